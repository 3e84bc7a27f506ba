//! Channel identity of a socket whose link phase was not seen (joined mid-stream): the channel
//! type and the SPICE role of each direction, inferred from the message types each direction
//! carries, and the grouping of one client's sockets into a session.
//!
//! Pure logic over counts the model keeps ([`super::DirStats::by_type`],
//! [`super::DirStats::sizes`], the lock's channel mask [`super::Locked::channel_mask`]).
//!
//! # Channel type
//! Every hypothesis "this socket is channel type `c`, with these roles" is checked against
//! every message type seen, in both directions:
//! - **Fit.** A type (with the smallest and largest body size seen for it) must be valid for
//!   `c` in its direction: [`s2c_channels`] / [`c2s_channels`], the tables the kernel hunts
//!   with (`docs/spice-protocol.md` §2.2–§2.5, `spice.proto`), and the fixed bodies of
//!   channel messages ([`size_fits`]: cursor MOVE 4 bytes, MOUSE_MOTION_ACK empty, …). In
//!   addition, SET_ACK (S→C 3),
//!   ACK_SYNC (C→S 1) and ACK (C→S 2) exist only on display and cursor connections:
//!   spice-server sends SET_ACK only there, and a client ACKs only after a SET_ACK (§3.1,
//!   `dcc.cpp` `dcc_start`, `CursorChannel::on_connect`). One message that does not fit rules
//!   `c` out. So does the lock's channel mask (the channel types every header of the chain the
//!   kernel locked on fits; those headers are not counted as messages).
//! - **Support.** Messages that are the recurring traffic of `c` ([`characteristic`]: display
//!   draws and streams, cursor SET/MOVE/HIDE, inputs key and mouse messages and
//!   MOUSE_MOTION_ACK, main's agent, mouse-mode, channels-list and multimedia-time messages,
//!   playback and record DATA, the data channels' DATA) count for `c`. Message numbers
//!   overlap between channels (S→C 101–108 exist on main, display, cursor, playback, …), so
//!   a number that fits several channels supports only those whose recurring message it is:
//!   a stream of size-4 S→C 104 messages fits main (CHANNELS_LIST, sent once), display
//!   (COPY_BITS), cursor (MOVE) and record (MUTE), and supports cursor only.
//!
//! The type is decided only when exactly one candidate fits everything, or when exactly one
//! fitting candidate has at least [`MIN_SUPPORT`] supporting messages and no other fitting
//! candidate has any. Otherwise it stays unknown, and the evidence says why.
//!
//! # Roles
//! The kernel's hint (how the socket was made: accepted from a listener or connected,
//! `spice_ebpf_common::config::preexisting`) gives the roles of a joined socket. When it is
//! missing ([`Role::Unknown`]) both assignments are tried with the rules above; roles are
//! decided when only one assignment lets some channel type fit everything seen, e.g. draws
//! (302–322) exist only server → client, PONG with 12 bytes only client → server.
//!
//! # Sessions
//! [`sessions`] groups server-end sockets of one process by the client's IP address around
//! the one main channel among them (spice-server lets one client in at a time by default,
//! §5.4). The session id itself (MAIN_INIT's, or a link message's connection_id) is never
//! inferred.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
};

use spice_ebpf_common::{
    framing::Role,
    protocol::{
        ALL_CHANNELS, c2s_channels, channel, channel_bit, channel_type_name, message_name,
        s2c_channels,
    },
};

use super::{DirStats, Model, SocketModel};

/// Supporting messages a decision by support needs when other channel types also fit: one
/// or two could be a once-per-connection message of another candidate (a CHANNELS_LIST, a
/// seamless-migration message).
pub const MIN_SUPPORT: u64 = 3;

/// Channel types considered: every type of [`channel`] but tunnel (7, obsolete, not in
/// spice-server, `docs/spice-protocol.md` §2.1).
const CANDIDATES: u16 = ALL_CHANNELS & !channel_bit(channel::TUNNEL);

/// Channels with an ACK window: the only ones with SET_ACK, ACK_SYNC and ACK (§3.1).
const ACK_CHANNELS: u16 = channel_bit(channel::DISPLAY) | channel_bit(channel::CURSOR);

/// One message type seen in one direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TypeSeen {
    pub msg_type: u16,
    /// Messages of this type.
    pub count: u64,
    /// Smallest and largest body size seen (bytes, header excluded).
    pub min_size: u32,
    pub max_size: u32,
}

/// What one direction of a socket showed, as the inference reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DirEvidence {
    /// The role the kernel or the link phase gave ([`Role::Unknown`] if none).
    pub role: Role,
    pub types: Vec<TypeSeen>,
    /// [`super::Locked::channel_mask`] of the newest lock, if the direction locked.
    pub lock_mask: Option<u16>,
}

impl DirEvidence {
    /// From a direction's counts: types from [`DirStats::by_type`] with their size ranges
    /// from [`DirStats::sizes`] (a type without a range is read as sizes 0..=u32::MAX, which
    /// fits only the types that accept any size).
    pub fn from_dir(d: &DirStats) -> Self {
        DirEvidence {
            role: d.role,
            types: d
                .by_type
                .iter()
                .filter(|(_, (n, _))| *n > 0)
                .map(|(&t, &(n, _))| {
                    let (lo, hi) = d.sizes.get(&t).copied().unwrap_or((0, u32::MAX));
                    TypeSeen {
                        msg_type: t,
                        count: n,
                        min_size: lo,
                        max_size: hi,
                    }
                })
                .collect(),
            lock_mask: d.locked.map(|l| l.channel_mask),
        }
    }

    fn messages(&self) -> u64 {
        self.types.iter().map(|t| t.count).sum()
    }
}

/// What the inference found for one socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inference {
    /// The channel type ([`channel`]), when the evidence decides it.
    pub channel_type: Option<u8>,
    /// Role of each direction (index as [`super::SocketModel::dirs`]): the given one, or the
    /// inferred one, or [`Role::Unknown`].
    pub roles: [Role; 2],
    /// Some role in [`Self::roles`] was inferred (not given by the kernel or the link).
    pub roles_inferred: bool,
    /// Channel types that fit every message seen under [`Self::roles`] (bit `1 << type`); 0
    /// when the roles are not decided.
    pub fitting: u16,
    /// Why: what decided, or why nothing could be decided. One line.
    pub evidence: String,
}

