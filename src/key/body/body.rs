//! [`BodyKeyResponseBody`]: the inner service's body, or a refusal's reason.

use std::fmt;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::ask::UsageStrip;
use super::responses::IdSniffer;
use crate::body::InnerOrBytes;

// === BodyKeyResponseBody ===

pin_project! {
    /// The response body of [`BodyKey`]: the inner service's body, or the JSON error body a
    /// request was refused with (`413`, `408`, `400`; [`Error::json_body`](crate::Error::json_body)).
    ///
    /// [`get_ref`](Self::get_ref) reaches the inner body: behind the layer, a
    /// [`SessionAffinity`](crate::SessionAffinity)'s [`ResponseBody`](crate::ResponseBody),
    /// with the [usage](crate::ResponseBody::usage) its answer reported once read to the end
    /// (which a server such as hyper's reaches without polling for `None`: see there), and the
    /// [decision](crate::ResponseBody::decision) when it is kept in the body:
    ///
    /// ```
    /// # async fn doc(res: http::Response<tower_affinity::key::BodyKeyResponseBody<
    /// #     tower_affinity::ResponseBody<http_body_util::Full<bytes::Bytes>>>>) {
    /// use http_body_util::BodyExt;
    ///
    /// let mut body = res.into_body();
    /// while let Some(frame) = body.frame().await {
    ///     // Each frame on to the client.
    /// #   let _ = frame;
    /// }
    /// // `None` for a request the layer refused, which never reached the service.
    /// if let Some(usage) = body.get_ref().and_then(|inner| inner.usage()) {
    ///     println!("{} of {} prompt tokens reused", usage.reused_tokens.unwrap_or(0), usage.prompt_tokens);
    /// }
    /// # }
    /// ```
    pub struct BodyKeyResponseBody<B> {
        #[pin]
        pub(super) kind: InnerOrBytes<B>,
        // The inner body has ended and the layer's own bytes after it have gone out: the end.
        // The inner body is kept (not polled again) for `get_ref`.
        pub(super) ended: bool,
        // Reads a Responses API answer's id from its first bytes.
        pub(super) sniff: Option<Box<IdSniffer>>,
        // Takes out the usage chunk the layer asked for on the client's behalf.
        pub(super) strip: Option<Box<UsageStrip>>,
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
        let mut this = self.project();
        loop {
            if *this.ended {
                return Poll::Ready(None);
            }
            if let Some(trailers) = this.strip.as_mut().and_then(|s| s.trailers.take()) {
                return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
            }
            let frame = ready!(this.kind.as_mut().poll_frame(cx));
            if let (Some(sniff), Some(Ok(frame))) = (this.sniff.as_mut(), &frame) {
                if let Some(data) = frame.data_ref() {
                    sniff.feed(data.chunk());
                }
            }
            let Some(strip) = this.strip.as_mut() else {
                return Poll::Ready(frame);
            };
            let out = match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(mut data) => strip.feed(data.copy_to_bytes(data.remaining())),
                    // Trailers come after the data: what is held goes first.
                    Err(trailers) if strip.is_empty() => return Poll::Ready(Some(Ok(trailers))),
                    Err(trailers) => {
                        strip.trailers = trailers.into_trailers().ok();
                        strip.finish()
                    }
                },
                // The end: whatever is held, then the end, as the body is polled again.
                None if strip.is_empty() => return Poll::Ready(None),
                None => {
                    let rest = strip.finish();
                    *this.strip = None;
                    *this.ended = true;
                    if rest.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(rest.into()))));
                }
                // A stream that fails ends with its error, as the client would have had it.
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
            };
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(out.into()))));
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
            || self.kind.is_end_stream()
                && self
                    .strip
                    .as_ref()
                    .is_none_or(|s| s.is_empty() && s.trailers.is_none())
    }

    fn size_hint(&self) -> SizeHint {
        match self.strip {
            // Its bytes may change.
            Some(_) => SizeHint::default(),
            None => self.kind.size_hint(),
        }
    }
}

impl<B> BodyKeyResponseBody<B> {
    /// A body of the layer's own bytes.
    pub(super) fn bytes(data: Bytes) -> Self {
        BodyKeyResponseBody {
            kind: InnerOrBytes::bytes(data),
            ended: false,
            sniff: None,
            strip: None,
        }
    }

    /// The inner service's body; `None` for a request the layer refused (its body is the
    /// reason), which never reached the service.
    pub fn get_ref(&self) -> Option<&B> {
        match &self.kind {
            InnerOrBytes::Inner { inner } => Some(inner),
            InnerOrBytes::Bytes { .. } => None,
        }
    }

    /// The inner service's body, mutably; `None` for a request the layer refused. Frames read
    /// from it directly pass the layer by: the usage it takes out of a stream it asked on the
    /// client's behalf would reach the client.
    pub fn get_mut(&mut self) -> Option<&mut B> {
        match &mut self.kind {
            InnerOrBytes::Inner { inner } => Some(inner),
            InnerOrBytes::Bytes { .. } => None,
        }
    }
}

/// An empty body, as the layer's own answers are made: what a layer answering on its own
/// needs (tower-http's `TimeoutLayer` answers `408` with `Default::default()`).
/// [`get_ref`](Self::get_ref) is `None`.
impl<B> Default for BodyKeyResponseBody<B> {
    fn default() -> Self {
        BodyKeyResponseBody::bytes(Bytes::new())
    }
}

impl<B> fmt::Debug for BodyKeyResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BodyKeyResponseBody")
            .field("kind", &self.kind.describe())
            .finish()
    }
}
