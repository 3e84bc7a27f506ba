//! `spice-observer observe --hook-set tcpinfo`: the no-BPF mode. TCP state of the watched
//! processes' sockets, polled over netlink sock_diag; no SPICE framing at all.
//!
//! Nothing is loaded into the kernel, no bpffs or pin is touched and no capability is needed:
//! sock_diag dumps and lookups of TCP sockets, `struct tcp_info` included, are open to every
//! user (that is how `ss -tin` works unprivileged), and `/proc/PID/fd` of one's own processes
//! is readable. Watching another user's process needs root (or `CAP_SYS_PTRACE`) for its
//! `/proc/PID/fd`, as with `ss -p`.
//!
//! Every `--sample-ms` the [`Poller`]:
//! 1. lists the socket descriptors of the watched processes and their descendants
//!    (`/proc/PID/fd/N -> socket:[INODE]`; the process set is refreshed once a second);
//! 2. asks each new descriptor's protocol from the socket itself (the `system.sockprotoname`
//!    extended attribute, `sockfs_xattr_get()` in `net/socket.c`: `TCP`, `TCPv6`, `UNIX`,
//!    `UDP`, …), so that the X11, D-Bus and UDP sockets of the process cost nothing after;
//! 3. when a TCP socket it does not know yet is there, dumps the namespace's TCP sockets once
//!    ([`DiagQuery::dump`], about a millisecond of kernel time) to learn its addresses and
//!    cookie by its inode;
//! 4. asks every known connection's current state by its addresses and cookie, in batches on
//!    the one netlink socket kept open ([`DiagQuery::sockets`], a hash lookup each).
//!
//! A connection whose descriptor is no longer held by any watched process, or that the kernel
//! no longer finds, is closed: it stays in the report with the last state read
//! ([`Connection::open`] false). At most [`MAX_CLOSED`] closed connections are kept (the
//! oldest go first, counted in [`Report::closed_dropped`]), so memory is bounded by the
//! watched processes' open descriptors plus that constant.
//!
//! What it cannot give: anything about SPICE messages. There are no channel types, message
//! counts, ACK window, in-flight messages or stages: only what TCP knows. Every output says so
//! ([`NO_FRAMING`]).

use std::{
    collections::{BTreeMap, HashMap, HashSet, VecDeque},
    net::SocketAddr,
    path::Path,
    time::Duration,
};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    cmd::observe::ObserveOptions,
    pipeline::monotonic_ns,
    sockdiag::{self, DiagQuery, DiagSocket, TcpInfo, TcpInfoMore},
};

/// The hook set name of this mode in every output (`hook_set`).
pub const HOOK_SET: &str = "tcpinfo";

/// The sentence every output of this mode carries (table, JSON `note`, start line).
pub const NO_FRAMING: &str = "tcpinfo mode: TCP state from sock_diag only, no SPICE framing \
    (no channels, no message counts, no ACK window, no in-flight messages, no stages)";

/// Most closed connections kept in the report; the oldest closed go first beyond it.
pub const MAX_CLOSED: usize = 1024;

/// How long a TCP socket not yet in any sock_diag dump (created, not bound or connected yet)
/// triggers a dump at every sample; after that, at most one dump a second for it.
const PENDING_EAGER: Duration = Duration::from_secs(2);

/// TCP state names (`include/net/tcp_states.h`), by `idiag_state`.
pub fn state_name(state: u8) -> &'static str {
    match state {
        1 => "ESTABLISHED",
        2 => "SYN_SENT",
        3 => "SYN_RECV",
        4 => "FIN_WAIT1",
        5 => "FIN_WAIT2",
        6 => "TIME_WAIT",
        7 => "CLOSE",
        8 => "CLOSE_WAIT",
        9 => "LAST_ACK",
        10 => "LISTEN",
        11 => "CLOSING",
        12 => "NEW_SYN_RECV",
        _ => "UNKNOWN",
    }
}

const TCP_LISTEN: u8 = 10;

