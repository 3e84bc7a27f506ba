//! TCP socket snapshots over netlink `sock_diag`, and the `/proc` helpers that tie sockets to
//! processes.
//!
//! * [`dump_tcp`] asks the kernel (`NETLINK_SOCK_DIAG`, `SOCK_DIAG_BY_FAMILY`, see
//!   `include/uapi/linux/sock_diag.h` and `include/uapi/linux/inet_diag.h`) for every TCP socket
//!   of the current network namespace, once for `AF_INET` and once for `AF_INET6`, with the
//!   `INET_DIAG_INFO` extension (a `struct tcp_info`, `include/uapi/linux/tcp.h`). It gives the
//!   observer a state for sockets that no eBPF hook has seen yet (for example connections that
//!   were open before the observer started). A dump walks every bucket of the kernel's TCP
//!   hash tables whatever the number of sockets (`inet_diag_dump_icsk`, net/ipv4/inet_diag.c;
//!   the established table has `thash_entries` buckets, 262144 on a host with a few GiB of
//!   RAM, see the `TCP established hash table entries` boot line), about a millisecond of
//!   kernel time: for what runs once (a watch, a restart, a scrape's fallback), not per sample.
//! * [`DiagQuery`] asks for one socket by its addresses and cookie (a hash lookup in the
//!   kernel, a few microseconds): what the periodic samples use, on one netlink socket kept
//!   open.
//! * [`socket_inodes`], [`descendants`] and [`comm`] read `/proc` to find which of those sockets
//!   belong to the watched processes: a socket belongs to a process when its inode
//!   ([`DiagSocket::inode`]) is the target of one of the process's `/proc/PID/fd/N` links
//!   (`socket:[INODE]`).
//!
//! Nothing here needs privileges: sock_diag dumps of TCP sockets, `tcp_info` included, are open
//! to every user (that is how `ss -ti` works unprivileged), and `/proc/PID/fd` of one's own
//! processes is readable. Watching another user's process needs root (or `CAP_SYS_PTRACE`) for
//! its `/proc/PID/fd`.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr, SocketAddrV4, SocketAddrV6};

use anyhow::{Context, bail};
use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload, Nla as _,
};
use netlink_packet_sock_diag::{
    SockDiagMessage,
    constants::{AF_INET, AF_INET6, INET_DIAG_INFO, IPPROTO_TCP},
    inet::{ExtensionFlags, InetRequest, InetResponse, SocketId, StateFlags},
};
use netlink_sys::{Socket, protocols::NETLINK_SOCK_DIAG};

/// One TCP socket from a sock_diag dump: a `struct inet_diag_msg`
/// (`include/uapi/linux/inet_diag.h`) plus its `INET_DIAG_INFO` attribute.
///
/// Addresses are given as the kernel stores them: an `AF_INET6` socket talking to an IPv4 peer
/// shows IPv4-mapped addresses (`::ffff:a.b.c.d`); use [`IpAddr::to_canonical`] to compare
/// them with IPv4 addresses.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DiagSocket {
    /// `idiag_cookie`: the socket cookie (`sock_gen_cookie()`), the same value as eBPF's
    /// `bpf_get_socket_cookie()` and `SO_COOKIE`. The kernel sends it as two host-endian
    /// `u32` halves, low half first (`sock_diag_save_cookie()`, `net/core/sock_diag.c`).
    pub cookie: u64,
    /// `idiag_inode`: the socket's inode number, as in `/proc/PID/fd/N -> socket:[INODE]`.
    /// The wire field is 32 bits wide; socket inodes come from `get_next_ino()` (an
    /// `unsigned int`), so it is the full value. 0 for `TIME_WAIT` and `SYN_RECV` mini-sockets,
    /// which have no inode.
    pub inode: u64,
    /// `idiag_state`: the TCP state (`include/net/tcp_states.h`): 1 = `ESTABLISHED`,
    /// 2 = `SYN_SENT`, 3 = `SYN_RECV`, 4 = `FIN_WAIT1`, 5 = `FIN_WAIT2`, 6 = `TIME_WAIT`,
    /// 7 = `CLOSE`, 8 = `CLOSE_WAIT`, 9 = `LAST_ACK`, 10 = `LISTEN`, 11 = `CLOSING`.
    pub state: u8,
    /// `id.idiag_src` / `id.idiag_sport`: the local address and port. For link-local IPv6
    /// addresses, the scope id is `id.idiag_if` (the bound interface index).
    pub local: SocketAddr,
    /// `id.idiag_dst` / `id.idiag_dport`: the peer address and port (unspecified address and
    /// port 0 for a listening socket).
    pub remote: SocketAddr,
    /// `idiag_rqueue`, from `tcp_diag_get_info()` (`net/ipv4/tcp_diag.c`). For a `LISTEN`
    /// socket: the accept backlog, i.e. connections waiting for `accept()`
    /// (`sk_ack_backlog`). Otherwise: bytes received in order but not yet read by the
    /// application (`rcv_nxt - copied_seq`).
    pub recv_queue: u32,
    /// `idiag_wqueue`, from `tcp_diag_get_info()`. For a `LISTEN` socket: the maximum accept
    /// backlog (`sk_max_ack_backlog`). Otherwise: bytes written by the application and not yet
    /// acknowledged by the peer, sent or not (`write_seq - snd_una`).
    pub send_queue: u32,
    /// `INET_DIAG_INFO` decoded, when the kernel sent it: it does for full sockets (all states
    /// but `TIME_WAIT` and `SYN_RECV` request sockets).
    pub info: Option<TcpInfo>,
    /// More of the same `struct tcp_info` ([`TcpInfoMore`]), for the no-BPF `tcpinfo` mode;
    /// present exactly when [`Self::info`] is. Not serialized (the other reports that carry a
    /// `DiagSocket` stay as they were).
    #[serde(skip)]
    pub more: Option<TcpInfoMore>,
}

