//! The no-BPF `tcpinfo` mode (`observe --hook-set tcpinfo`, README "Kernel requirements") on a
//! real session, everything unprivileged: Xspice (spice-server inside Xorg) and two headless
//! spice-gtk clients run as `nobody` (as the invoking user when the test is not run as root),
//! and so does the observer, with no capability at all.
//!
//! The observer's `--json` report is read into its typed [`Report`] (a missing field fails) and
//! held against a source outside the code under test: each spice-gtk client's own count of
//! the bytes it read per channel (`total_read_bytes`, in rig/client.py's SUMMARY) and the
//! local port of each channel's socket. A first client connects and leaves during the run:
//! its connections must be kept in the report, closed, with their last state. Then a second
//! one connects (spice-server serves one client at a time); the animation stops before the
//! observer does, so at the observer's last sample nothing is in flight and spice-server's
//! `tcpi_bytes_acked` on each of its channels must equal what the client read to the byte. The observer must hold no BPF object (no `anon_inode:bpf-*` descriptor) and
//! no capability while it runs.
//!
//! A second test runs `daemon --hook-set tcpinfo` the same way and holds its `/metrics`
//! scrape against the client's counts.
//!
//! Not privileged: it runs in `cargo xtask test` with the others, and also without root.

mod common;

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead, BufReader, Read},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use common::{cannot_run, ci, sh};
use serde::Deserialize;
use spice_observer::cmd::tcpinfo::{Connection, NO_FRAMING, Report};

const BIN: &str = env!("CARGO_BIN_EXE_spice-observer");
/// Xspice's port and X display: used by no other test.
const PORT: u16 = 5937;
const DISPLAY: u32 = 37;
/// The user everything runs as when the test runs as root (`nobody`).
const NOBODY: u32 = 65534;

/// A test that cannot run: a skip, or under `CI=true` a failure naming what is missing.
fn cannot(test: &str, why: &str) -> Result<()> {
    let msg = cannot_run(test, why);
    if ci() {
        bail!("{msg}");
    }
    eprintln!("{msg}");
    Ok(())
}

/// A scratch directory every user may write to (the unprivileged processes' state, HOME, the
/// binaries and rig scripts they run), removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Result<Self> {
        let p = std::env::temp_dir().join(format!("spice-tcpinfo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p)?;
        sh(Command::new("chmod").arg("1777").arg(&p))?;
        Ok(Self(p))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The uid the session and the observer run as.
fn run_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    match unsafe { libc::geteuid() } {
        0 => NOBODY,
        uid => uid,
    }
}

/// `prog` run as [`run_uid`]: through `setpriv` with every capability dropped when the test
/// is root, directly otherwise. HOME is the scratch dir (GLib and Xorg write there).
fn as_user(prog: &Path, home: &Path) -> Command {
    // SAFETY: geteuid has no preconditions.
    let mut c = if unsafe { libc::geteuid() } == 0 {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
        ])
        .arg(prog);
        c
    } else {
        Command::new(prog)
    };
    c.env("HOME", home).env_remove("SPICE_OBSERVER_HOOK_SET");
    c
}

/// A line of `/proc/PID/status` (`Uid:`, `CapEff:`), its value part.
fn status_field(pid: u32, field: &str) -> Result<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .map(|v| v.trim().to_string())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

/// The real uid of `pid`.
fn uid_of(pid: u32) -> Result<u32> {
    let v = status_field(pid, "Uid:")?;
    Ok(v.split_whitespace().next().unwrap_or("").parse()?)
}

/// Xspice started as [`run_uid`] from the scratch copy of the rig; stopped on drop.
struct Xspice {
    rig: PathBuf,
    run: PathBuf,
    home: PathBuf,
    xorg: u32,
}

impl Xspice {
    fn start(scratch: &Path, anim: &[&str]) -> Result<Self> {
        let rig = scratch.join("rig");
        let run = scratch.join("xspice");
        let mut cmd = as_user(&rig.join("start-xspice.sh"), scratch);
        cmd.env("RIG_RUN", &run)
            .args(["start", &PORT.to_string(), &DISPLAY.to_string(), "--"])
            .args(anim);
        let mut x = Self {
            rig,
            run: run.clone(),
            home: scratch.to_path_buf(),
            xorg: 0,
        };
        sh(&mut cmd)?;
        let pid = std::fs::read_to_string(run.join("Xorg.pid"))?;
        x.xorg = pid.trim().parse().context("Xorg.pid")?;
        Ok(x)
    }
}

