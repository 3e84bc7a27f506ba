//! `cargo xtask guest [--kernel 6.1|6.12]…`: the kernel-path tests on Debian's own kernels, in
//! a QEMU guest (TCG), under every hook set that loads there; prints the matrix kernel × hook
//! set → pass / fail / refused / absent.
//!
//! * Kernels: Debian 12's `linux-image-amd64` (6.1, without the `sock_send_length` /
//!   `sock_recv_length` tracepoints of Linux 6.3) and the newest `linux-image-6.12.*+deb12-amd64`
//!   that Debian 12 offers (source package linux-6.12, in bookworm-security), fetched with
//!   `apt-get download` into [`CACHE`] and kept there.
//! * The guest: `-accel tcg -smp 2 -m 2048`, no network device (loopback only), the kernel's
//!   serial console on stdio. Its initramfs holds busybox, bpftool, the release
//!   `spice-observer` and `spice-peer`, the release test binaries of `tests/kernel_paths.rs`
//!   and `tests/selftest.rs` (at the host paths their `CARGO_BIN_EXE_*` point to), and the
//!   host's copies of the libraries they link. Its `/init` mounts proc, sys, dev, bpffs,
//!   tracefs, cgroup2 and a tmpfs on /run, brings up `lo`, runs `spice-observer doctor --json`, then for
//!   each hook set doctor says loads, both test binaries with `CI=true` and
//!   `SPICE_OBSERVER_HOOK_SET` set (the tests then expect that set in every report), and
//!   `observe` with no `--hook-set` for the automatic choice.
//! * The result: every line the guest prints starting with `guest-matrix:` is parsed; the
//!   whole console log is kept in `target/guest/<kernel>.log`.
//!
//! It fails when a hook set that loaded fails a test, when a set this project expects on a
//! kernel does not load there (6.1: `fentry`, `kprobes`, `syscalls`; 6.12: all four), when
//! `auto` picks another set than the cheapest expected there (6.1: `fentry`; 6.12:
//! `tracepoints`), or when the guest does not finish.
//!
//! For work on one case: `--hook-set NAME` (repeatable) runs only those sets, `--test FILTER`
//! only the tests whose names contain FILTER, and `SPICE_OBSERVER_GUEST_TRACE=1` prints the
//! kernel's trace buffer (`bpf_printk` output) after each suite.

use std::{
    collections::BTreeMap,
    fs,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

/// Downloaded kernel packages and their extracted images.
pub(crate) const CACHE: &str = "/var/tmp/spice-observer-guest";
/// The rig's private QEMU (`rig/start-qemu.sh prepare`).
const RIG_QEMU: &str = "/var/tmp/rig-qemu/qemu";
/// How long one guest may run (boot, doctor, both suites under each hook set).
const GUEST_TIMEOUT: Duration = Duration::from_secs(25 * 60);
/// The framing hook sets this version builds, in `auto`'s order (cheapest first).
const HOOK_SETS: [&str; 4] = ["tracepoints", "fentry", "kprobes", "syscalls"];
/// Tests that cannot run in the guest: it re-runs a test as `nobody` through setpriv, which
/// the initramfs lacks (it checks the test harness, not a kernel path).
const SKIPPED: [&str; 1] = ["ci_true_turns_a_skip_into_a_failure"];

/// One Debian kernel of the matrix.
#[derive(Clone, Debug)]
pub(crate) struct Kernel {
    /// `6.1` or `6.12`.
    pub(crate) series: &'static str,
    /// The package (`linux-image-6.1.0-57-amd64`).
    pub(crate) package: String,
    /// The hook sets that must load and pass there.
    pub(crate) required: &'static [&'static str],
    /// The set `auto` must pick there (the cheapest that loads).
    pub(crate) auto: &'static str,
}

