//! [`BodyKeyResponseBody`]: the inner service's body, or a refusal's reason.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::body::InnerOrBytes;

// === BodyKeyResponseBody ===

pin_project! {
    /// The response body of [`BodyKey`]: the inner service's body, or the plain-text reason a
    /// request was refused (`413`, `408`, `400`).
    ///
    /// ```
    /// # fn doc(res: http::Response<tower_affinity::key::BodyKeyResponseBody<String>>) {
    /// use http_body::Body;
    ///
    /// let (_, body) = res.into_parts();
    /// let _ = body.size_hint();
    /// # }
    /// ```
    pub struct BodyKeyResponseBody<B> {
        #[pin]
        pub(super) kind: InnerOrBytes<B>,
    }
}

impl<B> Body for BodyKeyResponseBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        self.project().kind.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.kind.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.kind.size_hint()
    }
}

impl<B> fmt::Debug for BodyKeyResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BodyKeyResponseBody")
            .field("kind", &self.kind.describe())
            .finish()
    }
}
