//! Periodic samples: TCP positions of every watched socket, and the stage placement of each
//! chain's in-flight messages.
//!
//! Positions come from two sources read back to back: a netlink sock_diag dump (the queues:
//! `idiag_wqueue` = write_seq − snd_una, `tcpi_notsent_bytes` = write_seq − snd_nxt,
//! `idiag_rqueue` = rcv_nxt − copied_seq; `net/ipv4/tcp_diag.c` `tcp_diag_get_info`) and the
//! kernel hooks' `TCP_STATE` map (`write_seq` and `copied_seq`, which change only in the
//! application's own send and receive calls, all of which the hooks see). The map anchors the
//! positions in each stream; the dump gives the queues at the moment of the sample.

use std::collections::HashMap;

use spice_ebpf_common::event::TcpSnapshot;

use crate::{
    loader::Capture,
    model::{
        DirStats, Model, MsgSpan, SocketModel,
        chain::{self, Boundaries, Chain, ChainSample, RecvPos, SEND, SendPos},
    },
    pipeline::monotonic_ns,
    sockdiag::{self, DiagSocket},
};

/// Converts a 32-bit TCP sequence number to a stream offset of direction `dir`, anchored at
/// the newest framed message (valid within ±2 GiB of it).
pub fn stream_pos(dir: &DirStats, seq: u32) -> Option<u64> {
    let base = dir.seq_base?;
    let anchor = dir.recent.back().map_or(0, |m| m.end);
    let delta = seq.wrapping_sub(base).wrapping_sub(anchor as u32) as i32 as i64;
    Some((anchor as i64 + delta).max(0) as u64)
}

/// The raw 32-bit TCP sequence numbers of one socket at one sample, as the sample used them.
///
/// `write_seq` and `copied_seq` are the kernel hooks' `TCP_STATE` map entry (read right after
/// the dump); the other three combine them with the sock_diag dump's queues
/// (`net/ipv4/tcp_diag.c` `tcp_diag_get_info`, `tcp_get_info`):
/// `snd_nxt` = write_seq − `tcpi_notsent_bytes`, `snd_una` = write_seq − `idiag_wqueue`,
/// `rcv_nxt` = copied_seq + `idiag_rqueue` (all mod 2³²).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LegSeqs {
    /// Socket cookie.
    pub cookie: u64,
    pub write_seq: u32,
    pub snd_nxt: u32,
    pub snd_una: u32,
    pub rcv_nxt: u32,
    pub copied_seq: u32,
}

impl LegSeqs {
    /// From a map snapshot and the dump's entry of the same socket; `None` without the dump's
    /// `tcp_info` (no notsent).
    pub fn new(cookie: u64, snap: &TcpSnapshot, d: &DiagSocket) -> Option<Self> {
        let notsent = d.info.as_ref()?.notsent_bytes;
        Some(Self {
            cookie,
            write_seq: snap.write_seq,
            snd_nxt: snap.write_seq.wrapping_sub(notsent),
            snd_una: snap.write_seq.wrapping_sub(d.send_queue),
            rcv_nxt: snap.copied_seq.wrapping_add(d.recv_queue),
            copied_seq: snap.copied_seq,
        })
    }
}

fn send_pos(s: &SocketModel, l: &LegSeqs) -> Option<SendPos> {
    let d = &s.dirs[SEND];
    Some(SendPos {
        written: stream_pos(d, l.write_seq)?,
        snd_nxt: stream_pos(d, l.snd_nxt)?,
        snd_una: stream_pos(d, l.snd_una)?,
    })
}

/// The relay's receiving positions on its leg toward spice-server, as offsets of
/// spice-server's stream: the same TCP connection, so its sequence numbers convert with
/// spice-server's sending direction `sd` (for legs traced from their first byte both have the
/// same `seq_base`; for legs joined mid-stream they differ by what was in flight at the join).
fn recv_pos(sd: &DirStats, l: &LegSeqs) -> Option<RecvPos> {
    Some(RecvPos {
        rcv_nxt: stream_pos(sd, l.rcv_nxt)?,
        copied: stream_pos(sd, l.copied_seq)?,
    })
}

/// Offsets of the client leg's sending side shifted by `shift` bytes into spice-server's
/// stream ([`Chain::client_shift`]).
fn shifted(p: SendPos, shift: i64) -> SendPos {
    let f = |x: u64| (x as i64 + shift).max(0) as u64;
    SendPos {
        written: f(p.written),
        snd_nxt: f(p.snd_nxt),
        snd_una: f(p.snd_una),
    }
}

