//! Statistics of spice-server's ACK window, derived from the kernel's exact window state.
//!
//! The kernel runs spice-server's window rule (`spice_ebpf_common::window`, explained with
//! sources in `docs/spice-protocol.md` §3) on every framed message of a socket, keeps the state
//! in the socket map `SOCKETS` (`SockState::window`) and puts its post-state in each message
//! record: the in-flight count ([`MessageEvent::win_count`]), spice-server's `messages_window`
//! ([`MessageEvent::win_mw`]) and the [`effect`] bits saying what the message did. The agent
//! does not replay the rule: [`AckWindow`] takes the count from each record, the counters from
//! the effect bits (and from the record's kind where no bit exists: ACK_SYNCs, server messages
//! after the first SET_ACK), W and the generation from the SET_ACK record's body prefix, and
//! adds what the kernel does not keep: time. Records arrive in the order the kernel applied
//! them (the two directions of a connection are served by one thread, and the ring serialises
//! reservations), so the count between two records is the first one's post-state.
//!
//! Two counts, because spice-server's `messages_window` is a `uint32_t` (§3.5):
//! * [`AckWindow::messages_window`] is spice-server's value exactly, with its unsigned
//!   wrap-around. It decides whether the server is waiting for an ACK, as in
//!   `waiting_for_ack()`.
//! * [`AckWindow::count`] is the in-flight count reported: messages started and not yet covered
//!   by an ACK, never below 0. The two are equal unless a surplus ACK arrived (one that found
//!   fewer than W messages in flight): the kernel counts those ([`effect::ACK_SURPLUS`]), keeps
//!   `messages_window` wrapped, and spice-server's wait shows as stalled time.
//!
//! Every SET_ACK opens a new generation (spice-server resets `messages_window` in
//! `send_set_ack`). The time-weighted statistics (histogram, maximum, stalled time, stalls) are
//! those of the current generation; [`AckWindow::generations`] says how many there were. The
//! state is bounded: the histogram holds at most [`HISTOGRAM_MAX`] + 1 values, whatever the run
//! length.
//!
//! A restarted agent continues from the kernel's state with [`AckWindow::resume_from`]: the
//! counters continue exactly, the time statistics start again at the resume. After lost
//! records, a read of the kernel's state that differs continues the counters from it
//! ([`AckWindow::resync`]).

use spice_ebpf_common::{
    event::MessageEvent,
    framing::Role,
    protocol::msg_client,
    window::{WindowState, effect, state_flag},
};

/// Highest count the time histogram keeps apart; longer stays above it are added to this value.
/// spice-server's count never exceeds 2W+2 (82 with W = 40, `WIDE_CLIENT_ACK_WINDOW`), so only
/// a peer that ignores the window reaches it.
pub const HISTOGRAM_MAX: u32 = 4096;

/// Window state and statistics of one display or cursor connection, derived from the kernel's
/// post-message window state in each record.
#[derive(Clone, Debug, Default)]
pub struct AckWindow {
    /// W from the last SET_ACK, in messages (0 before any SET_ACK).
    pub window: u32,
    /// Generation from the last SET_ACK.
    pub generation: u32,
    /// Generation from the last ACK_SYNC, if any.
    pub client_generation: Option<u32>,
    /// In flight: messages started since the last SET_ACK (the SET_ACK included) and not yet
    /// covered by a matching ACK, never below 0 (the kernel's [`WindowState::count`] after the
    /// newest record). Equals [`Self::messages_window`] unless a surplus ACK arrived in this
    /// generation.
    pub count: u32,
    /// spice-server's `messages_window` exactly (a `uint32_t`: increments and subtractions
    /// wrap around as in C), after the newest record. Decides [`Self::stalled`].
    pub messages_window: u32,
    /// SET_ACKs seen (each opens a generation).
    pub set_acks: u64,
    pub ack_syncs: u64,
    /// ACKs that matched the generation (each subtracted W), all generations.
    pub acks: u64,
    /// ACKs dropped because no ACK_SYNC or a different generation preceded them.
    pub acks_ignored: u64,
    /// Matched ACKs that found fewer than W messages in flight (the count would have gone below
    /// 0). On the first of them spice-server's unsigned `messages_window` wraps around and the
    /// connection waits for an ACK for good. A well-behaved client never sends one.
    pub ack_surplus: u64,
    /// Server → client messages counted after the first SET_ACK (SET_ACKs not included).
    pub messages_after_set_ack: u64,
    /// Message starts while spice-server was waiting for an ACK that an urgent pair does not
    /// explain: spice-server never does this, so a non-zero value means the rule is wrong
    /// (or the server is not spice-server). All generations.
    pub starts_while_stalled: u64,
    /// Starts at 2W+1 right after an urgent INVAL_LIST / LIST on a display connection
    /// (allowed: peak 2W+2). All generations.
    pub urgent_pair_peaks: u64,
    /// Highest in-flight count reached in the current generation.
    pub max: u32,
    /// Transitions from not waiting to waiting for an ACK (`messages_window` going above 2W)
    /// in the current generation.
    pub stalls: u64,
    /// CLOCK_MONOTONIC ns when the current stall began (the record's `ts_ns`, or the kernel's
    /// [`WindowState::stall_began_ns`] after [`Self::resume_from`]); `None` while not stalled.
    pub stall_began_ns: Option<u64>,
    /// CLOCK_MONOTONIC ns of the current generation's SET_ACK.
    pub generation_began_ns: Option<u64>,
    /// Nanoseconds spent at each in-flight count (clamped to [`HISTOGRAM_MAX`]) in the current
    /// generation.
    time_at: TimeAt,
    /// Nanoseconds spent waiting for an ACK in the current generation.
    stalled_ns: u64,
    /// Start of the current generation's time accounting (its SET_ACK, or the resume), and the
    /// timestamp of the last record.
    since_ns: Option<u64>,
    last_ns: u64,
    /// Nanoseconds spent at each in-flight count (clamped to [`HISTOGRAM_MAX`]) over every
    /// generation: the source of [`WindowStats::histogram`].
    time_at_total: TimeAt,
    /// ∫ count dt over every generation, message·nanoseconds (exact, not clamped).
    count_ns_total: u128,
    /// Nanoseconds spent waiting for an ACK, every generation.
    stalled_ns_total: u64,
    /// Transitions into waiting for an ACK, every generation.
    stalls_total: u64,
}

