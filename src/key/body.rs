//! [`BodyKeyLayer`]: buffers a request body (bounded), reads the session key and the prompt
//! facts from it, and forwards the body unchanged.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{header, HeaderValue, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::time::{Instant, Sleep};
use tower::util::Oneshot;
use tower::{Layer, Service};

use super::{HeaderKey, SessionKey};
use crate::body::InnerOrBytes;
use crate::BoxError;

// === config ===

#[derive(Clone, Debug)]
struct Config {
    /// Each field as its path of object keys (`metadata.user_id` is `["metadata", "user_id"]`).
    fields: Vec<Vec<String>>,
    /// The distinct first keys of `fields`: the only top-level values the parse keeps whole.
    tops: Vec<String>,
    limit: usize,
    read_timeout: Option<Duration>,
    /// The body is left unread when these headers carry a key.
    skip_when: Option<HeaderKey>,
}

impl Config {
    fn new(limit: usize) -> Self {
        Config {
            fields: Vec::new(),
            tops: Vec::new(),
            limit,
            read_timeout: None,
            skip_when: None,
        }
    }

    fn set_fields(&mut self, fields: Vec<Vec<String>>) {
        let mut tops: Vec<String> = Vec::new();
        for first in fields.iter().filter_map(|path| path.first()) {
            if !tops.contains(first) {
                tops.push(first.clone());
            }
        }
        self.fields = fields;
        self.tops = tops;
    }

    /// Whether the body is read at all: not when a header already names the session.
    fn reads(&self, headers: &http::HeaderMap) -> bool {
        self.skip_when
            .as_ref()
            .is_none_or(|header| !header.finds_key(headers))
    }

    /// What a body says about its session and its prompt.
    ///
    /// One pass over the body that keeps only what it needs: the top-level values the key
    /// fields start with and the leading entries of `messages`; everything else is checked and
    /// skipped without being built. A body is taken as JSON exactly when it parses as a
    /// [`serde_json::Value`] (same nesting limit, same checks of strings and numbers).
    fn inspect(&self, body: &[u8]) -> (Option<SessionKey>, PromptFacts) {
        let mut facts = PromptFacts {
            body_bytes: body.len(),
            messages: 0,
            leading_digest: None,
        };
        // Most bodies that are not a JSON object are spotted without running the parser.
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return (None, facts);
        }
        let mut de = serde_json::Deserializer::from_slice(body);
        let found = match de.deserialize_map(TopLevel { tops: &self.tops }) {
            Ok(found) if de.end().is_ok() => found,
            _ => return (None, facts),
        };
        if let Some(messages) = found.messages {
            facts.messages = messages.count;
            if !messages.leading.is_empty() {
                // The same bytes as `serde_json::to_vec(&leading)`, hashed as they are written.
                let mut hasher = Sha256::new();
                if serde_json::to_writer(&mut hasher, &messages.leading).is_ok() {
                    facts.leading_digest = Some(hasher.finalize().into());
                }
            }
        }
        let key = self.fields.iter().find_map(|path| {
            let (first, rest) = path.split_first()?;
            let top = self.tops.iter().position(|t| t == first)?;
            let (_, value) = found.values.iter().find(|(i, _)| *i == top)?;
            key_at(value, rest)
        });
        (key, facts)
    }
}

/// The key at `path` below `value`: a non-blank string (trimmed) or a number (its JSON text).
fn key_at(value: &Value, path: &[String]) -> Option<SessionKey> {
    let mut value = value;
    for name in path {
        value = value.as_object()?.get(name)?;
    }
    match value {
        Value::String(s) => {
            let trimmed = s.trim_ascii();
            (!trimmed.is_empty()).then(|| SessionKey::from_bytes(trimmed.as_bytes()))
        }
        Value::Number(n) => Some(SessionKey::from_bytes(n.to_string().as_bytes())),
        _ => None,
    }
}

// === the parse ===

/// What the top-level object holds that [`Config::inspect`] needs.
#[derive(Default)]
struct Found {
    /// The values of the key fields' first keys, by their index in `Config::tops`. A key
    /// given twice keeps its last value, as in a parsed `Value`.
    values: Vec<(usize, Value)>,
    /// The last `messages` member, if any.
    messages: Option<Messages>,
}

/// The top-level object: keeps the members named in `tops` and `messages`, skips the rest.
struct TopLevel<'a> {
    tops: &'a [String],
}

impl<'de> Visitor<'de> for TopLevel<'_> {
    type Value = Found;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found, A::Error> {
        let mut found = Found::default();
        while let Some(member) = map.next_key_seed(MemberName { tops: self.tops })? {
            let (top, messages) = match member {
                Member::Other => {
                    map.next_value::<Skip>()?;
                    continue;
                }
                Member::Messages => {
                    found.messages = Some(map.next_value::<Messages>()?);
                    continue;
                }
                Member::Top { index, messages } => (index, messages),
            };
            // A key field's first key: kept whole, as it is small and may be nested.
            let value: Value = map.next_value()?;
            if messages {
                found.messages = Some(Messages::of_value(&value));
            }
            match found.values.iter_mut().find(|(i, _)| *i == top) {
                Some((_, v)) => *v = value,
                None => found.values.push((top, value)),
            }
        }
        Ok(found)
    }
}

