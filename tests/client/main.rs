//! `HttpBackend` over real HTTP on loopback: stub servers started by each test, hyper's or a
//! raw socket that misbehaves on purpose.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tower::retry::RetryLayer;
use tower::{Layer, ServiceExt};
use tower_affinity::client::{BackendBody, FailureKind, HttpBackend, HttpBackendError};
use tower_affinity::discover::StaticFleet;
use tower_affinity::{Backend, Error, SessionAffinityLayer};

#[allow(dead_code)]
#[path = "../support/llama_stub.rs"]
mod llama_stub;
#[path = "../support/refusing.rs"]
mod refusing;

use refusing::Refusing;

type Body = Full<Bytes>;

/// The longest any one exchange may take.
const DEADLINE: Duration = Duration::from_secs(5);

/// What the stub saw of one request.
#[derive(Clone, Debug)]
struct Seen {
    method: http::Method,
    uri: http::Uri,
    version: Version,
    headers: http::HeaderMap,
    body: Bytes,
}

/// A hyper server on loopback (HTTP/1.1 and HTTP/2 with prior knowledge) that records each
/// request and answers 200 with `x-stub: NAME` and some hop-by-hop headers of its own, and a
/// body `ok` that ends with the trailer `x-done: yes` (declared in `Trailer`; hyper's HTTP/1.1
/// server sends it only to a request whose `TE` asks for trailers).
async fn stub(name: &'static str) -> (SocketAddr, Arc<Mutex<Vec<Seen>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let log = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let log = log.clone();
            let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let log = log.clone();
                async move {
                    let (parts, body) = req.into_parts();
                    let body = body.collect().await?.to_bytes();
                    log.lock().push(Seen {
                        method: parts.method,
                        uri: parts.uri,
                        version: parts.version,
                        headers: parts.headers,
                        body,
                    });
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("x-done", http::HeaderValue::from_static("yes"));
                    let frames: Vec<Result<http_body::Frame<Bytes>, Infallible>> = vec![
                        Ok(http_body::Frame::data(Bytes::from_static(b"ok"))),
                        Ok(http_body::Frame::trailers(trailers)),
                    ];
                    let res = Response::builder()
                        .header("x-stub", name)
                        .header("connection", "x-resp-hop")
                        .header("x-resp-hop", "1")
                        .header("keep-alive", "timeout=5")
                        .header("proxy-connection", "keep-alive")
                        .header("trailer", "x-done")
                        .body(http_body_util::StreamBody::new(tokio_stream::iter(frames)))
                        .unwrap();
                    Ok::<_, hyper::Error>(res)
                }
            });
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
            });
        }
    });
    (addr, seen)
}

/// A raw server that reads one request's head and then does `then` with the socket.
async fn raw<F, Fut>(then: F) -> SocketAddr
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let then = Arc::new(then);
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let then = then.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                then(stream).await;
            });
        }
    });
    addr
}

/// Closes `stream` with a reset (RST) rather than a FIN: linger zero, which does not block,
/// as there is nothing left to send.
#[allow(deprecated)]
fn reset(stream: tokio::net::TcpStream) {
    let _ = stream.set_linger(Some(Duration::ZERO));
    drop(stream);
}

fn url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

async fn call(
    backend: &HttpBackend<Body>,
    req: Request<Body>,
) -> Result<Response<BackendBody>, HttpBackendError> {
    tokio::time::timeout(DEADLINE, backend.clone().oneshot(req))
        .await
        .expect("no answer in time")
}

#[tokio::test]
async fn method_path_query_and_body_are_kept_and_the_authority_rewritten() {
    let (addr, seen) = stub("a").await;
    let backend = HttpBackend::new(&url(addr)).unwrap();
    let req = Request::put("http://proxy.example:8000/v1/chat/completions?stream=false&x=%20y")
        .header("host", "proxy.example:8000")
        .header("x-session-id", "s-1")
        .body(Full::new(Bytes::from_static(br#"{"messages":[]}"#)))
        .unwrap();
    let res = call(&backend, req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["x-stub"], "a");
    let seen = seen.lock()[0].clone();
    assert_eq!(seen.method, http::Method::PUT);
    assert_eq!(
        seen.uri.path_and_query().unwrap().as_str(),
        "/v1/chat/completions?stream=false&x=%20y"
    );
    assert_eq!(seen.headers["host"], addr.to_string());
    assert_eq!(seen.headers["x-session-id"], "s-1");
    assert_eq!(seen.body.as_ref(), br#"{"messages":[]}"#);
    assert_eq!(seen.version, Version::HTTP_11);
}

#[tokio::test]
async fn hop_by_hop_headers_are_dropped_both_ways_with_those_connection_names() {
    let (addr, seen) = stub("a").await;
    let backend = HttpBackend::new(&url(addr)).unwrap();
    let req = Request::post("/v1/completions")
        .header("connection", "x-req-hop, keep-alive")
        .header("x-req-hop", "1")
        .header("keep-alive", "timeout=5")
        .header("proxy-authorization", "Basic eA==")
        .header("proxy-connection", "keep-alive")
        .header("upgrade", "h2c")
        .header("te", "trailers")
        .header("x-end-to-end", "kept")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let res = call(&backend, req).await.unwrap();
    let seen = seen.lock()[0].clone();
    for name in [
        "x-req-hop",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "upgrade",
    ] {
        assert!(
            !seen.headers.contains_key(name),
            "{name} reached the backend"
        );
    }
    // `TE` is the connection's, but a client that reads trailers has the proxy ask for them.
    assert_eq!(seen.headers["te"], "trailers");
    assert_eq!(seen.headers["x-end-to-end"], "kept");
    for name in ["connection", "x-resp-hop", "keep-alive", "proxy-connection"] {
        assert!(
            !res.headers().contains_key(name),
            "{name} reached the client"
        );
    }
    assert_eq!(res.headers()["x-stub"], "a");
}

/// A backend's trailers reach a client that asked for them (`TE: trailers`), with the
/// `Trailer` header that declares them; a client that did not ask has none asked for.
#[tokio::test]
async fn trailers_pass_to_a_client_that_asks_for_them() {
    let (addr, seen) = stub("t").await;
    let backend = HttpBackend::new(&url(addr)).unwrap();
    let asking = Request::post("/v1/chat/completions")
        .header("te", "trailers")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let res = call(&backend, asking).await.unwrap();
    assert_eq!(res.headers()["trailer"], "x-done");
    let body = res.into_body().collect().await.unwrap();
    assert_eq!(body.trailers().unwrap()["x-done"], "yes");
    let plain = Request::post("/v1/chat/completions")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let res = call(&backend, plain).await.unwrap();
    let body = res.into_body().collect().await.unwrap();
    assert!(body.trailers().is_none());
    let te: Vec<_> = seen
        .lock()
        .iter()
        .map(|s| s.headers.get("te").cloned())
        .collect();
    assert_eq!(te, [Some(http::HeaderValue::from_static("trailers")), None]);
}

#[tokio::test]
async fn http2_with_prior_knowledge_reaches_the_backend_as_http2() {
    let (addr, seen) = stub("h2").await;
    let backend = HttpBackend::<Body>::builder()
        .http2_prior_knowledge(true)
        .build(&url(addr))
        .unwrap();
    for i in 0..3 {
        let req = Request::post(format!("/v1/chat/completions?i={i}"))
            .header("connection", "x-hop")
            .header("x-hop", "1")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let res = call(&backend, req).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.version(), Version::HTTP_2);
        assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "ok");
    }
    let seen = seen.lock().clone();
    assert_eq!(seen.len(), 3);
    for s in &seen {
        assert_eq!(s.version, Version::HTTP_2);
        assert_eq!(
            s.uri.authority().map(|a| a.as_str()),
            Some(&*addr.to_string())
        );
        assert!(!s.headers.contains_key("x-hop"));
    }
    assert_eq!(
        seen[2].uri.path_and_query().unwrap(),
        "/v1/chat/completions?i=2"
    );
}

#[tokio::test]
async fn a_refused_connection_is_a_502_refusal() {
    let refusing = Refusing::new();
    let backend = HttpBackend::new(&url(refusing.addr)).unwrap();
    let e = call(&backend, Request::get("/").body(Body::default()).unwrap())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), FailureKind::Refused, "{e}");
    assert_eq!(e.status(), 502);
    assert!(e.to_string().starts_with("connection refused"), "{e}");
}

