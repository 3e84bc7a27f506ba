//! Bounded histograms for statistics over samples: their size depends on the range of the
//! values, never on how many were added, so a chain sampled for days keeps the same state as
//! one sampled for seconds.

use std::collections::BTreeMap;

use super::window::HISTOGRAM_MAX;

/// The sample quantile `q` (0..=1) of a histogram of `n` values: the value at 1-based rank
/// ⌈q·n⌉ (at least 1) in ascending order, as of a sorted list of every value.
fn rank_quantile<K: Copy>(hist: &BTreeMap<K, u64>, q: f64) -> Option<K> {
    let n: u64 = hist.values().sum();
    if n == 0 {
        return None;
    }
    let target = ((q * n as f64).ceil() as u64).clamp(1, n);
    let mut acc = 0;
    for (&k, &c) in hist {
        acc += c;
        if acc >= target {
            return Some(k);
        }
    }
    None
}

/// Histogram of small counts (messages in a stage): exact for values up to
/// [`HISTOGRAM_MAX`] (4096; spice-server's count never exceeds 2W+2), larger values are kept
/// as [`HISTOGRAM_MAX`]. The maximum is exact. At most 4097 entries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CountHist {
    counts: BTreeMap<u32, u64>,
    max: Option<u32>,
}

impl CountHist {
    /// Adds one value.
    pub fn add(&mut self, v: u32) {
        *self.counts.entry(v.min(HISTOGRAM_MAX)).or_default() += 1;
        self.max = Some(self.max.map_or(v, |m| m.max(v)));
    }

    /// Values added.
    pub fn len(&self) -> u64 {
        self.counts.values().sum()
    }

    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// Quantile `q` (rank ⌈q·n⌉), `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<u32> {
        rank_quantile(&self.counts, q)
    }

    /// Largest value added (exact), `None` when empty.
    pub fn max(&self) -> Option<u32> {
        self.max
    }

    /// Distinct values kept.
    pub fn buckets(&self) -> usize {
        self.counts.len()
    }
}

/// Significant bits a [`LogHist`] keeps of each value.
pub const LOG_HIST_BITS: u32 = 8;

/// Histogram of values of any size (bytes, bytes per second) with 8 significant bits: values
/// below 256 are exact, larger ones are rounded down to their bucket's lower bound (relative
/// error below 1/128). At most 57 × 128 + 256 entries, whatever was added.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogHist {
    counts: BTreeMap<u64, u64>,
}

impl LogHist {
    /// The lower bound of the bucket holding `v`.
    pub fn bucket(v: u64) -> u64 {
        let bits = 64 - v.leading_zeros();
        let shift = bits.saturating_sub(LOG_HIST_BITS);
        (v >> shift) << shift
    }

    /// Adds one value.
    pub fn add(&mut self, v: u64) {
        *self.counts.entry(Self::bucket(v)).or_default() += 1;
    }

    /// Values added.
    pub fn len(&self) -> u64 {
        self.counts.values().sum()
    }

    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// Quantile `q` (rank ⌈q·n⌉) as its bucket's lower bound, `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        rank_quantile(&self.counts, q)
    }

    /// Buckets in use.
    pub fn buckets(&self) -> usize {
        self.counts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The quantile of a sorted list, as the report computed it before the histograms.
    fn sorted_quantile(v: &mut [u64], q: f64) -> u64 {
        v.sort_unstable();
        let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        v[i]
    }

    #[test]
    fn count_hist_matches_the_sorted_list() {
        let mut h = CountHist::default();
        let mut v = Vec::new();
        let mut x = 17u64;
        for _ in 0..1001 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let c = (x >> 33) % 90;
            h.add(c as u32);
            v.push(c);
        }
        for q in [0.0, 0.25, 0.5, 0.9, 1.0] {
            assert_eq!(
                u64::from(h.quantile(q).unwrap()),
                sorted_quantile(&mut v, q),
                "q={q}"
            );
        }
        assert_eq!(u64::from(h.max().unwrap()), *v.iter().max().unwrap());
        assert_eq!(h.len(), 1001);
        assert!(h.buckets() <= 90);
        assert_eq!(CountHist::default().quantile(0.5), None);
    }

    #[test]
    fn count_hist_is_bounded_and_keeps_the_exact_max() {
        let mut h = CountHist::default();
        for v in 0..100_000u32 {
            h.add(v);
        }
        assert!(h.buckets() <= HISTOGRAM_MAX as usize + 1);
        assert_eq!(h.max(), Some(99_999));
        assert_eq!(h.quantile(1.0), Some(HISTOGRAM_MAX));
    }

    #[test]
    fn log_hist_is_exact_below_256_and_within_1_in_128_above() {
        for v in [0u64, 1, 255] {
            assert_eq!(LogHist::bucket(v), v);
        }
        for v in [256u64, 1000, 65_537, 12_345_678, u64::MAX] {
            let b = LogHist::bucket(v);
            assert!(b <= v && (v - b) as f64 <= v as f64 / 128.0, "{v} -> {b}");
        }
        let mut h = LogHist::default();
        for v in (0..1_000_000u64).step_by(7) {
            h.add(v * 1000);
        }
        assert!(h.buckets() <= 57 * 128 + 256, "{}", h.buckets());
        let m = h.quantile(0.5).unwrap();
        let exact = (0..1_000_000u64).step_by(7).count() as u64;
        let want = (exact.div_ceil(2) - 1) * 7 * 1000;
        assert!(
            m <= want && (want - m) as f64 <= want as f64 / 128.0,
            "{m} vs {want}"
        );
    }
}
