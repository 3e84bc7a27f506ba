//! `observe --samples PATH`: the per-sample series, one JSON object per line (JSON Lines).
//!
//! One line per sample ([`sampler::read`] and [`sampler::place`], every `--sample-ms`) per
//! display and cursor channel of spice-server (a chain's head socket; the relay's legs appear
//! inside it, under `legs`) once its SET_ACK was seen, or once the window model of a
//! connection joined mid-stream counts ([`crate::model::joined`]). The line holds what the sample read and what it made of
//! it: spice-server's in-flight count, the stage split, and the raw TCP sequence numbers it
//! was placed against, so that an independent reader (e.g. of packet captures) can check the
//! split. On a TLS socket the sequence numbers are the TCP stream's (TLS records); its
//! messages' offsets are plaintext offsets, placed by the libssl marks
//! ([`crate::model::tls`]). [`SampleLine`] is the format; README "Sample series" documents it.

use std::{
    collections::BTreeMap,
    io::{BufWriter, Write},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use serde::{Deserialize, Deserializer, Serialize};
use spice_ebpf_common::protocol::{channel, channel_type_name};

use crate::{
    model::{Model, SocketModel, chain::STAGES},
    sampler::{self, LegSeqs},
};

/// Reads an `Option` field that must be present (as a value or `null`): serde alone would
/// read a missing `Option` field as `None`.
fn required<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    Option::<T>::deserialize(d)
}

/// The raw positions of one socket used by one sample: 32-bit TCP sequence numbers
/// (mod 2³²), see [`sampler::LegSeqs`] for their sources.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LegLine {
    /// The socket, `laddr:port->raddr:port` as the process holding it sees it (the same
    /// string as `socket` in the JSON report).
    pub socket: String,
    /// Sequence number after the last byte the process has written (the kernel hooks' TCP
    /// state in the socket's `SOCKETS` entry).
    pub write_seq: u32,
    /// Next sequence to send: `write_seq − tcpi_notsent_bytes` (sock_diag dump).
    pub snd_nxt: u32,
    /// First unacknowledged sequence: `write_seq − idiag_wqueue` (sock_diag dump).
    pub snd_una: u32,
    /// Next sequence expected from the peer: `copied_seq + idiag_rqueue` (sock_diag dump).
    pub rcv_nxt: u32,
    /// Sequence number after the last byte the process has read (the same TCP state).
    pub copied_seq: u32,
}

/// The three sockets of a chain. Each is `null` when the chain has no such socket (no relay,
/// leg not paired yet) or when its positions were not available at this sample (not in this
/// network namespace's sock_diag dump, no TCP state from the hooks, no `tcp_info`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Legs {
    /// spice-server's socket (its sending direction carries the messages).
    #[serde(deserialize_with = "required")]
    pub server: Option<LegLine>,
    /// The relay's socket toward spice-server (the same TCP connection from the other end;
    /// its receiving direction carries the messages).
    #[serde(deserialize_with = "required")]
    pub relay_backend: Option<LegLine>,
    /// The relay's socket toward the client carrying the same channel (its sending
    /// direction carries the messages).
    #[serde(deserialize_with = "required")]
    pub relay_client: Option<LegLine>,
}

