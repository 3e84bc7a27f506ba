//! Maps shared by the kernel programs. Sizes are upper bounds for one host.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, PerCpuArray, RingBuf},
};
use spice_ebpf_common::{
    config::counter,
    event::{PendingCall, SockState, TcpSnapshot},
};

/// Watched processes: tgid → the `--pid` it descends from. Filled by the agent, extended by
/// the fork hook. The one lookup that decides whether a syscall is ours.
#[map]
pub static WATCHED_TGIDS: HashMap<u32, u32> = HashMap::with_max_entries(4096, 0);

/// Arguments of the socket syscall a watched thread is in: pid_tgid → call.
#[map]
pub static PENDING_CALLS: HashMap<u64, PendingCall> = HashMap::with_max_entries(16384, 0);

/// Framing state per socket: cookie → state. Removed when the socket closes.
#[map]
pub static SOCKETS: HashMap<u64, SockState> = HashMap::with_max_entries(8192, 0);

/// Latest TCP state per tracked socket: cookie → snapshot. Read by the agent.
#[map]
pub static TCP_STATE: HashMap<u64, TcpSnapshot> = HashMap::with_max_entries(8192, 0);

/// Local ports of the watched processes' listening sockets: sockops enrols new connections to
/// or from these ports for RTT / retransmit / state callbacks.
#[map]
pub static WATCH_PORTS: HashMap<u16, u8> = HashMap::with_max_entries(1024, 0);

/// Cookies of sockets that existed (and may have carried data) before observation started.
#[map]
pub static PREEXISTING: HashMap<u64, u8> = HashMap::with_max_entries(8192, 0);

/// Records to the agent (see `spice_ebpf_common::event`). 16 MiB ≈ 300,000 message records.
#[map]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(16 << 20, 0);

/// Loss and self counters (`spice_ebpf_common::config::counter`).
#[map]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

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

/// Adds 1 to counter `index`.
#[inline(always)]
pub fn count(index: u32) {
    if let Some(c) = COUNTERS.get_ptr_mut(index) {
        unsafe { *c += 1 };
    }
}
