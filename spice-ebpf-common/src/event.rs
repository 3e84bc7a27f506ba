//! Ring-buffer records (kernel → agent) and the per-socket state kept in kernel maps.
//!
//! Every record starts with an [`EventHeader`]; `kind` says which struct follows. At most one
//! [`MessageEvent`] (72 bytes) is written per SPICE message; link, socket, process and close
//! records are written once per socket or process. Each record goes to the ring(s) its
//! process's watch flags name ([`crate::config::watch`]): `EVENTS`, read by the daemon (or a
//! standalone observe), and/or `TAP_EVENTS`, read by an observe beside the daemon; the same
//! layout in both.

use crate::{framing::DirState, window::WindowState};

/// Record kinds ([`EventHeader::kind`]).
pub mod kind {
    /// [`super::SocketEvent`]: a watched process used a TCP socket for the first time.
    pub const SOCKET: u8 = 1;
    /// [`super::LinkEvent`]: a link message or reply was parsed.
    pub const LINK: u8 = 2;
    /// [`super::MessageEvent`]: a data message started.
    pub const MESSAGE: u8 = 3;
    /// [`super::UnparsedEvent`]: framing stopped for one direction.
    pub const UNPARSED: u8 = 4;
    /// [`super::ProcEvent`]: a watched process forked a child, now watched too.
    pub const FORK: u8 = 5;
    /// [`super::ProcEvent`]: a watched process exited.
    pub const EXIT: u8 = 6;
    /// [`super::CloseEvent`]: a tracked socket closed.
    pub const CLOSE: u8 = 7;
    /// [`super::HuntEvent`]: a direction has no message boundaries (joined mid-stream, or a
    /// header failed validation) and hunts for them.
    pub const HUNT: u8 = 8;
    /// [`super::LockEvent`]: a hunting direction found its boundaries; the next message
    /// record of that direction (flag [`super::msg_flags::LOCK`]) is the first one counted.
    pub const LOCK: u8 = 9;
    /// [`super::TlsEvent`]: the socket carries TLS, and its framing runs on the plaintext the
    /// process hands to libssl (uprobes), not on the socket's bytes. Once per socket, before
    /// any record of its plaintext.
    pub const TLS: u8 = 10;
    /// [`super::TlsMarkEvent`]: where one libssl call's plaintext ends, in TCP sequence space.
    pub const TLS_MARK: u8 = 11;
}

/// Direction of bytes relative to the watched process ([`EventHeader::dir`]).
pub mod dir {
    /// Bytes the watched process wrote (send, write, writev, sendmsg, sendto).
    pub const SEND: u8 = 0;
    /// Bytes the watched process read (recv, read, readv, recvmsg, recvfrom).
    pub const RECV: u8 = 1;
}

/// [`MessageEvent::flags`] bits.
pub mod msg_flags {
    /// Reported from a send call that failed with EAGAIN before any byte was taken: spice-server
    /// has already counted the message (`docs/spice-protocol.md` §3.2).
    pub const EAGAIN_START: u8 = 1;
    /// The first message after a lock ([`super::LockEvent`] just before it): the messages
    /// between the previous counted one and this one were not framed.
    pub const LOCK: u8 = 2;
    /// When this message's call ran, the socket's other direction was in the middle of a
    /// message ([`crate::framing::PeerView::mid_message`]). On an ACK that spice-server reads,
    /// this says its last message was held by TCP (a partial write, or an EAGAIN start), not
    /// by the ACK window.
    pub const PEER_MID_MESSAGE: u8 = 4;
}

/// How a hunting direction found its boundaries ([`LockEvent::how`]).
pub mod lock_how {
    /// The chain began at a send call that followed a writev (or sendmsg) which moved
    /// everything it was asked: spice-server writes one message per writev, so the next write
    /// starts a message (`docs/spice-protocol.md` §4.2). Relays' complete writes (write /
    /// send of arbitrary chunks) are no anchor.
    pub const SEND_AFTER_COMPLETE: u8 = 1;
    /// The chain began at a receive call that asked for exactly a data header (6 or 18 bytes)
    /// and got it: spice-server reads the header, then the body (§4.6).
    pub const RECV_HEADER_READ: u8 = 2;
    /// The chain began at a call start without such an anchor (relays): content alone.
    pub const CONTENT: u8 = 3;
    /// Short name for reports and JSON.
    pub const fn name(how: u8) -> &'static str {
        match how {
            SEND_AFTER_COMPLETE => "send_after_complete",
            RECV_HEADER_READ => "recv_header_read",
            CONTENT => "content",
            _ => "none",
        }
    }
}

