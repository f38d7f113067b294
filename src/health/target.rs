//! What the probe needs of a backend's service, and of the balancer.

use http::Uri;
use tower::discover::Discover;

use crate::client::HttpBackend;
use crate::{Backend, BackendId, SessionAffinity};

/// A backend service the probe can reach: its base URI, `scheme://authority/`, to which the
/// probe appends `/health` and `/slots`.
///
/// Implemented for [`HttpBackend`]; implement it for a service of your own that wraps one.
pub trait ProbeTarget {
    /// `scheme://authority/` of the backend.
    fn base_uri(&self) -> &Uri;
}

impl<B> ProbeTarget for HttpBackend<B> {
    fn base_uri(&self) -> &Uri {
        HttpBackend::base_uri(self)
    }
}

/// Where the probe reports what it found: the balancer's health marks.
///
/// Implemented for [`SessionAffinity`], whose
/// [`mark_down`](SessionAffinity::mark_down) and [`mark_up`](SessionAffinity::mark_up) the
/// probe calls; a test can implement it to watch the probe alone.
pub trait MarkHealth {
    /// Marks backend `id` down until [`mark_up`](Self::mark_up). Returns `false` if there is
    /// no such backend.
    fn mark_down(&self, id: &BackendId) -> bool;
    /// Marks backend `id` up. Returns `false` if there is no such backend.
    fn mark_up(&self, id: &BackendId) -> bool;
    /// Applies the discovery changes that are ready now (see
    /// [`SessionAffinity::apply_discovery`]): the probe calls it before each round, so that it
    /// knows the fleet, and after announcing a learned slot count.
    fn apply_discovery(&self);
}

impl<D, K, P, S> MarkHealth for SessionAffinity<D, K, P>
where
    D: Discover<Key = BackendId, Service = Backend<S>>,
{
    fn mark_down(&self, id: &BackendId) -> bool {
        SessionAffinity::mark_down(self, id.as_str(), None)
    }

    fn mark_up(&self, id: &BackendId) -> bool {
        SessionAffinity::mark_up(self, id.as_str())
    }

    fn apply_discovery(&self) {
        SessionAffinity::apply_discovery(self);
    }
}

impl<T: MarkHealth + ?Sized> MarkHealth for std::sync::Arc<T> {
    fn mark_down(&self, id: &BackendId) -> bool {
        (**self).mark_down(id)
    }

    fn mark_up(&self, id: &BackendId) -> bool {
        (**self).mark_up(id)
    }

    fn apply_discovery(&self) {
        (**self).apply_discovery();
    }
}
