//! `spice-peer load`: a SPICE load generator for benchmarks.
//!
//! The process that runs `load` plays spice-server for every channel (the observer's `--pid`
//! target, like qemu). It starts ONE other process (`spice-peer load-client`, hidden) that
//! plays the spice-gtk clients. That process is detached (double fork: its parent exits at
//! once), so it is not a descendant of the server and `observe --pid <server>`, which follows
//! a process's children, does not watch it; it is reaped by init or by the nearest
//! subreaper (`cargo xtask bench` is one).
//!
//! Each channel is one TCP connection over loopback: the link phase of `spice-peer server` /
//! `client` (`server_link`, `client_link`: byte-exact, docs/spice-protocol.md §1), SET_ACK(W),
//! then data messages of `--body-size` bytes under spice-server's ACK gate (no message
//! starts while more than 2W are unacknowledged, §3.4; the same [`AckState`] and
//! `server_reader` as `spice-peer server --set-ack`), while the client ACKs every W messages
//! with spice-gtk's cadence (`client_reader`, §3.8). All channels are display channels; the
//! channels of session `s` carry connection id [`session_connection_id`]`(s)` and channel ids
//! 0..M.
//!
//! Stdout: `hold pid <server> clients <client>` (with `--hold`, before any connection; then
//! one line on stdin starts the run), `pid <server> clients <client>` once every channel is
//! linked (streaming starts right after), and at the end one JSON line: per channel
//! (`channels`) the session, connection id, channel type and id, `local_addr` / `peer_addr`
//! (the server's socket), `messages_sent` (SET_ACK included) and `data_messages_sent`,
//! `bytes_sent` (data phase, headers included), `write_calls`, `gate_waits`, `acks_received`,
//! `ack_syncs_received`, `messages_received` / `bytes_received` (the client's ACK_SYNC and
//! ACKs), the client's `messages_received_by_client`, `acks_sent_by_client`, …, and
//! `disagreement` (why the two ends differ, or null); `totals`; `elapsed_s` (from the common
//! start to the last writer's stop) and `data_messages_per_s`. These are the generator's own
//! counts, from what the syscalls returned on both ends.
//! Exit status 0 when every channel ran and both ends agree (sent = received, ACKs =
//! floor((messages − 1) / W) with the SET_ACK not counted, as spice-gtk counts), 1 otherwise.

use super::*;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

/// Messages per second per channel, from a deadline schedule: message `n` (0-based) of a
/// channel is due at `t0 + n / rate`.
pub(crate) fn due_at(t0: Instant, n: u64, rate: f64) -> Instant {
    t0 + Duration::from_secs_f64(n as f64 / rate)
}

/// The connection id of session `s` in every link message of its channels (spice-gtk sends
/// the session id main's INIT gave it; no main channel here, so a made-up one per session).
pub(crate) fn session_connection_id(s: u32) -> u32 {
    0x5e55_0000 + s
}

/// ACKs a spice-gtk client sends for `messages` received after (and including) one SET_ACK of
/// window `w`: the SET_ACK is not counted, then one ACK per W messages (§3.8).
pub(crate) fn expected_acks(messages: u64, w: u32) -> u64 {
    if w == 0 {
        0
    } else {
        messages.saturating_sub(1) / w as u64
    }
}

#[derive(Clone, Debug, Args)]
pub(crate) struct LoadArgs {
    /// Sessions (each a connection id of its own).
    #[arg(long, default_value_t = 1)]
    pub(crate) sessions: u32,
    /// Display channels per session (channel ids 0..M), one TCP connection each.
    #[arg(long, default_value_t = 1)]
    pub(crate) channels: u32,
    /// Body bytes of each data message (the mini header's 6 bytes come on top).
    #[arg(long, default_value_t = 200)]
    pub(crate) body_size: u32,
    /// Messages per second per channel, held on a deadline schedule (catching up after a
    /// wait); 0 = as fast as the window and the socket allow (saturated).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) rate: f64,
    /// Messages per write call (with a rate, a call goes out once K messages are due).
    #[arg(long, default_value_t = 1)]
    pub(crate) batch: usize,
    /// write: one buffer per call; writev: spice-server-like, header and body as separate
    /// iovecs (2K per call).
    #[arg(long, value_enum, default_value_t = SendSyscall::Write)]
    pub(crate) send_syscall: SendSyscall,
    /// ACK window W of the SET_ACK.
    #[arg(long, default_value_t = 20)]
    pub(crate) window: u32,
    /// Seconds of streaming, from when every channel is linked.
    #[arg(long, default_value_t = 10.0)]
    pub(crate) duration: f64,
    /// Port to listen on (127.0.0.1; 0 = any free port).
    #[arg(long, default_value_t = 0)]
    pub(crate) port: u16,
    /// Message type of the data messages (default DRAW_COPY).
    #[arg(long, default_value_t = 304)]
    pub(crate) msg_type: u16,
    /// Print `hold pid <server> clients <client>` once listening, then wait for one line on
    /// stdin before the clients connect (time to attach an observer that sees every link
    /// phase).
    #[arg(long)]
    pub(crate) hold: bool,
}

