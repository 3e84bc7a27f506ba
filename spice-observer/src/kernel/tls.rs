//! The libssl hooks on the host side: which libssl each watched process maps, attaching the
//! uprobe programs to it for that process only, and following the watched processes (new
//! ones, exits, a library loaded later with `dlopen`).
//!
//! The kernel programs (`spice-ebpf`, loaded with the others by [`crate::loader`]) are
//! uprobes on OpenSSL's API ([`PROGRAMS`]): one per plaintext function on entry, one for the
//! four context functions (handshake, shutdown, peek) and one uretprobe on all eight
//! ([`FUNCTIONS`]). They are attached per process: `perf_event_open(2)` of the uprobe PMU
//! with the process's pid, which the kernel filters by the process's address space
//! (`kernel/trace/trace_uprobe.c`, `uprobe_perf_filter`), so every thread of that process
//! fires and no other process does. A child it forks has its own address space and needs
//! its own attachment: the kernel's fork hook adds children to `WATCHED_TGIDS`, and
//! [`TlsHooks::sync`] attaches for every watched process not handled yet.
//!
//! Where the library is: the first file mapping of `/proc/PID/maps` whose file name is
//! `libssl.so` or `libssl.so.*` (OpenSSL 3 is `libssl.so.3`, 1.1 `libssl.so.1.1`); each
//! distinct file (device and inode) is hooked. The attach path is `/proc/PID/root` + the
//! mapped path, so that a process in a container (another mount namespace) is hooked on the
//! file it maps, not on the host's file of the same name. A mapping marked `(deleted)`
//! (the package was upgraded under the running process) is attached through
//! `/proc/PID/map_files/START-END`, the inode the process maps.
//!
//! Costs: one file descriptor per attached (program, function) pair, 16 per process with
//! OpenSSL 3; [`raise_fd_limit`] lifts the soft `RLIMIT_NOFILE` to the hard limit.

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::OsStr,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::programs::uprobe::UProbeLink;
use log::debug;
use procfs::process::{MMPermissions, MMapPath, MemoryMaps};
use spice_ebpf_common::config::watch;

use crate::{
    loader::Capture,
    model::{Model, tls::TlsAttach},
};

/// One uprobe program of the kernel object and the libssl functions it attaches to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TlsProgram {
    /// Program name in the object (`spice-ebpf`).
    pub name: &'static str,
    /// A uretprobe (runs at the function's return) rather than a uprobe (at its entry).
    pub ret: bool,
    /// The symbols it attaches to.
    pub symbols: &'static [&'static str],
}

/// Every libssl function the hooks attach to: the plaintext functions of OpenSSL's API
/// (`SSL_write`, `SSL_write_ex`, `SSL_read`, `SSL_read_ex`, ssl/ssl_lib.c) and the ones
/// whose socket calls are the TLS library's own (`SSL_do_handshake`, which `SSL_accept` and
/// `SSL_connect` call; `SSL_shutdown`; `SSL_peek`, `SSL_peek_ex`). See
/// `spice_ebpf_common::event::tls_func`.
pub const FUNCTIONS: [&str; 8] = [
    "SSL_write",
    "SSL_write_ex",
    "SSL_read",
    "SSL_read_ex",
    "SSL_do_handshake",
    "SSL_shutdown",
    "SSL_peek",
    "SSL_peek_ex",
];

/// The functions without which nothing of a process's plaintext can be framed: a library
/// that lacks either (or on which either cannot be attached) is [`TlsAttach::Failed`]. The
/// others are attached when the library has them (OpenSSL 1.1.0 has no `SSL_write_ex`,
/// `SSL_read_ex` or `SSL_peek_ex`).
pub const REQUIRED: [&str; 2] = ["SSL_write", "SSL_read"];

/// The uretprobe program (on all of [`FUNCTIONS`]).
pub const RET_PROGRAM: &str = "spice_ssl_ret";

/// The uprobe programs of the kernel object: entry programs first, then the uretprobe.
pub const PROGRAMS: [TlsProgram; 6] = [
    TlsProgram {
        name: "spice_ssl_write",
        ret: false,
        symbols: &["SSL_write"],
    },
    TlsProgram {
        name: "spice_ssl_write_ex",
        ret: false,
        symbols: &["SSL_write_ex"],
    },
    TlsProgram {
        name: "spice_ssl_read",
        ret: false,
        symbols: &["SSL_read"],
    },
    TlsProgram {
        name: "spice_ssl_read_ex",
        ret: false,
        symbols: &["SSL_read_ex"],
    },
    TlsProgram {
        name: "spice_ssl_context",
        ret: false,
        symbols: &[
            "SSL_do_handshake",
            "SSL_shutdown",
            "SSL_peek",
            "SSL_peek_ex",
        ],
    },
    TlsProgram {
        name: RET_PROGRAM,
        ret: true,
        symbols: &FUNCTIONS,
    },
];

