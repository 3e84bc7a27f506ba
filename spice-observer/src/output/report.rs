//! The end-of-run report: one row per channel (socket), a verdict per display channel, and
//! the `--json` document. Field names are part of the CLI contract (README "JSON output").

use std::{collections::BTreeMap, fmt::Write as _};

use serde::{Deserialize, Deserializer, Serialize};
use spice_ebpf_common::{
    config::counter,
    event::TcpSnapshot,
    framing::UnparsedReason,
    protocol::{channel, channel_type_name, link_error_name},
};

use crate::model::joined::WindowSource;
use crate::model::tls::TlsAttach;
pub use crate::model::window::InFlightHistogram;
use crate::model::{
    Model, SocketModel,
    chain::{Chain, STAGES, Transparency},
};

/// Reads an `Option` field that must be present (as a value or `null`): serde alone would
/// read a missing `Option` field as `None`.
pub(crate) fn required<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<T>, D::Error> {
    Option::<T>::deserialize(d)
}

/// What the libssl hooks could do for one watched process ([`Report::tls_processes`], from
/// [`crate::model::Model::tls_attach`] as the front end reported it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TlsProcessReport {
    pub pid: u32,
    pub comm: String,
    /// `attached` (uprobes on the process's libssl), `no_libssl` (it maps none: linked
    /// statically, another TLS library, or not loaded yet), `failed` (attaching failed, see
    /// `error`), `disabled` (`--no-tls-hooks`): [`TlsAttach::state`].
    pub state: String,
    /// The libssl file, as the process maps it (`attached`, `failed`); null otherwise.
    #[serde(deserialize_with = "required")]
    pub library: Option<String>,
    /// Why attaching failed (`failed`); null otherwise.
    #[serde(deserialize_with = "required")]
    pub error: Option<String>,
}

impl TlsProcessReport {
    /// The row of process `pid` named `comm` with hook status `a`.
    pub fn new(pid: u32, comm: String, a: &TlsAttach) -> Self {
        let (library, error) = match a {
            TlsAttach::Attached { library } => (Some(library.clone()), None),
            TlsAttach::Failed { library, error } => (Some(library.clone()), Some(error.clone())),
            TlsAttach::NoLibrary | TlsAttach::Disabled => (None, None),
        };
        Self {
            pid,
            comm,
            state: a.state().into(),
            library,
            error,
        }
    }
}

/// A TLS socket's plaintext side ([`ChannelReport::tls`]): the framing, message counts and
/// offsets of such a channel are of the plaintext the process hands to libssl (uprobes on
/// SSL_write / SSL_read and their _ex forms), placed in TCP sequence space by one mark per
/// call ([`crate::model::tls`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TlsChannelReport {
    /// The libssl file the hooks are attached to in the socket's process; null when the front
    /// end reports no attached library for it (any more).
    #[serde(deserialize_with = "required")]
    pub library: Option<String>,
    /// libssl calls that moved plaintext on this socket (marks seen): SSL_write /
    /// SSL_write_ex (sent), SSL_read / SSL_read_ex (received).
    pub plaintext_calls_sent: u64,
    pub plaintext_calls_received: u64,
    /// Marks the agent keeps now, both directions (bounded: at most 4096 per direction).
    pub marks_kept: usize,
    /// Plaintext bytes written / read through libssl on this socket (the kernel's
    /// `DirState::pos` of a TLS socket, or the newest mark's end). `bytes_written_total` and
    /// `bytes_read_total` stay TCP bytes (TLS records).
    pub plaintext_bytes_sent: u64,
    pub plaintext_bytes_received: u64,
}

impl TlsChannelReport {
    /// From a TLS socket's model; `library` from the front end's status of its process.
    pub fn of(s: &SocketModel, library: Option<String>) -> Option<Self> {
        s.tls.as_ref()?;
        let t = |d: usize| s.dirs[d].tls.as_ref();
        Some(Self {
            library,
            plaintext_calls_sent: t(0).map_or(0, |t| t.calls),
            plaintext_calls_received: t(1).map_or(0, |t| t.calls),
            marks_kept: (0..2).filter_map(t).map(|t| t.marks.len()).sum(),
            plaintext_bytes_sent: t(0).map_or(0, |t| t.plain_bytes),
            plaintext_bytes_received: t(1).map_or(0, |t| t.plain_bytes),
        })
    }
}

/// `unparsed_detail` of a socket NOT carried by TLS whose bytes are TLS records (`unparsed:
/// tls`): why its plaintext is not visible, from the libssl hook status of its process
/// (`a`; `None` when the front end reported none).
pub fn tls_unparsed_detail(pid: u32, comm: &str, a: Option<&TlsAttach>) -> String {
    match a {
        Some(TlsAttach::NoLibrary) => format!(
            "process {pid} ({comm}) maps no libssl: linked statically or using another TLS library, so its TLS plaintext cannot be hooked"
        ),
        Some(TlsAttach::Failed { library, error }) => {
            format!("uprobes on {library} failed: {error}")
        }
        Some(TlsAttach::Attached { .. }) => "the connection's first bytes moved outside the libssl hooks (it started before they were attached)".into(),
        Some(TlsAttach::Disabled) => "TLS hooks disabled (--no-tls-hooks)".into(),
        None => "TLS hooks not attached for this process".into(),
    }
}

/// TCP state of one socket at the end of the run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TcpReport {
    /// Smoothed RTT, microseconds.
    pub srtt_us: u32,
    /// Congestion window, segments.
    pub cwnd_segments: u32,
    /// Bytes written by the application and not yet sent (write_seq − snd_nxt).
    pub notsent_bytes: u32,
    /// Largest notsent seen in the samples taken during the run, bytes.
    pub notsent_max_bytes: u32,
    /// Segments sent and not yet acknowledged.
    pub unacked_segments: u32,
    /// Retransmitted segments over the connection's life.
    pub total_retrans: u32,
    /// Bytes received and not yet read by the application (rcv_nxt − copied_seq).
    pub recv_queue_bytes: u32,
    /// Where the values come from: `sock_diag` (end-of-run netlink snapshot), `kernel_hooks`
    /// (last socket call or sockops callback), or `close` (the close tracepoint).
    pub source: String,
    /// `tcpi_delivery_rate` of the sock_diag snapshot: the kernel's latest delivery-rate
    /// sample, bytes per second; null when `source` is not `sock_diag` (the hooks do not read
    /// it).
    pub delivery_rate_bytes_per_s: Option<u64>,
}

impl TcpReport {
    /// From a kernel-hook snapshot.
    pub fn from_snapshot(s: &TcpSnapshot, notsent_max: u32, source: &'static str) -> Self {
        let notsent = s.write_seq.wrapping_sub(s.snd_nxt);
        let rq = s.rcv_nxt.wrapping_sub(s.copied_seq);
        Self {
            srtt_us: s.srtt_us,
            cwnd_segments: s.snd_cwnd,
            notsent_bytes: if notsent < 1 << 31 { notsent } else { 0 },
            notsent_max_bytes: notsent_max.max(if notsent < 1 << 31 { notsent } else { 0 }),
            unacked_segments: s.packets_out,
            total_retrans: s.total_retrans,
            recv_queue_bytes: if rq < 1 << 31 { rq } else { 0 },
            source: source.into(),
            delivery_rate_bytes_per_s: None,
        }
    }
}

/// Rates of the server → client direction of one channel.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FlowReport {
    pub messages: u64,
    pub bytes: u64,
    pub messages_per_s: f64,
    pub mbit_per_s: f64,
    /// Mean message size (header + body), bytes.
    pub mean_message_bytes: f64,
}

/// Every byte the watched process moved on one socket by traced calls, framed or not
/// (hunting, unparsed, joined mid-stream, not SPICE), from the kernel's `DirState::pos` of
/// each direction at the agent's reads of its socket map (every sample and once at the end;
/// [`crate::model::traced`]). Bytes of calls the hooks do not trace (sendfile, splice) are not
/// in it. Flattened into [`ChannelReport`]: its fields are the channel's own in the JSON.
/// All `null` until the first read of the socket's kernel entry (a socket that moved nothing
/// since the agent found it has none). For a socket that closed, the figures are those of
/// the newest read before the close (bytes moved after it are not in them).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SocketBytesReport {
    /// Bytes written / read by the watched process on this socket since observation began
    /// (since the kernel's entry began, for a socket taken over from the pinned socket map:
    /// a restarted daemon's, an `observe` beside the daemon's). Distinct from `bytes_sent` /
    /// `bytes_received`, which count the bytes of framed SPICE messages only: on a socket
    /// framed from its start these also hold the link phase, and a message begun but not all
    /// moved at the read is whole in those.
    pub bytes_written_total: Option<u64>,
    pub bytes_read_total: Option<u64>,
    /// Mean rates, bytes per second: from when the agent first knew the socket (the restore,
    /// for a socket taken over from pinned state) to the newest read.
    pub bytes_written_per_s: Option<f64>,
    pub bytes_read_per_s: Option<f64>,
    /// Rates over the newest second of reads (the newest read against the newest read at
    /// least 1 s before it, or the first), bytes per second.
    pub bytes_written_per_s_now: Option<f64>,
    pub bytes_read_per_s_now: Option<f64>,
    /// Seconds after the socket was first seen of the newest read the figures are from.
    pub byte_totals_at_s: Option<f64>,
}

impl SocketBytesReport {
    /// From a socket's model ([`crate::model::DirStats::traced`] of both directions).
    pub fn of(s: &SocketModel) -> Self {
        let [w, r] = [&s.dirs[0].traced, &s.dirs[1].traced];
        SocketBytesReport {
            bytes_written_total: w.total,
            bytes_read_total: r.total,
            bytes_written_per_s: w.rate_mean(),
            bytes_read_per_s: r.rate_mean(),
            bytes_written_per_s_now: w.rate_now(),
            bytes_read_per_s_now: r.rate_now(),
            byte_totals_at_s: w
                .read_at_s(s.first_ns)
                .into_iter()
                .chain(r.read_at_s(s.first_ns))
                .reduce(f64::max),
        }
    }

    /// The mean rate of these bytes both ways (written + read), Mbit/s, for the table's
    /// MBIT/S column of a socket without framed server → client messages: without framing
    /// the direction that carries the server's messages is not known for sure (a non-SPICE
    /// stream has none). `None` before a read.
    pub fn both_ways_mbit(&self) -> Option<f64> {
        Some((self.bytes_written_per_s? + self.bytes_read_per_s?) * 8.0 / 1e6)
    }
}

/// One stage's statistics over the samples (counts in messages, bytes of the in-flight range).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StageStat {
    pub now: u32,
    pub p50: u32,
    pub max: u32,
    pub bytes_p50: u64,
}

/// How a channel's chain (spice-server → relay → client) was assembled and sampled.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ChainReport {
    /// The relay's socket toward spice-server (same TCP connection), `"laddr:port->raddr:port"`.
    pub backend: Option<String>,
    /// The relay's socket toward the client carrying the same channel.
    pub client_leg: Option<String>,
    pub relay_pid: Option<u32>,
    /// Why the legs were paired.
    pub pairing: Vec<String>,
    /// `no_relay`, `unknown` (nothing compared yet), `transparent`, or `changed` (the relay
    /// inserted, dropped or rewrote a message: stages past its receive queue are not placed).
    pub transparency: String,
    pub transparency_detail: Option<String>,
    /// Stages this chain can place.
    pub placeable_stages: Vec<String>,
    /// Samples taken, and those with every socket's TCP position available.
    pub samples: usize,
    pub samples_placed: usize,
    /// Placed samples where at least one stage boundary was clamped: the positions read
    /// (sock_diag dump, the hooks' TCP state) disagreed with the data path's
    /// order or lay beyond the newest in-flight message's end ([`crate::model::chain::place`]).
    pub clamped_samples: usize,
    /// Most boundaries clamped in one sample (0 to 7).
    pub clamped_max: u32,
    /// Samples where the agent kept fewer in-flight messages than spice-server's count (the
    /// rest are unplaced).
    pub kept_short_samples: usize,
    /// Most messages unplaced in one placed sample: counted but not placeable (beyond the
    /// receive queue of a relay that changes the stream, or not kept).
    pub unplaced_max: u32,
    /// Median delivery rate the kernel measured on the client-facing link over the samples
    /// (`tcpi_delivery_rate`), Mbit/s: what the link delivers.
    pub link_rate_mbit: Option<f64>,
    /// Throughput delivered on the client-facing link (bytes TCP-acknowledged by the client, or
    /// by the relay's peer) over the samples, Mbit/s.
    pub link_delivered_mbit: Option<f64>,
    /// Share of the run the client's receive window limited the client-facing link
    /// (`tcpi_rwnd_limited` over elapsed time).
    pub link_rwnd_limited_fraction: Option<f64>,
    /// smoothed RTT of the client-facing link, microseconds.
    pub link_srtt_us: Option<u32>,
    /// Samples where the relay-visible count was above spice-server's count (never expected:
    /// a relay cannot have read more than spice-server started).
    pub relay_above_true_samples: usize,
    /// Share of samples where the relay-visible count was below spice-server's count.
    pub relay_below_true_fraction: Option<f64>,
    /// Share of samples where the gap (true − relay-visible) equals, within one message, the
    /// messages placed before the relay has read them (server_writing + server_notsent +
    /// server_unacked + proxy_recv_queue).
    pub relay_gap_upstream_fraction: Option<f64>,
}

