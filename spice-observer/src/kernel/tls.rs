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
//! OpenSSL 3 (the daemon's pinned links hold none once pinned); [`raise_fd_limit`] lifts
//! the soft `RLIMIT_NOFILE` to the hard limit. Attaching 16 takes ~25 ms; releasing them
//! ~1.7 s (~110 ms per uprobe on Linux 6.18, serialized in the kernel, see [`HookLink`]),
//! so links are released on a background thread ([`TlsHooks::with_detacher`]), entry
//! programs before uretprobes ([`ProcLinks`]).
//!
//! The daemon pins its links under its pin directory ([`TlsHooks::adopt_pins`],
//! [`PinName`]): its exit releases nothing, the hooks keep working while no daemon runs,
//! and the next daemon adopts those of processes still alive.

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::OsStr,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use log::debug;
use procfs::process::{MMPermissions, MMapPath, MemoryMaps};
use spice_ebpf_common::config::watch;

use crate::{
    loader::{Capture, TlsLink},
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
/// Called for every hooked process at every scan, so it is one `read` of the file and the
/// discovery scan's parser ([`crate::host::discovery::parse_stat`]), not a full
/// `procfs::process::Stat` (which opens `/proc/PID` first and parses all 52 fields).
pub fn start_time(pid: u32) -> Option<u64> {
    let raw = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    crate::host::discovery::parse_stat(&raw).map(|s| s.start_time)
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

/// A live attachment of one program to one function for one process ([`Host::Link`]).
/// Dropping it ends an attachment only this process holds (its file descriptor closes) and
/// leaves a pinned one in place (the pin holds it: the daemon's exit releases nothing);
/// [`HookLink::release`] ends either.
pub trait HookLink: Send + 'static {
    /// Ends the attachment now, in the calling thread; a pinned one loses its pin first.
    /// Slow: about 110 ms per uprobe measured on Linux 6.18 (releasing a perf-event uprobe
    /// runs `uprobe_unregister_sync`, an RCU-tasks-trace grace period, under the global
    /// `event_mutex`, so releases serialize), hence [`TlsHooks::with_detacher`].
    fn release(self);
}

/// The links of one process, entry programs and uretprobes apart, so that they always end
/// in the same order: every entry program first, then the uretprobes. (The other order
/// leaves, while the uretprobes are gone and the entries not yet, a `TlsCall` in the
/// kernel's `TLS_CALLS` map at each SSL call that no return takes: the thread's later
/// socket calls then look as if inside libssl, and a new socket's carrier is misdecided.)
/// Dropping it drops the links in that order, and so does [`ProcLinks::release`].
pub struct ProcLinks<L: HookLink> {
    entries: Vec<L>,
    rets: Vec<L>,
}

impl<L: HookLink> Default for ProcLinks<L> {
    fn default() -> Self {
        ProcLinks {
            entries: Vec::new(),
            rets: Vec::new(),
        }
    }
}

impl<L: HookLink> ProcLinks<L> {
    /// Adds one link: a uretprobe's (`ret`) or an entry program's.
    pub fn push(&mut self, ret: bool, link: L) {
        if ret {
            self.rets.push(link);
        } else {
            self.entries.push(link);
        }
    }

    /// Moves every link of `other` here.
    pub fn append(&mut self, mut other: ProcLinks<L>) {
        self.entries.append(&mut other.entries);
        self.rets.append(&mut other.rets);
    }

    /// Links held.
    pub fn len(&self) -> usize {
        self.entries.len() + self.rets.len()
    }

    /// No link held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Ends every link ([`HookLink::release`]) in the calling thread: the entries, then the
    /// uretprobes. Returns how many.
    pub fn release(mut self) -> usize {
        let n = self.len();
        for l in std::mem::take(&mut self.entries) {
            l.release();
        }
        for l in std::mem::take(&mut self.rets) {
            l.release();
        }
        n
    }
}

impl<L: HookLink> Drop for ProcLinks<L> {
    fn drop(&mut self) {
        // Explicit: a Vec drops front to back, and the fields in declaration order, but the
        // order here is the point.
        for l in std::mem::take(&mut self.entries) {
            drop(l);
        }
        for l in std::mem::take(&mut self.rets) {
            drop(l);
        }
    }
}

/// The name of a libssl link pin in the daemon's pin directory:
/// `tls_<pid>_<start time>_<major>-<minor>-<inode>_<links>_<program>_<function>`, e.g.
/// `tls_4242_981234_254-1-1836263_16_spice_ssl_ret_SSL_write` (no dots: the BPF filesystem
/// refuses names with one, EPERM, `kernel/bpf/inode.c` `bpf_lookup`). The process is named by pid
/// and start time (`/proc/PID/stat` field 22: a reused pid is another process), the library
/// by device and inode, and `links` is how many links that library got for that process, so
/// that a set cut short (an agent killed while attaching) is told from a library that lacks
/// optional functions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinName {
    pub pid: u32,
    pub start_time: u64,
    /// [`MappedLibrary::dev`] and [`MappedLibrary::inode`] of the library.
    pub dev: (i32, i32),
    pub inode: u64,
    /// Links of this (process, library) pair.
    pub links: usize,
    /// One of [`PROGRAMS`] and one of its symbols.
    pub program: &'static str,
    pub function: &'static str,
}

