//! Loads and attaches the kernel programs, and gives typed access to their maps.
//!
//! Two hook sets for the socket calls ([`HookSet`], chosen by [`choose_hook_set`]):
//! `tracepoints`, `tp_btf/sock_send_length` and `tp_btf/sock_recv_length` (Linux 6.3+), and
//! `syscalls`, `raw_tracepoint/sys_exit` (for older kernels; every syscall of the host pays
//! its filter). Both with `tp_btf/sched_process_fork`, `tp_btf/sched_process_exit`,
//! `tp_btf/inet_sock_set_state`, `tp_btf/tcp_destroy_sock`, plus `sock_ops` on the cgroup-v2
//! root when a cgroup2 mount exists (then the hook set is reported as
//! `tracepoints+sockops`), plus the libssl uprobes
//! ([`crate::kernel::tls::PROGRAMS`], `+libssl`): loaded here with the others, but attached
//! per watched process only, by the front ends ([`crate::kernel::tls::TlsHooks`], through
//! this module's [`tls::Host`] implementation of [`Capture`]). A kernel without the `kprobe`
//! program type or the `uprobe` PMU only loses them (listed in [`Capture::degraded`]).
//!
//! Before loading each program the kernel is probed for what it needs, independently of the
//! load: the program type (`aya::sys::is_program_supported`) and, for tracepoints, the
//! `btf_trace_<event>` typedef in the kernel's BTF. Only a probe that finds the feature
//! missing gives an error containing [`UNAVAILABLE`] ("… is not available on this kernel");
//! every other failure (permission, a verifier rejection, an attach error, a probe that could
//! not decide) is a hard error with the kernel's message, never that phrase.

use std::{
    collections::HashMap as StdHashMap,
    fs::File,
    num::NonZeroU32,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, anyhow, bail};
use aya::{
    Btf, Ebpf, EbpfLoader,
    maps::{Array, HashMap, Map, MapData, PerCpuArray, RingBuf},
    programs::{
        BtfTracePoint, FExit, KProbe, ProbeKind, ProgramError, ProgramType, RawTracePoint, SockOps,
        UProbe,
        links::{CgroupAttachMode, FdLink, PinnedLink},
        uprobe::{UProbeLink, UProbeScope},
    },
    sys::is_program_supported,
};
use log::{debug, warn};
use spice_ebpf_common::{
    config::{KernelConfig, LAYOUT_VERSION, counter, hook_set, layout, watch},
    event::{MessageEvent, SockState, TcpSnapshot},
};

use crate::btf::{KernelBtf, VMLINUX_BTF};
use crate::kernel::{kretprobe, tls};

/// The compiled kernel programs (built by `build.rs` with bpf-linker).
pub(crate) static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/spice-ebpf"));

/// The `tp_btf` programs: (program name in the object, kernel tracepoint). The first two are
/// hook set `tracepoints`' ([`SOCK_TRACEPOINTS`]), the others every hook set's.
const BTF_TRACEPOINTS: [(&str, &str); 6] = [
    ("spice_sock_send", "sock_send_length"),
    ("spice_sock_recv", "sock_recv_length"),
    ("spice_fork", "sched_process_fork"),
    ("spice_exit", "sched_process_exit"),
    ("spice_tcp_state", "inet_sock_set_state"),
    ("spice_tcp_destroy", "tcp_destroy_sock"),
];

/// How many of [`BTF_TRACEPOINTS`], from the first, hook set `tracepoints` has alone.
const SOCK_TRACEPOINTS: usize = 2;

/// Hook set `syscalls`' program (`raw_tracepoint/sys_exit`).
const SYS_EXIT: (&str, &str) = ("spice_sys_exit", "sys_exit");

/// Hook set `fentry`'s programs: (program name, kernel function), `fexit` on the TCP send and
/// receive functions every socket-file path reaches (`inet_sendmsg` / `inet_recvmsg`,
/// net/ipv4/af_inet.c), global functions on every kernel since BPF trampolines (5.5).
const FEXITS: [(&str, &str); 2] = [
    ("spice_fexit_send", "tcp_sendmsg"),
    ("spice_fexit_recv", "tcp_recvmsg"),
];

/// Hook set `fentry`'s program on `tcp_sendpage` (sendfile and splice before Linux 6.5, which
/// removed the function): attached where the kernel's BTF has it, so that those calls mark
/// their direction `untraced bytes` as under the other sets. Not part of a pinned set's
/// required links ([`HookSet::attached`]).
const FEXIT_SENDPAGE: (&str, &str) = ("spice_fexit_sendpage", "tcp_sendpage");

/// Hook set `kprobes`' programs: (program name, kernel function, return probe), a kprobe and
/// a kretprobe on each of the functions of [`FEXITS`] (the kretprobe sees only the return
/// registers: the kprobe keeps the socket and flags for it, `spice-ebpf/src/probes/kprobes.rs`).
const KPROBES: [(&str, &str, bool); 4] = [
    ("spice_kprobe_send", "tcp_sendmsg", false),
    ("spice_kretprobe_send", "tcp_sendmsg", true),
    ("spice_kprobe_recv", "tcp_recvmsg", false),
    ("spice_kretprobe_recv", "tcp_recvmsg", true),
];

/// Hook set `kprobes`' programs on `tcp_sendpage` (see [`FEXIT_SENDPAGE`]): attached where the
/// function exists, not part of a pinned set's required links.
const KPROBES_SENDPAGE: [(&str, &str, bool); 2] = [
    ("spice_kprobe_sendpage", "tcp_sendpage", false),
    ("spice_kretprobe_sendpage", "tcp_sendpage", true),
];

/// Where a kernel offers kprobes to perf (and so to BPF): the `kprobe` PMU (Linux 4.17), or
/// the older tracefs file through which aya creates them otherwise ([`kretprobe::KPROBE_EVENTS`]).
const KPROBE_PMU: &str = "/sys/bus/event_source/devices/kprobe";

/// Which hook set to load, as asked for (`--hook-set`, the daemon's `hook_set`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HookChoice {
    /// The cheapest set that loads ([`choose_hook_set`]): `tracepoints` where the kernel has
    /// both socket tracepoints, else `fentry`, `kprobes`, then `syscalls`, the first the
    /// kernel accepts.
    #[default]
    #[value(help = "the first of tracepoints, fentry, kprobes, syscalls that loads")]
    Auto,
    /// [`HookSet::Tracepoints`]; an error on a kernel without the socket tracepoints.
    #[value(help = "the socket tracepoints sock_send_length / sock_recv_length (Linux 6.3)")]
    Tracepoints,
    /// [`HookSet::Fentry`]; an error with the kernel's refusal where BPF trampolines are not
    /// allowed.
    #[value(help = "fexit on tcp_sendmsg / tcp_recvmsg (BPF trampolines)")]
    Fentry,
    /// [`HookSet::Kprobes`]; an error where the kernel has no kprobes.
    #[value(help = "kprobe + kretprobe on tcp_sendmsg / tcp_recvmsg")]
    Kprobes,
    /// [`HookSet::Syscalls`].
    #[value(help = "raw_tracepoint/sys_exit: a filter at every syscall exit of the host")]
    Syscalls,
    /// No BPF: sock_diag polling of the watched processes' TCP sockets, TCP state only, no
    /// SPICE framing; never chosen by `auto`.
    #[value(help = "no BPF: TCP state by sock_diag only, no SPICE framing")]
    // The mode is crate::cmd::tcpinfo (observe) and crate::cmd::tcpinfo_daemon; nothing in
    // this module loads it (choose_hook_set refuses it).
    Tcpinfo,
}

impl HookChoice {
    /// The hook set this choice forces, `None` for [`HookChoice::Auto`] (and for
    /// [`HookChoice::Tcpinfo`], which loads no hook set).
    pub fn forced(self) -> Option<HookSet> {
        match self {
            HookChoice::Auto | HookChoice::Tcpinfo => None,
            HookChoice::Tracepoints => Some(HookSet::Tracepoints),
            HookChoice::Syscalls => Some(HookSet::Syscalls),
            HookChoice::Fentry => Some(HookSet::Fentry),
            HookChoice::Kprobes => Some(HookSet::Kprobes),
        }
    }
}

impl From<HookSet> for HookChoice {
    fn from(set: HookSet) -> HookChoice {
        match set {
            HookSet::Tracepoints => HookChoice::Tracepoints,
            HookSet::Syscalls => HookChoice::Syscalls,
            HookSet::Fentry => HookChoice::Fentry,
            HookSet::Kprobes => HookChoice::Kprobes,
        }
    }
}

/// The programs that see the socket calls. Every other program (process tracking, TCP state,
/// sock_ops, libssl) and all of the framing are the same in each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookSet {
    /// `tp_btf/sock_send_length` and `tp_btf/sock_recv_length` (net/socket.c, Linux 6.3,
    /// commit 6e6eda44b939): one program run per socket send or receive, nothing on other
    /// syscalls.
    Tracepoints,
    /// `raw_tracepoint/sys_exit` (Linux 4.17): one program run per syscall of the host, which
    /// turns away all but the watched processes' socket reads and writes and finds the socket
    /// from the file descriptor. For kernels without the socket tracepoints.
    Syscalls,
    /// `fexit/tcp_sendmsg` and `fexit/tcp_recvmsg` (BPF trampolines): one program run per TCP
    /// send or receive, nothing on other syscalls; the arguments and the byte count are those
    /// of the function. For kernels without the socket tracepoints that allow trampolines.
    Fentry,
    /// `kprobe` + `kretprobe` on the same functions as [`HookSet::Fentry`]: two program runs
    /// per TCP send or receive of the host (the entry's filter turns away the unwatched
    /// processes), nothing on other syscalls. For kernels without trampolines.
    Kprobes,
}

impl HookSet {
    /// Its name in reports and options.
    pub fn name(self) -> &'static str {
        match self {
            HookSet::Tracepoints => "tracepoints",
            HookSet::Syscalls => "syscalls",
            HookSet::Fentry => "fentry",
            HookSet::Kprobes => "kprobes",
        }
    }

    /// Its [`KernelConfig::hook_set`] value.
    fn config_value(self) -> u32 {
        match self {
            HookSet::Tracepoints => hook_set::TRACEPOINTS,
            HookSet::Syscalls => hook_set::SYSCALLS,
            HookSet::Fentry => hook_set::FENTRY,
            HookSet::Kprobes => hook_set::KPROBES,
        }
    }

    /// The `tp_btf` programs it loads.
    fn btf_tracepoints(self) -> &'static [(&'static str, &'static str)] {
        match self {
            HookSet::Tracepoints => &BTF_TRACEPOINTS,
            HookSet::Syscalls | HookSet::Fentry | HookSet::Kprobes => {
                &BTF_TRACEPOINTS[SOCK_TRACEPOINTS..]
            }
        }
    }

    /// The names of every program it attaches at load (sock_ops aside).
    fn attached(self) -> Vec<&'static str> {
        let mut v: Vec<&str> = self.btf_tracepoints().iter().map(|(n, _)| *n).collect();
        match self {
            HookSet::Syscalls => v.push(SYS_EXIT.0),
            HookSet::Fentry => v.extend(FEXITS.iter().map(|(n, _)| *n)),
            HookSet::Kprobes => v.extend(KPROBES.iter().map(|(n, _, _)| *n)),
            HookSet::Tracepoints => {}
        }
        v
    }
}

/// Resolves `choice` to the hook sets to try, in order: one when forced, and for `auto` the
/// cheapest first, `tracepoints` where the kernel has the socket tracepoints, else `fentry`,
/// `kprobes` (probes on the TCP functions only: cheaper for the rest of the host than a
/// program at every syscall exit), then `syscalls`; the loader takes the first the kernel
/// accepts. Probes the kernel,
/// never its version: `tracepoints` needs the typedefs `btf_trace_sock_send_length` and
/// `btf_trace_sock_recv_length` in its BTF (`has_typedef`, see [`require_tracepoint`]),
/// which a backport brings along with the tracepoints; the others are tried by loading them.
/// The second value says why `auto` did not take `tracepoints`. Errors when `tracepoints` is
/// forced and missing (the error contains [`UNAVAILABLE`]), and for `tcpinfo`.
pub fn choose_hook_set(
    choice: HookChoice,
    has_typedef: &dyn Fn(&str) -> bool,
) -> Result<(Vec<HookSet>, Option<String>)> {
    let needed_by = "the `tracepoints` hook set";
    let probe = || -> Result<()> {
        for (_, tp) in &BTF_TRACEPOINTS[..SOCK_TRACEPOINTS] {
            require_tracepoint(tp, needed_by, has_typedef)?;
        }
        Ok(())
    };
    match choice {
        HookChoice::Tcpinfo => bail!(
            "hook set `tcpinfo` loads no BPF program: it is observe's sock_diag mode \
             (`spice-observer observe --hook-set tcpinfo`), not a set of programs to load"
        ),
        HookChoice::Tracepoints => probe().map(|()| (vec![HookSet::Tracepoints], None)),
        HookChoice::Auto => match probe() {
            Ok(()) => Ok((vec![HookSet::Tracepoints], None)),
            Err(e) => Ok((
                vec![HookSet::Fentry, HookSet::Kprobes, HookSet::Syscalls],
                Some(format!("{e:#}")),
            )),
        },
        forced => Ok((vec![forced.forced().expect("a hook set")], None)),
    }
}

