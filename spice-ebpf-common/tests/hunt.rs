//! Host tests of hunting: framing a stream joined at an unknown offset, and re-locking after a
//! header that fails validation (`DirState::hunt`, `DirState::hunt_call_start`,
//! `framing::feed_call`). The same code runs in the kernel.
//!
//! Run with `cargo test -p spice-ebpf-common --features std --test hunt`.
#![cfg(feature = "std")]

use spice_ebpf_common::event::lock_how;
use spice_ebpf_common::framing::{
    DirState, MessageInfo, Output, PeerView, Phase, Role, UnparsedReason, feed, feed_call,
};
use spice_ebpf_common::protocol::{channel, msg_client};
use spice_ebpf_common::wire::{self, HeaderKind, MessageWriter, Session, SplitMix64 as Rng};

/// One message of a generated stream: where it starts, its type and body size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Truth {
    at: u64,
    msg_type: u16,
    size: u32,
}

/// A display server → client stream like spice-server's: draws, stream data, INVAL_LISTs,
/// PINGs, MARKs, with bodies of random bytes (worse than real bodies for false candidates).
fn display_stream(rng: &mut Rng, kind: HeaderKind, n: usize) -> (Vec<Vec<u8>>, Vec<Truth>) {
    let mut w = MessageWriter::new(kind);
    let mut at = 0u64;
    let mut msgs = Vec::new();
    let mut truth = Vec::new();
    for _ in 0..n {
        let (t, size) = match rng.below(6) {
            0 => (302u16, 40 + rng.below(2000) as usize),
            1 => (304, 60 + rng.below(60_000) as usize),
            2 => (123, 12 + rng.below(30_000) as usize),
            3 => (105, 2 + 9 * rng.below(20) as usize),
            4 => (4, 12),
            _ => (102, 0),
        };
        let m = w.message(t, &rng.bytes(size));
        truth.push(Truth {
            at,
            msg_type: t,
            size: size as u32,
        });
        at += m.len() as u64;
        msgs.push(m);
    }
    (msgs, truth)
}

fn joined(role: Role) -> DirState {
    let mut st = DirState {
        role: role as u8,
        ..Default::default()
    };
    assert!(matches!(
        st.hunt(UnparsedReason::AttachedMidStream, 0, 0),
        Output::Hunt { .. }
    ));
    st
}

/// Feeds one call; returns the messages it reported.
fn call(st: &mut DirState, bytes: &[u8], anchor: u8, hdr: u8) -> Vec<MessageInfo> {
    let mut out = Vec::new();
    feed_call(st, &PeerView::default(), &[bytes], anchor, hdr, |o| {
        if let Output::Message(m) = o {
            out.push(m)
        }
    });
    out
}

/// The messages of `truth` that start at or after stream offset `cut`, with offsets relative
/// to `cut` (the joined stream's offset 0).
fn joined_at(truth: &[Truth], cut: u64) -> Vec<Truth> {
    truth
        .iter()
        .filter(|t| t.at >= cut)
        .map(|t| Truth {
            at: t.at - cut,
            ..*t
        })
        .collect()
}

/// Checks that the reported messages are exactly the truth (in joined offsets) from the lock
/// on: the first one carries `lock`, every later message follows without a gap. Returns the
/// truth index of the lock message.
fn check_from_lock(got: &[MessageInfo], truth: &[Truth], how: u8) -> usize {
    let first = got.first().expect("locked");
    assert_eq!(first.lock, how, "lock kind");
    let k = truth
        .iter()
        .position(|t| t.at == first.at)
        .expect("the lock is on a true boundary");
    assert_eq!(
        got.len(),
        truth.len() - k,
        "every message after the lock is reported"
    );
    for (i, (g, t)) in got.iter().zip(&truth[k..]).enumerate() {
        assert_eq!((g.at, g.msg_type, g.size), (t.at, t.msg_type, t.size));
        assert_eq!(g.index, first.index + i as u64);
        assert_eq!(g.lock, if i == 0 { how } else { 0 });
    }
    k
}

