//! TLS: what the libssl hooks could do for each watched process, and (for sockets whose
//! framing runs on TLS plaintext) where plaintext offsets sit in TCP sequence space.

/// What the libssl hooks (uprobes on SSL_write, SSL_read and friends, see
/// `spice_ebpf_common::event::tls_func`) could do for one watched process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsAttach {
    /// uprobes attached on this library file (the path as the process maps it).
    Attached { library: String },
    /// The process maps no libssl: it is linked statically, uses another TLS library, or
    /// has not loaded one yet. Its TLS plaintext cannot be hooked.
    NoLibrary,
    /// Attaching to `library` failed with `error`.
    Failed { library: String, error: String },
    /// The hooks were turned off (`--no-tls-hooks`).
    Disabled,
}

impl TlsAttach {
    /// Short state name for JSON and metric labels: `attached`, `no_libssl`, `failed`,
    /// `disabled`.
    pub fn state(&self) -> &'static str {
        match self {
            Self::Attached { .. } => "attached",
            Self::NoLibrary => "no_libssl",
            Self::Failed { .. } => "failed",
            Self::Disabled => "disabled",
        }
    }
}

use std::collections::VecDeque;

use spice_ebpf_common::event::{TlsMarkEvent, tls_func};

/// Most marks ([`Mark`]) kept per TLS direction. spice-server has at most 2W+2 ≤ 258
/// messages in flight (W ≤ 128) and writes one SSL_write per iovec, a few per message, so a
/// few thousand marks cover every in-flight message; older marks are pruned as soon as no
/// placement can need them ([`TlsDir::prune`]), and the list never grows past this.
pub const MARKS: usize = 4096;

/// One libssl call's end in TCP sequence space (`spice_ebpf_common::event::TlsMarkEvent`):
/// the plaintext of its direction up to `plain_end` went into (send) or came out of (recv)
/// the TCP stream up to `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mark {
    /// Plaintext stream offset just after the call's bytes.
    pub plain_end: u64,
    /// `write_seq` (send) or `copied_seq` (recv) at the call's return.
    pub seq: u32,
    /// Plaintext bytes the call moved.
    pub len: u32,
}

impl Mark {
    /// From a `TLS_MARK` record.
    pub fn of(e: &TlsMarkEvent) -> Self {
        Self {
            plain_end: e.plain_end,
            seq: e.seq,
            len: e.len,
        }
    }

    /// Plaintext offset of the call's first byte.
    pub fn plain_start(&self) -> u64 {
        self.plain_end.saturating_sub(u64::from(self.len))
    }
}

/// What a TLS direction knows of TCP positions older than its oldest kept mark.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Before {
    /// Nothing was pruned: the oldest kept mark is the first call the hooks framed on this
    /// direction, so before its `seq` no framed plaintext had moved: the plaintext offset is
    /// that call's start (0 for a connection traced from its first byte).
    #[default]
    Start,
    /// Marks were dropped; `mark` is the newest dropped one. `safe`: it was pruned because it
    /// ends at or below every message a placement can still take as in flight
    /// ([`TlsDir::prune`]), so a position before it converts to its `plain_end`, which lies
    /// before those messages and moves none of them (the placement clamps it to the oldest
    /// one's start). Not `safe`: dropped because the list was full ([`MARKS`]), and a
    /// position before it cannot be converted.
    Dropped { mark: Mark, safe: bool },
    /// The calls before the oldest kept mark are not known (a socket a restarted agent took
    /// over from the kernel's pinned map: the earlier marks went with the old agent).
    Unknown,
}

