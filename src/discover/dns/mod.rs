//! Discovery from DNS: the backends behind a name, followed as its records change.
//!
//! This is the fleet a Kubernetes headless service, Consul DNS or a docker compose service
//! name describes. A [`DnsFleet`] resolves a [`DnsTarget`]:
//!
//! - `NAME:PORT`: the name's A/AAAA records (see [`IpStrategy`]), each address a backend on
//!   `PORT`;
//! - `_SERVICE._PROTO.NAME`: its SRV records, each target host's addresses a backend on the
//!   record's port (priority and weight are not used: every target is a backend; a record
//!   on port 0 or with the target "." names none). The targets are looked up eight at a
//!   time, so that a large record set sends the nameserver no burst of queries; a target
//!   whose lookup fails (not one that has no address) fails the resolution at once.
//!
//! It resolves again when the answer's shortest TTL runs out, but no sooner than a floor and no
//! later than a ceiling, and yields tower [`Change`](tower::discover::Change)s for what
//! changed: an insert for each new `IP:PORT`, a removal for each that went, the inserts first
//! (a fleet whose addresses all changed is never empty between the two). A failed resolution
//! keeps the fleet as it was, and is counted and logged (see [`DnsHandle`]); an answer with no
//! address counts as failed, and an answer none of whose addresses could be made into a
//! backend (see [`DnsFleetBuilder::try_build`]) keeps the old backends until one is, so DNS
//! never empties the fleet.
//!
//! Queries go to the system's nameservers (`/etc/resolv.conf`, with its search domains), or to
//! those given with [`DnsFleetBuilder::nameserver`]. Resolution uses [hickory-resolver],
//! without its cache; the feature needs Rust 1.88 or later, as hickory-resolver 0.26 does.
//! A resolution that got no answer about the name (a timeout, a failed connection, a server
//! failure) fails with an error that names the name, the record type and the nameservers
//! asked, as in `llm.fleet.test. A: request timed out (nameserver 127.0.0.1:5353)`: a wrong
//! resolver address shows in the log and in [`DnsHandle::last_error`].
//!
//! A name without a trailing dot is tried under the search domains as the configuration's
//! `ndots` says. In a Kubernetes pod (`ndots:5`) `llm.default.svc.cluster.local:8080` is
//! asked under three or four search domains, where it does not exist, before it is asked as
//! it is, at every resolution; `llm.default.svc.cluster.local.:8080` is asked once. Each
//! record type asked is asked under one full name before the next full name is tried, and
//! the first with an address is the answer. A full name whose query failed (a timeout, a
//! server failure) while another type answered fails the resolution, as without search
//! domains. One whose queries failed with no answer is passed over, as a system resolver
//! passes it over: the name may still be found under a later domain; if it is not, the
//! resolution fails with the first failure, not as no such name. Either way the fleet is
//! kept.
//!
//! One [`DnsFleet`] follows one name. Streams of several can be merged (`select` of
//! `futures`); an `IP:PORT` that two names give is then one backend, which a removal from
//! either takes out: to keep it while any name gives it, keep the set of names that give
//! each id, and pass a removal on only once the set is empty, as the proxy example does. A
//! count of inserts does not do: a name's insert of an id it gave before is an update (see
//! [`DnsFleet`]).
//!
//! By default the fleet is what each answer says: a server that answers with a different
//! subset of a large record set each time (round-robin DNS whose answers are cut short, some
//! Consul setups) makes the fleet change each time, and the sessions homed on a backend left
//! out move and lose their warm caches. [`DnsFleetBuilder::removal_grace`] keeps an address
//! until the answers have left it out for the grace; one back before then stays, and no change
//! is announced. The cost: a backend that is really gone stays in the fleet up to the grace
//! longer. Requests placed on it fail (a refused connection, a timeout), and each failure
//! passes it over for the [failure cooldown](crate::SessionAffinityLayer::failure_cooldown)
//! (5 s by default; with zero, not at all), so it gets requests again only as each cooldown
//! ends; [`RetryOnce`](crate::RetryOnce) sends the failed ones elsewhere. A
//! [`HealthProbe`](crate::health::HealthProbe) marks it down once its probes have failed
//! [`failure_threshold`](crate::health::HealthProbe::failure_threshold) times in a row, until
//! it answers again.
//!
//! # Example
//!
//! ```no_run
//! use std::convert::Infallible;
//! use std::num::NonZeroU32;
//! use tower::{service_fn, Layer};
//! use tower_affinity::discover::dns::{DnsEndpoint, DnsFleet};
//! use tower_affinity::SessionAffinityLayer;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A backend's service from its address; a real proxy would build an HTTP client to
//! // `http://{authority}`.
//! let backend = |ep: &DnsEndpoint| {
//!     let authority = ep.authority();
//!     service_fn(move |_req: http::Request<String>| {
//!         let authority = authority.clone();
//!         async move { Ok::<_, Infallible>(http::Response::new(authority.to_string())) }
//!     })
//! };
//! let fleet = DnsFleet::builder("llm.default.svc.cluster.local:8080".parse()?)
//!     .slots(NonZeroU32::new(4).unwrap())
//!     .build(backend)?;
//! let dns = fleet.handle();
//! let svc = SessionAffinityLayer::new().layer(fleet);
//!
//! dns.resolved(1).await; // serve once the first answer is in
//! println!("{} backends, {} failed resolutions", svc.backends().len(), dns.failures());
//! # Ok(())
//! # }
//! ```
//!
//! [hickory-resolver]: https://docs.rs/hickory-resolver

// Layout:
//   target.rs    DnsTarget: NAME:PORT or SRV
//   endpoint.rs  DnsEndpoint: one address, as the service and node functions see it
//   builder.rs   DnsFleetBuilder, IpStrategy: the resolver, the schedule, the backends
//   fleet.rs     DnsFleet: the discovery stream
//   changes.rs   the changes announced and not yet yielded, merged: one a backend at most
//   task.rs      the resolving task: resolve, diff, announce, wait
//   resolve.rs   one resolution: addresses and the shortest TTL
//   handle.rs    DnsHandle, DnsStats: counters, last error, refresh
//   error.rs     DnsError, DnsErrorKind

mod builder;
mod changes;
mod endpoint;
mod error;
mod fleet;
mod handle;
mod resolve;
mod target;
mod task;

pub use builder::{DnsFleetBuilder, IpStrategy};
pub use endpoint::DnsEndpoint;
pub use error::{DnsError, DnsErrorKind};
pub use fleet::DnsFleet;
pub use handle::{DnsHandle, DnsStats};
pub use target::DnsTarget;
