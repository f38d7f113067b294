//! [`Probed`]: a discovery stream whose backends are probed.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_core::{Stream, TryStream};
use pin_project_lite::pin_project;
use tokio::sync::mpsc;
use tower::discover::Change;

use super::prober::{Prober, Update};
use super::target::ProbeTarget;
use crate::{Backend, BackendId};

pin_project! {
    /// The discovery half of [`HealthProbe::discover`](super::HealthProbe::discover): yields
    /// the inner stream's changes as they come, registering each backend with its
    /// [`Prober`], and the backends whose slot count the prober learned, announced again.
    ///
    /// A backend announced without a slot count ([`Backend::slots_given`]) and again later
    /// keeps the count learned for it. Announced again at another address, it is probed as
    /// another server: the answers of probes sent to the old address are dropped, and its
    /// failures and successes in a row start over. Whether it is up stays until the new
    /// server's probes say otherwise. The slot count and request context learned at the old
    /// address stay until the new server first answers ready, so that a server moved as it
    /// was does not serve as one slot meanwhile; from that answer on, the backend has what
    /// the new server says, and what it does not say is unknown (a count unknown is one
    /// slot). The stream does not end when the inner one does: the prober may still learn
    /// slot counts.
    pub struct Probed<D, S> {
        #[pin]
        inner: D,
        prober: Prober<S>,
        updates: mpsc::UnboundedReceiver<Update>,
        inner_ended: bool,
    }
}

impl<D, S> Probed<D, S> {
    pub(crate) fn new(inner: D, prober: Prober<S>) -> Self {
        let updates = prober.take_updates();
        Probed {
            inner,
            prober,
            updates,
            inner_ended: false,
        }
    }

    /// The prober of this stream's backends.
    pub fn prober(&self) -> &Prober<S> {
        &self.prober
    }
}

impl<D, S> Stream for Probed<D, S>
where
    D: TryStream<Ok = Change<BackendId, Backend<S>>>,
    S: ProbeTarget + Clone,
{
    type Item = Result<Change<BackendId, Backend<S>>, D::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut this = self.project();
        while let Poll::Ready(Some(update)) = this.updates.poll_recv(cx) {
            if let Some((id, backend)) = this.prober.still_current(update) {
                return Poll::Ready(Some(Ok(Change::Insert(id, backend))));
            }
        }
        if *this.inner_ended {
            return Poll::Pending;
        }
        match this.inner.as_mut().try_poll_next(cx) {
            Poll::Ready(Some(Ok(Change::Insert(id, backend)))) => {
                let backend = this.prober.announced(&id, backend);
                Poll::Ready(Some(Ok(Change::Insert(id, backend))))
            }
            Poll::Ready(Some(Ok(Change::Remove(id)))) => {
                this.prober.removed(&id);
                Poll::Ready(Some(Ok(Change::Remove(id))))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => {
                *this.inner_ended = true;
                Poll::Pending
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<D, S> fmt::Debug for Probed<D, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Probed")
            .field("prober", &self.prober)
            .finish_non_exhaustive()
    }
}