/// The window's time accounting up to an instant, computed by [`AckWindow::stats_at`] without
/// changing the window: the interval since the last event is added as if an event came then.
#[derive(Clone, Debug, PartialEq)]
pub struct WindowStats {
    /// Nanoseconds observed since the current generation's SET_ACK.
    pub observed_ns: u64,
    /// Share of `observed_ns` spent waiting for an ACK (0 when nothing was observed).
    pub stalled_fraction: f64,
    /// Time-weighted median in-flight count of the current generation (values above
    /// [`HISTOGRAM_MAX`] read as [`HISTOGRAM_MAX`]; the current count if no time passed).
    pub p50: u32,
    /// Seconds spent waiting for an ACK, every generation (a counter: never decreases).
    pub stalled_seconds_total: f64,
    /// Time-weighted histogram of the in-flight count over every generation.
    pub histogram: InFlightHistogram,
}

/// Time-weighted histogram of the in-flight count, in the form of a Prometheus histogram
/// whose observations are seconds: `seconds[i]` is the time spent with the count ≤ `le[i]`
/// (cumulative), `count` all time observed (the implicit `+Inf` bucket), `sum` ∫ count dt.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct InFlightHistogram {
    /// Upper bounds, messages: 0, W/4, W/2, W, 3W/2, 2W, 2W+1, 2W+2 (W of the current
    /// generation; deduplicated, ascending).
    pub le: Vec<u32>,
    /// Seconds with the count ≤ `le[i]`, cumulative; same length as `le`.
    pub seconds: Vec<f64>,
    /// ∫ count dt, message·seconds (mean count = sum / count).
    pub sum: f64,
    /// Seconds observed (all generations, from the first SET_ACK).
    pub count: f64,
}

/// Bucket bounds of [`InFlightHistogram`] for window `w`.
pub fn histogram_bounds(w: u32) -> Vec<u32> {
    let mut le = vec![
        0,
        w / 4,
        w / 2,
        w,
        w.saturating_mul(3) / 2,
        w.saturating_mul(2),
        w.saturating_mul(2).saturating_add(1),
        w.saturating_mul(2).saturating_add(2),
    ];
    le.sort_unstable();
    le.dedup();
    le
}

impl AckWindow {
    /// A window that continues from the kernel's state `k` at `now_ns` (CLOCK_MONOTONIC): for
    /// an agent that started while the connection was open and found its `SOCKETS` entry
    /// (pinned maps after a restart). Every counter, W, the generations, the count and the
    /// current generation's maximum and stalls continue exactly; the time statistics
    /// (histogram, stalled time, observed time) start at `now_ns`, and
    /// [`Self::stall_began_ns`] is the kernel's if it is stalled. Records the kernel wrote
    /// before `k` was read must not be applied on top (skip messages whose `index` is at or
    /// below the direction's `DirState::msg_count` read with `k`).
    pub fn resume_from(k: &WindowState, now_ns: u64) -> Self {
        let active = k.active();
        AckWindow {
            window: k.window,
            generation: k.generation,
            client_generation: (k.flags & state_flag::CLIENT_GENERATION != 0)
                .then_some(k.client_generation),
            count: k.count,
            messages_window: k.messages_window,
            set_acks: k.set_acks,
            ack_syncs: k.ack_syncs,
            acks: k.acks,
            acks_ignored: k.acks_ignored,
            ack_surplus: k.ack_surplus,
            messages_after_set_ack: k.messages_after_set_ack,
            starts_while_stalled: k.starts_while_stalled,
            urgent_pair_peaks: k.urgent_pair_peaks,
            max: k.max,
            stalls: u64::from(k.stalls),
            stall_began_ns: k.stalled().then_some(k.stall_began_ns),
            generation_began_ns: active.then_some(k.generation_began_ns),
            since_ns: active.then_some(now_ns),
            last_ns: now_ns,
            stalls_total: k.stalls_total,
            ..Default::default()
        }
    }

