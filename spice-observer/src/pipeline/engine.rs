//! [`Engine`]: one observation's state, from the kernel ring to the report.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    io::Write,
    path::{Path, PathBuf},
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, Result, bail};
use aya::maps::{MapData, RingBuf};
use log::{debug, warn};
use spice_ebpf_common::{
    config::{counter, preexisting, watch},
    framing::UnparsedReason,
    protocol::channel,
};
use tokio::io::{Interest, unix::AsyncFd};

use super::monotonic_ns;
use crate::{
    events,
    loader::{self, Capture},
    model::{Model, chain::Chain},
    report::{self, ClockReport, PidReport, Report, SourceReport, TcpReport},
    sampler,
    samples::SampleLine,
    sockdiag,
};

/// How an [`Engine`] runs.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Interval between TCP samples (the front end drives the timer; kept for reports).
    pub sample: Duration,
    /// Keep closed sockets until the end (observe: true, for the final report) or free them
    /// once a snapshot has included them (daemon: false; see [`Engine::release_reported`]).
    pub retain_closed: bool,
    /// Turn on kernel BPF run-time statistics (BPF_ENABLE_STATS fd held for the engine's life).
    pub bpf_stats: bool,
    /// The hook set to load ([`loader::choose_hook_set`]); a pinned set of another one is
    /// not continued but reloaded. Ignored beside a daemon ([`Engine::start_beside`]),
    /// which reads the daemon's set.
    pub hook_set: loader::HookChoice,
}

/// What watching a process found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Watched {
    /// The process (tgid) watched: a thread id given resolves to its process.
    pub pid: u32,
    pub comm: String,
    /// Listening ports of the process and its children enrolled for sockops.
    pub ports_enrolled: usize,
    /// Connections already open (reported with their TCP state, never framed).
    pub existing_connections: usize,
}

/// One program's kernel run-time statistics (bpf_prog_info run_time_ns / run_cnt).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgramStats {
    /// Program name in the object (`spice_sock_send`, `spice_sock_recv`, …).
    pub name: String,
    /// Nanoseconds the program ran, cumulative since it was loaded (0 while stats are off).
    pub run_time_ns: u64,
    /// Times it ran (0 while stats are off).
    pub run_count: u64,
}

/// Sizes of the engine's state, for self-metrics and the boundedness test.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Sockets in the model (open, and closed ones not released yet).
    pub sockets: usize,
    pub chains: usize,
    /// Process notes kept (at most [`crate::model::PROCESS_NOTES`]).
    pub processes: usize,
    /// Ring records decoded, and those that could not be.
    pub records: u64,
    pub decode_errors: u64,
}

/// A one-line view of the engine for a live progress display.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Sockets in the model, and those framed (`mini` or `full`).
    pub sockets: usize,
    pub framed: usize,
    /// Messages counted, both directions of every socket.
    pub messages: u64,
    /// spice-server's open display channels: (in-flight count, 2W+1).
    pub display_in_flight: Vec<(u32, u32)>,
    /// Kernel loss counters summed.
    pub lost: u64,
}

/// How an engine started on a pin directory ([`Engine::start_pinned`]) found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Restart {
    /// Not pinned ([`Engine::start`]).
    Unpinned,
    /// Nothing was pinned: the programs were loaded and pinned.
    Fresh,
    /// A complete set of this layout was pinned: reused without loading anything; `sockets`
    /// entries of the kernel's socket map were taken over, counts continuing exactly.
    Continued { sockets: usize },
    /// Something else was pinned (`why`: another layout, or a partial set): removed (which
    /// detached the old programs), loaded and pinned afresh. Connections the old set was
    /// counting are reported `restarted`.
    Reloaded { why: String },
}

/// Which already-open connections [`Engine::watch`] reports `restarted` rather than
/// `attached_mid_stream`: those of processes the replaced pinned set watched.
#[derive(Clone, Debug)]
enum PriorWatch {
    /// No earlier set was replaced.
    None,
    /// The replaced set's `WATCHED_TGIDS` keys.
    Tgids(HashSet<u32>),
    /// The replaced set's watched processes could not be read: every connection open at a
    /// watch is taken to be one it counted.
    Unknown,
}

/// One watch: the process given and the tgids watched for it at the start.
#[derive(Clone, Debug)]
struct Root {
    watched: Watched,
    tgids: Vec<u32>,
}

/// One observation: the loaded kernel programs, the event ring, the model of every watched
/// socket, the relay chains and the accumulated samples. Must be created inside a Tokio
/// runtime (the ring is registered with its reactor).
pub struct Engine {
    opts: EngineOptions,
    cap: Capture,
    ring: AsyncFd<RingBuf<MapData>>,
    model: Model,
    chains: Vec<Chain>,
    /// The samples' sock_diag socket.
    sampler: sampler::Sampler,
    decode_errors: u64,
    dump: Option<std::io::BufWriter<std::fs::File>>,
    started_ns: u64,
    clock: ClockReport,
    roots: Vec<Root>,
    /// Unwatched tgids and when (CLOCK_MONOTONIC ns): their sockets are released once a later
    /// snapshot included them.
    unwatched: Vec<(u64, Vec<u32>)>,
    /// `now_ns` of the newest snapshot (0: none yet).
    last_snapshot_ns: AtomicU64,
    /// Closed sockets the newest snapshot included.
    reported_closed: Mutex<Vec<u64>>,
    _stats_fd: Option<std::os::fd::OwnedFd>,
    restart: Restart,
    prior: PriorWatch,
    /// The pin directory's lock, held for the engine's life ([`Engine::start_pinned`]).
    _pin_lock: Option<loader::PinLock>,
    /// The pin directory used ([`Engine::start_pinned`], [`Engine::start_beside`]).
    pin_dir: Option<PathBuf>,
    /// Set when the engine reads the daemon's pinned set beside it ([`Engine::start_beside`]).
    tap: Option<Tap>,
    /// What the start-up self-test found when it passed ([`Engine::self_test`]).
    self_test: Option<super::selftest::SelfTestReport>,
    /// The kernel counters' growth over the self-test, taken out of every snapshot's
    /// (zeros when something else was watched meanwhile: a continued pinned set).
    self_test_counters: [u64; counter::COUNT as usize],
}

