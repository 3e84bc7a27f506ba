//! The SPICE framing state machine for one direction of one TCP connection.
//!
//! The same code runs in the kernel (`spice-ebpf`, on bytes read from the user buffers of each
//! send or receive call) and on the host (unit tests, through [`feed`]). It never buffers a
//! body: at each element boundary it asks for at most [`MAX_WANT`] bytes (a link field group, a
//! 6- or 18-byte data header plus up to 8 body bytes for SET_ACK / ACK_SYNC / MAIN_INIT), then
//! jumps the stream position past the rest.
//!
//! Protocol facts (`docs/spice-protocol.md`, sources named there):
//! * §1.2/§1.3: link header (16 bytes) then the client's `SpiceLinkMess` (size H_c) or the
//!   server's `SpiceLinkReply` (size H_s), each with caps at `16 + caps_offset`.
//! * §1.5: client → server: auth mechanism u32 (only if the client advertised
//!   PROTOCOL_AUTH_SELECTION), then the 128-byte ticket; server → client: the 4-byte result.
//! * §1.6: SASL (mechanism 2) makes the rest opaque; §1.7: error replies.
//! * §1.9: mini header (6 bytes) iff both common-caps words have bit 3, else the full 18-byte
//!   header; `size` counts the body only.
//!
//! Zeroed memory is the valid initial state ([`DirState::default`] is all zeros), so the kernel
//! can create an entry from a zero template without a 200-byte stack copy.

use crate::{
    event::lock_how,
    protocol::{
        AUTH_MECHANISM_LEN, AUTH_MECHANISM_SASL, AUTH_MECHANISM_SPICE, CAP_AUTH_SELECTION,
        CAP_MINI_HEADER, FULL_HEADER_LEN, HUNT_TYPES, HUNT_TYPES_LEN, LINK_HEADER_LEN,
        LINK_MESS_MAX, LINK_MESS_MIN, LINK_REPLY_CAPS_FIELDS, LINK_REPLY_MIN, LINK_RESULT_LEN,
        MINI_HEADER_LEN, SPICE_MAGIC, SPICE_VERSION_MAJOR, TICKET_LEN, c2s_size_ok, channel,
        msg_client, msg_server, s2c_size_ok,
    },
};

/// Size of the per-direction scratch buffer. Elements never exceed [`MAX_WANT`] bytes; the rest
/// is slack so that the kernel's variable-offset, variable-length read into `buf[have..]`
/// (offset ≤ 31, length ≤ 31 after masking) provably stays inside the map value.
pub const BUF_LEN: usize = 64;
/// The bytes of a data header that [`DirState::header_whole`] needs: all 6 of a mini header;
/// of a full header (18 bytes: serial u64, type u16, size u32, sub-message list u32) the
/// bytes up to its size (0..14; it reads type and size at 8 and 10), rounded up to whole
/// 8-byte words. The kernel reads a header into a buffer of this size on the BPF stack
/// rather than into a map value: `bpf_probe_read_user` checks its destination
/// (`__check_object_size`, mm/usercopy.c, with hardened usercopy), and in a perf profile of
/// saturated sends that check fell from 1.86 % to 0.90 % of all samples with the move.
pub const HEADER_BUF_LEN: usize = 16;
/// Most bytes the state machine asks for at one boundary: full header (18) + 8 body bytes.
pub const MAX_WANT: u32 = 26;
/// Largest body size accepted before the stream is declared out of sync (256 MiB). spice-server
/// has no cap on server → client sizes but real ones stay at a few MiB
/// (`docs/spice-protocol.md` §5.5).
pub const MAX_MESSAGE_SIZE: u32 = 256 << 20;
/// Largest message type accepted: the highest defined number is display 322 (`spice.proto`).
pub const MAX_MESSAGE_TYPE: u16 = 1000;
/// Largest body size a hunted header may claim (16 MiB): real messages stay at a few MiB
/// (`docs/spice-protocol.md` §5.5), and a random 32-bit size passes with odds 1 in 256.
pub const MAX_HUNT_SIZE: u32 = 16 << 20;
/// Consecutive valid headers that lock a hunt whose chain began at an anchor of the peer's
/// call pattern ([`lock_how::SEND_AFTER_COMPLETE`], [`lock_how::RECV_HEADER_READ`]).
pub const LOCK_RUN_ANCHORED: u8 = 3;
/// Consecutive valid headers that lock a hunt on content alone ([`lock_how::CONTENT`]).
pub const LOCK_RUN_CONTENT: u8 = 4;
/// `want_at` of a hunting direction with no candidate: nothing is read until the next call
/// start offers one ([`DirState::hunt_call_start`]).
pub const NOWHERE: u64 = u64::MAX;

/// What the state machine is reading next in one direction.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Phase {
    /// 16-byte `SpiceLinkHeader` at stream offset 0.
    #[default]
    LinkHeader = 0,
    /// Client link body fields 0..18 (connection_id, channel type/id, cap counts, caps_offset).
    LinkMess = 1,
    /// Server link reply `error` field.
    ReplyError = 2,
    /// Server link reply cap counts and caps_offset (body offset 166).
    ReplyCaps = 3,
    /// First common-caps word.
    CommonCaps = 4,
    /// Client auth mechanism word.
    AuthMechanism = 5,
    /// Server link result.
    LinkResult = 6,
    /// A data header (6 or 18 bytes).
    DataHeader = 7,
    /// A data header plus the first body bytes (SET_ACK, ACK_SYNC, MAIN_INIT).
    DataPrefix = 8,
    /// Framing stopped; see [`DirState::reason`].
    Unparsed = 9,
    /// Message boundaries unknown (joined mid-stream, or a header failed validation): hunting
    /// for a chain of valid headers ([`DirState::hunt_call_start`]); `reason` says why.
    Hunt = 10,
}

