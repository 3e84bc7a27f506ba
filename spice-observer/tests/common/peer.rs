//! The scripted SPICE peer (`spice-peer`, src/bin/spice-peer.rs) as child processes of a test:
//! a [`Server`] on a free or a fixed loopback port, a [`Client`] that connects to it (at once,
//! or held at a gate until [`Client::go`] so that its pid is known before it connects), and
//! [`summary_of`], which reads a finished peer's `SUMMARY` with the strict reader
//! ([`super::summary::parse_summary`]). Dropping a [`Server`] or [`Client`] whose process still
//! runs kills and reaps it.

use std::{
    io::{BufRead, BufReader, Read, Write},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    thread::JoinHandle,
};

use anyhow::{Context, Result, anyhow, ensure};

use super::summary::{PeerSummary, parse_summary};

/// The `spice-peer` binary cargo built for this test run.
pub const PEER: &str = env!("CARGO_BIN_EXE_spice-peer");
/// The peers give up (exit 1) after waiting this long for accept, connect, a read or a write
/// (`--timeout-ms`, milliseconds).
pub const PEER_TIMEOUT_MS: &str = "20000";

/// The peer's arguments: `ROLE ADDR_FLAG 127.0.0.1:PORT --timeout-ms` [`PEER_TIMEOUT_MS`]
/// `args…` (`server --listen …` or `client --connect …`).
fn argv(role: &str, addr_flag: &str, port: u16, args: &[&str]) -> Vec<String> {
    let addr = format!("127.0.0.1:{port}");
    [role, addr_flag, &addr, "--timeout-ms", PEER_TIMEOUT_MS]
        .iter()
        .chain(args)
        .map(|a| a.to_string())
        .collect()
}

/// A `spice-peer server` process listening on 127.0.0.1:[`Server::port`].
pub struct Server {
    /// The `spice-peer` process.
    pub child: Child,
    /// The rest of its stdout after the `listening` line; taken by [`Server::summary`] or
    /// [`Server::collect`].
    out: Option<BufReader<ChildStdout>>,
    /// The port it listens on (the one it printed).
    pub port: u16,
}

impl Server {
    /// Starts `spice-peer server --listen 127.0.0.1:0 --timeout-ms` [`PEER_TIMEOUT_MS`]
    /// `args…` and reads the port the kernel chose from its first stdout line,
    /// `listening PORT`. Fails if the process cannot start or that line is not there.
    pub fn start(args: &[&str]) -> Result<Self> {
        Self::spawn(0, args)
    }

    /// The same on the fixed port `port`; the first line must be `listening PORT` with that
    /// port.
    pub fn start_on(port: u16, args: &[&str]) -> Result<Self> {
        ensure!(port != 0, "Server::start_on: port 0 (use Server::start)");
        Self::spawn(port, args)
    }

    fn spawn(port: u16, args: &[&str]) -> Result<Self> {
        let mut child = Command::new(PEER)
            .args(argv("server", "--listen", port, args))
            .stdout(Stdio::piped())
            .spawn()
            .context("starting spice-peer server")?;
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line)?;
        let port = if port == 0 {
            line.strip_prefix("listening ")
                .ok_or_else(|| anyhow!("spice-peer server {args:?}: first line {line:?}"))?
                .trim()
                .parse()
                .with_context(|| format!("spice-peer server {args:?}: first line {line:?}"))?
        } else {
            ensure!(
                line.trim() == format!("listening {port}"),
                "spice-peer server {args:?} on {port}: first line {line:?}"
            );
            port
        };
        Ok(Self {
            child,
            out: Some(out),
            port,
        })
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Reads the rest of its stdout, waits for it and returns its SUMMARY ([`summary_of`]).
    pub fn summary(&mut self, what: &str) -> Result<PeerSummary> {
        let mut out = self
            .out
            .take()
            .ok_or_else(|| anyhow!("{what}: stdout already taken"))?;
        summary_of(&mut self.child, &mut out, what)
    }

    /// The rest of its stdout, read to the end by a thread (for a caller that keeps running
    /// a loop meanwhile); the process is not waited for.
    pub fn collect(&mut self) -> JoinHandle<String> {
        let mut out = self.out.take().unwrap();
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = out.read_to_string(&mut text);
            text
        })
    }
}

/// A `spice-peer client` process connecting to 127.0.0.1:`port`.
pub struct Client {
    /// The process: the gate's shell until [`Client::go`], then (same pid) `spice-peer`.
    pub child: Child,
    /// The gate's stdin, until [`Client::go`].
    stdin: Option<ChildStdin>,
    /// Its stdout, for [`Client::summary`]; none for [`Client::start`].
    out: Option<ChildStdout>,
}

impl Client {
    /// Starts `spice-peer client --connect 127.0.0.1:PORT --timeout-ms` [`PEER_TIMEOUT_MS`]
    /// `args…` held at a gate until [`Client::go`]: `sh -c 'read go && exec spice-peer …'`
    /// reads one line from its stdin, then execs the peer, which keeps the pid the observer
    /// was given. Its stdout is kept for [`Client::summary`].
    pub fn gated(port: u16, args: &[&str]) -> Result<Self> {
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(r#"read go && exec "$0" "$@""#)
            .arg(PEER)
            .args(argv("client", "--connect", port, args))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting gated spice-peer client")?;
        let stdin = child.stdin.take();
        let out = child.stdout.take();
        Ok(Self { child, stdin, out })
    }

    /// Starts the same client at once (no gate), its stdout discarded.
    pub fn start(port: u16, args: &[&str]) -> Result<Self> {
        let child = Command::new(PEER)
            .args(argv("client", "--connect", port, args))
            .stdout(Stdio::null())
            .spawn()
            .context("starting spice-peer client")?;
        Ok(Self {
            child,
            stdin: None,
            out: None,
        })
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Opens the gate of a [`Client::gated`] client: the shell execs the client, which
    /// connects. Fails if there is no gate (already opened, or [`Client::start`]).
    pub fn go(&mut self) -> Result<()> {
        let mut stdin = self
            .stdin
            .take()
            .ok_or_else(|| anyhow!("client released twice"))?;
        stdin.write_all(b"go\n")?;
        Ok(())
    }

    /// Reads its stdout to the end, waits for it and returns its SUMMARY ([`summary_of`]).
    /// Fails for a [`Client::start`] client (stdout discarded).
    pub fn summary(&mut self, what: &str) -> Result<PeerSummary> {
        let mut out = self
            .out
            .take()
            .ok_or_else(|| anyhow!("{what}: no stdout to read"))?;
        summary_of(&mut self.child, &mut out, what)
    }
}

/// Reads a peer's stdout to the end, waits for it, returns its SUMMARY (typed: a field the
/// peer did not write fails, a missing `error` is not read as success); the peer must have
/// exited 0 with `error` null.
pub fn summary_of(child: &mut Child, out: &mut dyn Read, what: &str) -> Result<PeerSummary> {
    let mut text = String::new();
    out.read_to_string(&mut text)?;
    let status = child.wait()?;
    let v = parse_summary(&text, what).with_context(|| format!("{what} exited {status}"))?;
    ensure!(
        status.success(),
        "{what} failed ({status}): error {:?}",
        v.error
    );
    ensure!(v.error.is_none(), "{what}: error {:?}", v.error);
    Ok(v)
}

/// Kills and reaps `child` if it still runs (a test that failed half-way leaves no peer).
fn kill_running(child: &mut Child) {
    if matches!(child.try_wait(), Ok(None)) {
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        kill_running(&mut self.child);
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        kill_running(&mut self.child);
    }
}
