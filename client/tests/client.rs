//! The client against a fake sidecar: a listener in the test that decodes requests with the
//! wire functions and answers as each test scripts it.
//!
//! Every test runs on `#[tokio::test]`'s current-thread runtime, so the client's tasks are
//! shown to work there.
#![allow(
    clippy::unwrap_used,
    reason = "a panic is a test's failure report; clippy.toml allows unwrap in #[test] fns but not in the fake server's helpers"
)]

use std::collections::HashSet;
use std::time::Duration;

use tally_client::wire::{self, Op, Reply, Request, Response};
use tally_client::{
    CheckId, Client, Decision, Endpoint, Error, Estimate, Mode, Options, Pipeline, Refusal, Status,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;

/// Generous timeouts: tests that need a request to time out set their own.
fn options() -> Options {
    Options::default()
        .with_timeout(Duration::from_secs(10))
        .with_connect_timeout(Duration::from_secs(10))
}

async fn listen() -> (TcpListener, Endpoint) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = Endpoint::Tcp(listener.local_addr().unwrap());
    (listener, endpoint)
}

/// Reads one request; `None` when the client closed the stream.
async fn read_request<R: AsyncRead + Unpin>(stream: &mut R) -> Option<Request> {
    let mut prefix = [0; 4];
    stream.read_exact(&mut prefix).await.ok()?;
    let mut body = vec![0; wire::frame_len(prefix).unwrap()];
    stream.read_exact(&mut body).await.unwrap();
    Some(wire::decode_body(&body).unwrap())
}

async fn write_responses<W: AsyncWrite + Unpin>(stream: &mut W, responses: &[Response]) {
    let mut frames = Vec::new();
    for response in responses {
        wire::encode_frame(response, &mut frames);
    }
    stream.write_all(&frames).await.unwrap();
}

/// Reads one request, which must be `Status`, and answers it with [`status`].
async fn answer_status<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S) {
    let request = read_request(stream).await.unwrap();
    assert_eq!(request.op, Op::Status);
    let response = Response {
        id: request.id,
        result: Ok(Reply::Status(status())),
    };
    write_responses(stream, &[response]).await;
}

fn estimate(estimate: i128) -> Estimate {
    Estimate {
        estimate,
        window: 7,
        staleness_ms: 0,
    }
}

fn status() -> Status {
    Status {
        node: 3,
        generation: 2,
        members: vec![("alive".into(), 1)],
        keys: 5,
    }
}

#[tokio::test]
async fn pipelined_requests_answered_in_reverse_are_matched_by_id() {
    const REQUESTS: u64 = 16;
    let (listener, endpoint) = listen().await;
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        // Every request arrives before any is answered: they are in flight together.
        let mut batch = Vec::new();
        for _ in 0..REQUESTS {
            batch.push(read_request(&mut stream).await.unwrap());
        }
        let ids: HashSet<u64> = batch.iter().map(|request| request.id).collect();
        assert_eq!(ids.len(), batch.len(), "request ids repeat: {batch:?}");
        let answers: Vec<Response> = batch
            .iter()
            .rev()
            .map(|request| {
                let Op::Incr { amount, .. } = request.op else {
                    panic!("expected an incr, got {request:?}");
                };
                Response {
                    id: request.id,
                    result: Ok(Reply::Counted(estimate(amount.into()))),
                }
            })
            .collect();
        write_responses(&mut stream, &answers).await;
    });

    let client = Client::connect(endpoint, options()).await.unwrap();
    let calls: Vec<_> = (1..=REQUESTS)
        .map(|amount| {
            let client = client.clone();
            tokio::spawn(async move { (amount, client.incr("login", "user-42", amount).await) })
        })
        .collect();
    for call in calls {
        let (amount, counted) = call.await.unwrap();
        assert_eq!(counted.unwrap(), estimate(amount.into()));
    }
    server.await.unwrap();
}