/// What attaching a uprobe needs: `perf_event_open(2)` of the uprobe PMU is refused with
/// EACCES without `CAP_SYS_ADMIN`; `CAP_PERFMON` is not enough (measured on Linux 6.18 with
/// `setpriv --bounding-set=-sys_admin`, while `-perfmon` alone still attaches).
pub const CAPABILITY_HINT: &str =
    "attaching uprobes needs CAP_SYS_ADMIN: perf_event_open(2) of the uprobe PMU";

/// How often a watched process that maps no libssl is looked at again (it may `dlopen` one
/// later): 5 s.
pub const RECHECK: Duration = Duration::from_secs(5);

/// The entry program attached to `function` (one of [`FUNCTIONS`]).
pub fn entry_program(function: &str) -> Option<&'static str> {
    PROGRAMS
        .iter()
        .find(|p| !p.ret && p.symbols.contains(&function))
        .map(|p| p.name)
}

/// Whether a file name is a libssl: `libssl.so` or `libssl.so.<version>`.
pub fn is_libssl_name(name: &OsStr) -> bool {
    let n = name.as_bytes();
    n == b"libssl.so" || n.starts_with(b"libssl.so.")
}

/// A libssl file mapped by a process (one line of `/proc/PID/maps`, proc(5)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MappedLibrary {
    /// The file's path as the process sees it (in its mount namespace), without the
    /// ` (deleted)` suffix.
    pub path: PathBuf,
    /// The kernel marked the mapping ` (deleted)`: the file at `path` is not (or no longer)
    /// the one mapped.
    pub deleted: bool,
    /// Device (major, minor) and inode of the mapped file.
    pub dev: (i32, i32),
    pub inode: u64,
    /// Address range of the mapping used for `/proc/PID/map_files` (start, end).
    pub range: (u64, u64),
}

impl MappedLibrary {
    /// The path to attach to for process `pid`: `/proc/PID/root` + [`MappedLibrary::path`]
    /// (the file in the process's own mount namespace), or, for a deleted mapping,
    /// `/proc/PID/map_files/START-END` (the inode the process maps; opening it needs
    /// `CAP_SYS_ADMIN`, see proc(5)).
    pub fn attach_path(&self, pid: u32) -> PathBuf {
        if self.deleted {
            return PathBuf::from(format!(
                "/proc/{pid}/map_files/{:x}-{:x}",
                self.range.0, self.range.1
            ));
        }
        let rel = self.path.strip_prefix("/").unwrap_or(&self.path);
        Path::new(&format!("/proc/{pid}/root")).join(rel)
    }

    /// The library as the status reports it: the mapped path, with ` (deleted)` when so.
    pub fn label(&self) -> String {
        if self.deleted {
            format!("{} (deleted)", self.path.display())
        } else {
            self.path.display().to_string()
        }
    }
}

/// The libssl files in a process's memory map: one entry per distinct file (device and
/// inode), in map order; an executable mapping of the file is preferred for the address
/// range. Pseudo-paths (`[heap]`, anonymous memory) never match.
pub fn libssl_in(maps: &MemoryMaps) -> Vec<MappedLibrary> {
    let mut out: Vec<MappedLibrary> = Vec::new();
    for m in &maps.0 {
        let MMapPath::Path(p) = &m.pathname else {
            continue;
        };
        let (path, deleted) = match p.as_os_str().as_bytes().strip_suffix(b" (deleted)") {
            Some(base) => (PathBuf::from(OsStr::from_bytes(base)), true),
            None => (p.clone(), false),
        };
        if !path.file_name().is_some_and(is_libssl_name) {
            continue;
        }
        let exec = m.perms.contains(MMPermissions::EXECUTE);
        let lib = MappedLibrary {
            path,
            deleted,
            dev: m.dev,
            inode: m.inode,
            range: m.address,
        };
        match out
            .iter_mut()
            .find(|l| (l.dev, l.inode, &l.path) == (lib.dev, lib.inode, &lib.path))
        {
            Some(seen) => {
                if exec {
                    seen.range = lib.range;
                }
            }
            None => out.push(lib),
        }
    }
    out
}

/// The libssl files process `pid` maps (`/proc/PID/maps`). Errors: the process is gone
/// (`Gone`) or its map cannot be read (another user's process without `CAP_SYS_PTRACE`).
pub fn mapped_libssl(pid: u32) -> Result<Vec<MappedLibrary>, ProcError> {
    let p =
        procfs::process::Process::new(pid as i32).map_err(|e| ProcError::from_procfs(pid, e))?;
    let maps = p.maps().map_err(|e| ProcError::from_procfs(pid, e))?;
    Ok(libssl_in(&maps))
}

/// The start time of process `pid` (`/proc/PID/stat` field 22, clock ticks after boot), to
/// tell a reused pid from the process that had it. `None` when it is gone or unreadable.
pub fn start_time(pid: u32) -> Option<u64> {
    procfs::process::Process::new(pid as i32)
        .and_then(|p| p.stat())
        .ok()
        .map(|s| s.starttime)
}

/// Why a process's map could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProcError {
    /// The process no longer exists.
    Gone,
    /// `/proc/PID/maps` could not be read: the message names the file and the error.
    Unreadable(String),
}

