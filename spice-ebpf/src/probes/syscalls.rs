//! `raw_tracepoint/sys_enter`: stash the arguments of socket syscalls made by watched
//! processes, so that the socket tracepoint that follows in the same task can find the user
//! buffers. x86-64 only: syscall numbers and `pt_regs` layout (arch/x86/entry/syscalls/
//! syscall_64.tbl, arch/x86/include/asm/ptrace.h).
//!
//! Every syscall of the host runs this program: an unrelated one costs the `match` on its
//! number and nothing else; a socket-type syscall of an unwatched process one more map
//! lookup (`WATCHED_TGIDS`).

use aya_ebpf::{
    bindings::pt_regs,
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_kernel, bpf_probe_read_user},
};
use spice_ebpf_common::{
    config::counter,
    event::{PendingCall, call_kind},
};

use crate::maps::{PENDING_CALLS, count, traced_route};

const SYS_READ: u64 = 0;
const SYS_WRITE: u64 = 1;
const SYS_READV: u64 = 19;
const SYS_WRITEV: u64 = 20;
const SYS_SENDFILE: u64 = 40;
const SYS_SENDTO: u64 = 44;
const SYS_RECVFROM: u64 = 45;
const SYS_SENDMSG: u64 = 46;
const SYS_RECVMSG: u64 = 47;
const SYS_SPLICE: u64 = 275;
const SYS_RECVMMSG: u64 = 299;
const SYS_SENDMMSG: u64 = 307;
const SYS_PREADV2: u64 = 327;
const SYS_PWRITEV2: u64 = 328;
const SYS_IO_URING_ENTER: u64 = 426;

/// Offset of `msg_iov` in `struct user_msghdr` (msg_name 8, msg_namelen 4 + pad).
const MSGHDR_IOV: usize = 16;

/// The first three syscall arguments as `struct pt_regs` holds them: `dx`, `si`, `di` are
/// consecutive (offsets 96, 104, 112 on x86-64, arch/x86/include/asm/ptrace.h), so one read
/// gets all three.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Args3 {
    dx: u64,
    si: u64,
    di: u64,
}

/// Handles one `sys_enter`: `regs` is the syscall's `struct pt_regs *`, `id` its number.
#[inline(always)]
pub fn on_sys_enter(regs: *const pt_regs, id: u64) {
    let kind = match id {
        SYS_READ | SYS_WRITE | SYS_SENDTO | SYS_RECVFROM => call_kind::BUFFER,
        SYS_READV | SYS_WRITEV | SYS_SENDMSG | SYS_RECVMSG => call_kind::IOVEC,
        SYS_SENDFILE | SYS_SPLICE | SYS_RECVMMSG | SYS_SENDMMSG | SYS_PREADV2 | SYS_PWRITEV2
        | SYS_IO_URING_ENTER => call_kind::UNSUPPORTED,
        _ => return,
    };
    stash(regs, id, kind);
}

/// The socket-type syscall `id` of kind `kind`: saves its arguments if the process is traced.
/// Updates the thread's `PENDING_CALLS` entry in place when it has one (a lookup instead of
/// an insert that allocates and frees an element).
#[inline(always)]
fn stash(regs: *const pt_regs, id: u64, kind: u8) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(route) = traced_route((pid_tgid >> 32) as u32) else {
        return;
    };
    let a: Args3 = unsafe { bpf_probe_read_kernel(&raw const (*regs).rdx as *const Args3) }
        .unwrap_or_default();
    let (mut ptr, mut len) = (a.si, a.dx);
    if id == SYS_SENDMSG || id == SYS_RECVMSG {
        // (fd, struct user_msghdr *msg, flags): the iovec array is inside the msghdr.
        let iov: [u64; 2] =
            unsafe { bpf_probe_read_user((a.si as usize + MSGHDR_IOV) as *const [u64; 2]) }
                .unwrap_or([0, 0]);
        ptr = iov[0];
        len = iov[1];
    }
    if let Some(p) = PENDING_CALLS.get_ptr_mut(&pid_tgid) {
        // SAFETY: the thread's own entry; only this thread's programs write it.
        unsafe {
            (*p).kind = kind;
            (*p).watch = route;
            (*p).fd = a.di as i32;
            (*p).ptr = ptr;
            (*p).len = len;
            (*p).live = 1;
        }
        return;
    }
    let call = PendingCall {
        kind,
        watch: route,
        live: 1,
        _pad: 0,
        fd: a.di as i32,
        ptr,
        len,
    };
    if PENDING_CALLS.insert(&pid_tgid, &call, 0).is_err() {
        count(counter::PENDING_MAP_FULL);
    }
}
