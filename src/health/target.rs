//! What the probe needs of a backend's service, and of the balancer.

use std::future::Future;
use std::pin::Pin;

use http::Uri;
use tower::discover::Discover;

use crate::client::{HttpBackend, IdSlot};
use crate::{Backend, BackendId, SessionAffinity};

/// A backend service the probe can reach: its base URI, `scheme://authority/`, to which the
/// probe appends `/health` and `/slots`. A base with a path (a service that sends under a
/// prefix, `http://gateway/llama-a/`) is probed under it (`/llama-a/health`), with or without
/// its trailing `/`; a query on the base goes after each path.
///
/// Implemented for [`HttpBackend`], and for an [`IdSlot`] around a target (probed where the
/// service it wraps sends); implement it for a service of your own that wraps one.
///
/// ```
/// use http::Uri;
/// use tower_affinity::client::HttpBackend;
/// use tower_affinity::health::ProbeTarget;
///
/// /// A backend service of one's own (one that adds a header to each request, say), around
/// /// the `HttpBackend` that sends them: probed where that one sends.
/// #[derive(Clone, Debug)]
/// struct Tagged<B>(HttpBackend<B>);
///
/// impl<B> ProbeTarget for Tagged<B> {
///     fn base_uri(&self) -> &Uri {
///         self.0.base_uri()
///     }
///
///     fn http2_prior_knowledge(&self) -> bool {
///         self.0.http2_prior_knowledge()
///     }
/// }
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let backend = Tagged(HttpBackend::<String>::new("http://10.0.0.1:8080")?);
/// assert_eq!(backend.base_uri(), "http://10.0.0.1:8080/");
/// # Ok(()) }
/// ```
pub trait ProbeTarget {
    /// `scheme://authority/` of the backend, or `scheme://authority/prefix/` for one reached
    /// under a path prefix.
    fn base_uri(&self) -> &Uri;

    /// Whether the backend is spoken to in HTTP/2 with prior knowledge (`h2c`), as the probe
    /// then asks it too: a front that takes only HTTP/2 never answers an HTTP/1.1 probe.
    /// HTTP/1.1 (`false`) unless implemented.
    fn http2_prior_knowledge(&self) -> bool {
        false
    }
}

impl<B> ProbeTarget for HttpBackend<B> {
    fn base_uri(&self) -> &Uri {
        HttpBackend::base_uri(self)
    }

    fn http2_prior_knowledge(&self) -> bool {
        HttpBackend::http2_prior_knowledge(self)
    }
}

/// An `IdSlot` sends its requests through the service it wraps: the probe reaches that one.
impl<S: ProbeTarget> ProbeTarget for IdSlot<S> {
    fn base_uri(&self) -> &Uri {
        self.get_ref().base_uri()
    }

    fn http2_prior_knowledge(&self) -> bool {
        self.get_ref().http2_prior_knowledge()
    }
}

/// Where the probe reports what it found: the balancer's health marks.
///
/// Implemented for [`SessionAffinity`], whose
/// [`mark_down`](SessionAffinity::mark_down) and [`mark_up`](SessionAffinity::mark_up) the
/// probe calls; a test can implement it to watch the probe alone.
///
/// ```
/// use parking_lot::Mutex;
/// use tower_affinity::health::MarkHealth;
/// use tower_affinity::BackendId;
///
/// /// Keeps the marks the probe sends, in order.
/// #[derive(Debug, Default)]
/// struct Marks(Mutex<Vec<(BackendId, bool)>>);
///
/// impl MarkHealth for Marks {
///     fn mark_down(&self, id: &BackendId) -> bool {
///         self.0.lock().push((id.clone(), false));
///         true
///     }
///
///     fn mark_up(&self, id: &BackendId) -> bool {
///         self.0.lock().push((id.clone(), true));
///         true
///     }
///
///     // No balancer: nothing to apply.
///     fn apply_discovery(&self) {}
/// }
///
/// let marks = Marks::default();
/// marks.mark_down(&BackendId::from("gpu-0"));
/// assert_eq!(*marks.0.lock(), [(BackendId::from("gpu-0"), false)]);
/// ```
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
    /// Checks the balancer's shared store, if it has one (see
    /// [`SessionAffinity::check_store`]): the probe runs it beside each round's probes, so
    /// that an outage is found with no request waiting on it. Checks nothing by default.
    fn check_store(&self) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>> {
        Box::pin(std::future::ready(()))
    }
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

    fn check_store(&self) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>> {
        let check = SessionAffinity::check_store(self);
        Box::pin(async move {
            check.await;
        })
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

    fn check_store(&self) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>> {
        (**self).check_store()
    }
}
