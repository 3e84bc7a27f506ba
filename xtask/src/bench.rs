//! `cargo xtask bench [--smoke] [--write-readme]`: what the observer costs the host, as ratios
//! measured in one run.
//!
//! Runs with and without the observer alternate, several repeats each; every figure is printed
//! as the median and the spread (min–max) of its repeats. Nothing is asserted on times (the
//! machines are shared and noisy). One thing is checked: in the stress run the observer must
//! lose nothing (`events_lost` 0) and its per-channel counts must equal the load generator's
//! own (`spice-observer bench compare`); a mismatch is printed loudly and the command exits
//! non-zero.
//!
//! Workloads (release build; `spice-peer load` is the SPICE load generator, the observer is
//! `spice-observer observe --pid <load's server process>` started before the link phases):
//! * a saturated sender over loopback, 1 session × 1 channel, 200-byte bodies, W = 20:
//!   write with 1 and with 10 messages per call, and writev (header + body iovecs): messages
//!   per second; then the same with `kernel.bpf_stats_enabled=1` for each program's run
//!   time per run and run count (timed runs keep the statistics off: they cost time too);
//!   at 1 message per write, also the reference floor program `spice_ref_floor` and its seven
//!   steps, each alone on `sock_send_length` in short runs of its own without the observer
//!   (programs on one hook run in attach order, the later ones on warm caches), forward in
//!   even repeats and backward in odd ones; and the load's throughput with only the empty
//!   reference program, and with only the floor, on `sock_send_length` (no observer,
//!   statistics off): what the hook and the least a traced send cost the sender, the
//!   yardstick for the observer's throughput ratio. A repeat's timed runs go in reverse order
//!   in odd repeats;
//! * an unrelated process's syscalls (getppid, an 8-byte write + read on a pipe) while the
//!   observer watches another process (`sleep`), and with only the empty reference
//!   `sys_enter` program attached (`spice-observer bench reference`);
//! * unrelated loopback TCP: iperf3;
//! * the agent at 10 sessions × 635 msgs/s: its CPU share (`/proc/PID/stat` utime + stime)
//!   and RSS (`VmRSS` each second);
//! * a stress run at 100 k msgs/s in total (10 channels × 10 k/s);
//! * per hook set, for each framing hook set `spice-observer doctor --json` finds loading
//!   here (the observer started with `--hook-set`): the saturated sender at 1 message per
//!   write (throughput ratio, kernel time of the set's socket-call programs per send call)
//!   and the unwatched getppid loop (timed, and the set's programs' runs and ns per call from
//!   bpf_stats, against the empty reference program on the same hook where the set has a
//!   program on every syscall: `spice_ref_sys_exit` for `syscalls`).

use std::{
    collections::BTreeMap,
    fs,
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
        mpsc::{self, Receiver},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde_json::Value;

/// Durations and sizes of one bench run.
#[derive(Clone, Debug)]
struct Plan {
    reps: usize,
    /// Seconds of each saturated-sender run.
    sat_secs: f64,
    /// Seconds of each run of the floor or one of its steps alone ([`With::Reference`]).
    alone_secs: f64,
    getppid_calls: u64,
    pipe_calls: u64,
    iperf_secs: u32,
    agent_secs: f64,
    stress_sessions: u32,
    /// Messages per second per channel of the stress run.
    stress_rate: f64,
    stress_secs: f64,
}

impl Plan {
    fn new(smoke: bool) -> Plan {
        if smoke {
            Plan {
                reps: 1,
                sat_secs: 1.0,
                alone_secs: 1.0,
                getppid_calls: 1_000_000,
                pipe_calls: 200_000,
                iperf_secs: 1,
                agent_secs: 4.0,
                stress_sessions: 10,
                stress_rate: 2_000.0,
                stress_secs: 3.0,
            }
        } else {
            Plan {
                reps: 3,
                sat_secs: 4.0,
                alone_secs: 1.5,
                getppid_calls: 5_000_000,
                pipe_calls: 1_000_000,
                iperf_secs: 3,
                agent_secs: 60.0,
                stress_sessions: 10,
                stress_rate: 10_000.0,
                stress_secs: 30.0,
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Pure helpers (unit-tested).

/// Median of `v` (mean of the two middle values for an even count); NaN when empty.
pub(crate) fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// A number with 3 significant digits, and a k/M suffix from 10 000 on.
pub(crate) fn num(x: f64) -> String {
    if !x.is_finite() {
        return "–".into();
    }
    let (v, suffix) = if x.abs() >= 1e6 {
        (x / 1e6, " M")
    } else if x.abs() >= 1e4 {
        (x / 1e3, " k")
    } else {
        (x, "")
    };
    let digits = if v.abs() >= 100.0 {
        0
    } else if v.abs() >= 10.0 {
        1
    } else {
        2
    };
    format!("{v:.digits$}{suffix}")
}

/// The smallest and the largest of `v` (infinite, reversed, when empty).
fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

/// `median (min–max)`, or just the value for a single repeat.
pub(crate) fn med_spread(v: &[f64], unit: &str) -> String {
    if v.is_empty() {
        return "–".into();
    }
    let (lo, hi) = min_max(v);
    if v.len() == 1 {
        format!("{}{unit}", num(v[0]))
    } else {
        format!("{}{unit} ({}–{})", num(median(v)), num(lo), num(hi))
    }
}

/// A throughput ratio: the median of `with` over the median of `without`, to two places,
/// then, when both have the same repeats (more than one), the lowest and highest of the
/// repeats' own ratios (each from two runs of the same repeat), `0.96 (per repeat
/// 0.91–1.06)`: how far the machine's drift between runs a few seconds apart moves one
/// ratio.
pub(crate) fn ratio_text(with: &[f64], without: &[f64]) -> String {
    let r = format!("{:.2}", median(with) / median(without));
    if with.len() < 2 || with.len() != without.len() {
        return r;
    }
    let per: Vec<f64> = with.iter().zip(without).map(|(a, b)| a / b).collect();
    let (lo, hi) = min_max(&per);
    format!("{r} (per repeat {lo:.2}–{hi:.2})")
}

/// One program's statistics at one instant.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ProgStat {
    pub(crate) id: u32,
    pub(crate) name: String,
    pub(crate) run_time_ns: u64,
    pub(crate) run_cnt: u64,
}

/// Parses `spice-observer bench stats` (or the last line of `bench reference`).
pub(crate) fn parse_stats(line: &str) -> Result<Vec<ProgStat>> {
    let v: Value = serde_json::from_str(line.trim()).with_context(|| format!("stats {line:?}"))?;
    let arr = v["programs"]
        .as_array()
        .ok_or_else(|| anyhow!("stats without `programs`: {line}"))?;
    arr.iter()
        .map(|p| {
            Ok(ProgStat {
                id: req_u64(p, "id")? as u32,
                name: req_str(p, "name")?.to_string(),
                run_time_ns: req_u64(p, "run_time_ns")?,
                run_cnt: req_u64(p, "run_cnt")?,
            })
        })
        .collect()
}

/// Per-program (name, Δrun_time_ns, Δrun_cnt) from `a` to `b`, for the ids in `b` that are
/// in `a` and not in `exclude` (programs that existed before the measured observer), with
/// at least one run. Names are the kernel's (15 characters).
pub(crate) fn stats_delta(
    a: &[ProgStat],
    b: &[ProgStat],
    exclude: &[ProgStat],
) -> Vec<(String, u64, u64)> {
    let mut out = Vec::new();
    for p in b {
        if exclude.iter().any(|e| e.id == p.id) {
            continue;
        }
        let Some(q) = a.iter().find(|q| q.id == p.id) else {
            continue;
        };
        let (dt, dn) = (
            p.run_time_ns.saturating_sub(q.run_time_ns),
            p.run_cnt.saturating_sub(q.run_cnt),
        );
        if dn > 0 {
            out.push((p.name.clone(), dt, dn));
        }
    }
    out.sort();
    out
}

/// Replaces the text between `<!-- bench:begin -->` and `<!-- bench:end -->` (markers kept).
pub(crate) fn replace_section(readme: &str, body: &str) -> Result<String> {
    const BEGIN: &str = "<!-- bench:begin -->";
    const END: &str = "<!-- bench:end -->";
    let b = readme
        .find(BEGIN)
        .ok_or_else(|| anyhow!("README has no {BEGIN} marker"))?;
    let e = readme
        .find(END)
        .ok_or_else(|| anyhow!("README has no {END} marker"))?;
    if e < b {
        bail!("README's {END} comes before {BEGIN}");
    }
    Ok(format!(
        "{}{BEGIN}\n{}\n{}",
        &readme[..b],
        body.trim_end(),
        &readme[e..]
    ))
}

/// utime + stime (clock ticks) from the text of `/proc/PID/stat` (fields 14 and 15; the
/// command name in parentheses may hold spaces, so fields are counted after its `)`).
pub(crate) fn stat_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14, stime 15.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// VmRSS in KiB from the text of `/proc/PID/status`.
pub(crate) fn status_rss_kib(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

fn req_u64(v: &Value, k: &str) -> Result<u64> {
    v[k].as_u64()
        .ok_or_else(|| anyhow!("field `{k}` missing or not a count in {v}"))
}

fn req_f64(v: &Value, k: &str) -> Result<f64> {
    v[k].as_f64()
        .ok_or_else(|| anyhow!("field `{k}` missing or not a number in {v}"))
}

fn req_str<'a>(v: &'a Value, k: &str) -> Result<&'a str> {
    v[k].as_str()
        .ok_or_else(|| anyhow!("field `{k}` missing or not a string in {v}"))
}

// ---------------------------------------------------------------------------------------
// Processes.

/// Set by SIGINT: the run stops at the next step (and restores bpf_stats on the way out).
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    Ok(())
}

/// `kernel.bpf_stats_enabled`, restored to its value at start when dropped.
struct BpfStats {
    old: String,
}

const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

impl BpfStats {
    fn take() -> Result<BpfStats> {
        let old = fs::read_to_string(BPF_STATS)
            .with_context(|| format!("reading {BPF_STATS}"))?
            .trim()
            .to_string();
        Ok(BpfStats { old })
    }

    fn set(&self, on: bool) -> Result<()> {
        fs::write(BPF_STATS, if on { "1" } else { "0" })
            .with_context(|| format!("writing {BPF_STATS}"))
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = fs::write(BPF_STATS, &self.old);
    }
}

/// Lines of a child's pipe, read on a thread.
struct Lines {
    rx: Receiver<String>,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Lines {
    fn new<R: std::io::Read + Send + 'static>(r: R) -> Lines {
        let (tx, rx) = mpsc::channel();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        thread::spawn(move || {
            for line in BufReader::new(r).lines() {
                let Ok(line) = line else { break };
                s.lock().unwrap().push(line.clone());
                if tx.send(line).is_err() {
                    // Nobody waits any more: keep collecting for error messages.
                }
            }
        });
        Lines { rx, seen }
    }

    /// The next line for which `pred` holds, within `timeout`.
    fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(l) if pred(&l) => return Ok(l),
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => bail!(
                    "timed out waiting for {what}; output so far:\n{}",
                    self.text()
                ),
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!(
                    "the process ended before {what}; its output:\n{}",
                    self.text()
                ),
            }
        }
    }

    fn text(&self) -> String {
        self.seen.lock().unwrap().join("\n")
    }
}