/// TESTING.md C3 at the client: each call made under a `CheckId` sends that id with its
/// arguments, every time it is made, so that a retry is one request to the sidecar; a call
/// without one sends none.
#[tokio::test]
async fn calls_under_a_check_id_send_it_with_every_retry() {
    let (listener, endpoint) = listen().await;
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut ops = Vec::new();
        while let Some(request) = read_request(&mut stream).await {
            let reply = match request.op {
                Op::Check { .. } => Reply::Decision(allowed()),
                _ => Reply::Counted(estimate(1)),
            };
            ops.push(request.op);
            let response = Response {
                id: request.id,
                result: Ok(reply),
            };
            write_responses(&mut stream, &[response]).await;
        }
        ops
    });

    let client = Client::connect(endpoint, options()).await.unwrap();
    let ids = [CheckId::new(), CheckId::new(), CheckId::new()];
    for _ in 0..2 {
        client
            .incr_with_id(ids[0], "login", "user-1", 2)
            .await
            .unwrap();
        client
            .decr_with_id(ids[1], "login", "user-1", 3)
            .await
            .unwrap();
        client
            .check_with_id(ids[2], "login", "user-1", 4)
            .await
            .unwrap();
    }
    client.incr("login", "user-1", 5).await.unwrap();
    client.decr("login", "user-1", 6).await.unwrap();
    client.check("login", "user-1", 7).await.unwrap();
    drop(client);

    let (rule, subject) = (String::from("login"), String::from("user-1"));
    let named = [
        Op::Incr {
            rule: rule.clone(),
            subject: subject.clone(),
            amount: 2,
            id: Some(ids[0]),
        },
        Op::Decr {
            rule: rule.clone(),
            subject: subject.clone(),
            amount: 3,
            id: Some(ids[1]),
        },
        Op::Check {
            rule: rule.clone(),
            subject: subject.clone(),
            cost: 4,
            id: Some(ids[2]),
        },
    ];
    let unnamed = [
        Op::Incr {
            rule: rule.clone(),
            subject: subject.clone(),
            amount: 5,
            id: None,
        },
        Op::Decr {
            rule: rule.clone(),
            subject: subject.clone(),
            amount: 6,
            id: None,
        },
        Op::Check {
            rule,
            subject,
            cost: 7,
            id: None,
        },
    ];
    let expected: Vec<Op> = [named.clone(), named, unnamed].concat();
    assert_eq!(server.await.unwrap(), expected);
}

#[tokio::test]
async fn an_unanswered_request_times_out_and_its_late_answer_is_dropped() {
    let timeout = Duration::from_millis(300);
    let (listener, endpoint) = listen().await;
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let first = read_request(&mut stream).await.unwrap();
        // The second request comes only after the first has timed out; then the first's
        // answer arrives late, ahead of the second's.
        let second = read_request(&mut stream).await.unwrap();
        let answer = |id, count| Response {
            id,
            result: Ok(Reply::Estimate(estimate(count))),
        };
        write_responses(&mut stream, &[answer(first.id, 1), answer(second.id, 2)]).await;
        // Hold the stream open until the client is done with it.
        assert!(read_request(&mut stream).await.is_none());
    });

    let client = Client::connect(endpoint, options().with_timeout(timeout))
        .await
        .unwrap();
    let err = client.get("login", "user-42").await.unwrap_err();
    assert!(
        matches!(err, Error::Timeout { after } if after == timeout),
        "{err:?}"
    );
    assert!(err.is_retryable());
    assert_eq!(client.get("login", "user-42").await.unwrap(), estimate(2));
    drop(client);
    server.await.unwrap();
}

#[tokio::test]
async fn a_dropped_connection_fails_pending_requests_and_the_next_request_reconnects() {
    const PENDING: usize = 3;
    let (listener, endpoint) = listen().await;
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        for _ in 0..PENDING {
            read_request(&mut stream).await.unwrap();
        }
        drop(stream);
        let (mut stream, _) = listener.accept().await.unwrap();
        answer_status(&mut stream).await;
    });

    let client = Client::connect(endpoint, options()).await.unwrap();
    let calls: Vec<_> = (0..PENDING)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move { client.incr("login", "user-42", 1).await })
        })
        .collect();
    for call in calls {
        let err = call.await.unwrap().unwrap_err();
        assert!(matches!(err, Error::Disconnected), "{err:?}");
        assert!(err.is_retryable());
    }
    assert_eq!(client.status().await.unwrap(), status());
    server.await.unwrap();
}

#[tokio::test]
async fn refusals_come_back_as_refused_with_their_variant() {
    let unknown = Refusal::UnknownRule {
        rule: "login".into(),
    };
    let unavailable = Refusal::RegionUnavailable {
        rule: "payments".into(),
        why: "no region node answered".into(),
    };
    let (listener, endpoint) = listen().await;
    let refusals = [unknown.clone(), unavailable.clone()];
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        for refusal in refusals {
            let request = read_request(&mut stream).await.unwrap();
            write_responses(
                &mut stream,
                &[Response {
                    id: request.id,
                    result: Err(refusal),
                }],
            )
            .await;
        }
    });

    let client = Client::connect(endpoint, options()).await.unwrap();
    let err = client.incr("login", "user-42", 1).await.unwrap_err();
    assert!(
        matches!(&err, Error::Refused(refusal) if *refusal == unknown),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    let err = client.check("payments", "user-42", 1).await.unwrap_err();
    assert!(
        matches!(&err, Error::Refused(refusal) if *refusal == unavailable),
        "{err:?}"
    );
    assert!(err.is_retryable());
    server.await.unwrap();
}

