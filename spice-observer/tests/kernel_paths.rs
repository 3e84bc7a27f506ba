//! Privileged kernel-path tests: the real `spice-observer` binary watches scripted SPICE peers
//! (`spice-peer`, real processes over real loopback TCP) that cut their byte streams in the
//! awkward ways real peers do (split headers, many messages per call, one message over many
//! calls, headers split across iovecs, every send and receive syscall, full headers, EAGAIN,
//! ACK windows, non-SPICE streams). Every count the observer reports is compared with what the
//! peer's `SUMMARY` says its syscalls actually moved.
//!
//! Each test runs one observation of several peer pairs at once: the servers are started
//! first, the clients are forked but held at a gate (`sh -c 'read; exec spice-peer client'`,
//! so their pid is known and stays the same), the observer attaches to the servers (and to
//! some clients), then the clients are released. Run serially: `--test-threads=1`.

mod common;

use std::{
    collections::BTreeMap,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use common::{
    check_run, describe_ch,
    peer::{Client, Server},
    privileged,
    summary::{PeerSummary, by_type},
};
use spice_observer::report::{ChannelReport, Report};

// ---------------------------------------------------------------------------------------------
// One observation of several peer pairs
// ---------------------------------------------------------------------------------------------

/// A server/client pair: peer options and whether the observer watches the client too.
struct Spec {
    name: &'static str,
    server: Vec<&'static str>,
    client: Vec<&'static str>,
    watch_client: bool,
}

fn spec(
    name: &'static str,
    server: &[&'static str],
    client: &[&'static str],
    watch_client: bool,
) -> Spec {
    Spec {
        name,
        server: server.to_vec(),
        client: client.to_vec(),
        watch_client,
    }
}

/// A finished pair: both SUMMARYs and pids.
struct Done {
    name: &'static str,
    s: PeerSummary,
    c: PeerSummary,
    spid: u32,
    cpid: u32,
    watch_client: bool,
}

/// The factor on every observation's length: `$SPICE_OBSERVER_TEST_TIME_SCALE` (default 1).
/// `cargo xtask guest` sets 1.5: under TCG, with other work on the host, the peers of a 3 s
/// observation once took 3.1 s.
fn time_scale() -> f64 {
    std::env::var("SPICE_OBSERVER_TEST_TIME_SCALE")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|f| *f >= 1.0)
        .unwrap_or(1.0)
}

/// Starts every pair's server, the observer (servers and the chosen clients), releases the
/// clients, waits for all peers, then for the observer's report; hands both to `check`.
/// The exchange must finish well inside the observation window.
fn observe(
    test: &str,
    secs: f64,
    specs: Vec<Spec>,
    check: impl FnOnce(&Report, &[Done]) -> Result<()>,
) -> Result<()> {
    observe_then(test, secs, specs, |report, done| {
        check(report, done)?;
        check_clean(report)
    })
}

/// [`observe`] without its final [`check_clean`]: for runs that lose information on purpose.
fn observe_then(
    test: &str,
    secs: f64,
    specs: Vec<Spec>,
    check: impl FnOnce(&Report, &[Done]) -> Result<()>,
) -> Result<()> {
    let secs = secs * time_scale();
    let mut running = Vec::new();
    for sp in &specs {
        let server = Server::start(&sp.server).with_context(|| sp.name)?;
        let client = Client::gated(server.port, &sp.client).with_context(|| sp.name)?;
        running.push((server, client));
    }
    let mut pids = Vec::new();
    for (sp, (server, client)) in specs.iter().zip(&running) {
        pids.push(server.pid());
        if sp.watch_client {
            pids.push(client.pid());
        }
    }
    let json = std::env::temp_dir().join(format!("spice-observer-kernel-paths-{test}.json"));
    let obs = observe_or_skip!(test, &pids, secs, json);
    let t0 = Instant::now();
    for (_, client) in running.iter_mut() {
        client.go()?;
    }
    let mut done = Vec::new();
    for (sp, (mut server, mut client)) in specs.iter().zip(running) {
        let c = client.summary(&format!("{} client", sp.name))?;
        let s = server.summary(&format!("{} server", sp.name))?;
        done.push(Done {
            name: sp.name,
            s,
            c,
            spid: server.pid(),
            cpid: client.pid(),
            watch_client: sp.watch_client,
        });
    }
    let took = t0.elapsed();
    eprintln!("{test}: peers done in {:.2} s", took.as_secs_f64());
    ensure!(
        took < Duration::from_secs_f64(secs - 0.5),
        "{test}: the peers took {took:?}, too close to the {secs} s observation"
    );
    let report = obs.finish_report()?;
    check(&report, &done)
}

// ---------------------------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------------------------

/// [`check_run`] (hook set, nothing degraded, `events_lost` 0), each kernel loss counter 0,
/// and some call traced.
fn check_clean(report: &Report) -> Result<()> {
    check_run(report)?;
    let k = &report.kernel_counters;
    for name in [
        "ring_full",
        "socket_map_full",
        "user_read_fault",
        "loop_limit",
        "untraced_bytes",
    ] {
        let v = *k
            .get(name)
            .with_context(|| format!("kernel counter {name} missing: {k:?}"))?;
        ensure!(v == 0, "kernel counter {name} = {v}: {k:?}");
    }
    let traced = *k
        .get("calls_traced")
        .with_context(|| format!("kernel counter calls_traced missing: {k:?}"))?;
    ensure!(traced > 0, "no call traced: {k:?}");
    Ok(())
}

/// The one channel the observer reports for `pid`.
fn only_channel<'a>(report: &'a Report, pid: u32, what: &str) -> Result<&'a ChannelReport> {
    let all: Vec<&ChannelReport> = report.channels.iter().filter(|c| c.pid == pid).collect();
    ensure!(
        all.len() == 1,
        "{what}: {} channels for pid {pid}: {:#?}",
        all.len(),
        all.iter().map(|c| describe_ch(c)).collect::<Vec<_>>()
    );
    Ok(all[0])
}

fn channel_name(t: u8) -> &'static str {
    match t {
        1 => "main",
        2 => "display",
        3 => "inputs",
        4 => "cursor",
        _ => "?",
    }
}

