//! `spice-observer bench …` (hidden): the kernel-side helpers of `cargo xtask bench`.
//!
//! * `stats [--prefix P]`: one JSON line, every loaded BPF program whose name starts with `P`
//!   (default `spice_`) with its id and `bpf_prog_info` `run_time_ns` / `run_cnt` (non-zero
//!   only while `kernel.bpf_stats_enabled` is 1 or a `BPF_ENABLE_STATS` fd is held). Read with
//!   `BPF_PROG_GET_NEXT_ID` (aya's `loaded_programs()`, CAP_SYS_ADMIN), so it sees any
//!   process's programs, the observer's included. The kernel keeps 15 characters of a name
//!   (`BPF_OBJ_NAME_LEN`): `spice_ref_sys_enter` and `spice_ref_sys_exit` are both listed as
//!   `spice_ref_sys_e` (tell them apart by the ids `reference` prints).
//! * `reference [--hooks sys_enter,sys_exit,sock_send,sock_recv,floor,floor_steps] [--pid PID]
//!   [--duration SECS] [--only NAME]`:
//!   loads the kernel object and attaches only its reference programs (`spice-ebpf/src/
//!   probes/reference.rs`), prints `attached {json}` (their ids), holds them until stdin
//!   reaches EOF (or a line is read, or SECS pass), then prints their statistics as one JSON
//!   line (counts since the load, i.e. since the attach). `floor` is `spice_ref_floor`, the
//!   least a send call on a traced socket needs (filter, socket state, header read, record):
//!   it needs `--pid`, the process it treats as watched (in this load's own maps, which the
//!   observer never sees), and its records are drained and dropped here. `floor_steps` (also
//!   with `--pid`) is the floor stopped after each of its parts: `spice_ref_step1` to `_step7`.
//!   `--only NAME` attaches that one program alone: programs on one hook run in the order
//!   they were attached, and each one after the first finds the caches warmed by those
//!   before it (the socket, the task, the maps, the ring's next line), so a program's cost
//!   alone is measured with nothing else on its hook.
//! * `syscalls --kind getppid|pipe --calls N`: times N calls in this process (a process
//!   nobody watches) and prints `{"kind","calls","elapsed_s","ns_per_call"}`; `pipe` is one
//!   8-byte write and one 8-byte read on a pipe per call.
//! * `compare --report R.json --load L.json`: the observer's per-channel counts (a
//!   `--json` report, read into [`Report`]) against `spice-peer load`'s own (its final JSON
//!   line), channel by channel; prints one JSON line and exits 1 when any differs, a
//!   channel is missing, or information was lost (`events_lost` > 0).

use std::{
    io::{BufRead, Write},
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail};
use aya::{
    Btf, EbpfLoader,
    programs::{BtfTracePoint, RawTracePoint, loaded_programs},
};
use clap::{Args, Subcommand, ValueEnum};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::report::Report;

/// The hidden `bench` subcommand.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    cmd: BenchCmd,
}

