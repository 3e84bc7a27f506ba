//! An oracle for the observer's stage split, built from packet captures only.
//!
//! It shares nothing with the observer's framing or placement code: dumpcap records the server
//! leg (spice-server ↔ relay) and the client leg (relay ↔ client), tshark turns each capture
//! into TCP segments with raw sequence numbers, this module reassembles every direction by
//! sequence number and parses SPICE framing itself (the link phase of docs/spice-protocol.md
//! §1.2–§1.5 and §1.8, then 6-byte mini headers or 18-byte full headers, §1.9). For every
//! message spice-server sent it then knows, on each leg, when its last byte first appeared on
//! the wire and when the peer's TCP cumulatively acknowledged it; at a sample's time that puts
//! the message in one of five positions, which [`Agreement`] compares with the stages the
//! observer wrote to `observe --samples`.
//!
//! Time base: capture timestamps are CLOCK_REALTIME (dumpcap's kernel timestamps); a sample's
//! `t_s` is CLOCK_MONOTONIC seconds since the observation's start, mapped to realtime with the
//! report's `clock` pair (`realtime_ns + t_s·1e9`).
//!
//! Capture points: on loopback each packet is seen once when it is transmitted. On `rigr0` (the
//! relay's end of the shaped link) a packet toward the client is seen when it leaves the HTB
//! qdisc, so bytes the relay's TCP has sent but that still wait in that queue would look "not
//! yet on the wire" (measured: up to ~250 kB, 6–7 draws of 55 kB, during slow start at
//! 8 Mbit/s). The oracle therefore takes a byte's send time from the TCP timestamp (TSval)
//! of the segment that first carried it, which the sender's TCP set when it sent the segment,
//! before any qdisc ([`Wire::TcpSent`], [`Direction::sent_at`]). That is the moment the
//! sender's `snd_nxt` passed the byte. The capture time is kept as [`Wire::Captured`], for
//! information.
//!
//! The taps that would capture before the qdisc (tc `mirred` to a dummy device) are not in
//! this kernel.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde::Deserialize;
use serde_json::Value;

use super::{rig, sh};

// ---------------------------------------------------------------------------------------------
// Capture

/// A running dumpcap (rig/capture.sh) writing `path`; stopped when dropped.
pub struct Capture {
    pub path: PathBuf,
    running: bool,
}

/// dumpcap's own account of a finished capture (its `Packets received/dropped` line).
#[derive(Clone, Debug)]
pub struct CaptureStats {
    pub received: u64,
    /// Sum of every drop counter dumpcap reports (pcap, dumpcap, flushed, ps_ifdrop).
    pub dropped: u64,
    pub line: String,
}

impl Capture {
    /// Starts capturing TCP `ports` on `iface` (in network namespace `netns` if given) into
    /// `path`; returns once dumpcap keeps packets. Buffer 256 MiB, snaplen 0 (rig/capture.sh).
    pub fn start(path: PathBuf, netns: Option<&str>, iface: &str, ports: &[u16]) -> Result<Self> {
        let mut cmd = Command::new(rig().join("capture.sh"));
        cmd.arg("start").arg(&path);
        if let Some(ns) = netns {
            cmd.args(["-n", ns]);
        }
        cmd.args(["-i", iface]);
        cmd.args(ports.iter().map(|p| p.to_string()));
        let out = sh(&mut cmd)?;
        eprintln!("oracle: {}", out.trim());
        Ok(Self {
            path,
            running: true,
        })
    }

    /// Stops dumpcap and fails if it dropped any packet: one lost segment leaves a hole in a
    /// TCP stream, and the SPICE framing after it cannot be parsed.
    pub fn stop(&mut self) -> Result<CaptureStats> {
        self.running = false;
        sh(Command::new(rig().join("capture.sh"))
            .arg("stop")
            .arg(&self.path))?;
        let log_path = PathBuf::from(format!("{}.log", self.path.display()));
        let log = std::fs::read_to_string(&log_path)
            .with_context(|| format!("reading {}", log_path.display()))?;
        let stats = parse_dumpcap_log(&log)
            .with_context(|| format!("dumpcap log {}:\n{log}", log_path.display()))?;
        eprintln!("oracle: {}: {}", self.path.display(), stats.line);
        ensure!(
            stats.dropped == 0,
            "capture {} dropped packets: {}",
            self.path.display(),
            stats.line
        );
        Ok(stats)
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if self.running {
            let _ = Command::new(rig().join("capture.sh"))
                .arg("stop")
                .arg(&self.path)
                .output();
        }
    }
}

/// Reads `Packets received/dropped on interface 'lo': 399/0 (pcap:0/dumpcap:0/flushed:0/ps_ifdrop:0)`.
fn parse_dumpcap_log(log: &str) -> Result<CaptureStats> {
    let line = log
        .lines()
        .find(|l| l.starts_with("Packets received/dropped"))
        .ok_or_else(|| {
            anyhow!("no 'Packets received/dropped' line (dumpcap not stopped cleanly?)")
        })?;
    let after = line
        .rsplit_once("': ")
        .map(|(_, a)| a)
        .ok_or_else(|| anyhow!("unexpected line {line:?}"))?;
    let (counts, rest) = after.split_once(' ').unwrap_or((after, ""));
    let (rx, drop) = counts
        .split_once('/')
        .ok_or_else(|| anyhow!("unexpected counts in {line:?}"))?;
    let mut dropped: u64 = drop.parse().with_context(|| format!("{line:?}"))?;
    // "(pcap:0/dumpcap:0/flushed:0/ps_ifdrop:0)"
    let inner = rest.split(')').next().unwrap_or("").trim_start_matches('(');
    for part in inner.split('/') {
        if let Some((_, n)) = part.split_once(':') {
            dropped += n.parse::<u64>().with_context(|| format!("{line:?}"))?;
        }
    }
    Ok(CaptureStats {
        received: rx.parse().with_context(|| format!("{line:?}"))?,
        dropped,
        line: line.to_string(),
    })
}

// ---------------------------------------------------------------------------------------------
// TCP segments and reassembly

/// One TCP segment as tshark decodes it.
#[derive(Clone, Debug)]
struct Segment {
    /// CLOCK_REALTIME, seconds.
    t: f64,
    stream: u32,
    src: String,
    dst: String,
    seq: u32,
    ack: u32,
    syn: bool,
    has_ack: bool,
    /// TCP timestamp option's TSval (RFC 7323): the sender's clock when its TCP built the
    /// segment, before any qdisc.
    tsval: Option<u32>,
    payload: Vec<u8>,
}

fn unhex(s: &str) -> Result<Vec<u8>> {
    ensure!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| anyhow!("hex: {e}")))
        .collect()
}

/// Every TCP segment of `cap`, in capture order. tshark's own SPICE dissector and TCP
/// reassembly are off: only the TCP header fields and the raw payload are used.
fn read_segments(cap: &Path) -> Result<Vec<Segment>> {
    let out = Command::new("tshark")
        .arg("-r")
        .arg(cap)
        .args([
            "-n",
            "-o",
            "tcp.desegment_tcp_streams:FALSE",
            "-o",
            "tcp.analyze_sequence_numbers:FALSE",
            "--disable-protocol",
            "spice",
            "-Y",
            "tcp",
            "-T",
            "fields",
            "-E",
            "separator=/t",
        ])
        .args(
            [
                "frame.time_epoch",
                "tcp.stream",
                "ip.src",
                "tcp.srcport",
                "ip.dst",
                "tcp.dstport",
                "tcp.seq_raw",
                "tcp.ack_raw",
                "tcp.flags",
                "tcp.len",
                "tcp.options.timestamp.tsval",
                "tcp.payload",
            ]
            .iter()
            .flat_map(|f| ["-e", f]),
        )
        .output()
        .context("running tshark")?;
    ensure!(
        out.status.success(),
        "tshark -r {} failed: {}",
        cap.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).context("tshark output")?;
    let mut segs = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let f: Vec<&str> = line.split('\t').collect();
        ensure!(
            f.len() == 12,
            "{} line {}: {} fields: {line:?}",
            cap.display(),
            n + 1,
            f.len()
        );
        let flags = u16::from_str_radix(f[8].trim_start_matches("0x"), 16)
            .with_context(|| format!("flags {:?}", f[8]))?;
        let len: usize = f[9]
            .parse()
            .with_context(|| format!("tcp.len {:?}", f[9]))?;
        let payload = unhex(f[11])?;
        ensure!(
            payload.len() == len,
            "{} line {}: tcp.len {len} but {} payload bytes (snaplen?)",
            cap.display(),
            n + 1,
            payload.len()
        );
        segs.push(Segment {
            t: f[0].parse().with_context(|| format!("time {:?}", f[0]))?,
            stream: f[1].parse()?,
            src: format!("{}:{}", f[2], f[3]),
            dst: format!("{}:{}", f[4], f[5]),
            seq: f[6].parse()?,
            ack: f[7].parse()?,
            syn: flags & 0x02 != 0,
            has_ack: flags & 0x10 != 0,
            tsval: if f[10].is_empty() {
                None
            } else {
                Some(
                    f[10]
                        .parse()
                        .with_context(|| format!("tsval {:?}", f[10]))?,
                )
            },
            payload,
        });
    }
    Ok(segs)
}

