//! Target discovery: which processes on this host are SPICE servers or configured relays,
//! and which of them started or exited since the previous scan.
//!
//! [`Discovery::scan`] lists `/proc` (one `getdents` pass gives every pid and the inode
//! number of its `/proc/PID` directory) and reads `/proc/PID/stat` (state, parent, flags,
//! `comm`, start time) only for processes it must look at: new pids, pids whose directory
//! inode changed (a new process under a reused pid), processes younger than [`EXEC_WINDOW`]
//! (a forked child looks like its parent until it calls `execve()`, which keeps pid and start
//! time but sets a new `comm`), current targets (to see them exit or turn zombie), and every
//! process once per [`FULL_RECHECK`] (an `execve()` by an older process). A process whose
//! (pid, start time, `comm`) it has not classified yet is classified once, from
//! `/proc/PID/cmdline` and, for Xorg only, `/proc/PID/maps`; those are never re-read for
//! the same (pid, start time, `comm`). Zombies and kernel threads are never targets.
//! Reading a small `/proc` file costs 10–20 µs on the test host, so this is what keeps a scan
//! cheap: see "Cost" below.
//!
//! How each kind is recognised (the rules, in order; a process is at most one target):
//!
//! * **QEMU** ([`ServerKind::Qemu`], `[discovery] qemu`): `comm` or the base name of
//!   `argv[0]` is `qemu-system-*` (`comm` is cut to 15 bytes: `qemu-system-x86`), `qemu-kvm`
//!   (RHEL) or `kvm` (Proxmox VE's symlink), and the command line has `-spice OPTS` (any
//!   options: `port=`, `tls-port=`, `unix=on,addr=PATH`, …) or `-display spice-app`; QEMU
//!   accepts `--opt` for `-opt`. See [`qemu_has_spice`]. A QEMU given its SPICE settings only
//!   through `-readconfig FILE` is not found.
//! * **Xspice** ([`ServerKind::Xspice`], `[discovery] xspice`): `comm` or `argv[0]` base name
//!   is `Xorg` (or `X`), and `/proc/PID/maps` maps `spiceqxl_drv.so` (the Xspice video driver)
//!   or `libspice-server.so.*` (the Xorg of `rig/start-xspice.sh` maps both:
//!   `/usr/lib/xorg/modules/drivers/spiceqxl_drv.so` and
//!   `/usr/lib/x86_64-linux-gnu/libspice-server.so.1.14.2`). The `/usr/bin/Xspice` Python
//!   wrapper is not the server (it maps neither and is not an Xorg): its Xorg child is. Xorg
//!   loads the driver some time after it starts, so an Xorg that does not map it yet is
//!   re-checked at every scan during its first [`XORG_SETTLE`].
//! * **Relays** ([`TargetKind::Relay`], `[discovery] relays`, first matching rule in config
//!   order): a `name` rule matches `comm`, the base name of `argv[0]`, and for a Python
//!   interpreter (`python`, `python3`, `python3.11`, `pypy3`, …) the script or `-m` module
//!   named on its command line, each also without a `.py` suffix ([`relay_name_matches`]).
//!   A `port` rule matches the process holding a `LISTEN` TCP socket on that port, any
//!   address, IPv4 or IPv6: a sock_diag dump gives the socket's inode, the owner is the
//!   process with a `/proc/PID/fd/N -> socket:[INODE]` link ([`crate::sockdiag::socket_inodes`]).
//!   Only sockets of the scanning process's network namespace are seen. A relay that
//!   descends from another relay (socat forks one child per connection; haproxy's master
//!   starts workers) is not a separate target, whatever rule it matches: whoever watches a
//!   relay watches its descendants ([`crate::sockdiag::descendants`]).
//!
//! Names ([`Target::name`]), usable as a Prometheus label value (at most [`NAME_MAX`]
//! characters, no whitespace or control characters, see [`label_value`]):
//!
//! * QEMU: the `guest` of the last `-name` (`-name guest=NAME,…` as libvirt writes it,
//!   `-name NAME`, `-name NAME,debug-threads=on`; `,,` is QEMU's escaped comma), else the
//!   `-uuid`, else `pid-PID`.
//! * Xspice: `xspice-N` for Xorg's display `:N` on its command line, else `pid-PID`.
//! * Relays: the rule's label ([`crate::config::RelayRule::label`]: `socat`, `port-6900`). Not
//!   unique: two socat relays share it; the pid tells them apart.
//!
//! Cost: a steady-state scan is one `/proc` listing plus a `stat` read per target and per
//! young process. Port rules add a sock_diag dump of the TCP sockets
//! ([`crate::sockdiag::dump_tcp`], or the caller's, [`Discovery::scan_with_sockets`]), plus a
//! walk of every process's `fd` directory when a listening socket on a watched port has an
//! owner not known yet. Not `/proc/net/tcp{,6}`: reading both took ~13 ms on the test host
//! with 60 TCP sockets, the dump of the same sockets ~1.5 ms (debug build).
//!
//! Measured by the `discovery_scan_cost` test in `tests/discovery.rs` (release build, 2-core
//! VM shared with other builds, ~1000 processes, most older than [`EXEC_WINDOW`]):
//! steady-state scan 0.7–0.9 ms without relay rules; 2.9–4.3 ms with a name and a port rule
//! and 800 TCP sockets open (the sock_diag dump is most of it;
//! [`Discovery::scan_with_sockets`] saves it). The first scan, which classifies every
//! process, 22–25 ms. A [`FULL_RECHECK`] scan, once per 30 s, reads every
//! `stat` file: 11–14 ms for 1000 (timed with a stand-alone readdir + read loop, not by the
//! test).
//!
//! Not done here: attaching the observer to the targets and following relays' children
//! ([`crate::cmd::daemon`] and the engine do that); not done at all: network namespaces
//! other than the scanning process's, and event-driven discovery (the proc connector)
//! instead of polling.
//!
//! Reading another user's `/proc/PID/maps` and `/proc/PID/fd` needs root or
//! `CAP_SYS_PTRACE`; without it such an Xorg or port owner is not found and
//! [`ScanStats::unreadable`] counts it.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, ErrorKind, Read};
use std::os::unix::fs::DirEntryExt as _;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::config::{DiscoveryConfig, RelayRule};
use crate::sockdiag;

/// Which SPICE server program a [`TargetKind::SpiceServer`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum ServerKind {
    /// QEMU with a SPICE display (spice-server linked into QEMU or its `ui-spice-core` module).
    Qemu,
    /// Xorg with the spiceqxl driver (Xspice); spice-server runs inside Xorg.
    Xspice,
}