/// Waits for `child` up to `timeout`, then kills it.
fn wait_child(
    child: &mut Child,
    what: &str,
    timeout: Duration,
) -> Result<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(s);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{what} did not end within {} s (killed)", timeout.as_secs());
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Reaps the load generator's detached client process (re-parented to us, a subreaper).
fn reap(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let mut st = 0;
        // SAFETY: waitpid on one pid with a valid status pointer.
        let r = unsafe { libc::waitpid(pid as i32, &mut st, libc::WNOHANG) };
        if r != 0 {
            return; // reaped, or not our child (ECHILD)
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// A load generator that is killed (and its client reaped) if a run fails half-way.
struct KillOnDrop(Option<Child>, Option<u32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
            if let Some(pid) = self.1 {
                reap(pid);
            }
        }
    }
}

/// The release binaries, and the hook set the observer is started with.
#[derive(Clone)]
struct Bins {
    observer: PathBuf,
    peer: PathBuf,
    tmp: PathBuf,
    /// `--hook-set` of every `observe` started (`None`: the observer's default, `auto`).
    hook_set: Option<String>,
}

/// A running `spice-observer observe`.
struct Observer {
    child: Child,
    stderr: Lines,
    json: PathBuf,
    /// Programs loaded before it (not its own).
    before: Vec<ProgStat>,
    pid: u32,
}

impl Observer {
    fn start(bins: &Bins, target: u32, tag: &str) -> Result<Observer> {
        let before = prog_stats(bins, "spice_")?;
        let json = bins.tmp.join(format!("observer-{tag}.json"));
        let _ = fs::remove_file(&json);
        let mut child = Command::new(&bins.observer)
            .args(["observe", "--pid", &target.to_string(), "--duration", "0"])
            .arg("--json")
            .arg(&json)
            .arg("--no-progress")
            .args(
                bins.hook_set
                    .iter()
                    .flat_map(|h| ["--hook-set", h.as_str()]),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting spice-observer observe")?;
        let stderr = Lines::new(child.stderr.take().unwrap());
        let pid = child.id();
        let mut o = Observer {
            child,
            stderr,
            json,
            before,
            pid,
        };
        if let Err(e) = o.stderr.wait_for(
            "the observer's `watching` line",
            Duration::from_secs(120),
            |l| l.starts_with("spice-observer: watching"),
        ) {
            let _ = o.child.kill();
            let _ = o.child.wait();
            return Err(e);
        }
        Ok(o)
    }

    /// SIGINT (observe then writes its report), wait, parse the JSON report.
    fn stop(mut self) -> Result<Value> {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.pid as i32, libc::SIGINT) };
        let st = wait_child(
            &mut self.child,
            "spice-observer observe",
            Duration::from_secs(60),
        )?;
        if !st.success() {
            bail!(
                "spice-observer observe failed ({st}):\n{}",
                self.stderr.text()
            );
        }
        let text = fs::read_to_string(&self.json)
            .with_context(|| format!("reading the observer's report {}", self.json.display()))?;
        serde_json::from_str(&text).context("parsing the observer's report")
    }
}

fn prog_stats(bins: &Bins, prefix: &str) -> Result<Vec<ProgStat>> {
    let out = Command::new(&bins.observer)
        .args(["bench", "stats", "--prefix", prefix])
        .stderr(Stdio::inherit())
        .output()
        .context("spice-observer bench stats")?;
    if !out.status.success() {
        bail!("spice-observer bench stats failed: {}", out.status);
    }
    parse_stats(&String::from_utf8_lossy(&out.stdout))
}

/// `spice-observer bench reference`: the empty programs attached until dropped.
struct Reference {
    child: Child,
    stdin: Option<ChildStdin>,
    ids: Vec<(u32, String)>,
}

impl Reference {
    fn start(bins: &Bins, hooks: &str) -> Result<Reference> {
        Reference::start_with(bins, hooks, &[])
    }

    /// `name`, `spice_ref_floor` (the least a traced send needs) or one of its steps
    /// ([`FLOOR_STEPS`]), alone on its hook, with `pid` watched in its own maps.
    fn start_alone(bins: &Bins, pid: u32, name: &str) -> Result<Reference> {
        Reference::start_with(
            bins,
            "floor,floor_steps",
            &["--pid", &pid.to_string(), "--only", name],
        )
    }

    fn start_with(bins: &Bins, hooks: &str, extra: &[&str]) -> Result<Reference> {
        let mut child = Command::new(&bins.observer)
            .args(["bench", "reference", "--hooks", hooks])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("spice-observer bench reference")?;
        let stdin = child.stdin.take();
        let lines = Lines::new(child.stdout.take().unwrap());
        let line = lines.wait_for("`attached`", Duration::from_secs(60), |l| {
            l.starts_with("attached ")
        })?;
        let v: Value = serde_json::from_str(&line["attached ".len()..])?;
        let mut ids = Vec::new();
        for p in v["programs"].as_array().into_iter().flatten() {
            ids.push((req_u64(p, "id")? as u32, req_str(p, "name")?.to_string()));
        }
        Ok(Reference { child, stdin, ids })
    }

    /// This reference's statistics now (by id, with the object's full names).
    fn stats(&self, bins: &Bins) -> Result<Vec<ProgStat>> {
        Ok(prog_stats(bins, "spice_ref")?
            .into_iter()
            .filter_map(|mut p| {
                let n = self.ids.iter().find(|(id, _)| *id == p.id)?;
                p.name = n.1.clone();
                Some(p)
            })
            .collect())
    }

    fn stop(mut self) -> Result<()> {
        drop(self.stdin.take());
        wait_child(
            &mut self.child,
            "spice-observer bench reference",
            Duration::from_secs(30),
        )?;
        Ok(())
    }
}

/// Options of one `spice-peer load` run.
#[derive(Clone, Debug)]
struct Load {
    sessions: u32,
    channels: u32,
    body: u32,
    rate: f64,
    batch: u32,
    writev: bool,
    window: u32,
    secs: f64,
}

impl Load {
    fn saturated(batch: u32, writev: bool, secs: f64) -> Load {
        Load {
            sessions: 1,
            channels: 1,
            body: 200,
            rate: 0.0,
            batch,
            writev,
            window: 20,
            secs,
        }
    }
}

