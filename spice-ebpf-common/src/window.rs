//! spice-server's ACK-window rule, as one `no_std` implementation: the kernel programs run it
//! on every framed message of a socket (state kept in the socket map, next to the framing
//! state), and the host's unit tests exercise the same code.
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
//! * The server starts no new message while `messages_window` is above 2W
//!   (`waiting_for_ack`), so the count peaks at 2W+1, or 2W+2 when an urgent pair (INVAL_LIST
//!   or LIST, then the message it guards, `dcc-send.cpp` `send_free_list`) straddles the
//!   threshold. Urgent pairs exist on display connections only (§3.3).
//! * `messages_window` is a `uint32_t` (§3.5): a surplus ACK (one that finds fewer than W
//!   messages in flight) wraps it to about 2³², which keeps the server waiting for good.
//!   [`WindowState::messages_window`] keeps that value exactly; [`WindowState::count`] is the
//!   in-flight count, never below 0.
//!
//! Every mutating call returns [`effect`] bits saying what it did; the kernel puts them in the
//! message's ring record ([`crate::event::MessageEvent::win_effects`]) so the agent can derive
//! time statistics without keeping a window of its own.

use crate::{
    framing::Role,
    protocol::{channel, msg_client, msg_server},
};

/// [`WindowState::flags`] bits.
pub mod state_flag {
    /// A SET_ACK was seen: the count and W are meaningful.
    pub const ACTIVE: u16 = 1;
    /// An ACK_SYNC was seen: [`super::WindowState::client_generation`] is meaningful.
    pub const CLIENT_GENERATION: u16 = 2;
}

/// Bits returned by [`WindowState`]'s mutating calls, and carried in message records.
pub mod effect {
    /// A SET_ACK opened a new generation (count 1, W and generation from its body).
    pub const NEW_GENERATION: u8 = 1;
    /// `messages_window` went above 2W: spice-server began waiting for an ACK.
    pub const STALL_BEGAN: u8 = 2;
    /// `messages_window` came back to 2W or below (an ACK, or a new SET_ACK).
    pub const STALL_ENDED: u8 = 4;
    /// A server message started while spice-server was waiting for an ACK, and no urgent
    /// pair explains it: spice-server never does this.
    pub const STARTED_WHILE_STALLED: u8 = 8;
    /// The second message of an urgent pair started at 2W+1 (display only; peak 2W+2).
    pub const URGENT_PEAK: u8 = 16;
    /// An ACK matched the generation and subtracted W.
    pub const ACK_APPLIED: u8 = 32;
    /// An ACK was dropped: no ACK_SYNC before it, or another generation, or no SET_ACK yet.
    pub const ACK_IGNORED: u8 = 64;
    /// A matched ACK found fewer than W messages in flight (`messages_window` wrapped).
    pub const ACK_SURPLUS: u8 = 128;
}

/// spice-server's window state of one connection, kept exactly. Plain data, all zero =
/// no SET_ACK seen yet. 120 bytes; kept per socket in the kernel map `SOCKETS`
/// ([`crate::event::SockState::window`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowState {
    /// spice-server's `messages_window` exactly (`uint32_t`, wrapping as in C).
    pub messages_window: u32,
    /// In flight: messages started since the last SET_ACK (the SET_ACK included) and not yet
    /// covered by a matching ACK, never below 0. Equals `messages_window` unless a surplus
    /// ACK arrived in this generation.
    pub count: u32,
    /// W from the last SET_ACK, messages.
    pub window: u32,
    /// Generation from the last SET_ACK.
    pub generation: u32,
    /// Generation from the last ACK_SYNC (valid with [`state_flag::CLIENT_GENERATION`]).
    pub client_generation: u32,
    /// [`state_flag`] bits.
    pub flags: u16,
    /// Type of the previous server → client message (for the urgent-pair exemption).
    pub last_type: u16,
    /// Highest count in the current generation.
    pub max: u32,
    /// Stalls (transitions into waiting for an ACK) in the current generation.
    pub stalls: u32,
    /// SET_ACKs seen (generations).
    pub set_acks: u64,
    /// ACK_SYNCs seen.
    pub ack_syncs: u64,
    /// ACKs that matched the generation, all generations.
    pub acks: u64,
    /// ACKs dropped, all generations.
    pub acks_ignored: u64,
    /// Matched ACKs that found fewer than W in flight, all generations.
    pub ack_surplus: u64,
    /// Server → client messages counted after the first SET_ACK (SET_ACKs not included).
    pub messages_after_set_ack: u64,
    /// Starts spice-server would not make (see [`effect::STARTED_WHILE_STALLED`]).
    pub starts_while_stalled: u64,
    /// Urgent-pair starts at 2W+1 (see [`effect::URGENT_PEAK`]).
    pub urgent_pair_peaks: u64,
    /// Stalls, all generations.
    pub stalls_total: u64,
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC ns) of the current generation's SET_ACK.
    pub generation_began_ns: u64,
    /// CLOCK_MONOTONIC ns when the current stall began (meaningful while [`Self::stalled`]).
    pub stall_began_ns: u64,
}

