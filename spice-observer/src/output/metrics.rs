//! The daemon's Prometheus metrics: every metric's definition in one table ([`METRICS`]) and
//! [`families`], which builds them from ONE engine snapshot ([`crate::report::Report`]).
//!
//! Conventions (Prometheus "Metric and label naming", "Writing exporters"): prefix
//! `spice_observer_`, base units in the name (`_seconds`, `_bytes`, `_messages`,
//! `_segments`), counters end in `_total`, constant-1 gauges that carry labels end in `_info`,
//! histograms rather than summaries. Labels are bounded: `vm` (the discovery target's name,
//! [`crate::host::discovery::Target::name`]), `leg`, `channel` (channel type name),
//! `channel_id`, `stage`, `direction`, `reason`, `event`, `program`, `kind`, `verdict`. A pid,
//! port, address or session id appears only in `spice_observer_channel_info`.
//!
//! Series come from the current snapshot only: a channel that closed or a VM that exited is
//! absent from the next scrape (no registered series are kept between scrapes).
//!
//! Legs: a spice-server socket is leg `server`; its chain names the relay's socket toward
//! spice-server (`chain.backend`, leg `relay_backend`) and toward the client
//! (`chain.client_leg`, leg `relay_client`), which get the `vm` of the chain's server. A relay
//! socket in no chain gets its leg from its `end` (`client`: it connected to spice-server,
//! `relay_backend`; `server`: a client connected to it, `relay_client`) and the `vm` of the
//! discovery target its process is (or descends from), e.g. `socat`.
//!
//! Per-channel series are emitted for open sockets whose channel type is known or inferred
//! (an inferred one has `channel_id` ""; `channel_info` says `channel_inferred`). Two open
//! sockets with the same (`vm`, `leg`, `channel`, `channel_id`) would make duplicate series;
//! then only the one that sent the most messages gets them (both keep their `_info`).

use std::collections::{BTreeMap, HashMap, HashSet};

use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
};
use spice_ebpf_common::config::counter;

use crate::host::discovery::{ServerKind, Target, TargetKind};
use crate::report::{ChannelReport, Report};

/// A metric's type, as exposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    /// The exposition format's TYPE word.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One metric's definition: full name, type, HELP text and label names (in exposition order).
#[derive(Clone, Copy, Debug)]
pub struct MetricDef {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    pub labels: &'static [&'static str],
}

const CH: &[&str] = &["vm", "leg", "channel", "channel_id"];
const CH_DIR: &[&str] = &["vm", "leg", "channel", "channel_id", "direction"];
const CH_STAGE: &[&str] = &["vm", "leg", "channel", "channel_id", "stage"];
const CH_BOUNDED: &[&str] = &["vm", "leg", "channel", "channel_id", "bounded"];

macro_rules! def {
    ($name:literal, $kind:ident, $labels:expr, $help:literal) => {
        MetricDef {
            name: concat!("spice_observer_", $name),
            kind: Kind::$kind,
            help: $help,
            labels: $labels,
        }
    };
}