/// One direction of a TCP connection, reassembled by sequence number. Offsets count from the
/// first data byte (ISN + 1).
#[derive(Clone, Debug, Default)]
pub struct Direction {
    pub src: String,
    pub dst: String,
    /// Initial sequence number (the SYN's).
    pub isn: u32,
    pub bytes: Vec<u8>,
    /// (start, end, t): bytes [start, end) first appeared in a segment captured at t; sorted,
    /// disjoint, covering [0, bytes.len()).
    first_seen: Vec<(u64, u64, f64)>,
    /// The same pieces with the time the sender's TCP sent them (from TSval, see
    /// [`Direction::sent_at`]); empty without TCP timestamps.
    first_sent: Vec<(u64, u64, f64)>,
    /// Bytes captured more than once (retransmissions, duplicates).
    pub resent_bytes: u64,
    /// (t, acked): the peer's cumulative ACK reached offset `acked` (exclusive) at t; both
    /// non-decreasing.
    acked: Vec<(f64, u64)>,
}

impl Direction {
    /// Offset of raw sequence number `seq` (wrapping).
    pub fn offset(&self, seq: u32) -> u64 {
        u64::from(seq.wrapping_sub(self.isn.wrapping_add(1)))
    }

    /// Raw sequence number of offset `off`.
    pub fn seq(&self, off: u64) -> u32 {
        self.isn.wrapping_add(1).wrapping_add(off as u32)
    }

    /// When byte `off` first appeared on the wire; None if never in the capture.
    pub fn first_seen(&self, off: u64) -> Option<f64> {
        let i = self.first_seen.partition_point(|&(_, end, _)| end <= off);
        self.first_seen
            .get(i)
            .filter(|&&(s, e, _)| s <= off && off < e)
            .map(|&(_, _, t)| t)
    }

    /// When the sender's TCP first sent byte `off` (handed it to IP, before any qdisc), from
    /// the TSval of the first segment that carried it: TSval counts milliseconds on the
    /// sender's clock plus a per-connection offset (Linux: `tcp_clock` ms + `tsoffset`), so
    /// send time = TSval / 1000 + c with c = min over the direction's segments of (capture
    /// time − TSval / 1000), the segments that met no queue. Error about 1 ms, never later
    /// than the capture. None if never in the capture.
    pub fn sent_at(&self, off: u64) -> Option<f64> {
        let i = self.first_sent.partition_point(|&(_, end, _)| end <= off);
        self.first_sent
            .get(i)
            .filter(|&&(s, e, _)| s <= off && off < e)
            .map(|&(_, _, t)| t)
    }

    /// When the peer's TCP first acknowledged byte `off` cumulatively; None if never.
    pub fn acked_at(&self, off: u64) -> Option<f64> {
        let i = self.acked.partition_point(|&(_, a)| a <= off);
        self.acked.get(i).map(|&(t, _)| t)
    }

    /// Bytes acknowledged by the peer at time `t`.
    pub fn acked_by(&self, t: f64) -> u64 {
        let i = self.acked.partition_point(|&(tt, _)| tt <= t);
        if i == 0 { 0 } else { self.acked[i - 1].1 }
    }
}

/// A TCP connection: the direction of the SYN's sender (`c2s`) and the other one.
#[derive(Clone, Debug)]
pub struct Connection {
    pub stream: u32,
    pub c2s: Direction,
    pub s2c: Direction,
}

fn reassemble(cap: &Path, segs: &[Segment]) -> Result<Vec<Connection>> {
    let mut by_stream: BTreeMap<u32, Vec<&Segment>> = BTreeMap::new();
    for s in segs {
        by_stream.entry(s.stream).or_default().push(s);
    }
    let mut conns = Vec::new();
    for (stream, segs) in by_stream {
        let syn = segs.iter().find(|s| s.syn && !s.has_ack).ok_or_else(|| {
            anyhow!(
                "{} stream {stream}: no SYN (capture started after the connection?)",
                cap.display()
            )
        })?;
        let synack = segs
            .iter()
            .find(|s| s.syn && s.has_ack && s.src == syn.dst)
            .ok_or_else(|| anyhow!("{} stream {stream}: no SYN-ACK", cap.display()))?;
        let mut dirs = [
            Direction {
                src: syn.src.clone(),
                dst: syn.dst.clone(),
                isn: syn.seq,
                ..Default::default()
            },
            Direction {
                src: synack.src.clone(),
                dst: synack.dst.clone(),
                isn: synack.seq,
                ..Default::default()
            },
        ];
        // Covered intervals per direction (disjoint, sorted), for first-seen bookkeeping.
        let mut covered: [Vec<(u64, u64)>; 2] = [Vec::new(), Vec::new()];
        // Per direction: (start, end, TSval) of each new piece; TSval of every data segment
        // with its capture time, for the clock offset.
        let mut piece_ts: [Vec<(u64, u64, Option<u32>)>; 2] = [Vec::new(), Vec::new()];
        let mut ts_cal: [Vec<(u32, f64)>; 2] = [Vec::new(), Vec::new()];
        for s in &segs {
            let d = if s.src == dirs[0].src {
                0
            } else if s.src == dirs[1].src {
                1
            } else {
                bail!(
                    "{} stream {stream}: third endpoint {}",
                    cap.display(),
                    s.src
                );
            };
            if s.has_ack && !(s.syn && d == 0) {
                let other = &mut dirs[1 - d];
                let a = other.offset(s.ack);
                // ACK of the SYN is offset 0 (ack = isn + 1); an ACK of a FIN is one past the end.
                if a < 1 << 31 && other.acked.last().is_none_or(|&(_, x)| a > x) {
                    other.acked.push((s.t, a));
                }
            }
            if s.payload.is_empty() {
                continue;
            }
            if let Some(ts) = s.tsval {
                ts_cal[d].push((ts, s.t));
            }
            let dir = &mut dirs[d];
            let start = dir.offset(s.seq);
            ensure!(
                start < 1 << 31,
                "{} stream {stream}: segment at offset {start} (seq {}) before the start",
                cap.display(),
                s.seq
            );
            let end = start + s.payload.len() as u64;
            if dir.bytes.len() < end as usize {
                dir.bytes.resize(end as usize, 0);
            }
            // New pieces of [start, end): the parts not yet covered.
            let cov = &mut covered[d];
            let mut pieces = Vec::new();
            let mut at = start;
            for &(cs, ce) in cov.iter() {
                if ce <= at {
                    continue;
                }
                if cs >= end {
                    break;
                }
                if cs > at {
                    pieces.push((at, cs.min(end)));
                }
                // overlap [max(cs,at), min(ce,end)): must carry the same bytes
                let (os, oe) = (cs.max(at), ce.min(end));
                if os < oe {
                    dir.resent_bytes += oe - os;
                    ensure!(
                        dir.bytes[os as usize..oe as usize]
                            == s.payload[(os - start) as usize..(oe - start) as usize],
                        "{} stream {stream}: a retransmission of [{os}, {oe}) carries other bytes",
                        cap.display()
                    );
                }
                at = at.max(ce);
                if at >= end {
                    break;
                }
            }
            if at < end {
                pieces.push((at, end));
            }
            for &(ps, pe) in &pieces {
                dir.bytes[ps as usize..pe as usize]
                    .copy_from_slice(&s.payload[(ps - start) as usize..(pe - start) as usize]);
                dir.first_seen.push((ps, pe, s.t));
                piece_ts[d].push((ps, pe, s.tsval));
                cov.push((ps, pe));
            }
            cov.sort_unstable();
            let mut merged: Vec<(u64, u64)> = Vec::with_capacity(cov.len());
            for &(a, b) in cov.iter() {
                match merged.last_mut() {
                    Some(m) if a <= m.1 => m.1 = m.1.max(b),
                    _ => merged.push((a, b)),
                }
            }
            *cov = merged;
        }
        for (d, dir) in dirs.iter_mut().enumerate() {
            let cov = &covered[d];
            ensure!(
                cov.is_empty() || (cov.len() == 1 && cov[0].0 == 0),
                "{} stream {stream} {}->{}: the reassembled stream has holes {:?} (lost capture)",
                cap.display(),
                dir.src,
                dir.dst,
                cov.iter().take(5).collect::<Vec<_>>()
            );
            dir.first_seen.sort_by_key(|p| p.0);
            // TSval → send time (see `sent_at`). TSval may wrap: count from the first one.
            if let Some(&(ts0, _)) = ts_cal[d].first() {
                let rel = |ts: u32| f64::from(ts.wrapping_sub(ts0)) / 1000.0;
                let c = ts_cal[d]
                    .iter()
                    .map(|&(ts, t)| t - rel(ts))
                    .fold(f64::INFINITY, f64::min);
                // The clock must run at 1 ms per TSval tick (not µs, not 10 ms): compare over
                // the whole direction (queueing delays of up to ~0.3 s blur short spans).
                let (&(tsa, ta), &(tsb, tb)) =
                    (ts_cal[d].first().unwrap(), ts_cal[d].last().unwrap());
                let (dt, dts) = (tb - ta, rel(tsb) - rel(tsa));
                ensure!(
                    dt < 2.0 || (0.8..1.25).contains(&(dts / dt)),
                    "{} stream {stream} {}->{}: TSval advanced {dts:.3} s over {dt:.3} s of capture: \
                     not a millisecond clock",
                    cap.display(),
                    dir.src,
                    dir.dst
                );
                let mut sent = Vec::new();
                for &(ps, pe, ts) in &piece_ts[d] {
                    let ts = ts.with_context(|| {
                        format!(
                            "{} stream {stream}: a data segment without TSval",
                            cap.display()
                        )
                    })?;
                    sent.push((ps, pe, rel(ts) + c));
                }
                sent.sort_by_key(|p| p.0);
                dir.first_sent = sent;
            }
        }
        let [c2s, s2c] = dirs;
        conns.push(Connection { stream, c2s, s2c });
    }
    Ok(conns)
}