/// The `struct tcp_info` fields (`include/uapi/linux/tcp.h`, filled by `tcp_get_info()` in
/// `net/ipv4/tcp.c`) that the observer reports.
///
/// A field lying past the end of the `tcp_info` the running kernel sent (kernels older than
/// the field) reads as 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TcpInfo {
    /// `tcpi_rtt`: smoothed round-trip time, microseconds (`srtt_us >> 3`).
    pub srtt_us: u32,
    /// `tcpi_snd_cwnd`: congestion window, segments.
    pub snd_cwnd: u32,
    /// `tcpi_unacked`: segments in flight (sent, not yet acknowledged), `packets_out`.
    pub unacked: u32,
    /// `tcpi_total_retrans`: segments retransmitted over the socket's lifetime.
    pub total_retrans: u32,
    /// `tcpi_notsent_bytes`: bytes written by the application that TCP has not sent yet
    /// (`write_seq - snd_nxt`), bytes.
    pub notsent_bytes: u32,
    /// `tcpi_bytes_acked`: bytes acknowledged by the peer (RFC 4898
    /// tcpEStatsAppHCThruOctetsAcked). Counts the SYN as one byte on the active side.
    pub bytes_acked: u64,
    /// `tcpi_bytes_received`: bytes received in order (RFC 4898
    /// tcpEStatsAppHCThruOctetsReceived), whether or not the application has read them.
    pub bytes_received: u64,
    /// `tcpi_delivery_rate`: the latest delivery-rate sample, bytes per second (when the
    /// application is the bottleneck, the highest recent sample instead).
    pub delivery_rate: u64,
    /// `tcpi_rwnd_limited`: time the sender was limited by the peer's receive window,
    /// microseconds. Like the two fields below, a `chrono_stat` kept in jiffies
    /// (`tcp_get_info_chrono_stats()`): whole ticks, 1 to 10 ms depending on `CONFIG_HZ`.
    pub rwnd_limited_us: u64,
    /// `tcpi_sndbuf_limited`: time the sender was limited by its send buffer, microseconds
    /// (jiffy granularity).
    pub sndbuf_limited_us: u64,
    /// `tcpi_busy_time`: time with data in flight, microseconds (jiffy granularity: a short
    /// burst can read 0).
    pub busy_time_us: u64,
    /// `tcpi_min_rtt`: minimum RTT seen over the recent window, microseconds (`~0U` when no
    /// sample yet).
    pub min_rtt_us: u32,
}

/// The other `struct tcp_info` fields (`include/uapi/linux/tcp.h`, filled by `tcp_get_info()`
/// in `net/ipv4/tcp.c`) that the no-BPF `tcpinfo` mode reports beside [`TcpInfo`]. As there,
/// a field past the end of what the running kernel sent reads as 0 (the Linux version that
/// added each is given when it is later than 4.9).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TcpInfoMore {
    /// `tcpi_ca_state`: congestion-avoidance state (`enum tcp_ca_state`,
    /// `include/uapi/linux/tcp.h`): 0 = Open, 1 = Disorder, 2 = CWR, 3 = Recovery, 4 = Loss.
    pub ca_state: u8,
    /// `tcpi_retransmits`: retransmission timeouts in a row not yet recovered from
    /// (`icsk_retransmits`); 0 on a healthy connection.
    pub retransmits: u8,
    /// `tcpi_backoff`: exponential backoff of the retransmission timer (`icsk_backoff`).
    pub backoff: u8,
    /// `tcpi_rto`: retransmission timeout, microseconds.
    pub rto_us: u32,
    /// `tcpi_snd_mss`: sender's maximum segment size, bytes (`mss_cache`).
    pub snd_mss: u32,
    /// `tcpi_rcv_mss`: estimate of the peer's segment size, bytes (`rcv_mss`).
    pub rcv_mss: u32,
    /// `tcpi_lost`: segments now considered lost (`lost_out`).
    pub lost: u32,
    /// `tcpi_retrans`: segments retransmitted and not yet acknowledged (`retrans_out`).
    pub retrans: u32,
    /// `tcpi_last_data_sent`: time since the last data segment was sent, milliseconds.
    pub last_data_sent_ms: u32,
    /// `tcpi_last_data_recv`: time since the last data segment was received, milliseconds.
    pub last_data_recv_ms: u32,
    /// `tcpi_rttvar`: round-trip time variation, microseconds (`mdev_us >> 2`).
    pub rttvar_us: u32,
    /// `tcpi_snd_ssthresh`: slow-start threshold, segments (`TCP_INFINITE_SSTHRESH`,
    /// 0x7fffffff, until the first loss).
    pub snd_ssthresh: u32,
    /// `tcpi_pacing_rate`: current pacing rate, bytes per second (`sk_pacing_rate`, Linux
    /// 3.15; `~0` = unlimited).
    pub pacing_rate: u64,
    /// `tcpi_segs_out`: segments sent, retransmissions and pure ACKs included (Linux 4.2).
    pub segs_out: u32,
    /// `tcpi_segs_in`: segments received (Linux 4.2).
    pub segs_in: u32,
    /// `tcpi_data_segs_out`: segments sent carrying data, retransmissions included (4.6).
    pub data_segs_out: u32,
    /// `tcpi_data_segs_in`: segments received carrying data (Linux 4.6).
    pub data_segs_in: u32,
    /// `tcpi_delivered`: segments delivered to the peer, retransmissions included (4.18).
    pub delivered: u32,
    /// `tcpi_bytes_sent`: bytes sent, retransmissions included (RFC 4898
    /// tcpEStatsPerfHCDataOctetsOut, Linux 4.19).
    pub bytes_sent: u64,
    /// `tcpi_bytes_retrans`: bytes retransmitted (RFC 4898 tcpEStatsPerfOctetsRetrans, 4.19).
    pub bytes_retrans: u64,
    /// `tcpi_snd_wnd`: the peer's advertised receive window, bytes (`snd_wnd`, Linux 5.4).
    pub snd_wnd: u32,
}

/// Byte offsets of the fields read from `struct tcp_info` (`include/uapi/linux/tcp.h`; the
/// struct is native-endian and unpacked: eight `__u8` then naturally aligned `__u32`/`__u64`).
/// Checked against `offsetof()` with the Linux 6.1 UAPI header (sizeof = 232), and by the
/// tests below against live byte counts.
mod tcpi_offset {
    pub const UNACKED: usize = 24;
    pub const RTT: usize = 68;
    pub const SND_CWND: usize = 80;
    pub const TOTAL_RETRANS: usize = 100;
    pub const BYTES_ACKED: usize = 120;
    pub const BYTES_RECEIVED: usize = 128;
    pub const NOTSENT_BYTES: usize = 144;
    pub const MIN_RTT: usize = 148;
    pub const DELIVERY_RATE: usize = 160;
    pub const BUSY_TIME: usize = 168;
    pub const RWND_LIMITED: usize = 176;
    pub const SNDBUF_LIMITED: usize = 184;
    // TcpInfoMore's.
    pub const CA_STATE: usize = 1;
    pub const RETRANSMITS: usize = 2;
    pub const BACKOFF: usize = 4;
    pub const RTO: usize = 8;
    pub const SND_MSS: usize = 16;
    pub const RCV_MSS: usize = 20;
    pub const LOST: usize = 32;
    pub const RETRANS: usize = 36;
    pub const LAST_DATA_SENT: usize = 44;
    pub const LAST_DATA_RECV: usize = 52;
    pub const RTTVAR: usize = 72;
    pub const SND_SSTHRESH: usize = 76;
    pub const PACING_RATE: usize = 104;
    pub const SEGS_OUT: usize = 136;
    pub const SEGS_IN: usize = 140;
    pub const DATA_SEGS_IN: usize = 152;
    pub const DATA_SEGS_OUT: usize = 156;
    pub const DELIVERED: usize = 192;
    pub const BYTES_SENT: usize = 200;
    pub const BYTES_RETRANS: usize = 208;
    pub const SND_WND: usize = 228;
}

