//! Configuration the agent passes to the kernel programs at load time, and the kernel's
//! loss and self counters.
//!
//! Rust eBPF programs get no CO-RE relocations, so the agent looks up the kernel struct
//! offsets the programs need in the running kernel's BTF (`/sys/kernel/btf/vmlinux`) and
//! writes them into the global [`KernelConfig`] before loading.

/// Offsets (bytes from the start of the named struct) and settings for the kernel programs.
/// A zero offset for a field that cannot be at offset 0 means "not found": the agent refuses
/// to start in that case, so the programs can trust every value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelConfig {
    /// The observer's own tgid: never traced.
    pub self_tgid: u32,
    /// Bytes of records one CPU submits to a ring between two wake-ups it forces
    /// ([`ring::wakeup_bytes_per_cpu`] of the machine's possible CPUs).
    pub ring_wakeup_bytes: u32,
    /// `struct sock`: `__sk_common.skc_family` (u16).
    pub skc_family: u32,
    /// `struct sock`: `__sk_common.skc_num` (u16, local port, host order).
    pub skc_num: u32,
    /// `struct sock`: `__sk_common.skc_dport` (u16, remote port, network order).
    pub skc_dport: u32,
    /// `struct sock`: `__sk_common.skc_rcv_saddr` (IPv4 local).
    pub skc_rcv_saddr: u32,
    /// `struct sock`: `__sk_common.skc_daddr` (IPv4 remote).
    pub skc_daddr: u32,
    /// `struct sock`: `__sk_common.skc_v6_rcv_saddr` (IPv6 local).
    pub skc_v6_rcv_saddr: u32,
    /// `struct sock`: `__sk_common.skc_v6_daddr` (IPv6 remote).
    pub skc_v6_daddr: u32,
    /// `struct sock`: `sk_protocol` (u16 since Linux 5.6).
    pub sk_protocol: u32,
    /// `struct sock`: `sk_type` (u16).
    pub sk_type: u32,
    /// `struct tcp_sock` members (u32 each).
    pub tcp_write_seq: u32,
    pub tcp_snd_nxt: u32,
    pub tcp_snd_una: u32,
    pub tcp_rcv_nxt: u32,
    pub tcp_copied_seq: u32,
    pub tcp_snd_cwnd: u32,
    pub tcp_srtt_us: u32,
    pub tcp_packets_out: u32,
    pub tcp_total_retrans: u32,
    /// `struct task_struct`: `pid` and `tgid` (i32 each).
    pub task_pid: u32,
    pub task_tgid: u32,
    /// `struct sock`: `sk_socket` (`struct socket *`), and `struct socket`: `file`
    /// (`struct file *`): a socket the kernel made for itself (`sock_create_kern`: NFS, CIFS,
    /// iSCSI, ...) has no file, and its calls are not the calling syscall's.
    pub sk_socket: u32,
    pub socket_file: u32,
    /// Which hook set the programs were loaded for ([`hook_set`]): what the shared programs
    /// (`inet_sock_set_state`) do differs between them.
    pub hook_set: u32,
    /// `struct sock`: `__sk_common.skc_cookie` (atomic64_t): the socket cookie, 0 until the
    /// kernel first hands it out (`sock_gen_cookie`, net/core/sock_diag.c). Hook set
    /// `syscalls` reads it there, having no BTF-typed socket to give `bpf_get_socket_cookie`.
    pub skc_cookie: u32,
    /// The chain from a task to the socket of one of its file descriptors, for hook set
    /// `syscalls` (include/linux/sched.h, fdtable.h, fs.h, net.h): `task_struct.files`
    /// (`struct files_struct *`), `files_struct.fdt` (`struct fdtable *`),
    /// `fdtable.max_fds` (u32) and `fdtable.fd` (`struct file **`), `file.private_data`
    /// (a socket file's `struct socket *`), `socket.sk` (`struct sock *`).
    pub task_files: u32,
    pub files_fdt: u32,
    pub fdtable_max_fds: u32,
    pub fdtable_fd: u32,
    pub file_private_data: u32,
    pub socket_sk: u32,
    /// Parameters of `tcp_recvmsg` in the kernel's BTF, for hook sets `fentry` and
    /// `kprobes`: 6 before Linux 5.19 (`sk, msg, len, nonblock, flags, addr_len`), 5 since
    /// ("net: remove noblock parameter from recvmsg() entities": `sk, msg, len, flags,
    /// addr_len`), 4 on later kernels without `addr_len` (this machine's 6.18: `sk, msg,
    /// len, flags`). `flags` is the fifth with 6, else the fourth; an fexit's return value
    /// follows the last.
    pub tcp_recvmsg_args: u32,
}