/// One watched socket (a SPICE channel when framed).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChannelReport {
    /// `"laddr:lport->raddr:rport"`.
    pub socket: String,
    pub cookie: u64,
    pub pid: u32,
    pub comm: String,
    /// `"server"` if the watched process is the server end of this TCP connection (it read
    /// the client's link message: spice-server, or a relay's client-facing leg), `"client"`
    /// if it is the client end (a relay's leg toward spice-server), null if not known.
    pub end: Option<String>,
    pub session_id: Option<u32>,
    pub channel_type: String,
    pub channel_id: Option<u8>,
    /// `channel_type` was inferred from the message types seen (the link phase was not seen:
    /// joined mid-stream), not read from the link message; `channel_id` is null then.
    pub channel_type_inferred: bool,
    /// For a socket whose link phase was not seen: why `channel_type` was inferred, or why
    /// it stays `"unknown"`. Null when the link message told.
    pub channel_type_evidence: Option<String>,
    /// `end` was inferred from the message types (no link phase seen, no role from how the
    /// socket was made).
    pub end_inferred: bool,
    /// The session this socket belongs to, named by its main channel's `socket`: from equal
    /// session ids, or inferred (`session_inferred`) from the client's address around the one
    /// main channel of the process. Null when neither groups it. `session_id` is never
    /// inferred.
    pub session_key: Option<String>,
    pub session_inferred: bool,
    /// Why the socket was grouped into `session_key`.
    pub session_evidence: Option<String>,
    /// `"mini"`, `"full"`, `"unparsed"`, `"hunting"` (joined mid-stream or lost sync, no
    /// message boundaries found yet in either direction) or `"pending"` (link phase not
    /// finished).
    pub framing: String,
    /// `"tls"`: the socket carries TLS and is framed from the plaintext at the libssl hooks
    /// (its framing, messages, offsets and window are the plaintext's; see `tls`). `"tcp"`:
    /// framed from the socket's own bytes (a socket whose bytes are TLS records the hooks did
    /// not see stays `unparsed_reason` `tls`).
    pub transport: String,
    /// The plaintext side of a `"tls"` socket; null for `"tcp"`.
    #[serde(deserialize_with = "required")]
    pub tls: Option<TlsChannelReport>,
    /// How each direction found its message boundaries when it had to hunt for them (a
    /// connection open before observation started, or a header that failed validation);
    /// null for a direction framed from its link phase without a resync.
    pub sync_sent: Option<SyncReport>,
    pub sync_received: Option<SyncReport>,
    pub unparsed_reason: Option<String>,
    /// Human-readable detail of `unparsed_reason`.
    pub unparsed_detail: Option<String>,
    /// W from the last SET_ACK (display and cursor only), messages.
    pub window: Option<u32>,
    /// Generation from the last SET_ACK.
    pub ack_generation: Option<u32>,
    /// Generation from the last ACK_SYNC.
    pub ack_sync_generation: Option<u32>,
    pub set_acks: u64,
    /// Generations this connection had: each SET_ACK opens one (spice-server resets its count
    /// there, docs/spice-protocol.md §3.5). The window statistics below (`in_flight_p50`,
    /// `in_flight_max`, `stalled_fraction`, `stalls`) are the last generation's. spice-server
    /// 0.14 and 0.15 send one SET_ACK per connection, so this is 1 there.
    pub generations: u64,
    pub ack_syncs: u64,
    /// ACKs that matched the generation (each subtracted W), all generations.
    pub acks: u64,
    /// ACKs dropped: no ACK_SYNC before them, or a different generation.
    pub acks_ignored: u64,
    /// Matched ACKs that found fewer than W messages in flight. spice-server's unsigned count
    /// wraps around on such an ACK and the connection waits for an ACK for good (§3.5); the
    /// in-flight count shows 0 then, never a negative value. 0 with well-behaved clients.
    pub ack_surplus: u64,
    /// Messages the watched process wrote on this socket, and their bytes (headers included).
    pub messages_sent: u64,
    pub bytes_sent: u64,
    pub messages_received: u64,
    pub bytes_received: u64,
    /// Message type number → messages written / read.
    pub messages_sent_by_type: BTreeMap<String, u64>,
    pub messages_received_by_type: BTreeMap<String, u64>,
    /// Message type number → bytes (headers included) written / read.
    pub bytes_sent_by_type: BTreeMap<String, u64>,
    pub bytes_received_by_type: BTreeMap<String, u64>,
    /// Written messages first seen on a send that failed with EAGAIN (already counted by
    /// spice-server then).
    pub messages_sent_eagain_start: u64,
    /// Server → client flow (whichever way it goes relative to the watched process).
    pub server_to_client: FlowReport,
    /// spice-server's in-flight count (its `messages_window`): now, and the time-weighted
    /// median and maximum since the last SET_ACK, in messages; `in_flight_limit` = 2W+1. Never
    /// negative (the model keeps it as a `u32`; see `ack_surplus`); `i64` in this struct only so
    /// that code comparing it with signed counts (e.g. a peer's) needs no casts.
    pub in_flight_now: Option<i64>,
    pub in_flight_p50: Option<i64>,
    pub in_flight_max: Option<i64>,
    pub in_flight_limit: Option<i64>,
    /// spice-server's in-flight count as an interval that always contains it, messages: equal
    /// to `in_flight_now` on a connection seen from its SET_ACK; on a connection joined
    /// mid-stream from [`crate::model::joined::JoinedWindow`] (README "Joined connections").
    /// Null without a window (no SET_ACK, and for a joined connection not counting yet).
    pub in_flight_low: Option<i64>,
    pub in_flight_high: Option<i64>,
    /// `in_flight_low` = `in_flight_high` (then `in_flight_now` holds the value).
    pub in_flight_exact: bool,
    /// The count is an interval, not a value: stages are placed for `in_flight_low` messages
    /// (those known to be in flight).
    pub in_flight_bounded: bool,
    /// `window` came from the ACK cadence of a joined connection, not from a SET_ACK.
    pub window_inferred: bool,
    /// Where `window` came from: `"set_ack"`, `"ack_cadence"`, or null (not known).
    pub window_source: Option<String>,
    /// The interval model of a connection joined mid-stream; null for others.
    pub joined_window: Option<JoinedWindowReport>,
    /// Fraction of time since the last SET_ACK that spice-server waited for an ACK (its count
    /// above 2W) (0..1).
    pub stalled_fraction: Option<f64>,
    /// Times spice-server began waiting for an ACK since the last SET_ACK.
    pub stalls: u64,
    /// Seconds spice-server waited for an ACK over the socket's life, every generation (a
    /// counter: it never decreases from one snapshot to the next). 0 without a SET_ACK.
    pub stalled_seconds_total: f64,
    /// Times spice-server began waiting for an ACK, every generation (a counter).
    pub stalls_total: u64,
    /// Time-weighted histogram of spice-server's in-flight count over every generation
    /// (buckets 0, W/4, W/2, W, 3W/2, 2W, 2W+1, 2W+2 of the current W; seconds cumulative);
    /// null without a SET_ACK.
    pub in_flight_histogram: Option<InFlightHistogram>,
    /// Message starts above 2W not explained by an urgent pair (always 0 for spice-server).
    pub starts_while_stalled: u64,
    /// Starts at 2W+1 right after an urgent INVAL_LIST / LIST (peak 2W+2, allowed).
    pub urgent_pair_peaks: u64,
    /// Message records lost between kernel and agent for this socket.
    pub records_lost: u64,
    /// The kernel's own state of this socket (`SOCKETS`) at the newest read the agent could
    /// compare with the record-derived figures above; null if no read was compared (the
    /// socket closed before a sample read it, or it carried no message).
    pub kernel_window: Option<KernelWindowReport>,
    /// Seconds this socket was observed.
    pub observed_s: f64,
    pub closed: bool,
    pub tcp: Option<TcpReport>,
    /// Every byte moved by traced calls, framed or not (flattened: `bytes_written_total`, …).
    #[serde(flatten)]
    pub traffic: SocketBytesReport,
    /// The count a relay-side observer reports (messages the relay read from spice-server
    /// minus W × the ACKs it passed on): time-weighted median and maximum. Relay chains only.
    pub in_flight_relay_p50: Option<i64>,
    pub in_flight_relay_max: Option<i64>,
    /// The relay-visible count at the newest sample. Relay chains only.
    pub in_flight_relay_now: Option<i64>,
    /// Where spice-server's in-flight messages are: stage → statistics over the samples.
    pub stages: Option<BTreeMap<String, StageStat>>,
    pub chain: Option<ChainReport>,
    /// Messages sent per smoothed RTT of the client-facing link (compare with 2W+1).
    pub messages_per_srtt: Option<f64>,
    /// The window's throughput ceiling 2W / (srtt + W × mean message size / link rate),
    /// messages per second.
    pub window_ceiling_msgs_per_s: Option<f64>,
    /// One-line judgement (display channels).
    pub verdict: Option<String>,
}

/// How the window of a connection joined mid-stream is known ([`ChannelReport::joined_window`],
/// [`crate::model::joined::JoinedWindow`]). Times are seconds since the observation's start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JoinedWindowReport {
    /// When counting began (both directions locked), the last time; null while not counting.
    pub counting_since_s: Option<f64>,
    /// Candidate W values still possible (1..=128 at first), and the list when 16 or fewer.
    pub window_candidates: u32,
    pub window_candidate_list: Option<Vec<u32>>,
    /// When W became known, and why (human-readable); null while not known.
    pub window_known_s: Option<f64>,
    pub window_reason: Option<String>,
    /// When the interval became one value, and why: `"set_ack"`, `"stall"` (a stall at the
    /// window pinned it) or `"constraints"`; null while it is an interval.
    pub exact_since_s: Option<f64>,
    pub exact_reason: Option<String>,
    /// Stall pins applied, and those ignored because the interval excluded them.
    pub pins: u64,
    pub pins_rejected: u64,
    /// Times counting started again from the full interval, and the last reason
    /// (`"resync"`, `"lost_records"`, `"no_candidate"`).
    pub restarts: u64,
    pub last_restart: Option<String>,
    /// ACK records seen on the connection (the position of this reading, with
    /// `server_to_client.messages`).
    pub acks: u64,
}

impl JoinedWindowReport {
    /// From the model `j`; `start_ns`: the observation's start (CLOCK_MONOTONIC ns).
    pub fn new(j: &crate::model::joined::JoinedWindow, start_ns: u64) -> Self {
        let secs = |ns: u64| ns.saturating_sub(start_ns) as f64 / 1e9;
        let cands: Vec<u32> = j.candidates().map(|c| c.window).collect();
        Self {
            counting_since_s: j.counting_since_ns.map(secs),
            window_candidates: cands.len() as u32,
            window_candidate_list: (cands.len() <= 16).then_some(cands),
            window_known_s: j.window().and(j.window_known).map(|k| secs(k.0)),
            window_reason: j.window_reason(),
            exact_since_s: j.exact_since.map(|e| secs(e.0)),
            exact_reason: j.exact_since.map(|e| e.1.name().to_string()),
            pins: j.pins,
            pins_rejected: j.pins_rejected,
            restarts: j.restarts,
            last_restart: j.last_restart.map(|r| r.name().to_string()),
            acks: j.acks,
        }
    }
}

