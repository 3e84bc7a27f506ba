//! Privileged tests of the byte figures every watched socket gets, framed or not
//! (`bytes_written_total`, `bytes_read_total`: the kernel's `DirState::pos` of each direction),
//! on connections the observer joins mid-stream, checked against sources outside the observer:
//! the TCP stack's own byte counters as `ss` (iproute2) reads them, and the counts of the peers
//! that sent and received the bytes.
//!
//! The tests open their connections before the observer starts, let them go idle, start the
//! observer, make traffic, and let it go idle again before the observer's last read: the bytes
//! the watched process moved in between are then exactly the difference of the external
//! counts taken before the observer started and after it ended. The spice session has one
//! source of traffic the tests do not make, spice-server's latency PING and its PONG: the
//! test reads the counters on both sides of the observer's start and of its end, and each
//! direction must equal exactly the difference of one reading at each.
//! Run serially (`--test-threads=1`); each test uses its own ports and display.

mod common;

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    process::{Child, ChildStdin, Command, Stdio},
    sync::mpsc,
    thread,
    time::Duration,
};

use anyhow::{Context, Result, bail, ensure};
use common::daemon::{Daemon, OnDrop, Scrape};
use common::{Client, Rig, check_run, describe_ch, draw, privileged};
use spice_observer::report::{ChannelReport, Report};

/// Bytes one socket's owner wrote and read over the connection's life, from the TCP stack:
/// written = `bytes_acked` + Send-Q (`tcpi_bytes_acked` counts what the peer acknowledged,
/// `write_seq − snd_una` is the rest: together `write_seq` less the initial sequence), read =
/// `bytes_received` − Recv-Q (`rcv_nxt` less the initial sequence, minus what the
/// application has not read: `copied_seq`). RFC 4898 tcpEStatsAppHCThruOctetsAcked /
/// tcpEStatsAppHCThruOctetsReceived; ss prints them from `struct tcp_info`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TcpBytes {
    written: u64,
    read: u64,
}

/// `ss -tinH state established FILTER`: socket (`"laddr:port->raddr:port"`, as the report
/// names it) → its [`TcpBytes`]. ss prints `bytes_acked` and `bytes_received` only when
/// non-zero (iproute2 misc/ss.c, tcp_stats_print), so `zero_ok` says whether a missing one
/// reads as 0 (sockets that may have moved nothing one way) or fails.
fn ss_bytes(filter: &str, zero_ok: bool) -> Result<BTreeMap<String, TcpBytes>> {
    let out = Command::new("ss")
        .args(["-tinH", "state", "established", filter])
        .output()
        .context("running ss")?;
    ensure!(out.status.success(), "ss failed: {out:?}");
    let text = String::from_utf8(out.stdout)?;
    let mut socks = BTreeMap::new();
    let mut lines = text.lines();
    while let Some(head) = lines.next() {
        // State filter given: Recv-Q Send-Q Local Peer.
        let f: Vec<&str> = head.split_whitespace().collect();
        ensure!(f.len() >= 4, "ss line {head:?}");
        let (recv_q, send_q): (u64, u64) = (f[0].parse()?, f[1].parse()?);
        let info = lines
            .next()
            .with_context(|| format!("no info after {head:?}"))?;
        let field = |name: &str| -> Result<u64> {
            let v = info
                .split_whitespace()
                .find_map(|w| w.strip_prefix(name)?.strip_prefix(':'));
            match v {
                Some(v) => Ok(v.parse()?),
                None if zero_ok => Ok(0),
                None => bail!("ss shows no {name} for {head:?}: {info:?}"),
            }
        };
        let acked = field("bytes_acked")?;
        let received = field("bytes_received")?;
        socks.insert(
            format!("{}->{}", f[2], f[3]),
            TcpBytes {
                written: acked + send_q,
                read: received
                    .checked_sub(recv_q)
                    .context("Recv-Q above bytes_received")?,
            },
        );
    }
    Ok(socks)
}

