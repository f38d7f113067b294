//! [`SentBody`]: the request body as the client sends it, with a note of whether it failed.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// A request body that sets `failed` if it yields an error: the client's error then says
    /// only that the connection or stream failed (HTTP/2 resets the stream), not that the
    /// request's own body, not the backend, was the cause.
    pub(crate) struct SentBody<B> {
        #[pin]
        inner: B,
        failed: Arc<AtomicBool>,
    }
}

impl<B> SentBody<B> {
    pub(crate) fn new(inner: B, failed: Arc<AtomicBool>) -> Self {
        SentBody { inner, failed }
    }
}

impl<B: Body> Body for SentBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = this.inner.poll_frame(cx);
        if let Poll::Ready(Some(Err(_))) = &frame {
            this.failed.store(true, Ordering::Release);
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
