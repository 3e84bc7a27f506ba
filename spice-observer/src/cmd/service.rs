//! The daemon as a system service: readiness and reload notifications to systemd
//! (`sd_notify(3)`, through the `sd-notify` crate), and what a SIGHUP reload applies.
//!
//! Notifications (each a no-op when `NOTIFY_SOCKET` is unset, i.e. outside a `Type=notify`
//! unit): `READY=1` once the kernel programs are attached, the capabilities dropped and the
//! HTTP listener bound ([`ready`]); `RELOADING=1` with `MONOTONIC_USEC=` when a SIGHUP
//! arrives, then `READY=1` when the new settings are in force ([`reloading`]);
//! `STOPPING=1` on SIGINT/SIGTERM ([`stopping`]) and on SIGUSR2, the restart in place
//! ([`stopping_for_restart`]). A failed notification is logged once at
//! debug level and otherwise ignored: the daemon runs the same without systemd.
//!
//! Reload (SIGHUP): the config file is read again and the flags applied again
//! ([`crate::cmd::daemon::resolve`]); [`Reload::plan`] compares it with the settings in force.
//! Applied in place, with the engine, its kernel programs and every count untouched:
//! `sample_ms`, `scan_ms` and `[discovery]` (`qemu`, `xspice`, `relays`: the next scan, at
//! once, watches the new targets and stops watching the processes no rule matches any
//! more). Need a restart, and are logged as not applied: `listen` (the socket is bound
//! before the capabilities are dropped), `bpf_stats` (the statistics descriptor is taken at
//! start, with a capability the daemon no longer has), `tls_hooks` (whether the daemon keeps
//! the capability uprobes need is decided when it drops the others), and any other key (the
//! kernel state's settings). A file that does not parse leaves everything as it was (warning with the
//! error). The log level is `RUST_LOG`, read at start only.

use std::time::Duration;

use log::{debug, info, warn};
use sd_notify::NotifyState;

use crate::config::Config;

fn notify(what: &str, states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        debug!("sd_notify {what}: {e}");
    }
}

/// Tells systemd the daemon is ready (`READY=1`) with a `STATUS=` line.
pub fn ready(status: &str) {
    notify("READY", &[NotifyState::Ready, NotifyState::Status(status)]);
}

/// Tells systemd a reload has begun (`RELOADING=1` and `MONOTONIC_USEC=`, as
/// `systemd.service(5)` asks of `Type=notify-reload` and accepts from `Type=notify`).
pub fn reloading() {
    let mut states = vec![NotifyState::Reloading];
    if let Ok(t) = NotifyState::monotonic_usec_now() {
        states.push(t);
    }
    notify("RELOADING", &states);
}

/// Tells systemd the daemon is stopping (`STOPPING=1`).
pub fn stopping() {
    notify("STOPPING", &[NotifyState::Stopping]);
}

/// Tells systemd the daemon is stopping for a restart in place (`STOPPING=1` with a
/// `STATUS=` line saying the pins are kept).
pub fn stopping_for_restart() {
    notify(
        "STOPPING",
        &[
            NotifyState::Stopping,
            NotifyState::Status("restarting in place: kernel state stays pinned"),
        ],
    );
}

/// What a reload changes: the settings it applies and those that need a restart.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Reload {
    /// New sample period, if it changed.
    pub sample: Option<Duration>,
    /// New scan period, if it changed.
    pub scan: Option<Duration>,
    /// `[discovery]` changed: discovery starts over with the new rules.
    pub discovery: bool,
    /// Changes applied, one `key: old -> new` each, for the log.
    pub applied: Vec<String>,
    /// Keys that changed and are not applied until a restart.
    pub need_restart: Vec<String>,
}