    /// Continues from the kernel's state `k`, read at `read_ns`, after records were lost: `k`
    /// is the state the records applied so far should have given ([`crate::model::KernelCheck`]
    /// compares only then), and they differed. W, the generations, the count,
    /// `messages_window`, every counter, the current generation's maximum and stalls, and the
    /// stall start ([`WindowState::stall_began_ns`]) are taken from `k`; the time statistics
    /// stay derived from the records (the lost ones' intervals are charged to the count the
    /// records showed). If a SET_ACK was lost (the kernel counted more), the current
    /// generation's time statistics start again at its SET_ACK or the newest record,
    /// whichever is later.
    pub fn resync(&mut self, k: &WindowState, read_ns: u64) {
        let new_generation = k.active() && (!self.active() || k.set_acks != self.set_acks);
        if new_generation {
            let since = k
                .generation_began_ns
                .clamp(self.last_ns, read_ns.max(self.last_ns));
            self.since_ns = Some(since);
            self.last_ns = since;
            self.time_at.clear();
            self.stalled_ns = 0;
        }
        self.window = k.window;
        self.generation = k.generation;
        self.client_generation =
            (k.flags & state_flag::CLIENT_GENERATION != 0).then_some(k.client_generation);
        self.count = k.count;
        self.messages_window = k.messages_window;
        self.set_acks = k.set_acks;
        self.ack_syncs = k.ack_syncs;
        self.acks = k.acks;
        self.acks_ignored = k.acks_ignored;
        self.ack_surplus = k.ack_surplus;
        self.messages_after_set_ack = k.messages_after_set_ack;
        self.starts_while_stalled = k.starts_while_stalled;
        self.urgent_pair_peaks = k.urgent_pair_peaks;
        self.max = k.max;
        self.stalls = u64::from(k.stalls);
        self.stalls_total = k.stalls_total;
        self.stall_began_ns = k.stalled().then_some(k.stall_began_ns);
        self.generation_began_ns = k.active().then_some(k.generation_began_ns);
    }

    /// Whether a SET_ACK has been seen (only then are the other fields meaningful).
    pub fn active(&self) -> bool {
        self.since_ns.is_some()
    }

    /// SET_ACKs seen, i.e. generations this connection had (the statistics are the last
    /// one's). spice-server 0.14 and 0.15 send one SET_ACK per connection (§3.5).
    pub fn generations(&self) -> u64 {
        self.set_acks
    }

    /// The stall threshold 2W, computed as spice-server does (`client_window * 2` in
    /// `uint32_t`): the server starts a message only while `messages_window` ≤ 2W.
    pub fn threshold(&self) -> u32 {
        self.window.wrapping_mul(2)
    }

    /// The most messages a gated start can leave in flight, 2W+1 (`in_flight_limit`).
    pub fn limit(&self) -> u32 {
        self.threshold().saturating_add(1)
    }

    /// Whether spice-server is waiting for an ACK: `waiting_for_ack()`, i.e.
    /// `messages_window > client_window * 2` in unsigned 32-bit arithmetic, once a SET_ACK
    /// was seen ([`WindowState::stalled`]).
    pub fn stalled(&self) -> bool {
        self.active() && self.messages_window > self.threshold()
    }

    fn advance(&mut self, now_ns: u64) {
        if self.since_ns.is_some() && now_ns > self.last_ns {
            let dt = now_ns - self.last_ns;
            let key = self.count.min(HISTOGRAM_MAX);
            self.time_at.add(key, dt);
            self.time_at_total.add(key, dt);
            self.count_ns_total += u128::from(self.count) * u128::from(dt);
            if self.stalled() {
                self.stalled_ns += dt;
                self.stalled_ns_total += dt;
            }
        }
        if now_ns > self.last_ns {
            self.last_ns = now_ns;
        }
    }

