//! [`BodyKey`]: the service.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header;
use http_body::Body;
use http_body_util::Full;
use tower::{Layer, Service};

use super::future::Rejection;
use super::inspect::Config;
use super::{BodyKeyFuture, BodyKeyLayer, BodyKeyResponseBody};
use crate::BoxError;

// === BodyKey ===

/// The service of [`BodyKeyLayer`]: see there for what it does.
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use tower::{service_fn, ServiceExt};
/// use tower_affinity::key::{BodyKey, SessionKey};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let inner = service_fn(|req: http::Request<Full<Bytes>>| async move {
///     let key = req.extensions().get::<SessionKey>().copied();
///     Ok::<_, Infallible>(http::Response::new(format!("{key:?}")))
/// });
/// let req = http::Request::post("/v1/chat/completions")
///     .body(Full::new(Bytes::from_static(br#"{"user":"agent-7","messages":[]}"#)))
///     .unwrap();
/// let res = BodyKey::new(inner).oneshot(req).await.unwrap();
/// let expected = format!("{:?}", Some(SessionKey::from_bytes(b"agent-7")));
/// let body = http_body_util::BodyExt::collect(res.into_body()).await.unwrap().to_bytes();
/// assert_eq!(body, expected);
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct BodyKey<S> {
    pub(super) inner: S,
    pub(super) config: Arc<Config>,
}

impl<S> BodyKey<S> {
    /// Wraps `inner` with the defaults of [`BodyKeyLayer::new`].
    pub fn new(inner: S) -> Self {
        BodyKeyLayer::new().layer(inner)
    }

    /// A layer that wraps services in `BodyKey`.
    pub fn layer() -> BodyKeyLayer {
        BodyKeyLayer::new()
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B, ResB> Service<http::Request<B>> for BodyKey<S>
where
    S: Service<http::Request<Full<Bytes>>, Response = http::Response<ResB>> + Clone,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Response = http::Response<BodyKeyResponseBody<ResB>>;
    type Error = S::Error;
    type Future = BodyKeyFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        // The service made ready goes with the request; this one is readied again next time.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        let (parts, body) = req.into_parts();

        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(body.size_hint().lower());
        if declared > config.limit as u64 {
            return BodyKeyFuture::reject(Rejection::TooLarge(config.limit));
        }
        BodyKeyFuture::read(inner, config, parts, body, declared)
    }
}