#[tokio::test]
async fn garbage_frames_close_the_connection_with_a_protocol_error() {
    let garbage: [&[u8]; 3] = [
        // A frame in a protocol version this client does not speak.
        &[2, 0, 0, 0, 9, 0],
        // A length prefix over the frame limit.
        &[0xff, 0xff, 0xff, 0xff],
        // A body that does not decode as a response.
        &[4, 0, 0, 0, wire::CLIENT_WIRE_VERSION, 0xff, 0xff, 0xff],
    ];
    let (listener, endpoint) = listen().await;
    let server = tokio::spawn(async move {
        for frame in garbage {
            let (mut stream, _) = listener.accept().await.unwrap();
            read_request(&mut stream).await.unwrap();
            stream.write_all(frame).await.unwrap();
            // The client closes a connection that sent garbage.
            assert!(read_request(&mut stream).await.is_none());
        }
    });

    let client = Client::connect(endpoint, options()).await.unwrap();
    for expected in ["version 9", "over the", "does not decode"] {
        let err = client.get("login", "user-42").await.unwrap_err();
        let Error::Protocol(why) = &err else {
            panic!("expected a protocol error, got {err:?}");
        };
        assert!(why.contains(expected), "{why:?} should say {expected:?}");
        assert!(!err.is_retryable());
    }
    server.await.unwrap();
}

#[tokio::test]
async fn a_frame_the_sidecar_refuses_fails_the_call_with_its_reason_and_no_retry() {
    // What a sidecar of this wire version answers a frame it cannot decode (an operation
    // added after its build, say): `Malformed` under id 0, then close.
    let (listener, endpoint) = listen().await;
    let server = tokio::spawn(async move {
        for _ in 0..2 {
            let (mut stream, _) = listener.accept().await.unwrap();
            read_request(&mut stream).await.unwrap();
            let refused = Response {
                id: 0,
                result: Err(Refusal::Malformed {
                    why: "frame: body does not decode: unknown variant".into(),
                }),
            };
            write_responses(&mut stream, &[refused]).await;
        }
    });
    let client = Client::connect(endpoint, options()).await.unwrap();
    for _ in 0..2 {
        let err = client.get("login", "user-42").await.unwrap_err();
        assert!(
            matches!(&err, Error::Protocol(why) if why.contains("unknown variant")),
            "{err:?}"
        );
        assert!(!err.is_retryable(), "a retry meets the same refusal");
    }
    server.await.unwrap();
}

/// A sidecar answers an `incr` with the frame `first` makes for its id, then a `get` with an
/// estimate of 4: the `incr` fails alone with a `Protocol` error saying `why`, and the `get`
/// is answered on the same connection.
async fn a_bad_answer_fails_its_call_alone(
    first: impl FnOnce(u64) -> Vec<u8> + Send + 'static,
    why: &str,
) {
    let (listener, endpoint) = listen().await;
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let incr = read_request(&mut stream).await.unwrap();
        stream.write_all(&first(incr.id)).await.unwrap();
        let get = read_request(&mut stream).await.unwrap();
        write_responses(
            &mut stream,
            &[Response {
                id: get.id,
                result: Ok(Reply::Estimate(estimate(4))),
            }],
        )
        .await;
    });

    let client = Client::connect(endpoint, options()).await.unwrap();
    let err = client.incr("login", "user-42", 1).await.unwrap_err();
    assert!(
        matches!(&err, Error::Protocol(said) if said.contains(why)),
        "{err:?}"
    );
    assert_eq!(client.get("login", "user-42").await.unwrap(), estimate(4));
    server.await.unwrap();
}

#[tokio::test]
async fn a_reply_of_the_wrong_kind_is_a_protocol_error_and_the_connection_stays_up() {
    let status_reply = |id| {
        let mut frame = Vec::new();
        let result = Ok(Reply::Status(status()));
        wire::encode_frame(&Response { id, result }, &mut frame);
        frame
    };
    a_bad_answer_fails_its_call_alone(status_reply, "incr expects a Counted reply").await;
}

#[tokio::test]
async fn an_answer_newer_than_this_client_fails_its_call_alone_and_the_connection_stays_up() {
    // A sidecar of the same wire version with a reply variant this build does not know.
    let unknown_reply = |id| {
        let id = u8::try_from(id).expect("a small first id");
        let body = [wire::CLIENT_WIRE_VERSION, id, 0, 9];
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend(body);
        frame
    };
    a_bad_answer_fails_its_call_alone(unknown_reply, "does not decode").await;
}