/// Fills the window-interval fields of `c` for socket `s`: from the exact window when a
/// SET_ACK was seen, from the joined model on a connection joined mid-stream (which also
/// gives `window`, `in_flight_limit` and, once exact, `in_flight_now`).
fn window_interval(c: &mut ChannelReport, s: &SocketModel, start_ns: u64) {
    if let Some(j) = s.joined.as_deref() {
        if s.dirs.iter().any(|d| d.resyncs > 0) {
            // A connection framed from its link phase that resynced: the kernel's count
            // (`in_flight_now` so far) misses the hunt's messages; the interval replaces it.
            c.in_flight_now = None;
        }
        c.joined_window = Some(JoinedWindowReport::new(j, start_ns));
        if let Some(w) = j.window() {
            c.window_source = j.window_source().map(|x| x.name().to_string());
            c.window_inferred = j.window_source() == Some(WindowSource::AckCadence);
            if c.window.is_none() {
                c.window = Some(w);
                c.in_flight_limit = Some(2 * i64::from(w) + 1);
            }
        }
        if let Some(i) = j.interval() {
            c.in_flight_low = Some(i64::from(i.low));
            c.in_flight_high = Some(i64::from(i.high));
            c.in_flight_exact = i.exact();
            c.in_flight_bounded = !i.exact();
            if i.exact() && c.in_flight_now.is_none() {
                c.in_flight_now = Some(i64::from(i.low));
            }
        }
        return;
    }
    if s.window.active() {
        c.window_source = Some(WindowSource::SetAck.name().to_string());
        if s.dirs.iter().any(|d| d.resyncs > 0) {
            // Hunting after a resync, not locked again yet: the kernel's count misses the
            // messages of the hunt, so only the window's bounds hold.
            c.in_flight_now = None;
            c.in_flight_low = Some(0);
            c.in_flight_high = Some(i64::from(s.window.limit()));
            c.in_flight_bounded = true;
            return;
        }
        let n = i64::from(s.window.count);
        c.in_flight_low = Some(n);
        c.in_flight_high = Some(n);
        c.in_flight_exact = true;
    }
}

/// Hunting and locking of one direction ([`ChannelReport::sync_sent`] /
/// [`ChannelReport::sync_received`]). Its message counts start at its first lock: the messages
/// before it (and those inside any later hunt) are not counted, their bytes are in
/// `unframed_bytes`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SyncReport {
    /// Still hunting now (no boundaries since the last hunt began).
    pub hunting: bool,
    /// Why the latest hunt began: `attached_mid_stream` (the connection was open before
    /// observation started), `bad_header` (a header failed validation: a resync).
    pub reason: String,
    /// When the latest hunt began, seconds since the report's clock start (may be negative
    /// for a connection found open at start: 0 there).
    pub hunt_began_s: f64,
    /// When the newest lock happened, seconds since the report's clock start, and CLOCK_MONOTONIC
    /// ns (to compare with another observer's timeline); null while never locked.
    pub locked_at_s: Option<f64>,
    pub locked_mono_ns: Option<u64>,
    /// Seconds from the start of that hunt to the lock.
    pub hunted_s: Option<f64>,
    /// What the validated chain began at: `send_after_complete`, `recv_header_read` or
    /// `content` (see `spice_ebpf_common::event::lock_how`).
    pub how: Option<String>,
    /// Consecutive headers validated before the lock.
    pub run: Option<u8>,
    /// Ordinal (`messages_sent` / `messages_received` numbering) of the first counted
    /// message after the newest lock.
    pub first_index: Option<u64>,
    /// Locks found and lost (resyncs: a locked stream whose header failed validation).
    pub locks: u32,
    pub resyncs: u32,
    /// Bytes of this direction not framed because it was hunting, finished hunts only.
    pub unframed_bytes: u64,
}

impl SyncReport {
    /// The report of direction `d` (`None` if it never hunted); times relative to
    /// `start_ns` (CLOCK_MONOTONIC).
    pub fn new(d: &crate::model::DirStats, start_ns: u64) -> Option<Self> {
        if d.hunting.is_none() && d.locked.is_none() {
            return None;
        }
        let rel = |ns: u64| (ns as f64 - start_ns as f64).max(0.0) / 1e9;
        let reason = d
            .hunting
            .map(|h| h.reason)
            .or(if d.resyncs > 0 {
                Some(UnparsedReason::BadHeader)
            } else {
                Some(UnparsedReason::AttachedMidStream)
            })
            .unwrap_or(UnparsedReason::AttachedMidStream);
        let began = d
            .hunting
            .map(|h| h.since_ns)
            .or(d.locked.map(|l| l.ts_ns.saturating_sub(l.hunted_ns)))
            .unwrap_or(start_ns);
        Some(SyncReport {
            hunting: d.hunting.is_some(),
            reason: reason.name().into(),
            hunt_began_s: rel(began),
            locked_at_s: d.locked.map(|l| rel(l.ts_ns)),
            locked_mono_ns: d.locked.map(|l| l.ts_ns),
            hunted_s: d.locked.map(|l| l.hunted_ns as f64 / 1e9),
            how: d
                .locked
                .map(|l| spice_ebpf_common::event::lock_how::name(l.how).into()),
            run: d.locked.map(|l| l.run),
            first_index: d.locked.map(|l| l.index),
            locks: d.locks,
            resyncs: d.resyncs,
            unframed_bytes: d.unframed,
        })
    }
}

/// The kernel's window state and byte totals of one socket, as read from its `SOCKETS` entry
/// (`spice_ebpf_common::window::WindowState`, `SockState::msg_bytes`), and how the agent's
/// record-derived figures compared with such reads. Field meanings as in [`ChannelReport`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelWindowReport {
    /// Seconds after the socket was first seen of the read shown.
    pub read_at_s: f64,
    /// The kernel's in-flight count and spice-server's `messages_window` (`uint32_t`).
    pub count: u32,
    pub messages_window: u32,
    /// W and generation of the last SET_ACK (0 before any), generation of the last ACK_SYNC.
    pub window: u32,
    pub generation: u32,
    pub ack_sync_generation: Option<u32>,
    pub set_acks: u64,
    pub ack_syncs: u64,
    pub acks: u64,
    pub acks_ignored: u64,
    pub ack_surplus: u64,
    /// Highest count of the current generation.
    pub max: u32,
    pub stalls_total: u64,
    pub starts_while_stalled: u64,
    pub urgent_pair_peaks: u64,
    pub messages_after_set_ack: u64,
    /// Messages the kernel had applied in each direction, and their bytes (headers
    /// included): written and read by the watched process.
    pub messages_sent: u64,
    pub messages_received: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Reads compared with the record-derived state, and those that differed.
    pub compared: u64,
    pub differed: u64,
    /// Fields that differed in the newest read that differed (empty if none did).
    pub differences: Vec<String>,
    /// Reads that differed after records of the socket were lost, from which the agent took
    /// the window's counters (and its record-derived byte totals) over.
    pub resynced: u64,
}

impl KernelWindowReport {
    /// From a socket's comparisons (its newest compared read); `None` if none was compared.
    /// `first_ns`: when the socket was first seen (CLOCK_MONOTONIC ns).
    pub fn new(k: &crate::model::KernelCheck, first_ns: u64) -> Option<Self> {
        let r = k.last?;
        let w = &r.window;
        Some(KernelWindowReport {
            read_at_s: r.read_ns.saturating_sub(first_ns) as f64 / 1e9,
            count: w.count,
            messages_window: w.messages_window,
            window: w.window,
            generation: w.generation,
            ack_sync_generation: (w.flags
                & spice_ebpf_common::window::state_flag::CLIENT_GENERATION
                != 0)
                .then_some(w.client_generation),
            set_acks: w.set_acks,
            ack_syncs: w.ack_syncs,
            acks: w.acks,
            acks_ignored: w.acks_ignored,
            ack_surplus: w.ack_surplus,
            max: w.max,
            stalls_total: w.stalls_total,
            starts_while_stalled: w.starts_while_stalled,
            urgent_pair_peaks: w.urgent_pair_peaks,
            messages_after_set_ack: w.messages_after_set_ack,
            messages_sent: r.messages[0],
            messages_received: r.messages[1],
            bytes_sent: r.bytes[0],
            bytes_received: r.bytes[1],
            compared: k.compared,
            differed: k.differed,
            differences: k.differences.iter().map(|d| d.to_string()).collect(),
            resynced: k.resynced,
        })
    }
}

/// A watched pid.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PidReport {
    pub pid: u32,
    pub comm: String,
}

/// A child a watched process forked during the run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ForkReport {
    pub parent: u32,
    pub child: u32,
    pub comm: String,
    /// Seconds after the start of observation.
    pub at_s: f64,
}

/// A watched process that exited during the run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExitReport {
    pub pid: u32,
    /// Seconds after the start of observation.
    pub at_s: f64,
}

/// The clocks at the start of observation, read back to back: lines up CLOCK_MONOTONIC times
/// (`t_s` of `--samples`, `at_s`, kernel timestamps) with CLOCK_REALTIME ones (packet
/// captures: dumpcap's timestamps).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockReport {
    /// CLOCK_REALTIME, nanoseconds since the Unix epoch.
    pub realtime_ns: u64,
    /// CLOCK_MONOTONIC, nanoseconds: the start every `*_s` time of the report and of
    /// `--samples` counts from.
    pub monotonic_ns: u64,
}

/// Where a report's data come from (`source` in JSON; the table's first line).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceReport {
    /// `"loaded"`: this process loaded the kernel programs itself (a standalone `observe`, or
    /// a daemon that found nothing of its layout pinned). `"pinned"`: it reads a set of
    /// programs and maps pinned by the daemon (an `observe` beside the daemon, reading the
    /// `TAP_EVENTS` ring, or a daemon continuing an earlier daemon's pins).
    pub kind: String,
    /// The pin directory read or pinned (`None` for a standalone `observe`).
    pub pin_dir: Option<String>,
    /// Whether the counts of a framed session that began before this process started are
    /// counted from the session's start (the kernel's per-socket state was taken over).
    /// `false`: such sessions are joined mid-stream (`framing` `hunting` until the kernel
    /// finds their message boundaries, see [`SyncReport`]), counted from their lock.
    pub exact_from_session_start: bool,
    /// Whether this process consumes the records of the `TAP_EVENTS` ring (an `observe`
    /// beside the daemon) rather than of `EVENTS`: its losses are then `tap_ring_full` and
    /// the map counters, not the daemon's `ring_full`.
    pub tap: bool,
}

impl SourceReport {
    /// The table's first line (without the `spice-observer: ` prefix).
    pub fn line(&self) -> String {
        match (self.kind.as_str(), &self.pin_dir) {
            ("pinned", Some(d)) if self.tap => format!(
                "reading the daemon's pinned state at {d}: counts exact from each session's \
                 start (stages only for messages sent since this run started)"
            ),
            ("pinned", Some(d)) => format!(
                "continuing the pinned state at {d}: counts exact from each session's start"
            ),
            (_, Some(d)) => format!(
                "loaded the programs and pinned them at {d}: sessions older than this run are \
                 joined mid-stream (counted from when their message boundaries are found)"
            ),
            _ => "loaded its own programs: sessions older than this run are joined mid-stream \
                  (counted from when their message boundaries are found)"
                .into(),
        }
    }
}

/// The whole `--json` document.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// Where the data come from.
    pub source: SourceReport,
    pub duration_s: f64,
    /// The start of observation on both clocks.
    pub clock: ClockReport,
    pub hook_set: String,
    /// The start-up self-test of the hook set ([`crate::pipeline::selftest`]); null where
    /// none ran (beside a daemon, which ran its own).
    pub self_test: Option<crate::pipeline::selftest::SelfTestReport>,
    /// Information lost anywhere (ring full, map full, unreadable user memory, untraced bytes,
    /// loop limit): the sum of the kernel's loss counters plus message records missing.
    pub events_lost: u64,
    pub kernel_counters: BTreeMap<String, u64>,
    pub degraded: Vec<String>,
    pub pids: Vec<PidReport>,
    pub forked: Vec<ForkReport>,
    pub exited: Vec<ExitReport>,
    /// The libssl hook status of every watched process the front end reported one for.
    pub tls_processes: Vec<TlsProcessReport>,
    pub channels: Vec<ChannelReport>,
}

fn detail_text(reason: UnparsedReason, detail: u32, at: u64) -> String {
    match reason {
        UnparsedReason::NotSpice
        | UnparsedReason::Tls
        | UnparsedReason::WebSocket
        | UnparsedReason::Http => {
            format!("first bytes {:02x?} at offset {at}", detail.to_le_bytes())
        }
        UnparsedReason::LinkRefused => format!("link error {} ({detail})", link_error_name(detail)),
        UnparsedReason::BadHeader => format!("message type {detail} at offset {at}"),
        UnparsedReason::UntracedBytes => {
            format!("{detail} bytes moved by an untraced call before offset {at}")
        }
        UnparsedReason::AttachedMidStream => "connection existed before observation started".into(),
        _ => format!("detail {detail} at offset {at}"),
    }
}

