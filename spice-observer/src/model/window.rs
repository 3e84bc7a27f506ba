//! spice-server's ACK window, replayed from the messages the kernel saw.
//!
//! The rules are spice-server's own (`server/red-channel-client.cpp`; explained with sources in
//! `docs/spice-protocol.md` §3):
//! * SET_ACK (server → client, type 3) carries (generation, window W) and sets the count to 1:
//!   the SET_ACK counts itself (`send_set_ack` then `begin_send_message`).
//! * Every later server → client message adds 1 when it starts (`begin_send_message`), before
//!   its first write, even if that write fails with EAGAIN.
//! * ACK_SYNC (client → server, type 1) records the client's generation.
//! * ACK (client → server, type 2) subtracts W only if that generation equals the SET_ACK's;
//!   other ACKs are dropped silently.
//! * The server starts no new message while the count is above 2W (`waiting_for_ack`), so the
//!   count peaks at 2W+1, or 2W+2 when an urgent pair (INVAL_LIST or LIST, then the message it
//!   guards, `dcc-send.cpp` `send_free_list`; display connections only, §3.3) straddles the
//!   threshold.
//!
//! The count is "in flight" in spice-server's sense: messages started and not yet covered by
//! an ACK. Time-weighted statistics are kept from the SET_ACK on.

use std::collections::BTreeMap;

use spice_ebpf_common::protocol::msg_server;

/// Replayed window state and statistics of one display or cursor connection.
#[derive(Clone, Debug, Default)]
pub struct AckWindow {
    /// W from the last SET_ACK, in messages (0 before any SET_ACK).
    pub window: u32,
    /// Generation from the last SET_ACK.
    pub generation: u32,
    /// Generation from the last ACK_SYNC, if any.
    pub client_generation: Option<u32>,
    /// spice-server's `messages_window` now, in messages.
    pub count: i64,
    pub set_acks: u64,
    pub ack_syncs: u64,
    /// ACKs that matched the generation (each subtracted W).
    pub acks: u64,
    /// ACKs dropped because no ACK_SYNC or a different generation preceded them.
    pub acks_ignored: u64,
    /// Server → client messages counted after the first SET_ACK (SET_ACKs not included).
    pub messages_after_set_ack: u64,
    /// Highest count reached.
    pub max: i64,
    /// Message starts while the count was above 2W that an urgent pair does not explain:
    /// spice-server never does this, so a non-zero value means the replay is wrong.
    pub starts_while_stalled: u64,
    /// Starts at count 2W+1 right after an urgent INVAL_LIST / LIST (allowed: peak 2W+2).
    pub urgent_pair_peaks: u64,
    /// Transitions from count ≤ 2W to count > 2W.
    pub stalls: u64,
    /// Nanoseconds spent at each count value since the first SET_ACK.
    time_at: BTreeMap<i64, u64>,
    /// Nanoseconds with count > 2W.
    stalled_ns: u64,
    /// Timestamp of the first SET_ACK and of the last change.
    since_ns: Option<u64>,
    last_ns: u64,
    /// Type of the previous server → client message.
    last_type: u16,
}

impl AckWindow {
    /// Whether a SET_ACK has been seen (only then are the other fields meaningful).
    pub fn active(&self) -> bool {
        self.since_ns.is_some()
    }

    /// The stall threshold 2W: the server sends only while count ≤ 2W.
    pub fn threshold(&self) -> i64 {
        2 * self.window as i64
    }

    fn advance(&mut self, now_ns: u64) {
        if self.since_ns.is_some() && now_ns > self.last_ns {
            let dt = now_ns - self.last_ns;
            *self.time_at.entry(self.count).or_default() += dt;
            if self.count > self.threshold() {
                self.stalled_ns += dt;
            }
        }
        if now_ns > self.last_ns {
            self.last_ns = now_ns;
        }
    }

    fn set(&mut self, count: i64) {
        let was_stalled = self.count > self.threshold();
        self.count = count;
        if self.count > self.max {
            self.max = self.count;
        }
        if !was_stalled && self.count > self.threshold() {
            self.stalls += 1;
        }
    }

    /// A server → client message of type `msg_type` started at `now_ns`. For SET_ACK,
    /// `prefix` holds (generation, window).
    pub fn server_message(&mut self, now_ns: u64, msg_type: u16, prefix: [u32; 2]) {
        self.advance(now_ns);
        if msg_type == msg_server::SET_ACK {
            self.set_acks += 1;
            self.generation = prefix[0];
            self.window = prefix[1];
            if self.since_ns.is_none() {
                self.since_ns = Some(now_ns);
                self.last_ns = now_ns;
            }
            // send_set_ack zeroes the count, then the SET_ACK itself counts.
            self.count = 0;
            self.set(1);
        } else if self.active() {
            self.messages_after_set_ack += 1;
            if self.count > self.threshold() {
                let urgent = matches!(
                    self.last_type,
                    msg_server::DISPLAY_INVAL_LIST | msg_server::LIST
                );
                if urgent && self.count == self.threshold() + 1 {
                    self.urgent_pair_peaks += 1;
                } else {
                    self.starts_while_stalled += 1;
                }
            }
            self.set(self.count + 1);
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
            self.set(self.count - self.window as i64);
        } else {
            self.acks_ignored += 1;
        }
    }

