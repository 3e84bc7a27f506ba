//! The syscall a socket call runs in, read from the calling task's saved user registers: which
//! call it is and where its user buffers are. Hook set `tracepoints` reads them at the socket
//! tracepoint itself, and no program runs at syscall entry or exit, so the host's other
//! syscalls pay nothing. Hook set `syscalls` ([`on_sys_exit`]) has no socket hook: it runs at
//! every syscall's exit, turns away all but the watched processes' socket calls, and finds
//! the socket from the call's file descriptor.
//!
//! x86-64 only: syscall numbers and the `struct pt_regs` a syscall saves at the top of the
//! task's kernel stack (arch/x86/entry/syscalls/syscall_64.tbl, arch/x86/include/asm/ptrace.h;
//! `bpf_task_pt_regs`, kernel/trace/bpf_trace.c, Linux 5.15). The registers hold the
//! arguments as the syscall received them: the kernel does not write `di`, `si`, `dx` or
//! `orig_ax` while it runs.

use aya_ebpf::{
    bindings::pt_regs,
    helpers::{
        bpf_get_current_pid_tgid, bpf_probe_read_user,
        generated::{bpf_get_current_task_btf, bpf_task_pt_regs},
    },
};
use spice_ebpf_common::{
    config::counter,
    event::{CallArgs, call_kind, dir},
};

use crate::{
    capture::{Call, EAGAIN, on_call},
    kernel::{fd_tcp_sock, konf, read_at},
    maps::{count, traced_route},
    probes::sock_calls::{MSG_ERRQUEUE, MSG_PEEK, MSG_TRUNC},
};

const SYS_READ: u64 = 0;
const SYS_WRITE: u64 = 1;
const SYS_READV: u64 = 19;
const SYS_WRITEV: u64 = 20;
const SYS_SENDTO: u64 = 44;
const SYS_RECVFROM: u64 = 45;
const SYS_SENDMSG: u64 = 46;
const SYS_RECVMSG: u64 = 47;
const SYS_SENDFILE: u64 = 40;

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
    syscall(route).1
}

/// What [`syscall`] read besides the [`CallArgs`]: the syscall number (`u64::MAX` when the
/// task is not in a 64-bit syscall) and the `flags` argument of sendto / recvfrom (4th,
/// `r10`) and sendmsg / recvmsg (3rd, `rdx`), 0 for the others.
#[derive(Clone, Copy)]
pub struct Syscall {
    pub nr: u64,
    pub flags: i32,
}

/// The current task's syscall ([`Syscall`]) and its arguments ([`current_call`]).
#[inline(always)]
fn syscall(route: u8) -> (Syscall, CallArgs) {
    let regs = unsafe { bpf_task_pt_regs(bpf_get_current_task_btf()) } as *const pt_regs;
    let mut call = CallArgs {
        kind: call_kind::UNSUPPORTED,
        watch: route,
        _pad: [0; 2],
        fd: 0,
        ptr: 0,
        len: 0,
    };
    let mut sys = Syscall {
        nr: u64::MAX,
        flags: 0,
    };
    // The low 16 bits: with FRED the slot's upper bits carry other fields.
    if reg!(regs, cs) & 0xffff != USER_CS || reg!(regs, rip) == 0 {
        return (sys, call);
    }
    let id = reg!(regs, orig_rax);
    sys.nr = id;
    // The first argument: the socket of every call below, and sendfile's out_fd.
    call.fd = reg!(regs, rdi) as i32;
    call.kind = match id {
        SYS_READ | SYS_WRITE | SYS_SENDTO | SYS_RECVFROM => call_kind::BUFFER,
        SYS_READV | SYS_WRITEV | SYS_SENDMSG | SYS_RECVMSG => call_kind::IOVEC,
        _ => return (sys, call),
    };
    call.ptr = reg!(regs, rsi);
    call.len = reg!(regs, rdx);
    if id == SYS_SENDTO || id == SYS_RECVFROM {
        sys.flags = reg!(regs, r10) as i32;
    }
    if id == SYS_SENDMSG || id == SYS_RECVMSG {
        // (fd, struct user_msghdr *msg, flags): the iovec array is inside the msghdr.
        sys.flags = call.len as i32;
        let iov: [u64; 2] =
            unsafe { bpf_probe_read_user((call.ptr as usize + MSGHDR_IOV) as *const [u64; 2]) }
                .unwrap_or([0, 0]);
        call.ptr = iov[0];
        call.len = iov[1];
    }
    (sys, call)
}

