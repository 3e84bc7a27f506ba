//! Privileged tests of `spice-observer daemon` against real sessions: Xspice and QEMU as
//! spice-server, spice-gtk clients, a socat relay found by name from the test's config file.
//! Each live scrape is read into typed samples (the `prometheus-parse` crate) and checked by
//! `promtool check metrics`; the daemon's counts are compared with an `observe` run started
//! alongside (a separate program instance with its own kernel programs), and with README's
//! Metrics table; the Grafana dashboard's queries are evaluated by a real Prometheus scraping the
//! daemon. Ports 5975-5979 / 6975-6979, displays :75-:79, daemon on 127.0.0.1:19591,
//! Prometheus on 127.0.0.1:19592.
//! Run serially under the machine-wide lock (`--test-threads=1`).

mod common;

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write,
    path::Path,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use common::daemon::{Daemon, OnDrop, Sample, Scrape, http_get};
use common::{Client, Rig, channels_of, check_run, describe_ch, privileged};
use spice_observer::report::{ChannelReport, Report};

const LISTEN: &str = "127.0.0.1:19591";

/// Starts `spice-observer daemon` with `config` and its own pin directory (`test` names it),
/// and waits for its start line; SIGTERM when dropped, then the pins are removed.
fn start_daemon(config: &Path, test: &str) -> Result<Daemon> {
    let pins = common::PinDir::new(test)?;
    Ok(Daemon::start(config, &pins.path, &[], OnDrop::Terminate)?.with_pins(pins))
}

/// An HTTP/1.0 GET of `path` from the daemon: (status code, body).
fn get(path: &str) -> Result<(u16, String)> {
    http_get(LISTEN, path)
}

/// `promtool check metrics` on a scrape: exit 0 and no lint output.
fn promtool(text: &str) -> Result<()> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running promtool (Debian package prometheus; scripts/setup.sh installs it)")?;
    child.stdin.take().unwrap().write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    common::silent_success(&out, "promtool check metrics")
}

/// The run checks of a scrape (instead of `common::check_run`): the expected hook set and no
/// other, nothing degraded, every information-lost counter 0.
fn check_scrape_run(s: &Scrape) -> Result<()> {
    s.check_run(0.0)?;
    ensure!(s.find("spice_observer_hook_set_info", &[]).len() == 1);
    Ok(())
}

/// Metric names of README's "Metrics" table (rows starting `` | `spice_observer_``).
fn readme_metrics() -> Result<BTreeSet<String>> {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))?;
    let section = readme
        .split("\n## Metrics")
        .nth(1)
        .ok_or_else(|| anyhow!("README has no '## Metrics' section"))?;
    let section = section.split("\n## ").next().unwrap();
    let names: BTreeSet<String> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `spice_observer_"))
        .filter_map(|l| l.split('`').next())
        .map(|n| format!("spice_observer_{n}"))
        .collect();
    ensure!(names.len() > 20, "README Metrics table: only {names:?}");
    Ok(names)
}

fn write_config(rig: &Rig, extra: &str) -> Result<std::path::PathBuf> {
    let path = rig.state.join("spice-observer.toml");
    std::fs::write(
        &path,
        format!(
            "listen = \"{LISTEN}\"\nsample_ms = 100\nscan_ms = 500\nbpf_stats = true\n{extra}\
             [discovery]\nqemu = true\nxspice = true\nrelays = [{{ name = \"socat\" }}]\n"
        ),
    )?;
    Ok(path)
}

/// Directions of a report row's sent and received messages (see the metrics module docs).
fn dirs(c: &ChannelReport) -> Result<(&'static str, &'static str)> {
    match c.end.as_deref() {
        Some("server") => Ok(("server_to_client", "client_to_server")),
        Some("client") => Ok(("client_to_server", "server_to_client")),
        _ => bail!("no end: {}", describe_ch(c)),
    }
}