/// Every metric the daemon exposes. README's "Metrics" table lists the same (a test compares
/// them with a live scrape).
pub const METRICS: &[MetricDef] = &[
    // --- per channel: spice-server's ACK window ---
    def!(
        "in_flight_now_messages",
        Gauge,
        CH,
        "Messages spice-server has in flight on this channel now (its messages_window, kept exactly by the kernel; on relay legs the same rule on what the relay read and wrote)."
    ),
    def!(
        "in_flight_stage_messages",
        Gauge,
        CH_STAGE,
        "spice-server's in-flight messages by where they are at the last sample (stage), leg server only."
    ),
    def!(
        "in_flight_relay_visible_messages",
        Gauge,
        CH,
        "The in-flight count a relay-side observer would report at the last sample (messages the relay read minus W per ACK it passed on), leg server of a relayed chain only."
    ),
    def!(
        "in_flight_limit_messages",
        Gauge,
        CH,
        "2W+1: spice-server starts no new message while its count is above 2W."
    ),
    def!(
        "ack_window_messages",
        Gauge,
        CH,
        "W, the ACK window from the last SET_ACK (the client ACKs every W messages)."
    ),
    def!(
        "in_flight_low_messages",
        Gauge,
        CH_BOUNDED,
        "Lowest count spice-server can have in flight now: equal to in_flight_now (bounded=false) unless the connection was joined mid-stream and its count is still an interval (bounded=true); stages place this many."
    ),
    def!(
        "in_flight_high_messages",
        Gauge,
        CH_BOUNDED,
        "Highest count spice-server can have in flight now (see in_flight_low_messages); spice-server's count is in [low, high]."
    ),
    def!(
        "ack_window_source_info",
        Gauge,
        &["vm", "leg", "channel", "channel_id", "source"],
        "1, labelled with where W came from: set_ack (a SET_ACK's body) or ack_cadence (inferred from the ACK cadence on a connection joined mid-stream)."
    ),
    def!(
        "in_flight_messages",
        Histogram,
        CH,
        "Time-weighted in-flight count: bucket le = milliseconds spent with the count <= le, _count = milliseconds observed, _sum = message-milliseconds (all generations). rate(_sum)/rate(_count) is the mean count."
    ),
    def!(
        "messages_total",
        Counter,
        CH_DIR,
        "SPICE messages moved on this socket, by direction of the SPICE flow (headers included in bytes)."
    ),
    def!(
        "bytes_total",
        Counter,
        CH_DIR,
        "Bytes of SPICE messages moved on this socket (header and body), by direction."
    ),
    def!(
        "socket_bytes_total",
        Counter,
        CH_DIR,
        "Every byte the process moved on this socket by traced calls, framed or not (hunting, unparsed, not SPICE; the kernel's DirState::pos at the last sample; TCP bytes, TLS records included, on a TLS socket), by direction of the SPICE flow. channel=\"unknown\": the open socket of unknown channel type of this vm and leg that moved the most bytes."
    ),
    def!(
        "acks_total",
        Counter,
        CH,
        "Client ACKs that matched the generation (each subtracted W from the count)."
    ),
    def!(
        "acks_ignored_total",
        Counter,
        CH,
        "Client ACKs dropped: no ACK_SYNC before them, or another generation."
    ),
    def!(
        "ack_surplus_total",
        Counter,
        CH,
        "Matched ACKs that found fewer than W messages in flight (spice-server's unsigned count wraps; 0 with well-behaved clients)."
    ),
    def!(
        "window_wait_seconds_total",
        Counter,
        CH,
        "Seconds spice-server waited for an ACK (count above 2W), all generations."
    ),
    def!(
        "window_stalls_total",
        Counter,
        CH,
        "Times spice-server began waiting for an ACK, all generations."
    ),
    def!(
        "records_lost_total",
        Counter,
        CH,
        "Message records of this socket lost between the kernel and the daemon (gaps in the record index, both directions); 0 unless something is wrong."
    ),
    def!(
        "resyncs_total",
        Counter,
        CH,
        "Times a framed direction of this socket met a header that failed validation and went back to hunting for message boundaries (both directions); the bytes until the next lock are not framed. 0 unless something is wrong."
    ),
    // --- per channel: TCP state of the leg ---
    def!(
        "tcp_srtt_seconds",
        Gauge,
        CH,
        "Smoothed round-trip time of this leg's TCP connection."
    ),
    def!(
        "tcp_cwnd_segments",
        Gauge,
        CH,
        "Congestion window of this leg."
    ),
    def!(
        "tcp_notsent_bytes",
        Gauge,
        CH,
        "Bytes written by the process and not yet sent (write_seq - snd_nxt)."
    ),
    def!(
        "tcp_unacked_segments",
        Gauge,
        CH,
        "Segments sent and not yet acknowledged by the peer."
    ),
    def!(
        "tcp_retransmits_total",
        Counter,
        CH,
        "Segments retransmitted over the connection's life (tcpi_total_retrans)."
    ),
    def!(
        "tcp_receive_queue_bytes",
        Gauge,
        CH,
        "Bytes received and not yet read by the process (rcv_nxt - copied_seq)."
    ),
    def!(
        "tcp_delivery_rate_bytes_per_second",
        Gauge,
        CH,
        "The kernel's delivery-rate estimate of this leg (tcpi_delivery_rate)."
    ),
    // --- per channel: labels only ---
    def!(
        "verdict_info",
        Gauge,
        &["vm", "channel", "channel_id", "verdict"],
        "1, labelled with what binds this display channel of spice-server (verdict: idle, client_bound, link_bound, ack_window_bound, send_buffer_bound, partly_window_bound, neither, cannot_judge)."
    ),
    def!(
        "channel_info",
        Gauge,
        &[
            "vm",
            "leg",
            "channel",
            "channel_id",
            "pid",
            "socket",
            "session_id",
            "framing",
            "unparsed_reason",
            "channel_inferred",
            "session_key",
            "transport"
        ],
        "1 per watched open socket, labelled with its process, addresses, SPICE session and framing (channel_inferred=\"true\": the channel type was inferred from the message types of a connection joined mid-stream; session_key: the socket of its session's main channel, session_inferred in the JSON; transport: tcp, or tls for a socket framed from its TLS plaintext at the libssl hooks)."
    ),
    // --- self metrics ---
    def!(
        "information_lost_total",
        Counter,
        &["reason"],
        "Information the kernel programs lost, by reason (the kernel loss counters; decode_errors: ring records that could not be decoded). 0 unless something is wrong."
    ),
    def!(
        "kernel_events_total",
        Counter,
        &["event"],
        "Activity of the kernel programs: socket calls traced, messages framed, sockops callbacks."
    ),
    def!(
        "ring_records_total",
        Counter,
        &[],
        "Ring records the daemon applied to its model."
    ),
    def!(
        "sockets_tracked",
        Gauge,
        &[],
        "Sockets the engine holds state for (open, and closed ones not released yet)."
    ),
    def!(
        "channels_tracked",
        Gauge,
        &[],
        "Open sockets with a known SPICE channel type."
    ),
    def!(
        "chains_tracked",
        Gauge,
        &[],
        "spice-server channels the engine pairs with relay legs and samples."
    ),
    def!(
        "processes_tracked",
        Gauge,
        &[],
        "Process notes (forks and exits of watched processes) the engine holds."
    ),
    def!(
        "targets_discovered",
        Gauge,
        &["kind"],
        "Processes discovery found, by kind (qemu, xspice, relay)."
    ),
    def!(
        "degraded_features",
        Gauge,
        &[],
        "Entries of the snapshot's degraded list: kernel features missing at start, unreadable counters, undecodable records (0 normally)."
    ),
    def!(
        "tls_processes",
        Gauge,
        &["state"],
        "Watched processes by what the libssl hooks could do for them (state: attached, no_libssl: it maps no libssl, failed: attaching failed, disabled: --no-tls-hooks); 0 for a state no process is in."
    ),
    def!(
        "hook_set_info",
        Gauge,
        &["hook_set"],
        "1, labelled with the set of kernel hooks in use."
    ),
    def!(
        "bpf_run_seconds_total",
        Counter,
        &["program"],
        "Kernel run time of each of the observer's BPF programs (bpf_prog_info run_time_ns; only with bpf_stats)."
    ),
    def!(
        "bpf_runs_total",
        Counter,
        &["program"],
        "Runs of each of the observer's BPF programs (bpf_prog_info run_cnt; only with bpf_stats)."
    ),
    def!(
        "scrape_duration_seconds",
        Gauge,
        &[],
        "Time this scrape took to take the snapshot and build the metrics."
    ),
    def!(
        "start_time_seconds",
        Gauge,
        &[],
        "When the engine started, seconds since the Unix epoch."
    ),
    def!(
        "build_info",
        Gauge,
        &["version"],
        "1, labelled with the daemon's version."
    ),
];

/// Every `state` of `spice_observer_tls_processes` (`crate::model::tls::TlsAttach::state`),
/// each exported, 0 when no process is in it.
pub const TLS_STATES: [&str; 4] = ["attached", "no_libssl", "failed", "disabled"];

/// The definition named `name` (full name).
pub fn def(name: &str) -> Option<&'static MetricDef> {
    METRICS.iter().find(|d| d.name == name)
}

/// One BPF program's kernel statistics.
#[derive(Clone, Debug, Default)]
pub struct ProgramCost {
    pub name: String,
    pub run_time_ns: u64,
    pub run_count: u64,
}

/// Everything one scrape exports besides the snapshot.
pub struct ScrapeInput<'a> {
    /// The engine snapshot.
    pub report: &'a Report,
    /// The current discovery targets.
    pub targets: &'a [Target],
    /// Per-program statistics; `None` when bpf_stats is off (the families are left out).
    pub programs: Option<&'a [ProgramCost]>,
    /// Engine sizes.
    pub sockets: usize,
    pub chains: usize,
    pub processes: usize,
    pub records: u64,
    pub decode_errors: u64,
    /// CLOCK_REALTIME of the engine's start, seconds since the epoch.
    pub start_time_s: f64,
}

