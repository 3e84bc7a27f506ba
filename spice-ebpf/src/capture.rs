//! Per-call capture: given a socket, a direction, the bytes the kernel took or returned and
//! where they sit in user memory, run the shared framing state machine over them and emit
//! records. Independent of which hooks delivered the call, so other hook sets (fentry/fexit,
//! kprobes) can feed the same function.
//!
//! Every framed data message also goes through spice-server's ACK-window rule
//! (`spice_ebpf_common::window`), on the socket's [`SockState::window`], before its record is
//! reserved: the state in `SOCKETS` is exact even when the ring is full. The two directions of
//! one socket share that state: spice-server, socat and haproxy serve each connection from one
//! thread at a time, but a process may send and receive on one socket from two threads at once
//! (the bench's load generator does). So a message is applied under the socket's
//! [`SockState::window_lock`], a word taken with a compare-and-exchange (BPF v3 atomics; a BPF
//! spin lock would need a BTF-described map value, which these maps are not) and held for the
//! rule's arithmetic only. A call that cannot take it within [`WINDOW_LOCK_TRIES`] applies its
//! message anyway and counts [`counter::WINDOW_LOCK_BUSY`].
//!
//! Records go to the rings named by the call's [`CallArgs::watch`] (the flags of its
//! process's `WATCHED_TGIDS` value, read at the call): `EVENTS` for the daemon or a
//! standalone observe, `TAP_EVENTS` for an observe beside the daemon, or both
//! ([`crate::maps::write_record`]). The kernel state is the same whichever rings get them.

use core::{
    ffi::c_void,
    intrinsics::{AtomicOrdering, atomic_cxchg},
    mem::MaybeUninit,
    sync::atomic::{Ordering, compiler_fence},
};

use aya_ebpf::helpers::{
    bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns,
    generated::{bpf_loop, bpf_probe_read_user},
};
use spice_ebpf_common::{
    config::{MAX_STEPS_PER_CALL, TCP_REFRESH_NS, WINDOW_LOCK_TRIES, counter, preexisting},
    event::{
        CallArgs, EventHeader, HuntEvent, LinkEvent, LockEvent, MessageEvent, SockState,
        SocketEvent, TcpSnapshot, TlsCall, TlsEvent, TlsMarkEvent, UnparsedEvent, call_kind,
        carrier, dir as dirs, hdr_flags, kind, lock_how, msg_flags, tcp_source, tls_func,
    },
    framing::{
        BUF_LEN, DirState, HEADER_BUF_LEN, LinkInfo, MAX_WANT, MessageInfo, Output, PeerView,
        Phase, Role, UnparsedReason,
    },
    protocol::{HUNT_TYPES, HUNT_TYPES_LEN},
};

use crate::{
    kernel::{self, AF_INET, AF_INET6, konf, read_at},
    maps::{
        CALL_SCRATCH, PREEXISTING, READ_WINDOW, SOCKETS, TLS_CALLS, TLS_SCRATCH, ZERO_SOCK, count,
        write_record,
    },
    mem::{zero_bytes, zero_words},
};

pub(crate) const EAGAIN: i32 = 11;

/// Map update flag: create only (include/uapi/linux/bpf.h).
const BPF_NOEXIST: u64 = 1;

/// The hunting type table ([`spice_ebpf_common::protocol::HUNT_TYPES`]) in the program's
/// read-only data: one load per candidate header.
static HUNT_TABLE: [u32; HUNT_TYPES_LEN] = HUNT_TYPES;

/// One socket call as seen by a hook.
#[repr(C)]
pub struct Call {
    /// `struct sock *` of the socket (null for the plaintext of a libssl call).
    pub sk: *const u8,
    /// The same socket as a `struct tcp_sock *` ([`kernel::tcp_sock`]; null with `sk`).
    pub tp: *const u8,
    /// Socket cookie.
    pub cookie: u64,
    /// [`dirs::SEND`] or [`dirs::RECV`].
    pub dir: u8,
    /// Bytes the kernel took or returned, or a negative errno.
    pub ret: i32,
    /// Where the bytes are in user memory, and the rings its records go to.
    pub args: CallArgs,
}

/// The framing loop's position within one call's bytes, shared with the `bpf_loop` step
/// callback ([`CallScratch::lp`]).
#[repr(C)]
pub struct LoopCtx {
    call_start: u64,
    call_end: u64,
    iov_ptr: u64,
    iov_cnt: u64,
    cur_iov: u64,
    cur_start: u64,
    cur_base: u64,
    cur_len: u64,
}

/// One call's working state while it is framed: what [`run_call`] hands to [`frame`],
/// [`peek_eagain`] and the step callback. It lives in a map value, not on the stack, because
/// the verifier limits the stack of a whole call chain (program, `on_call`, `frame`, the
/// `bpf_loop` callback and the functions it calls) to 512 bytes (`MAX_BPF_STACK`,
/// `check_max_stack_depth` in kernel/bpf/verifier.c). Programs on tracepoints get a private
/// stack per function on Linux 6.13+ (x86-64), which lifts that limit for them, but uprobe
/// programs do not (seen on 6.18) and older kernels have none: with these structures on the
/// stack, `spice_ssl_ret`'s chain took 544–752 bytes and the socket tracepoints' 720–736.
/// Now the deepest chains are at 512 (`kernel::stack`'s test in spice-observer).
///
/// Where it lives: the socket tracepoints run with preemption off (`__DO_TRACE`,
/// include/linux/tracepoint.h) and nothing that uses it runs in interrupt context, so one
/// per-CPU entry ([`crate::maps::CALL_SCRATCH`]) serves them; a uprobe program runs
/// preemptible (`bpf_prog_run_array_uprobe`, include/linux/bpf.h: `migrate_disable` only), so
/// the libssl return takes an entry of its thread ([`crate::maps::TLS_SCRATCH`]). A hook set
/// whose programs can be preempted (fentry/fexit trampolines also only disable migration)
/// must take a per-thread entry too.
///
/// No pointer is kept in it: the verifier tracks a pointer's type through registers and
/// stack slots, not through map values (a pointer loaded back from one is a plain number),
/// so the socket and direction go to the callback in [`LoopRefs`], on the stack.
#[repr(C)]
pub struct CallScratch {
    ec: EmitCtx,
    peer: PeerView,
    span: Span,
    lp: LoopCtx,
    /// The step's framing output (an [`Output`], emitted before the next step), as words:
    /// BTF cannot describe a data-carrying enum in a map value.
    out: [u64; OUTPUT_WORDS],
    /// The first iovec, then the first bytes, of a buffer a send could not take
    /// ([`peek_eagain`]).
    peek: [u8; BUF_LEN],
    /// [`peek_eagain`]'s trial framing state ([`DirState::peek_in`]).
    trial: DirState,
}

/// [`HEADER_BUF_LEN`] in 8-byte words: the stack buffers of the per-message header reads.
const HEADER_WORDS: usize = HEADER_BUF_LEN / 8;
const _: () = assert!(HEADER_BUF_LEN % 8 == 0 && HEADER_BUF_LEN >= 16); // an iovec fits too

/// Bytes a per-message header read takes for a header of `hdr_len` bytes (18 or 6): all of a
/// mini header, the first [`HEADER_BUF_LEN`] of a full one (what framing uses). A constant
/// per header kind, which the verifier needs for the read's length.
#[inline(always)]
fn header_read_len(hdr_len: u8) -> u32 {
    if hdr_len == 18 {
        HEADER_BUF_LEN as u32
    } else {
        6
    }
}

/// The header read into `words` (a [`header_read_len`] read), as the bytes
/// [`DirState::header_whole`] takes.
#[inline(always)]
fn header_bytes(words: &[u64; HEADER_WORDS]) -> &[u8; HEADER_BUF_LEN] {
    // SAFETY: HEADER_WORDS words are HEADER_BUF_LEN bytes, at u64 alignment.
    unsafe { &*(words.as_ptr() as *const [u8; HEADER_BUF_LEN]) }
}

/// [`CallScratch::out`]'s length in 8-byte words.
const OUTPUT_WORDS: usize = core::mem::size_of::<Output>() / 8;
// store_output copies whole words.
const _: () = assert!(core::mem::size_of::<Output>() % 8 == 0);