/// Compares one report row with the daemon's series of (vm, leg): totals bracketed by the two
/// scrapes taken before and after observe's end (the counters only grow), in-flight within ±1
/// plus what moved after observe's end.
fn compare(before: &Scrape, after: &Scrape, c: &ChannelReport, vm: &str, leg: &str) -> Result<u64> {
    let id = c
        .channel_id
        .ok_or_else(|| anyhow!("no channel id: {}", describe_ch(c)))?
        .to_string();
    let l = [
        ("vm", vm),
        ("leg", leg),
        ("channel", c.channel_type.as_str()),
        ("channel_id", id.as_str()),
    ];
    let (sent, recv) = dirs(c)?;
    let mut n = 0;
    // Messages the daemon counted after observe's end, per direction (sent, received).
    let mut later = [0u64; 2];
    for (metric, dir, v) in [
        ("spice_observer_messages_total", sent, c.messages_sent),
        ("spice_observer_messages_total", recv, c.messages_received),
        ("spice_observer_bytes_total", sent, c.bytes_sent),
        ("spice_observer_bytes_total", recv, c.bytes_received),
    ] {
        let mut with = l.to_vec();
        with.push(("direction", dir));
        let a = before.one(metric, &with)?;
        let b = after.one(metric, &with)?;
        ensure!(
            a <= v as f64 && v as f64 <= b,
            "{metric} {with:?}: observe {v}, daemon {a} before and {b} after its end: {}",
            describe_ch(c)
        );
        if metric == "spice_observer_messages_total" {
            later[usize::from(dir == recv)] = b as u64 - v;
        }
        n += 1;
    }
    if let Some(now) = c.in_flight_now {
        // Within ±1 of observe's, widened by what moved after observe's end: each message sent
        // since adds at most 1, each received (an ACK at most) takes at most W.
        let d = after.one("spice_observer_in_flight_now_messages", &l)?;
        let w = u64::from(c.window.unwrap_or(0));
        let (lo, hi) = (
            now as f64 - (w * later[1]) as f64 - 1.0,
            now as f64 + later[0] as f64 + 1.0,
        );
        ensure!(
            lo <= d && d <= hi,
            "in flight: observe {now}, daemon {d} (allowed {lo}..={hi}: {} sent and {} \
             received after observe's end): {}",
            later[0],
            later[1],
            describe_ch(c)
        );
        ensure!(
            after.one("spice_observer_ack_window_messages", &l)? == f64::from(c.window.unwrap()),
            "window"
        );
        for m in [
            "spice_observer_acks_total",
            "spice_observer_window_stalls_total",
        ] {
            after.one(m, &l)?;
        }
        let h = after.find("spice_observer_in_flight_messages_bucket", &l);
        ensure!(h.len() >= 4, "in-flight histogram of {l:?}: {h:?}");
    }
    Ok(n)
}

