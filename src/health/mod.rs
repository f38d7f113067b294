//! Health and slot probes, as a discovery adapter: [`HealthProbe`].
//!
//! [`HealthProbe::discover`] wraps any discovery stream (a [`StaticFleet`], a
//! [`channel`](crate::discover::channel), one from DNS) and splits it in two:
//!
//! ```text
//!   inner stream --> Probed --(changes, learned slot counts)--> SessionAffinity
//!                      |                                             ^
//!                  registers                                 mark_down / mark_up
//!                      v                                             |
//!                   Prober --- GET /health, /slots each interval ----+
//!                                  (/props once /slots was read)
//!                                  (/v1/models without slots)
//! ```
//!
//! The balancer keeps one health mechanism: a backend marked down is passed over by
//! placement (its requests in flight finish). A backend that fails requests is passed over
//! for the failure cooldown on its own; the probe marks down a backend that is loading or
//! does not answer, until it is ready again. The seam is the [`MarkHealth`] trait, which
//! [`SessionAffinity`](crate::SessionAffinity) implements; a backend's service gives the
//! probe its address through [`ProbeTarget`], which
//! [`HttpBackend`](crate::client::HttpBackend) implements, and
//! [`IdSlot`](crate::client::IdSlot) around one.
//!
//! What the probe found of each backend, its transitions and its busy slots, is in
//! [`Prober::status`] ([`ProbeStatus`]), for metrics and logs.
//!
//! A balancer with a [shared store](crate::store) has it checked each round too
//! ([`SessionAffinity::check_store`](crate::SessionAffinity::check_store)): an outage is
//! found, and its state published, while no request comes.
//!
//! [`StaticFleet`]: crate::discover::StaticFleet

mod check;
mod discover;
mod probe;
mod prober;
mod status;
mod target;

pub use discover::Probed;
pub use probe::HealthProbe;
pub use prober::{ProbeTask, Prober};
pub use status::ProbeStatus;
pub use target::{MarkHealth, ProbeTarget};
