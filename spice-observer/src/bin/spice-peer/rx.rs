//! Receiving: the reader issues the read calls, buffers and parses.

use super::*;

/// One parsed data message.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Msg {
    pub(crate) msg_type: u16,
    pub(crate) size: u32,
    /// First 8 body bytes (zero-padded).
    pub(crate) prefix: [u8; 8],
}

impl Msg {
    pub(crate) fn word(&self, i: usize) -> u32 {
        u32::from_le_bytes(self.prefix[i * 4..i * 4 + 4].try_into().unwrap())
    }
}

/// This side's reader: issues the read calls, buffers, and parses.
pub(crate) struct Rx {
    pub(crate) fd: RawFd,
    pub(crate) how: RecvSyscall,
    pub(crate) dir: Dir,
    pub(crate) size: usize,
    pub(crate) iovs: usize,
    pub(crate) exact: bool,
    pub(crate) nonblock: bool,
    pub(crate) pause: Duration,
    pub(crate) timeout: Duration,
    pub(crate) obs: Arc<Mutex<Observe>>,
    pub(crate) buf: Vec<u8>,
    pub(crate) rpos: usize,
    /// Unwrap SASL-shaped blobs in the data phase.
    pub(crate) sasl: bool,
    pub(crate) plain: Vec<u8>,
    pub(crate) ppos: usize,
    pub(crate) bytes: u64,
    pub(crate) consumed: u64,
    pub(crate) calls: u64,
    pub(crate) eagain: u64,
    pub(crate) eof: bool,
    pub(crate) link_bytes: Option<u64>,
    pub(crate) messages: u64,
    pub(crate) by_type: BTreeMap<u16, u64>,
    /// Data bytes discarded by `--skip-at` (not messages).
    pub(crate) junk_bytes: u64,
}

impl Rx {
    pub(crate) fn new(fd: RawFd, dir: Dir, c: &Common, obs: Arc<Mutex<Observe>>) -> Rx {
        Rx {
            fd,
            how: c.recv_syscall,
            dir,
            size: c.recv_size,
            iovs: c.recv_iovs,
            exact: c.recv_exact,
            nonblock: c.nonblock,
            pause: Duration::from_millis(c.recv_pause_ms),
            timeout: c.timeout(),
            obs,
            buf: Vec::new(),
            rpos: 0,
            sasl: false,
            plain: Vec::new(),
            ppos: 0,
            bytes: 0,
            consumed: 0,
            calls: 0,
            eagain: 0,
            eof: false,
            link_bytes: None,
            messages: 0,
            by_type: BTreeMap::new(),
            junk_bytes: 0,
        }
    }

    pub(crate) fn avail(&self) -> usize {
        self.buf.len() - self.rpos
    }

    /// One read call (repeated only on EINTR / EAGAIN); returns the bytes it moved, 0 at EOF.
    pub(crate) fn fill(&mut self, want: usize) -> io::Result<usize> {
        if self.eof {
            return Ok(0);
        }
        let req = if self.exact {
            want.clamp(1, self.size)
        } else {
            self.size
        };
        if self.rpos == self.buf.len() {
            self.buf.clear();
            self.rpos = 0;
        } else if self.rpos > (1 << 20) {
            self.buf.drain(..self.rpos);
            self.rpos = 0;
        }
        let old = self.buf.len();
        self.buf.resize(old + req, 0);
        if !self.pause.is_zero() {
            thread::sleep(self.pause);
        }
        loop {
            let r = sys_recv(self.fd, self.how, &mut self.buf[old..], self.iovs);
            self.calls += 1;
            match r {
                Ok(n) => {
                    self.buf.truncate(old + n);
                    self.bytes += n as u64;
                    if n == 0 {
                        self.eof = true;
                    } else {
                        // Feed as the iovecs the kernel filled.
                        let data = &self.buf[old..old + n];
                        let mut segs = Vec::new();
                        let mut off = 0;
                        for sz in iov_sizes(req, self.iovs) {
                            if off >= n {
                                break;
                            }
                            let k = sz.min(n - off);
                            segs.push(&data[off..off + k]);
                            off += k;
                        }
                        self.obs.lock().unwrap().feed(self.dir, &segs);
                    }
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if !self.nonblock || !wait_fd(self.fd, libc::POLLIN, self.timeout)? {
                        self.buf.truncate(old);
                        return Err(timed_out("reading"));
                    }
                    self.eagain += 1;
                }
                Err(e) => {
                    self.buf.truncate(old);
                    return Err(e);
                }
            }
        }
    }