/// What an engine reading the daemon's pinned set ([`Engine::start_beside`]) holds and must
/// undo at its end ([`Engine::untap`], also run on drop).
struct Tap {
    /// The exclusive lock of the one `TAP_EVENTS` consumer ([`tap_lock_path`]).
    _lock: std::fs::File,
    /// The kernel counters at the start: the report gives what happened since.
    counters_at_start: [u64; counter::COUNT as usize],
    /// Ports this engine added to `WATCH_PORTS` and cookies it added to `PREEXISTING`.
    ports_added: Vec<u16>,
    preexisting_added: Vec<u64>,
    /// Stale `TAP_EVENTS` records discarded at the start.
    discarded: u64,
    /// `untap` ran.
    released: bool,
}

/// What [`Engine::start_beside`] found in the pin directory.
pub enum Beside {
    /// A complete pinned set of this layout: the engine reads it (no program loaded).
    Tapped(Box<Engine>),
    /// Nothing pinned there.
    Absent,
    /// Something that cannot be read (another layout, a partial set): the text says why.
    Unusable(String),
}

/// The lock file of the one `TAP_EVENTS` consumer of pin directory `dir`:
/// `/run/spice-observer-tap.<dir with every byte but [A-Za-z0-9] as _>.lock`. (bpffs refuses
/// `open(2)` on a pinned ring, so the lock cannot live in the pin directory; the directory's
/// own lock is the daemon's.)
pub fn tap_lock_path(dir: &Path) -> PathBuf {
    let name: String = dir
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    PathBuf::from(format!("/run/spice-observer-tap.{name}.lock"))
}

/// Takes the exclusive lock of the one `TAP_EVENTS` consumer of `dir` ([`tap_lock_path`],
/// `flock(2)`, released when the process dies). Errors when another process holds it
/// (another `observe` beside the same daemon), naming the directory.
fn lock_tap(dir: &Path) -> Result<std::fs::File> {
    use std::os::{fd::AsRawFd as _, unix::fs::OpenOptionsExt as _};
    let path = tap_lock_path(dir);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            bail!(
                "another spice-observer observe is already reading the daemon's pinned state at \
                 {} (it holds {}): only one observe at a time can run beside the daemon; wait \
                 for it to end",
                dir.display(),
                path.display()
            );
        }
        return Err(e).with_context(|| format!("locking {}", path.display()));
    }
    Ok(f)
}

/// For a daemon continuing pins: clears the [`watch::TAP`] flags an observe beside an
/// earlier daemon left when it was killed, if no observe runs now (the daemon takes the tap
/// lock for the moment it clears them, so that it never clears a live observe's flags).
/// Otherwise the processes' records would go on filling `TAP_EVENTS` for nobody until the next
/// observe. Failures are logged: they cost only that.
fn clear_stale_tap(cap: &mut Capture, dir: &Path) {
    let lock = match lock_tap(dir) {
        Ok(l) => l,
        Err(e) => {
            debug!("TAP flags left alone: {e:#}");
            return;
        }
    };
    match clear_tap_flags(cap) {
        Ok(0) => {}
        Ok(n) => warn!("cleared {n} TAP flag(s) left by an observe that did not end cleanly"),
        Err(e) => warn!("clearing stale TAP flags: {e:#}"),
    }
    drop(lock);
}

/// Clears every [`watch::TAP`] flag of `WATCHED_TGIDS`: an entry that also has
/// [`watch::PRIMARY`] (the daemon's) keeps it, one with `TAP` only (an observe's) is removed.
/// Then drops the kernel state of sockets created for an observe only (no
/// [`watch::ROUTE_PRIMARY`] in `SockState::watch`) whose process the daemon does not watch.
fn clear_tap_flags(cap: &mut Capture) -> Result<usize> {
    let mut cleared = 0;
    for (tgid, v) in cap.watch_entries()? {
        if v & watch::TAP == 0 {
            continue;
        }
        cleared += 1;
        if v & watch::PRIMARY != 0 {
            cap.set_watch_value(tgid, v & !watch::TAP, true)?;
        } else {
            cap.remove_watch(tgid)?;
        }
    }
    for (cookie, st) in cap.sockets()? {
        if st.watch & watch::ROUTE_PRIMARY == 0 && !cap.is_watched(st.tgid) {
            cap.forget_socket(cookie)?;
        }
    }
    Ok(cleared)
}

/// Applies every record waiting in `ring` to `model` (and the dump file).
fn drain_ring(
    ring: &mut RingBuf<MapData>,
    model: &mut Model,
    decode_errors: &mut u64,
    dump: &mut Option<std::io::BufWriter<std::fs::File>>,
) {
    while let Some(item) = ring.next() {
        match events::decode(&item) {
            Ok(ev) => {
                // The self-test's records are not the observation's (Model::ignored).
                if let Some(d) = dump.as_mut()
                    && !model.ignored.contains(&ev.header().cookie)
                {
                    let _ = writeln!(d, "{ev:?}");
                }
                model.apply(&ev);
            }
            Err(e) => {
                *decode_errors += 1;
                debug!("bad record: {e}");
            }
        }
    }
}

/// The process (thread group) of `pid`: a thread id given by mistake (what `top -H` shows)
/// resolves to its process.
pub fn thread_group(pid: u32) -> Result<u32> {
    let proc = procfs::process::Process::new(pid as i32)
        .map_err(|_| anyhow::anyhow!("no process with pid {pid}"))?;
    let status = proc
        .status()
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    Ok(status.tgid as u32)
}

const TCP_LISTEN: u8 = 10;
const TCP_ESTABLISHED: u8 = 1;
const TCP_CLOSE_WAIT: u8 = 8;

/// A connection that was open before its process was watched.
struct Existing {
    cookie: u64,
    pid: u32,
    local: std::net::SocketAddr,
    remote: std::net::SocketAddr,
}