// ---------------------------------------------------------------------------------------------
// SPICE framing (docs/spice-protocol.md §1)

/// One server→client data message.
#[derive(Clone, Debug)]
pub struct Message {
    pub ty: u16,
    pub size: u32,
    /// Offset of its header's first byte and of its last byte.
    pub start: u64,
    pub last: u64,
}

/// A SPICE channel's connection as seen in one capture.
#[derive(Clone, Debug)]
pub struct SpiceConn {
    pub conn: Connection,
    /// The client's whole link message (16-byte header + body).
    pub link_message: Vec<u8>,
    /// Byte 20 of the link message: 1 main, 2 display, 3 inputs, 4 cursor (§2.1).
    pub channel_type: u8,
    pub channel_id: u8,
    pub mini_header: bool,
    /// Server→client data messages in order; the last may be only partly captured.
    pub messages: Vec<Message>,
    /// Server→client bytes after the last complete message (0 when the capture ends on a
    /// message boundary).
    pub trailing: u64,
}

fn u32le(b: &[u8], at: usize) -> Result<u32> {
    let s = b
        .get(at..at + 4)
        .ok_or_else(|| anyhow!("stream ends before offset {}", at + 4))?;
    Ok(u32::from_le_bytes(s.try_into().unwrap()))
}

fn parse_spice(conn: Connection) -> Result<SpiceConn> {
    let c = &conn.c2s.bytes;
    let s = &conn.s2c.bytes;
    ensure!(
        c.get(..4) == Some(b"REDQ"),
        "client link message lacks REDQ"
    );
    ensure!(s.get(..4) == Some(b"REDQ"), "server link reply lacks REDQ");
    // Client link message §1.2: size at 12, type at 20, id at 21, caps counts at 22/26,
    // caps_offset at 30 counted from byte 16.
    let h_c = u32le(c, 12)? as usize;
    ensure!((18..=4096).contains(&h_c), "client link size {h_c}");
    let link_message = c
        .get(..16 + h_c)
        .ok_or_else(|| anyhow!("link message incomplete"))?
        .to_vec();
    let c_common = if u32le(c, 22)? > 0 {
        u32le(c, 16 + u32le(c, 30)? as usize)?
    } else {
        0
    };
    // Server link reply §1.3: size at 12, error at 16, caps counts at 182/186, offset at 190.
    let h_s = u32le(s, 12)? as usize;
    ensure!(u32le(s, 16)? == 0, "link reply error {}", u32le(s, 16)?);
    let s_common = if u32le(s, 182)? > 0 {
        u32le(s, 16 + u32le(s, 190)? as usize)?
    } else {
        0
    };
    // Link result §1.5 step 3 (ticket auth), then data from 16 + H_s + 4 (§1.8).
    ensure!(
        u32le(s, 16 + h_s)? == 0,
        "link result {}",
        u32le(s, 16 + h_s)?
    );
    let mini_header = c_common & (1 << 3) != 0 && s_common & (1 << 3) != 0;
    let hdr = if mini_header { 6 } else { 18 };
    let mut pos = (16 + h_s + 4) as u64;
    let mut messages = Vec::new();
    while pos + hdr as u64 <= s.len() as u64 {
        let p = pos as usize;
        // mini: u16 type, u32 size; full: u64 serial, u16 type, u32 size, u32 sub_list.
        let (ty, size) = if mini_header {
            (u16::from_le_bytes([s[p], s[p + 1]]), u32le(s, p + 2)?)
        } else {
            (u16::from_le_bytes([s[p + 8], s[p + 9]]), u32le(s, p + 10)?)
        };
        let end = pos + hdr as u64 + u64::from(size);
        messages.push(Message {
            ty,
            size,
            start: pos,
            last: end - 1,
        });
        pos = end;
    }
    let trailing = (s.len() as u64).saturating_sub(
        messages
            .iter()
            .rev()
            .find(|m| m.last < s.len() as u64)
            .map_or((16 + h_s + 4) as u64, |m| m.last + 1),
    );
    Ok(SpiceConn {
        channel_type: link_message[20],
        channel_id: link_message[21],
        link_message,
        mini_header,
        conn,
        messages,
        trailing,
    })
}

/// Every TCP connection in capture `cap`, reassembled, without parsing its bytes (e.g. a TLS
/// leg, whose SPICE is encrypted).
pub fn parse_tcp(cap: &Path) -> Result<Vec<Connection>> {
    reassemble(cap, &read_segments(cap)?)
}

/// Every SPICE connection in capture `cap` (connections without a complete link phase are
/// listed in the error).
pub fn parse_capture(cap: &Path) -> Result<Vec<SpiceConn>> {
    let segs = read_segments(cap)?;
    let conns = reassemble(cap, &segs)?;
    let mut out = Vec::new();
    for conn in conns {
        if conn.c2s.bytes.is_empty() && conn.s2c.bytes.is_empty() {
            continue; // e.g. a connect that carried nothing
        }
        let stream = conn.stream;
        out.push(
            parse_spice(conn)
                .with_context(|| format!("{} stream {stream}: SPICE link phase", cap.display()))?,
        );
    }
    Ok(out)
}

/// The client's data messages in a captured connection: (type, bytes with the header, stream
/// offset of the header) in order, the last one possibly cut by the capture's end. Link
/// message (16 + H_c), then the auth mechanism word if the client's common caps have
/// PROTOCOL_AUTH_SELECTION (bit 0), then the 128-byte ticket (docs/spice-protocol.md §1.5),
/// then headers of 6 (mini) or 18 bytes (§1.9). An error if the link phase is cut.
pub fn c2s_messages(c: &SpiceConn) -> Result<Vec<(u16, u64, u64)>> {
    let b = &c.conn.c2s.bytes;
    let h_c = u32le(b, 12)? as usize;
    let common = if u32le(b, 22)? > 0 {
        u32le(b, 16 + u32le(b, 30)? as usize)?
    } else {
        0
    };
    let mut pos = 16 + h_c + if common & 1 != 0 { 4 } else { 0 } + 128;
    let hdr = if c.mini_header { 6 } else { 18 };
    let mut out = Vec::new();
    while pos + hdr <= b.len() {
        let (ty, size) = if c.mini_header {
            (u16::from_le_bytes([b[pos], b[pos + 1]]), u32le(b, pos + 2)?)
        } else {
            (
                u16::from_le_bytes([b[pos + 8], b[pos + 9]]),
                u32le(b, pos + 10)?,
            )
        };
        out.push((ty, (hdr + size as usize) as u64, pos as u64));
        pos += hdr + size as usize;
    }
    Ok(out)
}

