//! Least privilege for `spice-observer daemon`: the Linux capabilities it needs, the ones it
//! drops once its kernel programs are attached, and errors that name a missing one.
//!
//! Which capability each step needs was found by running the daemon as `nobody` with
//! `setpriv` and exactly a given set (`tests/service.rs` repeats it on every test run), on
//! Linux 6.18 with `kernel.unprivileged_bpf_disabled = 2`:
//!
//! | step | needs | without it |
//! | --- | --- | --- |
//! | create the maps, load BTF | `CAP_BPF` | `bpf(BPF_MAP_CREATE)`: EPERM |
//! | load `raw_tracepoint` / `tp_btf` programs (they read kernel memory) | `CAP_PERFMON` | `bpf(BPF_PROG_LOAD)`: EPERM |
//! | load `sock_ops` and attach it to the cgroup-v2 root | `CAP_NET_ADMIN` | `bpf(BPF_PROG_LOAD)`: EPERM |
//! | list another user's `/proc/PID/fd` (mode 0500, owned by the process's user) | `CAP_DAC_READ_SEARCH` | `opendir`: EACCES |
//! | `readlink` of `/proc/PID/fd/N`, read `/proc/PID/maps` of another user's process | `CAP_SYS_PTRACE` | EACCES (`ptrace_may_access`, `PTRACE_MODE_READ_FSCREDS`) |
//! | `BPF_ENABLE_STATS` (`bpf_stats = true`) | `CAP_SYS_ADMIN` | EPERM; the daemon runs without the statistics ([`BPF_STATS_REFUSED`]) |
//! | attach the libssl uprobes to each process found (`tls_hooks = true`): `perf_event_open` of the uprobe PMU | `CAP_SYS_ADMIN` (`CAP_PERFMON` is not enough) | EACCES; the daemon warns once and reports the processes' hooks `failed` |
//!
//! Both `/proc` capabilities are needed: with `CAP_SYS_PTRACE` alone the `fd` directory cannot
//! be opened (its permission check is the plain DAC one), with `CAP_DAC_READ_SEARCH` alone the
//! links cannot be read. `/proc/PID/status`, `stat`, `comm` and `cmdline` are readable by
//! every user. sock_diag dumps of TCP sockets with `INET_DIAG_INFO` need no capability (only
//! the `mark` and `class_id` attributes are kept from non-`CAP_NET_ADMIN` callers, and the
//! daemon does not ask for them). `RLIMIT_MEMLOCK` does not matter: since Linux 5.11 BPF
//! memory is charged to the memory cgroup, and the daemon loads with `RLIMIT_MEMLOCK = 0`
//! (measured with `prlimit --memlock=0`; raising the limit needs `CAP_SYS_RESOURCE`, which it
//! tries and does not need). Map and ring access through the descriptors the daemon already
//! holds needs no capability (the kernel checks the descriptor's mode, not the caller).
//!
//! After attaching, [`drop_after_attach`] keeps only [`STEADY`] (`CAP_DAC_READ_SEARCH`,
//! `CAP_SYS_PTRACE`: discovery of new QEMU and Xspice processes and their sockets) in the
//! permitted and effective sets, clears the inheritable and ambient sets and, when it holds
//! `CAP_SETPCAP` (a root daemon), shrinks the bounding set to the same two (plus
//! [`TLS_HOOKS_CAP`] when the libssl hooks are on and the daemon holds it: it attaches them
//! as processes are found, [`drop_after_attach_keeping`]). Capabilities are
//! per thread: the drop is made on the daemon's only thread (the runtime is single-threaded)
//! and [`ThreadCaps`] reads every thread back to check it.

use std::fmt;

use anyhow::{Context, Result, anyhow};
use caps::{CapSet, Capability};

/// A capability the daemon needs, and what for.
#[derive(Debug, Clone, Copy)]
pub struct Need {
    /// The capability.
    pub cap: Capability,
    /// What needs it (for errors and README).
    pub why: &'static str,
}

/// Needed to load and attach the kernel programs; dropped after.
pub const ATTACH: [Need; 3] = [
    Need {
        cap: Capability::CAP_BPF,
        why: "creating the BPF maps and loading BTF",
    },
    Need {
        cap: Capability::CAP_PERFMON,
        why: "loading the raw_tracepoint and tp_btf programs",
    },
    Need {
        cap: Capability::CAP_NET_ADMIN,
        why: "loading the sock_ops program and attaching it to the cgroup-v2 root",
    },
];

