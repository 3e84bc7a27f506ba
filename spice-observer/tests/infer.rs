//! Channel identity of connections joined mid-stream (README "Channel identity without the
//! link phase"), against a real session: Xspice with a spice-gtk client through a socat relay,
//! one observer attached before the client connected (the reference: it reads every channel's
//! link message and main's session id) and one that joins 5 s later. The joined observer's
//! inferred channel types, ends and session grouping must equal what the reference read from
//! the link phase, socket by socket, and a channel it cannot identify must say why instead.
//! Run serially (`--test-threads=1`) under the machine-wide lock.

mod common;

use std::{collections::BTreeMap, thread, time::Duration};

use anyhow::{Result, anyhow, ensure};
use common::{Client, Rig, check_run, describe_ch, privileged, rig};
use spice_observer::report::{ChannelReport, Report};

/// rig/client.py's input chatter: a mouse motion every 50 ms and a key press and a mouse-mode
/// request every 500 ms, so that inputs and main carry messages mid-session (an idle client
/// sends nothing on them).
const CHATTY: &[&str] = &["--inputs-every-ms", "50"];

fn row<'a>(r: &'a Report, c: &ChannelReport) -> Option<&'a ChannelReport> {
    r.channels
        .iter()
        .find(|x| x.pid == c.pid && x.socket == c.socket)
}

/// Xspice (rects, ~1000 display messages/s) behind socat; the joined observer starts 5 s after
/// the client. For every socket both observers saw:
/// - an inferred `channel_type` equals the reference's (from the link message); a type not
///   inferred is `unknown` with its reason, and a socket that carried no message says so;
/// - main, display and inputs are inferred on spice-server and on both relay legs (the
///   client's chatter makes main and inputs talk); Xspice's cursor channel is silent after its
///   INIT (it draws the cursor into the frame buffer), so it stays unknown;
/// - `end` equals the reference's where the joined run knows it;
/// - `session_id` stays null (it is never inferred), and spice-server's sockets are grouped
///   (`session_key`, inferred) around the same main channel the reference grouped them by
///   session id.
#[test]
fn joined_channels_are_named_as_their_link_says() -> Result<()> {
    const T: &str = "joined_channels_are_named_as_their_link_says";
    if !privileged(T) {
        return Ok(());
    }
    let client_py = std::fs::read_to_string(rig().join("client.py"))?;
    ensure!(
        client_py.contains("--inputs-every-ms"),
        "rig/client.py has no --inputs-every-ms (input chatter)"
    );
    let mut rig = Rig::new(T)?;
    let xorg = rig.xspice(
        5965,
        65,
        &["--mode", "rects", "--fps", "50", "--count", "20"],
    )?;
    let relay = rig.relay("socat", "127.0.0.1", 6965, "127.0.0.1", 5965)?;
    let reference = observe_or_skip!(T, &[xorg, relay], 16.0, rig.state.join("reference.json"));
    let _client = Client::start("spice://127.0.0.1:6965", 25, CHATTY, None)?;
    thread::sleep(Duration::from_secs(5));
    let joined = observe_or_skip!(T, &[xorg, relay], 6.0, rig.state.join("joined.json"));
    let j = joined.finish_report()?;
    let r = reference.finish_report()?;
    check_run(&j)?;
    check_run(&r)?;
    let mut failures = Vec::new();
    let mut fail = |what: String| {
        eprintln!("FAIL {what}");
        failures.push(what);
    };
    // Per reference type: (identified, rows), over spice-server and the relay's legs.
    let mut tally: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for c in &j.channels {
        let Some(rc) = row(&r, c) else {
            fail(format!(
                "joined row not in the reference: {}",
                describe_ch(c)
            ));
            continue;
        };
        let why = c.channel_type_evidence.as_deref().unwrap_or("");
        println!(
            "{:<6} {:<40} ref {:<8} joined {:<8} inferred {:<5} end {:?}/{:?} key {:?} ({}) | {}",
            c.comm,
            c.socket,
            rc.channel_type,
            c.channel_type,
            c.channel_type_inferred,
            c.end,
            rc.end,
            c.session_key,
            c.session_inferred,
            why
        );
        let t = tally.entry(rc.channel_type.clone()).or_default();
        t.1 += 1;
        if c.channel_type_evidence.is_none() {
            fail(format!(
                "no evidence on a joined socket: {}",
                describe_ch(c)
            ));
        }
        if c.channel_type_inferred {
            t.0 += usize::from(c.channel_type == rc.channel_type);
            if c.channel_type != rc.channel_type || c.channel_id.is_some() {
                fail(format!(
                    "{}: inferred {} (id {:?}), the link says {} ({why})",
                    c.socket, c.channel_type, c.channel_id, rc.channel_type
                ));
            }
        } else if c.channel_type != "unknown" {
            fail(format!(
                "{}: type {} neither from the link nor inferred",
                c.socket, c.channel_type
            ));
        }
        let silent = c.messages_sent == 0 && c.messages_received == 0;
        if silent && why != "no message framed yet" {
            fail(format!("{}: no message, evidence {why:?}", c.socket));
        }
        if c.end.is_some() && c.end != rc.end {
            fail(format!(
                "{}: end {:?}, the reference's {:?}",
                c.socket, c.end, rc.end
            ));
        }
        if c.session_id.is_some() {
            fail(format!(
                "{}: session_id {:?} on a joined socket",
                c.socket, c.session_id
            ));
        }
        if let (Some(a), Some(b)) = (&c.session_key, &rc.session_key)
            && a != b
        {
            fail(format!(
                "{}: session {a}, the reference's (by session id) {b}",
                c.socket
            ));
        }
    }
    println!("identified / rows per type: {tally:?}");
    for ty in ["main", "display", "inputs"] {
        match tally.get(ty) {
            Some(&(n, rows)) if n == rows && rows == 3 => {}
            other => fail(format!(
                "{ty}: identified/rows {other:?}, expected 3 of 3 (spice-server and both relay legs)"
            )),
        }
    }
    // spice-server's framed sockets are one session, named by its main channel, as the
    // reference grouped them by session id.
    let main = r
        .channels
        .iter()
        .find(|c| c.pid == xorg && c.channel_type == "main")
        .ok_or_else(|| anyhow!("no main channel of Xorg in the reference"))?;
    for c in j.channels.iter().filter(|c| c.pid == xorg) {
        let rc = row(&r, c).unwrap();
        ensure!(
            rc.session_key.as_deref() == Some(main.socket.as_str()) && !rc.session_inferred,
            "reference {}: session_key {:?} (inferred {}), expected {} by session id",
            rc.socket,
            rc.session_key,
            rc.session_inferred,
            main.socket
        );
        if c.channel_type_inferred
            && (c.session_key.as_deref() != Some(main.socket.as_str()) || !c.session_inferred)
        {
            fail(format!(
                "{}: session_key {:?} (inferred {}), expected {} inferred",
                c.socket, c.session_key, c.session_inferred, main.socket
            ));
        }
    }
    ensure!(
        failures.is_empty(),
        "{} failure(s): {failures:#?}",
        failures.len()
    );
    Ok(())
}
