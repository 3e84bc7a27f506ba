//! Host unit tests of the shared framing state machine (`framing::feed`, `DirState::peek`).
//!
//! Each test models one TCP connection as two `DirState`s (client → server, server → client);
//! each direction's `PeerView` is the other direction's `view()`. Bytes are fed in wire order:
//! the client link message, then the server reply, then the client auth, and so on.
//! The byte streams come from `spice_ebpf_common::wire` (feature `std`), so run with
//! `cargo test -p spice-ebpf-common --features std`.
#![cfg(feature = "std")]

use spice_ebpf_common::framing::{
    BUF_LEN, DirState, LinkInfo, MAX_MESSAGE_SIZE, MessageInfo, Output, Phase, UnparsedReason, feed,
};
use spice_ebpf_common::protocol::{channel, msg_client, msg_server};
use spice_ebpf_common::wire::{self, HeaderKind, MessageWriter, Session, SplitMix64 as Rng};

const C2S: u8 = 1;
const S2C: u8 = 2;
/// "REDQ" read as a little-endian u32.
const REDQ_LE: u32 = 0x5144_4552;

/// One socket: both directions' framing state.
#[derive(Default)]
struct Sock {
    c2s: DirState,
    s2c: DirState,
}

impl Sock {
    /// One client send call made of `segs` (iovec-like).
    fn c(&mut self, segs: &[&[u8]]) -> Vec<Output> {
        let peer = self.s2c.view();
        let mut out = Vec::new();
        feed(&mut self.c2s, &peer, segs, |o| out.push(o));
        out
    }

    /// One server send call.
    fn s(&mut self, segs: &[&[u8]]) -> Vec<Output> {
        let peer = self.c2s.view();
        let mut out = Vec::new();
        feed(&mut self.s2c, &peer, segs, |o| out.push(o));
        out
    }

    /// Runs the link phase of `sess` the way spice-gtk and spice-server write it: client link
    /// in one call, reply header+body in one call and each cap word in its own call, client
    /// mechanism and ticket in two calls, then the 4-byte result. Returns both link outputs.
    fn link(&mut self, sess: &Session) -> (LinkInfo, LinkInfo) {
        let c = self.c(&[&sess.client_link()]);
        let reply = sess.server_link();
        let mut s = self.s(&[&reply[..194]]);
        for word in reply[194..].chunks(4) {
            s.extend(self.s(&[word]));
        }
        let auth = sess.client_auth();
        let (mech, ticket) = auth.split_at(auth.len() - 128);
        let mut rest = self.c(&[mech]);
        rest.extend(self.c(&[ticket]));
        rest.extend(self.s(&[&sess.server_result()]));
        assert_eq!(rest, vec![], "auth and result produce no output");
        self.resolve();
        (only_link(&c), only_link(&s))
    }

    /// Resolves the data header length in both directions, as the framing loop does once the
    /// first data byte arrives (`DirState::prepare`).
    fn resolve(&mut self) {
        let (pc, ps) = (self.s2c.view(), self.c2s.view());
        assert_eq!(self.c2s.prepare(&pc), Output::None);
        assert_eq!(self.s2c.prepare(&ps), Output::None);
    }
}

fn only_link(out: &[Output]) -> LinkInfo {
    match out {
        [Output::Link(l)] => *l,
        other => panic!("expected one Link output, got {other:?}"),
    }
}

fn msgs(out: &[Output]) -> Vec<MessageInfo> {
    out.iter()
        .map(|o| match o {
            Output::Message(m) => *m,
            other => panic!("expected only messages, got {other:?}"),
        })
        .collect()
}

fn hunt(out: &[Output]) -> (UnparsedReason, u32, u64) {
    match out {
        [Output::Hunt { reason, detail, at }] => (*reason, *detail, *at),
        other => panic!("expected one Hunt output, got {other:?}"),
    }
}

fn unparsed(out: &[Output]) -> (UnparsedReason, u32, u64) {
    match out {
        [Output::Unparsed { reason, detail, at }] => (*reason, *detail, *at),
        other => panic!("expected one Unparsed output, got {other:?}"),
    }
}

/// Expected MessageInfo (prefix [0, 0], not already reported).
fn m(at: u64, index: u64, msg_type: u16, size: u32, hdr_len: u8) -> MessageInfo {
    MessageInfo {
        at,
        index,
        size,
        msg_type,
        hdr_len,
        already_reported: false,
        prefix: [0, 0],
        lock: 0,
    }
}

fn display_session() -> Session {
    let mut s = Session::new(channel::DISPLAY, 0);
    s.server_channel_caps = vec![0x1052];
    s
}

// ---------------------------------------------------------------------------------------------
// Link phase layouts
// ---------------------------------------------------------------------------------------------

#[test]
fn link_spice_gtk_client_and_spice_server_reply() {
    let sess = display_session();
    let mut k = Sock::default();
    let (c, s) = k.link(&sess);
    assert_eq!(
        c,
        LinkInfo {
            role: C2S,
            link_size: 22,
            connection_id: 0,
            channel_type: 2,
            channel_id: 0,
            common_caps: 0x09
        }
    );
    // The server direction takes the channel type from the client; it has no channel id.
    assert_eq!(
        s,
        LinkInfo {
            role: S2C,
            link_size: 186,
            connection_id: 0,
            channel_type: 2,
            channel_id: 0,
            common_caps: 0x0B
        }
    );
    // §1.8: client data at H_c + 148 = 170, server data at H_s + 20 = 206; mini headers.
    assert_eq!(k.c2s.need(), (170, 6));
    assert_eq!(k.s2c.need(), (206, 6));
    assert_eq!((k.c2s.hdr_len, k.s2c.hdr_len), (6, 6));
    assert_eq!(
        (k.c2s.phase(), k.s2c.phase()),
        (Phase::DataHeader, Phase::DataHeader)
    );
}