#[tokio::test]
async fn a_connection_reset_before_the_headers_end_is_a_502_reset() {
    let addr = raw(|mut stream| async move {
        let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-le").await;
        reset(stream);
    })
    .await;
    let backend = HttpBackend::new(&url(addr)).unwrap();
    let e = call(&backend, Request::get("/").body(Body::default()).unwrap())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), FailureKind::Reset, "{e}");
    assert_eq!(e.status(), 502);
}

#[tokio::test]
async fn a_connection_closed_before_any_answer_is_a_reset() {
    let addr = raw(|stream| async move { drop(stream) }).await;
    let backend = HttpBackend::new(&url(addr)).unwrap();
    let e = call(&backend, Request::get("/").body(Body::default()).unwrap())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), FailureKind::Reset, "{e}");
}

/// A server that answers the first request on each connection and closes the connection
/// after reading the second, unanswered: as llama-server closes its connection after a
/// streamed answer while a request goes out on it. Counts its connections.
async fn answering_one_a_connection() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    let addr = raw(move |mut stream| {
        counted.fetch_add(1, Ordering::SeqCst);
        async move {
            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
            if stream.write_all(answer).await.is_err() {
                return;
            }
            // The next request's head, read and left unanswered.
            let (mut head, mut buf) = (Vec::new(), [0u8; 1024]);
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
        }
    })
    .await;
    (addr, connections)
}

#[tokio::test]
async fn a_request_on_a_connection_closed_unanswered_is_sent_again_on_another_when_asked() {
    use std::sync::atomic::Ordering;
    let get = || Request::get("/v1/models").body(Body::default()).unwrap();
    // Asked: the second request, on the first connection, is sent again on a second one.
    let (addr, connections) = answering_one_a_connection().await;
    let backend = HttpBackend::builder()
        .resend_on_close(true)
        .build(&url(addr))
        .unwrap();
    for turn in 0..2 {
        let res = call(&backend, get()).await.unwrap();
        assert_eq!(res.status(), 200, "turn {turn}");
        // Marked, for the balancer to count, when it was sent again.
        let marked = res
            .extensions()
            .get::<tower_affinity::SentAgain>()
            .is_some();
        assert_eq!(marked, turn == 1, "turn {turn}");
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"ok", "turn {turn}");
    }
    assert_eq!(connections.load(Ordering::SeqCst), 2);
    // Not asked (the default): the second request fails, its connection reset.
    let (addr, _) = answering_one_a_connection().await;
    let backend = HttpBackend::new(&url(addr)).unwrap();
    let res = call(&backend, get()).await.unwrap();
    res.into_body().collect().await.unwrap();
    let e = call(&backend, get()).await.unwrap_err();
    assert_eq!(e.kind(), FailureKind::Reset, "{e}");
}

/// Two idle connections in the pool closed unseen at once (two streams ended together): the
/// request sent again goes out on a connection opened for it, not on the other stale one.
#[tokio::test]
async fn a_request_sent_again_goes_out_on_a_new_connection_not_another_idle_one() {
    use std::sync::atomic::Ordering;
    let (addr, connections) = answering_one_a_connection().await;
    let backend = HttpBackend::builder()
        .resend_on_close(true)
        .build(&url(addr))
        .unwrap();
    let get = || Request::get("/v1/models").body(Body::default()).unwrap();
    // Two at once: two connections, each answered once and back in the pool.
    let (a, b) = tokio::join!(call(&backend, get()), call(&backend, get()));
    for res in [a, b] {
        res.unwrap().into_body().collect().await.unwrap();
    }
    assert_eq!(connections.load(Ordering::SeqCst), 2);
    // Each idle one now closes when it reads a request: the third is answered on a third.
    let res = call(&backend, get()).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(connections.load(Ordering::SeqCst), 3);
}

