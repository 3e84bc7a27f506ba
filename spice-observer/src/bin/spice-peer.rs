//! spice-peer: a scripted SPICE peer (server or client) for kernel-path tests.
//!
//! Real spice-server and spice-gtk cannot be told to split a header over two `writev`s, to hit
//! EAGAIN mid-message or to send garbage, so the observer's end-to-end tests run this peer as
//! a real process over real TCP sockets instead. Each side speaks the SPICE link phase
//! byte-exactly (`docs/spice-protocol.md` §1), then streams data messages
//! with a chosen header kind (§1.9), ACK-window behaviour (§3) and syscall pattern (§4.2, §4.7).
//!
//! * `spice-peer server --listen 127.0.0.1:PORT [options]` accepts ONE connection, prints
//!   `listening <port>` (flushed) once bound, runs the link phase, streams `--messages` messages
//!   (after an optional SET_ACK, obeying spice-server's ACK gate), reads the client's messages
//!   concurrently, closes its write side when done and waits for the client to close.
//!   `--second-set-ack-after N` sends a second SET_ACK (a new generation) after N of them.
//! * `spice-peer client --connect 127.0.0.1:PORT [options]` links, answers SET_ACK with
//!   ACK_SYNC and sends an ACK every W messages (spice-gtk cadence by default), optionally
//!   sends its own messages, and reads until the server closes. `--surplus-ack-after N` sends
//!   one ACK more than the cadence asks for.
//!
//! Both print one final line `SUMMARY {json}` on stdout. Every count in it comes from what
//! the syscalls actually returned: bytes are summed from return values, a sent message counts
//! once all of its bytes were accepted by the kernel, a received message counts once it was
//! parsed from received bytes. The `framing` section is what the shared framing code
//! (`spice_ebpf_common::framing`, the code the eBPF programs run) makes of exactly the bytes
//! of each send and receive call, in call order: the expected kernel view.
//! Exit status: 0 if the script ran to its end (including scripted refusals), 1 on an I/O
//! error, timeout or unexpected protocol bytes (the SUMMARY `error` field says which), 2 on
//! bad options.

use std::collections::{BTreeMap, VecDeque};
use std::io::{self, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{Value, json};
use spice_ebpf_common::framing::{
    self, BUF_LEN, DirState, LinkInfo, MessageInfo, Output, UnparsedReason,
};
use spice_ebpf_common::protocol::{
    AUTH_MECHANISM_SASL, AUTH_MECHANISM_SPICE, CAP_AUTH_SASL, CAP_AUTH_SELECTION, CAP_AUTH_SPICE,
    CAP_MINI_HEADER, LINK_HEADER_LEN, LINK_MESS_MAX, LINK_MESS_MIN, LINK_REPLY_MIN, SPICE_MAGIC,
    SPICE_VERSION_MAJOR, TICKET_LEN, channel, msg_client, msg_server,
};
use spice_ebpf_common::wire::{self, HeaderKind, PUB_KEY_LEN, SplitMix64 as Rng};

// ---------------------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------------------

/// Scripted SPICE peer for kernel-path tests of spice-observer.
#[derive(Debug, Parser)]
#[command(name = "spice-peer", about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Accept one connection and play spice-server.
    Server(ServerArgs),
    /// Connect and play spice-gtk.
    Client(ClientArgs),
}

/// Which syscall writes the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum SendSyscall {
    Write,
    Writev,
    Sendmsg,
    Sendto,
}

/// Which syscall reads the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum RecvSyscall {
    Read,
    Readv,
    Recvmsg,
    Recvfrom,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum HeaderArg {
    /// Advertise MINI_HEADER (the header is mini iff the peer does too).
    Mini,
    /// Do not advertise MINI_HEADER: 18-byte full headers.
    Full,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum AckCadence {
    /// spice-gtk: the SET_ACK is not counted; ACK after every W later messages.
    Gtk,
    /// spice-html5: the SET_ACK counts; the first ACK comes after W-1 later messages.
    Html5,
}

fn parse_u32(s: &str) -> Result<u32, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u32::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|e| format!("{s:?}: {e}"))
}

/// Options shared by both sides: syscalls, write pattern, caps, non-SPICE modes.
#[derive(Clone, Debug, Args)]
struct Common {
    /// Syscall for every write of this side.
    #[arg(long, value_enum, default_value_t = SendSyscall::Write)]
    send_syscall: SendSyscall,
    /// Syscall for every read of this side.
    #[arg(long, value_enum, default_value_t = RecvSyscall::Read)]
    recv_syscall: RecvSyscall,
    /// Bytes asked for per read call (upper bound with --recv-exact).
    #[arg(long, default_value_t = 65536)]
    recv_size: usize,
    /// Iovecs per readv/recvmsg call (the buffer split evenly).
    #[arg(long, default_value_t = 1)]
    recv_iovs: usize,
    /// Read exactly the missing bytes of the current element (header, then body), like
    /// spice-server's receive path (§4.6), instead of --recv-size at a time.
    #[arg(long)]
    recv_exact: bool,
    /// Sleep this long before each read call (a slow reader, to fill the peer's send buffer).
    #[arg(long, default_value_t = 0)]
    recv_pause_ms: u64,
    /// Write each data header in two calls: the first --split-at bytes, then the rest (with
    /// the start of the body).
    #[arg(long)]
    split_header: bool,
    /// Where --split-header and --iov-split cut the header (1 ≤ N < header length).
    #[arg(long, default_value_t = 3)]
    split_at: usize,
    /// Whole messages per write call (1..=300).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// writev/sendmsg only: the header itself split across two iovecs.
    #[arg(long)]
    iov_split: bool,
    /// Header kind this side advertises (MINI_HEADER cap bit); ignored with --common-caps.
    #[arg(long, value_enum, default_value_t = HeaderArg::Mini)]
    header: HeaderArg,
    /// Write bodies in calls of at most B bytes (the first chunk goes with the header).
    #[arg(long)]
    chunk: Option<usize>,
    /// Sleep this long between write calls.
    #[arg(long, default_value_t = 0)]
    pause_ms: u64,
    /// Non-blocking socket: EAGAIN is counted, then poll() and the same call is retried
    /// (spice-server's write path, §4.2).
    #[arg(long)]
    nonblock: bool,
    /// SO_SNDBUF in bytes (small values provoke partial writes and EAGAIN).
    #[arg(long)]
    sndbuf: Option<u32>,
    /// SO_RCVBUF in bytes.
    #[arg(long)]
    rcvbuf: Option<u32>,
    /// First common-caps word this side sends (overrides the defaults and --header, --sasl).
    #[arg(long, value_parser = parse_u32)]
    common_caps: Option<u32>,
    /// Send num_common_caps = 0 (no auth selection, full headers).
    #[arg(long, conflicts_with = "common_caps")]
    no_common_caps: bool,
    /// Channel-cap words this side sends, comma-separated (default: client none, server the
    /// spice-server set for the channel type).
    #[arg(long, value_delimiter = ',', value_parser = parse_u32)]
    channel_caps: Option<Vec<u32>>,
    /// Send random bytes instead of this side's link message / reply.
    #[arg(long)]
    garbage: bool,
    /// Bytes of --garbage.
    #[arg(long, default_value_t = 64)]
    garbage_len: usize,
    /// Start with a TLS ClientHello-like (server: ServerHello-like) record instead of REDQ.
    #[arg(long)]
    tls_bytes: bool,
    /// SASL: the client advertises AUTH_SASL and picks mechanism 2; the server advertises
    /// AUTH_SASL, sends a zero public key and accepts SASL. After the handshake all data goes
    /// in 4-byte big-endian length-prefixed blobs (§1.6).
    #[arg(long)]
    sasl: bool,
    /// PRNG seed for --garbage and --tls-bytes.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Give up (exit 1) when a read, write, connect or accept waits longer than this.
    #[arg(long, default_value_t = 30000)]
    timeout_ms: u64,
}

#[derive(Clone, Debug, Args)]
struct ServerArgs {
    /// Address to listen on (port 0: any free port; the actual one is printed).
    #[arg(long)]
    listen: String,
    /// Data messages to stream after SET_ACK / MAIN_INIT.
    #[arg(long, default_value_t = 10)]
    messages: u64,
    /// Body bytes of each streamed message (0 allowed).
    #[arg(long, default_value_t = 64)]
    body_size: u32,
    /// Message type of the streamed messages (default DRAW_COPY).
    #[arg(long, default_value_t = 304)]
    msg_type: u16,
    /// Byte that fills the bodies.
    #[arg(long, value_parser = parse_u32, default_value = "0xA5")]
    body_fill: u32,
    /// Start with SET_ACK(--generation, --window) and obey the ACK gate (§3.4).
    #[arg(long)]
    set_ack: bool,
    /// ACK window W (needs --set-ack; default 20).
    #[arg(long)]
    window: Option<u32>,
    /// SET_ACK generation.
    #[arg(long, default_value_t = 1)]
    generation: u32,
    /// Send SET_ACK but ignore ACKs (no gate).
    #[arg(long)]
    ignore_acks: bool,
    /// Send a second SET_ACK after this many streamed messages (needs --set-ack): a new
    /// generation, as send_set_ack would start it (count reset to 1, §3.5).
    #[arg(long)]
    second_set_ack_after: Option<u64>,
    /// Generation of the second SET_ACK (default --generation + 1).
    #[arg(long)]
    second_generation: Option<u32>,
    /// Window of the second SET_ACK (default: the first one's).
    #[arg(long)]
    second_window: Option<u32>,
    /// Sleep this long before the second SET_ACK (lets the ACKs in flight arrive first).
    #[arg(long, default_value_t = 0)]
    second_set_ack_delay_ms: u64,
    /// Sleep this long before each streamed message is started, i.e. before it is counted and
    /// written (a slowly drawing guest). Unlike --pause-ms, nothing is counted during the sleep.
    #[arg(long, default_value_t = 0)]
    interval_ms: u64,
    /// Stop streaming (and finish normally) after waiting this long for an ACK.
    #[arg(long, default_value_t = 5000)]
    stall_timeout_ms: u64,
    /// Send main INIT with this session_id before the streamed messages.
    #[arg(long, value_parser = parse_u32)]
    main_init: Option<u32>,
    /// Refuse the link: an error reply with this SpiceLinkErr code, then close.
    #[arg(long, value_parser = parse_u32)]
    link_error: Option<u32>,
    /// Link result sent after the ticket (non-zero: close afterwards).
    #[arg(long, value_parser = parse_u32, default_value = "0")]
    result: u32,
    /// OK reply, then an error reply with this code where the result belongs (§1.7).
    #[arg(long, value_parser = parse_u32)]
    error_after_reply: Option<u32>,
    /// Write the link reply and its caps in one call (default: spice-server's pattern, reply
    /// in one write and each cap word in its own 4-byte write).
    #[arg(long)]
    link_one_write: bool,
    #[command(flatten)]
    common: Common,
}

#[derive(Clone, Debug, Args)]
struct ClientArgs {
    /// Server address.
    #[arg(long)]
    connect: String,
    /// Channel type (1 main, 2 display, 3 inputs, 4 cursor, ...).
    #[arg(long, default_value_t = 2)]
    channel_type: u8,
    /// Channel id.
    #[arg(long, default_value_t = 0)]
    channel_id: u8,
    /// connection_id of the link message.
    #[arg(long, value_parser = parse_u32, default_value = "0")]
    connection_id: u32,
    /// caps_offset of the link message (≥ 18; zero padding after the fixed fields).
    #[arg(long, default_value_t = 18)]
    caps_offset: u32,
    /// Link header major version (spice-server accepts only 2).
    #[arg(long, default_value_t = 2)]
    major: u32,
    /// Auth mechanism word (default 1, or 2 with --sasl); only sent with AUTH_SELECTION.
    #[arg(long, value_parser = parse_u32)]
    auth_mechanism: Option<u32>,
    /// Send a WebSocket upgrade request ("GET ...") instead of the link message.
    #[arg(long)]
    websocket: bool,
    /// How ACKs are counted.
    #[arg(long, value_enum, default_value_t = AckCadence::Gtk)]
    ack_cadence: AckCadence,
    /// Never send ACK_SYNC or ACK.
    #[arg(long)]
    no_acks: bool,
    /// Sleep this long before each ACK.
    #[arg(long, default_value_t = 0)]
    ack_delay_ms: u64,
    /// Once, after this many messages following the last SET_ACK, send one ACK more than the
    /// cadence asks for (a surplus ACK when fewer than W messages are in flight, §3.5).
    #[arg(long)]
    surplus_ack_after: Option<u64>,
    /// Client messages to send after the link (from a second thread, while reading).
    #[arg(long, default_value_t = 0)]
    messages: u64,
    /// Body bytes of each client message.
    #[arg(long, default_value_t = 14)]
    body_size: u32,
    /// Type of the client messages (default 101: display INIT).
    #[arg(long, default_value_t = 101)]
    msg_type: u16,
    #[command(flatten)]
    common: Common,
}

