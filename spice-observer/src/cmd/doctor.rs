//! `spice-observer doctor`: what this host gives spice-observer, one line per item, and why.
//!
//! Each item is probed, never inferred from the kernel version (distributions backport, so
//! versions lie):
//! * files and mounts: kernel BTF (and the struct offsets the programs need from it), the
//!   lockdown mode, the cgroup-v2 mount (sockops), tracefs, bpffs, `kernel.bpf_stats_enabled`,
//!   `kernel.unprivileged_bpf_disabled`;
//! * the capabilities of this process that loading and watching need;
//! * each hook set: `tracepoints`, `fentry`, `kprobes` and `syscalls` are loaded and attached
//!   for real (the observer's own programs, [`Capture::load`] with that hook set forced, then
//!   released), in `auto`'s order of preference, so the first that loads is the one `auto`
//!   takes; the no-BPF `tcpinfo` mode: its sock_diag socket is opened and dumps once
//!   (`available`, never the framing hook set);
//! * the libssl files each running QEMU maps (what TLS framing would hook).
//!
//! The programs are attached for well under a second and watch no process: their filter
//! (`WATCHED_TGIDS`) is empty, so no call is framed and nothing is written to any socket.
//!
//! Exit status 1 (with the report printed first) when no framing hook set loads.

use std::path::Path;

use anyhow::{Result, bail};
use caps::{CapSet, Capability};
use clap::Args;
use serde::{Deserialize, Serialize};

use crate::btf::{KernelBtf, VMLINUX_BTF};
use crate::kernel::tls;
use crate::loader::{self, Capture, UNAVAILABLE};
use crate::sockdiag;

/// `spice-observer doctor` options.
#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Print the report as one JSON object ([`Report`]) instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// How one item stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Present and usable.
    Ok,
    /// Usable, with a cost or a missing part the detail names.
    Warn,
    /// Missing or refused: the detail says what that disables.
    No,
    /// A fact, neither good nor bad.
    Info,
}

impl Status {
    fn word(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::No => "no",
            Status::Info => "info",
        }
    }
}

/// One line of the report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    /// What was probed, e.g. `kernel BTF`.
    pub item: String,
    pub status: Status,
    /// What was found, with the path or the kernel's error.
    pub detail: String,
}

/// What a hook set's probe found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HookState {
    /// Built, loaded and attached: it frames SPICE on this host.
    Loaded,
    /// Not built in this version, but its program family loads and attaches here.
    Allowed,
    /// Built and usable here, but it frames nothing: the no-BPF `tcpinfo` mode (TCP state
    /// only). Never the framing hook set.
    Available,
    /// The kernel refused the load or the attach (the detail has its error).
    Refused,
    /// The kernel lacks the facility (program type, hook, or kprobes altogether).
    Absent,
}

/// One hook set's line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HookSet {
    /// `tracepoints`, `syscalls`, `fentry`, `kprobes` or `tcpinfo`.
    pub name: String,
    /// Whether this version of spice-observer has the hook set (else only its kernel
    /// facility was probed).
    pub built: bool,
    pub state: HookState,
    /// What was loaded and attached, or the error.
    pub detail: String,
}

/// The libssl files one running QEMU maps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TlsProcess {
    pub pid: u32,
    /// The executable's file name.
    pub exe: String,
    /// Paths of the libssl files in its memory map (`/proc/PID/maps`), empty if none.
    pub libssl: Vec<String>,
    /// Why the map could not be read, if it could not.
    pub error: Option<String>,
}

/// The whole report (`--json` prints it as is).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// `uname -r`.
    pub kernel: String,
    /// `uname -m`.
    pub machine: String,
    pub checks: Vec<Check>,
    pub hook_sets: Vec<HookSet>,
    /// Running QEMU processes (executable name `qemu-system-*` or `qemu-kvm`).
    pub qemu_tls: Vec<TlsProcess>,
    /// The hook set the observer would frame with here; `None`: none loads (exit status 1).
    pub framing_hook_set: Option<String>,
}