/// Needed as long as the daemon runs (kept after attach): watching other users' processes.
pub const STEADY: [Need; 2] = [
    Need {
        cap: Capability::CAP_DAC_READ_SEARCH,
        why: "listing another user's /proc/PID/fd",
    },
    Need {
        cap: Capability::CAP_SYS_PTRACE,
        why: "reading another user's /proc/PID/fd links and /proc/PID/maps",
    },
];

/// The optional capability for `bpf_stats = true` (`BPF_ENABLE_STATS`), dropped after attach.
pub const BPF_STATS_CAP: Capability = Capability::CAP_SYS_ADMIN;

/// Start of the degraded entry (and warning) when the kernel refuses `BPF_ENABLE_STATS`
/// with EPERM: the daemon runs without the per-program statistics.
pub const BPF_STATS_REFUSED: &str = "bpf_stats off";

/// Every capability the daemon needs, in the order of [`ATTACH`] then [`STEADY`].
pub fn needed() -> impl Iterator<Item = Need> {
    ATTACH.into_iter().chain(STEADY)
}

/// A capability's name as `/usr/include/linux/capability.h` and `capabilities(7)` spell it
/// (`CAP_BPF`).
pub fn name(cap: Capability) -> String {
    cap.to_string()
}

/// The current thread's effective set, or an empty set if it cannot be read.
fn effective() -> caps::CapsHashSet {
    caps::read(None, CapSet::Effective).unwrap_or_default()
}

/// The capabilities of `needs` that the current thread's effective set lacks.
fn missing(needs: &[Need]) -> Vec<Need> {
    let eff = effective();
    needs
        .iter()
        .filter(|n| !eff.contains(&n.cap))
        .copied()
        .collect()
}

fn list(needs: &[Need]) -> String {
    needs
        .iter()
        .map(|n| format!("{} ({})", name(n.cap), n.why))
        .collect::<Vec<_>>()
        .join(", ")
}

/// True if `e`'s chain holds an EPERM or EACCES (an `io::Error` or, for errors that were
/// turned into text, the words the kernel's strerror gives them).
pub fn is_permission_error(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::PermissionDenied)
            || {
                let s = c.to_string().to_lowercase();
                s.contains("operation not permitted") || s.contains("permission denied")
            }
    })
}

/// Explains a failed start of the kernel programs: when it was refused for permissions,
/// adds which of [`ATTACH`] the process lacks (from its effective set), or that it has them
/// all (then something else refuses: an LSM, a seccomp filter, a user namespace). Other
/// errors are returned unchanged.
pub fn explain_start_error(e: anyhow::Error) -> anyhow::Error {
    if !is_permission_error(&e) {
        return e;
    }
    let lacking = missing(&ATTACH);
    let msg = if lacking.is_empty() {
        format!(
            "permission denied although this process holds {}: something else refuses \
             (a Linux security module, a seccomp filter, or capabilities held only in a user \
             namespace)",
            ATTACH.map(|n| name(n.cap)).join(", ")
        )
    } else {
        format!(
            "permission denied loading and attaching the kernel programs: this process lacks {} \
             (the daemon needs {}; see README, Running as a service)",
            list(&lacking),
            ATTACH.map(|n| name(n.cap)).join(", ")
        )
    };
    e.context(msg)
}

/// Explains a permission error while reading another user's `/proc/PID` (watching a target,
/// or discovery's unreadable files): which of [`STEADY`] the process lacks. `None` if it
/// lacks none of them (the words would be wrong) .
pub fn proc_hint() -> Option<String> {
    let lacking = missing(&STEADY);
    (!lacking.is_empty()).then(|| {
        format!(
            "reading other users' /proc/PID needs CAP_DAC_READ_SEARCH and CAP_SYS_PTRACE; \
             this process lacks {}",
            list(&lacking)
        )
    })
}

/// [`proc_hint`] appended to `e` when `e` is a permission error; otherwise `e` as text.
pub fn explain_watch_error(e: &anyhow::Error) -> String {
    match proc_hint() {
        Some(h) if is_permission_error(e) => format!("{e:#} ({h})"),
        _ => format!("{e:#}"),
    }
}

