//! Per-call capture: given a socket, a direction, the bytes the kernel took or returned and
//! where they sit in user memory, run the shared framing state machine over them and emit
//! records. Independent of which hooks delivered the call, so other hook sets (fentry/fexit,
//! kprobes) can feed the same function.

use core::ffi::c_void;

use aya_ebpf::helpers::{
    bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns,
    generated::{bpf_loop, bpf_probe_read_user},
};
use spice_ebpf_common::{
    config::{MAX_STEPS_PER_CALL, counter},
    event::{
        EventHeader, LinkEvent, MessageEvent, PendingCall, SockState, SocketEvent, TcpSnapshot,
        UnparsedEvent, call_kind, dir as dirs, kind, msg_flags, tcp_source,
    },
    framing::{
        BUF_LEN, DirState, LinkInfo, MAX_WANT, MessageInfo, Output, PeerView, UnparsedReason,
    },
};

use crate::{
    kernel::{self, AF_INET, AF_INET6, konf, read_at},
    maps::{EVENTS, PREEXISTING, SOCKETS, TCP_STATE, ZERO_SOCK, count},
};

const EAGAIN: i32 = 11;

/// One socket call as seen by a hook.
pub struct Call {
    /// `struct sock *` of the socket.
    pub sk: *const u8,
    /// Socket cookie.
    pub cookie: u64,
    /// [`dirs::SEND`] or [`dirs::RECV`].
    pub dir: u8,
    /// Bytes the kernel took or returned, or a negative errno.
    pub ret: i32,
    /// Where the bytes are in user memory.
    pub args: PendingCall,
}

/// State shared with the `bpf_loop` step callback (lives on the caller's stack).
#[repr(C)]
struct LoopCtx {
    st: *mut DirState,
    /// This direction's [`SockState::msg_bytes`]: header + body bytes of every message
    /// record emitted, kept in the kernel so that a restarted agent continues byte totals.
    msg_bytes: *mut u64,
    /// TCP sequence number of stream offset 0 in this direction.
    seq_base: u32,
    hdr: EventHeader,
    peer: PeerView,
    call_start: u64,
    call_end: u64,
    iov_ptr: u64,
    iov_cnt: u64,
    cur_iov: u64,
    cur_start: u64,
    cur_base: u64,
    cur_len: u64,
}

#[inline(always)]
fn header(kind_: u8, dir: u8, cookie: u64, tgid: u32, now: u64) -> EventHeader {
    EventHeader {
        kind: kind_,
        dir,
        flags: 0,
        _pad: 0,
        tgid,
        ts_ns: now,
        cookie,
    }
}

/// Writes the record for one framing output; counts a loss if the ring is full.
///
/// Dispatches to enum-free functions: BTF cannot describe `Output` in a BPF function signature.
#[inline(always)]
fn emit(hdr: &EventHeader, out: &Output, seq_base: u32) {
    match out {
        Output::None => {}
        Output::Message(m) => emit_message(hdr, m, 0, seq_base),
        Output::Link(l) => emit_link(hdr, l),
        Output::Unparsed { reason, detail, at } => emit_unparsed(hdr, *reason as u8, *detail, *at),
    }
}

/// Records are written in place in the ring: the BPF stack is 512 bytes for the whole chain.
#[inline(never)]
fn emit_message(hdr: &EventHeader, m: &MessageInfo, flags: u8, seq_base: u32) {
    if m.already_reported {
        return;
    }
    count(counter::MESSAGES_FRAMED);
    let Some(mut e) = EVENTS.reserve::<MessageEvent>(0) else {
        count(counter::RING_FULL);
        return;
    };
    let p = e.as_mut_ptr();
    unsafe {
        (*p).hdr = *hdr;
        (*p).hdr.kind = kind::MESSAGE;
        (*p).at = m.at;
        (*p).index = m.index;
        (*p).size = m.size;
        (*p).msg_type = m.msg_type;
        (*p).hdr_len = m.hdr_len;
        (*p).flags = flags;
        (*p).prefix = m.prefix;
        (*p).seq = seq_base.wrapping_add(m.at as u32);
        (*p).win_mw = 0;
        (*p).win_count = 0;
        (*p).win_effects = 0;
        (*p)._pad = [0; 3];
    }
    e.submit(0);
}

