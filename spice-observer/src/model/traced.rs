//! Bytes of one socket direction as the kernel counts them, framed or not, and the rates
//! derived from successive reads.
//!
//! The source is the kernel's `DirState::pos` (`spice_ebpf_common::framing::DirState`, in
//! the `SOCKETS` map): the bytes moved by the socket calls the kernel traced in that direction
//! (`ret` of every send or receive call, spice-ebpf `capture.rs::on_call`) since it created
//! the socket's entry, at the socket's first traced call. It advances for every traced call,
//! whatever the framing: framed, hunting, unparsed, or not SPICE at all. Bytes moved by calls
//! the hooks do not trace (sendfile, splice) are not in it; such a call stops the framing
//! with `untraced_bytes`.

use std::collections::VecDeque;

/// How far back [`TracedBytes::rate_now`] looks: the newest read against the newest read at
/// least this long before it, nanoseconds (1 s).
pub const RATE_SPAN_NS: u64 = 1_000_000_000;

/// Most reads [`TracedBytes`] keeps for [`TracedBytes::rate_now`] (bounded whatever the
/// sample period; with the default 100 ms period, 11 cover [`RATE_SPAN_NS`]).
pub const RATE_READS: usize = 64;

/// The byte total of one direction at the reads of the kernel's socket map, and what rates
/// are counted from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TracedBytes {
    /// `DirState::pos` at the newest read (bytes), `None` before any read.
    pub total: Option<u64>,
    /// CLOCK_MONOTONIC ns of the newest read (0 before any).
    pub read_ns: u64,
    /// The total the mean rate counts from and when (bytes, CLOCK_MONOTONIC ns): `(0, when
    /// the agent first knew the socket)` for a socket whose kernel entry began after that
    /// (a new connection's first call, or a joined connection's first call after the agent
    /// marked it), the map's value and the restore time for a socket a restarted agent took
    /// over from pinned state ([`TracedBytes::since`]).
    pub base: u64,
    pub base_ns: u64,
    /// Recent reads (total, ns), oldest first, for [`TracedBytes::rate_now`].
    reads: VecDeque<(u64, u64)>,
}

impl TracedBytes {
    /// Counting from `base` bytes at `base_ns`.
    pub fn since(base: u64, base_ns: u64) -> Self {
        Self {
            base,
            base_ns,
            ..Default::default()
        }
    }

    /// Takes a read of the kernel's total `pos` made at `read_ns`. The kernel's value only
    /// grows; a smaller one (a read older than the newest, or an entry the kernel recreated)
    /// leaves the newest total as it is, so the total never decreases (a Prometheus counter).
    pub fn read(&mut self, pos: u64, read_ns: u64) {
        if self.total.is_some_and(|t| pos < t) || read_ns < self.read_ns {
            return;
        }
        self.total = Some(pos);
        self.read_ns = read_ns;
        self.reads.push_back((pos, read_ns));
        // Keep the newest read at least RATE_SPAN_NS before the newest, and those after it.
        while self.reads.len() > RATE_READS
            || (self.reads.len() > 1 && read_ns.saturating_sub(self.reads[1].1) >= RATE_SPAN_NS)
        {
            self.reads.pop_front();
        }
    }

    /// Mean rate from [`Self::base`] at [`Self::base_ns`] to the newest read, bytes per
    /// second; `None` before a read, or if the read is not later than the base.
    pub fn rate_mean(&self) -> Option<f64> {
        let total = self.total?;
        rate(self.base, self.base_ns, total, self.read_ns)
    }

    /// Rate over the newest second: from the newest read at least [`RATE_SPAN_NS`] before the
    /// newest read (or the oldest read kept, if none is that old) to the newest, bytes per
    /// second; with a single read, from the base. `None` before any read.
    pub fn rate_now(&self) -> Option<f64> {
        let &(b, t) = self.reads.back()?;
        match self.reads.front() {
            Some(&(a, s)) if s < t => rate(a, s, b, t),
            _ => rate(self.base, self.base_ns, b, t),
        }
    }

    /// Seconds after `first_ns` of the newest read, `None` before any read.
    pub fn read_at_s(&self, first_ns: u64) -> Option<f64> {
        self.total?;
        Some(self.read_ns.saturating_sub(first_ns) as f64 / 1e9)
    }
}

/// Bytes per second from `a` bytes at `s` ns to `b` bytes at `t` ns; `None` unless `t > s`.
pub fn rate(a: u64, s: u64, b: u64, t: u64) -> Option<f64> {
    (t > s).then(|| b.saturating_sub(a) as f64 * 1e9 / (t - s) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn no_read_no_figures() {
        let t = TracedBytes::since(0, 5 * MS);
        assert_eq!(t.total, None);
        assert_eq!(t.rate_mean(), None);
        assert_eq!(t.rate_now(), None);
        assert_eq!(t.read_at_s(0), None);
    }

    #[test]
    fn mean_counts_from_the_base() {
        // First known at 1 s; 1 MB by 3 s: 0.5 MB/s.
        let mut t = TracedBytes::since(0, 1000 * MS);
        t.read(1_000_000, 3000 * MS);
        assert_eq!(t.total, Some(1_000_000));
        assert_eq!(t.rate_mean(), Some(500_000.0));
        // A single read: the rate now is the mean.
        assert_eq!(t.rate_now(), Some(500_000.0));
        assert_eq!(t.read_at_s(1000 * MS), Some(2.0));
        // A restored socket counts from the map's value at the restore.
        let mut r = TracedBytes::since(7_000_000, 1000 * MS);
        r.read(8_000_000, 1500 * MS);
        assert_eq!(r.rate_mean(), Some(2_000_000.0));
    }

    #[test]
    fn rate_now_spans_the_newest_second() {
        // 100 ms reads: 1000 bytes each for 2 s, then 10 000 bytes each.
        let mut t = TracedBytes::since(0, 0);
        let mut pos = 0;
        for i in 1..=20 {
            pos += 1000;
            t.read(pos, i * 100 * MS);
        }
        assert_eq!(t.rate_now(), Some(10_000.0));
        for i in 21..=30 {
            pos += 10_000;
            t.read(pos, i * 100 * MS);
        }
        // 2.0 s .. 3.0 s: 100 000 bytes.
        assert_eq!(t.rate_now(), Some(100_000.0));
        assert_eq!(t.rate_mean(), Some((20_000.0 + 100_000.0) / 3.0));
        // Bounded whatever the period.
        for i in 0..1000 {
            pos += 1;
            t.read(pos, 3000 * MS + i * 1000);
        }
        assert!(t.reads.len() <= RATE_READS);
        assert!(t.rate_now().is_some());
    }

    #[test]
    fn the_total_never_decreases() {
        let mut t = TracedBytes::since(0, 0);
        t.read(500, 10 * MS);
        t.read(400, 20 * MS);
        assert_eq!((t.total, t.read_ns), (Some(500), 10 * MS));
        // An older read after a newer one is ignored too.
        t.read(600, 5 * MS);
        assert_eq!(t.total, Some(500));
        // Idle: the same total at a later read, rate 0.
        t.read(500, 1010 * MS);
        assert_eq!(t.rate_now(), Some(0.0));
    }

    #[test]
    fn rate_needs_time_to_pass() {
        assert_eq!(rate(0, 10, 100, 10), None);
        assert_eq!(rate(0, 0, 125_000, 1_000_000_000), Some(125_000.0));
        // A read at the base's own instant: no mean yet.
        let mut t = TracedBytes::since(0, 50);
        t.read(10, 50);
        assert_eq!(t.rate_mean(), None);
    }
}