/// The package of a series, from apt's lists: 6.1 is what `linux-image-amd64` depends on in
/// Debian 12; 6.12 is the newest `linux-image-6.12.*+deb12-amd64`.
fn resolve(series: &'static str) -> Result<Kernel> {
    let out = |args: &[&str]| -> Result<String> {
        let o = Command::new("apt-cache").args(args).output()?;
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let (package, required, auto): (String, &'static [&'static str], &'static str) = match series {
        "6.1" => (
            out(&["depends", "linux-image-amd64"])?
                .lines()
                .filter_map(|l| l.trim().strip_prefix("Depends: "))
                .find(|p| p.starts_with("linux-image-6.1."))
                .ok_or_else(|| anyhow!("apt-cache: linux-image-amd64 depends on no 6.1 image"))?
                .to_string(),
            &["fentry", "kprobes", "syscalls"],
            "fentry",
        ),
        "6.12" => {
            let mut v: Vec<String> = out(&[
                "search",
                "--names-only",
                r"^linux-image-6\.12\..*+deb12-amd64$",
            ])?
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|p| p.ends_with("+deb12-amd64"))
            .map(str::to_string)
            .collect();
            // linux-image-6.12.N+deb12-amd64: newest N.
            v.sort_by_key(|p| {
                p.trim_start_matches("linux-image-6.12.")
                    .split('+')
                    .next()
                    .and_then(|n| n.parse::<u32>().ok())
                    .unwrap_or(0)
            });
            (
                v.pop()
                    .ok_or_else(|| anyhow!("apt-cache: no linux-image-6.12.*+deb12-amd64 (is bookworm-security in the apt sources?)"))?,
                &HOOK_SETS,
                "tracepoints",
            )
        }
        _ => bail!("unknown kernel series {series} (6.1 or 6.12)"),
    };
    Ok(Kernel {
        series,
        package,
        required,
        auto,
    })
}

/// The sock_diag modules the guests load (Debian builds them as modules): without them a
/// sock_diag TCP dump fails with ENOENT, and the observer's sampler and `tcpinfo` go blind.
const MODULES: [&str; 2] = ["inet_diag", "tcp_diag"];

/// The kernel image of `k` and the directory holding its [`MODULES`] (`<release>/NAME.ko`,
/// decompressed), downloaded and extracted once into [`CACHE`].
fn vmlinuz(k: &Kernel) -> Result<(PathBuf, PathBuf)> {
    let dir = Path::new(CACHE).join(&k.package);
    let image = dir.join("vmlinuz");
    let modules = dir.join("modules");
    if image.exists() && modules.exists() {
        return Ok((image, modules));
    }
    let _ = fs::remove_file(&image);
    fs::create_dir_all(&dir)?;
    eprintln!("guest: downloading {}", k.package);
    crate::run(
        Command::new("apt-get")
            .args(["download", &k.package])
            .current_dir(&dir),
    )?;
    let deb = fs::read_dir(&dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| anyhow!("apt-get download left no .deb in {}", dir.display()))?;
    let x = dir.join("x");
    fs::create_dir_all(&x)?;
    crate::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&x))?;
    let boot = fs::read_dir(x.join("boot"))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz-"))
        })
        .ok_or_else(|| anyhow!("{} has no /boot/vmlinuz-*", k.package))?;
    let release = fs::read_dir(x.join("lib/modules"))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
        .next()
        .ok_or_else(|| anyhow!("{} has no /lib/modules/<release>", k.package))?;
    let to = modules.join(&release);
    fs::create_dir_all(&to)?;
    for m in MODULES {
        let from = x.join("lib/modules").join(&release).join("kernel/net/ipv4");
        let plain = from.join(format!("{m}.ko"));
        let xz = from.join(format!("{m}.ko.xz"));
        if plain.exists() {
            fs::copy(&plain, to.join(format!("{m}.ko")))?;
        } else {
            let out = Command::new("xz")
                .args(["-dc"])
                .arg(&xz)
                .output()
                .with_context(|| format!("xz -dc {}", xz.display()))?;
            if !out.status.success() {
                bail!("xz -dc {}: {}", xz.display(), out.status);
            }
            fs::write(to.join(format!("{m}.ko")), out.stdout)?;
        }
    }
    // Copied under a temporary name and renamed: an interrupted run must not leave a partial
    // image that the check above would take for a cached one.
    let part = dir.join("vmlinuz.part");
    fs::copy(&boot, &part)?;
    fs::rename(&part, &image)?;
    let _ = fs::remove_dir_all(&x);
    let _ = fs::remove_file(&deb);
    Ok((image, modules))
}

/// The release test binaries `tests/NAME.rs` (built now), by name.
fn test_binaries(names: &[&str]) -> Result<BTreeMap<String, PathBuf>> {
    let mut cmd = crate::cargo();
    cmd.args(["test", "--release", "-p", "spice-observer", "--no-run"])
        .args(names.iter().flat_map(|n| ["--test", n]))
        .args(["--message-format", "json-render-diagnostics"])
        .stdout(Stdio::piped());
    eprintln!("+ {cmd:?}");
    let out = cmd.output().context("cargo test --no-run")?;
    if !out.status.success() {
        bail!("cargo test --no-run failed: {}", out.status);
    }
    let mut bins = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let (Some(name), Some(exe)) = (v["target"]["name"].as_str(), v["executable"].as_str())
        else {
            continue;
        };
        if v["target"]["kind"][0] == "test" && names.contains(&name) {
            bins.insert(name.to_string(), PathBuf::from(exe));
        }
    }
    for n in names {
        if !bins.contains_key(*n) {
            bail!("cargo built no test binary `{n}`");
        }
    }
    Ok(bins)
}

