//! Kernel struct offsets for the kernel programs, read from the running kernel's BTF.
//!
//! Rust eBPF programs get no CO-RE relocations, so every `struct sock`, `struct tcp_sock` and
//! `struct task_struct` field they read is located here, at start-up, with the `btfparse`
//! crate, and passed in through [`KernelConfig`].

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use btfparse::{Offset, Readable, TypeInformation, TypeVariant};
use spice_ebpf_common::config::{KernelConfig, hook_set};

/// Where the kernel exposes its own BTF.
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

struct Bytes(Vec<u8>);

impl Readable for Bytes {
    fn read(&self, offset: u64, buffer: &mut [u8]) -> btfparse::Result<()> {
        let start = offset as usize;
        match self.0.get(start..start + buffer.len()) {
            Some(src) => {
                buffer.copy_from_slice(src);
                Ok(())
            }
            None => Err(btfparse::Error::new(
                btfparse::ErrorKind::IOError,
                "read past the end of the BTF blob",
            )),
        }
    }
}

/// Parsed kernel BTF with a byte-offset lookup.
pub struct KernelBtf {
    info: TypeInformation,
}

impl KernelBtf {
    /// Parses the BTF file at `path` (normally [`VMLINUX_BTF`]).
    ///
    /// Errors if the file is missing (kernel built without `CONFIG_DEBUG_INFO_BTF`) or unparsable.
    pub fn open(path: &Path) -> Result<Self> {
        let data = std::fs::read(path).with_context(|| {
            format!(
                "reading {} (the kernel needs CONFIG_DEBUG_INFO_BTF=y)",
                path.display()
            )
        })?;
        let info = TypeInformation::new(&Bytes(data))
            .map_err(|e| anyhow!("parsing {}: {e:?}", path.display()))?;
        Ok(Self { info })
    }

    /// Byte offset of `path` (dotted members, anonymous members resolved) inside `struct ty`.
    ///
    /// Errors if the type or member does not exist, or if the member is a bitfield.
    pub fn offset(&self, ty: &str, path: &str) -> Result<u32> {
        let tid = self
            .info
            .id_of(ty)
            .ok_or_else(|| anyhow!("kernel BTF has no type `{ty}`"))?;
        let (_, off) = self
            .info
            .offset_of(tid, path)
            .map_err(|e| anyhow!("kernel BTF: `{ty}.{path}`: {e:?}"))?;
        match off {
            Offset::ByteOffset(b) => Ok(b),
            Offset::BitOffsetAndSize(bit, size) => {
                if bit % 8 == 0 && size % 8 == 0 {
                    Ok(bit / 8)
                } else {
                    bail!("kernel BTF: `{ty}.{path}` is a bitfield (bit {bit}, {size} bits)")
                }
            }
        }
    }

    /// True if the BTF has a typedef named `name`. The kernel defines `btf_trace_<event>` for
    /// every tracepoint it has (include/trace/bpf_probe.h), and `tp_btf` / `raw_tracepoint`
    /// programs attach through it: a missing one means the kernel lacks that tracepoint.
    /// Scans every type (a typedef may share its name with another kind of type).
    pub fn has_typedef(&self, name: &str) -> bool {
        self.info
            .get()
            .values()
            .any(|t| matches!(t, TypeVariant::Typedef(td) if td.name().as_deref() == Some(name)))
    }

    /// True if the BTF has a function named `name` (a `BTF_KIND_FUNC`): one that fentry/fexit
    /// programs can attach to.
    pub fn has_function(&self, name: &str) -> bool {
        self.info
            .get()
            .values()
            .any(|t| matches!(t, TypeVariant::Func(f) if f.name().as_deref() == Some(name)))
    }

    /// Number of parameters of function `name` (the prototype of its `BTF_KIND_FUNC`), `None`
    /// if the BTF has no such function.
    pub fn function_params(&self, name: &str) -> Option<usize> {
        let proto = self.info.get().values().find_map(|t| match t {
            TypeVariant::Func(f) if f.name().as_deref() == Some(name) => Some(f.prototype_tid()),
            _ => None,
        })?;
        match self.info.from_id(*proto)? {
            TypeVariant::FuncProto(p) => Some(p.parameter_list().len()),
            _ => None,
        }
    }

