//! SPICE wire constants: link phase layout, header sizes, channel types and message numbers.
//!
//! Every number here comes from spice-protocol (`spice/protocol.h`, `spice/enums.h`) and
//! spice-common's `spice.proto`, as summarised byte by byte in the project's protocol notes
//! (`docs/spice-protocol.md` §1–§2, with the upstream file and function for each fact; the
//! facts the code needs are repeated in this crate's docs). All integers on the wire are
//! little-endian.

/// `SPICE_MAGIC`, the first 4 bytes of both link messages: "REDQ" (`spice/protocol.h`).
pub const SPICE_MAGIC: [u8; 4] = *b"REDQ";
/// The only major protocol version spice-server accepts (`SPICE_VERSION_MAJOR`).
pub const SPICE_VERSION_MAJOR: u32 = 2;
/// `SPICE_VERSION_MINOR` as sent by spice-gtk and spice-server.
pub const SPICE_VERSION_MINOR: u32 = 2;

/// Bytes of `SpiceLinkHeader`: magic, major, minor, size (4 × u32).
pub const LINK_HEADER_LEN: u32 = 16;
/// Smallest client link body (`SpiceLinkMess` without caps): spice-server refuses less
/// (`reds.cpp` `reds_handle_read_header_done`).
pub const LINK_MESS_MIN: u32 = 18;
/// Largest client link body spice-server accepts (`reds_handle_read_header_done`).
pub const LINK_MESS_MAX: u32 = 4096;
/// `SpiceLinkReply` without caps: error u32 + 162-byte public key + 3 × u32 (`reds_send_link_ack`).
pub const LINK_REPLY_MIN: u32 = 178;
/// Offset of `num_common_caps` inside the link reply body (after error and pub_key).
pub const LINK_REPLY_CAPS_FIELDS: u32 = 4 + 162;
/// Bytes of the RSA-1024 encrypted ticket the client sends (`SPICE_TICKET_PUBKEY_BYTES` path,
/// `reds_get_spice_ticket`, `spice_channel_send_spice_ticket`).
pub const TICKET_LEN: u32 = 128;
/// Bytes of `SpiceLinkAuthMechanism` and of the link result (one u32 each).
pub const AUTH_MECHANISM_LEN: u32 = 4;
/// Bytes of the link result `SpiceLinkErr` the server sends after the ticket.
pub const LINK_RESULT_LEN: u32 = 4;

/// `SPICE_COMMON_CAP_PROTOCOL_AUTH_SELECTION` (bit 0 of common caps word 0).
pub const CAP_AUTH_SELECTION: u32 = 1 << 0;
/// `SPICE_COMMON_CAP_AUTH_SPICE` (bit 1).
pub const CAP_AUTH_SPICE: u32 = 1 << 1;
/// `SPICE_COMMON_CAP_AUTH_SASL` (bit 2).
pub const CAP_AUTH_SASL: u32 = 1 << 2;
/// `SPICE_COMMON_CAP_MINI_HEADER` (bit 3). Mini headers are used iff both sides set it.
pub const CAP_MINI_HEADER: u32 = 1 << 3;

/// `SPICE_COMMON_CAP_AUTH_SPICE` as an auth mechanism number (`SpiceLinkAuthMechanism`).
pub const AUTH_MECHANISM_SPICE: u32 = 1;
/// `SPICE_COMMON_CAP_AUTH_SASL` as an auth mechanism number.
pub const AUTH_MECHANISM_SASL: u32 = 2;

/// `SpiceMiniDataHeader`: type u16, size u32.
pub const MINI_HEADER_LEN: u8 = 6;
/// `SpiceDataHeader`: serial u64, type u16, size u32, sub_list u32.
pub const FULL_HEADER_LEN: u8 = 18;

/// Channel types (`enum SpiceChannelType`, client link byte 20).
pub mod channel {
    pub const MAIN: u8 = 1;
    pub const DISPLAY: u8 = 2;
    pub const INPUTS: u8 = 3;
    pub const CURSOR: u8 = 4;
    pub const PLAYBACK: u8 = 5;
    pub const RECORD: u8 = 6;
    pub const TUNNEL: u8 = 7;
    pub const SMARTCARD: u8 = 8;
    pub const USBREDIR: u8 = 9;
    pub const PORT: u8 = 10;
    pub const WEBDAV: u8 = 11;
}