    /// Applies one message record of a direction with SPICE role `role` (of this socket,
    /// either direction, in ring order): the interval since the previous record is charged to
    /// the previous count, then the record's post-state and effect bits are taken.
    pub fn record(&mut self, role: Role, m: &MessageEvent) {
        let now_ns = m.hdr.ts_ns;
        self.advance(now_ns);
        let fx = m.win_effects;
        match role {
            Role::ServerToClient if fx & effect::NEW_GENERATION != 0 => {
                self.set_acks += 1;
                self.generation = m.prefix[0];
                self.window = m.prefix[1];
                // A new generation: its statistics start here.
                self.since_ns = Some(now_ns);
                self.generation_began_ns = Some(now_ns);
                self.last_ns = now_ns;
                self.time_at.clear();
                self.stalled_ns = 0;
                self.stalls = 0;
                self.max = 0;
            }
            Role::ServerToClient if self.active() => self.messages_after_set_ack += 1,
            Role::ClientToServer if m.msg_type == msg_client::ACK_SYNC => {
                self.ack_syncs += 1;
                self.client_generation = Some(m.prefix[0]);
            }
            _ => {}
        }
        let counters = [
            (effect::ACK_APPLIED, &mut self.acks),
            (effect::ACK_IGNORED, &mut self.acks_ignored),
            (effect::ACK_SURPLUS, &mut self.ack_surplus),
            (
                effect::STARTED_WHILE_STALLED,
                &mut self.starts_while_stalled,
            ),
            (effect::URGENT_PEAK, &mut self.urgent_pair_peaks),
            (effect::STALL_BEGAN, &mut self.stalls),
            (effect::STALL_BEGAN, &mut self.stalls_total),
        ];
        for (bit, n) in counters {
            if fx & bit != 0 {
                *n += 1;
            }
        }
        if fx & effect::STALL_ENDED != 0 {
            self.stall_began_ns = None;
        }
        if fx & effect::STALL_BEGAN != 0 {
            self.stall_began_ns = Some(now_ns);
        }
        self.count = m.win_count;
        self.messages_window = m.win_mw;
        if self.active() {
            self.max = self.max.max(self.count);
        }
    }

    /// Fields in which this window differs from the kernel's state `k` (read when exactly the
    /// records applied here had been applied in the kernel), by name; empty when they agree.
    /// Compares the count, `messages_window`, W, the generations and every counter.
    pub fn differences(&self, k: &WindowState) -> Vec<&'static str> {
        let kc = (k.flags & state_flag::CLIENT_GENERATION != 0).then_some(k.client_generation);
        let checks = [
            ("active", self.active() == k.active()),
            ("count", self.count == k.count),
            ("messages_window", self.messages_window == k.messages_window),
            ("window", self.window == k.window),
            ("generation", self.generation == k.generation),
            ("client_generation", self.client_generation == kc),
            ("set_acks", self.set_acks == k.set_acks),
            ("ack_syncs", self.ack_syncs == k.ack_syncs),
            ("acks", self.acks == k.acks),
            ("acks_ignored", self.acks_ignored == k.acks_ignored),
            ("ack_surplus", self.ack_surplus == k.ack_surplus),
            (
                "messages_after_set_ack",
                self.messages_after_set_ack == k.messages_after_set_ack,
            ),
            (
                "starts_while_stalled",
                self.starts_while_stalled == k.starts_while_stalled,
            ),
            (
                "urgent_pair_peaks",
                self.urgent_pair_peaks == k.urgent_pair_peaks,
            ),
            ("max", self.max == k.max),
            ("stalls", self.stalls as u32 == k.stalls),
            ("stalls_total", self.stalls_total == k.stalls_total),
            (
                "stall_began_ns",
                self.stall_began_ns == k.stalled().then_some(k.stall_began_ns),
            ),
        ];
        checks
            .into_iter()
            .filter(|(_, ok)| !ok)
            .map(|(name, _)| name)
            .collect()
    }

    /// Closes the time accounting at `now_ns` (socket close: no event can follow).
    pub fn finish(&mut self, now_ns: u64) {
        self.advance(now_ns);
    }

    /// Times spice-server began waiting for an ACK, every generation (a counter).
    pub fn stalls_total(&self) -> u64 {
        self.stalls_total
    }

    /// The time accounting up to `now_ns`, without changing the window: the interval from the
    /// last event to `now_ns` is charged to the current count and stall state virtually, so
    /// two calls with the same `now_ns` give the same result and a record applied later
    /// (even one timestamped before `now_ns`) is charged where it belongs. A `now_ns` before
    /// the last event adds nothing.
    pub fn stats_at(&self, now_ns: u64) -> WindowStats {
        let extra = if self.since_ns.is_some() {
            now_ns.saturating_sub(self.last_ns)
        } else {
            0
        };
        let key = self.count.min(HISTOGRAM_MAX);
        let stalled_extra = if self.stalled() { extra } else { 0 };
        let observed_ns = self.observed_ns() + extra;
        let stalled_ns = self.stalled_ns + stalled_extra;
        let stalled_fraction = if observed_ns == 0 {
            0.0
        } else {
            stalled_ns as f64 / observed_ns as f64
        };
        let p50 = quantile_of(&self.time_at, key, extra, 0.5).unwrap_or(self.count);
        let le = histogram_bounds(self.window);
        let total_ns: u64 = self.time_at_total.total() + extra;
        let seconds = le
            .iter()
            .map(|&b| {
                let at_or_below: u64 =
                    self.time_at_total.at_or_below(b) + if key <= b { extra } else { 0 };
                at_or_below as f64 / 1e9
            })
            .collect();
        let sum = (self.count_ns_total + u128::from(self.count) * u128::from(extra)) as f64 / 1e9;
        WindowStats {
            observed_ns,
            stalled_fraction,
            p50,
            stalled_seconds_total: (self.stalled_ns_total + stalled_extra) as f64 / 1e9,
            histogram: InFlightHistogram {
                le,
                seconds,
                sum,
                count: total_ns as f64 / 1e9,
            },
        }
    }

    /// Nanoseconds observed since the current generation's SET_ACK (up to the last event or
    /// `finish`).
    pub fn observed_ns(&self) -> u64 {
        self.since_ns.map_or(0, |s| self.last_ns.saturating_sub(s))
    }

    /// Fraction of the current generation's observed time spent waiting for an ACK (0 when
    /// nothing was observed).
    pub fn stalled_fraction(&self) -> f64 {
        let total = self.observed_ns();
        if total == 0 {
            0.0
        } else {
            self.stalled_ns as f64 / total as f64
        }
    }

    /// Time-weighted quantile `q` (0..=1) of the in-flight count in the current generation
    /// (values above [`HISTOGRAM_MAX`] read as [`HISTOGRAM_MAX`]); the current count if no time
    /// passed.
    pub fn quantile(&self, q: f64) -> u32 {
        quantile_of(&self.time_at, 0, 0, q).unwrap_or(self.count)
    }

    /// Distinct in-flight values in the current generation's histogram (at most
    /// [`HISTOGRAM_MAX`] + 1).
    pub fn histogram_len(&self) -> usize {
        self.time_at.len()
    }
}