/// Absolute stream offset (bytes since the connection's first data byte) of the first traced
/// byte of socket `n`'s server→client direction: the kernel's count of bytes received in
/// order (`tcpi_bytes_received`, advanced with `rcv_nxt`) less `rcv_nxt`'s traced offset, on
/// the receiving side; bytes acknowledged (`tcpi_bytes_acked`, advanced with `snd_una`) less
/// `snd_una`'s traced offset, on the sending side (`net/ipv4/tcp_input.c`
/// `tcp_rcv_nxt_update`, `tcp_snd_una_update`; neither counts the SYN of a connection the
/// socket accepted). The relay's leg toward a client is accepted; its leg toward
/// spice-server receives.
fn stream_start(n: &Now<'_>) -> Option<i64> {
    let (info, leg) = (n.diag.info.as_ref()?, n.leg.as_ref()?);
    let d = n.model.s2c()?;
    let ds = &n.model.dirs[d];
    ds.recent.back()?;
    Some(if d == SEND {
        info.bytes_acked as i64 - stream_pos(ds, leg.snd_una)? as i64
    } else {
        info.bytes_received as i64 - stream_pos(ds, leg.rcv_nxt)? as i64
    })
}

/// For a chain whose client leg is not paired: gives it the stream starts
/// ([`stream_start`]) of its backend and of each candidate leg
/// ([`Chain::learn_stream_start`]).
fn learn_stream_starts<'a>(chain: &mut Chain, now: &impl Fn(Option<u64>) -> Option<Now<'a>>) {
    let Some(b) = now(chain.backend).and_then(|n| stream_start(&n)) else {
        return;
    };
    for c in chain.candidate_legs() {
        if let Some(start) = now(Some(c)).and_then(|n| stream_start(&n)) {
            chain.learn_stream_start(c, b, start);
        }
    }
}

/// What one sample took of one chain, beyond the [`ChainSample`] kept for the report: the raw
/// positions (for the `--samples` series).
#[derive(Clone, Debug)]
pub struct ChainTake {
    /// spice-server's socket (the chain's head), cookie.
    pub server: u64,
    /// The sample as appended to the chain.
    pub sample: ChainSample,
    /// The stages the placement filled ([`STAGES`](chain::STAGES) indexes), empty when
    /// nothing was placed.
    pub stages: &'static [usize],
    /// Raw positions of spice-server's socket, the relay's leg toward it and the relay's leg
    /// toward the client; `None` where there is no such leg or its positions were not read.
    pub server_leg: Option<LegSeqs>,
    pub backend_leg: Option<LegSeqs>,
    pub client_leg: Option<LegSeqs>,
    /// TCP sequence number of the last byte of the newest and of the oldest kept in-flight
    /// message, on spice-server's sending direction (`seq_base` + end offset − 1).
    pub newest_last_byte_seq: Option<u32>,
    pub oldest_last_byte_seq: Option<u32>,
}

/// One sample of every chain.
#[derive(Debug)]
pub struct Sample {
    /// CLOCK_MONOTONIC ns right before the sock_diag dump.
    pub t_ns: u64,
    /// CLOCK_MONOTONIC ns right after the last `TCP_STATE` map read.
    pub t_end_ns: u64,
    /// The dump by cookie, for other uses (TCP state of unchained sockets).
    pub dump: HashMap<u64, DiagSocket>,
    /// One entry per chain sampled (open spice-server socket), in `chains` order.
    pub chains: Vec<ChainTake>,
}

/// Everything one sample needs about one socket.
struct Now<'a> {
    model: &'a SocketModel,
    leg: Option<LegSeqs>,
    diag: &'a DiagSocket,
}

/// The positions one sample read, before placing: see [`read`].
#[derive(Debug)]
pub struct Positions {
    /// CLOCK_MONOTONIC ns right before the dump and right after the last map read.
    t_ns: u64,
    t_end_ns: u64,
    dump: HashMap<u64, DiagSocket>,
    snaps: HashMap<u64, TcpSnapshot>,
}

/// Takes one sample of every chain: [`read`], then [`place`] (without draining the ring in
/// between: see [`read`] for why the caller should).
pub fn sample(cap: &mut Capture, model: &mut Model, chains: &mut Vec<Chain>) -> Option<Sample> {
    let pos = read(cap, model, chains)?;
    Some(place(model, chains, pos))
}

