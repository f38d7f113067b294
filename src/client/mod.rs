//! An HTTP backend: [`HttpBackend`], a backend's service over hyper-util's pooled client.
//!
//! A proxy built on this crate needs one service per backend that sends a request on as the
//! client sent it. [`HttpBackend`] does that for a backend at `http://host:port`:
//!
//! - the request keeps its method, path, query, headers and body; its URI gets the backend's
//!   scheme and authority, and `Host` the backend's; a body that knows its exact length goes
//!   with that length as its `Content-Length`, whatever a layer that rewrote it left there;
//! - hop-by-hop headers (RFC 9110, section 7.6.1: [`HOP_BY_HOP`] and those `Connection`
//!   names) are dropped both ways ([`strip_hop_by_hop`]); a client whose `TE` accepts
//!   trailers has the backend asked for them, and the response's trailers and its `Trailer`
//!   header pass;
//! - connections are pooled; HTTP/1.1 by default, HTTP/2 with prior knowledge on request;
//! - a connect timeout, a response-header timeout and an idle timeout between the frames of
//!   an answer's body ([`Builder`]); TCP keepalive on its connections, so that a backend host
//!   that vanishes (no FIN, no RST) fails its requests instead of holding them forever;
//! - with [`Builder::resend_on_close`] (off by default; for a request body that is `Clone`, as
//!   [`BodyKeyLayer`](crate::key::BodyKeyLayer)'s `Full<Bytes>` is), a request whose
//!   connection closes before any answer is sent once more, on a connection opened for it:
//!   turn it on in front of llama-server, which closes its connection after each streamed
//!   answer, unannounced, so that a request sent on it just then, never read, does not fail
//!   a healthy backend;
//! - failures are [`HttpBackendError`]s of a [`FailureKind`]: refused, reset, timeout, ... each
//!   with its status. Inside the balancer they become [`Error::Backend`](crate::Error::Backend),
//!   so [`RetryOnce`](crate::RetryOnce) retries them elsewhere and the failure cooldown
//!   passes the backend over, as for any backend service; a timeout answers 504, the rest 502.
//!   A request whose own body failed while it was sent (the client went away, a body limit
//!   or read timeout of the proxy's), or was still arriving from the client when the response
//!   timeout passed, is the request's fault, not the backend's:
//!   [`FailureKind::RequestBody`], 400, and the backend is not passed over. So is a request
//!   it does not forward: a `CONNECT`, or a body in a transfer coding other than `chunked`
//!   ([`FailureKind::Unsupported`], 501, sent nowhere);
//! - an answer framed by `Transfer-Encoding` goes on without the `Content-Length` it
//!   overrode; one the proxy cannot hand on, a `101 Switching Protocols` (no `Upgrade` is
//!   forwarded, so upgrades and WebSockets are not carried), a status from 600 to 999
//!   (none in HTTP: a malformed answer) or a body in a transfer coding other than
//!   `chunked`, is the backend's failure (502). Interim answers (`1xx`) other than
//!   the `100 Continue` the server gives itself are not passed on: hyper-util's client does
//!   not hand them over.
//! - an answer goes on in HTTP/1.1 (or the client's own version) whatever the backend spoke,
//!   as the request goes on in the backend's: an HTTP/1.0 backend's answer of no declared
//!   length, which its close ends, goes on chunked, where a cut still shows.
//!
//! In front of llama-server, [`IdSlot`] sends the slot the router assigned a request to (an
//! [`AssignedSlot`](crate::AssignedSlot) extension) as the body's `id_slot`.
//!
//! The response body is a [`BackendBody`], hyper's [`Incoming`](hyper::body::Incoming)
//! streamed frame by frame; the balancer's [`ResponseBody`](crate::ResponseBody) holds the
//! slot until it ends.
//!
//! # Example
//!
//! ```no_run
//! use axum::body::Body;
//! use tower::Layer;
//! use tower_affinity::client::HttpBackend;
//! use tower_affinity::discover::StaticFleet;
//! use tower_affinity::{Backend, ErrorToResponse, SessionAffinityLayer};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let http = HttpBackend::<Body>::builder();
//! let fleet = StaticFleet::new([
//!     ("a1", Backend::new("node-a", http.build("http://10.0.0.1:8080")?)),
//!     ("b1", Backend::new("node-b", http.build("http://10.0.0.2:8080")?)),
//! ]);
//! let affinity = SessionAffinityLayer::new().layer(fleet);
//! let app = axum::Router::new().fallback_service(ErrorToResponse::new(affinity));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8000").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! ```

mod backend_body;
mod body;
mod error;
mod future;
mod hop_by_hop;
mod id_slot;
mod service;

pub use backend_body::BackendBody;
pub use error::{FailureKind, HttpBackendError, InvalidBackendUrl};
pub use future::ResponseFuture;
pub use hop_by_hop::{strip_hop_by_hop, HOP_BY_HOP};
pub use id_slot::{write_id_slot, IdSlot, IdSlotLayer};
pub use service::{Builder, HttpBackend};