/// One connection's TCP state at one sample: the `struct inet_diag_msg` queues and the
/// `struct tcp_info` fields (`include/uapi/linux/tcp.h`, filled by `tcp_get_info()`,
/// `net/ipv4/tcp.c`). Byte counts are bytes, times microseconds unless the name says
/// otherwise, rates bytes per second. A field the running kernel's `tcp_info` is too short
/// for reads 0.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Gauges {
    /// `idiag_state` by name ([`state_name`]): `ESTABLISHED`, `CLOSE_WAIT`, …
    pub state: String,
    /// `idiag_rqueue`: received in order, not yet read by the application (`rcv_nxt -
    /// copied_seq`), bytes.
    pub recv_queue: u32,
    /// `idiag_wqueue`: written by the application, not yet acknowledged (`write_seq -
    /// snd_una`), bytes.
    pub send_queue: u32,
    /// `tcpi_bytes_acked`: acknowledged by the peer over the connection's life, bytes (the
    /// active opener's counts its SYN as 1).
    pub bytes_acked: u64,
    /// `tcpi_bytes_received`: received in order over the connection's life, bytes.
    pub bytes_received: u64,
    /// `tcpi_bytes_sent`: sent, retransmissions included, bytes (Linux 4.19).
    pub bytes_sent: u64,
    /// `tcpi_bytes_retrans`: retransmitted, bytes (Linux 4.19).
    pub bytes_retrans: u64,
    /// `tcpi_notsent_bytes`: written by the application, not sent yet (`write_seq -
    /// snd_nxt`), bytes.
    pub notsent_bytes: u32,
    /// `tcpi_unacked`: segments in flight (`packets_out`).
    pub unacked: u32,
    /// `tcpi_lost`: segments now considered lost.
    pub lost: u32,
    /// `tcpi_retrans`: segments retransmitted and not yet acknowledged.
    pub retrans: u32,
    /// `tcpi_total_retrans`: segments retransmitted over the connection's life.
    pub total_retrans: u32,
    /// `tcpi_retransmits`: retransmission timeouts in a row not yet recovered from.
    pub retransmits: u8,
    /// `tcpi_ca_state`: 0 Open, 1 Disorder, 2 CWR, 3 Recovery, 4 Loss.
    pub ca_state: u8,
    /// `tcpi_snd_cwnd`: congestion window, segments.
    pub snd_cwnd: u32,
    /// `tcpi_snd_ssthresh`: slow-start threshold, segments.
    pub snd_ssthresh: u32,
    /// `tcpi_snd_mss`: sender's segment size, bytes.
    pub snd_mss: u32,
    /// `tcpi_snd_wnd`: the peer's advertised receive window, bytes (Linux 5.4).
    pub snd_wnd: u32,
    /// `tcpi_rtt`: smoothed round-trip time, µs.
    pub srtt_us: u32,
    /// `tcpi_rttvar`: round-trip time variation, µs.
    pub rttvar_us: u32,
    /// `tcpi_min_rtt`: minimum round-trip time over the recent window, µs.
    pub min_rtt_us: u32,
    /// `tcpi_rto`: retransmission timeout, µs.
    pub rto_us: u32,
    /// `tcpi_delivery_rate`: latest delivery-rate sample, bytes/s.
    pub delivery_rate: u64,
    /// `tcpi_pacing_rate`: pacing rate, bytes/s (`u64::MAX`: unlimited).
    pub pacing_rate: u64,
    /// `tcpi_busy_time`: time with data in flight, µs (jiffy granularity).
    pub busy_time_us: u64,
    /// `tcpi_rwnd_limited`: time limited by the peer's receive window, µs (jiffies).
    pub rwnd_limited_us: u64,
    /// `tcpi_sndbuf_limited`: time limited by the send buffer, µs (jiffies).
    pub sndbuf_limited_us: u64,
    /// `tcpi_last_data_sent`: time since the last data segment sent, ms.
    pub last_data_sent_ms: u32,
    /// `tcpi_last_data_recv`: time since the last data segment received, ms.
    pub last_data_recv_ms: u32,
    /// `tcpi_segs_out` / `tcpi_segs_in`: segments sent / received (Linux 4.2).
    pub segs_out: u32,
    pub segs_in: u32,
}

impl Gauges {
    /// From one sock_diag answer. Without `INET_DIAG_INFO` (a `TIME_WAIT` mini-socket) only the
    /// state and queues change, the `tcp_info` fields stay those of `prev`.
    fn from_diag(d: &DiagSocket, prev: Option<&Gauges>) -> Gauges {
        let mut g = prev.cloned().unwrap_or_default();
        g.state = state_name(d.state).into();
        g.recv_queue = d.recv_queue;
        g.send_queue = d.send_queue;
        if let (Some(i), Some(m)) = (d.info, d.more) {
            g.set_info(&i, &m);
        }
        g
    }

    fn set_info(&mut self, i: &TcpInfo, m: &TcpInfoMore) {
        self.bytes_acked = i.bytes_acked;
        self.bytes_received = i.bytes_received;
        self.bytes_sent = m.bytes_sent;
        self.bytes_retrans = m.bytes_retrans;
        self.notsent_bytes = i.notsent_bytes;
        self.unacked = i.unacked;
        self.lost = m.lost;
        self.retrans = m.retrans;
        self.total_retrans = i.total_retrans;
        self.retransmits = m.retransmits;
        self.ca_state = m.ca_state;
        self.snd_cwnd = i.snd_cwnd;
        self.snd_ssthresh = m.snd_ssthresh;
        self.snd_mss = m.snd_mss;
        self.snd_wnd = m.snd_wnd;
        self.srtt_us = i.srtt_us;
        self.rttvar_us = m.rttvar_us;
        self.min_rtt_us = i.min_rtt_us;
        self.rto_us = m.rto_us;
        self.delivery_rate = i.delivery_rate;
        self.pacing_rate = m.pacing_rate;
        self.busy_time_us = i.busy_time_us;
        self.rwnd_limited_us = i.rwnd_limited_us;
        self.sndbuf_limited_us = i.sndbuf_limited_us;
        self.last_data_sent_ms = m.last_data_sent_ms;
        self.last_data_recv_ms = m.last_data_recv_ms;
        self.segs_out = m.segs_out;
        self.segs_in = m.segs_in;
    }
}

