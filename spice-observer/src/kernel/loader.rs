//! Loads and attaches the kernel programs, and gives typed access to their maps.
//!
//! Hook set `tracepoints` (the only one so far; fentry/fexit are refused and kprobes absent on
//! the kernels this was built on): `raw_tracepoint/sys_enter`, `tp_btf/sock_send_length`,
//! `tp_btf/sock_recv_length`, `tp_btf/sched_process_fork`, `tp_btf/sched_process_exit`,
//! `tp_btf/inet_sock_set_state`, `tp_btf/tcp_destroy_sock`, plus `sock_ops` on the cgroup-v2 root when a cgroup2 mount
//! exists (then the hook set is reported as `tracepoints+sockops`).
//!
//! Before loading each program the kernel is probed for what it needs, independently of the
//! load: the program type (`aya::sys::is_program_supported`) and, for tracepoints, the
//! `btf_trace_<event>` typedef in the kernel's BTF. Only a probe that finds the feature
//! missing gives an error containing [`UNAVAILABLE`] ("… is not available on this kernel");
//! every other failure (permission, a verifier rejection, an attach error, a probe that could
//! not decide) is a hard error with the kernel's message, never that phrase.

use std::{fs::File, path::PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use aya::{
    Btf, Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, PerCpuArray, RingBuf},
    programs::{
        BtfTracePoint, ProgramError, ProgramType, RawTracePoint, SockOps, links::CgroupAttachMode,
    },
    sys::is_program_supported,
};
use log::{debug, warn};
use spice_ebpf_common::{
    config::{KernelConfig, counter},
    event::{SockState, TcpSnapshot},
};

use crate::btf::{KernelBtf, VMLINUX_BTF};

/// The compiled kernel programs (built by `build.rs` with bpf-linker).
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/spice-ebpf"));

/// The `tp_btf` programs: (program name in the object, kernel tracepoint).
const BTF_TRACEPOINTS: [(&str, &str); 6] = [
    ("spice_sock_send", "sock_send_length"),
    ("spice_sock_recv", "sock_recv_length"),
    ("spice_fork", "sched_process_fork"),
    ("spice_exit", "sched_process_exit"),
    ("spice_tcp_state", "inet_sock_set_state"),
    ("spice_tcp_destroy", "tcp_destroy_sock"),
];

/// Turns on the kernel's BPF run-time statistics (`BPF_ENABLE_STATS` with
/// `BPF_STATS_RUN_TIME`, Linux ≥ 5.8): they stay on while the returned fd is open.
pub fn enable_run_time_stats() -> Result<std::os::fd::OwnedFd> {
    aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .map_err(|e| anyhow!("enabling BPF run-time statistics (BPF_ENABLE_STATS): {e}"))
}

/// Loaded and attached kernel programs.
pub struct Capture {
    ebpf: Ebpf,
    /// Name of the active hook set, for reports (`hook_set` in JSON).
    pub hook_set: String,
    /// Kernel features that were missing and what that costs (empty when all present).
    pub degraded: Vec<String>,
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

/// Probes for a BPF program type (`kind` names it in messages, e.g. `raw_tracepoint`).
fn require_program_type(kind: &str, ty: ProgramType, needed_by: &str) -> Result<()> {
    require(
        &format!("BPF program type `{kind}`"),
        needed_by,
        is_program_supported(ty).map_err(anyhow::Error::from),
    )
}

/// The kernel refused to load program `name` (for `hook`): its errno and the verifier's log.
/// A hard error (the kernel has the feature, it probed present): a rejection is a bug here.
fn refused(name: &str, hook: &str, io_error: &std::io::Error, verifier_log: &str) -> anyhow::Error {
    anyhow!(
        "the kernel refused program `{name}` ({hook}): {io_error}\nverifier log:\n{verifier_log}"
    )
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
    pub fn load() -> Result<Self> {
        // Pre-5.11 kernels charge BPF maps to RLIMIT_MEMLOCK; harmless elsewhere.
        let rlim = libc::rlimit {
            rlim_cur: libc::RLIM_INFINITY,
            rlim_max: libc::RLIM_INFINITY,
        };
        if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rlim) } != 0 {
            debug!("could not raise RLIMIT_MEMLOCK");
        }
        let kbtf = KernelBtf::open(std::path::Path::new(VMLINUX_BTF))?;
        let config: KernelConfig = kbtf.kernel_config()?;
        // The loader parses the kernel's BTF for itself and drops it after the load; the copy
        // for the tp_btf programs is parsed after that, so that the two are never held at once
        // (each costs tens of MB of heap).
        let mut ebpf = EbpfLoader::new()
            .override_global("CONFIG", &config, true)
            .load(EBPF_OBJECT)
            .map_err(|e| match e {
                aya::EbpfError::MapError(aya::maps::MapError::CreateError {
                    name,
                    io_error,
                    ..
                }) if io_error.kind() == std::io::ErrorKind::PermissionDenied => {
                    anyhow!(
                        "creating BPF map `{name}`: permission denied (run spice-observer as \
                         root; it needs CAP_BPF or CAP_SYS_ADMIN)"
                    )
                }
                other => anyhow!("loading the eBPF object: {other}"),
            })?;