/// Copies `bin` to the same path under `root`, with every library `ldd` names.
fn copy_with_libs(root: &Path, bin: &Path) -> Result<()> {
    let put = |src: &Path| -> Result<()> {
        let dst = root.join(src.strip_prefix("/").unwrap_or(src));
        if dst.exists() {
            return Ok(());
        }
        fs::create_dir_all(dst.parent().unwrap())?;
        fs::copy(src, &dst).with_context(|| format!("copying {}", src.display()))?;
        Ok(())
    };
    put(bin)?;
    let out = Command::new("ldd").arg(bin).output().context("ldd")?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)" or "/lib64/ld-linux-x86-64.so.2 (0x…)"
        let path = match line.split_once("=>") {
            Some((_, r)) => r.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            put(&fs::canonicalize(p).unwrap_or_else(|_| PathBuf::from(p)))?;
            // The name the binary asks for (a symlink on the host): a copy under that name.
            let named = root.join(p.trim_start_matches('/'));
            if !named.exists() {
                fs::create_dir_all(named.parent().unwrap())?;
                fs::copy(p, &named)?;
            }
        }
    }
    Ok(())
}

/// The guest's `/init`. It writes its scratch files to the initramfs's own `/tmp` (the
/// root is a tmpfs already): a tmpfs mounted there would hide the binaries of a checkout
/// under `/tmp`, which sit at their host paths.
fn init_script(observer: &Path, tests: &BTreeMap<String, PathBuf>, pick: &Pick) -> String {
    let mut skip: String = SKIPPED.iter().map(|t| format!(" --skip {t}")).collect();
    if let Some(f) = &pick.test {
        skip.push_str(&format!(" '{f}'"));
    }
    let suites: String = tests
        .iter()
        .map(|(name, exe)| {
            format!(
                r#"    echo "guest-matrix: run $hs {name}"
    if CI=true RUST_LIB_BACKTRACE=0 SPICE_OBSERVER_TEST_TIME_SCALE=1.5 SPICE_OBSERVER_HOOK_SET=$hs {exe} --test-threads=1{skip} > /tmp/{name}.out 2>&1; then r=pass; else r=fail; fi
    sed 's/^/  | /' /tmp/{name}.out | grep -E '^  \| (test |Error|---- |thread |  )|no free instance' | tail -n 60
    echo "guest-matrix: result $hs {name} $r $(grep -o 'test result: .*' /tmp/{name}.out | head -1)"
    if [ -n "{trace}" ]; then sed 's/^/  trace| /' /sys/kernel/tracing/trace | tail -n 200; echo > /sys/kernel/tracing/trace; fi
"#,
                exe = exe.display(),
                trace = if std::env::var_os("SPICE_OBSERVER_GUEST_TRACE").is_some() { "1" } else { "" },
            )
        })
        .collect();
    let body = match &pick.bench {
        None => format!(
            r#"for hs in {sets}; do
  if tr -d ' \n' < /tmp/doctor.json | grep -q "\"name\":\"$hs\",\"built\":true,\"state\":\"loaded\""; then
{suites}    if [ $hs = kprobes ]; then pinned_cycle; fi
  fi
done"#,
            sets = pick.sets.join(" "),
        ),
        Some(xtask) => format!(
            r#"echo "guest-matrix: run bench"
{xtask} guest-bench --observer $O --peer {peer} > /tmp/bench.out 2> /tmp/bench.err || echo "guest-matrix: bench-failed $(tail -n 3 /tmp/bench.err | tr '\n' ' ')"
grep '^guest-matrix: bench ' /tmp/bench.out
grep -E '^bench:' /tmp/bench.err | tail -n 20"#,
            xtask = xtask.display(),
            peer = observer.with_file_name("spice-peer").display(),
        ),
    };
    format!(
        r#"#!/bin/busybox sh
# The daemon on hook set $hs with its state pinned, stopped for a restart in place (SIGUSR2,
# exit 75) twice, the second continuing the first's pins; then --unpin. Each step prints its
# exit status, the link pins and the observer's kprobe events still defined.
pinned_cycle() {{
  D=/sys/fs/bpf/spice-observer-guest
  for round in 1 2; do
    $O daemon --hook-set $hs --pin-dir $D --listen 127.0.0.1:19590 --no-bpf-stats --no-tls-hooks > /tmp/daemon.$round.out 2>&1 &
    d=$!
    i=0
    while [ $i -lt 180 ] && ! wget -q -O /tmp/metrics http://127.0.0.1:19590/metrics 2>/dev/null; do sleep 1; i=$((i+1)); done
    kill -USR2 $d; wait $d; rc=$?
    echo "guest-matrix: pinned $hs $round $rc $(ls $D | grep -c '^link_') $(grep -c spice_observer/ /sys/kernel/tracing/kprobe_events) $(grep -c "hook_set=\"$hs+" /tmp/metrics)"
    sed 's/^/  daemon| /' /tmp/daemon.$round.out | grep -iE 'error|warn' | tail -n 5
  done
  $O daemon --unpin --pin-dir $D > /tmp/unpin.out 2>&1; rc=$?
  echo "guest-matrix: unpinned $hs $rc $(grep -c spice_observer/ /sys/kernel/tracing/kprobe_events)"
}}
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mount -t tmpfs run /run
mount -t bpf bpf /sys/fs/bpf; mount -t tracefs tracefs /sys/kernel/tracing
mount -t debugfs debugfs /sys/kernel/debug; mount -t cgroup2 cgroup2 /sys/fs/cgroup
ip link set lo up
exec </dev/ttyS0 >/dev/ttyS0 2>&1
for m in {modules}; do insmod /lib/modules/$(uname -r)/$m.ko || echo "guest: insmod $m failed"; done
export PATH=/bin:/usr/sbin:/usr/bin HOME=/root
O={observer}
echo "guest-matrix: kernel $(uname -r)"
$O doctor --json > /tmp/doctor.json 2>/tmp/doctor.err
echo "guest-matrix: doctor $(tr -d '\n' < /tmp/doctor.json)"
{body}
RUST_LIB_BACKTRACE=0 $O observe --pid 1 --duration 1 --no-progress --json /tmp/auto.json > /tmp/auto.out 2>&1
echo "guest-matrix: auto $(tr -d ' \n' < /tmp/auto.json | grep -o '"hook_set":"[^"]*"' | head -1)"
echo "guest-matrix: leftover $(grep -c spice_observer/ /sys/kernel/tracing/kprobe_events)"
echo "guest-matrix: end"
poweroff -f
"#,
        observer = observer.display(),
        modules = MODULES.join(" "),
    )
}

