//! Privileged tests of the ACK window the kernel keeps (`spice_ebpf_common::window`, run in
//! `spice-ebpf/src/capture.rs`) and the statistics the agent derives from it
//! (`model/window.rs`), on the real kernel path and on a real session:
//!
//! * scripted peers (`spice-peer`, real processes over loopback ports 5980–5984) that do what
//!   spice-server and spice-gtk allow but rarely do: a second SET_ACK (a new generation), a
//!   surplus ACK (spice-server's unsigned count wraps), and type 105 at the window on cursor
//!   (CURSOR_HIDE, no urgent pair) and on display (INVAL_LIST, an urgent pair). Messages,
//!   SET_ACKs, generation, window, ACK_SYNCs, ACKs (matched, ignored, surplus) and the
//!   in-flight count (final, maximum) are compared with the peer's own `SUMMARY`, which counts
//!   spice-server's way on its side of the socket. The type-105 figures (starts above 2W,
//!   urgent-pair peaks) are the test's own arithmetic on the messages the peer sent: the peer
//!   keeps no such count.
//! * a real Xspice session (port 5985) with spice-gtk, whose client stops reading for a while:
//!   one generation per connection, no surplus ACK, the ACK count spice-gtk's cadence gives.
//!
//! Both also check the kernel's own state (report `kernel_window`, the socket's `SOCKETS` entry
//! read while it was open): every read the agent compared agreed with the record-derived
//! figures, and where the read came after the socket's last message (the surplus pair's final
//! wait, the idle end of the Xspice session) its counts are compared with the peer's
//! `SUMMARY` or spice-gtk's cadence directly.
//!
//! Run serially (`--test-threads=1`) and under the machine's privileged-test lock.

mod common;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use common::{
    Client as GtkClient, Rig,
    peer::{Client as PeerClient, Server as PeerServer},
    privileged,
    summary::PeerSummary,
};
use spice_observer::report::{ChannelReport, KernelWindowReport, Report};

/// A finished pair: the server's SUMMARY and pid.
struct Pair {
    name: &'static str,
    server: PeerSummary,
    spid: u32,
}

/// Starts every (name, port, server args, client args) pair, observes the servers for `secs`,
/// releases the clients, waits for all peers and returns the typed report.
fn observe_pairs(
    test: &str,
    secs: f64,
    specs: &[(&'static str, u16, Vec<&str>, Vec<&str>)],
) -> Result<Option<(Report, Vec<Pair>)>> {
    let mut running = Vec::new();
    for (name, port, sargs, cargs) in specs {
        let s = PeerServer::start_on(*port, sargs).with_context(|| *name)?;
        let c = PeerClient::gated(*port, cargs).with_context(|| *name)?;
        running.push((*name, s, c));
    }
    let pids: Vec<u32> = running.iter().map(|(_, s, _)| s.pid()).collect();
    let json = std::env::temp_dir().join(format!("spice-observer-window-{test}.json"));
    let obs = match common::Observer::start(&pids, secs, json)? {
        common::Started::Running(o) => o,
        common::Started::Unsupported(why) => {
            let msg = common::cannot_run(test, &format!("kernel feature missing:\n{why}"));
            if common::ci() {
                bail!("{msg}");
            }
            eprintln!("{msg}");
            return Ok(None);
        }
    };
    let t0 = Instant::now();
    for (_, _, c) in running.iter_mut() {
        c.go()?;
    }
    let mut pairs = Vec::new();
    for (name, mut s, mut c) in running {
        c.summary(&format!("{name} client"))?;
        let server = s.summary(&format!("{name} server"))?;
        pairs.push(Pair {
            name,
            server,
            spid: s.pid(),
        });
    }
    let took = t0.elapsed();
    eprintln!("{test}: peers done in {:.2} s", took.as_secs_f64());
    ensure!(
        took < Duration::from_secs_f64(secs - 1.0),
        "{test}: the peers took {took:?}, too close to the {secs} s observation"
    );
    let report = obs.finish_report()?;
    common::check_run(&report)?;
    Ok(Some((report, pairs)))
}

/// The one channel the observer reports for `pid`.
fn only_channel<'a>(r: &'a Report, pid: u32, what: &str) -> Result<&'a ChannelReport> {
    let all: Vec<&ChannelReport> = r.channels.iter().filter(|c| c.pid == pid).collect();
    match all.as_slice() {
        [c] => Ok(c),
        _ => bail!("{what}: {} channels for pid {pid}: {all:#?}", all.len()),
    }
}