    /// Fills every offset of [`KernelConfig`]; `self_tgid` is set to this process and
    /// `ring_wakeup_bytes` to the machine's share for its possible CPUs
    /// (`/sys/devices/system/cpu/possible`, as per-CPU maps count them); `hook_set` is
    /// [`hook_set::TRACEPOINTS`] (the loader sets the one it loads).
    pub fn kernel_config(&self) -> Result<KernelConfig> {
        let sk = |p: &str| self.offset("sock", p);
        let tp = |p: &str| self.offset("tcp_sock", p);
        let task = |p: &str| self.offset("task_struct", p);
        Ok(KernelConfig {
            self_tgid: std::process::id(),
            ring_wakeup_bytes: spice_ebpf_common::config::ring::wakeup_bytes_per_cpu(
                aya::util::nr_cpus().map_or(1, |n| n as u32),
            ),
            skc_family: sk("__sk_common.skc_family")?,
            skc_num: sk("__sk_common.skc_num")?,
            skc_dport: sk("__sk_common.skc_dport")?,
            skc_rcv_saddr: sk("__sk_common.skc_rcv_saddr")?,
            skc_daddr: sk("__sk_common.skc_daddr")?,
            skc_v6_rcv_saddr: sk("__sk_common.skc_v6_rcv_saddr")?,
            skc_v6_daddr: sk("__sk_common.skc_v6_daddr")?,
            sk_protocol: sk("sk_protocol")?,
            sk_type: sk("sk_type")?,
            tcp_write_seq: tp("write_seq")?,
            tcp_snd_nxt: tp("snd_nxt")?,
            tcp_snd_una: tp("snd_una")?,
            tcp_rcv_nxt: tp("rcv_nxt")?,
            tcp_copied_seq: tp("copied_seq")?,
            tcp_snd_cwnd: tp("snd_cwnd")?,
            tcp_srtt_us: tp("srtt_us")?,
            tcp_packets_out: tp("packets_out")?,
            tcp_total_retrans: tp("total_retrans")?,
            task_pid: task("pid")?,
            task_tgid: task("tgid")?,
            sk_socket: sk("sk_socket")?,
            socket_file: self.offset("socket", "file")?,
            hook_set: hook_set::TRACEPOINTS,
            skc_cookie: sk("__sk_common.skc_cookie")?,
            task_files: task("files")?,
            files_fdt: self.offset("files_struct", "fdt")?,
            fdtable_max_fds: self.offset("fdtable", "max_fds")?,
            fdtable_fd: self.offset("fdtable", "fd")?,
            file_private_data: self.offset("file", "private_data")?,
            socket_sk: self.offset("socket", "sk")?,
            // Without the function in BTF, fentry cannot attach; kprobes then assume 5.19+.
            tcp_recvmsg_args: self.function_params("tcp_recvmsg").unwrap_or(5) as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads this machine's BTF; skipped (loudly) where the kernel has none.
    #[test]
    fn offsets_resolve_on_this_kernel() {
        let path = Path::new(VMLINUX_BTF);
        if !path.exists() {
            eprintln!("SKIP: {VMLINUX_BTF} missing (kernel without CONFIG_DEBUG_INFO_BTF)");
            return;
        }
        let btf = KernelBtf::open(path).unwrap();
        let c = btf.kernel_config().unwrap();
        // struct sock starts with struct sock_common; skc_daddr is its first member.
        assert_eq!(c.skc_daddr, 0);
        assert_eq!(c.skc_rcv_saddr, 4);
        // tcp_sendmsg(sk, msg, size) on every kernel; tcp_recvmsg has 4 to 6 (see
        // KernelConfig::tcp_recvmsg_args): held against bpftool's dump of the same BTF.
        assert_eq!(btf.function_params("tcp_sendmsg"), Some(3));
        assert!(
            matches!(c.tcp_recvmsg_args, 4..=6),
            "{}",
            c.tcp_recvmsg_args
        );
        match std::process::Command::new("bpftool")
            .args(["btf", "dump", "file", VMLINUX_BTF, "format", "raw"])
            .output()
        {
            Ok(o) if o.status.success() => {
                let dump = String::from_utf8_lossy(&o.stdout);
                let proto = dump
                    .lines()
                    .find_map(|l| {
                        l.split_once("] FUNC 'tcp_recvmsg' type_id=")
                            .and_then(|(_, r)| r.split_whitespace().next())
                    })
                    .expect("bpftool lists FUNC tcp_recvmsg");
                let vlen = dump
                    .lines()
                    .find_map(|l| {
                        l.strip_prefix(&format!("[{proto}] FUNC_PROTO "))
                            .and_then(|r| r.split("vlen=").nth(1))
                    })
                    .expect("bpftool lists its FUNC_PROTO");
                assert_eq!(c.tcp_recvmsg_args.to_string(), vlen.trim());
            }
            _ if std::env::var_os("CI").is_some() => panic!("bpftool btf dump failed (CI)"),
            _ => eprintln!("SKIP: no bpftool to check tcp_recvmsg's parameters against"),
        }
        assert_eq!(btf.function_params("no_such_function_here"), None);
        assert!(
            c.tcp_write_seq > 1000,
            "tcp_sock members sit after inet_connection_sock"
        );
        assert_ne!(c.task_pid, c.task_tgid);
        assert!(c.sk_socket > 0 && c.socket_file > 0, "{c:?}");
        // The fd chain of hook set `syscalls` (include/linux/fdtable.h: max_fds first).
        assert_eq!(c.fdtable_max_fds, 0);
        assert!(
            c.task_files > 0 && c.files_fdt > 0 && c.fdtable_fd > 0,
            "{c:?}"
        );
        assert!(c.file_private_data > 0 && c.socket_sk > 0, "{c:?}");
        assert!(c.skc_cookie > c.skc_family, "{c:?}");
    }
}
