//! Chains and stages: where each of spice-server's in-flight messages is right now.
//!
//! A chain follows one SPICE channel from spice-server's socket `S`, optionally through a relay
//! ("proxy"): its leg toward spice-server `B` (the same TCP connection as `S`, seen from the
//! other end) and its leg toward the client `C` (the socket in the same process that carries the
//! same channel). A byte-transparent relay forwards the stream unchanged, so a byte's stream
//! offset is the same on `S` (sent), `B` (received) and `C` (sent): every in-flight message can
//! be placed by comparing its last byte's offset with each socket's positions.
//!
//! Stages, in chain order (a message is in the first stage whose position its last byte has not
//! passed yet):
//!
//! | stage | message end beyond | meaning |
//! |---|---|---|
//! | `server_writing` | S written (`write_seq`) | started by spice-server, not all written |
//! | `server_notsent` | S `snd_nxt` | in qemu's socket, not yet sent |
//! | `server_unacked` | S `snd_una` | sent, not acknowledged by the peer's TCP |
//! | `proxy_recv_queue` | B read (`copied_seq`) | in the relay's receive queue |
//! | `proxy_inside` | C written | read by the relay, not yet written toward the client |
//! | `proxy_notsent` | C `snd_nxt` | in the relay's send queue toward the client |
//! | `client_unacked` | C `snd_una` | sent toward the client (incl. a shaper's qdisc), not TCP-acknowledged |
//! | `client_owes_ack` | — | TCP-acknowledged by the client, not yet covered by a SPICE ACK |
//!
//! Without a relay the stages are `server_writing`, `server_notsent`, `server_unacked` and
//! `client_owes_ack`. Behind a relay that is not byte-transparent only the server-side stages
//! and `proxy_recv_queue` can be placed; the rest are counted as unplaced.
//!
//! Which messages are in flight ([`inflight`]): the newest `count` server → client messages of
//! spice-server's socket, `count` being the kernel's in-flight count (`model/window.rs`)
//! (SET_ACK included, since the SET_ACK counts itself: `docs/spice-protocol.md` §3.2). So the
//! SET_ACK message itself is in the set, as its oldest member, from the moment it starts until
//! the first matching ACK subtracts W, which drops the oldest W: the SET_ACK and the W − 1
//! messages after it. From then on the set still holds one message more than the client has
//! left unacknowledged by its own counting: with spice-gtk's cadence (an ACK after every W
//! messages following the SET_ACK, §3.8) that is the message whose arrival triggered the last
//! ACK, typically placed in `client_owes_ack`. A second SET_ACK restarts the set at that SET_ACK
//! (count 1); after a surplus ACK the count, and so the set, is empty (§3.5).

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
};

use spice_ebpf_common::{event::dir, protocol::channel};

use super::{
    DirStats, Model, MsgSpan, SocketModel,
    hist::{CountHist, LogHist},
};

/// Stage names, in chain order (JSON keys of `stages`).
pub const STAGES: [&str; 8] = [
    "server_writing",
    "server_notsent",
    "server_unacked",
    "proxy_recv_queue",
    "proxy_inside",
    "proxy_notsent",
    "client_unacked",
    "client_owes_ack",
];
/// Index of `client_owes_ack` in [`STAGES`].
pub const CLIENT_OWES_ACK: usize = 7;
/// Stages placeable without a relay.
pub const NO_RELAY_STAGES: [usize; 4] = [0, 1, 2, CLIENT_OWES_ACK];

/// Positions of a socket's sending side, as stream offsets (bytes since the first byte).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendPos {
    /// Bytes the application has written (`write_seq`).
    pub written: u64,
    /// Bytes sent (`snd_nxt`).
    pub snd_nxt: u64,
    /// Bytes acknowledged by the peer's TCP (`snd_una`).
    pub snd_una: u64,
}

/// Positions of a socket's receiving side, as stream offsets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecvPos {
    /// Bytes arrived (`rcv_nxt`).
    pub rcv_nxt: u64,
    /// Bytes the application has read (`copied_seq`).
    pub copied: u64,
}

/// Where the stage boundaries are for one sample.
#[derive(Clone, Copy, Debug)]
pub enum Boundaries {
    /// No relay: spice-server's socket only.
    Direct { server: SendPos },
    /// A byte-transparent relay: all stages.
    Relay {
        server: SendPos,
        backend: RecvPos,
        client: SendPos,
    },
    /// A relay that changes the stream: stages up to `proxy_recv_queue`.
    OpaqueRelay { server: SendPos, backend: RecvPos },
}

/// One placement of the in-flight messages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// Messages per stage ([`STAGES`] order).
    pub counts: [u32; 8],
    /// Bytes of the in-flight byte range per stage.
    pub bytes: [u64; 8],
    /// Messages that could not be placed (behind a relay that changes the stream, or more
    /// in flight than messages kept).
    pub unplaced: u32,
    /// Stage thresholds whose position [`place`] had to clamp because it disagreed with the
    /// data path's order or lay beyond the newest in-flight message's end (positions read at
    /// different instants). A lagging acknowledgement is not counted.
    pub clamped: u32,
}

impl Placement {
    /// Messages placed.
    pub fn placed(&self) -> u32 {
        self.counts.iter().sum()
    }
}

impl Boundaries {
    /// Indexes into [`STAGES`] that a placement against these boundaries fills: every stage
    /// through a byte-transparent relay, the server side and `proxy_recv_queue` behind an
    /// opaque one (the rest is unplaced), [`NO_RELAY_STAGES`] without a relay.
    pub fn stages(&self) -> &'static [usize] {
        match self {
            Boundaries::Direct { .. } => &NO_RELAY_STAGES,
            Boundaries::Relay { .. } => &[0, 1, 2, 3, 4, 5, 6, 7],
            Boundaries::OpaqueRelay { .. } => &[0, 1, 2, 3],
        }
    }
}

/// Places `inflight` (the messages spice-server counts as in flight, oldest first) against the
/// stage boundaries `b`. Every message lands in exactly one stage or in `unplaced`, so the
/// counts add up to `inflight.len()` by construction (that sum is no check of anything).
///
/// The thresholds, in chain order: S written, S `snd_nxt`, S `snd_una`, B read, C written,
/// C `snd_nxt`, C `snd_una`. At any one instant the data path orders them (S written ≥
/// S `snd_nxt` ≥ S `snd_una`; S `snd_nxt` ≥ B read ≥ C written ≥ C `snd_nxt` ≥ C `snd_una`)
/// and none lies beyond the end of the newest in-flight message; a position beyond that means
/// the readings are of different instants (the sock_diag dump and the map reads are not one),
/// and it is clamped, never reordered, and counted in
/// [`Placement::clamped`]. Not counted: S `snd_una` below B read (an acknowledgement lagging
/// behind the data, a delayed ACK: the message stays in `server_unacked`, the first stage whose
/// position its last byte has not passed) and positions before the oldest in-flight message's
/// start (bytes not counted in flight, e.g. the link phase; they move no message).
pub fn place(inflight: &[MsgSpan], b: &Boundaries) -> Placement {
    let mut p = Placement::default();
    let (Some(first), Some(last)) = (inflight.first(), inflight.last()) else {
        return p;
    };
    // Thresholds in chain order, each paired with the stage a message beyond it is in.
    let mut th: [(u64, usize); 7] = [(0, 0); 7];
    let n = match *b {
        Boundaries::Direct { server } => {
            th[..3].copy_from_slice(&[
                (server.written, 0),
                (server.snd_nxt, 1),
                (server.snd_una, 2),
            ]);
            3
        }
        Boundaries::Relay {
            server,
            backend,
            client,
        } => {
            th.copy_from_slice(&[
                (server.written, 0),
                (server.snd_nxt, 1),
                (server.snd_una, 2),
                (backend.copied, 3),
                (client.written, 4),
                (client.snd_nxt, 5),
                (client.snd_una, 6),
            ]);
            7
        }
        Boundaries::OpaqueRelay { server, backend } => {
            th[..4].copy_from_slice(&[
                (server.written, 0),
                (server.snd_nxt, 1),
                (server.snd_una, 2),
                (backend.copied, 3),
            ]);
            4
        }
    };
    // 1. Disagreements, clamped and counted: a position beyond its predecessor on the data
    // path (S written ≥ S snd_nxt ≥ S snd_una, S snd_nxt ≥ B read ≥ C written ≥ C snd_nxt ≥
    // C snd_una) or beyond the newest in-flight message's end cannot be at one instant with
    // the others and with the count.
    let (lo, hi) = (first.at, last.end);
    for i in 0..n {
        let upper = match (i, th[i].1) {
            (0, _) => hi,
            // B read follows what S sent, not what S saw acknowledged.
            (_, 3) => th[1].0,
            _ => th[i - 1].0,
        };
        if th[i].0 > upper {
            p.clamped += 1;
            th[i].0 = upper;
        }
    }
    // 2. The first-stage rule: an acknowledgement may lag behind the data (the relay has read
    // bytes S has not seen acknowledged yet: a delayed ACK), and such a message stays in the
    // earlier stage. A position before the oldest message's start (bytes not counted in
    // flight: the link phase, messages that left the count) moves no message. Neither is a
    // disagreement; neither is counted.
    let mut prev = hi;
    for t in th[..n].iter_mut() {
        t.0 = t.0.clamp(lo, prev);
        prev = t.0;
    }
    let opaque = matches!(b, Boundaries::OpaqueRelay { .. });
    for m in inflight {
        match th[..n].iter().find(|(pos, _)| m.end > *pos) {
            Some(&(_, stage)) => p.counts[stage] += 1,
            None if opaque => p.unplaced += 1,
            None => p.counts[CLIENT_OWES_ACK] += 1,
        }
    }
    let mut upper = hi;
    for &(pos, stage) in &th[..n] {
        p.bytes[stage] = upper - pos;
        upper = pos;
    }
    if !opaque {
        p.bytes[CLIENT_OWES_ACK] = upper - lo;
    }
    p
}

/// Whether the relay leg forwards the stream unchanged.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Transparency {
    /// No relay, or nothing compared yet.
    #[default]
    Unknown,
    /// Every message compared so far sits at the same offset with the same type and size.
    Transparent { compared: u64 },
    /// The relay inserted, dropped or changed a message.
    Changed {
        direction: &'static str,
        index: u64,
        detail: String,
    },
}

/// One channel's chain.
#[derive(Clone, Debug)]
pub struct Chain {
    /// spice-server's socket (cookie).
    pub server: u64,
    /// The relay's socket toward spice-server, if found.
    pub backend: Option<u64>,
    /// The relay's socket toward the client carrying the same channel, if found.
    pub client_leg: Option<u64>,
    /// How the legs were paired, for the report.
    pub pairing: Vec<String>,
    pub transparency: Transparency,
    /// Messages compared per direction ([server→client, client→server]).
    checked: [u64; 2],
    /// Statistics over every sample since the chain was found (bounded: see [`ChainStats`]).
    pub stats: ChainStats,
    /// `tcp_info` of the client-facing socket at the first and latest sample.
    pub link_info: Option<(crate::sockdiag::TcpInfo, crate::sockdiag::TcpInfo)>,
    /// While the client leg is not paired: what is known about each candidate leg.
    candidates: Vec<Candidate>,
    /// How the relay's legs line up, per direction ([server→client: read on the backend,
    /// written on the client leg; client→server: read on the client leg, written on the
    /// backend]): zero for legs paired on their link message (both traced from their first
    /// byte), the delta found for legs joined mid-stream ([`Align`]: by content, and for
    /// server→client by the TCP byte counters); `None` while not known (no client leg, or a
    /// joined client→server direction whose content repeats).
    pub align: [Option<Align>; 2],
}

/// How one direction of a relay's two legs lines up: the message the relay wrote on one leg
/// with ordinal `i` at stream offset `o` is the one it read on the other with ordinal
/// `i + index` at offset `o + offset`. Legs traced from their first byte have both 0; legs
/// joined mid-stream count ordinals from their own lock and offsets from their own first
/// traced byte, so they differ by constants: found by content ([`alignments`]) and, for
/// server→client, by the kernel's byte counters ([`Chain::learn_stream_start`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Align {
    pub index: i64,
    pub offset: i64,
}