/// One TCP connection of a watched process, over the run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Connection {
    /// The process that held its descriptor when it was first seen.
    pub pid: u32,
    pub comm: String,
    /// `idiag_cookie` (the socket cookie, as `SO_COOKIE`).
    pub cookie: u64,
    /// `idiag_inode` (`/proc/PID/fd/N -> socket:[INODE]`).
    pub inode: u64,
    /// Local and peer `address:port` (`id.idiag_src`/`sport`, `id.idiag_dst`/`dport`).
    pub local: String,
    pub remote: String,
    /// Still open when the report was made (its descriptor held by a watched process and the
    /// kernel still finding it).
    pub open: bool,
    /// Seconds from the start of the run: first and last sample that read it, and when it was
    /// found closed (`None` while open).
    pub first_seen_s: f64,
    pub last_seen_s: f64,
    pub closed_s: Option<f64>,
    /// How it was found closed (`None` while open): `descriptor closed, socket freed`,
    /// `descriptor closed, socket in STATE` (the last look found it still in the kernel, e.g.
    /// `FIN_WAIT1`, `LAST_ACK`) or `socket freed` (the kernel no longer had it while a watched
    /// process still held the descriptor: an abort, or the cookie now names another socket).
    /// [`Self::last`] is then the state of the last sample that read it.
    pub closed_how: Option<String>,
    /// Samples that read it.
    pub samples: u64,
    /// Its state at the first sample that read it.
    pub first: Gauges,
    /// Its state at the last sample that read it (for a closed connection: its last state).
    pub last: Gauges,
    /// `last - first` of `tcpi_bytes_acked` and `tcpi_bytes_received`: bytes moved while
    /// observed.
    pub acked_during_run: u64,
    pub received_during_run: u64,
    /// Those over `last_seen_s - first_seen_s`, bits per second (0 with a single sample).
    pub send_rate_bps: f64,
    pub recv_rate_bps: f64,
    /// Largest value seen at a sample: `idiag_wqueue`, `idiag_rqueue`,
    /// `tcpi_notsent_bytes` (bytes) and `tcpi_rtt` (µs).
    pub max_send_queue: u32,
    pub max_recv_queue: u32,
    pub max_notsent_bytes: u32,
    pub max_srtt_us: u32,
    /// The addresses as sock_diag gave them (the lookups use these, not the strings).
    #[serde(skip)]
    addrs: Option<(SocketAddr, SocketAddr)>,
}

/// A listening TCP socket of a watched process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Listener {
    pub pid: u32,
    pub comm: String,
    /// `address:port`.
    pub local: String,
}

/// A watched process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Process {
    pub pid: u32,
    pub comm: String,
    /// Given with `--pid` (else a descendant of one).
    pub root: bool,
    /// The `--pid` (or, in the daemon, the discovered target) it is or descends from.
    pub under: u32,
    /// Gone before the report.
    pub exited: bool,
}

/// The `--json` document of the `tcpinfo` mode.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Always `tcpinfo`.
    pub hook_set: String,
    /// Always false: this mode frames nothing.
    pub framing: bool,
    /// [`NO_FRAMING`].
    pub note: String,
    /// spice-observer's version.
    pub version: String,
    pub duration_s: f64,
    pub sample_ms: u64,
    /// Samples taken, and the sock_diag dumps among them (those that found new sockets).
    pub samples: u64,
    pub dumps: u64,
    /// The start of the run, CLOCK_REALTIME nanoseconds since the epoch.
    pub started_realtime_ns: u64,
    pub processes: Vec<Process>,
    pub listening: Vec<Listener>,
    /// Open connections first, then closed ones, each in the order first seen.
    pub connections: Vec<Connection>,
    /// Closed connections dropped beyond [`MAX_CLOSED`].
    pub closed_dropped: u64,
    /// Problems that did not stop the run (a sample's failed query, an unreadable process).
    pub warnings: Vec<String>,
}

/// Where a socket inode stands in the [`Poller`].
enum Known {
    /// Not TCP (its `system.sockprotoname`): never asked about again while open.
    Other,
    /// TCP, not yet found in a dump (not bound or connected yet), since this time (ns).
    Pending(u64),
    /// A connection, in `Poller::open`.
    Conn,
    /// A listening socket.
    Listener,
}

/// Polls the TCP sockets of a set of processes (see the module documentation).
pub struct Poller {
    query: DiagQuery,
    roots: Vec<u32>,
    /// Watched pids (roots and descendants) and their comm; refreshed by [`Self::refresh`].
    pids: BTreeMap<u32, Process>,
    known: HashMap<u64, Known>,
    /// Open connections by inode.
    open: HashMap<u64, Connection>,
    /// Order in which open connections were first seen (inodes).
    order: Vec<u64>,
    closed: VecDeque<Connection>,
    closed_dropped: u64,
    listening: BTreeMap<u64, Listener>,
    started_ns: u64,
    last_dump_ns: u64,
    samples: u64,
    dumps: u64,
    warnings: Vec<String>,
}

/// Most warnings kept (the first ones; a repeated problem is said once).
const MAX_WARNINGS: usize = 32;

/// The error for a process whose descriptors cannot be listed.
fn fd_error(pid: u32, e: anyhow::Error) -> anyhow::Error {
    // procfs says `Permission Denied: /proc/PID/fd`, io errors `Permission denied`.
    if format!("{e:#}")
        .to_lowercase()
        .contains("permission denied")
    {
        e.context(format!(
            "cannot read /proc/{pid}/fd: the tcpinfo mode needs it to find the process's \
             sockets; run spice-observer as the process's user or as root"
        ))
    } else {
        e
    }
}