impl WindowState {
    /// Whether a SET_ACK has been seen.
    #[inline(always)]
    pub fn active(&self) -> bool {
        self.flags & state_flag::ACTIVE != 0
    }

    /// The stall threshold 2W, computed as spice-server does (`client_window * 2` in
    /// `uint32_t`).
    #[inline(always)]
    pub fn threshold(&self) -> u32 {
        self.window.wrapping_mul(2)
    }

    /// The most messages a gated start can leave in flight, 2W+1.
    #[inline(always)]
    pub fn limit(&self) -> u32 {
        self.threshold().saturating_add(1)
    }

    /// Whether spice-server is waiting for an ACK: `waiting_for_ack()`, i.e.
    /// `messages_window > client_window * 2` in unsigned 32-bit arithmetic, once active.
    #[inline(always)]
    pub fn stalled(&self) -> bool {
        self.active() && self.messages_window > self.threshold()
    }

    /// Sets both counts and returns the stall transition, if any.
    #[inline(always)]
    fn set(&mut self, count: u32, mw: u32, now_ns: u64) -> u8 {
        let was = self.stalled();
        self.count = count;
        self.messages_window = mw;
        if count > self.max {
            self.max = count;
        }
        let is = self.stalled();
        if !was && is {
            self.stalls = self.stalls.wrapping_add(1);
            self.stalls_total += 1;
            self.stall_began_ns = now_ns;
            effect::STALL_BEGAN
        } else if was && !is {
            effect::STALL_ENDED
        } else {
            0
        }
    }

    /// A server → client message of type `msg_type` started at `now_ns` on a connection of
    /// channel type `channel_type` (from the client's link message; 0 if unknown). For
    /// SET_ACK, `prefix` holds (generation, window). Returns [`effect`] bits.
    #[inline(always)]
    pub fn server_message(
        &mut self,
        now_ns: u64,
        channel_type: u8,
        msg_type: u16,
        prefix: [u32; 2],
    ) -> u8 {
        let mut fx = 0;
        if self.stalled() {
            // Only the second message of an urgent pair starts without passing the gate.
            let urgent = channel_type == channel::DISPLAY
                && (self.last_type == msg_server::DISPLAY_INVAL_LIST
                    || self.last_type == msg_server::LIST);
            if urgent && self.messages_window == self.threshold().wrapping_add(1) {
                self.urgent_pair_peaks += 1;
                fx |= effect::URGENT_PEAK;
            } else {
                self.starts_while_stalled += 1;
                fx |= effect::STARTED_WHILE_STALLED;
            }
        }
        if msg_type == msg_server::SET_ACK {
            let was = self.stalled();
            self.set_acks += 1;
            self.generation = prefix[0];
            self.window = prefix[1];
            self.flags |= state_flag::ACTIVE;
            self.generation_began_ns = now_ns;
            self.stalls = 0;
            self.max = 0;
            // send_set_ack zeroes messages_window, then the SET_ACK itself counts.
            self.count = 0;
            self.messages_window = 0;
            fx |= effect::NEW_GENERATION | self.set(1, 1, now_ns);
            if was {
                fx |= effect::STALL_ENDED;
            }
        } else if self.active() {
            self.messages_after_set_ack += 1;
            fx |= self.set(
                self.count.saturating_add(1),
                self.messages_window.wrapping_add(1),
                now_ns,
            );
        }
        self.last_type = msg_type;
        fx
    }