#[test]
fn link_with_channel_caps_on_client_and_none_on_server() {
    // Cursor: spice-server sends no channel caps (H_s = 182, data at 202); the client sends
    // three channel-cap words (H_c = 18 + 16 = 34, data at 182).
    let mut sess = Session::new(channel::CURSOR, 3);
    sess.connection_id = 0xDEAD_BEEF;
    sess.client_channel_caps = vec![0xFFFF_FFFF, 0x1, 0x2];
    let mut k = Sock::default();
    let (c, s) = k.link(&sess);
    assert_eq!(
        c,
        LinkInfo {
            role: C2S,
            link_size: 34,
            connection_id: 0xDEAD_BEEF,
            channel_type: channel::CURSOR,
            channel_id: 3,
            common_caps: 0x09
        }
    );
    assert_eq!(
        (s.link_size, s.channel_type, s.common_caps),
        (182, channel::CURSOR, 0x0B)
    );
    assert_eq!(k.c2s.need(), (16 + 34 + 132, 6));
    assert_eq!(k.s2c.need(), (202, 6));
}

#[test]
fn link_caps_offset_beyond_18_with_padding() {
    let mut sess = display_session();
    sess.caps_offset = 40; // 22 bytes of padding after the 18-byte SpiceLinkMess
    let mut link = sess.client_link();
    assert_eq!(link.len(), 16 + 44);
    link[34..56].fill(0xFF); // junk in the padding must not be read as caps
    let mut k = Sock::default();
    let c = only_link(&k.c(&[&link]));
    assert_eq!((c.link_size, c.common_caps), (44, 0x09));
    assert_eq!(k.c2s.caps_offset, 40);
    let s = only_link(&k.s(&[&sess.server_link()]));
    assert_eq!(s.common_caps, 0x0B);
    assert_eq!(k.c(&[&sess.client_auth()]), vec![]);
    // The header length resolves when the first data byte arrives; the offset is known now.
    assert_eq!(k.c2s.need().0, 16 + 44 + 132);
}

#[test]
fn link_server_without_common_caps_means_full_headers() {
    let mut sess = display_session();
    sess.server_common_caps = vec![];
    sess.server_channel_caps = vec![];
    assert_eq!(sess.header_kind(), HeaderKind::Full);
    let mut k = Sock::default();
    let (c, s) = k.link(&sess);
    assert_eq!(c.common_caps, 0x09);
    assert_eq!((s.link_size, s.common_caps), (178, 0));
    assert_eq!(k.c2s.need(), (170, 18));
    assert_eq!(k.s2c.need(), (198, 18));
    let out = k.s(&[&sess.data(&[(msg_server::SET_ACK, wire::set_ack_body(1, 20))])]);
    let mut want = m(198, 1, msg_server::SET_ACK, 8, 18);
    want.prefix = [1, 20];
    assert_eq!(msgs(&out), vec![want]);
}

#[test]
fn link_client_without_common_caps_sends_ticket_directly_and_uses_full_headers() {
    // num_common_caps = 0: no AUTH_SELECTION (no mechanism word) and no MINI_HEADER.
    let mut sess = display_session();
    sess.client_common_caps = vec![];
    let mut k = Sock::default();
    let c = only_link(&k.c(&[&sess.client_link()]));
    assert_eq!((c.link_size, c.common_caps), (18, 0));
    assert_eq!(only_link(&k.s(&[&sess.server_link()])).common_caps, 0x0B);
    assert_eq!(k.c(&[&sess.client_auth()]), vec![], "128-byte ticket only");
    assert_eq!(k.c2s.need().0, 16 + 18 + 128);
    let out = k.c(&[&sess.data(&[(msg_client::ACK_SYNC, wire::ack_sync_body(1))])]);
    let mut want = m(162, 1, msg_client::ACK_SYNC, 4, 18);
    want.prefix = [1, 0];
    assert_eq!(msgs(&out), vec![want]);
}

#[test]
fn link_no_auth_selection_ticket_follows_link_message() {
    // Client caps 0x08: mini header but no PROTOCOL_AUTH_SELECTION, so the server reads the
    // 128-byte ticket right after the link message (§1.5, §1.8: data at H_c + 144).
    let mut sess = display_session();
    sess.client_common_caps = vec![0x08];
    assert_eq!(sess.client_auth().len(), 128);
    let mut k = Sock::default();
    let c = k.c(&[&sess.client_link()]);
    assert_eq!(only_link(&c).common_caps, 0x08);
    assert!(
        !k.c2s.is_unparsed(),
        "nothing after the link message has been seen yet: {:?}",
        c
    );
    only_link(&k.s(&[&sess.server_link()]));
    assert_eq!(k.c(&[&sess.client_auth()]), vec![]);
    assert_eq!(k.c2s.need().0, 22 + 144);
    let out = k.c(&[&wire::ack(HeaderKind::Mini)]);
    assert_eq!(msgs(&out), vec![m(166, 1, msg_client::ACK, 0, 6)]);
}