impl ProcError {
    fn from_procfs(pid: u32, e: procfs::ProcError) -> Self {
        match e {
            procfs::ProcError::NotFound(_) => ProcError::Gone,
            e => ProcError::Unreadable(format!("reading /proc/{pid}/maps: {e}")),
        }
    }
}

/// Why attaching one program to one function failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttachError {
    /// The library has no such symbol (an older OpenSSL; the text says what aya found).
    MissingSymbol(String),
    /// Anything else (permission, a kernel refusal, no file descriptor left): the text.
    Failed(String),
}

/// What [`TlsHooks`] needs from the system: reading processes and attaching programs. The
/// real one is [`crate::loader::Capture`]; unit tests give their own.
pub trait Host {
    /// A live attachment; dropping it detaches.
    type Link;
    /// [`start_time`] of `pid`.
    fn start_time(&self, pid: u32) -> Option<u64>;
    /// [`mapped_libssl`] of `pid`.
    fn libssl(&self, pid: u32) -> Result<Vec<MappedLibrary>, ProcError>;
    /// Attaches program `program` to `symbol` of the file `target`, for process `pid` only.
    fn attach(
        &mut self,
        program: &str,
        symbol: &str,
        target: &Path,
        pid: u32,
    ) -> Result<Self::Link, AttachError>;
    /// Why no hook can be attached at all (the programs could not be loaded), if so.
    fn unavailable(&self) -> Option<String>;
}

/// One watched process as the hooks know it.
struct Proc<L> {
    start_time: Option<u64>,
    status: TlsAttach,
    /// Dropping them detaches the uprobes.
    links: Vec<L>,
    /// [`TlsAttach::NoLibrary`]: when to look at the map again.
    recheck_at: Option<Instant>,
}

/// A change of one process's status, for the model ([`crate::model::Model::set_tls_attach`]
/// with `Some`, `forget_tls_attach` with `None`) and the front end's log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub tgid: u32,
    /// The new status; `None`: the process is gone or no longer watched (its hooks were
    /// detached).
    pub status: Option<TlsAttach>,
}

/// The libssl hooks of every watched process: status and uprobe links per tgid. Holds
/// entries only for the processes [`TlsHooks::sync`] was last given (plus those handled by
/// [`TlsHooks::handle`] since), so it never grows with the processes seen.
pub struct TlsHooks<L> {
    enabled: bool,
    /// Why nothing can be attached although the programs are loaded (the front end lacks a
    /// capability, [`TlsHooks::set_unavailable`]).
    unavailable: Option<String>,
    procs: BTreeMap<u32, Proc<L>>,
}

impl<L> TlsHooks<L> {
    /// No process yet. `enabled: false` (`--no-tls-hooks`): nothing is ever attached and
    /// every process is [`TlsAttach::Disabled`].
    pub fn new(enabled: bool) -> Self {
        TlsHooks {
            enabled,
            unavailable: None,
            procs: BTreeMap::new(),
        }
    }

    /// Nothing can be attached, for reason `why` (e.g. the daemon does not hold the
    /// capability `perf_event_open(2)` of the uprobe PMU needs): every process that maps a
    /// libssl is [`TlsAttach::Failed`] with this text, without an attempt.
    pub fn set_unavailable(&mut self, why: String) {
        self.unavailable = Some(why);
    }

    /// Whether hooks are attached at all (not `--no-tls-hooks`).
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Processes with an entry.
    pub fn len(&self) -> usize {
        self.procs.len()
    }

    /// No process has an entry.
    pub fn is_empty(&self) -> bool {
        self.procs.is_empty()
    }

    /// Live uprobe links, over every process.
    pub fn links(&self) -> usize {
        self.procs.values().map(|p| p.links.len()).sum()
    }

    /// The status of `tgid`, if it has an entry.
    pub fn status(&self, tgid: u32) -> Option<&TlsAttach> {
        self.procs.get(&tgid).map(|p| &p.status)
    }

    /// Looks at process `tgid` now and attaches the hooks to the libssl it maps (call it
    /// before the process is added to `WATCHED_TGIDS`, so that its sockets' first calls
    /// already run inside hooked functions). An existing entry of `tgid` is replaced (its
    /// links dropped first). Returns the new status, `None` when the process is gone.
    pub fn handle<H: Host<Link = L>>(
        &mut self,
        host: &mut H,
        tgid: u32,
        now: Instant,
    ) -> Option<TlsAttach> {
        // Detach first: a re-attachment must never run the programs twice per call.
        self.procs.remove(&tgid);
        let start = host.start_time(tgid);
        let (status, links) = if !self.enabled {
            (TlsAttach::Disabled, Vec::new())
        } else {
            match host.libssl(tgid) {
                Err(ProcError::Gone) => return None,
                Err(ProcError::Unreadable(e)) => (
                    TlsAttach::Failed {
                        library: format!("/proc/{tgid}/maps"),
                        error: e,
                    },
                    Vec::new(),
                ),
                Ok(libs) if libs.is_empty() => (TlsAttach::NoLibrary, Vec::new()),
                Ok(libs) => match host.unavailable().or_else(|| self.unavailable.clone()) {
                    Some(why) => (
                        TlsAttach::Failed {
                            library: libs[0].label(),
                            error: why,
                        },
                        Vec::new(),
                    ),
                    None => attach_all(host, tgid, &libs),
                },
            }
        };
        let recheck_at = (status == TlsAttach::NoLibrary).then(|| now + RECHECK);
        self.procs.insert(
            tgid,
            Proc {
                start_time: start,
                status: status.clone(),
                links,
                recheck_at,
            },
        );
        Some(status)
    }

