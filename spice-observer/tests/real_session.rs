//! Privileged tests against real SPICE sessions: Xspice (Debian's xserver-xspice, i.e.
//! spice-server inside Xorg) or QEMU as spice-server, a headless spice-gtk client, and a socat
//! relay, observed by the real `spice-observer` binary attached before the client connects.
//! Run serially (`--test-threads=1`); each test uses its own ports and display.

mod common;

use std::{thread, time::Duration};

use anyhow::{Result, ensure};
use common::{Client, Rig, by_local, channels, describe, privileged, remote, u};
use serde_json::Value;

/// Checks every display and cursor channel of the processes `pids` (spice-server, or the
/// relay's children carrying them): framing mini, one SET_ACK with window `w`, one ACK_SYNC
/// echoing its generation, and one ACK per `w` server messages after the SET_ACK (the session
/// is idle, so no ACK is owed).
fn check_windows(report: &Value, pids: &[u32], w: u64) -> Result<()> {
    for ty in ["display", "cursor"] {
        let chans: Vec<&Value> = pids.iter().flat_map(|&p| channels(report, p, ty)).collect();
        ensure!(
            !chans.is_empty(),
            "no {ty} channel observed for pids {pids:?}"
        );
        for c in chans {
            let d = describe(c);
            ensure!(c["framing"] == "mini", "framing: {d}");
            ensure!(u(&c["set_acks"]) == 1, "set_acks: {d}");
            ensure!(u(&c["window"]) == w, "window: {d}");
            ensure!(u(&c["ack_syncs"]) == 1, "ack_syncs: {d}");
            ensure!(
                c["ack_sync_generation"] == c["ack_generation"],
                "ACK_SYNC generation: {d}"
            );
            ensure!(u(&c["acks_ignored"]) == 0, "acks_ignored: {d}");
            let after = u(&c["server_to_client"]["messages"]) - 1;
            ensure!(
                u(&c["acks"]) == after / w,
                "acks {} for {after} messages after SET_ACK, W {w}: {d}",
                c["acks"]
            );
            ensure!(u(&c["starts_while_stalled"]) == 0, "starts above 2W: {d}");
        }
    }
    Ok(())
}

/// Children the relay forked during the run (socat: one per connection).
fn relay_children(report: &Value, relay: u32) -> Vec<u32> {
    report["forked"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["parent"] == relay)
        .map(|f| u(&f["child"]) as u32)
        .collect()
}

/// For every channel of spice-server (`pid`), finds the socat child's two legs and checks the
/// counts are equal on all three sockets, both ways. Returns how many channels were checked.
fn check_relay_counts(report: &Value, pid: u32) -> Result<usize> {
    let all = report["channels"].as_array().unwrap();
    let mut checked = 0;
    for s in all
        .iter()
        .filter(|c| c["pid"] == pid && c["end"] == "server")
    {
        let leg_to_server = by_local(report, &remote(s))
            .ok_or_else(|| anyhow::anyhow!("no relay leg for {}", describe(s)))?;
        let relay_pid = &leg_to_server["pid"];
        let legs: Vec<&Value> = all
            .iter()
            .filter(|c| &c["pid"] == relay_pid && c["socket"] != leg_to_server["socket"])
            .collect();
        ensure!(
            legs.len() == 1,
            "socat child {relay_pid} should have exactly one other socket, has {}",
            legs.len()
        );
        let to_client = legs[0];
        for (a, b, what) in [
            (
                &s["messages_sent"],
                &leg_to_server["messages_received"],
                "server wrote / relay read",
            ),
            (
                &s["messages_sent"],
                &to_client["messages_sent"],
                "server wrote / relay wrote to client",
            ),
            (
                &s["messages_received"],
                &leg_to_server["messages_sent"],
                "server read / relay wrote",
            ),
            (
                &s["messages_received"],
                &to_client["messages_received"],
                "server read / relay read from client",
            ),
            (
                &s["bytes_sent"],
                &to_client["bytes_sent"],
                "bytes server wrote / relay wrote to client",
            ),
        ] {
            ensure!(
                a == b,
                "{what}: {a} != {b}\n  {}\n  {}\n  {}",
                describe(s),
                describe(leg_to_server),
                describe(to_client)
            );
        }
        ensure!(
            leg_to_server["end"] == "client" && to_client["end"] == "server",
            "relay leg roles"
        );
        ensure!(
            to_client["channel_type"] == s["channel_type"],
            "channel type through the relay"
        );
        checked += 1;
    }
    Ok(checked)
}