/// What a member of the top-level object is to the parse.
enum Member {
    /// The first key of a key field (at this index of `tops`); `messages` if it also is
    /// `"messages"`.
    Top { index: usize, messages: bool },
    /// `"messages"`, not a key field.
    Messages,
    /// Anything else: skipped.
    Other,
}

/// Classifies a member name without keeping it.
struct MemberName<'a> {
    tops: &'a [String],
}

impl<'de> DeserializeSeed<'de> for MemberName<'_> {
    type Value = Member;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Member, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for MemberName<'_> {
    type Value = Member;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_str<E: de::Error>(self, name: &str) -> Result<Member, E> {
        let messages = name == "messages";
        Ok(match self.tops.iter().position(|t| t == name) {
            Some(index) => Member::Top { index, messages },
            None if messages => Member::Messages,
            None => Member::Other,
        })
    }
}

/// The `messages` member: how many entries it has and the leading ones. Anything but an
/// array counts as no messages.
#[derive(Default)]
struct Messages {
    count: usize,
    leading: Vec<Value>,
}

impl Messages {
    fn of_value(value: &Value) -> Self {
        match value {
            Value::Array(all) => Messages {
                count: all.len(),
                leading: all
                    .iter()
                    .take(PromptFacts::LEADING_MESSAGES)
                    .cloned()
                    .collect(),
            },
            _ => Messages::default(),
        }
    }
}

/// Visitor methods for the JSON values a visitor takes in and ignores: scalars and, skipped
/// member by member, objects. The depth limit of `serde_json` applies to them all.
macro_rules! ignore_other_values {
    () => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok(Default::default())
        }

        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }

        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }

        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }

        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok(Default::default())
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Default::default())
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<Skip, Skip>()?.is_some() {}
            Ok(Default::default())
        }
    };
}

impl<'de> Deserialize<'de> for Messages {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(MessagesVisitor)
    }
}

struct MessagesVisitor;

impl<'de> Visitor<'de> for MessagesVisitor {
    type Value = Messages;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Messages, A::Error> {
        let mut messages = Messages::default();
        while messages.count < PromptFacts::LEADING_MESSAGES {
            match seq.next_element::<Value>()? {
                Some(message) => messages.leading.push(message),
                None => return Ok(messages),
            }
            messages.count += 1;
        }
        while seq.next_element::<Skip>()?.is_some() {
            messages.count += 1;
        }
        Ok(messages)
    }

    ignore_other_values!();
}

/// Any JSON value, checked as `serde_json::Value` would be and then forgotten: nothing is
/// built, and strings are borrowed from the body where they have no escapes.
#[derive(Default)]
struct Skip;

impl<'de> Deserialize<'de> for Skip {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(Skip)
    }
}

impl<'de> Visitor<'de> for Skip {
    type Value = Skip;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Skip, A::Error> {
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(Skip)
    }

    ignore_other_values!();
}

// === PromptFacts ===

/// What a [`BodyKey`] learned about a request's prompt, put in the request's extensions for
/// placement policies and metrics to read.
///
/// The digest covers the first [`LEADING_MESSAGES`](Self::LEADING_MESSAGES) entries of an
/// OpenAI-style `messages` array (as re-serialized, so insignificant whitespace does not
/// matter): requests that share it share their system prompt and first message. It is a hint
/// for grouping prefixes, never a session key: the agents of one swarm all share it.
///
/// ```
/// use tower_affinity::key::PromptFacts;
///
/// let body = br#"{"messages":[{"role":"system","content":"be brief"},
///                              {"role":"user","content":"hi"},
///                              {"role":"assistant","content":"hello"}]}"#;
/// let facts = PromptFacts::from_body(body);
/// assert_eq!(facts.body_bytes, body.len());
/// assert_eq!(facts.messages, 3);
/// assert!(facts.leading_digest.is_some());
///
/// let other = PromptFacts::from_body(b"not json");
/// assert_eq!((other.messages, other.leading_digest), (0, None));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PromptFacts {
    /// The size of the request body in bytes.
    pub body_bytes: usize,
    /// How many entries the body's `messages` array has (0 if none).
    pub messages: usize,
    /// The SHA-256 of the leading messages, if the body has any.
    pub leading_digest: Option<[u8; 32]>,
}

impl PromptFacts {
    /// How many messages the digest covers: the system prompt and the first user message.
    pub const LEADING_MESSAGES: usize = 2;

    /// The facts of a whole request body.
    pub fn from_body(body: &[u8]) -> Self {
        Config::new(usize::MAX).inspect(body).1
    }
}

// === BodyKeyLayer ===

