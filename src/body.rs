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
        kind: Kind<B>,
        guard: Option<SlotGuard>,
        decision: Option<Decision>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Backend { #[pin] inner: B },
        Full { data: Option<Bytes> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn new(inner: B, guard: SlotGuard, decision: Option<Decision>) -> Self {
        ResponseBody {
            kind: Kind::Backend { inner },
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
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
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
        match this.kind.project() {
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d.into())))),
            KindProj::Backend { inner } => {
                let frame = ready!(inner.poll_frame(cx));
                // The end of the stream, or an error that ends it: the slot is free again.
                if !matches!(frame, Some(Ok(_))) {
                    this.guard.take();
                }
                Poll::Ready(frame)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Backend { inner } => inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.remaining() as u64))
            }
            Kind::Backend { inner } => inner.size_hint(),
        }
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseBody")
            .field("holds_slot", &self.guard.is_some())
            .finish_non_exhaustive()
    }
}
