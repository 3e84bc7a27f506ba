//! Privileged test of `observe --pid` beside a running daemon (README "Restarts and pinned
//! state"): a real Xspice session through socat with a spice-gtk client, a daemon watching
//! it on its own pin directory (`common::PinDir`), and an `observe --pin-dir` started 10 s
//! into the session. The observe reads the daemon's pinned programs and maps (its own ring,
//! `TAP_EVENTS`): its totals must equal a packet capture of the session from its start, the
//! daemon's must too (observe took none of its records), and no second copy of the programs
//! may be loaded. Scrapes of /metrics are read into typed samples (`prometheus-parse`); the
//! capture is framed by this test's own SPICE parser (`tests/common/oracle.rs` for the
//! server → client messages, [`oracle::c2s_messages`] for the client's), which shares no code
//! with the observer.
//!
//! Port 5991 (relay 6991), display :91, daemon on 127.0.0.1:19597. Run under the machine-wide
//! lock (`--test-threads=1`).

mod common;

use std::{
    path::Path,
    process::{Command, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use common::daemon::{self, Daemon, OnDrop, Scrape};
use common::{Client, PinDir, Rig, oracle, peer, privileged};
use spice_ebpf_common::config::watch;
use spice_observer::{loader, report::Report};

const LISTEN: &str = "127.0.0.1:19597";
const PORT: u16 = 5991;
const RELAY_PORT: u16 = 6991;

/// A message whose header the capture saw within this many seconds of a reading's time may
/// be counted by that reading or not (the send-to-capture and capture-to-read latencies).
const SLACK: f64 = 0.05;

/// Starts `daemon --config CONFIG --pin-dir PINS` (on [`LISTEN`]); waits for its listening
/// line. SIGKILLed if still running when dropped.
fn start_daemon(config: &Path, pins: &Path) -> Result<Daemon> {
    Daemon::start(
        config,
        pins,
        &[("RUST_LOG", "warn,spice_observer=info")],
        OnDrop::Kill,
    )
}

/// The pids in the `pid` label of `spice_observer_channel_info` (the one metric that names
/// pids).
fn channel_pids(s: &Scrape) -> Vec<u32> {
    s.find("spice_observer_channel_info", &[])
        .iter()
        .filter_map(|x| x.labels.get("pid")?.parse().ok())
        .collect()
}

fn write_config(rig: &Rig) -> Result<std::path::PathBuf> {
    let path = rig.state.join("spice-observer.toml");
    std::fs::write(
        &path,
        format!(
            "listen = \"{LISTEN}\"\nsample_ms = 100\nscan_ms = 500\nbpf_stats = false\n\
             [discovery]\nqemu = false\nxspice = true\nrelays = [{{ name = \"socat\" }}]\n"
        ),
    )?;
    Ok(path)
}

/// `observe --pid PID --pin-dir PINS --duration SECS --json JSON --no-progress`, run to its end.
fn observe(pid: u32, pins: &Path, secs: u32, json: &Path) -> Result<Output> {
    observe_pids(&[pid], pins, secs, json)
}

/// [`observe`] of several processes.
fn observe_pids(pids: &[u32], pins: &Path, secs: u32, json: &Path) -> Result<Output> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_spice-observer"));
    cmd.arg("observe");
    for p in pids {
        cmd.args(["--pid", &p.to_string()]);
    }
    cmd.arg("--pin-dir")
        .arg(pins)
        .args(["--duration", &secs.to_string(), "--no-progress", "--json"])
        .arg(json)
        .stdin(Stdio::null())
        .output()
        .context("running spice-observer observe")
}

/// Echoes an observe's stderr as `observer! LINE`; an error with it if the observe failed.
fn observe_succeeded(out: &Output) -> Result<()> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    for l in stderr.lines() {
        eprintln!("observer! {l}");
    }
    ensure!(
        out.status.success(),
        "observe failed ({}):\n{stderr}",
        out.status
    );
    Ok(())
}

/// The `WATCHED_TGIDS` entries of the set pinned at `pins` that carry [`watch::TAP`].
fn tap_entries(pins: &Path) -> Result<Vec<(u32, u32)>> {
    Ok(watch_entries(pins)?
        .into_iter()
        .filter(|(_, v)| v & watch::TAP != 0)
        .collect())
}

