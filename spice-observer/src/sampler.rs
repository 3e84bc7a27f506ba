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
        DirStats, Model, SocketModel,
        chain::{self, Boundaries, Chain, ChainSample, RECV, RecvPos, SEND, SendPos},
    },
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

fn send_pos(s: &SocketModel, snap: &TcpSnapshot, d: &DiagSocket) -> Option<SendPos> {
    let written = stream_pos(&s.dirs[SEND], snap.write_seq)?;
    let notsent = d.info.as_ref()?.notsent_bytes as u64;
    Some(SendPos {
        written,
        snd_nxt: written.saturating_sub(notsent),
        snd_una: written.saturating_sub(d.send_queue as u64),
    })
}

fn recv_pos(s: &SocketModel, snap: &TcpSnapshot, d: &DiagSocket) -> Option<RecvPos> {
    let copied = stream_pos(&s.dirs[RECV], snap.copied_seq)?;
    Some(RecvPos {
        rcv_nxt: copied + d.recv_queue as u64,
        copied,
    })
}

/// Everything one sample needs about one socket.
struct Now<'a> {
    model: &'a SocketModel,
    snap: TcpSnapshot,
    diag: &'a DiagSocket,
}

/// Takes one sample of every chain: pairs new sockets, then places each chain's in-flight
/// messages. `now_ns` is CLOCK_MONOTONIC. Returns the sock_diag dump for other uses (TCP
/// state of unchained sockets), or `None` if the dump failed.
pub fn sample(
    cap: &mut Capture,
    model: &mut Model,
    chains: &mut Vec<Chain>,
    now_ns: u64,
) -> Option<HashMap<u64, DiagSocket>> {
    chain::pair(model, chains);
    let dump: HashMap<u64, DiagSocket> = match sockdiag::dump_tcp() {
        Ok(v) => v.into_iter().map(|d| (d.cookie, d)).collect(),
        Err(e) => {
            log::debug!("sock_diag dump failed: {e:#}");
            return None;
        }
    };
    // Kernel-hook snapshots right after the dump (write_seq / copied_seq anchor the queues).
    let cookies: Vec<u64> = model
        .sockets
        .iter()
        .filter(|(_, s)| s.closed_ns.is_none())
        .map(|(c, _)| *c)
        .collect();
    let mut snaps = HashMap::new();
    for c in cookies {
        if let Some(snap) = cap.tcp_state(c) {
            model.tcp_sample(c, snap);
            snaps.insert(c, snap);
        }
    }
    let now = |cookie: Option<u64>| -> Option<Now<'_>> {
        let c = cookie?;
        Some(Now {
            model: model.sockets.get(&c)?,
            snap: *snaps.get(&c)?,
            diag: dump.get(&c)?,
        })
    };
    for chain in chains.iter_mut() {
        let Some(server) = model.sockets.get(&chain.server) else {
            continue;
        };
        if server.closed_ns.is_some() {
            continue;
        }
        let inflight = chain::inflight(server);
        let count = server.window.count;
        let s = now(Some(chain.server));
        let b = now(chain.backend);
        let c = now(chain.client_leg);
        let server_pos = s.as_ref().and_then(|n| send_pos(n.model, &n.snap, n.diag));
        let backend_pos = b.as_ref().and_then(|n| recv_pos(n.model, &n.snap, n.diag));
        let client_pos = c.as_ref().and_then(|n| send_pos(n.model, &n.snap, n.diag));
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
        chain.samples.push(ChainSample {
            t_ns: now_ns,
            in_flight: i64::from(count),
            relay_visible,
            placement,
            delivered,
        });
        let link = if chain.backend.is_some() {
            c.as_ref()
        } else {
            s.as_ref()
        };
        if let Some(info) = link.and_then(|n| n.diag.info) {
            if info.delivery_rate > 0 {
                chain.delivery_rates.push(info.delivery_rate);
            }
            chain.link_info = Some(match chain.link_info {
                Some((first, _)) => (first, info),
                None => (info, info),
            });
        }
    }
    Some(dump)
}