impl Drop for Xspice {
    fn drop(&mut self) {
        let _ = as_user(&self.rig.join("start-xspice.sh"), &self.home)
            .env("RIG_RUN", &self.run)
            .args(["stop", &PORT.to_string()])
            .output();
    }
}

/// rig/client.py's SUMMARY: the fields this test reads (a missing one fails).
#[derive(Debug, Deserialize)]
struct ClientSummary {
    ok: bool,
    channels: BTreeMap<String, ClientChannel>,
}

#[derive(Debug, Deserialize)]
struct ClientChannel {
    /// spice-gtk's `total_read_bytes` of the channel: every byte it read from the socket.
    read_bytes: u64,
    /// The channel socket's local port.
    local_port: Option<u16>,
}

/// A headless spice-gtk client (rig/client.py) run as [`run_uid`]; killed on drop.
struct GtkClient(Child);

impl GtkClient {
    fn start(scratch: &Path, seconds: u32) -> Result<Self> {
        let mut cmd = as_user(Path::new("/usr/bin/python3"), scratch);
        cmd.arg(scratch.join("rig/client.py"))
            .arg(format!("spice://127.0.0.1:{PORT}"))
            .args(["--seconds", &seconds.to_string(), "--report", "1000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        Ok(Self(cmd.spawn().context("starting rig/client.py")?))
    }

    /// Waits for it (at most `timeout`) and reads its SUMMARY.
    fn summary(&mut self, timeout: Duration) -> Result<ClientSummary> {
        let out = self.0.stdout.take().context("client stdout")?;
        let reader = thread::spawn(move || {
            let mut text = String::new();
            let _ = BufReader::new(out).read_to_string(&mut text);
            text
        });
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = self.0.try_wait()? {
                break s;
            }
            if t0.elapsed() > timeout {
                let _ = self.0.kill();
                bail!("rig/client.py still running after {timeout:?}");
            }
            thread::sleep(Duration::from_millis(50));
        };
        let text = reader.join().unwrap();
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("SUMMARY "))
            .with_context(|| format!("client ({status}) printed no SUMMARY:\n{text}"))?;
        let s: ClientSummary = serde_json::from_str(line).context("client SUMMARY")?;
        ensure!(status.success() && s.ok, "client failed ({status}): {line}");
        Ok(s)
    }
}

impl Drop for GtkClient {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The BPF objects a process holds: its descriptors that are `anon_inode:bpf-prog`,
/// `bpf-map`, `bpf_link`, … (what loading a program or creating a map gives).
fn bpf_fds(pid: u32) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(target) = std::fs::read_link(e?.path()) else {
            continue;
        };
        let t = target.to_string_lossy().into_owned();
        if t.contains("bpf") {
            out.push(t);
        }
    }
    Ok(out)
}