/// First half of a sample: pairs new sockets, then reads the positions of every socket: a
/// sock_diag dump, then the `TCP_STATE` map entries (the chains' sockets first). Returns
/// `None` if the dump failed (then no chain gets a sample).
///
/// Apply the ring's records between `read` and [`place`]: then the model (spice-server's
/// count, the messages' spans) includes every call made up to the map reads, as
/// `write_seq`/`copied_seq` do, and no position lies beyond the newest message because a
/// message was started after the ring was drained.
pub fn read(cap: &mut Capture, model: &mut Model, chains: &mut Vec<Chain>) -> Option<Positions> {
    chain::pair(model, chains);
    // The chains' sockets: their map entries are read before the dump too, to tell whether the
    // process moved write_seq / copied_seq while the dump ran (then the dump's queues and the
    // map's positions are of different instants).
    let chained: Vec<u64> = chains
        .iter()
        .flat_map(|c| [Some(c.server), c.backend, c.client_leg])
        .flatten()
        .collect();
    let before: HashMap<u64, TcpSnapshot> = chained
        .iter()
        .filter_map(|&c| Some((c, cap.tcp_state(c)?)))
        .collect();
    let t_ns = monotonic_ns();
    let dump: HashMap<u64, DiagSocket> = match sockdiag::dump_tcp() {
        Ok(v) => v.into_iter().map(|d| (d.cookie, d)).collect(),
        Err(e) => {
            log::debug!("sock_diag dump failed: {e:#}");
            return None;
        }
    };
    model.gone(&|c| dump.contains_key(&c), t_ns);
    // Kernel-hook snapshots right after the dump (write_seq / copied_seq anchor the queues),
    // the chains' sockets first.
    let mut cookies = chained.clone();
    cookies.extend(
        model
            .sockets
            .iter()
            .filter(|(c, s)| s.closed_ns.is_none() && !chained.contains(c))
            .map(|(c, _)| *c),
    );
    let mut snaps = HashMap::new();
    for c in cookies {
        if model.sockets.get(&c).is_some_and(|s| s.closed_ns.is_none())
            && let Some(snap) = cap.tcp_state(c)
        {
            model.tcp_sample(c, snap);
            snaps.insert(c, snap);
        }
    }
    let moved: Vec<u64> = before
        .iter()
        .filter(|(c, b)| snaps.get(c).is_some_and(|a| !same_position(a, b)))
        .map(|(c, _)| *c)
        .collect();
    let mut dump = dump;
    if !moved.is_empty() {
        reread_moved(cap, &moved, &mut dump, &mut snaps);
    }
    let t_end_ns = monotonic_ns();
    Some(Positions {
        t_ns,
        t_end_ns,
        dump,
        snaps,
    })
}

/// Whether a socket's application-side positions are the same in two map reads.
fn same_position(a: &TcpSnapshot, b: &TcpSnapshot) -> bool {
    a.write_seq == b.write_seq && a.copied_seq == b.copied_seq
}

/// How often a moved socket is queried again before its positions are given up for a sample.
const REREAD_TRIES: usize = 3;

/// Chain sockets whose process sent or read during the dump have queues (from the dump) and
/// `write_seq`/`copied_seq` (from the map) of different instants: `snd_una` = `write_seq` −
/// send queue would count bytes written after the dump as acknowledged. Each is read again
/// alone, between two map reads (a single-socket sock_diag query takes tens of microseconds),
/// until both map reads agree. A socket that keeps moving loses its positions for this sample
/// (its chain is then not placed this time, never placed wrongly).
fn reread_moved(
    cap: &mut Capture,
    moved: &[u64],
    dump: &mut HashMap<u64, DiagSocket>,
    snaps: &mut HashMap<u64, TcpSnapshot>,
) {
    let mut query = match sockdiag::DiagQuery::new() {
        Ok(q) => Some(q),
        Err(e) => {
            log::debug!("sock_diag query socket: {e:#}");
            None
        }
    };
    for &c in moved {
        let mut fixed = false;
        if let (Some(q), Some(old)) = (query.as_mut(), dump.get(&c).cloned()) {
            for _ in 0..REREAD_TRIES {
                let Some(b) = cap.tcp_state(c) else { break };
                let d = match q.one(&old) {
                    Ok(Some(d)) => d,
                    Ok(None) => break,
                    Err(e) => {
                        log::debug!("sock_diag query of {}: {e:#}", old.local);
                        break;
                    }
                };
                let Some(a) = cap.tcp_state(c) else { break };
                if same_position(&a, &b) {
                    dump.insert(c, d);
                    snaps.insert(c, a);
                    fixed = true;
                    break;
                }
            }
        }
        if !fixed {
            log::debug!(
                "sample: socket {c} kept moving; its positions are left out of this sample"
            );
            dump.remove(&c);
        }
    }
}