/// Runs `doctor`: probes, prints the table (or JSON) to stdout, and fails when no framing
/// hook set loads.
pub fn run(args: DoctorArgs) -> Result<()> {
    let report = probe();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    match &report.framing_hook_set {
        Some(_) => Ok(()),
        None => bail!(
            "no framing hook set loads on this host (see the hook set lines above); \
             observe and daemon cannot run here (except `observe --hook-set tcpinfo`: TCP \
             state only, if its line says available)"
        ),
    }
}

/// Takes every probe of the report.
pub fn probe() -> Report {
    let uts = uname();
    let mounts: Mounts = procfs::process::Process::myself()
        .and_then(|p| p.mountinfo())
        .map_err(|e| e.to_string());
    let mut checks = vec![
        btf_check(),
        lockdown_check(),
        cgroup_check(),
        mount_check(
            &mounts,
            "tracefs",
            "tracefs",
            Status::Info,
            "not needed by the tracepoints hook set",
        ),
        mount_check(
            &mounts,
            "bpffs",
            "bpf",
            Status::Warn,
            "the daemon pins its state under /sys/fs/bpf and stops without it",
        ),
        sysctl_check(
            "bpf_stats",
            "/proc/sys/kernel/bpf_stats_enabled",
            |v| match v {
                "0" => (
                    Status::Info,
                    "off (kernel.bpf_stats_enabled = 0); the daemon's `bpf_stats = true` \
                     turns it on while it runs"
                        .into(),
                ),
                _ => (
                    Status::Info,
                    format!(
                        "on (kernel.bpf_stats_enabled = {v}): every BPF program on the host \
                         pays two clock reads per run for its statistics"
                    ),
                ),
            },
        ),
        sysctl_check(
            "unprivileged BPF",
            "/proc/sys/kernel/unprivileged_bpf_disabled",
            |v| {
                (
                    Status::Info,
                    format!("kernel.unprivileged_bpf_disabled = {v} (the observer loads as root)"),
                )
            },
        ),
    ];
    checks.push(caps_check(caps::read(None, CapSet::Effective).ok()));
    let hook_sets = vec![
        full_set(loader::HookSet::Tracepoints),
        full_set(loader::HookSet::Fentry),
        full_set(loader::HookSet::Kprobes),
        full_set(loader::HookSet::Syscalls),
        tcpinfo(),
    ];
    let framing_hook_set = framing_choice(&hook_sets);
    Report {
        kernel: uts.0,
        machine: uts.1,
        checks,
        hook_sets,
        qemu_tls: qemu_tls(),
        framing_hook_set,
    }
}

/// The hook set the observer frames with: the first built one that loaded.
pub fn framing_choice(sets: &[HookSet]) -> Option<String> {
    sets.iter()
        .find(|h| h.built && h.state == HookState::Loaded)
        .map(|h| h.name.clone())
}

/// The report as the table `doctor` prints: one line per item, then the hook sets, the QEMU
/// processes' libssl and the framing verdict.
pub fn render(r: &Report) -> String {
    let mut s = format!("spice-observer doctor: Linux {} {}\n", r.kernel, r.machine);
    for c in &r.checks {
        s += &format!("  {:<5} {:<18} {}\n", c.status.word(), c.item, c.detail);
    }
    s += "hook sets:\n";
    for h in &r.hook_sets {
        let state = match h.state {
            HookState::Loaded => "loaded",
            HookState::Allowed => "allowed",
            HookState::Available => "available",
            HookState::Refused => "refused",
            HookState::Absent => "absent",
        };
        let built = if h.built {
            ""
        } else {
            " (not built in this version)"
        };
        s += &format!("  {:<8} {:<12} {}{built}\n", state, h.name, h.detail);
    }
    s += "TLS libraries of running QEMU processes:\n";
    if r.qemu_tls.is_empty() {
        s += "  (no QEMU process is running)\n";
    }
    for p in &r.qemu_tls {
        let what = match (&p.error, p.libssl.is_empty()) {
            (Some(e), _) => format!("unknown: {e}"),
            (None, true) => "no libssl mapped (its SPICE sockets, if any, are plain)".into(),
            (None, false) => p.libssl.join(", "),
        };
        s += &format!("  pid {:<8} {:<22} {what}\n", p.pid, p.exe);
    }
    s += &match &r.framing_hook_set {
        Some(h) => format!("framing: hook set `{h}`\n"),
        None => "framing: NONE: no framing hook set loads on this host\n".into(),
    };
    s
}