/// Whether channel type `c`'s message `t` in direction `role` can have a body of `size` bytes:
/// the fixed bodies of channel messages (`docs/spice-protocol.md` §2.3–§2.5, `spice.proto`),
/// which the kernel's hunting tables leave out (they check the base messages' sizes only,
/// [`s2c_channels`] / [`c2s_channels`]). Server → client: main MIGRATE_CANCEL,
/// AGENT_CONNECTED, MIGRATE_END, MIGRATE_DST_SEAMLESS_ACK/NACK empty, INIT 32 bytes,
/// AGENT_DATA ≤ 2048; display MARK, RESET, INVAL_ALL_PALETTES, STREAM_DESTROY_ALL empty,
/// INVAL_PALETTE 8, STREAM_DESTROY 4; cursor RESET, HIDE, INVAL_ALL empty, MOVE 4,
/// INVAL_ONE 8; inputs MOUSE_MOTION_ACK empty; playback STOP and record STOP empty. Client →
/// server: main ATTACH_CHANNELS empty, display INIT 14, inputs KEY_DOWN / KEY_UP 4.
pub fn size_fits(c: u8, role: Role, t: u16, size: u32) -> bool {
    use channel::*;
    let want = |n: u32| size == n;
    match role {
        Role::ServerToClient => match (c, t) {
            (MAIN, 102 | 107 | 112 | 117 | 118) => want(0),
            (MAIN, 103) => want(32),
            (MAIN, 109) => size <= 2048,
            (DISPLAY, 102 | 103 | 108 | 126) => want(0),
            (DISPLAY, 107) => want(8),
            (DISPLAY, 125) => want(4),
            (CURSOR, 102 | 105 | 108) => want(0),
            (CURSOR, 104) => want(4),
            (CURSOR, 107) => want(8),
            (INPUTS, 111) => want(0),
            (PLAYBACK, 104) => want(0),
            (RECORD, 102) => want(0),
            _ => true,
        },
        Role::ClientToServer => match (c, t) {
            (MAIN, 104) => want(0),
            (DISPLAY, 101) => want(14),
            (INPUTS, 101 | 102) => want(4),
            _ => true,
        },
        Role::Unknown => false,
    }
}

/// `t`'s mask in direction `role` for body sizes `lo..=hi`: the channel types for which the
/// header is valid with both the smallest and the largest size ([`s2c_channels`] /
/// [`c2s_channels`] and [`size_fits`]; every size constraint is an equality or a bound, so
/// both ends fitting means every size between fits), and the ACK-window rule.
fn fit(role: Role, t: &TypeSeen) -> u16 {
    let table = |size| match role {
        Role::ServerToClient => s2c_channels(t.msg_type, size),
        Role::ClientToServer => c2s_channels(t.msg_type, size),
        Role::Unknown => 0,
    };
    let mut m = table(t.min_size) & table(t.max_size) & CANDIDATES;
    for c in 1..16u8 {
        if m & channel_bit(c) != 0
            && !(size_fits(c, role, t.msg_type, t.min_size)
                && size_fits(c, role, t.msg_type, t.max_size))
        {
            m &= !channel_bit(c);
        }
    }
    let ack_only = match role {
        Role::ServerToClient => t.msg_type == 3,
        Role::ClientToServer => t.msg_type == 1 || t.msg_type == 2,
        Role::Unknown => false,
    };
    if ack_only {
        m &= ACK_CHANNELS;
    }
    m
}

/// Whether `t` in direction `role` is recurring traffic of channel type `c` (it must also
/// [`fit`]): what the channel carries while it is in use, as opposed to its start-up and
/// migration messages (`docs/spice-protocol.md` §2.3–§2.5, `spice.proto`).
pub fn characteristic(c: u8, role: Role, t: &TypeSeen) -> bool {
    use channel::*;
    let s2c = role == Role::ServerToClient;
    let ty = t.msg_type;
    match c {
        // Draws, surfaces, monitors config, GL (302–322), video streams (122–126), COPY_BITS
        // (DisplayBase 21 bytes + a point: at least 29).
        DISPLAY => s2c && (matches!(ty, 122..=126 | 302..=322) || ty == 104 && t.min_size >= 29),
        // SET, MOVE (x, y: 4 bytes), HIDE (empty).
        CURSOR => {
            s2c && (ty == 103
                || (ty == 104 && t.min_size == 4 && t.max_size == 4)
                || (ty == 105 && t.max_size == 0))
        }
        // Client: KEY_DOWN, KEY_UP, KEY_MODIFIERS, KEY_SCANCODE, MOUSE_MOTION,
        // MOUSE_POSITION, MOUSE_PRESS, MOUSE_RELEASE. Server: MOUSE_MOTION_ACK (empty).
        INPUTS => {
            if s2c {
                ty == 111 && t.max_size == 0
            } else {
                matches!(ty, 101..=104 | 111..=114)
            }
        }
        // Server: CHANNELS_LIST (count u32 + (type, id) pairs: at least 6 bytes), MOUSE_MODE,
        // MULTI_MEDIA_TIME, AGENT_CONNECTED, AGENT_DISCONNECTED, AGENT_DATA, AGENT_TOKEN,
        // AGENT_CONNECTED_TOKENS. Client: ATTACH_CHANNELS, MOUSE_MODE_REQUEST, AGENT_START,
        // AGENT_DATA, AGENT_TOKEN.
        MAIN => {
            if s2c {
                ty == 104 && t.min_size >= 6 || matches!(ty, 105..=110 | 115)
            } else {
                matches!(ty, 104..=108)
            }
        }
        // Server: DATA (time u32 + audio), START, STOP, LATENCY.
        PLAYBACK => s2c && (ty == 101 && t.min_size >= 4 || matches!(ty, 103 | 104 | 107)),
        // Client: DATA, START_MARK (the server's START, STOP, VOLUME, MUTE are control).
        RECORD => !s2c && matches!(ty, 101 | 103),
        // DATA both ways.
        SMARTCARD => ty == 101,
        // DATA, COMPRESSED_DATA both ways; port's INIT / EVENT.
        USBREDIR | WEBDAV => matches!(ty, 101 | 102),
        PORT => matches!(ty, 101 | 102 | 201 | 202),
        _ => false,
    }
}

/// The name of `t` in `c`'s table (base messages whatever `c`), else its number.
fn type_label(c: Option<u8>, role: Role, t: u16) -> String {
    let s2c = role == Role::ServerToClient;
    let c = if t < 101 { Some(channel::MAIN) } else { c };
    match c.and_then(|c| message_name(c, s2c, t)) {
        Some(n) => format!("{n} ({t})"),
        None => format!("type {t}"),
    }
}

fn dir_label(role: Role) -> &'static str {
    match role {
        Role::ServerToClient => "server→client",
        Role::ClientToServer => "client→server",
        Role::Unknown => "unknown direction",
    }
}

fn names(mask: u16) -> String {
    if mask & CANDIDATES == CANDIDATES {
        return "every channel type".into();
    }
    let v: Vec<&str> = (1..16u8)
        .filter(|&c| mask & channel_bit(c) != 0)
        .map(channel_type_name)
        .collect();
    v.join(", ")
}

