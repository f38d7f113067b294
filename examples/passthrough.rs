//! A reverse proxy that does nothing but forward: no key, no placement, no retry, no metrics.
//! It is the floor against which `scripts/bench-proxy.sh` measures the proxy example: what the
//! same HTTP parts (hyper's HTTP/1 server through hyper-util, and an HTTP/1 client) cost on
//! their own on the same machine.
//!
//! ```text
//! cargo run --release --example passthrough -- 127.0.0.1:8080 127.0.0.1:8081          # pooled
//! cargo run --release --example passthrough -- 127.0.0.1:8080 127.0.0.1:8081 --per-connection
//! ```
//!
//! Two ways to reach the backend:
//!
//! - **pooled** (the default): one hyper-util `Client` shared by every connection, as the proxy
//!   example does. Each request checks a connection out of the pool and hands the request to
//!   that connection's own task.
//! - **`--per-connection`**: each client connection gets one backend connection of its own,
//!   driven in the same task as the client connection, so a request never leaves the task
//!   that read it. This is the least an HTTP/1 proxy built on hyper can do per request.
//!
//! Clients may speak HTTP/1.1 or HTTP/2; requests go to the backend in HTTP/1.1, bodies
//! streamed. Both ways rewrite the same and nothing more: the version; `Host`, which is always
//! the backend's address (`BACKEND_ADDR`), whatever `Host` or `:authority` the client sent; and
//! the URI, which gets the backend's scheme and authority for the pooled client and is only its
//! path and query on a connection of its own. `Host` is the backend's, as the proxy example
//! and the library's `HttpBackend` send it: the client's names this proxy, not the backend,
//! and a backend behind a front that routes by `Host` needs its own. `TOKIO_WORKER_THREADS`
//! sets the runtime's threads.

use std::convert::Infallible;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::sync::Arc;

use http::header::HOST;
use http::uri::{Authority, Scheme};
use http::{HeaderValue, Request, Response, StatusCode, Uri, Version};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1 as client_http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tower_affinity::BoxError;

/// What the proxy answers with: the backend's body, or a short error of its own.
type Body = http_body_util::combinators::BoxBody<bytes::Bytes, hyper::Error>;

const USAGE: &str = "usage: passthrough LISTEN_ADDR BACKEND_ADDR [--per-connection]
  each address an IP:PORT, such as 127.0.0.1:8080 (names such as localhost are not looked up)";

/// Reads the arguments after the program's name: the two addresses and whether
/// `--per-connection` is given. An argument that is not UTF-8 is an error that names it, where
/// `std::env::args` would panic on it.
fn parse<I: IntoIterator<Item = OsString>>(
    args: I,
) -> Result<(SocketAddr, SocketAddr, bool), String> {
    let mut text = Vec::new();
    for (n, arg) in args.into_iter().enumerate() {
        match arg.into_string() {
            Ok(arg) => text.push(arg),
            Err(arg) => {
                return Err(format!(
                    "passthrough: argument {} ({arg:?}) is not UTF-8: every argument is text",
                    n + 1
                ))
            }
        }
    }
    match text.as_slice() {
        [listen, backend, rest @ ..] if rest.iter().all(|a| a == "--per-connection") => {
            match (listen.parse(), backend.parse()) {
                (Ok(l), Ok(b)) => Ok((l, b, !rest.is_empty())),
                (Err(_), _) => Err(format!(
                    "passthrough: LISTEN_ADDR {listen:?} is not an IP:PORT"
                )),
                (_, Err(_)) => Err(format!(
                    "passthrough: BACKEND_ADDR {backend:?} is not an IP:PORT"
                )),
            }
        }
        _ => Err(String::new()),
    }
}