/// How the observer takes part in a load run.
#[derive(Clone, Copy, Debug, PartialEq)]
enum With {
    Without,
    Observer,
    /// Observer, and per-program statistics over the run (bpf_stats must be on). Nothing
    /// else on its hooks: programs on one hook run in attach order, and each one after the
    /// first finds the caches warmed by those before it.
    Stats,
    /// No observer: only the reference program of this name ([`FLOOR_STEPS`]), alone on its
    /// hook, with the load's server watched in its own maps, and its statistics over the
    /// run (bpf_stats must be on) in [`LoadRun::reference`]. Fails if any other `spice_`
    /// program ran meanwhile (another observer on the host would warm its caches).
    Reference(&'static str),
    /// No observer and no statistics: only the reference program of this name
    /// ([`YARDSTICKS`]) alone on `sock_send_length`, for the load's throughput with it: what
    /// the hook and the least a traced send needs cost the sender, beside what the observer
    /// costs it. Fails if a `spice_` program other than the reference's own is loaded at the
    /// end of the streaming (with statistics off no program counts its runs, so whether one
    /// ran cannot be told), such as one a killed test left pinned under /sys/fs/bpf.
    Yardstick(&'static str),
    /// Observer, with its CPU and RSS sampled.
    Agent,
}

/// What one load run gave.
struct LoadRun {
    /// `spice-peer load`'s final JSON line.
    load: Value,
    load_path: PathBuf,
    report: Option<Value>,
    report_path: Option<PathBuf>,
    /// (program, Δrun_time_ns, Δrun_cnt) of the observer's programs over the streaming.
    stats: Vec<(String, u64, u64)>,
    /// (program, Δrun_time_ns, Δrun_cnt) of the reference program of [`With::Reference`]
    /// over the streaming; empty otherwise.
    reference: Vec<(String, u64, u64)>,
    agent: Option<AgentSample>,
}

/// The observer process's CPU and memory over a run.
#[derive(Debug, Clone)]
struct AgentSample {
    cpu_share: f64,
    rss_kib: Vec<u64>,
}

fn run_load(bins: &Bins, l: &Load, with: With, tag: &str) -> Result<LoadRun> {
    check_interrupted()?;
    let mut cmd = Command::new(&bins.peer);
    cmd.arg("load")
        .args(["--sessions", &l.sessions.to_string()])
        .args(["--channels", &l.channels.to_string()])
        .args(["--body-size", &l.body.to_string()])
        .args(["--rate", &l.rate.to_string()])
        .args(["--batch", &l.batch.to_string()])
        .args(["--send-syscall", if l.writev { "writev" } else { "write" }])
        .args(["--window", &l.window.to_string()])
        .args(["--duration", &l.secs.to_string()])
        .arg("--hold")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let mut child = KillOnDrop(Some(cmd.spawn().context("starting spice-peer load")?), None);
    let c = child.0.as_mut().unwrap();
    let mut stdin = c.stdin.take().unwrap();
    let lines = Lines::new(c.stdout.take().unwrap());
    let hold = lines.wait_for(
        "spice-peer load's `hold` line",
        Duration::from_secs(30),
        |l| l.starts_with("hold pid "),
    )?;
    let f: Vec<&str> = hold.split_whitespace().collect();
    let (server, client): (u32, u32) = match f.as_slice() {
        ["hold", "pid", s, "clients", c] => (s.parse()?, c.parse()?),
        _ => bail!("spice-peer load said {hold:?}"),
    };
    child.1 = Some(client);
    let floor = match with {
        With::Reference(name) => Some(Reference::start_alone(bins, server, name)?),
        With::Yardstick(name) if name == EMPTY_SEND => Some(Reference::start(bins, "sock_send")?),
        With::Yardstick(name) => Some(Reference::start_alone(bins, server, name)?),
        _ => None,
    };
    let observer = match with {
        With::Without | With::Reference(_) | With::Yardstick(_) => None,
        _ => Some(Observer::start(bins, server, tag)?),
    };
    let s0 = match with {
        With::Stats | With::Reference(_) => prog_stats(bins, "spice_")?,
        _ => Vec::new(),
    };
    let f0 = match &floor {
        Some(f) => f.stats(bins)?,
        None => Vec::new(),
    };
    // The agent's CPU and RSS: from here to the end of the streaming.
    let stop_sampling = Arc::new(AtomicBool::new(false));
    let sampler = (with == With::Agent).then(|| {
        let pid = observer.as_ref().unwrap().pid;
        let stop = stop_sampling.clone();
        thread::spawn(move || sample_agent(pid, &stop))
    });
    writeln!(stdin, "go")?;
    stdin.flush()?;
    let wait = Duration::from_secs_f64(l.secs + 60.0);
    let line = lines.wait_for("spice-peer load's JSON line", wait, |l| l.starts_with('{'))?;
    let mut c = child.0.take().unwrap();
    let status = wait_child(&mut c, "spice-peer load", Duration::from_secs(30))?;
    reap(client);
    stop_sampling.store(true, Ordering::SeqCst);
    let agent = sampler.map(|h| h.join().expect("sampler panicked"));
    let s1 = match with {
        With::Stats | With::Reference(_) | With::Yardstick(_) => prog_stats(bins, "spice_")?,
        _ => Vec::new(),
    };
    // The reference's own programs, for the Yardstick check below.
    let own: Vec<u32> = floor
        .as_ref()
        .map_or_else(Vec::new, |f| f.ids.iter().map(|p| p.0).collect());
    let reference = match floor {
        Some(f) => {
            let f1 = f.stats(bins)?;
            f.stop()?;
            stats_delta(&f0, &f1, &[])
        }
        None => Vec::new(),
    };
    if let With::Yardstick(name) = with {
        // Alone means alone; with bpf_stats off no program counts its runs, so no other
        // spice_ program may be loaded once the streaming is over.
        let others: Vec<String> = s1
            .iter()
            .filter(|p| !own.contains(&p.id))
            .map(|p| format!("{} (id {})", p.name, p.id))
            .collect();
        ensure!(
            others.is_empty(),
            "{name} was not alone: other spice_ programs were loaded at the end of its run: \
             {} (is another spice-observer or `spice-observer bench reference` running?)",
            others.join(", ")
        );
    }
    if let With::Reference(name) = with {
        // Alone means alone: the reference's own programs are named spice_ref_*.
        let others: Vec<String> = stats_delta(&s0, &s1, &[])
            .into_iter()
            .filter(|(n, _, runs)| *runs > 0 && !n.starts_with("spice_ref"))
            .map(|(n, _, runs)| format!("{n} ({runs} runs)"))
            .collect();
        ensure!(
            others.is_empty(),
            "{name} was not alone: other spice_ programs ran during its run: {} (is another \
             spice-observer running?)",
            others.join(", ")
        );
    }
    let load: Value = serde_json::from_str(&line).context("parsing spice-peer load's JSON")?;
    let load_path = bins.tmp.join(format!("load-{tag}.json"));
    fs::write(&load_path, &line)?;
    if !status.success() {
        bail!(
            "spice-peer load failed ({status}): {}",
            load["error"]
                .as_str()
                .map_or_else(|| load.to_string(), str::to_string)
        );
    }
    let (report, report_path, stats) = match observer {
        Some(o) => {
            let path = o.json.clone();
            let stats = stats_delta(&s0, &s1, &o.before);
            (Some(o.stop()?), Some(path), stats)
        }
        None => (None, None, Vec::new()),
    };
    Ok(LoadRun {
        load,
        load_path,
        report,
        report_path,
        stats,
        reference,
        agent,
    })
}

/// Samples `pid` once a second until `stop`: VmRSS, and the CPU share (utime + stime over
/// the wall time between the first and the last sample).
fn sample_agent(pid: u32, stop: &AtomicBool) -> AgentSample {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let read = || {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        Some((stat_ticks(&stat)?, status_rss_kib(&status)?))
    };
    let t0 = Instant::now();
    let first = read();
    let mut rss = Vec::new();
    let mut last = first;
    let mut t_last = t0;
    if let Some((_, r)) = first {
        rss.push(r);
    }
    let mut next = t0 + Duration::from_secs(1);
    while !stop.load(Ordering::SeqCst) {
        thread::sleep(Duration::from_millis(20));
        if Instant::now() >= next {
            next += Duration::from_secs(1);
            if let Some(s) = read() {
                rss.push(s.1);
                last = Some(s);
                t_last = Instant::now();
            }
        }
    }
    // One last reading at the end of the streaming.
    if let Some(s) = read() {
        rss.push(s.1);
        last = Some(s);
        t_last = Instant::now();
    }
    let cpu_share = match (first, last) {
        (Some((a, _)), Some((b, _))) if t_last > t0 => {
            (b - a) as f64 / hz / t_last.duration_since(t0).as_secs_f64()
        }
        _ => f64::NAN,
    };
    AgentSample {
        cpu_share,
        rss_kib: rss,
    }
}

fn syscalls(bins: &Bins, kind: &str, calls: u64) -> Result<f64> {
    check_interrupted()?;
    let out = Command::new(&bins.observer)
        .args([
            "bench",
            "syscalls",
            "--kind",
            kind,
            "--calls",
            &calls.to_string(),
        ])
        .output()
        .context("spice-observer bench syscalls")?;
    if !out.status.success() {
        bail!("spice-observer bench syscalls failed: {}", out.status);
    }
    let v: Value = serde_json::from_slice(&out.stdout)?;
    req_f64(&v, "ns_per_call")
}

/// Is something listening on TCP `port` (either address family)?
fn listening(port: u16) -> bool {
    let needle = format!(":{port:04X} ");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        fs::read_to_string(f).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let c: Vec<&str> = l.split_whitespace().collect();
                c.len() > 3 && format!("{} ", c[1]).ends_with(&needle) && c[3] == "0A"
            })
        })
    })
}

