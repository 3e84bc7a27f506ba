//! The `spice-observer daemon` side of the privileged tests (tests/daemon.rs, service.rs,
//! restart.rs): a running daemon whose log is read line by line as it arrives, HTTP GETs of
//! its endpoints, and `/metrics` read into typed samples with the `prometheus-parse` crate (a
//! parser outside the code under test).

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    path::Path,
    process::{Child, Command, ExitStatus, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};

use super::{PinDir, oracle};

/// How a [`Daemon`] that still runs is ended when dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnDrop {
    /// SIGTERM, then SIGKILL if it has not exited within 5 s ([`super::terminate`]).
    Terminate,
    /// SIGKILL at once (a test that stops the daemon itself, with a signal of its choice).
    Kill,
}

/// A running `spice-observer daemon` (or a wrapper that execs it, e.g. `setpriv`), its stderr
/// read by a thread that echoes each line as `daemon! LINE` and forwards it with the instant it
/// was read. Ended as its [`OnDrop`] says when dropped; a pin directory it owns
/// ([`Daemon::with_pins`]) is unpinned after that.
pub struct Daemon {
    child: Child,
    log: mpsc::Receiver<(Instant, String)>,
    lines: Vec<(Instant, String)>,
    on_drop: OnDrop,
    /// Dropped after `drop` has stopped the daemon (fields drop after `Drop::drop`).
    _pins: Option<PinDir>,
}

impl Daemon {
    /// Spawns `cmd` (stdout to /dev/null, stderr read line by line); does not wait for
    /// anything. `what` names it in the error if it cannot be started.
    pub fn spawn(mut cmd: Command, on_drop: OnDrop, what: &str) -> Result<Daemon> {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {what}"))?;
        let (tx, rx) = mpsc::channel();
        let err = child.stderr.take().unwrap();
        thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("daemon! {line}");
                if tx.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        Ok(Daemon {
            child,
            log: rx,
            lines: Vec::new(),
            on_drop,
            _pins: None,
        })
    }

    /// Starts `spice-observer daemon --config CONFIG --pin-dir PINS` with the extra
    /// environment `env`, and waits for its start line ([`Daemon::wait_listening`]).
    pub fn start(
        config: &Path,
        pins: &Path,
        env: &[(&str, &str)],
        on_drop: OnDrop,
    ) -> Result<Daemon> {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_spice-observer"));
        cmd.args(["daemon", "--config"])
            .arg(config)
            .arg("--pin-dir")
            .arg(pins)
            .envs(env.iter().copied());
        let mut d = Daemon::spawn(cmd, on_drop, "spice-observer daemon")?;
        d.wait_listening()?;
        Ok(d)
    }

    /// Gives the daemon `pins` to own: unpinned once the daemon has been stopped on drop.
    pub fn with_pins(mut self, pins: PinDir) -> Daemon {
        self._pins = Some(pins);
        self
    }

    /// Waits up to 60 s for the start line (`listening on http://…`, logged once the HTTP
    /// listener is bound).
    pub fn wait_listening(&mut self) -> Result<String> {
        self.wait_line(
            |l| l.contains("listening on http://"),
            Duration::from_secs(60),
        )
        .context("daemon start line")
    }

