//! `tp_btf/sock_send_length` and `tp_btf/sock_recv_length` (net/socket.c
//! `sock_sendmsg_nosec` / `sock_recvmsg_nosec`): once per socket send or receive call, in the
//! calling task, with the `struct sock *` and the byte count the kernel took or returned.

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, generated::bpf_get_socket_cookie};
use spice_ebpf_common::event::dir;

use crate::{
    capture::{Call, on_call},
    kernel::tcp_sock,
    maps::{PENDING_CALLS, maybe_watched},
};

const MSG_PEEK: i32 = 2;

/// Handles a socket call result. `direction` is [`dir::SEND`] or [`dir::RECV`].
#[inline(always)]
pub fn on_sock_length(sk: *const u8, ret: i32, flags: i32, direction: u8) {
    let pid_tgid = bpf_get_current_pid_tgid();
    // Most processes are turned away here, by one array load: a call can be stashed only
    // for a process that passed the same filter at sys_enter (its entry is never cleared).
    if !maybe_watched((pid_tgid >> 32) as u32) {
        return;
    }
    // No stashed call: not ours.
    let Some(p) = PENDING_CALLS.get_ptr_mut(&pid_tgid) else {
        return;
    };
    // SAFETY: the thread's own entry (see PendingCall::live).
    let args = unsafe {
        if (*p).live == 0 {
            return; // taken by an earlier socket call of the same syscall, or no socket call
        }
        (*p).live = 0;
        *p
    };
    if direction == dir::RECV && flags & MSG_PEEK != 0 {
        return;
    }
    // Also the TCP check: NULL unless an IPv4/IPv6 TCP socket.
    let tp = tcp_sock(sk);
    if tp.is_null() {
        return;
    }
    let cookie = unsafe { bpf_get_socket_cookie(sk as *mut _) };
    on_call(
        &Call {
            sk,
            tp,
            cookie,
            dir: direction,
            ret,
            args,
        },
        pid_tgid,
    );
}