/// The observer's counts for one end equal what that peer's syscalls moved.
fn check_counts(c: &ChannelReport, p: &PeerSummary, what: &str) -> Result<()> {
    let d = format!("{what}: {}", describe_ch(c));
    let (sent, recv) = (&p.sent, &p.received);
    ensure!(
        sent.unfinished_messages == 0,
        "{what}: the peer left messages unfinished: {sent:?}"
    );
    for (field, got, want) in [
        ("messages_sent", c.messages_sent, sent.messages),
        ("bytes_sent", c.bytes_sent, sent.data_bytes),
        ("messages_received", c.messages_received, recv.messages),
        ("bytes_received", c.bytes_received, recv.data_bytes),
    ] {
        ensure!(
            got == want,
            "{field}: observer {got}, peer {want}\n  {d}\n  peer sent {sent:?}\n  peer received {recv:?}"
        );
    }
    for (field, got, want) in [
        (
            "messages_sent_by_type",
            &c.messages_sent_by_type,
            &sent.by_type,
        ),
        (
            "messages_received_by_type",
            &c.messages_received_by_type,
            &recv.by_type,
        ),
    ] {
        ensure!(
            got == want,
            "{field}: observer {got:?}, peer {want:?}\n  {d}\n  peer sent {sent:?}\n  peer received {recv:?}"
        );
    }
    ensure!(c.records_lost == 0, "records_lost: {d}");
    Ok(())
}

/// A framed pair: the server end (and the client end if watched) framed with the negotiated
/// header, as the right end and channel, with exact counts.
fn check_pair(report: &Report, x: &Done) -> Result<()> {
    let header =
        x.s.header
            .as_deref()
            .ok_or_else(|| anyhow!("{}: no header in server SUMMARY", x.name))?;
    ensure!(
        x.s.outcome == "ok" && x.c.outcome == "ok",
        "{}: outcomes {} / {}",
        x.name,
        x.s.outcome,
        x.c.outcome
    );
    ensure!(
        x.c.header.as_deref() == Some(header),
        "{}: peers disagree on the header",
        x.name
    );
    ensure!(
        x.s.sent.by_type == x.c.received.by_type,
        "{}: peers disagree",
        x.name
    );
    let mut ends = vec![(x.spid, &x.s, "server")];
    if x.watch_client {
        ends.push((x.cpid, &x.c, "client"));
    }
    for (pid, p, end) in ends {
        let what = format!("{} {end}", x.name);
        let c = only_channel(report, pid, &what)?;
        let d = describe_ch(c);
        ensure!(
            c.framing == header,
            "{what}: framing {} ({:?}), expected {header}: {d}",
            c.framing,
            c.unparsed_detail
        );
        ensure!(
            c.unparsed_reason.is_none(),
            "{what}: unparsed {:?}: {d}",
            c.unparsed_reason
        );
        ensure!(
            c.end.as_deref() == Some(end),
            "{what}: end {:?}: {d}",
            c.end
        );
        let ty = channel_name(p.channel.ty);
        ensure!(
            c.channel_type == ty && c.channel_id == Some(p.channel.id),
            "{what}: channel {} {:?}: {d}",
            c.channel_type,
            c.channel_id
        );
        check_counts(c, p, &what)?;
    }
    if !x.watch_client {
        ensure!(
            report.channels.iter().all(|c| c.pid != x.cpid),
            "{}: the unwatched client {} appears in the report",
            x.name,
            x.cpid
        );
    }
    Ok(())
}

fn check_pairs(report: &Report, done: &[Done]) -> Result<()> {
    for x in done {
        check_pair(report, x)?;
    }
    Ok(())
}

fn find<'a>(done: &'a [Done], name: &str) -> &'a Done {
    done.iter()
        .find(|x| x.name == name)
        .unwrap_or_else(|| panic!("no pair {name}"))
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

/// Headers written in two calls (cut after 1, 3 or 11 bytes, mini and full), and readers that
/// take 1, 2 or a few exact bytes per call, so that headers arrive in pieces on both ends.
#[test]
fn split_headers_and_small_reads() -> Result<()> {
    const T: &str = "split_headers_and_small_reads";
    if !privileged(T) {
        return Ok(());
    }
    let specs = vec![
        spec(
            "split3-read1",
            &[
                "--messages",
                "200",
                "--body-size",
                "5",
                "--split-header",
                "--split-at",
                "3",
            ],
            &["--recv-size", "1"],
            true,
        ),
        spec(
            "full-split11-exact4",
            &[
                "--messages",
                "150",
                "--split-header",
                "--split-at",
                "11",
                "--set-ack",
                "--window",
                "6",
                "--recv-exact",
                "--recv-size",
                "4",
            ],
            &[
                "--header",
                "full",
                "--recv-exact",
                "--recv-size",
                "4",
                "--split-header",
                "--split-at",
                "11",
                "--messages",
                "20",
            ],
            true,
        ),
        spec(
            "client-split1-server-read2",
            &[
                "--messages",
                "100",
                "--set-ack",
                "--window",
                "4",
                "--recv-size",
                "2",
            ],
            &[
                "--messages",
                "60",
                "--body-size",
                "3",
                "--split-header",
                "--split-at",
                "1",
                "--recv-size",
                "5",
            ],
            true,
        ),
        spec(
            "split5-readv-exact",
            &[
                "--messages",
                "120",
                "--body-size",
                "0",
                "--split-header",
                "--split-at",
                "5",
                "--send-syscall",
                "sendmsg",
            ],
            &[
                "--recv-exact",
                "--recv-syscall",
                "readv",
                "--recv-iovs",
                "2",
                "--recv-size",
                "3",
            ],
            false,
        ),
    ];
    observe(T, 3.0, specs, |report, done| {
        check_pairs(report, done)?;
        let x = find(done, "split3-read1");
        ensure!(
            x.c.received.calls > x.c.received.bytes,
            "1-byte reads expected"
        );
        ensure!(
            x.s.sent.calls >= 400,
            "split writes expected: {:?}",
            x.s.sent
        );
        ensure!(
            find(done, "full-split11-exact4").s.header.as_deref() == Some("full"),
            "full headers expected"
        );
        Ok(())
    })
}