/// The daemon before two real sessions (Xspice through a socat relay found by name, QEMU
/// directly): both VMs on /metrics under their names with all their channels, totals equal to
/// an `observe` run's over the same period, in-flight within ±1; promtool clean; README's
/// table and the scrape name the same metrics; the Grafana dashboard's metrics on the scrape and
/// its queries answered by a Prometheus scraping the daemon ([`check_dashboard_live`]); a new
/// Xspice picked up within 1 s; the QEMU gone from /metrics once it exits.
#[test]
fn daemon_two_sessions_relay_and_churn() -> Result<()> {
    const T: &str = "daemon_two_sessions_relay_and_churn";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let config = write_config(&rig, "")?;
    let mut daemon = start_daemon(&config, T)?;
    // Scrapes the daemon every second from now on, for the dashboard's queries.
    let prom = Prom::start(&rig.state)?;
    let (code, health) = get("/healthz")?;
    ensure!(
        code == 200 && health.trim() == "ok",
        "/healthz {code} {health}"
    );
    let (code, landing) = get("/")?;
    ensure!(
        code == 200
            && landing.contains("/metrics")
            && landing.contains("/healthz")
            && landing.contains(env!("CARGO_PKG_VERSION"))
            && landing.contains(&common::expected_hook_set()),
        "landing page {code}: {landing}"
    );
    // Draws for 15 s, then idle; QEMU draws 120 frames and idles.
    let xorg = rig.xspice_rects(5975, 75, 15)?;
    let relay = rig.relay("socat", "127.0.0.1", 6975, "127.0.0.1", 5975)?;
    let qemu = rig.qemu(5976, 120)?;
    daemon.wait_found(&[("xspice-75", xorg), ("socat", relay), ("rig-spice", qemu)])?;
    let obs = observe_or_skip!(T, &[xorg, relay, qemu], 16.0, rig.state.join("report.json"));
    let t_obs = Instant::now();
    let _cx = Client::start("spice://127.0.0.1:6975", 60, &[], None)?;
    let _cq = Client::start("spice://127.0.0.1:5976", 60, &[], None)?;
    rig.qemu_wait_done(5976, 60)?;
    // Both animations have ended; observe ends 16 s after its start: one scrape before that
    // end and one after bracket its totals.
    let until = Duration::from_secs(14).saturating_sub(t_obs.elapsed());
    thread::sleep(until);
    let before = Scrape::take(LISTEN)?;
    let report: Report = obs.finish_report()?;
    let after = Scrape::take(LISTEN)?;
    check_run(&report)?;
    check_scrape_run(&after)?;
    promtool(&after.text)?;
    check_dashboard_live(&after, &prom)?;
    println!(
        "scrape: {} families, {} samples",
        after.families.len(),
        after.samples.len()
    );

    // Every spice-server channel of both VMs, and the relay legs of the Xspice chain.
    let mut compared = 0;
    for (pid, vm) in [(xorg, "xspice-75"), (qemu, "rig-spice")] {
        let mine: Vec<&ChannelReport> = report
            .channels
            .iter()
            .filter(|c| c.pid == pid && !c.closed && c.end.as_deref() == Some("server"))
            .collect();
        let types: BTreeSet<&str> = mine.iter().map(|c| c.channel_type.as_str()).collect();
        for ty in ["main", "display", "inputs", "cursor"] {
            ensure!(
                types.contains(ty),
                "{vm}: observe saw no {ty} channel: {types:?}"
            );
        }
        let scraped: BTreeSet<String> = after
            .find(
                "spice_observer_channel_info",
                &[("vm", vm), ("leg", "server")],
            )
            .iter()
            .map(|s| s.labels["channel"].clone())
            .collect();
        let want: BTreeSet<String> = types.iter().map(|t| t.to_string()).collect();
        ensure!(
            scraped == want,
            "{vm}: daemon channels {scraped:?}, observe {want:?}"
        );
        for c in &mine {
            compared += compare(&before, &after, c, vm, "server")?;
            if let Some(ch) = &c.chain
                && vm == "xspice-75"
            {
                for (sock, leg) in [
                    (&ch.backend, "relay_backend"),
                    (&ch.client_leg, "relay_client"),
                ] {
                    let sock = sock
                        .as_ref()
                        .ok_or_else(|| anyhow!("{leg} missing: {}", describe_ch(c)))?;
                    let r = report
                        .channels
                        .iter()
                        .find(|x| &x.socket == sock)
                        .ok_or_else(|| anyhow!("no row for {sock}"))?;
                    compared += compare(&before, &after, r, vm, leg)?;
                }
            }
        }
    }
    let displays = channels_of(&report, qemu, "display");
    ensure!(
        !displays.is_empty() && displays[0].messages_sent > 100,
        "qemu display traffic"
    );
    println!("compared {compared} totals with observe");

    // README's table and the live scrape name the same metrics.
    let readme = readme_metrics()?;
    let scraped: BTreeSet<String> = after.families.keys().cloned().collect();
    let missing: Vec<_> = readme.difference(&scraped).collect();
    let undocumented: Vec<_> = scraped.difference(&readme).collect();
    // Checked at the end, so that the churn checks below run either way.
    let readme_problem = (!missing.is_empty() || !undocumented.is_empty()).then(|| {
        format!(
            "README lists but the scrape lacks {missing:?}; scraped but not in README {undocumented:?}"
        )
    });
    // No pid, port or address outside the _info metrics.
    for s in &after.samples {
        if !s.name.ends_with("_info") {
            for k in s.labels.keys() {
                ensure!(
                    !["pid", "port", "socket", "session_id", "address"].contains(&k.as_str()),
                    "{} has label {k}",
                    s.name
                );
            }
        }
    }

    // A new session is picked up within 1 s of its server process starting.
    daemon.drain_log();
    let xorg2 = rig.xspice(5977, 77, &["--mode", "rects", "--fps", "20"])?;
    let xorg2_start = process_start(xorg2)?;
    let (found, _) = daemon.wait_line_at(
        |l| l.contains("found xspice xspice-77") && l.contains(&format!("pid {xorg2}")),
        Duration::from_secs(5),
    )?;
    let picked = found.saturating_duration_since(xorg2_start);
    println!("xspice-77: found {picked:?} after its Xorg started");
    ensure!(
        picked <= Duration::from_secs(1),
        "xspice-77 picked up {picked:?} after its Xorg started"
    );
    let _c2 = Client::start("spice://127.0.0.1:5977", 60, &[], None)?;
    thread::sleep(Duration::from_secs(3));
    let s = Scrape::take(LISTEN)?;
    let m = s.one(
        "spice_observer_messages_total",
        &[
            ("vm", "xspice-77"),
            ("leg", "server"),
            ("channel", "display"),
            ("direction", "server_to_client"),
        ],
    )?;
    ensure!(m > 10.0, "xspice-77 display messages {m}");

    // The QEMU exits: its series disappear (no stale series), the target count drops.
    let q_before = s.one("spice_observer_targets_discovered", &[("kind", "qemu")])?;
    Command::new(common::rig().join("start-qemu.sh"))
        .args(["stop", "5976"])
        .status()?;
    daemon.wait_line(
        |l| l.contains("lost qemu rig-spice") && l.contains(&format!("pid {qemu}")),
        Duration::from_secs(5),
    )?;
    // One scrape may still show its closed sockets' release; the next must not.
    thread::sleep(Duration::from_millis(600));
    let _ = Scrape::take(LISTEN)?;
    let s = Scrape::take(LISTEN)?;
    let stale: Vec<&Sample> = s
        .samples
        .iter()
        .filter(|x| x.labels.get("vm").map(String::as_str) == Some("rig-spice"))
        .collect();
    ensure!(stale.is_empty(), "series of the exited qemu: {stale:?}");
    ensure!(
        s.one("spice_observer_targets_discovered", &[("kind", "qemu")])? == q_before - 1.0,
        "qemu targets"
    );
    check_scrape_run(&s)?;
    promtool(&s.text)?;
    if let Some(p) = readme_problem {
        bail!("{p}");
    }
    Ok(())
}

/// `--config` naming a missing file is an error, at start, naming the file.
#[test]
fn daemon_missing_config_is_an_error() -> Result<()> {
    let out = Command::new(env!("CARGO_BIN_EXE_spice-observer"))
        .args(["daemon", "--config", "/nonexistent/spice-observer.toml"])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "exit status {}", out.status);
    ensure!(err.contains("/nonexistent/spice-observer.toml"), "{err}");
    Ok(())
}

