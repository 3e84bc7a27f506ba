//! Shared harness of the privileged tests: the project's rig (real spice-server, real spice-gtk
//! client, real relay, shaped links) and the real `spice-observer` binary.
//!
//! Every test first calls [`privileged`]: without root it says so and skips. A kernel that
//! lacks a needed program type or hook makes the observer fail with a message naming it and
//! containing [`UNAVAILABLE`]; [`Observer::start`] turns that (and only that) into
//! [`Started::Unsupported`], which [`observe_or_skip!`] reports as a loud skip. Any other
//! failure to load or attach (permission, verifier rejection, attach error) fails the test.
//! With `CI=true` in the environment a test never skips: where it would, it fails naming
//! the missing feature ([`ci`]).
//!
//! Outputs are read into typed structs: the observer's report into
//! [`spice_observer::report::Report`] ([`parse_report`], [`Observer::finish_report`]), the
//! scripted peer's SUMMARY into [`summary::PeerSummary`]; both fail on a field the document
//! lacks. Every privileged test checks its run with [`check_run`].
#![allow(dead_code)]

pub mod daemon;
pub mod peer;
pub mod summary;

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::Value;
use spice_observer::report::{ChannelReport, Report};

/// The phrase the observer's error contains when (and only when) the kernel lacks a program
/// type or hook; only that error is a skip.
pub use spice_observer::loader::UNAVAILABLE;

/// True when `CI` is `true` in the environment: a test that would skip fails instead.
pub fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Message of a test that cannot run, for a skip or (under [`ci`]) a failure.
pub fn cannot_run(test: &str, why: &str) -> String {
    if ci() {
        format!("FAIL {test}: CI=true and the test cannot run: {why}")
    } else {
        format!("SKIP {test}: {why}")
    }
}

pub mod oracle;

/// The rig scripts.
pub fn rig() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../rig")
}

/// True if the test can load BPF programs; otherwise prints why and the test returns.
///
/// Panics (the test fails) instead of returning false when `CI=true` ([`ci`]).
pub fn privileged(test: &str) -> bool {
    if unsafe { libc::geteuid() } != 0 {
        let msg = cannot_run(
            test,
            "needs root to load BPF programs (run `cargo xtask test` as root)",
        );
        if ci() {
            panic!("{msg}");
        }
        eprintln!("{msg}");
        return false;
    }
    true
}

/// `DISPLAY=:display rig/xanim.py ARGS` to completion (an X client drawing on Xspice, not
/// watched: Xorg writes what it draws to the display channel). A test that needs drawing at
/// a given time after the client starts draws here rather than in [`Rig::xspice`]'s
/// animation, whose clock starts before the observer has loaded.
pub fn draw(display: u32, args: &[&str]) -> Result<()> {
    sh(Command::new("/usr/bin/python3")
        .env("DISPLAY", format!(":{display}"))
        .arg(rig().join("xanim.py"))
        .args(args))?;
    Ok(())
}

/// xanim's arguments for many small rectangles: 20 a frame at 50 frames/s for `seconds`
/// seconds ([`Rig::xspice_rects`], [`draw`]).
pub fn rects(seconds: &str) -> [&str; 8] {
    [
        "--mode",
        "rects",
        "--fps",
        "50",
        "--count",
        "20",
        "--seconds",
        seconds,
    ]
}