/// Which way this direction's bytes flow in SPICE terms (decided at its link header: the
/// direction that starts first carries the client's link message, `docs/spice-protocol.md` §1.1).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Role {
    #[default]
    Unknown = 0,
    /// Carries the client's link message, auth and client messages (ACK_SYNC, ACK, …).
    ClientToServer = 1,
    /// Carries the server's link reply, result and server messages (SET_ACK, draws, …).
    ServerToClient = 2,
}

impl Role {
    /// Decodes the wire value kept in [`DirState::role`].
    pub const fn from_u8(v: u8) -> Role {
        match v {
            1 => Role::ClientToServer,
            2 => Role::ServerToClient,
            _ => Role::Unknown,
        }
    }
}

/// Why a direction stopped being framed. The numeric value travels in events.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnparsedReason {
    None = 0,
    /// The first 4 bytes are not "REDQ" (detail: those bytes, little-endian u32).
    NotSpice = 1,
    /// A TLS record header (0x16 0x03) where "REDQ" was expected: the TLS port.
    Tls = 2,
    /// "GET " where "REDQ" was expected: SPICE over WebSocket.
    WebSocket = 3,
    /// Link header major version is not 2 (detail: major).
    LinkVersion = 4,
    /// Link sizes or cap layout outside what spice-server accepts (detail: the size).
    BadLink = 5,
    /// The server refused the link (detail: SpiceLinkErr code).
    LinkRefused = 6,
    /// A full link error reply came where the 4-byte result was expected (§1.7).
    LinkErrorAfterReply = 7,
    /// SASL authentication: after it, bytes may be wrapped by the SASL security layer (§1.6).
    Sasl = 8,
    /// Auth mechanism neither SPICE (1) nor SASL (2) (detail: the value).
    BadAuthMechanism = 9,
    /// A data header with type 0, an unknown type number or an absurd size: out of sync
    /// (detail: type in the low 16 bits).
    BadHeader = 10,
    /// Data started before the peer direction's link message was seen.
    PeerLinkMissing = 11,
    /// The kernel could not read the user buffer (detail: error code).
    UserMemoryFault = 12,
    /// Bytes moved on the socket by a call the hooks cannot read (sendfile, splice, io_uring,
    /// …), detected from the TCP sequence numbers (detail: bytes unaccounted for).
    UntracedBytes = 13,
    /// More boundaries in one call than the kernel loop allows.
    LoopLimit = 14,
    /// The connection carried data before observation started.
    AttachedMidStream = 15,
    /// Internal inconsistency (a bug): the stream position went backwards.
    Internal = 16,
    /// An HTTP response where "REDQ" was expected.
    Http = 17,
    /// A ring-buffer record for this direction was lost; counts would be wrong from here on.
    EventsLost = 18,
    /// The observer restarted with a kernel state layout it could not continue (a new
    /// version): this connection's counts before the restart are gone.
    Restarted = 19,
}

impl UnparsedReason {
    /// Decodes the wire value.
    pub const fn from_u8(v: u8) -> UnparsedReason {
        match v {
            1 => Self::NotSpice,
            2 => Self::Tls,
            3 => Self::WebSocket,
            4 => Self::LinkVersion,
            5 => Self::BadLink,
            6 => Self::LinkRefused,
            7 => Self::LinkErrorAfterReply,
            8 => Self::Sasl,
            9 => Self::BadAuthMechanism,
            10 => Self::BadHeader,
            11 => Self::PeerLinkMissing,
            12 => Self::UserMemoryFault,
            13 => Self::UntracedBytes,
            14 => Self::LoopLimit,
            15 => Self::AttachedMidStream,
            16 => Self::Internal,
            17 => Self::Http,
            18 => Self::EventsLost,
            19 => Self::Restarted,
            _ => Self::None,
        }
    }

    /// Short machine-friendly name used in JSON (`unparsed_reason`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::NotSpice => "not_spice",
            Self::Tls => "tls",
            Self::WebSocket => "websocket",
            Self::LinkVersion => "link_version",
            Self::BadLink => "bad_link",
            Self::LinkRefused => "link_refused",
            Self::LinkErrorAfterReply => "link_error_after_reply",
            Self::Sasl => "sasl",
            Self::BadAuthMechanism => "bad_auth_mechanism",
            Self::BadHeader => "bad_header",
            Self::PeerLinkMissing => "peer_link_missing",
            Self::UserMemoryFault => "user_memory_fault",
            Self::UntracedBytes => "untraced_bytes",
            Self::LoopLimit => "loop_limit",
            Self::AttachedMidStream => "attached_mid_stream",
            Self::Internal => "internal",
            Self::Http => "http",
            Self::EventsLost => "events_lost",
            Self::Restarted => "restarted",
        }
    }
}

