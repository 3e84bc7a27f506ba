//! Privileged tests of SPICE inside TLS, framed from the plaintext the processes hand to
//! libssl (uprobes on the libssl.so.3 each watched process maps), on real processes:
//!
//! * Xspice with only a TLS port (certificates made by the test with openssl,
//!   rig/tls-certs.sh) and spice-gtk given the CA: every channel framed and typed through the
//!   uprobes, the window (SET_ACK, W, ACKs) on display and cursor, and the stalled client's
//!   maximum 2W+1 ([`tls_port_session_is_framed`]).
//! * the same session through stunnel (Debian's stunnel4, a TLS-terminating relay whose
//!   client side is plaintext): spice-server's TLS sockets (uprobes) carry the counts of
//!   stunnel's plaintext leg (normal path), which a packet capture of that leg and stunnel's
//!   own byte counts confirm; the stages add up to the count, and where they lie relative to
//!   the plaintext leg agrees with the capture of that leg ([`tls_relay_counts_equal_plain_leg`]).
//! * spice-peer through two stunnels (plain → TLS → plain): the peers' own counts equal what
//!   the observer frames on both stunnels' TLS legs and plain legs, and a marker string that
//!   fills every message body appears in no output of the observer
//!   ([`spice_peer_through_two_stunnels_counts_exact`]).
//! * TLS records from a process that maps no libssl (spice-peer `--tls-bytes`) stay
//!   `unparsed: tls`, with a detail that says so ([`tls_without_libssl_stays_unparsed`]).
//!
//! Run serially (`--test-threads=1`) and under the machine's privileged-test lock. Ports
//! 5910–5915 / 6911–6913, displays :10 and :11.

mod common;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use common::{
    Client, Rig, check_run, describe_ch,
    oracle::{self, Capture, Clock, Sample, SpiceConn},
    peer::{Client as PeerClient, Server as PeerServer},
    privileged, remote_of,
};
use spice_observer::report::{ChannelReport, Report, TlsChannelReport};

// ---------------------------------------------------------------------------------------------
// Shared checks
// ---------------------------------------------------------------------------------------------

/// The libssl file `pid` maps, from /proc/PID/maps (the source the observer's
/// `tls_processes[].library` must match); None if it maps none.
fn libssl_of(pid: u32) -> Result<Option<String>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .with_context(|| format!("reading /proc/{pid}/maps"))?;
    Ok(maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            Path::new(p)
                .file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.starts_with("libssl.so"))
        })
        .map(str::to_string))
}

/// [`check_run`], the libssl programs in the hook set, and no loss in the TLS counters:
/// `tls_unmapped` (a socket call inside a hooked libssl call that found no socket),
/// `tls_pending_full` (no room to keep a libssl call open), `tls_unseen` (bytes of a TLS
/// socket moved outside every hooked call); `tls_calls` must show the hooks ran.
fn check_tls_run(r: &Report) -> Result<()> {
    check_run(r)?;
    ensure!(
        r.hook_set.split('+').any(|h| h == "libssl"),
        "hook set {:?} lacks libssl",
        r.hook_set
    );
    let k = &r.kernel_counters;
    let get = |name: &str| {
        k.get(name)
            .copied()
            .with_context(|| format!("kernel counter {name} missing: {k:?}"))
    };
    for name in ["tls_unmapped", "tls_pending_full", "tls_unseen"] {
        let v = get(name)?;
        ensure!(v == 0, "kernel counter {name} = {v}: {k:?}");
    }
    ensure!(get("tls_calls")? > 0, "no libssl call traced: {k:?}");
    Ok(())
}

/// `tls_processes` says the hooks are attached to `pid` on `library` (the file its maps
/// name).
fn check_attached(r: &Report, pid: u32, library: &str) -> Result<()> {
    let p = r
        .tls_processes
        .iter()
        .find(|p| p.pid == pid)
        .with_context(|| format!("pid {pid} not in tls_processes: {:?}", r.tls_processes))?;
    ensure!(
        p.state == "attached" && p.library.as_deref() == Some(library) && p.error.is_none(),
        "pid {pid}: tls_processes entry {p:?}, expected attached on {library}"
    );
    Ok(())
}

/// The `tls` object of a socket framed through the uprobes: transport `tls`, framed with mini
/// headers from its link phase (never `unparsed`), the library of its process, and libssl
/// calls that moved plaintext both ways.
fn check_tls_socket<'a>(c: &'a ChannelReport, library: &str) -> Result<&'a TlsChannelReport> {
    let d = describe_ch(c);
    ensure!(c.transport == "tls", "transport {:?}: {d}", c.transport);
    let t = c
        .tls
        .as_ref()
        .with_context(|| format!("transport tls but no tls object: {d}"))?;
    ensure!(
        t.library.as_deref() == Some(library),
        "tls.library {:?}, the process maps {library}: {d}",
        t.library
    );
    ensure!(
        t.plaintext_calls_sent > 0 && t.plaintext_calls_received > 0,
        "no plaintext libssl call one way: {t:?}: {d}"
    );
    check_framed(c)?;
    Ok(t)
}

/// Framed from the link phase with mini headers, typed by the link message, nothing unparsed.
fn check_framed(c: &ChannelReport) -> Result<()> {
    let d = describe_ch(c);
    ensure!(
        c.framing == "mini",
        "framing {} ({:?}: {:?}): {d}",
        c.framing,
        c.unparsed_reason,
        c.unparsed_detail
    );
    ensure!(
        c.unparsed_reason.is_none(),
        "unparsed {:?} ({:?}): {d}",
        c.unparsed_reason,
        c.unparsed_detail
    );
    ensure!(
        !c.channel_type_inferred && c.channel_id.is_some(),
        "channel not typed by its link message: {d}"
    );
    ensure!(
        c.sync_sent.is_none() && c.sync_received.is_none(),
        "a direction resynchronised: {:?} / {:?}: {d}",
        c.sync_sent,
        c.sync_received
    );
    ensure!(c.records_lost == 0, "records lost: {d}");
    Ok(())
}

