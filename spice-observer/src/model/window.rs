//! spice-server's ACK window, replayed from the messages the kernel saw.
//!
//! The rules are spice-server's own (`server/red-channel-client.cpp`; explained with sources in
//! `docs/spice-protocol.md` §3):
//! * SET_ACK (server → client, type 3) carries (generation, window W) and sets the count to 1:
//!   the SET_ACK counts itself (`send_set_ack` zeroes `messages_window`, then
//!   `begin_send_message` adds 1).
//! * Every later server → client message adds 1 when it starts (`begin_send_message`), before
//!   its first write, even if that write fails with EAGAIN.
//! * ACK_SYNC (client → server, type 1) records the client's generation.
//! * ACK (client → server, type 2) subtracts W only if that generation equals the SET_ACK's;
//!   other ACKs are dropped silently.
//! * The server starts no new message while the count is above 2W (`waiting_for_ack`), so the
//!   count peaks at 2W+1, or 2W+2 when an urgent pair (INVAL_LIST or LIST, then the message it
//!   guards, `dcc-send.cpp` `send_free_list`) straddles the threshold. Urgent pairs exist on
//!   display connections only (§3.3): on cursor, type 105 is CURSOR_HIDE and LIST is never sent,
//!   so the exemption is keyed on the channel type.
//!
//! Two counts are kept, because spice-server's `messages_window` is a `uint32_t` (§3.5):
//! * [`AckWindow::messages_window`] is spice-server's value exactly, with its unsigned
//!   wrap-around. It decides whether the server is waiting for an ACK, as in
//!   `waiting_for_ack()`.
//! * [`AckWindow::count`] is the in-flight count reported: messages started and not yet covered
//!   by an ACK, never below 0. The two are equal unless a surplus ACK arrived (one that found
//!   fewer than W messages in flight): spice-server's unsigned subtraction then wraps
//!   `messages_window` to about 2³², which keeps it waiting for good, while nothing is in
//!   flight. The replay counts such ACKs in [`AckWindow::ack_surplus`], sets the count to 0 and
//!   keeps `messages_window` wrapped, so the stall spice-server is in shows as stalled time.
//!
//! Every SET_ACK opens a new generation (spice-server resets `messages_window` in
//! `send_set_ack`). The time-weighted statistics (histogram, maximum, stalled time, stalls) are
//! those of the current generation; [`AckWindow::generations`] says how many there were. The
//! state is bounded: the histogram holds at most [`HISTOGRAM_MAX`] + 1 values, whatever the run
//! length.

use std::collections::BTreeMap;

use spice_ebpf_common::protocol::{channel, msg_server};

/// Highest count the time histogram keeps apart; longer stays above it are added to this value.
/// spice-server's count never exceeds 2W+2 (82 with W = 40, `WIDE_CLIENT_ACK_WINDOW`), so only
/// a peer that ignores the window reaches it.
pub const HISTOGRAM_MAX: u32 = 4096;

/// Replayed window state and statistics of one display or cursor connection.
#[derive(Clone, Debug, Default)]
pub struct AckWindow {
    /// W from the last SET_ACK, in messages (0 before any SET_ACK).
    pub window: u32,
    /// Generation from the last SET_ACK.
    pub generation: u32,
    /// Generation from the last ACK_SYNC, if any.
    pub client_generation: Option<u32>,
    /// In flight: messages started since the last SET_ACK (the SET_ACK included) and not yet
    /// covered by a matching ACK, never below 0. Equals [`Self::messages_window`] unless a
    /// surplus ACK arrived in this generation.
    pub count: u32,
    /// spice-server's `messages_window` exactly (a `uint32_t`: increments and subtractions
    /// wrap around as in C). Decides [`Self::stalled`].
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
    /// explain: spice-server never does this, so a non-zero value means the replay is wrong
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
    /// Nanoseconds spent at each in-flight count (clamped to [`HISTOGRAM_MAX`]) in the current
    /// generation.
    time_at: BTreeMap<u32, u64>,
    /// Nanoseconds spent waiting for an ACK in the current generation.
    stalled_ns: u64,
    /// Timestamp of the current generation's SET_ACK, and of the last event.
    since_ns: Option<u64>,
    last_ns: u64,
    /// Type of the previous server → client message.
    last_type: u16,
    /// Nanoseconds spent at each in-flight count (clamped to [`HISTOGRAM_MAX`]) over every
    /// generation: the source of [`WindowStats::histogram`].
    time_at_total: BTreeMap<u32, u64>,
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
    /// `messages_window > client_window * 2` in unsigned 32-bit arithmetic.
    pub fn stalled(&self) -> bool {
        self.messages_window > self.threshold()
    }