/// Buffers each request body (up to a limit), attaches the session key found in its JSON and
/// the body's [`PromptFacts`], and forwards the request with the very bytes the client sent as
/// an [`http_body_util::Full`] body.
///
/// - The key is read from the first of the configured fields that holds a non-blank string or
///   a number: by default `prompt_cache_key`, then `user`, then `metadata.user_id`. It goes
///   into the request's extensions as a [`SessionKey`]; read it with
///   [`ExtensionKey`](super::ExtensionKey), usually behind the headers:
///   `FirstOf::new(HeaderKey::default(), ExtensionKey)`.
/// - A body that is not JSON, or has none of the fields, goes on without a key. The body is
///   parsed once, keeping only the key fields and the leading messages; a request whose
///   headers already name its session can skip the parse ([`skip_when_header`]).
/// - A body over the limit (default [`DEFAULT_LIMIT`](Self::DEFAULT_LIMIT), 16 MiB: long agent
///   prompts run to a few hundred kilobytes) is answered `413 Payload Too Large` with a
///   plain-text reason, from its `Content-Length` before reading when it has one. A body
///   that fails to arrive is answered `400`, or `408` past the [read
///   timeout](Self::read_timeout).
/// - Trailers are dropped: a buffered body has nowhere to carry them.
///
/// Buffering is also what makes a request retryable (see [`RetryOnce`](crate::RetryOnce)).
///
/// [`skip_when_header`]: Self::skip_when_header
///
/// ```
/// use std::time::Duration;
/// use tower::{Layer, ServiceBuilder};
/// use tower_affinity::key::{BodyKeyLayer, ExtensionKey, FirstOf, HeaderKey};
/// use tower_affinity::{discover::StaticFleet, Backend, SessionAffinityLayer};
///
/// # fn backend() -> tower::util::BoxCloneService<http::Request<http_body_util::Full<bytes::Bytes>>, http::Response<String>, std::convert::Infallible> { unimplemented!() }
/// # fn doc() {
/// let fleet = StaticFleet::new([("gpu-0", Backend::new("host-a", backend()))]);
/// let affinity = SessionAffinityLayer::new()
///     .key(FirstOf::new(HeaderKey::default(), ExtensionKey))
///     .layer(fleet);
/// let svc = ServiceBuilder::new()
///     .layer(
///         BodyKeyLayer::new()
///             .limit(4 << 20)
///             .fields(["conversation_id", "user"])
///             .read_timeout(Duration::from_secs(30)),
///     )
///     .service(affinity);
/// # let _ = svc;
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct BodyKeyLayer {
    config: Arc<Config>,
}

impl BodyKeyLayer {
    /// The default body limit: 16 MiB.
    pub const DEFAULT_LIMIT: usize = 16 << 20;

    /// The default fields, tried in order.
    pub const DEFAULT_FIELDS: [&'static str; 3] = ["prompt_cache_key", "user", "metadata.user_id"];

    /// The layer with its defaults: the [default fields](Self::DEFAULT_FIELDS), a 16 MiB limit,
    /// no read timeout.
    ///
    /// ```
    /// use tower_affinity::key::BodyKeyLayer;
    ///
    /// assert_eq!(BodyKeyLayer::DEFAULT_LIMIT, 16 * 1024 * 1024);
    /// assert_eq!(BodyKeyLayer::DEFAULT_FIELDS, ["prompt_cache_key", "user", "metadata.user_id"]);
    /// let layer = BodyKeyLayer::new();
    /// # let _ = layer;
    /// ```
    pub fn new() -> Self {
        BodyKeyLayer {
            config: Arc::new(Config::new(Self::DEFAULT_LIMIT)),
        }
        .fields(Self::DEFAULT_FIELDS)
    }

    /// Sets the largest body buffered, in bytes.
    ///
    /// ```
    /// let layer = tower_affinity::key::BodyKeyLayer::new().limit(1 << 20);
    /// # let _ = layer;
    /// ```
    pub fn limit(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.config).limit = bytes;
        self
    }

    /// Sets the fields that name the session, tried in order. A dot reaches into nested
    /// objects: `metadata.user_id`.
    ///
    /// ```
    /// let layer = tower_affinity::key::BodyKeyLayer::new().fields(["session.id", "user"]);
    /// # let _ = layer;
    /// ```
    pub fn fields<I>(mut self, fields: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        Arc::make_mut(&mut self.config).set_fields(
            fields
                .into_iter()
                .map(|f| f.as_ref().split('.').map(str::to_owned).collect())
                .collect(),
        );
        self
    }

    /// Leaves the body unread when `header` finds a key on the request: such a request gets
    /// neither a [`SessionKey`] nor [`PromptFacts`] from this layer. Its body is still
    /// buffered (the limit and the read timeout still apply) and forwarded unchanged.
    ///
    /// This saves parsing the body when the key is in a header and headers win anyway, as
    /// with `FirstOf::new(HeaderKey::default(), ExtensionKey)` behind the layer. Leave it off
    /// if something behind the layer reads [`PromptFacts`].
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http_body_util::{BodyExt, Full};
    /// use tower::{service_fn, Layer, ServiceExt};
    /// use tower_affinity::key::{BodyKeyLayer, HeaderKey, PromptFacts};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// // Answers whether the body was read.
    /// let svc = BodyKeyLayer::new()
    ///     .skip_when_header(HeaderKey::default())
    ///     .layer(service_fn(|req: http::Request<Full<Bytes>>| async move {
    ///         let read = req.extensions().get::<PromptFacts>().is_some();
    ///         Ok::<_, std::convert::Infallible>(http::Response::new(read.to_string()))
    ///     }));
    /// let body_read = |req: http::request::Builder| {
    ///     let svc = svc.clone();
    ///     async move {
    ///         let req = req.body(Full::new(Bytes::from_static(br#"{"user":"u"}"#))).unwrap();
    ///         let res = svc.oneshot(req).await.unwrap();
    ///         res.into_body().collect().await.unwrap().to_bytes() == "true"
    ///     }
    /// };
    /// let keyed = http::Request::post("/").header("x-session-id", "run-1");
    /// assert!(!body_read(keyed).await); // the header names the session
    /// assert!(body_read(http::Request::post("/")).await);
    /// # }
    /// ```
    pub fn skip_when_header(mut self, header: HeaderKey) -> Self {
        Arc::make_mut(&mut self.config).skip_when = Some(header);
        self
    }