/// Lower-case channel type name as used in reports and JSON (`"main"`, `"display"`, …);
/// `"unknown"` for numbers outside `enum SpiceChannelType`.
pub const fn channel_type_name(channel_type: u8) -> &'static str {
    match channel_type {
        channel::MAIN => "main",
        channel::DISPLAY => "display",
        channel::INPUTS => "inputs",
        channel::CURSOR => "cursor",
        channel::PLAYBACK => "playback",
        channel::RECORD => "record",
        channel::TUNNEL => "tunnel",
        channel::SMARTCARD => "smartcard",
        channel::USBREDIR => "usbredir",
        channel::PORT => "port",
        channel::WEBDAV => "webdav",
        _ => "unknown",
    }
}

/// Server → client base messages, shared by every channel (`spice.proto` `BaseChannel`).
pub mod msg_server {
    pub const MIGRATE: u16 = 1;
    pub const MIGRATE_DATA: u16 = 2;
    /// Body: generation u32, window u32.
    pub const SET_ACK: u16 = 3;
    /// Body: id u32, timestamp u64, optional filler.
    pub const PING: u16 = 4;
    pub const WAIT_FOR_CHANNELS: u16 = 5;
    pub const DISCONNECTING: u16 = 6;
    pub const NOTIFY: u16 = 7;
    /// Urgent sub-message list under mini headers (`dcc-send.cpp` `send_free_list`).
    pub const LIST: u16 = 8;
    /// Main channel INIT: body starts with session_id u32.
    pub const MAIN_INIT: u16 = 103;
    /// Display INVAL_LIST: the other urgent message of an urgent pair (display only; on the
    /// cursor channel 105 is HIDE, `docs/spice-protocol.md` §3.3).
    pub const DISPLAY_INVAL_LIST: u16 = 105;
}

/// Client → server base messages (`spice.proto` `BaseChannel` client part).
pub mod msg_client {
    /// Body: generation u32.
    pub const ACK_SYNC: u16 = 1;
    /// Empty body.
    pub const ACK: u16 = 2;
    /// Body: id u32, timestamp u64.
    pub const PONG: u16 = 3;
    pub const MIGRATE_FLUSH_MARK: u16 = 4;
    pub const MIGRATE_DATA: u16 = 5;
    pub const DISCONNECTING: u16 = 6;
    /// Display channel INIT (the client speaks first on display, `dcc_start`).
    pub const DISPLAY_INIT: u16 = 101;
}

/// Link errors (`enum SpiceLinkErr`, `spice/enums.h`).
pub const fn link_error_name(code: u32) -> &'static str {
    match code {
        0 => "OK",
        1 => "ERROR",
        2 => "INVALID_MAGIC",
        3 => "INVALID_DATA",
        4 => "VERSION_MISMATCH",
        5 => "NEED_SECURED",
        6 => "NEED_UNSECURED",
        7 => "PERMISSION_DENIED",
        8 => "BAD_CONNECTION_ID",
        9 => "CHANNEL_NOT_AVAILABLE",
        _ => "unknown",
    }
}

