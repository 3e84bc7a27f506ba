//! Reads of kernel structs at offsets the agent found in the running kernel's BTF.

use aya_ebpf::helpers::bpf_probe_read_kernel;
use spice_ebpf_common::{config::KernelConfig, event::TcpSnapshot};

/// Filled in by the agent before load (`EbpfLoader::set_global`), read-only here.
#[unsafe(no_mangle)]
pub static CONFIG: KernelConfig = KernelConfig {
    self_tgid: 0,
    _reserved: 0,
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
const IPPROTO_TCP: u16 = 6;
const SOCK_STREAM: u16 = 1;

/// True if `sk` is an IPv4/IPv6 TCP socket.
#[inline(always)]
pub fn is_tcp(sk: *const u8) -> bool {
    let family: u16 = read_at(sk, konf!(skc_family));
    let protocol: u16 = read_at(sk, konf!(sk_protocol));
    let ty: u16 = read_at(sk, konf!(sk_type));
    (family == AF_INET || family == AF_INET6) && protocol == IPPROTO_TCP && ty == SOCK_STREAM
}

/// Fills `out` with the TCP state of `sk` (a `struct tcp_sock`), keeping earlier source bits.
#[inline(always)]
pub fn fill_tcp(sk: *const u8, now: u64, source: u32, out: &mut TcpSnapshot) {
    out.ts_ns = now;
    out.write_seq = read_at(sk, konf!(tcp_write_seq));
    out.snd_nxt = read_at(sk, konf!(tcp_snd_nxt));
    out.snd_una = read_at(sk, konf!(tcp_snd_una));
    out.rcv_nxt = read_at(sk, konf!(tcp_rcv_nxt));
    out.copied_seq = read_at(sk, konf!(tcp_copied_seq));
    out.snd_cwnd = read_at(sk, konf!(tcp_snd_cwnd));
    let srtt: u32 = read_at(sk, konf!(tcp_srtt_us));
    out.srtt_us = srtt >> 3;
    out.packets_out = read_at(sk, konf!(tcp_packets_out));
    out.total_retrans = read_at(sk, konf!(tcp_total_retrans));
    out.sources |= source;
}

/// `write_seq` (send) or `copied_seq` (recv) of `sk`.
#[inline(always)]
pub fn seq_after_call(sk: *const u8, send: bool) -> u32 {
    if send {
        read_at(sk, konf!(tcp_write_seq))
    } else {
        read_at(sk, konf!(tcp_copied_seq))
    }
}
