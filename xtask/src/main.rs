//! Developer commands for spice-observer: `cargo xtask <command>`.
//!
//! * `setup`: install what a fresh machine lacks (Debian packages incl. LLVM 22 and the rig's,
//!   the pinned nightly with rust-src, bpf-linker, the QEMU rig). Idempotent.
//! * `demo`: set up, build, run a real SPICE session (Xspice + animating X client + headless
//!   spice-gtk client through a socat relay), observe it, print the table, clean up.
//! * `test`: set up, then run every test: unit tests, then the privileged tests that load the
//!   BPF programs against real sessions (root required).
//! * `bench`: set up, build release, measure what the observer costs (`bench.rs`; root).
//! * `guest`: the kernel-path tests in QEMU guests on Debian's 6.1 and 6.12 kernels, under
//!   every hook set that loads there; prints the matrix (`guest.rs`; root).

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

mod bench;
mod guest;
mod testlog;

#[derive(Debug, Parser)]
#[command(name = "xtask", about = "spice-observer developer commands")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Install everything a fresh machine lacks (idempotent; fast when done).
    Setup {
        /// Skip the QEMU rig (only the QEMU test needs it).
        #[arg(long)]
        no_qemu: bool,
    },
    /// Run the demo: a real SPICE session observed for a short while.
    Demo {
        /// Seconds to observe.
        #[arg(long, default_value_t = 8)]
        seconds: u32,
        /// Animation: `noise` (big incompressible draws) or `rects` (many small draws).
        #[arg(long, default_value = "rects")]
        mode: String,
    },
    /// Run all tests (unit, then privileged real-session tests; needs root).
    Test {
        /// Only the unit tests (no root, no BPF).
        #[arg(long)]
        unit_only: bool,
        /// Extra arguments for the privileged test run (e.g. a test name filter).
        #[arg(trailing_var_arg = true)]
        filter: Vec<String>,
    },
    /// Benchmarks: what the observer costs, with and without it alternating (root; release
    /// build; about 5 minutes). Exits non-zero if the stress run's counts are not exact.
    Bench {
        /// A short run of the same code paths (~30 s, one repeat, lower stress rate).
        #[arg(long)]
        smoke: bool,
        /// Replace README.md's section between `<!-- bench:begin -->` and
        /// `<!-- bench:end -->` with the results.
        #[arg(long)]
        write_readme: bool,
    },
    /// The kernel-path tests in a QEMU guest (TCG) on Debian's own kernels, under every hook
    /// set that loads there; prints the matrix kernel × hook set (root; about 6 minutes for
    /// 6.1, 7.5 for 6.12). Exits non-zero if a loaded set fails, an expected set does not
    /// load, or `auto` picks another set than expected.
    Guest {
        /// `6.1` (Debian 12's kernel) or `6.12` (Debian 12's linux-6.12); repeat for
        /// both (the default).
        #[arg(long = "kernel", value_name = "SERIES")]
        kernels: Vec<String>,
        /// Run only this hook set (repeat for several; default: every framing set this
        /// version builds). The run then requires only the sets named.
        #[arg(long = "hook-set", value_name = "NAME")]
        hook_sets: Vec<String>,
        /// Run only the tests whose names contain FILTER (the test harness's filter), e.g.
        /// `eagain_starts`.
        #[arg(long, value_name = "FILTER")]
        test: Option<String>,
        /// Instead of the test suites: the benchmarks' per-hook-set pass in each guest
        /// (throughput ratio and kernel time per send call, getppid with and without the
        /// observer), printed as a table per kernel and written to `target/guest/bench.md`.
        #[arg(long)]
        bench: bool,
    },
    /// Inside a guest (`guest --bench`): the per-hook-set benchmark pass with these binaries.
    #[command(hide = true)]
    GuestBench {
        #[arg(long)]
        observer: PathBuf,
        #[arg(long)]
        peer: PathBuf,
    },
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("+ {cmd:?}");
    let status = cmd.status().with_context(|| format!("spawning {cmd:?}"))?;
    check(status, cmd)
}

