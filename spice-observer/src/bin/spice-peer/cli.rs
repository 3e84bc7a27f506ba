//! Command line: the subcommands and their options.

use super::*;

/// Scripted SPICE peer for kernel-path tests of spice-observer.
#[derive(Debug, Parser)]
#[command(name = "spice-peer", about, long_about = None)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) cmd: Cmd,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Cmd {
    /// Accept one connection and play spice-server.
    Server(ServerArgs),
    /// Connect and play spice-gtk.
    Client(ClientArgs),
    /// Load generator: play spice-server for N sessions × M display channels, streamed to
    /// one client process that ACKs every W (see `load.rs`).
    Load(LoadArgs),
    /// The client process of `load` (started by it).
    #[command(hide = true)]
    LoadClient(LoadClientArgs),
}

/// Which syscall writes the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum SendSyscall {
    Write,
    Writev,
    Sendmsg,
    Sendto,
}

/// Which syscall reads the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum RecvSyscall {
    Read,
    Readv,
    Recvmsg,
    Recvfrom,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum HeaderArg {
    /// Advertise MINI_HEADER (the header is mini iff the peer does too).
    Mini,
    /// Do not advertise MINI_HEADER: 18-byte full headers.
    Full,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum AckCadence {
    /// spice-gtk: the SET_ACK is not counted; ACK after every W later messages.
    Gtk,
    /// spice-html5: the SET_ACK counts; the first ACK comes after W-1 later messages.
    Html5,
}

pub(crate) fn parse_u32(s: &str) -> Result<u32, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u32::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|e| format!("{s:?}: {e}"))
}

/// Options shared by both sides: syscalls, write pattern, caps, non-SPICE modes.
#[derive(Clone, Debug, Args)]
pub(crate) struct Common {
    /// Syscall for every write of this side.
    #[arg(long, value_enum, default_value_t = SendSyscall::Write)]
    pub(crate) send_syscall: SendSyscall,
    /// Syscall for every read of this side.
    #[arg(long, value_enum, default_value_t = RecvSyscall::Read)]
    pub(crate) recv_syscall: RecvSyscall,
    /// Bytes asked for per read call (upper bound with --recv-exact).
    #[arg(long, default_value_t = 65536)]
    pub(crate) recv_size: usize,
    /// Once this side has sent N data messages (N ≥ 1), every later write goes out with
    /// sendfile(2) from a memfd instead of --send-syscall: bytes on the socket that no hook can
    /// read from a user buffer (an observer must mark that direction `untraced bytes`).
    #[arg(long, value_name = "N")]
    pub(crate) sendfile_after: Option<u64>,
    /// Iovecs per readv/recvmsg call (the buffer split evenly).
    #[arg(long, default_value_t = 1)]
    pub(crate) recv_iovs: usize,
    /// Read exactly the missing bytes of the current element (header, then body), like
    /// spice-server's receive path (§4.6), instead of --recv-size at a time.
    #[arg(long)]
    pub(crate) recv_exact: bool,
    /// Sleep this long before each read call (a slow reader, to fill the peer's send buffer).
    #[arg(long, default_value_t = 0)]
    pub(crate) recv_pause_ms: u64,
    /// Write each data header in two calls: the first --split-at bytes, then the rest (with
    /// the start of the body).
    #[arg(long)]
    pub(crate) split_header: bool,
    /// Where --split-header and --iov-split cut the header (1 ≤ N < header length).
    #[arg(long, default_value_t = 3)]
    pub(crate) split_at: usize,
    /// Whole messages per write call (1..=300).
    #[arg(long, default_value_t = 1)]
    pub(crate) batch: usize,
    /// writev/sendmsg only: the header itself split across two iovecs.
    #[arg(long)]
    pub(crate) iov_split: bool,
    /// Header kind this side advertises (MINI_HEADER cap bit); ignored with --common-caps.
    #[arg(long, value_enum, default_value_t = HeaderArg::Mini)]
    pub(crate) header: HeaderArg,
    /// Write bodies in calls of at most B bytes (the first chunk goes with the header).
    #[arg(long)]
    pub(crate) chunk: Option<usize>,
    /// Sleep this long between write calls.
    #[arg(long, default_value_t = 0)]
    pub(crate) pause_ms: u64,
    /// Non-blocking socket: EAGAIN is counted, then poll() and the same call is retried
    /// (spice-server's write path, §4.2).
    #[arg(long)]
    pub(crate) nonblock: bool,
    /// SO_SNDBUF in bytes (small values provoke partial writes and EAGAIN).
    #[arg(long)]
    pub(crate) sndbuf: Option<u32>,
    /// SO_RCVBUF in bytes.
    #[arg(long)]
    pub(crate) rcvbuf: Option<u32>,
    /// First common-caps word this side sends (overrides the defaults and --header, --sasl).
    #[arg(long, value_parser = parse_u32)]
    pub(crate) common_caps: Option<u32>,
    /// Send num_common_caps = 0 (no auth selection, full headers).
    #[arg(long, conflicts_with = "common_caps")]
    pub(crate) no_common_caps: bool,
    /// Channel-cap words this side sends, comma-separated (default: client none, server the
    /// spice-server set for the channel type).
    #[arg(long, value_delimiter = ',', value_parser = parse_u32)]
    pub(crate) channel_caps: Option<Vec<u32>>,
    /// Send random bytes instead of this side's link message / reply.
    #[arg(long)]
    pub(crate) garbage: bool,
    /// Bytes of --garbage.
    #[arg(long, default_value_t = 64)]
    pub(crate) garbage_len: usize,
    /// Start with a TLS ClientHello-like (server: ServerHello-like) record instead of REDQ.
    #[arg(long)]
    pub(crate) tls_bytes: bool,
    /// SASL: the client advertises AUTH_SASL and picks mechanism 2; the server advertises
    /// AUTH_SASL, sends a zero public key and accepts SASL. After the handshake all data goes
    /// in 4-byte big-endian length-prefixed blobs (§1.6).
    #[arg(long)]
    pub(crate) sasl: bool,
    /// Fill every streamed message body with this ASCII string, repeated and cut at the
    /// body size (server: instead of --body-fill; client: instead of 0x5A), so that a test can
    /// grep an observer's outputs for plaintext it must never contain.
    #[arg(long)]
    pub(crate) body_marker: Option<String>,
    /// PRNG seed for --garbage and --tls-bytes.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Give up (exit 1) when a read, write, connect or accept waits longer than this.
    #[arg(long, default_value_t = 30000)]
    pub(crate) timeout_ms: u64,
}