/// What the `bpf_loop` context slot holds (on [`frame`]'s stack; `bpf_loop` takes a stack
/// pointer, ARG_PTR_TO_STACK_OR_NULL): the call's scratch entry, its socket's `SOCKETS`
/// value and the direction being framed.
#[repr(C)]
struct LoopRefs {
    sc: *mut CallScratch,
    sock: *mut SockState,
    st: *mut DirState,
}

/// Bytes one [`ReadWindow`] read takes at most. A power of two (offsets into the window are
/// masked with `READ_WINDOW_LEN - 1` for the verifier).
pub const READ_WINDOW_LEN: usize = 2048;

/// A copy of up to [`READ_WINDOW_LEN`] bytes of the call being framed, from user address
/// `base`, for the element loop's whole-header reads ([`window_header`]).
///
/// A call that carries several small messages (a relay's forwarded chunk, a sender's batch)
/// used to take one `bpf_probe_read_user` per header, and on this project's VM each such read
/// costs about 100 ns whatever its length (the helper, `copy_from_user_nofault`'s checks and
/// the user-access fences), against a few ns per KiB for the copy itself. With the window, one
/// read serves every header that lies in the next [`READ_WINDOW_LEN`] bytes.
///
/// One per-CPU entry ([`crate::maps::READ_WINDOW`]), used by the programs that also take the
/// per-CPU [`CallScratch`] (the socket tracepoints, hook set `syscalls`' `sys_exit`, hook set
/// `kprobes`' kretprobes), which run with preemption off. It holds bytes of one call only
/// ([`frame`] empties it first: the caller's buffer may change between calls). The
/// preemptible programs (hook set `fentry`'s fexits, the libssl uprobes) take a per-thread
/// scratch, use no window, and read each header alone.
#[repr(C)]
pub struct ReadWindow {
    /// User address of `bytes[0]`.
    base: u64,
    /// Valid bytes from `base`; 0: empty.
    len: u64,
    /// The copy, with [`HEADER_BUF_LEN`] bytes of slack so that [`HEADER_BUF_LEN`] bytes can be
    /// copied out from any offset below [`READ_WINDOW_LEN`].
    bytes: [u8; READ_WINDOW_LEN + HEADER_BUF_LEN],
}

/// Reads the data header of `hl` bytes (6 or 18) at user address `src` into `words` (the
/// caller's stack buffer of [`HEADER_WORDS`] words) as [`header_alone`] does: its first
/// [`header_read_len`] bytes, zeros after them. The header lies whole in the call's current
/// buffer (or iovec), which holds `avail` bytes of the call from `src` on. Returns 0 when
/// `words` holds it, or `bpf_probe_read_user`'s error.
///
/// From the window if it holds the header, whatever the size of the messages before it.
/// Otherwise, when the stream's messages are small (the last one framed, `prev_len` bytes
/// with its header, at most a quarter of the window) and the buffer has room for another
/// header after this one, the window is refilled first with the next
/// `min(avail, READ_WINDOW_LEN)` bytes from `src`: the rest of this buffer only, never past
/// what the call moved. Else, or when that read faults, the header is read alone, as the
/// step did before the window; a fault there is returned, and stops the direction with its
/// reason as before.
///
/// Shaped for the verifier, which walks the rest of the step once for each distinct state it
/// leaves with:
/// * The header is copied to the stack buffer, not handed out as a pointer into the window:
///   a pointer of two types (stack or map value) into the same code made it walk that code
///   twice (the programs took 15 s instead of 3.4 s to load).
/// * The window's way out returns a 0 the verifier cannot see as a constant
///   (`w.len >> 63`: `len` is at most [`READ_WINDOW_LEN`]). With a constant 0 beside the
///   helper's unknown result, the socket tracepoints took 2.2–2.6 s each to load instead of
///   0.6 s (`strace -T` of their `BPF_PROG_LOAD`).
/// * A function of its own that looks the window up itself: with the window's pointer in
///   [`LoopRefs`], or the lookup in [`step`], the deepest call chains (`fexit`, `kretprobe`,
///   `spice_sock_send`) grew past the 512-byte limit (see [`CallScratch`]).
#[inline(never)]
fn window_header(src: u64, avail: u64, hl: u64, prev_len: u64, words: *mut u64) -> i64 {
    const MASK: u64 = READ_WINDOW_LEN as u64 - 1;
    let w = match READ_WINDOW.get_ptr_mut(0) {
        // SAFETY: this CPU's entry, used by one program run at a time (see ReadWindow).
        Some(w) => unsafe { &mut *w },
        None => return header_alone(src, hl, words),
    };
    if src < w.base || src + hl > w.base + w.len {
        // A copy that cannot hold a second header (a header alone in its iovec, the call's
        // last bytes) would only move the read into a map value.
        if prev_len > READ_WINDOW_LEN as u64 / 4 || avail < 2 * hl {
            return header_alone(src, hl, words);
        }
        let want = if avail < READ_WINDOW_LEN as u64 {
            avail as u32
        } else {
            READ_WINDOW_LEN as u32
        };
        let rc = unsafe {
            bpf_probe_read_user(
                w.bytes.as_mut_ptr() as *mut c_void,
                want,
                src as *const c_void,
            )
        };
        if rc != 0 {
            w.len = 0;
            return header_alone(src, hl, words);
        }
        w.base = src;
        w.len = want as u64;
    }
    let at = ((src - w.base) & MASK) as usize;
    // SAFETY: `at` < READ_WINDOW_LEN, and `bytes` has HEADER_BUF_LEN more.
    let p = unsafe { w.bytes.as_ptr().add(at) } as *const [u64; HEADER_WORDS];
    let [w0, w1] = unsafe { core::ptr::read_unaligned(p) };
    // As `header_alone` leaves them: a mini header's 6 bytes and zeros, a full header's first
    // 16 bytes (`header_read_len`), not the window's next bytes. Without a branch (1 for a
    // full header, 0 for a mini one), which would make two ways out again (see above).
    let full = (hl >> 4) & 1;
    let words_out = [
        w0 & (u64::MAX >> (16 * (1 - full))),
        w1 & full.wrapping_neg(),
    ];
    for (i, v) in words_out.iter().enumerate() {
        // SAFETY: `words` is the caller's HEADER_WORDS-word stack buffer.
        unsafe { core::ptr::write_volatile(words.add(i), *v) };
    }
    (w.len >> 63) as i64
}

