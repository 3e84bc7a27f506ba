//! Privileged tests of the daemon's pinned kernel state (README "Restarts and pinned state"):
//! a real Xspice session through socat with a spice-gtk client, the daemon killed (SIGKILL),
//! stopped (SIGTERM) and restarted in place (SIGUSR2, exit status 75) and started again while
//! it runs, and reloaded (SIGHUP) with a new sample period. Scrapes of /metrics are read into
//! typed samples (the `prometheus-parse` crate); the totals are compared with the relay's legs
//! and with a packet capture of the server leg, framed by this test's own SPICE parser
//! (`tests/common/oracle.rs` for the server → client messages, [`oracle::c2s_messages`] for the
//! client's), which shares no code with the observer.
//!
//! Ports 5955/6955 and 5956/6956, displays :55 and :56, daemon on 127.0.0.1:19593. Each test
//! has its own pin directory (`common::PinDir`). Run serially under the machine-wide lock
//! (`--test-threads=1`).

mod common;

use std::{
    collections::BTreeMap,
    path::Path,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, ensure};
use common::daemon::{self, Daemon, OnDrop, Scrape, TotalKey, http_get};
use common::{Client, PinDir, Rig, oracle, privileged};

const LISTEN: &str = "127.0.0.1:19593";

/// The test-only layout override (`spice_observer::loader::LAYOUT_VERSION_OVERRIDE_ENV`).
const OVERRIDE: &str = spice_observer::loader::LAYOUT_VERSION_OVERRIDE_ENV;

/// Starts `daemon --config CONFIG --pin-dir PINS` (on [`LISTEN`]) with `env`; waits for its
/// start line. SIGKILLed if still running when dropped (the test stops it explicitly
/// otherwise, [`Daemon::stop`]).
fn start_daemon(config: &Path, pins: &Path, env: &[(&str, &str)]) -> Result<Daemon> {
    let mut env = env.to_vec();
    env.push(("RUST_LOG", "warn,spice_observer=info"));
    Daemon::start(config, pins, &env, OnDrop::Kill)
}

/// `later` continues `earlier`: the same series, none smaller (no reset).
fn continues(
    earlier: &BTreeMap<TotalKey, f64>,
    later: &BTreeMap<TotalKey, f64>,
    what: &str,
) -> Result<()> {
    for (k, v) in earlier {
        let w = later
            .get(k)
            .ok_or_else(|| anyhow!("{what}: series {k:?} gone"))?;
        ensure!(w >= v, "{what}: {k:?} went from {v} to {w} (reset)");
    }
    Ok(())
}

fn write_config(rig: &Rig) -> Result<std::path::PathBuf> {
    write_config_sample(rig, 100)
}

/// The test's config file with `sample_ms` = `sample_ms`.
fn write_config_sample(rig: &Rig, sample_ms: u64) -> Result<std::path::PathBuf> {
    let path = rig.state.join("spice-observer.toml");
    std::fs::write(
        &path,
        format!(
            "listen = \"{LISTEN}\"\nsample_ms = {sample_ms}\nscan_ms = 500\nbpf_stats = false\n\
             [discovery]\nqemu = false\nxspice = true\nrelays = [{{ name = \"socat\" }}]\n"
        ),
    )?;
    Ok(path)
}

/// The landing page (`GET /`), answered with status 200.
fn landing() -> Result<String> {
    let (code, page) = http_get(LISTEN, "/")?;
    ensure!(code == 200, "/: {code} {page}");
    Ok(page)
}

/// What the test does to the daemon mid-session.
#[derive(Debug, Clone, Copy)]
enum Event {
    /// SIGKILL, then a new daemon on the same pins.
    Kill,
    /// SIGTERM (exit 0, pins kept), then a new daemon.
    Term,
    /// SIGHUP with `sample_ms` changed in the config file: the same daemon goes on.
    Reload,
    /// SIGUSR2: the restart in place (exit 75, pins kept), then a new daemon.
    RestartInPlace,
}