/// Hook set `syscalls`: the exit of any syscall of any task (`raw_tracepoint/sys_exit`,
/// include/trace/events/syscalls.h), `ret` its return value.
///
/// Everything but a watched process's read, write, readv, writev, sendto, recvfrom, sendmsg
/// or recvmsg is turned away first, at the cost of the [`traced_route`] filter (most
/// processes) and a load of the saved syscall number. Then, as the socket tracepoints' path
/// does ([`super::sock_calls::on_sock_length`]): the direction from the syscall, peeks and
/// error-queue reads skipped, `MSG_TRUNC` reads unsupported; the socket from the fd
/// ([`fd_tcp_sock`]: only TCP sockets go on); its cookie read from `skc_cookie`, which the
/// kernel fills in at the first `sock_gen_cookie` (net/core/sock_diag.c): given at
/// `inet_sock_set_state` to every connection established while the programs run, and by the
/// agent's sock_diag dumps to the watched processes' older ones. A call that moved bytes on a
/// socket with no cookie yet is counted ([`counter::NO_COOKIE`]) and dropped. Sends and
/// receives share one instance of [`on_call`] (its send-only EAGAIN path tests the direction).
///
/// The syscall's return value is what the socket call returned (`sock_sendmsg` /
/// `sock_recvmsg`, net/socket.c: a read or write on a socket file is one such call), except
/// that a call interrupted after moving bytes may return them: the same bytes either way.
/// sendfile to a socket is an unsupported call on it (its bytes stop that direction). Calls
/// this hook does not follow (splice, sendmmsg, recvmmsg, io_uring: their return value is not
/// one socket's byte count) move bytes the next seen call's sequence check finds untraced.
#[inline(always)]
pub fn on_sys_exit(ret: i64) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(route) = traced_route((pid_tgid >> 32) as u32) else {
        return;
    };
    if ret <= 0 && ret != -(EAGAIN as i64) {
        return;
    }
    let (sys, mut args) = syscall(route);
    let direction = match sys.nr {
        // sendfile's bytes are not in user memory: an unsupported call on its out_fd, which
        // stops that direction at once (the tracepoints see it as a socket send too).
        SYS_WRITE | SYS_WRITEV | SYS_SENDTO | SYS_SENDMSG | SYS_SENDFILE => dir::SEND,
        SYS_READ | SYS_READV | SYS_RECVFROM | SYS_RECVMSG => dir::RECV,
        _ => return,
    };
    if ret < 0 && direction == dir::RECV {
        return;
    }
    if direction == dir::RECV {
        if sys.flags & (MSG_PEEK | MSG_ERRQUEUE) != 0 {
            return;
        }
        if sys.flags & MSG_TRUNC != 0 {
            args.kind = call_kind::UNSUPPORTED;
        }
    }
    let task = unsafe { bpf_get_current_task_btf() } as *const u8;
    let sk = fd_tcp_sock(task, args.fd);
    if sk.is_null() {
        return;
    }
    on_raw_sock_call::<true>(sk, direction, ret as i32, args, pid_tgid);
}

/// A call of direction `direction` on TCP socket `sk`, an address the hook computed or took
/// from a register (hook sets `syscalls` and `kprobes`: no BTF-typed socket), with result
/// `ret` and buffers `args`: its cookie is read from `skc_cookie` (see [`on_sys_exit`]); a
/// call that moved bytes on a socket with none yet is counted ([`counter::NO_COOKIE`]) and
/// dropped. `SEND`: the instance may see sends (see [`on_call`]).
#[inline(always)]
pub fn on_raw_sock_call<const SEND: bool>(
    sk: *const u8,
    direction: u8,
    ret: i32,
    args: CallArgs,
    pid_tgid: u64,
) {
    let cookie: u64 = read_at(sk, konf!(skc_cookie));
    if cookie == 0 {
        if ret > 0 {
            count(counter::NO_COOKIE);
        }
        return;
    }
    let call = Call {
        sk,
        tp: sk,
        cookie,
        dir: direction,
        ret,
        args,
    };
    on_call::<SEND, true, false>(&call, pid_tgid);
}
