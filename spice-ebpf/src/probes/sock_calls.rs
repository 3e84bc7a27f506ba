//! `tp_btf/sock_send_length` and `tp_btf/sock_recv_length` (net/socket.c
//! `sock_sendmsg_nosec` / `sock_recvmsg_nosec`): once per socket send or receive call, in the
//! calling task, with the `struct sock *` and the byte count the kernel took or returned.

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, generated::bpf_get_socket_cookie};
use spice_ebpf_common::event::{call_kind, dir};

use crate::{
    capture::{Call, on_call},
    kernel::{konf, tcp_sock, user_socket},
    maps::traced_route,
    probes::syscalls::current_call,
};

/// recvmsg flags whose bytes are not the stream's next bytes: a peek leaves them queued, the
/// error queue holds no stream data (include/linux/socket.h).
pub const MSG_PEEK: i32 = 2;
pub const MSG_ERRQUEUE: i32 = 0x2000;
/// A TCP receive with this flag discards the bytes instead of copying them
/// (`tcp_recvmsg_locked`): they are the stream's, but not in the user buffer.
pub const MSG_TRUNC: i32 = 0x20;

/// Handles a socket call result. `direction` is [`dir::SEND`] or [`dir::RECV`]. `THREAD`: the
/// hook is preemptible (fexit trampolines only disable migration, `__bpf_prog_enter`,
/// kernel/bpf/trampoline.c), so the call's framing state takes the thread's scratch entry,
/// not this CPU's.
#[inline(always)]
pub fn on_sock_length<const THREAD: bool>(sk: *const u8, ret: i32, flags: i32, direction: u8) {
    let pid_tgid = bpf_get_current_pid_tgid();
    // Most processes are turned away by the array filter inside, with one load.
    let Some(route) = traced_route((pid_tgid >> 32) as u32) else {
        return;
    };
    if direction == dir::RECV && flags & (MSG_PEEK | MSG_ERRQUEUE) != 0 {
        return;
    }
    // Also the TCP check: NULL unless an IPv4/IPv6 TCP socket.
    let tp = tcp_sock(sk);
    if tp.is_null() || !user_socket(sk) {
        return;
    }
    let cookie = socket_cookie(sk);
    let mut args = current_call(route);
    if direction == dir::RECV && flags & MSG_TRUNC != 0 {
        args.kind = call_kind::UNSUPPORTED;
    }
    let call = Call {
        sk,
        tp,
        cookie,
        dir: direction,
        ret,
        args,
    };
    // `direction` is a constant in each program: one instance each.
    if direction == dir::SEND {
        on_call::<true, false, THREAD>(&call, pid_tgid);
    } else {
        on_call::<false, false, THREAD>(&call, pid_tgid);
    }
}

/// The cookie of `sk` (a BTF-typed `struct sock *`): `__sk_common.skc_cookie` read with one
/// load, or, while it is still 0 (the kernel makes a socket's cookie the first time one is
/// asked for: `sock_gen_cookie`, net/core/sock_diag.c), `bpf_get_socket_cookie`, which makes
/// it. The same value either way: the helper returns the word once it is set
/// (`__sock_gen_cookie` reads it first). A socket's first traced call pays the helper, the
/// others a load: on this project's VM a helper call costs 30–50 ns.
#[inline(always)]
pub(crate) fn socket_cookie(sk: *const u8) -> u64 {
    // SAFETY: `sk` is the hook's BTF-typed socket; a plain load at a member's offset.
    let c = unsafe { core::ptr::read_volatile(sk.add(konf!(skc_cookie) as usize) as *const u64) };
    if c != 0 {
        return c;
    }
    unsafe { bpf_get_socket_cookie(sk as *mut _) }
}
