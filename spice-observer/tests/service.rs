//! The daemon as a system service: least privilege, readiness, reload, the systemd unit.
//!
//! * `service_least_privilege_session` (privileged): the daemon runs as `nobody` with only
//!   the documented capabilities (`setpriv`), tells a notify socket it is ready, shows the
//!   dropped set in `/proc/PID/task/*/status`, and counts a real Xspice session's display
//!   channel exactly as a root `observe` run alongside does.
//! * `service_each_capability_is_needed` (privileged): with one capability of the list
//!   missing, the daemon fails (attach capabilities) or cannot watch the Xspice (the two
//!   `/proc` ones), with a message naming it; with all of them it watches it.
//! * `service_sighup_reload_keeps_counts` (privileged): SIGHUP during a real session applies
//!   a new sample period and a relay rule, names the key that needs a restart, notifies
//!   RELOADING/READY, and the message totals keep growing from where they were.
//! * `service_unit_verifies`: `systemd-analyze verify` of packaging/spice-observer.service
//!   (pointed at the built binary) exits 0 and prints nothing; its capability lines are the
//!   code's list.
//! * `service_stop_post_unpins_only_on_stop`: the unit restarts and keeps the pins on the
//!   daemon's restart-in-place status (75), and its `ExecStopPost=` line, run with each
//!   `SERVICE_RESULT`/`EXIT_CODE`/`EXIT_STATUS` systemd may give it, removes the pins only
//!   after a clean stop.
//!
//! Ports 5990-5992, displays :90-:92, relay 6991, daemon on 127.0.0.1:19594. Run serially
//! under the machine-wide lock (`--test-threads=1`).

mod common;

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    os::unix::{fs::PermissionsExt, net::UnixDatagram},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use common::{Client, Rig, channels_of, check_run, privileged};
use spice_observer::host::privilege::{self, Need, ThreadCaps};
use spice_observer::report::Report;

const LISTEN: &str = "127.0.0.1:19594";
/// The unprivileged user the daemon runs as (`nobody` on Debian).
const UID: u32 = 65534;

/// setpriv's spelling of a capability set: `-all,+bpf,+perfmon`.
fn setpriv_caps(needs: &[Need]) -> String {
    let mut s = String::from("-all");
    for n in needs {
        s.push_str(",+");
        s.push_str(
            &privilege::name(n.cap)
                .trim_start_matches("CAP_")
                .to_lowercase(),
        );
    }
    s
}