fn check_clean(report: &Value) -> Result<()> {
    ensure!(
        u(&report["events_lost"]) == 0,
        "events lost: {}",
        report["kernel_counters"]
    );
    for c in report["channels"].as_array().unwrap() {
        ensure!(
            c["framing"] != "unparsed",
            "unexpected unparsed channel: {} {}",
            describe(c),
            c["unparsed_detail"]
        );
    }
    Ok(())
}

#[test]
fn xspice_session_through_socat() -> Result<()> {
    const T: &str = "xspice_session_through_socat";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    // Many small draws for 6 s, then idle.
    let xorg = rig.xspice(
        5941,
        41,
        &[
            "--mode",
            "rects",
            "--fps",
            "50",
            "--count",
            "20",
            "--seconds",
            "6",
        ],
    )?;
    let relay = rig.relay("socat", "127.0.0.1", 6941, "127.0.0.1", 5941)?;
    let obs = observe_or_skip!(T, &[xorg, relay], 10.0, rig.state.join("report.json"));
    let _client = Client::start("spice://127.0.0.1:6941", 30, &[], None)?;
    let report = obs.finish()?;
    check_clean(&report)?;
    check_windows(&report, &[xorg], 20)?;
    let kids = relay_children(&report, relay);
    ensure!(
        kids.len() >= 4,
        "expected one socat child per channel, got {kids:?}"
    );
    check_windows(&report, &kids, 20)?;
    let n = check_relay_counts(&report, xorg)?;
    ensure!(
        n >= 4,
        "main, display, inputs and cursor expected, checked {n}"
    );
    let display = &channels(&report, xorg, "display")[0];
    ensure!(
        u(&display["server_to_client"]["messages"]) > 1000,
        "too few draws: {}",
        describe(display)
    );
    Ok(())
}

/// The client stops reading for 6 s while small draws stream: spice-server's count must stop
/// at exactly 2W+1 (2W+2 only after an urgent pair), and no message may start above 2W.
fn stalled_max(report: &Value, pid: u32, w: i64) -> Result<()> {
    let d = channels(report, pid, "display");
    ensure!(d.len() == 1, "one display channel expected");
    let c = d[0];
    let desc = describe(c);
    ensure!(c["window"].as_i64() == Some(w), "W: {desc}");
    let max = c["in_flight_max"].as_i64().unwrap_or(-1);
    let urgent = u(&c["urgent_pair_peaks"]);
    ensure!(
        max == 2 * w + 1 || (max == 2 * w + 2 && urgent > 0),
        "in-flight max {max} (urgent pair peaks {urgent}): {desc}"
    );
    ensure!(
        u(&c["starts_while_stalled"]) == 0,
        "a message started above 2W: {desc}"
    );
    ensure!(u(&c["stalls"]) >= 1, "no stall: {desc}");
    let f = c["stalled_fraction"].as_f64().unwrap_or(0.0);
    ensure!(
        f > 0.25,
        "stalled fraction {f} too small for a 6 s pause: {desc}"
    );
    Ok(())
}

#[test]
fn stalled_client_peaks_at_2w_plus_1() -> Result<()> {
    const T: &str = "stalled_client_peaks_at_2w_plus_1";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let xorg = rig.xspice(
        5942,
        42,
        &["--mode", "rects", "--fps", "50", "--count", "20"],
    )?;
    let relay = rig.relay("socat", "127.0.0.1", 6942, "127.0.0.1", 5942)?;
    let obs = observe_or_skip!(T, &[xorg, relay], 12.0, rig.state.join("report.json"));
    let _client = Client::start(
        "spice://127.0.0.1:6942",
        30,
        &["--pause-at", "3", "--pause-for", "6"],
        None,
    )?;
    let report = obs.finish()?;
    check_clean(&report)?;
    stalled_max(&report, xorg, 20)
}

