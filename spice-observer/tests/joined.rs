//! Issue 9 acceptance: joining sessions that are already open, against real processes.
//!
//! * A real session (Xspice, i.e. spice-server in Xorg, and the headless spice-gtk client
//!   rig/client.py) is watched from its start by a reference `observe`; 5 s after the client
//!   connected a second, standalone `observe --pid` joins it mid-stream. Both load their own
//!   programs (`source.kind` `loaded`; no daemon). Every kernel record of both runs is
//!   dumped (`--dump-events`): the reference's messages carry the TCP sequence number of
//!   their header (`MessageEvent::seq`), the same number space for both observers of one
//!   socket, so the joined run's first counted message (the one after its LOCK record) is
//!   found in the reference, and from there on both must list exactly the same messages
//!   (sequence number, type, size), to the joined run's last one.
//!   Checked: the display channel locks within 2 s (rects: ~1000 msgs/s) or 10 s (noise:
//!   ~20 big draws/s) of the joined run's start; no resync on a real session; the inferred
//!   channel types equal the reference's link-derived ones for main, display, inputs and
//!   cursor; the window interval of the joined run contains the reference's exact count.
//! * The same through a socat relay: the relay's legs lock on content alone, and the chain
//!   is paired and its stages placed after the lock.
//! * No false lock: non-SPICE TCP traffic (iperf3, an HTTP download of binaries, /dev/urandom
//!   through socat; ≥ 1 GB in all) joined mid-stream never locks.
//! * Resync: the scripted peer writes junk into a framed stream (`spice-peer server
//!   --garbage-at N --garbage-bytes M`; its client skips the junk): the observer hunts,
//!   re-locks, counts the resync, and its counts and unframed bytes agree with what the peer
//!   wrote.
//!
//! Privileged (loads BPF, starts Xspice, socat, iperf3): run serially (`--test-threads=1`)
//! under the machine-wide lock. Under `CI=true` every test fails instead of skipping.

mod common;

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use common::{Client, Rig, check_run, describe_ch, parse_report, privileged, terminate};
use serde_json::Value;
use spice_ebpf_common::event::{lock_how, msg_flags};
use spice_observer::{
    model::joined::STALL_GAP_NS,
    report::{ChannelReport, Report},
    samples::SampleLine,
};

/// A pin directory that does not exist: each `observe` loads its own programs even if a
/// daemon has pinned a set at the default place (`--pin-dir`).
const NO_PINS: &str = "/tmp/spice-observer-test-joined-no-pins";

// ---------------------------------------------------------------------------------------------
// The dumped records

/// One record of `observe --dump-events`: the `Debug` form of
/// `spice_observer::events::Event` (one per line), with its header and its numeric fields.
#[derive(Clone, Debug)]
struct Rec {
    /// The `Event` variant: `Message`, `Lock`, `Hunt`, … .
    kind: String,
    /// `EventHeader` fields.
    dir: u8,
    ts_ns: u64,
    cookie: u64,
    /// The record's own numeric fields (`at`, `index`, `seq`, `msg_type`, …); arrays left out.
    f: BTreeMap<String, u64>,
}

impl Rec {
    fn get(&self, k: &str) -> Result<u64> {
        self.f
            .get(k)
            .copied()
            .ok_or_else(|| anyhow!("{} record lacks field {k}: {self:?}", self.kind))
    }
}

/// A dumped message, with what the comparisons use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Msg {
    ts_ns: u64,
    /// TCP sequence number of the header's first byte.
    seq: u32,
    /// Stream offset of the header (this observer's; joined runs count from the join).
    at: u64,
    index: u64,
    msg_type: u16,
    size: u32,
    flags: u8,
}

