//! The client script: connect and play spice-gtk.

use super::*;

pub(crate) fn connect(addr: &str, timeout: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::InvalidInput, format!("{addr}: no address"));
    for sa in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&sa, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

pub(crate) fn run_client(a: &ClientArgs) -> Report {
    let c = &a.common;
    let obs = Arc::new(Mutex::new(Observe::default()));
    let mut link = LinkFacts::of_client(a);
    let mode = mode_name(c, a.websocket);
    let stream = match connect(&a.connect, c.timeout()).and_then(|s| setup_socket(&s, c).map(|_| s))
    {
        Ok(s) => Arc::new(s),
        Err(e) => {
            let tx = Tx::new(-1, Dir::C2S, c, obs.clone());
            let rx = Rx::new(-1, Dir::S2C, c, obs.clone());
            return summary(
                "client",
                mode,
                &link,
                &tx,
                &rx,
                Value::Null,
                c,
                &obs.lock().unwrap(),
                Some(format!("connect: {e}")),
            );
        }
    };
    let fd = stream.as_raw_fd();
    let tx = Arc::new(Mutex::new(Tx::new(fd, Dir::C2S, c, obs.clone())));
    let mut rx = Rx::new(fd, Dir::S2C, c, obs.clone());
    let mut acks = ClientAcks::default();
    let res = client_script(a, &stream, &tx, &mut rx, &mut link, &mut acks);
    let _ = stream.shutdown(Shutdown::Both);
    let ack_json = json!({
        "cadence": format!("{:?}", a.ack_cadence).to_lowercase(),
        "window": acks.window, "generation": acks.generation,
        "ack_syncs_sent": acks.ack_syncs_sent, "acks_sent": acks.acks_sent,
        "surplus_acks_sent": acks.surplus_acks_sent,
    });
    let tx = tx.lock().unwrap();
    summary(
        "client",
        mode,
        &link,
        &tx,
        &rx,
        ack_json,
        c,
        &obs.lock().unwrap(),
        res.err().map(|e| e.to_string()),
    )
}

pub(crate) fn client_script(
    a: &ClientArgs,
    stream: &TcpStream,
    tx: &Arc<Mutex<Tx>>,
    rx: &mut Rx,
    link: &mut LinkFacts,
    acks: &mut ClientAcks,
) -> io::Result<()> {
    if !client_link(a, stream, tx, rx, link)? {
        return Ok(());
    }
    let c = &a.common;
    let kind = link.header.unwrap();
    rx.start_data();
    tx.lock().unwrap().start_data(kind);
    let pat = Pattern {
        split_header: c.split_header,
        iov_split: c.iov_split,
        split_at: c.split_at,
        chunk: c.chunk,
    };
    // The client's own messages go out from a second thread while this one reads.
    let writer = (a.messages > 0).then(|| {
        let tx = tx.clone();
        let (n, t, batch) = (a.messages, a.msg_type, c.batch);
        let body = c.body(a.body_size as usize, 0x5A);
        thread::spawn(move || -> io::Result<()> {
            let mut sent = 0u64;
            while sent < n {
                let k = (batch as u64).min(n - sent);
                let msgs: Vec<(u16, &[u8])> = (0..k).map(|_| (t, body.as_slice())).collect();
                tx.lock().unwrap().send_messages(&msgs, &pat)?;
                sent += k;
            }
            Ok(())
        })
    });
    let read_res = client_reader(a, tx, rx, kind, acks, &pat);
    let write_res = writer
        .map(|h| h.join().expect("writer thread panicked"))
        .unwrap_or(Ok(()));
    read_res?;
    write_res?;
    stream.shutdown(Shutdown::Write)
}

