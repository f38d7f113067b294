//! The response body wrapper that holds the request's slot until the body ends, and reads the
//! usage the answer reports as it passes.

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http::header::{CONTENT_ENCODING, CONTENT_TYPE};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::Instant;

use crate::api::{Api, Opening};
use crate::cache::{ModelCell, Verdict};
use crate::fleet::SlotGuard;
use crate::learn::{Answer, Prediction};
use crate::stats::bump;
use crate::usage::UsageScanner;
use crate::{Decision, Outcome, Usage};

pin_project! {
    /// A backend's response body, holding its backend slot until the last frame has been read,
    /// the body fails, or the body is dropped.
    ///
    /// LLM answers stream for minutes: the slot is busy all that time, so it is released with
    /// the body, not with the response headers.
    ///
    /// A JSON answer or an SSE stream is read for the usage it reports as its bytes pass
    /// (unchanged): see [`usage`](Self::usage).
    pub struct ResponseBody<B> {
        #[pin]
        kind: InnerOrBytes<B>,
        guard: Option<SlotGuard>,
        decision: Option<Decision>,
        observe: Option<Box<Observe>>,
        // How long its backend is passed over when the body fails while it is read whole,
        // before any of it reaches the client (see `read_whole`).
        failure_cooldown: Duration,
        // Whether the body is read whole before any of it reaches the client.
        read_whole: bool,
    }

    impl<B> PinnedDrop for ResponseBody<B> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            // A client that stops reading once it has the answer's last chunk (an SSE client
            // at `data: [DONE]`) may drop the body before its end is polled: what the answer
            // reported in full is learned all the same.
            if let (Some(observe), Some(guard)) = (this.observe.as_mut(), this.guard.as_ref()) {
                observe.end_if_reported(guard);
            }
        }
    }
}

/// What the service hands the response body to learn from its answer.
#[derive(Debug)]
pub(crate) struct Watch {
    /// What the cache model predicted for the request on its backend.
    pub(crate) prediction: Option<Prediction>,
    /// That backend's model, to correct when the prediction was far off.
    pub(crate) cache: Option<Arc<ModelCell>>,
    /// How the request was placed: the answer's figures are counted under it too.
    pub(crate) outcome: Outcome,
    /// Whether the backend answered with a success.
    pub(crate) success: bool,
    /// The API the request spoke: whether its answer's stream may open before the prompt is
    /// read.
    pub(crate) api: Api,
    /// How long the request waited for a slot before its dispatch, if it waited.
    pub(crate) waited: Option<Duration>,
}

impl Watch {
    /// Watching the answer to a request placed with `outcome`.
    pub(crate) fn new(outcome: Outcome) -> Self {
        Watch {
            prediction: None,
            cache: None,
            outcome,
            success: false,
            api: Api::Other,
            waited: None,
        }
    }
}

/// Reading one answer: the scanner, and what the answer has shown so far.
#[derive(Debug)]
pub(crate) struct Observe {
    scanner: UsageScanner,
    /// For a stream, which may open before its prompt is read (a Responses stream's lifecycle
    /// events, llama-server's progress chunks), what finds the first event after the read;
    /// `None` for a JSON answer, whose first byte follows the read.
    opening: Option<Opening>,
    watch: Watch,
    stream: bool,
    /// When the first byte that follows the prompt's read came: a JSON answer's first byte,
    /// or a stream's first event after those sent while the prompt is read.
    first_byte: Option<Instant>,
    /// The figures, once the body has ended.
    usage: Option<Usage>,
    done: bool,
    /// For a stream, whether the last chunk read with bytes in it held a `usage` or
    /// `timings` object whose choice is not going on (its last `finish_reason` is not null,
    /// or it has none), or the stream's last event (see
    /// [`ends_answer`](crate::slots::ends_answer)): a client that drops the body then has
    /// read the answer to its end. An Anthropic stream gives its prompt's figures in its
    /// first event, before the answer is written; vLLM with `continuous_usage_stats` and
    /// llama-server with `timings_per_token` give figures in every chunk.
    at_end: bool,
    /// The request spoke Anthropic Messages: its stream ends with its last event,
    /// `message_stop`, alone. Its figures come first, in `message_start`, and a frame that
    /// cuts that event leaves them in a chunk that does not say whose they are.
    messages: bool,
    /// A chunk with figures has named a choice after the first (see
    /// [`names_a_later_choice`](crate::slots::names_a_later_choice)): the request asked for
    /// several, and one choice's finish is not the answer's end.
    several: bool,
}