/// One line of `--samples`: one sample of one display or cursor channel of spice-server.
/// Every key is always present (`null` where a value is not available).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SampleLine {
    /// Seconds since the observation's start (`clock.monotonic_ns` of the JSON report),
    /// CLOCK_MONOTONIC, taken right before the sample's sock_diag dump.
    pub t_s: f64,
    /// Seconds since the start, taken right after the sample's last read of the sockets' TCP
    /// state (`SOCKETS` map):
    /// the positions were read between `t_s` and `t_end_s`.
    pub t_end_s: f64,
    /// spice-server's socket, `laddr:port->raddr:port` (as `socket` in the JSON report).
    pub socket: String,
    /// `display` or `cursor`.
    pub channel_type: String,
    /// Channel id from the client's link message.
    pub channel_id: u8,
    /// spice-server's in-flight count (`messages_window`, as the kernel keeps it) at the
    /// sample.
    pub in_flight: u64,
    /// The interval that holds spice-server's count at the sample: both equal `in_flight` on
    /// a connection seen from its SET_ACK; on a connection joined mid-stream the model's
    /// bounds (README "Joined connections"), and `in_flight` is `in_flight_low` (the
    /// messages known to be in flight, which the stages place).
    pub in_flight_low: u64,
    pub in_flight_high: u64,
    /// `in_flight_low` = `in_flight_high`.
    pub in_flight_exact: bool,
    /// Where `window` came from: `"set_ack"`, `"ack_cadence"`, or `null` (not known yet;
    /// `window` is then 0).
    #[serde(deserialize_with = "required")]
    pub window_source: Option<String>,
    /// The position the count refers to: server → client messages up to the sample (the
    /// direction's ordinal: from the connection's start, or from its lock on a joined
    /// connection; lost records included), and client ACK records seen (all ACKs matched
    /// on a connection seen from its start; every ACK record on a joined one).
    pub server_messages: u64,
    pub acks: u64,
    /// The count a relay-side observer reports at the sample (the window rule on the relay
    /// leg's own messages); `None` without a relay leg with a SET_ACK seen. For front ends in process
    /// (the plot's relay line): not part of the `--samples` file (never written, read as
    /// `None`).
    #[serde(skip)]
    pub in_flight_relay: Option<u64>,
    /// ACK window W from the last SET_ACK, messages.
    pub window: u32,
    /// Messages per stage (README "Stages" names), for the stages this sample placed: all
    /// eight through a byte-transparent relay with both legs' positions, `server_writing`
    /// … `proxy_recv_queue` behind a relay that changes the stream (or whose client leg is
    /// not available), the four no-relay stages without a relay; empty when no position
    /// could be read (then every message is `unplaced`).
    pub stages: BTreeMap<String, u32>,
    /// Messages counted but not placed: beyond the relay's receive queue of a relay that
    /// changes the stream, counted but no longer kept (`in_flight − kept`), or all of them
    /// when no position was read. `stages` values + `unplaced` = `in_flight`.
    pub unplaced: u32,
    /// The raw TCP positions the placement used.
    pub legs: Legs,
    /// TCP sequence number (spice-server's socket, sending direction) of the last byte of the
    /// newest in-flight message; `null` when nothing is in flight or the stream's sequence
    /// base is unknown. On a TLS socket (`transport` `tls` in the report) the last byte of the
    /// TLS records of the SSL_write that moved the message's last plaintext byte
    /// ([`sampler::last_byte_seq`]); `null` while that call has not returned.
    #[serde(deserialize_with = "required")]
    pub newest_last_byte_seq: Option<u32>,
    /// The same for the oldest in-flight message kept.
    #[serde(deserialize_with = "required")]
    pub oldest_last_byte_seq: Option<u32>,
    /// In-flight messages the agent kept to place (≤ `in_flight`): the newest `kept` of them.
    pub kept: u64,
    /// Stage thresholds that disagreed with the data path's order or lay beyond the newest
    /// in-flight message's end, and were clamped ([`crate::model::chain::place`]; a lagging acknowledgement is
    /// not counted); 0 when nothing was placed.
    pub clamped: u32,
}

/// `laddr:port->raddr:port`, as the JSON report names sockets.
pub fn socket_name(s: &SocketModel) -> String {
    match (s.local, s.remote) {
        (Some(l), Some(r)) => format!("{l}->{r}"),
        _ => format!("cookie:{}", s.cookie),
    }
}

fn leg(model: &Model, l: Option<LegSeqs>) -> Option<LegLine> {
    let l = l?;
    Some(LegLine {
        socket: model
            .sockets
            .get(&l.cookie)
            .map_or_else(|| format!("cookie:{}", l.cookie), socket_name),
        write_seq: l.write_seq,
        snd_nxt: l.snd_nxt,
        snd_una: l.snd_una,
        rcv_nxt: l.rcv_nxt,
        copied_seq: l.copied_seq,
    })
}