/// One sample of a chain.
#[derive(Clone, Copy, Debug)]
pub struct ChainSample {
    /// CLOCK_MONOTONIC ns.
    pub t_ns: u64,
    /// spice-server's in-flight count (its `messages_window`).
    pub in_flight: i64,
    /// The count a relay-side observer would report (the window rule on the relay's leg
    /// toward spice-server), if a relay.
    pub relay_visible: Option<i64>,
    /// Where the in-flight messages are; `None` when the sockets' TCP positions were not
    /// available (e.g. a socket in another network namespace).
    pub placement: Option<Placement>,
    /// How many of the `in_flight` messages the agent still kept to place ([`inflight`]):
    /// fewer than `in_flight` means the rest are in `unplaced`.
    pub kept: u64,
    /// Stream offset of the last byte TCP-acknowledged on the client-facing link.
    pub delivered: Option<u64>,
}

/// What the report needs of a chain's samples, accumulated as they are taken: counters, the
/// first and last values, and bounded histograms ([`super::hist`]), so the state does not grow
/// with the number of samples.
#[derive(Clone, Debug, Default)]
pub struct ChainStats {
    /// Samples taken, and those with a placement (every socket's position available).
    pub samples: usize,
    pub placed: usize,
    /// Per stage ([`STAGES`] order), over the placed samples: messages (exact up to
    /// [`super::window::HISTOGRAM_MAX`], exact maximum) and bytes of the in-flight range (8
    /// significant bits, [`LogHist`]). A stage a placement did not fill counts 0.
    pub stage_counts: [CountHist; 8],
    pub stage_bytes: [LogHist; 8],
    /// The newest placement.
    pub last_placement: Option<Placement>,
    /// Placed samples with a clamped boundary, and the most boundaries clamped at one.
    pub clamped_samples: usize,
    pub clamped_max: u32,
    /// Samples where fewer in-flight messages were kept than counted.
    pub kept_short_samples: usize,
    /// Most messages unplaced at one placed sample.
    pub unplaced_max: u32,
    /// Placed samples with a relay-visible count, and among them those where it was above
    /// spice-server's count, below it, and below it by the upstream stages (± 1).
    pub with_relay: usize,
    pub relay_above: usize,
    pub relay_below: usize,
    pub gap_upstream: usize,
    /// The relay-visible count at the newest sample.
    pub last_relay_visible: Option<i64>,
    /// (CLOCK_MONOTONIC ns, stream offset) of the first and newest sample with a delivered
    /// position on the client-facing link.
    pub first_delivered: Option<(u64, u64)>,
    pub last_delivered: Option<(u64, u64)>,
    /// Non-zero `tcpi_delivery_rate` samples of the client-facing socket, bytes/s (8
    /// significant bits), and the newest one: the kernel's measurement of what the link
    /// delivers.
    pub delivery_rates: LogHist,
    pub last_delivery_rate: Option<u64>,
}

impl ChainStats {
    /// Adds one sample.
    pub fn add(&mut self, s: &ChainSample) {
        self.samples += 1;
        if (s.kept as i64) < s.in_flight {
            self.kept_short_samples += 1;
        }
        self.last_relay_visible = s.relay_visible;
        if let Some(d) = s.delivered {
            self.first_delivered.get_or_insert((s.t_ns, d));
            self.last_delivered = Some((s.t_ns, d));
        }
        let Some(p) = s.placement else { return };
        self.placed += 1;
        for i in 0..STAGES.len() {
            self.stage_counts[i].add(p.counts[i]);
            self.stage_bytes[i].add(p.bytes[i]);
        }
        self.last_placement = Some(p);
        if p.clamped > 0 {
            self.clamped_samples += 1;
        }
        self.clamped_max = self.clamped_max.max(p.clamped);
        self.unplaced_max = self.unplaced_max.max(p.unplaced);
        if let Some(r) = s.relay_visible {
            let t = s.in_flight;
            self.with_relay += 1;
            if r > t {
                self.relay_above += 1;
            }
            if r < t {
                self.relay_below += 1;
            }
            let upstream: i64 = p.counts[..4].iter().map(|&v| v as i64).sum();
            if ((t - r) - upstream).abs() <= 1 {
                self.gap_upstream += 1;
            }
        }
    }

    /// Adds one non-zero delivery rate sample (bytes/s).
    pub fn add_delivery_rate(&mut self, rate: u64) {
        self.delivery_rates.add(rate);
        self.last_delivery_rate = Some(rate);
    }
}

impl Chain {
    fn new(server: u64) -> Self {
        Self {
            server,
            backend: None,
            client_leg: None,
            pairing: Vec::new(),
            transparency: Transparency::Unknown,
            checked: [0, 0],
            stats: ChainStats::default(),
            link_info: None,
            candidates: Vec::new(),
            align: [None, None],
        }
    }

    /// False once the relay was seen inserting, dropping or rewriting a message.
    pub fn is_transparent(&self) -> bool {
        !matches!(self.transparency, Transparency::Changed { .. })
    }

    /// What to add to an offset of the client leg's sending side to get the offset of the
    /// same byte in spice-server's stream: the server→client alignment ([`Align::offset`],
    /// client leg → backend) plus the backend's `seq_base` less spice-server's (backend →
    /// spice-server: one TCP connection). 0 for legs traced from their first byte; `None`
    /// without an alignment, or for joined legs without both bases. When that connection is
    /// TLS, both ends count plaintext offsets: the same offsets when both were traced from the
    /// first plaintext byte (both saw the link phase), else the delta their marks give at a
    /// TCP position where a call of each ended ([`tls_delta`]).
    pub fn client_shift(&self, model: &Model) -> Option<i64> {
        let a = self.align[0]?;
        let (b, s) = (
            model.sockets.get(&self.backend?),
            model.sockets.get(&self.server),
        );
        if b.is_some_and(|x| x.is_tls()) || s.is_some_and(|x| x.is_tls()) {
            let (b, s) = (b?, s?);
            if linked(b) && linked(s) {
                return Some(a.offset);
            }
            let delta = tls_delta(&s.dirs[s.s2c()?], &b.dirs[b.s2c()?])?;
            return Some(a.offset + delta);
        }
        let base = |c: u64| {
            let s = model.sockets.get(&c)?;
            s.dirs[s.s2c()?].seq_base
        };
        match (base(self.backend?), base(self.server)) {
            (Some(b), Some(s)) => Some(a.offset + i64::from(b.wrapping_sub(s) as i32)),
            // Legs paired on their link message: both traced from the stream's first byte.
            _ if a == Align::default() => Some(0),
            _ => None,
        }
    }

    /// The relay's legs toward clients still candidates for this chain's client leg (legs
    /// joined mid-stream: [`Self::learn_stream_start`] wants their positions).
    pub fn candidate_legs(&self) -> Vec<u64> {
        self.candidates.iter().map(|k| k.cookie).collect()
    }

    /// Takes one sample's absolute stream offsets (bytes since the connection's first byte)
    /// of the first traced byte of the backend's server→client reads (`backend_start`) and of
    /// candidate leg `cookie`'s server→client writes (`leg_start`). A transparent relay
    /// forwards the stream from its first byte, so a byte at absolute offset p is at
    /// `p − backend_start` on the backend and `p − leg_start` on the leg: the alignment's
    /// offset delta is `leg_start − backend_start`. Taken once two consecutive samples gave
    /// the same value; a different one starts the count again.
    pub fn learn_stream_start(&mut self, cookie: u64, backend_start: i64, leg_start: i64) {
        let Some(k) = self.candidates.iter_mut().find(|k| k.cookie == cookie) else {
            return;
        };
        let d = leg_start - backend_start;
        k.tcp_offset = match k.tcp_offset {
            Some((v, n)) if v == d => Some((v, n.saturating_add(1))),
            _ => Some((d, 1)),
        };
    }

    /// Indexes into [`STAGES`] this chain can place: all of them through a byte-transparent
    /// relay whose two legs are paired, the server side up to the relay's receive queue when
    /// the relay changes the stream (or its client leg is not found yet), [`NO_RELAY_STAGES`]
    /// without a relay.
    pub fn placeable_stages(&self) -> Vec<usize> {
        match (
            self.backend.is_some(),
            self.client_leg.is_some() && self.is_transparent(),
        ) {
            (false, _) => NO_RELAY_STAGES.to_vec(),
            (true, true) => (0..STAGES.len()).collect(),
            (true, false) => vec![0, 1, 2, 3],
        }
    }
}

/// Whether a socket's offsets count from the stream's first byte: its link message (or the
/// map's record of it, after a restart) was parsed, which only happens at offset 0.
fn linked(s: &SocketModel) -> bool {
    s.dirs.iter().any(|d| d.link.is_some())
}

/// Marks of both ends agreeing on this many TCP positions fix the plaintext delta of a TLS
/// connection joined mid-stream ([`tls_delta`]).
const TLS_DELTA_AGREE: usize = 2;

/// For one TLS connection seen from both ends, each joined mid-stream (offsets from its own
/// first traced plaintext byte): spice-server's plaintext offset less the relay's at the
/// same byte. Where an SSL_write of spice-server ended at TCP position X (its mark's
/// `write_seq`) and the relay's reads ended there too (its marks' `copied_seq` = X; several
/// SSL_reads of one record share it, the last holds the most plaintext), both had moved
/// the same plaintext. Taken when the newest [`TLS_DELTA_AGREE`] such positions agree;
/// `None` otherwise (no common position kept yet, or disagreement: a read that ended
/// inside a call's records).
pub fn tls_delta(server: &DirStats, relay: &DirStats) -> Option<i64> {
    let (st, rt) = (server.tls.as_ref()?, relay.tls.as_ref()?);
    let newest = st.marks.back()?.seq;
    let rel = |x: u32| x.wrapping_sub(newest) as i32;
    let mut found: Vec<i64> = Vec::new();
    // Relay marks newest first; the last one at each seq is the one with the most plaintext.
    let mut prev: Option<u32> = None;
    for m in rt.marks.iter().rev() {
        if prev == Some(m.seq) {
            continue;
        }
        prev = Some(m.seq);
        // The newest server mark at or before that seq; it must end exactly there.
        let i = st.marks.partition_point(|x| rel(x.seq) <= rel(m.seq));
        if let Some(x) = i.checked_sub(1).and_then(|i| st.marks.get(i))
            && x.seq == m.seq
        {
            found.push(x.plain_end as i64 - m.plain_end as i64);
            if found.len() == TLS_DELTA_AGREE {
                break;
            }
        }
    }
    (found.len() == TLS_DELTA_AGREE && found.iter().all(|&d| d == found[0])).then(|| found[0])
}

fn same_ip(a: std::net::SocketAddr, b: std::net::SocketAddr) -> bool {
    a.ip().to_canonical() == b.ip().to_canonical() && a.port() == b.port()
}

/// Processes that act as relays: they hold a SPICE socket on the client end (they connected to
/// a SPICE server). Every other watched process's server-end sockets head a chain.
pub fn relay_pids(model: &Model) -> HashSet<u32> {
    model
        .sockets
        .values()
        .filter(|s| s.is_server_end() == Some(false))
        .map(|s| s.pid)
        .collect()
}

/// The kept message with ordinal `index` of a direction: from the recent ring, or from the
/// first [`super::FINGERPRINT`] messages once the ring has dropped it.
fn kept(d: &DirStats, index: u64) -> Option<MsgSpan> {
    if let Some(m) = d.by_index(index) {
        return Some(*m);
    }
    if d.first.last().is_none_or(|m| m.index < index) {
        return None;
    }
    d.first.iter().find(|m| m.index == index).copied()
}

/// What pairing knows about one candidate client leg of a chain whose client leg is not
/// paired yet: a server-end socket of the backend's relay process, not paired with another
/// chain, that carries the same link message as the backend.
#[derive(Clone, Debug)]
struct Candidate {
    cookie: u64,
    /// Highest message ordinal examined, per direction ([server→client, client→server]).
    upto: [u64; 2],
    /// Messages compared and found equal, per direction (ordinals no longer kept on either
    /// leg are skipped, not counted).
    agreed: [u64; 2],
    /// Main channel: the MAIN_INIT session id was seen on both legs and is the same.
    same_session: bool,
    /// Why this leg cannot be the chain's (the first disagreement), once found.
    excluded: Option<String>,
    /// Legs joined mid-stream (no link message): per direction, the alignments still
    /// possible ([`alignments`]), each with the messages compared under it; `None` until
    /// both legs framed a message in that direction.
    aligns: [Option<Vec<(Align, u64)>>; 2],
    /// Legs joined mid-stream: the server→client offset delta ([`Align::offset`]) the TCP
    /// byte counters give ([`Chain::learn_stream_start`]): (value, samples that gave it).
    tcp_offset: Option<(i64, u32)>,
}