impl Observe {
    /// An observer for an answer with `headers`, if it can carry usage: JSON or an SSE
    /// stream, not compressed.
    pub(crate) fn new(headers: &HeaderMap, watch: Watch) -> Option<Box<Self>> {
        // One pass over the names, no lookups (an answer has a handful of headers); none for
        // an answer without headers. The first of each counts, as `HeaderMap::get` has it.
        if headers.is_empty() {
            return None;
        }
        let (mut kind, mut encoding) = (None, None);
        for (name, value) in headers {
            if *name == CONTENT_TYPE {
                kind.get_or_insert(value);
            } else if *name == CONTENT_ENCODING {
                encoding.get_or_insert(value);
            }
        }
        let kind = kind?.as_bytes();
        let essence = kind
            .split(|&b| b == b';')
            .next()
            .unwrap_or(kind)
            .trim_ascii();
        let stream = essence.eq_ignore_ascii_case(b"text/event-stream");
        let json = essence.eq_ignore_ascii_case(b"application/json");
        let encoded = encoding.is_some_and(|e| !e.as_bytes().eq_ignore_ascii_case(b"identity"));
        if !(stream || json) || encoded {
            return None;
        }
        Some(Box::new(Observe {
            messages: watch.api == Api::Messages,
            scanner: UsageScanner::default(),
            opening: stream.then(|| Opening::new(watch.api.may_open_before_read())),
            watch,
            stream,
            first_byte: None,
            usage: None,
            done: false,
            at_end: false,
            several: false,
        }))
    }

    /// Reads a chunk; returns the time it read for the first byte, if the chunk holds the
    /// first byte that follows the prompt's read.
    fn data(&mut self, chunk: &[u8]) -> Option<Instant> {
        let first = match self.first_byte {
            None => self.first(chunk),
            Some(_) => None,
        };
        let before = self.scanner.objects_read();
        self.scanner.feed(chunk);
        if self.stream && !chunk.is_empty() {
            // The last event is looked for only once figures were read (an Anthropic stream,
            // from its first event on): before that, a stream dropped is not learned anyway,
            // and the look costs a token chunk of an OpenAI stream nothing. A chunk with
            // figures is the end unless its choice goes on (a token chunk of a stream with
            // figures in every chunk): looked at only in a chunk with figures, one a stream
            // that gives them once. An Anthropic stream ends with its last event only; a
            // stream of several choices, at the chunk after them.
            let read = self.scanner.objects_read();
            self.at_end = if read != before && !self.messages {
                self.several = self.several || crate::slots::names_a_later_choice(chunk);
                !crate::slots::choice_goes_on(chunk, self.several)
                    || (self.several && crate::slots::ends_answer(chunk))
            } else {
                read > 0 && crate::slots::ends_answer(chunk)
            };
        }
        first
    }

    /// Reads a chunk before the first byte that follows the prompt's read: the time it came,
    /// if the chunk holds it. Out of line: it is for the first chunks only.
    #[inline(never)]
    fn first(&mut self, chunk: &[u8]) -> Option<Instant> {
        if !self.opening.as_mut().is_none_or(|o| o.feed(chunk)) {
            return None;
        }
        let now = Instant::now();
        self.first_byte = Some(now);
        Some(now)
    }

