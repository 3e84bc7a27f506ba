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
    os::unix::{fs::PermissionsExt, net::UnixDatagram},
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use common::daemon::{Daemon, OnDrop, Scrape, http_get};
use common::{Client, PinDir, Rig, channels_of, check_run, privileged};
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

/// Starts `spice-observer daemon --config CONFIG` as [`UID`] with exactly `caps`
/// (inheritable, ambient and bounding sets, no supplementary groups), `NOTIFY_SOCKET` =
/// `notify` if given; does not wait for it. SIGTERM when dropped.
fn spawn_daemon(caps: &[Need], config: &Path, notify: Option<&Path>) -> Result<Daemon> {
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
    .env_remove("NOTIFY_SOCKET");
    if let Some(n) = notify {
        cmd.env("NOTIFY_SOCKET", n);
    }
    Daemon::spawn(
        cmd,
        OnDrop::Terminate,
        "the daemon under setpriv (util-linux)",
    )
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

/// An HTTP/1.0 GET of `path` from the daemon: (status code, body).
fn get(path: &str) -> Result<(u16, String)> {
    http_get(LISTEN, path)
}

/// spice-server's display messages toward the client, of VM `vm`.
fn display_sent(s: &Scrape, vm: &str) -> Result<f64> {
    s.one(
        "spice_observer_messages_total",
        &[
            ("vm", vm),
            ("leg", "server"),
            ("channel", "display"),
            ("direction", "server_to_client"),
        ],
    )
}

/// The test's pin directory on the BPF filesystem (`common::PinDir`), empty and owned by
/// [`UID`] (as the unit's `ExecStartPre=` makes it); the daemon pins its kernel state there.
fn pin_dir(test: &str) -> Result<PinDir> {
    let pins = PinDir::new(test)?;
    pins.reset_for(UID)?;
    Ok(pins)
}

/// Writes the daemon's config into the rig's state directory (readable by [`UID`]).
fn write_config(rig: &Rig, pins: &PinDir, body: &str) -> Result<PathBuf> {
    let path = rig.state.join("spice-observer.toml");
    std::fs::write(
        &path,
        format!("listen = \"{LISTEN}\"\n{}{body}", pins.config_line()),
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

/// The rig and pin directory ([`pin_dir`]) of privileged test `test`, or `None` if it cannot
/// run here ([`privileged`], [`can_run_as_user`]: a skip; under CI=true those fail instead).
fn service_rig(test: &str) -> Result<Option<(Rig, PinDir)>> {
    if !privileged(test) || !can_run_as_user(test)? {
        return Ok(None);
    }
    let rig = Rig::new(test)?;
    Ok(Some((rig, pin_dir(test)?)))
}

/// The daemon as `nobody` with exactly the documented capabilities, before a real Xspice
/// session: READY=1 on the notify socket; every thread's status shows only
/// CAP_DAC_READ_SEARCH and CAP_SYS_PTRACE permitted and effective, nothing inheritable or
/// ambient, the bounding set = the list; bpf_stats is refused (no CAP_SYS_ADMIN) and listed
/// as degraded; the display channel's totals equal those of a root `observe` run alongside.
#[test]
fn service_least_privilege_session() -> Result<()> {
    const T: &str = "service_least_privilege_session";
    let Some((mut rig, pins)) = service_rig(T)? else {
        return Ok(());
    };
    let config = write_config(
        &rig,
        &pins,
        "sample_ms = 100\nscan_ms = 200\nbpf_stats = true\n[discovery]\nqemu = true\nxspice = true\n",
    )?;
    let mut notify = Notify::bind(rig.state.join("notify.sock"))?;
    let mut daemon = spawn_daemon(&all(), &config, Some(&notify.path))?;
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
    let xorg = rig.xspice_rects(5990, 90, 10)?;
    daemon.wait_line(
        |l| l.contains("found xspice xspice-90") && l.contains(&format!("pid {xorg},")),
        Duration::from_secs(5),
    )?;
    let obs = observe_or_skip!(T, &[xorg], 9.0, rig.state.join("report.json"));
    let t_obs = Instant::now();
    let _client = Client::start("spice://127.0.0.1:5990", 30, &[], None)?;
    thread::sleep(Duration::from_secs(8).saturating_sub(t_obs.elapsed()));
    let before = Scrape::take(LISTEN)?;
    let report: Report = obs.finish_report()?;
    let after = Scrape::take(LISTEN)?;
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
        display_sent(&before, "xspice-90")?,
        display_sent(&after, "xspice-90")?,
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
    let Some((mut rig, pins)) = service_rig(T)? else {
        return Ok(());
    };
    let config = write_config(&rig, &pins, "scan_ms = 200\nbpf_stats = false\n")?;
    let xorg = rig.xspice(
        5992,
        92,
        &["--mode", "rects", "--fps", "10", "--seconds", "60"],
    )?;
    let found =
        |l: &str| l.contains("found xspice xspice-92") && l.contains(&format!("pid {xorg},"));
    {
        let mut d = spawn_daemon(&all(), &config, None)?;
        d.wait_line(found, Duration::from_secs(30))
            .context("control: all capabilities")?;
    }
    for need in privilege::ATTACH {
        let name = privilege::name(need.cap);
        let caps: Vec<Need> = all().into_iter().filter(|n| n.cap != need.cap).collect();
        pins.reset_for(UID)?;
        let mut d = spawn_daemon(&caps, &config, None)?;
        let (st, log) = d.wait_exit(Duration::from_secs(30))?;
        let log = log.join("\n");
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
        pins.reset_for(UID)?;
        let mut d = spawn_daemon(&caps, &config, None)?;
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
    // counts are read through the program descriptors), and CAP_SYS_ADMIN is dropped too
    // when the libssl hooks are off.
    let mut caps = all();
    caps.push(Need {
        cap: privilege::BPF_STATS_CAP,
        why: "BPF_ENABLE_STATS",
    });
    let steady = privilege::mask(privilege::STEADY.map(|n| n.cap));
    let with_tls = privilege::mask(
        privilege::STEADY
            .iter()
            .chain([&privilege::TLS_HOOKS_CAP])
            .map(|n| n.cap),
    );
    for (tls_hooks, want) in [(false, steady), (true, with_tls)] {
        pins.reset_for(UID)?;
        let config = write_config(
            &rig,
            &pins,
            &format!("scan_ms = 200\nbpf_stats = true\ntls_hooks = {tls_hooks}\n"),
        )?;
        let mut d = spawn_daemon(&caps, &config, None)?;
        d.wait_line(found, Duration::from_secs(30))?;
        thread::sleep(Duration::from_secs(1));
        let s = Scrape::take(LISTEN)?;
        // The libssl programs are loaded either way, but in use only with the hooks on.
        let hook = common::expected_hook_set();
        if tls_hooks {
            s.check_run_with_hooks(0.0, &hook)?;
        } else {
            s.check_run_with_hooks(0.0, &hook.replace("+libssl", ""))?;
        }
        let runs: f64 = s
            .find("spice_observer_bpf_runs_total", &[])
            .iter()
            .map(|x| x.value)
            .sum();
        ensure!(runs > 0.0, "bpf_runs_total {runs} with CAP_SYS_ADMIN");
        // Only the libssl hooks keep CAP_SYS_ADMIN after attach: they hook each process
        // found later (perf_event_open of the uprobe PMU).
        for (tid, c) in ThreadCaps::of_process(d.pid())? {
            ensure!(
                c.effective == want && c.permitted == want,
                "tls_hooks = {tls_hooks}: thread {tid}: {c:x?}, want {want:x}"
            );
        }
        println!(
            "with CAP_SYS_ADMIN, tls_hooks = {tls_hooks}: {runs} BPF program runs counted, \
             CapEff {want:x} after attach"
        );
    }
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
    let Some((mut rig, pins)) = service_rig(T)? else {
        return Ok(());
    };
    let body = |sample: u64, relays: &str| {
        format!(
            "sample_ms = {sample}\nscan_ms = 200\nbpf_stats = false\n[discovery]\nrelays = [{relays}]\n"
        )
    };
    let config = write_config(&rig, &pins, &body(100, ""))?;
    let mut notify = Notify::bind(rig.state.join("notify.sock"))?;
    let mut daemon = spawn_daemon(&all(), &config, Some(&notify.path))?;
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
    let s1 = Scrape::take(LISTEN)?;
    let m1 = display_sent(&s1, "xspice-91")?;
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
            pins.config_line(),
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
    let s2 = Scrape::take(LISTEN)?;
    let m2 = display_sent(&s2, "xspice-91")?;
    thread::sleep(Duration::from_secs(2));
    let s3 = Scrape::take(LISTEN)?;
    let m3 = display_sent(&s3, "xspice-91")?;
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
    ensure!(daemon.exited()?.is_none(), "daemon exited");
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
    common::silent_success(&out, "systemd-analyze verify")?;

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
/// timeout). The line names the pin directory (`--pin-dir`), replaced here by the scratch one,
/// and the config file has a typo: the unpin must not depend on it. Not privileged: `--unpin`
/// on a plain directory removes its files as on bpffs.
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
    // A config with a typo: the stop action must not depend on it (it names the pin
    // directory itself).
    std::fs::write(&config, format!("pin_dri = \"{}\"\n", pins.display()))?;
    ensure!(
        script.contains("--pin-dir /sys/fs/bpf/spice-observer --unpin"),
        "ExecStopPost= does not name the pin directory: {script}"
    );
    let script = script
        .replace(
            "/usr/local/bin/spice-observer",
            env!("CARGO_BIN_EXE_spice-observer"),
        )
        .replace(
            "/etc/spice-observer/spice-observer.toml",
            config.to_str().unwrap(),
        )
        .replace("/sys/fs/bpf/spice-observer", pins.to_str().unwrap());
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
        std::fs::write(pins.join("link_spice_sock_send"), "")?;
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

/// `daemon --help` says what each signal does (SIGTERM: exit 0, pins kept; SIGUSR2: exit 75,
/// pins kept, restart in place; SIGHUP: reload), and `--unpin`'s help says it is refused
/// while a daemon runs (with `--force`), not that it detaches a running daemon's programs.
/// Not privileged.
#[test]
fn service_daemon_help_says_signals() -> Result<()> {
    let out = Command::new(env!("CARGO_BIN_EXE_spice-observer"))
        .args(["daemon", "--help"])
        .output()?;
    ensure!(out.status.success(), "daemon --help: {out:?}");
    let help = String::from_utf8_lossy(&out.stdout).replace('\n', " ");
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    for want in [
        "SIGTERM (or SIGINT) stops it with exit status 0 and keeps the kernel state pinned",
        "SIGUSR2 stops it with exit status 75 and keeps the pins too, for a restart in place",
        "SIGHUP re-reads the config file",
        "Refused while a daemon runs on the directory",
        "--force",
    ] {
        ensure!(help.contains(want), "daemon --help lacks {want:?}: {help}");
    }
    ensure!(
        !help.contains("programs detached unless"),
        "daemon --help: {help}"
    );
    Ok(())
}

/// A pin directory the service user may not write: root's, mode 0700 (no `ExecStartPre=`
/// chown), and then one a root daemon left its pins in. The daemon as `nobody` with the
/// unit's capabilities (setpriv) fails at start with an error whose headline names the
/// directory, its owner (uid 0) and mode, and the fixes (chown, or `--unpin` as root), not
/// "something else refuses"; `--unpin` as `nobody` on the root daemon's pins says the same
/// and removes nothing; as root it removes them.
#[test]
fn service_unwritable_pin_dir_is_named() -> Result<()> {
    const T: &str = "service_unwritable_pin_dir_is_named";
    let Some((rig, pins)) = service_rig(T)? else {
        return Ok(());
    };
    let config = write_config(&rig, &pins, "bpf_stats = false\n")?;
    std::os::unix::fs::chown(&pins.path, Some(0), Some(0))?;
    std::fs::set_permissions(&pins.path, std::fs::Permissions::from_mode(0o700))?;
    let check = |text: &str, what: &str, mode: &str| -> Result<()> {
        let headline = text
            .lines()
            .find(|l| l.starts_with("Error: "))
            .ok_or_else(|| anyhow!("{what}: no Error: line in {text}"))?;
        for want in [
            pins.path.to_str().unwrap(),
            "owned by uid 0",
            mode,
            "chown",
            "--unpin",
        ] {
            ensure!(
                headline.contains(want),
                "{what}: headline lacks {want:?}: {headline}"
            );
        }
        ensure!(
            !text.contains("something else refuses"),
            "{what}: misleading explanation: {text}"
        );
        Ok(())
    };
    let mut d = spawn_daemon(&all(), &config, None)?;
    let (st, lines) = d
        .wait_exit(Duration::from_secs(20))
        .context("the daemon did not fail on an unwritable pin directory")?;
    ensure!(!st.success(), "daemon exited {st}");
    check(
        &lines.join("\n"),
        "daemon on root's 0700 directory",
        "mode 0700",
    )?;

    // Pins of a root daemon, kept by its SIGTERM.
    let root = Daemon::start(&config, &pins.path, &[], OnDrop::Kill)?;
    // Served once the loop runs: its SIGTERM handler is installed.
    ensure!(get("/healthz")?.0 == 200, "root daemon's /healthz");
    let (st, _) = root.stop(libc::SIGTERM)?;
    ensure!(st.success(), "root daemon SIGTERM: {st}");
    std::fs::set_permissions(&pins.path, std::fs::Permissions::from_mode(0o755))?;
    let count = || std::fs::read_dir(&pins.path).map(|d| d.count());
    let pinned = count()?;
    ensure!(pinned >= 11, "root daemon pinned {pinned} entries");
    let out = Command::new("setpriv")
        .args([
            &format!("--reuid={UID}"),
            &format!("--regid={UID}"),
            "--clear-groups",
            &format!("--inh-caps={}", setpriv_caps(&all())),
            &format!("--ambient-caps={}", setpriv_caps(&all())),
            &format!("--bounding-set={}", setpriv_caps(&all())),
        ])
        .arg(daemon_binary()?)
        .args(["daemon", "--pin-dir"])
        .arg(&pins.path)
        .arg("--unpin")
        .env("RUST_BACKTRACE", "0")
        .output()?;
    ensure!(!out.status.success(), "--unpin as {UID}: {out:?}");
    check(
        &String::from_utf8_lossy(&out.stderr),
        "--unpin as nobody",
        "mode 0755",
    )?;
    ensure!(count()? == pinned, "--unpin as nobody removed pins");
    let mut d = spawn_daemon(&all(), &config, None)?;
    let (st, lines) = d.wait_exit(Duration::from_secs(20))?;
    ensure!(!st.success(), "daemon on root's pins exited {st}");
    check(&lines.join("\n"), "daemon on root's pins", "mode 0755")?;
    ensure!(count()? == pinned, "the daemon as nobody removed pins");
    let said = pins.unpin()?;
    ensure!(said.contains("removed"), "--unpin as root: {said}");
    Ok(())
}