    /// Waits for a log line matching `f` (also among the lines read so far, since the start
    /// or the last [`Daemon::drain_log`]); returns it and when it was read. An error if the
    /// daemon's stderr closes (it exited) or `timeout` passes, with the log so far.
    pub fn wait_line_at(
        &mut self,
        f: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> Result<(Instant, String)> {
        if let Some(l) = self.lines.iter().find(|(_, l)| f(l)) {
            return Ok(l.clone());
        }
        let t0 = Instant::now();
        while t0.elapsed() < timeout {
            match self.log.recv_timeout(Duration::from_millis(20)) {
                Ok((at, line)) => {
                    self.lines.push((at, line.clone()));
                    if f(&line) {
                        return Ok((at, line));
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    bail!("daemon exited:\n{}", self.text())
                }
            }
        }
        bail!("no such line within {timeout:?}:\n{}", self.text())
    }

    /// Waits for a log line matching `f` ([`Daemon::wait_line_at`]); returns it.
    pub fn wait_line(&mut self, f: impl Fn(&str) -> bool, timeout: Duration) -> Result<String> {
        Ok(self.wait_line_at(f, timeout)?.1)
    }

    /// Waits up to 5 s for each of `procs` (name as the daemon calls it, pid) to be found: a
    /// line `found … NAME (pid PID…` per process.
    pub fn wait_found(&mut self, procs: &[(&str, u32)]) -> Result<()> {
        self.wait_found_within(procs, Duration::from_secs(5))
    }

    /// [`Daemon::wait_found`] with `timeout` per process. The error names the process.
    pub fn wait_found_within(&mut self, procs: &[(&str, u32)], timeout: Duration) -> Result<()> {
        for (what, pid) in procs {
            self.wait_line(
                |l| l.contains("found ") && l.contains(&format!("{what} (pid {pid}")),
                timeout,
            )
            .with_context(|| format!("the daemon did not find {what} (pid {pid})"))?;
        }
        Ok(())
    }

    /// Every line logged so far (since the start or the last [`Daemon::drain_log`]), joined
    /// with newlines.
    pub fn text(&mut self) -> String {
        while let Ok(l) = self.log.try_recv() {
            self.lines.push(l);
        }
        self.lines
            .iter()
            .map(|(_, l)| l.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Forgets every line logged so far: later waits see only lines logged from now on.
    pub fn drain_log(&mut self) {
        while let Ok(l) = self.log.try_recv() {
            self.lines.push(l);
        }
        self.lines.clear();
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status if it has exited (reaps it), `None` while it runs.
    pub fn exited(&mut self) -> Result<Option<ExitStatus>> {
        Ok(self.child.try_wait()?)
    }

    /// Sends `signal` to the daemon, unless it has already exited (its pid may be reused).
    pub fn signal(&mut self, signal: i32) {
        if matches!(self.child.try_wait(), Ok(None)) {
            unsafe { libc::kill(self.child.id() as i32, signal) };
        }
    }

    /// Waits up to `timeout` for the daemon to exit on its own: its status and every line it
    /// logged (the reader thread ends with the pipe).
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<(ExitStatus, Vec<String>)> {
        let t0 = Instant::now();
        while t0.elapsed() < timeout {
            if let Some(st) = self.child.try_wait()? {
                while let Ok(l) = self.log.recv_timeout(Duration::from_secs(2)) {
                    self.lines.push(l);
                }
                let lines = std::mem::take(&mut self.lines);
                return Ok((st, lines.into_iter().map(|(_, l)| l).collect()));
            }
            thread::sleep(Duration::from_millis(20));
        }
        bail!("daemon still running after {timeout:?}:\n{}", self.text())
    }

    /// Sends `signal` and waits up to 10 s for the exit ([`Daemon::wait_exit`]).
    pub fn stop(mut self, signal: i32) -> Result<(ExitStatus, Vec<String>)> {
        self.signal(signal);
        self.wait_exit(Duration::from_secs(10))
            .with_context(|| format!("after signal {signal}"))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        match self.on_drop {
            OnDrop::Terminate => super::terminate(&mut self.child),
            OnDrop::Kill => {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
    }
}

/// An HTTP/1.0 GET of `path` from `addr` (15 s read timeout): (status code, body).
pub fn http_get(addr: &str, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(15)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
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

/// One sample of a scrape, typed: histogram buckets, _sum and _count are samples of their own
/// (`NAME_bucket` with `le`, `NAME_sum`, `NAME_count`).
#[derive(Clone, Debug)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// (metric, leg, channel, channel_id, direction) of a message or byte total
/// ([`Scrape::vm_totals`]).
pub type TotalKey = (String, String, String, String, String);

/// A `/metrics` body parsed with the `prometheus-parse` crate.
pub struct Scrape {
    /// The body as served.
    pub text: String,
    /// Family name (every `# TYPE` line) → its HELP text (empty if it has none).
    pub families: BTreeMap<String, String>,
    pub samples: Vec<Sample>,
}

impl Scrape {
    /// GETs `/metrics` from `addr` (status 200 required) and parses it ([`Scrape::parse`]).
    pub fn take(addr: &str) -> Result<Scrape> {
        let (code, text) = http_get(addr, "/metrics")?;
        ensure!(code == 200, "/metrics answered {code}: {text}");
        Scrape::parse(text)
    }

    /// Parses an exposition-format body; an error if the parser rejects it or it has a
    /// summary (the daemon exports none).
    pub fn parse(text: String) -> Result<Scrape> {
        let parsed = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
            .context("parsing the scrape")?;
        let mut samples = Vec::new();
        for s in parsed.samples {
            let labels: BTreeMap<String, String> = s
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => samples.push(Sample {
                    name: s.metric,
                    labels,
                    value: v,
                }),
                prometheus_parse::Value::Histogram(buckets) => {
                    for b in buckets {
                        let mut l = labels.clone();
                        l.insert("le".into(), b.less_than.to_string());
                        samples.push(Sample {
                            name: format!("{}_bucket", s.metric),
                            labels: l,
                            value: b.count,
                        });
                    }
                }
                prometheus_parse::Value::Summary(_) => bail!("summary {} in scrape", s.metric),
            }
        }
        let families = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .map(|n| {
                (
                    n.to_string(),
                    parsed.docs.get(n).cloned().unwrap_or_default(),
                )
            })
            .collect();
        Ok(Scrape {
            text,
            families,
            samples,
        })
    }

    /// Samples of `name` whose labels include every pair of `with`.
    pub fn find(&self, name: &str, with: &[(&str, &str)]) -> Vec<&Sample> {
        self.samples
            .iter()
            .filter(|s| {
                s.name == name
                    && with
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .collect()
    }

    /// The value of the one sample of `name` matching `with`; an error if none or several.
    pub fn one(&self, name: &str, with: &[(&str, &str)]) -> Result<f64> {
        match self.find(name, with)[..] {
            [s] => Ok(s.value),
            [] => bail!("no sample {name} {with:?}"),
            ref many => bail!("{} samples {name} {with:?}: {many:?}", many.len()),
        }
    }

    /// Every `spice_observer_messages_total` and `_bytes_total` of `vm`: [`TotalKey`] → value.
    pub fn vm_totals(&self, vm: &str) -> BTreeMap<TotalKey, f64> {
        let mut out = BTreeMap::new();
        for m in [
            "spice_observer_messages_total",
            "spice_observer_bytes_total",
        ] {
            for x in self.find(m, &[("vm", vm)]) {
                let l = &x.labels;
                out.insert(
                    (
                        m.to_string(),
                        l["leg"].clone(),
                        l["channel"].clone(),
                        l["channel_id"].clone(),
                        l["direction"].clone(),
                    ),
                    x.value,
                );
            }
        }
        out
    }

    /// The run checks of a scrape (as [`super::check_run`] for a report): the expected hook
    /// set ([`super::expected_hook_set`]), `degraded` degraded features, and at least 9
    /// information-lost counters, every one 0.
    pub fn check_run(&self, degraded: f64) -> Result<()> {
        self.check_run_with_hooks(degraded, &super::expected_hook_set())
    }

    /// [`Scrape::check_run`] for a daemon whose hook set is `hook` (e.g. without `+libssl`
    /// under `tls_hooks = false`).
    pub fn check_run_with_hooks(&self, degraded: f64, hook: &str) -> Result<()> {
        ensure!(
            self.one("spice_observer_hook_set_info", &[("hook_set", hook)])? == 1.0,
            "hook set is not {hook}"
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

/// Compares the daemon's message and byte totals of captured connection `c` (`totals` from
/// [`Scrape::vm_totals`]) with the capture: both directions on spice-server's socket and on
/// the relay's two legs (`server`, `relay_backend`, `relay_client`) must lie within the
/// capture's counts `lo..=hi` ([`oracle::captured_by`] at the two ends of the scrape's
/// window). Prints a line per total, adds those outside to `wrong`, and returns how many were
/// compared (12). An error if one of the totals is missing.
pub fn compare_totals(
    totals: &BTreeMap<TotalKey, f64>,
    c: &oracle::SpiceConn,
    (lo, hi): (oracle::Counts, oracle::Counts),
    wrong: &mut Vec<String>,
) -> Result<usize> {
    let ty = oracle::type_name(c.channel_type);
    let id = c.channel_id.to_string();
    let mut compared = 0;
    for (dir, (lo_m, lo_b), (hi_m, hi_b)) in [
        ("server_to_client", lo.0, hi.0),
        ("client_to_server", lo.1, hi.1),
    ] {
        for leg in ["server", "relay_backend", "relay_client"] {
            for (metric, lo, hi) in [
                ("spice_observer_messages_total", lo_m, hi_m),
                ("spice_observer_bytes_total", lo_b, hi_b),
            ] {
                let got = totals
                    .get(&(
                        metric.to_string(),
                        leg.to_string(),
                        ty.to_string(),
                        id.clone(),
                        dir.to_string(),
                    ))
                    .copied()
                    .ok_or_else(|| anyhow!("no {metric} {leg} {ty} {id} {dir}"))?;
                let line =
                    format!("{metric} {ty} {id} {dir} {leg}: daemon {got}, capture {lo}..={hi}");
                println!("{line}");
                if got < lo as f64 || got > hi as f64 {
                    wrong.push(line);
                }
                compared += 1;
            }
        }
    }
    Ok(compared)
}