/// A backend that is gone fails the second sending too: the failure is its, once.
#[tokio::test]
async fn a_request_sent_again_to_a_backend_that_is_gone_fails_as_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        // One connection: its first request answered, its second read, then the listener
        // closed with the connection, as a backend that stops.
        let (mut stream, _) = listener.accept().await.unwrap();
        let (mut head, mut buf) = (Vec::new(), [0u8; 1024]);
        for answered in [true, false] {
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            head.clear();
            if answered {
                let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                stream.write_all(answer).await.unwrap();
            }
        }
    });
    let backend = HttpBackend::builder()
        .resend_on_close(true)
        .build(&url(addr))
        .unwrap();
    let get = || Request::get("/").body(Body::default()).unwrap();
    let res = call(&backend, get()).await.unwrap();
    res.into_body().collect().await.unwrap();
    // The server reads the second request and stops, listener and all, before answering.
    let second = tokio::spawn({
        let backend = backend.clone();
        async move { call(&backend, get()).await }
    });
    server.await.unwrap();
    let e = second.await.unwrap().unwrap_err();
    assert_eq!(e.kind(), FailureKind::Refused, "{e}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn no_response_headers_within_the_timeout_is_a_504_timeout() {
    // Reads the request, then never answers; the socket stays open.
    let addr = raw(|stream| async move {
        std::future::pending::<()>().await;
        drop(stream);
    })
    .await;
    let backend = HttpBackend::<Body>::builder()
        .connect_timeout(None)
        .response_timeout(Duration::from_secs(30))
        .build(&url(addr))
        .unwrap();
    let started = tokio::time::Instant::now();
    let e = backend
        .clone()
        .oneshot(Request::get("/").body(Body::default()).unwrap())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), FailureKind::Timeout, "{e}");
    assert_eq!(e.status(), 504);
    assert!(
        e.to_string().contains("no response headers within 30s"),
        "{e}"
    );
    assert!(started.elapsed() >= Duration::from_secs(30));

    // Through the balancer: 504, and the backend passed over for the cooldown.
    let svc =
        SessionAffinityLayer::new().layer(StaticFleet::new([("slow", Backend::new("n", backend))]));
    let e = svc
        .clone()
        .oneshot(Request::get("/").body(Body::default()).unwrap())
        .await
        .unwrap_err();
    assert_eq!(e.status(), 504);
    assert_eq!(
        HttpBackendError::of(&e).map(|e| e.kind()),
        Some(FailureKind::Timeout)
    );
    assert!(!svc.backends()[0].healthy);
}

/// No connection within the connect timeout: a listener whose backlog is full drops the
/// connection's SYN, as a host that is down or cut off does. A 504 that says it was the
/// connection that timed out, not the answer.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn no_connection_within_the_connect_timeout_is_a_504_timeout_that_says_so() {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1).unwrap();
    let addr = listener.local_addr().unwrap();
    // Never accepted: with these the backlog is full.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    // The response timeout bounds the test should a connection be made after all.
    let backend = HttpBackend::<Body>::builder()
        .connect_timeout(Duration::from_secs(2))
        .response_timeout(Duration::from_secs(10))
        .build(&url(addr))
        .unwrap();
    let started = tokio::time::Instant::now();
    let e = backend
        .oneshot(Request::get("/").body(Body::default()).unwrap())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), FailureKind::Timeout, "{e}");
    assert_eq!(e.status(), 504);
    assert_eq!(started.elapsed(), Duration::from_secs(2));
    assert!(e.to_string().starts_with("timed out connecting: "), "{e}");
    drop((listener, held));
}

/// A request body that sends its first bytes and then nothing more, its sender still there:
/// a client that trickles its upload, or stalls.
type Trickle = http_body_util::combinators::BoxBody<Bytes, Infallible>;

fn trickling() -> Request<Trickle> {
    use tokio_stream::StreamExt as _;
    let first = Ok(http_body::Frame::data(Bytes::from_static(
        b"{\"messages\":",
    )));
    let frames = tokio_stream::iter([first]).chain(tokio_stream::pending());
    Request::post("/v1/chat/completions")
        .header("x-session-id", "s-1")
        .body(BodyExt::boxed(http_body_util::StreamBody::new(frames)))
        .unwrap()
}

/// A hyper server on loopback (HTTP/1.1 and HTTP/2) that reads each request's whole body and
/// then never answers.
async fn silent_after_the_body() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let svc = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| async {
                req.into_body().collect().await?;
                std::future::pending::<Result<Response<Body>, hyper::Error>>().await
            });
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
            });
        }
    });
    addr
}

/// The response timeout passing while the request's own body is still awaited from the
/// client is the client's slowness, not the backend's: the request's fault (400), and the
/// backend, which waited for the rest of the body, is not passed over. A client trickling its
/// bodies must not be able to mark backends down. Once the body is all sent, the timeout is
/// the backend's.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_response_timeout_while_the_body_still_arrives_is_the_requests_fault() {
    // Both read the whole body before they answer; the second never does.
    let (addr, seen) = stub("a").await;
    let silent = silent_after_the_body().await;
    for http2 in [false, true] {
        let builder = HttpBackend::<Trickle>::builder()
            .connect_timeout(None)
            .http2_prior_knowledge(http2)
            .response_timeout(Duration::from_secs(30));
        let sent = builder.build(&url(silent)).unwrap();
        let whole = trickling().map(|_| {
            let frames = [Ok(http_body::Frame::data(Bytes::from_static(b"{}")))];
            BodyExt::boxed(http_body_util::StreamBody::new(tokio_stream::iter(frames)))
        });
        let e = sent.oneshot(whole).await.unwrap_err();
        assert_eq!(e.kind(), FailureKind::Timeout, "http2 {http2}: {e}");

        let backend = builder.build(&url(addr)).unwrap();
        let started = tokio::time::Instant::now();
        let e = backend.clone().oneshot(trickling()).await.unwrap_err();
        assert_eq!(e.kind(), FailureKind::RequestBody, "http2 {http2}: {e}");
        assert_eq!(e.status(), 400);
        assert!(e.to_string().contains("still arriving after 30s"), "{e}");
        assert_eq!(started.elapsed(), Duration::from_secs(30));

        let svc = SessionAffinityLayer::new()
            .layer(StaticFleet::new([("a", Backend::new("n", backend))]));
        let e: Error = svc.clone().oneshot(trickling()).await.unwrap_err();
        assert_eq!(e.status(), 400, "http2 {http2}: {e}");
        let a = &svc.backends()[0];
        assert!(
            a.healthy,
            "http2 {http2}: a slow client marked the backend down"
        );
        assert_eq!(a.failures, 0);
        assert_eq!(svc.stats().backend_errors, 0);
    }
    assert!(seen.lock().is_empty());
}

