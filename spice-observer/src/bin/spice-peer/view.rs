//! The framing code's view of this socket: what the kernel should see.

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    C2S,
    S2C,
}

impl Dir {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Dir::C2S => "c2s",
            Dir::S2C => "s2c",
        }
    }
}

#[derive(Default, Debug)]
pub(crate) struct FrameTally {
    pub(crate) bytes: u64,
    pub(crate) calls: u64,
    pub(crate) messages: u64,
    pub(crate) by_type: BTreeMap<u16, u64>,
    pub(crate) already_reported: u64,
    pub(crate) peeked: u64,
    /// The last message `peek` reported, until the real write completes it.
    pub(crate) last_peek: Option<MessageInfo>,
    /// Real messages flagged `already_reported` that differ from what `peek` reported (or
    /// were never peeked): the kernel would have reported a wrong message.
    pub(crate) peek_mismatched: u64,
    pub(crate) link: Option<LinkInfo>,
    pub(crate) unparsed: Option<(UnparsedReason, u32, u64)>,
    /// Times the framing lost its boundaries and went back to hunting.
    pub(crate) hunts: u64,
    /// (type, prefix) of messages with a non-zero prefix, the first 32.
    pub(crate) prefixes: Vec<(u16, [u32; 2])>,
}

impl FrameTally {
    pub(crate) fn take(&mut self, o: Output) {
        match o {
            Output::None => {}
            Output::Link(l) => self.link = Some(l),
            Output::Message(m) => {
                self.messages += 1;
                *self.by_type.entry(m.msg_type).or_default() += 1;
                if m.already_reported {
                    self.already_reported += 1;
                    let peeked = self.last_peek.take().map(|p| MessageInfo {
                        already_reported: true,
                        ..p
                    });
                    if peeked != Some(m) {
                        self.peek_mismatched += 1;
                    }
                }
                if m.prefix != [0, 0] && self.prefixes.len() < 32 {
                    self.prefixes.push((m.msg_type, m.prefix));
                }
            }
            Output::Unparsed { reason, detail, at } => self.unparsed = Some((reason, detail, at)),
            Output::Hunt { .. } => self.hunts += 1,
        }
    }

    pub(crate) fn json(&self) -> Value {
        json!({
            "bytes": self.bytes,
            "calls": self.calls,
            "messages": self.messages,
            "by_type": by_type_json(&self.by_type),
            "already_reported": self.already_reported,
            "peeked": self.peeked,
            "peek_mismatched": self.peek_mismatched,
            "hunts": self.hunts,
            "link": self.link.map(|l| json!({
                "role": l.role, "link_size": l.link_size, "connection_id": l.connection_id,
                "channel_type": l.channel_type, "channel_id": l.channel_id, "common_caps": l.common_caps,
            })),
            "unparsed": self.unparsed.map(|(r, d, at)| json!({"reason": r.name(), "detail": d, "at": at})),
            "prefixes": self.prefixes.iter().map(|(t, p)| json!([t, p[0], p[1]])).collect::<Vec<_>>(),
        })
    }
}

/// Both directions' `DirState`, fed with the bytes of each call in the order calls returned.
#[derive(Default)]
pub(crate) struct Observe {
    pub(crate) c2s: DirState,
    pub(crate) s2c: DirState,
    pub(crate) t: [FrameTally; 2],
    /// Feed nothing (`spice-peer load`: the load generator keeps its own counts and must not
    /// spend CPU on the framing self-check).
    pub(crate) off: bool,
}

impl Observe {
    /// An `Observe` that ignores every call (its JSON stays empty).
    pub(crate) fn off() -> Observe {
        Observe {
            off: true,
            ..Default::default()
        }
    }

    pub(crate) fn parts(&mut self, dir: Dir) -> (&mut DirState, &DirState, &mut FrameTally) {
        match dir {
            Dir::C2S => (&mut self.c2s, &self.s2c, &mut self.t[0]),
            Dir::S2C => (&mut self.s2c, &self.c2s, &mut self.t[1]),
        }
    }

    pub(crate) fn feed(&mut self, dir: Dir, segs: &[&[u8]]) {
        if self.off {
            return;
        }
        let (st, other, tally) = self.parts(dir);
        let peer = other.view();
        tally.calls += 1;
        tally.bytes += segs.iter().map(|s| s.len() as u64).sum::<u64>();
        framing::feed(st, &peer, segs, |o| tally.take(o));
    }

    /// A send call that moved nothing (EAGAIN): the kernel's `peek` of its first bytes.
    pub(crate) fn peek(&mut self, dir: Dir, segs: &[&[u8]]) {
        if self.off {
            return;
        }
        let (st, other, tally) = self.parts(dir);
        let peer = other.view();
        let mut first = [0u8; BUF_LEN];
        let mut n = 0;
        for s in segs {
            let k = s.len().min(BUF_LEN - n);
            first[n..n + k].copy_from_slice(&s[..k]);
            n += k;
        }
        if let Some(m) = st.peek(&first, n as u32, &peer) {
            tally.peeked += 1;
            tally.last_peek = Some(m);
        }
    }

    pub(crate) fn json(&self) -> Value {
        json!({"c2s": self.t[0].json(), "s2c": self.t[1].json()})
    }
}

pub(crate) fn by_type_json(m: &BTreeMap<u16, u64>) -> Value {
    Value::Object(m.iter().map(|(k, v)| (k.to_string(), json!(v))).collect())
}