fn uname() -> (String, String) {
    // SAFETY: utsname is plain data, filled by the kernel.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut u) } != 0 {
        return ("?".into(), "?".into());
    }
    let field = |f: &[libc::c_char]| {
        let b: Vec<u8> = f
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        String::from_utf8_lossy(&b).into_owned()
    };
    (field(&u.release), field(&u.machine))
}

fn check(item: &str, status: Status, detail: impl Into<String>) -> Check {
    Check {
        item: item.into(),
        status,
        detail: detail.into(),
    }
}

/// Kernel BTF: the file, and whether every struct offset the programs take from it resolves
/// ([`KernelBtf::kernel_config`], the loader's own resolution).
fn btf_check() -> Check {
    let path = Path::new(VMLINUX_BTF);
    let size = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) => {
            return check(
                "kernel BTF",
                Status::No,
                format!(
                    "{VMLINUX_BTF}: {e} (the kernel needs CONFIG_DEBUG_INFO_BTF; without it no \
                     hook set loads)"
                ),
            );
        }
    };
    match KernelBtf::open(path).and_then(|b| b.kernel_config()) {
        Ok(_) => check(
            "kernel BTF",
            Status::Ok,
            format!(
                "{VMLINUX_BTF} ({:.1} MiB), every struct offset the programs read resolves",
                size as f64 / (1024.0 * 1024.0)
            ),
        ),
        Err(e) => check("kernel BTF", Status::No, format!("{e:#}")),
    }
}

/// The bracketed word of `/sys/kernel/security/lockdown` (`none [integrity] confidentiality`).
pub fn lockdown_mode(text: &str) -> Option<&str> {
    let start = text.find('[')? + 1;
    let len = text[start..].find(']')?;
    Some(&text[start..start + len])
}

/// Lockdown (security/lockdown/lockdown.c): `confidentiality` refuses the kernel-memory reads
/// of BPF tracing programs (`LOCKDOWN_BPF_READ_KERNEL`), so no hook set can read socket state;
/// `integrity` refuses only `bpf_probe_write_user`, which the observer never calls.
fn lockdown_check() -> Check {
    const PATH: &str = "/sys/kernel/security/lockdown";
    let text = match std::fs::read_to_string(PATH) {
        Ok(t) => t,
        Err(_) => {
            return check(
                "lockdown",
                Status::Info,
                "no lockdown LSM (nothing refused)",
            );
        }
    };
    match lockdown_mode(&text) {
        Some("none") => check("lockdown", Status::Ok, "none"),
        Some("integrity") => check(
            "lockdown",
            Status::Ok,
            "integrity (refuses bpf_probe_write_user only, which the observer never calls)",
        ),
        Some("confidentiality") => check(
            "lockdown",
            Status::No,
            "confidentiality: BPF programs may not read kernel memory, so no hook set can \
             read socket state",
        ),
        _ => check("lockdown", Status::Info, format!("{PATH}: {}", text.trim())),
    }
}

fn cgroup_check() -> Check {
    match loader::cgroup2_mount() {
        Ok(p) => check(
            "cgroup v2",
            Status::Ok,
            format!("{} (sockops attaches here)", p.display()),
        ),
        Err(e) => check(
            "cgroup v2",
            Status::Warn,
            format!("{e:#}: sockops is disabled, TCP state is read at socket calls only"),
        ),
    }
}

/// This process's mounts (`/proc/self/mountinfo`), read once for every mount line; the error
/// as text.
type Mounts = std::result::Result<procfs::process::MountInfos, String>;