#[tokio::test]
async fn a_body_cut_mid_response_fails_the_body_and_frees_the_slot() {
    let addr = raw(|mut stream| async move {
        let _ = stream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nfirst ten.")
            .await;
        reset(stream);
    })
    .await;
    let backend = HttpBackend::new(&url(addr)).unwrap();
    let svc =
        SessionAffinityLayer::new().layer(StaticFleet::new([("cut", Backend::new("n", backend))]));
    let res = tokio::time::timeout(
        DEADLINE,
        svc.clone()
            .oneshot(Request::get("/").body(Body::default()).unwrap()),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(res.status(), 200);
    let body = tokio::time::timeout(DEADLINE, res.into_body().collect())
        .await
        .unwrap();
    assert!(body.is_err(), "a cut body must not end as if complete");
    assert_eq!(svc.stats().in_flight, 0);
}

#[tokio::test]
async fn retry_once_moves_a_refused_request_to_another_backend() {
    let (live, seen) = stub("live").await;
    let refusing = Refusing::new();
    let dead = refusing.addr;
    let fleet = StaticFleet::new([
        (
            "dead",
            Backend::new("node-a", HttpBackend::new(&url(dead)).unwrap()),
        ),
        (
            "live",
            Backend::new("node-b", HttpBackend::new(&url(live)).unwrap()),
        ),
    ]);
    let affinity = SessionAffinityLayer::new().layer(fleet);
    let svc = RetryLayer::new(tower_affinity::RetryOnce::new()).layer(affinity.clone());
    // Sessions until one was placed on `dead` first (rendezvous spreads them).
    for s in 0..64 {
        let req = Request::post("/v1/chat/completions")
            .header("x-session-id", format!("s-{s}"))
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let res: Result<Response<_>, Error> =
            tokio::time::timeout(DEADLINE, svc.clone().oneshot(req))
                .await
                .unwrap();
        let res = res.unwrap_or_else(|e| panic!("session s-{s}: {e}"));
        assert_eq!(res.headers()["x-stub"], "live");
        if affinity.stats().backend_errors == 1 {
            break;
        }
    }
    assert_eq!(
        affinity.stats().backend_errors,
        1,
        "no session went to dead"
    );
    let dead = affinity
        .backends()
        .into_iter()
        .find(|b| b.id.as_str() == "dead")
        .unwrap();
    assert!(!dead.healthy, "the cooldown passes dead over");
    assert_eq!(dead.failures, 1);
    assert!(!seen.lock().is_empty());
}

#[tokio::test]
async fn a_refusal_through_the_balancer_is_a_502_of_kind_refused() {
    let refusing = Refusing::new();
    let backend = HttpBackend::new(&url(refusing.addr)).unwrap();
    let svc =
        SessionAffinityLayer::new().layer(StaticFleet::new([("dead", Backend::new("n", backend))]));
    let e: Error = tokio::time::timeout(
        DEADLINE,
        svc.oneshot(Request::get("/").body(Body::default()).unwrap()),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert_eq!(e.status(), 502);
    assert_eq!(
        HttpBackendError::of(&e).map(|e| e.kind()),
        Some(FailureKind::Refused)
    );
    let res = e.into_response::<Infallible>();
    assert_eq!(res.status(), 502);
}

/// A request body capped by the proxy (`Limited`), as a proxy that streams bodies caps them.
type Capped = http_body_util::Limited<Body>;

#[tokio::test]
async fn a_request_body_that_fails_on_its_way_is_400_and_no_fault_of_the_backend() {
    let (addr, seen) = stub("a").await;
    let oversize = || {
        let body = Full::new(Bytes::from(vec![b'x'; 64 * 1024]));
        Request::post("/v1/chat/completions")
            .body(http_body_util::Limited::new(body, 1024))
            .unwrap()
    };
    for http2 in [false, true] {
        let backend = HttpBackend::<Capped>::builder()
            .http2_prior_knowledge(http2)
            .build(&url(addr))
            .unwrap();
        let e = tokio::time::timeout(DEADLINE, backend.clone().oneshot(oversize()))
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(e.kind(), FailureKind::RequestBody, "http2 {http2}: {e:?}");
        assert_eq!(e.status(), 400);

        // Through the balancer: 400, and the backend neither counted as failed nor passed
        // over; the next request goes to it.
        let svc = SessionAffinityLayer::new()
            .layer(StaticFleet::new([("a", Backend::new("n", backend))]));
        let e: Error = tokio::time::timeout(DEADLINE, svc.clone().oneshot(oversize()))
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(e.status(), 400, "http2 {http2}: {e}");
        assert_eq!(
            HttpBackendError::of(&e).map(|e| e.kind()),
            Some(FailureKind::RequestBody)
        );
        // Said as the request's fault, not the backend's.
        assert_eq!(
            e.to_string(),
            "the request's own body failed on its way to backend a"
        );
        let text = e
            .into_response::<Full<Bytes>>()
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&text).unwrap();
        assert_eq!(body["error"]["code"], 400, "http2 {http2}");
        let text = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            text.starts_with("the request's own body failed on its way to backend a: ")
                && !text.contains("backend a failed"),
            "http2 {http2}: {text}"
        );
        let a = &svc.backends()[0];
        assert!(
            a.healthy,
            "http2 {http2}: a client's body marked the backend down"
        );
        assert_eq!(a.failures, 0);
        assert_eq!(svc.stats().backend_errors, 0);
        assert_eq!(svc.stats().in_flight, 0);
        // Nor retried: the same body would fail again.
        let placed = svc.stats().placed();
        let retrying = RetryLayer::new(tower_affinity::RetryOnce::new()).layer(svc.clone());
        let e: Error = tokio::time::timeout(DEADLINE, retrying.oneshot(oversize()))
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(e.status(), 400, "http2 {http2}: {e}");
        assert_eq!(svc.stats().placed(), placed + 1, "http2 {http2}: retried");
        let small = Request::post("/")
            .body(http_body_util::Limited::new(
                Full::new(Bytes::from_static(b"{}")),
                1024,
            ))
            .unwrap();
        let res = tokio::time::timeout(DEADLINE, svc.clone().oneshot(small))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(res.status(), 200);
    }
    assert!(seen.lock().iter().all(|s| s.body.as_ref() == b"{}"));
}

#[tokio::test]
async fn cookies_an_http2_client_split_reach_an_http1_backend_as_one_field() {
    let (addr, seen) = stub("a").await;
    let cookies = || {
        Request::get("/v1/models")
            .version(Version::HTTP_2)
            .header("cookie", "a=1")
            .header("cookie", "b=2")
            .header("cookie", "c=3")
            .body(Body::default())
            .unwrap()
    };
    let backend = HttpBackend::new(&url(addr)).unwrap();
    call(&backend, cookies()).await.unwrap();
    let s = seen.lock()[0].clone();
    let got: Vec<_> = s.headers.get_all("cookie").iter().collect();
    assert_eq!(got, ["a=1; b=2; c=3"]);

    // An HTTP/2 backend takes them as they came.
    let backend = HttpBackend::<Body>::builder()
        .http2_prior_knowledge(true)
        .build(&url(addr))
        .unwrap();
    call(&backend, cookies()).await.unwrap();
    let s = seen.lock()[1].clone();
    let got: Vec<_> = s.headers.get_all("cookie").iter().collect();
    assert_eq!(got.len(), 3, "{got:?}");
}