/// What `auto` says when it did not load `tracepoints` (`why_not_tracepoints`): which set it
/// loaded, why not the cheaper ones (`refusals`, one per set tried before), and what the set
/// costs the host. `None` when there was no fallback.
fn fallback_note(
    set: HookSet,
    why_not_tracepoints: Option<&str>,
    refusals: &[String],
) -> Option<String> {
    let why = why_not_tracepoints?;
    let mut note = format!("hook set `{}`, not `tracepoints`: {why}", set.name());
    if !refusals.is_empty() {
        note += &format!("; refused before it: {}", refusals.join("; "));
    }
    note += match set {
        HookSet::Syscalls => {
            "; a program runs at every syscall exit of the host (its filter turns away the \
             unwatched processes)"
        }
        HookSet::Kprobes => {
            "; a kprobe and a kretprobe run at every TCP send and receive of the host (their \
             filter turns away the unwatched processes)"
        }
        HookSet::Fentry | HookSet::Tracepoints => "",
    };
    Some(note)
}

/// Loads the eBPF object with `config` (nothing is attached).
fn load_object(config: &KernelConfig) -> Result<Ebpf> {
    EbpfLoader::new()
        .override_global("CONFIG", config, true)
        .load(EBPF_OBJECT)
        .map_err(|e| match e {
            aya::EbpfError::MapError(aya::maps::MapError::CreateError {
                name, io_error, ..
            }) if io_error.kind() == std::io::ErrorKind::PermissionDenied => {
                anyhow!(
                    "creating BPF map `{name}`: permission denied (run spice-observer as \
                     root; it needs CAP_BPF or CAP_SYS_ADMIN)"
                )
            }
            other => anyhow!("loading the eBPF object: {other}"),
        })
}

/// Loads and attaches the programs that see `set`'s socket calls: (name, program id, link if
/// `pin`). Links are not pinned here, so that a set refused half-way leaves no pin.
fn attach_socket_hooks(
    ebpf: &mut Ebpf,
    btf: &Btf,
    kbtf: &KernelBtf,
    set: HookSet,
    pin_dir: Option<&Path>,
    kretprobes: &mut Vec<KretprobeHeld>,
) -> Result<Vec<(&'static str, u32, Option<FdLink>)>> {
    let pin = pin_dir.is_some();
    let needed_by = format!("the `{}` hook set", set.name());
    match set {
        HookSet::Tracepoints => {
            let mut out = Vec::new();
            for &(name, tp) in &BTF_TRACEPOINTS[..SOCK_TRACEPOINTS] {
                let prog: &mut BtfTracePoint = ebpf
                    .program_mut(name)
                    .ok_or_else(|| anyhow!("program {name} missing from the object"))?
                    .try_into()?;
                prog.load(tp, btf)
                    .map_err(|e| load_error(name, &format!("tp_btf/{tp}"), e))?;
                let id = prog
                    .attach()
                    .with_context(|| format!("attaching tp_btf/{tp}"))?;
                let pid = prog.info()?.id();
                let link = match pin {
                    true => Some(prog.take_link(id)?.into()),
                    false => None,
                };
                out.push((name, pid, link));
            }
            Ok(out)
        }
        // The kernel decides (trampolines are refused on hosts like the one this was built
        // on: EPERM at the load, with no verifier log).
        HookSet::Fentry => attach_fexits(ebpf, btf, pin, kbtf.has_function(FEXIT_SENDPAGE.1)),
        HookSet::Kprobes => {
            require(
                "kprobes (perf's `kprobe` PMU or tracefs `kprobe_events`)",
                &needed_by,
                Ok(Path::new(KPROBE_PMU).exists() || kretprobe::tracefs().is_some()),
            )?;
            attach_kprobes(
                ebpf,
                pin_dir,
                kbtf.has_function(KPROBES_SENDPAGE[0].1),
                kretprobes,
            )
        }
        HookSet::Syscalls => {
            let (name, tp) = SYS_EXIT;
            require(
                "BPF program type `raw_tracepoint`",
                &needed_by,
                is_program_supported(ProgramType::RawTracePoint).map_err(anyhow::Error::from),
            )?;
            let prog: &mut RawTracePoint = ebpf
                .program_mut(name)
                .ok_or_else(|| anyhow!("program {name} missing from the object"))?
                .try_into()?;
            prog.load()
                .map_err(|e| load_error(name, &format!("raw_tracepoint/{tp}"), e))?;
            let id = prog
                .attach(tp)
                .with_context(|| format!("attaching raw_tracepoint/{tp}"))?;
            let pid = prog.info()?.id();
            let link = match pin {
                true => Some(prog.take_link(id)?.into()),
                false => None,
            };
            Ok(vec![(name, pid, link)])
        }
    }
}

/// A return probe of hook set `kprobes` ([`kretprobe`]): its link's descriptor (`None` once
/// the link is an [`FdLink`] to be pinned) and its tracefs event, kept for the capture's
/// lifetime.
type KretprobeHeld = (Option<OwnedFd>, kretprobe::Event);

/// Loads and attaches hook set `kprobes`' programs ([`KPROBES`], and [`KPROBES_SENDPAGE`]
/// with `sendpage`): (name, program id, link if `pin_dir`). The return probes go through
/// tracefs with [`kretprobe::MAXACTIVE`] instances ([`kretprobe`]); what they hold goes to
/// `kretprobes`. Errors with the kernel's refusal.
fn attach_kprobes(
    ebpf: &mut Ebpf,
    pin_dir: Option<&Path>,
    sendpage: bool,
    kretprobes: &mut Vec<KretprobeHeld>,
) -> Result<Vec<(&'static str, u32, Option<FdLink>)>> {
    let tracefs = kretprobe::tracefs().ok_or_else(|| {
        anyhow!(
            "no tracefs kprobe_events, which the return probes need (mount tracefs on \
             /sys/kernel/tracing)"
        )
    })?;
    kretprobe::remove_stale(&tracefs);
    let mut out = Vec::new();
    let all = KPROBES.iter().chain(match sendpage {
        true => &KPROBES_SENDPAGE[..],
        false => &[],
    });
    for &(name, func, ret) in all {
        let hook = format!("{}/{func}", if ret { "kretprobe" } else { "kprobe" });
        let prog: &mut KProbe = ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("program {name} missing from the object"))?
            .try_into()?;
        prog.load().map_err(|e| load_error(name, &hook, e))?;
        let pid = prog.info()?.id();
        if ret {
            let (fd, event) = kretprobe::attach(&tracefs, prog.fd()?.as_fd(), name, func)
                .with_context(|| format!("attaching {hook}"))?;
            let link = match pin_dir {
                // An FdLink for the caller to pin like the others: pinned here under a
                // temporary name, opened through aya and unpinned.
                Some(dir) => {
                    let tmp = dir.join(format!("tmp_{name}"));
                    kretprobe::pin(fd.as_fd(), &tmp)?;
                    drop(fd);
                    let l: FdLink = PinnedLink::from_pin(&tmp)
                        .with_context(|| format!("opening {}", tmp.display()))?
                        .unpin()
                        .with_context(|| format!("removing {}", tmp.display()))?;
                    kretprobes.push((None, event));
                    Some(l)
                }
                None => {
                    kretprobes.push((Some(fd), event));
                    None
                }
            };
            out.push((name, pid, link));
            continue;
        }
        let id = prog
            .attach(func, 0)
            .with_context(|| format!("attaching {hook}"))?;
        let link = match pin_dir {
            Some(_) => Some(prog.take_link(id)?.try_into().map_err(|e| {
                anyhow!("{hook} is attached without a bpf_link, cannot pin it: {e}")
            })?),
            None => None,
        };
        out.push((name, pid, link));
    }
    Ok(out)
}

/// Loads and attaches hook set `fentry`'s programs ([`FEXITS`], and [`FEXIT_SENDPAGE`] with
/// `sendpage`): (name, program id, link if `pin`).
/// Errors with the kernel's refusal (a verifier log, EPERM where trampolines are not allowed,
/// a missing function).
fn attach_fexits(
    ebpf: &mut Ebpf,
    btf: &Btf,
    pin: bool,
    sendpage: bool,
) -> Result<Vec<(&'static str, u32, Option<FdLink>)>> {
    let mut out = Vec::new();
    for &(name, func) in FEXITS.iter().chain(sendpage.then_some(&FEXIT_SENDPAGE)) {
        let prog: &mut FExit = ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("program {name} missing from the object"))?
            .try_into()?;
        prog.load(func, btf)
            .map_err(|e| load_error(name, &format!("fexit/{func}"), e))?;
        let id = prog
            .attach()
            .with_context(|| format!("attaching fexit/{func}"))?;
        let pid = prog.info()?.id();
        // The link stays with the program (detached with it) unless it is to be pinned.
        let link = match pin {
            true => Some(prog.take_link(id)?.into()),
            false => None,
        };
        out.push((name, pid, link));
    }
    Ok(out)
}

/// Turns on the kernel's BPF run-time statistics (`BPF_ENABLE_STATS` with
/// `BPF_STATS_RUN_TIME`, Linux ≥ 5.8): they stay on while the returned fd is open.
pub fn enable_run_time_stats() -> Result<std::os::fd::OwnedFd> {
    aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .map_err(|e| anyhow!("enabling BPF run-time statistics (BPF_ENABLE_STATS): {e}"))
}

/// Every map of the object the agent uses, by name: what a pin directory holds (one file per
/// map, named after it), besides one `link_<program>` and one `prog_<program>` file per attached
/// program. The object's
/// global-data section (`.rodata`, holding [`KernelConfig`]) is not pinned: the programs hold
/// it, and nothing reads it after the load.
pub const MAP_NAMES: [&str; 10] = [
    "WATCHED_TGIDS",
    "MAYBE_WATCHED",
    "SOCKETS",
    "WATCH_PORTS",
    "PREEXISTING",
    "EVENTS",
    "TAP_EVENTS",
    "COUNTERS",
    "ZERO_SOCK",
    "LAYOUT",
];

/// The sock_ops program's name (its link is pinned only when it was attached).
const SOCKOPS: &str = "spice_sockops";

/// Every program of the object that may be attached and pinned (`link_<name>`,
/// `prog_<name>`): the [`BTF_TRACEPOINTS`], [`SYS_EXIT`], [`FEXITS`], [`KPROBES`], sock_ops and the
/// libssl uprobes ([`tls::PROGRAMS`]; pinned as `prog_<name>`; their links are per process,
/// pinned by the daemon as `tls_…` ([`tls::PinName`])).
const PROGRAMS: [&str; 23] = [
    BTF_TRACEPOINTS[0].0,
    BTF_TRACEPOINTS[1].0,
    BTF_TRACEPOINTS[2].0,
    BTF_TRACEPOINTS[3].0,
    BTF_TRACEPOINTS[4].0,
    BTF_TRACEPOINTS[5].0,
    SYS_EXIT.0,
    FEXITS[0].0,
    FEXITS[1].0,
    FEXIT_SENDPAGE.0,
    KPROBES[0].0,
    KPROBES[1].0,
    KPROBES[2].0,
    KPROBES[3].0,
    KPROBES_SENDPAGE[0].0,
    KPROBES_SENDPAGE[1].0,
    SOCKOPS,
    tls::PROGRAMS[0].name,
    tls::PROGRAMS[1].name,
    tls::PROGRAMS[2].name,
    tls::PROGRAMS[3].name,
    tls::PROGRAMS[4].name,
    tls::PROGRAMS[5].name,
];

/// Pins that earlier versions made and this one does not: still this agent's, so that a reload or `--unpin` after an upgrade removes them
/// rather than refusing the directory. `PENDING_CALLS` and `spice_sys_enter` went with layout
/// version 8 (the socket tracepoints read the syscall's registers themselves); `TCP_STATE`
/// with layout version 10 (a socket's TCP state is part of its `SOCKETS` entry).
const RETIRED_PINS: [&str; 4] = [
    "PENDING_CALLS",
    "link_spice_sys_enter",
    "prog_spice_sys_enter",
    "TCP_STATE",
];

/// Whether `name` is a pin this agent makes in a pin directory: a map of [`MAP_NAMES`],
/// `link_<program>` / `prog_<program>` of one of its programs, the link of a libssl
/// uprobe for one process ([`tls::PinName`]), or one an earlier version made
/// ([`RETIRED_PINS`]). Only such names are ever removed from a pin directory.
pub fn is_owned_pin(name: &str) -> bool {
    MAP_NAMES.contains(&name)
        || RETIRED_PINS.contains(&name)
        || name
            .strip_prefix("link_")
            .or_else(|| name.strip_prefix("prog_"))
            // A return probe's link between its pin and unpin in `attach_kprobes`.
            .or_else(|| name.strip_prefix("tmp_"))
            .is_some_and(|p| PROGRAMS.contains(&p))
        || tls::PinName::parse(name).is_some()
}

/// The libssl uprobe link pins in `dir` ([`tls::PinName`]), by name, sorted; none when it
/// cannot be read.
pub fn tls_pins(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| tls::PinName::parse(n).is_some())
        .collect();
    v.sort();
    v
}

/// Releases the libssl uprobe link pins of `dir` one by one, in the calling thread, each
/// process's entry programs before its uretprobes ([`tls::ProcLinks`]): each is opened,
/// its pin removed and the descriptor closed, which detaches it there and then (~110 ms
/// per uprobe on Linux 6.18). Returns the names released and how long it took.
pub fn release_tls_pins(dir: &Path) -> (Vec<String>, std::time::Duration) {
    let t0 = std::time::Instant::now();
    let mut names = tls_pins(dir);
    // Entries first, over all processes: no uretprobe goes while its entry runs.
    names.sort_by_key(|n| tls::PinName::parse(n).is_some_and(|p| p.ret()));
    for n in &names {
        TlsLink::Pinned(dir.join(n)).release_now();
    }
    (names, t0.elapsed())
}