/// What every libssl link pin's name starts with ([`PinName`]).
pub const PIN_PREFIX: &str = "tls_";

/// A library's identity in [`PinName`]: (device major, minor, inode).
pub type LibKey = (i32, i32, u64);

impl PinName {
    /// The library part of the name.
    pub fn lib(&self) -> LibKey {
        (self.dev.0, self.dev.1, self.inode)
    }

    /// Whether the program is the uretprobe.
    pub fn ret(&self) -> bool {
        self.program == RET_PROGRAM
    }

    /// Parses a pin name; `None` for anything that is not exactly what [`PinName`]'s
    /// `Display` writes (other files, a program or function not of [`PROGRAMS`], numbers
    /// with leading zeros or signs).
    pub fn parse(name: &str) -> Option<PinName> {
        let rest = name.strip_prefix(PIN_PREFIX)?;
        let mut it = rest.splitn(5, '_');
        let pid = it.next()?.parse().ok()?;
        let start_time = it.next()?.parse().ok()?;
        let mut lib = it.next()?.split('-');
        let dev: (u32, u32) = (lib.next()?.parse().ok()?, lib.next()?.parse().ok()?);
        let dev = (dev.0 as i32, dev.1 as i32);
        let inode = lib.next()?.parse().ok()?;
        if lib.next().is_some() {
            return None;
        }
        let links = it.next()?.parse().ok()?;
        let tail = it.next()?;
        let (program, function) = PROGRAMS.iter().find_map(|p| {
            let f = tail.strip_prefix(p.name)?.strip_prefix('_')?;
            p.symbols.iter().find(|s| **s == f).map(|s| (p.name, *s))
        })?;
        let n = PinName {
            pid,
            start_time,
            dev,
            inode,
            links,
            program,
            function,
        };
        (n.to_string() == name).then_some(n)
    }
}

impl std::fmt::Display for PinName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{PIN_PREFIX}{}_{}_{}-{}-{}_{}_{}_{}",
            self.pid,
            self.start_time,
            self.dev.0 as u32,
            self.dev.1 as u32,
            self.inode,
            self.links,
            self.program,
            self.function
        )
    }
}

/// The pinned links of one library for one process, as found at start.
struct PinnedLib<L: HookLink> {
    /// [`PinName::links`] (the same in every name of a complete set).
    want: usize,
    links: ProcLinks<L>,
}

/// Whether the pinned links an earlier daemon left for a process can be adopted as they
/// are: every libssl it maps now has exactly the links its pins recorded
/// ([`PinName::links`]), and none is for a library it no longer maps. `pinned`: (library,
/// links recorded, links found).
pub fn can_adopt(pinned: &[(LibKey, usize, usize)], mapped: &[MappedLibrary]) -> bool {
    let keys: BTreeSet<LibKey> = mapped.iter().map(|l| (l.dev.0, l.dev.1, l.inode)).collect();
    !mapped.is_empty()
        && pinned.len() == keys.len()
        && pinned
            .iter()
            .all(|(k, want, found)| keys.contains(k) && want == found && *want > 0)
}

/// Why attaching one program to one function failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttachError {
    /// The library has no such symbol (an older OpenSSL; the text says what aya found).
    MissingSymbol(String),
    /// Anything else (permission, a kernel refusal, no file descriptor left): the text.
    Failed(String),
}

/// What [`TlsHooks`] needs from the system: reading processes, attaching programs and
/// pinning links. The real one is [`crate::loader::Capture`]; unit tests give their own.
pub trait Host {
    /// A live attachment.
    type Link: HookLink;
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
    /// Pins `link` as `name` ([`PinName`]) in the pin directory, so that it outlives this
    /// process: the returned link holds no file descriptor and is not ended by a drop.
    /// Errors give the reason and the link unchanged, or `None` when it was lost (detached)
    /// in the attempt.
    fn pin(
        &mut self,
        link: Self::Link,
        name: &str,
    ) -> Result<Self::Link, (Option<Self::Link>, String)>;
    /// The names of the entries of the pin directory that are libssl link pins
    /// ([`PinName::parse`]); none without a pin directory.
    fn pinned_links(&self) -> Vec<String>;
    /// The link of the existing pin `name`, to adopt or to release.
    fn open_pin(&mut self, name: &str) -> Self::Link;
}

