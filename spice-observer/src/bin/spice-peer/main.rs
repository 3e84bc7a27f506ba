//! spice-peer: a scripted SPICE peer (server or client) for kernel-path tests.
//!
//! Real spice-server and spice-gtk cannot be told to split a header over two `writev`s, to hit
//! EAGAIN mid-message or to send garbage, so the observer's end-to-end tests run this peer as
//! a real process over real TCP sockets instead. Each side speaks the SPICE link phase
//! byte-exactly (`docs/spice-protocol.md` §1), then streams data messages
//! with a chosen header kind (§1.9), ACK-window behaviour (§3) and syscall pattern (§4.2, §4.7).
//!
//! * `spice-peer server --listen 127.0.0.1:PORT [options]` accepts ONE connection, prints
//!   `listening <port>` (flushed) once bound, runs the link phase, streams `--messages` messages
//!   (after an optional SET_ACK, obeying spice-server's ACK gate), reads the client's messages
//!   concurrently, closes its write side when done and waits for the client to close.
//!   `--second-set-ack-after N` sends a second SET_ACK (a new generation) after N of them;
//!   `--garbage-at N --garbage-bytes M` writes M bytes of junk into the stream after N
//!   messages (a resync test; the client skips them with `--skip-at N --skip-bytes M`).
//! * `spice-peer client --connect 127.0.0.1:PORT [options]` links, answers SET_ACK with
//!   ACK_SYNC and sends an ACK every W messages (spice-gtk cadence by default), optionally
//!   sends its own messages, and reads until the server closes. `--surplus-ack-after N` sends
//!   one ACK more than the cadence asks for.
//! * `spice-peer load --sessions N --channels M --body-size B --rate R --batch K
//!   --send-syscall write|writev --window W --duration SECS [--port P] [--hold]`: a load
//!   generator for `cargo xtask bench` (`load.rs`): this process plays spice-server for N × M
//!   display channels, one detached client process plays spice-gtk; prints its own counts per
//!   channel as one JSON line at the end (not a `SUMMARY`).
//!
//! `server` and `client` print one final line `SUMMARY {json}` on stdout. Every count in it comes from what
//! the syscalls actually returned: bytes are summed from return values, a sent message counts
//! once all of its bytes were accepted by the kernel, a received message counts once it was
//! parsed from received bytes. The `framing` section is what the shared framing code
//! (`spice_ebpf_common::framing`, the code the eBPF programs run) makes of exactly the bytes
//! of each send and receive call, in call order: the expected kernel view.
//! Exit status: 0 if the script ran to its end (including scripted refusals), 1 on an I/O
//! error, timeout or unexpected protocol bytes (the SUMMARY `error` field says which), 2 on
//! bad options.

mod cli;
mod client;
mod link;
mod load;
mod rx;
mod server;
mod sys;
#[cfg(test)]
mod tests;
mod tx;
mod view;

use std::collections::{BTreeMap, VecDeque};
use std::io::{self, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{Value, json};
use spice_ebpf_common::framing::{
    self, BUF_LEN, DirState, LinkInfo, MessageInfo, Output, UnparsedReason,
};
use spice_ebpf_common::protocol::{
    AUTH_MECHANISM_SASL, AUTH_MECHANISM_SPICE, CAP_AUTH_SASL, CAP_AUTH_SELECTION, CAP_AUTH_SPICE,
    CAP_MINI_HEADER, LINK_HEADER_LEN, LINK_MESS_MAX, LINK_MESS_MIN, LINK_REPLY_MIN, SPICE_MAGIC,
    SPICE_VERSION_MAJOR, TICKET_LEN, channel, msg_client, msg_server,
};
use spice_ebpf_common::wire::{self, HeaderKind, PUB_KEY_LEN, SplitMix64 as Rng};

use cli::*;
use client::*;
use link::*;
use load::*;
use rx::*;
use server::*;
use sys::*;
use tx::*;
use view::*;

fn validate(cli: &Cli) -> Result<(), String> {
    match &cli.cmd {
        Cmd::Server(a) => {
            a.common.validate()?;
            if a.window.is_some() && !a.set_ack {
                return Err("--window needs --set-ack".into());
            }
            if a.window == Some(0) || a.second_window == Some(0) {
                return Err("--window and --second-window must be at least 1".into());
            }
            if !a.set_ack
                && (a.second_set_ack_after.is_some()
                    || a.second_generation.is_some()
                    || a.second_window.is_some())
            {
                return Err("--second-set-ack-after and its options need --set-ack".into());
            }
            if a.garbage_at.is_some() && a.garbage_bytes < 2 {
                return Err("--garbage-bytes must be at least 2".into());
            }
            Ok(())
        }
        Cmd::Client(a) => {
            a.common.validate()?;
            if a.websocket && (a.common.garbage || a.common.tls_bytes || a.common.sasl) {
                return Err("--websocket excludes --garbage, --tls-bytes and --sasl".into());
            }
            Ok(())
        }
        Cmd::Load(a) => a.validate(),
        Cmd::LoadClient(_) => Ok(()),
    }
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = validate(&cli) {
        eprintln!("spice-peer: {e}");
        std::process::exit(2);
    }
    match &cli.cmd {
        Cmd::Load(a) => {
            let (report, ok) = run_load(a);
            let mut out = io::stdout().lock();
            let _ = writeln!(out, "{report}");
            let _ = out.flush();
            if let Some(e) = report["error"].as_str() {
                eprintln!("spice-peer load: {e}");
            } else if !ok {
                eprintln!(
                    "spice-peer load: the two ends disagree or a channel failed (see its JSON)"
                );
            }
            std::process::exit(if ok { 0 } else { 1 });
        }
        Cmd::LoadClient(a) => std::process::exit(if run_load_client(a) { 0 } else { 1 }),
        _ => {}
    }
    let report = match &cli.cmd {
        Cmd::Server(a) => run_server(a, &mut |port| {
            let mut out = io::stdout().lock();
            let _ = writeln!(out, "listening {port}");
            let _ = out.flush();
        }),
        Cmd::Client(a) => run_client(a),
        Cmd::Load(_) | Cmd::LoadClient(_) => unreachable!(),
    };
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "SUMMARY {}", report.summary);
    let _ = out.flush();
    if let Some(e) = report.summary["error"].as_str() {
        eprintln!("spice-peer: {e}");
    }
    std::process::exit(if report.ok { 0 } else { 1 });
}