/// Framing state of one direction of one socket. Plain data, zero = initial state.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DirState {
    /// Bytes moved in this direction so far (the stream offset of the next call's first byte).
    pub pos: u64,
    /// Stream offset where the element being read starts.
    pub want_at: u64,
    /// Messages framed so far in the data phase (the last message's 1-based ordinal).
    pub msg_count: u64,
    /// Stream offset of a message start already reported by [`DirState::peek`]; 0 = none
    /// (no message can start at offset 0, the link header is there).
    pub announced_at: u64,
    /// `size` field of this direction's link header (H_c or H_s).
    pub link_size: u32,
    /// Bytes wanted for the current element.
    pub want_len: u32,
    /// Bytes of the current element already in `buf`.
    pub have: u32,
    /// Body size of the data message whose header is in `buf`.
    pub msg_size: u32,
    /// First common-caps word of this side's link message (valid when `caps_known`).
    pub common_caps: u32,
    /// `caps_offset` of this side's link message (relative to byte 16).
    pub caps_offset: u32,
    /// Client link message: connection_id (0 for a new session's main channel).
    pub connection_id: u32,
    /// Detail of the unparsed reason (see [`UnparsedReason`]).
    pub detail: u32,
    /// Data message type in `buf`.
    pub msg_type: u16,
    /// [`Phase`] as u8.
    pub phase: u8,
    /// [`Role`] as u8.
    pub role: u8,
    /// Data header length once decided: 6 (mini) or 18 (full); 0 = not decided yet.
    pub hdr_len: u8,
    /// [`UnparsedReason`] as u8.
    pub reason: u8,
    /// 1 once this direction's link header was read.
    pub started: u8,
    /// 1 once `common_caps` is valid.
    pub caps_known: u8,
    /// Client link message: channel type and id.
    pub channel_type: u8,
    pub channel_id: u8,
    /// Hunting: consecutive headers validated in the current chain (0: no chain yet).
    pub run: u8,
    /// Hunting: [`lock_how`] of what the current chain began at.
    pub how: u8,
    /// 1 when `hdr_len` came from the link phase: hunting then tries only that length.
    pub hdr_fixed: u8,
    /// 1 when the previous call of this direction was a writev / sendmsg that moved every byte
    /// it asked for (kept by the kernel for send calls while hunting: the anchor of
    /// [`lock_how::SEND_AFTER_COMPLETE`]).
    pub call_complete: u8,
    /// Set at a lock until the lock message is reported ([`MessageInfo::lock`]).
    pub lock_pending: u8,
    /// 1 once this direction hunted: `msg_count` leaves out the messages inside its hunts (a
    /// connection joined mid-stream counts from its first lock, the lock message being 1).
    pub joined: u8,
    /// Hunting: channel types every header of the chain fits ([`crate::protocol::channel_bit`]).
    pub chain_mask: u16,
    pub _pad: u16,
    /// Hunting, full headers: low 32 bits of the chain's last serial.
    pub last_serial: u32,
    /// Locks lost: a header failed validation and the direction went back to hunting.
    pub resyncs: u32,
    /// Hunting candidates whose first header validated.
    pub candidates: u32,
    /// Stream offset where the current (or last) hunt began.
    pub hunt_from: u64,
    /// Bytes not framed because the direction was hunting, all hunts (lock offset minus hunt
    /// start, summed at each lock).
    pub unframed: u64,
    /// The element being read.
    pub buf: [u8; BUF_LEN],
}

/// What one direction needs to know about the other direction of the same socket.
///
/// Plain fields only (no `Option`): the kernel passes it between BPF functions, and BTF cannot
/// describe Rust's data-carrying enums.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PeerView {
    /// The other direction has read its link header already.
    pub started: bool,
    /// `common_caps` is valid.
    pub caps_known: bool,
    /// The other direction's first common-caps word (valid when `caps_known`).
    pub common_caps: u32,
    /// Channel type from the client link message (0 if not seen).
    pub channel_type: u8,
    /// The client chose SASL authentication.
    pub sasl: bool,
    /// The other direction is in the middle of a data message: its last call ended inside
    /// one (a partial write), or a message spice-server counted at an EAGAIN start
    /// ([`DirState::peek`]) is not written yet.
    pub mid_message: bool,
}

/// Link message or reply summary, produced once per direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LinkInfo {
    pub role: u8,
    /// H_c or H_s.
    pub link_size: u32,
    pub connection_id: u32,
    pub channel_type: u8,
    pub channel_id: u8,
    pub common_caps: u32,
}

/// One framed data message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MessageInfo {
    /// Stream offset of the header's first byte in this direction.
    pub at: u64,
    /// 1-based ordinal of the message in this direction.
    pub index: u64,
    /// Body size in bytes (header not included).
    pub size: u32,
    pub msg_type: u16,
    /// 6 or 18.
    pub hdr_len: u8,
    /// The message was already reported by [`DirState::peek`] (EAGAIN start); do not report again.
    pub already_reported: bool,
    /// First body words, little-endian: SET_ACK (generation, window), ACK_SYNC (generation, 0),
    /// main INIT (session_id, 0); zero otherwise.
    pub prefix: [u32; 2],
    /// [`lock_how`] if this is the first message counted after a lock, else 0.
    pub lock: u8,
}

/// Result of completing an element. (Never crosses a BPF function boundary; see
/// [`DirState::complete`].)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    None,
    Link(LinkInfo),
    Message(MessageInfo),
    /// Framing stopped at stream offset `at`.
    Unparsed {
        reason: UnparsedReason,
        detail: u32,
        at: u64,
    },
    /// Boundaries lost (or unknown) from stream offset `at`: hunting ([`Phase::Hunt`]).
    Hunt {
        reason: UnparsedReason,
        detail: u32,
        at: u64,
    },
}

#[inline(always)]
fn le_u32<const N: usize>(buf: &[u8; N], off: usize) -> u32 {
    match buf.get(off..off + 4) {
        Some(&[a, b, c, d]) => u32::from_le_bytes([a, b, c, d]),
        _ => 0,
    }
}

#[inline(always)]
fn le_u16<const N: usize>(buf: &[u8; N], off: usize) -> u16 {
    match buf.get(off..off + 2) {
        Some(&[a, b]) => u16::from_le_bytes([a, b]),
        _ => 0,
    }
}

/// Body bytes wanted after the header of a message, so that its fields can be reported.
#[inline(always)]
const fn prefix_len(role: Role, channel_type: u8, msg_type: u16, size: u32) -> u32 {
    let want = match role {
        Role::ServerToClient => match msg_type {
            msg_server::SET_ACK => 8,
            msg_server::MAIN_INIT if channel_type == channel::MAIN => 4,
            _ => 0,
        },
        Role::ClientToServer => match msg_type {
            msg_client::ACK_SYNC => 4,
            _ => 0,
        },
        Role::Unknown => 0,
    };
    if size < want { size } else { want }
}

impl Default for DirState {
    /// The initial state: all zeros (link header expected at stream offset 0).
    fn default() -> Self {
        // SAFETY: every field is an integer or an integer array; all-zero is valid.
        unsafe { core::mem::zeroed() }
    }
}