    /// Closes the time accounting at `now_ns` (end of observation or socket close).
    pub fn finish(&mut self, now_ns: u64) {
        self.advance(now_ns);
    }

    /// Nanoseconds observed since the first SET_ACK (up to the last event or `finish`).
    pub fn observed_ns(&self) -> u64 {
        self.since_ns.map_or(0, |s| self.last_ns.saturating_sub(s))
    }

    /// Fraction of observed time with count > 2W (0 when nothing was observed).
    pub fn stalled_fraction(&self) -> f64 {
        let total = self.observed_ns();
        if total == 0 {
            0.0
        } else {
            self.stalled_ns as f64 / total as f64
        }
    }

    /// Time-weighted quantile `q` (0..=1) of the count; the current count if no time passed.
    pub fn quantile(&self, q: f64) -> i64 {
        let total: u64 = self.time_at.values().sum();
        if total == 0 {
            return self.count;
        }
        let target = (q * total as f64).ceil().max(1.0) as u64;
        let mut acc = 0u64;
        for (&v, &t) in &self.time_at {
            acc += t;
            if acc >= target {
                return v;
            }
        }
        self.count
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spice_ebpf_common::protocol::msg_server::{DISPLAY_INVAL_LIST, SET_ACK};

    const DRAW: u16 = 302;

    fn started(w: u32) -> AckWindow {
        let mut a = AckWindow::default();
        a.server_message(0, SET_ACK, [1, w]);
        a.ack_sync(1, 1);
        a
    }

    #[test]
    fn set_ack_counts_itself_and_acks_subtract_window() {
        let mut a = started(20);
        assert_eq!(a.count, 1);
        for i in 0..20 {
            a.server_message(10 + i, DRAW, [0, 0]);
        }
        assert_eq!(a.count, 21);
        a.ack(100);
        assert_eq!((a.count, a.acks, a.acks_ignored), (1, 1, 0));
        assert_eq!(a.messages_after_set_ack, 20);
    }

    #[test]
    fn ack_before_ack_sync_or_wrong_generation_is_ignored() {
        let mut a = AckWindow::default();
        a.server_message(0, SET_ACK, [2, 20]);
        a.ack(1);
        a.ack_sync(2, 1);
        a.ack(3);
        assert_eq!((a.acks, a.acks_ignored, a.count), (0, 2, 1));
        a.ack_sync(4, 2);
        a.ack(5);
        assert_eq!((a.acks, a.count), (1, -19));
    }

    #[test]
    fn stall_at_2w_plus_1_and_time_fractions() {
        let mut a = started(20);
        for i in 0..40u64 {
            a.server_message(2 + i, DRAW, [0, 0]);
        }
        assert_eq!(a.count, 41);
        assert_eq!(a.stalls, 1);
        a.finish(1042);
        // The 40th draw (count 41) starts at t=41: stalled 1001 ns of 1042.
        assert!((a.stalled_fraction() - 1001.0 / 1042.0).abs() < 1e-9);
        assert_eq!(a.quantile(0.5), 41);
        assert_eq!(a.max, 41);
        assert_eq!(a.starts_while_stalled, 0);
        a.server_message(2000, DRAW, [0, 0]);
        assert_eq!(a.starts_while_stalled, 1);
    }

    #[test]
    fn urgent_pair_may_reach_2w_plus_2() {
        let mut a = started(20);
        for i in 0..39u64 {
            a.server_message(2 + i, DRAW, [0, 0]);
        }
        a.server_message(50, DISPLAY_INVAL_LIST, [0, 0]);
        assert_eq!(a.count, 41);
        a.server_message(51, DRAW, [0, 0]);
        assert_eq!(
            (a.count, a.max, a.urgent_pair_peaks, a.starts_while_stalled),
            (42, 42, 1, 0)
        );
    }

    #[test]
    fn quantile_is_time_weighted() {
        let mut a = started(20);
        a.server_message(10, DRAW, [0, 0]); // count 2 from t=10
        a.finish(1000); // count 1 for 10 ns, 2 for 990 ns
        assert_eq!(a.quantile(0.5), 2);
        assert_eq!(a.quantile(0.005), 1);
    }
}
