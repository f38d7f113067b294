//! Clients that hold a connection without a request open: every such wait is bounded by the
//! header timeout, whatever the protocol, and open streams are not. Paused time over loopback,
//! with a header timeout of [`T`].

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::{after_first_chunk, config, start, Conversation, Running, DEADLINE};
use crate::llama_stub::Stub;

/// The header timeout of these tests.
const T: Duration = Duration::from_millis(400);

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

async fn proxy(a: &Stub) -> Running {
    let mut c = config(&[("node-a", a)]);
    c.header_timeout = Some(T);
    start(c).await
}

/// Reads until the proxy closes the connection (an end of stream or a reset), for at most
/// `within`: what it sent, and when it closed (`None`: still open).
async fn until_closed(s: &mut TcpStream, within: Duration) -> (Vec<u8>, Option<Instant>) {
    let mut got = Vec::new();
    let deadline = Instant::now() + within;
    loop {
        let mut buf = [0u8; 4096];
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return (got, Some(Instant::now())),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return (got, None),
        }
    }
}

/// The types of the HTTP/2 frames in `bytes` (whole frames only).
fn frame_types(mut bytes: &[u8]) -> Vec<u8> {
    let mut types = Vec::new();
    while bytes.len() >= 9 {
        let len = usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
        types.push(bytes[3]);
        bytes = &bytes[(9 + len).min(bytes.len())..];
    }
    types
}

const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;

/// An empty SETTINGS frame.
const EMPTY_SETTINGS: [u8; 9] = [0, 0, 0, SETTINGS, 0, 0, 0, 0, 0];

/// A HEADERS frame opening stream 1: a POST of a chat whose body is still to come.
/// A connection to `proxy` that has sent the HTTP/2 preface and an empty SETTINGS frame, and
/// nothing else.
async fn http2_connection(proxy: &Running) -> TcpStream {
    let mut h2 = TcpStream::connect(proxy.addr).await.unwrap();
    h2.write_all(PREFACE).await.unwrap();
    h2.write_all(&EMPTY_SETTINGS).await.unwrap();
    h2
}

/// Reads `body`, a streamed answer, to its end.
async fn to_the_end(body: Incoming) {
    let rest = tokio::time::timeout(DEADLINE, body.collect())
        .await
        .expect("the stream stalled")
        .unwrap()
        .to_bytes();
    assert!(rest.ends_with(b"data: [DONE]\n\n"), "{rest:?}");
}

fn post_headers() -> Vec<u8> {
    let path = b"/v1/chat/completions";
    // HPACK: :method POST and :scheme http from the static table; :path and :authority as
    // literals with their names from it.
    let mut block = vec![0x83, 0x86, 0x04, path.len() as u8];
    block.extend_from_slice(path);
    block.extend_from_slice(&[0x01, 0x01, b'x']);
    let len = block.len();
    // END_HEADERS, not END_STREAM.
    let mut frame = vec![0, 0, len as u8, 0x1, 0x4, 0, 0, 0, 1];
    frame.extend(block);
    frame
}

/// A client that connects and sends nothing is disconnected at the header timeout: hyper's
/// header timer starts only once `auto::Builder` has the first bytes, which it waits for with
/// no timeout, so otherwise each such client would hold a connection and a file descriptor
/// for good.
#[tokio::test(start_paused = true)]
async fn a_client_silent_after_connecting_is_disconnected_at_the_header_timeout() {
    let a = Stub::start("a", 2).await;
    let proxy = proxy(&a).await;
    let started = Instant::now();
    let mut silent = TcpStream::connect(proxy.addr).await.unwrap();
    let (sent, closed) = until_closed(&mut silent, 4 * T).await;
    let closed = closed.expect("a silent client is held past 4x the header timeout");
    let waited = closed - started;
    assert!(waited >= T && waited < 3 * T, "{waited:?}");
    assert!(sent.is_empty(), "{sent:?}");

    // A client that waits less than the timeout before its request is served.
    let mut slow = TcpStream::connect(proxy.addr).await.unwrap();
    tokio::time::sleep(T / 2).await;
    slow.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(DEADLINE, slow.read(&mut buf))
        .await
        .expect("no answer in time")
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 201"), "{:?}", &buf[..n]);
}