impl Common {
    fn validate(&self) -> Result<(), String> {
        let multi_iov = matches!(
            self.send_syscall,
            SendSyscall::Writev | SendSyscall::Sendmsg
        );
        if self.iov_split && !multi_iov {
            return Err("--iov-split needs --send-syscall writev or sendmsg".into());
        }
        if self.batch == 0 || self.batch > 300 {
            return Err("--batch must be 1..=300".into());
        }
        if self.batch > 1 && (self.split_header || self.chunk.is_some()) {
            return Err("--batch cannot be combined with --split-header or --chunk".into());
        }
        if self.chunk == Some(0) {
            return Err("--chunk must be at least 1".into());
        }
        if self.split_at == 0 || self.split_at >= 18 {
            return Err("--split-at must be 1..=17 (and below the header length)".into());
        }
        if self.recv_size == 0 || self.recv_iovs == 0 {
            return Err("--recv-size and --recv-iovs must be at least 1".into());
        }
        if self.recv_iovs > 1
            && !matches!(self.recv_syscall, RecvSyscall::Readv | RecvSyscall::Recvmsg)
        {
            return Err("--recv-iovs > 1 needs --recv-syscall readv or recvmsg".into());
        }
        if [self.garbage, self.tls_bytes, self.sasl]
            .iter()
            .filter(|b| **b)
            .count()
            > 1
        {
            return Err("--garbage, --tls-bytes and --sasl are exclusive".into());
        }
        Ok(())
    }

    fn pattern_json(&self) -> Value {
        json!({
            "send_syscall": format!("{:?}", self.send_syscall).to_lowercase(),
            "recv_syscall": format!("{:?}", self.recv_syscall).to_lowercase(),
            "split_header": self.split_header,
            "split_at": self.split_at,
            "batch": self.batch,
            "iov_split": self.iov_split,
            "chunk": self.chunk,
            "pause_ms": self.pause_ms,
            "nonblock": self.nonblock,
            "sndbuf": self.sndbuf,
            "rcvbuf": self.rcvbuf,
            "recv_size": self.recv_size,
            "recv_iovs": self.recv_iovs,
            "recv_exact": self.recv_exact,
            "recv_pause_ms": self.recv_pause_ms,
        })
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}

// ---------------------------------------------------------------------------------------------
// Raw syscalls (libc on the socket fd, so the exact syscall is issued)
// ---------------------------------------------------------------------------------------------

fn iovecs(segs: &[&[u8]]) -> Vec<libc::iovec> {
    segs.iter()
        .map(|s| libc::iovec {
            iov_base: s.as_ptr() as *mut libc::c_void,
            iov_len: s.len(),
        })
        .collect()
}

/// One send call of `segs` (write/sendto get them concatenated into one buffer).
fn sys_send(fd: RawFd, how: SendSyscall, segs: &[&[u8]]) -> io::Result<usize> {
    let r = match how {
        SendSyscall::Write | SendSyscall::Sendto => {
            let joined;
            let buf: &[u8] = if segs.len() == 1 {
                segs[0]
            } else {
                joined = segs.concat();
                &joined
            };
            // SAFETY: `buf` is a valid readable slice for the duration of the call.
            unsafe {
                if how == SendSyscall::Write {
                    libc::write(fd, buf.as_ptr().cast(), buf.len())
                } else {
                    libc::sendto(
                        fd,
                        buf.as_ptr().cast(),
                        buf.len(),
                        libc::MSG_NOSIGNAL,
                        std::ptr::null(),
                        0,
                    )
                }
            }
        }
        SendSyscall::Writev => {
            let iov = iovecs(segs);
            // SAFETY: every iovec points into a live slice of `segs`.
            unsafe { libc::writev(fd, iov.as_ptr(), iov.len() as libc::c_int) }
        }
        SendSyscall::Sendmsg => {
            let mut iov = iovecs(segs);
            // SAFETY: a zeroed msghdr is valid (no name, no control); iov outlives the call.
            unsafe {
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = iov.as_mut_ptr();
                msg.msg_iovlen = iov.len() as _;
                libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL)
            }
        }
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// Sizes of `iovs` near-equal parts of a `len`-byte buffer (no empty parts).
fn iov_sizes(len: usize, iovs: usize) -> Vec<usize> {
    let n = iovs.min(len).max(1);
    (0..n).map(|i| len / n + usize::from(i < len % n)).collect()
}

/// One receive call into `buf` (readv/recvmsg split it into `iovs` parts).
fn sys_recv(fd: RawFd, how: RecvSyscall, buf: &mut [u8], iovs: usize) -> io::Result<usize> {
    // SAFETY: all pointers come from `buf`, which is valid and writable for its length.
    let r = unsafe {
        match how {
            RecvSyscall::Read => libc::read(fd, buf.as_mut_ptr().cast(), buf.len()),
            RecvSyscall::Recvfrom => libc::recvfrom(
                fd,
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            ),
            RecvSyscall::Readv | RecvSyscall::Recvmsg => {
                let mut iov = Vec::new();
                let mut off = 0;
                for sz in iov_sizes(buf.len(), iovs) {
                    iov.push(libc::iovec {
                        iov_base: buf.as_mut_ptr().add(off).cast(),
                        iov_len: sz,
                    });
                    off += sz;
                }
                if how == RecvSyscall::Readv {
                    libc::readv(fd, iov.as_ptr(), iov.len() as libc::c_int)
                } else {
                    let mut msg: libc::msghdr = std::mem::zeroed();
                    msg.msg_iov = iov.as_mut_ptr();
                    msg.msg_iovlen = iov.len() as _;
                    libc::recvmsg(fd, &mut msg, 0)
                }
            }
        }
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// poll() one fd; Ok(false) on timeout.
fn wait_fd(fd: RawFd, events: libc::c_short, timeout: Duration) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    loop {
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(r > 0);
    }
}

fn set_int_opt(fd: RawFd, level: libc::c_int, name: libc::c_int, v: u32) -> io::Result<()> {
    let v = v as libc::c_int;
    // SAFETY: pointer to a live c_int of the given size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as _,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn timed_out(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, format!("timed out {what}"))
}

fn proto_err(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

// ---------------------------------------------------------------------------------------------
// The framing code's view of this socket (what the kernel should see)
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    C2S,
    S2C,
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::C2S => "c2s",
            Dir::S2C => "s2c",
        }
    }
}

#[derive(Default, Debug)]
struct FrameTally {
    bytes: u64,
    calls: u64,
    messages: u64,
    by_type: BTreeMap<u16, u64>,
    already_reported: u64,
    peeked: u64,
    /// The last message `peek` reported, until the real write completes it.
    last_peek: Option<MessageInfo>,
    /// Real messages flagged `already_reported` that differ from what `peek` reported (or
    /// were never peeked): the kernel would have reported a wrong message.
    peek_mismatched: u64,
    link: Option<LinkInfo>,
    unparsed: Option<(UnparsedReason, u32, u64)>,
    /// (type, prefix) of messages with a non-zero prefix, the first 32.
    prefixes: Vec<(u16, [u32; 2])>,
}

impl FrameTally {
    fn take(&mut self, o: Output) {
        match o {
            Output::None => {}
            Output::Link(l) => self.link = Some(l),
            Output::Message(m) => {
                self.messages += 1;
                *self.by_type.entry(m.msg_type).or_default() += 1;
                if m.already_reported {
                    self.already_reported += 1;
                    let peeked = self.last_peek.take().map(|p| MessageInfo {
                        already_reported: true,
                        ..p
                    });
                    if peeked != Some(m) {
                        self.peek_mismatched += 1;
                    }
                }
                if m.prefix != [0, 0] && self.prefixes.len() < 32 {
                    self.prefixes.push((m.msg_type, m.prefix));
                }
            }
            Output::Unparsed { reason, detail, at } => self.unparsed = Some((reason, detail, at)),
        }
    }

    fn json(&self) -> Value {
        json!({
            "bytes": self.bytes,
            "calls": self.calls,
            "messages": self.messages,
            "by_type": by_type_json(&self.by_type),
            "already_reported": self.already_reported,
            "peeked": self.peeked,
            "peek_mismatched": self.peek_mismatched,
            "link": self.link.map(|l| json!({
                "role": l.role, "link_size": l.link_size, "connection_id": l.connection_id,
                "channel_type": l.channel_type, "channel_id": l.channel_id, "common_caps": l.common_caps,
            })),
            "unparsed": self.unparsed.map(|(r, d, at)| json!({"reason": r.name(), "detail": d, "at": at})),
            "prefixes": self.prefixes.iter().map(|(t, p)| json!([t, p[0], p[1]])).collect::<Vec<_>>(),
        })
    }
}

/// Both directions' `DirState`, fed with the bytes of each call in the order calls returned.
#[derive(Default)]
struct Observe {
    c2s: DirState,
    s2c: DirState,
    t: [FrameTally; 2],
}

impl Observe {
    fn parts(&mut self, dir: Dir) -> (&mut DirState, &DirState, &mut FrameTally) {
        match dir {
            Dir::C2S => (&mut self.c2s, &self.s2c, &mut self.t[0]),
            Dir::S2C => (&mut self.s2c, &self.c2s, &mut self.t[1]),
        }
    }

    fn feed(&mut self, dir: Dir, segs: &[&[u8]]) {
        let (st, other, tally) = self.parts(dir);
        let peer = other.view();
        tally.calls += 1;
        tally.bytes += segs.iter().map(|s| s.len() as u64).sum::<u64>();
        framing::feed(st, &peer, segs, |o| tally.take(o));
    }

    /// A send call that moved nothing (EAGAIN): the kernel's `peek` of its first bytes.
    fn peek(&mut self, dir: Dir, segs: &[&[u8]]) {
        let (st, other, tally) = self.parts(dir);
        let peer = other.view();
        let mut first = [0u8; BUF_LEN];
        let mut n = 0;
        for s in segs {
            let k = s.len().min(BUF_LEN - n);
            first[n..n + k].copy_from_slice(&s[..k]);
            n += k;
        }
        if let Some(m) = st.peek(&first, n as u32, &peer) {
            tally.peeked += 1;
            tally.last_peek = Some(m);
        }
    }

    fn json(&self) -> Value {
        json!({"c2s": self.t[0].json(), "s2c": self.t[1].json()})
    }
}

fn by_type_json(m: &BTreeMap<u16, u64>) -> Value {
    Value::Object(m.iter().map(|(k, v)| (k.to_string(), json!(v))).collect())
}

// ---------------------------------------------------------------------------------------------
// Sending
// ---------------------------------------------------------------------------------------------

/// How data messages are cut into calls.
#[derive(Clone, Copy, Debug)]
struct Pattern {
    split_header: bool,
    iov_split: bool,
    split_at: usize,
    chunk: Option<usize>,
}

/// This side's writer: issues the calls and accounts for what they moved.
struct Tx {
    fd: RawFd,
    how: SendSyscall,
    dir: Dir,
    nonblock: bool,
    pause: Duration,
    timeout: Duration,
    obs: Arc<Mutex<Observe>>,
    /// Wrap every call in a SASL-shaped blob (4-byte big-endian length + payload).
    sasl_wrap: bool,
    kind: HeaderKind,
    next_serial: u64,
    /// Raw bytes the send calls returned.
    bytes: u64,
    /// Plain (pre-wrapping) stream bytes fully sent.
    plain: u64,
    /// Plain stream offset after everything planned so far.
    planned: u64,
    /// (plain end offset, type) of planned messages not yet fully sent.
    pending: VecDeque<(u64, u16)>,
    calls: u64,
    eagain: u64,
    short_writes: u64,
    link_bytes: Option<u64>,
    messages: u64,
    by_type: BTreeMap<u16, u64>,
}

impl Tx {
    fn new(fd: RawFd, dir: Dir, c: &Common, obs: Arc<Mutex<Observe>>) -> Tx {
        Tx {
            fd,
            how: c.send_syscall,
            dir,
            nonblock: c.nonblock,
            pause: Duration::from_millis(c.pause_ms),
            timeout: c.timeout(),
            obs,
            sasl_wrap: false,
            kind: HeaderKind::Mini,
            next_serial: 1,
            bytes: 0,
            plain: 0,
            planned: 0,
            pending: VecDeque::new(),
            calls: 0,
            eagain: 0,
            short_writes: 0,
            link_bytes: None,
            messages: 0,
            by_type: BTreeMap::new(),
        }
    }