/// What moved on each socket between two [`ss_bytes`] readings (sockets in both).
fn moved(
    before: &BTreeMap<String, TcpBytes>,
    after: &BTreeMap<String, TcpBytes>,
) -> Result<BTreeMap<String, TcpBytes>> {
    let mut out = BTreeMap::new();
    for (s, a) in after {
        let b = before
            .get(s)
            .with_context(|| format!("{s} not there before"))?;
        out.insert(
            s.clone(),
            TcpBytes {
                written: a.written - b.written,
                read: a.read - b.read,
            },
        );
    }
    Ok(out)
}

/// Checks one socket's byte totals against what the TCP stack (or the peers) say moved: a
/// socket that moved nothing either way while observed has no kernel entry (both totals
/// null) or zeros; any other has exactly `want` each way.
fn check_totals(c: &ChannelReport, want: TcpBytes) -> Result<()> {
    let t = &c.traffic;
    let got = (t.bytes_written_total, t.bytes_read_total);
    if want.written == 0 && want.read == 0 {
        ensure!(
            matches!(got, (None, None) | (Some(0), Some(0))),
            "idle socket with bytes {got:?}: {}",
            describe_ch(c)
        );
        return Ok(());
    }
    ensure!(
        got == (Some(want.written), Some(want.read)),
        "bytes written/read {got:?}, the TCP stack says {want:?}: {}",
        describe_ch(c)
    );
    Ok(())
}

/// [`check_totals`] where traffic the test did not make (spice-server's latency PING every
/// 15 s and the client's PONG, `red-channel-client.cpp` PING_TEST_TIMEOUT_MS) may have come
/// while the observer was starting or ending, between two of the test's readings of the TCP
/// counters: `starts` are what moved before the observer's start, at the readings that
/// bracket it, `ends` the same for its end. Each direction must equal `end − start` exactly
/// for one of them, as such a message either was or was not moved inside the observation.
fn check_totals_bracketed(
    c: &ChannelReport,
    starts: [TcpBytes; 2],
    ends: [TcpBytes; 2],
) -> Result<()> {
    let t = &c.traffic;
    let got = match (t.bytes_written_total, t.bytes_read_total) {
        (None, None) => (Some(0), Some(0)),
        g => g,
    };
    let mut written = Vec::new();
    let mut read = Vec::new();
    for s in starts {
        for e in ends {
            written.push(e.written - s.written);
            read.push(e.read - s.read);
        }
    }
    ensure!(
        got.0.is_some_and(|v| written.contains(&v)) && got.1.is_some_and(|v| read.contains(&v)),
        "bytes written/read {got:?}, the TCP stack says written one of {written:?}, read one \
         of {read:?}: {}",
        describe_ch(c)
    );
    Ok(())
}

