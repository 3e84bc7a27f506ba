//! Periodic samples: TCP positions of every watched socket, and the stage placement of each
//! chain's in-flight messages.
//!
//! Positions come from two sources read back to back: netlink sock_diag (the queues, one
//! query per socket by its cookie and addresses, [`crate::sockdiag::DiagQuery`]:
//! `idiag_wqueue` = write_seq − snd_una, `tcpi_notsent_bytes` = write_seq − snd_nxt,
//! `idiag_rqueue` = rcv_nxt − copied_seq; `net/ipv4/tcp_diag.c` `tcp_diag_get_info`) and the
//! TCP state the kernel hooks keep in each socket's `SOCKETS` entry (`write_seq` and
//! `copied_seq`, which change only in the application's own send and receive calls, all of
//! which the hooks see). The map anchors the
//! positions in each stream; sock_diag gives the queues at the moment of the sample.

use std::{collections::HashMap, net::SocketAddr};

use spice_ebpf_common::event::{SockState, TcpSnapshot};

use crate::{
    loader::{Capture, same_counts},
    model::{
        DirStats, Model, MsgSpan, SocketModel,
        chain::{self, Boundaries, Chain, ChainSample, RecvPos, SEND, SendPos},
    },
    pipeline::monotonic_ns,
    sockdiag::{self, DiagSocket},
};

/// Converts a 32-bit TCP sequence number to a stream offset of direction `dir`, anchored at
/// the newest framed message (valid within ±2 GiB of it).
///
/// A direction of a TLS socket ([`DirStats::tls`]) counts plaintext offsets: the TCP
/// position converts to the plaintext offset of the newest libssl call whose records end at
/// or before it ([`crate::model::tls::TlsDir::plain_at`]; precise to one call's records),
/// never through `seq_base`. The positions of the other end of the same TCP connection (a
/// relay's `rcv_nxt`, `copied_seq`) convert with this direction's marks too.
pub fn stream_pos(dir: &DirStats, seq: u32) -> Option<u64> {
    if let Some(t) = &dir.tls {
        return t.plain_at(seq);
    }
    let base = dir.seq_base?;
    let anchor = dir.recent.back().map_or(0, |m| m.end);
    let delta = seq.wrapping_sub(base).wrapping_sub(anchor as u32) as i32 as i64;
    Some((anchor as i64 + delta).max(0) as u64)
}

/// The TCP sequence number of the last byte of the stream up to offset `end` of direction
/// `dir` (`end` > 0): `seq_base + end − 1`; on a TLS direction the last byte of the records
/// of the libssl call that moved plaintext offset `end − 1` (the first mark reaching `end`,
/// [`crate::model::tls::TlsDir::seq_at`]). `None` when not known.
pub fn last_byte_seq(dir: &DirStats, end: u64) -> Option<u32> {
    match &dir.tls {
        Some(t) => Some(t.seq_at(end)?.wrapping_sub(1)),
        None => Some(dir.seq_base?.wrapping_add(end as u32).wrapping_sub(1)),
    }
}

/// The raw 32-bit TCP sequence numbers of one socket at one sample, as the sample used them.
///
/// `write_seq` and `copied_seq` are the kernel hooks' TCP state of the socket (read right after
/// the sock_diag queries); the other three combine them with the sock_diag answer's queues
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
    /// From a map snapshot and the sock_diag answer of the same socket; `None` without the
    /// answer's `tcp_info` (no notsent).
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
/// spice-server receives. `None` for a TLS socket: its byte counters count TLS records, its
/// offsets plaintext.
fn stream_start(n: &Now<'_>) -> Option<i64> {
    if n.model.is_tls() {
        return None;
    }
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
    /// message, on spice-server's sending direction ([`last_byte_seq`]: `seq_base` + end
    /// offset − 1, or on a TLS socket the last byte of the records that carry it).
    pub newest_last_byte_seq: Option<u32>,
    pub oldest_last_byte_seq: Option<u32>,
}

