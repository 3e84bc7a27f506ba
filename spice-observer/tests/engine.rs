//! The engine API ([`spice_observer::pipeline::Engine`]) in process, against real `spice-peer`
//! processes over real TCP: the counts of a snapshot against the peer's own SUMMARY, two
//! snapshots at one instant equal, counters that never decrease, the kernel's per-program
//! run-time statistics, `release_reported` freeing what a snapshot reported, and `unwatch`
//! stopping the kernel's records for a process that keeps sending.
//!
//! Privileged (loads BPF): run under the machine-wide lock, one test at a time.

mod common;

use std::time::Duration;

use anyhow::{Result, anyhow, ensure};
use common::{
    check_run,
    peer::{Client, Server},
    privileged,
    summary::{PeerSummary, parse_summary},
};
use spice_observer::{
    pipeline::{Engine, EngineOptions, monotonic_ns},
    report::{ChannelReport, Report},
};

/// Runs the engine's loop (drain on readiness, a sample every 100 ms) until `done` or `max`.
async fn run_until(engine: &mut Engine, max: Duration, mut done: impl FnMut() -> bool) {
    let end = tokio::time::Instant::now() + max;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            r = engine.drain_ready() => r.unwrap(),
            _ = tick.tick() => {
                engine.sample(monotonic_ns());
                if done() {
                    break;
                }
            }
            _ = tokio::time::sleep_until(end) => break,
        }
    }
    engine.drain();
}

/// spice-server's display socket of process `pid` in the report.
fn display_of(r: &Report, pid: u32) -> Result<&ChannelReport> {
    let v: Vec<_> = r
        .channels
        .iter()
        .filter(|c| {
            c.pid == pid && c.channel_type == "display" && c.end.as_deref() == Some("server")
        })
        .collect();
    ensure!(v.len() == 1, "pid {pid}: {} display sockets", v.len());
    Ok(v[0])
}

#[test]
fn engine_api_against_real_peers() -> Result<()> {
    const T: &str = "engine_api_against_real_peers";
    if !privileged(T) {
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut engine = match Engine::start(EngineOptions {
            sample: Duration::from_millis(100),
            retain_closed: false,
            bpf_stats: true,
            hook_set: spice_observer::loader::HookChoice::Auto,
        }) {
            Ok(e) => e,
            Err(e) if format!("{e:#}").contains(common::UNAVAILABLE) => {
                eprintln!("{}", common::cannot_run(T, &format!("{e:#}")));
                assert!(!common::ci(), "{e:#}");
                return Ok(());
            }
            Err(e) => return Err(e),
        };

        // --- Pair A: a finished exchange, its snapshot against the peer's own counts.
        let mut a = Server::start(&["--set-ack", "--window", "20", "--messages", "5000"])?;
        let w = engine.watch(a.pid())?;
        ensure!(w.pid == a.pid() && w.existing_connections == 0, "{w:?}");
        ensure!(engine.watch(a.pid())? == w, "watch is not idempotent");
        let mut ca = Client::start(a.port, &[])?;
        let out = a.collect();
        run_until(&mut engine, Duration::from_secs(15), || out.is_finished()).await;
        let text = out.join().map_err(|_| anyhow!("reader thread"))?;
        let sa: PeerSummary = parse_summary(&text, "server A")?;
        let status = a.child.wait()?;
        ensure!(
            status.success() && sa.error.is_none(),
            "server A failed ({status}): error {:?}",
            sa.error
        );
        ca.child.wait()?;
        // Let the close records arrive.
        run_until(&mut engine, Duration::from_millis(300), || false).await;
        let now = monotonic_ns();
        let r1 = engine.snapshot(now);
        let r2 = engine.snapshot(now);
        ensure!(
            serde_json::to_value(&r1)? == serde_json::to_value(&r2)?,
            "two snapshots at the same instant differ"
        );
        check_run(&r1)?;
        let c = display_of(&r1, a.pid())?;
        ensure!(
            c.messages_sent == sa.sent.messages && c.messages_received == sa.received.messages,
            "observer {}/{} messages, peer {}/{}",
            c.messages_sent,
            c.messages_received,
            sa.sent.messages,
            sa.received.messages
        );
        ensure!(c.closed, "socket not closed: {c:?}");
        let h = c
            .in_flight_histogram
            .as_ref()
            .ok_or_else(|| anyhow!("no histogram"))?;
        // One generation, a peer that obeys the gate: every second observed is at or below
        // 2W+1, and the histogram's time is the generation's.
        let at_limit = h.le.iter().position(|&b| b == 41).unwrap();
        ensure!(
            (h.seconds[at_limit] - h.count).abs() < 1e-9 && h.count > 0.0,
            "{h:?}"
        );
        ensure!(
            c.stalls_total == c.stalls,
            "{} vs {}",
            c.stalls_total,
            c.stalls
        );
        let later = engine.snapshot(now + 1_000_000_000);
        let c2 = display_of(&later, a.pid())?;
        ensure!(
            c2.stalled_seconds_total == c.stalled_seconds_total
                && c2.in_flight_histogram == c.in_flight_histogram,
            "a closed socket's accounting moved after its close"
        );
        // The kernel ran the programs, and said so.
        let ps = engine.program_stats();
        let send = ps
            .iter()
            .find(|p| p.name == "spice_sock_send")
            .ok_or_else(|| anyhow!("no spice_sock_send in {ps:?}"))?;
        ensure!(send.run_count > 0 && send.run_time_ns > 0, "{ps:?}");
        // Server A has exited: unwatching it is no error, and it is no longer listed.
        engine.unwatch(a.pid())?;
        ensure!(engine.watched().is_empty(), "{:?}", engine.watched());
        // The snapshot reported the closed socket: released now.
        let before = engine.stats();
        ensure!(before.sockets >= 1 && before.chains >= 1, "{before:?}");
        engine.release_reported();
        let after = engine.stats();
        ensure!(
            after.sockets == 0 && after.chains == 0,
            "{before:?} -> {after:?}"
        );

        // --- Pair B: a process that keeps sending; unwatch stops its records.
        let mut b = Server::start(&[
            "--set-ack",
            "--window",
            "20",
            "--messages",
            "100000",
            "--interval-ms",
            "2",
        ])?;
        engine.watch(b.pid())?;
        let mut cb = Client::start(b.port, &[])?;
        run_until(&mut engine, Duration::from_secs(1), || false).await;
        let sent = |r: &Report| display_of(r, b.pid()).map(|c| c.messages_sent);
        let n1 = sent(&engine.snapshot(monotonic_ns()))?;
        ensure!(n1 > 50, "pair B sent only {n1} messages in 1 s");
        engine.unwatch(b.pid())?;
        ensure!(engine.watched().is_empty(), "{:?}", engine.watched());
        // Records already in the ring arrive; then nothing more for a second.
        run_until(&mut engine, Duration::from_millis(200), || false).await;
        let n2 = sent(&engine.snapshot(monotonic_ns()))?;
        let records = engine.stats().records;
        run_until(&mut engine, Duration::from_secs(1), || false).await;
        let n3 = sent(&engine.snapshot(monotonic_ns()))?;
        ensure!(
            n3 == n2 && engine.stats().records == records,
            "records after unwatch: {n1} -> {n2} -> {n3} messages, {records} -> {} records",
            engine.stats().records
        );
        // The snapshot after the unwatch included its sockets: released.
        engine.release_reported();
        ensure!(engine.stats().sockets == 0, "{:?}", engine.stats());
        let _ = b.child.kill();
        let _ = cb.child.kill();
        let _ = b.child.wait();
        let _ = cb.child.wait();
        Ok(())
    })
}