/// Judges one display channel from its window statistics, stage split and TCP state.
///
/// In order: client bound (the client's receive window limited the client-facing link ≥ 20%
/// of the time), link bound (throughput ≥ 70% of the delivery rate the kernel measured on the
/// client-facing link), ACK-window bound (count above 2W ≥ 50% of the time), send-buffer bound
/// (qemu's unsent bytes hold most of the in-flight bytes while the count stays below 2W),
/// partly window bound (≥ 5%), idle, or neither.
pub fn verdict(c: &ChannelReport) -> Option<String> {
    if c.channel_type != channel_type_name(channel::DISPLAY) {
        return None;
    }
    if c.framing == "unparsed" {
        return Some(format!(
            "cannot judge: stream unparsed ({})",
            c.unparsed_reason.as_deref().unwrap_or("?")
        ));
    }
    let (Some(w), Some(p50), Some(limit)) = (c.window, c.in_flight_p50, c.in_flight_limit) else {
        return Some("no SET_ACK seen: the ACK window is unknown".into());
    };
    let stalled = c.stalled_fraction.unwrap_or(0.0);
    let flow = &c.server_to_client;
    let chain = c.chain.as_ref();
    let stage_bytes = |name: &str| {
        c.stages
            .as_ref()
            .and_then(|s| s.get(name))
            .map_or(0, |s| s.bytes_p50)
    };
    let total_bytes: u64 = c
        .stages
        .as_ref()
        .map_or(0, |s| s.values().map(|v| v.bytes_p50).sum());
    let relay = chain.is_some_and(|ch| ch.backend.is_some());
    let queued: u64 = if relay {
        [
            "server_writing",
            "server_notsent",
            "server_unacked",
            "proxy_recv_queue",
            "proxy_inside",
            "proxy_notsent",
        ]
        .iter()
        .map(|n| stage_bytes(n))
        .sum()
    } else {
        stage_bytes("server_writing") + stage_bytes("server_notsent")
    };
    let link = chain.and_then(|ch| ch.link_rate_mbit).filter(|r| *r > 0.0);
    let delivered = chain
        .and_then(|ch| ch.link_delivered_mbit)
        .unwrap_or(flow.mbit_per_s);
    let util = link.map(|r| delivered / r);
    let rwnd = chain
        .and_then(|ch| ch.link_rwnd_limited_fraction)
        .unwrap_or(0.0);
    let kib = |b: u64| b / 1024;
    Some(if flow.messages_per_s < 1.0 && stalled < 0.05 {
        format!("idle: {:.1} msgs/s", flow.messages_per_s)
    } else if rwnd >= 0.2 {
        format!(
            "client bound: the client's receive window held the link back {:.0}% of the time (paused or slow client); in flight p50 {p50} of {limit}",
            rwnd * 100.0
        )
    } else if let (Some(u), Some(rate)) = (util.filter(|u| *u >= 0.7), link) {
        let biggest = [
            "server_notsent",
            "server_unacked",
            "proxy_recv_queue",
            "proxy_inside",
            "proxy_notsent",
        ]
        .into_iter()
        .map(|n| (stage_bytes(n), n))
        .max()
        .filter(|(b, _)| *b > 0)
        .map_or(String::new(), |(b, n)| {
            format!(", most in {n} ({} KiB)", kib(b))
        });
        format!(
            "link bound (cwnd/rate): {:.1} Mbit/s delivered, the link's rate is {:.1} Mbit/s ({:.0}%); in flight p50 {p50} of {limit}, {} of {} KiB in flight queued before the link{biggest}{}",
            delivered,
            rate,
            u * 100.0,
            kib(queued),
            kib(total_bytes),
            if stalled >= 0.05 {
                format!("; at the window {:.0}% of the time", stalled * 100.0)
            } else {
                String::new()
            }
        )
    } else if stalled >= 0.5 {
        let ceiling = match (c.messages_per_srtt, c.window_ceiling_msgs_per_s) {
            (Some(m), Some(ceil)) => format!(
                "; {m:.1} msgs per srtt against {limit}, window ceiling {ceil:.0} msgs/s vs {:.0} measured",
                flow.messages_per_s
            ),
            _ => String::new(),
        };
        format!(
            "ACK-window bound: spice-server waited for ACKs {:.0}% of the time (in flight p50 {p50} of {limit}, W={w}){ceiling}",
            stalled * 100.0
        )
    } else if c.stages.is_some()
        && stage_bytes("server_notsent") >= (256 * 1024).max(total_bytes / 2)
        && p50 < 2 * i64::from(w)
    {
        format!(
            "send-buffer bound: {} KiB of the {} KiB in flight wait unsent in qemu's socket while the count stays at p50 {p50} of {limit}",
            kib(stage_bytes("server_notsent")),
            kib(total_bytes)
        )
    } else if c.stages.is_none()
        && c.tcp
            .as_ref()
            .is_some_and(|t| t.notsent_max_bytes >= 256 * 1024)
        && stalled < 0.5
    {
        format!(
            "send-buffer bound: up to {} KiB waited unsent in the socket (in flight p50 {p50} of {limit})",
            kib(c.tcp.as_ref().map_or(0, |t| t.notsent_max_bytes as u64))
        )
    } else if stalled >= 0.05 {
        format!(
            "partly window bound: at the window {:.0}% of the time (in flight p50 {p50} of {limit})",
            stalled * 100.0
        )
    } else {
        format!(
            "neither window nor link binds: in flight p50 {p50} of {limit}, at the window {:.1}% of the time{}",
            stalled * 100.0,
            util.map_or(String::new(), |u| format!(", link {:.0}% used", u * 100.0))
        )
    })
}

/// Builds the report row of one socket. `end_ns` is the end of observation (the window's
/// time accounting is computed up to it, or up to the close, without changing the model);
/// `tcp` the best TCP state known for it (see [`TcpReport::source`]).
pub fn channel_report(
    s: &SocketModel,
    start_ns: u64,
    end_ns: u64,
    tcp: Option<TcpReport>,
) -> ChannelReport {
    let until = s.closed_ns.unwrap_or(end_ns);
    let ws = s.window.stats_at(until);
    let observed_s = until.saturating_sub(s.first_ns) as f64 / 1e9;
    let send = &s.dirs[0];
    let recv = &s.dirs[1];
    let by_type = |d: &crate::model::DirStats| {
        d.by_type
            .iter()
            .map(|(t, (n, _))| (t.to_string(), *n))
            .collect::<BTreeMap<_, _>>()
    };
    let bytes_by_type = |d: &crate::model::DirStats| {
        d.by_type
            .iter()
            .map(|(t, (_, b))| (t.to_string(), *b))
            .collect::<BTreeMap<_, _>>()
    };
    let flow = match s.s2c() {
        Some(i) => {
            let d = &s.dirs[i];
            let secs = observed_s.max(1e-9);
            FlowReport {
                messages: d.messages,
                bytes: d.bytes,
                messages_per_s: d.messages as f64 / secs,
                mbit_per_s: d.bytes as f64 * 8.0 / secs / 1e6,
                mean_message_bytes: if d.messages > 0 {
                    d.bytes as f64 / d.messages as f64
                } else {
                    0.0
                },
            }
        }
        None => FlowReport::default(),
    };
    let w = &s.window;
    let active = w.active();
    let unparsed = s.unparsed();
    let socket = match (s.local, s.remote) {
        (Some(l), Some(r)) => format!("{l}->{r}"),
        _ => format!("cookie:{}", s.cookie),
    };
    let inference = s.inference();
    let inferred = inference.as_ref().and_then(|i| i.channel_type);
    let (ctype, cid) = match s.channel() {
        Some((t, i)) => (channel_type_name(t), Some(i)),
        None => (inferred.map_or("unknown", channel_type_name), None),
    };
    let mut c = ChannelReport {
        socket,
        cookie: s.cookie,
        pid: s.pid,
        comm: s.comm.clone(),
        end: s
            .is_server_end()
            .map(|b| if b { "server" } else { "client" }.into()),
        session_id: s.session_id,
        channel_type: ctype.into(),
        channel_id: cid,
        channel_type_inferred: s.channel().is_none() && inferred.is_some(),
        channel_type_evidence: inference.map(|i| i.evidence),
        end_inferred: s.roles_inferred(),
        session_key: None,
        session_inferred: false,
        session_evidence: None,
        framing: s.framing().into(),
        transport: s.transport().into(),
        tls: TlsChannelReport::of(s, None),
        sync_sent: SyncReport::new(send, start_ns),
        sync_received: SyncReport::new(recv, start_ns),
        unparsed_reason: unparsed.map(|u| u.reason.name().into()),
        unparsed_detail: unparsed.map(|u| detail_text(u.reason, u.detail, u.at)),
        window: active.then_some(w.window),
        ack_generation: active.then_some(w.generation),
        ack_sync_generation: w.client_generation,
        set_acks: w.set_acks,
        generations: w.generations(),
        ack_syncs: w.ack_syncs,
        acks: w.acks,
        acks_ignored: w.acks_ignored,
        ack_surplus: w.ack_surplus,
        messages_sent: send.messages,
        bytes_sent: send.bytes,
        messages_received: recv.messages,
        bytes_received: recv.bytes,
        messages_sent_by_type: by_type(send),
        messages_received_by_type: by_type(recv),
        bytes_sent_by_type: bytes_by_type(send),
        bytes_received_by_type: bytes_by_type(recv),
        messages_sent_eagain_start: send.eagain_starts,
        server_to_client: flow,
        in_flight_now: active.then_some(i64::from(w.count)),
        in_flight_p50: active.then_some(i64::from(ws.p50)),
        in_flight_max: active.then_some(i64::from(w.max)),
        in_flight_limit: active.then(|| i64::from(w.limit())),
        in_flight_low: None,
        in_flight_high: None,
        in_flight_exact: false,
        in_flight_bounded: false,
        window_inferred: false,
        window_source: None,
        joined_window: None,
        stalled_fraction: active.then_some(ws.stalled_fraction),
        stalls: w.stalls,
        stalled_seconds_total: ws.stalled_seconds_total,
        stalls_total: w.stalls_total(),
        in_flight_histogram: active.then_some(ws.histogram),
        starts_while_stalled: w.starts_while_stalled,
        urgent_pair_peaks: w.urgent_pair_peaks,
        records_lost: s.lost_records(),
        kernel_window: KernelWindowReport::new(&s.kernel, s.first_ns),
        observed_s,
        closed: s.closed_ns.is_some(),
        tcp,
        traffic: SocketBytesReport::of(s),
        in_flight_relay_p50: None,
        in_flight_relay_max: None,
        in_flight_relay_now: None,
        stages: None,
        chain: None,
        messages_per_srtt: None,
        window_ceiling_msgs_per_s: None,
        verdict: None,
    };
    window_interval(&mut c, s, start_ns);
    c.verdict = verdict(&c);
    c
}

