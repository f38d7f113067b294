//! [`RetryOnce`]: retry a request whose backend failed before answering.

use std::future::{ready, Ready};

use tower::retry::Policy;

use crate::Error;

/// A [`tower::retry::Policy`] that retries a request once when its backend failed before
/// sending a response ([`Error::Backend`]); nothing has reached the client yet, so the retry is
/// invisible to it. The failed backend is marked down (see
/// [`SessionAffinityLayer::failure_cooldown`]), so the retry is placed on the next candidate.
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
}

impl<B: Clone, Res> Policy<http::Request<B>, Res, Error> for RetryOnce {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _req: &mut http::Request<B>,
        result: &mut Result<Res, Error>,
    ) -> Option<Self::Future> {
        match result {
            Err(Error::Backend { .. }) if !self.retried => {
                self.retried = true;
                Some(ready(()))
            }
            _ => None,
        }
    }

    fn clone_request(&mut self, req: &http::Request<B>) -> Option<http::Request<B>> {
        Some(req.clone())
    }
}