/// A raw backend that answers every request with `answer`, as written, and closes.
async fn answering_raw(answer: &'static [u8]) -> SocketAddr {
    raw(move |mut stream| async move {
        let _ = stream.write_all(answer).await;
        let _ = stream.shutdown().await;
    })
    .await
}

async fn sent_through(addr: SocketAddr) -> Result<Response<BackendBody>, HttpBackendError> {
    let backend = HttpBackend::<Body>::new(&url(addr)).unwrap();
    let req = Request::get("/").body(Body::default()).unwrap();
    tokio::time::timeout(DEADLINE, backend.oneshot(req))
        .await
        .unwrap()
}

/// An answer framed by both `Transfer-Encoding` and `Content-Length` is framed by the first
/// (RFC 9112, section 6.3), and goes on without the second: a client given the backend's
/// length would read a body cut short, or wait for bytes that never come.
#[tokio::test]
async fn an_answer_framed_by_transfer_encoding_goes_on_without_its_content_length() {
    let addr = answering_raw(
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n\
          14\r\n01234567890123456789\r\n0\r\n\r\n",
    )
    .await;
    let res = sent_through(addr).await.unwrap();
    assert_eq!(res.status(), 200);
    assert!(res.headers().get(http::header::CONTENT_LENGTH).is_none());
    assert!(res.headers().get(http::header::TRANSFER_ENCODING).is_none());
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.as_ref(), b"01234567890123456789");
}

/// What the proxy cannot hand a client is the backend's failure, 502: a switch of protocols
/// it did not ask for (it forwards no `Upgrade`), and a body in a transfer coding other than
/// chunked, which would reach the client coded and unmarked once that hop-by-hop field goes.
#[tokio::test]
async fn an_unasked_upgrade_or_an_answer_in_another_transfer_coding_is_a_failed_backend() {
    for answer in [
        &b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"[..],
        &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nConnection: close\r\n\r\nnot gzip"[..],
    ] {
        let addr = answering_raw(answer).await;
        let e = sent_through(addr).await.unwrap_err();
        assert_eq!(
            (e.kind(), e.status()),
            (FailureKind::Other, StatusCode::BAD_GATEWAY),
            "{e}"
        );
    }
    // The same checks for an answer on a connection of the caller's own.
    let backend = HttpBackend::<Body>::new("http://127.0.0.1:1").unwrap();
    let mut switched = Response::new(());
    *switched.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let mut gzipped = Response::new(());
    gzipped
        .headers_mut()
        .insert(http::header::TRANSFER_ENCODING, "gzip".parse().unwrap());
    for mut res in [switched, gzipped] {
        let e = backend.finish_response(&mut res).unwrap_err();
        assert_eq!(e.kind(), FailureKind::Other, "{e}");
    }
    let mut chunked = Response::new(());
    for (name, value) in [("transfer-encoding", "chunked"), ("content-length", "5")] {
        chunked.headers_mut().insert(name, value.parse().unwrap());
    }
    backend.finish_response(&mut chunked).unwrap();
    assert!(chunked.headers().is_empty());
}

/// A status out of HTTP's range, 600 to 999 (RFC 9110, section 15: invalid, to be taken as a
/// server error), is a malformed answer: not passed to the client, which may take it for
/// anything or choke on it, but the backend's failure, 502, passed over for the cooldown and
/// retried elsewhere, as a 101 it was not asked for is. 599 is a status, and goes on.
#[tokio::test]
async fn a_status_past_599_is_a_malformed_answer_and_the_backends_failure() {
    for answer in [
        &b"HTTP/1.1 600 Odd\r\nContent-Length: 2\r\n\r\nok"[..],
        &b"HTTP/1.1 999 Odd\r\nContent-Length: 2\r\n\r\nok"[..],
    ] {
        let addr = answering_raw(answer).await;
        let e = sent_through(addr).await.unwrap_err();
        assert_eq!(
            (e.kind(), e.status()),
            (FailureKind::Other, StatusCode::BAD_GATEWAY),
            "{e}"
        );
        assert!(e.to_string().contains("out of range"), "{e}");
    }
    let addr = answering_raw(b"HTTP/1.1 599 Odd\r\nContent-Length: 2\r\n\r\nok").await;
    assert_eq!(sent_through(addr).await.unwrap().status(), 599);

    // Through the balancer and its retry: the backend is counted as failed and passed over,
    // and with no other to retry on, its failure is the answer.
    let odd = answering_raw(b"HTTP/1.1 700 Odd\r\nContent-Length: 2\r\n\r\nok").await;
    let affinity = SessionAffinityLayer::new().layer(StaticFleet::new([(
        "odd",
        Backend::new("n", HttpBackend::<Body>::new(&url(odd)).unwrap()),
    )]));
    let svc = RetryLayer::new(tower_affinity::RetryOnce::new()).layer(affinity.clone());
    let req = Request::get("/").body(Body::default()).unwrap();
    let e: Error = tokio::time::timeout(DEADLINE, svc.oneshot(req))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(e.status(), StatusCode::BAD_GATEWAY, "{e}");
    let odd = &affinity.backends()[0];
    assert_eq!((odd.failures, odd.healthy), (1, false));
    assert_eq!(affinity.stats().in_flight, 0);
    // The same check for an answer on a connection of the caller's own.
    let backend = HttpBackend::<Body>::new("http://127.0.0.1:1").unwrap();
    let mut res = Response::new(());
    *res.status_mut() = StatusCode::from_u16(600).unwrap();
    let e = backend.finish_response(&mut res).unwrap_err();
    assert_eq!(e.kind(), FailureKind::Other, "{e}");
}

