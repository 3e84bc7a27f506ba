//! Privileged tests of the start-up self-test (`spice_observer::pipeline::selftest`, README
//! "Kernel requirements"): `observe` reports it in its JSON (read into the typed report, so
//! a missing field fails) and hides the test's own sockets and counters; and when the hooks
//! cannot see the child's writes, because it sends its DRAW_FILLs with sendmmsg(2), which
//! neither hook set frames (README: such calls are `untraced bytes`), observe refuses to
//! report, names the hook set, and leaves no program loaded (`bpftool prog show`, through
//! `common::spice_programs`).

mod common;

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};
use common::{check_run, expected_hook_set, privileged, spice_programs};
use spice_observer::{
    pipeline::selftest::{DRAWS, SEND_ENV, WINDOW},
    report::Report,
};

const BIN: &str = env!("CARGO_BIN_EXE_spice-observer");

/// A `sleep` for observe to watch (it makes no socket call). Killed on drop.
struct Sleeper(Child);

impl Sleeper {
    fn start() -> Result<Sleeper> {
        Ok(Sleeper(
            Command::new("sleep")
                .arg("60")
                .stdin(Stdio::null())
                .spawn()
                .context("starting sleep")?,
        ))
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn observe(pid: u32, json: &std::path::Path, fault: bool) -> Result<std::process::Output> {
    let mut cmd = Command::new(BIN);
    cmd.args(["observe", "--pid", &pid.to_string(), "--duration", "1"])
        .arg("--json")
        .arg(json)
        .arg("--no-progress")
        .env("RUST_LIB_BACKTRACE", "0");
    if fault {
        cmd.env(SEND_ENV, "sendmmsg");
    } else {
        cmd.env_remove(SEND_ENV);
    }
    cmd.output().context("running spice-observer observe")
}

#[test]
fn self_test_counts_the_childs_exchange_and_hides_it() -> Result<()> {
    if !privileged("self_test_counts_the_childs_exchange_and_hides_it") {
        return Ok(());
    }
    let sleeper = Sleeper::start()?;
    let json = std::env::temp_dir().join(format!("spice-selftest-{}.json", std::process::id()));
    let out = observe(sleeper.0.id(), &json, false)?;
    ensure!(
        out.status.success(),
        "observe failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&json)?;
    let _ = std::fs::remove_file(&json);
    let r: Report = serde_json::from_str(&text).context("parsing the report")?;
    check_run(&r)?;
    let t = r
        .self_test
        .as_ref()
        .context("no `self_test` in the report")?;
    ensure!(t.passed, "self-test did not pass: {t:?}");
    ensure!(
        t.hook_set == expected_hook_set(),
        "self-test hook set {:?}",
        t.hook_set
    );
    // What the child's script writes (module doc of selftest): SET_ACK + the draws one way,
    // ACK_SYNC + one ACK per W draws the other.
    let acks = DRAWS / u64::from(WINDOW);
    ensure!(
        t.counted.server_sent == 1 + DRAWS
            && t.counted.client_received == 1 + DRAWS
            && t.counted.client_sent == 1 + acks
            && t.counted.server_received == 1 + acks
            && t.counted.set_acks == 1
            && t.counted.acks == acks,
        "counted {:?}",
        t.counted
    );
    // The test's own sockets and calls are not the run's: `sleep` makes no socket call.
    ensure!(
        r.channels.is_empty(),
        "channels shown: {:?}",
        r.channels.len()
    );
    ensure!(
        r.exited.is_empty() && r.forked.is_empty(),
        "process notes: {:?} {:?}",
        r.exited,
        r.forked
    );
    for (name, v) in &r.kernel_counters {
        ensure!(
            *v == 0,
            "kernel counter {name} = {v} with nothing but `sleep` watched"
        );
    }
    Ok(())
}

#[test]
fn hooks_that_miss_the_childs_writes_stop_observe() -> Result<()> {
    if !privileged("hooks_that_miss_the_childs_writes_stop_observe") {
        return Ok(());
    }
    let sleeper = Sleeper::start()?;
    let json = std::env::temp_dir().join(format!("spice-selftest-f-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&json);
    let before = settled_programs()?;
    let out = observe(sleeper.0.id(), &json, true)?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "observe succeeded: {err}");
    ensure!(
        err.contains("start-up self-test failed")
            && err.contains(&format!("hook set `{}`", expected_hook_set())),
        "stderr does not name the failed self-test and its hook set: {err}"
    );
    // Only the SET_ACK was written with write(2).
    ensure!(
        err.contains("server_sent: 1,"),
        "stderr does not give the count: {err}"
    );
    // observe truncates the file at start (a bad path fails early); no report follows.
    let written = std::fs::read_to_string(&json).unwrap_or_default();
    let _ = std::fs::remove_file(&json);
    ensure!(written.is_empty(), "a report was written: {written}");
    // Released with the process's descriptors (after an RCU grace period: polled).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = spice_programs()?;
        if within(&left, &before) {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "programs left loaded: before {before:?}, after {left:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The `spice_*` programs loaded once two reads 300 ms apart agree (within 10 s): those of an
/// observer that exited just before (the previous test's) go with an RCU grace period, and a
/// snapshot taken meanwhile held some of them (seen in the `.ci/run` pass under `syscalls`).
fn settled_programs() -> Result<Vec<String>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = spice_programs()?;
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = spice_programs()?;
        if now == last || Instant::now() > deadline {
            return Ok(now);
        }
        last = now;
    }
}

/// Whether every program of `left` (sorted names) is one of `before`, counted with
/// repetition: nothing this test loaded is still there.
fn within(left: &[String], before: &[String]) -> bool {
    let mut rest = before.to_vec();
    left.iter().all(|p| match rest.iter().position(|b| b == p) {
        Some(i) => {
            rest.remove(i);
            true
        }
        None => false,
    })
}