/// Native-endian readers of a `struct tcp_info` payload; a field past its end reads as 0.
fn tcpi_readers(
    raw: &[u8],
) -> (
    impl Fn(usize) -> u8,
    impl Fn(usize) -> u32,
    impl Fn(usize) -> u64,
) {
    let u8_at = move |off: usize| raw.get(off).copied().unwrap_or(0);
    let u32_at = move |off: usize| {
        raw.get(off..off + 4)
            .map_or(0, |b| u32::from_ne_bytes(b.try_into().unwrap()))
    };
    let u64_at = move |off: usize| {
        raw.get(off..off + 8)
            .map_or(0, |b| u64::from_ne_bytes(b.try_into().unwrap()))
    };
    (u8_at, u32_at, u64_at)
}

impl TcpInfoMore {
    /// Decodes the fields of [`TcpInfoMore`] from an `INET_DIAG_INFO` payload; `None` when
    /// [`TcpInfo::from_bytes`] would give `None`.
    pub fn from_bytes(raw: &[u8]) -> Option<TcpInfoMore> {
        use tcpi_offset::*;
        if raw.len() < TOTAL_RETRANS + 4 {
            return None;
        }
        let (u8_at, u32_at, u64_at) = tcpi_readers(raw);
        Some(TcpInfoMore {
            ca_state: u8_at(CA_STATE),
            retransmits: u8_at(RETRANSMITS),
            backoff: u8_at(BACKOFF),
            rto_us: u32_at(RTO),
            snd_mss: u32_at(SND_MSS),
            rcv_mss: u32_at(RCV_MSS),
            lost: u32_at(LOST),
            retrans: u32_at(RETRANS),
            last_data_sent_ms: u32_at(LAST_DATA_SENT),
            last_data_recv_ms: u32_at(LAST_DATA_RECV),
            rttvar_us: u32_at(RTTVAR),
            snd_ssthresh: u32_at(SND_SSTHRESH),
            pacing_rate: u64_at(PACING_RATE),
            segs_out: u32_at(SEGS_OUT),
            segs_in: u32_at(SEGS_IN),
            data_segs_out: u32_at(DATA_SEGS_OUT),
            data_segs_in: u32_at(DATA_SEGS_IN),
            delivered: u32_at(DELIVERED),
            bytes_sent: u64_at(BYTES_SENT),
            bytes_retrans: u64_at(BYTES_RETRANS),
            snd_wnd: u32_at(SND_WND),
        })
    }
}

impl TcpInfo {
    /// Decodes the payload of an `INET_DIAG_INFO` attribute (a `struct tcp_info` as long as the
    /// running kernel's). Returns `None` when it is too short to hold even the oldest fields
    /// (`tcpi_total_retrans`, Linux 2.6); later fields missing from it read as 0.
    pub fn from_bytes(raw: &[u8]) -> Option<TcpInfo> {
        use tcpi_offset::*;
        if raw.len() < TOTAL_RETRANS + 4 {
            return None;
        }
        let u32_at = |off: usize| {
            raw.get(off..off + 4)
                .map_or(0, |b| u32::from_ne_bytes(b.try_into().unwrap()))
        };
        let u64_at = |off: usize| {
            raw.get(off..off + 8)
                .map_or(0, |b| u64::from_ne_bytes(b.try_into().unwrap()))
        };
        Some(TcpInfo {
            srtt_us: u32_at(RTT),
            snd_cwnd: u32_at(SND_CWND),
            unacked: u32_at(UNACKED),
            total_retrans: u32_at(TOTAL_RETRANS),
            notsent_bytes: u32_at(NOTSENT_BYTES),
            bytes_acked: u64_at(BYTES_ACKED),
            bytes_received: u64_at(BYTES_RECEIVED),
            delivery_rate: u64_at(DELIVERY_RATE),
            rwnd_limited_us: u64_at(RWND_LIMITED),
            sndbuf_limited_us: u64_at(SNDBUF_LIMITED),
            busy_time_us: u64_at(BUSY_TIME),
            min_rtt_us: u32_at(MIN_RTT),
        })
    }
}

/// Receive buffer for the dump. The kernel sizes each dump datagram from the reader's previous
/// `recvmsg()` length, capped at 32 KiB (`netlink_recvmsg()`, `net/netlink/af_netlink.c`), so
/// 64 KiB never truncates; truncation is still detected (`MSG_TRUNC`) and reported.
const RECV_BUF_LEN: usize = 64 * 1024;

/// Dumps all IPv4 and IPv6 TCP sockets of the current network namespace, all states, with
/// `INET_DIAG_INFO`: one `SOCK_DIAG_BY_FAMILY` dump request per address family on one
/// `NETLINK_SOCK_DIAG` socket, each read until its `NLMSG_DONE`.
///
/// The result is a snapshot, not atomic: sockets opened or closed during the dump may or may
/// not appear. An `AF_INET6` socket appears once, in the IPv6 dump, even when it talks IPv4.
///
/// Errors: the netlink socket cannot be opened, bound or written to; the kernel answers with
/// `NLMSG_ERROR` or a negative `NLMSG_DONE` code (e.g. `ENOENT` when the `tcp_diag`/`inet_diag`
/// module is missing); a reply cannot be decoded or was truncated.
pub fn dump_tcp() -> anyhow::Result<Vec<DiagSocket>> {
    let mut socket =
        Socket::new(NETLINK_SOCK_DIAG).context("cannot open a NETLINK_SOCK_DIAG socket")?;
    socket
        .bind_auto()
        .context("cannot bind the NETLINK_SOCK_DIAG socket")?;
    socket
        .connect(&netlink_sys::SocketAddr::new(0, 0))
        .context("cannot connect the NETLINK_SOCK_DIAG socket to the kernel")?;

    let mut sockets = Vec::new();
    let mut buf = Vec::with_capacity(RECV_BUF_LEN);
    for (seq, family) in [(1, AF_INET), (2, AF_INET6)] {
        dump_family(&socket, family, seq, &mut buf, &mut sockets)?;
    }
    Ok(sockets)
}