/// Values of [`KernelConfig::hook_set`].
pub mod hook_set {
    /// `tp_btf/sock_send_length` and `sock_recv_length` (Linux 6.3+).
    pub const TRACEPOINTS: u32 = 0;
    /// `raw_tracepoint/sys_exit` (Linux 4.17+): the socket from the syscall's file
    /// descriptor, the byte count from its return value.
    pub const SYSCALLS: u32 = 1;
    /// `fexit/tcp_sendmsg` and `fexit/tcp_recvmsg` (BPF trampolines, Linux 5.5+).
    pub const FENTRY: u32 = 2;
    /// kprobe + kretprobe on `tcp_sendmsg` and `tcp_recvmsg`.
    pub const KPROBES: u32 = 3;
}

/// Version of everything a restarted agent reuses from pinned kernel state: the layouts of
/// the pinned maps' keys and values ([`crate::event::SockState`], [`crate::event::TcpSnapshot`],
/// ...), of the ring records and of [`KernelConfig`], and the meaning of their fields. Bump it
/// with any such change: a new agent that finds another version pinned reloads the programs
/// and marks the open channels `restarted` instead of misreading the old state.
pub const LAYOUT_VERSION: u32 = 12;

/// Ring-buffer wake-ups. A record submitted without flags wakes the agent (an `irq_work`,
/// i.e. a self-IPI, then an epoll wake-up) whenever the agent has caught up with the ring,
/// which on a busy stream is nearly every record; that wake-up cost more than everything
/// else a send call does (measured on a 2-CPU VM, kernel 6.18, spice-peer streaming 200 k
/// messages of 200 B: `perf record -a -g` put 83 % of `spice_sock_send`'s samples under
/// `bpf_ringbuf_submit` → `irq_work_queue` → `native_write_msr`, the self-IPI; bpf_stats
/// went from 5.1–8.1 µs to 1.2 µs per run without it). So the programs submit with
/// `BPF_RB_NO_WAKEUP` and force a wake-up each time one CPU has submitted
/// [`KernelConfig::ring_wakeup_bytes`] to a ring since its last forced one (a per-CPU count,
/// `RING_PENDING`, read and written with plain loads and stores: no helper call, where asking
/// the ring for its unread bytes, `bpf_ringbuf_query`, cost one per record), and the agent
/// also drains the rings every [`ring::DRAIN_INTERVAL_MS`]: no record waits longer than that.
pub mod ring {
    /// Unread bytes in a ring by which a wake-up is due, all CPUs together: with the 4 MiB
    /// `EVENTS` and `TAP_EVENTS` rings, one sixteenth of one (≈ 3,300 message records).
    /// Each CPU forces a wake-up after its share ([`wakeup_bytes_per_cpu`]), so that even
    /// with every CPU submitting at once at most this much is unread before one comes.
    pub const WAKEUP_BYTES: u64 = 256 << 10;
    /// Smallest per-CPU share of [`WAKEUP_BYTES`]: on a machine with many CPUs, a wake-up at
    /// most every ~180 message records per CPU.
    pub const MIN_WAKEUP_BYTES_PER_CPU: u64 = 16 << 10;
    /// [`KernelConfig::ring_wakeup_bytes`] on a machine with `possible_cpus` CPUs:
    /// [`WAKEUP_BYTES`] shared among them, at least [`MIN_WAKEUP_BYTES_PER_CPU`].
    pub const fn wakeup_bytes_per_cpu(possible_cpus: u32) -> u32 {
        let cpus = if possible_cpus == 0 {
            1
        } else {
            possible_cpus as u64
        };
        let share = WAKEUP_BYTES / cpus;
        if share < MIN_WAKEUP_BYTES_PER_CPU {
            MIN_WAKEUP_BYTES_PER_CPU as u32
        } else {
            share as u32
        }
    }
    /// Longest time, milliseconds, between two drains of the ring by the agent when no
    /// wake-up came: the latency bound of a record. The default sample period (100 ms):
    /// every sample drains the ring before and after its reads anyway, and each drain that
    /// no record asked for is a wake-up of the agent (measured on the 2-CPU VM of the rig,
    /// 10 sessions × 900 messages/s: 10 ms cost the agent 1.1 % of a core at 115 wake-ups/s,
    /// 100 ms 0.46 % at 27/s; `rig/agent-cost.sh`). At 6,350 messages/s (10 sessions × 635)
    /// 100 ms leave about 50 KiB in the ring; faster streams wake the agent every
    /// [`WAKEUP_BYTES`] before that.
    pub const DRAIN_INTERVAL_MS: u64 = 100;
    /// Bytes a record of `len` bytes takes in a ring: its 8-byte header plus the record,
    /// rounded up to 8 (kernel/bpf/ringbuf.c `BPF_RINGBUF_HDR_SZ`, `round_up(len + hdr, 8)`).
    pub const fn slot_len(len: usize) -> u64 {
        (len as u64 + 8).div_ceil(8) * 8
    }
    /// Flags for submitting a record whose slot takes `slot` bytes on a CPU that has
    /// submitted `pending` bytes to the ring since its last forced wake-up, with its share
    /// `every` ([`KernelConfig::ring_wakeup_bytes`]), and the new `pending`:
    /// `BPF_RB_FORCE_WAKEUP` (2) and 0 once the share is reached, else `BPF_RB_NO_WAKEUP` (1)
    /// (include/uapi/linux/bpf.h).
    #[inline(always)]
    pub const fn submit_flags(pending: u64, slot: u64, every: u64) -> (u64, u64) {
        let next = pending + slot;
        if next >= every { (2, 0) } else { (1, next) }
    }
}

