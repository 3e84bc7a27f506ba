//! The agent's model of every watched socket: identity, SPICE channel, framing status,
//! message counts per direction and type, and statistics of the ACK window the kernel keeps.
//! Built from kernel records ([`crate::events::Event`]), in ring order (the ring serialises
//! reservations, so records of one thread arrive in program order), and checked against the
//! kernel's own per-socket state when the agent reads it ([`Model::kernel_state`]), which is
//! also where the message and byte totals are taken from: a lost record leaves them short only
//! until the next read.

pub mod chain;
pub mod hist;
pub mod infer;
pub mod joined;
pub mod tls;
pub mod traced;
pub mod window;

use std::{
    collections::{BTreeMap, BTreeSet, HashSet, VecDeque},
    net::SocketAddr,
};

use spice_ebpf_common::{
    event::{
        EventHeader, LinkEvent, MessageEvent, SockState, TcpSnapshot, carrier, dir, hdr_flags,
        kind, msg_flags,
    },
    framing::{Role, UnparsedReason},
    protocol::{channel, msg_server},
    window::WindowState,
};

use crate::events::Event;
pub use window::AckWindow;

/// Where framing stopped in one direction.
#[derive(Clone, Copy, Debug)]
pub struct Unparsed {
    pub reason: UnparsedReason,
    pub detail: u32,
    /// Stream offset (bytes) where it stopped.
    pub at: u64,
}

/// A direction without message boundaries, hunting for them (kernel `Phase::Hunt`): a
/// connection joined mid-stream, or one whose header failed validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hunting {
    /// `AttachedMidStream` (joined) or `BadHeader` (a lock lost; detail: the type).
    pub reason: UnparsedReason,
    pub detail: u32,
    /// Stream offset (bytes) from which nothing is framed until the next lock.
    pub at: u64,
    /// When the hunt began (CLOCK_MONOTONIC ns: the record's time, or when the agent found
    /// the connection).
    pub since_ns: u64,
}

/// The newest lock of a direction that hunted ([`spice_ebpf_common::event::LockEvent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Locked {
    /// [`spice_ebpf_common::event::lock_how`]: what the validated chain began at.
    pub how: u8,
    /// Consecutive headers validated.
    pub run: u8,
    /// Stream offset of the first counted message.
    pub at: u64,
    /// Ordinal of that message.
    pub index: u64,
    /// Bytes not framed in that hunt.
    pub skipped: u64,
    /// Channel types every validated header fit (bit `1 << type`).
    pub channel_mask: u16,
    /// When it locked (CLOCK_MONOTONIC ns) and how long the hunt took, ns.
    pub ts_ns: u64,
    pub hunted_ns: u64,
}

/// One framed message, as kept for placing in-flight messages and comparing relay legs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsgSpan {
    /// 1-based ordinal in its direction.
    pub index: u64,
    /// Stream offsets of the header's first byte and one past the body's last byte.
    pub at: u64,
    pub end: u64,
    pub msg_type: u16,
}

/// How many recent messages each direction keeps: far more than the most a window can hold
/// in flight (2W+2 = 82).
pub const RECENT: usize = 4096;
/// How many first messages each direction keeps to pair relay legs.
pub const FINGERPRINT: usize = 16;

/// Per-direction counts of one socket. "Direction" is relative to the watched process:
/// index [`dir::SEND`] holds what it wrote, [`dir::RECV`] what it read.
#[derive(Clone, Debug, Default)]
pub struct DirStats {
    /// SPICE role of these bytes, from the link phase.
    pub role: Role,
    /// The link message (C→S) or reply (S→C) of this direction.
    pub link: Option<LinkEvent>,
    /// Data header length in use: 6 (mini) or 18 (full); 0 before the first message.
    pub hdr_len: u8,
    /// Messages started: the kernel's count at the newest read of its socket map
    /// ([`Self::base_index`]) plus the records applied since with a higher ordinal, and at
    /// least the highest ordinal seen ([`Self::last_index`], less [`Self::uncounted`]): exact
    /// up to the newest record, lost records included.
    pub messages: u64,
    /// Bytes of those messages (headers + bodies): the kernel's `SockState::msg_bytes` at the
    /// newest read plus the bytes of the records applied since with a higher ordinal. Short by
    /// the bytes of records lost after that read until the next read rebases it.
    pub bytes: u64,
    /// Per message type: (messages, bytes) of the records applied (lost records are not in
    /// them: the kernel keeps no per-type counts).
    pub by_type: BTreeMap<u16, (u64, u64)>,
    /// Per message type: smallest and largest body size (bytes, header excluded) of the
    /// records applied, for [`infer`].
    pub sizes: BTreeMap<u16, (u32, u32)>,
    /// Messages first reported from a send that failed with EAGAIN.
    pub eagain_starts: u64,
    /// Highest message ordinal seen; a jump means lost ring records.
    pub last_index: u64,
    /// Message records missing (ordinal gaps).
    pub lost_records: u64,
    /// Set once framing stopped.
    pub unparsed: Option<Unparsed>,
    /// Set while the direction hunts for its message boundaries (cleared at a lock).
    pub hunting: Option<Hunting>,
    /// The newest lock, if the direction ever hunted and found its boundaries.
    pub locked: Option<Locked>,
    /// Locks found, and locks lost (a header failed validation: back to hunting).
    pub locks: u32,
    pub resyncs: u32,
    /// Bytes not framed because the direction was hunting, summed over its finished hunts.
    pub unframed: u64,
    /// Timestamps (CLOCK_MONOTONIC ns) of the first and last message.
    pub first_ns: Option<u64>,
    pub last_ns: u64,
    /// TCP sequence number of stream offset 0 (from the first message record). Always `None`
    /// on a TLS socket ([`SocketModel::tls`]): its offsets count plaintext bytes, which sit in
    /// TCP sequence space by [`Self::tls`]'s marks, and its records' `seq` means nothing.
    pub seq_base: Option<u32>,
    /// A TLS socket's marks of this direction (where its plaintext lies in TCP sequence
    /// space) and plaintext counts; `None` on a socket not carried by TLS.
    pub tls: Option<tls::TlsDir>,
    /// The last [`RECENT`] messages.
    pub recent: VecDeque<MsgSpan>,
    /// The first [`FINGERPRINT`] messages.
    pub first: Vec<MsgSpan>,
    /// Messages counted from the kernel's socket map when a restarted agent took this socket
    /// over ([`Model::restore`]): ring records with an ordinal up to this one were the old
    /// agent's; they are already in the totals and in the window taken from the map, and only
    /// their spans are kept. 0 otherwise.
    pub restored_upto: u64,
    /// The kernel's message count (`DirState::msg_count`, plus an EAGAIN send's early message)
    /// at the newest read of its socket map that rebased the totals ([`Model::kernel_state`],
    /// [`Model::restore`]): records with an ordinal up to this one are in [`Self::messages`]
    /// and [`Self::bytes`] already (equal means counted) and add only to the per-type counts,
    /// spans and window. 0 before any read.
    pub base_index: u64,
    /// Messages before the first record of a socket this agent did not see from its start
    /// and found no map entry for (a socket reported `restarted`): not in
    /// [`Self::messages`].
    pub uncounted: u64,
    /// Bytes of the records applied, on top of the bytes taken from the map at a restore or
    /// at the newest comparison that resynchronised after lost records: the record-derived
    /// figure [`KernelCheck`] compares with `SockState::msg_bytes`.
    pub derived_bytes: u64,
    /// Every byte the watched process moved in this direction by traced calls, framed or not
    /// (hunting, unparsed, not SPICE): the kernel's `DirState::pos` at the newest read of its
    /// socket map ([`Model::kernel_state`]), with the rates derived from the reads. TCP bytes
    /// on a TLS socket too (`SockState::wire_pos`; its plaintext count is in [`Self::tls`]).
    pub traced: traced::TracedBytes,
}

impl DirStats {
    /// The kept message with ordinal `index`, if still kept.
    pub fn by_index(&self, index: u64) -> Option<&MsgSpan> {
        let last = self.recent.back()?;
        let back = last.index.checked_sub(index)? as usize;
        let i = self.recent.len().checked_sub(1 + back)?;
        self.recent.get(i).filter(|m| m.index == index)
    }
}

/// A socket's SPICE channel type, known or inferred ([`SocketModel::channel_type`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelType {
    /// [`channel`] number.
    pub ty: u8,
    /// Channel id: only the link message carries it.
    pub id: Option<u8>,
    /// `None` when the link message told; else why it was inferred ([`infer::Inference`]).
    pub evidence: Option<String>,
}

impl ChannelType {
    /// Inferred from the message types, not read from the link message.
    pub fn inferred(&self) -> bool {
        self.evidence.is_some()
    }
}

/// Everything known about one watched TCP socket.
#[derive(Clone, Debug)]
pub struct SocketModel {
    /// Socket cookie (kernel-wide unique id, also sock_diag's `idiag_cookie`).
    pub cookie: u64,
    /// Process (tgid) that first used the socket, and its comm.
    pub pid: u32,
    pub comm: String,
    /// Thread that first used it.
    pub tid: u32,
    pub local: Option<SocketAddr>,
    pub remote: Option<SocketAddr>,
    /// When the socket was first seen and when it closed (CLOCK_MONOTONIC ns).
    pub first_ns: u64,
    pub closed_ns: Option<u64>,
    /// Indexed by [`dir::SEND`] / [`dir::RECV`].
    pub dirs: [DirStats; 2],
    /// spice-server's ACK window on this socket, as the kernel keeps it (each record's
    /// post-message state) plus time statistics. Active only once a SET_ACK was seen: display
    /// and cursor channels.
    pub window: AckWindow,
    /// Comparisons of [`Self::window`] and the byte totals with the kernel's `SOCKETS` entry.
    pub kernel: KernelCheck,
    /// Main INIT session id (main channel), or the link message's connection_id (others).
    pub session_id: Option<u32>,
    /// Last TCP state a kernel hook read (socket calls, sockops, close).
    pub tcp: Option<TcpSnapshot>,
    /// Largest notsent (write_seq − snd_nxt) seen in samples, bytes.
    pub notsent_max: u32,
    /// Found open by the agent's sock_diag dump when it started watching the process (a
    /// connection older than the observation), so in the agent's network namespace: such a
    /// socket that goes idle has no kernel entry and no close record, and is marked closed
    /// when a later dump no longer lists it ([`Model::gone`]).
    pub found_by_dump: bool,
    /// spice-server's window as an interval, for a connection joined mid-stream
    /// ([`joined::is_joined`]); `None` for others.
    pub joined: Option<Box<joined::JoinedWindow>>,
    /// Set when the socket carries TLS (its `TLS` record, a mark, or the kernel's
    /// `SockState::carrier`): its framing, message records and offsets are of the plaintext
    /// the process hands to libssl; the marks are in [`DirStats::tls`].
    pub tls: Option<tls::TlsSocket>,
}

