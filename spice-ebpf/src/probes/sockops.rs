//! sock_ops on the cgroup-v2 root: new connections to or from a watched listening port are
//! enrolled for RTT, retransmit and state callbacks (include/uapi/linux/bpf.h
//! `BPF_SOCK_OPS_*_CB_FLAG`), which keep the socket's TCP state (`SockState::tcp` in
//! `SOCKETS`) fresh between the process's own calls: snd_una and cwnd move with every ACK even
//! while spice-server is blocked. A connection is enrolled when it is established; its state
//! is kept once its first traced call has made its `SOCKETS` entry (before that, no record
//! refers to it).

use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_RETRANS_CB, BPF_SOCK_OPS_RETRANS_CB_FLAG, BPF_SOCK_OPS_RTT_CB,
        BPF_SOCK_OPS_RTT_CB_FLAG, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG, bpf_sock_ops,
    },
    helpers::{bpf_ktime_get_ns, generated::bpf_get_socket_cookie},
    programs::SockOpsContext,
};
use spice_ebpf_common::{
    config::counter,
    event::{TcpSnapshot, tcp_source},
};

use crate::maps::{SOCKETS, WATCH_PORTS, count};

macro_rules! field {
    ($ops:expr, $f:ident) => {
        unsafe { core::ptr::read_volatile(&raw const (*$ops).$f) }
    };
}

#[inline(always)]
fn update(ops: *const bpf_sock_ops, snap: &mut TcpSnapshot) {
    snap.ts_ns = unsafe { bpf_ktime_get_ns() };
    snap.snd_cwnd = field!(ops, snd_cwnd);
    snap.srtt_us = field!(ops, srtt_us) >> 3;
    snap.snd_una = field!(ops, snd_una);
    snap.snd_nxt = field!(ops, snd_nxt);
    snap.rcv_nxt = field!(ops, rcv_nxt);
    snap.packets_out = field!(ops, packets_out);
    snap.total_retrans = field!(ops, total_retrans);
    snap.sources |= tcp_source::SOCKOPS;
}

#[inline(always)]
pub fn on_sock_ops(ctx: &SockOpsContext) {
    let ops = ctx.ops as *const bpf_sock_ops;
    let op = field!(ops, op);
    match op {
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB | BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB => {
            let local = field!(ops, local_port) as u16;
            let remote_raw = field!(ops, remote_port);
            // remote_port holds the network-order port; on little-endian it sits in the upper
            // 16 bits (net/core/filter.c sock_ops_convert_ctx_access).
            let remote = u16::from_be(if remote_raw > 0xffff {
                (remote_raw >> 16) as u16
            } else {
                remote_raw as u16
            });
            if WATCH_PORTS.get_ptr(&local).is_none() && WATCH_PORTS.get_ptr(&remote).is_none() {
                return;
            }
            let flags = BPF_SOCK_OPS_RTT_CB_FLAG
                | BPF_SOCK_OPS_RETRANS_CB_FLAG
                | BPF_SOCK_OPS_STATE_CB_FLAG;
            let _ = ctx.set_cb_flags(flags as i32);
        }
        BPF_SOCK_OPS_RTT_CB | BPF_SOCK_OPS_RETRANS_CB | BPF_SOCK_OPS_STATE_CB => {
            let cookie = unsafe { bpf_get_socket_cookie(ctx.ops as *mut _) };
            if let Some(p) = SOCKETS.get_ptr_mut(&cookie) {
                update(ops, unsafe { &mut (*p).tcp });
                count(counter::SOCKOPS_UPDATES);
            }
        }
        _ => {}
    }
}
