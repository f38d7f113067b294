//! The response body wrapper that holds the request's slot until the body ends.

use std::fmt;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::fleet::SlotGuard;
use crate::Decision;

pin_project! {
    /// A backend's response body, holding its backend slot until the last frame has been read,
    /// the body fails, or the body is dropped.
    ///
    /// LLM answers stream for minutes: the slot is busy all that time, so it is released with
    /// the body, not with the response headers.
    pub struct ResponseBody<B> {
        #[pin]
        kind: InnerOrBytes<B>,
        guard: Option<SlotGuard>,
        decision: Option<Decision>,
    }
}

pin_project! {
    /// A body that is either another body or a few fixed bytes: the backend's body or an error
    /// answer here, and the inner service's body or a refusal in
    /// [`BodyKeyResponseBody`](crate::key::BodyKeyResponseBody).
    #[project = InnerOrBytesProj]
    pub(crate) enum InnerOrBytes<B> {
        Inner { #[pin] inner: B },
        Bytes { data: Option<Bytes> },
    }
}

impl<B> InnerOrBytes<B> {
    pub(crate) fn bytes(data: Bytes) -> Self {
        InnerOrBytes::Bytes {
            data: (!data.is_empty()).then_some(data),
        }
    }

    /// What it is, for `Debug`.
    pub(crate) fn describe(&self) -> &'static str {
        match self {
            InnerOrBytes::Inner { .. } => "inner",
            InnerOrBytes::Bytes { .. } => "bytes",
        }
    }
}

impl<B> Body for InnerOrBytes<B>
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
        match self.project() {
            InnerOrBytesProj::Inner { inner } => inner.poll_frame(cx),
            InnerOrBytesProj::Bytes { data } => {
                Poll::Ready(data.take().map(|d| Ok(Frame::data(d.into()))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            InnerOrBytes::Inner { inner } => inner.is_end_stream(),
            InnerOrBytes::Bytes { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            InnerOrBytes::Inner { inner } => inner.size_hint(),
            InnerOrBytes::Bytes { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.remaining() as u64))
            }
        }
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn new(inner: B, guard: SlotGuard, decision: Option<Decision>) -> Self {
        ResponseBody {
            kind: InnerOrBytes::Inner { inner },
            guard: Some(guard),
            decision,
        }
    }

    /// Where the request went and why, when the service was built with
    /// [`decision_extension(false)`](crate::SessionAffinityLayer::decision_extension); by
    /// default the decision is in the response's extensions instead, and this is `None`, as it
    /// is for an error response made by [`Error::into_response`](crate::Error::into_response).
    pub fn decision(&self) -> Option<&Decision> {
        self.decision.as_ref()
    }

    /// A body of fixed bytes that holds no slot: used for error responses.
    pub fn full(data: Bytes) -> Self {
        ResponseBody {
            kind: InnerOrBytes::bytes(data),
            guard: None,
            decision: None,
        }
    }
}

impl<B> Body for ResponseBody<B>
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
        // The end of the stream, or an error that ends it: the slot is free again.
        if !matches!(frame, Some(Ok(_))) {
            this.guard.take();
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

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseBody")
            .field("holds_slot", &self.guard.is_some())
            .finish_non_exhaustive()
    }
}
