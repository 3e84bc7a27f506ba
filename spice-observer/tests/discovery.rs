//! Host target discovery ([`spice_observer::host::discovery`]) against real processes: a real
//! Xspice (rig/start-xspice.sh), real socat relays (rig/relay.sh), stand-ins for QEMU
//! (`discovery_real_processes`), a real paused QEMU (`discovery_real_qemu`); and the cost of a
//! scan on a host with ~1000 processes (`discovery_scan_cost`, prints the numbers).
//!
//! The first two start Xorg / QEMU and bind fixed ports (5970, 6970, 6971, 5996; display :70):
//! run them under the machine-wide lock, as root (they read other users' `/proc/PID/maps` and
//! `/proc/PID/fd`):
//!
//! ```text
//! flock /tmp/spice-observer-priv.lock cargo test -p spice-observer --test discovery -- --test-threads=1 --nocapture
//! ```
//!
//! Without root (or without a prepared QEMU) they skip, loudly; under `CI=true` they fail
//! instead. They load no BPF program and run no observer, so there is no report for
//! `common::check_run`.

mod common;

use std::collections::HashSet;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::TcpStream;
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use common::{Rig, rig, sh};
use spice_observer::config::{DiscoveryConfig, RelayRule};
use spice_observer::host::discovery::{
    Discovery, EXEC_WINDOW, Scan, ServerKind, Target, TargetKind,
};
use spice_observer::sockdiag;

/// True if the test may run (root); otherwise prints why and the test returns, or under
/// `CI=true` fails ([`common::cannot_run`]).
fn root_or_skip(test: &str) -> bool {
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    let msg = common::cannot_run(
        test,
        "needs root (it starts Xorg and reads other users' /proc/PID/maps and fd)",
    );
    assert!(!common::ci(), "{msg}");
    eprintln!("{msg}");
    false
}

/// Children killed (and reaped) when dropped, so a failing assertion leaves nothing behind.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
        }
        for c in &mut self.0 {
            let _ = c.wait();
        }
    }
}

/// A process whose command line looks like QEMU's: `argv[0]` is `qemu-system-x86_64` and the
/// arguments are QEMU options, but the program is a Python interpreter that sleeps
/// (`python3 -c 'import time; time.sleep(60)' ARGS…` leaves ARGS alone; `sleep` would reject
/// `-name`). This stands in for QEMU because discovery reads nothing but `/proc/PID/stat`
/// (comm `python3` here, `qemu-system-x86` for a real QEMU; the match is on `comm` or
/// `argv[0]`) and `/proc/PID/cmdline`, which is exactly what QEMU's would be; it never talks
/// to the process. Starting, exiting and exec'ing several of them is instant, which the
/// timing checks need; `discovery_real_qemu` checks one real QEMU.
fn fake_qemu(args: &[&str]) -> Result<Child> {
    Command::new("/usr/bin/python3")
        .arg0("qemu-system-x86_64")
        .args(["-c", "import time; time.sleep(60)"])
        .args(args)
        .stdin(Stdio::null())
        .spawn()
        .context("starting the fake qemu")
}

fn find(scan: &Scan, pid: u32) -> Vec<&Target> {
    scan.targets.iter().filter(|t| t.pid == pid).collect()
}

fn pids(targets: &[Target]) -> HashSet<u32> {
    targets.iter().map(|t| t.pid).collect()
}

/// `TCP_LISTEN` (`include/net/tcp_states.h`), as in [`sockdiag::DiagSocket::state`].
const TCP_LISTEN: u8 = 10;

fn relay(rule: &str) -> TargetKind {
    TargetKind::Relay {
        rule: rule.to_owned(),
    }
}