/// The entries of `dir` that are not this agent's pins ([`is_owned_pin`]), sorted; a
/// subdirectory (whatever its name) is foreign and listed with a trailing `/`. Empty when
/// `dir` does not exist. Errors when it cannot be read.
pub fn foreign_entries(dir: &Path) -> Result<Vec<String>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    let mut foreign = Vec::new();
    for e in entries {
        let e = e.with_context(|| format!("reading {}", dir.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let is_dir = e.file_type().map(|t| t.is_dir()).unwrap_or(false);
        if is_dir {
            foreign.push(format!("{name}/"));
        } else if !is_owned_pin(&name) {
            foreign.push(name);
        }
    }
    foreign.sort();
    Ok(foreign)
}

/// Refuses a pin directory that holds anything but this agent's pins ([`foreign_entries`]):
/// the error names the foreign entries (the first 10) and says to give a dedicated directory.
/// Nothing is removed.
pub fn refuse_foreign(dir: &Path) -> Result<()> {
    let foreign = foreign_entries(dir)?;
    if foreign.is_empty() {
        return Ok(());
    }
    let shown: Vec<&str> = foreign.iter().take(10).map(String::as_str).collect();
    let more = foreign.len().saturating_sub(shown.len());
    bail!(
        "pin directory {} holds {} entr{} that {} not spice-observer's: {}{}; spice-observer \
         only ever removes its own pins (its maps, the link_/prog_ files of its programs, \
         the tls_ links of its libssl uprobes and the names earlier versions used) and leaves these alone: pick a dedicated directory for --pin-dir / `pin_dir` (default \
         {}), or move these entries away",
        dir.display(),
        foreign.len(),
        if foreign.len() == 1 { "y" } else { "ies" },
        if foreign.len() == 1 { "is" } else { "are" },
        shown.join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        },
        crate::config::DEFAULT_PIN_DIR,
    );
}

/// The name of user `uid` from /etc/passwd, if it has one there.
fn user_name(uid: u32) -> Option<String> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let mut f = l.split(':');
        let name = f.next()?;
        let id: u32 = f.nth(1)?.parse().ok()?;
        (id == uid).then(|| name.to_string())
    })
}

/// Checks that this process may make and remove pins in `dir` (an existing directory):
/// write and search permission on it (`BPF_OBJ_PIN` and `unlink` check them, as for any
/// file made in a directory), and read permission to list it, checked with the effective
/// ids and capabilities (`faccessat(2)` with `AT_EACCESS`). `what` says what the caller is
/// about to do, for the message.
///
/// Errors name the directory, its owner and mode, this process's user, and the two ways
/// out: give the directory to the service user, or remove the pins as root.
pub fn check_pin_dir_access(dir: &Path, what: &str) -> Result<()> {
    use std::os::unix::{ffi::OsStrExt as _, fs::MetadataExt as _};
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    let mode = libc::R_OK | libc::W_OK | libc::X_OK;
    // SAFETY: `c` is a NUL-terminated path.
    if unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), mode, libc::AT_EACCESS) } == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EACCES) {
        return Err(err).with_context(|| format!("checking access to {}", dir.display()));
    }
    let md = std::fs::metadata(dir).with_context(|| format!("stat {}", dir.display()))?;
    let who = |uid: u32| match user_name(uid) {
        Some(n) => format!("uid {uid} ({n})"),
        None => format!("uid {uid}"),
    };
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    bail!(
        "this process ({}) may not {what} in the pin directory {}: it is owned by {}, group \
         {}, mode {:04o}, and pins are made and removed with write and search access to the \
         directory. Give it to the service user (`chown -R USER: {}`, as the unit's \
         ExecStartPre= does for spice-observer), or remove the pins as root (`spice-observer \
         daemon --pin-dir {} --unpin`)",
        who(me),
        dir.display(),
        who(md.uid()),
        md.gid(),
        md.mode() & 0o7777,
        dir.display(),
        dir.display(),
    );
}

/// Environment variable read at run time by [`layout_version`], for tests only: a decimal
/// number that replaces [`LAYOUT_VERSION`], so that a test can play a daemon of another
/// layout without a second build. Never set it in production: a wrong value makes the daemon
/// reload (and mark every open channel `restarted`) at each start.
pub const LAYOUT_VERSION_OVERRIDE_ENV: &str = "SPICE_OBSERVER_LAYOUT_VERSION_OVERRIDE";

/// The layout version this agent writes into and expects from a pinned set:
/// [`LAYOUT_VERSION`], unless [`LAYOUT_VERSION_OVERRIDE_ENV`] is set (tests).
///
/// Errors when the variable is set but is not a decimal `u32` (or not UTF-8): a typo there
/// must not silently run with the real version.
pub fn layout_version() -> Result<u32> {
    match std::env::var_os(LAYOUT_VERSION_OVERRIDE_ENV) {
        None => Ok(LAYOUT_VERSION),
        Some(v) => parse_layout_override(&v.to_string_lossy()),
    }
}

/// Parses the value of [`LAYOUT_VERSION_OVERRIDE_ENV`]: a decimal `u32`, surrounding
/// whitespace allowed. The error names the variable and the value.
fn parse_layout_override(v: &str) -> Result<u32> {
    v.trim().parse().map_err(|e| {
        anyhow!(
            "{LAYOUT_VERSION_OVERRIDE_ENV}={v:?} is not a layout version (a decimal number): {e}"
        )
    })
}

/// What this agent writes into the pinned `LAYOUT` map (indexes of
/// [`spice_ebpf_common::config::layout`]), without the hook bits. Errors as
/// [`layout_version`].
fn expected_layout() -> Result<[u32; layout::HOOKS as usize]> {
    Ok([
        layout_version()?,
        std::mem::size_of::<SockState>() as u32,
        std::mem::size_of::<TcpSnapshot>() as u32,
        std::mem::size_of::<MessageEvent>() as u32,
    ])
}

/// `bpf_map_update_elem` flag: update only an existing element (include/uapi/linux/bpf.h).
const BPF_EXIST: u64 = 2;

/// `statfs(2)` magic number of the BPF filesystem (`BPF_FS_MAGIC`, include/uapi/linux/magic.h).
const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// Whether `path` (which must exist) lies on a BPF filesystem.
fn on_bpffs(path: &Path) -> Result<bool> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-buffer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("statfs {}", path.display()));
    }
    Ok(st.f_type as i64 == BPF_FS_MAGIC)
}

/// Checks that `dir` is (or would be created) on a BPF filesystem, creates it, and checks
/// that this process may pin into it and remove its pins ([`check_pin_dir_access`]).
///
/// Errors: the nearest existing ancestor of `dir` is not on a bpffs (the message says how to
/// mount one), `dir` cannot be created (an ancestor this process may not write is named with
/// its owner and mode), or this process may not write `dir`.
pub fn prepare_pin_dir(dir: &Path) -> Result<()> {
    let mut probe = dir;
    while !probe.exists() {
        probe = probe.parent().unwrap_or(Path::new("/"));
    }
    if !on_bpffs(probe)? {
        bail!(
            "pin directory {} is not on a BPF filesystem ({} is not bpffs): mount one with \
             `mount -t bpf bpf /sys/fs/bpf` (scripts/setup.sh does), or give --pin-dir / \
             `pin_dir` a directory on a bpffs",
            dir.display(),
            probe.display()
        );
    }
    if !dir.exists() {
        check_pin_dir_access(probe, "create the pin directory")?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    check_pin_dir_access(dir, "make or remove pins")
}

/// An exclusive `flock(2)` on a pin directory, held by the daemon that uses it for as long as
/// it runs (released when dropped or when the process dies, SIGKILL included), so that two
/// daemons never drain one pinned ring. Other programs can test it ([`PinLock::held`]).
pub struct PinLock {
    _dir: File,
}

impl PinLock {
    /// Takes the lock on `dir` (which must exist) without waiting. Errors when another
    /// process holds it (the message names the directory), or `dir` cannot be opened.
    pub fn take(dir: &Path) -> Result<PinLock> {
        match Self::try_take(dir)? {
            Some(l) => Ok(l),
            None => bail!(
                "another spice-observer daemon is using the pin directory {} (it holds its \
                 lock); stop it first, or give this one another --pin-dir",
                dir.display()
            ),
        }
    }

    /// Takes the lock on `dir` (which must exist) without waiting: `None` when another
    /// process holds it. Errors when `dir` cannot be opened or locked.
    pub fn try_take(dir: &Path) -> Result<Option<PinLock>> {
        use std::os::fd::AsRawFd as _;
        let f = File::open(dir).with_context(|| format!("opening {}", dir.display()))?;
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Ok(None);
            }
            return Err(e).with_context(|| format!("locking {}", dir.display()));
        }
        Ok(Some(PinLock { _dir: f }))
    }

    /// Whether a running process holds the lock of `dir` (false if `dir` does not exist).
    pub fn held(dir: &Path) -> bool {
        match File::open(dir) {
            Ok(f) => {
                use std::os::fd::AsRawFd as _;
                // SAFETY: flock on an fd we own; the lock, if taken, goes with `f`.
                unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) != 0 }
            }
            Err(_) => false,
        }
    }
}

/// Removes this agent's pins from `dir` (program links first, then programs and maps) but
/// keeps the directory (and so a [`PinLock`] on it). Returns the names removed. The libssl
/// uprobe links ([`tls::PinName`]) are only unpinned: the kernel releases them on its own
/// workqueue afterwards (a whole set goes, so their order does not matter; [`unpin`]
/// releases them here, in order, first).
///
/// Errors, removing nothing, when `dir` holds anything that is not this agent's pin
/// ([`refuse_foreign`]: other tools' pins, subdirectories): those are never unlinked.
pub fn unpin_contents(dir: &Path) -> Result<Vec<String>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    refuse_foreign(dir)?;
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| is_owned_pin(n))
        .collect();
    // Links before the rest.
    names.sort_by_key(|n| (!n.starts_with("link_"), n.clone()));
    for n in &names {
        let p = dir.join(n);
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", p.display())),
        }
    }
    Ok(names)
}

/// What [`unpin`] did with the directory itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirLeft {
    /// Removed, or there was none.
    Removed,
    /// Kept, empty: it is a mount point (EBUSY), e.g. the bind mount systemd makes of a
    /// unit's `ReadWritePaths=` directory.
    MountPoint,
}

/// Removes a pin directory: the program links first (which detaches the programs, unless a
/// running process still holds them), then the maps, then the directory. Idempotent: a
/// missing directory removes nothing. Returns the names removed and whether the directory
/// went; a directory that is a mount point (`rmdir` EBUSY) once empty stays and is not an
/// error.
///
/// Errors, removing nothing, when `dir` holds anything but this agent's pins
/// ([`unpin_contents`]).
pub fn unpin(dir: &Path) -> Result<(Vec<String>, DirLeft)> {
    refuse_foreign(dir)?;
    let (mut names, took) = release_tls_pins(dir);
    if took > std::time::Duration::from_secs(1) {
        log::info!(
            "released {} libssl uprobe link(s) in {:.1} s (the kernel takes ~0.1 s per uprobe)",
            names.len(),
            took.as_secs_f64()
        );
    }
    let mut rest = unpin_contents(dir)?;
    names.append(&mut rest);
    // Hook set `kprobes`' return-probe events, unused once their links' pins are gone.
    if let Some(tracefs) = kretprobe::tracefs() {
        let left = kretprobe::remove_stale_after_unpin(&tracefs, std::time::Duration::from_secs(2));
        if left > 0 {
            warn!(
                "{left} kprobe event(s) of group {} still in use 2 s after the unpin; the next \
                 start removes them",
                kretprobe::GROUP
            );
        }
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            return Ok((names, DirLeft::MountPoint));
        }
        Err(e) => return Err(e).with_context(|| format!("removing {}", dir.display())),
    }
    Ok((names, DirLeft::Removed))
}

/// A libssl uprobe link of one process ([`tls::Host::Link`] of [`Capture`]).
pub enum TlsLink {
    /// Held by this process only: dropping it detaches the uprobe.
    Own(UProbeLink),
    /// Pinned at this path (by this daemon or an earlier one): dropping it keeps it
    /// attached; [`tls::HookLink::release`] removes the pin and detaches it.
    Pinned(PathBuf),
}

impl TlsLink {
    fn release_now(self) {
        match self {
            TlsLink::Own(l) => drop(l),
            TlsLink::Pinned(p) => {
                // Hold a reference while the pin goes, so that the last one is dropped here
                // (then the release runs in this thread, in the order called) rather than
                // on the kernel's workqueue.
                let held = PinnedLink::from_pin(&p);
                match std::fs::remove_file(&p) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => debug!("removing {}: {e}", p.display()),
                }
                drop(held);
            }
        }
    }
}

impl tls::HookLink for TlsLink {
    fn release(self) {
        self.release_now()
    }
}

/// The processes (`WATCHED_TGIDS` keys) of the set pinned under `dir`, read without trusting
/// its layout beyond that map's key and value sizes (4 and 4 bytes). Errors when the map is
/// missing or of another shape.
pub fn pinned_watched(dir: &Path) -> Result<std::collections::HashSet<u32>> {
    let data = MapData::from_pin(dir.join("WATCHED_TGIDS"))?;
    let map: HashMap<MapData, u32, u32> = HashMap::try_from(Map::from_map_data(data)?)?;
    Ok(map.keys().filter_map(|k| k.ok()).collect())
}