/// One sample of every chain.
#[derive(Debug)]
pub struct Sample {
    /// CLOCK_MONOTONIC ns right before the first sock_diag query.
    pub t_ns: u64,
    /// CLOCK_MONOTONIC ns right after the last read of the sockets' TCP state (`SOCKETS`).
    pub t_end_ns: u64,
    /// The sock_diag answers by cookie: the sockets [`Sampler::read`] queried that still
    /// exist and did not move during their query.
    pub diag: HashMap<u64, DiagSocket>,
    /// One entry per chain sampled (open spice-server socket), in `chains` order.
    pub chains: Vec<ChainTake>,
}

/// Everything one sample needs about one socket.
struct Now<'a> {
    model: &'a SocketModel,
    leg: Option<LegSeqs>,
    diag: &'a DiagSocket,
}

/// The positions one sample read, before placing: see [`Sampler::read`].
#[derive(Debug)]
pub struct Positions {
    /// CLOCK_MONOTONIC ns right before the first query and right after the last map read.
    t_ns: u64,
    t_end_ns: u64,
    diag: HashMap<u64, DiagSocket>,
    snaps: HashMap<u64, TcpSnapshot>,
}

/// What the samples keep between them: the netlink socket of their sock_diag queries,
/// opened at the first sample and again after a query failed.
#[derive(Default)]
pub struct Sampler {
    query: Option<sockdiag::DiagQuery>,
}

impl Sampler {
    /// A sampler; its netlink socket is opened by the first sample.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes one sample of every chain: [`Self::read`], then [`place`] (without draining the
    /// ring in between: see [`Self::read`] for why the caller should).
    pub fn sample(
        &mut self,
        cap: &mut Capture,
        model: &mut Model,
        chains: &mut Vec<Chain>,
    ) -> Option<Sample> {
        let pos = self.read(cap, model, chains)?;
        Some(place(model, chains, pos))
    }