/// The lines of one sample: display and cursor channels of spice-server whose SET_ACK was
/// seen. `started_ns`: CLOCK_MONOTONIC ns of the observation's start.
pub fn lines(model: &Model, sample: &sampler::Sample, started_ns: u64) -> Vec<SampleLine> {
    let secs = |ns: u64| ns.saturating_sub(started_ns) as f64 / 1e9;
    let mut out = Vec::new();
    for take in &sample.chains {
        let Some(s) = model.sockets.get(&take.server) else {
            continue;
        };
        // A connection joined mid-stream: its interval, once counting.
        let joined = s.joined.as_deref().and_then(|j| Some((j, j.interval()?)));
        let Some((ctype, cid)) = s
            .channel()
            .or_else(|| joined.and_then(|_| s.channel_type().map(|c| (c.ty, c.id.unwrap_or(0)))))
        else {
            continue;
        };
        if !(ctype == channel::DISPLAY || ctype == channel::CURSOR)
            || !(s.window.active() || joined.is_some())
        {
            continue;
        }
        let x = &take.sample;
        let in_flight = x.in_flight.max(0) as u64;
        let (stages, unplaced, clamped) = match x.placement {
            Some(p) => (
                take.stages
                    .iter()
                    .map(|&i| (STAGES[i].to_string(), p.counts[i]))
                    .collect(),
                p.unplaced,
                p.clamped,
            ),
            None => (BTreeMap::new(), in_flight as u32, 0),
        };
        out.push(SampleLine {
            t_s: secs(sample.t_ns),
            t_end_s: secs(sample.t_end_ns),
            socket: socket_name(s),
            channel_type: channel_type_name(ctype).to_string(),
            channel_id: cid,
            in_flight,
            in_flight_low: joined.map_or(in_flight, |(_, i)| u64::from(i.low)),
            in_flight_high: joined.map_or(in_flight, |(_, i)| u64::from(i.high)),
            in_flight_exact: joined.is_none_or(|(_, i)| i.exact()),
            window_source: match joined {
                Some((j, _)) => j.window_source().map(|w| w.name().to_string()),
                None => Some("set_ack".to_string()),
            },
            server_messages: s.s2c().map_or(0, |d| s.dirs[d].last_index),
            acks: joined.map_or(s.window.acks, |(j, _)| j.acks),
            in_flight_relay: x.relay_visible.map(|r| r.max(0) as u64),
            window: joined.map_or(s.window.window, |(j, _)| j.window().unwrap_or(0)),
            stages,
            unplaced,
            legs: Legs {
                server: leg(model, take.server_leg),
                relay_backend: leg(model, take.backend_leg),
                relay_client: leg(model, take.client_leg),
            },
            newest_last_byte_seq: take.newest_last_byte_seq,
            oldest_last_byte_seq: take.oldest_last_byte_seq,
            kept: x.kept,
            clamped,
        });
    }
    out
}

/// Writes [`SampleLine`]s to a file or stdout, flushing at least every second.
pub struct SampleWriter {
    out: BufWriter<Box<dyn Write>>,
    path: PathBuf,
    last_flush: Instant,
    /// The first write error; writing stops there and [`SampleWriter::finish`] returns it.
    error: Option<std::io::Error>,
}

/// Longest time lines wait in the buffer.
const FLUSH_EVERY: Duration = Duration::from_secs(1);

impl SampleWriter {
    /// Opens (creates or truncates) `path`, or stdout for `-`. Fails now if the file cannot
    /// be created, so that a bad path fails before observing.
    pub fn create(path: &Path) -> Result<Self> {
        let out: Box<dyn Write> = if path.as_os_str() == "-" {
            Box::new(std::io::stdout())
        } else {
            Box::new(
                std::fs::File::create(path)
                    .with_context(|| format!("cannot write the samples to {}", path.display()))?,
            )
        };
        Ok(Self {
            out: BufWriter::new(out),
            path: path.to_path_buf(),
            last_flush: Instant::now(),
            error: None,
        })
    }

    /// Appends `lines`, one JSON object per line, and flushes if the last flush is a second
    /// old. After a write error it writes nothing more (the error is kept for `finish`).
    pub fn write(&mut self, lines: &[SampleLine]) {
        if self.error.is_some() {
            return;
        }
        let r = lines.iter().try_for_each(|l| {
            serde_json::to_writer(&mut self.out, l)?;
            self.out.write_all(b"\n")
        });
        if let Err(e) = r {
            log::warn!("writing samples to {}: {e}", self.path.display());
            self.error = Some(e);
            return;
        }
        if self.last_flush.elapsed() >= FLUSH_EVERY {
            self.flush();
        }
    }