/// Builds the initramfs at `out`, with every kernel's [`MODULES`] from `modules` (each a
/// directory of `<release>/NAME.ko`) under `/lib/modules`.
fn initramfs(
    out: &Path,
    observer: &Path,
    peer: &Path,
    tests: &BTreeMap<String, PathBuf>,
    modules: &[PathBuf],
    pick: &Pick,
) -> Result<()> {
    let root = out.with_extension("root");
    let _ = fs::remove_dir_all(&root);
    for d in [
        "bin",
        "proc",
        "sys",
        "dev",
        "tmp",
        "run",
        "root",
        "usr/sbin",
        "lib/modules",
    ] {
        fs::create_dir_all(root.join(d))?;
    }
    fs::copy("/bin/busybox", root.join("bin/busybox")).context("busybox (busybox-static)")?;
    let bpftool = ["/usr/sbin/bpftool", "/usr/bin/bpftool"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .ok_or_else(|| anyhow!("no bpftool on the host (scripts/setup.sh installs it)"))?;
    copy_with_libs(&root, Path::new(&fs::canonicalize(bpftool)?))?;
    if !root.join("usr/sbin/bpftool").exists() {
        fs::copy(bpftool, root.join("usr/sbin/bpftool"))?;
    }
    for b in [observer, peer]
        .into_iter()
        .chain(pick.bench.as_deref())
        .chain(tests.values().map(PathBuf::as_path))
    {
        copy_with_libs(&root, b)?;
    }
    for m in modules {
        crate::run(
            Command::new("cp")
                .arg("-r")
                .arg(format!("{}/.", m.display()))
                .arg(root.join("lib/modules")),
        )?;
    }
    let init = root.join("init");
    fs::write(&init, init_script(observer, tests, pick))?;
    crate::run(Command::new("chmod").arg("755").arg(&init))?;
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "cd '{}' && find . | cpio -o -H newc --quiet | gzip -1 > '{}'",
            root.display(),
            out.display()
        ))
        .status()?;
    if !status.success() {
        bail!("cpio/gzip of the initramfs failed: {status}");
    }
    let _ = fs::remove_dir_all(&root);
    Ok(())
}