/// Runs a command to completion; errors with its output if it fails.
pub fn sh(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("spawning {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Names of the `spice_*` programs loaded in the kernel (`bpftool prog show`), sorted.
pub fn spice_programs() -> Result<Vec<String>> {
    let out = sh(Command::new("bpftool").args(["prog", "show"]))?;
    let mut v: Vec<String> = out
        .lines()
        .filter_map(|l| l.split_whitespace().skip_while(|w| *w != "name").nth(1))
        .filter(|n| n.starts_with("spice_"))
        .map(str::to_string)
        .collect();
    v.sort();
    Ok(v)
}

/// A checker's verdict that must be silent: exit 0 and nothing on stdout or stderr (as
/// `promtool check metrics` and `systemd-analyze verify` answer a clean input); otherwise an
/// error naming `what` with its status and output.
pub fn silent_success(out: &std::process::Output, what: &str) -> Result<()> {
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success() && said.trim().is_empty(),
        "{what} ({}):\n{said}",
        out.status
    );
    Ok(())
}

fn read_pid(path: &Path) -> Result<u32> {
    let s = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    s.trim()
        .parse()
        .with_context(|| format!("pid in {}", path.display()))
}

/// Rig pieces started by one test; stopped in reverse order when dropped.
pub struct Rig {
    pub state: PathBuf,
    stops: Vec<Command>,
}

impl Rig {
    /// `name` keeps the state of concurrent or consecutive tests apart.
    pub fn new(name: &str) -> Result<Self> {
        let state = std::env::temp_dir().join(format!("spice-observer-test-{name}"));
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(&state)?;
        Ok(Self {
            state,
            stops: Vec::new(),
        })
    }

    fn on_drop(&mut self, cmd: Command) {
        self.stops.push(cmd);
    }

    /// Xspice on 127.0.0.1:`port`, display `:display`, animated by `xanim.py anim`. Returns the
    /// pid of Xorg, the process that runs spice-server.
    pub fn xspice(&mut self, port: u16, display: u32, anim: &[&str]) -> Result<u32> {
        self.xspice_opts(port, display, &[], anim)
    }

    /// [`Rig::xspice`] with only a TLS port: `port` is spice-server's TLS port (no plain
    /// port), certificates from `x509` (spice-server's layout, [`Rig::tls_certs`]).
    pub fn xspice_tls(
        &mut self,
        port: u16,
        display: u32,
        x509: &Path,
        anim: &[&str],
    ) -> Result<u32> {
        let dir = x509.to_str().context("x509 dir path")?;
        self.xspice_opts(port, display, &["--tls", dir], anim)
    }

    fn xspice_opts(
        &mut self,
        port: u16,
        display: u32,
        opts: &[&str],
        anim: &[&str],
    ) -> Result<u32> {
        let run = self.state.join(format!("xspice-{port}"));
        let mut stop = Command::new(rig().join("start-xspice.sh"));
        stop.env("RIG_RUN", &run).args(["stop", &port.to_string()]);
        self.on_drop(stop);
        sh(Command::new(rig().join("start-xspice.sh"))
            .env("RIG_RUN", &run)
            .args(["start", &port.to_string(), &display.to_string()])
            .args(opts)
            .arg("--")
            .args(anim))?;
        read_pid(&run.join("Xorg.pid"))
    }

    /// Throwaway certificates (rig/tls-certs.sh: a CA and a server certificate for
    /// 127.0.0.1 / localhost) in `STATE/x509`, spice-server's layout: `ca-cert.pem`,
    /// `server-cert.pem`, `server-key.pem` (and `server.pem` for stunnel). Returns the dir.
    pub fn tls_certs(&mut self) -> Result<PathBuf> {
        let dir = self.state.join("x509");
        sh(Command::new(rig().join("tls-certs.sh")).arg(&dir))?;
        Ok(dir)
    }

    /// A TLS-terminating relay (rig/stunnel.sh) from `laddr`:`lport` to 127.0.0.1:`sport`:
    /// `mode` `client` (plaintext in, TLS out, the server verified against
    /// `x509/ca-cert.pem`) or `server` (TLS in with `x509/server.pem`, plaintext out).
    pub fn stunnel(
        &mut self,
        mode: &str,
        laddr: &str,
        lport: u16,
        sport: u16,
        x509: &Path,
    ) -> Result<Stunnel> {
        let pidfile = self.state.join(format!("stunnel-{lport}.pid"));
        let mut stop = Command::new(rig().join("stunnel.sh"));
        stop.arg("stop").arg(&pidfile);
        self.on_drop(stop);
        let tls = match mode {
            "client" => x509.join("ca-cert.pem"),
            "server" => x509.to_path_buf(),
            other => bail!("stunnel mode {other:?}"),
        };
        sh(Command::new(rig().join("stunnel.sh"))
            .args([
                mode,
                laddr,
                &lport.to_string(),
                "127.0.0.1",
                &sport.to_string(),
            ])
            .arg(&tls)
            .arg(&pidfile))?;
        Ok(Stunnel {
            pid: read_pid(&pidfile)?,
            log: pidfile.with_extension("log"),
        })
    }

    /// [`Rig::xspice`] drawing many small rectangles ([`rects`]) for `seconds` seconds, then
    /// idle.
    pub fn xspice_rects(&mut self, port: u16, display: u32, seconds: u32) -> Result<u32> {
        self.xspice(port, display, &rects(&seconds.to_string()))
    }

    /// QEMU (TCG) with spice-server on 127.0.0.1:`port`; the guest draws `frames` frames of
    /// noise and then stops. Returns the qemu pid.
    pub fn qemu(&mut self, port: u16, frames: u32) -> Result<u32> {
        let mut stop = Command::new(rig().join("start-qemu.sh"));
        stop.args(["stop", &port.to_string()]);
        self.on_drop(stop);
        sh(Command::new(rig().join("start-qemu.sh")).args([
            "start",
            &port.to_string(),
            "noise",
            "20",
            "96",
            &frames.to_string(),
        ]))?;
        read_pid(Path::new(&format!("/tmp/rig-qemu-{port}/qemu.pid")))
    }

    /// Waits until the QEMU guest has drawn its frames.
    pub fn qemu_wait_done(&self, port: u16, timeout_s: u32) -> Result<()> {
        sh(Command::new(rig().join("start-qemu.sh")).args([
            "wait-done",
            &port.to_string(),
            &timeout_s.to_string(),
        ]))?;
        Ok(())
    }

    /// A `kind` (socat or haproxy) relay from laddr:lport to saddr:sport. Returns its pid.
    pub fn relay(
        &mut self,
        kind: &str,
        laddr: &str,
        lport: u16,
        saddr: &str,
        sport: u16,
    ) -> Result<u32> {
        self.relay_env(kind, laddr, lport, saddr, sport, &[])
    }

    /// [`Rig::relay`] with rig settings in the environment (e.g. `RIG_RELAY_RCVBUF`).
    pub fn relay_env(
        &mut self,
        kind: &str,
        laddr: &str,
        lport: u16,
        saddr: &str,
        sport: u16,
        env: &[(&str, &str)],
    ) -> Result<u32> {
        let pidfile = self.state.join(format!("relay-{lport}.pid"));
        let mut stop = Command::new(rig().join("relay.sh"));
        stop.arg("stop").arg(&pidfile);
        self.on_drop(stop);
        sh(Command::new(rig().join("relay.sh"))
            .envs(env.iter().copied())
            .args([kind, laddr, &lport.to_string(), saddr, &sport.to_string()])
            .arg(&pidfile))?;
        read_pid(&pidfile)
    }

    /// rig/mangle-relay.py (a relay that inserts one message toward the client on display
    /// channels: not byte-transparent) from 127.0.0.1:`lport` to 127.0.0.1:`sport`. Returns its pid.
    pub fn mangle_relay(&mut self, lport: u16, sport: u16) -> Result<u32> {
        let pidfile = self.state.join(format!("mangle-{lport}.pid"));
        let mut child = Command::new("/usr/bin/python3")
            .arg(rig().join("mangle-relay.py"))
            .args([
                "--listen",
                &format!("127.0.0.1:{lport}"),
                "--server",
                &format!("127.0.0.1:{sport}"),
            ])
            .arg("--pidfile")
            .arg(&pidfile)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting rig/mangle-relay.py")?;
        let pid = child.id();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line)?;
        ensure!(
            line.trim() == "listening",
            "mangle-relay did not start: {line:?}"
        );
        let mut stop = Command::new("kill");
        stop.arg(pid.to_string());
        self.on_drop(stop);
        std::mem::forget(child);
        Ok(pid)
    }

    /// Runs `shape.sh ARGS` (after [`Rig::shaped_link`]), e.g. `["rmem", "4096 65536 262144"]`.
    pub fn shape(&mut self, args: &[&str]) -> Result<()> {
        sh(Command::new(rig().join("shape.sh"))
            .env("RIG_STATE", self.state.join("shape"))
            .args(args))?;
        Ok(())
    }

    /// Client namespace `rigc` with a link of `kind` (`veth`, or `tun D U`), rate-limited to
    /// `rate` both ways if given. The relay must listen on 198.18.0.1.
    pub fn shaped_link(&mut self, up: &[&str], rate: Option<&str>) -> Result<()> {
        let mut down = Command::new(rig().join("shape.sh"));
        down.env("RIG_STATE", self.state.join("shape")).arg("down");
        self.on_drop(down);
        sh(Command::new(rig().join("shape.sh"))
            .env("RIG_STATE", self.state.join("shape"))
            .arg("up")
            .args(up))?;
        if let Some(r) = rate {
            sh(Command::new(rig().join("shape.sh"))
                .env("RIG_STATE", self.state.join("shape"))
                .args(["rate", r, r]))?;
        }
        Ok(())
    }
}

