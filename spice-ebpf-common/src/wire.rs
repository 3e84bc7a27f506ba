//! Byte builders for SPICE link messages and data messages (host only: unit tests and the
//! scripted peer `spice-peer`). Compiled with feature `std` or under `cfg(test)`.
//!
//! Every builder returns the exact bytes a real peer puts on the wire, little-endian and packed,
//! following the project's protocol notes (`docs/spice-protocol.md`):
//! * §1.2 client link message (spice-gtk layout), §1.3 server link reply (spice-server layout),
//!   §1.5 auth mechanism word, 128-byte ticket and 4-byte link result, §1.7 error replies;
//! * §1.9 the 6-byte mini header and the 18-byte full header; §2.2/§2.3 SET_ACK, ACK_SYNC,
//!   ACK, PING and main INIT bodies.
//!
//! [`Session`] glues these together into the complete byte stream of each direction of one
//! connection (link, auth, result, then data messages).

use std::vec::Vec;

use crate::protocol::{
    AUTH_MECHANISM_SPICE, CAP_AUTH_SELECTION, CAP_MINI_HEADER, FULL_HEADER_LEN, LINK_HEADER_LEN,
    LINK_MESS_MIN, LINK_REPLY_MIN, MINI_HEADER_LEN, SPICE_MAGIC, SPICE_VERSION_MAJOR,
    SPICE_VERSION_MINOR, TICKET_LEN, msg_client, msg_server,
};

/// Bytes of the public key field of `SpiceLinkReply` (`SPICE_TICKET_PUBKEY_BYTES`, 128 + 34).
pub const PUB_KEY_LEN: usize = 162;

/// The data header a connection uses (`docs/spice-protocol.md` §1.9).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HeaderKind {
    /// `SpiceMiniDataHeader`, 6 bytes: type u16, size u32.
    Mini,
    /// `SpiceDataHeader`, 18 bytes: serial u64, type u16, size u32, sub_list u32.
    Full,
}

impl HeaderKind {
    /// Header length in bytes: 6 or 18.
    pub const fn header_len(self) -> usize {
        match self {
            HeaderKind::Mini => MINI_HEADER_LEN as usize,
            HeaderKind::Full => FULL_HEADER_LEN as usize,
        }
    }

    /// The parser rule of §1.9: mini iff *both* first common-caps words have bit 3
    /// (`CAP_MINI_HEADER`); an empty list (num_common_caps = 0) means full headers.
    pub fn negotiated(client_common_caps: &[u32], server_common_caps: &[u32]) -> HeaderKind {
        let c = client_common_caps.first().copied().unwrap_or(0);
        let s = server_common_caps.first().copied().unwrap_or(0);
        if c & s & CAP_MINI_HEADER != 0 {
            HeaderKind::Mini
        } else {
            HeaderKind::Full
        }
    }

    /// `"mini"` or `"full"` (for reports).
    pub const fn name(self) -> &'static str {
        match self {
            HeaderKind::Mini => "mini",
            HeaderKind::Full => "full",
        }
    }
}

fn put_u32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_le_bytes());
}

/// 16-byte `SpiceLinkHeader` (§1.2/§1.3): "REDQ", major 2, minor 2, `size` = bytes that follow
/// the header (H_c for the client, H_s for the server).
pub fn link_header(size: u32) -> [u8; 16] {
    link_header_version(SPICE_VERSION_MAJOR, size)
}

/// [`link_header`] with an arbitrary major version (spice-server refuses anything but 2, §1.2).
pub fn link_header_version(major: u32, size: u32) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&SPICE_MAGIC);
    h[4..8].copy_from_slice(&major.to_le_bytes());
    h[8..12].copy_from_slice(&SPICE_VERSION_MINOR.to_le_bytes());
    h[12..16].copy_from_slice(&size.to_le_bytes());
    h
}

/// Client link message as spice-gtk writes it (§1.2), in one buffer:
/// `SpiceLinkHeader` (size H_c = 18 + 4·(common + channel words)) + `SpiceLinkMess`
/// (connection_id u32, channel_type u8, channel_id u8, num_common_caps u32,
/// num_channel_caps u32, caps_offset u32 = 18) + the common cap words + the channel cap words.
/// Total length 16 + H_c = 34 + 4·n bytes.
pub fn link_mess(
    connection_id: u32,
    channel_type: u8,
    channel_id: u8,
    common_caps: &[u32],
    channel_caps: &[u32],
) -> Vec<u8> {
    link_mess_with_caps_offset(
        connection_id,
        channel_type,
        channel_id,
        common_caps,
        channel_caps,
        LINK_MESS_MIN,
    )
}