/// Many whole messages per call: batches of 300 empty messages (mini and full headers,
/// write and writev with the headers split across iovecs), small bodies through sendmsg,
/// small and large bodies mixed in each call, client batches, and receivers that get
/// hundreds of messages per read.
#[test]
fn many_messages_per_call() -> Result<()> {
    const T: &str = "many_messages_per_call";
    if !privileged(T) {
        return Ok(());
    }
    let specs = vec![
        spec(
            "300-empty-write",
            &[
                "--messages",
                "900",
                "--batch",
                "300",
                "--body-size",
                "0",
                "--msg-type",
                "102",
            ],
            &[
                "--messages",
                "600",
                "--batch",
                "300",
                "--body-size",
                "0",
                "--msg-type",
                "4",
            ],
            true,
        ),
        spec(
            "300-empty-full-writev",
            &[
                "--messages",
                "600",
                "--batch",
                "300",
                "--body-size",
                "0",
                "--send-syscall",
                "writev",
            ],
            &[
                "--header",
                "full",
                "--recv-syscall",
                "recvmsg",
                "--recv-iovs",
                "7",
            ],
            true,
        ),
        spec(
            "300-empty-iov-split",
            &[
                "--messages",
                "600",
                "--batch",
                "300",
                "--body-size",
                "0",
                "--send-syscall",
                "writev",
                "--iov-split",
                "--split-at",
                "4",
            ],
            &["--recv-size", "100000"],
            true,
        ),
        spec(
            "300-small-sendmsg",
            &[
                "--messages",
                "900",
                "--batch",
                "300",
                "--body-size",
                "3",
                "--send-syscall",
                "sendmsg",
                "--iov-split",
                "--split-at",
                "2",
            ],
            &[
                "--messages",
                "300",
                "--batch",
                "300",
                "--body-size",
                "1",
                "--send-syscall",
                "sendto",
            ],
            true,
        ),
        // Small and large messages mixed in each call: the kernel reads the headers of a
        // run of small messages from one copy of the buffer's next 2 KiB (ReadWindow), and
        // the headers after a large one alone. In each write of 70 messages one header
        // straddles the copy's end (mini: at offset 2046 of a copy, full: at 2038) and is
        // followed by a non-empty body, so a header taken from past the copied bytes would
        // give a wrong size, not a lucky zero.
        spec(
            "mixed-sizes-write",
            &[
                "--messages",
                "700",
                "--batch",
                "70",
                "--body-sizes",
                "4,3,700,40,2500,1,300,9,2040",
            ],
            &["--recv-size", "100000"],
            true,
        ),
        spec(
            "mixed-sizes-full-write",
            &[
                "--messages",
                "700",
                "--batch",
                "70",
                "--body-sizes",
                "5,2500,0,120,33,1000,2,2020,7",
            ],
            &["--header", "full", "--recv-size", "65536"],
            true,
        ),
        spec(
            "batches-cut-by-the-gate",
            &[
                "--messages",
                "500",
                "--batch",
                "50",
                "--body-size",
                "7",
                "--set-ack",
                "--window",
                "20",
            ],
            &[],
            true,
        ),
    ];
    observe(T, 3.0, specs, |report, done| {
        check_pairs(report, done)?;
        let x = find(done, "300-empty-write");
        // Link: reply, two cap words, result (4 calls); then 3 calls of 300 messages.
        ensure!(
            x.s.sent.calls == 4 + 3,
            "batched writes expected: {:?}",
            x.s.sent
        );
        ensure!(
            find(done, "300-empty-full-writev").s.header.as_deref() == Some("full"),
            "full headers expected"
        );
        // A receiver got many messages per read.
        let r = &find(done, "300-empty-iov-split").c.received;
        ensure!(r.calls < 100, "large reads expected: {r:?}");
        Ok(())
    })
}

/// One message over many calls: 200 kB bodies in 100-byte writes, 1-byte body writes after a
/// split header, a client's chunked messages, and readers taking 100 bytes per readv.
#[test]
fn message_over_many_calls() -> Result<()> {
    const T: &str = "message_over_many_calls";
    if !privileged(T) {
        return Ok(());
    }
    let specs = vec![
        spec(
            "200k-in-100",
            &[
                "--messages",
                "5",
                "--body-size",
                "200000",
                "--chunk",
                "100",
                "--set-ack",
                "--window",
                "2",
            ],
            &[
                "--recv-syscall",
                "readv",
                "--recv-iovs",
                "3",
                "--recv-size",
                "100",
            ],
            true,
        ),
        spec(
            "1-byte-chunks",
            &[
                "--messages",
                "3",
                "--body-size",
                "2000",
                "--chunk",
                "1",
                "--split-header",
                "--split-at",
                "2",
                "--send-syscall",
                "writev",
            ],
            &[
                "--messages",
                "4",
                "--body-size",
                "30000",
                "--chunk",
                "13",
                "--send-syscall",
                "sendmsg",
            ],
            true,
        ),
        spec(
            "1MB-full",
            &[
                "--messages",
                "2",
                "--body-size",
                "1000000",
                "--chunk",
                "4093",
                "--send-syscall",
                "sendto",
            ],
            &[
                "--header",
                "full",
                "--recv-syscall",
                "recvfrom",
                "--recv-size",
                "777",
            ],
            true,
        ),
    ];
    observe(T, 4.0, specs, |report, done| {
        check_pairs(report, done)?;
        let x = find(done, "200k-in-100");
        ensure!(
            x.s.sent.calls >= 5 * 2000,
            "chunked writes expected: {:?}",
            x.s.sent
        );
        let x = find(done, "1-byte-chunks");
        ensure!(
            x.c.sent.calls >= 4 * 2300,
            "chunked client writes expected: {:?}",
            x.c.sent
        );
        Ok(())
    })
}