impl DirState {
    /// What the other direction needs from this one (see [`PeerView`]).
    #[inline(always)]
    pub fn view(&self) -> PeerView {
        PeerView {
            started: self.started != 0,
            caps_known: self.caps_known != 0,
            common_caps: self.common_caps,
            channel_type: self.channel_type,
            sasl: self.reason == UnparsedReason::Sasl as u8,
            mid_message: self.phase == Phase::DataPrefix as u8
                || (self.phase == Phase::DataHeader as u8
                    && (self.have != 0
                        || self.want_at != self.pos
                        || (self.announced_at != 0 && self.announced_at == self.want_at))),
        }
    }

    /// The current [`Phase`].
    #[inline(always)]
    pub fn phase(&self) -> Phase {
        match self.phase {
            1 => Phase::LinkMess,
            2 => Phase::ReplyError,
            3 => Phase::ReplyCaps,
            4 => Phase::CommonCaps,
            5 => Phase::AuthMechanism,
            6 => Phase::LinkResult,
            7 => Phase::DataHeader,
            8 => Phase::DataPrefix,
            9 => Phase::Unparsed,
            10 => Phase::Hunt,
            _ => Phase::LinkHeader,
        }
    }

    /// True once framing has stopped for good.
    #[inline(always)]
    pub fn is_unparsed(&self) -> bool {
        self.phase == Phase::Unparsed as u8
    }

    #[inline(always)]
    fn want(&mut self, at: u64, len: u32, phase: Phase) {
        self.want_at = at;
        self.want_len = len;
        self.have = 0;
        self.phase = phase as u8;
    }

    /// Stops framing with `reason`; returns the matching output (at = element start).
    #[inline(always)]
    pub fn stop(&mut self, reason: UnparsedReason, detail: u32) -> Output {
        self.phase = Phase::Unparsed as u8;
        self.reason = reason as u8;
        self.detail = detail;
        Output::Unparsed {
            reason,
            detail,
            at: self.want_at,
        }
    }

    /// Resolves what the next element needs once its first byte is available: the link header
    /// length on a fresh state, and the data header length (mini or full, from both sides'
    /// caps) at the first data message. Call it only when the current call holds the byte at
    /// `need().0`: the peer's caps may arrive after this direction's link message (a client
    /// without auth selection reaches the data phase right after it). Returns an
    /// [`Output::Unparsed`] if resolving is impossible.
    #[inline(always)]
    pub fn prepare(&mut self, peer: &PeerView) -> Output {
        if self.phase == Phase::LinkHeader as u8 && self.want_len == 0 {
            self.want_len = LINK_HEADER_LEN;
        } else if self.phase == Phase::DataHeader as u8 && self.hdr_len == 0 {
            if !peer.caps_known {
                return self.stop(UnparsedReason::PeerLinkMissing, 0);
            }
            let peer_caps = peer.common_caps;
            let mini = (self.common_caps & peer_caps & CAP_MINI_HEADER) != 0;
            self.hdr_len = if mini {
                MINI_HEADER_LEN
            } else {
                FULL_HEADER_LEN
            };
            self.hdr_fixed = 1;
            self.want_len = self.hdr_len as u32;
            self.have = 0;
        }
        Output::None
    }

    /// Stream offset of the next byte needed and how many bytes are still needed for the
    /// current element (`(want_at + have, want_len - have)`).
    #[inline(always)]
    pub fn need(&self) -> (u64, u32) {
        (
            self.want_at.saturating_add(self.have as u64),
            self.want_len.saturating_sub(self.have),
        )
    }

    fn after_link(&mut self) {
        let body_end = LINK_HEADER_LEN as u64 + self.link_size as u64;
        if self.role == Role::ClientToServer as u8 {
            if self.common_caps & CAP_AUTH_SELECTION != 0 {
                self.want(body_end, AUTH_MECHANISM_LEN, Phase::AuthMechanism);
            } else {
                // No auth selection: the ticket follows the link message directly (§1.8).
                self.want(body_end + TICKET_LEN as u64, 0, Phase::DataHeader);
                self.hdr_len = 0;
            }
        } else {
            self.want(body_end, LINK_RESULT_LEN, Phase::LinkResult);
        }
    }

    #[inline(always)]
    fn link_output(&self) -> Output {
        Output::Link(LinkInfo {
            role: self.role,
            link_size: self.link_size,
            connection_id: self.connection_id,
            channel_type: self.channel_type,
            channel_id: self.channel_id,
            common_caps: self.common_caps,
        })
    }

    /// Checks that `n_caps` cap words at `caps_offset` fit inside the link body.
    fn caps_fit(&self, caps_offset: u32, n_common: u32, n_channel: u32, min_offset: u32) -> bool {
        let end = caps_offset as u64 + 4 * (n_common as u64 + n_channel as u64);
        caps_offset >= min_offset
            && n_common <= 1024
            && n_channel <= 1024
            && end <= self.link_size as u64
    }

