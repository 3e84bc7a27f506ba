//! Privileged tests against real SPICE sessions: Xspice (Debian's xserver-xspice, i.e.
//! spice-server inside Xorg) or QEMU as spice-server, a headless spice-gtk client, and a socat
//! relay, observed by the real `spice-observer` binary attached before the client connects.
//! Run serially (`--test-threads=1`); each test uses its own ports and display.

mod common;

use std::{thread, time::Duration};

use anyhow::{Context, Result, anyhow, ensure};
use common::{
    Client, Rig, by_local_of, channels_of, check_run, describe_ch, privileged, remote_of,
};
use spice_observer::report::{ChannelReport, Report};

/// Checks every display and cursor channel of the processes `pids` (spice-server, or the
/// relay's children carrying them): framing mini, one SET_ACK with window `w`, one ACK_SYNC
/// echoing its generation, and one ACK per `w` server messages after the SET_ACK (the session
/// is idle, so no ACK is owed).
fn check_windows(report: &Report, pids: &[u32], w: u32) -> Result<()> {
    for ty in ["display", "cursor"] {
        let chans: Vec<&ChannelReport> = pids
            .iter()
            .flat_map(|&p| channels_of(report, p, ty))
            .collect();
        ensure!(
            !chans.is_empty(),
            "no {ty} channel observed for pids {pids:?}"
        );
        for c in chans {
            let d = describe_ch(c);
            ensure!(c.framing == "mini", "framing: {d}");
            ensure!(c.set_acks == 1, "set_acks: {d}");
            ensure!(c.window == Some(w), "window: {d}");
            ensure!(c.ack_syncs == 1, "ack_syncs: {d}");
            ensure!(
                c.ack_sync_generation.is_some() && c.ack_sync_generation == c.ack_generation,
                "ACK_SYNC generation {:?}, SET_ACK generation {:?}: {d}",
                c.ack_sync_generation,
                c.ack_generation
            );
            ensure!(c.acks_ignored == 0, "acks_ignored: {d}");
            let after = c
                .server_to_client
                .messages
                .checked_sub(1)
                .with_context(|| format!("no server message (not even SET_ACK): {d}"))?;
            ensure!(
                c.acks == after / w as u64,
                "acks {} for {after} messages after SET_ACK, W {w}: {d}",
                c.acks
            );
            ensure!(c.starts_while_stalled == 0, "starts above 2W: {d}");
        }
    }
    Ok(())
}

/// Children the relay forked during the run (socat: one per connection).
fn relay_children(report: &Report, relay: u32) -> Vec<u32> {
    report
        .forked
        .iter()
        .filter(|f| f.parent == relay)
        .map(|f| f.child)
        .collect()
}

/// For every channel of spice-server (`pid`), finds the socat child's two legs and checks the
/// counts are equal on all three sockets, both ways. Returns how many channels were checked.
fn check_relay_counts(report: &Report, pid: u32) -> Result<usize> {
    let all = &report.channels;
    let mut checked = 0;
    for s in all
        .iter()
        .filter(|c| c.pid == pid && c.end.as_deref() == Some("server"))
    {
        let leg_to_server = by_local_of(report, remote_of(s)?)
            .ok_or_else(|| anyhow!("no relay leg for {}", describe_ch(s)))?;
        let relay_pid = leg_to_server.pid;
        let legs: Vec<&ChannelReport> = all
            .iter()
            .filter(|c| c.pid == relay_pid && c.socket != leg_to_server.socket)
            .collect();
        ensure!(
            legs.len() == 1,
            "socat child {relay_pid} should have exactly one other socket, has {}",
            legs.len()
        );
        let to_client = legs[0];
        for (a, b, what) in [
            (
                s.messages_sent,
                leg_to_server.messages_received,
                "server wrote / relay read",
            ),
            (
                s.messages_sent,
                to_client.messages_sent,
                "server wrote / relay wrote to client",
            ),
            (
                s.messages_received,
                leg_to_server.messages_sent,
                "server read / relay wrote",
            ),
            (
                s.messages_received,
                to_client.messages_received,
                "server read / relay read from client",
            ),
            (
                s.bytes_sent,
                to_client.bytes_sent,
                "bytes server wrote / relay wrote to client",
            ),
        ] {
            ensure!(
                a == b,
                "{what}: {a} != {b}\n  {}\n  {}\n  {}",
                describe_ch(s),
                describe_ch(leg_to_server),
                describe_ch(to_client)
            );
        }
        ensure!(
            leg_to_server.end.as_deref() == Some("client")
                && to_client.end.as_deref() == Some("server"),
            "relay leg roles: {} / {}",
            describe_ch(leg_to_server),
            describe_ch(to_client)
        );
        ensure!(
            to_client.channel_type == s.channel_type,
            "channel type through the relay"
        );
        checked += 1;
    }
    Ok(checked)
}