#[test]
fn link_bad_version_and_bad_sizes() {
    let mut k = Sock::default();
    let mut link = wire::link_mess(0, 2, 0, &[9], &[]);
    link[4] = 3;
    assert_eq!(
        unparsed(&k.c(&[&link])),
        (UnparsedReason::LinkVersion, 3, 0)
    );

    // H_c = 17 < 18.
    let mut k = Sock::default();
    let out = k.c(&[&wire::link_header(17)]);
    assert_eq!(unparsed(&out), (UnparsedReason::BadLink, 17, 0));

    // Caps that do not fit inside H_c (2 common words announced, H_c = 22).
    let mut k = Sock::default();
    let mut link = wire::link_mess(0, 2, 0, &[9], &[]);
    link[22..26].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(unparsed(&k.c(&[&link])), (UnparsedReason::BadLink, 18, 16));
}

#[test]
fn link_unknown_auth_mechanism() {
    let mut sess = display_session();
    sess.auth_mechanism = 3;
    let mut k = Sock::default();
    only_link(&k.c(&[&sess.client_link()]));
    only_link(&k.s(&[&sess.server_link()]));
    let out = k.c(&[&sess.client_auth()]);
    assert_eq!(unparsed(&out), (UnparsedReason::BadAuthMechanism, 3, 38));
}

// ---------------------------------------------------------------------------------------------
// Data headers
// ---------------------------------------------------------------------------------------------

#[test]
fn mini_headers_both_directions() {
    let sess = display_session();
    let mut k = Sock::default();
    k.link(&sess);
    let out = k.s(&[&sess.data(&[(304u16, vec![7u8; 100]), (102, vec![]), (123, vec![1; 5])])]);
    assert_eq!(
        msgs(&out),
        vec![
            m(206, 1, 304, 100, 6),
            m(312, 2, 102, 0, 6),
            m(318, 3, 123, 5, 6)
        ]
    );
    let out = k.c(&[&sess.data(&[(101u16, vec![0u8; 14])])]);
    assert_eq!(msgs(&out), vec![m(170, 1, 101, 14, 6)]);
    assert_eq!(k.s2c.msg_count, 3);
    assert_eq!(k.s2c.need(), (329, 6));
}

#[test]
fn full_headers_both_directions() {
    let sess = Session::new_full(channel::DISPLAY, 0);
    let mut k = Sock::default();
    k.link(&sess);
    assert_eq!((k.c2s.hdr_len, k.s2c.hdr_len), (18, 18));
    let mut w = MessageWriter::new(HeaderKind::Full);
    let mut bytes = w.message(304, &[1; 40]);
    bytes.extend(w.message(102, &[]));
    assert_eq!(&bytes[58..66], &2u64.to_le_bytes(), "second serial is 2");
    let out = k.s(&[&bytes]);
    assert_eq!(
        msgs(&out),
        vec![m(202, 1, 304, 40, 18), m(260, 2, 102, 0, 18)]
    );
    let out = k.c(&[&wire::ack(HeaderKind::Full)]);
    assert_eq!(msgs(&out), vec![m(170, 1, msg_client::ACK, 0, 18)]);
}

#[test]
fn header_split_across_two_calls() {
    let sess = display_session();
    let mut k = Sock::default();
    k.link(&sess);
    let msg = wire::message(HeaderKind::Mini, 304, &[9; 20]);
    assert_eq!(k.s(&[&msg[..3]]), vec![]);
    assert_eq!((k.s2c.have, k.s2c.need()), (3, (209, 3)));
    assert_eq!(msgs(&k.s(&[&msg[3..]])), vec![m(206, 1, 304, 20, 6)]);
    assert_eq!(k.s2c.need(), (232, 6));
}

#[test]
fn header_split_across_two_iovec_segments() {
    let sess = Session::new_full(channel::DISPLAY, 0);
    let mut k = Sock::default();
    k.link(&sess);
    let msg = wire::message(HeaderKind::Full, 304, &[9; 20]);
    // One writev: [first 5 header bytes] [rest of the header] [body] [next message's header].
    let next = wire::message(HeaderKind::Full, 102, &[]);
    let out = k.s(&[&msg[..5], &msg[5..18], &msg[18..], &[], &next]);
    assert_eq!(
        msgs(&out),
        vec![m(202, 1, 304, 20, 18), m(240, 2, 102, 0, 18)]
    );
}

#[test]
fn message_spread_over_many_calls_and_one_byte_calls() {
    let sess = display_session();
    let mut k = Sock::default();
    k.link(&sess);
    // A 100 KiB body written in 4 KiB partial writes: reported once, on the header's call.
    let big = wire::message(HeaderKind::Mini, 304, &vec![0xAB; 100 * 1024]);
    let mut reported = Vec::new();
    for (i, chunk) in big.chunks(4096).enumerate() {
        for o in k.s(&[chunk]) {
            reported.push((i, o));
        }
    }
    assert_eq!(
        reported,
        vec![(0, Output::Message(m(206, 1, 304, 100 * 1024, 6)))]
    );
    // Then SET_ACK + MARK + draw, one byte per call.
    let stream = sess.data(&[
        (msg_server::SET_ACK, wire::set_ack_body(1, 20).to_vec()),
        (102, vec![]),
        (304, vec![3; 10]),
    ]);
    let base = 206 + big.len() as u64;
    let mut out = Vec::new();
    for (i, b) in stream.iter().enumerate() {
        for o in k.s(&[std::slice::from_ref(b)]) {
            out.push((i, o));
        }
    }
    let mut set_ack = m(base, 2, 3, 8, 6);
    set_ack.prefix = [1, 20];
    assert_eq!(
        out,
        vec![
            (13, Output::Message(set_ack)), // reported when its 8th body byte arrives
            (19, Output::Message(m(base + 14, 3, 102, 0, 6))),
            (25, Output::Message(m(base + 20, 4, 304, 10, 6))),
        ]
    );
}

