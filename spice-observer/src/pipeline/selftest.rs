//! The start-up self-test: before an engine that loaded (or continued) its own programs
//! reports anything, a short-lived child of the observer (`spice-observer self-test-peer`,
//! the same executable) plays both ends of one SPICE display channel over a loopback TCP
//! connection, and the engine must count exactly what the child wrote. A hook set that
//! loads and attaches but does not see the calls (a kernel that routes the syscalls
//! elsewhere, a struct offset that BTF gave wrong, a socket path the hooks miss) would
//! otherwise report zeros as if the sessions were idle.
//!
//! The exchange ([`peer_main`]) is what spice-gtk and spice-server do on a display channel
//! (`docs/spice-protocol.md` §1.2–§1.9, §3): the link message, the link reply, the auth
//! mechanism and ticket, the link result, then mini-header data messages: the server's
//! SET_ACK (generation 1, window [`WINDOW`]) and [`DRAWS`] DRAW_FILL messages, the first
//! half one per write and the rest in one write; the client's ACK_SYNC and one ACK after
//! [`WINDOW`] messages. The check compares the engine's per-channel counts (messages each
//! way, SET_ACKs, ACKs) with those the child itself wrote, so it needs no knowledge of the
//! hook set. The child's sockets are then dropped from the model (and their later records
//! ignored, [`crate::model::Model::ignored`]), so no output ever shows them.
//!
//! Cost: one child process and about 10–50 ms at start.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{TcpListener, TcpStream},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};
use spice_ebpf_common::{
    protocol::{
        AUTH_MECHANISM_SPICE, CAP_AUTH_SELECTION, CAP_AUTH_SPICE, CAP_MINI_HEADER, channel,
    },
    wire::{self, HeaderKind},
};

use super::{Engine, monotonic_ns};

/// Test hook: `SPICE_OBSERVER_SELF_TEST_SEND=sendmmsg` makes the child's server end write
/// its DRAW_FILLs with sendmmsg(2), which hook set `syscalls` does not see (README, Kernel
/// requirements): the self-test must then fail. `tests/selftest.rs` uses it.
pub const SEND_ENV: &str = "SPICE_OBSERVER_SELF_TEST_SEND";
/// The hidden subcommand the child runs.
pub const PEER_SUBCOMMAND: &str = "self-test-peer";
/// W of the child's SET_ACK, messages.
pub const WINDOW: u32 = 20;
/// DRAW_FILL messages the child's server end writes after its SET_ACK.
pub const DRAWS: u64 = 24;
/// The display message type the child writes (DRAW_FILL, `spice.proto`).
const DRAW_FILL: u16 = 302;
/// Bytes of each DRAW_FILL body (arbitrary: the framing skips bodies).
const DRAW_BODY: usize = 48;
/// The `connection_id` of the child's link message (any value: it names the session).
const CONNECTION_ID: u32 = 0x5e1f_7e57;
/// How long the child may take for each step, and the engine to show its counts.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);
const COUNT_TIMEOUT: Duration = Duration::from_secs(3);

/// What the self-test found (`self_test` in the JSON report).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelfTestReport {
    /// The hook set tested (as [`Engine::hook_set`]).
    pub hook_set: String,
    /// The engine counted exactly what the child wrote.
    pub passed: bool,
    /// Messages the child wrote, server → client (SET_ACK + DRAW_FILLs) and client → server
    /// (ACK_SYNC + ACK).
    pub expected: Counts,
    /// What the engine counted on the child's two sockets (zeros where it saw nothing).
    pub counted: Counts,
    /// Wall time of the whole test, milliseconds.
    pub elapsed_ms: u64,
}

/// Message counts of one self-test channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Messages written by the server end, as counted at the server end's socket.
    pub server_sent: u64,
    /// Messages written by the client end, as counted at the client end's socket.
    pub client_sent: u64,
    /// Messages read by the server end / by the client end.
    pub server_received: u64,
    pub client_received: u64,
    /// SET_ACKs and matched ACKs, at the server end.
    pub set_acks: u64,
    pub acks: u64,
}

impl Counts {
    fn expected() -> Counts {
        let server = 1 + DRAWS;
        let client = 2;
        Counts {
            server_sent: server,
            client_sent: client,
            server_received: client,
            client_received: server,
            set_acks: 1,
            acks: DRAWS / WINDOW as u64,
        }
    }
}