impl Reload {
    /// Compares the settings in force (`old`) with the reloaded ones (`new`).
    pub fn plan(old: &Config, new: &Config) -> Reload {
        let mut r = Reload::default();
        if new.sample_ms != old.sample_ms {
            r.sample = Some(Duration::from_millis(new.sample_ms));
            r.applied
                .push(format!("sample_ms: {} -> {}", old.sample_ms, new.sample_ms));
        }
        if new.scan_ms != old.scan_ms {
            r.scan = Some(Duration::from_millis(new.scan_ms));
            r.applied
                .push(format!("scan_ms: {} -> {}", old.scan_ms, new.scan_ms));
        }
        if new.discovery != old.discovery {
            r.discovery = true;
            let rules = |c: &Config| {
                let mut v: Vec<String> = Vec::new();
                if c.discovery.qemu {
                    v.push("qemu".into());
                }
                if c.discovery.xspice {
                    v.push("xspice".into());
                }
                v.extend(
                    c.discovery
                        .relays
                        .iter()
                        .map(|r| format!("relay {}", r.label())),
                );
                format!("[{}]", v.join(", "))
            };
            r.applied
                .push(format!("discovery: {} -> {}", rules(old), rules(new)));
        }
        if new.listen != old.listen {
            r.need_restart
                .push(format!("listen ({} -> {})", old.listen, new.listen));
        }
        if new.bpf_stats != old.bpf_stats {
            r.need_restart.push(format!(
                "bpf_stats ({} -> {})",
                old.bpf_stats, new.bpf_stats
            ));
        }
        if new.tls_hooks != old.tls_hooks {
            r.need_restart.push(format!(
                "tls_hooks ({} -> {})",
                old.tls_hooks, new.tls_hooks
            ));
        }
        if new.pin_dir != old.pin_dir {
            r.need_restart.push(format!(
                "pin_dir ({} -> {})",
                old.pin_dir.display(),
                new.pin_dir.display()
            ));
        }
        // Any other key: what is left once the ones above are made equal.
        let mut rest = new.clone();
        rest.pin_dir = old.pin_dir.clone();
        rest.sample_ms = old.sample_ms;
        rest.scan_ms = old.scan_ms;
        rest.discovery = old.discovery.clone();
        rest.listen = old.listen;
        rest.bpf_stats = old.bpf_stats;
        rest.tls_hooks = old.tls_hooks;
        if rest != *old {
            r.need_restart
                .push("other keys (the kernel state's settings)".to_string());
        }
        r
    }

    /// The settings in force after the reload: `old` with the applied keys of `new`.
    pub fn apply(&self, old: &Config, new: &Config) -> Config {
        let mut c = old.clone();
        c.sample_ms = new.sample_ms;
        c.scan_ms = new.scan_ms;
        c.discovery = new.discovery.clone();
        c
    }

    /// Logs the outcome: one `info` line with what was applied (or that nothing changed)
    /// and a `warn` line naming each key that needs a restart.
    pub fn log(&self, file: &str) {
        if self.applied.is_empty() {
            info!("reloaded {file}: nothing to apply");
        } else {
            info!("reloaded {file}: applied {}", self.applied.join("; "));
        }
        if !self.need_restart.is_empty() {
            warn!(
                "reloaded {file}: not applied until a restart: {}",
                self.need_restart.join("; ")
            );
        }
    }
}

/// The landing page's line of settings in force (sample and scan periods, discovery
/// rules), rewritten at each reload.
pub fn settings_line(c: &Config) -> String {
    let relays: Vec<String> = c.discovery.relays.iter().map(|r| r.label()).collect();
    format!(
        "sample_ms {}, scan_ms {}, discovery: qemu {}, xspice {}, relays [{}]",
        c.sample_ms,
        c.scan_ms,
        c.discovery.qemu,
        c.discovery.xspice,
        relays.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_reload_plan() {
        let old = Config::default();
        assert_eq!(Reload::plan(&old, &old), Reload::default());
        let new = Config::parse(
            "sample_ms = 250\nscan_ms = 200\nlisten = \"127.0.0.1:1\"\nbpf_stats = false\n\
             [discovery]\nrelays = [{ name = \"socat\" }]\n",
        )
        .unwrap();
        let r = Reload::plan(&old, &new);
        assert_eq!(r.sample, Some(Duration::from_millis(250)));
        assert_eq!(r.scan, Some(Duration::from_millis(200)));
        assert!(r.discovery);
        assert_eq!(r.applied.len(), 3, "{r:?}");
        assert!(r.applied[2].contains("relay socat"), "{r:?}");
        assert_eq!(r.need_restart.len(), 2, "{r:?}");
        assert!(r.need_restart[0].starts_with("listen"));
        assert!(r.need_restart[1].starts_with("bpf_stats"));
        let c = r.apply(&old, &new);
        assert_eq!((c.sample_ms, c.scan_ms), (250, 200));
        assert_eq!(c.discovery, new.discovery);
        assert_eq!((c.listen, c.bpf_stats), (old.listen, old.bpf_stats));
        let tls_off = Config::parse("tls_hooks = false\n").unwrap();
        let r = Reload::plan(&old, &tls_off);
        assert_eq!(r.need_restart, ["tls_hooks (true -> false)"], "{r:?}");
        assert!(r.applied.is_empty(), "{r:?}");
        assert!(r.apply(&old, &tls_off).tls_hooks);
        assert!(settings_line(&c).contains("sample_ms 250"));
        assert!(settings_line(&c).contains("relays [socat]"));
    }
}