/// What a discovered process is.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum TargetKind {
    /// A process running spice-server.
    SpiceServer(ServerKind),
    /// A relay (SPICE proxy) matched by a `discovery.relays` rule.
    Relay {
        /// The rule's label ([`RelayRule::label`]).
        rule: String,
    },
}

/// One discovered process.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Target {
    /// Process id (thread-group id).
    pub pid: u32,
    /// `/proc/PID/stat` field 22, `starttime`: when the process started, in clock ticks
    /// (`sysconf(_SC_CLK_TCK)`, usually 100 per second) since boot. With the pid, it
    /// identifies the process across pid reuse.
    pub start_time: u64,
    /// What it is.
    pub kind: TargetKind,
    /// The VM's (or relay rule's) name, a bounded label value; see the module docs for the
    /// rule.
    pub name: String,
    /// `/proc/PID/comm` as of the scan (the kernel's `task->comm`, at most 15 bytes).
    pub comm: String,
}

/// Targets that appeared and disappeared between two scans.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Diff {
    /// In the new scan but not in the old one (by pid and start time), or changed kind or
    /// name: the daemon starts watching these.
    pub started: Vec<Target>,
    /// In the old scan but not in the new one, or changed (then also in `started`): the
    /// daemon stops watching these.
    pub exited: Vec<Target>,
}

impl Diff {
    /// No change.
    pub fn is_empty(&self) -> bool {
        self.started.is_empty() && self.exited.is_empty()
    }
}

/// Compares two target lists: `started` = in `now` but not in `prev`, `exited` = in `prev`
/// but not in `now`, both in the order of their list. A target is the same when pid and start
/// time are; one whose kind or name changed (an `execve()` into another program) is both
/// exited (old) and started (new).
pub fn diff(prev: &[Target], now: &[Target]) -> Diff {
    let key = |t: &Target| (t.pid, t.start_time);
    let prev_by: HashMap<(u32, u64), &Target> = prev.iter().map(|t| (key(t), t)).collect();
    let now_by: HashMap<(u32, u64), &Target> = now.iter().map(|t| (key(t), t)).collect();
    let same = |a: &Target, b: &Target| a.kind == b.kind && a.name == b.name;
    Diff {
        started: now
            .iter()
            .filter(|t| !prev_by.get(&key(t)).is_some_and(|p| same(p, t)))
            .cloned()
            .collect(),
        exited: prev
            .iter()
            .filter(|t| !now_by.get(&key(t)).is_some_and(|n| same(n, t)))
            .cloned()
            .collect(),
    }
}

/// What one scan cost and saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ScanStats {
    /// Processes listed in `/proc` (zombies and kernel threads included; threads are not
    /// listed by `/proc`).
    pub processes: usize,
    /// `/proc/PID/stat` files read: new, young, target and changed processes, or all at a
    /// full re-check.
    pub stat_reads: usize,
    /// Processes classified this scan (new pid, or a known pid with a new start time or
    /// `comm`): their `cmdline` was read.
    pub classified: usize,
    /// `/proc/PID/maps` files read (new Xorg candidates, and Xorg in its first
    /// [`XORG_SETTLE`] that did not map spice-server yet).
    pub maps_read: usize,
    /// `cmdline`, `maps` or `fd` files that exist but could not be read (permissions); such
    /// a process is not a target.
    pub unreadable: usize,
    /// Walks of every process's `/proc/PID/fd` to find the owner of a listening socket on a
    /// watched port (0 without port rules, and when the owners are known already).
    pub fd_walks: usize,
    /// Wall-clock time of the scan, microseconds.
    pub elapsed_us: u64,
}

/// The result of [`Discovery::scan`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Scan {
    /// Every target found, by pid.
    pub targets: Vec<Target>,
    /// Change since the previous scan (the first scan reports every target as started).
    pub diff: Diff,
    /// Cost and counts.
    pub stats: ScanStats,
}

/// How long after its start an Xorg that does not map spice-server yet keeps being
/// re-checked: Xorg loads its video driver during start-up, after `execve()`.
pub const XORG_SETTLE: Duration = Duration::from_secs(30);

/// Processes younger than this have their `stat` re-read at every scan, so that an
/// `execve()` soon after `fork()` (libvirt starting QEMU, a wrapper script `exec`ing it) is
/// seen: a forked child looks like its parent until it execs.
pub const EXEC_WINDOW: Duration = Duration::from_secs(10);

/// How often every process's `stat` is re-read, to see an `execve()` by an older process.
pub const FULL_RECHECK: Duration = Duration::from_secs(30);

/// `TCP_LISTEN` (`include/net/tcp_states.h`).
const TCP_LISTEN: u8 = 10;

/// Maximum length of a [`Target::name`], in characters.
pub const NAME_MAX: usize = 64;

/// How far up the parent chain a relay's relay ancestor is looked for.
const MAX_DEPTH: usize = 64;

/// `PF_KTHREAD` in `/proc/PID/stat` field 9 (`flags`): a kernel thread
/// (`include/linux/sched.h`).
const PF_KTHREAD: u64 = 0x0020_0000;

/// The fields of `/proc/PID/stat` that discovery uses (`proc_pid_stat(5)`;
/// `do_task_stat()` in `fs/proc/array.c`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat<'a> {
    /// Field 2 without its parentheses: `task->comm` (may itself contain `)` and spaces).
    pub comm: &'a str,
    /// Field 3: `R`, `S`, `D`, `Z` (zombie), `X`, `T`, `t`, `I`, …
    pub state: u8,
    /// Field 4: parent pid.
    pub ppid: u32,
    /// Field 9: `task->flags` (`PF_*`).
    pub flags: u64,
    /// Field 22: start time, clock ticks since boot.
    pub start_time: u64,
}

/// Parses the contents of `/proc/PID/stat`. `None` if it is malformed. `comm` is delimited by
/// the first `(` and the last `)`, since it may contain either.
pub fn parse_stat(raw: &[u8]) -> Option<Stat<'_>> {
    let open = raw.iter().position(|&b| b == b'(')?;
    let close = raw.iter().rposition(|&b| b == b')')?;
    let comm = std::str::from_utf8(raw.get(open + 1..close)?).unwrap_or("?");
    let rest = std::str::from_utf8(raw.get(close + 1..)?).ok()?;
    // Fields from 3 (state) on.
    let mut fields = rest.split_ascii_whitespace();
    let state = *fields.next()?.as_bytes().first()?;
    let ppid = fields.next()?.parse().ok()?;
    let flags = fields.nth(4)?.parse().ok()?; // field 9
    let start_time = fields.nth(12)?.parse().ok()?; // field 22
    Some(Stat {
        comm,
        state,
        ppid,
        flags,
        start_time,
    })
}