    /// Exactly `n` raw bytes (link phase, SASL blobs).
    pub(crate) fn take_raw(&mut self, n: usize) -> io::Result<Vec<u8>> {
        while self.avail() < n {
            if self.fill(n - self.avail())? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("peer closed, {n} bytes expected"),
                ));
            }
        }
        let v = self.buf[self.rpos..self.rpos + n].to_vec();
        self.rpos += n;
        self.consumed += n as u64;
        Ok(v)
    }

    pub(crate) fn u32_raw(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.take_raw(4)?.try_into().unwrap()))
    }

    /// Reads and discards until EOF.
    pub(crate) fn drain(&mut self) -> io::Result<()> {
        loop {
            self.consumed += self.avail() as u64;
            self.rpos = self.buf.len();
            if self.fill(self.size)? == 0 {
                return Ok(());
            }
        }
    }

    pub(crate) fn start_data(&mut self) {
        self.link_bytes = Some(self.consumed);
    }

    pub(crate) fn data(&self) -> &[u8] {
        if self.sasl {
            &self.plain[self.ppos..]
        } else {
            &self.buf[self.rpos..]
        }
    }

    pub(crate) fn advance(&mut self, n: usize) {
        if self.sasl {
            self.ppos += n;
        } else {
            self.rpos += n;
            self.consumed += n as u64;
        }
    }

    /// Makes more data bytes available; Ok(false) at EOF.
    pub(crate) fn data_fill(&mut self, want: usize) -> io::Result<bool> {
        if !self.sasl {
            return Ok(self.fill(want)? > 0);
        }
        if self.avail() == 0 && self.fill(4)? == 0 {
            return Ok(false);
        }
        let len = u32::from_be_bytes(self.take_raw(4)?.try_into().unwrap()) as usize;
        let blob = self.take_raw(len)?;
        if self.ppos == self.plain.len() {
            self.plain.clear();
            self.ppos = 0;
        }
        self.plain.extend_from_slice(&blob);
        Ok(true)
    }

    /// Reads and discards exactly `n` data bytes (`--skip-at`), counted in `junk_bytes`.
    pub(crate) fn skip_data(&mut self, n: usize) -> io::Result<()> {
        let mut left = n;
        while left > 0 {
            if self.data().is_empty() {
                if !self.data_fill(left)? {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("peer closed, {left} junk bytes still expected"),
                    ));
                }
                continue;
            }
            let k = self.data().len().min(left);
            self.advance(k);
            left -= k;
        }
        self.junk_bytes += n as u64;
        Ok(())
    }

    /// The next data message; None on EOF at a message boundary.
    pub(crate) fn read_message(&mut self, kind: HeaderKind) -> io::Result<Option<Msg>> {
        let hl = kind.header_len();
        let mut hdr = Vec::with_capacity(hl);
        while hdr.len() < hl {
            if self.data().is_empty() {
                if !self.data_fill(hl - hdr.len())? {
                    if hdr.is_empty() {
                        return Ok(None);
                    }
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "peer closed inside a header",
                    ));
                }
                continue;
            }
            let k = self.data().len().min(hl - hdr.len());
            hdr.extend_from_slice(&self.data()[..k]);
            self.advance(k);
        }
        let (msg_type, size) = match kind {
            HeaderKind::Mini => (
                u16::from_le_bytes([hdr[0], hdr[1]]),
                u32::from_le_bytes(hdr[2..6].try_into().unwrap()),
            ),
            HeaderKind::Full => (
                u16::from_le_bytes([hdr[8], hdr[9]]),
                u32::from_le_bytes(hdr[10..14].try_into().unwrap()),
            ),
        };
        if msg_type == 0 {
            return Err(proto_err("data header with type 0"));
        }
        let mut prefix = [0u8; 8];
        let mut got = 0usize;
        let mut remaining = size as usize;
        while remaining > 0 {
            if self.data().is_empty() {
                if !self.data_fill(remaining)? {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "peer closed inside a body",
                    ));
                }
                continue;
            }
            let k = self.data().len().min(remaining);
            if got < 8 {
                let c = k.min(8 - got);
                prefix[got..got + c].copy_from_slice(&self.data()[..c]);
            }
            self.advance(k);
            got += k;
            remaining -= k;
        }
        self.messages += 1;
        *self.by_type.entry(msg_type).or_default() += 1;
        Ok(Some(Msg {
            msg_type,
            size,
            prefix,
        }))
    }

    pub(crate) fn json(&self) -> Value {
        let link = self.link_bytes.unwrap_or(self.bytes);
        json!({
            "direction": self.dir.name(),
            "bytes": self.bytes,
            "link_bytes": link,
            "data_bytes": self.bytes.saturating_sub(link),
            "messages": self.messages,
            "by_type": by_type_json(&self.by_type),
            "calls": self.calls,
            "eagain": self.eagain,
            "eof": self.eof,
            "junk_bytes": self.junk_bytes,
        })
    }
}