/// iperf3 over loopback for `secs`: received Gbit/s.
fn iperf(secs: u32) -> Result<f64> {
    check_interrupted()?;
    const PORT: u16 = 15301;
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-p", &PORT.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting iperf3 -s (Debian package iperf3, installed by scripts/setup.sh)")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !listening(PORT) {
        if Instant::now() > deadline {
            let _ = server.kill();
            let _ = server.wait();
            bail!("iperf3 -s did not listen on port {PORT}");
        }
        thread::sleep(Duration::from_millis(20));
    }
    let out = Command::new("iperf3")
        .args(["-c", "127.0.0.1", "-p", &PORT.to_string(), "-J"])
        .args(["-t", &secs.to_string()])
        .output()
        .context("iperf3 -c")?;
    wait_child(&mut server, "iperf3 -s", Duration::from_secs(10))?;
    let v: Value = serde_json::from_slice(&out.stdout).context("iperf3 -J output")?;
    let bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .ok_or_else(|| {
            anyhow!(
                "iperf3: no end.sum_received.bits_per_second ({})",
                v["error"]
            )
        })?;
    Ok(bps / 1e9)
}

// ---------------------------------------------------------------------------------------
// The bench.

/// One row of the results table.
struct Row {
    what: String,
    without: String,
    with: String,
    figure: String,
}

fn row(
    what: impl Into<String>,
    without: impl Into<String>,
    with: impl Into<String>,
    figure: impl Into<String>,
) -> Row {
    Row {
        what: what.into(),
        without: without.into(),
        with: with.into(),
        figure: figure.into(),
    }
}

/// Per-program figures over repeats: name → (ns/run values, run counts).
#[derive(Default)]
struct ProgFigures(BTreeMap<String, (Vec<f64>, Vec<f64>)>);

impl ProgFigures {
    fn add(&mut self, stats: &[(String, u64, u64)]) {
        for (n, t, c) in stats {
            let e = self.0.entry(n.clone()).or_default();
            e.0.push(*t as f64 / *c as f64);
            e.1.push(*c as f64);
        }
    }