/// A netlink sock_diag socket kept open for single-socket queries ([`DiagQuery::one`],
/// [`DiagQuery::socket`]).
pub struct DiagQuery {
    socket: Socket,
    buf: Vec<u8>,
    /// [`DiagQuery::sockets`]' answer slots, [`ANSWER_SLOT`] bytes each (grown, never shrunk).
    answers: Vec<u8>,
    seq: u32,
}

impl DiagQuery {
    /// Opens and binds a `NETLINK_SOCK_DIAG` socket. Errors as [`dump_tcp`].
    pub fn new() -> anyhow::Result<Self> {
        let mut socket =
            Socket::new(NETLINK_SOCK_DIAG).context("cannot open a NETLINK_SOCK_DIAG socket")?;
        socket
            .bind_auto()
            .context("cannot bind the NETLINK_SOCK_DIAG socket")?;
        socket
            .connect(&netlink_sys::SocketAddr::new(0, 0))
            .context("cannot connect the NETLINK_SOCK_DIAG socket to the kernel")?;
        set_recv_timeout(&socket, ANSWER_TIMEOUT)?;
        Ok(Self {
            socket,
            buf: Vec::with_capacity(RECV_BUF_LEN),
            answers: Vec::new(),
            seq: 1000,
        })
    }

    /// [`dump_tcp`] on this query's socket (no new netlink socket per dump): every IPv4 and
    /// IPv6 TCP socket of the network namespace. Errors as [`dump_tcp`].
    pub fn dump(&mut self) -> anyhow::Result<Vec<DiagSocket>> {
        let mut sockets = Vec::new();
        for family in [AF_INET, AF_INET6] {
            self.seq = self.seq.wrapping_add(1);
            dump_family(&self.socket, family, self.seq, &mut self.buf, &mut sockets)?;
        }
        Ok(sockets)
    }

    /// The current state of one TCP socket, looked up by its addresses and checked against its
    /// cookie (a request without `NLM_F_DUMP`: the kernel's `inet_diag_find_one_icsk` and
    /// `sock_diag_check_cookie`, net/ipv4/inet_diag.c). Tens of microseconds, against a few
    /// milliseconds for a dump of every socket. `Ok(None)` when the socket is gone (`ENOENT`)
    /// or the cookie names another socket now.
    pub fn one(&mut self, s: &DiagSocket) -> anyhow::Result<Option<DiagSocket>> {
        self.socket(s.cookie, s.local, s.remote)
    }

