//! The pipeline shared by every front end: [`Engine`] owns the kernel capture, the model, the
//! chains and the samples, and answers [`Engine::snapshot`] with a [`crate::report::Report`]
//! at any time. `observe` ([`crate::cmd::observe`]) and the daemon are thin front ends over
//! it: they arrange its calls and print, they compute no statistic.
//!
//! Order of the data: capture ([`crate::loader::Capture`]: programs, maps, the event ring) →
//! records ([`crate::events`]) → model ([`crate::model::Model`], chains) → samples
//! ([`crate::sampler`]: TCP positions, stage placement) → snapshot (a pure read).

mod engine;
pub mod sampler;
pub mod selftest;
pub mod ticker;

pub use engine::{
    Beside, Engine, EngineOptions, EngineStats, ProgramStats, Progress, Restart, Watched,
    thread_group,
};

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `ts`.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// CLOCK_REALTIME in nanoseconds since the Unix epoch (the clock of packet capture
/// timestamps, e.g. dumpcap's).
pub fn realtime_ns() -> u64 {
    clock_ns(libc::CLOCK_REALTIME)
}
