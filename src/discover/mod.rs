//! Built-in discovery streams: a static list, a channel fed at run time, and (feature `dns`)
//! the backends behind a DNS name.
//!
//! Any `Stream<Item = Result<Change<BackendId, Backend<S>>, E>>` works as discovery (tower's
//! [`Change`]); these cover the common cases.

use std::convert::Infallible;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_core::Stream;
use tokio::sync::mpsc;
use tower::discover::Change;

use crate::{Backend, BackendId};

#[cfg(feature = "dns")]
#[cfg_attr(docsrs, doc(cfg(feature = "dns")))]
pub mod dns;
#[cfg(feature = "dns")]
#[cfg_attr(docsrs, doc(cfg(feature = "dns")))]
#[doc(no_inline)]
pub use dns::DnsFleet;

/// A fixed fleet: yields an insert for each backend, then ends. The service keeps the fleet
/// after the stream ends, and nothing changes it then: for a fleet listed at the start and
/// changed at run time, insert the list through a [`channel`]'s [`FleetHandle`] instead.
///
/// Ids name backends: an id given twice is one backend, the later entry updating the earlier
/// (its node, slots and service), as a discovery insert of a known id does, with a warning in
/// the log. Two servers listed under one id leave the first out of the fleet; give each its
/// own id.
///
/// ```
/// use tower_affinity::{discover::StaticFleet, Backend};
///
/// let fleet: StaticFleet<()> = [
///     ("a1", Backend::new("node-a", ())),
///     ("b1", Backend::new("node-b", ())),
/// ]
/// .into_iter()
/// .collect();
/// # let _ = fleet;
/// ```
pub struct StaticFleet<S> {
    backends: std::vec::IntoIter<(BackendId, Backend<S>)>,
}

impl<S> StaticFleet<S> {
    /// A fleet of the given backends.
    pub fn new<I, Id>(backends: I) -> Self
    where
        I: IntoIterator<Item = (Id, Backend<S>)>,
        Id: Into<BackendId>,
    {
        backends.into_iter().collect()
    }
}

impl<S, Id: Into<BackendId>> FromIterator<(Id, Backend<S>)> for StaticFleet<S> {
    fn from_iter<T: IntoIterator<Item = (Id, Backend<S>)>>(iter: T) -> Self {
        let backends: Vec<(BackendId, Backend<S>)> =
            iter.into_iter().map(|(id, b)| (id.into(), b)).collect();
        let mut seen = std::collections::HashSet::with_capacity(backends.len());
        for (id, _) in &backends {
            if !seen.insert(id) {
                tracing::warn!(backend = %id, "backend id given twice in a StaticFleet: the later entry replaces the earlier");
            }
        }
        StaticFleet {
            backends: backends.into_iter(),
        }
    }
}

impl<S> Stream for StaticFleet<S> {
    type Item = Result<Change<BackendId, Backend<S>>, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Poll::Ready(
            self.backends
                .next()
                .map(|(id, b)| Ok(Change::Insert(id, b))),
        )
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.backends.size_hint()
    }
}

impl<S> Unpin for StaticFleet<S> {}

impl<S> fmt::Debug for StaticFleet<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StaticFleet")
            .field("remaining", &self.backends.len())
            .finish()
    }
}

/// A discovery stream fed through a [`FleetHandle`]. Ends when every handle is dropped; the
/// service keeps the fleet it had.
pub struct FleetChannel<S> {
    rx: mpsc::UnboundedReceiver<Change<BackendId, Backend<S>>>,
}

/// Inserts, updates and removes backends of a running service.
///
/// Changes are applied the next time the service is polled for readiness, which every
/// request does, or at once by
/// [`SessionAffinity::apply_discovery`](crate::SessionAffinity::apply_discovery): until
/// then, [`backends`](crate::SessionAffinity::backends) lists the fleet as it was, and
/// [`mark_down`](crate::SessionAffinity::mark_down) knows no backend just inserted.
///
/// ```
/// use std::convert::Infallible;
/// use tower::{service_fn, Layer};
/// use tower_affinity::{discover, Backend, SessionAffinityLayer};
///
/// let backend = service_fn(|_: http::Request<String>| async {
///     Ok::<_, Infallible>(http::Response::new(String::new()))
/// });
/// // A fleet listed at the start, changed at run time.
/// let (fleet, stream) = discover::channel();
/// for (id, node) in [("gpu-0", "host-a"), ("gpu-1", "host-b")] {
///     fleet.insert(id, Backend::new(node, backend.clone()));
/// }
/// let balancer = SessionAffinityLayer::new().layer(stream);
/// fleet.remove("gpu-1");
/// fleet.insert("gpu-2", Backend::new("host-c", backend));
/// balancer.apply_discovery();
/// let ids: Vec<_> = balancer.backends().iter().map(|b| b.id.to_string()).collect();
/// assert_eq!(ids, ["gpu-0", "gpu-2"]);
/// ```
pub struct FleetHandle<S> {
    tx: mpsc::UnboundedSender<Change<BackendId, Backend<S>>>,
}

/// A channel-fed discovery stream and its handle.
///
/// ```
/// use tower_affinity::{discover, Backend};
///
/// let (handle, stream) = discover::channel::<()>();
/// handle.insert("gpu-0", Backend::new("host-a", ()));
/// handle.remove("gpu-0");
/// # let _ = stream;
/// ```
pub fn channel<S>() -> (FleetHandle<S>, FleetChannel<S>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (FleetHandle { tx }, FleetChannel { rx })
}

impl<S> FleetHandle<S> {
    /// Adds a backend, or updates it if the id is known (its sessions stay). Returns `false` if
    /// the stream has been dropped.
    pub fn insert(&self, id: impl Into<BackendId>, backend: Backend<S>) -> bool {
        self.tx.send(Change::Insert(id.into(), backend)).is_ok()
    }

    /// Removes a backend: its in-flight requests finish, its sessions are placed again on
    /// their next turn. Returns `false` if the stream has been dropped.
    pub fn remove(&self, id: impl Into<BackendId>) -> bool {
        self.tx.send(Change::Remove(id.into())).is_ok()
    }
}

impl<S> Clone for FleetHandle<S> {
    fn clone(&self) -> Self {
        FleetHandle {
            tx: self.tx.clone(),
        }
    }
}

impl<S> Stream for FleetChannel<S> {
    type Item = Result<Change<BackendId, Backend<S>>, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx).map(|c| c.map(Ok))
    }
}

impl<S> fmt::Debug for FleetChannel<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FleetChannel").finish_non_exhaustive()
    }
}

impl<S> fmt::Debug for FleetHandle<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FleetHandle").finish_non_exhaustive()
    }
}