/// The marks of one direction of a TLS socket, and its plaintext counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsDir {
    /// Kept marks, oldest first (plaintext and TCP positions both ascending).
    pub marks: VecDeque<Mark>,
    /// Marks seen: libssl calls that moved plaintext on this direction (SSL_write /
    /// SSL_write_ex for send, SSL_read / SSL_read_ex for recv), kept or not.
    pub calls: u64,
    /// Plaintext bytes moved (stream offset after the newest call): the newest mark's
    /// `plain_end` or the kernel's `DirState::pos` at the newest read of its socket map,
    /// whichever is larger (both only grow).
    pub plain_bytes: u64,
    /// Marks dropped because the list was full (not pruned as unneeded).
    pub overflowed: u64,
    /// Marks that arrived with a plaintext end not beyond the newest kept one (out of order):
    /// counted in `calls`, not kept.
    pub out_of_order: u64,
    /// What is known before the oldest kept mark.
    pub before: Before,
}

impl TlsDir {
    /// A direction a restarted agent took over with `plain_pos` plaintext bytes already
    /// moved (the kernel's `DirState::pos`); its earlier marks are unknown.
    pub fn restored(plain_pos: u64) -> Self {
        Self {
            plain_bytes: plain_pos,
            before: Before::Unknown,
            ..Default::default()
        }
    }

    /// Takes one mark. Marks of one direction arrive in call order (one socket's calls in one
    /// direction are serialised by libssl's `SSL *`, and each thread's records reach the ring
    /// in program order), so a mark not beyond the newest is counted but not kept.
    pub fn push(&mut self, m: Mark) {
        self.calls += 1;
        self.plain_bytes = self.plain_bytes.max(m.plain_end);
        if self
            .marks
            .back()
            .is_some_and(|b| m.plain_end <= b.plain_end)
        {
            self.out_of_order += 1;
            return;
        }
        if self.marks.len() == MARKS
            && let Some(old) = self.marks.pop_front()
        {
            self.overflowed += 1;
            self.before = Before::Dropped {
                mark: old,
                safe: false,
            };
        }
        self.marks.push_back(m);
    }

    /// Takes the kernel's plaintext byte count (`DirState::pos` of a TLS socket).
    pub fn read_plain(&mut self, pos: u64) {
        self.plain_bytes = self.plain_bytes.max(pos);
    }

    /// Drops the marks that end at or below `floor`, a plaintext offset at or below the start
    /// of every message a placement of this direction can still use (the oldest message that
    /// can still be in flight), keeping at least the newest mark. Such a mark is needed by
    /// no conversion: any TCP position before the next kept mark converts to at most its
    /// `plain_end`, which moves no message.
    pub fn prune(&mut self, floor: u64) {
        while self.marks.len() > 1
            && let Some(&f) = self.marks.front()
            && f.plain_end <= floor
        {
            self.marks.pop_front();
            self.before = Before::Dropped {
                mark: f,
                safe: true,
            };
        }
    }

    /// The plaintext offset TCP position `x` (`write_seq`, `snd_nxt`, `snd_una` of the
    /// sending socket; `rcv_nxt`, `copied_seq` of the receiving socket of the same
    /// connection) has passed: the `plain_end` of the newest mark whose `seq` is at or
    /// before `x`. Sequence numbers are compared mod 2³² relative to the newest mark (valid
    /// within 2 GiB of it). A position beyond the newest mark (a call still writing, or TLS
    /// records of no plaintext: handshake, alerts, session tickets) gives the newest mark's
    /// `plain_end`: the bytes of a call are taken as passed once all of that call's records
    /// have. Precision: one call's records (spice-server writes one iovec per SSL_write; one
    /// SSL_write of at most 16 KiB is one TLS record). A position before the oldest kept mark
    /// converts as [`Before`] says; `None` without a mark, or when it cannot be converted.
    pub fn plain_at(&self, x: u32) -> Option<u64> {
        let newest = self.marks.back()?;
        let rel = |s: u32| s.wrapping_sub(newest.seq) as i32;
        let rx = rel(x);
        if rx >= 0 {
            return Some(newest.plain_end);
        }
        let i = self.marks.partition_point(|m| rel(m.seq) <= rx);
        if i > 0 {
            return Some(self.marks[i - 1].plain_end);
        }
        match self.before {
            Before::Start => Some(self.marks[0].plain_start()),
            Before::Dropped { mark, safe } => {
                (safe || rel(mark.seq) <= rx).then_some(mark.plain_end)
            }
            Before::Unknown => None,
        }
    }