#[test]
fn hundreds_of_messages_in_one_call() {
    let sess = display_session();
    let mut k = Sock::default();
    k.link(&sess);
    let list: Vec<(u16, Vec<u8>)> = (0..500u32)
        .map(|i| (302 + (i % 12) as u16, vec![0; (i % 7) as usize]))
        .collect();
    let out = msgs(&k.s(&[&sess.data(&list)]));
    assert_eq!(out.len(), 500);
    let mut at = 206u64;
    for (i, (msg, (t, body))) in out.iter().zip(&list).enumerate() {
        assert_eq!(*msg, m(at, i as u64 + 1, *t, body.len() as u32, 6));
        at += 6 + body.len() as u64;
    }
    assert_eq!(k.s2c.need(), (at, 6));
    // 400 ACKs from the client in one call.
    let acks: Vec<u8> = (0..400).flat_map(|_| wire::ack(HeaderKind::Mini)).collect();
    let out = msgs(&k.c(&[&acks]));
    assert_eq!(out.len(), 400);
    assert_eq!(out[399], m(170 + 399 * 6, 400, msg_client::ACK, 0, 6));
}

#[test]
fn zero_length_bodies() {
    let sess = display_session();
    let mut k = Sock::default();
    k.link(&sess);
    // Display MARK (102) and RESET (103) from the server, ACK and MIGRATE_FLUSH_MARK from the client.
    let out = k.s(&[&sess.data(&[(102u16, []), (103, [])])]);
    assert_eq!(msgs(&out), vec![m(206, 1, 102, 0, 6), m(212, 2, 103, 0, 6)]);
    let out = k.c(&[&sess.data(&[(msg_client::ACK, []), (msg_client::MIGRATE_FLUSH_MARK, [])])]);
    assert_eq!(msgs(&out), vec![m(170, 1, 2, 0, 6), m(176, 2, 4, 0, 6)]);
    // A lone empty message in its own call, at the very end of the data seen so far.
    assert_eq!(
        msgs(&k.c(&[&wire::ack(HeaderKind::Mini)])),
        vec![m(182, 3, 2, 0, 6)]
    );
}

// ---------------------------------------------------------------------------------------------
// Prefixes: SET_ACK, ACK_SYNC, main INIT
// ---------------------------------------------------------------------------------------------

#[test]
fn prefixes_reported() {
    let sess = display_session();
    let mut k = Sock::default();
    k.link(&sess);
    let out = k.s(&[&wire::set_ack(HeaderKind::Mini, 7, 40)]);
    let mut want = m(206, 1, 3, 8, 6);
    want.prefix = [7, 40];
    assert_eq!(msgs(&out), vec![want]);
    let out = k.c(&[&wire::ack_sync(HeaderKind::Mini, 7)]);
    let mut want = m(170, 1, 1, 4, 6);
    want.prefix = [7, 0];
    assert_eq!(msgs(&out), vec![want]);
    // Type 103 on display is INVAL_ALL_PALETTES-area, not main INIT: no prefix.
    let out = k.s(&[&wire::message(HeaderKind::Mini, 103, &[5; 32])]);
    assert_eq!(msgs(&out), vec![m(220, 2, 103, 32, 6)]);
}

#[test]
fn main_init_prefix_is_session_id() {
    let sess = Session::new(channel::MAIN, 0);
    let mut k = Sock::default();
    k.link(&sess);
    let out = k.s(&[
        &wire::main_init(HeaderKind::Mini, 0x1234_5678),
        &wire::ping(HeaderKind::Mini, 1, 99, 0),
    ]);
    let mut init = m(202, 1, 103, 32, 6);
    init.prefix = [0x1234_5678, 0];
    assert_eq!(msgs(&out), vec![init, m(240, 2, 4, 12, 6)]);
}

#[test]
fn short_prefix_bodies() {
    // A SET_ACK whose size is 4 gets one prefix word; an ACK_SYNC of size 0 none.
    let sess = display_session();
    let mut k = Sock::default();
    k.link(&sess);
    let out = k.s(&[&wire::message(HeaderKind::Mini, 3, &9u32.to_le_bytes())]);
    let mut want = m(206, 1, 3, 4, 6);
    want.prefix = [9, 0];
    assert_eq!(msgs(&out), vec![want]);
    let out = k.c(&[&wire::message(HeaderKind::Mini, 1, &[])]);
    assert_eq!(msgs(&out), vec![m(170, 1, 1, 0, 6)]);
}

#[test]
fn prefix_bytes_split_across_calls() {
    let sess = Session::new_full(channel::DISPLAY, 0);
    let mut k = Sock::default();
    k.link(&sess);
    let sa = wire::set_ack(HeaderKind::Full, 1, 20);
    assert_eq!(sa.len(), 26);
    assert_eq!(
        k.s(&[&sa[..18]]),
        vec![],
        "header alone: waits for the prefix"
    );
    assert_eq!(k.s2c.phase(), Phase::DataPrefix);
    assert_eq!(k.s(&[&sa[18..21]]), vec![]);
    assert_eq!(k.s2c.need(), (202 + 21, 5));
    let out = k.s(&[&sa[21..], &wire::message(HeaderKind::Full, 102, &[])]);
    let mut want = m(202, 1, 3, 8, 18);
    want.prefix = [1, 20];
    assert_eq!(msgs(&out), vec![want, m(228, 2, 102, 0, 18)]);

    let sync = wire::ack_sync(HeaderKind::Full, 1);
    assert_eq!(k.c(&[&sync[..20]]), vec![]);
    let out = k.c(&[&sync[20..21], &sync[21..]]);
    let mut want = m(170, 1, 1, 4, 18);
    want.prefix = [1, 0];
    assert_eq!(msgs(&out), vec![want]);
}