/// [`EventHeader::flags`] bits.
pub mod hdr_flags {
    /// Written by the libssl hooks for a TLS socket: stream offsets (`at`) are plaintext
    /// offsets, and [`super::MessageEvent::seq`] is no TCP sequence number (the
    /// [`super::TlsMarkEvent`]s place the plaintext).
    pub const TLS: u8 = 1;
}

/// Common prefix of every record. 24 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct EventHeader {
    /// One of [`kind`].
    pub kind: u8,
    /// One of [`dir`] (0 where it does not apply).
    pub dir: u8,
    /// [`hdr_flags`] bits.
    pub flags: u8,
    pub _pad: u8,
    /// Process (thread group) that made the call, host pid namespace.
    pub tgid: u32,
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC, nanoseconds).
    pub ts_ns: u64,
    /// Socket cookie (`bpf_get_socket_cookie`, same value as sock_diag's `idiag_cookie`).
    pub cookie: u64,
}

/// A data message started in one direction. 72 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MessageEvent {
    pub hdr: EventHeader,
    /// Stream offset (bytes since the connection's first byte in this direction) of the header.
    pub at: u64,
    /// 1-based ordinal of the message in this direction; a gap means a lost record.
    pub index: u64,
    /// Body size in bytes.
    pub size: u32,
    pub msg_type: u16,
    /// 6 (mini header) or 18 (full header).
    pub hdr_len: u8,
    /// [`msg_flags`] bits.
    pub flags: u8,
    /// SET_ACK: generation, window. ACK_SYNC: generation. Main INIT: session_id.
    pub prefix: [u32; 2],
    /// TCP sequence number of the header's first byte (`write_seq` / `copied_seq` space of
    /// this socket), to place the message against snd_una, snd_nxt, rcv_nxt.
    pub seq: u32,
    /// The socket's [`WindowState::messages_window`] after the kernel applied this message.
    pub win_mw: u32,
    /// The socket's [`WindowState::count`] (in flight) after this message.
    pub win_count: u32,
    /// [`crate::window::effect`] bits: what this message did to the window.
    pub win_effects: u8,
    pub _pad: [u8; 3],
}

/// A link message (client) or link reply (server) was parsed. 48 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LinkEvent {
    pub hdr: EventHeader,
    /// [`crate::framing::Role`] of this direction.
    pub role: u8,
    pub channel_type: u8,
    pub channel_id: u8,
    pub _pad: u8,
    /// H_c or H_s.
    pub link_size: u32,
    pub connection_id: u32,
    pub common_caps: u32,
    /// Stream offset just after the link message (`16 + link_size`).
    pub end: u64,
}

/// Framing stopped for one direction. 40 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct UnparsedEvent {
    pub hdr: EventHeader,
    /// Stream offset where it stopped.
    pub at: u64,
    /// [`crate::framing::UnparsedReason`].
    pub reason: u8,
    pub _pad: [u8; 3],
    pub detail: u32,
}

/// A direction lost (or never had) its message boundaries and hunts for them from stream
/// offset `at`. 48 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HuntEvent {
    pub hdr: EventHeader,
    /// Stream offset from which bytes are not framed until the next [`LockEvent`].
    pub at: u64,
    /// Why ([`crate::framing::UnparsedReason`]): `AttachedMidStream` for a connection open
    /// before observation started, `BadHeader` for a header that failed validation.
    pub reason: u8,
    /// [`crate::framing::Role`] the hunt assumes for this direction (0: unknown).
    pub role: u8,
    pub _pad: [u8; 2],
    /// Detail of the reason (`BadHeader`: the type that failed).
    pub detail: u32,
    /// Locks of this direction lost so far, this one included ([`DirState::resyncs`]).
    pub resyncs: u32,
    pub _pad2: u32,
}

