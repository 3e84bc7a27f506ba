//! `spice-observer daemon`: one per hypervisor. Finds SPICE servers (QEMU, Xspice) and the
//! configured relays ([`crate::host::discovery`]), watches them as they come and go, and
//! serves Prometheus metrics ([`crate::output::metrics`]) over HTTP.
//!
//! The loop (one thread): a discovery scan every `scan_ms` (new targets are watched, exited
//! ones unwatched), kernel records applied as they arrive, a TCP sample of every chain every
//! `sample_ms`, and per `/metrics` request one engine snapshot, from which
//! [`SnapshotCollector`] builds the metric families; the closed sockets that snapshot included
//! are then released. The HTTP server (axum on the same tokio runtime) asks the loop over a
//! channel, so scrapes are serialised with sampling and never see a half-applied state.
//!
//! Kernel state is pinned under `pin_dir` ([`Engine::start_pinned`]): a restarted daemon
//! continues it (README "Restarts and pinned state"); SIGINT and SIGTERM leave the pins and
//! exit 0, SIGUSR2 leaves them and exits [`EXIT_RESTART`] (a restart in place: the unit
//! restarts the daemon and keeps the pins, see packaging/spice-observer.service);
//! `--unpin` removes them (refused while a daemon runs on them, unless `--force`; never
//! anything in the directory that is not the daemon's own pin).
//!
//! HTTP paths: `/` (a landing page naming the paths, the version and the hook set),
//! `/metrics` (Prometheus text format 0.0.4), `/healthz` (`200 ok` while the loop answers;
//! `503` with the reason when it does not answer within [`HEALTH_TIMEOUT`] or has stopped).
//!
//! Logging (env_logger; default `warn,spice_observer=info`, `RUST_LOG` overrides): one line
//! at start (listen address, hook set, config file), one with the capabilities kept after
//! attach, one per target found (naming the libssl its uprobes were attached on) or lost,
//! warnings when information is lost (kernel loss counters or undecodable records went up),
//! a target cannot be watched, or a process's libssl hooks cannot be attached (one line per
//! process; once at start when the daemon lacks the capability for any).
//!
//! libssl hooks ([`crate::kernel::tls`], unless `tls_hooks = false` / `--no-tls-hooks`):
//! attached to each target before it is watched, and at every scan to the watched processes
//! not hooked yet (children forked since), re-checked every 5 s for those without a libssl;
//! detached when they go, on a background thread (the kernel takes ~0.1 s per uprobe). The
//! links are pinned under `pin_dir` (`tls_<pid>_…`, [`tls::PinName`]): the daemon's exit
//! (SIGTERM, SIGUSR2, a crash) releases none of them and the hooks keep working while no
//! daemon runs; the next daemon adopts the pins of the processes it still watches (same pid
//! and start time, same libraries) without attaching again, and releases the others.
//!
//! As a service ([`crate::cmd::service`], [`crate::host::privilege`]): after the programs
//! are attached it drops every capability but the two that reading other users' `/proc`
//! needs (and `CAP_SYS_ADMIN`, which attaching uprobes needs, when the libssl hooks are on
//! and it holds it), tells systemd it is ready, and re-reads its config on SIGHUP.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use axum::{
    Router,
    extract::State,
    http::{StatusCode, header},
    response::{Html, IntoResponse, Response},
    routing::get,
};
use log::{debug, info, warn};
use prometheus::{Encoder, TextEncoder, core::Collector, proto::MetricFamily};
use spice_ebpf_common::config::counter;
use tokio::sync::{mpsc, oneshot};

use crate::cmd::service;
use crate::config::{Config, RelayRule};
use crate::host::discovery::{self, Discovery, ServerKind, Target, TargetKind};
use crate::host::privilege;
use crate::kernel::tls::{self, TlsHooks};
use crate::model::tls::TlsAttach;
use crate::output::metrics::{self, ProgramCost, ScrapeInput};
use crate::pipeline::{
    Engine, EngineOptions, Restart, monotonic_ns,
    ticker::{Due, SampleClock, Ticker},
};

/// Config file read when `--config` is not given, if it exists.
pub const DEFAULT_CONFIG: &str = "/etc/spice-observer/spice-observer.toml";

/// How long `/healthz` waits for the loop to answer.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

/// How long `/metrics` waits for the loop's snapshot.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the kernel loss counters are compared with the last warning.
const LOSS_CHECK: Duration = Duration::from_secs(5);

/// Exit status after SIGUSR2, a restart in place: 75, `EX_TEMPFAIL` of `sysexits.h` ("a
/// temporary failure ... the user is invited to retry"), which systemd names `TEMPFAIL`
/// (`systemd-analyze exit-status`). The unit lists it in `RestartForceExitStatus=` (systemd
/// starts the daemon again whatever `Restart=` says) and `SuccessExitStatus=` (not a
/// failure), and its `ExecStopPost=` removes the pins only after any other clean end.
pub const EXIT_RESTART: i32 = 75;

/// How the daemon's loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// SIGINT or SIGTERM: exit 0. The pins stay (the unit's stop action removes them).
    Stop,
    /// SIGUSR2: exit [`EXIT_RESTART`], the pins stay for the next daemon.
    RestartInPlace,
}

