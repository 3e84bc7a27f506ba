//! `tp_btf/sock_send_length` and `tp_btf/sock_recv_length` (net/socket.c
//! `sock_sendmsg_nosec` / `sock_recvmsg_nosec`): once per socket send or receive call, in the
//! calling task, with the `struct sock *` and the byte count the kernel took or returned.

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, generated::bpf_get_socket_cookie};
use spice_ebpf_common::event::dir;

use crate::{
    capture::{Call, on_call},
    kernel::is_tcp,
    maps::PENDING_CALLS,
};

const MSG_PEEK: i32 = 2;

/// Handles a socket call result. `direction` is [`dir::SEND`] or [`dir::RECV`].
#[inline(always)]
pub fn on_sock_length(sk: *const u8, ret: i32, flags: i32, direction: u8) {
    let pid_tgid = bpf_get_current_pid_tgid();
    // The one lookup for unwatched processes: no stashed call, not ours.
    let Some(p) = PENDING_CALLS.get_ptr(&pid_tgid) else {
        return;
    };
    let args = unsafe { *p };
    let _ = PENDING_CALLS.remove(&pid_tgid);
    if direction == dir::RECV && flags & MSG_PEEK != 0 {
        return;
    }
    if !is_tcp(sk) {
        return;
    }
    let cookie = unsafe { bpf_get_socket_cookie(sk as *mut _) };
    on_call(&Call {
        sk,
        cookie,
        dir: direction,
        ret,
        args,
    });
}