/// A stunnel started by [`Rig::stunnel`].
pub struct Stunnel {
    pub pid: u32,
    /// Its log (`debug = notice`): per connection `LOG5[N]: Service [spice] accepted
    /// connection from ADDR:PORT` and, when it ends, `LOG5[N]: Connection closed: A byte(s)
    /// sent to TLS, B byte(s) sent to socket` (N: stunnel's connection number).
    pub log: PathBuf,
}

impl Stunnel {
    /// stunnel's own plaintext byte counts of its finished connections: client address
    /// (`ADDR:PORT` of the accepted connection) → (bytes it sent to TLS, bytes it sent to the
    /// plain socket), from its log's `accepted connection from` and `Connection closed`
    /// lines of the same connection number. Fails on a line it cannot read.
    pub fn closed_connections(&self) -> Result<std::collections::BTreeMap<String, (u64, u64)>> {
        let text = std::fs::read_to_string(&self.log)
            .with_context(|| format!("reading {}", self.log.display()))?;
        let mut from = std::collections::BTreeMap::new();
        let mut out = std::collections::BTreeMap::new();
        for line in text.lines() {
            let Some((_, rest)) = line.split_once("LOG5[") else {
                continue;
            };
            let Some((n, msg)) = rest.split_once("]: ") else {
                continue;
            };
            if let Some(a) = msg.strip_prefix("Service [spice] accepted connection from ") {
                from.insert(n.to_string(), a.trim().to_string());
            } else if let Some(c) = msg.strip_prefix("Connection closed: ") {
                // "A byte(s) sent to TLS, B byte(s) sent to socket"
                let nums: Vec<u64> = c
                    .split(|ch: char| !ch.is_ascii_digit())
                    .filter(|w| !w.is_empty())
                    .map(|w| w.parse())
                    .collect::<Result<_, _>>()
                    .with_context(|| format!("stunnel log line {line:?}"))?;
                ensure!(nums.len() == 2, "stunnel log line {line:?}");
                let a = from.get(n).with_context(|| {
                    format!("connection {n} closed but never accepted: {line:?}")
                })?;
                out.insert(a.clone(), (nums[0], nums[1]));
            }
        }
        Ok(out)
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        while let Some(mut c) = self.stops.pop() {
            let _ = c.stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
    }
}

/// Ends `child` if it still runs: SIGTERM, then SIGKILL if it has not exited within 5 s; reaps
/// it. A child already reaped gets no signal (its pid may have been reused).
pub fn terminate(child: &mut Child) {
    if !matches!(child.try_wait(), Ok(None)) {
        return;
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A headless spice-gtk client (rig/client.py), optionally inside network namespace `netns`.
pub struct Client(Child);

impl Client {
    pub fn start(uri: &str, seconds: u32, extra: &[&str], netns: Option<&str>) -> Result<Self> {
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "/usr/bin/python3"]);
                c
            }
            None => Command::new("/usr/bin/python3"),
        };
        cmd.arg(rig().join("client.py"))
            .arg(uri)
            .args(["--seconds", &seconds.to_string(), "--report", "1000"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        Ok(Self(cmd.spawn().context("starting rig/client.py")?))
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A running `spice-observer observe`.
pub struct Observer {
    child: Child,
    json: PathBuf,
    stderr: mpsc::Receiver<String>,
    pub log: Vec<String>,
    /// Every stdout line so far (also echoed as `observer| …`).
    pub stdout: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// The thread reading stdout; it ends when the observer exits.
    stdout_reader: Option<thread::JoinHandle<()>>,
}

/// What [`Observer::start`] found.
pub enum Started {
    Running(Observer),
    /// The kernel lacks a program type or hook: the observer's error contained [`UNAVAILABLE`]
    /// and names the feature (the whole stderr of the observer).
    Unsupported(String),
}

impl Observer {
    /// Starts observing `pids` for `seconds` and waits until it is attached.
    pub fn start(pids: &[u32], seconds: f64, json: PathBuf) -> Result<Started> {
        Self::start_with(pids, seconds, json, &[])
    }

    /// Like [`Observer::start`], with extra `observe` arguments (e.g. `--plot PATH`).
    pub fn start_with(
        pids: &[u32],
        seconds: f64,
        json: PathBuf,
        extra: &[&str],
    ) -> Result<Started> {
        Self::start_env(pids, seconds, json, extra, &[])
    }

    /// Like [`Observer::start_with`], with variables added to the observer's environment
    /// (e.g. `RUST_LOG`).
    pub fn start_env(
        pids: &[u32],
        seconds: f64,
        json: PathBuf,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Started> {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_spice-observer"));
        cmd.envs(env.iter().copied());
        cmd.arg("observe").args(extra);
        for p in pids {
            cmd.args(["--pid", &p.to_string()]);
        }
        cmd.args([
            "--duration",
            &seconds.to_string(),
            "--no-progress",
            "--json",
        ])
        .arg(&json)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = cmd.spawn().context("starting spice-observer")?;
        let (tx, rx) = mpsc::channel();
        let err = child.stderr.take().unwrap();
        thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let out = child.stdout.take().unwrap();
        let stdout = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let keep = stdout.clone();
        let stdout_reader = Some(thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                println!("observer| {line}");
                keep.lock().unwrap().push(line);
            }
        }));
        let mut log = Vec::new();
        let t0 = Instant::now();
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => {
                    eprintln!("observer! {line}");
                    let attached = line.starts_with("spice-observer: watching");
                    log.push(line);
                    if attached {
                        return Ok(Started::Running(Observer {
                            child,
                            json,
                            stderr: rx,
                            log,
                            stdout,
                            stdout_reader,
                        }));
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = child.wait()?;
                    let text = log.join("\n");
                    if text.contains(UNAVAILABLE) {
                        return Ok(Started::Unsupported(text));
                    }
                    bail!("spice-observer exited before attaching ({status}):\n{text}");
                }
            }
            if t0.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                bail!(
                    "spice-observer did not attach within 60 s:\n{}",
                    log.join("\n")
                );
            }
        }
    }

    /// Waits for the end of the observation and returns the JSON report, read into the typed
    /// [`Report`] the observer writes (see [`parse_report`]).
    pub fn finish_report(self) -> Result<Report> {
        let raw = self.finish()?;
        parse_report(&raw)
    }

    /// [`Observer::finish`], also returning everything the observer printed: its stdout
    /// lines, then its stderr lines.
    pub fn finish_with_output(self) -> Result<(Value, Vec<String>)> {
        let stdout = self.stdout.clone();
        let mut log = Vec::new();
        let raw = self.finish_logged(&mut log)?;
        let mut all = stdout.lock().unwrap().clone();
        all.extend(log);
        Ok((raw, all))
    }

    /// Waits for the end of the observation and returns the JSON report.
    pub fn finish(self) -> Result<Value> {
        self.finish_logged(&mut Vec::new())
    }

    /// [`Observer::finish`], leaving the stderr lines in `log`.
    fn finish_logged(mut self, log: &mut Vec<String>) -> Result<Value> {
        let status = self.child.wait()?;
        if let Some(t) = self.stdout_reader.take() {
            let _ = t.join();
        }
        while let Ok(line) = self.stderr.recv_timeout(Duration::from_millis(200)) {
            eprintln!("observer! {line}");
            self.log.push(line);
        }
        *log = self.log.clone();
        if !status.success() {
            bail!("spice-observer failed ({status}):\n{}", self.log.join("\n"));
        }
        let text = std::fs::read_to_string(&self.json)
            .with_context(|| format!("reading {}", self.json.display()))?;
        serde_json::from_str(&text).map_err(|e| anyhow!("bad JSON report: {e}"))
    }
}