// ---------------------------------------------------------------------------------------------
// EAGAIN starts: DirState::peek
// ---------------------------------------------------------------------------------------------

/// The first bytes of a rejected call, as the kernel copies them for `peek`.
fn first32(bytes: &[u8]) -> ([u8; BUF_LEN], u32) {
    let mut b = [0u8; BUF_LEN];
    let n = bytes.len().min(32);
    b[..n].copy_from_slice(&bytes[..n]);
    (b, n as u32)
}

#[test]
fn peek_then_real_write_reports_once() {
    let sess = display_session();
    let mut k = Sock::default();
    k.link(&sess);
    let msg = wire::message(HeaderKind::Mini, 304, &[1; 1000]);
    let (first, avail) = first32(&msg);
    let peer = k.c2s.view();
    // The writev that hit EAGAIN carried the message start.
    let peeked = k
        .s2c
        .peek(&first, avail, &peer)
        .expect("message start peeked");
    assert_eq!(peeked, m(206, 1, 304, 1000, 6));
    assert_eq!(k.s2c.msg_count, 0, "peek does not advance the state");
    assert_eq!(
        k.s2c.peek(&first, avail, &peer),
        None,
        "a second EAGAIN does not report it again"
    );
    // The retried write moves the bytes in two partial writes.
    let out = k.s(&[&msg[..500]]);
    let mut want = peeked;
    want.already_reported = true;
    assert_eq!(msgs(&out), vec![want]);
    assert_eq!(k.s(&[&msg[500..]]), vec![]);
    // The next message is a fresh one.
    let next = wire::message(HeaderKind::Mini, 102, &[]);
    let (first, avail) = first32(&next);
    let p = k.s2c.peek(&first, avail, &k.c2s.view()).unwrap();
    assert_eq!(p, m(1212, 2, 102, 0, 6));
    let out = k.s(&[&next]);
    assert!(msgs(&out)[0].already_reported);
}

#[test]
fn peek_needs_the_whole_header_and_prefix() {
    let sess = display_session();
    let mut k = Sock::default();
    k.link(&sess);
    let sa = wire::set_ack(HeaderKind::Mini, 1, 20);
    let peer = k.c2s.view();
    let (first, _) = first32(&sa);
    assert_eq!(k.s2c.peek(&first, 5, &peer), None, "header incomplete");
    assert_eq!(k.s2c.peek(&first, 10, &peer), None, "prefix incomplete");
    let mut want = m(206, 1, 3, 8, 6);
    want.prefix = [1, 20];
    assert_eq!(k.s2c.peek(&first, 14, &peer), Some(want));
    let out = k.s(&[&sa]);
    want.already_reported = true;
    assert_eq!(msgs(&out), vec![want]);
}

#[test]
fn peek_refuses_outside_a_data_boundary() {
    // In the link phase, or with part of a header already buffered, peek reports nothing.
    let sess = display_session();
    let mut k = Sock::default();
    let (first, avail) = first32(&wire::ack(HeaderKind::Mini));
    assert_eq!(k.s2c.peek(&first, avail, &k.c2s.view()), None);
    k.link(&sess);
    let msg = wire::message(HeaderKind::Mini, 304, &[0; 8]);
    k.s(&[&msg[..2]]);
    let (first, avail) = first32(&msg[2..]);
    assert_eq!(k.s2c.peek(&first, avail, &k.c2s.view()), None);
}

#[test]
fn peek_in_the_middle_of_a_body_reports_nothing() {
    // A message was partly written (header + 10 of 100 body bytes); the next writev, carrying
    // more *body* bytes, hits EAGAIN. Those bytes are not a message start, even if they look
    // like a header (here: 02 00 00 00 00 00 = an ACK-shaped mini header).
    let sess = display_session();
    let mut k = Sock::default();
    k.link(&sess);
    let body: Vec<u8> = [0u8; 10]
        .iter()
        .chain([2u8, 0, 0, 0, 0, 0].iter())
        .chain([0u8; 84].iter())
        .copied()
        .collect();
    let msg = wire::message(HeaderKind::Mini, 304, &body);
    assert_eq!(msgs(&k.s(&[&msg[..16]])), vec![m(206, 1, 304, 100, 6)]);
    assert_eq!(k.s2c.pos, 222);
    let (first, avail) = first32(&msg[16..]);
    let peeked = k.s2c.peek(&first, avail, &k.c2s.view());
    assert_eq!(
        peeked, None,
        "stream position 222 is inside the body (next message at 312)"
    );
}

// ---------------------------------------------------------------------------------------------
// Not SPICE, or SPICE that cannot be framed
// ---------------------------------------------------------------------------------------------

