//! An axum reverse proxy with session affinity, in front of four tiny HTTP backends on
//! loopback (two nodes of two backends each). It sends a few sessions' turns through the proxy,
//! prints where each landed, and exits.
//!
//! ```sh
//! cargo run --example axum
//! ```

use std::net::SocketAddr;
use std::num::NonZeroU32;

use axum::body::Body;
use axum::extract::Request;
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tower::{Layer, Service, ServiceExt};
use tower_affinity::discover::StaticFleet;
use tower_affinity::{Backend, ErrorToResponse, SessionAffinityLayer};

type HttpClient = Client<HttpConnector, Body>;

/// Starts a backend that names itself in every answer.
async fn start_backend(name: &'static str) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new().fallback(move || async move { format!("answered by {name}") });
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// The client, pointed at one backend: the request keeps its method, path, query, headers and
/// body; only the scheme and authority change.
fn forward_to(
    client: HttpClient,
    addr: SocketAddr,
) -> impl Service<
    Request,
    Response = http::Response<hyper::body::Incoming>,
    Error = hyper_util::client::legacy::Error,
    Future: Send,
> + Clone
       + Send
       + Sync {
    client.map_request(move |mut req: Request| {
        let path = req
            .uri()
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_string();
        *req.uri_mut() = format!("http://{addr}{path}")
            .parse()
            .unwrap_or_else(|_| http::Uri::from_static("/"));
        req
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let two = NonZeroU32::new(2).ok_or("slots")?;
    let mut backends = Vec::new();
    for (name, node) in [
        ("a1", "node-a"),
        ("a2", "node-a"),
        ("b1", "node-b"),
        ("b2", "node-b"),
    ] {
        let addr = start_backend(name).await?;
        let service = forward_to(client.clone(), addr);
        backends.push((name, Backend::new(node, service).slots(two)));
    }

    let affinity = SessionAffinityLayer::new()
        .decision_headers(true)
        .layer(StaticFleet::new(backends));
    let app = axum::Router::new().fallback_service(ErrorToResponse::new(affinity.clone()));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let proxy = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    println!("proxy on http://{proxy}, four backends on two nodes\n");

    println!(
        "{:<10} {:>4}  {:<8} {:<7} {:<16} answer",
        "session", "turn", "backend", "node", "outcome"
    );
    for turn in 1..=3 {
        for session in ["agent-1", "agent-2", "agent-3", ""] {
            let req = http::Request::post(format!("http://{proxy}/v1/chat/completions"))
                .header("x-session-id", session)
                .body(Body::from(r#"{"messages":[]}"#))?;
            let res = client.request(req).await?;
            let header = |name: &str| {
                res.headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-")
                    .to_string()
            };
            let (backend, node, outcome) = (
                header("x-affinity-backend"),
                header("x-affinity-node"),
                header("x-affinity-outcome"),
            );
            let answer = res.into_body().collect().await?.to_bytes();
            let session = if session.is_empty() {
                "(none)"
            } else {
                session
            };
            println!(
                "{session:<10} {turn:>4}  {backend:<8} {node:<7} {outcome:<16} {}",
                String::from_utf8_lossy(&answer)
            );
        }
    }

    let stats = affinity.stats();
    println!(
        "\nhome hits {}, new sessions {}, keyless {}, spills {}, in flight now {}",
        stats.home_hits,
        stats.new_sessions,
        stats.keyless,
        stats.same_node_spills + stats.cross_node_spills,
        stats.in_flight
    );
    Ok(())
}
