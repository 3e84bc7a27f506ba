//! spice-observer's kernel programs, hook sets `tracepoints` (`spice_sock_send`,
//! `spice_sock_recv`), `fentry` (`spice_fexit_send`, `spice_fexit_recv`), `kprobes`
//! (`spice_kprobe_*`, `spice_kretprobe_*`) and `syscalls` (`spice_sys_exit`) with the
//! programs they share (see README "Kernel requirements"), plus uprobes on libssl for TLS
//! plaintext (`probes/tls.rs`).
//!
//! Entry points are thin: they unpack their context and call the hook family in `probes/`,
//! which hands socket calls to `capture`, where the shared framing state machine
//! (`spice_ebpf_common::framing`) runs.
#![no_std]
#![no_main]
// The atomic intrinsics of `capture::take_window_lock` (the eBPF build uses a pinned nightly).
#![feature(core_intrinsics)]
// `mem::scalar_r0`'s one BPF instruction.
#![feature(asm_experimental_arch)]
#![allow(internal_features)]

mod capture;
mod kernel;
mod maps;
mod mem;
mod probes;

use aya_ebpf::{
    macros::{
        btf_tracepoint, fexit, kprobe, kretprobe, raw_tracepoint, sock_ops, uprobe, uretprobe,
    },
    programs::{
        BtfTracePointContext, FExitContext, ProbeContext, RawTracePointContext, RetProbeContext,
        SockOpsContext,
    },
};
use spice_ebpf_common::event::{dir, tls_func};

/// Socket send result (`sock_send_length(sk, ret, flags)`).
#[btf_tracepoint(function = "sock_send_length")]
pub fn spice_sock_send(ctx: BtfTracePointContext) -> i32 {
    probes::sock_calls::on_sock_length::<false>(ctx.arg(0), ctx.arg(1), ctx.arg(2), dir::SEND);
    0
}

/// Socket receive result (`sock_recv_length(sk, ret, flags)`).
#[btf_tracepoint(function = "sock_recv_length")]
pub fn spice_sock_recv(ctx: BtfTracePointContext) -> i32 {
    probes::sock_calls::on_sock_length::<false>(ctx.arg(0), ctx.arg(1), ctx.arg(2), dir::RECV);
    0
}

/// Hook set `fentry`: `tcp_sendmsg(sk, msg, size)` returned (net/ipv4/tcp.c; every TCP send
/// path of a socket file reaches it through `inet_sendmsg`). fexit sees the arguments and, after
/// them, the return value: the bytes taken.
#[fexit(function = "tcp_sendmsg")]
pub fn spice_fexit_send(ctx: FExitContext) -> i32 {
    probes::sock_calls::on_sock_length::<true>(ctx.arg(0), ctx.arg(3), 0, dir::SEND);
    0
}

/// Hook set `fentry`: `tcp_recvmsg(sk, msg, len, flags, addr_len)` returned (net/ipv4/tcp.c):
/// the bytes given. Six arguments before Linux 5.19 (`nonblock` before `flags`), four on
/// kernels without `addr_len`: `KernelConfig::tcp_recvmsg_args`, from BTF.
#[fexit(function = "tcp_recvmsg")]
pub fn spice_fexit_recv(ctx: FExitContext) -> i32 {
    // Slots 3 and 4 exist with any of the three signatures: both are loaded, then one taken.
    let (a3, a4) = (btf_slot(&ctx, 3), btf_slot(&ctx, 4));
    let flags = if kernel::konf!(tcp_recvmsg_args) == 6 {
        a4
    } else {
        a3
    };
    // The return value wherever it is (`bpf_get_func_ret`, Linux 5.17; inlined by the
    // verifier).
    let ret: i64 = ctx.ret().unwrap_or(0);
    probes::sock_calls::on_sock_length::<true>(ctx.arg(0), ret as i32, flags as i32, dir::RECV);
    0
}

/// Slot `n` of a BTF context (the arguments, then an fexit's return value, as 64-bit words) by
/// a volatile load at a constant offset. Loads in the branches of a choice were merged by
/// LLVM into one load at a computed offset (volatile or not), which the verifier refuses
/// ("dereference of modified ctx ptr", seen on 6.1): [`spice_fexit_recv`] loads both
/// candidates, then chooses.
#[inline(always)]
fn btf_slot(ctx: &FExitContext, n: usize) -> u64 {
    use aya_ebpf::EbpfContext as _;
    unsafe { core::ptr::read_volatile((ctx.as_ptr() as *const u64).add(n)) }
}

