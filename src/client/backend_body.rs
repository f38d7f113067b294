//! [`BackendBody`]: an [`HttpBackend`](super::HttpBackend)'s response body, with its idle
//! timeout between frames.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use super::error::HttpBackendError;
use crate::BoxError;

/// The response body of an [`HttpBackend`](super::HttpBackend): hyper's [`Incoming`],
/// streamed frame by frame as the backend sends it, that fails when the backend sends
/// nothing for longer than the [idle timeout between frames] once its first frame came.
///
/// A body that fails, for that or because its connection did, yields one error and then
/// ends; its connection is closed at once (over HTTP/2, its stream is reset), not handed
/// back to the pool. Its error is
/// hyper's, or, past the idle timeout, an [`HttpBackendError`] of kind
/// [`Timeout`](super::FailureKind::Timeout) that says so (`timed out: no frame of the
/// body within 60s of the last`).
///
/// Behind the balancer it is the inner body of [`ResponseBody`](crate::ResponseBody),
/// which frees the request's slot when it ends or fails, and counts a failure as an
/// answer cut short ([`BackendStatus::cut_answers`](crate::BackendStatus::cut_answers)).
///
/// ```no_run
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http_body_util::{BodyExt, Full};
/// use tower::ServiceExt;
/// use tower_affinity::client::HttpBackend;
///
/// # async fn doc() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let backend = HttpBackend::<Full<Bytes>>::builder()
///     .body_idle_timeout(Duration::from_secs(120))
///     .build("http://10.0.0.1:8080")?;
/// let res = backend.oneshot(http::Request::get("/v1/models").body(Full::default())?).await?;
/// assert_eq!(res.body().idle_timeout(), Some(Duration::from_secs(120)));
/// // Fails if the backend, once it began, falls silent for two minutes.
/// let models = res.into_body().collect().await?.to_bytes();
/// # let _ = models;
/// # Ok(()) }
/// ```
///
/// [idle timeout between frames]: super::Builder::body_idle_timeout
pub struct BackendBody {
    // `None` once the body has ended or failed: a connection it failed on is let go at once.
    inner: Option<Incoming>,
    idle: Option<Duration>,
    // Boxed, once a body, so that the body is `Unpin`, as hyper's is.
    deadline: Option<Pin<Box<Sleep>>>,
}

impl BackendBody {
    /// `inner`, failing past `idle` without a frame once its first frame came.
    pub(crate) fn new(inner: Incoming, idle: Option<Duration>) -> Self {
        BackendBody {
            inner: Some(inner),
            idle,
            deadline: None,
        }
    }

    /// The idle timeout between frames, if any.
    pub fn idle_timeout(&self) -> Option<Duration> {
        self.idle
    }
}

impl fmt::Debug for BackendBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendBody")
            .field("ended", &self.inner.is_none())
            .field("idle", &self.idle)
            .finish_non_exhaustive()
    }
}

impl Body for BackendBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let frame = match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(frame) => frame,
            Poll::Pending => {
                let Some(deadline) = this.deadline.as_mut() else {
                    return Poll::Pending;
                };
                if deadline.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                // Dropped here, the connection closes now, whoever still holds the body.
                this.inner = None;
                this.deadline = None;
                let after = this.idle.unwrap_or_default();
                return Poll::Ready(Some(Err(HttpBackendError::body_idle(after).into())));
            }
        };
        match (frame, this.idle) {
            (Some(Ok(frame)), Some(after)) => {
                if this.inner.as_ref().is_some_and(Body::is_end_stream) {
                    this.deadline = None;
                } else {
                    // A timeout too long for the clock to hold never comes: none at all.
                    match (Instant::now().checked_add(after), this.deadline.as_mut()) {
                        (None, _) => this.deadline = None,
                        (Some(at), Some(deadline)) => deadline.as_mut().reset(at),
                        (Some(at), None) => {
                            this.deadline = Some(Box::pin(tokio::time::sleep_until(at)))
                        }
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            (Some(Ok(frame)), None) => Poll::Ready(Some(Ok(frame))),
            (end_or_error, _) => {
                this.inner = None;
                this.deadline = None;
                Poll::Ready(end_or_error.map(|r| r.map_err(Into::into)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Some(inner) => inner.size_hint(),
            None => SizeHint::with_exact(0),
        }
    }
}
