//! [`BodyKeyResponseBody`]: the inner service's body, or a refusal's reason.

use std::fmt;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::responses::IdSniffer;
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
        // Reads a Responses API answer's id from its first bytes.
        pub(super) sniff: Option<Box<IdSniffer>>,
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
        let this = self.project();
        let frame = ready!(this.kind.poll_frame(cx));
        if let (Some(sniff), Some(Ok(frame))) = (this.sniff.as_mut(), &frame) {
            if let Some(data) = frame.data_ref() {
                sniff.feed(data.chunk());
            }
        }
        Poll::Ready(frame)
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