/// Values of the `WATCHED_TGIDS` map (key: tgid): the pid the watch descends from (the one
/// given to `--pid` or found by discovery; forked children inherit it) in the low bits, and
/// who wants the process's records in the high bits. pid_max is at most 2^22
/// (`PID_MAX_LIMIT`, include/linux/threads.h), so the flags never meet a pid.
pub mod watch {
    /// Records go to the `EVENTS` ring: the process is watched by the ring's one consumer
    /// (the daemon, or a standalone `observe` with its own programs).
    pub const PRIMARY: u32 = 1 << 31;
    /// Records go (also) to the `TAP_EVENTS` ring: an `observe` beside a daemon reads the
    /// process through the daemon's pinned programs.
    pub const TAP: u32 = 1 << 30;
    /// Both flags.
    pub const FLAGS: u32 = PRIMARY | TAP;
    /// The root pid of a value.
    pub const ROOT_MASK: u32 = !FLAGS;
    /// The flags of a value as a byte ([`crate::event::CallArgs::watch`],
    /// [`crate::event::SockState::watch`]): [`ROUTE_PRIMARY`] for [`PRIMARY`], [`ROUTE_TAP`]
    /// for [`TAP`].
    #[inline(always)]
    pub const fn route(value: u32) -> u8 {
        (value >> 30) as u8
    }
    /// [`route`] bit: records to `EVENTS`.
    pub const ROUTE_PRIMARY: u8 = 2;
    /// [`route`] bit: records to `TAP_EVENTS`.
    pub const ROUTE_TAP: u8 = 1;