fn brief(c: &ChannelReport) -> String {
    format!(
        "{} {:?} {} (W {:?}, gen {:?}, generations {}, set_acks {}, ack_syncs {}, acks {}, ignored {}, surplus {}, sent {}, now {:?}, max {:?}, limit {:?}, stalls {}, stalled {:?}, starts_while_stalled {}, urgent {})",
        c.channel_type,
        c.channel_id,
        c.socket,
        c.window,
        c.ack_generation,
        c.generations,
        c.set_acks,
        c.ack_syncs,
        c.acks,
        c.acks_ignored,
        c.ack_surplus,
        c.messages_sent,
        c.in_flight_now,
        c.in_flight_max,
        c.in_flight_limit,
        c.stalls,
        c.stalled_fraction,
        c.starts_while_stalled,
        c.urgent_pair_peaks
    )
}

/// The kernel's own window state of `c` (`kernel_window`): read at least once while the
/// socket was open, every compared read agreed with the record-derived state, and none was
/// ahead of the records. If the read shown covers every message of the report, its counts must
/// equal the report's; returns it and whether it does.
fn kernel_state<'a>(c: &'a ChannelReport, d: &str) -> Result<(&'a KernelWindowReport, bool)> {
    let k = c
        .kernel_window
        .as_ref()
        .ok_or_else(|| anyhow!("no kernel read was compared: {d}"))?;
    ensure!(
        k.compared >= 1 && k.differed == 0 && k.differences.is_empty(),
        "kernel and record-derived state differ in {:?} ({} of {} reads): {k:?}: {d}",
        k.differences,
        k.differed,
        k.compared
    );
    ensure!(
        k.messages_sent <= c.messages_sent
            && k.messages_received <= c.messages_received
            && k.bytes_sent <= c.bytes_sent
            && k.bytes_received <= c.bytes_received,
        "kernel read ahead of the report: {k:?}: {d}"
    );
    let last = k.messages_sent == c.messages_sent && k.messages_received == c.messages_received;
    if last {
        ensure!(
            k.bytes_sent == c.bytes_sent
                && k.bytes_received == c.bytes_received
                && Some(i64::from(k.count)) == c.in_flight_now
                && Some(i64::from(k.max)) == c.in_flight_max
                && Some(k.window) == c.window
                && Some(k.generation) == c.ack_generation
                && k.ack_sync_generation == c.ack_sync_generation
                && k.set_acks == c.set_acks
                && k.ack_syncs == c.ack_syncs
                && k.acks == c.acks
                && k.acks_ignored == c.acks_ignored
                && k.ack_surplus == c.ack_surplus
                && k.stalls_total == c.stalls_total
                && k.starts_while_stalled == c.starts_while_stalled
                && k.urgent_pair_peaks == c.urgent_pair_peaks,
            "kernel read after the last message, but the report differs: {k:?}: {d}"
        );
    }
    Ok((k, last))
}

// ---------------------------------------------------------------------------------------------
// Kernel path: generations, surplus ACK, type 105 on cursor and display
// ---------------------------------------------------------------------------------------------

