//! Privileged tests of relay pairing and the per-stage split of spice-server's in-flight
//! messages, on real sessions: Xspice (spice-server) with an animating X client, a real
//! spice-gtk client (in its own network namespace behind a shaped link where the scenario
//! needs one), and a real relay (socat or haproxy). Each test prints its report table, so the
//! run log holds the measured numbers of every scenario.

mod common;

use anyhow::{Result, anyhow, ensure};
use common::{Client, Rig, channels, describe, privileged, u};
use serde_json::Value;

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn display(report: &Value, pid: u32) -> Result<&Value> {
    let d = channels(report, pid, "display");
    ensure!(
        d.len() == 1,
        "expected one display channel of pid {pid}, got {}",
        d.len()
    );
    Ok(d[0])
}

fn stage(c: &Value, name: &str, what: &str) -> u64 {
    u(&c["stages"][name][what])
}

/// Every channel of spice-server is paired with exactly one relay leg toward it and one toward
/// the client, all distinct, carrying equal counts; the report names the pairing.
fn check_pairing(report: &Value, server: u32, relay_kind: &str) -> Result<()> {
    let all = report["channels"].as_array().unwrap();
    let ours: Vec<&Value> = all
        .iter()
        .filter(|c| c["pid"] == server && c["end"] == "server")
        .collect();
    ensure!(
        ours.len() >= 4,
        "main, display, inputs, cursor expected, got {}",
        ours.len()
    );
    let mut legs = std::collections::HashSet::new();
    for c in ours {
        let ch = &c["chain"];
        let d = describe(c);
        let backend = ch["backend"]
            .as_str()
            .ok_or_else(|| anyhow!("no backend leg: {d}\n{ch}"))?;
        let client_leg = ch["client_leg"]
            .as_str()
            .ok_or_else(|| anyhow!("no client leg: {d}\n{ch}"))?;
        ensure!(
            legs.insert(backend.to_string()) && legs.insert(client_leg.to_string()),
            "a relay leg paired twice: {d}"
        );
        ensure!(
            ch["transparency"] == "transparent",
            "{relay_kind} should be byte-transparent: {d}\n{ch}"
        );
        ensure!(
            !ch["pairing"].as_array().unwrap().is_empty(),
            "pairing not explained: {d}"
        );
        // The legs exist in the report, belong to the relay, and carry the same counts.
        let find = |sock: &str| all.iter().find(|x| x["socket"] == sock);
        let b = find(backend).ok_or_else(|| anyhow!("backend {backend} not in report"))?;
        let cl =
            find(client_leg).ok_or_else(|| anyhow!("client leg {client_leg} not in report"))?;
        ensure!(
            b["pid"] == ch["relay_pid"] && cl["pid"] == ch["relay_pid"],
            "legs of different processes: {d}"
        );
        ensure!(
            b["comm"] == relay_kind && cl["comm"] == relay_kind,
            "legs not owned by {relay_kind}: {d}"
        );
        ensure!(
            b["end"] == "client" && cl["end"] == "server",
            "leg roles: {d}"
        );
        ensure!(
            cl["channel_type"] == c["channel_type"] && cl["channel_id"] == c["channel_id"],
            "channel identity: {d}"
        );
        ensure!(
            c["messages_sent"] == b["messages_received"]
                && c["messages_sent"] == cl["messages_sent"],
            "server→client counts differ along the chain: {d} / {} / {}",
            describe(b),
            describe(cl)
        );
    }
    Ok(())
}

fn check_clean(report: &Value) -> Result<()> {
    ensure!(
        u(&report["events_lost"]) == 0,
        "events lost: {}",
        report["kernel_counters"]
    );
    Ok(())
}

/// Checks common to every stage scenario on the display chain.
fn check_stages(c: &Value) -> Result<()> {
    let ch = &c["chain"];
    let d = describe(c);
    ensure!(
        u(&ch["kept_short_samples"]) == 0,
        "in-flight messages counted but not kept: {d}\n{ch}"
    );
    // Positions out of the data path's order (read at different instants): at most ~2% of
    // the samples in the runs measured so far.
    ensure!(
        u(&ch["clamped_samples"]).saturating_mul(10) <= u(&ch["samples_placed"]),
        "stage boundaries clamped at more than 10% of the samples: {d}\n{ch}"
    );
    ensure!(
        u(&ch["samples_placed"]) >= 20,
        "too few placed samples: {d}\n{ch}"
    );
    ensure!(
        u(&ch["relay_above_true_samples"]) == 0,
        "relay-visible above the true count: {d}\n{ch}"
    );
    Ok(())
}