    /// Answers `408 Request Timeout` when the whole body has not arrived within `timeout` of
    /// the call, so a client that trickles its body cannot hold the proxy. Needs tokio's time
    /// driver.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let layer = tower_affinity::key::BodyKeyLayer::new().read_timeout(Duration::from_secs(30));
    /// # let _ = layer;
    /// ```
    pub fn read_timeout(mut self, timeout: Duration) -> Self {
        Arc::make_mut(&mut self.config).read_timeout = Some(timeout);
        self
    }
}

impl Default for BodyKeyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for BodyKeyLayer {
    type Service = BodyKey<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BodyKey {
            inner,
            config: self.config.clone(),
        }
    }
}

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
    inner: S,
    config: Arc<Config>,
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
        // A declared length is a claim, not bytes: reserve a little up front and let the
        // buffer grow as data arrives, so idle clients cannot pin memory by announcing size.
        const UP_FRONT: usize = 64 * 1024;
        let capacity = usize::try_from(declared)
            .unwrap_or(0)
            .min(config.limit)
            .min(UP_FRONT);
        // The timer itself is only set if the body is not all there at the first poll.
        let started = config.read_timeout.map(|_| Instant::now());
        BodyKeyFuture {
            state: State::Reading {
                body,
                buf: Buffer::new(capacity),
                parts: Some(parts),
                service: Some(inner),
                config,
                started,
                deadline: None,
            },
        }
    }
}

// === Buffer ===

/// A request body as it arrives. The first chunk is kept as it came, so a body that arrives
/// in one chunk (most do) is neither copied nor reallocated; later chunks are copied after it.
#[derive(Debug)]
struct Buffer {
    first: Option<Bytes>,
    rest: BytesMut,
    /// What to reserve for `rest` once a second chunk arrives.
    capacity: usize,
}

impl Buffer {
    fn new(capacity: usize) -> Self {
        Buffer {
            first: None,
            rest: BytesMut::new(),
            capacity,
        }
    }

    fn len(&self) -> usize {
        self.first.as_ref().map_or(0, Bytes::len) + self.rest.len()
    }

    fn push(&mut self, mut data: impl Buf) {
        let n = data.remaining();
        if n == 0 {
            return;
        }
        if self.first.is_none() && self.rest.is_empty() {
            // Free for `Bytes` (hyper's chunks): a new handle on the same memory.
            self.first = Some(data.copy_to_bytes(n));
            return;
        }
        if let Some(first) = self.first.take() {
            self.rest.reserve(self.capacity.max(first.len() + n));
            self.rest.put(first);
        }
        self.rest.put(data);
    }

    fn take(&mut self) -> Bytes {
        match self.first.take() {
            Some(first) => first,
            None => std::mem::take(&mut self.rest).freeze(),
        }
    }
}

// === BodyKeyFuture ===

/// Why a request was answered without reaching the inner service.
#[derive(Debug)]
enum Rejection {
    TooLarge(usize),
    Timeout(Duration),
    Read(BoxError),
}

impl Rejection {
    fn into_response<B>(self) -> http::Response<BodyKeyResponseBody<B>> {
        let (status, message) = match self {
            Rejection::TooLarge(limit) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body is larger than the limit of {limit} bytes\n"),
            ),
            Rejection::Timeout(t) => (
                StatusCode::REQUEST_TIMEOUT,
                format!("request body did not arrive within {} s\n", t.as_secs_f64()),
            ),
            Rejection::Read(e) => (
                StatusCode::BAD_REQUEST,
                format!("failed to read the request body: {e}\n"),
            ),
        };
        let mut res = http::Response::new(BodyKeyResponseBody {
            kind: InnerOrBytes::bytes(Bytes::from(message)),
        });
        *res.status_mut() = status;
        res.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        res
    }
}

