//! Hook set `kprobes`: a kprobe at the entry and a kretprobe at the return of `tcp_sendmsg`
//! and `tcp_recvmsg` (and of `tcp_sendpage` where it exists), for kernels without the socket
//! tracepoints (Linux 6.3) where BPF trampolines (fentry/fexit) are refused.
//!
//! A kretprobe program sees only the return registers, not the arguments, so the entry
//! program keeps the call's socket and flags for its thread in [`KPROBE_CALLS`] and the
//! return program takes them back. Both turn away an unwatched process first, at the cost of
//! the [`traced_route`] filter. The socket pointer comes from a register, not from a BTF-typed
//! argument, so everything read from it goes through `bpf_probe_read_kernel` (the `RAW` path
//! of [`on_call`], as hook set `syscalls`), and the cookie is the socket's `skc_cookie`.
//!
//! Both kinds of program run with preemption off (the kprobe handler and the kretprobe's
//! rethook handler, kernel/kprobes.c, kernel/trace/rethook.c; `trace_call_bpf`,
//! kernel/trace/bpf_trace.c, counts per-CPU `bpf_prog_active`), so the call uses this CPU's
//! scratch entry.
//!
//! A kretprobe has a bounded number of instances (`maxactive`), held by every thread of the
//! host that is inside the function, blocked receivers included. A call that finds none free
//! has no return probe. perf's `kprobe` PMU gives the default, max(10, 2 × possible CPUs)
//! (kernel/kprobes.c `register_kretprobe`), which the 6.12 guest's test peers used up, so the
//! agent defines these return probes through tracefs with 4096
//! (`spice-observer/src/kernel/kretprobe.rs`). A call that still finds none is counted by the
//! kernel (`kprobe_profile`, warned by the agent); its bytes are found untraced by the
//! direction's next call, except on a socket's first call, where nothing yet shows that
//! bytes came before.

use aya_ebpf::helpers::bpf_get_current_pid_tgid;
use spice_ebpf_common::event::{call_kind, dir};

use crate::{
    kernel::raw_tcp_sock,
    maps::{KPROBE_CALLS, traced_route},
    probes::{
        sock_calls::{MSG_ERRQUEUE, MSG_PEEK, MSG_TRUNC},
        syscalls::{current_call, on_raw_sock_call},
    },
};

/// Entry of `tcp_sendmsg(sk, msg, size)`, `tcp_sendpage(sk, …)` or
/// `tcp_recvmsg(sk, msg, len, flags, addr_len)`: remembers `sk` and `flags` (0 for sends) for
/// the return.
#[inline(always)]
pub fn on_entry(sk: u64, flags: u64) {
    let pid_tgid = bpf_get_current_pid_tgid();
    if traced_route((pid_tgid >> 32) as u32).is_none() {
        return;
    }
    let _ = KPROBE_CALLS.insert(&pid_tgid, &[sk, flags], 0);
}

/// Return of the call [`on_entry`] saw, `ret` the function's return value (bytes taken or
/// given, or a negative errno), `direction` [`dir::SEND`] or [`dir::RECV`].
#[inline(always)]
pub fn on_return(ret: i64, direction: u8) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(route) = traced_route((pid_tgid >> 32) as u32) else {
        return;
    };
    let Some(&[sk, flags]) = (unsafe { KPROBE_CALLS.get(&pid_tgid) }) else {
        return;
    };
    let _ = KPROBE_CALLS.remove(&pid_tgid);
    let flags = flags as i32;
    if direction == dir::RECV && flags & (MSG_PEEK | MSG_ERRQUEUE) != 0 {
        return;
    }
    let sk = raw_tcp_sock(sk as *const u8);
    if sk.is_null() {
        return;
    }
    let mut args = current_call(route);
    if direction == dir::RECV && flags & MSG_TRUNC != 0 {
        args.kind = call_kind::UNSUPPORTED;
    }
    // The function returns an `int`: the low half of the register.
    let ret = ret as i32;
    if direction == dir::SEND {
        on_raw_sock_call::<true>(sk, direction, ret, args, pid_tgid);
    } else {
        on_raw_sock_call::<false>(sk, direction, ret, args, pid_tgid);
    }
}