    /// Brings the entries in line with `watched` (the tgids whose hooks this front end
    /// owns, from `WATCHED_TGIDS`): processes no longer there, gone or whose pid now
    /// belongs to another process (start time changed) are detached and dropped; watched
    /// ones without an entry are handled ([`TlsHooks::handle`]); those without a libssl
    /// are looked at again every [`RECHECK`]. Returns what changed.
    pub fn sync<H: Host<Link = L>>(
        &mut self,
        host: &mut H,
        watched: &[u32],
        now: Instant,
    ) -> Vec<Change> {
        let want: BTreeSet<u32> = watched.iter().copied().collect();
        let mut changes = Vec::new();
        let gone: Vec<u32> = self
            .procs
            .keys()
            .copied()
            .filter(|t| !want.contains(t))
            .collect();
        for tgid in gone {
            self.procs.remove(&tgid);
            changes.push(Change { tgid, status: None });
        }
        for &tgid in &want {
            let redo = match self.procs.get(&tgid) {
                None => true,
                Some(p) => {
                    let start = host.start_time(tgid);
                    start.is_none()
                        || start != p.start_time
                        || p.recheck_at.is_some_and(|t| now >= t)
                }
            };
            if !redo {
                continue;
            }
            let before = self.procs.get(&tgid).map(|p| p.status.clone());
            let status = self.handle(host, tgid, now);
            if status != before {
                changes.push(Change { tgid, status });
            }
        }
        changes
    }
}

/// Whether this front end hooks the process of a `WATCHED_TGIDS` entry of value `value`:
/// the processes it watches ([`watch::PRIMARY`]); beside the daemon (reading its pinned set,
/// `observe --pin-dir`), only those the daemon does not watch ([`watch::TAP`] without
/// `PRIMARY`): the daemon hooks its own, and hooking a process twice would run the programs
/// twice per call.
pub fn hooks_entry(value: u32, beside: bool) -> bool {
    if beside {
        value & watch::TAP != 0 && value & watch::PRIMARY == 0
    } else {
        value & watch::PRIMARY != 0
    }
}

impl TlsHooks<UProbeLink> {
    /// [`TlsHooks::handle`] of `tgid` and of the children it already has (those
    /// `Engine::watch` watches with it, `sockdiag::descendants`) through the capture, before
    /// the front end adds them to `WATCHED_TGIDS` (`Engine::watch`), and their statuses to
    /// the model. Beside the daemon, a process the daemon watches is left to it. Returns the
    /// status of `tgid` (`None`: gone, or left to the daemon) and the children's.
    pub fn attach_first(
        &mut self,
        cap: &mut Capture,
        model: &mut Model,
        tgid: u32,
        beside: bool,
    ) -> (Option<TlsAttach>, Vec<(u32, TlsAttach)>) {
        let me = std::process::id();
        let mut one = |hooks: &mut Self, t: u32| -> Option<TlsAttach> {
            if t == me || (beside && cap.is_watched(t)) {
                return None;
            }
            let s = hooks.handle(cap, t, Instant::now())?;
            debug!("pid {t}: libssl hooks {s:?}");
            model.set_tls_attach(t, s.clone());
            Some(s)
        };
        let root = one(self, tgid);
        let children = crate::sockdiag::descendants(tgid)
            .into_iter()
            .filter_map(|c| one(self, c).map(|s| (c, s)))
            .collect();
        (root, children)
    }

    /// [`TlsHooks::sync`] with the capture's `WATCHED_TGIDS` entries this front end hooks
    /// ([`hooks_entry`]), each change reported to the model (set, or forgotten when the
    /// process went). Returns the changes, for the front end's log (see [`failure_line`]).
    /// Errors when `WATCHED_TGIDS` cannot be read (nothing changes then).
    pub fn follow(
        &mut self,
        cap: &mut Capture,
        model: &mut Model,
        beside: bool,
    ) -> anyhow::Result<Vec<Change>> {
        let watched: Vec<u32> = cap
            .watch_entries()?
            .into_iter()
            .filter(|&(_, v)| hooks_entry(v, beside))
            .map(|(t, _)| t)
            .collect();
        let changes = self.sync(cap, &watched, Instant::now());
        for c in &changes {
            debug!("pid {}: libssl hooks {:?}", c.tgid, c.status);
            match &c.status {
                Some(s) => model.set_tls_attach(c.tgid, s.clone()),
                None => model.forget_tls_attach(c.tgid),
            }
        }
        Ok(changes)
    }
}