    /// [`Self::one`] by cookie, local and remote address. An IPv4 address, or an IPv4-mapped
    /// IPv6 one (`::ffff:a.b.c.d`, as an `AF_INET6` socket talking IPv4 shows it), is asked
    /// for as `AF_INET`: the kernel's lookup then searches the IPv4 hash chains, where such
    /// a dual-stack socket is hashed too (`inet_diag_find_one_icsk` treats an `AF_INET6`
    /// request with mapped addresses the same way), and the answer gives the socket as it is
    /// (an `AF_INET6` one with mapped addresses). Link-local IPv6 addresses take the scope id
    /// of `local` as the interface.
    pub fn socket(
        &mut self,
        cookie: u64,
        local: SocketAddr,
        remote: SocketAddr,
    ) -> anyhow::Result<Option<DiagSocket>> {
        let (family, socket_id) = exact_id(cookie, local, remote);
        self.seq = self.seq.wrapping_add(1);
        let mut out = Vec::with_capacity(1);
        match request(
            &self.socket,
            family,
            self.seq,
            socket_id,
            false,
            &mut self.buf,
            &mut out,
        ) {
            Ok(()) => Ok(out.pop().filter(|d| d.cookie == cookie)),
            Err(e)
                if e.downcast_ref::<std::io::Error>()
                    .and_then(|io| io.raw_os_error())
                    == Some(libc::ENOENT) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// [`Self::socket`] of many sockets, each given as (cookie, local, remote), with few
    /// system calls: the requests of up to [`BATCH_QUERIES`] sockets go in one `sendto(2)`
    /// (the kernel answers the netlink messages of a datagram one after the other,
    /// `netlink_rcv_skb`, each with its own answer or `NLMSG_ERROR`), and their answers are
    /// read with `recvmmsg(2)`. Returns one entry per socket, in order: `None` when it is gone
    /// (`ENOENT`) or its cookie names another socket now.
    ///
    /// Errors: as [`Self::socket`] for any request the kernel refuses with another error, an
    /// undecodable or truncated answer, or no answer within [`ANSWER_TIMEOUT`].
    pub fn sockets(
        &mut self,
        socks: &[(u64, SocketAddr, SocketAddr)],
    ) -> anyhow::Result<Vec<Option<DiagSocket>>> {
        let mut out = Vec::with_capacity(socks.len());
        for chunk in socks.chunks(BATCH_QUERIES) {
            self.batch(chunk, &mut out)?;
        }
        Ok(out)
    }

    /// One [`Self::sockets`] round of at most [`BATCH_QUERIES`] sockets.
    fn batch(
        &mut self,
        socks: &[(u64, SocketAddr, SocketAddr)],
        out: &mut Vec<Option<DiagSocket>>,
    ) -> anyhow::Result<()> {
        let first_seq = self.seq.wrapping_add(1);
        let mut bytes = Vec::with_capacity(socks.len() * 72);
        for &(cookie, local, remote) in socks {
            self.seq = self.seq.wrapping_add(1);
            let (family, socket_id) = exact_id(cookie, local, remote);
            let m = request_message(family, self.seq, socket_id, false);
            let at = bytes.len();
            bytes.resize(at + m.buffer_len(), 0);
            m.serialize(&mut bytes[at..]);
        }
        let sent = self
            .socket
            .send(&bytes, 0)
            .context("cannot send the sock_diag requests")?;
        if sent != bytes.len() {
            bail!("sock_diag requests: sent {sent} of {} bytes", bytes.len());
        }
        let base = out.len();
        out.resize(base + socks.len(), None);
        let mut left = socks.len();
        let slot = ANSWER_SLOT;
        if self.answers.len() < slot * socks.len() {
            self.answers.resize(slot * socks.len(), 0);
        }
        while left > 0 {
            let n = recv_many(&self.socket, &mut self.answers, slot, left)?;
            for (i, &(len, flags)) in n.iter().enumerate() {
                if flags & libc::MSG_TRUNC != 0 {
                    bail!("sock_diag answer truncated to {slot} bytes");
                }
                let raw = &self.answers[i * slot..i * slot + len];
                let message = NetlinkMessage::<SockDiagMessage>::deserialize(raw)
                    .map_err(|e| anyhow::anyhow!("sock_diag: undecodable answer: {e}"))?;
                let k = message.header.sequence_number.wrapping_sub(first_seq) as usize;
                if k >= socks.len() {
                    continue; // an answer to an earlier request
                }
                let answer = match message.payload {
                    NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => {
                        Some(DiagSocket::from_response(&r)).filter(|d| d.cookie == socks[k].0)
                    }
                    NetlinkPayload::Error(e) if e.code.is_some() => {
                        let e = e.to_io();
                        if e.raw_os_error() != Some(libc::ENOENT) {
                            return Err(e).with_context(|| {
                                format!("the kernel refused the sock_diag query of {}", socks[k].1)
                            });
                        }
                        None
                    }
                    _ => continue,
                };
                out[base + k] = answer;
                left -= 1;
            }
        }
        Ok(())
    }
}

/// Sockets asked for per datagram by [`DiagQuery::sockets`]: their answers (about 400 bytes
/// each with `INET_DIAG_INFO`, a few KiB of receive buffer each) stay well within the
/// netlink socket's default receive buffer (`net.core.rmem_default`, 208 KiB).
pub const BATCH_QUERIES: usize = 32;

/// Bytes of receive buffer per answer in [`DiagQuery::sockets`]: an answer is a
/// `struct inet_diag_msg` with its attributes (`INET_DIAG_INFO`: `struct tcp_info`, 248
/// bytes on Linux 6.x, and a few small ones), well under this.
const ANSWER_SLOT: usize = 4096;

/// How long [`DiagQuery::sockets`] waits for an answer before it gives up (`SO_RCVTIMEO`).
pub const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Receives up to `max` datagrams into consecutive `slot`-byte slots of `buf` with one
/// `recvmmsg(2)` (`MSG_WAITFORONE`: waits for the first, takes those already queued after
/// it). Returns (length, `msg_flags`) of each. Errors: the system call's (`EAGAIN` after
/// [`ANSWER_TIMEOUT`] without any).
fn recv_many(
    socket: &Socket,
    buf: &mut [u8],
    slot: usize,
    max: usize,
) -> anyhow::Result<Vec<(usize, i32)>> {
    use std::os::fd::AsRawFd as _;
    let max = max.min(buf.len() / slot);
    let mut iov: Vec<libc::iovec> = buf
        .chunks_mut(slot)
        .take(max)
        .map(|c| libc::iovec {
            iov_base: c.as_mut_ptr().cast(),
            iov_len: c.len(),
        })
        .collect();
    // SAFETY: all-zero is a valid mmsghdr (null pointers, zero lengths).
    let mut msgs: Vec<libc::mmsghdr> = (0..max).map(|_| unsafe { std::mem::zeroed() }).collect();
    for (m, v) in msgs.iter_mut().zip(iov.iter_mut()) {
        m.msg_hdr.msg_iov = v;
        m.msg_hdr.msg_iovlen = 1;
    }
    loop {
        // SAFETY: `msgs` holds `max` headers, each pointing at one iovec of a distinct slot
        // of `buf`; all outlive the call.
        let r = unsafe {
            libc::recvmmsg(
                socket.as_raw_fd(),
                msgs.as_mut_ptr(),
                max as u32,
                libc::MSG_WAITFORONE,
                std::ptr::null_mut(),
            )
        };
        if r >= 0 {
            return Ok(msgs[..r as usize]
                .iter()
                .map(|m| (m.msg_len as usize, m.msg_hdr.msg_flags))
                .collect());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e).context("sock_diag: no answer (recvmmsg)");
        }
    }
}

/// The family and `inet_diag_sockid` of an exact request for socket `cookie` with these
/// addresses ([`DiagQuery::socket`] says which family).
fn exact_id(cookie: u64, local: SocketAddr, remote: SocketAddr) -> (u8, SocketId) {
    let (lip, rip) = (local.ip().to_canonical(), remote.ip().to_canonical());
    let family = if lip.is_ipv4() && rip.is_ipv4() {
        AF_INET
    } else {
        AF_INET6
    };
    let v6 = |ip: IpAddr| match ip {
        IpAddr::V4(v4) if family == AF_INET6 => IpAddr::V6(v4.to_ipv6_mapped()),
        ip => ip,
    };
    let interface_id = match local {
        SocketAddr::V6(a) if a.ip().is_unicast_link_local() => a.scope_id(),
        _ => 0,
    };
    let half = |v: u64| (v as u32).to_ne_bytes();
    let mut raw_cookie = [0u8; 8];
    raw_cookie[..4].copy_from_slice(&half(cookie));
    raw_cookie[4..].copy_from_slice(&half(cookie >> 32));
    (
        family,
        SocketId {
            source_port: local.port(),
            destination_port: remote.port(),
            source_address: v6(lip),
            destination_address: v6(rip),
            interface_id,
            cookie: raw_cookie,
        },
    )
}

/// `SO_RCVTIMEO` of `socket`: a receive that waits longer fails with `EAGAIN`.
fn set_recv_timeout(socket: &Socket, t: std::time::Duration) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd as _;
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: t.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: setsockopt reads a timeval of the given size from `tv`.
    let r = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const tv).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error()).context("SO_RCVTIMEO on the sock_diag socket");
    }
    Ok(())
}

fn family_name(family: u8) -> &'static str {
    if family == AF_INET6 {
        "AF_INET6"
    } else {
        "AF_INET"
    }
}

/// Sends one dump request for `family` and appends the answers to `out`, reading datagrams
/// (each may hold several netlink messages) until the `NLMSG_DONE` of sequence number `seq`.
fn dump_family(
    socket: &Socket,
    family: u8,
    seq: u32,
    buf: &mut Vec<u8>,
    out: &mut Vec<DiagSocket>,
) -> anyhow::Result<()> {
    let socket_id = if family == AF_INET6 {
        SocketId::new_v6()
    } else {
        SocketId::new_v4()
    };
    request(socket, family, seq, socket_id, true, buf, out)
}

/// A `SOCK_DIAG_BY_FAMILY` request of TCP sockets of `family` in every state with
/// `INET_DIAG_INFO`: a dump, or with `dump` false the one socket `socket_id` names.
fn request_message(
    family: u8,
    seq: u32,
    socket_id: SocketId,
    dump: bool,
) -> NetlinkMessage<SockDiagMessage> {
    let mut header = NetlinkHeader::default();
    header.flags = if dump {
        NLM_F_REQUEST | NLM_F_DUMP
    } else {
        NLM_F_REQUEST
    };
    header.sequence_number = seq;
    let mut request = NetlinkMessage::new(
        header,
        SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::INFO,
            states: StateFlags::all(),
            socket_id,
        })
        .into(),
    );
    request.finalize();
    request
}