/// Adds a chain's stage statistics, relay-visible count and seed-style figures to the report
/// row of its spice-server socket, and recomputes the verdict. `end_ns`: the end of
/// observation (the relay leg's window accounting runs up to it or its close).
pub fn add_chain(
    c: &mut ChannelReport,
    chain: &Chain,
    model: &Model,
    duration_s: f64,
    end_ns: u64,
) {
    let sock = |cookie: Option<u64>| cookie.and_then(|k| model.sockets.get(&k));
    let name = |s: &SocketModel| match (s.local, s.remote) {
        (Some(l), Some(r)) => format!("{l}->{r}"),
        _ => format!("cookie:{}", s.cookie),
    };
    let backend = sock(chain.backend);
    let client_leg = sock(chain.client_leg);
    if let Some(b) = backend.filter(|b| b.window.active()) {
        let bs = b.window.stats_at(b.closed_ns.unwrap_or(end_ns));
        c.in_flight_relay_p50 = Some(i64::from(bs.p50));
        c.in_flight_relay_max = Some(i64::from(b.window.max));
    }
    let st = &chain.stats;
    c.in_flight_relay_now = st.last_relay_visible;
    let placeable = chain.placeable_stages();
    let mut stages = BTreeMap::new();
    for &i in &placeable {
        stages.insert(
            STAGES[i].to_string(),
            StageStat {
                now: st.last_placement.map_or(0, |p| p.counts[i]),
                p50: st.stage_counts[i].quantile(0.5).unwrap_or(0),
                max: st.stage_counts[i].max().unwrap_or(0),
                bytes_p50: st.stage_bytes[i].quantile(0.5).unwrap_or(0),
            },
        );
    }
    let (link_srtt, rwnd) = match chain.link_info {
        Some((first, last)) => {
            let rwnd = last.rwnd_limited_us.saturating_sub(first.rwnd_limited_us);
            let span = (duration_s * 1e6).max(1.0);
            (Some(last.srtt_us), Some((rwnd as f64 / span).min(1.0)))
        }
        None => (None, None),
    };
    // The median delivery rate: single samples overshoot after bursts (HTB, GRO).
    let rate = st.delivery_rates.quantile(0.5).map(|r| r as f64);
    if let (Some(w), Some(srtt)) = (c.window, link_srtt) {
        let srtt_s = srtt as f64 / 1e6;
        c.messages_per_srtt = Some(c.server_to_client.messages_per_s * srtt_s);
        if let Some(rate) = rate {
            let mean = c.server_to_client.mean_message_bytes;
            c.window_ceiling_msgs_per_s = Some(2.0 * w as f64 / (srtt_s + w as f64 * mean / rate));
        }
    }
    let frac = |n: usize| (st.with_relay > 0).then(|| n as f64 / st.with_relay as f64);
    let delivered_mbit = match (st.first_delivered, st.last_delivered) {
        (Some((t0, d0)), Some((t1, d1))) if t1 > t0 => {
            Some(d1.saturating_sub(d0) as f64 * 8.0 / ((t1 - t0) as f64 / 1e9) / 1e6)
        }
        _ => None,
    };
    let (transparency, detail) = match (&chain.backend, &chain.transparency) {
        (None, _) => ("no_relay", None),
        (Some(_), Transparency::Unknown) => ("unknown", None),
        (Some(_), Transparency::Transparent { compared }) => {
            ("transparent", Some(format!("{compared} messages compared")))
        }
        (
            Some(_),
            Transparency::Changed {
                direction,
                index,
                detail,
            },
        ) => (
            "changed",
            Some(format!("{direction}, from message {index}: {detail}")),
        ),
    };
    c.chain = Some(ChainReport {
        backend: backend.map(name),
        client_leg: client_leg.map(name),
        relay_pid: backend.map(|b| b.pid),
        pairing: chain.pairing.clone(),
        transparency: transparency.into(),
        transparency_detail: detail,
        placeable_stages: placeable.iter().map(|&i| STAGES[i].into()).collect(),
        samples: st.samples,
        samples_placed: st.placed,
        clamped_samples: st.clamped_samples,
        clamped_max: st.clamped_max,
        kept_short_samples: st.kept_short_samples,
        unplaced_max: st.unplaced_max,
        link_rate_mbit: rate.map(|r| r * 8.0 / 1e6),
        link_delivered_mbit: delivered_mbit,
        link_rwnd_limited_fraction: rwnd,
        link_srtt_us: link_srtt,
        relay_above_true_samples: st.relay_above,
        relay_below_true_fraction: frac(st.relay_below),
        relay_gap_upstream_fraction: frac(st.gap_upstream),
    });
    // Stages exist only where spice-server keeps an ACK window (display, cursor).
    if c.window.is_some() {
        c.stages = Some(stages);
    }
    c.verdict = verdict(c);
}

/// Sort key: process, session, channel type and id, socket.
fn order(c: &ChannelReport) -> (u32, u32, u8, u8, String) {
    let t = match c.channel_type.as_str() {
        "main" => 1,
        "display" => 2,
        "inputs" => 3,
        "cursor" => 4,
        "unknown" => 255,
        _ => 100,
    };
    (
        c.pid,
        c.session_id.unwrap_or(u32::MAX),
        t,
        c.channel_id.unwrap_or(0),
        c.socket.clone(),
    )
}

/// What the run knows besides the model, for [`build`].
pub struct RunInfo<'a> {
    /// CLOCK_MONOTONIC ns at the start and the end of observation.
    pub started_ns: u64,
    pub end_ns: u64,
    /// Both clocks at the start (`clock.monotonic_ns` = `started_ns`).
    pub clock: ClockReport,
    pub hook_set: &'a str,
    pub source: &'a SourceReport,
    pub counters: &'a [u64; counter::COUNT as usize],
    pub degraded: &'a [String],
    pub pids: Vec<PidReport>,
    /// Best TCP state per cookie.
    pub tcp_final: &'a BTreeMap<u64, TcpReport>,
    pub chains: &'a [Chain],
    /// Process names by pid, preferred over the thread name a socket's first record carried.
    pub comms: &'a std::collections::HashMap<u32, String>,
}

/// Assembles the report: one row per socket, chains and verdicts added.
pub fn build(model: &Model, run: RunInfo<'_>) -> Report {
    let RunInfo {
        started_ns,
        end_ns,
        clock,
        hook_set,
        source,
        counters,
        degraded,
        pids,
        tcp_final,
        chains,
        comms,
    } = run;
    let duration_s = end_ns.saturating_sub(started_ns) as f64 / 1e9;
    let mut channels: Vec<ChannelReport> = model
        .sockets
        .values()
        .map(|s| {
            let mut c = channel_report(
                s,
                clock.monotonic_ns,
                end_ns,
                tcp_final.get(&s.cookie).cloned(),
            );
            if let Some(comm) = comms.get(&s.pid) {
                c.comm = comm.clone();
            }
            let attach = model.tls_attach(s.pid);
            if let Some(t) = c.tls.as_mut()
                && let Some(TlsAttach::Attached { library }) = attach
            {
                t.library = Some(library.clone());
            }
            if c.tls.is_none() && unparsed_tls(s) {
                c.unparsed_detail = Some(tls_unparsed_detail(s.pid, &c.comm, attach));
            }
            if let Some(chain) = chains.iter().find(|ch| ch.server == s.cookie) {
                add_chain(&mut c, chain, model, duration_s, end_ns);
            }
            c
        })
        .collect();
    let sessions = crate::model::infer::sessions(model);
    for c in channels.iter_mut() {
        if let Some(g) = sessions.get(&c.cookie) {
            c.session_key = Some(g.key.clone());
            c.session_inferred = g.inferred;
            c.session_evidence = Some(g.evidence.clone());
        }
    }
    // Verdicts belong to spice-server's channels: a relay's legs are part of those chains.
    let relay_pids: std::collections::HashSet<u32> = channels
        .iter()
        .filter(|c| c.end.as_deref() == Some("client"))
        .map(|c| c.pid)
        .collect();
    for c in channels.iter_mut() {
        if c.end.as_deref() != Some("server") || relay_pids.contains(&c.pid) {
            c.verdict = None;
        }
    }
    channels.sort_by_key(order);
    let kernel_counters: BTreeMap<String, u64> = counter::NAMES
        .iter()
        .zip(counters.iter())
        .map(|(n, v)| (n.to_string(), *v))
        .collect();
    let kernel_lost: u64 = (0..counter::COUNT)
        .filter(|&i| {
            if source.tap {
                counter::is_tap_loss(i)
            } else {
                counter::is_loss(i)
            }
        })
        .map(|i| counters[i as usize])
        .sum();
    let records_lost: u64 = channels.iter().map(|c| c.records_lost).sum();
    let forked = model
        .processes
        .iter()
        .filter_map(|p| match p {
            crate::model::ProcessNote::Forked {
                ts_ns,
                parent,
                child,
                comm,
            } => Some(ForkReport {
                parent: *parent,
                child: *child,
                comm: comm.clone(),
                at_s: ts_ns.saturating_sub(started_ns) as f64 / 1e9,
            }),
            _ => None,
        })
        .collect();
    let exited = model
        .processes
        .iter()
        .filter_map(|p| match p {
            crate::model::ProcessNote::Exited { ts_ns, pid } => Some(ExitReport {
                pid: *pid,
                at_s: ts_ns.saturating_sub(started_ns) as f64 / 1e9,
            }),
            _ => None,
        })
        .collect();
    let tls_processes = model
        .tls_attach
        .iter()
        .map(|(&pid, a)| {
            // As the channel rows name it: the live process name, else the one its sockets'
            // first records carried, else the watched pid's at the start.
            let comm = comms
                .get(&pid)
                .cloned()
                .or_else(|| {
                    model
                        .sockets
                        .values()
                        .find(|s| s.pid == pid && !s.comm.is_empty())
                        .map(|s| s.comm.clone())
                })
                .or_else(|| pids.iter().find(|p| p.pid == pid).map(|p| p.comm.clone()))
                .unwrap_or_default();
            TlsProcessReport::new(pid, comm, a)
        })
        .collect();
    Report {
        source: source.clone(),
        duration_s,
        clock,
        hook_set: hook_set.to_string(),
        self_test: None,
        events_lost: kernel_lost.max(records_lost),
        kernel_counters,
        degraded: degraded.to_vec(),
        pids,
        forked,
        exited,
        tls_processes,
        channels,
    }
}

/// Whether the first reason framing stopped on `s` is that its bytes are TLS records.
fn unparsed_tls(s: &SocketModel) -> bool {
    s.unparsed()
        .is_some_and(|u| u.reason == UnparsedReason::Tls)
}

/// A mean message size for the table: bytes below 1 KiB, else KiB with one decimal.
fn size_text(bytes: f64) -> String {
    if bytes < 1024.0 {
        format!("{bytes:.0} B")
    } else {
        format!("{:.1} KiB", bytes / 1024.0)
    }
}

/// The W column: `20`, `20*` when inferred from the ACK cadence, `-` when not known.
fn window_text(c: &ChannelReport) -> String {
    match (c.window, c.window_inferred) {
        (Some(w), true) => format!("{w}*"),
        (w, _) => opt(w),
    }
}

/// The in-flight column of a channel without time statistics (joined mid-stream): the count
/// now, `12..41` while it is an interval, with `of 2W+1` once W is known.
fn interval_text(c: &ChannelReport) -> String {
    let (Some(lo), Some(hi)) = (c.in_flight_low, c.in_flight_high) else {
        return "-".into();
    };
    let now = if lo == hi {
        format!("={lo}")
    } else {
        format!("{lo}..{hi}")
    };
    match c.in_flight_limit {
        Some(l) => format!("{now} of {l}"),
        None => now,
    }
}