/// One watched process as the hooks know it.
struct Proc<L: HookLink> {
    start_time: Option<u64>,
    status: TlsAttach,
    /// Their release ends the uprobes ([`ProcLinks`]).
    links: ProcLinks<L>,
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

/// One thread that releases the links of processes that went ([`ProcLinks::release`]), so
/// that the ~110 ms per uprobe never blocks a front end's loop. Jobs run in order; `pending`
/// counts the queued jobs per tgid.
struct Detacher<L: HookLink> {
    tx: Option<std::sync::mpsc::Sender<(u32, ProcLinks<L>)>>,
    thread: Option<std::thread::JoinHandle<()>>,
    pending: Arc<Mutex<BTreeMap<u32, usize>>>,
}

impl<L: HookLink> Detacher<L> {
    fn start() -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<(u32, ProcLinks<L>)>();
        let pending: Arc<Mutex<BTreeMap<u32, usize>>> = Arc::default();
        let p = pending.clone();
        let thread = std::thread::Builder::new()
            .name("libssl-detach".into())
            .spawn(move || {
                for (tgid, links) in rx {
                    let t0 = Instant::now();
                    let n = links.release();
                    debug!(
                        "pid {tgid}: {n} libssl hook link(s) released in {:.0} ms",
                        t0.elapsed().as_secs_f64() * 1e3
                    );
                    let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(c) = p.get_mut(&tgid) {
                        *c -= 1;
                        if *c == 0 {
                            p.remove(&tgid);
                        }
                    }
                }
            })?;
        Ok(Detacher {
            tx: Some(tx),
            thread: Some(thread),
            pending,
        })
    }

    /// Queues `links` of `tgid`; gives them back when the thread is gone.
    fn send(&self, tgid: u32, links: ProcLinks<L>) -> Result<(), ProcLinks<L>> {
        let Some(tx) = &self.tx else {
            return Err(links);
        };
        *self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(tgid)
            .or_default() += 1;
        tx.send((tgid, links)).map_err(|e| {
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            p.remove(&tgid);
            (e.0).1
        })
    }