/// `k: v` pairs at depth 0 of `s` (a `Debug` struct body without its braces), values that
/// parse as `u64`.
fn pairs(s: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let mut depth = 0i32;
    let mut start = 0usize;
    let mut push = |piece: &str| {
        if let Some((k, v)) = piece.split_once(": ")
            && let Ok(n) = v.trim().parse::<u64>()
        {
            out.insert(k.trim().to_string(), n);
        }
    };
    for (i, ch) in s.char_indices() {
        match ch {
            '[' | '{' | '(' => depth += 1,
            ']' | '}' | ')' => depth -= 1,
            ',' if depth == 0 => {
                push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    push(&s[start..]);
    out
}

/// Reads one dump line: `Variant(Struct { hdr: EventHeader { … }, … })` or
/// `Variant { hdr: EventHeader { … }, … }`. `None` for a line without an `EventHeader`.
fn parse_rec(line: &str) -> Result<Option<Rec>> {
    let kind: String = line
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .collect();
    let Some(h0) = line.find("EventHeader { ") else {
        return Ok(None);
    };
    let h0 = h0 + "EventHeader { ".len();
    let h1 = line[h0..]
        .find(" }")
        .map(|i| i + h0)
        .ok_or_else(|| anyhow!("unterminated EventHeader: {line}"))?;
    let hdr = pairs(&line[h0..h1]);
    let rest = line[h1 + 2..].trim_start_matches(',').trim();
    let rest = rest.trim_end_matches([')', '}', ' ']);
    let f = pairs(rest);
    let h = |k: &str| {
        hdr.get(k)
            .copied()
            .ok_or_else(|| anyhow!("EventHeader lacks {k}: {line}"))
    };
    Ok(Some(Rec {
        kind,
        dir: h("dir")? as u8,
        ts_ns: h("ts_ns")?,
        cookie: h("cookie")?,
        f,
    }))
}

/// Every record of a `--dump-events` file.
fn read_dump(path: &Path) -> Result<Vec<Rec>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for line in text.lines() {
        if let Some(r) = parse_rec(line).with_context(|| format!("{}", path.display()))? {
            out.push(r);
        }
    }
    ensure!(!out.is_empty(), "{} holds no record", path.display());
    Ok(out)
}

/// The messages of one socket and direction, in record order.
fn messages(recs: &[Rec], cookie: u64, dir: u8) -> Result<Vec<Msg>> {
    recs.iter()
        .filter(|r| r.kind == "Message" && r.cookie == cookie && r.dir == dir)
        .map(|r| {
            Ok(Msg {
                ts_ns: r.ts_ns,
                seq: r.get("seq")? as u32,
                at: r.get("at")?,
                index: r.get("index")?,
                msg_type: r.get("msg_type")? as u16,
                size: r.get("size")? as u32,
                flags: r.get("flags")? as u8,
            })
        })
        .collect()
}

/// Durations (ns) of spice-server's waits on the ACK window on socket `cookie`, from the
/// kernel's window effects in the records (STALL_BEGAN on a server message, STALL_ENDED on
/// the ACK or SET_ACK that ended it).
fn window_stalls(recs: &[Rec], cookie: u64) -> Result<Vec<Stall>> {
    use spice_ebpf_common::window::effect;
    let mut out = Vec::new();
    let mut began = None;
    let mut all: Vec<&Rec> = recs
        .iter()
        .filter(|r| r.kind == "Message" && r.cookie == cookie)
        .collect();
    all.sort_by_key(|r| r.ts_ns);
    for r in all {
        let fx = r.get("win_effects")? as u8;
        if fx & effect::STALL_BEGAN != 0 {
            began = Some(r.ts_ns);
        }
        if fx & effect::STALL_ENDED != 0
            && let Some(b) = began.take()
        {
            out.push(Stall {
                ns: r.ts_ns - b,
                end_ts: r.ts_ns,
                end_seq: r.get("seq")? as u32,
                end_flags: r.get("flags")? as u8,
            });
        }
    }
    Ok(out)
}

/// A window stall of the reference run: how long (ns), and the record that ended it (the
/// client's ACK): its timestamp (ns, the kernel's monotonic clock, shared by both runs), TCP
/// sequence number and `msg_flags`.
#[derive(Clone, Copy, Debug)]
struct Stall {
    ns: u64,
    end_ts: u64,
    end_seq: u32,
    end_flags: u8,
}

/// What the joined run's records show at the ACK that ended a stall of the reference: the
/// preconditions of the stall pin (`spice_observer::model::joined`, "Pinning the count at a
/// stall") that do not depend on the model.
#[derive(Debug)]
struct StallEnd {
    /// The ACK's `msg_flags` in the joined run.
    flags: u8,
    /// Nanoseconds from the ACK's record to the next server → client start, and its size
    /// (header + body); `None` if no start followed.
    resume: Option<(u64, u64)>,
    /// Further ACKs read before that start.
    acks_between: usize,
}

impl StallEnd {
    /// Why no stall pin can apply here, if one of its preconditions failed.
    fn no_pin(&self) -> Option<String> {
        use spice_observer::model::joined::{RESUME_NS, RESUME_NS_PER_BYTE};
        if self.flags & msg_flags::PEER_MID_MESSAGE != 0 {
            return Some("the ACK was read with the server mid-message".into());
        }
        if self.acks_between > 0 {
            return Some(format!(
                "spice-server read {} more ACK(s) before it started a message",
                self.acks_between
            ));
        }
        match self.resume {
            None => Some("no server message followed the ACK".into()),
            Some((ns, bytes)) if ns > RESUME_NS + RESUME_NS_PER_BYTE * bytes => Some(format!(
                "spice-server started its next message ({bytes} B) {:.3} ms after the ACK, \
                 beyond the pin's {:.3} ms",
                ns as f64 / 1e6,
                (RESUME_NS + RESUME_NS_PER_BYTE * bytes) as f64 / 1e6
            )),
            Some(_) => None,
        }
    }
}

/// The joined run's view of the ACK with TCP sequence number `seq` on socket `cookie`
/// (client → server direction 1); `None` if it did not record that ACK.
fn stall_end(recs: &[Rec], cookie: u64, seq: u32) -> Result<Option<StallEnd>> {
    let mut all: Vec<&Rec> = recs
        .iter()
        .filter(|r| r.kind == "Message" && r.cookie == cookie)
        .collect();
    all.sort_by_key(|r| r.ts_ns);
    let mut at = None;
    for (i, r) in all.iter().enumerate() {
        if r.dir == 1 && r.get("seq")? as u32 == seq {
            at = Some(i);
            break;
        }
    }
    let Some(i) = at else {
        return Ok(None);
    };
    let ack = all[i];
    let mut acks_between = 0;
    let mut resume = None;
    for r in &all[i + 1..] {
        if r.dir == 0 {
            resume = Some((
                r.ts_ns.saturating_sub(ack.ts_ns),
                r.get("size")? + r.get("hdr_len")?,
            ));
            break;
        }
        if r.get("msg_type")? == 2 {
            acks_between += 1;
        }
    }
    Ok(Some(StallEnd {
        flags: ack.get("flags")? as u8,
        resume,
        acks_between,
    }))
}

/// Records of `kind` of one socket and direction.
fn of_kind<'a>(recs: &'a [Rec], kind: &str, cookie: u64, dir: u8) -> Vec<&'a Rec> {
    recs.iter()
        .filter(|r| r.kind == kind && r.cookie == cookie && r.dir == dir)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Observers

/// The files of one `observe` run.
struct Files {
    json: PathBuf,
    dump: PathBuf,
    samples: PathBuf,
}

impl Files {
    fn new(state: &Path, name: &str) -> Self {
        Self {
            json: state.join(format!("{name}.json")),
            dump: state.join(format!("{name}.events")),
            samples: state.join(format!("{name}.samples")),
        }
    }

    /// The extra `observe` arguments: own programs, every record dumped, the sample series.
    fn args(&self) -> Vec<String> {
        vec![
            "--pin-dir".into(),
            NO_PINS.into(),
            "--dump-events".into(),
            self.dump.display().to_string(),
            "--samples".into(),
            self.samples.display().to_string(),
        ]
    }
}

/// A finished run: its typed report, its records and its sample lines.
struct Run {
    report: Report,
    recs: Vec<Rec>,
    samples: Vec<SampleLine>,
}

/// Waits for `obs` and reads its outputs; checks the run ([`check_run`]) and that it loaded
/// its own programs.
fn finish(name: &'static str, obs: common::Observer, files: &Files) -> Result<Run> {
    let report = parse_report(&obs.finish()?)?;
    check_run(&report).with_context(|| format!("{name} run"))?;
    ensure!(
        report.source.kind == "loaded",
        "{name}: source {:?}: not a standalone observe",
        report.source
    );
    let recs = read_dump(&files.dump)?;
    let text = std::fs::read_to_string(&files.samples).unwrap_or_default();
    let samples = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).with_context(|| format!("{name} sample line {l}")))
        .collect::<Result<Vec<SampleLine>>>()?;
    Ok(Run {
        report,
        recs,
        samples,
    })
}

/// Starts an `observe` of `pids` for `secs` with [`Files::args`]; under `CI=true` a missing
/// kernel feature is an error, otherwise `None` (a loud skip).
fn observe(test: &str, pids: &[u32], secs: f64, files: &Files) -> Result<Option<common::Observer>> {
    let args = files.args();
    let extra: Vec<&str> = args.iter().map(String::as_str).collect();
    match common::Observer::start_with(pids, secs, files.json.clone(), &extra)? {
        common::Started::Running(o) => Ok(Some(o)),
        common::Started::Unsupported(why) => {
            let msg = common::cannot_run(test, &format!("kernel feature missing:\n{why}"));
            if common::ci() {
                bail!("{msg}");
            }
            eprintln!("{msg}");
            Ok(None)
        }
    }
}

fn channel_by_cookie(r: &Report, cookie: u64) -> Option<&ChannelReport> {
    r.channels.iter().find(|c| c.cookie == cookie)
}

// ---------------------------------------------------------------------------------------------
// Joined run against the reference