/// [`link_mess`] with the caps at `caps_offset` (relative to byte 16, ≥ 18); the bytes between
/// the 18-byte `SpiceLinkMess` and the caps are zero padding, and H_c = caps_offset + 4·n.
///
/// Panics if `caps_offset < 18` (the layout would overlap the fixed fields).
pub fn link_mess_with_caps_offset(
    connection_id: u32,
    channel_type: u8,
    channel_id: u8,
    common_caps: &[u32],
    channel_caps: &[u32],
    caps_offset: u32,
) -> Vec<u8> {
    assert!(
        caps_offset >= LINK_MESS_MIN,
        "caps_offset {caps_offset} < 18"
    );
    let n = (common_caps.len() + channel_caps.len()) as u32;
    let size = caps_offset + 4 * n;
    let mut v = Vec::with_capacity(16 + size as usize);
    v.extend_from_slice(&link_header(size));
    put_u32(&mut v, connection_id);
    v.push(channel_type);
    v.push(channel_id);
    put_u32(&mut v, common_caps.len() as u32);
    put_u32(&mut v, channel_caps.len() as u32);
    put_u32(&mut v, caps_offset);
    v.resize(16 + caps_offset as usize, 0);
    for &c in common_caps.iter().chain(channel_caps) {
        put_u32(&mut v, c);
    }
    v
}

/// A stand-in for the 162-byte DER SubjectPublicKeyInfo spice-server sends (§1.3): a DER
/// SEQUENCE prefix followed by a fixed byte pattern. Framing never looks inside it.
pub fn fake_pub_key() -> [u8; PUB_KEY_LEN] {
    let mut k = [0u8; PUB_KEY_LEN];
    k[0] = 0x30;
    k[1] = 0x81;
    k[2] = 0x9f;
    for (i, b) in k.iter_mut().enumerate().skip(3) {
        *b = (i as u8).wrapping_mul(37).wrapping_add(11);
    }
    k
}

/// Server link reply as spice-server writes it (§1.3): `SpiceLinkHeader` (size H_s =
/// 178 + 4·n) + `SpiceLinkReply` (error u32, 162-byte pub key ([`fake_pub_key`]),
/// num_common_caps u32, num_channel_caps u32, caps_offset u32 = 178) + the cap words.
/// Total length 16 + H_s = 194 + 4·n bytes; the caps start at byte 194.
///
/// spice-server writes bytes 0..194 in one write and then each cap word in its own 4-byte
/// write; this function returns them concatenated (split at 194 + 4·i to mimic the writes).
pub fn link_reply(error: u32, common_caps: &[u32], channel_caps: &[u32]) -> Vec<u8> {
    link_reply_with_key(error, &fake_pub_key(), common_caps, channel_caps)
}

/// [`link_reply`] with an explicit public key (all zeros when SASL is on, §1.3).
pub fn link_reply_with_key(
    error: u32,
    pub_key: &[u8; PUB_KEY_LEN],
    common_caps: &[u32],
    channel_caps: &[u32],
) -> Vec<u8> {
    let n = (common_caps.len() + channel_caps.len()) as u32;
    let size = LINK_REPLY_MIN + 4 * n;
    let mut v = Vec::with_capacity(16 + size as usize);
    v.extend_from_slice(&link_header(size));
    put_u32(&mut v, error);
    v.extend_from_slice(pub_key);
    put_u32(&mut v, common_caps.len() as u32);
    put_u32(&mut v, channel_caps.len() as u32);
    put_u32(&mut v, LINK_REPLY_MIN);
    for &c in common_caps.iter().chain(channel_caps) {
        put_u32(&mut v, c);
    }
    v
}

/// Link error reply (`reds_send_link_error`, §1.7): a 16-byte header with size 178 and a
/// 178-byte `SpiceLinkReply` whose only non-zero field is `error`. 194 bytes in all.
pub fn link_error_reply(error: u32) -> Vec<u8> {
    let total = (LINK_HEADER_LEN + LINK_REPLY_MIN) as usize;
    let mut v = Vec::with_capacity(total);
    v.extend_from_slice(&link_header(LINK_REPLY_MIN));
    put_u32(&mut v, error);
    v.resize(total, 0);
    v
}

/// `SpiceLinkAuthMechanism` (§1.5 step 1): one u32, 1 = SPICE ticket, 2 = SASL.
pub fn auth_mechanism(mechanism: u32) -> [u8; 4] {
    mechanism.to_le_bytes()
}