/// Hook set `fentry`, kernels before 6.5: `tcp_sendpage(sk, page, offset, size, flags)`
/// returned (sendfile and splice to a TCP socket; Linux 6.5 removed it, those go through
/// `tcp_sendmsg` since). The bytes are not in a user buffer: the call is classified from the
/// syscall's registers as unsupported, and its direction marked `untraced bytes`.
#[fexit(function = "tcp_sendpage")]
pub fn spice_fexit_sendpage(ctx: FExitContext) -> i32 {
    probes::sock_calls::on_sock_length::<true>(ctx.arg(0), ctx.arg(5), 0, dir::SEND);
    0
}

/// Hook set `kprobes`: `tcp_sendmsg(sk, msg, size)` entry (the socket, for the return).
#[kprobe]
pub fn spice_kprobe_send(ctx: ProbeContext) -> u32 {
    probes::kprobes::on_entry(ctx.arg(0).unwrap_or(0), 0);
    0
}

/// Hook set `kprobes`: `tcp_sendmsg` returned (`ret`: the bytes taken, or a negative errno).
#[kretprobe]
pub fn spice_kretprobe_send(ctx: RetProbeContext) -> u32 {
    probes::kprobes::on_return(ctx.ret(), dir::SEND);
    0
}

/// Hook set `kprobes`: `tcp_recvmsg(sk, msg, len, flags, …)` entry (the socket and the flags,
/// for the return; `flags` is the fifth argument before Linux 5.19, see
/// [`spice_fexit_recv`]).
#[kprobe]
pub fn spice_kprobe_recv(ctx: ProbeContext) -> u32 {
    // Both registers loaded (volatile, at constant offsets), then one taken: see btf_slot.
    let (rcx, r8) = unsafe {
        (
            core::ptr::read_volatile(&raw const (*ctx.regs).rcx),
            core::ptr::read_volatile(&raw const (*ctx.regs).r8),
        )
    };
    let flags = if kernel::konf!(tcp_recvmsg_args) == 6 {
        r8
    } else {
        rcx
    };
    probes::kprobes::on_entry(ctx.arg(0).unwrap_or(0), flags);
    0
}

/// Hook set `kprobes`: `tcp_recvmsg` returned (`ret`: the bytes given, or a negative errno).
#[kretprobe]
pub fn spice_kretprobe_recv(ctx: RetProbeContext) -> u32 {
    probes::kprobes::on_return(ctx.ret(), dir::RECV);
    0
}

/// Hook set `kprobes`, kernels before 6.5: `tcp_sendpage(sk, page, offset, size, flags)`
/// entry (see [`spice_fexit_sendpage`]).
#[kprobe]
pub fn spice_kprobe_sendpage(ctx: ProbeContext) -> u32 {
    probes::kprobes::on_entry(ctx.arg(0).unwrap_or(0), 0);
    0
}

/// Hook set `kprobes`: `tcp_sendpage` returned (a program of its own, so that each program
/// has one link to pin).
#[kretprobe]
pub fn spice_kretprobe_sendpage(ctx: RetProbeContext) -> u32 {
    probes::kprobes::on_return(ctx.ret(), dir::SEND);
    0
}

/// Hook set `syscalls`: any syscall's exit (`sys_exit(regs, ret)`), for kernels without the
/// socket tracepoints.
#[raw_tracepoint(tracepoint = "sys_exit")]
pub fn spice_sys_exit(ctx: RawTracePointContext) -> i32 {
    probes::syscalls::on_sys_exit(ctx.arg(1));
    0
}

/// Process fork (`sched_process_fork(parent, child)`).
#[btf_tracepoint(function = "sched_process_fork")]
pub fn spice_fork(ctx: BtfTracePointContext) -> i32 {
    probes::sched::on_fork(ctx.arg(1));
    0
}

/// Thread exit (`sched_process_exit(p, ...)`).
#[btf_tracepoint(function = "sched_process_exit")]
pub fn spice_exit(_ctx: BtfTracePointContext) -> i32 {
    probes::sched::on_exit();
    0
}

/// TCP state change (`inet_sock_set_state(sk, oldstate, newstate)`).
#[btf_tracepoint(function = "inet_sock_set_state")]
pub fn spice_tcp_state(ctx: BtfTracePointContext) -> i32 {
    let sk: *const u8 = ctx.arg(0);
    let newstate: i32 = ctx.arg(2);
    probes::tcp_state::on_set_state(sk, 6, newstate);
    0
}

/// TCP socket destroyed (`tcp_destroy_sock(sk)`).
#[btf_tracepoint(function = "tcp_destroy_sock")]
pub fn spice_tcp_destroy(ctx: BtfTracePointContext) -> i32 {
    probes::tcp_state::on_destroy(ctx.arg(0));
    0
}

/// libssl `SSL_write(ssl, buf, num)` entry (attached per watched process).
#[uprobe]
pub fn spice_ssl_write(ctx: ProbeContext) -> u32 {
    probes::tls::on_entry(&ctx, tls_func::WRITE);
    0
}