/// The channels of `pid`, by type; exactly main, display, inputs and cursor, id 0, each once.
fn session_channels(r: &Report, pid: u32) -> Result<BTreeMap<String, &ChannelReport>> {
    let mut by = BTreeMap::new();
    for c in r.channels.iter().filter(|c| c.pid == pid) {
        ensure!(
            c.channel_id == Some(0),
            "channel id {:?}: {}",
            c.channel_id,
            describe_ch(c)
        );
        if by.insert(c.channel_type.clone(), c).is_some() {
            bail!("two {} channels of pid {pid}", c.channel_type);
        }
    }
    let types: Vec<&str> = by.keys().map(String::as_str).collect();
    ensure!(
        types == ["cursor", "display", "inputs", "main"],
        "channels of pid {pid}: {types:?}"
    );
    Ok(by)
}

/// One SET_ACK with window `w`, its ACK_SYNC, and the ACKs spice-gtk's cadence gives for the
/// messages after the SET_ACK (floor((messages − 1) / W); the session is idle at the end),
/// none ignored, none surplus.
fn check_window(c: &ChannelReport, w: u32) -> Result<()> {
    let d = describe_ch(c);
    ensure!(c.set_acks == 1 && c.generations == 1, "set_acks: {d}");
    ensure!(c.window == Some(w), "window: {d}");
    ensure!(c.ack_syncs == 1, "ack_syncs: {d}");
    ensure!(
        c.ack_sync_generation.is_some() && c.ack_sync_generation == c.ack_generation,
        "ACK_SYNC generation {:?}, SET_ACK generation {:?}: {d}",
        c.ack_sync_generation,
        c.ack_generation
    );
    ensure!(c.acks_ignored == 0 && c.ack_surplus == 0, "ACKs: {d}");
    let after = c
        .server_to_client
        .messages
        .checked_sub(1)
        .with_context(|| format!("no server message: {d}"))?;
    ensure!(
        c.acks == after / u64::from(w),
        "acks {} for {after} messages after the SET_ACK, W {w}: {d}",
        c.acks
    );
    ensure!(c.starts_while_stalled == 0, "starts above 2W: {d}");
    Ok(())
}

fn json(rig: &Rig) -> std::path::PathBuf {
    rig.state.join("report.json")
}

/// xanim: [`common::rects`] and a cursor change every 2nd frame (cursor channel traffic).
fn rects_with_cursor(seconds: &str) -> Vec<&str> {
    let mut args = common::rects(seconds).to_vec();
    args.extend(["--cursor-every", "2"]);
    args
}

// ---------------------------------------------------------------------------------------------
// a. Xspice with only a TLS port
// ---------------------------------------------------------------------------------------------