/// Sends one `SOCK_DIAG_BY_FAMILY` request (a dump of every socket of `family`, or with
/// `dump` false the one socket `socket_id` names) and appends the answers to `out`.
fn request(
    socket: &Socket,
    family: u8,
    seq: u32,
    socket_id: SocketId,
    dump: bool,
    buf: &mut Vec<u8>,
    out: &mut Vec<DiagSocket>,
) -> anyhow::Result<()> {
    let what = family_name(family);
    let request = request_message(family, seq, socket_id, dump);
    let mut bytes = vec![0; request.buffer_len()];
    request.serialize(&mut bytes);
    let sent = socket
        .send(&bytes, 0)
        .with_context(|| format!("cannot send the sock_diag {what} TCP dump request"))?;
    if sent != bytes.len() {
        bail!(
            "sock_diag {what} dump request: sent {sent} of {} bytes",
            bytes.len()
        );
    }

    loop {
        buf.clear();
        let len = match socket.recv(buf, libc::MSG_TRUNC) {
            Ok(len) => len,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(e).with_context(|| format!("sock_diag {what} dump: recv failed"));
            }
        };
        if len > buf.len() {
            bail!(
                "sock_diag {what} dump: datagram of {len} bytes truncated to {}",
                buf.len()
            );
        }
        let mut offset = 0;
        while offset < len {
            let message = NetlinkMessage::<SockDiagMessage>::deserialize(&buf[offset..len])
                .map_err(|e| anyhow::anyhow!("sock_diag {what} dump: undecodable reply: {e}"))?;
            let msg_len = message.header.length as usize;
            if msg_len == 0 {
                bail!("sock_diag {what} dump: zero-length netlink message");
            }
            // NLMSG_ALIGN: messages in a datagram start on 4-byte boundaries.
            offset += (msg_len + 3) & !3;
            if message.header.sequence_number != seq {
                continue; // not an answer to this request
            }
            match message.payload {
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(response)) => {
                    out.push(DiagSocket::from_response(&response));
                    if !dump {
                        return Ok(()); // a single-socket answer has no NLMSG_DONE
                    }
                }
                NetlinkPayload::Done(done) => {
                    if done.code < 0 {
                        return Err(std::io::Error::from_raw_os_error(-done.code))
                            .with_context(|| format!("sock_diag {what} TCP dump failed"));
                    }
                    return Ok(());
                }
                NetlinkPayload::Error(error) if error.code.is_some() => {
                    return Err(error.to_io()).with_context(|| {
                        format!("the kernel refused the sock_diag {what} TCP dump")
                    });
                }
                NetlinkPayload::Overrun(_) => {
                    bail!("sock_diag {what} dump: NLMSG_OVERRUN");
                }
                // NLMSG_NOOP, an ACK (NLMSG_ERROR with code 0, not expected without NLM_F_ACK),
                // or a message kind not asked for.
                _ => {}
            }
        }
    }
}

impl DiagSocket {
    fn from_response(response: &InetResponse) -> DiagSocket {
        let header = &response.header;
        let id = &header.socket_id;
        let half = |b: &[u8]| u64::from(u32::from_ne_bytes(b.try_into().unwrap()));
        let cookie = half(&id.cookie[..4]) | half(&id.cookie[4..]) << 32;
        // Whatever the crate's `rich_nlas` feature (which changes the type inside
        // `Nla::TcpInfo`), the generic `Nla` interface gives back the attribute's raw payload.
        let raw_info = response
            .nlas
            .iter()
            .find(|nla| nla.kind() == INET_DIAG_INFO)
            .map(|nla| {
                let mut raw = vec![0; nla.value_len()];
                nla.emit_value(&mut raw);
                raw
            });
        let info = raw_info.as_deref().and_then(TcpInfo::from_bytes);
        let more = raw_info.as_deref().and_then(TcpInfoMore::from_bytes);
        DiagSocket {
            cookie,
            inode: u64::from(header.inode),
            state: header.state,
            local: socket_addr(id.source_address, id.source_port, id.interface_id),
            remote: socket_addr(id.destination_address, id.destination_port, id.interface_id),
            recv_queue: header.recv_queue,
            send_queue: header.send_queue,
            info,
            more,
        }
    }
}

fn socket_addr(ip: IpAddr, port: u16, interface: u32) -> SocketAddr {
    match ip {
        IpAddr::V4(ip) => SocketAddr::V4(SocketAddrV4::new(ip, port)),
        IpAddr::V6(ip) => {
            let scope = if ip.is_unicast_link_local() {
                interface
            } else {
                0
            };
            SocketAddr::V6(SocketAddrV6::new(ip, port, 0, scope))
        }
    }
}

fn proc_pid(pid: u32) -> anyhow::Result<i32> {
    i32::try_from(pid).with_context(|| format!("pid {pid} is out of range"))
}

/// Socket inodes held open by process `pid`: the `N` of every `/proc/PID/fd/* -> socket:[N]`
/// link. All threads of a process share its descriptor table, so this covers them all.
///
/// Errors (the message names the pid): the process does not exist, or its `/proc/PID/fd`
/// cannot be read (another user's process without root or `CAP_SYS_PTRACE`). Descriptors
/// closed while the directory is read are skipped.
pub fn socket_inodes(pid: u32) -> anyhow::Result<HashSet<u64>> {
    let process = procfs::process::Process::new(proc_pid(pid)?)
        .with_context(|| format!("process {pid}: cannot open /proc/{pid}"))?;
    let fds = process
        .fd()
        .with_context(|| format!("process {pid}: cannot list /proc/{pid}/fd"))?;
    let mut inodes = HashSet::new();
    for fd in fds {
        let fd = fd.with_context(|| format!("process {pid}: cannot read /proc/{pid}/fd"))?;
        if let procfs::process::FDTarget::Socket(inode) = fd.target {
            inodes.insert(inode);
        }
    }
    Ok(inodes)
}

