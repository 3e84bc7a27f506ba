//! `spice-observer observe`: attach to one or more processes, follow their SPICE sockets for a
//! while, then print a table (and optionally JSON, the sample series, a plot). A thin front end
//! over [`Engine`]: it arranges the engine's calls and writes the outputs.

use std::{
    collections::{BTreeMap, HashSet},
    io::{IsTerminal, Write},
    path::PathBuf,
    time::Duration,
};

use anyhow::{Context, Result, bail};
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    kernel::tls::{self, TlsHooks},
    pipeline::{
        Beside, Engine, EngineOptions, Progress, monotonic_ns,
        ticker::{Due, SampleClock, Ticker},
    },
    report::{self, Report},
    samples::SampleLine,
    sockdiag,
};

/// Options of one observation.
#[derive(Clone, Debug)]
pub struct ObserveOptions {
    /// Processes to watch (host pid namespace).
    pub pids: Vec<u32>,
    /// How long to observe; `None` = until Ctrl-C / SIGTERM.
    pub duration: Option<Duration>,
    /// Where to write the JSON report (`-` = stdout).
    pub json: Option<PathBuf>,
    /// Interval between TCP state samples.
    pub sample: Duration,
    /// Print the live progress line.
    pub progress: bool,
    /// Append every decoded kernel record to this file (debugging aid).
    pub dump_events: Option<PathBuf>,
    /// Write the stage plot (SVG) here.
    pub plot: Option<PathBuf>,
    /// Write the per-sample series (JSON Lines, [`crate::samples::SampleLine`]) here
    /// (`-` = stdout).
    pub samples: Option<PathBuf>,
    /// The daemon's pin directory: observe reads the set pinned there when it is complete
    /// and of this layout ([`Engine::start_beside`]), else loads its own programs. `None`:
    /// always loads its own.
    pub pin_dir: Option<PathBuf>,
    /// Attach the libssl uprobes to the watched processes ([`crate::kernel::tls`]); false
    /// (`--no-tls-hooks`): none, every process's status is `disabled`.
    pub tls_hooks: bool,
    /// The hook set to load when observe loads its own programs (not beside a daemon).
    pub hook_set: crate::kernel::loader::HookChoice,
}

// Re-exported for callers of the former `observe` module.
pub use crate::pipeline::realtime_ns;

/// Most samples `--plot` keeps per channel: at 100 ms samples, 6.8 minutes at full resolution.
pub const PLOT_KEEP: usize = 4096;

/// The display channels' sample lines kept for `--plot`, bounded by [`PLOT_KEEP`] samples
/// whatever the run's length: each time the cap is reached, every second sample kept is
/// dropped and from then on only every second sample is taken (the series spans the whole run
/// with between [`PLOT_KEEP`] / 2 and [`PLOT_KEEP`] samples per channel, evenly spaced).
#[derive(Default)]
struct PlotLines {
    /// (sample number, line), in sample order.
    lines: Vec<(u64, SampleLine)>,
    /// Samples offered so far, and the stride of those kept (a power of two).
    offered: u64,
    stride: u64,
    /// Samples kept (a sample keeps at most one line per channel).
    kept: usize,
}

impl PlotLines {
    fn add(&mut self, lines: Vec<SampleLine>) {
        self.stride = self.stride.max(1);
        let n = self.offered;
        self.offered += 1;
        if !n.is_multiple_of(self.stride) {
            return;
        }
        let before = self.lines.len();
        self.lines.extend(
            lines
                .into_iter()
                .filter(|l| l.channel_type == "display")
                .map(|l| (n, l)),
        );
        if self.lines.len() > before {
            self.kept += 1;
        }
        if self.kept > PLOT_KEEP {
            self.stride *= 2;
            let stride = self.stride;
            self.lines.retain(|(k, _)| k.is_multiple_of(stride));
            self.kept = self
                .lines
                .iter()
                .map(|(k, _)| *k)
                .collect::<HashSet<_>>()
                .len();
        }
    }

    fn lines(&self) -> impl Iterator<Item = &SampleLine> {
        self.lines.iter().map(|(_, l)| l)
    }
}

