//! Privileged tests of `spice-observer doctor` (README "Kernel requirements"): its JSON report
//! is read into the typed [`Report`] (a missing field fails), and held against sources outside
//! the observer: `/proc/kallsyms` (whether the kernel has kprobes at all), the fake QEMU's
//! own `/proc/PID/maps` (its libssl), `bpftool prog show` (nothing left loaded), and a run
//! without any capability (it must refuse and say why).

mod common;

use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use common::{privileged, sh, spice_programs};
use spice_observer::cmd::doctor::{HookState, Report, Status};

const BIN: &str = env!("CARGO_BIN_EXE_spice-observer");

/// A scratch directory under the system's temp dir, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Result<Self> {
        let p = std::env::temp_dir().join(format!("spice-doctor-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p)?;
        // Readable and searchable by the unprivileged user of the second test.
        sh(Command::new("chmod").arg("755").arg(&p))?;
        Ok(Self(p))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A process whose executable is named `qemu-system-x86_64` (a copy of python3) with libssl
/// loaded (`import ssl`), waiting on its stdin. Killed on drop.
struct FakeQemu(Child);

impl FakeQemu {
    fn start(dir: &Path) -> Result<Self> {
        let python = std::fs::canonicalize("/usr/bin/python3")?;
        let exe = dir.join("qemu-system-x86_64");
        std::fs::copy(&python, &exe).context("copying python3")?;
        let mut child = Command::new(&exe)
            .args([
                "-c",
                "import ssl, sys; print('ready', flush=True); sys.stdin.read()",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the fake qemu")?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
        ensure!(line.trim() == "ready", "fake qemu said {line:?}");
        Ok(Self(child))
    }
}

impl Drop for FakeQemu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The libssl files `/proc/PID/maps` lists (the path column), sorted.
fn libssl_in_maps(pid: u32) -> Result<BTreeSet<String>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    Ok(maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|p| {
            Path::new(p)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libssl.so"))
        })
        .map(str::to_string)
        .collect())
}

/// Runs `doctor --json` (through `pre`, e.g. setpriv); returns its exit code, its report and
/// its stderr.
fn doctor(pre: &[&str], bin: &Path) -> Result<(Option<i32>, Report, String)> {
    let mut cmd = match pre.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(bin);
            c
        }
        None => Command::new(bin),
    };
    let out = cmd
        .args(["doctor", "--json"])
        .env("RUST_BACKTRACE", "0")
        .output()
        .context("running doctor")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Report =
        serde_json::from_str(&stdout).with_context(|| format!("doctor's JSON: {stdout}"))?;
    Ok((
        out.status.code(),
        report,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

fn check_line<'a>(r: &'a Report, item: &str) -> Result<&'a spice_observer::cmd::doctor::Check> {
    r.checks
        .iter()
        .find(|c| c.item == item)
        .with_context(|| format!("no `{item}` line in {r:#?}"))
}

fn hook_set<'a>(r: &'a Report, name: &str) -> Result<&'a spice_observer::cmd::doctor::HookSet> {
    r.hook_sets
        .iter()
        .find(|h| h.name == name)
        .with_context(|| format!("no hook set `{name}` in {r:#?}"))
}

