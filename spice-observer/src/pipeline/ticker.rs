//! The front ends' periodic clocks, on kernel timers (`timerfd_create(2)`, CLOCK_MONOTONIC),
//! one wake-up of the agent per period.
//!
//! Why not `tokio::time::interval`: tokio's timer wheel keeps a timer due in 64 ms or more
//! in a coarser level and wakes the runtime once when that level's slot comes round, to move
//! the timer down, then again when it is due (tokio `runtime/time/wheel`: six levels of 64
//! slots, 1 ms apart at level 0). A 100 ms interval thus woke the agent twice per sample, and
//! the 100 ms drain timeout that [`super::Engine::drain_ready`] re-armed on every pass of the
//! front end's loop added more: 24 voluntary context switches per second of `observe` at
//! 10 sessions × 635 messages/s, for 10 samples and about 4 ring wake-ups (`strace -e
//! epoll_wait` showed most waits ending in a timeout 5–60 ms after the previous one). In a
//! perf profile of that run, waiting and waking up took 22 % of `observe`'s CPU.

use std::{os::fd::OwnedFd, time::Duration};

use anyhow::{Context, Result};
use rustix::time::{
    Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, timerfd_create, timerfd_settime,
};
use tokio::io::{Interest, unix::AsyncFd};

use spice_ebpf_common::config::ring;

/// A periodic timer: [`Ticker::tick`] completes once per period, the first time right away
/// (as `tokio::time::interval`). Periods missed while the caller was busy are skipped, not
/// made up in a burst (tokio's `MissedTickBehavior::Skip`).
pub struct Ticker {
    fd: AsyncFd<OwnedFd>,
    period: Duration,
}

impl Ticker {
    /// A timer of `period` (at least 1 ms) on the current tokio runtime. Errors: the
    /// kernel's (`timerfd_create`, `timerfd_settime`, or registering it with the runtime).
    pub fn new(period: Duration) -> Result<Self> {
        let fd = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
        )
        .context("timerfd_create")?;
        // SAFETY: `fd` is the timer just created, owned by the AsyncFd until it is dropped.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(|e| e.into_parts().1)
            .context("registering a timerfd with the runtime")?;
        let t = Ticker {
            fd,
            period: period.max(Duration::from_millis(1)),
        };
        t.reset_immediately()?;
        Ok(t)
    }

    /// Restarts the timer: the next [`Ticker::tick`] completes right away, the following ones
    /// a period apart from now.
    pub fn reset_immediately(&self) -> Result<()> {
        let p = rustix::time::Timespec {
            tv_sec: self.period.as_secs() as _,
            tv_nsec: self.period.subsec_nanos() as _,
        };
        // it_value 1 ns: the first expiry at once (0 would disarm the timer).
        let first = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 1,
        };
        timerfd_settime(
            self.fd.get_ref(),
            TimerfdTimerFlags::empty(),
            &Itimerspec {
                it_interval: p,
                it_value: first,
            },
        )
        .context("timerfd_settime")?;
        Ok(())
    }

    /// Waits for the next expiry; returns how many periods expired since the last call (≥ 1).
    /// Cancel-safe (for `tokio::select!`): an expiry not consumed stays pending. Errors: a
    /// failed read of the timer other than `EAGAIN`.
    pub async fn tick(&mut self) -> Result<u64> {
        loop {
            let mut guard = self.fd.readable().await?;
            let mut buf = [0u8; 8];
            match rustix::io::read(guard.get_inner(), &mut buf) {
                Ok(8) => return Ok(u64::from_ne_bytes(buf)),
                Ok(n) => anyhow::bail!("timerfd read returned {n} bytes"),
                Err(rustix::io::Errno::AGAIN) => guard.clear_ready(),
                Err(e) => return Err(e).context("reading a timerfd"),
            }
        }
    }
}

/// What a [`SampleClock`] tick asks of the front end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Due {
    /// Take a sample (it drains the ring before and after its reads).
    Sample,
    /// Only drain the ring: the sample period is longer than [`ring::DRAIN_INTERVAL_MS`],
    /// the longest a record may wait in the ring when no wake-up comes.
    Drain,
}

/// The clock of a front end's samples and of its ring drains: one timer, ticking every
/// sample period, or, for a period longer than [`ring::DRAIN_INTERVAL_MS`], every equal part
/// of it no longer than that (a sample at every N-th tick, a drain at the others). With the
/// default 100 ms sample period, one wake-up per sample and none besides (ring wake-ups
/// aside).
pub struct SampleClock {
    ticker: Ticker,
    /// Ticks since the last sample, and ticks per sample.
    ticks: u64,
    every: u64,
}

impl SampleClock {
    /// A clock for samples every `sample`. Errors as [`Ticker::new`].
    pub fn new(sample: Duration) -> Result<Self> {
        let drain = Duration::from_millis(ring::DRAIN_INTERVAL_MS);
        let (period, every) = Self::plan(sample, drain);
        Ok(SampleClock {
            ticker: Ticker::new(period)?,
            // The first tick samples.
            ticks: every,
            every,
        })
    }

    /// The timer period and the ticks per sample for sample period `sample` and drain bound
    /// `drain`.
    fn plan(sample: Duration, drain: Duration) -> (Duration, u64) {
        if sample <= drain {
            return (sample, 1);
        }
        let every = sample.as_nanos().div_ceil(drain.as_nanos()).max(1);
        let period = sample / every as u32;
        (period, every as u64)
    }

    /// Waits for the next tick and says what is due. Cancel-safe. Errors as [`Ticker::tick`].
    pub async fn tick(&mut self) -> Result<Due> {
        let n = self.ticker.tick().await?;
        self.ticks += n;
        if self.ticks >= self.every {
            self.ticks = 0;
            Ok(Due::Sample)
        } else {
            Ok(Due::Drain)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_period_longer_than_the_drain_bound_is_split_into_drain_ticks() {
        let ms = Duration::from_millis;
        assert_eq!(SampleClock::plan(ms(100), ms(100)), (ms(100), 1));
        assert_eq!(SampleClock::plan(ms(50), ms(100)), (ms(50), 1));
        assert_eq!(SampleClock::plan(ms(1000), ms(100)), (ms(100), 10));
        // 250 ms: 3 ticks of 83.3 ms, none longer than the bound.
        let (p, every) = SampleClock::plan(ms(250), ms(100));
        assert_eq!(every, 3);
        assert!(p <= ms(100) && p * 3 <= ms(250) && p * 3 > ms(249), "{p:?}");
    }

    /// A real timerfd: the first tick at once, then one tick that counts the periods a busy
    /// stretch missed (no burst of ticks after it).
    #[test]
    fn missed_periods_come_as_one_tick_that_counts_them() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut t = Ticker::new(Duration::from_millis(20)).unwrap();
            assert_eq!(t.tick().await.unwrap(), 1);
            // Busy for more than 3 periods.
            std::thread::sleep(Duration::from_millis(70));
            let n = t.tick().await.unwrap();
            assert!(n >= 3, "{n}");
        });
    }
}