impl LoadArgs {
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.sessions == 0 || self.channels == 0 || self.sessions * self.channels > 1000 {
            return Err("--sessions and --channels must be ≥ 1, at most 1000 channels".into());
        }
        if !(self.rate >= 0.0 && self.rate.is_finite()) {
            return Err("--rate must be a number ≥ 0".into());
        }
        if self.batch == 0 || self.batch > 300 {
            return Err("--batch must be 1..=300".into());
        }
        if !matches!(self.send_syscall, SendSyscall::Write | SendSyscall::Writev) {
            return Err("--send-syscall must be write or writev".into());
        }
        if self.window == 0 {
            return Err("--window must be at least 1".into());
        }
        if !(self.duration > 0.0 && self.duration.is_finite()) {
            return Err("--duration must be a number of seconds > 0".into());
        }
        if self.msg_type == 0 {
            return Err("--msg-type must not be 0".into());
        }
        Ok(())
    }
}

/// The hidden client side: connects every channel, links, ACKs, reports.
#[derive(Clone, Debug, Args)]
pub(crate) struct LoadClientArgs {
    /// Server address.
    #[arg(long)]
    pub(crate) connect: String,
    #[arg(long)]
    pub(crate) sessions: u32,
    #[arg(long)]
    pub(crate) channels: u32,
}

/// The data messages of one write call, built once: K copies of header + body, contiguous
/// for `write`, and the iovec split (header, body) for `writev`. Full headers (serials)
/// are rewritten in place before each call.
pub(crate) struct Batch {
    kind: HeaderKind,
    msg_type: u16,
    body_len: usize,
    /// K messages back to back.
    buf: Vec<u8>,
    next_serial: u64,
}

impl Batch {
    pub(crate) fn new(kind: HeaderKind, msg_type: u16, body: &[u8], k: usize) -> Batch {
        let mut buf = Vec::with_capacity(k * (kind.header_len() + body.len()));
        for _ in 0..k {
            buf.extend_from_slice(&wire::header(kind, 0, msg_type, body.len() as u32));
            buf.extend_from_slice(body);
        }
        Batch {
            kind,
            msg_type,
            body_len: body.len(),
            buf,
            next_serial: 1,
        }
    }

    pub(crate) fn msg_len(&self) -> usize {
        self.kind.header_len() + self.body_len
    }

    /// Sets the serials of the first `k` messages (full headers only) and takes them.
    fn number(&mut self, k: usize) {
        if self.kind == HeaderKind::Full {
            let n = self.msg_len();
            for i in 0..k {
                let h = wire::header(
                    self.kind,
                    self.next_serial,
                    self.msg_type,
                    self.body_len as u32,
                );
                self.buf[i * n..i * n + h.len()].copy_from_slice(&h);
                self.next_serial += 1;
            }
        }
    }

    /// The segments of the first `k` messages: one for write, header and body apart for
    /// writev (an empty body adds no iovec).
    pub(crate) fn segments(&self, k: usize, how: SendSyscall) -> Vec<&[u8]> {
        let n = self.msg_len();
        let hl = self.kind.header_len();
        if how == SendSyscall::Write {
            return vec![&self.buf[..k * n]];
        }
        let mut v = Vec::with_capacity(2 * k);
        for i in 0..k {
            let m = &self.buf[i * n..(i + 1) * n];
            v.push(&m[..hl]);
            if self.body_len > 0 {
                v.push(&m[hl..]);
            }
        }
        v
    }
}

/// The server side's counts of one channel's data phase (the lean writer).
#[derive(Debug, Default, Clone)]
pub(crate) struct WriterCounts {
    /// Data messages whose bytes the kernel accepted entirely.
    pub(crate) messages: u64,
    pub(crate) bytes: u64,
    pub(crate) calls: u64,
    pub(crate) short_writes: u64,
}

