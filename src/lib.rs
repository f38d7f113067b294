//! Session-affinity load balancing for LLM fleets, as a Tower middleware.
//!
//! A coding agent resends its whole conversation every turn. A model server that still holds
//! that prefix in its prompt cache answers in about a second; any other server reads the
//! prompt again first, which for a 30,000-token prompt on a modest GPU takes minutes. This
//! crate keeps each session close to the cache that served it last: the same backend, else
//! another backend on the same node (where a move was measured far cheaper), else another node,
//! spilling when capacity is full. Affinity is a preference, not a pin.
//!
//! # Shape
//!
//! ```text
//! request -> KeyExtractor -> Placement (key + fleet view + session table) -> preference order
//!         -> first candidate with a free slot (else wait / overcommit / reject)
//!         -> slot taken -> backend called once ready -> response body holds the slot until it ends
//! ```
//!
//! - [`key`]: [`SessionKey`](key::SessionKey) digests, the [`KeyExtractor`](key::KeyExtractor)
//!   trait and the header and extension extractors; [`BodyKeyLayer`](key::BodyKeyLayer), which
//!   buffers a request's body (so that a retry can send it again) and reads its key and its
//!   prompt's [`PromptChain`] from the JSON.
//! - [`placement`]: the [`Placement`](placement::Placement) trait over a read-only view, the
//!   default [`NodeThenBackend`](placement::NodeThenBackend) and the baselines. The view holds
//!   the *cache model*: per backend, which links of the requests' [`PromptChain`]s it
//!   probably still holds, so that placement knows where a conversation's prefix is, whether a
//!   session's home evicted it, and where a request without a key belongs.
//! - [`discover`]: static and channel-fed discovery streams of [`Backend`]s, and with the `dns`
//!   feature `DnsFleet`, the backends behind a DNS name (A/AAAA with a port, or SRV) followed
//!   as its records change.
//! - [`store`]: homes shared by router replicas, through the [`HomeStore`](store::HomeStore)
//!   trait; with the `redis` feature, `store::RedisStore` keeps them in Redis.
//! - `client` (feature `client`): `HttpBackend`, a backend's service over hyper-util's
//!   pooled client, with hop-by-hop headers dropped, timeouts and failures by kind; `IdSlot`,
//!   which sends llama-server the slot the router assigned a request to ([`AssignedSlot`]).
//! - `health` (feature `health`): `HealthProbe`, a discovery adapter that probes each
//!   backend's `/health` and `/slots` (a llama-server's `/props` for its slots' context, and
//!   `/v1/models` for a backend without slots) and marks it down and up.
//! - `metrics` (feature `metrics`): the series the balancer writes through the `metrics`
//!   facade.
//! - [`SessionAffinityLayer`] builds [`SessionAffinity`], a `tower::Service` for your axum or
//!   hyper proxy. Its [`ResponseBody`] releases the request's slot when the body ends.
//! - [`RetryOnce`], a retry policy for tower's `RetryLayer`: a request whose backend failed,
//!   answered 503, or refused its prompt as too long for its context ([`ReadRefusals`] reads
//!   such a refusal into a [`ContextRefusal`]) is retried once where it fits; where no other
//!   backend takes it, the balancer answers the retry with the refusal as it came.
//! - [`Error`], why a request was not served, and the HTTP answer each maps to (429, 503, 502,
//!   504, ...); [`ErrorToResponse`] answers a service's errors so, for axum's
//!   `fallback_service`.
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use std::num::NonZeroU32;
//! use tower::{service_fn, Layer, ServiceExt};
//! use tower_affinity::{discover::StaticFleet, Backend, Decision, Outcome, SessionAffinityLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // Four backends on two nodes; a real proxy would use a hyper-util client per backend.
//! let backend = |name: &'static str| {
//!     service_fn(move |_req: http::Request<String>| async move {
//!         Ok::<_, Infallible>(http::Response::new(name.to_string()))
//!     })
//! };
//! let two = NonZeroU32::new(2).unwrap();
//! let fleet = StaticFleet::new([
//!     ("a1", Backend::new("node-a", backend("a1")).slots(two)),
//!     ("a2", Backend::new("node-a", backend("a2")).slots(two)),
//!     ("b1", Backend::new("node-b", backend("b1")).slots(two)),
//!     ("b2", Backend::new("node-b", backend("b2")).slots(two)),
//! ]);
//! let svc = SessionAffinityLayer::new().layer(fleet);
//!
//! let turn = || {
//!     http::Request::post("/v1/chat/completions")
//!         .header("x-session-id", "agent-1")
//!         .body(String::new())
//!         .unwrap()
//! };
//! let first = svc.clone().oneshot(turn()).await.unwrap();
//! let second = svc.clone().oneshot(turn()).await.unwrap();
//! let d1 = first.extensions().get::<Decision>().unwrap();
//! let d2 = second.extensions().get::<Decision>().unwrap();
//! assert_eq!(d1.outcome, Outcome::NewSession);
//! assert_eq!(d2.outcome, Outcome::HomeHit);
//! assert_eq!(d1.backend, d2.backend);
//! # }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
// A few docs link items of features not built with them (a `HealthProbe` that checks the
// store, `publish_metrics`): rustdoc leaves those as text. With every feature, as docs.rs
// builds, every link must resolve (`.ci/run` denies broken ones).
#![cfg_attr(
    not(all(
        feature = "client",
        feature = "health",
        feature = "dns",
        feature = "metrics",
        feature = "redis"
    )),
    allow(rustdoc::broken_intra_doc_links)
)]