fn main() -> std::process::ExitCode {
    let (listen, backend, per_connection) = match parse(std::env::args_os().skip(1)) {
        Ok(parsed) => parsed,
        Err(why) => {
            if !why.is_empty() {
                eprintln!("{why}");
            }
            eprintln!("{USAGE}");
            return std::process::ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("passthrough: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(listen, backend, per_connection)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("passthrough: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(
    listen: SocketAddr,
    backend: SocketAddr,
    per_connection: bool,
) -> Result<(), BoxError> {
    let listener = TcpListener::bind(listen).await?;
    eprintln!(
        "passthrough: listening on {}, forwarding to {backend} ({})",
        listener.local_addr()?,
        if per_connection {
            "one backend connection per client connection"
        } else {
            "pooled"
        }
    );
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> =
        Client::builder(TokioExecutor::new()).build(connector);
    let backend = Backend::new(backend)?;
    serve(listener, client, backend, per_connection).await
}

/// Accepts client connections on `listener` and serves each in a task of its own, for good.
/// A failed accept does not end it (see [`accept_error`]).
async fn serve(
    listener: TcpListener,
    client: Client<HttpConnector, Incoming>,
    backend: Backend,
    per_connection: bool,
) -> Result<(), BoxError> {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                accept_error(e).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        if per_connection {
            tokio::spawn(serve_per_connection(stream, backend.clone()));
        } else {
            tokio::spawn(serve_pooled(stream, client.clone(), backend.clone()));
        }
    }
}

/// A failed accept: a connection that went away before it was accepted is nothing; anything
/// else (out of file descriptors under a load test's many connections, say) is reported and
/// accepting pauses for a second, so as not to spin while it lasts. Either way the server goes
/// on, as the proxy example's does: the connections it serves end, and free what they hold.
async fn accept_error(e: std::io::Error) {
    use std::io::{ErrorKind, Write};
    if matches!(
        e.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    ) {
        return;
    }
    let _ = writeln!(
        std::io::stderr(),
        "passthrough: accept failed: {e}; pausing for 1 s"
    );
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
}

/// The backend's address, as a connection, a URI and `Host` take it.
#[derive(Clone, Debug)]
struct Backend {
    addr: SocketAddr,
    authority: Authority,
    host: HeaderValue,
}

impl Backend {
    fn new(addr: SocketAddr) -> Result<Self, BoxError> {
        Ok(Backend {
            addr,
            authority: Authority::try_from(addr.to_string())?,
            host: HeaderValue::try_from(addr.to_string())?,
        })
    }
}

/// Every request through the shared pooled client.
async fn serve_pooled(
    stream: TcpStream,
    client: Client<HttpConnector, Incoming>,
    backend: Backend,
) {
    let service = service_fn(move |req: Request<Incoming>| {
        let mut req = as_http1(req, &backend.host);
        let mut parts = req.uri().clone().into_parts();
        parts.scheme = Some(Scheme::HTTP);
        parts.authority = Some(backend.authority.clone());
        let uri = Uri::from_parts(parts);
        let sent = uri.map(|uri| {
            *req.uri_mut() = uri;
            client.request(req)
        });
        async move {
            match sent {
                Ok(fut) => Ok::<_, Infallible>(match fut.await {
                    Ok(res) => res.map(BodyExt::boxed),
                    Err(e) => bad_gateway(&e),
                }),
                Err(e) => Ok(bad_gateway(&e)),
            }
        }
    });
    let builder = auto::Builder::new(TokioExecutor::new());
    let _ = builder
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

/// One backend connection for this client connection, driven by this task: the client's
/// requests come one at a time, and each goes out on it.
async fn serve_per_connection(stream: TcpStream, backend: Backend) {
    let upstream = match TcpStream::connect(backend.addr).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("passthrough: connecting to {}: {e}", backend.addr);
            return;
        }
    };
    let _ = upstream.set_nodelay(true);
    let (sender, upstream_conn) = match client_http1::handshake(TokioIo::new(upstream)).await {
        Ok(pair) => pair,
        Err(e) => {
            eprintln!("passthrough: handshake with {}: {e}", backend.addr);
            return;
        }
    };
    let sender = Arc::new(tokio::sync::Mutex::new(sender));
    let service = service_fn(move |req: Request<Incoming>| {
        let sender = sender.clone();
        let mut req = as_http1(req, &backend.host);
        // On a connection of its own, the URI is the path and query alone.
        if req.uri().authority().is_some() {
            let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
            if let Ok(uri) = Uri::try_from(path) {
                *req.uri_mut() = uri;
            }
        }
        async move {
            let mut sender = sender.lock().await;
            let sent = match sender.ready().await {
                Ok(()) => sender.send_request(req),
                Err(e) => return Ok::<_, Infallible>(bad_gateway(&e)),
            };
            drop(sender);
            Ok(match sent.await {
                Ok(res) => res.map(BodyExt::boxed),
                Err(e) => bad_gateway(&e),
            })
        }
    });
    let builder = auto::Builder::new(TokioExecutor::new());
    let server = builder.serve_connection(TokioIo::new(stream), service);
    // The backend connection lives as long as the client's; both are polled here.
    tokio::select! {
        _ = server => {}
        _ = upstream_conn => {}
    }
}

/// `req` as the backend gets it, either way: in HTTP/1.1, whatever the client spoke, with
/// `host` (the backend's address) as its `Host`, whatever the client's `Host` or `:authority`.
fn as_http1(mut req: Request<Incoming>, host: &HeaderValue) -> Request<Incoming> {
    *req.version_mut() = Version::HTTP_11;
    req.headers_mut().insert(HOST, host.clone());
    req
}

fn bad_gateway(e: &dyn std::fmt::Display) -> Response<Body> {
    let mut res = Response::new(
        Full::from(format!("bad gateway: {e}\n"))
            .map_err(|n| match n {})
            .boxed(),
    );
    *res.status_mut() = StatusCode::BAD_GATEWAY;
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend that answers each request with its `Host` and its URI.
    async fn start_backend() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let service = service_fn(|req: Request<Incoming>| async move {
                    let host = req
                        .headers()
                        .get(HOST)
                        .map(|h| h.to_str().unwrap().to_string());
                    let seen = format!("{} {}", host.unwrap_or_default(), req.uri());
                    Ok::<_, Infallible>(Response::new(Full::<bytes::Bytes>::from(seen)))
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        addr
    }

    /// Sends `GET /v1/models?x=1`, in HTTP/2 or in HTTP/1.1, through a pass-through of the
    /// kind given; the backend's address, the status, and what the backend saw.
    async fn through(per_connection: bool, http2: bool) -> (SocketAddr, StatusCode, String) {
        let backend = start_backend().await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let backend = Backend::new(backend).unwrap();
            if per_connection {
                serve_per_connection(stream, backend).await;
            } else {
                let pool = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
                serve_pooled(stream, pool, backend).await;
            }
        });
        let client = Client::builder(TokioExecutor::new())
            .http2_only(http2)
            .build_http::<Full<bytes::Bytes>>();
        let uri: Uri = format!("http://{addr}/v1/models?x=1").parse().unwrap();
        let res = client.get(uri).await.unwrap();
        let status = res.status();
        let body = res.into_body().collect().await.unwrap().to_bytes();
        (backend, status, String::from_utf8_lossy(&body).into_owned())
    }

    /// An argument that is not UTF-8 is refused with an error that names it, as any other bad
    /// argument is (exit status 2), not a panic.
    #[cfg(unix)]
    #[test]
    fn an_argument_that_is_not_utf8_is_refused_not_a_panic() {
        use std::os::unix::ffi::OsStringExt;
        let bad = OsString::from_vec(b"127.0.0.1:80\xff".to_vec());
        for args in [
            vec![bad.clone(), "127.0.0.1:8081".into()],
            vec!["127.0.0.1:8080".into(), "127.0.0.1:8081".into(), bad],
        ] {
            let position = args.len();
            let err = std::panic::catch_unwind(|| parse(args))
                .expect("no panic")
                .expect_err("an error");
            assert!(err.contains("not UTF-8"), "{err}");
            let shown = if position == 2 { 1 } else { 3 };
            assert!(err.contains(&format!("argument {shown} ")), "{err}");
        }
        let ok = parse(["127.0.0.1:8080".into(), "127.0.0.1:8081".into()]);
        assert_eq!(
            ok,
            Ok((
                ([127, 0, 0, 1], 8080).into(),
                ([127, 0, 0, 1], 8081).into(),
                false
            ))
        );
        let main = include_str!("passthrough.rs");
        assert!(main.contains(&["parse(std::env::", "args_os()"].concat()));
    }

    /// Out of file descriptors, the server pauses accepting and then serves again, rather than
    /// end. The test runs itself again under `ulimit -n`, and that run fills the limit with
    /// connections to the pass-through.
    #[cfg(unix)]
    #[test]
    fn running_out_of_file_descriptors_pauses_accepting_and_does_not_end_the_server() {
        const CHILD: &str = "PASSTHROUGH_TEST_FEW_FILE_DESCRIPTORS";
        const NAME: &str =
            "tests::running_out_of_file_descriptors_pauses_accepting_and_does_not_end_the_server";
        if std::env::var_os(CHILD).is_some() {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .start_paused(true)
                .build()
                .unwrap()
                .block_on(out_of_file_descriptors());
            return;
        }
        let status = std::process::Command::new("sh")
            .args(["-c", "ulimit -n 64 && exec \"$0\" \"$@\""])
            .arg(std::env::current_exe().unwrap())
            .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .stdin(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "the run under ulimit -n 64: {status}");
    }

    /// Connects to a pass-through until no file descriptor is left, lets it meet the limit in
    /// its accept, closes those connections, and sends a request through it.
    async fn out_of_file_descriptors() {
        let backend = start_backend().await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let pool = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let server = tokio::spawn(serve(listener, pool, Backend::new(backend).unwrap(), false));
        let mut held = Vec::new();
        loop {
            match TcpStream::connect(addr).await {
                Ok(stream) => held.push(stream),
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(24), "EMFILE: {e}");
                    break;
                }
            }
            assert!(held.len() < 1000, "no limit met");
        }
        // The server's accept, with the backlog full of connections and no descriptor free.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(
            !server.is_finished(),
            "the server ended: {:?}",
            server.await
        );
        drop(held);
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<bytes::Bytes>>();
        let uri: Uri = format!("http://{addr}/v1/models").parse().unwrap();
        let res = tokio::time::timeout(std::time::Duration::from_secs(30), client.get(uri))
            .await
            .expect("an answer")
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn an_http2_client_is_forwarded_to_an_http1_backend_through_the_pool() {
        let (_, status, body) = through(false, true).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body.ends_with(" /v1/models?x=1"), "{body}");
    }

    #[tokio::test]
    async fn an_http2_client_is_forwarded_to_an_http1_backend_on_its_own_connection() {
        let (_, status, body) = through(true, true).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body.ends_with(" /v1/models?x=1"), "{body}");
        assert!(!body.starts_with(' '), "a Host header: {body}");
    }

    /// Pooled or on its own connection, from an HTTP/2 client or an HTTP/1.1 one, a request
    /// reaches the backend with the backend's address as `Host`, not the client's
    /// `:authority` or `Host` (which name the pass-through).
    #[tokio::test]
    async fn both_ways_send_the_backend_s_address_as_host_whatever_the_client_spoke() {
        let (mut seen, mut want) = (Vec::new(), Vec::new());
        for per_connection in [false, true] {
            for http2 in [true, false] {
                let (backend, status, body) = through(per_connection, http2).await;
                assert_eq!(status, StatusCode::OK, "{body}");
                let way = format!("per connection: {per_connection}, HTTP/2: {http2}");
                // The backend's `Host` and the path, as the backend answers them.
                want.push(format!("{way}: {backend} /v1/models?x=1"));
                seen.push(format!("{way}: {body}"));
            }
        }
        assert_eq!(seen, want);
    }
}
