//! Reference programs for `cargo xtask bench`: empty programs on the hooks the observer's
//! socket programs use (`tp_btf/sock_send_length`, `tp_btf/sock_recv_length`), and on
//! `raw_tracepoint/sys_enter`, where the observer has none (what a program on every syscall
//! would cost). Their run time per call (`bpf_stats`) is the floor any
//! program on that hook costs: the kernel's dispatch into a BPF program and back, plus what
//! `bpf_stats` itself adds. The observer never attaches them (`observe` and `daemon` load only
//! the programs they name); the hidden `spice-observer bench reference` attaches them alone.
//! `spice-observer doctor` uses the same empty body for its probe programs
//! (`spice_probe_kprobe`): attached for a moment to learn whether the kernel allows kprobes.

/// The whole body of a reference program: nothing, return 0.
#[inline(always)]
pub fn nothing() -> i32 {
    0
}

use core::{mem::MaybeUninit, ptr::write_volatile};

use aya_ebpf::helpers::{
    bpf_get_current_pid_tgid, bpf_ktime_get_ns, generated::bpf_probe_read_user,
};
use spice_ebpf_common::event::{EventHeader, MessageEvent, call_kind, kind};

use crate::{
    kernel::{konf, tcp_sock, tcp_u32},
    maps::{EVENTS, SOCKETS, ZERO_SOCK, traced_route},
    mem::{zero_bytes, zero_words},
    probes::{sock_calls::socket_cookie, syscalls::current_call},
};

/// [`floor`]'s `UPTO` for the whole floor program.
pub const FLOOR_ALL: u8 = 8;

/// Map update flag: create only (include/uapi/linux/bpf.h).
const BPF_NOEXIST: u64 = 1;
/// `BPF_RB_NO_WAKEUP` (include/uapi/linux/bpf.h).
const BPF_RB_NO_WAKEUP: u64 = 1;

/// The body of `spice_ref_floor` (`tp_btf/sock_send_length`): the least a send call on a
/// traced socket needs, with none of the framing. The watched-process filter
/// ([`traced_route`]: one array load, one hash lookup), the TCP socket check, the socket's
/// cookie (one load, as the socket programs take it: [`socket_cookie`]) and one hash lookup
/// of its state (`SOCKETS`, made at its first call), the syscall's buffer from its saved
/// registers ([`current_call`]), the clock, one read of a 6-byte mini header at the buffer's
/// start, `write_seq` stored in the state, and one 72-byte message record in the ring
/// (`EVENTS`, drained by `bench reference`). Only single-buffer calls (write, send) are
/// handled; anything else returns after the filter.
///
/// `bench reference --hooks floor --pid PID` attaches it on its own copy of the maps, with
/// `PID` watched there: its run time per run (`bpf_stats`) is the floor of
/// `spice_sock_send`'s on the same load. `cargo xtask bench` runs it alone on its hook, in
/// runs of its own (`--only`): programs on one hook run in attach order, and each one after
/// the first finds the caches warmed by those before it.
///
/// `UPTO` < [`FLOOR_ALL`] stops early, for the floor's cost in steps (`spice_ref_step1` to
/// `spice_ref_step7`, `--hooks floor_steps`, each alone on its hook in the bench):
/// 1 after the filter; 2 after the socket check (`bpf_skc_to_tcp_sock`) and the cookie; 3
/// after the syscall's registers ([`current_call`]: `bpf_get_current_task_btf`,
/// `bpf_task_pt_regs`, five loads); 4 after the clock (`bpf_ktime_get_ns`); 5 after the
/// `SOCKETS` lookup (a miss makes the entry and returns, in steps 5–7 as in the floor); 6 after
/// the header read; 7 after `write_seq` and a 72-byte ring reservation that is discarded
/// unwritten (the ring's lock, its 8-byte record header and the discard, which takes a
/// submit's commit path: none of the record's own stores). Each step's run time minus the one
/// before is what that part costs.
#[inline(always)]
pub fn floor<const UPTO: u8>(sk: *const u8, ret: i32) -> i32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let Some(route) = traced_route(tgid) else {
        return 0;
    };
    if UPTO == 1 {
        return 0;
    }
    let tp = tcp_sock(sk);
    if ret <= 0 || tp.is_null() {
        return 0;
    }
    let cookie = socket_cookie(sk);
    if UPTO == 2 {
        return 0;
    }
    let args = current_call(route);
    if args.kind != call_kind::BUFFER {
        return 0;
    }
    if UPTO == 3 {
        return 0;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    if UPTO == 4 {
        return 0;
    }
    let Some(s) = SOCKETS.get_ptr_mut(&cookie) else {
        // Every step from the lookup on makes the entry, as the floor does: alone on its
        // hook (`bench reference --only`), a step that did not would stop here on every call.
        if let Some(zero) = ZERO_SOCK.get_ptr(0) {
            let _ = SOCKETS.insert(&cookie, unsafe { &*zero }, BPF_NOEXIST);
        }
        return 0;
    };
    if UPTO == 5 {
        return 0;
    }
    let mut hdr = MaybeUninit::uninit();
    let hdr: &mut [u64; 1] = zero_words(&mut hdr);
    let rc = unsafe {
        bpf_probe_read_user(
            hdr.as_mut_ptr() as *mut core::ffi::c_void,
            6,
            args.ptr as *const core::ffi::c_void,
        )
    };
    if rc != 0 {
        return 0;
    }
    let hdr = hdr[0].to_le_bytes();
    if UPTO == 6 {
        return 0;
    }
    let seq = tcp_u32::<false>(tp, konf!(tcp_write_seq));
    unsafe { (*s).tcp.write_seq = seq };
    if let Some(mut e) = EVENTS.reserve::<MessageEvent>(0) {
        if UPTO == 7 {
            e.discard(BPF_RB_NO_WAKEUP);
            return 0;
        }
        let p = e.as_mut_ptr();
        unsafe {
            let h = EventHeader {
                kind: kind::MESSAGE,
                dir: 0,
                flags: 0,
                _pad: 0,
                tgid,
                ts_ns: now,
                cookie,
            };
            // Volatile zeros: plain ones to adjacent fields were merged into `memset` calls
            // (see crate::mem), which the socket programs' message path does not make.
            (*p).hdr = h;
            write_volatile(&mut (*p).at, 0);
            write_volatile(&mut (*p).index, 0);
            (*p).size = u32::from_le_bytes([hdr[2], hdr[3], hdr[4], hdr[5]]);
            (*p).msg_type = u16::from_le_bytes([hdr[0], hdr[1]]);
            (*p).hdr_len = 6;
            write_volatile(&mut (*p).flags, 0);
            write_volatile(&mut (*p).prefix, [0, 0]);
            (*p).seq = seq;
            write_volatile(&mut (*p).win_mw, 0);
            write_volatile(&mut (*p).win_count, 0);
            write_volatile(&mut (*p).win_effects, 0);
            zero_bytes(&raw mut (*p)._pad);
        }
        e.submit(BPF_RB_NO_WAKEUP);
    }
    0
}