/// The header itself split across two iovecs of one writev / sendmsg (mini and full, both
/// ends), and readers whose readv / recvmsg iovecs cut headers on arrival.
#[test]
fn header_split_across_iovecs() -> Result<()> {
    const T: &str = "header_split_across_iovecs";
    if !privileged(T) {
        return Ok(());
    }
    let specs = vec![
        spec(
            "writev-2",
            &[
                "--messages",
                "200",
                "--iov-split",
                "--split-at",
                "2",
                "--send-syscall",
                "writev",
                "--set-ack",
                "--window",
                "5",
            ],
            &[
                "--iov-split",
                "--split-at",
                "1",
                "--send-syscall",
                "writev",
                "--messages",
                "30",
                "--recv-syscall",
                "readv",
                "--recv-iovs",
                "4",
                "--recv-size",
                "10",
            ],
            true,
        ),
        spec(
            "sendmsg-5",
            &[
                "--messages",
                "200",
                "--iov-split",
                "--split-at",
                "5",
                "--send-syscall",
                "sendmsg",
                "--recv-syscall",
                "recvmsg",
                "--recv-iovs",
                "5",
                "--recv-size",
                "11",
            ],
            &[
                "--iov-split",
                "--split-at",
                "3",
                "--send-syscall",
                "sendmsg",
                "--messages",
                "40",
                "--body-size",
                "0",
                "--recv-syscall",
                "recvmsg",
                "--recv-iovs",
                "3",
                "--recv-size",
                "9",
            ],
            true,
        ),
        spec(
            "full-sendmsg-13",
            &[
                "--messages",
                "100",
                "--body-size",
                "33",
                "--iov-split",
                "--split-at",
                "13",
                "--send-syscall",
                "sendmsg",
                "--set-ack",
                "--window",
                "3",
            ],
            &[
                "--header",
                "full",
                "--iov-split",
                "--split-at",
                "9",
                "--send-syscall",
                "writev",
                "--messages",
                "10",
                "--recv-syscall",
                "readv",
                "--recv-iovs",
                "8",
                "--recv-size",
                "40",
            ],
            true,
        ),
    ];
    observe(T, 3.0, specs, |report, done| {
        check_pairs(report, done)?;
        ensure!(
            find(done, "full-sendmsg-13").s.header.as_deref() == Some("full"),
            "full headers expected"
        );
        Ok(())
    })
}

/// Every send syscall (write, writev, sendmsg, sendto) and every receive syscall (read,
/// readv, recvmsg, recvfrom) on both ends, in both directions, all pairs watched on both ends.
#[test]
fn every_send_and_receive_syscall_on_both_ends() -> Result<()> {
    const T: &str = "every_send_and_receive_syscall_on_both_ends";
    if !privileged(T) {
        return Ok(());
    }
    const SEND: [&str; 4] = ["write", "writev", "sendmsg", "sendto"];
    const RECV: [&str; 4] = ["read", "readv", "recvmsg", "recvfrom"];
    const NAMES: [&str; 4] = ["rot0", "rot1", "rot2", "rot3"];
    let mut specs = Vec::new();
    for i in 0..4 {
        // Server i: send SEND[i], receive RECV[i]; client: send SEND[i+1], receive RECV[i+2].
        specs.push(spec(
            NAMES[i],
            &[
                "--messages",
                "150",
                "--set-ack",
                "--window",
                "3",
                "--send-syscall",
                SEND[i],
                "--recv-syscall",
                RECV[i],
            ],
            &[
                "--messages",
                "25",
                "--body-size",
                "9",
                "--send-syscall",
                SEND[(i + 1) % 4],
                "--recv-syscall",
                RECV[(i + 2) % 4],
                "--recv-size",
                "7",
            ],
            true,
        ));
    }
    observe(T, 3.0, specs, |report, done| {
        check_pairs(report, done)?;
        for (i, x) in done.iter().enumerate() {
            let p = &x.s.write_pattern;
            ensure!(
                p.send_syscall == SEND[i] && p.recv_syscall == RECV[i],
                "{}: pattern {p:?}",
                x.name
            );
            // 150 draws with W=3: the client ACKs 50 times, sends 25 own messages and an ACK_SYNC.
            ensure!(
                x.s.received.by_type == by_type(&[(1, 1), (2, 50), (101, 25)]),
                "{}: {:?}",
                x.name,
                x.s.received
            );
        }
        Ok(())
    })
}

/// Full 18-byte headers whichever side lacks MINI_HEADER, and without auth selection (the
/// ticket right after the link message); a mini control in the same observation.
#[test]
fn full_headers() -> Result<()> {
    const T: &str = "full_headers";
    if !privileged(T) {
        return Ok(());
    }
    let specs = vec![
        spec(
            "client-full",
            &["--messages", "100", "--set-ack", "--window", "4"],
            &["--header", "full", "--messages", "10"],
            true,
        ),
        spec(
            "server-full",
            &[
                "--header",
                "full",
                "--messages",
                "100",
                "--body-size",
                "100",
                "--link-one-write",
            ],
            &["--messages", "5"],
            true,
        ),
        spec(
            "no-common-caps",
            &["--messages", "50", "--set-ack", "--window", "5"],
            &["--no-common-caps", "--messages", "3"],
            true,
        ),
        spec(
            "mini-no-auth-selection",
            &["--messages", "50", "--set-ack", "--window", "5"],
            &["--common-caps", "0x08", "--messages", "3"],
            true,
        ),
        spec(
            "full-split17",
            &[
                "--header",
                "full",
                "--messages",
                "60",
                "--split-header",
                "--split-at",
                "17",
                "--set-ack",
                "--window",
                "2",
            ],
            &[
                "--recv-size",
                "5",
                "--messages",
                "7",
                "--split-header",
                "--split-at",
                "1",
            ],
            true,
        ),
    ];
    observe(T, 3.0, specs, |report, done| {
        check_pairs(report, done)?;
        for x in done {
            let want = if x.name == "mini-no-auth-selection" {
                "mini"
            } else {
                "full"
            };
            ensure!(
                x.s.header.as_deref() == Some(want),
                "{}: the peers negotiated {:?} headers, {want} expected",
                x.name,
                x.s.header
            );
        }
        Ok(())
    })
}