/// [`oracle::c2s_messages`] with each message's first 4 body bytes (little-endian; 0 if the
/// body is shorter): (type, first body word, bytes with the header, stream offset of the
/// header) in order. An error if a body of 4 bytes or more is cut by the capture's end.
fn c2s_messages(c: &oracle::SpiceConn) -> Result<Vec<(u16, u32, u64, u64)>> {
    let b = &c.conn.c2s.bytes;
    let hdr = if c.mini_header { 6 } else { 18 };
    oracle::c2s_messages(c)?
        .into_iter()
        .map(|(ty, len, at)| {
            let first = if len >= hdr + 4 {
                let at = (at + hdr) as usize;
                let s = b
                    .get(at..at + 4)
                    .ok_or_else(|| anyhow!("client stream ends before {}", at + 4))?;
                u32::from_le_bytes(s.try_into().unwrap())
            } else {
                0
            };
            Ok((ty, first, len, at))
        })
        .collect()
}

/// spice-server's in-flight count at the end of a captured display or cursor connection, by
/// the window rule (docs/spice-protocol.md §3): 1 + the server messages after the last
/// SET_ACK (type 3, body: generation, W), minus W per client ACK (type 2) after an ACK_SYNC
/// (type 1) of that generation. Assumes nothing was in transit when the capture stopped (the
/// session was idle), counting only the messages whose header the capture saw by `until`
/// (epoch seconds). Returns (in flight, W).
fn capture_in_flight(c: &oracle::SpiceConn, until: f64) -> Result<(i64, i64)> {
    let seen = |d: &oracle::Direction, off: u64| d.first_seen(off).is_some_and(|t| t <= until);
    let s = &c.conn.s2c.bytes;
    let hdr = if c.mini_header { 6 } else { 18 };
    let i = c
        .messages
        .iter()
        .rposition(|m| m.ty == 3)
        .ok_or_else(|| anyhow!("no SET_ACK in the capture"))?;
    let body = c.messages[i].start as usize + hdr;
    let word = |at: usize| -> Result<u32> {
        Ok(u32::from_le_bytes(
            s.get(at..at + 4)
                .ok_or_else(|| anyhow!("SET_ACK body cut"))?
                .try_into()
                .unwrap(),
        ))
    };
    let (generation, w) = (word(body)?, word(body + 4)? as i64);
    let started = c.messages[i..]
        .iter()
        .filter(|m| seen(&c.conn.s2c, m.start))
        .count() as i64;
    let mut synced = false;
    let mut acks = 0i64;
    for (ty, first, _, at) in c2s_messages(c)? {
        if !seen(&c.conn.c2s, at) {
            continue;
        }
        match ty {
            1 => synced = first == generation,
            2 if synced => acks += 1,
            _ => {}
        }
    }
    Ok(((started - w * acks).max(0), w))
}

/// (restart, scrape request and answer times in epoch seconds, (channel, in-flight count)).
type InFlightAt = (usize, f64, f64, Vec<(String, f64)>);

/// The lowest and highest in-flight count of [`capture_in_flight`] between `from` and `to`
/// (epoch seconds): at both ends and at every captured message header in between.
fn in_flight_range(c: &oracle::SpiceConn, from: f64, to: f64) -> Result<(i64, i64)> {
    let mut times = vec![from, to];
    let inside = |t: Option<f64>| t.filter(|t| (from..=to).contains(t));
    times.extend(
        c.messages
            .iter()
            .filter_map(|m| inside(c.conn.s2c.first_seen(m.start))),
    );
    for m in c2s_messages(c)? {
        times.extend(inside(c.conn.c2s.first_seen(m.3)));
    }
    let mut lo = i64::MAX;
    let mut hi = i64::MIN;
    for t in times {
        let (n, _) = capture_in_flight(c, t)?;
        lo = lo.min(n);
        hi = hi.max(n);
    }
    Ok((lo, hi))
}

