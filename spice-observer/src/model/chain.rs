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
//! | `client_unacked` | C `snd_una` | on the client link, not TCP-acknowledged |
//! | `client_owes_ack` | — | TCP-acknowledged by the client, not yet covered by a SPICE ACK |
//!
//! Without a relay the stages are `server_writing`, `server_notsent`, `server_unacked` and
//! `client_owes_ack`. Behind a relay that is not byte-transparent only the server-side stages
//! and `proxy_recv_queue` can be placed; the rest are counted as unplaced.

use std::collections::HashSet;

use spice_ebpf_common::event::dir;

use super::{Model, MsgSpan, SocketModel};

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
/// the readings are of different instants (the sock_diag dump, the map reads and the drained
/// ring records are not one), and it is clamped, never reordered, and counted in
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
    /// One entry per sample since the chain was found.
    pub samples: Vec<ChainSample>,
    /// `tcpi_delivery_rate` samples of the client-facing socket (bytes/s, non-zero ones): the
    /// kernel's measurement of what the link delivers.
    pub delivery_rates: Vec<u64>,
    /// `tcp_info` of the client-facing socket at the first and latest sample.
    pub link_info: Option<(crate::sockdiag::TcpInfo, crate::sockdiag::TcpInfo)>,
}

/// One sample of a chain.
#[derive(Clone, Copy, Debug)]
pub struct ChainSample {
    /// CLOCK_MONOTONIC ns.
    pub t_ns: u64,
    /// spice-server's in-flight count (its `messages_window`).
    pub in_flight: i64,
    /// The count a relay-side observer would report (the relay's own replay), if a relay.
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

impl Chain {
    fn new(server: u64) -> Self {
        Self {
            server,
            backend: None,
            client_leg: None,
            pairing: Vec::new(),
            transparency: Transparency::Unknown,
            checked: [0, 0],
            samples: Vec::new(),
            delivery_rates: Vec::new(),
            link_info: None,
        }
    }

    /// False once the relay was seen inserting, dropping or rewriting a message.
    pub fn is_transparent(&self) -> bool {
        !matches!(self.transparency, Transparency::Changed { .. })
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

/// Direction indexes: server→client and client→server of a socket.
fn s2c(s: &SocketModel) -> Option<usize> {
    s.s2c()
}

/// True if the first messages of two directions agree as far as both have them (and at least
/// one was compared), and returns how many were compared.
fn fingerprints_agree(a: &[MsgSpan], b: &[MsgSpan]) -> Option<usize> {
    let n = a.len().min(b.len());
    if n == 0 {
        return None;
    }
    let same = a[..n]
        .iter()
        .zip(&b[..n])
        .all(|(x, y)| x.at == y.at && x.end == y.end && x.msg_type == y.msg_type);
    same.then_some(n)
}

/// Finds and extends chains: new server sockets get a chain; unpaired chains look for their
/// relay legs. Call after applying records; cheap when everything is paired.
pub fn pair(model: &Model, chains: &mut Vec<Chain>) {
    let relays = relay_pids(model);
    for s in model.sockets.values() {
        if s.is_server_end() == Some(true)
            && !relays.contains(&s.pid)
            && !chains.iter().any(|c| c.server == s.cookie)
        {
            chains.push(Chain::new(s.cookie));
        }
    }
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
            let found = model.sockets.values().find(|b| {
                if b.is_server_end() != Some(false) || used.contains(&b.cookie) {
                    return false;
                }
                let addr_ok = match (server.local, server.remote, b.local, b.remote) {
                    (Some(sl), Some(sr), Some(bl), Some(br)) => same_ip(sl, br) && same_ip(sr, bl),
                    _ => false,
                };
                let b_seq = b.s2c().and_then(|d| b.dirs[d].seq_base);
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
            let b_c2s_link = backend.c2s().and_then(|d| backend.dirs[d].link);
            let mut best: Option<(&SocketModel, usize)> = None;
            for c in model.sockets.values() {
                if c.pid != backend.pid
                    || c.cookie == backend.cookie
                    || c.is_server_end() != Some(true)
                    || used.contains(&c.cookie)
                {
                    continue;
                }
                // The client's link message, forwarded unchanged.
                let c_link = c.c2s().and_then(|d| c.dirs[d].link);
                let link_ok = match (c_link, b_c2s_link) {
                    (Some(x), Some(y)) => {
                        (
                            x.channel_type,
                            x.channel_id,
                            x.connection_id,
                            x.common_caps,
                            x.link_size,
                        ) == (
                            y.channel_type,
                            y.channel_id,
                            y.connection_id,
                            y.common_caps,
                            y.link_size,
                        )
                    }
                    _ => false,
                };
                if !link_ok {
                    continue;
                }
                // The first server→client messages, forwarded unchanged.
                let compared = match (s2c(c), s2c(backend)) {
                    (Some(cd), Some(bd)) => {
                        fingerprints_agree(&c.dirs[cd].first, &backend.dirs[bd].first).unwrap_or(0)
                    }
                    _ => 0,
                };
                if best.is_none_or(|(_, n)| compared > n) {
                    best = Some((c, compared));
                }
            }
            if let Some((c, compared)) = best {
                // With several candidates (one relay process, many connections), wait until the
                // first messages tell them apart.
                let candidates = model
                    .sockets
                    .values()
                    .filter(|x| {
                        x.pid == backend.pid
                            && x.cookie != backend.cookie
                            && x.is_server_end() == Some(true)
                            && !used.contains(&x.cookie)
                    })
                    .count();
                if compared > 0 || candidates == 1 {
                    chain.client_leg = Some(c.cookie);
                    used.insert(c.cookie);
                    chain.pairing.push(format!(
                        "client leg: relay socket {} carries the same link message{}",
                        c.local.map(|a| a.to_string()).unwrap_or_default(),
                        if compared > 0 {
                            format!(" and the same first {compared} server message(s)")
                        } else {
                            String::new()
                        },
                    ));
                }
            }
        }
    }
    for chain in chains.iter_mut() {
        check_transparency(model, chain);
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
        let (Some(read), Some(written)) = (read, written) else {
            continue;
        };
        while chain.checked[k] < written.last_index {
            let i = chain.checked[k] + 1;
            let Some(w) = written.by_index(i) else {
                chain.checked[k] = i;
                continue;
            };
            match read.by_index(i) {
                Some(r) if r.at == w.at && r.end == w.end && r.msg_type == w.msg_type => {}
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
                None if i > read.last_index => {
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
/// `count` server→client messages it started (the SET_ACK counts itself and is never ACKed by
/// spice-gtk, so it stays in the set). Fewer if fewer are kept.
pub fn inflight(s: &SocketModel) -> Vec<MsgSpan> {
    let Some(d) = s.s2c() else { return Vec::new() };
    let count = s.window.count.max(0) as usize;
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