/// Name of a message number in a given channel type and direction, for reports.
///
/// `server_to_client` selects the direction; channel-specific numbers (≥ 101) depend on the
/// channel type (`spice.proto`). Returns `None` for numbers this table does not name.
pub const fn message_name(
    channel_type: u8,
    server_to_client: bool,
    msg_type: u16,
) -> Option<&'static str> {
    if server_to_client {
        match msg_type {
            1 => return Some("MIGRATE"),
            2 => return Some("MIGRATE_DATA"),
            3 => return Some("SET_ACK"),
            4 => return Some("PING"),
            5 => return Some("WAIT_FOR_CHANNELS"),
            6 => return Some("DISCONNECTING"),
            7 => return Some("NOTIFY"),
            8 => return Some("LIST"),
            _ => {}
        }
        match (channel_type, msg_type) {
            (channel::MAIN, 101) => Some("MIGRATE_BEGIN"),
            (channel::MAIN, 102) => Some("MIGRATE_CANCEL"),
            (channel::MAIN, 103) => Some("INIT"),
            (channel::MAIN, 104) => Some("CHANNELS_LIST"),
            (channel::MAIN, 105) => Some("MOUSE_MODE"),
            (channel::MAIN, 106) => Some("MULTI_MEDIA_TIME"),
            (channel::MAIN, 107) => Some("AGENT_CONNECTED"),
            (channel::MAIN, 108) => Some("AGENT_DISCONNECTED"),
            (channel::MAIN, 109) => Some("AGENT_DATA"),
            (channel::MAIN, 110) => Some("AGENT_TOKEN"),
            (channel::MAIN, 111) => Some("MIGRATE_SWITCH_HOST"),
            (channel::MAIN, 112) => Some("MIGRATE_END"),
            (channel::MAIN, 113) => Some("NAME"),
            (channel::MAIN, 114) => Some("UUID"),
            (channel::MAIN, 115) => Some("AGENT_CONNECTED_TOKENS"),
            (channel::MAIN, 116) => Some("MIGRATE_BEGIN_SEAMLESS"),
            (channel::MAIN, 117) => Some("MIGRATE_DST_SEAMLESS_ACK"),
            (channel::MAIN, 118) => Some("MIGRATE_DST_SEAMLESS_NACK"),
            (channel::DISPLAY, 101) => Some("MODE"),
            (channel::DISPLAY, 102) => Some("MARK"),
            (channel::DISPLAY, 103) => Some("RESET"),
            (channel::DISPLAY, 104) => Some("COPY_BITS"),
            (channel::DISPLAY, 105) => Some("INVAL_LIST"),
            (channel::DISPLAY, 106) => Some("INVAL_ALL_PIXMAPS"),
            (channel::DISPLAY, 107) => Some("INVAL_PALETTE"),
            (channel::DISPLAY, 108) => Some("INVAL_ALL_PALETTES"),
            (channel::DISPLAY, 122) => Some("STREAM_CREATE"),
            (channel::DISPLAY, 123) => Some("STREAM_DATA"),
            (channel::DISPLAY, 124) => Some("STREAM_CLIP"),
            (channel::DISPLAY, 125) => Some("STREAM_DESTROY"),
            (channel::DISPLAY, 126) => Some("STREAM_DESTROY_ALL"),
            (channel::DISPLAY, 302) => Some("DRAW_FILL"),
            (channel::DISPLAY, 303) => Some("DRAW_OPAQUE"),
            (channel::DISPLAY, 304) => Some("DRAW_COPY"),
            (channel::DISPLAY, 305) => Some("DRAW_BLEND"),
            (channel::DISPLAY, 306) => Some("DRAW_BLACKNESS"),
            (channel::DISPLAY, 307) => Some("DRAW_WHITENESS"),
            (channel::DISPLAY, 308) => Some("DRAW_INVERS"),
            (channel::DISPLAY, 309) => Some("DRAW_ROP3"),
            (channel::DISPLAY, 310) => Some("DRAW_STROKE"),
            (channel::DISPLAY, 311) => Some("DRAW_TEXT"),
            (channel::DISPLAY, 312) => Some("DRAW_TRANSPARENT"),
            (channel::DISPLAY, 313) => Some("DRAW_ALPHA_BLEND"),
            (channel::DISPLAY, 314) => Some("SURFACE_CREATE"),
            (channel::DISPLAY, 315) => Some("SURFACE_DESTROY"),
            (channel::DISPLAY, 316) => Some("STREAM_DATA_SIZED"),
            (channel::DISPLAY, 317) => Some("MONITORS_CONFIG"),
            (channel::DISPLAY, 318) => Some("DRAW_COMPOSITE"),
            (channel::DISPLAY, 319) => Some("STREAM_ACTIVATE_REPORT"),
            (channel::DISPLAY, 320) => Some("GL_SCANOUT_UNIX"),
            (channel::DISPLAY, 321) => Some("GL_DRAW"),
            (channel::CURSOR, 101) => Some("INIT"),
            (channel::CURSOR, 102) => Some("RESET"),
            (channel::CURSOR, 103) => Some("SET"),
            (channel::CURSOR, 104) => Some("MOVE"),
            (channel::CURSOR, 105) => Some("HIDE"),
            (channel::CURSOR, 106) => Some("TRAIL"),
            (channel::CURSOR, 107) => Some("INVAL_ONE"),
            (channel::CURSOR, 108) => Some("INVAL_ALL"),
            (channel::INPUTS, 101) => Some("INIT"),
            (channel::INPUTS, 102) => Some("KEY_MODIFIERS"),
            (channel::INPUTS, 111) => Some("MOUSE_MOTION_ACK"),
            _ => None,
        }
    } else {
        match msg_type {
            1 => return Some("ACK_SYNC"),
            2 => return Some("ACK"),
            3 => return Some("PONG"),
            4 => return Some("MIGRATE_FLUSH_MARK"),
            5 => return Some("MIGRATE_DATA"),
            6 => return Some("DISCONNECTING"),
            _ => {}
        }
        match (channel_type, msg_type) {
            (channel::MAIN, 101) => Some("CLIENT_INFO"),
            (channel::MAIN, 102) => Some("MIGRATE_CONNECTED"),
            (channel::MAIN, 103) => Some("MIGRATE_CONNECT_ERROR"),
            (channel::MAIN, 104) => Some("ATTACH_CHANNELS"),
            (channel::MAIN, 105) => Some("MOUSE_MODE_REQUEST"),
            (channel::MAIN, 106) => Some("AGENT_START"),
            (channel::MAIN, 107) => Some("AGENT_DATA"),
            (channel::MAIN, 108) => Some("AGENT_TOKEN"),
            (channel::MAIN, 109) => Some("MIGRATE_END"),
            (channel::DISPLAY, 101) => Some("INIT"),
            (channel::DISPLAY, 102) => Some("STREAM_REPORT"),
            (channel::DISPLAY, 103) => Some("PREFERRED_COMPRESSION"),
            (channel::DISPLAY, 104) => Some("GL_DRAW_DONE"),
            (channel::DISPLAY, 105) => Some("PREFERRED_VIDEO_CODEC_TYPE"),
            (channel::INPUTS, 101) => Some("KEY_DOWN"),
            (channel::INPUTS, 102) => Some("KEY_UP"),
            (channel::INPUTS, 103) => Some("KEY_MODIFIERS"),
            (channel::INPUTS, 104) => Some("KEY_SCANCODE"),
            (channel::INPUTS, 111) => Some("MOUSE_MOTION"),
            (channel::INPUTS, 112) => Some("MOUSE_POSITION"),
            (channel::INPUTS, 113) => Some("MOUSE_PRESS"),
            (channel::INPUTS, 114) => Some("MOUSE_RELEASE"),
            _ => None,
        }
    }
}