#[inline(never)]
fn emit_link(hdr: &EventHeader, l: &LinkInfo) {
    let Some(mut e) = EVENTS.reserve::<LinkEvent>(0) else {
        count(counter::RING_FULL);
        return;
    };
    let p = e.as_mut_ptr();
    unsafe {
        (*p).hdr = *hdr;
        (*p).hdr.kind = kind::LINK;
        (*p).role = l.role;
        (*p).channel_type = l.channel_type;
        (*p).channel_id = l.channel_id;
        (*p)._pad = 0;
        (*p).link_size = l.link_size;
        (*p).connection_id = l.connection_id;
        (*p).common_caps = l.common_caps;
        (*p).end = 16 + l.link_size as u64;
    }
    e.submit(0);
}

#[inline(never)]
fn emit_unparsed(hdr: &EventHeader, reason: u8, detail: u32, at: u64) {
    let Some(mut e) = EVENTS.reserve::<UnparsedEvent>(0) else {
        count(counter::RING_FULL);
        return;
    };
    let p = e.as_mut_ptr();
    unsafe {
        (*p).hdr = *hdr;
        (*p).hdr.kind = kind::UNPARSED;
        (*p).at = at;
        (*p).reason = reason;
        (*p)._pad = [0; 3];
        (*p).detail = detail;
    }
    e.submit(0);
}

/// One step of the per-call loop: resolve the element, move to the iovec holding the next
/// wanted byte, or read (part of) the element and complete it. Returns 1 to stop.
extern "C" fn step(_index: u64, ctx: *mut c_void) -> i64 {
    let c = unsafe { &mut *(ctx as *mut LoopCtx) };
    let st = unsafe { &mut *c.st };
    if st.is_unparsed() || st.need().0 >= c.call_end {
        return 1;
    }
    // Resolve the element only once its first byte is in this call (see DirState::prepare).
    let out = st.prepare(&c.peer);
    emit(&c.hdr, &out, c.seq_base);
    if st.is_unparsed() {
        return 1;
    }
    let (at, remaining) = st.need();
    if at < c.call_start {
        let out = st.stop(UnparsedReason::Internal, 0);
        emit(&c.hdr, &out, c.seq_base);
        return 1;
    }
    if at >= c.cur_start + c.cur_len {
        // The wanted byte is in a later iovec.
        c.cur_start += c.cur_len;
        c.cur_iov += 1;
        if c.cur_iov >= c.iov_cnt {
            let out = st.stop(UnparsedReason::Internal, 1);
            emit(&c.hdr, &out, c.seq_base);
            return 1;
        }
        let mut iov = [0u64; 2];
        let src = (c.iov_ptr + c.cur_iov * 16) as *const c_void;
        let rc = unsafe { bpf_probe_read_user(iov.as_mut_ptr() as *mut c_void, 16, src) };
        if rc != 0 {
            count(counter::USER_READ_FAULT);
            let out = st.stop(UnparsedReason::UserMemoryFault, rc as u32);
            emit(&c.hdr, &out, c.seq_base);
            return 1;
        }
        c.cur_base = iov[0];
        c.cur_len = iov[1];
        return 0;
    }
    let off = at - c.cur_start;
    let mut n = remaining as u64;
    let seg_left = c.cur_len - off;
    if seg_left < n {
        n = seg_left;
    }
    let call_left = c.call_end - at;
    if call_left < n {
        n = call_left;
    }
    let n = (n as u32) & 31;
    let have = st.have & 31;
    let dst = unsafe { st.buf.as_mut_ptr().add(have as usize) } as *mut c_void;
    let rc = unsafe { bpf_probe_read_user(dst, n, (c.cur_base + off) as *const c_void) };
    if rc != 0 {
        count(counter::USER_READ_FAULT);
        let out = st.stop(UnparsedReason::UserMemoryFault, rc as u32);
        emit(&c.hdr, &out, c.seq_base);
        return 1;
    }
    st.have = have + n;
    if st.have >= st.want_len {
        let out = st.complete(&c.peer);
        if let Output::Message(m) = &out
            && !m.already_reported
        {
            unsafe { *c.msg_bytes += m.hdr_len as u64 + m.size as u64 };
        }
        emit(&c.hdr, &out, c.seq_base);
    }
    0
}