/// What is missing for this test on this machine, if anything.
fn missing() -> Option<String> {
    if !Path::new("/usr/lib/xorg/Xorg").exists() {
        return Some("Xspice: /usr/lib/xorg/Xorg missing (apt-get install xserver-xspice)".into());
    }
    let gi = Command::new("/usr/bin/python3")
        .args([
            "-c",
            "import gi; gi.require_version('SpiceClientGLib', '2.0'); \
             from gi.repository import SpiceClientGLib",
        ])
        .output();
    if !gi.is_ok_and(|o| o.status.success()) {
        return Some(
            "spice-gtk for python: gir1.2-spiceclientglib-2.0 / python3-gi missing".into(),
        );
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 && Command::new("setpriv").arg("--version").output().is_err()
    {
        return Some("setpriv (util-linux), to run the session as nobody".into());
    }
    None
}

/// Connections of the report to spice-server's port whose peer is the client socket on
/// `port`.
fn conn_of(r: &Report, port: u16) -> Result<&Connection> {
    let remote = format!("127.0.0.1:{port}");
    let found: Vec<&Connection> = r
        .connections
        .iter()
        .filter(|c| c.remote == remote && c.local == format!("127.0.0.1:{PORT}"))
        .collect();
    ensure!(
        found.len() == 1,
        "{} connections to {remote} in the report: {found:#?}",
        found.len()
    );
    Ok(found[0])
}

/// Copies of the rig and the observer in `dir` that the unprivileged user can read and run
/// (the checkout and the build tree may be private to root); returns the observer's path.
fn stage(dir: &std::path::Path) -> Result<std::path::PathBuf> {
    sh(Command::new("cp")
        .arg("-r")
        .arg(common::rig())
        .arg(dir.join("rig")))?;
    let bin = dir.join("spice-observer");
    std::fs::copy(BIN, &bin)?;
    sh(Command::new("chmod")
        .arg("-R")
        .arg("a+rX")
        .arg(dir.join("rig")))?;
    sh(Command::new("chmod").arg("755").arg(&bin))?;
    Ok(bin)
}

#[test]
fn tcpinfo_mode_reads_a_real_session_unprivileged() -> Result<()> {
    const T: &str = "tcpinfo_mode_reads_a_real_session_unprivileged";
    if let Some(why) = missing() {
        return cannot(T, &why);
    }
    let uid = run_uid();
    let scratch = Scratch::new()?;
    let dir = &scratch.0;
    let bin = stage(dir)?;

    // Noise frames (incompressible: megabytes on the display channel) for 5 s, then idle.
    let x = Xspice::start(
        dir,
        &[
            "--mode",
            "noise",
            "--fps",
            "20",
            "--size",
            "256x192",
            "--seconds",
            "5",
        ],
    )?;
    ensure!(
        uid_of(x.xorg)? == uid,
        "Xorg runs as uid {}, not {uid}",
        uid_of(x.xorg)?
    );

    let json = dir.join("report.json");
    let mut obs = as_user(&bin, dir)
        .args([
            "observe",
            "--pid",
            &x.xorg.to_string(),
            "--hook-set",
            "tcpinfo",
        ])
        .args([
            "--duration",
            "9",
            "--sample-ms",
            "100",
            "--no-progress",
            "--json",
        ])
        .arg(&json)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the observer")?;
    let obs_pid = obs.id();
    // The observer's start line: it is watching (its sockets' first sample is taken).
    let mut stderr = BufReader::new(obs.stderr.take().unwrap());
    let mut said = String::new();
    let t0 = Instant::now();
    while !said.contains("watching pid") {
        let mut line = String::new();
        if stderr.read_line(&mut line)? == 0 || t0.elapsed() > Duration::from_secs(10) {
            let _ = obs.kill();
            bail!("observer did not start: {said}");
        }
        said += &line;
    }
    let stderr_rest = thread::spawn(move || {
        let mut rest = String::new();
        let _ = stderr.read_to_string(&mut rest);
        rest
    });
    let mut stdout = obs.stdout.take().unwrap();
    let stdout_all = thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });

    // Client B comes and goes during the run; then client A (spice-server serves one client
    // at a time) connects and stays past the observer's end.
    let mut b = GtkClient::start(dir, 1)?;
    let sb = b.summary(Duration::from_secs(20))?;
    let mut a = GtkClient::start(dir, 10)?;
    thread::sleep(Duration::from_millis(1000));

    // Mid-run: the observer holds no BPF object and no capability, as the user given.
    let held = bpf_fds(obs_pid)?;
    ensure!(
        held.is_empty(),
        "the tcpinfo observer holds BPF objects: {held:?}"
    );
    let cap_eff = status_field(obs_pid, "CapEff:")?;
    ensure!(
        u64::from_str_radix(&cap_eff, 16)? == 0,
        "the observer has capabilities: CapEff {cap_eff}"
    );
    ensure!(uid_of(obs_pid)? == uid, "observer uid");

    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = obs.try_wait()? {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = obs.kill();
            bail!("the observer did not end");
        }
        thread::sleep(Duration::from_millis(50));
    };
    let table = stdout_all.join().unwrap();
    said += &stderr_rest.join().unwrap();
    ensure!(
        status.success(),
        "observer failed ({status}):\n{said}\n{table}"
    );
    let sa = a.summary(Duration::from_secs(20))?;
    eprintln!("{table}");

    // The report, typed.
    let text = std::fs::read_to_string(&json)?;
    let r: Report = serde_json::from_str(&text).context("the tcpinfo report")?;
    ensure!(
        r.hook_set == "tcpinfo" && !r.framing,
        "{} {}",
        r.hook_set,
        r.framing
    );
    ensure!(r.note == NO_FRAMING && NO_FRAMING.contains("no SPICE framing"));
    ensure!(
        table.contains(NO_FRAMING),
        "the table does not say it: {table}"
    );
    ensure!(said.contains(NO_FRAMING), "stderr does not say it: {said}");
    ensure!(r.warnings.is_empty(), "warnings: {:?}", r.warnings);
    ensure!(
        r.listening
            .iter()
            .any(|l| l.local == format!("127.0.0.1:{PORT}") && l.pid == x.xorg),
        "spice-server's listener: {:?}",
        r.listening
    );
    ensure!(
        r.processes
            .iter()
            .any(|p| p.pid == x.xorg && p.root && p.comm == "Xorg"),
        "{:?}",
        r.processes
    );

    // Exactly the clients' channels, no more.
    let ports = |s: &ClientSummary| -> Result<BTreeSet<u16>> {
        s.channels
            .iter()
            .map(|(k, c)| {
                c.local_port
                    .with_context(|| format!("channel {k}: no local port"))
            })
            .collect()
    };
    let (pa, pb) = (ports(&sa)?, ports(&sb)?);
    ensure!(
        pa.len() >= 3 && pb.len() >= 3,
        "channels: A {pa:?}, B {pb:?}"
    );
    let seen: BTreeSet<u16> = r
        .connections
        .iter()
        .filter(|c| c.local == format!("127.0.0.1:{PORT}"))
        .map(|c| c.remote.rsplit(':').next().unwrap().parse().unwrap())
        .collect();
    let want: BTreeSet<u16> = pa.union(&pb).copied().collect();
    ensure!(
        seen == want,
        "connections seen {seen:?}, the clients' {want:?}"
    );

    // Client A: open, ESTABLISHED, nothing in flight, and every byte the client read is a
    // byte spice-server's TCP had acknowledged at the observer's last sample.
    for (name, ch) in &sa.channels {
        let c = conn_of(&r, ch.local_port.unwrap())?;
        let g = &c.last;
        eprintln!(
            "client A {name}: read {} B; observer: acked {} B, received {} B, sent {} B, {}",
            ch.read_bytes, g.bytes_acked, g.bytes_received, g.bytes_sent, g.state
        );
        ensure!(
            c.open && c.closed_s.is_none() && c.closed_how.is_none(),
            "{name}: {c:#?}"
        );
        ensure!(g.state == "ESTABLISHED", "{name}: {c:#?}");
        ensure!(
            g.send_queue == 0 && g.notsent_bytes == 0 && g.unacked == 0,
            "{name}: in flight at the end of an idle session: {c:#?}"
        );
        ensure!(
            g.bytes_acked > 0 && g.bytes_acked == ch.read_bytes,
            "{name}: spice-server's bytes_acked {} against the client's read_bytes {}",
            g.bytes_acked,
            ch.read_bytes
        );
        ensure!(
            g.bytes_received > 0,
            "{name}: the client's link message: {c:#?}"
        );
        ensure!(c.first_seen_s > 0.0 && c.samples > 10, "{name}: {c:#?}");
    }
    let display = sa
        .channels
        .iter()
        .find(|(k, _)| k.starts_with("display"))
        .context("client A has no display channel")?;
    let d = conn_of(&r, display.1.local_port.unwrap())?;
    ensure!(
        d.acked_during_run > 1_000_000 && d.send_rate_bps > 0.0 && d.last.snd_cwnd > 0,
        "display moved nothing while observed: {d:#?}"
    );
    ensure!(
        d.last.srtt_us > 0 && d.max_srtt_us >= d.last.srtt_us,
        "{d:#?}"
    );

    // Client B: gone during the run, kept with its last state; TCP had acknowledged no more
    // than the client read.
    for (name, ch) in &sb.channels {
        let c = conn_of(&r, ch.local_port.unwrap())?;
        eprintln!(
            "client B {name}: read {} B; observer: acked {} B, last state {}, closed at {:?} s ({:?})",
            ch.read_bytes, c.last.bytes_acked, c.last.state, c.closed_s, c.closed_how
        );
        ensure!(
            !c.open && c.closed_s.is_some() && c.closed_how.is_some(),
            "{name}: {c:#?}"
        );
        ensure!(
            c.last.bytes_acked > 0 && c.last.bytes_acked <= ch.read_bytes,
            "{name}: acked {} read {}",
            c.last.bytes_acked,
            ch.read_bytes
        );
    }
    drop(x);
    Ok(())
}