/// One direction of one socket: the joined run against the reference.
#[derive(Clone, Debug)]
struct DirFigures {
    cookie: u64,
    socket: String,
    channel_type: String,
    dir: u8,
    /// Seconds from the joined run's start to its LOCK record; `None` if it never locked.
    lock_s: Option<f64>,
    lock_how: Option<String>,
    /// Messages the joined run counted (from the lock), and the reference over the same
    /// messages (its first one = the joined run's lock message).
    joined: usize,
    reference: usize,
    /// Messages the reference counted in this direction before the lock message.
    before_lock: u64,
}

/// Compares one direction: the joined run's messages must be exactly the reference's from the
/// joined run's lock message to its last message. Returns the figures and the problems found
/// (the first difference of each kind).
fn compare_dir(
    joined: &Run,
    reference: &Run,
    cookie: u64,
    dir: u8,
) -> Result<(DirFigures, Vec<String>)> {
    let j = messages(&joined.recs, cookie, dir)?;
    let r = messages(&reference.recs, cookie, dir)?;
    let locks = of_kind(&joined.recs, "Lock", cookie, dir);
    let ch = channel_by_cookie(&reference.report, cookie);
    let mut fig = DirFigures {
        cookie,
        socket: ch.map_or_else(|| format!("cookie:{cookie}"), |c| c.socket.clone()),
        channel_type: ch.map_or_else(|| "?".into(), |c| c.channel_type.clone()),
        dir,
        lock_s: locks
            .first()
            .map(|l| l.ts_ns.saturating_sub(joined.report.clock.monotonic_ns) as f64 / 1e9),
        lock_how: locks
            .first()
            .and_then(|l| l.get("how").ok())
            .map(|h| lock_how::name(h as u8).to_string()),
        joined: j.len(),
        reference: 0,
        before_lock: 0,
    };
    let mut problems = Vec::new();
    let name = format!("{} {} dir {dir}", fig.channel_type, fig.socket);
    let Some(first) = j.first() else {
        if !locks.is_empty() {
            problems.push(format!("{name}: a LOCK record but no message after it"));
        }
        return Ok((fig, problems));
    };
    if locks.len() != 1 {
        problems.push(format!(
            "{name}: {} locks on a real session (a resync: a lock failed validation)",
            locks.len()
        ));
    }
    if first.flags & msg_flags::LOCK == 0 {
        problems.push(format!(
            "{name}: the first counted message lacks the LOCK flag (msg_flags::LOCK): {first:?}"
        ));
    }
    if let Some(l) = locks.first() {
        let lock_index = l.get("index")?;
        let lock_at = l.get("at")?;
        if first.index != lock_index || first.at != lock_at {
            problems.push(format!(
                "{name}: LOCK index {lock_index} at {lock_at}, first message {first:?}"
            ));
        }
    }
    let Some(p) = r.iter().position(|m| m.seq == first.seq) else {
        problems.push(format!(
            "{name}: the joined run locked at seq {} (type {}, size {}), which starts no message \
             of the reference (a false lock)",
            first.seq, first.msg_type, first.size
        ));
        return Ok((fig, problems));
    };
    let last = j.last().unwrap().seq.wrapping_sub(first.seq);
    let same: Vec<&Msg> = r[p..]
        .iter()
        .take_while(|m| m.seq.wrapping_sub(first.seq) <= last)
        .collect();
    fig.reference = same.len();
    fig.before_lock = r[p].index - 1;
    if let Some((k, (a, b))) = j.iter().zip(same.iter()).enumerate().find(|(_, (a, b))| {
        (a.seq, a.msg_type, a.size) != (b.seq, b.msg_type, b.size)
            || a.index - first.index != b.index - r[p].index
    }) {
        problems.push(format!(
            "{name}: message {k} after the lock differs: joined {a:?}, reference {b:?}"
        ));
    }
    if j.len() != same.len() {
        problems.push(format!(
            "{name}: {} messages from the lock, the reference has {} over the same bytes",
            j.len(),
            same.len()
        ));
    }
    // The report counts what the records say, and says when and how it locked.
    match channel_by_cookie(&joined.report, cookie) {
        None => problems.push(format!("{name}: not in the joined report")),
        Some(c) => {
            let (counted, sync) = if dir == 0 {
                (c.messages_sent, &c.sync_sent)
            } else {
                (c.messages_received, &c.sync_received)
            };
            if counted != j.len() as u64 {
                problems.push(format!(
                    "{name}: the joined report counts {counted}, its records {}",
                    j.len()
                ));
            }
            match (sync, locks.first()) {
                (None, _) => {
                    problems.push(format!("{name}: no sync_* report of a joined direction"))
                }
                (Some(y), l) => {
                    let lock_ns = l.map(|l| l.ts_ns);
                    if y.hunting
                        || y.reason != "attached_mid_stream"
                        || y.locks != 1
                        || y.resyncs != 0
                        || y.first_index != Some(1)
                        || y.locked_mono_ns != lock_ns
                        || y.how != fig.lock_how
                    {
                        problems.push(format!(
                            "{name}: sync report {y:?}, the LOCK record at {lock_ns:?} ns ({:?})",
                            fig.lock_how
                        ));
                    }
                }
            }
        }
    }
    Ok((fig, problems))
}

fn print_figures(test: &str, figs: &[DirFigures]) {
    println!("{test}: direction  lock_s  how  joined  reference  before_lock");
    for f in figs {
        println!(
            "{test}:   {:8} {:>4} {:32} {:?} {:?} joined {} reference {} before_lock {}",
            f.channel_type,
            if f.dir == 0 { "send" } else { "recv" },
            f.socket,
            f.lock_s,
            f.lock_how,
            f.joined,
            f.reference,
            f.before_lock
        );
    }
}

/// The channel type the joined run gives socket `cookie`, and whether it marks it inferred
/// (`channel_type_inferred`).
fn joined_type(joined: &Run, cookie: u64) -> Result<(String, bool)> {
    let c = channel_by_cookie(&joined.report, cookie)
        .ok_or_else(|| anyhow!("joined report lacks socket cookie {cookie}"))?;
    println!(
        "type: {} {} inferred {} ({:?})",
        c.socket, c.channel_type, c.channel_type_inferred, c.channel_type_evidence
    );
    Ok((c.channel_type.clone(), c.channel_type_inferred))
}

/// What one session test found; failures are collected so that every figure is printed.
#[derive(Default)]
struct Verdict {
    failures: Vec<String>,
}

impl Verdict {
    fn check(&mut self, what: &str, r: Result<()>) {
        if let Err(e) = r {
            let msg = format!("{what}: {e:#}");
            println!("FAILED {msg}");
            self.failures.push(msg);
        }
    }

    fn done(self, test: &str) -> Result<()> {
        if self.failures.is_empty() {
            println!("{test}: every check passed");
            return Ok(());
        }
        bail!(
            "{test}: {} check(s) failed:\n  {}",
            self.failures.len(),
            self.failures.join("\n  ")
        )
    }
}