#[derive(Debug, Subcommand)]
enum BenchCmd {
    /// Run time and run count of every loaded BPF program with a name prefix.
    Stats {
        #[arg(long, default_value = "spice_")]
        prefix: String,
    },
    /// Attach only the empty reference programs and hold them.
    Reference {
        /// Hooks to attach a reference program to.
        #[arg(long, value_enum, value_delimiter = ',', default_value = "sys_enter")]
        hooks: Vec<RefHook>,
        /// The process `floor` treats as watched.
        #[arg(long)]
        pid: Option<u32>,
        /// Detach after this many seconds at the latest.
        #[arg(long, default_value_t = 600.0)]
        duration: f64,
        /// Attach only the program of this name among those of `--hooks` (e.g.
        /// `spice_ref_step3`): alone on its hook, it runs first, on caches that no program
        /// before it on the same call has warmed.
        #[arg(long)]
        only: Option<String>,
    },
    /// Time a loop of syscalls in this (unwatched) process.
    Syscalls {
        #[arg(long, value_enum)]
        kind: SyscallKind,
        #[arg(long, default_value_t = 5_000_000)]
        calls: u64,
    },
    /// Compare an observer report with spice-peer load's counts.
    Compare {
        #[arg(long)]
        report: PathBuf,
        #[arg(long)]
        load: PathBuf,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum RefHook {
    #[value(name = "sys_enter")]
    SysEnter,
    #[value(name = "sys_exit")]
    SysExit,
    #[value(name = "sock_send")]
    SockSend,
    #[value(name = "sock_recv")]
    SockRecv,
    /// `spice_ref_floor` on `tp_btf/sock_send_length` (not empty: see the module doc).
    #[value(name = "floor")]
    Floor,
    /// `spice_ref_step1` … `spice_ref_step7` on `tp_btf/sock_send_length`: the floor program
    /// stopped after each of its parts (`probes::reference::floor` in spice-ebpf).
    #[value(name = "floor_steps")]
    FloorSteps,
}

impl RefHook {
    /// (program name in the object, hook) of each program this choice attaches.
    fn programs(self) -> &'static [(&'static str, &'static str)] {
        const SEND: &str = "tp_btf/sock_send_length";
        match self {
            RefHook::SysEnter => &[("spice_ref_sys_enter", "raw_tracepoint/sys_enter")],
            RefHook::SysExit => &[("spice_ref_sys_exit", "raw_tracepoint/sys_exit")],
            RefHook::SockSend => &[("spice_ref_sock_send", SEND)],
            RefHook::SockRecv => &[("spice_ref_sock_recv", "tp_btf/sock_recv_length")],
            RefHook::Floor => &[("spice_ref_floor", SEND)],
            RefHook::FloorSteps => &[
                ("spice_ref_step1", SEND),
                ("spice_ref_step2", SEND),
                ("spice_ref_step3", SEND),
                ("spice_ref_step4", SEND),
                ("spice_ref_step5", SEND),
                ("spice_ref_step6", SEND),
                ("spice_ref_step7", SEND),
            ],
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum SyscallKind {
    Getppid,
    Pipe,
}

/// Runs one `bench` helper.
pub fn run(args: BenchArgs) -> Result<()> {
    match args.cmd {
        BenchCmd::Stats { prefix } => {
            println!("{}", json!({ "programs": program_stats(&prefix)? }));
            Ok(())
        }
        BenchCmd::Reference {
            hooks,
            pid,
            duration,
            only,
        } => reference(&hooks, pid, duration, only.as_deref()),
        BenchCmd::Syscalls { kind, calls } => {
            let (elapsed, n) = time_syscalls(kind, calls)?;
            println!(
                "{}",
                json!({
                    "kind": format!("{kind:?}").to_lowercase(),
                    "calls": n,
                    "elapsed_s": elapsed.as_secs_f64(),
                    "ns_per_call": elapsed.as_nanos() as f64 / n as f64,
                })
            );
            Ok(())
        }
        BenchCmd::Compare { report, load } => {
            let rep: Report = serde_json::from_str(
                &std::fs::read_to_string(&report)
                    .with_context(|| format!("reading {}", report.display()))?,
            )
            .with_context(|| format!("parsing the observer report {}", report.display()))?;
            let text = std::fs::read_to_string(&load)
                .with_context(|| format!("reading {}", load.display()))?;
            let line = text
                .lines()
                .rev()
                .find(|l| l.starts_with('{'))
                .ok_or_else(|| anyhow!("{}: no JSON line", load.display()))?;
            let gen_: LoadReport = serde_json::from_str(line)
                .with_context(|| format!("parsing spice-peer load's report {}", load.display()))?;
            let out = compare(&Observed::of(&rep), &gen_);
            println!("{}", out.json);
            if !out.exact {
                std::process::exit(1);
            }
            Ok(())
        }
    }
}

/// (id, name, run_time_ns, run_cnt) of the loaded programs named `prefix…`.
fn program_stats(prefix: &str) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    for p in loaded_programs() {
        let p = match p {
            Ok(p) => p,
            // Unloaded between BPF_PROG_GET_NEXT_ID and BPF_PROG_GET_FD_BY_ID (ENOENT): another
            // process's programs come and go while this lists them.
            Err(e) if vanished(&e) => continue,
            Err(e) => {
                return Err(e)
                    .context("listing loaded BPF programs (BPF_PROG_GET_NEXT_ID needs root)");
            }
        };
        let Some(name) = p.name_as_str() else {
            continue;
        };
        if name.starts_with(prefix) {
            out.push(json!({
                "id": p.id(),
                "name": name,
                "run_time_ns": p.run_time().as_nanos() as u64,
                "run_cnt": p.run_count(),
            }));
        }
    }
    Ok(out)
}

/// Whether `e` (from aya's `loaded_programs`) is a program that was unloaded while it was
/// being listed: an `ENOENT` anywhere in its sources.
fn vanished(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io.raw_os_error() == Some(libc::ENOENT)
        {
            return true;
        }
        cur = err.source();
    }
    false
}

fn reference(hooks: &[RefHook], pid: Option<u32>, duration: f64, only: Option<&str>) -> Result<()> {
    if hooks.is_empty() {
        bail!("give at least one hook");
    }
    let floor = hooks.contains(&RefHook::Floor);
    let watched = floor || hooks.contains(&RefHook::FloorSteps);
    if watched && pid.is_none() {
        bail!("--hooks floor and floor_steps need --pid: the process they treat as watched");
    }
    // The floor program reads struct offsets from the config, as the observer's programs do.
    let config = crate::btf::KernelBtf::open(std::path::Path::new(crate::btf::VMLINUX_BTF))?
        .kernel_config()?;
    let mut ebpf = EbpfLoader::new()
        .override_global("CONFIG", &config, true)
        .load(crate::loader::EBPF_OBJECT)
        .context("loading the eBPF object")?;
    if let (true, Some(pid)) = (watched, pid) {
        use spice_ebpf_common::config::watch;
        aya::maps::Array::<_, u8>::try_from(
            ebpf.map_mut("MAYBE_WATCHED").context("map MAYBE_WATCHED")?,
        )?
        .set(watch::filter_index(pid), 1, 0)?;
        aya::maps::HashMap::<_, u32, u32>::try_from(
            ebpf.map_mut("WATCHED_TGIDS").context("map WATCHED_TGIDS")?,
        )?
        .insert(pid, (pid & watch::ROOT_MASK) | watch::PRIMARY, 0)?;
    }
    let btf = Btf::from_sys_fs().context("loading kernel BTF")?;
    let mut ids = Vec::new();
    let programs: Vec<_> = hooks
        .iter()
        .flat_map(|h| h.programs())
        .filter(|(name, _)| only.is_none_or(|o| o == *name))
        .collect();
    if let (Some(o), true) = (only, programs.is_empty()) {
        bail!("--only {o}: no such program among those of --hooks {hooks:?}");
    }
    for &&(name, hook) in &programs {
        let prog = ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("program {name} missing from the object"))?;
        let id = if let Some(tp) = hook.strip_prefix("raw_tracepoint/") {
            let p: &mut RawTracePoint = prog.try_into()?;
            p.load()
                .with_context(|| format!("loading {name} ({hook})"))?;
            p.attach(tp).with_context(|| format!("attaching {name}"))?;
            p.info()?.id()
        } else {
            let tp = &hook["tp_btf/".len()..];
            let p: &mut BtfTracePoint = prog.try_into()?;
            p.load(tp, &btf)
                .with_context(|| format!("loading {name} ({hook})"))?;
            p.attach().with_context(|| format!("attaching {name}"))?;
            p.info()?.id()
        };
        ids.push(json!({"name": name, "hook": hook, "id": id}));
    }
    println!("attached {}", json!({ "programs": ids }));
    std::io::stdout().flush()?;
    // Held until stdin ends (or a line comes) or the duration passes; the floor program's
    // records are drained meanwhile (a full ring would make its reserve fail, cheaper than
    // the observer's).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::stdin().lock().read_line(&mut line);
        let _ = tx.send(());
    });
    // (spice_ref_step7 reserves records too.)
    let mut ring = match watched {
        true => Some(aya::maps::RingBuf::try_from(
            ebpf.take_map("EVENTS").context("map EVENTS")?,
        )?),
        false => None,
    };
    let until = Instant::now() + Duration::from_secs_f64(duration.max(0.0));
    loop {
        let wait = until
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(20));
        match rx.recv_timeout(wait) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) if Instant::now() < until => {}
            _ => break,
        }
        if let Some(r) = ring.as_mut() {
            while r.next().is_some() {}
        }
    }
    let wanted: Vec<u32> = ids
        .iter()
        .filter_map(|v| v["id"].as_u64())
        .map(|i| i as u32)
        .collect();
    let stats: Vec<Value> = program_stats("spice_ref")?
        .into_iter()
        .filter(|v| {
            v["id"]
                .as_u64()
                .is_some_and(|i| wanted.contains(&(i as u32)))
        })
        .collect();
    println!("{}", json!({ "programs": stats }));
    drop(ebpf);
    Ok(())
}