fn check(status: ExitStatus, cmd: &Command) -> Result<()> {
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn setup(no_qemu: bool) -> Result<()> {
    let mut cmd = Command::new(root().join("scripts/setup.sh"));
    if no_qemu {
        cmd.arg("--no-qemu");
    }
    run(&mut cmd)
}

/// Cargo with ~/.cargo/bin on PATH (bpf-linker lives there).
fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let path = std::env::var("PATH").unwrap_or_default();
    let bin = format!("{home}/.cargo/bin");
    if !path.split(':').any(|p| p == bin) {
        cmd.env("PATH", format!("{bin}:{path}"));
    }
    cmd.current_dir(root());
    cmd
}

/// Children started by the demo, stopped in reverse order on drop.
struct Cleanup(Vec<Command>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        while let Some(mut c) = self.0.pop() {
            let _ = c.stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
    }
}

fn read_pid(path: &Path) -> Result<u32> {
    let s = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    s.trim()
        .parse()
        .with_context(|| format!("pid in {}", path.display()))
}

/// A binary of the release build: `$CARGO_TARGET_DIR` if set (relative to the workspace),
/// else target/.
fn release_bin(name: &str) -> Result<PathBuf> {
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map_or_else(|| root().join("target"), |d| root().join(d));
    let bin = target_dir.join("release").join(name);
    if !bin.exists() {
        bail!("the build left no binary at {}", bin.display());
    }
    Ok(bin)
}

fn bench(smoke: bool, write_readme: bool) -> Result<()> {
    setup(true)?;
    if unsafe { libc_geteuid() } != 0 {
        bail!("the benchmarks load BPF programs and change kernel.bpf_stats_enabled: run as root");
    }
    run(cargo().args(["build", "--release", "-p", "spice-observer"]))?;
    bench::bench(
        &root(),
        release_bin("spice-observer")?,
        release_bin("spice-peer")?,
        smoke,
        write_readme,
    )
}

