//! [`SentBody`]: the request body as the client sends it, with a note of how its sending goes.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

/// How the sending of a request's body goes, as its [`SentBody`] sees it: what the client's
/// error, or the response timeout, cannot tell.
#[derive(Debug, Default)]
pub(crate) struct Sending {
    /// The body yielded an error.
    failed: AtomicBool,
    /// The connection asked for the body's next frame and the body had none yet: the
    /// request's sender, not the backend, is being waited on.
    waiting: AtomicBool,
}

impl Sending {
    /// Whether the body yielded an error.
    pub(crate) fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Whether the body owes the connection a frame that it asked for.
    pub(crate) fn waiting(&self) -> bool {
        self.waiting.load(Ordering::Acquire)
    }
}

pin_project! {
    /// A request body that notes in its [`Sending`] whether it yields an error, and whether
    /// the connection is waiting on it: the client's error then says only that the
    /// connection or stream failed (HTTP/2 resets the stream), and a response timeout only
    /// that no answer came, not that the request's own body, not the backend, was the cause.
    pub(crate) struct SentBody<B> {
        #[pin]
        inner: B,
        sending: Arc<Sending>,
    }
}

impl<B> SentBody<B> {
    pub(crate) fn new(inner: B, sending: Arc<Sending>) -> Self {
        SentBody { inner, sending }
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
        this.sending
            .waiting
            .store(frame.is_pending(), Ordering::Release);
        if let Poll::Ready(Some(Err(_))) = &frame {
            this.sending.failed.store(true, Ordering::Release);
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