/// Mid-session, while the animation runs: the daemon killed with SIGKILL, stopped with
/// SIGTERM, reloaded with SIGHUP (config `sample_ms` 100 -> 50: the log says it was applied
/// and the landing page shows it) and restarted in place with SIGUSR2 (exit status 75, the
/// pins and programs still there after the exit, the log says why it exited), each stop
/// followed by a new daemon on the same pins that says it continues them; then SIGKILLed
/// once more while the session is idle: every
/// message and byte total continues (no series resets at a restart or the reload); at the end each
/// channel's server → client and client → server message and byte totals on spice-server's
/// socket and on the relay's two legs equal the packet capture's up to the scrape (the
/// messages whose header the capture saw between the scrape's request and answer, ±50 ms,
/// may go either way; idle, that is normally none), and spice-server's in-flight count on
/// display and cursor, scraped right after the last restart, equals the capture's count,
/// and the one scraped right after each mid-session event is within one message of the range
/// the capture goes through over that scrape. Finally `daemon --unpin` removes the pin directory, and no `spice_` program is left.
#[test]
fn restart_continues_counts_exactly() -> Result<()> {
    const T: &str = "restart_continues_counts_exactly";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let pins = PinDir::new(T)?;
    let config = write_config(&rig)?;
    let vm = "xspice-55";
    let mut d = start_daemon(&config, &pins.path, &[])?;
    d.wait_line(|l| l.contains("loaded and pinned"), Duration::ZERO)
        .context("first start did not load")?;
    let mut cap = oracle::Capture::start(rig.state.join("server.pcapng"), None, "lo", &[5955])?;
    let xorg = rig.xspice_rects(5955, 55, 12)?;
    let relay = rig.relay("socat", "127.0.0.1", 6955, "127.0.0.1", 5955)?;
    d.wait_found(&[(vm, xorg), ("socat", relay)])?;
    let t0 = Instant::now();
    let _client = Client::start("spice://127.0.0.1:6955", 60, &[], None)?;

    let epoch = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    let mut last = BTreeMap::new();
    // (restart, scrape request time, answer time, display and cursor in-flight counts) of
    // the first scrape after each restart during traffic, checked against the capture.
    let mut mid: Vec<InFlightAt> = Vec::new();
    // Each event at its time (ms after the client's start); the animation runs to 12 s.
    let events = [
        (3000u64, Event::Kill),
        (5500, Event::Term),
        (8000, Event::Reload),
        (10000, Event::RestartInPlace),
    ];
    for (restarts, (at, event)) in events.into_iter().enumerate() {
        thread::sleep(Duration::from_millis(at).saturating_sub(t0.elapsed()));
        ensure!(
            t0.elapsed() < Duration::from_millis(11_500),
            "{event:?} at {:?}: not during the animation (the restarts before took too long)",
            t0.elapsed()
        );
        println!("restart {restarts}: {event:?} at {:?}", t0.elapsed());
        let before = Scrape::take(LISTEN)?;
        before.check_run(0.0)?;
        let b = before.vm_totals(vm);
        ensure!(
            b.keys().any(|k| k.2 == "display"),
            "no display totals before restart {restarts}: {b:?}"
        );
        continues(&last, &b, "before restart")?;
        match event {
            Event::Reload => {
                write_config_sample(&rig, 50)?;
                d.signal(libc::SIGHUP);
                let line = d.wait_line(
                    |l| l.contains("reloaded ") && l.contains("applied sample_ms: 100 -> 50"),
                    Duration::from_secs(5),
                )?;
                println!("restart {restarts}: {line}");
                let page = landing()?;
                ensure!(
                    page.contains("sample_ms 50,"),
                    "the landing page does not show the reloaded sample_ms:\n{page}"
                );
                ensure!(d.exited()?.is_none(), "the daemon exited at SIGHUP");
            }
            Event::Kill | Event::Term | Event::RestartInPlace => {
                let signal = match event {
                    Event::Kill => libc::SIGKILL,
                    Event::Term => libc::SIGTERM,
                    _ => libc::SIGUSR2,
                };
                let (st, log) = d.stop(signal)?;
                println!("daemon stopped by signal {signal}: {st:?}");
                if let Event::RestartInPlace = event {
                    use std::os::unix::process::ExitStatusExt;
                    ensure!(
                        st.code() == Some(spice_observer::cmd::daemon::EXIT_RESTART)
                            && st.signal().is_none(),
                        "SIGUSR2: exit status {st:?}, expected code 75"
                    );
                    let said = log
                        .iter()
                        .find(|l| l.contains("restart in place"))
                        .ok_or_else(|| anyhow!("SIGUSR2: no restart line in {log:?}"))?;
                    println!("restart {restarts}: {said}");
                    let pinned: Vec<String> = std::fs::read_dir(&pins.path)
                        .with_context(|| format!("SIGUSR2 removed {}", pins.path.display()))?
                        .filter_map(|e| e.ok())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect();
                    for name in ["SOCKETS", "LAYOUT", "EVENTS", "link_spice_sock_send"] {
                        ensure!(
                            pinned.iter().any(|n| n == name),
                            "SIGUSR2: {name} not pinned any more: {pinned:?}"
                        );
                    }
                    ensure!(
                        !common::spice_programs()?.is_empty(),
                        "SIGUSR2: no spice_ program loaded after the exit"
                    );
                }
                // Traffic goes on with no daemon for a moment: the programs keep framing it.
                thread::sleep(Duration::from_millis(700));
                d = start_daemon(&config, &pins.path, &[])?;
                let line = d.wait_line(
                    |l| l.contains("continuing the kernel state"),
                    Duration::ZERO,
                )?;
                println!("restart {restarts}: {line}");
            }
        }
        let t_a = epoch();
        let after = Scrape::take(LISTEN)?;
        let t_b = epoch();
        let mut counts = Vec::new();
        for ty in ["display", "cursor"] {
            let n = after.one(
                "spice_observer_in_flight_now_messages",
                &[
                    ("vm", vm),
                    ("leg", "server"),
                    ("channel", ty),
                    ("channel_id", "0"),
                ],
            )?;
            counts.push((ty.to_string(), n));
        }
        mid.push((restarts, t_a, t_b, counts));
        after.check_run(0.0)?;
        let a = after.vm_totals(vm);
        continues(&b, &a, &format!("restart {restarts} ({event:?})"))?;
        let disp = |m: &BTreeMap<_, f64>| {
            m.get(&(
                "spice_observer_messages_total".to_string(),
                "server".to_string(),
                "display".to_string(),
                "0".to_string(),
                "server_to_client".to_string(),
            ))
            .copied()
        };
        println!(
            "restart {restarts}: display messages {:?} before, {:?} right after",
            disp(&b),
            disp(&a)
        );
        last = a;
    }

    // The animation ends at 12 s; at 17 s the session is idle (spice-server pings each
    // channel 15 s after its start when idle: not in the middle of the comparison).
    thread::sleep(Duration::from_secs(17).saturating_sub(t0.elapsed()));
    let idle = Scrape::take(LISTEN)?;
    continues(&last, &idle.vm_totals(vm), "before the idle restart")?;
    d.stop(libc::SIGKILL)?;
    d = start_daemon(&config, &pins.path, &[])?;
    d.wait_line(
        |l| l.contains("continuing the kernel state"),
        Duration::ZERO,
    )?;
    // One sample after the restart.
    thread::sleep(Duration::from_millis(150));
    let t_a = epoch();
    let end = Scrape::take(LISTEN)?;
    let t_b = epoch();
    end.check_run(0.0)?;
    let totals = end.vm_totals(vm);
    continues(&idle.vm_totals(vm), &totals, "idle restart")?;
    // The capture runs on for a second, so that it holds every packet up to the scrape; only
    // messages seen by the scrape's time are counted (a ping may come in between).
    thread::sleep(Duration::from_secs(1));
    cap.stop()?;
    // Window of the comparison: a message counted by the scrape was captured before t_b plus
    // the send-to-capture latency; one captured before t_a minus the capture-to-read latency
    // was counted (the session is idle: nothing waits in a queue).
    const SLACK: f64 = 0.05;
    let (lo_t, hi_t) = (t_a - SLACK, t_b + SLACK);
    let conns = oracle::parse_capture(&cap.path)?;

    let mut compared = 0;
    let mut wrong = Vec::new();
    for c in &conns {
        let ty = oracle::type_name(c.channel_type);
        let id = c.channel_id.to_string();
        println!(
            "capture: {ty} {id} {} -> {}: {} server messages (types {:?}), {} trailing bytes",
            c.conn.c2s.src,
            c.conn.c2s.dst,
            c.messages.len(),
            c.messages.iter().map(|m| m.ty).take(20).collect::<Vec<_>>(),
            c.trailing
        );
        let window = (oracle::captured_by(c, lo_t)?, oracle::captured_by(c, hi_t)?);
        compared += daemon::compare_totals(&totals, c, window, &mut wrong)?;
        if ty == "display" || ty == "cursor" {
            let (a, w) = capture_in_flight(c, lo_t)?;
            let (b, _) = capture_in_flight(c, hi_t)?;
            let (lo, hi) = (a.min(b), a.max(b));
            let got = end.one(
                "spice_observer_in_flight_now_messages",
                &[
                    ("vm", vm),
                    ("leg", "server"),
                    ("channel", ty),
                    ("channel_id", &id),
                ],
            )?;
            println!(
                "{ty} {id} in flight right after the restart: daemon {got}, capture {lo}..={hi} (W {w})"
            );
            ensure!(
                lo as f64 <= got && got <= hi as f64,
                "{ty} {id}: in flight {got} after the restart, capture {lo}..={hi}"
            );
        }
    }
    // In flight right after each restart during traffic: within the range the capture shows
    // over the scrape's request-to-answer interval (±50 ms), plus one message either way.
    for (restart, t_a, t_b, counts) in &mid {
        for (ty, got) in counts {
            let c = conns
                .iter()
                .find(|c| oracle::type_name(c.channel_type) == ty && c.channel_id == 0)
                .ok_or_else(|| anyhow!("no {ty} connection in the capture"))?;
            let (lo, hi) = in_flight_range(c, t_a - SLACK, t_b + SLACK)?;
            let line = format!(
                "restart {restart}: {ty} in flight {got} right after, capture {lo}..={hi} over the scrape"
            );
            println!("{line}");
            if *got < (lo - 1) as f64 || *got > (hi + 1) as f64 {
                wrong.push(line);
            }
        }
    }
    ensure!(
        wrong.is_empty(),
        "differences from the capture:\n{}",
        wrong.join("\n")
    );
    ensure!(
        conns
            .iter()
            .any(|c| c.channel_type == 2 && c.messages.len() > 100),
        "display traffic in the capture"
    );
    ensure!(compared >= 48, "compared {compared} totals");

    // SIGTERM leaves the pins, and the programs stay loaded; --unpin removes everything.
    d.stop(libc::SIGTERM)?;
    ensure!(
        pins.path.join("SOCKETS").exists(),
        "SIGTERM removed the pins"
    );
    ensure!(
        !common::spice_programs()?.is_empty(),
        "no spice_ program while pinned"
    );
    let said = pins.unpin()?;
    println!("--unpin: {}", said.trim());
    ensure!(said.contains("removed"), "--unpin said {said:?}");
    ensure!(!pins.path.exists(), "{} still exists", pins.path.display());
    let again = pins.unpin()?;
    ensure!(
        again.contains("nothing pinned"),
        "second --unpin said {again:?}"
    );
    // Program release is asynchronous (RCU); give it a moment.
    let t = Instant::now();
    let mut left = common::spice_programs()?;
    while !left.is_empty() && t.elapsed() < Duration::from_secs(3) {
        thread::sleep(Duration::from_millis(100));
        left = common::spice_programs()?;
    }
    ensure!(
        left.is_empty(),
        "spice_ programs left after --unpin: {left:?}"
    );
    Ok(())
}