/// The result of checking every channel type under one role assignment.
#[derive(Clone, Debug)]
struct Hypothesis {
    roles: [Role; 2],
    /// Channel types that fit every message and lock mask.
    fitting: u16,
    /// Supporting messages per channel type (index = type).
    support: [u64; 16],
    /// The first message type (direction, role, type) that rules all out, for the evidence.
    misfit: Option<(usize, TypeSeen)>,
}

fn check(dirs: &[DirEvidence; 2], roles: [Role; 2]) -> Hypothesis {
    let mut fitting = CANDIDATES;
    let mut support = [0u64; 16];
    let mut misfit = None;
    for (d, e) in dirs.iter().enumerate() {
        if let Some(m) = e.lock_mask
            && m != 0
        {
            fitting &= m;
        }
        for t in &e.types {
            let m = fit(roles[d], t);
            if m == 0 && misfit.is_none() {
                misfit = Some((d, *t));
            }
            fitting &= m;
            for c in 1..16u8 {
                if m & channel_bit(c) != 0 && characteristic(c, roles[d], t) {
                    support[c as usize] += t.count;
                }
            }
        }
    }
    Hypothesis {
        roles,
        fitting,
        support,
        misfit,
    }
}

/// Lists the supporting message types of `c` ("MOVE (104) ×40 server→client, …").
fn support_text(dirs: &[DirEvidence; 2], roles: [Role; 2], c: u8) -> String {
    let mut parts = Vec::new();
    for (d, e) in dirs.iter().enumerate() {
        let mut ts: Vec<&TypeSeen> = e
            .types
            .iter()
            .filter(|t| fit(roles[d], t) & channel_bit(c) != 0 && characteristic(c, roles[d], t))
            .collect();
        ts.sort_by_key(|t| std::cmp::Reverse(t.count));
        for t in ts.iter().take(4) {
            parts.push(format!(
                "{} ×{} {}",
                type_label(Some(c), roles[d], t.msg_type),
                t.count,
                dir_label(roles[d])
            ));
        }
        if ts.len() > 4 {
            parts.push(format!(
                "{} more type(s) {}",
                ts.len() - 4,
                dir_label(roles[d])
            ));
        }
    }
    parts.join(", ")
}

/// Decides the channel type under fixed roles; returns (type, evidence).
fn decide(dirs: &[DirEvidence; 2], h: &Hypothesis) -> (Option<u8>, String) {
    let seen: u64 = dirs.iter().map(DirEvidence::messages).sum();
    let fitting: Vec<u8> = (1..16u8)
        .filter(|&c| h.fitting & channel_bit(c) != 0)
        .collect();
    if fitting.is_empty() {
        return (
            None,
            match h.misfit {
                Some((d, t)) => format!(
                    "type {} ({} bytes) {} fits no channel type",
                    t.msg_type,
                    t.min_size,
                    dir_label(h.roles[d])
                ),
                None => "the messages seen fit no single channel type".into(),
            },
        );
    }
    if seen == 0 {
        return (None, "no message framed yet".into());
    }
    if let [c] = fitting[..] {
        let sup = support_text(dirs, h.roles, c);
        let name = channel_type_name(c);
        let why = if sup.is_empty() {
            format!("only {name} fits every message seen")
        } else {
            format!("{sup}: only {name} fits every message seen")
        };
        return (Some(c), why);
    }
    let supported: Vec<u8> = fitting
        .iter()
        .copied()
        .filter(|&c| h.support[c as usize] > 0)
        .collect();
    match supported[..] {
        [c] if h.support[c as usize] >= MIN_SUPPORT => {
            let others = h.fitting & !channel_bit(c);
            (
                Some(c),
                format!(
                    "{}: {}'s recurring traffic; {} also fit, without any of their recurring messages",
                    support_text(dirs, h.roles, c),
                    channel_type_name(c),
                    names(others)
                ),
            )
        }
        [c] => (
            None,
            format!(
                "{} message(s) of {}'s recurring traffic ({}), fewer than {MIN_SUPPORT}; also fits {}",
                h.support[c as usize],
                channel_type_name(c),
                support_text(dirs, h.roles, c),
                names(h.fitting & !channel_bit(c))
            ),
        ),
        [] => {
            let mut labels = BTreeSet::new();
            for (d, e) in dirs.iter().enumerate() {
                for t in &e.types {
                    labels.insert(format!(
                        "{} {}",
                        type_label(None, h.roles[d], t.msg_type),
                        dir_label(h.roles[d])
                    ));
                }
            }
            (
                None,
                format!(
                    "no message distinctive of a channel type ({}); fits {}",
                    labels.into_iter().collect::<Vec<_>>().join(", "),
                    names(h.fitting)
                ),
            )
        }
        _ => {
            let mut why = String::from("ambiguous: ");
            for (i, &c) in supported.iter().enumerate() {
                if i > 0 {
                    why.push_str("; ");
                }
                let _ = write!(
                    why,
                    "{} ({})",
                    channel_type_name(c),
                    support_text(dirs, h.roles, c)
                );
            }
            (None, why)
        }
    }
}

/// Infers the channel type, and the roles where they are not given, of a socket whose link
/// phase was not seen, from what its two directions carried (index as
/// [`super::SocketModel::dirs`]).
pub fn infer(dirs: &[DirEvidence; 2]) -> Inference {
    let given = [dirs[0].role, dirs[1].role];
    let opposite = |r: Role| match r {
        Role::ServerToClient => Role::ClientToServer,
        Role::ClientToServer => Role::ServerToClient,
        Role::Unknown => Role::Unknown,
    };
    let assignments: Vec<[Role; 2]> = match given {
        [Role::Unknown, Role::Unknown] => vec![
            [Role::ServerToClient, Role::ClientToServer],
            [Role::ClientToServer, Role::ServerToClient],
        ],
        [Role::Unknown, r] => vec![[opposite(r), r]],
        [r, Role::Unknown] => vec![[r, opposite(r)]],
        r => vec![r],
    };
    let inferred_roles = given.contains(&Role::Unknown);
    let hyps: Vec<Hypothesis> = assignments.iter().map(|&r| check(dirs, r)).collect();
    let viable: Vec<&Hypothesis> = hyps.iter().filter(|h| h.fitting != 0).collect();
    let h = match viable[..] {
        [h] => h,
        [] => {
            // Nothing fits under any assignment: report the given (or first) one's misfit.
            let (_, why) = decide(dirs, &hyps[0]);
            return Inference {
                channel_type: None,
                roles: given,
                roles_inferred: false,
                fitting: 0,
                evidence: why,
            };
        }
        _ => {
            let seen: u64 = dirs.iter().map(DirEvidence::messages).sum();
            return Inference {
                channel_type: None,
                roles: given,
                roles_inferred: false,
                fitting: 0,
                evidence: if seen == 0 {
                    "no message framed yet".into()
                } else {
                    "roles unknown: the messages seen fit either direction".into()
                },
            };
        }
    };
    let (c, mut why) = decide(dirs, h);
    if inferred_roles {
        let d = h
            .roles
            .iter()
            .position(|&r| r == Role::ServerToClient)
            .unwrap_or(0);
        let _ = write!(
            why,
            "; roles inferred (direction {} carries server→client messages)",
            if d == 0 { "sent" } else { "received" }
        );
    }
    Inference {
        channel_type: c,
        roles: h.roles,
        roles_inferred: inferred_roles,
        fitting: h.fitting,
        evidence: why,
    }
}