    fn text(&self) -> String {
        self.0
            .iter()
            .map(|(n, (ns, cnt))| format!("`{n}` {} ns × {}", num(median(ns)), num(median(cnt))))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The observer's kernel programs as the kernel names them (15 characters).
const SOCK_SEND: &str = "spice_sock_send";
/// The row text of the floor's steps: each step's median ns per run (with its spread) and
/// what the median added to the one before (`runs[k]` holds step k's ns per run over the
/// repeats, in [`FLOOR_STEPS`] order).
fn floor_steps_text(runs: &[Vec<f64>]) -> String {
    let mut parts = Vec::new();
    let mut before = 0.0;
    for ((name, what), v) in FLOOR_STEPS.iter().zip(runs) {
        let m = median(v);
        let d = m - before;
        let sign = if d < 0.0 { "−" } else { "+" };
        parts.push(format!(
            "`{name}` {} ({sign}{} ns: {what})",
            med_spread(v, " ns"),
            num(d.abs())
        ));
        before = m;
    }
    parts.join("; ")
}

/// The floor program: the least a traced send needs (`spice-ebpf/src/probes/reference.rs`).
const FLOOR: &str = "spice_ref_floor";
/// The floor program stopped after each of its parts, with what each step adds
/// (`spice-ebpf/src/probes/reference.rs`, `floor`), then the floor itself.
const FLOOR_STEPS: [(&str, &str); 8] = [
    (
        "spice_ref_step1",
        "the filter (`MAYBE_WATCHED` load, `WATCHED_TGIDS` lookup)",
    ),
    ("spice_ref_step2", "socket check and cookie"),
    ("spice_ref_step3", "the syscall's registers"),
    ("spice_ref_step4", "the clock"),
    ("spice_ref_step5", "the `SOCKETS` lookup"),
    (
        "spice_ref_step6",
        "the header read from the caller's buffer",
    ),
    (
        "spice_ref_step7",
        "`write_seq`, a ring reservation and its discard (a submit's commit path)",
    ),
    (FLOOR, "the 72-byte record's stores"),
];

/// The reference programs whose cost to the sender the saturated load measures beside the
/// observer's ([`With::Yardstick`]), each with what it does.
const YARDSTICKS: [(&str, &str); 2] = [
    (EMPTY_SEND, "empty"),
    (FLOOR, "the floor: the least a traced send needs"),
];
/// The empty reference program on `sock_send_length` (`spice-observer bench reference
/// --hooks sock_send`).
const EMPTY_SEND: &str = "spice_ref_sock_send";

/// The row text of the [`YARDSTICKS`]: each one's median msgs/s with its spread and its
/// ratio to `without` (msgs/s without any program, per repeat; see [`ratio_text`]).
fn yardsticks_text(runs: &[Vec<f64>], without: &[f64]) -> String {
    YARDSTICKS
        .iter()
        .zip(runs)
        .map(|((name, what), v)| {
            format!(
                "`{name}` ({what}) {}: ratio {}",
                med_spread(v, ""),
                ratio_text(v, without)
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn machine() -> String {
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = thread::available_parallelism().map_or(0, |n| n.get());
    let ram = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        })
        .map_or("?".into(), |kib| {
            format!("{:.1} GiB", kib / 1024.0 / 1024.0)
        });
    format!(
        "{cpu}, {cores} cores, {ram} RAM; {}",
        mitigations(Path::new(VULNERABILITIES))
    )
}

/// Where the kernel says how it mitigates each CPU vulnerability
/// (Documentation/ABI/testing/sysfs-devices-system-cpu, `vulnerabilities/*`).
const VULNERABILITIES: &str = "/sys/devices/system/cpu/vulnerabilities";

/// The mitigations that change what a BPF program's calls and returns cost, as the kernel
/// reports them in `dir` ([`VULNERABILITIES`]): `spectre_v2` (retpolines on every indirect
/// call, such as a hook's call of its program), `retbleed` and `spec_rstack_overflow` (return
/// thunks, such as SRSO's "Safe RET", on every return of the kernel's functions and of the
/// JIT's BPF functions: Documentation/admin-guide/hw-vuln/srso.rst). Those the kernel says
/// the CPU is not affected by are left out; "CPU mitigations: none reported" if none is left
/// or the directory is absent. On this project's VMs, under them, most of the floor's parts
/// cost 25–60 ns each and its one user read about 100 ns (README, the floor in steps), so a
/// table from another machine compares only with this line.
pub(crate) fn mitigations(dir: &Path) -> String {
    let found: Vec<String> = ["spectre_v2", "retbleed", "spec_rstack_overflow"]
        .iter()
        .filter_map(|name| {
            let v = fs::read_to_string(dir.join(name)).ok()?;
            let v = v.trim();
            (!v.is_empty() && v != "Not affected").then(|| format!("{name} \"{v}\""))
        })
        .collect();
    if found.is_empty() {
        "CPU mitigations: none reported".to_string()
    } else {
        format!("CPU mitigations: {}", found.join(", "))
    }
}

fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|t| t.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

fn git_commit(root: &Path) -> String {
    let out = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let rev = out(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "?".into());
    let dirty =
        out(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    if dirty {
        format!("{rev} (uncommitted changes)")
    } else {
        rev
    }
}

/// Entry point of `cargo xtask bench`.
/// What every bench run sets up first: SIGINT stops it between runs, this process reaps the
/// load generator's detached clients, and its scratch directory; the binaries it runs.
fn prepare(observer: PathBuf, peer: PathBuf) -> Result<Bins> {
    // SAFETY: installing a handler that only stores to an atomic; prctl with integer args:
    // detached load clients (re-parented past their dead parent) come to us to be reaped.
    unsafe {
        libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong);
    }
    let tmp = std::env::temp_dir().join("spice-observer-bench");
    fs::create_dir_all(&tmp)?;
    Ok(Bins {
        observer,
        peer,
        tmp,
        hook_set: None,
    })
}

pub(crate) fn bench(
    root: &Path,
    observer: PathBuf,
    peer: PathBuf,
    smoke: bool,
    write_readme: bool,
) -> Result<()> {
    let t_start = Instant::now();
    let plan = Plan::new(smoke);
    let bins = prepare(observer, peer)?;
    let stats = BpfStats::take()?;
    stats.set(false)?;
    let load_start = loadavg();
    eprintln!(
        "bench: {} (load average {load_start})",
        if smoke { "smoke run" } else { "full run" }
    );

    let mut rows: Vec<Row> = Vec::new();
    let mut programs: Vec<Row> = Vec::new();
    let mut hook_set = String::from("?");
    let mut exact_runs = (0usize, 0usize);
    let note_report = |rep: &Option<Value>, hook_set: &mut String| {
        if let Some(h) = rep.as_ref().and_then(|r| r["hook_set"].as_str()) {
            *hook_set = h.to_string();
        }
    };

    // --- Saturated sender.
    let variants: [(&str, u32, bool); 3] = [
        ("write, 1 message per call", 1, false),
        ("write, 10 messages per call", 10, false),
        ("writev (header + body iovecs), 1 message per call", 1, true),
    ];
    // ns of spice_sock_send per observed send call, per variant (for the additional message).
    let mut per_call: Vec<Vec<f64>> = Vec::new();
    for (i, (name, batch, writev)) in variants.iter().enumerate() {
        let l = Load::saturated(*batch, *writev, plan.sat_secs);
        let (mut without, mut with) = (Vec::new(), Vec::new());
        let mut figs = ProgFigures::default();
        let (mut call_ns, mut msg_ns, mut calls_per_msg) = (Vec::new(), Vec::new(), Vec::new());
        // ns per run of spice_sock_send (the observer's stats runs) and of each of
        // FLOOR_STEPS (the floor program last), each alone on the hook in runs of its own.
        // Only where the floor does what a call needs: one message in one buffer.
        let floor_comparable = *batch == 1 && !*writev;
        let mut send_run = Vec::new();
        let mut step_run: Vec<Vec<f64>> = vec![Vec::new(); FLOOR_STEPS.len()];
        // msgs/s with only each of YARDSTICKS on the hook.
        let mut yard: Vec<Vec<f64>> = vec![Vec::new(); YARDSTICKS.len()];
        let alone = Load::saturated(*batch, *writev, plan.alone_secs);
        for r in 0..plan.reps {
            eprintln!(
                "bench: saturated sender, {name}: repeat {}/{}",
                r + 1,
                plan.reps
            );
            // The timed runs, in reverse order in odd repeats (as the floor's steps below).
            let mut timed = vec![With::Without, With::Observer];
            if floor_comparable {
                timed.extend(YARDSTICKS.iter().map(|y| With::Yardstick(y.0)));
            }
            if r % 2 == 1 {
                timed.reverse();
            }
            for w in timed {
                match w {
                    With::Without => {
                        let a = run_load(&bins, &l, w, &format!("sat{i}-{r}-without"))?;
                        without.push(req_f64(&a.load, "data_messages_per_s")?);
                    }
                    With::Yardstick(y) => {
                        let a = run_load(&bins, &l, w, &format!("sat{i}-{r}-alone-{y}"))?;
                        let k = YARDSTICKS.iter().position(|p| p.0 == y).unwrap();
                        yard[k].push(req_f64(&a.load, "data_messages_per_s")?);
                    }
                    With::Observer => {
                        let b = run_load(&bins, &l, w, &format!("sat{i}-{r}-with"))?;
                        with.push(req_f64(&b.load, "data_messages_per_s")?);
                        note_report(&b.report, &mut hook_set);
                        exact_runs.1 += 1;
                        exact_runs.0 += usize::from(compare(&bins, &b)?.0);
                    }
                    _ => unreachable!("only timed runs are listed"),
                }
            }
            stats.set(true)?;
            let c = run_load(&bins, &l, With::Stats, &format!("sat{i}-{r}-stats"));
            stats.set(false)?;
            let c = c?;
            figs.add(&c.stats);
            let tot = &c.load["totals"];
            let (calls, msgs) = (
                req_u64(tot, "write_calls")? as f64,
                req_u64(tot, "messages_sent")? as f64,
            );
            let send = c.stats.iter().find(|s| s.0 == SOCK_SEND);
            if let Some((_, t, n)) = send {
                call_ns.push(*t as f64 / calls);
                if *n > 0 {
                    send_run.push(*t as f64 / *n as f64);
                }
            }
            if floor_comparable {
                // Forward in even repeats, backward in odd ones: a drift of the machine
                // within a repeat does not bias every step's difference the same way.
                let mut order: Vec<usize> = (0..FLOOR_STEPS.len()).collect();
                if r % 2 == 1 {
                    order.reverse();
                }
                for k in order {
                    let step = FLOOR_STEPS[k].0;
                    stats.set(true)?;
                    let f = run_load(
                        &bins,
                        &alone,
                        With::Reference(step),
                        &format!("sat{i}-{r}-{step}"),
                    );
                    stats.set(false)?;
                    let f = f?;
                    if let Some((_, st, sn)) = f.reference.iter().find(|f| f.0 == step && f.2 > 0) {
                        step_run[k].push(*st as f64 / *sn as f64);
                    }
                }
            }
            let all: u64 = c.stats.iter().map(|s| s.1).sum();
            msg_ns.push(all as f64 / msgs);
            calls_per_msg.push(calls / msgs);
        }
        let ratio = median(&with) / median(&without);
        rows.push(row(
            format!("saturated spice-peer load → client, 1 session × 1 channel, 200 B, W = 20, {name} (msgs/s)"),
            med_spread(&without, ""),
            med_spread(&with, ""),
            format!("throughput ratio {}", ratio_text(&with, &without)),
        ));
        if yard.iter().all(|v| !v.is_empty()) {
            rows.push(row(
                format!("  the same load with only a reference program on `sock_send_length`, {name} (no observer; msgs/s)"),
                "–",
                yardsticks_text(&yard, &without),
                format!("what the hook and the least a traced send needs cost the sender here: the observer's throughput ratio ({ratio:.2}) against these"),
            ));
        }
        rows.push(row(
            format!("  kernel time, {name} (bpf_stats runs)"),
            "–",
            format!(
                "`spice_sock_send` per observed send call {}",
                med_spread(&call_ns, " ns")
            ),
            match step_run.last().filter(|f| !f.is_empty() && !send_run.is_empty()) {
                None => format!("all programs: {} per message", med_spread(&msg_ns, " ns")),
                Some(floor_run) => format!(
                    "all programs: {} per message; per run, `{SOCK_SEND}` {} against the floor `{FLOOR}` {} (×{}), each alone on its hook, in separate runs (the floor's: {} s, no observer)",
                    med_spread(&msg_ns, " ns"),
                    med_spread(&send_run, " ns"),
                    med_spread(floor_run, " ns"),
                    num(median(&send_run) / median(floor_run)),
                    plan.alone_secs,
                ),
            },
        ));
        if step_run.iter().all(|v| !v.is_empty()) {
            rows.push(row(
                format!("  the floor in steps, {name} (bpf_stats, each step alone on the hook in {} s runs of its own)", plan.alone_secs),
                "–",
                floor_steps_text(&step_run),
                "each step's ns per run minus the one before is what its part costs; a difference smaller than the steps' spreads is not resolved",
            ));
        }
        programs.push(row(format!("saturated, {name}"), "", figs.text(), ""));
        per_call.push(call_ns);
    }
    let extra = (median(&per_call[1]) - median(&per_call[0])) / 9.0;
    rows.push(row(
        "  kernel time per additional message in the same call",
        "–",
        "–",
        format!(
            "{} ns ((10 per call − 1 per call) / 9, medians of `spice_sock_send` per call)",
            num(extra)
        ),
    ));

    // --- Unrelated syscalls and TCP.
    let mut target = Command::new("sleep")
        .arg("3600")
        .stdin(Stdio::null())
        .spawn()
        .context("starting `sleep` (the process the observer watches)")?;
    let target_pid = target.id();
    let res = unrelated(
        &bins,
        &plan,
        &stats,
        target_pid,
        &mut rows,
        &mut programs,
        &mut hook_set,
    );
    let res = res.and_then(|()| per_hook_set(&bins, &plan, &stats, target_pid));
    let _ = target.kill();
    let _ = target.wait();
    let sets = res?;

    // --- The agent at the seed's offered rate.
    eprintln!(
        "bench: agent, 10 sessions × 635 msgs/s for {} s",
        plan.agent_secs
    );
    let l = Load {
        sessions: 10,
        channels: 1,
        body: 200,
        rate: 635.0,
        batch: 1,
        writev: false,
        window: 20,
        secs: plan.agent_secs,
    };
    let a = run_load(&bins, &l, With::Agent, "agent")?;
    note_report(&a.report, &mut hook_set);
    let (agent_exact, _) = compare(&bins, &a)?;
    let s = a.agent.clone().ok_or_else(|| anyhow!("no agent samples"))?;
    let mib = |k: u64| format!("{:.1}", k as f64 / 1024.0);
    let (first, last, max) = (
        s.rss_kib.first().copied().unwrap_or(0),
        s.rss_kib.last().copied().unwrap_or(0),
        s.rss_kib.iter().copied().max().unwrap_or(0),
    );
    rows.push(row(
        format!(
            "agent (observe), 10 sessions × 635 msgs/s, {} s ({} msgs/s offered)",
            plan.agent_secs,
            num(6350.0)
        ),
        "–",
        format!(
            "CPU {:.2} % of one core; RSS first {} MiB, max {} MiB, last {} MiB ({} samples)",
            s.cpu_share * 100.0,
            mib(first),
            mib(max),
            mib(last),
            s.rss_kib.len()
        ),
        format!(
            "{} msgs/s sent; counts exact: {}",
            num(req_f64(&a.load, "data_messages_per_s")?),
            if agent_exact { "yes" } else { "NO" }
        ),
    ));

    // --- Stress.
    let total_rate = plan.stress_rate * plan.stress_sessions as f64;
    eprintln!(
        "bench: stress, {} msgs/s for {} s",
        num(total_rate),
        plan.stress_secs
    );
    let l = Load {
        sessions: plan.stress_sessions,
        channels: 1,
        body: 200,
        rate: plan.stress_rate,
        batch: 1,
        writev: false,
        window: 20,
        secs: plan.stress_secs,
    };
    let st = run_load(&bins, &l, With::Observer, "stress")?;
    note_report(&st.report, &mut hook_set);
    let (stress_exact, cmp) = compare(&bins, &st)?;
    let lost = cmp["events_lost"].as_u64();
    rows.push(row(
        format!(
            "stress, {} msgs/s offered ({} sessions × {} msgs/s), {} s",
            num(total_rate),
            plan.stress_sessions,
            num(plan.stress_rate),
            plan.stress_secs
        ),
        "–",
        format!(
            "{} msgs/s sent; events_lost {}",
            num(req_f64(&st.load, "data_messages_per_s")?),
            lost.map_or("?".into(), |n| n.to_string())
        ),
        if stress_exact {
            "counts exact (every channel: messages and bytes each way, ACKs, ACK_SYNCs)".to_string()
        } else {
            "**MISMATCH**: counts differ from the load generator's (below)".to_string()
        },
    ));

    // --- Output.
    let elapsed = t_start.elapsed().as_secs_f64();
    let mut md = String::new();
    md.push_str(&format!(
        "Machine: {}; kernel {}; hook set `{hook_set}`; observer {}; load average {} at start, {} at the end (other work on the machine is not stopped); {} in {:.0} s.\n\n",
        machine(),
        fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
        git_commit(root),
        load_start,
        loadavg(),
        if smoke { "`cargo xtask bench --smoke`" } else { "`cargo xtask bench`" },
        elapsed,
    ));
    md.push_str(&format!(
        "Median (min–max) of {} repeat(s), with and without the observer alternating; timed runs with `kernel.bpf_stats_enabled=0`, kernel times from separate runs with it on.\n\n",
        plan.reps
    ));
    md.push_str("| what | without | with | figure |\n|---|---|---|---|\n");
    for r in &rows {
        md.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            r.what, r.without, r.with, r.figure
        ));
    }
    md.push_str(
        "\nPer hook set (each framing hook set that `spice-observer doctor` finds loading here, \
         the observer started with `--hook-set`): the saturated sender (write, 1 message per \
         call) and the getppid loop of an unwatched process, as above.\n\n\
         | hook set | throughput ratio (msgs/s without → with) | kernel time per observed send call | getppid, unwatched | its programs on the getppid loop (bpf_stats) |\n|---|---|---|---|---|\n",
    );
    for r in &sets {
        md.push_str(&format!(
            "| `{}` | {} | {} | {} | {} |\n",
            r.set, r.ratio, r.per_call, r.getppid, r.on_getppid
        ));
    }
    md.push_str(
        "\nPer program (bpf_stats: median ns per run × runs in one run; kernel names, cut at 15 \
         characters; every program on the machine's calls, not only the watched process's):\n\n\
         | workload | programs |\n|---|---|\n",
    );
    for r in &programs {
        md.push_str(&format!("| {} | {} |\n", r.what, r.with));
    }
    md.push_str(&format!(
        "\nStress counts, per channel (load generator / observer, messages sent · messages received):\n\n{}\n",
        stress_table(&cmp)
    ));
    md.push_str(&format!(
        "\nThe observer's counts equalled the generator's in {}/{} saturated runs.\n",
        exact_runs.0, exact_runs.1
    ));
    println!("{md}");
    if write_readme {
        let path = root.join("README.md");
        let text = fs::read_to_string(&path)?;
        fs::write(&path, replace_section(&text, &md)?)?;
        eprintln!("bench: README.md section rewritten");
    }
    drop(stats);
    eprintln!("bench: finished in {elapsed:.0} s");
    if !stress_exact {
        bail!(
            "stress run: the observer's counts differ from the load generator's or information was lost: {}",
            cmp["problems"]
        );
    }
    Ok(())
}

/// `spice-observer bench compare` of one observed load run: (exact, its JSON).
fn compare(bins: &Bins, r: &LoadRun) -> Result<(bool, Value)> {
    let report = r
        .report_path
        .as_ref()
        .ok_or_else(|| anyhow!("no observer report to compare"))?;
    let out = Command::new(&bins.observer)
        .args(["bench", "compare", "--report"])
        .arg(report)
        .arg("--load")
        .arg(&r.load_path)
        .output()
        .context("spice-observer bench compare")?;
    let v: Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "spice-observer bench compare ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    let exact = v["exact"].as_bool() == Some(true) && out.status.success();
    if !exact {
        eprintln!("bench: counts differ: {}", v["problems"]);
    }
    Ok((exact, v))
}

fn stress_table(cmp: &Value) -> String {
    let mut t = String::from(
        "| channel | load sent · recv | observer sent · recv | equal |\n|---|---|---|---|\n",
    );
    for c in cmp["channels"].as_array().into_iter().flatten() {
        let l = &c["load"];
        let o = &c["observer"];
        t.push_str(&format!(
            "| session {} display {} | {} · {} | {} · {} | {} |\n",
            c["session"],
            c["channel_id"],
            l["messages_sent"],
            l["messages_received"],
            o["messages_sent"],
            o["messages_received"],
            if c["equal"].as_bool() == Some(true) {
                "yes"
            } else {
                "**NO**"
            }
        ));
    }
    t
}

/// The framing hook sets that load here, from `spice-observer doctor --json` (`built` and
/// `loaded`), in its order (cheapest first).
fn loaded_hook_sets(bins: &Bins) -> Result<Vec<String>> {
    let out = Command::new(&bins.observer)
        .args(["doctor", "--json"])
        .stderr(Stdio::null())
        .output()
        .context("spice-observer doctor --json")?;
    let v: Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("spice-observer doctor --json ({}): not JSON", out.status))?;
    let sets = v["hook_sets"]
        .as_array()
        .ok_or_else(|| anyhow!("doctor --json has no `hook_sets`"))?;
    let mut names = Vec::new();
    for h in sets {
        if h["built"].as_bool() == Some(true) && h["state"].as_str() == Some("loaded") {
            names.push(req_str(h, "name")?.to_string());
        }
    }
    Ok(names)
}

/// One hook set's line of the per-hook-set table (formatted cells).
struct SetRow {
    set: String,
    ratio: String,
    per_call: String,
    getppid: String,
    on_getppid: String,
}

/// The programs a hook set runs on the socket calls themselves (kernel names, cut at 15
/// characters: `spice_kretprobe` is the return probe of both directions), and the empty
/// reference program on the hook that also fires for unrelated syscalls (if it has one).
fn set_programs(
    set: &str,
) -> (
    &'static [&'static str],
    Option<(&'static str, &'static str)>,
) {
    match set {
        "syscalls" => (
            &["spice_sys_exit"],
            Some(("sys_exit", "spice_ref_sys_exit")),
        ),
        "fentry" => (&["spice_fexit_sen", "spice_fexit_rec"], None),
        "kprobes" => (
            &["spice_kprobe_se", "spice_kprobe_re", "spice_kretprobe"],
            None,
        ),
        _ => (&[SOCK_SEND, "spice_sock_recv"], None),
    }
}