/// The plotted series of every display channel of spice-server with placed samples: the
/// sample lines of its socket, drawn with the stages its chain can place (from the report).
fn plot_series<'a>(
    rep: &Report,
    lines: impl IntoIterator<Item = &'a SampleLine>,
) -> Vec<crate::plot::ChannelSeries> {
    let mut by_socket: BTreeMap<&str, Vec<&SampleLine>> = BTreeMap::new();
    for l in lines {
        if l.channel_type == "display" && !l.stages.is_empty() {
            by_socket.entry(l.socket.as_str()).or_default().push(l);
        }
    }
    let mut out = Vec::new();
    for c in &rep.channels {
        let (Some(chain), Some(limit)) = (c.chain.as_ref(), c.in_flight_limit) else {
            continue;
        };
        let Some(samples) = by_socket.get(c.socket.as_str()) else {
            continue;
        };
        let relay = chain.backend.is_some();
        let stages = chain
            .placeable_stages
            .iter()
            .map(|name| {
                (
                    name.clone(),
                    samples
                        .iter()
                        .map(|x| x.stages.get(name).copied().unwrap_or(0))
                        .collect(),
                )
            })
            .collect();
        let t_s: Vec<f64> = samples.iter().map(|x| x.t_s).collect();
        // Delivered: the last byte TCP-acknowledged on the client-facing link (the relay's
        // leg toward the client, or spice-server's socket without a relay).
        let delivered = |x: &SampleLine| {
            if relay {
                x.legs.relay_client.as_ref().map(|l| l.snd_una)
            } else {
                x.legs.server.as_ref().map(|l| l.snd_una)
            }
        };
        let mut throughput = Vec::with_capacity(samples.len());
        let mut prev: Option<(f64, u32)> = None;
        for x in samples {
            let d = delivered(x);
            let v = match (prev, d) {
                (Some((t0, d0)), Some(d1)) if x.t_s > t0 => {
                    d1.wrapping_sub(d0) as f64 * 8.0 / (x.t_s - t0) / 1e6
                }
                _ => 0.0,
            };
            throughput.push(v);
            if let Some(d) = d {
                prev = Some((x.t_s, d));
            }
        }
        let relay_visible = relay.then(|| {
            samples
                .iter()
                .map(|x| x.in_flight_relay.map_or(0, |r| r as i64))
                .collect()
        });
        out.push(crate::plot::ChannelSeries {
            title: format!(
                "{} {} — {} pid {}, {}",
                c.channel_type,
                c.channel_id.unwrap_or(0),
                c.comm,
                c.pid,
                if c.socket.starts_with("cookie:") {
                    ""
                } else {
                    &c.socket
                }
            ),
            limit: limit as u32,
            t_s,
            stages,
            relay_visible,
            throughput_mbit: throughput,
        });
    }
    out
}

/// Creates (truncates) an output file now, so that a bad path fails before observing.
fn check_writable(path: &std::path::Path, what: &str) -> Result<()> {
    std::fs::File::create(path)
        .with_context(|| format!("cannot write the {what} to {}", path.display()))?;
    Ok(())
}

fn progress_line(p: &Progress, secs: f64) -> String {
    format!(
        "[{secs:6.1}s] {} sockets, {} framed, {} msgs, display in flight {}, lost {}",
        p.sockets,
        p.framed,
        p.messages,
        if p.display_in_flight.is_empty() {
            "-".into()
        } else {
            p.display_in_flight
                .iter()
                .map(|(c, l)| format!("{c}/{l}"))
                .collect::<Vec<_>>()
                .join(" ")
        },
        p.lost,
    )
}

/// Prints the one line of a process whose libssl hooks failed ([`tls::failure_line`]).
fn tls_failure(tgid: u32, status: &crate::model::tls::TlsAttach) {
    let comm = sockdiag::comm(tgid).unwrap_or_default();
    if let Some(line) = tls::failure_line(tgid, &comm, status, None) {
        eprintln!("spice-observer: {line}");
    }
}