/// The socket descriptors of `pid`: (fd number, inode).
fn socket_fds(pid: u32) -> Result<Vec<(i32, u64)>> {
    let process = procfs::process::Process::new(
        i32::try_from(pid).with_context(|| format!("pid {pid} is out of range"))?,
    )
    .with_context(|| format!("process {pid}: cannot open /proc/{pid}"))?;
    let fds = process
        .fd()
        .with_context(|| format!("process {pid}: cannot list /proc/{pid}/fd"))?;
    let mut out = Vec::new();
    for fd in fds.flatten() {
        if let procfs::process::FDTarget::Socket(inode) = fd.target {
            out.push((fd.fd, inode));
        }
    }
    Ok(out)
}

/// The protocol name of the socket behind `/proc/PID/fd/FD`: its `system.sockprotoname`
/// extended attribute (`sockfs_xattr_get()`, net/socket.c: the `struct proto` name, `TCP`,
/// `TCPv6`, `UNIX`, `UDP`, `NETLINK`, …). `None` if it cannot be read (descriptor closed
/// meanwhile, or an error).
fn sock_proto_name(pid: u32, fd: i32) -> Option<String> {
    let path = std::ffi::CString::new(format!("/proc/{pid}/fd/{fd}")).ok()?;
    let name = c"system.sockprotoname";
    let mut buf = [0u8; 64];
    // SAFETY: getxattr writes at most buf.len() bytes into buf; both strings are NUL-ended.
    let n = unsafe {
        libc::getxattr(
            path.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return None;
    }
    let raw = &buf[..n as usize];
    let raw = raw.strip_suffix(&[0]).unwrap_or(raw);
    Some(String::from_utf8_lossy(raw).into_owned())
}

/// Whether a `system.sockprotoname` is one of TCP's (`TCP`, `TCPv6`; MPTCP's subflows are
/// TCP too but its own socket is not a sock_diag TCP socket).
fn is_tcp_proto(name: &str) -> bool {
    name == "TCP" || name == "TCPv6"
}

fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

impl Poller {
    /// Opens the sock_diag socket and checks that every root process's descriptors can be
    /// read. Errors: a root does not exist, its `/proc/PID/fd` cannot be read (the message
    /// says to run as its user or root), the sock_diag socket cannot be opened.
    pub fn new(roots: &[u32]) -> Result<Poller> {
        for &pid in roots {
            socket_fds(pid).map_err(|e| fd_error(pid, e))?;
        }
        let query = DiagQuery::new().context(
            "the tcpinfo mode needs a NETLINK_SOCK_DIAG socket (the kernel's inet_diag and \
             tcp_diag)",
        )?;
        let mut p = Poller {
            query,
            roots: roots.to_vec(),
            pids: BTreeMap::new(),
            known: HashMap::new(),
            open: HashMap::new(),
            order: Vec::new(),
            closed: VecDeque::new(),
            closed_dropped: 0,
            listening: BTreeMap::new(),
            started_ns: monotonic_ns(),
            last_dump_ns: 0,
            samples: 0,
            dumps: 0,
            warnings: Vec::new(),
        };
        p.refresh();
        Ok(p)
    }

    /// [`Self::sample`], its error kept as a warning (the next sample tries again).
    pub fn sample_or_warn(&mut self) {
        if let Err(e) = self.sample() {
            self.warn(format!("{e:#}"));
        }
    }

    fn warn(&mut self, w: String) {
        if self.warnings.len() < MAX_WARNINGS && !self.warnings.contains(&w) {
            log::warn!("{w}");
            self.warnings.push(w);
        }
    }

    /// Re-reads the process set: the roots and their descendants now; processes gone are
    /// kept, marked exited.
    pub fn refresh(&mut self) {
        let mut now: Vec<(u32, bool, u32)> = Vec::new();
        for &r in &self.roots {
            if sockdiag::comm(r).is_some() {
                now.push((r, true, r));
                now.extend(sockdiag::descendants(r).into_iter().map(|c| (c, false, r)));
            }
        }
        let alive: HashSet<u32> = now.iter().map(|(p, _, _)| *p).collect();
        for p in self.pids.values_mut() {
            if !alive.contains(&p.pid) {
                p.exited = true;
            }
        }
        for (pid, root, under) in now {
            let comm = sockdiag::comm(pid).unwrap_or_default();
            let e = self.pids.entry(pid).or_insert(Process {
                pid,
                comm: comm.clone(),
                root,
                under,
                exited: false,
            });
            e.exited = false;
            e.comm = comm;
            e.root = root;
            e.under = under;
        }
        // Bounded: a process that forks short-lived children all day keeps only those
        // alive, the roots, and the exited ones that held a connection still reported.
        if self.pids.len() > 4 * MAX_CLOSED {
            let keep: HashSet<u32> = self
                .open
                .values()
                .chain(self.closed.iter())
                .map(|c| c.pid)
                .collect();
            self.pids
                .retain(|pid, p| !p.exited || p.root || keep.contains(pid));
        }
    }

    /// Replaces the root processes (the daemon's targets as discovery finds them) and
    /// re-reads the process set (also when they are the same: their descendants change). Processes no longer under a root are dropped at once, and so
    /// are their connections (the daemon reports what is watched now).
    pub fn set_roots(&mut self, roots: Vec<u32>) {
        if roots == self.roots {
            self.refresh();
            return;
        }
        self.roots = roots;
        let keep: HashSet<u32> = self.roots.iter().copied().collect();
        self.pids.retain(|_, p| keep.contains(&p.under));
        self.refresh();
        let pids: HashSet<u32> = self.pids.keys().copied().collect();
        let dropped: Vec<u64> = self
            .open
            .iter()
            .filter(|(_, c)| !pids.contains(&c.pid))
            .map(|(i, _)| *i)
            .collect();
        for i in dropped {
            self.open.remove(&i);
            self.known.remove(&i);
            self.order.retain(|o| *o != i);
        }
        self.closed.retain(|c| pids.contains(&c.pid));
        self.listening.retain(|_, l| pids.contains(&l.pid));
    }

    /// The watched processes, by pid.
    pub fn processes(&self) -> &BTreeMap<u32, Process> {
        &self.pids
    }

    /// The open connections, in the order first seen.
    pub fn open_connections(&self) -> impl Iterator<Item = &Connection> {
        self.order.iter().filter_map(|i| self.open.get(i))
    }

    /// Forgets the closed connections (the daemon exports open ones only).
    pub fn clear_closed(&mut self) {
        self.closed.clear();
    }

    /// Whether every root process has exited.
    pub fn all_exited(&self) -> bool {
        self.roots.iter().all(|&r| sockdiag::comm(r).is_none())
    }

    /// Counts for the progress line: (open connections, closed kept).
    pub fn counts(&self) -> (usize, usize) {
        (self.open.len(), self.closed.len())
    }

    /// One sample: finds new TCP sockets, reads every known connection's state, closes those
    /// gone. Problems are kept as warnings; only a failing sock_diag dump or query is an
    /// error.
    pub fn sample(&mut self) -> Result<()> {
        let now = monotonic_ns();
        self.samples += 1;
        // inode -> pid, every socket descriptor of the watched processes.
        let mut held: HashMap<u64, u32> = HashMap::new();
        let pids: Vec<u32> = self
            .pids
            .values()
            .filter(|p| !p.exited)
            .map(|p| p.pid)
            .collect();
        let mut fresh_tcp = false;
        for pid in pids {
            let fds = match socket_fds(pid) {
                Ok(f) => f,
                Err(e) => {
                    // Gone since the last refresh, or not readable (a child that changed
                    // user): said once.
                    if sockdiag::comm(pid).is_some() {
                        self.warn(format!("{:#}", fd_error(pid, e)));
                    }
                    continue;
                }
            };
            for (fd, inode) in fds {
                if held.insert(inode, pid).is_some() {
                    continue;
                }
                if let std::collections::hash_map::Entry::Vacant(e) = self.known.entry(inode) {
                    let tcp = sock_proto_name(pid, fd).is_none_or(|n| is_tcp_proto(&n));
                    e.insert(if tcp {
                        fresh_tcp = true;
                        Known::Pending(now)
                    } else {
                        Known::Other
                    });
                }
            }
        }
        // Sockets whose descriptor went: connections close, the rest is forgotten.
        let gone: Vec<u64> = self
            .known
            .keys()
            .filter(|i| !held.contains_key(i))
            .copied()
            .collect();
        for inode in &gone {
            if let Some(Known::Conn) = self.known.remove(inode) {
                // One last look: a socket just closed may still exist (FIN_WAIT, LAST_ACK).
                self.close(*inode, now, true)?;
            }
            self.listening.remove(inode);
        }
        // New TCP sockets: one dump finds their addresses by inode.
        let pending: Vec<(u64, u64)> = self
            .known
            .iter()
            .filter_map(|(i, k)| match k {
                Known::Pending(since) => Some((*i, *since)),
                _ => None,
            })
            .collect();
        let eager = pending
            .iter()
            .any(|(_, since)| now.saturating_sub(*since) < PENDING_EAGER.as_nanos() as u64);
        let due = now.saturating_sub(self.last_dump_ns) >= 1_000_000_000;
        if !pending.is_empty() && (fresh_tcp || eager || due) {
            self.dumps += 1;
            self.last_dump_ns = now;
            let dump = self.query.dump().context("tcpinfo: sock_diag dump")?;
            let by_inode: HashMap<u64, &DiagSocket> = dump
                .iter()
                .filter(|d| d.inode != 0)
                .map(|d| (d.inode, d))
                .collect();
            for (inode, _) in pending {
                let Some(d) = by_inode.get(&inode) else {
                    continue;
                };
                let pid = held[&inode];
                let comm = self
                    .pids
                    .get(&pid)
                    .map(|p| p.comm.clone())
                    .unwrap_or_default();
                if d.state == TCP_LISTEN {
                    self.known.insert(inode, Known::Listener);
                    self.listening.insert(
                        inode,
                        Listener {
                            pid,
                            comm,
                            local: d.local.to_string(),
                        },
                    );
                    continue;
                }
                self.known.insert(inode, Known::Conn);
                let g = Gauges::from_diag(d, None);
                let t = secs(now - self.started_ns);
                self.open.insert(
                    inode,
                    Connection {
                        pid,
                        comm,
                        cookie: d.cookie,
                        inode,
                        local: d.local.to_string(),
                        remote: d.remote.to_string(),
                        open: true,
                        first_seen_s: t,
                        last_seen_s: t,
                        closed_s: None,
                        closed_how: None,
                        samples: 0,
                        max_send_queue: g.send_queue,
                        max_recv_queue: g.recv_queue,
                        max_notsent_bytes: g.notsent_bytes,
                        max_srtt_us: g.srtt_us,
                        first: g.clone(),
                        last: g,
                        acked_during_run: 0,
                        received_during_run: 0,
                        send_rate_bps: 0.0,
                        recv_rate_bps: 0.0,
                        addrs: Some((d.local, d.remote)),
                    },
                );
                self.order.push(inode);
            }
        }
        // Every connection's state now.
        let ask: Vec<u64> = self
            .order
            .iter()
            .filter(|i| self.open.contains_key(i))
            .copied()
            .collect();
        let keys: Vec<(u64, SocketAddr, SocketAddr)> = ask
            .iter()
            .filter_map(|i| {
                let c = &self.open[i];
                let (l, r) = c.addrs?;
                Some((c.cookie, l, r))
            })
            .collect();
        let answers = self
            .query
            .sockets(&keys)
            .context("tcpinfo: sock_diag query")?;
        let t = secs(now - self.started_ns);
        let mut vanished = Vec::new();
        for (inode, answer) in ask.iter().zip(answers) {
            match answer {
                Some(d) => {
                    if let Some(c) = self.open.get_mut(inode) {
                        c.update(&d, t);
                    }
                }
                None => vanished.push(*inode),
            }
        }
        for inode in vanished {
            // Its descriptor is still held (a reset connection in CLOSE): not TCP to look
            // for any more, until the descriptor goes.
            self.known.insert(inode, Known::Other);
            self.close(inode, now, false)?;
        }
        Ok(())
    }

    /// Moves an open connection to the closed ones (after a last query when `look`).
    fn close(&mut self, inode: u64, now: u64, look: bool) -> Result<()> {
        let Some(mut c) = self.open.remove(&inode) else {
            return Ok(());
        };
        self.order.retain(|i| *i != inode);
        let t = secs(now - self.started_ns);
        let mut how = "socket freed".to_string();
        if look && let Some((l, r)) = c.addrs {
            how = match self.query.socket(c.cookie, l, r) {
                Ok(Some(d)) => {
                    c.update(&d, t);
                    format!("descriptor closed, socket in {}", state_name(d.state))
                }
                Ok(None) => "descriptor closed, socket freed".into(),
                Err(e) => {
                    self.warn(format!("tcpinfo: last query of {}: {e:#}", c.local));
                    "descriptor closed".into()
                }
            };
        }
        c.closed_how = Some(how);
        c.open = false;
        c.closed_s = Some(t);
        self.closed.push_back(c);
        while self.closed.len() > MAX_CLOSED {
            self.closed.pop_front();
            self.closed_dropped += 1;
        }
        Ok(())
    }

    /// The report as of now.
    pub fn report(&self, sample_ms: u64, started_realtime_ns: u64) -> Report {
        let mut connections: Vec<Connection> = self
            .order
            .iter()
            .filter_map(|i| self.open.get(i).cloned())
            .collect();
        connections.extend(self.closed.iter().cloned());
        let mut processes: Vec<Process> = self.pids.values().cloned().collect();
        for p in &mut processes {
            if sockdiag::comm(p.pid).is_none() {
                p.exited = true;
            }
        }
        Report {
            hook_set: HOOK_SET.into(),
            framing: false,
            note: NO_FRAMING.into(),
            version: env!("CARGO_PKG_VERSION").into(),
            duration_s: secs(monotonic_ns() - self.started_ns),
            sample_ms,
            samples: self.samples,
            dumps: self.dumps,
            started_realtime_ns,
            processes,
            listening: self.listening.values().cloned().collect(),
            connections,
            closed_dropped: self.closed_dropped,
            warnings: self.warnings.clone(),
        }
    }
}

impl Connection {
    fn update(&mut self, d: &DiagSocket, t: f64) {
        self.last = Gauges::from_diag(d, Some(&self.last));
        self.samples += 1;
        self.last_seen_s = t;
        let g = &self.last;
        self.max_send_queue = self.max_send_queue.max(g.send_queue);
        self.max_recv_queue = self.max_recv_queue.max(g.recv_queue);
        self.max_notsent_bytes = self.max_notsent_bytes.max(g.notsent_bytes);
        self.max_srtt_us = self.max_srtt_us.max(g.srtt_us);
        self.acked_during_run = g.bytes_acked.saturating_sub(self.first.bytes_acked);
        self.received_during_run = g.bytes_received.saturating_sub(self.first.bytes_received);
        let span = self.last_seen_s - self.first_seen_s;
        if span > 0.0 {
            self.send_rate_bps = self.acked_during_run as f64 * 8.0 / span;
            self.recv_rate_bps = self.received_during_run as f64 * 8.0 / span;
        }
    }
}

/// Bytes for the table: `B`, `KiB`, `MiB`, `GiB`.
fn bytes(n: u64) -> String {
    const K: f64 = 1024.0;
    let f = n as f64;
    if f < K {
        format!("{n} B")
    } else if f < K * K {
        format!("{:.1} KiB", f / K)
    } else if f < K * K * K {
        format!("{:.1} MiB", f / (K * K))
    } else {
        format!("{:.2} GiB", f / (K * K * K))
    }
}

/// Bits per second for the table.
fn rate(bps: f64) -> String {
    if bps >= 1e6 {
        format!("{:.1} Mbit/s", bps / 1e6)
    } else if bps >= 1e3 {
        format!("{:.0} kbit/s", bps / 1e3)
    } else {
        format!("{bps:.0} bit/s")
    }
}

/// The end-of-run table.
pub fn render(r: &Report) -> String {
    let mut s = format!("spice-observer: {}\n", r.note);
    let procs: Vec<String> = r
        .processes
        .iter()
        .map(|p| {
            format!(
                "{} ({}){}",
                p.pid,
                p.comm,
                if p.exited { ", exited" } else { "" }
            )
        })
        .collect();
    s += &format!(
        "hook set tcpinfo (no BPF), {:.1} s, {} samples every {} ms; processes: {}\n",
        r.duration_s,
        r.samples,
        r.sample_ms,
        if procs.is_empty() {
            "-".into()
        } else {
            procs.join(", ")
        }
    );
    if !r.listening.is_empty() {
        s += &format!(
            "listening: {}\n",
            r.listening
                .iter()
                .map(|l| format!("{} (pid {})", l.local, l.pid))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let open = r.connections.iter().filter(|c| c.open).count();
    s += &format!(
        "connections: {} open, {} closed during the run{}\n",
        open,
        r.connections.len() - open,
        if r.closed_dropped > 0 {
            format!(" ({} older closed ones not kept)", r.closed_dropped)
        } else {
            String::new()
        }
    );
    for c in &r.connections {
        let g = &c.last;
        s += &format!(
            "  pid {} {} {} -> {}  {}{}\n",
            c.pid,
            c.comm,
            c.local,
            c.remote,
            g.state,
            match c.closed_s {
                Some(t) => format!(
                    " at the last sample; closed at {t:.1} s ({})",
                    c.closed_how.as_deref().unwrap_or("?")
                ),
                None => String::new(),
            }
        );
        s += &format!(
            "      acked {} (+{} seen, {}), received {} (+{} seen, {}), sent {}, retransmitted {}\n",
            bytes(g.bytes_acked),
            bytes(c.acked_during_run),
            rate(c.send_rate_bps),
            bytes(g.bytes_received),
            bytes(c.received_during_run),
            rate(c.recv_rate_bps),
            bytes(g.bytes_sent),
            bytes(g.bytes_retrans),
        );
        s += &format!(
            "      send queue {} (max {}), not sent {} (max {}), unacked {} seg, recv queue {} (max {}); \
             cwnd {}, srtt {:.2} ms (max {:.2}), delivery {}, retrans {} total\n",
            bytes(u64::from(g.send_queue)),
            bytes(u64::from(c.max_send_queue)),
            bytes(u64::from(g.notsent_bytes)),
            bytes(u64::from(c.max_notsent_bytes)),
            g.unacked,
            bytes(u64::from(g.recv_queue)),
            bytes(u64::from(c.max_recv_queue)),
            g.snd_cwnd,
            f64::from(g.srtt_us) / 1e3,
            f64::from(c.max_srtt_us) / 1e3,
            rate(g.delivery_rate as f64 * 8.0),
            g.total_retrans,
        );
    }
    for w in &r.warnings {
        s += &format!("warning: {w}\n");
    }
    s
}

/// Options observe accepts that need BPF, refused in this mode with the reason.
fn refuse_bpf_options(opts: &ObserveOptions) -> Result<()> {
    let why = "needs SPICE framing, which the tcpinfo mode does not do";
    if opts.plot.is_some() {
        bail!("--plot {why}");
    }
    if opts.samples.is_some() {
        bail!("--samples {why}");
    }
    if opts.dump_events.is_some() {
        bail!("--dump-events has no kernel records to write in the tcpinfo mode (no BPF)");
    }
    Ok(())
}

/// Runs `observe --hook-set tcpinfo` with `opts` (its `pin_dir` and `tls_hooks` have no
/// effect: nothing is loaded).
pub async fn run(opts: ObserveOptions, roots: Vec<u32>) -> Result<()> {
    refuse_bpf_options(&opts)?;
    let stdout_json = opts.json.as_ref().is_some_and(|p| p.as_os_str() == "-");
    if let Some(p) = opts.json.as_ref().filter(|p| p.as_os_str() != "-") {
        std::fs::File::create(p)
            .with_context(|| format!("cannot write the JSON report to {}", p.display()))?;
    }
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let started_realtime_ns = crate::pipeline::realtime_ns();
    let mut poller = Poller::new(&roots)?;
    eprintln!("spice-observer: {NO_FRAMING}; nothing is loaded into the kernel");
    eprintln!(
        "spice-observer: watching {} (hook set tcpinfo); {}",
        roots
            .iter()
            .map(|p| format!("pid {p} ({})", sockdiag::comm(*p).unwrap_or_default()))
            .collect::<Vec<_>>()
            .join(", "),
        match opts.duration {
            Some(d) => format!("{:.0} s", d.as_secs_f64()),
            None => "until Ctrl-C".into(),
        }
    );
    let sample_ms = opts.sample.as_millis() as u64;
    let mut sample = tokio::time::interval(opts.sample);
    sample.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let deadline = tokio::time::sleep(opts.duration.unwrap_or(Duration::from_secs(u64::MAX / 4)));
    tokio::pin!(deadline);
    let mut ticks = 0u64;
    let mut all_exited = false;
    loop {
        tokio::select! {
            _ = sample.tick() => poller.sample_or_warn(),
            _ = tick.tick() => {
                ticks += 1;
                poller.refresh();
                if !all_exited && poller.all_exited() {
                    all_exited = true;
                    eprintln!("spice-observer: every watched process has exited");
                    if opts.duration.is_none() {
                        break;
                    }
                }
                if opts.progress && ticks.is_multiple_of(5) {
                    let (open, closed) = poller.counts();
                    eprintln!(
                        "[{:6.1}s] {open} connection(s) open, {closed} closed (tcpinfo: no framing)",
                        ticks as f64
                    );
                }
            }
            _ = &mut deadline => break,
            _ = sigint.recv() => break,
            _ = sigterm.recv() => break,
        }
    }
    // A last sample, so that the report is as of the end.
    poller.sample_or_warn();
    let rep = poller.report(sample_ms, started_realtime_ns);
    let table = render(&rep);
    if stdout_json {
        eprint!("{table}");
    } else {
        print!("{table}");
    }
    match &opts.json {
        Some(p) if p.as_os_str() == "-" => println!("{}", serde_json::to_string_pretty(&rep)?),
        Some(p) => write_json(p, &rep)?,
        None => {}
    }
    Ok(())
}

fn write_json(p: &Path, rep: &Report) -> Result<()> {
    std::fs::write(p, serde_json::to_string_pretty(rep)?)
        .with_context(|| format!("writing {}", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::process::{Command, Stdio};

    /// A child process (`python3`) that listens, accepts one connection from this test,
    /// reads N bytes and echoes them, then waits on its stdin: the poller watches it and
    /// finds the listener, then the connection with the bytes each side counted, then the
    /// connection closed with its last state.
    #[test]
    fn poller_follows_a_child_connection_to_its_close() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let script = format!(
            "import socket,sys\n\
             s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
             s.bind(('127.0.0.1',{port})); s.listen(1); print('ready', flush=True)\n\
             c,_=s.accept(); n=0\n\
             while n < 5000:\n    d=c.recv(65536); n+=len(d); c.sendall(d)\n\
             sys.stdin.readline(); c.close(); sys.stdin.readline()\n"
        );
        let mut child = Command::new("python3")
            .args(["-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut ready = [0u8; 6];
        child
            .stdout
            .as_mut()
            .unwrap()
            .read_exact(&mut ready)
            .unwrap();
        let mut p = Poller::new(&[child.id()]).unwrap();
        p.sample().unwrap();
        let r = p.report(10, 0);
        assert_eq!(r.listening.len(), 1, "{r:#?}");
        assert_eq!(r.listening[0].local, format!("127.0.0.1:{port}"));
        assert!(r.connections.is_empty());

        let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
        c.write_all(&[1u8; 5000]).unwrap();
        let mut back = vec![0u8; 5000];
        c.read_exact(&mut back).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let conn = loop {
            p.sample().unwrap();
            let r = p.report(10, 0);
            if let Some(conn) = r.connections.first().filter(|c| c.last.bytes_acked >= 5000) {
                break conn.clone();
            }
            assert!(std::time::Instant::now() < deadline, "{r:#?}");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(conn.open);
        assert_eq!(conn.last.state, "ESTABLISHED");
        assert_eq!(conn.remote, c.local_addr().unwrap().to_string());
        assert_eq!(conn.last.bytes_received, 5000);
        assert!((5000..=5001).contains(&conn.last.bytes_acked), "{conn:?}");
        assert!(conn.last.bytes_sent >= 5000);
        assert!(conn.last.snd_cwnd > 0 && conn.last.srtt_us > 0, "{conn:?}");

        // The child closes its end: the connection is reported closed, with its last state.
        child.stdin.as_mut().unwrap().write_all(b"\n").unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let closed = loop {
            p.sample().unwrap();
            let r = p.report(10, 0);
            if let Some(conn) = r.connections.first().filter(|c| !c.open) {
                break conn.clone();
            }
            assert!(std::time::Instant::now() < deadline, "{r:#?}");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(closed.closed_s.is_some());
        assert!(
            closed
                .closed_how
                .as_deref()
                .is_some_and(|h| h.starts_with("descriptor closed")),
            "{closed:?}"
        );
        assert!((5000..=5001).contains(&closed.last.bytes_acked));
        assert_ne!(closed.last.state, "ESTABLISHED", "{closed:?}");
        let r = p.report(10, 0);
        assert_eq!(r.hook_set, "tcpinfo");
        assert!(!r.framing);
        assert!(render(&r).contains("no SPICE framing"));
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Another user's process (pid 1 as a non-root user): the error says what to do. As root
    /// every `/proc/PID/fd` is readable, so there is nothing to check.
    #[test]
    fn an_unreadable_process_says_to_run_as_its_user() {
        if unsafe { libc::geteuid() } == 0 {
            return;
        }
        let e = Poller::new(&[1])
            .err()
            .expect("pid 1's fds are not readable");
        let msg = format!("{e:#}");
        assert!(
            msg.contains("run spice-observer as the process's user or as root"),
            "{msg}"
        );
    }

    #[test]
    fn a_process_that_does_not_exist_is_an_error() {
        let e = Poller::new(&[i32::MAX as u32]).err().unwrap();
        assert!(format!("{e:#}").contains(&(i32::MAX).to_string()), "{e:#}");
    }
}
