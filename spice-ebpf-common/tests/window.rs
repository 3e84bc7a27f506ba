//! Host tests of the ACK-window rule (`window::WindowState`) on framed byte streams: the same
//! path the kernel takes (`spice-ebpf/src/capture.rs`), with `framing::feed` in place of the
//! kernel's loop. Each framed data message goes through `WindowState::apply` with its
//! direction's role and the channel type from the client's link message, exactly once (a
//! message `DirState::peek` reported from an EAGAIN send is applied then, and skipped when the
//! retried write frames it with `already_reported`), and adds its bytes to the direction's
//! total, as `SockState::msg_bytes`.
//!
//! The streams are spice-server ↔ spice-gtk display sessions built by `wire::Session`, cut into
//! calls the way real peers cut them (several messages per writev, headers split across iovecs
//! and calls, partial writes, EAGAIN rejections, ACKs read in batches). The expected figures are
//! the test's own arithmetic on its script (a signed count of messages started minus W per ACK
//! read), never the rule's code. Run with `cargo test -p spice-ebpf-common --features std`.
#![cfg(feature = "std")]

use spice_ebpf_common::{
    framing::{BUF_LEN, DirState, MAX_WANT, MessageInfo, Output, feed},
    protocol::{channel, msg_client},
    window::{WindowState, effect},
    wire::{self, HeaderKind, Session, SplitMix64 as Rng},
};

/// One observed socket of spice-server: both directions' framing state, the window, the byte
/// totals, all as in `SockState`.
#[derive(Default)]
struct Sock {
    c2s: DirState,
    s2c: DirState,
    window: WindowState,
    bytes: [u64; 2],
    /// Effect bits of every applied message, in order.
    effects: Vec<u8>,
}

const C2S: usize = 0;
const S2C: usize = 1;
/// An ACK with a mini header: 6 bytes, no body.
const ACK_LEN: u64 = 6;

impl Sock {
    /// Applies one framed message of direction `d` as `capture.rs`'s `emit_message` does.
    fn apply(&mut self, d: usize, now_ns: u64, m: &MessageInfo) {
        if m.already_reported {
            return;
        }
        let (st, other) = if d == S2C {
            (&self.s2c, &self.c2s)
        } else {
            (&self.c2s, &self.s2c)
        };
        // The server → client direction takes the channel type from the other direction's
        // view, the client → server direction parsed it itself.
        let channel_type = if d == S2C {
            other.view().channel_type
        } else {
            st.channel_type
        };
        let fx = self
            .window
            .apply(st.role, now_ns, channel_type, m.msg_type, m.prefix);
        self.bytes[d] += u64::from(m.hdr_len) + u64::from(m.size);
        self.effects.push(fx);
    }

    /// One call of direction `d` that moved `segs` (iovec-like) at `now_ns`.
    fn call(&mut self, d: usize, now_ns: u64, segs: &[&[u8]]) {
        let mut out = Vec::new();
        if d == S2C {
            let peer = self.c2s.view();
            feed(&mut self.s2c, &peer, segs, |o| out.push(o));
        } else {
            let peer = self.s2c.view();
            feed(&mut self.c2s, &peer, segs, |o| out.push(o));
        }
        for o in out {
            match o {
                Output::Message(m) => self.apply(d, now_ns, &m),
                Output::Unparsed { .. } => panic!("unparsed: {o:?}"),
                _ => {}
            }
        }
    }

    /// A server send of `buf` rejected with EAGAIN: the kernel copies its first
    /// [`MAX_WANT`] bytes and peeks (`capture.rs` `peek_eagain`).
    fn eagain(&mut self, now_ns: u64, buf: &[u8]) {
        let mut first = [0u8; BUF_LEN];
        let avail = buf.len().min(MAX_WANT as usize);
        first[..avail].copy_from_slice(&buf[..avail]);
        let peer = self.c2s.view();
        if let Some(m) = self.s2c.peek(&first, avail as u32, &peer) {
            self.apply(S2C, now_ns, &m);
        }
    }

    /// The link phase as spice-gtk and spice-server write it.
    fn link(&mut self, sess: &Session) {
        self.call(C2S, 1, &[&sess.client_link()]);
        self.call(S2C, 2, &[&sess.server_link()]);
        self.call(C2S, 3, &[&sess.client_auth()]);
        self.call(S2C, 4, &[&sess.server_result()]);
    }
}