/// Runs the self-test on `engine` (which must have no process of the child's watched, and
/// must not be a beside-a-daemon engine: that one reads the daemon's tested set). Returns the
/// report when the counts match; errors, naming the hook set and both counts, when they do
/// not, and when the child cannot be started or fails (its error is in the message).
pub fn run(engine: &mut Engine) -> Result<SelfTestReport> {
    let t0 = Instant::now();
    let exe = std::env::current_exe().context("self-test: the observer's own executable")?;
    let mut child = Command::new(&exe)
        .arg(PEER_SUBCOMMAND)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("self-test: starting {} {PEER_SUBCOMMAND}", exe.display()))?;
    let res = drive(engine, &mut child, t0);
    let _ = child.kill();
    let _ = child.wait();
    let rep = res?;
    if !rep.passed {
        bail!(
            "start-up self-test failed: hook set `{}` counted {:?} on a loopback SPICE display \
             channel of the observer's own child, which wrote {:?}; the observer would report \
             wrong counts on this host, so it stops (run `spice-observer doctor`, or try another \
             `--hook-set`)",
            rep.hook_set,
            rep.counted,
            rep.expected
        );
    }
    Ok(rep)
}

fn drive(engine: &mut Engine, child: &mut Child, t0: Instant) -> Result<SelfTestReport> {
    let pid = child.id();
    let mut stdin = child.stdin.take().context("self-test child stdin")?;
    let stdout = child.stdout.take().context("self-test child stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let line = |what: &str| -> Result<String> {
        rx.recv_timeout(STEP_TIMEOUT)
            .map_err(|_| anyhow!("self-test: the child (pid {pid}) never said {what:?}"))
    };
    let listening = line("listening")?;
    let port: u16 = listening
        .strip_prefix("listening ")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| anyhow!("self-test: the child said {listening:?}"))?;
    engine
        .watch(pid)
        .with_context(|| format!("self-test: watching the child (pid {pid})"))?;
    writeln!(stdin, "go")?;
    stdin.flush()?;
    let done = line("done")?;
    if done != "done" {
        bail!("self-test: the child said {done:?}");
    }
    let expected = Counts::expected();
    let deadline = Instant::now() + COUNT_TIMEOUT;
    let counted = loop {
        engine.drain();
        let c = counted(engine, pid);
        if c == expected || Instant::now() >= deadline {
            break c;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // Unwatched while its sockets are still open: its exit is no watched exit, and its
    // sockets' closing records are dropped with them.
    engine.forget_self_test(pid, port)?;
    drop(stdin);
    Ok(SelfTestReport {
        hook_set: engine.hook_set().to_string(),
        passed: counted == expected,
        expected,
        counted,
        elapsed_ms: t0.elapsed().as_millis() as u64,
    })
}

/// The engine's counts on the child's display channel (its two sockets).
fn counted(engine: &Engine, pid: u32) -> Counts {
    let rep = engine.snapshot(monotonic_ns());
    let mut c = Counts::default();
    for ch in rep.channels.iter().filter(|ch| ch.pid == pid) {
        // The server end read the client's link message (`end`); the window is the server
        // → client flow's, shown on both ends.
        if ch.end.as_deref() == Some("server") {
            c.server_sent = ch.messages_sent;
            c.server_received = ch.messages_received;
            c.set_acks = ch.set_acks;
            c.acks = ch.acks;
        } else {
            c.client_sent = ch.messages_sent;
            c.client_received = ch.messages_received;
        }
    }
    c
}

/// The child (`spice-observer self-test-peer`): listens on 127.0.0.1, prints
/// `listening PORT`, waits for a line on stdin, then connects to itself and plays both
/// ends of a display channel (the module doc), prints `done`, and keeps its sockets open
/// until stdin ends. Any failure is an error (exit status 1, its message on stderr).
pub fn peer_main() -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "listening {}", addr.port())?;
    out.flush()?;
    let mut stdin = std::io::stdin().lock();
    let mut go = String::new();
    stdin.read_line(&mut go)?;
    if go.trim() != "go" {
        bail!("expected `go` on stdin, got {go:?}");
    }
    let mut client = TcpStream::connect(addr).context("connecting to itself")?;
    let (mut server, _) = listener.accept().context("accepting its own connection")?;
    for s in [&client, &server] {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(STEP_TIMEOUT))?;
        s.set_write_timeout(Some(STEP_TIMEOUT))?;
    }
    let caps = [CAP_AUTH_SELECTION | CAP_AUTH_SPICE | CAP_MINI_HEADER];
    // Link: client message, server reply, auth mechanism and ticket, result.
    client.write_all(&wire::link_mess(
        CONNECTION_ID,
        channel::DISPLAY,
        0,
        &caps,
        &[],
    ))?;
    read_link(&mut server)?;
    server.write_all(&wire::link_reply(0, &caps, &[]))?;
    read_link(&mut client)?;
    client.write_all(&wire::auth_mechanism(AUTH_MECHANISM_SPICE))?;
    client.write_all(&wire::ticket())?;
    read_n(&mut server, 4 + wire::ticket().len())?;
    server.write_all(&wire::link_result(0))?;
    read_n(&mut client, 4)?;
    // Data: SET_ACK and the draws (half one per write, half in one write), ACK_SYNC and
    // the ACKs the client owes.
    let kind = HeaderKind::Mini;
    let set_ack = wire::set_ack(kind, 1, WINDOW);
    server.write_all(&set_ack)?;
    let draw = wire::message(kind, DRAW_FILL, &[0x5a; DRAW_BODY]);
    let half = DRAWS / 2;
    let sendmmsg = std::env::var(SEND_ENV).is_ok_and(|v| v == "sendmmsg");
    for _ in 0..half {
        write_draws(&mut server, &draw, sendmmsg)?;
    }
    write_draws(&mut server, &draw.repeat((DRAWS - half) as usize), sendmmsg)?;
    read_n(&mut client, set_ack.len() + draw.len() * DRAWS as usize)?;
    let acks = (DRAWS / WINDOW as u64) as usize;
    let (ack_sync, ack) = (wire::ack_sync(kind, 1), wire::ack(kind));
    client.write_all(&ack_sync)?;
    for _ in 0..acks {
        client.write_all(&ack)?;
    }
    read_n(&mut server, ack_sync.len() + ack.len() * acks)?;
    writeln!(out, "done")?;
    out.flush()?;
    let mut rest = Vec::new();
    let _ = stdin.read_to_end(&mut rest);
    Ok(())
}