/// What one guest gave for one hook set.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Cell {
    /// Loaded; every suite passed (their `test result:` lines).
    Pass(Vec<String>),
    /// Loaded; a suite failed.
    Fail(Vec<String>),
    /// doctor's state (`refused`, `absent`, `allowed`) and detail.
    NotLoaded(String, String),
}

/// The parsed `guest-matrix:` lines of one guest.
#[derive(Debug, Default)]
pub(crate) struct GuestRun {
    pub(crate) uname: Option<String>,
    pub(crate) doctor: Option<Value>,
    /// hook set → suite → (passed, test result line).
    pub(crate) results: BTreeMap<String, BTreeMap<String, (bool, String)>>,
    pub(crate) auto: Option<String>,
    /// The observer's return-probe events still defined in tracefs after every run (each
    /// observer removes its own at exit, `spice-observer/src/kernel/kretprobe.rs`).
    pub(crate) leftover_kprobe_events: Option<u32>,
    /// The `pinned` and `unpinned` lines of the daemon's pinned cycle under `kprobes`, as
    /// printed (`pinned SET ROUND STATUS LINKS EVENTS METRIC`, `unpinned SET STATUS EVENTS`).
    pub(crate) pinned: Vec<String>,
    /// `guest --bench`: per hook set, its cells (set, ratio, per call, getppid, on getppid).
    pub(crate) bench: Vec<Vec<String>>,
    /// `guest --bench`: the pass failed (the last lines of its stderr).
    pub(crate) bench_failed: Option<String>,
    pub(crate) ended: bool,
}

/// Parses one console line into `run` (other lines are ignored).
pub(crate) fn parse_line(run: &mut GuestRun, line: &str) {
    let Some(rest) = line
        .trim_end_matches('\r')
        .split_once("guest-matrix: ")
        .map(|x| x.1)
    else {
        return;
    };
    let (word, rest) = rest.split_once(' ').unwrap_or((rest, ""));
    match word {
        "kernel" => run.uname = Some(rest.to_string()),
        "doctor" => run.doctor = serde_json::from_str(rest).ok(),
        "result" => {
            let mut f = rest.splitn(4, ' ');
            if let (Some(hs), Some(suite), Some(r)) = (f.next(), f.next(), f.next()) {
                run.results.entry(hs.to_string()).or_default().insert(
                    suite.to_string(),
                    (r == "pass", f.next().unwrap_or("").to_string()),
                );
            }
        }
        "auto" => {
            run.auto = rest
                .strip_prefix("\"hook_set\":\"")
                .and_then(|s| s.strip_suffix('"'))
                .map(str::to_string)
        }
        "leftover" => run.leftover_kprobe_events = rest.trim().parse().ok(),
        "pinned" | "unpinned" => run.pinned.push(format!("{word} {}", rest.trim())),
        "bench" => run
            .bench
            .push(rest.split('\t').map(str::to_string).collect()),
        "bench-failed" => run.bench_failed = Some(rest.trim().to_string()),
        "end" => run.ended = true,
        _ => {}
    }
}

impl GuestRun {
    /// The cell of `set`: its suites' results if it ran, else doctor's line for it.
    pub(crate) fn cell(&self, set: &str) -> Cell {
        if let Some(r) = self.results.get(set) {
            let lines: Vec<String> = r.iter().map(|(s, (_, l))| format!("{s}: {l}")).collect();
            return match r.values().all(|(ok, _)| *ok) {
                true => Cell::Pass(lines),
                false => Cell::Fail(lines),
            };
        }
        let h = self
            .doctor
            .as_ref()
            .and_then(|d| d["hook_sets"].as_array())
            .and_then(|a| a.iter().find(|h| h["name"] == set));
        match h {
            Some(h) => Cell::NotLoaded(
                h["state"].as_str().unwrap_or("?").to_string(),
                h["detail"].as_str().unwrap_or("").to_string(),
            ),
            None => Cell::NotLoaded("?".into(), "no doctor report".into()),
        }
    }
}