impl SocketModel {
    fn new(cookie: u64, hdr: &EventHeader) -> Self {
        Self {
            cookie,
            pid: hdr.tgid,
            comm: String::new(),
            tid: 0,
            local: None,
            remote: None,
            first_ns: hdr.ts_ns,
            closed_ns: None,
            dirs: Default::default(),
            window: AckWindow::default(),
            kernel: KernelCheck::default(),
            session_id: None,
            tcp: None,
            notsent_max: 0,
            found_by_dump: false,
            joined: None,
            tls: None,
        }
    }

    /// The socket carries TLS (framed from the plaintext at the libssl hooks).
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// `"tls"` for a socket carried by TLS, else `"tcp"`.
    pub fn transport(&self) -> &'static str {
        if self.is_tls() { "tls" } else { "tcp" }
    }

    /// Marks the socket as carried by TLS: `func` is the libssl function its first traced
    /// call ran in (0: not known), `ts_ns` when that became known. Its sequence bases are
    /// dropped (a TLS socket's message records carry no meaningful `seq`) and each direction
    /// gets its marks.
    fn set_tls(&mut self, func: u8, ts_ns: u64) {
        match &mut self.tls {
            Some(t) if t.func == 0 => t.func = func,
            Some(_) => {}
            None => {
                self.tls = Some(tls::TlsSocket {
                    func,
                    since_ns: ts_ns,
                })
            }
        }
        for d in self.dirs.iter_mut() {
            d.seq_base = None;
            d.tls.get_or_insert_with(Default::default);
        }
    }

    /// The plaintext offset below which direction `d`'s marks are needed by no placement:
    /// the start of the oldest message that can still be counted in flight on the server →
    /// client direction (the newest max(count, 2W+2, the joined interval's high end)
    /// messages), the start of the newest message on the client → server direction (whose
    /// positions are never converted). `None` while not known (no role, or fewer messages
    /// kept than that).
    fn mark_floor(&self, d: usize) -> Option<u64> {
        let ds = &self.dirs[d];
        let n = match ds.role {
            Role::ServerToClient => {
                let mut n = self.placement_count().max(self.window.count);
                if self.window.active() {
                    n = n.max(self.window.limit() + 1);
                }
                if let Some(i) = self.joined.as_deref().and_then(|j| j.interval()) {
                    n = n.max(i.high);
                }
                n.max(1)
            }
            Role::ClientToServer => 1,
            _ => return None,
        };
        let i = ds.recent.len().checked_sub(n as usize)?;
        Some(ds.recent[i].at)
    }

    /// Prunes direction `d`'s marks ([`tls::TlsDir::prune`]) to [`Self::mark_floor`].
    fn prune_marks(&mut self, d: usize) {
        if self.dirs[d].tls.is_none() {
            return;
        }
        let Some(floor) = self.mark_floor(d) else {
            return;
        };
        if let Some(t) = self.dirs[d].tls.as_mut() {
            t.prune(floor);
        }
    }

    /// Index of the direction carrying server → client bytes, once the link phase or the
    /// kernel's hint told, else as inferred ([`Self::roles_inferred`]).
    pub fn s2c(&self) -> Option<usize> {
        self.dirs
            .iter()
            .position(|d| d.role == Role::ServerToClient)
            .or_else(|| self.inferred_role(Role::ServerToClient))
    }

    /// Index of the direction carrying client → server bytes (as [`Self::s2c`]).
    pub fn c2s(&self) -> Option<usize> {
        self.dirs
            .iter()
            .position(|d| d.role == Role::ClientToServer)
            .or_else(|| self.inferred_role(Role::ClientToServer))
    }

    /// A socket joined mid-stream or that lost its boundaries: some direction hunted.
    pub fn joined(&self) -> bool {
        self.dirs
            .iter()
            .any(|d| d.hunting.is_some() || d.locked.is_some())
    }

    /// What the message types say about a socket whose link phase was not seen (some
    /// direction hunted, or is framed without a link: a joined connection an agent restarted
    /// on pinned state took over; no link message or reply seen): [`infer::infer`] over both
    /// directions. `None` for other sockets.
    pub fn inference(&self) -> Option<infer::Inference> {
        let framed = self.dirs.iter().any(|d| d.hdr_len != 0);
        if !(self.joined() || framed) || self.dirs.iter().any(|d| d.link.is_some()) {
            return None;
        }
        let e = [0, 1].map(|d| infer::DirEvidence::from_dir(&self.dirs[d]));
        Some(infer::infer(&e))
    }

    fn inferred_role(&self, role: Role) -> Option<usize> {
        if !self.dirs.iter().any(|d| d.role == Role::Unknown) {
            return None;
        }
        let i = self.inference()?;
        i.roles.iter().position(|&r| r == role)
    }

    /// Some direction's role was inferred from its messages ([`infer`]): the kernel gave no
    /// hint and no link phase was seen.
    pub fn roles_inferred(&self) -> bool {
        self.dirs.iter().any(|d| d.role == Role::Unknown)
            && self.inference().is_some_and(|i| i.roles_inferred)
    }

    /// Channel type: from the link message ([`Self::channel`]), else inferred from the
    /// message types ([`Self::inference`]); `None` when neither tells.
    pub fn channel_type(&self) -> Option<ChannelType> {
        if let Some((ty, id)) = self.channel() {
            return Some(ChannelType {
                ty,
                id: Some(id),
                evidence: None,
            });
        }
        let i = self.inference()?;
        Some(ChannelType {
            ty: i.channel_type?,
            id: None,
            evidence: Some(i.evidence),
        })
    }

    /// Channel type and id from the client's link message.
    pub fn channel(&self) -> Option<(u8, u8)> {
        let l = self.c2s().and_then(|i| self.dirs[i].link)?;
        Some((l.channel_type, l.channel_id))
    }

    /// Whether the watched process is the server end of this connection (spice-server, or a
    /// relay's client-facing leg): it read the client's link message.
    pub fn is_server_end(&self) -> Option<bool> {
        self.c2s().map(|i| i == dir::RECV as usize)
    }

    /// The first reason framing stopped, in either direction.
    pub fn unparsed(&self) -> Option<Unparsed> {
        self.dirs
            .iter()
            .filter_map(|d| d.unparsed)
            .min_by_key(|u| u.at)
    }

    /// `"mini"`, `"full"`, `"unparsed"`, `"hunting"` (no message boundaries yet in either
    /// direction: joined mid-stream or lost), or `"pending"` (link phase not finished yet).
    pub fn framing(&self) -> &'static str {
        if self.unparsed().is_some() {
            return "unparsed";
        }
        if self
            .dirs
            .iter()
            .all(|d| d.hunting.is_some() && d.hdr_len == 0)
        {
            return "hunting";
        }
        match self.dirs.iter().map(|d| d.hdr_len).max().unwrap_or(0) {
            6 => "mini",
            18 => "full",
            _ => "pending",
        }
    }

    /// Message records lost for this socket (ordinal gaps), both directions.
    pub fn lost_records(&self) -> u64 {
        self.dirs.iter().map(|d| d.lost_records).sum()
    }

    fn message(&mut self, m: &MessageEvent) {
        if m.hdr.flags & hdr_flags::TLS != 0 && !self.is_tls() {
            // Its TLS record was lost (counted): the libssl hooks wrote this one.
            self.set_tls(0, m.hdr.ts_ns);
        }
        let d = (m.hdr.dir & 1) as usize;
        let ds = &mut self.dirs[d];
        if m.index <= ds.restored_upto {
            // Counted from the kernel's map at the restart (index = 1-based ordinal: equal
            // means counted), and already in the window state taken from there. Only its span
            // is kept, for stage placement, and a main channel's session id.
            let bytes = m.hdr_len as u64 + m.size as u64;
            if ds.recent.back().is_none_or(|b| b.index < m.index) {
                if ds.recent.len() == RECENT {
                    ds.recent.pop_front();
                }
                ds.recent.push_back(MsgSpan {
                    index: m.index,
                    at: m.at,
                    end: m.at + bytes,
                    msg_type: m.msg_type,
                });
            }
            if ds.tls.is_none() {
                ds.seq_base.get_or_insert(m.seq.wrapping_sub(m.at as u32));
            }
            if m.msg_type == msg_server::MAIN_INIT
                && m.size >= 4
                && ds.role == Role::ServerToClient
                && self.channel().map(|c| c.0) == Some(channel::MAIN)
            {
                self.session_id = Some(m.prefix[0]);
            }
            return;
        }
        if m.index > ds.last_index + 1 {
            ds.lost_records += m.index - ds.last_index - 1;
        }
        ds.last_index = ds.last_index.max(m.index);
        ds.hdr_len = m.hdr_len;
        let bytes = m.hdr_len as u64 + m.size as u64;
        ds.derived_bytes += bytes;
        if m.index > ds.base_index {
            // Not in the kernel's totals taken at the newest read: counted here.
            ds.messages += 1;
            ds.bytes += bytes;
        }
        // The ordinal says how many messages there were up to this one, lost records included.
        ds.messages = ds.messages.max(ds.last_index.saturating_sub(ds.uncounted));
        let e = ds.by_type.entry(m.msg_type).or_default();
        e.0 += 1;
        e.1 += bytes;
        let r = ds.sizes.entry(m.msg_type).or_insert((m.size, m.size));
        *r = (r.0.min(m.size), r.1.max(m.size));
        if m.flags & msg_flags::EAGAIN_START != 0 {
            ds.eagain_starts += 1;
        }
        ds.first_ns.get_or_insert(m.hdr.ts_ns);
        ds.last_ns = m.hdr.ts_ns;
        if ds.tls.is_none() {
            // A TLS socket's records carry no meaningful `seq`: its marks place it.
            ds.seq_base.get_or_insert(m.seq.wrapping_sub(m.at as u32));
        }
        let span = MsgSpan {
            index: m.index,
            at: m.at,
            end: m.at + bytes,
            msg_type: m.msg_type,
        };
        if ds.recent.len() == RECENT {
            ds.recent.pop_front();
        }
        ds.recent.push_back(span);
        if ds.first.len() < FINGERPRINT {
            ds.first.push(span);
        }
        let role = ds.role;
        self.window.record(role, m);
        self.joined_record(role, m);
        if m.msg_type == msg_server::MAIN_INIT
            && m.size >= 4
            && role == Role::ServerToClient
            && self.channel().map(|c| c.0) == Some(channel::MAIN)
        {
            self.session_id = Some(m.prefix[0]);
        }
        self.prune_marks(d);
        self.compare_kernel();
    }

    /// Compares the pending kernel read with the record-derived state if exactly the
    /// messages the kernel had applied at the read have been applied here; drops it if more
    /// have (it can no longer be compared).
    fn compare_kernel(&mut self) {
        let Some(k) = self.kernel.pending else {
            return;
        };
        let applied = [self.dirs[0].last_index, self.dirs[1].last_index];
        if applied.iter().zip(k.messages).any(|(&a, b)| a > b) {
            self.kernel.pending = None;
            return;
        }
        if applied != k.messages {
            return;
        }
        let mut diff = self.window.differences(&k.window);
        if self.dirs[0].derived_bytes != k.bytes[0] {
            diff.push("bytes_sent");
        }
        if self.dirs[1].derived_bytes != k.bytes[1] {
            diff.push("bytes_received");
        }
        self.kernel.compared += 1;
        let lost = self.lost_records();
        if !diff.is_empty() {
            self.kernel.differed += 1;
            self.kernel.differences = diff;
            if lost > self.kernel.lost_seen {
                // Records were lost since the last comparison: the record-derived state
                // drifted, and the kernel's state at this read is exactly what the records
                // applied so far should have given. Continue from it.
                self.window.resync(&k.window, k.read_ns);
                for d in 0..2 {
                    self.dirs[d].derived_bytes = k.bytes[d];
                }
                self.kernel.resynced += 1;
            }
        }
        self.kernel.lost_seen = lost;
        self.kernel.last = Some(k);
        self.kernel.pending = None;
    }

    /// Takes the message and byte totals of every direction from the kernel read `k`
    /// ([`DirStats::base_index`]), for a direction whose records the model has not applied
    /// beyond the read (the usual case: the engine reads the map after draining the ring).
    /// A direction the model is ahead of keeps its totals (records applied after the read
    /// cannot be told from lost ones there) and is rebased at the next read.
    fn rebase(&mut self, k: &KernelRead) {
        for (d, ds) in self.dirs.iter_mut().enumerate() {
            let n = k.messages[d];
            if n < ds.last_index || n < ds.base_index {
                continue;
            }
            ds.base_index = n;
            ds.messages = n;
            ds.bytes = k.bytes[d];
        }
    }
}