#[tokio::test]
async fn a_request_too_large_for_one_frame_is_refused_before_it_is_sent() {
    let (listener, endpoint) = listen().await;
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        // The first request to arrive is the small one that followed the refused one.
        let get = read_request(&mut stream).await.unwrap();
        assert!(
            matches!(&get.op, Op::Get { subject, .. } if subject == "user-42"),
            "{get:?}"
        );
        write_responses(
            &mut stream,
            &[Response {
                id: get.id,
                result: Ok(Reply::Estimate(estimate(1))),
            }],
        )
        .await;
    });

    let client = Client::connect(endpoint, options()).await.unwrap();
    let huge = "x".repeat(wire::CLIENT_FRAME_BYTES_MAX);
    let err = client.incr("login", &huge, 1).await.unwrap_err();
    assert!(
        matches!(&err, Error::Refused(Refusal::BadField { field, .. }) if field == "subject"),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    assert_eq!(client.get("login", "user-42").await.unwrap(), estimate(1));
    server.await.unwrap();
}

#[tokio::test]
async fn connecting_to_a_closed_port_is_a_retryable_connect_error_naming_the_endpoint() {
    let (listener, endpoint) = listen().await;
    drop(listener);
    let err = Client::connect(endpoint.clone(), options())
        .await
        .unwrap_err();
    let Error::Connect {
        endpoint: named, ..
    } = &err
    else {
        panic!("expected a connect error, got {err:?}");
    };
    assert_eq!(*named, endpoint.to_string());
    assert!(err.is_retryable());
}

#[cfg(unix)]
#[tokio::test]
async fn a_unix_socket_endpoint_works() {
    let path = std::env::temp_dir().join(format!("tally-client-test-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let endpoint: Endpoint = format!("unix:{}", path.display()).parse().unwrap();
    assert_eq!(endpoint, Endpoint::Unix(path.clone()));
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let request = read_request(&mut stream).await.unwrap();
        assert_eq!(
            request.op,
            Op::Decr {
                rule: "concurrent".into(),
                subject: "user-42".into(),
                amount: 2,
                id: None,
            }
        );
        write_responses(
            &mut stream,
            &[Response {
                id: request.id,
                result: Ok(Reply::Counted(estimate(-2))),
            }],
        )
        .await;
    });

    let client = Client::connect(endpoint, options()).await.unwrap();
    let counted = client.decr("concurrent", "user-42", 2).await;
    server.await.unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(counted.unwrap(), estimate(-2));
}

/// A Unix socket path no socket can have (over the 107 bytes of `sun_path`, or with a NUL
/// byte) fails every connect the same way: the error must not say that asking again may
/// succeed (the sidecar refuses such a `client_socket` at start, so none listens there).
#[cfg(unix)]
#[tokio::test]
async fn a_unix_socket_path_no_socket_can_have_is_no_retryable_connect_error() {
    let too_long = format!("/tmp/{}.sock", "a".repeat(200));
    for path in [too_long.as_str(), "/tmp/tally\0client.sock"] {
        let endpoint = Endpoint::Unix(path.into());
        for _ in 0..2 {
            let err = Client::connect(endpoint.clone(), options())
                .await
                .unwrap_err();
            assert!(matches!(err, Error::Connect { .. }), "{err:?}");
            assert!(
                !err.is_retryable(),
                "{path:?}: {err}: {:?} called retryable",
                std::error::Error::source(&err)
            );
        }
        // Refused when parsed, naming the text, rather than at each connect.
        let text = format!("unix:{path}");
        assert!(text.parse::<Endpoint>().is_err(), "{text:?} parsed");
    }
}

#[tokio::test]
async fn calls_to_a_sidecar_that_stops_reading_wait_for_room_and_time_out() {
    // Enough big requests to fill the socket's buffers and then the client's outbox, so
    // that later calls wait for room; every one must still come back within its timeout.
    const CALLS: usize = 300;
    let timeout = Duration::from_millis(300);
    let (listener, endpoint) = listen().await;
    let (done, finished) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        // Accept, then never read, until the test is over.
        let (stream, _) = listener.accept().await.unwrap();
        finished.await.unwrap();
        drop(stream);
    });

    let client = Client::connect(endpoint, options().with_timeout(timeout))
        .await
        .unwrap();
    let subject = "s".repeat(wire::CLIENT_FRAME_BYTES_MAX - 100);
    let calls: Vec<_> = (0..CALLS)
        .map(|_| {
            let (client, subject) = (client.clone(), subject.clone());
            tokio::spawn(async move { client.incr("login", &subject, 1).await })
        })
        .collect();
    // A call whose request was queued times out; one that never found room says that
    // nothing was sent.
    let all = async {
        let (mut timed_out, mut not_sent) = (0, 0);
        for call in calls {
            match call.await.unwrap().unwrap_err() {
                Error::Timeout { after } if after == timeout => timed_out += 1,
                Error::NotSent { why } if why.contains("no room") => not_sent += 1,
                err => panic!("{err:?}"),
            }
        }
        assert!(timed_out > 0 && not_sent > 0, "{timed_out} {not_sent}");
    };
    // A hang is the failure this guards against: fail instead of waiting for ever.
    tokio::time::timeout(Duration::from_secs(30), all)
        .await
        .expect("every call came back");
    done.send(()).unwrap();
    server.await.unwrap();
}