/// Writes the first `k` messages of `batch` in one call (repeated on the remainder after a
/// short write or EINTR), counting what the kernel accepted.
pub(crate) fn write_batch(
    fd: RawFd,
    how: SendSyscall,
    batch: &mut Batch,
    k: usize,
    counts: &mut WriterCounts,
) -> io::Result<()> {
    batch.number(k);
    let segs = batch.segments(k, how);
    let total = k * batch.msg_len();
    let mut done = 0usize;
    let res = loop {
        if done == total {
            break Ok(());
        }
        let rem = skip_segments(&segs, done);
        let r = sys_send(fd, how, &rem);
        counts.calls += 1;
        match r {
            Ok(n) => {
                if n < total - done {
                    counts.short_writes += 1;
                }
                done += n;
                counts.bytes += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    counts.messages += (done / batch.msg_len()) as u64;
    res
}

/// When one channel starts streaming, shared between the channel threads and main.
#[derive(Default)]
pub(crate) struct Start {
    linked: usize,
    failed: usize,
    /// Set by main once every channel is linked: the common t0 and the end of streaming.
    go: Option<(Instant, Instant)>,
    abort: bool,
}

type Shared<T> = Arc<(Mutex<T>, Condvar)>;

/// One channel's result on the server side.
#[derive(Debug, Default)]
pub(crate) struct ServerChannel {
    session: u32,
    connection_id: u32,
    channel_type: u8,
    channel_id: u8,
    local: String,
    peer: String,
    /// SET_ACK + data messages fully sent.
    messages_sent: u64,
    data_messages_sent: u64,
    bytes_sent: u64,
    write_calls: u64,
    short_writes: u64,
    gate_waits: u64,
    acks_received: u64,
    acks_matched: u64,
    ack_syncs_received: u64,
    messages_received: u64,
    bytes_received: u64,
    max_count: i64,
    /// When this channel's writer stopped (for the run's elapsed time).
    stopped: Option<Instant>,
    error: Option<String>,
}

/// One channel's result on the client side (the JSON the client process prints).
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct ClientChannel {
    pub(crate) local: String,
    pub(crate) peer: String,
    pub(crate) messages_received: u64,
    pub(crate) bytes_received: u64,
    pub(crate) acks_sent: u64,
    pub(crate) ack_syncs_sent: u64,
    pub(crate) messages_sent: u64,
    pub(crate) bytes_sent: u64,
    pub(crate) error: Option<String>,
}

impl ClientChannel {
    fn json(&self) -> Value {
        json!({
            "local": self.local, "peer": self.peer,
            "messages_received": self.messages_received, "bytes_received": self.bytes_received,
            "acks_sent": self.acks_sent, "ack_syncs_sent": self.ack_syncs_sent,
            "messages_sent": self.messages_sent, "bytes_sent": self.bytes_sent,
            "error": self.error,
        })
    }

    fn from_json(v: &Value) -> Result<ClientChannel, String> {
        let s = |k: &str| {
            v[k].as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("client report: {k} missing"))
        };
        let n = |k: &str| {
            v[k].as_u64()
                .ok_or_else(|| format!("client report: {k} missing"))
        };
        Ok(ClientChannel {
            local: s("local")?,
            peer: s("peer")?,
            messages_received: n("messages_received")?,
            bytes_received: n("bytes_received")?,
            acks_sent: n("acks_sent")?,
            ack_syncs_sent: n("ack_syncs_sent")?,
            messages_sent: n("messages_sent")?,
            bytes_sent: n("bytes_sent")?,
            error: v["error"].as_str().map(str::to_string),
        })
    }
}

/// Why the two ends of one channel disagree, or None: every message sent was received and
/// the client ACKed exactly as spice-gtk would for what it received with window `w`.
pub(crate) fn disagreement(s: &ServerChannel, c: &ClientChannel, w: u32) -> Option<String> {
    let mut why = Vec::new();
    if s.messages_sent != c.messages_received {
        why.push(format!(
            "server sent {} messages, client received {}",
            s.messages_sent, c.messages_received
        ));
    }
    if s.bytes_sent != c.bytes_received {
        why.push(format!(
            "server sent {} data bytes, client received {}",
            s.bytes_sent, c.bytes_received
        ));
    }
    if s.acks_received != c.acks_sent || s.ack_syncs_received != c.ack_syncs_sent {
        why.push(format!(
            "client sent {} ACKs and {} ACK_SYNCs, server read {} and {}",
            c.acks_sent, c.ack_syncs_sent, s.acks_received, s.ack_syncs_received
        ));
    }
    if s.messages_received != c.messages_sent || s.bytes_received != c.bytes_sent {
        why.push(format!(
            "client sent {} messages ({} bytes), server read {} ({})",
            c.messages_sent, c.bytes_sent, s.messages_received, s.bytes_received
        ));
    }
    let want = expected_acks(c.messages_received, w);
    if c.acks_sent != want {
        why.push(format!(
            "client sent {} ACKs for {} messages at W={w}, spice-gtk's cadence gives {want}",
            c.acks_sent, c.messages_received
        ));
    }
    if c.ack_syncs_sent != 1 {
        why.push(format!("{} ACK_SYNCs for one SET_ACK", c.ack_syncs_sent));
    }
    (!why.is_empty()).then(|| why.join("; "))
}

/// `spice-peer server` options for the link phase of one load channel (the CLI's own
/// defaults, so the link bytes are `spice-peer server`'s).
fn server_args(a: &LoadArgs) -> ServerArgs {
    let w = a.window.to_string();
    let how = format!("{:?}", a.send_syscall).to_lowercase();
    let cli = Cli::try_parse_from([
        "spice-peer",
        "server",
        "--listen",
        "127.0.0.1:0",
        "--set-ack",
        "--window",
        &w,
        "--send-syscall",
        &how,
    ])
    .expect("built-in server options");
    match cli.cmd {
        Cmd::Server(s) => s,
        _ => unreachable!(),
    }
}

fn client_args(addr: &str, channel_id: u8, connection_id: u32) -> ClientArgs {
    let (id, conn) = (channel_id.to_string(), connection_id.to_string());
    let cli = Cli::try_parse_from([
        "spice-peer",
        "client",
        "--connect",
        addr,
        "--channel-type",
        "2",
        "--channel-id",
        &id,
        "--connection-id",
        &conn,
    ])
    .expect("built-in client options");
    match cli.cmd {
        Cmd::Client(c) => c,
        _ => unreachable!(),
    }
}

fn addrs(s: &TcpStream) -> (String, String) {
    let f = |r: io::Result<std::net::SocketAddr>| r.map(|a| a.to_string()).unwrap_or_default();
    (f(s.local_addr()), f(s.peer_addr()))
}

/// Starts the client process detached and returns (its pid, its stdin, its stdout).
fn spawn_client(
    addr: &str,
    a: &LoadArgs,
) -> io::Result<(
    u32,
    std::process::ChildStdin,
    BufReader<std::process::ChildStdout>,
)> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(["load-client", "--connect", addr])
        .args(["--sessions", &a.sessions.to_string()])
        .args(["--channels", &a.channels.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    // SAFETY: between fork and exec only fork, setsid and _exit are called (this process
    // has no other thread yet). The intermediate child exits at once, so the client is
    // re-parented away from this process (not its descendant) and execs the command.
    unsafe {
        cmd.pre_exec(|| match libc::fork() {
            -1 => Err(io::Error::last_os_error()),
            0 => {
                libc::setsid();
                Ok(())
            }
            _ => libc::_exit(0),
        });
    }
    let mut child = cmd.spawn()?;
    let stdin = child.stdin.take().expect("piped stdin");
    let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
    child.wait()?; // the intermediate, which exited at once
    let mut line = String::new();
    stdout.read_line(&mut line)?;
    let pid = line
        .trim()
        .strip_prefix("client-pid ")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| proto_err(format!("client process said {line:?}")))?;
    Ok((pid, stdin, stdout))
}

/// Runs the server side of the load; returns the JSON report and whether all went well.
pub(crate) fn run_load(a: &LoadArgs) -> (Value, bool) {
    match load_inner(a) {
        Ok(r) => r,
        Err(e) => (json!({"error": e.to_string()}), false),
    }
}

fn load_inner(a: &LoadArgs) -> io::Result<(Value, bool)> {
    let listener = TcpListener::bind(("127.0.0.1", a.port))?;
    let addr = listener.local_addr()?.to_string();
    let (client_pid, mut client_in, mut client_out) = spawn_client(&addr, a)?;
    let me = std::process::id();
    let say = |line: String| {
        let mut out = io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    };
    if a.hold {
        say(format!("hold pid {me} clients {client_pid}"));
        let mut line = String::new();
        if io::stdin().read_line(&mut line)? == 0 {
            return Err(proto_err("stdin closed before the start line"));
        }
    }
    writeln!(client_in, "go")?;
    client_in.flush()?;
    // SAFETY: prctl with an integer argument. A 1 ns timer slack makes the rate schedule's
    // sleeps end on time (the default 50 µs would bunch messages at high rates).
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };

    let total = (a.sessions * a.channels) as usize;
    let start: Shared<Start> = Arc::new((Mutex::new(Start::default()), Condvar::new()));
    let sa = Arc::new(server_args(a));
    let la = Arc::new(a.clone());
    let mut handles = Vec::new();
    for _ in 0..total {
        let stream = accept_one(&listener, sa.common.timeout())?;
        let (sa, la, start) = (sa.clone(), la.clone(), start.clone());
        handles.push(thread::spawn(move || {
            serve_channel(stream, &sa, &la, &start)
        }));
    }
    drop(listener);
    // Every channel linked (or one failed): start them all at one t0.
    {
        let (lock, cv) = &*start;
        let mut s = lock.lock().unwrap();
        let deadline = Instant::now() + sa.common.timeout();
        while s.linked + s.failed < total && Instant::now() < deadline {
            s = cv.wait_timeout(s, Duration::from_millis(100)).unwrap().0;
        }
        if s.linked == total {
            say(format!("pid {me} clients {client_pid}"));
            let t0 = Instant::now();
            s.go = Some((t0, t0 + Duration::from_secs_f64(a.duration)));
        } else {
            s.abort = true;
        }
        cv.notify_all();
    }
    let t0 = start.0.lock().unwrap().go.map(|g| g.0);
    let mut server: Vec<ServerChannel> = handles
        .into_iter()
        .map(|h| h.join().expect("channel thread panicked"))
        .collect();
    drop(client_in);
    // The client's report: one JSON line once all its channels ended.
    let mut line = String::new();
    client_out.read_line(&mut line)?;
    let client: Value = serde_json::from_str(line.trim())
        .map_err(|e| proto_err(format!("client report {line:?}: {e}")))?;
    let mut clients: Vec<ClientChannel> = Vec::new();
    for c in client["channels"].as_array().into_iter().flatten() {
        clients.push(ClientChannel::from_json(c).map_err(proto_err)?);
    }
    let elapsed = match (t0, server.iter().filter_map(|c| c.stopped).max()) {
        (Some(t0), Some(end)) => end.duration_since(t0).as_secs_f64(),
        _ => 0.0,
    };
    server.sort_by_key(|c| (c.session, c.channel_id));
    let mut ok = client["error"].is_null() && t0.is_some();
    let mut rows = Vec::new();
    let mut tot = [0u64; 10];
    for s in &server {
        let c = clients
            .iter()
            .find(|c| c.local == s.peer && c.peer == s.local)
            .cloned();
        let bad = match &c {
            Some(c) => disagreement(s, c, a.window),
            None => Some("no client report for this connection".into()),
        };
        let c = c.unwrap_or_default();
        ok &= bad.is_none() && s.error.is_none() && c.error.is_none();
        for (t, v) in tot.iter_mut().zip([
            s.messages_sent,
            s.data_messages_sent,
            s.bytes_sent,
            s.write_calls,
            s.acks_received,
            s.messages_received,
            s.bytes_received,
            c.messages_received,
            c.acks_sent,
            s.gate_waits,
        ]) {
            *t += v;
        }
        rows.push(json!({
            "session": s.session, "connection_id": s.connection_id,
            "channel_type": s.channel_type, "channel_id": s.channel_id,
            "local_addr": s.local, "peer_addr": s.peer,
            "messages_sent": s.messages_sent, "data_messages_sent": s.data_messages_sent,
            "bytes_sent": s.bytes_sent, "write_calls": s.write_calls,
            "short_writes": s.short_writes, "gate_waits": s.gate_waits,
            "max_in_flight": s.max_count,
            "acks_received": s.acks_received, "acks_matched": s.acks_matched,
            "ack_syncs_received": s.ack_syncs_received,
            "messages_received": s.messages_received, "bytes_received": s.bytes_received,
            "messages_received_by_client": c.messages_received,
            "bytes_received_by_client": c.bytes_received,
            "acks_sent_by_client": c.acks_sent, "ack_syncs_sent_by_client": c.ack_syncs_sent,
            "messages_sent_by_client": c.messages_sent, "bytes_sent_by_client": c.bytes_sent,
            "error": s.error, "client_error": c.error, "disagreement": bad,
        }));
    }
    let report = json!({
        "server_pid": me, "client_pid": client_pid,
        "sessions": a.sessions, "channels_per_session": a.channels,
        "body_size": a.body_size, "rate_per_channel": a.rate, "batch": a.batch,
        "send_syscall": format!("{:?}", a.send_syscall).to_lowercase(),
        "window": a.window, "duration_s": a.duration,
        "elapsed_s": elapsed,
        "data_messages_per_s": if elapsed > 0.0 { tot[1] as f64 / elapsed } else { 0.0 },
        "channels": rows,
        "totals": {
            "messages_sent": tot[0], "data_messages_sent": tot[1], "bytes_sent": tot[2],
            "write_calls": tot[3], "acks_received": tot[4], "messages_received": tot[5],
            "bytes_received": tot[6], "messages_received_by_client": tot[7],
            "acks_sent_by_client": tot[8], "gate_waits": tot[9],
        },
        "client_error": client["error"],
        "ok": ok,
    });
    Ok((report, ok))
}

/// One channel of the server side: link, SET_ACK, wait for the common start, stream until
/// the end, close the write side and wait for the client to close.
fn serve_channel(
    stream: TcpStream,
    sa: &ServerArgs,
    a: &LoadArgs,
    start: &Shared<Start>,
) -> ServerChannel {
    let mut ch = ServerChannel::default();
    let mut linked = false;
    let r = serve_inner(stream, sa, a, start, &mut ch, &mut linked);
    if let Err(e) = r {
        ch.error = Some(e.to_string());
    }
    if !linked {
        let (lock, cv) = &**start;
        lock.lock().unwrap().failed += 1;
        cv.notify_all();
    }
    ch
}

fn serve_inner(
    stream: TcpStream,
    sa: &ServerArgs,
    a: &LoadArgs,
    start: &Shared<Start>,
    ch: &mut ServerChannel,
    linked: &mut bool,
) -> io::Result<()> {
    let c = &sa.common;
    setup_socket(&stream, c)?;
    let stream = Arc::new(stream);
    (ch.local, ch.peer) = addrs(&stream);
    let fd = stream.as_raw_fd();
    let obs = Arc::new(Mutex::new(Observe::off()));
    let tx = Arc::new(Mutex::new(Tx::new(fd, Dir::S2C, c, obs.clone())));
    let mut rx = Rx::new(fd, Dir::C2S, c, obs);
    let mut link = LinkFacts {
        outcome: "ok",
        ..Default::default()
    };
    if !server_link(sa, &stream, &tx, &mut rx, &mut link)? {
        return Err(proto_err(format!("link ended: {}", link.outcome)));
    }
    ch.connection_id = link.connection_id;
    ch.session = link.connection_id.wrapping_sub(session_connection_id(0));
    ch.channel_type = link.channel_type;
    ch.channel_id = link.channel_id;
    let kind = link.header.unwrap();
    rx.start_data();
    tx.lock().unwrap().start_data(kind);
    let acks: Shared<AckState> = Arc::new((Mutex::new(AckState::default()), Condvar::new()));
    {
        let mut s = acks.0.lock().unwrap();
        s.flow = true;
        s.set_ack_sent(sa.generation, a.window);
        s.note_max();
    }
    let set_ack = wire::set_ack_body(sa.generation, a.window);
    let pat = Pattern {
        split_header: false,
        iov_split: false,
        split_at: 3,
        chunk: None,
    };
    tx.lock()
        .unwrap()
        .send_messages(&[(msg_server::SET_ACK, &set_ack)], &pat)?;
    let acks_r = acks.clone();
    let reader = thread::spawn(move || {
        let r = server_reader(&mut rx, kind, &acks_r);
        let (lock, cv) = &*acks_r;
        lock.lock().unwrap().reader_done = true;
        cv.notify_all();
        (rx, r)
    });
    *linked = true;
    let go = {
        let (lock, cv) = &**start;
        let mut s = lock.lock().unwrap();
        s.linked += 1;
        cv.notify_all();
        while s.go.is_none() && !s.abort {
            s = cv.wait(s).unwrap();
        }
        s.go
    };
    let mut counts = WriterCounts::default();
    let wres = match go {
        Some((t0, end)) => stream_data(fd, a, kind, &acks, t0, end, &mut counts),
        None => Ok(()),
    };
    ch.stopped = Some(Instant::now());
    let shut = stream.shutdown(Shutdown::Write);
    let (rx, rres) = reader.join().expect("reader thread panicked");
    let txs = tx.lock().unwrap();
    ch.data_messages_sent = counts.messages;
    ch.messages_sent = txs.messages + counts.messages;
    ch.bytes_sent = (txs.bytes - txs.link_bytes.unwrap_or(0)) + counts.bytes;
    ch.write_calls = txs.calls + counts.calls;
    ch.short_writes = txs.short_writes + counts.short_writes;
    ch.messages_received = rx.messages;
    ch.bytes_received = rx.bytes - rx.link_bytes.unwrap_or(0);
    let s = acks.0.lock().unwrap();
    ch.gate_waits = s.waits;
    ch.acks_received = s.acks;
    ch.acks_matched = s.acks_matched;
    ch.ack_syncs_received = s.ack_syncs;
    ch.max_count = s.max_count;
    wres.and(shut).and(rres)
}

/// The data phase of one channel: batches of up to `--batch` messages, each started under
/// the ACK gate, on the rate schedule (or back to back), until `end`.
fn stream_data(
    fd: RawFd,
    a: &LoadArgs,
    kind: HeaderKind,
    acks: &Shared<AckState>,
    t0: Instant,
    end: Instant,
    counts: &mut WriterCounts,
) -> io::Result<()> {
    let body = vec![0xA5u8; a.body_size as usize];
    let mut batch = Batch::new(kind, a.msg_type, &body, a.batch);
    let mut started = 0u64;
    loop {
        let now = Instant::now();
        if now >= end {
            return Ok(());
        }
        if a.rate > 0.0 {
            // The call goes out once its last message is due.
            let at = due_at(t0, started + a.batch as u64 - 1, a.rate);
            if at > now {
                thread::sleep(at.min(end) - now);
                continue;
            }
        }
        let k = {
            let (lock, cv) = &**acks;
            let mut s = lock.lock().unwrap();
            if s.waiting_for_ack() {
                s.waits += 1;
                s = AckState::wait_for_ack(s, cv, end);
                if s.waiting_for_ack() {
                    if s.reader_done {
                        return Err(proto_err("the client closed while the window was full"));
                    }
                    return Ok(()); // the end came while waiting
                }
            }
            let mut k = 0;
            while k < a.batch && !s.waiting_for_ack() {
                s.message_started();
                k += 1;
            }
            s.note_max();
            k
        };
        write_batch(fd, a.send_syscall, &mut batch, k, counts)?;
        started += k as u64;
    }
}

/// The client process: `client-pid N`, then on `go` connect and link every channel, ACK as
/// spice-gtk, and print one JSON line of per-channel counts once every channel is closed.
pub(crate) fn run_load_client(a: &LoadClientArgs) -> bool {
    let say = |line: String| {
        let mut out = io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    };
    say(format!("client-pid {}", std::process::id()));
    let mut line = String::new();
    if io::stdin().read_line(&mut line).unwrap_or(0) == 0 || line.trim() != "go" {
        say(json!({"channels": [], "error": "no go from the server"}).to_string());
        return false;
    }
    let mut handles = Vec::new();
    let mut error = None;
    'all: for s in 0..a.sessions {
        for m in 0..a.channels {
            let ca = client_args(&a.connect, m as u8, session_connection_id(s));
            let stream = match connect(&a.connect, ca.common.timeout())
                .and_then(|st| setup_socket(&st, &ca.common).map(|_| st))
            {
                Ok(st) => st,
                Err(e) => {
                    error = Some(format!("connect: {e}"));
                    break 'all;
                }
            };
            handles.push(thread::spawn(move || client_channel(stream, &ca)));
        }
    }
    let channels: Vec<Value> = handles
        .into_iter()
        .map(|h| h.join().expect("client thread panicked").json())
        .collect();
    let ok = error.is_none();
    say(json!({"channels": channels, "error": error}).to_string());
    ok
}