/// Boots `k` with `initrd`, streaming its console to `log`; returns the parsed run.
fn boot(k: &Kernel, image: &Path, initrd: &Path, log: &Path) -> Result<GuestRun> {
    let qemu = [
        "/usr/bin/qemu-system-x86_64",
        &format!("{RIG_QEMU}/usr/bin/qemu-system-x86_64"),
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
    .map(str::to_string)
    .ok_or_else(|| {
        anyhow!("no qemu-system-x86_64 (run `rig/start-qemu.sh prepare` or `cargo xtask setup`)")
    })?;
    let mut cmd = Command::new(&qemu);
    if qemu.starts_with(RIG_QEMU) {
        cmd.env(
            "QEMU_MODULE_DIR",
            format!("{RIG_QEMU}/usr/lib/x86_64-linux-gnu/qemu"),
        )
        .args(["-L", "/usr/share/seabios", "-L", "/usr/share/qemu"]);
    }
    cmd.args([
        "-accel",
        "tcg",
        "-smp",
        "2",
        "-m",
        "2048",
        "-nographic",
        "-no-reboot",
    ])
    .args(["-nic", "none", "-monitor", "none"])
    .arg("-kernel")
    .arg(image)
    .arg("-initrd")
    .arg(initrd)
    .args(["-append", "console=ttyS0 quiet panic=-1"])
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    eprintln!("guest: booting {} ({})", k.package, k.series);
    let mut child = cmd.spawn().with_context(|| format!("starting {qemu}"))?;
    let stdout = child.stdout.take().unwrap();
    let log_path = log.to_path_buf();
    let reader = std::thread::spawn(move || -> Result<GuestRun> {
        let mut run = GuestRun::default();
        let mut f = fs::File::create(&log_path)?;
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            use std::io::Write;
            writeln!(f, "{line}")?;
            if line.contains("guest-matrix: result") || line.contains("guest-matrix: auto") {
                eprintln!("guest: {}", line.trim_end_matches('\r'));
            }
            parse_line(&mut run, &line);
        }
        Ok(run)
    });
    let t0 = Instant::now();
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if t0.elapsed() > GUEST_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "the {} guest did not finish in {} s (console in {})",
                k.series,
                GUEST_TIMEOUT.as_secs(),
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let run = reader
        .join()
        .map_err(|_| anyhow!("console reader panicked"))??;
    eprintln!(
        "guest: {} finished in {:.0} s",
        k.series,
        t0.elapsed().as_secs_f64()
    );
    Ok(run)
}

/// The last `n` lines of a console log, indented (or why it cannot be read).
fn console_tail(log: &Path, n: usize) -> String {
    match fs::read(log) {
        Ok(b) => {
            let text = String::from_utf8_lossy(&b);
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(n)..]
                .iter()
                .map(|l| format!("  | {}", l.trim_end_matches('\r')))
                .collect::<Vec<_>>()
                .join("\n")
        }
        Err(e) => format!("  (cannot read {}: {e})", log.display()),
    }
}

/// What a run covers: the hook sets whose suites run (all of [`HOOK_SETS`] by default) and
/// an optional test-name filter.
pub(crate) struct Pick {
    sets: Vec<&'static str>,
    test: Option<String>,
    /// The benchmarks' per-hook-set pass instead of the suites: this `xtask` (copied into
    /// the initramfs) runs `guest-bench` there.
    bench: Option<PathBuf>,
}

