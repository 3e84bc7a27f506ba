//! `spice-observer observe`: attach to one or more processes, follow their SPICE sockets for a
//! while, then print a table (and optionally JSON).

use std::{
    collections::{BTreeMap, HashMap},
    io::{IsTerminal, Write},
    path::PathBuf,
    time::Duration,
};

use anyhow::{Context, Result, bail};
use log::{debug, warn};
use spice_ebpf_common::protocol::channel;
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::{SignalKind, signal},
};

use crate::{
    events,
    loader::Capture,
    model::{Model, chain::Chain},
    report::{self, PidReport, TcpReport},
    sampler, sockdiag,
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
}

/// The plotted series of every display channel chain with samples.
fn plot_series(
    model: &Model,
    chains: &[Chain],
    started_ns: u64,
) -> Vec<crate::plot::ChannelSeries> {
    use crate::model::chain::STAGES;
    let mut out = Vec::new();
    for chain in chains {
        let Some(s) = model.sockets.get(&chain.server) else {
            continue;
        };
        if s.channel().map(|c| c.0) != Some(channel::DISPLAY) || !s.window.active() {
            continue;
        }
        let samples: Vec<_> = chain
            .samples
            .iter()
            .filter(|x| x.placement.is_some())
            .collect();
        if samples.is_empty() {
            continue;
        }
        let stage_idx = chain.placeable_stages();
        let stages = stage_idx
            .iter()
            .map(|&i| {
                (
                    STAGES[i].to_string(),
                    samples
                        .iter()
                        .map(|x| x.placement.unwrap().counts[i])
                        .collect(),
                )
            })
            .collect();
        let t_s: Vec<f64> = samples
            .iter()
            .map(|x| x.t_ns.saturating_sub(started_ns) as f64 / 1e9)
            .collect();
        let mut throughput = Vec::with_capacity(samples.len());
        let mut prev: Option<(u64, u64)> = None;
        for x in &samples {
            let v = match (prev, x.delivered) {
                (Some((t0, d0)), Some(d1)) if x.t_ns > t0 => {
                    d1.saturating_sub(d0) as f64 * 8.0 / ((x.t_ns - t0) as f64 / 1e9) / 1e6
                }
                _ => 0.0,
            };
            throughput.push(v);
            if let Some(d) = x.delivered {
                prev = Some((x.t_ns, d));
            }
        }
        let relay = chain.backend.is_some().then(|| {
            samples
                .iter()
                .map(|x| x.relay_visible.unwrap_or(0))
                .collect()
        });
        let (ctype, cid) = s.channel().unwrap_or((0, 0));
        out.push(crate::plot::ChannelSeries {
            title: format!(
                "{} {} — {} pid {}, {}",
                spice_ebpf_common::protocol::channel_type_name(ctype),
                cid,
                s.comm,
                s.pid,
                match (s.local, s.remote) {
                    (Some(l), Some(r)) => format!("{l}->{r}"),
                    _ => String::new(),
                }
            ),
            limit: s.window.limit(),
            t_s,
            stages,
            relay_visible: relay,
            throughput_mbit: throughput,
        });
    }
    out
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// CLOCK_REALTIME in nanoseconds since the Unix epoch (the clock of packet capture
/// timestamps, e.g. dumpcap's).
pub fn realtime_ns() -> u64 {
    clock_ns(libc::CLOCK_REALTIME)
}

const TCP_LISTEN: u8 = 10;
const TCP_ESTABLISHED: u8 = 1;
const TCP_CLOSE_WAIT: u8 = 8;

/// A connection that was open before observation started.
pub struct Existing {
    pub cookie: u64,
    pub pid: u32,
    pub local: std::net::SocketAddr,
    pub remote: std::net::SocketAddr,
}

/// Enrols the watched processes' listening ports for sockops and marks their already-connected
/// sockets in the kernel (reported, never framed: a SPICE stream can only be framed from its
/// link phase). Must run before the processes are watched, or a busy socket's first traced call
/// would create its framing state unmarked. Returns the ports enrolled and the connections.
fn prepare_sockets(cap: &mut Capture, pids: &[u32]) -> Result<(usize, Vec<Existing>)> {
    let mut owner = HashMap::new();
    for &pid in pids {
        for inode in sockdiag::socket_inodes(pid).unwrap_or_default() {
            owner.entry(inode).or_insert(pid);
        }
    }
    let mut ports = 0;
    let mut existing = Vec::new();
    match sockdiag::dump_tcp() {
        Ok(socks) => {
            for s in socks.iter() {
                let Some(&pid) = owner.get(&s.inode) else {
                    continue;
                };
                if s.state == TCP_LISTEN {
                    cap.watch_port(s.local.port())?;
                    ports += 1;
                } else if s.state == TCP_ESTABLISHED || s.state == TCP_CLOSE_WAIT {
                    cap.mark_preexisting(s.cookie)?;
                    existing.push(Existing {
                        cookie: s.cookie,
                        pid,
                        local: s.local,
                        remote: s.remote,
                    });
                }
            }
        }
        Err(e) => warn!(
            "sock_diag dump failed ({e:#}); sockops enrolment and pre-existing socket detection are off"
        ),
    }
    Ok((ports, existing))
}

/// The process (thread group) of `pid`: a thread id given by mistake (what `top -H` shows)
/// resolves to its process.
fn thread_group(pid: u32) -> Result<u32> {
    let proc = procfs::process::Process::new(pid as i32)
        .map_err(|_| anyhow::anyhow!("no process with pid {pid}"))?;
    let status = proc
        .status()
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    Ok(status.tgid as u32)
}

/// Creates (truncates) an output file now, so that a bad path fails before observing.
fn check_writable(path: &std::path::Path, what: &str) -> Result<()> {
    std::fs::File::create(path)
        .with_context(|| format!("cannot write the {what} to {}", path.display()))?;
    Ok(())
}

/// Best TCP state per socket at the end: a sock_diag snapshot where the socket still exists in
/// this network namespace, else the last kernel-hook snapshot.
fn final_tcp(model: &Model) -> BTreeMap<u64, TcpReport> {
    let mut out = BTreeMap::new();
    let diag = match sockdiag::dump_tcp() {
        Ok(v) => v
            .into_iter()
            .map(|s| (s.cookie, s))
            .collect::<BTreeMap<_, _>>(),
        Err(e) => {
            debug!("final sock_diag dump failed: {e:#}");
            BTreeMap::new()
        }
    };
    for s in model.sockets.values() {
        let from_hooks = s.tcp.as_ref().map(|t| {
            TcpReport::from_snapshot(
                t,
                s.notsent_max,
                if s.closed_ns.is_some() {
                    "close"
                } else {
                    "kernel_hooks"
                },
            )
        });
        let rep = match (
            s.closed_ns,
            diag.get(&s.cookie)
                .and_then(|d| d.info.as_ref().map(|i| (d, i))),
        ) {
            (None, Some((d, i))) => Some(TcpReport {
                srtt_us: i.srtt_us,
                cwnd_segments: i.snd_cwnd,
                notsent_bytes: i.notsent_bytes,
                notsent_max_bytes: s.notsent_max.max(i.notsent_bytes),
                unacked_segments: i.unacked,
                total_retrans: i.total_retrans,
                recv_queue_bytes: d.recv_queue,
                source: "sock_diag".into(),
            }),
            _ => from_hooks,
        };
        if let Some(r) = rep {
            out.insert(s.cookie, r);
        }
    }
    out
}

fn progress_line(model: &Model, started_ns: u64, lost: u64) -> String {
    let secs = (monotonic_ns() - started_ns) as f64 / 1e9;
    let msgs: u64 = model
        .sockets
        .values()
        .map(|s| s.dirs[0].messages + s.dirs[1].messages)
        .sum();
    let framed = model
        .sockets
        .values()
        .filter(|s| matches!(s.framing(), "mini" | "full"))
        .count();
    // spice-server's display channels only: a relay's client-facing legs are server ends too.
    let relays = crate::model::chain::relay_pids(model);
    let mut display = Vec::new();
    for s in model.sockets.values() {
        if s.closed_ns.is_none()
            && s.window.active()
            && s.channel().map(|c| c.0) == Some(channel::DISPLAY)
            && s.is_server_end() == Some(true)
            && !relays.contains(&s.pid)
        {
            display.push(format!("{}/{}", s.window.count, s.window.limit()));
        }
    }
    format!(
        "[{secs:6.1}s] {} sockets, {framed} framed, {msgs} msgs, display in flight {}, lost {lost}",
        model.sockets.len(),
        if display.is_empty() {
            "-".into()
        } else {
            display.join(" ")
        },
    )
}

/// Where ring records go: the model, and optionally a dump file.
struct Sink {
    model: Model,
    decode_errors: u64,
    dump: Option<std::io::BufWriter<std::fs::File>>,
}

impl Sink {
    /// Applies every record waiting in the ring.
    fn drain(&mut self, ring: &mut aya::maps::RingBuf<aya::maps::MapData>) {
        while let Some(item) = ring.next() {
            match events::decode(&item) {
                Ok(ev) => {
                    if let Some(d) = self.dump.as_mut() {
                        let _ = writeln!(d, "{ev:?}");
                    }
                    self.model.apply(&ev);
                }
                Err(e) => {
                    self.decode_errors += 1;
                    debug!("bad record: {e}");
                }
            }
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
    for &pid in &opts.pids {
        let tgid = thread_group(pid)?;
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
    let pid_reports: Vec<PidReport> = roots
        .iter()
        .map(|&pid| PidReport {
            pid,
            comm: sockdiag::comm(pid).unwrap_or_default(),
        })
        .collect();
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
    let mut cap = Capture::load()?;
    // The roots and the children they already have (a socat listener's live connections).
    let mut watched = roots.clone();
    for &pid in &roots {
        for child in sockdiag::descendants(pid) {
            if child != me && !watched.contains(&child) {
                watched.push(child);
            }
        }
    }
    let (ports, existing) = prepare_sockets(&mut cap, &watched)?;
    for &pid in &watched {
        cap.watch_pid(pid)?;
    }
    // SAFETY: the ring owns its map fd, which stays open and unchanged for the AsyncFd's life.
    let mut ring = unsafe { AsyncFd::register_with_interest(cap.take_ring()?, Interest::READABLE) }
        .map_err(|e| anyhow::anyhow!("polling the event ring: {}", e.into_parts().1))?;
    // Both clocks back to back, so that sample times can be lined up with packet timestamps.
    let started_ns = monotonic_ns();
    let clock = report::ClockReport {
        realtime_ns: realtime_ns(),
        monotonic_ns: started_ns,
    };
    eprintln!(
        "spice-observer: watching {} (hook set {}; {ports} listening port(s) enrolled, {} connection(s) already open); {}",
        pid_reports
            .iter()
            .map(|p| format!("pid {} ({})", p.pid, p.comm))
            .collect::<Vec<_>>()
            .join(", "),
        cap.hook_set,
        existing.len(),
        match opts.duration {
            Some(d) => format!("{:.0} s", d.as_secs_f64()),
            None => "until Ctrl-C".into(),
        }
    );

    let mut chains: Vec<Chain> = Vec::new();
    let mut sample = tokio::time::interval(opts.sample);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let deadline = tokio::time::sleep(opts.duration.unwrap_or(Duration::from_secs(u64::MAX / 4)));
    tokio::pin!(deadline);
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let tty = std::io::stderr().is_terminal();
    let mut ticks = 0u64;
    let mut model = Model::default();
    for e in &existing {
        model.add_existing(e.cookie, e.pid, e.local, e.remote, started_ns);
    }
    let mut sink = Sink {
        model,
        decode_errors: 0,
        dump: match &opts.dump_events {
            Some(p) => Some(std::io::BufWriter::new(
                std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
            )),
            None => None,
        },
    };
    loop {
        tokio::select! {
            guard = ring.readable_mut() => {
                let mut guard = guard?;
                sink.drain(guard.get_inner_mut());
                guard.clear_ready();
            }
            _ = sample.tick() => {
                // Apply what the kernel has recorded up to now, then sample the queues.
                sink.drain(ring.get_mut());
                if let Some(pos) = sampler::read(&mut cap, &mut sink.model, &mut chains) {
                    // The records of the calls made up to the map reads: the count and the
                    // messages then match write_seq / copied_seq.
                    sink.drain(ring.get_mut());
                    let taken = sampler::place(&sink.model, &mut chains, pos);
                    if let Some(w) = samples_out.as_mut() {
                        w.write(&crate::samples::lines(&sink.model, &taken, started_ns));
                    }
                }
            }
            _ = tick.tick() => {
                ticks += 1;
                if let Some(w) = samples_out.as_mut() {
                    w.flush();
                }
                if roots.iter().all(|&p| sockdiag::comm(p).is_none()) {
                    eprintln!("\nspice-observer: every watched process has exited");
                    if opts.duration.is_none() {
                        break;
                    }
                }
                if opts.progress {
                    let lost = cap.counters().map(|c| (0..c.len() as u32).filter(|&i| spice_ebpf_common::config::counter::is_loss(i)).map(|i| c[i as usize]).sum()).unwrap_or(0);
                    let line = progress_line(&sink.model, started_ns, lost);
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
    sink.drain(ring.get_mut());
    // The series is complete: flush it before the report (its error is reported at the end).
    let samples_result = samples_out.map(|w| w.finish());
    let Sink {
        mut model,
        decode_errors,
        ..
    } = sink;
    let end_ns = monotonic_ns();
    model.finish(end_ns);
    // Name sockets after their process, not the thread that first used them.
    let mut comms: HashMap<u32, Option<String>> = HashMap::new();
    for s in model.sockets.values_mut() {
        if let Some(c) = comms.entry(s.pid).or_insert_with(|| sockdiag::comm(s.pid)) {
            s.comm = c.clone();
        }
    }
    let counters = cap.counters()?;
    let tcp = final_tcp(&model);
    let mut rep = report::build(
        &model,
        report::RunInfo {
            started_ns,
            end_ns,
            clock,
            hook_set: &cap.hook_set,
            counters: &counters,
            degraded: &cap.degraded,
            pids: pid_reports,
            tcp_final: &tcp,
            chains: &chains,
        },
    );
    if decode_errors > 0 {
        rep.degraded.push(format!(
            "{decode_errors} ring record(s) could not be decoded"
        ));
        rep.events_lost += decode_errors;
    }
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
        let series = plot_series(&model, &chains, started_ns);
        if series.is_empty() {
            eprintln!(
                "spice-observer: no display channel of spice-server with stage samples; {} left empty",
                path.display()
            );
        } else {
            crate::plot::write_svg(path, &series)?;
        }
    }
    samples_result.transpose()?;
    Ok(())
}