/// A real Xspice session through socat, open and idle before the observer starts (its
/// sockets are joined mid-stream, framing unknown): the observer's byte totals of all twelve
/// sockets (spice-server's four channels and the relay's two legs of each) equal, both ways,
/// what the TCP stack counted on them over the observation, while Xorg drew rectangles on
/// the display channel; every socket has its TCP state.
#[test]
fn joined_session_bytes_match_the_tcp_counters() -> Result<()> {
    const T: &str = "joined_session_bytes_match_the_tcp_counters";
    if !privileged(T) {
        return Ok(());
    }
    let (port, display, rport) = (5981u16, 81u32, 6981u16);
    let filter = format!("( sport = :{port} or dport = :{port} or sport = :{rport} )");
    let mut rig = Rig::new(T)?;
    // 1 s of drawing while the session opens, then idle.
    let xorg = rig.xspice_rects(port, display, 1)?;
    let relay = rig.relay("socat", "127.0.0.1", rport, "127.0.0.1", port)?;
    let _client = Client::start(&format!("spice://127.0.0.1:{rport}"), 60, &[], None)?;
    thread::sleep(Duration::from_secs(4));
    let before = ss_bytes(&filter, false)?;
    ensure!(
        before.len() == 12,
        "4 channels × 3 sockets expected: {before:?}"
    );
    let obs = observe_or_skip!(T, &[xorg, relay], 7.0, rig.state.join("report.json"));
    let ready = ss_bytes(&filter, false)?;
    draw(display, &common::rects("3"))?;
    thread::sleep(Duration::from_secs(1));
    let drawn = ss_bytes(&filter, false)?;
    let report: Report = obs.finish_report()?;
    check_run(&report)?;
    let after = ss_bytes(&filter, false)?;
    for (when, a, b) in [("start", &before, &ready), ("end", &drawn, &after)] {
        let moving: BTreeMap<_, _> = moved(a, b)?
            .into_iter()
            .filter(|(_, m)| m.written > 0 || m.read > 0)
            .collect();
        if !moving.is_empty() {
            // Not the test's: spice-server's periodic PING and the client's PONG.
            eprintln!("traffic during the observer's {when}: {moving:?}");
        }
    }
    let want = moved(&before, &after)?;
    let busy: Vec<_> = want.iter().filter(|(_, b)| b.written > 0).collect();
    ensure!(
        busy.len() >= 3,
        "the drawing should have moved bytes on the display channel's 3 sockets: {want:?}"
    );
    let chans: Vec<&ChannelReport> = report
        .channels
        .iter()
        .filter(|c| want.contains_key(&c.socket))
        .collect();
    ensure!(
        chans.len() == 12,
        "12 sockets expected in the report, {} found",
        chans.len()
    );
    for c in chans {
        eprintln!(
            "{:<44} {:>8} framing {:<8} written {:?} read {:?} (TCP {:?}) {:.2} Mbit/s written",
            c.socket,
            c.comm,
            c.framing,
            c.traffic.bytes_written_total,
            c.traffic.bytes_read_total,
            want[&c.socket],
            c.traffic.bytes_written_per_s.unwrap_or(0.0) * 8.0 / 1e6,
        );
        let at = |r: &BTreeMap<String, TcpBytes>| r[&c.socket];
        check_totals_bracketed(c, [at(&before), at(&ready)], [at(&drawn), at(&after)])?;
        ensure!(c.tcp.is_some(), "no TCP state: {}", describe_ch(c));
    }
    Ok(())
}