/// Reads the header of `hl` bytes at user address `src` alone into `words` (a
/// [`header_read_len`] read): `bpf_probe_read_user`'s result.
#[inline(always)]
fn header_alone(src: u64, hl: u64, words: *mut u64) -> i64 {
    let len = header_read_len(hl as u8);
    unsafe { bpf_probe_read_user(words as *mut c_void, len, src as *const c_void) }
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

/// Writes the record for one framing output of direction `st` (peer view `peer`); counts a
/// loss if the ring is full.
///
/// Dispatches to enum-free functions: BTF cannot describe `Output` in a BPF function signature.
#[inline(always)]
fn emit(ec: &EmitCtx, sock: *mut SockState, out: &Output, st: &DirState, peer: &PeerView) {
    match out {
        Output::None => {}
        Output::Message(m) => {
            let mut flags = if m.lock != 0 {
                emit_lock(&ec.hdr, ec.route, m, st);
                msg_flags::LOCK
            } else {
                0
            };
            if peer.mid_message {
                flags |= msg_flags::PEER_MID_MESSAGE;
            }
            emit_message(
                ec,
                sock,
                m,
                message_meta(flags, st.role, message_channel_type(st, peer)),
            )
        }
        Output::Link(l) => emit_link(&ec.hdr, ec.route, l),
        Output::Unparsed { reason, detail, at } => {
            emit_unparsed(&ec.hdr, ec.route, *reason as u8, *detail, *at)
        }
        Output::Hunt { .. } => {
            count(counter::RESYNCS);
            emit_hunt(&ec.hdr, ec.route, st)
        }
    }
}

/// [`emit_message`]'s message flags, role and channel type in one argument (a BPF function
/// takes at most five).
#[inline(always)]
fn message_meta(flags: u8, role: u8, channel_type: u8) -> u32 {
    flags as u32 | (role as u32) << 8 | (channel_type as u32) << 16
}

/// Writes the record of a hunt `st` just began ([`DirState::hunt`]: reason, detail and start
/// offset are in the state).
#[inline(never)]
fn emit_hunt(hdr: &EventHeader, route: u8, st: &DirState) {
    let (role, resyncs, reason, detail, at) =
        (st.role, st.resyncs, st.reason, st.detail, st.hunt_from);
    write_record::<HuntEvent>(route, |p| unsafe {
        (*p).hdr = *hdr;
        (*p).hdr.kind = kind::HUNT;
        (*p).at = at;
        (*p).reason = reason;
        (*p).role = role;
        zero_bytes(&raw mut (*p)._pad);
        (*p).detail = detail;
        (*p).resyncs = resyncs;
        (*p)._pad2 = 0;
    });
}

/// Writes the record of the lock that message `m` ends ([`MessageInfo::lock`]), before the
/// message's own record.
#[inline(never)]
fn emit_lock(hdr: &EventHeader, route: u8, m: &MessageInfo, st: &DirState) {
    count(counter::LOCKS);
    let (run, role, mask, candidates, resyncs, from) = (
        st.run,
        st.role,
        st.chain_mask,
        st.candidates,
        st.resyncs,
        st.hunt_from,
    );
    write_record::<LockEvent>(route, |p| unsafe {
        (*p).hdr = *hdr;
        (*p).hdr.kind = kind::LOCK;
        (*p).at = m.at;
        (*p).skipped = m.at.saturating_sub(from);
        (*p).index = m.index;
        (*p).how = m.lock;
        (*p).run = run;
        (*p).hdr_len = m.hdr_len;
        (*p).role = role;
        (*p).channel_mask = mask;
        (*p)._pad = 0;
        (*p).candidates = candidates;
        (*p).resyncs = resyncs;
    });
}

/// Writes the record of a [`DirState::stop`] or [`DirState::prepare`] output (of those, only
/// [`Output::Unparsed`] has one), to the rings `route` names.
#[inline(always)]
fn emit_stop(hdr: &EventHeader, route: u8, out: &Output) {
    if let Output::Unparsed { reason, detail, at } = out {
        emit_unparsed(hdr, route, *reason as u8, *detail, *at);
    }
}

/// Channel type of the connection, from the client's link message, as the window rule needs
/// it for a message of direction `st`: the server → client direction takes it from the other
/// direction (`peer`), the client → server direction parsed it itself.
#[inline(always)]
fn message_channel_type(st: &DirState, peer: &PeerView) -> u8 {
    if st.role == Role::ServerToClient as u8 {
        peer.channel_type
    } else {
        st.channel_type
    }
}

/// Applies one framed data message of a direction with SPICE role `role` ([`DirState::role`])
/// to the socket's window ([`WindowState::apply`], at the call's `bpf_ktime_get_ns`, the
/// record's `ts_ns`) and byte total, then writes its record with the window's post-state. A
/// message [`DirState::peek`] reported already (`already_reported`) was applied then and is
/// skipped. The window is applied before the record is reserved, so a full ring loses the
/// record (counted) but never the kernel's state.
///
/// Records are written in place in the ring: the BPF stack is 512 bytes for the whole chain.
#[inline(always)]
fn emit_message(ec: &EmitCtx, sock: *mut SockState, m: &MessageInfo, meta: u32) {
    let _ = spice_emit_message(ec, sock, m, meta);
}

/// [`emit_message`] as a BPF global function: the verifier checks it once, on its own (its
/// pointer arguments are memory of their types' sizes, maybe null), and each call of it only
/// against its signature, with an unknown result (kernel/bpf/verifier.c, "Func#N is global
/// and assumed valid"; Linux 5.6, pointer arguments 5.12). As a static function it was
/// checked again on every path that reached a call, each path through the window rule
/// multiplying the paths after it: inside the `bpf_loop` callbacks, where the verifier
/// prunes only paths with the same constants, `spice_sock_send`, `spice_sys_exit` and
/// `spice_ssl_ret` went past its 1M instructions on a Linux 6.18 build (6.18.44,
/// November 2026; an earlier build of the same version had accepted them). `no_mangle` keeps
/// the symbol external, so its BTF linkage is global (`bpftool btf dump file` shows
/// `FUNC 'spice_emit_message' … linkage=global`). Returns 0.
#[unsafe(no_mangle)]
#[inline(never)]
pub(crate) extern "C" fn spice_emit_message(
    ec: *const EmitCtx,
    sock: *mut SockState,
    m: *const MessageInfo,
    meta: u32,
) -> i32 {
    if ec.is_null() || sock.is_null() || m.is_null() {
        return 0;
    }
    // SAFETY: non-null; the caller's scratch entry and the socket's SOCKETS value.
    let (ec, m) = unsafe { (&*ec, &*m) };
    if m.already_reported {
        return 0;
    }
    let (flags, role, channel_type) = (meta as u8, (meta >> 8) as u8, (meta >> 16) as u8);
    count(counter::MESSAGES_FRAMED);
    // SAFETY: `sock` is the socket's SOCKETS value, looked up for this call; the window, the
    // lock and the byte totals do not overlap the DirState being framed.
    let lock = unsafe { &mut (*sock).window_lock as *mut u64 };
    let locked = take_window_lock(lock);
    let w = unsafe { &mut (*sock).window };
    let fx = w.apply(role, ec.hdr.ts_ns, channel_type, m.msg_type, m.prefix);
    let (mw, in_flight) = (w.messages_window, w.count);
    if locked {
        release_window_lock(lock);
    } else {
        count(counter::WINDOW_LOCK_BUSY);
    }
    unsafe { (*sock).msg_bytes[(ec.hdr.dir & 1) as usize] += m.hdr_len as u64 + m.size as u64 };
    write_record::<MessageEvent>(ec.route, |p| unsafe {
        crate::mem::copy_words(&ec.hdr, &raw mut (*p).hdr);
        (*p).hdr.kind = kind::MESSAGE;
        (*p).at = m.at;
        (*p).index = m.index;
        (*p).size = m.size;
        (*p).msg_type = m.msg_type;
        (*p).hdr_len = m.hdr_len;
        (*p).flags = flags;
        (*p).prefix = m.prefix;
        (*p).seq = ec.seq_base.wrapping_add(m.at as u32);
        (*p).win_mw = mw;
        (*p).win_count = in_flight;
        (*p).win_effects = fx;
        zero_bytes(&raw mut (*p)._pad);
    });
    0
}

/// Takes a socket's window lock ([`SockState::window_lock`], at `lock`) within
/// [`WINDOW_LOCK_TRIES`] compare-and-exchanges: one inline, the rest in a `bpf_loop` (so that
/// the verifier checks one try, not every one); false if another CPU held it throughout. The
/// intrinsics because Rust's BPF target declares no compare-and-swap (its generic CPU has
/// none); the programs are generated for v3, which has (`spice-observer/build.rs`). Measured
/// (bpf_stats, saturated spice-peer load, alternating builds): `spice_sock_send` 852-874 ns
/// per run with it and v3, 891-923 ns before; 1876-2040 ns against 1854-2084 ns at 10
/// messages per call.
#[inline(always)]
fn take_window_lock(lock: *mut u64) -> bool {
    // The first try inline: the lock is almost always free.
    // SAFETY: `lock` points into the socket's SOCKETS value.
    let (_, ok) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::Acquire }, { AtomicOrdering::Relaxed }>(lock, 0, 1)
    };
    ok || spin_window_lock(lock)
}

/// Releases what [`take_window_lock`] took: a plain store after a compiler fence, which is a
/// release on x86-64 (stores are not reordered with earlier stores; the programs are x86-64
/// only, see `probes/syscalls.rs`), and cheaper than an exchange.
#[inline(always)]
fn release_window_lock(lock: *mut u64) {
    compiler_fence(Ordering::Release);
    // SAFETY: `lock` points into the socket's SOCKETS value.
    unsafe { core::ptr::write_volatile(lock, 0) };
}