#[test]
fn slow_link_gets_window_40() -> Result<()> {
    const T: &str = "slow_link_gets_window_40";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let xorg = rig.xspice(
        5943,
        43,
        &["--mode", "rects", "--fps", "50", "--count", "20"],
    )?;
    rig.shaped_link(&["veth"], Some("8mbit"))?;
    let relay = rig.relay("socat", "198.18.0.1", 6943, "127.0.0.1", 5943)?;
    let obs = observe_or_skip!(T, &[xorg, relay], 14.0, rig.state.join("report.json"));
    let _client = Client::start(
        "spice://198.18.0.1:6943",
        30,
        &["--pause-at", "4", "--pause-for", "6"],
        Some("rigc"),
    )?;
    let report = obs.finish()?;
    check_clean(&report)?;
    for ty in ["display", "cursor"] {
        for c in channels(&report, xorg, ty) {
            ensure!(
                c["window"] == 40,
                "spice-server judged the 8 Mbit/s link fast: {}",
                describe(c)
            );
            ensure!(u(&c["set_acks"]) == 1, "{}", describe(c));
        }
    }
    stalled_max(&report, xorg, 40)
}

#[test]
fn qemu_session_through_socat() -> Result<()> {
    const T: &str = "qemu_session_through_socat";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    // The guest draws 150 frames (≈10 s under TCG) from boot, then stops.
    let qemu = rig.qemu(5946, 150)?;
    let relay = rig.relay("socat", "127.0.0.1", 6946, "127.0.0.1", 5946)?;
    let obs = observe_or_skip!(T, &[qemu, relay], 20.0, rig.state.join("report.json"));
    let _client = Client::start("spice://127.0.0.1:6946", 40, &[], None)?;
    rig.qemu_wait_done(5946, 60)?;
    thread::sleep(Duration::from_secs(1));
    let report = obs.finish()?;
    check_clean(&report)?;
    check_windows(&report, &[qemu], 20)?;
    check_windows(&report, &relay_children(&report, relay), 20)?;
    let n = check_relay_counts(&report, qemu)?;
    ensure!(
        n >= 4,
        "main, display, inputs and cursor expected, checked {n}"
    );
    let display = &channels(&report, qemu, "display")[0];
    ensure!(
        u(&display["server_to_client"]["messages"]) > 100,
        "too few draws: {}",
        describe(display)
    );
    Ok(())
}

/// Connections opened before the observer started are listed with their TCP state and marked
/// `attached_mid_stream`: never misread mid-stream (a busy display socket's first traced write
/// must not be taken for the start of a stream).
#[test]
fn existing_connections_are_listed_not_framed() -> Result<()> {
    const T: &str = "existing_connections_are_listed_not_framed";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let xorg = rig.xspice(
        5947,
        47,
        &["--mode", "rects", "--fps", "50", "--count", "20"],
    )?;
    let relay = rig.relay("socat", "127.0.0.1", 6947, "127.0.0.1", 5947)?;
    let _client = Client::start("spice://127.0.0.1:6947", 30, &[], None)?;
    thread::sleep(Duration::from_secs(3));
    let obs = observe_or_skip!(T, &[xorg, relay], 2.0, rig.state.join("report.json"));
    let report = obs.finish()?;
    ensure!(
        u(&report["events_lost"]) == 0,
        "events lost: {}",
        report["kernel_counters"]
    );
    let all = report["channels"].as_array().unwrap();
    ensure!(
        all.len() == 12,
        "4 channels × (spice-server + 2 relay legs) expected, got {}",
        all.len()
    );
    for c in all {
        ensure!(
            c["framing"] == "unparsed" && c["unparsed_reason"] == "attached_mid_stream",
            "{} {}",
            describe(c),
            c["unparsed_reason"]
        );
        ensure!(
            u(&c["messages_sent"]) == 0 && u(&c["messages_received"]) == 0,
            "framed mid-stream: {}",
            describe(c)
        );
        ensure!(
            c["tcp"]["srtt_us"].as_u64().is_some(),
            "no TCP state: {}",
            describe(c)
        );
    }
    Ok(())
}