/// Hands the release of this process's libssl uprobe links (file descriptors `entries` and
/// `rets`, [`crate::loader::Capture::tls_link_fds`]) to a child process: it closes every
/// other descriptor it inherited (its copies of the maps, the programs, the TAP lock, the
/// output pipes), then the entry programs' links, then the uretprobes' (each last close
/// detaches one uprobe, ~0.1 s in the kernel), and exits. This process's own closes are
/// then not the last and cost nothing. Returns false when no child could be started (the
/// caller then releases them itself).
fn hand_off_release(entries: &[i32], rets: &[i32]) -> bool {
    let keep: std::collections::BTreeSet<i32> = entries.iter().chain(rets).copied().collect();
    let others: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|d| d.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter(|fd| !keep.contains(fd))
        .collect();
    // SAFETY: after fork the child (a copy of one thread of a threaded process) makes only
    // async-signal-safe calls (setsid, close, _exit) over slices allocated before the fork.
    unsafe {
        match libc::fork() {
            -1 => false,
            0 => {
                libc::setsid();
                for &fd in &others {
                    libc::close(fd);
                }
                for &fd in entries {
                    libc::close(fd);
                }
                for &fd in rets {
                    libc::close(fd);
                }
                libc::_exit(0)
            }
            _ => true,
        }
    }
}