    /// The answer's first byte came at `at`: on the histograms now, however the answer ends
    /// (read whole, cut, or dropped midway by a client that stopped reading). Not an error's:
    /// it comes without the prompt read (a refusal, a 503 while the model loads), and would
    /// read as the fastest prefill of all.
    fn first_byte(&self, guard: &SlotGuard, at: Instant) {
        if !self.watch.success {
            return;
        }
        let capacity = guard.capacity();
        let after = capacity.now_ms(at).saturating_sub(guard.since_ms());
        let after = Duration::from_millis(after);
        guard.metrics().first_byte(after);
        crate::metrics::first_byte(&capacity.counters.labels, self.watch.outcome, after);
    }

    /// The body is dropped before its end: if the answer has reported its figures in full,
    /// they are learned as at its end; otherwise nothing is (a stream cut short). A stream
    /// has reported them in full when the last chunk read held figures (the usage chunk,
    /// `response.completed`, llama-server's last chunk) and no choice that goes on
    /// (`"finish_reason":null`), or its last event (`data: [DONE]`, `message_stop`): an
    /// Anthropic stream's figures in its first event, `message_start`, and the figures in
    /// each token chunk of a stream that gives them in every chunk (vLLM's
    /// `continuous_usage_stats`, llama-server's `timings_per_token`) are not its end, and a
    /// client that stops it in the middle has not read the answer, nor has one that stops
    /// a stream of several choices (`n`) at one choice's finish, while the others may still
    /// stream: its end is the usage chunk after them, or `data: [DONE]`. The stream of an
    /// Anthropic Messages request has been read to its end at `message_stop` only, however
    /// its frames cut its events.
    fn end_if_reported(&mut self, guard: &SlotGuard) {
        let ended = !self.stream || self.at_end;
        if !self.done && ended && self.scanner.finish().is_some() {
            self.end(guard, None);
        }
    }

    /// The body has ended (`now`, if the clock was just read): what it reported goes to its
    /// backend's figures.
    fn end(&mut self, guard: &SlotGuard, now: Option<Instant>) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let capacity = guard.capacity();
        let now = now.unwrap_or_else(Instant::now);
        let since = guard.since_ms();
        let ms = |t: Instant| Duration::from_millis(capacity.now_ms(t).saturating_sub(since));
        let answer = Answer {
            // An answer other than a success did not take its prompt: figures in it (a
            // gateway's, the count of a prompt refused) say nothing of what the backend holds.
            usage: self.scanner.finish().filter(|_| self.watch.success),
            first_byte: self.first_byte.filter(|_| self.watch.success).map(ms),
            duration: Some(ms(now)).filter(|_| self.watch.success),
            stream: self.stream,
            returns: guard.returns(),
        };
        let (usage, verdict) = guard.learned().learn(&answer, self.watch.prediction);
        if let Some(u) = usage {
            let correction = verdict == Verdict::HeldLess;
            guard
                .metrics()
                .answer(u.prompt_tokens, u.reused_tokens, correction);
            let c = &capacity.counters;
            c.usage_reports.fetch_add(1, Ordering::Relaxed);
            // Only the answers that said their reuse count against it.
            match u.reused_tokens {
                Some(reused) => c.count_reuse(self.watch.outcome, u.prompt_tokens, reused),
                None => {
                    c.unreported_prompt_tokens
                        .fetch_add(u.prompt_tokens, Ordering::Relaxed);
                }
            }
        }
        if verdict == Verdict::HeldLess {
            bump(&capacity.counters.corrections);
        }
        // One line an answer for an operator who asks (`debug`): what the backend said it
        // reused of the prompt, where the request was placed and why. A backend id that is no
        // header value (see `DecisionHeaders`) is left out of it.
        tracing::debug!(
            backend = guard
                .headers()
                .backend()
                .as_ref()
                .and_then(|v| v.to_str().ok())
                .map(tracing::field::display),
            outcome = %self.watch.outcome,
            success = self.watch.success,
            prompt_tokens = usage.map(|u| u.prompt_tokens),
            reused_tokens = usage.and_then(|u| u.reused_tokens),
            prompt_ms = usage.and_then(|u| u.prompt_time).map(|t| t.as_millis() as u64),
            first_byte_ms = answer.first_byte.map(|t| t.as_millis() as u64),
            ms = answer.duration.map(|t| t.as_millis() as u64),
            waited_ms = self.watch.waited.map(|t| t.as_millis() as u64),
            slot = guard.assigned_slot(),
            "answer read"
        );
        if verdict != Verdict::Fine {
            if let (Some(cache), Some(p)) = (&self.watch.cache, self.watch.prediction) {
                // What the model over-predicted, in the chain's estimate of tokens.
                let share = usage.map_or(0.0, |u| {
                    u.reused_tokens.unwrap_or(0) as f64 / u.prompt_tokens.max(1) as f64
                });
                let measured = (p.prompt_tokens as f64 * share) as u64;
                let shortfall = p.held_tokens.saturating_sub(measured);
                cache.lock().correct(verdict, p.stamp, shortfall);
            }
        }
        self.usage = usage;
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
    pub(crate) fn new(
        inner: B,
        guard: SlotGuard,
        decision: Option<Decision>,
        observe: Option<Box<Observe>>,
        failure_cooldown: Duration,
    ) -> Self {
        ResponseBody {
            kind: InnerOrBytes::Inner { inner },
            guard: Some(guard),
            decision,
            observe,
            failure_cooldown,
            read_whole: false,
        }
    }