#[tokio::test]
async fn callers_on_other_threads_each_get_their_own_answer() {
    // The connection's tasks run on this test's runtime; the callers run on runtimes of
    // their own, one per thread, so calls, answers and wake-ups cross threads.
    const THREADS: u64 = 4;
    const CALLS: u64 = 500;
    let (listener, endpoint) = listen().await;
    // Answers every request as it comes, with its amount as the count.
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let (mut read, mut write) = stream.into_split();
        while let Some(request) = read_request(&mut read).await {
            let Op::Incr { amount, .. } = request.op else {
                panic!("expected an incr, got {request:?}");
            };
            let response = Response {
                id: request.id,
                result: Ok(Reply::Counted(estimate(amount.into()))),
            };
            write_responses(&mut write, &[response]).await;
        }
    });

    let client = Client::connect(endpoint, options()).await.unwrap();
    let callers = client.clone();
    tokio::task::spawn_blocking(move || {
        std::thread::scope(|scope| {
            for thread in 0..THREADS {
                let client = callers.clone();
                scope.spawn(move || {
                    current_thread().block_on(async {
                        let tasks: Vec<_> = (0..2)
                            .map(|task| {
                                let client = client.clone();
                                tokio::spawn(async move {
                                    for call in 0..CALLS {
                                        let amount = (thread * 2 + task) * CALLS + call;
                                        let counted =
                                            client.incr("login", "user-42", amount).await.unwrap();
                                        assert_eq!(counted, estimate(amount.into()));
                                    }
                                })
                            })
                            .collect();
                        for task in tasks {
                            task.await.unwrap();
                        }
                    });
                });
            }
        });
    })
    .await
    .unwrap();
    drop(client);
    server.await.unwrap();
}

fn allowed() -> Decision {
    Decision {
        allowed: true,
        estimate: 1,
        limit: 10,
        remaining: 9,
        reset_after_ms: 1000,
        mode: Mode::ApproximateConnected,
        staleness_ms: 0,
        bound: 0.0,
    }
}

#[tokio::test]
async fn a_pipeline_gets_each_answer_in_its_own_order_whatever_order_they_come_in() {
    let unknown = Refusal::UnknownRule {
        rule: "nope".into(),
    };
    let refusal = unknown.clone();
    let (listener, endpoint) = listen().await;
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        // All four arrive before any is answered: they are sent together.
        let mut requests = Vec::new();
        for _ in 0..4 {
            requests.push(read_request(&mut stream).await.unwrap());
        }
        let ops: Vec<&Op> = requests.iter().map(|request| &request.op).collect();
        assert!(
            matches!(
                ops[..],
                [
                    Op::Incr { amount: 3, .. },
                    Op::Get { .. },
                    Op::Check { cost: 1, .. },
                    Op::Decr { amount: 2, .. }
                ]
            ),
            "{ops:?}"
        );
        let results = [
            Ok(Reply::Counted(estimate(3))),
            Ok(Reply::Estimate(estimate(3))),
            Ok(Reply::Decision(allowed())),
            Err(refusal),
        ];
        let answers: Vec<Response> = requests
            .iter()
            .zip(results)
            .map(|(request, result)| Response {
                id: request.id,
                result,
            })
            .rev()
            .collect();
        write_responses(&mut stream, &answers).await;
    });

    let client = Client::connect(endpoint, options()).await.unwrap();
    let mut pipeline = Pipeline::new();
    pipeline
        .incr("login", "user-42", 3)
        .get("login", "user-42")
        .check("login", "user-42", 1)
        .decr("nope", "user-42", 2);
    let results = client.send(&pipeline).await.unwrap();
    assert_eq!(results.len(), 4);
    assert_eq!(*results[0].as_ref().unwrap(), Reply::Counted(estimate(3)));
    assert_eq!(*results[1].as_ref().unwrap(), Reply::Estimate(estimate(3)));
    assert_eq!(*results[2].as_ref().unwrap(), Reply::Decision(allowed()));
    assert!(
        matches!(&results[3], Err(Error::Refused(refusal)) if *refusal == unknown),
        "{:?}",
        results[3]
    );
    server.await.unwrap();
}