    /// Entries of the kernel's `MAYBE_WATCHED` array, the filter in front of `WATCHED_TGIDS`
    /// (a power of two). Entry [`filter_index`]`(tgid)` is set to 1 before any process with
    /// that index is added to `WATCHED_TGIDS` (by an agent, or by the fork hook for a child)
    /// and is never cleared: 0 means no such process is or was watched, decided by one array
    /// load instead of a hash lookup. Processes that were watched once keep their entries, so
    /// over a long run more unrelated processes fall through to the hash lookups (they are
    /// then as cheap as without the filter, never treated wrongly). On a host whose
    /// `kernel.pid_max` is at most this, every tgid has an entry of its own.
    pub const FILTER_LEN: u32 = 1 << 16;

    /// The `MAYBE_WATCHED` entry of process `tgid`.
    #[inline(always)]
    pub const fn filter_index(tgid: u32) -> u32 {
        tgid & (FILTER_LEN - 1)
    }
}

/// Values of the `PREEXISTING` map (key: socket cookie): a connection that was open before
/// observation started, so its framing begins by hunting for message boundaries
/// ([`crate::framing::Phase::Hunt`]). The value tells which SPICE role each direction has,
/// from how the socket came to be: SPICE clients always connect and servers always accept
/// (`docs/spice-protocol.md` §1.1), relays included (a relay accepts the client and connects
/// to the server), so an accepted socket sends server → client bytes.
pub mod preexisting {
    /// Role not known: hunting validates types of both directions' sets.
    pub const UNKNOWN: u8 = 1;
    /// Accepted from a listener (its local port is a listening port): sends are
    /// server → client, receives client → server.
    pub const ACCEPTED: u8 = 2;
    /// Connected by the process: sends are client → server, receives server → client.
    pub const CONNECTED: u8 = 3;
}

/// Indexes into the `LAYOUT` array map, which records what a pinned set of maps holds.
pub mod layout {
    /// [`super::LAYOUT_VERSION`] of the agent that loaded the programs.
    pub const VERSION: u32 = 0;
    /// `size_of::<SockState>()` (map `SOCKETS` values).
    pub const SOCK_STATE_SIZE: u32 = 1;
    /// `size_of::<TcpSnapshot>()` (inside `SOCKETS` values, and in `CLOSE` records).
    pub const TCP_SNAPSHOT_SIZE: u32 = 2;
    /// `size_of::<MessageEvent>()` (ring records).
    pub const MESSAGE_EVENT_SIZE: u32 = 3;
    /// Bit 0: the sock_ops program was attached (its pinned link belongs to the set); bit 1:
    /// the socket calls are hooked by hook set `syscalls` (`spice_sys_exit`), not by the
    /// socket tracepoints; bit 2: by hook set `fentry` (`spice_fexit_send`, `spice_fexit_recv`);
    /// bit 3: by hook set `kprobes` (`spice_kprobe_*`, `spice_kretprobe_*`).
    pub const HOOKS: u32 = 4;
    /// Number of entries.
    pub const COUNT: u32 = 5;
    /// [`HOOKS`] bit: sock_ops attached.
    pub const HOOK_SOCKOPS: u32 = 1;
    /// [`HOOKS`] bit: hook set `syscalls`.
    pub const HOOK_SYSCALLS: u32 = 2;
    /// [`HOOKS`] bit: hook set `fentry`.
    pub const HOOK_FENTRY: u32 = 4;
    /// [`HOOKS`] bit: hook set `kprobes`.
    pub const HOOK_KPROBES: u32 = 8;
}