/// Enrols the processes' listening ports for sockops and marks their already-connected
/// sockets in the kernel (reported, never framed: a SPICE stream can only be framed from its
/// link phase). Must run before the processes are watched, or a busy socket's first traced call
/// would create its framing state unmarked. Sockets the model already knows are left alone.
/// Errors: a process's `/proc/PID/fd` exists but may not be read (permissions), or the
/// kernel maps refuse an update.
///
/// With `continued` (the kernel has been watching these processes since an earlier agent
/// of a pinned set), an open socket the model does not know moved no byte since that watch:
/// it is listed only if the kernel marked it pre-existing then, and never marked again (a
/// fresh connection is framed from its start).
fn prepare_sockets(
    cap: &mut Capture,
    model: &Model,
    pids: &[u32],
    continued: &[u32],
) -> Result<(usize, Vec<Existing>)> {
    let mut owner = HashMap::new();
    for &pid in pids {
        match sockdiag::socket_inodes(pid) {
            Ok(inodes) => {
                for inode in inodes {
                    owner.entry(inode).or_insert(pid);
                }
            }
            // Another user's process without the capabilities to read its /proc/PID/fd:
            // watching it would silently see none of its sockets.
            Err(e) if crate::host::privilege::is_permission_error(&e) => return Err(e),
            // The process exited meanwhile.
            Err(_) => {}
        }
    }
    let mut ports = 0;
    let mut existing = Vec::new();
    match sockdiag::dump_tcp() {
        Ok(socks) => {
            // A connection whose local port some socket listens on was accepted: the watched
            // process is its SPICE server side (or a relay's client-facing leg).
            let listening: HashSet<u16> = socks
                .iter()
                .filter(|s| s.state == TCP_LISTEN)
                .map(|s| s.local.port())
                .collect();
            let ephemeral = ephemeral_ports();
            for s in socks.iter() {
                let Some(&pid) = owner.get(&s.inode) else {
                    continue;
                };
                if s.state == TCP_LISTEN {
                    cap.watch_port(s.local.port())?;
                    ports += 1;
                } else if (s.state == TCP_ESTABLISHED || s.state == TCP_CLOSE_WAIT)
                    && !model.sockets.contains_key(&s.cookie)
                {
                    if continued.contains(&pid) {
                        if !cap.is_preexisting(s.cookie) {
                            continue;
                        }
                    } else {
                        let how = made_how(&listening, ephemeral, s.local.port(), s.remote.port());
                        cap.mark_preexisting(s.cookie, how)?;
                    }
                    existing.push(Existing {
                        cookie: s.cookie,
                        pid,
                        local: s.local,
                        remote: s.remote,
                    });
                }
            }
        }
        Err(e) => warn!(
            "sock_diag dump failed ({e:#}); sockops enrolment and pre-existing socket detection are off"
        ),
    }
    Ok((ports, existing))
}

/// The kernel's range of ports for connections that do not bind one
/// (`/proc/sys/net/ipv4/ip_local_port_range`, default 32768–60999); `None` if unreadable.
fn ephemeral_ports() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut it = text.split_whitespace().map(|x| x.parse::<u16>());
    match (it.next(), it.next()) {
        (Some(Ok(lo)), Some(Ok(hi))) => Some((lo, hi)),
        _ => None,
    }
}

/// How a connection open before observation started was made
/// ([`spice_ebpf_common::config::preexisting`]), which gives each direction's SPICE role:
/// accepted if a socket listens on its local port; connected if one listens on its remote port
/// (a connection to a local server); else by the ports alone: the side whose port is
/// ephemeral (`ephemeral`, the kernel's range for unbound connects) connected, if only one is;
/// unknown otherwise (a single-connection server that closed its listener on an ephemeral
/// port: hunting then tries both directions' message types).
fn made_how(
    listening: &HashSet<u16>,
    ephemeral: Option<(u16, u16)>,
    local: u16,
    remote: u16,
) -> u8 {
    if listening.contains(&local) {
        return preexisting::ACCEPTED;
    }
    if listening.contains(&remote) {
        return preexisting::CONNECTED;
    }
    let Some((lo, hi)) = ephemeral else {
        return preexisting::UNKNOWN;
    };
    match ((lo..=hi).contains(&local), (lo..=hi).contains(&remote)) {
        (true, false) => preexisting::CONNECTED,
        (false, true) => preexisting::ACCEPTED,
        _ => preexisting::UNKNOWN,
    }
}

/// Local and remote address of every TCP socket by cookie (sock_diag), for restored sockets;
/// empty (logged) if the dump fails.
fn socket_addresses() -> HashMap<u64, (std::net::SocketAddr, std::net::SocketAddr)> {
    match sockdiag::dump_tcp() {
        Ok(v) => v
            .into_iter()
            .map(|s| (s.cookie, (s.local, s.remote)))
            .collect(),
        Err(e) => {
            warn!(
                "sock_diag dump failed ({e:#}): restored sockets have no addresses until their next record"
            );
            HashMap::new()
        }
    }
}

/// Best TCP state per socket now: a sock_diag answer where the socket is open and still
/// exists in this network namespace (a query of every open socket whose addresses are known,
/// [`sockdiag::DiagQuery::sockets`]), else the last kernel-hook snapshot.
fn best_tcp(model: &Model) -> BTreeMap<u64, TcpReport> {
    let mut out = BTreeMap::new();
    let mut diag = HashMap::new();
    let open: Vec<(u64, std::net::SocketAddr, std::net::SocketAddr)> = model
        .sockets
        .values()
        .filter(|s| s.closed_ns.is_none())
        .filter_map(|s| Some((s.cookie, s.local?, s.remote?)))
        .collect();
    match sockdiag::DiagQuery::new().and_then(|mut q| q.sockets(&open)) {
        Ok(answers) => {
            for (&(c, _, _), a) in open.iter().zip(answers) {
                if let Some(d) = a {
                    diag.insert(c, d);
                }
            }
        }
        Err(e) => debug!("sock_diag queries failed: {e:#}"),
    }
    for s in model.sockets.values() {
        let from_hooks = s.tcp.as_ref().map(|t| {
            TcpReport::from_snapshot(
                t,
                s.notsent_max,
                if s.closed_ns.is_some() {
                    "close"
                } else {
                    "kernel_hooks"
                },
            )
        });
        let rep = match (
            s.closed_ns,
            diag.get(&s.cookie)
                .and_then(|d| d.info.as_ref().map(|i| (d, i))),
        ) {
            (None, Some((d, i))) => Some(TcpReport {
                srtt_us: i.srtt_us,
                cwnd_segments: i.snd_cwnd,
                notsent_bytes: i.notsent_bytes,
                notsent_max_bytes: s.notsent_max.max(i.notsent_bytes),
                unacked_segments: i.unacked,
                total_retrans: i.total_retrans,
                recv_queue_bytes: d.recv_queue,
                source: "sock_diag".into(),
                delivery_rate_bytes_per_s: Some(i.delivery_rate),
            }),
            _ => from_hooks,
        };
        if let Some(r) = rep {
            out.insert(s.cookie, r);
        }
    }
    out
}

impl Engine {
    /// Loads and attaches the kernel programs and registers the event ring. Errors as
    /// [`Capture::load`]; with `bpf_stats`, also when the kernel refuses `BPF_ENABLE_STATS`.
    pub fn start(opts: EngineOptions) -> Result<Engine> {
        let stats_fd = if opts.bpf_stats {
            Some(loader::enable_run_time_stats()?)
        } else {
            None
        };
        let cap = Capture::load(opts.hook_set)?;
        Self::with_capture(opts, cap, stats_fd, Restart::Unpinned, PriorWatch::None)
    }