    /// What the answer reported about its prompt, once the body has ended: its prompt tokens
    /// and the tokens its backend reused. `None` before the end, for an answer that reports
    /// nothing (or is neither JSON nor SSE, or is compressed), for one cut short, and for an
    /// answer other than a success (2xx), which did not take its prompt.
    ///
    /// The end is the poll that returns `None`, or the frame after which the body's
    /// [`is_end_stream`](Body::is_end_stream) is true: a server need not poll a body past
    /// that, and hyper's does not (an answer of known length, such as a JSON answer with its
    /// `Content-Length`, is dropped once its bytes are written). A body of your own around
    /// this one that logs the usage reads it there, or when it is dropped, not only at
    /// `None`; forward `is_end_stream` and `size_hint` too.
    ///
    /// The same figures add up per backend in
    /// [`SessionAffinity::backends`](crate::SessionAffinity::backends). Behind a
    /// [`BodyKeyLayer`](crate::key::BodyKeyLayer), this body is reached through
    /// [`BodyKeyResponseBody::get_ref`](crate::key::BodyKeyResponseBody::get_ref).
    pub fn usage(&self) -> Option<Usage> {
        self.observe.as_ref().and_then(|o| o.usage)
    }

    /// Where the request went and why, when the service was built with
    /// [`decision_extension(false)`](crate::SessionAffinityLayer::decision_extension); by
    /// default the decision is in the response's extensions instead, and this is `None`, as it
    /// is for an error response made by [`Error::into_response`](crate::Error::into_response).
    pub fn decision(&self) -> Option<&Decision> {
        self.decision.as_ref()
    }

    /// Takes the decision kept in the body, if any: for a body read whole and given back as
    /// bytes.
    pub(crate) fn take_decision(self: Pin<&mut Self>) -> Option<Decision> {
        self.project().decision.take()
    }

    /// The body is about to be read whole before any of it reaches the client (a `400` that
    /// [`ReadRefusals`](crate::ReadRefusals) reads): should it fail, the request fails with
    /// its backend's failure, which a retry sends elsewhere, so the backend is counted as
    /// failed and passed over for the failure cooldown, as one that fails before answering
    /// is, rather than counted as an answer cut short.
    pub(crate) fn read_whole(mut self) -> Self {
        self.read_whole = true;
        self
    }