#[test]
fn peer_generations_surplus_ack_and_type_105() -> Result<()> {
    const T: &str = "peer_generations_surplus_ack_and_type_105";
    if !privileged(T) {
        return Ok(());
    }
    let specs = vec![
        // One message every 30 ms; the client ACKs once after the 3rd, when 4 messages are
        // counted: 4 - 20 wraps spice-server's count, and the server waits for good (600 ms,
        // then the peer gives up).
        (
            "surplus",
            5980,
            vec![
                "--set-ack",
                "--window",
                "20",
                "--messages",
                "30",
                "--interval-ms",
                "30",
                "--stall-timeout-ms",
                "600",
            ],
            vec!["--surplus-ack-after", "3"],
        ),
        // Generation 1 (W 10): 15 messages, no stall, max 16. 100 ms later SET_ACK(2, W 3):
        // 12 more messages at most 7 in flight. The client sleeps 400 ms before each ACK, so
        // its ACK for generation 1 arrives after the second SET_ACK and is ignored.
        (
            "generations",
            5981,
            vec![
                "--set-ack",
                "--window",
                "10",
                "--messages",
                "27",
                "--second-set-ack-after",
                "15",
                "--second-window",
                "3",
                "--second-set-ack-delay-ms",
                "100",
            ],
            vec!["--ack-delay-ms", "400"],
        ),
        // A server that ignores the window (W 2), every message type 105, no ACKs.
        (
            "cursor-105",
            5982,
            vec![
                "--set-ack",
                "--window",
                "2",
                "--ignore-acks",
                "--messages",
                "10",
                "--msg-type",
                "105",
            ],
            vec!["--no-acks", "--channel-type", "4"],
        ),
        (
            "display-105",
            5983,
            vec![
                "--set-ack",
                "--window",
                "2",
                "--ignore-acks",
                "--messages",
                "10",
                "--msg-type",
                "105",
            ],
            vec!["--no-acks", "--channel-type", "2"],
        ),
    ];
    let Some((report, pairs)) = observe_pairs(T, 6.0, &specs)? else {
        return Ok(());
    };
    for p in &pairs {
        let c = only_channel(&report, p.spid, p.name)?;
        let a = &p
            .server
            .server_acks()
            .with_context(|| format!("{}: the peer kept no ACK state", p.name))?;
        let d = format!("{}: {} (peer {a:?})", p.name, brief(c));
        // Common to all: what the peer's syscalls moved and its own window accounting.
        ensure!(
            c.messages_sent == p.server.sent.messages,
            "messages_sent: {d}"
        );
        ensure!(c.set_acks == a.set_acks, "set_acks: {d}");
        ensure!(c.generations == a.set_acks, "generations: {d}");
        ensure!(c.ack_generation == Some(a.generation), "generation: {d}");
        ensure!(c.window == Some(a.window), "window: {d}");
        ensure!(
            c.in_flight_limit == Some(2 * i64::from(a.window) + 1),
            "limit: {d}"
        );
        ensure!(c.ack_syncs == a.ack_syncs, "ack_syncs: {d}");
        ensure!(c.acks == a.acks_matched, "acks: {d}");
        ensure!(
            c.acks_ignored == a.acks - a.acks_matched,
            "acks_ignored: {d}"
        );
        ensure!(c.ack_surplus == a.ack_surplus, "ack_surplus: {d}");
        // The in-flight count is the peer's, except that it never goes below 0.
        ensure!(
            c.in_flight_now == Some(a.final_count.max(0)),
            "in_flight_now: {d}"
        );
        // The short pairs may close before any sample reads their kernel state.
        if matches!(p.name, "surplus" | "generations") || c.kernel_window.is_some() {
            kernel_state(c, &d)?;
        }
        match p.name {
            "surplus" => {
                // The server's last 600 ms are a wait with nothing sent or read: the kernel
                // state read then is final, and is the peer's.
                let (k, last) = kernel_state(c, &d)?;
                ensure!(last, "no kernel read during the final wait: {k:?}: {d}");
                ensure!(
                    k.messages_sent == p.server.sent.messages
                        && k.set_acks == a.set_acks
                        && k.ack_syncs == a.ack_syncs
                        && k.acks == a.acks_matched
                        && k.acks_ignored == a.acks - a.acks_matched
                        && k.ack_surplus == a.ack_surplus
                        && i64::from(k.count) == a.final_count.max(0)
                        && k.messages_window == a.messages_window
                        && i64::from(k.max) == a.max_count,
                    "kernel state is not the peer's: {k:?}: {d}"
                );
                ensure!(
                    a.ack_surplus == 1 && a.final_count < 0 && a.stalled_timeout,
                    "the peer did not get its surplus ACK and stall: {d}"
                );
                // spice-server's uint32_t wrapped: the peer kept it the same way.
                ensure!(
                    a.messages_window == (a.final_count as i32) as u32,
                    "peer messages_window: {d}"
                );
                ensure!(c.in_flight_max == Some(a.max_count), "max: {d}");
                ensure!(c.stalls == 1, "one stall, for good: {d}");
                let f = c.stalled_fraction.unwrap_or(-1.0);
                ensure!(f > 0.5, "stalled_fraction {f} after a 600 ms wedge: {d}");
                ensure!(c.starts_while_stalled == 0, "starts_while_stalled: {d}");
            }
            "generations" => {
                ensure!(
                    a.set_acks == 2,
                    "the peer sent {} SET_ACKs: {d}",
                    a.set_acks
                );
                ensure!(
                    a.acks > a.acks_matched,
                    "no ACK of generation 1 arrived late: {d}"
                );
                // The maximum is generation 2's, not the connection's.
                ensure!(
                    a.max_count > a.max_count_generation,
                    "generation 1 peaked no higher: {d}"
                );
                ensure!(
                    c.in_flight_max == Some(a.max_count_generation),
                    "in_flight_max is not generation 2's: {d}"
                );
                ensure!(c.starts_while_stalled == 0, "starts_while_stalled: {d}");
                ensure!(c.urgent_pair_peaks == 0, "urgent_pair_peaks: {d}");
            }
            "cursor-105" | "display-105" => {
                // The test's own arithmetic (the peer counts no starts above the gate): with no
                // ACK, the n messages after the SET_ACK start at counts 1..=n (messages
                // already counted); those above 2W broke the gate (the peer ignored it).
                let n = p.server.sent.messages - 1;
                let beyond = n.saturating_sub(2 * u64::from(a.window));
                ensure!(beyond >= 2, "too few messages beyond the window: {d}");
                ensure!(c.in_flight_max == Some(a.max_count), "max: {d}");
                if p.name == "cursor-105" {
                    ensure!(c.channel_type == "cursor", "channel type: {d}");
                    // CURSOR_HIDE excuses nothing.
                    ensure!(
                        c.urgent_pair_peaks == 0 && c.starts_while_stalled == beyond,
                        "cursor 105 treated as an urgent pair: {d}"
                    );
                } else {
                    ensure!(c.channel_type == "display", "channel type: {d}");
                    // INVAL_LIST: the one start at 2W+1 after it is the urgent pair's second.
                    ensure!(
                        c.urgent_pair_peaks == 1 && c.starts_while_stalled == beyond - 1,
                        "display 105 not treated as an urgent pair: {d}"
                    );
                }
            }
            other => bail!("unknown pair {other}"),
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Real session: spice-server and spice-gtk
// ---------------------------------------------------------------------------------------------

/// An X client draws small rectangles on Xspice for 6 s, started right after spice-gtk's
/// process (rig/client.py); spice-gtk stops reading from 2 s to 4.5 s after its start, so the
/// display channel sits at the window, then catches up; the session is idle for the last
/// ~5 s of the observer's 12 s. (The drawing used to start with Xspice, before the observer
/// loaded: a slow load once left the pause with nothing to draw, and max 39 of 41.)
/// spice-server sends one SET_ACK per connection (`push_set_ack` has three callers, each run
/// once per channel client: docs/spice-protocol.md §3.1), spice-gtk never ACKs more than it
/// received (§3.8), so: one generation, no surplus ACK, and floor((messages − 1) / W) ACKs.
#[test]
fn xspice_one_generation_no_surplus() -> Result<()> {
    const T: &str = "xspice_one_generation_no_surplus";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let xorg = rig.xspice(5985, 85, &["--mode", "rects", "--frames", "1"])?;
    let obs = observe_or_skip!(T, &[xorg], 12.0, rig.state.join("report.json"));
    let _client = GtkClient::start(
        "spice://127.0.0.1:5985",
        30,
        &["--pause-at", "2", "--pause-for", "2.5"],
        None,
    )?;
    common::draw(85, &common::rects("6"))?;
    let report = obs.finish_report()?;
    common::check_run(&report)?;
    let mut seen = [0usize; 2];
    for c in report.channels.iter().filter(|c| c.pid == xorg) {
        let k = match c.channel_type.as_str() {
            "display" => 0,
            "cursor" => 1,
            _ => continue,
        };
        seen[k] += 1;
        let d = brief(c);
        let w = c.window.ok_or_else(|| anyhow!("no SET_ACK: {d}"))?;
        ensure!(c.set_acks == 1 && c.generations == 1, "generations: {d}");
        // Open at the end, and idle: the kernel state read then covers every message.
        let (kw, last) = kernel_state(c, &d)?;
        ensure!(
            last,
            "the kernel read at the end missed messages: {kw:?}: {d}"
        );
        ensure!(c.ack_surplus == 0, "surplus ACK from spice-gtk: {d}");
        ensure!(c.acks_ignored == 0, "acks_ignored: {d}");
        ensure!(c.starts_while_stalled == 0, "starts above 2W: {d}");
        let after = c.server_to_client.messages - 1;
        ensure!(
            c.acks == after / u64::from(w),
            "acks {} for {after} messages after SET_ACK, W {w}: {d}",
            c.acks
        );
        let max = c.in_flight_max.ok_or_else(|| anyhow!("no max: {d}"))?;
        let w = i64::from(w);
        if k == 0 {
            ensure!(
                max == 2 * w + 1 || (max == 2 * w + 2 && c.urgent_pair_peaks > 0),
                "display max {max} after a 2.5 s pause: {d}"
            );
            ensure!(c.stalls >= 1, "no stall during the pause: {d}");
        } else {
            ensure!(max <= 2 * w + 1, "cursor max {max}: {d}");
        }
    }
    ensure!(seen == [1, 1], "display and cursor channels seen: {seen:?}");
    Ok(())
}
