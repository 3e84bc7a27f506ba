//! Loopback self-tests: server and client in threads of the test process, real TCP sockets.

use super::*;
use std::sync::mpsc;

fn parse(args: &[&str]) -> Cli {
    let cli =
        Cli::try_parse_from(std::iter::once("spice-peer").chain(args.iter().copied())).unwrap();
    validate(&cli).unwrap();
    cli
}

/// Runs `server_args` and `client_args` (without --listen / --connect) against each
/// other; returns (server SUMMARY, client SUMMARY).
fn pair(server_args: &[&str], client_args: &[&str]) -> (Value, Value) {
    let mut sa = vec!["server", "--listen", "127.0.0.1:0", "--timeout-ms", "10000"];
    sa.extend_from_slice(server_args);
    let Cmd::Server(server) = parse(&sa).cmd else {
        unreachable!()
    };
    let (ptx, prx) = mpsc::channel();
    let sh = thread::spawn(move || run_server(&server, &mut |p| ptx.send(p).unwrap()).summary);
    let port = prx.recv().unwrap().to_string();
    let addr = format!("127.0.0.1:{port}");
    let mut ca = vec!["client", "--connect", &addr, "--timeout-ms", "10000"];
    ca.extend_from_slice(client_args);
    let Cmd::Client(client) = parse(&ca).cmd else {
        unreachable!()
    };
    let c = run_client(&client).summary;
    let s = sh.join().unwrap();
    (s, c)
}