impl Candidate {
    fn new(cookie: u64) -> Self {
        Self {
            cookie,
            upto: [0, 0],
            agreed: [0, 0],
            same_session: false,
            excluded: None,
            aligns: [None, None],
            tcp_offset: None,
        }
    }

    /// Things compared and found equal: messages, and the session id.
    fn evidence(&self) -> u64 {
        self.agreed[0] + self.agreed[1] + u64::from(self.same_session)
    }

    /// "the same MAIN_INIT session id and the same first N server→client and M
    /// client→server messages", or "" when nothing was compared.
    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if self.same_session {
            parts.push("the same MAIN_INIT session id".to_string());
        }
        if self.agreed != [0, 0] {
            parts.push(format!(
                "the same {} server→client and {} client→server message(s)",
                self.agreed[0], self.agreed[1]
            ));
        }
        parts.join(" and ")
    }
}

/// Compares, from ordinal `*upto + 1`, what a relay read on one leg (`read`) with what it
/// wrote on the other (`written`). A byte-transparent relay writes message `i` at the same
/// offset with the same type and size as it read it, and cannot write a message before it
/// has read it: records of one connection's read precede those of its write in the ring,
/// since a message is reported once its header has been framed, and the relay can only write
/// header bytes it has read. Advances `*upto` to the last message both legs have framed
/// (the rest is still in the relay) and counts the equal ones in `*agreed`; returns the first
/// disagreement. Each ordinal is examined once, so the cost over a chain's life is the number
/// of messages compared, not messages × samples.
fn compare_dir(
    read: &DirStats,
    written: &DirStats,
    upto: &mut u64,
    agreed: &mut u64,
) -> Result<(), String> {
    if written.last_index > read.last_index {
        return Err(format!(
            "message {} written before it was read (the other leg has read {})",
            written.last_index, read.last_index
        ));
    }
    // Ordinals between the first messages and the ring's oldest are kept on neither leg.
    let first_end = |d: &DirStats| d.first.last().map_or(0, |m| m.index);
    let ring_start = |d: &DirStats| d.recent.front().map_or(u64::MAX, |m| m.index);
    let gap_end = ring_start(read)
        .max(ring_start(written))
        .min(written.last_index + 1);
    let gap_start = first_end(read).min(first_end(written));
    while *upto < written.last_index {
        let i = *upto + 1;
        if i > gap_start && i < gap_end {
            *upto = gap_end - 1;
            continue;
        }
        if let (Some(r), Some(w)) = (kept(read, i), kept(written, i)) {
            if (r.at, r.end, r.msg_type) != (w.at, w.end, w.msg_type) {
                return Err(format!(
                    "message {i} written as type {} at offset {} ({} bytes), read as type {} at offset {} ({} bytes)",
                    w.msg_type,
                    w.at,
                    w.end - w.at,
                    r.msg_type,
                    r.at,
                    r.end - r.at
                ));
            }
            *agreed += 1;
        }
        *upto = i;
    }
    Ok(())
}

/// Compares what is new since the last call between a chain's `backend` and one candidate
/// client leg `leg`: the MAIN_INIT session id (main channel), the server→client messages
/// (read on the backend, written on the leg) and the client→server messages (read on the
/// leg, written on the backend). Returns why the leg cannot be the chain's.
fn examine(
    backend: &SocketModel,
    leg: &SocketModel,
    is_main: bool,
    k: &mut Candidate,
) -> Result<(), String> {
    if is_main {
        // Both are set from the MAIN_INIT the relay read and wrote (`SocketModel::session_id`).
        match (backend.session_id, leg.session_id) {
            (Some(b), Some(c)) if b != c => {
                return Err(format!(
                    "MAIN_INIT session id {c:#x}, the backend's is {b:#x}"
                ));
            }
            (Some(_), Some(_)) => k.same_session = true,
            _ => {}
        }
    }
    if let (Some(bd), Some(cd)) = (backend.s2c(), leg.s2c()) {
        compare_dir(
            &backend.dirs[bd],
            &leg.dirs[cd],
            &mut k.upto[0],
            &mut k.agreed[0],
        )
        .map_err(|e| format!("server→client {e}"))?;
    }
    if let (Some(bd), Some(cd)) = (backend.c2s(), leg.c2s()) {
        compare_dir(
            &leg.dirs[cd],
            &backend.dirs[bd],
            &mut k.upto[1],
            &mut k.agreed[1],
        )
        .map_err(|e| format!("client→server {e}"))?;
    }
    Ok(())
}

/// Messages a run must cover to align two legs joined mid-stream: fewer only if fewer are
/// kept on the written leg.
const MIN_RUN: u64 = 8;

/// The kept messages of a direction, oldest first: the first [`super::FINGERPRINT`] ones not
/// in the ring any more, then the ring.
fn kept_all(d: &DirStats) -> impl Iterator<Item = &MsgSpan> {
    let front = d.recent.front().map_or(u64::MAX, |m| m.index);
    d.first
        .iter()
        .filter(move |m| m.index < front)
        .chain(d.recent.iter())
}

/// The kept message of a direction starting at stream offset `at`.
fn kept_at(d: &DirStats, at: i64) -> Option<MsgSpan> {
    let at = u64::try_from(at).ok()?;
    let i = d.recent.partition_point(|m| m.at < at);
    d.recent.get(i).filter(|m| m.at == at).copied()
}

/// Compares written message `w` with the read message `a` maps it to: `Ok(false)` when that
/// one is not kept (nothing compared), `Ok(true)` when type, size and offset agree, and the
/// disagreement otherwise. A mapped ordinal beyond the newest read is a message written
/// before it was read: impossible for a relay.
fn compare_at(read: &DirStats, w: &MsgSpan, a: Align) -> Result<bool, String> {
    let ri = w.index as i64 + a.index;
    if ri > read.last_index as i64 {
        return Err(format!(
            "message {} would have been written before it was read",
            w.index
        ));
    }
    let Some(r) = u64::try_from(ri).ok().and_then(|i| kept(read, i)) else {
        return Ok(false);
    };
    if (r.end - r.at, r.msg_type) != (w.end - w.at, w.msg_type)
        || r.at as i64 - w.at as i64 != a.offset
    {
        return Err(format!(
            "message {} written as type {} at offset {} ({} bytes), read {ri} as type {} at offset {} ({} bytes)",
            w.index,
            w.msg_type,
            w.at,
            w.end - w.at,
            r.msg_type,
            r.at,
            r.end - r.at
        ));
    }
    Ok(true)
}

/// Newest messages compared under each alignment when the set is started ([`alignments`]):
/// bounds the start's cost; an alignment not contradicted by them stays possible, so fewer
/// comparisons can only delay a pairing, never make one.
const START_COMPARE: u64 = 64;

/// Most messages a relay is taken to hold that it read before its other leg locked:
/// alignments needing more are not considered. Below the ring's size, so that a distinct
/// message on either leg is still kept on the other when it is compared ([`advance`]).
const HOLD_MAX: i64 = super::RECENT as i64 / 2;

/// Every alignment ([`Align`]) of a joined direction's written messages with its read ones
/// that content and order allow, each with the messages compared under it. Its ordinal delta
/// lies between two bounds: at most `read.last_index − written.last_index` (a relay cannot
/// write a message before it has read it: its read records precede its write records in the
/// ring, as in [`compare_dir`]) and at least the delta mapping the newest written message
/// [`HOLD_MAX`] messages below the oldest read one still in the ring. Alignments that map
/// the newest written messages below what the read leg framed (the relay still writing what
/// it read before that leg locked) cannot be compared yet and stay possible, with nothing
/// compared, until [`advance`] compares them. An alignment is left out when one of the
/// newest [`START_COMPARE`] messages kept on both legs under it differs in type, size or
/// offset delta (the offset delta being that of the newest message compared). `None` while
/// either leg has framed nothing.
fn alignments(read: &DirStats, written: &DirStats) -> Option<Vec<(Align, u64)>> {
    let rf = read.recent.front()?.index as i64;
    written.recent.back()?;
    let (rl, wl) = (read.last_index as i64, written.last_index as i64);
    let (lo, hi) = (rf - wl - HOLD_MAX, rl - wl);
    let ws: Vec<MsgSpan> = kept_all(written).copied().collect();
    let mut out = Vec::new();
    'delta: for index in lo..=hi {
        let mut a = Align { index, offset: 0 };
        let mut n = 0;
        for w in ws.iter().rev() {
            let ri = w.index as i64 + index;
            if ri < 1 || n >= START_COMPARE {
                break;
            }
            let Some(r) = kept(read, ri as u64) else {
                continue;
            };
            if n == 0 {
                a.offset = r.at as i64 - w.at as i64;
            }
            match compare_at(read, w, a) {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(_) => continue 'delta,
            }
        }
        out.push((a, n));
    }
    Some(out)
}

/// Extends the comparison of the alignments `set` to the written messages after ordinal
/// `*upto`, dropping those a message contradicts. An alignment nothing was compared under
/// yet takes its offset delta from its first message kept on both legs.
fn advance(read: &DirStats, written: &DirStats, set: &mut Vec<(Align, u64)>, upto: &mut u64) {
    let new: Vec<MsgSpan> = kept_all(written)
        .filter(|m| m.index > *upto)
        .copied()
        .collect();
    set.retain_mut(|(a, n)| {
        for w in &new {
            let ri = w.index as i64 + a.index;
            if ri > read.last_index as i64 {
                return false;
            }
            if *n == 0 {
                match u64::try_from(ri).ok().and_then(|i| kept(read, i)) {
                    Some(r) => a.offset = r.at as i64 - w.at as i64,
                    None => continue,
                }
            }
            match compare_at(read, w, *a) {
                Ok(true) => *n += 1,
                Ok(false) => {}
                Err(_) => return false,
            }
        }
        true
    });
    *upto = written.last_index.max(*upto);
}

/// Compares what is new between a chain's `backend` and a candidate client leg `leg`, both
/// joined mid-stream (no link message): per direction, starts the set of possible alignments
/// ([`alignments`]) once both legs framed a message, then extends it ([`advance`]). Returns
/// why the leg cannot be the chain's (no alignment left in a direction).
fn examine_joined(
    backend: &SocketModel,
    leg: &SocketModel,
    k: &mut Candidate,
) -> Result<(), String> {
    // (direction, relay reads from, relay writes to)
    let dirs = [
        (
            "server→client",
            backend.s2c().map(|d| &backend.dirs[d]),
            leg.s2c().map(|d| &leg.dirs[d]),
        ),
        (
            "client→server",
            leg.c2s().map(|d| &leg.dirs[d]),
            backend.c2s().map(|d| &backend.dirs[d]),
        ),
    ];
    let mut err = None;
    for (i, (name, read, written)) in dirs.into_iter().enumerate() {
        let (Some(read), Some(written)) = (read, written) else {
            continue;
        };
        if i == 0
            && let Some((offset, 2..)) = k.tcp_offset
            && k.aligns[0]
                .as_ref()
                .is_none_or(|s| s.len() != 1 || s[0].0.offset != offset)
        {
            // The TCP byte counters fix the offset delta: the ordinal delta is that of the
            // read message at the newest written one's offset.
            let a = written.recent.iter().rev().find_map(|w| {
                let r = kept_at(read, w.at as i64 + offset)?;
                Some(Align {
                    index: r.index as i64 - w.index as i64,
                    offset,
                })
            });
            if let Some(a) = a {
                k.aligns[0] = Some(vec![(a, 0)]);
                k.upto[0] = 0;
            }
        }
        match &mut k.aligns[i] {
            Some(set) if !set.is_empty() => advance(read, written, set, &mut k.upto[i]),
            // Nothing fitted: the relay may still have been writing what it read before the
            // other leg locked. Started again once it wrote more.
            Some(_) if written.last_index < k.upto[i] + RESTART_AFTER => {}
            slot => {
                *slot = alignments(read, written);
                k.upto[i] = written.last_index;
            }
        }
        if let Some(set) = &k.aligns[i] {
            k.agreed[i] = set.iter().map(|x| x.1).max().unwrap_or(0);
            if set.is_empty() {
                err.get_or_insert(format!(
                    "{name}: no alignment of its newest written messages (up to {}) with the {} read fits type, size and order",
                    written.last_index, read.last_index
                ));
            }
        }
    }
    err.map_or(Ok(()), Err)
}

/// Written messages after which a direction whose alignments all failed is started again.
const RESTART_AFTER: u64 = 64;

