//! Typed view of the kernel's ring-buffer records (`spice_ebpf_common::event`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use anyhow::{Result, bail};
use spice_ebpf_common::{
    event::{
        CloseEvent, EventHeader, HuntEvent, LinkEvent, LockEvent, MessageEvent, ProcEvent,
        SocketEvent, TcpSnapshot, TlsEvent, TlsMarkEvent, UnparsedEvent, kind,
    },
    framing::UnparsedReason,
};

/// One decoded record.
#[derive(Clone, Debug)]
pub enum Event {
    /// First use of a TCP socket by a watched process.
    /// `tid` is the thread that made the call.
    Socket {
        hdr: EventHeader,
        tid: u32,
        local: SocketAddr,
        remote: SocketAddr,
        comm: String,
    },
    /// A link message (client) or reply (server) in direction `hdr.dir`.
    Link(LinkEvent),
    /// A data message start.
    Message(MessageEvent),
    /// Framing stopped in direction `hdr.dir`.
    Unparsed {
        hdr: EventHeader,
        at: u64,
        reason: UnparsedReason,
        detail: u32,
    },
    /// Direction `hdr.dir` has no message boundaries from stream offset `at` and hunts for
    /// them: joined mid-stream, or a header failed validation.
    Hunt(HuntEvent),
    /// Direction `hdr.dir` locked on its boundaries again; its next message record is the
    /// first one counted.
    Lock(LockEvent),
    /// The socket carries TLS: its framing runs on the plaintext at the libssl hooks, and
    /// its message, link, hunt and lock records describe that plaintext (offsets are
    /// plaintext offsets). `func`: the `spice_ebpf_common::event::tls_func` its first traced
    /// call ran in. Once per socket, before any record of its plaintext.
    Tls { hdr: EventHeader, func: u8 },
    /// One libssl call on a TLS socket moved plaintext of direction `hdr.dir` up to
    /// `plain_end`, which is in the TCP stream up to `seq` (`write_seq` / `copied_seq` at the
    /// call's return).
    TlsMark(TlsMarkEvent),
    /// A watched process forked `child`.
    Fork {
        hdr: EventHeader,
        child: u32,
        comm: String,
    },
    /// A watched process exited.
    Exit { hdr: EventHeader },
    /// A tracked socket closed, with its last TCP state.
    /// `pos`: bytes moved by traced socket calls per direction at the close: TCP bytes
    /// (for a TLS socket `SockState::wire_pos`, not its plaintext).
    Close {
        hdr: EventHeader,
        tcp: TcpSnapshot,
        pos: [u64; 2],
    },
}

impl Event {
    /// The record's header (every record has one; process records carry cookie 0).
    pub fn header(&self) -> &EventHeader {
        match self {
            Event::Socket { hdr, .. }
            | Event::Unparsed { hdr, .. }
            | Event::Tls { hdr, .. }
            | Event::Fork { hdr, .. }
            | Event::Exit { hdr }
            | Event::Close { hdr, .. } => hdr,
            Event::Link(e) => &e.hdr,
            Event::Message(e) => &e.hdr,
            Event::Hunt(e) => &e.hdr,
            Event::Lock(e) => &e.hdr,
            Event::TlsMark(e) => &e.hdr,
        }
    }
}

fn read<T: Copy>(buf: &[u8]) -> Result<T> {
    if buf.len() < size_of::<T>() {
        bail!(
            "record of {} bytes is shorter than {}",
            buf.len(),
            std::any::type_name::<T>()
        );
    }
    // SAFETY: length checked; T is a plain repr(C) record; unaligned read.
    Ok(unsafe { std::ptr::read_unaligned(buf.as_ptr() as *const T) })
}

fn comm(raw: &[u8; 16]) -> String {
    let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
    String::from_utf8_lossy(&raw[..end]).into_owned()
}

fn addr(family: u16, raw: &[u8; 16], port: u16) -> SocketAddr {
    let ip = if family == 10 {
        let v6 = Ipv6Addr::from(*raw);
        match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        }
    } else {
        IpAddr::V4(Ipv4Addr::new(raw[0], raw[1], raw[2], raw[3]))
    };
    SocketAddr::new(ip, port)
}

/// Decodes one ring-buffer record.
pub fn decode(buf: &[u8]) -> Result<Event> {
    let hdr: EventHeader = read(buf)?;
    Ok(match hdr.kind {
        kind::SOCKET => {
            let e: SocketEvent = read(buf)?;
            Event::Socket {
                hdr,
                tid: e.tid,
                local: addr(e.family, &e.laddr, e.lport),
                remote: addr(e.family, &e.raddr, e.rport),
                comm: comm(&e.comm),
            }
        }
        kind::LINK => Event::Link(read(buf)?),
        kind::MESSAGE => Event::Message(read(buf)?),
        kind::UNPARSED => {
            let e: UnparsedEvent = read(buf)?;
            Event::Unparsed {
                hdr,
                at: e.at,
                reason: UnparsedReason::from_u8(e.reason),
                detail: e.detail,
            }
        }
        kind::HUNT => Event::Hunt(read(buf)?),
        kind::LOCK => Event::Lock(read(buf)?),
        kind::TLS => {
            let e: TlsEvent = read(buf)?;
            Event::Tls { hdr, func: e.func }
        }
        kind::TLS_MARK => Event::TlsMark(read(buf)?),
        kind::FORK => {
            let e: ProcEvent = read(buf)?;
            Event::Fork {
                hdr,
                child: e.pid,
                comm: comm(&e.comm),
            }
        }
        kind::EXIT => Event::Exit { hdr },
        kind::CLOSE => {
            let e: CloseEvent = read(buf)?;
            Event::Close {
                hdr,
                tcp: e.tcp,
                pos: e.pos,
            }
        }
        other => bail!("unknown record kind {other}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use spice_ebpf_common::event::{dir, tls_func};

    fn bytes<T: Copy>(v: &T) -> Vec<u8> {
        // SAFETY: plain repr(C) record, read as bytes.
        unsafe { std::slice::from_raw_parts(v as *const T as *const u8, size_of::<T>()) }.to_vec()
    }

    #[test]
    fn tls_records_decode() {
        let hdr = EventHeader {
            kind: kind::TLS,
            tgid: 42,
            cookie: 7,
            ts_ns: 5,
            ..Default::default()
        };
        let e = TlsEvent {
            hdr,
            func: tls_func::WRITE,
            _pad: [0; 7],
        };
        assert_eq!(size_of::<TlsEvent>(), 32);
        match decode(&bytes(&e)).unwrap() {
            Event::Tls { hdr, func } => {
                assert_eq!((hdr.cookie, hdr.tgid, func), (7, 42, tls_func::WRITE));
            }
            other => panic!("{other:?}"),
        }
        let m = TlsMarkEvent {
            hdr: EventHeader {
                kind: kind::TLS_MARK,
                dir: dir::RECV,
                cookie: 7,
                ..Default::default()
            },
            plain_end: 1 << 33,
            seq: 0xffff_fff0,
            len: 16_384,
        };
        assert_eq!(size_of::<TlsMarkEvent>(), 40);
        match decode(&bytes(&m)).unwrap() {
            Event::TlsMark(x) => {
                assert_eq!(
                    (x.hdr.dir, x.plain_end, x.seq, x.len),
                    (dir::RECV, 1 << 33, 0xffff_fff0, 16_384)
                );
            }
            other => panic!("{other:?}"),
        }
        // A short record is an error, not a zero-filled mark.
        assert!(decode(&bytes(&m)[..30]).is_err());
    }
}