/// The client's link phase. Ok(true): go on to data; Ok(false): the script ended here.
pub(crate) fn client_link(
    a: &ClientArgs,
    stream: &TcpStream,
    tx: &Arc<Mutex<Tx>>,
    rx: &mut Rx,
    link: &mut LinkFacts,
) -> io::Result<bool> {
    let c = &a.common;
    let send = |segs: &[&[u8]]| tx.lock().unwrap().link_call(segs);
    if c.garbage || c.tls_bytes || a.websocket {
        let bytes = if c.garbage {
            garbage(c.seed, c.garbage_len)
        } else if c.tls_bytes {
            tls_record(c.seed, 1)
        } else {
            WEBSOCKET_GET.to_vec()
        };
        send(&[&bytes])?;
        link.outcome = "client_not_spice";
        client_read_refusal(rx, link)?;
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    link.client_common_caps = own_common_caps(c, CAP_AUTH_SELECTION | CAP_MINI_HEADER);
    link.client_channel_caps = c.channel_caps.clone().unwrap_or_default();
    if a.caps_offset < LINK_MESS_MIN {
        return Err(proto_err("--caps-offset must be at least 18"));
    }
    let mut msg = wire::link_mess_with_caps_offset(
        a.connection_id,
        a.channel_type,
        a.channel_id,
        &link.client_common_caps,
        &link.client_channel_caps,
        a.caps_offset,
    );
    msg[4..8].copy_from_slice(&a.major.to_le_bytes());
    link.client_link_size = Some(le32(&msg, 12));
    send(&[&msg])?;

    // Reply header, then body (§1.3).
    let hdr = match rx.take_raw(16) {
        Ok(h) => h,
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            link.outcome = "closed_by_server";
            close_and_drain(stream, rx)?;
            return Ok(false);
        }
        Err(e) => return Err(e),
    };
    let magic = le32(&hdr, 0);
    if magic != u32::from_le_bytes(SPICE_MAGIC) {
        link.peer_magic = Some(magic);
        link.outcome = "server_not_spice";
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    let size = le32(&hdr, 12);
    link.server_link_size = Some(size);
    if !(LINK_REPLY_MIN..=LINK_REPLY_MIN + LINK_MESS_MAX).contains(&size) {
        return Err(proto_err(format!("link reply size {size}")));
    }
    let body = rx.take_raw(size as usize)?;
    let error = le32(&body, 0);
    if error != 0 {
        link.outcome = "link_refused";
        link.refused = Some(error);
        close_and_drain(stream, rx)?;
        return Ok(false);
    }
    let (n_common, n_channel, caps_offset) = (le32(&body, 166), le32(&body, 170), le32(&body, 174));
    let end = caps_offset as u64 + 4 * (n_common as u64 + n_channel as u64);
    if caps_offset < LINK_REPLY_MIN || end > size as u64 {
        return Err(proto_err(format!(
            "link reply caps: offset {caps_offset}, {n_common}+{n_channel} words"
        )));
    }
    let words: Vec<u32> = (0..n_common + n_channel)
        .map(|i| le32(&body, (caps_offset + 4 * i) as usize))
        .collect();
    link.server_common_caps = words[..n_common as usize].to_vec();
    link.server_channel_caps = words[n_common as usize..].to_vec();

    // Auth (§1.5): mechanism word iff we advertised auth selection (what the server reads).
    let own0 = link.client_common_caps.first().copied().unwrap_or(0);
    let mechanism = if own0 & CAP_AUTH_SELECTION != 0 {
        let m = a.auth_mechanism.unwrap_or(if c.sasl {
            AUTH_MECHANISM_SASL
        } else {
            AUTH_MECHANISM_SPICE
        });
        send(&[&wire::auth_mechanism(m)])?;
        m
    } else {
        AUTH_MECHANISM_SPICE
    };
    link.auth_mechanism = Some(mechanism);
    let mut sasl = false;
    if mechanism == AUTH_MECHANISM_SPICE {
        send(&[&wire::ticket()])?;
    } else if mechanism == AUTH_MECHANISM_SASL {
        let first = rx.u32_raw()?;
        if first == u32::from_le_bytes(SPICE_MAGIC) {
            client_error_after_reply(stream, rx, link)?;
            return Ok(false);
        }
        client_sasl(tx, rx, first)?;
        sasl = true;
    }
    // Link result, or an error reply in its place (§1.7).
    let result = match rx.u32_raw() {
        Ok(r) => r,
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            link.outcome = "closed_by_server";
            close_and_drain(stream, rx)?;
            return Ok(false);
        }
        Err(e) => return Err(e),
    };
    if result == u32::from_le_bytes(SPICE_MAGIC) {
        client_error_after_reply(stream, rx, link)?;
        return Ok(false);
    }
    finish_link(result, sasl, stream, tx, rx, link)
}

/// The 4 bytes "REDQ" were read where a result was expected: read the rest of the error reply.
pub(crate) fn client_error_after_reply(
    stream: &TcpStream,
    rx: &mut Rx,
    link: &mut LinkFacts,
) -> io::Result<()> {
    let rest = rx.take_raw(12)?;
    let size = le32(&rest, 8) as usize;
    let body = rx.take_raw(size.min(LINK_REPLY_MIN as usize))?;
    link.outcome = "link_error_after_reply";
    link.error_after_reply = Some(le32(&body, 0));
    close_and_drain(stream, rx)
}