/// Xspice serves only a TLS port; spice-gtk, given the test's CA, opens all four channels
/// over TLS and stops reading from 2 s to 4.5 s. Every channel of spice-server is framed and
/// typed through the uprobes; display and cursor show the one SET_ACK (W 20 on loopback), the
/// ACKs of spice-gtk's cadence, and the display channel's maximum during the pause is 2W+1
/// (spice-server's rule, docs/spice-protocol.md §3.4; 2W+2 only with an urgent pair).
#[test]
fn tls_port_session_is_framed() -> Result<()> {
    const T: &str = "tls_port_session_is_framed";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let x509 = rig.tls_certs()?;
    // The drawing (6 s) starts right after the client's process (below), not with Xspice
    // before the observer has loaded, so the pause from 2 s has drawing to hold back; the
    // observer's 12 s leave the session idle for about its last 5 s.
    let xorg = rig.xspice_tls(5910, 10, &x509, &["--mode", "rects", "--frames", "1"])?;
    let lib = libssl_of(xorg)?.context("Xorg (spice-server) maps no libssl")?;
    let obs = observe_or_skip!(T, &[xorg], 12.0, json(&rig));
    let ca = x509.join("ca-cert.pem");
    let _client = Client::start(
        "spice://127.0.0.1?tls-port=5910",
        30,
        &[
            "--ca-file",
            ca.to_str().unwrap(),
            "--pause-at",
            "2",
            "--pause-for",
            "2.5",
        ],
        None,
    )?;
    common::draw(10, &rects_with_cursor("6"))?;
    let report = obs.finish_report()?;
    check_tls_run(&report)?;
    check_attached(&report, xorg, &lib)?;
    let chans = session_channels(&report, xorg)?;
    for c in chans.values() {
        let d = describe_ch(c);
        ensure!(c.end.as_deref() == Some("server"), "end: {d}");
        check_tls_socket(c, &lib)?;
        ensure!(
            c.messages_sent > 0 && c.messages_received > 0,
            "no message one way: {d}"
        );
    }
    let w = 20;
    for ty in ["display", "cursor"] {
        check_window(chans[ty], w)?;
    }
    let disp = chans["display"];
    let d = describe_ch(disp);
    let max = disp.in_flight_max.with_context(|| format!("no max: {d}"))?;
    let w = i64::from(w);
    ensure!(
        max == 2 * w + 1 || (max == 2 * w + 2 && disp.urgent_pair_peaks > 0),
        "display max {max} after a 2.5 s pause, W {w}: {d}"
    );
    ensure!(disp.stalls >= 1, "no stall during the pause: {d}");
    let cur = chans["cursor"];
    ensure!(
        cur.acks >= 1,
        "cursor: no ACK (too little traffic): {}",
        describe_ch(cur)
    );
    let cmax = cur.in_flight_max.context("cursor: no max")?;
    ensure!(cmax <= 2 * w + 1, "cursor max {cmax}: {}", describe_ch(cur));
    eprintln!(
        "{T}: display: W {w}, {} messages sent, {} ACKs, max {max}, stalls {}; cursor: {} messages, {} ACKs, max {cmax}",
        disp.messages_sent, disp.acks, disp.stalls, cur.messages_sent, cur.acks
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// b. Through stunnel: TLS toward spice-server, plaintext toward spice-gtk
// ---------------------------------------------------------------------------------------------

/// Where the last byte of one of spice-server's messages is, seen on the plaintext leg only
/// (stunnel → spice-gtk), in chain order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum PlainPos {
    /// Not yet sent by stunnel's TCP on the plaintext leg: spice-server, its TLS leg or
    /// stunnel still hold it.
    Upstream = 0,
    /// Sent on the plaintext leg, not yet acknowledged by spice-gtk's TCP.
    ClientUnacked = 1,
    /// Acknowledged by spice-gtk's TCP (spice-gtk holds it until it ACKs).
    ClientAcked = 2,
}

/// The comparison groups of the plaintext-leg oracle: name, the observer's stages summed,
/// the oracle's position.
const PLAIN_GROUPS: [(&str, &[&str], PlainPos); 3] = [
    (
        "upstream of the plaintext leg",
        &[
            "server_writing",
            "server_notsent",
            "server_unacked",
            "proxy_recv_queue",
            "proxy_inside",
            "proxy_notsent",
        ],
        PlainPos::Upstream,
    ),
    (
        "client_unacked",
        &["client_unacked"],
        PlainPos::ClientUnacked,
    ),
    (
        "client_owes_ack",
        &["client_owes_ack"],
        PlainPos::ClientAcked,
    ),
];

/// Resolution of a TSval send time (Linux's millisecond TCP clock), as in [`oracle`].
const TSVAL_TICK: f64 = 0.001;

/// One message's position on the plaintext leg at `t` (CLOCK_REALTIME seconds); `late` takes
/// its send time at the latest it can be (the capture time, or TSval + 1 tick), otherwise at
/// the earliest (TSval − 1 tick).
fn plain_position(conn: &SpiceConn, last: u64, t: f64, late: bool) -> PlainPos {
    let d = &conn.conn.s2c;
    let wire = match (d.sent_at(last), d.first_seen(last)) {
        (Some(s), Some(c)) if late => Some(c.min(s + TSVAL_TICK)),
        (Some(s), _) => Some(s - TSVAL_TICK),
        (None, c) => c,
    };
    if wire.is_none_or(|w| t < w) {
        PlainPos::Upstream
    } else if d.acked_at(last).is_none_or(|a| t < a) {
        PlainPos::ClientUnacked
    } else {
        PlainPos::ClientAcked
    }
}

/// The oracle of the plaintext leg: for every sample of spice-server's display channel with
/// messages in flight, the in-flight messages are its `in_flight` newest of
/// `server_messages` (the channel's ordinal; stunnel relays the plaintext unchanged, so
/// message i of spice-server's TLS socket is message i of the captured plaintext
/// connection). The capture of that connection (the sample's `relay_client` leg) puts each
/// at the sample's start and end in one of [`PlainPos`]; the observer's stages, summed per
/// [`PLAIN_GROUPS`], must lie within the oracle's [lo − 1, hi + 1] (the rule of
/// [`oracle::classify`]) on at least [`oracle::THRESHOLD`] of the samples per group. A sample
/// without all eight stages, or without the client leg, is a disagreement in every group.
/// Samples whose newest in-flight message the capture does not hold whole are excluded (at
/// most 10 %). `mutate` changes the observer's stages before the comparison (identity for the
/// check itself; a wrong placement for the mutation test).
fn plain_leg_oracle(
    samples: &[Sample],
    clock: Clock,
    plain: &[SpiceConn],
    server_socket: &str,
    mutate: &dyn Fn(&mut BTreeMap<String, u32>),
) -> Result<PlainAgreement> {
    let base = clock.realtime_ns as f64 / 1e9;
    let mut compared = 0usize;
    let mut agree = vec![0usize; PLAIN_GROUPS.len()];
    let mut sums = vec![(0u64, 0u64, 0u64); PLAIN_GROUPS.len()];
    let mut beyond = 0usize;
    let mut with_flight = 0usize;
    // Every stage of a byte-transparent relay chain with both legs (README "Stages").
    let all: BTreeSet<&str> = spice_observer::model::chain::STAGES.into_iter().collect();
    for s in samples.iter().filter(|s| s.socket == server_socket) {
        // The stages add up to the count, whatever else.
        let placed: u64 = s.stages.values().map(|&v| u64::from(v)).sum();
        ensure!(
            placed + u64::from(s.unplaced) == s.in_flight,
            "sample t_s {:.3}: stages {:?} + unplaced {} != in_flight {}",
            s.t_s,
            s.stages,
            s.unplaced,
            s.in_flight
        );
        if s.in_flight == 0 {
            continue;
        }
        with_flight += 1;
        let keys: BTreeSet<&str> = s.stages.keys().map(String::as_str).collect();
        let conn = s.legs.relay_client.as_ref().and_then(|leg| {
            let (l, r) = leg.socket.split_once("->")?;
            plain
                .iter()
                .find(|c| c.conn.s2c.src == l && c.conn.s2c.dst == r)
        });
        let placed_all = keys == all && s.unplaced == 0;
        let Some(conn) = conn.filter(|_| placed_all) else {
            // failed to place through the TLS hop: a disagreement in every group
            eprintln!(
                "ORACLE | plaintext leg | t_s {:.3}: not placed through the TLS hop (stages {:?}, unplaced {}, client leg {:?})",
                s.t_s,
                s.stages,
                s.unplaced,
                s.legs.relay_client.as_ref().map(|l| &l.socket)
            );
            compared += 1;
            continue;
        };
        ensure!(
            oracle::type_name(conn.channel_type) == s.channel_type,
            "the plaintext leg {} carries {} {}, the sample says {}",
            s.legs.relay_client.as_ref().unwrap().socket,
            oracle::type_name(conn.channel_type),
            conn.channel_id,
            s.channel_type
        );
        let whole: Vec<&oracle::Message> = conn
            .messages
            .iter()
            .filter(|m| m.last < conn.conn.s2c.bytes.len() as u64)
            .collect();
        let newest = s.server_messages as usize;
        if newest > whole.len() {
            beyond += 1;
            continue;
        }
        let first = newest
            .checked_sub(s.in_flight as usize)
            .with_context(|| format!("sample t_s {:.3}: in_flight > server_messages", s.t_s))?;
        let (t0, t1) = (base + s.t_s, base + s.t_end_s);
        let mut lo = vec![0u64; PLAIN_GROUPS.len()];
        let mut hi = vec![0u64; PLAIN_GROUPS.len()];
        for m in &whole[first..newest] {
            let p0 = plain_position(conn, m.last, t0, true);
            let p1 = plain_position(conn, m.last, t1, false);
            for (g, (_, _, pos)) in PLAIN_GROUPS.iter().enumerate() {
                if p0 == *pos && p1 == *pos {
                    lo[g] += 1;
                }
                if p0 <= *pos && *pos <= p1 {
                    hi[g] += 1;
                }
            }
        }
        compared += 1;
        let mut st = s.stages.clone();
        mutate(&mut st);
        for (g, (_, stages, _)) in PLAIN_GROUPS.iter().enumerate() {
            let obs: i64 = stages.iter().map(|k| i64::from(st[*k])).sum();
            if lo[g] as i64 - oracle::TOLERANCE <= obs && obs <= hi[g] as i64 + oracle::TOLERANCE {
                agree[g] += 1;
            }
            sums[g].0 += obs as u64;
            sums[g].1 += lo[g];
            sums[g].2 += hi[g];
        }
    }
    ensure!(
        (beyond as f64) <= 0.10 * with_flight as f64,
        "{beyond} of {with_flight} samples beyond the plaintext capture"
    );
    Ok(PlainAgreement {
        compared,
        agree,
        sums,
    })
}

/// What [`plain_leg_oracle`] found, per [`PLAIN_GROUPS`] group.
struct PlainAgreement {
    /// Samples compared (with messages in flight, within the capture).
    compared: usize,
    /// Samples whose observer count lies within the oracle's bounds.
    agree: Vec<usize>,
    /// Over the compared samples: (observer's messages, oracle's lower bounds, upper bounds).
    sums: Vec<(u64, u64, u64)>,
}

impl PlainAgreement {
    /// Prints one `ORACLE |` line per group; true if every group agrees on at least
    /// [`oracle::THRESHOLD`] of the samples.
    fn report(&self, what: &str) -> bool {
        let n = self.compared;
        let mut ok = true;
        for (g, (name, _, _)) in PLAIN_GROUPS.iter().enumerate() {
            let (o, lo, hi) = self.sums[g];
            eprintln!(
                "ORACLE | {what} | {name}: {}/{n} agree ({:.1}%); messages summed over the samples: observer {o}, oracle [{lo}, {hi}]",
                self.agree[g],
                100.0 * self.agree[g] as f64 / n.max(1) as f64
            );
            ok &= self.agree[g] as f64 >= oracle::THRESHOLD * n as f64;
        }
        ok
    }
}

/// Offsets just past each TLS record in one direction of a TCP stream (5-byte record headers:
/// content type 20–23, version 3.x, 16-bit length; RFC 8446 §5.1). Fails on bytes that are
/// not a record header where one belongs (a hole or a wrong parse).
fn tls_record_ends(b: &[u8]) -> Result<BTreeSet<u64>> {
    let mut ends = BTreeSet::new();
    let mut off = 0usize;
    while off + 5 <= b.len() {
        let (ty, major) = (b[off], b[off + 1]);
        ensure!(
            (20..=23).contains(&ty) && major == 3,
            "no TLS record header at offset {off}: {:02x?}",
            &b[off..off + 5]
        );
        off += 5 + usize::from(u16::from_be_bytes([b[off + 3], b[off + 4]]));
        ends.insert(off as u64);
    }
    Ok(ends)
}

/// Moves all of stage `from` into stage `to`.
fn merge_into(st: &mut BTreeMap<String, u32>, from: &str, to: &str) {
    let n = st.insert(from.into(), 0).unwrap_or(0);
    *st.entry(to.into()).or_default() += n;
}

/// Xspice (TLS port only) ← stunnel (client mode: plaintext in, TLS out) on 198.18.0.1 ←
/// an 8 Mbit/s link (rig/shape.sh veth) ← spice-gtk (plain, in the client namespace, pausing
/// 1.5 s). The observer watches Xorg and stunnel: spice-server's sockets are framed through
/// Xorg's libssl, stunnel's leg toward Xorg through stunnel's libssl, its leg toward spice-gtk
/// on the normal path. Per channel and direction the three sockets carry the same messages
/// (types and bytes); the capture of the plaintext leg (tshark, the oracle's own SPICE
/// parser) and stunnel's own byte counts (its log) confirm them. The chain pairs the TLS
/// legs by link message; on spice-server's display channel the stages add up to the count
/// at every sample and agree with the plaintext leg's capture.
#[test]
fn tls_relay_counts_equal_plain_leg() -> Result<()> {
    const T: &str = "tls_relay_counts_equal_plain_leg";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let x509 = rig.tls_certs()?;
    // draws of ≈50 KB at 20/s (≈8 Mbit/s) over a client link of 8 Mbit/s: a backlog in
    // stunnel's send queue and on the client link, more while the client pauses
    let xorg = rig.xspice_tls(
        5911,
        11,
        &x509,
        &[
            "--mode",
            "noise",
            "--fps",
            "20",
            "--size",
            "128x96",
            "--seconds",
            "7",
            "--cursor-every",
            "2",
        ],
    )?;
    rig.shaped_link(&["veth"], Some("8mbit"))?;
    let st = rig.stunnel("client", "198.18.0.1", 6911, 5911, &x509)?;
    let lib_x = libssl_of(xorg)?.context("Xorg maps no libssl")?;
    let lib_s = libssl_of(st.pid)?.context("stunnel maps no libssl")?;
    let mut cap = Capture::start(rig.state.join("plain-leg.pcapng"), None, "rigr0", &[6911])?;
    let mut tls_cap = Capture::start(rig.state.join("tls-leg.pcapng"), None, "lo", &[5911])?;
    let samples = rig.state.join("samples.jsonl");
    let obs = observe_or_skip!(
        T,
        &[xorg, st.pid],
        10.0,
        json(&rig),
        &["--samples", samples.to_str().unwrap()]
    );
    let client = Client::start(
        "spice://198.18.0.1:6911",
        30,
        &["--pause-at", "3", "--pause-for", "1.5"],
        Some("rigc"),
    )?;
    let report = obs.finish_report()?;
    // End the session: stunnel logs each connection's byte counts as it closes.
    drop(client);
    std::thread::sleep(std::time::Duration::from_millis(500));
    cap.stop()?;
    tls_cap.stop()?;
    check_tls_run(&report)?;
    check_attached(&report, xorg, &lib_x)?;
    check_attached(&report, st.pid, &lib_s)?;
    let plain = oracle::parse_capture(&cap.path)?;
    let closed = st.closed_connections()?;
    let chans = session_channels(&report, xorg)?;
    let find = |sock: &str| report.channels.iter().find(|x| x.socket == sock);
    for (ty, s) in &chans {
        let d = describe_ch(s);
        ensure!(s.end.as_deref() == Some("server"), "end: {d}");
        let ts = check_tls_socket(s, &lib_x)?;
        let ch = s.chain.as_ref().with_context(|| format!("no chain: {d}"))?;
        ensure!(
            ch.relay_pid == Some(st.pid) && ch.transparency == "transparent",
            "{ty}: chain {ch:?}: {d}"
        );
        let b = find(ch.backend.as_deref().context("no backend leg")?)
            .context("backend leg not in the report")?;
        let cl = find(ch.client_leg.as_deref().context("no client leg")?)
            .context("client leg not in the report")?;
        let (db, dc) = (describe_ch(b), describe_ch(cl));
        ensure!(
            b.pid == st.pid && b.end.as_deref() == Some("client"),
            "backend leg: {db}"
        );
        let tb = check_tls_socket(b, &lib_s)?;
        ensure!(
            cl.pid == st.pid && cl.end.as_deref() == Some("server") && cl.transport == "tcp",
            "client leg: {dc}"
        );
        ensure!(cl.tls.is_none(), "plain leg with a tls object: {dc}");
        check_framed(cl)?;
        ensure!(
            cl.channel_type == *ty && b.channel_type == *ty,
            "channel types along the chain: {d} / {db} / {dc}"
        );
        // Per direction: spice-server's TLS socket (uprobes) = stunnel's TLS leg (uprobes) =
        // stunnel's plain leg (normal path).
        for (what, x, y, z) in [
            (
                "server → client messages",
                s.messages_sent,
                b.messages_received,
                cl.messages_sent,
            ),
            (
                "client → server messages",
                s.messages_received,
                b.messages_sent,
                cl.messages_received,
            ),
            (
                "server → client message bytes",
                s.bytes_sent,
                b.bytes_received,
                cl.bytes_sent,
            ),
            (
                "client → server message bytes",
                s.bytes_received,
                b.bytes_sent,
                cl.bytes_received,
            ),
        ] {
            ensure!(
                x == y && y == z,
                "{ty} {what}: spice-server {x}, stunnel TLS leg {y}, stunnel plain leg {z}\n  {d}\n  {db}\n  {dc}"
            );
        }
        ensure!(
            s.messages_sent_by_type == b.messages_received_by_type
                && s.messages_sent_by_type == cl.messages_sent_by_type
                && s.messages_received_by_type == b.messages_sent_by_type
                && s.messages_received_by_type == cl.messages_received_by_type,
            "{ty}: message types differ along the chain: {:?} / {:?} / {:?}; {:?} / {:?} / {:?}",
            s.messages_sent_by_type,
            b.messages_received_by_type,
            cl.messages_sent_by_type,
            s.messages_received_by_type,
            b.messages_sent_by_type,
            cl.messages_received_by_type
        );
        // The capture of the plaintext leg (the oracle's own parser).
        let (l, r) = cl.socket.split_once("->").unwrap();
        let conn = plain
            .iter()
            .find(|c| c.conn.s2c.src == l && c.conn.s2c.dst == r)
            .with_context(|| format!("{ty}: plain leg {} not in the capture", cl.socket))?;
        let (s2c, c2s) = oracle::captured_by(conn, f64::INFINITY)?;
        ensure!(
            s2c.0 == cl.messages_sent && c2s.0 == cl.messages_received,
            "{ty}: the capture of the plain leg holds {} / {} messages (s2c / c2s), the observer {} / {}: {dc}",
            s2c.0,
            c2s.0,
            cl.messages_sent,
            cl.messages_received
        );
        // stunnel's own count of the plaintext it relayed (logged at the connection's end):
        // "A byte(s) sent to TLS" = everything spice-gtk wrote, "B byte(s) sent to socket" =
        // everything spice-server wrote, link phase included.
        let peer = remote_of(cl)?;
        let &(to_tls, to_socket) = closed
            .get(peer)
            .with_context(|| format!("{ty}: stunnel logged no close for {peer}: {closed:?}"))?;
        ensure!(
            conn.conn.s2c.bytes.len() as u64 == to_socket
                && conn.conn.c2s.bytes.len() as u64 == to_tls,
            "{ty}: capture {} / {} bytes, stunnel {to_socket} / {to_tls}",
            conn.conn.s2c.bytes.len(),
            conn.conn.c2s.bytes.len()
        );
        for (what, got, want) in [
            (
                "spice-server's plaintext written",
                ts.plaintext_bytes_sent,
                to_socket,
            ),
            (
                "spice-server's plaintext read",
                ts.plaintext_bytes_received,
                to_tls,
            ),
            (
                "stunnel's TLS-leg plaintext read",
                tb.plaintext_bytes_received,
                to_socket,
            ),
            (
                "stunnel's TLS-leg plaintext written",
                tb.plaintext_bytes_sent,
                to_tls,
            ),
        ] {
            ensure!(
                got == want,
                "{ty}: {what}: observer {got}, stunnel's log {want}\n  {d}\n  {db}"
            );
        }
        eprintln!(
            "{T}: {ty}: {} / {} messages s2c / c2s on all three sockets and in the capture; plaintext {to_socket} / {to_tls} bytes (stunnel's log = uprobes)",
            s.messages_sent, s.messages_received
        );
    }
    // Stages on spice-server's display channel.
    let disp = chans["display"];
    let ch = disp.chain.as_ref().unwrap();
    let d = describe_ch(disp);
    ensure!(
        ch.kept_short_samples == 0 && ch.relay_above_true_samples == 0,
        "chain: {ch:?}: {d}"
    );
    ensure!(
        ch.samples_placed >= 20,
        "too few placed samples: {ch:?}: {d}"
    );
    let lines = oracle::read_samples(&samples)?;
    let clock = oracle::read_clock(&json(&rig))?;
    let a = plain_leg_oracle(&lines, clock, &plain, &disp.socket, &|_| {})?;
    ensure!(
        a.compared >= 20,
        "only {} display samples with messages in flight compared",
        a.compared
    );
    ensure!(
        a.report(&format!("{T} | plaintext leg | display 0")),
        "the observer's stages disagree with the plaintext leg's capture (ORACLE lines above)"
    );
    // Placement in TCP space: the newest and oldest in-flight message's last byte is the last
    // byte of a TLS record in the TLS leg's capture (the records of the SSL_write that moved
    // the message's last plaintext byte).
    let tls_conns = oracle::parse_tcp(&tls_cap.path)?;
    let (l, r) = disp.socket.split_once("->").unwrap();
    let tconn = tls_conns
        .iter()
        .find(|c| c.s2c.src == l && c.s2c.dst == r)
        .with_context(|| format!("{} not in the TLS leg's capture", disp.socket))?;
    let ends = tls_record_ends(&tconn.s2c.bytes)?;
    let (mut at_end, mut checked) = (0usize, 0usize);
    for line in lines.iter().filter(|l| l.socket == disp.socket) {
        for seq in [line.newest_last_byte_seq, line.oldest_last_byte_seq]
            .into_iter()
            .flatten()
        {
            let end = tconn.s2c.offset(seq) + 1;
            if end > tconn.s2c.bytes.len() as u64 {
                continue; // beyond the capture
            }
            checked += 1;
            if ends.contains(&end) {
                at_end += 1;
            } else {
                eprintln!(
                    "{T}: sample t_s {:.3}: last byte seq {seq} (TLS stream offset {end}) is not the end of a TLS record",
                    line.t_s
                );
            }
        }
    }
    eprintln!(
        "{T}: display 0: {at_end}/{checked} newest/oldest last-byte sequence numbers at a TLS record end ({} records in the TLS leg's capture)",
        ends.len()
    );
    ensure!(
        checked >= 20 && at_end == checked,
        "{at_end}/{checked} last-byte sequence numbers at TLS record ends"
    );
    // Mutation test: wrong placements must be caught where the run exercised them (the
    // stage moved holds messages at more than 10 % of the samples).
    let mut per_stage: BTreeMap<&str, u64> = BTreeMap::new();
    for l in lines.iter().filter(|l| l.socket == disp.socket) {
        for (k, v) in &l.stages {
            *per_stage.entry(k.as_str()).or_default() += u64::from(*v);
        }
    }
    eprintln!("{T}: display 0: messages per stage summed over the samples: {per_stage:?}");
    let mutations: [(&str, &str, &str); 3] = [
        (
            "proxy_notsent placed as client_unacked (client-leg boundary at write_seq, not snd_nxt)",
            "proxy_notsent",
            "client_unacked",
        ),
        (
            "client_owes_ack placed as client_unacked (client boundary at snd_una, not the client's ACK)",
            "client_owes_ack",
            "client_unacked",
        ),
        (
            "client_owes_ack placed upstream (as proxy_notsent)",
            "client_owes_ack",
            "proxy_notsent",
        ),
    ];
    for (name, from, to) in mutations {
        let used = lines
            .iter()
            .filter(|s| s.socket == disp.socket && s.stages.get(from).is_some_and(|&v| v >= 2))
            .count();
        if (used as f64) < 0.10 * a.compared as f64 {
            eprintln!(
                "ORACLE | {T} | mutation not exercised ({from} ≥ 2 at {used} samples): {name}"
            );
            continue;
        }
        let m = plain_leg_oracle(&lines, clock, &plain, &disp.socket, &|st| {
            merge_into(st, from, to)
        })?;
        ensure!(
            !m.report(&format!("{T} | mutated: {name}")),
            "the mutation '{name}' still agrees: the comparison does not catch it"
        );
        eprintln!("ORACLE | {T} | mutation caught: {name}");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// c. spice-peer through two stunnels
// ---------------------------------------------------------------------------------------------

/// A string that fills every message body of both peers: plaintext the observer must never
/// copy or print.
const MARKER: &str = "SPICE-OBSERVER-TLS-BODY-MARKER-5d1c";

/// spice-peer client → stunnel A (client mode: plain in, TLS out) → stunnel B (server mode:
/// TLS in, plain out) → spice-peer server. The server streams 400 DRAW_COPY after a SET_ACK
/// (W 20), the client answers with its ACKs and sends 30 messages of its own; every body is
/// [`MARKER`] repeated. The observer watches both stunnels: on each of their four sockets
/// (A's plain and TLS legs, B's TLS and plain legs) the messages, types and message bytes per
/// direction equal the peers' own counts, and the window (SET_ACK, W, ACKs) matches theirs.
/// The marker is on the wire in the plaintext legs (capture) and not in the TLS leg, and it
/// appears nowhere in the observer's JSON, samples, plot, event dump, stdout or stderr
/// (observer run with RUST_LOG=debug).
#[test]
fn spice_peer_through_two_stunnels_counts_exact() -> Result<()> {
    const T: &str = "spice_peer_through_two_stunnels_counts_exact";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let x509 = rig.tls_certs()?;
    let mut server = PeerServer::start_on(
        5913,
        &[
            "--set-ack",
            "--window",
            "20",
            "--messages",
            "400",
            "--body-size",
            "3000",
            "--interval-ms",
            "2",
            "--body-marker",
            MARKER,
        ],
    )?;
    let b = rig.stunnel("server", "127.0.0.1", 5914, 5913, &x509)?;
    let a = rig.stunnel("client", "127.0.0.1", 6913, 5914, &x509)?;
    let lib_a = libssl_of(a.pid)?.context("stunnel A maps no libssl")?;
    let lib_b = libssl_of(b.pid)?.context("stunnel B maps no libssl")?;
    let mut client = PeerClient::gated(
        6913,
        &[
            "--messages",
            "30",
            "--body-size",
            "500",
            "--body-marker",
            MARKER,
        ],
    )?;
    let mut caps = [
        Capture::start(rig.state.join("plain.pcapng"), None, "lo", &[5913, 6913])?,
        Capture::start(rig.state.join("tls.pcapng"), None, "lo", &[5914])?,
    ];
    let out = |n: &str| rig.state.join(n);
    let (samples, plot, dump) = (out("samples.jsonl"), out("plot.svg"), out("events.txt"));
    let obs = match common::Observer::start_env(
        &[server.pid(), a.pid, b.pid],
        6.0,
        json(&rig),
        &[
            "--samples",
            samples.to_str().unwrap(),
            "--plot",
            plot.to_str().unwrap(),
            "--dump-events",
            dump.to_str().unwrap(),
        ],
        &[("RUST_LOG", "debug")],
    )? {
        common::Started::Running(o) => o,
        common::Started::Unsupported(why) => {
            let msg = common::cannot_run(T, &format!("kernel feature missing:\n{why}"));
            ensure!(!common::ci(), "{msg}");
            eprintln!("{msg}");
            return Ok(());
        }
    };
    client.go()?;
    let pc = client.summary("peer client")?;
    let ps = server.summary("peer server")?;
    let (raw, printed) = obs.finish_with_output()?;
    for c in &mut caps {
        c.stop()?;
    }
    let report = common::parse_report(&raw)?;
    check_tls_run(&report)?;
    check_attached(&report, a.pid, &lib_a)?;
    check_attached(&report, b.pid, &lib_b)?;
    ensure!(
        ps.sent.messages == 401 && pc.received.by_type == ps.sent.by_type,
        "the peers disagree: server sent {:?}, client received {:?}",
        ps.sent,
        pc.received
    );
    ensure!(
        pc.sent.by_type == ps.received.by_type,
        "the peers disagree: client sent {:?}, server received {:?}",
        pc.sent,
        ps.received
    );
    let sacks = ps.server_acks()?;
    let cacks = pc.client_acks()?;
    // (process, transport, end): A's plain leg faces the client (A plays the server there),
    // A's TLS leg faces B (A is its client), B's TLS leg faces A, B's plain leg faces the
    // server.
    let legs = [
        ("A plain", a.pid, "tcp", "server"),
        ("A TLS", a.pid, "tls", "client"),
        ("B TLS", b.pid, "tls", "server"),
        ("B plain", b.pid, "tcp", "client"),
    ];
    for (name, pid, transport, end) in legs {
        let mine: Vec<&ChannelReport> = report
            .channels
            .iter()
            .filter(|c| c.pid == pid && c.transport == transport)
            .collect();
        let [c] = mine.as_slice() else {
            bail!(
                "{name}: {} {transport} sockets of pid {pid}: {:#?}",
                mine.len(),
                mine.iter().map(|c| describe_ch(c)).collect::<Vec<_>>()
            );
        };
        let d = format!("{name}: {}", describe_ch(c));
        ensure!(c.end.as_deref() == Some(end), "end: {d}");
        ensure!(c.channel_type == "display", "channel: {d}");
        if transport == "tls" {
            let lib = if pid == a.pid { &lib_a } else { &lib_b };
            let t = check_tls_socket(c, lib)?;
            // all plaintext, link phase included: what the peers' calls moved
            let (w, r) = if end == "server" {
                (ps.sent.bytes, pc.sent.bytes)
            } else {
                (pc.sent.bytes, ps.sent.bytes)
            };
            ensure!(
                t.plaintext_bytes_sent == w && t.plaintext_bytes_received == r,
                "plaintext bytes {} / {} (sent / received), the peers {w} / {r}: {d}",
                t.plaintext_bytes_sent,
                t.plaintext_bytes_received
            );
        } else {
            ensure!(c.tls.is_none(), "plain socket with a tls object: {d}");
            check_framed(c)?;
        }
        // The server → client stream: written by this socket if it is the server end.
        let (s2c_m, s2c_b, s2c_t, c2s_m, c2s_b, c2s_t) = if end == "server" {
            (
                c.messages_sent,
                c.bytes_sent,
                &c.messages_sent_by_type,
                c.messages_received,
                c.bytes_received,
                &c.messages_received_by_type,
            )
        } else {
            (
                c.messages_received,
                c.bytes_received,
                &c.messages_received_by_type,
                c.messages_sent,
                c.bytes_sent,
                &c.messages_sent_by_type,
            )
        };
        for (what, got, want) in [
            ("s2c messages", s2c_m, ps.sent.messages),
            ("s2c message bytes", s2c_b, ps.sent.data_bytes),
            ("c2s messages", c2s_m, pc.sent.messages),
            ("c2s message bytes", c2s_b, pc.sent.data_bytes),
        ] {
            ensure!(got == want, "{what}: observer {got}, peers {want}: {d}");
        }
        ensure!(
            *s2c_t == ps.sent.by_type && *c2s_t == pc.sent.by_type,
            "types {s2c_t:?} / {c2s_t:?}, peers {:?} / {:?}: {d}",
            ps.sent.by_type,
            pc.sent.by_type
        );
        ensure!(
            c.set_acks == 1
                && c.window == Some(sacks.window)
                && c.ack_syncs == cacks.ack_syncs_sent
                && c.acks == cacks.acks_sent
                && c.acks_ignored == 0
                && c.ack_surplus == 0,
            "window: server W {}, client {} ACK_SYNC {} ACKs: {d}",
            sacks.window,
            cacks.ack_syncs_sent,
            cacks.acks_sent
        );
        eprintln!(
            "{T}: {name}: {s2c_m} / {c2s_m} messages s2c / c2s, {s2c_b} / {c2s_b} message bytes, {} ACKs = the peers'",
            c.acks
        );
    }
    // The marker: on the wire in plaintext (so a leak would be found), encrypted between the
    // stunnels, and in no output of the observer.
    let has = |bytes: &[u8]| bytes.windows(MARKER.len()).any(|w| w == MARKER.as_bytes());
    let pcap = |c: &Capture| std::fs::read(&c.path).with_context(|| c.path.display().to_string());
    ensure!(
        has(&pcap(&caps[0])?),
        "the marker is not in the plaintext capture"
    );
    ensure!(
        !has(&pcap(&caps[1])?),
        "the marker is in the TLS leg's capture"
    );
    let mut outputs: Vec<(String, Vec<u8>)> = vec![
        ("stdout+stderr".into(), printed.join("\n").into_bytes()),
        ("JSON report".into(), serde_json::to_vec(&raw)?),
    ];
    for p in [&json(&rig), &samples, &plot, &dump] {
        let bytes = std::fs::read(p).with_context(|| p.display().to_string())?;
        outputs.push((p.display().to_string(), bytes));
    }
    ensure!(
        !printed.is_empty() && !outputs[5].1.is_empty(),
        "the observer printed nothing, or dumped no event"
    );
    for (what, bytes) in &outputs {
        ensure!(!has(bytes), "the body marker appears in {what}");
        // also not hex-encoded (a body dumped as bytes)
        let hex: String = MARKER.bytes().map(|b| format!("{b:02x}")).collect();
        ensure!(
            !String::from_utf8_lossy(bytes).to_lowercase().contains(&hex),
            "the body marker appears hex-encoded in {what}"
        );
        eprintln!("{T}: marker not in {what} ({} bytes)", bytes.len());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// d. TLS without libssl
// ---------------------------------------------------------------------------------------------

/// spice-peer maps no libssl (checked in /proc/PID/maps); with `--tls-bytes` it sends a TLS
/// handshake record (ServerHello-like from a server, ClientHello-like from a client) where
/// the link phase belongs. Two pairs:
/// * `alive`: the server sends the record; its client sleeps 4 s before reading, so both
///   outlive the 3 s observation. The server's socket stays `unparsed: tls`.
/// * `exited`: the client sends the record, the server refuses it at once; both are gone
///   before the report. Both sockets stay `unparsed: tls` all the same.
///
/// `tls_processes` lists all four as `no_libssl` (no library, no error).
///
/// Every socket that is `unparsed: tls` has transport `tcp`, no `tls` object, no message, and
/// an `unparsed_detail` naming its process and that it maps no libssl.
#[test]
fn tls_without_libssl_stays_unparsed() -> Result<()> {
    const T: &str = "tls_without_libssl_stays_unparsed";
    if !privileged(T) {
        return Ok(());
    }
    let mut alive_s = PeerServer::start_on(5915, &["--tls-bytes"])?;
    let mut alive_c = PeerClient::gated(5915, &["--recv-pause-ms", "4000"])?;
    let mut gone_s = PeerServer::start_on(6015, &[])?;
    let mut gone_c = PeerClient::gated(6015, &["--tls-bytes"])?;
    for pid in [alive_s.pid(), gone_s.pid()] {
        // the clients run the same binary once their gate execs it
        ensure!(
            libssl_of(pid)?.is_none(),
            "spice-peer (pid {pid}) maps libssl"
        );
    }
    let pids = [alive_s.pid(), alive_c.pid(), gone_s.pid(), gone_c.pid()];
    let json = std::env::temp_dir().join(format!("spice-observer-tls-{T}.json"));
    let obs = observe_or_skip!(T, &pids, 3.0, json);
    alive_c.go()?;
    gone_c.go()?;
    let gone = [
        gone_c.summary("exited client")?,
        gone_s.summary("exited server")?,
    ];
    let report = obs.finish_report()?;
    let alive = [
        alive_c.summary("alive client")?,
        alive_s.summary("alive server")?,
    ];
    eprintln!(
        "{T}: tls_processes {:?}; exited {:?}",
        report.tls_processes, report.exited
    );
    check_run(&report)?;
    ensure!(
        alive[1].mode == "tls" && gone[0].mode == "tls",
        "the peers did not send TLS records: {} / {}",
        alive[1].mode,
        gone[0].mode
    );
    let exited: BTreeSet<u32> = report.exited.iter().map(|e| e.pid).collect();
    ensure!(
        exited.contains(&gone_s.pid())
            && exited.contains(&gone_c.pid())
            && !exited.contains(&alive_s.pid())
            && !exited.contains(&alive_c.pid()),
        "exited {exited:?}: the alive pair must outlive the observation, the other not"
    );
    // every process, also those gone before the report (their sockets are in it)
    for pid in pids {
        let p = report
            .tls_processes
            .iter()
            .find(|p| p.pid == pid)
            .with_context(|| format!("pid {pid} not in tls_processes"))?;
        ensure!(
            p.state == "no_libssl" && p.library.is_none() && p.error.is_none(),
            "pid {pid}: {p:?}"
        );
    }
    for (what, pid) in [
        ("alive server", alive_s.pid()),
        ("exited server", gone_s.pid()),
        ("exited client", gone_c.pid()),
    ] {
        let mine: Vec<&ChannelReport> = report.channels.iter().filter(|c| c.pid == pid).collect();
        let [c] = mine.as_slice() else {
            bail!("{what}: {} channels of pid {pid}", mine.len());
        };
        let d = format!(
            "{what}: {} ({:?}: {:?})",
            describe_ch(c),
            c.unparsed_reason,
            c.unparsed_detail
        );
        ensure!(
            c.unparsed_reason.as_deref() == Some("tls") && c.framing == "unparsed",
            "not unparsed tls: {d}"
        );
        ensure!(c.transport == "tcp" && c.tls.is_none(), "transport: {d}");
        ensure!(
            c.messages_sent == 0 && c.messages_received == 0,
            "messages framed: {d}"
        );
        let detail = c
            .unparsed_detail
            .as_deref()
            .ok_or_else(|| anyhow!("no unparsed_detail: {d}"))?;
        ensure!(
            detail.contains("maps no libssl") && detail.contains(&format!("process {pid} ")),
            "the detail does not say that process {pid} maps no libssl: {d}"
        );
        eprintln!("{T}: {what} pid {pid}: unparsed tls: {detail}");
    }
    Ok(())
}