/// Runs `calls` syscalls of `kind`; returns the elapsed time and the calls made.
fn time_syscalls(kind: SyscallKind, calls: u64) -> Result<(Duration, u64)> {
    if calls == 0 {
        bail!("--calls must be at least 1");
    }
    match kind {
        SyscallKind::Getppid => {
            let t0 = Instant::now();
            for _ in 0..calls {
                // SAFETY: getppid has no arguments and cannot fail.
                std::hint::black_box(unsafe { libc::getppid() });
            }
            Ok((t0.elapsed(), calls))
        }
        SyscallKind::Pipe => {
            let mut fds = [0i32; 2];
            // SAFETY: a valid two-int array.
            if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
                bail!("pipe: {}", std::io::Error::last_os_error());
            }
            let mut buf = [0u8; 8];
            let t0 = Instant::now();
            for _ in 0..calls {
                // SAFETY: 8 bytes from / into a live 8-byte buffer on our own pipe; one
                // write of 8 bytes always fits an empty pipe, so neither call blocks.
                let (w, r) = unsafe {
                    (
                        libc::write(fds[1], buf.as_ptr().cast(), 8),
                        libc::read(fds[0], buf.as_mut_ptr().cast(), 8),
                    )
                };
                if w != 8 || r != 8 {
                    bail!("pipe write/read returned {w}/{r}");
                }
            }
            let e = t0.elapsed();
            // SAFETY: closing our own descriptors.
            unsafe {
                libc::close(fds[0]);
                libc::close(fds[1]);
            }
            Ok((e, calls))
        }
    }
}

