//! `spice-observer daemon --hook-set tcpinfo` (config `hook_set = "tcpinfo"`): the no-BPF mode
//! as a host daemon. Discovery finds the SPICE servers and relays as the BPF daemon does
//! ([`Discovery`], every `scan_ms`); a [`Poller`] reads their TCP sockets over sock_diag every
//! `sample_ms`; `/metrics` serves per-connection TCP gauges. Nothing is loaded into the kernel,
//! nothing is pinned, no capability is needed for one's own processes (root, or
//! `CAP_SYS_PTRACE` and `CAP_DAC_READ_SEARCH`, to read other users' `/proc/PID`).
//!
//! No SPICE framing: no channel, message, window or stage metric exists in this mode.
//! `spice_observer_info{hook_set="tcpinfo",framing="false"}` and `spice_observer_framing 0`
//! say so on every scrape.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use axum::{
    Router,
    extract::State,
    http::{StatusCode, header},
    response::{Html, IntoResponse, Response},
    routing::get,
};
use log::{info, warn};
use prometheus::{Encoder, GaugeVec, Opts, Registry, TextEncoder};

use crate::cmd::service;
use crate::cmd::tcpinfo::{HOOK_SET, NO_FRAMING, Poller};
use crate::config::Config;
use crate::host::discovery::Discovery;

/// What the HTTP handlers share with the loop.
#[derive(Clone)]
struct Shared {
    poller: Arc<Mutex<Poller>>,
    /// Target pid → its name (the `vm` label).
    names: Arc<Mutex<BTreeMap<u32, String>>>,
    landing: Arc<String>,
}

/// Runs the tcpinfo daemon until SIGTERM or SIGINT (exit status 0). `path`: the config file
/// read, for the landing page. SIGHUP is ignored (a reload of this mode is not built).
pub fn run(cfg: Config, path: Option<PathBuf>) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(serve(cfg, path))
}

