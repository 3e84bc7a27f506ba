//! Hunting on senders whose messages span several complete write calls (found by the trial of
//! issue 9): a relay's leg toward the client (socat writes 8 KiB, haproxy 16 KiB, every write
//! moving all it asked) and peers that write a header and its body in separate calls. Only a
//! complete writev is a send anchor (spice-ebpf/src/capture.rs `offer_call_start`), and a send
//! anchor never cuts a chain that validated a header (`DirState::hunt_call_start`): before
//! both, a chain whose next header lay beyond the next call start never grew past one header.
//!
//! Real runs that showed it: an Xspice noise session (≈200 KiB draws) through socat or
//! haproxy, joined mid-stream: spice-server's socket and the relay's leg toward it locked
//! within 0.2 s, the relay's leg toward the client was still hunting after 12 s and 48 MB.
//! Scripted peer: `spice-peer server --split-header` (or `--chunk 16`) never locked its send
//! side.
//!
//! Pure logic (the host mirror `framing::feed_call` of the kernel's per-call loop), no root.
//! Run with `cargo test -p spice-ebpf-common --features std --test hunt_calls`.
//!
//! Not covered, a known limit: tiny writes (1 byte a call) joined off a boundary. Candidates
//! start only at call starts, one at a time, so a candidate read over six 1-byte calls that
//! fails is followed by the next one six bytes on, and with such a stride a stream of equal
//! messages may never offer a candidate at a header.

use spice_ebpf_common::event::lock_how;
use spice_ebpf_common::framing::{
    DirState, MessageInfo, Output, PeerView, Role, UnparsedReason, feed_call,
};

/// A mini-header display message: DRAW_COPY (304) with `size` body bytes of 0xA5.
fn message(size: usize) -> Vec<u8> {
    let mut m = Vec::with_capacity(6 + size);
    m.extend_from_slice(&304u16.to_le_bytes());
    m.extend_from_slice(&(size as u32).to_le_bytes());
    m.resize(6 + size, 0xA5);
    m
}

/// A server → client direction joined mid-stream, as the kernel starts it (capture.rs
/// `socket_state`: an accepted socket's sends are server → client).
fn joined() -> DirState {
    let mut st = DirState {
        role: Role::ServerToClient as u8,
        ..Default::default()
    };
    assert!(matches!(
        st.hunt(UnparsedReason::AttachedMidStream, 0, 0),
        Output::Hunt { .. }
    ));
    st
}

/// Feeds `calls` as send calls the way the kernel classifies them: the first call after the
/// join is content (no previous call seen), every later one follows a complete send (blocking
/// writes move all they ask). Returns the messages reported.
fn sends(st: &mut DirState, calls: &[&[u8]]) -> Vec<MessageInfo> {
    let mut out = Vec::new();
    for (i, c) in calls.iter().enumerate() {
        let anchor = if i == 0 {
            lock_how::CONTENT
        } else {
            lock_how::SEND_AFTER_COMPLETE
        };
        feed_call(st, &PeerView::default(), &[c], anchor, 0, |o| {
            if let Output::Message(m) = o {
                out.push(m)
            }
        });
    }
    out
}

/// Control: one message per write locks (this passes today).
#[test]
fn one_message_per_write_locks() {
    let msgs: Vec<Vec<u8>> = (0..50).map(|_| message(64)).collect();
    let calls: Vec<&[u8]> = msgs.iter().map(|m| m.as_slice()).collect();
    let mut st = joined();
    let got = sends(&mut st, &calls);
    assert!(
        got.len() >= 45,
        "locked late or not at all: {} messages",
        got.len()
    );
}

/// spice-peer --split-header: each header in two writes (3 bytes, then the rest with the body).
#[test]
fn header_split_across_two_writes_locks() {
    let msgs: Vec<Vec<u8>> = (0..50).map(|_| message(64)).collect();
    let mut calls: Vec<&[u8]> = Vec::new();
    for m in &msgs {
        calls.push(&m[..3]);
        calls.push(&m[3..]);
    }
    let mut st = joined();
    let got = sends(&mut st, &calls);
    assert!(
        got.len() >= 40,
        "a sender that splits its header never locks: {} messages of 50, phase {}, candidates {}",
        got.len(),
        st.phase,
        st.candidates
    );
}

/// A relay's leg toward the client: socat reads at most 8 KiB (its default buffer) and writes
/// what it read. After a quiet moment a read starts at a message boundary, so each 100 KB draw
/// (spice-server writes one a frame) goes out as 13 writes, the first starting at its header.
/// The join happens in the middle of a message.
#[test]
fn relay_writes_of_big_messages_lock() {
    let msgs: Vec<Vec<u8>> = (0..40).map(|_| message(100_000)).collect();
    let mut calls: Vec<&[u8]> = Vec::new();
    for m in &msgs {
        calls.extend(m.chunks(8192));
    }
    calls.drain(..3);
    let mut st = joined();
    let got = sends(&mut st, &calls);
    assert!(
        got.len() >= 30,
        "8 KiB relay writes of 100 KB messages never lock: {} messages of 39, candidates {}",
        got.len(),
        st.candidates
    );
}