#[test]
fn garbage_is_not_spice() {
    let mut k = Sock::default();
    let bytes = [
        0x01u8, 0x02, 0x03, 0x04, 0xAA, 0xBB, 0xCC, 0xDD, 9, 9, 9, 9, 9, 9, 9, 9, 9,
    ];
    assert_eq!(
        unparsed(&k.c(&[&bytes])),
        (UnparsedReason::NotSpice, 0x0403_0201, 0)
    );
    assert!(k.c2s.is_unparsed());
    assert_eq!(k.c(&[&[0u8; 100]]), vec![], "nothing more once unparsed");
    assert_eq!(k.c2s.pos, 117);
    // Garbage split over calls: still decided only once 16 bytes are in.
    let mut k = Sock::default();
    assert_eq!(k.c(&[&bytes[..3]]), vec![]);
    assert_eq!(unparsed(&k.c(&[&bytes[3..]])).0, UnparsedReason::NotSpice);
}

#[test]
fn tls_websocket_and_http_starts() {
    let hello = [
        0x16u8, 0x03, 0x01, 0x00, 0xF1, 0x01, 0x00, 0x00, 0xED, 0x03, 0x03, 0, 0, 0, 0, 0,
    ];
    let mut k = Sock::default();
    assert_eq!(
        unparsed(&k.c(&[&hello])),
        (UnparsedReason::Tls, 0x0001_0316, 0)
    );

    let get = b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n\r\n";
    let mut k = Sock::default();
    assert_eq!(
        unparsed(&k.c(&[get])),
        (UnparsedReason::WebSocket, u32::from_le_bytes(*b"GET "), 0)
    );

    // The server answering a REDQ client with HTTP.
    let sess = display_session();
    let mut k = Sock::default();
    only_link(&k.c(&[&sess.client_link()]));
    let out = k.s(&[b"HTTP/1.1 400 Bad Request\r\n\r\n"]);
    assert_eq!(
        unparsed(&out),
        (UnparsedReason::Http, u32::from_le_bytes(*b"HTTP"), 0)
    );
}

#[test]
fn sasl_leaves_both_directions_unparsed() {
    let mut sess = display_session();
    sess.client_common_caps = vec![0x0D];
    sess.server_common_caps = vec![0x0D];
    sess.auth_mechanism = 2;
    let mut k = Sock::default();
    only_link(&k.c(&[&sess.client_link()]));
    only_link(&k.s(&[&sess.server_link()]));
    assert_eq!(
        unparsed(&k.c(&[&wire::auth_mechanism(2)])),
        (UnparsedReason::Sasl, 2, 38)
    );
    assert!(k.c2s.view().sasl);
    // S→C: u32 length + mechanism list where the link result would be.
    let mechs = b",DIGEST-MD5,GSSAPI,";
    let out = k.s(&[&(mechs.len() as u32).to_le_bytes(), mechs]);
    assert_eq!(unparsed(&out), (UnparsedReason::Sasl, 2, 16 + 186));
    assert!(k.s2c.is_unparsed() && k.c2s.is_unparsed());
    assert_eq!(k.c(&[b"\x0aDIGEST-MD5"]), vec![]);
}

#[test]
fn link_refused_in_reply() {
    let sess = display_session();
    let mut k = Sock::default();
    only_link(&k.c(&[&sess.client_link()]));
    let out = k.s(&[&wire::link_error_reply(9)]);
    assert_eq!(unparsed(&out), (UnparsedReason::LinkRefused, 9, 16));
}

#[test]
fn link_refused_by_result() {
    let sess = display_session();
    let mut k = Sock::default();
    only_link(&k.c(&[&sess.client_link()]));
    only_link(&k.s(&[&sess.server_link()]));
    k.c(&[&sess.client_auth()]);
    let out = k.s(&[&wire::link_result(7)]);
    assert_eq!(unparsed(&out), (UnparsedReason::LinkRefused, 7, 202));
}

#[test]
fn error_reply_after_ok_reply() {
    // Unknown mechanism: spice-server answers the OK reply with a full error reply (§1.7).
    let sess = display_session();
    let mut k = Sock::default();
    only_link(&k.c(&[&sess.client_link()]));
    only_link(&k.s(&[&sess.server_link()]));
    let out = k.s(&[&wire::link_error_reply(3)]);
    assert_eq!(
        unparsed(&out),
        (UnparsedReason::LinkErrorAfterReply, REDQ_LE, 202)
    );
}

#[test]
fn bad_headers_start_a_hunt_at_their_offset() {
    let sess = display_session();
    // Type 0 as the third message.
    let mut k = Sock::default();
    k.link(&sess);
    let mut bytes = sess.data(&[(304u16, vec![0u8; 10]), (102, vec![])]);
    bytes.extend(wire::mini_header(0, 4));
    bytes.extend(wire::message(HeaderKind::Mini, 102, &[]));
    let out = k.s(&[&bytes]);
    assert_eq!(out.len(), 3);
    assert_eq!(msgs(&out[..2]).len(), 2);
    assert_eq!(
        hunt(&out[2..]),
        (UnparsedReason::BadHeader, 0, 206 + 16 + 6)
    );

    // Huge size (above MAX_MESSAGE_SIZE), full header.
    let sess = Session::new_full(channel::DISPLAY, 0);
    let mut k = Sock::default();
    k.link(&sess);
    let mut bytes = wire::message(HeaderKind::Full, 102, &[]);
    bytes.extend(wire::full_header(2, 304, MAX_MESSAGE_SIZE + 1, 0));
    let out = k.s(&[&bytes]);
    assert_eq!(msgs(&out[..1]), vec![m(202, 1, 102, 0, 18)]);
    assert_eq!(hunt(&out[1..]), (UnparsedReason::BadHeader, 304, 220));
    // MAX_MESSAGE_SIZE itself is accepted.
    let mut k = Sock::default();
    k.link(&sess);
    let out = k.s(&[&wire::full_header(1, 304, MAX_MESSAGE_SIZE, 0)]);
    assert_eq!(msgs(&out), vec![m(202, 1, 304, MAX_MESSAGE_SIZE, 18)]);

    // Type above 1000 from the client.
    let sess = display_session();
    let mut k = Sock::default();
    k.link(&sess);
    let out = k.c(&[&wire::mini_header(1001, 0)]);
    assert_eq!(hunt(&out), (UnparsedReason::BadHeader, 1001, 170));
}

