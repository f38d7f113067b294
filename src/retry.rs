//! [`RetryOnce`]: retry a request whose backend failed before answering, or answered 503.

use std::future::{ready, Ready};

use http::StatusCode;
use tower::retry::Policy;

use crate::{BoxError, Error};

/// A [`tower::retry::Policy`] that retries a request once when its backend failed before
/// sending a response ([`Error::Backend`]), or answered `503 Service Unavailable` (it serves
/// nothing now: llama-server answers so while it loads its model). Nothing has reached the
/// client yet, so the retry is invisible to it; the 503's body is dropped. The backend is
/// marked down in either case (see [`SessionAffinityLayer::failure_cooldown`]), so the retry
/// is placed on the next candidate. With the cooldown turned off (`Duration::ZERO`) nothing
/// marks it down, and the retry is placed as the first attempt was: a session's retry goes
/// back to its home, the backend that just failed. Other answers, errors included, are the
/// backend's to give. A failure that is the request's own is not retried: its body failed on
/// its way to the backend (the client went away, a body limit), or it is not one a proxy
/// forwards (a `CONNECT`, a transfer coding other than `chunked`). The backend is not at
/// fault, and the same request would fail again.
///
/// The request body must be `Clone`: buffer it first (a `Full<Bytes>` body is).
///
/// ```
/// use tower::retry::RetryLayer;
/// use tower_affinity::RetryOnce;
///
/// let layer = RetryLayer::new(RetryOnce::new());
/// # let _ = layer;
/// ```
///
/// [`SessionAffinityLayer::failure_cooldown`]: crate::SessionAffinityLayer::failure_cooldown
#[derive(Clone, Copy, Debug, Default)]
pub struct RetryOnce {
    retried: bool,
}

impl RetryOnce {
    /// A policy that has not retried yet.
    pub const fn new() -> Self {
        RetryOnce { retried: false }
    }

    /// Whether to retry an attempt that `failed` (before answering, or with a 503).
    fn once(&mut self, failed: bool) -> Option<Ready<()>> {
        if !failed || self.retried {
            return None;
        }
        self.retried = true;
        Some(ready(()))
    }
}

/// Nothing reached the client: the backend failed before answering, or answered that it
/// serves nothing now.
fn failed<ResB>(result: Result<&http::Response<ResB>, &Error>) -> bool {
    match result {
        Err(Error::Backend { source, .. }) => !crate::error::request_at_fault(&**source),
        Ok(res) => res.status() == StatusCode::SERVICE_UNAVAILABLE,
        Err(_) => false,
    }
}

impl<B: Clone, ResB> Policy<http::Request<B>, http::Response<ResB>, Error> for RetryOnce {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _req: &mut http::Request<B>,
        result: &mut Result<http::Response<ResB>, Error>,
    ) -> Option<Self::Future> {
        self.once(failed(result.as_ref()))
    }

    fn clone_request(&mut self, req: &http::Request<B>) -> Option<http::Request<B>> {
        Some(req.clone())
    }
}

/// Behind a layer that boxes errors (tower's `Buffer`, `Timeout`): this crate's [`Error`]
/// inside the box is retried as above; any other error is not.
impl<B: Clone, ResB> Policy<http::Request<B>, http::Response<ResB>, BoxError> for RetryOnce {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _req: &mut http::Request<B>,
        result: &mut Result<http::Response<ResB>, BoxError>,
    ) -> Option<Self::Future> {
        let failed = match result {
            Ok(res) => failed::<ResB>(Ok(res)),
            Err(e) => e
                .downcast_ref::<Error>()
                .is_some_and(|e| failed::<ResB>(Err(e))),
        };
        self.once(failed)
    }

    fn clone_request(&mut self, req: &http::Request<B>) -> Option<http::Request<B>> {
        Some(req.clone())
    }
}