/// Splits the contents of `/proc/PID/cmdline` into arguments (NUL-separated, bytes that are
/// not UTF-8 replaced).
pub fn parse_cmdline(raw: &[u8]) -> Vec<String> {
    let raw = raw.strip_suffix(b"\0").unwrap_or(raw);
    if raw.is_empty() {
        return Vec::new();
    }
    raw.split(|&b| b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

fn basename(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// True if `comm` or `argv[0]` names a QEMU system emulator: `qemu-system-*`, `qemu-kvm`, or
/// `kvm`.
pub fn is_qemu_program(comm: &str, argv: &[String]) -> bool {
    let argv0 = argv.first().map(|a| basename(a)).unwrap_or("");
    [comm, argv0]
        .iter()
        .any(|n| n.starts_with("qemu-system-") || *n == "qemu-kvm" || *n == "kvm")
}

/// The options of a QEMU command line as (name, value) pairs, `--opt` read as `-opt`. Only
/// the options discovery needs are given their value; every other word is skipped, which
/// cannot take a value for one of them, since QEMU's values are separate arguments.
fn qemu_options(argv: &[String]) -> impl Iterator<Item = (&str, &str)> {
    const WANTED: [&str; 4] = ["-spice", "-display", "-name", "-uuid"];
    let mut args = argv.iter().skip(1);
    std::iter::from_fn(move || {
        loop {
            let arg = args.next()?;
            let opt = arg.strip_prefix('-').filter(|o| o.starts_with('-'));
            let opt = opt.unwrap_or(arg);
            if let Some(&wanted) = WANTED.iter().find(|w| **w == opt) {
                return Some((wanted, args.next().map_or("", String::as_str)));
            }
        }
    })
}

/// True if a QEMU command line enables SPICE: a `-spice` option (any value), or
/// `-display spice-app[,…]` (QEMU 4.0+, which starts spice-server on a unix socket).
pub fn qemu_has_spice(argv: &[String]) -> bool {
    qemu_options(argv).any(|(opt, value)| {
        opt == "-spice" || (opt == "-display" && value.split(',').next() == Some("spice-app"))
    })
}

/// Splits a QEMU option value (`QemuOpts` syntax: `a=b,c=d`, `,,` is a literal comma) into
/// (key, value) pairs; a first element without `=` is the value of `implied` (QEMU's
/// `implied_opt_name`), a later one is a flag (`key` → value "on").
fn qemu_opts(value: &str, implied: &str) -> Vec<(String, String)> {
    let mut parts = Vec::new();
    let mut cur = String::new();
    let mut chars = value.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                cur.push(',');
            } else {
                parts.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    parts.push(cur);
    parts
        .into_iter()
        .enumerate()
        .filter(|(_, p)| !p.is_empty())
        .map(|(i, p)| match p.split_once('=') {
            Some((k, v)) => (k.to_owned(), v.to_owned()),
            None if i == 0 => (implied.to_owned(), p),
            None => (p, "on".to_owned()),
        })
        .collect()
}

/// The VM name on a QEMU command line, raw: the `guest` of the last `-name` that has one,
/// else the last `-uuid`. `None` if neither is given.
pub fn qemu_vm_name(argv: &[String]) -> Option<String> {
    let mut guest = None;
    let mut uuid = None;
    for (opt, value) in qemu_options(argv) {
        match opt {
            "-name" => {
                if let Some((_, g)) = qemu_opts(value, "guest")
                    .into_iter()
                    .rfind(|(k, _)| k == "guest")
                {
                    guest = Some(g);
                }
            }
            "-uuid" if !value.is_empty() => uuid = Some(value.to_owned()),
            _ => {}
        }
    }
    guest.filter(|g| !g.is_empty()).or(uuid)
}

/// True if `comm` or `argv[0]` names an X server binary (`Xorg`, `X`).
pub fn is_xorg_program(comm: &str, argv: &[String]) -> bool {
    let argv0 = argv.first().map(|a| basename(a)).unwrap_or("");
    [comm, argv0].iter().any(|n| *n == "Xorg" || *n == "X")
}

/// The display number on an X server's command line: the first argument `:N`.
pub fn xorg_display(argv: &[String]) -> Option<u32> {
    argv.iter()
        .skip(1)
        .find_map(|a| a.strip_prefix(':')?.parse().ok())
}

/// True if one line of `/proc/PID/maps` maps the spiceqxl driver or spice-server's library.
pub fn maps_line_is_spice(line: &str) -> bool {
    // The path is the 6th field; it may contain spaces, and is absent for anonymous maps.
    let Some(path) = line.split_ascii_whitespace().nth(5) else {
        return false;
    };
    let name = basename(path);
    name.starts_with("spiceqxl_drv.so") || name.starts_with("libspice-server.so")
}

/// The script (base name) or `-m` module a Python interpreter runs, if `argv[0]` or `comm`
/// is one (`python`, `python3`, `python3.11`, `pypy3`, …). `None` for `-c`, stdin, or
/// another program.
pub fn python_script<'a>(comm: &str, argv: &'a [String]) -> Option<&'a str> {
    let is_python = |n: &str| {
        ["python", "pypy"].iter().any(|p| {
            n.strip_prefix(p)
                .is_some_and(|v| v.chars().all(|c| c.is_ascii_digit() || c == '.'))
        })
    };
    let argv0 = basename(argv.first()?);
    if !is_python(argv0) && !is_python(comm) {
        return None;
    }
    let mut args = argv.iter().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-m" => return args.next().map(String::as_str),
            "-c" | "-" => return None,
            // Options that take a separate value.
            "-W" | "-X" | "--check-hash-based-pycs" => {
                args.next();
            }
            "--" => return args.next().map(|a| basename(a)),
            a if a.starts_with("-m") => return Some(&a[2..]),
            a if a.starts_with("-c") => return None,
            a if a.starts_with('-') => {}
            a => return Some(basename(a)),
        }
    }
    None
}