    /// One logical write of `segs`: one syscall, repeated on the remainder after a short write
    /// and after EAGAIN (non-blocking mode: poll first, then the same call again).
    fn call(&mut self, segs: &[&[u8]]) -> io::Result<()> {
        let plain_len: usize = segs.iter().map(|s| s.len()).sum();
        if plain_len == 0 {
            return Ok(());
        }
        let len_prefix = (plain_len as u32).to_be_bytes();
        let mut all: Vec<&[u8]> = Vec::with_capacity(segs.len() + 1);
        let overhead = if self.sasl_wrap {
            all.push(&len_prefix);
            4
        } else {
            0
        };
        all.extend_from_slice(segs);
        let total = plain_len + overhead;
        let plain_base = self.plain;
        let mut done = 0usize;
        while done < total {
            if self.calls > 0 && !self.pause.is_zero() {
                thread::sleep(self.pause);
            }
            let rem = skip_segments(&all, done);
            let r = sys_send(self.fd, self.how, &rem);
            self.calls += 1;
            match r {
                Ok(n) => {
                    let want: usize = rem.iter().map(|s| s.len()).sum();
                    if n < want {
                        self.short_writes += 1;
                    }
                    self.bytes += n as u64;
                    let moved = take_segments(&rem, n);
                    self.obs.lock().unwrap().feed(self.dir, &moved);
                    done += n;
                    self.plain = plain_base + done.saturating_sub(overhead) as u64;
                    while let Some(&(end, t)) = self.pending.front() {
                        if end > self.plain {
                            break;
                        }
                        self.pending.pop_front();
                        self.messages += 1;
                        *self.by_type.entry(t).or_default() += 1;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if !self.nonblock {
                        return Err(timed_out("writing"));
                    }
                    self.eagain += 1;
                    self.obs.lock().unwrap().peek(self.dir, &rem);
                    if !wait_fd(self.fd, libc::POLLOUT, self.timeout)? {
                        return Err(timed_out("waiting for POLLOUT"));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Link-phase bytes (no message accounting) in one call.
    fn link_call(&mut self, segs: &[&[u8]]) -> io::Result<()> {
        self.planned += segs.iter().map(|s| s.len() as u64).sum::<u64>();
        self.call(segs)
    }

    /// Marks the end of the link phase for this direction.
    fn start_data(&mut self, kind: HeaderKind) {
        self.kind = kind;
        self.link_bytes = Some(self.bytes);
    }

    fn next_header(&mut self, msg_type: u16, body_len: usize) -> Vec<u8> {
        let h = wire::header(self.kind, self.next_serial, msg_type, body_len as u32);
        self.next_serial += 1;
        self.planned += (h.len() + body_len) as u64;
        self.pending.push_back((self.planned, msg_type));
        h
    }

    /// Sends `msgs` (one call for a batch of several; the split options for a single one).
    fn send_messages(&mut self, msgs: &[(u16, &[u8])], p: &Pattern) -> io::Result<()> {
        let hl = self.kind.header_len();
        if p.split_at >= hl && (p.split_header || p.iov_split) {
            return Err(proto_err(format!(
                "--split-at {} is not inside a {hl}-byte header",
                p.split_at
            )));
        }
        let k = p.split_at;
        if msgs.len() > 1 {
            let hdrs: Vec<Vec<u8>> = msgs
                .iter()
                .map(|(t, b)| self.next_header(*t, b.len()))
                .collect();
            let mut segs: Vec<&[u8]> = Vec::new();
            for (h, (_, b)) in hdrs.iter().zip(msgs) {
                if p.iov_split {
                    segs.extend([&h[..k], &h[k..]]);
                } else {
                    segs.push(h);
                }
                if !b.is_empty() {
                    segs.push(b);
                }
            }
            return self.call(&segs);
        }
        for (t, body) in msgs {
            let h = self.next_header(*t, body.len());
            let chunks: Vec<&[u8]> = match p.chunk {
                Some(c) => body.chunks(c).collect(),
                None if body.is_empty() => Vec::new(),
                None => vec![body],
            };
            let mut first: Vec<&[u8]> = Vec::new();
            if p.split_header {
                self.call(&[&h[..k]])?;
                first.push(&h[k..]);
            } else if p.iov_split {
                first.extend([&h[..k], &h[k..]]);
            } else {
                first.push(&h);
            }
            if let Some(c0) = chunks.first() {
                first.push(c0);
            }
            self.call(&first)?;
            for c in chunks.iter().skip(1) {
                self.call(&[c])?;
            }
        }
        Ok(())
    }

    fn json(&self) -> Value {
        let link = self.link_bytes.unwrap_or(self.bytes);
        json!({
            "direction": self.dir.name(),
            "bytes": self.bytes,
            "link_bytes": link,
            "data_bytes": self.bytes - link,
            "messages": self.messages,
            "by_type": by_type_json(&self.by_type),
            "unfinished_messages": self.pending.len(),
            "calls": self.calls,
            "eagain": self.eagain,
            "short_writes": self.short_writes,
        })
    }
}

/// `segs` without its first `skip` bytes.
fn skip_segments<'a>(segs: &[&'a [u8]], mut skip: usize) -> Vec<&'a [u8]> {
    let mut out = Vec::with_capacity(segs.len());
    for s in segs {
        if skip >= s.len() {
            skip -= s.len();
        } else {
            out.push(&s[skip..]);
            skip = 0;
        }
    }
    out
}

/// The first `n` bytes of `segs`.
fn take_segments<'a>(segs: &[&'a [u8]], mut n: usize) -> Vec<&'a [u8]> {
    let mut out = Vec::with_capacity(segs.len());
    for s in segs {
        if n == 0 {
            break;
        }
        let k = s.len().min(n);
        out.push(&s[..k]);
        n -= k;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Receiving
// ---------------------------------------------------------------------------------------------

/// One parsed data message.
#[derive(Clone, Copy, Debug)]
struct Msg {
    msg_type: u16,
    size: u32,
    /// First 8 body bytes (zero-padded).
    prefix: [u8; 8],
}

impl Msg {
    fn word(&self, i: usize) -> u32 {
        u32::from_le_bytes(self.prefix[i * 4..i * 4 + 4].try_into().unwrap())
    }
}

/// This side's reader: issues the read calls, buffers, and parses.
struct Rx {
    fd: RawFd,
    how: RecvSyscall,
    dir: Dir,
    size: usize,
    iovs: usize,
    exact: bool,
    nonblock: bool,
    pause: Duration,
    timeout: Duration,
    obs: Arc<Mutex<Observe>>,
    buf: Vec<u8>,
    rpos: usize,
    /// Unwrap SASL-shaped blobs in the data phase.
    sasl: bool,
    plain: Vec<u8>,
    ppos: usize,
    bytes: u64,
    consumed: u64,
    calls: u64,
    eagain: u64,
    eof: bool,
    link_bytes: Option<u64>,
    messages: u64,
    by_type: BTreeMap<u16, u64>,
}

impl Rx {
    fn new(fd: RawFd, dir: Dir, c: &Common, obs: Arc<Mutex<Observe>>) -> Rx {
        Rx {
            fd,
            how: c.recv_syscall,
            dir,
            size: c.recv_size,
            iovs: c.recv_iovs,
            exact: c.recv_exact,
            nonblock: c.nonblock,
            pause: Duration::from_millis(c.recv_pause_ms),
            timeout: c.timeout(),
            obs,
            buf: Vec::new(),
            rpos: 0,
            sasl: false,
            plain: Vec::new(),
            ppos: 0,
            bytes: 0,
            consumed: 0,
            calls: 0,
            eagain: 0,
            eof: false,
            link_bytes: None,
            messages: 0,
            by_type: BTreeMap::new(),
        }
    }

    fn avail(&self) -> usize {
        self.buf.len() - self.rpos
    }

    /// One read call (repeated only on EINTR / EAGAIN); returns the bytes it moved, 0 at EOF.
    fn fill(&mut self, want: usize) -> io::Result<usize> {
        if self.eof {
            return Ok(0);
        }
        let req = if self.exact {
            want.clamp(1, self.size)
        } else {
            self.size
        };
        if self.rpos == self.buf.len() {
            self.buf.clear();
            self.rpos = 0;
        } else if self.rpos > (1 << 20) {
            self.buf.drain(..self.rpos);
            self.rpos = 0;
        }
        let old = self.buf.len();
        self.buf.resize(old + req, 0);
        if !self.pause.is_zero() {
            thread::sleep(self.pause);
        }
        loop {
            let r = sys_recv(self.fd, self.how, &mut self.buf[old..], self.iovs);
            self.calls += 1;
            match r {
                Ok(n) => {
                    self.buf.truncate(old + n);
                    self.bytes += n as u64;
                    if n == 0 {
                        self.eof = true;
                    } else {
                        // Feed as the iovecs the kernel filled.
                        let data = &self.buf[old..old + n];
                        let mut segs = Vec::new();
                        let mut off = 0;
                        for sz in iov_sizes(req, self.iovs) {
                            if off >= n {
                                break;
                            }
                            let k = sz.min(n - off);
                            segs.push(&data[off..off + k]);
                            off += k;
                        }
                        self.obs.lock().unwrap().feed(self.dir, &segs);
                    }
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if !self.nonblock || !wait_fd(self.fd, libc::POLLIN, self.timeout)? {
                        self.buf.truncate(old);
                        return Err(timed_out("reading"));
                    }
                    self.eagain += 1;
                }
                Err(e) => {
                    self.buf.truncate(old);
                    return Err(e);
                }
            }
        }
    }

    /// Exactly `n` raw bytes (link phase, SASL blobs).
    fn take_raw(&mut self, n: usize) -> io::Result<Vec<u8>> {
        while self.avail() < n {
            if self.fill(n - self.avail())? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("peer closed, {n} bytes expected"),
                ));
            }
        }
        let v = self.buf[self.rpos..self.rpos + n].to_vec();
        self.rpos += n;
        self.consumed += n as u64;
        Ok(v)
    }