    fn advance(&mut self, now_ns: u64) {
        if self.since_ns.is_some() && now_ns > self.last_ns {
            let dt = now_ns - self.last_ns;
            let key = self.count.min(HISTOGRAM_MAX);
            *self.time_at.entry(key).or_default() += dt;
            *self.time_at_total.entry(key).or_default() += dt;
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

    /// Sets both counts (`count` = in flight, `mw` = spice-server's) and the maxima.
    fn set(&mut self, count: u32, mw: u32) {
        let was_stalled = self.stalled();
        self.count = count;
        self.messages_window = mw;
        self.max = self.max.max(count);
        if !was_stalled && self.stalled() {
            self.stalls += 1;
            self.stalls_total += 1;
        }
    }

    /// A server → client message of type `msg_type` started at `now_ns` on a connection of
    /// channel type `channel_type` (from the client's link message; `None` if not known). For
    /// SET_ACK, `prefix` holds (generation, window).
    pub fn server_message(
        &mut self,
        now_ns: u64,
        channel_type: Option<u8>,
        msg_type: u16,
        prefix: [u32; 2],
    ) {
        self.advance(now_ns);
        if self.active() && self.stalled() {
            // Only the second message of an urgent pair starts without passing the gate: it is
            // begun from `msg_sent`, right after the urgent INVAL_LIST or LIST (display only).
            let urgent = channel_type == Some(channel::DISPLAY)
                && matches!(
                    self.last_type,
                    msg_server::DISPLAY_INVAL_LIST | msg_server::LIST
                );
            if urgent && self.messages_window == self.threshold() + 1 {
                self.urgent_pair_peaks += 1;
            } else {
                self.starts_while_stalled += 1;
            }
        }
        if msg_type == msg_server::SET_ACK {
            self.set_acks += 1;
            self.generation = prefix[0];
            self.window = prefix[1];
            // A new generation: its statistics start here.
            self.since_ns = Some(now_ns);
            self.last_ns = now_ns;
            self.time_at.clear();
            self.stalled_ns = 0;
            self.stalls = 0;
            self.max = 0;
            // send_set_ack zeroes messages_window, then the SET_ACK itself counts.
            self.count = 0;
            self.messages_window = 0;
            self.set(1, 1);
        } else if self.active() {
            self.messages_after_set_ack += 1;
            self.set(
                self.count.saturating_add(1),
                self.messages_window.wrapping_add(1),
            );
        }
        self.last_type = msg_type;
    }

    /// An ACK_SYNC carrying `generation` was read by the server at `now_ns`.
    pub fn ack_sync(&mut self, now_ns: u64, generation: u32) {
        self.advance(now_ns);
        self.ack_syncs += 1;
        self.client_generation = Some(generation);
    }

    /// An ACK was read by the server at `now_ns`.
    pub fn ack(&mut self, now_ns: u64) {
        self.advance(now_ns);
        if self.active() && self.client_generation == Some(self.generation) {
            self.acks += 1;
            if self.count < self.window {
                self.ack_surplus += 1;
            }
            self.set(
                self.count.saturating_sub(self.window),
                self.messages_window.wrapping_sub(self.window),
            );
        } else {
            self.acks_ignored += 1;
        }
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
        let total_ns: u64 = self.time_at_total.values().sum::<u64>() + extra;
        let seconds = le
            .iter()
            .map(|&b| {
                let at_or_below: u64 = self.time_at_total.range(..=b).map(|(_, t)| t).sum::<u64>()
                    + if key <= b { extra } else { 0 };
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

/// Time-weighted quantile `q` of `hist` with `extra` ns added at value `key`; `None` if no
/// time at all.
fn quantile_of(hist: &BTreeMap<u32, u64>, key: u32, extra: u64, q: f64) -> Option<u32> {
    let total: u64 = hist.values().sum::<u64>() + extra;
    if total == 0 {
        return None;
    }
    let target = (q * total as f64).ceil().max(1.0) as u64;
    let mut acc = 0u64;
    let mut extra_left = extra;
    for (&v, &t) in hist {
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
    use spice_ebpf_common::protocol::msg_server::{DISPLAY_INVAL_LIST, LIST, SET_ACK};

    const DRAW: u16 = 302;
    /// Cursor HIDE (S→C 105 on cursor, docs/spice-protocol.md §2.5).
    const CURSOR_HIDE: u16 = 105;
    const D: Option<u8> = Some(channel::DISPLAY);
    const C: Option<u8> = Some(channel::CURSOR);

    fn started(w: u32) -> AckWindow {
        let mut a = AckWindow::default();
        a.server_message(0, D, SET_ACK, [1, w]);
        a.ack_sync(1, 1);
        a
    }

    #[test]
    fn set_ack_counts_itself_and_acks_subtract_window() {
        let mut a = started(20);
        assert_eq!((a.count, a.messages_window), (1, 1));
        for i in 0..20 {
            a.server_message(10 + i, D, DRAW, [0, 0]);
        }
        assert_eq!(a.count, 21);
        a.ack(100);
        assert_eq!(
            (a.count, a.acks, a.acks_ignored, a.ack_surplus),
            (1, 1, 0, 0)
        );
        assert_eq!(a.messages_after_set_ack, 20);
        assert_eq!(a.messages_window, 1);
    }

    #[test]
    fn ack_before_ack_sync_or_wrong_generation_is_ignored() {
        let mut a = AckWindow::default();
        a.server_message(0, D, SET_ACK, [2, 20]);
        a.ack(1);
        a.ack_sync(2, 1);
        a.ack(3);
        assert_eq!((a.acks, a.acks_ignored, a.count), (0, 2, 1));
        for i in 0..25 {
            a.server_message(4 + i, D, DRAW, [0, 0]);
        }
        a.ack_sync(40, 2);
        a.ack(41);
        assert_eq!((a.acks, a.count, a.ack_surplus), (1, 6, 0));
    }

    #[test]
    fn stall_at_2w_plus_1_and_time_fractions() {
        let mut a = started(20);
        for i in 0..40u64 {
            a.server_message(2 + i, D, DRAW, [0, 0]);
        }
        assert_eq!(a.count, 41);
        assert!(a.stalled());
        assert_eq!(a.stalls, 1);
        a.finish(1042);
        // The 40th draw (count 41) starts at t=41: stalled 1001 ns of 1042.
        assert!((a.stalled_fraction() - 1001.0 / 1042.0).abs() < 1e-9);
        assert_eq!(a.quantile(0.5), 41);
        assert_eq!(a.max, 41);
        assert_eq!(a.starts_while_stalled, 0);
        a.server_message(2000, D, DRAW, [0, 0]);
        assert_eq!(a.starts_while_stalled, 1);
    }

    #[test]
    fn urgent_pair_may_reach_2w_plus_2_on_display() {
        for urgent in [DISPLAY_INVAL_LIST, LIST] {
            let mut a = started(20);
            for i in 0..39u64 {
                a.server_message(2 + i, D, DRAW, [0, 0]);
            }
            a.server_message(50, D, urgent, [0, 0]);
            assert_eq!(a.count, 41);
            a.server_message(51, D, DRAW, [0, 0]);
            assert_eq!(
                (a.count, a.max, a.urgent_pair_peaks, a.starts_while_stalled),
                (42, 42, 1, 0)
            );
            // A third start is beyond anything spice-server does.
            a.server_message(52, D, DRAW, [0, 0]);
            assert_eq!((a.urgent_pair_peaks, a.starts_while_stalled), (1, 1));
        }
    }

    #[test]
    fn no_urgent_pair_on_cursor() {
        // On cursor, 105 is CURSOR_HIDE and 8 would be an ordinary LIST: neither excuses a
        // start at 2W+1 (docs/spice-protocol.md §3.3).
        for t in [CURSOR_HIDE, LIST] {
            let mut a = AckWindow::default();
            a.server_message(0, C, SET_ACK, [1, 2]);
            a.ack_sync(1, 1);
            for i in 0..3u64 {
                a.server_message(2 + i, C, DRAW, [0, 0]);
            }
            a.server_message(10, C, t, [0, 0]);
            assert_eq!(a.count, 5);
            a.server_message(11, C, DRAW, [0, 0]);
            assert_eq!(
                (a.count, a.urgent_pair_peaks, a.starts_while_stalled),
                (6, 0, 1)
            );
        }
        // An unknown channel type gets no exemption either.
        let mut a = AckWindow::default();
        a.server_message(0, None, SET_ACK, [1, 1]);
        a.server_message(1, None, DRAW, [0, 0]);
        a.server_message(2, None, DISPLAY_INVAL_LIST, [0, 0]);
        a.server_message(3, None, DRAW, [0, 0]);
        assert_eq!((a.urgent_pair_peaks, a.starts_while_stalled), (0, 1));
    }

    #[test]
    fn surplus_ack_wraps_messages_window_but_never_the_count() {
        let mut a = started(20);
        for i in 0..5u64 {
            a.server_message(2 + i, D, DRAW, [0, 0]);
        }
        assert_eq!(a.count, 6);
        a.ack(100);
        // spice-server: messages_window (uint32_t) = 6 - 20 wraps; waiting_for_ack() is then
        // true for good. In flight: nothing.
        assert_eq!(a.ack_surplus, 1);
        assert_eq!(a.count, 0);
        assert_eq!(a.messages_window, 6u32.wrapping_sub(20));
        assert!(a.stalled());
        assert_eq!(a.stalls, 1);
        a.finish(200);
        assert!((a.stalled_fraction() - 100.0 / 200.0).abs() < 1e-9);
        assert_eq!(a.quantile(0.5), 0);
        // A second matched ACK: spice-server subtracts again (no new wrap); still nothing in
        // flight, and still a surplus.
        a.ack(300);
        assert_eq!((a.ack_surplus, a.count, a.acks), (2, 0, 2));
        assert_eq!(a.messages_window, 6u32.wrapping_sub(40));
        // A start now is one spice-server would not make.
        a.server_message(400, D, DRAW, [0, 0]);
        assert_eq!((a.count, a.starts_while_stalled), (1, 1));
        // The next SET_ACK resets both counts.
        a.server_message(500, D, SET_ACK, [2, 20]);
        assert_eq!((a.count, a.messages_window, a.ack_surplus), (1, 1, 2));
        assert!(!a.stalled());
    }

    #[test]
    fn html5_cadence_reaches_zero_without_surplus() {
        // spice-html5 ACKs after W-1 messages following the SET_ACK (§3.8): mw = W - W = 0.
        let mut a = started(5);
        for i in 0..4u64 {
            a.server_message(2 + i, D, DRAW, [0, 0]);
        }
        a.ack(10);
        assert_eq!((a.count, a.messages_window, a.ack_surplus), (0, 0, 0));
    }

    #[test]
    fn second_set_ack_starts_a_new_generation() {
        let mut a = started(10);
        // Generation 1: up to 21 (2W+1), 10 ns there.
        for i in 0..20u64 {
            a.server_message(2 + i, D, DRAW, [0, 0]);
        }
        assert_eq!((a.max, a.stalls), (21, 1));
        a.ack(31); // 11
        a.server_message(100, D, SET_ACK, [2, 3]);
        assert_eq!(a.generations(), 2);
        assert_eq!(
            (a.generation, a.window, a.count, a.max, a.stalls),
            (2, 3, 1, 1, 0)
        );
        assert_eq!(a.observed_ns(), 0);
        // The client's ACK for generation 1 arrives late: ignored.
        a.ack(101);
        assert_eq!((a.acks, a.acks_ignored, a.count), (1, 1, 1));
        a.ack_sync(102, 2);
        for i in 0..6u64 {
            a.server_message(110 + i, D, DRAW, [0, 0]);
        }
        assert_eq!((a.count, a.max, a.stalls), (7, 7, 1));
        a.ack(200); // 4, from t=200
        a.finish(300);
        // Generation 2 only: 200 ns observed; stalled from t=115 to t=200.
        assert_eq!(a.observed_ns(), 200);
        assert!((a.stalled_fraction() - 85.0 / 200.0).abs() < 1e-9);
        assert_eq!(a.quantile(0.5), 4);
        assert!(a.histogram_len() <= 8);
        assert_eq!(a.limit(), 7);
    }

    #[test]
    fn state_stays_bounded_whatever_the_run_length() {
        // A peer that ignores the window (no ACKs at all): the count climbs without end, the
        // histogram does not.
        let mut a = started(20);
        for i in 0..20_000u64 {
            a.server_message(2 + i, D, DRAW, [0, 0]);
        }
        a.finish(1_000_000);
        assert_eq!(a.count, 20_001);
        assert!(a.histogram_len() <= HISTOGRAM_MAX as usize + 1);
        assert_eq!(a.quantile(0.5), HISTOGRAM_MAX);
        // Many generations: only the current one's histogram is kept.
        let mut a = started(2);
        for g in 0..10_000u64 {
            let t = 10 + g * 10;
            a.server_message(t, D, SET_ACK, [g as u32 + 2, 2]);
            a.server_message(t + 1, D, DRAW, [0, 0]);
        }
        assert_eq!(a.generations(), 10_001);
        assert!(a.histogram_len() <= 2);
    }

    #[test]
    fn quantile_is_time_weighted() {
        let mut a = started(20);
        a.server_message(10, D, DRAW, [0, 0]); // count 2 from t=10
        a.finish(1000); // count 1 for 10 ns, 2 for 990 ns
        assert_eq!(a.quantile(0.5), 2);
        assert_eq!(a.quantile(0.005), 1);
    }

    #[test]
    fn stats_at_is_pure_and_adds_the_open_interval() {
        let mut a = started(2);
        for i in 0..4u64 {
            a.server_message(10 + i, D, DRAW, [0, 0]); // count 5 = 2W+1 from t=13: stalled
        }
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
        a.ack(513);
        let s3 = a.stats_at(1013);
        assert_eq!(s3.observed_ns, 1013);
        assert!((s3.stalled_seconds_total - 500e-9).abs() < 1e-15);
        assert_eq!(s3.p50, 3);
        // A now before the last event adds nothing.
        assert_eq!(a.stats_at(0).observed_ns, a.observed_ns());
    }

    #[test]
    fn histogram_is_time_weighted_cumulative_over_all_generations() {
        assert_eq!(histogram_bounds(40), vec![0, 10, 20, 40, 60, 80, 81, 82]);
        assert_eq!(histogram_bounds(1), vec![0, 1, 2, 3, 4]);
        assert_eq!(histogram_bounds(0), vec![0, 1, 2]);
        let mut a = started(4); // count 1 from t=0
        a.server_message(100, D, DRAW, [0, 0]); // 2 from t=100
        for i in 0..7u64 {
            a.server_message(200 + i, D, DRAW, [0, 0]); // 9 = 2W+1 from t=206
        }
        a.ack(1206); // 5 from t=1206
        // Generation 2: the counts start again; the histogram keeps both generations.
        a.server_message(2206, D, SET_ACK, [2, 4]); // 1 from t=2206
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