/// A peer process: writes its stdout lines to a channel.
struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Peer {
    fn start(script: &str, args: &[&str]) -> Result<Peer> {
        let mut child = Command::new("/usr/bin/python3")
            .args(["-u", "-c", script])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting a python peer")?;
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Ok(Peer {
            stdin: child.stdin.take(),
            child,
            lines: rx,
        })
    }

    /// Waits for a line starting with `prefix`; returns the rest as a number.
    fn wait(&self, prefix: &str) -> Result<u64> {
        loop {
            let l = self
                .lines
                .recv_timeout(Duration::from_secs(30))
                .with_context(|| format!("no {prefix:?} line within 30 s"))?;
            if let Some(v) = l.strip_prefix(prefix) {
                return Ok(v.trim().parse()?);
            }
        }
    }

    fn say(&mut self, line: &str) -> Result<()> {
        let s = self.stdin.as_mut().context("stdin closed")?;
        writeln!(s, "{line}")?;
        s.flush()?;
        Ok(())
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Listens on the port in argv[1]; for each line on stdin, sends that many random bytes
/// back on the connection; prints `got N` (bytes received so far) whenever nothing arrived
/// for 300 ms after something did.
const SINK: &str = r#"
import os, select, socket, sys
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", int(sys.argv[1]))); ls.listen(1); print("listening 0")
c, _ = ls.accept(); total = 0; fresh = False
while True:
    r, _, _ = select.select([c, sys.stdin], [], [], 0.3)
    if c in r:
        b = c.recv(1 << 20)
        if not b: break
        total += len(b); fresh = True
    if sys.stdin in r:
        n = sys.stdin.readline()
        if not n: break
        c.sendall(os.urandom(int(n)))
    if not r and fresh:
        print("got", total); fresh = False
"#;

/// Connects to the port in argv[1]; for each line N on stdin, sends N random bytes and
/// prints `sent TOTAL`; counts what comes back and prints `back N` after 300 ms of quiet.
const SOURCE: &str = r#"
import os, select, socket, sys
c = socket.create_connection(("127.0.0.1", int(sys.argv[1]))); sent = 0; back = 0; fresh = False
chunk = os.urandom(1 << 20)
while True:
    r, _, _ = select.select([c, sys.stdin], [], [], 0.3)
    if sys.stdin in r:
        n = sys.stdin.readline()
        if not n: break
        n = int(n)
        while n > 0:
            k = min(n, len(chunk)); c.sendall(chunk[:k]); n -= k; sent += k
        print("sent", sent)
    if c in r:
        b = c.recv(1 << 20)
        if not b: break
        back += len(b); fresh = True
    if not r and fresh:
        print("back", back); fresh = False
"#;

/// Random bytes (not SPICE) between a source and a sink through a socat relay listening on
/// `relay_port`; 1 MiB each way, then quiet. Returns (sink, source, relay pid).
fn non_spice_stream(rig: &mut Rig, sink_port: u16, relay_port: u16) -> Result<(Peer, Peer, u32)> {
    let mut sink = Peer::start(SINK, &[&sink_port.to_string()])?;
    sink.wait("listening")?;
    let relay = rig.relay("socat", "127.0.0.1", relay_port, "127.0.0.1", sink_port)?;
    let mut source = Peer::start(SOURCE, &[&relay_port.to_string()])?;
    push(&mut sink, &mut source, 0, 1 << 20, 1 << 20)?;
    Ok((sink, source, relay))
}

/// The source sends `there` bytes, then the sink `back`; waits until both peers have
/// received all of it (`done`: what each had before) and gone quiet.
fn push(sink: &mut Peer, source: &mut Peer, done: u64, there: u64, back: u64) -> Result<()> {
    source.say(&there.to_string())?;
    source.wait("sent")?;
    sink.say(&back.to_string())?;
    let got = loop {
        let g = sink.wait("got")?;
        if g >= done + there {
            break g;
        }
    };
    let returned = loop {
        let b = source.wait("back")?;
        if b >= done + back {
            break b;
        }
    };
    ensure!(
        got == done + there && returned == done + back,
        "peers: sink got {got}, source got back {returned}, {done} before, {there} and {back} sent"
    );
    Ok(())
}

/// Random bytes (not SPICE) through a socat relay, connection open before the observer
/// starts: the relay's byte totals on both legs equal what the peers sent and received
/// while it observed: 48 MiB one way, 3 MiB back. The table shows their rate (`*`), not 0.
#[test]
fn non_spice_relay_bytes_match_the_peers() -> Result<()> {
    const T: &str = "non_spice_relay_bytes_match_the_peers";
    if !privileged(T) {
        return Ok(());
    }
    let (sink_port, relay_port) = (7982u16, 7983u16);
    let mut rig = Rig::new(T)?;
    let (mut sink, mut source, relay) = non_spice_stream(&mut rig, sink_port, relay_port)?;
    let obs = observe_or_skip!(T, &[relay], 6.0, rig.state.join("report.json"));
    let (there, back) = (48u64 << 20, 3u64 << 20);
    push(&mut sink, &mut source, 1 << 20, there, back)?;
    let report: Report = obs.finish_report()?;
    check_run(&report)?;
    let src = format!("127.0.0.1:{relay_port}");
    let snk = format!("127.0.0.1:{sink_port}");
    let legs: Vec<&ChannelReport> = report
        .channels
        .iter()
        .filter(|c| c.socket.starts_with(&format!("{src}->")) || c.socket.ends_with(&snk))
        .collect();
    ensure!(legs.len() == 2, "the relay's two legs: {legs:?}");
    let table = spice_observer::report::render(&report);
    for c in legs {
        eprintln!(
            "{:<44} framing {:<8} reason {:?} written {:?} read {:?} messages {}/{}",
            c.socket,
            c.framing,
            c.unparsed_reason,
            c.traffic.bytes_written_total,
            c.traffic.bytes_read_total,
            c.messages_sent,
            c.messages_received
        );
        // Toward the source: reads what it sent, writes what the sink sent back; toward the
        // sink the other way round.
        let want = if c.socket.starts_with(&src) {
            TcpBytes {
                written: back,
                read: there,
            }
        } else {
            TcpBytes {
                written: there,
                read: back,
            }
        };
        check_totals(c, want)?;
        ensure!(c.tcp.is_some(), "no TCP state: {}", describe_ch(c));
        if c.server_to_client.messages == 0 {
            let row = table
                .lines()
                .find(|l| l.starts_with(&c.socket))
                .with_context(|| format!("no table row for {}:\n{table}", c.socket))?;
            let mbit = row
                .split_whitespace()
                .find_map(|w| w.strip_suffix('*'))
                .with_context(|| format!("MBIT/S not marked *: {row}"))?;
            ensure!(mbit.parse::<f64>()? > 0.0, "MBIT/S 0: {row}");
        }
    }
    Ok(())
}

/// The daemon started while random bytes (not SPICE) flow through a socat relay it finds by
/// name: `spice_observer_socket_bytes_total` of the relay's two legs (channel `unknown`, leg
/// and direction from how each socket was made) equals what the peers sent and received
/// after it joined: 48 MiB toward the sink, 3 MiB back; promtool accepts the scrape.
#[test]
fn daemon_socket_bytes_of_a_joined_stream() -> Result<()> {
    const T: &str = "daemon_socket_bytes_of_a_joined_stream";
    if !privileged(T) {
        return Ok(());
    }
    const LISTEN: &str = "127.0.0.1:19681";
    let (sink_port, relay_port) = (7984u16, 7985u16);
    let mut rig = Rig::new(T)?;
    let (mut sink, mut source, relay) = non_spice_stream(&mut rig, sink_port, relay_port)?;
    let config = rig.state.join("spice-observer.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"{LISTEN}\"\nsample_ms = 100\nscan_ms = 500\n\
             [discovery]\nqemu = false\nxspice = false\nrelays = [{{ name = \"socat\" }}]\n"
        ),
    )?;
    let pins = common::PinDir::new(T)?;
    let mut daemon = Daemon::start(&config, &pins.path, &[], OnDrop::Terminate)?.with_pins(pins);
    daemon.wait_found(&[("socat", relay)])?;
    thread::sleep(Duration::from_secs(1));
    let (there, back) = (48u64 << 20, 3u64 << 20);
    push(&mut sink, &mut source, 1 << 20, there, back)?;
    // A sample (every 100 ms) after the stream went quiet.
    thread::sleep(Duration::from_millis(500));
    let scrape = Scrape::take(LISTEN)?;
    scrape.check_run(0.0)?;
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running promtool")?;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(scrape.text.as_bytes())?;
    common::silent_success(&child.wait_with_output()?, "promtool check metrics")?;
    let series = scrape.find(
        "spice_observer_socket_bytes_total",
        &[("vm", "socat"), ("channel", "unknown")],
    );
    for s in &series {
        eprintln!("{:?} {}", s.labels, s.value);
    }
    // The relay accepted the source's connection (leg relay_client: it writes server →
    // client) and made the one toward the sink (relay_backend: it writes client → server).
    for (leg, dir, want) in [
        ("relay_client", "client_to_server", there),
        ("relay_client", "server_to_client", back),
        ("relay_backend", "client_to_server", there),
        ("relay_backend", "server_to_client", back),
    ] {
        let v = scrape.one(
            "spice_observer_socket_bytes_total",
            &[
                ("vm", "socat"),
                ("leg", leg),
                ("channel", "unknown"),
                ("direction", dir),
            ],
        )?;
        ensure!(v == want as f64, "{leg} {dir}: {v}, the peers moved {want}");
    }
    ensure!(series.len() == 4, "{series:?}");
    Ok(())
}