    fn u32_raw(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.take_raw(4)?.try_into().unwrap()))
    }

    /// Reads and discards until EOF.
    fn drain(&mut self) -> io::Result<()> {
        loop {
            self.consumed += self.avail() as u64;
            self.rpos = self.buf.len();
            if self.fill(self.size)? == 0 {
                return Ok(());
            }
        }
    }

    fn start_data(&mut self) {
        self.link_bytes = Some(self.consumed);
    }

    fn data(&self) -> &[u8] {
        if self.sasl {
            &self.plain[self.ppos..]
        } else {
            &self.buf[self.rpos..]
        }
    }

    fn advance(&mut self, n: usize) {
        if self.sasl {
            self.ppos += n;
        } else {
            self.rpos += n;
            self.consumed += n as u64;
        }
    }

    /// Makes more data bytes available; Ok(false) at EOF.
    fn data_fill(&mut self, want: usize) -> io::Result<bool> {
        if !self.sasl {
            return Ok(self.fill(want)? > 0);
        }
        if self.avail() == 0 && self.fill(4)? == 0 {
            return Ok(false);
        }
        let len = u32::from_be_bytes(self.take_raw(4)?.try_into().unwrap()) as usize;
        let blob = self.take_raw(len)?;
        if self.ppos == self.plain.len() {
            self.plain.clear();
            self.ppos = 0;
        }
        self.plain.extend_from_slice(&blob);
        Ok(true)
    }

    /// The next data message; None on EOF at a message boundary.
    fn read_message(&mut self, kind: HeaderKind) -> io::Result<Option<Msg>> {
        let hl = kind.header_len();
        let mut hdr = Vec::with_capacity(hl);
        while hdr.len() < hl {
            if self.data().is_empty() {
                if !self.data_fill(hl - hdr.len())? {
                    if hdr.is_empty() {
                        return Ok(None);
                    }
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "peer closed inside a header",
                    ));
                }
                continue;
            }
            let k = self.data().len().min(hl - hdr.len());
            hdr.extend_from_slice(&self.data()[..k]);
            self.advance(k);
        }
        let (msg_type, size) = match kind {
            HeaderKind::Mini => (
                u16::from_le_bytes([hdr[0], hdr[1]]),
                u32::from_le_bytes(hdr[2..6].try_into().unwrap()),
            ),
            HeaderKind::Full => (
                u16::from_le_bytes([hdr[8], hdr[9]]),
                u32::from_le_bytes(hdr[10..14].try_into().unwrap()),
            ),
        };
        if msg_type == 0 {
            return Err(proto_err("data header with type 0"));
        }
        let mut prefix = [0u8; 8];
        let mut got = 0usize;
        let mut remaining = size as usize;
        while remaining > 0 {
            if self.data().is_empty() {
                if !self.data_fill(remaining)? {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "peer closed inside a body",
                    ));
                }
                continue;
            }
            let k = self.data().len().min(remaining);
            if got < 8 {
                let c = k.min(8 - got);
                prefix[got..got + c].copy_from_slice(&self.data()[..c]);
            }
            self.advance(k);
            got += k;
            remaining -= k;
        }
        self.messages += 1;
        *self.by_type.entry(msg_type).or_default() += 1;
        Ok(Some(Msg {
            msg_type,
            size,
            prefix,
        }))
    }

    fn json(&self) -> Value {
        let link = self.link_bytes.unwrap_or(self.bytes);
        json!({
            "direction": self.dir.name(),
            "bytes": self.bytes,
            "link_bytes": link,
            "data_bytes": self.bytes.saturating_sub(link),
            "messages": self.messages,
            "by_type": by_type_json(&self.by_type),
            "calls": self.calls,
            "eagain": self.eagain,
            "eof": self.eof,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Shared pieces of both scripts
// ---------------------------------------------------------------------------------------------

/// Random bytes that do not start like REDQ, TLS, "GET " or "HTTP".
fn garbage(seed: u64, n: usize) -> Vec<u8> {
    let mut v = Rng(seed).bytes(n.max(1));
    if matches!(v[0], b'R' | b'G' | b'H' | 0x16) {
        v[0] ^= 0x80;
    }
    v
}

/// A TLS 1.2-style handshake record: ClientHello (type 1) or ServerHello (type 2).
fn tls_record(seed: u64, hello_type: u8) -> Vec<u8> {
    let mut body = vec![0x03, 0x03];
    body.extend(Rng(seed).bytes(32));
    if hello_type == 1 {
        body.extend([0x00, 0x00, 0x02, 0x13, 0x01, 0x01, 0x00, 0x00, 0x00]);
    } else {
        body.extend([0x00, 0x13, 0x01, 0x00, 0x00, 0x00]);
    }
    let mut hs = vec![hello_type, 0, (body.len() >> 8) as u8, body.len() as u8];
    hs.extend(body);
    let mut rec = vec![
        0x16,
        0x03,
        if hello_type == 1 { 0x01 } else { 0x03 },
        (hs.len() >> 8) as u8,
        hs.len() as u8,
    ];
    rec.extend(hs);
    rec
}

const WEBSOCKET_GET: &[u8] = b"GET / HTTP/1.1\r\nHost: spice\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: binary\r\n\r\n";

fn le32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}

/// This side's first common-caps words.
fn own_common_caps(c: &Common, default: u32) -> Vec<u32> {
    if c.no_common_caps {
        return vec![];
    }
    if let Some(w) = c.common_caps {
        return vec![w];
    }
    let mut w = default;
    if c.sasl {
        w = (w & !CAP_AUTH_SPICE) | CAP_AUTH_SASL;
    }
    if c.header == HeaderArg::Full {
        w &= !CAP_MINI_HEADER;
    }
    vec![w]
}

/// spice-server's channel caps per channel type (§1.3).
fn server_default_channel_caps(channel_type: u8) -> Vec<u32> {
    match channel_type {
        channel::MAIN => vec![0x0F],
        channel::DISPLAY => vec![(1 << 1) | (1 << 4) | (1 << 6) | (1 << 12)],
        channel::INPUTS => vec![0x01],
        channel::PLAYBACK => vec![(1 << 1) | (1 << 3)],
        channel::RECORD => vec![(1 << 1) | (1 << 2)],
        _ => vec![],
    }
}

fn setup_socket(s: &TcpStream, c: &Common) -> io::Result<()> {
    s.set_nodelay(true)?;
    if let Some(b) = c.sndbuf {
        set_int_opt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDBUF, b)?;
    }
    if let Some(b) = c.rcvbuf {
        set_int_opt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUF, b)?;
    }
    if c.nonblock {
        s.set_nonblocking(true)?;
    } else {
        s.set_read_timeout(Some(c.timeout()))?;
        s.set_write_timeout(Some(c.timeout()))?;
    }
    Ok(())
}

/// What the link phase established or how it ended, for the SUMMARY.
#[derive(Default, Debug)]
struct LinkFacts {
    outcome: &'static str,
    channel_type: u8,
    channel_id: u8,
    connection_id: u32,
    client_link_size: Option<u32>,
    server_link_size: Option<u32>,
    client_common_caps: Vec<u32>,
    client_channel_caps: Vec<u32>,
    server_common_caps: Vec<u32>,
    server_channel_caps: Vec<u32>,
    auth_mechanism: Option<u32>,
    result: Option<u32>,
    refused: Option<u32>,
    error_after_reply: Option<u32>,
    peer_magic: Option<u32>,
    header: Option<HeaderKind>,
}

impl LinkFacts {
    fn json(&self) -> Value {
        json!({
            "client_link_size": self.client_link_size,
            "server_link_size": self.server_link_size,
            "client_common_caps": self.client_common_caps,
            "client_channel_caps": self.client_channel_caps,
            "server_common_caps": self.server_common_caps,
            "server_channel_caps": self.server_channel_caps,
            "auth_mechanism": self.auth_mechanism,
            "result": self.result,
            "refused": self.refused,
            "error_after_reply": self.error_after_reply,
            "peer_magic": self.peer_magic,
        })
    }
}

/// Server-side ACK accounting (§3.2–§3.5), shared with the reader thread.
#[derive(Debug, Default)]
struct AckState {
    flow: bool,
    window: u32,
    generation: u32,
    /// spice-server's messages_window: 1 after SET_ACK, +1 per message start, −W per ACK.
    count: i64,
    max_count: i64,
    /// The same count as spice-server keeps it, a `uint32_t` (wraps below 0); the gate reads
    /// this one, like `waiting_for_ack()`.
    mw: u32,
    /// Highest count since the last SET_ACK.
    max_count_generation: i64,
    set_acks: u64,
    /// Matched ACKs that found fewer than W messages counted (mw wrapped).
    ack_surplus: u64,
    client_generation: Option<u32>,
    ack_syncs: u64,
    acks: u64,
    acks_matched: u64,
    waits: u64,
    stalled_timeout: bool,
    reader_done: bool,
}

/// Client-side ACK accounting (§3.8).
#[derive(Debug, Default)]
struct ClientAcks {
    window: u32,
    generation: u32,
    counter: u32,
    ack_syncs_sent: u64,
    acks_sent: u64,
    /// Messages received since the last SET_ACK.
    since_set_ack: u64,
    /// Extra ACKs sent by --surplus-ack-after (also counted in acks_sent).
    surplus_acks_sent: u64,
}

/// The finished run: the SUMMARY object and whether the script completed.
struct Report {
    summary: Value,
    ok: bool,
}

fn mode_name(c: &Common, websocket: bool) -> &'static str {
    if c.garbage {
        "garbage"
    } else if c.tls_bytes {
        "tls"
    } else if c.sasl {
        "sasl"
    } else if websocket {
        "websocket"
    } else {
        "spice"
    }
}

#[allow(clippy::too_many_arguments)]
fn summary(
    role: &str,
    mode: &str,
    link: &LinkFacts,
    tx: &Tx,
    rx: &Rx,
    acks: Value,
    common: &Common,
    obs: &Observe,
    error: Option<String>,
) -> Report {
    let summary = json!({
        "role": role,
        "mode": mode,
        "outcome": if error.is_some() { "error" } else { link.outcome },
        "channel": {"type": link.channel_type, "id": link.channel_id, "connection_id": link.connection_id},
        "header": link.header.map(|h| h.name()),
        "link": link.json(),
        "sent": tx.json(),
        "received": rx.json(),
        "acks": acks,
        "write_pattern": common.pattern_json(),
        "framing": obs.json(),
        "error": error,
    });
    Report {
        ok: summary["error"].is_null(),
        summary,
    }
}

// ---------------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------------

fn accept_one(listener: &TcpListener, timeout: Duration) -> io::Result<TcpStream> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                return Ok(s);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || !wait_fd(listener.as_raw_fd(), libc::POLLIN, left)? {
                    return Err(timed_out("accepting"));
                }
            }
            Err(e) => return Err(e),
        }
    }
}

fn run_server(a: &ServerArgs, on_listen: &mut dyn FnMut(u16)) -> Report {
    let c = &a.common;
    let obs = Arc::new(Mutex::new(Observe::default()));
    let mut link = LinkFacts {
        outcome: "ok",
        ..Default::default()
    };
    let acks = Arc::new((Mutex::new(AckState::default()), Condvar::new()));
    let mode = mode_name(c, false);
    let listener = match TcpListener::bind(&a.listen) {
        Ok(l) => l,
        Err(e) => {
            let tx = Tx::new(-1, Dir::S2C, c, obs.clone());
            let rx = Rx::new(-1, Dir::C2S, c, obs.clone());
            return summary(
                "server",
                mode,
                &link,
                &tx,
                &rx,
                Value::Null,
                c,
                &obs.lock().unwrap(),
                Some(format!("bind: {e}")),
            );
        }
    };
    on_listen(listener.local_addr().map(|x| x.port()).unwrap_or(0));
    let stream =
        match accept_one(&listener, c.timeout()).and_then(|s| setup_socket(&s, c).map(|_| s)) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                let tx = Tx::new(-1, Dir::S2C, c, obs.clone());
                let rx = Rx::new(-1, Dir::C2S, c, obs.clone());
                return summary(
                    "server",
                    mode,
                    &link,
                    &tx,
                    &rx,
                    Value::Null,
                    c,
                    &obs.lock().unwrap(),
                    Some(format!("accept: {e}")),
                );
            }
        };
    drop(listener);
    let fd = stream.as_raw_fd();
    let tx = Arc::new(Mutex::new(Tx::new(fd, Dir::S2C, c, obs.clone())));
    let rx = Rx::new(fd, Dir::C2S, c, obs.clone());
    let (rx, res) = server_script(a, &stream, &tx, rx, &mut link, &acks);
    let err = res.err().map(|e| e.to_string());
    let _ = stream.shutdown(Shutdown::Both);
    let ack_json = {
        let s = acks.0.lock().unwrap();
        if s.window == 0 {
            Value::Null
        } else {
            json!({
                "flow_control": s.flow, "window": s.window, "generation": s.generation,
                "final_count": s.count, "max_count": s.max_count,
                "messages_window": s.mw, "max_count_generation": s.max_count_generation,
                "set_acks": s.set_acks, "ack_surplus": s.ack_surplus,
                "client_generation": s.client_generation, "ack_syncs": s.ack_syncs,
                "acks": s.acks, "acks_matched": s.acks_matched, "gate_waits": s.waits,
                "stalled_timeout": s.stalled_timeout,
            })
        }
    };
    let tx = tx.lock().unwrap();
    summary(
        "server",
        mode,
        &link,
        &tx,
        &rx,
        ack_json,
        c,
        &obs.lock().unwrap(),
        err,
    )
}

/// Ends a refused or non-SPICE session: close our side, read the peer's leftovers until EOF.
fn close_and_drain(stream: &TcpStream, rx: &mut Rx) -> io::Result<()> {
    stream.shutdown(Shutdown::Write)?;
    rx.drain()
}