/// One read of a socket's kernel state (`SOCKETS`), in the terms the model compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelRead {
    /// CLOCK_MONOTONIC ns of the read.
    pub read_ns: u64,
    /// The kernel's window ([`SockState::window`]).
    pub window: WindowState,
    /// Messages the kernel had applied per direction ([`dir`] index): `DirState::msg_count`,
    /// plus the one an EAGAIN send reported early (`announced_at` ≠ 0), whose record carries
    /// the next index.
    pub messages: [u64; 2],
    /// [`SockState::msg_bytes`]: header + body bytes of those messages.
    pub bytes: [u64; 2],
}

impl KernelRead {
    /// From a `SOCKETS` value read at `read_ns`.
    pub fn new(st: &SockState, read_ns: u64) -> Self {
        let applied = |d: usize| st.dir[d].msg_count + u64::from(st.dir[d].announced_at != 0);
        KernelRead {
            read_ns,
            window: st.window,
            messages: [applied(0), applied(1)],
            bytes: st.msg_bytes,
        }
    }
}

/// Comparisons of one socket's record-derived window and byte totals with the kernel's state.
/// A read is compared when the model has applied exactly the records of the messages the
/// kernel had applied at the read (per direction, by message index); a read overtaken before
/// that (a newer read, or a lost record) is dropped uncompared.
#[derive(Clone, Debug, Default)]
pub struct KernelCheck {
    /// The newest read, not compared yet.
    pub pending: Option<KernelRead>,
    /// The newest read that was compared.
    pub last: Option<KernelRead>,
    /// Reads compared, and those in which some field differed.
    pub compared: u64,
    pub differed: u64,
    /// The fields that differed in the newest read that differed ([`AckWindow::differences`]
    /// names, `bytes_sent`, `bytes_received`).
    pub differences: Vec<&'static str>,
    /// Compared reads that differed after records of the socket were lost, from which the
    /// window's counters and the record-derived byte totals were taken
    /// ([`AckWindow::resync`]).
    pub resynced: u64,
    /// The socket's lost records ([`SocketModel::lost_records`]) at the newest comparison.
    pub lost_seen: u64,
}

/// A process event seen while observing.
#[derive(Clone, Debug)]
pub enum ProcessNote {
    /// `parent` forked `child`, which is watched from then on.
    /// `ts_ns`: CLOCK_MONOTONIC ns of the fork.
    Forked {
        ts_ns: u64,
        parent: u32,
        child: u32,
        comm: String,
    },
    Exited {
        ts_ns: u64,
        pid: u32,
    },
}

/// How many process notes (forks and exits) the model keeps: the newest ones. Older notes
/// are only counted ([`Model::forks`], [`Model::exits`]), so a relay forking one child per
/// connection for days keeps a bounded list.
pub const PROCESS_NOTES: usize = 256;

/// All sockets and process notes of one observation.
#[derive(Clone, Debug, Default)]
pub struct Model {
    pub sockets: BTreeMap<u64, SocketModel>,
    /// The newest [`PROCESS_NOTES`] process notes, oldest first.
    pub processes: VecDeque<ProcessNote>,
    /// Sockets whose records [`Model::apply`] drops: the start-up self-test's
    /// ([`crate::pipeline::selftest`]), two per self-test, one self-test per engine.
    pub ignored: HashSet<u64>,
    /// Forks and exits seen, including notes no longer kept.
    pub forks: u64,
    pub exits: u64,
    /// Records of any kind decoded.
    pub records: u64,
    /// When a restarted agent rebuilt this model from the kernel's pinned socket map
    /// ([`Model::restore`]), CLOCK_MONOTONIC ns; `None` for a model built from the ring only.
    pub restored_ns: Option<u64>,
    /// What the libssl hooks could do for each watched process (tgid → status), as the front
    /// end last reported it ([`Model::set_tls_attach`]). Entries leave with their process
    /// ([`Model::forget_tls_attach`]), once the model holds no socket of it any more.
    pub tls_attach: BTreeMap<u32, tls::TlsAttach>,
    /// Processes the front end forgot ([`Model::forget_tls_attach`]) whose status is kept
    /// while the model still holds sockets of theirs (their report rows, e.g. an `unparsed:
    /// tls` detail, say what the hooks could do); dropped by [`Model::release_tls_attach`].
    pub tls_forgotten: BTreeSet<u32>,
}

/// One entry of the kernel's socket map and what the host knows about it, for
/// [`Model::restore`].
#[derive(Clone, Debug)]
pub struct Restored {
    pub cookie: u64,
    /// The map value (framing state of both directions, message bytes, window).
    pub state: SockState,
    /// `comm` of the owning process (`/proc/PID/comm`), empty if it is gone.
    pub comm: String,
    /// Addresses from sock_diag (by cookie); `None` if the socket is no longer in the dump.
    pub local: Option<SocketAddr>,
    pub remote: Option<SocketAddr>,
    /// The TCP state the kernel hooks keep in the socket's `SOCKETS` entry, if any.
    pub tcp: Option<TcpSnapshot>,
}

/// The host window of a connection whose exact state is `w` (from the kernel's socket map),
/// as of `now_ns`.
///
/// The kernel runs spice-server's window rule on every framed message and keeps its exact
/// state in the socket map, so the window continues exactly: [`AckWindow::resume_from`].
fn resume_window(w: &WindowState, now_ns: u64) -> AckWindow {
    AckWindow::resume_from(w, now_ns)
}

impl Model {
    /// Records what the libssl hooks could do for process `tgid` (see [`tls::TlsAttach`]).
    pub fn set_tls_attach(&mut self, tgid: u32, a: tls::TlsAttach) {
        self.tls_forgotten.remove(&tgid);
        self.tls_attach.insert(tgid, a);
    }

    /// What the libssl hooks could do for process `tgid`, if the front end reported it.
    pub fn tls_attach(&self, tgid: u32) -> Option<&tls::TlsAttach> {
        self.tls_attach.get(&tgid)
    }

    /// Drops the status of process `tgid` ([`Model::set_tls_attach`]): its process is gone or
    /// no longer watched. While the model still holds sockets of `tgid` (closed sockets stay
    /// until a snapshot reported them, and to the end in `observe`), the status is kept for
    /// their report rows and `tls_processes`, and dropped by [`Model::release_tls_attach`]
    /// once they are gone.
    pub fn forget_tls_attach(&mut self, tgid: u32) {
        if self.sockets.values().any(|s| s.pid == tgid) {
            self.tls_forgotten.insert(tgid);
        } else {
            self.tls_forgotten.remove(&tgid);
            self.tls_attach.remove(&tgid);
        }
    }

    /// Drops the kept status of forgotten processes ([`Model::forget_tls_attach`]) the model
    /// holds no socket of any more. Call after releasing sockets.
    pub fn release_tls_attach(&mut self) {
        let live: BTreeSet<u32> = self.sockets.values().map(|s| s.pid).collect();
        let gone: Vec<u32> = self
            .tls_forgotten
            .iter()
            .copied()
            .filter(|t| !live.contains(t))
            .collect();
        for t in gone {
            self.tls_forgotten.remove(&t);
            self.tls_attach.remove(&t);
        }
    }