    /// An ACK_SYNC carrying `generation` was read by the server.
    #[inline(always)]
    pub fn ack_sync(&mut self, generation: u32) -> u8 {
        self.ack_syncs += 1;
        self.client_generation = generation;
        self.flags |= state_flag::CLIENT_GENERATION;
        0
    }

    /// An ACK was read by the server at `now_ns`. Returns [`effect`] bits.
    #[inline(always)]
    pub fn ack(&mut self, now_ns: u64) -> u8 {
        let matched = self.active()
            && self.flags & state_flag::CLIENT_GENERATION != 0
            && self.client_generation == self.generation;
        if !matched {
            self.acks_ignored += 1;
            return effect::ACK_IGNORED;
        }
        self.acks += 1;
        let mut fx = effect::ACK_APPLIED;
        if self.count < self.window {
            self.ack_surplus += 1;
            fx |= effect::ACK_SURPLUS;
        }
        fx | self.set(
            self.count.saturating_sub(self.window),
            self.messages_window.wrapping_sub(self.window),
            now_ns,
        )
    }

    /// Applies one framed data message of a direction with SPICE role `role` (the raw
    /// [`Role`] value of its framing state): server → client messages go through
    /// [`Self::server_message`], client → server ACK_SYNC and ACK through [`Self::ack_sync`]
    /// and [`Self::ack`]; everything else changes nothing. Returns [`effect`] bits.
    #[inline(always)]
    pub fn apply(
        &mut self,
        role: u8,
        now_ns: u64,
        channel_type: u8,
        msg_type: u16,
        prefix: [u32; 2],
    ) -> u8 {
        if role == Role::ServerToClient as u8 {
            self.server_message(now_ns, channel_type, msg_type, prefix)
        } else if role == Role::ClientToServer as u8 {
            match msg_type {
                msg_client::ACK_SYNC => self.ack_sync(prefix[0]),
                msg_client::ACK => self.ack(now_ns),
                _ => 0,
            }
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::msg_server::{DISPLAY_INVAL_LIST, LIST, SET_ACK};

    const DRAW: u16 = 302;
    const CURSOR_HIDE: u16 = 105;
    const D: u8 = channel::DISPLAY;
    const C: u8 = channel::CURSOR;

    fn started(w: u32) -> WindowState {
        let mut a = WindowState::default();
        assert_eq!(
            a.server_message(0, D, SET_ACK, [1, w]),
            effect::NEW_GENERATION
        );
        a.ack_sync(1);
        a
    }

    #[test]
    fn zero_is_the_initial_state() {
        let a = WindowState::default();
        assert!(!a.active() && !a.stalled());
        assert_eq!(core::mem::size_of::<WindowState>(), 120);
    }

    #[test]
    fn set_ack_counts_itself_and_acks_subtract_window() {
        let mut a = started(20);
        assert_eq!((a.count, a.messages_window), (1, 1));
        for i in 0..20 {
            assert_eq!(a.server_message(10 + i, D, DRAW, [0, 0]), 0);
        }
        assert_eq!(a.count, 21);
        assert_eq!(a.ack(100), effect::ACK_APPLIED);
        assert_eq!(
            (a.count, a.acks, a.acks_ignored, a.ack_surplus),
            (1, 1, 0, 0)
        );
        assert_eq!(a.messages_after_set_ack, 20);
    }

    #[test]
    fn ack_before_ack_sync_or_wrong_generation_is_ignored() {
        let mut a = WindowState::default();
        assert_eq!(a.ack(0), effect::ACK_IGNORED);
        a.server_message(0, D, SET_ACK, [2, 20]);
        a.ack(1);
        a.ack_sync(1);
        a.ack(3);
        assert_eq!((a.acks, a.acks_ignored, a.count), (0, 3, 1));
        for i in 0..25 {
            a.server_message(4 + i, D, DRAW, [0, 0]);
        }
        a.ack_sync(2);
        a.ack(41);
        assert_eq!((a.acks, a.count, a.ack_surplus), (1, 6, 0));
    }

    #[test]
    fn stall_at_2w_plus_1_records_when_it_began() {
        let mut a = started(20);
        for i in 0..39u64 {
            assert_eq!(a.server_message(2 + i, D, DRAW, [0, 0]), 0);
        }
        assert_eq!(a.server_message(41, D, DRAW, [0, 0]), effect::STALL_BEGAN);
        assert_eq!(
            (a.count, a.max, a.stalls, a.stall_began_ns),
            (41, 41, 1, 41)
        );
        assert!(a.stalled());
        assert_eq!(
            a.server_message(50, D, DRAW, [0, 0]),
            effect::STARTED_WHILE_STALLED
        );
        assert_eq!(a.starts_while_stalled, 1);
        let fx = a.ack(60);
        assert_eq!(fx, effect::ACK_APPLIED | effect::STALL_ENDED);
        assert_eq!((a.count, a.stalls_total), (22, 1));
    }

    #[test]
    fn urgent_pair_may_reach_2w_plus_2_on_display_only() {
        for urgent in [DISPLAY_INVAL_LIST, LIST] {
            let mut a = started(20);
            for i in 0..39u64 {
                a.server_message(2 + i, D, DRAW, [0, 0]);
            }
            a.server_message(50, D, urgent, [0, 0]);
            assert_eq!(a.server_message(51, D, DRAW, [0, 0]), effect::URGENT_PEAK);
            assert_eq!((a.count, a.max, a.urgent_pair_peaks), (42, 42, 1));
            assert_eq!(
                a.server_message(52, D, DRAW, [0, 0]),
                effect::STARTED_WHILE_STALLED
            );
        }
        for t in [CURSOR_HIDE, LIST] {
            let mut a = WindowState::default();
            a.server_message(0, C, SET_ACK, [1, 2]);
            for i in 0..3u64 {
                a.server_message(2 + i, C, DRAW, [0, 0]);
            }
            a.server_message(10, C, t, [0, 0]);
            a.server_message(11, C, DRAW, [0, 0]);
            assert_eq!((a.urgent_pair_peaks, a.starts_while_stalled), (0, 1));
        }
    }

    #[test]
    fn surplus_ack_wraps_messages_window_but_never_the_count() {
        let mut a = started(20);
        for i in 0..5u64 {
            a.server_message(2 + i, D, DRAW, [0, 0]);
        }
        let fx = a.ack(100);
        assert_eq!(
            fx,
            effect::ACK_APPLIED | effect::ACK_SURPLUS | effect::STALL_BEGAN
        );
        assert_eq!((a.count, a.messages_window), (0, 6u32.wrapping_sub(20)));
        assert!(a.stalled());
        // A SET_ACK is a start too: made while waiting, spice-server would not make it.
        let fx = a.server_message(500, D, SET_ACK, [2, 20]);
        assert_eq!(
            fx,
            effect::NEW_GENERATION | effect::STALL_ENDED | effect::STARTED_WHILE_STALLED
        );
        assert_eq!((a.count, a.messages_window, a.stalls, a.max), (1, 1, 0, 1));
        assert!(!a.stalled());
    }

    #[test]
    fn no_urgent_pair_on_an_unknown_channel_type() {
        let mut a = WindowState::default();
        a.server_message(0, 0, SET_ACK, [1, 1]);
        a.server_message(1, 0, DRAW, [0, 0]);
        a.server_message(2, 0, DISPLAY_INVAL_LIST, [0, 0]);
        assert_eq!(
            a.server_message(3, 0, DRAW, [0, 0]),
            effect::STARTED_WHILE_STALLED
        );
        assert_eq!((a.urgent_pair_peaks, a.starts_while_stalled), (0, 1));
    }

    #[test]
    fn a_second_surplus_ack_subtracts_again_without_a_new_stall() {
        let mut a = started(20);
        for i in 0..5u64 {
            a.server_message(2 + i, D, DRAW, [0, 0]);
        }
        a.ack(100);
        // spice-server subtracts again (no new wrap of its own); still nothing in flight.
        assert_eq!(a.ack(300), effect::ACK_APPLIED | effect::ACK_SURPLUS);
        assert_eq!((a.ack_surplus, a.count, a.acks, a.stalls), (2, 0, 2, 1));
        assert_eq!(a.messages_window, 6u32.wrapping_sub(40));
        // A start now is one spice-server would not make.
        assert_eq!(
            a.server_message(400, D, DRAW, [0, 0]),
            effect::STARTED_WHILE_STALLED
        );
        assert_eq!((a.count, a.starts_while_stalled), (1, 1));
    }

    #[test]
    fn html5_cadence_reaches_zero_without_surplus() {
        // spice-html5 ACKs after W-1 messages following the SET_ACK (§3.8): mw = W - W = 0.
        let mut a = started(5);
        for i in 0..4u64 {
            a.server_message(2 + i, D, DRAW, [0, 0]);
        }
        assert_eq!(a.ack(10), effect::ACK_APPLIED);
        assert_eq!((a.count, a.messages_window, a.ack_surplus), (0, 0, 0));
    }

    #[test]
    fn a_second_set_ack_starts_a_new_generation() {
        let mut a = started(10);
        for i in 0..20u64 {
            a.server_message(2 + i, D, DRAW, [0, 0]);
        }
        assert_eq!((a.max, a.stalls, a.count), (21, 1, 21));
        a.ack(31); // 11
        assert_eq!(
            a.server_message(100, D, SET_ACK, [2, 3]),
            effect::NEW_GENERATION
        );
        assert_eq!(
            (a.generation, a.window, a.count, a.max, a.stalls),
            (2, 3, 1, 1, 0)
        );
        assert_eq!(
            (a.set_acks, a.generation_began_ns, a.stalls_total),
            (2, 100, 1)
        );
        // The client's ACK for generation 1 arrives late: ignored.
        assert_eq!(a.ack(101), effect::ACK_IGNORED);
        assert_eq!((a.acks, a.acks_ignored, a.count), (1, 1, 1));
        a.ack_sync(2);
        for i in 0..6u64 {
            a.server_message(110 + i, D, DRAW, [0, 0]);
        }
        assert_eq!((a.count, a.max, a.stalls, a.stall_began_ns), (7, 7, 1, 115));
        assert_eq!(a.ack(200), effect::ACK_APPLIED | effect::STALL_ENDED);
        assert_eq!((a.count, a.acks, a.stalls_total), (4, 2, 2));
    }

    #[test]
    fn apply_routes_by_role() {
        let mut a = WindowState::default();
        let s2c = Role::ServerToClient as u8;
        let c2s = Role::ClientToServer as u8;
        a.apply(s2c, 0, D, SET_ACK, [1, 2]);
        a.apply(c2s, 1, D, msg_client::ACK_SYNC, [1, 0]);
        a.apply(s2c, 2, D, DRAW, [0, 0]);
        a.apply(s2c, 3, D, DRAW, [0, 0]);
        assert_eq!(a.count, 3);
        // A server message in the client's direction, and any message of an unknown role,
        // change nothing.
        assert_eq!(a.apply(c2s, 4, D, DRAW, [0, 0]), 0);
        assert_eq!(
            a.apply(Role::Unknown as u8, 5, D, msg_client::ACK, [0, 0]),
            0
        );
        assert_eq!(
            a.apply(c2s, 6, D, msg_client::ACK, [0, 0]),
            effect::ACK_APPLIED
        );
        assert_eq!((a.count, a.acks, a.ack_syncs), (1, 1, 1));
    }
}