    /// First half of a sample: pairs new sockets, then reads the positions: the queues of
    /// the sockets a placement may use (the chains' sockets, the candidate client legs of a
    /// chain not paired yet) and of the open sockets found by the dump at a watch (to tell
    /// when they are gone: they have no close record), each by a sock_diag query by cookie
    /// and addresses, all in a few system calls ([`sockdiag::DiagQuery::sockets`]; a socket
    /// whose addresses are not known is not queried), then the `SOCKETS` entry of every open
    /// socket ([`Capture::sock_entries`]: its TCP state, and the kernel's framing, byte totals
    /// and window, which go to [`Model::kernel_state`]). Returns `None` if a query failed
    /// (then no chain gets a sample).
    ///
    /// A chain's socket is read twice (before and after the queries), and the kernel's counts
    /// and window are taken from those reads where they agree; any other open socket, and a
    /// chain's socket whose two reads differ, is read again until two reads agree
    /// ([`Capture::sock_states`]). Before, every socket's kernel state was read twice more
    /// after the sample: about 20 of the 55 `bpf(2)` lookups of a sample of 10 busy channels.
    ///
    /// Apply the ring's records between `read` and [`place`]: then the model (spice-server's
    /// count, the messages' spans) includes every call made up to the map reads, as
    /// `write_seq`/`copied_seq` do, and no position lies beyond the newest message because a
    /// message was started after the ring was drained.
    pub fn read(
        &mut self,
        cap: &mut Capture,
        model: &mut Model,
        chains: &mut Vec<Chain>,
    ) -> Option<Positions> {
        chain::pair(model, chains);
        // The chains' sockets: their map entries are read before the queries too, to tell
        // whether the process moved write_seq / copied_seq meanwhile (then the answer's queues
        // and the map's positions are of different instants).
        let chained: Vec<u64> = chains
            .iter()
            .flat_map(|c| [Some(c.server), c.backend, c.client_leg])
            .flatten()
            .collect();
        let mut queried: Vec<u64> = chained.clone();
        for c in chains.iter().filter(|c| c.client_leg.is_none()) {
            queried.extend(c.candidate_legs());
        }
        queried.extend(
            model
                .sockets
                .values()
                .filter(|s| s.found_by_dump && s.closed_ns.is_none())
                .map(|s| s.cookie),
        );
        queried.sort_unstable();
        queried.dedup();
        let queried: Vec<(u64, SocketAddr, SocketAddr)> = queried
            .into_iter()
            .filter_map(|c| {
                let s = model.sockets.get(&c).filter(|s| s.closed_ns.is_none())?;
                Some((c, s.local?, s.remote?))
            })
            .collect();
        let before = cap.sock_entries(&chained);
        let t_ns = monotonic_ns();
        let mut diag = HashMap::with_capacity(queried.len());
        let mut gone = Vec::new();
        if !queried.is_empty() {
            let q = match self.query.as_mut() {
                Some(q) => q,
                None => match sockdiag::DiagQuery::new() {
                    Ok(q) => self.query.insert(q),
                    Err(e) => {
                        log::debug!("sock_diag query socket: {e:#}");
                        return None;
                    }
                },
            };
            match q.sockets(&queried) {
                Ok(answers) => {
                    for (&(c, _, _), a) in queried.iter().zip(answers) {
                        match a {
                            Some(d) => {
                                diag.insert(c, d);
                            }
                            None => gone.push(c),
                        }
                    }
                }
                Err(e) => {
                    log::debug!("sock_diag queries: {e:#}");
                    self.query = None;
                    return None;
                }
            }
        }
        model.gone(&|c| !gone.contains(&c), t_ns);
        // Kernel-hook snapshots of every open socket right after the queries (write_seq /
        // copied_seq anchor the queues), in one read of the map.
        let open: Vec<u64> = model
            .sockets
            .values()
            .filter(|s| s.closed_ns.is_none())
            .map(|s| s.cookie)
            .collect();
        let after = cap.sock_entries(&open);
        let read_ns = monotonic_ns();
        kernel_states(cap, model, &open, &before, &after, read_ns);
        let mut snaps: HashMap<u64, TcpSnapshot> = after
            .iter()
            .filter(|(_, st)| st.tcp.ts_ns != 0)
            .map(|(&c, st)| (c, st.tcp))
            .collect();
        for (&c, &snap) in &snaps {
            model.tcp_sample(c, snap);
        }
        let moved: Vec<u64> = before
            .iter()
            .filter(|(c, b)| {
                b.tcp.ts_ns != 0 && snaps.get(c).is_some_and(|a| !same_position(a, &b.tcp))
            })
            .map(|(c, _)| *c)
            .collect();
        if !moved.is_empty() {
            reread_moved(cap, self.query.as_mut(), &moved, &mut diag, &mut snaps);
        }
        let t_end_ns = monotonic_ns();
        Some(Positions {
            t_ns,
            t_end_ns,
            diag,
            snaps,
        })
    }
}

/// Hands the kernel's state of each `open` socket to the model ([`Model::kernel_state`]),
/// read at `read_ns`: its `after` value where the `before` value (a chain's socket, read
/// before the sample's queries) agrees on the counts and window ([`same_counts`]: the
/// programs were not writing them during either read); the other sockets with an entry are
/// read again until two reads agree ([`Capture::sock_states`]: two walks of the map where
/// batch reads pay, else each socket alone). Called before the ring is drained again: the
/// model is then behind or at the read, and compares it once it has applied the records of
/// the messages the read counts ([`crate::model::KernelCheck`]).
fn kernel_states(
    cap: &mut Capture,
    model: &mut Model,
    open: &[u64],
    before: &HashMap<u64, SockState>,
    after: &HashMap<u64, SockState>,
    read_ns: u64,
) {
    let mut again = Vec::new();
    for &c in open {
        match (before.get(&c), after.get(&c)) {
            (Some(b), Some(a)) if same_counts(a, b) => model.kernel_state(c, a, read_ns),
            (_, Some(_)) => again.push(c),
            (_, None) => {}
        }
    }
    for (c, st) in cap.sock_states(&again) {
        model.kernel_state(c, &st, read_ns);
    }
}

/// Whether a socket's application-side positions are the same in two map reads.
fn same_position(a: &TcpSnapshot, b: &TcpSnapshot) -> bool {
    a.write_seq == b.write_seq && a.copied_seq == b.copied_seq
}

/// How often a moved socket is queried again before its positions are given up for a sample.
const REREAD_TRIES: usize = 3;