    fn pending(&self, tgid: u32) -> bool {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&tgid)
    }

    /// Waits until every queued job has run; the thread ends.
    fn finish(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The libssl hooks of every watched process: status and uprobe links per tgid. Holds
/// entries only for the processes [`TlsHooks::sync`] was last given (plus those handled by
/// [`TlsHooks::handle`] since), so it never grows with the processes seen.
pub struct TlsHooks<L: HookLink> {
    enabled: bool,
    /// Why nothing can be attached although the programs are loaded (the front end lacks a
    /// capability, [`TlsHooks::set_unavailable`]).
    unavailable: Option<String>,
    procs: BTreeMap<u32, Proc<L>>,
    /// [`TlsHooks::with_detacher`]: links of processes that went are released there.
    detacher: Option<Detacher<L>>,
    /// [`TlsHooks::adopt_pins`]: new links are pinned ([`Host::pin`]).
    pin: bool,
    /// Pinned links of an earlier daemon not adopted yet, by (pid, start time) and library.
    adoptable: BTreeMap<(u32, u64), BTreeMap<LibKey, PinnedLib<L>>>,
    /// The next [`TlsHooks::sync`] releases what is left in `adoptable`.
    release_unadopted: bool,
}

impl<L: HookLink> TlsHooks<L> {
    /// No process yet. `enabled: false` (`--no-tls-hooks`): nothing is ever attached and
    /// every process is [`TlsAttach::Disabled`]. Links are released in the calling thread
    /// until [`TlsHooks::with_detacher`].
    pub fn new(enabled: bool) -> Self {
        TlsHooks {
            enabled,
            unavailable: None,
            procs: BTreeMap::new(),
            detacher: None,
            pin: false,
            adoptable: BTreeMap::new(),
            release_unadopted: false,
        }
    }

    /// Releases the links of processes that went or are no longer watched on one
    /// background thread, in order (a process's entries, then its uretprobes), instead of
    /// in the calling thread. A thread that cannot be started leaves the release inline.
    pub fn with_detacher(mut self) -> Self {
        match Detacher::start() {
            Ok(d) => self.detacher = Some(d),
            Err(e) => log::warn!("libssl hooks: no detacher thread ({e}): releasing inline"),
        }
        self
    }

    /// The daemon's mode: every link attached from now on is pinned ([`Host::pin`],
    /// [`PinName`]), and the pinned links an earlier daemon left are taken in: the next
    /// [`TlsHooks::handle`] of each of their processes, still alive with the same start
    /// time and mapping the same libraries, adopts them (no re-attachment, no gap); the
    /// first [`TlsHooks::sync`] after this releases the rest (processes gone or not watched
    /// any more). With the hooks disabled, every pinned link is released. Returns how many
    /// pinned links were found.
    pub fn adopt_pins<H: Host<Link = L>>(&mut self, host: &mut H) -> usize {
        self.pin = true;
        let mut n = 0;
        for name in host.pinned_links() {
            let Some(p) = PinName::parse(&name) else {
                continue;
            };
            n += 1;
            let link = host.open_pin(&name);
            let lib = self
                .adoptable
                .entry((p.pid, p.start_time))
                .or_default()
                .entry(p.lib())
                .or_insert_with(|| PinnedLib {
                    want: p.links,
                    links: ProcLinks::default(),
                });
            if lib.want != p.links {
                // Two sets of names for one library: never complete.
                lib.want = 0;
            }
            lib.links.push(p.ret(), link);
        }
        if !self.enabled {
            let all = std::mem::take(&mut self.adoptable);
            for ((pid, _), libs) in all {
                for (_, l) in libs {
                    self.discard(pid, l.links, false);
                }
            }
        }
        self.release_unadopted = true;
        n
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

    /// Ends `links` of `tgid`: on the detacher thread, or here when `now` (the process is
    /// about to be hooked again: its old hooks must be gone first, or every call would run
    /// the programs twice) or without one.
    fn discard(&mut self, tgid: u32, links: ProcLinks<L>, now: bool) {
        if links.is_empty() {
            return;
        }
        let links = match (&self.detacher, now) {
            (Some(d), false) => match d.send(tgid, links) {
                Ok(()) => return,
                Err(l) => l,
            },
            _ => links,
        };
        links.release();
    }

    /// Ends every link now, in order (each process's entries, then its uretprobes): queued
    /// ones first (the detacher finishes), then the rest here; pinned links lose their pins.
    /// For a front end's exit when its links must not outlive it (`observe`; the daemon's
    /// pinned links stay). Returns how many links were released here and how long the whole
    /// took.
    pub fn release_all(&mut self) -> (usize, Duration) {
        let t0 = Instant::now();
        if let Some(d) = self.detacher.as_mut() {
            d.finish();
        }
        self.detacher = None;
        let mut n = 0;
        for (_, p) in std::mem::take(&mut self.procs) {
            n += p.links.release();
        }
        (n, t0.elapsed())
    }

    /// Waits for the detacher thread to finish what it was given (tests; a front end's
    /// exit), which ends it: later releases run in the calling thread.
    pub fn flush(&mut self) {
        if let Some(d) = self.detacher.as_mut() {
            d.finish();
        }
        self.detacher = None;
    }

    /// Looks at process `tgid` now and attaches the hooks to the libssl it maps (call it
    /// before the process is added to `WATCHED_TGIDS`, so that its sockets' first calls
    /// already run inside hooked functions), or adopts the pinned links an earlier daemon
    /// left for it ([`TlsHooks::adopt_pins`]). An existing entry of `tgid` is replaced: its
    /// links are released first (here when it is the same process, on the detacher thread
    /// when the pid now belongs to another). Returns the new status, `None` when the process
    /// is gone.
    pub fn handle<H: Host<Link = L>>(
        &mut self,
        host: &mut H,
        tgid: u32,
        now: Instant,
    ) -> Option<TlsAttach> {
        let start = host.start_time(tgid);
        if let Some(old) = self.procs.remove(&tgid) {
            // Detach first: a re-attachment must never run the programs twice per call.
            let same = start.is_some() && start == old.start_time;
            self.discard(tgid, old.links, same);
        }
        // Pins of an earlier daemon for this pid: those of another start time were another
        // process's.
        let keys: Vec<(u32, u64)> = self
            .adoptable
            .range((tgid, 0)..=(tgid, u64::MAX))
            .map(|(k, _)| *k)
            .collect();
        let mut pinned = None;
        for k in keys {
            let libs = self.adoptable.remove(&k).unwrap_or_default();
            if Some(k.1) == start {
                pinned = Some(libs);
            } else {
                for (_, l) in libs {
                    self.discard(tgid, l.links, false);
                }
            }
        }
        let (status, links) = if !self.enabled {
            (TlsAttach::Disabled, ProcLinks::default())
        } else {
            match host.libssl(tgid) {
                Err(ProcError::Gone) => {
                    for (_, l) in pinned.unwrap_or_default() {
                        self.discard(tgid, l.links, false);
                    }
                    return None;
                }
                Err(ProcError::Unreadable(e)) => (
                    TlsAttach::Failed {
                        library: format!("/proc/{tgid}/maps"),
                        error: e,
                    },
                    ProcLinks::default(),
                ),
                Ok(libs) => {
                    let adopted = pinned.take().and_then(|p| {
                        let shape: Vec<(LibKey, usize, usize)> =
                            p.iter().map(|(k, l)| (*k, l.want, l.links.len())).collect();
                        if can_adopt(&shape, &libs) {
                            let mut all = ProcLinks::default();
                            for (_, l) in p {
                                all.append(l.links);
                            }
                            debug!(
                                "pid {tgid}: adopted {} pinned libssl hook link(s)",
                                all.len()
                            );
                            Some(all)
                        } else {
                            // Cut short, or the libraries changed: released before anything
                            // is attached again (never twice per call).
                            debug!("pid {tgid}: pinned libssl hooks {shape:?} not adoptable");
                            for (_, l) in p {
                                self.discard(tgid, l.links, true);
                            }
                            None
                        }
                    });
                    match adopted {
                        Some(links) => (
                            TlsAttach::Attached {
                                library: libs
                                    .iter()
                                    .map(MappedLibrary::label)
                                    .collect::<Vec<_>>()
                                    .join(", "),
                            },
                            links,
                        ),
                        None if libs.is_empty() => (TlsAttach::NoLibrary, ProcLinks::default()),
                        None => match host.unavailable().or_else(|| self.unavailable.clone()) {
                            Some(why) => (
                                TlsAttach::Failed {
                                    library: libs[0].label(),
                                    error: why,
                                },
                                ProcLinks::default(),
                            ),
                            None => {
                                let pin = if self.pin { start } else { None };
                                attach_all(host, tgid, pin, &libs)
                            }
                        },
                    }
                }
            }
        };
        for (_, l) in pinned.unwrap_or_default() {
            self.discard(tgid, l.links, false);
        }
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
    /// belongs to another process (start time changed) are detached (on the detacher
    /// thread) and dropped; watched ones without an entry are handled ([`TlsHooks::handle`];
    /// one whose old links are still being released waits for the next sync); those
    /// without a libssl are looked at again every [`RECHECK`]. The first sync after
    /// [`TlsHooks::adopt_pins`] releases the pinned links no process adopted. Returns what
    /// changed.
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
            if let Some(p) = self.procs.remove(&tgid) {
                self.discard(tgid, p.links, false);
            }
            changes.push(Change { tgid, status: None });
        }
        for &tgid in &want {
            let redo = match self.procs.get(&tgid) {
                None => !self.detacher.as_ref().is_some_and(|d| d.pending(tgid)),
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
        if std::mem::take(&mut self.release_unadopted) {
            let left = std::mem::take(&mut self.adoptable);
            let n: usize = left
                .values()
                .flat_map(|libs| libs.values())
                .map(|l| l.links.len())
                .sum();
            if n > 0 {
                debug!(
                    "releasing {n} pinned libssl hook link(s) of {} process(es) gone or not watched",
                    left.len()
                );
            }
            for ((pid, _), libs) in left {
                for (_, l) in libs {
                    self.discard(pid, l.links, false);
                }
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

impl TlsHooks<TlsLink> {
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
/// failure. With `pin` (the process's start time), each link is pinned ([`Host::pin`],
/// [`PinName`]); one that cannot be pinned stays this process's own.
fn attach_all<H: Host>(
    host: &mut H,
    pid: u32,
    pin: Option<u64>,
    libs: &[MappedLibrary],
) -> (TlsAttach, ProcLinks<H::Link>) {
    let mut links = ProcLinks::default();
    let mut attached: Vec<String> = Vec::new();
    let mut failed: Option<TlsAttach> = None;
    let mut pin_failed = false;
    for lib in libs {
        let result = attach_library(host, pid, lib).and_then(|l| match pin {
            None => {
                let mut own = ProcLinks::default();
                for (program, _, link) in l {
                    own.push(program == RET_PROGRAM, link);
                }
                Ok(own)
            }
            Some(start_time) => pin_library(host, pid, start_time, lib, l, &mut pin_failed),
        });
        match result {
            Ok(l) => {
                links.append(l);
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
        return (f, links);
    }
    (
        TlsAttach::Attached {
            library: attached.join(", "),
        },
        links,
    )
}

/// Pins the links `l` of one library ([`PinName`]). A link the host cannot pin but gives
/// back stays this process's own (warned once per process, `warned`); one lost in the
/// attempt fails the library (its other links are released, entries first).
fn pin_library<H: Host>(
    host: &mut H,
    pid: u32,
    start_time: u64,
    lib: &MappedLibrary,
    l: Vec<Attached<H::Link>>,
    warned: &mut bool,
) -> Result<ProcLinks<H::Link>, String> {
    let n = l.len();
    let mut out = ProcLinks::default();
    let mut lost = None;
    for (program, function, link) in l {
        let ret = program == RET_PROGRAM;
        if lost.is_some() {
            out.push(ret, link);
            continue;
        }
        let name = PinName {
            pid,
            start_time,
            dev: lib.dev,
            inode: lib.inode,
            links: n,
            program,
            function,
        };
        match host.pin(link, &name.to_string()) {
            Ok(link) => out.push(ret, link),
            Err((Some(link), e)) => {
                if !std::mem::replace(warned, true) {
                    log::warn!(
                        "pid {pid}: libssl hook link {name} not pinned ({e}): this process's \
                         hooks end with this daemon"
                    );
                }
                out.push(ret, link);
            }
            Err((None, e)) => lost = Some(format!("{name}: {e}")),
        }
    }
    match lost {
        None => Ok(out),
        Some(e) => {
            out.release();
            Err(e)
        }
    }
}

/// One attached (program, function) pair.
type Attached<L> = (&'static str, &'static str, L);

/// Attaches the hooks of every function of [`FUNCTIONS`] the library has: for each, the
/// uretprobe first and then the entry program, so that every entry that saves a call has
/// a return that takes it. A function the library lacks is skipped, unless it is
/// [`REQUIRED`]; any other failure fails the library. On failure every link made is
/// released (entries first) and the error says which function and program failed.
fn attach_library<H: Host>(
    host: &mut H,
    pid: u32,
    lib: &MappedLibrary,
) -> Result<Vec<Attached<H::Link>>, String> {
    let target = lib.attach_path(pid);
    let t0 = Instant::now();
    let mut links: Vec<Attached<H::Link>> = Vec::new();
    let mut missing = Vec::new();
    let fail = |links: Vec<Attached<H::Link>>, e: String| {
        let mut l = ProcLinks::default();
        for (p, _, link) in links {
            l.push(p == RET_PROGRAM, link);
        }
        l.release();
        Err(e)
    };
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
                return fail(
                    links,
                    format!("{f} not found in {} ({e})", target.display()),
                );
            }
            Err(AttachError::Failed(e)) => {
                return fail(links, format!("attaching {RET_PROGRAM} to {f}: {e}"));
            }
        };
        links.push((RET_PROGRAM, f, ret));
        let e = match host.attach(entry, f, &target, pid) {
            Ok(l) => l,
            Err(AttachError::MissingSymbol(e) | AttachError::Failed(e)) => {
                return fail(links, format!("attaching {entry} to {f}: {e}"));
            }
        };
        links.push((entry, f, e));
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

    type Key = (u32, String, String);

    /// What the fake kernel holds: live attachments, the order they were detached in, and
    /// the pin directory (name -> attachment).
    #[derive(Default)]
    struct Kernel {
        live: Vec<Key>,
        detached: Vec<Key>,
        pins: BTreeMap<String, Key>,
    }

    /// A fake system: processes (start time, libraries), symbols per library path, attach
    /// and pin results, and the fake kernel (a link detaches itself when dropped, unless
    /// pinned; a pinned one only on release).
    #[derive(Default)]
    struct Fake {
        procs: BTreeMap<u32, (u64, Vec<MappedLibrary>)>,
        /// Symbols each attach target lacks.
        lacks: Vec<&'static str>,
        /// (program, symbol) pairs whose attach fails.
        refuse: Vec<(&'static str, &'static str)>,
        kernel: Arc<Mutex<Kernel>>,
        attaches: usize,
        unavailable: Option<String>,
        /// Pinning gives the link back unpinned / loses it.
        pin_refuse: bool,
        pin_lose: bool,
    }

    struct FakeLink {
        key: Key,
        pinned: Option<String>,
        done: bool,
        kernel: Arc<Mutex<Kernel>>,
    }

    impl FakeLink {
        fn detach(&mut self) {
            if std::mem::replace(&mut self.done, true) {
                return;
            }
            let mut k = self.kernel.lock().unwrap();
            let i = k.live.iter().position(|x| *x == self.key).unwrap();
            let key = k.live.remove(i);
            k.detached.push(key);
        }
    }

    impl HookLink for FakeLink {
        fn release(mut self) {
            if let Some(n) = self.pinned.take() {
                self.kernel.lock().unwrap().pins.remove(&n);
            }
            self.detach();
        }
    }

    impl Drop for FakeLink {
        fn drop(&mut self) {
            if self.pinned.is_none() {
                self.detach();
            }
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
            self.kernel.lock().unwrap().live.push(key.clone());
            Ok(FakeLink {
                key,
                pinned: None,
                done: false,
                kernel: self.kernel.clone(),
            })
        }
        fn unavailable(&self) -> Option<String> {
            self.unavailable.clone()
        }
        fn pin(
            &mut self,
            mut link: FakeLink,
            name: &str,
        ) -> Result<FakeLink, (Option<FakeLink>, String)> {
            if self.pin_refuse {
                return Err((Some(link), "no bpf_link".into()));
            }
            if self.pin_lose {
                drop(link);
                return Err((None, "EEXIST".into()));
            }
            let mut k = self.kernel.lock().unwrap();
            assert!(!k.pins.contains_key(name), "{name} pinned twice");
            k.pins.insert(name.to_string(), link.key.clone());
            link.pinned = Some(name.to_string());
            Ok(link)
        }
        fn pinned_links(&self) -> Vec<String> {
            self.kernel.lock().unwrap().pins.keys().cloned().collect()
        }
        fn open_pin(&mut self, name: &str) -> FakeLink {
            let key = self.kernel.lock().unwrap().pins[name].clone();
            FakeLink {
                key,
                pinned: Some(name.to_string()),
                done: false,
                kernel: self.kernel.clone(),
            }
        }
    }

    impl Fake {
        fn live(&self) -> usize {
            self.kernel.lock().unwrap().live.len()
        }
        fn pins_of(&self, pid: u32) -> usize {
            let k = self.kernel.lock().unwrap();
            k.pins.values().filter(|x| x.0 == pid).count()
        }
        /// Detached links of `pid`, in order.
        fn detached_of(&self, pid: u32) -> Vec<Key> {
            let k = self.kernel.lock().unwrap();
            k.detached.iter().filter(|x| x.0 == pid).cloned().collect()
        }
    }

    /// Every entry program of `pid` was detached before any of its uretprobes.
    fn entries_first(f: &Fake, pid: u32) {
        let d = f.detached_of(pid);
        assert!(!d.is_empty());
        let first_ret = d.iter().position(|k| k.1 == RET_PROGRAM).unwrap();
        assert!(
            d[first_ret..].iter().all(|k| k.1 == RET_PROGRAM),
            "detach order of pid {pid}: {d:?}"
        );
    }

    fn lib3() -> MappedLibrary {
        libssl_in(&maps(MAPS)).remove(0)
    }

    fn live_of(f: &Fake, pid: u32) -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = f
            .kernel
            .lock()
            .unwrap()
            .live
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
        assert_eq!(f.live(), 0);
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

    /// Pin names: every (program, function) pair round-trips; anything else is refused
    /// (other prefixes, leading zeros, signs, a function of another program, missing or
    /// extra fields).
    #[test]
    fn pin_names() {
        let lib = lib3();
        for p in PROGRAMS {
            for f in p.symbols {
                let n = PinName {
                    pid: 4242,
                    start_time: 981234,
                    dev: lib.dev,
                    inode: lib.inode,
                    links: 16,
                    program: p.name,
                    function: f,
                };
                let s = n.to_string();
                assert!(!s.contains('.') && !s.contains('/'), "bpffs refuses {s}");
                assert_eq!(PinName::parse(&s), Some(n.clone()), "{s}");
                assert_eq!(n.ret(), p.ret);
                assert_eq!(n.lib(), (254, 1, 1836263));
            }
        }
        let ok = "tls_4242_981234_254-1-1836263_16_spice_ssl_ret_SSL_write";
        let n = PinName::parse(ok).unwrap();
        assert_eq!((n.pid, n.start_time, n.links), (4242, 981234, 16));
        assert_eq!((n.program, n.function), (RET_PROGRAM, "SSL_write"));
        for bad in [
            "link_spice_ssl_ret",
            "tls_",
            "tls_4242_981234_254-1-1836263_16_spice_ssl_ret",
            "tls_04242_981234_254-1-1836263_16_spice_ssl_ret_SSL_write",
            "tls_+4242_981234_254-1-1836263_16_spice_ssl_ret_SSL_write",
            "tls_4242_981234_254-1_16_spice_ssl_ret_SSL_write",
            "tls_4242_981234_254-1-1836263-7_16_spice_ssl_ret_SSL_write",
            "tls_4242_981234_254-1-1836263_x_spice_ssl_ret_SSL_write",
            "tls_4242_981234_254-1-1836263_16_spice_ssl_write_SSL_read",
            "tls_4242_981234_254-1-1836263_16_spice_ssl_ret_SSL_other",
            "tls_4242_981234_254-1-1836263_16_spice_ssl_ret_SSL_write_",
            "tls_4242_981234_254-1-1836263_16_other_SSL_write",
            "TLS_4242_981234_254-1-1836263_16_spice_ssl_ret_SSL_write",
        ] {
            assert_eq!(PinName::parse(bad), None, "{bad}");
        }
    }

    /// Adoption: exactly the libraries mapped now, each with the links its pins recorded.
    #[test]
    fn adoption_decisions() {
        let libs = libssl_in(&maps(MAPS));
        let k0 = (254, 1, 1836263);
        let k1 = (254, 1, 2000001);
        assert!(can_adopt(&[(k0, 16, 16)], &libs[..1]));
        assert!(
            can_adopt(&[(k0, 10, 10)], &libs[..1]),
            "an OpenSSL without _ex"
        );
        assert!(can_adopt(&[(k0, 16, 16), (k1, 16, 16)], &libs));
        // Cut short (an agent killed while attaching or pinning).
        assert!(!can_adopt(&[(k0, 16, 15)], &libs[..1]));
        assert!(!can_adopt(&[(k0, 0, 0)], &libs[..1]));
        // A library mapped now without pins, or pins of one no longer mapped.
        assert!(!can_adopt(&[(k0, 16, 16)], &libs));
        assert!(!can_adopt(&[(k0, 16, 16), (k1, 16, 16)], &libs[..1]));
        assert!(!can_adopt(&[(k1, 16, 16)], &libs[..1]));
        assert!(!can_adopt(&[], &libs[..1]));
        assert!(!can_adopt(&[(k0, 16, 16)], &[]));
    }

    /// A process's links end entries first, uretprobes last: when dropped, when released,
    /// and when the detacher releases those of a process that went.
    #[test]
    fn entries_detach_before_returns() {
        let mut f = Fake::default();
        for pid in [10, 11, 12] {
            f.procs.insert(pid, (1, vec![lib3()]));
        }
        let mut h = TlsHooks::new(true);
        let t = Instant::now();
        h.handle(&mut f, 10, t);
        h.handle(&mut f, 11, t);
        h.handle(&mut f, 12, t);
        // Replaced while it is the same process: released here, before the new attach.
        h.handle(&mut f, 10, t);
        assert_eq!(f.detached_of(10).len(), 16);
        entries_first(&f, 10);
        drop(h);
        entries_first(&f, 11);
        entries_first(&f, 12);
        assert_eq!(f.live(), 0);

        let mut f = Fake::default();
        f.procs.insert(20, (1, vec![lib3()]));
        f.procs.insert(21, (1, vec![lib3()]));
        let mut h = TlsHooks::new(true).with_detacher();
        assert_eq!(h.sync(&mut f, &[20, 21], t).len(), 2);
        assert_eq!(f.live(), 32);
        f.procs.remove(&20);
        let c = h.sync(&mut f, &[21], t);
        assert_eq!(
            c,
            [Change {
                tgid: 20,
                status: None
            }]
        );
        h.flush();
        assert!(live_of(&f, 20).is_empty());
        entries_first(&f, 20);
        let (n, _) = h.release_all();
        assert_eq!(n, 16);
        entries_first(&f, 21);
        assert_eq!(f.live(), 0);
    }

    /// The daemon's pins: its exit releases nothing; the next daemon adopts the links of a
    /// process still watched (no attach), re-attaches a pid that is another process now,
    /// attaches a new one, and releases the pins of a process gone or no longer watched.
    #[test]
    fn restart_adopts_pinned_links() {
        let mut f = Fake::default();
        for pid in [10, 11, 12] {
            f.procs.insert(pid, (1, vec![lib3()]));
        }
        let t = Instant::now();
        let mut h = TlsHooks::new(true).with_detacher();
        assert_eq!(h.adopt_pins(&mut f), 0);
        h.sync(&mut f, &[10, 11, 12], t);
        assert_eq!((f.live(), f.pins_of(10), f.pins_of(11)), (48, 16, 16));
        // SIGTERM: nothing released, the hooks keep running.
        drop(h);
        assert_eq!(f.live(), 48);
        assert!(f.detached_of(10).is_empty());

        // Meanwhile: 11 exits, pid 12 is another process, 13 starts.
        f.procs.remove(&11);
        f.procs.insert(12, (2, vec![lib3()]));
        f.procs.insert(13, (1, vec![lib3()]));
        let n0 = f.attaches;
        let mut h = TlsHooks::new(true).with_detacher();
        assert_eq!(h.adopt_pins(&mut f), 48);
        let s = h.handle(&mut f, 10, t).unwrap();
        assert!(matches!(s, TlsAttach::Attached { .. }), "{s:?}");
        assert_eq!(f.attaches, n0, "adopted without attaching");
        assert_eq!(h.links(), 16);
        let c = h.sync(&mut f, &[10, 12, 13], t);
        assert_eq!(c.len(), 2, "{c:?}");
        h.flush();
        assert!(f.detached_of(10).is_empty(), "adopted links kept");
        assert_eq!(f.pins_of(10), 16);
        assert!(live_of(&f, 11).is_empty());
        assert_eq!(f.pins_of(11), 0);
        entries_first(&f, 11);
        // Pid 12: the old process's 16 released, the new one's 16 attached and pinned.
        assert_eq!(f.detached_of(12).len(), 16);
        assert_eq!((live_of(&f, 12).len(), f.pins_of(12)), (16, 16));
        assert_eq!(f.pins_of(13), 16);
        assert_eq!(f.attaches, n0 + 32);

        // Another restart after 13 is unwatched: its pins go at the first sync.
        drop(h);
        let mut h = TlsHooks::new(true).with_detacher();
        assert_eq!(h.adopt_pins(&mut f), 48);
        h.sync(&mut f, &[10, 12], t);
        h.flush();
        assert_eq!((live_of(&f, 13).len(), f.pins_of(13)), (0, 0));
        assert_eq!(f.live(), 32);
        // release_all (an observe's exit; `daemon --unpin` does the same on the pins).
        h.release_all();
        assert_eq!((f.live(), f.kernel.lock().unwrap().pins.len()), (0, 0));
        entries_first(&f, 10);
    }

    /// A pinned set cut short is released before the process is hooked again; with the
    /// hooks disabled every pin is released; a link lost while pinning fails the library.
    #[test]
    fn partial_and_disabled_pins() {
        let mut f = Fake::default();
        f.procs.insert(10, (1, vec![lib3()]));
        let t = Instant::now();
        let mut h = TlsHooks::new(true);
        h.adopt_pins(&mut f);
        h.handle(&mut f, 10, t);
        drop(h);
        // Killed while pinning: one pin short.
        let name = f.pinned_links().pop().unwrap();
        f.open_pin(&name).release();
        let n0 = f.attaches;
        let mut h = TlsHooks::new(true);
        assert_eq!(h.adopt_pins(&mut f), 15);
        assert!(matches!(
            h.handle(&mut f, 10, t),
            Some(TlsAttach::Attached { .. })
        ));
        assert_eq!(f.attaches, n0 + 16);
        assert_eq!((live_of(&f, 10).len(), f.pins_of(10)), (16, 16));
        drop(h);

        let mut h: TlsHooks<FakeLink> = TlsHooks::new(false);
        assert_eq!(h.adopt_pins(&mut f), 16);
        assert_eq!(h.handle(&mut f, 10, t), Some(TlsAttach::Disabled));
        assert_eq!((f.live(), f.pins_of(10)), (0, 0));

        // Pinning refused (link given back): attached, own links.
        f.pin_refuse = true;
        let mut h = TlsHooks::new(true);
        h.adopt_pins(&mut f);
        assert!(matches!(
            h.handle(&mut f, 10, t),
            Some(TlsAttach::Attached { .. })
        ));
        assert_eq!((f.live(), f.pins_of(10)), (16, 0));
        drop(h);
        assert_eq!(f.live(), 0);
        // A link lost while pinning: the library fails, nothing stays.
        f.pin_refuse = false;
        f.pin_lose = true;
        let mut h = TlsHooks::new(true);
        h.adopt_pins(&mut f);
        let s = h.handle(&mut f, 10, t).unwrap();
        assert!(
            matches!(&s, TlsAttach::Failed { error, .. } if error.contains("EEXIST")),
            "{s:?}"
        );
        assert_eq!((f.live(), f.pins_of(10)), (0, 0));
    }
}