/// Label value of a verdict: its leading words, from [`crate::report::verdict`]'s text.
pub fn verdict_label(verdict: &str) -> &'static str {
    const PREFIXES: [(&str, &str); 9] = [
        ("idle", "idle"),
        ("client bound", "client_bound"),
        ("link bound", "link_bound"),
        ("ACK-window bound", "ack_window_bound"),
        ("send-buffer bound", "send_buffer_bound"),
        ("partly window bound", "partly_window_bound"),
        ("neither", "neither"),
        ("cannot judge", "cannot_judge"),
        // No SET_ACK seen: the window is unknown, nothing can be judged.
        ("no SET_ACK", "cannot_judge"),
    ];
    PREFIXES
        .iter()
        .find(|(p, _)| verdict.starts_with(p))
        .map_or("cannot_judge", |(_, l)| l)
}

/// Family builder: families in table order, label names checked against the table.
struct Builder {
    fams: BTreeMap<usize, MetricFamily>,
}

impl Builder {
    fn family(&mut self, name: &str) -> (&'static MetricDef, &mut MetricFamily) {
        let i = METRICS
            .iter()
            .position(|d| d.name == name)
            .unwrap_or_else(|| panic!("metric {name} is not in METRICS"));
        let d = &METRICS[i];
        let mf = self.fams.entry(i).or_insert_with(|| {
            let mut mf = MetricFamily::default();
            mf.set_name(d.name.to_string());
            mf.set_help(d.help.to_string());
            mf.set_field_type(match d.kind {
                Kind::Counter => MetricType::COUNTER,
                Kind::Gauge => MetricType::GAUGE,
                Kind::Histogram => MetricType::HISTOGRAM,
            });
            mf
        });
        (d, mf)
    }

    fn metric(d: &MetricDef, values: &[&str]) -> Metric {
        assert_eq!(d.labels.len(), values.len(), "labels of {}", d.name);
        let mut m = Metric::default();
        m.set_label(
            d.labels
                .iter()
                .zip(values)
                .map(|(n, v)| {
                    let mut l = LabelPair::default();
                    l.set_name(n.to_string());
                    l.set_value(v.to_string());
                    l
                })
                .collect(),
        );
        m
    }

    fn put(&mut self, name: &str, values: &[&str], v: f64) {
        let (d, mf) = self.family(name);
        let mut m = Self::metric(d, values);
        match d.kind {
            Kind::Counter => {
                let mut c = Counter::default();
                c.set_value(v);
                m.set_counter(c);
            }
            Kind::Gauge => {
                let mut g = Gauge::default();
                g.set_value(v);
                m.set_gauge(g);
            }
            Kind::Histogram => panic!("{name} is a histogram"),
        }
        mf.mut_metric().push(m);
    }

    fn histogram(
        &mut self,
        name: &str,
        values: &[&str],
        buckets: &[(f64, u64)],
        sum: f64,
        count: u64,
    ) {
        let (d, mf) = self.family(name);
        assert_eq!(d.kind, Kind::Histogram);
        let mut m = Self::metric(d, values);
        let mut h = Histogram::default();
        h.set_bucket(
            buckets
                .iter()
                .map(|&(le, n)| {
                    let mut b = Bucket::default();
                    b.set_upper_bound(le);
                    b.set_cumulative_count(n);
                    b
                })
                .collect(),
        );
        h.set_sample_sum(sum);
        h.set_sample_count(count);
        m.set_histogram(h);
        mf.mut_metric().push(m);
    }

    fn finish(self) -> Vec<MetricFamily> {
        self.fams.into_values().collect()
    }
}

/// Direction labels of a socket's sent and received messages, from its `end`.
fn directions(c: &ChannelReport) -> Option<(&'static str, &'static str)> {
    match c.end.as_deref()? {
        // It read the link message: spice-server, or a relay's client-facing leg.
        "server" => Some(("server_to_client", "client_to_server")),
        "client" => Some(("client_to_server", "server_to_client")),
        _ => None,
    }
}

/// Direction labels of a socket's written and read bytes: from its `end` ([`directions`]),
/// else from its leg (the process accepted a client on legs `server` and `relay_client`, it
/// connected to spice-server on `relay_backend`).
fn byte_directions(c: &ChannelReport, leg: &str) -> (&'static str, &'static str) {
    directions(c).unwrap_or(if leg == "relay_backend" {
        ("client_to_server", "server_to_client")
    } else {
        ("server_to_client", "client_to_server")
    })
}

/// `spice_observer_socket_bytes_total` of one socket (`l`: vm, leg, channel, channel_id), both
/// directions; nothing before the first read of its kernel entry.
fn put_socket_bytes(b: &mut Builder, l: &[&str; 4], c: &ChannelReport) {
    let (written, read) = byte_directions(c, l[1]);
    for (dir, v) in [
        (written, c.traffic.bytes_written_total),
        (read, c.traffic.bytes_read_total),
    ] {
        if let Some(v) = v {
            b.put(
                "spice_observer_socket_bytes_total",
                &[l[0], l[1], l[2], l[3], dir],
                v as f64,
            );
        }
    }
}

/// The discovery target `pid` is or descends from: `parent` maps a child to its parent (the
/// snapshot's forks), else `/proc/PID/stat` is read.
fn target_of<'t>(
    pid: u32,
    targets: &'t [Target],
    parent: &HashMap<u32, u32>,
) -> Option<&'t Target> {
    let mut p = pid;
    for _ in 0..64 {
        if let Some(t) = targets.iter().find(|t| t.pid == p) {
            return Some(t);
        }
        p = match parent.get(&p) {
            Some(&pp) => pp,
            None => {
                let raw = std::fs::read(format!("/proc/{p}/stat")).ok()?;
                crate::host::discovery::parse_stat(&raw)?.ppid
            }
        };
        if p <= 1 {
            return None;
        }
    }
    None
}