/// Every `WATCHED_TGIDS` entry (tgid, value) of the set pinned at `pins`.
fn watch_entries(pins: &Path) -> Result<Vec<(u32, u32)>> {
    match loader::Capture::open_pinned(pins, loader::HookChoice::Auto)? {
        loader::Pinned::Reusable(mut cap) => cap.watch_entries(),
        _ => bail!("no usable pinned set at {}", pins.display()),
    }
}

fn epoch() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The daemon watches a session from its start; `observe --pid <Xorg> --pin-dir` started 10 s
/// in (duration 5 s) reads its pinned state: its first line says so, it loads no second copy
/// of the programs (`bpftool prog show` lists the daemon's `spice_` programs once, as before
/// it started), a second observe at the same time is refused, and its per-channel message and
/// byte totals at its end, both directions of spice-server's sockets, equal the capture's of
/// the session from its start up to its end (messages captured within ±50 ms of its end may
/// go either way). After it exits, no `TAP` flag is left, and the daemon's totals on
/// spice-server's socket and the relay's two legs, scraped once the session is idle, still
/// equal the capture's, with nothing lost.
#[test]
fn observe_beside_daemon_reads_pinned_state() -> Result<()> {
    const T: &str = "observe_beside_daemon_reads_pinned_state";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let pins = PinDir::new(T)?;
    let config = write_config(&rig)?;
    let vm = "xspice-91";
    let mut d = start_daemon(&config, &pins.path)?;
    let mut cap = oracle::Capture::start(rig.state.join("server.pcapng"), None, "lo", &[PORT])?;
    // Animation until 14 s after Xspice's start: traffic while observe starts, idle at its
    // end (≈ 15 s after the client's start).
    let xorg = rig.xspice_rects(PORT, 91, 14)?;
    let relay = rig.relay("socat", "127.0.0.1", RELAY_PORT, "127.0.0.1", PORT)?;
    d.wait_found(&[(vm, xorg), ("socat", relay)])?;
    let t0 = Instant::now();
    let _client = Client::start(&format!("spice://127.0.0.1:{RELAY_PORT}"), 60, &[], None)?;
    let programs_before = common::spice_programs()?;
    ensure!(
        !programs_before.is_empty(),
        "no spice_ program with the daemon running"
    );

    thread::sleep(Duration::from_secs(10).saturating_sub(t0.elapsed()));
    let json = rig.state.join("observe.json");
    let (pins_a, json_a) = (pins.path.clone(), json.clone());
    let first = thread::spawn(move || observe(xorg, &pins_a, 5, &json_a));
    // While it runs: one set of programs, and a second observe is refused.
    thread::sleep(Duration::from_secs(2));
    let programs_during = common::spice_programs()?;
    let second = observe(xorg, &pins.path, 1, &rig.state.join("second.json"))?;
    let out = first
        .join()
        .map_err(|_| anyhow!("observe thread panicked"))??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    observe_succeeded(&out)?;
    let second_err = String::from_utf8_lossy(&second.stderr);
    println!("second observe ({}): {}", second.status, second_err.trim());
    ensure!(
        !second.status.success()
            && second_err.contains("another spice-observer observe is already reading"),
        "a second observe beside the daemon was not refused: {} {second_err}",
        second.status
    );
    println!("programs before observe: {programs_before:?}, during: {programs_during:?}");
    ensure!(
        programs_during == programs_before,
        "observe changed the loaded programs: before {programs_before:?}, during {programs_during:?}"
    );
    let mut dedup = programs_during.clone();
    dedup.dedup();
    ensure!(
        dedup == programs_during,
        "more than one set of spice_ programs: {programs_during:?}"
    );
    let first_line = stdout.lines().next().unwrap_or_default();
    println!("observe's first line: {first_line}");
    ensure!(
        first_line.contains(&format!(
            "reading the daemon's pinned state at {}",
            pins.path.display()
        )) && first_line.contains("counts exact from each session's start"),
        "observe's first line: {first_line:?}"
    );
    let raw: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
    let rep: Report = common::parse_report(&raw)?;
    common::check_run(&rep)?;
    ensure!(
        rep.source.kind == "pinned"
            && rep.source.tap
            && rep.source.exact_from_session_start
            && rep.source.pin_dir.as_deref() == Some(&*pins.path.to_string_lossy()),
        "source: {:?}",
        rep.source
    );
    let observe_start = rep.clock.realtime_ns as f64 / 1e9;
    let observe_end = observe_start + rep.duration_s;
    let left = tap_entries(&pins.path)?;
    ensure!(left.is_empty(), "TAP flags left after observe: {left:?}");

    // The daemon's view once the session is idle (the animation ended at 14 s).
    thread::sleep(Duration::from_secs(19).saturating_sub(t0.elapsed()));
    let t_a = epoch();
    let scrape = Scrape::take(LISTEN)?;
    let t_b = epoch();
    scrape.check_run(0.0)?;
    let totals = scrape.vm_totals(vm);
    thread::sleep(Duration::from_secs(1));
    cap.stop()?;
    let conns = oracle::parse_capture(&cap.path)?;

    let mut compared = 0;
    let mut wrong = Vec::new();
    for c in &conns {
        let ty = oracle::type_name(c.channel_type);
        let id = c.channel_id.to_string();
        println!(
            "capture: {ty} {id} {} -> {}: {} server messages",
            c.conn.c2s.src,
            c.conn.c2s.dst,
            c.messages.len()
        );
        // observe: spice-server's socket of this channel.
        let ch: Vec<_> = rep
            .channels
            .iter()
            .filter(|x| x.pid == xorg && x.channel_type == ty && x.channel_id == Some(c.channel_id))
            .collect();
        ensure!(
            ch.len() == 1,
            "observe has {} sockets of {ty} {id}: {:?}",
            ch.len(),
            ch.iter()
                .map(|x| common::describe_ch(x))
                .collect::<Vec<_>>()
        );
        let ch = ch[0];
        if ty == "display" {
            // Traffic while observe ran: counts it read from its own ring, not only the
            // socket map's at its start.
            let (at_start, at_end) = (
                oracle::captured_by(c, observe_start + SLACK)?.0.0,
                oracle::captured_by(c, observe_end - SLACK)?.0.0,
            );
            println!("display messages captured while observe ran: {at_start} → {at_end}");
            ensure!(
                at_end > at_start + 100,
                "too little display traffic while observe ran: {at_start} → {at_end}"
            );
        }
        let (lo, hi) = (
            oracle::captured_by(c, observe_end - SLACK)?,
            oracle::captured_by(c, observe_end + SLACK)?,
        );
        for (what, got, lo, hi) in [
            ("messages sent", ch.messages_sent, lo.0.0, hi.0.0),
            ("bytes sent", ch.bytes_sent, lo.0.1, hi.0.1),
            ("messages received", ch.messages_received, lo.1.0, hi.1.0),
            ("bytes received", ch.bytes_received, lo.1.1, hi.1.1),
        ] {
            let line = format!("observe {ty} {id} {what}: {got}, capture {lo}..={hi}");
            println!("{line}");
            if got < lo || got > hi {
                wrong.push(line);
            }
            compared += 1;
        }
        // The daemon: spice-server's socket and the relay's two legs, up to the scrape.
        let window = (
            oracle::captured_by(c, t_a - SLACK)?,
            oracle::captured_by(c, t_b + SLACK)?,
        );
        compared += daemon::compare_totals(&totals, c, window, &mut wrong)?;
    }
    ensure!(
        wrong.is_empty(),
        "differences from the capture:\n{}",
        wrong.join("\n")
    );
    ensure!(
        conns
            .iter()
            .any(|c| c.channel_type == 2 && c.messages.len() > 100),
        "display traffic in the capture"
    );
    ensure!(compared >= 64, "compared {compared} totals");
    d.stop(libc::SIGTERM)?;
    Ok(())
}