/// The metric families of one scrape, in the text format.
///
/// * `spice_observer_info{version,hook_set="tcpinfo",framing="false"}` 1;
/// * `spice_observer_hook_set_info{hook_set="tcpinfo"}` 1 and
///   `spice_observer_build_info{version}` 1, as the BPF daemon has them;
/// * `spice_observer_framing` 0 (1 would mean SPICE messages are framed: a BPF hook set);
/// * `spice_observer_tcpinfo_targets`: discovered targets watched;
/// * per open connection of a watched process, labels `vm` (the target's name), `pid`,
///   `local`, `remote`: `spice_observer_tcpinfo_tcp_state{…,state}` 1, and the gauges of
///   [`crate::cmd::tcpinfo::Gauges`] at the last sample: `_bytes_acked`, `_bytes_received`,
///   `_bytes_sent`, `_bytes_retrans` (the kernel's per-connection byte counters
///   `tcpi_bytes_*`, bytes), `_send_queue_bytes`, `_recv_queue_bytes`, `_notsent_bytes`,
///   `_unacked_segments`, `_lost_segments`, `_retrans_segments_total`,
///   `_snd_cwnd_segments`, `_snd_wnd_bytes`, `_srtt_seconds`, `_min_rtt_seconds`,
///   `_delivery_rate_bytes_per_second` (`tcpi_delivery_rate`).
pub fn metrics_text(poller: &Poller, names: &BTreeMap<u32, String>) -> Result<String> {
    let reg = Registry::new();
    let info = GaugeVec::new(
        Opts::new(
            "spice_observer_info",
            "spice-observer: version, hook set, and whether SPICE is framed",
        ),
        &["version", "hook_set", "framing"],
    )?;
    reg.register(Box::new(info.clone()))?;
    info.with_label_values(&[env!("CARGO_PKG_VERSION"), HOOK_SET, "false"])
        .set(1.0);
    // The BPF daemon's two info families too, so that dashboards and alerts on them see
    // this mode (metrics.rs: `hook_set_info`, `build_info`).
    let hook_set_info = GaugeVec::new(
        Opts::new(
            "spice_observer_hook_set_info",
            "1, labelled with the set of kernel hooks in use (tcpinfo: none, no framing)",
        ),
        &["hook_set"],
    )?;
    reg.register(Box::new(hook_set_info.clone()))?;
    hook_set_info.with_label_values(&[HOOK_SET]).set(1.0);
    let build_info = GaugeVec::new(
        Opts::new(
            "spice_observer_build_info",
            "1, labelled with the daemon's version",
        ),
        &["version"],
    )?;
    reg.register(Box::new(build_info.clone()))?;
    build_info
        .with_label_values(&[env!("CARGO_PKG_VERSION")])
        .set(1.0);
    let framing = prometheus::Gauge::new(
        "spice_observer_framing",
        "1 when SPICE messages are framed (a BPF hook set); 0 in the tcpinfo mode, which has \
         TCP state only: no channel, message, window or stage metric",
    )?;
    reg.register(Box::new(framing.clone()))?;
    framing.set(0.0);
    let targets = prometheus::Gauge::new(
        "spice_observer_tcpinfo_targets",
        "Discovered SPICE servers and relays whose sockets are polled",
    )?;
    reg.register(Box::new(targets.clone()))?;
    targets.set(names.len() as f64);

    let labels = ["vm", "pid", "local", "remote"];
    let state = GaugeVec::new(
        Opts::new(
            "spice_observer_tcpinfo_tcp_state",
            "TCP state of a watched connection (idiag_state), 1 for the state label",
        ),
        &["vm", "pid", "local", "remote", "state"],
    )?;
    reg.register(Box::new(state.clone()))?;
    type Get = fn(&crate::cmd::tcpinfo::Gauges) -> f64;
    let gauges: [(&str, &str, Get); 15] = [
        (
            "bytes_acked",
            "tcpi_bytes_acked: bytes the peer acknowledged",
            |g| g.bytes_acked as f64,
        ),
        (
            "bytes_received",
            "tcpi_bytes_received: bytes received in order",
            |g| g.bytes_received as f64,
        ),
        (
            "bytes_sent",
            "tcpi_bytes_sent: bytes sent, retransmissions included",
            |g| g.bytes_sent as f64,
        ),
        (
            "bytes_retrans",
            "tcpi_bytes_retrans: bytes retransmitted",
            |g| g.bytes_retrans as f64,
        ),
        (
            "send_queue_bytes",
            "idiag_wqueue: written, not yet acknowledged",
            |g| f64::from(g.send_queue),
        ),
        (
            "recv_queue_bytes",
            "idiag_rqueue: received, not yet read",
            |g| f64::from(g.recv_queue),
        ),
        (
            "notsent_bytes",
            "tcpi_notsent_bytes: written, not yet sent",
            |g| f64::from(g.notsent_bytes),
        ),
        (
            "unacked_segments",
            "tcpi_unacked: segments in flight",
            |g| f64::from(g.unacked),
        ),
        (
            "lost_segments",
            "tcpi_lost: segments considered lost",
            |g| f64::from(g.lost),
        ),
        (
            "retrans_segments_total",
            "tcpi_total_retrans: segments retransmitted over the connection's life",
            |g| f64::from(g.total_retrans),
        ),
        (
            "snd_cwnd_segments",
            "tcpi_snd_cwnd: congestion window",
            |g| f64::from(g.snd_cwnd),
        ),
        (
            "snd_wnd_bytes",
            "tcpi_snd_wnd: the peer's receive window",
            |g| f64::from(g.snd_wnd),
        ),
        ("srtt_seconds", "tcpi_rtt: smoothed round-trip time", |g| {
            f64::from(g.srtt_us) / 1e6
        }),
        (
            "min_rtt_seconds",
            "tcpi_min_rtt: minimum round-trip time",
            |g| f64::from(g.min_rtt_us) / 1e6,
        ),
        (
            "delivery_rate_bytes_per_second",
            "tcpi_delivery_rate: latest delivery-rate sample",
            |g| g.delivery_rate as f64,
        ),
    ];
    let mut vecs = Vec::new();
    for (name, help, get) in gauges {
        let v = GaugeVec::new(
            Opts::new(
                format!("spice_observer_tcpinfo_{name}"),
                format!("{help} (tcpinfo mode, per connection, at the last sample)"),
            ),
            &labels,
        )?;
        reg.register(Box::new(v.clone()))?;
        vecs.push((v, get));
    }
    let procs = poller.processes();
    for c in poller.open_connections() {
        let under = procs.get(&c.pid).map_or(c.pid, |p| p.under);
        let vm = names.get(&under).cloned().unwrap_or_default();
        let pid = c.pid.to_string();
        let l = [
            vm.as_str(),
            pid.as_str(),
            c.local.as_str(),
            c.remote.as_str(),
        ];
        state
            .with_label_values(&[l[0], l[1], l[2], l[3], c.last.state.as_str()])
            .set(1.0);
        for (v, get) in &vecs {
            v.with_label_values(&l).set(get(&c.last));
        }
    }
    let mut buf = Vec::new();
    TextEncoder::new().encode(&reg.gather(), &mut buf)?;
    Ok(String::from_utf8(buf)?)
}