fn mount_check(mounts: &Mounts, item: &str, fs_type: &str, missing: Status, why: &str) -> Check {
    let points = mounts.as_ref().map(|m| {
        m.iter()
            .filter(|m| m.fs_type == fs_type)
            .map(|m| m.mount_point.display().to_string())
            .collect::<Vec<_>>()
    });
    match points {
        Ok(v) if !v.is_empty() => check(item, Status::Ok, v.join(", ")),
        Ok(_) => check(item, missing, format!("not mounted: {why}")),
        Err(e) => check(item, missing, format!("reading /proc/self/mountinfo: {e}")),
    }
}

fn sysctl_check(item: &str, path: &str, judge: impl Fn(&str) -> (Status, String)) -> Check {
    match std::fs::read_to_string(path) {
        Ok(v) => {
            let (status, detail) = judge(v.trim());
            check(item, status, detail)
        }
        Err(e) => check(item, Status::Info, format!("{path}: {e}")),
    }
}

/// Capabilities loading and watching use: CAP_BPF with CAP_PERFMON (or CAP_SYS_ADMIN) to load
/// and attach programs, CAP_NET_ADMIN for sockops, CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH to
/// read other users' `/proc/PID/fd` and maps.
pub fn caps_check(effective: Option<caps::CapsHashSet>) -> Check {
    let Some(have) = effective else {
        return check(
            "capabilities",
            Status::Info,
            "cannot read this process's capabilities",
        );
    };
    let wanted = [
        Capability::CAP_BPF,
        Capability::CAP_PERFMON,
        Capability::CAP_SYS_ADMIN,
        Capability::CAP_NET_ADMIN,
        Capability::CAP_SYS_PTRACE,
        Capability::CAP_DAC_READ_SEARCH,
    ];
    let name = |c: &Capability| c.to_string();
    let present: Vec<String> = wanted
        .iter()
        .filter(|c| have.contains(c))
        .map(name)
        .collect();
    let missing: Vec<String> = wanted
        .iter()
        .filter(|c| !have.contains(c))
        .map(name)
        .collect();
    let load = have.contains(&Capability::CAP_SYS_ADMIN)
        || (have.contains(&Capability::CAP_BPF) && have.contains(&Capability::CAP_PERFMON));
    let list = |v: &[String]| {
        if v.is_empty() {
            "none".to_string()
        } else {
            v.join(" ")
        }
    };
    if !load {
        return check(
            "capabilities",
            Status::No,
            format!(
                "cannot load BPF (needs CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN; run as \
                 root); present: {}",
                list(&present)
            ),
        );
    }
    if missing.is_empty() {
        check("capabilities", Status::Ok, list(&present))
    } else {
        check(
            "capabilities",
            Status::Warn,
            format!("present: {}; missing: {}", list(&present), list(&missing)),
        )
    }
}

fn hook(name: &str, built: bool, state: HookState, detail: impl Into<String>) -> HookSet {
    HookSet {
        name: name.into(),
        built,
        state,
        detail: detail.into(),
    }
}

/// A built hook set: the observer's own load of it ([`Capture::load`]), released at once.
fn full_set(set: loader::HookSet) -> HookSet {
    match Capture::load(set.into()) {
        Ok(cap) => {
            let mut detail = format!("loaded and attached as `{}`", cap.hook_set);
            for d in &cap.degraded {
                detail += &format!("; {d}");
            }
            drop(cap);
            hook(set.name(), true, HookState::Loaded, detail)
        }
        Err(e) => {
            let msg = format!("{e:#}");
            let state = if msg.contains(UNAVAILABLE) {
                HookState::Absent
            } else {
                HookState::Refused
            };
            hook(set.name(), true, state, msg)
        }
    }
}

/// `tcpinfo`: the no-BPF mode ([`crate::cmd::tcpinfo`]): its sock_diag socket opens and
/// answers a dump (what every sample of the mode needs; no privilege).
fn tcpinfo() -> HookSet {
    match sockdiag::DiagQuery::new().and_then(|mut q| q.dump()) {
        Ok(_) => hook(
            "tcpinfo",
            true,
            HookState::Available,
            "no BPF: NETLINK_SOCK_DIAG answers; TCP state only, no SPICE framing \
             (`observe --hook-set tcpinfo`, unprivileged for one's own processes)",
        ),
        Err(e) => hook("tcpinfo", true, HookState::Refused, format!("{e:#}")),
    }
}