/// True if a `name` relay rule matches the process: `name` equals its `comm` (compared on
/// the first 15 bytes, as the kernel cuts `comm`), the base name of `argv[0]`, or the
/// [`python_script`] it runs; each of those also without a `.py` suffix.
pub fn relay_name_matches(name: &str, comm: &str, argv: &[String]) -> bool {
    let strip = |n: &str| n.strip_suffix(".py").unwrap_or(n).to_owned();
    let mut comm_name = name;
    while comm_name.len() > 15 {
        // TASK_COMM_LEN is 16 with the NUL; cut on a char boundary.
        let mut cut = 15;
        while !comm_name.is_char_boundary(cut) {
            cut -= 1;
        }
        comm_name = &comm_name[..cut];
    }
    if comm == comm_name || strip(comm) == name {
        return true;
    }
    let argv0 = argv.first().map(|a| basename(a)).unwrap_or("");
    if !argv0.is_empty() && strip(argv0) == name {
        return true;
    }
    python_script(comm, argv).is_some_and(|s| strip(s) == name)
}

/// Makes a label value of `raw`: whitespace and control characters become `_`, and it is cut
/// to [`NAME_MAX`] characters. `None` if `raw` is empty.
pub fn label_value(raw: &str) -> Option<String> {
    if raw.is_empty() {
        return None;
    }
    Some(
        raw.chars()
            .take(NAME_MAX)
            .map(|c| {
                if c.is_whitespace() || c.is_control() {
                    '_'
                } else {
                    c
                }
            })
            .collect(),
    )
}

/// The name of a QEMU target: [`qemu_vm_name`] as a [`label_value`], else `pid-PID`.
pub fn qemu_target_name(pid: u32, argv: &[String]) -> String {
    qemu_vm_name(argv)
        .and_then(|n| label_value(&n))
        .unwrap_or_else(|| format!("pid-{pid}"))
}

/// The name of an Xspice target: `xspice-N` for display `:N`, else `pid-PID`.
pub fn xspice_target_name(pid: u32, argv: &[String]) -> String {
    match xorg_display(argv) {
        Some(n) => format!("xspice-{n}"),
        None => format!("pid-{pid}"),
    }
}

/// What a process is, as far as the (cached) command line tells.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Class {
    Other,
    Server(ServerKind, String),
    /// An Xorg that did not map spice-server when last checked.
    XorgCandidate(String),
    /// Matches the `name` relay rule with this index.
    NamedRelay(usize),
}

#[derive(Debug)]
struct Known {
    /// `d_ino` of `/proc/PID` when its `stat` was last read.
    ino: u64,
    start_time: u64,
    comm: String,
    ppid: u32,
    class: Class,
    kthread: bool,
    /// The scan that last saw it.
    seen: u64,
}

/// The owners of one listening socket on a watched port, as (pid, start time), found by the
/// fd walk at `walked`.
#[derive(Debug)]
struct Listener {
    owners: Vec<(u32, u64)>,
    walked: Instant,
}

/// Finds targets by polling `/proc`; keeps the classification of every process it has seen
/// and the previous scan's targets. See the module docs for the rules.
#[derive(Debug)]
pub struct Discovery {
    qemu: bool,
    xspice: bool,
    rules: Vec<RelayRule>,
    known: HashMap<u32, Known>,
    /// Listening socket inode → its owners, for the port rules.
    listeners: HashMap<u64, Listener>,
    targets: Vec<Target>,
    generation: u64,
    /// When every process's `stat` was last re-read.
    last_full: Option<Instant>,
    /// `sysconf(_SC_CLK_TCK)`: the unit of `/proc/PID/stat` times.
    ticks_per_s: u64,
    buf: Vec<u8>,
    path: String,
}

impl Discovery {
    /// A discovery with the settings of `[discovery]`; nothing is read until [`Self::scan`].
    pub fn new(config: &DiscoveryConfig) -> Discovery {
        Discovery {
            qemu: config.qemu,
            xspice: config.xspice,
            rules: config.relays.clone(),
            known: HashMap::new(),
            listeners: HashMap::new(),
            targets: Vec::new(),
            generation: 0,
            last_full: None,
            // SAFETY: sysconf has no preconditions.
            ticks_per_s: u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
                .ok()
                .filter(|&t| t > 0)
                .unwrap_or(100),
            buf: Vec::with_capacity(1024),
            path: String::with_capacity(32),
        }
    }

    /// The targets of the last scan, by pid (empty before the first).
    pub fn targets(&self) -> &[Target] {
        &self.targets
    }

    /// Scans `/proc` once: the current targets, and the [`Diff`] against the previous scan.
    /// With port rules, takes a sock_diag dump of the TCP sockets ([`sockdiag::dump_tcp`]) to
    /// find the listening ones; [`Self::scan_with_sockets`] reuses a dump the caller has.
    ///
    /// Errors: `/proc` cannot be listed, or (with port rules) the sock_diag dump fails. A
    /// process that exits during the scan is skipped; one whose files cannot be read is
    /// counted in [`ScanStats::unreadable`].
    pub fn scan(&mut self) -> anyhow::Result<Scan> {
        self.scan_with_sockets(None)
    }