/// Nanoseconds spent at each in-flight count, indexed by the count (clamped to
/// [`HISTOGRAM_MAX`] by the caller): one indexed add per record, where an ordered map took a
/// tree search. Grown to the highest count seen, so at most [`HISTOGRAM_MAX`] + 1 slots
/// (spice-server's counts stay within 2W+2: 83 slots for W = 40).
#[derive(Clone, Debug, Default)]
struct TimeAt(Vec<u64>);

impl TimeAt {
    fn add(&mut self, key: u32, dt: u64) {
        let k = key as usize;
        if k >= self.0.len() {
            self.0.resize(k + 1, 0);
        }
        self.0[k] += dt;
    }

    fn clear(&mut self) {
        self.0.clear();
    }

    /// (count, ns) of every count with time, ascending.
    fn iter(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.0
            .iter()
            .enumerate()
            .filter(|(_, t)| **t > 0)
            .map(|(v, t)| (v as u32, *t))
    }

    fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// Time at counts ≤ `b`.
    fn at_or_below(&self, b: u32) -> u64 {
        let n = (b as usize).saturating_add(1).min(self.0.len());
        self.0[..n].iter().sum()
    }

    /// Counts with time.
    fn len(&self) -> usize {
        self.0.iter().filter(|t| **t > 0).count()
    }
}