#[derive(Clone, Debug, Args)]
pub(crate) struct ServerArgs {
    /// Address to listen on (port 0: any free port; the actual one is printed).
    #[arg(long)]
    pub(crate) listen: String,
    /// Data messages to stream after SET_ACK / MAIN_INIT.
    #[arg(long, default_value_t = 10)]
    pub(crate) messages: u64,
    /// Body bytes of each streamed message (0 allowed; see also --body-sizes).
    #[arg(long, default_value_t = 64)]
    pub(crate) body_size: u32,
    /// Comma-separated body sizes, taken in turn by the streamed messages and repeated from
    /// the first when the list runs out, instead of --body-size (e.g. `0,700,5,3000` with
    /// --batch 10: small and large messages mixed in each write call).
    #[arg(long, value_delimiter = ',', conflicts_with = "body_size")]
    pub(crate) body_sizes: Option<Vec<u32>>,
    /// Message type of the streamed messages (default DRAW_COPY).
    #[arg(long, default_value_t = 304)]
    pub(crate) msg_type: u16,
    /// Byte that fills the bodies.
    #[arg(long, value_parser = parse_u32, default_value = "0xA5")]
    pub(crate) body_fill: u32,
    /// Start with SET_ACK(--generation, --window) and obey the ACK gate (§3.4).
    #[arg(long)]
    pub(crate) set_ack: bool,
    /// ACK window W (needs --set-ack; default 20).
    #[arg(long)]
    pub(crate) window: Option<u32>,
    /// SET_ACK generation.
    #[arg(long, default_value_t = 1)]
    pub(crate) generation: u32,
    /// Send SET_ACK but ignore ACKs (no gate).
    #[arg(long)]
    pub(crate) ignore_acks: bool,
    /// Send a second SET_ACK after this many streamed messages (needs --set-ack): a new
    /// generation, as send_set_ack would start it (count reset to 1, §3.5).
    #[arg(long)]
    pub(crate) second_set_ack_after: Option<u64>,
    /// Generation of the second SET_ACK (default --generation + 1).
    #[arg(long)]
    pub(crate) second_generation: Option<u32>,
    /// Window of the second SET_ACK (default: the first one's).
    #[arg(long)]
    pub(crate) second_window: Option<u32>,
    /// Sleep this long before the second SET_ACK (lets the ACKs in flight arrive first).
    #[arg(long, default_value_t = 0)]
    pub(crate) second_set_ack_delay_ms: u64,
    /// Sleep this long before each streamed message is started, i.e. before it is counted and
    /// written (a slowly drawing guest). Unlike --pause-ms, nothing is counted during the sleep.
    #[arg(long, default_value_t = 0)]
    pub(crate) interval_ms: u64,
    /// Stop streaming (and finish normally) after waiting this long for an ACK.
    #[arg(long, default_value_t = 5000)]
    pub(crate) stall_timeout_ms: u64,
    /// Send main INIT with this session_id before the streamed messages.
    #[arg(long, value_parser = parse_u32)]
    pub(crate) main_init: Option<u32>,
    /// Refuse the link: an error reply with this SpiceLinkErr code, then close.
    #[arg(long, value_parser = parse_u32)]
    pub(crate) link_error: Option<u32>,
    /// Link result sent after the ticket (non-zero: close afterwards).
    #[arg(long, value_parser = parse_u32, default_value = "0")]
    pub(crate) result: u32,
    /// OK reply, then an error reply with this code where the result belongs (§1.7).
    #[arg(long, value_parser = parse_u32)]
    pub(crate) error_after_reply: Option<u32>,
    /// Write the link reply and its caps in one call (default: spice-server's pattern, reply
    /// in one write and each cap word in its own 4-byte write).
    #[arg(long)]
    pub(crate) link_one_write: bool,
    /// Write --garbage-bytes of junk into the data stream after this many data messages
    /// (SET_ACK and main INIT included), in a write call of its own; the streamed messages
    /// then go on. The junk's first two bytes are 0xFF (type 65535 where a header is due:
    /// invalid on every channel), the rest random (--seed). A client told the same with
    /// --skip-at / --skip-bytes skips it.
    #[arg(long)]
    pub(crate) garbage_at: Option<u64>,
    /// Bytes of --garbage-at junk (at least 2).
    #[arg(long, default_value_t = 64)]
    pub(crate) garbage_bytes: usize,
    #[command(flatten)]
    pub(crate) common: Common,
}