    /// Starts on the pin directory `dir` (the daemon): continues the set pinned there if it
    /// is complete and of this agent's layout ([`Capture::open_pinned`]): nothing is loaded,
    /// the model is rebuilt from the kernel's socket map ([`Model::restore`]: sock_diag gives
    /// the addresses, /proc the comm) and the pinned ring is drained from where the old agent
    /// left it. Otherwise removes what is there ([`loader::unpin`]) and loads and pins afresh
    /// ([`Capture::load_pinned`]); connections the old set was counting are then reported
    /// `restarted` when their process is watched. [`Engine::restart`] says which happened.
    ///
    /// The engine holds the directory's [`loader::PinLock`] for its life.
    ///
    /// Errors as [`Engine::start`], when `dir` is not on a BPF filesystem, and when another
    /// process holds its lock (another daemon on the same pins).
    pub fn start_pinned(opts: EngineOptions, dir: &Path) -> Result<Engine> {
        let stats_fd = if opts.bpf_stats {
            Some(loader::enable_run_time_stats()?)
        } else {
            None
        };
        loader::prepare_pin_dir(dir)?;
        let lock = loader::PinLock::take(dir)?;
        let mut e = Self::start_on_pins(opts, dir, stats_fd)?;
        e._pin_lock = Some(lock);
        e.pin_dir = Some(dir.to_path_buf());
        Ok(e)
    }

    fn start_on_pins(
        opts: EngineOptions,
        dir: &Path,
        stats_fd: Option<std::os::fd::OwnedFd>,
    ) -> Result<Engine> {
        match Capture::open_pinned(dir, opts.hook_set)? {
            loader::Pinned::Reusable(cap) => {
                let mut cap = *cap;
                clear_stale_tap(&mut cap, dir);
                // Sockets created for an observe beside the daemon only (no PRIMARY route) were
                // never this daemon's: left out.
                let socks: Vec<(u64, spice_ebpf_common::event::SockState)> = cap
                    .sockets()?
                    .into_iter()
                    .filter(|(_, st)| st.watch & watch::ROUTE_PRIMARY != 0)
                    .collect();
                let addrs = socket_addresses();
                let now = monotonic_ns();
                let mut model = Model::default();
                for (cookie, state) in &socks {
                    let a = addrs.get(cookie);
                    model.restore(
                        &crate::model::Restored {
                            cookie: *cookie,
                            state: *state,
                            comm: sockdiag::comm(state.tgid).unwrap_or_default(),
                            local: a.map(|a| a.0),
                            remote: a.map(|a| a.1),
                            tcp: cap.tcp_state(*cookie),
                        },
                        now,
                    );
                }
                model.restored_at(now);
                let mut e = Self::with_capture(
                    opts,
                    cap,
                    stats_fd,
                    Restart::Continued {
                        sockets: socks.len(),
                    },
                    PriorWatch::None,
                )?;
                e.model = model;
                // Pair the relay legs now, so that the first snapshot already labels them
                // with their chain's VM (chains are otherwise formed at the first sample).
                e.sample_only(monotonic_ns());
                Ok(e)
            }
            found => {
                let (restart, prior) = match found {
                    loader::Pinned::Stale(why) => {
                        let prior = match loader::pinned_watched(dir) {
                            Ok(t) => PriorWatch::Tgids(t),
                            Err(e) => {
                                debug!("reading the old set's watched processes: {e:#}");
                                PriorWatch::Unknown
                            }
                        };
                        let gone = loader::unpin_contents(dir)?;
                        debug!("removed {} pin(s) from {}", gone.len(), dir.display());
                        (Restart::Reloaded { why }, prior)
                    }
                    _ => (Restart::Fresh, PriorWatch::None),
                };
                let cap = Capture::load_pinned(dir, opts.hook_set)?;
                Self::with_capture(opts, cap, stats_fd, restart, prior)
            }
        }
    }

    fn with_capture(
        opts: EngineOptions,
        cap: Capture,
        stats_fd: Option<std::os::fd::OwnedFd>,
        restart: Restart,
        prior: PriorWatch,
    ) -> Result<Engine> {
        Self::with_capture_ring(opts, cap, stats_fd, restart, prior, "EVENTS")
    }

    fn with_capture_ring(
        opts: EngineOptions,
        mut cap: Capture,
        stats_fd: Option<std::os::fd::OwnedFd>,
        restart: Restart,
        prior: PriorWatch,
        ring_name: &str,
    ) -> Result<Engine> {
        // Loading parsed the kernel's BTF twice (tens of MB, freed now): give the freed heap
        // back to the system, or it stays in the resident set for the engine's life.
        // SAFETY: malloc_trim only releases free memory of glibc's heap.
        #[cfg(target_env = "gnu")]
        unsafe {
            libc::malloc_trim(0);
        }
        // SAFETY: the ring owns its map fd, which stays open and unchanged for the AsyncFd's
        // life.
        let ring = unsafe {
            AsyncFd::register_with_interest(cap.take_ring_named(ring_name)?, Interest::READABLE)
        }
        .map_err(|e| anyhow::anyhow!("polling the event ring: {}", e.into_parts().1))?;
        // Both clocks back to back, so that sample times can be lined up with packet timestamps.
        let started_ns = monotonic_ns();
        let clock = ClockReport {
            realtime_ns: super::realtime_ns(),
            monotonic_ns: started_ns,
        };
        Ok(Engine {
            opts,
            cap,
            ring,
            model: Model::default(),
            chains: Vec::new(),
            sampler: sampler::Sampler::new(),
            decode_errors: 0,
            dump: None,
            started_ns,
            clock,
            roots: Vec::new(),
            unwatched: Vec::new(),
            last_snapshot_ns: AtomicU64::new(0),
            reported_closed: Mutex::new(Vec::new()),
            _stats_fd: stats_fd,
            restart,
            prior,
            _pin_lock: None,
            pin_dir: None,
            tap: None,
            self_test: None,
            self_test_counters: [0; counter::COUNT as usize],
        })
    }

