//! `uprobe` / `uretprobe` on the libssl a watched process maps (OpenSSL 3, `ssl/ssl_lib.c`):
//! the plaintext the process hands to SSL_write and gets from SSL_read, framed by the same
//! state machine as a plain socket's bytes (`capture::on_plaintext`).
//!
//! The agent attaches these per process (a uprobe fires only in the process it was attached
//! for), so no other process pays for them. The entry programs save the call's arguments in
//! `TLS_CALLS`; socket calls made inside it (the TLS records going out or coming in) record
//! the socket's cookie there (`capture::on_call`); the return program takes the entry, learns
//! `SSL * → socket` in `SSL_SOCKETS`, and frames the plaintext the call moved.
//!
//! x86-64 System V calling convention: arguments in rdi, rsi, rdx, rcx; the result in rax.

use core::{mem::MaybeUninit, ptr::write_volatile};

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    programs::{ProbeContext, RetProbeContext},
};
use spice_ebpf_common::{
    config::counter,
    event::{SslKey, TlsCall, tls_func},
};

use crate::{
    capture,
    maps::{SSL_SOCKETS, TLS_CALLS, count, traced_route},
    mem::zero_bytes,
};

/// Entry of a hooked libssl function `func` ([`tls_func`]): saves its arguments for the
/// return, for watched processes only.
#[inline(always)]
pub fn on_entry(ctx: &ProbeContext, func: u8) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(route) = traced_route((pid_tgid >> 32) as u32) else {
        return;
    };
    let ssl: u64 = ctx.arg(0).unwrap_or(0);
    let (buf, num, out) = if tls_func::moves_plaintext(func) {
        let buf: u64 = ctx.arg(1).unwrap_or(0);
        let raw: u64 = ctx.arg(2).unwrap_or(0);
        // SSL_write / SSL_read take an `int num` (the register's upper half is undefined),
        // the _ex forms a `size_t num` and a `size_t *` for the count.
        let (num, out) = if func == tls_func::WRITE || func == tls_func::READ {
            ((raw as u32 as i32).max(0) as u64, 0)
        } else {
            (raw, ctx.arg::<u64>(3).unwrap_or(0))
        };
        (buf, num, out)
    } else {
        (0, 0, 0)
    };
    // Built field by field with volatile stores: as a struct literal its zero fields became
    // `memset` calls (see crate::mem).
    let mut call = MaybeUninit::<TlsCall>::uninit();
    let c = call.as_mut_ptr();
    // SAFETY: every field of the stack value is written before it is read.
    let call = unsafe {
        write_volatile(&raw mut (*c).func, func);
        write_volatile(&raw mut (*c).watch, route);
        write_volatile(&raw mut (*c).eagain, 0);
        zero_bytes(&raw mut (*c)._pad);
        write_volatile(&raw mut (*c).ssl, ssl);
        write_volatile(&raw mut (*c).buf, buf);
        write_volatile(&raw mut (*c).num, num);
        write_volatile(&raw mut (*c).out, out);
        write_volatile(&raw mut (*c).cookie, 0);
        call.assume_init_ref()
    };
    if TLS_CALLS.insert(&pid_tgid, call, 0).is_err() {
        count(counter::TLS_PENDING_FULL);
    }
}

/// Return of a hooked libssl function: takes the saved entry, learns which socket the `SSL *`
/// uses, and frames the plaintext SSL_write accepted or SSL_read produced.
#[inline(always)]
pub fn on_return(ctx: &RetProbeContext) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(p) = TLS_CALLS.get_ptr(&pid_tgid) else {
        return;
    };
    let tc = unsafe { *p };
    let _ = TLS_CALLS.remove(&pid_tgid);
    let tgid = (pid_tgid >> 32) as u32;
    let key = SslKey {
        tgid,
        _pad: 0,
        ssl: tc.ssl,
    };
    let cookie = if tc.cookie != 0 {
        let known = SSL_SOCKETS.get_ptr(&key).map(|c| unsafe { *c });
        if known != Some(tc.cookie) {
            let _ = SSL_SOCKETS.insert(&key, &tc.cookie, 0);
        }
        tc.cookie
    } else {
        SSL_SOCKETS.get_ptr(&key).map_or(0, |c| unsafe { *c })
    };
    if !tls_func::moves_plaintext(tc.func) {
        return;
    }
    let rc: u64 = ctx.ret();
    let rc = rc as u32 as i32;
    // Bytes moved (> 0), or ≤ 0 for a call that moved none (SSL_ERROR_WANT_WRITE etc.).
    let moved: i64 = if tc.func == tls_func::WRITE || tc.func == tls_func::READ {
        rc as i64
    } else if rc == 1 {
        unsafe { bpf_probe_read_user(tc.out as *const u64) }.map_or(0, |n| n as i64)
    } else {
        0
    };
    if cookie == 0 {
        if moved > 0 {
            count(counter::TLS_UNMAPPED);
        }
        return;
    }
    capture::on_plaintext(cookie, &tc, moved, pid_tgid);
}