    /// The TCP sequence number after the records that carry plaintext offset `p` − 1 (the
    /// byte before `p`): the `seq` of the first mark whose `plain_end` is at or beyond `p`.
    /// `None` when no kept mark reaches `p` (not written yet) or the mark is no longer kept.
    pub fn seq_at(&self, p: u64) -> Option<u32> {
        let i = self.marks.partition_point(|m| m.plain_end < p);
        let m = self.marks.get(i)?;
        if i == 0 && p <= m.plain_start() && self.before != Before::Start {
            return None;
        }
        Some(m.seq)
    }
}

/// A socket that carries TLS, whose framing runs on the plaintext at the libssl hooks
/// ([`spice_ebpf_common::event::TlsEvent`]; per-direction marks in
/// [`super::DirStats::tls`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsSocket {
    /// [`tls_func`] the socket's first traced call ran in; 0 when not known (the `TLS`
    /// record was lost, or the socket was taken over from the pinned map).
    pub func: u8,
    /// When the agent learnt the socket carries TLS (CLOCK_MONOTONIC ns).
    pub since_ns: u64,
}

impl TlsSocket {
    /// Name of [`Self::func`] (`SSL_write`, …, `none` when not known).
    pub fn func_name(&self) -> &'static str {
        tls_func::name(self.func)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(plain_end: u64, seq: u32, len: u32) -> Mark {
        Mark {
            plain_end,
            seq,
            len,
        }
    }

    /// Three SSL_write calls of 100, 50 and 200 plaintext bytes, each one TLS record (22
    /// bytes of overhead with TLS 1.3 AES-GCM), after a 2000-byte handshake from ISN 1000.
    fn three(base: u32) -> TlsDir {
        let mut d = TlsDir::default();
        let mut seq = base;
        let mut end = 0;
        for len in [100u32, 50, 200] {
            seq = seq.wrapping_add(len + 22);
            end += u64::from(len);
            d.push(mark(end, seq, len));
        }
        d
    }

    #[test]
    fn positions_between_marks_take_the_older_marks_end() {
        let d = three(3000);
        // Marks: (100, 3122), (150, 3194), (350, 3416).
        assert_eq!(d.plain_at(3122), Some(100), "at a mark");
        assert_eq!(
            d.plain_at(3150),
            Some(100),
            "inside the second call's record"
        );
        assert_eq!(d.plain_at(3193), Some(100));
        assert_eq!(d.plain_at(3194), Some(150));
        assert_eq!(d.plain_at(3415), Some(150));
        assert_eq!(d.plain_at(3416), Some(350));
        // Beyond the newest mark (a call still writing, or a session ticket): the newest end.
        assert_eq!(d.plain_at(5000), Some(350));
        assert_eq!(d.seq_at(1), Some(3122));
        assert_eq!(d.seq_at(100), Some(3122));
        assert_eq!(d.seq_at(101), Some(3194));
        assert_eq!(d.seq_at(350), Some(3416));
        assert_eq!(d.seq_at(351), None, "not written yet");
    }

    #[test]
    fn positions_before_the_first_mark() {
        let d = three(3000);
        // The handshake and the first call's record: no plaintext passed yet.
        assert_eq!(d.plain_at(1000), Some(0));
        assert_eq!(d.plain_at(3121), Some(0));
        // A connection joined mid-stream: its first framed call starts at its own offset 0
        // too, the same rule.
        let mut j = TlsDir::default();
        j.push(mark(500, 77, 500));
        assert_eq!(j.plain_at(76), Some(0));
        // A restored direction knows nothing before its first mark after the restart.
        let mut r = TlsDir::restored(10_000);
        assert_eq!(r.plain_at(5), None, "no mark");
        r.push(mark(10_300, 900, 300));
        assert_eq!(r.plain_at(899), None);
        assert_eq!(r.plain_at(900), Some(10_300));
        assert_eq!(r.seq_at(10_001), Some(900));
        assert_eq!(
            r.seq_at(10_000),
            None,
            "before the first mark after the restore"
        );
        assert_eq!(TlsDir::default().plain_at(0), None);
    }