/// Non-blocking writers behind a 4 KiB send buffer and slow readers: EAGAIN at message starts
/// (reported then, exactly once) and in the middle of bodies (header-like ones included).
#[test]
fn eagain_starts() -> Result<()> {
    const T: &str = "eagain_starts";
    if !privileged(T) {
        return Ok(());
    }
    let slow = ["--recv-size", "4096", "--recv-pause-ms", "1"];
    let specs = vec![
        spec(
            "small-writev",
            &[
                "--nonblock",
                "--sndbuf",
                "4096",
                "--messages",
                "3000",
                "--body-size",
                "200",
                "--send-syscall",
                "writev",
            ],
            &slow,
            true,
        ),
        spec(
            "small-write-full",
            &[
                "--nonblock",
                "--sndbuf",
                "4096",
                "--messages",
                "2000",
                "--body-size",
                "100",
                "--send-syscall",
                "write",
            ],
            &[
                "--header",
                "full",
                "--recv-size",
                "4096",
                "--recv-pause-ms",
                "1",
                "--recv-syscall",
                "recvmsg",
            ],
            true,
        ),
        spec(
            "big-sendmsg-window",
            &[
                "--nonblock",
                "--sndbuf",
                "4096",
                "--messages",
                "20",
                "--body-size",
                "65536",
                "--send-syscall",
                "sendmsg",
                "--set-ack",
                "--window",
                "4",
            ],
            &["--recv-size", "8192", "--recv-pause-ms", "1"],
            true,
        ),
        spec(
            "header-like-bodies",
            &[
                "--nonblock",
                "--sndbuf",
                "4096",
                "--messages",
                "4",
                "--body-size",
                "300000",
                "--body-fill",
                "2",
                "--send-syscall",
                "sendto",
            ],
            &slow,
            false,
        ),
        spec(
            "client-eagain",
            &[
                "--messages",
                "10",
                "--recv-size",
                "4096",
                "--recv-pause-ms",
                "1",
            ],
            &[
                "--nonblock",
                "--sndbuf",
                "4096",
                "--messages",
                "2000",
                "--body-size",
                "150",
                "--send-syscall",
                "writev",
            ],
            true,
        ),
    ];
    observe(T, 4.0, specs, |report, done| {
        check_pairs(report, done)?;
        let mut starts = BTreeMap::new();
        for x in done {
            let mut ends = vec![(x.spid, &x.s, "s2c", "server")];
            if x.watch_client {
                ends.push((x.cpid, &x.c, "c2s", "client"));
            }
            for (pid, p, dir, end) in ends {
                let c = only_channel(report, pid, x.name)?;
                let f = match dir {
                    "s2c" => &p.framing.s2c,
                    _ => &p.framing.c2s,
                };
                // The framing code, fed this peer's calls (EAGAIN ones by peek), predicts which
                // message starts are first seen on a rejected call.
                ensure!(
                    f.peek_mismatched == 0 && f.peeked == f.already_reported,
                    "{} {end}: peer framing {f:?}",
                    x.name
                );
                ensure!(
                    c.messages_sent_eagain_start == f.peeked,
                    "{} {end}: messages_sent_eagain_start {}, the peer's EAGAINs at message starts {} (EAGAINs in all {}): {}",
                    x.name,
                    c.messages_sent_eagain_start,
                    f.peeked,
                    p.sent.eagain,
                    describe_ch(c)
                );
                starts.insert(format!("{} {end}", x.name), (f.peeked, p.sent.eagain));
            }
        }
        eprintln!("EAGAIN (at message starts, all): {starts:?}");
        for k in [
            "small-writev server",
            "small-write-full server",
            "client-eagain client",
        ] {
            ensure!(
                starts[k].0 > 0,
                "{k}: no EAGAIN at a message start happened, the path is not exercised: {starts:?}"
            );
        }
        let (at_start, all) = starts["header-like-bodies server"];
        ensure!(
            all > at_start,
            "header-like-bodies: no EAGAIN in the middle of a body: {starts:?}"
        );
        Ok(())
    })
}

/// The ACK window through the peers: SET_ACK, ACK_SYNC and ACKs (spice-gtk and spice-html5
/// cadences, a non-default generation, a cursor channel), and a client that never ACKs so the
/// server stalls at 2W+1.
#[test]
fn ack_window() -> Result<()> {
    const T: &str = "ack_window";
    if !privileged(T) {
        return Ok(());
    }
    let specs = vec![
        spec(
            "gtk-w7",
            &["--messages", "300", "--set-ack", "--window", "7"],
            &[],
            true,
        ),
        spec(
            "stalled-w5",
            &[
                "--messages",
                "100",
                "--set-ack",
                "--window",
                "5",
                "--stall-timeout-ms",
                "400",
            ],
            &["--no-acks"],
            true,
        ),
        spec(
            "html5-w5-gen9",
            &[
                "--messages",
                "199",
                "--set-ack",
                "--window",
                "5",
                "--generation",
                "9",
            ],
            &["--ack-cadence", "html5"],
            true,
        ),
        spec(
            "cursor-w2",
            &[
                "--messages",
                "80",
                "--set-ack",
                "--window",
                "2",
                "--msg-type",
                "102",
            ],
            &["--channel-type", "4", "--channel-id", "1"],
            false,
        ),
        spec(
            "stalled-w1-split",
            &[
                "--messages",
                "50",
                "--set-ack",
                "--window",
                "1",
                "--stall-timeout-ms",
                "400",
                "--split-header",
            ],
            &["--no-acks", "--recv-size", "1"],
            false,
        ),
    ];
    observe(T, 3.0, specs, |report, done| {
        check_pairs(report, done)?;
        for x in done {
            let a = x.s.server_acks().with_context(|| x.name)?;
            let w = a.window;
            let c = only_channel(report, x.spid, x.name)?;
            let d = format!("{}: {} (peer acks {a:?})", x.name, describe_ch(c));
            let stalled = x.name.starts_with("stalled");
            let limit = 2 * w as i64 + 1;
            ensure!(c.set_acks == 1, "set_acks: {d}");
            ensure!(c.window == Some(w), "window: {d}");
            ensure!(c.ack_generation == Some(a.generation), "generation: {d}");
            ensure!(c.acks_ignored == 0, "acks_ignored: {d}");
            ensure!(c.starts_while_stalled == 0, "starts_while_stalled: {d}");
            ensure!(c.urgent_pair_peaks == 0, "urgent_pair_peaks: {d}");
            ensure!(c.in_flight_limit == Some(limit), "in_flight_limit: {d}");
            // The final count is spice-server's: 1 + messages after SET_ACK − W × ACKs.
            ensure!(
                c.in_flight_now == Some(a.final_count),
                "in_flight_now {:?} vs the peer's final count: {d}",
                c.in_flight_now
            );
            let max = c
                .in_flight_max
                .with_context(|| format!("in_flight_max missing: {d}"))?;
            if stalled {
                ensure!(
                    a.stalled_timeout && a.max_count == limit,
                    "{}: the peer did not stall: {a:?}",
                    x.name
                );
                ensure!(
                    max == limit,
                    "in_flight_max {max}, 2W+1 = {limit} expected: {d}"
                );
                ensure!(c.messages_sent == limit as u64, "messages_sent: {d}");
                ensure!(
                    c.ack_syncs == 0 && c.acks == 0,
                    "no ACK_SYNC / ACK expected: {d}"
                );
                ensure!(c.stalls == 1, "stalls: {d}");
                let f = c
                    .stalled_fraction
                    .with_context(|| format!("stalled_fraction missing: {d}"))?;
                ensure!(f > 0.5, "stalled_fraction {f} after a 400 ms stall: {d}");
            } else {
                ensure!(!a.stalled_timeout, "{}: the peer stalled: {a:?}", x.name);
                ensure!(
                    c.ack_syncs == 1 && c.ack_sync_generation == Some(a.generation),
                    "ack_syncs: {d}"
                );
                ensure!(c.acks == a.acks_matched && a.acks_matched > 0, "acks: {d}");
                ensure!(
                    max >= 1 && max <= a.max_count && max <= limit,
                    "in_flight_max {max}: {d}"
                );
            }
        }
        // Cadences: gtk ACKs every W messages after the SET_ACK, html5 counts the SET_ACK too.
        ensure!(
            find(done, "gtk-w7").s.server_acks()?.acks_matched == 300 / 7,
            "gtk cadence"
        );
        ensure!(
            find(done, "html5-w5-gen9").s.server_acks()?.acks_matched == 200 / 5,
            "html5 cadence"
        );
        // The watched client ends replay the same window from the other side.
        for name in ["gtk-w7", "stalled-w5", "html5-w5-gen9"] {
            let x = find(done, name);
            let c = only_channel(report, x.cpid, name)?;
            let a = x.s.server_acks()?;
            let ca =
                x.c.client_acks()
                    .with_context(|| format!("{name} client"))?;
            ensure!(
                c.set_acks == 1 && c.window == Some(a.window),
                "{name} client: {}",
                describe_ch(c)
            );
            ensure!(
                c.acks == ca.acks_sent,
                "{name} client acks: {} vs {ca:?}",
                describe_ch(c)
            );
            ensure!(
                c.in_flight_now == Some(a.final_count),
                "{name} client final count: {}",
                describe_ch(c)
            );
        }
        Ok(())
    })
}