/// The rest of [`take_window_lock`]'s tries. Inlined: a frame of its own would add a
/// 32-byte step to the deepest call chain on kernels that round frames to 32 bytes (before
/// the JIT's 16-byte rounding), see [`CallScratch`].
#[inline(always)]
fn spin_window_lock(lock: *mut u64) -> bool {
    let mut ctx = LockTry { lock, taken: 0 };
    unsafe {
        bpf_loop(
            WINDOW_LOCK_TRIES,
            try_window_lock as *mut c_void,
            &mut ctx as *mut LockTry as *mut c_void,
            0,
        )
    };
    ctx.taken != 0
}

/// State of [`take_window_lock`]'s loop.
#[repr(C)]
struct LockTry {
    lock: *mut u64,
    taken: u64,
}

/// One try of [`take_window_lock`]: returns 1 (stop) once the lock is taken.
extern "C" fn try_window_lock(_index: u64, ctx: *mut c_void) -> i64 {
    let c = unsafe { &mut *(ctx as *mut LockTry) };
    // Read before trying (test and test-and-set): a plain read leaves the holder's cache
    // line shared instead of taking it away at every try.
    // SAFETY: `lock` points into the socket's SOCKETS value.
    if unsafe { core::ptr::read_volatile(c.lock) } != 0 {
        return 0;
    }
    // SAFETY: as above.
    let (_, ok) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::Acquire }, { AtomicOrdering::Relaxed }>(c.lock, 0, 1)
    };
    if ok {
        c.taken = 1;
        return 1;
    }
    0
}

#[inline(never)]
fn emit_link(hdr: &EventHeader, route: u8, l: &LinkInfo) {
    write_record::<LinkEvent>(route, |p| unsafe {
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
    });
}

#[inline(never)]
fn emit_unparsed(hdr: &EventHeader, route: u8, reason: u8, detail: u32, at: u64) {
    write_record::<UnparsedEvent>(route, |p| unsafe {
        (*p).hdr = *hdr;
        (*p).hdr.kind = kind::UNPARSED;
        (*p).at = at;
        (*p).reason = reason;
        zero_bytes(&raw mut (*p)._pad);
        (*p).detail = detail;
    });
}

/// One step of the per-call loop: resolve the element, move to the iovec holding the next
/// wanted byte, or read (part of) the element and complete it. Returns 1 to stop. `BULK`:
/// whole headers are read through this CPU's [`ReadWindow`] (only where the program cannot be
/// preempted).
extern "C" fn step<const BULK: bool>(_index: u64, ctx: *mut c_void) -> i64 {
    // The verifier requires a callback's return in [0, 1]. LLVM returns some paths' bools
    // straight from a byte it loaded (0..=255 to the verifier); the volatile read and the
    // mask keep the bound explicit.
    let r = step_body::<BULK>(ctx);
    unsafe { core::ptr::read_volatile(&r) & 1 }
}