/// Second half of a sample: places each chain's in-flight messages against the positions
/// [`read`] took and appends a [`ChainSample`] to each chain whose spice-server socket is
/// open. Returns what was taken.
pub fn place(model: &Model, chains: &mut [Chain], pos: Positions) -> Sample {
    let Positions {
        t_ns,
        t_end_ns,
        dump,
        snaps,
    } = pos;
    let now = |cookie: Option<u64>| -> Option<Now<'_>> {
        let c = cookie?;
        let diag = dump.get(&c)?;
        let snap = snaps.get(&c)?;
        Some(Now {
            model: model.sockets.get(&c)?,
            leg: LegSeqs::new(c, snap, diag),
            diag,
        })
    };
    let mut taken = Vec::new();
    for chain in chains.iter_mut() {
        if chain.client_leg.is_none() {
            learn_stream_starts(chain, &now);
        }
        let Some(server) = model.sockets.get(&chain.server) else {
            continue;
        };
        if server.closed_ns.is_some() {
            continue;
        }
        let inflight = chain::inflight(server);
        let count = server.placement_count();
        let s = now(Some(chain.server));
        let b = now(chain.backend);
        let c = now(chain.client_leg);
        let pos = |n: &Option<Now<'_>>, f: fn(&SocketModel, &LegSeqs) -> Option<SendPos>| {
            n.as_ref().and_then(|n| f(n.model, n.leg.as_ref()?))
        };
        let server_pos = pos(&s, send_pos);
        // Every position as an offset of spice-server's stream.
        let client_pos = pos(&c, send_pos)
            .zip(chain.client_shift(model))
            .map(|(p, shift)| shifted(p, shift));
        let backend_pos = server.s2c().and_then(|d| {
            let n = b.as_ref()?;
            recv_pos(&server.dirs[d], n.leg.as_ref()?)
        });
        let bounds = match (server_pos, chain.backend.is_some(), backend_pos, client_pos) {
            (Some(server), false, _, _) => Some(Boundaries::Direct { server }),
            (Some(server), true, Some(backend), Some(client)) if chain.is_transparent() => {
                Some(Boundaries::Relay {
                    server,
                    backend,
                    client,
                })
            }
            (Some(server), true, Some(backend), _) => {
                Some(Boundaries::OpaqueRelay { server, backend })
            }
            _ => None,
        };
        // Messages counted but not kept cannot be placed: unplaced, never hidden.
        let placement = bounds.map(|b| {
            let mut p = chain::place(&inflight, &b);
            p.unplaced += (count as usize).saturating_sub(inflight.len()) as u32;
            p
        });
        let relay_visible = chain
            .backend
            .and_then(|b| model.sockets.get(&b))
            .filter(|b| b.window.active())
            .map(|b| i64::from(b.window.count));
        let delivered = match (chain.backend.is_some(), client_pos, server_pos) {
            (true, Some(c), _) => Some(c.snd_una),
            (false, _, Some(s)) => Some(s.snd_una),
            _ => None,
        };
        let sample = ChainSample {
            t_ns,
            in_flight: i64::from(count),
            relay_visible,
            placement,
            delivered,
            kept: inflight.len() as u64,
        };
        chain.stats.add(&sample);
        let last_byte_seq = |m: Option<&MsgSpan>| {
            let base = server.s2c().and_then(|d| server.dirs[d].seq_base)?;
            Some(base.wrapping_add(m?.end as u32).wrapping_sub(1))
        };
        taken.push(ChainTake {
            server: chain.server,
            sample,
            stages: bounds.as_ref().map_or(&[], |b| b.stages()),
            server_leg: s.as_ref().and_then(|n| n.leg),
            backend_leg: b.as_ref().and_then(|n| n.leg),
            client_leg: c.as_ref().and_then(|n| n.leg),
            newest_last_byte_seq: last_byte_seq(inflight.last()),
            oldest_last_byte_seq: last_byte_seq(inflight.first()),
        });
        let link = if chain.backend.is_some() {
            c.as_ref()
        } else {
            s.as_ref()
        };
        if let Some(info) = link.and_then(|n| n.diag.info) {
            if info.delivery_rate > 0 {
                chain.stats.add_delivery_rate(info.delivery_rate);
            }
            chain.link_info = Some(match chain.link_info {
                Some((first, _)) => (first, info),
                None => (info, info),
            });
        }
    }
    Sample {
        t_ns,
        t_end_ns,
        dump,
        chains: taken,
    }
}