/// ((server → client messages, bytes), (client → server messages, bytes)) of a captured
/// connection ([`captured_by`]).
pub type Counts = ((u64, u64), (u64, u64));

/// The [`Counts`] of `c` whose header the capture saw by `t` (epoch seconds): the server →
/// client messages captured whole ([`SpiceConn::messages`]) and the client's
/// ([`c2s_messages`]), bytes with the header.
pub fn captured_by(c: &SpiceConn, t: f64) -> Result<Counts> {
    let seen = |d: &Direction, off: u64| d.first_seen(off).is_some_and(|x| x <= t);
    let s: Vec<&Message> = c
        .messages
        .iter()
        .filter(|m| m.last < c.conn.s2c.bytes.len() as u64 && seen(&c.conn.s2c, m.start))
        .collect();
    let k: Vec<(u16, u64, u64)> = c2s_messages(c)?
        .into_iter()
        .filter(|m| seen(&c.conn.c2s, m.2))
        .collect();
    Ok((
        (s.len() as u64, s.iter().map(|m| m.last + 1 - m.start).sum()),
        (k.len() as u64, k.iter().map(|m| m.1).sum()),
    ))
}

/// Channel type name as the observer writes it (§2.1).
pub fn type_name(t: u8) -> &'static str {
    match t {
        1 => "main",
        2 => "display",
        3 => "inputs",
        4 => "cursor",
        5 => "playback",
        6 => "record",
        _ => "other",
    }
}

// ---------------------------------------------------------------------------------------------
// Samples (the `observe --samples` contract), read without the observer's types

/// One leg's raw TCP positions in a sample.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SampleLeg {
    pub socket: String,
    pub write_seq: u32,
    pub snd_nxt: u32,
    pub snd_una: u32,
    pub rcv_nxt: u32,
    pub copied_seq: u32,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SampleLegs {
    pub server: Option<SampleLeg>,
    pub relay_backend: Option<SampleLeg>,
    pub relay_client: Option<SampleLeg>,
}

/// One line of `observe --samples`: one sample of one display/cursor channel of spice-server.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sample {
    /// Seconds since the observation's start (CLOCK_MONOTONIC) before / after reading.
    pub t_s: f64,
    pub t_end_s: f64,
    pub socket: String,
    pub channel_type: String,
    pub channel_id: u8,
    pub in_flight: u64,
    /// The count's interval (equal to `in_flight` on a connection seen from its SET_ACK; README
    /// "The window of a joined connection").
    pub in_flight_low: u64,
    pub in_flight_high: u64,
    pub in_flight_exact: bool,
    pub window_source: Option<String>,
    /// Position the count refers to: server → client messages and ACKs counted.
    pub server_messages: u64,
    pub acks: u64,
    pub window: u32,
    pub stages: BTreeMap<String, u32>,
    pub unplaced: u32,
    pub legs: SampleLegs,
    pub newest_last_byte_seq: Option<u32>,
    pub oldest_last_byte_seq: Option<u32>,
    pub kept: u64,
    pub clamped: u32,
}

const SAMPLE_KEYS: [&str; 20] = [
    "t_s",
    "t_end_s",
    "socket",
    "channel_type",
    "channel_id",
    "in_flight",
    "in_flight_low",
    "in_flight_high",
    "in_flight_exact",
    "window_source",
    "server_messages",
    "acks",
    "window",
    "stages",
    "unplaced",
    "legs",
    "newest_last_byte_seq",
    "oldest_last_byte_seq",
    "kept",
    "clamped",
];

/// The report's `clock`: CLOCK_REALTIME and CLOCK_MONOTONIC read back to back at the start.
#[derive(Clone, Copy, Debug, Deserialize)]
pub struct Clock {
    pub realtime_ns: u64,
    pub monotonic_ns: u64,
}

/// Reads the `clock` object of the JSON report at `path`.
pub fn read_clock(path: &Path) -> Result<Clock> {
    let raw: Value = serde_json::from_str(
        &std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
    )?;
    serde_json::from_value(
        raw.get("clock")
            .cloned()
            .context("report lacks `clock` (realtime_ns, monotonic_ns)")?,
    )
    .context("report `clock`")
}

/// Reads a `--samples` file: every line must have exactly the contract's keys (and every leg
/// exactly its six), nulls only where the contract allows them.
pub fn read_samples(path: &Path) -> Result<Vec<Sample>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let want: BTreeSet<&str> = SAMPLE_KEYS.into_iter().collect();
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let v: Value = serde_json::from_str(line)
            .with_context(|| format!("{} line {}", path.display(), n + 1))?;
        let keys: BTreeSet<&str> = v
            .as_object()
            .context("sample line is not an object")?
            .keys()
            .map(String::as_str)
            .collect();
        ensure!(
            keys == want,
            "{} line {}: keys {keys:?}, contract {want:?}",
            path.display(),
            n + 1
        );
        for leg in ["server", "relay_backend", "relay_client"] {
            ensure!(
                v["legs"].get(leg).is_some(),
                "{} line {}: legs.{leg} missing",
                path.display(),
                n + 1
            );
        }
        out.push(
            serde_json::from_value(v)
                .with_context(|| format!("{} line {}", path.display(), n + 1))?,
        );
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Classification

/// Where a message's last byte is at a given time, in chain order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Position {
    /// (a) not yet on the server-leg wire
    ServerQueue = 0,
    /// (b) on it, not acknowledged by the relay's (or client's) TCP
    ServerUnacked = 1,
    /// (c) acknowledged on the server leg, not yet on the client-leg wire
    Relay = 2,
    /// (d) on the client-leg wire, not acknowledged
    ClientUnacked = 3,
    /// (e) acknowledged by the client's TCP
    ClientAcked = 4,
}

/// How the chain of a channel looks in the captures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chain {
    /// No client-leg capture given: spice-server's peer is the client.
    NoRelay,
    /// A client-leg connection with the same link message carrying the same server→client
    /// bytes (over the part both captures hold).
    Transparent,
    /// A client-leg connection with the same link message but other server→client bytes.
    Changed,
}

/// A comparison group: oracle positions ↔ the observer's stages summed.
#[derive(Clone, Debug)]
pub struct Group {
    pub name: &'static str,
    pub positions: &'static [Position],
    pub stages: &'static [&'static str],
    /// Add the sample's `unplaced` to the observer's side.
    pub with_unplaced: bool,
}

use Position::*;

/// The groups compared for a chain (placeable stages only behind a changing relay).
pub fn groups(chain: Chain) -> Vec<Group> {
    let a = Group {
        name: "server_writing+server_notsent",
        positions: &[ServerQueue],
        stages: &["server_writing", "server_notsent"],
        with_unplaced: false,
    };
    let b = Group {
        name: "server_unacked",
        positions: &[ServerUnacked],
        stages: &["server_unacked"],
        with_unplaced: false,
    };
    match chain {
        Chain::NoRelay => vec![
            a,
            b,
            Group {
                name: "client_owes_ack",
                positions: &[Relay, ClientUnacked, ClientAcked],
                stages: &["client_owes_ack"],
                with_unplaced: false,
            },
        ],
        Chain::Transparent => vec![
            a,
            b,
            Group {
                name: "proxy_recv_queue+proxy_inside+proxy_notsent",
                positions: &[Relay],
                stages: &["proxy_recv_queue", "proxy_inside", "proxy_notsent"],
                with_unplaced: false,
            },
            Group {
                name: "client_unacked",
                positions: &[ClientUnacked],
                stages: &["client_unacked"],
                with_unplaced: false,
            },
            Group {
                name: "client_owes_ack",
                positions: &[ClientAcked],
                stages: &["client_owes_ack"],
                with_unplaced: false,
            },
        ],
        Chain::Changed => vec![
            a,
            b,
            Group {
                name: "proxy_recv_queue+unplaced",
                positions: &[Relay, ClientUnacked, ClientAcked],
                stages: &["proxy_recv_queue"],
                with_unplaced: true,
            },
        ],
    }
}

