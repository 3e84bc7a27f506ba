//! Privileged test of relay pairing with two sessions through ONE relay process: two Xspice
//! servers with the same animation, one haproxy process with a frontend for each, two real
//! spice-gtk clients started at nearly the same moment. Both main channels link with
//! connection_id 0, so the link message alone does not tell their relay legs apart; the
//! observer must pair each spice-server socket with the legs of its own session. To make
//! that as hard as possible, haproxy is held stopped while both clients connect, so both
//! sessions' links and first messages go through it in the same instant.
//!
//! Ground truth comes from outside the observer: the frontend port a client leg listens on
//! (6961 belongs to the first session, 6962 to the second), the local port of each channel as
//! the client itself prints it (rig/client.py), and haproxy's connections as `ss -tnp` lists
//! them during the run.

mod common;

use std::{
    collections::{BTreeMap, HashSet},
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use common::{Rig, privileged, rig, sh};
use spice_observer::report::{ChannelReport, Report};

/// One haproxy process with a frontend per `(listen port, server port)` pair
/// (`rig/relay.sh haproxy ADDR L1,L2 ADDR S1,S2`); stopped when dropped.
struct Haproxy {
    pidfile: PathBuf,
    pid: u32,
}

impl Haproxy {
    fn start(rig: &Rig, pairs: &[(u16, u16)]) -> Result<Self> {
        let pidfile = rig.state.join("haproxy.pid");
        let list = |f: fn(&(u16, u16)) -> u16| {
            pairs
                .iter()
                .map(|p| f(p).to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        let out = sh(Command::new(common::rig().join("relay.sh"))
            .args(["haproxy", "127.0.0.1", &list(|p| p.0), "127.0.0.1"])
            .arg(list(|p| p.1))
            .arg(&pidfile))?;
        print!("{out}");
        let pid = std::fs::read_to_string(&pidfile)?
            .trim()
            .parse()
            .context("haproxy pid")?;
        Ok(Self { pidfile, pid })
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = Command::new(rig().join("relay.sh"))
            .arg("stop")
            .arg(&self.pidfile)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// rig/client.py with its stdout read: each channel's local port, as the client prints it
/// when the channel opens ("channel main-0 opened local 127.0.0.1:PORT -> ...").
struct PortClient {
    child: Child,
    lines: Option<thread::JoinHandle<Vec<String>>>,
}

impl PortClient {
    fn start(uri: &str, seconds: u32) -> Result<Self> {
        let mut child = Command::new("/usr/bin/python3")
            .arg(rig().join("client.py"))
            .arg(uri)
            .args(["--seconds", &seconds.to_string(), "--report", "1000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting rig/client.py")?;
        let out = child.stdout.take().unwrap();
        let lines = thread::spawn(move || {
            BufReader::new(out)
                .lines()
                .map_while(Result::ok)
                .collect::<Vec<_>>()
        });
        Ok(Self {
            child,
            lines: Some(lines),
        })
    }

    /// Waits for the client to end; returns channel key ("main-0") → local port.
    fn finish(mut self) -> Result<BTreeMap<String, u16>> {
        let status = self.child.wait()?;
        let lines = self.lines.take().unwrap().join().unwrap();
        ensure!(
            status.success(),
            "client.py failed ({status}):\n{}",
            lines.join("\n")
        );
        let mut ports = BTreeMap::new();
        for l in &lines {
            let w: Vec<&str> = l.split_whitespace().collect();
            if let ["channel", key, "opened", "local", local, "->", _] = w.as_slice() {
                let port = local
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.parse().ok())
                    .ok_or_else(|| anyhow!("bad client line {l:?}"))?;
                ensure!(
                    ports.insert(key.to_string(), port).is_none(),
                    "channel {key} opened twice"
                );
            }
        }
        Ok(ports)
    }
}

impl Drop for PortClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// haproxy's established connections as `ss -Htnp` lists them: `"local->peer"` strings of
/// sockets owned by `pid` whose local or peer port is in `ports`.
fn ss_sockets(pid: u32, filter: &str) -> Result<HashSet<String>> {
    let out = sh(Command::new("ss").args(["-Htnp", "state", "established", filter]))?;
    let owner = format!("pid={pid},");
    Ok(out
        .lines()
        .filter(|l| l.contains(&owner))
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            // Recv-Q Send-Q Local Peer Process (no State column with a state filter)
            Some(format!("{}->{}", w.get(2)?, w.get(3)?))
        })
        .collect())
}

/// Sends `sig` to `pid` (a process this test started).
fn signal(pid: u32, sig: i32) -> Result<()> {
    let rc = unsafe { libc::kill(pid as i32, sig) };
    ensure!(
        rc == 0,
        "kill({pid}, {sig}): {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

fn port_of(addr: &str) -> Option<u16> {
    addr.rsplit(':').next()?.parse().ok()
}

/// `"l->r"` → `("l", "r")`.
fn ends(socket: &str) -> Result<(&str, &str)> {
    socket
        .split_once("->")
        .ok_or_else(|| anyhow!("socket {socket:?} is not \"local->remote\""))
}

fn describe(c: &ChannelReport) -> String {
    format!(
        "{} {:?} pid {} {} (sent {}, received {})",
        c.channel_type, c.channel_id, c.pid, c.socket, c.messages_sent, c.messages_received
    )
}

/// One session of the test: its spice-server, the frontend its client connects to, and what
/// the rig saw of it.
struct Session {
    xorg: u32,
    server_port: u16,
    frontend: u16,
    /// Channel key → the client's local port (from the client).
    client_ports: BTreeMap<String, u16>,
}

/// Every main, display, inputs and cursor channel of `s`'s spice-server is paired with the
/// haproxy legs of its own session (ground truth: `ss` and the client's ports), the chain is
/// transparent, and message counts agree along it. Returns the legs it checked.
fn check_session(
    report: &Report,
    s: &Session,
    haproxy: u32,
    ss_backends: &HashSet<String>,
    ss_client_legs: &HashSet<String>,
) -> Result<Vec<String>> {
    let find = |sock: &str| {
        report
            .channels
            .iter()
            .find(|c| c.socket == sock)
            .ok_or_else(|| anyhow!("{sock} not in the report"))
    };
    let ours: Vec<&ChannelReport> = report
        .channels
        .iter()
        .filter(|c| {
            c.pid == s.xorg
                && c.end.as_deref() == Some("server")
                && ["main", "display", "inputs", "cursor"].contains(&c.channel_type.as_str())
        })
        .collect();
    let mut types: Vec<&str> = ours.iter().map(|c| c.channel_type.as_str()).collect();
    types.sort();
    ensure!(
        types == ["cursor", "display", "inputs", "main"],
        "Xorg {} on port {}: channels {types:?}",
        s.xorg,
        s.server_port
    );
    let mut legs = Vec::new();
    for c in ours {
        let d = describe(c);
        let ch = c.chain.as_ref().ok_or_else(|| anyhow!("no chain: {d}"))?;
        println!("{d}:");
        for p in &ch.pairing {
            println!("    {p}");
        }
        let backend = ch
            .backend
            .as_deref()
            .ok_or_else(|| anyhow!("no backend leg: {d}"))?;
        let client_leg = ch
            .client_leg
            .as_deref()
            .ok_or_else(|| anyhow!("no client leg: {d}\n{:?}", ch.pairing))?;
        ensure!(
            ch.relay_pid == Some(haproxy),
            "relay pid {:?}: {d}",
            ch.relay_pid
        );
        ensure!(
            ch.pairing
                .last()
                .is_some_and(|p| p.starts_with("client leg: relay socket ")),
            "pairing not explained: {d}: {:?}",
            ch.pairing
        );
        ensure!(
            ch.transparency == "transparent",
            "haproxy should be byte-transparent: {d}: {} {:?}",
            ch.transparency,
            ch.transparency_detail
        );
        // Backend: the same TCP connection as spice-server's socket, one of haproxy's
        // connections to this session's server port in `ss`.
        let (sl, sr) = ends(&c.socket)?;
        ensure!(
            backend == format!("{sr}->{sl}"),
            "backend {backend} is not the other end of {}",
            c.socket
        );
        ensure!(
            ss_backends.contains(backend),
            "backend {backend} is not among haproxy's connections to spice-server in ss: {ss_backends:?}"
        );
        // Client leg: on this session's frontend, toward this session's client's socket of
        // this channel.
        let (cl_local, cl_peer) = ends(client_leg)?;
        let key = format!(
            "{}-{}",
            c.channel_type,
            c.channel_id.ok_or_else(|| anyhow!("no channel id: {d}"))?
        );
        let client_port = *s
            .client_ports
            .get(&key)
            .ok_or_else(|| anyhow!("client did not print channel {key}: {:?}", s.client_ports))?;
        ensure!(
            port_of(cl_local) == Some(s.frontend) && port_of(cl_peer) == Some(client_port),
            "{d}: client leg {client_leg} is not this session's (frontend {}, client's {key} port {client_port})",
            s.frontend
        );
        ensure!(
            ss_client_legs.contains(client_leg),
            "client leg {client_leg} not among haproxy's client connections in ss: {ss_client_legs:?}"
        );
        // Counts along the chain.
        let b = find(backend)?;
        let cl = find(client_leg)?;
        ensure!(
            b.pid == haproxy && cl.pid == haproxy && b.comm == "haproxy" && cl.comm == "haproxy",
            "legs not haproxy's: {} / {}",
            describe(b),
            describe(cl)
        );
        ensure!(
            cl.channel_type == c.channel_type && cl.channel_id == c.channel_id,
            "channel identity: {d} / {}",
            describe(cl)
        );
        ensure!(
            c.messages_sent == b.messages_received
                && c.messages_sent == cl.messages_sent
                && c.messages_sent_by_type == cl.messages_sent_by_type,
            "server→client counts differ along the chain: {d} / {} / {}",
            describe(b),
            describe(cl)
        );
        ensure!(
            cl.messages_received == b.messages_sent
                && c.messages_received == b.messages_sent
                && c.messages_received_by_type == cl.messages_received_by_type,
            "client→server counts differ along the chain: {d} / {} / {}",
            describe(b),
            describe(cl)
        );
        ensure!(c.messages_sent > 0, "nothing sent: {d}");
        legs.push(backend.to_string());
        legs.push(client_leg.to_string());
    }
    Ok(legs)
}

/// Two sessions with the same animation through one haproxy process, clients started at the
/// same moment: every channel is paired with its own session's legs.
#[test]
fn two_sessions_through_one_haproxy_pair_with_their_own_legs() -> Result<()> {
    const T: &str = "two_sessions_through_one_haproxy_pair_with_their_own_legs";
    if !privileged(T) {
        return Ok(());
    }
    let mut rig = Rig::new(T)?;
    // The same animation on both: equal message sizes as far as the drawing decides them.
    let anim = common::rects("30");
    let xorg_a = rig.xspice(5961, 61, &anim)?;
    let xorg_b = rig.xspice(5962, 62, &anim)?;
    let haproxy = Haproxy::start(&rig, &[(6961, 5961), (6962, 5962)])?;
    let obs = observe_or_skip!(
        T,
        &[xorg_a, xorg_b, haproxy.pid],
        14.0,
        rig.state.join("report.json")
    );
    // Both sessions start in the same instant: haproxy is held stopped while both clients
    // connect (the kernel completes their handshakes and queues their link messages), then
    // continued, so it forwards both links and both sessions' first messages in one burst.
    signal(haproxy.pid, libc::SIGSTOP)?;
    let client_a = PortClient::start("spice://127.0.0.1:6961", 8);
    let client_b = PortClient::start("spice://127.0.0.1:6962", 8);
    thread::sleep(Duration::from_millis(1500));
    signal(haproxy.pid, libc::SIGCONT)?;
    let (client_a, client_b) = (client_a?, client_b?);
    // haproxy's connections while both sessions run.
    thread::sleep(Duration::from_secs(3));
    let ss_backends = ss_sockets(haproxy.pid, "( dport = :5961 or dport = :5962 )")?;
    let ss_client_legs = ss_sockets(haproxy.pid, "( sport = :6961 or sport = :6962 )")?;
    println!("ss: haproxy → spice-server {ss_backends:?}");
    println!("ss: haproxy ← clients {ss_client_legs:?}");
    let ports_a = client_a.finish()?;
    let ports_b = client_b.finish()?;
    println!("client ports: session 1 {ports_a:?}, session 2 {ports_b:?}");
    let report = obs.finish_report()?;
    common::check_run(&report)?;
    let sessions = [
        Session {
            xorg: xorg_a,
            server_port: 5961,
            frontend: 6961,
            client_ports: ports_a,
        },
        Session {
            xorg: xorg_b,
            server_port: 5962,
            frontend: 6962,
            client_ports: ports_b,
        },
    ];
    ensure!(
        ss_client_legs.len() == 8 && ss_backends.len() == 8,
        "expected 4 channels per session, so 8 haproxy connections each way in ss"
    );
    let mut all = HashSet::new();
    for s in &sessions {
        for leg in check_session(&report, s, haproxy.pid, &ss_backends, &ss_client_legs)? {
            if !all.insert(leg.clone()) {
                bail!("relay leg {leg} paired twice");
            }
        }
    }
    Ok(())
}