/// So is one that sends the first line of the HTTP/2 preface and stops: `auto::Builder` reads
/// all 24 bytes of the preface before it chooses HTTP/2.
#[tokio::test(start_paused = true)]
async fn a_client_silent_after_part_of_the_http2_preface_is_disconnected_at_the_header_timeout() {
    let a = Stub::start("a", 2).await;
    let proxy = proxy(&a).await;
    let started = Instant::now();
    let mut partial = TcpStream::connect(proxy.addr).await.unwrap();
    partial.write_all(&PREFACE[..16]).await.unwrap();
    let (_, closed) = until_closed(&mut partial, 4 * T).await;
    let closed = closed.expect("held past 4x the header timeout");
    let waited = closed - started;
    assert!(waited >= T && waited < 3 * T, "{waited:?}");
}

/// An HTTP/2 connection that sends its preface and SETTINGS and then nothing is told to go
/// (GOAWAY) at the header timeout and closed by twice that, though it answers nothing: hyper
/// has no header or idle timeout for HTTP/2, so otherwise it would stay open for good.
#[tokio::test(start_paused = true)]
async fn an_idle_http2_connection_is_closed() {
    let a = Stub::start("a", 2).await;
    let proxy = proxy(&a).await;
    let started = Instant::now();
    let mut h2 = http2_connection(&proxy).await;
    let (sent, closed) = until_closed(&mut h2, 6 * T).await;
    let closed = closed.expect("an idle HTTP/2 connection is held past 6x the header timeout");
    let waited = closed - started;
    assert!(waited >= T && waited < 4 * T, "{waited:?}");
    let types = frame_types(&sent);
    assert!(types.contains(&GOAWAY), "frames {types:?}");
}

/// An HTTP/2 client that opens a stream and then stops answering is pinged after the header
/// timeout without a frame, and disconnected when the ping goes unanswered as long again,
/// though its stream is open (a peer gone without a word would otherwise hold its stream,
/// and the backend slot behind it, until TCP gives up).
#[tokio::test(start_paused = true)]
async fn an_http2_client_that_does_not_answer_a_ping_is_disconnected() {
    let a = Stub::start("a", 2).await;
    let proxy = proxy(&a).await;
    let started = Instant::now();
    let mut h2 = http2_connection(&proxy).await;
    // The request's body never comes: the proxy waits for it (up to its read timeout, 60 s).
    h2.write_all(&post_headers()).await.unwrap();
    let (sent, closed) = until_closed(&mut h2, 6 * T).await;
    let closed = closed.expect("held past 6x the header timeout");
    let waited = closed - started;
    assert!(waited >= 2 * T && waited < 4 * T, "{waited:?}");
    // Pinged; not told to go as idle while its stream is open.
    let types = frame_types(&sent);
    let ping = types.iter().position(|&t| t == PING);
    let goaway = types.iter().position(|&t| t == GOAWAY);
    assert!(
        ping.is_some_and(|p| goaway.is_none_or(|g| p < g)),
        "frames {types:?}"
    );
}