/// Time-weighted quantile `q` of `hist` with `extra` ns added at value `key`; `None` if no
/// time at all.
fn quantile_of(hist: &TimeAt, key: u32, extra: u64, q: f64) -> Option<u32> {
    let total: u64 = hist.total() + extra;
    if total == 0 {
        return None;
    }
    let target = (q * total as f64).ceil().max(1.0) as u64;
    let mut acc = 0u64;
    let mut extra_left = extra;
    for (v, t) in hist.iter() {
        if extra_left > 0 && key < v {
            acc += extra_left;
            extra_left = 0;
            if acc >= target {
                return Some(key);
            }
        }
        acc += t + if v == key {
            std::mem::take(&mut extra_left)
        } else {
            0
        };
        if acc >= target {
            return Some(v);
        }
    }
    if extra_left > 0 {
        return Some(key);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use spice_ebpf_common::{
        event::EventHeader,
        protocol::{
            channel,
            msg_server::{DISPLAY_INVAL_LIST, SET_ACK},
        },
    };

    const DRAW: u16 = 302;

    /// One connection as the kernel and the agent see it: the shared rule (the kernel's
    /// [`WindowState`]) applied to each message, its post-state put in a record as
    /// `capture.rs` does, the record given to an [`AckWindow`]. After every record the
    /// derived window must agree with the kernel's state.
    struct Conn {
        kernel: WindowState,
        w: AckWindow,
        channel_type: u8,
    }

    impl Conn {
        fn new(channel_type: u8) -> Self {
            Conn {
                kernel: WindowState::default(),
                w: AckWindow::default(),
                channel_type,
            }
        }

        /// SET_ACK(1, w) at t=0, ACK_SYNC(1) at t=1.
        fn started(w: u32) -> Self {
            let mut c = Conn::new(channel::DISPLAY);
            c.server(0, SET_ACK, [1, w]);
            c.ack_sync(1, 1);
            c
        }

        fn message(&mut self, role: Role, t: u64, msg_type: u16, prefix: [u32; 2]) -> MessageEvent {
            let fx = self
                .kernel
                .apply(role as u8, t, self.channel_type, msg_type, prefix);
            MessageEvent {
                hdr: EventHeader {
                    ts_ns: t,
                    ..Default::default()
                },
                msg_type,
                prefix,
                win_mw: self.kernel.messages_window,
                win_count: self.kernel.count,
                win_effects: fx,
                ..Default::default()
            }
        }

        fn apply(&mut self, role: Role, t: u64, msg_type: u16, prefix: [u32; 2]) {
            let m = self.message(role, t, msg_type, prefix);
            self.w.record(role, &m);
            let d = self.w.differences(&self.kernel);
            assert!(d.is_empty(), "{d:?}: {:?} vs {:?}", self.w, self.kernel);
        }

        fn server(&mut self, t: u64, msg_type: u16, prefix: [u32; 2]) {
            self.apply(Role::ServerToClient, t, msg_type, prefix);
        }

        fn draw(&mut self, t: u64) {
            self.server(t, DRAW, [0, 0]);
        }

        fn ack_sync(&mut self, t: u64, generation: u32) {
            self.apply(
                Role::ClientToServer,
                t,
                msg_client::ACK_SYNC,
                [generation, 0],
            );
        }

        fn ack(&mut self, t: u64) {
            self.apply(Role::ClientToServer, t, msg_client::ACK, [0, 0]);
        }
    }

    #[test]
    fn counters_come_from_the_kernels_effect_bits() {
        let mut c = Conn::started(2);
        // An ACK_SYNC of another generation, an ignored ACK, then the right one.
        c.ack_sync(2, 7);
        c.ack(3);
        c.ack_sync(4, 1);
        for i in 0..4u64 {
            c.draw(10 + i); // 5 = 2W+1 at t=13: stall
        }
        c.draw(20); // beyond the gate
        c.ack(30); // 6 - 2 = 4: stall over
        // Client messages other than ACK_SYNC / ACK change nothing.
        c.apply(Role::ClientToServer, 31, 3, [0, 0]);
        let w = &c.w;
        assert_eq!(
            (
                w.set_acks,
                w.ack_syncs,
                w.acks,
                w.acks_ignored,
                w.ack_surplus
            ),
            (1, 3, 1, 1, 0)
        );
        assert_eq!(
            (w.messages_after_set_ack, w.starts_while_stalled, w.max),
            (5, 1, 6)
        );
        assert_eq!(
            (w.count, w.stalls, w.stalls_total(), w.stall_began_ns),
            (4, 1, 1, None)
        );
        assert_eq!(w.client_generation, Some(1));
    }

    #[test]
    fn stall_at_2w_plus_1_and_time_fractions() {
        let mut c = Conn::started(20);
        for i in 0..40u64 {
            c.draw(2 + i);
        }
        let a = &mut c.w;
        assert_eq!(a.count, 41);
        assert!(a.stalled());
        assert_eq!((a.stalls, a.stall_began_ns), (1, Some(41)));
        a.finish(1042);
        // The 40th draw (count 41) starts at t=41: stalled 1001 ns of 1042.
        assert!((a.stalled_fraction() - 1001.0 / 1042.0).abs() < 1e-9);
        assert_eq!(a.quantile(0.5), 41);
        assert_eq!(a.max, 41);
        assert_eq!(a.starts_while_stalled, 0);
        c.draw(2000);
        assert_eq!(c.w.starts_while_stalled, 1);
    }

    #[test]
    fn surplus_ack_keeps_the_server_stalled_with_nothing_in_flight() {
        let mut c = Conn::started(20);
        for i in 0..5u64 {
            c.draw(2 + i);
        }
        c.ack(100);
        let a = &mut c.w;
        // spice-server: messages_window (uint32_t) = 6 - 20 wraps; waiting_for_ack() is then
        // true for good. In flight: nothing.
        assert_eq!((a.ack_surplus, a.count), (1, 0));
        assert_eq!(a.messages_window, 6u32.wrapping_sub(20));
        assert!(a.stalled());
        assert_eq!(a.stalls, 1);
        a.finish(200);
        assert!((a.stalled_fraction() - 100.0 / 200.0).abs() < 1e-9);
        assert_eq!(a.quantile(0.5), 0);
        // The next SET_ACK ends the stall and resets both counts.
        c.server(500, SET_ACK, [2, 20]);
        assert_eq!((c.w.count, c.w.messages_window, c.w.ack_surplus), (1, 1, 1));
        assert!(!c.w.stalled() && c.w.stall_began_ns.is_none());
    }

    #[test]
    fn second_set_ack_starts_a_new_generation() {
        let mut c = Conn::started(10);
        // Generation 1: up to 21 (2W+1), 10 ns there.
        for i in 0..20u64 {
            c.draw(2 + i);
        }
        assert_eq!((c.w.max, c.w.stalls), (21, 1));
        c.ack(31); // 11
        c.server(100, SET_ACK, [2, 3]);
        let a = &c.w;
        assert_eq!(a.generations(), 2);
        assert_eq!(
            (a.generation, a.window, a.count, a.max, a.stalls),
            (2, 3, 1, 1, 0)
        );
        assert_eq!((a.observed_ns(), a.generation_began_ns), (0, Some(100)));
        // The client's ACK for generation 1 arrives late: ignored.
        c.ack(101);
        assert_eq!((c.w.acks, c.w.acks_ignored, c.w.count), (1, 1, 1));
        c.ack_sync(102, 2);
        for i in 0..6u64 {
            c.draw(110 + i);
        }
        assert_eq!((c.w.count, c.w.max, c.w.stalls), (7, 7, 1));
        c.ack(200); // 4, from t=200
        let a = &mut c.w;
        a.finish(300);
        // Generation 2 only: 200 ns observed; stalled from t=115 to t=200.
        assert_eq!(a.observed_ns(), 200);
        assert!((a.stalled_fraction() - 85.0 / 200.0).abs() < 1e-9);
        assert_eq!(a.quantile(0.5), 4);
        assert!(a.histogram_len() <= 8);
        assert_eq!(a.limit(), 7);
        assert_eq!(a.stalls_total(), 2);
    }

    #[test]
    fn urgent_pair_peak_is_counted_from_its_bit() {
        let mut c = Conn::started(2);
        for i in 0..3u64 {
            c.draw(2 + i);
        }
        c.server(10, DISPLAY_INVAL_LIST, [0, 0]); // 5 = 2W+1
        c.draw(11); // 6 = 2W+2, the urgent pair's second
        assert_eq!(
            (
                c.w.count,
                c.w.max,
                c.w.urgent_pair_peaks,
                c.w.starts_while_stalled
            ),
            (6, 6, 1, 0)
        );
    }

    #[test]
    fn resume_continues_the_counters_exactly_and_restarts_time() {
        // One connection observed throughout, and the same connection's kernel state picked up
        // by a new agent in the middle of a stall.
        let mut whole = Conn::started(2);
        let script = |c: &mut Conn, from: u64, to: u64| {
            for i in from..to {
                match i % 7 {
                    6 => c.ack(100 * i),
                    _ => c.draw(100 * i),
                }
            }
        };
        script(&mut whole, 1, 12);
        assert!(whole.w.stalled(), "{:?}", whole.w);
        let stall_began = whole.kernel.stall_began_ns;
        let mut resumed = Conn {
            kernel: whole.kernel,
            w: AckWindow::resume_from(&whole.kernel, 1250),
            channel_type: channel::DISPLAY,
        };
        assert!(resumed.w.differences(&resumed.kernel).is_empty());
        assert_eq!(resumed.w.stall_began_ns, Some(stall_began));
        script(&mut whole, 12, 40);
        script(&mut resumed, 12, 40);
        let (a, b) = (&whole.w, &resumed.w);
        assert!(b.differences(&whole.kernel).is_empty());
        assert_eq!(
            (
                a.count,
                a.acks,
                a.set_acks,
                a.messages_after_set_ack,
                a.stalls_total()
            ),
            (
                b.count,
                b.acks,
                b.set_acks,
                b.messages_after_set_ack,
                b.stalls_total()
            )
        );
        // Time: the resumed window observed from 1250 on only.
        assert_eq!(a.observed_ns(), 3900);
        assert_eq!(b.observed_ns(), 3900 - 1250);
        // An inactive state resumes inactive.
        let idle = AckWindow::resume_from(&WindowState::default(), 5);
        assert!(!idle.active() && idle.differences(&WindowState::default()).is_empty());
    }

    #[test]
    fn a_lost_record_shows_as_a_difference() {
        let mut c = Conn::started(20);
        c.draw(2);
        // The kernel applies a draw whose record never reaches the agent (ring full).
        let _lost = c.message(Role::ServerToClient, 3, DRAW, [0, 0]);
        assert_eq!(
            c.w.differences(&c.kernel),
            ["count", "messages_window", "messages_after_set_ack", "max"]
        );
    }

    #[test]
    fn state_stays_bounded_whatever_the_run_length() {
        // A peer that ignores the window (no ACKs at all): the count climbs without end, the
        // histogram does not.
        let mut c = Conn::started(20);
        for i in 0..20_000u64 {
            c.draw(2 + i);
        }
        c.w.finish(1_000_000);
        assert_eq!(c.w.count, 20_001);
        assert!(c.w.histogram_len() <= HISTOGRAM_MAX as usize + 1);
        assert_eq!(c.w.quantile(0.5), HISTOGRAM_MAX);
        // Many generations: only the current one's histogram is kept.
        let mut c = Conn::started(2);
        for g in 0..10_000u64 {
            let t = 10 + g * 10;
            c.server(t, SET_ACK, [g as u32 + 2, 2]);
            c.draw(t + 1);
        }
        assert_eq!(c.w.generations(), 10_001);
        assert!(c.w.histogram_len() <= 2);
    }

    #[test]
    fn quantile_is_time_weighted() {
        let mut c = Conn::started(20);
        c.draw(10); // count 2 from t=10
        c.w.finish(1000); // count 1 for 10 ns, 2 for 990 ns
        assert_eq!(c.w.quantile(0.5), 2);
        assert_eq!(c.w.quantile(0.005), 1);
    }

    #[test]
    fn stats_at_is_pure_and_adds_the_open_interval() {
        let mut c = Conn::started(2);
        for i in 0..4u64 {
            c.draw(10 + i); // count 5 = 2W+1 from t=13: stalled
        }
        let a = &c.w;
        let before = a.clone();
        let s1 = a.stats_at(1013);
        let s2 = a.stats_at(1013);
        assert_eq!(s1, s2);
        // Nothing changed: the window is as before, and a later finish gives the same figures.
        assert_eq!(format!("{a:?}"), format!("{before:?}"));
        let mut f = a.clone();
        f.finish(1013);
        assert_eq!(f.stats_at(1013), s1);
        assert_eq!(f.stalled_fraction(), s1.stalled_fraction);
        assert_eq!(f.quantile(0.5), s1.p50);
        // 1013 ns observed, stalled from 13 to 1013.
        assert_eq!(s1.observed_ns, 1013);
        assert!((s1.stalled_seconds_total - 1000e-9).abs() < 1e-15);
        assert_eq!(s1.p50, 5);
        // A record timestamped before the snapshot's instant, applied after it, is charged
        // where it belongs: an ACK at t=513 (count 3 from then on).
        c.ack(513);
        let s3 = c.w.stats_at(1013);
        assert_eq!(s3.observed_ns, 1013);
        assert!((s3.stalled_seconds_total - 500e-9).abs() < 1e-15);
        assert_eq!(s3.p50, 3);
        // A now before the last event adds nothing.
        assert_eq!(c.w.stats_at(0).observed_ns, c.w.observed_ns());
    }

    #[test]
    fn histogram_is_time_weighted_cumulative_over_all_generations() {
        assert_eq!(histogram_bounds(40), vec![0, 10, 20, 40, 60, 80, 81, 82]);
        assert_eq!(histogram_bounds(1), vec![0, 1, 2, 3, 4]);
        assert_eq!(histogram_bounds(0), vec![0, 1, 2]);
        let mut c = Conn::new(channel::DISPLAY);
        c.server(0, SET_ACK, [1, 4]); // count 1 from t=0
        c.draw(100); // 2 from t=100
        for i in 0..7u64 {
            c.draw(200 + i); // 9 = 2W+1 from t=206
        }
        c.ack_sync(1000, 1);
        c.ack(1206); // 5 from t=1206
        // Generation 2: the counts start again; the histogram keeps both generations.
        c.server(2206, SET_ACK, [2, 4]); // 1 from t=2206
        let a = &c.w;
        let h = a.stats_at(3206).histogram;
        assert_eq!(h.le, vec![0, 1, 2, 4, 6, 8, 9, 10]);
        let ns = |v: f64| (v * 1e9).round() as u64;
        // ≤0: none; ≤1: 100 + 1000 (gen 2); ≤2: +100; ... 3,4 for 1 ns each (t=200..206: 3..8)
        assert_eq!(ns(h.seconds[0]), 0);
        assert_eq!(ns(h.seconds[1]), 1100);
        assert_eq!(ns(h.seconds[2]), 1200);
        assert_eq!(ns(h.seconds[3]), 1202); // 3 (t=200..201), 4 (201..202)
        assert_eq!(ns(h.seconds[4]), 2204); // 5 (202..203 and 1206..2206), 6
        assert_eq!(ns(h.seconds[5]), 2206); // 7, 8
        assert_eq!(ns(h.seconds[6]), 3206); // 9 for 1000 ns
        assert_eq!(ns(h.seconds[7]), 3206);
        assert_eq!(ns(h.count), 3206);
        let sum = 100 + 2 * 100 + (3 + 4 + 5 + 6 + 7 + 8) + 9 * 1000 + 5 * 1000 + 1000;
        assert!(
            (h.sum - sum as f64 / 1e9).abs() < 1e-12,
            "{} vs {sum}",
            h.sum
        );
        // Cumulative and never above count.
        assert!(h.seconds.windows(2).all(|w| w[0] <= w[1]));
        // The all-generation counters keep generation 1's stall.
        let s = a.stats_at(3206);
        assert!((s.stalled_seconds_total - 1000e-9).abs() < 1e-15);
        assert_eq!((a.stalls, a.stalls_total()), (0, 1));
    }
}