/// Attaches every hook to every library of `libs` for `pid`: [`TlsAttach::Attached`] (the
/// libraries that took them, comma-separated) if any did, else the first library's
/// failure.
fn attach_all<H: Host>(
    host: &mut H,
    pid: u32,
    libs: &[MappedLibrary],
) -> (TlsAttach, Vec<H::Link>) {
    let mut links = Vec::new();
    let mut attached: Vec<String> = Vec::new();
    let mut failed: Option<TlsAttach> = None;
    for lib in libs {
        match attach_library(host, pid, lib) {
            Ok(mut l) => {
                links.append(&mut l);
                attached.push(lib.label());
            }
            Err(error) => {
                debug!("pid {pid}: libssl hooks on {}: {error}", lib.label());
                failed.get_or_insert(TlsAttach::Failed {
                    library: lib.label(),
                    error,
                });
            }
        }
    }
    if attached.is_empty() {
        let f = failed.unwrap_or(TlsAttach::NoLibrary);
        return (f, Vec::new());
    }
    (
        TlsAttach::Attached {
            library: attached.join(", "),
        },
        links,
    )
}

/// Attaches the hooks of every function of [`FUNCTIONS`] the library has: for each, the
/// uretprobe first and then the entry program, so that every entry that saves a call has
/// a return that takes it. A function the library lacks is skipped, unless it is
/// [`REQUIRED`]; any other failure fails the library. On failure every link made is
/// dropped (detached) and the error says which function and program failed.
fn attach_library<H: Host>(
    host: &mut H,
    pid: u32,
    lib: &MappedLibrary,
) -> Result<Vec<H::Link>, String> {
    let target = lib.attach_path(pid);
    let t0 = Instant::now();
    let mut links = Vec::new();
    let mut missing = Vec::new();
    for f in FUNCTIONS {
        let entry = entry_program(f).expect("every function has an entry program");
        let ret = match host.attach(RET_PROGRAM, f, &target, pid) {
            Ok(l) => l,
            Err(AttachError::MissingSymbol(e)) if !REQUIRED.contains(&f) => {
                missing.push(f);
                debug!("pid {pid}: {} has no {f} ({e}): not hooked", lib.label());
                continue;
            }
            Err(AttachError::MissingSymbol(e)) => {
                return Err(format!("{f} not found in {} ({e})", target.display()));
            }
            Err(AttachError::Failed(e)) => {
                return Err(format!("attaching {RET_PROGRAM} to {f}: {e}"));
            }
        };
        let e = match host.attach(entry, f, &target, pid) {
            Ok(l) => l,
            Err(AttachError::MissingSymbol(e) | AttachError::Failed(e)) => {
                return Err(format!("attaching {entry} to {f}: {e}"));
            }
        };
        links.push(ret);
        links.push(e);
    }
    debug!(
        "pid {pid}: libssl hooks on {} ({} links in {:.1} ms{})",
        target.display(),
        links.len(),
        t0.elapsed().as_secs_f64() * 1e3,
        if missing.is_empty() {
            String::new()
        } else {
            format!("; absent: {}", missing.join(", "))
        }
    );
    Ok(links)
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (each attached hook holds a file
/// descriptor, [`PROGRAMS`] × functions per process). Returns the soft limit in force.
pub fn raise_fd_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return 0;
        }
        if r.rlim_cur < r.rlim_max {
            let want = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                return want.rlim_cur;
            }
        }
    }
    r.rlim_cur
}