/// A hunting direction locked on its message boundaries. 64 bytes. The next message record of
/// this direction carries [`msg_flags::LOCK`] and is the first one counted after the lock.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LockEvent {
    pub hdr: EventHeader,
    /// Stream offset of the first counted message's header.
    pub at: u64,
    /// Bytes not framed in this hunt (from its [`HuntEvent::at`] to `at`).
    pub skipped: u64,
    /// Ordinal the first counted message gets ([`MessageEvent::index`]).
    pub index: u64,
    /// [`lock_how`]: what the validated chain began at.
    pub how: u8,
    /// Consecutive headers that validated, the lock message's included.
    pub run: u8,
    /// 6 (mini) or 18 (full), as the chain found it.
    pub hdr_len: u8,
    /// [`crate::framing::Role`] of this direction.
    pub role: u8,
    /// Channel types every validated header fits (bit `1 << channel_type`,
    /// [`crate::protocol::channel`]): a hint for the agent's inference.
    pub channel_mask: u16,
    pub _pad: u16,
    /// Candidates this direction tried so far ([`DirState::candidates`]).
    pub candidates: u32,
    /// Locks this direction lost so far ([`DirState::resyncs`]).
    pub resyncs: u32,
}

/// A socket turned out to carry TLS: its first traced call ran inside a hooked libssl
/// function ([`tls_func`]). From here on the socket's message records, hunts, locks and link
/// records describe the TLS plaintext (stream offsets count plaintext bytes), and its
/// `SockState::wire_pos` counts the TCP bytes. 32 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct TlsEvent {
    pub hdr: EventHeader,
    /// The [`tls_func`] whose call the socket's first traced call ran in.
    pub func: u8,
    pub _pad: [u8; 7],
}

/// One libssl call moved plaintext on a TLS socket: the plaintext up to `plain_end` (stream
/// offset in direction `hdr.dir`) is in the TCP stream up to `seq`. For a send, `seq` is
/// `write_seq` at the return of SSL_write: every byte of the records that call wrote is
/// queued. For a receive, `copied_seq` at the return of SSL_read: the records the plaintext
/// came from have been read. A plaintext byte is therefore placed in TCP sequence space to
/// within one call's records (spice-server writes one iovec per SSL_write, so at most one
/// message part). 40 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct TlsMarkEvent {
    pub hdr: EventHeader,
    /// Plaintext stream offset just after this call's bytes.
    pub plain_end: u64,
    /// `write_seq` (send) or `copied_seq` (recv) at the call's return.
    pub seq: u32,
    /// Plaintext bytes this call moved.
    pub len: u32,
}

/// libssl functions the TLS hooks attach to ([`TlsEvent::func`], [`TlsCall::func`]). OpenSSL
/// 3 `ssl/ssl_lib.c`: SSL_write and SSL_write_ex both call `ssl_write_internal`, SSL_read and
/// SSL_read_ex `ssl_read_internal`, SSL_accept and SSL_connect `SSL_do_handshake`, so no
/// hooked function runs inside another.
pub mod tls_func {
    /// `int SSL_write(SSL *s, const void *buf, int num)`: returns the bytes written (> 0).
    pub const WRITE: u8 = 1;
    /// `int SSL_write_ex(SSL *s, const void *buf, size_t num, size_t *written)`: returns 1.
    pub const WRITE_EX: u8 = 2;
    /// `int SSL_read(SSL *s, void *buf, int num)`: returns the bytes read (> 0).
    pub const READ: u8 = 3;
    /// `int SSL_read_ex(SSL *s, void *buf, size_t num, size_t *readbytes)`: returns 1.
    pub const READ_EX: u8 = 4;
    /// SSL_do_handshake, SSL_shutdown, SSL_peek, SSL_peek_ex: no plaintext is framed from
    /// these, but socket calls inside them are the TLS library's (handshake records, alerts,
    /// reads ahead), not bytes the hooks missed.
    pub const CONTEXT: u8 = 5;
    /// True for the functions that return plaintext to frame.
    pub const fn moves_plaintext(f: u8) -> bool {
        f >= WRITE && f <= READ_EX
    }
    /// Short name for reports.
    pub const fn name(f: u8) -> &'static str {
        match f {
            WRITE => "SSL_write",
            WRITE_EX => "SSL_write_ex",
            READ => "SSL_read",
            READ_EX => "SSL_read_ex",
            CONTEXT => "SSL_do_handshake/SSL_shutdown/SSL_peek",
            _ => "none",
        }
    }
}

/// A libssl call a watched thread is in (map `TLS_CALLS`, key: pid_tgid), saved at the
/// function's entry and taken at its return. 48 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct TlsCall {
    /// [`tls_func`].
    pub func: u8,
    /// [`crate::config::watch::route`] of the process.
    pub watch: u8,
    /// 1 if a socket send inside this call failed with EAGAIN (so a failed SSL_write is
    /// the WANT_WRITE that spice-server retries, not a dead connection).
    pub eagain: u8,
    pub _pad: [u8; 5],
    /// The `SSL *` (user address in the calling process).
    pub ssl: u64,
    /// Plaintext buffer (user address).
    pub buf: u64,
    /// Bytes asked (`num`).
    pub num: u64,
    /// SSL_write_ex / SSL_read_ex: the `size_t *` that receives the byte count.
    pub out: u64,
    /// Cookie of the socket a socket call inside this call used (0: none yet).
    pub cookie: u64,
}