fn client_channel(stream: TcpStream, a: &ClientArgs) -> ClientChannel {
    let stream = Arc::new(stream);
    let (local, peer) = addrs(&stream);
    let c = &a.common;
    let fd = stream.as_raw_fd();
    let obs = Arc::new(Mutex::new(Observe::off()));
    let tx = Arc::new(Mutex::new(Tx::new(fd, Dir::C2S, c, obs.clone())));
    let mut rx = Rx::new(fd, Dir::S2C, c, obs);
    let mut link = LinkFacts::of_client(a);
    let mut acks = ClientAcks::default();
    let res = (|| -> io::Result<()> {
        if !client_link(a, &stream, &tx, &mut rx, &mut link)? {
            return Err(proto_err(format!("link ended: {}", link.outcome)));
        }
        let kind = link.header.unwrap();
        rx.start_data();
        tx.lock().unwrap().start_data(kind);
        let pat = Pattern {
            split_header: false,
            iov_split: false,
            split_at: 3,
            chunk: None,
        };
        client_reader(a, &tx, &mut rx, kind, &mut acks, &pat)?;
        stream.shutdown(Shutdown::Write)
    })();
    let tx = tx.lock().unwrap();
    ClientChannel {
        local,
        peer,
        messages_received: rx.messages,
        bytes_received: rx.bytes - rx.link_bytes.unwrap_or(0),
        acks_sent: acks.acks_sent,
        ack_syncs_sent: acks.ack_syncs_sent,
        messages_sent: tx.messages,
        bytes_sent: tx.bytes - tx.link_bytes.unwrap_or(0),
        error: res.err().map(|e| e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_holds_the_rate_without_drift() {
        let t0 = Instant::now();
        // 635 msgs/s: message 635 is due exactly one second after the first.
        assert_eq!(due_at(t0, 0, 635.0), t0);
        let d = due_at(t0, 635, 635.0) - t0;
        assert!((d.as_secs_f64() - 1.0).abs() < 1e-9, "{d:?}");
        // 60 s at 635/s: 38100 deadlines, the last one 60 s − 1/635 after t0 (no accumulation).
        let last = due_at(t0, 38_099, 635.0) - t0;
        assert!((last.as_secs_f64() - (60.0 - 1.0 / 635.0)).abs() < 1e-6);
    }

    #[test]
    fn gtk_cadence_acks() {
        // SET_ACK + 40 messages at W = 20: the SET_ACK is not counted, ACKs after 20 and 40.
        assert_eq!(expected_acks(41, 20), 2);
        assert_eq!(expected_acks(40, 20), 1);
        assert_eq!(expected_acks(1, 20), 0);
        assert_eq!(expected_acks(0, 20), 0);
    }

    #[test]
    fn batch_segments_write_and_writev() {
        let body = [7u8; 10];
        let b = Batch::new(HeaderKind::Mini, 304, &body, 3);
        assert_eq!(b.msg_len(), 16);
        let w = b.segments(3, SendSyscall::Write);
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].len(), 48);
        let hdr = wire::header(HeaderKind::Mini, 0, 304, 10);
        assert_eq!(&w[0][16..22], &hdr[..]);
        assert_eq!(&w[0][22..32], &body[..]);
        let v = b.segments(2, SendSyscall::Writev);
        assert_eq!(
            v.iter().map(|s| s.len()).collect::<Vec<_>>(),
            [6, 10, 6, 10]
        );
        assert_eq!(v[2], &hdr[..]);
        // Empty bodies: one iovec per message.
        let e = Batch::new(HeaderKind::Mini, 304, &[], 2);
        assert_eq!(e.segments(2, SendSyscall::Writev).len(), 2);
    }

    #[test]
    fn full_headers_are_numbered() {
        let mut b = Batch::new(HeaderKind::Full, 304, &[1, 2], 2);
        b.number(2);
        b.number(1);
        let s = b.segments(2, SendSyscall::Write)[0];
        let serial = |off: usize| u64::from_le_bytes(s[off..off + 8].try_into().unwrap());
        // The second call numbered message 0 again with serial 3; message 1 kept serial 2.
        assert_eq!((serial(0), serial(20)), (3, 2));
    }

    #[test]
    fn write_batch_counts_messages_across_short_writes() {
        // A socketpair with a small send buffer and a reader thread: every byte arrives, and
        // messages are counted once all their bytes were accepted.
        let mut fds = [0; 2];
        // SAFETY: a valid two-int array for socketpair.
        assert_eq!(
            unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()) },
            0
        );
        set_int_opt(fds[0], libc::SOL_SOCKET, libc::SO_SNDBUF, 4096).unwrap();
        let reader = thread::spawn(move || {
            let mut got = 0usize;
            let mut buf = [0u8; 1000];
            loop {
                // SAFETY: reading into a live buffer.
                let n = unsafe { libc::read(fds[1], buf.as_mut_ptr().cast(), buf.len()) };
                if n <= 0 {
                    break;
                }
                got += n as usize;
                thread::sleep(Duration::from_micros(50));
            }
            got
        });
        let body = vec![0x11u8; 2000];
        let mut b = Batch::new(HeaderKind::Mini, 304, &body, 10);
        let mut c = WriterCounts::default();
        for how in [SendSyscall::Write, SendSyscall::Writev] {
            write_batch(fds[0], how, &mut b, 10, &mut c).unwrap();
        }
        // SAFETY: closing our end ends the reader.
        unsafe { libc::close(fds[0]) };
        assert_eq!(reader.join().unwrap(), 2 * 10 * 2006);
        assert_eq!((c.messages, c.bytes), (20, 2 * 10 * 2006));
        assert!(c.calls >= 2);
    }

    fn server(msgs: u64, acks: u64) -> ServerChannel {
        ServerChannel {
            messages_sent: msgs,
            bytes_sent: msgs * 206,
            acks_received: acks,
            ack_syncs_received: 1,
            messages_received: acks + 1,
            bytes_received: (acks + 1) * 6 + 4,
            ..Default::default()
        }
    }

    fn client(msgs: u64, acks: u64) -> ClientChannel {
        ClientChannel {
            messages_received: msgs,
            bytes_received: msgs * 206,
            acks_sent: acks,
            ack_syncs_sent: 1,
            messages_sent: acks + 1,
            bytes_sent: (acks + 1) * 6 + 4,
            ..Default::default()
        }
    }

    #[test]
    fn ends_must_agree() {
        assert_eq!(disagreement(&server(41, 2), &client(41, 2), 20), None);
        // A lost message, a missing ACK, a wrong cadence: each named.
        let d = disagreement(&server(42, 2), &client(41, 2), 20).unwrap();
        assert!(
            d.contains("server sent 42 messages, client received 41"),
            "{d}"
        );
        let d = disagreement(&server(41, 1), &client(41, 2), 20).unwrap();
        assert!(d.contains("server read 1"), "{d}");
        let d = disagreement(&server(41, 1), &client(41, 1), 20).unwrap();
        assert!(d.contains("cadence gives 2"), "{d}");
    }

    #[test]
    fn client_report_round_trips() {
        let c = ClientChannel {
            local: "127.0.0.1:1".into(),
            peer: "127.0.0.1:2".into(),
            error: Some("x".into()),
            ..client(5, 0)
        };
        assert_eq!(ClientChannel::from_json(&c.json()).unwrap(), c);
        assert!(ClientChannel::from_json(&json!({"local": "a"})).is_err());
    }

    #[test]
    fn options_are_checked() {
        let parse = |extra: &[&str]| {
            let cli = Cli::try_parse_from(["spice-peer", "load"].iter().chain(extra)).unwrap();
            validate(&cli)
        };
        assert!(parse(&[]).is_ok());
        assert!(parse(&["--send-syscall", "sendto"]).is_err());
        assert!(parse(&["--batch", "0"]).is_err());
        assert!(parse(&["--rate=-1"]).is_err());
        assert!(parse(&["--duration", "0"]).is_err());
        assert!(parse(&["--window", "0"]).is_err());
    }
}