/// Turns on `BPF_ENABLE_STATS` if `wanted`: `Ok(None)` with statistics on (the engine then
/// holds its own descriptor: this probe's is closed at once) or off by choice;
/// `Ok(Some(why))` when the kernel refused it with EPERM (the process lacks
/// [`BPF_STATS_CAP`]): the daemon runs without the statistics and reports `why` as
/// degraded. Other errors (the kernel lacks the command) are errors.
pub fn probe_bpf_stats(wanted: bool) -> Result<Option<String>> {
    if !wanted {
        return Ok(None);
    }
    match aya::sys::enable_stats(aya::sys::Stats::RunTime) {
        Ok(fd) => {
            drop(fd);
            Ok(None)
        }
        Err(e) if e.io_error.kind() == std::io::ErrorKind::PermissionDenied => Ok(Some(format!(
            "{BPF_STATS_REFUSED}: the kernel refused BPF_ENABLE_STATS ({}); it needs {} (not \
             granted by the systemd unit): spice_observer_bpf_* are not exported (set \
             bpf_stats = false to silence this)",
            e.io_error,
            name(BPF_STATS_CAP)
        ))),
        Err(e) => Err(anyhow!(
            "enabling BPF run-time statistics (BPF_ENABLE_STATS): {}",
            e.io_error
        )),
    }
}

/// The capability sets of one thread, from `/proc/PID/task/TID/status` (`CapInh`, `CapPrm`,
/// `CapEff`, `CapBnd`, `CapAmb`, hexadecimal masks; `proc(5)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThreadCaps {
    pub inheritable: u64,
    pub permitted: u64,
    pub effective: u64,
    pub bounding: u64,
    pub ambient: u64,
}

impl ThreadCaps {
    /// Parses the `Cap*` lines of a `status` file. `None` if one of the five is missing or
    /// not hexadecimal.
    pub fn parse(status: &str) -> Option<ThreadCaps> {
        let get = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        };
        Some(ThreadCaps {
            inheritable: get("CapInh:")?,
            permitted: get("CapPrm:")?,
            effective: get("CapEff:")?,
            bounding: get("CapBnd:")?,
            ambient: get("CapAmb:")?,
        })
    }

    /// Every thread of process `pid` (`/proc/PID/task/*/status`), by thread id.
    pub fn of_process(pid: u32) -> Result<Vec<(u32, ThreadCaps)>> {
        let dir = format!("/proc/{pid}/task");
        let mut out = Vec::new();
        for e in std::fs::read_dir(&dir).with_context(|| format!("listing {dir}"))? {
            let e = e?;
            let Some(tid) = e.file_name().to_str().and_then(|t| t.parse().ok()) else {
                continue;
            };
            let path = e.path().join("status");
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            let c = ThreadCaps::parse(&text)
                .ok_or_else(|| anyhow!("no Cap* lines in {}", path.display()))?;
            out.push((tid, c));
        }
        out.sort_by_key(|(t, _)| *t);
        Ok(out)
    }
}

/// The mask of a set of capabilities, as `/proc/PID/status` shows it (bit = capability number).
pub fn mask(caps: impl IntoIterator<Item = Capability>) -> u64 {
    caps.into_iter().fold(0, |m, c| m | c.bitmask())
}

/// Names of the capabilities in `mask`, lowest number first.
pub fn names(mask: u64) -> Vec<String> {
    let mut v: Vec<Capability> = caps::all()
        .into_iter()
        .filter(|c| mask & c.bitmask() != 0)
        .collect();
    v.sort_by_key(|c| c.index());
    v.into_iter().map(name).collect()
}

/// What [`drop_after_attach`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// Capabilities still permitted and effective (those of [`STEADY`] the process had).
    pub kept: Vec<String>,
    /// Capabilities that were permitted before and are gone now.
    pub dropped: Vec<String>,
    /// True if the bounding set was shrunk to `kept` too (needs `CAP_SETPCAP`, which a
    /// daemon started by the systemd unit does not hold: its bounding set is the unit's
    /// `CapabilityBoundingSet=`).
    pub bounding_shrunk: bool,
}

impl fmt::Display for Dropped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kept = if self.kept.is_empty() {
            "none".to_string()
        } else {
            self.kept.join(", ")
        };
        let dropped = if self.dropped.is_empty() {
            "none".to_string()
        } else {
            self.dropped.join(", ")
        };
        write!(
            f,
            "capabilities kept after attach: {kept}; dropped: {dropped}; bounding set {}",
            if self.bounding_shrunk {
                "shrunk to the kept ones"
            } else {
                "unchanged (no CAP_SETPCAP)"
            }
        )
    }
}

/// Kept after attach too when the libssl hooks are on (`tls_hooks`) and the daemon holds it:
/// attaching the uprobes to each process found later is a `perf_event_open(2)` of the uprobe
/// PMU, which the kernel refuses (EACCES) without `CAP_SYS_ADMIN`; `CAP_PERFMON` is not
/// enough (measured on Linux 6.18, see [`crate::kernel::tls::CAPABILITY_HINT`]).
pub const TLS_HOOKS_CAP: Need = Need {
    cap: Capability::CAP_SYS_ADMIN,
    why: "attaching the libssl uprobes to each process found (perf_event_open of the uprobe PMU)",
};