/// Starts the observer or, where the kernel lacks a feature, prints a loud skip and returns
/// `Ok(())` from the test; with `CI=true` ([`ci`]) returns an error naming the feature instead.
#[macro_export]
macro_rules! observe_or_skip {
    ($test:expr, $pids:expr, $secs:expr, $json:expr) => {
        observe_or_skip!($test, $pids, $secs, $json, &[])
    };
    ($test:expr, $pids:expr, $secs:expr, $json:expr, $extra:expr) => {
        match common::Observer::start_with($pids, $secs, $json, $extra)? {
            common::Started::Running(o) => o,
            common::Started::Unsupported(why) => {
                let msg = common::cannot_run($test, &format!("kernel feature missing:\n{why}"));
                if common::ci() {
                    return Err(::anyhow::anyhow!("{msg}"));
                }
                eprintln!("{msg}");
                return Ok(());
            }
        }
    };
}

/// Channels of the report whose `pid` is `pid` and type is `ty`.
pub fn channels_of<'a>(report: &'a Report, pid: u32, ty: &str) -> Vec<&'a ChannelReport> {
    report
        .channels
        .iter()
        .filter(|c| c.pid == pid && c.channel_type == ty)
        .collect()
}

/// The channel whose `socket` starts with `local` ("addr:port->").
pub fn by_local_of<'a>(report: &'a Report, local: &str) -> Option<&'a ChannelReport> {
    let prefix = format!("{local}->");
    report
        .channels
        .iter()
        .find(|c| c.socket.starts_with(&prefix))
}