/// A `CONNECT`, and a body in a transfer coding other than chunked, are not forwarded: 501,
/// sent nowhere, and no fault of the backend's, which stays up and is not retried.
#[tokio::test]
async fn a_connect_or_a_body_in_another_transfer_coding_is_501_and_sent_nowhere() {
    let (addr, seen) = stub("a").await;
    let svc = SessionAffinityLayer::new().layer(StaticFleet::new([(
        "a",
        Backend::new("n", HttpBackend::<Body>::new(&url(addr)).unwrap()),
    )]));
    let retrying = RetryLayer::new(tower_affinity::RetryOnce::new()).layer(svc.clone());
    let connect = Request::connect("evil.example:443")
        .body(Body::default())
        .unwrap();
    let gzipped = Request::post("/v1/chat/completions")
        .header(http::header::TRANSFER_ENCODING, "gzip, chunked")
        .body(Body::new(Bytes::from_static(b"\x1f\x8b")))
        .unwrap();
    for req in [connect, gzipped] {
        let e: Error = tokio::time::timeout(DEADLINE, retrying.clone().oneshot(req))
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(e.status(), StatusCode::NOT_IMPLEMENTED, "{e}");
        assert_eq!(
            HttpBackendError::of(&e).map(|e| e.kind()),
            Some(FailureKind::Unsupported)
        );
        assert_eq!(
            e.to_string(),
            "the request cannot be forwarded to backend a"
        );
    }
    assert!(seen.lock().is_empty());
    let a = &svc.backends()[0];
    assert!(a.healthy && a.failures == 0);
    assert_eq!(svc.stats().placed(), 2, "neither retried");
}

/// The only backend fails: the retry finds no other backend up (the failure's cooldown passes
/// that one over), and the client is told of the failure, its status and its cause, not that
/// there were no backends: 502 for a refused connection, 504 past the response timeout.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_only_backend_failing_is_its_failure_after_the_retry_not_no_backends() {
    let silent = raw(|stream| async move {
        std::future::pending::<()>().await;
        drop(stream);
    })
    .await;
    let timing_out = HttpBackend::<Body>::builder()
        .connect_timeout(None)
        .response_timeout(Duration::from_secs(30))
        .build(&url(silent))
        .unwrap();
    let refused = Refusing::new();
    let refusing = HttpBackend::<Body>::builder()
        .connect_timeout(None)
        .build(&url(refused.addr))
        .unwrap();
    for (backend, kind, status) in [
        (refusing, FailureKind::Refused, StatusCode::BAD_GATEWAY),
        (
            timing_out,
            FailureKind::Timeout,
            StatusCode::GATEWAY_TIMEOUT,
        ),
    ] {
        let affinity = SessionAffinityLayer::new()
            .layer(StaticFleet::new([("only", Backend::new("n", backend))]));
        let svc = RetryLayer::new(tower_affinity::RetryOnce::new()).layer(affinity.clone());
        let e: Error = svc
            .oneshot(Request::get("/").body(Body::default()).unwrap())
            .await
            .unwrap_err();
        assert_eq!(e.status(), status, "{kind}: {e}");
        assert_eq!(
            HttpBackendError::of(&e).map(|e| e.kind()),
            Some(kind),
            "{e}"
        );
        assert_eq!(affinity.stats().in_flight, 0);
    }
}

/// A layer in front that rewrote the body but left the client's `Content-Length` must not
/// have the body cut short at the backend (HTTP/1.1 frames it by that field), nor fail the
/// request as the backend's fault (a longer one, or HTTP/2's check of the stream's length),
/// which would pass over a sound backend: the body's own length goes with it.
#[tokio::test]
async fn a_content_length_the_body_contradicts_is_sent_as_the_bodys_length() {
    let (addr, seen) = stub("a").await;
    for http2 in [false, true] {
        let backend = HttpBackend::<Body>::builder()
            .http2_prior_knowledge(http2)
            .build(&url(addr))
            .unwrap();
        for (declared, body) in [
            (&["1"][..], "abc"),
            (&["10"][..], "ab"),
            (&["3", "3"][..], "abc"),
            (&["+3"][..], "abc"),
            (&["3"][..], "abc"),
        ] {
            seen.lock().clear();
            let mut req = Request::post("/v1/chat/completions")
                .body(Full::new(Bytes::from_static(body.as_bytes())))
                .unwrap();
            for v in declared {
                req.headers_mut()
                    .append(http::header::CONTENT_LENGTH, v.parse().unwrap());
            }
            let res = call(&backend, req)
                .await
                .unwrap_or_else(|e| panic!("http2 {http2}, {declared:?}: {e}"));
            assert_eq!(res.status(), 200);
            let s = seen.lock()[0].clone();
            assert_eq!(s.body, body, "http2 {http2}, {declared:?}");
            let lengths: Vec<_> = s
                .headers
                .get_all("content-length")
                .iter()
                .map(|v| v.to_str().unwrap().to_string())
                .collect();
            assert_eq!(
                lengths,
                [body.len().to_string()],
                "http2 {http2}, {declared:?}"
            );
        }
    }
}

/// A backend host that vanishes (powered off, its network cut) sends no FIN and no RST: only
/// TCP keepalive finds it gone. On by default, after 30 s of silence and then every 10 s,
/// three probes unanswered: a minute. Set on the connector the pooled client connects with.
/// Keepalive probes only a connection with nothing in flight: on Linux, bytes the host
/// never acknowledges (an HTTP/2 window update sent as it vanished) are given as long
/// (`TCP_USER_TIMEOUT`), not the quarter of an hour of the retransmissions.
#[tokio::test]
async fn connections_have_tcp_keepalive_so_a_vanished_host_fails_its_requests() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let keepalive = |builder: tower_affinity::client::Builder<Body>| async move {
        let backend = builder.build(&url(addr)).unwrap();
        let io = backend
            .connector()
            .clone()
            .oneshot(backend.base_uri().clone())
            .await
            .unwrap();
        let socket = socket2::SockRef::from(io.inner());
        #[cfg(target_os = "linux")]
        {
            let unacknowledged = socket.tcp_user_timeout().unwrap();
            let probed = socket.keepalive().unwrap().then(|| {
                let time = socket.tcp_keepalive_time().unwrap();
                time + socket.tcp_keepalive_interval().unwrap() * 3
            });
            assert_eq!(unacknowledged, probed);
        }
        socket.keepalive().unwrap().then(|| {
            (
                socket.tcp_keepalive_time().unwrap(),
                socket.tcp_keepalive_interval().unwrap(),
                socket.tcp_keepalive_retries().unwrap(),
            )
        })
    };
    let secs = Duration::from_secs;
    assert_eq!(
        keepalive(HttpBackend::builder()).await,
        Some((secs(30), secs(10), 3))
    );
    assert_eq!(
        keepalive(HttpBackend::builder().tcp_keepalive(secs(90))).await,
        Some((secs(90), secs(30), 3))
    );
    // Below the system's unit of a second, the least it takes.
    assert_eq!(
        keepalive(HttpBackend::builder().tcp_keepalive(Duration::from_millis(10))).await,
        Some((secs(1), secs(1), 3))
    );
    // Above Linux's limit, which the system refuses, keeping its own two hours: the most it
    // takes.
    assert_eq!(
        keepalive(HttpBackend::builder().tcp_keepalive(secs(86_400))).await,
        Some((secs(32_767), secs(10_922), 3))
    );
    assert_eq!(
        keepalive(HttpBackend::builder().tcp_keepalive(None)).await,
        None
    );
    drop(listener);
}