// Layout: one concept a file.
//   api.rs       the API a request speaks, told by its path, and where its answer's stream
//                says the backend has read the prompt
//   layer.rs     SessionAffinityLayer, the builder
//   service.rs   SessionAffinity: discovery, placement attempts, stats
//   future.rs    ResponseFuture: waiting for a slot, then driving the backend
//   wait.rs      the wait queue: which waiter a freed slot wakes
//   chain.rs     PromptChain: a prompt's digests at its message boundaries
//   cache.rs     the cache model: the chain links each backend probably holds
//   learn.rs     what the answers teach per backend: reuse, prefill rate, wait versus move
//   metrics.rs   the `metrics` facade's names (feature `metrics`)
//   body.rs      ResponseBody: holds the slot until the body ends; InnerOrBytes, shared with key/
//   overflow.rs  what a request does when every candidate is full
//   error.rs     Error, its HTTP mapping, ErrorToResponse
//   retry.rs     RetryOnce; ReadRefusals, ContextRefusal
//   fleet.rs     nodes, backends, slot counters, health (discovery applied here)
//   table.rs     the session table
//   store/       the shared store of homes for router replicas: the HomeStore trait,
//                StoredHome and its value format, the service's side (deadline, writes,
//                up/down state, counters: shared.rs), RedisStore (redis.rs, `redis` feature)
//   slots.rs     AssignedSlot, and the table of a backend's slots the router assigns
//   stats.rs     Decision, Outcome, counters
//   usage.rs     Usage: the prompt and reused tokens a backend's answer reports, and its scanner
//   discover/    static and channel-fed discovery (mod.rs); dns/, discovery from a DNS name
//                (feature dns: target, endpoint, builder, the stream, its task, one resolution,
//                the handle, errors)
//   key/         SessionKey, extractors; key/body/, the body-reading layer (layer, service,
//                future, body, and the parse: inspect, leading, canonical, prompt, facts,
//                pinned; responses, the Responses API's stored responses; ask, a stream's
//                usage asked on the client's behalf)
//   placement/   the Placement trait, its view, rendezvous, NodeThenBackend, baselines,
//                Snapshot (a fleet view for tests)
//   client/      (feature `client`) HttpBackend: service, future, error, hop_by_hop, the
//                request body as sent (body) and the answer's (backend_body); IdSlot, the
//                assigned slot written into the body as llama-server's `id_slot` (id_slot)
//   health/      (feature `health`) HealthProbe: the discovery adapter, the prober, its checks,
//                each backend's status, and what it needs of a backend and of the balancer

mod api;
mod body;
mod cache;
mod chain;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
pub mod discover;
mod error;
mod fleet;
mod future;
#[cfg(feature = "health")]
#[cfg_attr(docsrs, doc(cfg(feature = "health")))]
pub mod health;
pub mod key;
mod layer;
mod learn;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
#[cfg(not(feature = "metrics"))]
mod metrics;
mod overflow;
pub mod placement;
mod retry;
mod service;
mod slots;
mod stats;
pub mod store;
mod table;
mod usage;
mod wait;

pub use body::ResponseBody;
pub use chain::{Link, PromptChain};
pub use error::{BoxError, Error, ErrorToResponse, ErrorToResponseFuture, ErrorToResponseLayer};
pub use fleet::{Backend, BackendId, BackendStatus, NodeId};
pub use future::ResponseFuture;
pub use layer::SessionAffinityLayer;
pub use overflow::Overflow;
pub use retry::{ContextRefusal, ReadRefusals, ReadRefusalsFuture, ReadRefusalsLayer, RetryOnce};
pub use service::SessionAffinity;
pub use slots::AssignedSlot;
pub use stats::{Decision, Outcome, ParseOutcomeError, Reuse, SentAgain, Stats};
pub use table::Sessions;
pub use usage::Usage;

// The README's examples are whole programs, as they read on a repository's page (no hidden
// lines), and use the optional parts: they are tested with every feature on.
#[cfg(all(doctest, feature = "health", feature = "metrics", feature = "redis"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
