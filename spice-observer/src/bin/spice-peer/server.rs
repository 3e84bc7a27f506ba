//! The server script: accept one connection and play spice-server.

use super::*;

pub(crate) fn accept_one(listener: &TcpListener, timeout: Duration) -> io::Result<TcpStream> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                return Ok(s);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || !wait_fd(listener.as_raw_fd(), libc::POLLIN, left)? {
                    return Err(timed_out("accepting"));
                }
            }
            Err(e) => return Err(e),
        }
    }
}

pub(crate) fn run_server(a: &ServerArgs, on_listen: &mut dyn FnMut(u16)) -> Report {
    let c = &a.common;
    let obs = Arc::new(Mutex::new(Observe::default()));
    let mut link = LinkFacts {
        outcome: "ok",
        ..Default::default()
    };
    let acks = Arc::new((Mutex::new(AckState::default()), Condvar::new()));
    let mode = mode_name(c, false);
    let listener = match TcpListener::bind(&a.listen) {
        Ok(l) => l,
        Err(e) => {
            let tx = Tx::new(-1, Dir::S2C, c, obs.clone());
            let rx = Rx::new(-1, Dir::C2S, c, obs.clone());
            return summary(
                "server",
                mode,
                &link,
                &tx,
                &rx,
                Value::Null,
                c,
                &obs.lock().unwrap(),
                Some(format!("bind: {e}")),
            );
        }
    };
    on_listen(listener.local_addr().map(|x| x.port()).unwrap_or(0));
    let stream =
        match accept_one(&listener, c.timeout()).and_then(|s| setup_socket(&s, c).map(|_| s)) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                let tx = Tx::new(-1, Dir::S2C, c, obs.clone());
                let rx = Rx::new(-1, Dir::C2S, c, obs.clone());
                return summary(
                    "server",
                    mode,
                    &link,
                    &tx,
                    &rx,
                    Value::Null,
                    c,
                    &obs.lock().unwrap(),
                    Some(format!("accept: {e}")),
                );
            }
        };
    drop(listener);
    let fd = stream.as_raw_fd();
    let tx = Arc::new(Mutex::new(Tx::new(fd, Dir::S2C, c, obs.clone())));
    let rx = Rx::new(fd, Dir::C2S, c, obs.clone());
    let (rx, res) = server_script(a, &stream, &tx, rx, &mut link, &acks);
    let err = res.err().map(|e| e.to_string());
    let _ = stream.shutdown(Shutdown::Both);
    let ack_json = {
        let s = acks.0.lock().unwrap();
        if s.window == 0 {
            Value::Null
        } else {
            json!({
                "flow_control": s.flow, "window": s.window, "generation": s.generation,
                "final_count": s.count, "max_count": s.max_count,
                "messages_window": s.mw, "max_count_generation": s.max_count_generation,
                "set_acks": s.set_acks, "ack_surplus": s.ack_surplus,
                "client_generation": s.client_generation, "ack_syncs": s.ack_syncs,
                "acks": s.acks, "acks_matched": s.acks_matched, "gate_waits": s.waits,
                "stalled_timeout": s.stalled_timeout,
            })
        }
    };
    let tx = tx.lock().unwrap();
    summary(
        "server",
        mode,
        &link,
        &tx,
        &rx,
        ack_json,
        c,
        &obs.lock().unwrap(),
        err,
    )
}

/// Ends a refused or non-SPICE session: close our side, read the peer's leftovers until EOF.
pub(crate) fn close_and_drain(stream: &TcpStream, rx: &mut Rx) -> io::Result<()> {
    stream.shutdown(Shutdown::Write)?;
    rx.drain()
}

pub(crate) fn server_script(
    a: &ServerArgs,
    stream: &TcpStream,
    tx: &Arc<Mutex<Tx>>,
    mut rx: Rx,
    link: &mut LinkFacts,
    acks: &Arc<(Mutex<AckState>, Condvar)>,
) -> (Rx, io::Result<()>) {
    match server_link(a, stream, tx, &mut rx, link) {
        Ok(true) => {}
        Ok(false) => return (rx, Ok(())),
        Err(e) => return (rx, Err(e)),
    }
    // Data phase: a reader thread for the client's messages, this thread writes.
    let kind = link.header.unwrap();
    rx.start_data();
    tx.lock().unwrap().start_data(kind);
    let mut reader = rx;
    let acks_r = acks.clone();
    let handle = thread::spawn(move || {
        let r = server_reader(&mut reader, kind, &acks_r);
        let (lock, cv) = &*acks_r;
        lock.lock().unwrap().reader_done = true;
        cv.notify_all();
        (reader, r)
    });
    let wres = server_writer(a, tx, acks);
    let shut = stream.shutdown(Shutdown::Write);
    let (reader, rres) = handle.join().expect("reader thread panicked");
    (reader, wres.and(shut).and(rres))
}