/// The alignment of a joined candidate's direction `i`, if exactly one is left and enough
/// was compared under it ([`MIN_RUN`], or every written message kept if fewer).
fn unique_align(k: &Candidate, written: Option<&DirStats>, i: usize) -> Option<Align> {
    let [(a, n)] = k.aligns[i].as_deref()? else {
        return None;
    };
    let need = written.map_or(MIN_RUN, |w| (kept_all(w).count() as u64).min(MIN_RUN));
    (*n >= need.max(1)).then_some(*a)
}

/// The link message fields a relay forwards unchanged: channel type, channel id,
/// connection_id, common caps, link size.
fn link_key(s: &SocketModel) -> Option<(u8, u8, u32, u32, u32)> {
    let l = s.c2s().and_then(|d| s.dirs[d].link)?;
    Some((
        l.channel_type,
        l.channel_id,
        l.connection_id,
        l.common_caps,
        l.link_size,
    ))
}

fn sock_name(s: &SocketModel) -> String {
    match (s.local, s.remote) {
        (Some(l), Some(r)) => format!("{l}->{r}"),
        _ => format!("cookie {}", s.cookie),
    }
}

/// Whether a socket was joined mid-stream: a direction hunts or locked.
fn joined(s: &SocketModel) -> bool {
    s.dirs
        .iter()
        .any(|d| d.hunting.is_some() || d.locked.is_some())
}

/// Whether spice-server's socket `server` and a relay socket `b` carry the same
/// server→client bytes by TCP sequence number (`seq_base` + offset): the newest message `b`
/// read, mapped into `server`'s stream, must be a message `server` wrote with the same type
/// and size, and not beyond what it wrote. `None` when that cannot be told (no message on
/// either side, or the mapped offset older than what `server` keeps).
fn same_seq_space(server: &SocketModel, b: &SocketModel) -> Option<bool> {
    if server.is_tls() || b.is_tls() {
        // Offsets of plaintext, no `seq_base`: sequence numbers cannot tell.
        return None;
    }
    let sd = &server.dirs[server.s2c()?];
    let bd = &b.dirs[b.s2c()?];
    let m = bd.recent.back()?;
    let seq = bd.seq_base?.wrapping_add(m.at as u32);
    let at = crate::pipeline::sampler::stream_pos(sd, seq)?;
    if at >= sd.recent.back()?.end {
        // Bytes spice-server never wrote (its records precede the relay's read of them).
        return Some(false);
    }
    if at < sd.recent.front()?.at {
        return None;
    }
    let i = sd.recent.partition_point(|x| x.at < at);
    Some(
        sd.recent.get(i).is_some_and(|x| {
            x.at == at && x.end - x.at == m.end - m.at && x.msg_type == m.msg_type
        }),
    )
}

/// Prefix of the pairing note kept while a chain waits for its client leg.
const WAITING: &str = "client leg not paired yet: ";

/// The sockets that may be some chain's backend (client ends: the watched process connected
/// to a SPICE server), indexed by what pairs them with spice-server's socket: by their
/// addresses (local, remote; IPv4-mapped addresses as IPv4) and by the sequence base of their
/// server→client direction. Built once per [`pair`], so that each chain looking for its
/// backend looks at the few sockets with its mirrored addresses or its sequence base, not at
/// every socket.
struct Backends<'m> {
    by_addr: HashMap<(SocketAddr, SocketAddr), Vec<&'m SocketModel>>,
    by_seq: HashMap<u32, Vec<&'m SocketModel>>,
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

impl<'m> Backends<'m> {
    fn new(model: &'m Model) -> Self {
        let mut by_addr: HashMap<(SocketAddr, SocketAddr), Vec<&SocketModel>> = HashMap::new();
        let mut by_seq: HashMap<u32, Vec<&SocketModel>> = HashMap::new();
        for b in model.sockets.values() {
            if b.is_server_end() != Some(false) {
                continue;
            }
            if let (Some(l), Some(r)) = (b.local, b.remote) {
                by_addr
                    .entry((canonical(l), canonical(r)))
                    .or_default()
                    .push(b);
            }
            if let Some(seq) = b.s2c().and_then(|d| b.dirs[d].seq_base) {
                by_seq.entry(seq).or_default().push(b);
            }
        }
        Backends { by_addr, by_seq }
    }

    fn is_empty(&self) -> bool {
        self.by_addr.is_empty() && self.by_seq.is_empty()
    }

    /// The possible backends of `server`: those at its mirrored addresses, then those with
    /// the sequence base `seq`.
    fn of(&self, server: &SocketModel, seq: Option<u32>) -> impl Iterator<Item = &'m SocketModel> {
        let mirrored = match (server.local, server.remote) {
            (Some(l), Some(r)) => self.by_addr.get(&(canonical(r), canonical(l))),
            _ => None,
        };
        let same_seq = seq.and_then(|q| self.by_seq.get(&q));
        mirrored
            .into_iter()
            .flatten()
            .chain(same_seq.into_iter().flatten())
            .copied()
    }
}

/// Finds and extends chains: new server sockets get a chain; unpaired chains look for their
/// relay legs. Call after applying records; cheap when everything is paired: one pass over
/// the sockets, then per chain still looking for its backend a lookup of the sockets at its
/// mirrored addresses or with its sequence base ([`Backends`]), not a pass over every socket.
pub fn pair(model: &Model, chains: &mut Vec<Chain>) {
    let relays = relay_pids(model);
    let known: HashSet<u64> = chains.iter().map(|c| c.server).collect();
    for s in model.sockets.values() {
        if s.is_server_end() == Some(true) && !relays.contains(&s.pid) && !known.contains(&s.cookie)
        {
            chains.push(Chain::new(s.cookie));
        }
    }
    // The relays' legs toward clients (server-end sockets of relay processes), listed only
    // if a chain still looks for its client leg; the possible backends, only if a chain
    // still looks for its backend.
    let mut legs: Option<Vec<&SocketModel>> = None;
    let mut backends: Option<Backends> = None;
    let mut used: HashSet<u64> = chains
        .iter()
        .flat_map(|c| [c.backend, c.client_leg])
        .flatten()
        .collect();
    for chain in chains.iter_mut() {
        let Some(server) = model.sockets.get(&chain.server) else {
            continue;
        };
        if chain.backend.is_none() {
            // Same TCP connection from the other end: mirrored addresses; the TCP sequence
            // numbers of the server's sending side must match the relay's receiving side.
            let server_seq = server.s2c().and_then(|d| server.dirs[d].seq_base);
            let index = backends.get_or_insert_with(|| Backends::new(model));
            let mut possible = if index.is_empty() {
                None
            } else {
                Some(index.of(server, server_seq))
            };
            let found = possible.iter_mut().flatten().find(|b| {
                if used.contains(&b.cookie) {
                    return false;
                }
                let addr_ok = match (server.local, server.remote, b.local, b.remote) {
                    (Some(sl), Some(sr), Some(bl), Some(br)) => same_ip(sl, br) && same_ip(sr, bl),
                    _ => false,
                };
                let b_seq = b.s2c().and_then(|d| b.dirs[d].seq_base);
                if joined(server) || joined(b) {
                    // Offset 0 is each socket's first traced byte: the bases differ by what
                    // was in flight at the join; the messages' sequence numbers must agree.
                    return addr_ok && same_seq_space(server, b) != Some(false);
                }
                let seq_ok = matches!((server_seq, b_seq), (Some(x), Some(y)) if x == y);
                let seq_differ = matches!((server_seq, b_seq), (Some(x), Some(y)) if x != y);
                (addr_ok && !seq_differ) || seq_ok
            });
            if let Some(b) = found {
                chain.backend = Some(b.cookie);
                used.insert(b.cookie);
                let b_seq = b.s2c().and_then(|d| b.dirs[d].seq_base);
                chain.pairing.push(format!(
                    "backend: relay pid {} socket {} is the same TCP connection ({}{})",
                    b.pid,
                    b.local.map(|a| a.to_string()).unwrap_or_default(),
                    if server.local.is_some() {
                        "mirrored addresses"
                    } else {
                        ""
                    },
                    if server_seq.is_some() && server_seq == b_seq {
                        ", same sequence numbers"
                    } else if same_seq_space(server, b) == Some(true) {
                        ", joined mid-stream: a message at the same sequence number on both"
                    } else {
                        ""
                    },
                ));
            }
        }
        let Some(backend) = chain.backend.and_then(|b| model.sockets.get(&b)) else {
            continue;
        };
        if chain.client_leg.is_none() {
            let legs = legs.get_or_insert_with(|| {
                model
                    .sockets
                    .values()
                    .filter(|x| x.is_server_end() == Some(true) && relays.contains(&x.pid))
                    .collect()
            });
            pair_client_leg(model, legs, backend, chain, &mut used);
        }
    }
    for chain in chains.iter_mut() {
        check_transparency(model, chain);
    }
}

/// Looks for the client leg of `chain` (whose backend is `backend`) among the relay's legs
/// `legs` not in `used`. Candidates are the legs of the backend's process that carry the
/// same link message. A transparent relay forwards every message unchanged, so the chain's
/// leg agrees with the backend on everything compared ([`examine`]); a candidate that
/// disagrees once is excluded for good. Pairs when exactly one candidate exists (the leg
/// that carried the link message is always among them: the relay read it before it wrote it
/// to the backend), or when exactly one candidate remains consistent and something was
/// compared on it. Otherwise (a tie: several legs agree on everything so far, e.g. two
/// sessions' main channels with connection_id 0 and equal first messages) it waits, and
/// keeps a note of why in `chain.pairing`.
fn pair_client_leg(
    model: &Model,
    legs: &[&SocketModel],
    backend: &SocketModel,
    chain: &mut Chain,
    used: &mut HashSet<u64>,
) {
    let Some(b_link) = link_key(backend) else {
        pair_joined_leg(model, legs, backend, chain, used);
        return;
    };
    let cands = refresh_candidates(legs, backend, chain, used, |c| link_key(c) == Some(b_link));
    let is_main = b_link.0 == channel::MAIN;
    for c in &cands {
        let k = candidate(chain, c.cookie);
        if k.excluded.is_none() {
            k.excluded = examine(backend, c, is_main, k).err();
        }
    }
    let name = |cookie: u64| sock_label(model, cookie);
    let live: Vec<&Candidate> = chain
        .candidates
        .iter()
        .filter(|k| k.excluded.is_none())
        .collect();
    let (pick, note) = if let [only] = chain.candidates.as_slice() {
        let mut why = format!(
            "client leg: relay socket {} is relay pid {}'s only unpaired leg with the same link message",
            name(only.cookie),
            backend.pid
        );
        let same = only.describe();
        if !same.is_empty() {
            why += &format!(", and carries {same}");
        }
        if let Some(e) = &only.excluded {
            why += &format!("; but its stream differs ({e}): the relay changes it");
        }
        (Some(only.cookie), why)
    } else if let [one] = live.as_slice()
        && one.evidence() > 0
    {
        let others: Vec<String> = chain
            .candidates
            .iter()
            .filter_map(|k| Some(format!("{}: {}", name(k.cookie), k.excluded.as_ref()?)))
            .collect();
        (
            Some(one.cookie),
            format!(
                "client leg: relay socket {} carries the same link message and {}; the {} other leg(s) of relay pid {} with that link message differ ({})",
                name(one.cookie),
                one.describe(),
                others.len(),
                backend.pid,
                others.join("; ")
            ),
        )
    } else if chain.candidates.is_empty() {
        (
            None,
            format!(
                "{WAITING}no unpaired leg of relay pid {} carries the same link message",
                backend.pid
            ),
        )
    } else if live.is_empty() {
        (
            None,
            format!(
                "{WAITING}all {} legs of relay pid {} with the same link message differ from the backend",
                chain.candidates.len(),
                backend.pid
            ),
        )
    } else {
        let names: Vec<String> = live
            .iter()
            .map(|k| format!("{} ({})", name(k.cookie), k.evidence()))
            .collect();
        (
            None,
            format!(
                "{WAITING}{} legs of relay pid {} agree with the backend on everything compared so far (things compared in parentheses): {}",
                live.len(),
                backend.pid,
                names.join(", ")
            ),
        )
    };
    set_note(&mut chain.pairing, note);
    if let Some(c) = pick {
        chain.client_leg = Some(c);
        chain.align = [Some(Align::default()); 2];
        used.insert(c);
        chain.candidates = Vec::new();
    }
}