/// Returns the tracked state of the socket, creating it (and announcing the socket) on first
/// sight. `None` if the map is full.
#[inline(always)]
fn socket_state(call: &Call, tgid: u32, now: u64) -> Option<*mut SockState> {
    if let Some(s) = SOCKETS.get_ptr_mut(&call.cookie) {
        return Some(s);
    }
    let zero = ZERO_SOCK.get_ptr(0)?;
    if SOCKETS.insert(&call.cookie, unsafe { &*zero }, 0).is_err() {
        count(counter::SOCKET_MAP_FULL);
        return None;
    }
    let s = SOCKETS.get_ptr_mut(&call.cookie)?;
    let state = unsafe { &mut *s };
    state.tgid = tgid;
    let hdr = header(kind::SOCKET, call.dir, call.cookie, tgid, now);
    announce_socket(call.sk, &hdr);
    if PREEXISTING.get_ptr(&call.cookie).is_some() {
        // Connected before observation started: the stream cannot be framed from here.
        for d in 0..2usize {
            let ds = &mut state.dir[d];
            let out = ds.stop(UnparsedReason::AttachedMidStream, 0);
            emit(
                &EventHeader {
                    dir: d as u8,
                    ..hdr
                },
                &out,
                0,
            );
        }
    }
    Some(s)
}