/// Key of the `SSL_SOCKETS` map: one `SSL *` of one process → the socket cookie its calls
/// move bytes on.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SslKey {
    pub tgid: u32,
    pub _pad: u32,
    pub ssl: u64,
}

/// [`SockState::carrier`] values: what the socket's framing reads.
pub mod carrier {
    /// No call seen yet.
    pub const UNDECIDED: u8 = 0;
    /// The socket's own bytes (plain SPICE, or anything else the plain path judges).
    pub const PLAIN: u8 = 1;
    /// TLS: the socket's first traced call ran inside a hooked libssl function, so its bytes
    /// are TLS records; framing runs on the plaintext at the libssl hooks.
    pub const TLS: u8 = 2;
}

/// First use of a TCP socket by a watched process.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SocketEvent {
    pub hdr: EventHeader,
    /// Thread that made the call.
    pub tid: u32,
    /// AF_INET (2) or AF_INET6 (10).
    pub family: u16,
    /// Local port, host order.
    pub lport: u16,
    /// Remote port, host order.
    pub rport: u16,
    pub _pad: [u8; 6],
    /// Local address: IPv4 in the first 4 bytes, or IPv6.
    pub laddr: [u8; 16],
    /// Remote address, same layout.
    pub raddr: [u8; 16],
    /// `comm` of the calling thread.
    pub comm: [u8; 16],
}

/// Fork or exit of a watched process.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcEvent {
    pub hdr: EventHeader,
    /// FORK: the new child's tgid. EXIT: the exiting tgid.
    pub pid: u32,
    pub _pad: u32,
    pub comm: [u8; 16],
}

/// A tracked socket went to TCP_CLOSE; carries its last TCP state.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CloseEvent {
    pub hdr: EventHeader,
    pub tcp: TcpSnapshot,
    /// Bytes moved by traced socket calls in each direction so far ([`DirState::pos`], or
    /// [`SockState::wire_pos`] for a TLS socket: TCP bytes either way; indexed by [`dir`]):
    /// the socket's entry is deleted at `tcp_destroy_sock`, soon after this record,
    /// so the agent's last read of it may be older.
    pub pos: [u64; 2],
}

/// TCP state of one socket as last read by a kernel hook ([`SockState::tcp`] in map
/// `SOCKETS`, key: cookie; the `CLOSE` record's state at the close).
///
/// Fields are `struct tcp_sock` members (include/linux/tcp.h) in their kernel units.
/// notsent = `write_seq - snd_nxt`, receive queue = `rcv_nxt - copied_seq` (both bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct TcpSnapshot {
    /// When it was read (`bpf_ktime_get_ns`).
    pub ts_ns: u64,
    /// Sequence after the last byte the application wrote.
    pub write_seq: u32,
    /// Next sequence to send.
    pub snd_nxt: u32,
    /// First unacknowledged sequence.
    pub snd_una: u32,
    /// Next sequence expected from the peer.
    pub rcv_nxt: u32,
    /// Sequence after the last byte the application read.
    pub copied_seq: u32,
    /// Congestion window, segments.
    pub snd_cwnd: u32,
    /// Smoothed RTT in microseconds (already shifted: `srtt_us >> 3`).
    pub srtt_us: u32,
    /// Segments sent and not yet acknowledged (`packets_out`, tcp_info's `unacked`).
    pub packets_out: u32,
    /// Retransmitted segments over the connection's life.
    pub total_retrans: u32,
    /// Which hooks filled this ([`tcp_source`] bits).
    pub sources: u32,
}

/// [`TcpSnapshot::sources`] bits.
pub mod tcp_source {
    /// Read from `struct tcp_sock` in a send or receive tracepoint (process context).
    pub const SOCKET_CALL: u32 = 1;
    /// sockops callback (RTT, retransmit, state, header parse).
    pub const SOCKOPS: u32 = 2;
    /// `inet_sock_set_state` tracepoint (close).
    pub const STATE_TRACEPOINT: u32 = 4;
}