/// When process `pid` started, as an [`Instant`]: `/proc/PID/stat` field 22 (clock ticks since
/// boot) against `/proc/uptime`, read back to back with `Instant::now()`.
fn process_start(pid: u32) -> Result<Instant> {
    let stat = std::fs::read(format!("/proc/{pid}/stat"))?;
    let st = spice_observer::host::discovery::parse_stat(&stat)
        .ok_or_else(|| anyhow!("bad /proc/{pid}/stat"))?;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")?
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow!("bad /proc/uptime"))?;
    let now = Instant::now();
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let age = (uptime - st.start_time as f64 / tck).max(0.0);
    Ok(now - Duration::from_secs_f64(age))
}

fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| anyhow!("no VmRSS"))
}

/// Five minutes of sessions coming and going (an Xspice and client every 20 s, through socat):
/// the daemon's RSS, sampled every 10 s, shows no upward trend (the last minute's median within
/// 10% + 2 MiB of the second minute's), and its tracked-object counts return to the baseline.
#[test]
#[ignore = "5 minutes; run alone: cargo test --test daemon -- --ignored --test-threads=1"]
fn daemon_memory_flat_over_churn() -> Result<()> {
    const T: &str = "daemon_memory_flat_over_churn";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let config = write_config(&rig, "")?;
    let mut daemon = start_daemon(&config, T)?;
    let relay = rig.relay("socat", "127.0.0.1", 6978, "127.0.0.1", 5978)?;
    let _ = relay;
    thread::sleep(Duration::from_secs(2));
    let base = Scrape::take(LISTEN)?;
    let base_sockets = base.one("spice_observer_sockets_tracked", &[])?;
    let base_chains = base.one("spice_observer_chains_tracked", &[])?;
    let t0 = Instant::now();
    let mut rss = Vec::new();
    let mut peak_sockets = 0f64;
    let mut peak_framed = 0f64;
    let mut round = 0;
    while t0.elapsed() < Duration::from_secs(300) {
        round += 1;
        let run = rig.state.join(format!("churn-{round}"));
        common::sh(
            Command::new(common::rig().join("start-xspice.sh"))
                .env("RIG_RUN", &run)
                .args([
                    "start", "5978", "78", "--", "--mode", "rects", "--fps", "30",
                ]),
        )?;
        // The client connects once the daemon watches the server (else its sockets are
        // attached mid-stream and never framed).
        let xorg = std::fs::read_to_string(run.join("Xorg.pid"))?
            .trim()
            .to_string();
        daemon.wait_line(
            |l| l.contains("found xspice xspice-78") && l.contains(&format!("pid {xorg},")),
            Duration::from_secs(5),
        )?;
        daemon.drain_log();
        {
            let _c = Client::start("spice://127.0.0.1:6978", 15, &[], None)?;
            for _ in 0..2 {
                thread::sleep(Duration::from_secs(5));
                let s = Scrape::take(LISTEN)?;
                peak_sockets = peak_sockets.max(s.one("spice_observer_sockets_tracked", &[])?);
                let framed = s
                    .find(
                        "spice_observer_channel_info",
                        &[
                            ("vm", "xspice-78"),
                            ("channel", "display"),
                            ("framing", "mini"),
                        ],
                    )
                    .len();
                peak_framed = peak_framed.max(framed as f64);
                rss.push(rss_kib(daemon.pid())?);
                thread::sleep(Duration::from_secs(5));
            }
        }
        common::sh(
            Command::new(common::rig().join("start-xspice.sh"))
                .env("RIG_RUN", &run)
                .args(["stop", "5978"]),
        )?;
    }
    thread::sleep(Duration::from_secs(2));
    let _ = Scrape::take(LISTEN)?;
    let end = Scrape::take(LISTEN)?;
    check_scrape_run(&end)?;
    println!("RSS KiB every 10 s: {rss:?}");
    println!(
        "sockets tracked: baseline {base_sockets}, end {}; chains: baseline {base_chains}, end {}; peak {peak_sockets} sockets",
        end.one("spice_observer_sockets_tracked", &[])?,
        end.one("spice_observer_chains_tracked", &[])?
    );
    ensure!(
        peak_sockets >= 8.0,
        "the sessions were not tracked: peak {peak_sockets} sockets"
    );
    ensure!(
        peak_framed >= 1.0,
        "no display channel framed during the churn"
    );
    let median = |v: &[u64]| {
        let mut v = v.to_vec();
        v.sort();
        v[v.len() / 2]
    };
    let n = rss.len();
    ensure!(n >= 24, "{n} RSS samples");
    let early = median(&rss[6..12]);
    let late = median(&rss[n - 6..]);
    ensure!(
        late as f64 <= early as f64 * 1.1 + 2048.0,
        "RSS grew: {early} KiB in minute 2, {late} KiB in the last minute: {rss:?}"
    );
    ensure!(
        end.one("spice_observer_sockets_tracked", &[])? <= base_sockets,
        "sockets tracked {} > baseline {base_sockets}",
        end.one("spice_observer_sockets_tracked", &[])?
    );
    ensure!(end.one("spice_observer_chains_tracked", &[])? <= base_chains);
    Ok(())
}