#[test]
fn truncated_stream_waits_mid_header() {
    let sess = display_session();
    let mut k = Sock::default();
    k.link(&sess);
    let msg = wire::message(HeaderKind::Mini, 304, &[0; 4]);
    assert_eq!(k.s(&[&msg[..4]]), vec![]);
    assert_eq!(k.s2c.phase(), Phase::DataHeader);
    assert_eq!((k.s2c.have, k.s2c.msg_count, k.s2c.pos), (4, 0, 210));
    assert_eq!(k.s2c.need(), (210, 2));
    // Stream ends mid-body too: the message is reported, the position waits at the body.
    let mut k2 = Sock::default();
    k2.link(&sess);
    assert_eq!(msgs(&k2.s(&[&msg[..8]])).len(), 1);
    assert_eq!(k2.s2c.need(), (216, 6));
    assert_eq!(k2.s2c.pos, 214);
    // Truncated mid-link: no link output yet.
    let mut k3 = Sock::default();
    assert_eq!(k3.c(&[&sess.client_link()[..30]]), vec![]);
    assert_eq!(k3.c2s.phase(), Phase::LinkMess);
}

#[test]
fn data_before_the_peer_link_reply() {
    // A client that pipelines link, mechanism, ticket and a message before any server byte.
    let sess = display_session();
    let mut k = Sock::default();
    let out = k.c(&[&sess.client_stream(&[(msg_client::ACK, [])])]);
    assert_eq!(out.len(), 2);
    only_link(&out[..1]);
    assert_eq!(
        unparsed(&out[1..]),
        (UnparsedReason::PeerLinkMissing, 0, 170)
    );
}

// ---------------------------------------------------------------------------------------------
// Property: random split points frame identically to one call
// ---------------------------------------------------------------------------------------------

/// Feeds `bytes` as a random sequence of calls, each a random number of random segments.
fn feed_randomly(
    st: &mut DirState,
    peer: &spice_ebpf_common::framing::PeerView,
    bytes: &[u8],
    rng: &mut Rng,
) -> Vec<Output> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let max = if rng.below(4) == 0 { 3 } else { 200 };
        let call = (1 + rng.below(max) as usize).min(bytes.len() - i);
        let data = &bytes[i..i + call];
        let mut segs: Vec<&[u8]> = Vec::new();
        let mut j = 0;
        while j < data.len() {
            let n = (rng.below(40) as usize).min(data.len() - j); // empty segments allowed
            segs.push(&data[j..j + n]);
            j += n;
        }
        feed(st, peer, &segs, |o| out.push(o));
        i += call;
    }
    out
}

#[test]
fn random_splits_frame_like_one_call() {
    let mut rng = Rng(0x5EED);
    for round in 0..300 {
        let kind = if rng.below(2) == 0 {
            HeaderKind::Mini
        } else {
            HeaderKind::Full
        };
        let ch = if rng.below(3) == 0 {
            channel::MAIN
        } else {
            channel::DISPLAY
        };
        let mut sess = if kind == HeaderKind::Mini {
            Session::new(ch, 0)
        } else {
            Session::new_full(ch, 0)
        };
        sess.server_channel_caps = (0..rng.below(3)).map(|_| rng.next_u64() as u32).collect();
        let n = 1 + rng.below(60) as usize;
        let server_msgs: Vec<(u16, Vec<u8>)> = (0..n)
            .map(|_| {
                let t = [3u16, 4, 102, 103, 123, 304][rng.below(6) as usize];
                let size = match rng.below(10) {
                    0 => 0,
                    1 => rng.below(5000) as usize,
                    _ => rng.below(64) as usize,
                };
                let body: Vec<u8> = (0..size).map(|_| rng.next_u64() as u8).collect();
                (t, body)
            })
            .collect();
        let client_msgs: Vec<(u16, Vec<u8>)> = (0..n)
            .map(|_| {
                (
                    [1u16, 2, 3, 101][rng.below(4) as usize],
                    vec![1u8; rng.below(16) as usize],
                )
            })
            .collect();

        let run = |split: Option<&mut Rng>| -> (Vec<Output>, Vec<Output>) {
            let mut k = Sock::default();
            k.link(&sess);
            let s = sess.data(&server_msgs);
            let c = sess.data(&client_msgs);
            match split {
                None => (k.s(&[&s]), k.c(&[&c])),
                Some(rng) => {
                    let peer = k.c2s.view();
                    let so = feed_randomly(&mut k.s2c, &peer, &s, rng);
                    let peer = k.s2c.view();
                    let co = feed_randomly(&mut k.c2s, &peer, &c, rng);
                    (so, co)
                }
            }
        };
        let whole = run(None);
        let split = run(Some(&mut rng));
        assert_eq!(whole, split, "round {round}");
        // And both match what was generated.
        let data_start = sess.server_data_start() as u64;
        let hl = kind.header_len() as u64;
        let mut at = data_start;
        let got = msgs(&whole.0);
        assert_eq!(got.len(), n, "round {round}");
        for (g, (t, b)) in got.iter().zip(&server_msgs) {
            assert_eq!(
                (g.at, g.msg_type, g.size as usize, g.hdr_len as u64),
                (at, *t, b.len(), hl),
                "round {round}"
            );
            at += hl + b.len() as u64;
        }
        assert_eq!(msgs(&whole.1).len(), n, "round {round}");
    }
}