    /// [`Self::scan`], with the TCP sockets of a recent [`sockdiag::dump_tcp`] of this network
    /// namespace (the daemon's sampler takes one every sample) instead of a dump of its own.
    /// Only the `LISTEN` sockets (state 10) of the dump are used, and only with port rules.
    pub fn scan_with_sockets(
        &mut self,
        sockets: Option<&[sockdiag::DiagSocket]>,
    ) -> anyhow::Result<Scan> {
        let t0 = Instant::now();
        self.generation += 1;
        let generation = self.generation;
        let mut stats = ScanStats::default();
        let full = self
            .last_full
            .is_none_or(|t| t0.duration_since(t) >= FULL_RECHECK);
        if full {
            self.last_full = Some(t0);
        }
        // Boot-relative now, in the unit of start times, to tell young processes (all are
        // young if /proc/uptime cannot be read).
        let now_ticks = std::fs::read_to_string("/proc/uptime")
            .ok()
            .and_then(|u| u.split_ascii_whitespace().next()?.parse::<f64>().ok())
            .map_or(0, |secs| (secs * self.ticks_per_s as f64) as u64);
        let ticks = |d: Duration| d.as_secs() * self.ticks_per_s;
        let (exec_window, xorg_settle) = (ticks(EXEC_WINDOW), ticks(XORG_SETTLE));
        let younger = |start: u64, window: u64| now_ticks.saturating_sub(start) < window;

        let dir = std::fs::read_dir("/proc").context("cannot list /proc")?;
        for entry in dir {
            let Ok(entry) = entry else { continue };
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            stats.processes += 1;
            // The inode number of /proc/PID, from getdents: proc_pid_readdir() instantiates
            // the directory's inode (proc_pid_make_inode(), i_ino from get_next_ino()), so a
            // new process under a reused pid has a new one.
            let ino = entry.ino();
            // Skipped: an old process, seen before under this inode, not a target.
            if let Some(k) = self.known.get_mut(&pid)
                && !full
                && k.ino == ino
                && !younger(k.start_time, exec_window)
                && self.targets.binary_search_by_key(&pid, |t| t.pid).is_err()
            {
                k.seen = generation;
                continue;
            }
            stats.stat_reads += 1;
            if !self.read_proc_file(pid, "stat") {
                continue; // exited
            }
            let Some(stat) = parse_stat(&self.buf) else {
                continue;
            };
            if stat.state == b'Z' || stat.state == b'X' {
                continue; // exited, not reaped yet: not a target, forgotten below
            }
            let (start_time, ppid, flags) = (stat.start_time, stat.ppid, stat.flags);
            let comm = stat.comm;
            if let Some(k) = self.known.get_mut(&pid)
                && k.start_time == start_time
                && k.comm == comm
            {
                k.ino = ino;
                k.ppid = ppid;
                k.seen = generation;
                continue;
            }
            let comm = comm.to_owned();
            let kthread = flags & PF_KTHREAD != 0;
            let class = if kthread {
                Class::Other
            } else {
                stats.classified += 1;
                match self.classify(pid, &comm, &mut stats) {
                    Some(class) => class,
                    None => continue, // exited
                }
            };
            self.known.insert(
                pid,
                Known {
                    ino,
                    start_time,
                    comm,
                    ppid,
                    class,
                    kthread,
                    seen: generation,
                },
            );
        }
        self.known.retain(|_, k| k.seen == generation);

        // Xorg that did not map spice-server yet: look again while it is young, then give up.
        let pending: Vec<(u32, bool)> = self
            .known
            .iter()
            .filter(|(_, k)| matches!(k.class, Class::XorgCandidate(_)))
            .map(|(&pid, k)| (pid, younger(k.start_time, xorg_settle)))
            .collect();
        for (pid, young) in pending {
            let spice = young && self.maps_have_spice(pid, &mut stats) == Some(true);
            if let Some(k) = self.known.get_mut(&pid)
                && let Class::XorgCandidate(name) = &k.class
            {
                if spice {
                    k.class = Class::Server(ServerKind::Xspice, name.clone());
                } else if !young {
                    k.class = Class::Other;
                }
            }
        }

        let port_relays = self.port_relays(sockets, &mut stats)?;
        let targets = self.collect_targets(&port_relays);
        let diff = diff(&self.targets, &targets);
        self.targets = targets.clone();
        stats.elapsed_us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
        Ok(Scan {
            targets,
            diff,
            stats,
        })
    }

    /// Reads `/proc/PID/FILE` into `self.buf`; false if the process is gone or the file
    /// cannot be read.
    fn read_proc_file(&mut self, pid: u32, file: &str) -> bool {
        self.path.clear();
        let _ = write!(self.path, "/proc/{pid}/{file}");
        self.buf.clear();
        std::fs::File::open(&self.path)
            .and_then(|mut f| f.read_to_end(&mut self.buf))
            .is_ok()
    }

    /// Classifies a process not seen before. `None` if it exited meanwhile.
    fn classify(&mut self, pid: u32, comm: &str, stats: &mut ScanStats) -> Option<Class> {
        self.path.clear();
        let _ = write!(self.path, "/proc/{pid}/cmdline");
        let argv = match std::fs::read(&self.path) {
            Ok(raw) => parse_cmdline(&raw),
            Err(e) if gone(&e) => return None,
            Err(_) => {
                stats.unreadable += 1;
                return Some(Class::Other);
            }
        };
        if argv.is_empty() {
            // A zombie, or a process that exited between stat and cmdline.
            return Some(Class::Other);
        }
        if self.qemu && is_qemu_program(comm, &argv) && qemu_has_spice(&argv) {
            return Some(Class::Server(
                ServerKind::Qemu,
                qemu_target_name(pid, &argv),
            ));
        }
        if self.xspice && is_xorg_program(comm, &argv) {
            let name = xspice_target_name(pid, &argv);
            return match self.maps_have_spice(pid, stats) {
                None => None,
                Some(true) => Some(Class::Server(ServerKind::Xspice, name)),
                Some(false) => Some(Class::XorgCandidate(name)),
            };
        }
        let rule = self.rules.iter().position(|r| {
            r.name
                .as_deref()
                .is_some_and(|n| relay_name_matches(n, comm, &argv))
        });
        Some(rule.map_or(Class::Other, Class::NamedRelay))
    }