/// The relay's legs `legs` that may be `chain`'s client leg: of the backend's process, not
/// the backend, not paired with another chain (`used`), and `same_kind` (carrying the
/// backend's link message, or none for a joined backend). Drops the candidates of `chain`
/// that no longer qualify and returns the qualifying legs.
fn refresh_candidates<'m>(
    legs: &[&'m SocketModel],
    backend: &SocketModel,
    chain: &mut Chain,
    used: &HashSet<u64>,
    same_kind: impl Fn(&SocketModel) -> bool,
) -> Vec<&'m SocketModel> {
    let cands: Vec<&SocketModel> = legs
        .iter()
        .copied()
        .filter(|c| {
            c.pid == backend.pid
                && c.cookie != backend.cookie
                && !used.contains(&c.cookie)
                && same_kind(c)
        })
        .collect();
    chain
        .candidates
        .retain(|k| cands.iter().any(|c| c.cookie == k.cookie));
    cands
}

/// `chain`'s candidate entry for leg `cookie`, added if new.
fn candidate(chain: &mut Chain, cookie: u64) -> &mut Candidate {
    let i = match chain.candidates.iter().position(|k| k.cookie == cookie) {
        Some(i) => i,
        None => {
            chain.candidates.push(Candidate::new(cookie));
            chain.candidates.len() - 1
        }
    };
    &mut chain.candidates[i]
}

/// The addresses of socket `cookie` for pairing notes (`cookie N` if it is gone).
fn sock_label(model: &Model, cookie: u64) -> String {
    model
        .sockets
        .get(&cookie)
        .map(sock_name)
        .unwrap_or_else(|| format!("cookie {cookie}"))
}

/// Records the pairing note of this round in a chain's `pairing`: a note that the chain is
/// still waiting replaces the previous waiting note, so the list does not grow while it waits.
fn set_note(pairing: &mut Vec<String>, note: String) {
    if pairing.last().is_some_and(|p| p.starts_with(WAITING)) {
        pairing.pop();
    }
    pairing.push(note);
}