/// Writes `buf` with write(2), or with sendmmsg(2) (one message) when `sendmmsg`.
fn write_draws(s: &mut TcpStream, buf: &[u8], sendmmsg: bool) -> Result<()> {
    if !sendmmsg {
        return Ok(s.write_all(buf)?);
    }
    use std::os::fd::AsRawFd;
    let mut iov = libc::iovec {
        iov_base: buf.as_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: zeroed mmsghdr is valid (no name, no control); its iovec points at `buf`, which
    // outlives the call.
    let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
    m.msg_hdr.msg_iov = &mut iov;
    m.msg_hdr.msg_iovlen = 1;
    // SAFETY: one valid mmsghdr on a socket this process owns.
    let n = unsafe { libc::sendmmsg(s.as_raw_fd(), &mut m, 1, 0) };
    if n != 1 || m.msg_len as usize != buf.len() {
        bail!(
            "sendmmsg wrote {} of {} bytes: {}",
            m.msg_len,
            buf.len(),
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Reads a link header and the `size` bytes it announces.
fn read_link(s: &mut TcpStream) -> Result<()> {
    let mut h = [0u8; 16];
    s.read_exact(&mut h).context("reading a link header")?;
    let size = u32::from_le_bytes(h[12..16].try_into().unwrap()) as usize;
    read_n(s, size)
}

fn read_n(s: &mut TcpStream, n: usize) -> Result<()> {
    let mut buf = vec![0u8; n];
    s.read_exact(&mut buf)
        .with_context(|| format!("reading {n} bytes"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_counts_follow_the_script() {
        let e = Counts::expected();
        assert_eq!(e.server_sent, 25);
        assert_eq!(e.client_sent, 2);
        assert_eq!(e.acks, 1);
    }
}