/// Cuts `bytes` into 1–3 iovec segments at random points.
fn segments<'a>(rng: &mut Rng, bytes: &'a [u8]) -> Vec<&'a [u8]> {
    let mut cuts: Vec<usize> = (0..rng.below(3))
        .map(|_| rng.below(bytes.len() as u64 + 1) as usize)
        .collect();
    cuts.sort_unstable();
    let mut v = Vec::new();
    let mut at = 0;
    for c in cuts.into_iter().chain([bytes.len()]) {
        v.push(&bytes[at..c]);
        at = c;
    }
    v
}

/// What the test's script did, counted its own way.
#[derive(Debug, Default, PartialEq, Eq)]
struct Script {
    /// Server messages started after the SET_ACK, and ACKs the server read.
    messages: u64,
    acks: u64,
    /// The in-flight count as spice-server keeps it (signed: no surplus in this script), its
    /// maximum, and how often it went above 2W.
    count: i64,
    max: i64,
    stalls: u64,
    /// Bytes each way after the link phase.
    bytes_s2c: u64,
    bytes_c2s: u64,
}

/// A display session with W = `w`: SET_ACK, ACK_SYNC, then `n` draws of random sizes from a
/// server that obeys the gate, a client that ACKs after every W messages following the
/// SET_ACK (spice-gtk, docs/spice-protocol.md §3.8) and whose ACKs the server reads late, in
/// batches, sometimes split across reads.
fn run(seed: u64, w: u32, n: u64) -> (Sock, Script) {
    let mut rng = Rng(seed);
    let sess = Session::new(channel::DISPLAY, 0);
    let kind = HeaderKind::Mini;
    let mut k = Sock::default();
    k.link(&sess);
    let mut t = 10u64;
    let mut s = Script::default();
    let set_ack = wire::set_ack(kind, 1, w);
    k.eagain(t, &set_ack);
    t += 1;
    k.call(S2C, t, &[&set_ack]);
    s.count = 1;
    s.max = 1;
    s.bytes_s2c += set_ack.len() as u64;
    let sync = wire::ack_sync(kind, 1);
    k.call(C2S, t, &[&sync]);
    let sync_len = sync.len() as u64;
    s.bytes_c2s += sync_len;
    assert_eq!(wire::ack(kind).len() as u64, ACK_LEN);
    // Client side: messages received since the SET_ACK, ACK bytes not yet read by the server.
    let mut received = 0u64;
    let mut pending_acks: Vec<u8> = Vec::new();
    // Server side: bytes of a batch that a partial write left unsent.
    let mut unsent: Vec<u8> = Vec::new();
    while s.messages < n || !unsent.is_empty() || !pending_acks.is_empty() {
        t += 1 + rng.below(1000);
        match rng.below(3) {
            // The server reads some of the ACK bytes waiting for it (between its writes:
            // spice-server reads while no message is half written).
            0 if !pending_acks.is_empty() && unsent.is_empty() => {
                let take = 1 + rng.below(pending_acks.len() as u64) as usize;
                let bytes: Vec<u8> = pending_acks.drain(..take).collect();
                k.call(C2S, t, &segments(&mut rng, &bytes));
                s.bytes_c2s += bytes.len() as u64;
                // An ACK is a 6-byte mini header: it counts once its last byte is read.
                let acks = (s.bytes_c2s - sync_len) / ACK_LEN;
                s.count -= (acks - s.acks) as i64 * i64::from(w);
                s.acks = acks;
            }
            // The server writes: the rest of a partial write, or a batch of new messages
            // started while the gate lets it.
            _ => {
                let mut batch = std::mem::take(&mut unsent);
                if batch.is_empty() {
                    for _ in 0..1 + rng.below(5) {
                        if s.messages == n || s.count > 2 * i64::from(w) {
                            break;
                        }
                        let len = rng.below(200) as usize;
                        let body = rng.bytes(len);
                        batch.extend(wire::message(kind, 302, &body));
                        s.messages += 1;
                        s.count += 1;
                        s.max = s.max.max(s.count);
                        if s.count == 2 * i64::from(w) + 1 {
                            s.stalls += 1;
                        }
                        // The client gets it and ACKs after every W since the SET_ACK.
                        received += 1;
                        if received.is_multiple_of(u64::from(w)) {
                            pending_acks.extend(wire::ack(kind));
                        }
                    }
                    if batch.is_empty() {
                        continue;
                    }
                    // A full send buffer: the first writev of the batch fails with EAGAIN.
                    if rng.below(4) == 0 {
                        k.eagain(t, &batch);
                        t += 1;
                    }
                }
                // Partial writes: the kernel may take only part of the buffer.
                let moved = if rng.below(3) == 0 {
                    1 + rng.below(batch.len() as u64) as usize
                } else {
                    batch.len()
                };
                k.call(S2C, t, &segments(&mut rng, &batch[..moved]));
                s.bytes_s2c += moved as u64;
                unsent = batch.split_off(moved);
            }
        }
    }
    (k, s)
}