/// Each framing hook set that loads here: the saturated sender's throughput ratio and
/// kernel time per send call (write, 1 message per call), and what an unwatched process's
/// getppid pays (timed, and its programs' bpf_stats against the empty reference program on
/// the same hook).
fn per_hook_set(bins: &Bins, plan: &Plan, stats: &BpfStats, target: u32) -> Result<Vec<SetRow>> {
    let mut out = Vec::new();
    for set in loaded_hook_sets(bins)? {
        check_interrupted()?;
        let bins = Bins {
            hook_set: Some(set.clone()),
            ..bins.clone()
        };
        let (progs, reference) = set_programs(&set);
        let l = Load::saturated(1, false, plan.sat_secs);
        let (mut without, mut with, mut call_ns, mut msg_ns) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut g0, mut g1) = (Vec::new(), Vec::new());
        let mut exact = 0;
        for r in 0..plan.reps {
            eprintln!("bench: hook set {set}: repeat {}/{}", r + 1, plan.reps);
            let a = run_load(&bins, &l, With::Without, &format!("set-{set}-{r}-without"))?;
            without.push(req_f64(&a.load, "data_messages_per_s")?);
            let b = run_load(&bins, &l, With::Observer, &format!("set-{set}-{r}-with"))?;
            with.push(req_f64(&b.load, "data_messages_per_s")?);
            let h = b.report.as_ref().and_then(|r| r["hook_set"].as_str());
            if h.is_none_or(|h| h.split('+').next() != Some(set.as_str())) {
                bail!("the observer started with --hook-set {set} reported hook_set {h:?}");
            }
            exact += usize::from(compare(&bins, &b)?.0);
            stats.set(true)?;
            let c = run_load(&bins, &l, With::Stats, &format!("set-{set}-{r}-stats"));
            stats.set(false)?;
            let c = c?;
            let calls = req_u64(&c.load["totals"], "write_calls")? as f64;
            let msgs = req_u64(&c.load["totals"], "messages_sent")? as f64;
            let ours: u64 = c
                .stats
                .iter()
                .filter(|s| progs.contains(&s.0.as_str()))
                .map(|s| s.1)
                .sum();
            call_ns.push(ours as f64 / calls);
            msg_ns.push(c.stats.iter().map(|s| s.1).sum::<u64>() as f64 / msgs);
            g0.push(syscalls(&bins, "getppid", plan.getppid_calls)?);
            let o = Observer::start(&bins, target, &format!("set-{set}-{r}-getppid"))?;
            let g = syscalls(&bins, "getppid", plan.getppid_calls);
            o.stop()?;
            g1.push(g?);
        }
        // The getppid loop with statistics: this set's programs, then the empty reference.
        stats.set(true)?;
        let measured = (|| -> Result<_> {
            let o = Observer::start(&bins, target, &format!("set-{set}-getppid-stats"))?;
            let r = (|| -> Result<_> {
                let a = prog_stats(&bins, "spice_")?;
                syscalls(&bins, "getppid", plan.getppid_calls)?;
                Ok(stats_delta(&a, &prog_stats(&bins, "spice_")?, &o.before))
            })();
            o.stop()?;
            let ours = r?;
            let refs = match reference {
                Some((hook, _)) => {
                    let rf = Reference::start(&bins, hook)?;
                    let r = (|| -> Result<_> {
                        let a = rf.stats(&bins)?;
                        syscalls(&bins, "getppid", plan.getppid_calls)?;
                        Ok(stats_delta(&a, &rf.stats(&bins)?, &[]))
                    })();
                    rf.stop()?;
                    r?
                }
                None => Vec::new(),
            };
            Ok((ours, refs))
        })();
        stats.set(false)?;
        let (ours, refs) = measured?;
        let calls = plan.getppid_calls as f64;
        let (t, n) = ours
            .iter()
            .fold((0u64, 0u64), |(t, n), s| (t + s.1, n + s.2));
        let mut on_getppid = format!(
            "{} runs per call, {} ns per call",
            num(n as f64 / calls),
            num(t as f64 / calls)
        );
        if let Some((_, name)) = reference {
            let per_run = |s: &[(String, u64, u64)], p: &str| {
                s.iter()
                    .find(|x| x.0 == p)
                    .map_or(f64::NAN, |x| x.1 as f64 / x.2 as f64)
            };
            let (mine, empty) = (per_run(&ours, progs[0]), per_run(&refs, name));
            on_getppid.push_str(&format!(
                "; `{}` {} ns per run against the empty `{name}` {} ns (×{})",
                progs[0],
                num(mine),
                num(empty),
                num(mine / empty)
            ));
        }
        out.push(SetRow {
            ratio: format!(
                "{:.2} ({} → {}); counts exact in {exact}/{}",
                median(&with) / median(&without),
                med_spread(&without, ""),
                med_spread(&with, ""),
                plan.reps
            ),
            per_call: format!(
                "{} {}; all programs {} per message",
                progs
                    .iter()
                    .map(|p| format!("`{p}`"))
                    .collect::<Vec<_>>()
                    .join(" + "),
                med_spread(&call_ns, " ns"),
                med_spread(&msg_ns, " ns")
            ),
            getppid: format!(
                "{:+.0} ns per call ({} → {})",
                median(&g1) - median(&g0),
                med_spread(&g0, " ns"),
                med_spread(&g1, " ns")
            ),
            on_getppid,
            set,
        });
    }
    Ok(out)
}