#[test]
fn doctor_as_root_names_what_loads_and_leaves_nothing_behind() -> Result<()> {
    if !privileged("doctor_as_root_names_what_loads_and_leaves_nothing_behind") {
        return Ok(());
    }
    let dir = Scratch::new("root")?;
    let qemu = FakeQemu::start(&dir.0)?;
    let qemu_pid = qemu.0.id();
    let before = spice_programs()?;
    let (code, r, stderr) = doctor(&[], Path::new(BIN))?;
    ensure!(code == Some(0), "doctor exited {code:?}: {stderr}");

    ensure!(
        r.framing_hook_set.as_deref() == Some("tracepoints"),
        "framing: {:?}",
        r.framing_hook_set
    );
    let tp = hook_set(&r, "tracepoints")?;
    ensure!(tp.built && tp.state == HookState::Loaded, "{tp:?}");
    ensure!(tp.detail.contains("`tracepoints+sockops"), "{tp:?}");
    let sc = hook_set(&r, "syscalls")?;
    ensure!(sc.built && sc.state == HookState::Loaded, "{sc:?}");
    ensure!(sc.detail.contains("`syscalls+sockops"), "{sc:?}");
    // `fentry` is built; this machine's kernel refuses BPF trampolines (EPERM at the load),
    // which doctor must say with the kernel's own error.
    let fe = hook_set(&r, "fentry")?;
    ensure!(
        fe.built && fe.state == HookState::Refused && fe.detail.contains("os error"),
        "{fe:?}"
    );
    // The no-BPF mode is built, usable here, and never the framing hook set.
    let ti = hook_set(&r, "tcpinfo")?;
    ensure!(ti.built && ti.state == HookState::Available, "{ti:?}");
    // Every framing set is built, listed in `auto`'s order of preference.
    let names: Vec<&str> = r.hook_sets.iter().map(|h| h.name.as_str()).collect();
    ensure!(
        names == ["tracepoints", "fentry", "kprobes", "syscalls", "tcpinfo"],
        "hook sets {names:?}"
    );
    ensure!(r.hook_sets.iter().all(|h| h.built), "{:?}", r.hook_sets);
    // Whether the kernel has kprobes at all, from its symbol table (CONFIG_KPROBES provides
    // register_kprobe): absent exactly when it has none, else loaded or refused with the
    // kernel's own error.
    let kallsyms = std::fs::read_to_string("/proc/kallsyms")?;
    let has_kprobes = kallsyms.lines().any(|l| l.ends_with(" register_kprobe"));
    let kp = hook_set(&r, "kprobes")?;
    ensure!(
        (kp.state == HookState::Absent) == !has_kprobes,
        "kprobes {kp:?}, but register_kprobe is {}in /proc/kallsyms",
        if has_kprobes { "" } else { "not " }
    );
    if kp.state == HookState::Refused {
        ensure!(
            kp.detail.contains("os error"),
            "{kp:?} names no kernel error"
        );
    }
    let caps = check_line(&r, "capabilities")?;
    ensure!(caps.status == Status::Ok, "{caps:?}");
    let btf = check_line(&r, "kernel BTF")?;
    ensure!(
        (btf.status == Status::Ok) == Path::new("/sys/kernel/btf/vmlinux").exists(),
        "{btf:?}"
    );

    // The fake QEMU's libssl, as its own map lists it.
    let want = libssl_in_maps(qemu_pid)?;
    ensure!(!want.is_empty(), "python's `import ssl` mapped no libssl");
    let p = r
        .qemu_tls
        .iter()
        .find(|p| p.pid == qemu_pid)
        .with_context(|| format!("qemu pid {qemu_pid} missing from {:#?}", r.qemu_tls))?;
    ensure!(p.exe == "qemu-system-x86_64" && p.error.is_none(), "{p:?}");
    let got: BTreeSet<String> = p.libssl.iter().cloned().collect();
    ensure!(
        got == want,
        "doctor says libssl {got:?}, /proc/{qemu_pid}/maps {want:?}"
    );
    drop(qemu);

    // Every program doctor loaded is gone once it exits (the kernel frees them after an RCU
    // grace period: polled).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = spice_programs()?;
        if now == before {
            break;
        }
        if Instant::now() > deadline {
            bail!("programs left loaded after doctor: before {before:?}, after {now:?}");
        }
        thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

#[test]
fn doctor_without_capabilities_refuses_and_says_why() -> Result<()> {
    if !privileged("doctor_without_capabilities_refuses_and_says_why") {
        return Ok(());
    }
    // A copy the unprivileged user can execute (the build tree may be private).
    let dir = Scratch::new("nobody")?;
    let bin = dir.0.join("spice-observer");
    std::fs::copy(BIN, &bin)?;
    sh(Command::new("chmod").arg("755").arg(&bin))?;
    let (code, r, stderr) = doctor(
        &[
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
        ],
        &bin,
    )?;
    ensure!(
        code == Some(1),
        "doctor exited {code:?} without capabilities: {stderr}"
    );
    ensure!(
        stderr.contains("no framing hook set loads on this host"),
        "stderr: {stderr}"
    );
    ensure!(r.framing_hook_set.is_none(), "{r:#?}");
    let caps = check_line(&r, "capabilities")?;
    ensure!(
        caps.status == Status::No && caps.detail.contains("present: none"),
        "{caps:?}"
    );
    let tp = hook_set(&r, "tracepoints")?;
    ensure!(
        tp.state == HookState::Refused && tp.detail.contains("permission denied"),
        "{tp:?}"
    );
    // sock_diag needs no privilege for the no-BPF mode.
    let ti = hook_set(&r, "tcpinfo")?;
    ensure!(ti.built && ti.state == HookState::Available, "{ti:?}");
    Ok(())
}