/// Bytes no hook can read from a user buffer: a server that switches to sendfile(2) after 11
/// messages (`spice-peer --sendfile-after`) has its send direction marked `untraced_bytes`
/// with those 11 counted, while its receive direction, the client's end and a good pair
/// beside it stay exact. sendfile reaches `sock_sendmsg` (and the tracepoint) since Linux 6.5
/// (`MSG_SPLICE_PAGES`); before, it went through `sendpage` and only the sequence check of a
/// later traced call would see the bytes.
#[test]
fn untraced_bytes_mark_their_direction_only() -> Result<()> {
    const T: &str = "untraced_bytes_mark_their_direction_only";
    if !privileged(T) {
        return Ok(());
    }
    let specs = vec![
        spec(
            "sendfile",
            &[
                "--messages",
                "40",
                "--set-ack",
                "--window",
                "5",
                "--sendfile-after",
                "11",
            ],
            &["--messages", "3"],
            true,
        ),
        spec(
            "good",
            &["--messages", "100", "--set-ack", "--window", "10"],
            &["--messages", "10"],
            true,
        ),
    ];
    observe_then(T, 3.0, specs, |report, done| {
        for x in done {
            if x.name == "good" {
                check_pair(report, x)?;
                continue;
            }
            // The peer's own account: the first 11 messages by write, the rest by sendfile.
            ensure!(
                x.s.sent.sendfile_calls > 0 && x.s.sent.messages > 11,
                "{}: the server sent {:?}",
                x.name,
                x.s.sent
            );
            // The server's send direction stops at the first sendfile, with the messages the
            // writes carried; its receive direction stays framed and exact.
            let c = only_channel(report, x.spid, "sendfile server")?;
            let d = format!(
                "sendfile server: {} ({:?})",
                describe_ch(c),
                c.unparsed_reason
            );
            ensure!(
                c.unparsed_reason.as_deref() == Some("untraced_bytes"),
                "untraced_bytes expected: {d}"
            );
            ensure!(
                c.messages_sent == 11
                    && c.messages_received == x.s.received.messages
                    && c.bytes_received == x.s.received.data_bytes,
                "11 messages sent and the peer's {} received expected: {d}",
                x.s.received.messages
            );
            // The client reads every byte with read(2): its end is framed in full.
            let c = only_channel(report, x.cpid, "sendfile client")?;
            ensure!(
                c.unparsed_reason.is_none(),
                "sendfile client: unparsed {:?}: {}",
                c.unparsed_reason,
                describe_ch(c)
            );
            check_counts(c, &x.c, "sendfile client")?;
        }
        // Counted once, as a loss, and nothing else lost.
        let k = &report.kernel_counters;
        ensure!(
            k.get("untraced_bytes") == Some(&1) && report.events_lost == 1,
            "untraced_bytes 1 and events_lost 1 expected: {} / {k:?}",
            report.events_lost
        );
        Ok(())
    })
}

