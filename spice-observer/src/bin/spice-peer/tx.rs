//! Sending: the writer issues the calls and accounts for what they moved.

use super::*;

/// How data messages are cut into calls.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pattern {
    pub(crate) split_header: bool,
    pub(crate) iov_split: bool,
    pub(crate) split_at: usize,
    pub(crate) chunk: Option<usize>,
}

/// This side's writer: issues the calls and accounts for what they moved.
pub(crate) struct Tx {
    pub(crate) fd: RawFd,
    pub(crate) how: SendSyscall,
    pub(crate) dir: Dir,
    pub(crate) nonblock: bool,
    pub(crate) pause: Duration,
    pub(crate) timeout: Duration,
    pub(crate) obs: Arc<Mutex<Observe>>,
    /// Wrap every call in a SASL-shaped blob (4-byte big-endian length + payload).
    pub(crate) sasl_wrap: bool,
    pub(crate) kind: HeaderKind,
    pub(crate) next_serial: u64,
    /// Raw bytes the send calls returned.
    pub(crate) bytes: u64,
    /// Plain (pre-wrapping) stream bytes fully sent.
    pub(crate) plain: u64,
    /// Plain stream offset after everything planned so far.
    pub(crate) planned: u64,
    /// (plain end offset, type) of planned messages not yet fully sent.
    pub(crate) pending: VecDeque<(u64, u16)>,
    pub(crate) calls: u64,
    pub(crate) eagain: u64,
    pub(crate) short_writes: u64,
    pub(crate) link_bytes: Option<u64>,
    pub(crate) messages: u64,
    pub(crate) by_type: BTreeMap<u16, u64>,
    /// Bytes of `--garbage-at` junk written into the data stream (not messages).
    pub(crate) junk_bytes: u64,
    /// `--sendfile-after`: writes go out with sendfile(2) once this many messages are sent.
    pub(crate) sendfile_after: Option<u64>,
    /// Calls made with sendfile(2).
    pub(crate) sendfile_calls: u64,
}

impl Tx {
    pub(crate) fn new(fd: RawFd, dir: Dir, c: &Common, obs: Arc<Mutex<Observe>>) -> Tx {
        Tx {
            fd,
            how: c.send_syscall,
            dir,
            nonblock: c.nonblock,
            pause: Duration::from_millis(c.pause_ms),
            timeout: c.timeout(),
            obs,
            sasl_wrap: false,
            kind: HeaderKind::Mini,
            next_serial: 1,
            bytes: 0,
            plain: 0,
            planned: 0,
            pending: VecDeque::new(),
            calls: 0,
            eagain: 0,
            short_writes: 0,
            link_bytes: None,
            messages: 0,
            by_type: BTreeMap::new(),
            junk_bytes: 0,
            sendfile_after: c.sendfile_after,
            sendfile_calls: 0,
        }
    }