/// The daemon's listen address in [`tcpinfo_daemon_serves_tcp_gauges_unprivileged`] (no other
/// test uses it).
const DAEMON_LISTEN: &str = "127.0.0.1:19537";

/// `daemon --hook-set tcpinfo` as `nobody` with no capability, beside an Xspice session of
/// the same user: discovery finds Xspice, `/metrics` says `hook_set="tcpinfo"`,
/// `framing="false"` and `spice_observer_framing 0`, and per connection of the client the
/// scraped `spice_observer_tcpinfo_bytes_acked` at the idle end equals the client's own
/// `total_read_bytes`; once the client has gone its series are gone. It holds no BPF object.
#[test]
fn tcpinfo_daemon_serves_tcp_gauges_unprivileged() -> Result<()> {
    const T: &str = "tcpinfo_daemon_serves_tcp_gauges_unprivileged";
    if let Some(why) = missing() {
        return cannot(T, &why);
    }
    let uid = run_uid();
    let scratch = Scratch::new()?;
    let dir = &scratch.0;
    let bin = stage(dir)?;
    // An empty config file: the built-in defaults, whatever /etc holds.
    let config = dir.join("config.toml");
    std::fs::write(&config, "")?;
    sh(Command::new("chmod").arg("644").arg(&config))?;

    // Noise frames for 3 s, then idle.
    let x = Xspice::start(
        dir,
        &[
            "--mode",
            "noise",
            "--fps",
            "20",
            "--size",
            "256x192",
            "--seconds",
            "3",
        ],
    )?;
    let mut cmd = as_user(&bin, dir);
    cmd.args(["daemon", "--hook-set", "tcpinfo", "--listen", DAEMON_LISTEN])
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "info");
    let mut d = common::daemon::Daemon::spawn(cmd, common::daemon::OnDrop::Kill, "tcpinfo daemon")?;
    let xorg = x.xorg.to_string();
    d.wait_line(
        |l| l.contains("found ") && l.contains(&format!("pid {xorg}")),
        Duration::from_secs(10),
    )?;
    let dpid = d.pid();
    ensure!(uid_of(dpid)? == uid, "daemon uid");
    let cap_eff = status_field(dpid, "CapEff:")?;
    ensure!(
        u64::from_str_radix(&cap_eff, 16)? == 0,
        "the daemon has capabilities: CapEff {cap_eff}"
    );

    let mut a = GtkClient::start(dir, 8)?;
    // Past the animation's end (3 s after Xspice started) and a few samples more.
    thread::sleep(Duration::from_millis(5500));
    let held = bpf_fds(dpid)?;
    ensure!(
        held.is_empty(),
        "the tcpinfo daemon holds BPF objects: {held:?}"
    );
    let s = common::daemon::Scrape::take(DAEMON_LISTEN)?;
    let sa = a.summary(Duration::from_secs(20))?;

    ensure!(
        s.one(
            "spice_observer_info",
            &[("hook_set", "tcpinfo"), ("framing", "false")]
        )? == 1.0,
        "info: {}",
        s.text
    );
    ensure!(s.one("spice_observer_framing", &[])? == 0.0);
    ensure!(s.one("spice_observer_hook_set_info", &[("hook_set", "tcpinfo")])? == 1.0);
    ensure!(s.one("spice_observer_tcpinfo_targets", &[])? >= 1.0);
    ensure!(
        s.families
            .get("spice_observer_framing")
            .is_some_and(|h| h.contains("tcpinfo")),
        "the framing metric's help: {:?}",
        s.families.get("spice_observer_framing")
    );
    ensure!(
        !s.families.keys().any(|f| f.contains("messages")),
        "a message metric in the tcpinfo mode: {:?}",
        s.families.keys()
    );
    for (name, ch) in &sa.channels {
        let remote = format!("127.0.0.1:{}", ch.local_port.context("local port")?);
        let with = [("remote", remote.as_str()), ("pid", xorg.as_str())];
        let acked = s.one("spice_observer_tcpinfo_bytes_acked", &with)?;
        eprintln!(
            "client {name}: read {} B; scraped bytes_acked {acked}",
            ch.read_bytes
        );
        ensure!(
            acked > 0.0 && acked == ch.read_bytes as f64,
            "{name}: scraped bytes_acked {acked}, the client read {}",
            ch.read_bytes
        );
        ensure!(
            s.one(
                "spice_observer_tcpinfo_tcp_state",
                &[("remote", remote.as_str()), ("state", "ESTABLISHED")]
            )? == 1.0
        );
        ensure!(s.one("spice_observer_tcpinfo_unacked_segments", &with)? == 0.0);
        let vm = &s.find("spice_observer_tcpinfo_bytes_acked", &with)[0].labels["vm"];
        ensure!(!vm.is_empty(), "no vm label for {remote}");
    }
    // The client has gone: its connections are no longer exported.
    thread::sleep(Duration::from_millis(700));
    let after = common::daemon::Scrape::take(DAEMON_LISTEN)?;
    ensure!(
        after
            .find(
                "spice_observer_tcpinfo_bytes_acked",
                &[("pid", xorg.as_str())]
            )
            .is_empty(),
        "series left after the client went: {}",
        after.text
    );
    let (status, _) = d.stop(libc::SIGTERM)?;
    ensure!(status.success(), "daemon exit {status}");
    drop(x);
    Ok(())
}