pin_project! {
    /// The response future of [`BodyKey`]: reads the body, then calls the inner service.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http_body_util::Full;
    /// use tower::Service;
    /// use tower_affinity::key::{BodyKey, BodyKeyFuture};
    ///
    /// fn call<S>(svc: &mut BodyKey<S>, req: http::Request<String>) -> BodyKeyFuture<S, String>
    /// where
    ///     S: Service<http::Request<Full<Bytes>>, Response = http::Response<String>> + Clone,
    /// {
    ///     svc.call(req)
    /// }
    /// # let _ = call::<tower::util::BoxCloneService<http::Request<Full<Bytes>>, http::Response<String>, std::convert::Infallible>>;
    /// ```
    pub struct BodyKeyFuture<S, B>
    where
        S: Service<http::Request<Full<Bytes>>>,
    {
        #[pin]
        state: State<S, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B>
    where
        S: Service<http::Request<Full<Bytes>>>,
    {
        Reading {
            #[pin]
            body: B,
            buf: Buffer,
            parts: Option<http::request::Parts>,
            service: Option<S>,
            config: Arc<Config>,
            // When the call was made, if there is a read timeout.
            started: Option<Instant>,
            // Set at the first poll that finds the body incomplete.
            deadline: Option<Pin<Box<Sleep>>>,
        },
        Calling {
            #[pin]
            fut: Oneshot<S, http::Request<Full<Bytes>>>,
        },
        Rejected {
            rejection: Option<Rejection>,
        },
    }
}

impl<S, B> BodyKeyFuture<S, B>
where
    S: Service<http::Request<Full<Bytes>>>,
{
    fn reject(rejection: Rejection) -> Self {
        BodyKeyFuture {
            state: State::Rejected {
                rejection: Some(rejection),
            },
        }
    }
}

impl<S, B, ResB> Future for BodyKeyFuture<S, B>
where
    S: Service<http::Request<Full<Bytes>>, Response = http::Response<ResB>>,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Output = Result<http::Response<BodyKeyResponseBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Reading {
                    mut body,
                    buf,
                    parts,
                    service,
                    config,
                    started,
                    deadline,
                } => {
                    let rejection = loop {
                        match body.as_mut().poll_frame(cx) {
                            Poll::Ready(Some(Ok(frame))) => {
                                let Ok(data) = frame.into_data() else {
                                    continue;
                                };
                                if buf.len().saturating_add(data.remaining()) > config.limit {
                                    break Some(Rejection::TooLarge(config.limit));
                                }
                                buf.push(data);
                            }
                            Poll::Ready(Some(Err(e))) => break Some(Rejection::Read(e.into())),
                            Poll::Ready(None) => break None,
                            Poll::Pending => {
                                let (Some(timeout), Some(started)) =
                                    (config.read_timeout, *started)
                                else {
                                    return Poll::Pending;
                                };
                                let d = deadline.get_or_insert_with(|| {
                                    Box::pin(match started.checked_add(timeout) {
                                        Some(at) => tokio::time::sleep_until(at),
                                        // Past what the clock can tell: tokio's far future.
                                        None => tokio::time::sleep(timeout),
                                    })
                                });
                                ready!(d.as_mut().poll(cx));
                                break Some(Rejection::Timeout(timeout));
                            }
                        }
                    };
                    if let Some(rejection) = rejection {
                        state.set(State::Rejected {
                            rejection: Some(rejection),
                        });
                        continue;
                    }
                    let (Some(mut parts), Some(service)) = (parts.take(), service.take()) else {
                        panic!("BodyKeyFuture polled after completion");
                    };
                    let bytes = buf.take();
                    if config.reads(&parts.headers) {
                        let (key, facts) = config.inspect(&bytes);
                        if let Some(key) = key {
                            parts.extensions.insert(key);
                        }
                        parts.extensions.insert(facts);
                    }
                    let req = http::Request::from_parts(parts, Full::new(bytes));
                    state.set(State::Calling {
                        fut: Oneshot::new(service, req),
                    });
                }
                StateProj::Calling { fut } => {
                    let res = ready!(fut.poll(cx))?;
                    return Poll::Ready(Ok(res.map(|inner| BodyKeyResponseBody {
                        kind: InnerOrBytes::Inner { inner },
                    })));
                }
                StateProj::Rejected { rejection } => {
                    let Some(rejection) = rejection.take() else {
                        panic!("BodyKeyFuture polled after completion");
                    };
                    return Poll::Ready(Ok(rejection.into_response()));
                }
            }
        }
    }
}