/// A backend that stops sending midway through its answer, its connection open (stuck, or
/// its host gone): past the idle timeout between frames the body fails and says why, its
/// connection is closed at once, the slot is free and the answer counted as cut. The wait for
/// the first frame, a long prompt's reading after early headers, is not counted.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_body_silent_past_the_idle_timeout_between_frames_fails_and_lets_its_connection_go() {
    let closed = Arc::new(tokio::sync::Notify::new());
    let seen_close = closed.clone();
    let addr = raw(move |mut stream| {
        let closed = seen_close.clone();
        async move {
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                        transfer-encoding: chunked\r\n\r\n";
            stream.write_all(head.as_bytes()).await.unwrap();
            // Reading the prompt, for longer than the idle timeout.
            tokio::time::sleep(Duration::from_secs(300)).await;
            stream.write_all(b"5\r\nfirst\r\n").await.unwrap();
            // Then nothing, the connection open, until the proxy closes it.
            let mut buf = [0u8; 64];
            while let Ok(n) = stream.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
            closed.notify_one();
        }
    })
    .await;
    let backend = HttpBackend::<Body>::builder()
        .connect_timeout(None)
        .body_idle_timeout(Duration::from_secs(60))
        .build(&url(addr))
        .unwrap();
    assert_eq!(backend.body_idle_timeout(), Some(Duration::from_secs(60)));
    let svc =
        SessionAffinityLayer::new().layer(StaticFleet::new([("a", Backend::new("n", backend))]));
    let res = svc
        .clone()
        .oneshot(
            Request::post("/v1/chat/completions")
                .body(Body::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let mut body = res.into_body();
    let bound = Duration::from_secs(3600);
    let started = tokio::time::Instant::now();
    let first = tokio::time::timeout(bound, body.frame()).await.unwrap();
    let first = first.unwrap().unwrap().into_data().unwrap();
    assert_eq!(first, "first");
    assert_eq!(started.elapsed(), Duration::from_secs(300));

    let started = tokio::time::Instant::now();
    let next = tokio::time::timeout(bound, body.frame())
        .await
        .expect("a silent body never ended");
    let e = next.unwrap().unwrap_err();
    assert_eq!(started.elapsed(), Duration::from_secs(60));
    assert!(
        e.to_string()
            .contains("no frame of the body within 60s of the last"),
        "{e}"
    );
    let e = HttpBackendError::of(&Error::backend("a", e)).map(|e| e.kind());
    assert_eq!(e, Some(FailureKind::Timeout));
    // Its connection is let go while the body is still held.
    tokio::time::timeout(Duration::from_secs(1), closed.notified())
        .await
        .expect("the silent connection was kept open");
    assert_eq!(svc.stats().in_flight, 0);
    let a = &svc.backends()[0];
    assert_eq!(a.cut_answers, 1);
    assert!(body.frame().await.is_none());
}

/// The only backend answers 503 (llama-server loading its model) with its `Retry-After`: the
/// 503 passes it over for the failure cooldown, so the retry finds no backend up. The client
/// is told the backend's 503 and when to come back, as the backend said, not only that no
/// backend was available.
#[tokio::test]
async fn the_only_backends_503_keeps_its_retry_after_when_the_retry_finds_no_other() {
    for (answer, hint) in [
        (
            &b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 30\r\nContent-Length: 13\r\n\r\nLoading model"[..],
            Some("30"),
        ),
        (
            &b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: Wed, 21 Oct 2037 07:28:00 GMT\r\nContent-Length: 0\r\n\r\n"[..],
            Some("Wed, 21 Oct 2037 07:28:00 GMT"),
        ),
        (
            &b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"[..],
            None,
        ),
    ] {
        let addr = answering_raw(answer).await;
        let fleet = || {
            SessionAffinityLayer::new().layer(StaticFleet::new([(
                "loading",
                Backend::new("n", HttpBackend::<Body>::new(&url(addr)).unwrap()),
            )]))
        };
        let affinity = fleet();
        let req = || Request::get("/").body(Body::default()).unwrap();
        let svc = RetryLayer::new(tower_affinity::RetryOnce::new()).layer(affinity.clone());
        let e: Error = tokio::time::timeout(DEADLINE, svc.oneshot(req()))
            .await
            .unwrap()
            .unwrap_err();
        assert!(matches!(e, Error::Backend { .. }), "{hint:?}: {e:?}");
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        let seconds = hint.and_then(|h| h.parse().ok()).map(Duration::from_secs);
        assert_eq!(e.retry_after(), seconds);
        assert!(e.to_string().contains("loading"), "{e}");
        let res = e.into_response::<Body>();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        let given = res.headers().get(http::header::RETRY_AFTER);
        assert_eq!(given.map(|v| v.to_str().unwrap()), hint);
        assert_eq!(affinity.stats().in_flight, 0);

        // Behind a layer that boxes errors, the same.
        let boxed = tower::util::MapErrLayer::new(tower_affinity::BoxError::from).layer(fleet());
        let svc = RetryLayer::new(tower_affinity::RetryOnce::new()).layer(boxed);
        let e = tokio::time::timeout(DEADLINE, svc.oneshot(req()))
            .await
            .unwrap()
            .unwrap_err();
        let res = Error::response_for::<Body>(&*e);
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE, "{e}");
        let given = res.headers().get(http::header::RETRY_AFTER);
        assert_eq!(given.map(|v| v.to_str().unwrap()), hint);
    }
}