/// What a pin directory held when an agent started.
pub enum Pinned {
    /// Nothing pinned there (no directory, or an empty one).
    Absent,
    /// A complete set of this agent's layout: the maps opened, the programs left running.
    Reusable(Box<Capture>),
    /// Something this agent cannot continue: another layout, or a partial set. The text
    /// says which. The caller removes it ([`unpin`]) and loads afresh.
    Stale(String),
}

/// Loaded and attached kernel programs, and their maps.
pub struct Capture {
    /// The loaded object, holding the programs and (when not pinned) their links; `None` when
    /// the programs are a pinned set loaded by an earlier agent.
    _ebpf: Option<Ebpf>,
    /// The maps in use, by name ([`MAP_NAMES`]; `EVENTS` leaves with [`Capture::take_ring`]).
    maps: StdHashMap<String, Map>,
    /// (program name in the object, kernel program id) of each attached program.
    programs: Vec<(String, u32)>,
    /// The pin directory when the programs are pinned there (`prog_<name>`): their run-time
    /// statistics are read through those pins, which needs no capability (the daemon drops
    /// CAP_SYS_ADMIN after attach, and `BPF_PROG_GET_NEXT_ID` needs it).
    pin_dir: Option<PathBuf>,
    /// The libssl uprobe programs, to attach per process ([`tls::Host`]).
    tls: TlsPrograms,
    /// Name of the active hook set, for reports (`hook_set` in JSON).
    pub hook_set: String,
    /// Kernel features that were missing and what that costs (empty when all present).
    pub degraded: Vec<String>,
    /// Hook set `kprobes`' return probes: links and tracefs events ([`kretprobe`]); dropped
    /// after the object, so that an event is unused when its removal is tried.
    _kretprobes: Vec<KretprobeHeld>,
    /// Own descriptors of the hash maps read in batches ([`Capture::sock_entries`],
    /// [`Capture::sock_states`]), found at their first use; `None`: read key by key.
    batch_fds: StdHashMap<&'static str, Option<(OwnedFd, u32)>>,
}

/// Where a [`Capture`]'s libssl uprobe programs ([`tls::PROGRAMS`]) are.
enum TlsPrograms {
    /// Loaded in the capture's own object (`Capture::_ebpf`).
    Object,
    /// Opened from the pins of an earlier agent's set (`prog_<name>`), by program name.
    Pinned(StdHashMap<&'static str, UProbe>),
    /// Not loaded: why (every process with a libssl is then `Failed` with this text).
    Unavailable(String),
}

/// The uprobe PMU's type file: uprobes are created through it (`perf_event_open(2)` with
/// this type, Linux ≥ 4.17, `kernel/events/core.c` `perf_uprobe`), which aya uses.
const UPROBE_PMU: &str = "/sys/bus/event_source/devices/uprobe/type";

/// The degraded entry when the libssl hooks cannot be loaded (`why` says what is missing).
fn tls_degraded(why: &str) -> String {
    format!(
        "libssl hooks unavailable ({why}): TLS channels stay `unparsed: tls`, their plaintext \
         is not framed"
    )
}

/// Probes for what the libssl hooks need: the `kprobe` program type (uprobes are kprobe
/// programs, `BPF_PROG_TYPE_KPROBE`) and the uprobe PMU ([`UPROBE_PMU`]). `Ok(Err(why))`:
/// missing (the hooks are left out); `Err`: the probe could not decide (a hard error, as for
/// the other program types).
fn tls_supported() -> Result<std::result::Result<(), String>> {
    if !is_program_supported(ProgramType::KProbe)
        .context("probing the kernel for BPF program type `kprobe` failed")?
    {
        return Ok(Err(format!("BPF program type `kprobe` {UNAVAILABLE}")));
    }
    if !Path::new(UPROBE_PMU).exists() {
        return Ok(Err(format!(
            "the kernel has no uprobe PMU: {UPROBE_PMU} is missing (CONFIG_UPROBE_EVENTS)"
        )));
    }
    Ok(Ok(()))
}

/// Turns aya's attach error into a [`tls::AttachError`]: a symbol the library does not have
/// (aya's `SymbolError` for an unknown symbol, or a debug link it followed for the symbol
/// and could not use) is [`tls::AttachError::MissingSymbol`]; anything else (the file
/// cannot be read, `perf_event_open` or `bpf_link_create` refused) is
/// [`tls::AttachError::Failed`]. Both carry aya's message with its causes.
fn attach_error(e: ProgramError) -> tls::AttachError {
    let text = format!("{:#}", anyhow::Error::from(e));
    let missing = ["unknown symbol", "debuglink file", "mismatched build IDs"];
    if text.starts_with("error resolving symbol") && missing.iter().any(|m| text.contains(m)) {
        tls::AttachError::MissingSymbol(text)
    } else if text.contains("perf_event_open") && text.contains("Permission denied") {
        tls::AttachError::Failed(format!("{text} ({})", tls::CAPABILITY_HINT))
    } else if text.contains("perf_event_open") && text.contains("Operation not permitted") {
        tls::AttachError::Failed(format!(
            "{text} (a seccomp filter may refuse perf_event_open(2): systemd's \
             SystemCallFilter=@system-service does not allow it)"
        ))
    } else {
        tls::AttachError::Failed(text)
    }
}

impl tls::Host for Capture {
    type Link = TlsLink;

    fn start_time(&self, pid: u32) -> Option<u64> {
        tls::start_time(pid)
    }

    fn libssl(&self, pid: u32) -> std::result::Result<Vec<tls::MappedLibrary>, tls::ProcError> {
        tls::mapped_libssl(pid)
    }

    /// `UProbe::attach(symbol, target, UProbeScope::OneProcess(pid))`, and the link taken
    /// out of the program (dropping it detaches).
    fn attach(
        &mut self,
        program: &str,
        symbol: &str,
        target: &Path,
        pid: u32,
    ) -> std::result::Result<TlsLink, tls::AttachError> {
        let Some(pid) = NonZeroU32::new(pid) else {
            return Err(tls::AttachError::Failed("pid 0".into()));
        };
        let prog: Option<&mut UProbe> = match &mut self.tls {
            TlsPrograms::Object => self
                ._ebpf
                .as_mut()
                .and_then(|e| e.program_mut(program))
                .and_then(|p| p.try_into().ok()),
            TlsPrograms::Pinned(m) => m.get_mut(program),
            TlsPrograms::Unavailable(why) => return Err(tls::AttachError::Failed(why.clone())),
        };
        let prog = prog
            .ok_or_else(|| tls::AttachError::Failed(format!("program {program} is not loaded")))?;
        let id = prog
            .attach(symbol, target, UProbeScope::OneProcess(pid))
            .map_err(attach_error)?;
        prog.take_link(id)
            .map(TlsLink::Own)
            .map_err(|e| tls::AttachError::Failed(format!("{:#}", anyhow::Error::from(e))))
    }

    fn unavailable(&self) -> Option<String> {
        match &self.tls {
            TlsPrograms::Unavailable(why) => Some(why.clone()),
            _ => None,
        }
    }

    /// `FdLink::try_from(link)` (a `bpf_link` of type perf_event, Linux ≥ 5.15 for kprobe
    /// programs; aya falls back to `PERF_EVENT_IOC_SET_BPF` before, which cannot be pinned)
    /// and `FdLink::pin` under the capture's pin directory. The descriptor is closed after:
    /// the pin holds the link.
    fn pin(
        &mut self,
        link: TlsLink,
        name: &str,
    ) -> std::result::Result<TlsLink, (Option<TlsLink>, String)> {
        let Some(dir) = self.pin_dir.clone() else {
            return Err((Some(link), "no pin directory".into()));
        };
        let TlsLink::Own(l) = link else {
            return Ok(link);
        };
        if !aya::features().bpf_perf_link() {
            return Err((
                Some(TlsLink::Own(l)),
                "the kernel attaches uprobes without a bpf_link (before Linux 5.15): they \
                 cannot be pinned"
                    .into(),
            ));
        }
        let path = dir.join(name);
        let fd: FdLink = match FdLink::try_from(l) {
            Ok(fd) => fd,
            Err(e) => return Err((None, format!("not a bpf_link: {e}"))),
        };
        // A failed BPF_OBJ_PIN drops the link (aya's `pin` consumes it): it is gone then.
        match fd.pin(&path) {
            Ok(pinned) => {
                // The pin holds the link: the descriptor is not needed.
                drop(pinned);
                Ok(TlsLink::Pinned(path))
            }
            Err(e) => Err((
                None,
                format!("pinning {}: {:#}", path.display(), anyhow::Error::from(e)),
            )),
        }
    }

    fn pinned_links(&self) -> Vec<String> {
        match &self.pin_dir {
            Some(dir) => tls_pins(dir),
            None => Vec::new(),
        }
    }

    fn open_pin(&mut self, name: &str) -> TlsLink {
        let dir = self.pin_dir.clone().unwrap_or_default();
        TlsLink::Pinned(dir.join(name))
    }
}

/// The phrase of every error that means "this kernel lacks a program type or hook the
/// observer needs" (and of no other error): the test harness turns exactly these into skips.
pub const UNAVAILABLE: &str = "is not available on this kernel";

/// Turns a probe for a kernel feature into the start-up decision.
///
/// `Ok(true)`: present. `Ok(false)`: the kernel lacks `feature`; the error names it, says
/// what needs it (`needed_by`) and contains [`UNAVAILABLE`]. `Err`: the probe could not
/// decide (e.g. EPERM): a hard error that does not contain [`UNAVAILABLE`].
fn require(feature: &str, needed_by: &str, probe: Result<bool>) -> Result<()> {
    match probe {
        Ok(true) => Ok(()),
        Ok(false) => {
            bail!("{feature} {UNAVAILABLE}; {needed_by} needs it (see README, Kernel requirements)")
        }
        Err(e) => Err(e.context(format!(
            "probing the kernel for {feature} failed (this is not a missing feature)"
        ))),
    }
}

/// Probes for tracepoint `event` (name without group, e.g. `sock_send_length`): the kernel
/// defines the typedef `btf_trace_<event>` for each tracepoint it has
/// (include/trace/bpf_probe.h), and `tp_btf` programs attach by it (aya's
/// `BtfTracePoint::load` looks up the same name). `has_typedef` looks a typedef up in the
/// kernel's BTF.
fn require_tracepoint(
    event: &str,
    needed_by: &str,
    has_typedef: &dyn Fn(&str) -> bool,
) -> Result<()> {
    require(
        &format!("tracepoint `{event}`"),
        needed_by,
        Ok(has_typedef(&format!("btf_trace_{event}"))),
    )
}

/// The kernel refused to load program `name` (for `hook`): its errno and the verifier's log.
/// A hard error (the kernel has the feature, it probed present): a rejection is a bug here.
fn refused(name: &str, hook: &str, io_error: &std::io::Error, verifier_log: &str) -> anyhow::Error {
    // A refusal before the verifier ran (EPERM for a trampoline) leaves no log.
    match verifier_log.trim() {
        "" => anyhow!("the kernel refused program `{name}` ({hook}): {io_error} (no verifier log)"),
        log => anyhow!(
            "the kernel refused program `{name}` ({hook}): {io_error}\nverifier log:\n{log}"
        ),
    }
}

/// Explains a program load failure for `hook`, keeping the verifier's log. Never contains
/// [`UNAVAILABLE`]: the hook was probed present before loading.
fn load_error(name: &str, hook: &str, e: ProgramError) -> anyhow::Error {
    match e {
        ProgramError::LoadError {
            io_error,
            verifier_log,
        } => refused(name, hook, &io_error, &verifier_log.to_string()),
        other => anyhow!("loading program `{name}` ({hook}): {other}"),
    }
}

/// The cgroup-v2 mount point, from /proc/self/mountinfo (hybrid hosts mount it at
/// `/sys/fs/cgroup/unified`, pure v2 hosts at `/sys/fs/cgroup`).
pub fn cgroup2_mount() -> Result<PathBuf> {
    let me = procfs::process::Process::myself()?;
    let infos = me.mountinfo().context("reading /proc/self/mountinfo")?;
    infos
        .into_iter()
        .find(|m| m.fs_type == "cgroup2")
        .map(|m| m.mount_point)
        .ok_or_else(|| anyhow!("no cgroup2 filesystem is mounted"))
}

impl Capture {
    /// Loads the programs, sets their kernel offsets from BTF and attaches every hook.
    ///
    /// Errors: not root / no CAP_BPF, no kernel BTF, a missing program type or tracepoint
    /// (named in the error, which contains [`UNAVAILABLE`]), a verifier rejection (with the
    /// verifier log) or an attach failure (with the kernel's errno). A missing cgroup2 mount or
    /// a kernel without the `sock_ops` program type only disables sockops (listed in
    /// [`Capture::degraded`]).
    pub fn load(choice: HookChoice) -> Result<Self> {
        Self::load_into(None, choice)
    }

    /// [`Capture::load`], then pins every map of [`MAP_NAMES`], one link per attached
    /// program (`link_<program>`) and the program (`prog_<program>`) under `dir` (see [`prepare_pin_dir`]), and records this
    /// agent's layout in the `LAYOUT` map. The programs stay attached after this process
    /// exits, until the pins are removed ([`unpin`]). `dir` must hold no pins.
    pub fn load_pinned(dir: &Path, choice: HookChoice) -> Result<Self> {
        prepare_pin_dir(dir)?;
        Self::load_into(Some(dir), choice)
    }