/// The body of [`step`]: 1 to stop the loop, 0 to go on.
#[inline(always)]
fn step_body<const BULK: bool>(ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is `frame`'s LoopRefs; all three outlive the loop.
    let r = unsafe { &*(ctx as *const LoopRefs) };
    let (sc, sock, st) = unsafe { (&mut *r.sc, r.sock, &mut *r.st) };
    let (c, ec, peer) = (&mut sc.lp, &sc.ec, &sc.peer);
    if st.is_unparsed() || st.need().0 >= c.call_end {
        return 1;
    }
    // The step's one stack buffer for its user reads: the next iovec, or a whole data header
    // (see [`HEADER_BUF_LEN`] for why on the stack). One buffer for both keeps the frame
    // within the chain's 512 bytes (`step` is on the deepest chains: spice-observer's
    // `kernel::stack` test).
    let mut words = MaybeUninit::uninit();
    let words: &mut [u64; HEADER_WORDS] = zero_words(&mut words);
    // Resolve the element only once its first byte is in this call (see DirState::prepare).
    let out = st.prepare(peer);
    emit_stop(&ec.hdr, ec.route, &out);
    if st.is_unparsed() {
        return 1;
    }
    let (at, remaining) = st.need();
    if at < c.call_start {
        let out = st.stop(UnparsedReason::Internal, 0);
        emit_stop(&ec.hdr, ec.route, &out);
        return 1;
    }
    if at >= c.cur_start + c.cur_len {
        // The wanted byte is in a later iovec.
        c.cur_start += c.cur_len;
        c.cur_iov += 1;
        if c.cur_iov >= c.iov_cnt {
            let out = st.stop(UnparsedReason::Internal, 1);
            emit_stop(&ec.hdr, ec.route, &out);
            return 1;
        }
        let src = (c.iov_ptr + c.cur_iov * 16) as *const c_void;
        let rc = unsafe { bpf_probe_read_user(words.as_mut_ptr() as *mut c_void, 16, src) };
        if rc != 0 {
            count(counter::USER_READ_FAULT);
            let out = st.stop(UnparsedReason::UserMemoryFault, rc as u32);
            emit_stop(&ec.hdr, ec.route, &out);
            return 1;
        }
        c.cur_base = words[0];
        c.cur_len = words[1];
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
    // A whole data header in this buffer: framed from one read into the stack buffer
    // (DirState::header_whole), as the call's first message is ([`first_message`]); where the
    // program cannot be preempted, through this CPU's ReadWindow.
    if st.have == 0 && st.hdr_len != 0 && remaining == st.hdr_len as u32 && n == remaining as u64 {
        let src = c.cur_base + off;
        let avail = if seg_left < call_left {
            seg_left
        } else {
            call_left
        };
        // The last message framed in this direction, header included: whether to fill the
        // window (see window_header).
        let prev_len = st.msg_size as u64 + st.hdr_len as u64;
        let hl = st.hdr_len as u64;
        let rc = if BULK {
            window_header(src, avail, hl, prev_len, words.as_mut_ptr())
        } else {
            header_alone(src, hl, words.as_mut_ptr())
        };
        if rc == 0 {
            if let Some(m) = st.header_whole(header_bytes(words)) {
                let flags = if peer.mid_message {
                    msg_flags::PEER_MID_MESSAGE
                } else {
                    0
                };
                let meta = message_meta(flags, st.role, message_channel_type(st, peer));
                store_words(&m, sc.out.as_mut_ptr());
                // SAFETY: the MessageInfo just stored (smaller than an Output).
                let m = unsafe { &*(sc.out.as_ptr() as *const MessageInfo) };
                emit_message(ec, sock, m, meta);
                return 0;
            }
        }
    }
    let n = (n as u32) & 31;
    let have = st.have & 31;
    let dst = unsafe { st.buf.as_mut_ptr().add(have as usize) } as *mut c_void;
    let rc = unsafe { bpf_probe_read_user(dst, n, (c.cur_base + off) as *const c_void) };
    if rc != 0 {
        count(counter::USER_READ_FAULT);
        let out = st.stop(UnparsedReason::UserMemoryFault, rc as u32);
        emit_stop(&ec.hdr, ec.route, &out);
        return 1;
    }
    st.have = have + n;
    if st.have >= st.want_len {
        // The hunting checks return their output here rather than emit it themselves, so
        // that `hunt_complete`'s frame and the emitting functions' are never on the stack at
        // once (the 512-byte limit is on the whole chain: see [`LoopCtx`]).
        let out = sc.out.as_mut_ptr() as *mut c_void;
        if st.phase == Phase::Hunt as u8 {
            hunt_complete(st, out);
        } else {
            complete(st, peer, out);
        }
        // SAFETY: one of the two wrote an Output there.
        emit(ec, sock, unsafe { &*(out as *const Output) }, st, peer);
    }
    0
}

/// A hunting direction's candidate header is complete: validate it; at a lock the output is
/// the first counted message ([`DirState::complete_hunt`]). A function of its own so that the
/// verifier walks the hunting checks once, apart from the framing of [`step`]. `out` is an
/// [`Output`] of the caller's, passed untyped: BTF cannot describe `Output` in a BPF
/// function signature (see [`emit`]).
#[inline(never)]
fn hunt_complete(st: &mut DirState, out: *mut c_void) {
    // SAFETY: `out` is the caller's CallScratch::out: OUTPUT_WORDS words, 8-aligned (Output's
    // alignment is at most 8).
    // SAFETY: the caller passes its own `Output`.
    store_output(&st.complete_hunt_with(&HUNT_TABLE), out);
}

/// A framing direction's element is complete ([`DirState::complete`]); its output goes to
/// `out`, as in [`hunt_complete`]. A function of its own: written in place by inlined code,
/// the enum's bytes went out through a register LLVM had reused for a pointer, which the
/// verifier refuses ("32-bit pointer arithmetic prohibited").
#[inline(never)]
fn complete(st: &mut DirState, peer: &PeerView, out: *mut c_void) {
    store_output(&st.complete(peer), out);
}

/// Copies `o` to `out` ([`CallScratch::out`]) word by word through memory. Storing the enum
/// directly lets LLVM assemble its words from registers, including never-written ones for the
/// bytes a variant leaves out, which the verifier refuses ("!read_ok"); the volatile loads
/// read the stack copy instead (uninitialised padding bytes there are readable for a
/// CAP_PERFMON loader, `allow_uninit_stack`).
#[inline(always)]
fn store_output(o: &Output, out: *mut c_void) {
    store_words(o, out as *mut u64);
}

/// [`store_output`] for any value of whole 8-byte words that fits in
/// [`CallScratch::out`] (an [`Output`] or a [`MessageInfo`]).
#[inline(always)]
fn store_words<T: Copy>(v: &T, dst: *mut u64) {
    const {
        assert!(core::mem::size_of::<T>() % 8 == 0 && core::mem::size_of::<T>() <= 8 * OUTPUT_WORDS)
    };
    let src = v as *const T as *const u64;
    for i in 0..core::mem::size_of::<T>() / 8 {
        // SAFETY: `src` is a T of whole words (its stack slot is 8-aligned, T's alignment is
        // at most 8); `dst` is a CallScratch::out, at least as long.
        unsafe { core::ptr::write_volatile(dst.add(i), core::ptr::read_volatile(src.add(i))) };
    }
}

/// Returns the tracked state of the socket, creating it (and announcing the socket) on first
/// sight. `None` if the map is full.
#[inline(always)]
fn socket_state(call: &Call, tgid: u32, now: u64) -> Option<*mut SockState> {
    if let Some(s) = SOCKETS.get_ptr_mut(&call.cookie) {
        return Some(s);
    }
    let zero = ZERO_SOCK.get_ptr(0)?;
    // BPF_NOEXIST: two threads' first calls on one socket at once must not replace each
    // other's entry (the first would go on updating a freed one); the one that loses uses
    // the winner's.
    if SOCKETS
        .insert(&call.cookie, unsafe { &*zero }, BPF_NOEXIST)
        .is_err()
    {
        return match SOCKETS.get_ptr_mut(&call.cookie) {
            Some(s) => Some(s),
            None => {
                count(counter::SOCKET_MAP_FULL);
                None
            }
        };
    }
    let s = SOCKETS.get_ptr_mut(&call.cookie)?;
    let state = unsafe { &mut *s };
    state.tgid = tgid;
    state.watch = call.args.watch;
    let hdr = header(kind::SOCKET, call.dir, call.cookie, tgid, now);
    announce_socket(call.sk, &hdr, call.args.watch);
    if let Some(how) = PREEXISTING.get_ptr(&call.cookie) {
        // Connected before observation started: no link phase to start from. Both directions
        // hunt for message boundaries, each with the SPICE role the way the socket was made
        // gives it (config::preexisting).
        let send_role = match unsafe { *how } {
            preexisting::ACCEPTED => Role::ServerToClient as u8,
            preexisting::CONNECTED => Role::ClientToServer as u8,
            _ => Role::Unknown as u8,
        };
        let recv_role = match send_role {
            1 => Role::ServerToClient as u8,
            2 => Role::ClientToServer as u8,
            _ => Role::Unknown as u8,
        };
        for d in 0..2usize {
            let ds = &mut state.dir[d];
            ds.role = if d == dirs::SEND as usize {
                send_role
            } else {
                recv_role
            };
            let _ = ds.hunt(UnparsedReason::AttachedMidStream, 0, 0);
            emit_hunt(
                &EventHeader {
                    kind: kind::HUNT,
                    dir: d as u8,
                    ..hdr
                },
                call.args.watch,
                ds,
            );
        }
    }
    Some(s)
}

#[inline(never)]
fn announce_socket(sk: *const u8, hdr: &EventHeader, route: u8) {
    let family: u16 = read_at(sk, konf!(skc_family));
    write_record::<SocketEvent>(route, |p| unsafe {
        (*p).hdr = *hdr;
        (*p).tid = bpf_get_current_pid_tgid() as u32;
        (*p).family = family;
        (*p).lport = read_at(sk, konf!(skc_num));
        (*p).rport = u16::from_be(read_at(sk, konf!(skc_dport)));
        zero_bytes(&raw mut (*p)._pad);
        zero_bytes(&raw mut (*p).laddr);
        zero_bytes(&raw mut (*p).raddr);
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
    });
}

/// Updates the socket's TCP state ([`SockState::tcp`], in place) after a call and returns
/// the sequence number after it in stream terms: `write_seq` (send) or `copied_seq` (recv).
/// Those two only change through the application's own calls, which these hooks see, and the
/// agent anchors every sample on them: the one of the call's direction is read at every
/// call. The members that move with ACKs and transmissions are refreshed at most every
/// [`TCP_REFRESH_NS`] per socket (`ts_ns` says when, 0 before the first read; sockops
/// callbacks refresh them between calls on enrolled connections). `tp` is the socket's
/// `struct tcp_sock *`, read as [`kernel::tcp_u32`] says for `RAW`.
#[inline(always)]
fn store_tcp<const RAW: bool>(tp: *const u8, snap: &mut TcpSnapshot, now: u64, send: bool) -> u32 {
    let seq = kernel::seq_after_call::<RAW>(tp, send);
    if send {
        snap.write_seq = seq;
    } else {
        snap.copied_seq = seq;
    }
    if now.wrapping_sub(snap.ts_ns) >= TCP_REFRESH_NS {
        kernel::fill_tcp::<RAW>(tp, now, tcp_source::SOCKET_CALL, snap);
    }
    seq
}

/// Handles one traced socket call of the current thread, `pid_tgid` its
/// `bpf_get_current_pid_tgid` (the hook has it already, from its `WATCHED_TGIDS` lookup).
///
/// `SEND`: the hook sees sends (then a send that failed with EAGAIN is handled too). The
/// receive hook's instance has no EAGAIN path, so its program does not contain
/// [`peek_eagain`], whose frame would otherwise be on its deepest call chain. `RAW`: `call.tp`
/// is not BTF-typed (hook set `syscalls`, [`kernel::tcp_u32`]).
#[inline(always)]
pub fn on_call<const SEND: bool, const RAW: bool, const THREAD: bool>(call: &Call, pid_tgid: u64) {
    count(counter::CALLS_TRACED);
    // Decided here, in the hook's own frame, by the first test of `ret` in the program.
    if SEND && call.dir == dirs::SEND && call.ret == -EAGAIN {
        let _ = spice_eagain_send(call, pid_tgid, THREAD as u32);
        return;
    }
    if call.ret <= 0 {
        // Errors, EOF and zero-length calls move nothing. Do not (re)create state: this also
        // keeps a socket read after its close from being announced again.
        return;
    }
    on_moved::<RAW, THREAD>(call, pid_tgid);
}

/// [`on_call`] for a call that moved bytes (`ret` > 0).
#[inline(never)]
fn on_moved<const RAW: bool, const THREAD: bool>(call: &Call, pid_tgid: u64) {
    call_body::<false, RAW, THREAD>(call, pid_tgid);
    crate::mem::scalar_r0();
}

/// A send that moved nothing (EAGAIN) on socket call `call` ([`on_call`]; `thread` 1 for a
/// preemptible hook's per-thread scratch entry), as a BPF global function: the verifier
/// checks its path on its own (see [`spice_emit_message`]). Inside one program, the 6.1
/// verifier never checked the EAGAIN path under hook sets `fentry` and `kprobes`: where it
/// joined the path of a call that moved bytes, it took the two states for one (their `ret`
/// was not marked precise, though a later test of it had been decided by its range on the
/// first path), so the EAGAIN code was never seen, and code the verifier never sees becomes
/// a jump past it. bpf_printk in the 6.1 guest showed the calls reaching `on_call` with
/// `ret` -11 and going no further; no EAGAIN message start was reported. In here `ret` is
/// the constant -EAGAIN ([`call_body`]), so no test of it has two outcomes to join. The
/// socket pointers are plain numbers in here (no BTF type crosses a global function's
/// arguments), so the TCP state is read with `bpf_probe_read_kernel` (`RAW`). Returns 0.
#[unsafe(no_mangle)]
#[inline(never)]
pub(crate) extern "C" fn spice_eagain_send(call: *const Call, pid_tgid: u64, thread: u32) -> i32 {
    if call.is_null() {
        return 0;
    }
    // A copy on this function's stack: the 6.1 verifier takes a map key only from the stack
    // or a map value, not from memory passed in as an argument ("R2 type=mem expected=fp").
    // SAFETY: non-null: the caller's Call.
    let call: Call = unsafe { core::ptr::read_volatile(call) };
    if thread != 0 {
        call_body::<true, true, true>(&call, pid_tgid);
    } else {
        call_body::<true, true, false>(&call, pid_tgid);
    }
    0
}

/// [`on_call`]'s body: `EAGAIN`, a send that moved nothing (its socket must be known), else a
/// call that moved bytes.
#[inline(always)]
fn call_body<const EAGAIN: bool, const RAW: bool, const THREAD: bool>(call: &Call, pid_tgid: u64) {
    // The EAGAIN instance never reads `call.ret` (see spice_eagain_send).
    let ret = if EAGAIN {
        -(crate::capture::EAGAIN)
    } else {
        call.ret
    };
    let tgid = (pid_tgid >> 32) as u32;
    let now = unsafe { bpf_ktime_get_ns() };
    let sp = if !EAGAIN {
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
    if sock.carrier != carrier::PLAIN {
        if tls_socket_call::<RAW>(sock, call, ret, pid_tgid, now) {
            return;
        }
    } else if sock.dir[0].reason == UnparsedReason::Tls as u8
        || sock.dir[1].reason == UnparsedReason::Tls as u8
    {
        plain_tls_call(call, pid_tgid);
    }

    let seq_now = store_tcp::<RAW>(call.tp, &mut sock.tcp, now, call.dir == dirs::SEND);
    // A one-entry per-CPU array (the lookup cannot fail), or for a preemptible hook the
    // thread's own entry (`None`: TLS_SCRATCH full; the call is then not framed).
    let sc = if THREAD {
        tls_scratch(pid_tgid)
    } else {
        CALL_SCRATCH.get_ptr_mut(0)
    };
    let Some(sc) = sc else {
        return;
    };
    // The read window only where the scratch is per-CPU (see ReadWindow).
    run_call::<EAGAIN>(
        sock,
        call,
        ret,
        tgid,
        now,
        Some(seq_now),
        unsafe { &mut *sc },
        !THREAD,
    );
}

/// The carrier part of a socket call on a socket that is not known to be plain: decides the
/// carrier at its first call ([`carrier`]: TLS if the call runs inside a hooked libssl
/// function, announced by a [`TlsEvent`]), and for a TLS socket does all the call needs (its
/// TCP state and TCP byte count, the cookie for the libssl call it runs in). Returns true if
/// the socket is TLS: its framing then runs on the plaintext ([`on_plaintext`]), not here.
///
/// A TLS socket's call outside every hooked libssl function moved bytes whose plaintext the
/// hooks cannot have seen (they were detached): that direction resyncs
/// ([`counter::TLS_UNSEEN`]).
#[inline(never)]
fn tls_socket_call<const RAW: bool>(
    sock: &mut SockState,
    call: &Call,
    ret: i32,
    pid_tgid: u64,
    now: u64,
) -> bool {
    let tgid = (pid_tgid >> 32) as u32;
    let tc = TLS_CALLS.get_ptr_mut(&pid_tgid);
    if sock.carrier == carrier::UNDECIDED {
        match tc {
            None => {
                sock.carrier = carrier::PLAIN;
                return false;
            }
            Some(t) => {
                sock.carrier = carrier::TLS;
                let func = unsafe { (*t).func };
                let hdr = header(kind::TLS, call.dir, call.cookie, tgid, now);
                write_record::<TlsEvent>(call.args.watch, |p| unsafe {
                    (*p).hdr = hdr;
                    (*p).func = func;
                    zero_bytes(&raw mut (*p)._pad);
                });
            }
        }
    }
    if sock.carrier != carrier::TLS {
        return false;
    }
    let d = (call.dir & 1) as usize;
    match tc {
        Some(t) => unsafe {
            (*t).cookie = call.cookie;
            if ret == -EAGAIN {
                (*t).eagain = 1;
            }
        },
        None => {
            if ret > 0 {
                count(counter::TLS_UNSEEN);
                let st = &mut sock.dir[d];
                if st.phase != Phase::Hunt as u8 && !st.is_unparsed() {
                    let at = st.pos;
                    let _ = st.hunt(UnparsedReason::UntracedBytes, ret as u32, at);
                    let hdr = header(kind::HUNT, call.dir, call.cookie, tgid, now);
                    count(counter::RESYNCS);
                    emit_hunt(&hdr, call.args.watch, st);
                }
            }
        }
    }
    let _ = store_tcp::<RAW>(call.tp, &mut sock.tcp, now, call.dir == dirs::SEND);
    if ret > 0 {
        sock.wire_pos[d] += ret as u64;
    }
    true
}

/// A call on a socket judged `unparsed: tls` on its own bytes (its first call ran outside the
/// libssl hooks): if it runs inside a hooked libssl call, that call's `SSL *` is this socket,
/// whose plaintext is not framed. Recording the cookie keeps the return from counting the
/// call's plaintext as unmapped (a loss): the socket is reported `unparsed: tls` instead.
#[inline(never)]
fn plain_tls_call(call: &Call, pid_tgid: u64) {
    if let Some(t) = TLS_CALLS.get_ptr_mut(&pid_tgid) {
        unsafe { (*t).cookie = call.cookie };
    }
}

/// The calling thread's [`CallScratch`] entry in [`TLS_SCRATCH`], made at its first
/// framed libssl call (the new entry's bytes are copied from this CPU's [`CALL_SCRATCH`]
/// entry: every field is written before it is read). `None` if the map is full.
#[inline(always)]
fn tls_scratch(pid_tgid: u64) -> Option<*mut CallScratch> {
    if let Some(sc) = TLS_SCRATCH.get_ptr_mut(&pid_tgid) {
        return Some(sc);
    }
    let template = CALL_SCRATCH.get_ptr(0)?;
    TLS_SCRATCH
        .insert(&pid_tgid, unsafe { &*template }, BPF_NOEXIST)
        .ok()?;
    TLS_SCRATCH.get_ptr_mut(&pid_tgid)
}

/// Frames the plaintext one hooked libssl call moved on TLS socket `cookie`: `moved` bytes
/// (≤ 0: none, e.g. SSL_ERROR_WANT_WRITE) at `tc.buf`. Then writes a [`TlsMarkEvent`]: the
/// plaintext up to here is in the TCP stream up to the socket's `write_seq` (send) or
/// `copied_seq` (recv) as its last socket call left it in [`SockState::tcp`].
#[inline(always)]
pub fn on_plaintext(cookie: u64, tc: &TlsCall, moved: i64, pid_tgid: u64) {
    let tgid = (pid_tgid >> 32) as u32;
    let Some(sp) = SOCKETS.get_ptr_mut(&cookie) else {
        if moved > 0 {
            count(counter::TLS_UNMAPPED);
        }
        return;
    };
    let sock = unsafe { &mut *sp };
    if sock.carrier != carrier::TLS {
        return;
    }
    let send = tc.func == tls_func::WRITE || tc.func == tls_func::WRITE_EX;
    let now = unsafe { bpf_ktime_get_ns() };
    let ret = if moved > i32::MAX as i64 {
        i32::MAX
    } else if moved > 0 {
        moved as i32
    } else if send && tc.eagain != 0 {
        // Nothing taken because the socket was full (WANT_WRITE): treated like a send that
        // failed with EAGAIN (spice-server counts the message it tried to start,
        // `docs/spice-protocol.md` §3.2). Any other failure (a dead connection) moved nothing.
        -EAGAIN
    } else {
        return;
    };
    if ret > 0 {
        count(counter::TLS_CALLS);
    }
    let call = Call {
        sk: core::ptr::null(),
        tp: core::ptr::null(),
        cookie,
        dir: if send { dirs::SEND } else { dirs::RECV },
        ret,
        args: CallArgs {
            kind: call_kind::BUFFER,
            watch: tc.watch,
            _pad: [0; 2],
            fd: 0,
            ptr: tc.buf,
            len: tc.num,
        },
    };
    let Some(sc) = tls_scratch(pid_tgid) else {
        // No working space for this thread: the plaintext cannot be framed, so the direction
        // stops rather than lose its place silently.
        count(counter::TLS_PENDING_FULL);
        let st = &mut sock.dir[(call.dir & 1) as usize];
        if !st.is_unparsed() {
            let out = st.stop(UnparsedReason::Internal, 2);
            let hdr = header(kind::MESSAGE, call.dir, cookie, tgid, now);
            emit_stop(&hdr, tc.watch, &out);
        }
        return;
    };
    run_call::<true>(
        sock,
        &call,
        ret,
        tgid,
        now,
        None,
        unsafe { &mut *sc },
        false,
    );
    if ret <= 0 {
        return;
    }
    // No TCP state yet (no socket call of this socket has been seen): no position to give,
    // so no mark (the host then cannot place this plaintext, rather than misplace it).
    if sock.tcp.ts_ns == 0 {
        return;
    }
    let seq = if send {
        sock.tcp.write_seq
    } else {
        sock.tcp.copied_seq
    };
    let plain_end = sock.dir[(call.dir & 1) as usize].pos;
    let mut hdr = header(kind::TLS_MARK, call.dir, cookie, tgid, now);
    hdr.flags = hdr_flags::TLS;
    write_record::<TlsMarkEvent>(tc.watch, |p| unsafe {
        (*p).hdr = hdr;
        (*p).plain_end = plain_end;
        (*p).seq = seq;
        (*p).len = ret as u32;
    });
}

/// Frames one call's bytes on socket state `sock`: the socket's own bytes (`seq_now`: its
/// `write_seq` / `copied_seq` after the call, checked against the bytes traced) or a TLS
/// socket's plaintext (`seq_now` `None`: plaintext has no TCP sequence of its own).
/// `ret` is the call's result (`call.ret`, read by the caller: see [`call_body`]).
/// `PEEK`: a call that moved nothing may be a send refused with EAGAIN ([`peek_eagain`]);
/// false in the instance for calls that moved bytes.
#[inline(always)]
fn run_call<const PEEK: bool>(
    sock: &mut SockState,
    call: &Call,
    ret: i32,
    tgid: u32,
    now: u64,
    seq_now: Option<u32>,
    sc: &mut CallScratch,
    bulk: bool,
) {
    let d = (call.dir & 1) as usize;
    sc.peer = sock.dir[d ^ 1].view();
    let sockp = sock as *mut SockState;
    let st = &mut sock.dir[d];
    let mut hdr = header(kind::MESSAGE, call.dir, call.cookie, tgid, now);
    if seq_now.is_none() {
        hdr.flags = hdr_flags::TLS;
    }

    if ret <= 0 {
        if PEEK && call.args.kind != call_kind::UNSUPPORTED {
            let base = if sock.seq_init[d] != 0 {
                sock.seq_base[d]
            } else {
                0
            };
            sc.ec = EmitCtx {
                hdr,
                seq_base: base,
                route: call.args.watch,
            };
            // The message is emitted here, not inside: the two frames are never on the stack
            // at once (see CallScratch).
            if peek_eagain(st, call, sc) != 0 {
                // SAFETY: peek_eagain stored a MessageInfo there (smaller than an Output).
                let m = unsafe { &*(sc.out.as_ptr() as *const MessageInfo) };
                let meta = message_meta(
                    msg_flags::EAGAIN_START,
                    st.role,
                    message_channel_type(st, &sc.peer),
                );
                emit_message(&sc.ec, sockp, m, meta);
            }
        }
        return;
    }
    let moved = ret as u64;
    let call_start = st.pos;
    let call_end = call_start + moved;

    if let Some(seq_now) = seq_now {
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
                emit_stop(&hdr, call.args.watch, &out);
            }
        }
    }

    if call.args.kind == call_kind::UNSUPPORTED && !st.is_unparsed() {
        count(counter::UNTRACED_BYTES);
        let out = st.stop(UnparsedReason::UntracedBytes, ret as u32);
        emit_stop(&hdr, call.args.watch, &out);
    }
    if st.phase == Phase::Hunt as u8 {
        offer_call_start(st, call, call_start, moved);
    }
    if !st.is_unparsed() {
        let candidates = st.candidates;
        sc.ec = EmitCtx {
            hdr,
            seq_base: sock.seq_base[d],
            route: call.args.watch,
        };
        sc.span = Span {
            start: call_start,
            end: call_end,
        };
        if first_message(st, call, sc, moved) {
            // SAFETY: first_message stored a MessageInfo there (smaller than an Output).
            let m = unsafe { &*(sc.out.as_ptr() as *const MessageInfo) };
            let flags = if sc.peer.mid_message {
                msg_flags::PEER_MID_MESSAGE
            } else {
                0
            };
            let meta = message_meta(flags, st.role, message_channel_type(st, &sc.peer));
            emit_message(&sc.ec, sockp, m, meta);
        }
        // The element loop only when an element begins or continues in this call: most
        // calls end with the message the fast path framed, or carry only body bytes.
        if !st.is_unparsed() && st.need().0 < call_end {
            frame(st, call, sc, sockp, bulk);
        }
        if st.candidates != candidates {
            count(counter::HUNT_CANDIDATES);
        }
    }
    st.pos = call_end;
}