#[test]
fn discovery_real_processes() -> Result<()> {
    if !root_or_skip("discovery_real_processes") {
        return Ok(());
    }
    let mut setup = Rig::new("discovery")?;
    let mut children = Children(Vec::new());

    // Real Xspice: the server is the Xorg that start-xspice.sh wrote to Xorg.pid.
    let xorg = setup.xspice(
        5970,
        70,
        &["--mode", "rects", "--fps", "10", "--count", "5"],
    )?;
    // Relay A on 6970 (found by its port), relay B on 6971 (found by its name).
    let relay_a = setup.relay("socat", "127.0.0.1", 6970, "127.0.0.1", 5970)?;
    let relay_b = setup.relay("socat", "127.0.0.1", 6971, "127.0.0.1", 5970)?;
    // A connection through A, so that socat forks its per-connection child.
    let conn = TcpStream::connect("127.0.0.1:6970")?;
    let deadline = Instant::now() + Duration::from_secs(5);
    let relay_child = loop {
        let kids = sockdiag::descendants(relay_a);
        if let Some(&k) = kids.first() {
            break k;
        }
        ensure!(
            Instant::now() < deadline,
            "socat did not fork for the connection"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    ensure!(
        sockdiag::comm(relay_child).as_deref() == Some("socat"),
        "relay child {relay_child} is {:?}",
        sockdiag::comm(relay_child)
    );

    children.0.push(fake_qemu(&[
        "-name",
        "guest=vm1,debug-threads=on",
        "-uuid",
        "0e7c7f5e-8d2e-4b1f-9a3c-5d6e7f8a9b0c",
        "-spice",
        "port=5999,addr=127.0.0.1,disable-ticketing=on",
    ])?);
    let vm1 = children.0[0].id();
    // A QEMU without SPICE (VNC only): not a target.
    children
        .0
        .push(fake_qemu(&["-name", "guest=vnc-only", "-vnc", ":99"])?);
    let vnc_only = children.0[1].id();

    let mut discovery = Discovery::new(&DiscoveryConfig {
        qemu: true,
        xspice: true,
        relays: vec![
            RelayRule {
                name: None,
                port: Some(6970),
            },
            RelayRule {
                name: Some("socat".into()),
                port: None,
            },
        ],
    });
    let first = discovery.scan()?;
    eprintln!("first scan: {:?}", first.stats);
    for t in &first.targets {
        eprintln!("  {t:?}");
    }

    let x = find(&first, xorg);
    ensure!(
        x.len() == 1,
        "Xorg {xorg} not found once: {:?}",
        first.targets
    );
    ensure!(
        x[0].kind == TargetKind::SpiceServer(ServerKind::Xspice),
        "{:?}",
        x[0]
    );
    ensure!(x[0].name == "xspice-70", "{:?}", x[0]);
    ensure!(x[0].comm == "Xorg", "{:?}", x[0]);
    let xspice_targets: Vec<&Target> = first
        .targets
        .iter()
        .filter(|t| t.name == "xspice-70")
        .collect();
    ensure!(
        xspice_targets.len() == 1,
        "the xanim client or anything else is not a server: {xspice_targets:?}"
    );

    let a = find(&first, relay_a);
    ensure!(
        a.len() == 1 && a[0].kind == relay("port-6970") && a[0].comm == "socat",
        "relay A {relay_a}: {a:?}"
    );
    let b = find(&first, relay_b);
    ensure!(
        b.len() == 1 && b[0].kind == relay("socat") && b[0].name == "socat",
        "relay B {relay_b}: {b:?}"
    );
    ensure!(
        find(&first, relay_child).is_empty(),
        "socat's per-connection child {relay_child} is part of relay A, not a target: {:?}",
        first.targets
    );

    let q = find(&first, vm1);
    ensure!(
        q.len() == 1
            && q[0].kind == TargetKind::SpiceServer(ServerKind::Qemu)
            && q[0].name == "vm1",
        "fake qemu {vm1}: {q:?}"
    );
    ensure!(
        find(&first, vnc_only).is_empty(),
        "qemu without -spice is not a target"
    );
    ensure!(pids(&first.diff.started) == pids(&first.targets));
    ensure!(first.diff.exited.is_empty());

    // Nothing changed: same targets, nothing re-read.
    let second = discovery.scan()?;
    eprintln!("second scan: {:?}", second.stats);
    ensure!(second.targets == first.targets, "{:?}", second.targets);
    ensure!(second.diff.is_empty(), "{:?}", second.diff);
    ensure!(
        second.stats.maps_read == 0 && second.stats.fd_walks == 0,
        "{:?}",
        second.stats
    );

    // A QEMU started now is in the very next scan.
    children.0.push(fake_qemu(&[
        "-name",
        "vm2,debug-threads=on",
        "-spice",
        "unix=on,addr=/run/vm2.sock",
    ])?);
    let vm2 = children.0[2].id();
    let t0 = Instant::now();
    let third = discovery.scan()?;
    eprintln!(
        "third scan ({:?} after the start): {:?}",
        t0.elapsed(),
        third.stats
    );
    let started: Vec<&Target> = third.diff.started.iter().collect();
    ensure!(
        started.len() == 1
            && started[0].pid == vm2
            && started[0].name == "vm2"
            && started[0].kind == TargetKind::SpiceServer(ServerKind::Qemu),
        "vm2 {vm2} started: {:?}",
        third.diff
    );
    ensure!(third.diff.exited.is_empty(), "{:?}", third.diff);

    // A process seen before it execs QEMU (libvirt forks, prepares, then execs): found once
    // it has exec'd, under the same pid and start time.
    let mut shell = Command::new("/bin/bash")
        .args([
            "-c",
            "read go; exec -a qemu-system-x86_64 /usr/bin/python3 -c 'import time; \
             time.sleep(60)' -name guest=vm3 -spice port=5998",
        ])
        .stdin(Stdio::piped())
        .spawn()?;
    let vm3 = shell.id();
    let mut go = shell.stdin.take().context("bash stdin")?;
    children.0.push(shell);
    let before_exec = discovery.scan()?;
    ensure!(
        find(&before_exec, vm3).is_empty() && before_exec.diff.is_empty(),
        "bash {vm3} before its exec is no target: {:?}",
        before_exec.diff
    );
    go.write_all(b"go\n")?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while sockdiag::comm(vm3).as_deref() != Some("python3") {
        ensure!(Instant::now() < deadline, "bash {vm3} did not exec");
        std::thread::sleep(Duration::from_millis(10));
    }
    let after_exec = discovery.scan()?;
    ensure!(
        after_exec.diff.started.len() == 1
            && after_exec.diff.started[0].pid == vm3
            && after_exec.diff.started[0].name == "vm3"
            && after_exec.diff.exited.is_empty(),
        "vm3 {vm3} found after its exec: {:?}",
        after_exec.diff
    );

    // vm1 killed but not reaped yet (a zombie): exited.
    unsafe { libc::kill(vm1 as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !std::fs::read_to_string(format!("/proc/{vm1}/stat"))?.contains(") Z ") {
        ensure!(
            Instant::now() < deadline,
            "vm1 {vm1} did not become a zombie"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let fourth = discovery.scan()?;
    ensure!(
        pids(&fourth.diff.exited) == HashSet::from([vm1]) && fourth.diff.started.is_empty(),
        "vm1 {vm1} exited (zombie): {:?}",
        fourth.diff
    );
    children.0[0].wait()?;

    // Stop Xspice and relay A: both reported exited. The relay's child goes with the
    // connection (rig/relay.sh stop signals socat's process group).
    drop(conn);
    sh(Command::new(rig().join("start-xspice.sh"))
        .env("RIG_RUN", setup.state.join("xspice-5970"))
        .args(["stop", "5970"]))?;
    sh(Command::new(rig().join("relay.sh"))
        .arg("stop")
        .arg(setup.state.join("relay-6970.pid")))?;
    let fifth = discovery.scan()?;
    eprintln!("fifth scan: {:?} diff {:?}", fifth.stats, fifth.diff);
    ensure!(
        pids(&fifth.diff.exited) == HashSet::from([xorg, relay_a]),
        "Xorg {xorg} and relay A {relay_a} exited: {:?}",
        fifth.diff
    );
    ensure!(fifth.diff.started.is_empty(), "{:?}", fifth.diff);
    ensure!(!find(&fifth, relay_b).is_empty() && !find(&fifth, vm2).is_empty());

    drop(children);
    let sixth = discovery.scan()?;
    ensure!(
        pids(&sixth.diff.exited) == HashSet::from([vm2, vm3]),
        "{:?}",
        sixth.diff
    );
    drop(setup);
    Ok(())
}

/// The cost of a scan with ~1000 processes on the host: `sleep` children fill up the
/// process table; prints the numbers. Not privileged (only our own children are added).
#[test]
fn discovery_scan_cost() -> Result<()> {
    const HOST_PROCESSES: usize = 1000;
    const STEADY_SCANS: u32 = 20;
    let before = std::fs::read_dir("/proc")?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .count();
    let mut sleepers = Children(Vec::new());
    for _ in before..HOST_PROCESSES {
        sleepers.0.push(
            Command::new("sleep")
                .arg("120")
                .stdin(Stdio::null())
                .spawn()?,
        );
    }
    let sleeper_pids: HashSet<u32> = sleepers.0.iter().map(Child::id).collect();
    // A host's processes are mostly old; young ones have their stat re-read at every scan.
    std::thread::sleep(EXEC_WINDOW + Duration::from_secs(1));

    let mut out = String::new();
    for (label, relays, connections) in [
        ("no relay rules", vec![], 0),
        (
            "name rule + port rule, 400 loopback connections open",
            vec![
                RelayRule {
                    name: Some("socat".into()),
                    port: None,
                },
                RelayRule {
                    name: None,
                    port: Some(6900),
                },
            ],
            400,
        ),
    ] {
        // Sockets for the sock_diag dump of the port rules to go through.
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let mut conns = Vec::new();
        for _ in 0..connections {
            conns.push(TcpStream::connect(listener.local_addr()?)?);
            conns.push(listener.accept()?.0);
        }
        let mut d = Discovery::new(&DiscoveryConfig {
            qemu: true,
            xspice: true,
            relays,
        });
        let cold = d.scan()?;
        ensure!(
            cold.stats.processes >= HOST_PROCESSES.min(before + sleeper_pids.len()) - 50,
            "{:?}",
            cold.stats
        );
        ensure!(
            cold.stats.classified >= sleeper_pids.len(),
            "every new sleeper is classified once: {:?}",
            cold.stats
        );
        ensure!(
            cold.targets.iter().all(|t| !sleeper_pids.contains(&t.pid)),
            "sleep is no target"
        );
        let mut total_us = 0;
        let mut worst_us = 0;
        let (mut classified, mut stat_reads) = (0, 0);
        for _ in 0..STEADY_SCANS {
            std::thread::sleep(Duration::from_millis(50));
            let s = d.scan()?;
            total_us += s.stats.elapsed_us;
            worst_us = worst_us.max(s.stats.elapsed_us);
            classified += s.stats.classified;
            stat_reads += s.stats.stat_reads;
            ensure!(s.stats.maps_read == 0, "{:?}", s.stats);
        }
        let mean_us = total_us / u64::from(STEADY_SCANS);
        writeln!(
            out,
            "scan cost, {label}: {} processes; first scan {} us ({} classified); \
             steady state ({STEADY_SCANS} scans 50 ms apart): mean {mean_us} us, worst \
             {worst_us} us, {} stat reads per scan (targets and young processes), \
             {classified} classified in total (processes started meanwhile)",
            cold.stats.processes,
            cold.stats.elapsed_us,
            cold.stats.classified,
            stat_reads / STEADY_SCANS as usize,
        )?;
        drop(conns);
        // Loose bound, so that a regression (re-reading cmdline or maps every scan) shows; the
        // numbers themselves are printed.
        ensure!(mean_us < 100_000, "steady-state scan takes {mean_us} us");
        ensure!(
            stat_reads / (STEADY_SCANS as usize) < cold.stats.processes / 2,
            "old processes are not re-read: {stat_reads} stat reads in {STEADY_SCANS} scans"
        );
    }
    drop(sleepers);
    eprint!("{out}");
    Ok(())
}

/// A real QEMU with SPICE (the rig's QEMU 7.2, `rig/start-qemu.sh prepare`), started paused
/// (`-S`: no guest code runs, so it costs no CPU and needs no kernel image) with the
/// spice-server listening: discovery names it from its real command line and `comm`.
#[test]
fn discovery_real_qemu() -> Result<()> {
    if !root_or_skip("discovery_real_qemu") {
        return Ok(());
    }
    if let Err(e) = sh(Command::new(rig().join("start-qemu.sh")).arg("check")) {
        let msg = common::cannot_run(
            "discovery_real_qemu",
            &format!("QEMU is not prepared (rig/start-qemu.sh prepare): {e:#}"),
        );
        assert!(!common::ci(), "{msg}");
        eprintln!("{msg}");
        return Ok(());
    }
    // Where rig/start-qemu.sh finds QEMU, its modules and firmware (qemu_bin, qemu_env).
    let cache = std::env::var("RIG_QEMU_CACHE").unwrap_or_else(|_| "/var/tmp/rig-qemu".into());
    let system = std::path::Path::new("/usr/bin/qemu-system-x86_64");
    let mut cmd = if system.exists() {
        Command::new(system)
    } else {
        let mut c = Command::new(format!("{cache}/qemu/usr/bin/qemu-system-x86_64"));
        c.env(
            "QEMU_MODULE_DIR",
            format!("{cache}/qemu/usr/lib/x86_64-linux-gnu/qemu"),
        )
        .args(["-L", "/usr/share/seabios", "-L", "/usr/share/qemu"]);
        c
    };
    const PORT: u16 = 5996;
    cmd.args([
        "-name",
        "guest=realvm,debug-threads=on",
        "-uuid",
        "5f0e2a8c-1d3b-4c6e-8a9f-0b1c2d3e4f50",
        "-machine",
        "pc",
        "-accel",
        "tcg",
        "-m",
        "64",
        "-smp",
        "1",
        "-S",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-vga",
        "qxl",
        "-monitor",
        "none",
        "-spice",
    ])
    .arg(format!("port={PORT},addr=127.0.0.1,disable-ticketing=on"))
    .stdin(Stdio::null())
    .stdout(Stdio::null());
    let mut children = Children(vec![cmd.spawn().context("starting qemu")?]);
    let qemu = children.0[0].id();

    // spice-server is up once QEMU listens on the port (sock_diag, pid checked by inode).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let listening: HashSet<u64> = sockdiag::dump_tcp()?
            .into_iter()
            .filter(|s| s.state == TCP_LISTEN && s.local.port() == PORT)
            .map(|s| s.inode)
            .collect();
        if !listening.is_empty() && !listening.is_disjoint(&sockdiag::socket_inodes(qemu)?) {
            break;
        }
        ensure!(
            children.0[0].try_wait()?.is_none(),
            "qemu exited before listening"
        );
        ensure!(
            Instant::now() < deadline,
            "qemu {qemu} does not listen on {PORT}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let mut discovery = Discovery::new(&DiscoveryConfig::default());
    let scan = discovery.scan()?;
    let found = find(&scan, qemu);
    eprintln!("real qemu: {found:?}");
    ensure!(
        found.len() == 1
            && found[0].kind == TargetKind::SpiceServer(ServerKind::Qemu)
            && found[0].name == "realvm"
            && found[0].comm == "qemu-system-x86",
        "real qemu {qemu}: {found:?}"
    );
    ensure!(scan.diff.started.iter().any(|t| t.pid == qemu));

    drop(children);
    let after = discovery.scan()?;
    ensure!(
        after.diff.exited.iter().any(|t| t.pid == qemu) && find(&after, qemu).is_empty(),
        "qemu {qemu} exited: {:?}",
        after.diff
    );
    Ok(())
}
