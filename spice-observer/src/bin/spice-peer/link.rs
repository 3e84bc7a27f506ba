//! Pieces both scripts share: non-SPICE openings, caps, socket setup, link facts, ACK state, the SUMMARY.

use super::*;

/// Random bytes that do not start like REDQ, TLS, "GET " or "HTTP".
pub(crate) fn garbage(seed: u64, n: usize) -> Vec<u8> {
    let mut v = Rng(seed).bytes(n.max(1));
    if matches!(v[0], b'R' | b'G' | b'H' | 0x16) {
        v[0] ^= 0x80;
    }
    v
}

/// The junk of `--garbage-at`: `n` bytes (n ≥ 2), the first two 0xFF, so that where a data
/// header is due its type reads 65535 (no channel has it, `framing::MAX_MESSAGE_TYPE`), the
/// rest from the seeded generator.
pub(crate) fn stream_junk(seed: u64, n: usize) -> Vec<u8> {
    let mut v = Rng(seed).bytes(n.max(2));
    v[0] = 0xFF;
    v[1] = 0xFF;
    v
}

/// A TLS 1.2-style handshake record: ClientHello (type 1) or ServerHello (type 2).
pub(crate) fn tls_record(seed: u64, hello_type: u8) -> Vec<u8> {
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

pub(crate) const WEBSOCKET_GET: &[u8] = b"GET / HTTP/1.1\r\nHost: spice\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: binary\r\n\r\n";

pub(crate) fn le32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}

/// This side's first common-caps words.
pub(crate) fn own_common_caps(c: &Common, default: u32) -> Vec<u32> {
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
pub(crate) fn server_default_channel_caps(channel_type: u8) -> Vec<u32> {
    match channel_type {
        channel::MAIN => vec![0x0F],
        channel::DISPLAY => vec![(1 << 1) | (1 << 4) | (1 << 6) | (1 << 12)],
        channel::INPUTS => vec![0x01],
        channel::PLAYBACK => vec![(1 << 1) | (1 << 3)],
        channel::RECORD => vec![(1 << 1) | (1 << 2)],
        _ => vec![],
    }
}

pub(crate) fn setup_socket(s: &TcpStream, c: &Common) -> io::Result<()> {
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
pub(crate) struct LinkFacts {
    pub(crate) outcome: &'static str,
    pub(crate) channel_type: u8,
    pub(crate) channel_id: u8,
    pub(crate) connection_id: u32,
    pub(crate) client_link_size: Option<u32>,
    pub(crate) server_link_size: Option<u32>,
    pub(crate) client_common_caps: Vec<u32>,
    pub(crate) client_channel_caps: Vec<u32>,
    pub(crate) server_common_caps: Vec<u32>,
    pub(crate) server_channel_caps: Vec<u32>,
    pub(crate) auth_mechanism: Option<u32>,
    pub(crate) result: Option<u32>,
    pub(crate) refused: Option<u32>,
    pub(crate) error_after_reply: Option<u32>,
    pub(crate) peer_magic: Option<u32>,
    pub(crate) header: Option<HeaderKind>,
}

impl LinkFacts {
    /// What a client knows of its link before it starts: the channel it asks for
    /// (`--channel-type`, `--channel-id`, `--connection-id`), outcome "ok" so far.
    pub(crate) fn of_client(a: &ClientArgs) -> Self {
        LinkFacts {
            outcome: "ok",
            channel_type: a.channel_type,
            channel_id: a.channel_id,
            connection_id: a.connection_id,
            ..Default::default()
        }
    }

    pub(crate) fn json(&self) -> Value {
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
pub(crate) struct AckState {
    pub(crate) flow: bool,
    pub(crate) window: u32,
    pub(crate) generation: u32,
    /// spice-server's messages_window: 1 after SET_ACK, +1 per message start, −W per ACK.
    pub(crate) count: i64,
    pub(crate) max_count: i64,
    /// The same count as spice-server keeps it, a `uint32_t` (wraps below 0); the gate reads
    /// this one, like `waiting_for_ack()`.
    pub(crate) mw: u32,
    /// Highest count since the last SET_ACK.
    pub(crate) max_count_generation: i64,
    pub(crate) set_acks: u64,
    /// Matched ACKs that found fewer than W messages counted (mw wrapped).
    pub(crate) ack_surplus: u64,
    pub(crate) client_generation: Option<u32>,
    pub(crate) ack_syncs: u64,
    pub(crate) acks: u64,
    pub(crate) acks_matched: u64,
    pub(crate) waits: u64,
    pub(crate) stalled_timeout: bool,
    pub(crate) reader_done: bool,
}

impl AckState {
    /// spice-server's `send_set_ack` for a SET_ACK(`generation`, `window`) being sent:
    /// messages_window is reset to 0 and `begin_send_message` counts the SET_ACK itself, so
    /// the count is 1 (§3.4, §3.5).
    pub(crate) fn set_ack_sent(&mut self, generation: u32, window: u32) {
        self.generation = generation;
        self.window = window;
        self.count = 1;
        self.mw = 1;
        self.set_acks += 1;
        self.max_count_generation = 0;
    }

    /// spice-server's `waiting_for_ack()`: with flow control on, no new message starts while
    /// the (unsigned) count is above 2W (§3.4).
    pub(crate) fn waiting_for_ack(&self) -> bool {
        self.flow && self.mw > self.window.wrapping_mul(2)
    }

    /// Waits on `cv` (notified by the reader thread) while the window is full
    /// ([`Self::waiting_for_ack`]) and the reader still runs, until `deadline` at the latest;
    /// gives the guard back, for the caller to look at why the wait ended.
    pub(crate) fn wait_for_ack<'a>(
        mut s: std::sync::MutexGuard<'a, AckState>,
        cv: &std::sync::Condvar,
        deadline: Instant,
    ) -> std::sync::MutexGuard<'a, AckState> {
        while s.waiting_for_ack() && !s.reader_done {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = cv.wait_timeout(s, left).unwrap().0;
        }
        s
    }

    /// `begin_send_message` of one message (counted once a SET_ACK gave a window).
    pub(crate) fn message_started(&mut self) {
        if self.window > 0 {
            self.count += 1;
            self.mw = self.mw.wrapping_add(1);
        }
    }

    /// Updates the maxima after a change of the count.
    pub(crate) fn note_max(&mut self) {
        self.max_count = self.max_count.max(self.count);
        self.max_count_generation = self.max_count_generation.max(self.count);
    }
}

/// Client-side ACK accounting (§3.8).
#[derive(Debug, Default)]
pub(crate) struct ClientAcks {
    pub(crate) window: u32,
    pub(crate) generation: u32,
    pub(crate) counter: u32,
    pub(crate) ack_syncs_sent: u64,
    pub(crate) acks_sent: u64,
    /// Messages received since the last SET_ACK.
    pub(crate) since_set_ack: u64,
    /// Extra ACKs sent by --surplus-ack-after (also counted in acks_sent).
    pub(crate) surplus_acks_sent: u64,
}

/// The finished run: the SUMMARY object and whether the script completed.
pub(crate) struct Report {
    pub(crate) summary: Value,
    pub(crate) ok: bool,
}

pub(crate) fn mode_name(c: &Common, websocket: bool) -> &'static str {
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
pub(crate) fn summary(
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