    /// Starts beside a running daemon (`observe --pid` with a pin directory): if `dir` holds a
    /// complete pinned set of this agent's layout ([`Capture::open_pinned`]), reads it without
    /// loading anything. [`Engine::watch`] then sets the [`watch::TAP`] flag of the processes
    /// (adding entries with `TAP` only for those the daemon does not watch, never
    /// [`watch::PRIMARY`]), so that their records also go to the `TAP_EVENTS` ring, which
    /// this engine consumes; the daemon's `EVENTS` ring is never read. The model of each
    /// process's sockets is rebuilt from the kernel's socket map as the daemon's restore does
    /// ([`Model::restore`]), so the counts are exact from each session's start.
    ///
    /// At the start, `TAP` flags left by an observe that died are cleared and stale
    /// `TAP_EVENTS` records discarded. At the end ([`Engine::untap`], or on drop) the flags
    /// are cleared and the entries, ports and marks this engine added removed.
    ///
    /// Errors: the directory cannot be read, another observe holds the `TAP_EVENTS` lock,
    /// the maps refuse an update.
    pub fn start_beside(opts: EngineOptions, dir: &Path) -> Result<Beside> {
        let mut cap = match Capture::open_pinned(dir, loader::HookChoice::Auto)? {
            loader::Pinned::Reusable(cap) => *cap,
            loader::Pinned::Absent => return Ok(Beside::Absent),
            loader::Pinned::Stale(why) => return Ok(Beside::Unusable(why)),
        };
        let lock = lock_tap(dir)?;
        let cleared = clear_tap_flags(&mut cap)?;
        if cleared > 0 {
            warn!("cleared {cleared} TAP flag(s) left by an observe that did not end cleanly");
        }
        // Records of calls in progress at the clear land within microseconds.
        std::thread::sleep(Duration::from_millis(10));
        let counters_at_start = cap.counters()?;
        let mut e = Self::with_capture_ring(
            opts,
            cap,
            None,
            Restart::Unpinned,
            PriorWatch::None,
            "TAP_EVENTS",
        )?;
        let mut discarded = 0u64;
        while e.ring.get_mut().next().is_some() {
            discarded += 1;
        }
        if discarded > 0 {
            debug!("discarded {discarded} stale TAP_EVENTS record(s)");
        }
        e.pin_dir = Some(dir.to_path_buf());
        e.tap = Some(Tap {
            _lock: lock,
            counters_at_start,
            ports_added: Vec::new(),
            preexisting_added: Vec::new(),
            discarded,
            released: false,
        });
        Ok(Beside::Tapped(Box::new(e)))
    }

    /// Ends reading beside the daemon ([`Engine::start_beside`]): clears every
    /// [`watch::TAP`] flag (entries with `TAP` only are removed, the daemon's keep
    /// [`watch::PRIMARY`] and their root), removes the `WATCH_PORTS` and `PREEXISTING` entries
    /// this engine added and the kernel state of sockets created for it only. Idempotent;
    /// a no-op for other engines. Also run on drop, so error paths clean up too.
    pub fn untap(&mut self) -> Result<()> {
        let Some(t) = self.tap.as_mut() else {
            return Ok(());
        };
        if t.released {
            return Ok(());
        }
        t.released = true;
        let ports = std::mem::take(&mut t.ports_added);
        let marks = std::mem::take(&mut t.preexisting_added);
        clear_tap_flags(&mut self.cap)?;
        for p in ports {
            self.cap.unwatch_port(p)?;
        }
        for c in marks {
            self.cap.unmark_preexisting(c)?;
        }
        Ok(())
    }

    /// Where this engine's data come from (report `source`, the table's first line).
    pub fn source(&self) -> SourceReport {
        let pin_dir = self.pin_dir.as_ref().map(|d| d.display().to_string());
        match (&self.tap, &self.restart) {
            (Some(_), _) => SourceReport {
                kind: "pinned".into(),
                pin_dir,
                exact_from_session_start: true,
                tap: true,
            },
            (None, Restart::Continued { .. }) => SourceReport {
                kind: "pinned".into(),
                pin_dir,
                exact_from_session_start: true,
                tap: false,
            },
            _ => SourceReport {
                kind: "loaded".into(),
                pin_dir,
                exact_from_session_start: false,
                tap: false,
            },
        }
    }

    /// Stale `TAP_EVENTS` records discarded at the start of [`Engine::start_beside`] (0 for
    /// other engines).
    pub fn tap_discarded(&self) -> u64 {
        self.tap.as_ref().map_or(0, |t| t.discarded)
    }

    /// [`Engine::watch`] beside the daemon: see [`Engine::start_beside`]. The order makes the
    /// counts exact: the flags are set first (each socket call reads them once), then, once
    /// calls in progress have ended, the socket map is read: every message the map
    /// does not count yet has a `TAP_EVENTS` record, and the records of those it counts are
    /// skipped by their ordinal ([`crate::model::DirStats::restored_upto`]).
    fn watch_beside(&mut self, tgid: u32, tgids: Vec<u32>) -> Result<Watched> {
        let values: HashMap<u32, u32> = tgids
            .iter()
            .filter_map(|&t| Some((t, self.cap.watch_value(t)?)))
            .collect();
        let continued: Vec<u32> = tgids
            .iter()
            .copied()
            .filter(|t| values.get(t).is_some_and(|v| v & watch::PRIMARY != 0))
            .collect();
        let ports_before: HashSet<u16> = self.cap.watch_ports()?.into_iter().collect();
        let marks_before: HashSet<u64> = self.cap.preexisting()?.into_iter().collect();
        let (ports, existing) = prepare_sockets(&mut self.cap, &self.model, &tgids, &continued)?;
        let ports_added: Vec<u16> = self
            .cap
            .watch_ports()?
            .into_iter()
            .filter(|p| !ports_before.contains(p))
            .collect();
        let marks_added: Vec<u64> = self
            .cap
            .preexisting()?
            .into_iter()
            .filter(|c| !marks_before.contains(c))
            .collect();
        if let Some(t) = self.tap.as_mut() {
            t.ports_added.extend(ports_added);
            t.preexisting_added.extend(marks_added);
        }
        for &t in &tgids {
            if continued.contains(&t) {
                // The daemon's entry: its root and PRIMARY stay.
                self.cap.set_watch_value(t, values[&t] | watch::TAP, true)?;
            } else {
                if t == std::process::id() {
                    continue;
                }
                self.cap
                    .set_watch_value(t, (tgid & watch::ROOT_MASK) | watch::TAP, false)?;
            }
        }
        // A socket call that read the old value (its route) before the update has written
        // its records within microseconds; every later one sends them to TAP_EVENTS too.
        std::thread::sleep(Duration::from_millis(20));
        let socks = self.cap.sockets()?;
        let addrs = socket_addresses();
        let now = monotonic_ns();
        let mut restored = 0;
        for (cookie, state) in &socks {
            if !tgids.contains(&state.tgid) || self.model.sockets.contains_key(cookie) {
                continue;
            }
            let a = addrs.get(cookie);
            self.model.restore(
                &crate::model::Restored {
                    cookie: *cookie,
                    state: *state,
                    comm: sockdiag::comm(state.tgid).unwrap_or_default(),
                    local: a.map(|a| a.0),
                    remote: a.map(|a| a.1),
                    tcp: self.cap.tcp_state(*cookie),
                },
                now,
            );
            restored += 1;
        }
        self.model.restored_at(now);
        debug!("beside the daemon: {restored} socket(s) of pid {tgid} taken from the socket map");
        for e in &existing {
            if !self.model.sockets.contains_key(&e.cookie) {
                self.model.add_existing_as(
                    e.cookie,
                    e.pid,
                    e.local,
                    e.remote,
                    now,
                    UnparsedReason::AttachedMidStream,
                );
            }
        }
        Ok(self.add_root(tgid, tgids, ports, existing.len()))
    }

