//! TEMPORARY: the issue-7 engine API (`spice_observer::pipeline::Engine`) over the current
//! observe pieces, so that the daemon compiles and runs before the `engine` branch lands.
//! Replaced by `crate::pipeline` at the merge; not the final thing.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use anyhow::Result;
use spice_ebpf_common::config::counter;
use tokio::io::{Interest, unix::AsyncFd};

use crate::{
    events,
    loader::Capture,
    model::{Model, chain::Chain},
    observe::{monotonic_ns, realtime_ns},
    report::{self, ClockReport, PidReport, TcpReport},
    sampler, sockdiag,
};

pub struct EngineOptions {
    pub sample: Duration,
    pub retain_closed: bool,
    pub bpf_stats: bool,
}

pub struct Watched {
    pub pid: u32,
    pub comm: String,
    pub ports_enrolled: usize,
    pub existing_connections: usize,
}

pub struct ProgramStats {
    pub name: String,
    pub run_time_ns: u64,
    pub run_count: u64,
}

pub struct EngineStats {
    pub sockets: usize,
    pub chains: usize,
    pub processes: usize,
    pub records: u64,
    pub decode_errors: u64,
}

pub struct Engine {
    cap: Capture,
    ring: AsyncFd<aya::maps::RingBuf<aya::maps::MapData>>,
    model: Model,
    chains: Vec<Chain>,
    decode_errors: u64,
    clock: ClockReport,
    pids: Vec<u32>,
    unwatched: HashSet<u32>,
    /// Sample-weighted stand-in for the engine's time-weighted histogram: cookie → (le,
    /// seconds ≤ le, sum, count), advanced at each sample by the interval since the last.
    hist: HashMap<u64, report::InFlightHistogram>,
    last_sample_ns: u64,
    /// Cookies included (closed) in the last snapshot.
    reported_closed: std::cell::RefCell<Vec<u64>>,
}

const TCP_LISTEN: u8 = 10;
const TCP_ESTABLISHED: u8 = 1;
const TCP_CLOSE_WAIT: u8 = 8;

impl Engine {
    pub fn start(_opts: EngineOptions) -> Result<Engine> {
        let mut cap = Capture::load()?;
        let ring = unsafe { AsyncFd::register_with_interest(cap.take_ring()?, Interest::READABLE) }
            .map_err(|e| anyhow::anyhow!("polling the event ring: {}", e.into_parts().1))?;
        let started = monotonic_ns();
        Ok(Engine {
            cap,
            ring,
            model: Model::default(),
            chains: Vec::new(),
            decode_errors: 0,
            clock: ClockReport {
                realtime_ns: realtime_ns(),
                monotonic_ns: started,
            },
            pids: Vec::new(),
            unwatched: HashSet::new(),
            hist: HashMap::new(),
            last_sample_ns: started,
            reported_closed: Default::default(),
        })
    }

    pub fn watch(&mut self, pid: u32) -> Result<Watched> {
        let mut all = vec![pid];
        all.extend(sockdiag::descendants(pid));
        let mut owner = HashMap::new();
        for &p in &all {
            for inode in sockdiag::socket_inodes(p).unwrap_or_default() {
                owner.entry(inode).or_insert(p);
            }
        }
        let mut ports = 0;
        let mut existing = 0;
        let now = monotonic_ns();
        for s in sockdiag::dump_tcp()? {
            let Some(&p) = owner.get(&s.inode) else {
                continue;
            };
            if s.state == TCP_LISTEN {
                self.cap.watch_port(s.local.port())?;
                ports += 1;
            } else if s.state == TCP_ESTABLISHED || s.state == TCP_CLOSE_WAIT {
                self.cap.mark_preexisting(s.cookie)?;
                self.model.add_existing(s.cookie, p, s.local, s.remote, now);
                existing += 1;
            }
        }
        for &p in &all {
            self.cap.watch_pid(p)?;
        }
        self.unwatched.remove(&pid);
        if !self.pids.contains(&pid) {
            self.pids.push(pid);
        }
        Ok(Watched {
            pid,
            comm: sockdiag::comm(pid).unwrap_or_default(),
            ports_enrolled: ports,
            existing_connections: existing,
        })
    }

    pub fn unwatch(&mut self, pid: u32) -> Result<()> {
        self.pids.retain(|&p| p != pid);
        self.unwatched.insert(pid);
        Ok(())
    }

    pub async fn drain_ready(&mut self) -> Result<()> {
        let mut guard = self.ring.readable_mut().await?;
        let ring = guard.get_inner_mut();
        while let Some(item) = ring.next() {
            match events::decode(&item) {
                Ok(ev) => self.model.apply(&ev),
                Err(_) => self.decode_errors += 1,
            }
        }
        guard.clear_ready();
        Ok(())
    }

    pub fn drain(&mut self) {
        let ring = self.ring.get_mut();
        while let Some(item) = ring.next() {
            match events::decode(&item) {
                Ok(ev) => self.model.apply(&ev),
                Err(_) => self.decode_errors += 1,
            }
        }
    }

