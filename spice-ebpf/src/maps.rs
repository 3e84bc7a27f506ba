//! Maps shared by the kernel programs. Sizes are upper bounds for one host.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
};
use spice_ebpf_common::{
    config::{counter, ring, watch},
    event::{SockState, SslKey, TlsCall},
};

use crate::capture::{CallScratch, ReadWindow};

/// Watched processes: tgid → the `--pid` it descends from, with the flags of who reads its
/// records (`spice_ebpf_common::config::watch`). Filled by the agents, extended by the fork
/// hook (children inherit the value). The one lookup that decides whether a syscall is ours.
#[map]
pub static WATCHED_TGIDS: HashMap<u32, u32> = HashMap::with_max_entries(4096, 0);

/// The filter in front of `WATCHED_TGIDS` ([`watch::FILTER_LEN`]): entry
/// `watch::filter_index(tgid)` is 1 once a process with that index was watched, never
/// cleared. Checked first by every hook that asks "is this process ours?", so an unrelated
/// process costs one array load there instead of a hash lookup (measured: a hash miss alone
/// took 130-230 ns per `sock_send_length` run under iperf3, an array load 15 ns).
#[map]
pub static MAYBE_WATCHED: Array<u8> = Array::with_max_entries(watch::FILTER_LEN, 0);

/// Whether process `tgid` may be watched ([`MAYBE_WATCHED`]): false means it is not.
#[inline(always)]
pub fn maybe_watched(tgid: u32) -> bool {
    MAYBE_WATCHED
        .get(watch::filter_index(tgid))
        .is_some_and(|v| *v != 0)
}

/// Sets process `tgid`'s [`MAYBE_WATCHED`] entry: before its `WATCHED_TGIDS` entry is made.
#[inline(always)]
pub fn set_maybe_watched(tgid: u32) {
    if let Some(p) = MAYBE_WATCHED.get_ptr_mut(watch::filter_index(tgid)) {
        unsafe { *p = 1 };
    }
}

/// The hooked libssl call a watched thread is in: pid_tgid → call (entry arguments, and the
/// cookie of a socket a socket call inside it used). Written at the function's entry, taken
/// at its return; a thread that exits inside the call loses its entry at `sched_process_exit`
/// (a plain hash: an LRU insert costs more on every call).
#[map]
pub static TLS_CALLS: HashMap<u64, TlsCall> = HashMap::with_max_entries(16384, 0);

/// The hooked TCP call a watched thread is in: pid_tgid → `[struct sock *, flags]`. Written
/// at the function's entry, taken at its return; a thread that exits inside the call (or
/// whose return was not probed) leaves an entry that its next call overwrites, or that
/// `sched_process_exit` removes (hook set `kprobes`, `probes/kprobes.rs`).
#[map]
pub static KPROBE_CALLS: HashMap<u64, [u64; 2]> = HashMap::with_max_entries(16384, 0);

/// Each thread's working space for framing a libssl call's plaintext
/// ([`crate::capture::CallScratch`]; per thread because a uprobe program can be preempted):
/// pid_tgid → scratch, made at the thread's first framed call, removed at its exit with its
/// `TLS_CALLS` entry. Not pinned: nothing outside one program run reads it.
#[map]
pub static TLS_SCRATCH: HashMap<u64, CallScratch> = HashMap::with_max_entries(16384, 0);

/// The socket tracepoints' working space for one call ([`crate::capture::CallScratch`]): one
/// per-CPU entry (they run with preemption off). Not pinned.
#[map]
pub static CALL_SCRATCH: PerCpuArray<CallScratch> = PerCpuArray::with_max_entries(1, 0);

/// The element loop's [`crate::capture::ReadWindow`] for the programs that use
/// [`CALL_SCRATCH`]: one per-CPU entry (2080 bytes). Not pinned.
#[map]
pub static READ_WINDOW: PerCpuArray<ReadWindow> = PerCpuArray::with_max_entries(1, 0);

/// `SSL *` of a watched process → the cookie of the socket its calls move bytes on, learned
/// from the socket calls made inside libssl calls on it. LRU: `SSL_free` is not hooked.
#[map]
pub static SSL_SOCKETS: LruHashMap<SslKey, u64> = LruHashMap::with_max_entries(16384, 0);

/// Framing state per socket: cookie → state. Removed when the socket closes.
#[map]
pub static SOCKETS: HashMap<u64, SockState> = HashMap::with_max_entries(8192, 0);

/// Local ports of the watched processes' listening sockets: sockops enrols new connections to
/// or from these ports for RTT / retransmit / state callbacks.
#[map]
pub static WATCH_PORTS: HashMap<u16, u8> = HashMap::with_max_entries(1024, 0);