// ---------------------------------------------------------------------------------------------
// The first-message fast path (DirState::header_at_call_start) against the element loop
// ---------------------------------------------------------------------------------------------

/// `st` without its element buffer: the fast path reads a header without copying it there,
/// and nothing reads the buffer of an element already complete.
fn without_buf(st: &DirState) -> String {
    let mut s = *st;
    s.buf = [0; BUF_LEN];
    format!("{s:?}")
}

/// A random server → client stream and a random client → server one, each cut into calls at
/// random places (often at message boundaries, as spice-server writes; sometimes with the
/// header in its own iovec, as its writev does; sometimes mid-header), fed twice: with the
/// fast path and with the element loop alone. Every call's outputs and every state must be
/// the same. The streams include messages whose first body words are reported (SET_ACK,
/// ACK_SYNC), zero-length bodies, and headers that fail validation (type 0, a size over the
/// limit), which start the hunt.
#[test]
fn fast_path_frames_as_the_element_loop_does() {
    use spice_ebpf_common::event::lock_how;
    use spice_ebpf_common::framing::feed_call_with;
    let mut rng = Rng(0x5eed_fa57);
    let mut fast_msgs = 0usize;
    for round in 0..200 {
        let sess = if round % 2 == 0 {
            display_session()
        } else {
            Session::new_full(channel::DISPLAY, 0)
        };
        let kind = if round % 2 == 0 {
            HeaderKind::Mini
        } else {
            HeaderKind::Full
        };
        let mut a = Sock::default();
        a.link(&sess);
        let mut b = Sock::default();
        b.link(&sess);
        for dir in [S2C, C2S] {
            let mut w = MessageWriter::new(kind);
            let mut bytes = Vec::new();
            let mut bounds = vec![0usize];
            let mut hdr_ends = Vec::new();
            for _ in 0..60 {
                let r = rng.below(100);
                let msg = if dir == S2C && r < 8 {
                    wire::set_ack(kind, 1 + rng.below(5) as u32, 20)
                } else if dir == C2S && r < 8 {
                    wire::ack_sync(kind, 1 + rng.below(5) as u32)
                } else if r < 10 {
                    // Fails validation: type 0 (the loop hunts from here).
                    w.message(0, &[0; 3])
                } else {
                    let body = vec![0xa5u8; rng.below(300) as usize];
                    w.message(100 + rng.below(200) as u16, &body)
                };
                hdr_ends.push(bytes.len() + if kind == HeaderKind::Mini { 6 } else { 18 });
                bytes.extend(msg);
                bounds.push(bytes.len());
            }
            // Cut points: message boundaries, header ends, and random bytes.
            let mut cuts = Vec::new();
            for (i, &e) in bounds.iter().enumerate().skip(1) {
                match rng.below(4) {
                    0 => {}
                    1 => cuts.push(e),
                    2 => cuts.push(hdr_ends[i - 1].min(e)),
                    _ => cuts
                        .push(bounds[i - 1] + rng.below((e - bounds[i - 1]) as u64 + 1) as usize),
                }
            }
            cuts.push(bytes.len());
            cuts.sort_unstable();
            cuts.dedup();
            let mut start = 0usize;
            for &end in &cuts {
                if end <= start {
                    continue;
                }
                let call = &bytes[start..end];
                // Sometimes the header in an iovec of its own (spice-server's writev).
                let split = if rng.below(3) == 0 {
                    (1 + rng.below(call.len() as u64) as usize).min(call.len())
                } else {
                    call.len()
                };
                let segs: Vec<&[u8]> = if split < call.len() {
                    vec![&call[..split], &call[split..]]
                } else {
                    vec![call]
                };
                let (mut oa, mut ob) = (Vec::new(), Vec::new());
                if dir == S2C {
                    let (pa, pb) = (a.c2s.view(), b.c2s.view());
                    feed_call_with(&mut a.s2c, &pa, &segs, lock_how::CONTENT, 0, true, |o| {
                        oa.push(o)
                    });
                    feed_call_with(&mut b.s2c, &pb, &segs, lock_how::CONTENT, 0, false, |o| {
                        ob.push(o)
                    });
                    assert_eq!(
                        without_buf(&a.s2c),
                        without_buf(&b.s2c),
                        "round {round} s2c at {start}"
                    );
                } else {
                    let (pa, pb) = (a.s2c.view(), b.s2c.view());
                    feed_call_with(&mut a.c2s, &pa, &segs, lock_how::CONTENT, 0, true, |o| {
                        oa.push(o)
                    });
                    feed_call_with(&mut b.c2s, &pb, &segs, lock_how::CONTENT, 0, false, |o| {
                        ob.push(o)
                    });
                    assert_eq!(
                        without_buf(&a.c2s),
                        without_buf(&b.c2s),
                        "round {round} c2s at {start}"
                    );
                }
                assert_eq!(oa, ob, "round {round} dir {dir} call {start}..{end}");
                fast_msgs += oa
                    .iter()
                    .filter(|o| matches!(o, Output::Message(_)))
                    .count();
                start = end;
            }
        }
    }
    // The streams must have exercised the fast path (not only hunts).
    assert!(fast_msgs > 5_000, "only {fast_msgs} messages framed");
}