/// The per-hook-set pass alone, for a QEMU guest (`cargo xtask guest --bench`, run inside
/// the guest as `xtask guest-bench`): every framing set that loads there, one repeat, a 2 s
/// saturated sender and 200 k getppid calls (TCG runs the guest's code about an order of
/// magnitude slower than the host, so absolute times mean little; the ratios against the
/// same run's figures do). Prints one `guest-matrix: bench SET\tRATIO\tPER_CALL\tGETPPID\t
/// ON_GETPPID` line per set.
pub(crate) fn guest_sets(observer: PathBuf, peer: PathBuf) -> Result<()> {
    let bins = prepare(observer, peer)?;
    let plan = Plan {
        sat_secs: 2.0,
        getppid_calls: 200_000,
        ..Plan::new(true)
    };
    let stats = BpfStats::take()?;
    stats.set(false)?;
    let mut target = Command::new("sleep")
        .arg("3600")
        .stdin(Stdio::null())
        .spawn()
        .context("starting `sleep` (the process the observer watches)")?;
    let res = per_hook_set(&bins, &plan, &stats, target.id());
    let _ = target.kill();
    let _ = target.wait();
    for r in res? {
        println!(
            "guest-matrix: bench {}\t{}\t{}\t{}\t{}",
            r.set, r.ratio, r.per_call, r.getppid, r.on_getppid
        );
    }
    Ok(())
}