/// A scripted SPICE server (`spice-peer`, which the daemon's discovery does not find) and a
/// `sleep` process, watched by an observe beside the daemon: their entries carry `TAP` only
/// (never `PRIMARY`), the observe's counts of the peer's session equal what the peers' own
/// syscalls moved (their `SUMMARY`), and the daemon never shows them: not before, and not
/// after a restart on its pins in the middle of the session (its rebuild from the socket map
/// leaves out sockets created for the observe only). After the observe, no entry of either
/// process is left (the `sleep` still runs), and the daemon lost nothing.
#[test]
fn observe_beside_daemon_of_an_unwatched_process() -> Result<()> {
    const T: &str = "observe_beside_daemon_of_an_unwatched_process";
    if !privileged(T) {
        return Ok(());
    }
    let rig = Rig::new(T)?;
    let pins = PinDir::new(T)?;
    let config = write_config(&rig)?;
    let d = start_daemon(&config, &pins.path)?;
    // About 4 s of messages (400, one write each 10 ms) once the client is let go.
    let mut server = peer::Server::start(&["--messages", "400", "--pause-ms", "10"])?;
    let mut client = peer::Client::gated(server.port, &[])?;
    let mut sleeper = Command::new("sleep").arg("60").spawn()?;
    let (spid, cpid, zpid) = (server.pid(), client.pid(), sleeper.id());
    let json = rig.state.join("observe.json");
    let (pins_a, json_a) = (pins.path.clone(), json.clone());
    let obs = thread::spawn(move || observe_pids(&[spid, zpid], &pins_a, 7, &json_a));
    // Attached once both entries carry TAP.
    let t = Instant::now();
    let entries = loop {
        let e = tap_entries(&pins.path)?;
        if [spid, zpid].iter().all(|p| e.iter().any(|(k, _)| k == p)) {
            break e;
        }
        ensure!(
            t.elapsed() < Duration::from_secs(20),
            "observe did not set TAP on {spid} and {zpid}: {e:?}"
        );
        thread::sleep(Duration::from_millis(50));
    };
    println!("TAP entries: {entries:x?}");
    for (k, v) in &entries {
        ensure!(
            v & watch::PRIMARY == 0,
            "observe's entry of {k} has PRIMARY: {v:#x}"
        );
    }
    client.go()?;
    thread::sleep(Duration::from_millis(1500));
    let before = Scrape::take(LISTEN)?;
    before.check_run(0.0)?;
    d.stop(libc::SIGTERM)?;
    let mut d = start_daemon(&config, &pins.path)?;
    d.wait_line(
        |l| l.contains("continuing the kernel state"),
        Duration::ZERO,
    )?;
    let after = Scrape::take(LISTEN)?;
    after.check_run(0.0)?;
    for (when, s) in [
        ("before its restart", &before),
        ("after its restart", &after),
    ] {
        let pids = channel_pids(s);
        ensure!(
            !pids.contains(&spid) && !pids.contains(&cpid),
            "the daemon shows the peers {spid}/{cpid} {when}: channel pids {pids:?}"
        );
    }
    let s = server.summary("server")?;
    let c = client.summary("client")?;
    let out = obs
        .join()
        .map_err(|_| anyhow!("observe thread panicked"))??;
    observe_succeeded(&out)?;
    let raw: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
    let rep: Report = common::parse_report(&raw)?;
    common::check_run(&rep)?;
    ensure!(rep.source.tap, "source: {:?}", rep.source);
    let ch: Vec<_> = rep.channels.iter().filter(|x| x.pid == spid).collect();
    ensure!(
        ch.len() == 1,
        "observe has {} sockets of the peer server",
        ch.len()
    );
    let ch = ch[0];
    println!("observe: {}", common::describe_ch(ch));
    for (what, got, want) in [
        ("messages sent", ch.messages_sent, s.sent.messages),
        ("bytes sent", ch.bytes_sent, s.sent.data_bytes),
        (
            "messages received",
            ch.messages_received,
            s.received.messages,
        ),
        ("bytes received", ch.bytes_received, s.received.data_bytes),
        (
            "client's messages received",
            ch.messages_sent,
            c.received.messages,
        ),
    ] {
        println!("{what}: observe {got}, peer {want}");
        ensure!(got == want, "{what}: observe {got}, peer {want}");
    }
    ensure!(s.sent.messages == 400, "peer sent {}", s.sent.messages);
    let left: Vec<(u32, u32)> = watch_entries(&pins.path)?
        .into_iter()
        .filter(|(k, v)| [spid, zpid].contains(k) || v & watch::TAP != 0)
        .collect();
    ensure!(
        sleeper.try_wait()?.is_none(),
        "sleep exited: its entry would be gone anyway"
    );
    ensure!(left.is_empty(), "entries left after observe: {left:x?}");
    let end = Scrape::take(LISTEN)?;
    end.check_run(0.0)?;
    let pids = channel_pids(&end);
    ensure!(
        !pids.contains(&spid) && !pids.contains(&cpid),
        "the daemon shows the peers at the end: {pids:?}"
    );
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    d.stop(libc::SIGTERM)?;
    Ok(())
}