    /// Interprets a complete element (`have == want_len`) and moves to the next one.
    ///
    /// Always inlined: [`Output`] is a data-carrying enum, which BTF cannot describe in a BPF
    /// function signature.
    #[inline(always)]
    pub fn complete(&mut self, peer: &PeerView) -> Output {
        let at = self.want_at;
        match self.phase() {
            Phase::LinkHeader => {
                let magic = le_u32(&self.buf, 0);
                if magic != u32::from_le_bytes(SPICE_MAGIC) {
                    let reason = match (self.buf[0], self.buf[1], self.buf[2], self.buf[3]) {
                        (0x16, 0x03, _, _) => UnparsedReason::Tls,
                        (b'G', b'E', b'T', b' ') => UnparsedReason::WebSocket,
                        (b'H', b'T', b'T', b'P') => UnparsedReason::Http,
                        _ => UnparsedReason::NotSpice,
                    };
                    return self.stop(reason, magic);
                }
                let major = le_u32(&self.buf, 4);
                if major != SPICE_VERSION_MAJOR {
                    return self.stop(UnparsedReason::LinkVersion, major);
                }
                self.link_size = le_u32(&self.buf, 12);
                self.started = 1;
                if peer.started {
                    self.role = Role::ServerToClient as u8;
                    if self.link_size < LINK_REPLY_MIN
                        || self.link_size > LINK_REPLY_MIN + LINK_MESS_MAX
                    {
                        return self.stop(UnparsedReason::BadLink, self.link_size);
                    }
                    self.want(at + LINK_HEADER_LEN as u64, 4, Phase::ReplyError);
                } else {
                    self.role = Role::ClientToServer as u8;
                    if self.link_size < LINK_MESS_MIN || self.link_size > LINK_MESS_MAX {
                        return self.stop(UnparsedReason::BadLink, self.link_size);
                    }
                    self.want(at + LINK_HEADER_LEN as u64, LINK_MESS_MIN, Phase::LinkMess);
                }
                Output::None
            }
            Phase::LinkMess => {
                self.connection_id = le_u32(&self.buf, 0);
                self.channel_type = self.buf[4];
                self.channel_id = self.buf[5];
                let n_common = le_u32(&self.buf, 6);
                let n_channel = le_u32(&self.buf, 10);
                let caps_offset = le_u32(&self.buf, 14);
                if !self.caps_fit(caps_offset, n_common, n_channel, LINK_MESS_MIN) {
                    return self.stop(UnparsedReason::BadLink, caps_offset);
                }
                self.caps_offset = caps_offset;
                if n_common > 0 {
                    self.want(
                        LINK_HEADER_LEN as u64 + caps_offset as u64,
                        4,
                        Phase::CommonCaps,
                    );
                    Output::None
                } else {
                    self.common_caps = 0;
                    self.caps_known = 1;
                    self.after_link();
                    self.link_output()
                }
            }
            Phase::ReplyError => {
                let error = le_u32(&self.buf, 0);
                if error != 0 {
                    return self.stop(UnparsedReason::LinkRefused, error);
                }
                self.want(
                    (LINK_HEADER_LEN + LINK_REPLY_CAPS_FIELDS) as u64,
                    12,
                    Phase::ReplyCaps,
                );
                Output::None
            }
            Phase::ReplyCaps => {
                let n_common = le_u32(&self.buf, 0);
                let n_channel = le_u32(&self.buf, 4);
                let caps_offset = le_u32(&self.buf, 8);
                if !self.caps_fit(caps_offset, n_common, n_channel, LINK_REPLY_MIN) {
                    return self.stop(UnparsedReason::BadLink, caps_offset);
                }
                self.caps_offset = caps_offset;
                self.channel_type = peer.channel_type;
                if n_common > 0 {
                    self.want(
                        LINK_HEADER_LEN as u64 + caps_offset as u64,
                        4,
                        Phase::CommonCaps,
                    );
                    Output::None
                } else {
                    self.common_caps = 0;
                    self.caps_known = 1;
                    self.after_link();
                    self.link_output()
                }
            }
            Phase::CommonCaps => {
                self.common_caps = le_u32(&self.buf, 0);
                self.caps_known = 1;
                self.after_link();
                self.link_output()
            }
            Phase::AuthMechanism => {
                let mechanism = le_u32(&self.buf, 0);
                if mechanism == AUTH_MECHANISM_SPICE {
                    self.want(
                        at + (AUTH_MECHANISM_LEN + TICKET_LEN) as u64,
                        0,
                        Phase::DataHeader,
                    );
                    self.hdr_len = 0;
                    Output::None
                } else if mechanism == AUTH_MECHANISM_SASL {
                    self.stop(UnparsedReason::Sasl, mechanism)
                } else {
                    self.stop(UnparsedReason::BadAuthMechanism, mechanism)
                }
            }
            Phase::LinkResult => {
                let code = le_u32(&self.buf, 0);
                if peer.sasl {
                    return self.stop(UnparsedReason::Sasl, AUTH_MECHANISM_SASL);
                }
                if code == u32::from_le_bytes(SPICE_MAGIC) {
                    return self.stop(UnparsedReason::LinkErrorAfterReply, code);
                }
                if code != 0 {
                    return self.stop(UnparsedReason::LinkRefused, code);
                }
                self.want(at + LINK_RESULT_LEN as u64, 0, Phase::DataHeader);
                self.hdr_len = 0;
                Output::None
            }
            Phase::DataHeader => self.data_header(),
            // Hunting has its own entry point (`complete_hunt`), so that the kernel verifies
            // it in a function of its own.
            Phase::Hunt => Output::None,
            Phase::DataPrefix => {
                // Constant offsets only (hdr_len is 6 or 18): the kernel verifier refuses
                // variable-offset reads of a stack copy.
                let full = self.hdr_len == FULL_HEADER_LEN;
                let extra = self.want_len.saturating_sub(self.hdr_len as u32);
                let (w0, w1) = if full {
                    (le_u32(&self.buf, 18), le_u32(&self.buf, 22))
                } else {
                    (le_u32(&self.buf, 6), le_u32(&self.buf, 10))
                };
                let p0 = if extra >= 4 { w0 } else { 0 };
                let p1 = if extra >= 8 { w1 } else { 0 };
                self.finish_message([p0, p1])
            }
            Phase::Unparsed => Output::None,
        }
    }

