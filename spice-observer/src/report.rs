//! The end-of-run report: one row per channel (socket), a verdict per display channel, and
//! the `--json` document. Field names are part of the CLI contract (README "JSON output").

use std::{collections::BTreeMap, fmt::Write as _};

use serde::Serialize;
use spice_ebpf_common::{
    config::counter,
    event::TcpSnapshot,
    framing::UnparsedReason,
    protocol::{channel, channel_type_name, link_error_name},
};

use crate::model::{Model, SocketModel};

/// TCP state of one socket at the end of the run.
#[derive(Clone, Debug, Default, Serialize)]
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
    pub source: &'static str,
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
            source,
        }
    }
}

/// Rates of the server → client direction of one channel.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FlowReport {
    pub messages: u64,
    pub bytes: u64,
    pub messages_per_s: f64,
    pub mbit_per_s: f64,
    /// Mean message size (header + body), bytes.
    pub mean_message_bytes: f64,
}

/// One watched socket (a SPICE channel when framed).
#[derive(Clone, Debug, Serialize)]
pub struct ChannelReport {
    /// `"laddr:lport->raddr:rport"`.
    pub socket: String,
    pub cookie: u64,
    pub pid: u32,
    pub comm: String,
    /// `"server"` if the watched process is the server end of this TCP connection (it read
    /// the client's link message: spice-server, or a relay's client-facing leg), `"client"`
    /// if it is the client end (a relay's leg toward spice-server), null if not known.
    pub end: Option<&'static str>,
    pub session_id: Option<u32>,
    pub channel_type: &'static str,
    pub channel_id: Option<u8>,
    /// `"mini"`, `"full"`, `"unparsed"` or `"pending"` (link phase not finished).
    pub framing: &'static str,
    pub unparsed_reason: Option<&'static str>,
    /// Human-readable detail of `unparsed_reason`.
    pub unparsed_detail: Option<String>,
    /// W from SET_ACK (display and cursor only), messages.
    pub window: Option<u32>,
    /// Generation from SET_ACK.
    pub ack_generation: Option<u32>,
    /// Generation from the last ACK_SYNC.
    pub ack_sync_generation: Option<u32>,
    pub set_acks: u64,
    pub ack_syncs: u64,
    pub acks: u64,
    pub acks_ignored: u64,
    /// Messages the watched process wrote on this socket, and their bytes (headers included).
    pub messages_sent: u64,
    pub bytes_sent: u64,
    pub messages_received: u64,
    pub bytes_received: u64,
    /// Message type number → messages written / read.
    pub messages_sent_by_type: BTreeMap<String, u64>,
    pub messages_received_by_type: BTreeMap<String, u64>,
    /// Written messages first seen on a send that failed with EAGAIN (already counted by
    /// spice-server then).
    pub messages_sent_eagain_start: u64,
    /// Server → client flow (whichever way it goes relative to the watched process).
    pub server_to_client: FlowReport,
    /// spice-server's in-flight count (its `messages_window`): now, time-weighted median and
    /// maximum since SET_ACK, in messages; `in_flight_limit` = 2W+1.
    pub in_flight_now: Option<i64>,
    pub in_flight_p50: Option<i64>,
    pub in_flight_max: Option<i64>,
    pub in_flight_limit: Option<i64>,
    /// Fraction of time since SET_ACK with the count above 2W (0..1).
    pub stalled_fraction: Option<f64>,
    /// Times the count went above 2W.
    pub stalls: u64,
    /// Message starts above 2W not explained by an urgent pair (always 0 for spice-server).
    pub starts_while_stalled: u64,
    /// Starts at 2W+1 right after an urgent INVAL_LIST / LIST (peak 2W+2, allowed).
    pub urgent_pair_peaks: u64,
    /// Message records lost between kernel and agent for this socket.
    pub records_lost: u64,
    /// Seconds this socket was observed.
    pub observed_s: f64,
    pub closed: bool,
    pub tcp: Option<TcpReport>,
    /// One-line judgement (display channels).
    pub verdict: Option<String>,
}

/// A watched pid.
#[derive(Clone, Debug, Serialize)]
pub struct PidReport {
    pub pid: u32,
    pub comm: String,
}

/// A child a watched process forked during the run.
#[derive(Clone, Debug, Serialize)]
pub struct ForkReport {
    pub parent: u32,
    pub child: u32,
    pub comm: String,
    /// Seconds after the start of observation.
    pub at_s: f64,
}

/// A watched process that exited during the run.
#[derive(Clone, Debug, Serialize)]
pub struct ExitReport {
    pub pid: u32,
    /// Seconds after the start of observation.
    pub at_s: f64,
}

/// The whole `--json` document.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub duration_s: f64,
    pub hook_set: String,
    /// Information lost anywhere (ring full, map full, unreadable user memory, untraced bytes,
    /// loop limit): the sum of the kernel's loss counters plus message records missing.
    pub events_lost: u64,
    pub kernel_counters: BTreeMap<&'static str, u64>,
    pub degraded: Vec<String>,
    pub pids: Vec<PidReport>,
    pub forked: Vec<ForkReport>,
    pub exited: Vec<ExitReport>,
    pub channels: Vec<ChannelReport>,
}