// --- The Grafana dashboard (packaging/grafana/spice-observer.json) ---

/// Where the test Prometheus listens (next to the daemon's port).
const PROM_LISTEN: &str = "127.0.0.1:19592";

/// The families the dashboard must use: one for each view issue 8 asks for (in flight by stage
/// against 2W+1 with the relay-visible and exact counts; time at the window, stalls, msgs/s,
/// Mbit/s; srtt, retransmits, delivery rate; information lost; the daemon's health).
const DASHBOARD_REQUIRED: &[&str] = &[
    "spice_observer_in_flight_stage_messages",
    "spice_observer_in_flight_limit_messages",
    "spice_observer_in_flight_relay_visible_messages",
    "spice_observer_in_flight_now_messages",
    "spice_observer_in_flight_messages",
    "spice_observer_window_wait_seconds_total",
    "spice_observer_window_stalls_total",
    "spice_observer_messages_total",
    "spice_observer_bytes_total",
    "spice_observer_tcp_srtt_seconds",
    "spice_observer_tcp_retransmits_total",
    "spice_observer_tcp_delivery_rate_bytes_per_second",
    "spice_observer_information_lost_total",
    "spice_observer_records_lost_total",
    "spice_observer_hook_set_info",
    "spice_observer_degraded_features",
    "spice_observer_scrape_duration_seconds",
    "spice_observer_bpf_run_seconds_total",
];

/// One query of the dashboard: a panel target's `expr` or a query variable's query.
#[derive(Debug)]
struct DashQuery {
    /// Panel title and refId, or `variable NAME`.
    place: String,
    text: String,
    /// The target's legendFormat (empty for variables).
    legend: String,
    /// A variable query (`label_values(SELECTOR, LABEL)`), not PromQL.
    variable: bool,
}

fn dashboard() -> Result<serde_json::Value> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/grafana/spice-observer.json");
    let raw = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    serde_json::from_str(&raw).with_context(|| format!("parsing {}", path.display()))
}

/// A string field of a JSON object, or an error naming `what`.
fn jstr<'a>(v: &'a serde_json::Value, key: &str, what: &str) -> Result<&'a str> {
    v.get(key)
        .and_then(|x| x.as_str())
        .ok_or_else(|| anyhow!("{what}: no string {key:?} in {v}"))
}

/// The dashboard's panels, those nested in collapsed rows included.
fn dashboard_panels(d: &serde_json::Value) -> Result<Vec<&serde_json::Value>> {
    let top = d["panels"]
        .as_array()
        .ok_or_else(|| anyhow!("dashboard has no panels array"))?;
    let mut out = Vec::new();
    for p in top {
        out.push(p);
        if let Some(inner) = p.get("panels").and_then(|x| x.as_array()) {
            out.extend(inner);
        }
    }
    Ok(out)
}

/// Every query of the dashboard: each non-row panel's targets' `expr` and each query variable's
/// query (the `query.query` object form of Grafana 10+, or a plain string).
fn dashboard_queries(d: &serde_json::Value) -> Result<Vec<DashQuery>> {
    let mut out = Vec::new();
    for p in dashboard_panels(d)? {
        if p["type"] == "row" {
            continue;
        }
        let title = jstr(p, "title", "panel")?;
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push(DashQuery {
                place: format!("panel {title:?} {}", jstr(t, "refId", title)?),
                text: jstr(t, "expr", title)?.to_string(),
                legend: t["legendFormat"].as_str().unwrap_or("").to_string(),
                variable: false,
            });
        }
    }
    for v in d["templating"]["list"].as_array().into_iter().flatten() {
        if v["type"] != "query" {
            continue;
        }
        let name = jstr(v, "name", "variable")?;
        let q = v["query"]
            .get("query")
            .unwrap_or(&v["query"])
            .as_str()
            .ok_or_else(|| anyhow!("variable {name}: no query"))?;
        out.push(DashQuery {
            place: format!("variable {name}"),
            text: q.to_string(),
            legend: String::new(),
            variable: true,
        });
    }
    Ok(out)
}

/// The metric selectors of a query: each `spice_observer_…` name with the text between the
/// braces that follow it (`None` when no `{` follows). Every metric the daemon exports has that
/// prefix, so this finds every metric name the query uses.
fn dashboard_selectors(q: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut rest = q;
    while let Some(i) = rest.find("spice_observer_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = tail[..end].to_string();
        let after = &tail[end..];
        let (matchers, used) = match after.strip_prefix('{') {
            Some(m) => match m.find('}') {
                Some(j) => (Some(m[..j].to_string()), end + 1 + j + 1),
                None => (None, end),
            },
            None => (None, end),
        };
        out.push((name, matchers));
        rest = &tail[used..];
    }
    out
}