/// The fields of `spice-peer load`'s final JSON line the comparison reads (missing ones fail
/// the parse).
#[derive(Debug, Deserialize)]
struct LoadReport {
    server_pid: u32,
    window: u32,
    /// Messages per write call.
    batch: u64,
    ok: bool,
    channels: Vec<LoadChannel>,
}

#[derive(Debug, Deserialize)]
struct LoadChannel {
    session: u32,
    channel_id: u8,
    local_addr: String,
    peer_addr: String,
    messages_sent: u64,
    bytes_sent: u64,
    acks_received: u64,
    ack_syncs_received: u64,
    messages_received: u64,
    bytes_received: u64,
    messages_received_by_client: u64,
    acks_sent_by_client: u64,
}

struct Comparison {
    exact: bool,
    json: Value,
}

/// What the comparison reads of the observer's report (one line per channel), taken from
/// the typed [`Report`].
#[derive(Clone, Debug, Default)]
struct Observed {
    events_lost: u64,
    hook_set: String,
    degraded: Vec<String>,
    channels: Vec<ObservedChannel>,
}

#[derive(Clone, Debug, Default)]
struct ObservedChannel {
    socket: String,
    pid: u32,
    framing: String,
    window: Option<u32>,
    messages_sent: u64,
    bytes_sent: u64,
    messages_received: u64,
    bytes_received: u64,
    acks: u64,
    ack_syncs: u64,
    set_acks: u64,
    /// The kernel window's peak, its starts above 2W and its ACKs that found fewer than W
    /// messages counted (see [`compare`]).
    in_flight_max: u64,
    starts_while_stalled: u64,
    ack_surplus: u64,
}

impl Observed {
    fn of(rep: &Report) -> Observed {
        Observed {
            events_lost: rep.events_lost,
            hook_set: rep.hook_set.clone(),
            degraded: rep.degraded.clone(),
            channels: rep
                .channels
                .iter()
                .map(|c| ObservedChannel {
                    socket: c.socket.clone(),
                    pid: c.pid,
                    framing: c.framing.clone(),
                    window: c.window,
                    messages_sent: c.messages_sent,
                    bytes_sent: c.bytes_sent,
                    messages_received: c.messages_received,
                    bytes_received: c.bytes_received,
                    acks: c.acks,
                    ack_syncs: c.ack_syncs,
                    set_acks: c.set_acks,
                    in_flight_max: c.in_flight_max.map_or(0, |m| m.max(0) as u64),
                    starts_while_stalled: c.starts_while_stalled,
                    ack_surplus: c.ack_surplus,
                })
                .collect(),
        }
    }
}