#[tokio::test]
async fn in_a_pipeline_each_request_times_out_or_is_checked_on_its_own() {
    let timeout = Duration::from_millis(300);
    let (listener, endpoint) = listen().await;
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let first = read_request(&mut stream).await.unwrap();
        let second = read_request(&mut stream).await.unwrap();
        let _third = read_request(&mut stream).await.unwrap();
        // The first is answered, the second with the wrong kind, the third never.
        let answers = [
            Response {
                id: first.id,
                result: Ok(Reply::Counted(estimate(1))),
            },
            Response {
                id: second.id,
                result: Ok(Reply::Status(status())),
            },
        ];
        write_responses(&mut stream, &answers).await;
        assert!(read_request(&mut stream).await.is_none());
    });

    let client = Client::connect(endpoint, options().with_timeout(timeout))
        .await
        .unwrap();
    let mut pipeline = Pipeline::new();
    pipeline
        .incr("login", "user-42", 1)
        .check("login", "user-42", 1)
        .get("login", "user-42");
    let results = client.send(&pipeline).await.unwrap();
    assert_eq!(*results[0].as_ref().unwrap(), Reply::Counted(estimate(1)));
    assert!(
        matches!(&results[1], Err(Error::Protocol(why)) if why.contains("check expects a Decision reply")),
        "{:?}",
        results[1]
    );
    assert!(
        matches!(results[2], Err(Error::Timeout { after }) if after == timeout),
        "{:?}",
        results[2]
    );
    drop(client);
    server.await.unwrap();
}

#[tokio::test]
async fn a_pipeline_too_large_to_send_is_refused_whole_and_an_empty_one_sends_nothing() {
    let (listener, endpoint) = listen().await;
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        // Nothing of the refused pipelines arrives: the first request is the status.
        answer_status(&mut stream).await;
    });

    let client = Client::connect(endpoint, options()).await.unwrap();
    assert!(client.send(&Pipeline::new()).await.unwrap().is_empty());

    // Each request fits in a frame, but together they are over a mebibyte.
    let big = "s".repeat(wire::CLIENT_FRAME_BYTES_MAX - 100);
    let mut pipeline = Pipeline::new();
    for _ in 0..17 {
        pipeline.incr("login", &big, 1);
    }
    let err = client.send(&pipeline).await.unwrap_err();
    assert!(
        matches!(&err, Error::Refused(Refusal::BadField { field, why })
            if field == "pipeline" && why.contains("17 requests")),
        "{err:?}"
    );

    // One request too large for a frame refuses the whole pipeline.
    let huge = "x".repeat(wire::CLIENT_FRAME_BYTES_MAX);
    pipeline.clear();
    pipeline.get("login", "user-42").incr("login", &huge, 1);
    let err = client.send(&pipeline).await.unwrap_err();
    assert!(
        matches!(&err, Error::Refused(Refusal::BadField { field, .. }) if field == "subject"),
        "{err:?}"
    );

    assert_eq!(client.status().await.unwrap(), status());
    server.await.unwrap();
}

#[tokio::test]
async fn a_pipeline_cut_off_by_a_dropped_connection_fails_whole_and_the_next_reconnects() {
    let (listener, endpoint) = listen().await;
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        for _ in 0..3 {
            read_request(&mut stream).await.unwrap();
        }
        drop(stream);
        let (mut stream, _) = listener.accept().await.unwrap();
        let first = read_request(&mut stream).await.unwrap();
        let second = read_request(&mut stream).await.unwrap();
        let answers = [first, second].map(|request| Response {
            id: request.id,
            result: Ok(Reply::Counted(estimate(5))),
        });
        write_responses(&mut stream, &answers).await;
    });

    let client = Client::connect(endpoint, options()).await.unwrap();
    let mut pipeline = Pipeline::new();
    pipeline
        .incr("login", "a", 1)
        .incr("login", "b", 1)
        .incr("login", "c", 1);
    let results = client.send(&pipeline).await.unwrap();
    assert_eq!(results.len(), 3, "one result per request: {results:?}");
    for result in results {
        assert!(matches!(result, Err(Error::Disconnected)), "{result:?}");
    }
    pipeline.clear();
    pipeline.incr("login", "a", 1).incr("login", "b", 1);
    let results = client.send(&pipeline).await.unwrap();
    assert_eq!(results.len(), 2, "one result per request: {results:?}");
    for result in results {
        assert_eq!(result.unwrap(), Reply::Counted(estimate(5)));
    }
    server.await.unwrap();
}