impl<S, B> fmt::Debug for BodyKeyFuture<S, B>
where
    S: Service<http::Request<Full<Bytes>>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Reading { .. } => "reading the body",
            State::Calling { .. } => "calling",
            State::Rejected { .. } => "rejected",
        };
        f.debug_struct("BodyKeyFuture")
            .field("state", &state)
            .finish()
    }
}

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
        kind: InnerOrBytes<B>,
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

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::convert::Infallible;

    use http_body_util::BodyExt;
    use parking_lot::Mutex;
    use tower::{service_fn, ServiceExt};

    use super::*;

    /// A body of the given chunks, with no declared length.
    struct Chunks(VecDeque<Bytes>, bool);

    impl Chunks {
        fn new<const N: usize>(chunks: [&'static [u8]; N]) -> Self {
            Chunks(chunks.into_iter().map(Bytes::from_static).collect(), false)
        }

        /// Never finishes after its chunks.
        fn stalling<const N: usize>(chunks: [&'static [u8]; N]) -> Self {
            Chunks(chunks.into_iter().map(Bytes::from_static).collect(), true)
        }
    }

    impl Body for Chunks {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            match self.0.pop_front() {
                Some(c) => Poll::Ready(Some(Ok(Frame::data(c)))),
                None if self.1 => Poll::Pending,
                None => Poll::Ready(None),
            }
        }
    }

    /// What the inner service saw.
    #[derive(Clone, Debug, Default)]
    struct Seen {
        body: Option<Bytes>,
        key: Option<SessionKey>,
        facts: Option<PromptFacts>,
        headers: Option<http::HeaderMap>,
    }

    async fn run<B>(layer: BodyKeyLayer, req: http::Request<B>) -> (http::Response<String>, Seen)
    where
        B: Body + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let record = seen.clone();
        let inner = service_fn(move |req: http::Request<Full<Bytes>>| {
            let record = record.clone();
            async move {
                let (parts, body) = req.into_parts();
                let body = body.collect().await.unwrap().to_bytes();
                *record.lock() = Seen {
                    body: Some(body),
                    key: parts.extensions.get::<SessionKey>().copied(),
                    facts: parts.extensions.get::<PromptFacts>().copied(),
                    headers: Some(parts.headers),
                };
                Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
            }
        });
        let res = layer.layer(inner).oneshot(req).await.unwrap();
        let (parts, body) = res.into_parts();
        let text = body.collect().await.unwrap().to_bytes();
        let text = String::from_utf8(text.to_vec()).unwrap();
        let seen = seen.lock().clone();
        (http::Response::from_parts(parts, text), seen)
    }

    fn post(body: &'static [u8]) -> http::Request<Full<Bytes>> {
        http::Request::post("/v1/chat/completions")
            .header(header::CONTENT_LENGTH, body.len())
            .body(Full::new(Bytes::from_static(body)))
            .unwrap()
    }

    fn key(raw: &str) -> Option<SessionKey> {
        Some(SessionKey::from_bytes(raw.as_bytes()))
    }

    #[tokio::test]
    async fn prompt_cache_key_is_the_session_key() {
        let (res, seen) = run(
            BodyKeyLayer::new(),
            post(br#"{"prompt_cache_key":"run-1","messages":[]}"#),
        )
        .await;
        assert_eq!(res.status(), 200);
        assert_eq!(seen.key, key("run-1"));
    }

    #[tokio::test]
    async fn fields_are_tried_in_order() {
        let both = br#"{"metadata":{"user_id":"m"},"user":"u","prompt_cache_key":"p"}"#;
        assert_eq!(run(BodyKeyLayer::new(), post(both)).await.1.key, key("p"));
        let user = br#"{"metadata":{"user_id":"m"},"user":"u"}"#;
        assert_eq!(run(BodyKeyLayer::new(), post(user)).await.1.key, key("u"));
        let meta = br#"{"metadata":{"user_id":"m"}}"#;
        assert_eq!(run(BodyKeyLayer::new(), post(meta)).await.1.key, key("m"));
    }

    #[tokio::test]
    async fn blank_strings_and_other_types_fall_through() {
        let body = br#"{"prompt_cache_key":"  ","user":{"id":1},"metadata":{"user_id":"m"}}"#;
        assert_eq!(run(BodyKeyLayer::new(), post(body)).await.1.key, key("m"));
        let none = br#"{"prompt_cache_key":"","user":null,"metadata":[]}"#;
        assert_eq!(run(BodyKeyLayer::new(), post(none)).await.1.key, None);
    }

    #[tokio::test]
    async fn a_number_is_a_key_by_its_text() {
        let body = br#"{"user":42}"#;
        assert_eq!(run(BodyKeyLayer::new(), post(body)).await.1.key, key("42"));
    }

    #[tokio::test]
    async fn a_body_key_equals_the_same_header_key() {
        use crate::key::{HeaderKey, KeyExtractor};
        let req = http::Request::get("/")
            .header("x-session-id", "agent-7")
            .body(())
            .unwrap();
        let body = br#"{"user":"agent-7"}"#;
        assert_eq!(
            run(BodyKeyLayer::new(), post(body)).await.1.key,
            HeaderKey::default().extract(&req)
        );
    }

    #[tokio::test]
    async fn configured_fields_replace_the_defaults() {
        let layer = BodyKeyLayer::new().fields(["conversation.id"]);
        let body = br#"{"user":"u","conversation":{"id":"c"}}"#;
        assert_eq!(run(layer.clone(), post(body)).await.1.key, key("c"));
        assert_eq!(run(layer, post(br#"{"user":"u"}"#)).await.1.key, None);
    }

    #[tokio::test]
    async fn the_body_is_forwarded_byte_for_byte() {
        let body: &[u8] = b" {\"user\" : \"u\",\n \"z\":1, \"a\":[1.50, 2e3]}  ";
        let (_, seen) = run(BodyKeyLayer::new(), post(Box::leak(body.into()))).await;
        assert_eq!(seen.body.as_deref(), Some(body));
        assert_eq!(seen.key, key("u"));
    }

    #[tokio::test]
    async fn a_chunked_body_is_reassembled() {
        let req = http::Request::post("/")
            .body(Chunks::new([b"{\"us", b"er\":\"", b"split\"}"]))
            .unwrap();
        let (_, seen) = run(BodyKeyLayer::new(), req).await;
        assert_eq!(seen.body.as_deref(), Some(&b"{\"user\":\"split\"}"[..]));
        assert_eq!(seen.key, key("split"));
    }

    #[tokio::test]
    async fn non_json_passes_through_keyless_and_untouched() {
        let body: &'static [u8] = b"\x00\xffnot json {\"user\":\"u\"}";
        let req = http::Request::post("/upload")
            .header("content-type", "application/octet-stream")
            .body(Full::new(Bytes::from_static(body)))
            .unwrap();
        let (res, seen) = run(BodyKeyLayer::new(), req).await;
        assert_eq!(res.status(), 200);
        assert_eq!(seen.body.as_deref(), Some(body));
        assert_eq!(seen.key, None);
        assert_eq!(
            seen.headers.unwrap()["content-type"],
            "application/octet-stream"
        );
        let facts = seen.facts.unwrap();
        assert_eq!((facts.body_bytes, facts.messages), (body.len(), 0));
        // Broken JSON is not JSON either.
        let (_, seen) = run(BodyKeyLayer::new(), post(br#"{"user":"u""#)).await;
        assert_eq!(seen.key, None);
    }

    #[tokio::test]
    async fn an_empty_body_passes_through() {
        let (res, seen) = run(BodyKeyLayer::new(), post(b"")).await;
        assert_eq!(res.status(), 200);
        assert_eq!(seen.body.as_deref(), Some(&b""[..]));
    }

    #[tokio::test]
    async fn a_declared_length_over_the_limit_is_413_before_reading() {
        let req = http::Request::post("/")
            .header(header::CONTENT_LENGTH, 11)
            .body(Chunks::stalling([]))
            .unwrap();
        let (res, seen) = run(BodyKeyLayer::new().limit(10), req).await;
        assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert!(res.body().contains("limit of 10 bytes"), "{}", res.body());
        assert_eq!(res.headers()["content-type"], "text/plain; charset=utf-8");
        assert!(seen.body.is_none());
    }

    #[tokio::test]
    async fn a_body_growing_over_the_limit_is_413() {
        let req = http::Request::post("/")
            .body(Chunks::new([b"12345", b"67890", b"1"]))
            .unwrap();
        let (res, seen) = run(BodyKeyLayer::new().limit(10), req).await;
        assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert!(seen.body.is_none());
        // Exactly at the limit is fine.
        let req = http::Request::post("/")
            .body(Chunks::new([b"12345", b"67890"]))
            .unwrap();
        assert_eq!(
            run(BodyKeyLayer::new().limit(10), req).await.0.status(),
            200
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_body_slower_than_the_read_timeout_is_408() {
        let req = http::Request::post("/")
            .body(Chunks::stalling([b"{\"user\""]))
            .unwrap();
        let layer = BodyKeyLayer::new().read_timeout(Duration::from_secs(5));
        let (res, seen) = run(layer, req).await;
        assert_eq!(res.status(), StatusCode::REQUEST_TIMEOUT);
        assert!(seen.body.is_none());
    }

    #[tokio::test]
    async fn prompt_facts_digest_the_leading_two_messages() {
        let turn1 =
            br#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"task"}]}"#;
        let turn2 =
            br#"{"messages": [ {"role":"system","content":"s"}, {"role":"user", "content":"task"},
                         {"role":"assistant","content":"a"}, {"role":"user","content":"more"}]}"#;
        let other =
            br#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"other"}]}"#;
        let f1 = run(BodyKeyLayer::new(), post(turn1)).await.1.facts.unwrap();
        let f2 = run(BodyKeyLayer::new(), post(turn2)).await.1.facts.unwrap();
        let f3 = run(BodyKeyLayer::new(), post(other)).await.1.facts.unwrap();
        assert_eq!((f1.messages, f2.messages), (2, 4));
        assert_eq!(f2.body_bytes, turn2.len());
        assert!(f1.leading_digest.is_some());
        assert_eq!(f1.leading_digest, f2.leading_digest);
        assert_ne!(f1.leading_digest, f3.leading_digest);
    }

    /// The parse before it was made lazy, kept as the reference: a whole `Value`, then the
    /// key fields and the re-serialized leading messages read from it.
    fn reference(fields: &[&str], body: &[u8]) -> (Option<SessionKey>, usize, Option<[u8; 32]>) {
        let Ok(Value::Object(object)) = serde_json::from_slice::<Value>(body) else {
            return (None, 0, None);
        };
        let (mut messages, mut digest) = (0, None);
        if let Some(Value::Array(all)) = object.get("messages") {
            messages = all.len();
            let leading = &all[..all.len().min(PromptFacts::LEADING_MESSAGES)];
            if !leading.is_empty() {
                let bytes = serde_json::to_vec(leading).unwrap();
                digest = Some(Sha256::digest(&bytes).into());
            }
        }
        let key = fields.iter().find_map(|field| {
            let path: Vec<String> = field.split('.').map(str::to_owned).collect();
            let (first, rest) = path.split_first()?;
            key_at(object.get(first)?, rest)
        });
        (key, messages, digest)
    }

    fn config(fields: &[&str]) -> Config {
        let mut config = Config::new(usize::MAX);
        config.set_fields(
            fields
                .iter()
                .map(|f| f.split('.').map(str::to_owned).collect())
                .collect(),
        );
        config
    }

    #[test]
    fn the_lazy_parse_agrees_with_a_whole_value() {
        let deep = |n: usize| format!(r#"{{"user":"u","x":{}{}}}"#, "[".repeat(n), "]".repeat(n));
        let bodies: Vec<Vec<u8>> = [
            r#"{"user":"u","messages":[{"role":"user","content":"hi"}]}"#.to_string(),
            r#"{"messages":[{"content":"a","role":"system"},{"role":"user","content":"b"},3,null]}"#.into(),
            r#"{"messages":[{"z":1.50,"a":2e3,"m":-0,"s":"\u00e9\n"}]}"#.into(),
            r#"{"messages":[],"user":7}"#.into(),
            r#"{"messages":{"0":{}},"user":"u"}"#.into(),
            r#"{"messages":"abc","user":""}"#.into(),
            r#"{"messages":[1],"messages":[2,3]}"#.into(),
            r#"{"messages":[1,2],"messages":5}"#.into(),
            r#"{"user":"a","user":"b"}"#.into(),
            r#"{"user":"a","user":null}"#.into(),
            r#"{"metadata":{"user_id":"m"},"metadata":{"other":1}}"#.into(),
            r#"{"metadata":{"user_id":12.5e1}}"#.into(),
            r#"{"us\u0065r":"escaped name"}"#.into(),
            r#"{"prompt_cache_key":"  p  ","user":"u"}"#.into(),
            r#"{"a":{"b":[true,false,null,{"c":"d"}]},"user":"u"} "#.into(),
            r#"{"user":"u"} trailing"#.into(),
            r#"{"user":"u","n":1e400}"#.into(),
            r#"{"user":"u","n":18446744073709551616}"#.into(),
            r#"{"user":"u","s":"\ud800"}"#.into(),
            r#"{"user":"u","s":"bad \x escape"}"#.into(),
            r#"{"user":"u",}"#.into(),
            r#"{"user":"u""#.into(),
            "{}".into(),
            " \n{\"user\" : \"spaced\"}\n".into(),
            deep(10),
            deep(126),
            deep(127),
            deep(128),
            deep(100_000),
        ]
        .into_iter()
        .map(String::into_bytes)
        .chain([
            b"{\"user\":\"u\",\"s\":\"\xff\"}".to_vec(),
            b"{\"user\":\"u\",\"s\":\"tab\there\"}".to_vec(),
            b"{\"user\":\"\xc3\xa9\"}".to_vec(),
        ])
        .collect();
        let configs: [&[&str]; 4] = [
            &BodyKeyLayer::DEFAULT_FIELDS,
            &["messages", "user"],
            &["messages.0", "a.b"],
            &[],
        ];
        for fields in configs {
            let config = config(fields);
            for body in &bodies {
                let (key, facts) = config.inspect(body);
                let text = String::from_utf8_lossy(&body[..body.len().min(80)]);
                assert_eq!(
                    (key, facts.messages, facts.leading_digest),
                    reference(fields, body),
                    "fields {fields:?}, body {text}"
                );
                assert_eq!(facts.body_bytes, body.len());
            }
        }
    }

    #[test]
    fn the_leading_digest_is_over_the_re_serialized_messages() {
        let body = br#"{"messages":[ {"role":"system", "content":"s"},
                                     {"role":"user","content":"t"}, {"role":"user"}]}"#;
        let facts = PromptFacts::from_body(body);
        let expected: [u8; 32] =
            Sha256::digest(br#"[{"content":"s","role":"system"},{"content":"t","role":"user"}]"#)
                .into();
        assert_eq!(facts.leading_digest, Some(expected));
        assert_eq!(facts.messages, 3);
    }

    fn with_session_header(value: &'static str, body: &'static [u8]) -> http::Request<Full<Bytes>> {
        let mut req = post(body);
        req.headers_mut()
            .insert("x-session-id", HeaderValue::from_static(value));
        req
    }

    #[tokio::test]
    async fn skip_when_header_leaves_a_keyed_body_unread() {
        use crate::key::HeaderKey;
        let layer = BodyKeyLayer::new().skip_when_header(HeaderKey::default());
        let body = br#"{"user":"u","messages":[{"role":"user","content":"hi"}]}"#;
        let (res, seen) = run(layer.clone(), with_session_header("run-1", body)).await;
        assert_eq!(res.status(), 200);
        assert_eq!((seen.key, seen.facts), (None, None));
        assert_eq!(seen.body.as_deref(), Some(&body[..]));
        // A blank header names no session: the body is read.
        let (_, seen) = run(layer.clone(), with_session_header(" ", body)).await;
        assert_eq!(seen.key, key("u"));
        assert_eq!(seen.facts.map(|f| f.messages), Some(1));
        // So is a body without the header.
        let (_, seen) = run(layer, post(body)).await;
        assert_eq!(seen.key, key("u"));
        // Without the option, the body is read whatever the headers say.
        let (_, seen) = run(BodyKeyLayer::new(), with_session_header("run-1", body)).await;
        assert_eq!(seen.key, key("u"));
    }

    #[tokio::test]
    async fn skip_when_header_still_bounds_the_body() {
        use crate::key::HeaderKey;
        let layer = BodyKeyLayer::new()
            .limit(10)
            .skip_when_header(HeaderKey::new(["x-session-id"]));
        let (res, seen) = run(layer, with_session_header("run-1", b"12345678901")).await;
        assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert!(seen.body.is_none());
    }

    #[tokio::test]
    async fn empty_chunks_and_a_single_chunk_are_forwarded_whole() {
        let req = http::Request::post("/")
            .body(Chunks::new([b"", b"{\"user\":\"one\"}", b""]))
            .unwrap();
        let (_, seen) = run(BodyKeyLayer::new(), req).await;
        assert_eq!(seen.body.as_deref(), Some(&b"{\"user\":\"one\"}"[..]));
        assert_eq!(seen.key, key("one"));
        let req = http::Request::post("/")
            .body(Chunks::new([b"", b"{\"user\":", b"", b"\"two\"}"]))
            .unwrap();
        let (_, seen) = run(BodyKeyLayer::new(), req).await;
        assert_eq!(seen.body.as_deref(), Some(&b"{\"user\":\"two\"}"[..]));
        assert_eq!(seen.key, key("two"));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_read_timeout_past_the_clock_never_fires() {
        let layer = BodyKeyLayer::new().read_timeout(Duration::MAX);
        let (res, _) = run(layer.clone(), post(br#"{"user":"u"}"#)).await;
        assert_eq!(res.status(), 200);
        let req = http::Request::post("/")
            .body(Chunks::stalling([b"{"]))
            .unwrap();
        let waited = tokio::time::timeout(Duration::from_secs(365 * 86_400), run(layer, req)).await;
        assert!(waited.is_err(), "still reading a year later");
    }
}