/// Channel-type bit of [`channel`] number `c` in a channel mask (`1 << c`).
pub const fn channel_bit(c: u8) -> u16 {
    if c < 16 { 1 << c } else { 0 }
}

/// Every channel type of [`channel`] (bits 1–11).
pub const ALL_CHANNELS: u16 = 0x0ffe;

/// Bits `lo..=hi` of a mask of message types counted from 101 (types 101–164).
const fn span(lo: u16, hi: u16) -> u64 {
    let mut m = 0u64;
    let mut t = lo;
    while t <= hi {
        m |= 1 << (t - 101);
        t += 1;
    }
    m
}

/// The channel types of `table` (channel, [`span`] of its types) whose span holds type `t`
/// (101–164).
const fn channels_in(table: &[(u8, u64)], t: u16) -> u16 {
    let mut m = 0u16;
    let mut i = 0;
    while i < table.len() {
        if table[i].1 & (1 << (t - 101)) != 0 {
            m |= channel_bit(table[i].0);
        }
        i += 1;
    }
    m
}

/// Channel types whose **server → client** messages include type `t`, ignoring the body size
/// (`docs/spice-protocol.md` §2.2–§2.5, from `spice.proto`): base 1–8 on every channel; main
/// 101–118; display 101–108, 122–126, 302–322; cursor 101–108; inputs 101, 102, 111; playback
/// 101–107; record 101–104; smartcard 101; usbredir, port, webdav 101–102; port 201–202.
pub const fn s2c_type_channels(t: u16) -> u16 {
    use channel::*;
    if t >= 1 && t <= 8 {
        return ALL_CHANNELS;
    }
    if t >= 302 && t <= 322 {
        return channel_bit(DISPLAY);
    }
    if t == 201 || t == 202 {
        return channel_bit(PORT);
    }
    if t < 101 || t > 164 {
        return 0;
    }
    let table: [(u8, u64); 10] = [
        (MAIN, span(101, 118)),
        (DISPLAY, span(101, 108) | span(122, 126)),
        (CURSOR, span(101, 108)),
        (INPUTS, span(101, 102) | span(111, 111)),
        (PLAYBACK, span(101, 107)),
        (RECORD, span(101, 104)),
        (SMARTCARD, span(101, 101)),
        (USBREDIR, span(101, 102)),
        (PORT, span(101, 102)),
        (WEBDAV, span(101, 102)),
    ];
    channels_in(&table, t)
}

