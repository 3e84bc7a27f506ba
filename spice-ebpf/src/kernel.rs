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
    hook_set: 0,
    skc_cookie: 0,
    task_files: 0,
    files_fdt: 0,
    fdtable_max_fds: 0,
    fdtable_fd: 0,
    file_private_data: 0,
    socket_sk: 0,
    tcp_recvmsg_args: 0,
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
/// from `tp`.
///
/// `RAW` false: `tp` is BTF-typed ([`tcp_sock`]), and this is a plain load, not a
/// `bpf_probe_read_kernel` helper call: the verifier knows `tp`'s BTF type and `off` (the
/// config lives in a frozen read-only map, so its values are constants to it) and checks the
/// access against the struct's layout; the JIT turns it into a load that reads zero on a
/// fault. `RAW` true: `tp` is an address the program computed (hook set `syscalls` finds the
/// socket through the fd table), which the verifier only lets `bpf_probe_read_kernel` read;
/// zero on a fault as well.
#[inline(always)]
pub fn tcp_u32<const RAW: bool>(tp: *const u8, off: u32) -> u32 {
    if RAW {
        read_at(tp, off)
    } else {
        unsafe { core::ptr::read_volatile(tp.add(off as usize) as *const u32) }
    }
}

/// Fills `out` with the TCP state of `tp` ([`tcp_u32`] for `RAW`) read at `now`, keeping
/// earlier source bits.
#[inline(always)]
pub fn fill_tcp<const RAW: bool>(tp: *const u8, now: u64, source: u32, out: &mut TcpSnapshot) {
    out.ts_ns = now;
    out.write_seq = tcp_u32::<RAW>(tp, konf!(tcp_write_seq));
    out.copied_seq = tcp_u32::<RAW>(tp, konf!(tcp_copied_seq));
    fill_tcp_transport::<RAW>(tp, out);
    out.sources |= source;
}

/// The members of [`TcpSnapshot`] that move with the transport (ACKs, transmissions), not
/// with the application's calls: snd_nxt, snd_una, rcv_nxt, cwnd, srtt, packets_out,
/// total_retrans.
#[inline(always)]
pub fn fill_tcp_transport<const RAW: bool>(tp: *const u8, out: &mut TcpSnapshot) {
    out.snd_nxt = tcp_u32::<RAW>(tp, konf!(tcp_snd_nxt));
    out.snd_una = tcp_u32::<RAW>(tp, konf!(tcp_snd_una));
    out.rcv_nxt = tcp_u32::<RAW>(tp, konf!(tcp_rcv_nxt));
    out.snd_cwnd = tcp_u32::<RAW>(tp, konf!(tcp_snd_cwnd));
    out.srtt_us = tcp_u32::<RAW>(tp, konf!(tcp_srtt_us)) >> 3;
    out.packets_out = tcp_u32::<RAW>(tp, konf!(tcp_packets_out));
    out.total_retrans = tcp_u32::<RAW>(tp, konf!(tcp_total_retrans));
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

/// `write_seq` (send) or `copied_seq` (recv) of `tp` ([`tcp_u32`] for `RAW`).
#[inline(always)]
pub fn seq_after_call<const RAW: bool>(tp: *const u8, send: bool) -> u32 {
    if send {
        tcp_u32::<RAW>(tp, konf!(tcp_write_seq))
    } else {
        tcp_u32::<RAW>(tp, konf!(tcp_copied_seq))
    }
}

/// `sk`, an address taken from a register (hook set `kprobes`: the first argument of a TCP
/// function), if it is a user's TCP socket: `sk_protocol` IPPROTO_TCP, `sk_type`
/// SOCK_STREAM, and a socket file behind it (`sk->sk_socket->file`, as [`user_socket`]),
/// every read a `bpf_probe_read_kernel`; null otherwise.
#[inline(always)]
pub fn raw_tcp_sock(sk: *const u8) -> *const u8 {
    let null = core::ptr::null();
    if sk.is_null() {
        return null;
    }
    if !raw_is_tcp(sk) {
        return null;
    }
    let sock = read_at::<u64>(sk, konf!(sk_socket)) as *const u8;
    if sock.is_null() || read_at::<u64>(sock, konf!(socket_file)) == 0 {
        return null;
    }
    sk
}

/// `SOCK_STREAM` (include/linux/net.h) and `IPPROTO_TCP`.
const SOCK_STREAM: u16 = 1;
const IPPROTO_TCP: u16 = 6;

/// The TCP socket behind file descriptor `fd` of the current task, for hook set `syscalls`
/// (which has no socket argument): `current->files->fdt->fd[fd]->private_data`, a
/// `struct socket *` when the file is a socket, then its `sk`; every step a
/// `bpf_probe_read_kernel` at offsets from BTF ([`KernelConfig::task_files`] and the
/// following fields). Null unless the fd is open (below `max_fds`, include/linux/fdtable.h),
/// is a socket file (the socket's `file` points back at the file: a file of another kind
/// keeps something else in `private_data`) and the socket is TCP (`sk_protocol`
/// IPPROTO_TCP, `sk_type` SOCK_STREAM). Runs at the syscall's exit, in the task whose table
/// it reads, so the fd still names the file the call used unless another thread of the
/// process closed or replaced it meanwhile (then the check above turns it away, or the
/// sequence check of the next call sees the bytes as untraced).
#[inline(always)]
pub fn fd_tcp_sock(task: *const u8, fd: i32) -> *const u8 {
    let null = core::ptr::null();
    if fd < 0 {
        return null;
    }
    let files = read_at::<u64>(task, konf!(task_files)) as *const u8;
    if files.is_null() {
        return null;
    }
    let fdt = read_at::<u64>(files, konf!(files_fdt)) as *const u8;
    if fdt.is_null() {
        return null;
    }
    let max_fds: u32 = read_at(fdt, konf!(fdtable_max_fds));
    if fd as u32 >= max_fds {
        return null;
    }
    let fds = read_at::<u64>(fdt, konf!(fdtable_fd)) as *const u8;
    if fds.is_null() {
        return null;
    }
    let file = read_at::<u64>(fds, (fd as u32) * 8) as *const u8;
    if file.is_null() {
        return null;
    }
    let sock = read_at::<u64>(file, konf!(file_private_data)) as *const u8;
    if sock.is_null() {
        return null;
    }
    let back = read_at::<u64>(sock, konf!(socket_file)) as *const u8;
    if back != file {
        return null;
    }
    let sk = read_at::<u64>(sock, konf!(socket_sk)) as *const u8;
    if sk.is_null() {
        return null;
    }
    if !raw_is_tcp(sk) {
        return null;
    }
    sk
}

/// Whether `sk` (any address) is a TCP socket: `sk_protocol` IPPROTO_TCP and `sk_type`
/// SOCK_STREAM, read with `bpf_probe_read_kernel`.
#[inline(always)]
fn raw_is_tcp(sk: *const u8) -> bool {
    let protocol: u16 = read_at(sk, konf!(sk_protocol));
    let ty: u16 = read_at(sk, konf!(sk_type));
    protocol == IPPROTO_TCP && ty == SOCK_STREAM
}