#[tokio::test]
async fn a_dropped_pipeline_leaves_the_connection_serving_and_its_late_answers_reach_no_one() {
    let (listener, endpoint) = listen().await;
    let (cancelled, was_cancelled) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let first = read_request(&mut stream).await.unwrap();
        let second = read_request(&mut stream).await.unwrap();
        was_cancelled.await.unwrap();
        let get = read_request(&mut stream).await.unwrap();
        // The dropped pipeline's answers come late, ahead of the get's.
        let answers = [
            Response {
                id: first.id,
                result: Ok(Reply::Counted(estimate(1))),
            },
            Response {
                id: second.id,
                result: Ok(Reply::Counted(estimate(2))),
            },
            Response {
                id: get.id,
                result: Ok(Reply::Estimate(estimate(9))),
            },
        ];
        write_responses(&mut stream, &answers).await;
    });

    let client = Client::connect(endpoint, options()).await.unwrap();
    let mut pipeline = Pipeline::new();
    pipeline.incr("login", "a", 1).incr("login", "b", 1);
    let gave_up = tokio::time::timeout(Duration::from_millis(100), client.send(&pipeline)).await;
    assert!(gave_up.is_err(), "no answer came, so the pipeline waited");
    cancelled.send(()).unwrap();
    assert_eq!(client.get("login", "user-42").await.unwrap(), estimate(9));
    server.await.unwrap();
}

/// A current-thread runtime, as an application's thread would run.
fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A sidecar on a thread and runtime of its own, answering every request with a count of 1;
/// if `drop_first`, it closes its first connection after one answer.
fn sidecar_on_its_own_thread(drop_first: bool) -> Endpoint {
    let (endpoint_sender, endpoint) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        current_thread().block_on(async move {
            let (listener, endpoint) = listen().await;
            endpoint_sender.send(endpoint).unwrap();
            for connection in 0.. {
                let (stream, _) = listener.accept().await.unwrap();
                let once = drop_first && connection == 0;
                tokio::spawn(async move {
                    let (mut read, mut write) = stream.into_split();
                    while let Some(request) = read_request(&mut read).await {
                        let response = Response {
                            id: request.id,
                            result: Ok(Reply::Counted(estimate(1))),
                        };
                        write_responses(&mut write, &[response]).await;
                        if once {
                            return;
                        }
                    }
                });
            }
        })
    });
    endpoint.recv().unwrap()
}

/// A client connected, and one increment answered, on an application's runtime that keeps
/// running on its own thread until told to stop.
fn connected_on_an_application_thread(
    endpoint: Endpoint,
) -> (
    Client,
    tokio::sync::oneshot::Sender<()>,
    std::thread::JoinHandle<()>,
) {
    let (client_sender, client) = std::sync::mpsc::channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let application = std::thread::spawn(move || {
        current_thread().block_on(async move {
            let client = Client::connect(endpoint, options()).await.unwrap();
            assert_eq!(
                client.incr("login", "user-42", 1).await.unwrap(),
                estimate(1)
            );
            client_sender.send(client).unwrap();
            stopped.await.unwrap();
        })
    });
    (client.recv().unwrap(), stop, application)
}

#[test]
fn a_reconnect_called_from_a_runtime_without_timers_is_timed_on_the_connections() {
    let endpoint = sidecar_on_its_own_thread(true);
    let (client, stop, application) = connected_on_an_application_thread(endpoint);
    // A runtime with no timer: the reconnect's timeout is not made on it.
    let no_timers = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .unwrap();
    let mut answered = false;
    for _ in 0..100 {
        match no_timers.block_on(client.incr("login", "user-42", 1)) {
            Ok(counted) => {
                assert_eq!(counted, estimate(1));
                answered = true;
                break;
            }
            Err(Error::Disconnected) => std::thread::sleep(Duration::from_millis(10)),
            Err(err) => panic!("{err:?}"),
        }
    }
    assert!(answered, "the calls never got through");
    stop.send(()).unwrap();
    application.join().unwrap();
}