/// A stream that outlasts the header timeout several times over is served to its end on an
/// HTTP/2 connection (its client answers pings), and the connection is closed once it has
/// been idle for the header timeout after that.
#[tokio::test(start_paused = true)]
async fn an_http2_stream_outlasting_the_header_timeout_ends_then_its_idle_connection_closes() {
    let a = Stub::start("a", 2).await;
    let proxy = proxy(&a).await;
    a.hold_streams();
    let stream = TcpStream::connect(proxy.addr).await.unwrap();
    let (mut tx, conn) = hyper::client::conn::http2::handshake::<_, _, Full<Bytes>>(
        TokioExecutor::new(),
        TokioIo::new(stream),
    )
    .await
    .unwrap();
    let mut conn = tokio::spawn(conn);

    let body = Conversation::new("long").next(json!({"stream": true}));
    let req = Request::post(format!("http://{}/v1/chat/completions", proxy.addr))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let res = tokio::time::timeout(DEADLINE, tx.send_request(req))
        .await
        .expect("no response in time")
        .unwrap();
    let body = after_first_chunk(res).await;
    // Held for three header timeouts: longer than the idle bound and than a ping's.
    tokio::time::sleep(3 * T).await;
    assert!(
        !conn.is_finished(),
        "the connection closed with its stream open"
    );
    // The stream ends after this, and the idle bound counts from its end.
    let released = Instant::now();
    a.release_streams();
    to_the_end(body).await;

    tokio::time::timeout(4 * T, &mut conn)
        .await
        .expect("the idle connection is held past 4x the header timeout")
        .unwrap()
        .unwrap();
    let idle = released.elapsed();
    assert!(
        idle >= T,
        "closed {idle:?} after its stream was let go, before the header timeout"
    );
}

/// HTTP/1 keeps what it had: a stream outlasting the header timeout is served to its end,
/// and a client that thinks for less than the header timeout before its next request keeps
/// its connection.
#[tokio::test(start_paused = true)]
async fn an_http1_stream_outlasting_the_header_timeout_ends_and_the_next_request_follows() {
    let a = Stub::start("a", 2).await;
    let proxy = proxy(&a).await;
    let stream = TcpStream::connect(proxy.addr).await.unwrap();
    let (mut tx, conn) =
        hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    let mut conversation = Conversation::new("thinker");
    let post = |body: serde_json::Value| {
        Request::post("/v1/chat/completions")
            .header("host", "x")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap()
    };
    a.hold_streams();
    let req = post(conversation.next(json!({"stream": true})));
    let res = tokio::time::timeout(DEADLINE, tx.send_request(req))
        .await
        .expect("no response in time")
        .unwrap();
    let body = after_first_chunk(res).await;
    tokio::time::sleep(2 * T).await;
    a.release_streams();
    to_the_end(body).await;
    tokio::time::sleep(T / 2).await;
    let req = post(conversation.next(json!({})));
    let res = tokio::time::timeout(DEADLINE, tx.send_request(req))
        .await
        .expect("no response in time")
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    res.into_body().collect().await.unwrap();
    assert!(!conn.is_finished());
}

/// A header timeout too long for the clock (`--header-timeout 10000000000000000000`, some
/// 300 billion years) is as good as none: each connection's header timer and HTTP/2 ping
/// were set by adding it to the clock, which panicked, so every connection was dropped
/// unanswered.
#[tokio::test(start_paused = true)]
async fn a_header_timeout_too_long_for_the_clock_serves_http1_and_http2() {
    let a = Stub::start("a", 2).await;
    let mut c = config(&[("node-a", &a)]);
    let args = [
        "--backend",
        "n=http://x:1",
        "--header-timeout",
        "10000000000000000000",
    ];
    let crate::cli::Command::Run(parsed) = crate::cli::parse(args).unwrap() else {
        panic!("a run");
    };
    c.header_timeout = parsed.config.header_timeout;
    assert!(c.header_timeout.is_some());
    let proxy = start(c).await;
    // HTTP/1, two requests on one connection.
    assert_eq!(proxy.get("/health").await.status, StatusCode::OK);
    assert_eq!(proxy.get("/health").await.status, StatusCode::OK);
    // HTTP/2.
    let stream = TcpStream::connect(proxy.addr).await.unwrap();
    let (mut tx, conn) = hyper::client::conn::http2::handshake::<_, _, Full<Bytes>>(
        TokioExecutor::new(),
        TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = Request::get(format!("http://{}/health", proxy.addr))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let res = tokio::time::timeout(DEADLINE, tx.send_request(req))
        .await
        .expect("no response in time")
        .expect("the HTTP/2 connection failed");
    assert_eq!(res.status(), StatusCode::OK);
}