/// Chain sockets whose process sent or read while the sample's queries ran have queues (from
/// sock_diag) and `write_seq`/`copied_seq` (from the map) of different instants: `snd_una` =
/// `write_seq` − send queue would count bytes written after the query as acknowledged. Each
/// is queried again alone, between two map reads (a single-socket sock_diag query takes a few
/// microseconds), until both map reads agree. A socket that keeps moving loses its positions
/// for this sample (its chain is then not placed this time, never placed wrongly).
fn reread_moved(
    cap: &mut Capture,
    query: Option<&mut sockdiag::DiagQuery>,
    moved: &[u64],
    diag: &mut HashMap<u64, DiagSocket>,
    snaps: &mut HashMap<u64, TcpSnapshot>,
) {
    let mut query = query;
    for &c in moved {
        let mut fixed = false;
        if let (Some(q), Some(old)) = (query.as_deref_mut(), diag.get(&c).cloned()) {
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
                    diag.insert(c, d);
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
            diag.remove(&c);
        }
    }
}

/// Second half of a sample: places each chain's in-flight messages against the positions
/// [`Sampler::read`] took and appends a [`ChainSample`] to each chain whose spice-server socket is
/// open. Returns what was taken.
pub fn place(model: &Model, chains: &mut [Chain], pos: Positions) -> Sample {
    let Positions {
        t_ns,
        t_end_ns,
        diag,
        snaps,
    } = pos;
    let now = |cookie: Option<u64>| -> Option<Now<'_>> {
        let c = cookie?;
        let diag = diag.get(&c)?;
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
        let last_byte_seq =
            |m: Option<&MsgSpan>| last_byte_seq(&server.dirs[server.s2c()?], m?.end);
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
        diag,
        chains: taken,
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use spice_ebpf_common::{
        event::{EventHeader, LinkEvent, MessageEvent, TlsMarkEvent, dir, tls_func},
        framing::Role,
        protocol::{channel, msg_server},
        window::WindowState,
    };

    use super::*;
    use crate::{events::Event, model::chain::STAGES, sockdiag::TcpInfo};

    const XORG: u32 = 10;
    const STUNNEL: u32 = 20;
    /// spice-server's socket, the relay's TLS leg toward it, the relay's plaintext leg toward
    /// the client.
    const S: u64 = 1;
    const B: u64 = 2;
    const C: u64 = 3;
    /// Bytes of TLS record around each SSL_write's plaintext (TLS 1.3 AES-GCM: 5 header,
    /// 1 content type, 16 tag).
    const REC: u32 = 22;
    /// The link message and reply: 16-byte header + 30.
    const LINK: u64 = 46;
    /// Sequence number of the client leg's stream offset 0.
    const C0: u32 = 777_000;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn hdr(cookie: u64, pid: u32, d: u8, ts: u64) -> EventHeader {
        EventHeader {
            tgid: pid,
            cookie,
            dir: d,
            ts_ns: ts,
            ..Default::default()
        }
    }

    /// One server → client message as spice-server wrote it: plaintext span and the TCP
    /// positions after its header's and its body's TLS records.
    #[derive(Clone, Copy, Debug)]
    struct Sent {
        at: u64,
        end: u64,
        hdr_seq: u32,
        end_seq: u32,
        ty: u16,
        size: u32,
        prefix: [u32; 2],
    }

    /// spice-server (Xspice) with a TLS port, stunnel terminating TLS in front of it
    /// (its leg toward spice-server is TLS, hooked in stunnel's libssl; its leg toward the
    /// client plain), one display channel.
    struct Rig {
        m: Model,
        ts: u64,
        /// spice-server's write_seq after its newest SSL_write, and the plaintext offset.
        seq: u32,
        plain: u64,
        sent: Vec<Sent>,
        win: [WindowState; 3],
    }

    impl Rig {
        fn new(first_seq: u32) -> Self {
            let mut m = Model::default();
            for (cookie, pid, l, r) in [
                (S, XORG, 5900, 40000),
                (B, STUNNEL, 40000, 5900),
                (C, STUNNEL, 6900, 50000),
            ] {
                m.apply(&Event::Socket {
                    hdr: hdr(cookie, pid, 0, 1),
                    tid: pid,
                    local: addr(l),
                    remote: addr(r),
                    comm: String::new(),
                });
            }
            // Both ends of the TLS connection: the first traced calls are the handshake's.
            m.apply(&Event::Tls {
                hdr: hdr(S, XORG, 0, 2),
                func: tls_func::CONTEXT,
            });
            m.apply(&Event::Tls {
                hdr: hdr(B, STUNNEL, 0, 2),
                func: tls_func::CONTEXT,
            });
            let mut r = Rig {
                m,
                ts: 10,
                seq: first_seq,
                plain: 0,
                sent: Vec::new(),
                win: Default::default(),
            };
            // The client's link message: read on C, written on B (one SSL_write), read by
            // spice-server (one SSL_read); the reply the other way.
            let link = |r: &mut Rig, cookie, pid, d, role: Role| {
                r.m.apply(&Event::Link(LinkEvent {
                    hdr: hdr(cookie, pid, d, 3),
                    role: role as u8,
                    channel_type: channel::DISPLAY,
                    link_size: 30,
                    end: LINK,
                    ..Default::default()
                }));
            };
            link(&mut r, C, STUNNEL, dir::RECV, Role::ClientToServer);
            link(&mut r, B, STUNNEL, dir::SEND, Role::ClientToServer);
            r.mark(
                B,
                STUNNEL,
                dir::SEND,
                LINK,
                5000 + LINK as u32 + REC,
                LINK as u32,
            );
            link(&mut r, S, XORG, dir::RECV, Role::ClientToServer);
            r.mark(
                S,
                XORG,
                dir::RECV,
                LINK,
                5000 + LINK as u32 + REC,
                LINK as u32,
            );
            link(&mut r, S, XORG, dir::SEND, Role::ServerToClient);
            let (end, seq) = r.write(LINK);
            link(&mut r, B, STUNNEL, dir::RECV, Role::ServerToClient);
            r.mark(B, STUNNEL, dir::RECV, end, seq, LINK as u32);
            link(&mut r, C, STUNNEL, dir::SEND, Role::ServerToClient);
            r
        }

        fn mark(&mut self, cookie: u64, pid: u32, d: u8, plain_end: u64, seq: u32, len: u32) {
            self.ts += 1;
            self.m.apply(&Event::TlsMark(TlsMarkEvent {
                hdr: hdr(cookie, pid, d, self.ts),
                plain_end,
                seq,
                len,
            }));
        }

        /// One SSL_write of `n` plaintext bytes by spice-server: one TLS record.
        fn write(&mut self, n: u64) -> (u64, u32) {
            self.plain += n;
            self.seq = self.seq.wrapping_add(n as u32 + REC);
            let (p, s) = (self.plain, self.seq);
            self.mark(S, XORG, dir::SEND, p, s, n as u32);
            (p, s)
        }

        /// A message record of `cookie`'s direction `d`; `w`: whose window it runs in.
        fn record(&mut self, cookie: u64, pid: u32, d: u8, w: usize, x: &Sent, index: u64) {
            self.ts += 1;
            let fx = self.win[w].apply(
                Role::ServerToClient as u8,
                self.ts,
                channel::DISPLAY,
                x.ty,
                x.prefix,
            );
            let seq = if cookie == C {
                C0.wrapping_add(x.at as u32)
            } else {
                // Meaningless on a TLS socket: must not be used.
                0xdead_beef
            };
            self.m.apply(&Event::Message(MessageEvent {
                hdr: hdr(cookie, pid, d, self.ts),
                at: x.at,
                index,
                size: x.size,
                msg_type: x.ty,
                hdr_len: 6,
                prefix: x.prefix,
                seq,
                win_mw: self.win[w].messages_window,
                win_count: self.win[w].count,
                win_effects: fx,
                ..Default::default()
            }));
        }

        /// spice-server starts a message: one SSL_write for the header, one for the body
        /// unless `body_pending` (that call has not returned yet: no mark).
        fn send(&mut self, ty: u16, size: u32, prefix: [u32; 2], body_pending: bool) {
            let at = self.plain;
            let mut x = Sent {
                at,
                end: at + 6 + u64::from(size),
                hdr_seq: 0,
                end_seq: 0,
                ty,
                size,
                prefix,
            };
            x.hdr_seq = self.write(6).1;
            let index = self.sent.len() as u64 + 1;
            self.record(S, XORG, dir::SEND, 0, &x, index);
            if !body_pending {
                x.end_seq = self.write(u64::from(size)).1;
            }
            self.sent.push(x);
        }

        /// stunnel reads message `i` (two SSL_reads: its records) from its TLS leg.
        fn relay_reads(&mut self, i: usize) {
            let x = self.sent[i];
            self.mark(B, STUNNEL, dir::RECV, x.at + 6, x.hdr_seq, 6);
            self.record(B, STUNNEL, dir::RECV, 1, &x, i as u64 + 1);
            self.mark(B, STUNNEL, dir::RECV, x.end, x.end_seq, x.size);
        }

        /// stunnel writes message `i` toward the client (plain).
        fn relay_writes(&mut self, i: usize) {
            let x = self.sent[i];
            self.record(C, STUNNEL, dir::SEND, 2, &x, i as u64 + 1);
        }
    }

    fn diag(
        cookie: u64,
        l: u16,
        r: u16,
        send_queue: u32,
        recv_queue: u32,
        notsent: u32,
    ) -> DiagSocket {
        DiagSocket {
            cookie,
            inode: 0,
            state: 1,
            local: addr(l),
            remote: addr(r),
            recv_queue,
            send_queue,
            info: Some(TcpInfo {
                notsent_bytes: notsent,
                ..Default::default()
            }),
            more: None,
        }
    }

    fn snap(write_seq: u32, copied_seq: u32) -> TcpSnapshot {
        TcpSnapshot {
            write_seq,
            copied_seq,
            ..Default::default()
        }
    }

    /// Eight in-flight messages (SET_ACK, W = 4, then seven draws), one in each stage of a
    /// chain whose spice-server socket is TLS (stunnel in front). spice-server's write_seq,
    /// snd_nxt and snd_una and stunnel's copied_seq convert to plaintext offsets with
    /// spice-server's marks; the client leg is plain and pairs by its link message. The TCP
    /// sequence numbers wrap around 2³² in the middle.
    #[test]
    fn a_chain_whose_server_socket_is_tls_places_every_stage() {
        let mut r = Rig::new(u32::MAX - 1500);
        r.send(msg_server::SET_ACK, 8, [1, 4], false);
        for (i, size) in [100u32, 2000, 300, 50, 400, 1000, 700]
            .into_iter()
            .enumerate()
        {
            r.send(302, size, [0, 0], i == 6);
        }
        for i in 0..4 {
            r.relay_reads(i);
        }
        for i in 0..3 {
            r.relay_writes(i);
        }
        let x = r.sent.clone();
        assert!(
            x[2].end_seq < x[0].end_seq,
            "the sequence numbers wrap inside the run"
        );
        // Offsets are plaintext; no sequence base on a TLS socket whatever its records say.
        let s = &r.m.sockets[&S];
        assert_eq!(s.transport(), "tls");
        assert!(s.dirs.iter().all(|d| d.seq_base.is_none()));
        assert_eq!(s.dirs[SEND].recent.front().unwrap().at, LINK);
        assert_eq!(r.m.sockets[&C].transport(), "tcp");
        assert_eq!(r.m.sockets[&C].dirs[SEND].seq_base, Some(C0));

        let mut chains = Vec::new();
        chain::pair(&r.m, &mut chains);
        assert_eq!(chains.len(), 1);
        assert_eq!(
            (chains[0].backend, chains[0].client_leg),
            (Some(B), Some(C))
        );
        assert!(chains[0].is_transparent());
        assert_eq!(chains[0].client_shift(&r.m), Some(0));

        // spice-server: m7's body call still writing (write_seq 10 bytes into its record),
        // sent up to m5's end, acknowledged 3 bytes into m5's header record.
        let write_seq = x[7].hdr_seq.wrapping_add(10);
        let snd_nxt = x[5].end_seq;
        let snd_una = x[4].end_seq.wrapping_add(3);
        // stunnel: read up to m3's end, m4 arrived.
        let (copied, rcv_nxt) = (x[3].end_seq, x[4].end_seq);
        // The client leg: written up to m2, sent up to m1, acknowledged up to m0.
        let c = |i: usize| C0.wrapping_add(x[i].end as u32);
        let pos = Positions {
            t_ns: 100,
            t_end_ns: 101,
            diag: [
                diag(
                    S,
                    5900,
                    40000,
                    write_seq.wrapping_sub(snd_una),
                    0,
                    write_seq.wrapping_sub(snd_nxt),
                ),
                diag(B, 40000, 5900, 0, rcv_nxt.wrapping_sub(copied), 0),
                diag(
                    C,
                    6900,
                    50000,
                    c(2).wrapping_sub(c(0)),
                    0,
                    c(2).wrapping_sub(c(1)),
                ),
            ]
            .into_iter()
            .map(|d| (d.cookie, d))
            .collect(),
            snaps: [
                (S, snap(write_seq, 5000 + LINK as u32 + REC)),
                (B, snap(5000 + LINK as u32 + REC, copied)),
                (C, snap(c(2), 0)),
            ]
            .into_iter()
            .collect(),
        };
        let sample = place(&r.m, &mut chains, pos);
        let take = &sample.chains[0];
        assert_eq!(take.stages.len(), STAGES.len());
        let p = take.sample.placement.expect("placed");
        assert_eq!(p.counts, [1; 8], "{p:?}");
        assert_eq!((p.clamped, p.unplaced), (0, 0));
        // Bytes per stage: from m7's end down to the oldest message's start, cut at each
        // converted position (precise to one SSL_write: m7's header call is the last done).
        assert_eq!(p.bytes[0], x[7].end - (x[7].at + 6));
        assert_eq!(p.bytes[2], x[5].end - x[4].end);
        assert_eq!(p.bytes[3], x[4].end - x[3].end);
        // The oldest in-flight message's last byte: its body record's last byte; the newest
        // one's body call has not returned, so where it ends in TCP is not known yet.
        assert_eq!(
            take.oldest_last_byte_seq,
            Some(x[0].end_seq.wrapping_sub(1))
        );
        assert_eq!(take.newest_last_byte_seq, None);
        assert_eq!(take.sample.relay_visible, Some(4));
    }

    /// A TLS socket's message records carry a `seq` that means nothing: a plain socket of
    /// another process whose sequence base happens to equal what those records would give is
    /// not taken for the relay's leg toward spice-server (only mirrored addresses pair).
    #[test]
    fn no_pairing_by_sequence_number_across_a_tls_socket() {
        let mut r = Rig::new(1000);
        r.send(msg_server::SET_ACK, 8, [1, 4], false);
        // An unrelated plain socket at the client end of some other connection, framed with
        // the sequence base the TLS records' meaningless seq would give.
        let other = 9;
        r.m.apply(&Event::Socket {
            hdr: hdr(other, 30, 0, 1),
            tid: 30,
            local: addr(41000),
            remote: addr(7000),
            comm: String::new(),
        });
        for (d, role) in [
            (dir::SEND, Role::ClientToServer),
            (dir::RECV, Role::ServerToClient),
        ] {
            r.m.apply(&Event::Link(LinkEvent {
                hdr: hdr(other, 30, d, 3),
                role: role as u8,
                channel_type: channel::DISPLAY,
                link_size: 30,
                end: LINK,
                ..Default::default()
            }));
        }
        r.m.apply(&Event::Message(MessageEvent {
            hdr: hdr(other, 30, dir::RECV, 50),
            at: LINK,
            index: 1,
            size: 8,
            msg_type: msg_server::SET_ACK,
            hdr_len: 6,
            seq: 0xdead_beef,
            ..Default::default()
        }));
        // The stunnel legs are gone: only the unrelated socket could be a backend.
        r.m.sockets.remove(&B);
        r.m.sockets.remove(&C);
        let mut chains = Vec::new();
        chain::pair(&r.m, &mut chains);
        assert_eq!(chains.len(), 1);
        assert_eq!(chains[0].backend, None);
    }
}