/// Channel types whose **client → server** messages include type `t`, ignoring the size:
/// base 1–6 everywhere; main 101–112; display 101–105; inputs 101–104, 111–114; record
/// 101–103; smartcard 101; usbredir, port, webdav 101–102; port 201.
pub const fn c2s_type_channels(t: u16) -> u16 {
    use channel::*;
    if t >= 1 && t <= 6 {
        return ALL_CHANNELS;
    }
    if t == 201 {
        return channel_bit(PORT);
    }
    if t < 101 || t > 164 {
        return 0;
    }
    let table: [(u8, u64); 8] = [
        (MAIN, span(101, 112)),
        (DISPLAY, span(101, 105)),
        (INPUTS, span(101, 104) | span(111, 114)),
        (RECORD, span(101, 103)),
        (SMARTCARD, span(101, 101)),
        (USBREDIR, span(101, 102)),
        (PORT, span(101, 102)),
        (WEBDAV, span(101, 102)),
    ];
    channels_in(&table, t)
}

/// Entries of [`HUNT_TYPES`]: message types 0..1024 ([`crate::framing::MAX_MESSAGE_TYPE`] is
/// 1000).
pub const HUNT_TYPES_LEN: usize = 1024;

/// Per message type: [`s2c_type_channels`] in the high 16 bits, [`c2s_type_channels`] in the
/// low 16. A table, so that the kernel pays one load for it while hunting (and its verifier
/// walks one path instead of one per channel).
pub const HUNT_TYPES: [u32; HUNT_TYPES_LEN] = {
    let mut t = [0u32; HUNT_TYPES_LEN];
    let mut i = 0;
    while i < HUNT_TYPES_LEN {
        t[i] = ((s2c_type_channels(i as u16) as u32) << 16) | c2s_type_channels(i as u16) as u32;
        i += 1;
    }
    t
};

/// What the body size of a **server → client** header with type `t` rules out: base messages
/// with a fixed body (MIGRATE 4, SET_ACK 8, DISCONNECTING 12) or a fixed part (PING ≥ 12,
/// WAIT_FOR_CHANNELS ≥ 1, NOTIFY ≥ 24, LIST ≥ 2), `docs/spice-protocol.md` §2.2. Returns
/// [`ALL_CHANNELS`] if the size fits, else 0. Few branches with two outcomes: cheap for the
/// kernel verifier.
#[inline(always)]
pub const fn s2c_size_ok(t: u16, size: u32) -> u16 {
    let ok = match t {
        1 => size == 4,
        3 => size == 8,
        4 => size >= 12,
        5 => size >= 1,
        6 => size == 12,
        7 => size >= 24,
        8 => size >= 2,
        _ => true,
    };
    if ok { ALL_CHANNELS } else { 0 }
}

/// What the body size of a **client → server** header with type `t` rules out: ACK_SYNC 4,
/// ACK 0, PONG 12, MIGRATE_FLUSH_MARK 0, DISCONNECTING 12 (§2.2), and spice-server's
/// per-channel limits on client messages (§4.6: display and cursor 1024, inputs 2048, main
/// 26,624 bytes; MIGRATE_DATA and main AGENT_DATA exempt). Returns a channel mask.
#[inline(always)]
pub const fn c2s_size_ok(t: u16, size: u32) -> u16 {
    let ok = match t {
        1 => size == 4,
        2 | 4 => size == 0,
        3 | 6 => size == 12,
        _ => true,
    };
    if !ok {
        return 0;
    }
    if t == 5 || t == 107 {
        return ALL_CHANNELS;
    }
    let mut m = ALL_CHANNELS;
    if size > 1024 {
        m &= !(channel_bit(channel::DISPLAY) | channel_bit(channel::CURSOR));
    }
    if size > 2048 {
        m &= !channel_bit(channel::INPUTS);
    }
    if size > 26_624 {
        m &= !channel_bit(channel::MAIN);
    }
    m
}

/// Channel types for which a **server → client** data header with this type and body size is
/// valid: [`s2c_type_channels`] ∩ [`s2c_size_ok`]. 0: no channel, not a SPICE header. Used
/// while hunting for message boundaries ([`crate::framing::Phase::Hunt`]); framed streams
/// accept any type up to [`crate::framing::MAX_MESSAGE_TYPE`].
pub const fn s2c_channels(t: u16, size: u32) -> u16 {
    s2c_type_channels(t) & s2c_size_ok(t, size)
}

/// Channel types for which a **client → server** data header with this type and body size is
/// valid: [`c2s_type_channels`] ∩ [`c2s_size_ok`].
pub const fn c2s_channels(t: u16, size: u32) -> u16 {
    c2s_type_channels(t) & c2s_size_ok(t, size)
}
