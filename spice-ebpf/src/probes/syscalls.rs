//! The syscall a socket call runs in, read from the calling task's saved user registers at the
//! socket tracepoint itself: which call it is and where its user buffers are. No program runs
//! at syscall entry, so the host's other syscalls pay nothing.
//!
//! x86-64 only: syscall numbers and the `struct pt_regs` a syscall saves at the top of the
//! task's kernel stack (arch/x86/entry/syscalls/syscall_64.tbl, arch/x86/include/asm/ptrace.h;
//! `bpf_task_pt_regs`, kernel/trace/bpf_trace.c, Linux 5.15). The registers hold the
//! arguments as the syscall received them: the kernel does not write `di`, `si`, `dx` or
//! `orig_ax` while it runs.

use aya_ebpf::{
    bindings::pt_regs,
    helpers::{
        bpf_probe_read_user,
        generated::{bpf_get_current_task_btf, bpf_task_pt_regs},
    },
};
use spice_ebpf_common::event::{CallArgs, call_kind};

const SYS_READ: u64 = 0;
const SYS_WRITE: u64 = 1;
const SYS_READV: u64 = 19;
const SYS_WRITEV: u64 = 20;
const SYS_SENDTO: u64 = 44;
const SYS_RECVFROM: u64 = 45;
const SYS_SENDMSG: u64 = 46;
const SYS_RECVMSG: u64 = 47;

/// `__USER_CS` (arch/x86/include/asm/segment.h): the code segment of a 64-bit user task's
/// syscall. A 32-bit (compat) syscall has `__USER32_CS` and other numbers.
const USER_CS: u64 = 0x33;

/// Offset of `msg_iov` in `struct user_msghdr` (msg_name 8, msg_namelen 4 + pad).
const MSGHDR_IOV: usize = 16;

/// Loads one saved register: a plain load from the BTF-typed `struct pt_regs *` that
/// `bpf_task_pt_regs` returns (the verifier checks the field; the JIT's load reads zero on a
/// fault), cheaper than a `bpf_probe_read_kernel` call.
macro_rules! reg {
    ($regs:expr, $field:ident) => {
        unsafe { core::ptr::read_volatile(&raw const (*$regs).$field) }
    };
}

/// The arguments of the syscall the current task is in, for a socket call of a process whose
/// records go to the rings `route` names ([`CallArgs::watch`]).
///
/// [`call_kind::UNSUPPORTED`] when its bytes cannot be read from the arguments: sendfile,
/// splice, sendmmsg, recvmmsg, io_uring_enter, preadv2/pwritev2 and any other syscall; a
/// compat (32-bit) syscall; or no syscall at all: an io_uring worker (`copy_thread` gives it
/// a copy of its creator's registers with `ip` 0, arch/x86/kernel/process.c). Only calls on
/// a user's socket get here ([`crate::kernel::user_socket`]): a kernel socket's call in a
/// watched thread (NFS) is not the syscall's.
///
/// Not told apart: io_uring work that the task runs on its way out of another syscall
/// (task_work, without `IORING_SETUP_DEFER_TASKRUN`) takes that syscall's registers. If that
/// syscall is one of the read/write family above, its buffer is taken for the io_uring
/// call's. spice-server and the relays do not use io_uring for sockets.
#[inline(always)]
pub fn current_call(route: u8) -> CallArgs {
    let regs = unsafe { bpf_task_pt_regs(bpf_get_current_task_btf()) } as *const pt_regs;
    let mut call = CallArgs {
        kind: call_kind::UNSUPPORTED,
        watch: route,
        _pad: [0; 2],
        fd: 0,
        ptr: 0,
        len: 0,
    };
    // The low 16 bits: with FRED the slot's upper bits carry other fields.
    if reg!(regs, cs) & 0xffff != USER_CS || reg!(regs, rip) == 0 {
        return call;
    }
    let id = reg!(regs, orig_rax);
    call.kind = match id {
        SYS_READ | SYS_WRITE | SYS_SENDTO | SYS_RECVFROM => call_kind::BUFFER,
        SYS_READV | SYS_WRITEV | SYS_SENDMSG | SYS_RECVMSG => call_kind::IOVEC,
        _ => return call,
    };
    call.fd = reg!(regs, rdi) as i32;
    call.ptr = reg!(regs, rsi);
    call.len = reg!(regs, rdx);
    if id == SYS_SENDMSG || id == SYS_RECVMSG {
        // (fd, struct user_msghdr *msg, flags): the iovec array is inside the msghdr.
        let iov: [u64; 2] =
            unsafe { bpf_probe_read_user((call.ptr as usize + MSGHDR_IOV) as *const [u64; 2]) }
                .unwrap_or([0, 0]);
        call.ptr = iov[0];
        call.len = iov[1];
    }
    call
}