    fn load_into(pin: Option<&Path>, choice: HookChoice) -> Result<Self> {
        // Before anything is loaded: a bad test override fails here, not after attaching.
        layout_version()?;
        // Pinned links: kept here until every pin is made (dropping one closes its fd only).
        let mut links: Vec<PinnedLink> = Vec::new();
        let mut programs: Vec<(String, u32)> = Vec::new();
        let pin_link =
            |link: FdLink, name: &str, links: &mut Vec<PinnedLink>| -> Result<()> {
                if let Some(dir) = pin {
                    let p = dir.join(format!("link_{name}"));
                    links.push(link.pin(&p).with_context(|| {
                        format!("pinning the link of {name} at {}", p.display())
                    })?);
                }
                Ok(())
            };
        // Pre-5.11 kernels charge BPF maps to RLIMIT_MEMLOCK; harmless elsewhere.
        let rlim = libc::rlimit {
            rlim_cur: libc::RLIM_INFINITY,
            rlim_max: libc::RLIM_INFINITY,
        };
        if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rlim) } != 0 {
            debug!("could not raise RLIMIT_MEMLOCK");
        }
        let kbtf = KernelBtf::open(std::path::Path::new(VMLINUX_BTF))?;
        let mut config: KernelConfig = kbtf.kernel_config()?;
        let (candidates, why_not_tracepoints) =
            choose_hook_set(choice, &|name: &str| kbtf.has_typedef(name))?;
        // The BTF for the tp_btf and fexit programs: parsed after the loader has parsed (and
        // dropped) its own copy, so that the two are never held at once (each costs tens of
        // MB of heap).
        let mut btf: Option<Btf> = None;
        let mut refusals: Vec<String> = Vec::new();
        let mut chosen = None;
        // Hook set `kprobes`' return probes (attached outside aya, [`kretprobe`]).
        let mut kretprobes: Vec<KretprobeHeld> = Vec::new();
        for (i, &set) in candidates.iter().enumerate() {
            config.hook_set = set.config_value();
            let mut ebpf = load_object(&config)?;
            if btf.is_none() {
                btf = Some(Btf::from_sys_fs().context("loading kernel BTF for tp_btf programs")?);
            }
            match attach_socket_hooks(
                &mut ebpf,
                btf.as_ref().unwrap(),
                &kbtf,
                set,
                pin,
                &mut kretprobes,
            ) {
                Ok(hooks) => {
                    chosen = Some((set, ebpf, hooks));
                    break;
                }
                // `auto`: the next candidate (the object is dropped, with what it attached).
                Err(e) if i + 1 < candidates.len() => {
                    kretprobes.clear();
                    debug!("hook set `{}` did not load: {e:#}", set.name());
                    // The first line: a verifier log follows on the next ones.
                    let why = format!("{e:#}");
                    let why = why.lines().next().unwrap_or("");
                    refusals.push(format!("`{}`: {why}", set.name()));
                }
                Err(e) if refusals.is_empty() => return Err(e),
                Err(e) => {
                    return Err(e.context(format!(
                        "no hook set loads (refused before: {})",
                        refusals.join("; ")
                    )));
                }
            }
        }
        let (set, mut ebpf, hooks) = chosen.ok_or_else(|| anyhow!("no hook set to load"))?;
        let btf = btf.expect("parsed with the first object");
        for (name, id, link) in hooks {
            programs.push((name.into(), id));
            if let Some(link) = link {
                pin_link(link, name, &mut links)?;
            }
        }
        let fallback = fallback_note(set, why_not_tracepoints.as_deref(), &refusals);
        let needed_by = format!("the `{}` hook set", set.name());
        let has_typedef = |name: &str| kbtf.has_typedef(name);

        // No program-type probe for tp_btf: aya's probe for BPF_PROG_TYPE_TRACING attaches an
        // fentry trampoline, which the kernels this was built on refuse while tp_btf works.
        for &(name, tp) in &BTF_TRACEPOINTS[SOCK_TRACEPOINTS..] {
            require_tracepoint(tp, &needed_by, &has_typedef)?;
            let prog: &mut BtfTracePoint = ebpf
                .program_mut(name)
                .ok_or_else(|| anyhow!("program {name} missing from the object"))?
                .try_into()?;
            prog.load(tp, &btf)
                .map_err(|e| load_error(name, &format!("tp_btf/{tp}"), e))?;
            let id = prog
                .attach()
                .with_context(|| format!("attaching tp_btf/{tp}"))?;
            programs.push((name.into(), prog.info()?.id()));
            if pin.is_some() {
                let link: FdLink = prog.take_link(id)?.into();
                pin_link(link, name, &mut links)?;
            }
        }
        let mut hook_set = String::from(set.name());
        let mut degraded = Vec::new();
        if let Some(why) = fallback {
            log::info!("{why}");
            degraded.push(why);
        }
        let sockops_supported = is_program_supported(ProgramType::SockOps)
            .context("probing the kernel for BPF program type `sock_ops` failed")?;
        match cgroup2_mount() {
            Ok(_) if !sockops_supported => degraded.push(
                "sockops disabled (the kernel lacks BPF program type `sock_ops`): TCP state is \
                 read at socket calls and by sock_diag only"
                    .into(),
            ),
            Ok(cg) => {
                let prog: &mut SockOps = ebpf
                    .program_mut("spice_sockops")
                    .ok_or_else(|| anyhow!("program spice_sockops missing from the object"))?
                    .try_into()?;
                prog.load()
                    .map_err(|e| load_error("spice_sockops", "sock_ops", e))?;
                let dir = File::open(&cg).with_context(|| format!("opening {}", cg.display()))?;
                // AllowMultiple (bpf_link_create with BPF_F_ALLOW_MULTI) is refused on the
                // kernels this was tested on; the default single mode works.
                match prog.attach(dir, CgroupAttachMode::default()) {
                    Ok(id) => {
                        hook_set.push_str("+sockops");
                        programs.push((SOCKOPS.into(), prog.info()?.id()));
                        if pin.is_some() {
                            // A bpf_link (Linux ≥ 5.7; aya uses bpf_link_create there), not
                            // a legacy prog attach: only a link can be pinned.
                            let link: FdLink = prog.take_link(id)?.try_into().map_err(|e| {
                                anyhow!(
                                    "sockops is attached without a bpf_link, cannot pin it: {e}"
                                )
                            })?;
                            pin_link(link, SOCKOPS, &mut links)?;
                        }
                    }
                    Err(e) => {
                        warn!("sockops not attached to {}: {e}", cg.display());
                        degraded.push(format!("sockops not attached ({e}): TCP state is read at socket calls and by sock_diag only"));
                    }
                }
            }
            Err(e) => degraded.push(format!(
                "sockops disabled ({e}): TCP state is read at socket calls and by sock_diag only"
            )),
        }

        // The libssl uprobes: loaded (not attached) here; a kernel without them only loses
        // them. A verifier rejection is a hard error, as for every other program.
        let tls = match tls_supported()? {
            Ok(()) => {
                for p in tls::PROGRAMS {
                    let hook = if p.ret { "uretprobe" } else { "uprobe" };
                    let prog: &mut UProbe = ebpf
                        .program_mut(p.name)
                        .ok_or_else(|| anyhow!("program {} missing from the object", p.name))?
                        .try_into()?;
                    prog.load().map_err(|e| load_error(p.name, hook, e))?;
                    programs.push((p.name.into(), prog.info()?.id()));
                }
                hook_set.push_str("+libssl");
                TlsPrograms::Object
            }
            Err(why) => {
                warn!("libssl hooks not loaded: {why}");
                degraded.push(tls_degraded(&why));
                TlsPrograms::Unavailable(why)
            }
        };