/// A 128-byte ticket (§1.5 step 2). Real clients send RSA-OAEP ciphertext; framing only
/// counts it, so this is a fixed, non-zero pattern.
pub fn ticket() -> [u8; TICKET_LEN as usize] {
    let mut t = [0u8; TICKET_LEN as usize];
    for (i, b) in t.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(73).wrapping_add(5);
    }
    t
}

/// The 4-byte link result `SpiceLinkErr` (§1.5 step 3): 0 = OK.
pub fn link_result(code: u32) -> [u8; 4] {
    code.to_le_bytes()
}

/// 6-byte `SpiceMiniDataHeader` (§1.9): type u16 @0, size u32 @2 (`size` = body bytes).
pub fn mini_header(msg_type: u16, size: u32) -> [u8; 6] {
    let mut h = [0u8; 6];
    h[0..2].copy_from_slice(&msg_type.to_le_bytes());
    h[2..6].copy_from_slice(&size.to_le_bytes());
    h
}

/// 18-byte `SpiceDataHeader` (§1.9): serial u64 @0, type u16 @8, size u32 @10, sub_list u32 @14.
pub fn full_header(serial: u64, msg_type: u16, size: u32, sub_list: u32) -> [u8; 18] {
    let mut h = [0u8; 18];
    h[0..8].copy_from_slice(&serial.to_le_bytes());
    h[8..10].copy_from_slice(&msg_type.to_le_bytes());
    h[10..14].copy_from_slice(&size.to_le_bytes());
    h[14..18].copy_from_slice(&sub_list.to_le_bytes());
    h
}

/// The header of a message of `size` body bytes: 6 or 18 bytes (`serial` is ignored for mini
/// headers; sub_list is 0).
pub fn header(kind: HeaderKind, serial: u64, msg_type: u16, size: u32) -> Vec<u8> {
    match kind {
        HeaderKind::Mini => mini_header(msg_type, size).to_vec(),
        HeaderKind::Full => full_header(serial, msg_type, size, 0).to_vec(),
    }
}

/// One whole data message: header + `body`. A full header gets serial 1 (use
/// [`MessageWriter`] for a numbered sequence) and sub_list 0.
pub fn message(kind: HeaderKind, msg_type: u16, body: &[u8]) -> Vec<u8> {
    message_with_serial(kind, 1, msg_type, body)
}

/// [`message`] with an explicit full-header serial.
pub fn message_with_serial(kind: HeaderKind, serial: u64, msg_type: u16, body: &[u8]) -> Vec<u8> {
    let mut v = header(kind, serial, msg_type, body.len() as u32);
    v.extend_from_slice(body);
    v
}

/// SET_ACK body (S→C type 3, §2.2): generation u32, window u32 (8 bytes).
pub fn set_ack_body(generation: u32, window: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0..4].copy_from_slice(&generation.to_le_bytes());
    b[4..8].copy_from_slice(&window.to_le_bytes());
    b
}

/// ACK_SYNC body (C→S type 1, §2.2): generation u32 (4 bytes).
pub fn ack_sync_body(generation: u32) -> [u8; 4] {
    generation.to_le_bytes()
}

/// PING body (S→C type 4, §2.2): id u32, timestamp u64, then `filler` zero bytes
/// (12 + filler bytes).
pub fn ping_body(id: u32, timestamp: u64, filler: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(12 + filler);
    put_u32(&mut b, id);
    b.extend_from_slice(&timestamp.to_le_bytes());
    b.resize(12 + filler, 0);
    b
}

/// Main-channel INIT body (S→C type 103 on channel 1, §2.3): 8 × u32 = 32 bytes, session_id
/// first; the rest are plausible values (1 display channel, client+server mouse modes,
/// server mode current, no agent, 10 agent tokens, multimedia time 0, ram hint 0).
pub fn main_init_body(session_id: u32) -> [u8; 32] {
    let fields = [session_id, 1, 3, 1, 0, 10, 0, 0];
    let mut b = [0u8; 32];
    for (i, f) in fields.iter().enumerate() {
        b[i * 4..i * 4 + 4].copy_from_slice(&f.to_le_bytes());
    }
    b
}

/// Whole SET_ACK message (14 bytes mini, 26 full).
pub fn set_ack(kind: HeaderKind, generation: u32, window: u32) -> Vec<u8> {
    message(kind, msg_server::SET_ACK, &set_ack_body(generation, window))
}

/// Whole ACK_SYNC message (10 bytes mini, 22 full).
pub fn ack_sync(kind: HeaderKind, generation: u32) -> Vec<u8> {
    message(kind, msg_client::ACK_SYNC, &ack_sync_body(generation))
}

/// Whole ACK message: header only (6 bytes mini, 18 full).
pub fn ack(kind: HeaderKind) -> Vec<u8> {
    message(kind, msg_client::ACK, &[])
}