/// Per-socket state in the kernel map `SOCKETS` (key: cookie).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SockState {
    /// Framing state, indexed by [`dir`].
    pub dir: [DirState; 2],
    /// `write_seq` (send) or `copied_seq` (recv) minus the stream position, fixed at first sight;
    /// a later mismatch means bytes moved that the hooks did not see.
    pub seq_base: [u32; 2],
    /// 1 once `seq_base[d]` is set.
    pub seq_init: [u8; 2],
    /// 1 once the SOCKET record went out.
    pub announced: u8,
    /// Where the records of the call that created this entry went
    /// ([`crate::config::watch::route`] of its tgid's `WATCHED_TGIDS` value): a socket
    /// without [`crate::config::watch::ROUTE_PRIMARY`] was created for an `observe` beside
    /// the daemon only, and a restarted daemon leaves it out of its model.
    pub watch: u8,
    /// tgid that first used the socket.
    pub tgid: u32,
    /// Bytes (header + body) of the data messages started in each direction (indexed by
    /// [`dir`]), kept by the kernel so that a restarted agent continues the byte totals
    /// exactly (`DirState::msg_count` is the message total).
    pub msg_bytes: [u64; 2],
    /// spice-server's ACK window on this connection, run by the kernel on every framed
    /// message (`crate::window`). The exact count lives here, not in the agent.
    pub window: WindowState,
    /// [`carrier`]: whether `dir` frames the socket's bytes or its TLS plaintext.
    pub carrier: u8,
    pub _pad: [u8; 7],
    /// 1 while a call applies a message to [`Self::window`], else 0: taken with a
    /// compare-and-exchange, so that a send and a receive on two CPUs at once (a process
    /// that reads and writes one socket from two threads) cannot lose an update. Never held
    /// across a helper call; 0 in a fresh or restored entry. 64 bits: the BPF target's only
    /// atomic width in Rust.
    pub window_lock: u64,
    /// [`carrier::TLS`] sockets: TCP bytes moved by traced socket calls in each direction
    /// (indexed by [`dir`]); `dir[d].pos` then counts plaintext bytes. Zero otherwise.
    pub wire_pos: [u64; 2],
    /// The socket's TCP state, updated in place: `write_seq` (send) or `copied_seq` (recv) at
    /// every socket call, the members that move with ACKs and transmissions at most every
    /// [`crate::config::TCP_REFRESH_NS`] by the calls and at every sockops callback of an
    /// enrolled connection. `ts_ns` 0: not read yet. Part of the socket's entry, not a map of
    /// its own, so that a call makes one hash lookup for both (layout 10).
    pub tcp: TcpSnapshot,
}

/// Where one socket call's bytes are in user memory: read from the arguments of the syscall it
/// runs in, or of the libssl call for TLS plaintext. Kernel-side only (the capture path's
/// input); not a map value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CallArgs {
    /// One of [`call_kind`].
    pub kind: u8,
    /// [`crate::config::watch::route`] of the tgid's `WATCHED_TGIDS` value, read once per
    /// call: which rings the call's records go to.
    pub watch: u8,
    pub _pad: [u8; 2],
    pub fd: i32,
    /// User address of the buffer (single-buffer calls) or of the iovec array.
    pub ptr: u64,
    /// Buffer length in bytes, or iovec count.
    pub len: u64,
}

/// [`CallArgs::kind`] values.
pub mod call_kind {
    /// write, read, sendto, recvfrom: one buffer.
    pub const BUFFER: u8 = 1;
    /// writev, readv, sendmsg, recvmsg: an iovec array.
    pub const IOVEC: u8 = 2;
    /// Bytes the hooks cannot read from the call's arguments, and a socket call under one
    /// marks the direction unparsed (`untraced_bytes`): sendfile, splice, sendmmsg, recvmmsg,
    /// io_uring_enter, preadv2/pwritev2 or any other syscall, a compat (32-bit) task, an
    /// io_uring worker (no syscall), a `MSG_TRUNC` receive (the bytes are discarded, not
    /// copied).
    pub const UNSUPPORTED: u8 = 3;
}

/// Size of the biggest record, for ring sizing.
pub const MAX_EVENT_LEN: usize = core::mem::size_of::<SocketEvent>();

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: plain `repr(C)` data, no pointers, any bit pattern valid.
    unsafe impl aya::Pod for TcpSnapshot {}
    unsafe impl aya::Pod for SockState {}
    unsafe impl aya::Pod for TlsCall {}
    unsafe impl aya::Pod for SslKey {}
}