/// Indexes into the per-CPU counter array `COUNTERS`.
pub mod counter {
    /// A ring-buffer record could not be reserved (ring full).
    pub const RING_FULL: u32 = 0;
    /// A new socket could not be added to `SOCKETS` (map full).
    pub const SOCKET_MAP_FULL: u32 = 1;
    /// `bpf_probe_read_user` failed on a user buffer or iovec.
    pub const USER_READ_FAULT: u32 = 2;
    /// Bytes moved on a tracked socket by a call the hooks could not read.
    pub const UNTRACED_BYTES: u32 = 3;
    /// A call held more boundaries than the kernel loop allows.
    pub const LOOP_LIMIT: u32 = 4;
    /// Retired, always 0: counted a full `TCP_STATE` map until layout 10, when a socket's
    /// TCP state moved into its `SOCKETS` entry ([`SOCKET_MAP_FULL`] counts that map full).
    /// Kept so that the other counters keep their indexes and names.
    pub const TCP_MAP_FULL: u32 = 5;
    /// A forked child could not be added to `WATCHED_TGIDS` (map full).
    pub const WATCH_MAP_FULL: u32 = 6;
    /// Socket calls traced (self metric, not a loss).
    pub const CALLS_TRACED: u32 = 7;
    /// Messages framed (self metric, not a loss).
    pub const MESSAGES_FRAMED: u32 = 8;
    /// sockops callbacks handled for enrolled sockets (self metric).
    pub const SOCKOPS_UPDATES: u32 = 9;
    /// A `TAP_EVENTS` record could not be reserved (that ring full): information lost for an
    /// `observe` beside the daemon, not for the daemon (not in [`is_loss`]; see [`is_tap_loss`]).
    pub const TAP_RING_FULL: u32 = 10;
    /// Hunting candidates tried: a header validated at a call start of a direction that has
    /// lost (or never had) its message boundaries (self metric, not a loss).
    pub const HUNT_CANDIDATES: u32 = 11;
    /// Locks: a hunting direction found its message boundaries again (self metric).
    pub const LOCKS: u32 = 12;
    /// Resyncs: a framed direction met a header that failed validation and went back to
    /// hunting (the bytes until the next lock are not framed; see `DirState::unframed`).
    pub const RESYNCS: u32 = 13;
    /// Plaintext calls framed at the libssl hooks (SSL_write / SSL_read and their _ex forms
    /// that moved bytes on a TLS socket; self metric, not a loss).
    pub const TLS_CALLS: u32 = 14;
    /// A libssl call moved plaintext, but no socket call was ever seen inside a call on the
    /// same `SSL *` (a memory BIO, or the mapping was evicted): its plaintext is not framed.
    pub const TLS_UNMAPPED: u32 = 15;
    /// A libssl call's arguments could not be saved in `TLS_CALLS` (map full).
    pub const TLS_PENDING_FULL: u32 = 16;
    /// A TLS socket moved bytes outside every hooked libssl function (the hooks were
    /// detached, e.g. between two agents without pinned links): the plaintext of that
    /// direction may have moved unseen, so it goes back to hunting (a resync). A loss, like
    /// [`UNTRACED_BYTES`] on a plain socket.
    pub const TLS_UNSEEN: u32 = 17;
    /// A message was applied to a socket's window without its lock: another CPU held it
    /// through every try (`config::WINDOW_LOCK_TRIES`), so a concurrent update of the other
    /// direction may have been lost. A loss.
    pub const WINDOW_LOCK_BUSY: u32 = 18;
    /// Hook set `syscalls`: a call moved bytes on a TCP socket the kernel had not given a
    /// cookie yet ([`super::KernelConfig::skc_cookie`] 0), so it could not be keyed: its
    /// bytes are not framed (that direction resyncs at its next call). Cookies are given to
    /// every connection established while the programs run (`inet_sock_set_state`) and to
    /// the sockets the agent's sock_diag dump finds at a watch. A loss.
    pub const NO_COOKIE: u32 = 19;
    /// Number of counters.
    pub const COUNT: u32 = 20;

    /// Names used in reports and JSON (`kernel_counters`), by index.
    pub const NAMES: [&str; COUNT as usize] = [
        "ring_full",
        "socket_map_full",
        "user_read_fault",
        "untraced_bytes",
        "loop_limit",
        "tcp_map_full",
        "watch_map_full",
        "calls_traced",
        "messages_framed",
        "sockops_updates",
        "tap_ring_full",
        "hunt_candidates",
        "locks",
        "resyncs",
        "tls_calls",
        "tls_unmapped",
        "tls_pending_full",
        "tls_unseen",
        "window_lock_busy",
        "no_cookie",
    ];

