//! The `SUMMARY {json}` line `spice-peer` prints at the end of a run (src/bin/spice-peer.rs,
//! `summary()`), read into typed structs so that a field the peer did not write fails the test
//! instead of comparing as null. Every count is what the peer's own syscalls moved: the
//! source the kernel-path tests compare the observer with.

use std::collections::BTreeMap;

use anyhow::{Context, Result, anyhow, ensure};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Message type number (decimal string, as JSON object keys) → messages.
pub type ByType = BTreeMap<String, u64>;

/// Builds a [`ByType`] from `(type, messages)` pairs, for expected values.
pub fn by_type(pairs: &[(u16, u64)]) -> ByType {
    pairs.iter().map(|(t, n)| (t.to_string(), *n)).collect()
}

/// The whole SUMMARY object of one peer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerSummary {
    /// `server` or `client`.
    pub role: String,
    /// `spice`, `garbage`, `tls`, `sasl` or `websocket`.
    pub mode: String,
    /// `ok`, `link_refused`, `error`, … (what the link phase established or how it ended).
    pub outcome: String,
    pub channel: ChannelIds,
    /// Negotiated data header, `mini` or `full`; null when the link phase did not finish.
    pub header: Option<String>,
    pub link: LinkSummary,
    pub sent: SentSummary,
    pub received: ReceivedSummary,
    /// Server: [`ServerAcks`] or null (no SET_ACK sent); client: [`ClientAcks`]. Read with
    /// [`PeerSummary::server_acks`] / [`PeerSummary::client_acks`].
    pub acks: Value,
    pub write_pattern: WritePattern,
    /// The framing code fed this peer's own calls, per direction.
    pub framing: Framing,
    /// Why the peer gave up; null on success.
    pub error: Option<String>,
}

impl PeerSummary {
    /// The server's ACK accounting; fails if the server sent no SET_ACK (`acks` null) or a
    /// field is missing.
    pub fn server_acks(&self) -> Result<ServerAcks> {
        ensure!(
            !self.acks.is_null(),
            "{} summary: acks is null (no SET_ACK sent)",
            self.role
        );
        super::parse_typed(&self.acks, "server acks")
    }

    /// The client's ACK accounting; fails if a field is missing.
    pub fn client_acks(&self) -> Result<ClientAcks> {
        super::parse_typed(&self.acks, "client acks")
    }
}

/// The channel the client asked for in its link message.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChannelIds {
    /// Channel type number (1 main, 2 display, 3 inputs, 4 cursor).
    #[serde(rename = "type")]
    pub ty: u8,
    pub id: u8,
    pub connection_id: u32,
}

/// What the link phase exchanged.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LinkSummary {
    pub client_link_size: Option<u32>,
    pub server_link_size: Option<u32>,
    pub client_common_caps: Vec<u32>,
    pub client_channel_caps: Vec<u32>,
    pub server_common_caps: Vec<u32>,
    pub server_channel_caps: Vec<u32>,
    pub auth_mechanism: Option<u32>,
    pub result: Option<u32>,
    /// Link error code of a refusal reply.
    pub refused: Option<u32>,
    /// Error code of a link result sent after a good reply.
    pub error_after_reply: Option<u32>,
    pub peer_magic: Option<u32>,
}

/// What the peer's send calls moved.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SentSummary {
    pub direction: String,
    /// Bytes, link phase included.
    pub bytes: u64,
    pub link_bytes: u64,
    /// Bytes after the link phase (headers included).
    pub data_bytes: u64,
    pub messages: u64,
    pub by_type: ByType,
    /// Messages started and not completely written.
    pub unfinished_messages: u64,
    pub calls: u64,
    pub eagain: u64,
    pub short_writes: u64,
    /// Bytes of `--garbage-at` junk written into the data stream (in `data_bytes`, no
    /// message).
    pub junk_bytes: u64,
    /// Calls made with sendfile(2) (`--sendfile-after`).
    pub sendfile_calls: u64,
}

/// What the peer's receive calls moved.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReceivedSummary {
    pub direction: String,
    pub bytes: u64,
    pub link_bytes: u64,
    pub data_bytes: u64,
    pub messages: u64,
    pub by_type: ByType,
    pub calls: u64,
    pub eagain: u64,
    pub eof: bool,
    /// Data bytes `--skip-at` discarded (in `data_bytes`, no message).
    pub junk_bytes: u64,
}

/// How the peer cut its calls (the options it ran with).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WritePattern {
    pub send_syscall: String,
    pub recv_syscall: String,
}

/// Both directions of [`FrameTally`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Framing {
    pub c2s: FrameTally,
    pub s2c: FrameTally,
}

/// The framing code (`spice-ebpf-common`) fed one direction's calls as the peer made them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FrameTally {
    pub bytes: u64,
    pub calls: u64,
    pub messages: u64,
    pub by_type: ByType,
    /// Messages flagged as already reported by an EAGAIN peek.
    pub already_reported: u64,
    /// Message starts found by peeking at a send that failed with EAGAIN.
    pub peeked: u64,
    /// Messages flagged already reported that differ from what the peek reported.
    pub peek_mismatched: u64,
    pub unparsed: Option<Unparsed>,
}

/// Why the framing code stopped.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Unparsed {
    pub reason: String,
    pub detail: u32,
    pub at: u64,
}

/// Server-side ACK accounting (spice-server's `messages_window` rule).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ServerAcks {
    pub flow_control: bool,
    pub window: u32,
    pub generation: u32,
    /// 1 after SET_ACK, +1 per message start, −W per ACK, at the end.
    pub final_count: i64,
    pub max_count: i64,
    /// The same count as spice-server keeps it, a `uint32_t` (wraps below 0).
    pub messages_window: u32,
    /// Highest count since the last SET_ACK.
    pub max_count_generation: i64,
    pub set_acks: u64,
    /// Matched ACKs that found fewer than W messages counted (`messages_window` wrapped).
    pub ack_surplus: u64,
    pub client_generation: Option<u32>,
    pub ack_syncs: u64,
    pub acks: u64,
    /// ACKs whose generation matched.
    pub acks_matched: u64,
    pub gate_waits: u64,
    /// The server waited at 2W+1 until its stall timeout.
    pub stalled_timeout: bool,
}

/// Client-side ACK accounting.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClientAcks {
    /// `gtk` or `html5`.
    pub cadence: String,
    pub window: u32,
    pub generation: u32,
    pub ack_syncs_sent: u64,
    pub acks_sent: u64,
}

/// Finds the one `SUMMARY ` line of a peer's stdout and reads it.
pub fn parse_summary(stdout: &str, what: &str) -> Result<PeerSummary> {
    let lines: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("SUMMARY "))
        .collect();
    ensure!(
        lines.len() == 1,
        "{what}: {} SUMMARY lines in {stdout:?}",
        lines.len()
    );
    let raw: Value = serde_json::from_str(lines[0]).with_context(|| format!("{what}: SUMMARY"))?;
    super::parse_typed(&raw, what).map_err(|e| anyhow!("{what}: {e:#}"))
}