/// A socket's inferred membership in a client's session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionGuess {
    /// The session's main channel socket (`"laddr->raddr"` as in the report's `socket`).
    pub key: String,
    /// The grouping rests on the client address (not on equal known session ids).
    pub inferred: bool,
    /// Why, one line.
    pub evidence: String,
}

fn sock_name(s: &SocketModel) -> String {
    match (s.local, s.remote) {
        (Some(l), Some(r)) => format!("{l}->{r}"),
        _ => format!("cookie:{}", s.cookie),
    }
}

/// Groups the sockets of each client into sessions, by socket cookie:
/// - sockets of one process with the same known session id ([`SocketModel::session_id`]:
///   MAIN_INIT's, or a link message's connection_id) and a main channel among them: not
///   inferred;
/// - open server-end sockets of one process (spice-server, or a relay's client-facing legs)
///   whose SPICE framing was found (a channel type, known or inferred, or boundaries in some
///   direction) and whose client has one IP address: grouped around the one main channel
///   (known or inferred) among them. spice-server admits one client at a time unless told
///   otherwise, so all of them belong to it (`docs/spice-protocol.md` §5.4); two main
///   channels from one address (several clients, or a reconnect not closed yet) leave the
///   group ungrouped. Inferred.
///
/// A socket with a known session id is never grouped with a main channel whose known id
/// differs.
pub fn sessions(model: &Model) -> BTreeMap<u64, SessionGuess> {
    let mut out = BTreeMap::new();
    let is_main = |s: &SocketModel| s.channel_type().map(|c| c.ty) == Some(channel::MAIN);
    // Known ids.
    // (process, end, session id) → main channels with that id.
    type IdKey = (u32, Option<bool>, u32);
    let mut mains_by_id: BTreeMap<IdKey, Vec<&SocketModel>> = BTreeMap::new();
    for s in model.sockets.values() {
        if let Some(id) = s.session_id
            && s.channel().map(|c| c.0) == Some(channel::MAIN)
        {
            let k = (s.pid, s.is_server_end(), id);
            mains_by_id.entry(k).or_default().push(s);
        }
    }
    for s in model.sockets.values() {
        if let Some(id) = s.session_id
            && let Some([m]) = mains_by_id
                .get(&(s.pid, s.is_server_end(), id))
                .map(|v| &v[..])
        {
            out.insert(
                s.cookie,
                SessionGuess {
                    key: sock_name(m),
                    inferred: false,
                    evidence: format!("session id {id:#x} of main channel {}", sock_name(m)),
                },
            );
        }
    }
    // Address groups.
    let mut groups: BTreeMap<(u32, IpAddr), Vec<&SocketModel>> = BTreeMap::new();
    for s in model.sockets.values() {
        let framed = s.channel_type().is_some() || s.dirs.iter().any(|d| d.hdr_len != 0);
        if s.closed_ns.is_some() || s.is_server_end() != Some(true) || !framed {
            continue;
        }
        if let Some(r) = s.remote {
            groups
                .entry((s.pid, r.ip().to_canonical()))
                .or_default()
                .push(s);
        }
    }
    for ((pid, ip), members) in groups {
        let mains: Vec<&&SocketModel> = members.iter().filter(|s| is_main(s)).collect();
        let [m] = mains[..] else { continue };
        let key = sock_name(m);
        for s in &members {
            if out.contains_key(&s.cookie) {
                continue;
            }
            if let (Some(a), Some(b)) = (s.session_id, m.session_id)
                && a != b
            {
                continue;
            }
            let how = if m.channel().is_some() {
                "main channel"
            } else {
                "inferred main channel"
            };
            out.insert(
                s.cookie,
                SessionGuess {
                    key: key.clone(),
                    inferred: true,
                    evidence: format!(
                        "same client address {ip} as the only {how} of pid {pid}, {key}"
                    ),
                },
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use Role::{ClientToServer as C2S, ServerToClient as S2C, Unknown};

    fn ty(msg_type: u16, count: u64, size: u32) -> TypeSeen {
        TypeSeen {
            msg_type,
            count,
            min_size: size,
            max_size: size,
        }
    }

    fn ranged(msg_type: u16, count: u64, lo: u32, hi: u32) -> TypeSeen {
        TypeSeen {
            msg_type,
            count,
            min_size: lo,
            max_size: hi,
        }
    }

    fn dir(role: Role, types: &[TypeSeen]) -> DirEvidence {
        DirEvidence {
            role,
            types: types.to_vec(),
            lock_mask: None,
        }
    }

    /// A server-end socket: sends server → client.
    fn server(s2c: &[TypeSeen], c2s: &[TypeSeen]) -> [DirEvidence; 2] {
        [dir(S2C, s2c), dir(C2S, c2s)]
    }

    fn name(i: &Inference) -> &'static str {
        i.channel_type.map_or("unknown", channel_type_name)
    }

    #[test]
    fn display_draws_decide_display() {
        // rects mode: DRAW_FILL, and the client's ACKs.
        let i = infer(&server(&[ty(302, 1000, 120)], &[ty(2, 50, 0)]));
        assert_eq!(name(&i), "display", "{}", i.evidence);
        assert!(!i.roles_inferred);
        assert!(
            i.evidence.contains("DRAW_FILL (302) ×1000"),
            "{}",
            i.evidence
        );
        assert!(i.evidence.contains("only display fits"), "{}", i.evidence);
        // noise mode: big DRAW_COPYs; a stream.
        let i = infer(&server(
            &[ranged(304, 20, 100_000, 200_000), ty(123, 5, 4000)],
            &[],
        ));
        assert_eq!(name(&i), "display", "{}", i.evidence);
    }

    #[test]
    fn cursor_moves_decide_cursor_over_record() {
        // MOVE (4 bytes) and SET: fit cursor and record (VOLUME, MUTE); only cursor's traffic.
        let i = infer(&server(&[ty(104, 40, 4), ranged(103, 2, 100, 4200)], &[]));
        assert_eq!(name(&i), "cursor", "{}", i.evidence);
        assert_eq!(
            i.fitting,
            channel_bit(channel::CURSOR) | channel_bit(channel::RECORD)
        );
        assert!(i.evidence.contains("MOVE (104) ×40"), "{}", i.evidence);
        assert!(i.evidence.contains("record also fit"), "{}", i.evidence);
        // MOVEs only: main (CHANNELS_LIST), display (COPY_BITS), record (MUTE) also fit.
        let i = infer(&server(&[ty(104, 10, 4)], &[]));
        assert_eq!(name(&i), "cursor", "{}", i.evidence);
        // With an ACK (every W messages) only display and cursor fit (104 is display's
        // COPY_BITS number), and a 4-byte 104 is no COPY_BITS (≥ 29 bytes): cursor.
        let i = infer(&server(&[ty(104, 25, 4), ty(4, 1, 12)], &[ty(2, 1, 0)]));
        assert_eq!(name(&i), "cursor", "{}", i.evidence);
        assert_eq!(i.fitting, ACK_CHANNELS);
    }

    #[test]
    fn too_little_support_stays_unknown() {
        // Two MOVEs: a record channel's MUTE could be them; fewer than MIN_SUPPORT.
        let i = infer(&server(&[ty(104, 2, 4)], &[]));
        assert_eq!(i.channel_type, None);
        assert!(i.evidence.contains("fewer than 3"), "{}", i.evidence);
        // 104 with 6–20 bytes is no MOVE (4) and no COPY_BITS (≥ 29): main, display and
        // record fit it, and it is main's CHANNELS_LIST.
        let i = infer(&server(&[ranged(104, 5, 6, 20)], &[]));
        assert_eq!(name(&i), "main", "{}", i.evidence);
        // 29–60 bytes: CHANNELS_LIST or COPY_BITS.
        let i = infer(&server(&[ranged(104, 5, 29, 60)], &[]));
        assert_eq!(i.channel_type, None, "{}", i.evidence);
        assert!(i.evidence.starts_with("ambiguous: main"), "{}", i.evidence);
    }

    #[test]
    fn inputs_from_client_mouse_and_server_motion_ack() {
        // MOUSE_POSITION (client → server) and MOUSE_MOTION_ACK (empty, server → client).
        let i = infer(&server(&[ty(111, 10, 0)], &[ty(112, 40, 11)]));
        assert_eq!(name(&i), "inputs", "{}", i.evidence);
        // Keys alone: KEY_DOWN / KEY_UP have 4 bytes; record DATA and the data channels'
        // DATA (101) also fit KEY_DOWN, so KEY_UP, MOUSE_PRESS and the like decide.
        let i = infer(&server(&[], &[ty(101, 5, 4), ty(102, 5, 4), ty(113, 2, 2)]));
        assert_eq!(name(&i), "inputs", "{}", i.evidence);
        // MOUSE_MOTION_ACK alone: main's 111 (MIGRATE_SWITCH_HOST) fits too, unsupported.
        let i = infer(&server(&[ty(111, 3, 0)], &[]));
        assert_eq!(name(&i), "inputs", "{}", i.evidence);
        // A real session's keys go as KEY_SCANCODE (104, 2 bytes): main's 104 is the empty
        // ATTACH_CHANNELS, so it neither fits nor supports main.
        let i = infer(&server(
            &[ty(111, 36, 0)],
            &[ty(104, 15, 2), ty(111, 156, 10)],
        ));
        assert_eq!(name(&i), "inputs", "{}", i.evidence);
        assert_eq!(i.fitting, channel_bit(channel::INPUTS), "{}", i.evidence);
        // Key down alone fits record DATA, smartcard, usbredir, port and webdav DATA too.
        let i = infer(&server(&[], &[ty(101, 8, 4)]));
        assert_eq!(i.channel_type, None, "{}", i.evidence);
        assert!(i.evidence.starts_with("ambiguous"), "{}", i.evidence);
    }

    #[test]
    fn main_from_agent_and_mouse_mode_messages() {
        // AGENT_DATA (≤ 2048) and AGENT_TOKEN exist only on main.
        let i = infer(&server(
            &[ty(109, 30, 200), ty(110, 2, 4)],
            &[ty(107, 20, 100)],
        ));
        assert_eq!(name(&i), "main", "{}", i.evidence);
        assert!(
            i.evidence.contains("AGENT_DATA (109) ×30"),
            "{}",
            i.evidence
        );
        // MULTI_MEDIA_TIME (4 bytes) fits display, cursor and playback numbers too.
        let i = infer(&server(&[ty(106, 6, 4), ty(4, 1, 12)], &[ty(3, 1, 12)]));
        assert_eq!(name(&i), "main", "{}", i.evidence);
        assert!(i.evidence.contains("also fit,"), "{}", i.evidence);
        // MOUSE_MODE + the client's MOUSE_MODE_REQUEST.
        let i = infer(&server(&[ty(105, 2, 4)], &[ty(105, 2, 4)]));
        assert_eq!(name(&i), "main", "{}", i.evidence);
    }

    #[test]
    fn playback_and_record_data() {
        // Playback DATA with START/STOP: the data channels have no 103/104.
        let i = infer(&server(
            &[ranged(101, 200, 1000, 2000), ty(104, 1, 0), ty(103, 1, 14)],
            &[],
        ));
        assert_eq!(name(&i), "playback", "{}", i.evidence);
        // DATA alone fits the data channels' DATA too: ambiguous.
        let i = infer(&server(&[ranged(101, 200, 1000, 2000)], &[]));
        assert_eq!(i.channel_type, None, "{}", i.evidence);
        assert!(i.evidence.contains("playback"), "{}", i.evidence);
        // Record: client DATA and START_MARK; server STOP (empty).
        let i = infer(&server(
            &[ty(102, 1, 0)],
            &[ranged(101, 300, 500, 4000), ty(103, 1, 4)],
        ));
        assert_eq!(name(&i), "record", "{}", i.evidence);
    }

    #[test]
    fn base_messages_alone_decide_nothing() {
        // PING / PONG: every channel has them.
        let i = infer(&server(&[ty(4, 2, 12)], &[ty(3, 2, 12)]));
        assert_eq!(i.channel_type, None);
        assert!(
            i.evidence.contains("no message distinctive"),
            "{}",
            i.evidence
        );
        // ACKs: display or cursor, not which.
        let i = infer(&server(&[ty(4, 1, 12)], &[ty(2, 3, 0)]));
        assert_eq!(i.channel_type, None);
        assert_eq!(i.fitting, ACK_CHANNELS);
        let i = infer(&server(&[], &[]));
        assert_eq!(i.evidence, "no message framed yet");
    }

    #[test]
    fn one_misfit_rules_a_type_out() {
        // A draw on what otherwise looks like cursor: display's draws and cursor's MOVE
        // together fit no single type.
        let i = infer(&server(&[ty(302, 10, 50), ty(104, 10, 4)], &[]));
        assert_eq!(name(&i), "display", "{}", i.evidence);
        let i = infer(&server(&[ty(302, 10, 50), ty(111, 1, 0)], &[]));
        assert_eq!(i.channel_type, None);
        // A number no table has.
        let i = infer(&server(&[ty(999, 1, 0)], &[]));
        assert_eq!(i.channel_type, None);
        assert!(i.evidence.contains("type 999"), "{}", i.evidence);
        assert!(
            i.evidence.contains("fits no channel type"),
            "{}",
            i.evidence
        );
    }

    #[test]
    fn the_lock_mask_narrows_the_candidates() {
        // ACKs only (display or cursor), but the headers the kernel locked on fit cursor only.
        let mut d = server(&[ty(4, 1, 12)], &[ty(2, 3, 0)]);
        d[0].lock_mask = Some(channel_bit(channel::CURSOR) | channel_bit(channel::RECORD));
        let i = infer(&d);
        assert_eq!(name(&i), "cursor", "{}", i.evidence);
        // A mask of 0 carries nothing.
        let mut d = server(&[ty(302, 3, 50)], &[]);
        d[0].lock_mask = Some(0);
        assert_eq!(name(&infer(&d)), "display");
    }

    #[test]
    fn roles_are_inferred_when_the_hint_is_missing() {
        // Draws sent, ACKs received: the sending direction is server → client.
        let i = infer(&[
            dir(Unknown, &[ty(302, 10, 60)]),
            dir(Unknown, &[ty(2, 1, 0)]),
        ]);
        assert_eq!(i.roles, [S2C, C2S]);
        assert!(i.roles_inferred);
        assert_eq!(name(&i), "display", "{}", i.evidence);
        assert!(i.evidence.contains("roles inferred"), "{}", i.evidence);
        // A relay's leg toward spice-server: draws received.
        let i = infer(&[
            dir(Unknown, &[ty(2, 1, 0)]),
            dir(Unknown, &[ty(302, 10, 60)]),
        ]);
        assert_eq!(i.roles, [C2S, S2C]);
        assert_eq!(name(&i), "display");
        // One role given: the other is its opposite.
        let i = infer(&[dir(Unknown, &[ty(104, 9, 4)]), dir(C2S, &[])]);
        assert_eq!(i.roles, [S2C, C2S]);
        assert!(i.roles_inferred);
        assert_eq!(name(&i), "cursor");
        // PING one way, PONG the other: PONG's 12 bytes are no SET_ACK (8), so only one
        // assignment fits, though no channel type is decided.
        let i = infer(&[dir(Unknown, &[ty(3, 1, 12)]), dir(Unknown, &[ty(4, 1, 12)])]);
        assert_eq!(i.roles, [C2S, S2C]);
        assert_eq!(i.channel_type, None);
        // Only messages valid both ways (type 2 with an empty body: ACK or an empty
        // MIGRATE_DATA): roles stay unknown.
        let i = infer(&[dir(Unknown, &[ty(2, 4, 0)]), dir(Unknown, &[])]);
        assert_eq!(i.roles, [Unknown, Unknown]);
        assert!(!i.roles_inferred);
        assert_eq!(i.channel_type, None);
        assert!(i.evidence.contains("roles unknown"), "{}", i.evidence);
    }

    #[test]
    fn characteristic_types_fit_their_channel() {
        // Every characteristic (type, size) listed is valid for its channel in the shared
        // tables: a support that could never count would be a table mistake.
        let cases: &[(u8, Role, TypeSeen)] = &[
            (channel::DISPLAY, S2C, ty(302, 1, 40)),
            (channel::DISPLAY, S2C, ty(322, 1, 4)),
            (channel::DISPLAY, S2C, ty(123, 1, 4000)),
            (channel::CURSOR, S2C, ty(103, 1, 100)),
            (channel::CURSOR, S2C, ty(104, 1, 4)),
            (channel::CURSOR, S2C, ty(105, 1, 0)),
            (channel::INPUTS, S2C, ty(111, 1, 0)),
            (channel::INPUTS, C2S, ty(101, 1, 4)),
            (channel::INPUTS, C2S, ty(114, 1, 2)),
            (channel::MAIN, S2C, ty(109, 1, 100)),
            (channel::MAIN, S2C, ty(115, 1, 8)),
            (channel::MAIN, C2S, ty(106, 1, 4)),
            (channel::PLAYBACK, S2C, ty(101, 1, 1000)),
            (channel::PLAYBACK, S2C, ty(107, 1, 4)),
            (channel::RECORD, C2S, ty(101, 1, 1000)),
            (channel::USBREDIR, S2C, ty(102, 1, 10)),
            (channel::PORT, S2C, ty(201, 1, 10)),
        ];
        for (c, role, t) in cases {
            assert!(characteristic(*c, *role, t), "{c} {role:?} {t:?}");
            assert!(
                fit(*role, t) & channel_bit(*c) != 0,
                "{} {role:?} {t:?} not valid",
                channel_type_name(*c)
            );
        }
        // Start-up messages are not characteristic: display INIT, cursor INIT, main INIT.
        assert!(!characteristic(channel::DISPLAY, C2S, &ty(101, 1, 14)));
        assert!(!characteristic(channel::CURSOR, S2C, &ty(101, 1, 20)));
        assert!(!characteristic(channel::MAIN, S2C, &ty(103, 1, 32)));
    }

    /// What each channel of a real session carries once it is running: Xspice (rects mode,
    /// 20 rectangles at 50 fps) with a spice-gtk client that sends a relative mouse motion
    /// every 50 ms and a key press and a mouse-mode request every 500 ms, observed from the
    /// start for 14 s (counts and mean body sizes of the reference report, start-up messages
    /// left out: what a mid-stream join sees). Xspice draws the cursor into the frame buffer
    /// (changing the root window's cursor made DRAW_COPYs on display, nothing on cursor), so
    /// its cursor channel carries nothing after INIT but a PING every 5 minutes: nothing to
    /// infer from.
    #[test]
    fn steady_traffic_of_each_channel_is_recognised() {
        let cases: &[(Option<u8>, [DirEvidence; 2])] = &[
            (
                Some(channel::DISPLAY),
                server(
                    &[ty(302, 10939, 41), ranged(304, 845, 100, 20891)],
                    &[ty(2, 588, 0)],
                ),
            ),
            (Some(channel::MAIN), server(&[], &[ty(105, 22, 2)])),
            (
                Some(channel::INPUTS),
                server(
                    &[ty(111, 54, 0)],
                    &[ty(111, 215, 10), ty(104, 21, 2), ty(103, 1, 2)],
                ),
            ),
            (None, server(&[], &[])),
        ];
        for (c, d) in cases {
            let i = infer(d);
            assert_eq!(i.channel_type, *c, "{}", i.evidence);
        }
    }

    mod model {
        use super::*;
        use crate::events::Event;
        use spice_ebpf_common::{
            event::{EventHeader, HuntEvent, LinkEvent, LockEvent, MessageEvent, dir, lock_how},
            framing::UnparsedReason,
        };

        fn hdr(cookie: u64, pid: u32, d: u8, ts: u64) -> EventHeader {
            EventHeader {
                dir: d,
                ts_ns: ts,
                cookie,
                tgid: pid,
                ..Default::default()
            }
        }

        /// A connection joined mid-stream as the engine and kernel report it: listed
        /// (`add_existing`), a HUNT per direction with the kernel's role hint, a LOCK per
        /// direction with messages, then the messages `(direction, type, size, count)`.
        fn joined(
            m: &mut Model,
            cookie: u64,
            pid: u32,
            local: &str,
            remote: &str,
            hint: [Role; 2],
            msgs: &[(u8, u16, u32, u64)],
        ) {
            m.add_existing(
                cookie,
                pid,
                local.parse().unwrap(),
                remote.parse().unwrap(),
                1,
            );
            for d in [dir::SEND, dir::RECV] {
                m.apply(&Event::Hunt(HuntEvent {
                    hdr: hdr(cookie, pid, d, 2),
                    reason: UnparsedReason::AttachedMidStream as u8,
                    role: hint[d as usize] as u8,
                    ..Default::default()
                }));
            }
            let mut index = [0u64; 2];
            let mut at = [0u64; 2];
            for &(d, t, size, n) in msgs {
                let i = d as usize;
                for _ in 0..n {
                    if index[i] == 0 {
                        m.apply(&Event::Lock(LockEvent {
                            hdr: hdr(cookie, pid, d, 3),
                            at: at[i],
                            index: 1,
                            how: lock_how::SEND_AFTER_COMPLETE,
                            run: 3,
                            hdr_len: 6,
                            role: hint[i] as u8,
                            ..Default::default()
                        }));
                    }
                    index[i] += 1;
                    m.apply(&Event::Message(MessageEvent {
                        hdr: hdr(cookie, pid, d, 10 + index[i]),
                        at: at[i],
                        index: index[i],
                        size,
                        msg_type: t,
                        hdr_len: 6,
                        ..Default::default()
                    }));
                    at[i] += 6 + size as u64;
                }
            }
        }

        const SERVER: [Role; 2] = [S2C, C2S];
        const S: u8 = dir::SEND;
        const R: u8 = dir::RECV;

        /// One client's four channels on spice-server (pid 10), joined mid-stream.
        fn client(m: &mut Model, base: u64, ip: &str, main: bool) {
            let sock = |p: u16| format!("{ip}:{p}");
            if main {
                joined(
                    m,
                    base,
                    10,
                    "127.0.0.1:5900",
                    &sock(40001),
                    SERVER,
                    &[(S, 106, 4, 3), (S, 4, 12, 1), (R, 3, 12, 1)],
                );
            }
            joined(
                m,
                base + 1,
                10,
                "127.0.0.1:5900",
                &sock(40002),
                SERVER,
                &[(S, 302, 80, 100), (R, 2, 0, 5)],
            );
            joined(
                m,
                base + 2,
                10,
                "127.0.0.1:5900",
                &sock(40003),
                SERVER,
                &[(S, 111, 0, 4), (R, 112, 11, 16)],
            );
            joined(
                m,
                base + 3,
                10,
                "127.0.0.1:5900",
                &sock(40004),
                SERVER,
                &[(S, 104, 4, 30)],
            );
        }

        #[test]
        fn joined_sockets_get_inferred_types_and_known_ones_keep_theirs() {
            let mut m = Model::default();
            client(&mut m, 100, "127.0.0.1", true);
            let ty = |c: u64| m.sockets[&c].channel_type();
            for (c, want) in [
                (100, "main"),
                (101, "display"),
                (102, "inputs"),
                (103, "cursor"),
            ] {
                let t = ty(c).unwrap_or_else(|| panic!("{c}: {:?}", m.sockets[&c].inference()));
                assert_eq!(channel_type_name(t.ty), want);
                assert!(t.inferred() && t.id.is_none());
                assert!(!m.sockets[&c].roles_inferred());
                assert_eq!(m.sockets[&c].is_server_end(), Some(true));
            }
            // A socket whose link was seen: the link tells, nothing inferred.
            m.apply(&Event::Link(LinkEvent {
                hdr: hdr(7, 10, R, 1),
                role: C2S as u8,
                channel_type: channel::CURSOR,
                channel_id: 2,
                ..Default::default()
            }));
            let t = m.sockets[&7].channel_type().unwrap();
            assert_eq!(
                (t.ty, t.id, t.inferred()),
                (channel::CURSOR, Some(2), false)
            );
            assert!(m.sockets[&7].inference().is_none());
        }

        #[test]
        fn roles_from_messages_make_the_end_known() {
            let mut m = Model::default();
            joined(
                &mut m,
                1,
                10,
                "127.0.0.1:6900",
                "127.0.0.1:5900",
                [Unknown, Unknown],
                &[(R, 302, 80, 10), (S, 2, 0, 1)],
            );
            let s = &m.sockets[&1];
            assert_eq!(s.s2c(), Some(R as usize));
            assert_eq!(s.c2s(), Some(S as usize));
            assert_eq!(
                s.is_server_end(),
                Some(false),
                "a relay's leg toward spice-server"
            );
            assert!(s.roles_inferred());
            assert_eq!(s.channel_type().map(|t| t.ty), Some(channel::DISPLAY));
            // Nothing framed: roles stay unknown.
            joined(
                &mut m,
                2,
                10,
                "127.0.0.1:6900",
                "127.0.0.1:5900",
                [Unknown, Unknown],
                &[],
            );
            let s = &m.sockets[&2];
            assert_eq!(
                (s.s2c(), s.is_server_end(), s.roles_inferred()),
                (None, None, false)
            );
        }

        #[test]
        fn one_main_per_client_address_groups_the_session() {
            let mut m = Model::default();
            client(&mut m, 100, "127.0.0.1", true);
            client(&mut m, 200, "10.0.0.2", true);
            let g = sessions(&m);
            for c in 100..104 {
                let k = &g[&c];
                assert_eq!(k.key, "127.0.0.1:5900->127.0.0.1:40001", "{c}");
                assert!(k.inferred);
                assert!(k.evidence.contains("127.0.0.1"), "{}", k.evidence);
            }
            for c in 200..204 {
                assert_eq!(g[&c].key, "127.0.0.1:5900->10.0.0.2:40001");
            }
            // Its main not framed yet: nothing to group around.
            let mut m = Model::default();
            client(&mut m, 100, "127.0.0.1", false);
            assert!(sessions(&m).is_empty());
            // Two mains from one address (two clients behind one IP): not grouped.
            let mut m = Model::default();
            client(&mut m, 100, "127.0.0.1", true);
            joined(
                &mut m,
                300,
                10,
                "127.0.0.1:5900",
                "127.0.0.1:40100",
                SERVER,
                &[(S, 109, 100, 5)],
            );
            assert!(sessions(&m).is_empty());
            // Closed sockets are left out.
            let mut m = Model::default();
            client(&mut m, 100, "127.0.0.1", true);
            m.sockets.get_mut(&101).unwrap().closed_ns = Some(50);
            let g = sessions(&m);
            assert!(g.contains_key(&100) && !g.contains_key(&101));
        }

        /// The report row, JSON and table of a joined client: inferred types marked, the
        /// session grouped around the inferred main channel, session ids unset.
        #[test]
        fn the_report_marks_inferred_fields() {
            use crate::output::report::{build_for_test, render};
            let mut m = Model::default();
            client(&mut m, 100, "127.0.0.1", true);
            joined(
                &mut m,
                104,
                10,
                "127.0.0.1:5900",
                "127.0.0.1:40005",
                SERVER,
                &[(S, 4, 12, 1), (R, 3, 12, 1)],
            );
            let r = build_for_test(&m, 1_000_000_000);
            let row = |cookie: u64| r.channels.iter().find(|c| c.cookie == cookie).unwrap();
            let main_key = "127.0.0.1:5900->127.0.0.1:40001";
            for (cookie, ty) in [
                (100, "main"),
                (101, "display"),
                (102, "inputs"),
                (103, "cursor"),
            ] {
                let c = row(cookie);
                assert_eq!(c.channel_type, ty);
                assert!(c.channel_type_inferred && !c.end_inferred);
                assert_eq!(c.channel_id, None);
                assert!(c.channel_type_evidence.is_some());
                assert_eq!(c.session_id, None);
                assert_eq!(c.session_key.as_deref(), Some(main_key));
                assert!(c.session_inferred);
            }
            // PING/PONG only: type unknown, and why; its framing was found, so it is SPICE
            // from the same client address: grouped.
            let c = row(104);
            assert_eq!(c.channel_type, "unknown");
            assert!(!c.channel_type_inferred);
            let why = c.channel_type_evidence.as_deref().unwrap();
            assert!(why.contains("no message distinctive"), "{why}");
            assert_eq!(c.session_key.as_deref(), Some(main_key));
            let v = serde_json::to_value(row(103)).unwrap();
            assert_eq!(v["channel_type"], "cursor");
            assert_eq!(v["channel_type_inferred"], true);
            assert!(
                v["channel_type_evidence"]
                    .as_str()
                    .unwrap()
                    .contains("MOVE (104) ×30")
            );
            let t = render(&r);
            for ty in ["main?", "display?", "inputs?", "cursor?"] {
                assert!(t.contains(&format!(" {ty} ")), "{ty}: {t}");
            }
            assert!(!t.contains("unknown?"), "{t}");
            assert!(
                t.contains("inferred from the message types for 4 connection(s) without a link phase, 1 still unknown"),
                "{t}"
            );
        }

        /// A daemon restarted on its pinned maps takes over a connection an earlier agent had
        /// joined and locked: no link in the map, no HUNT or LOCK record any more, but framed;
        /// the records after the restart identify it.
        #[test]
        fn a_restored_joined_connection_is_identified_by_its_new_records() {
            use super::super::super::Restored;
            use spice_ebpf_common::event::SockState;
            let mut st = SockState {
                tgid: 10,
                ..Default::default()
            };
            for (d, role) in [(S, S2C), (R, C2S)] {
                st.dir[d as usize].role = role as u8;
                st.dir[d as usize].hdr_len = 6;
                st.dir[d as usize].msg_count = 50;
            }
            let mut m = Model::default();
            m.restore(
                &Restored {
                    cookie: 5,
                    state: st,
                    comm: "Xorg".into(),
                    local: "127.0.0.1:5900".parse().ok(),
                    remote: "127.0.0.1:40000".parse().ok(),
                    tcp: None,
                },
                100,
            );
            m.restored_at(100);
            assert_eq!(
                m.sockets[&5].inference().map(|i| i.evidence),
                Some("no message framed yet".into())
            );
            for i in 51..60 {
                m.apply(&Event::Message(MessageEvent {
                    hdr: hdr(5, 10, S, 200 + i),
                    index: i,
                    size: 40,
                    msg_type: 302,
                    hdr_len: 6,
                    ..Default::default()
                }));
            }
            let t = m.sockets[&5].channel_type().unwrap();
            assert_eq!((t.ty, t.inferred()), (channel::DISPLAY, true));
        }

        #[test]
        fn known_session_ids_group_without_inference() {
            let mut m = Model::default();
            let link = |m: &mut Model, cookie: u64, ty: u8, conn: u32| {
                m.apply(&Event::Socket {
                    hdr: hdr(cookie, 10, S, 1),
                    tid: 10,
                    local: "127.0.0.1:5900".parse().unwrap(),
                    remote: format!("127.0.0.1:{}", 41000 + cookie).parse().unwrap(),
                    comm: "Xorg".into(),
                });
                m.apply(&Event::Link(LinkEvent {
                    hdr: hdr(cookie, 10, R, 1),
                    role: C2S as u8,
                    channel_type: ty,
                    connection_id: conn,
                    ..Default::default()
                }));
                m.apply(&Event::Link(LinkEvent {
                    hdr: hdr(cookie, 10, S, 2),
                    role: S2C as u8,
                    ..Default::default()
                }));
            };
            link(&mut m, 1, channel::MAIN, 0);
            m.apply(&Event::Message(MessageEvent {
                hdr: hdr(1, 10, S, 3),
                index: 1,
                size: 32,
                msg_type: 103,
                hdr_len: 6,
                prefix: [0xabcd, 0],
                ..Default::default()
            }));
            link(&mut m, 2, channel::DISPLAY, 0xabcd);
            link(&mut m, 3, channel::DISPLAY, 0x9999);
            let g = sessions(&m);
            assert_eq!(m.sockets[&1].session_id, Some(0xabcd));
            assert!(!g[&1].inferred && !g[&2].inferred);
            assert_eq!(g[&2].key, "127.0.0.1:5900->127.0.0.1:41001");
            assert!(g[&2].evidence.contains("0xabcd"), "{}", g[&2].evidence);
            // Another session's display never joins this main, neither by id nor by address.
            assert!(!g.contains_key(&3));
        }
    }
}