/// The daemon binary where [`UID`] can run it: a copy in a world-readable directory (the
/// build's own path may be under a directory only root may enter, e.g. a checkout in /root).
fn daemon_binary() -> Result<PathBuf> {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    if let Some(p) = BIN.get() {
        return Ok(p.clone());
    }
    // One fixed place, replaced by rename (a daemon may still run the old file).
    let dir = std::env::temp_dir().join("spice-observer-service-bin");
    std::fs::create_dir_all(&dir)?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
    let bin = dir.join("spice-observer");
    let tmp = dir.join(format!("spice-observer.{}", std::process::id()));
    std::fs::copy(env!("CARGO_BIN_EXE_spice-observer"), &tmp)
        .with_context(|| format!("copying the daemon binary to {}", tmp.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&tmp, &bin)?;
    Ok(BIN.get_or_init(|| bin).clone())
}

/// A running daemon; SIGTERM when dropped.
struct Daemon {
    child: Child,
    log: mpsc::Receiver<String>,
    lines: Vec<String>,
}

impl Daemon {
    /// Starts `spice-observer daemon --config CONFIG` as [`UID`] with exactly `caps`
    /// (inheritable, ambient and bounding sets, no supplementary groups), `NOTIFY_SOCKET` =
    /// `notify` if given.
    fn spawn(caps: &[Need], config: &Path, notify: Option<&Path>) -> Result<Daemon> {
        let set = setpriv_caps(caps);
        let mut cmd = Command::new("setpriv");
        cmd.args([
            &format!("--reuid={UID}"),
            &format!("--regid={UID}"),
            "--clear-groups",
            &format!("--inh-caps={set}"),
            &format!("--ambient-caps={set}"),
            &format!("--bounding-set={set}"),
        ])
        .arg(daemon_binary()?)
        .args(["daemon", "--config"])
        .arg(config)
        .env("RUST_BACKTRACE", "0")
        .env_remove("NOTIFY_SOCKET")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        if let Some(n) = notify {
            cmd.env("NOTIFY_SOCKET", n);
        }
        let mut child = cmd
            .spawn()
            .context("starting the daemon under setpriv (util-linux)")?;
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
        Ok(Daemon {
            child,
            log: rx,
            lines: Vec::new(),
        })
    }

    /// Waits for a log line (since the start) matching `f`.
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

    /// Every line logged so far.
    fn text(&mut self) -> String {
        while let Ok(l) = self.log.try_recv() {
            self.lines.push(l);
        }
        self.lines.join("\n")
    }

    /// Waits for the daemon to exit on its own: its status and whole log.
    fn wait_exit(&mut self, timeout: Duration) -> Result<(ExitStatus, String)> {
        let t0 = Instant::now();
        while t0.elapsed() < timeout {
            if let Some(st) = self.child.try_wait()? {
                // The reader thread ends with the pipe.
                while let Ok(l) = self.log.recv_timeout(Duration::from_millis(500)) {
                    self.lines.push(l);
                }
                return Ok((st, self.lines.join("\n")));
            }
            thread::sleep(Duration::from_millis(50));
        }
        bail!("daemon still running after {timeout:?}:\n{}", self.text())
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn signal(&self, sig: i32) {
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.signal(libc::SIGTERM);
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The receiving end of `NOTIFY_SOCKET` (what systemd listens on): a datagram socket the
/// daemon's user may write to.
struct Notify {
    sock: UnixDatagram,
    path: PathBuf,
    got: Vec<String>,
}

impl Notify {
    fn bind(path: PathBuf) -> Result<Notify> {
        let _ = std::fs::remove_file(&path);
        let sock = UnixDatagram::bind(&path).with_context(|| format!("binding {path:?}"))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777))?;
        sock.set_read_timeout(Some(Duration::from_millis(100)))?;
        Ok(Notify {
            sock,
            path,
            got: Vec::new(),
        })
    }

    /// Waits for a datagram with the line `want` (e.g. `READY=1`); returns that datagram's
    /// lines. Datagrams before it are kept in `got`.
    fn expect(&mut self, want: &str, timeout: Duration) -> Result<Vec<String>> {
        let t0 = Instant::now();
        let mut buf = [0u8; 4096];
        while t0.elapsed() < timeout {
            if let Ok(n) = self.sock.recv(&mut buf) {
                let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                self.got.push(msg.clone());
                let lines: Vec<String> = msg.lines().map(str::to_string).collect();
                if lines.iter().any(|l| l == want) {
                    return Ok(lines);
                }
            }
        }
        bail!(
            "no {want} on the notify socket within {timeout:?}; got {:?}",
            self.got
        )
    }
}

impl Drop for Notify {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// An HTTP/1.0 GET of `path` on `listen`: (status code, body).
fn get_at(listen: &str, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(listen).with_context(|| format!("connecting to {listen}"))?;
    s.set_read_timeout(Some(Duration::from_secs(15)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {listen}\r\n\r\n")?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow!("no HTTP header end in {raw:?}"))?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("bad status line {head:?}"))?;
    Ok((code, body.to_string()))
}

fn get(path: &str) -> Result<(u16, String)> {
    get_at(LISTEN, path)
}

/// One sample of a scrape, typed (counters, gauges; histogram buckets as `_bucket`).
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A `/metrics` body parsed with the `prometheus-parse` crate.
struct Scrape(Vec<Sample>);

impl Scrape {
    fn take() -> Result<Scrape> {
        let (code, text) = get("/metrics")?;
        ensure!(code == 200, "/metrics answered {code}: {text}");
        let parsed = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
            .context("parsing the scrape")?;
        let mut out = Vec::new();
        for s in parsed.samples {
            let labels: BTreeMap<String, String> = s
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => out.push(Sample {
                    name: s.metric,
                    labels,
                    value: v,
                }),
                prometheus_parse::Value::Histogram(b) => {
                    for b in b {
                        let mut l = labels.clone();
                        l.insert("le".into(), b.less_than.to_string());
                        out.push(Sample {
                            name: format!("{}_bucket", s.metric),
                            labels: l,
                            value: b.count,
                        });
                    }
                }
                prometheus_parse::Value::Summary(_) => bail!("summary {} in scrape", s.metric),
            }
        }
        Ok(Scrape(out))
    }

    fn find(&self, name: &str, with: &[(&str, &str)]) -> Vec<&Sample> {
        self.0
            .iter()
            .filter(|s| {
                s.name == name
                    && with
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .collect()
    }

    /// The one sample of `name` matching `with`; an error if none or several.
    fn one(&self, name: &str, with: &[(&str, &str)]) -> Result<f64> {
        match self.find(name, with)[..] {
            [s] => Ok(s.value),
            [] => bail!("no sample {name} {with:?}"),
            ref many => bail!("{} samples {name} {with:?}: {many:?}", many.len()),
        }
    }

    /// spice-server's display messages toward the client, of VM `vm`.
    fn display_sent(&self, vm: &str) -> Result<f64> {
        self.one(
            "spice_observer_messages_total",
            &[
                ("vm", vm),
                ("leg", "server"),
                ("channel", "display"),
                ("direction", "server_to_client"),
            ],
        )
    }

    /// The run checks (as tests/daemon.rs makes them): the expected hook set, `degraded`
    /// degraded entries, every information-lost counter 0.
    fn check_run(&self, degraded: f64) -> Result<()> {
        let hook = common::expected_hook_set();
        ensure!(
            self.one("spice_observer_hook_set_info", &[("hook_set", &hook)])? == 1.0,
            "hook set"
        );
        let d = self.one("spice_observer_degraded_features", &[])?;
        ensure!(d == degraded, "degraded features {d}, expected {degraded}");
        let lost = self.find("spice_observer_information_lost_total", &[]);
        ensure!(lost.len() >= 9, "loss counters: {lost:?}");
        for l in lost {
            ensure!(l.value == 0.0, "information lost: {l:?}");
        }
        Ok(())
    }
}

/// The test's pin directory on the BPF filesystem, owned by [`UID`] (as the unit's
/// `ExecStartPre=` makes it), for builds whose config has `pin_dir` (the daemon pins its
/// kernel state there); removed with everything in it when dropped.
struct PinDir(Option<PathBuf>);

impl PinDir {
    fn new(test: &str) -> Result<PinDir> {
        let path = PathBuf::from(format!("/sys/fs/bpf/{test}"));
        let supported =
            spice_observer::config::Config::parse(&format!("pin_dir = {:?}\n", path)).is_ok();
        if !supported {
            return Ok(PinDir(None));
        }
        let d = PinDir(Some(path));
        d.reset()?;
        Ok(d)
    }

    /// Empties it (a daemon started next loads afresh, instead of continuing the pinned
    /// state with fewer capabilities) and gives it to [`UID`].
    fn reset(&self) -> Result<()> {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_dir_all(p);
            std::fs::create_dir_all(p).with_context(|| format!("creating {p:?} (bpffs)"))?;
            std::os::unix::fs::chown(p, Some(UID), Some(UID))?;
        }
        Ok(())
    }

    /// The config line naming it, if the build has `pin_dir`.
    fn line(&self) -> String {
        self.0
            .as_ref()
            .map_or(String::new(), |p| format!("pin_dir = {p:?}\n"))
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// Writes the daemon's config into the rig's state directory (readable by [`UID`]).
fn write_config(rig: &Rig, pins: &PinDir, body: &str) -> Result<PathBuf> {
    let path = rig.state.join("spice-observer.toml");
    std::fs::write(
        &path,
        format!("listen = \"{LISTEN}\"\n{}{body}", pins.line()),
    )?;
    // The daemon's user reads it; the state directory is created world-readable.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
    Ok(path)
}

/// Every documented capability.
fn all() -> Vec<Need> {
    privilege::needed().collect()
}

/// True if the daemon can run as [`UID`]: the test binary's path is readable by it, and
/// setpriv exists. Otherwise the reason (a skip, or under CI=true a failure).
fn can_run_as_user(test: &str) -> Result<bool> {
    let bin = daemon_binary()?;
    let ok = Command::new("setpriv")
        .args([
            &format!("--reuid={UID}"),
            &format!("--regid={UID}"),
            "--clear-groups",
        ])
        .arg(&bin)
        .arg("--version")
        .output();
    match ok {
        Ok(o) if o.status.success() => Ok(true),
        other => {
            let msg = common::cannot_run(
                test,
                &format!(
                    "uid {UID} cannot run {} through setpriv: {other:?}",
                    bin.display()
                ),
            );
            if common::ci() {
                bail!("{msg}");
            }
            eprintln!("{msg}");
            Ok(false)
        }
    }
}

/// The daemon as `nobody` with exactly the documented capabilities, before a real Xspice
/// session: READY=1 on the notify socket; every thread's status shows only
/// CAP_DAC_READ_SEARCH and CAP_SYS_PTRACE permitted and effective, nothing inheritable or
/// ambient, the bounding set = the list; bpf_stats is refused (no CAP_SYS_ADMIN) and listed
/// as degraded; the display channel's totals equal those of a root `observe` run alongside.
#[test]
fn service_least_privilege_session() -> Result<()> {
    const T: &str = "service_least_privilege_session";
    if !privileged(T) || !can_run_as_user(T)? {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let pins = PinDir::new(T)?;
    let config = write_config(
        &rig,
        &pins,
        "sample_ms = 100\nscan_ms = 200\nbpf_stats = true\n[discovery]\nqemu = true\nxspice = true\n",
    )?;
    let mut notify = Notify::bind(rig.state.join("notify.sock"))?;
    let mut daemon = Daemon::spawn(&all(), &config, Some(&notify.path))?;
    daemon.wait_line(
        |l| l.contains("listening on http://"),
        Duration::from_secs(60),
    )?;
    let ready = notify.expect("READY=1", Duration::from_secs(5))?;
    ensure!(
        ready.iter().any(|l| l.starts_with("STATUS=listening on ")),
        "{ready:?}"
    );

    // The dropped set, on every thread of the daemon.
    let steady = privilege::mask(privilege::STEADY.map(|n| n.cap));
    let listed = privilege::mask(all().iter().map(|n| n.cap));
    let threads = ThreadCaps::of_process(daemon.pid())?;
    println!("daemon threads' capabilities: {threads:x?}");
    for (tid, c) in &threads {
        ensure!(
            c.effective == steady && c.permitted == steady,
            "thread {tid}: CapEff {:x} ({:?}), CapPrm {:x}: expected {:x} ({:?})",
            c.effective,
            privilege::names(c.effective),
            c.permitted,
            steady,
            privilege::names(steady)
        );
        ensure!(c.inheritable == 0 && c.ambient == 0, "thread {tid}: {c:x?}");
        ensure!(
            c.bounding == listed,
            "thread {tid}: CapBnd {:x}",
            c.bounding
        );
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", daemon.pid()))?;
    let uid_line = status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .ok_or_else(|| anyhow!("no Uid line"))?;
    ensure!(
        uid_line
            .split_whitespace()
            .skip(1)
            .all(|u| u == UID.to_string()),
        "{uid_line}"
    );
    daemon.wait_line(
        |l| l.contains("capabilities kept after attach: CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE;"),
        Duration::from_secs(1),
    )?;
    daemon.wait_line(
        |l| l.contains("degraded: bpf_stats off") && l.contains("CAP_SYS_ADMIN"),
        Duration::from_secs(1),
    )?;
    let (code, landing) = get("/")?;
    ensure!(
        code == 200 && landing.contains("kept after attach: CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE"),
        "landing page {code}: {landing}"
    );

    // A session that starts after the daemon: found, and counted as observe counts it.
    let xorg = rig.xspice(
        5990,
        90,
        &[
            "--mode",
            "rects",
            "--fps",
            "50",
            "--count",
            "20",
            "--seconds",
            "10",
        ],
    )?;
    daemon.wait_line(
        |l| l.contains("found xspice xspice-90") && l.contains(&format!("pid {xorg},")),
        Duration::from_secs(5),
    )?;
    let obs = observe_or_skip!(T, &[xorg], 9.0, rig.state.join("report.json"));
    let t_obs = Instant::now();
    let _client = Client::start("spice://127.0.0.1:5990", 30, &[], None)?;
    thread::sleep(Duration::from_secs(8).saturating_sub(t_obs.elapsed()));
    let before = Scrape::take()?;
    let report: Report = obs.finish_report()?;
    let after = Scrape::take()?;
    check_run(&report)?;
    after.check_run(1.0)?;
    ensure!(
        after.find("spice_observer_bpf_runs_total", &[]).is_empty(),
        "bpf_runs_total exported without BPF_ENABLE_STATS"
    );
    let displays: Vec<_> = channels_of(&report, xorg, "display")
        .into_iter()
        .filter(|c| c.end.as_deref() == Some("server") && !c.closed)
        .collect();
    ensure!(
        displays.len() == 1,
        "observe's display channels: {}",
        displays.len()
    );
    let want = displays[0].messages_sent as f64;
    let (a, b) = (
        before.display_sent("xspice-90")?,
        after.display_sent("xspice-90")?,
    );
    println!("display messages: daemon {a} before and {b} after observe's end, observe {want}");
    ensure!(want > 100.0, "observe counted only {want} display messages");
    ensure!(
        a <= want && want <= b,
        "display messages: observe {want}, daemon {a} before and {b} after its end"
    );
    Ok(())
}

/// One capability of the list missing at a time: each of CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN
/// makes the daemon exit with an error naming it; without CAP_DAC_READ_SEARCH or
/// CAP_SYS_PTRACE it runs but cannot watch the running Xspice, and its warning names the
/// capability. With all of them (the control) it watches it. With CAP_SYS_ADMIN added,
/// `bpf_stats` works (program run counts > 0 after the drop) and nothing is degraded.
#[test]
fn service_each_capability_is_needed() -> Result<()> {
    const T: &str = "service_each_capability_is_needed";
    if !privileged(T) || !can_run_as_user(T)? {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let pins = PinDir::new(T)?;
    let config = write_config(&rig, &pins, "scan_ms = 200\nbpf_stats = false\n")?;
    let xorg = rig.xspice(
        5992,
        92,
        &["--mode", "rects", "--fps", "10", "--seconds", "60"],
    )?;
    let found =
        |l: &str| l.contains("found xspice xspice-92") && l.contains(&format!("pid {xorg},"));
    {
        let mut d = Daemon::spawn(&all(), &config, None)?;
        d.wait_line(found, Duration::from_secs(30))
            .context("control: all capabilities")?;
    }
    for need in privilege::ATTACH {
        let name = privilege::name(need.cap);
        let caps: Vec<Need> = all().into_iter().filter(|n| n.cap != need.cap).collect();
        pins.reset()?;
        let mut d = Daemon::spawn(&caps, &config, None)?;
        let (st, log) = d.wait_exit(Duration::from_secs(30))?;
        println!("without {name}: {st}: {}", log.lines().last().unwrap_or(""));
        ensure!(
            !st.success(),
            "without {name} the daemon exited {st}:\n{log}"
        );
        ensure!(
            log.contains(&format!("lacks {name}")),
            "without {name}, the error does not name it:\n{log}"
        );
    }
    for need in privilege::STEADY {
        let name = privilege::name(need.cap);
        let caps: Vec<Need> = all().into_iter().filter(|n| n.cap != need.cap).collect();
        pins.reset()?;
        let mut d = Daemon::spawn(&caps, &config, None)?;
        let warned = d.wait_line(
            |l| l.contains("WARN") && l.contains(&format!("lacks {name}")),
            Duration::from_secs(30),
        )?;
        println!("without {name}: {warned}");
        // Several scans later the Xspice is still not watched.
        thread::sleep(Duration::from_secs(1));
        let log = d.text();
        ensure!(
            !log.lines().any(found),
            "without {name} the daemon watched the Xspice:\n{log}"
        );
    }

    // The optional one: with CAP_SYS_ADMIN too, bpf_stats works, also after the drop (run
    // counts are read through the program descriptors), and CAP_SYS_ADMIN is dropped too.
    pins.reset()?;
    let config = write_config(&rig, &pins, "scan_ms = 200\nbpf_stats = true\n")?;
    let mut caps = all();
    caps.push(Need {
        cap: privilege::BPF_STATS_CAP,
        why: "BPF_ENABLE_STATS",
    });
    let mut d = Daemon::spawn(&caps, &config, None)?;
    d.wait_line(found, Duration::from_secs(30))?;
    thread::sleep(Duration::from_secs(1));
    let s = Scrape::take()?;
    s.check_run(0.0)?;
    let runs: f64 = s
        .find("spice_observer_bpf_runs_total", &[])
        .iter()
        .map(|x| x.value)
        .sum();
    ensure!(runs > 0.0, "bpf_runs_total {runs} with CAP_SYS_ADMIN");
    let steady = privilege::mask(privilege::STEADY.map(|n| n.cap));
    for (tid, c) in ThreadCaps::of_process(d.pid())? {
        ensure!(
            c.effective == steady && c.permitted == steady,
            "thread {tid}: {c:x?}"
        );
    }
    println!("with CAP_SYS_ADMIN: {runs} BPF program runs counted, CapEff {steady:x} after attach");
    Ok(())
}

/// SIGHUP during a real session: RELOADING=1 then READY=1; sample_ms 100 → 250 and a new
/// relay rule are applied (the landing page shows them, the already running socat is found),
/// the changed listen address is named as needing a restart (and the old one keeps
/// serving); the display channel's message total keeps growing from its value before the
/// reload, and the engine's start time is unchanged.
#[test]
fn service_sighup_reload_keeps_counts() -> Result<()> {
    const T: &str = "service_sighup_reload_keeps_counts";
    if !privileged(T) || !can_run_as_user(T)? {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let body = |sample: u64, relays: &str| {
        format!(
            "sample_ms = {sample}\nscan_ms = 200\nbpf_stats = false\n[discovery]\nrelays = [{relays}]\n"
        )
    };
    let pins = PinDir::new(T)?;
    let config = write_config(&rig, &pins, &body(100, ""))?;
    let mut notify = Notify::bind(rig.state.join("notify.sock"))?;
    let mut daemon = Daemon::spawn(&all(), &config, Some(&notify.path))?;
    daemon.wait_line(
        |l| l.contains("listening on http://"),
        Duration::from_secs(60),
    )?;
    notify.expect("READY=1", Duration::from_secs(5))?;
    let xorg = rig.xspice(
        5991,
        91,
        &["--mode", "rects", "--fps", "30", "--seconds", "40"],
    )?;
    let relay = rig.relay("socat", "127.0.0.1", 6991, "127.0.0.1", 5991)?;
    daemon.wait_line(
        |l| l.contains("found xspice xspice-91") && l.contains(&format!("pid {xorg},")),
        Duration::from_secs(5),
    )?;
    let _client = Client::start("spice://127.0.0.1:5991", 40, &[], None)?;
    thread::sleep(Duration::from_secs(3));
    let (_, landing) = get("/")?;
    ensure!(landing.contains("sample_ms 100,"), "{landing}");
    let s1 = Scrape::take()?;
    let m1 = s1.display_sent("xspice-91")?;
    let started = s1.one("spice_observer_start_time_seconds", &[])?;
    ensure!(m1 > 10.0, "display messages before the reload: {m1}");
    ensure!(
        !daemon.text().contains("found relay"),
        "socat watched before its rule was added"
    );

    // The new settings; the listen address changes too (needs a restart: not applied).
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:19595\"\n{}{}",
            pins.line(),
            body(250, "{ name = \"socat\" }")
        ),
    )?;
    daemon.signal(libc::SIGHUP);
    let reloading = notify.expect("RELOADING=1", Duration::from_secs(5))?;
    ensure!(
        reloading.iter().any(|l| l.starts_with("MONOTONIC_USEC=")),
        "{reloading:?}"
    );
    notify.expect("READY=1", Duration::from_secs(5))?;
    daemon.wait_line(
        |l| {
            l.contains("reloaded")
                && l.contains("applied sample_ms: 100 -> 250")
                && l.contains("relay socat")
        },
        Duration::from_secs(2),
    )?;
    daemon.wait_line(
        |l| l.contains("not applied until a restart: listen (127.0.0.1:19594 -> 127.0.0.1:19595)"),
        Duration::from_secs(2),
    )?;
    daemon.wait_line(
        |l| l.contains("found relay (socat) socat") && l.contains(&format!("pid {relay},")),
        Duration::from_secs(2),
    )?;
    let (code, landing) = get("/")?;
    ensure!(
        code == 200 && landing.contains("sample_ms 250,") && landing.contains("relays [socat]"),
        "landing page after the reload {code}: {landing}"
    );
    let s2 = Scrape::take()?;
    let m2 = s2.display_sent("xspice-91")?;
    thread::sleep(Duration::from_secs(2));
    let s3 = Scrape::take()?;
    let m3 = s3.display_sent("xspice-91")?;
    println!("display messages: {m1} before the reload, {m2} just after, {m3} 2 s later");
    ensure!(
        m1 <= m2 && m2 < m3,
        "display totals {m1}, {m2}, {m3}: reset or stalled"
    );
    ensure!(
        s3.one("spice_observer_start_time_seconds", &[])? == started,
        "engine restarted"
    );
    s3.check_run(0.0)?;
    ensure!(daemon.child.try_wait()?.is_none(), "daemon exited");
    Ok(())
}

/// `systemd-analyze verify` of the unit (ExecStart etc. pointed at the built binary) exits 0
/// and prints nothing; the unit's AmbientCapabilities and CapabilityBoundingSet are the
/// code's list ([`privilege::needed`]).
#[test]
fn service_unit_verifies() -> Result<()> {
    const T: &str = "service_unit_verifies";
    let unit_path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/spice-observer.service");
    let unit = std::fs::read_to_string(&unit_path)?;
    let want: Vec<String> = privilege::needed()
        .map(|n| privilege::name(n.cap))
        .collect();
    for key in ["AmbientCapabilities=", "CapabilityBoundingSet="] {
        let line = unit
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .ok_or_else(|| anyhow!("unit has no {key}"))?;
        let got: Vec<&str> = line.split_whitespace().collect();
        ensure!(got == want, "{key}{line}: expected {want:?}");
    }
    let dir = std::env::temp_dir().join(format!("spice-observer-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let copy = dir.join("spice-observer.service");
    std::fs::write(
        &copy,
        unit.replace(
            "/usr/local/bin/spice-observer",
            env!("CARGO_BIN_EXE_spice-observer"),
        ),
    )?;
    let out = match Command::new("systemd-analyze")
        .arg("verify")
        .arg(&copy)
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            let msg = common::cannot_run(
                T,
                &format!(
                    "systemd-analyze (Debian package systemd; scripts/setup.sh installs it): {e}"
                ),
            );
            if common::ci() {
                bail!("{msg}");
            }
            eprintln!("{msg}");
            return Ok(());
        }
    };
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify ({}):\n{said}",
        out.status
    );

    // The sysusers.d file creates the unit's User= and Group= (in a scratch root; needs root
    // to write its files with their owners).
    let user = unit
        .lines()
        .find_map(|l| l.strip_prefix("User="))
        .ok_or_else(|| anyhow!("unit has no User="))?;
    ensure!(
        unit.lines().any(|l| l == format!("Group={user}")),
        "unit's Group= is not {user}"
    );
    if unsafe { libc::geteuid() } == 0 {
        let root = dir.join("root");
        std::fs::create_dir_all(root.join("etc"))?;
        let out = Command::new("systemd-sysusers")
            .arg(format!("--root={}", root.display()))
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/spice-observer.sysusers"))
            .output()?;
        ensure!(out.status.success(), "systemd-sysusers: {out:?}");
        let passwd = std::fs::read_to_string(root.join("etc/passwd"))?;
        let entry = passwd
            .lines()
            .find(|l| l.starts_with(&format!("{user}:")))
            .ok_or_else(|| anyhow!("sysusers created no {user}: {passwd}"))?;
        ensure!(entry.ends_with(":/usr/sbin/nologin"), "{entry}");
        let group = std::fs::read_to_string(root.join("etc/group"))?;
        ensure!(
            group.lines().any(|l| l.starts_with(&format!("{user}:"))),
            "sysusers created no group {user}: {group}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The unit's restart in place and stop action: `RestartForceExitStatus=` and
/// `SuccessExitStatus=` name the daemon's SIGUSR2 exit status
/// (`spice_observer::cmd::daemon::EXIT_RESTART`), and its `ExecStopPost=` line, run by
/// `/bin/sh` with the environment systemd gives it (systemd.exec(5), "Summary of possible
/// service result variable values") and the built binary on a scratch pin directory, removes
/// the pins after a stop (exit 0; SIGTERM before the handler is installed) and keeps them
/// after the restart in place (75) and after failures (exit 1, SIGKILL, a core dump, a
/// timeout). Not privileged: `--unpin` on a plain directory removes its files as on bpffs.
#[test]
fn service_stop_post_unpins_only_on_stop() -> Result<()> {
    let unit_path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/spice-observer.service");
    let unit = std::fs::read_to_string(&unit_path)?;
    let code = spice_observer::cmd::daemon::EXIT_RESTART.to_string();
    for key in ["RestartForceExitStatus=", "SuccessExitStatus="] {
        let line = unit
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .ok_or_else(|| anyhow!("unit has no {key}"))?;
        ensure!(line.trim() == code, "{key}{line}: expected {code}");
    }
    let post = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStopPost="))
        .ok_or_else(|| anyhow!("unit has no ExecStopPost="))?;
    // systemd's command line: `/bin/sh -c '…'`, with `$$` for a literal `$`.
    let script = post
        .strip_prefix("/bin/sh -c '")
        .and_then(|s| s.strip_suffix('\''))
        .ok_or_else(|| anyhow!("ExecStopPost= is not /bin/sh -c '…': {post}"))?
        .replace("$$", "$");
    let dir = std::env::temp_dir().join(format!("spice-observer-stoppost-{}", std::process::id()));
    let pins = dir.join("pins");
    let config = dir.join("spice-observer.toml");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(&config, format!("pin_dir = \"{}\"\n", pins.display()))?;
    let script = script
        .replace(
            "/usr/local/bin/spice-observer",
            env!("CARGO_BIN_EXE_spice-observer"),
        )
        .replace(
            "/etc/spice-observer/spice-observer.toml",
            config.to_str().unwrap(),
        );
    // (SERVICE_RESULT, EXIT_CODE, EXIT_STATUS, pins removed)
    let cases = [
        ("success", "exited", "0", true),
        ("success", "killed", "TERM", true),
        ("success", "exited", code.as_str(), false),
        ("exit-code", "exited", "1", false),
        ("signal", "killed", "KILL", false),
        ("core-dump", "dumped", "SEGV", false),
        ("timeout", "killed", "KILL", false),
    ];
    for (result, exit_code, status, removed) in cases {
        std::fs::create_dir_all(&pins)?;
        std::fs::write(pins.join("link_spice_sys_enter"), "")?;
        std::fs::write(pins.join("SOCKETS"), "")?;
        let out = Command::new("/bin/sh")
            .arg("-c")
            .arg(&script)
            .env("SERVICE_RESULT", result)
            .env("EXIT_CODE", exit_code)
            .env("EXIT_STATUS", status)
            .output()?;
        let said = String::from_utf8_lossy(&out.stdout);
        println!(
            "{result} {exit_code} {status}: {} {}",
            out.status,
            said.trim()
        );
        ensure!(
            out.status.success(),
            "ExecStopPost for {result} {exit_code} {status}: {out:?}"
        );
        ensure!(
            pins.exists() != removed,
            "ExecStopPost for {result} {exit_code} {status}: pins {} ({said})",
            if removed { "kept" } else { "removed" }
        );
        if removed {
            ensure!(said.contains("removed 2"), "--unpin said {said:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