/// The sockets of `pids` (and their children) the reference saw framed from the link, by
/// cookie.
fn reference_channels<'a>(reference: &'a Run, pids: &[u32]) -> Vec<&'a ChannelReport> {
    let kids: Vec<u32> = reference
        .report
        .forked
        .iter()
        .filter(|f| pids.contains(&f.parent))
        .map(|f| f.child)
        .collect();
    reference
        .report
        .channels
        .iter()
        .filter(|c| (pids.contains(&c.pid) || kids.contains(&c.pid)) && c.channel_id.is_some())
        .collect()
}

/// The checks of a joined run against the reference, for the sockets of spice-server (`xorg`)
/// and, through a relay, of the relay (`relay`).
fn check_session(
    test: &str,
    joined: &Run,
    reference: &Run,
    xorg: u32,
    relay: Option<u32>,
    lock_limit_s: f64,
) -> Result<()> {
    let mut v = Verdict::default();
    let mut pids = vec![xorg];
    pids.extend(relay);
    let chans = reference_channels(reference, &pids);
    let mut figs = Vec::new();
    for c in &chans {
        for dir in [0u8, 1] {
            let (f, problems) = compare_dir(joined, reference, c.cookie, dir)?;
            figs.push(f);
            for p in problems {
                v.check("from the lock", Err(anyhow!("{p}")));
            }
        }
    }
    print_figures(test, &figs);
    // The display channel's server → client direction locks in time, on every socket.
    for c in chans.iter().filter(|c| c.channel_type == "display") {
        let send = if c.end.as_deref() == Some("server") {
            0
        } else {
            1
        };
        let f = figs.iter().find(|f| f.cookie == c.cookie && f.dir == send);
        v.check(
            &format!("display lock time {}", c.socket),
            match f.and_then(|f| f.lock_s) {
                Some(s) if s <= lock_limit_s => Ok(()),
                Some(s) => Err(anyhow!("locked after {s:.3} s (limit {lock_limit_s} s)")),
                None => Err(anyhow!("never locked")),
            },
        );
    }
    // Channel types: the joined run's inference equals the reference's link, on
    // spice-server's sockets and on the relay's legs.
    for c in &chans {
        v.check(
            &format!("channel type of {} ({})", c.socket, c.channel_type),
            joined_type(joined, c.cookie).and_then(|(ty, inferred)| {
                ensure!(
                    ty == c.channel_type,
                    "inferred {ty}, the link says {}",
                    c.channel_type
                );
                ensure!(inferred, "type {ty} not marked inferred");
                Ok(())
            }),
        );
    }
    for ty in ["main", "display", "inputs", "cursor"] {
        v.check(
            &format!("{ty} channel present"),
            if chans.iter().any(|c| c.pid == xorg && c.channel_type == ty) {
                Ok(())
            } else {
                Err(anyhow!("the reference saw no {ty} channel of spice-server"))
            },
        );
    }
    v.check("window interval", check_interval(joined, reference, xorg));
    if relay.is_some() {
        v.check("relay chain", check_chain(joined, reference, xorg));
    }
    v.done(test)
}

/// The window interval of the joined run against the reference's exact count, position by
/// position.
///
/// Each joined sample line of spice-server's display socket names the position its interval
/// refers to: `server_messages` (server → client messages counted since the lock) and
/// `acks` (ACK records seen). The reference's dump gives, for that position, spice-server's
/// exact count (the window rule of docs/spice-protocol.md §3: messages since the SET_ACK,
/// which counts, minus W per ACK): the joined run's n-th message is the reference's
/// (before_lock + n)-th, its a-th ACK the reference's (acks before the client direction's
/// lock + a)-th. Every interval must contain that count; once a line is exact, every later
/// line must be exact and equal to it (the paused client's stall pins the count).
fn check_interval(joined: &Run, reference: &Run, xorg: u32) -> Result<()> {
    let c = reference
        .report
        .channels
        .iter()
        .find(|c| c.pid == xorg && c.channel_type == "display")
        .ok_or_else(|| anyhow!("no display channel in the reference"))?;
    let w = i64::from(
        c.window
            .ok_or_else(|| anyhow!("the reference saw no SET_ACK: {}", describe_ch(c)))?,
    );
    let (r_s, r_c) = (
        messages(&reference.recs, c.cookie, 0)?,
        messages(&reference.recs, c.cookie, 1)?,
    );
    let (j_s, j_c) = (
        messages(&joined.recs, c.cookie, 0)?,
        messages(&joined.recs, c.cookie, 1)?,
    );
    let set_ack = r_s
        .iter()
        .find(|m| m.msg_type == 3)
        .ok_or_else(|| anyhow!("no SET_ACK in the reference's records"))?
        .index;
    let pos = |r: &[Msg], j: &[Msg], what: &str| -> Result<usize> {
        let first = j
            .first()
            .ok_or_else(|| anyhow!("the joined run counted no {what} message"))?;
        r.iter()
            .position(|m| m.seq == first.seq)
            .ok_or_else(|| anyhow!("the joined run's first {what} message is not the reference's"))
    };
    let before_s = r_s[pos(&r_s, &j_s, "server")?].index - 1;
    let acks_before = r_c[..pos(&r_c, &j_c, "client")?]
        .iter()
        .filter(|m| m.msg_type == 2)
        .count() as i64;
    let truth = |n: u64, a: u64| -> i64 {
        (before_s + n) as i64 - set_ack as i64 + 1 - w * (acks_before + a as i64)
    };
    let lines: Vec<&SampleLine> = joined
        .samples
        .iter()
        .filter(|l| l.socket == c.socket)
        .collect();
    ensure!(
        !lines.is_empty(),
        "the joined run wrote no sample line for the display channel {} ({} lines in all)",
        c.socket,
        joined.samples.len()
    );
    let (mut inside, mut exact_lines, mut widest) = (0usize, 0usize, 0u64);
    let mut first_exact: Option<f64> = None;
    for l in &lines {
        let (lo, hi, exact) = (l.in_flight_low, l.in_flight_high, l.in_flight_exact);
        let t = truth(l.server_messages, l.acks);
        ensure!(
            lo as i64 <= t && t <= hi as i64,
            "interval [{lo}, {hi}] does not contain the reference's count {t} (inside before: \
             {inside}): {l:?}"
        );
        ensure!(
            exact == (lo == hi),
            "in_flight_exact {exact} for [{lo}, {hi}]: {l:?}"
        );
        if first_exact.is_some() {
            ensure!(exact, "no longer exact after the stall pinned it: {l:?}");
        }
        if exact {
            exact_lines += 1;
            first_exact.get_or_insert(l.t_s);
        }
        widest = widest.max(hi - lo);
        inside += 1;
    }
    let j = channel_by_cookie(&joined.report, c.cookie)
        .ok_or_else(|| anyhow!("the joined run lacks {}", c.socket))?;
    println!(
        "interval: {inside} sample lines, every one contains the reference's count; widest \
         {widest}; exact from t = {first_exact:?} s ({exact_lines} lines); joined W {:?} ({:?}), \
         the reference's {w}; joined_window {:?}",
        j.window, j.window_source, j.joined_window
    );
    // The stall pin needs spice-server to have waited on the window (its count above 2W)
    // for a while, then to start right after the ACK. The reference's own records say whether
    // it did: with big draws the paused client's TCP buffers hold the server before its count
    // reaches 2W+1, and its window stalls last about a millisecond; then nothing can pin the
    // count and the channel stays bounded (contained, as checked above).
    let r_stalls = window_stalls(&reference.recs, c.cookie)?;
    let longest = r_stalls.iter().max_by_key(|s| s.ns).copied();
    println!(
        "reference: {} window stall(s), longest {:.1} ms",
        r_stalls.len(),
        longest.map_or(0.0, |s| s.ns as f64 / 1e6)
    );
    // A stall long enough for the pin ([`STALL_GAP_NS`]) must pin the count, unless the
    // joined run's own records show that spice-server did not resume at the ACK the way the
    // pin requires (the kernel's timestamps; the reference's flags on the same ACK).
    let pinnable = |s: &Stall| -> Result<Option<String>> {
        let end = stall_end(&joined.recs, c.cookie, s.end_seq)?.ok_or_else(|| {
            anyhow!(
                "the joined run has no record of the ACK (seq {}) that ended a {:.0} ms \
                 window stall of the reference",
                s.end_seq,
                s.ns as f64 / 1e6
            )
        })?;
        let mid = msg_flags::PEER_MID_MESSAGE;
        ensure!(
            end.flags & mid == s.end_flags & mid,
            "the ACK (seq {}) that ended a window stall: PEER_MID_MESSAGE {} in the joined \
             run, {} in the reference",
            s.end_seq,
            end.flags & mid != 0,
            s.end_flags & mid != 0
        );
        println!("stall end (seq {}): {end:?}", s.end_seq);
        Ok(end.no_pin())
    };
    let mut blocked = Vec::new();
    let mut expect_pin = false;
    for s in r_stalls.iter().filter(|s| s.ns >= STALL_GAP_NS) {
        // Stalls that ended before the joined run saw this socket are not its to pin.
        let joined_from = joined
            .recs
            .iter()
            .filter(|r| r.cookie == c.cookie)
            .map(|r| r.ts_ns)
            .min();
        if joined_from.is_none_or(|t| t > s.end_ts) {
            continue;
        }
        match pinnable(s)? {
            Some(why) => blocked.push(format!("{:.0} ms stall: {why}", s.ns as f64 / 1e6)),
            None => expect_pin = true,
        }
    }
    if expect_pin {
        ensure!(
            first_exact.is_some(),
            "the interval never became exact, though the reference shows spice-server waiting \
             {:.0} ms on the window and the joined run's records meet the stall pin's \
             conditions at its end",
            longest.map_or(0.0, |s| s.ns as f64 / 1e6)
        );
    } else if !blocked.is_empty() {
        println!("no stall could pin the count: {}", blocked.join("; "));
    }
    ensure!(
        j.window.map(i64::from) == Some(w)
            && j.window_inferred
            && j.window_source.as_deref() == Some("ack_cadence"),
        "the joined run's W {:?} (inferred {}, source {:?}), the reference's SET_ACK W {w}",
        j.window,
        j.window_inferred,
        j.window_source
    );
    Ok(())
}