        let zero: &mut Array<&mut MapData, SockState> = &mut Array::try_from(
            ebpf.map_mut("ZERO_SOCK")
                .ok_or_else(|| anyhow!("map ZERO_SOCK"))?,
        )?;
        zero.set(0, SockState::default(), 0)?;
        {
            let lay: &mut Array<&mut MapData, u32> = &mut Array::try_from(
                ebpf.map_mut("LAYOUT")
                    .ok_or_else(|| anyhow!("map LAYOUT missing from the object"))?,
            )?;
            for (i, v) in expected_layout()?.into_iter().enumerate() {
                lay.set(i as u32, v, 0)?;
            }
            let mut hooks = if hook_set.contains("+sockops") {
                layout::HOOK_SOCKOPS
            } else {
                0
            };
            match set {
                HookSet::Syscalls => hooks |= layout::HOOK_SYSCALLS,
                HookSet::Fentry => hooks |= layout::HOOK_FENTRY,
                HookSet::Kprobes => hooks |= layout::HOOK_KPROBES,
                HookSet::Tracepoints => {}
            }
            lay.set(layout::HOOKS, hooks, 0)?;
        }
        let mut maps = StdHashMap::new();
        for name in MAP_NAMES {
            let m = ebpf
                .take_map(name)
                .ok_or_else(|| anyhow!("map {name} missing from the object"))?;
            maps.insert(name.to_string(), m);
        }
        if let Some(dir) = pin {
            // The programs too: their statistics are read through these pins (no capability).
            for (name, _) in &programs {
                let p = dir.join(format!("prog_{name}"));
                ebpf.program_mut(name)
                    .ok_or_else(|| anyhow!("program {name} missing from the object"))?
                    .pin(&p)
                    .with_context(|| format!("pinning program {name} at {}", p.display()))?;
            }
            // LAYOUT last: a set whose LAYOUT is pinned had every other pin made before it.
            for name in MAP_NAMES
                .iter()
                .filter(|n| **n != "LAYOUT")
                .chain(&["LAYOUT"])
            {
                let p = dir.join(name);
                maps[*name]
                    .pin(&p)
                    .with_context(|| format!("pinning map {name} at {}", p.display()))?;
            }
        }
        drop(links);
        Ok(Self {
            _ebpf: Some(ebpf),
            maps,
            programs,
            pin_dir: pin.map(Path::to_path_buf),
            tls,
            hook_set,
            degraded,
            _kretprobes: kretprobes,
            batch_fds: StdHashMap::new(),
        })
    }

    /// Opens the set pinned under `dir` by an earlier agent, without loading anything: the
    /// programs keep running as they have since that agent loaded them.
    ///
    /// [`Pinned::Reusable`] needs the `LAYOUT` map to record this agent's
    /// [`layout_version`] and the sizes of `SockState`, `TcpSnapshot` and `MessageEvent`, and
    /// every map of [`MAP_NAMES`] and every program link the set recorded (sock_ops only if
    /// it was attached) to be pinned, and the libssl programs' `prog_` pins all or none (none:
    /// a set loaded where the kernel lacked uprobes; the hooks are then unavailable). The
    /// libssl programs are opened from their pins, to be attached per process by this agent:
    /// the earlier agent's uprobe links ended with it. Errors when the directory cannot be read, when it holds
    /// anything but this agent's pins ([`refuse_foreign`]: the caller must not remove such a
    /// directory's contents), and when [`layout_version`] does.
    pub fn open_pinned(dir: &Path, choice: HookChoice) -> Result<Pinned> {
        refuse_foreign(dir)?;
        let want = expected_layout()?;
        let present: Vec<String> = match std::fs::read_dir(dir) {
            Ok(e) => e
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Pinned::Absent),
            Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
        };
        if present.is_empty() {
            return Ok(Pinned::Absent);
        }
        let layout = match read_layout(&dir.join("LAYOUT")) {
            Ok(l) => l,
            Err(e) => return Ok(Pinned::Stale(format!("no readable LAYOUT map ({e:#})"))),
        };
        if layout[..want.len()] != want {
            return Ok(Pinned::Stale(format!(
                "pinned layout version {} (SockState {} B, TcpSnapshot {} B, MessageEvent {} B), \
             this agent's {} ({} B, {} B, {} B)",
                layout[0], layout[1], layout[2], layout[3], want[0], want[1], want[2], want[3]
            )));
        }
        let sockops = layout[layout::HOOKS as usize] & layout::HOOK_SOCKOPS != 0;
        let set = if layout[layout::HOOKS as usize] & layout::HOOK_SYSCALLS != 0 {
            HookSet::Syscalls
        } else if layout[layout::HOOKS as usize] & layout::HOOK_FENTRY != 0 {
            HookSet::Fentry
        } else if layout[layout::HOOKS as usize] & layout::HOOK_KPROBES != 0 {
            HookSet::Kprobes
        } else {
            HookSet::Tracepoints
        };
        if let Some(asked) = choice.forced().filter(|a| *a != set) {
            return Ok(Pinned::Stale(format!(
                "the pinned set is hook set `{}`, `{}` was asked for",
                set.name(),
                asked.name()
            )));
        }
        let mut links = set.attached();
        if sockops {
            links.push(SOCKOPS);
        }
        // The libssl uprobes have program pins only (their links are per process): all or
        // none (a set loaded on a kernel without uprobes).
        let tls_pins: Vec<String> = tls::PROGRAMS
            .iter()
            .map(|p| format!("prog_{}", p.name))
            .collect();
        let with_tls = tls_pins.iter().any(|n| present.contains(n));
        let missing: Vec<String> = MAP_NAMES
            .iter()
            .map(|m| m.to_string())
            .chain(links.iter().map(|l| format!("link_{l}")))
            .chain(links.iter().map(|l| format!("prog_{l}")))
            .chain(tls_pins.iter().filter(|_| with_tls).cloned())
            .filter(|n| !present.contains(n))
            .collect();
        if !missing.is_empty() {
            return Ok(Pinned::Stale(format!(
                "partial set, missing {}",
                missing.join(", ")
            )));
        }
        let mut maps = StdHashMap::new();
        for name in MAP_NAMES {
            let p = dir.join(name);
            let m = MapData::from_pin(&p)
                .map_err(anyhow::Error::from)
                .and_then(|d| Map::from_map_data(d).map_err(anyhow::Error::from));
            match m {
                Ok(m) => {
                    maps.insert(name.to_string(), m);
                }
                Err(e) => {
                    return Ok(Pinned::Stale(format!(
                        "map {} cannot be opened ({e:#})",
                        p.display()
                    )));
                }
            }
        }
        let mut programs = Vec::new();
        for name in links {
            let p = dir.join(format!("link_{name}"));
            match PinnedLink::from_pin(&p)
                .map_err(anyhow::Error::from)
                .and_then(|l| FdLink::from(l).info().map_err(anyhow::Error::from))
            {
                Ok(info) => programs.push((name.to_string(), info.program_id())),
                Err(e) => {
                    return Ok(Pinned::Stale(format!(
                        "link {} cannot be opened ({e:#})",
                        p.display()
                    )));
                }
            }
        }
        let mut degraded = Vec::new();
        let mut hook_set = if sockops {
            format!("{}+sockops", set.name())
        } else {
            degraded.push(
                "sockops not attached (the pinned set has none): TCP state is read at socket \
             calls and by sock_diag only"
                    .into(),
            );
            set.name().to_string()
        };
        let tls = if with_tls {
            let mut progs = StdHashMap::new();
            for p in tls::PROGRAMS {
                let path = dir.join(format!("prog_{}", p.name));
                let kind = if p.ret {
                    ProbeKind::Return
                } else {
                    ProbeKind::Entry
                };
                let opened = UProbe::from_pin(&path, kind)
                    .map_err(anyhow::Error::from)
                    .and_then(|u| Ok((u.info()?.id(), u)));
                match opened {
                    Ok((id, u)) => {
                        programs.push((p.name.to_string(), id));
                        progs.insert(p.name, u);
                    }
                    Err(e) => {
                        return Ok(Pinned::Stale(format!(
                            "program {} cannot be opened ({e:#})",
                            path.display()
                        )));
                    }
                }
            }
            hook_set.push_str("+libssl");
            TlsPrograms::Pinned(progs)
        } else {
            let why = "the pinned set has no libssl programs".to_string();
            degraded.push(tls_degraded(&why));
            TlsPrograms::Unavailable(why)
        };
        Ok(Pinned::Reusable(Box::new(Self {
            _ebpf: None,
            maps,
            programs,
            pin_dir: Some(dir.to_path_buf()),
            tls,
            hook_set,
            degraded,
            _kretprobes: Vec::new(),
            batch_fds: StdHashMap::new(),
        })))
    }

    fn map_mut(&mut self, name: &str) -> Result<&mut Map> {
        self.maps
            .get_mut(name)
            .ok_or_else(|| anyhow!("map {name} missing"))
    }

    fn hash<K: aya::Pod, V: aya::Pod>(
        &mut self,
        name: &str,
    ) -> Result<HashMap<&mut MapData, K, V>> {
        Ok(HashMap::try_from(self.map_mut(name)?)?)
    }

    /// Drops `+libssl` from [`Capture::hook_set`]: for a front end that attaches none of the
    /// libssl programs (`--no-tls-hooks`), which are then loaded but not in use.
    pub fn hook_set_without_libssl(&mut self) {
        self.hook_set = self.hook_set.replace("+libssl", "");
    }

    /// Every entry of the kernel's `SOCKETS` map: (cookie, state). The programs update a
    /// value in place while this reads it (no lock), so each value is read until two reads in
    /// a row are equal (up to 8 times; a socket still changing then is read once more and
    /// taken as is, which [`crate::model::Model::restore`] tolerates for messages: see there).
    /// Sockets destroyed between the key walk and the read are left out.
    pub fn sockets(&mut self) -> Result<Vec<(u64, SockState)>> {
        let map = self.hash::<u64, SockState>("SOCKETS")?;
        let keys: Vec<u64> = map.keys().filter_map(|k| k.ok()).collect();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let Ok(mut a) = map.get(&k, 0) else { continue };
            for _ in 0..8 {
                let Ok(b) = map.get(&k, 0) else { break };
                if pod_bytes(&a) == pod_bytes(&b) {
                    break;
                }
                a = b;
            }
            out.push((k, a));
        }
        Ok(out)
    }

    /// Whether `tgid` is in the kernel's `WATCHED_TGIDS` with [`watch::PRIMARY`] (watched by
    /// this agent, or by the earlier agent whose pinned set this one continues; an entry of an
    /// `observe` beside the daemon, [`watch::TAP`] only, is not).
    pub fn is_watched(&mut self, tgid: u32) -> bool {
        self.watch_value(tgid)
            .is_some_and(|v| v & watch::PRIMARY != 0)
    }

    /// The `WATCHED_TGIDS` value of `tgid` (root pid and [`watch`] flags), if it has one.
    pub fn watch_value(&mut self, tgid: u32) -> Option<u32> {
        self.hash::<u32, u32>("WATCHED_TGIDS")
            .ok()?
            .get(&tgid, 0)
            .ok()
    }

    /// Every `WATCHED_TGIDS` entry: (tgid, value).
    pub fn watch_entries(&mut self) -> Result<Vec<(u32, u32)>> {
        Ok(self
            .hash::<u32, u32>("WATCHED_TGIDS")?
            .iter()
            .filter_map(|e| e.ok())
            .collect())
    }

    /// Sets the `WATCHED_TGIDS` value of `tgid` to `value`. With `only_existing`, only if the
    /// entry exists (`BPF_EXIST`: never re-creates an entry the exit hook just removed);
    /// `Ok(false)` then when it does not.
    pub fn set_watch_value(&mut self, tgid: u32, value: u32, only_existing: bool) -> Result<bool> {
        self.mark_maybe_watched(tgid)?;
        let flags = if only_existing { BPF_EXIST } else { 0 };
        match self
            .hash::<u32, u32>("WATCHED_TGIDS")?
            .insert(tgid, value, flags)
        {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::SyscallError(e))
                if only_existing && e.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Sets `tgid`'s entry of the kernel's `MAYBE_WATCHED` filter
    /// ([`watch::FILTER_LEN`]), which every `WATCHED_TGIDS` entry needs before it is made:
    /// the hooks turn away a process whose entry is 0 without looking further. Only ever set
    /// to 1, by this and by the fork hook, so concurrent writers cannot undo each other.
    fn mark_maybe_watched(&mut self, tgid: u32) -> Result<()> {
        aya::maps::Array::<_, u8>::try_from(self.map_mut("MAYBE_WATCHED")?)?
            .set(watch::filter_index(tgid), 1, 0)
            .context("setting the MAYBE_WATCHED entry")?;
        Ok(())
    }

    /// Removes `tgid`'s `WATCHED_TGIDS` entry (no error if it is gone).
    pub fn remove_watch(&mut self, tgid: u32) -> Result<()> {
        let _ = self.hash::<u32, u32>("WATCHED_TGIDS")?.remove(&tgid);
        Ok(())
    }

    /// Whether `cookie` was marked as existing before its process was watched.
    pub fn is_preexisting(&mut self, cookie: u64) -> bool {
        self.hash::<u64, u8>("PREEXISTING")
            .ok()
            .is_some_and(|m| m.get(&cookie, 0).is_ok())
    }

    /// Starts watching process `tgid` (its threads, and children it forks from now on).
    pub fn watch_pid(&mut self, tgid: u32) -> Result<()> {
        self.watch_pid_under(tgid, tgid)
    }

    /// Starts watching process `tgid` as part of the watch of `root` (its value in
    /// `WATCHED_TGIDS`, inherited by the children it forks: [`Capture::unwatch_tree`] removes
    /// them together).
    /// The entry gets [`watch::PRIMARY`] (records to `EVENTS`, this agent's ring), keeping
    /// the [`watch::TAP`] flag of an `observe` beside the daemon.
    pub fn watch_pid_under(&mut self, tgid: u32, root: u32) -> Result<()> {
        if tgid == std::process::id() {
            bail!("refusing to watch the observer itself (pid {tgid})");
        }
        let tap = self.watch_value(tgid).unwrap_or(0) & watch::TAP;
        self.mark_maybe_watched(tgid)?;
        self.hash::<u32, u32>("WATCHED_TGIDS")?.insert(
            tgid,
            (root & watch::ROOT_MASK) | watch::PRIMARY | tap,
            0,
        )?;
        Ok(())
    }

    /// Lets sockops enrol new connections to or from local/remote `port`.
    pub fn watch_port(&mut self, port: u16) -> Result<()> {
        self.hash::<u16, u8>("WATCH_PORTS")?.insert(port, 1, 0)?;
        Ok(())
    }

    /// Marks a socket that existed before observation started: the kernel hunts for its
    /// message boundaries instead of expecting a link phase. `how` is one of
    /// [`spice_ebpf_common::config::preexisting`] (whether the socket was accepted or
    /// connected, which gives each direction's SPICE role).
    pub fn mark_preexisting(&mut self, cookie: u64, how: u8) -> Result<()> {
        self.hash::<u64, u8>("PREEXISTING")?
            .insert(cookie, how, 0)?;
        Ok(())
    }

    /// A descriptor of hash map `name` of this capture's own, for [`lookup_batch`], and the
    /// map's `max_entries`; `None` when it cannot be had or the kernel refused a batch read of
    /// it once (then the callers read key by key). Found once per map ([`dup_map_fd`]).
    fn batch_fd(&mut self, name: &'static str) -> Option<(BorrowedFd<'_>, u32)> {
        if !self.batch_fds.contains_key(name) {
            let fd = match self.maps.get(name) {
                Some(Map::HashMap(data)) => {
                    dup_map_fd(data).and_then(|fd| Some((fd, data.info().ok()?.max_entries())))
                }
                _ => None,
            };
            if fd.is_none() {
                debug!("map {name}: no descriptor for batch reads; reading it key by key");
            }
            self.batch_fds.insert(name, fd);
        }
        self.batch_fds
            .get(name)?
            .as_ref()
            .map(|(fd, max)| (fd.as_fd(), *max))
    }

    /// Every entry of hash map `name` in as few `bpf(2)` calls as it takes
    /// ([`lookup_batch`]), when `expected` entries are wanted; `None` if batch reads are not
    /// available for it (the kernel's refusal is logged once and the map is read key by key
    /// from then on) or would cost more than `expected` single lookups ([`batch_pays`]).
    fn entries_batch<V: aya::Pod>(
        &mut self,
        name: &'static str,
        expected: usize,
    ) -> Option<Vec<(u64, V)>> {
        let (fd, max_entries) = self.batch_fd(name)?;
        if !batch_pays(expected, max_entries) {
            return None;
        }
        match lookup_batch::<u64, V>(fd, expected) {
            Ok(v) => Some(v),
            Err(e) => {
                debug!("map {name}: batch read refused ({e}); reading it key by key");
                self.batch_fds.insert(name, None);
                None
            }
        }
    }

    /// One read of the `SOCKETS` entry of each of `cookies` that has one: the whole map in
    /// one batch read (a few `bpf(2)` calls for thousands of sockets) when that pays
    /// ([`batch_pays`]), else one lookup per cookie. The programs update a value in place
    /// while it is read, so a value's counts and window may be torn: trust them only where a
    /// second read agrees ([`same_counts`]; [`Capture::sock_state`] reads until two do). Its
    /// `tcp.write_seq` and `tcp.copied_seq` are aligned 32-bit words, never torn.
    pub fn sock_entries(&mut self, cookies: &[u64]) -> StdHashMap<u64, SockState> {
        if cookies.is_empty() {
            return StdHashMap::new();
        }
        match self.entries_batch::<SockState>("SOCKETS", cookies.len()) {
            Some(all) => {
                let want: std::collections::HashSet<u64> = cookies.iter().copied().collect();
                all.into_iter().filter(|(c, _)| want.contains(c)).collect()
            }
            None => {
                let Ok(map) = self.hash::<u64, SockState>("SOCKETS") else {
                    return StdHashMap::new();
                };
                cookies
                    .iter()
                    .filter_map(|&c| Some((c, map.get(&c, 0).ok()?)))
                    .collect()
            }
        }
    }

    /// [`Capture::sock_state`] of each of `cookies` that has an entry, with the same rule for
    /// values the programs change while they are read: the whole `SOCKETS` map is read twice
    /// in batches ([`lookup_batch`]); an entry whose counts and window agree in both reads is
    /// taken, one that changed in between is read again alone ([`Capture::sock_state`]).
    /// Without batch reads, key by key.
    pub fn sock_states(&mut self, cookies: &[u64]) -> StdHashMap<u64, SockState> {
        let mut out = StdHashMap::with_capacity(cookies.len());
        if cookies.is_empty() {
            return out;
        }
        let n = cookies.len();
        let batches = self
            .entries_batch::<SockState>("SOCKETS", n)
            .and_then(|a| Some((a, self.entries_batch::<SockState>("SOCKETS", n)?)));
        let Some((first, second)) = batches else {
            for &c in cookies {
                if let Some(st) = self.sock_state(c) {
                    out.insert(c, st);
                }
            }
            return out;
        };
        let want: std::collections::HashSet<u64> = cookies.iter().copied().collect();
        let first: StdHashMap<u64, SockState> = first
            .into_iter()
            .filter(|(c, _)| want.contains(c))
            .collect();
        let mut changed = Vec::new();
        for (c, b) in second {
            match first.get(&c) {
                Some(a) if same_counts(a, &b) => {
                    out.insert(c, b);
                }
                Some(_) => changed.push(c),
                None => {}
            }
        }
        for c in changed {
            if let Some(st) = self.sock_state(c) {
                out.insert(c, st);
            }
        }
        out
    }

    /// Latest TCP state a kernel hook read for `cookie` ([`SockState::tcp`]), if any: `None`
    /// when the socket has no `SOCKETS` entry or no state was read yet. One read of the entry:
    /// its `write_seq` and `copied_seq` are aligned 32-bit words, never torn, and each other
    /// member is as recent as that read.
    pub fn tcp_state(&mut self, cookie: u64) -> Option<TcpSnapshot> {
        self.hash::<u64, SockState>("SOCKETS")
            .ok()?
            .get(&cookie, 0)
            .ok()
            .map(|s| s.tcp)
            .filter(|t| t.ts_ns != 0)
    }

    /// The kernel's state of socket `cookie` (`SOCKETS`: framing, byte totals and ACK window),
    /// if it has an entry. The map value is copied without a lock while the kernel may be
    /// writing it, so it is read until two reads in a row agree (at most 3 reads); `None` if
    /// they never do, or on any error.
    pub fn sock_state(&mut self, cookie: u64) -> Option<SockState> {
        let map = self.hash::<u64, SockState>("SOCKETS").ok()?;
        let mut prev = map.get(&cookie, 0).ok()?;
        for _ in 0..2 {
            let next = map.get(&cookie, 0).ok()?;
            if same_counts(&prev, &next) {
                return Some(next);
            }
            prev = next;
        }
        None
    }

    /// Stops watching the processes of one watch: every `WATCHED_TGIDS` entry whose key or
    /// root (the watched pid a forked child descends from, `spice-ebpf/src/probes/sched.rs`)
    /// is one of `roots`. An entry an `observe` beside the daemon also reads
    /// ([`watch::TAP`]) only loses [`watch::PRIMARY`]. Returns the tgids unwatched.
    pub fn unwatch_tree(&mut self, roots: &[u32]) -> Result<Vec<u32>> {
        let mut map = self.hash::<u32, u32>("WATCHED_TGIDS")?;
        let gone: Vec<(u32, u32)> = map
            .iter()
            .filter_map(|e| e.ok())
            .filter(|(k, v)| roots.contains(k) || roots.contains(&(v & watch::ROOT_MASK)))
            .collect();
        for (k, v) in &gone {
            if v & watch::TAP != 0 {
                let _ = map.insert(*k, v & !watch::PRIMARY, BPF_EXIST);
            } else {
                // Gone already (the exit hook removes exited tgids): nothing to do.
                let _ = map.remove(k);
            }
        }
        Ok(gone.into_iter().map(|(k, _)| k).collect())
    }

    /// Per-program kernel run-time statistics (`bpf_prog_info.run_time_ns` / `run_cnt`):
    /// (program name in the object, run time ns, run count). Zeros unless the kernel's
    /// statistics are on (`BPF_ENABLE_STATS`, see [`enable_run_time_stats`]).
    pub fn program_stats(&self) -> Vec<(String, u64, u64)> {
        // Through the program's own descriptor or pin: enumerating programs by id
        // (BPF_PROG_GET_NEXT_ID) needs CAP_SYS_ADMIN, which the daemon drops after attach.
        let mut out: Vec<(String, u64, u64)> = self
            .programs
            .iter()
            .filter_map(|(name, _id)| {
                let info = match (&self.pin_dir, &self._ebpf) {
                    (Some(dir), _) => {
                        aya::programs::ProgramInfo::from_pin(dir.join(format!("prog_{name}")))
                            .ok()?
                    }
                    (None, Some(ebpf)) => ebpf.program(name)?.info().ok()?,
                    (None, None) => return None,
                };
                Some((
                    name.clone(),
                    info.run_time().as_nanos() as u64,
                    info.run_count(),
                ))
            })
            .collect();
        out.sort();
        out
    }

    /// Sum over CPUs of each kernel counter (`spice_ebpf_common::config::counter`).
    pub fn counters(&self) -> Result<[u64; counter::COUNT as usize]> {
        let map: PerCpuArray<&MapData, u64> = PerCpuArray::try_from(
            self.maps
                .get("COUNTERS")
                .ok_or_else(|| anyhow!("map COUNTERS"))?,
        )?;
        let mut out = [0u64; counter::COUNT as usize];
        for (i, slot) in out.iter_mut().enumerate() {
            *slot = map.get(&(i as u32), 0)?.iter().sum();
        }
        Ok(out)
    }

    /// Takes the event ring (call once).
    pub fn take_ring(&mut self) -> Result<RingBuf<MapData>> {
        self.take_ring_named("EVENTS")
    }

    /// Takes ring `name` (`EVENTS` or `TAP_EVENTS`; call once per ring).
    pub fn take_ring_named(&mut self, name: &str) -> Result<RingBuf<MapData>> {
        Ok(RingBuf::try_from(self.maps.remove(name).ok_or_else(
            || anyhow!("map {name} missing or already taken"),
        )?)?)
    }

    /// The file descriptors of this process that are links of the libssl programs
    /// ([`tls::PROGRAMS`]), read from `/proc/self/fdinfo` (`prog_id`, fs/proc/fd.c and
    /// `bpf_link_show_fdinfo`): (entry programs' links, the uretprobe's links), each sorted.
    pub fn tls_link_fds(&self) -> (Vec<i32>, Vec<i32>) {
        let id_of = |name: &str| {
            self.programs
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, id)| *id)
        };
        let ret = id_of(tls::RET_PROGRAM);
        let entries: Vec<u32> = tls::PROGRAMS
            .iter()
            .filter(|p| !p.ret)
            .filter_map(|p| id_of(p.name))
            .collect();
        let (mut e, mut r) = (Vec::new(), Vec::new());
        for d in std::fs::read_dir("/proc/self/fdinfo")
            .into_iter()
            .flatten()
            .flatten()
        {
            let Some(fd) = d.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(text) = std::fs::read_to_string(d.path()) else {
                continue;
            };
            if !text.lines().any(|l| l.starts_with("link_type:")) {
                continue;
            }
            let prog = text.lines().find_map(|l| {
                l.strip_prefix("prog_id:")
                    .and_then(|v| v.trim().parse::<u32>().ok())
            });
            match prog {
                Some(id) if Some(id) == ret => r.push(fd),
                Some(id) if entries.contains(&id) => e.push(fd),
                _ => {}
            }
        }
        e.sort();
        r.sort();
        (e, r)
    }

    /// The ports in `WATCH_PORTS`.
    pub fn watch_ports(&mut self) -> Result<Vec<u16>> {
        Ok(self
            .hash::<u16, u8>("WATCH_PORTS")?
            .keys()
            .filter_map(|k| k.ok())
            .collect())
    }

    /// Removes `port` from `WATCH_PORTS` (no error if absent).
    pub fn unwatch_port(&mut self, port: u16) -> Result<()> {
        let _ = self.hash::<u16, u8>("WATCH_PORTS")?.remove(&port);
        Ok(())
    }

    /// The cookies in `PREEXISTING`.
    pub fn preexisting(&mut self) -> Result<Vec<u64>> {
        Ok(self
            .hash::<u64, u8>("PREEXISTING")?
            .keys()
            .filter_map(|k| k.ok())
            .collect())
    }

    /// Removes `cookie` from `PREEXISTING` (no error if absent).
    pub fn unmark_preexisting(&mut self, cookie: u64) -> Result<()> {
        let _ = self.hash::<u64, u8>("PREEXISTING")?.remove(&cookie);
        Ok(())
    }

    /// Drops socket `cookie`'s kernel state (its `SOCKETS` entry), as the destroy hook does;
    /// no error if absent.
    pub fn forget_socket(&mut self, cookie: u64) -> Result<()> {
        let _ = self.hash::<u64, SockState>("SOCKETS")?.remove(&cookie);
        Ok(())
    }
}