#[test]
fn calls_fail_rather_than_hang_once_the_connecting_runtime_is_gone() {
    // The connection's tasks run on the runtime that connected. Once it is shut down, a
    // call from another runtime must fail (the tasks were dropped with the link open),
    // and so must its reconnect, whose tasks the dead runtime can never run.
    let endpoint = sidecar_on_its_own_thread(false);
    let connecting = current_thread();
    let client = connecting.block_on(async {
        let client = Client::connect(endpoint, options()).await.unwrap();
        assert_eq!(
            client.incr("login", "user-42", 1).await.unwrap(),
            estimate(1)
        );
        client
    });
    drop(connecting);
    current_thread().block_on(async {
        let mut results = Vec::new();
        for _ in 0..3 {
            let call = client.incr("login", "user-42", 1);
            let result = tokio::time::timeout(Duration::from_secs(10), call)
                .await
                .expect("the call came back");
            results.push(result);
        }
        // The dropped tasks closed the link: each call reconnects, finds the runtime gone
        // and says so, not retryable, so a retry loop stops.
        for result in &results {
            let Err(err) = result else {
                panic!("{results:?}");
            };
            assert!(matches!(err, Error::RuntimeStopped), "{results:?}");
            assert!(!err.is_retryable());
        }
    });
}

#[test]
fn a_reconnect_made_from_another_runtime_keeps_serving_once_that_runtime_idles() {
    let endpoint = sidecar_on_its_own_thread(true);
    let (client, stop, application) = connected_on_an_application_thread(endpoint);
    // A helper's runtime finds the connection closed and reconnects, then idles.
    current_thread().block_on(async {
        let mut answered = false;
        for _ in 0..100 {
            match client.incr("login", "user-42", 1).await {
                Ok(counted) => {
                    assert_eq!(counted, estimate(1));
                    answered = true;
                    break;
                }
                Err(Error::Disconnected) => tokio::time::sleep(Duration::from_millis(10)).await,
                Err(err) => panic!("{err:?}"),
            }
        }
        assert!(answered, "the helper's calls never got through");
    });
    // Another caller is still answered: the new link is served by the application's
    // runtime, not by the helper's, which no longer runs.
    let result = current_thread().block_on(client.incr("login", "user-42", 1));
    assert_eq!(result.unwrap(), estimate(1));
    stop.send(()).unwrap();
    application.join().unwrap();
}

/// An answer that arrives one byte at a time (its length prefix split too) is still
/// matched to its call, and a truncated one followed by the end of the stream fails the
/// waiting call with `Disconnected`, not a panic or a hang (from review, session 46).
#[tokio::test]
async fn an_answer_trickled_byte_by_byte_is_decoded_and_a_truncated_one_disconnects() {
    let (listener, endpoint) = listen().await;
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let answer = |id, count| {
            let mut frame = Vec::new();
            let result = Ok(Reply::Estimate(estimate(count)));
            wire::encode_frame(&Response { id, result }, &mut frame);
            frame
        };
        let first = read_request(&mut stream).await.unwrap();
        for byte in answer(first.id, 11) {
            stream.write_all(&[byte]).await.unwrap();
            stream.flush().await.unwrap();
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let second = read_request(&mut stream).await.unwrap();
        let frame = answer(second.id, 12);
        stream.write_all(&frame[..frame.len() - 1]).await.unwrap();
    });
    let client = Client::connect(endpoint, options()).await.unwrap();
    assert_eq!(client.get("r", "s").await.unwrap(), estimate(11));
    let err = client.get("r", "s").await.unwrap_err();
    assert!(matches!(err, Error::Disconnected), "{err:?}");
    server.await.unwrap();
}

/// A sidecar that answers a request and then goes away with a request of this client still
/// unread resets the connection. The answer was in the client's socket before the reset: a
/// write failing on the reset socket must not close the link before the reader has handed
/// that answer to its call, which would be told `Disconnected` (outcome unknown, and a
/// retry may count twice) for a request whose answer had come (found in review).
#[tokio::test]
async fn an_answer_that_came_before_the_connection_was_reset_reaches_its_call() {
    let (listener, endpoint) = listen().await;
    let client = Client::connect(endpoint, options()).await.unwrap();
    let (mut sidecar, _) = listener.accept().await.unwrap();
    let call = |amount| {
        let client = client.clone();
        tokio::spawn(async move { client.incr("login", "user-42", amount).await })
    };
    let answered = call(1);
    let first = read_request(&mut sidecar).await.unwrap();
    // A second request arrives and is left unread, so that closing resets the connection.
    let unread = call(2);
    sidecar.peek(&mut [0]).await.unwrap();
    let answer = Response {
        id: first.id,
        result: Ok(Reply::Counted(estimate(1))),
    };
    write_responses(&mut sidecar, &[answer]).await;
    drop(sidecar);
    // The writer meets the reset with this request, before the reader has run.
    let failed_write = call(3);
    assert_eq!(answered.await.unwrap().unwrap(), estimate(1));
    for call in [unread, failed_write] {
        let err = call.await.unwrap().unwrap_err();
        assert!(matches!(err, Error::Disconnected), "{err:?}");
    }
}
