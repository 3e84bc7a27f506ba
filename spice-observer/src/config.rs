//! The host daemon's configuration file (TOML), as [`Config`].
//!
//! What it does: parses the file into typed settings with serde and the `toml` crate, fills
//! every missing key with its default ([`Config::default`]), rejects unknown keys (the error
//! names the key, with line and column) and values that make no sense (a zero period, a relay
//! rule that says neither what name nor what port to look for). The sample file
//! `packaging/spice-observer.toml` in the repository lists every key with its default (but
//! `bpf_stats`, off there because the packaged unit lacks CAP_SYS_ADMIN); a unit
//! test parses it, so it cannot drift from this module.
//!
//! `spice-observer daemon` ([`crate::cmd::daemon`]) loads it (flags override its keys),
//! hands [`Config::discovery`] to [`crate::host::discovery::Discovery::new`], scans every
//! [`Config::scan_ms`], samples every [`Config::sample_ms`], serves Prometheus metrics on
//! [`Config::listen`] and holds `BPF_ENABLE_STATS` when [`Config::bpf_stats`] is set. It
//! reads it again on SIGHUP and applies what can change without a restart
//! ([`crate::cmd::service`]).
//!
//! ```toml
//! listen = "127.0.0.1:19590"
//! sample_ms = 100
//! scan_ms = 500
//! bpf_stats = true
//! tls_hooks = true
//! hook_set = "auto"
//! [discovery]
//! qemu = true
//! xspice = true
//! relays = [{ name = "socat" }, { port = 6900 }]
//! ```

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::Deserialize;

/// Default TCP port of the Prometheus endpoint: 19590.
///
/// Why this number: the Prometheus project's "Default port allocations" wiki page
/// (github.com/prometheus/prometheus/wiki/Default-port-allocations) hands out 9090–9099 to its
/// own servers and 9100–9999 to exporters; that range is fully allocated since 2023 and new
/// registrations continue above 10000 (e.g. 10019). The Prometheus guide "Writing exporters"
/// (section "Port numbers") asks exporters that are not registered there to stay outside the
/// allocated ranges. 19590 is outside them, below Linux's ephemeral range (32768–60999 by
/// default, `net.ipv4.ip_local_port_range`, so an outgoing connection never holds it), away
/// from SPICE/VNC's 5900+N, and not in this Debian host's `/etc/services`. Not registered on
/// the wiki page.
pub const DEFAULT_PORT: u16 = 19590;

/// Default pin directory of the daemon's kernel state: `/sys/fs/bpf/spice-observer` (on the
/// BPF filesystem's usual mount point).
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/spice-observer";