/// Whether two reads of a `SOCKETS` value agree on what [`Capture::sock_state`] must read
/// consistently: the window, the byte totals, each direction's message count and its
/// early-announced message.
pub fn same_counts(a: &SockState, b: &SockState) -> bool {
    a.window == b.window
        && a.msg_bytes == b.msg_bytes
        && (0..2).all(|d| {
            a.dir[d].msg_count == b.dir[d].msg_count
                && a.dir[d].announced_at == b.dir[d].announced_at
        })
}

/// `BPF_MAP_LOOKUP_BATCH` (`enum bpf_cmd`, include/uapi/linux/bpf.h; Linux 5.6).
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// The `batch` member of `union bpf_attr` (include/uapi/linux/bpf.h), the argument of the
/// `BPF_MAP_*_BATCH` commands.
#[repr(C)]
#[derive(Default)]
struct BpfBatchAttr {
    /// Where the walk starts: a pointer to the token a previous call gave, 0 for the start.
    in_batch: u64,
    /// Where the kernel writes the token of the next call.
    out_batch: u64,
    /// Arrays of `count` keys and values the kernel fills.
    keys: u64,
    values: u64,
    /// In: room in the arrays; out: entries written.
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Whether one batch walk of a hash map of `max_entries` costs less than `wanted` single
/// lookups. The kernel's batch read visits every bucket (one per entry of `max_entries`,
/// rounded up to a power of two), locking each (`__htab_map_lookup_and_delete_batch`):
/// tens of ns per bucket whether it holds anything or not, so a walk of an 8192-entry map
/// costs about as much as a few hundred `BPF_MAP_LOOKUP_ELEM` calls (about 0.5 µs each). On
/// the rig's 2-CPU VM, `observe` of 10 sessions × 635 msgs/s spent 11 % of its time in
/// those walks (perf, three walks of 8192-entry maps per sample for 20 sockets). A batch
/// read is taken from [`BATCH_MIN_SHARE`] of the map on.
fn batch_pays(wanted: usize, max_entries: u32) -> bool {
    wanted.saturating_mul(BATCH_MIN_SHARE) >= max_entries as usize
}

/// See [`batch_pays`]: batch reads from 1/32 of a map's capacity on (256 sockets of 8192).
const BATCH_MIN_SHARE: usize = 32;

/// Entries asked for per `BPF_MAP_LOOKUP_BATCH` call (grown when a hash bucket holds more).
const BATCH_ENTRIES: usize = 128;

/// Every entry of the BPF hash map behind `fd` (key `K`, value `V`), by
/// `BPF_MAP_LOOKUP_BATCH`: one `bpf(2)` call per [`BATCH_ENTRIES`] entries (fewer per call when
/// about `expected` entries are expected: the arrays are sized for them) instead of two per
/// entry (`BPF_MAP_GET_NEXT_KEY` and `BPF_MAP_LOOKUP_ELEM`). The kernel walks the buckets in
/// order, copying each bucket's entries under the bucket's lock (kernel/bpf/hashtab.c
/// `__htab_map_lookup_and_delete_batch`; the token is a `u32` bucket index), so entries
/// added or removed during the walk may or may not appear, and a value a program changes in
/// place during the copy may be torn, as with a single lookup. Errors: the kernel's (`EINVAL`
/// or `ENOTSUPP` on kernels or map types without batch support).
fn lookup_batch<K: aya::Pod, V: aya::Pod>(
    fd: BorrowedFd<'_>,
    expected: usize,
) -> std::io::Result<Vec<(K, V)>> {
    // SAFETY: `Pod` types are plain `repr(C)` data, for which all-zero bytes are a value.
    let zk: K = unsafe { std::mem::zeroed() };
    let zv: V = unsafe { std::mem::zeroed() };
    let mut room = (expected + 16).next_power_of_two().min(BATCH_ENTRIES);
    let (mut keys, mut values) = (vec![zk; room], vec![zv; room]);
    let mut out = Vec::new();
    let (mut token, mut next) = (0u32, 0u32);
    let mut first = true;
    loop {
        let mut attr = BpfBatchAttr {
            in_batch: if first { 0 } else { &raw const token as u64 },
            out_batch: &raw mut next as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: room as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        // SAFETY: the attribute points at arrays of `room` keys and values and at two u32
        // tokens, all alive and writable for the call; the kernel writes at most that.
        let r = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &raw mut attr,
                std::mem::size_of::<BpfBatchAttr>(),
            )
        };
        let err = (r < 0).then(std::io::Error::last_os_error);
        match err.as_ref().and_then(|e| e.raw_os_error()) {
            None | Some(libc::ENOENT) => {}
            // One bucket holds more entries than there is room for: more room, same bucket.
            Some(libc::ENOSPC) if attr.count == 0 && room < (1 << 16) => {
                room *= 4;
                keys.resize(room, zk);
                values.resize(room, zv);
                continue;
            }
            Some(_) => return Err(err.unwrap_or_else(std::io::Error::last_os_error)),
        }
        let n = (attr.count as usize).min(room);
        out.extend(keys[..n].iter().copied().zip(values[..n].iter().copied()));
        if err.is_some() {
            // ENOENT: the walk reached the last bucket.
            return Ok(out);
        }
        token = next;
        first = false;
    }
}