        let btf = Btf::from_sys_fs().context("loading kernel BTF for tp_btf programs")?;
        const NEEDED_BY: &str = "the `tracepoints` hook set";
        let has_typedef = |name: &str| kbtf.has_typedef(name);

        require_program_type("raw_tracepoint", ProgramType::RawTracePoint, NEEDED_BY)?;
        require_tracepoint("sys_enter", NEEDED_BY, &has_typedef)?;
        let prog: &mut RawTracePoint = ebpf
            .program_mut("spice_sys_enter")
            .ok_or_else(|| anyhow!("program spice_sys_enter missing from the object"))?
            .try_into()?;
        prog.load()
            .map_err(|e| load_error("spice_sys_enter", "raw_tracepoint/sys_enter", e))?;
        prog.attach("sys_enter")
            .context("attaching raw_tracepoint/sys_enter")?;

        // No program-type probe for tp_btf: aya's probe for BPF_PROG_TYPE_TRACING attaches an
        // fentry trampoline, which the kernels this was built on refuse while tp_btf works.
        for (name, tp) in BTF_TRACEPOINTS {
            require_tracepoint(tp, NEEDED_BY, &has_typedef)?;
            let prog: &mut BtfTracePoint = ebpf
                .program_mut(name)
                .ok_or_else(|| anyhow!("program {name} missing from the object"))?
                .try_into()?;
            prog.load(tp, &btf)
                .map_err(|e| load_error(name, &format!("tp_btf/{tp}"), e))?;
            prog.attach()
                .with_context(|| format!("attaching tp_btf/{tp}"))?;
        }

        let mut hook_set = String::from("tracepoints");
        let mut degraded = Vec::new();
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
                    Ok(_) => hook_set.push_str("+sockops"),
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