    /// One logical write of `segs`: one syscall, repeated on the remainder after a short write
    /// and after EAGAIN (non-blocking mode: poll first, then the same call again).
    pub(crate) fn call(&mut self, segs: &[&[u8]]) -> io::Result<()> {
        let plain_len: usize = segs.iter().map(|s| s.len()).sum();
        if plain_len == 0 {
            return Ok(());
        }
        let len_prefix = (plain_len as u32).to_be_bytes();
        let mut all: Vec<&[u8]> = Vec::with_capacity(segs.len() + 1);
        let overhead = if self.sasl_wrap {
            all.push(&len_prefix);
            4
        } else {
            0
        };
        all.extend_from_slice(segs);
        let total = plain_len + overhead;
        let plain_base = self.plain;
        let mut done = 0usize;
        while done < total {
            if self.calls > 0 && !self.pause.is_zero() {
                thread::sleep(self.pause);
            }
            let rem = skip_segments(&all, done);
            let r = if self.sendfile_after.is_some_and(|n| self.messages >= n) {
                self.sendfile_calls += 1;
                sys_sendfile(self.fd, &rem)
            } else {
                sys_send(self.fd, self.how, &rem)
            };
            self.calls += 1;
            match r {
                Ok(n) => {
                    let want: usize = rem.iter().map(|s| s.len()).sum();
                    if n < want {
                        self.short_writes += 1;
                    }
                    self.bytes += n as u64;
                    let moved = take_segments(&rem, n);
                    self.obs.lock().unwrap().feed(self.dir, &moved);
                    done += n;
                    self.plain = plain_base + done.saturating_sub(overhead) as u64;
                    while let Some(&(end, t)) = self.pending.front() {
                        if end > self.plain {
                            break;
                        }
                        self.pending.pop_front();
                        self.messages += 1;
                        *self.by_type.entry(t).or_default() += 1;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if !self.nonblock {
                        return Err(timed_out("writing"));
                    }
                    self.eagain += 1;
                    self.obs.lock().unwrap().peek(self.dir, &rem);
                    if !wait_fd(self.fd, libc::POLLOUT, self.timeout)? {
                        return Err(timed_out("waiting for POLLOUT"));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Link-phase bytes (no message accounting) in one call.
    pub(crate) fn link_call(&mut self, segs: &[&[u8]]) -> io::Result<()> {
        self.planned += segs.iter().map(|s| s.len() as u64).sum::<u64>();
        self.call(segs)
    }

    /// Junk in the data stream (`--garbage-at`): one call, counted in `junk_bytes`, no message.
    pub(crate) fn junk_call(&mut self, junk: &[u8]) -> io::Result<()> {
        self.planned += junk.len() as u64;
        self.call(&[junk])?;
        self.junk_bytes += junk.len() as u64;
        Ok(())
    }

    /// Marks the end of the link phase for this direction.
    pub(crate) fn start_data(&mut self, kind: HeaderKind) {
        self.kind = kind;
        self.link_bytes = Some(self.bytes);
    }

    pub(crate) fn next_header(&mut self, msg_type: u16, body_len: usize) -> Vec<u8> {
        let h = wire::header(self.kind, self.next_serial, msg_type, body_len as u32);
        self.next_serial += 1;
        self.planned += (h.len() + body_len) as u64;
        self.pending.push_back((self.planned, msg_type));
        h
    }

    /// Sends `msgs` (one call for a batch of several; the split options for a single one).
    pub(crate) fn send_messages(&mut self, msgs: &[(u16, &[u8])], p: &Pattern) -> io::Result<()> {
        let hl = self.kind.header_len();
        if p.split_at >= hl && (p.split_header || p.iov_split) {
            return Err(proto_err(format!(
                "--split-at {} is not inside a {hl}-byte header",
                p.split_at
            )));
        }
        let k = p.split_at;
        if msgs.len() > 1 {
            let hdrs: Vec<Vec<u8>> = msgs
                .iter()
                .map(|(t, b)| self.next_header(*t, b.len()))
                .collect();
            let mut segs: Vec<&[u8]> = Vec::new();
            for (h, (_, b)) in hdrs.iter().zip(msgs) {
                if p.iov_split {
                    segs.extend([&h[..k], &h[k..]]);
                } else {
                    segs.push(h);
                }
                if !b.is_empty() {
                    segs.push(b);
                }
            }
            return self.call(&segs);
        }
        for (t, body) in msgs {
            let h = self.next_header(*t, body.len());
            let chunks: Vec<&[u8]> = match p.chunk {
                Some(c) => body.chunks(c).collect(),
                None if body.is_empty() => Vec::new(),
                None => vec![body],
            };
            let mut first: Vec<&[u8]> = Vec::new();
            if p.split_header {
                self.call(&[&h[..k]])?;
                first.push(&h[k..]);
            } else if p.iov_split {
                first.extend([&h[..k], &h[k..]]);
            } else {
                first.push(&h);
            }
            if let Some(c0) = chunks.first() {
                first.push(c0);
            }
            self.call(&first)?;
            for c in chunks.iter().skip(1) {
                self.call(&[c])?;
            }
        }
        Ok(())
    }

    pub(crate) fn json(&self) -> Value {
        let link = self.link_bytes.unwrap_or(self.bytes);
        json!({
            "direction": self.dir.name(),
            "bytes": self.bytes,
            "link_bytes": link,
            "data_bytes": self.bytes - link,
            "messages": self.messages,
            "by_type": by_type_json(&self.by_type),
            "unfinished_messages": self.pending.len(),
            "calls": self.calls,
            "eagain": self.eagain,
            "short_writes": self.short_writes,
            "junk_bytes": self.junk_bytes,
            "sendfile_calls": self.sendfile_calls,
        })
    }
}

/// `segs` without its first `skip` bytes.
pub(crate) fn skip_segments<'a>(segs: &[&'a [u8]], mut skip: usize) -> Vec<&'a [u8]> {
    let mut out = Vec::with_capacity(segs.len());
    for s in segs {
        if skip >= s.len() {
            skip -= s.len();
        } else {
            out.push(&s[skip..]);
            skip = 0;
        }
    }
    out
}

/// The first `n` bytes of `segs`.
pub(crate) fn take_segments<'a>(segs: &[&'a [u8]], mut n: usize) -> Vec<&'a [u8]> {
    let mut out = Vec::with_capacity(segs.len());
    for s in segs {
        if n == 0 {
            break;
        }
        let k = s.len().min(n);
        out.push(&s[..k]);
        n -= k;
    }
    out
}