/// Through the relay: the joined run paired spice-server's display socket with the relay's
/// legs and placed stages.
fn check_chain(joined: &Run, reference: &Run, xorg: u32) -> Result<()> {
    let d = reference
        .report
        .channels
        .iter()
        .find(|c| c.pid == xorg && c.channel_type == "display")
        .ok_or_else(|| anyhow!("no display channel in the reference"))?;
    let r_chain = d
        .chain
        .as_ref()
        .ok_or_else(|| anyhow!("the reference has no chain: {}", describe_ch(d)))?;
    let j = channel_by_cookie(&joined.report, d.cookie)
        .ok_or_else(|| anyhow!("the joined run lacks {}", d.socket))?;
    let chain = j
        .chain
        .as_ref()
        .ok_or_else(|| anyhow!("joined: no chain: {}", describe_ch(j)))?;
    println!(
        "chain: joined backend {:?} client_leg {:?} pairing {:?} samples {} placed {}; reference backend {:?} client_leg {:?}",
        chain.backend,
        chain.client_leg,
        chain.pairing,
        chain.samples,
        chain.samples_placed,
        r_chain.backend,
        r_chain.client_leg
    );
    ensure!(
        chain.backend.is_some() && chain.backend == r_chain.backend,
        "backend leg {:?}, the reference paired {:?}",
        chain.backend,
        r_chain.backend
    );
    ensure!(
        chain.client_leg.is_some() && chain.client_leg == r_chain.client_leg,
        "client leg {:?}, the reference paired {:?}",
        chain.client_leg,
        r_chain.client_leg
    );
    ensure!(
        chain.transparency == "transparent",
        "transparency {:?} ({:?})",
        chain.transparency,
        chain.transparency_detail
    );
    ensure!(
        chain.placeable_stages == r_chain.placeable_stages && chain.placeable_stages.len() == 8,
        "placeable stages {:?}, the reference's {:?}",
        chain.placeable_stages,
        r_chain.placeable_stages
    );
    ensure!(chain.samples_placed > 0, "no sample placed");
    // Stages placed after the lock: sample lines of the display socket with every stage.
    let full = joined
        .samples
        .iter()
        .filter(|l| l.socket == d.socket && l.stages.len() == 8)
        .count();
    ensure!(
        full > 0,
        "no sample line of {} with all 8 stages placed",
        d.socket
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Session tests

/// Options of rig/client.py that make the quiet channels talk mid-session: mouse motion and
/// key presses (inputs) and mouse-mode requests (main).
const CHATTY: &[&str] = &["--inputs-every-ms", "50"];

fn joined_session(
    test: &str,
    port: u16,
    display: u32,
    anim: &[&str],
    relay_port: Option<u16>,
    lock_limit_s: f64,
) -> Result<()> {
    let mut rig = Rig::new(test)?;
    let xorg = rig.xspice(port, display, anim)?;
    let relay = match relay_port {
        Some(rp) => Some(rig.relay("socat", "127.0.0.1", rp, "127.0.0.1", port)?),
        None => None,
    };
    let mut pids = vec![xorg];
    pids.extend(relay);
    let ref_files = Files::new(&rig.state, "reference");
    let joined_files = Files::new(&rig.state, "joined");
    // Reference: from before the client connects to after the joined run ends.
    let Some(reference) = observe(test, &pids, 26.0, &ref_files)? else {
        return Ok(());
    };
    let uri = format!("spice://127.0.0.1:{}", relay_port.unwrap_or(port));
    // The client stops reading at 12 s for 4 s: spice-server stalls at its window.
    let mut args = vec!["--pause-at", "12", "--pause-for", "4"];
    args.extend_from_slice(CHATTY);
    let _client = Client::start(&uri, 40, &args, None)?;
    thread::sleep(Duration::from_secs(5));
    let Some(joined) = observe(test, &pids, 15.0, &joined_files)? else {
        return Ok(());
    };
    let joined = finish("joined", joined, &joined_files)?;
    let reference = finish("reference", reference, &ref_files)?;
    check_session(test, &joined, &reference, xorg, relay, lock_limit_s)
}

/// Rects: 20 small fills a frame at 50 frames/s, about 1000 display messages/s; the cursor
/// changes and moves 5 times a second (cursor channel traffic).
const RECTS: &[&str] = &[
    "--mode",
    "rects",
    "--fps",
    "50",
    "--count",
    "20",
    "--cursor-every",
    "10",
];
/// Noise: one 256×192 PutImage of random pixels a frame at 20 frames/s (big DRAW_COPYs); the
/// cursor as for [`RECTS`].
const NOISE: &[&str] = &[
    "--mode",
    "noise",
    "--fps",
    "20",
    "--size",
    "256x192",
    "--cursor-every",
    "4",
];

#[test]
fn joined_rects_session_locks_within_2s() -> Result<()> {
    const T: &str = "joined_rects_session_locks_within_2s";
    if !privileged(T) {
        return Ok(());
    }
    joined_session(T, 5931, 31, RECTS, None, 2.0)
}

#[test]
fn joined_noise_session_locks_within_10s() -> Result<()> {
    const T: &str = "joined_noise_session_locks_within_10s";
    if !privileged(T) {
        return Ok(());
    }
    joined_session(T, 5932, 32, NOISE, None, 10.0)
}

#[test]
fn joined_rects_session_through_socat() -> Result<()> {
    const T: &str = "joined_rects_session_through_socat";
    if !privileged(T) {
        return Ok(());
    }
    joined_session(T, 5933, 33, RECTS, Some(6933), 2.0)
}

#[test]
fn joined_noise_session_through_socat() -> Result<()> {
    const T: &str = "joined_noise_session_through_socat";
    if !privileged(T) {
        return Ok(());
    }
    joined_session(T, 5934, 34, NOISE, Some(6934), 10.0)
}

// ---------------------------------------------------------------------------------------------
// No false lock

/// A background process of a test, ended ([`terminate`]) when dropped.
struct Proc {
    child: Child,
    what: &'static str,
}

impl Proc {
    fn spawn(what: &'static str, cmd: &mut Command) -> Result<Self> {
        let child = cmd
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {what}: {cmd:?}"))?;
        Ok(Self { child, what })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails if it has exited already (a generator that died carries no traffic).
    fn alive(&mut self) -> Result<()> {
        match self.child.try_wait()? {
            None => Ok(()),
            Some(s) => bail!("{} exited early ({s})", self.what),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

/// Waits until something listens on 127.0.0.1:`port` (5 s at most).
fn wait_listening(port: u16) -> Result<()> {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(50));
    }
    bail!("nothing listens on 127.0.0.1:{port} after 5 s")
}

/// Writes `bytes` of the binaries of /usr/bin (regular files, concatenated in name order,
/// cycling) to `path`: real executable content, with its runs of small integers and zeros.
fn binary_file(path: &Path, bytes: u64) -> Result<()> {
    let mut bins: Vec<PathBuf> = std::fs::read_dir("/usr/bin")?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_file() && !p.is_symlink())
        .collect();
    bins.sort();
    ensure!(!bins.is_empty(), "no file in /usr/bin");
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut left = bytes;
    'fill: loop {
        for b in &bins {
            let Ok(data) = std::fs::read(b) else {
                continue;
            };
            let k = (data.len() as u64).min(left) as usize;
            out.write_all(&data[..k])?;
            left -= k as u64;
            if left == 0 {
                break 'fill;
            }
        }
    }
    out.flush()?;
    Ok(())
}

/// A paced TCP sink on 127.0.0.1:`port`: accepts one connection and reads at most `rate`
/// bytes/s (so that the sender's stream lasts); prints `listening` once bound, and the bytes
/// read when its peer closes or on SIGTERM.
const PACED_SINK: &str = r#"
import signal, socket, sys, time
port, rate = int(sys.argv[1]), float(sys.argv[2])
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", port)); ls.listen(1)
print("listening", flush=True)
c, _ = ls.accept()
n = 0
def done(*_):
    print(n, flush=True); sys.exit(0)
signal.signal(signal.SIGTERM, done)
t0 = time.monotonic()
while True:
    ahead = n / rate - (time.monotonic() - t0)
    if ahead > 0:
        time.sleep(ahead)
    b = c.recv(65536)
    if not b:
        done()
    n += len(b)
"#;

/// No false lock: a mid-stream join on non-SPICE TCP traffic never locks as SPICE.
///
/// Three generators, each already connected when `observe` starts, over 1 GB (the observer's
/// own byte figures) during the 12 s observation: iperf3 (500 Mbit/s), an HTTP download of /usr/bin binaries
/// (`python3 -m http.server`, `curl --limit-rate 30M`) and /dev/urandom through socat into a
/// paced sink (25 MB/s). Every socket of those processes must stay unframed (no LOCK record,
/// no message, the kernel's `locks` counter 0) while the kernel did hunt on them
/// (`hunt_candidates` > 0). The figures are printed.
#[test]
fn no_false_lock_on_non_spice_traffic() -> Result<()> {
    const T: &str = "no_false_lock_on_non_spice_traffic";
    if !privileged(T) {
        return Ok(());
    }
    let rig = Rig::new(T)?;
    let (iperf_port, http_port, sink_port) = (15941u16, 15942u16, 15943u16);
    let secs = 12.0;
    // iperf3: 500 Mbit/s for longer than the observation.
    let mut iperf_s = Proc::spawn(
        "iperf3 -s",
        Command::new("iperf3")
            .args(["-s", "-B", "127.0.0.1", "-p", &iperf_port.to_string()])
            .stdout(Stdio::null()),
    )?;
    wait_listening(iperf_port)?;
    let mut iperf_c = Proc::spawn(
        "iperf3 -c",
        Command::new("iperf3")
            .args(["-c", "127.0.0.1", "-p", &iperf_port.to_string()])
            .args(["-t", "30", "-b", "500M", "--json"])
            .stdout(Stdio::piped()),
    )?;
    // HTTP: 600 MB of binaries, fetched at 30 MB/s.
    let file = rig.state.join("bin.dat");
    binary_file(&file, 600 << 20)?;
    let mut http = Proc::spawn(
        "python3 -m http.server",
        Command::new("/usr/bin/python3")
            .args([
                "-m",
                "http.server",
                "--bind",
                "127.0.0.1",
                &http_port.to_string(),
            ])
            .arg("--directory")
            .arg(&rig.state)
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )?;
    wait_listening(http_port)?;
    let mut curl = Proc::spawn(
        "curl",
        Command::new("curl")
            .args([
                "-s",
                "--limit-rate",
                "30M",
                "-o",
                "/dev/null",
                "-w",
                "%{size_download}",
            ])
            .arg(format!("http://127.0.0.1:{http_port}/bin.dat"))
            .stdout(Stdio::piped()),
    )?;
    // /dev/urandom through socat into the paced sink (it prints `listening` once bound).
    let mut sink = Proc::spawn(
        "paced sink",
        Command::new("/usr/bin/python3")
            .args(["-c", PACED_SINK, &sink_port.to_string(), "25e6"])
            .stdout(Stdio::piped()),
    )?;
    {
        let mut line = String::new();
        let out = sink.child.stdout.as_mut().unwrap();
        let mut b = [0u8; 1];
        while !line.ends_with('\n') && out.read(&mut b)? == 1 {
            line.push(b[0] as char);
        }
        ensure!(line.trim() == "listening", "paced sink: {line:?}");
    }
    let mut socat = Proc::spawn(
        "socat",
        Command::new("socat")
            .args(["-u", "OPEN:/dev/urandom"])
            .arg(format!("TCP:127.0.0.1:{sink_port}"))
            .stdout(Stdio::null()),
    )?;
    // Everything connected and streaming before the observer starts.
    thread::sleep(Duration::from_millis(1500));
    for p in [
        &mut iperf_s,
        &mut iperf_c,
        &mut http,
        &mut curl,
        &mut sink,
        &mut socat,
    ] {
        p.alive()?;
    }
    let pids = [
        iperf_s.pid(),
        iperf_c.pid(),
        http.pid(),
        curl.pid(),
        sink.pid(),
        socat.pid(),
    ];
    let files = Files::new(&rig.state, "observe");
    let t0 = Instant::now();
    let Some(obs) = observe(T, &pids, secs, &files)? else {
        return Ok(());
    };
    let run = finish("observe", obs, &files)?;
    let observed = t0.elapsed().as_secs_f64();
    // The generators' own byte counts (from their start: an upper bound of what the observer
    // could see, printed for the note).
    let iperf_json = {
        terminate(&mut iperf_c.child);
        let mut s = String::new();
        iperf_c
            .child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut s)?;
        s
    };
    let iperf_bytes = serde_json::from_str::<Value>(&iperf_json)
        .ok()
        .and_then(|v| v["end"]["sum_sent"]["bytes"].as_u64());
    let read_line = |p: &mut Proc| -> Option<u64> {
        terminate(&mut p.child);
        let mut s = String::new();
        p.child.stdout.take()?.read_to_string(&mut s).ok()?;
        s.trim().parse().ok()
    };
    // curl ends by itself (--max-time) and then prints its byte count.
    let curl_bytes = {
        let t = Instant::now();
        while curl.child.try_wait()?.is_none() && t.elapsed() < Duration::from_secs(8) {
            thread::sleep(Duration::from_millis(100));
        }
        read_line(&mut curl)
    };
    let sink_bytes = read_line(&mut sink);
    println!(
        "{T}: generators (from their start, ~{:.1} s before the observer): iperf3 {:?} B, \
         HTTP {:?} B, urandom/socat {:?} B; observed {observed:.1} s",
        1.5, iperf_bytes, curl_bytes, sink_bytes
    );
    let k = &run.report.kernel_counters;
    let counter = |name: &str| -> Result<u64> {
        k.get(name)
            .copied()
            .ok_or_else(|| anyhow!("kernel_counters lack {name}: {k:?}"))
    };
    let candidates = counter("hunt_candidates")?;
    let locks = counter("locks")?;
    let resyncs = counter("resyncs")?;
    // Bytes the watched processes moved on those sockets while observed (every byte of a
    // stream is written by one watched process and read by another: hunted at both ends).
    let (mut written, mut read) = (0u64, 0u64);
    for c in &run.report.channels {
        // Null for a socket that moved nothing while observed (iperf3's control connection);
        // counted as 0, which only makes the 1 GB below harder to reach.
        let t = &c.traffic;
        let (w, r) = (
            t.bytes_written_total.unwrap_or(0),
            t.bytes_read_total.unwrap_or(0),
        );
        written += w;
        read += r;
        println!(
            "{T}:   {} pid {} ({}) framing {} messages {}/{} written {w} read {r} sync_sent {:?}",
            c.socket,
            c.pid,
            c.comm,
            c.framing,
            c.messages_sent,
            c.messages_received,
            c.sync_sent
                .as_ref()
                .map(|y| (y.hunting, y.locks, &y.reason))
        );
    }
    println!(
        "{T}: FIGURES: sockets {}, stream bytes while observed {written} written / {read} read \
         (hunted at both ends: {} bytes), hunt_candidates {candidates}, locks {locks}, resyncs \
         {resyncs}",
        run.report.channels.len(),
        written + read
    );
    let lock_recs = run.recs.iter().filter(|r| r.kind == "Lock").count();
    let msg_recs = run.recs.iter().filter(|r| r.kind == "Message").count();
    ensure!(
        run.report.channels.len() >= 6,
        "expected the generators' sockets (iperf3 control + data, HTTP, socat): {}",
        run.report.channels.len()
    );
    ensure!(
        lock_recs == 0 && msg_recs == 0,
        "false lock: {lock_recs} LOCK and {msg_recs} message records"
    );
    ensure!(locks == 0, "the kernel counted {locks} locks");
    for c in &run.report.channels {
        for (what, y) in [("sent", &c.sync_sent), ("received", &c.sync_received)] {
            let y = y
                .as_ref()
                .ok_or_else(|| anyhow!("no sync_{what} of a joined socket: {}", describe_ch(c)))?;
            ensure!(
                y.hunting && y.locks == 0 && y.locked_at_s.is_none(),
                "sync_{what} {y:?}: {}",
                describe_ch(c)
            );
        }
        ensure!(
            c.messages_sent == 0 && c.messages_received == 0,
            "messages counted on non-SPICE traffic: {}",
            describe_ch(c)
        );
        ensure!(
            c.framing != "mini" && c.framing != "full",
            "framed as SPICE: {}",
            describe_ch(c)
        );
    }
    ensure!(
        candidates > 0,
        "hunt_candidates 0: the kernel did not hunt on the joined streams at all"
    );
    ensure!(
        written >= 1_000_000_000,
        "the generators moved {written} bytes while observed, less than 1 GB"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Resync

/// Junk mid-stream through the scripted peer: the observer hunts at the junk, re-locks on a
/// true message boundary, counts the resync, and every figure agrees with what the peer
/// wrote.
///
/// The server streams SET_ACK and 600 DRAW_COPYs of 200 bytes (mini headers: 206 bytes each,
/// one message per write, 2 ms apart) and writes 333 bytes of junk after the first 301
/// messages; its client skips them (`--skip-at 301 --skip-bytes 333`). Both processes are
/// watched from before the connection. For the server's sending direction and the client's
/// receiving direction: one HUNT record (reason bad_header) at exactly the junk's stream
/// offset (the peer's link bytes + SET_ACK + 300 × 206); one LOCK whose first counted message
/// starts on one of the peer's message boundaries after the junk: `skipped` = 333 + lost ×
/// 206 with `lost` = the peer's messages − the observer's (0 ≤ lost ≤ the lock run); the
/// observer's DRAW_COPY count = 600 − lost; the kernel's `resyncs` counter 2.
#[test]
fn junk_mid_stream_resyncs_and_relocks() -> Result<()> {
    const T: &str = "junk_mid_stream_resyncs_and_relocks";
    if !privileged(T) {
        return Ok(());
    }
    let rig = Rig::new(T)?;
    let (n_draws, body, junk_after, junk) = (600u64, 200u64, 301u64, 333u64);
    let mut server = common::peer::Server::start(&[
        "--set-ack",
        "--window",
        "20",
        "--messages",
        &n_draws.to_string(),
        "--body-size",
        &body.to_string(),
        "--interval-ms",
        "2",
        "--garbage-at",
        &junk_after.to_string(),
        "--garbage-bytes",
        &junk.to_string(),
        "--seed",
        "9",
    ])?;
    let mut client = common::peer::Client::gated(
        server.port,
        &[
            "--skip-at",
            &junk_after.to_string(),
            "--skip-bytes",
            &junk.to_string(),
        ],
    )?;
    let files = Files::new(&rig.state, "observe");
    let Some(obs) = observe(T, &[server.pid(), client.pid()], 6.0, &files)? else {
        return Ok(());
    };
    client.go()?;
    let s = server.summary("server")?;
    let c = client.summary("client")?;
    let run = finish("observe", obs, &files)?;
    ensure!(
        s.sent.messages == n_draws + 1 && c.received.messages == n_draws + 1,
        "the peer did not stream its script: sent {}, received {}",
        s.sent.messages,
        c.received.messages
    );
    ensure!(
        s.sent.junk_bytes == junk && c.received.junk_bytes == junk,
        "junk written {}, skipped {}",
        s.sent.junk_bytes,
        c.received.junk_bytes
    );
    let hdr = 6u64;
    let junk_at = s.sent.link_bytes + (hdr + 8) + (junk_after - 1) * (hdr + body);
    let k = &run.report.kernel_counters;
    println!("{T}: kernel counters {k:?}");
    let mut checked = 0;
    for ch in &run.report.channels {
        // The direction carrying the stream: the server's send, the client's receive.
        let dir = if ch.pid == server.pid() {
            0u8
        } else if ch.pid == client.pid() {
            1u8
        } else {
            continue;
        };
        let d = describe_ch(ch);
        let hunts = of_kind(&run.recs, "Hunt", ch.cookie, dir);
        let locks = of_kind(&run.recs, "Lock", ch.cookie, dir);
        let msgs = messages(&run.recs, ch.cookie, dir)?;
        println!(
            "{T}: {} dir {dir}: hunts {:?}\n    locks {:?}\n    messages {}",
            ch.socket,
            hunts.iter().map(|h| &h.f).collect::<Vec<_>>(),
            locks.iter().map(|l| &l.f).collect::<Vec<_>>(),
            msgs.len()
        );
        ensure!(
            hunts.len() == 1,
            "one HUNT record expected, {}: {d}",
            hunts.len()
        );
        let h = hunts[0];
        ensure!(
            h.get("reason")? == spice_ebpf_common::framing::UnparsedReason::BadHeader as u64,
            "hunt reason {:?}: {d}",
            h.get("reason")?
        );
        ensure!(
            h.get("at")? == junk_at,
            "hunt at offset {}, the junk starts at {junk_at}: {d}",
            h.get("at")?
        );
        ensure!(
            locks.len() == 1,
            "one LOCK record expected, {}: {d}",
            locks.len()
        );
        let l = locks[0];
        let observed = if dir == 0 {
            ch.messages_sent
        } else {
            ch.messages_received
        };
        let lost = (n_draws + 1)
            .checked_sub(observed)
            .ok_or_else(|| anyhow!("observer counted {observed}, more than the peer: {d}"))?;
        let skipped = l.get("skipped")?;
        println!(
            "{T}: FIGURES {} dir {dir}: junk at {junk_at}, lock at {} ({}), skipped {skipped} = \
             {junk} junk + {lost} messages × {}, counted {observed} of {}",
            ch.socket,
            l.get("at")?,
            lock_how::name(l.get("how")? as u8),
            hdr + body,
            n_draws + 1
        );
        ensure!(
            lost <= u64::from(spice_ebpf_common::framing::LOCK_RUN_CONTENT),
            "{lost} messages lost, more than a lock run: {d}"
        );
        ensure!(
            skipped == junk + lost * (hdr + body),
            "skipped {skipped}, the peer wrote {junk} junk bytes and {lost} unframed messages of \
             {} bytes: {d}",
            hdr + body
        );
        ensure!(
            l.get("at")? == junk_at + skipped,
            "lock at {}, expected {}: {d}",
            l.get("at")?,
            junk_at + skipped
        );
        // After the lock: the peer's messages after the junk minus those not framed.
        let after = msgs.iter().filter(|m| m.at >= junk_at).count() as u64;
        ensure!(
            after == (n_draws + 1 - junk_after) - lost,
            "{after} messages counted after the junk, the peer wrote {} and {lost} were not framed",
            n_draws + 1 - junk_after
        );
        let sync = if dir == 0 {
            &ch.sync_sent
        } else {
            &ch.sync_received
        };
        let y = sync
            .as_ref()
            .ok_or_else(|| anyhow!("no sync report of the resynced direction: {d}"))?;
        println!("{T}: sync report {y:?}");
        ensure!(
            !y.hunting && y.reason == "bad_header" && y.resyncs == 1 && y.locks == 1,
            "sync report {y:?} (expected: locked again after one bad_header resync): {d}"
        );
        ensure!(
            y.unframed_bytes == skipped,
            "sync report unframed_bytes {}, the LOCK record skipped {skipped}: {d}",
            y.unframed_bytes
        );
        ensure!(
            y.first_index == Some(junk_after + 1),
            "first index after the re-lock {:?}, expected {} (ordinals continue): {d}",
            y.first_index,
            junk_after + 1
        );
        let by_type = if dir == 0 {
            &ch.messages_sent_by_type
        } else {
            &ch.messages_received_by_type
        };
        ensure!(
            by_type.get("304").copied() == Some(n_draws - lost),
            "DRAW_COPY count {:?}, expected {}: {d}",
            by_type.get("304"),
            n_draws - lost
        );
        checked += 1;
    }
    ensure!(
        checked == 2,
        "expected the server's and the client's socket, checked {checked}"
    );
    let resyncs = k
        .get("resyncs")
        .copied()
        .ok_or_else(|| anyhow!("kernel_counters lack resyncs"))?;
    ensure!(
        resyncs == 2,
        "kernel resyncs {resyncs}, expected 2 (one per socket)"
    );
    Ok(())
}