/// `spice-observer daemon` options. Each given flag overrides the config file's key.
#[derive(Debug, clap::Args)]
pub struct DaemonArgs {
    /// Config file (TOML; see packaging/spice-observer.toml). Default
    /// /etc/spice-observer/spice-observer.toml if it exists, else built-in defaults. A given
    /// path that does not exist is an error.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Address and port of the HTTP endpoint (`listen`), e.g. `127.0.0.1:19590` or `[::]:19590`.
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: Option<SocketAddr>,
    /// Milliseconds between TCP samples of the watched sockets (`sample_ms`).
    #[arg(long, value_name = "MS")]
    pub sample_ms: Option<u64>,
    /// Milliseconds between process scans (`scan_ms`).
    #[arg(long, value_name = "MS")]
    pub scan_ms: Option<u64>,
    /// Do not turn on the kernel's BPF run-time statistics (`bpf_stats = false`).
    #[arg(long)]
    pub no_bpf_stats: bool,
    /// Also watch relays with this program name (added to `discovery.relays`). Repeatable.
    #[arg(long = "relay-name", value_name = "NAME")]
    pub relay_names: Vec<String>,
    /// Also watch the process listening on this TCP port as a relay (added to
    /// `discovery.relays`). Repeatable.
    #[arg(long = "relay-port", value_name = "PORT")]
    pub relay_ports: Vec<u16>,
    /// Directory on a BPF filesystem where the kernel state is pinned (`pin_dir`, default
    /// /sys/fs/bpf/spice-observer): a restarted daemon continues from it.
    #[arg(long, value_name = "DIR")]
    pub pin_dir: Option<PathBuf>,
    /// Remove the daemon's pins from the pin directory (the libssl uprobe links first, each
    /// process's entries before its uretprobes, ~0.1 s each in the kernel; then the other
    /// program links, which detaches the programs, then the maps), then the directory, and
    /// exit. Idempotent. Refused while
    /// a daemon runs on the directory (it holds its lock): stop it first (SIGTERM), or add
    /// --force. Refused, removing nothing, if the directory holds anything but the daemon's
    /// own pins. The directory is --pin-dir if given, else the config file's `pin_dir` if the
    /// file parses, else (with a warning) /sys/fs/bpf/spice-observer.
    #[arg(long)]
    pub unpin: bool,
    /// With --unpin: remove the pins even while a daemon runs on them (its programs stay
    /// attached until it exits, then they are gone; a new daemon may start on the directory
    /// meanwhile).
    #[arg(long, requires = "unpin")]
    pub force: bool,
    /// Do not attach the libssl uprobes (`tls_hooks = false`): TLS channels stay
    /// `unparsed: tls`, every watched process's TLS state is `disabled`, and CAP_SYS_ADMIN is
    /// not kept after attach. By default each watched process that maps a libssl gets
    /// uprobes on SSL_write, SSL_read and friends for that process only.
    #[arg(long)]
    pub no_tls_hooks: bool,
    /// The programs that see the socket calls (`hook_set`): `auto` (the default: the first
    /// of `tracepoints`, `fentry`, `kprobes`, `syscalls` that loads), or one of those; see
    /// README, Kernel requirements. `tcpinfo`: the no-BPF mode, per-connection TCP gauges
    /// only, no SPICE framing
    /// ([`crate::cmd::tcpinfo_daemon`]).
    #[arg(long, value_enum, value_name = "SET", env = "SPICE_OBSERVER_HOOK_SET")]
    pub hook_set: Option<crate::kernel::loader::HookChoice>,
}