/// A killed stub answers nothing more, not even on a connection a client pooled before the
/// kill: `kill` returns once the stub's serving task and every connection it accepted have
/// ended, on a runtime with several workers too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_stub_answers_no_request_on_a_pooled_connection() {
    for round in 0..1_000 {
        let stub = llama_stub::Stub::start("a", 1).await;
        let backend = HttpBackend::<Body>::new(&stub.url()).unwrap();
        let req = || Request::get("/health").body(Body::default()).unwrap();
        let res = tokio::time::timeout(DEADLINE, backend.clone().oneshot(req()))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(res.status(), 200);
        // Read to its end, the answer puts its connection back in the pool.
        res.into_body().collect().await.unwrap();
        stub.kill().await;
        let next = tokio::time::timeout(DEADLINE, backend.oneshot(req()))
            .await
            .unwrap();
        assert!(
            next.is_err(),
            "round {round}: a killed stub answered {:?}",
            next.map(|r| r.status())
        );
        assert_eq!(stub.connections(), 1, "round {round}");
    }
}

/// How [`refusing_h2`] turns down the first request of its first connection.
#[derive(Clone, Copy, Debug)]
enum Refusal {
    /// `GOAWAY` whose last stream is 0: no stream was processed, and the connection closes.
    GoAway,
    /// `RST_STREAM` with `REFUSED_STREAM`: the stream was not processed.
    RefusedStream,
    /// `RST_STREAM` with `NO_ERROR`: not a refusal, and nothing says what was processed.
    ResetNoError,
}

/// An HTTP/2 server written frame by frame: its first connection turns down its first
/// request as `refusal` says; every other request it answers `200` with no body. Counts its
/// connections.
async fn refusing_h2(refusal: Refusal) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
            tokio::spawn(async move {
                let frame = |ty: u8, flags: u8, stream: u32, payload: &[u8]| {
                    let len = (payload.len() as u32).to_be_bytes();
                    let mut f = vec![len[1], len[2], len[3], ty, flags];
                    f.extend_from_slice(&stream.to_be_bytes());
                    f.extend_from_slice(payload);
                    f
                };
                let mut preface = [0u8; 24];
                if s.read_exact(&mut preface).await.is_err() {
                    return;
                }
                let _ = s.write_all(&frame(4, 0, 0, &[])).await;
                let mut refuse = first;
                loop {
                    let mut head = [0u8; 9];
                    if s.read_exact(&mut head).await.is_err() {
                        return;
                    }
                    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                    let mut payload = vec![0u8; len];
                    if s.read_exact(&mut payload).await.is_err() {
                        return;
                    }
                    let (ty, flags) = (head[3], head[4]);
                    let stream = u32::from_be_bytes(head[5..9].try_into().unwrap()) & !(1 << 31);
                    let out = match ty {
                        // SETTINGS, acknowledged.
                        4 if flags & 1 == 0 => frame(4, 1, 0, &[]),
                        // HEADERS of a request.
                        1 if refuse => {
                            refuse = false;
                            match refusal {
                                Refusal::GoAway => frame(7, 0, 0, &[0; 8]),
                                Refusal::RefusedStream => frame(3, 0, stream, &7u32.to_be_bytes()),
                                Refusal::ResetNoError => frame(3, 0, stream, &0u32.to_be_bytes()),
                            }
                        }
                        // `:status: 200` (static table entry 8), the stream's end.
                        1 => frame(1, 0x4 | 0x1, stream, &[0x88]),
                        _ => continue,
                    };
                    if s.write_all(&out).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, connections)
}

/// An HTTP/2 backend that turns a request down unprocessed (`GOAWAY` below its stream, or
/// `REFUSED_STREAM`) closed the request's connection, or its stream, before any answer: a
/// reset, as over HTTP/1.1, which `resend_on_close` sends once more on another connection.
/// A stream reset with `NO_ERROR` says no such thing and stays a failure of another kind.
#[tokio::test]
async fn a_request_an_http2_backend_refused_unprocessed_is_a_reset_and_sent_again() {
    use std::sync::atomic::Ordering;
    let post = || {
        Request::post("/v1/chat/completions")
            .body(Body::from("{}"))
            .unwrap()
    };
    for refusal in [Refusal::GoAway, Refusal::RefusedStream] {
        let (addr, _) = refusing_h2(refusal).await;
        let backend = HttpBackend::<Body>::builder()
            .http2_prior_knowledge(true)
            .build(&url(addr))
            .unwrap();
        let e = call(&backend, post()).await.unwrap_err();
        assert_eq!(e.kind(), FailureKind::Reset, "{refusal:?}: {e}");

        let (addr, connections) = refusing_h2(refusal).await;
        let backend = HttpBackend::<Body>::builder()
            .http2_prior_knowledge(true)
            .resend_on_close(true)
            .build(&url(addr))
            .unwrap();
        let res = call(&backend, post()).await.unwrap();
        assert_eq!(res.status(), 200, "{refusal:?}");
        assert!(res
            .extensions()
            .get::<tower_affinity::SentAgain>()
            .is_some());
        assert_eq!(connections.load(Ordering::SeqCst), 2, "{refusal:?}");
    }
    // Beside them, a stream reset without a refusal is no closed connection.
    let (addr, _) = refusing_h2(Refusal::ResetNoError).await;
    let backend = HttpBackend::<Body>::builder()
        .http2_prior_knowledge(true)
        .resend_on_close(true)
        .build(&url(addr))
        .unwrap();
    let e = call(&backend, post()).await.unwrap_err();
    assert_eq!(e.kind(), FailureKind::Other, "{e}");
}

/// `prepare` for a connection of the caller's own: origin-form for HTTP/1.1, but over HTTP/2
/// the scheme and authority stay, as the request's pseudo-header fields, without which an
/// HTTP/2 connection refuses it.
#[tokio::test]
async fn a_request_prepared_for_an_http2_connection_of_ones_own_is_sent_on_it() {
    let (addr, seen) = stub("own").await;
    let backend = HttpBackend::<Body>::builder()
        .http2_prior_knowledge(true)
        .build(&url(addr))
        .unwrap();
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = Request::post("/v1/chat/completions?x=%20y")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let req = backend.prepare(req, false).unwrap();
    let res = tokio::time::timeout(DEADLINE, sender.send_request(req))
        .await
        .expect("no answer in time")
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let seen = seen.lock()[0].clone();
    assert_eq!(seen.version, Version::HTTP_2);
    assert_eq!(
        seen.uri.path_and_query().unwrap(),
        "/v1/chat/completions?x=%20y"
    );
    assert_eq!(seen.uri.authority().unwrap().as_str(), addr.to_string());

    // Over HTTP/1.1 the target stays in origin-form, as a request line carries it.
    let http1 = HttpBackend::<Body>::new(&url(addr)).unwrap();
    let req = Request::post("http://proxy/v1/completions").body(Body::default());
    let req = http1.prepare(req.unwrap(), false).unwrap();
    assert_eq!(req.uri(), "/v1/completions");
}