/// Streams the observer cannot or must not frame: garbage, TLS and WebSocket starts, SASL,
/// link refusals (error reply, bad result, error after the reply). Each is reported unparsed
/// with its reason. An out-of-range message type is a resync: that direction hunts from
/// there (`sync_*` reason `bad_header`), the other stays framed. A good pair observed at the
/// same time keeps exact counts.
#[test]
fn unreadable_streams_and_refusals() -> Result<()> {
    const T: &str = "unreadable_streams_and_refusals";
    if !privileged(T) {
        return Ok(());
    }
    let specs = vec![
        spec(
            "good",
            &["--messages", "200", "--set-ack", "--window", "10"],
            &["--messages", "20"],
            true,
        ),
        spec(
            "garbage-server",
            &["--garbage", "--garbage-len", "100"],
            &[],
            true,
        ),
        spec("garbage-client", &[], &["--garbage", "--seed", "7"], true),
        spec("tls-server", &["--tls-bytes"], &[], true),
        spec("tls-client", &[], &["--tls-bytes"], true),
        spec("websocket-client", &[], &["--websocket"], true),
        spec(
            "sasl",
            &["--sasl", "--messages", "30", "--set-ack", "--window", "3"],
            &["--sasl", "--messages", "5"],
            true,
        ),
        spec("link-error-9", &["--link-error", "9"], &[], true),
        spec("result-7", &["--result", "7"], &[], true),
        spec(
            "error-after-reply-8",
            &["--error-after-reply", "8"],
            &[],
            true,
        ),
        spec(
            "bad-type",
            &[
                "--set-ack",
                "--window",
                "4",
                "--messages",
                "20",
                "--msg-type",
                "1001",
            ],
            &[],
            true,
        ),
        spec(
            "good-2",
            &["--messages", "100", "--split-header", "--body-size", "0"],
            &["--recv-size", "3"],
            true,
        ),
    ];
    observe(T, 3.0, specs, |report, done| {
        for x in done {
            // (reason, detail substring, server → client messages framed before the stop,
            // client → server messages framed: that direction stays parsed). The unreadable
            // streams must frame nothing either way: the test's own expectation (0, 0).
            let (reason, detail, s2c, c2s): (&str, Option<&str>, u64, u64) = match x.name {
                "good" | "good-2" => {
                    check_pair(report, x)?;
                    continue;
                }
                "garbage-server" | "garbage-client" => ("not_spice", None, 0, 0),
                "tls-server" | "tls-client" => ("tls", None, 0, 0),
                "websocket-client" => ("websocket", None, 0, 0),
                "sasl" => ("sasl", None, 0, 0),
                "link-error-9" => ("link_refused", Some("(9)"), 0, 0),
                "result-7" => ("link_refused", Some("(7)"), 0, 0),
                "error-after-reply-8" => ("link_error_after_reply", None, 0, 0),
                // The server's script sends SET_ACK first, then only type 1001: framed are
                // the messages it sent before the first out-of-range type, from its SUMMARY
                // (1, the SET_ACK); then that direction hunts for good (1001 is no type of any
                // channel); the other direction stays parsed: the client's messages the
                // server read (its ACK_SYNC and 5 ACKs).
                "bad-type" => {
                    ensure!(
                        x.s.sent.by_type == by_type(&[(3, 1), (1001, 20)]),
                        "{}: the server sent {:?}",
                        x.name,
                        x.s.sent
                    );
                    ensure!(
                        x.s.received.by_type == by_type(&[(1, 1), (2, 5)])
                            && x.c.sent.messages == x.s.received.messages,
                        "{}: the server read {:?}, the client sent {:?}",
                        x.name,
                        x.s.received,
                        x.c.sent
                    );
                    let before_bad = x.s.sent.messages - x.s.sent.by_type["1001"];
                    (
                        "bad_header",
                        Some("message type 1001"),
                        before_bad,
                        x.s.received.messages,
                    )
                }
                other => bail!("unknown pair {other}"),
            };
            for (pid, end) in [(x.spid, "server"), (x.cpid, "client")] {
                let c = only_channel(report, pid, &format!("{} {end}", x.name))?;
                let d = format!(
                    "{} {end}: {} ({:?} / {:?})",
                    x.name,
                    describe_ch(c),
                    c.unparsed_reason,
                    c.unparsed_detail
                );
                if reason == "bad_header" {
                    let s2c = if end == "server" {
                        &c.sync_sent
                    } else {
                        &c.sync_received
                    };
                    let c2s = if end == "server" {
                        &c.sync_received
                    } else {
                        &c.sync_sent
                    };
                    ensure!(
                        c.framing == "mini"
                            && c.unparsed_reason.is_none()
                            && c2s.is_none()
                            && s2c.as_ref().is_some_and(|y| y.hunting
                                && y.reason == "bad_header"
                                && y.resyncs == 1
                                && y.locks == 0),
                        "a resync of the server's direction expected: {d} {s2c:?} {c2s:?}"
                    );
                } else {
                    ensure!(
                        c.framing == "unparsed" && c.unparsed_reason.as_deref() == Some(reason),
                        "{reason} expected: {d}"
                    );
                }
                if let Some(want) = detail.filter(|_| reason != "bad_header") {
                    ensure!(
                        c.unparsed_detail
                            .as_deref()
                            .is_some_and(|t| t.contains(want)),
                        "detail {want:?} expected: {d}"
                    );
                }
                let (msgs_out, msgs_in) = if end == "server" {
                    (s2c, c2s)
                } else {
                    (c2s, s2c)
                };
                ensure!(
                    c.messages_sent == msgs_out && c.messages_received == msgs_in,
                    "messages sent / received {msgs_out} / {msgs_in} expected: {d}"
                );
                ensure!(c.records_lost == 0, "records_lost: {d}");
            }
        }
        // The peers really went through their scripts.
        ensure!(
            find(done, "link-error-9").c.link.refused == Some(9),
            "link-error-9 client"
        );
        ensure!(
            find(done, "result-7").c.outcome == "link_refused",
            "result-7 client"
        );
        ensure!(
            find(done, "error-after-reply-8").c.link.error_after_reply == Some(8),
            "error-after-reply-8 client"
        );
        ensure!(
            find(done, "sasl").c.received.by_type == by_type(&[(3, 1), (304, 30)]),
            "sasl data went through"
        );
        ensure!(
            find(done, "bad-type").c.received.by_type == by_type(&[(3, 1), (1001, 20)]),
            "bad-type data went through"
        );
        Ok(())
    })
}