/// Descendant pids of `pid` that exist now: children, grandchildren, ... found by walking the
/// parent pid (`/proc/PID/stat`, field 4) of every process in `/proc`. `pid` itself is not
/// included; the order is breadth-first. Processes that cannot be read (exited during the
/// scan) are skipped, and an unreadable `/proc` gives an empty list.
pub fn descendants(pid: u32) -> Vec<u32> {
    let Ok(processes) = procfs::process::all_processes() else {
        return Vec::new();
    };
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for process in processes.flatten() {
        let Ok(stat) = process.stat() else { continue };
        if let (Ok(child), Ok(parent)) = (u32::try_from(stat.pid), u32::try_from(stat.ppid)) {
            children.entry(parent).or_default().push(child);
        }
    }
    let mut found = Vec::new();
    let mut seen = HashSet::from([pid]);
    let mut next = 0;
    let mut parent = pid;
    loop {
        for &child in children.get(&parent).map(Vec::as_slice).unwrap_or(&[]) {
            if seen.insert(child) {
                found.push(child);
            }
        }
        let Some(&p) = found.get(next) else { break };
        parent = p;
        next += 1;
    }
    found
}

/// Short process name (`/proc/PID/comm`: the kernel's `task->comm`, at most 15 bytes, without
/// the trailing newline; bytes that are not UTF-8 are replaced), if the process exists and
/// the file can be read.
pub fn comm(pid: u32) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/comm")).ok()?;
    let name = raw.strip_suffix(b"\n").unwrap_or(&raw);
    Some(String::from_utf8_lossy(name).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::net::{TcpListener, TcpStream};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    /// `include/net/tcp_states.h`
    const TCP_ESTABLISHED: u8 = 1;
    const TCP_LISTEN: u8 = 10;

    /// Polls `dump_tcp()` until `check` accepts the snapshot (or 5 s pass), returning the last
    /// snapshot.
    fn dump_until(check: impl Fn(&[DiagSocket]) -> bool) -> Vec<DiagSocket> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let dump = dump_tcp().expect("sock_diag dump");
            if check(&dump) || Instant::now() > deadline {
                return dump;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn find(dump: &[DiagSocket], local: SocketAddr, state: u8) -> Option<&DiagSocket> {
        dump.iter().find(|s| s.local == local && s.state == state)
    }

    /// A single-socket query finds the socket a dump listed, with the same cookie and the
    /// queue as it is now; another cookie on the same addresses finds nothing.
    #[test]
    fn query_one_by_addresses_and_cookie() {
        for ip in ["127.0.0.1", "::1"] {
            let listener = TcpListener::bind((ip, 0)).unwrap();
            let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (_server, _) = listener.accept().unwrap();
            let local = client.local_addr().unwrap();
            let dump = dump_until(|d| find(d, local, TCP_ESTABLISHED).is_some());
            let listed = find(&dump, local, TCP_ESTABLISHED)
                .expect("client in the dump")
                .clone();
            client.write_all(&[7u8; 100]).unwrap();
            let mut q = DiagQuery::new().unwrap();
            let deadline = Instant::now() + Duration::from_secs(5);
            let now = loop {
                let d = q.one(&listed).unwrap().expect("the socket, by its cookie");
                if d.info.as_ref().is_some_and(|i| i.bytes_acked >= 101)
                    || Instant::now() > deadline
                {
                    break d;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            assert_eq!(
                (now.cookie, now.local, now.remote),
                (listed.cookie, listed.local, listed.remote)
            );
            assert!(
                now.info.is_some(),
                "INET_DIAG_INFO in a single-socket answer ({ip})"
            );
            let mut other = listed.clone();
            other.cookie ^= 1;
            assert!(
                q.one(&other).unwrap().is_none(),
                "a stale cookie finds nothing ({ip})"
            );
        }
    }

    /// Many sockets asked for at once (more than one datagram of requests): every answer is
    /// the socket asked for, in order, as the dump lists it; a stale cookie and a closed
    /// connection's socket give `None`.
    #[test]
    fn query_many_sockets_at_once() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let n = BATCH_QUERIES + 9;
        let mut pairs = Vec::new();
        for _ in 0..n {
            let c = TcpStream::connect(addr).unwrap();
            let (s, _) = listener.accept().unwrap();
            pairs.push((c, s));
        }
        let locals: Vec<SocketAddr> = pairs.iter().map(|(c, _)| c.local_addr().unwrap()).collect();
        let dump = dump_until(|d| {
            locals
                .iter()
                .all(|l| find(d, *l, TCP_ESTABLISHED).is_some())
        });
        let listed: Vec<DiagSocket> = locals
            .iter()
            .map(|l| find(&dump, *l, TCP_ESTABLISHED).unwrap().clone())
            .collect();
        // The last connection closes before the queries: its client socket goes to
        // TIME_WAIT or away, and its full socket's cookie is then not found as ESTABLISHED.
        let (c, s) = pairs.pop().unwrap();
        drop(s);
        drop(c);
        let mut ask: Vec<(u64, SocketAddr, SocketAddr)> = listed
            .iter()
            .map(|d| (d.cookie, d.local, d.remote))
            .collect();
        ask.push((listed[0].cookie ^ 1, listed[0].local, listed[0].remote));
        let mut q = DiagQuery::new().unwrap();
        let got = q.sockets(&ask).unwrap();
        assert_eq!(got.len(), ask.len());
        for (i, d) in listed.iter().enumerate().take(n - 1) {
            let a = got[i]
                .as_ref()
                .unwrap_or_else(|| panic!("socket {i} found"));
            assert_eq!((a.cookie, a.local, a.remote), (d.cookie, d.local, d.remote));
            assert!(a.info.is_some());
        }
        assert!(
            got[n - 1]
                .as_ref()
                .is_none_or(|a| a.state != TCP_ESTABLISHED),
            "{:?}",
            got[n - 1]
        );
        assert!(got[n].is_none(), "a stale cookie finds nothing");
        // The same socket again right after: the batch left nothing behind in the socket.
        let again = q.socket(listed[0].cookie, listed[0].local, listed[0].remote);
        assert_eq!(again.unwrap().map(|d| d.cookie), Some(listed[0].cookie));
    }

    /// An `AF_INET6` socket talking IPv4 (dual-stack listener, IPv4 client) is found by its
    /// plain IPv4 addresses, as the kernel hooks' records give them, and by the IPv4-mapped
    /// ones the dump shows.
    #[test]
    fn query_a_dual_stack_socket_by_its_ipv4_addresses() {
        let Ok(listener) = TcpListener::bind(("::", 0)) else {
            eprintln!("no IPv6, skipped");
            return;
        };
        let port = listener.local_addr().unwrap().port();
        let client = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (server, _) = listener.accept().unwrap();
        let (local, remote) = (server.local_addr().unwrap(), server.peer_addr().unwrap());
        assert!(local.is_ipv6(), "{local}: an AF_INET6 socket");
        let dump = dump_until(|d| d.iter().any(|s| s.local == local && s.remote == remote));
        let listed = dump
            .iter()
            .find(|s| s.local == local && s.remote == remote)
            .expect("the accepted socket in the dump")
            .clone();
        let v4 = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
        assert!(v4(local).is_ipv4());
        let mut q = DiagQuery::new().unwrap();
        for (l, r) in [(v4(local), v4(remote)), (local, remote)] {
            let d = q
                .socket(listed.cookie, l, r)
                .unwrap()
                .unwrap_or_else(|| panic!("found by {l} -> {r}"));
            assert_eq!(
                (d.cookie, d.local, d.remote),
                (listed.cookie, local, remote)
            );
            assert!(d.info.is_some());
        }
        assert!(
            q.socket(listed.cookie ^ 1, v4(local), v4(remote))
                .unwrap()
                .is_none()
        );
        drop(client);
    }

    /// Listener, client and accepted server socket on `ip`; the client writes `N` bytes that
    /// the server does not read.
    fn check_pair(ip: &str) {
        const N: usize = 4321;
        let listener = TcpListener::bind((ip, 0)).unwrap();
        let listen_addr = listener.local_addr().unwrap();
        let mut client = TcpStream::connect(listen_addr).unwrap();
        let (server, _) = listener.accept().unwrap();
        let client_addr = client.local_addr().unwrap();
        let server_addr = server.local_addr().unwrap();
        client.write_all(&[0x5a; N]).unwrap();

        let dump = dump_until(|d| {
            find(d, server_addr, TCP_ESTABLISHED).is_some_and(|s| s.recv_queue as usize == N)
                && find(d, client_addr, TCP_ESTABLISHED)
                    .and_then(|s| s.info)
                    .is_some_and(|i| i.bytes_acked >= N as u64)
        });

        let listen = find(&dump, listen_addr, TCP_LISTEN).expect("listener in dump");
        let client_s = find(&dump, client_addr, TCP_ESTABLISHED).expect("client in dump");
        let server_s = dump
            .iter()
            .find(|s| s.local == server_addr && s.remote == client_addr)
            .expect("accepted socket in dump");
        assert_eq!(server_s.state, TCP_ESTABLISHED);
        assert_eq!(client_s.remote, server_addr);
        assert_eq!(listen.recv_queue, 0, "nothing left in the accept queue");

        for s in [listen, client_s, server_s] {
            assert_ne!(s.cookie, 0, "{s:?}");
            assert_ne!(s.inode, 0, "{s:?}");
            assert!(s.info.is_some(), "full sockets carry INET_DIAG_INFO: {s:?}");
        }
        let cookies: HashSet<u64> = [listen, client_s, server_s]
            .iter()
            .map(|s| s.cookie)
            .collect();
        assert_eq!(cookies.len(), 3, "cookies are distinct");

        let inodes = socket_inodes(std::process::id()).unwrap();
        for s in [listen, client_s, server_s] {
            assert!(
                inodes.contains(&s.inode),
                "inode {} not among our fds",
                s.inode
            );
        }

        // The reader has not read: everything sits in its receive queue.
        assert_eq!(server_s.recv_queue as usize, N);
        let server_info = server_s.info.unwrap();
        assert_eq!(server_info.bytes_received, N as u64, "{server_info:?}");
        // The writer: all acknowledged (+1 for the SYN), nothing left to send.
        let client_info = client_s.info.unwrap();
        assert!(
            (N as u64..=N as u64 + 1).contains(&client_info.bytes_acked),
            "{client_info:?}"
        );
        assert_eq!(client_s.send_queue, 0);
        assert_eq!(client_info.notsent_bytes, 0);
        assert_eq!(client_info.unacked, 0);
        assert!(client_info.snd_cwnd > 0, "{client_info:?}");
        assert!(client_info.srtt_us > 0, "{client_info:?}");
        assert!(
            client_info.min_rtt_us > 0 && client_info.min_rtt_us < 1_000_000,
            "{client_info:?}"
        );
        // busy_time_us has jiffy granularity: a loopback burst this small may read 0.

        // The cookie is the one SO_COOKIE (i.e. bpf_get_socket_cookie) gives.
        use std::os::fd::AsRawFd;
        let mut cookie = 0u64;
        let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `cookie`.
        let rc = unsafe {
            libc::getsockopt(
                client.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_COOKIE,
                (&raw mut cookie).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0);
        assert_eq!(cookie, client_s.cookie);
    }

    #[test]
    fn sockdiag_dump_ipv4() {
        check_pair("127.0.0.1");
    }

    #[test]
    fn sockdiag_dump_ipv6() {
        if TcpListener::bind(("::1", 0)).is_err() {
            eprintln!("no IPv6 loopback, skipped");
            return;
        }
        check_pair("::1");
    }

    #[test]
    fn sockdiag_tcp_info_short_payload() {
        assert_eq!(TcpInfo::from_bytes(&[0; 100]), None);
        let mut raw = vec![0u8; 104];
        raw[tcpi_offset::SND_CWND..][..4].copy_from_slice(&10u32.to_ne_bytes());
        let info = TcpInfo::from_bytes(&raw).unwrap();
        assert_eq!(info.snd_cwnd, 10);
        assert_eq!(info.bytes_acked, 0, "missing fields read as 0");
    }

    #[test]
    fn sockdiag_socket_inodes_missing_process() {
        let err = socket_inodes(i32::MAX as u32).unwrap_err();
        assert!(
            format!("{err:#}").contains(&(i32::MAX).to_string()),
            "{err:#}"
        );
        assert!(socket_inodes(u32::MAX).is_err());
    }

    #[test]
    fn sockdiag_descendants_and_comm() {
        let me = std::process::id();
        assert!(comm(me).is_some_and(|c| !c.is_empty()));
        assert_eq!(comm(i32::MAX as u32), None);

        // A child, and a grandchild whose pid the child prints.
        let mut child = Command::new("sh")
            .args(["-c", "sleep 5 & echo $!; wait"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let grandchild: u32 = line.trim().parse().unwrap();
        let mut sleeper = Command::new("sleep").arg("5").spawn().unwrap();

        let found = descendants(me);
        // SAFETY: kill(2) on processes this test started.
        unsafe { libc::kill(grandchild as i32, libc::SIGKILL) };
        let sleeper_comm = comm(sleeper.id());
        let _ = sleeper.kill();
        let _ = sleeper.wait();
        let _ = child.kill();
        let _ = child.wait();

        assert!(found.contains(&child.id()), "{found:?}");
        assert!(found.contains(&grandchild), "{found:?}");
        assert!(found.contains(&sleeper.id()), "{found:?}");
        assert!(!found.contains(&me));
        assert_eq!(sleeper_comm.as_deref(), Some("sleep"));
        assert!(descendants(sleeper.id()).is_empty());
    }
}
