//! The BPF stack each program's deepest call chain needs, read from the compiled object: a
//! check that the programs stay within the verifier's limit on every kernel they may meet,
//! not only on the one the tests run on.
//!
//! The verifier adds up the stack of every frame on a chain of BPF-to-BPF calls, `bpf_loop`
//! callbacks included, and refuses a program whose deepest chain needs more than 512 bytes
//! (`MAX_BPF_STACK`; "combined stack size of N calls is M. Too large",
//! `check_max_stack_depth_subprog` in kernel/bpf/verifier.c). Each frame is rounded up: to 16
//! bytes for a JITed program since Linux 6.9, to 32 bytes (at least 32, even for a frame of
//! none) before that (`round_up_stack_depth`). Linux 6.13 gives tracepoint programs a
//! private stack per frame instead on x86-64, which is why a program over the limit can load
//! on this machine; a uprobe program gets none (seen on 6.18), and older kernels have none at
//! all. So the check uses the strict rule: 32-byte rounding, every frame counted.
//!
//! A frame's depth is the deepest `r10`-relative access in it (loads, stores, and addresses
//! `r10 - N` handed to helpers), as the verifier records it. Calls are `call` instructions
//! with the BPF_PSEUDO_CALL source (resolved through the object's relocations, or relative
//! within a section); callbacks are function addresses loaded by `ld_imm64` with a
//! relocation into an executable section (`bpf_loop`'s callback).

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget, SectionIndex, SymbolKind};

    use crate::kernel::loader::EBPF_OBJECT;

    /// The verifier's limit on a call chain's stack (`MAX_BPF_STACK`).
    const MAX_BPF_STACK: u32 = 512;

    /// One function of the object: its section and instruction range, its own stack depth
    /// and the functions it calls.
    struct Func {
        name: String,
        program: bool,
        stack: u32,
        callees: Vec<usize>,
    }

    /// A frame's size as kernels before 6.9 count it (`round_up(max(depth, 1), 32)`).
    fn rounded(depth: u32) -> u32 {
        depth.max(1).div_ceil(32) * 32
    }

    fn functions(bytes: &[u8]) -> Vec<Func> {
        let file = object::File::parse(bytes).expect("the BPF object parses as ELF");
        // (section, first instruction, end) of every function symbol.
        let mut spans: Vec<(SectionIndex, usize, usize, String, bool)> = Vec::new();
        for sym in file.symbols() {
            let (Some(sec), SymbolKind::Text) = (sym.section_index(), sym.kind()) else {
                continue;
            };
            if sym.size() == 0 {
                continue;
            }
            let section = file.section_by_index(sec).expect("symbol's section");
            let program = section.name().is_ok_and(|n| n != ".text");
            let start = (sym.address() / 8) as usize;
            let end = ((sym.address() + sym.size()) / 8) as usize;
            spans.push((
                sec,
                start,
                end,
                sym.name().unwrap_or("?").to_string(),
                program,
            ));
        }
        let at = |sec: SectionIndex, insn: usize| {
            spans
                .iter()
                .position(|&(s, a, b, _, _)| s == sec && a <= insn && insn < b)
        };
        let mut funcs = Vec::new();
        for &(sec, start, end, ref name, program) in &spans {
            let section = file.section_by_index(sec).unwrap();
            let data = section.data().expect("section data");
            // Relocations of this section by instruction: the target symbol's section and
            // address.
            let relocs: HashMap<usize, (Option<SectionIndex>, u64)> = section
                .relocations()
                .filter_map(|(off, r)| match r.target() {
                    RelocationTarget::Symbol(i) => {
                        let s = file.symbol_by_index(i).ok()?;
                        Some(((off / 8) as usize, (s.section_index(), s.address())))
                    }
                    _ => None,
                })
                .collect();
            let executable = |s: Option<SectionIndex>| {
                s.and_then(|s| file.section_by_index(s).ok())
                    .is_some_and(|s| s.kind() == object::SectionKind::Text)
            };
            let mut stack = 0u32;
            let mut callees = Vec::new();
            let mut frame_ptr = [false; 11];
            let mut i = start;
            while i < end {
                let b = &data[i * 8..i * 8 + 8];
                let (op, dst, src) = (b[0], (b[1] & 0xf) as usize, (b[1] >> 4) as usize);
                let off = i16::from_le_bytes([b[2], b[3]]) as i32;
                let imm = i32::from_le_bytes([b[4], b[5], b[6], b[7]]);
                let class = op & 7;
                // ST / STX to r10 - N, LDX from r10 - N.
                if ((class == 2 || class == 3) && dst == 10 || class == 1 && src == 10) && off < 0 {
                    stack = stack.max((-off) as u32);
                }
                // rX = r10, then rX += -N: a stack address for a helper.
                if dst < 11 {
                    if op == 0xbf {
                        frame_ptr[dst] = src == 10;
                    } else if op == 0x07 && frame_ptr[dst] {
                        if imm < 0 {
                            stack = stack.max(imm.unsigned_abs());
                        }
                        frame_ptr[dst] = false;
                    } else if class == 4 || class == 7 || class == 1 || op == 0x18 {
                        frame_ptr[dst] = false;
                    }
                }
                if op == 0x85 && src == 1 {
                    let target = match relocs.get(&i) {
                        Some(&(s, addr)) => s.map(|s| (s, (addr / 8) as i64 + imm as i64 + 1)),
                        None => Some((sec, i as i64 + imm as i64 + 1)),
                    };
                    if let Some((s, t)) = target
                        && let Some(f) = at(s, t as usize)
                    {
                        callees.push(f);
                    }
                }
                if op == 0x18 {
                    if let Some(&(s, addr)) = relocs.get(&i)
                        && executable(s)
                        && let Some(f) = at(s.unwrap(), ((addr as i64 + imm as i64) / 8) as usize)
                    {
                        callees.push(f);
                    }
                    i += 1;
                }
                i += 1;
            }
            callees.sort_unstable();
            callees.dedup();
            funcs.push(Func {
                name: name.clone(),
                program,
                stack,
                callees,
            });
        }
        funcs
    }

    /// The deepest chain from `f`: its bytes (frames rounded) and the functions on it.
    fn deepest(funcs: &[Func], f: usize, seen: &mut Vec<usize>) -> (u32, Vec<String>) {
        seen.push(f);
        let mut best = (0, Vec::new());
        for &c in &funcs[f].callees {
            if seen.contains(&c) {
                continue;
            }
            let d = deepest(funcs, c, seen);
            if d.0 > best.0 {
                best = d;
            }
        }
        seen.pop();
        let mut chain = vec![format!("{} {}", short(&funcs[f].name), funcs[f].stack)];
        chain.extend(best.1);
        (rounded(funcs[f].stack) + best.0, chain)
    }

    /// The last path segment of a mangled Rust name (`…7capture4step` → `step`), for the
    /// message; a program's unmangled name as it is.
    fn short(name: &str) -> &str {
        let tail = name.trim_end_matches(|c: char| c.is_ascii_alphabetic() || c == '_');
        if tail.is_empty() || !tail.ends_with(|c: char| c.is_ascii_digit()) {
            return name;
        }
        &name[tail.len()..]
    }

    /// Every program of the object fits the verifier's stack limit under the strict rule
    /// (32-byte frames, no private stacks), so it loads on every kernel the hooks exist on.
    /// Fails if the code or the toolchain (Debian's LLVM is not pinned) makes one chain too
    /// deep, with the chain in the message. The programs' own frames are all read (a program
    /// with no stack access at all would mean the decoder missed them).
    #[test]
    fn every_call_chain_fits_the_bpf_stack() {
        let funcs = functions(EBPF_OBJECT);
        let programs: Vec<usize> = (0..funcs.len()).filter(|&i| funcs[i].program).collect();
        assert!(
            programs.len() >= 15,
            "{} programs found in the object",
            programs.len()
        );
        let send = funcs
            .iter()
            .position(|f| f.name == "spice_sock_send")
            .expect("spice_sock_send");
        assert!(
            funcs[send].stack > 0,
            "no stack access decoded in spice_sock_send"
        );
        let mut report = Vec::new();
        let mut over = Vec::new();
        for &p in &programs {
            let (depth, chain) = deepest(&funcs, p, &mut Vec::new());
            let line = format!("{} {depth}: {}", funcs[p].name, chain.join(" > "));
            if depth > MAX_BPF_STACK {
                over.push(line.clone());
            }
            report.push(line);
        }
        println!("{}", report.join("\n"));
        assert!(
            over.is_empty(),
            "call chains over {MAX_BPF_STACK} bytes (32-byte frames):\n{}",
            over.join("\n")
        );
    }
}