    /// A complete data header is in `buf` (`hdr_len` bytes): validate it loosely (a framed
    /// stream accepts any type up to [`MAX_MESSAGE_TYPE`]), then read its prefix or report it.
    /// A header that fails goes back to hunting ([`Self::hunt`], counted in `resyncs`).
    #[inline(always)]
    fn data_header(&mut self) -> Output {
        let (msg_type, size) = if self.hdr_len == FULL_HEADER_LEN {
            (le_u16(&self.buf, 8), le_u32(&self.buf, 10))
        } else {
            (le_u16(&self.buf, 0), le_u32(&self.buf, 2))
        };
        if msg_type == 0 || msg_type > MAX_MESSAGE_TYPE || size > MAX_MESSAGE_SIZE {
            return self.hunt(UnparsedReason::BadHeader, msg_type as u32, self.want_at);
        }
        self.msg_type = msg_type;
        self.msg_size = size;
        let extra = prefix_len(Role::from_u8(self.role), self.channel_type, msg_type, size);
        if extra > 0 {
            self.want_len = self.hdr_len as u32 + extra;
            self.phase = Phase::DataPrefix as u8;
            return Output::None;
        }
        self.finish_message([0, 0])
    }

    /// Starts hunting for message boundaries from stream offset `at`: a connection joined
    /// mid-stream ([`UnparsedReason::AttachedMidStream`], `role` from how the socket was made,
    /// see [`crate::config::preexisting`]) or a header that failed validation
    /// ([`UnparsedReason::BadHeader`], counted in `resyncs`). Nothing is read until a call
    /// start offers a candidate ([`Self::hunt_call_start`]).
    #[inline(always)]
    pub fn hunt(&mut self, reason: UnparsedReason, detail: u32, at: u64) -> Output {
        if self.phase != Phase::Hunt as u8 && reason != UnparsedReason::AttachedMidStream {
            self.resyncs = self.resyncs.wrapping_add(1);
        }
        self.phase = Phase::Hunt as u8;
        self.reason = reason as u8;
        self.detail = detail;
        self.joined = 1;
        self.run = 0;
        self.lock_pending = 0;
        // The send anchor needs a call seen while hunting.
        self.call_complete = 0;
        self.hunt_from = at;
        self.want_at = NOWHERE;
        self.want_len = 0;
        self.have = 0;
        Output::Hunt { reason, detail, at }
    }

    /// A call of this direction starts at stream offset `at` (its first byte) while hunting:
    /// offers it as a candidate header start. `anchor` says what the call start is
    /// ([`lock_how`]); `hdr` is the header length a receive asked for exactly (6 or 18), else
    /// 0. A chain that expects a header exactly here continues; a header-read anchor replaces
    /// any other chain or candidate unless it falls inside the body the chain skips, a send
    /// anchor only one that validated nothing yet; a plain
    /// call start (content) is taken only when nothing is pending. No effect outside
    /// [`Phase::Hunt`].
    #[inline(always)]
    pub fn hunt_call_start(&mut self, at: u64, anchor: u8, hdr: u8) {
        if self.phase != Phase::Hunt as u8 {
            return;
        }
        if self.run > 0 && self.want_at == at && self.have == 0 {
            return;
        }
        let pending = self.want_at != NOWHERE;
        // A send anchor does not cut a chain that already validated a header (or is reading
        // one): a peer that writes one message in several complete calls (more than 1024
        // iovecs, a scripted peer's chunks) would never get past its first header otherwise.
        // Nor does a header-sized read inside the body the chain is skipping (a 6- or
        // 18-byte body read looks like a header read).
        if pending
            && (anchor == lock_how::CONTENT
                || (anchor == lock_how::SEND_AFTER_COMPLETE && (self.run > 0 || self.have > 0))
                || (anchor == lock_how::RECV_HEADER_READ && self.run > 0 && at < self.want_at))
        {
            return;
        }
        self.run = 0;
        self.how = anchor;
        self.chain_mask = 0;
        self.want_at = at;
        self.have = 0;
        self.want_len = if hdr == MINI_HEADER_LEN || hdr == FULL_HEADER_LEN {
            hdr as u32
        } else if self.hdr_fixed != 0 {
            self.hdr_len as u32
        } else {
            MINI_HEADER_LEN as u32
        };
    }

    /// A complete candidate header is in `buf` (`want_len` bytes) while hunting. It must fit
    /// some channel type in this direction ([`s2c_channels`] / [`c2s_channels`]: a known type
    /// with a size it can have), the same channel types as the chain's earlier headers, a size
    /// up to [`MAX_HUNT_SIZE`], and for full headers a serial one above the previous one.
    /// [`LOCK_RUN_ANCHORED`] or [`LOCK_RUN_CONTENT`] such headers in a row lock: the last one
    /// becomes the first counted message. A mini header that fails a fresh candidate is tried
    /// again as a full header; any other failure drops the chain.
    #[inline(always)]
    pub fn complete_hunt(&mut self) -> Output {
        self.complete_hunt_with(&HUNT_TYPES)
    }