async fn metrics_handler(State(s): State<Shared>) -> Response {
    let text = {
        let poller = s.poller.lock().unwrap_or_else(|e| e.into_inner());
        let names = s.names.lock().unwrap_or_else(|e| e.into_inner());
        metrics_text(&poller, &names)
    };
    match text {
        Ok(t) => (
            [(
                header::CONTENT_TYPE,
                TextEncoder::new().format_type().to_string(),
            )],
            t,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}\n")).into_response(),
    }
}

async fn serve(cfg: Config, path: Option<PathBuf>) -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let poller = Arc::new(Mutex::new(Poller::new(&[])?));
    let names: Arc<Mutex<BTreeMap<u32, String>>> = Arc::default();
    let landing = format!(
        "<!DOCTYPE html>\n<html><head><title>spice-observer</title></head><body>\n\
         <h1>spice-observer daemon {version}</h1>\n\
         <p>Hook set: tcpinfo (no BPF). {NO_FRAMING}.</p>\n\
         <p>Listening on {listen}. Config: {config}.</p>\n<ul>\n\
         <li><a href=\"/metrics\">/metrics</a>: Prometheus metrics (text format 0.0.4)</li>\n\
         <li><a href=\"/healthz\">/healthz</a>: 200 ok while it runs</li>\n\
         </ul></body></html>\n",
        version = env!("CARGO_PKG_VERSION"),
        listen = cfg.listen,
        config = path
            .as_ref()
            .map_or("none (built-in defaults)".to_string(), |p| p
                .display()
                .to_string()),
    );
    let shared = Shared {
        poller: poller.clone(),
        names: names.clone(),
        landing: Arc::new(landing),
    };
    let app = Router::new()
        .route(
            "/",
            get(|State(s): State<Shared>| async move { Html((*s.landing).clone()) }),
        )
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { (StatusCode::OK, "ok\n") }))
        .with_state(shared);
    info!(
        "spice-observer daemon {}: listening on http://{} (hook set tcpinfo, no BPF; {NO_FRAMING}; sample {} ms, scan {} ms)",
        env!("CARGO_PKG_VERSION"),
        cfg.listen,
        cfg.sample_ms,
        cfg.scan_ms
    );
    let mut discovery = Discovery::new(&cfg.discovery);
    let mut scan = tokio::time::interval(Duration::from_millis(cfg.scan_ms));
    scan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sample = tokio::time::interval(Duration::from_millis(cfg.sample_ms));
    sample.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sighup = signal(SignalKind::hangup())?;
    let mut http = Some((listener, app));
    let mut server = None;
    let mut scan_failed = false;
    loop {
        tokio::select! {
            _ = scan.tick() => {
                match discovery.scan() {
                    Ok(s) => {
                        scan_failed = false;
                        for t in &s.diff.started {
                            info!("found {} (pid {}, {})", t.name, t.pid, t.comm);
                        }
                        for t in &s.diff.exited {
                            info!("lost {} (pid {})", t.name, t.pid);
                        }
                        let map: BTreeMap<u32, String> =
                            s.targets.iter().map(|t| (t.pid, t.name.clone())).collect();
                        let roots: Vec<u32> = map.keys().copied().collect();
                        *names.lock().unwrap_or_else(|e| e.into_inner()) = map;
                        let mut p = poller.lock().unwrap_or_else(|e| e.into_inner());
                        p.set_roots(roots);
                    }
                    Err(e) => {
                        if !scan_failed {
                            warn!("process scan failed: {e:#}");
                        }
                        scan_failed = true;
                    }
                }
                // The HTTP server starts after the first scan, so that no scrape sees an
                // empty host that is not.
                if let Some((listener, app)) = http.take() {
                    server = Some(tokio::spawn(async move { axum::serve(listener, app).await }));
                    service::ready(&format!("listening on {}", cfg.listen));
                }
            }
            _ = sample.tick() => {
                let mut p = poller.lock().unwrap_or_else(|e| e.into_inner());
                p.sample_or_warn();
                p.clear_closed();
            }
            _ = sighup.recv() => {
                warn!("SIGHUP: the tcpinfo daemon does not re-read its config; restart it to change settings");
            }
            _ = sigint.recv() => break,
            _ = sigterm.recv() => break,
        }
    }
    if let Some(s) = server {
        s.abort();
    }
    info!("stopped");
    Ok(())
}