    #[test]
    fn sequence_numbers_wrap() {
        // The ISN just below 2^32: the marks wrap around.
        let d = three(u32::MAX - 150);
        let s: Vec<u32> = d.marks.iter().map(|m| m.seq).collect();
        assert_eq!(s, [u32::MAX - 28, 43, 265]);
        assert_eq!(d.plain_at(u32::MAX - 28), Some(100));
        assert_eq!(d.plain_at(u32::MAX), Some(100), "just before the wrap");
        assert_eq!(d.plain_at(0), Some(100), "just after the wrap");
        assert_eq!(d.plain_at(43), Some(150));
        assert_eq!(d.plain_at(264), Some(150));
        assert_eq!(d.plain_at(265), Some(350));
        assert_eq!(d.plain_at(u32::MAX - 100), Some(0), "before the first mark");
        assert_eq!(d.plain_at(10_000), Some(350));
        assert_eq!(d.seq_at(120), Some(43));
    }

    #[test]
    fn several_reads_at_one_sequence_number() {
        // SSL_read with a 4 KiB buffer on a 16 KiB record: copied_seq jumps to the record's
        // end at the first read; three more reads return the rest without a socket read.
        let mut d = TlsDir::default();
        for (i, end) in [4096u64, 8192, 12288, 16384].into_iter().enumerate() {
            d.push(mark(end, 16_406, 4096));
            assert_eq!(d.plain_at(16_406), Some(end), "read {i}");
        }
        assert_eq!(d.plain_at(16_405), Some(0));
        assert_eq!(d.seq_at(16_000), Some(16_406));
        // A duplicate or out-of-order mark is counted, not kept.
        d.push(mark(8192, 16_406, 4096));
        assert_eq!((d.calls, d.marks.len(), d.out_of_order), (5, 4, 1));
        assert_eq!(d.plain_bytes, 16_384);
    }

    #[test]
    fn pruning_keeps_what_placement_needs_and_is_bounded() {
        let mut d = three(3000);
        // The oldest message that can be in flight starts at 150: the first two marks end at
        // or below it.
        d.prune(150);
        assert_eq!(d.marks.len(), 1);
        assert_eq!(
            d.before,
            Before::Dropped {
                mark: mark(150, 3194, 50),
                safe: true
            }
        );
        // Positions before the oldest kept mark convert to at most 150 (they move no message
        // starting at 150 or later).
        assert_eq!(d.plain_at(3200), Some(150));
        assert_eq!(d.plain_at(3100), Some(150));
        assert_eq!(d.plain_at(3416), Some(350));
        assert_eq!(d.seq_at(151), Some(3416));
        assert_eq!(d.seq_at(150), None, "pruned");
        // The newest mark always stays.
        d.prune(10_000);
        assert_eq!(d.marks.len(), 1);
        // Never more than MARKS, whatever the run length; a position before a mark dropped
        // because the list was full cannot be converted.
        let mut f = TlsDir::default();
        for i in 1..=(MARKS as u64 + 10) {
            f.push(mark(i * 10, (i * 20) as u32, 10));
        }
        assert_eq!(f.marks.len(), MARKS);
        assert_eq!(f.calls, MARKS as u64 + 10);
        assert_eq!(f.overflowed, 10);
        // Dropped: marks 1..=10 (the newest at seq 200, plaintext 100); kept from seq 220.
        assert_eq!(f.plain_at(220), Some(110), "the oldest kept mark");
        assert_eq!(f.plain_at(219), Some(100), "at the newest dropped mark");
        assert_eq!(f.plain_at(199), None, "before it");
        assert_eq!(f.plain_at(240), Some(120));
    }
}