/// Cookies of sockets that existed (and may have carried data) before observation started.
#[map]
pub static PREEXISTING: HashMap<u64, u8> = HashMap::with_max_entries(8192, 0);

/// Records to the agent (see `spice_ebpf_common::event`). 4 MiB ≈ 52,000 message records
/// (80-byte slots): 8 s of 10 sessions × 635 messages/s without a reader (a daemon restart).
/// The agent maps the ring's data twice (the kernel's wrap-around mapping), and those pages
/// count in its resident set: 8 MiB at this size, 32 MiB at 16 MiB.
#[map]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(4 << 20, 0);

/// Records for an `observe` beside the daemon (`--pid` of processes whose watch value has
/// `watch::TAP`): the same records as `EVENTS`, for those processes only, so that `EVENTS`
/// keeps its one consumer. 4 MiB ≈ 52,000 message records.
#[map]
pub static TAP_EVENTS: RingBuf = RingBuf::with_byte_size(4 << 20, 0);

/// Loss and self counters (`spice_ebpf_common::config::counter`).
#[map]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

/// Bytes of records this CPU submitted to `EVENTS` (entry 0) and `TAP_EVENTS` (entry 1)
/// since it last forced a wake-up of that ring's reader ([`write_record`],
/// `spice_ebpf_common::config::ring`). Not pinned: a fresh count after a reload only delays
/// one wake-up.
#[map]
pub static RING_PENDING: PerCpuArray<u64> = PerCpuArray::with_max_entries(2, 0);

/// One all-zero `SockState`: the template for new `SOCKETS` entries (too big for the stack).
#[map]
pub static ZERO_SOCK: Array<SockState> = Array::with_max_entries(1, 0);

/// What the pinned state is (written by the agent after loading, never by the programs):
/// `spice_ebpf_common::config::layout` indexes, e.g. the layout version and the sizes of the
/// map values and records. A restarted agent compares it with its own before reusing the
/// pinned maps.
#[map]
pub static LAYOUT: Array<u32> =
    Array::with_max_entries(spice_ebpf_common::config::layout::COUNT, 0);

/// Writes one record of type `T` to each ring `route` names
/// (`spice_ebpf_common::config::watch::ROUTE_*`): reserves it, lets `fill` write it in place
/// (the BPF stack is too small for a copy) and submits it. A full ring counts `RING_FULL`
/// (`EVENTS`) or `TAP_RING_FULL` (`TAP_EVENTS`). The agent is not woken for each record: see
/// [`spice_ebpf_common::config::ring`].
#[inline(always)]
pub fn write_record<T: 'static>(route: u8, fill: impl Fn(*mut T)) {
    use spice_ebpf_common::config::watch::{ROUTE_PRIMARY, ROUTE_TAP};
    if route & ROUTE_PRIMARY != 0 {
        write_one(&EVENTS, counter::RING_FULL, 0, &fill);
    }
    if route & ROUTE_TAP != 0 {
        write_one(&TAP_EVENTS, counter::TAP_RING_FULL, 1, &fill);
    }
}

/// [`write_record`] for one ring; `full` is the counter of a failed reserve, `pending` the
/// ring's entry in [`RING_PENDING`].
#[inline(always)]
fn write_one<T: 'static>(rb: &RingBuf, full: u32, pending: u32, fill: &impl Fn(*mut T)) {
    match rb.reserve::<T>(0) {
        Some(mut e) => {
            fill(e.as_mut_ptr());
            let mut flags = 1;
            if let Some(p) = RING_PENDING.get_ptr_mut(pending) {
                let every = crate::kernel::konf!(ring_wakeup_bytes) as u64;
                let (f, next) =
                    ring::submit_flags(unsafe { *p }, ring::slot_len(size_of::<T>()), every);
                unsafe { *p = next };
                flags = f;
            }
            e.submit(flags);
        }
        None => count(full),
    }
}

/// The rings the records of process `tgid` go to ([`watch::route`] of its `WATCHED_TGIDS`
/// value), or `None` when no one reads them: not watched, no route, or the observer itself.
/// The one lookup that decides whether an entry hook's call is ours (after the
/// [`maybe_watched`] filter, which turns away most processes that are not).
#[inline(always)]
pub fn traced_route(tgid: u32) -> Option<u8> {
    if !maybe_watched(tgid) {
        return None;
    }
    let route = watch::route(unsafe { *WATCHED_TGIDS.get_ptr(&tgid)? });
    if route == 0 || tgid == crate::kernel::konf!(self_tgid) {
        return None;
    }
    Some(route)
}

/// Adds 1 to counter `index`.
#[inline(always)]
pub fn count(index: u32) {
    if let Some(c) = COUNTERS.get_ptr_mut(index) {
        unsafe { *c += 1 };
    }
}