    /// [`Self::complete_hunt`] with the type table passed in (the kernel passes its own copy
    /// in read-only data, read with a volatile load so the compiler keeps it a table).
    #[inline(always)]
    pub fn complete_hunt_with(&mut self, types: &[u32; HUNT_TYPES_LEN]) -> Output {
        let at = self.want_at;
        let full = self.want_len == FULL_HEADER_LEN as u32;
        let (msg_type, size) = if full {
            (le_u16(&self.buf, 8), le_u32(&self.buf, 10))
        } else {
            (le_u16(&self.buf, 0), le_u32(&self.buf, 2))
        };
        let role = Role::from_u8(self.role);
        // The load always happens, at a masked index: the kernel verifier needs a bound it can
        // see on the table offset (a range check alone gets folded into a check of the high
        // byte, which the verifier does not connect to the index).
        let i = (msg_type as usize) & (HUNT_TYPES_LEN - 1);
        // SAFETY: i < HUNT_TYPES_LEN.
        let loaded = unsafe { core::ptr::read_volatile(types.as_ptr().add(i)) };
        let entry = if (msg_type as usize) < HUNT_TYPES_LEN {
            loaded
        } else {
            0
        };
        let (s2c, c2s) = ((entry >> 16) as u16, entry as u16);
        let mut mask = match role {
            Role::ServerToClient => s2c & s2c_size_ok(msg_type, size),
            Role::ClientToServer => c2s & c2s_size_ok(msg_type, size),
            Role::Unknown => {
                (s2c & s2c_size_ok(msg_type, size)) | (c2s & c2s_size_ok(msg_type, size))
            }
        };
        if size > MAX_HUNT_SIZE {
            mask = 0;
        }
        let serial = le_u32(&self.buf, 0);
        if full {
            let serial_ok = le_u32(&self.buf, 4) == 0
                && serial != 0
                && (self.run == 0 || serial == self.last_serial.wrapping_add(1))
                && le_u32(&self.buf, 14) <= size;
            if !serial_ok {
                mask = 0;
            }
        }
        if self.run > 0 {
            mask &= self.chain_mask;
        }
        if mask == 0 {
            if self.run == 0
                && !full
                && self.hdr_fixed == 0
                && self.how != lock_how::RECV_HEADER_READ
            {
                self.want_len = FULL_HEADER_LEN as u32;
                return Output::None;
            }
            self.run = 0;
            self.want_at = NOWHERE;
            self.want_len = 0;
            self.have = 0;
            return Output::None;
        }
        if self.run == 0 {
            self.candidates = self.candidates.wrapping_add(1);
        }
        self.chain_mask = mask;
        self.run = self.run.saturating_add(1);
        self.last_serial = serial;
        let need = if self.how == lock_how::CONTENT {
            LOCK_RUN_CONTENT
        } else {
            LOCK_RUN_ANCHORED
        };
        if self.run >= need {
            self.unframed = self
                .unframed
                .wrapping_add(at.saturating_sub(self.hunt_from));
            self.hdr_len = self.want_len as u8;
            self.phase = Phase::DataHeader as u8;
            self.lock_pending = 1;
            return self.data_header();
        }
        let next = at + self.want_len as u64 + size as u64;
        self.want_at = next;
        self.have = 0;
        Output::None
    }

    #[inline(always)]
    fn finish_message(&mut self, prefix: [u32; 2]) -> Output {
        Output::Message(self.finish(prefix))
    }

    /// [`Self::finish_message`]'s message.
    #[inline(always)]
    fn finish(&mut self, prefix: [u32; 2]) -> MessageInfo {
        let at = self.want_at;
        self.msg_count += 1;
        let already_reported = self.announced_at == at && at != 0;
        if already_reported {
            self.announced_at = 0;
        }
        let hdr_len = self.hdr_len;
        let size = self.msg_size;
        let lock = if self.lock_pending != 0 { self.how } else { 0 };
        self.lock_pending = 0;
        let out = MessageInfo {
            at,
            index: self.msg_count,
            size,
            msg_type: self.msg_type,
            hdr_len,
            already_reported,
            prefix,
            lock,
        };
        self.want(
            at + hdr_len as u64 + size as u64,
            hdr_len as u32,
            Phase::DataHeader,
        );
        out
    }

    /// The fast path of a call that begins with a whole data header, `hdr` holding its first
    /// bytes (as [`Self::header_whole`] takes them): [`Self::header_whole`] when
    /// the state's next header is at the call's start (`want_at == pos`); `None` otherwise.
    ///
    /// Most calls of spice-server and of a relay begin at a message boundary; the kernel then
    /// frames the first message without its per-element loop, and runs the loop only for
    /// elements further in the call. [`feed_call`] does the same, so every host test of the
    /// framing goes through it.
    #[inline(always)]
    pub fn header_at_call_start<const N: usize>(&mut self, hdr: &[u8; N]) -> Option<MessageInfo> {
        if self.want_at != self.pos {
            return None;
        }
        self.header_whole(hdr)
    }

    /// Frames the message whose whole data header lies in one piece in the caller's buffer and
    /// was read into `hdr` (its first [`Self::hdr_len`] bytes, at most [`HEADER_BUF_LEN`] of
    /// them: the rest is neither needed nor read), from stream offset
    /// `want_at`: with the state at a message boundary (phase [`Phase::DataHeader`], header
    /// length decided, nothing of the header read, no lock to report), as
    /// [`Self::complete`] would after reading the header into [`Self::buf`], and returns it.
    /// `None`, with the state unchanged, for anything else, and for a header the general
    /// path must handle: one that fails validation (it starts the hunt) or a message whose
    /// first body words are reported (SET_ACK, ACK_SYNC, main INIT: the general path reads
    /// them). The kernel's element loop uses it for every header that lies whole in one
    /// buffer of the call, [`feed_call`] for every one in one segment.
    #[inline(always)]
    pub fn header_whole<const N: usize>(&mut self, hdr: &[u8; N]) -> Option<MessageInfo> {
        const { assert!(N >= HEADER_BUF_LEN) };
        if self.phase != Phase::DataHeader as u8
            || self.hdr_len == 0
            || self.want_len != self.hdr_len as u32
            || self.have != 0
            || self.lock_pending != 0
        {
            return None;
        }
        let (msg_type, size) = if self.hdr_len == FULL_HEADER_LEN {
            (le_u16(hdr, 8), le_u32(hdr, 10))
        } else {
            (le_u16(hdr, 0), le_u32(hdr, 2))
        };
        if msg_type == 0 || msg_type > MAX_MESSAGE_TYPE || size > MAX_MESSAGE_SIZE {
            return None;
        }
        if prefix_len(Role::from_u8(self.role), self.channel_type, msg_type, size) != 0 {
            return None;
        }
        self.msg_type = msg_type;
        self.msg_size = size;
        Some(self.finish([0, 0]))
    }

    /// Reads a message start from the bytes of a send call that moved nothing (EAGAIN).
    ///
    /// spice-server counts a message when it starts writing it, before the first `writev`
    /// (`RedChannelClient::begin_send_message`, `docs/spice-protocol.md` §3.2), and that
    /// `writev` may fail with EAGAIN. `first` holds the first bytes of the rejected call's
    /// buffer (`avail` of them valid). If the state sits at a data boundary and those bytes hold
    /// the whole header (plus the prefix it needs), returns the message and remembers its offset
    /// so that the later successful write does not report it again. State is otherwise
    /// unchanged.
    #[inline(always)]
    pub fn peek(
        &mut self,
        first: &[u8; BUF_LEN],
        avail: u32,
        peer: &PeerView,
    ) -> Option<MessageInfo> {
        let mut t = *self;
        self.peek_in(&mut t, first, avail, peer)
    }