/// The exported family of a sample name: a histogram's `_bucket`, `_sum` and `_count` map to
/// the histogram (per [`METRICS`](spice_observer::output::metrics::METRICS)).
fn dashboard_family(name: &str) -> String {
    use spice_observer::output::metrics::{Kind, def};
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix)
            && def(base).is_some_and(|d| d.kind == Kind::Histogram)
        {
            return base.to_string();
        }
    }
    name.to_string()
}

/// Label matchers of a selector's brace text: (label, operator, value).
fn dashboard_matchers(m: &str) -> Result<Vec<(String, String, String)>> {
    let mut out = Vec::new();
    for part in m.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let at = part
            .find(['=', '!'])
            .ok_or_else(|| anyhow!("no operator in matcher {part:?}"))?;
        let (label, rest) = part.split_at(at);
        let op_len = if rest.starts_with("=~") || rest.starts_with("!=") || rest.starts_with("!~") {
            2
        } else {
            1
        };
        let (op, value) = rest.split_at(op_len);
        let value = value
            .trim()
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .ok_or_else(|| anyhow!("matcher value not quoted: {part:?}"))?;
        out.push((label.trim().to_string(), op.to_string(), value.to_string()));
    }
    Ok(out)
}

/// The dashboard's structure, checked without Prometheus: a current schemaVersion; the
/// datasource a `${datasource}` variable of type prometheus, used by every panel and target;
/// the `vm` variable from `label_values(spice_observer_channel_info…, vm)`, multi-select with
/// All, and a row repeated per VM; every non-row panel with at least one target; every metric
/// in README's Metrics table and METRICS, every selector filtering `instance=~"$instance"`
/// and, for families with a `vm` label, `vm=~"$vm"`; matchers only on the family's labels (or
/// Prometheus's `instance`/`job`); every family of [`DASHBOARD_REQUIRED`] used. Returns the
/// queries.
fn check_dashboard(d: &serde_json::Value) -> Result<Vec<DashQuery>> {
    use spice_observer::output::metrics::def;
    let schema = d["schemaVersion"]
        .as_u64()
        .ok_or_else(|| anyhow!("no schemaVersion"))?;
    ensure!(
        (38..=41).contains(&schema),
        "schemaVersion {schema}: Grafana 10/11 write 38-41"
    );
    let vars = d["templating"]["list"]
        .as_array()
        .ok_or_else(|| anyhow!("no templating.list"))?;
    let var = |name: &str| {
        vars.iter()
            .find(|v| v["name"] == name)
            .ok_or_else(|| anyhow!("no variable {name}"))
    };
    let ds = var("datasource")?;
    ensure!(
        ds["type"] == "datasource" && ds["query"] == "prometheus",
        "datasource variable: {ds}"
    );
    let vm = var("vm")?;
    let vm_q = vm["query"]["query"].as_str().unwrap_or("");
    ensure!(
        vm["type"] == "query"
            && vm_q.starts_with("label_values(spice_observer_channel_info")
            && vm_q.ends_with(", vm)")
            && vm["multi"] == true
            && vm["includeAll"] == true,
        "vm variable: {vm}"
    );
    let uses_var = |v: &serde_json::Value| {
        v["datasource"]["type"] == "prometheus" && v["datasource"]["uid"] == "${datasource}"
    };
    for v in vars.iter().filter(|v| v["type"] == "query") {
        ensure!(uses_var(v), "variable {} datasource: {v}", v["name"]);
    }
    let panels = dashboard_panels(d)?;
    ensure!(
        panels
            .iter()
            .any(|p| p["type"] == "row" && p["repeat"] == "vm"),
        "no row repeated per vm"
    );
    let mut ids = BTreeSet::new();
    for p in &panels {
        let id = p["id"].as_u64().ok_or_else(|| anyhow!("panel id: {p}"))?;
        ensure!(ids.insert(id), "panel id {id} twice");
        ensure!(p["gridPos"]["w"].as_u64().is_some(), "gridPos of {p}");
        if p["type"] == "row" {
            continue;
        }
        let title = jstr(p, "title", "panel")?;
        ensure!(
            uses_var(p),
            "panel {title:?} datasource: {}",
            p["datasource"]
        );
        let targets = p["targets"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        ensure!(!targets.is_empty(), "panel {title:?} has no targets");
        for t in targets {
            ensure!(
                uses_var(t),
                "panel {title:?} target datasource: {}",
                t["datasource"]
            );
        }
    }
    let readme = readme_metrics()?;
    let queries = dashboard_queries(d)?;
    let mut used = BTreeSet::new();
    for q in &queries {
        let sels = dashboard_selectors(&q.text);
        ensure!(
            !sels.is_empty(),
            "{}: no spice_observer metric in {:?}",
            q.place,
            q.text
        );
        for (name, matchers) in sels {
            let fam = dashboard_family(&name);
            ensure!(
                readme.contains(&fam),
                "{}: {name} (family {fam}) is not in README's Metrics table",
                q.place
            );
            let d = def(&fam).ok_or_else(|| anyhow!("{}: {fam} not in METRICS", q.place))?;
            used.insert(fam.clone());
            let m = dashboard_matchers(matchers.as_deref().unwrap_or(""))?;
            let has = |label: &str| {
                m.iter().any(|(l, op, v)| {
                    l == label && (op == "=~" || op == "=") && v == &format!("${label}")
                })
            };
            // The instance variable lists the instances itself.
            ensure!(
                has("instance") || q.place == "variable instance",
                "{}: {name} not filtered by instance=~\"$instance\": {:?}",
                q.place,
                q.text
            );
            // The vm variable lists the VMs itself.
            if d.labels.contains(&"vm") && q.place != "variable vm" {
                ensure!(
                    has("vm"),
                    "{}: {name} not filtered by vm=~\"$vm\": {:?}",
                    q.place,
                    q.text
                );
            }
            for (l, _, _) in &m {
                let known = d.labels.contains(&l.as_str())
                    || (l == "le" && name.ends_with("_bucket"))
                    || ["instance", "job"].contains(&l.as_str());
                ensure!(known, "{}: {name} has no label {l}", q.place);
            }
        }
    }
    let missing: Vec<_> = DASHBOARD_REQUIRED
        .iter()
        .filter(|n| !used.contains(**n))
        .collect();
    ensure!(
        missing.is_empty(),
        "the dashboard does not show {missing:?}"
    );
    Ok(queries)
}

/// The dashboard parses and is well formed, and every metric it uses is in README's Metrics
/// table (no root, no daemon).
#[test]
fn dashboard_json_uses_documented_metrics() -> Result<()> {
    let d = dashboard()?;
    let queries = check_dashboard(&d)?;
    println!("dashboard: {} queries checked", queries.len());
    Ok(())
}

/// A Prometheus server (Debian's `prometheus`, the package that ships promtool) scraping the
/// daemon every second, with its TSDB in the test's state directory; SIGTERM when dropped.
struct Prom {
    child: Child,
    log: std::path::PathBuf,
}

/// A Prometheus HTTP API answer (`status`, `data` or `error`).
#[derive(serde::Deserialize)]
struct PromAnswer<T> {
    status: String,
    data: Option<T>,
    error: Option<String>,
}

#[derive(serde::Deserialize)]
struct PromVector {
    #[serde(rename = "resultType")]
    result_type: String,
    result: Vec<PromSeries>,
}

/// One series of an instant vector: its labels and `[time, "value"]`.
#[derive(serde::Deserialize, Debug)]
struct PromSeries {
    metric: BTreeMap<String, String>,
    value: (f64, String),
}

impl Prom {
    fn start(dir: &Path) -> Result<Prom> {
        let cfg = dir.join("prometheus.yml");
        std::fs::write(
            &cfg,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: spice-observer\n    static_configs:\n      - targets: [\"{LISTEN}\"]\n"
            ),
        )?;
        let log = dir.join("prometheus.log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={PROM_LISTEN}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context(
                "running prometheus (Debian package prometheus; scripts/setup.sh installs it)",
            )?;
        let p = Prom { child, log };
        let t0 = Instant::now();
        loop {
            if let Ok((200, _)) = http_get(PROM_LISTEN, "/-/ready") {
                return Ok(p);
            }
            ensure!(
                t0.elapsed() < Duration::from_secs(30),
                "prometheus not ready within 30 s:\n{}",
                p.log_text()
            );
            thread::sleep(Duration::from_millis(200));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn api<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T> {
        let (code, body) = http_get(PROM_LISTEN, path)?;
        let a: PromAnswer<T> = serde_json::from_str(&body)
            .with_context(|| format!("prometheus {path}: {code} {body}"))?;
        ensure!(
            a.status == "success",
            "prometheus {path}: {code} {:?}",
            a.error
        );
        a.data
            .ok_or_else(|| anyhow!("prometheus {path}: no data: {body}"))
    }

    /// An instant query at the current time.
    fn query(&self, expr: &str) -> Result<Vec<PromSeries>> {
        let v: PromVector = self.api(&format!("/api/v1/query?query={}", enc(expr)))?;
        ensure!(
            v.result_type == "vector",
            "{expr}: result type {}",
            v.result_type
        );
        Ok(v.result)
    }

    /// Grafana's `label_values(SELECTOR, LABEL)`: the label's values over the series matching
    /// SELECTOR in the last hour.
    fn label_values(&self, q: &str) -> Result<BTreeSet<String>> {
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|x| x.strip_suffix(')'))
            .ok_or_else(|| anyhow!("not label_values(…): {q}"))?;
        let (sel, label) = inner
            .rsplit_once(',')
            .ok_or_else(|| anyhow!("label_values without a label: {q}"))?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs_f64();
        let v: Vec<String> = self.api(&format!(
            "/api/v1/label/{}/values?match[]={}&start={}&end={now}",
            label.trim(),
            enc(sel.trim()),
            now - 3600.0
        ))?;
        Ok(v.into_iter().collect())
    }
}

impl Drop for Prom {
    fn drop(&mut self) {
        common::terminate(&mut self.child);
    }
}

/// A query parameter, percent-encoded.
fn enc(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// The dashboard's variables as Grafana would fill them in one repeated row: `vm` one VM,
/// `channel_id` display channel 0, `instance` the daemon's scrape target, `$__rate_interval`
/// 10 s (10 of the test Prometheus's scrapes).
fn interpolate(q: &str, vm: &str) -> Result<String> {
    let s = q
        .replace("$__rate_interval", "10s")
        .replace("$channel_id", "0")
        .replace("$instance", LISTEN)
        .replace("$vm", vm);
    ensure!(!s.contains('$'), "variable left in {s:?}");
    Ok(s)
}

/// The dashboard against a live session. By name: every metric name any query uses is a
/// sample name of the scrape (histogram `_bucket`/`_sum`/`_count` lines included) and its
/// family a `# TYPE` of the scrape. By query: a real Prometheus that scraped the daemon all
/// along evaluates every panel query with the variables of the relayed Xspice's row
/// (`xspice-75`) and of the direct QEMU's (`rig-spice`): each must return series, except
/// the relay-visible count, which exists only for relayed chains and must be empty for the
/// QEMU. The per-leg panels must show all three legs of the relayed chain, the in-flight
/// panel stages of both. The `vm` variable must list both VMs, `instance` the daemon,
/// `channel_id` display channel 0.
fn check_dashboard_live(scrape: &Scrape, prom: &Prom) -> Result<()> {
    let queries = check_dashboard(&dashboard()?)?;
    let sample_names: BTreeSet<&str> = scrape
        .text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let mut names = BTreeSet::new();
    for q in &queries {
        for (name, _) in dashboard_selectors(&q.text) {
            ensure!(
                sample_names.contains(name.as_str()),
                "{}: {name} is not on the live scrape",
                q.place
            );
            let fam = dashboard_family(&name);
            ensure!(
                scrape.families.contains_key(&fam),
                "{}: family {fam} has no # TYPE on the live scrape",
                q.place
            );
            names.insert(name);
        }
    }
    println!(
        "dashboard: {} metric names, all on the live scrape",
        names.len()
    );
    let up = prom.query(&format!("up{{instance=\"{LISTEN}\"}}"))?;
    ensure!(
        up.len() == 1 && up[0].value.1 == "1",
        "prometheus scrape of the daemon: {up:?}\n{}",
        prom.log_text()
    );
    let mut evaluated = 0;
    for q in queries.iter().filter(|q| !q.variable) {
        for vm in ["xspice-75", "rig-spice"] {
            let expr = interpolate(&q.text, vm)?;
            let r = prom.query(&expr)?;
            let relay_only = q
                .text
                .contains("spice_observer_in_flight_relay_visible_messages");
            if relay_only && vm == "rig-spice" {
                ensure!(
                    r.is_empty(),
                    "{}: relay-visible count for the unrelayed QEMU: {r:?}",
                    q.place
                );
                continue;
            }
            ensure!(!r.is_empty(), "{} for {vm}: no series from {expr}", q.place);
            for s in &r {
                s.value
                    .1
                    .parse::<f64>()
                    .with_context(|| format!("{}: value {:?}", q.place, s.value.1))?;
                if let Some(v) = s.metric.get("vm") {
                    ensure!(v == vm, "{}: series of vm {v} in {vm}'s row", q.place);
                }
            }
            let legs: BTreeSet<&str> = r
                .iter()
                .filter_map(|s| s.metric.get("leg").map(String::as_str))
                .collect();
            if q.legend.contains("{{leg}}") && !q.text.contains("leg=") && vm == "xspice-75" {
                for leg in ["server", "relay_backend", "relay_client"] {
                    ensure!(
                        legs.contains(leg),
                        "{} for {vm}: no leg {leg}: {r:?}",
                        q.place
                    );
                }
            }
            if q.legend == "{{stage}}" {
                ensure!(r.len() >= 4, "{} for {vm}: stages {r:?}", q.place);
            }
            evaluated += 1;
        }
    }
    let var_q = |name: &str| -> Result<String> {
        let q = queries
            .iter()
            .find(|q| q.place == format!("variable {name}"))
            .ok_or_else(|| anyhow!("no variable {name}"))?;
        Ok(q.text.clone())
    };
    let vms = prom.label_values(&interpolate(&var_q("vm")?, ".*")?)?;
    ensure!(
        vms.contains("xspice-75") && vms.contains("rig-spice"),
        "vm variable: {vms:?}"
    );
    let inst = prom.label_values(&var_q("instance")?)?;
    ensure!(inst.contains(LISTEN), "instance variable: {inst:?}");
    for vm in ["xspice-75", "rig-spice"] {
        let ids = prom.label_values(&interpolate(&var_q("channel_id")?, vm)?)?;
        ensure!(ids.contains("0"), "channel_id variable for {vm}: {ids:?}");
    }
    println!(
        "dashboard: {evaluated} panel queries returned series on Prometheus; variables vm {vms:?}"
    );
    Ok(())
}