    fn socket(&mut self, hdr: &EventHeader) -> &mut SocketModel {
        self.sockets
            .entry(hdr.cookie)
            .or_insert_with(|| SocketModel::new(hdr.cookie, hdr))
    }

    fn note(&mut self, n: ProcessNote) {
        if self.processes.len() == PROCESS_NOTES {
            self.processes.pop_front();
        }
        self.processes.push_back(n);
    }

    /// Rebuilds the model of socket `r.cookie` from the kernel's socket map, for an agent that
    /// continues a pinned set after a restart: link info, roles, header length, unparsed
    /// state and TCP sequence bases from the framing state; message totals from
    /// `DirState::msg_count` (plus one for a message already reported from an EAGAIN send and
    /// not counted there yet, `announced_at`); byte totals from `SockState::msg_bytes`; the
    /// window from `SockState::window`. Ring records of messages up to those totals are then
    /// skipped ([`DirStats::restored_upto`]), so the totals are exact whatever the previous
    /// agent had consumed of the ring. Per-type counts, first and recent messages and the
    /// time statistics start empty. Call [`Model::restored_at`] once every socket is in.
    ///
    /// A value read while the kernel was updating it may be torn; [`crate::loader::Capture::sockets`]
    /// reads until two reads agree, and the message totals stay exact even for a torn read
    /// (`msg_count` and the ring record of each message are written by the same program run,
    /// the count first: whichever the read saw, the record is either counted or skipped).
    pub fn restore(&mut self, r: &Restored, now_ns: u64) {
        let st = &r.state;
        let hdr = EventHeader {
            tgid: st.tgid,
            ts_ns: now_ns,
            cookie: r.cookie,
            ..Default::default()
        };
        let s = self.socket(&hdr);
        s.comm = r.comm.clone();
        s.local = r.local;
        s.remote = r.remote;
        s.tcp = r.tcp;
        let is_tls = st.carrier == carrier::TLS;
        for d in 0..2 {
            let k = &st.dir[d];
            let ds = &mut s.dirs[d];
            ds.role = Role::from_u8(k.role);
            if k.caps_known != 0 {
                // The link message (or reply) was parsed: what its LINK record carried.
                ds.link = Some(LinkEvent {
                    hdr: EventHeader {
                        kind: kind::LINK,
                        dir: d as u8,
                        ..hdr
                    },
                    role: k.role,
                    channel_type: k.channel_type,
                    channel_id: k.channel_id,
                    _pad: 0,
                    link_size: k.link_size,
                    connection_id: k.connection_id,
                    common_caps: k.common_caps,
                    end: 16 + k.link_size as u64,
                });
            }
            ds.hdr_len = k.hdr_len;
            let taken = k.msg_count + u64::from(k.announced_at != 0);
            ds.messages = taken;
            ds.bytes = st.msg_bytes[d];
            ds.derived_bytes = st.msg_bytes[d];
            ds.last_index = taken;
            ds.restored_upto = taken;
            ds.base_index = taken;
            if k.is_unparsed() {
                ds.unparsed = Some(Unparsed {
                    reason: UnparsedReason::from_u8(k.reason),
                    detail: k.detail,
                    at: k.want_at,
                });
            }
            if k.phase() == spice_ebpf_common::framing::Phase::Hunt {
                ds.hunting = Some(Hunting {
                    reason: UnparsedReason::from_u8(k.reason),
                    detail: k.detail,
                    at: k.hunt_from,
                    since_ns: now_ns,
                });
            } else if k.joined != 0 {
                // Locked before the restart: the lock's own record went with the old agent;
                // what the map keeps of it (how, run, where its hunt began) is enough to know
                // the direction counts from a lock and not from its link phase.
                ds.locked = Some(Locked {
                    how: k.how,
                    run: k.run,
                    at: k.hunt_from,
                    index: 1,
                    skipped: 0,
                    channel_mask: k.chain_mask,
                    ts_ns: now_ns,
                    hunted_ns: 0,
                });
            }
            ds.resyncs = k.resyncs;
            ds.unframed = k.unframed;
            if ds.locked.is_some() {
                ds.locks = 1;
            }
            if st.seq_init[d] != 0 && !is_tls {
                ds.seq_base = Some(st.seq_base[d]);
            }
            // The map's byte total runs since the kernel's entry began, before this agent:
            // TCP bytes (a TLS socket's `pos` counts its plaintext, `wire_pos` its TCP bytes).
            let wire = if is_tls { st.wire_pos[d] } else { k.pos };
            ds.traced = traced::TracedBytes::since(wire, now_ns);
            ds.traced.read(wire, now_ns);
            if is_tls {
                // The framing state is the plaintext's; the marks before now are gone.
                ds.tls = Some(tls::TlsDir::restored(k.pos));
            }
        }
        if is_tls {
            s.set_tls(0, now_ns);
        }
        if let Some(i) = s.c2s()
            && let Some(l) = s.dirs[i].link
            && l.channel_type != channel::MAIN
        {
            s.session_id = Some(l.connection_id);
        }
        s.window = resume_window(&st.window, now_ns);
    }

    /// Marks the model as rebuilt from the kernel's map at `now_ns` (after the last
    /// [`Model::restore`]): a socket the map no longer held (destroyed while no agent ran)
    /// whose records in the ring begin before `now_ns` without its SOCKET record is reported
    /// `restarted`, its earlier counts being gone with the old agent.
    pub fn restored_at(&mut self, now_ns: u64) {
        self.restored_ns = Some(now_ns);
    }

    /// Marks `cookie`'s directions unparsed with `reason` (first reason wins).
    fn mark(&mut self, cookie: u64, reason: UnparsedReason) {
        if let Some(s) = self.sockets.get_mut(&cookie) {
            for d in s.dirs.iter_mut() {
                d.unparsed.get_or_insert(Unparsed {
                    reason,
                    detail: 0,
                    at: 0,
                });
            }
        }
    }

    /// A record of a socket not in the model, from before the restart, that is not the
    /// socket's first record: the socket's beginning went with the old agent.
    fn orphan_before_restart(&mut self, ev: &Event) {
        let Some(t) = self.restored_ns else { return };
        let hdr = match ev {
            Event::Link(l) => &l.hdr,
            Event::Message(m) => &m.hdr,
            Event::Unparsed { hdr, .. } => hdr,
            Event::TlsMark(t) => &t.hdr,
            _ => return,
        };
        if hdr.ts_ns >= t || self.sockets.contains_key(&hdr.cookie) {
            return;
        }
        self.socket(hdr);
        self.mark(hdr.cookie, UnparsedReason::Restarted);
        if let (Event::Message(m), Some(s)) = (ev, self.sockets.get_mut(&hdr.cookie)) {
            // Its earlier messages are not lost records: they were the old agent's.
            let ds = &mut s.dirs[(m.hdr.dir & 1) as usize];
            ds.last_index = m.index.saturating_sub(1);
            ds.uncounted = ds.last_index;
        }
    }

    /// Applies one kernel record.
    pub fn apply(&mut self, ev: &Event) {
        self.records += 1;
        if !self.ignored.is_empty() && self.ignored.contains(&ev.header().cookie) {
            return;
        }
        self.orphan_before_restart(ev);
        match ev {
            Event::Socket {
                hdr,
                tid,
                local,
                remote,
                comm,
            } => {
                let s = self.socket(hdr);
                if s.local.is_none() {
                    s.tid = *tid;
                    s.local = Some(*local);
                    s.remote = Some(*remote);
                    s.comm = comm.clone();
                    s.pid = hdr.tgid;
                }
            }
            Event::Link(l) => {
                let s = self.socket(&l.hdr);
                let d = (l.hdr.dir & 1) as usize;
                s.dirs[d].role = Role::from_u8(l.role);
                s.dirs[d].link = Some(*l);
                if s.dirs[d].role == Role::ClientToServer && l.channel_type != channel::MAIN {
                    s.session_id = Some(l.connection_id);
                }
            }
            Event::Message(m) => self.socket(&m.hdr).message(m),
            Event::Unparsed {
                hdr,
                at,
                reason,
                detail,
            } => {
                let s = self.socket(hdr);
                let d = (hdr.dir & 1) as usize;
                s.dirs[d].unparsed.get_or_insert(Unparsed {
                    reason: *reason,
                    detail: *detail,
                    at: *at,
                });
            }
            Event::Hunt(h) => {
                let s = self.socket(&h.hdr);
                let ds = &mut s.dirs[(h.hdr.dir & 1) as usize];
                if ds.role == Role::Unknown {
                    ds.role = Role::from_u8(h.role);
                }
                ds.resyncs = ds.resyncs.max(h.resyncs);
                let mut reason = UnparsedReason::from_u8(h.reason);
                if reason == UnparsedReason::AttachedMidStream
                    && ds
                        .hunting
                        .is_some_and(|x| x.reason == UnparsedReason::Restarted)
                {
                    // A connection an earlier agent was counting (its pinned state could not
                    // be reused): the kernel only knows it is open since before this run.
                    reason = UnparsedReason::Restarted;
                }
                ds.hunting = Some(Hunting {
                    reason,
                    detail: h.detail,
                    at: h.at,
                    since_ns: h.hdr.ts_ns,
                });
                s.joined_resync(h.hdr.ts_ns);
            }
            Event::Lock(l) => {
                let s = self.socket(&l.hdr);
                let ds = &mut s.dirs[(l.hdr.dir & 1) as usize];
                if ds.role == Role::Unknown {
                    ds.role = Role::from_u8(l.role);
                }
                let since = ds.hunting.take().map(|h| h.since_ns).unwrap_or(l.hdr.ts_ns);
                ds.locks += 1;
                ds.resyncs = ds.resyncs.max(l.resyncs);
                ds.unframed += l.skipped;
                ds.hdr_len = l.hdr_len;
                ds.locked = Some(Locked {
                    how: l.how,
                    run: l.run,
                    at: l.at,
                    index: l.index,
                    skipped: l.skipped,
                    channel_mask: l.channel_mask,
                    ts_ns: l.hdr.ts_ns,
                    hunted_ns: l.hdr.ts_ns.saturating_sub(since),
                });
                // Ordinals continue across a resync; the messages of the hunt were never
                // counted, so the next ordinal is no gap.
                ds.last_index = ds.last_index.max(l.index.saturating_sub(1));
            }
            Event::Tls { hdr, func } => self.socket(hdr).set_tls(*func, hdr.ts_ns),
            Event::TlsMark(e) => {
                let s = self.socket(&e.hdr);
                // A mark says the socket carries TLS even if its TLS record was lost.
                s.set_tls(0, e.hdr.ts_ns);
                let d = (e.hdr.dir & 1) as usize;
                if let Some(t) = s.dirs[d].tls.as_mut() {
                    t.push(tls::Mark::of(e));
                }
                s.prune_marks(d);
            }
            Event::Fork { hdr, child, comm } => {
                self.forks += 1;
                self.note(ProcessNote::Forked {
                    ts_ns: hdr.ts_ns,
                    parent: hdr.tgid,
                    child: *child,
                    comm: comm.clone(),
                })
            }
            Event::Exit { hdr } => {
                self.exits += 1;
                self.note(ProcessNote::Exited {
                    ts_ns: hdr.ts_ns,
                    pid: hdr.tgid,
                })
            }
            Event::Close { hdr, tcp, pos } => {
                if let Some(s) = self.sockets.get_mut(&hdr.cookie) {
                    s.closed_ns = Some(hdr.ts_ns);
                    s.tcp = Some(*tcp);
                    // The kernel's entry goes at tcp_destroy_sock: take its byte totals now
                    // (TCP bytes, for a TLS socket too; its plaintext count is its marks').
                    for (ds, &p) in s.dirs.iter_mut().zip(pos) {
                        if ds.traced.total.is_none() {
                            ds.traced = traced::TracedBytes::since(0, s.first_ns);
                        }
                        ds.traced.read(p, hdr.ts_ns);
                    }
                    s.window.finish(hdr.ts_ns);
                }
            }
        }
    }