/// [`pair_client_leg`] for a backend joined mid-stream (no link message). Candidates are the
/// unpaired server-end legs of the backend's process without a link message either. A
/// transparent relay writes on the chain's leg what it read on the backend, so under one
/// alignment of ordinals and offsets ([`Align`]) every message kept on both legs is the same
/// (type, size, offset): a candidate with no such alignment left in a direction is excluded
/// ([`examine_joined`]). Pairs when exactly one candidate is left and its server→client
/// alignment is unique (one delta left, [`MIN_RUN`] messages compared under it), the other
/// candidates being excluded; the client→server alignment is kept when unique too. Otherwise
/// it waits (a stream whose types and sizes repeat fits several deltas until a distinct
/// message, e.g. a PING, tells them apart) and keeps a note of why in `chain.pairing`.
fn pair_joined_leg(
    model: &Model,
    legs: &[&SocketModel],
    backend: &SocketModel,
    chain: &mut Chain,
    used: &mut HashSet<u64>,
) {
    let cands = refresh_candidates(legs, backend, chain, used, |c| link_key(c).is_none());
    for c in &cands {
        let k = candidate(chain, c.cookie);
        k.excluded = examine_joined(backend, c, k).err();
    }
    let name = |cookie: u64| sock_label(model, cookie);
    let live: Vec<&Candidate> = chain
        .candidates
        .iter()
        .filter(|k| k.excluded.is_none())
        .collect();
    let written = |k: &Candidate, i: usize| {
        let c = model.sockets.get(&k.cookie)?;
        let d = if i == 0 { c.s2c() } else { backend.c2s() };
        let s = if i == 0 { c } else { backend };
        d.map(|d| &s.dirs[d])
    };
    let describe = |k: &Candidate| {
        let part = |i: usize, what: &str| match (&k.aligns[i], unique_align(k, written(k, i), i)) {
            (_, Some(a)) => format!(
                "{what}: offset {:+}{}, ordinal {:+} ({} messages compared)",
                a.offset,
                if i == 0 && k.tcp_offset.is_some_and(|(v, n)| n >= 2 && v == a.offset) {
                    " (from the TCP byte counters)"
                } else {
                    ""
                },
                a.index,
                k.agreed[i]
            ),
            (Some(set), None) => format!("{what}: {} alignments fit", set.len()),
            (None, None) => format!("{what}: nothing framed on both legs yet"),
        };
        format!("{}; {}", part(0, "server→client"), part(1, "client→server"))
    };
    let excluded: Vec<String> = chain
        .candidates
        .iter()
        .filter_map(|k| Some(format!("{}: {}", name(k.cookie), k.excluded.as_ref()?)))
        .collect();
    let pick = match live.as_slice() {
        [one] => unique_align(one, written(one, 0), 0).map(|a| (*one, a)),
        _ => None,
    };
    let note = match (pick, live.as_slice()) {
        (Some((k, _)), _) => format!(
            "client leg: relay socket {} (joined mid-stream, no link message) is the only one of relay pid {}'s {} unpaired leg(s) without a link message whose messages line up with the backend's at a single alignment ({}){}",
            name(k.cookie),
            backend.pid,
            chain.candidates.len(),
            describe(k),
            if excluded.is_empty() {
                String::new()
            } else {
                format!("; the others differ ({})", excluded.join("; "))
            }
        ),
        (None, []) if chain.candidates.is_empty() => format!(
            "{WAITING}no unpaired leg of relay pid {} without a link message (the backend was joined mid-stream)",
            backend.pid
        ),
        (None, []) => format!(
            "{WAITING}none of the {} legs of relay pid {} without a link message lines up with the backend ({})",
            chain.candidates.len(),
            backend.pid,
            excluded.join("; ")
        ),
        (None, live) => format!(
            "{WAITING}{} leg(s) of relay pid {} without a link message still fit the backend's messages (joined mid-stream: aligned by content): {}",
            live.len(),
            backend.pid,
            live.iter()
                .map(|k| format!("{} ({})", name(k.cookie), describe(k)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    set_note(&mut chain.pairing, note);
    if let Some((k, a)) = pick {
        let c2s = unique_align(k, written(k, 1), 1);
        chain.client_leg = Some(k.cookie);
        chain.align = [Some(a), c2s];
        used.insert(k.cookie);
        chain.candidates = Vec::new();
    }
}

/// Compares what the relay read from spice-server with what it wrote toward the client (and
/// the other way round), message by message, for messages not compared yet.
fn check_transparency(model: &Model, chain: &mut Chain) {
    if !chain.is_transparent() {
        return;
    }
    let (Some(b), Some(c)) = (
        chain.backend.and_then(|x| model.sockets.get(&x)),
        chain.client_leg.and_then(|x| model.sockets.get(&x)),
    ) else {
        return;
    };
    // (direction name, relay reads from, relay writes to)
    let pairs = [
        (
            "server_to_client",
            b.s2c().map(|d| &b.dirs[d]),
            c.s2c().map(|d| &c.dirs[d]),
        ),
        (
            "client_to_server",
            c.c2s().map(|d| &c.dirs[d]),
            b.c2s().map(|d| &b.dirs[d]),
        ),
    ];
    for (k, (name, read, written)) in pairs.into_iter().enumerate() {
        let (Some(read), Some(written), Some(a)) = (read, written, chain.align[k]) else {
            continue;
        };
        while chain.checked[k] < written.last_index {
            let i = chain.checked[k] + 1;
            let Some(w) = written.by_index(i) else {
                chain.checked[k] = i;
                continue;
            };
            // The read ordinal of written message i; below 1: read before that leg locked.
            let ri = i as i64 + a.index;
            let mapped = u64::try_from(ri).ok().filter(|&r| r > 0);
            match mapped.and_then(|r| read.by_index(r)) {
                Some(r)
                    if r.at as i64 == w.at as i64 + a.offset
                        && r.end - r.at == w.end - w.at
                        && r.msg_type == w.msg_type => {}
                Some(r) => {
                    chain.transparency = Transparency::Changed {
                        direction: name,
                        index: i,
                        detail: format!(
                            "message {i} written as type {} at offset {} ({} bytes), read as type {} at offset {} ({} bytes)",
                            w.msg_type,
                            w.at,
                            w.end - w.at,
                            r.msg_type,
                            r.at,
                            r.end - r.at
                        ),
                    };
                    return;
                }
                None if ri > read.last_index as i64 => {
                    chain.transparency = Transparency::Changed {
                        direction: name,
                        index: i,
                        detail: format!(
                            "the relay wrote message {i} (type {}) before reading it",
                            w.msg_type
                        ),
                    };
                    return;
                }
                None => {}
            }
            chain.checked[k] = i;
        }
    }
    let compared = chain.checked[0] + chain.checked[1];
    if compared > 0 {
        chain.transparency = Transparency::Transparent { compared };
    }
}

/// The messages spice-server counts as in flight on socket `s`, oldest first: the last
/// `count` server→client messages it started. The SET_ACK counts itself, so it is the oldest
/// of the set until the first matching ACK takes the oldest W out (docs/spice-protocol.md §3.9).
/// Fewer if fewer are kept. On a joined connection whose count is an interval, the newest
/// low-end many: those known to be in flight ([`SocketModel::placement_count`]).
pub fn inflight(s: &SocketModel) -> Vec<MsgSpan> {
    let Some(d) = s.s2c() else { return Vec::new() };
    let count = s.placement_count() as usize;
    let recent = &s.dirs[d].recent;
    recent
        .iter()
        .skip(recent.len().saturating_sub(count))
        .copied()
        .collect()
}

/// Which direction index of a socket is the watched process's sending side.
pub const SEND: usize = dir::SEND as usize;
/// Which direction index is its receiving side.
pub const RECV: usize = dir::RECV as usize;

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(sizes: &[u64], start: u64) -> Vec<MsgSpan> {
        let mut at = start;
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let m = MsgSpan {
                    index: i as u64 + 1,
                    at,
                    end: at + n,
                    msg_type: 302,
                };
                at += n;
                m
            })
            .collect()
    }

    /// Both ends of one TLS connection joined mid-stream: spice-server counts plaintext
    /// from 1000 bytes earlier than the relay. Where a write's records end and the relay's
    /// reads of them end too (the last of several reads at one `copied_seq`), the offsets
    /// differ by that constant.
    #[test]
    fn tls_delta_from_marks_at_common_tcp_positions() {
        use crate::model::tls::{Mark, TlsDir};
        let mk = |marks: &[(u64, u32, u32)]| {
            let mut t = TlsDir::default();
            for &(plain_end, seq, len) in marks {
                t.push(Mark {
                    plain_end,
                    seq,
                    len,
                });
            }
            DirStats {
                tls: Some(t),
                ..Default::default()
            }
        };
        // spice-server: writes of 100, 200, 300 bytes (22 bytes of record each).
        let server = mk(&[(1100, 5122, 100), (1300, 5344, 200), (1600, 5666, 300)]);
        // The relay: the 200-byte record in two reads; the newest record not read yet.
        let relay = mk(&[(100, 5122, 100), (150, 5344, 50), (300, 5344, 150)]);
        assert_eq!(tls_delta(&server, &relay), Some(1000));
        // One common position is not enough.
        let one = mk(&[(300, 5344, 300)]);
        assert_eq!(tls_delta(&server, &one), None);
        // Reads that end inside a write's records share no position with it.
        let inside = mk(&[(50, 5100, 50), (250, 5300, 200)]);
        assert_eq!(tls_delta(&server, &inside), None);
        // Positions that disagree (a relay that dropped bytes): no delta.
        let bad = mk(&[(100, 5122, 100), (290, 5344, 190)]);
        assert_eq!(tls_delta(&server, &bad), None);
        // A plain direction has no marks.
        assert_eq!(tls_delta(&server, &DirStats::default()), None);
    }

    #[test]
    fn direct_placement_by_last_byte() {
        // Messages end at 110, 120, ..., 200.
        let m = msgs(&[10; 10], 100);
        let server = SendPos {
            written: 195,
            snd_nxt: 160,
            snd_una: 130,
        };
        let p = place(&m, &Boundaries::Direct { server });
        // end 200 > 195: writing; 170..190 > 160: notsent (3); 140..160 > 130: unacked (3);
        // 110..130: client owes the ACK (3).
        assert_eq!(p.counts, [1, 3, 3, 0, 0, 0, 0, 3]);
        assert_eq!(p.placed(), 10);
        assert_eq!(p.bytes, [5, 35, 30, 0, 0, 0, 0, 30]);
        assert_eq!(p.bytes.iter().sum::<u64>(), 100);
    }

    #[test]
    fn relay_placement_covers_every_stage_and_adds_up() {
        let m = msgs(&[10; 8], 0);
        // Messages end at 10, 20, ..., 80; one boundary between each pair.
        let b = Boundaries::Relay {
            server: SendPos {
                written: 75,
                snd_nxt: 65,
                snd_una: 55,
            },
            backend: RecvPos {
                rcv_nxt: 55,
                copied: 45,
            },
            client: SendPos {
                written: 35,
                snd_nxt: 25,
                snd_una: 15,
            },
        };
        let p = place(&m, &b);
        assert_eq!(p.counts, [1, 1, 1, 1, 1, 1, 1, 1]);
        assert_eq!(p.bytes, [5, 10, 10, 10, 10, 10, 10, 15]);
    }

    #[test]
    fn inconsistent_boundaries_are_clamped_not_reordered() {
        let m = msgs(&[10; 4], 0);
        // The relay read more than spice-server's snd_una shows (its ACK was still in flight).
        let b = Boundaries::Relay {
            server: SendPos {
                written: 40,
                snd_nxt: 40,
                snd_una: 10,
            },
            backend: RecvPos {
                rcv_nxt: 40,
                copied: 30,
            },
            client: SendPos {
                written: 30,
                snd_nxt: 30,
                snd_una: 30,
            },
        };
        let p = place(&m, &b);
        assert_eq!(p.placed(), 4);
        assert_eq!(p.counts[2], 3, "beyond snd_una 10: three messages unacked");
        assert_eq!(p.bytes.iter().sum::<u64>(), 40);
        // B read 30 and the client leg above S snd_una 10 is a lagging ACK, not a
        // disagreement: nothing counted.
        assert_eq!(p.clamped, 0);
    }

    #[test]
    fn consistent_boundaries_are_not_counted_as_clamped() {
        let m = msgs(&[10; 10], 100);
        let server = SendPos {
            written: 200,
            snd_nxt: 200,
            snd_una: 100,
        };
        // Thresholds equal to the range's ends and to each other are in order: not clamped.
        let p = place(&m, &Boundaries::Direct { server });
        assert_eq!((p.clamped, p.counts[2]), (0, 10));
    }

    #[test]
    fn clamp_counts_each_threshold_out_of_data_path_order() {
        // Messages 100..200.
        let m = msgs(&[10; 10], 100);
        // write_seq beyond the newest message's end (a message started after the ring was
        // drained): counted. snd_una before the oldest message's start (older bytes not yet
        // acknowledged) moves no message: not counted.
        let server = SendPos {
            written: 230,
            snd_nxt: 150,
            snd_una: 40,
        };
        let p = place(&m, &Boundaries::Direct { server });
        assert_eq!(p.clamped, 1);
        assert_eq!(p.counts, [0, 5, 5, 0, 0, 0, 0, 0]);
        assert_eq!(p.bytes[..3], [0, 50, 50]);
        // snd_nxt above written: snd_nxt is clamped down to written, and snd_una (in order
        // with the clamped value) is not.
        let server = SendPos {
            written: 150,
            snd_nxt: 170,
            snd_una: 120,
        };
        let p = place(&m, &Boundaries::Direct { server });
        assert_eq!(p.clamped, 1);
        assert_eq!(p.counts, [5, 0, 3, 0, 0, 0, 0, 2]);
        // Through a relay: the relay read past spice-server's snd_una (the ACK on its way: not
        // counted) and the client leg wrote past what the relay read (counted).
        let b = Boundaries::Relay {
            server: SendPos {
                written: 200,
                snd_nxt: 200,
                snd_una: 160,
            },
            backend: RecvPos {
                rcv_nxt: 200,
                copied: 180,
            },
            client: SendPos {
                written: 190,
                snd_nxt: 150,
                snd_una: 120,
            },
        };
        let p = place(&m, &b);
        assert_eq!(p.clamped, 1);
        assert_eq!(p.counts, [0, 0, 4, 0, 0, 1, 3, 2]);
        // The relay read more than spice-server had sent (a read after the dump): counted, and
        // the client leg, in order with the clamped read, is not.
        let b = Boundaries::OpaqueRelay {
            server: SendPos {
                written: 200,
                snd_nxt: 170,
                snd_una: 150,
            },
            backend: RecvPos {
                rcv_nxt: 190,
                copied: 190,
            },
        };
        let p = place(&m, &b);
        assert_eq!(p.clamped, 1);
        assert_eq!((p.counts[1], p.counts[2], p.unplaced), (3, 2, 5));
    }

    #[test]
    fn opaque_relay_leaves_the_client_side_unplaced() {
        let m = msgs(&[10; 4], 0);
        let b = Boundaries::OpaqueRelay {
            server: SendPos {
                written: 40,
                snd_nxt: 40,
                snd_una: 30,
            },
            backend: RecvPos {
                rcv_nxt: 30,
                copied: 20,
            },
        };
        let p = place(&m, &b);
        assert_eq!((p.counts[2], p.counts[3], p.unplaced), (1, 1, 2));
    }

    // --- pairing: sockets built from kernel records, as the agent builds them ---

    use crate::events::Event;
    use spice_ebpf_common::{
        event::{EventHeader, LinkEvent, MessageEvent},
        framing::Role,
        protocol::msg_server,
    };

    const XORG: u32 = 10;
    const RELAY: u32 = 20;

    fn addr(port: u16) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn hdr(cookie: u64, pid: u32, d: u8) -> EventHeader {
        EventHeader {
            tgid: pid,
            cookie,
            dir: d,
            ..Default::default()
        }
    }

    /// One SPICE channel through the relay: spice-server's socket `s`, the relay's backend
    /// `b` (same TCP connection) and its client leg `c`. Message records are emitted the way
    /// a relay produces them: read on one leg, then written on the other.
    struct Leg {
        s: u64,
        b: u64,
        c: u64,
        /// Messages framed so far: [spice-server wrote = relay read on b, relay wrote on c].
        s2c: [u64; 2],
        /// [client wrote = relay read on c, relay wrote on b].
        c2s: [u64; 2],
        /// (offset, size, type) of every server→client and client→server message.
        s2c_msgs: Vec<(u64, u32, u16, u32)>,
        c2s_msgs: Vec<(u64, u32, u16)>,
    }

    fn link(m: &mut Model, cookie: u64, pid: u32, d: u8, role: Role, ty: u8, conn: u32) {
        m.apply(&Event::Link(LinkEvent {
            hdr: hdr(cookie, pid, d),
            role: role as u8,
            channel_type: ty,
            channel_id: 0,
            link_size: 30,
            connection_id: conn,
            common_caps: 0xb,
            ..Default::default()
        }));
    }

    #[allow(clippy::too_many_arguments)]
    fn message(
        m: &mut Model,
        cookie: u64,
        pid: u32,
        d: u8,
        index: u64,
        at: u64,
        size: u32,
        ty: u16,
        prefix: u32,
    ) {
        m.apply(&Event::Message(MessageEvent {
            hdr: hdr(cookie, pid, d),
            at,
            index,
            size,
            msg_type: ty,
            hdr_len: 6,
            prefix: [prefix, 0],
            seq: 1000 + at as u32,
            ..Default::default()
        }));
    }

    impl Leg {
        /// Session `n`'s channel of type `ty`: server port 5960+n, relay frontend 6960+n,
        /// backend port 40000+10n+ty, client port 50000+10n+ty. Cookies are allocated in
        /// `s < b < c` order per channel.
        fn new(m: &mut Model, n: u16, ty: u8, conn: u32) -> Leg {
            let base = u64::from(n) * 1000 + u64::from(ty) * 10;
            let (s, b, c) = (base + 1, base + 2, base + 3);
            let (sp, fp) = (5960 + n, 6960 + n);
            let (bp, cp) = (
                40000 + 10 * n + u16::from(ty),
                50000 + 10 * n + u16::from(ty),
            );
            for (cookie, pid, l, r) in [(s, XORG, sp, bp), (b, RELAY, bp, sp), (c, RELAY, fp, cp)] {
                m.apply(&Event::Socket {
                    hdr: hdr(cookie, pid, 0),
                    tid: pid,
                    local: addr(l),
                    remote: addr(r),
                    comm: String::new(),
                });
            }
            // The client's link message: read on c, written on b, read by spice-server.
            link(m, c, RELAY, dir::RECV, Role::ClientToServer, ty, conn);
            link(m, b, RELAY, dir::SEND, Role::ClientToServer, ty, conn);
            link(m, s, XORG, dir::RECV, Role::ClientToServer, ty, conn);
            link(m, s, XORG, dir::SEND, Role::ServerToClient, ty, conn);
            link(m, b, RELAY, dir::RECV, Role::ServerToClient, ty, conn);
            link(m, c, RELAY, dir::SEND, Role::ServerToClient, ty, conn);
            Leg {
                s,
                b,
                c,
                s2c: [0, 0],
                c2s: [0, 0],
                s2c_msgs: Vec::new(),
                c2s_msgs: Vec::new(),
            }
        }

        /// spice-server writes a message; the relay reads it from the backend.
        fn server_sends(&mut self, m: &mut Model, size: u32, ty: u16, prefix: u32) {
            let at = self
                .s2c_msgs
                .last()
                .map_or(0, |&(at, n, ..)| at + 6 + n as u64);
            self.s2c_msgs.push((at, size, ty, prefix));
            self.s2c[0] += 1;
            let i = self.s2c[0];
            message(m, self.s, XORG, dir::SEND, i, at, size, ty, prefix);
            message(m, self.b, RELAY, dir::RECV, i, at, size, ty, prefix);
        }

        /// The relay writes the oldest message it read and has not written toward the client.
        fn relay_forwards(&mut self, m: &mut Model) {
            let (at, size, ty, prefix) = self.s2c_msgs[self.s2c[1] as usize];
            self.s2c[1] += 1;
            message(
                m,
                self.c,
                RELAY,
                dir::SEND,
                self.s2c[1],
                at,
                size,
                ty,
                prefix,
            );
        }

        /// A server message all the way to the client.
        fn s2c(&mut self, m: &mut Model, size: u32, ty: u16) {
            self.server_sends(m, size, ty, 0);
            self.relay_forwards(m);
        }

        /// A client message all the way to spice-server.
        fn c2s(&mut self, m: &mut Model, size: u32, ty: u16) {
            let at = self
                .c2s_msgs
                .last()
                .map_or(0, |&(at, n, _)| at + 6 + n as u64);
            self.c2s_msgs.push((at, size, ty));
            self.c2s[0] += 1;
            let i = self.c2s[0];
            message(m, self.c, RELAY, dir::RECV, i, at, size, ty, 0);
            message(m, self.b, RELAY, dir::SEND, i, at, size, ty, 0);
            message(m, self.s, XORG, dir::RECV, i, at, size, ty, 0);
        }
    }

    fn chain_of(chains: &[Chain], server: u64) -> &Chain {
        chains.iter().find(|c| c.server == server).unwrap()
    }

    /// Two sessions' main channels (connection_id 0 on both) with the same messages.
    fn two_mains(m: &mut Model) -> (Leg, Leg) {
        let a = Leg::new(m, 1, channel::MAIN, 0);
        let b = Leg::new(m, 2, channel::MAIN, 0);
        (a, b)
    }

    #[test]
    fn single_candidate_pairs_on_the_link_message() {
        let mut m = Model::default();
        let a = Leg::new(&mut m, 1, channel::DISPLAY, 0x1234);
        let mut chains = Vec::new();
        pair(&m, &mut chains);
        let c = chain_of(&chains, a.s);
        assert_eq!((c.backend, c.client_leg), (Some(a.b), Some(a.c)));
        assert!(
            c.pairing[1].contains("only unpaired leg"),
            "{:?}",
            c.pairing
        );
    }

    #[test]
    fn different_connection_ids_pair_each_session_with_its_own_leg() {
        let mut m = Model::default();
        let a = Leg::new(&mut m, 1, channel::DISPLAY, 0x1111);
        let b = Leg::new(&mut m, 2, channel::DISPLAY, 0x2222);
        let mut chains = Vec::new();
        pair(&m, &mut chains);
        assert_eq!(chain_of(&chains, a.s).client_leg, Some(a.c));
        assert_eq!(chain_of(&chains, b.s).client_leg, Some(b.c));
    }

    #[test]
    fn a_tie_is_never_paired_and_waits() {
        let mut m = Model::default();
        let (mut a, mut b) = two_mains(&mut m);
        let mut chains = Vec::new();
        pair(&m, &mut chains);
        for _ in 0..20 {
            for l in [&mut a, &mut b] {
                l.s2c(&mut m, 100, 104);
                l.c2s(&mut m, 4, 3);
            }
            pair(&m, &mut chains);
        }
        for l in [&a, &b] {
            let c = chain_of(&chains, l.s);
            assert_eq!(c.backend, Some(l.b));
            assert_eq!(c.client_leg, None, "tie paired: {:?}", c.pairing);
            let note = c.pairing.last().unwrap();
            assert!(
                note.starts_with(WAITING) && note.contains("2 legs") && note.contains("(40)"),
                "{note}"
            );
        }
        // Beyond the first FINGERPRINT messages, from the recent ring: session 2's next
        // message has another size, so its leg is excluded from session 1's chain.
        a.s2c(&mut m, 100, 104);
        b.s2c(&mut m, 120, 104);
        pair(&m, &mut chains);
        let ca = chain_of(&chains, a.s);
        assert_eq!(ca.client_leg, Some(a.c), "{:?}", ca.pairing);
        let why = ca.pairing.last().unwrap();
        assert!(
            why.contains("the same 21 server→client and 20 client→server")
                && why.contains("message 21 written as type 104 at offset 2120 (126 bytes)"),
            "{why}"
        );
        assert_eq!(chain_of(&chains, b.s).client_leg, Some(b.c));
        assert!(ca.candidates.is_empty());
    }

    #[test]
    fn the_client_to_server_direction_tells_sessions_apart() {
        let mut m = Model::default();
        let (mut a, mut b) = two_mains(&mut m);
        let mut chains = Vec::new();
        for l in [&mut a, &mut b] {
            l.s2c(&mut m, 100, 104);
        }
        pair(&m, &mut chains);
        assert!(chains.iter().all(|c| c.client_leg.is_none()));
        a.c2s(&mut m, 4, 3);
        b.c2s(&mut m, 8, 3);
        pair(&m, &mut chains);
        assert_eq!(chain_of(&chains, a.s).client_leg, Some(a.c));
        assert_eq!(chain_of(&chains, b.s).client_leg, Some(b.c));
        assert!(
            chain_of(&chains, a.s).pairing[1].contains("client→server message 1"),
            "{:?}",
            chain_of(&chains, a.s).pairing
        );
    }

    #[test]
    fn main_init_session_ids_tell_sessions_apart() {
        let mut m = Model::default();
        let (mut a, mut b) = two_mains(&mut m);
        let mut chains = Vec::new();
        a.server_sends(&mut m, 32, msg_server::MAIN_INIT, 0xaaaa);
        a.relay_forwards(&mut m);
        b.server_sends(&mut m, 32, msg_server::MAIN_INIT, 0xbbbb);
        b.relay_forwards(&mut m);
        pair(&m, &mut chains);
        let ca = chain_of(&chains, a.s);
        assert_eq!(ca.client_leg, Some(a.c));
        assert!(
            ca.pairing[1].contains("the same MAIN_INIT session id")
                && ca.pairing[1].contains("MAIN_INIT session id 0xbbbb, the backend's is 0xaaaa"),
            "{:?}",
            ca.pairing
        );
        assert_eq!(chain_of(&chains, b.s).client_leg, Some(b.c));
    }

    /// The case the former rule (most agreeing first messages wins) paired wrongly: the relay
    /// has read a message from session 1's server but not written it yet, while session 2's
    /// leg already carries it.
    #[test]
    fn a_lagging_leg_is_not_outvoted() {
        let mut m = Model::default();
        let (mut a, mut b) = two_mains(&mut m);
        let mut chains = Vec::new();
        for l in [&mut a, &mut b] {
            l.s2c(&mut m, 100, 104);
            l.s2c(&mut m, 50, 105);
        }
        a.server_sends(&mut m, 70, 106, 0);
        b.s2c(&mut m, 70, 106);
        pair(&m, &mut chains);
        // Session 1's leg agrees on 2 messages, session 2's on 3: still a tie.
        assert!(
            chains.iter().all(|c| c.client_leg.is_none()),
            "{:?}",
            chains.iter().map(|c| &c.pairing).collect::<Vec<_>>()
        );
        // Session 2's leg now writes a message session 1's backend has not read: not it.
        b.s2c(&mut m, 70, 106);
        pair(&m, &mut chains);
        let ca = chain_of(&chains, a.s);
        assert_eq!(ca.client_leg, Some(a.c));
        assert!(
            ca.pairing[1]
                .contains("message 4 written before it was read (the other leg has read 3)"),
            "{:?}",
            ca.pairing
        );
        assert_eq!(chain_of(&chains, b.s).client_leg, Some(b.c));
    }

    #[test]
    fn a_consistent_leg_with_nothing_compared_waits() {
        let mut m = Model::default();
        let (mut a, mut b) = two_mains(&mut m);
        let mut chains = Vec::new();
        // Session 2's leg wrote a message session 1's backend never read (excluded), but
        // session 1's own leg has nothing compared yet.
        b.s2c(&mut m, 100, 104);
        pair(&m, &mut chains);
        assert_eq!(chain_of(&chains, a.s).client_leg, None);
        a.s2c(&mut m, 100, 104);
        pair(&m, &mut chains);
        assert_eq!(chain_of(&chains, a.s).client_leg, Some(a.c));
        assert_eq!(chain_of(&chains, b.s).client_leg, Some(b.c));
    }

    #[test]
    fn comparison_is_incremental_and_skips_what_is_no_longer_kept() {
        let mut m = Model::default();
        let mut a = Leg::new(&mut m, 1, channel::MAIN, 0);
        let n = super::super::RECENT as u64 + 1000;
        for _ in 0..n {
            a.s2c(&mut m, 10, 104);
        }
        let s = &m.sockets;
        let (bd, cd) = (
            &s[&a.b].dirs[dir::RECV as usize],
            &s[&a.c].dirs[dir::SEND as usize],
        );
        let (mut upto, mut agreed) = (0, 0);
        compare_dir(bd, cd, &mut upto, &mut agreed).unwrap();
        assert_eq!(upto, n);
        assert_eq!(
            agreed,
            (super::super::FINGERPRINT + super::super::RECENT) as u64
        );
        // Nothing new: nothing compared again.
        compare_dir(bd, cd, &mut upto, &mut agreed).unwrap();
        assert_eq!(
            agreed,
            (super::super::FINGERPRINT + super::super::RECENT) as u64
        );
    }

    // --- pairing of legs joined mid-stream: no link message, own ordinals and offsets ---

    use spice_ebpf_common::event::{HuntEvent, LockEvent};

    /// One socket joined mid-stream: each direction traced from stream position `from[d]`
    /// (bytes before it never seen), counting from the first message at or after it.
    struct Joined {
        cookie: u64,
        pid: u32,
        /// Per direction: first traced stream position, first counted global message, TCP
        /// sequence number of stream position 0.
        from: [u64; 2],
        first: [Option<usize>; 2],
        seq0: [u32; 2],
    }

    /// Both directions' messages of one channel as the peers wrote them: (stream position,
    /// size, type).
    #[derive(Default)]
    struct Stream {
        msgs: [Vec<(u64, u32, u16)>; 2],
    }

    impl Stream {
        fn push(&mut self, k: usize, size: u32, ty: u16) {
            let at = self.msgs[k].last().map_or(0, |&(a, n, _)| a + 6 + n as u64);
            self.msgs[k].push((at, size, ty));
        }
    }

    const S2C: usize = 0;
    const C2S: usize = 1;

    impl Joined {
        /// `server_end`: the socket's process reads client→server bytes (spice-server, the
        /// relay's client-facing leg).
        #[allow(clippy::too_many_arguments)]
        fn new(
            m: &mut Model,
            cookie: u64,
            pid: u32,
            local: u16,
            remote: u16,
            server_end: bool,
            from: [u64; 2],
            seq0: [u32; 2],
        ) -> Joined {
            m.add_existing(cookie, pid, addr(local), addr(remote), 0);
            let j = Joined {
                cookie,
                pid,
                from,
                first: [None, None],
                seq0,
            };
            for k in [S2C, C2S] {
                m.apply(&Event::Hunt(HuntEvent {
                    hdr: hdr(cookie, pid, j.dir(k, server_end)),
                    role: if k == S2C {
                        Role::ServerToClient
                    } else {
                        Role::ClientToServer
                    } as u8,
                    reason: 15,
                    ..Default::default()
                }));
            }
            j
        }

        fn dir(&self, k: usize, server_end: bool) -> u8 {
            if (k == S2C) == server_end {
                dir::SEND
            } else {
                dir::RECV
            }
        }

        /// The record of global message `g` of direction `k`, as this socket's process moves
        /// it (locking on the first one it sees).
        fn see(&mut self, m: &mut Model, st: &Stream, k: usize, g: usize, server_end: bool) {
            let (at, size, ty) = st.msgs[k][g];
            if at < self.from[k] {
                return;
            }
            let d = self.dir(k, server_end);
            let first = *self.first[k].get_or_insert_with(|| {
                m.apply(&Event::Lock(LockEvent {
                    hdr: hdr(self.cookie, self.pid, d),
                    at: at - self.from[k],
                    index: 1,
                    hdr_len: 6,
                    role: if k == S2C {
                        Role::ServerToClient
                    } else {
                        Role::ClientToServer
                    } as u8,
                    ..Default::default()
                }));
                g
            });
            m.apply(&Event::Message(MessageEvent {
                hdr: hdr(self.cookie, self.pid, d),
                at: at - self.from[k],
                index: (g - first + 1) as u64,
                size,
                msg_type: ty,
                hdr_len: 6,
                seq: self.seq0[k].wrapping_add(at as u32),
                ..Default::default()
            }));
        }
    }

    /// spice-server's socket `s`, the relay's backend `b` (one TCP connection) and client
    /// leg `c`, each joined at its own stream position.
    struct JoinedChain {
        s: Joined,
        b: Joined,
        c: Joined,
        st: Stream,
    }

    impl JoinedChain {
        /// Relay pid RELAY, ports as [`Leg::new`]; `from` = [s, b, c] first traced positions
        /// (server→client; client→server from 0).
        fn new(m: &mut Model, n: u16, from: [u64; 3]) -> JoinedChain {
            let base = 5000 + u64::from(n) * 10;
            let (sp, bp, cp) = (5960 + n, 40000 + n, 50000 + n);
            let s = Joined::new(m, base + 1, XORG, sp, bp, true, [from[0], 0], [7000, 9000]);
            let b = Joined::new(
                m,
                base + 2,
                RELAY,
                bp,
                sp,
                false,
                [from[1], 0],
                [7000, 9000],
            );
            let c = Joined::new(m, base + 3, RELAY, 6960, cp, true, [from[2], 0], [123, 456]);
            JoinedChain {
                s,
                b,
                c,
                st: Stream::default(),
            }
        }

        /// A server message all the way to the client.
        fn s2c(&mut self, m: &mut Model, size: u32, ty: u16) {
            self.st.push(S2C, size, ty);
            let g = self.st.msgs[S2C].len() - 1;
            self.s.see(m, &self.st, S2C, g, true);
            self.b.see(m, &self.st, S2C, g, false);
            self.c.see(m, &self.st, S2C, g, true);
        }

        /// A client message all the way to spice-server.
        fn c2s(&mut self, m: &mut Model, size: u32, ty: u16) {
            self.st.push(C2S, size, ty);
            let g = self.st.msgs[C2S].len() - 1;
            self.c.see(m, &self.st, C2S, g, true);
            self.b.see(m, &self.st, C2S, g, false);
            self.s.see(m, &self.st, C2S, g, true);
        }
    }

    /// A fixed pseudo-random number of `i` (not periodic within a test's messages).
    fn noise(i: u32) -> u32 {
        i.wrapping_mul(2_654_435_761).rotate_left(13) >> 8
    }

    #[test]
    fn joined_legs_pair_once_a_distinct_message_fixes_the_alignment() {
        let mut m = Model::default();
        // The relay had read 94 bytes (two 41-byte fills) more than it had written when the
        // observer joined; spice-server's socket was joined 47 bytes later.
        let mut j = JoinedChain::new(&mut m, 1, [1000 + 47 + 94, 1000 + 94, 1000]);
        let mut chains = Vec::new();
        // More fills than HOLD_MAX, the client ACKing every 40.
        for i in 0..2200 {
            j.s2c(&mut m, 41, 302);
            if i % 40 == 39 {
                j.c2s(&mut m, 0, 2);
            }
            pair(&m, &mut chains);
        }
        let ch = chain_of(&chains, j.s.cookie);
        assert_eq!(ch.backend, Some(j.b.cookie), "{:?}", ch.pairing);
        // Every fill is the same: every small enough delta fits.
        assert_eq!(ch.client_leg, None, "{:?}", ch.pairing);
        let note = ch.pairing.last().unwrap();
        assert!(
            note.starts_with(WAITING) && note.contains("alignments fit"),
            "{note}"
        );
        // A PING on the display channel tells them apart.
        j.s2c(&mut m, 12, 4);
        for _ in 0..10 {
            j.s2c(&mut m, 41, 302);
        }
        pair(&m, &mut chains);
        let ch = chain_of(&chains, j.s.cookie);
        assert_eq!(ch.client_leg, Some(j.c.cookie), "{:?}", ch.pairing);
        // Written at client-leg offset o, read at backend offset o + (1000 − 1094); ordinals
        // from the client leg's lock (message 0 of the stream's tail: the first at or after
        // 1000) and the backend's (two later).
        let a = ch.align[0].unwrap();
        assert_eq!(
            a,
            Align {
                index: -2,
                offset: 1000 - 1094
            }
        );
        // The client's ACKs are all alike: that direction's alignment is left unknown (not
        // compared) rather than guessed.
        assert_eq!(ch.align[1], None);
        let note = ch.pairing.last().unwrap();
        assert!(
            note.contains("server→client: offset -94, ordinal -2")
                && note.contains("client→server: ")
                && note.contains("alignments fit"),
            "{note}"
        );
        // From there on the legs are compared under that alignment: transparent.
        pair(&m, &mut chains);
        let ch = chain_of(&chains, j.s.cookie);
        assert!(
            matches!(ch.transparency, Transparency::Transparent { compared } if compared > 2000),
            "{:?}",
            ch.transparency
        );
        // The client leg's offset o is spice-server's o + 1094 − 1141 after the backend's
        // sequence numbers are taken into spice-server's stream.
        assert_eq!(ch.client_shift(&m), Some(1000 - 1141));
        let s_off = |g: usize| j.st.msgs[S2C][g].0 - 1141;
        let c_off = |g: usize| j.st.msgs[S2C][g].0 - 1000;
        assert_eq!(
            c_off(250) as i64 + ch.client_shift(&m).unwrap(),
            s_off(250) as i64
        );
    }

    #[test]
    fn the_tcp_byte_counters_align_a_stream_of_identical_messages() {
        let mut m = Model::default();
        let mut j = JoinedChain::new(&mut m, 7, [1000 + 47 + 94, 1000 + 94, 1000]);
        let mut chains = Vec::new();
        for _ in 0..300 {
            j.s2c(&mut m, 41, 302);
            pair(&m, &mut chains);
        }
        let (s, c) = (j.s.cookie, j.c.cookie);
        let ch = chains.iter_mut().find(|x| x.server == s).unwrap();
        assert_eq!(ch.candidate_legs(), vec![c]);
        // One sample is not enough; two that agree are.
        ch.learn_stream_start(c, 1094, 1000);
        pair(&m, &mut chains);
        assert_eq!(chain_of(&chains, s).client_leg, None);
        let ch = chains.iter_mut().find(|x| x.server == s).unwrap();
        ch.learn_stream_start(c, 1094, 1000);
        pair(&m, &mut chains);
        let ch = chain_of(&chains, s);
        assert_eq!(ch.client_leg, Some(c), "{:?}", ch.pairing);
        assert_eq!(
            ch.align[0],
            Some(Align {
                index: -2,
                offset: -94
            })
        );
        assert!(
            ch.pairing
                .last()
                .unwrap()
                .contains("offset -94 (from the TCP byte counters), ordinal -2"),
            "{:?}",
            ch.pairing
        );
        // Counters that put the leg's messages off the backend's boundaries: not paired.
        let mut m = Model::default();
        let mut j = JoinedChain::new(&mut m, 8, [1000 + 47 + 94, 1000 + 94, 1000]);
        let mut chains = Vec::new();
        for _ in 0..300 {
            j.s2c(&mut m, 41, 302);
            pair(&m, &mut chains);
        }
        let (s, c) = (j.s.cookie, j.c.cookie);
        for _ in 0..2 {
            let ch = chains.iter_mut().find(|x| x.server == s).unwrap();
            ch.learn_stream_start(c, 1094, 1010);
            pair(&m, &mut chains);
        }
        assert_eq!(chain_of(&chains, s).client_leg, None);
    }

    #[test]
    fn a_relay_changing_a_joined_stream_is_caught_under_the_alignment() {
        let mut m = Model::default();
        let mut j = JoinedChain::new(&mut m, 2, [100, 100, 100]);
        let mut chains = Vec::new();
        for i in 0..2200u32 {
            j.s2c(&mut m, 10 + noise(i) % 37, 302);
            j.c2s(&mut m, 4 + noise(i + 7) % 11, 3);
            pair(&m, &mut chains);
        }
        let ch = chain_of(&chains, j.s.cookie);
        assert_eq!(ch.client_leg, Some(j.c.cookie), "{:?}", ch.pairing);
        assert_eq!(ch.align, [Some(Align::default()); 2]);
        // The relay writes a message with another size than it read.
        j.st.push(S2C, 77, 302);
        let g = j.st.msgs[S2C].len() - 1;
        j.s.see(&mut m, &j.st, S2C, g, true);
        j.b.see(&mut m, &j.st, S2C, g, false);
        j.st.msgs[S2C][g].1 = 78;
        j.c.see(&mut m, &j.st, S2C, g, true);
        pair(&m, &mut chains);
        let ch = chain_of(&chains, j.s.cookie);
        assert!(
            matches!(
                &ch.transparency,
                Transparency::Changed {
                    direction: "server_to_client",
                    ..
                }
            ),
            "{:?}",
            ch.transparency
        );
    }

    #[test]
    fn joined_legs_of_one_relay_process_pair_each_with_its_own_backend() {
        // One relay process (haproxy-like) carrying two channels: its two client legs are
        // both candidates of both chains.
        let mut m = Model::default();
        let mut a = JoinedChain::new(&mut m, 3, [0, 0, 0]);
        let mut b = JoinedChain::new(&mut m, 4, [0, 0, 0]);
        let mut chains = Vec::new();
        for i in 0..2200u32 {
            a.s2c(&mut m, 20 + noise(i) % 7, 302);
            b.s2c(&mut m, 20 + noise(i + 99) % 7, 302);
            pair(&m, &mut chains);
        }
        let (ca, cb) = (chain_of(&chains, a.s.cookie), chain_of(&chains, b.s.cookie));
        assert_eq!(ca.client_leg, Some(a.c.cookie), "{:?}", ca.pairing);
        assert_eq!(cb.client_leg, Some(b.c.cookie), "{:?}", cb.pairing);
        assert!(
            ca.pairing.last().unwrap().contains("2 unpaired leg(s)"),
            "{:?}",
            ca.pairing
        );
    }

    /// Many direct sessions (no relay) and one relay leg whose addresses do not mirror any
    /// spice-server socket (the relay saw the connection through a NAT) but whose stream has
    /// one server's TCP sequence base: that server's chain gets it as its backend, found
    /// through the index by sequence base; every other chain has none, and pairing again
    /// changes nothing.
    #[test]
    fn a_backend_is_found_by_sequence_base_among_many_direct_sessions() {
        let mut m = Model::default();
        let n = 40u64;
        let sock = |m: &mut Model, cookie: u64, pid: u32, l: u16, r: u16| {
            m.apply(&Event::Socket {
                hdr: hdr(cookie, pid, 0),
                tid: pid,
                local: addr(l),
                remote: addr(r),
                comm: String::new(),
            });
        };
        let msg = |m: &mut Model, cookie: u64, pid: u32, d: u8, seq_base: u32| {
            m.apply(&Event::Message(MessageEvent {
                hdr: hdr(cookie, pid, d),
                at: 100,
                index: 1,
                size: 8,
                msg_type: msg_server::SET_ACK,
                hdr_len: 6,
                prefix: [1, 20],
                seq: seq_base.wrapping_add(100),
                ..Default::default()
            }));
        };
        for i in 1..=n {
            sock(&mut m, i, XORG, 5900, 40000 + i as u16);
            link(
                &mut m,
                i,
                XORG,
                dir::RECV,
                Role::ClientToServer,
                channel::DISPLAY,
                0,
            );
            link(
                &mut m,
                i,
                XORG,
                dir::SEND,
                Role::ServerToClient,
                channel::DISPLAY,
                0,
            );
            msg(&mut m, i, XORG, dir::SEND, 7_000_000 * i as u32);
        }
        let rb = 1000;
        sock(&mut m, rb, RELAY, 33333, 15900);
        link(
            &mut m,
            rb,
            RELAY,
            dir::SEND,
            Role::ClientToServer,
            channel::DISPLAY,
            0,
        );
        link(
            &mut m,
            rb,
            RELAY,
            dir::RECV,
            Role::ServerToClient,
            channel::DISPLAY,
            0,
        );
        msg(&mut m, rb, RELAY, dir::RECV, 7_000_000 * 7);
        let mut chains = Vec::new();
        for _ in 0..2 {
            pair(&m, &mut chains);
            assert_eq!(chains.len(), n as usize);
            for c in &chains {
                let want = (c.server == 7).then_some(rb);
                assert_eq!(c.backend, want, "chain of {}", c.server);
            }
        }
        let c7 = chain_of(&chains, 7);
        assert!(
            c7.pairing[0].contains("same sequence numbers"),
            "{:?}",
            c7.pairing
        );
    }

    #[test]
    fn joined_backend_pairs_despite_different_sequence_bases() {
        // spice-server's socket traced from 300, the relay's backend from 200: the sequence
        // numbers of stream offset 0 differ by 100, the messages' own agree.
        let mut m = Model::default();
        let mut j = JoinedChain::new(&mut m, 5, [300, 200, 200]);
        let mut chains = Vec::new();
        for i in 0..20u32 {
            j.s2c(&mut m, 10 + i, 302);
        }
        pair(&m, &mut chains);
        let ch = chain_of(&chains, j.s.cookie);
        assert_eq!(ch.backend, Some(j.b.cookie), "{:?}", ch.pairing);
        assert!(
            ch.pairing[0].contains("a message at the same sequence number on both"),
            "{:?}",
            ch.pairing
        );
        // A relay socket with mirrored addresses whose sequence numbers do not match is not it.
        let mut m = Model::default();
        let mut j = JoinedChain::new(&mut m, 6, [300, 200, 200]);
        j.b.seq0[S2C] = 7000 + 50_000;
        for i in 0..20u32 {
            j.s2c(&mut m, 10 + i, 302);
        }
        let mut chains = Vec::new();
        pair(&m, &mut chains);
        assert_eq!(chain_of(&chains, j.s.cookie).backend, None);
    }

    #[test]
    fn chain_stats_stay_bounded_whatever_the_samples() {
        let mut st = ChainStats::default();
        for i in 0..200_000u64 {
            let mut p = Placement::default();
            p.counts[2] = (i % 83) as u32;
            p.bytes[2] = i * 7919;
            p.clamped = (i % 3) as u32;
            st.add(&ChainSample {
                t_ns: i * 100_000_000,
                in_flight: (i % 83) as i64,
                relay_visible: Some((i % 83) as i64),
                placement: Some(p),
                kept: i % 83,
                delivered: Some(i * 1000),
            });
            st.add_delivery_rate(1_000_000 + i * 37);
        }
        assert_eq!(
            (st.samples, st.placed, st.with_relay),
            (200_000, 200_000, 200_000)
        );
        assert!(st.stage_counts[2].buckets() <= 83);
        assert_eq!(st.stage_counts[2].max(), Some(82));
        assert!(st.stage_bytes[2].buckets() <= 57 * 128 + 256);
        assert!(st.delivery_rates.buckets() <= 57 * 128 + 256);
        assert_eq!(st.first_delivered, Some((0, 0)));
        assert_eq!(st.last_delivered.unwrap().1, 199_999 * 1000);
        assert_eq!((st.clamped_samples, st.clamped_max), (133_333, 2));
        assert_eq!((st.relay_above, st.relay_below), (0, 0));
    }

    #[test]
    fn empty_inflight_places_nothing() {
        let p = place(
            &[],
            &Boundaries::Direct {
                server: SendPos::default(),
            },
        );
        assert_eq!(p, Placement::default());
    }
}