/// The effective settings: the config file (`--config`, else [`DEFAULT_CONFIG`] if it
/// exists, else defaults) with the flags applied. Returns the file read, if any.
///
/// Errors: a given `--config` that does not exist or does not parse (see
/// [`Config::load`]); the default file exists but does not parse; a flag value out of range
/// (`--sample-ms 0`, `--scan-ms 0`, `--relay-port 0`, an empty `--relay-name` or one with
/// a `/`).
pub fn resolve(args: &DaemonArgs) -> Result<(Config, Option<PathBuf>)> {
    let path = match &args.config {
        Some(p) => {
            if !p.exists() {
                bail!("config file {} does not exist", p.display());
            }
            Some(p.clone())
        }
        None => Some(PathBuf::from(DEFAULT_CONFIG)).filter(|p| p.exists()),
    };
    let mut cfg = match &path {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    if let Some(l) = args.listen {
        cfg.listen = l;
    }
    if let Some(ms) = args.sample_ms {
        if ms == 0 {
            bail!("--sample-ms must be > 0");
        }
        cfg.sample_ms = ms;
    }
    if let Some(ms) = args.scan_ms {
        if ms == 0 {
            bail!("--scan-ms must be > 0");
        }
        cfg.scan_ms = ms;
    }
    if args.no_bpf_stats {
        cfg.bpf_stats = false;
    }
    if args.no_tls_hooks {
        cfg.tls_hooks = false;
    }
    if let Some(h) = args.hook_set {
        cfg.hook_set = h;
    }
    if let Some(d) = &args.pin_dir {
        if !d.is_absolute() {
            bail!("--pin-dir {} must be an absolute path", d.display());
        }
        cfg.pin_dir = d.clone();
    }
    for name in &args.relay_names {
        if name.is_empty() || name.contains('/') {
            bail!("--relay-name {name:?} must be a non-empty program name without '/'");
        }
        cfg.discovery.relays.push(RelayRule {
            name: Some(name.clone()),
            port: None,
        });
    }
    for &port in &args.relay_ports {
        if port == 0 {
            bail!("--relay-port must be 1-65535");
        }
        cfg.discovery.relays.push(RelayRule {
            name: None,
            port: Some(port),
        });
    }
    Ok((cfg, path))
}

/// Runs the daemon until SIGINT or SIGTERM, and returns (the pins stay: a restart continues
/// from them), or until SIGUSR2, and then exits the process with status [`EXIT_RESTART`]
/// (pins kept too; the unit restarts it). SIGHUP re-reads the config
/// ([`crate::cmd::service`]). With `--unpin` it removes the pins and returns.
pub fn run(args: DaemonArgs) -> Result<()> {
    if args.unpin {
        return unpin(&unpin_dir(&args)?, args.force);
    }
    let (cfg, path) = resolve(&args)?;
    if cfg.hook_set == crate::kernel::loader::HookChoice::Tcpinfo {
        // No BPF, no pins: discovery and sock_diag polling only (cmd/tcpinfo_daemon.rs).
        return crate::cmd::tcpinfo_daemon::run(cfg, path);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let stop = rt.block_on(serve(cfg, path, &args))?;
    // The engine (maps, ring, program descriptors) was dropped in `serve`; the pins hold
    // the kernel state from here on.
    drop(rt);
    match stop {
        Stop::Stop => Ok(()),
        Stop::RestartInPlace => std::process::exit(EXIT_RESTART),
    }
}

/// The pin directory of `daemon --unpin`: `--pin-dir` if given (it must be absolute), else
/// the config file's `pin_dir` (the file of [`resolve`]) if it parses, else the built-in
/// default with a warning: a stop action must still unpin when the config has a typo.
pub fn unpin_dir(args: &DaemonArgs) -> Result<PathBuf> {
    if let Some(d) = &args.pin_dir {
        if !d.is_absolute() {
            bail!("--pin-dir {} must be an absolute path", d.display());
        }
        return Ok(d.clone());
    }
    let from_file = match &args.config {
        Some(p) if !p.exists() => Err(anyhow!("config file {} does not exist", p.display())),
        Some(p) => Config::load(p).map(|c| c.pin_dir),
        None => match Some(Path::new(DEFAULT_CONFIG)).filter(|p| p.exists()) {
            Some(p) => Config::load(p).map(|c| c.pin_dir),
            None => Ok(Config::default().pin_dir),
        },
    };
    match from_file {
        Ok(d) => Ok(d),
        Err(e) => {
            let d = Config::default().pin_dir;
            warn!(
                "{e:#}; unpinning the default pin directory {} (give --pin-dir to name another)",
                d.display()
            );
            Ok(d)
        }
    }
}

/// `daemon --unpin`: removes the daemon's pins and the pin directory, says what it did.
/// Refused while a daemon holds the directory's lock, unless `force`.
fn unpin(dir: &Path, force: bool) -> Result<()> {
    if dir.is_dir() {
        crate::loader::check_pin_dir_access(dir, "remove pins")?;
    }
    // Held while removing: no daemon can start on the directory meanwhile.
    let lock = if dir.is_dir() {
        crate::loader::PinLock::try_take(dir)?
    } else {
        None
    };
    let running = dir.is_dir() && lock.is_none();
    if running && !force {
        bail!(
            "a spice-observer daemon is running on the pin directory {} (it holds its lock): \
             unpinning would detach the programs it uses. Stop it first (SIGTERM keeps the \
             pins, then run --unpin), or add --force",
            dir.display()
        );
    }
    let (gone, left) = crate::loader::unpin(dir)?;
    drop(lock);
    if running {
        println!(
            "--force: a daemon is still running on {}: its programs stay attached until it exits",
            dir.display()
        );
    }
    if gone.is_empty() {
        println!("nothing pinned at {}", dir.display());
    } else {
        let links = gone.iter().filter(|n| n.starts_with("link_")).count();
        let tls = gone
            .iter()
            .filter(|n| tls::PinName::parse(n).is_some())
            .count();
        println!(
            "removed {} from {}: {} program link(s) (programs detached unless a running daemon \
             still holds them){} and {} other pin(s)",
            gone.len(),
            dir.display(),
            links,
            if tls > 0 {
                format!(", {tls} libssl uprobe link(s)")
            } else {
                String::new()
            },
            gone.len() - links - tls
        );
    }
    if left == crate::loader::DirLeft::MountPoint {
        info!(
            "{} is a mount point (e.g. the unit's ReadWritePaths= bind mount): every pin is \
             removed, the directory stays, empty",
            dir.display()
        );
    }
    Ok(())
}

/// A request from an HTTP handler to the loop.
enum Request {
    /// Take a snapshot and answer the exposition text.
    Scrape(oneshot::Sender<Result<String, String>>),
    /// Answer if the loop runs.
    Health(oneshot::Sender<()>),
}

#[derive(Clone)]
struct AppState {
    tx: mpsc::Sender<Request>,
    /// The landing page; rewritten at each reload (it shows the settings in force).
    landing: std::sync::Arc<std::sync::RwLock<String>>,
}

/// A Prometheus collector over ONE engine snapshot: `collect` takes the snapshot, reads the
/// kernel counters and the engine's sizes, builds the families ([`metrics::families`]) and
/// then releases the closed sockets the snapshot included (`Engine::release_reported`).
pub struct SnapshotCollector<'a> {
    engine: Mutex<&'a mut Engine>,
    targets: &'a [Target],
    bpf_stats: bool,
}

impl Collector for SnapshotCollector<'_> {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        // Unchecked collector: the families change with the snapshot.
        Vec::new()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let t0 = Instant::now();
        let mut engine = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        let mut report = engine.snapshot(monotonic_ns());
        match engine.counters() {
            Ok(c) => {
                report.kernel_counters = counter::NAMES
                    .iter()
                    .zip(c)
                    .map(|(n, v)| (n.to_string(), v))
                    .collect()
            }
            Err(e) => warn!("reading the kernel counters failed: {e:#}"),
        }
        let stats = engine.stats();
        let programs: Vec<ProgramCost> = engine
            .program_stats()
            .into_iter()
            .map(|p| ProgramCost {
                name: p.name,
                run_time_ns: p.run_time_ns,
                run_count: p.run_count,
            })
            .collect();
        let started = engine.started();
        let mut fams = metrics::families(&ScrapeInput {
            report: &report,
            targets: self.targets,
            programs: self.bpf_stats.then_some(&programs[..]),
            sockets: stats.sockets,
            chains: stats.chains,
            processes: stats.processes,
            records: stats.records,
            decode_errors: stats.decode_errors,
            start_time_s: started.realtime_ns as f64 / 1e9,
        });
        engine.release_reported();
        fams.push(metrics::scrape_duration(t0.elapsed().as_secs_f64()));
        fams
    }
}