/// Both scripts completed, both sides agree on every count, and the framing code's
/// reading of each side's calls finds the same messages (the self-check).
fn check_consistent(s: &Value, c: &Value) {
    assert!(s["error"].is_null(), "server: {s:#}");
    assert!(c["error"].is_null(), "client: {c:#}");
    for (w, r) in [(s, c), (c, s)] {
        let (sent, recv) = (&w["sent"], &r["received"]);
        assert_eq!(sent["bytes"], recv["bytes"], "bytes\n{w:#}\n{r:#}");
        assert_eq!(sent["messages"], recv["messages"], "messages");
        assert_eq!(sent["by_type"], recv["by_type"], "by_type");
        assert_eq!(sent["unfinished_messages"], 0);
        assert_eq!(sent["link_bytes"], recv["link_bytes"], "link bytes");
        let d = sent["direction"].as_str().unwrap();
        for side in [w, r] {
            let f = &side["framing"][d];
            assert!(
                f["unparsed"].is_null(),
                "{} framing {d}: {f:#}",
                side["role"]
            );
            assert_eq!(
                f["messages"], sent["messages"],
                "{} framing {d} messages",
                side["role"]
            );
            assert_eq!(
                f["by_type"], sent["by_type"],
                "{} framing {d} by_type",
                side["role"]
            );
            assert_eq!(
                f["bytes"], sent["bytes"],
                "{} framing {d} bytes",
                side["role"]
            );
            assert_eq!(
                f["peek_mismatched"], 0,
                "{} framing {d}: {f:#}",
                side["role"]
            );
        }
    }
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn default_mini_with_ack_window() {
    let (s, c) = pair(&["--messages", "200", "--set-ack", "--window", "4"], &[]);
    check_consistent(&s, &c);
    assert_eq!(s["header"], "mini");
    assert_eq!(s["sent"]["by_type"], json!({"3": 1, "304": 200}));
    assert_eq!(n(&s["sent"]["link_bytes"]), 16 + 186 + 4);
    // spice-gtk cadence: ACK_SYNC once, then one ACK per 4 messages after the SET_ACK.
    assert_eq!(s["received"]["by_type"], json!({"1": 1, "2": 50}));
    assert_eq!(s["acks"]["acks_matched"], 50);
    assert!(
        n(&s["acks"]["max_count"]) <= 9,
        "gate: count never above 2W+1"
    );
    assert_eq!(s["framing"]["s2c"]["prefixes"][0], json!([3, 1, 4]));
    assert_eq!(c["framing"]["c2s"]["prefixes"][0], json!([1, 1, 0]));
    assert_eq!(c["link"]["server_common_caps"], json!([0x0B]));
    assert_eq!(n(&c["sent"]["link_bytes"]), 16 + 22 + 4 + 128);
}

#[test]
fn second_set_ack_opens_a_generation() {
    let (s, c) = pair(
        &[
            "--messages",
            "20",
            "--set-ack",
            "--window",
            "4",
            "--second-set-ack-after",
            "8",
            "--second-generation",
            "7",
            "--second-window",
            "2",
            "--second-set-ack-delay-ms",
            "50",
        ],
        &[],
    );
    check_consistent(&s, &c);
    assert_eq!(s["sent"]["by_type"], json!({"3": 2, "304": 20}));
    let a = &s["acks"];
    assert_eq!(
        (a["set_acks"].clone(), a["generation"].clone()),
        (json!(2), json!(7))
    );
    assert_eq!(
        (a["window"].clone(), a["ack_syncs"].clone()),
        (json!(2), json!(2))
    );
    // Generation 7: SET_ACK + 12 messages, the client ACKs every 2: count 1 + 12 - 12.
    assert_eq!(a["acks_matched"], 2 + 6);
    assert_eq!(a["final_count"], 1);
    assert!(n(&a["max_count_generation"]) <= 5, "gate: 2W+1 of W=2: {a}");
    assert_eq!(c["framing"]["s2c"]["prefixes"][0], json!([3, 1, 4]));
    assert_eq!(c["acks"]["generation"], 7);
}

#[test]
fn surplus_ack_wraps_the_unsigned_count_and_stalls() {
    let (s, c) = pair(
        &[
            "--messages",
            "10",
            "--set-ack",
            "--window",
            "8",
            "--interval-ms",
            "30",
            "--stall-timeout-ms",
            "200",
        ],
        &["--surplus-ack-after", "2"],
    );
    assert!(s["error"].is_null() && c["error"].is_null(), "{s:#}\n{c:#}");
    let a = &s["acks"];
    // SET_ACK + 2 messages counted, then the ACK: 3 - 8 wraps messages_window.
    assert_eq!(a["ack_surplus"], 1);
    assert_eq!(a["final_count"], -5);
    assert_eq!(a["messages_window"], 3u32.wrapping_sub(8));
    assert_eq!(a["stalled_timeout"], true);
    assert_eq!(s["sent"]["by_type"], json!({"3": 1, "304": 2}));
    assert_eq!(c["acks"]["surplus_acks_sent"], 1);
    assert_eq!(c["acks"]["acks_sent"], 1);
}

#[test]
fn full_headers() {
    let (s, c) = pair(
        &["--messages", "30", "--set-ack", "--window", "5"],
        &["--header", "full"],
    );
    check_consistent(&s, &c);
    assert_eq!(c["header"], "full");
    assert_eq!(n(&s["sent"]["data_bytes"]), 26 + 30 * (18 + 64));
    assert_eq!(s["received"]["by_type"], json!({"1": 1, "2": 6}));
}

#[test]
fn every_send_and_recv_syscall() {
    let pairs = [
        ("write", "read"),
        ("writev", "readv"),
        ("sendmsg", "recvmsg"),
        ("sendto", "recvfrom"),
    ];
    for (snd, rcv) in pairs {
        let (s, c) = pair(
            &[
                "--messages",
                "40",
                "--set-ack",
                "--window",
                "3",
                "--send-syscall",
                snd,
                "--recv-syscall",
                rcv,
            ],
            &[
                "--send-syscall",
                snd,
                "--recv-syscall",
                rcv,
                "--recv-size",
                "7",
                "--messages",
                "5",
            ],
        );
        check_consistent(&s, &c);
        assert_eq!(
            s["received"]["by_type"],
            json!({"1": 1, "2": 13, "101": 5}),
            "{snd}/{rcv}"
        );
    }
}

#[test]
fn readv_with_several_iovecs_and_exact_reads() {
    let (s, c) = pair(
        &["--messages", "20", "--body-size", "1000", "--recv-exact"],
        &[
            "--recv-syscall",
            "readv",
            "--recv-iovs",
            "3",
            "--recv-size",
            "100",
            "--messages",
            "3",
        ],
    );
    check_consistent(&s, &c);
    // Exact reads on the server: link header 4 + 12, body, mechanism, ticket, then per
    // message header then body.
    assert_eq!(n(&s["received"]["calls"]), 2 + 1 + 1 + 1 + 3 * 2 + 1);
}

#[test]
fn split_header_each_header_in_two_calls() {
    let (s, c) = pair(
        &["--messages", "10", "--body-size", "5", "--split-header"],
        &[],
    );
    check_consistent(&s, &c);
    // Link: reply, 2 cap words, result = 4 calls; then 2 per message.
    assert_eq!(n(&s["sent"]["calls"]), 4 + 20);
    let (s, c) = pair(
        &["--messages", "10", "--split-header", "--split-at", "11"],
        &["--header", "full"],
    );
    check_consistent(&s, &c);
}

#[test]
fn batches_of_whole_messages() {
    let (s, c) = pair(
        &[
            "--messages",
            "100",
            "--batch",
            "25",
            "--send-syscall",
            "writev",
            "--body-size",
            "0",
        ],
        &[],
    );
    check_consistent(&s, &c);
    assert_eq!(n(&s["sent"]["calls"]), 4 + 4);
    // The gate cuts batches short.
    let (s, c) = pair(
        &[
            "--messages",
            "100",
            "--batch",
            "50",
            "--set-ack",
            "--window",
            "5",
        ],
        &[],
    );
    check_consistent(&s, &c);
    assert!(n(&s["acks"]["max_count"]) <= 11);
}

#[test]
fn header_split_across_iovecs() {
    for sc in ["writev", "sendmsg"] {
        let (s, c) = pair(
            &[
                "--messages",
                "20",
                "--iov-split",
                "--send-syscall",
                sc,
                "--set-ack",
                "--window",
                "2",
            ],
            &["--iov-split", "--send-syscall", sc, "--messages", "4"],
        );
        check_consistent(&s, &c);
        assert_eq!(n(&s["sent"]["calls"]), 4 + 21);
    }
}

#[test]
fn chunked_bodies_and_partial_reads() {
    let (s, c) = pair(
        &["--messages", "20", "--body-size", "1000", "--chunk", "128"],
        &["--recv-size", "1"],
    );
    check_consistent(&s, &c);
    assert_eq!(n(&s["sent"]["calls"]), 4 + 20 * 8);
    assert_eq!(
        n(&c["received"]["calls"]),
        n(&c["received"]["bytes"]) + 1,
        "1-byte reads + EOF"
    );
}

#[test]
fn pauses_between_writes() {
    let t = Instant::now();
    let (s, c) = pair(
        &["--messages", "5", "--pause-ms", "20"],
        &["--pause-ms", "5"],
    );
    check_consistent(&s, &c);
    assert!(t.elapsed() >= Duration::from_millis(5 * 20));
}

#[test]
fn nonblocking_writer_with_a_slow_reader_hits_eagain() {
    let (s, c) = pair(
        &[
            "--messages",
            "10",
            "--body-size",
            "65536",
            "--nonblock",
            "--sndbuf",
            "4096",
            "--send-syscall",
            "writev",
        ],
        &["--recv-size", "4096", "--recv-pause-ms", "1"],
    );
    check_consistent(&s, &c);
    assert!(n(&s["sent"]["eagain"]) > 0, "{:#}", s["sent"]);
    assert!(n(&s["sent"]["short_writes"]) > 0);
    // Every peeked start was reported once by the real write.
    let f = &s["framing"]["s2c"];
    assert_eq!(f["peeked"], f["already_reported"]);
}

#[test]
fn eagain_in_the_middle_of_header_like_bodies() {
    // Bodies of 0x02 bytes read as a mini header: type 514, size 0x02020202 (< 256 MiB).
    // Large bodies through a tiny send buffer: many EAGAINs land mid-body.
    let (s, c) = pair(
        &[
            "--messages",
            "5",
            "--body-size",
            "300000",
            "--body-fill",
            "2",
            "--nonblock",
            "--sndbuf",
            "4096",
        ],
        &["--recv-size", "4096", "--recv-pause-ms", "1"],
    );
    assert!(
        n(&s["sent"]["eagain"]) > n(&s["framing"]["s2c"]["already_reported"]),
        "no mid-body EAGAIN"
    );
    check_consistent(&s, &c);
}

#[test]
fn main_init_and_display_types() {
    let (s, c) = pair(
        &[
            "--main-init",
            "0xCAFE",
            "--messages",
            "3",
            "--msg-type",
            "4",
            "--body-size",
            "12",
        ],
        &["--channel-type", "1"],
    );
    check_consistent(&s, &c);
    assert_eq!(s["sent"]["by_type"], json!({"4": 3, "103": 1}));
    assert_eq!(c["framing"]["s2c"]["prefixes"][0], json!([103, 0xCAFE, 0]));
    assert_eq!(s["link"]["server_channel_caps"], json!([0x0F]));
}

#[test]
fn caps_offset_channel_caps_and_link_one_write() {
    let (s, c) = pair(
        &[
            "--link-one-write",
            "--channel-caps",
            "1,2,3",
            "--messages",
            "3",
        ],
        &[
            "--caps-offset",
            "30",
            "--channel-caps",
            "0xFFFF",
            "--channel-id",
            "2",
            "--connection-id",
            "77",
        ],
    );
    check_consistent(&s, &c);
    assert_eq!(s["link"]["client_link_size"], 30 + 8);
    assert_eq!(s["link"]["client_channel_caps"], json!([0xFFFF]));
    assert_eq!(
        s["channel"],
        json!({"type": 2, "id": 2, "connection_id": 77})
    );
    assert_eq!(n(&s["sent"]["calls"]), 1 + 1 + 3);
    let l = &c["framing"]["s2c"]["link"];
    assert_eq!((n(&l["link_size"]), n(&l["common_caps"])), (178 + 16, 0x0B));
}

#[test]
fn no_auth_selection_ticket_right_after_link() {
    let (s, c) = pair(&["--messages", "5"], &["--common-caps", "0x08"]);
    check_consistent(&s, &c);
    let (s, c) = pair(&["--messages", "5"], &["--no-common-caps"]);
    check_consistent(&s, &c);
}

#[test]
fn no_auth_selection_peer_counts() {
    // The peers themselves handle it (framing is checked by the ignored test above).
    for caps in [&["--common-caps", "0x08"][..], &["--no-common-caps"][..]] {
        let (s, c) = pair(&["--messages", "5"], caps);
        assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
        assert_eq!(c["received"]["messages"], 5);
        assert_eq!(s["link"]["auth_mechanism"], 1);
        assert_eq!(
            n(&c["sent"]["link_bytes"]),
            n(&s["link"]["client_link_size"]) + 16 + 128
        );
    }
}

#[test]
fn stall_without_acks() {
    let (s, c) = pair(
        &[
            "--messages",
            "100",
            "--set-ack",
            "--window",
            "4",
            "--stall-timeout-ms",
            "200",
        ],
        &["--no-acks"],
    );
    assert!(s["error"].is_null() && c["error"].is_null());
    // count: 1 after SET_ACK; messages start while count ≤ 8 → 8 messages.
    assert_eq!(s["sent"]["by_type"], json!({"3": 1, "304": 8}));
    assert_eq!(s["acks"]["stalled_timeout"], true);
    assert_eq!(c["received"]["messages"], 9);
    assert_eq!(c["framing"]["s2c"]["messages"], 9);
}

#[test]
fn html5_cadence_acks_one_message_earlier() {
    let (s, c) = pair(
        &["--messages", "19", "--set-ack", "--window", "5"],
        &["--ack-cadence", "html5"],
    );
    check_consistent(&s, &c);
    // 20 messages counted including the SET_ACK → 4 ACKs (gtk would send 3).
    assert_eq!(s["received"]["by_type"], json!({"1": 1, "2": 4}));
}

#[test]
fn garbage_tls_and_websocket_clients_are_refused() {
    for mode in ["--garbage", "--tls-bytes", "--websocket"] {
        let (s, c) = pair(&[], &[mode]);
        assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
        assert_eq!(s["outcome"], "client_not_spice");
        assert_eq!(c["link"]["refused"], 2, "INVALID_MAGIC error reply");
        assert_eq!(s["sent"]["bytes"], c["received"]["bytes"]);
        assert_eq!(s["received"]["bytes"], c["sent"]["bytes"]);
        let want = match mode {
            "--garbage" => "not_spice",
            "--tls-bytes" => "tls",
            _ => "websocket",
        };
        assert_eq!(c["framing"]["c2s"]["unparsed"]["reason"], want);
        assert_eq!(s["framing"]["c2s"]["unparsed"]["reason"], want);
        assert_eq!(c["framing"]["c2s"]["unparsed"]["at"], 0);
    }
}

#[test]
fn garbage_and_tls_servers() {
    for (mode, want) in [("--garbage", "not_spice"), ("--tls-bytes", "tls")] {
        let (s, c) = pair(&[mode], &[]);
        assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
        assert_eq!(c["outcome"], "server_not_spice");
        assert_eq!(c["framing"]["c2s"]["link"]["link_size"], 22);
        assert_eq!(c["framing"]["s2c"]["unparsed"]["reason"], want);
    }
}

#[test]
fn sasl_both_directions_unparsed() {
    let (s, c) = pair(
        &["--sasl", "--messages", "10", "--set-ack", "--window", "2"],
        &["--sasl"],
    );
    assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
    assert_eq!(s["sent"]["by_type"], json!({"3": 1, "304": 10}));
    assert_eq!(c["received"]["by_type"], json!({"3": 1, "304": 10}));
    assert_eq!(s["received"]["by_type"], json!({"1": 1, "2": 5}));
    assert_eq!(s["sent"]["bytes"], c["received"]["bytes"]);
    for side in [&s, &c] {
        assert_eq!(side["framing"]["c2s"]["unparsed"]["reason"], "sasl");
        assert_eq!(side["framing"]["s2c"]["unparsed"]["reason"], "sasl");
    }
    assert_eq!(c["link"]["server_common_caps"], json!([0x0D]));
}

#[test]
fn sasl_client_without_sasl_server_gets_error_after_reply() {
    let (s, c) = pair(&[], &["--sasl"]);
    assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
    assert_eq!(c["outcome"], "link_error_after_reply");
    assert_eq!(c["link"]["error_after_reply"], 3);
    assert_eq!(c["framing"]["c2s"]["unparsed"]["reason"], "sasl");
}

#[test]
fn link_refusals() {
    let (s, c) = pair(&["--link-error", "9"], &[]);
    assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
    assert_eq!(c["link"]["refused"], 9);
    assert_eq!(
        c["framing"]["s2c"]["unparsed"],
        json!({"reason": "link_refused", "detail": 9, "at": 16})
    );

    let (s, c) = pair(&["--result", "7"], &[]);
    assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
    assert_eq!(c["outcome"], "link_refused");
    assert_eq!(
        c["framing"]["s2c"]["unparsed"],
        json!({"reason": "link_refused", "detail": 7, "at": 202})
    );

    let (s, c) = pair(&["--error-after-reply", "8"], &[]);
    assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
    assert_eq!(c["link"]["error_after_reply"], 8);
    assert_eq!(
        c["framing"]["s2c"]["unparsed"]["reason"],
        "link_error_after_reply"
    );

    let (s, c) = pair(&[], &["--major", "3"]);
    assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
    assert_eq!(s["outcome"], "version_mismatch");
    assert_eq!(c["link"]["refused"], 4);
    assert_eq!(c["framing"]["c2s"]["unparsed"]["reason"], "link_version");

    let (s, c) = pair(&[], &["--auth-mechanism", "5"]);
    assert!(s["error"].is_null() && c["error"].is_null(), "{s:#} {c:#}");
    assert_eq!(c["outcome"], "link_error_after_reply");
    assert_eq!(
        c["framing"]["c2s"]["unparsed"]["reason"],
        "bad_auth_mechanism"
    );
}

#[test]
fn empty_bodies_and_client_batches() {
    let (s, c) = pair(
        &[
            "--messages",
            "300",
            "--body-size",
            "0",
            "--msg-type",
            "102",
            "--set-ack",
            "--window",
            "20",
        ],
        &[
            "--messages",
            "50",
            "--body-size",
            "0",
            "--msg-type",
            "4",
            "--batch",
            "10",
        ],
    );
    check_consistent(&s, &c);
    assert_eq!(s["received"]["by_type"], json!({"1": 1, "2": 15, "4": 50}));
}

#[test]
fn bad_options_are_rejected() {
    for args in [
        &["server", "--listen", "x", "--window", "4"][..],
        &["server", "--listen", "x", "--iov-split"][..],
        &["server", "--listen", "x", "--batch", "2", "--chunk", "3"][..],
        &["client", "--connect", "x", "--recv-iovs", "2"][..],
        &["client", "--connect", "x", "--garbage", "--sasl"][..],
        &[
            "server",
            "--listen",
            "x",
            "--garbage-at",
            "3",
            "--garbage-bytes",
            "1",
        ][..],
    ] {
        let cli =
            Cli::try_parse_from(std::iter::once("spice-peer").chain(args.iter().copied())).unwrap();
        assert!(validate(&cli).is_err(), "{args:?}");
    }
}

#[test]
fn junk_mid_stream_is_skipped_by_a_client_told_so() {
    // SET_ACK + 40 draws, 100 bytes of junk after the first 11 messages, batches of 4 (the
    // junk still goes in a call of its own).
    let (s, c) = pair(
        &[
            "--messages",
            "40",
            "--set-ack",
            "--window",
            "8",
            "--garbage-at",
            "11",
            "--garbage-bytes",
            "100",
            "--batch",
            "4",
            "--seed",
            "7",
        ],
        &["--skip-at", "11", "--skip-bytes", "100"],
    );
    for side in [&s, &c] {
        assert!(side["error"].is_null(), "{side:#}");
    }
    assert_eq!(s["sent"]["messages"], 41);
    assert_eq!(s["sent"]["junk_bytes"], 100);
    assert_eq!(c["received"]["junk_bytes"], 100);
    assert_eq!(s["sent"]["by_type"], c["received"]["by_type"]);
    assert_eq!(s["sent"]["bytes"], c["received"]["bytes"]);
    // The data bytes are the messages' plus the junk.
    assert_eq!(n(&s["sent"]["data_bytes"]), 6 + 8 + 40 * (6 + 64) + 100);
    // ACKs count messages only: 40 draws after the SET_ACK, W 8.
    assert_eq!(s["acks"]["acks_matched"], 5);
    // The framing code met the junk where a header was due and went back to hunting.
    assert_eq!(c["framing"]["s2c"]["hunts"], 1, "{:#}", c["framing"]);
}

#[test]
fn body_marker_fills_bodies_and_keeps_counts() {
    let cli = parse(&[
        "server",
        "--listen",
        "127.0.0.1:0",
        "--body-marker",
        "MARK-",
    ]);
    let Cmd::Server(a) = cli.cmd else {
        unreachable!()
    };
    assert_eq!(a.common.body(12, 0xA5), b"MARK-MARK-MA");
    assert_eq!(a.common.body(3, 0xA5), b"MAR");
    assert!(a.common.body(0, 0xA5).is_empty());
    let plain = parse(&["server", "--listen", "127.0.0.1:0"]);
    let Cmd::Server(p) = plain.cmd else {
        unreachable!()
    };
    assert_eq!(p.common.body(3, 0xA5), [0xA5; 3]);
    assert!(
        Cli::try_parse_from([
            "spice-peer",
            "client",
            "--connect",
            "x:1",
            "--body-marker",
            ""
        ])
        .map_err(|e| e.to_string())
        .and_then(|c| validate(&c))
        .is_err()
    );
    let (s, c) = pair(
        &[
            "--set-ack",
            "--messages",
            "30",
            "--body-size",
            "700",
            "--body-marker",
            "MARK-",
        ],
        &["--messages", "5", "--body-marker", "MARK-"],
    );
    check_consistent(&s, &c);
    assert_eq!(s["sent"]["by_type"]["304"], 30);
}

/// `--body-sizes` takes the sizes in turn: 7 messages with `0,700,5` are 3 empty ones, 2 of
/// 700 bytes and 2 of 5, plus 7 mini headers on the wire beyond a run with none (the link
/// and the SET_ACK), and the client reads the same messages.
#[test]
fn body_sizes_are_taken_in_turn() {
    let (s, c) = pair(
        &[
            "--set-ack",
            "--messages",
            "7",
            "--body-sizes",
            "0,700,5",
            "--batch",
            "7",
        ],
        &["--messages", "1"],
    );
    check_consistent(&s, &c);
    assert_eq!(s["sent"]["by_type"]["304"], 7);
    let (one, _) = pair(&["--set-ack", "--messages", "0"], &["--messages", "1"]);
    let data = s["sent"]["bytes"].as_u64().unwrap() - one["sent"]["bytes"].as_u64().unwrap();
    assert_eq!(data, 2 * 700 + 2 * 5 + 7 * 6);
}