/// A daemon of another layout version (the test-only override) finds the pins of this one:
/// it removes them, loads afresh and joins every connection the old set was counting
/// mid-stream (hunting, then counted from a lock; never unparsed). A second daemon on the same
/// pins is then refused.
#[test]
fn restart_layout_mismatch_marks_restarted() -> Result<()> {
    const T: &str = "restart_layout_mismatch_marks_restarted";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    let pins = PinDir::new(T)?;
    let config = write_config(&rig)?;
    let vm = "xspice-56";
    let mut d = start_daemon(&config, &pins.path, &[])?;
    let xorg = rig.xspice(5956, 56, &["--mode", "rects", "--fps", "20"])?;
    let relay = rig.relay("socat", "127.0.0.1", 6956, "127.0.0.1", 5956)?;
    d.wait_found(&[(vm, xorg), ("socat", relay)])?;
    let _client = Client::start("spice://127.0.0.1:6956", 60, &[], None)?;
    thread::sleep(Duration::from_secs(3));
    let s = Scrape::take(LISTEN)?;
    s.check_run(0.0)?;
    let framed = s.find(
        "spice_observer_channel_info",
        &[("vm", vm), ("framing", "mini")],
    );
    ensure!(framed.len() >= 12, "framed channels before: {framed:?}");
    d.stop(libc::SIGKILL)?;

    let bumped = (spice_ebpf_common::config::LAYOUT_VERSION + 1).to_string();
    let mut d = start_daemon(&config, &pins.path, &[(OVERRIDE, &bumped)])?;
    let line = d.wait_line(
        |l| l.contains("reloaded the kernel programs"),
        Duration::ZERO,
    )?;
    ensure!(line.contains("layout version"), "{line}");
    // The old set's libssl links (about 100) go when their pins are removed, and the kernel
    // unregisters their uprobes in the background: while it does, each new process's 16
    // links took 0.4-1.4 s to attach here (5-30 ms otherwise), for socat's listener and each
    // of its per-connection children in turn.
    let t = Instant::now();
    d.wait_found_within(&[(vm, xorg), ("socat", relay)], Duration::from_secs(30))?;
    println!(
        "after the reload, found both in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    thread::sleep(Duration::from_millis(500));
    let s = Scrape::take(LISTEN)?;
    s.check_run(0.0)?;
    // The relay's legs are not paired with spice-server's sockets (their channels are
    // unknown): they carry the relay's name.
    let mut infos = s.find("spice_observer_channel_info", &[("vm", vm)]);
    infos.extend(s.find("spice_observer_channel_info", &[("vm", "socat")]));
    let framing: Vec<&str> = infos.iter().map(|x| x.labels["framing"].as_str()).collect();
    println!(
        "after the reload: {} connections of {vm}, framing {framing:?}",
        infos.len()
    );
    ensure!(infos.len() >= 12, "connections after the reload: {infos:?}");
    // Joined mid-stream like any connection open before a fresh start: hunting, or locked
    // (counted from the lock on), never unparsed and never counted from a wrong base.
    ensure!(
        framing.iter().all(|f| *f == "hunting" || *f == "mini"),
        "framing after the reload: {framing:?}"
    );
    ensure!(
        infos.iter().all(|x| x.labels["unparsed_reason"].is_empty()),
        "unparsed after the reload: {infos:?}"
    );
    ensure!(
        std::fs::read_dir(&pins.path)?.count() >= 18,
        "the reload did not pin a full set"
    );
    // A second daemon on the same pins is refused while this one runs (another listen
    // address, so that only the pin lock can refuse it).
    let second = Command::new(env!("CARGO_BIN_EXE_spice-observer"))
        .args(["daemon", "--listen", "127.0.0.1:19594", "--pin-dir"])
        .arg(&pins.path)
        .output()?;
    let said = String::from_utf8_lossy(&second.stderr);
    ensure!(
        !second.status.success() && said.contains("another spice-observer daemon"),
        "second daemon on the same pins: {} {said}",
        second.status
    );
    d.stop(libc::SIGTERM)?;
    Ok(())
}

/// `spice-observer daemon ARGS…` run to its end: (success, stdout, stderr).
fn run_bin(args: &[&str], pins: &Path) -> Result<(bool, String, String)> {
    let out = Command::new(env!("CARGO_BIN_EXE_spice-observer"))
        .arg("daemon")
        .args(["--pin-dir", pins.to_str().unwrap()])
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// `bpftool map create DIR/NAME type hash key 4 value 4 entries 4 name NAME`: a pin of
/// another tool (or, with one of the daemon's names, a stale pin of the wrong shape).
fn foreign_map(dir: &Path, name: &str) -> Result<()> {
    common::sh(Command::new("bpftool").args([
        "map",
        "create",
        dir.join(name).to_str().unwrap(),
        "type",
        "hash",
        "key",
        "4",
        "value",
        "4",
        "entries",
        "4",
        "name",
        &name.to_lowercase(),
    ]))?;
    Ok(())
}

/// Waits up to 20 s for a daemon that must refuse to start: its stderr as one text. An error
/// if it is still running (it did not refuse) or exited 0.
fn refused(mut d: Daemon, what: &str) -> Result<String> {
    let (st, lines) = d
        .wait_exit(Duration::from_secs(20))
        .with_context(|| format!("{what}: the daemon did not refuse to start"))?;
    ensure!(!st.success(), "{what}: the daemon exited {st}");
    Ok(lines.join("\n"))
}

/// A pin directory holding another tool's pin (made by bpftool) and a subdirectory with a pin
/// in it, beside a stale pin of the daemon's own name: the daemon refuses to start and
/// `--unpin` refuses, each naming the foreign entries and asking for a dedicated directory,
/// and every entry is still there afterwards (bpftool can read the foreign map). Once the
/// foreign entries are moved away the daemon starts, reloading (the stale pin is its own),
/// and scrapes clean. A layout override that is not a number stops the daemon with an error
/// naming the variable.
#[test]
fn restart_foreign_pins_are_never_removed() -> Result<()> {
    const T: &str = "restart_foreign_pins_are_never_removed";
    if !privileged(T) {
        return Ok(());
    }
    let rig = Rig::new(T)?;
    let config = write_config(&rig)?;
    // A failed run leaves its foreign entries, which PinDir's --unpin refuses to remove.
    let _ = std::fs::remove_dir_all(format!("/sys/fs/bpf/spice-observer-test-{T}"));
    let pins = PinDir::new(T)?;
    std::fs::create_dir_all(pins.path.join("inner"))?;
    foreign_map(&pins.path, "FOREIGN_MAP")?;
    foreign_map(&pins.path.join("inner"), "INNER")?;
    foreign_map(&pins.path, "SOCKETS")?;
    let entries = ["FOREIGN_MAP", "inner", "inner/INNER", "SOCKETS"];
    let all_there = || -> Result<()> {
        for e in entries {
            ensure!(pins.path.join(e).exists(), "{e} was removed");
        }
        common::sh(Command::new("bpftool").args([
            "map",
            "show",
            "pinned",
            pins.path.join("FOREIGN_MAP").to_str().unwrap(),
        ]))?;
        Ok(())
    };
    let names_them = |t: &str, what: &str| -> Result<()> {
        ensure!(
            t.contains("FOREIGN_MAP") && t.contains("inner/") && t.contains("dedicated"),
            "{what} does not name the foreign entries: {t}"
        );
        ensure!(!t.contains("SOCKETS,"), "{what} calls SOCKETS foreign: {t}");
        Ok(())
    };

    let mut cmd = Command::new(env!("CARGO_BIN_EXE_spice-observer"));
    cmd.args(["daemon", "--config"])
        .arg(&config)
        .arg("--pin-dir")
        .arg(&pins.path)
        .env("RUST_BACKTRACE", "0");
    let text = refused(Daemon::spawn(cmd, OnDrop::Kill, "daemon")?, "daemon start")?;
    names_them(&text, "the daemon's error")?;
    all_there()?;

    let (ok, out, err) = run_bin(&["--unpin"], &pins.path)?;
    ensure!(!ok, "--unpin on a foreign directory succeeded: {out} {err}");
    names_them(&err, "--unpin's error")?;
    all_there()?;

    let mut cmd = Command::new(env!("CARGO_BIN_EXE_spice-observer"));
    cmd.args(["daemon", "--config"])
        .arg(&config)
        .arg("--pin-dir")
        .arg(&pins.path)
        .env("RUST_BACKTRACE", "0")
        .env(OVERRIDE, "abc");
    std::fs::remove_file(pins.path.join("FOREIGN_MAP"))?;
    std::fs::remove_file(pins.path.join("inner/INNER"))?;
    std::fs::remove_dir(pins.path.join("inner"))?;
    let text = refused(Daemon::spawn(cmd, OnDrop::Kill, "daemon")?, "override abc")?;
    ensure!(
        text.contains(OVERRIDE) && text.contains("\"abc\""),
        "override abc: {text}"
    );

    let mut d = start_daemon(&config, &pins.path, &[])?;
    d.wait_line(
        |l| l.contains("reloaded the kernel programs"),
        Duration::from_secs(5),
    )?;
    Scrape::take(LISTEN)?.check_run(0.0)?;
    let (st, _) = d.stop(libc::SIGTERM)?;
    ensure!(st.success(), "SIGTERM: {st}");
    Ok(())
}

/// `--unpin` while a daemon runs on the pins: refused (exit status not 0, the error says a
/// daemon is running and names --force), every pin and `spice_` program still there and the
/// daemon still serving clean scrapes; `--unpin --force` then removes the directory, and the
/// daemon exits 0 on SIGTERM.
#[test]
fn restart_unpin_refused_while_running() -> Result<()> {
    const T: &str = "restart_unpin_refused_while_running";
    if !privileged(T) {
        return Ok(());
    }
    let rig = Rig::new(T)?;
    let config = write_config(&rig)?;
    let pins = PinDir::new(T)?;
    let d = start_daemon(&config, &pins.path, &[])?;
    let before: Vec<_> = std::fs::read_dir(&pins.path)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()?;
    ensure!(
        before.iter().any(|n| n == "LAYOUT") && before.iter().any(|n| n == "link_spice_sock_send"),
        "pins: {before:?}"
    );
    let (ok, out, err) = run_bin(&["--unpin"], &pins.path)?;
    ensure!(
        !ok,
        "--unpin beside a running daemon succeeded: {out} {err}"
    );
    ensure!(
        err.contains("running") && err.contains("--force"),
        "--unpin's error: {err}"
    );
    let after: Vec<_> = std::fs::read_dir(&pins.path)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()?;
    ensure!(
        after.len() == before.len(),
        "pins {before:?} became {after:?}"
    );
    ensure!(
        !common::spice_programs()?.is_empty(),
        "no spice_ program attached"
    );
    Scrape::take(LISTEN)?.check_run(0.0)?;

    let (ok, out, err) = run_bin(&["--unpin", "--force"], &pins.path)?;
    ensure!(
        ok && out.contains("removed"),
        "--unpin --force: {out} {err}"
    );
    ensure!(!pins.path.exists(), "--unpin --force left {:?}", pins.path);
    let (st, _) = d.stop(libc::SIGTERM)?;
    ensure!(st.success(), "SIGTERM: {st}");
    Ok(())
}

/// The pin directory as the unit sees it (`ReadWritePaths=` bind-mounts it), emulated with
/// `unshare -m` and `mount --bind DIR DIR`: `--unpin` after a daemon's SIGTERM exits 0,
/// removes every pin (no `spice_` program left attached) and says at info level that the
/// directory, a mount point, stays; outside the namespace the directory is there and empty.
#[test]
fn restart_unpin_bind_mounted_pin_dir() -> Result<()> {
    const T: &str = "restart_unpin_bind_mounted_pin_dir";
    if !privileged(T) {
        return Ok(());
    }
    let rig = Rig::new(T)?;
    let config = write_config(&rig)?;
    let pins = PinDir::new(T)?;
    let d = start_daemon(&config, &pins.path, &[])?;
    // Served once the loop runs: its SIGTERM handler is installed.
    Scrape::take(LISTEN)?.check_run(0.0)?;
    let (st, _) = d.stop(libc::SIGTERM)?;
    ensure!(st.success(), "SIGTERM: {st}");
    ensure!(
        !common::spice_programs()?.is_empty(),
        "pins gone after SIGTERM"
    );
    let p = pins.path.to_str().unwrap();
    let out = Command::new("unshare")
        .args(["-m", "sh", "-c"])
        .arg(format!(
            "mount --bind {p} {p} && exec {} daemon --pin-dir {p} --unpin",
            env!("CARGO_BIN_EXE_spice-observer")
        ))
        .env("RUST_LOG", "warn,spice_observer=info")
        .output()?;
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    ensure!(out.status.success(), "--unpin on a bind mount: {out:?}");
    ensure!(so.contains("removed"), "--unpin said {so:?}");
    ensure!(
        se.contains("INFO") && se.contains("mount point"),
        "no info line about the mount point: {se:?}"
    );
    let left: Vec<_> = std::fs::read_dir(&pins.path)?.collect();
    ensure!(left.is_empty(), "left in {p}: {left:?}");
    let mut progs = common::spice_programs()?;
    let t0 = Instant::now();
    while !progs.is_empty() && t0.elapsed() < Duration::from_secs(5) {
        thread::sleep(Duration::from_millis(100));
        progs = common::spice_programs()?;
    }
    ensure!(progs.is_empty(), "programs still attached: {progs:?}");
    Ok(())
}