/// The metric-label identity of a channel: (vm, leg).
fn legs<'a>(r: &'a Report, targets: &[Target]) -> HashMap<&'a str, (String, &'static str)> {
    let parent: HashMap<u32, u32> = r.forked.iter().map(|f| (f.child, f.parent)).collect();
    let name_of = |pid: u32| {
        target_of(pid, targets, &parent).map_or_else(|| "unknown".to_string(), |t| t.name.clone())
    };
    let mut out: HashMap<&str, (String, &'static str)> = HashMap::new();
    let mut relay_side = HashSet::new();
    for c in &r.channels {
        if let Some(ch) = &c.chain {
            let vm = name_of(c.pid);
            if let Some(b) = &ch.backend {
                out.insert(b.as_str(), (vm.clone(), "relay_backend"));
                relay_side.insert(b.as_str());
            }
            if let Some(l) = &ch.client_leg {
                out.insert(l.as_str(), (vm.clone(), "relay_client"));
                relay_side.insert(l.as_str());
            }
        }
    }
    for c in &r.channels {
        if relay_side.contains(c.socket.as_str()) {
            continue;
        }
        let relay = target_of(c.pid, targets, &parent)
            .is_some_and(|t| matches!(t.kind, TargetKind::Relay { .. }));
        let leg = if !relay {
            "server"
        } else if c.end.as_deref() == Some("client") {
            "relay_backend"
        } else {
            "relay_client"
        };
        out.insert(c.socket.as_str(), (name_of(c.pid), leg));
    }
    out
}

/// Builds every metric family from one snapshot. Families without a series are left out (the
/// text format has no empty family).
pub fn families(input: &ScrapeInput<'_>) -> Vec<MetricFamily> {
    let r = input.report;
    let mut b = Builder {
        fams: BTreeMap::new(),
    };
    let legs = legs(r, input.targets);
    // One series owner per label set: the open socket that sent the most messages.
    let mut owner: HashMap<(String, &str, &str, String), &ChannelReport> = HashMap::new();
    for c in r.channels.iter().filter(|c| !c.closed) {
        let (vm, leg) = &legs[c.socket.as_str()];
        let id = c.channel_id.map_or(String::new(), |i| i.to_string());
        b.put(
            "spice_observer_channel_info",
            &[
                vm,
                leg,
                &c.channel_type,
                &id,
                &c.pid.to_string(),
                &c.socket,
                &c.session_id.map_or(String::new(), |s| s.to_string()),
                &c.framing,
                c.unparsed_reason.as_deref().unwrap_or(""),
                if c.channel_type_inferred {
                    "true"
                } else {
                    "false"
                },
                c.session_key.as_deref().unwrap_or(""),
                &c.transport,
            ],
            1.0,
        );
        if c.channel_type == "unknown" {
            continue;
        }
        let key = (vm.clone(), *leg, c.channel_type.as_str(), id);
        let e = owner.entry(key).or_insert(c);
        if c.messages_sent > e.messages_sent {
            *e = c;
        }
    }
    let mut owned: Vec<_> = owner.into_iter().collect();
    owned.sort_by(|a, b| a.0.cmp(&b.0));
    for ((vm, leg, ty, id), c) in owned {
        let l: [&str; 4] = [&vm, leg, ty, &id];
        fn with<'s>(l: &[&'s str; 4], x: &'s str) -> [&'s str; 5] {
            [l[0], l[1], l[2], l[3], x]
        }
        if let Some(v) = c.in_flight_now {
            b.put("spice_observer_in_flight_now_messages", &l, v as f64);
        }
        if let Some(v) = c.in_flight_limit {
            b.put("spice_observer_in_flight_limit_messages", &l, v as f64);
        }
        if let Some(w) = c.window {
            b.put("spice_observer_ack_window_messages", &l, w as f64);
        }
        if let (Some(lo), Some(hi)) = (c.in_flight_low, c.in_flight_high) {
            let bounded = if c.in_flight_bounded { "true" } else { "false" };
            b.put(
                "spice_observer_in_flight_low_messages",
                &with(&l, bounded),
                lo as f64,
            );
            b.put(
                "spice_observer_in_flight_high_messages",
                &with(&l, bounded),
                hi as f64,
            );
        }
        if let Some(src) = &c.window_source {
            b.put(
                "spice_observer_ack_window_source_info",
                &with(&l, src.as_str()),
                1.0,
            );
        }
        if let Some(stages) = &c.stages {
            for (stage, s) in stages {
                b.put(
                    "spice_observer_in_flight_stage_messages",
                    &with(&l, stage),
                    s.now as f64,
                );
            }
        }
        if let Some(v) = c.in_flight_relay_now {
            b.put(
                "spice_observer_in_flight_relay_visible_messages",
                &l,
                v as f64,
            );
        }
        if let Some(h) = &c.in_flight_histogram {
            // The report keeps seconds; the exposition's bucket counts are integers (prometheus
            // 0.14's Bucket::cumulative_count is a u64): milliseconds.
            let ms = |s: f64| (s * 1e3).round().max(0.0) as u64;
            let buckets: Vec<(f64, u64)> =
                h.le.iter()
                    .zip(&h.seconds)
                    .map(|(&le, &s)| (f64::from(le), ms(s)))
                    .collect();
            b.histogram(
                "spice_observer_in_flight_messages",
                &l,
                &buckets,
                h.sum * 1e3,
                ms(h.count),
            );
        }
        if let Some((sent, recv)) = directions(c) {
            b.put(
                "spice_observer_messages_total",
                &with(&l, sent),
                c.messages_sent as f64,
            );
            b.put(
                "spice_observer_messages_total",
                &with(&l, recv),
                c.messages_received as f64,
            );
            b.put(
                "spice_observer_bytes_total",
                &with(&l, sent),
                c.bytes_sent as f64,
            );
            b.put(
                "spice_observer_bytes_total",
                &with(&l, recv),
                c.bytes_received as f64,
            );
        }
        put_socket_bytes(&mut b, &l, c);
        if c.window.is_some() {
            b.put("spice_observer_acks_total", &l, c.acks as f64);
            b.put(
                "spice_observer_acks_ignored_total",
                &l,
                c.acks_ignored as f64,
            );
            b.put("spice_observer_ack_surplus_total", &l, c.ack_surplus as f64);
            b.put(
                "spice_observer_window_wait_seconds_total",
                &l,
                c.stalled_seconds_total,
            );
            b.put(
                "spice_observer_window_stalls_total",
                &l,
                c.stalls_total as f64,
            );
        }
        b.put(
            "spice_observer_records_lost_total",
            &l,
            c.records_lost as f64,
        );
        let resyncs: u32 = [&c.sync_sent, &c.sync_received]
            .iter()
            .filter_map(|s| s.as_ref().map(|s| s.resyncs))
            .sum();
        b.put("spice_observer_resyncs_total", &l, resyncs as f64);
        if let Some(t) = &c.tcp {
            b.put(
                "spice_observer_tcp_srtt_seconds",
                &l,
                f64::from(t.srtt_us) / 1e6,
            );
            b.put(
                "spice_observer_tcp_cwnd_segments",
                &l,
                f64::from(t.cwnd_segments),
            );
            b.put(
                "spice_observer_tcp_notsent_bytes",
                &l,
                f64::from(t.notsent_bytes),
            );
            b.put(
                "spice_observer_tcp_unacked_segments",
                &l,
                f64::from(t.unacked_segments),
            );
            b.put(
                "spice_observer_tcp_retransmits_total",
                &l,
                f64::from(t.total_retrans),
            );
            b.put(
                "spice_observer_tcp_receive_queue_bytes",
                &l,
                f64::from(t.recv_queue_bytes),
            );
            if let Some(rate) = t.delivery_rate_bytes_per_s {
                b.put(
                    "spice_observer_tcp_delivery_rate_bytes_per_second",
                    &l,
                    rate as f64,
                );
            }
        }
        if leg == "server"
            && let Some(v) = &c.verdict
        {
            b.put(
                "spice_observer_verdict_info",
                &[l[0], l[2], l[3], verdict_label(v)],
                1.0,
            );
        }
    }
    // Sockets of no known channel type share channel "unknown": the open one of each vm and
    // leg that moved the most bytes gets the byte counter.
    let moved = |c: &ChannelReport| {
        c.traffic.bytes_written_total.unwrap_or(0) + c.traffic.bytes_read_total.unwrap_or(0)
    };
    let mut unknown: BTreeMap<(&str, &str), &ChannelReport> = BTreeMap::new();
    for c in r
        .channels
        .iter()
        .filter(|c| !c.closed && c.channel_type == "unknown")
    {
        let (vm, leg) = &legs[c.socket.as_str()];
        let e = unknown.entry((vm.as_str(), *leg)).or_insert(c);
        if moved(c) > moved(e) {
            *e = c;
        }
    }
    for ((vm, leg), c) in unknown {
        put_socket_bytes(&mut b, &[vm, leg, "unknown", ""], c);
    }
    // Self metrics.
    for (i, name) in counter::NAMES.iter().enumerate() {
        let v = r.kernel_counters.get(*name).copied().unwrap_or(0) as f64;
        if counter::is_loss(i as u32) {
            b.put("spice_observer_information_lost_total", &[name], v);
        } else {
            b.put("spice_observer_kernel_events_total", &[name], v);
        }
    }
    b.put(
        "spice_observer_information_lost_total",
        &["decode_errors"],
        input.decode_errors as f64,
    );
    b.put(
        "spice_observer_ring_records_total",
        &[],
        input.records as f64,
    );
    b.put("spice_observer_sockets_tracked", &[], input.sockets as f64);
    let channels = r
        .channels
        .iter()
        .filter(|c| !c.closed && c.channel_type != "unknown")
        .count();
    b.put("spice_observer_channels_tracked", &[], channels as f64);
    b.put("spice_observer_chains_tracked", &[], input.chains as f64);
    b.put(
        "spice_observer_processes_tracked",
        &[],
        input.processes as f64,
    );
    for kind in ["qemu", "xspice", "relay"] {
        let n = input
            .targets
            .iter()
            .filter(|t| {
                kind == match t.kind {
                    TargetKind::SpiceServer(ServerKind::Qemu) => "qemu",
                    TargetKind::SpiceServer(ServerKind::Xspice) => "xspice",
                    TargetKind::Relay { .. } => "relay",
                }
            })
            .count();
        b.put("spice_observer_targets_discovered", &[kind], n as f64);
    }
    b.put(
        "spice_observer_degraded_features",
        &[],
        r.degraded.len() as f64,
    );
    for state in TLS_STATES {
        let n = r.tls_processes.iter().filter(|p| p.state == state).count();
        b.put("spice_observer_tls_processes", &[state], n as f64);
    }
    b.put("spice_observer_hook_set_info", &[&r.hook_set], 1.0);
    if let Some(programs) = input.programs {
        for p in programs {
            b.put(
                "spice_observer_bpf_run_seconds_total",
                &[&p.name],
                p.run_time_ns as f64 / 1e9,
            );
            b.put(
                "spice_observer_bpf_runs_total",
                &[&p.name],
                p.run_count as f64,
            );
        }
    }
    b.put("spice_observer_start_time_seconds", &[], input.start_time_s);
    b.put(
        "spice_observer_build_info",
        &[env!("CARGO_PKG_VERSION")],
        1.0,
    );
    b.finish()
}