/// Most iovecs [`asked_bytes`] adds up (spice-server's messages have a few: header and fixed
/// fields, then bulk chunks of ≤ 64 KiB, `docs/spice-protocol.md` §4.1).
const ASKED_IOVECS: u64 = 8;

/// Bytes the call asked to move: the buffer length, or the sum of up to [`ASKED_IOVECS`]
/// iovec lengths; `u64::MAX` if unknown (more iovecs, or unreadable).
#[inline(never)]
fn asked_bytes(call: &Call) -> u64 {
    if call.args.kind == call_kind::BUFFER {
        return call.args.len;
    }
    if call.args.kind != call_kind::IOVEC || call.args.len > ASKED_IOVECS {
        return u64::MAX;
    }
    let mut total = 0u64;
    for i in 0..ASKED_IOVECS {
        if i >= call.args.len {
            break;
        }
        let mut iov = MaybeUninit::uninit();
        let iov: &mut [u64; 2] = zero_words(&mut iov);
        let src = (call.args.ptr + i * 16) as *const c_void;
        if unsafe { bpf_probe_read_user(iov.as_mut_ptr() as *mut c_void, 16, src) } != 0 {
            return u64::MAX;
        }
        total = total.wrapping_add(iov[1]);
    }
    total
}

/// A hunting direction's call starts at stream offset `at` and moved `moved` bytes: offers
/// its first byte as a candidate header ([`DirState::hunt_call_start`]), anchored by the peer's
/// call pattern where it has one (`docs/spice-protocol.md` §4.2, §4.6, §4.7):
/// * a send after a writev (or sendmsg) that moved everything it asked: spice-server writes
///   one message per writev, so it starts a message. Only vectored calls count: relays
///   (socat, haproxy) forward arbitrary chunks with write / send, each complete, and an anchor
///   at each of their call starts would cut every chain of a message longer than one call;
/// * a receive that asked for exactly 6 or 18 bytes and got them: spice-server reading a
///   data header;
/// * anything else (a relay's reads and writes): content alone.
#[inline(never)]
fn offer_call_start(st: &mut DirState, call: &Call, at: u64, moved: u64) {
    if call.dir == dirs::SEND {
        let anchor = if st.call_complete != 0 {
            lock_how::SEND_AFTER_COMPLETE
        } else {
            lock_how::CONTENT
        };
        st.hunt_call_start(at, anchor, 0);
        st.call_complete = (call.args.kind == call_kind::IOVEC && asked_bytes(call) == moved) as u8;
        return;
    }
    let asked = asked_bytes(call);
    if (asked == 6 || asked == 18) && moved == asked {
        st.hunt_call_start(at, lock_how::RECV_HEADER_READ, asked as u8);
    } else {
        st.hunt_call_start(at, lock_how::CONTENT, 0);
    }
}