#[test]
fn pairing_through_socat() -> Result<()> {
    const T: &str = "pairing_through_socat";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let xorg = rig.xspice(
        5951,
        51,
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
    let relay = rig.relay("socat", "127.0.0.1", 6951, "127.0.0.1", 5951)?;
    let obs = observe_or_skip!(T, &[xorg, relay], 9.0, rig.state.join("report.json"));
    let _client = Client::start("spice://127.0.0.1:6951", 30, &[], None)?;
    let report = obs.finish()?;
    check_clean(&report)?;
    check_pairing(&report, xorg, "socat")
}

/// haproxy: one process holds every leg; the client connects from another network namespace.
#[test]
fn pairing_through_haproxy_from_another_netns() -> Result<()> {
    const T: &str = "pairing_through_haproxy_from_another_netns";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let xorg = rig.xspice(
        5952,
        52,
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
    rig.shaped_link(&["veth"], None)?;
    let relay = rig.relay("haproxy", "198.18.0.1", 6952, "127.0.0.1", 5952)?;
    let obs = observe_or_skip!(T, &[xorg, relay], 9.0, rig.state.join("report.json"));
    let _client = Client::start("spice://198.18.0.1:6952", 30, &[], Some("rigc"))?;
    let report = obs.finish()?;
    check_clean(&report)?;
    check_pairing(&report, xorg, "haproxy")
}

/// Large incompressible draws and a client that stops reading for 8 s, with a small receive
/// buffer in the client's namespace: the backlog climbs back up the chain into the relay's
/// queues and qemu's (here Xorg's) send queue; the relay sees fewer in flight than there are.
#[test]
fn paused_client_backlog_reaches_spice_server() -> Result<()> {
    const T: &str = "paused_client_backlog_reaches_spice_server";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let xorg = rig.xspice(
        5953,
        53,
        &["--mode", "noise", "--fps", "20", "--size", "256x192"],
    )?;
    rig.shaped_link(&["veth"], None)?;
    rig.shape(&["rmem", "4096 65536 262144"])?;
    let relay = rig.relay("socat", "198.18.0.1", 6953, "127.0.0.1", 5953)?;
    let obs = observe_or_skip!(T, &[xorg, relay], 16.0, rig.state.join("report.json"));
    let _client = Client::start(
        "spice://198.18.0.1:6953",
        40,
        &["--pause-at", "4", "--pause-for", "8"],
        Some("rigc"),
    )?;
    let report = obs.finish()?;
    check_clean(&report)?;
    let c = display(&report, xorg)?;
    check_stages(c)?;
    let d = describe(c);
    ensure!(
        stage(c, "server_notsent", "max") >= 1,
        "nothing ever waited in spice-server's send queue: {d}\n{}",
        c["stages"]
    );
    ensure!(
        stage(c, "proxy_recv_queue", "max") + stage(c, "proxy_notsent", "max") >= 1,
        "nothing ever waited in the relay's queues: {d}\n{}",
        c["stages"]
    );
    ensure!(
        f(&c["chain"]["relay_below_true_fraction"]) > 0.2,
        "relay-visible not below the true count: {}",
        c["chain"]
    );
    ensure!(
        c["in_flight_relay_max"].as_i64() <= c["in_flight_max"].as_i64(),
        "relay max above true max: {d}"
    );
    Ok(())
}

/// 8 Mbit/s link, draws of ~55 kB at 30 fps (more than the link carries), 2 MiB relay receive
/// buffer: the seed's "link binds" regime. spice-server sits at 2W+1 most of the run while the
/// relay sees fewer; the difference is the messages the relay has not read yet.
#[test]
fn link_binds_at_8_mbit_with_55k_draws() -> Result<()> {
    const T: &str = "link_binds_at_8_mbit_with_55k_draws";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let xorg = rig.xspice(
        5954,
        54,
        &["--mode", "noise", "--fps", "30", "--size", "128x96"],
    )?;
    rig.shaped_link(&["veth"], Some("8mbit"))?;
    let relay = rig.relay_env(
        "socat",
        "198.18.0.1",
        6954,
        "127.0.0.1",
        5954,
        &[("RIG_RELAY_RCVBUF", "2097152")],
    )?;
    let svg = rig.state.join("stages.svg");
    let obs = observe_or_skip!(
        T,
        &[xorg, relay],
        20.0,
        rig.state.join("report.json"),
        &["--plot", svg.to_str().unwrap()]
    );
    let _client = Client::start("spice://198.18.0.1:6954", 40, &[], Some("rigc"))?;
    let report = obs.finish()?;
    check_clean(&report)?;
    let c = display(&report, xorg)?;
    check_stages(c)?;
    let d = describe(c);
    ensure!(c["window"] == 40, "W: {d}");
    let mean = f(&c["server_to_client"]["mean_message_bytes"]);
    ensure!(
        (35_000.0..75_000.0).contains(&mean),
        "draws of ~55 kB expected, mean {mean}: {d}"
    );
    ensure!(
        f(&c["stalled_fraction"]) >= 0.5,
        "not at 2W+1 most of the run: {d} {}",
        c["stalled_fraction"]
    );
    ensure!(
        c["in_flight_relay_p50"].as_i64() < c["in_flight_p50"].as_i64(),
        "relay-visible p50 {} not below true p50 {}",
        c["in_flight_relay_p50"],
        c["in_flight_p50"]
    );
    ensure!(
        f(&c["chain"]["relay_gap_upstream_fraction"]) >= 0.8,
        "the relay's blind spot is not in spice-server's queue and the relay's receive queue: {}",
        c["chain"]
    );
    let v = c["verdict"].as_str().unwrap_or("");
    ensure!(v.starts_with("link bound"), "verdict: {v}");
    // The picture: well-formed SVG with the channel and every stage named.
    let text = std::fs::read_to_string(&svg)?;
    let doc = roxmltree::Document::parse(&text)?;
    let texts: String = doc
        .descendants()
        .filter_map(|n| n.text())
        .collect::<Vec<_>>()
        .join("\n");
    ensure!(texts.contains("display 0"), "SVG lacks the channel title");
    for s in [
        "server_notsent",
        "proxy_recv_queue",
        "client_owes_ack",
        "2W+1 = 81",
    ] {
        ensure!(texts.contains(s), "SVG lacks {s}");
    }
    ensure!(
        doc.descendants()
            .filter(|n| n.has_tag_name("polygon"))
            .count()
            >= 8,
        "SVG lacks the stacked stages"
    );
    Ok(())
}

/// The same link with ~200 KB draws: the send buffers fill before the window does. The relay's
/// socket buffers are capped at 256 KiB so that the backlog sits in spice-server's send queue:
/// with autotuned relay buffers the relay alone can hold 20+ of these draws, and whether the
/// count then touches 2W+1 varies from run to run (seen once in CI: 81).
#[test]
fn big_draws_fill_send_buffers_before_the_window() -> Result<()> {
    const T: &str = "big_draws_fill_send_buffers_before_the_window";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let xorg = rig.xspice(
        5955,
        55,
        &["--mode", "noise", "--fps", "20", "--size", "256x192"],
    )?;
    rig.shaped_link(&["veth"], Some("8mbit"))?;
    let relay = rig.relay_env(
        "socat",
        "198.18.0.1",
        6955,
        "127.0.0.1",
        5955,
        &[
            ("RIG_RELAY_RCVBUF", "262144"),
            ("RIG_RELAY_SNDBUF", "262144"),
        ],
    )?;
    let obs = observe_or_skip!(T, &[xorg, relay], 20.0, rig.state.join("report.json"));
    let _client = Client::start("spice://198.18.0.1:6955", 40, &[], Some("rigc"))?;
    let report = obs.finish()?;
    check_clean(&report)?;
    let c = display(&report, xorg)?;
    check_stages(c)?;
    let d = describe(c);
    let mean = f(&c["server_to_client"]["mean_message_bytes"]);
    ensure!(
        mean > 150_000.0,
        "draws of ~200 KB expected, mean {mean}: {d}"
    );
    let limit = c["in_flight_limit"].as_i64().unwrap_or(0);
    ensure!(
        c["in_flight_max"].as_i64().unwrap_or(limit) <= limit - 6,
        "the count reached the window: {d}"
    );
    ensure!(
        stage(c, "server_notsent", "p50") >= 5,
        "spice-server's send queue not the backlog: {}",
        c["stages"]
    );
    let v = c["verdict"].as_str().unwrap_or("");
    ensure!(
        v.starts_with("send-buffer bound") || v.starts_with("link bound"),
        "verdict: {v}"
    );
    Ok(())
}

/// Unshaped loopback: neither the window nor the link binds.
#[test]
fn unshaped_link_binds_nothing() -> Result<()> {
    const T: &str = "unshaped_link_binds_nothing";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let xorg = rig.xspice(
        5956,
        56,
        &["--mode", "noise", "--fps", "20", "--size", "256x192"],
    )?;
    let relay = rig.relay("socat", "127.0.0.1", 6956, "127.0.0.1", 5956)?;
    let obs = observe_or_skip!(T, &[xorg, relay], 10.0, rig.state.join("report.json"));
    let _client = Client::start("spice://127.0.0.1:6956", 30, &[], None)?;
    let report = obs.finish()?;
    check_clean(&report)?;
    let c = display(&report, xorg)?;
    check_stages(c)?;
    ensure!(
        f(&c["stalled_fraction"]) < 0.05,
        "stalled on an unshaped link: {}",
        describe(c)
    );
    ensure!(
        f(&c["server_to_client"]["mbit_per_s"]) > 10.0,
        "the animation did not flow: {}",
        describe(c)
    );
    let v = c["verdict"].as_str().unwrap_or("");
    ensure!(v.starts_with("neither"), "verdict: {v}");
    Ok(())
}

/// 20 ms + 20 ms delay (user-space delay line) and 8 Mbit/s: spice-server picks W = 40, and with
/// many small draws the window binds.
#[test]
fn delayed_link_window_binds_small_messages() -> Result<()> {
    const T: &str = "delayed_link_window_binds_small_messages";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let xorg = rig.xspice(
        5957,
        57,
        &["--mode", "rects", "--fps", "100", "--count", "40"],
    )?;
    rig.shaped_link(&["tun", "20", "20"], Some("8mbit"))?;
    let relay = rig.relay("socat", "198.18.0.1", 6957, "127.0.0.1", 5957)?;
    let obs = observe_or_skip!(T, &[xorg, relay], 15.0, rig.state.join("report.json"));
    let _client = Client::start("spice://198.18.0.1:6957", 40, &[], Some("rigc"))?;
    let report = obs.finish()?;
    check_clean(&report)?;
    let c = display(&report, xorg)?;
    check_stages(c)?;
    let d = describe(c);
    ensure!(c["window"] == 40, "W: {d}");
    let v = c["verdict"].as_str().unwrap_or("");
    ensure!(v.starts_with("ACK-window bound"), "verdict: {v}");
    let (ceiling, measured) = (
        f(&c["window_ceiling_msgs_per_s"]),
        f(&c["server_to_client"]["messages_per_s"]),
    );
    eprintln!(
        "window ceiling {ceiling:.0} msgs/s, measured {measured:.0} msgs/s ({:+.0}%)",
        (ceiling / measured - 1.0) * 100.0
    );
    ensure!(
        ceiling.is_finite() && measured > 0.0,
        "ceiling not computed: {d}"
    );
    Ok(())
}

/// A relay that inserts a message toward the client: detected, reported, and the split then
/// places only the stages up to the relay's receive queue. Channels it leaves alone stay
/// transparent.
#[test]
fn non_transparent_relay_is_detected() -> Result<()> {
    const T: &str = "non_transparent_relay_is_detected";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let xorg = rig.xspice(
        5958,
        58,
        &["--mode", "rects", "--fps", "50", "--count", "20"],
    )?;
    let relay = rig.mangle_relay(6958, 5958)?;
    let obs = observe_or_skip!(T, &[xorg, relay], 8.0, rig.state.join("report.json"));
    let _client = Client::start("spice://127.0.0.1:6958", 30, &[], None)?;
    let report = obs.finish()?;
    check_clean(&report)?;
    let c = display(&report, xorg)?;
    let ch = &c["chain"];
    ensure!(ch["client_leg"].is_string(), "client leg not paired: {ch}");
    ensure!(
        ch["transparency"] == "changed",
        "insertion not detected: {ch}"
    );
    let detail = ch["transparency_detail"].as_str().unwrap_or("");
    ensure!(
        detail.contains("server_to_client") && detail.contains("type 102"),
        "detail: {detail}"
    );
    let placeable: Vec<&str> = ch["placeable_stages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    ensure!(
        placeable
            == [
                "server_writing",
                "server_notsent",
                "server_unacked",
                "proxy_recv_queue"
            ],
        "placeable: {placeable:?}"
    );
    ensure!(
        c["stages"].get("client_owes_ack").is_none(),
        "client-side stages reported: {}",
        c["stages"]
    );
    ensure!(
        u(&ch["unplaced_max"]) > 0 && u(&ch["kept_short_samples"]) == 0,
        "unplaced messages not counted: {ch}"
    );
    let cursor = &channels(&report, xorg, "cursor")[0];
    ensure!(
        cursor["chain"]["transparency"] != "changed",
        "cursor untouched but flagged: {}",
        cursor["chain"]
    );
    Ok(())
}