/// Both sides, after the 4-byte link result: record it; on a refusal close (the peer closes
/// too); otherwise fix the negotiated header and switch both directions to SASL framing if
/// SASL was used. Returns whether the data phase starts.
pub(crate) fn finish_link(
    result: u32,
    sasl: bool,
    stream: &TcpStream,
    tx: &Arc<Mutex<Tx>>,
    rx: &mut Rx,
    link: &mut LinkFacts,
) -> io::Result<bool> {
    link.result = Some(result);
    if result != 0 {
        link.outcome = "link_refused";
        link.refused = Some(result);
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    link.header = Some(HeaderKind::negotiated(
        &link.client_common_caps,
        &link.server_common_caps,
    ));
    if sasl {
        tx.lock().unwrap().sasl_wrap = true;
        rx.sasl = true;
    }
    Ok(true)
}

/// The server's link phase. Ok(true): go on to data; Ok(false): the script ended here.
pub(crate) fn server_link(
    a: &ServerArgs,
    stream: &TcpStream,
    tx: &Arc<Mutex<Tx>>,
    rx: &mut Rx,
    link: &mut LinkFacts,
) -> io::Result<bool> {
    let c = &a.common;
    let send = |segs: &[&[u8]]| tx.lock().unwrap().link_call(segs);
    let hdr = rx.take_raw(4)?;
    let magic = le32(&hdr, 0);
    if magic != u32::from_le_bytes(SPICE_MAGIC) {
        // spice-server's plain port: INVALID_MAGIC (it would first try WebSocket, §1.1).
        link.peer_magic = Some(magic);
        link.outcome = "client_not_spice";
        server_answer_non_spice(a, &send)?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    let hdr = [hdr, rx.take_raw(12)?].concat();
    let major = le32(&hdr, 4);
    let size = le32(&hdr, 12);
    link.client_link_size = Some(size);
    if major != SPICE_VERSION_MAJOR {
        link.outcome = "version_mismatch";
        if major != 0 {
            send(&[&wire::link_error_reply(4)])?;
        }
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    if !(LINK_MESS_MIN..=LINK_MESS_MAX).contains(&size) {
        link.outcome = "bad_link";
        send(&[&wire::link_error_reply(3)])?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    let body = rx.take_raw(size as usize)?;
    link.connection_id = le32(&body, 0);
    link.channel_type = body[4];
    link.channel_id = body[5];
    let (n_common, n_channel, caps_offset) = (le32(&body, 6), le32(&body, 10), le32(&body, 14));
    let end = caps_offset as u64 + 4 * (n_common as u64 + n_channel as u64);
    if caps_offset < LINK_MESS_MIN || n_common > 1024 || n_channel > 1024 || end > size as u64 {
        link.outcome = "bad_link";
        send(&[&wire::link_error_reply(3)])?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    let words: Vec<u32> = (0..n_common + n_channel)
        .map(|i| le32(&body, (caps_offset + 4 * i) as usize))
        .collect();
    link.client_common_caps = words[..n_common as usize].to_vec();
    link.client_channel_caps = words[n_common as usize..].to_vec();
    if c.garbage || c.tls_bytes {
        link.outcome = "server_not_spice";
        server_answer_non_spice(a, &send)?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    if let Some(code) = a.link_error {
        link.outcome = "link_refused";
        link.refused = Some(code);
        send(&[&wire::link_error_reply(code)])?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    link.server_common_caps =
        own_common_caps(c, CAP_AUTH_SELECTION | CAP_AUTH_SPICE | CAP_MINI_HEADER);
    link.server_channel_caps = c
        .channel_caps
        .clone()
        .unwrap_or_else(|| server_default_channel_caps(link.channel_type));
    let client_caps0 = link.client_common_caps.first().copied().unwrap_or(0);
    let server_caps0 = link.server_common_caps.first().copied().unwrap_or(0);
    let key = if c.sasl && client_caps0 & CAP_AUTH_SASL != 0 {
        [0u8; PUB_KEY_LEN]
    } else {
        wire::fake_pub_key()
    };
    let reply =
        wire::link_reply_with_key(0, &key, &link.server_common_caps, &link.server_channel_caps);
    link.server_link_size = Some(le32(&reply, 12));
    let fixed = (LINK_HEADER_LEN + LINK_REPLY_MIN) as usize;
    if a.link_one_write {
        send(&[&reply])?;
    } else {
        send(&[&reply[..fixed]])?;
        for w in reply[fixed..].chunks(4) {
            send(&[w])?;
        }
    }
    // Auth (§1.5): the mechanism word only if the client advertised auth selection.
    let mechanism = if client_caps0 & CAP_AUTH_SELECTION != 0 {
        rx.u32_raw()?
    } else {
        AUTH_MECHANISM_SPICE
    };
    link.auth_mechanism = Some(mechanism);
    let sasl = if mechanism == AUTH_MECHANISM_SPICE {
        rx.take_raw(TICKET_LEN as usize)?;
        false
    } else if mechanism == AUTH_MECHANISM_SASL && server_caps0 & CAP_AUTH_SASL != 0 {
        server_sasl(tx, rx)?;
        true
    } else {
        // Unknown mechanism, or SASL not enabled: an error reply after the OK reply (§1.7).
        link.outcome = "link_error_after_reply";
        link.error_after_reply = Some(3);
        send(&[&wire::link_error_reply(3)])?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    };
    if let Some(code) = a.error_after_reply {
        link.outcome = "link_error_after_reply";
        link.error_after_reply = Some(code);
        send(&[&wire::link_error_reply(code)])?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    send(&[&wire::link_result(a.result)])?;
    finish_link(a.result, sasl, stream, tx, rx, link)
}

pub(crate) fn server_answer_non_spice(
    a: &ServerArgs,
    send: &dyn Fn(&[&[u8]]) -> io::Result<()>,
) -> io::Result<()> {
    let c = &a.common;
    if c.garbage {
        send(&[&garbage(c.seed, c.garbage_len)])
    } else if c.tls_bytes {
        send(&[&tls_record(c.seed, 2)])
    } else {
        send(&[&wire::link_error_reply(2)])
    }
}

pub(crate) fn sasl_msg(data: &[u8]) -> Vec<u8> {
    let mut v = (data.len() as u32).to_le_bytes().to_vec();
    v.extend_from_slice(data);
    v
}

/// Server half of the SASL exchange (§1.6), with canned payloads.
pub(crate) fn server_sasl(tx: &Arc<Mutex<Tx>>, rx: &mut Rx) -> io::Result<()> {
    let send = |b: &[u8]| tx.lock().unwrap().link_call(&[b]);
    send(&sasl_msg(b",DIGEST-MD5,GSSAPI,"))?;
    let n = rx.u32_raw()? as usize;
    if n == 0 || n > 100 {
        return Err(proto_err(format!("SASL mechanism name length {n}")));
    }
    rx.take_raw(n)?;
    let n = rx.u32_raw()? as usize;
    rx.take_raw(n)?;
    let mut step = sasl_msg(b"server-challenge\0");
    step.push(0);
    send(&step)?;
    let n = rx.u32_raw()? as usize;
    rx.take_raw(n)?;
    let mut done = sasl_msg(b"server-final\0");
    done.push(1);
    send(&done)?;
    send(&wire::link_result(0))
}

/// Reads the client's data messages and applies ACK_SYNC / ACK to the gate.
pub(crate) fn server_reader(
    rx: &mut Rx,
    kind: HeaderKind,
    acks: &Arc<(Mutex<AckState>, Condvar)>,
) -> io::Result<()> {
    while let Some(m) = rx.read_message(kind)? {
        let (lock, cv) = &**acks;
        let mut s = lock.lock().unwrap();
        match m.msg_type {
            msg_client::ACK_SYNC if m.size >= 4 => {
                s.client_generation = Some(m.word(0));
                s.ack_syncs += 1;
            }
            msg_client::ACK => {
                s.acks += 1;
                if s.client_generation == Some(s.generation) && s.window > 0 {
                    s.acks_matched += 1;
                    if s.count < s.window as i64 {
                        s.ack_surplus += 1;
                    }
                    s.count -= s.window as i64;
                    s.mw = s.mw.wrapping_sub(s.window);
                    cv.notify_all();
                }
            }
            _ => {}
        }
    }
    Ok(())
}

pub(crate) fn server_writer(
    a: &ServerArgs,
    tx: &Arc<Mutex<Tx>>,
    acks: &Arc<(Mutex<AckState>, Condvar)>,
) -> io::Result<()> {
    let c = &a.common;
    let pat = Pattern {
        split_header: c.split_header,
        iov_split: c.iov_split,
        split_at: c.split_at,
        chunk: c.chunk,
    };
    let window = a.window.unwrap_or(20);
    {
        let mut s = acks.0.lock().unwrap();
        if a.set_ack {
            s.window = window;
            s.generation = a.generation;
            s.flow = !a.ignore_acks;
        }
    }
    let sizes = a.body_sizes.clone().unwrap_or_else(|| vec![a.body_size]);
    let bodies: Vec<Vec<u8>> = sizes
        .iter()
        .map(|&n| c.body(n as usize, a.body_fill as u8))
        .collect();
    let mut list: Vec<(u16, Vec<u8>)> = Vec::new();
    if a.set_ack {
        list.push((
            msg_server::SET_ACK,
            wire::set_ack_body(a.generation, window).to_vec(),
        ));
    }
    if let Some(sid) = a.main_init {
        list.push((msg_server::MAIN_INIT, wire::main_init_body(sid).to_vec()));
    }
    let extra = list.len() as u64;
    // The second SET_ACK, if any, goes out after that many streamed messages.
    let second_at = a.second_set_ack_after.map(|n| extra + n.min(a.messages));
    let second = (
        a.second_generation.unwrap_or(a.generation.wrapping_add(1)),
        a.second_window.unwrap_or(window),
    );
    let second_body = wire::set_ack_body(second.0, second.1);
    let total = extra + a.messages + second_at.is_some() as u64;
    let get = |i: u64| -> (u16, &[u8]) {
        if i < extra {
            let (t, b) = &list[i as usize];
            (*t, b.as_slice())
        } else if Some(i) == second_at {
            (msg_server::SET_ACK, second_body.as_slice())
        } else {
            // The streamed messages' own count: the second SET_ACK takes no size.
            let n = i - extra - second_at.is_some_and(|at| i > at) as u64;
            let k = n as usize % bodies.len();
            (a.msg_type, bodies[k].as_slice())
        }
    };
    let stall = Duration::from_millis(a.stall_timeout_ms);
    let junk = a.garbage_at.map(|_| stream_junk(c.seed, a.garbage_bytes));
    let mut junk_at = a.garbage_at;
    let mut i = 0u64;
    'outer: while i < total {
        let mut batch: Vec<(u16, &[u8])> = Vec::new();
        while batch.len() < c.batch && i < total {
            if junk_at == Some(i) {
                if !batch.is_empty() {
                    break; // the junk goes in a write call of its own
                }
                junk_at = None;
                tx.lock()
                    .unwrap()
                    .junk_call(junk.as_deref().unwrap_or_default())?;
            }
            let (t, b) = get(i);
            let is_second = Some(i) == second_at;
            if is_second {
                if !batch.is_empty() {
                    break; // the second SET_ACK starts a write call of its own
                }
                thread::sleep(Duration::from_millis(a.second_set_ack_delay_ms));
            } else if i >= extra && a.interval_ms > 0 {
                if !batch.is_empty() {
                    break; // each message goes out when its interval has passed
                }
                thread::sleep(Duration::from_millis(a.interval_ms));
            }
            {
                let (lock, cv) = &**acks;
                let mut s = lock.lock().unwrap();
                if a.set_ack && i == 0 {
                    s.set_ack_sent(a.generation, window);
                } else {
                    if s.waiting_for_ack() {
                        if !batch.is_empty() {
                            break; // send what the gate allowed so far
                        }
                        s.waits += 1;
                        s = AckState::wait_for_ack(s, cv, Instant::now() + stall);
                        if s.waiting_for_ack() {
                            s.stalled_timeout = !s.reader_done;
                            break 'outer;
                        }
                    }
                    s.message_started();
                }
                if is_second {
                    // A new generation: send_set_ack resets the count, the SET_ACK counts.
                    s.set_ack_sent(second.0, second.1);
                }
                s.note_max();
            }
            batch.push((t, b));
            i += 1;
        }
        tx.lock().unwrap().send_messages(&batch, &pat)?;
    }
    Ok(())
}