    /// True for counters that mean information was lost (they add up to `events_lost`).
    pub const fn is_loss(index: u32) -> bool {
        index <= WATCH_MAP_FULL
            || index == TLS_UNMAPPED
            || index == TLS_PENDING_FULL
            || index == TLS_UNSEEN
            || index == WINDOW_LOCK_BUSY
            || index == NO_COOKIE
    }

    /// True for counters that mean information was lost for a reader of `TAP_EVENTS`: the
    /// daemon's losses except its own ring's ([`RING_FULL`]), plus [`TAP_RING_FULL`].
    pub const fn is_tap_loss(index: u32) -> bool {
        (is_loss(index) && index != RING_FULL) || index == TAP_RING_FULL
    }
}

/// How often a call tries to take a socket's window lock (`SockState::window_lock`) before it
/// applies its message without it ([`counter::WINDOW_LOCK_BUSY`]). The lock is held for the
/// window rule's arithmetic only (tens of nanoseconds), but an interrupt and the softirq
/// work after it (loopback TCP receives, for one) can hold up its holder for tens of
/// microseconds; 16 tries lost 4-24 updates in 900 k messages with perf sampling the machine.
/// A try takes a few nanoseconds, so this bounds a wait at about a millisecond.
pub const WINDOW_LOCK_TRIES: u32 = 1 << 18;

/// Most boundaries (plus iovec steps) one socket call may hold before the direction is marked
/// [`crate::framing::UnparsedReason::LoopLimit`]. A 16 KiB relay buffer of 6-byte ACKs holds
/// 2,731; the kernel's `bpf_loop` allows up to 8 million.
pub const MAX_STEPS_PER_CALL: u32 = 16384;

/// Longest time, nanoseconds, between two reads of a socket's transport members of
/// `TcpSnapshot` (snd_nxt, snd_una, rcv_nxt, cwnd, srtt, packets_out, total_retrans) by
/// its socket calls: a call reads them only if the snapshot is older (`ts_ns`). write_seq and
/// copied_seq are read at every call of their direction. The agent's samples take the
/// queues from sock_diag, not from these members; they feed the report's `kernel_hooks`
/// TCP state, which is then at most this old at the socket's last call.
pub const TCP_REFRESH_NS: u64 = 1_000_000;

#[cfg(feature = "user")]
// SAFETY: plain `repr(C)` integers.
unsafe impl aya::Pod for KernelConfig {}

#[cfg(test)]
mod tests {
    use super::ring::{
        MIN_WAKEUP_BYTES_PER_CPU, WAKEUP_BYTES, slot_len, submit_flags, wakeup_bytes_per_cpu,
    };

    #[test]
    fn ring_slots_and_wakeups() {
        // A 72-byte MessageEvent takes 80 bytes; a 4-byte record 16.
        assert_eq!(slot_len(72), 80);
        assert_eq!(slot_len(4), 16);
        // A CPU's share: the threshold split among the CPUs, with a floor.
        assert_eq!(wakeup_bytes_per_cpu(2) as u64, WAKEUP_BYTES / 2);
        assert_eq!(wakeup_bytes_per_cpu(0) as u64, WAKEUP_BYTES);
        assert_eq!(wakeup_bytes_per_cpu(1024) as u64, MIN_WAKEUP_BYTES_PER_CPU);
        // No wake-up below the share; one (and the count back to 0) when a record reaches
        // it; none right after.
        let every = 1000;
        assert_eq!(submit_flags(0, 80, every), (1, 80));
        assert_eq!(submit_flags(880, 80, every), (1, 960));
        assert_eq!(submit_flags(960, 80, every), (2, 0));
        assert_eq!(submit_flags(0, 80, every), (1, 80));
        // Every record forces one when no share was set (a config of 0).
        assert_eq!(submit_flags(0, 80, 0), (2, 0));
        // Over a stream of records, one forced wake-up per share's worth of bytes.
        let (mut pending, mut wakeups) = (0, 0);
        for _ in 0..10_000 {
            let (f, next) = submit_flags(pending, 80, every);
            pending = next;
            wakeups += (f == 2) as u32;
        }
        assert_eq!(wakeups, 10_000 * 80 / 1040);
    }
}
