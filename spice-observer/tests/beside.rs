//! Privileged test of `observe --pid` beside a running daemon (README "Restarts and pinned
//! state"): a real Xspice session through socat with a spice-gtk client, a daemon watching
//! it on its own pin directory (`common::PinDir`), and an `observe --pin-dir` started 10 s
//! into the session. The observe reads the daemon's pinned programs and maps (its own ring,
//! `TAP_EVENTS`): its totals must equal a packet capture of the session from its start, the
//! daemon's must too (observe took none of its records), and no second copy of the programs
//! may be loaded. Scrapes of /metrics are read into typed samples (`prometheus-parse`); the
//! capture is framed by this test's own SPICE parser (`tests/common/oracle.rs` for the
//! server → client messages, [`c2s_messages`] here for the client's), which shares no code
//! with the observer.
//!
//! Port 5991 (relay 6991), display :91, daemon on 127.0.0.1:19597. Run under the machine-wide
//! lock (`--test-threads=1`).

mod common;

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    path::Path,
    process::{Child, Command, Output, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use common::{Client, PinDir, Rig, oracle, peer, privileged};
use spice_ebpf_common::config::watch;
use spice_observer::{loader, report::Report};

const LISTEN: &str = "127.0.0.1:19597";
const PORT: u16 = 5991;
const RELAY_PORT: u16 = 6991;

/// A message whose header the capture saw within this many seconds of a reading's time may
/// be counted by that reading or not (the send-to-capture and capture-to-read latencies).
const SLACK: f64 = 0.05;

/// A running daemon on [`LISTEN`]; SIGKILLed if still running when dropped.
struct Daemon {
    child: Child,
    log: mpsc::Receiver<String>,
    lines: Vec<String>,
}

impl Daemon {
    /// Starts `daemon --config CONFIG --pin-dir PINS`; waits for its listening line.
    fn start(config: &Path, pins: &Path) -> Result<Daemon> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_spice-observer"))
            .args(["daemon", "--config"])
            .arg(config)
            .arg("--pin-dir")
            .arg(pins)
            .env("RUST_LOG", "warn,spice_observer=info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting spice-observer daemon")?;
        let (tx, rx) = mpsc::channel();
        let err = child.stderr.take().unwrap();
        thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("daemon! {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut d = Daemon {
            child,
            log: rx,
            lines: Vec::new(),
        };
        d.wait_line(
            |l| l.contains("listening on http://"),
            Duration::from_secs(60),
        )?;
        Ok(d)
    }

    /// Waits for a log line matching `f` (also among the lines read so far).
    fn wait_line(&mut self, f: impl Fn(&str) -> bool, timeout: Duration) -> Result<String> {
        if let Some(l) = self.lines.iter().find(|l| f(l)) {
            return Ok(l.clone());
        }
        let t0 = Instant::now();
        while t0.elapsed() < timeout {
            match self.log.recv_timeout(Duration::from_millis(20)) {
                Ok(line) => {
                    self.lines.push(line.clone());
                    if f(&line) {
                        return Ok(line);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    bail!("daemon exited:\n{}", self.lines.join("\n"))
                }
            }
        }
        bail!(
            "no such line within {timeout:?}:\n{}",
            self.lines.join("\n")
        )
    }

    /// SIGTERM, and waits for the exit.
    fn stop(mut self) -> Result<()> {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            thread::sleep(Duration::from_millis(20));
        }
        bail!("daemon did not exit within 10 s of SIGTERM")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// (metric, leg, channel, channel_id, direction) of a message or byte total.
type Key = (String, String, String, String, String);

/// A parsed `/metrics` scrape: (metric name, labels, value) of every sample.
struct Scrape {
    samples: Vec<(String, BTreeMap<String, String>, f64)>,
}

impl Scrape {
    fn take() -> Result<Scrape> {
        let mut s = TcpStream::connect(LISTEN).with_context(|| format!("connecting {LISTEN}"))?;
        s.set_read_timeout(Some(Duration::from_secs(15)))?;
        write!(s, "GET /metrics HTTP/1.0\r\nHost: {LISTEN}\r\n\r\n")?;
        let mut raw = String::new();
        s.read_to_string(&mut raw)?;
        let (head, body) = raw
            .split_once("\r\n\r\n")
            .ok_or_else(|| anyhow!("no HTTP header end"))?;
        ensure!(head.contains(" 200 "), "/metrics: {head}");
        let parsed = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string())))?;
        let mut samples = Vec::new();
        for s in parsed.samples {
            let labels = s
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => samples.push((s.metric, labels, v)),
                _ => {}
            }
        }
        Ok(Scrape { samples })
    }

    fn find(&self, name: &str, with: &[(&str, &str)]) -> Vec<(&BTreeMap<String, String>, f64)> {
        self.samples
            .iter()
            .filter(|(n, l, _)| {
                n == name
                    && with
                        .iter()
                        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|(_, l, v)| (l, *v))
            .collect()
    }

    /// The pids in the `pid` label of `spice_observer_channel_info` (the one metric that
    /// names pids).
    fn channel_pids(&self) -> Vec<u32> {
        self.find("spice_observer_channel_info", &[])
            .iter()
            .filter_map(|(l, _)| l.get("pid")?.parse().ok())
            .collect()
    }

    /// Every `spice_observer_messages_total` and `_bytes_total` of `vm`.
    fn totals(&self, vm: &str) -> BTreeMap<Key, f64> {
        let mut out = BTreeMap::new();
        for m in [
            "spice_observer_messages_total",
            "spice_observer_bytes_total",
        ] {
            for (l, v) in self.find(m, &[("vm", vm)]) {
                out.insert(
                    (
                        m.to_string(),
                        l["leg"].clone(),
                        l["channel"].clone(),
                        l["channel_id"].clone(),
                        l["direction"].clone(),
                    ),
                    v,
                );
            }
        }
        out
    }

    /// As `common::check_run` for a scrape: the expected hook set, nothing degraded, every
    /// information-lost counter 0.
    fn check_run(&self) -> Result<()> {
        let hook = common::expected_hook_set();
        ensure!(
            self.find("spice_observer_hook_set_info", &[("hook_set", &hook)])
                .first()
                .is_some_and(|(_, v)| *v == 1.0),
            "hook set is not {hook}"
        );
        let degraded = self.find("spice_observer_degraded_features", &[]);
        ensure!(
            degraded.len() == 1 && degraded[0].1 == 0.0,
            "degraded: {degraded:?}"
        );
        let lost = self.find("spice_observer_information_lost_total", &[]);
        ensure!(lost.len() >= 9, "loss counters: {lost:?}");
        for (l, v) in lost {
            ensure!(v == 0.0, "information lost: {l:?} {v}");
        }
        Ok(())
    }
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

/// The client's data messages in a captured connection: (type, bytes with the header, stream
/// offset of the header) in order. Link message (16 + H_c), then the auth mechanism word if
/// the client's common caps have PROTOCOL_AUTH_SELECTION (bit 0), then the 128-byte ticket
/// (docs/spice-protocol.md §1.5), then headers of 6 (mini) or 18 bytes (§1.9).
fn c2s_messages(c: &oracle::SpiceConn) -> Result<Vec<(u16, u64, u64)>> {
    let b = &c.conn.c2s.bytes;
    let u32le = |at: usize| -> Result<u32> {
        let s = b
            .get(at..at + 4)
            .ok_or_else(|| anyhow!("client stream ends before {}", at + 4))?;
        Ok(u32::from_le_bytes(s.try_into().unwrap()))
    };
    let h_c = u32le(12)? as usize;
    let common = if u32le(22)? > 0 {
        u32le(16 + u32le(30)? as usize)?
    } else {
        0
    };
    let mut pos = 16 + h_c + if common & 1 != 0 { 4 } else { 0 } + 128;
    let hdr = if c.mini_header { 6 } else { 18 };
    let mut out = Vec::new();
    while pos + hdr <= b.len() {
        let (ty, size) = if c.mini_header {
            (u16::from_le_bytes([b[pos], b[pos + 1]]), u32le(pos + 2)?)
        } else {
            (
                u16::from_le_bytes([b[pos + 8], b[pos + 9]]),
                u32le(pos + 10)?,
            )
        };
        out.push((ty, (hdr + size as usize) as u64, pos as u64));
        pos += hdr + size as usize;
    }
    Ok(out)
}

/// ((server → client messages, bytes), (client → server messages, bytes)) of a captured
/// connection whose header the capture saw by `t` (epoch seconds).
type Counts = ((u64, u64), (u64, u64));

fn captured_by(c: &oracle::SpiceConn, t: f64) -> Result<Counts> {
    let seen = |d: &oracle::Direction, off: u64| d.first_seen(off).is_some_and(|x| x <= t);
    let s: Vec<&oracle::Message> = c
        .messages
        .iter()
        .filter(|m| m.last < c.conn.s2c.bytes.len() as u64 && seen(&c.conn.s2c, m.start))
        .collect();
    let k: Vec<(u16, u64, u64)> = c2s_messages(c)?
        .into_iter()
        .filter(|m| seen(&c.conn.c2s, m.2))
        .collect();
    Ok((
        (s.len() as u64, s.iter().map(|m| m.last + 1 - m.start).sum()),
        (k.len() as u64, k.iter().map(|m| m.1).sum()),
    ))
}

/// Names of the `spice_*` programs loaded in the kernel (`bpftool prog show`), sorted.
fn spice_programs() -> Result<Vec<String>> {
    let out = common::sh(Command::new("bpftool").args(["prog", "show"]))?;
    let mut v: Vec<String> = out
        .lines()
        .filter_map(|l| l.split_whitespace().skip_while(|w| *w != "name").nth(1))
        .filter(|n| n.starts_with("spice_"))
        .map(str::to_string)
        .collect();
    v.sort();
    Ok(v)
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

/// The `WATCHED_TGIDS` entries of the set pinned at `pins` that carry [`watch::TAP`].
fn tap_entries(pins: &Path) -> Result<Vec<(u32, u32)>> {
    Ok(watch_entries(pins)?
        .into_iter()
        .filter(|(_, v)| v & watch::TAP != 0)
        .collect())
}

/// Every `WATCHED_TGIDS` entry (tgid, value) of the set pinned at `pins`.
fn watch_entries(pins: &Path) -> Result<Vec<(u32, u32)>> {
    match loader::Capture::open_pinned(pins)? {
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
    let mut d = Daemon::start(&config, &pins.path)?;
    let mut cap = oracle::Capture::start(rig.state.join("server.pcapng"), None, "lo", &[PORT])?;
    // Animation until 14 s after Xspice's start: traffic while observe starts, idle at its
    // end (≈ 15 s after the client's start).
    let xorg = rig.xspice(
        PORT,
        91,
        &[
            "--mode",
            "rects",
            "--fps",
            "50",
            "--count",
            "20",
            "--seconds",
            "14",
        ],
    )?;
    let relay = rig.relay("socat", "127.0.0.1", RELAY_PORT, "127.0.0.1", PORT)?;
    for (what, pid) in [(vm, xorg), ("socat", relay)] {
        d.wait_line(
            |l| l.contains("found ") && l.contains(&format!("{what} (pid {pid}")),
            Duration::from_secs(5),
        )?;
    }
    let t0 = Instant::now();
    let _client = Client::start(&format!("spice://127.0.0.1:{RELAY_PORT}"), 60, &[], None)?;
    let programs_before = spice_programs()?;
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
    let programs_during = spice_programs()?;
    let second = observe(xorg, &pins.path, 1, &rig.state.join("second.json"))?;
    let out = first
        .join()
        .map_err(|_| anyhow!("observe thread panicked"))??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for l in stderr.lines() {
        eprintln!("observer! {l}");
    }
    ensure!(
        out.status.success(),
        "observe failed ({}):\n{stderr}",
        out.status
    );
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
    let scrape = Scrape::take()?;
    let t_b = epoch();
    scrape.check_run()?;
    let daemon = scrape.totals(vm);
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
                captured_by(c, observe_start + SLACK)?.0.0,
                captured_by(c, observe_end - SLACK)?.0.0,
            );
            println!("display messages captured while observe ran: {at_start} → {at_end}");
            ensure!(
                at_end > at_start + 100,
                "too little display traffic while observe ran: {at_start} → {at_end}"
            );
        }
        let (lo, hi) = (
            captured_by(c, observe_end - SLACK)?,
            captured_by(c, observe_end + SLACK)?,
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
        let (lo, hi) = (captured_by(c, t_a - SLACK)?, captured_by(c, t_b + SLACK)?);
        for (dir, (lo_m, lo_b), (hi_m, hi_b)) in [
            ("server_to_client", lo.0, hi.0),
            ("client_to_server", lo.1, hi.1),
        ] {
            for leg in ["server", "relay_backend", "relay_client"] {
                for (metric, lo, hi) in [
                    ("spice_observer_messages_total", lo_m, hi_m),
                    ("spice_observer_bytes_total", lo_b, hi_b),
                ] {
                    let key = (
                        metric.to_string(),
                        leg.to_string(),
                        ty.to_string(),
                        id.clone(),
                        dir.to_string(),
                    );
                    let got = daemon
                        .get(&key)
                        .copied()
                        .ok_or_else(|| anyhow!("no {metric} {leg} {ty} {id} {dir}"))?;
                    let line = format!(
                        "daemon {metric} {ty} {id} {dir} {leg}: {got}, capture {lo}..={hi}"
                    );
                    println!("{line}");
                    if got < lo as f64 || got > hi as f64 {
                        wrong.push(line);
                    }
                    compared += 1;
                }
            }
        }
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
    d.stop()?;
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
    let d = Daemon::start(&config, &pins.path)?;
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
    let before = Scrape::take()?;
    before.check_run()?;
    d.stop()?;
    let mut d = Daemon::start(&config, &pins.path)?;
    d.wait_line(
        |l| l.contains("continuing the kernel state"),
        Duration::ZERO,
    )?;
    let after = Scrape::take()?;
    after.check_run()?;
    for (when, s) in [
        ("before its restart", &before),
        ("after its restart", &after),
    ] {
        let pids = s.channel_pids();
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
    let stderr = String::from_utf8_lossy(&out.stderr);
    for l in stderr.lines() {
        eprintln!("observer! {l}");
    }
    ensure!(
        out.status.success(),
        "observe failed ({}):\n{stderr}",
        out.status
    );
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
    let end = Scrape::take()?;
    end.check_run()?;
    let pids = end.channel_pids();
    ensure!(
        !pids.contains(&spid) && !pids.contains(&cpid),
        "the daemon shows the peers at the end: {pids:?}"
    );
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    d.stop()?;
    Ok(())
}