    /// Records `tgid` (with `tgids`, itself and the children watched for it) as watched and
    /// returns what watching it found.
    fn add_root(&mut self, tgid: u32, tgids: Vec<u32>, ports: usize, existing: usize) -> Watched {
        let watched = Watched {
            pid: tgid,
            comm: sockdiag::comm(tgid).unwrap_or_default(),
            ports_enrolled: ports,
            existing_connections: existing,
        };
        self.roots.push(Root {
            watched: watched.clone(),
            tgids,
        });
        watched
    }

    /// How this engine found its pin directory ([`Restart::Unpinned`] without one).
    pub fn restart(&self) -> &Restart {
        &self.restart
    }

    /// Writes every decoded kernel record to `path` from now on, one per line (debugging the
    /// capture). Errors if the file cannot be created.
    pub fn dump_events(&mut self, path: &Path) -> Result<()> {
        self.dump = Some(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        ));
        Ok(())
    }

    /// Starts watching process `pid` (its threads, current children and future forks): enrols its
    /// listening ports for sockops, lists its open connections (reported, not framed). Idempotent.
    pub fn watch(&mut self, pid: u32) -> Result<Watched> {
        let me = std::process::id();
        let tgid = thread_group(pid)?;
        if tgid == me {
            bail!("refusing to watch the observer itself (pid {me})");
        }
        if let Some(r) = self.roots.iter().find(|r| r.watched.pid == tgid) {
            return Ok(r.watched.clone());
        }
        // The process and the children it already has (a socat listener's live connections).
        let mut tgids = vec![tgid];
        for child in sockdiag::descendants(tgid) {
            if child != me && !tgids.contains(&child) {
                tgids.push(child);
            }
        }
        if self.tap.is_some() {
            return self.watch_beside(tgid, tgids);
        }
        let continued: Vec<u32> = if self.model.restored_ns.is_some() {
            tgids
                .iter()
                .copied()
                .filter(|&t| self.cap.is_watched(t))
                .collect()
        } else {
            Vec::new()
        };
        let (ports, existing) = prepare_sockets(&mut self.cap, &self.model, &tgids, &continued)?;
        for &t in &tgids {
            self.cap.watch_pid_under(t, tgid)?;
        }
        let now = monotonic_ns();
        for e in &existing {
            let counted_before = match &self.prior {
                PriorWatch::None => false,
                PriorWatch::Tgids(t) => t.contains(&e.pid),
                PriorWatch::Unknown => true,
            };
            let reason = if counted_before {
                UnparsedReason::Restarted
            } else {
                UnparsedReason::AttachedMidStream
            };
            self.model
                .add_existing_as(e.cookie, e.pid, e.local, e.remote, now, reason);
        }
        Ok(self.add_root(tgid, tgids, ports, existing.len()))
    }

    /// Stops watching `pid` and its children (the process exited or is no longer a target);
    /// its sockets' state is released after the next snapshot. A pid not watched is no error.
    pub fn unwatch(&mut self, pid: u32) -> Result<()> {
        let tgid = thread_group(pid).unwrap_or(pid);
        let Some(i) = self.roots.iter().position(|r| r.watched.pid == tgid) else {
            return Ok(());
        };
        let root = self.roots.remove(i);
        let mut gone = self.cap.unwatch_tree(&[tgid])?;
        gone.extend(root.tgids);
        // Children forked since (and maybe exited: the exit hook removed them from the map).
        for n in &self.model.processes {
            if let crate::model::ProcessNote::Forked { parent, child, .. } = n
                && gone.contains(parent)
            {
                gone.push(*child);
            }
        }
        gone.sort_unstable();
        gone.dedup();
        self.unwatched.push((monotonic_ns(), gone));
        Ok(())
    }

    /// Waits until the ring wakes the agent and applies the records waiting then to the model
    /// (cancel-safe: use in `select!`). The kernel programs wake the agent only about every
    /// [`spice_ebpf_common::config::ring::WAKEUP_BYTES`] of records, so the front end must also
    /// drain at least every [`spice_ebpf_common::config::ring::DRAIN_INTERVAL_MS`] to bound how
    /// long a record waits in the ring ([`super::ticker::SampleClock`]: every sample drains).
    pub async fn drain_ready(&mut self) -> Result<()> {
        let mut guard = self.ring.readable_mut().await?;
        drain_ring(
            guard.get_inner_mut(),
            &mut self.model,
            &mut self.decode_errors,
            &mut self.dump,
        );
        guard.clear_ready();
        Ok(())
    }

    /// Applies every record waiting now.
    pub fn drain(&mut self) {
        drain_ring(
            self.ring.get_mut(),
            &mut self.model,
            &mut self.decode_errors,
            &mut self.dump,
        );
    }

    /// One TCP sample of every chain (pairs new sockets first): applies the ring's records,
    /// reads the positions and the kernel's state of every open socket
    /// ([`sampler::Sampler::read`], which hands the latter to the model), applies the records
    /// of the calls made up to those reads (so the count and the messages match `write_seq` /
    /// `copied_seq`, and the model compares its window with the kernel's), then places
    /// ([`sampler::place`]). Returns the per-chain sample lines for front ends that
    /// write or plot them; empty when a sock_diag query failed. `now_ns` is the front end's
    /// tick (CLOCK_MONOTONIC); the lines carry the instants the positions were read.
    pub fn sample(&mut self, now_ns: u64) -> Vec<SampleLine> {
        match self.take_sample(now_ns) {
            Some(taken) => crate::samples::lines(&self.model, &taken, self.started_ns),
            None => Vec::new(),
        }
    }

    /// [`Engine::sample`] without building the sample lines, for a front end that writes and
    /// plots none (the daemon; `observe` without `--samples` and `--plot`): the same sample is
    /// taken and kept in the chains' statistics.
    pub fn sample_only(&mut self, now_ns: u64) {
        let _ = self.take_sample(now_ns);
    }

    fn take_sample(&mut self, now_ns: u64) -> Option<sampler::Sample> {
        let _ = now_ns;
        self.drain();
        let pos = self
            .sampler
            .read(&mut self.cap, &mut self.model, &mut self.chains)?;
        self.drain();
        Some(sampler::place(&self.model, &mut self.chains, pos))
    }

    /// Reads the kernel's state (`SOCKETS`, in batches: [`Capture::sock_states`]) of every
    /// open socket and hands it to the model, which takes the bytes of every traced call
    /// (framed or not) from it, and, for a socket that carried messages, the message and byte
    /// totals (records lost since the previous read are then in the totals) and compares it
    /// with the record-derived window and byte totals once it has applied exactly the records
    /// the kernel had written at the read ([`crate::model::KernelCheck`]; report
    /// `kernel_window`). Each sample does the same from its own reads
    /// ([`sampler::Sampler::read`]); call this before the last [`Engine::drain`] for a
    /// comparison at the end.
    pub fn read_kernel_state(&mut self) {
        let now = monotonic_ns();
        let open: Vec<u64> = self
            .model
            .sockets
            .values()
            .filter(|s| s.closed_ns.is_none())
            .map(|s| s.cookie)
            .collect();
        for (cookie, st) in self.cap.sock_states(&open) {
            self.model.kernel_state(cookie, &st, now);
        }
    }

    /// A pure read of the current state and cumulative statistics up to `now_ns` (does not
    /// change time accounting; calling it twice gives the same result, apart from what it
    /// reads live: the TCP state of open sockets by sock_diag, process names, the kernel
    /// counters). Records still in the ring are not applied: call [`Engine::drain`] first for
    /// an up-to-date report.
    pub fn snapshot(&self, now_ns: u64) -> Report {
        let mut comms: HashMap<u32, String> = HashMap::new();
        let pids = self
            .model
            .sockets
            .values()
            .map(|s| s.pid)
            .chain(self.model.tls_attach.keys().copied());
        for pid in pids {
            if !comms.contains_key(&pid)
                && let Some(c) = sockdiag::comm(pid)
            {
                comms.insert(pid, c);
            }
        }
        let mut degraded = self.cap.degraded.clone();
        let mut counters = self.cap.counters().unwrap_or_else(|e| {
            degraded.push(format!("kernel counters unreadable: {e:#}"));
            [0; counter::COUNT as usize]
        });
        if let Some(t) = &self.tap {
            // The daemon's counters run since it loaded the programs: this run's share.
            for (c, s) in counters.iter_mut().zip(t.counters_at_start) {
                *c = c.saturating_sub(s);
            }
        }
        for (c, s) in counters.iter_mut().zip(self.self_test_counters) {
            *c = c.saturating_sub(s);
        }
        let source = self.source();
        let tcp = best_tcp(&self.model);
        let mut rep = report::build(
            &self.model,
            report::RunInfo {
                started_ns: self.started_ns,
                end_ns: now_ns,
                clock: self.clock,
                hook_set: &self.cap.hook_set,
                source: &source,
                counters: &counters,
                degraded: &degraded,
                pids: self
                    .roots
                    .iter()
                    .map(|r| PidReport {
                        pid: r.watched.pid,
                        comm: r.watched.comm.clone(),
                    })
                    .collect(),
                tcp_final: &tcp,
                chains: &self.chains,
                comms: &comms,
            },
        );
        rep.self_test = self.self_test.clone();
        if self.decode_errors > 0 {
            rep.degraded.push(format!(
                "{} ring record(s) could not be decoded",
                self.decode_errors
            ));
            rep.events_lost += self.decode_errors;
        }
        self.last_snapshot_ns.fetch_max(now_ns, Ordering::Relaxed);
        let closed: Vec<u64> = self
            .model
            .sockets
            .values()
            .filter(|s| s.closed_ns.is_some())
            .map(|s| s.cookie)
            .collect();
        if let Ok(mut r) = self.reported_closed.lock() {
            *r = closed;
        }
        rep
    }

    /// Runs the start-up self-test ([`super::selftest::run`]) unless this engine reads a
    /// daemon's set beside it (`Ok(None)`: the daemon tested its set). Errors when the hooks
    /// did not count the test's messages exactly: the front end must not report then.
    pub fn self_test(&mut self) -> Result<Option<super::selftest::SelfTestReport>> {
        if self.tap.is_some() {
            return Ok(None);
        }
        // Only the test's own calls move the counters while nothing else is watched.
        let alone = self.roots.is_empty() && !matches!(self.restart, Restart::Continued { .. });
        let before = self.cap.counters().ok().filter(|_| alone);
        let res = super::selftest::run(self);
        if let (Some(b), Ok(a)) = (before, self.cap.counters()) {
            for ((d, a), b) in self.self_test_counters.iter_mut().zip(a).zip(b) {
                *d = a.saturating_sub(b);
            }
        }
        let rep = res?;
        self.self_test = Some(rep.clone());
        Ok(Some(rep))
    }

    /// Drops the self-test child `pid` at once: unwatches it, takes its listening `port` out
    /// of `WATCH_PORTS`, frees its sockets and ignores their later records
    /// ([`Model::ignored`]), so that no report shows them.
    pub(super) fn forget_self_test(&mut self, pid: u32, port: u16) -> Result<()> {
        self.unwatch(pid)?;
        self.unwatched.retain(|(_, p)| !p.contains(&pid));
        self.cap.unwatch_port(port)?;
        let free: HashSet<u64> = self
            .model
            .sockets
            .values()
            .filter(|s| s.pid == pid)
            .map(|s| s.cookie)
            .collect();
        self.model.ignored.extend(free.iter().copied());
        self.free_sockets(&free);
        Ok(())
    }

    /// Frees the state of sockets that were closed (or whose process was unwatched) at or before the
    /// last snapshot. Called by the daemon after each scrape. Bounded memory. With
    /// `retain_closed`, closed sockets are kept (only unwatched processes' are freed).
    pub fn release_reported(&mut self) {
        let t = self.last_snapshot_ns.load(Ordering::Relaxed);
        if t == 0 {
            return;
        }
        let mut free: HashSet<u64> = HashSet::new();
        if !self.opts.retain_closed
            && let Ok(mut r) = self.reported_closed.lock()
        {
            free.extend(r.drain(..));
        }
        let (done, pending): (Vec<_>, Vec<_>) =
            self.unwatched.drain(..).partition(|(at, _)| *at <= t);
        self.unwatched = pending;
        let pids: HashSet<u32> = done.into_iter().flat_map(|(_, p)| p).collect();
        // Their libssl hook status goes with them (the model's list stays bounded).
        self.model.tls_attach.retain(|p, _| !pids.contains(p));
        self.model.tls_forgotten.retain(|p| !pids.contains(p));
        if !pids.is_empty() {
            free.extend(
                self.model
                    .sockets
                    .values()
                    .filter(|s| pids.contains(&s.pid))
                    .map(|s| s.cookie),
            );
        }
        self.free_sockets(&free);
    }

    fn free_sockets(&mut self, free: &HashSet<u64>) {
        if free.is_empty() {
            return;
        }
        self.model.sockets.retain(|c, _| !free.contains(c));
        self.model.release_tls_attach();
        self.chains.retain(|c| !free.contains(&c.server));
        for c in self.chains.iter_mut() {
            if c.backend.is_some_and(|b| free.contains(&b)) {
                c.backend = None;
            }
            if c.client_leg.is_some_and(|b| free.contains(&b)) {
                c.client_leg = None;
            }
        }
    }

    /// The capture and the model, for the front ends' per-process libssl hooks
    /// ([`crate::kernel::tls::TlsHooks`]: they attach through the capture and report each
    /// process's status to the model).
    pub fn capture_and_model(&mut self) -> (&mut Capture, &mut Model) {
        (&mut self.cap, &mut self.model)
    }

    /// Name of the active hook set (`hook_set` in the report).
    pub fn hook_set(&self) -> &str {
        &self.cap.hook_set
    }

    /// Kernel features that were missing and what that costs.
    pub fn degraded(&self) -> &[String] {
        &self.cap.degraded
    }

    /// Adds a feature the front end could not turn on (e.g. the daemon's `bpf_stats` without
    /// CAP_SYS_ADMIN) to the degraded list that [`Engine::degraded`] and every snapshot give.
    pub fn note_degraded(&mut self, what: String) {
        self.cap.degraded.push(what);
    }

    /// Kernel loss/activity counters (config::counter order).
    pub fn counters(&mut self) -> Result<[u64; counter::COUNT as usize]> {
        self.cap.counters()
    }

    /// Per-program run time and count (zeros when bpf_stats is off), sorted by name.
    pub fn program_stats(&self) -> Vec<ProgramStats> {
        self.cap
            .program_stats()
            .into_iter()
            .map(|(name, run_time_ns, run_count)| ProgramStats {
                name,
                run_time_ns,
                run_count,
            })
            .collect()
    }

    /// Sizes of the engine's state.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            sockets: self.model.sockets.len(),
            chains: self.chains.len(),
            processes: self.model.processes.len(),
            records: self.model.records,
            decode_errors: self.decode_errors,
        }
    }

    /// CLOCK_MONOTONIC ns at start and the matching CLOCK_REALTIME (report `clock`).
    pub fn started(&self) -> ClockReport {
        self.clock
    }

    /// The processes watched (one per [`Engine::watch`] not undone by [`Engine::unwatch`]).
    pub fn watched(&self) -> Vec<Watched> {
        self.roots.iter().map(|r| r.watched.clone()).collect()
    }

    /// What a live progress line shows.
    pub fn progress(&self) -> Progress {
        let m = &self.model;
        let relays = crate::model::chain::relay_pids(m);
        let lost = self
            .cap
            .counters()
            .map(|c| match &self.tap {
                // Beside the daemon: its own losses since its start.
                Some(t) => (0..c.len() as u32)
                    .filter(|&i| counter::is_tap_loss(i))
                    .map(|i| c[i as usize].saturating_sub(t.counters_at_start[i as usize]))
                    .sum(),
                None => (0..c.len() as u32)
                    .filter(|&i| counter::is_loss(i))
                    .map(|i| c[i as usize])
                    .sum(),
            })
            .unwrap_or(0);
        Progress {
            sockets: m.sockets.len(),
            framed: m
                .sockets
                .values()
                .filter(|s| matches!(s.framing(), "mini" | "full"))
                .count(),
            messages: m
                .sockets
                .values()
                .map(|s| s.dirs[0].messages + s.dirs[1].messages)
                .sum(),
            // spice-server's display channels only: a relay's client-facing legs are server
            // ends too.
            display_in_flight: m
                .sockets
                .values()
                .filter(|s| {
                    s.closed_ns.is_none()
                        && s.window.active()
                        && s.channel().map(|c| c.0) == Some(channel::DISPLAY)
                        && s.is_server_end() == Some(true)
                        && !relays.contains(&s.pid)
                })
                .map(|s| (s.window.count, s.window.limit()))
                .collect(),
            lost,
        }
    }
}