fn demo(seconds: u32, mode: &str) -> Result<()> {
    let anim: Vec<&str> = match mode {
        "noise" => vec!["--mode", "noise", "--fps", "20", "--size", "256x192"],
        "rects" => vec!["--mode", "rects", "--fps", "50", "--count", "20"],
        other => bail!("unknown --mode {other} (noise or rects)"),
    };
    setup(true)?;
    run(cargo().args(["build", "--release", "-p", "spice-observer"]))?;
    let rig = root().join("rig");
    let observer = release_bin("spice-observer")?;
    let run_dir = std::env::temp_dir().join("spice-observer-demo");
    std::fs::create_dir_all(&run_dir)?;
    let (port, display, relay_port) = (5930u16, 30u32, 6930u16);
    let mut cleanup = Cleanup(Vec::new());

    let xspice_state = run_dir.join("xspice");
    let mut stop_x = Command::new(rig.join("start-xspice.sh"));
    stop_x
        .env("RIG_RUN", &xspice_state)
        .args(["stop", &port.to_string()]);
    cleanup.0.push(stop_x);
    run(Command::new(rig.join("start-xspice.sh"))
        .env("RIG_RUN", &xspice_state)
        .args(["start", &port.to_string(), &display.to_string(), "--"])
        .args(&anim))?;
    let xorg = read_pid(&xspice_state.join("Xorg.pid"))?;

    let relay_pidfile = run_dir.join("relay.pid");
    let mut stop_relay = Command::new(rig.join("relay.sh"));
    stop_relay.arg("stop").arg(&relay_pidfile);
    cleanup.0.push(stop_relay);
    run(Command::new(rig.join("relay.sh"))
        .args([
            "socat",
            "127.0.0.1",
            &relay_port.to_string(),
            "127.0.0.1",
            &port.to_string(),
        ])
        .arg(&relay_pidfile))?;
    let relay = read_pid(&relay_pidfile)?;

    // Observer first, so it sees every channel's link phase.
    let mut obs: Child = Command::new(&observer)
        .args([
            "observe",
            "--pid",
            &xorg.to_string(),
            "--pid",
            &relay.to_string(),
        ])
        .args(["--duration", &seconds.to_string()])
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", observer.display()))?;
    // The client only once the observer says it is attached (`spice-observer: watching …`):
    // a fixed wait let the client connect first on a loaded machine, and the demo then
    // joined every channel mid-stream. Its stderr is passed through meanwhile.
    let (attached_tx, attached) = std::sync::mpsc::channel();
    let err = obs.stderr.take().expect("piped stderr");
    thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            eprintln!("{line}");
            if line.starts_with("spice-observer: watching") {
                let _ = attached_tx.send(());
            }
        }
    });
    if attached.recv_timeout(Duration::from_secs(60)).is_err() {
        let _ = obs.kill();
        bail!(
            "spice-observer did not attach within 60 s ({})",
            match obs.wait() {
                Ok(s) => s.to_string(),
                Err(e) => e.to_string(),
            }
        );
    }
    let mut client = Command::new("/usr/bin/python3")
        .arg(rig.join("client.py"))
        .arg(format!("spice://127.0.0.1:{relay_port}"))
        .args(["--seconds", &(seconds + 4).to_string(), "--report", "100"])
        .stdout(Stdio::null())
        .spawn()
        .context("starting the spice-gtk client")?;
    let t0 = Instant::now();
    let status = obs.wait()?;
    let _ = client.kill();
    let _ = client.wait();
    drop(cleanup);
    eprintln!("demo finished in {:.1} s", t0.elapsed().as_secs_f64());
    if !status.success() {
        bail!("spice-observer failed: {status}");
    }
    Ok(())
}

fn test(unit_only: bool, filter: &[String]) -> Result<()> {
    setup(unit_only)?;
    // Unit tests: pure logic, no privileges (the kernel crate only builds for BPF).
    run(cargo().args([
        "test",
        "--workspace",
        "--exclude",
        "spice-ebpf",
        "--exclude",
        "spice-observer",
    ]))?;
    run(cargo().args(["test", "-p", "spice-observer", "--lib", "--bins"]))?;
    if unit_only {
        return Ok(());
    }
    if unsafe { libc_geteuid() } != 0 {
        bail!(
            "the privileged tests load BPF programs and need root; run as root or pass --unit-only"
        );
    }
    // Privileged tests: real processes, real BPF; serial (they share ports and the kernel).
    let mut cmd = cargo();
    // A failing test prints its error, not anyhow's backtrace of the test harness (set
    // RUST_LIB_BACKTRACE=1 to get it back): the message is what a CI log's tail must show.
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        cmd.env("RUST_LIB_BACKTRACE", "0");
    }
    cmd.args([
        "test",
        "-p",
        "spice-observer",
        "--test",
        "*",
        "--",
        "--test-threads=1",
        "--nocapture",
    ]);
    cmd.args(filter);
    testlog::run_summarized(&mut cmd)
}

unsafe extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Setup { no_qemu } => setup(no_qemu),
        Cmd::Demo { seconds, mode } => demo(seconds, &mode),
        Cmd::Test { unit_only, filter } => test(unit_only, filter.as_slice()),
        Cmd::Bench {
            smoke,
            write_readme,
        } => bench(smoke, write_readme),
        Cmd::Guest {
            kernels,
            hook_sets,
            test,
            bench,
        } => {
            setup(false)?;
            guest::guest(&root(), &kernels, &hook_sets, test.as_deref(), bench)
        }
        Cmd::GuestBench { observer, peer } => bench::guest_sets(observer, peer),
    }
}