/// After a non-SPICE start: if the server answered with a link error reply, note its code.
pub(crate) fn client_read_refusal(rx: &mut Rx, link: &mut LinkFacts) -> io::Result<()> {
    let Ok(hdr) = rx.take_raw(16) else {
        return Ok(());
    };
    if le32(&hdr, 0) == u32::from_le_bytes(SPICE_MAGIC) {
        let size = le32(&hdr, 12) as usize;
        if let Ok(body) = rx.take_raw(size.min(LINK_REPLY_MIN as usize)) {
            link.refused = Some(le32(&body, 0));
        }
    } else {
        link.peer_magic = Some(le32(&hdr, 0));
    }
    Ok(())
}

/// Client half of the SASL exchange (§1.6); `mech_list_len` was already read.
pub(crate) fn client_sasl(tx: &Arc<Mutex<Tx>>, rx: &mut Rx, mech_list_len: u32) -> io::Result<()> {
    let send = |b: &[u8]| tx.lock().unwrap().link_call(&[b]);
    if mech_list_len > 4096 {
        return Err(proto_err(format!(
            "SASL mechanism list length {mech_list_len}"
        )));
    }
    rx.take_raw(mech_list_len as usize)?;
    send(&sasl_msg(b"DIGEST-MD5"))?;
    send(&sasl_msg(b"client-first\0"))?;
    loop {
        let n = rx.u32_raw()? as usize;
        if n > (1 << 20) {
            return Err(proto_err(format!("SASL step length {n}")));
        }
        rx.take_raw(n)?;
        let complete = rx.take_raw(1)?[0];
        if complete != 0 {
            return Ok(());
        }
        send(&sasl_msg(b"client-response\0"))?;
    }
}

pub(crate) fn client_reader(
    a: &ClientArgs,
    tx: &Arc<Mutex<Tx>>,
    rx: &mut Rx,
    kind: HeaderKind,
    acks: &mut ClientAcks,
    pat: &Pattern,
) -> io::Result<()> {
    let ack_delay = Duration::from_millis(a.ack_delay_ms);
    let send_ack = |acks: &mut ClientAcks| -> io::Result<()> {
        if !ack_delay.is_zero() {
            thread::sleep(ack_delay);
        }
        acks.acks_sent += 1;
        tx.lock()
            .unwrap()
            .send_messages(&[(msg_client::ACK, &[])], pat)
    };
    let mut skip_at = a.skip_at;
    loop {
        if skip_at == Some(rx.messages) {
            skip_at = None;
            rx.skip_data(a.skip_bytes)?;
        }
        let Some(m) = rx.read_message(kind)? else {
            break;
        };
        let is_set_ack = m.msg_type == msg_server::SET_ACK && m.size >= 8;
        // spice-gtk decrements before handling, and the SET_ACK finds the counter still unset.
        if a.ack_cadence == AckCadence::Gtk && !is_set_ack && acks.window > 0 && !a.no_acks {
            acks.counter -= 1;
            if acks.counter == 0 {
                acks.counter = acks.window;
                send_ack(acks)?;
            }
        }
        if is_set_ack {
            acks.generation = m.word(0);
            acks.window = m.word(1);
            acks.counter = acks.window;
            acks.since_set_ack = 0;
            if !a.no_acks && acks.window > 0 {
                acks.ack_syncs_sent += 1;
                let body = wire::ack_sync_body(acks.generation);
                tx.lock()
                    .unwrap()
                    .send_messages(&[(msg_client::ACK_SYNC, &body)], pat)?;
            }
        }
        // spice-html5 decrements after handling every message, the SET_ACK included.
        if a.ack_cadence == AckCadence::Html5 && acks.window > 0 && !a.no_acks {
            acks.counter -= 1;
            if acks.counter == 0 {
                acks.counter = acks.window;
                send_ack(acks)?;
            }
        }
        if !is_set_ack && acks.window > 0 {
            acks.since_set_ack += 1;
            if a.surplus_ack_after == Some(acks.since_set_ack) && acks.surplus_acks_sent == 0 {
                acks.surplus_acks_sent += 1;
                send_ack(acks)?;
            }
        }
    }
    Ok(())
}