/// What writing a record needs besides the output and the socket: the record header (its
/// `dir` is the direction framed), the direction's TCP sequence number of stream offset 0,
/// and the rings. Kept in [`CallScratch`]; the socket's window, lock and byte totals are
/// reached through its `SOCKETS` value, passed beside it.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct EmitCtx {
    hdr: EventHeader,
    seq_base: u32,
    /// The rings the records go to ([`CallArgs::watch`]).
    route: u8,
}

/// Stream offsets `[start, end)` of the bytes one call moved.
struct Span {
    start: u64,
    end: u64,
}

/// Runs the framing loop over one call's bytes; `bulk` as [`step`]'s `BULK`.
#[inline(always)]
fn frame(st: &mut DirState, call: &Call, sc: &mut CallScratch, sock: *mut SockState, bulk: bool) {
    let (call_start, call_end) = (sc.span.start, sc.span.end);
    let (iov_ptr, iov_cnt, cur_base, cur_len) = if call.args.kind == call_kind::IOVEC {
        let mut iov = MaybeUninit::uninit();
        let iov: &mut [u64; 2] = zero_words(&mut iov);
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
            emit_stop(&sc.ec.hdr, sc.ec.route, &out);
            return;
        }
        (call.args.ptr, call.args.len, iov[0], iov[1])
    } else {
        (0, 1, call.args.ptr, call.args.len)
    };
    sc.lp = LoopCtx {
        call_start,
        call_end,
        iov_ptr,
        iov_cnt,
        cur_iov: 0,
        cur_start: call_start,
        cur_base,
        cur_len,
    };
    if bulk {
        if let Some(w) = READ_WINDOW.get_ptr_mut(0) {
            // Empty: the window holds bytes of this call only.
            unsafe { (*w).len = 0 };
        }
    }
    let mut refs = LoopRefs {
        sc: sc as *mut CallScratch,
        sock,
        st: st as *mut DirState,
    };
    let steps = unsafe {
        bpf_loop(
            MAX_STEPS_PER_CALL,
            if bulk {
                step::<true> as *mut c_void
            } else {
                step::<false> as *mut c_void
            },
            &mut refs as *mut LoopRefs as *mut c_void,
            0,
        )
    };
    if steps as u32 >= MAX_STEPS_PER_CALL && !st.is_unparsed() {
        let (at, _) = st.need();
        if at < call_end {
            count(counter::LOOP_LIMIT);
            let out = st.stop(UnparsedReason::LoopLimit, 0);
            emit_stop(&sc.ec.hdr, sc.ec.route, &out);
        }
    }
}