impl Drop for Engine {
    /// Clears the `TAP` flags of an engine beside the daemon ([`Engine::untap`]).
    fn drop(&mut self) {
        if let Err(e) = self.untap() {
            warn!("clearing the TAP flags at exit failed: {e:#}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn how_a_joined_connection_was_made() {
        let listening: HashSet<u16> = [5900, 6900].into_iter().collect();
        let eph = Some((32768, 60999));
        use preexisting::{ACCEPTED, CONNECTED, UNKNOWN};
        for (what, ephemeral, local, remote, want) in [
            (
                "spice-server's (or a relay's client-facing) socket: accepted on a listening port",
                eph,
                5900,
                41000,
                ACCEPTED,
            ),
            (
                "a relay's leg toward a local spice-server: connected to a listening port",
                eph,
                41002,
                5900,
                CONNECTED,
            ),
            (
                "toward a remote server (its port not listening here): the ephemeral side connected",
                eph,
                41004,
                5930,
                CONNECTED,
            ),
            (
                "a server that closed its listener on a fixed port",
                eph,
                5931,
                41006,
                ACCEPTED,
            ),
            (
                "both ephemeral (a scripted server on port 0 that closed its listener)",
                eph,
                40000,
                41008,
                UNKNOWN,
            ),
            ("the ephemeral range unreadable", None, 40000, 5931, UNKNOWN),
        ] {
            assert_eq!(
                made_how(&listening, ephemeral, local, remote),
                want,
                "{what}"
            );
        }
    }
}