/// One scrape: the collector's families in the text format.
fn scrape(engine: &mut Engine, targets: &[Target], bpf_stats: bool) -> Result<String> {
    let collector = SnapshotCollector {
        engine: Mutex::new(engine),
        targets,
        bpf_stats,
    };
    let fams = collector.collect();
    let mut buf = Vec::new();
    TextEncoder::new().encode(&fams, &mut buf)?;
    Ok(String::from_utf8(buf)?)
}

fn kind_name(t: &Target) -> String {
    match &t.kind {
        TargetKind::SpiceServer(ServerKind::Qemu) => "qemu".into(),
        TargetKind::SpiceServer(ServerKind::Xspice) => "xspice".into(),
        TargetKind::Relay { rule } => format!("relay ({rule})"),
    }
}

async fn landing(State(s): State<AppState>) -> Html<String> {
    Html(s.landing.read().unwrap_or_else(|e| e.into_inner()).clone())
}

async fn metrics_handler(State(s): State<AppState>) -> Response {
    let (tx, rx) = oneshot::channel();
    if s.tx.send(Request::Scrape(tx)).await.is_err() {
        return (StatusCode::SERVICE_UNAVAILABLE, "engine stopped\n").into_response();
    }
    match tokio::time::timeout(SCRAPE_TIMEOUT, rx).await {
        Ok(Ok(Ok(text))) => (
            [(
                header::CONTENT_TYPE,
                TextEncoder::new().format_type().to_string(),
            )],
            text,
        )
            .into_response(),
        Ok(Ok(Err(e))) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
        Ok(Err(_)) => (StatusCode::SERVICE_UNAVAILABLE, "engine stopped\n").into_response(),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "engine loop did not answer within 10 s\n",
        )
            .into_response(),
    }
}

async fn healthz(State(s): State<AppState>) -> (StatusCode, String) {
    let (tx, rx) = oneshot::channel();
    if s.tx.send(Request::Health(tx)).await.is_err() {
        return (StatusCode::SERVICE_UNAVAILABLE, "engine stopped\n".into());
    }
    match tokio::time::timeout(HEALTH_TIMEOUT, rx).await {
        Ok(Ok(())) => (StatusCode::OK, "ok\n".into()),
        Ok(Err(_)) => (StatusCode::SERVICE_UNAVAILABLE, "engine stopped\n".into()),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "engine loop did not answer within {} s\n",
                HEALTH_TIMEOUT.as_secs()
            ),
        ),
    }
}

fn landing_page(
    listen: SocketAddr,
    hook_set: &str,
    config: Option<&Path>,
    settings: &str,
    privileges: &str,
) -> String {
    format!(
        "<!DOCTYPE html>\n<html><head><title>spice-observer</title></head><body>\n\
         <h1>spice-observer daemon {version}</h1>\n\
         <p>Hook set: {hook_set}. Listening on {listen}. Config: {config}.</p>\n\
         <p>Settings: {settings}.</p>\n<p>Privileges: {privileges}.</p>\n<ul>\n\
         <li><a href=\"/metrics\">/metrics</a>: Prometheus metrics (text format 0.0.4)</li>\n\
         <li><a href=\"/healthz\">/healthz</a>: 200 ok while the engine runs, 503 and the reason if not</li>\n\
         </ul></body></html>\n",
        version = env!("CARGO_PKG_VERSION"),
        config = config.map_or("none (built-in defaults)".to_string(), |p| p
            .display()
            .to_string()),
    )
}

