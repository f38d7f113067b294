//! [`DnsFleet`]: the discovery stream, fed by the resolving task.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_core::Stream;
use tokio::task::JoinHandle;
use tower::discover::Change;

use super::builder::DnsFleetBuilder;
use super::changes::Changes;
use super::endpoint::DnsEndpoint;
use super::error::DnsError;
use super::handle::DnsHandle;
use super::resolve::Resolver;
use super::target::DnsTarget;
use super::task::{run, Make, Schedule};
use crate::{Backend, BackendId};

/// A discovery stream from DNS: resolves a [`DnsTarget`] again and again, and yields an insert
/// for each address that appears and a removal for each that goes.
///
/// Each backend's id is its `IP:PORT`; its service is made by the function given to
/// [`build`](DnsFleetBuilder::build), its node by [`node`](DnsFleetBuilder::node) (default:
/// the IP address). The next resolution comes after the answer's shortest TTL, kept between a
/// floor and a ceiling ([`min_interval`](DnsFleetBuilder::min_interval),
/// [`max_interval`](DnsFleetBuilder::max_interval)), or sooner on
/// [`DnsHandle::refresh`]. An address that answers leave out is removed at once, or once
/// they have left it out for the [removal grace](DnsFleetBuilder::removal_grace).
///
/// A failed resolution (no such name, no records, a timeout, a server failure) keeps the
/// fleet as it was: it is counted in [`DnsHandle::stats`], logged once when resolutions start
/// failing (and once when they recover), and retried after
/// [`retry_interval`](DnsFleetBuilder::retry_interval). The stream itself never yields an
/// error, and ends only if its resolving task does.
///
/// Resolution runs in a task of its own, so a changed fleet is ready for the next request
/// even after a quiet spell. Dropping the stream stops it. Built outside a tokio runtime,
/// the stream starts the task on its first poll; polled outside a runtime before it has one,
/// it panics, as `tokio::spawn` does. The changes the stream has not yielded yet are merged
/// as they come: it owes at most one change a backend, what differs from what it has yielded
/// so far (an address that came and went meanwhile is not announced; one that went and came
/// back is an insert that updates it), the inserts first.
/// A balancer that takes no request for hours finds the fleet as it is now, not every
/// answer on the way.
///
/// With a literal address, which resolves to itself without a query:
///
/// ```
/// use tokio_stream::StreamExt;
/// use tower::discover::Change;
/// use tower_affinity::discover::dns::{DnsEndpoint, DnsFleet};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let mut fleet = DnsFleet::builder("127.0.0.1:8080".parse().unwrap())
///     .nameserver("127.0.0.1:53".parse().unwrap())
///     .build(|ep: &DnsEndpoint| format!("http://{}", ep.authority()))
///     .unwrap();
/// let Some(Ok(Change::Insert(id, backend))) = fleet.next().await else {
///     unreachable!()
/// };
/// assert_eq!(id.as_str(), "127.0.0.1:8080");
/// assert_eq!(backend.node().as_str(), "127.0.0.1");
/// assert_eq!(backend.service(), "http://127.0.0.1:8080");
/// assert_eq!(fleet.handle().stats().backends, 1);
/// # }
/// ```
///
/// See [the module docs](super) for one under [`SessionAffinity`](crate::SessionAffinity).
pub struct DnsFleet<S> {
    changes: Arc<Changes<S>>,
    handle: DnsHandle,
    task: Task,
}

enum Task {
    /// Built outside a runtime: spawned on the first poll.
    Waiting(Option<Pin<Box<dyn Future<Output = ()> + Send>>>),
    Running(JoinHandle<()>),
}

impl<S: Send + 'static> DnsFleet<S> {
    /// A fleet from `target` through the system's DNS configuration, with the default
    /// schedule, one slot a backend, and the IP address as node. See [`DnsFleet::builder`]
    /// for the rest.
    pub fn new<F>(target: DnsTarget, service: F) -> Result<Self, DnsError>
    where
        F: Fn(&DnsEndpoint) -> S + Send + Sync + 'static,
    {
        DnsFleet::builder(target).build(service)
    }

    pub(crate) fn start(
        resolver: Resolver,
        target: DnsTarget,
        schedule: Schedule,
        make: Make<S>,
    ) -> Self {
        let changes = Changes::new();
        let handle = DnsHandle::new(target);
        let work: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(run(
            resolver,
            handle.clone(),
            schedule,
            make,
            changes.clone(),
        ));
        let task = match tokio::runtime::Handle::try_current() {
            Ok(rt) => Task::Running(rt.spawn(work)),
            Err(_) => Task::Waiting(Some(work)),
        };
        DnsFleet {
            changes,
            handle,
            task,
        }
    }
}

impl DnsFleet<()> {
    /// Configures a fleet from `target`: nameserver, schedule, node names, slots.
    pub fn builder(target: DnsTarget) -> DnsFleetBuilder {
        DnsFleetBuilder::new(target)
    }
}

impl<S> DnsFleet<S> {
    /// The handle on this stream's resolutions: counters, last error, refresh.
    pub fn handle(&self) -> DnsHandle {
        self.handle.clone()
    }
}

impl<S> Stream for DnsFleet<S> {
    type Item = Result<Change<BackendId, Backend<S>>, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if let Task::Waiting(work) = &mut this.task {
            // Not an end of the stream: one that ended here would start on a later poll
            // inside a runtime, and yield after `None`.
            let Ok(rt) = tokio::runtime::Handle::try_current() else {
                panic!(
                    "DnsFleet for {} polled outside a tokio runtime: its resolving task needs one",
                    this.handle.target()
                );
            };
            if let Some(work) = work.take() {
                this.task = Task::Running(rt.spawn(work));
            }
        }
        this.changes.poll_next(cx).map(|c| c.map(Ok))
    }
}

impl<S> Drop for DnsFleet<S> {
    fn drop(&mut self) {
        if let Task::Running(task) = &self.task {
            task.abort();
        }
        self.handle.shared().closed();
    }
}

impl<S> fmt::Debug for DnsFleet<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DnsFleet")
            .field("handle", &self.handle)
            .finish_non_exhaustive()
    }
}