#[test]
fn spice_server_sends_lock_at_the_third_anchored_message() {
    let mut rng = Rng(7);
    let (msgs, truth) = display_stream(&mut rng, HeaderKind::Mini, 300);
    let mut st = joined(Role::ServerToClient);
    // Joined in the middle of message 0: its tail is the first call, then one writev per
    // message, each after a complete one.
    let cut = msgs[0].len() / 2;
    let mut got = call(&mut st, &msgs[0][cut..], lock_how::CONTENT, 0);
    for m in &msgs[1..] {
        got.extend(call(&mut st, m, lock_how::SEND_AFTER_COMPLETE, 0));
    }
    let truth = joined_at(&truth, cut as u64);
    let k = check_from_lock(&got, &truth, lock_how::SEND_AFTER_COMPLETE);
    assert_eq!(
        k, 2,
        "messages 1 and 2 validate, 3 locks (truth[0] is message 1)"
    );
    assert_eq!(st.phase(), Phase::DataHeader);
    assert_eq!(st.unframed, truth[2].at);
    assert_eq!(st.resyncs, 0);
}

#[test]
fn relay_reads_lock_on_content_alone() {
    for seed in 0..20u64 {
        let mut rng = Rng(100 + seed);
        let (msgs, truth) = display_stream(&mut rng, HeaderKind::Mini, 400);
        let stream: Vec<u8> = msgs.concat();
        // Joined at a random offset; the relay reads chunks of up to 8 KiB, cut anywhere,
        // except that one read in four drains what the sender has written so far and so ends
        // at a message end (spice-server writes whole messages when the socket has room).
        let ends: Vec<usize> = truth
            .iter()
            .map(|t| (t.at + 6 + t.size as u64) as usize)
            .collect();
        let start = rng.below(stream.len() as u64 / 4) as usize;
        let mut st = joined(Role::ServerToClient);
        let mut got = Vec::new();
        let mut pos = start;
        while pos < stream.len() {
            let mut n = (1 + rng.below(8192) as usize).min(stream.len() - pos);
            if rng.below(4) == 0
                && let Some(&e) = ends.iter().find(|&&e| e > pos && e <= pos + n)
            {
                n = e - pos;
            }
            got.extend(call(&mut st, &stream[pos..pos + n], lock_how::CONTENT, 0));
            pos += n;
        }
        let k = check_from_lock(&got, &joined_at(&truth, start as u64), lock_how::CONTENT);
        assert!(k < 200, "seed {seed}: locked only at message {k}");
    }
}

#[test]
fn full_headers_lock_with_consecutive_serials() {
    let mut rng = Rng(3);
    let (msgs, truth) = display_stream(&mut rng, HeaderKind::Full, 50);
    let mut st = joined(Role::ServerToClient);
    let mut got = call(&mut st, &msgs[0][3..], lock_how::CONTENT, 0);
    for m in &msgs[1..] {
        got.extend(call(&mut st, m, lock_how::SEND_AFTER_COMPLETE, 0));
    }
    check_from_lock(&got, &joined_at(&truth, 3), lock_how::SEND_AFTER_COMPLETE);
    assert_eq!(got[0].hdr_len, 18);
}

#[test]
fn spice_server_header_reads_anchor_the_client_direction() {
    // spice-server reads exactly a header, then exactly the body (ACKs have none).
    let mut st = joined(Role::ClientToServer);
    let mut got = Vec::new();
    let pong = wire::message(HeaderKind::Mini, msg_client::PONG, &[0; 12]);
    got.extend(call(&mut st, &pong[9..], lock_how::CONTENT, 0));
    for i in 0..10 {
        let m = if i == 4 {
            pong.clone()
        } else {
            wire::ack(HeaderKind::Mini)
        };
        got.extend(call(&mut st, &m[..6], lock_how::RECV_HEADER_READ, 6));
        if m.len() > 6 {
            got.extend(call(&mut st, &m[6..], lock_how::CONTENT, 0));
        }
    }
    assert_eq!(
        got.len(),
        8,
        "locked at the third header, then every message"
    );
    assert_eq!(got[0].lock, lock_how::RECV_HEADER_READ);
    assert_eq!(got[2].msg_type, msg_client::PONG);
}