/// The daemon's settings. Every key is optional; [`Config::default`] gives the value of a
/// missing one. Unknown keys are an error.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `listen`: address and port of the Prometheus `/metrics` HTTP endpoint, as
    /// `"ADDR:PORT"` (IPv6 in brackets: `"[::1]:19590"`). Default `127.0.0.1:19590`
    /// ([`DEFAULT_PORT`]): loopback only; scraping from another host needs an explicit
    /// address.
    pub listen: SocketAddr,
    /// `sample_ms`: period of the TCP-position samples of every watched socket,
    /// milliseconds, > 0. Default 100.
    pub sample_ms: u64,
    /// `scan_ms`: period of the process scan that finds SPICE servers and relays
    /// ([`crate::host::discovery::Discovery::scan`]), milliseconds, > 0. Default 500, so a
    /// new server is picked up within 1 s. A scan of a host with ~1000 processes costs
    /// ~1 ms (measured numbers in the discovery module's docs).
    pub scan_ms: u64,
    /// `bpf_stats`: hold `BPF_ENABLE_STATS` (`BPF_STATS_RUN_TIME`, bpf(2), Linux 5.8) while
    /// running, so that the kernel accounts each program's run count and run time
    /// (`run_cnt`, `run_time_ns` in `bpf_prog_info`) and the daemon can export the
    /// observer's own kernel-side cost. The accounting costs two clock reads per program
    /// run, for every BPF program on the host while enabled. Default true.
    pub bpf_stats: bool,
    /// `pin_dir`: directory on a BPF filesystem (bpffs) where the daemon pins its maps and
    /// program links, so that a restarted daemon continues the counts exactly (README,
    /// "Restarts and pinned state"). Default [`DEFAULT_PIN_DIR`]; must be absolute.
    pub pin_dir: PathBuf,
    /// `tls_hooks`: attach the libssl uprobes ([`crate::kernel::tls`]) to every watched
    /// process that maps a libssl, so that SPICE inside TLS is framed from the plaintext.
    /// Attaching a uprobe needs `CAP_SYS_ADMIN` (`perf_event_open(2)` of the uprobe PMU), so
    /// with this on the daemon keeps that capability after attach when it has it; without
    /// it every process with a libssl is reported `failed` with that reason. `false`
    /// (`--no-tls-hooks`): nothing is attached, TLS channels stay `unparsed: tls`. Needs a
    /// restart to change. Default true.
    pub tls_hooks: bool,
    /// `hook_set`: the programs that see the socket calls, `"auto"` (default: the first of
    /// `tracepoints`, `fentry`, `kprobes`, `syscalls` that loads), or one of those
    /// ([`crate::kernel::loader::HookChoice`]; `"tcpinfo"`:
    /// the no-BPF mode, TCP gauges per connection without framing,
    /// [`crate::cmd::tcpinfo_daemon`]). Needs a
    /// restart to change; a pinned set of another hook set is then reloaded, and its open
    /// channels are reported `restarted`.
    pub hook_set: crate::kernel::loader::HookChoice,
    /// `[discovery]`: what to look for.
    pub discovery: DiscoveryConfig,
}

/// `[discovery]`: which processes the daemon watches. See
/// [`crate::host::discovery`] for how each kind is recognised.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// `qemu`: watch QEMU processes started with a SPICE display (`-spice …` or
    /// `-display spice-app`). Default true.
    pub qemu: bool,
    /// `xspice`: watch Xorg servers running the spiceqxl driver (Xspice). Default true.
    pub xspice: bool,
    /// `relays`: relay (SPICE proxy) processes to watch, each found by process name or by
    /// listening port. Default none: a relay program such as socat is too common to watch
    /// every instance of it unasked.
    pub relays: Vec<RelayRule>,
}

/// One entry of `discovery.relays`: exactly one of `name` and `port`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayRule {
    /// `name`: the program's name, e.g. `"socat"`, `"haproxy"`, `"websockify"`,
    /// `"spiceproxy"`, or the script name of a Python relay (`"kerbside"` matches
    /// `python3 /usr/bin/kerbside`, `python3 kerbside.py` and `python3 -m kerbside`).
    /// Compared with the process's `comm` and with the base name of its `argv[0]`.
    #[serde(default)]
    pub name: Option<String>,
    /// `port`: a TCP port; the process holding a `LISTEN` socket on it (any address, the
    /// daemon's network namespace) is the relay.
    #[serde(default)]
    pub port: Option<u16>,
}

impl RelayRule {
    /// The rule's label, used as the relay's name: the `name`, or `port-N`.
    pub fn label(&self) -> String {
        match (&self.name, self.port) {
            (Some(name), _) => name.clone(),
            (None, Some(port)) => format!("port-{port}"),
            (None, None) => String::new(),
        }
    }
}

impl Default for Config {
    fn default() -> Config {
        Config {
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), DEFAULT_PORT),
            sample_ms: 100,
            scan_ms: 500,
            bpf_stats: true,
            pin_dir: PathBuf::from(DEFAULT_PIN_DIR),
            tls_hooks: true,
            hook_set: crate::kernel::loader::HookChoice::Auto,
            discovery: DiscoveryConfig::default(),
        }
    }
}

impl Default for DiscoveryConfig {
    fn default() -> DiscoveryConfig {
        DiscoveryConfig {
            qemu: true,
            xspice: true,
            relays: Vec::new(),
        }
    }
}