/// The `spice_observer_scrape_duration_seconds` family (added by the collector once the rest
/// is built).
pub fn scrape_duration(seconds: f64) -> MetricFamily {
    let mut b = Builder {
        fams: BTreeMap::new(),
    };
    b.put("spice_observer_scrape_duration_seconds", &[], seconds);
    b.finish().remove(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::discovery::{ServerKind, TargetKind};
    use prometheus::{Encoder, TextEncoder};
    use serde_json::json;

    /// A report row as the observer writes it: spice-server's display channel unless changed.
    fn row(socket: &str, pid: u32, end: &str, ty: &str, sent: u64) -> serde_json::Value {
        let mut v = json!({
            "socket": socket, "cookie": 1, "pid": pid, "comm": "x", "end": end,
            "session_id": 7, "channel_type": ty, "channel_id": 0, "framing": "mini",
            "transport": "tcp", "tls": null,
            "unparsed_reason": null, "unparsed_detail": null, "window": 20,
            "ack_generation": 1, "ack_sync_generation": 1, "set_acks": 1, "generations": 1,
            "ack_syncs": 1, "acks": 3, "acks_ignored": 0, "ack_surplus": 0,
            "messages_sent": sent, "bytes_sent": sent * 100, "messages_received": 4,
            "bytes_received": 40, "messages_sent_by_type": {}, "messages_received_by_type": {},
            "bytes_sent_by_type": {}, "bytes_received_by_type": {},
            "messages_sent_eagain_start": 0, "channel_type_inferred": false,
            "end_inferred": false, "session_inferred": false,
            "server_to_client": {"messages": sent, "bytes": 0, "messages_per_s": 0.0,
                "mbit_per_s": 0.0, "mean_message_bytes": 0.0}
        });
        let more = json!({
            "in_flight_now": 5, "in_flight_p50": 3, "in_flight_max": 9, "in_flight_limit": 41,
            "in_flight_low": 5, "in_flight_high": 5, "in_flight_exact": true,
            "in_flight_bounded": false, "window_inferred": false, "window_source": "set_ack",
            "joined_window": null,
            "stalled_fraction": 0.0, "stalls": 0, "starts_while_stalled": 0,
            "urgent_pair_peaks": 0, "records_lost": 0, "kernel_window": null, "observed_s": 1.0, "closed": false,
            "tcp": {"srtt_us": 1500, "cwnd_segments": 10, "notsent_bytes": 0,
                "notsent_max_bytes": 0, "unacked_segments": 0, "total_retrans": 2,
                "recv_queue_bytes": 0, "source": "sock_diag", "delivery_rate_bytes_per_s": 1000},
            "in_flight_relay_p50": null, "in_flight_relay_max": null, "in_flight_relay_now": null,
            "stages": null, "chain": null, "messages_per_srtt": null,
            "window_ceiling_msgs_per_s": null,
            "verdict": "neither window nor link binds: in flight p50 3 of 41",
            "stalled_seconds_total": 0.25, "stalls_total": 2,
            "in_flight_histogram": {"le": [0, 5, 10, 20, 30, 40, 41, 42],
                "seconds": [0.1, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], "sum": 3.0, "count": 1.0}
        });
        for (k, x) in more.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    fn report(channels: Vec<serde_json::Value>) -> Report {
        serde_json::from_value(json!({
            "source": {"kind": "pinned", "pin_dir": "/sys/fs/bpf/spice-observer",
                "exact_from_session_start": true, "tap": false},
            "duration_s": 1.0, "clock": {"realtime_ns": 0, "monotonic_ns": 0},
            "hook_set": "tracepoints+sockops", "events_lost": 0,
            "kernel_counters": {"ring_full": 0, "calls_traced": 12}, "degraded": [],
            "pids": [], "forked": [{"parent": 200, "child": 201, "comm": "socat", "at_s": 0.1}],
            "exited": [], "tls_processes": [], "channels": channels
        }))
        .unwrap()
    }

    fn target(pid: u32, kind: TargetKind, name: &str) -> Target {
        Target {
            pid,
            start_time: 1,
            kind,
            name: name.into(),
            comm: "x".into(),
        }
    }

    fn text(fams: &[MetricFamily]) -> String {
        let mut buf = Vec::new();
        TextEncoder::new().encode(fams, &mut buf).unwrap();
        String::from_utf8(buf).unwrap()
    }

    /// The sample lines of `name` (exact, with labels).
    fn lines<'a>(t: &'a str, name: &str) -> Vec<&'a str> {
        t.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
            .collect()
    }

    #[test]
    fn metrics_table_is_consistent() {
        let mut names = HashSet::new();
        for d in METRICS {
            assert!(names.insert(d.name), "{} twice", d.name);
            assert!(d.name.starts_with("spice_observer_"));
            assert_eq!(
                d.kind == Kind::Counter,
                d.name.ends_with("_total"),
                "{}",
                d.name
            );
            if d.name.ends_with("_info") {
                assert_eq!(d.kind, Kind::Gauge);
            }
            for l in d.labels {
                if !d.name.ends_with("_info") {
                    assert!(
                        !["pid", "socket", "session_id", "port"].contains(l),
                        "{}",
                        d.name
                    );
                }
            }
        }
    }

    /// README's Metrics table lists exactly [`METRICS`], with their types and labels.
    #[test]
    fn metrics_readme_table_matches() {
        let readme = include_str!("../../../README.md");
        let section = readme.split("\n## Metrics").nth(1).expect("## Metrics");
        let section = section.split("\n## ").next().unwrap();
        let mut rows = BTreeMap::new();
        for l in section
            .lines()
            .filter(|l| l.starts_with("| `spice_observer_"))
        {
            let cells: Vec<&str> = l.split(" | ").collect();
            let name = cells[0].trim_start_matches("| ").trim_matches('`');
            rows.insert(
                name.to_string(),
                (cells[1].to_string(), cells[2].replace('`', "")),
            );
        }
        for d in METRICS {
            let (kind, labels) = rows
                .remove(d.name)
                .unwrap_or_else(|| panic!("{} not in README", d.name));
            assert_eq!(kind, d.kind.name(), "{}", d.name);
            let want = if d.labels.is_empty() {
                "—".to_string()
            } else {
                d.labels.join(", ")
            };
            assert_eq!(labels, want, "{}", d.name);
        }
        assert!(
            rows.is_empty(),
            "README lists unknown metrics {:?}",
            rows.keys()
        );
    }

    /// A joined socket whose channel type was inferred says so in `channel_info`, with its
    /// session's main channel; a known one says `channel_inferred="false"`.
    #[test]
    fn metrics_info_marks_inferred_channel_types() {
        let known = row("10.0.0.1:5900->10.0.0.2:40000", 100, "server", "main", 3);
        let mut joined = row("10.0.0.1:5900->10.0.0.2:40001", 100, "server", "display", 9);
        joined["channel_id"] = json!(null);
        joined["channel_type_inferred"] = json!(true);
        joined["channel_type_evidence"] = json!("DRAW_FILL (302) ×9 server→client");
        joined["session_key"] = json!("10.0.0.1:5900->10.0.0.2:40000");
        joined["session_inferred"] = json!(true);
        let r = report(vec![known, joined]);
        let targets = [target(
            100,
            TargetKind::SpiceServer(ServerKind::Qemu),
            "vm-a",
        )];
        let t = text(&families(&ScrapeInput {
            report: &r,
            targets: &targets,
            programs: None,
            sockets: 2,
            chains: 0,
            processes: 1,
            records: 0,
            decode_errors: 0,
            start_time_s: 1.0,
        }));
        let info = lines(&t, "spice_observer_channel_info");
        assert_eq!(info.len(), 2, "{info:?}");
        assert!(
            info.iter()
                .any(|l| l.contains("channel=\"display\",channel_id=\"\"")
                    && l.contains("channel_inferred=\"true\"")
                    && l.contains("session_key=\"10.0.0.1:5900->10.0.0.2:40000\"")),
            "{info:?}"
        );
        assert!(
            info.iter().any(|l| l.contains("channel=\"main\"")
                && l.contains("channel_inferred=\"false\"")
                && l.contains("session_key=\"\"")),
            "{info:?}"
        );
    }

    #[test]
    fn metrics_verdict_labels() {
        for (text, label) in [
            ("idle: 0.0 msgs/s", "idle"),
            ("client bound: the client's receive window", "client_bound"),
            ("link bound (cwnd/rate): 1.0 Mbit/s", "link_bound"),
            ("ACK-window bound: spice-server waited", "ack_window_bound"),
            ("send-buffer bound: 300 KiB", "send_buffer_bound"),
            (
                "partly window bound: at the window 7%",
                "partly_window_bound",
            ),
            ("neither window nor link binds: in flight", "neither"),
            ("cannot judge: stream unparsed (tls)", "cannot_judge"),
            ("no SET_ACK seen: the ACK window is unknown", "cannot_judge"),
        ] {
            assert_eq!(verdict_label(text), label, "{text}");
        }
    }

    /// A display channel joined mid-stream whose count is still an interval: low and high
    /// gauges labelled bounded="true", W's source ack_cadence, no exact count; a channel seen
    /// from its SET_ACK gets bounded="false" with low = high = the count.
    #[test]
    fn metrics_joined_channel_is_bounded() {
        let mut joined = row(
            "10.0.0.1:5900->10.0.0.1:40000",
            100,
            "server",
            "display",
            50,
        );
        for (k, v) in [
            ("in_flight_now", json!(null)),
            ("in_flight_low", json!(12)),
            ("in_flight_high", json!(41)),
            ("in_flight_exact", json!(false)),
            ("in_flight_bounded", json!(true)),
            ("window_inferred", json!(true)),
            ("window_source", json!("ack_cadence")),
        ] {
            joined[k] = v;
        }
        let exact = row("10.0.0.1:5900->10.0.0.1:40001", 100, "server", "cursor", 5);
        let r = report(vec![joined, exact]);
        let targets = [target(
            100,
            TargetKind::SpiceServer(ServerKind::Qemu),
            "vm-a",
        )];
        let fams = families(&ScrapeInput {
            report: &r,
            targets: &targets,
            programs: None,
            sockets: 2,
            chains: 0,
            processes: 0,
            records: 0,
            decode_errors: 0,
            start_time_s: 0.0,
        });
        let t = text(&fams);
        let l = "vm=\"vm-a\",leg=\"server\",channel=\"display\",channel_id=\"0\"";
        assert!(
            t.contains(&format!(
                "spice_observer_in_flight_low_messages{{{l},bounded=\"true\"}} 12"
            )),
            "{t}"
        );
        assert!(
            t.contains(&format!(
                "spice_observer_in_flight_high_messages{{{l},bounded=\"true\"}} 41"
            )),
            "{t}"
        );
        assert!(
            t.contains(&format!(
                "spice_observer_ack_window_source_info{{{l},source=\"ack_cadence\"}} 1"
            )),
            "{t}"
        );
        assert!(
            !t.contains(&format!("spice_observer_in_flight_now_messages{{{l}}}")),
            "{t}"
        );
        let c = "vm=\"vm-a\",leg=\"server\",channel=\"cursor\",channel_id=\"0\"";
        assert!(
            t.contains(&format!(
                "spice_observer_in_flight_low_messages{{{c},bounded=\"false\"}} 5"
            )),
            "{t}"
        );
        assert!(
            t.contains(&format!(
                "spice_observer_ack_window_source_info{{{c},source=\"set_ack\"}} 1"
            )),
            "{t}"
        );
    }

    /// Legs and VMs from the chain, series only for open channels, one owner per label set,
    /// and a text exposition without empty families.
    #[test]
    fn metrics_families_from_a_snapshot() {
        let mut server = row(
            "10.0.0.1:5900->10.0.0.1:40000",
            100,
            "server",
            "display",
            500,
        );
        server["chain"] = json!({
            "backend": "10.0.0.1:40000->10.0.0.1:5900", "client_leg": "10.0.0.1:6900->10.0.0.2:50000",
            "relay_pid": 201, "pairing": [], "transparency": "transparent",
            "transparency_detail": null, "placeable_stages": [], "samples": 1,
            "samples_placed": 1, "clamped_samples": 0, "clamped_max": 0, "kept_short_samples": 0,
            "unplaced_max": 0, "link_rate_mbit": null, "link_delivered_mbit": null,
            "link_rwnd_limited_fraction": null, "link_srtt_us": null,
            "relay_above_true_samples": 0, "relay_below_true_fraction": null,
            "relay_gap_upstream_fraction": null
        });
        server["stages"] = json!({"server_notsent": {"now": 2, "p50": 1, "max": 3, "bytes_p50": 0},
            "client_owes_ack": {"now": 3, "p50": 1, "max": 3, "bytes_p50": 0}});
        server["in_flight_relay_now"] = json!(4);
        let mut backend = row("10.0.0.1:40000->10.0.0.1:5900", 201, "client", "display", 4);
        backend["verdict"] = json!(null);
        let mut client = row(
            "10.0.0.1:6900->10.0.0.2:50000",
            201,
            "server",
            "display",
            500,
        );
        client["verdict"] = json!(null);
        // An unpaired relay leg, a closed socket of the same VM, two of the same channel.
        let lone = row("10.0.0.1:41000->10.0.0.1:5901", 201, "client", "main", 9);
        let mut closed = row("10.0.0.1:5900->10.0.0.1:39999", 100, "server", "cursor", 5);
        closed["closed"] = json!(true);
        let dup = row("10.0.0.1:5900->10.0.0.1:40001", 100, "server", "display", 3);
        let mut unknown = row("10.0.0.1:5900->10.0.0.1:40002", 100, "server", "unknown", 0);
        unknown["framing"] = json!("unparsed");
        unknown["unparsed_reason"] = json!("not_spice");
        let r = report(vec![server, backend, client, lone, closed, dup, unknown]);
        let targets = [
            target(100, TargetKind::SpiceServer(ServerKind::Qemu), "vm-a"),
            target(
                200,
                TargetKind::Relay {
                    rule: "socat".into(),
                },
                "socat",
            ),
        ];
        let fams = families(&ScrapeInput {
            report: &r,
            targets: &targets,
            programs: Some(&[ProgramCost {
                name: "spice_sock_send".into(),
                run_time_ns: 2_000_000_000,
                run_count: 5,
            }]),
            sockets: 7,
            chains: 1,
            processes: 2,
            records: 99,
            decode_errors: 0,
            start_time_s: 1.0,
        });
        let t = text(&fams);
        let now = lines(&t, "spice_observer_in_flight_now_messages");
        assert_eq!(now.len(), 4, "{now:?}");
        for leg in ["server", "relay_backend", "relay_client"] {
            assert!(
                now.iter()
                    .any(|l| l.contains("vm=\"vm-a\"") && l.contains(&format!("leg=\"{leg}\""))),
                "{leg}: {now:?}"
            );
        }
        assert!(
            now.iter()
                .any(|l| l.contains("vm=\"socat\",leg=\"relay_backend\",channel=\"main\""))
        );
        // The busier of the two display sockets owns the series.
        assert!(t.contains("spice_observer_messages_total{vm=\"vm-a\",leg=\"server\",channel=\"display\",channel_id=\"0\",direction=\"server_to_client\"} 500"), "{t}");
        // The relay's backend leg sends client → server.
        assert!(t.contains("leg=\"relay_backend\",channel=\"display\",channel_id=\"0\",direction=\"client_to_server\"} 4"));
        // Closed channels are gone; unknown ones only in channel_info.
        assert!(!t.contains("channel=\"cursor\""), "{t}");
        assert_eq!(lines(&t, "spice_observer_channel_info").len(), 6);
        assert!(t.contains("unparsed_reason=\"not_spice\""));
        assert_eq!(lines(&t, "spice_observer_verdict_info").len(), 1);
        assert!(t.contains("verdict=\"neither\""));
        assert!(t.contains("spice_observer_in_flight_stage_messages{vm=\"vm-a\",leg=\"server\",channel=\"display\",channel_id=\"0\",stage=\"client_owes_ack\"} 3"));
        assert!(t.contains("spice_observer_in_flight_relay_visible_messages{vm=\"vm-a\",leg=\"server\",channel=\"display\",channel_id=\"0\"} 4"));
        assert!(t.contains("spice_observer_tcp_srtt_seconds{vm=\"vm-a\",leg=\"server\",channel=\"display\",channel_id=\"0\"} 0.0015"));
        assert!(t.contains("spice_observer_window_wait_seconds_total{vm=\"vm-a\",leg=\"server\",channel=\"display\",channel_id=\"0\"} 0.25"));
        assert!(t.contains("spice_observer_records_lost_total{vm=\"vm-a\",leg=\"server\",channel=\"display\",channel_id=\"0\"} 0"));
        // Histogram in milliseconds.
        assert!(t.contains("spice_observer_in_flight_messages_bucket{vm=\"vm-a\",leg=\"server\",channel=\"display\",channel_id=\"0\",le=\"5\"} 500"), "{t}");
        assert!(t.contains("spice_observer_in_flight_messages_count{vm=\"vm-a\",leg=\"server\",channel=\"display\",channel_id=\"0\"} 1000"));
        assert!(t.contains("spice_observer_in_flight_messages_sum{vm=\"vm-a\",leg=\"server\",channel=\"display\",channel_id=\"0\"} 3000"));
        assert!(t.contains("spice_observer_bpf_run_seconds_total{program=\"spice_sock_send\"} 2"));
        assert!(t.contains("spice_observer_kernel_events_total{event=\"calls_traced\"} 12"));
        assert!(t.contains("spice_observer_information_lost_total{reason=\"ring_full\"} 0"));
        assert!(t.contains("spice_observer_targets_discovered{kind=\"relay\"} 1"));
        // Without bpf_stats the families are absent.
        let fams = families(&ScrapeInput {
            report: &r,
            targets: &targets,
            programs: None,
            sockets: 0,
            chains: 0,
            processes: 0,
            records: 0,
            decode_errors: 0,
            start_time_s: 0.0,
        });
        assert!(!text(&fams).contains("bpf_run"));
    }

    /// `spice_observer_socket_bytes_total`: every socket's traced bytes, framed or not. A
    /// joined socket whose end is not known yet takes its directions from its leg; of two
    /// open sockets of unknown channel type of one vm and leg, the one that moved more
    /// bytes gets the series; a socket not read yet has none.
    #[test]
    fn metrics_tls_processes_and_transport() {
        let mut tls = row("10.0.0.1:5900->10.0.0.1:40000", 100, "server", "display", 5);
        tls["transport"] = json!("tls");
        let plain = row("10.0.0.1:5900->10.0.0.1:40001", 100, "server", "cursor", 5);
        let mut r = report(vec![tls, plain]);
        r.tls_processes = serde_json::from_value(json!([
            {"pid": 100, "comm": "qemu", "state": "attached", "library": "/usr/lib/libssl.so.3", "error": null},
            {"pid": 201, "comm": "socat", "state": "no_libssl", "library": null, "error": null},
            {"pid": 202, "comm": "haproxy", "state": "no_libssl", "library": null, "error": null}
        ]))
        .unwrap();
        // The kernel's TLS counters: losses count as information lost, the rest as events.
        r.kernel_counters = counter::NAMES.iter().map(|n| (n.to_string(), 3)).collect();
        let targets = [target(
            100,
            TargetKind::SpiceServer(ServerKind::Qemu),
            "vm-a",
        )];
        let t = text(&families(&ScrapeInput {
            report: &r,
            targets: &targets,
            programs: None,
            sockets: 2,
            chains: 0,
            processes: 0,
            records: 0,
            decode_errors: 0,
            start_time_s: 0.0,
        }));
        assert_eq!(
            lines(&t, "spice_observer_tls_processes"),
            [
                "spice_observer_tls_processes{state=\"attached\"} 1",
                "spice_observer_tls_processes{state=\"no_libssl\"} 2",
                "spice_observer_tls_processes{state=\"failed\"} 0",
                "spice_observer_tls_processes{state=\"disabled\"} 0",
            ],
            "{t}"
        );
        let info = lines(&t, "spice_observer_channel_info");
        assert_eq!(info.len(), 2);
        assert!(
            info.iter()
                .any(|l| l.contains("channel=\"display\"") && l.contains("transport=\"tls\"")),
            "{info:?}"
        );
        assert!(
            info.iter()
                .any(|l| l.contains("channel=\"cursor\"") && l.contains("transport=\"tcp\"")),
            "{info:?}"
        );
        for (name, lost) in [
            ("tls_unmapped", true),
            ("tls_pending_full", true),
            ("tls_calls", false),
            ("tls_unseen", true),
        ] {
            let family = if lost {
                "spice_observer_information_lost_total{reason="
            } else {
                "spice_observer_kernel_events_total{event="
            };
            assert!(
                t.contains(&format!("{family}\"{name}\"}} 3")),
                "{name}: {t}"
            );
        }
    }

    #[test]
    fn metrics_socket_bytes_for_unframed_sockets() {
        let traffic = |v: &mut serde_json::Value, w: u64, r: u64| {
            v["bytes_written_total"] = json!(w);
            v["bytes_read_total"] = json!(r);
        };
        let mut framed = row("10.0.0.1:5900->10.0.0.1:40000", 100, "server", "display", 5);
        traffic(&mut framed, 700, 60);
        let mut busy = row("10.0.0.1:5900->10.0.0.1:40002", 100, "server", "unknown", 0);
        busy["end"] = json!(null);
        busy["framing"] = json!("hunting");
        traffic(&mut busy, 9_000_000, 1200);
        let mut quiet = row("10.0.0.1:5900->10.0.0.1:40003", 100, "server", "unknown", 0);
        quiet["end"] = json!(null);
        traffic(&mut quiet, 10, 10);
        let unread = row("10.0.0.1:41000->10.0.0.1:5901", 201, "client", "unknown", 0);
        let r = report(vec![framed, busy, quiet, unread]);
        let targets = [
            target(100, TargetKind::SpiceServer(ServerKind::Qemu), "vm-a"),
            target(
                201,
                TargetKind::Relay {
                    rule: "socat".into(),
                },
                "socat",
            ),
        ];
        let t = text(&families(&ScrapeInput {
            report: &r,
            targets: &targets,
            programs: None,
            sockets: 4,
            chains: 0,
            processes: 0,
            records: 0,
            decode_errors: 0,
            start_time_s: 0.0,
        }));
        let got = lines(&t, "spice_observer_socket_bytes_total");
        assert_eq!(
            got,
            [
                "spice_observer_socket_bytes_total{vm=\"vm-a\",leg=\"server\",channel=\"display\",channel_id=\"0\",direction=\"server_to_client\"} 700",
                "spice_observer_socket_bytes_total{vm=\"vm-a\",leg=\"server\",channel=\"display\",channel_id=\"0\",direction=\"client_to_server\"} 60",
                "spice_observer_socket_bytes_total{vm=\"vm-a\",leg=\"server\",channel=\"unknown\",channel_id=\"\",direction=\"server_to_client\"} 9000000",
                "spice_observer_socket_bytes_total{vm=\"vm-a\",leg=\"server\",channel=\"unknown\",channel_id=\"\",direction=\"client_to_server\"} 1200",
            ],
            "{t}"
        );
        assert!(t.contains("# TYPE spice_observer_socket_bytes_total counter"));
    }
}