    /// Lists a connection that was open before observation started: reported with its TCP
    /// state, never framed ([`UnparsedReason::AttachedMidStream`]).
    pub fn add_existing(
        &mut self,
        cookie: u64,
        pid: u32,
        local: SocketAddr,
        remote: SocketAddr,
        now_ns: u64,
    ) {
        self.add_existing_as(
            cookie,
            pid,
            local,
            remote,
            now_ns,
            UnparsedReason::AttachedMidStream,
        )
    }

    /// [`Model::add_existing`] with another reason: [`UnparsedReason::Restarted`] for a
    /// connection an earlier agent was counting, whose pinned state this one could not reuse.
    pub fn add_existing_as(
        &mut self,
        cookie: u64,
        pid: u32,
        local: SocketAddr,
        remote: SocketAddr,
        now_ns: u64,
        reason: UnparsedReason,
    ) {
        let hdr = EventHeader {
            tgid: pid,
            ts_ns: now_ns,
            cookie,
            ..Default::default()
        };
        let s = self.socket(&hdr);
        s.local = Some(local);
        s.remote = Some(remote);
        s.found_by_dump = true;
        for d in s.dirs.iter_mut() {
            if reason == UnparsedReason::AttachedMidStream || reason == UnparsedReason::Restarted {
                // The kernel hunts for its boundaries (`PREEXISTING`); its HUNT record, if
                // any arrives, says the same.
                if d.locked.is_none() {
                    d.hunting.get_or_insert(Hunting {
                        reason,
                        detail: 0,
                        at: 0,
                        since_ns: now_ns,
                    });
                }
            } else {
                d.unparsed.get_or_insert(Unparsed {
                    reason,
                    detail: 0,
                    at: 0,
                });
            }
        }
    }

    /// Marks the open sockets [`SocketModel::found_by_dump`] that `listed` (a sock_diag dump of
    /// the agent's network namespace made at `now_ns`) no longer holds as closed then: a
    /// connection found open at start that closed without a traced call has no close record.
    pub fn gone(&mut self, listed: &dyn Fn(u64) -> bool, now_ns: u64) {
        for s in self.sockets.values_mut() {
            if s.found_by_dump && s.closed_ns.is_none() && !listed(s.cookie) {
                s.closed_ns = Some(now_ns);
                s.window.finish(now_ns);
            }
        }
    }

    /// Hands the model a read of socket `cookie`'s kernel state (`SOCKETS`) made at `read_ns`.
    /// The message and byte totals are taken from it at once (the kernel counts every
    /// message it framed, whether its ring record reached the agent or not): records with an
    /// ordinal up to the read's count add to everything but the totals
    /// ([`DirStats::base_index`]), so a lost record leaves the totals short only until the
    /// next read. The read is also compared with the record-derived window and bytes at once
    /// or when the records it covers have been applied ([`KernelCheck`]); if they differ after
    /// records were lost, the window's counters continue from the kernel's
    /// ([`AckWindow::resync`]). Every direction also takes the kernel's count of all bytes
    /// moved by traced calls, framed or not ([`DirStats::traced`]: TCP bytes, for a TLS socket
    /// `SockState::wire_pos`, whose `DirState::pos` is its plaintext count, kept in
    /// [`DirStats::tls`]); a socket that carried no message takes only that. A socket the
    /// kernel says carries TLS (`SockState::carrier`) becomes one here if its `TLS` record was
    /// lost. Unknown sockets are ignored.
    pub fn kernel_state(&mut self, cookie: u64, st: &SockState, read_ns: u64) {
        if let Some(s) = self.sockets.get_mut(&cookie) {
            let is_tls = st.carrier == carrier::TLS;
            if is_tls {
                // Its TLS record may have been lost: the kernel's state says it too.
                s.set_tls(0, read_ns);
            }
            for (d, (ds, k)) in s.dirs.iter_mut().zip(&st.dir).enumerate() {
                if ds.traced.total.is_none() {
                    // The first read (a restored socket has one from the map): the kernel's
                    // entry began at the socket's first traced call after the agent knew it,
                    // so count from 0 then.
                    ds.traced = traced::TracedBytes::since(0, s.first_ns);
                }
                // TCP bytes: a TLS socket's `pos` counts its plaintext (kept with its marks).
                if is_tls {
                    ds.traced.read(st.wire_pos[d], read_ns);
                    if let Some(t) = ds.tls.as_mut() {
                        t.read_plain(k.pos);
                    }
                } else {
                    ds.traced.read(k.pos, read_ns);
                    // A direction that moved bytes but no message yet (a relay's leg that
                    // has forwarded only the link reply) has its sequence base from the
                    // kernel: the same `write_seq`/`copied_seq` less stream offset that the
                    // message records carry, so its positions can be read before its first
                    // message is.
                    if ds.seq_base.is_none() && st.seq_init[d] != 0 {
                        ds.seq_base = Some(st.seq_base[d]);
                    }
                }
            }
            if st
                .dir
                .iter()
                .all(|d| d.msg_count == 0 && d.announced_at == 0)
                && s.dirs
                    .iter()
                    .all(|d| d.last_index == 0 && d.base_index == 0)
            {
                // No message on either side (hunting, unparsed, not SPICE, or not linked
                // yet): nothing to rebase or compare.
                return;
            }
            let k = KernelRead::new(st, read_ns);
            s.rebase(&k);
            s.kernel.pending = Some(k);
            s.compare_kernel();
        }
    }