/// The fast path of a call that moved `moved` bytes starting at a message boundary
/// ([`DirState::header_at_call_start`]): reads the header from the first buffer (or iovec)
/// into a stack buffer with one read (all of a mini header, the first [`HEADER_BUF_LEN`]
/// bytes of a full one) and, if the state accepts it, leaves the
/// message in [`CallScratch::out`] for the caller to report, and returns true. False, with
/// nothing changed, when the call does not begin with a whole header of a plain data
/// message; the element loop ([`frame`]) then reads it, as it reads any later element of the
/// call. A read that faults here is left to the loop too, which stops the direction with the
/// fault's reason.
///
/// Cheaper than the loop's first step: no `bpf_loop` set-up and callback calls, and no call
/// of [`complete`]. Like the loop's whole-header reads, the header lands in a stack buffer
/// (see [`HEADER_BUF_LEN`]).
///
/// A function of its own: inlined, it grew the libssl return's frame past the 512-byte chain
/// limit (see [`CallScratch`]); inlined into the socket tracepoints only (their frames have
/// room), it made no difference measurable with bpf_stats (559-597 ns per send call against
/// 568-590, alternating builds).
#[inline(never)]
fn first_message(st: &mut DirState, call: &Call, sc: &mut CallScratch, moved: u64) -> bool {
    let hl = st.hdr_len as u64;
    if st.phase != Phase::DataHeader as u8
        || st.have != 0
        || st.want_at != st.pos
        || hl == 0
        || moved < hl
    {
        return false;
    }
    // The first iovec, then the header, on the stack (see [`HEADER_BUF_LEN`]).
    let mut words = MaybeUninit::uninit();
    let words: &mut [u64; HEADER_WORDS] = zero_words(&mut words);
    let (base, len) = if call.args.kind == call_kind::BUFFER {
        (call.args.ptr, call.args.len)
    } else if call.args.kind == call_kind::IOVEC && call.args.len > 0 {
        let rc = unsafe {
            bpf_probe_read_user(
                words.as_mut_ptr() as *mut c_void,
                16,
                call.args.ptr as *const c_void,
            )
        };
        if rc != 0 {
            return false;
        }
        (words[0], words[1])
    } else {
        return false;
    };
    if len < hl {
        return false;
    }
    if header_alone(base, hl, words.as_mut_ptr()) != 0 {
        return false;
    }
    match st.header_at_call_start(header_bytes(words)) {
        Some(m) => {
            store_words(&m, sc.out.as_mut_ptr());
            true
        }
        None => false,
    }
}

/// A send that moved nothing (EAGAIN) at a message boundary: spice-server has counted the
/// message already, and its header is in the rejected buffer. Returns 1 with the message in
/// `out` ([`CallScratch::out`]) for the caller to report now, once, and apply to the window
/// now (the later write that carries it finds it `already_reported`); 0 if there is none.
/// Reads the buffer's first bytes into [`CallScratch::peek`].
#[inline(never)]
fn peek_eagain(st: &mut DirState, call: &Call, sc: &mut CallScratch) -> i32 {
    let peer = &sc.peer;
    let _ = st.prepare(peer);
    if st.is_unparsed() {
        return 0;
    }
    let (base, len) = if call.args.kind == call_kind::IOVEC {
        // The first iovec goes through the scratch buffer, not a stack array: this frame is on
        // `spice_ssl_ret`'s deepest chain, already at the 512-byte limit (EAGAIN sends are
        // rare, so the heap-checked read costs little here).
        let rc = unsafe {
            bpf_probe_read_user(
                sc.peek.as_mut_ptr() as *mut c_void,
                16,
                call.args.ptr as *const c_void,
            )
        };
        if rc != 0 {
            return 0;
        }
        let iov = sc.peek.as_ptr() as *const u64;
        // SAFETY: the 16 bytes just read.
        unsafe { (iov.read_unaligned(), iov.add(1).read_unaligned()) }
    } else {
        (call.args.ptr, call.args.len)
    };
    if len < MAX_WANT as u64 && len < st.want_len as u64 {
        return 0;
    }
    let avail = if len < MAX_WANT as u64 {
        len as u32
    } else {
        MAX_WANT
    };
    let rc = unsafe {
        bpf_probe_read_user(
            sc.peek.as_mut_ptr() as *mut c_void,
            avail & 31,
            base as *const c_void,
        )
    };
    if rc != 0 {
        return 0;
    }
    match st.peek_in(&mut sc.trial, &sc.peek, avail, peer) {
        Some(m) => {
            store_words(&m, sc.out.as_mut_ptr());
            1
        }
        None => 0,
    }
}