/// The stage keys the observer must write for a chain.
fn expected_stage_keys(chain: Chain) -> BTreeSet<&'static str> {
    groups(chain)
        .iter()
        .flat_map(|g| g.stages.iter().copied())
        .collect()
}

/// Resolution of a send time taken from TSval: one tick of Linux's millisecond TCP clock.
const TSVAL_TICK: f64 = 0.001;

/// Per message times (CLOCK_REALTIME seconds; None = not within the capture).
#[derive(Clone, Copy, Debug)]
struct Times {
    server_wire: Option<f64>,
    server_acked: Option<f64>,
    client_wire: Option<f64>,
    client_acked: Option<f64>,
}

fn before(t: f64, event: Option<f64>) -> bool {
    event.is_none_or(|e| t < e)
}

impl Times {
    fn position(&self, t: f64) -> Position {
        if before(t, self.server_wire) {
            ServerQueue
        } else if before(t, self.server_acked) {
            ServerUnacked
        } else if before(t, self.client_wire) {
            Relay
        } else if before(t, self.client_acked) {
            ClientUnacked
        } else {
            ClientAcked
        }
    }
}

/// One spice-server channel matched across the captures.
struct Matched<'a> {
    server: &'a SpiceConn,
    client: Option<&'a SpiceConn>,
    chain: Chain,
    /// Behind a changing relay: (offset, length) of the one run of bytes it inserted.
    insertion: Option<(u64, u64)>,
    /// Per message: the events at their earliest and latest possible times.
    early: Vec<Times>,
    late: Vec<Times>,
}

/// If `client` is `server` with one run of bytes inserted (compared over the part both hold),
/// its (offset, length).
fn single_insertion(server: &[u8], client: &[u8]) -> Option<(u64, u64)> {
    let at = server.iter().zip(client).position(|(a, b)| a != b)?;
    (1..=4096.min(client.len() - at)).find_map(|len| {
        let n = (client.len() - at - len).min(server.len() - at);
        (n > 0 && client[at + len..at + len + n] == server[at..at + n])
            .then_some((at as u64, len as u64))
    })
}

/// Which time puts a byte "on the wire" of a leg.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    /// When the sender's TCP sent it (TSval): the point `snd_nxt` moves, before the shaping
    /// qdisc of the relay's link. The oracle's reference.
    TcpSent,
    /// When the capture saw it (after the qdisc on `rigr0`): shown for information, it counts
    /// bytes waiting in the qdisc as not yet on the wire.
    Captured,
}

impl Wire {
    /// Short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            Wire::TcpSent => "tcp-sent",
            Wire::Captured => "captured",
        }
    }
}

fn match_channel<'a>(
    wire: Wire,
    socket: &str,
    server_leg: &'a [SpiceConn],
    client_leg: Option<&'a [SpiceConn]>,
) -> Result<Matched<'a>> {
    // spice-server's socket "laddr:port->raddr:port": its s2c direction goes laddr -> raddr.
    let (l, r) = socket
        .split_once("->")
        .with_context(|| format!("socket {socket:?}"))?;
    let server = server_leg
        .iter()
        .find(|c| c.conn.s2c.src == l && c.conn.s2c.dst == r)
        .with_context(|| {
            format!("spice-server's socket {socket} is not in the server-leg capture")
        })?;
    let (client, chain) = match client_leg {
        None => (None, Chain::NoRelay),
        Some(legs) => {
            let same: Vec<&SpiceConn> = legs
                .iter()
                .filter(|c| c.link_message == server.link_message)
                .collect();
            ensure!(
                same.len() == 1,
                "{} client-leg connections carry the link message of {socket} ({} {})",
                same.len(),
                type_name(server.channel_type),
                server.channel_id
            );
            let c = same[0];
            let (sb, cb) = (&server.conn.s2c.bytes, &c.conn.s2c.bytes);
            let n = cb.len().min(sb.len());
            let chain = if cb[..n] == sb[..n] {
                Chain::Transparent
            } else {
                Chain::Changed
            };
            (Some(c), chain)
        }
    };
    // Behind a changing relay: if it inserted one run of bytes into an otherwise identical
    // stream (rig/mangle-relay.py inserts one message), server offset o maps to o below the
    // insertion point and to o + its length above it; otherwise the client leg cannot be
    // mapped.
    let insertion = match (chain, client) {
        (Chain::Changed, Some(c)) => single_insertion(&server.conn.s2c.bytes, &c.conn.s2c.bytes),
        _ => None,
    };
    let map: Option<Box<dyn Fn(u64) -> u64>> = match (chain, insertion) {
        (Chain::Transparent, _) => Some(Box::new(|o| o)),
        (Chain::Changed, Some((at, len))) => {
            Some(Box::new(move |o| if o < at { o } else { o + len }))
        }
        _ => None,
    };
    if wire == Wire::TcpSent {
        for c in std::iter::once(server).chain(client) {
            ensure!(
                c.conn.s2c.bytes.is_empty() || !c.conn.s2c.first_sent.is_empty(),
                "stream {} {}->{}: no TCP timestamps (net.ipv4.tcp_timestamps off?)",
                c.conn.stream,
                c.conn.s2c.src,
                c.conn.s2c.dst
            );
        }
    }
    // The TSval send time is known to ±1 ms (one TSval tick); the capture is a hard upper
    // bound. `late` = the latest the byte can have been sent, `early` the earliest.
    let on_wire = |d: &Direction, off: u64, late: bool| match wire {
        Wire::TcpSent => d.sent_at(off).map(|t| {
            if late {
                d.first_seen(off)
                    .map_or(t + TSVAL_TICK, |c| c.min(t + TSVAL_TICK))
            } else {
                t - TSVAL_TICK
            }
        }),
        Wire::Captured => d.first_seen(off),
    };
    let times_at = |late: bool| -> Vec<Times> {
        server
            .messages
            .iter()
            .map(|m| {
                let (client_wire, client_acked) = match (&map, client) {
                    (Some(map), Some(c)) => {
                        let o = map(m.last);
                        (on_wire(&c.conn.s2c, o, late), c.conn.s2c.acked_at(o))
                    }
                    // Without a (transparent) client leg, (c) and (d) drop out.
                    _ => (Some(f64::NEG_INFINITY), Some(f64::NEG_INFINITY)),
                };
                Times {
                    server_wire: on_wire(&server.conn.s2c, m.last, late),
                    server_acked: server.conn.s2c.acked_at(m.last),
                    client_wire,
                    client_acked,
                }
            })
            .collect()
    };
    let (early, late) = (times_at(false), times_at(true));
    Ok(Matched {
        server,
        client,
        chain,
        insertion,
        early,
        late,
    })
}

/// One sample with messages in flight that is compared, classified.
#[derive(Clone, Debug)]
pub struct Scored {
    pub sample: Sample,
    /// The groups compared: the chain of the stages the observer placed at this sample, or,
    /// when it placed nothing, the chain the captures show.
    pub chain: Chain,
    /// Per group: the oracle's count lies in [lo, hi] over the sample's read interval. Empty
    /// when the oracle could not place the sample's messages (a sample the observer failed to
    /// place whose newest message is unknown or beyond the capture).
    pub lo: Vec<u64>,
    pub hi: Vec<u64>,
    /// Set when the observer failed to place this sample ([`NOTHING_PLACED`],
    /// [`SOME_UNPLACED`], [`OPAQUE_WHEN_PAIRED`]): the sample disagrees in every group,
    /// whatever the numbers.
    pub failed: Option<&'static str>,
}