    pub fn sample(&mut self, now_ns: u64) -> Vec<crate::samples::SampleLine> {
        self.drain();
        let dt = now_ns.saturating_sub(self.last_sample_ns) as f64 / 1e9;
        self.last_sample_ns = now_ns;
        for s in self.model.sockets.values() {
            if s.closed_ns.is_some() || !s.window.active() {
                continue;
            }
            let w = s.window.window;
            let h = self.hist.entry(s.cookie).or_insert_with(|| {
                let mut le = vec![0, w / 4, w / 2, w, 3 * w / 2, 2 * w, 2 * w + 1, 2 * w + 2];
                le.dedup();
                report::InFlightHistogram {
                    seconds: vec![0.0; le.len()],
                    le,
                    sum: 0.0,
                    count: 0.0,
                }
            });
            let n = s.window.count;
            for (le, sec) in h.le.iter().zip(h.seconds.iter_mut()) {
                if n <= *le {
                    *sec += dt;
                }
            }
            h.sum += f64::from(n) * dt;
            h.count += dt;
        }
        if let Some(pos) = sampler::read(&mut self.cap, &mut self.model, &mut self.chains) {
            self.drain();
            let taken = sampler::place(&self.model, &mut self.chains, pos);
            for c in &mut self.chains {
                if c.samples.len() > 1200 {
                    c.samples.drain(..600);
                }
                if c.delivery_rates.len() > 1200 {
                    c.delivery_rates.drain(..600);
                }
            }
            return crate::samples::lines(&self.model, &taken, self.clock.monotonic_ns);
        }
        Vec::new()
    }

    pub fn snapshot(&self, now_ns: u64) -> report::Report {
        let mut tcp = BTreeMap::new();
        let diag: HashMap<u64, sockdiag::DiagSocket> = sockdiag::dump_tcp()
            .unwrap_or_default()
            .into_iter()
            .map(|d| (d.cookie, d))
            .collect();
        for s in self.model.sockets.values() {
            let rep = match (s.closed_ns, diag.get(&s.cookie)) {
                (None, Some(d)) if d.info.is_some() => {
                    let i = d.info.as_ref().unwrap();
                    Some(TcpReport {
                        srtt_us: i.srtt_us,
                        cwnd_segments: i.snd_cwnd,
                        notsent_bytes: i.notsent_bytes,
                        notsent_max_bytes: s.notsent_max.max(i.notsent_bytes),
                        unacked_segments: i.unacked,
                        total_retrans: i.total_retrans,
                        recv_queue_bytes: d.recv_queue,
                        delivery_rate_bytes_per_s: Some(i.delivery_rate),
                        source: "sock_diag".into(),
                    })
                }
                _ => s
                    .tcp
                    .as_ref()
                    .map(|t| TcpReport::from_snapshot(t, s.notsent_max, "kernel_hooks")),
            };
            if let Some(r) = rep {
                tcp.insert(s.cookie, r);
            }
        }
        let counters = [0u64; counter::COUNT as usize];
        let mut rep = report::build(
            &self.model,
            report::RunInfo {
                started_ns: self.clock.monotonic_ns,
                end_ns: now_ns,
                clock: self.clock,
                hook_set: &self.cap.hook_set,
                counters: &counters,
                degraded: &self.cap.degraded,
                pids: self
                    .pids
                    .iter()
                    .map(|&pid| PidReport {
                        pid,
                        comm: sockdiag::comm(pid).unwrap_or_default(),
                    })
                    .collect(),
                tcp_final: &tcp,
                chains: &self.chains,
            },
        );
        for c in rep.channels.iter_mut() {
            if let Some(ch) = self.chains.iter().find(|ch| ch.server == c.cookie) {
                c.in_flight_relay_now = ch.samples.last().and_then(|s| s.relay_visible);
            }
            c.in_flight_histogram = self.hist.get(&c.cookie).cloned();
        }
        *self.reported_closed.borrow_mut() = self
            .model
            .sockets
            .values()
            .filter(|s| s.closed_ns.is_some())
            .map(|s| s.cookie)
            .collect();
        rep
    }

    pub fn release_reported(&mut self) {
        let closed = std::mem::take(&mut *self.reported_closed.borrow_mut());
        for c in closed {
            self.model.sockets.remove(&c);
            self.hist.remove(&c);
        }
        let live: HashSet<u64> = self.model.sockets.keys().copied().collect();
        self.chains.retain(|c| live.contains(&c.server));
        if self.model.processes.len() > 1000 {
            self.model.processes.drain(..500);
        }
    }

    pub fn hook_set(&self) -> &str {
        &self.cap.hook_set
    }

    pub fn degraded(&self) -> &[String] {
        &self.cap.degraded
    }

    pub fn counters(&mut self) -> Result<[u64; counter::COUNT as usize]> {
        self.cap.counters()
    }

    pub fn program_stats(&self) -> Vec<ProgramStats> {
        Vec::new()
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            sockets: self.model.sockets.len(),
            chains: self.chains.len(),
            processes: self.pids.len(),
            records: self.model.records,
            decode_errors: self.decode_errors,
        }
    }

    pub fn started(&self) -> ClockReport {
        self.clock
    }
}