    /// A body of `data` that holds no slot, keeping `decision` as the body it replaces did.
    pub(crate) fn read_back(data: Bytes, decision: Option<Decision>) -> Self {
        ResponseBody {
            kind: InnerOrBytes::bytes(data),
            guard: None,
            decision,
            observe: None,
            failure_cooldown: Duration::ZERO,
            read_whole: false,
        }
    }

    /// A body of fixed bytes that holds no slot: used for error responses.
    pub fn full(data: Bytes) -> Self {
        ResponseBody {
            kind: InnerOrBytes::bytes(data),
            guard: None,
            decision: None,
            observe: None,
            failure_cooldown: Duration::ZERO,
            read_whole: false,
        }
    }
}

/// An empty body that holds no slot, as [`ResponseBody::full`] of no bytes: what a layer
/// answering on its own needs (tower-http's `TimeoutLayer` answers `408` with
/// `Default::default()`).
impl<B> Default for ResponseBody<B> {
    fn default() -> Self {
        ResponseBody::full(Bytes::new())
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
        let mut this = self.project();
        let frame = ready!(this.kind.as_mut().poll_frame(cx));
        // The backend's last frame: a body that knows it has ended may not be polled again,
        // so all its end does is done now, once.
        let last = matches!(frame, Some(Ok(_))) && this.kind.is_end_stream();
        let mut now = None;
        match (&frame, this.observe.as_mut()) {
            (Some(Ok(f)), Some(observe)) => {
                // A one-chunk answer ends when it starts: one reading of the clock.
                now = f.data_ref().and_then(|data| observe.data(data.chunk()));
                if let (Some(_), Some(guard)) = (now, this.guard.as_mut()) {
                    // The answer's first byte after the read (a Responses stream's, after
                    // the events that open it): its backend has read the prompt.
                    guard.prompt_read();
                }
            }
            (Some(Ok(_)), None) => {
                if let Some(guard) = this.guard.as_mut() {
                    // The answer has begun: its backend has read the prompt.
                    guard.prompt_read();
                }
            }
            _ => {}
        }
        if let Some(observe) = this.observe.as_mut() {
            match &frame {
                Some(Ok(_)) => {
                    if let (Some(first), Some(guard)) = (now, this.guard.as_ref()) {
                        observe.first_byte(guard, first);
                    }
                    if last {
                        if let Some(guard) = this.guard.as_ref() {
                            observe.end(guard, now);
                        }
                    }
                }
                // The end: what the answer said is learned. An error, not.
                None => {
                    if let Some(guard) = this.guard.as_ref() {
                        observe.end(guard, None);
                    }
                }
                Some(Err(_)) => observe.done = true,
            }
        }
        // The backend's last frame, or an event stream's last event: the slot it was
        // assigned is free on the backend.
        if let (Some(Ok(f)), Some(guard)) = (&frame, this.guard.as_mut()) {
            if guard.holds_assigned_slot()
                && (last
                    || f.data_ref()
                        .is_some_and(|d| crate::slots::ends_answer(d.chunk())))
            {
                guard.release_assigned_slot();
            }
        }
        // The backend's last frame, the end of the stream, or an error that ends it: the slot
        // is free again. Taken once: the end polled after the last frame finds none.
        if last || !matches!(frame, Some(Ok(_))) {
            match (&frame, this.guard.take()) {
                // Nothing reached the client: the backend failed before it answered, and
                // the request is retried as for any failure, elsewhere.
                (Some(Err(_)), Some(guard)) if *this.read_whole => {
                    guard.count_failure();
                    if !this.failure_cooldown.is_zero() {
                        guard.fail(*this.failure_cooldown);
                    }
                }
                (Some(Err(_)), Some(guard)) => guard.count_cut_answer(),
                _ => {}
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

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseBody")
            .field("holds_slot", &self.guard.is_some())
            .finish_non_exhaustive()
    }
}