    /// Flushes what is buffered.
    pub fn flush(&mut self) {
        if self.error.is_some() {
            return;
        }
        self.last_flush = Instant::now();
        if let Err(e) = self.out.flush() {
            log::warn!("writing samples to {}: {e}", self.path.display());
            self.error = Some(e);
        }
    }

    /// Flushes and reports the first write error, if any.
    pub fn finish(mut self) -> Result<()> {
        self.flush();
        match self.error {
            Some(e) => {
                Err(e).with_context(|| format!("writing samples to {}", self.path.display()))
            }
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line() -> SampleLine {
        SampleLine {
            t_s: 1.5,
            t_end_s: 1.5001,
            socket: "127.0.0.1:5990->127.0.0.1:40000".into(),
            channel_type: "display".into(),
            channel_id: 0,
            in_flight: 7,
            in_flight_low: 7,
            in_flight_high: 9,
            in_flight_exact: false,
            window_source: Some("ack_cadence".into()),
            server_messages: 1234,
            acks: 61,
            in_flight_relay: None,
            window: 20,
            stages: [("server_notsent", 3), ("client_owes_ack", 2)]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            unplaced: 2,
            legs: Legs {
                server: Some(LegLine {
                    socket: "127.0.0.1:5990->127.0.0.1:40000".into(),
                    write_seq: 4_000_000_000,
                    snd_nxt: 3_999_000_000,
                    snd_una: 3_998_000_000,
                    rcv_nxt: 17,
                    copied_seq: 16,
                }),
                relay_backend: None,
                relay_client: None,
            },
            newest_last_byte_seq: Some(3_999_999_999),
            oldest_last_byte_seq: None,
            kept: 5,
            clamped: 1,
        }
    }

    #[test]
    fn every_key_is_written_with_its_exact_name() {
        let v = serde_json::to_value(line()).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        let mut want = vec![
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
        let mut got = keys.clone();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want);
        let legs: Vec<&str> = v["legs"]
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        assert_eq!(legs, ["relay_backend", "relay_client", "server"]);
        assert!(v["legs"]["relay_backend"].is_null() && v["oldest_last_byte_seq"].is_null());
        let mut leg: Vec<&str> = v["legs"]["server"]
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        leg.sort_unstable();
        assert_eq!(
            leg,
            [
                "copied_seq",
                "rcv_nxt",
                "snd_nxt",
                "snd_una",
                "socket",
                "write_seq"
            ]
        );
        assert_eq!(v["legs"]["server"]["write_seq"], 4_000_000_000u32);
        assert_eq!(v["stages"]["server_notsent"], 3);
        // One line, no newline inside.
        let text = serde_json::to_string(&line()).unwrap();
        assert!(!text.contains('\n'));
    }

    #[test]
    fn round_trips_and_rejects_missing_or_unknown_keys() {
        let v = serde_json::to_value(line()).unwrap();
        let back: SampleLine = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(back, line());
        for key in [
            "window_source",
            "in_flight_low",
            "newest_last_byte_seq",
            "oldest_last_byte_seq",
            "kept",
            "t_end_s",
        ] {
            let mut w = v.clone();
            w.as_object_mut().unwrap().remove(key);
            assert!(
                serde_json::from_value::<SampleLine>(w).is_err(),
                "missing {key} accepted"
            );
        }
        let mut w = v.clone();
        w["legs"].as_object_mut().unwrap().remove("relay_client");
        assert!(serde_json::from_value::<SampleLine>(w).is_err());
        let mut w = v.clone();
        w["extra"] = 1.into();
        assert!(serde_json::from_value::<SampleLine>(w).is_err());
    }

    #[test]
    fn writer_writes_one_object_per_line() {
        let dir =
            std::env::temp_dir().join(format!("spice-observer-samples-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.jsonl");
        let mut w = SampleWriter::create(&path).unwrap();
        w.write(&[line(), line()]);
        w.finish().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let got: Vec<SampleLine> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(got, [line(), line()]);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(SampleWriter::create(Path::new("/nonexistent-dir/x.jsonl")).is_err());
    }
}
