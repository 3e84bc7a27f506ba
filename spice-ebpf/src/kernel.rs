//! Reads of kernel structs at offsets the agent found in the running kernel's BTF.

use aya_ebpf::helpers::{bpf_probe_read_kernel, generated::bpf_skc_to_tcp_sock};
use spice_ebpf_common::{config::KernelConfig, event::TcpSnapshot};

/// Filled in by the agent before load (`EbpfLoader::set_global`), read-only here.
#[unsafe(no_mangle)]
pub static CONFIG: KernelConfig = KernelConfig {
    self_tgid: 0,
    ring_wakeup_bytes: 0,
    skc_family: 0,
    skc_num: 0,
    skc_dport: 0,
    skc_rcv_saddr: 0,
    skc_daddr: 0,
    skc_v6_rcv_saddr: 0,
    skc_v6_daddr: 0,
    sk_protocol: 0,
    sk_type: 0,
    tcp_write_seq: 0,
    tcp_snd_nxt: 0,
    tcp_snd_una: 0,
    tcp_rcv_nxt: 0,
    tcp_copied_seq: 0,
    tcp_snd_cwnd: 0,
    tcp_srtt_us: 0,
    tcp_packets_out: 0,
    tcp_total_retrans: 0,
    task_pid: 0,
    task_tgid: 0,
    sk_socket: 0,
    socket_file: 0,
};

/// Reads one config field without letting the compiler constant-fold the zero initialiser.
macro_rules! konf {
    ($field:ident) => {{
        #[allow(unused_unsafe)]
        let v = unsafe { core::ptr::read_volatile(&raw const $crate::kernel::CONFIG.$field) };
        v
    }};
}
pub(crate) use konf;

/// Reads a `T` at `base + off` from kernel memory; zero on fault.
#[inline(always)]
pub fn read_at<T: Copy + Default>(base: *const u8, off: u32) -> T {
    unsafe { bpf_probe_read_kernel(base.add(off as usize) as *const T) }.unwrap_or_default()
}

pub const AF_INET: u16 = 2;
pub const AF_INET6: u16 = 10;

/// `sk` as a `struct tcp_sock *` the programs may read directly (`bpf_skc_to_tcp_sock`,
/// net/core/filter.c: a full socket with `sk_protocol` IPPROTO_TCP and `sk_type`
/// SOCK_STREAM), or null for any other socket. `sk` must be a BTF-typed `struct sock *`
/// (a `tp_btf` argument).
#[inline(always)]
pub fn tcp_sock(sk: *const u8) -> *const u8 {
    unsafe { bpf_skc_to_tcp_sock(sk as *mut _) as *const u8 }
}

/// Loads a `u32` member of `struct tcp_sock` at offset `off` (a [`KernelConfig`] value)
/// from `tp` ([`tcp_sock`]). A plain load, not a `bpf_probe_read_kernel` helper call: the
/// verifier knows `tp`'s BTF type and `off` (the config lives in a frozen read-only map, so
/// its values are constants to it) and checks the access against the struct's layout; the
/// JIT turns it into a load that reads zero on a fault.
#[inline(always)]
pub fn tcp_u32(tp: *const u8, off: u32) -> u32 {
    unsafe { core::ptr::read_volatile(tp.add(off as usize) as *const u32) }
}

/// Fills `out` with the TCP state of `tp` ([`tcp_sock`]) read at `now`, keeping earlier
/// source bits.
#[inline(always)]
pub fn fill_tcp(tp: *const u8, now: u64, source: u32, out: &mut TcpSnapshot) {
    out.ts_ns = now;
    out.write_seq = tcp_u32(tp, konf!(tcp_write_seq));
    out.copied_seq = tcp_u32(tp, konf!(tcp_copied_seq));
    fill_tcp_transport(tp, out);
    out.sources |= source;
}

/// The members of [`TcpSnapshot`] that move with the transport (ACKs, transmissions), not
/// with the application's calls: snd_nxt, snd_una, rcv_nxt, cwnd, srtt, packets_out,
/// total_retrans.
#[inline(always)]
pub fn fill_tcp_transport(tp: *const u8, out: &mut TcpSnapshot) {
    out.snd_nxt = tcp_u32(tp, konf!(tcp_snd_nxt));
    out.snd_una = tcp_u32(tp, konf!(tcp_snd_una));
    out.rcv_nxt = tcp_u32(tp, konf!(tcp_rcv_nxt));
    out.snd_cwnd = tcp_u32(tp, konf!(tcp_snd_cwnd));
    out.srtt_us = tcp_u32(tp, konf!(tcp_srtt_us)) >> 3;
    out.packets_out = tcp_u32(tp, konf!(tcp_packets_out));
    out.total_retrans = tcp_u32(tp, konf!(tcp_total_retrans));
}

/// Whether `sk` (a BTF-typed `struct sock *`, a `tp_btf` argument) belongs to a user's
/// socket file: `sk->sk_socket->file` is set. A socket the kernel made for itself
/// (`sock_create_kern`, net/socket.c: NFS and CIFS clients, iSCSI) has none; its calls can
/// run in a watched thread (a synchronous NFS RPC sends from the caller's context) but move
/// no byte of the syscall being made. Plain loads from BTF pointers (see [`tcp_u32`]); a
/// null `sk_socket` reads as a null file.
#[inline(always)]
pub fn user_socket(sk: *const u8) -> bool {
    let sock =
        unsafe { core::ptr::read_volatile(sk.add(konf!(sk_socket) as usize) as *const *const u8) };
    if sock.is_null() {
        return false;
    }
    let file =
        unsafe { core::ptr::read_volatile(sock.add(konf!(socket_file) as usize) as *const u64) };
    file != 0
}

/// `write_seq` (send) or `copied_seq` (recv) of `tp` ([`tcp_sock`]).
#[inline(always)]
pub fn seq_after_call(tp: *const u8, send: bool) -> u32 {
    if send {
        tcp_u32(tp, konf!(tcp_write_seq))
    } else {
        tcp_u32(tp, konf!(tcp_copied_seq))
    }
}