/// The unrelated-process workloads: getppid, pipe, iperf3, and the reference programs.
fn unrelated(
    bins: &Bins,
    plan: &Plan,
    stats: &BpfStats,
    target: u32,
    rows: &mut Vec<Row>,
    programs: &mut Vec<Row>,
    hook_set: &mut String,
) -> Result<()> {
    let (mut g0, mut g1, mut p0, mut p1, mut i0, mut i1) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    let mut lost = Vec::new();
    for r in 0..plan.reps {
        eprintln!(
            "bench: unrelated syscalls and iperf3: repeat {}/{}",
            r + 1,
            plan.reps
        );
        g0.push(syscalls(bins, "getppid", plan.getppid_calls)?);
        p0.push(syscalls(bins, "pipe", plan.pipe_calls)?);
        i0.push(iperf(plan.iperf_secs)?);
        let o = Observer::start(bins, target, &format!("unrelated-{r}"))?;
        let w = (|| -> Result<(f64, f64, f64)> {
            Ok((
                syscalls(bins, "getppid", plan.getppid_calls)?,
                syscalls(bins, "pipe", plan.pipe_calls)?,
                iperf(plan.iperf_secs)?,
            ))
        })();
        let rep = o.stop()?;
        let (g, p, i) = w?;
        g1.push(g);
        p1.push(p);
        i1.push(i);
        lost.push(req_u64(&rep, "events_lost")?);
        if let Some(h) = rep["hook_set"].as_str() {
            *hook_set = h.to_string();
        }
    }
    // The empty reference sys_enter alone, statistics off: what any program there costs.
    let rf = Reference::start(bins, "sys_enter")?;
    let g_ref = syscalls(bins, "getppid", plan.getppid_calls);
    rf.stop()?;
    let g_ref = g_ref?;

    // Statistics: the observer's programs, then the reference programs, on the same loops.
    eprintln!("bench: unrelated syscalls and iperf3 with bpf_stats");
    stats.set(true)?;
    let measured = (|| -> Result<_> {
        let o = Observer::start(bins, target, "unrelated-stats")?;
        let r = (|| -> Result<_> {
            let a = prog_stats(bins, "spice_")?;
            syscalls(bins, "getppid", plan.getppid_calls)?;
            let b = prog_stats(bins, "spice_")?;
            iperf(plan.iperf_secs)?;
            let c = prog_stats(bins, "spice_")?;
            Ok((
                stats_delta(&a, &b, &o.before),
                stats_delta(&b, &c, &o.before),
            ))
        })();
        o.stop()?;
        let (ours_g, ours_i) = r?;
        let rf = Reference::start(bins, "sys_enter,sock_send,sock_recv")?;
        let r = (|| -> Result<_> {
            let a = rf.stats(bins)?;
            syscalls(bins, "getppid", plan.getppid_calls)?;
            let b = rf.stats(bins)?;
            iperf(plan.iperf_secs)?;
            let c = rf.stats(bins)?;
            Ok((stats_delta(&a, &b, &[]), stats_delta(&b, &c, &[])))
        })();
        rf.stop()?;
        let (ref_g, ref_i) = r?;
        Ok((ours_g, ours_i, ref_g, ref_i))
    })();
    stats.set(false)?;
    let (ours_g, ours_i, ref_g, ref_i) = measured?;
    let per_run = |s: &[(String, u64, u64)], name: &str| {
        s.iter()
            .find(|x| x.0 == name)
            .map_or(f64::NAN, |x| x.1 as f64 / x.2 as f64)
    };
    // The observer has no program on syscall entry: what its programs ran during the getppid
    // loop (forks, exits of other processes), per getppid call.
    let ours_g_runs: u64 = ours_g.iter().map(|x| x.2).sum();
    let ref_se = per_run(&ref_g, "spice_ref_sys_enter");
    let (ours_ss, ref_ss) = (
        per_run(&ours_i, SOCK_SEND),
        per_run(&ref_i, "spice_ref_sock_send"),
    );
    let fmt_delta = |a: &[f64], b: &[f64]| format!("{:+.0} ns", median(b) - median(a));
    rows.push(row(
        format!(
            "getppid() in an unwatched process, {} calls (ns per call)",
            num(plan.getppid_calls as f64)
        ),
        med_spread(&g0, " ns"),
        med_spread(&g1, " ns"),
        format!(
            "{} per syscall; with only the empty reference `sys_enter` attached: {} ns ({:+.0} ns)",
            fmt_delta(&g0, &g1),
            num(g_ref),
            g_ref - median(&g0)
        ),
    ));
    rows.push(row(
        format!(
            "8-byte write + read on a pipe, unwatched, {} pairs (ns per pair)",
            num(plan.pipe_calls as f64)
        ),
        med_spread(&p0, " ns"),
        med_spread(&p1, " ns"),
        format!("{} per pair", fmt_delta(&p0, &p1)),
    ));
    rows.push(row(
        "the observer's programs during the getppid loop, bpf_stats",
        format!("empty reference `sys_enter` {} ns per run", num(ref_se)),
        format!("{ours_g_runs} runs in all"),
        format!(
            "{:.6} runs per getppid call: no program on syscall entry",
            ours_g_runs as f64 / plan.getppid_calls as f64
        ),
    ));
    rows.push(row(
        format!(
            "iperf3 over loopback, unwatched, {} s (Gbit/s)",
            plan.iperf_secs
        ),
        med_spread(&i0, ""),
        med_spread(&i1, ""),
        format!(
            "ratio {:.3}; `spice_sock_send` {} ns per run vs the empty reference {} ns",
            median(&i1) / median(&i0),
            num(ours_ss),
            num(ref_ss)
        ),
    ));
    for (label, stats) in [
        ("getppid loop, observer watching `sleep`", &ours_g),
        ("getppid loop, empty reference programs", &ref_g),
        ("iperf3, observer watching `sleep`", &ours_i),
        ("iperf3, empty reference programs", &ref_i),
    ] {
        let mut figs = ProgFigures::default();
        figs.add(stats);
        programs.push(row(label, "", figs.text(), ""));
    }
    if lost.iter().any(|&n| n != 0) {
        eprintln!("bench: the observer watching `sleep` reported events_lost {lost:?}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_spreads() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        assert_eq!(
            med_spread(&[120.0, 110.0, 127.0], " ns"),
            "120 ns (110–127)"
        );
        assert_eq!(med_spread(&[137_694.0], ""), "138 k");
        assert_eq!(num(0.694), "0.69");
        assert_eq!(num(34.7e9 / 1e9), "34.7");
        assert_eq!(num(12_345_678.0), "12.3 M");
        assert_eq!(num(5e6), "5.00 M");
    }

    #[test]
    fn floor_steps_say_each_parts_cost() {
        let runs: Vec<Vec<f64>> = [100.0, 120.0, 150.0, 140.0, 170.0, 200.0, 260.0, 300.0]
            .iter()
            .map(|&m| vec![m - 1.0, m, m + 5.0])
            .collect();
        let t = floor_steps_text(&runs);
        assert!(
            t.starts_with("`spice_ref_step1` 100 ns (99.0–105) (+100 ns: the filter"),
            "{t}"
        );
        assert!(
            t.contains("`spice_ref_step4` 140 ns (139–145) (−10.0 ns: the clock)"),
            "{t}"
        );
        assert!(
            t.ends_with(
                "`spice_ref_floor` 300 ns (299–305) (+40.0 ns: the 72-byte record's stores)"
            ),
            "{t}"
        );
    }

    #[test]
    fn stats_deltas_by_id() {
        let p = |id, name: &str, t, c| ProgStat {
            id,
            name: name.into(),
            run_time_ns: t,
            run_cnt: c,
        };
        let before = [p(1, "spice_old", 0, 0)];
        let a = [
            p(1, "spice_old", 10, 1),
            p(2, "spice_sock_send", 100, 10),
            p(3, "spice_ssl_ret", 0, 0),
        ];
        let b = [
            p(1, "spice_old", 50, 5),
            p(2, "spice_sock_send", 1100, 20),
            p(3, "spice_ssl_ret", 0, 0),
            p(4, "spice_new", 5, 1),
        ];
        // Id 1 existed before the observer, 3 never ran, 4 was not there at the start.
        assert_eq!(
            stats_delta(&a, &b, &before),
            vec![("spice_sock_send".into(), 1000, 10)]
        );
        let s = parse_stats(r#"{"programs":[{"id":2,"name":"x","run_time_ns":5,"run_cnt":1}]}"#)
            .unwrap();
        assert_eq!(s, vec![p(2, "x", 5, 1)]);
        assert!(parse_stats(r#"{"programs":[{"id":2,"name":"x"}]}"#).is_err());
    }

    #[test]
    fn readme_section() {
        let r = "a\n<!-- bench:begin -->\nold\n<!-- bench:end -->\nb\n";
        assert_eq!(
            replace_section(r, "new\n").unwrap(),
            "a\n<!-- bench:begin -->\nnew\n<!-- bench:end -->\nb\n"
        );
        assert!(replace_section("no markers", "x").is_err());
    }

    #[test]
    fn yardsticks_against_the_load_alone() {
        let without = [150_000.0, 160_000.0, 140_000.0];
        let t = yardsticks_text(
            &[
                vec![150_000.0, 140_000.0, 145_000.0],
                vec![120_000.0, 130_000.0, 126_000.0],
            ],
            &without,
        );
        assert_eq!(
            t,
            "`spice_ref_sock_send` (empty) 145 k (140 k–150 k): ratio 0.97 (per repeat \
             0.88–1.04); `spice_ref_floor` (the floor: the least a traced send needs) 126 k \
             (120 k–130 k): ratio 0.84 (per repeat 0.80–0.90)"
        );
        // One repeat, or repeats that do not pair: the ratio of the medians alone.
        assert_eq!(ratio_text(&[90.0], &[100.0]), "0.90");
        assert_eq!(ratio_text(&[90.0, 80.0], &[100.0]), "0.85");
    }

    #[test]
    fn mitigations_that_shape_call_costs() {
        let dir = std::env::temp_dir().join(format!("bench-vuln-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        assert_eq!(mitigations(&dir), "CPU mitigations: none reported");
        fs::write(
            dir.join("spectre_v2"),
            "Mitigation: Retpolines; STIBP: disabled\n",
        )
        .unwrap();
        fs::write(dir.join("retbleed"), "Not affected\n").unwrap();
        fs::write(
            dir.join("spec_rstack_overflow"),
            "Vulnerable: Safe RET, no microcode\n",
        )
        .unwrap();
        fs::write(dir.join("meltdown"), "Mitigation: PTI\n").unwrap();
        assert_eq!(
            mitigations(&dir),
            "CPU mitigations: spectre_v2 \"Mitigation: Retpolines; STIBP: disabled\", \
             spec_rstack_overflow \"Vulnerable: Safe RET, no microcode\""
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn proc_parsing() {
        let stat = "123 (tokio rt (x)) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 3 0";
        assert_eq!(stat_ticks(stat), Some(300));
        assert_eq!(
            status_rss_kib("Name:\tx\nVmRSS:\t  41234 kB\n"),
            Some(41234)
        );
        assert_eq!(status_rss_kib("Name:\tx\n"), None);
    }
}
