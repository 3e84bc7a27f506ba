//! Raw syscalls: libc on the socket fd, so that the exact syscall is issued.

use super::*;

pub(crate) fn iovecs(segs: &[&[u8]]) -> Vec<libc::iovec> {
    segs.iter()
        .map(|s| libc::iovec {
            iov_base: s.as_ptr() as *mut libc::c_void,
            iov_len: s.len(),
        })
        .collect()
}

/// One send call of `segs` (write/sendto get them concatenated into one buffer).
pub(crate) fn sys_send(fd: RawFd, how: SendSyscall, segs: &[&[u8]]) -> io::Result<usize> {
    let r = match how {
        SendSyscall::Write | SendSyscall::Sendto => {
            let joined;
            let buf: &[u8] = if segs.len() == 1 {
                segs[0]
            } else {
                joined = segs.concat();
                &joined
            };
            // SAFETY: `buf` is a valid readable slice for the duration of the call.
            unsafe {
                if how == SendSyscall::Write {
                    libc::write(fd, buf.as_ptr().cast(), buf.len())
                } else {
                    libc::sendto(
                        fd,
                        buf.as_ptr().cast(),
                        buf.len(),
                        libc::MSG_NOSIGNAL,
                        std::ptr::null(),
                        0,
                    )
                }
            }
        }
        SendSyscall::Writev => {
            let iov = iovecs(segs);
            // SAFETY: every iovec points into a live slice of `segs`.
            unsafe { libc::writev(fd, iov.as_ptr(), iov.len() as libc::c_int) }
        }
        SendSyscall::Sendmsg => {
            let mut iov = iovecs(segs);
            // SAFETY: a zeroed msghdr is valid (no name, no control); iov outlives the call.
            unsafe {
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = iov.as_mut_ptr();
                msg.msg_iovlen = iov.len() as _;
                libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL)
            }
        }
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// One sendfile(2) of `segs` (concatenated) to the socket, from a memfd made for the call: the
/// socket's bytes come from the page cache, never from a user buffer.
pub(crate) fn sys_sendfile(fd: RawFd, segs: &[&[u8]]) -> io::Result<usize> {
    use std::os::fd::FromRawFd;
    let data = segs.concat();
    // SAFETY: a NUL-terminated name; the returned fd is owned by `file` from here on.
    let mfd = unsafe { libc::memfd_create(c"spice-peer-sendfile".as_ptr(), libc::MFD_CLOEXEC) };
    if mfd < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut file = unsafe { std::fs::File::from_raw_fd(mfd) };
    file.write_all(&data)?;
    let mut off: libc::off_t = 0;
    // SAFETY: both fds are open; `off` is a valid offset pointer for the call.
    let r = unsafe { libc::sendfile(fd, mfd, &mut off, data.len()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// Sizes of `iovs` near-equal parts of a `len`-byte buffer (no empty parts).
pub(crate) fn iov_sizes(len: usize, iovs: usize) -> Vec<usize> {
    let n = iovs.min(len).max(1);
    (0..n).map(|i| len / n + usize::from(i < len % n)).collect()
}

/// One receive call into `buf` (readv/recvmsg split it into `iovs` parts).
pub(crate) fn sys_recv(
    fd: RawFd,
    how: RecvSyscall,
    buf: &mut [u8],
    iovs: usize,
) -> io::Result<usize> {
    // SAFETY: all pointers come from `buf`, which is valid and writable for its length.
    let r = unsafe {
        match how {
            RecvSyscall::Read => libc::read(fd, buf.as_mut_ptr().cast(), buf.len()),
            RecvSyscall::Recvfrom => libc::recvfrom(
                fd,
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            ),
            RecvSyscall::Readv | RecvSyscall::Recvmsg => {
                let mut iov = Vec::new();
                let mut off = 0;
                for sz in iov_sizes(buf.len(), iovs) {
                    iov.push(libc::iovec {
                        iov_base: buf.as_mut_ptr().add(off).cast(),
                        iov_len: sz,
                    });
                    off += sz;
                }
                if how == RecvSyscall::Readv {
                    libc::readv(fd, iov.as_ptr(), iov.len() as libc::c_int)
                } else {
                    let mut msg: libc::msghdr = std::mem::zeroed();
                    msg.msg_iov = iov.as_mut_ptr();
                    msg.msg_iovlen = iov.len() as _;
                    libc::recvmsg(fd, &mut msg, 0)
                }
            }
        }
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// poll() one fd; Ok(false) on timeout.
pub(crate) fn wait_fd(fd: RawFd, events: libc::c_short, timeout: Duration) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    loop {
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(r > 0);
    }
}

pub(crate) fn set_int_opt(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    v: u32,
) -> io::Result<()> {
    let v = v as libc::c_int;
    // SAFETY: pointer to a live c_int of the given size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as _,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

pub(crate) fn timed_out(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, format!("timed out {what}"))
}

pub(crate) fn proto_err(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}
