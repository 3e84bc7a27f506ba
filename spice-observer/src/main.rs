//! spice-observer: an eBPF observer of SPICE remote-display sockets.
//!
//! Kernel programs find SPICE message boundaries in the byte streams of the watched processes'
//! TCP sockets, run spice-server's ACK-window rule on them and read each socket's TCP state;
//! this agent derives the window's statistics per display and cursor channel. See README.md.

use std::{path::PathBuf, time::Duration};

use anyhow::Result;
use clap::{Parser, Subcommand};
use spice_observer::{cmd::observe, kernel::loader::HookChoice};

/// eBPF observer of SPICE remote-display sockets: exact ACK-window accounting per channel.
#[derive(Debug, Parser)]
#[command(name = "spice-observer", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Watch processes (spice-server / qemu, a SPICE relay) for a while and report per channel:
    /// framing, ACK window W, in-flight messages (spice-server's exact count), stalls, rates
    /// and TCP state; with a relay watched too, where each in-flight message is. Run as root
    /// (`--hook-set tcpinfo`: TCP state only, as the processes' user).
    Observe {
        /// Process to watch: its threads, the children it already has, and those it forks from
        /// now on. A thread id is resolved to its process. Repeatable.
        #[arg(long = "pid", required = true, value_name = "PID")]
        pids: Vec<u32>,
        /// Seconds to observe; 0 = until Ctrl-C (SIGINT) or SIGTERM.
        #[arg(
            long,
            default_value_t = 10.0,
            value_name = "SECS",
            allow_negative_numbers = true
        )]
        duration: f64,
        /// Also write the report as JSON to PATH (`-` = stdout; the table then goes to stderr).
        #[arg(long, value_name = "PATH|-")]
        json: Option<PathBuf>,
        /// Milliseconds between TCP state samples of the watched sockets (10 to 60000; each
        /// sample queries the sockets of the relay chains by sock_diag).
        #[arg(long, default_value_t = 100, value_name = "MS",
              value_parser = clap::value_parser!(u64).range(10..=60_000))]
        sample_ms: u64,
        /// Do not print the live progress line.
        #[arg(long)]
        no_progress: bool,
        /// Write every decoded kernel record to PATH, one per line (for debugging the capture).
        #[arg(long, value_name = "PATH")]
        dump_events: Option<PathBuf>,
        /// Draw, per display channel, the in-flight count over time as stacked stages with the
        /// 2W+1 line, and the link throughput under it, into an SVG file (at most 4096 samples
        /// per channel are kept: a longer run is thinned evenly).
        #[arg(long, value_name = "PATH.svg")]
        plot: Option<PathBuf>,
        /// Write the per-sample series to PATH as JSON Lines (`-` = stdout; the table then goes
        /// to stderr): one line per sample per display and cursor channel of spice-server, with
        /// the in-flight count, the stage split and the raw TCP positions it used.
        #[arg(long, value_name = "PATH|-")]
        samples: Option<PathBuf>,
        /// Pin directory of a running daemon's kernel state. If it holds a complete pinned
        /// set of this version's layout, observe reads it (no second copy of the programs is
        /// loaded) and its counts are exact from each session's start; otherwise it loads its
        /// own programs, as without a daemon.
        #[arg(long, value_name = "DIR",
              default_value = spice_observer::config::DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// Do not attach the libssl uprobes. By default each watched process that maps a
        /// libssl (libssl.so.3, …) gets uprobes on SSL_write, SSL_read and friends for that
        /// process only, so that SPICE inside TLS is framed from the plaintext; with this
        /// flag TLS channels stay `unparsed: tls` and every process's TLS state is
        /// `disabled`.
        #[arg(long)]
        no_tls_hooks: bool,
        /// The programs that see the socket calls, when observe loads its own (beside a
        /// daemon it reads the daemon's): `auto` (the first that loads of `tracepoints`, the
        /// socket tracepoints of Linux 6.3+; `fentry`, BPF trampolines; `kprobes`; `syscalls`,
        /// a filter at every syscall exit), or one of those forced; or
        /// `tcpinfo`, the no-BPF mode: TCP state of the processes' sockets polled over
        /// sock_diag every --sample-ms, no SPICE framing, no privilege needed for one's own
        /// processes (never chosen by `auto`). See README, Kernel requirements.
        #[arg(long, value_enum, default_value_t = HookChoice::Auto, value_name = "SET",
              env = "SPICE_OBSERVER_HOOK_SET")]
        hook_set: HookChoice,
    },
    /// Run as a host daemon: find SPICE servers (QEMU, Xspice) and configured relays as they
    /// come and go, watch them, and serve Prometheus metrics on 127.0.0.1:19590. Run as root.
    ///
    /// Signals: SIGTERM (or SIGINT) stops it with exit status 0 and keeps the kernel state
    /// pinned under the pin directory (`--unpin` removes it, as the unit's stop action does).
    /// SIGUSR2 stops it with exit status 75 and keeps the pins too, for a restart in place:
    /// the next daemon on the same pin directory continues every count. SIGHUP re-reads the
    /// config file (sample_ms, scan_ms and [discovery] apply at once; listen and bpf_stats
    /// need a restart).
    Daemon(spice_observer::cmd::daemon::DaemonArgs),
    /// Say what this host supports, one line per item: kernel BTF, lockdown, cgroup v2,
    /// tracefs, bpffs, bpf_stats, the capabilities present, each hook set (loaded, allowed by
    /// the kernel but not built yet, refused with the kernel's error, or absent; the no-BPF
    /// `tcpinfo` mode: available, never framing) and the
    /// libssl of running QEMU processes. Exits 1 when no framing hook set loads. Run as root
    /// for the hook set probes.
    Doctor(spice_observer::cmd::doctor::DoctorArgs),
    /// Helpers of `cargo xtask bench` (program statistics, empty reference programs,
    /// syscall loops, count comparison).
    #[command(hide = true)]
    Bench(spice_observer::cmd::bench::BenchArgs),
}

fn main() -> Result<()> {
    // The start-up self-test's child (spice_observer::pipeline::selftest), not a user command.
    if std::env::args().nth(1).as_deref()
        == Some(spice_observer::pipeline::selftest::PEER_SUBCOMMAND)
    {
        return spice_observer::pipeline::selftest::peer_main();
    }
    // The daemon logs targets found and lost at info level.
    let daemon = std::env::args().nth(1).as_deref() == Some("daemon");
    let default = if daemon {
        "warn,spice_observer=info"
    } else {
        "warn"
    };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(default)).init();
    let cli = Cli::parse();
    match cli.command {
        Command::Observe {
            pids,
            duration,
            json,
            sample_ms,
            no_progress,
            dump_events,
            plot,
            samples,
            pin_dir,
            no_tls_hooks,
            hook_set,
        } => {
            if !(duration >= 0.0 && duration.is_finite()) {
                anyhow::bail!("--duration must be a number of seconds ≥ 0");
            }
            let opts = observe::ObserveOptions {
                pids,
                duration: (duration > 0.0).then(|| Duration::from_secs_f64(duration)),
                json,
                sample: Duration::from_millis(sample_ms),
                progress: !no_progress,
                dump_events,
                plot,
                samples,
                pin_dir: Some(pin_dir),
                tls_hooks: !no_tls_hooks,
                hook_set,
            };
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(observe::run(opts))
        }
        Command::Daemon(args) => spice_observer::cmd::daemon::run(args),
        Command::Doctor(args) => spice_observer::cmd::doctor::run(args),
        Command::Bench(args) => spice_observer::cmd::bench::run(args),
    }
}