/// The observer's counts against the generator's, channel by channel: messages and bytes
/// each way, ACKs and ACK_SYNCs, one SET_ACK of the generator's W, framing `mini`; and its
/// window against the generator's gate (spice-server's rule: no start once more than 2W are
/// unacknowledged, so at most 2W+1 in flight).
///
/// The generator writes and reads each connection from two threads, so this checks that the
/// two directions' concurrent updates of the kernel's window state lose nothing (before the
/// window lock, a run of 10 messages per call reached 285 in flight). One effect of the two
/// threads is legitimate: the kernel counts a write's messages when the call returns, and an
/// ACK for them can be read on the other thread before that (loopback delivers during the
/// call). Such an ACK finds fewer than W counted (the observer's `ack_surplus`), the count
/// stops at 0, and it stays high by at most the messages of one call from then on. So: with
/// no such ACK, at most 2W+1 and no start above 2W; with one, at most 2W+1 + the batch.
fn compare(rep: &Observed, gen_: &LoadReport) -> Comparison {
    let mut exact = gen_.ok && rep.events_lost == 0;
    let mut rows = Vec::new();
    let mut problems: Vec<String> = Vec::new();
    if !gen_.ok {
        problems.push("spice-peer load reported a failure or a disagreement of its own".into());
    }
    if rep.events_lost != 0 {
        problems.push(format!("events_lost = {}", rep.events_lost));
    }
    for g in &gen_.channels {
        let socket = format!("{}->{}", g.local_addr, g.peer_addr);
        let Some(c) = rep
            .channels
            .iter()
            .find(|c| c.socket == socket && c.pid == gen_.server_pid)
        else {
            exact = false;
            problems.push(format!("{socket}: not in the observer's report"));
            rows.push(
                json!({"socket": socket, "session": g.session, "channel_id": g.channel_id,
                             "observed": false}),
            );
            continue;
        };
        let pairs: [(&str, u64, u64); 7] = [
            ("messages_sent", g.messages_sent, c.messages_sent),
            ("bytes_sent", g.bytes_sent, c.bytes_sent),
            (
                "messages_received",
                g.messages_received,
                c.messages_received,
            ),
            ("bytes_received", g.bytes_received, c.bytes_received),
            ("acks", g.acks_received, c.acks),
            ("ack_syncs", g.ack_syncs_received, c.ack_syncs),
            ("set_acks", 1, c.set_acks),
        ];
        let mut diffs: Vec<String> = pairs
            .iter()
            .filter(|(_, a, b)| a != b)
            .map(|(k, a, b)| format!("{k}: load {a}, observer {b}"))
            .collect();
        if g.messages_sent != g.messages_received_by_client
            || g.acks_received != g.acks_sent_by_client
        {
            diffs.push("the generator's two ends disagree".into());
        }
        if c.framing != "mini" {
            diffs.push(format!("framing {}", c.framing));
        }
        if c.window != Some(gen_.window) {
            diffs.push(format!("window {:?}, load {}", c.window, gen_.window));
        }
        let gate = 2 * gen_.window as u64 + 1;
        let (limit, starts_ok) = if c.ack_surplus == 0 {
            (gate, c.starts_while_stalled == 0)
        } else {
            (gate + gen_.batch, true)
        };
        if c.in_flight_max > limit || !starts_ok {
            diffs.push(format!(
                "window: in flight up to {} ({} start(s) above 2W, {} early ACK(s)); the \
                 generator's gate keeps it at {gate}, at most {limit} here: an update of the \
                 kernel's window was lost",
                c.in_flight_max, c.starts_while_stalled, c.ack_surplus
            ));
        }
        if !diffs.is_empty() {
            exact = false;
            problems.push(format!("{socket}: {}", diffs.join(", ")));
        }
        rows.push(json!({
            "socket": socket, "session": g.session, "channel_id": g.channel_id, "observed": true,
            "load": {"messages_sent": g.messages_sent, "bytes_sent": g.bytes_sent,
                     "messages_received": g.messages_received, "bytes_received": g.bytes_received,
                     "acks": g.acks_received, "ack_syncs": g.ack_syncs_received},
            "observer": {"messages_sent": c.messages_sent, "bytes_sent": c.bytes_sent,
                         "messages_received": c.messages_received,
                         "bytes_received": c.bytes_received, "acks": c.acks,
                         "ack_syncs": c.ack_syncs, "set_acks": c.set_acks,
                         "framing": c.framing, "window": c.window,
                         "in_flight_max": c.in_flight_max,
                         "starts_while_stalled": c.starts_while_stalled,
                         "ack_surplus": c.ack_surplus},
            "equal": diffs.is_empty(),
        }));
    }
    Comparison {
        exact,
        json: json!({
            "exact": exact,
            "events_lost": rep.events_lost,
            "hook_set": rep.hook_set,
            "degraded": rep.degraded,
            "channels": rows,
            "problems": problems,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_unloaded_while_listed_is_skipped_other_errors_are_not() {
        let err = |errno| {
            aya::programs::ProgramError::SyscallError(aya::sys::SyscallError {
                call: "bpf_prog_get_fd_by_id",
                io_error: std::io::Error::from_raw_os_error(errno),
            })
        };
        assert!(vanished(&err(libc::ENOENT)));
        assert!(!vanished(&err(libc::EPERM)));
    }

    fn load() -> LoadReport {
        serde_json::from_value(json!({
            "server_pid": 7, "window": 20, "batch": 1, "ok": true,
            "channels": [{
                "session": 0, "channel_id": 0,
                "local_addr": "127.0.0.1:1", "peer_addr": "127.0.0.1:2",
                "messages_sent": 41, "bytes_sent": 41 * 206,
                "acks_received": 2, "ack_syncs_received": 1,
                "messages_received": 3, "bytes_received": 22,
                "messages_received_by_client": 41, "acks_sent_by_client": 2,
            }],
        }))
        .unwrap()
    }

    fn observed() -> Observed {
        Observed {
            channels: vec![ObservedChannel {
                socket: "127.0.0.1:1->127.0.0.1:2".into(),
                pid: 7,
                framing: "mini".into(),
                window: Some(20),
                messages_sent: 41,
                bytes_sent: 41 * 206,
                messages_received: 3,
                bytes_received: 22,
                acks: 2,
                ack_syncs: 1,
                set_acks: 1,
                in_flight_max: 41,
                starts_while_stalled: 0,
                ack_surplus: 0,
            }],
            ..Default::default()
        }
    }

    #[test]
    fn equal_counts_are_exact() {
        let c = compare(&observed(), &load());
        assert!(c.exact, "{}", c.json);
        assert_eq!(c.json["channels"][0]["equal"], true);
    }

    /// The first problem `compare` finds in `o`, which must not be exact.
    fn first_problem(o: &Observed) -> String {
        let c = compare(o, &load());
        assert!(!c.exact, "{}", c.json);
        c.json["problems"][0].as_str().unwrap().to_string()
    }

    #[test]
    fn every_difference_fails() {
        let mut o = observed();
        o.channels[0].messages_sent = 40;
        assert!(first_problem(&o).contains("messages_sent: load 41, observer 40"));
        let mut o = observed();
        o.events_lost = 1;
        assert!(!compare(&o, &load()).exact);
        let mut o = observed();
        o.channels[0].pid = 8; // another process's socket with the same addresses
        let c = compare(&o, &load());
        assert!(!c.exact);
        assert_eq!(c.json["channels"][0]["observed"], false);
        let mut o = observed();
        o.channels[0].framing = "hunting".into();
        assert!(!compare(&o, &load()).exact);
        // The window past the generator's gate (2W+1 = 41): a lost update of the kernel's
        // window state.
        let mut o = observed();
        o.channels[0].in_flight_max = 42;
        assert!(!compare(&o, &load()).exact);
        let mut o = observed();
        o.channels[0].starts_while_stalled = 3;
        assert!(first_problem(&o).contains("3 start(s) above 2W"));
        // An ACK read before its messages' write returned: 2W+1 + one call's messages.
        let mut o = observed();
        o.channels[0].ack_surplus = 1;
        o.channels[0].starts_while_stalled = 3;
        o.channels[0].in_flight_max = 42;
        assert!(compare(&o, &load()).exact);
        o.channels[0].in_flight_max = 43;
        assert!(!compare(&o, &load()).exact);
        let mut g = load();
        g.ok = false;
        assert!(!compare(&observed(), &g).exact);
        // A missing field of the generator's line fails the parse, not the comparison.
        assert!(serde_json::from_value::<LoadReport>(json!({"server_pid": 7})).is_err());
    }
}