#[test]
fn random_bytes_never_lock() {
    // 96 MiB of random bytes in calls of 1..=1024 bytes: about 190,000 candidates per role.
    for (seed, role) in [
        (1u64, Role::ServerToClient),
        (2, Role::ClientToServer),
        (3, Role::Unknown),
    ] {
        let mut rng = Rng(seed);
        let mut st = joined(role);
        let mut left = 32usize << 20;
        let mut best_run = 0;
        while left > 0 {
            let n = (1 + rng.below(1024) as usize).min(left);
            let anchor = if rng.below(2) == 0 {
                lock_how::SEND_AFTER_COMPLETE
            } else {
                lock_how::CONTENT
            };
            let got = call(&mut st, &rng.bytes(n), anchor, 0);
            assert!(
                got.is_empty(),
                "{role:?}: false lock on random bytes: {got:?}"
            );
            best_run = best_run.max(st.run);
            left -= n;
        }
        assert_eq!(st.phase(), Phase::Hunt);
        eprintln!(
            "{role:?}: {} candidates validated a first header, longest chain {best_run}",
            st.candidates
        );
    }
}

#[test]
fn garbage_mid_stream_resyncs_and_relocks() {
    let sess = Session::new(channel::DISPLAY, 0);
    let mut c2s = DirState::default();
    let mut s2c = DirState::default();
    let mut outs = Vec::new();
    feed(&mut c2s, &s2c.view(), &[&sess.client_link()], |o| {
        outs.push(o)
    });
    feed(&mut s2c, &c2s.view(), &[&sess.server_link()], |o| {
        outs.push(o)
    });
    feed(&mut c2s, &s2c.view(), &[&sess.client_auth()], |o| {
        outs.push(o)
    });
    feed(&mut s2c, &c2s.view(), &[&sess.server_result()], |o| {
        outs.push(o)
    });
    let mut rng = Rng(11);
    let (msgs, _) = display_stream(&mut rng, HeaderKind::Mini, 30);
    let mut got = Vec::new();
    let mut hunts = Vec::new();
    let mut send = |st: &mut DirState, peer: PeerView, b: &[u8], anchor: u8| {
        feed_call(st, &peer, &[b], anchor, 0, |o| match o {
            Output::Message(m) => got.push(m),
            Output::Hunt { reason, at, .. } => hunts.push((reason, at)),
            Output::None | Output::Link(_) => {}
            Output::Unparsed { .. } => panic!("never unparsed: {o:?}"),
        })
    };
    for m in &msgs[..10] {
        send(&mut s2c, c2s.view(), m, lock_how::SEND_AFTER_COMPLETE);
    }
    let garbage_at = s2c.pos;
    send(
        &mut s2c,
        c2s.view(),
        &[0xff; 100],
        lock_how::SEND_AFTER_COMPLETE,
    );
    for m in &msgs[10..] {
        send(&mut s2c, c2s.view(), m, lock_how::SEND_AFTER_COMPLETE);
    }
    assert_eq!(hunts, vec![(UnparsedReason::BadHeader, garbage_at)]);
    assert_eq!(s2c.resyncs, 1);
    assert_eq!(
        got.len(),
        10 + 20 - 2,
        "two messages validate the new chain, the third locks"
    );
    assert_eq!(got[10].lock, lock_how::SEND_AFTER_COMPLETE);
    assert_eq!(got[10].index, 11, "ordinals continue after a resync");
    assert_eq!(s2c.unframed, 100 + (msgs[10].len() + msgs[11].len()) as u64);
}

#[test]
fn hunting_type_table_agrees_with_the_message_names() {
    use spice_ebpf_common::protocol::{
        HUNT_TYPES, c2s_type_channels, channel_bit, message_name, s2c_type_channels,
    };
    // Every message `message_name` names (the report's table, written from spice.proto) is
    // one the hunting tables accept on that channel and direction, and the packed table the
    // kernel loads says the same as the functions.
    let mut named = 0;
    for ch in 1..=11u8 {
        for t in 1..=400u16 {
            for s2c in [true, false] {
                if message_name(ch, s2c, t).is_some() {
                    named += 1;
                    let m = if s2c {
                        s2c_type_channels(t)
                    } else {
                        c2s_type_channels(t)
                    };
                    assert_ne!(m & channel_bit(ch), 0, "channel {ch} s2c {s2c} type {t}");
                }
            }
        }
    }
    assert!(named > 150, "{named}");
    for t in 0..1024u16 {
        let e = HUNT_TYPES[t as usize];
        assert_eq!((e >> 16) as u16, s2c_type_channels(t), "s2c {t}");
        assert_eq!(e as u16, c2s_type_channels(t), "c2s {t}");
    }
    assert_eq!(HUNT_TYPES[0], 0);
    assert_eq!(HUNT_TYPES[1001], 0);
}