/// The remote endpoint of a channel's `socket` ("…->addr:port"); errors if it has none.
pub fn remote_of(c: &ChannelReport) -> Result<&str> {
    c.socket
        .split_once("->")
        .map(|(_, r)| r)
        .ok_or_else(|| anyhow!("socket {:?} has no remote end", c.socket))
}

/// Short description of a channel for assertion messages.
pub fn describe_ch(c: &ChannelReport) -> String {
    format!(
        "{} {:?} pid {} {} (end {:?}, framing {}, W {:?}, set_acks {}, ack_syncs {}, acks {}, sent {}, received {}, max {:?})",
        c.channel_type,
        c.channel_id,
        c.pid,
        c.socket,
        c.end,
        c.framing,
        c.window,
        c.set_acks,
        c.ack_syncs,
        c.acks,
        c.messages_sent,
        c.messages_received,
        c.in_flight_max
    )
}

/// Reads a JSON report into [`Report`]. Fails on a field that is missing from the document
/// (serde alone would read a missing `Option` field as `None`) or of the wrong type.
pub fn parse_report(raw: &Value) -> Result<Report> {
    parse_typed(raw, "JSON report")
}

/// Reads `raw` into `T`. Fails on a field of `T` that `raw` lacks (serde alone would read a
/// missing `Option` field as `None`) or one of the wrong type; `what` names the document.
pub fn parse_typed<T: DeserializeOwned + Serialize>(raw: &Value, what: &str) -> Result<T> {
    let typed: T = serde_json::from_value(raw.clone()).with_context(|| what.to_string())?;
    missing_keys(&serde_json::to_value(&typed)?, raw, "", what)?;
    Ok(typed)
}