fn detail_text(reason: UnparsedReason, detail: u32, at: u64) -> String {
    match reason {
        UnparsedReason::NotSpice | UnparsedReason::Tls | UnparsedReason::WebSocket | UnparsedReason::Http => {
            format!("first bytes {:02x?} at offset {at}", detail.to_le_bytes())
        }
        UnparsedReason::LinkRefused => format!("link error {} ({detail})", link_error_name(detail)),
        UnparsedReason::BadHeader => format!("message type {detail} at offset {at}"),
        UnparsedReason::UntracedBytes => format!("{detail} bytes moved by an untraced call before offset {at}"),
        UnparsedReason::AttachedMidStream => "connection existed before observation started".into(),
        _ => format!("detail {detail} at offset {at}"),
    }
}

/// Judges one display channel from its window statistics and TCP state.
pub fn verdict(c: &ChannelReport) -> Option<String> {
    if c.channel_type != channel_type_name(channel::DISPLAY) {
        return None;
    }
    if c.framing == "unparsed" {
        return Some(format!("cannot judge: stream unparsed ({})", c.unparsed_reason.unwrap_or("?")));
    }
    let (Some(w), Some(p50), Some(limit)) = (c.window, c.in_flight_p50, c.in_flight_limit) else {
        return Some("no SET_ACK seen: the ACK window is unknown".into());
    };
    let stalled = c.stalled_fraction.unwrap_or(0.0);
    let notsent = c.tcp.as_ref().map_or(0, |t| t.notsent_max_bytes);
    Some(if stalled >= 0.5 {
        format!(
            "ACK-window bound: spice-server waited for ACKs {:.0}% of the time (in flight p50 {p50} of {limit}, W={w})",
            stalled * 100.0
        )
    } else if notsent >= 256 * 1024 {
        format!(
            "send-queue bound: up to {} KiB waited unsent in the socket; window stalled {:.0}% (in flight p50 {p50} of {limit})",
            notsent / 1024,
            stalled * 100.0
        )
    } else if stalled >= 0.05 {
        format!("partly window bound: stalled {:.0}% of the time (in flight p50 {p50} of {limit})", stalled * 100.0)
    } else if c.server_to_client.messages_per_s < 1.0 {
        format!("idle: {:.1} msgs/s", c.server_to_client.messages_per_s)
    } else {
        format!("not window bound: in flight p50 {p50} of {limit}, stalled {:.1}% of the time", stalled * 100.0)
    })
}