/// [`check_run`] (hook set, nothing degraded, nothing lost), and no channel unparsed.
fn check_clean(report: &Report) -> Result<()> {
    check_run(report)?;
    for c in &report.channels {
        ensure!(
            c.framing != "unparsed",
            "unexpected unparsed channel: {} {:?}",
            describe_ch(c),
            c.unparsed_detail
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
    let xorg = rig.xspice_rects(5941, 41, 6)?;
    let relay = rig.relay("socat", "127.0.0.1", 6941, "127.0.0.1", 5941)?;
    let obs = observe_or_skip!(T, &[xorg, relay], 10.0, rig.state.join("report.json"));
    let _client = Client::start("spice://127.0.0.1:6941", 30, &[], None)?;
    let report = obs.finish_report()?;
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
    let display = channels_of(&report, xorg, "display")[0];
    ensure!(
        display.server_to_client.messages > 1000,
        "too few draws: {}",
        describe_ch(display)
    );
    Ok(())
}

/// The client stops reading for 6 s while small draws stream: spice-server's count must stop
/// at exactly 2W+1 (2W+2 only after an urgent pair), and no message may start above 2W.
fn stalled_max(report: &Report, pid: u32, w: u32) -> Result<()> {
    let d = channels_of(report, pid, "display");
    ensure!(
        d.len() == 1,
        "one display channel expected, got {}",
        d.len()
    );
    let c = d[0];
    let desc = describe_ch(c);
    ensure!(c.window == Some(w), "W: {desc}");
    let w = w as i64;
    let max = c
        .in_flight_max
        .with_context(|| format!("in_flight_max missing: {desc}"))?;
    let urgent = c.urgent_pair_peaks;
    ensure!(
        max == 2 * w + 1 || (max == 2 * w + 2 && urgent > 0),
        "in-flight max {max} (urgent pair peaks {urgent}): {desc}"
    );
    ensure!(
        c.starts_while_stalled == 0,
        "a message started above 2W: {desc}"
    );
    ensure!(c.stalls >= 1, "no stall: {desc}");
    let f = c
        .stalled_fraction
        .with_context(|| format!("stalled_fraction missing: {desc}"))?;
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
    let report = obs.finish_report()?;
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
    let report = obs.finish_report()?;
    check_clean(&report)?;
    for ty in ["display", "cursor"] {
        for c in channels_of(&report, xorg, ty) {
            ensure!(
                c.window == Some(40),
                "spice-server judged the 8 Mbit/s link fast: {}",
                describe_ch(c)
            );
            ensure!(c.set_acks == 1, "{}", describe_ch(c));
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
    let report = obs.finish_report()?;
    check_clean(&report)?;
    check_windows(&report, &[qemu], 20)?;
    check_windows(&report, &relay_children(&report, relay), 20)?;
    let n = check_relay_counts(&report, qemu)?;
    ensure!(
        n >= 4,
        "main, display, inputs and cursor expected, checked {n}"
    );
    let display = channels_of(&report, qemu, "display")[0];
    ensure!(
        display.server_to_client.messages > 100,
        "too few draws: {}",
        describe_ch(display)
    );
    Ok(())
}

/// Connections opened before the observer started are joined mid-stream: every direction
/// hunts (`sync_*` reason `attached_mid_stream`, never `unparsed`) and carries its TCP state;
/// the busy display socket and both its relay legs lock and count only display server
/// messages from there. Exact counts against a reference observer: tests/joined.rs.
#[test]
fn existing_connections_are_joined_mid_stream() -> Result<()> {
    const T: &str = "existing_connections_are_joined_mid_stream";
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
    let report = obs.finish_report()?;
    check_run(&report)?;
    let all = &report.channels;
    ensure!(
        all.len() == 12,
        "4 channels × (spice-server + 2 relay legs) expected, got {}",
        all.len()
    );
    for c in all {
        ensure!(c.framing != "unparsed", "unparsed: {}", describe_ch(c));
        for (what, sync) in [("sent", &c.sync_sent), ("received", &c.sync_received)] {
            let sync = sync
                .as_ref()
                .with_context(|| format!("no sync_{what}: {}", describe_ch(c)))?;
            ensure!(
                sync.reason == "attached_mid_stream",
                "sync_{what} {sync:?}: {}",
                describe_ch(c)
            );
        }
        ensure!(c.tcp.is_some(), "no TCP state: {}", describe_ch(c));
    }
    // The display stream (about 1000 draws/s) locks on spice-server's socket and both relay
    // legs; what it counts are display server messages only.
    let busy: Vec<_> = all
        .iter()
        .filter(|c| c.server_to_client.messages > 0)
        .collect();
    ensure!(
        busy.len() == 3,
        "the display socket and its two relay legs should lock, got {}",
        busy.len()
    );
    for c in busy {
        let s2c_types = if c.end.as_deref() == Some("server") {
            &c.messages_sent_by_type
        } else {
            &c.messages_received_by_type
        };
        for t in s2c_types.keys() {
            let t: u16 = t.parse()?;
            ensure!(
                spice_ebpf_common::protocol::s2c_type_channels(t)
                    & spice_ebpf_common::protocol::channel_bit(
                        spice_ebpf_common::protocol::channel::DISPLAY
                    )
                    != 0,
                "type {t} is no display server message: {}",
                describe_ch(c)
            );
        }
    }
    Ok(())
}