/// Whether the current thread's effective set holds `cap`.
pub fn holds(cap: Capability) -> bool {
    effective().contains(&cap)
}

/// Drops every capability but [`STEADY`] from the current thread: bounding set (only with
/// `CAP_SETPCAP`, which is dropped last), ambient, inheritable, effective, permitted, in
/// that order (the kernel wants ambient ⊆ permitted ∩ inheritable and effective ⊆
/// permitted at each step). Call it once the kernel programs are attached, before any other
/// thread is started.
///
/// Errors: a `capset(2)` or `prctl(2)` call failed (lowering never needs a capability, so
/// this means the kernel refused for another reason).
pub fn drop_after_attach() -> Result<Dropped> {
    drop_after_attach_keeping(&[])
}

/// [`drop_after_attach`], keeping `extra` too (those of them the process has), e.g.
/// [`TLS_HOOKS_CAP`].
pub fn drop_after_attach_keeping(extra: &[Need]) -> Result<Dropped> {
    let before =
        caps::read(None, CapSet::Permitted).context("reading the permitted capabilities")?;
    let keep: caps::CapsHashSet = STEADY
        .iter()
        .chain(extra)
        .map(|n| n.cap)
        .filter(|c| before.contains(c))
        .collect();
    let bounding_shrunk =
        caps::has_cap(None, CapSet::Effective, Capability::CAP_SETPCAP).unwrap_or(false);
    if bounding_shrunk {
        let bounding = caps::read(None, CapSet::Bounding).context("reading the bounding set")?;
        for c in bounding
            .into_iter()
            .filter(|c| !keep.contains(c) && *c != Capability::CAP_SETPCAP)
        {
            caps::drop(None, CapSet::Bounding, c)
                .with_context(|| format!("dropping {} from the bounding set", name(c)))?;
        }
        if !keep.contains(&Capability::CAP_SETPCAP) {
            caps::drop(None, CapSet::Bounding, Capability::CAP_SETPCAP)
                .context("dropping CAP_SETPCAP from the bounding set")?;
        }
    }
    caps::clear(None, CapSet::Ambient).context("clearing the ambient set")?;
    caps::clear(None, CapSet::Inheritable).context("clearing the inheritable set")?;
    caps::set(None, CapSet::Effective, &keep).context("lowering the effective set")?;
    caps::set(None, CapSet::Permitted, &keep).context("lowering the permitted set")?;
    let mut kept: Vec<Capability> = keep.iter().copied().collect();
    kept.sort_by_key(|c| c.index());
    let mut dropped: Vec<Capability> = before.difference(&keep).copied().collect();
    dropped.sort_by_key(|c| c.index());
    Ok(Dropped {
        kept: kept.into_iter().map(name).collect(),
        dropped: dropped.into_iter().map(name).collect(),
        bounding_shrunk,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn privilege_parse_status_caps() {
        let s = "Name:\tx\nCapInh:\t0000000000000000\nCapPrm:\t0000000000080004\n\
                 CapEff:\t0000000000080004\nCapBnd:\t000001ffffffffff\nCapAmb:\t0000000000000000\n";
        let c = ThreadCaps::parse(s).unwrap();
        assert_eq!(c.permitted, c.effective);
        assert_eq!(
            names(c.effective),
            ["CAP_DAC_READ_SEARCH", "CAP_SYS_PTRACE"]
        );
        assert_eq!(c.effective, mask(STEADY.map(|n| n.cap)));
        assert_eq!(c.ambient, 0);
        assert!(ThreadCaps::parse("CapInh:\t0\n").is_none());
    }

    /// Our own status file parses (five Cap* lines).
    #[test]
    fn privilege_own_status() {
        let me = ThreadCaps::of_process(std::process::id()).unwrap();
        assert!(!me.is_empty());
    }

    #[test]
    fn privilege_names_and_errors() {
        assert_eq!(name(Capability::CAP_NET_ADMIN), "CAP_NET_ADMIN");
        assert_eq!(needed().count(), 5);
        let e =
            anyhow::Error::new(std::io::Error::from_raw_os_error(libc::EPERM)).context("loading");
        assert!(is_permission_error(&e));
        assert!(!is_permission_error(&anyhow!("no BTF")));
        // A non-permission error passes unchanged.
        assert_eq!(
            format!("{:#}", explain_start_error(anyhow!("no BTF"))),
            "no BTF"
        );
    }
}