/// Whole PING message (header + 12 + filler bytes).
pub fn ping(kind: HeaderKind, id: u32, timestamp: u64, filler: usize) -> Vec<u8> {
    message(kind, msg_server::PING, &ping_body(id, timestamp, filler))
}

/// Whole main INIT message (header + 32 bytes).
pub fn main_init(kind: HeaderKind, session_id: u32) -> Vec<u8> {
    message(kind, msg_server::MAIN_INIT, &main_init_body(session_id))
}

/// Builds a numbered sequence of messages for one direction: full-header serials start at 1
/// and grow by 1 per message (§1.9); mini headers carry no serial.
#[derive(Clone, Copy, Debug)]
pub struct MessageWriter {
    pub kind: HeaderKind,
    /// Serial of the next full-header message.
    pub next_serial: u64,
}

impl MessageWriter {
    /// A writer whose first full-header serial is 1.
    pub fn new(kind: HeaderKind) -> Self {
        MessageWriter {
            kind,
            next_serial: 1,
        }
    }

    /// The next header for a body of `size` bytes (takes a serial).
    pub fn header(&mut self, msg_type: u16, size: u32) -> Vec<u8> {
        let h = header(self.kind, self.next_serial, msg_type, size);
        self.next_serial += 1;
        h
    }

    /// The next whole message (takes a serial).
    pub fn message(&mut self, msg_type: u16, body: &[u8]) -> Vec<u8> {
        let mut v = self.header(msg_type, body.len() as u32);
        v.extend_from_slice(body);
        v
    }
}

/// Both directions of one plain-TCP SPICE connection, built from the link parameters.
///
/// Defaults ([`Session::new`]) are what spice-gtk and spice-server send: client common caps
/// `[0x09]` (AUTH_SELECTION + MINI_HEADER), server common caps `[0x0B]` (+ AUTH_SPICE), no
/// channel caps, caps_offset 18, connection_id 0, ticket auth and link result 0.
///
/// Stream layout (§1.8): client → server = link message (16 + H_c), auth mechanism (4, only if
/// the *client's* common caps have bit 0), ticket (128), then data; server → client = link
/// reply (16 + H_s), result (4), then data. Data uses mini headers iff both common-caps words
/// have bit 3 ([`HeaderKind::negotiated`]).
#[derive(Clone, Debug)]
pub struct Session {
    pub connection_id: u32,
    pub channel_type: u8,
    pub channel_id: u8,
    pub client_common_caps: Vec<u32>,
    pub client_channel_caps: Vec<u32>,
    pub server_common_caps: Vec<u32>,
    pub server_channel_caps: Vec<u32>,
    /// caps_offset of the client link message (≥ 18).
    pub caps_offset: u32,
    /// Auth mechanism word the client sends when it advertises auth selection.
    pub auth_mechanism: u32,
    /// Link result the server sends after the ticket.
    pub link_result: u32,
}

impl Session {
    /// A spice-gtk ↔ spice-server session on (`channel_type`, `channel_id`) with mini headers.
    pub fn new(channel_type: u8, channel_id: u8) -> Self {
        Session {
            connection_id: 0,
            channel_type,
            channel_id,
            client_common_caps: std::vec![CAP_AUTH_SELECTION | CAP_MINI_HEADER],
            client_channel_caps: Vec::new(),
            server_common_caps: std::vec![0x0B],
            server_channel_caps: Vec::new(),
            caps_offset: LINK_MESS_MIN,
            auth_mechanism: AUTH_MECHANISM_SPICE,
            link_result: 0,
        }
    }

    /// Same as [`Session::new`] but the client does not advertise MINI_HEADER (caps `[0x01]`),
    /// so both directions use 18-byte full headers.
    pub fn new_full(channel_type: u8, channel_id: u8) -> Self {
        let mut s = Self::new(channel_type, channel_id);
        s.client_common_caps = std::vec![CAP_AUTH_SELECTION];
        s
    }

    /// The negotiated data header.
    pub fn header_kind(&self) -> HeaderKind {
        HeaderKind::negotiated(&self.client_common_caps, &self.server_common_caps)
    }

    /// True if the client advertised PROTOCOL_AUTH_SELECTION, i.e. sends the mechanism word.
    pub fn auth_selection(&self) -> bool {
        self.client_common_caps
            .first()
            .is_some_and(|c| c & CAP_AUTH_SELECTION != 0)
    }

    /// H_c: the `size` field of the client link header.
    pub fn client_link_size(&self) -> u32 {
        self.caps_offset
            + 4 * (self.client_common_caps.len() + self.client_channel_caps.len()) as u32
    }