/// Whether an executable's file name is QEMU's.
pub fn is_qemu_exe(name: &str) -> bool {
    name.starts_with("qemu-system-") || name == "qemu-kvm"
}

fn qemu_tls() -> Vec<TlsProcess> {
    let Ok(all) = procfs::process::all_processes() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for p in all.flatten() {
        let Some(exe) = p
            .exe()
            .ok()
            .and_then(|e| e.file_name().map(|n| n.to_string_lossy().into_owned()))
        else {
            continue;
        };
        if !is_qemu_exe(&exe) {
            continue;
        }
        let pid = p.pid as u32;
        let (libssl, error) = match tls::mapped_libssl(pid) {
            Ok(libs) => (libs.iter().map(|l| l.label()).collect(), None),
            Err(tls::ProcError::Gone) => continue,
            Err(tls::ProcError::Unreadable(e)) => (Vec::new(), Some(e)),
        };
        out.push(TlsProcess {
            pid,
            exe,
            libssl,
            error,
        });
    }
    out.sort_by_key(|p| p.pid);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lockdown_word_is_the_bracketed_one() {
        assert_eq!(
            lockdown_mode("none [integrity] confidentiality\n"),
            Some("integrity")
        );
        assert_eq!(
            lockdown_mode("[none] integrity confidentiality"),
            Some("none")
        );
        assert_eq!(lockdown_mode("none integrity"), None);
    }

    #[test]
    fn capabilities_without_bpf_cannot_load() {
        let mut set = caps::CapsHashSet::new();
        set.insert(Capability::CAP_NET_ADMIN);
        let c = caps_check(Some(set.clone()));
        assert_eq!(c.status, Status::No, "{c:?}");
        assert!(c.detail.contains("CAP_NET_ADMIN"), "{c:?}");
        set.insert(Capability::CAP_BPF);
        set.insert(Capability::CAP_PERFMON);
        let c = caps_check(Some(set));
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(
            c.detail
                .contains("missing: CAP_SYS_ADMIN CAP_SYS_PTRACE CAP_DAC_READ_SEARCH"),
            "{c:?}"
        );
    }

    #[test]
    fn only_a_built_loaded_hook_set_frames() {
        let sets = vec![
            hook("tracepoints", true, HookState::Refused, "x"),
            hook("fentry", false, HookState::Allowed, "y"),
        ];
        assert_eq!(framing_choice(&sets), None);
        // The no-BPF mode never frames, even when nothing else loads.
        let only_tcpinfo = vec![
            hook("tracepoints", true, HookState::Refused, "x"),
            hook("tcpinfo", true, HookState::Available, "z"),
        ];
        assert_eq!(framing_choice(&only_tcpinfo), None);
        let sets = vec![
            hook("tracepoints", true, HookState::Loaded, "x"),
            hook("fentry", false, HookState::Allowed, "y"),
        ];
        assert_eq!(framing_choice(&sets).as_deref(), Some("tracepoints"));
        let text = render(&Report {
            kernel: "6.1.0".into(),
            machine: "x86_64".into(),
            checks: vec![check("lockdown", Status::Ok, "none")],
            hook_sets: sets,
            qemu_tls: vec![],
            framing_hook_set: Some("tracepoints".into()),
        });
        assert!(text.contains("  ok    lockdown           none\n"), "{text}");
        assert!(
            text.contains("allowed  fentry       y (not built in this version)"),
            "{text}"
        );
        assert!(
            text.ends_with("framing: hook set `tracepoints`\n"),
            "{text}"
        );
    }

    #[test]
    fn qemu_executables() {
        assert!(is_qemu_exe("qemu-system-x86_64"));
        assert!(is_qemu_exe("qemu-kvm"));
        assert!(!is_qemu_exe("qemu-img"));
        assert!(!is_qemu_exe("Xorg"));
    }
}