/// A descriptor of the agent's own for `map`, found among the process's descriptors by the
/// map's id (`/proc/self/fdinfo/N`, `map_id:`; `aya` keeps a map's descriptor private) and
/// duplicated (`F_DUPFD_CLOEXEC`). Needs no capability (`BPF_MAP_GET_FD_BY_ID` would need
/// `CAP_SYS_ADMIN`, which the daemon drops). `None` if not found.
fn dup_map_fd(map: &MapData) -> Option<OwnedFd> {
    let id = map.info().ok()?.id();
    for e in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(info) = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")) else {
            continue;
        };
        let same = info.lines().any(|l| {
            l.strip_prefix("map_id:")
                .is_some_and(|v| v.trim().parse::<u32>().ok() == Some(id))
        });
        if same {
            // SAFETY: fcntl on a descriptor of this process; the new one is owned here.
            let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
            if new >= 0 {
                // SAFETY: `new` is a fresh descriptor nobody else owns.
                return Some(unsafe { OwnedFd::from_raw_fd(new) });
            }
        }
    }
    None
}

fn pod_bytes<T: aya::Pod>(v: &T) -> &[u8] {
    // SAFETY: `T: Pod` is plain `repr(C)` data; reading its bytes is sound (padding included:
    // both values were copied whole from the same kernel map value).
    unsafe { std::slice::from_raw_parts(v as *const T as *const u8, std::mem::size_of::<T>()) }
}

/// Reads the pinned `LAYOUT` map at `path`: its [`layout::COUNT`] entries.
fn read_layout(path: &Path) -> Result<[u32; layout::COUNT as usize]> {
    let map = Map::from_map_data(MapData::from_pin(path)?)?;
    let arr: Array<MapData, u32> = Array::try_from(map)?;
    let mut out = [0u32; layout::COUNT as usize];
    for (i, slot) in out.iter_mut().enumerate() {
        *slot = arr.get(&(i as u32), 0)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::io;

    use aya::sys::SyscallError;

    use super::*;

    fn text(e: &anyhow::Error) -> String {
        format!("{e:#}")
    }

    /// `auto` takes `tracepoints` alone where both typedefs are in the BTF, else tries the
    /// other sets cheapest first; a forced set is the only candidate.
    #[test]
    fn auto_tries_the_cheapest_set_first() {
        let all = |_: &str| true;
        let none = |_: &str| false;
        let (c, why) = choose_hook_set(HookChoice::Auto, &all).unwrap();
        assert_eq!((c, why), (vec![HookSet::Tracepoints], None));
        let (c, why) = choose_hook_set(HookChoice::Auto, &none).unwrap();
        assert_eq!(c, [HookSet::Fentry, HookSet::Kprobes, HookSet::Syscalls]);
        assert!(why.unwrap().contains("sock_send_length"));
        for forced in [
            HookChoice::Fentry,
            HookChoice::Kprobes,
            HookChoice::Syscalls,
        ] {
            let (c, why) = choose_hook_set(forced, &none).unwrap();
            assert_eq!((c, why), (vec![forced.forced().unwrap()], None));
        }
        let e = choose_hook_set(HookChoice::Tracepoints, &none).unwrap_err();
        assert!(text(&e).contains(UNAVAILABLE), "{e:#}");
        assert!(choose_hook_set(HookChoice::Tcpinfo, &all).is_err());
    }

    /// The fallback note names the set, why not `tracepoints`, each refusal before it, and
    /// the host-wide cost of the two sets that have one.
    #[test]
    fn fallback_note_says_why() {
        assert_eq!(fallback_note(HookSet::Tracepoints, None, &[]), None);
        let n = fallback_note(HookSet::Fentry, Some("no tp"), &[]).unwrap();
        assert_eq!(n, "hook set `fentry`, not `tracepoints`: no tp");
        let n = fallback_note(
            HookSet::Syscalls,
            Some("no tp"),
            &["`fentry`: EPERM".into(), "`kprobes`: absent".into()],
        )
        .unwrap();
        assert!(
            n.starts_with(
                "hook set `syscalls`, not `tracepoints`: no tp; refused before it: `fentry`: \
                 EPERM; `kprobes`: absent; a program runs at every syscall exit"
            ),
            "{n}"
        );
        let n = fallback_note(HookSet::Kprobes, Some("no tp"), &[]).unwrap();
        assert!(
            n.contains("kretprobe run at every TCP send and receive"),
            "{n}"
        );
    }

    /// Batch reads start at 1/32 of the map: 256 of the 8192-entry `SOCKETS`, one of a
    /// 32-entry map; never for nothing wanted of a big map.
    #[test]
    fn batch_reads_pay_from_a_share_of_the_map() {
        assert!(!batch_pays(20, 8192));
        assert!(!batch_pays(255, 8192));
        assert!(batch_pays(256, 8192));
        assert!(batch_pays(1, 32));
        assert!(!batch_pays(0, 8192));
    }

    /// A batch read of a real kernel hash map gives every entry exactly once, across several
    /// calls (more entries than one call's room), through a descriptor found by the map's id;
    /// an empty map gives none. Needs root (creating a BPF map): skipped otherwise.
    #[test]
    fn batch_reads_give_every_entry_once() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("not root: skipped (creating a BPF map needs CAP_BPF)");
            return;
        }
        use aya::maps::IterableMap as _;
        let mut map: HashMap<MapData, u64, TcpSnapshot> = HashMap::create(4096, 0).unwrap();
        let fd = dup_map_fd(map.map()).expect("the map's descriptor among ours");
        assert!(
            lookup_batch::<u64, TcpSnapshot>(fd.as_fd(), 0)
                .unwrap()
                .is_empty()
        );
        let n = 3 * BATCH_ENTRIES as u64 + 17;
        for k in 0..n {
            let v = TcpSnapshot {
                write_seq: k as u32 * 7,
                copied_seq: !(k as u32),
                ..Default::default()
            };
            map.insert(k * 1_000_003, v, 0).unwrap();
        }
        let mut got = lookup_batch::<u64, TcpSnapshot>(fd.as_fd(), 10).unwrap();
        got.sort_by_key(|(k, _)| *k);
        assert_eq!(got.len() as u64, n);
        for (i, (k, v)) in got.iter().enumerate() {
            assert_eq!(*k, i as u64 * 1_000_003);
            assert_eq!((v.write_seq, v.copied_seq), (i as u32 * 7, !(i as u32)));
        }
    }

    /// A tracepoint whose `btf_trace_` typedef the BTF lacks is "not available", named.
    #[test]
    fn missing_tracepoint_typedef_is_unavailable() {
        let asked = std::cell::RefCell::new(Vec::new());
        let lookup = |name: &str| {
            asked.borrow_mut().push(name.to_string());
            false
        };
        let e = require_tracepoint("sock_send_length", "the `tracepoints` hook set", &lookup)
            .unwrap_err();
        assert_eq!(*asked.borrow(), ["btf_trace_sock_send_length"]);
        let t = text(&e);
        assert!(t.contains(UNAVAILABLE), "{t}");
        assert!(t.contains("tracepoint `sock_send_length`"), "{t}");
        assert!(t.contains("the `tracepoints` hook set"), "{t}");
    }

    #[test]
    fn present_tracepoint_typedef_passes() {
        require_tracepoint("sys_enter", "x", &|name| name == "btf_trace_sys_enter").unwrap();
    }

    /// A probe that cannot decide (EPERM from bpf(2)) is a hard error, not "not available".
    #[test]
    fn undecided_probe_is_a_hard_error() {
        let probe = Err(anyhow::Error::from(ProgramError::SyscallError(
            SyscallError {
                call: "bpf_prog_load",
                io_error: io::Error::from_raw_os_error(libc::EPERM),
            },
        )));
        let t = text(&require("BPF program type `sock_ops`", "sockops", probe).unwrap_err());
        assert!(!t.contains(UNAVAILABLE), "{t}");
        assert!(t.contains("sock_ops"), "{t}");
        assert!(t.contains("Operation not permitted"), "{t}");
    }

    #[test]
    fn unsupported_program_type_is_unavailable() {
        let t =
            text(&require("BPF program type `raw_tracepoint`", "hooks", Ok(false)).unwrap_err());
        assert!(t.contains(UNAVAILABLE), "{t}");
        assert!(t.contains("raw_tracepoint"), "{t}");
    }

    /// Load failures of a probed-present hook (verifier rejection, EPERM, EINVAL) are hard
    /// errors carrying the kernel's message.
    #[test]
    fn load_failures_are_hard_errors() {
        let t = text(&refused(
            "spice_sock_send",
            "tp_btf/sock_send_length",
            &io::Error::from_raw_os_error(libc::EACCES),
            "R1 invalid mem access 'scalar'",
        ));
        assert!(!t.contains(UNAVAILABLE), "{t}");
        assert!(t.contains("R1 invalid mem access"), "{t}");
        assert!(t.contains("tp_btf/sock_send_length"), "{t}");
        for errno in [libc::EPERM, libc::EINVAL] {
            let e = ProgramError::SyscallError(SyscallError {
                call: "bpf_prog_load",
                io_error: io::Error::from_raw_os_error(errno),
            });
            let t = text(&load_error("spice_sock_send", "tp_btf/sock_send_length", e));
            assert!(!t.contains(UNAVAILABLE), "{t}");
            assert!(t.contains("tp_btf/sock_send_length"), "{t}");
        }
    }

    /// Only the agent's own names are its pins: its maps, link_/prog_ of its programs, and
    /// the retired names of earlier versions.
    #[test]
    fn owned_pin_names() {
        for n in [
            "PENDING_CALLS",
            "link_spice_sys_enter",
            "prog_spice_sys_enter",
            "LAYOUT",
            "SOCKETS",
            "link_spice_exit",
            "prog_spice_sockops",
            "prog_spice_ssl_ret",
            "prog_spice_ssl_context",
            "tls_4242_981234_254-1-1836263_16_spice_ssl_ret_SSL_write",
            "tls_7_1_0-27-12_10_spice_ssl_context_SSL_peek",
        ] {
            assert!(is_owned_pin(n), "{n}");
        }
        for n in [
            "FOREIGN_MAP",
            "link_other",
            "prog_",
            "tc",
            "layout",
            "link_LAYOUT",
            "prog_spice_ssl_other",
            "tls_4242_981234_254-1-1836263_16_spice_ssl_ret",
            "tls_4242_981234_254-1-1836263_16_spice_ssl_write_SSL_read",
        ] {
            assert!(!is_owned_pin(n), "{n}");
        }
    }

    /// A directory with anything foreign (a file of another name, a subdirectory even of an
    /// owned name) is refused by `unpin_contents`/`unpin`, naming the entries and removing
    /// nothing; without them only the owned pins go. (Plain files stand in for pins: the
    /// names are what is checked.)
    #[test]
    fn unpin_never_removes_foreign_entries() {
        let dir =
            std::env::temp_dir().join(format!("spice-observer-foreign-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("SOCKETS_dir/LAYOUT")).unwrap();
        for f in [
            "LAYOUT",
            "link_spice_sys_enter",
            "prog_spice_fork",
            "FOREIGN_MAP",
        ] {
            std::fs::write(dir.join(f), "").unwrap();
        }
        let mut sub = dir.join("LAYOUT");
        sub.set_file_name("EVENTS");
        std::fs::create_dir(&sub).unwrap();
        assert_eq!(
            foreign_entries(&dir).unwrap(),
            ["EVENTS/", "FOREIGN_MAP", "SOCKETS_dir/"]
        );
        for r in [unpin_contents(&dir).map(|_| ()), unpin(&dir).map(|_| ())] {
            let t = text(&r.unwrap_err());
            assert!(
                t.contains("FOREIGN_MAP") && t.contains("EVENTS/") && t.contains("dedicated"),
                "{t}"
            );
        }
        for f in [
            "LAYOUT",
            "link_spice_sys_enter",
            "prog_spice_fork",
            "FOREIGN_MAP",
        ] {
            assert!(dir.join(f).exists(), "{f} removed");
        }
        std::fs::remove_file(dir.join("FOREIGN_MAP")).unwrap();
        std::fs::remove_dir_all(dir.join("SOCKETS_dir")).unwrap();
        std::fs::remove_dir(&sub).unwrap();
        let (gone, left) = unpin(&dir).unwrap();
        assert_eq!(gone, ["link_spice_sys_enter", "LAYOUT", "prog_spice_fork"]);
        assert_eq!(left, DirLeft::Removed);
        assert!(!dir.exists());
        assert_eq!(unpin(&dir).unwrap(), (Vec::new(), DirLeft::Removed));
    }

    /// The test override of the layout version is a decimal number or an error.
    #[test]
    fn layout_override_must_be_a_number() {
        assert_eq!(parse_layout_override(" 7\n").unwrap(), 7);
        for bad in ["abc", "", "-1", "1.5", "99999999999"] {
            let t = text(&parse_layout_override(bad).unwrap_err());
            assert!(
                t.contains(LAYOUT_VERSION_OVERRIDE_ENV) && t.contains(&format!("{bad:?}")),
                "{t}"
            );
        }
    }

    /// This machine's BTF has the typedef of every tracepoint the hook set uses, and not one
    /// of a tracepoint that does not exist. Skipped (loudly) without kernel BTF.
    #[test]
    fn this_kernel_btf_has_the_tracepoint_typedefs() {
        let path = std::path::Path::new(VMLINUX_BTF);
        if !path.exists() {
            eprintln!("SKIP: {VMLINUX_BTF} missing (kernel without CONFIG_DEBUG_INFO_BTF)");
            return;
        }
        let kbtf = KernelBtf::open(path).unwrap();
        for (_, tp) in BTF_TRACEPOINTS {
            assert!(kbtf.has_typedef(&format!("btf_trace_{tp}")), "{tp}");
        }
        assert!(!kbtf.has_typedef("btf_trace_no_such_tracepoint_xyz"));
    }
}
