//! `tp_btf/inet_sock_set_state` (`inet_sk_state_store` callers): when a tracked socket reaches
//! TCP_CLOSE, send its last TCP state; under hook set `syscalls`, give every connection that
//! reaches TCP_ESTABLISHED its cookie (see [`on_set_state`]). Its framing state stays: data still in the receive
//! queue can be read after TCP_CLOSE (FIN in FIN_WAIT2, or RST). `tp_btf/tcp_destroy_sock`
//! (`tcp_v4_destroy_sock`): the socket is gone, drop its kernel state.

use aya_ebpf::helpers::{bpf_ktime_get_ns, generated::bpf_get_socket_cookie};
use spice_ebpf_common::{
    config::{hook_set, watch},
    event::{CloseEvent, EventHeader, TcpSnapshot, carrier, kind, tcp_source},
};

use crate::{
    kernel::{fill_tcp, konf, tcp_sock},
    maps::{SOCKETS, WATCHED_TGIDS, write_record},
};

const TCP_ESTABLISHED: i32 = 1;
const TCP_CLOSE: i32 = 7;
const IPPROTO_TCP: u16 = 6;

///
/// Hook sets `syscalls` and `kprobes` read a socket's cookie from `skc_cookie`
/// ([`super::syscalls`], [`super::kprobes`]), where
/// it is 0 until something asks for it (`sock_gen_cookie`, net/core/sock_diag.c):
/// `bpf_get_socket_cookie` here, as a connection reaches TCP_ESTABLISHED (both sides: the
/// connecting socket in `tcp_finish_connect`, an accepted one in `tcp_rcv_state_process`
/// before `accept` returns it), makes it. One helper call per new connection of the host.
#[inline(always)]
pub fn on_set_state(sk: *const u8, protocol: u16, newstate: i32) {
    if newstate == TCP_ESTABLISHED
        && protocol == IPPROTO_TCP
        && (konf!(hook_set) == hook_set::SYSCALLS || konf!(hook_set) == hook_set::KPROBES)
    {
        let _ = unsafe { bpf_get_socket_cookie(sk as *mut _) };
        return;
    }
    if newstate != TCP_CLOSE || protocol != IPPROTO_TCP {
        return;
    }
    let cookie = unsafe { bpf_get_socket_cookie(sk as *mut _) };
    let Some(sock) = SOCKETS.get_ptr(&cookie) else {
        return;
    };
    let tgid = unsafe { (*sock).tgid };
    // TCP bytes moved by traced calls: a TLS socket's framing positions count plaintext.
    let pos = unsafe {
        if (*sock).carrier == carrier::TLS {
            (*sock).wire_pos
        } else {
            [(*sock).dir[0].pos, (*sock).dir[1].pos]
        }
    };
    // The rings of the owning process's watch now (no socket call here to carry them: the one
    // lookup of this path, made only for tracked sockets); after the process exited (its
    // entry gone), those of the call that created the socket.
    let route = match WATCHED_TGIDS.get_ptr(&tgid) {
        Some(w) => watch::route(unsafe { *w }),
        None => unsafe { (*sock).watch },
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let tp = tcp_sock(sk);
    write_record::<CloseEvent>(route, |p| unsafe {
        (*p).hdr = EventHeader {
            kind: kind::CLOSE,
            dir: 0,
            flags: 0,
            _pad: 0,
            tgid,
            ts_ns: now,
            cookie,
        };
        (*p).tcp = TcpSnapshot::default();
        (*p).pos = pos;
        if !tp.is_null() {
            fill_tcp::<false>(tp, now, tcp_source::STATE_TRACEPOINT, &mut (*p).tcp);
        }
    });
}

/// The socket is being destroyed: forget it.
#[inline(always)]
pub fn on_destroy(sk: *const u8) {
    let cookie = unsafe { bpf_get_socket_cookie(sk as *mut _) };
    let _ = SOCKETS.remove(&cookie);
}