    /// Whether `/proc/PID/maps` maps spice-server. `None` if the process is gone;
    /// `Some(false)` if unreadable (counted).
    fn maps_have_spice(&mut self, pid: u32, stats: &mut ScanStats) -> Option<bool> {
        stats.maps_read += 1;
        let file = match std::fs::File::open(format!("/proc/{pid}/maps")) {
            Ok(f) => f,
            Err(e) if gone(&e) => return None,
            Err(_) => {
                stats.unreadable += 1;
                return Some(false);
            }
        };
        let mut reader = BufReader::with_capacity(16 * 1024, file);
        let mut line = String::new();
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) => return Some(false),
                Ok(_) if maps_line_is_spice(&line) => return Some(true),
                Ok(_) => {}
                Err(e) if gone(&e) => return None,
                // Not UTF-8 (a mapped file's name) or a read error: skip the rest.
                Err(_) => return Some(false),
            }
        }
    }

    /// The processes that own a listening socket on a port of a `port` rule: pid → rule
    /// index. Looks at the TCP sockets only when there are port rules, and walks the fds of
    /// every process only when a watched listening socket's owners are not known.
    fn port_relays(
        &mut self,
        sockets: Option<&[sockdiag::DiagSocket]>,
        stats: &mut ScanStats,
    ) -> anyhow::Result<HashMap<u32, usize>> {
        let ports: HashMap<u16, usize> = self
            .rules
            .iter()
            .enumerate()
            .rev() // the first rule for a port wins
            .filter_map(|(i, r)| Some((r.port?, i)))
            .collect();
        if ports.is_empty() {
            return Ok(HashMap::new());
        }
        let own;
        let sockets = match sockets {
            Some(s) => s,
            None => {
                own = sockdiag::dump_tcp().context("listening sockets for the port rules")?;
                &own[..]
            }
        };
        let mut listening: HashMap<u64, usize> = HashMap::new();
        for socket in sockets {
            if socket.state == TCP_LISTEN
                && socket.inode != 0
                && let Some(&rule) = ports.get(&socket.local.port())
            {
                listening.insert(socket.inode, rule);
            }
        }
        self.listeners
            .retain(|inode, _| listening.contains_key(inode));
        let alive = |known: &HashMap<u32, Known>, &(pid, start): &(u32, u64)| {
            known.get(&pid).is_some_and(|k| k.start_time == start)
        };
        // Walk again for a new socket, for one whose known owner exited (a child may hold
        // it), and for one without a visible owner (another user's process without root),
        // but for that one only once per FULL_RECHECK.
        let now = Instant::now();
        let stale: HashSet<u64> = listening
            .keys()
            .filter(|inode| {
                self.listeners.get(inode).is_none_or(|l| {
                    if l.owners.is_empty() {
                        now.duration_since(l.walked) >= FULL_RECHECK
                    } else {
                        !l.owners.iter().all(|o| alive(&self.known, o))
                    }
                })
            })
            .copied()
            .collect();
        if !stale.is_empty() {
            stats.fd_walks += 1;
            for inode in &stale {
                self.listeners.insert(
                    *inode,
                    Listener {
                        owners: Vec::new(),
                        walked: now,
                    },
                );
            }
            for (&pid, k) in &self.known {
                if k.kthread {
                    continue;
                }
                match sockdiag::socket_inodes(pid) {
                    Ok(inodes) => {
                        for inode in inodes.intersection(&stale) {
                            if let Some(l) = self.listeners.get_mut(inode) {
                                l.owners.push((pid, k.start_time));
                            }
                        }
                    }
                    Err(e) => {
                        let gone = e
                            .chain()
                            .filter_map(|c| c.downcast_ref::<procfs::ProcError>())
                            .any(|c| matches!(c, procfs::ProcError::NotFound(_)));
                        if !gone {
                            stats.unreadable += 1;
                        }
                    }
                }
            }
        }
        let mut relays = HashMap::new();
        for (inode, rule) in listening {
            for &(pid, start) in self.listeners.get(&inode).map_or(&[][..], |l| &l.owners) {
                if alive(&self.known, &(pid, start)) {
                    let r = relays.entry(pid).or_insert(rule);
                    *r = (*r).min(rule);
                }
            }
        }
        Ok(relays)
    }

    /// The targets from the classified processes and the port relays, by pid; relays that
    /// descend from a relay are left out.
    fn collect_targets(&self, port_relays: &HashMap<u32, usize>) -> Vec<Target> {
        let relay_rule = |pid: u32, k: &Known| {
            let named = match k.class {
                Class::NamedRelay(i) => Some(i),
                _ => None,
            };
            match (named, port_relays.get(&pid).copied()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            }
        };
        let mut targets: Vec<Target> = self
            .known
            .iter()
            .filter_map(|(&pid, k)| {
                let (kind, name) = match &k.class {
                    Class::Server(kind, name) => (TargetKind::SpiceServer(*kind), name.clone()),
                    Class::XorgCandidate(_) => return None,
                    Class::Other | Class::NamedRelay(_) => {
                        let rule = relay_rule(pid, k)?;
                        // A descendant of a relay is part of that relay.
                        let mut ancestor = k.ppid;
                        for _ in 0..MAX_DEPTH {
                            let Some(a) = self.known.get(&ancestor) else {
                                break;
                            };
                            if relay_rule(ancestor, a).is_some() {
                                return None;
                            }
                            ancestor = a.ppid;
                        }
                        let label = self.rules[rule].label();
                        (
                            TargetKind::Relay {
                                rule: label.clone(),
                            },
                            label,
                        )
                    }
                };
                Some(Target {
                    pid,
                    start_time: k.start_time,
                    kind,
                    name,
                    comm: k.comm.clone(),
                })
            })
            .collect();
        targets.sort_by_key(|t| t.pid);
        targets
    }
}