    /// H_s: the `size` field of the server link header.
    pub fn server_link_size(&self) -> u32 {
        LINK_REPLY_MIN + 4 * (self.server_common_caps.len() + self.server_channel_caps.len()) as u32
    }

    /// Client link message (16 + H_c bytes).
    pub fn client_link(&self) -> Vec<u8> {
        link_mess_with_caps_offset(
            self.connection_id,
            self.channel_type,
            self.channel_id,
            &self.client_common_caps,
            &self.client_channel_caps,
            self.caps_offset,
        )
    }

    /// What the client sends after reading the reply: mechanism word (if auth selection) and
    /// the 128-byte ticket (132 or 128 bytes).
    pub fn client_auth(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(132);
        if self.auth_selection() {
            v.extend_from_slice(&auth_mechanism(self.auth_mechanism));
        }
        v.extend_from_slice(&ticket());
        v
    }

    /// Server link reply (16 + H_s bytes).
    pub fn server_link(&self) -> Vec<u8> {
        link_reply(0, &self.server_common_caps, &self.server_channel_caps)
    }

    /// The 4-byte link result.
    pub fn server_result(&self) -> [u8; 4] {
        link_result(self.link_result)
    }

    /// Stream offset of the client's first data byte: 16 + H_c + (4 if auth selection) + 128.
    pub fn client_data_start(&self) -> usize {
        self.client_link().len() + self.client_auth().len()
    }

    /// Stream offset of the server's first data byte: 16 + H_s + 4.
    pub fn server_data_start(&self) -> usize {
        (LINK_HEADER_LEN + self.server_link_size() + crate::protocol::LINK_RESULT_LEN) as usize
    }

    /// Data messages `(type, body)` with the negotiated header, full serials from 1.
    pub fn data<B: AsRef<[u8]>>(&self, messages: &[(u16, B)]) -> Vec<u8> {
        let mut w = MessageWriter::new(self.header_kind());
        let mut v = Vec::new();
        for (t, b) in messages {
            v.extend_from_slice(&w.message(*t, b.as_ref()));
        }
        v
    }

    /// The whole client → server stream: link message, auth, then `messages`.
    pub fn client_stream<B: AsRef<[u8]>>(&self, messages: &[(u16, B)]) -> Vec<u8> {
        let mut v = self.client_link();
        v.extend_from_slice(&self.client_auth());
        v.extend_from_slice(&self.data(messages));
        v
    }

    /// The whole server → client stream: link reply, result, then `messages`.
    pub fn server_stream<B: AsRef<[u8]>>(&self, messages: &[(u16, B)]) -> Vec<u8> {
        let mut v = self.server_link();
        v.extend_from_slice(&self.server_result());
        v.extend_from_slice(&self.data(messages));
        v
    }
}

/// splitmix64: a small deterministic PRNG for reproducible test streams (random split points,
/// garbage bytes). Not for anything that needs real randomness.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_layouts_match_the_notes() {
        let m = link_mess(0, 2, 0, &[0x09], &[]);
        assert_eq!(m.len(), 38);
        assert_eq!(&m[0..4], b"REDQ");
        assert_eq!(u32::from_le_bytes(m[12..16].try_into().unwrap()), 22);
        assert_eq!(m[20], 2);
        assert_eq!(u32::from_le_bytes(m[30..34].try_into().unwrap()), 18);
        assert_eq!(u32::from_le_bytes(m[34..38].try_into().unwrap()), 0x09);

        let r = link_reply(0, &[0x0B], &[0x1052]);
        assert_eq!(r.len(), 16 + 186);
        assert_eq!(u32::from_le_bytes(r[12..16].try_into().unwrap()), 186);
        assert_eq!(u32::from_le_bytes(r[182..186].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(r[190..194].try_into().unwrap()), 178);
        assert_eq!(u32::from_le_bytes(r[194..198].try_into().unwrap()), 0x0B);

        let e = link_error_reply(7);
        assert_eq!(e.len(), 194);
        assert_eq!(u32::from_le_bytes(e[16..20].try_into().unwrap()), 7);

        assert_eq!(
            set_ack(HeaderKind::Mini, 1, 20),
            [3, 0, 8, 0, 0, 0, 1, 0, 0, 0, 20, 0, 0, 0]
        );
        assert_eq!(ack(HeaderKind::Mini), [2, 0, 0, 0, 0, 0]);
        assert_eq!(ack(HeaderKind::Full).len(), 18);
        let s = Session::new(2, 0);
        assert_eq!(s.client_data_start(), 170);
        assert_eq!(s.server_data_start(), 202);
    }
}