/// Entry point of `cargo xtask guest`: `series` (`6.1`, `6.12`; both if empty), `sets` (hook
/// set names; all if empty), `test` (a test-name filter).
pub(crate) fn guest(
    root: &Path,
    series: &[String],
    sets: &[String],
    test: Option<&str>,
    bench: bool,
) -> Result<()> {
    let t0 = Instant::now();
    let pick = Pick {
        sets: if sets.is_empty() {
            HOOK_SETS.to_vec()
        } else {
            sets.iter()
                .map(|s| {
                    HOOK_SETS
                        .iter()
                        .find(|h| **h == s.as_str())
                        .copied()
                        .ok_or_else(|| anyhow!("--hook-set {s}: one of {}", HOOK_SETS.join(", ")))
                })
                .collect::<Result<_>>()?
        },
        test: match test {
            Some(t) if t.contains('\'') => bail!("--test {t}: no quotes"),
            t => t.map(str::to_string),
        },
        bench: match bench {
            true => Some(std::env::current_exe().context("the xtask executable")?),
            false => None,
        },
    };
    let series: Vec<&'static str> = if series.is_empty() {
        vec!["6.1", "6.12"]
    } else {
        series
            .iter()
            .map(|s| match s.as_str() {
                "6.1" => Ok("6.1"),
                "6.12" => Ok("6.12"),
                o => Err(anyhow!("--kernel {o}: 6.1 or 6.12")),
            })
            .collect::<Result<_>>()?
    };
    let kernels: Vec<Kernel> = series.iter().map(|s| resolve(s)).collect::<Result<_>>()?;
    crate::run(crate::cargo().args(["build", "--release", "-p", "spice-observer", "--bins"]))?;
    let observer = crate::release_bin("spice-observer")?;
    let peer = crate::release_bin("spice-peer")?;
    let tests = test_binaries(&["kernel_paths", "selftest"])?;
    let dir = root.join("target/guest");
    fs::create_dir_all(&dir)?;
    let initrd = dir.join("initrd.gz");
    let images: Vec<(PathBuf, PathBuf)> = kernels.iter().map(vmlinuz).collect::<Result<_>>()?;
    let modules: Vec<PathBuf> = images.iter().map(|(_, m)| m.clone()).collect();
    initramfs(&initrd, &observer, &peer, &tests, &modules, &pick)?;
    let mut rows = Vec::new();
    let mut problems = Vec::new();
    for (k, (image, _)) in kernels.iter().zip(&images) {
        let log = dir.join(format!("{}.log", k.series));
        let mut run = boot(k, image, &initrd, &log)?;
        if run.uname.is_none() {
            // The guest stopped before its /init printed its first line: a boot that failed
            // (once in CI, 6 s into the 6.12 guest, console not kept), not a test. Shown, then
            // booted once more; a second such stop fails the run below.
            eprintln!(
                "guest: {} stopped before its /init ran; the console's last lines:\n{}\nguest: booting it once more",
                k.series,
                console_tail(&log, 40)
            );
            fs::rename(&log, log.with_extension("first.log"))?;
            run = boot(k, image, &initrd, &log)?;
        }
        if !run.ended {
            eprintln!(
                "guest: {} stopped before its end; the console's last lines:\n{}",
                k.series,
                console_tail(&log, 40)
            );
            problems.push(format!(
                "{}: the guest stopped before its end (console in {})",
                k.series,
                log.display()
            ));
        }
        let mut cells = Vec::new();
        for set in HOOK_SETS {
            let c = run.cell(set);
            if pick.bench.is_some() {
                // No suites ran: each set that loads must have its bench line.
                if matches!(&c, Cell::NotLoaded(s, _) if s == "loaded")
                    && !run
                        .bench
                        .iter()
                        .any(|b| b.first().map(String::as_str) == Some(set))
                {
                    problems.push(format!("{} {set}: loads, but has no bench line", k.series));
                }
                cells.push(c);
                continue;
            }
            match &c {
                Cell::Fail(l) => {
                    problems.push(format!("{} {set}: failed: {}", k.series, l.join("; ")))
                }
                Cell::NotLoaded(state, d)
                    if k.required.contains(&set) && pick.sets.contains(&set) =>
                {
                    problems.push(format!(
                        "{} {set}: must load there, doctor says {state}: {d}",
                        k.series
                    ))
                }
                _ => {}
            }
            cells.push(c);
        }
        if pick.bench.is_none() && pick.sets.contains(&"kprobes") && k.required.contains(&"kprobes")
        {
            if let Err(e) = check_pinned(&run.pinned) {
                problems.push(format!("{} kprobes, daemon with pins: {e}", k.series));
            }
        }
        if let Some(n @ 1..) = run.leftover_kprobe_events {
            problems.push(format!(
                "{}: {n} kprobe event(s) of group spice_observer left in kprobe_events after \
                 the runs (each observer removes its own at exit)",
                k.series
            ));
        }
        if let Some(why) = &run.bench_failed {
            problems.push(format!("{}: the bench pass failed: {why}", k.series));
        }
        let auto = run.auto.as_deref().unwrap_or("?");
        if auto.split('+').next() != Some(k.auto) {
            problems.push(format!(
                "{}: `auto` picked `{auto}`, expected `{}`",
                k.series, k.auto
            ));
        }
        rows.push((k.clone(), run, cells));
    }
    let (md, file) = match pick.bench {
        None => (matrix(&rows), "matrix.md"),
        Some(_) => (bench_table(&rows), "bench.md"),
    };
    println!("{md}");
    fs::write(dir.join(file), &md)?;
    eprintln!("guest: finished in {:.0} s", t0.elapsed().as_secs_f64());
    if !problems.is_empty() {
        bail!("guest matrix:\n  {}", problems.join("\n  "));
    }
    Ok(())
}

/// The daemon's pinned cycle under `kprobes` (see the init script's `pinned_cycle`): both
/// rounds stopped for a restart in place (exit 75) with every link pinned, the return-probe
/// events still defined (the pinned links hold them) and the set named in the metrics; then
/// `--unpin` exits 0 and leaves no event defined.
fn check_pinned(lines: &[String]) -> Result<()> {
    let mut rounds = 0;
    let mut unpinned = false;
    for l in lines {
        let f: Vec<&str> = l.split_whitespace().collect();
        match f.as_slice() {
            ["pinned", _, round, status, links, events, metric] => {
                rounds += 1;
                let n = |s: &str| s.parse::<u32>().unwrap_or(0);
                if *status != "75" || n(links) < 4 || n(events) == 0 || n(metric) == 0 {
                    bail!(
                        "round {round}: exit status {status} (75 expected), {links} link pins, \
                         {events} kprobe events, hook set in the metrics: {metric}"
                    );
                }
            }
            ["unpinned", _, status, events] => {
                if *status != "0" || *events != "0" {
                    bail!("--unpin: exit status {status}, {events} kprobe events left");
                }
                unpinned = true;
            }
            _ => bail!("unreadable line `{l}`"),
        }
    }
    if rounds != 2 || !unpinned {
        bail!(
            "{rounds} of 2 rounds reported, unpin {}",
            if unpinned { "ran" } else { "missing" }
        );
    }
    Ok(())
}