        let zero: &mut Array<&mut MapData, SockState> = &mut Array::try_from(
            ebpf.map_mut("ZERO_SOCK")
                .ok_or_else(|| anyhow!("map ZERO_SOCK"))?,
        )?;
        zero.set(0, SockState::default(), 0)?;
        Ok(Self {
            ebpf,
            hook_set,
            degraded,
        })
    }

    fn hash<K: aya::Pod, V: aya::Pod>(
        &mut self,
        name: &str,
    ) -> Result<HashMap<&mut MapData, K, V>> {
        Ok(HashMap::try_from(
            self.ebpf
                .map_mut(name)
                .ok_or_else(|| anyhow!("map {name} missing"))?,
        )?)
    }

    /// Starts watching process `tgid` (its threads, and children it forks from now on).
    pub fn watch_pid(&mut self, tgid: u32) -> Result<()> {
        self.watch_pid_under(tgid, tgid)
    }

    /// Starts watching process `tgid` as part of the watch of `root` (its value in
    /// `WATCHED_TGIDS`, inherited by the children it forks: [`Capture::unwatch_tree`] removes
    /// them together).
    pub fn watch_pid_under(&mut self, tgid: u32, root: u32) -> Result<()> {
        if tgid == std::process::id() {
            bail!("refusing to watch the observer itself (pid {tgid})");
        }
        self.hash::<u32, u32>("WATCHED_TGIDS")?
            .insert(tgid, root, 0)?;
        Ok(())
    }

    /// Lets sockops enrol new connections to or from local/remote `port`.
    pub fn watch_port(&mut self, port: u16) -> Result<()> {
        self.hash::<u16, u8>("WATCH_PORTS")?.insert(port, 1, 0)?;
        Ok(())
    }

    /// Marks a socket that existed before observation started: it is reported, never framed.
    pub fn mark_preexisting(&mut self, cookie: u64) -> Result<()> {
        self.hash::<u64, u8>("PREEXISTING")?.insert(cookie, 1, 0)?;
        Ok(())
    }

    /// Latest TCP state a kernel hook read for `cookie`, if any.
    pub fn tcp_state(&mut self, cookie: u64) -> Option<TcpSnapshot> {
        self.hash::<u64, TcpSnapshot>("TCP_STATE")
            .ok()?
            .get(&cookie, 0)
            .ok()
    }

    /// The kernel's state of socket `cookie` (`SOCKETS`: framing, byte totals and ACK window),
    /// if it has an entry. The map value is copied without a lock while the kernel may be
    /// writing it, so it is read until two reads in a row agree (at most 3 reads); `None` if
    /// they never do, or on any error.
    pub fn sock_state(&mut self, cookie: u64) -> Option<SockState> {
        let map = self.hash::<u64, SockState>("SOCKETS").ok()?;
        let same = |a: &SockState, b: &SockState| {
            a.window == b.window
                && a.msg_bytes == b.msg_bytes
                && (0..2).all(|d| {
                    a.dir[d].msg_count == b.dir[d].msg_count
                        && a.dir[d].announced_at == b.dir[d].announced_at
                })
        };
        let mut prev = map.get(&cookie, 0).ok()?;
        for _ in 0..2 {
            let next = map.get(&cookie, 0).ok()?;
            if same(&prev, &next) {
                return Some(next);
            }
            prev = next;
        }
        None
    }

    /// Stops watching the processes of one watch: every `WATCHED_TGIDS` entry whose key or
    /// value (the watched pid a forked child descends from, `spice-ebpf/src/probes/sched.rs`)
    /// is one of `roots`. Returns the tgids removed.
    pub fn unwatch_tree(&mut self, roots: &[u32]) -> Result<Vec<u32>> {
        let mut map = self.hash::<u32, u32>("WATCHED_TGIDS")?;
        let gone: Vec<u32> = map
            .iter()
            .filter_map(|e| e.ok())
            .filter(|(k, v)| roots.contains(k) || roots.contains(v))
            .map(|(k, _)| k)
            .collect();
        for k in &gone {
            // Gone already (the exit hook removes exited tgids): nothing to do.
            let _ = map.remove(k);
        }
        Ok(gone)
    }

    /// Per-program kernel run-time statistics (`bpf_prog_info.run_time_ns` / `run_cnt`):
    /// (program name in the object, run time ns, run count). Zeros unless the kernel's
    /// statistics are on (`BPF_ENABLE_STATS`, see [`enable_run_time_stats`]).
    pub fn program_stats(&self) -> Vec<(String, u64, u64)> {
        let mut out: Vec<(String, u64, u64)> = self
            .ebpf
            .programs()
            .filter_map(|(name, p)| {
                let info = p.info().ok()?;
                Some((
                    name.to_string(),
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
            self.ebpf
                .map("COUNTERS")
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
        Ok(RingBuf::try_from(
            self.ebpf
                .take_map("EVENTS")
                .ok_or_else(|| anyhow!("map EVENTS already taken"))?,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use std::io;

    use aya::sys::SyscallError;

    use super::*;

    fn text(e: &anyhow::Error) -> String {
        format!("{e:#}")
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
            let t = text(&load_error(
                "spice_sys_enter",
                "raw_tracepoint/sys_enter",
                e,
            ));
            assert!(!t.contains(UNAVAILABLE), "{t}");
            assert!(t.contains("raw_tracepoint/sys_enter"), "{t}");
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
        for (_, tp) in BTF_TRACEPOINTS.iter().chain(&[("", "sys_enter")]) {
            assert!(kbtf.has_typedef(&format!("btf_trace_{tp}")), "{tp}");
        }
        assert!(!kbtf.has_typedef("btf_trace_no_such_tracepoint_xyz"));
    }
}
