//! Runs the built `spice-peer` binary as two real processes over loopback TCP (no privileges
//! needed) and checks the stdout protocol the kernel-path tests rely on: `listening <port>`
//! first on the server, one `SUMMARY {json}` line at the end of both, exit status 0, and
//! matching counts on both sides. The option-by-option coverage lives in the binary's own
//! unit tests (`cargo test -p spice-observer --bin spice-peer`). The SUMMARY is read into the
//! typed [`common::summary::PeerSummary`] the kernel-path tests use, so a field the peer
//! stops writing fails here first.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};

use common::summary::{PeerSummary, by_type, parse_summary};

const PEER: &str = env!("CARGO_BIN_EXE_spice-peer");

/// Starts the server, returns it and its port (read from its first stdout line).
fn start_server(args: &[&str]) -> (Child, BufReader<std::process::ChildStdout>, String) {
    let mut child = Command::new(PEER)
        .args(["server", "--listen", "127.0.0.1:0", "--timeout-ms", "10000"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn spice-peer server");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let port = line
        .strip_prefix("listening ")
        .unwrap_or_else(|| panic!("first line {line:?}"))
        .trim()
        .to_string();
    (child, out, port)
}

fn summary_of(stdout: &str, what: &str) -> PeerSummary {
    parse_summary(stdout, what).unwrap_or_else(|e| panic!("{e:#}"))
}

/// Runs a server and a client process; returns both SUMMARY objects.
fn run(server: &[&str], client: &[&str]) -> (PeerSummary, PeerSummary) {
    let (mut s, mut s_out, port) = start_server(server);
    let c = Command::new(PEER)
        .args([
            "client",
            "--connect",
            &format!("127.0.0.1:{port}"),
            "--timeout-ms",
            "10000",
        ])
        .args(client)
        .output()
        .expect("run spice-peer client");
    let mut rest = String::new();
    s_out.read_to_string(&mut rest).unwrap();
    let status = s.wait().unwrap();
    assert!(
        c.status.success(),
        "client: {}",
        String::from_utf8_lossy(&c.stderr)
    );
    assert!(status.success(), "server exit {status}");
    (
        summary_of(&rest, "server"),
        summary_of(&String::from_utf8(c.stdout).unwrap(), "client"),
    )
}

#[test]
fn server_and_client_processes_agree() {
    let (s, c) = run(
        &[
            "--messages",
            "100",
            "--set-ack",
            "--window",
            "10",
            "--send-syscall",
            "writev",
            "--iov-split",
        ],
        &[
            "--recv-syscall",
            "recvmsg",
            "--recv-size",
            "64",
            "--messages",
            "3",
            "--send-syscall",
            "sendto",
        ],
    );
    assert_eq!(s.outcome, "ok");
    assert_eq!(s.sent.by_type, c.received.by_type);
    assert_eq!(s.sent.bytes, c.received.bytes);
    assert_eq!(c.sent.by_type, s.received.by_type);
    assert_eq!(s.sent.messages, 101);
    assert_eq!(s.received.by_type, by_type(&[(1, 1), (2, 10), (101, 3)]));
    // The framing code, fed the client's receive calls, finds what the server wrote.
    assert_eq!(c.framing.s2c.by_type, s.sent.by_type);
    assert_eq!(s.framing.c2s.by_type, c.sent.by_type);
}

#[test]
fn refused_link_still_exits_zero_with_a_summary() {
    let (s, c) = run(&["--link-error", "9"], &[]);
    assert_eq!(s.outcome, "link_refused");
    assert_eq!(c.link.refused, Some(9));
    assert_eq!(
        c.framing.s2c.unparsed.as_ref().map(|u| u.reason.as_str()),
        Some("link_refused")
    );
}

#[test]
fn bad_options_exit_2() {
    let out = Command::new(PEER)
        .args(["server", "--listen", "127.0.0.1:0", "--window", "3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
}
