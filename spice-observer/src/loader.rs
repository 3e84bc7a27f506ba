//! Loads and attaches the kernel programs, and gives typed access to their maps.
//!
//! Hook set `tracepoints` (the only one so far; fentry/fexit are refused and kprobes absent on
//! the kernels this was built on): `raw_tracepoint/sys_enter`, `tp_btf/sock_send_length`,
//! `tp_btf/sock_recv_length`, `tp_btf/sched_process_fork`, `tp_btf/sched_process_exit`,
//! `tp_btf/inet_sock_set_state`, `tp_btf/tcp_destroy_sock`, plus `sock_ops` on the cgroup-v2 root when a cgroup2 mount
//! exists (then the hook set is reported as `tracepoints+sockops`).

use std::{fs::File, path::PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use aya::{
    Btf, Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, PerCpuArray, RingBuf},
    programs::{BtfTracePoint, ProgramError, RawTracePoint, SockOps, links::CgroupAttachMode},
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

/// Loaded and attached kernel programs.
pub struct Capture {
    ebpf: Ebpf,
    /// Name of the active hook set, for reports (`hook_set` in JSON).
    pub hook_set: String,
    /// Kernel features that were missing and what that costs (empty when all present).
    pub degraded: Vec<String>,
}

/// Explains a program load failure, keeping the verifier's log (a rejection is a bug here).
fn load_error(name: &str, e: ProgramError) -> anyhow::Error {
    match e {
        ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            anyhow!(
                "the kernel refused program `{name}`: {io_error}\nverifier log:\n{verifier_log}"
            )
        }
        other => anyhow!("loading program `{name}`: {other}"),
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
    /// Errors: not root / no CAP_BPF, no kernel BTF, a missing tracepoint (named in the error),
    /// or a verifier rejection (with the verifier log). A missing cgroup2 mount only disables
    /// sockops (listed in [`Capture::degraded`]).
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
        let btf = Btf::from_sys_fs().context("loading kernel BTF for tp_btf programs")?;
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
                        "creating BPF map `{name}`: permission denied (run spice-observer as root)"
                    )
                }
                other => anyhow!("loading the eBPF object: {other}"),
            })?;

        let prog: &mut RawTracePoint = ebpf
            .program_mut("spice_sys_enter")
            .ok_or_else(|| anyhow!("program spice_sys_enter missing from the object"))?
            .try_into()?;
        prog.load().map_err(|e| load_error("spice_sys_enter", e))?;
        prog.attach("sys_enter")
            .context("attaching raw_tracepoint sys_enter")?;

        for (name, tp) in BTF_TRACEPOINTS {
            let prog: &mut BtfTracePoint = ebpf
                .program_mut(name)
                .ok_or_else(|| anyhow!("program {name} missing from the object"))?
                .try_into()?;
            prog.load(tp, &btf).map_err(|e| match e {
                ProgramError::LoadError { .. } => load_error(name, e),
                other => anyhow!(
                    "tracepoint `{tp}` is not available on this kernel ({other}); the `tracepoints` \
                     hook set needs it (see README, Kernel requirements)"
                ),
            })?;
            prog.attach()
                .with_context(|| format!("attaching tp_btf/{tp}"))?;
        }

        let mut hook_set = String::from("tracepoints");
        let mut degraded = Vec::new();
        match cgroup2_mount() {
            Ok(cg) => {
                let prog: &mut SockOps = ebpf
                    .program_mut("spice_sockops")
                    .ok_or_else(|| anyhow!("program spice_sockops missing from the object"))?
                    .try_into()?;
                prog.load().map_err(|e| load_error("spice_sockops", e))?;
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
        if tgid == std::process::id() {
            bail!("refusing to watch the observer itself (pid {tgid})");
        }
        self.hash::<u32, u32>("WATCHED_TGIDS")?
            .insert(tgid, tgid, 0)?;
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

    /// Sum over CPUs of each kernel counter (`spice_ebpf_common::config::counter`).
    pub fn counters(&mut self) -> Result<[u64; counter::COUNT as usize]> {
        let map: PerCpuArray<&mut MapData, u64> = PerCpuArray::try_from(
            self.ebpf
                .map_mut("COUNTERS")
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
