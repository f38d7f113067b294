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
//! streamed. Nothing is rewritten but what that takes: the URI's scheme and authority for the
//! pooled client, and for one backend connection per client connection an HTTP/2 request's
//! URI as its path and query, with its authority as `Host`. `TOKIO_WORKER_THREADS` sets the
//! runtime's threads.

use std::convert::Infallible;
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

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = match args.as_slice() {
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
    };
    let (listen, backend, per_connection) = match parsed {
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
    let authority = Authority::try_from(backend.to_string())?;
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        if per_connection {
            tokio::spawn(serve_per_connection(stream, backend));
        } else {
            tokio::spawn(serve_pooled(stream, client.clone(), authority.clone()));
        }
    }
}

/// Every request through the shared pooled client.
async fn serve_pooled(
    stream: TcpStream,
    client: Client<HttpConnector, Incoming>,
    authority: Authority,
) {
    let service = service_fn(move |mut req: Request<Incoming>| {
        // The backend is spoken to in HTTP/1.1, whatever the client spoke.
        *req.version_mut() = Version::HTTP_11;
        let mut parts = req.uri().clone().into_parts();
        parts.scheme = Some(Scheme::HTTP);
        parts.authority = Some(authority.clone());
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
async fn serve_per_connection(stream: TcpStream, backend: SocketAddr) {
    let upstream = match TcpStream::connect(backend).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("passthrough: connecting to {backend}: {e}");
            return;
        }
    };
    let _ = upstream.set_nodelay(true);
    let (sender, upstream_conn) = match client_http1::handshake(TokioIo::new(upstream)).await {
        Ok(pair) => pair,
        Err(e) => {
            eprintln!("passthrough: handshake with {backend}: {e}");
            return;
        }
    };
    let sender = Arc::new(tokio::sync::Mutex::new(sender));
    let service = service_fn(move |req: Request<Incoming>| {
        let sender = sender.clone();
        let req = as_http1(req);
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

/// `req` as an HTTP/1.1 request: an HTTP/2 client's absolute URI becomes its path and query,
/// and its authority the `Host` header, as an HTTP/1.1 server expects them.
fn as_http1(mut req: Request<Incoming>) -> Request<Incoming> {
    *req.version_mut() = Version::HTTP_11;
    if let Some(authority) = req.uri().authority().cloned() {
        if !req.headers().contains_key(HOST) {
            if let Ok(host) = HeaderValue::from_str(authority.as_str()) {
                req.headers_mut().insert(HOST, host);
            }
        }
        let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
        if let Ok(uri) = Uri::try_from(path) {
            *req.uri_mut() = uri;
        }
    }
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

    /// Sends `GET /v1/models?x=1` in HTTP/2 through a pass-through of the kind given.
    async fn through(per_connection: bool) -> (StatusCode, String) {
        let backend = start_backend().await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            if per_connection {
                serve_per_connection(stream, backend).await;
            } else {
                let pool = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
                let authority = Authority::try_from(backend.to_string()).unwrap();
                serve_pooled(stream, pool, authority).await;
            }
        });
        let client = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http::<Full<bytes::Bytes>>();
        let uri: Uri = format!("http://{addr}/v1/models?x=1").parse().unwrap();
        let res = client.get(uri).await.unwrap();
        let status = res.status();
        let body = res.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn an_http2_client_is_forwarded_to_an_http1_backend_through_the_pool() {
        let (status, body) = through(false).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body.ends_with(" /v1/models?x=1"), "{body}");
    }

    #[tokio::test]
    async fn an_http2_client_is_forwarded_to_an_http1_backend_on_its_own_connection() {
        let (status, body) = through(true).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body.ends_with(" /v1/models?x=1"), "{body}");
        assert!(!body.starts_with(' '), "a Host header: {body}");
    }
}