#[derive(Clone, Debug, Args)]
pub(crate) struct ClientArgs {
    /// Server address.
    #[arg(long)]
    pub(crate) connect: String,
    /// Channel type (1 main, 2 display, 3 inputs, 4 cursor, ...).
    #[arg(long, default_value_t = 2)]
    pub(crate) channel_type: u8,
    /// Channel id.
    #[arg(long, default_value_t = 0)]
    pub(crate) channel_id: u8,
    /// connection_id of the link message.
    #[arg(long, value_parser = parse_u32, default_value = "0")]
    pub(crate) connection_id: u32,
    /// caps_offset of the link message (≥ 18; zero padding after the fixed fields).
    #[arg(long, default_value_t = 18)]
    pub(crate) caps_offset: u32,
    /// Link header major version (spice-server accepts only 2).
    #[arg(long, default_value_t = 2)]
    pub(crate) major: u32,
    /// Auth mechanism word (default 1, or 2 with --sasl); only sent with AUTH_SELECTION.
    #[arg(long, value_parser = parse_u32)]
    pub(crate) auth_mechanism: Option<u32>,
    /// Send a WebSocket upgrade request ("GET ...") instead of the link message.
    #[arg(long)]
    pub(crate) websocket: bool,
    /// How ACKs are counted.
    #[arg(long, value_enum, default_value_t = AckCadence::Gtk)]
    pub(crate) ack_cadence: AckCadence,
    /// Never send ACK_SYNC or ACK.
    #[arg(long)]
    pub(crate) no_acks: bool,
    /// Sleep this long before each ACK.
    #[arg(long, default_value_t = 0)]
    pub(crate) ack_delay_ms: u64,
    /// Once, after this many messages following the last SET_ACK, send one ACK more than the
    /// cadence asks for (a surplus ACK when fewer than W messages are in flight, §3.5).
    #[arg(long)]
    pub(crate) surplus_ack_after: Option<u64>,
    /// Client messages to send after the link (from a second thread, while reading).
    #[arg(long, default_value_t = 0)]
    pub(crate) messages: u64,
    /// Body bytes of each client message.
    #[arg(long, default_value_t = 14)]
    pub(crate) body_size: u32,
    /// Type of the client messages (default 101: display INIT).
    #[arg(long, default_value_t = 101)]
    pub(crate) msg_type: u16,
    /// After this many data messages read (SET_ACK included), read and discard
    /// --skip-bytes bytes before the next header: the junk of a server's --garbage-at.
    #[arg(long)]
    pub(crate) skip_at: Option<u64>,
    /// Bytes --skip-at discards.
    #[arg(long, default_value_t = 64)]
    pub(crate) skip_bytes: usize,
    #[command(flatten)]
    pub(crate) common: Common,
}

impl Common {
    pub(crate) fn validate(&self) -> Result<(), String> {
        let multi_iov = matches!(
            self.send_syscall,
            SendSyscall::Writev | SendSyscall::Sendmsg
        );
        if self.iov_split && !multi_iov {
            return Err("--iov-split needs --send-syscall writev or sendmsg".into());
        }
        if self.sendfile_after == Some(0) {
            return Err(
                "--sendfile-after must be at least 1 (the link phase is written as usual)".into(),
            );
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
        if self
            .body_marker
            .as_deref()
            .is_some_and(|m| m.is_empty() || !m.is_ascii())
        {
            return Err("--body-marker must be a non-empty ASCII string".into());
        }
        Ok(())
    }

    /// A message body of `size` bytes: the --body-marker string repeated and cut at `size`,
    /// or `fill` repeated without one.
    pub(crate) fn body(&self, size: usize, fill: u8) -> Vec<u8> {
        match &self.body_marker {
            Some(m) => m.bytes().cycle().take(size).collect(),
            None => vec![fill; size],
        }
    }

    pub(crate) fn pattern_json(&self) -> Value {
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

    pub(crate) fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}