/// `guest --bench`'s results as a Markdown table: one row per kernel and hook set.
fn bench_table(rows: &[(Kernel, GuestRun, Vec<Cell>)]) -> String {
    let mut md = String::from(
        "| kernel | hook set | throughput ratio (msgs/s without → with) | kernel time per \
         observed send call | getppid, unwatched | its programs on the getppid loop (bpf_stats) \
         |\n|---|---|---|---|---|---|\n",
    );
    for (k, run, _) in rows {
        for b in run.bench.iter().filter(|b| !b.is_empty()) {
            md.push_str(&format!(
                "| {} | `{}` | {} |\n",
                run.uname.as_deref().unwrap_or(&k.package),
                b[0],
                b[1..].join(" | ")
            ));
        }
    }
    md
}

/// The matrix as a Markdown table: one row per kernel, one column per hook set (the framing
/// sets this version builds, then doctor's lines for those it does not), and the automatic
/// choice.
fn matrix(rows: &[(Kernel, GuestRun, Vec<Cell>)]) -> String {
    let mut md = String::from("| kernel |");
    for s in HOOK_SETS {
        md.push_str(&format!(" `{s}` |"));
    }
    md.push_str(" `tcpinfo` | `auto` picks |\n|---|");
    md.push_str(&"---|".repeat(HOOK_SETS.len() + 2));
    md.push('\n');
    for (k, run, cells) in rows {
        md.push_str(&format!(
            "| {} ({}) |",
            run.uname.as_deref().unwrap_or("?"),
            k.package
        ));
        for c in cells {
            md.push_str(&format!(
                " {} |",
                match c {
                    Cell::Pass(l) => format!("pass ({})", l.join("; ")),
                    Cell::Fail(l) => format!("**FAIL** ({})", l.join("; ")),
                    Cell::NotLoaded(s, d) => format!("{s}: {d}"),
                }
            ));
        }
        for other in ["tcpinfo"] {
            md.push_str(&format!(
                " {} |",
                match run.cell(other) {
                    Cell::NotLoaded(s, d) => format!("{s}: {d}"),
                    _ => "?".into(),
                }
            ));
        }
        md.push_str(&format!(" `{}` |\n", run.auto.as_deref().unwrap_or("?")));
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_lines() {
        let mut r = GuestRun::default();
        for l in [
            "guest-matrix: kernel 6.1.0-57-amd64\r",
            r#"guest-matrix: doctor {"hook_sets":[{"name":"tracepoints","built":true,"state":"absent","detail":"no tp"}]}"#,
            "noise guest-matrix: result syscalls kernel_paths pass test result: ok. 12 passed; 0 failed",
            "guest-matrix: result syscalls selftest fail test result: FAILED. 1 passed; 1 failed",
            r#"guest-matrix: auto "hook_set":"syscalls+sockops+libssl""#,
            "guest-matrix: leftover 0",
            "guest-matrix: pinned kprobes 1 75 9 2 1",
            "guest-matrix: pinned kprobes 2 75 9 2 1",
            "guest-matrix: unpinned kprobes 0 0",
            "guest-matrix: end",
        ] {
            parse_line(&mut r, l);
        }
        assert_eq!(r.uname.as_deref(), Some("6.1.0-57-amd64"));
        assert_eq!(r.auto.as_deref(), Some("syscalls+sockops+libssl"));
        assert!(r.ended);
        assert_eq!(r.leftover_kprobe_events, Some(0));
        check_pinned(&r.pinned).unwrap();
        assert!(check_pinned(&r.pinned[..2]).is_err());
        assert!(check_pinned(&["pinned kprobes 1 1 9 2 1".into()]).is_err());
        assert_eq!(
            r.cell("tracepoints"),
            Cell::NotLoaded("absent".into(), "no tp".into())
        );
        match r.cell("syscalls") {
            Cell::Fail(l) => assert_eq!(l.len(), 2),
            c => panic!("{c:?}"),
        }
    }
}