async fn serve(cfg: Config, path: Option<PathBuf>, args: &DaemonArgs) -> Result<Stop> {
    use tokio::signal::unix::{SignalKind, signal};
    // Bind first: a taken port fails before the kernel programs load.
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    // The settings as resolved (what a reload compares with); `cfg` is what is in force.
    let mut resolved = cfg.clone();
    let mut cfg = cfg;
    // BPF_ENABLE_STATS needs CAP_SYS_ADMIN: without it the daemon runs without the statistics.
    let stats_refused = privilege::probe_bpf_stats(cfg.bpf_stats)?;
    if stats_refused.is_some() {
        cfg.bpf_stats = false;
    }
    let mut engine = Engine::start_pinned(
        EngineOptions {
            sample: Duration::from_millis(cfg.sample_ms),
            retain_closed: false,
            bpf_stats: cfg.bpf_stats,
            hook_set: cfg.hook_set,
        },
        &cfg.pin_dir,
    )
    .map_err(privilege::explain_start_error)?;
    if let Some(why) = stats_refused {
        engine.note_degraded(why);
    }
    match engine.restart() {
        Restart::Continued { sockets } => info!(
            "continuing the kernel state pinned at {} ({sockets} socket(s) taken over, counts continue)",
            cfg.pin_dir.display()
        ),
        Restart::Reloaded { why } => warn!(
            "reloaded the kernel programs: the state pinned at {} could not be continued ({why}); \
             connections it was counting are reported `restarted`",
            cfg.pin_dir.display()
        ),
        Restart::Fresh | Restart::Unpinned => {
            info!(
                "kernel programs loaded and pinned at {}",
                cfg.pin_dir.display()
            )
        }
    }
    for d in engine.degraded() {
        warn!("degraded: {d}");
    }
    // Nothing is served unless the hooks count a known SPICE exchange exactly.
    if let Some(t) = engine.self_test()? {
        info!(
            "self-test passed: hook set {} counted the {} + {} messages of its loopback display channel ({} ms)",
            t.hook_set, t.expected.server_sent, t.expected.client_sent, t.elapsed_ms
        );
    }
    // The libssl hooks are attached per process as processes are found: that needs
    // CAP_SYS_ADMIN for as long as the daemon runs (privilege::TLS_HOOKS_CAP).
    let mut tls_hooks = TlsHooks::new(cfg.tls_hooks);
    if !cfg.tls_hooks {
        // Loaded but never attached: not part of what is in use.
        engine.capture_and_model().0.hook_set_without_libssl();
    }
    let keep_tls_cap = cfg.tls_hooks && privilege::holds(privilege::TLS_HOOKS_CAP.cap);
    // A reason every process fails with, logged once here rather than per process.
    let mut tls_said: Option<String> = None;
    if cfg.tls_hooks {
        tls::raise_fd_limit();
        if !keep_tls_cap {
            let why = format!(
                "{}, which this daemon does not hold (grant it, or set tls_hooks = false / \
                 --no-tls-hooks)",
                tls::CAPABILITY_HINT
            );
            warn!("libssl hooks cannot be attached: {why}; TLS channels stay `unparsed: tls`");
            tls_hooks.set_unavailable(why.clone());
            tls_said = Some(why);
        }
    }
    // Attached: keep only what discovery (and the libssl hooks) need from now on.
    let extra: &[privilege::Need] = if keep_tls_cap {
        &[privilege::TLS_HOOKS_CAP]
    } else {
        &[]
    };
    let dropped = privilege::drop_after_attach_keeping(extra)
        .context("dropping capabilities after attach")?;
    info!("{dropped}");
    // The detacher thread after the drop: capabilities are per thread, and a thread started
    // before it would keep them all.
    let mut tls_hooks = tls_hooks.with_detacher();
    // The pins an earlier daemon left: adopted as their processes are found again (the first
    // scan), the rest released after it.
    let pinned = tls_hooks.adopt_pins(engine.capture_and_model().0);
    if pinned > 0 {
        info!(
            "{pinned} pinned libssl hook link(s) at {}: {}",
            cfg.pin_dir.display(),
            if cfg.tls_hooks {
                "kept for the processes still watched, released for the others"
            } else {
                "released (tls_hooks off)"
            }
        );
    }
    let page = |cfg: &Config, engine: &Engine| {
        landing_page(
            cfg.listen,
            engine.hook_set(),
            path.as_deref(),
            &service::settings_line(cfg),
            &dropped.to_string(),
        )
    };
    let (tx, mut rx) = mpsc::channel::<Request>(16);
    let state = AppState {
        tx,
        landing: std::sync::Arc::new(std::sync::RwLock::new(page(&cfg, &engine))),
    };
    let landing_text = state.landing.clone();
    let app = Router::new()
        .route("/", get(landing))
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz))
        .with_state(state);
    // The HTTP server starts after the first scan (connections wait in the listen backlog
    // until then), so that no scrape sees sockets without their targets (VM names, legs).
    let mut http = Some((listener, app));
    let mut server = None;
    info!(
        "spice-observer daemon {}: listening on http://{} (hook set {}, config {}, sample {} ms, scan {} ms, bpf_stats {})",
        env!("CARGO_PKG_VERSION"),
        cfg.listen,
        engine.hook_set(),
        path.as_ref().map_or("none: built-in defaults".into(), |p| p
            .display()
            .to_string()),
        cfg.sample_ms,
        cfg.scan_ms,
        if cfg.bpf_stats { "on" } else { "off" },
    );
    service::ready(&format!("listening on {}", cfg.listen));

    let mut discovery = Discovery::new(&cfg.discovery);
    let mut targets: Vec<Target> = Vec::new();
    // Targets whose watch failed (warned once), retried at each scan.
    let mut pending: Vec<Target> = Vec::new();
    // Kernel timers, one wake-up per period (pipeline::ticker says why not tokio's).
    let mut scan = Ticker::new(Duration::from_millis(cfg.scan_ms))?;
    let mut sample = SampleClock::new(Duration::from_millis(cfg.sample_ms))?;
    let mut loss_check = Ticker::new(LOSS_CHECK)?;
    let mut lost_seen = [0u64; counter::COUNT as usize];
    let mut decode_seen = 0u64;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sighup = signal(SignalKind::hangup())?;
    // SIGUSR2: restart in place (nginx and unicorn use it for their binary upgrade).
    let mut sigusr2 = signal(SignalKind::user_defined2())?;
    let mut scan_failed = false;
    // After a reload changed `[discovery]`: the next scan's diff is against the targets
    // watched so far (a new Discovery would report every target as new).
    let mut rediff = false;
    let mut unreadable_seen = 0;
    let stop = loop {
        tokio::select! {
            r = engine.drain_ready() => r.context("reading the kernel's event ring")?,
            r = scan.tick() => {
                r.context("the scan timer")?;
                let s = match discovery.scan() {
                    Ok(mut s) => {
                        scan_failed = false;
                        if std::mem::take(&mut rediff) {
                            s.diff = discovery::diff(&targets, &s.targets);
                        }
                        if s.stats.unreadable > unreadable_seen && let Some(h) = privilege::proc_hint() {
                            warn!("{} /proc file(s) could not be read, such processes are not watched: {h}", s.stats.unreadable);
                        }
                        unreadable_seen = s.stats.unreadable;
                        s
                    }
                    Err(e) => {
                        if !scan_failed {
                            warn!("process scan failed: {e:#}");
                        }
                        scan_failed = true;
                        if let Some((listener, app)) = http.take() {
                            server = Some(tokio::spawn(async move { axum::serve(listener, app).await }));
                        }
                        continue;
                    }
                };
                for t in &s.diff.exited {
                    pending.retain(|p| p.pid != t.pid);
                    if let Err(e) = engine.unwatch(t.pid) {
                        warn!("unwatching {} {} (pid {}): {e:#}", kind_name(t), t.name, t.pid);
                    }
                    info!("lost {} {} (pid {})", kind_name(t), t.name, t.pid);
                }
                let retry = std::mem::take(&mut pending);
                for (t, first) in s.diff.started.iter().map(|t| (t, true)).chain(retry.iter().map(|t| (t, false))) {
                    if !first && !s.targets.iter().any(|x| x.pid == t.pid && x.start_time == t.start_time) {
                        continue;
                    }
                    // Attaching one process's libssl hooks can take seconds (while the kernel
                    // still unregisters an old set's uprobes, 0.4-1.4 s per process): the
                    // records of the processes watched so far are applied between targets,
                    // so a scan of many new targets never holds the ring that long.
                    engine.drain();
                    // The libssl hooks first, so that the process's sockets are decided
                    // with them in place. (A retry of a watch that failed does not attach
                    // again each scan: the `follow` below hooks it once it is watched.)
                    let mut tls_state = None;
                    if first {
                        let (cap, model) = engine.capture_and_model();
                        let (root, children) = tls_hooks.attach_first(cap, model, t.pid, false);
                        for (p, s) in root.iter().map(|s| (t.pid, s)).chain(children.iter().map(|(c, s)| (*c, s))) {
                            let comm = crate::sockdiag::comm(p).unwrap_or_default();
                            if let Some(line) = tls::failure_line(p, &comm, s, tls_said.as_deref()) {
                                warn!("{line}");
                            }
                        }
                        tls_state = root;
                    }
                    match engine.watch(t.pid) {
                        Ok(w) => info!(
                            "found {} {} (pid {}, {}): {} listening port(s), {} connection(s) already open{}",
                            kind_name(t), t.name, t.pid, w.comm, w.ports_enrolled, w.existing_connections,
                            match &tls_state {
                                Some(TlsAttach::Attached { library }) => format!(", libssl hooks on {library}"),
                                _ => String::new(),
                            }
                        ),
                        Err(e) => {
                            if first {
                                warn!("cannot watch {} {} (pid {}): {}; retrying at each scan", kind_name(t), t.name, t.pid, privilege::explain_watch_error(&e));
                            }
                            pending.push(t.clone());
                        }
                    }
                }
                targets = s.targets;
                // Children forked since, processes gone, late dlopen of a libssl.
                let (cap, model) = engine.capture_and_model();
                match tls_hooks.follow(cap, model, false) {
                    Ok(changes) => {
                        for c in changes {
                            let comm = crate::sockdiag::comm(c.tgid).unwrap_or_default();
                            if let Some(line) = c.status.as_ref().and_then(|s| tls::failure_line(c.tgid, &comm, s, tls_said.as_deref())) {
                                warn!("{line}");
                            }
                        }
                    }
                    Err(e) => debug!("libssl hooks: reading WATCHED_TGIDS: {e:#}"),
                }
                if let Some((listener, app)) = http.take() {
                    server = Some(tokio::spawn(async move { axum::serve(listener, app).await }));
                }
            }
            due = sample.tick() => match due.context("the sample timer")? {
                Due::Sample => engine.sample_only(monotonic_ns()),
                Due::Drain => engine.drain(),
            },
            r = loss_check.tick() => {
                r.context("the loss-check timer")?;
                if let Ok(c) = engine.counters() {
                    let grew: Vec<String> = (0..counter::COUNT)
                        .filter(|&i| counter::is_loss(i) && c[i as usize] > lost_seen[i as usize])
                        .map(|i| format!("{} +{}", counter::NAMES[i as usize], c[i as usize] - lost_seen[i as usize]))
                        .collect();
                    if !grew.is_empty() {
                        warn!("information lost in the kernel: {}", grew.join(", "));
                    }
                    lost_seen = c;
                }
                let d = engine.stats().decode_errors;
                if d > decode_seen {
                    warn!("{} ring record(s) could not be decoded", d - decode_seen);
                    decode_seen = d;
                }
            }
            Some(req) = rx.recv() => match req {
                Request::Scrape(reply) => {
                    // Records and positions up to now, so the snapshot is current.
                    engine.drain();
                    let text = scrape(&mut engine, &targets, cfg.bpf_stats).map_err(|e| format!("{e:#}"));
                    if let Err(e) = &text {
                        warn!("scrape failed: {e}");
                    }
                    let _ = reply.send(text);
                }
                Request::Health(reply) => {
                    let _ = reply.send(());
                }
            },
            _ = sighup.recv() => {
                service::reloading();
                let file = path.as_ref().map_or("(no config file)".into(), |p| p.display().to_string());
                match resolve(args) {
                    Ok((new, _)) => {
                        let plan = service::Reload::plan(&resolved, &new);
                        plan.log(&file);
                        // A timer the kernel refuses (no file descriptor left) keeps the
                        // old one running, as a config error keeps the settings in force.
                        if let Some(d) = plan.sample {
                            match SampleClock::new(d) {
                                Ok(c) => sample = c,
                                Err(e) => warn!("reload: no timer for the new sample period ({e:#}); sampling at the old one"),
                            }
                        }
                        if let Some(d) = plan.scan {
                            match Ticker::new(d) {
                                Ok(t) => scan = t,
                                Err(e) => warn!("reload: no timer for the new scan period ({e:#}); scanning at the old one"),
                            }
                        }
                        if plan.discovery {
                            discovery = Discovery::new(&new.discovery);
                            rediff = true;
                            if let Err(e) = scan.reset_immediately() {
                                warn!("reload: the scan timer could not be restarted ({e:#}); the next scan comes at its period");
                            }
                        }
                        cfg = plan.apply(&cfg, &new);
                        resolved = plan.apply(&resolved, &new);
                        *landing_text.write().unwrap_or_else(|e| e.into_inner()) = page(&cfg, &engine);
                    }
                    Err(e) => warn!("reloading {file} failed, the settings in force stay: {e:#}"),
                }
                service::ready(&format!("listening on {}", cfg.listen));
            }
            _ = sigint.recv() => break Stop::Stop,
            _ = sigterm.recv() => break Stop::Stop,
            _ = sigusr2.recv() => break Stop::RestartInPlace,
        }
    };
    match stop {
        Stop::Stop => {
            service::stopping();
            debug!("stopping");
        }
        Stop::RestartInPlace => {
            service::stopping_for_restart();
            info!(
                "SIGUSR2: exiting for a restart in place with status {EXIT_RESTART}; the kernel \
                 state stays pinned at {} and the next daemon continues it",
                cfg.pin_dir.display()
            );
        }
    }
    if let Some(s) = server {
        s.abort();
    }
    Ok(stop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(config: Option<&Path>) -> DaemonArgs {
        DaemonArgs {
            config: config.map(Path::to_path_buf),
            listen: None,
            sample_ms: None,
            scan_ms: None,
            no_bpf_stats: false,
            relay_names: Vec::new(),
            relay_ports: Vec::new(),
            pin_dir: None,
            unpin: false,
            force: false,
            no_tls_hooks: false,
            hook_set: None,
        }
    }

    #[test]
    fn daemon_flags_override_the_config_file() {
        let dir =
            std::env::temp_dir().join(format!("spice-observer-daemon-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:9999\"\nsample_ms = 50\n[discovery]\nrelays = [{ name = \"haproxy\" }]\n",
        )
        .unwrap();
        let (c, p) = resolve(&args(Some(&path))).unwrap();
        assert_eq!(p.as_deref(), Some(path.as_path()));
        assert_eq!(
            (c.listen.port(), c.sample_ms, c.scan_ms, c.bpf_stats),
            (9999, 50, 500, true)
        );
        let mut a = args(Some(&path));
        a.listen = Some("[::1]:19600".parse().unwrap());
        a.sample_ms = Some(20);
        a.scan_ms = Some(250);
        a.no_bpf_stats = true;
        a.relay_names = vec!["socat".into()];
        a.relay_ports = vec![6900];
        a.no_tls_hooks = true;
        let (c, _) = resolve(&a).unwrap();
        assert!(!c.tls_hooks);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(c.listen.to_string(), "[::1]:19600");
        assert_eq!((c.sample_ms, c.scan_ms, c.bpf_stats), (20, 250, false));
        let labels: Vec<String> = c.discovery.relays.iter().map(RelayRule::label).collect();
        assert_eq!(labels, ["haproxy", "socat", "port-6900"]);
    }

    #[test]
    fn daemon_bad_flags_and_missing_config() {
        let e = format!(
            "{:#}",
            resolve(&args(Some(Path::new("/nonexistent/x.toml")))).unwrap_err()
        );
        assert!(
            e.contains("/nonexistent/x.toml") && e.contains("does not exist"),
            "{e}"
        );
        let mut a = args(None);
        a.sample_ms = Some(0);
        assert!(format!("{:#}", resolve(&a).unwrap_err()).contains("--sample-ms"));
        let mut a = args(None);
        a.scan_ms = Some(0);
        assert!(format!("{:#}", resolve(&a).unwrap_err()).contains("--scan-ms"));
        let mut a = args(None);
        a.relay_ports = vec![0];
        assert!(format!("{:#}", resolve(&a).unwrap_err()).contains("--relay-port"));
        let mut a = args(None);
        a.relay_names = vec!["/usr/bin/socat".into()];
        assert!(format!("{:#}", resolve(&a).unwrap_err()).contains("--relay-name"));
    }

    /// `--unpin`'s directory: `--pin-dir`, else a config that parses, else the default
    /// (a config with a typo must not stop the unpin).
    #[test]
    fn unpin_dir_survives_a_bad_config() {
        let dir =
            std::env::temp_dir().join(format!("spice-observer-unpindir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.toml");
        std::fs::write(&good, "pin_dir = \"/sys/fs/bpf/from-config\"\n").unwrap();
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, "pin_dri = \"/sys/fs/bpf/typo\"\n").unwrap();
        let mut a = args(Some(&bad));
        a.unpin = true;
        a.pin_dir = Some("/sys/fs/bpf/given".into());
        assert_eq!(unpin_dir(&a).unwrap(), Path::new("/sys/fs/bpf/given"));
        a.pin_dir = None;
        assert_eq!(
            unpin_dir(&a).unwrap(),
            Path::new(crate::config::DEFAULT_PIN_DIR)
        );
        a.config = Some(dir.join("missing.toml"));
        assert_eq!(
            unpin_dir(&a).unwrap(),
            Path::new(crate::config::DEFAULT_PIN_DIR)
        );
        a.config = Some(good);
        assert_eq!(unpin_dir(&a).unwrap(), Path::new("/sys/fs/bpf/from-config"));
        a.pin_dir = Some("relative".into());
        assert!(unpin_dir(&a).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn state(tx: mpsc::Sender<Request>) -> AppState {
        AppState {
            tx,
            landing: std::sync::Arc::new(std::sync::RwLock::new(String::new())),
        }
    }

    /// `/healthz`: 200 while the loop answers, 503 with the reason when it has stopped or
    /// does not answer within [`HEALTH_TIMEOUT`]; `/metrics` 503 once the loop has stopped.
    #[test]
    fn daemon_healthz_answers() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (tx, mut rx) = mpsc::channel(4);
            let answer = tokio::spawn(async move {
                if let Some(Request::Health(r)) = rx.recv().await {
                    let _ = r.send(());
                }
                // Receive the next request and never answer it.
                let stuck = rx.recv().await;
                tokio::time::sleep(Duration::from_secs(60)).await;
                drop(stuck);
            });
            let (code, body) = healthz(State(state(tx.clone()))).await;
            assert_eq!((code, body.as_str()), (StatusCode::OK, "ok\n"));
            let (code, body) = healthz(State(state(tx.clone()))).await;
            assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
            assert!(body.contains("did not answer within 2 s"), "{body}");
            answer.abort();
            let _ = answer.await;
            let (code, body) = healthz(State(state(tx.clone()))).await;
            assert_eq!(
                (code, body.as_str()),
                (StatusCode::SERVICE_UNAVAILABLE, "engine stopped\n")
            );
            let r = metrics_handler(State(state(tx))).await;
            assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        });
    }
}