impl Config {
    /// Reads and checks the config file at `path`.
    ///
    /// Errors (each names the file): it cannot be read; it is not valid TOML, has an unknown
    /// key or a value of the wrong type (the message gives line and column, from the `toml`
    /// crate); a value is out of range (see [`Config::parse`]).
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the config file {}", path.display()))?;
        Config::parse(&text).with_context(|| format!("config file {}", path.display()))
    }

    /// Parses and checks config text (the contents of a file; `load` adds the file name to
    /// errors).
    ///
    /// Errors: invalid TOML, an unknown key, a wrong type (message with line and column);
    /// `sample_ms` or `scan_ms` 0; a `discovery.relays` entry with neither or both of
    /// `name` and `port`, an empty name or one with a `/`, port 0.
    pub fn parse(text: &str) -> anyhow::Result<Config> {
        let config: Config = toml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
        config.check()?;
        Ok(config)
    }

    fn check(&self) -> anyhow::Result<()> {
        if self.sample_ms == 0 {
            bail!("sample_ms must be > 0");
        }
        if self.scan_ms == 0 {
            bail!("scan_ms must be > 0");
        }
        if !self.pin_dir.is_absolute() {
            bail!("pin_dir {:?} must be an absolute path", self.pin_dir);
        }
        for (i, rule) in self.discovery.relays.iter().enumerate() {
            let at = format!("discovery.relays[{i}]");
            match (&rule.name, rule.port) {
                (None, None) => bail!("{at}: give `name` or `port`"),
                (Some(_), Some(_)) => {
                    bail!("{at}: give `name` or `port`, not both (use two entries)")
                }
                (Some(name), None) if name.is_empty() || name.contains('/') => {
                    bail!("{at}: name {name:?} must be a non-empty program name without '/'")
                }
                (None, Some(0)) => bail!("{at}: port must be 1-65535"),
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = include_str!("../../packaging/spice-observer.toml");

    #[test]
    fn config_empty_is_default() {
        assert_eq!(Config::parse("").unwrap(), Config::default());
        assert_eq!(
            Config::default().listen.to_string(),
            format!("127.0.0.1:{DEFAULT_PORT}")
        );
    }

    /// The sample file sets every key to its default, so parsing it gives the defaults, but
    /// for `bpf_stats` and `tls_hooks`: the packaged unit does not grant CAP_SYS_ADMIN, so the
    /// file installed with it turns both off.
    #[test]
    fn config_sample_file_is_default() {
        let sample = Config::parse(SAMPLE).unwrap();
        assert!(!sample.bpf_stats);
        assert!(!sample.tls_hooks);
        assert_eq!(
            Config {
                bpf_stats: true,
                tls_hooks: true,
                ..sample
            },
            Config::default()
        );
    }

    /// The commented-out relay examples of the sample file parse too, into the rules they
    /// describe.
    #[test]
    fn config_sample_relay_examples_parse() {
        let lines: Vec<&str> = SAMPLE.lines().collect();
        let start = lines
            .iter()
            .position(|l| l.trim_start() == "# relays = [")
            .expect("sample has a commented `relays = [` example");
        let len = lines[start..]
            .iter()
            .position(|l| l.trim_start() == "# ]")
            .expect("example ends with `# ]`");
        let example: String = lines[start..=start + len]
            .iter()
            .map(|l| l.trim_start().strip_prefix('#').unwrap().to_owned() + "\n")
            .collect();
        assert!(SAMPLE.contains("\nrelays = []\n"));
        let text = SAMPLE.replace("\nrelays = []\n", &format!("\n{example}"));
        let config = Config::parse(&text).unwrap();
        let rules = &config.discovery.relays;
        assert!(rules.len() >= 3, "{rules:?}");
        assert!(rules.iter().any(|r| r.name.as_deref() == Some("socat")));
        assert!(rules.iter().any(|r| r.port.is_some()));
        let labels: Vec<String> = rules.iter().map(RelayRule::label).collect();
        assert!(labels.iter().all(|l| !l.is_empty()), "{labels:?}");
    }

    #[test]
    fn config_values() {
        let c = Config::parse(
            "listen = \"[::]:9999\"\nsample_ms = 50\nbpf_stats = false\n\
             [discovery]\nqemu = false\nrelays = [{ name = \"haproxy\" }, { port = 6900 }]\n",
        )
        .unwrap();
        assert_eq!(c.listen.to_string(), "[::]:9999");
        assert_eq!(c.sample_ms, 50);
        assert_eq!(c.scan_ms, 500, "missing key keeps its default");
        assert!(!c.bpf_stats);
        assert!(c.tls_hooks, "missing key keeps its default");
        assert!(!Config::parse("tls_hooks = false\n").unwrap().tls_hooks);
        assert_eq!(
            Config::parse("hook_set = \"syscalls\"\n").unwrap().hook_set,
            crate::kernel::loader::HookChoice::Syscalls
        );
        assert_eq!(
            Config::parse("hook_set = \"tcpinfo\"\n").unwrap().hook_set,
            crate::kernel::loader::HookChoice::Tcpinfo
        );
        assert_eq!(
            Config::parse("hook_set = \"fentry\"\n").unwrap().hook_set,
            crate::kernel::loader::HookChoice::Fentry
        );
        assert_eq!(
            Config::parse("hook_set = \"kprobes\"\n").unwrap().hook_set,
            crate::kernel::loader::HookChoice::Kprobes
        );
        assert!(err("hook_set = \"kprobe\"\n").contains("line 1"));
        assert!(err("tls_hooks = \"no\"\n").contains("line 1"));
        assert!(!c.discovery.qemu);
        assert!(c.discovery.xspice);
        assert_eq!(
            c.discovery.relays,
            [
                RelayRule {
                    name: Some("haproxy".into()),
                    port: None
                },
                RelayRule {
                    name: None,
                    port: Some(6900)
                }
            ]
        );
        assert_eq!(c.discovery.relays[1].label(), "port-6900");
    }

    fn err(text: &str) -> String {
        format!("{:#}", Config::parse(text).unwrap_err())
    }

    #[test]
    fn config_unknown_key_is_named_with_position() {
        let e = err("sample_ms = 100\nscan_msec = 5\n");
        assert!(e.contains("scan_msec"), "{e}");
        assert!(e.contains("line 2"), "{e}");
        let e = err("[discovery]\nqemu = true\nlibvirt = true\n");
        assert!(e.contains("libvirt") && e.contains("line 3"), "{e}");
        let e = err("[discovery]\nrelays = [{ nam = \"socat\" }]\n");
        assert!(e.contains("nam") && e.contains("line 2"), "{e}");
    }

    #[test]
    fn config_bad_values() {
        let e = err("sample_ms = \"fast\"\n");
        assert!(e.contains("sample_ms") || e.contains("line 1"), "{e}");
        assert!(err("listen = \"localhost\"\n").contains("line 1"));
        assert!(err("scan_ms = 0\n").contains("scan_ms"));
        assert!(err("sample_ms = 0\n").contains("sample_ms"));
        assert!(err("[discovery]\nrelays = [{}]\n").contains("discovery.relays[0]"));
        assert!(
            err("[discovery]\nrelays = [{ name = \"a\" }, { name = \"socat\", port = 1 }]\n")
                .contains("discovery.relays[1]")
        );
        assert!(err("[discovery]\nrelays = [{ port = 0 }]\n").contains("port"));
        assert!(err("[discovery]\nrelays = [{ port = 70000 }]\n").contains("line 2"));
        assert!(err("[discovery]\nrelays = [{ name = \"/usr/bin/socat\" }]\n").contains("'/'"));
        assert!(err("listen = [1\n").contains("line 1"));
    }

    #[test]
    fn config_load_names_the_file() {
        let e = format!(
            "{:#}",
            Config::load(Path::new("/nonexistent/spice-observer.toml")).unwrap_err()
        );
        assert!(e.contains("/nonexistent/spice-observer.toml"), "{e}");
        let dir =
            std::env::temp_dir().join(format!("spice-observer-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.toml");
        std::fs::write(&path, "bogus = 1\n").unwrap();
        let e = format!("{:#}", Config::load(&path).unwrap_err());
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(e.contains("bad.toml") && e.contains("bogus"), "{e}");
    }
}