/// The process (or the file) disappeared: `ENOENT`, or `ESRCH` from a task being torn down.
fn gone(e: &std::io::Error) -> bool {
    e.kind() == ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(line: &str) -> Vec<String> {
        line.split(' ').map(str::to_owned).collect()
    }

    /// A libvirt 9 / QEMU 7.2 command line (shortened), as /proc/PID/cmdline gives it.
    const LIBVIRT: &str = "/usr/bin/qemu-system-x86_64 -name guest=win10-desk,debug-threads=on \
        -S -object {\"qom-type\":\"secret\",\"id\":\"masterKey0\"} \
        -machine pc-q35-7.2,usb=off,dump-guest-core=off -accel kvm -cpu host -m 4096 \
        -uuid 7c2b3f0e-5b1a-4d2e-9f3c-2a1b0c9d8e7f -no-user-config -nodefaults \
        -spice port=5901,addr=127.0.0.1,disable-ticketing=on,seamless-migration=on \
        -device {\"driver\":\"qxl-vga\",\"id\":\"video0\"} -msg timestamp=on";

    #[test]
    fn discovery_parse_stat() {
        let raw = b"4242 (qemu-system-x86) S 1 4242 4242 0 -1 4194560 1024 0 0 0 \
            50 20 0 0 20 0 9 0 123456 1000000 500 18446744073709551615 1 1 0 0 0 0 0 \
            4096 0 0 0 0 17 1 0 0 0 0 0\n";
        let s = parse_stat(raw).unwrap();
        assert_eq!(s.comm, "qemu-system-x86");
        assert_eq!(s.state, b'S');
        assert_eq!(s.ppid, 1);
        assert_eq!(s.flags, 4194560);
        assert_eq!(s.start_time, 123456);
        // comm with spaces and parentheses
        let raw = b"7 (a) b (c)) Z 3 0 0 0 -1 2097152 0 0 0 0 0 0 0 0 20 0 1 0 99 0 0";
        let s = parse_stat(raw).unwrap();
        assert_eq!(s.comm, "a) b (c)");
        assert_eq!(s.state, b'Z');
        assert_eq!(s.flags & PF_KTHREAD, PF_KTHREAD);
        assert_eq!(s.start_time, 99);
        assert_eq!(parse_stat(b"7 (x) S 1 2 3"), None);
        assert_eq!(parse_stat(b""), None);
        // our own stat parses, and its ppid is our parent
        let own = std::fs::read("/proc/self/stat").unwrap();
        let s = parse_stat(&own).unwrap();
        assert_eq!(s.ppid, std::os::unix::process::parent_id());
        assert_eq!(s.flags & PF_KTHREAD, 0);
    }

    #[test]
    fn discovery_parse_cmdline() {
        assert_eq!(
            parse_cmdline(b"socat\0-d\0TCP-LISTEN:1\0"),
            ["socat", "-d", "TCP-LISTEN:1"]
        );
        assert_eq!(parse_cmdline(b"a\0\0b\0"), ["a", "", "b"]);
        assert!(parse_cmdline(b"").is_empty());
    }

    #[test]
    fn discovery_qemu_libvirt() {
        let a = argv(LIBVIRT);
        assert!(is_qemu_program("qemu-system-x86", &a));
        assert!(qemu_has_spice(&a));
        assert_eq!(qemu_vm_name(&a).as_deref(), Some("win10-desk"));
        assert_eq!(qemu_target_name(1, &a), "win10-desk");
    }

    #[test]
    fn discovery_qemu_names() {
        let name = |line: &str| qemu_target_name(77, &argv(line));
        assert_eq!(name("qemu-system-x86_64 -name vm2 -spice port=5900"), "vm2");
        assert_eq!(
            name("qemu-system-x86_64 -name vm3,debug-threads=on -spice port=5900"),
            "vm3"
        );
        assert_eq!(
            name("qemu-system-x86_64 -name debug-threads=on,guest=vm4 -spice port=5900"),
            "vm4"
        );
        assert_eq!(
            name("qemu-system-x86_64 --name vm5 --spice port=5900"),
            "vm5"
        );
        // ",," is an escaped comma in QemuOpts
        assert_eq!(
            name("qemu-system-x86_64 -name guest=a,,b,process=qemu:a -spice port=5900"),
            "a,b"
        );
        // the last -name wins
        assert_eq!(
            name("qemu-kvm -name first -name guest=second -spice x"),
            "second"
        );
        assert_eq!(
            name("qemu-kvm -uuid 1a2b3c4d-0000-4000-8000-0123456789ab -spice port=5900"),
            "1a2b3c4d-0000-4000-8000-0123456789ab"
        );
        // -name without guest falls back to the uuid, then the pid
        assert_eq!(
            name("qemu-kvm -name debug-threads=on -uuid U -spice x"),
            "U"
        );
        assert_eq!(name("qemu-system-aarch64 -spice port=5900"), "pid-77");
        assert_eq!(name("qemu-system-x86_64 -name"), "pid-77");
        // whitespace and length are bounded
        assert_eq!(name("kvm -name guest=my\tvm -spice x"), "my_vm");
        let long = "x".repeat(300);
        assert_eq!(
            name(&format!("kvm -name {long} -spice x")).chars().count(),
            NAME_MAX
        );
        assert_eq!(label_value(""), None);
        assert_eq!(label_value("vm-é").as_deref(), Some("vm-é"));
    }

    #[test]
    fn discovery_qemu_spice_options() {
        let spice = |line: &str| {
            let a = argv(line);
            is_qemu_program("x", &a) && qemu_has_spice(&a)
        };
        assert!(spice(
            "qemu-system-x86_64 -spice port=5900,disable-ticketing=on"
        ));
        assert!(spice(
            "qemu-system-x86_64 -spice tls-port=5901,x509-dir=/etc/pki/qemu"
        ));
        assert!(spice(
            "qemu-system-x86_64 -spice unix=on,addr=/run/vm1.sock,disable-ticketing=on"
        ));
        assert!(spice("/usr/libexec/qemu-kvm -spice port=5900"));
        assert!(spice(
            "/usr/bin/kvm -id 100 -name vm100 -spice tls-port=61000,addr=127.0.0.1"
        ));
        assert!(spice("qemu-system-x86_64 --spice port=5900"));
        assert!(spice("qemu-system-x86_64 -display spice-app,gl=on"));
        assert!(!spice("qemu-system-x86_64 -display gtk -vnc :1"));
        assert!(!spice("qemu-system-x86_64 -display sdl"));
        // "-spice" inside another option's value is not the option
        assert!(!spice(
            "qemu-system-x86_64 -append console=ttyS0,-spice -vnc :0"
        ));
        // not QEMU: another program with -spice in its arguments
        let a = argv("/usr/bin/remote-viewer -spice port=5900");
        assert!(!is_qemu_program("remote-viewer", &a));
        // comm cut to 15 bytes, argv[0] rewritten
        assert!(is_qemu_program(
            "qemu-system-aar",
            &argv("qemu:vm1 -spice x")
        ));
        // `exec -a qemu-system-x86_64 sleep …`: comm is sleep, argv[0] says qemu
        assert!(is_qemu_program(
            "sleep",
            &argv("qemu-system-x86_64 30 -spice port=5999")
        ));
    }

    #[test]
    fn discovery_xorg() {
        let a = argv(
            "/usr/lib/xorg/Xorg -config /tmp/rig/xorg.conf -noreset :70 -nolisten tcp \
             -logfile /tmp/rig/xorg.log",
        );
        assert!(is_xorg_program("Xorg", &a));
        assert_eq!(xorg_display(&a), Some(70));
        assert_eq!(xspice_target_name(9, &a), "xspice-70");
        assert_eq!(xspice_target_name(9, &argv("Xorg -noreset")), "pid-9");
        // The /usr/bin/Xspice wrapper is a Python script: not an Xorg.
        let w = argv("/usr/bin/python3 /usr/bin/Xspice --port 5900 :1");
        assert!(!is_xorg_program("Xspice", &w));
        assert!(is_xorg_program("X", &argv("/usr/bin/X :0")));

        assert!(maps_line_is_spice(
            "7f1c2a000000-7f1c2a0b4000 r-xp 00020000 fe:01 1234 \
             /usr/lib/x86_64-linux-gnu/libspice-server.so.1.14.2\n"
        ));
        assert!(maps_line_is_spice(
            "7f1c2b000000-7f1c2b010000 r--p 00000000 fe:01 99 \
             /usr/lib/xorg/modules/drivers/spiceqxl_drv.so\n"
        ));
        assert!(!maps_line_is_spice(
            "7f1c2b000000-7f1c2b010000 r--p 00000000 fe:01 99 /usr/lib/xorg/modules/libfb.so\n"
        ));
        assert!(!maps_line_is_spice(
            "7ffd1000-7ffd2000 rw-p 00000000 00:00 0\n"
        ));
        assert!(!maps_line_is_spice(
            "7ffd1000-7ffd2000 rw-p 00000000 00:00 0 [stack]\n"
        ));
    }

    #[test]
    fn discovery_relay_names() {
        let m = |name: &str, comm: &str, line: &str| relay_name_matches(name, comm, &argv(line));
        assert!(m(
            "socat",
            "socat",
            "socat -d TCP-LISTEN:6900,fork TCP:127.0.0.1:5900"
        ));
        assert!(m(
            "haproxy",
            "haproxy",
            "/usr/sbin/haproxy -db -f /tmp/r.cfg"
        ));
        assert!(!m(
            "socat",
            "haproxy",
            "/usr/sbin/haproxy -db -f /tmp/socat.cfg"
        ));
        // shebang scripts: comm is the script's name, argv[0] the interpreter
        assert!(m(
            "websockify",
            "websockify",
            "/usr/bin/python3 /usr/bin/websockify 6080 :5900"
        ));
        assert!(m("spiceproxy", "spiceproxy", "spiceproxy"));
        // Python relays started through the interpreter
        assert!(m(
            "kerbside",
            "python3",
            "/usr/bin/python3 /usr/bin/kerbside --config x"
        ));
        assert!(m(
            "kerbside",
            "python3.11",
            "python3.11 -u -X dev kerbside.py"
        ));
        assert!(m("kerbside", "python3", "python3 -m kerbside"));
        assert!(m("kerbside", "python3", "python3 -mkerbside"));
        assert!(m(
            "mangle-relay",
            "python3",
            "/usr/bin/python3 rig/mangle-relay.py --listen x"
        ));
        assert!(!m("kerbside", "python3", "python3 -c import kerbside"));
        assert!(!m(
            "kerbside",
            "python3",
            "python3 -W ignore other.py kerbside"
        ));
        assert!(!m("kerbside", "bash", "bash kerbside"));
        // comm is cut to 15 bytes
        assert!(m("a-very-long-relay-name", "a-very-long-rel", "/opt/bin/x"));
        assert!(m(
            "a-very-long-relay-name",
            "x",
            "/opt/bin/a-very-long-relay-name"
        ));
        assert_eq!(
            python_script("python3", &argv("python3 -B -- /srv/relay.py")),
            Some("relay.py")
        );
        assert_eq!(python_script("node", &argv("node relay.js")), None);
    }

    fn target(pid: u32, start: u64, name: &str) -> Target {
        Target {
            pid,
            start_time: start,
            kind: TargetKind::SpiceServer(ServerKind::Qemu),
            name: name.to_owned(),
            comm: "qemu-system-x86".to_owned(),
        }
    }

    #[test]
    fn discovery_diff() {
        let a = target(10, 100, "a");
        let b = target(20, 200, "b");
        let c = target(30, 300, "c");
        let d = diff(&[a.clone(), b.clone()], &[b, c.clone()]);
        assert_eq!(d.started, [c]);
        assert_eq!(d.exited, std::slice::from_ref(&a));
        let one = std::slice::from_ref(&a);
        assert!(diff(one, one).is_empty());
        // pid reuse: same pid, new start time
        let a2 = target(10, 150, "a");
        let d = diff(one, std::slice::from_ref(&a2));
        assert_eq!((d.started, d.exited), (vec![a2], vec![a.clone()]));
        // same process, new name: exited and started
        let a3 = target(10, 100, "renamed");
        let d = diff(one, std::slice::from_ref(&a3));
        assert_eq!((d.started, d.exited), (vec![a3], vec![a.clone()]));
        // comm alone changing is not a change of target
        let mut a4 = a.clone();
        a4.comm = "qemu:a".into();
        assert!(diff(&[a], &[a4]).is_empty());
    }

    /// A scan of this machine's /proc runs, and finds our own process as a relay by name and
    /// (with a listener) by port; nothing else here is a target.
    #[test]
    fn discovery_scan_self() {
        let me = std::process::id();
        let own_comm = crate::sockdiag::comm(me).unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let config = DiscoveryConfig {
            qemu: true,
            xspice: true,
            relays: vec![
                RelayRule {
                    name: None,
                    port: Some(port),
                },
                RelayRule {
                    name: Some(own_comm.clone()),
                    port: None,
                },
            ],
        };
        let mut d = Discovery::new(&config);
        let first = d.scan().unwrap();
        assert!(first.stats.processes > 1, "{:?}", first.stats);
        assert_eq!(first.stats.fd_walks, 1, "{:?}", first.stats);
        let mine: Vec<&Target> = first.targets.iter().filter(|t| t.pid == me).collect();
        assert_eq!(mine.len(), 1, "{:?}", first.targets);
        // port rule comes first in the config
        assert_eq!(
            mine[0].kind,
            TargetKind::Relay {
                rule: format!("port-{port}")
            }
        );
        assert_eq!(mine[0].comm, own_comm);
        assert_eq!(first.diff.started, first.targets);
        assert!(first.diff.exited.is_empty());

        let second = d.scan().unwrap();
        assert_eq!(second.targets, first.targets);
        assert!(second.diff.is_empty(), "{:?}", second.diff);
        assert_eq!(second.stats.fd_walks, 0, "owners known: {:?}", second.stats);

        drop(listener);
        let third = d.scan().unwrap();
        let mine: Vec<&Target> = third.targets.iter().filter(|t| t.pid == me).collect();
        assert_eq!(
            mine.iter().map(|t| &t.kind).collect::<Vec<_>>(),
            [&TargetKind::Relay {
                rule: own_comm.clone()
            }],
            "without the listener, the name rule"
        );
        // (other processes with our comm, e.g. other test runs, may come and go meanwhile)
        let started: Vec<&Target> = third.diff.started.iter().filter(|t| t.pid == me).collect();
        let exited: Vec<&Target> = third.diff.exited.iter().filter(|t| t.pid == me).collect();
        assert_eq!(started, mine, "{:?}", third.diff);
        assert_eq!(exited.len(), 1, "{:?}", third.diff);
        assert_eq!(
            exited[0].kind,
            TargetKind::Relay {
                rule: format!("port-{port}")
            }
        );

        // An IPv6 listener is found by its port too.
        let Ok(listener6) = std::net::TcpListener::bind("[::1]:0") else {
            eprintln!("no IPv6 loopback: IPv6 port rule not checked");
            return;
        };
        let port6 = listener6.local_addr().unwrap().port();
        let mut d6 = Discovery::new(&DiscoveryConfig {
            relays: vec![RelayRule {
                name: None,
                port: Some(port6),
            }],
            ..DiscoveryConfig::default()
        });
        let scan6 = d6.scan().unwrap();
        let mine6: Vec<&Target> = scan6.targets.iter().filter(|t| t.pid == me).collect();
        assert_eq!(mine6.len(), 1, "{:?}", scan6.targets);
        assert_eq!(
            mine6[0].kind,
            TargetKind::Relay {
                rule: format!("port-{port6}")
            }
        );
    }
}