/// Fails if `typed` (the typed struct written back) has an object key `raw` lacks.
fn missing_keys(typed: &Value, raw: &Value, path: &str, what: &str) -> Result<()> {
    match (typed, raw) {
        (Value::Object(t), Value::Object(r)) => {
            for (k, v) in t {
                let p = format!("{path}.{k}");
                let rv = r.get(k).ok_or_else(|| anyhow!("{what} lacks field {p}"))?;
                missing_keys(v, rv, &p, what)?;
            }
        }
        (Value::Array(t), Value::Array(r)) => {
            for (i, (tv, rv)) in t.iter().zip(r).enumerate() {
                missing_keys(tv, rv, &format!("{path}[{i}]"), what)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// The hook set every privileged test expects: `tracepoints+sockops+libssl` (this project's
/// machines: the libssl uprobe programs load whether or not a watched process maps libssl),
/// with `fentry`, `kprobes` or `syscalls` first when `$SPICE_OBSERVER_HOOK_SET` (which the observer's binaries
/// read, and `.ci/run` sets for its second pass) forces it; or
/// `$SPICE_OBSERVER_EXPECT_HOOK_SET`.
pub fn expected_hook_set() -> String {
    let set = match std::env::var("SPICE_OBSERVER_HOOK_SET").as_deref() {
        Ok("syscalls") => "syscalls",
        Ok("fentry") => "fentry",
        Ok("kprobes") => "kprobes",
        _ => "tracepoints",
    };
    std::env::var("SPICE_OBSERVER_EXPECT_HOOK_SET")
        .unwrap_or_else(|_| format!("{set}+sockops+libssl"))
}

/// Checks every privileged test makes of a run: the expected hook set, nothing degraded, and
/// no information lost (the kernel's loss counters and missing records).
pub fn check_run(r: &Report) -> Result<()> {
    ensure!(
        r.hook_set == expected_hook_set(),
        "hook set {:?}, expected {:?}",
        r.hook_set,
        expected_hook_set()
    );
    ensure!(r.degraded.is_empty(), "degraded: {:?}", r.degraded);
    ensure!(
        r.events_lost == 0,
        "events lost: {} ({:?})",
        r.events_lost,
        r.kernel_counters
    );
    Ok(())
}

/// A per-test pin directory for `spice-observer daemon` (`--pin-dir`), so that no test sees
/// another's pinned kernel state: `/sys/fs/bpf/spice-observer-test-NAME`. Mounts the BPF
/// filesystem on /sys/fs/bpf if nothing is mounted there (as scripts/setup.sh does), removes
/// what an earlier run left, and `daemon --unpin`s it when dropped.
pub struct PinDir {
    pub path: PathBuf,
}

impl PinDir {
    pub fn new(name: &str) -> Result<Self> {
        let mounted = Command::new("mountpoint")
            .args(["-q", "/sys/fs/bpf"])
            .status()
            .context("running mountpoint")?
            .success();
        if !mounted {
            sh(Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]))?;
        }
        let p = PinDir {
            path: PathBuf::from(format!("/sys/fs/bpf/spice-observer-test-{name}")),
        };
        p.unpin()?;
        Ok(p)
    }

    /// `spice-observer daemon --pin-dir PATH --unpin`; returns its stdout.
    pub fn unpin(&self) -> Result<String> {
        sh(Command::new(env!("CARGO_BIN_EXE_spice-observer"))
            .args(["daemon", "--pin-dir"])
            .arg(&self.path)
            .arg("--unpin"))
    }

    /// Empties it ([`PinDir::unpin`]: a daemon started next loads afresh) and creates it again
    /// owned by `uid`, as a unit's `ExecStartPre=` does for a daemon that runs unprivileged
    /// and cannot create it on the BPF filesystem itself.
    pub fn reset_for(&self, uid: u32) -> Result<()> {
        self.unpin()?;
        std::fs::create_dir_all(&self.path)
            .with_context(|| format!("creating {} (bpffs)", self.path.display()))?;
        std::os::unix::fs::chown(&self.path, Some(uid), Some(uid))?;
        Ok(())
    }

    /// The config line naming it: `pin_dir = "PATH"`.
    pub fn config_line(&self) -> String {
        format!("pin_dir = {:?}\n", self.path)
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if let Err(e) = self.unpin() {
            eprintln!("unpinning {}: {e:#}", self.path.display());
        }
    }
}