fn server_script(
    a: &ServerArgs,
    stream: &TcpStream,
    tx: &Arc<Mutex<Tx>>,
    mut rx: Rx,
    link: &mut LinkFacts,
    acks: &Arc<(Mutex<AckState>, Condvar)>,
) -> (Rx, io::Result<()>) {
    match server_link(a, stream, tx, &mut rx, link) {
        Ok(true) => {}
        Ok(false) => return (rx, Ok(())),
        Err(e) => return (rx, Err(e)),
    }
    // Data phase: a reader thread for the client's messages, this thread writes.
    let kind = link.header.unwrap();
    rx.start_data();
    tx.lock().unwrap().start_data(kind);
    let mut reader = rx;
    let acks_r = acks.clone();
    let handle = thread::spawn(move || {
        let r = server_reader(&mut reader, kind, &acks_r);
        let (lock, cv) = &*acks_r;
        lock.lock().unwrap().reader_done = true;
        cv.notify_all();
        (reader, r)
    });
    let wres = server_writer(a, tx, acks);
    let shut = stream.shutdown(Shutdown::Write);
    let (reader, rres) = handle.join().expect("reader thread panicked");
    (reader, wres.and(shut).and(rres))
}

/// Both sides, after the 4-byte link result: record it; on a refusal close (the peer closes
/// too); otherwise fix the negotiated header and switch both directions to SASL framing if
/// SASL was used. Returns whether the data phase starts.
fn finish_link(
    result: u32,
    sasl: bool,
    stream: &TcpStream,
    tx: &Arc<Mutex<Tx>>,
    rx: &mut Rx,
    link: &mut LinkFacts,
) -> io::Result<bool> {
    link.result = Some(result);
    if result != 0 {
        link.outcome = "link_refused";
        link.refused = Some(result);
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    link.header = Some(HeaderKind::negotiated(
        &link.client_common_caps,
        &link.server_common_caps,
    ));
    if sasl {
        tx.lock().unwrap().sasl_wrap = true;
        rx.sasl = true;
    }
    Ok(true)
}

/// The server's link phase. Ok(true): go on to data; Ok(false): the script ended here.
fn server_link(
    a: &ServerArgs,
    stream: &TcpStream,
    tx: &Arc<Mutex<Tx>>,
    rx: &mut Rx,
    link: &mut LinkFacts,
) -> io::Result<bool> {
    let c = &a.common;
    let send = |segs: &[&[u8]]| tx.lock().unwrap().link_call(segs);
    let hdr = rx.take_raw(4)?;
    let magic = le32(&hdr, 0);
    if magic != u32::from_le_bytes(SPICE_MAGIC) {
        // spice-server's plain port: INVALID_MAGIC (it would first try WebSocket, §1.1).
        link.peer_magic = Some(magic);
        link.outcome = "client_not_spice";
        server_answer_non_spice(a, &send)?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    let hdr = [hdr, rx.take_raw(12)?].concat();
    let major = le32(&hdr, 4);
    let size = le32(&hdr, 12);
    link.client_link_size = Some(size);
    if major != SPICE_VERSION_MAJOR {
        link.outcome = "version_mismatch";
        if major != 0 {
            send(&[&wire::link_error_reply(4)])?;
        }
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    if !(LINK_MESS_MIN..=LINK_MESS_MAX).contains(&size) {
        link.outcome = "bad_link";
        send(&[&wire::link_error_reply(3)])?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    let body = rx.take_raw(size as usize)?;
    link.connection_id = le32(&body, 0);
    link.channel_type = body[4];
    link.channel_id = body[5];
    let (n_common, n_channel, caps_offset) = (le32(&body, 6), le32(&body, 10), le32(&body, 14));
    let end = caps_offset as u64 + 4 * (n_common as u64 + n_channel as u64);
    if caps_offset < LINK_MESS_MIN || n_common > 1024 || n_channel > 1024 || end > size as u64 {
        link.outcome = "bad_link";
        send(&[&wire::link_error_reply(3)])?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    let words: Vec<u32> = (0..n_common + n_channel)
        .map(|i| le32(&body, (caps_offset + 4 * i) as usize))
        .collect();
    link.client_common_caps = words[..n_common as usize].to_vec();
    link.client_channel_caps = words[n_common as usize..].to_vec();
    if c.garbage || c.tls_bytes {
        link.outcome = "server_not_spice";
        server_answer_non_spice(a, &send)?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    if let Some(code) = a.link_error {
        link.outcome = "link_refused";
        link.refused = Some(code);
        send(&[&wire::link_error_reply(code)])?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    link.server_common_caps =
        own_common_caps(c, CAP_AUTH_SELECTION | CAP_AUTH_SPICE | CAP_MINI_HEADER);
    link.server_channel_caps = c
        .channel_caps
        .clone()
        .unwrap_or_else(|| server_default_channel_caps(link.channel_type));
    let client_caps0 = link.client_common_caps.first().copied().unwrap_or(0);
    let server_caps0 = link.server_common_caps.first().copied().unwrap_or(0);
    let key = if c.sasl && client_caps0 & CAP_AUTH_SASL != 0 {
        [0u8; PUB_KEY_LEN]
    } else {
        wire::fake_pub_key()
    };
    let reply =
        wire::link_reply_with_key(0, &key, &link.server_common_caps, &link.server_channel_caps);
    link.server_link_size = Some(le32(&reply, 12));
    let fixed = (LINK_HEADER_LEN + LINK_REPLY_MIN) as usize;
    if a.link_one_write {
        send(&[&reply])?;
    } else {
        send(&[&reply[..fixed]])?;
        for w in reply[fixed..].chunks(4) {
            send(&[w])?;
        }
    }
    // Auth (§1.5): the mechanism word only if the client advertised auth selection.
    let mechanism = if client_caps0 & CAP_AUTH_SELECTION != 0 {
        rx.u32_raw()?
    } else {
        AUTH_MECHANISM_SPICE
    };
    link.auth_mechanism = Some(mechanism);
    let sasl = if mechanism == AUTH_MECHANISM_SPICE {
        rx.take_raw(TICKET_LEN as usize)?;
        false
    } else if mechanism == AUTH_MECHANISM_SASL && server_caps0 & CAP_AUTH_SASL != 0 {
        server_sasl(tx, rx)?;
        true
    } else {
        // Unknown mechanism, or SASL not enabled: an error reply after the OK reply (§1.7).
        link.outcome = "link_error_after_reply";
        link.error_after_reply = Some(3);
        send(&[&wire::link_error_reply(3)])?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    };
    if let Some(code) = a.error_after_reply {
        link.outcome = "link_error_after_reply";
        link.error_after_reply = Some(code);
        send(&[&wire::link_error_reply(code)])?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    send(&[&wire::link_result(a.result)])?;
    finish_link(a.result, sasl, stream, tx, rx, link)
}

fn server_answer_non_spice(
    a: &ServerArgs,
    send: &dyn Fn(&[&[u8]]) -> io::Result<()>,
) -> io::Result<()> {
    let c = &a.common;
    if c.garbage {
        send(&[&garbage(c.seed, c.garbage_len)])
    } else if c.tls_bytes {
        send(&[&tls_record(c.seed, 2)])
    } else {
        send(&[&wire::link_error_reply(2)])
    }
}

fn sasl_msg(data: &[u8]) -> Vec<u8> {
    let mut v = (data.len() as u32).to_le_bytes().to_vec();
    v.extend_from_slice(data);
    v
}

/// Server half of the SASL exchange (§1.6), with canned payloads.
fn server_sasl(tx: &Arc<Mutex<Tx>>, rx: &mut Rx) -> io::Result<()> {
    let send = |b: &[u8]| tx.lock().unwrap().link_call(&[b]);
    send(&sasl_msg(b",DIGEST-MD5,GSSAPI,"))?;
    let n = rx.u32_raw()? as usize;
    if n == 0 || n > 100 {
        return Err(proto_err(format!("SASL mechanism name length {n}")));
    }
    rx.take_raw(n)?;
    let n = rx.u32_raw()? as usize;
    rx.take_raw(n)?;
    let mut step = sasl_msg(b"server-challenge\0");
    step.push(0);
    send(&step)?;
    let n = rx.u32_raw()? as usize;
    rx.take_raw(n)?;
    let mut done = sasl_msg(b"server-final\0");
    done.push(1);
    send(&done)?;
    send(&wire::link_result(0))
}

/// Reads the client's data messages and applies ACK_SYNC / ACK to the gate.
fn server_reader(
    rx: &mut Rx,
    kind: HeaderKind,
    acks: &Arc<(Mutex<AckState>, Condvar)>,
) -> io::Result<()> {
    while let Some(m) = rx.read_message(kind)? {
        let (lock, cv) = &**acks;
        let mut s = lock.lock().unwrap();
        match m.msg_type {
            msg_client::ACK_SYNC if m.size >= 4 => {
                s.client_generation = Some(m.word(0));
                s.ack_syncs += 1;
            }
            msg_client::ACK => {
                s.acks += 1;
                if s.client_generation == Some(s.generation) && s.window > 0 {
                    s.acks_matched += 1;
                    if s.count < s.window as i64 {
                        s.ack_surplus += 1;
                    }
                    s.count -= s.window as i64;
                    s.mw = s.mw.wrapping_sub(s.window);
                    cv.notify_all();
                }
            }
            _ => {}
        }
    }
    Ok(())
}

fn server_writer(
    a: &ServerArgs,
    tx: &Arc<Mutex<Tx>>,
    acks: &Arc<(Mutex<AckState>, Condvar)>,
) -> io::Result<()> {
    let c = &a.common;
    let pat = Pattern {
        split_header: c.split_header,
        iov_split: c.iov_split,
        split_at: c.split_at,
        chunk: c.chunk,
    };
    let window = a.window.unwrap_or(20);
    {
        let mut s = acks.0.lock().unwrap();
        if a.set_ack {
            s.window = window;
            s.generation = a.generation;
            s.flow = !a.ignore_acks;
        }
    }
    let body = vec![a.body_fill as u8; a.body_size as usize];
    let mut list: Vec<(u16, Vec<u8>)> = Vec::new();
    if a.set_ack {
        list.push((
            msg_server::SET_ACK,
            wire::set_ack_body(a.generation, window).to_vec(),
        ));
    }
    if let Some(sid) = a.main_init {
        list.push((msg_server::MAIN_INIT, wire::main_init_body(sid).to_vec()));
    }
    let extra = list.len() as u64;
    // The second SET_ACK, if any, goes out after that many streamed messages.
    let second_at = a.second_set_ack_after.map(|n| extra + n.min(a.messages));
    let second = (
        a.second_generation.unwrap_or(a.generation.wrapping_add(1)),
        a.second_window.unwrap_or(window),
    );
    let second_body = wire::set_ack_body(second.0, second.1);
    let total = extra + a.messages + second_at.is_some() as u64;
    let get = |i: u64| -> (u16, &[u8]) {
        if i < extra {
            let (t, b) = &list[i as usize];
            (*t, b.as_slice())
        } else if Some(i) == second_at {
            (msg_server::SET_ACK, second_body.as_slice())
        } else {
            (a.msg_type, body.as_slice())
        }
    };
    let stall = Duration::from_millis(a.stall_timeout_ms);
    let mut i = 0u64;
    'outer: while i < total {
        let mut batch: Vec<(u16, &[u8])> = Vec::new();
        while batch.len() < c.batch && i < total {
            let (t, b) = get(i);
            let is_second = Some(i) == second_at;
            if is_second {
                if !batch.is_empty() {
                    break; // the second SET_ACK starts a write call of its own
                }
                thread::sleep(Duration::from_millis(a.second_set_ack_delay_ms));
            } else if i >= extra && a.interval_ms > 0 {
                if !batch.is_empty() {
                    break; // each message goes out when its interval has passed
                }
                thread::sleep(Duration::from_millis(a.interval_ms));
            }
            {
                let (lock, cv) = &**acks;
                let mut s = lock.lock().unwrap();
                if a.set_ack && i == 0 {
                    // send_set_ack: mw = 0, then begin_send_message counts the SET_ACK itself.
                    s.count = 1;
                    s.mw = 1;
                    s.set_acks = 1;
                    s.max_count_generation = 0;
                } else if s.flow {
                    if s.mw > s.window.wrapping_mul(2) {
                        if !batch.is_empty() {
                            break; // send what the gate allowed so far
                        }
                        s.waits += 1;
                        let deadline = Instant::now() + stall;
                        while s.mw > s.window.wrapping_mul(2) && !s.reader_done {
                            let left = deadline.saturating_duration_since(Instant::now());
                            if left.is_zero() {
                                break;
                            }
                            s = cv.wait_timeout(s, left).unwrap().0;
                        }
                        if s.mw > s.window.wrapping_mul(2) {
                            s.stalled_timeout = !s.reader_done;
                            break 'outer;
                        }
                    }
                    s.count += 1;
                    s.mw = s.mw.wrapping_add(1);
                } else if s.window > 0 {
                    s.count += 1;
                    s.mw = s.mw.wrapping_add(1);
                }
                if is_second {
                    // A new generation: send_set_ack resets the count, the SET_ACK counts.
                    s.generation = second.0;
                    s.window = second.1;
                    s.count = 1;
                    s.mw = 1;
                    s.set_acks += 1;
                    s.max_count_generation = 0;
                }
                s.max_count = s.max_count.max(s.count);
                s.max_count_generation = s.max_count_generation.max(s.count);
            }
            batch.push((t, b));
            i += 1;
        }
        tx.lock().unwrap().send_messages(&batch, &pat)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------------

fn connect(addr: &str, timeout: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::InvalidInput, format!("{addr}: no address"));
    for sa in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&sa, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn run_client(a: &ClientArgs) -> Report {
    let c = &a.common;
    let obs = Arc::new(Mutex::new(Observe::default()));
    let mut link = LinkFacts {
        outcome: "ok",
        channel_type: a.channel_type,
        channel_id: a.channel_id,
        connection_id: a.connection_id,
        ..Default::default()
    };
    let mode = mode_name(c, a.websocket);
    let stream = match connect(&a.connect, c.timeout()).and_then(|s| setup_socket(&s, c).map(|_| s))
    {
        Ok(s) => Arc::new(s),
        Err(e) => {
            let tx = Tx::new(-1, Dir::C2S, c, obs.clone());
            let rx = Rx::new(-1, Dir::S2C, c, obs.clone());
            return summary(
                "client",
                mode,
                &link,
                &tx,
                &rx,
                Value::Null,
                c,
                &obs.lock().unwrap(),
                Some(format!("connect: {e}")),
            );
        }
    };
    let fd = stream.as_raw_fd();
    let tx = Arc::new(Mutex::new(Tx::new(fd, Dir::C2S, c, obs.clone())));
    let mut rx = Rx::new(fd, Dir::S2C, c, obs.clone());
    let mut acks = ClientAcks::default();
    let res = client_script(a, &stream, &tx, &mut rx, &mut link, &mut acks);
    let _ = stream.shutdown(Shutdown::Both);
    let ack_json = json!({
        "cadence": format!("{:?}", a.ack_cadence).to_lowercase(),
        "window": acks.window, "generation": acks.generation,
        "ack_syncs_sent": acks.ack_syncs_sent, "acks_sent": acks.acks_sent,
        "surplus_acks_sent": acks.surplus_acks_sent,
    });
    let tx = tx.lock().unwrap();
    summary(
        "client",
        mode,
        &link,
        &tx,
        &rx,
        ack_json,
        c,
        &obs.lock().unwrap(),
        res.err().map(|e| e.to_string()),
    )
}

fn client_script(
    a: &ClientArgs,
    stream: &TcpStream,
    tx: &Arc<Mutex<Tx>>,
    rx: &mut Rx,
    link: &mut LinkFacts,
    acks: &mut ClientAcks,
) -> io::Result<()> {
    if !client_link(a, stream, tx, rx, link)? {
        return Ok(());
    }
    let c = &a.common;
    let kind = link.header.unwrap();
    rx.start_data();
    tx.lock().unwrap().start_data(kind);
    let pat = Pattern {
        split_header: c.split_header,
        iov_split: c.iov_split,
        split_at: c.split_at,
        chunk: c.chunk,
    };
    // The client's own messages go out from a second thread while this one reads.
    let writer = (a.messages > 0).then(|| {
        let tx = tx.clone();
        let (n, t, size, batch) = (a.messages, a.msg_type, a.body_size as usize, c.batch);
        thread::spawn(move || -> io::Result<()> {
            let body = vec![0x5Au8; size];
            let mut sent = 0u64;
            while sent < n {
                let k = (batch as u64).min(n - sent);
                let msgs: Vec<(u16, &[u8])> = (0..k).map(|_| (t, body.as_slice())).collect();
                tx.lock().unwrap().send_messages(&msgs, &pat)?;
                sent += k;
            }
            Ok(())
        })
    });
    let read_res = client_reader(a, tx, rx, kind, acks, &pat);
    let write_res = writer
        .map(|h| h.join().expect("writer thread panicked"))
        .unwrap_or(Ok(()));
    read_res?;
    write_res?;
    stream.shutdown(Shutdown::Write)
}

/// The client's link phase. Ok(true): go on to data; Ok(false): the script ended here.
fn client_link(
    a: &ClientArgs,
    stream: &TcpStream,
    tx: &Arc<Mutex<Tx>>,
    rx: &mut Rx,
    link: &mut LinkFacts,
) -> io::Result<bool> {
    let c = &a.common;
    let send = |segs: &[&[u8]]| tx.lock().unwrap().link_call(segs);
    if c.garbage || c.tls_bytes || a.websocket {
        let bytes = if c.garbage {
            garbage(c.seed, c.garbage_len)
        } else if c.tls_bytes {
            tls_record(c.seed, 1)
        } else {
            WEBSOCKET_GET.to_vec()
        };
        send(&[&bytes])?;
        link.outcome = "client_not_spice";
        client_read_refusal(rx, link)?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    link.client_common_caps = own_common_caps(c, CAP_AUTH_SELECTION | CAP_MINI_HEADER);
    link.client_channel_caps = c.channel_caps.clone().unwrap_or_default();
    if a.caps_offset < LINK_MESS_MIN {
        return Err(proto_err("--caps-offset must be at least 18"));
    }
    let mut msg = wire::link_mess_with_caps_offset(
        a.connection_id,
        a.channel_type,
        a.channel_id,
        &link.client_common_caps,
        &link.client_channel_caps,
        a.caps_offset,
    );
    msg[4..8].copy_from_slice(&a.major.to_le_bytes());
    link.client_link_size = Some(le32(&msg, 12));
    send(&[&msg])?;

    // Reply header, then body (§1.3).
    let hdr = match rx.take_raw(16) {
        Ok(h) => h,
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            link.outcome = "closed_by_server";
            close_and_drain(stream, rx)?;
            return Ok(false);
        }
        Err(e) => return Err(e),
    };
    let magic = le32(&hdr, 0);
    if magic != u32::from_le_bytes(SPICE_MAGIC) {
        link.peer_magic = Some(magic);
        link.outcome = "server_not_spice";
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    let size = le32(&hdr, 12);
    link.server_link_size = Some(size);
    if !(LINK_REPLY_MIN..=LINK_REPLY_MIN + LINK_MESS_MAX).contains(&size) {
        return Err(proto_err(format!("link reply size {size}")));
    }
    let body = rx.take_raw(size as usize)?;
    let error = le32(&body, 0);
    if error != 0 {
        link.outcome = "link_refused";
        link.refused = Some(error);
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    let (n_common, n_channel, caps_offset) = (le32(&body, 166), le32(&body, 170), le32(&body, 174));
    let end = caps_offset as u64 + 4 * (n_common as u64 + n_channel as u64);
    if caps_offset < LINK_REPLY_MIN || end > size as u64 {
        return Err(proto_err(format!(
            "link reply caps: offset {caps_offset}, {n_common}+{n_channel} words"
        )));
    }
    let words: Vec<u32> = (0..n_common + n_channel)
        .map(|i| le32(&body, (caps_offset + 4 * i) as usize))
        .collect();
    link.server_common_caps = words[..n_common as usize].to_vec();
    link.server_channel_caps = words[n_common as usize..].to_vec();

    // Auth (§1.5): mechanism word iff we advertised auth selection (what the server reads).
    let own0 = link.client_common_caps.first().copied().unwrap_or(0);
    let mechanism = if own0 & CAP_AUTH_SELECTION != 0 {
        let m = a.auth_mechanism.unwrap_or(if c.sasl {
            AUTH_MECHANISM_SASL
        } else {
            AUTH_MECHANISM_SPICE
        });
        send(&[&wire::auth_mechanism(m)])?;
        m
    } else {
        AUTH_MECHANISM_SPICE
    };
    link.auth_mechanism = Some(mechanism);
    let mut sasl = false;
    if mechanism == AUTH_MECHANISM_SPICE {
        send(&[&wire::ticket()])?;
    } else if mechanism == AUTH_MECHANISM_SASL {
        let first = rx.u32_raw()?;
        if first == u32::from_le_bytes(SPICE_MAGIC) {
            client_error_after_reply(stream, rx, link)?;
            return Ok(false);
        }
        client_sasl(tx, rx, first)?;
        sasl = true;
    }
    // Link result, or an error reply in its place (§1.7).
    let result = match rx.u32_raw() {
        Ok(r) => r,
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            link.outcome = "closed_by_server";
            close_and_drain(stream, rx)?;
            return Ok(false);
        }
        Err(e) => return Err(e),
    };
    if result == u32::from_le_bytes(SPICE_MAGIC) {
        client_error_after_reply(stream, rx, link)?;
        return Ok(false);
    }
    finish_link(result, sasl, stream, tx, rx, link)
}

/// The 4 bytes "REDQ" were read where a result was expected: read the rest of the error reply.
fn client_error_after_reply(
    stream: &TcpStream,
    rx: &mut Rx,
    link: &mut LinkFacts,
) -> io::Result<()> {
    let rest = rx.take_raw(12)?;
    let size = le32(&rest, 8) as usize;
    let body = rx.take_raw(size.min(LINK_REPLY_MIN as usize))?;
    link.outcome = "link_error_after_reply";
    link.error_after_reply = Some(le32(&body, 0));
    close_and_drain(stream, rx)
}

/// After a non-SPICE start: if the server answered with a link error reply, note its code.
fn client_read_refusal(rx: &mut Rx, link: &mut LinkFacts) -> io::Result<()> {
    let Ok(hdr) = rx.take_raw(16) else {
        return Ok(());
    };
    if le32(&hdr, 0) == u32::from_le_bytes(SPICE_MAGIC) {
        let size = le32(&hdr, 12) as usize;
        if let Ok(body) = rx.take_raw(size.min(LINK_REPLY_MIN as usize)) {
            link.refused = Some(le32(&body, 0));
        }
    } else {
        link.peer_magic = Some(le32(&hdr, 0));
    }
    Ok(())
}

/// Client half of the SASL exchange (§1.6); `mech_list_len` was already read.
fn client_sasl(tx: &Arc<Mutex<Tx>>, rx: &mut Rx, mech_list_len: u32) -> io::Result<()> {
    let send = |b: &[u8]| tx.lock().unwrap().link_call(&[b]);
    if mech_list_len > 4096 {
        return Err(proto_err(format!(
            "SASL mechanism list length {mech_list_len}"
        )));
    }
    rx.take_raw(mech_list_len as usize)?;
    send(&sasl_msg(b"DIGEST-MD5"))?;
    send(&sasl_msg(b"client-first\0"))?;
    loop {
        let n = rx.u32_raw()? as usize;
        if n > (1 << 20) {
            return Err(proto_err(format!("SASL step length {n}")));
        }
        rx.take_raw(n)?;
        let complete = rx.take_raw(1)?[0];
        if complete != 0 {
            return Ok(());
        }
        send(&sasl_msg(b"client-response\0"))?;
    }
}

fn client_reader(
    a: &ClientArgs,
    tx: &Arc<Mutex<Tx>>,
    rx: &mut Rx,
    kind: HeaderKind,
    acks: &mut ClientAcks,
    pat: &Pattern,
) -> io::Result<()> {
    let ack_delay = Duration::from_millis(a.ack_delay_ms);
    let send_ack = |acks: &mut ClientAcks| -> io::Result<()> {
        if !ack_delay.is_zero() {
            thread::sleep(ack_delay);
        }
        acks.acks_sent += 1;
        tx.lock()
            .unwrap()
            .send_messages(&[(msg_client::ACK, &[])], pat)
    };
    while let Some(m) = rx.read_message(kind)? {
        let is_set_ack = m.msg_type == msg_server::SET_ACK && m.size >= 8;
        // spice-gtk decrements before handling, and the SET_ACK finds the counter still unset.
        if a.ack_cadence == AckCadence::Gtk && !is_set_ack && acks.window > 0 && !a.no_acks {
            acks.counter -= 1;
            if acks.counter == 0 {
                acks.counter = acks.window;
                send_ack(acks)?;
            }
        }
        if is_set_ack {
            acks.generation = m.word(0);
            acks.window = m.word(1);
            acks.counter = acks.window;
            acks.since_set_ack = 0;
            if !a.no_acks && acks.window > 0 {
                acks.ack_syncs_sent += 1;
                let body = wire::ack_sync_body(acks.generation);
                tx.lock()
                    .unwrap()
                    .send_messages(&[(msg_client::ACK_SYNC, &body)], pat)?;
            }
        }
        // spice-html5 decrements after handling every message, the SET_ACK included.
        if a.ack_cadence == AckCadence::Html5 && acks.window > 0 && !a.no_acks {
            acks.counter -= 1;
            if acks.counter == 0 {
                acks.counter = acks.window;
                send_ack(acks)?;
            }
        }
        if !is_set_ack && acks.window > 0 {
            acks.since_set_ack += 1;
            if a.surplus_ack_after == Some(acks.since_set_ack) && acks.surplus_acks_sent == 0 {
                acks.surplus_acks_sent += 1;
                send_ack(acks)?;
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// main
// ---------------------------------------------------------------------------------------------

fn validate(cli: &Cli) -> Result<(), String> {
    match &cli.cmd {
        Cmd::Server(a) => {
            a.common.validate()?;
            if a.window.is_some() && !a.set_ack {
                return Err("--window needs --set-ack".into());
            }
            if a.window == Some(0) || a.second_window == Some(0) {
                return Err("--window and --second-window must be at least 1".into());
            }
            if !a.set_ack
                && (a.second_set_ack_after.is_some()
                    || a.second_generation.is_some()
                    || a.second_window.is_some())
            {
                return Err("--second-set-ack-after and its options need --set-ack".into());
            }
            Ok(())
        }
        Cmd::Client(a) => {
            a.common.validate()?;
            if a.websocket && (a.common.garbage || a.common.tls_bytes || a.common.sasl) {
                return Err("--websocket excludes --garbage, --tls-bytes and --sasl".into());
            }
            Ok(())
        }
    }
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = validate(&cli) {
        eprintln!("spice-peer: {e}");
        std::process::exit(2);
    }
    let report = match &cli.cmd {
        Cmd::Server(a) => run_server(a, &mut |port| {
            let mut out = io::stdout().lock();
            let _ = writeln!(out, "listening {port}");
            let _ = out.flush();
        }),
        Cmd::Client(a) => run_client(a),
    };
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "SUMMARY {}", report.summary);
    let _ = out.flush();
    if let Some(e) = report.summary["error"].as_str() {
        eprintln!("spice-peer: {e}");
    }
    std::process::exit(if report.ok { 0 } else { 1 });
}

// ---------------------------------------------------------------------------------------------
// Loopback self-tests: server and client in threads of the test process, real TCP sockets.
// ---------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn parse(args: &[&str]) -> Cli {
        let cli =
            Cli::try_parse_from(std::iter::once("spice-peer").chain(args.iter().copied())).unwrap();
        validate(&cli).unwrap();
        cli
    }

    /// Runs `server_args` and `client_args` (without --listen / --connect) against each
    /// other; returns (server SUMMARY, client SUMMARY).
    fn pair(server_args: &[&str], client_args: &[&str]) -> (Value, Value) {
        let mut sa = vec!["server", "--listen", "127.0.0.1:0", "--timeout-ms", "10000"];
        sa.extend_from_slice(server_args);
        let Cmd::Server(server) = parse(&sa).cmd else {
            unreachable!()
        };
        let (ptx, prx) = mpsc::channel();
        let sh = thread::spawn(move || run_server(&server, &mut |p| ptx.send(p).unwrap()).summary);
        let port = prx.recv().unwrap().to_string();
        let addr = format!("127.0.0.1:{port}");
        let mut ca = vec!["client", "--connect", &addr, "--timeout-ms", "10000"];
        ca.extend_from_slice(client_args);
        let Cmd::Client(client) = parse(&ca).cmd else {
            unreachable!()
        };
        let c = run_client(&client).summary;
        let s = sh.join().unwrap();
        (s, c)
    }

    /// Both scripts completed, both sides agree on every count, and the framing code's
    /// reading of each side's calls finds the same messages (the self-check).
    fn check_consistent(s: &Value, c: &Value) {
        assert!(s["error"].is_null(), "server: {s:#}");
        assert!(c["error"].is_null(), "client: {c:#}");
        for (w, r) in [(s, c), (c, s)] {
            let (sent, recv) = (&w["sent"], &r["received"]);
            assert_eq!(sent["bytes"], recv["bytes"], "bytes\n{w:#}\n{r:#}");
            assert_eq!(sent["messages"], recv["messages"], "messages");
            assert_eq!(sent["by_type"], recv["by_type"], "by_type");
            assert_eq!(sent["unfinished_messages"], 0);
            assert_eq!(sent["link_bytes"], recv["link_bytes"], "link bytes");
            let d = sent["direction"].as_str().unwrap();
            for side in [w, r] {
                let f = &side["framing"][d];
                assert!(
                    f["unparsed"].is_null(),
                    "{} framing {d}: {f:#}",
                    side["role"]
                );
                assert_eq!(
                    f["messages"], sent["messages"],
                    "{} framing {d} messages",
                    side["role"]
                );
                assert_eq!(
                    f["by_type"], sent["by_type"],
                    "{} framing {d} by_type",
                    side["role"]
                );
                assert_eq!(
                    f["bytes"], sent["bytes"],
                    "{} framing {d} bytes",
                    side["role"]
                );
                assert_eq!(
                    f["peek_mismatched"], 0,
                    "{} framing {d}: {f:#}",
                    side["role"]
                );
            }
        }
    }

    fn n(v: &Value) -> u64 {
        v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
    }

    #[test]
    fn default_mini_with_ack_window() {
        let (s, c) = pair(&["--messages", "200", "--set-ack", "--window", "4"], &[]);
        check_consistent(&s, &c);
        assert_eq!(s["header"], "mini");
        assert_eq!(s["sent"]["by_type"], json!({"3": 1, "304": 200}));
        assert_eq!(n(&s["sent"]["link_bytes"]), 16 + 186 + 4);
        // spice-gtk cadence: ACK_SYNC once, then one ACK per 4 messages after the SET_ACK.
        assert_eq!(s["received"]["by_type"], json!({"1": 1, "2": 50}));
        assert_eq!(s["acks"]["acks_matched"], 50);
        assert!(
            n(&s["acks"]["max_count"]) <= 9,
            "gate: count never above 2W+1"
        );
        assert_eq!(s["framing"]["s2c"]["prefixes"][0], json!([3, 1, 4]));
        assert_eq!(c["framing"]["c2s"]["prefixes"][0], json!([1, 1, 0]));
        assert_eq!(c["link"]["server_common_caps"], json!([0x0B]));
        assert_eq!(n(&c["sent"]["link_bytes"]), 16 + 22 + 4 + 128);
    }

    #[test]
    fn second_set_ack_opens_a_generation() {
        let (s, c) = pair(
            &[
                "--messages",
                "20",
                "--set-ack",
                "--window",
                "4",
                "--second-set-ack-after",
                "8",
                "--second-generation",
                "7",
                "--second-window",
                "2",
                "--second-set-ack-delay-ms",
                "50",
            ],
            &[],
        );
        check_consistent(&s, &c);
        assert_eq!(s["sent"]["by_type"], json!({"3": 2, "304": 20}));
        let a = &s["acks"];
        assert_eq!(
            (a["set_acks"].clone(), a["generation"].clone()),
            (json!(2), json!(7))
        );
        assert_eq!(
            (a["window"].clone(), a["ack_syncs"].clone()),
            (json!(2), json!(2))
        );
        // Generation 7: SET_ACK + 12 messages, the client ACKs every 2: count 1 + 12 - 12.
        assert_eq!(a["acks_matched"], 2 + 6);
        assert_eq!(a["final_count"], 1);
        assert!(n(&a["max_count_generation"]) <= 5, "gate: 2W+1 of W=2: {a}");
        assert_eq!(c["framing"]["s2c"]["prefixes"][0], json!([3, 1, 4]));
        assert_eq!(c["acks"]["generation"], 7);
    }

    #[test]
    fn surplus_ack_wraps_the_unsigned_count_and_stalls() {
        let (s, c) = pair(
            &[
                "--messages",
                "10",
                "--set-ack",
                "--window",
                "8",
                "--interval-ms",
                "30",
                "--stall-timeout-ms",
                "200",
            ],
            &["--surplus-ack-after", "2"],
        );
        assert!(s["error"].is_null() && c["error"].is_null(), "{s:#}\n{c:#}");
        let a = &s["acks"];
        // SET_ACK + 2 messages counted, then the ACK: 3 - 8 wraps messages_window.
        assert_eq!(a["ack_surplus"], 1);
        assert_eq!(a["final_count"], -5);
        assert_eq!(a["messages_window"], 3u32.wrapping_sub(8));
        assert_eq!(a["stalled_timeout"], true);
        assert_eq!(s["sent"]["by_type"], json!({"3": 1, "304": 2}));
        assert_eq!(c["acks"]["surplus_acks_sent"], 1);
        assert_eq!(c["acks"]["acks_sent"], 1);
    }

    #[test]
    fn full_headers() {
        let (s, c) = pair(
            &["--messages", "30", "--set-ack", "--window", "5"],
            &["--header", "full"],
        );
        check_consistent(&s, &c);
        assert_eq!(c["header"], "full");
        assert_eq!(n(&s["sent"]["data_bytes"]), 26 + 30 * (18 + 64));
        assert_eq!(s["received"]["by_type"], json!({"1": 1, "2": 6}));
    }

    #[test]
    fn every_send_and_recv_syscall() {
        let pairs = [
            ("write", "read"),
            ("writev", "readv"),
            ("sendmsg", "recvmsg"),
            ("sendto", "recvfrom"),
        ];
        for (snd, rcv) in pairs {
            let (s, c) = pair(
                &[
                    "--messages",
                    "40",
                    "--set-ack",
                    "--window",
                    "3",
                    "--send-syscall",
                    snd,
                    "--recv-syscall",
                    rcv,
                ],
                &[
                    "--send-syscall",
                    snd,
                    "--recv-syscall",
                    rcv,
                    "--recv-size",
                    "7",
                    "--messages",
                    "5",
                ],
            );
            check_consistent(&s, &c);
            assert_eq!(
                s["received"]["by_type"],
                json!({"1": 1, "2": 13, "101": 5}),
                "{snd}/{rcv}"
            );
        }
    }

    #[test]
    fn readv_with_several_iovecs_and_exact_reads() {
        let (s, c) = pair(
            &["--messages", "20", "--body-size", "1000", "--recv-exact"],
            &[
                "--recv-syscall",
                "readv",
                "--recv-iovs",
                "3",
                "--recv-size",
                "100",
                "--messages",
                "3",
            ],
        );
        check_consistent(&s, &c);
        // Exact reads on the server: link header 4 + 12, body, mechanism, ticket, then per
        // message header then body.
        assert_eq!(n(&s["received"]["calls"]), 2 + 1 + 1 + 1 + 3 * 2 + 1);
    }

    #[test]
    fn split_header_each_header_in_two_calls() {
        let (s, c) = pair(
            &["--messages", "10", "--body-size", "5", "--split-header"],
            &[],
        );
        check_consistent(&s, &c);
        // Link: reply, 2 cap words, result = 4 calls; then 2 per message.
        assert_eq!(n(&s["sent"]["calls"]), 4 + 20);
        let (s, c) = pair(
            &["--messages", "10", "--split-header", "--split-at", "11"],
            &["--header", "full"],
        );
        check_consistent(&s, &c);
    }

    #[test]
    fn batches_of_whole_messages() {
        let (s, c) = pair(
            &[
                "--messages",
                "100",
                "--batch",
                "25",
                "--send-syscall",
                "writev",
                "--body-size",
                "0",
            ],
            &[],
        );
        check_consistent(&s, &c);
        assert_eq!(n(&s["sent"]["calls"]), 4 + 4);
        // The gate cuts batches short.
        let (s, c) = pair(
            &[
                "--messages",
                "100",
                "--batch",
                "50",
                "--set-ack",
                "--window",
                "5",
            ],
            &[],
        );
        check_consistent(&s, &c);
        assert!(n(&s["acks"]["max_count"]) <= 11);
    }

    #[test]
    fn header_split_across_iovecs() {
        for sc in ["writev", "sendmsg"] {
            let (s, c) = pair(
                &[
                    "--messages",
                    "20",
                    "--iov-split",
                    "--send-syscall",
                    sc,
                    "--set-ack",
                    "--window",
                    "2",
                ],
                &["--iov-split", "--send-syscall", sc, "--messages", "4"],
            );
            check_consistent(&s, &c);
            assert_eq!(n(&s["sent"]["calls"]), 4 + 21);
        }
    }

    #[test]
    fn chunked_bodies_and_partial_reads() {
        let (s, c) = pair(
            &["--messages", "20", "--body-size", "1000", "--chunk", "128"],
            &["--recv-size", "1"],
        );
        check_consistent(&s, &c);
        assert_eq!(n(&s["sent"]["calls"]), 4 + 20 * 8);
        assert_eq!(
            n(&c["received"]["calls"]),
            n(&c["received"]["bytes"]) + 1,
            "1-byte reads + EOF"
        );
    }

    #[test]
    fn pauses_between_writes() {
        let t = Instant::now();
        let (s, c) = pair(
            &["--messages", "5", "--pause-ms", "20"],
            &["--pause-ms", "5"],
        );
        check_consistent(&s, &c);
        assert!(t.elapsed() >= Duration::from_millis(5 * 20));
    }

    #[test]
    fn nonblocking_writer_with_a_slow_reader_hits_eagain() {
        let (s, c) = pair(
            &[
                "--messages",
                "10",
                "--body-size",
                "65536",
                "--nonblock",
                "--sndbuf",
                "4096",
                "--send-syscall",
                "writev",
            ],
            &["--recv-size", "4096", "--recv-pause-ms", "1"],
        );
        check_consistent(&s, &c);
        assert!(n(&s["sent"]["eagain"]) > 0, "{:#}", s["sent"]);
        assert!(n(&s["sent"]["short_writes"]) > 0);
        // Every peeked start was reported once by the real write.
        let f = &s["framing"]["s2c"];
        assert_eq!(f["peeked"], f["already_reported"]);
    }

    #[test]
    fn eagain_in_the_middle_of_header_like_bodies() {
        // Bodies of 0x02 bytes read as a mini header: type 514, size 0x02020202 (< 256 MiB).
        // Large bodies through a tiny send buffer: many EAGAINs land mid-body.
        let (s, c) = pair(
            &[
                "--messages",
                "5",
                "--body-size",
                "300000",
                "--body-fill",
                "2",
                "--nonblock",
                "--sndbuf",
                "4096",
            ],
            &["--recv-size", "4096", "--recv-pause-ms", "1"],
        );
        assert!(
            n(&s["sent"]["eagain"]) > n(&s["framing"]["s2c"]["already_reported"]),
            "no mid-body EAGAIN"
        );
        check_consistent(&s, &c);
    }

    #[test]
    fn main_init_and_display_types() {
        let (s, c) = pair(
            &[
                "--main-init",
                "0xCAFE",
                "--messages",
                "3",
                "--msg-type",
                "4",
                "--body-size",
                "12",
            ],
            &["--channel-type", "1"],
        );
        check_consistent(&s, &c);
        assert_eq!(s["sent"]["by_type"], json!({"4": 3, "103": 1}));
        assert_eq!(c["framing"]["s2c"]["prefixes"][0], json!([103, 0xCAFE, 0]));
        assert_eq!(s["link"]["server_channel_caps"], json!([0x0F]));
    }

    #[test]
    fn caps_offset_channel_caps_and_link_one_write() {
        let (s, c) = pair(
            &[
                "--link-one-write",
                "--channel-caps",
                "1,2,3",
                "--messages",
                "3",
            ],
            &[
                "--caps-offset",
                "30",
                "--channel-caps",
                "0xFFFF",
                "--channel-id",
                "2",
                "--connection-id",
                "77",
            ],
        );
        check_consistent(&s, &c);
        assert_eq!(s["link"]["client_link_size"], 30 + 8);
        assert_eq!(s["link"]["client_channel_caps"], json!([0xFFFF]));
        assert_eq!(
            s["channel"],
            json!({"type": 2, "id": 2, "connection_id": 77})
        );
        assert_eq!(n(&s["sent"]["calls"]), 1 + 1 + 3);
        let l = &c["framing"]["s2c"]["link"];
        assert_eq!((n(&l["link_size"]), n(&l["common_caps"])), (178 + 16, 0x0B));
    }

    #[test]
    fn no_auth_selection_ticket_right_after_link() {
        let (s, c) = pair(&["--messages", "5"], &["--common-caps", "0x08"]);
        check_consistent(&s, &c);
        let (s, c) = pair(&["--messages", "5"], &["--no-common-caps"]);
        check_consistent(&s, &c);
    }

    #[test]
    fn no_auth_selection_peer_counts() {
        // The peers themselves handle it (framing is checked by the ignored test above).
        for caps in [&["--common-caps", "0x08"][..], &["--no-common-caps"][..]] {
            let (s, c) = pair(&["--messages", "5"], caps);
            assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
            assert_eq!(c["received"]["messages"], 5);
            assert_eq!(s["link"]["auth_mechanism"], 1);
            assert_eq!(
                n(&c["sent"]["link_bytes"]),
                n(&s["link"]["client_link_size"]) + 16 + 128
            );
        }
    }

    #[test]
    fn stall_without_acks() {
        let (s, c) = pair(
            &[
                "--messages",
                "100",
                "--set-ack",
                "--window",
                "4",
                "--stall-timeout-ms",
                "200",
            ],
            &["--no-acks"],
        );
        assert!(s["error"].is_null() && c["error"].is_null());
        // count: 1 after SET_ACK; messages start while count ≤ 8 → 8 messages.
        assert_eq!(s["sent"]["by_type"], json!({"3": 1, "304": 8}));
        assert_eq!(s["acks"]["stalled_timeout"], true);
        assert_eq!(c["received"]["messages"], 9);
        assert_eq!(c["framing"]["s2c"]["messages"], 9);
    }

    #[test]
    fn html5_cadence_acks_one_message_earlier() {
        let (s, c) = pair(
            &["--messages", "19", "--set-ack", "--window", "5"],
            &["--ack-cadence", "html5"],
        );
        check_consistent(&s, &c);
        // 20 messages counted including the SET_ACK → 4 ACKs (gtk would send 3).
        assert_eq!(s["received"]["by_type"], json!({"1": 1, "2": 4}));
    }

    #[test]
    fn garbage_tls_and_websocket_clients_are_refused() {
        for mode in ["--garbage", "--tls-bytes", "--websocket"] {
            let (s, c) = pair(&[], &[mode]);
            assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
            assert_eq!(s["outcome"], "client_not_spice");
            assert_eq!(c["link"]["refused"], 2, "INVALID_MAGIC error reply");
            assert_eq!(s["sent"]["bytes"], c["received"]["bytes"]);
            assert_eq!(s["received"]["bytes"], c["sent"]["bytes"]);
            let want = match mode {
                "--garbage" => "not_spice",
                "--tls-bytes" => "tls",
                _ => "websocket",
            };
            assert_eq!(c["framing"]["c2s"]["unparsed"]["reason"], want);
            assert_eq!(s["framing"]["c2s"]["unparsed"]["reason"], want);
            assert_eq!(c["framing"]["c2s"]["unparsed"]["at"], 0);
        }
    }

    #[test]
    fn garbage_and_tls_servers() {
        for (mode, want) in [("--garbage", "not_spice"), ("--tls-bytes", "tls")] {
            let (s, c) = pair(&[mode], &[]);
            assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
            assert_eq!(c["outcome"], "server_not_spice");
            assert_eq!(c["framing"]["c2s"]["link"]["link_size"], 22);
            assert_eq!(c["framing"]["s2c"]["unparsed"]["reason"], want);
        }
    }

    #[test]
    fn sasl_both_directions_unparsed() {
        let (s, c) = pair(
            &["--sasl", "--messages", "10", "--set-ack", "--window", "2"],
            &["--sasl"],
        );
        assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
        assert_eq!(s["sent"]["by_type"], json!({"3": 1, "304": 10}));
        assert_eq!(c["received"]["by_type"], json!({"3": 1, "304": 10}));
        assert_eq!(s["received"]["by_type"], json!({"1": 1, "2": 5}));
        assert_eq!(s["sent"]["bytes"], c["received"]["bytes"]);
        for side in [&s, &c] {
            assert_eq!(side["framing"]["c2s"]["unparsed"]["reason"], "sasl");
            assert_eq!(side["framing"]["s2c"]["unparsed"]["reason"], "sasl");
        }
        assert_eq!(c["link"]["server_common_caps"], json!([0x0D]));
    }

    #[test]
    fn sasl_client_without_sasl_server_gets_error_after_reply() {
        let (s, c) = pair(&[], &["--sasl"]);
        assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
        assert_eq!(c["outcome"], "link_error_after_reply");
        assert_eq!(c["link"]["error_after_reply"], 3);
        assert_eq!(c["framing"]["c2s"]["unparsed"]["reason"], "sasl");
    }

    #[test]
    fn link_refusals() {
        let (s, c) = pair(&["--link-error", "9"], &[]);
        assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
        assert_eq!(c["link"]["refused"], 9);
        assert_eq!(
            c["framing"]["s2c"]["unparsed"],
            json!({"reason": "link_refused", "detail": 9, "at": 16})
        );

        let (s, c) = pair(&["--result", "7"], &[]);
        assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
        assert_eq!(c["outcome"], "link_refused");
        assert_eq!(
            c["framing"]["s2c"]["unparsed"],
            json!({"reason": "link_refused", "detail": 7, "at": 202})
        );

        let (s, c) = pair(&["--error-after-reply", "8"], &[]);
        assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
        assert_eq!(c["link"]["error_after_reply"], 8);
        assert_eq!(
            c["framing"]["s2c"]["unparsed"]["reason"],
            "link_error_after_reply"
        );

        let (s, c) = pair(&[], &["--major", "3"]);
        assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
        assert_eq!(s["outcome"], "version_mismatch");
        assert_eq!(c["link"]["refused"], 4);
        assert_eq!(c["framing"]["c2s"]["unparsed"]["reason"], "link_version");

        let (s, c) = pair(&[], &["--auth-mechanism", "5"]);
        assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
        assert_eq!(c["outcome"], "link_error_after_reply");
        assert_eq!(
            c["framing"]["c2s"]["unparsed"]["reason"],
            "bad_auth_mechanism"
        );
    }

    #[test]
    fn empty_bodies_and_client_batches() {
        let (s, c) = pair(
            &[
                "--messages",
                "300",
                "--body-size",
                "0",
                "--msg-type",
                "102",
                "--set-ack",
                "--window",
                "20",
            ],
            &[
                "--messages",
                "50",
                "--body-size",
                "0",
                "--msg-type",
                "4",
                "--batch",
                "10",
            ],
        );
        check_consistent(&s, &c);
        assert_eq!(s["received"]["by_type"], json!({"1": 1, "2": 15, "4": 50}));
    }

    #[test]
    fn bad_options_are_rejected() {
        for args in [
            &["server", "--listen", "x", "--window", "4"][..],
            &["server", "--listen", "x", "--iov-split"][..],
            &["server", "--listen", "x", "--batch", "2", "--chunk", "3"][..],
            &["client", "--connect", "x", "--recv-iovs", "2"][..],
            &["client", "--connect", "x", "--garbage", "--sasl"][..],
        ] {
            let cli =
                Cli::try_parse_from(std::iter::once("spice-peer").chain(args.iter().copied()))
                    .unwrap();
            assert!(validate(&cli).is_err(), "{args:?}");
        }
    }
}