#[test]
fn framed_sessions_give_the_scripts_own_counts_whatever_the_cuts() {
    for (seed, w, n) in [
        (1, 20, 2000),
        (2, 20, 999),
        (3, 40, 3000),
        (4, 3, 500),
        (5, 1, 200),
    ] {
        let (k, s) = run(seed, w, n);
        let win = &k.window;
        let what = format!("seed {seed} W {w}: {s:?} vs {win:?}");
        // Every message framed once, by both the framing and the window.
        assert_eq!(k.s2c.msg_count, 1 + n, "{what}");
        assert_eq!(k.c2s.msg_count, 1 + s.acks, "{what}");
        assert_eq!(k.effects.len() as u64, 2 + n + s.acks, "{what}");
        // The client ACKs every W messages after the SET_ACK, all read by the end.
        assert_eq!(s.acks, n / u64::from(w), "{what}");
        assert!(
            s.max > 2 * i64::from(w),
            "the gate was never reached: {what}"
        );
        assert_eq!(
            (
                win.set_acks,
                win.ack_syncs,
                win.acks,
                win.acks_ignored,
                win.ack_surplus
            ),
            (1, 1, s.acks, 0, 0),
            "{what}"
        );
        assert_eq!(
            (
                i64::from(win.count),
                i64::from(win.messages_window),
                i64::from(win.max)
            ),
            (s.count, s.count, s.max),
            "{what}"
        );
        assert_eq!((win.window, win.generation), (w, 1), "{what}");
        assert_eq!(win.messages_after_set_ack, n, "{what}");
        assert_eq!(u64::from(win.stalls), s.stalls, "{what}");
        assert_eq!(win.stalls_total, s.stalls, "{what}");
        assert_eq!(
            (win.starts_while_stalled, win.urgent_pair_peaks),
            (0, 0),
            "{what}"
        );
        assert_eq!(k.bytes, [s.bytes_c2s, s.bytes_s2c], "{what}");
        // Stall starts and ends alternate, one per stall.
        let began = k.effects.iter().filter(|&&f| f & effect::STALL_BEGAN != 0);
        let ended = k.effects.iter().filter(|&&f| f & effect::STALL_ENDED != 0);
        assert_eq!(began.count() as u64, s.stalls, "{what}");
        assert!(
            ended.count() as u64 >= s.stalls - u64::from(win.stalled()),
            "{what}"
        );
    }
}

#[test]
fn an_eagain_start_is_applied_once_when_peeked() {
    let sess = Session::new(channel::DISPLAY, 0);
    let kind = HeaderKind::Mini;
    let mut k = Sock::default();
    k.link(&sess);
    k.call(S2C, 10, &[&wire::set_ack(kind, 1, 20)]);
    let draw = wire::message(kind, 302, &[7; 500]);
    // Rejected twice, then written in three partial writes.
    k.eagain(20, &draw);
    assert_eq!(
        k.window.count, 2,
        "counted at the rejected write, as spice-server does"
    );
    k.eagain(21, &draw);
    k.call(S2C, 30, &[&draw[..3]]);
    k.call(S2C, 31, &[&draw[3..100]]);
    k.call(S2C, 32, &[&draw[100..]]);
    assert_eq!(
        (
            k.window.count,
            k.window.messages_after_set_ack,
            k.effects.len()
        ),
        (2, 1, 2)
    );
    assert_eq!(k.bytes[S2C], (14 + draw.len()) as u64);
    // An ACK_SYNC and a client message of another type: only the ACK_SYNC touches the window.
    k.call(C2S, 40, &[&wire::ack_sync(kind, 1)]);
    k.call(C2S, 41, &[&wire::message(kind, msg_client::ACK + 100, &[])]);
    assert_eq!((k.window.ack_syncs, k.window.client_generation), (1, 1));
    assert_eq!(k.window.count, 2);
}