/// libssl `SSL_write_ex(ssl, buf, num, written)` entry.
#[uprobe]
pub fn spice_ssl_write_ex(ctx: ProbeContext) -> u32 {
    probes::tls::on_entry(&ctx, tls_func::WRITE_EX);
    0
}

/// libssl `SSL_read(ssl, buf, num)` entry.
#[uprobe]
pub fn spice_ssl_read(ctx: ProbeContext) -> u32 {
    probes::tls::on_entry(&ctx, tls_func::READ);
    0
}

/// libssl `SSL_read_ex(ssl, buf, num, readbytes)` entry.
#[uprobe]
pub fn spice_ssl_read_ex(ctx: ProbeContext) -> u32 {
    probes::tls::on_entry(&ctx, tls_func::READ_EX);
    0
}

/// libssl `SSL_do_handshake`, `SSL_shutdown`, `SSL_peek`, `SSL_peek_ex` entry: socket calls
/// inside are the TLS library's own.
#[uprobe]
pub fn spice_ssl_context(ctx: ProbeContext) -> u32 {
    probes::tls::on_entry(&ctx, tls_func::CONTEXT);
    0
}

/// Return of every hooked libssl function.
#[uretprobe]
pub fn spice_ssl_ret(ctx: RetProbeContext) -> u32 {
    probes::tls::on_return(&ctx);
    0
}

/// RTT / retransmit / state callbacks of enrolled connections.
#[sock_ops]
pub fn spice_sockops(ctx: SockOpsContext) -> u32 {
    probes::sockops::on_sock_ops(&ctx);
    1
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";

// Reference programs for `cargo xtask bench` (`probes/reference.rs`): empty, on the hooks of
// `spice_sock_send` and `spice_sock_recv`, and on `sys_enter` and `sys_exit`; never attached by
// the observer.

/// Empty `raw_tracepoint/sys_enter`: what any program on every syscall of the host would cost
/// (the observer has none there).
#[raw_tracepoint(tracepoint = "sys_enter")]
pub fn spice_ref_sys_enter(_ctx: RawTracePointContext) -> i32 {
    probes::reference::nothing()
}

/// Empty `raw_tracepoint/sys_exit`: the floor of [`spice_sys_exit`]'s cost on a syscall of a
/// process it does not watch (hook set `syscalls`).
#[raw_tracepoint(tracepoint = "sys_exit")]
pub fn spice_ref_sys_exit(_ctx: RawTracePointContext) -> i32 {
    probes::reference::nothing()
}

/// Empty `tp_btf/sock_send_length`: the floor of [`spice_sock_send`]'s cost.
#[btf_tracepoint(function = "sock_send_length")]
pub fn spice_ref_sock_send(_ctx: BtfTracePointContext) -> i32 {
    probes::reference::nothing()
}

/// Empty `tp_btf/sock_recv_length`: the floor of [`spice_sock_recv`]'s cost.
#[btf_tracepoint(function = "sock_recv_length")]
pub fn spice_ref_sock_recv(_ctx: BtfTracePointContext) -> i32 {
    probes::reference::nothing()
}

/// `tp_btf/sock_send_length` doing the least a traced send needs, none of the framing
/// ([`probes::reference::floor`]): the floor of [`spice_sock_send`]'s cost with its work.
#[btf_tracepoint(function = "sock_send_length")]
pub fn spice_ref_floor(ctx: BtfTracePointContext) -> i32 {
    probes::reference::floor::<{ probes::reference::FLOOR_ALL }>(ctx.arg(0), ctx.arg(1))
}

/// `tp_btf/sock_send_length` programs that run [`probes::reference::floor`] up to step `N`
/// (that function says what each step adds); aya's attribute needs one function each.
macro_rules! floor_steps {
    ($($name:ident $n:literal $doc:literal;)*) => {$(
        #[doc = concat!("[`spice_ref_floor`] up to ", $doc, ".")]
        #[btf_tracepoint(function = "sock_send_length")]
        pub fn $name(ctx: BtfTracePointContext) -> i32 {
            probes::reference::floor::<$n>(ctx.arg(0), ctx.arg(1))
        }
    )*};
}

floor_steps! {
    spice_ref_step1 1 "its filter (the `MAYBE_WATCHED` load and the `WATCHED_TGIDS` lookup)";
    spice_ref_step2 2 "the socket check and its cookie";
    spice_ref_step3 3 "the syscall's registers";
    spice_ref_step4 4 "the clock";
    spice_ref_step5 5 "the socket's `SOCKETS` lookup";
    spice_ref_step6 6 "the read of the message header from the caller's buffer";
    spice_ref_step7 7 "`write_seq` and a ring reservation discarded unwritten";
}