    /// Records a TCP state sample read from the kernel map.
    pub fn tcp_sample(&mut self, cookie: u64, snap: TcpSnapshot) {
        if let Some(s) = self.sockets.get_mut(&cookie) {
            let notsent = snap.write_seq.wrapping_sub(snap.snd_nxt);
            if notsent < (1 << 31) {
                s.notsent_max = s.notsent_max.max(notsent);
            }
            s.tcp = Some(snap);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spice_ebpf_common::{event::dir, protocol::msg_client};

    /// One server-end socket (cookie 7; the watched process is spice-server: it reads the
    /// link message, so [`dir::SEND`] is server → client) fed as the kernel feeds the agent:
    /// each message goes through the shared window rule and the message counts of a
    /// [`SockState`] as `capture.rs` applies them, and its record carries the post-state.
    struct Feed {
        m: Model,
        k: SockState,
        channel_type: u8,
    }

    fn hdr(d: u8, ts: u64) -> EventHeader {
        EventHeader {
            dir: d,
            ts_ns: ts,
            cookie: 7,
            tgid: 1,
            ..Default::default()
        }
    }

    impl Feed {
        fn new(channel_type: u8) -> Self {
            let mut m = Model::default();
            m.apply(&Event::Link(LinkEvent {
                hdr: hdr(dir::RECV, 1),
                role: Role::ClientToServer as u8,
                channel_type,
                ..Default::default()
            }));
            m.apply(&Event::Link(LinkEvent {
                hdr: hdr(dir::SEND, 2),
                role: Role::ServerToClient as u8,
                ..Default::default()
            }));
            Feed {
                m,
                k: SockState::default(),
                channel_type,
            }
        }

        /// The kernel applies a message of direction `d` and returns its record (not given to
        /// the model yet).
        fn kernel(&mut self, d: u8, ts: u64, msg_type: u16, prefix: [u32; 2]) -> Event {
            let role = if d == dir::SEND {
                Role::ServerToClient
            } else {
                Role::ClientToServer
            };
            let fx = self
                .k
                .window
                .apply(role as u8, ts, self.channel_type, msg_type, prefix);
            let i = d as usize;
            self.k.dir[i].msg_count += 1;
            self.k.msg_bytes[i] += 6 + 10;
            Event::Message(MessageEvent {
                hdr: hdr(d, ts),
                index: self.k.dir[i].msg_count,
                size: 10,
                msg_type,
                hdr_len: 6,
                prefix,
                win_mw: self.k.window.messages_window,
                win_count: self.k.window.count,
                win_effects: fx,
                ..Default::default()
            })
        }

        fn send(&mut self, d: u8, ts: u64, msg_type: u16, prefix: [u32; 2]) {
            let e = self.kernel(d, ts, msg_type, prefix);
            self.m.apply(&e);
        }

        /// SET_ACK(1, W=2), ACK_SYNC(1), then `types` as server messages.
        fn started(channel_type: u8, types: &[u16]) -> Self {
            let mut f = Feed::new(channel_type);
            f.send(dir::SEND, 10, msg_server::SET_ACK, [1, 2]);
            f.send(dir::RECV, 11, msg_client::ACK_SYNC, [1, 0]);
            for (i, &t) in types.iter().enumerate() {
                f.send(dir::SEND, 20 + i as u64, t, [0, 0]);
            }
            f
        }

        fn socket(&self) -> &SocketModel {
            &self.m.sockets[&7]
        }
    }

    fn tls_mark(d: u8, ts: u64, plain_end: u64, seq: u32, len: u32) -> Event {
        Event::TlsMark(spice_ebpf_common::event::TlsMarkEvent {
            hdr: hdr(d, ts),
            plain_end,
            seq,
            len,
        })
    }

    /// A TLS socket whose TLS record was lost: its first message record (flag
    /// `hdr_flags::TLS`) makes it TLS before any sequence base is taken from its `seq`.
    #[test]
    fn a_tls_message_without_its_tls_record_makes_no_sequence_base() {
        let mut f = Feed::new(channel::DISPLAY);
        let Event::Message(mut m) = f.kernel(dir::SEND, 10, msg_server::SET_ACK, [1, 2]) else {
            unreachable!()
        };
        (m.at, m.seq, m.hdr.flags) = (46, 46, hdr_flags::TLS);
        f.m.apply(&Event::Message(m));
        let sock = f.socket();
        assert_eq!(sock.transport(), "tls");
        assert!(sock.dirs.iter().all(|d| d.seq_base.is_none()));
    }

    /// A TLS socket: its records' `seq` never makes a sequence base, its marks are kept per
    /// direction, its byte totals are TCP bytes (`wire_pos` at the reads, the close
    /// record's `pos`) and its plaintext bytes are counted apart (`DirState::pos`).
    #[test]
    fn a_tls_socket_counts_tcp_bytes_and_plaintext_apart() {
        let mut f = Feed::new(channel::DISPLAY);
        f.m.apply(&Event::Tls {
            hdr: hdr(0, 3),
            func: spice_ebpf_common::event::tls_func::CONTEXT,
        });
        let s = dir::SEND as usize;
        let r = dir::RECV as usize;
        let Event::Message(mut m) = f.kernel(dir::SEND, 10, msg_server::SET_ACK, [1, 2]) else {
            unreachable!()
        };
        (m.at, m.seq) = (46, 0x1234_5678);
        f.m.apply(&Event::Message(m));
        f.m.apply(&tls_mark(dir::SEND, 11, 46 + 14, 4000, 14));
        f.m.apply(&tls_mark(dir::RECV, 12, 46, 900, 46));
        let sock = f.socket();
        assert_eq!(sock.transport(), "tls");
        assert_eq!(
            sock.tls.as_ref().unwrap().func_name(),
            "SSL_do_handshake/SSL_shutdown/SSL_peek"
        );
        assert!(sock.dirs.iter().all(|d| d.seq_base.is_none()));
        let t = sock.dirs[s].tls.as_ref().unwrap();
        assert_eq!((t.calls, t.marks.len(), t.plain_bytes), (1, 1, 60));
        assert_eq!(crate::sampler::stream_pos(&sock.dirs[s], 4000), Some(60));
        assert_eq!(crate::sampler::stream_pos(&sock.dirs[s], 3999), Some(46));
        // A read of the kernel's map: pos is plaintext, wire_pos the TCP bytes.
        f.k.carrier = carrier::TLS;
        f.k.dir[s].pos = 60;
        f.k.dir[r].pos = 46;
        f.k.wire_pos = [3100, 900];
        f.m.kernel_state(7, &f.k, 20);
        let sock = f.socket();
        assert_eq!(sock.dirs[s].traced.total, Some(3100));
        assert_eq!(sock.dirs[r].traced.total, Some(900));
        assert_eq!(sock.dirs[r].tls.as_ref().unwrap().plain_bytes, 46);
        assert_eq!(sock.kernel.compared, 1);
        assert_eq!(sock.kernel.differed, 0, "{:?}", sock.kernel.differences);
        // The close record carries TCP bytes (wire_pos).
        f.m.apply(&Event::Close {
            hdr: hdr(0, 30),
            tcp: TcpSnapshot::default(),
            pos: [3300, 950],
        });
        let sock = f.socket();
        assert_eq!(sock.dirs[s].traced.total, Some(3300));
        assert_eq!(sock.dirs[r].traced.total, Some(950));
        assert_eq!(sock.dirs[s].tls.as_ref().unwrap().plain_bytes, 60);
    }

    /// A socket whose TLS record was lost: the kernel's `carrier` at the next read makes it a
    /// TLS socket and drops the sequence base its records made.
    #[test]
    fn the_kernels_carrier_makes_a_socket_tls() {
        let mut f = Feed::started(channel::DISPLAY, &[302]);
        let s = dir::SEND as usize;
        assert!(f.socket().dirs[s].seq_base.is_some());
        assert_eq!(f.socket().transport(), "tcp");
        f.k.carrier = carrier::TLS;
        f.k.wire_pos = [5000, 700];
        f.m.kernel_state(7, &f.k, 40);
        let sock = f.socket();
        assert_eq!(sock.transport(), "tls");
        assert!(
            sock.dirs
                .iter()
                .all(|d| d.seq_base.is_none() && d.tls.is_some())
        );
        assert_eq!(sock.dirs[s].traced.total, Some(5000));
        // Marks only from now on.
        f.m.apply(&tls_mark(dir::SEND, 41, 100, 9000, 10));
        assert_eq!(f.socket().dirs[s].tls.as_ref().unwrap().calls, 1);
    }

    /// A restarted agent takes over a TLS socket from the pinned map: transport tls, framing
    /// state of the plaintext, byte totals from `wire_pos`, no sequence base (whatever
    /// `seq_base` holds), and no conversion before its first new mark.
    #[test]
    fn restore_of_a_tls_socket() {
        let mut st = SockState {
            carrier: carrier::TLS,
            wire_pos: [80_000, 3_000],
            ..Default::default()
        };
        let s = dir::SEND as usize;
        st.dir[s].pos = 70_000;
        st.dir[s].role = Role::ServerToClient as u8;
        st.dir[s].hdr_len = 6;
        st.dir[s].msg_count = 12;
        st.seq_init = [1, 1];
        st.seq_base = [123, 456];
        let mut m = Model::default();
        m.restore(
            &Restored {
                cookie: 7,
                state: st,
                comm: "Xorg".into(),
                local: None,
                remote: None,
                tcp: None,
            },
            1000,
        );
        let sock = &m.sockets[&7];
        assert_eq!(sock.transport(), "tls");
        assert!(sock.dirs.iter().all(|d| d.seq_base.is_none()));
        assert_eq!(sock.dirs[s].traced.total, Some(80_000));
        assert_eq!(sock.dirs[1].traced.total, Some(3_000));
        let t = sock.dirs[s].tls.as_ref().unwrap();
        assert_eq!((t.plain_bytes, t.before), (70_000, tls::Before::Unknown));
        assert_eq!(sock.dirs[s].messages, 12);
        m.apply(&tls_mark(dir::SEND, 1001, 70_100, 9_000, 100));
        let d = &m.sockets[&7].dirs[s];
        assert_eq!(crate::sampler::stream_pos(d, 8_999), None);
        assert_eq!(crate::sampler::stream_pos(d, 9_000), Some(70_100));
    }

    /// A direction that has moved bytes but carried no message yet (here the link reply only)
    /// takes its sequence base from the kernel's read, so its stream positions are known;
    /// a direction the kernel has not set stays without one.
    #[test]
    fn sequence_base_from_the_kernel_before_the_first_message() {
        let mut f = Feed::new(channel::DISPLAY);
        let s = dir::SEND as usize;
        assert_eq!(f.socket().dirs[s].seq_base, None);
        f.k.dir[s].pos = 178;
        f.k.seq_init = [0, 0];
        f.k.seq_init[s] = 1;
        f.k.seq_base[s] = 4_000_000_000;
        f.m.kernel_state(7, &f.k, 40);
        let sock = f.socket();
        assert_eq!(sock.dirs[s].seq_base, Some(4_000_000_000));
        assert_eq!(sock.dirs[s ^ 1].seq_base, None);
        assert_eq!(
            crate::sampler::stream_pos(&sock.dirs[s], 4_000_000_178),
            Some(178)
        );
    }

    /// Marks of a long run stay few: those below the oldest message that can be in flight
    /// (the newest 2W+2 here, W = 2) are pruned as the messages come; the calls are all
    /// counted.
    #[test]
    fn marks_are_pruned_below_what_can_be_in_flight() {
        let mut f = Feed::new(channel::DISPLAY);
        f.m.apply(&Event::Tls {
            hdr: hdr(0, 3),
            func: spice_ebpf_common::event::tls_func::CONTEXT,
        });
        let (mut at, mut seq) = (46u64, 10_000u32);
        let mut send = |f: &mut Feed, ts: u64, ty: u16, prefix: [u32; 2]| {
            let Event::Message(mut m) = f.kernel(dir::SEND, ts, ty, prefix) else {
                unreachable!()
            };
            m.at = at;
            f.m.apply(&Event::Message(m));
            // Header and body: two SSL_writes.
            for n in [6u64, 10] {
                at += n;
                seq = seq.wrapping_add(n as u32 + 22);
                f.m.apply(&tls_mark(dir::SEND, ts, at, seq, n as u32));
            }
        };
        send(&mut f, 10, msg_server::SET_ACK, [1, 2]);
        f.send(dir::RECV, 11, msg_client::ACK_SYNC, [1, 0]);
        for i in 0..1000u64 {
            send(&mut f, 20 + 2 * i, 302, [0, 0]);
            if i % 2 == 1 {
                f.send(dir::RECV, 21 + 2 * i, msg_client::ACK, [0, 0]);
            }
        }
        let sock = f.socket();
        let t = sock.dirs[dir::SEND as usize].tls.as_ref().unwrap();
        assert_eq!(t.calls, 2002);
        assert_eq!(t.overflowed, 0);
        // 2W+2 = 6 messages of two calls each, and the newest message of the one before.
        assert!(t.marks.len() <= 2 * 6 + 1, "{} marks kept", t.marks.len());
        // Every in-flight message's start still converts exactly.
        let d = &sock.dirs[dir::SEND as usize];
        for m in chain::inflight(sock) {
            let i = t
                .marks
                .iter()
                .position(|k| k.plain_end == m.at + 6)
                .unwrap();
            assert_eq!(
                crate::sampler::stream_pos(d, t.marks[i].seq),
                Some(m.at + 6)
            );
            assert_eq!(
                crate::sampler::stream_pos(d, t.marks[i].seq - 1),
                Some(m.at)
            );
        }
    }

    /// The hook status of a process that went stays while its sockets are in the model (their
    /// rows and `tls_processes` still say what the hooks could do), and goes with them.
    #[test]
    fn tls_status_stays_while_the_processes_sockets_do() {
        let mut f = Feed::new(channel::DISPLAY);
        f.m.set_tls_attach(1, tls::TlsAttach::NoLibrary);
        f.m.set_tls_attach(2, tls::TlsAttach::Disabled);
        f.m.forget_tls_attach(2);
        assert_eq!(f.m.tls_attach(2), None, "no socket of pid 2");
        f.m.forget_tls_attach(1);
        assert_eq!(f.m.tls_attach(1), Some(&tls::TlsAttach::NoLibrary));
        f.m.release_tls_attach();
        assert_eq!(f.m.tls_attach(1), Some(&tls::TlsAttach::NoLibrary));
        // A new process with the same pid reports again: not forgotten any more.
        f.m.set_tls_attach(1, tls::TlsAttach::NoLibrary);
        f.m.sockets.clear();
        f.m.release_tls_attach();
        assert_eq!(f.m.tls_attach(1), Some(&tls::TlsAttach::NoLibrary));
        f.m.forget_tls_attach(1);
        assert!(f.m.tls_attach.is_empty() && f.m.tls_forgotten.is_empty());
        // Forgotten with a socket, released once it is gone.
        let mut g = Feed::new(channel::DISPLAY);
        g.m.set_tls_attach(1, tls::TlsAttach::NoLibrary);
        g.m.forget_tls_attach(1);
        g.m.sockets.clear();
        g.m.release_tls_attach();
        assert!(g.m.tls_attach.is_empty() && g.m.tls_forgotten.is_empty());
    }

    #[test]
    fn inflight_set_holds_the_set_ack_until_the_first_ack() {
        // What chain::inflight() places (README "Stages"): the newest `count` messages.
        let mut f = Feed::started(channel::DISPLAY, &[302, 302, 302]);
        let types = |s: &SocketModel| -> Vec<(u64, u16)> {
            chain::inflight(s)
                .iter()
                .map(|m| (m.index, m.msg_type))
                .collect()
        };
        assert_eq!(
            types(f.socket()),
            [(1, msg_server::SET_ACK), (2, 302), (3, 302), (4, 302)]
        );
        // The first ACK (W = 2) covers the oldest two: the SET_ACK and the first draw.
        f.send(dir::RECV, 100, msg_client::ACK, [0, 0]);
        assert_eq!(types(f.socket()), [(3, 302), (4, 302)]);
    }

    /// A restarted agent: the old model consumed the ring up to some record; the new one
    /// restores from the kernel state (SockState) read while records were still queued, then
    /// gets the ring from before the old agent's last record (one duplicate) on, and new
    /// records after. Its totals, byte totals and window equal those of a model that saw
    /// every record once, and nothing counts as lost.
    #[test]
    fn restore_then_ring_counts_each_message_once() {
        let mut f = Feed::started(channel::DISPLAY, &[302, 302, 302]);
        f.k.dir[dir::RECV as usize].role = Role::ClientToServer as u8;
        f.k.dir[dir::RECV as usize].caps_known = 1;
        f.k.dir[dir::RECV as usize].channel_type = channel::DISPLAY;
        f.k.dir[dir::SEND as usize].role = Role::ServerToClient as u8;
        f.k.dir[dir::SEND as usize].caps_known = 1;
        f.k.dir[dir::SEND as usize].channel_type = channel::DISPLAY;
        // Records the old agent took last (it dies after applying the first), and those
        // still in the ring.
        let mut ring = vec![f.kernel(dir::SEND, 30, 302, [0, 0])];
        f.m.apply(&ring[0]);
        ring.push(f.kernel(dir::RECV, 31, msg_client::ACK, [0, 0]));
        ring.push(f.kernel(dir::SEND, 32, 302, [0, 0]));
        // The new agent reads the map now; two more messages follow before it drains.
        let at_restart = f.k;
        ring.push(f.kernel(dir::SEND, 40, 302, [0, 0]));
        ring.push(f.kernel(dir::RECV, 41, msg_client::ACK, [0, 0]));
        let mut reference = f.m.clone();
        for e in &ring[1..] {
            reference.apply(e);
        }
        let mut m = Model::default();
        m.restore(
            &Restored {
                cookie: 7,
                state: at_restart,
                comm: "Xorg".into(),
                local: None,
                remote: None,
                tcp: None,
            },
            35,
        );
        m.restored_at(35);
        for e in &ring {
            m.apply(e);
        }
        let (a, b) = (&m.sockets[&7], &reference.sockets[&7]);
        for d in 0..2 {
            assert_eq!(a.dirs[d].messages, b.dirs[d].messages, "dir {d}");
            assert_eq!(a.dirs[d].bytes, b.dirs[d].bytes, "dir {d}");
            assert_eq!(a.dirs[d].lost_records, 0);
        }
        assert_eq!(a.dirs[0].messages, 7);
        assert_eq!(a.window.count, b.window.count);
        assert_eq!(a.window.acks, b.window.acks);
        assert_eq!(a.window.window, 2);
        assert_eq!(a.channel(), Some((channel::DISPLAY, 0)));
        assert!(a.unparsed().is_none());
    }

    /// trial2 (tester): README "Restarts and pinned state" says that after a downtime that
    /// filled the ring "the totals and the window, read from the map, stay exact". When the
    /// ring is still full as the new agent reads the map, the kernel drops records of
    /// messages AFTER the totals it read (ordinals > `restored_upto`): the model counts
    /// them in `lost_records` but not in the totals, so `messages_total` stays short of the
    /// kernel's `msg_count` for good (seen on a real Xspice session: 49 + 1 messages short
    /// of the packet capture, `records_lost_total` 50). Expected: the totals equal the
    /// kernel's count (the record's ordinal says how many messages there were).
    #[test]
    fn restore_with_ring_full_after_the_map_read_keeps_totals_exact() {
        let mut f = Feed::started(channel::DISPLAY, &[302, 302, 302]);
        f.k.dir[dir::SEND as usize].role = Role::ServerToClient as u8;
        f.k.dir[dir::SEND as usize].caps_known = 1;
        f.k.dir[dir::RECV as usize].role = Role::ClientToServer as u8;
        f.k.dir[dir::RECV as usize].caps_known = 1;
        f.k.dir[dir::RECV as usize].channel_type = channel::DISPLAY;
        let at_restart = f.k;
        // After the map read: three messages, the middle record dropped (ring full).
        let a = f.kernel(dir::SEND, 40, 302, [0, 0]);
        let _dropped = f.kernel(dir::SEND, 41, 302, [0, 0]);
        let c = f.kernel(dir::SEND, 42, 302, [0, 0]);
        let mut m = Model::default();
        m.restore(
            &Restored {
                cookie: 7,
                state: at_restart,
                comm: "Xorg".into(),
                local: None,
                remote: None,
                tcp: None,
            },
            35,
        );
        m.restored_at(35);
        m.apply(&a);
        m.apply(&c);
        let s = &m.sockets[&7];
        assert_eq!(s.dirs[dir::SEND as usize].lost_records, 1);
        assert_eq!(
            s.dirs[dir::SEND as usize].messages,
            f.k.dir[dir::SEND as usize].msg_count,
            "messages total vs the kernel's msg_count"
        );
    }

    /// Records lost mid-stream between two reads of the kernel's map: the message total is
    /// exact from the next record on (its ordinal), the byte total is short by the lost
    /// records' bytes until the next read, which makes both equal the kernel's; both only
    /// grow (they are Prometheus counters); every loss stays counted.
    #[test]
    fn a_read_after_lost_records_makes_the_totals_the_kernels() {
        let mut f = Feed::started(channel::DISPLAY, &[302, 302]);
        f.m.kernel_state(7, &f.k, 30);
        let s = dir::SEND as usize;
        assert_eq!(f.socket().dirs[s].messages, f.k.dir[s].msg_count);
        // Two draws whose records are lost (ring full), then one that arrives.
        let _lost = [
            f.kernel(dir::SEND, 31, 302, [0, 0]),
            f.kernel(dir::SEND, 32, 302, [0, 0]),
        ];
        f.send(dir::SEND, 33, 302, [0, 0]);
        let before = (f.socket().dirs[s].messages, f.socket().dirs[s].bytes);
        assert_eq!(
            before.0, f.k.dir[s].msg_count,
            "the ordinal bounds the total"
        );
        assert_eq!(
            before.1,
            f.k.msg_bytes[s] - 2 * 16,
            "short by the lost records"
        );
        assert_eq!(f.socket().dirs[s].lost_records, 2);
        // One more message still in the ring when the next read comes.
        let held = f.kernel(dir::SEND, 34, 302, [0, 0]);
        f.m.kernel_state(7, &f.k, 40);
        let d = &f.socket().dirs[s];
        assert_eq!(
            (d.messages, d.bytes),
            (f.k.dir[s].msg_count, f.k.msg_bytes[s])
        );
        assert!(d.messages >= before.0 && d.bytes >= before.1);
        f.m.apply(&held);
        let d = &f.socket().dirs[s];
        assert_eq!(
            (d.messages, d.bytes),
            (f.k.dir[s].msg_count, f.k.msg_bytes[s])
        );
        assert_eq!(d.lost_records, 2);
        // Per-type counts hold the records applied only.
        assert_eq!(d.by_type[&302].0, 4);
        let r = dir::RECV as usize;
        let d = &f.socket().dirs[r];
        assert_eq!(
            (d.messages, d.bytes),
            (f.k.dir[r].msg_count, f.k.msg_bytes[r])
        );
    }

    /// Records of messages the kernel had counted at a read (ordinal ≤ the read's count)
    /// that arrive after it: not counted again in the totals, but in the per-type counts and
    /// the window, and the read compares equal once they are in.
    #[test]
    fn records_up_to_a_read_arriving_after_it_are_not_counted_twice() {
        let mut f = Feed::started(channel::DISPLAY, &[302]);
        let held = [
            f.kernel(dir::SEND, 30, 302, [0, 0]),
            f.kernel(dir::RECV, 31, msg_client::ACK, [0, 0]),
            f.kernel(dir::SEND, 32, 302, [0, 0]),
        ];
        f.m.kernel_state(7, &f.k, 40);
        let totals = |f: &Feed| {
            let s = f.socket();
            [0, 1].map(|d| (s.dirs[d].messages, s.dirs[d].bytes))
        };
        let kernel = [0, 1].map(|d| (f.k.dir[d].msg_count, f.k.msg_bytes[d]));
        assert_eq!(totals(&f), kernel);
        for e in &held {
            f.m.apply(e);
            assert_eq!(totals(&f), kernel);
        }
        let s = f.socket();
        assert_eq!(s.dirs[dir::SEND as usize].by_type[&302].0, 3);
        assert_eq!(s.window.acks, 1);
        assert_eq!(s.lost_records(), 0);
        assert_eq!((s.kernel.compared, s.kernel.differed), (1, 0));
        // A message after the read counts once.
        f.send(dir::SEND, 50, 302, [0, 0]);
        let s = f.socket();
        let d = dir::SEND as usize;
        assert_eq!(s.dirs[d].messages, f.k.dir[d].msg_count);
        assert_eq!(s.dirs[d].bytes, f.k.msg_bytes[d]);
    }

    /// A lost ACK record (the one that ended a stall): the first read after the gap shows
    /// (the next record of its direction) differs, and the window continues from the
    /// kernel's counters; the next read agrees. A lost record that is the newest at a read
    /// leaves that read uncompared (the model jumps past it).
    #[test]
    fn lost_window_records_resync_the_window_counters() {
        // W = 2: SET_ACK and four draws put 5 = 2W+1 in flight (stalled).
        let mut f = Feed::started(channel::DISPLAY, &[302, 302, 302, 302]);
        assert!(f.socket().window.stalled());
        let _lost = f.kernel(dir::RECV, 40, msg_client::ACK, [0, 0]);
        f.m.kernel_state(7, &f.k, 41);
        assert_eq!(f.socket().kernel.compared, 0);
        f.send(dir::RECV, 42, msg_client::ACK, [0, 0]);
        assert_eq!(f.socket().kernel.pending, None, "jumped past");
        f.m.kernel_state(7, &f.k, 43);
        let k = &f.socket().kernel;
        assert_eq!((k.compared, k.differed, k.resynced), (1, 1, 1));
        assert_eq!(k.differences, ["acks", "stall_began_ns", "bytes_received"]);
        let w = &f.socket().window;
        assert_eq!((w.acks, w.count, w.messages_window), (2, 1, 1));
        assert!(!w.stalled() && w.stall_began_ns.is_none());
        assert!(w.differences(&f.k.window).is_empty());
        // Records after it continue from the kernel's state: the next read agrees.
        f.send(dir::SEND, 50, 302, [0, 0]);
        f.send(dir::SEND, 51, 302, [0, 0]);
        f.send(dir::RECV, 52, msg_client::ACK, [0, 0]);
        f.m.kernel_state(7, &f.k, 60);
        let k = &f.socket().kernel;
        assert_eq!((k.compared, k.differed, k.resynced), (2, 1, 1));
        assert_eq!(f.socket().window.acks, 3);
        assert_eq!(f.socket().lost_records(), 1);
        // A difference without a lost record is shown, not taken over.
        let mut g = Feed::started(channel::DISPLAY, &[302]);
        g.k.window.acks += 1;
        g.m.kernel_state(7, &g.k, 70);
        let k = &g.socket().kernel;
        assert_eq!((k.compared, k.differed, k.resynced), (1, 1, 0));
        assert_eq!(g.socket().window.acks, 0);
    }

    /// A socket unknown at the restore (destroyed while no agent ran) whose first record in
    /// the ring predates the restore and is not its SOCKET record: reported `restarted`,
    /// no lost records.
    #[test]
    fn orphan_records_before_a_restore_are_restarted() {
        let mut m = Model::default();
        m.restored_at(100);
        m.apply(&Event::Message(MessageEvent {
            hdr: hdr(dir::SEND, 50),
            index: 40,
            hdr_len: 6,
            msg_type: 302,
            ..Default::default()
        }));
        let s = &m.sockets[&7];
        assert_eq!(
            s.unparsed().map(|u| u.reason),
            Some(UnparsedReason::Restarted)
        );
        assert_eq!(s.lost_records(), 0);
    }

    #[test]
    fn kernel_reads_are_compared_once_the_records_catch_up() {
        let mut f = Feed::started(channel::DISPLAY, &[302, 302]);
        // Two records still in the ring when the kernel state is read.
        let held = [
            f.kernel(dir::SEND, 30, 302, [0, 0]),
            f.kernel(dir::RECV, 31, msg_client::ACK, [0, 0]),
        ];
        f.m.kernel_state(7, &f.k, 40);
        assert_eq!(f.socket().kernel.compared, 0);
        assert!(f.socket().kernel.pending.is_some());
        f.m.apply(&held[0]);
        assert_eq!(f.socket().kernel.compared, 0);
        f.m.apply(&held[1]);
        let k = &f.socket().kernel;
        assert_eq!((k.compared, k.differed, k.pending), (1, 0, None));
        assert_eq!(k.last.unwrap().window.acks, 1);
        // A message an EAGAIN send reported early: applied and recorded with the next index,
        // DirState::msg_count not advanced yet.
        let early = f.kernel(dir::SEND, 50, 302, [0, 0]);
        f.k.dir[dir::SEND as usize].msg_count -= 1;
        f.k.dir[dir::SEND as usize].announced_at = 1234;
        f.m.apply(&early);
        f.m.kernel_state(7, &f.k, 51);
        assert_eq!(
            (f.socket().kernel.compared, f.socket().kernel.differed),
            (2, 0)
        );
    }

    #[test]
    fn a_lost_record_makes_the_kernel_read_differ_or_drops_it() {
        let mut f = Feed::started(channel::DISPLAY, &[302, 302]);
        // The kernel applies a draw whose record is lost, then another that arrives.
        let _lost = f.kernel(dir::SEND, 30, 302, [0, 0]);
        f.send(dir::SEND, 31, 302, [0, 0]);
        f.m.kernel_state(7, &f.k, 40);
        let k = &f.socket().kernel;
        assert_eq!((k.compared, k.differed), (1, 1));
        assert_eq!(
            k.differences,
            ["messages_after_set_ack", "bytes_sent"],
            "{:?} vs {:?}",
            f.socket().window,
            f.k.window
        );
        // A read taken while the host is behind, whose next record is lost: the host jumps
        // past it, and the read is dropped uncompared.
        let _lost = f.kernel(dir::SEND, 50, 302, [0, 0]);
        f.m.kernel_state(7, &f.k, 51);
        f.send(dir::SEND, 52, 302, [0, 0]);
        let k = &f.socket().kernel;
        assert_eq!((k.compared, k.pending), (1, None));
    }

    /// A joined socket that never locks (hunting, or not SPICE): the kernel's byte count of
    /// each direction is taken at every read and its rates derived, counted from when the
    /// agent found the socket; nothing is rebased or compared (no message on either side).
    /// A restored socket counts its rates from the map's value at the restore.
    #[test]
    fn kernel_reads_give_every_socket_its_traced_bytes() {
        let mut m = Model::default();
        let a: SocketAddr = "127.0.0.1:5900".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        m.add_existing(7, 1, a, b, 1_000_000_000);
        let mut k = SockState::default();
        let s = dir::SEND as usize;
        let r = dir::RECV as usize;
        for (i, ms) in [1500u64, 2000, 2500, 3000].into_iter().enumerate() {
            k.dir[s].pos = 250_000 * (i as u64 + 1);
            k.dir[r].pos = 1000 * (i as u64 + 1);
            m.kernel_state(7, &k, ms * 1_000_000);
        }
        let sock = &m.sockets[&7];
        assert_eq!(sock.framing(), "hunting");
        let w = &sock.dirs[s].traced;
        assert_eq!(w.total, Some(1_000_000));
        // 1 MB from 1.0 s to 3.0 s; the newest second, 2.0 s to 3.0 s: 500 kB.
        assert_eq!(w.rate_mean(), Some(500_000.0));
        assert_eq!(w.rate_now(), Some(500_000.0));
        assert_eq!(sock.dirs[r].traced.total, Some(4000));
        assert_eq!(sock.dirs[s].messages, 0);
        assert_eq!((sock.kernel.compared, sock.kernel.last), (0, None));
        // Restored from pinned state: 5 MB moved before this agent.
        let mut k2 = k;
        k2.dir[s].pos = 5_000_000;
        let mut m2 = Model::default();
        m2.restore(
            &Restored {
                cookie: 8,
                state: k2,
                comm: "Xorg".into(),
                local: None,
                remote: None,
                tcp: None,
            },
            10_000_000_000,
        );
        k2.dir[s].pos = 6_000_000;
        m2.kernel_state(8, &k2, 12_000_000_000);
        let t = &m2.sockets[&8].dirs[s].traced;
        assert_eq!(t.total, Some(6_000_000));
        assert_eq!(t.rate_mean(), Some(500_000.0));
        // A framed socket's reads carry its traced bytes too.
        let mut f = Feed::started(channel::DISPLAY, &[302]);
        f.k.dir[s].pos = 4242;
        f.m.kernel_state(7, &f.k, 50);
        assert_eq!(f.socket().dirs[s].traced.total, Some(4242));
        assert_eq!(f.socket().kernel.compared, 1);
    }
}