/// Builds the report row of one socket. `end_ns` is the end of observation; `tcp` the best
/// TCP state known for it (see [`TcpReport::source`]).
pub fn channel_report(s: &SocketModel, end_ns: u64, tcp: Option<TcpReport>) -> ChannelReport {
    let until = s.closed_ns.unwrap_or(end_ns);
    let observed_s = until.saturating_sub(s.first_ns) as f64 / 1e9;
    let send = &s.dirs[0];
    let recv = &s.dirs[1];
    let by_type = |d: &crate::model::DirStats| {
        d.by_type.iter().map(|(t, (n, _))| (t.to_string(), *n)).collect::<BTreeMap<_, _>>()
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
                mean_message_bytes: if d.messages > 0 { d.bytes as f64 / d.messages as f64 } else { 0.0 },
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
    let (ctype, cid) = match s.channel() {
        Some((t, i)) => (channel_type_name(t), Some(i)),
        None => ("unknown", None),
    };
    let mut c = ChannelReport {
        socket,
        cookie: s.cookie,
        pid: s.pid,
        comm: s.comm.clone(),
        end: s.is_server_end().map(|b| if b { "server" } else { "client" }),
        session_id: s.session_id,
        channel_type: ctype,
        channel_id: cid,
        framing: s.framing(),
        unparsed_reason: unparsed.map(|u| u.reason.name()),
        unparsed_detail: unparsed.map(|u| detail_text(u.reason, u.detail, u.at)),
        window: active.then_some(w.window),
        ack_generation: active.then_some(w.generation),
        ack_sync_generation: w.client_generation,
        set_acks: w.set_acks,
        ack_syncs: w.ack_syncs,
        acks: w.acks,
        acks_ignored: w.acks_ignored,
        messages_sent: send.messages,
        bytes_sent: send.bytes,
        messages_received: recv.messages,
        bytes_received: recv.bytes,
        messages_sent_by_type: by_type(send),
        messages_received_by_type: by_type(recv),
        messages_sent_eagain_start: send.eagain_starts,
        server_to_client: flow,
        in_flight_now: active.then_some(w.count),
        in_flight_p50: active.then(|| w.quantile(0.5)),
        in_flight_max: active.then_some(w.max),
        in_flight_limit: active.then(|| w.threshold() + 1),
        stalled_fraction: active.then(|| w.stalled_fraction()),
        stalls: w.stalls,
        starts_while_stalled: w.starts_while_stalled,
        urgent_pair_peaks: w.urgent_pair_peaks,
        records_lost: s.lost_records(),
        observed_s,
        closed: s.closed_ns.is_some(),
        tcp,
        verdict: None,
    };
    c.verdict = verdict(&c);
    c
}

/// Sort key: process, session, channel type and id, socket.
fn order(c: &ChannelReport) -> (u32, u32, u8, u8, String) {
    let t = match c.channel_type {
        "main" => 1,
        "display" => 2,
        "inputs" => 3,
        "cursor" => 4,
        "unknown" => 255,
        _ => 100,
    };
    (c.pid, c.session_id.unwrap_or(u32::MAX), t, c.channel_id.unwrap_or(0), c.socket.clone())
}

/// Assembles the report. `tcp_final` gives the best TCP state per cookie.
pub fn build(
    model: &Model,
    end_ns: u64,
    duration_s: f64,
    hook_set: &str,
    counters: &[u64; counter::COUNT as usize],
    degraded: &[String],
    pids: Vec<PidReport>,
    tcp_final: &BTreeMap<u64, TcpReport>,
    started_ns: u64,
) -> Report {
    let mut channels: Vec<ChannelReport> = model
        .sockets
        .values()
        .map(|s| channel_report(s, end_ns, tcp_final.get(&s.cookie).cloned()))
        .collect();
    channels.sort_by_key(order);
    let kernel_counters: BTreeMap<&'static str, u64> =
        counter::NAMES.iter().zip(counters.iter()).map(|(n, v)| (*n, *v)).collect();
    let kernel_lost: u64 = (0..counter::COUNT).filter(|&i| counter::is_loss(i)).map(|i| counters[i as usize]).sum();
    let records_lost: u64 = channels.iter().map(|c| c.records_lost).sum();
    let forked = model
        .processes
        .iter()
        .filter_map(|p| match p {
            crate::model::ProcessNote::Forked { ts_ns, parent, child, comm } => Some(ForkReport {
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
            crate::model::ProcessNote::Exited { ts_ns, pid } => {
                Some(ExitReport { pid: *pid, at_s: ts_ns.saturating_sub(started_ns) as f64 / 1e9 })
            }
            _ => None,
        })
        .collect();
    Report {
        duration_s,
        hook_set: hook_set.to_string(),
        events_lost: kernel_lost.max(records_lost),
        kernel_counters,
        degraded: degraded.to_vec(),
        pids,
        forked,
        exited,
        channels,
    }
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

/// Renders the human table and verdicts.
pub fn render(r: &Report) -> String {
    let mut out = String::new();
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
        "{:<44} {:>7} {:<10} {:<12} {:>3} {:>8} {:>7} {:>8} {:>7} {:>13} {:>7} {:>8} {:>6} {:>9} {:>6}",
        "SOCKET", "PID", "COMM", "CHANNEL", "W", "MSGS/S", "MBIT/S", "MEAN KiB", "SRTT ms",
        "INFLT p50/max", "STALL%", "STALLS/s", "ACKS", "NOTSENT", "RETRANS"
    );
    for c in &r.channels {
        let chan = match c.channel_id {
            Some(id) => format!("{} {}", c.channel_type, id),
            None => c.channel_type.to_string(),
        };
        let chan = if c.framing == "unparsed" { format!("{chan}!") } else { chan };
        let inflight = match (c.in_flight_p50, c.in_flight_max, c.in_flight_limit) {
            (Some(p), Some(m), Some(l)) => format!("{p}/{m} of {l}"),
            _ => "-".into(),
        };
        let secs = c.observed_s.max(1e-9);
        let _ = writeln!(
            out,
            "{:<44} {:>7} {:<10} {:<12} {:>3} {:>8.1} {:>7.2} {:>8.1} {:>7} {:>13} {:>7} {:>8} {:>6} {:>9} {:>6}",
            c.socket,
            c.pid,
            c.comm.chars().take(10).collect::<String>(),
            chan,
            opt(c.window),
            c.server_to_client.messages_per_s,
            c.server_to_client.mbit_per_s,
            c.server_to_client.mean_message_bytes / 1024.0,
            opt(c.tcp.as_ref().map(|t| format!("{:.1}", t.srtt_us as f64 / 1000.0))),
            inflight,
            opt(c.stalled_fraction.map(|f| format!("{:.1}", f * 100.0))),
            if c.window.is_some() { format!("{:.2}", c.stalls as f64 / secs) } else { "-".into() },
            if c.window.is_some() { c.acks.to_string() } else { "-".into() },
            opt(c.tcp.as_ref().map(|t| t.notsent_bytes)),
            opt(c.tcp.as_ref().map(|t| t.total_retrans)),
        );
    }
    let unparsed: Vec<_> = r.channels.iter().filter(|c| c.framing == "unparsed").collect();
    if !unparsed.is_empty() {
        let _ = writeln!(out, "unparsed (!):");
        for c in unparsed {
            let _ = writeln!(
                out,
                "  {} pid {}: {} ({})",
                c.socket,
                c.pid,
                c.unparsed_reason.unwrap_or("?"),
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
                "  WARNING: {} message(s) started above 2W without an urgent pair: the replay disagrees with spice-server's rule",
                c.starts_while_stalled
            );
        }
    }
    out
}