/// Runs one observation and prints its report.
pub async fn run(opts: ObserveOptions) -> Result<()> {
    if opts.pids.is_empty() {
        bail!("give at least one --pid");
    }
    let me = std::process::id();
    let mut roots: Vec<u32> = Vec::new();
    // Said once, when the last watched process is gone.
    let mut all_exited = false;
    for &pid in &opts.pids {
        let tgid = crate::pipeline::thread_group(pid)?;
        if tgid != pid {
            eprintln!(
                "spice-observer: pid {pid} is a thread of process {tgid}; watching process {tgid}"
            );
        }
        if tgid == me {
            bail!("refusing to watch the observer itself (pid {me})");
        }
        if !roots.contains(&tgid) {
            roots.push(tgid);
        }
    }
    if opts.hook_set == crate::kernel::loader::HookChoice::Tcpinfo {
        // No BPF: sock_diag polling only (cmd/tcpinfo.rs).
        return crate::cmd::tcpinfo::run(opts, roots).await;
    }
    if let Some(p) = opts.json.as_ref().filter(|p| p.as_os_str() != "-") {
        check_writable(p, "JSON report")?;
    }
    if let Some(p) = &opts.plot {
        check_writable(p, "plot")?;
    }
    let stdout_json = opts.json.as_ref().is_some_and(|p| p.as_os_str() == "-");
    let stdout_samples = opts.samples.as_ref().is_some_and(|p| p.as_os_str() == "-");
    if stdout_json && stdout_samples {
        bail!("--json - and --samples - would both write to stdout: give one of them a file path");
    }
    let mut samples_out = match &opts.samples {
        Some(p) => Some(crate::samples::SampleWriter::create(p)?),
        None => None,
    };
    // Handlers first: a Ctrl-C from here on ends the run through the clean-up of the TAP
    // flags (Engine::untap) instead of killing the process.
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let engine_opts = EngineOptions {
        sample: opts.sample,
        retain_closed: true,
        bpf_stats: false,
        hook_set: opts.hook_set,
    };
    let beside = match &opts.pin_dir {
        Some(dir) => match Engine::start_beside(engine_opts.clone(), dir) {
            Ok(b) => b,
            // Not allowed to read the daemon's pins (not root): the own load below fails
            // with the usual explanation of what is missing.
            Err(e) if crate::host::privilege::is_permission_error(&e) => {
                Beside::Unusable(format!("{e:#}"))
            }
            Err(e) => return Err(e),
        },
        None => Beside::Absent,
    };
    let mut engine = match beside {
        Beside::Tapped(e) => *e,
        Beside::Absent => Engine::start(engine_opts)?,
        Beside::Unusable(why) => {
            eprintln!(
                "spice-observer: the pinned state at {} cannot be read ({why}); loading own programs",
                opts.pin_dir
                    .as_deref()
                    .unwrap_or(std::path::Path::new("?"))
                    .display()
            );
            Engine::start(engine_opts)?
        }
    };
    eprintln!("spice-observer: {}", engine.source().line());
    // Nothing is reported unless the hooks count a known SPICE exchange exactly. Before the
    // dump starts: the test's records are not the observation's.
    engine.self_test()?;
    if let Some(p) = &opts.dump_events {
        engine.dump_events(p)?;
    }
    // The libssl hooks of each process are attached before it is watched, so that its
    // sockets' first calls already run inside hooked functions; then at each tick for the
    // processes watched since (forked children), and again for those without a libssl.
    let beside = engine.source().tap;
    // Links of processes that went are released on a background thread (~0.1 s per uprobe
    // in the kernel), all of them at the end.
    let mut tls_hooks = TlsHooks::new(opts.tls_hooks).with_detacher();
    if opts.tls_hooks {
        tls::raise_fd_limit();
    } else {
        // Loaded but never attached: not part of what is in use.
        engine.capture_and_model().0.hook_set_without_libssl();
    }
    let mut watched = Vec::new();
    for &pid in &roots {
        let (cap, model) = engine.capture_and_model();
        let (root, children) = tls_hooks.attach_first(cap, model, pid, beside);
        for (t, s) in root.map(|s| (pid, s)).into_iter().chain(children) {
            tls_failure(t, &s);
        }
        watched.push(engine.watch(pid)?);
    }
    let started_ns = engine.started().monotonic_ns;
    eprintln!(
        "spice-observer: watching {} (hook set {}; {} listening port(s) enrolled, {} connection(s) already open); {}",
        watched
            .iter()
            .map(|w| format!("pid {} ({})", w.pid, w.comm))
            .collect::<Vec<_>>()
            .join(", "),
        engine.hook_set(),
        watched.iter().map(|w| w.ports_enrolled).sum::<usize>(),
        watched
            .iter()
            .map(|w| w.existing_connections)
            .sum::<usize>(),
        match opts.duration {
            Some(d) => format!("{:.0} s", d.as_secs_f64()),
            None => "until Ctrl-C".into(),
        }
    );

    // The plot needs the whole series of the display channels: kept here, in the front end.
    let mut plot_lines = PlotLines::default();
    // Kernel timers, one wake-up per period (pipeline::ticker says why not tokio's).
    let mut sample = SampleClock::new(opts.sample)?;
    let mut tick = Ticker::new(Duration::from_secs(1))?;
    let deadline = tokio::time::sleep(opts.duration.unwrap_or(Duration::from_secs(u64::MAX / 4)));
    tokio::pin!(deadline);
    let tty = std::io::stderr().is_terminal();
    let mut ticks = 0u64;
    loop {
        tokio::select! {
            r = engine.drain_ready() => r?,
            due = sample.tick() => {
                if due? == Due::Drain {
                    engine.drain();
                    continue;
                }
                if samples_out.is_none() && opts.plot.is_none() {
                    engine.sample_only(monotonic_ns());
                    continue;
                }
                let lines = engine.sample(monotonic_ns());
                if let Some(w) = samples_out.as_mut() {
                    w.write(&lines);
                }
                if opts.plot.is_some() {
                    plot_lines.add(lines);
                }
            }
            t = tick.tick() => {
                t?;
                ticks += 1;
                let (cap, model) = engine.capture_and_model();
                match tls_hooks.follow(cap, model, beside) {
                    Ok(changes) => {
                        for c in changes {
                            if let Some(s) = &c.status {
                                tls_failure(c.tgid, s);
                            }
                        }
                    }
                    Err(e) => log::debug!("libssl hooks: reading WATCHED_TGIDS: {e:#}"),
                }
                if let Some(w) = samples_out.as_mut() {
                    w.flush();
                }
                if !all_exited && roots.iter().all(|&p| sockdiag::comm(p).is_none()) {
                    all_exited = true;
                    eprintln!("\nspice-observer: every watched process has exited");
                    if opts.duration.is_none() {
                        break;
                    }
                }
                if opts.progress {
                    let secs = (monotonic_ns() - started_ns) as f64 / 1e9;
                    let line = progress_line(&engine.progress(), secs);
                    if tty {
                        eprint!("\r\x1b[K{line}");
                        let _ = std::io::stderr().flush();
                    } else if ticks.is_multiple_of(5) {
                        eprintln!("{line}");
                    }
                }
            }
            _ = &mut deadline => break,
            _ = sigint.recv() => break,
            _ = sigterm.recv() => break,
        }
    }
    if tty && opts.progress {
        eprintln!();
    }
    engine.read_kernel_state();
    engine.drain();
    // Beside the daemon: stop the TAP records now (the report is built from what was read).
    engine.untap()?;
    engine.drain();
    // The series is complete: flush it before the report (its error is reported at the end).
    let samples_result = samples_out.map(|w| w.finish());
    let rep = engine.snapshot(monotonic_ns());
    // Table and JSON first: a failing plot must not lose them.
    let table = report::render(&rep);
    // stdout carries at most one machine-readable stream; the table then goes to stderr.
    if stdout_json || stdout_samples {
        eprint!("{table}");
    } else {
        print!("{table}");
    }
    match &opts.json {
        Some(p) if p.as_os_str() == "-" => {
            println!("{}", serde_json::to_string_pretty(&rep)?);
        }
        Some(p) => {
            std::fs::write(p, serde_json::to_string_pretty(&rep)?)
                .with_context(|| format!("writing {}", p.display()))?;
        }
        None => {}
    }
    if let Some(path) = &opts.plot {
        let series = plot_series(&rep, plot_lines.lines());
        if series.is_empty() {
            eprintln!(
                "spice-observer: no display channel of spice-server with stage samples; {} left empty",
                path.display()
            );
        } else {
            crate::plot::write_svg(path, &series)?;
        }
    }
    // The hooks end after the outputs are written, entry programs before uretprobes. Ending
    // them takes the kernel ~0.1 s per uprobe (1.7 s per process): a child process takes it
    // over and this one exits at once (its exit would otherwise close the descriptors in
    // ascending order, the uretprobes first, and take as long).
    let (entries, rets) = engine.capture_and_model().0.tls_link_fds();
    if !entries.is_empty() || !rets.is_empty() {
        if hand_off_release(&entries, &rets) {
            log::debug!(
                "{} libssl hook link(s) handed to a child process to release",
                entries.len() + rets.len()
            );
        } else {
            let (_, took) = tls_hooks.release_all();
            log::debug!("libssl hooks released in {:.1} s", took.as_secs_f64());
        }
    }
    samples_result.transpose()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::samples::Legs;

    fn line(t_s: f64, socket: &str, channel_type: &str) -> SampleLine {
        SampleLine {
            t_s,
            t_end_s: t_s,
            socket: socket.into(),
            channel_type: channel_type.into(),
            channel_id: 0,
            in_flight: 0,
            in_flight_low: 0,
            in_flight_high: 0,
            in_flight_exact: true,
            window_source: None,
            server_messages: 0,
            acks: 0,
            in_flight_relay: None,
            window: 20,
            stages: BTreeMap::new(),
            unplaced: 0,
            legs: Legs {
                server: None,
                relay_backend: None,
                relay_client: None,
            },
            newest_last_byte_seq: None,
            oldest_last_byte_seq: None,
            kept: 0,
            clamped: 0,
        }
    }

    /// Two display channels and a cursor channel sampled far longer than the cap: each display
    /// channel keeps between PLOT_KEEP / 2 and PLOT_KEEP samples, evenly spaced, spanning the
    /// whole run (its first sample and one within a stride of its last); the cursor's none.
    #[test]
    fn plot_lines_stay_bounded_and_span_the_run() {
        let mut p = PlotLines::default();
        let n = 5 * PLOT_KEEP as u64 + 123;
        for i in 0..n {
            let t = i as f64 / 10.0;
            p.add(vec![
                line(t, "a", "display"),
                line(t, "b", "display"),
                line(t, "c", "cursor"),
            ]);
        }
        for sock in ["a", "b"] {
            let t: Vec<f64> = p
                .lines()
                .filter(|l| l.socket == sock)
                .map(|l| l.t_s)
                .collect();
            assert!(
                (PLOT_KEEP / 2..=PLOT_KEEP).contains(&t.len()),
                "{sock}: {} samples",
                t.len()
            );
            assert_eq!(t[0], 0.0);
            let step = t[1] - t[0];
            assert!(t.windows(2).all(|w| ((w[1] - w[0]) - step).abs() < 1e-6));
            assert!(t[t.len() - 1] + step >= (n - 1) as f64 / 10.0 - 1e-6);
        }
        assert_eq!(p.lines().filter(|l| l.socket == "c").count(), 0);
        // A short run keeps every sample.
        let mut q = PlotLines::default();
        for i in 0..100 {
            q.add(vec![line(i as f64, "a", "display")]);
        }
        assert_eq!(q.lines().count(), 100);
    }
}