/// The comparison of one scenario's samples with the captures. Every sample line is counted
/// once: compared (in `scored`, disagreements included) or excluded (in `excluded`).
pub struct Agreement {
    pub scenario: String,
    pub wire: Wire,
    pub scored: Vec<Scored>,
    /// Samples left out of the comparison, per (channel, reason): [`NOTHING_IN_FLIGHT`] and
    /// [`BEYOND_CAPTURE`] (bounded by [`BEYOND_CAPTURE_MAX`]), nothing else.
    pub excluded: BTreeMap<(String, &'static str), usize>,
    /// Compared samples whose groups follow the observer's stage set rather than the chain the
    /// captures show, per (channel, reason): [`AROUND_INSERTION`], [`UP_TO_RECV_QUEUE`]
    /// (bounded by [`UP_TO_RECV_QUEUE_MAX`]). They are in `scored` too.
    pub compared_differently: BTreeMap<(String, &'static str), usize>,
    /// Diagnostics: samples whose server-leg snd_una lies within the captured ACKs over
    /// [t_s − 2 ms, t_end_s + 2 ms] (the clock mapping's sanity), and those checked.
    pub snd_una_in_range: (usize, usize),
}

/// Excluded: nothing in flight (no message to place; the comparison is over samples with
/// messages in flight).
pub const NOTHING_IN_FLIGHT: &str = "excluded: nothing in flight";

/// Excluded: the sample's newest in-flight message was not sent before the capture stopped.
pub const BEYOND_CAPTURE: &str =
    "excluded: newest in-flight message sent after the capture stopped";

/// At most this share of a channel's samples with messages in flight may be
/// [`BEYOND_CAPTURE`].
pub const BEYOND_CAPTURE_MAX: f64 = 0.10;

/// Failed to place: the observer wrote no stage (no position read) for a sample with messages
/// in flight.
pub const NOTHING_PLACED: &str = "disagreement: nothing placed by the observer (no positions read)";

/// Failed to place: messages unplaced where every stage of the chain is placeable (no relay,
/// or a byte-transparent relay with both legs): the agent kept fewer than it counted.
pub const SOME_UNPLACED: &str =
    "disagreement: messages unplaced by the observer although every stage is placeable";

/// Failed to place: the observer placed only up to `proxy_recv_queue` although it had the
/// client leg's position, and the captures show the relay byte-transparent.
pub const OPAQUE_WHEN_PAIRED: &str = "disagreement: placed only up to proxy_recv_queue with the client leg read, but the captures show a byte-transparent relay";

/// At most this share of a channel's compared samples may be ones the observer failed to
/// place (they also count as disagreements in every group).
pub const FAILED_MAX: f64 = 0.05;

/// Compared with all stages behind a changing relay: placed before the change was detected,
/// the client leg mapped around the insertion.
pub const AROUND_INSERTION: &str = "compared with all stages behind the changing relay (placed before the change was detected; client leg mapped around the insertion)";

/// Compared up to `proxy_recv_queue` (+ unplaced) on a byte-transparent chain: the sample has
/// no client-leg position (the observer had not paired that leg yet).
pub const UP_TO_RECV_QUEUE: &str = "compared up to proxy_recv_queue+unplaced only: no client-leg position in the sample (leg not paired yet)";

/// At most this share of a channel's compared samples may be [`UP_TO_RECV_QUEUE`].
pub const UP_TO_RECV_QUEUE_MAX: f64 = 0.05;

/// Tolerance: ±1 message. Threshold: share of samples that must agree, per group.
pub const TOLERANCE: i64 = 1;
pub const THRESHOLD: f64 = 0.95;

/// Classifies every sample of spice-server's channels against the captures.
///
/// Rule (ties): a message's position is taken at the sample's start `t_s` and end `t_end_s`
/// (capture times mapped with `clock`); over the read interval it may be in any position
/// between the two. A TSval send time is only known to ±1 ms (capped by the capture time), so
/// at `t_s` the message is taken with every event at its latest possible time and at `t_end_s`
/// at its earliest. A group's oracle count therefore lies in [lo, hi] with lo = messages in the
/// group at both ends and hi = messages in the group at either end or passing through it; the
/// observer agrees when lo − 1 ≤ its count ≤ hi + 1.
///
/// Each sample line is counted once. Excluded: nothing in flight ([`NOTHING_IN_FLIGHT`]), or
/// the newest in-flight message sent after the capture stopped ([`BEYOND_CAPTURE`], bounded in
/// [`Agreement::check`]). Every other sample is compared; one the observer failed to place
/// ([`NOTHING_PLACED`], [`SOME_UNPLACED`], [`OPAQUE_WHEN_PAIRED`]) is compared as a
/// disagreement in every group, even when the oracle cannot place its messages.
///
/// Fails if a sample's newest in-flight message (within the capture) ends at no message
/// boundary of the server-leg capture, if the oldest kept one does not match the capture, or
/// if the observer's stage keys do not fit the chain the captures show.
pub fn classify(
    wire: Wire,
    scenario: &str,
    samples: &[Sample],
    clock: Clock,
    server_leg: &[SpiceConn],
    client_leg: Option<&[SpiceConn]>,
) -> Result<Agreement> {
    classify_with(
        wire,
        Ties::ReadInterval,
        scenario,
        samples,
        clock,
        server_leg,
        client_leg,
    )
}

/// How a sample's time is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ties {
    /// Any time in [t_s, t_end_s] (the rule of [`classify`]).
    ReadInterval,
    /// t_s alone (stricter; for information).
    StartOnly,
}

/// [`classify`] with a choice of tie rule.
pub fn classify_with(
    wire: Wire,
    ties: Ties,
    scenario: &str,
    samples: &[Sample],
    clock: Clock,
    server_leg: &[SpiceConn],
    client_leg: Option<&[SpiceConn]>,
) -> Result<Agreement> {
    let mut matched: BTreeMap<String, Matched> = BTreeMap::new();
    let mut scored = Vec::new();
    let mut excluded: BTreeMap<(String, &'static str), usize> = BTreeMap::new();
    let mut differently: BTreeMap<(String, &'static str), usize> = BTreeMap::new();
    let mut una = (0, 0);
    let base = clock.realtime_ns as f64 / 1e9;
    for (n, s) in samples.iter().enumerate() {
        if !matched.contains_key(&s.socket) {
            let m = match_channel(wire, &s.socket, server_leg, client_leg)?;
            ensure!(
                type_name(m.server.channel_type) == s.channel_type
                    && m.server.channel_id == s.channel_id,
                "sample says {} {} for {}, the capture's link message says {} {}",
                s.channel_type,
                s.channel_id,
                s.socket,
                type_name(m.server.channel_type),
                m.server.channel_id
            );
            matched.insert(s.socket.clone(), m);
        }
        let m = &matched[&s.socket];
        // The legs the observer paired must be this channel's connections in the captures.
        if let Some(b) = &s.legs.relay_backend {
            let want = format!("{}->{}", m.server.conn.s2c.dst, m.server.conn.s2c.src);
            ensure!(
                b.socket == want,
                "sample {}: relay backend leg {} but the server-leg capture's connection is {want}",
                n + 1,
                b.socket
            );
        }
        if let (Some(c), Some(cl)) = (&s.legs.relay_client, m.client) {
            let want = format!("{}->{}", cl.conn.s2c.src, cl.conn.s2c.dst);
            ensure!(
                c.socket == want,
                "sample {}: relay client leg {} but the capture's connection with the same link \
                 message is {want}",
                n + 1,
                c.socket
            );
        }
        let what = format!(
            "{scenario}: sample {} ({} {} t_s {:.3})",
            n + 1,
            s.channel_type,
            s.channel_id,
            s.t_s
        );
        let (t0, t1) = (base + s.t_s, base + s.t_end_s);
        ensure!(t1 >= t0, "{what}: t_end_s before t_s");
        let t1 = match ties {
            Ties::ReadInterval => t1,
            Ties::StartOnly => t0,
        };
        if let Some(leg) = &s.legs.server {
            let d = &m.server.conn.s2c;
            let off = d.offset(leg.snd_una);
            una.1 += 1;
            if d.acked_by(t0 - 0.002) <= off && off <= d.acked_by(t1 + 0.002) {
                una.0 += 1;
            }
        }
        let chan = format!("{} {}", s.channel_type, s.channel_id);
        if s.in_flight == 0 {
            *excluded.entry((chan, NOTHING_IN_FLIGHT)).or_default() += 1;
            continue;
        }
        // Which stages the observer placed at this sample decides the groups compared; they
        // must fit the chain the captures show. A sample the observer failed to place is
        // compared too, as a disagreement in every group.
        let keys: BTreeSet<&str> = s.stages.keys().map(String::as_str).collect();
        let (mode, failed) = if keys.is_empty() {
            (m.chain, Some(NOTHING_PLACED))
        } else {
            let mode = [Chain::Transparent, Chain::Changed, Chain::NoRelay]
                .into_iter()
                .find(|&c| keys == expected_stage_keys(c))
                .with_context(|| format!("{what}: unexpected stage set {keys:?}"))?;
            let mut failed = None;
            match (m.chain, mode) {
                (a, b) if a == b => {}
                (Chain::Changed, Chain::Transparent) if m.insertion.is_some() => {
                    *differently
                        .entry((chan.clone(), AROUND_INSERTION))
                        .or_default() += 1;
                }
                (Chain::Transparent, Chain::Changed) if s.legs.relay_client.is_none() => {
                    *differently
                        .entry((chan.clone(), UP_TO_RECV_QUEUE))
                        .or_default() += 1;
                }
                (Chain::Transparent, Chain::Changed) => failed = Some(OPAQUE_WHEN_PAIRED),
                _ => bail!(
                    "{what}: the captures show a {:?} chain, the observer placed {keys:?}",
                    m.chain
                ),
            }
            // Every stage is placeable here: an unplaced message is one the agent lost.
            if failed.is_none() && mode != Chain::Changed && s.unplaced > 0 {
                failed = Some(SOME_UNPLACED);
            }
            (mode, failed)
        };
        let gs = groups(mode);
        let unclassified = Scored {
            sample: s.clone(),
            chain: mode,
            lo: Vec::new(),
            hi: Vec::new(),
            failed,
        };
        let Some(newest) = s.newest_last_byte_seq else {
            ensure!(
                failed.is_some(),
                "{what}: {} in flight but newest_last_byte_seq is null",
                s.in_flight
            );
            scored.push(unclassified);
            continue;
        };
        let off = m.server.conn.s2c.offset(newest);
        if m.server.messages.last().is_none_or(|x| off > x.last) {
            // The oracle cannot place it; a failure to place is a disagreement all the same.
            if failed.is_some() {
                scored.push(unclassified);
            } else {
                *excluded.entry((chan, BEYOND_CAPTURE)).or_default() += 1;
            }
            continue;
        }
        let k = m
            .server
            .messages
            .iter()
            .position(|x| x.last == off)
            .with_context(|| {
                format!(
                    "{what}: no server→client message in the capture ends at seq {newest} \
                     (offset {off}; {} messages parsed, last ends at {:?})",
                    m.server.messages.len(),
                    m.server.messages.last().map(|x| x.last)
                )
            })?;
        let count = s.in_flight as usize;
        ensure!(
            count <= k + 1,
            "{what}: {count} in flight but only {} messages up to the newest",
            k + 1
        );
        if let Some(oldest) = s.oldest_last_byte_seq {
            let kept = s.kept as usize;
            ensure!(
                (1..=count).contains(&kept),
                "{what}: kept {kept} with {count} in flight"
            );
            let want = m.server.conn.s2c.seq(m.server.messages[k + 1 - kept].last);
            ensure!(
                oldest == want,
                "{what}: oldest kept message ends at seq {oldest}; in the capture the {kept}th \
                 newest (from seq {newest}) ends at {want}"
            );
        }
        let (mut lo, mut hi) = (vec![0u64; gs.len()], vec![0u64; gs.len()]);
        for i in k + 1 - count..=k {
            // The least advanced position at t0, the most advanced at t1.
            let (p0, p1) = (m.late[i].position(t0), m.early[i].position(t1));
            for (g, group) in gs.iter().enumerate() {
                let in0 = group.positions.contains(&p0);
                let in1 = group.positions.contains(&p1);
                let through = group.positions.iter().any(|&p| p0 <= p && p <= p1);
                if in0 && in1 {
                    lo[g] += 1;
                }
                if in0 || in1 || through {
                    hi[g] += 1;
                }
            }
        }
        scored.push(Scored {
            lo,
            hi,
            ..unclassified
        });
    }
    for (sock, m) in &matched {
        eprintln!(
            "oracle: {scenario}: {sock} = {} {}, server leg stream {} ({} messages, mini header {}), \
             client leg {}, chain {:?}, insertion (offset, bytes) {:?}",
            type_name(m.server.channel_type),
            m.server.channel_id,
            m.server.conn.stream,
            m.server.messages.len(),
            m.server.mini_header,
            m.client.map_or("none".to_string(), |c| format!(
                "stream {} {}->{}",
                c.conn.stream, c.conn.s2c.src, c.conn.s2c.dst
            )),
            m.chain,
            m.insertion
        );
    }
    Ok(Agreement {
        scenario: scenario.to_string(),
        wire,
        scored,
        excluded,
        compared_differently: differently,
        snd_una_in_range: una,
    })
}

/// The observer's count for a group, from a (possibly mutated) stage map.
fn observed(g: &Group, stages: &BTreeMap<String, u32>, unplaced: u32) -> Result<u64> {
    let mut n = 0u64;
    for s in g.stages {
        n += u64::from(
            *stages
                .get(*s)
                .with_context(|| format!("stage {s} missing from the sample"))?,
        );
    }
    if g.with_unplaced {
        n += u64::from(unplaced);
    }
    Ok(n)
}

/// Per channel and group: (agreeing samples, compared samples).
pub type Shares = BTreeMap<(String, &'static str), (usize, usize)>;

/// Per channel and group: (sum of the oracle's midpoint counts, sum of the observer's counts,
/// the observer's largest count), to show what the agreement was about.
type Sizes = BTreeMap<(String, &'static str), (f64, u64, u64)>;

/// A sample's channel, as the tables name it.
fn channel(s: &Sample) -> String {
    format!("{} {}", s.channel_type, s.channel_id)
}

/// One group of one sample, judged: (group name, the observer's count, the oracle's [lo, hi],
/// agrees).
type Judged = (&'static str, Option<i64>, Option<(u64, u64)>, bool);

impl Scored {
    /// Per group of [`Scored::chain`]: the observer's count after `mutate` (None when it placed
    /// nothing), the oracle's [lo, hi] (None when it could not place the messages), and
    /// whether they agree: lo − [`TOLERANCE`] ≤ observer ≤ hi + [`TOLERANCE`], and never for
    /// a sample the observer failed to place.
    fn judge(&self, mutate: &dyn Fn(&mut BTreeMap<String, u32>)) -> Result<Vec<Judged>> {
        let mut st = self.sample.stages.clone();
        mutate(&mut st);
        let mut out = Vec::new();
        for (g, group) in groups(self.chain).iter().enumerate() {
            let obs = if self.sample.stages.is_empty() {
                None
            } else {
                Some(observed(group, &st, self.sample.unplaced)? as i64)
            };
            let range = (!self.lo.is_empty()).then(|| (self.lo[g], self.hi[g]));
            let ok = self.failed.is_none()
                && match (obs, range) {
                    (Some(o), Some((lo, hi))) => {
                        lo as i64 - TOLERANCE <= o && o <= hi as i64 + TOLERANCE
                    }
                    _ => false,
                };
            out.push((group.name, obs, range, ok));
        }
        Ok(out)
    }
}

impl Agreement {
    /// Scores the samples, the observer's stages first passed through `mutate`.
    pub fn shares_with(&self, mutate: &dyn Fn(&mut BTreeMap<String, u32>)) -> Result<Shares> {
        Ok(self.score(mutate)?.0)
    }

    fn score(&self, mutate: &dyn Fn(&mut BTreeMap<String, u32>)) -> Result<(Shares, Sizes)> {
        let mut out = Shares::new();
        let mut sizes = Sizes::new();
        for sc in &self.scored {
            let chan = channel(&sc.sample);
            for (name, obs, range, ok) in sc.judge(mutate)? {
                let e = out.entry((chan.clone(), name)).or_default();
                e.1 += 1;
                if ok {
                    e.0 += 1;
                }
                let z = sizes.entry((chan.clone(), name)).or_default();
                if let Some((lo, hi)) = range {
                    z.0 += (lo + hi) as f64 / 2.0;
                }
                let obs = obs.unwrap_or(0) as u64;
                z.1 += obs;
                z.2 = z.2.max(obs);
            }
        }
        Ok((out, sizes))
    }

    /// Per channel and reason: compared samples the observer failed to place.
    pub fn failed(&self) -> BTreeMap<(String, &'static str), usize> {
        let mut out = BTreeMap::new();
        for sc in &self.scored {
            if let Some(why) = sc.failed {
                *out.entry((channel(&sc.sample), why)).or_default() += 1;
            }
        }
        out
    }

    /// Per channel: (sample lines, compared samples).
    fn lines_per_channel(&self) -> BTreeMap<String, (usize, usize)> {
        let mut out: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        for sc in &self.scored {
            let e = out.entry(channel(&sc.sample)).or_default();
            e.0 += 1;
            e.1 += 1;
        }
        for ((chan, _), n) in &self.excluded {
            out.entry(chan.clone()).or_default().0 += n;
        }
        out
    }

    /// Up to `n` samples where a group disagrees, one line each: time, count, the oracle's
    /// [lo, hi] and the observer's number per group, and the observer's raw stages.
    pub fn disagreements(&self, n: usize) -> Result<String> {
        let mut s = String::new();
        for sc in self.scored.iter() {
            let mut line = String::new();
            let mut bad = false;
            for (name, obs, range, ok) in sc.judge(&|_| {})? {
                bad |= !ok;
                let range = range.map_or("?".to_string(), |(lo, hi)| format!("[{lo},{hi}]"));
                let obs = obs.map_or("-".to_string(), |o| o.to_string());
                let _ = write!(line, " {}{name}={range}/{obs}", if ok { "" } else { "!" });
            }
            if bad {
                let _ = writeln!(
                    s,
                    "ORACLE | {} | disagreement: {} t_s {:.3}..{:.3} in_flight {} kept {} unplaced {} clamped {}{}:{line} | observer {:?}",
                    self.scenario,
                    channel(&sc.sample),
                    sc.sample.t_s,
                    sc.sample.t_end_s,
                    sc.sample.in_flight,
                    sc.sample.kept,
                    sc.sample.unplaced,
                    sc.sample.clamped,
                    sc.failed.map_or(String::new(), |w| format!(" ({w})")),
                    sc.sample.stages
                );
                if s.lines().count() >= n {
                    break;
                }
            }
        }
        Ok(s)
    }

    /// The observer's own numbers.
    pub fn shares(&self) -> Result<Shares> {
        self.shares_with(&|_| {})
    }

    /// A copyable table of the agreement after `mutate`, one line per channel and group:
    /// agreeing/compared samples, share, mean oracle and observer counts, observer maximum;
    /// then, per channel, every sample line accounted for once: compared (of which failed to
    /// place, and compared on the observer's stage set), excluded by reason.
    pub fn table(
        &self,
        mutate: &dyn Fn(&mut BTreeMap<String, u32>),
        label: &str,
    ) -> Result<String> {
        let (shares, sizes) = self.score(mutate)?;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "ORACLE | {:<48} | {:<12} | {:<9} | {:<9} | {:<44} | agree/samples | share  | mean oracle / observer (max)",
            "scenario", "numbers", "wire time", "channel", "group"
        );
        for ((chan, g), (ok, n)) in &shares {
            let (so, sb, mx) = sizes[&(chan.clone(), *g)];
            let nn = (*n).max(1) as f64;
            let _ = writeln!(
                s,
                "ORACLE | {:<48} | {label:<12} | {:<9} | {chan:<9} | {g:<44} | {ok:>5}/{n:<7} | {:>5.1}% | {:>6.2} / {:>6.2} ({mx})",
                self.scenario,
                self.wire.name(),
                100.0 * *ok as f64 / nn,
                so / nn,
                sb as f64 / nn
            );
        }
        let failed = self.failed();
        for (chan, (lines, compared)) in self.lines_per_channel() {
            let _ = writeln!(
                s,
                "ORACLE | {:<48} | {label:<12} | {chan}: {lines} sample lines, {compared} compared",
                self.scenario
            );
            for (what, reasons) in [
                ("of the compared, failed to place", &failed),
                ("of the compared", &self.compared_differently),
                ("not compared", &self.excluded),
            ] {
                for ((c, why), n) in reasons {
                    if *c == chan {
                        let _ = writeln!(
                            s,
                            "ORACLE | {:<48} | {label:<12} | {chan}: {what}: {n} samples {why}",
                            self.scenario
                        );
                    }
                }
            }
        }
        let (a, b) = self.snd_una_in_range;
        let _ = writeln!(
            s,
            "ORACLE | {:<48} | clock check: server-leg snd_una within the captured ACKs of the read interval ±2 ms in {a}/{b} samples",
            self.scenario
        );
        Ok(s)
    }

    /// Prints the table and fails unless the display channel has at least `min_samples`
    /// compared samples and, per channel: every group agrees on at least [`THRESHOLD`] of the
    /// compared samples (a sample the observer failed to place disagrees in every group);
    /// those failures are at most [`FAILED_MAX`] of the compared samples; compared on the
    /// server-side groups for want of a client-leg position at most [`UP_TO_RECV_QUEUE_MAX`];
    /// excluded for lack of capture at most [`BEYOND_CAPTURE_MAX`] of the samples with
    /// messages in flight.
    pub fn check(&self, min_samples: usize) -> Result<Shares> {
        let shares = self.shares()?;
        eprint!("{}", self.table(&|_| {}, "observer")?);
        eprint!("{}", self.disagreements(10)?);
        let display = self
            .lines_per_channel()
            .iter()
            .filter(|(c, _)| c.starts_with("display"))
            .map(|(_, &(_, n))| n)
            .max()
            .unwrap_or(0);
        ensure!(
            display >= min_samples,
            "{}: only {display} display samples with messages in flight compared (need {min_samples})",
            self.scenario
        );
        let failed = self.failed();
        for (chan, (_, compared)) in self.lines_per_channel() {
            let of = |m: &BTreeMap<(String, &'static str), usize>, why: &str| {
                m.get(&(chan.clone(), why)).copied().unwrap_or(0)
            };
            let beyond = of(&self.excluded, BEYOND_CAPTURE);
            let in_flight = compared + beyond;
            ensure!(
                beyond as f64 <= BEYOND_CAPTURE_MAX * in_flight as f64,
                "{}: {chan}: {beyond} of {in_flight} samples with messages in flight name a \
                 message the capture did not reach (at most {:.0}%): keep capturing longer \
                 after the observation",
                self.scenario,
                BEYOND_CAPTURE_MAX * 100.0
            );
            let n_failed: usize = failed
                .iter()
                .filter(|((c, _), _)| *c == chan)
                .map(|(_, n)| n)
                .sum();
            ensure!(
                n_failed as f64 <= FAILED_MAX * compared as f64,
                "{}: {chan}: the observer failed to place {n_failed} of {compared} compared \
                 samples (at most {:.0}%): {failed:?}",
                self.scenario,
                FAILED_MAX * 100.0
            );
            let unpaired = of(&self.compared_differently, UP_TO_RECV_QUEUE);
            ensure!(
                unpaired as f64 <= UP_TO_RECV_QUEUE_MAX * compared as f64,
                "{}: {chan}: {unpaired} of {compared} compared samples had no client-leg \
                 position on a byte-transparent chain (at most {:.0}%)",
                self.scenario,
                UP_TO_RECV_QUEUE_MAX * 100.0
            );
        }
        for ((chan, g), &(ok, n)) in &shares {
            ensure!(
                ok as f64 >= THRESHOLD * n as f64,
                "{}: {chan} {g}: the observer agrees with the captures on {ok}/{n} samples, \
                 below {:.0}%",
                self.scenario,
                THRESHOLD * 100.0
            );
        }
        Ok(shares)
    }
}

/// Captures and parses both legs of one scenario.
pub struct Legs {
    pub server: Capture,
    pub client: Option<Capture>,
}

impl Legs {
    /// Starts the server-leg capture on loopback (`server_port`) and, with a relay, the
    /// client-leg capture on `client_iface` (`relay_port`). Call before the client connects.
    pub fn start(dir: &Path, server_port: u16, relay: Option<(&str, u16)>) -> Result<Self> {
        let server = Capture::start(dir.join("server-leg.pcapng"), None, "lo", &[server_port])?;
        let client = match relay {
            Some((iface, port)) => Some(Capture::start(
                dir.join("client-leg.pcapng"),
                None,
                iface,
                &[port],
            )?),
            None => None,
        };
        Ok(Self { server, client })
    }

    /// Stops both captures (failing on drops) and parses them.
    pub fn finish(mut self) -> Result<(Vec<SpiceConn>, Option<Vec<SpiceConn>>)> {
        self.server.stop()?;
        if let Some(c) = &mut self.client {
            c.stop()?;
        }
        let server = parse_capture(&self.server.path)?;
        let client = match &self.client {
            Some(c) => Some(parse_capture(&c.path)?),
            None => None,
        };
        for (leg, conns) in [("server", Some(&server)), ("client", client.as_ref())] {
            for c in conns.into_iter().flatten() {
                eprintln!(
                    "oracle: {leg} leg stream {} {}->{}: {} {}, {} messages, {} trailing bytes, {} bytes captured twice",
                    c.conn.stream,
                    c.conn.s2c.src,
                    c.conn.s2c.dst,
                    type_name(c.channel_type),
                    c.channel_id,
                    c.messages.len(),
                    c.trailing,
                    c.conn.s2c.resent_bytes
                );
            }
        }
        Ok((server, client))
    }
}