/// The one line a front end prints when a process's hooks could not be attached (naming
/// the process, the library and the error); `None` for every other status, and for a
/// failure whose error is `said` (a reason the front end logged once for every process,
/// e.g. a missing capability).
pub fn failure_line(
    tgid: u32,
    comm: &str,
    status: &TlsAttach,
    said: Option<&str>,
) -> Option<String> {
    match status {
        TlsAttach::Failed { error, .. } if Some(error.as_str()) == said => None,
        TlsAttach::Failed { library, error } => Some(format!(
            "libssl hooks for pid {tgid} ({comm}) not attached on {library}: {error}; its TLS \
             channels stay `unparsed: tls`"
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use procfs::FromRead as _;

    use super::*;

    /// `/proc/PID/maps` of an `openssl s_server` on Debian 12 (OpenSSL 3.0), shortened, with
    /// a container's libssl of another inode and a deleted 1.1 copy appended.
    const MAPS: &str = "\
55d0c2a00000-55d0c2a3c000 r--p 00000000 fe:01 1837443                    /usr/bin/openssl
55d0c2a3c000-55d0c2ab5000 r-xp 0003c000 fe:01 1837443                    /usr/bin/openssl
55d0c3e1d000-55d0c3e3e000 rw-p 00000000 00:00 0                          [heap]
7f1c4b000000-7f1c4b021000 rw-p 00000000 00:00 0 
7f1c4b400000-7f1c4b47e000 r--p 00000000 fe:01 1836262                    /usr/lib/x86_64-linux-gnu/libcrypto.so.3
7f1c4b8a0000-7f1c4b8bd000 r--p 00000000 fe:01 1836263                    /usr/lib/x86_64-linux-gnu/libssl.so.3
7f1c4b8bd000-7f1c4b916000 r-xp 0001d000 fe:01 1836263                    /usr/lib/x86_64-linux-gnu/libssl.so.3
7f1c4b916000-7f1c4b932000 r--p 00076000 fe:01 1836263                    /usr/lib/x86_64-linux-gnu/libssl.so.3
7f1c4b932000-7f1c4b93c000 rw-p 00092000 fe:01 1836263                    /usr/lib/x86_64-linux-gnu/libssl.so.3
7f1c4b950000-7f1c4b960000 r-xp 00010000 fe:01 1836999                    /usr/lib/x86_64-linux-gnu/libssl3.so
7f1c4b960000-7f1c4b970000 r-xp 00010000 fe:01 1836998                    /usr/lib/x86_64-linux-gnu/libssl.so.3.bak/x
7f1c4b970000-7f1c4b990000 r-xp 00020000 fe:01 2000001                    /opt/ssl/lib/libssl.so.1.1 (deleted)
7f1c4bb00000-7f1c4bb02000 r--p 00000000 fe:01 1836000                    /usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
7ffd5e8f0000-7ffd5e911000 rw-p 00000000 00:00 0                          [stack]
7ffd5e9b0000-7ffd5e9b4000 r--p 00000000 00:00 0                          [vvar]
7ffd5e9b4000-7ffd5e9b6000 r-xp 00000000 00:00 0                          [vdso]
";

    fn maps(text: &str) -> MemoryMaps {
        MemoryMaps::from_read(text.as_bytes()).unwrap()
    }

    #[test]
    fn libssl_names() {
        for yes in [
            "libssl.so",
            "libssl.so.3",
            "libssl.so.1.1",
            "libssl.so.3.0.15",
        ] {
            assert!(is_libssl_name(OsStr::new(yes)), "{yes}");
        }
        for no in [
            "libssl3.so",
            "libcrypto.so.3",
            "libssl.so3",
            "libssl",
            "xlibssl.so.3",
            "libgnutls.so.30",
        ] {
            assert!(!is_libssl_name(OsStr::new(no)), "{no}");
        }
    }

    /// One entry per distinct libssl file, the executable mapping's range, no other
    /// library (libssl3.so is NSS's, a directory named libssl.so.* is not a file name), and
    /// a deleted mapping recognised with its path cleaned.
    #[test]
    fn libssl_in_maps_fixture() {
        let libs = libssl_in(&maps(MAPS));
        assert_eq!(
            libs,
            [
                MappedLibrary {
                    path: "/usr/lib/x86_64-linux-gnu/libssl.so.3".into(),
                    deleted: false,
                    dev: (0xfe, 1),
                    inode: 1836263,
                    range: (0x7f1c4b8bd000, 0x7f1c4b916000),
                },
                MappedLibrary {
                    path: "/opt/ssl/lib/libssl.so.1.1".into(),
                    deleted: true,
                    dev: (0xfe, 1),
                    inode: 2000001,
                    range: (0x7f1c4b970000, 0x7f1c4b990000),
                },
            ]
        );
        assert_eq!(
            libs[0].attach_path(4242),
            Path::new("/proc/4242/root/usr/lib/x86_64-linux-gnu/libssl.so.3")
        );
        assert_eq!(
            libs[1].attach_path(4242),
            Path::new("/proc/4242/map_files/7f1c4b970000-7f1c4b990000")
        );
        assert_eq!(libs[1].label(), "/opt/ssl/lib/libssl.so.1.1 (deleted)");
    }

    /// A process without libssl (statically linked, or GnuTLS) has none.
    #[test]
    fn no_libssl_in_maps() {
        let text: String = MAPS
            .lines()
            .filter(|l| !l.contains("libssl.so"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(libssl_in(&maps(&text)).is_empty());
        assert!(libssl_in(&maps("")).is_empty());
    }

    /// This test process's own map parses (real input; whether it maps libssl depends on
    /// the build, so only that the read works is checked).
    #[test]
    fn own_maps_read() {
        mapped_libssl(std::process::id()).unwrap();
        assert_eq!(mapped_libssl(u32::MAX >> 1), Err(ProcError::Gone));
    }

    /// Every function has its entry program and is under the uretprobe; the program list
    /// covers the functions exactly once per kind.
    #[test]
    fn program_table() {
        for f in FUNCTIONS {
            assert!(entry_program(f).is_some(), "{f}");
            let n = PROGRAMS
                .iter()
                .filter(|p| !p.ret && p.symbols.contains(&f))
                .count();
            assert_eq!(n, 1, "{f}");
        }
        let ret: Vec<_> = PROGRAMS.iter().filter(|p| p.ret).collect();
        assert_eq!(ret.len(), 1);
        assert_eq!(ret[0].symbols, FUNCTIONS);
        assert_eq!(ret[0].name, RET_PROGRAM);
    }

    /// A fake system: processes (start time, libraries), symbols per library path, attach
    /// results, and a log of live links (a link removes itself from it when dropped).
    #[derive(Default)]
    struct Fake {
        procs: BTreeMap<u32, (u64, Vec<MappedLibrary>)>,
        /// Symbols each attach target lacks.
        lacks: Vec<&'static str>,
        /// (program, symbol) pairs whose attach fails.
        refuse: Vec<(&'static str, &'static str)>,
        live: Rc<RefCell<Vec<(u32, String, String)>>>,
        attaches: usize,
        unavailable: Option<String>,
    }

    struct FakeLink {
        key: (u32, String, String),
        live: Rc<RefCell<Vec<(u32, String, String)>>>,
    }

    impl Drop for FakeLink {
        fn drop(&mut self) {
            let mut l = self.live.borrow_mut();
            let i = l.iter().position(|k| *k == self.key).unwrap();
            l.remove(i);
        }
    }

    impl Host for Fake {
        type Link = FakeLink;
        fn start_time(&self, pid: u32) -> Option<u64> {
            self.procs.get(&pid).map(|p| p.0)
        }
        fn libssl(&self, pid: u32) -> Result<Vec<MappedLibrary>, ProcError> {
            self.procs
                .get(&pid)
                .map(|p| p.1.clone())
                .ok_or(ProcError::Gone)
        }
        fn attach(
            &mut self,
            program: &str,
            symbol: &str,
            target: &Path,
            pid: u32,
        ) -> Result<FakeLink, AttachError> {
            self.attaches += 1;
            assert!(target.starts_with(format!("/proc/{pid}/")), "{target:?}");
            if self.lacks.contains(&symbol) {
                return Err(AttachError::MissingSymbol(format!("no symbol {symbol}")));
            }
            if self
                .refuse
                .iter()
                .any(|&(p, s)| p == program && s == symbol)
            {
                return Err(AttachError::Failed(
                    "Permission denied (os error 13)".into(),
                ));
            }
            let key = (pid, program.to_string(), symbol.to_string());
            self.live.borrow_mut().push(key.clone());
            Ok(FakeLink {
                key,
                live: self.live.clone(),
            })
        }
        fn unavailable(&self) -> Option<String> {
            self.unavailable.clone()
        }
    }

    fn lib3() -> MappedLibrary {
        libssl_in(&maps(MAPS)).remove(0)
    }

    fn live_of(f: &Fake, pid: u32) -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = f
            .live
            .borrow()
            .iter()
            .filter(|k| k.0 == pid)
            .map(|k| (k.1.clone(), k.2.clone()))
            .collect();
        v.sort();
        v
    }

    /// OpenSSL 3: both programs on each of the eight functions, the uretprobe on all.
    #[test]
    fn attaches_every_function() {
        let mut f = Fake::default();
        f.procs.insert(10, (1, vec![lib3()]));
        let mut h = TlsHooks::new(true);
        let t = Instant::now();
        let s = h.handle(&mut f, 10, t).unwrap();
        assert_eq!(
            s,
            TlsAttach::Attached {
                library: "/usr/lib/x86_64-linux-gnu/libssl.so.3".into()
            }
        );
        let live = live_of(&f, 10);
        assert_eq!(live.len(), 16);
        for fun in FUNCTIONS {
            assert!(live.contains(&(RET_PROGRAM.into(), fun.into())), "{fun}");
            assert!(live.contains(&(entry_program(fun).unwrap().into(), fun.into())));
        }
        assert_eq!(h.links(), 16);
    }

    /// OpenSSL 1.1.0 (no _ex functions): the rest is attached; without SSL_write or
    /// SSL_read, or when one cannot be attached, the library fails and nothing stays
    /// attached.
    #[test]
    fn missing_symbols() {
        let mut f = Fake::default();
        f.procs.insert(10, (1, vec![lib3()]));
        f.lacks = vec!["SSL_write_ex", "SSL_read_ex", "SSL_peek_ex"];
        let mut h = TlsHooks::new(true);
        let t = Instant::now();
        assert!(matches!(
            h.handle(&mut f, 10, t),
            Some(TlsAttach::Attached { .. })
        ));
        assert_eq!(live_of(&f, 10).len(), 10);

        f.lacks = vec!["SSL_read"];
        let s = h.handle(&mut f, 10, t).unwrap();
        let TlsAttach::Failed { library, error } = &s else {
            panic!("{s:?}")
        };
        assert_eq!(library, "/usr/lib/x86_64-linux-gnu/libssl.so.3");
        assert!(
            error.contains("SSL_read not found") && error.contains("no symbol SSL_read"),
            "{error}"
        );
        assert!(live_of(&f, 10).is_empty(), "{:?}", live_of(&f, 10));
        assert!(
            failure_line(10, "x", &s, None)
                .unwrap()
                .contains("libssl.so.3")
        );
        assert!(failure_line(10, "x", &s, Some("other")).is_some());
        let TlsAttach::Failed { error, .. } = &s else {
            unreachable!()
        };
        assert!(failure_line(10, "x", &s, Some(error)).is_none());
        assert!(failure_line(10, "x", &TlsAttach::NoLibrary, None).is_none());

        f.lacks = Vec::new();
        f.refuse = vec![("spice_ssl_write", "SSL_write")];
        let s = h.handle(&mut f, 10, t).unwrap();
        let TlsAttach::Failed { error, .. } = &s else {
            panic!("{s:?}")
        };
        assert!(
            error.contains("spice_ssl_write") && error.contains("Permission denied"),
            "{error}"
        );
        assert!(live_of(&f, 10).is_empty());

        // An optional function that exists but cannot be attached is a failure too.
        f.refuse = vec![(RET_PROGRAM, "SSL_peek")];
        assert!(matches!(
            h.handle(&mut f, 10, t),
            Some(TlsAttach::Failed { .. })
        ));
        assert!(live_of(&f, 10).is_empty());
    }

    /// Statuses without attaching: disabled, no library, programs unavailable, unreadable
    /// map, gone.
    #[test]
    fn statuses_without_links() {
        let mut f = Fake::default();
        f.procs.insert(10, (1, vec![lib3()]));
        f.procs.insert(11, (1, Vec::new()));
        let t = Instant::now();
        let mut off = TlsHooks::new(false);
        assert_eq!(off.handle(&mut f, 10, t), Some(TlsAttach::Disabled));
        assert_eq!(f.attaches, 0);
        let mut h = TlsHooks::new(true);
        assert_eq!(h.handle(&mut f, 11, t), Some(TlsAttach::NoLibrary));
        assert_eq!(h.handle(&mut f, 12, t), None);
        assert_eq!(h.len(), 1);
        f.unavailable = Some("the kernel lacks uprobes".into());
        assert_eq!(
            h.handle(&mut f, 10, t),
            Some(TlsAttach::Failed {
                library: "/usr/lib/x86_64-linux-gnu/libssl.so.3".into(),
                error: "the kernel lacks uprobes".into()
            })
        );
        assert_eq!(f.attaches, 0);
    }

    /// sync: new watched processes are handled, unwatched ones detached and forgotten, a
    /// reused pid re-done, a process without libssl re-checked after RECHECK (a dlopen),
    /// and the entries never outgrow the watched set.
    #[test]
    fn sync_follows_the_watched_set() {
        let mut f = Fake::default();
        f.procs.insert(10, (1, vec![lib3()]));
        f.procs.insert(11, (1, Vec::new()));
        let mut h = TlsHooks::new(true);
        let t0 = Instant::now();
        // Attached before it is watched, then the first sync has nothing to do for it.
        h.handle(&mut f, 10, t0);
        let c = h.sync(&mut f, &[10, 11], t0);
        assert_eq!(
            c,
            [Change {
                tgid: 11,
                status: Some(TlsAttach::NoLibrary)
            }]
        );
        assert!(
            h.sync(&mut f, &[10, 11], t0 + Duration::from_secs(1))
                .is_empty()
        );
        let n = f.attaches;
        // dlopen: 11 maps libssl now; seen at the recheck, not before.
        f.procs.get_mut(&11).unwrap().1 = vec![lib3()];
        assert!(
            h.sync(&mut f, &[10, 11], t0 + Duration::from_secs(4))
                .is_empty()
        );
        assert_eq!(f.attaches, n);
        let c = h.sync(&mut f, &[10, 11], t0 + RECHECK);
        assert_eq!(c.len(), 1);
        assert!(
            matches!(c[0].status, Some(TlsAttach::Attached { .. })),
            "{c:?}"
        );
        assert_eq!(live_of(&f, 11).len(), 16);
        // No longer watched: detached and forgotten.
        let c = h.sync(&mut f, &[10], t0 + RECHECK);
        assert_eq!(
            c,
            [Change {
                tgid: 11,
                status: None
            }]
        );
        assert!(live_of(&f, 11).is_empty());
        // Pid 10 reused by another process (start time changed): its old links go first.
        f.procs.insert(10, (2, Vec::new()));
        let c = h.sync(&mut f, &[10], t0 + RECHECK);
        assert_eq!(
            c,
            [Change {
                tgid: 10,
                status: Some(TlsAttach::NoLibrary)
            }]
        );
        assert!(live_of(&f, 10).is_empty());
        // Exited while still listed: dropped.
        f.procs.remove(&10);
        let c = h.sync(&mut f, &[10], t0 + RECHECK);
        assert_eq!(
            c,
            [Change {
                tgid: 10,
                status: None
            }]
        );
        assert!(h.is_empty());
        // Bounded: a thousand short-lived processes leave nothing behind.
        for pid in 100..1100 {
            f.procs.insert(pid, (1, vec![lib3()]));
            h.sync(&mut f, &[pid], t0);
            f.procs.remove(&pid);
        }
        h.sync(&mut f, &[], t0);
        assert!(h.is_empty());
        assert!(f.live.borrow().is_empty());
    }

    /// Two libssl files: both hooked, both named; one failing leaves the other attached.
    #[test]
    fn two_libraries() {
        let libs = libssl_in(&maps(MAPS));
        let mut f = Fake::default();
        f.procs.insert(10, (1, libs));
        let mut h = TlsHooks::new(true);
        let s = h.handle(&mut f, 10, Instant::now()).unwrap();
        assert_eq!(
            s,
            TlsAttach::Attached {
                library:
                    "/usr/lib/x86_64-linux-gnu/libssl.so.3, /opt/ssl/lib/libssl.so.1.1 (deleted)"
                        .into()
            }
        );
        assert_eq!(live_of(&f, 10).len(), 32);
    }
}