#[inline(never)]
fn announce_socket(sk: *const u8, hdr: &EventHeader) {
    let Some(mut e) = EVENTS.reserve::<SocketEvent>(0) else {
        count(counter::RING_FULL);
        return;
    };
    let p = e.as_mut_ptr();
    let family: u16 = read_at(sk, konf!(skc_family));
    unsafe {
        (*p).hdr = *hdr;
        (*p).tid = bpf_get_current_pid_tgid() as u32;
        (*p).family = family;
        (*p).lport = read_at(sk, konf!(skc_num));
        (*p).rport = u16::from_be(read_at(sk, konf!(skc_dport)));
        (*p)._pad = [0; 6];
        (*p).laddr = [0; 16];
        (*p).raddr = [0; 16];
        if family == AF_INET {
            let l: [u8; 4] = read_at(sk, konf!(skc_rcv_saddr));
            let r: [u8; 4] = read_at(sk, konf!(skc_daddr));
            (*p).laddr = [l[0], l[1], l[2], l[3], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
            (*p).raddr = [r[0], r[1], r[2], r[3], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        } else if family == AF_INET6 {
            (*p).laddr = read_at(sk, konf!(skc_v6_rcv_saddr));
            (*p).raddr = read_at(sk, konf!(skc_v6_daddr));
        }
        (*p).comm = bpf_get_current_comm().unwrap_or_default();
    }
    e.submit(0);
}

/// Reads the socket's TCP state into `TCP_STATE` (in place) and returns the sequence number
/// after this call in stream terms: `write_seq` (send) or `copied_seq` (recv). These two only
/// change through the application's own calls, which this hook sees.
#[inline(never)]
fn store_tcp(sk: *const u8, cookie: u64, now: u64, send: bool) -> u32 {
    let p = match TCP_STATE.get_ptr_mut(&cookie) {
        Some(p) => p,
        None => {
            let zero = TcpSnapshot::default();
            if TCP_STATE.insert(&cookie, &zero, 0).is_err() {
                count(counter::TCP_MAP_FULL);
                return kernel::seq_after_call(sk, send);
            }
            match TCP_STATE.get_ptr_mut(&cookie) {
                Some(p) => p,
                None => return kernel::seq_after_call(sk, send),
            }
        }
    };
    let snap = unsafe { &mut *p };
    kernel::fill_tcp(sk, now, tcp_source::SOCKET_CALL, snap);
    if send {
        snap.write_seq
    } else {
        snap.copied_seq
    }
}

/// Handles one traced socket call.
pub fn on_call(call: &Call) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let now = unsafe { bpf_ktime_get_ns() };
    count(counter::CALLS_TRACED);
    let eagain_send = call.dir == dirs::SEND && call.ret == -EAGAIN;
    if call.ret <= 0 && !eagain_send {
        // Errors, EOF and zero-length calls move nothing. Do not (re)create state: this also
        // keeps a socket read after its close from being announced again.
        return;
    }
    let sp = if call.ret > 0 {
        match socket_state(call, tgid, now) {
            Some(sp) => sp,
            None => return,
        }
    } else {
        match SOCKETS.get_ptr_mut(&call.cookie) {
            Some(sp) => sp,
            None => return,
        }
    };
    let sock = unsafe { &mut *sp };

    let seq_now = store_tcp(call.sk, call.cookie, now, call.dir == dirs::SEND);

    let d = (call.dir & 1) as usize;
    let peer = sock.dir[d ^ 1].view();
    let st = &mut sock.dir[d];
    let hdr = header(kind::MESSAGE, call.dir, call.cookie, tgid, now);

    if call.ret <= 0 {
        if call.args.kind != call_kind::UNSUPPORTED {
            let base = if sock.seq_init[d] != 0 {
                sock.seq_base[d]
            } else {
                0
            };
            peek_eagain(
                st,
                &peer,
                call,
                &EmitCtx {
                    hdr,
                    seq_base: base,
                    msg_bytes: &mut sock.msg_bytes[d],
                },
            );
        }
        return;
    }
    let moved = call.ret as u64;
    let call_start = st.pos;
    let call_end = call_start + moved;

    if sock.seq_init[d] == 0 {
        sock.seq_base[d] = seq_now.wrapping_sub(call_end as u32);
        sock.seq_init[d] = 1;
    } else {
        let expected = sock.seq_base[d].wrapping_add(call_end as u32);
        // A read that also consumes the peer's FIN advances copied_seq by one more
        // (tcp_recvmsg_locked, found_fin_ok): not a byte of the stream.
        let fin = call.dir == dirs::RECV && seq_now == expected.wrapping_add(1);
        if expected != seq_now && !fin && !st.is_unparsed() {
            // Bytes moved that no traced call accounted for.
            count(counter::UNTRACED_BYTES);
            let out = st.stop(
                UnparsedReason::UntracedBytes,
                seq_now.wrapping_sub(expected),
            );
            emit(&hdr, &out, 0);
        }
    }

    if call.args.kind == call_kind::UNSUPPORTED && !st.is_unparsed() {
        count(counter::UNTRACED_BYTES);
        let out = st.stop(UnparsedReason::UntracedBytes, call.ret as u32);
        emit(&hdr, &out, 0);
    }
    if !st.is_unparsed() {
        let span = Span {
            start: call_start,
            end: call_end,
            seq_base: sock.seq_base[d],
            msg_bytes: &mut sock.msg_bytes[d],
        };
        frame(st, &peer, call, &hdr, &span);
    }
    st.pos = call_end;
}

/// Record header and sequence base for emissions outside the loop.
struct EmitCtx {
    hdr: EventHeader,
    seq_base: u32,
    /// This direction's [`SockState::msg_bytes`].
    msg_bytes: *mut u64,
}

/// Stream offsets `[start, end)` of the bytes one call moved, and the direction's TCP sequence
/// number of stream offset 0.
struct Span {
    start: u64,
    end: u64,
    seq_base: u32,
    /// This direction's [`SockState::msg_bytes`].
    msg_bytes: *mut u64,
}

/// Runs the framing loop over one call's bytes.
#[inline(never)]
fn frame(st: &mut DirState, peer: &PeerView, call: &Call, hdr: &EventHeader, span: &Span) {
    let (call_start, call_end) = (span.start, span.end);
    let (iov_ptr, iov_cnt, cur_base, cur_len) = if call.args.kind == call_kind::IOVEC {
        let mut iov = [0u64; 2];
        let rc = unsafe {
            bpf_probe_read_user(
                iov.as_mut_ptr() as *mut c_void,
                16,
                call.args.ptr as *const c_void,
            )
        };
        if rc != 0 {
            count(counter::USER_READ_FAULT);
            let out = st.stop(UnparsedReason::UserMemoryFault, rc as u32);
            emit(hdr, &out, 0);
            return;
        }
        (call.args.ptr, call.args.len, iov[0], iov[1])
    } else {
        (0, 1, call.args.ptr, call.args.len)
    };
    let mut ctx = LoopCtx {
        st: st as *mut DirState,
        msg_bytes: span.msg_bytes,
        seq_base: span.seq_base,
        hdr: *hdr,
        peer: *peer,
        call_start,
        call_end,
        iov_ptr,
        iov_cnt,
        cur_iov: 0,
        cur_start: call_start,
        cur_base,
        cur_len,
    };
    let steps = unsafe {
        bpf_loop(
            MAX_STEPS_PER_CALL,
            step as *mut c_void,
            &mut ctx as *mut LoopCtx as *mut c_void,
            0,
        )
    };
    if steps as u32 >= MAX_STEPS_PER_CALL && !st.is_unparsed() {
        let (at, _) = st.need();
        if at < call_end {
            count(counter::LOOP_LIMIT);
            let out = st.stop(UnparsedReason::LoopLimit, 0);
            emit(hdr, &out, 0);
        }
    }
}

/// A send that moved nothing (EAGAIN) at a message boundary: spice-server has counted the
/// message already, and its header is in the rejected buffer. Report it now, once.
#[inline(never)]
fn peek_eagain(st: &mut DirState, peer: &PeerView, call: &Call, ec: &EmitCtx) {
    let _ = st.prepare(peer);
    if st.is_unparsed() {
        return;
    }
    let (base, len) = if call.args.kind == call_kind::IOVEC {
        let mut iov = [0u64; 2];
        let rc = unsafe {
            bpf_probe_read_user(
                iov.as_mut_ptr() as *mut c_void,
                16,
                call.args.ptr as *const c_void,
            )
        };
        if rc != 0 {
            return;
        }
        (iov[0], iov[1])
    } else {
        (call.args.ptr, call.args.len)
    };
    if len < MAX_WANT as u64 && len < st.want_len as u64 {
        return;
    }
    let avail = if len < MAX_WANT as u64 {
        len as u32
    } else {
        MAX_WANT
    };
    let mut first = [0u8; BUF_LEN];
    let rc = unsafe {
        bpf_probe_read_user(
            first.as_mut_ptr() as *mut c_void,
            avail & 31,
            base as *const c_void,
        )
    };
    if rc != 0 {
        return;
    }
    if let Some(m) = st.peek(&first, avail, peer) {
        // Counted now, as its record is: the later write that completes it emits none.
        unsafe { *ec.msg_bytes += m.hdr_len as u64 + m.size as u64 };
        emit_message(&ec.hdr, &m, msg_flags::EAGAIN_START, ec.seq_base);
    }
}