    /// [`Self::peek`] with the trial state in `t` (overwritten; any contents) instead of a
    /// copy on the stack: the kernel programs keep it in a map value, since a `DirState` is
    /// a large share of the BPF stack.
    pub fn peek_in(
        &mut self,
        t: &mut DirState,
        first: &[u8; BUF_LEN],
        avail: u32,
        peer: &PeerView,
    ) -> Option<MessageInfo> {
        // Only at a message boundary: the rejected call must start where a header is due.
        if self.phase != Phase::DataHeader as u8 || self.have != 0 || self.pos != self.want_at {
            return None;
        }
        if self.prepare(peer) != Output::None || self.hdr_len == 0 {
            return None;
        }
        if self.announced_at == self.want_at {
            return None;
        }
        *t = *self;
        t.buf = *first;
        for _ in 0..2 {
            if avail < t.want_len {
                return None;
            }
            t.have = t.want_len;
            match t.complete(peer) {
                Output::Message(m) => {
                    self.announced_at = m.at;
                    return Some(m);
                }
                Output::None if t.phase == Phase::DataPrefix as u8 => continue,
                _ => return None,
            }
        }
        None
    }
}

/// Host mirror of the kernel's per-call loop: feeds the bytes one call moved (as iovec-like
/// `segments`, in order) through `st`, calling `emit` for every output. Bytes before `st.pos`
/// are never seen again; bodies are skipped by offset, not copied. Used by the unit tests, the
/// scripted-peer checks and anything that frames captured bytes on the host.
pub fn feed<F: FnMut(Output)>(st: &mut DirState, peer: &PeerView, segments: &[&[u8]], emit: F) {
    feed_call(st, peer, segments, lock_how::CONTENT, 0, emit)
}

/// [`feed`] for a call whose start is an anchor of the peer's call pattern while hunting:
/// `anchor` and `hdr` as in [`DirState::hunt_call_start`] (the kernel works them out from the
/// call's arguments and the previous call's result).
pub fn feed_call<F: FnMut(Output)>(
    st: &mut DirState,
    peer: &PeerView,
    segments: &[&[u8]],
    anchor: u8,
    hdr: u8,
    mut emit: F,
) {
    feed_call_with(st, peer, segments, anchor, hdr, true, &mut emit)
}

/// The bytes of a header of `hl` bytes at the start of `src` as the kernel reads them into
/// its stack buffer: at most [`HEADER_BUF_LEN`], the rest zero. A framing change that read
/// past them would see zeros here too (`le_u32`/`le_u16` return 0 past the end), and the
/// host tests' counts would show it.
fn kernel_header_read(src: &[u8], hl: usize) -> [u8; HEADER_BUF_LEN] {
    let mut buf = [0u8; HEADER_BUF_LEN];
    let k = hl.min(HEADER_BUF_LEN);
    buf[..k].copy_from_slice(&src[..k]);
    buf
}

/// [`feed_call`], with the first-message fast path ([`DirState::header_at_call_start`]) on
/// or off (`fast`): the kernel's path and the element loop alone, for tests that hold them
/// against each other. The fast path takes the header from the first segment only, as the
/// kernel takes it from the first buffer or iovec.
pub fn feed_call_with<F: FnMut(Output)>(
    st: &mut DirState,
    peer: &PeerView,
    segments: &[&[u8]],
    anchor: u8,
    hdr: u8,
    fast: bool,
    mut emit: F,
) {
    let call_start = st.pos;
    st.hunt_call_start(call_start, anchor, hdr);
    let total: u64 = segments.iter().map(|s| s.len() as u64).sum();
    let call_end = call_start + total;
    let first = segments.first().copied().unwrap_or(&[]);
    let hl = st.hdr_len as usize;
    if fast && hl != 0 && first.len() >= hl && !st.is_unparsed() {
        if let Some(m) = st.header_at_call_start(&kernel_header_read(first, hl)) {
            emit(Output::Message(m));
        }
    }
    let mut seg_i = 0usize;
    let mut seg_start = call_start;
    loop {
        if st.is_unparsed() || st.need().0 >= call_end {
            break;
        }
        // Resolve the element only once its first byte is in this call: the data header
        // length needs the peer's caps, which arrive after the client's link message.
        let out = st.prepare(peer);
        if out != Output::None {
            emit(out);
        }
        if st.is_unparsed() {
            break;
        }
        let (at, remaining) = st.need();
        if at < call_start {
            emit(st.stop(UnparsedReason::Internal, 0));
            break;
        }
        while at >= seg_start + segments[seg_i].len() as u64 {
            seg_start += segments[seg_i].len() as u64;
            seg_i += 1;
        }
        let seg = segments[seg_i];
        let off = (at - seg_start) as usize;
        let n = (remaining as usize)
            .min(seg.len() - off)
            .min((call_end - at) as usize);
        // A whole header in this segment: framed from one read, as the kernel does.
        let hl = st.hdr_len as usize;
        if fast && st.have == 0 && hl != 0 && remaining as usize == hl && n == hl {
            if let Some(m) = st.header_whole(&kernel_header_read(&seg[off..], hl)) {
                emit(Output::Message(m));
                continue;
            }
        }
        let have = st.have as usize;
        st.buf[have..have + n].copy_from_slice(&seg[off..off + n]);
        st.have += n as u32;
        if st.have == st.want_len {
            let out = if st.phase == Phase::Hunt as u8 {
                st.complete_hunt()
            } else {
                st.complete(peer)
            };
            if out != Output::None {
                emit(out);
            }
        }
    }
    st.pos = call_end;
}