/// The note under the table for a connection joined mid-stream: whether its count is bounded
/// or exact, and where W came from.
fn joined_line(c: &ChannelReport) -> Option<String> {
    let j = c.joined_window.as_ref()?;
    let what = format!("{} {} ({})", c.channel_type, opt(c.channel_id), c.socket);
    let w = match (c.window, c.window_source.as_deref()) {
        (Some(w), Some("set_ack")) => format!("W={w} from a SET_ACK"),
        (Some(w), _) => format!("W={w}* inferred from the ACK cadence"),
        _ => format!("W not known yet ({} candidates)", j.window_candidates),
    };
    let count = match (c.in_flight_low, c.in_flight_high, j.exact_since_s) {
        (Some(lo), Some(hi), _) if lo != hi => format!(
            "bounded: spice-server's count is in {lo}..{hi} (stages placed for the {lo} known in flight)"
        ),
        (Some(v), Some(_), Some(t)) => format!(
            "exact since {t:.1} s ({}): {v} in flight",
            j.exact_reason.as_deref().unwrap_or("?")
        ),
        _ => "not counting yet (waits for both directions to lock)".into(),
    };
    Some(format!("  joined mid-stream {what}: {count}; {w}"))
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

/// Most processes the table's libssl line names one by one (beyond, it counts them per state).
const TLS_LINE_PROCESSES: usize = 6;

/// The report of `model` for unit tests: observation from 0 to `end_ns`, a standalone
/// `observe` (source `loaded`), no counters, chains or final TCP state.
#[cfg(test)]
pub(crate) fn build_for_test(model: &Model, end_ns: u64) -> Report {
    build_for_test_with(model, end_ns, &[0; counter::COUNT as usize])
}

/// [`build_for_test`] with the kernel counters `counters`.
#[cfg(test)]
pub(crate) fn build_for_test_with(
    model: &Model,
    end_ns: u64,
    counters: &[u64; counter::COUNT as usize],
) -> Report {
    build(
        model,
        RunInfo {
            started_ns: 0,
            end_ns,
            clock: ClockReport::default(),
            hook_set: "tracepoints",
            source: &SourceReport {
                kind: "loaded".into(),
                pin_dir: None,
                exact_from_session_start: false,
                tap: false,
            },
            counters,
            degraded: &[],
            pids: Vec::new(),
            tcp_final: &BTreeMap::new(),
            chains: &[],
            comms: &std::collections::HashMap::new(),
        },
    )
}

/// Renders the human table and verdicts.
pub fn render(r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "spice-observer: {}", r.source.line());
    let _ = writeln!(
        out,
        "spice-observer: {:.1} s, hook set {}, {} channel(s), events lost {}",
        r.duration_s,
        r.hook_set,
        r.channels.len(),
        r.events_lost
    );
    for d in &r.degraded {
        let _ = writeln!(out, "  note: {d}");
    }
    let _ = writeln!(
        out,
        "{:<44} {:>7} {:<10} {:<16} {:>3} {:>8} {:>7} {:>9} {:>7} {:>13} {:>7} {:>8} {:>6} {:>9} {:>6}",
        "SOCKET",
        "PID",
        "COMM",
        "CHANNEL",
        "W",
        "MSGS/S",
        "MBIT/S",
        "MEAN SIZE",
        "SRTT ms",
        "INFLT p50/max",
        "STALL%",
        "STALLS/s",
        "ACKS",
        "NOTSENT",
        "RETRANS"
    );
    let not_spice = |c: &&ChannelReport| {
        matches!(
            c.unparsed_reason.as_deref(),
            Some("not_spice") | Some("http")
        )
    };
    let hidden = r.channels.iter().filter(not_spice).count();
    let mut unframed_rows = 0;
    for c in r.channels.iter().filter(|c| !not_spice(c)) {
        // A TLS socket, framed from its plaintext at the libssl hooks: `display/tls 0`.
        let ty = if c.transport == "tls" {
            format!("{}/tls", c.channel_type)
        } else {
            c.channel_type.clone()
        };
        let chan = match c.channel_id {
            Some(id) => format!("{ty} {id}"),
            None => ty,
        };
        let chan = if c.framing == "unparsed" {
            format!("{chan}!")
        } else {
            chan
        };
        let chan = if c.channel_type_inferred {
            format!("{chan}?")
        } else {
            chan
        };
        let chan = if c.closed { format!("{chan}~") } else { chan };
        let inflight = match (c.in_flight_p50, c.in_flight_max, c.in_flight_limit) {
            (Some(p), Some(m), Some(l)) => format!("{p}/{m} of {l}"),
            _ => interval_text(c),
        };
        let secs = c.observed_s.max(1e-9);
        // No framed server → client message: the rate of every byte moved, marked `*`.
        let mbit = match c.traffic.both_ways_mbit() {
            Some(m) if c.server_to_client.messages == 0 => {
                unframed_rows += 1;
                format!("{m:.2}*")
            }
            _ => format!("{:.2}", c.server_to_client.mbit_per_s),
        };
        let _ = writeln!(
            out,
            "{:<44} {:>7} {:<10} {:<16} {:>3} {:>8.1} {:>7} {:>9} {:>7} {:>13} {:>7} {:>8} {:>6} {:>9} {:>6}",
            c.socket,
            c.pid,
            c.comm.chars().take(10).collect::<String>(),
            chan,
            window_text(c),
            c.server_to_client.messages_per_s,
            mbit,
            size_text(c.server_to_client.mean_message_bytes),
            opt(c
                .tcp
                .as_ref()
                .map(|t| format!("{:.1}", t.srtt_us as f64 / 1000.0))),
            inflight,
            opt(c.stalled_fraction.map(|f| format!("{:.1}", f * 100.0))),
            if c.window.is_some() {
                format!("{:.2}", c.stalls as f64 / secs)
            } else {
                "-".into()
            },
            if c.window.is_some() {
                c.acks.to_string()
            } else {
                "-".into()
            },
            opt(c.tcp.as_ref().map(|t| t.notsent_bytes)),
            opt(c.tcp.as_ref().map(|t| t.total_retrans)),
        );
    }
    if unframed_rows > 0 {
        let _ = writeln!(
            out,
            "  * no framed server → client message: MBIT/S of every byte the process moved on the socket, both ways (JSON bytes_written_per_s + bytes_read_per_s)"
        );
    }
    if !r.tls_processes.is_empty() {
        // Each process when few; else the count per state, and the failures by name.
        let many = r.tls_processes.len() > TLS_LINE_PROCESSES;
        let mut procs: Vec<String> = Vec::new();
        if many {
            for state in ["attached", "no_libssl", "failed", "disabled"] {
                let n = r.tls_processes.iter().filter(|p| p.state == state).count();
                if n > 0 {
                    procs.push(format!("{n} {state}"));
                }
            }
        }
        procs.extend(
            r.tls_processes
                .iter()
                .filter(|p| !many || p.state == "failed")
                .map(|p| {
                    let what = match (&p.library, &p.error) {
                        (Some(l), Some(e)) => format!("{} {l}: {e}", p.state),
                        (Some(l), None) => format!("{} {l}", p.state),
                        _ => p.state.clone(),
                    };
                    format!("pid {} ({}) {what}", p.pid, p.comm)
                }),
        );
        let _ = writeln!(
            out,
            "  libssl hooks (/tls: framed from the TLS plaintext): {}",
            procs.join("; ")
        );
    }
    // Window facts the columns cannot show: several generations, surplus ACKs, and starts
    // spice-server would not make.
    for c in r.channels.iter().filter(|c| c.window.is_some()) {
        let mut notes = Vec::new();
        if c.generations > 1 {
            notes.push(format!(
                "{} generations (SET_ACKs); the window columns are generation {}'s",
                c.generations,
                opt(c.ack_generation)
            ));
        }
        if c.ack_surplus > 0 {
            notes.push(format!(
                "{} surplus ACK(s): spice-server's unsigned count wrapped and it waits for an ACK for good (in flight shown as 0)",
                c.ack_surplus
            ));
        }
        // (Display channels get this warning with their verdict.)
        if c.starts_while_stalled > 0 && c.verdict.is_none() {
            notes.push(format!(
                "{} message start(s) while waiting for an ACK: not spice-server's behaviour, or events were missed",
                c.starts_while_stalled
            ));
        }
        if !notes.is_empty() {
            let _ = writeln!(
                out,
                "  window of {} {} ({}): {}",
                c.channel_type,
                opt(c.channel_id),
                c.socket,
                notes.join("; ")
            );
        }
    }
    // Joined connections: what the window columns mean there.
    for c in r.channels.iter().filter(|c| c.joined_window.is_some()) {
        if let Some(line) = joined_line(c) {
            let _ = writeln!(out, "{line}");
        }
    }
    let chained: Vec<&ChannelReport> = r
        .channels
        .iter()
        .filter(|c| c.chain.as_ref().is_some_and(|ch| ch.backend.is_some()))
        .collect();
    if !chained.is_empty() {
        let _ = writeln!(
            out,
            "\nrelay pairing (spice-server socket => relay leg toward it | relay leg toward the client):"
        );
        for c in chained {
            let ch = c.chain.as_ref().unwrap();
            let _ = writeln!(
                out,
                "  {:<10} {} => relay pid {} {} | {}  [{}]",
                format!("{} {}", c.channel_type, opt(c.channel_id)),
                c.socket,
                opt(ch.relay_pid),
                ch.backend.as_deref().unwrap_or("-"),
                ch.client_leg.as_deref().unwrap_or("not found"),
                ch.transparency,
            );
        }
    }
    let seed: Vec<&ChannelReport> = r.channels.iter().filter(|c| c.stages.is_some()).collect();
    if !seed.is_empty() {
        let short = [
            "writing",
            "notsent",
            "unacked",
            "p_recvq",
            "p_inside",
            "p_notsent",
            "c_unacked",
            "c_owesack",
        ];
        let _ = writeln!(
            out,
            "\nspice-server's in-flight messages, per display and cursor channel (stage columns: p50 messages)"
        );
        let _ = writeln!(
            out,
            "{:<12} {:>3} {:>7} {:>7} {:>9} {:>7} {:>14} {:>11} {:>7} {:>8} {:>13}  {}",
            "CHANNEL",
            "W",
            "MBIT/S",
            "MSGS/S",
            "MEAN SIZE",
            "SRTT ms",
            "MSGS/SRTT",
            "CEIL msgs/s",
            "AT 2W+1",
            "STALLS/s",
            "p50 relay/true",
            short.join(" ")
        );
        for c in seed {
            let chain = c.chain.as_ref();
            let stages = c.stages.as_ref().unwrap();
            let cols: Vec<String> = STAGES
                .iter()
                .zip(short)
                .map(|(name, s)| match stages.get(*name) {
                    Some(st) => format!("{:>w$}", st.p50, w = s.len()),
                    None => format!("{:>w$}", "-", w = s.len()),
                })
                .collect();
            let secs = c.observed_s.max(1e-9);
            let _ = writeln!(
                out,
                "{:<12} {:>3} {:>7.2} {:>7.1} {:>9} {:>7} {:>14} {:>11} {:>7} {:>8.2} {:>13}  {}",
                format!("{} {}", c.channel_type, opt(c.channel_id)),
                opt(c.window),
                c.server_to_client.mbit_per_s,
                c.server_to_client.messages_per_s,
                size_text(c.server_to_client.mean_message_bytes),
                opt(chain
                    .and_then(|ch| ch.link_srtt_us)
                    .map(|v| format!("{:.1}", v as f64 / 1000.0))),
                match (c.messages_per_srtt, c.in_flight_limit) {
                    (Some(m), Some(l)) => format!("{m:.1} of {l}"),
                    _ => "-".into(),
                },
                opt(c.window_ceiling_msgs_per_s.map(|v| format!("{v:.0}"))),
                opt(c.stalled_fraction.map(|f| format!("{:.1}%", f * 100.0))),
                c.stalls as f64 / secs,
                format!("{} / {}", opt(c.in_flight_relay_p50), opt(c.in_flight_p50)),
                cols.join(" ")
            );
            if let Some(ch) = chain {
                for p in &ch.pairing {
                    let _ = writeln!(out, "    paired: {p}");
                }
                if ch.transparency == "changed" {
                    let _ = writeln!(
                        out,
                        "    relay is NOT byte-transparent ({}): only {} placed",
                        ch.transparency_detail.as_deref().unwrap_or(""),
                        ch.placeable_stages.join(", ")
                    );
                }
                if ch.clamped_samples > 0 {
                    let _ = writeln!(
                        out,
                        "    positions out of chain order at {} of {} placed samples (up to {} {} clamped)",
                        ch.clamped_samples,
                        ch.samples_placed,
                        ch.clamped_max,
                        if ch.clamped_max == 1 {
                            "boundary"
                        } else {
                            "boundaries"
                        }
                    );
                }
                if ch.kept_short_samples > 0 || ch.unplaced_max > 0 {
                    let _ = writeln!(
                        out,
                        "    unplaced: up to {} message(s) at a sample; fewer kept than counted at {} of {} samples",
                        ch.unplaced_max, ch.kept_short_samples, ch.samples
                    );
                }
            }
        }
    }
    if r.channels.len() == hidden {
        let _ = writeln!(
            out,
            "no SPICE channel seen: watch spice-server's (qemu's) pid (or a relay's); a session already open is joined once its channels carry messages"
        );
    }
    if hidden > 0 {
        let _ = writeln!(
            out,
            "{hidden} other TCP socket(s) of the watched processes carry no SPICE (not listed; see --json)"
        );
    }
    if r.channels
        .iter()
        .any(|c| c.end.as_deref() == Some("client"))
        && !r.channels.iter().any(|c| c.chain.is_some())
    {
        let _ = writeln!(
            out,
            "note: only a relay's sockets were seen; add spice-server's (qemu's) pid to place the in-flight messages"
        );
    }
    let unparsed: Vec<_> = r
        .channels
        .iter()
        .filter(|c| c.framing == "unparsed" && !not_spice(c))
        .collect();
    let hunting: Vec<_> = r
        .channels
        .iter()
        .filter(|c| c.framing == "hunting")
        .collect();
    let joined = r
        .channels
        .iter()
        .filter(|c| {
            [&c.sync_sent, &c.sync_received].iter().any(|s| {
                s.as_ref()
                    .is_some_and(|s| s.reason == "attached_mid_stream")
            })
        })
        .count();
    if joined > 0 {
        let _ = writeln!(
            out,
            "joined mid-stream: {joined} connection(s) were open before observation started: \
             counted from when the kernel found their message boundaries (sync_sent / \
             sync_received in --json); {} still hunting",
            hunting.len()
        );
    }
    let inferred = r
        .channels
        .iter()
        .filter(|c| c.channel_type_inferred)
        .count();
    let undecided = r
        .channels
        .iter()
        .filter(|c| !c.channel_type_inferred && c.channel_type_evidence.is_some())
        .count();
    if inferred + undecided > 0 {
        let _ = writeln!(
            out,
            "channel type (?): inferred from the message types for {inferred} connection(s) \
             without a link phase, {undecided} still unknown (channel_type_evidence in --json \
             says why)"
        );
    }
    for c in r.channels.iter().filter(|c| {
        [&c.sync_sent, &c.sync_received]
            .iter()
            .any(|s| s.as_ref().is_some_and(|s| s.resyncs > 0))
    }) {
        let resyncs: u32 = [&c.sync_sent, &c.sync_received]
            .iter()
            .filter_map(|s| s.as_ref().map(|s| s.resyncs))
            .sum();
        let _ = writeln!(
            out,
            "resync (!): {} pid {}: {resyncs} header(s) failed validation; the bytes until the \
             next lock were not framed",
            c.socket, c.pid
        );
    }
    if !unparsed.is_empty() {
        let _ = writeln!(out, "unparsed (!):");
        for c in unparsed {
            let _ = writeln!(
                out,
                "  {} pid {}: {} ({})",
                c.socket,
                c.pid,
                c.unparsed_reason.as_deref().unwrap_or("?"),
                c.unparsed_detail.as_deref().unwrap_or("")
            );
        }
    }
    for c in r.channels.iter().filter(|c| c.verdict.is_some()) {
        let _ = writeln!(
            out,
            "verdict {} {} [{} pid {} {}]: {}",
            c.channel_type,
            opt(c.channel_id),
            c.comm,
            c.pid,
            c.socket,
            c.verdict.as_deref().unwrap_or("")
        );
        if c.urgent_pair_peaks > 0 {
            let _ = writeln!(
                out,
                "  note: the count reached 2W+2 {} time(s), each right after an urgent INVAL_LIST/LIST (spice-server's urgent pair)",
                c.urgent_pair_peaks
            );
        }
        if c.starts_while_stalled > 0 {
            let _ = writeln!(
                out,
                "  WARNING: {} message(s) started above 2W without an urgent pair: these messages disagree with spice-server's rule",
                c.starts_while_stalled
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A display channel with W=40, given window and flow figures.
    fn display(stalled: f64, p50: i64, msgs_per_s: f64, mbit: f64) -> ChannelReport {
        ChannelReport {
            socket: "127.0.0.1:5900->127.0.0.1:40000".into(),
            cookie: 1,
            pid: 1,
            comm: "qemu".into(),
            end: Some("server".into()),
            session_id: Some(7),
            channel_type: "display".into(),
            channel_id: Some(0),
            channel_type_inferred: false,
            channel_type_evidence: None,
            end_inferred: false,
            session_key: None,
            session_inferred: false,
            session_evidence: None,
            framing: "mini".into(),
            transport: "tcp".into(),
            tls: None,
            sync_sent: None,
            sync_received: None,
            unparsed_reason: None,
            unparsed_detail: None,
            window: Some(40),
            ack_generation: Some(1),
            ack_sync_generation: Some(1),
            set_acks: 1,
            generations: 1,
            ack_syncs: 1,
            acks: 10,
            acks_ignored: 0,
            ack_surplus: 0,
            messages_sent: 0,
            bytes_sent: 0,
            messages_received: 0,
            bytes_received: 0,
            messages_sent_by_type: BTreeMap::new(),
            messages_received_by_type: BTreeMap::new(),
            bytes_sent_by_type: BTreeMap::new(),
            bytes_received_by_type: BTreeMap::new(),
            messages_sent_eagain_start: 0,
            server_to_client: FlowReport {
                messages: 100,
                bytes: 0,
                messages_per_s: msgs_per_s,
                mbit_per_s: mbit,
                mean_message_bytes: 50_000.0,
            },
            in_flight_now: Some(p50),
            in_flight_p50: Some(p50),
            in_flight_max: Some(81),
            in_flight_limit: Some(81),
            in_flight_low: Some(p50),
            in_flight_high: Some(p50),
            in_flight_exact: true,
            in_flight_bounded: false,
            window_inferred: false,
            window_source: Some("set_ack".into()),
            joined_window: None,
            stalled_fraction: Some(stalled),
            stalls: 0,
            stalled_seconds_total: 0.0,
            stalls_total: 0,
            in_flight_histogram: None,
            starts_while_stalled: 0,
            urgent_pair_peaks: 0,
            records_lost: 0,
            kernel_window: None,
            observed_s: 10.0,
            closed: false,
            tcp: None,
            traffic: SocketBytesReport::default(),
            in_flight_relay_p50: None,
            in_flight_relay_max: None,
            in_flight_relay_now: None,
            stages: None,
            chain: None,
            messages_per_srtt: None,
            window_ceiling_msgs_per_s: None,
            verdict: None,
        }
    }

    fn with_link(
        mut c: ChannelReport,
        rate: f64,
        delivered: f64,
        rwnd: f64,
        notsent_bytes: u64,
    ) -> ChannelReport {
        let mut stages = BTreeMap::new();
        stages.insert(
            "server_notsent".into(),
            StageStat {
                bytes_p50: notsent_bytes,
                ..Default::default()
            },
        );
        stages.insert(
            "client_owes_ack".into(),
            StageStat {
                bytes_p50: 100_000,
                ..Default::default()
            },
        );
        c.stages = Some(stages);
        c.chain = Some(ChainReport {
            backend: Some("relay".into()),
            link_rate_mbit: Some(rate),
            link_delivered_mbit: Some(delivered),
            link_rwnd_limited_fraction: Some(rwnd),
            ..Default::default()
        });
        c
    }

    fn starts(c: &ChannelReport, prefix: &str) -> bool {
        verdict(c).unwrap().starts_with(prefix)
    }

    #[test]
    fn verdicts_in_order() {
        // A busy link at its rate: link bound even though the count sits at the window.
        assert!(starts(
            &with_link(display(0.8, 81, 20.0, 8.0), 7.6, 7.5, 0.0, 2 << 20),
            "link bound"
        ));
        // The link has room but spice-server waits for ACKs: window bound.
        assert!(starts(
            &with_link(display(0.8, 81, 900.0, 0.4), 7.6, 0.4, 0.0, 0),
            "ACK-window bound"
        ));
        // The client's receive window held the link back: client bound, whatever else.
        assert!(starts(
            &with_link(display(0.8, 81, 20.0, 8.0), 7.6, 7.5, 0.5, 0),
            "client bound"
        ));
        // qemu's unsent bytes hold the backlog, count below the window, link not saturated.
        assert!(starts(
            &with_link(display(0.0, 30, 20.0, 4.0), 7.6, 4.0, 0.0, 3 << 20),
            "send-buffer bound"
        ));
        // Nothing binds.
        assert!(starts(
            &with_link(display(0.0, 10, 20.0, 1.0), 1000.0, 1.0, 0.0, 0),
            "neither"
        ));
        assert!(starts(&display(0.0, 1, 0.2, 0.0), "idle"));
        assert!(starts(&display(0.1, 10, 20.0, 1.0), "partly window bound"));
    }

    #[test]
    fn no_verdict_for_other_channels_or_unparsed_streams() {
        let mut c = display(0.0, 1, 10.0, 1.0);
        c.channel_type = "cursor".into();
        assert_eq!(verdict(&c), None);
        let mut c = display(0.0, 1, 10.0, 1.0);
        c.framing = "unparsed".into();
        c.unparsed_reason = Some("tls".into());
        assert!(starts(&c, "cannot judge"));
        let mut c = display(0.0, 1, 10.0, 1.0);
        c.window = None;
        assert!(starts(&c, "no SET_ACK"));
    }

    #[test]
    fn window_notes_name_generations_and_surplus_acks() {
        let report = |c: ChannelReport| Report {
            source: SourceReport {
                kind: "loaded".into(),
                pin_dir: None,
                exact_from_session_start: false,
                tap: false,
            },
            duration_s: 1.0,
            clock: ClockReport {
                realtime_ns: 0,
                monotonic_ns: 0,
            },
            hook_set: "tracepoints+sockops".into(),
            self_test: None,
            events_lost: 0,
            kernel_counters: BTreeMap::new(),
            degraded: Vec::new(),
            pids: Vec::new(),
            forked: Vec::new(),
            exited: Vec::new(),
            tls_processes: Vec::new(),
            channels: vec![c],
        };
        let plain = render(&report(display(0.0, 1, 10.0, 1.0)));
        assert!(!plain.contains("window of display 0"), "{plain}");
        let mut c = display(0.9, 0, 10.0, 1.0);
        c.generations = 2;
        c.ack_generation = Some(2);
        c.ack_surplus = 1;
        c.in_flight_now = Some(0);
        let text = render(&report(c));
        assert!(
            text.contains("2 generations (SET_ACKs); the window columns are generation 2's"),
            "{text}"
        );
        assert!(text.contains("1 surplus ACK(s)"), "{text}");
        // The JSON carries both counters.
        let v = serde_json::to_value(display(0.0, 1, 10.0, 1.0)).unwrap();
        assert_eq!(v["ack_surplus"], 0);
        assert_eq!(v["generations"], 1);
    }

    // --- snapshots of a model: pure reads ---

    use crate::events::Event;
    use spice_ebpf_common::{
        event::{EventHeader, LinkEvent, MessageEvent, dir},
        framing::Role,
        protocol::{msg_client, msg_server},
        window::WindowState,
    };

    fn hdr(d: u8, ts: u64) -> EventHeader {
        EventHeader {
            dir: d,
            ts_ns: ts,
            cookie: 7,
            tgid: 1,
            ..Default::default()
        }
    }

    /// A message record of a display socket whose watched process is spice-server
    /// ([`dir::SEND`] is server → client), with the post-state of the kernel's window `k`
    /// after the shared rule applied the message (as `spice-ebpf/src/capture.rs` does).
    fn msg(
        k: &mut WindowState,
        d: u8,
        ts: u64,
        index: u64,
        msg_type: u16,
        prefix: [u32; 2],
    ) -> Event {
        let role = if d == dir::SEND {
            Role::ServerToClient
        } else {
            Role::ClientToServer
        };
        let fx = k.apply(role as u8, ts, channel::DISPLAY, msg_type, prefix);
        Event::Message(MessageEvent {
            hdr: hdr(d, ts),
            index,
            msg_type,
            hdr_len: 6,
            size: 100,
            at: index * 106,
            prefix,
            win_mw: k.messages_window,
            win_count: k.count,
            win_effects: fx,
            ..Default::default()
        })
    }

    /// spice-server's display socket with W = 2: SET_ACK, ACK_SYNC, then 4 draws (count 5 =
    /// 2W+1, stalled from t = 1013 ns).
    fn display_model() -> (Model, WindowState) {
        let mut m = Model::default();
        let mut k = WindowState::default();
        m.apply(&Event::Link(LinkEvent {
            hdr: hdr(dir::RECV, 1),
            role: Role::ClientToServer as u8,
            channel_type: channel::DISPLAY,
            ..Default::default()
        }));
        m.apply(&Event::Link(LinkEvent {
            hdr: hdr(dir::SEND, 2),
            role: Role::ServerToClient as u8,
            ..Default::default()
        }));
        m.apply(&msg(
            &mut k,
            dir::SEND,
            1000,
            1,
            msg_server::SET_ACK,
            [1, 2],
        ));
        m.apply(&msg(
            &mut k,
            dir::RECV,
            1001,
            1,
            msg_client::ACK_SYNC,
            [1, 0],
        ));
        for i in 0..4u64 {
            m.apply(&msg(&mut k, dir::SEND, 1010 + i, 2 + i, 302, [0, 0]));
        }
        (m, k)
    }

    fn snapshot(m: &Model, now: u64) -> serde_json::Value {
        serde_json::to_value(build_for_test(m, now)).unwrap()
    }

    /// A display connection joined mid-stream: before the client's pause its count is an
    /// interval (bounded, stages for the low end), W inferred; after the pause it is exact
    /// (`in_flight_now` set, reason `stall`). The table shows `20*` and `lo..hi`, and says so
    /// under the table.
    #[test]
    fn joined_channels_report_the_interval() {
        use crate::model::joined::tests::simulated_joined_model;
        let (m, truth) = simulated_joined_model(20, 100, false);
        let s = &m.sockets[&9];
        let c = channel_report(s, 0, s.dirs[0].last_ns, None);
        let (lo, hi) = (c.in_flight_low.unwrap(), c.in_flight_high.unwrap());
        assert!(lo <= i64::from(truth) && i64::from(truth) <= hi && lo < hi);
        assert!(c.in_flight_bounded && !c.in_flight_exact && c.in_flight_now.is_none());
        assert_eq!((c.window, c.in_flight_limit), (Some(20), Some(41)));
        assert!(c.window_inferred);
        assert_eq!(c.window_source.as_deref(), Some("ack_cadence"));
        let j = c.joined_window.as_ref().unwrap();
        assert_eq!(j.window_candidate_list.as_deref(), Some(&[20][..]));
        assert!(
            j.window_reason
                .as_deref()
                .unwrap()
                .starts_with("W=20: every other W")
        );
        assert_eq!((j.exact_since_s, j.pins), (None, 0));
        assert_eq!(window_text(&c), "20*");
        assert_eq!(interval_text(&c), format!("{lo}..{hi} of 41"));
        let line = joined_line(&c).unwrap();
        assert!(
            line.contains(&format!("bounded: spice-server's count is in {lo}..{hi}")),
            "{line}"
        );
        assert!(
            line.contains("W=20* inferred from the ACK cadence"),
            "{line}"
        );
        // JSON round trip keeps every field.
        let back: ChannelReport =
            serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
        assert_eq!(back.joined_window, c.joined_window);

        let (m, truth) = simulated_joined_model(20, 100, true);
        let s = &m.sockets[&9];
        let c = channel_report(s, 0, s.dirs[0].last_ns, None);
        assert_eq!(c.in_flight_now, Some(i64::from(truth)));
        assert!(c.in_flight_exact && !c.in_flight_bounded);
        let j = c.joined_window.as_ref().unwrap();
        assert_eq!((j.exact_reason.as_deref(), j.pins), (Some("stall"), 1));
        assert!(j.exact_since_s.unwrap() > 2.5);
        assert_eq!(interval_text(&c), format!("={truth} of 41"));
        assert!(joined_line(&c).unwrap().contains("exact since"));
    }

    #[test]
    fn snapshots_are_pure_reads() {
        let (mut m, mut k) = display_model();
        let a = snapshot(&m, 2013);
        assert_eq!(a, snapshot(&m, 2013));
        let c = &a["channels"][0];
        assert_eq!(c["in_flight_now"], 5);
        assert_eq!(c["stalls_total"], 1);
        assert_eq!(c["stalled_seconds_total"].as_f64().unwrap(), 1000e-9);
        assert_eq!(c["in_flight_histogram"]["count"].as_f64().unwrap(), 1013e-9);
        // An ACK timestamped before the first snapshot's instant but applied after it is
        // charged from its own time: count 3 from t = 1513, stalled 500 ns in all. A model that
        // was never snapshotted gives exactly the same report.
        m.apply(&msg(&mut k, dir::RECV, 1513, 2, msg_client::ACK, [0, 0]));
        let b = snapshot(&m, 2013);
        let (mut fresh, mut fk) = display_model();
        fresh.apply(&msg(&mut fk, dir::RECV, 1513, 2, msg_client::ACK, [0, 0]));
        assert_eq!(b, snapshot(&fresh, 2013));
        let c = &b["channels"][0];
        assert_eq!(c["in_flight_now"], 3);
        assert_eq!(c["stalled_seconds_total"].as_f64().unwrap(), 500e-9);
        assert_eq!(c["in_flight_p50"], 3);
        // The first snapshot's figures were not charged to the later count.
        assert_eq!(a["channels"][0]["in_flight_p50"], 5);
        // Counters never decrease from one snapshot to the next.
        let later = snapshot(&m, 5000);
        let (c1, c2) = (&b["channels"][0], &later["channels"][0]);
        for k in ["stalled_seconds_total", "stalls_total"] {
            assert!(c2[k].as_f64().unwrap() >= c1[k].as_f64().unwrap(), "{k}");
        }
        let h = &c2["in_flight_histogram"];
        assert_eq!(h["le"], serde_json::json!([0, 1, 2, 3, 4, 5, 6]));
        assert_eq!(h["count"].as_f64().unwrap(), 4000e-9);
    }

    /// A joined socket that stays hunting: its JSON row carries the kernel's byte totals and
    /// rates (flattened into the channel), and the table's MBIT/S shows the rate of those
    /// bytes, marked `*`, not 0.00; it round-trips through the typed report.
    /// A TLS display channel (transport tls, its plaintext side with the hooked library and
    /// its calls), and plain sockets whose bytes are TLS records the hooks did not see, one
    /// per hook status of their process: the detail says why their plaintext is not visible.
    #[test]
    fn tls_channels_and_unhooked_tls_sockets() {
        use crate::model::tls::TlsAttach;
        use spice_ebpf_common::event::{SockState, TlsMarkEvent, carrier, tls_func};
        let (mut m, _) = display_model();
        m.apply(&Event::Tls {
            hdr: hdr(dir::SEND, 1),
            func: tls_func::CONTEXT,
        });
        for (d, ts, end, seq) in [
            (dir::SEND, 40, 60, 900),
            (dir::SEND, 41, 80, 942),
            (dir::RECV, 42, 46, 300),
        ] {
            m.apply(&Event::TlsMark(TlsMarkEvent {
                hdr: hdr(d, ts),
                plain_end: end,
                seq,
                len: 20,
            }));
        }
        let st = SockState {
            carrier: carrier::TLS,
            wire_pos: [1200, 400],
            ..Default::default()
        };
        m.kernel_state(7, &st, 50);
        m.set_tls_attach(
            1,
            TlsAttach::Attached {
                library: "/usr/lib/x86_64-linux-gnu/libssl.so.3".into(),
            },
        );
        // Plain sockets unparsed as tls, in processes 2..=6.
        let states = [
            Some(TlsAttach::NoLibrary),
            Some(TlsAttach::Failed {
                library: "/opt/lib/libssl.so.3".into(),
                error: "symbol SSL_write_ex not found".into(),
            }),
            Some(TlsAttach::Attached {
                library: "/usr/lib/libssl.so.3".into(),
            }),
            Some(TlsAttach::Disabled),
            None,
        ];
        for (i, a) in states.iter().enumerate() {
            let pid = 2 + i as u32;
            let cookie = 100 + i as u64;
            m.apply(&Event::Socket {
                hdr: EventHeader {
                    cookie,
                    tgid: pid,
                    ..Default::default()
                },
                tid: pid,
                local: "127.0.0.1:5901".parse().unwrap(),
                remote: format!("127.0.0.1:{}", 41000 + i).parse().unwrap(),
                comm: format!("proc{pid}"),
            });
            m.apply(&Event::Unparsed {
                hdr: EventHeader {
                    cookie,
                    tgid: pid,
                    dir: dir::RECV,
                    ..Default::default()
                },
                at: 0,
                reason: UnparsedReason::Tls,
                detail: 0x0103_0116,
            });
            if let Some(a) = a {
                m.set_tls_attach(pid, a.clone());
            }
        }
        let v = snapshot(&m, 100);
        let r: Report = serde_json::from_value(v.clone()).unwrap();
        let c = r.channels.iter().find(|c| c.cookie == 7).unwrap();
        assert_eq!(c.transport, "tls");
        assert_eq!(
            c.tls,
            Some(TlsChannelReport {
                library: Some("/usr/lib/x86_64-linux-gnu/libssl.so.3".into()),
                plaintext_calls_sent: 2,
                plaintext_calls_received: 1,
                marks_kept: 3,
                plaintext_bytes_sent: 80,
                plaintext_bytes_received: 46,
            })
        );
        assert_eq!(c.traffic.bytes_written_total, Some(1200), "TCP bytes");
        let detail = |cookie: u64| {
            let c = r.channels.iter().find(|c| c.cookie == cookie).unwrap();
            assert_eq!(
                (c.transport.as_str(), c.unparsed_reason.as_deref()),
                ("tcp", Some("tls"))
            );
            assert!(c.tls.is_none());
            c.unparsed_detail.clone().unwrap()
        };
        assert_eq!(
            detail(100),
            "process 2 (proc2) maps no libssl: linked statically or using another TLS library, so its TLS plaintext cannot be hooked"
        );
        assert_eq!(
            detail(101),
            "uprobes on /opt/lib/libssl.so.3 failed: symbol SSL_write_ex not found"
        );
        assert_eq!(
            detail(102),
            "the connection's first bytes moved outside the libssl hooks (it started before they were attached)"
        );
        assert_eq!(detail(103), "TLS hooks disabled (--no-tls-hooks)");
        assert_eq!(detail(104), "TLS hooks not attached for this process");
        let states: Vec<(u32, &str, Option<&str>, Option<&str>)> = r
            .tls_processes
            .iter()
            .map(|p| {
                (
                    p.pid,
                    p.state.as_str(),
                    p.library.as_deref(),
                    p.error.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            states,
            [
                (
                    1,
                    "attached",
                    Some("/usr/lib/x86_64-linux-gnu/libssl.so.3"),
                    None
                ),
                (2, "no_libssl", None, None),
                (
                    3,
                    "failed",
                    Some("/opt/lib/libssl.so.3"),
                    Some("symbol SSL_write_ex not found")
                ),
                (4, "attached", Some("/usr/lib/libssl.so.3"), None),
                (5, "disabled", None, None),
            ]
        );
        assert_eq!(r.tls_processes[1].comm, "proc2");
        // The JSON names the tests read; a missing `tls` or `library` fails to parse.
        let ch = &v["channels"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["cookie"] == 7)
            .unwrap()
            .clone();
        for k in [
            "library",
            "plaintext_calls_sent",
            "plaintext_calls_received",
            "marks_kept",
            "plaintext_bytes_sent",
            "plaintext_bytes_received",
        ] {
            assert!(ch["tls"].get(k).is_some(), "{k}");
        }
        let mut missing = v.clone();
        missing["channels"][0]
            .as_object_mut()
            .unwrap()
            .remove("tls");
        assert!(serde_json::from_value::<Report>(missing).is_err());
        let text = render(&r);
        assert!(text.contains(" display/tls 0 "), "{text}");
        assert!(text.contains("pid 2 (proc2) no_libssl"), "{text}");
        // Many processes (a relay forking one per connection): counted per state, failures
        // named.
        let mut many = r.clone();
        for pid in 10..20 {
            many.tls_processes.push(TlsProcessReport::new(
                pid,
                "stunnel4".into(),
                &TlsAttach::NoLibrary,
            ));
        }
        let text = render(&many);
        assert!(
            text.contains(
                "libssl hooks (/tls: framed from the TLS plaintext): 2 attached; 11 no_libssl; 1 failed; 1 disabled; pid 3 (proc3) failed /opt/lib/libssl.so.3: symbol SSL_write_ex not found\n"
            ),
            "{text}"
        );
    }

    /// The kernel's TLS counters reach `kernel_counters`; `tls_unmapped`, `tls_pending_full`
    /// and `tls_unseen` are losses (`events_lost`), `tls_calls` not.
    #[test]
    fn tls_losses_count_in_events_lost() {
        let mut counters = [0; counter::COUNT as usize];
        counters[counter::TLS_CALLS as usize] = 1000;
        counters[counter::TLS_UNSEEN as usize] = 7;
        counters[counter::TLS_UNMAPPED as usize] = 2;
        counters[counter::TLS_PENDING_FULL as usize] = 3;
        let r = build_for_test_with(&Model::default(), 1, &counters);
        assert_eq!(r.events_lost, 12);
        assert_eq!(r.kernel_counters["tls_calls"], 1000);
        assert_eq!(r.kernel_counters["tls_unseen"], 7);
    }

    #[test]
    fn a_hunting_socket_shows_its_bytes() {
        let mut m = Model::default();
        let a: std::net::SocketAddr = "127.0.0.1:5900".parse().unwrap();
        let b: std::net::SocketAddr = "127.0.0.1:40000".parse().unwrap();
        m.add_existing(7, 1, a, b, 1_000_000_000);
        let mut st = spice_ebpf_common::event::SockState::default();
        st.dir[dir::SEND as usize].pos = 1_250_000;
        st.dir[dir::RECV as usize].pos = 2_500;
        m.kernel_state(7, &st, 2_000_000_000);
        let v = snapshot(&m, 2_000_000_000);
        let c = &v["channels"][0];
        assert_eq!(c["framing"], "hunting");
        assert_eq!(c["bytes_written_total"], 1_250_000);
        assert_eq!(c["bytes_read_total"], 2_500);
        assert_eq!(c["bytes_written_per_s"].as_f64(), Some(1_250_000.0));
        assert_eq!(c["bytes_read_per_s_now"].as_f64(), Some(2_500.0));
        assert_eq!(c["byte_totals_at_s"].as_f64(), Some(1.0));
        assert_eq!(c["bytes_sent"], 0);
        let r: Report = serde_json::from_value(v.clone()).unwrap();
        let t = &r.channels[0].traffic;
        assert_eq!(
            (t.bytes_written_total, t.bytes_read_total),
            (Some(1_250_000), Some(2_500))
        );
        // Both ways: (1 250 000 + 2 500) × 8 / 1e6 Mbit/s.
        let text = render(&r);
        assert!(text.contains(" 10.02* "), "{text}");
        assert!(
            text.contains("* no framed server → client message"),
            "{text}"
        );
        // Not read yet: null, and the table keeps the framed figure.
        let mut fresh = Model::default();
        fresh.add_existing(7, 1, a, b, 1_000_000_000);
        let v = snapshot(&fresh, 2_000_000_000);
        assert!(v["channels"][0]["bytes_written_total"].is_null());
        let text = render(&serde_json::from_value(v).unwrap());
        assert!(!text.contains('*'), "{text}");
    }
}