/// The reader sleeps until the server has written everything and closed its side, so one
/// read returns the last messages and also consumes the FIN (Linux advances `copied_seq` by
/// one for the FIN in that same call). The messages of that read must still be counted, and a
/// refusal read together with the FIN must keep its reason.
#[test]
fn last_read_that_also_takes_the_fin() -> Result<()> {
    const T: &str = "last_read_that_also_takes_the_fin";
    if !privileged(T) {
        return Ok(());
    }
    let slow = ["--recv-pause-ms", "250"];
    let specs = vec![
        spec("data-and-fin", &["--messages", "10"], &slow, true),
        spec("result-7-and-fin", &["--result", "7"], &slow, true),
    ];
    observe(T, 3.0, specs, |report, done| {
        let x = find(done, "data-and-fin");
        // Reads: link reply, then result + 10 messages + FIN, then nothing (EOF).
        ensure!(
            x.c.received.calls <= 4,
            "{}: the client did not read in a few calls: {:?}",
            x.name,
            x.c.received
        );
        check_pair(report, x)?;
        let x = find(done, "result-7-and-fin");
        ensure!(x.c.outcome == "link_refused", "{}: {}", x.name, x.c.outcome);
        let c = only_channel(report, x.cpid, "result-7-and-fin client")?;
        ensure!(
            c.unparsed_reason.as_deref() == Some("link_refused"),
            "{} client: reason {:?} ({:?}), link_refused expected: {}",
            x.name,
            c.unparsed_reason,
            c.unparsed_detail,
            describe_ch(c)
        );
        Ok(())
    })
}

/// The server half-closes first (FIN_WAIT2), reads slowly, and the client's last messages
/// arrive together with its FIN: the server's socket reaches TCP_CLOSE (FIN in FIN_WAIT2 →
/// TIME_WAIT) while those messages still wait in its receive queue. They are read afterwards
/// and must be counted like any other (both when they are ≥ 16 bytes and when fewer).
#[test]
fn data_read_after_the_socket_reached_tcp_close() -> Result<()> {
    const T: &str = "data_read_after_the_socket_reached_tcp_close";
    if !privileged(T) {
        return Ok(());
    }
    let specs = vec![
        spec(
            "five-messages",
            &["--messages", "10", "--recv-pause-ms", "300"],
            &["--messages", "5"],
            false,
        ),
        spec(
            "one-small-message",
            &["--messages", "10", "--recv-pause-ms", "300"],
            &["--messages", "1", "--body-size", "2"],
            false,
        ),
    ];
    observe(T, 3.0, specs, |report, done| {
        for x in done {
            ensure!(x.s.received.messages >= 1, "{}: {:?}", x.name, x.s.received);
            let c = only_channel(report, x.spid, x.name)?;
            ensure!(c.closed, "{}: close not seen: {}", x.name, describe_ch(c));
        }
        check_pairs(report, done)
    })
}

/// Runs this test binary's `split_headers_and_small_reads` in a child, through `wrap` (e.g.
/// `setpriv …`), with `CI=true` or without `CI`; returns (exit success, stdout + stderr).
fn run_child_test(wrap: &[&str], ci: bool) -> Result<(bool, String)> {
    let me = std::env::current_exe().context("this test binary")?;
    let mut cmd = match wrap.split_first() {
        Some((prog, args)) => {
            let mut c = Command::new(prog);
            c.args(args).arg(&me);
            c
        }
        None => Command::new(&me),
    };
    cmd.args([
        "--exact",
        "split_headers_and_small_reads",
        "--test-threads=1",
        "--nocapture",
    ]);
    // Backtraces off: the messages are what is checked (and read).
    cmd.env("RUST_BACKTRACE", "0")
        .env("RUST_LIB_BACKTRACE", "0");
    if ci {
        cmd.env("CI", "true");
    } else {
        cmd.env_remove("CI");
    }
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Each line prefixed, so that the child's expected `test … FAILED` lines are not read
    // (by a person or a CI log parser) as this run's own failures.
    let shown: String = text.lines().map(|l| format!("child| {l}\n")).collect();
    eprintln!(
        "--- {cmd:?} (CI {}) exited {}:\n{shown}---",
        if ci { "true" } else { "unset" },
        out.status
    );
    Ok((out.status.success(), text))
}

/// No silent passes: a privileged test that cannot run skips loudly, and fails under
/// `CI=true` naming why (here: not root, the test run as user nobody, or as this non-root
/// user); a test whose observer cannot load its programs (root without CAP_BPF,
/// CAP_SYS_ADMIN and CAP_PERFMON) fails with the kernel's refusal, with or without `CI`.
#[test]
fn ci_true_turns_a_skip_into_a_failure() -> Result<()> {
    const CHILD: &str = "split_headers_and_small_reads";
    let root = unsafe { libc::geteuid() } == 0;
    let nobody: &[&str] = if root {
        &[
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--",
        ]
    } else {
        &[]
    };
    let (ok, text) = run_child_test(nobody, true)?;
    ensure!(!ok, "CI=true: a test that cannot run passed:\n{text}");
    ensure!(
        text.contains(&format!(
            "FAIL {CHILD}: CI=true and the test cannot run: needs root"
        )),
        "CI=true: the failure does not name the reason:\n{text}"
    );
    let (ok, text) = run_child_test(nobody, false)?;
    ensure!(ok, "without CI the test should skip (pass):\n{text}");
    ensure!(
        text.contains(&format!("SKIP {CHILD}: needs root")),
        "without CI the skip is not loud:\n{text}"
    );
    if !root {
        // The other half (root without CAP_BPF) cannot run: a loud skip, a failure under CI.
        let msg = common::cannot_run(
            "ci_true_turns_a_skip_into_a_failure",
            "not root: the load as root without CAP_BPF, CAP_SYS_ADMIN and CAP_PERFMON was not tried",
        );
        ensure!(!common::ci(), "{msg}");
        eprintln!("{msg}");
        return Ok(());
    }
    let no_bpf = [
        "setpriv",
        "--inh-caps=-bpf,-sys_admin,-perfmon",
        "--bounding-set=-bpf,-sys_admin,-perfmon",
        "--",
    ];
    for ci in [false, true] {
        let (ok, text) = run_child_test(&no_bpf, ci)?;
        ensure!(
            !ok,
            "root without CAP_BPF: the test passed (CI {ci}):\n{text}"
        );
        ensure!(
            text.contains("spice-observer exited before attaching")
                && text.contains("permission denied")
                && !text.contains(common::UNAVAILABLE)
                && !text.contains("SKIP"),
            "root without CAP_BPF: not failed with the kernel's refusal (CI {ci}):\n{text}"
        );
    }
    Ok(())
}
