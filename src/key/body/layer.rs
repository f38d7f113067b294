//! [`BodyKeyLayer`]: the builder.

use std::sync::Arc;
use std::time::Duration;

use tower::Layer;

use super::inspect::Config;
use super::BodyKey;
use crate::key::HeaderKey;

// === BodyKeyLayer ===

/// Buffers each request body (up to a limit), attaches the session key found in its JSON and
/// the body's [`PromptFacts`](crate::key::PromptFacts), and forwards the request with the very bytes the client sent as
/// an [`http_body_util::Full`] body (but for a stream asked for its usage on the client's
/// behalf, with [`ask_stream_usage`](Self::ask_stream_usage) on).
///
/// - The key is read from the first of the configured fields that holds a non-blank string or
///   a number: by default `prompt_cache_key`, then `user`, then `metadata.user_id`. A string
///   counts trimmed of the whitespace around it, a number by its JSON text as `serde_json`
///   writes it, so `"12"`, `" 12 "` and `12` are one key and `12.0` another; where an object
///   names a member twice, the last counts. The key is a digest of that text alone: to key
///   on a field together with a header, see [`KeyExtractor`](crate::key::KeyExtractor). It goes
///   into the request's extensions as a [`SessionKey`](crate::key::SessionKey); read it with
///   [`ExtensionKey`](crate::key::ExtensionKey), usually behind the headers:
///   `FirstOf::new(HeaderKey::default(), ExtensionKey)`.
/// - A body that is not JSON, or has none of the fields, goes on without a key. A UTF-8 byte
///   order mark at the very start of the body is skipped, as llama-server skips it; one
///   anywhere else (after whitespace, or a second one) makes the body no JSON. The body is
///   parsed once (twice if it is not JSON, or if a prompt array holds an item that is neither
///   an object nor an array), keeping only the key fields, the leading messages and the prompt's members,
///   which become the facts' [`PromptChain`](crate::PromptChain): a digest at every message
///   boundary and every [`BLOCK_BYTES`](crate::key::PromptFacts::BLOCK_BYTES) inside a long
///   message, over each message's JSON without the whitespace between its tokens, without
///   Anthropic's `cache_control` markers (clients move those from turn to turn) and without
///   the `cch=` value of Claude Code's billing line (new with every request; llama-server
///   leaves it out too); a message's `content` of one text part is hashed as its text, which
///   chat templates render alike. A member given as a string (`system`, `instructions`,
///   `input`, `prompt`) is hashed as its text, marked so that it shares no digest with an
///   array whose JSON the text spells out, nor with a longer prompt whose message boundaries
///   it spells out. Tokens are estimated at four bytes each and a digit each (tokenizers
///   split numbers into digits, or runs of three; a `\uXXXX` escape's digits aside); a long
///   base64 string or `data:` URI (an image) at 1,024 at most; a `prompt` of token ids (whole
///   numbers, or arrays of them) at a token an id, each run of ids one part cut into blocks:
///
///   | request | the prompt, in order |
///   |---|---|
///   | OpenAI chat, `/v1/chat/completions` | `tools`, then each of `messages` |
///   | Anthropic Messages, `/v1/messages` | `tools`, `system`, then each of `messages` |
///   | OpenAI Responses, `/v1/responses` | `tools`, `instructions`, then `input` (each item) |
///   | legacy completions, `/v1/completions` | `prompt`, as text (each string of an array) or token ids |
///
/// - A Responses request that names `previous_response_id` sends only its new `input`; the
///   server puts the conversation that response ended in front of it. Its chain is the chain
///   of the request that response answered, then its input: the layer reads each Responses
///   answer's id from its first 4 KiB as it passes (the `id` of a JSON answer, or of the
///   `response` in a stream's first event) and remembers, for the latest 4,096, that chain
///   and the backend that answered (a response that a later one continues is forgotten
///   first, so the bound is on conversations, not turns; the chains at most 2^20 links in
///   all, 24 MiB: past that, the chains of responses continued, then the oldest, are
///   dropped first and their responses' backends kept; an
///   answer to a request with `"store": false` is stored nowhere, and not remembered). The
///   request goes to that backend, which alone stores the response (see
///   [`pin_stored_responses`](Self::pin_stored_responses)). A response it never saw (another
///   router process answered it), or whose chain was dropped, leaves the request with an
///   empty chain: its prompt is not known here.
/// - A request whose headers already name its session can skip the parse
///   ([`skip_when_header`]), at the price of its chain: the cache model then learns nothing
///   from it. A Responses request is read all the same while stored responses are pinned,
///   and a body that names its own slot (a top-level `id_slot`) gets facts of that alone.
/// - A body over the limit (default [`DEFAULT_LIMIT`](Self::DEFAULT_LIMIT), 16 MiB: long agent
///   prompts run to a few hundred kilobytes) is answered `413 Payload Too Large` with its
///   reason in a JSON error body ([`Error::json_body`](crate::Error::json_body)), from its
///   `Content-Length` before reading when it has one. A body
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
/// # fn backend() -> tower::util::BoxCloneSyncService<http::Request<http_body_util::Full<bytes::Bytes>>, http::Response<String>, std::convert::Infallible> { unimplemented!() }
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
    pub(super) config: Arc<Config>,
}

impl BodyKeyLayer {
    /// The default body limit: 16 MiB.
    pub const DEFAULT_LIMIT: usize = 16 << 20;

    /// The default fields, tried in order.
    pub const DEFAULT_FIELDS: &'static [&'static str] =
        &["prompt_cache_key", "user", "metadata.user_id"];

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
    /// objects: `metadata.user_id`. A field may start with a member the layer reads for
    /// itself (`stream`, `stream_options`, `store`, `previous_response_id`, `id_slot`): that
    /// member is read all the same. One starting with `model` reads it as a key only (see
    /// [`PromptFacts::model`](crate::key::PromptFacts::model)).
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
    /// neither a [`SessionKey`](crate::key::SessionKey) nor [`PromptFacts`](crate::key::PromptFacts) from this layer. Its body is still
    /// buffered (the limit and the read timeout still apply) and forwarded unchanged. A
    /// Responses API request (a path ending in `/responses`) is read all the same while
    /// [`pin_stored_responses`](Self::pin_stored_responses) is on: it may name a stored
    /// response that only the backend that answered it can continue.
    ///
    /// A body left unread is still searched for `"id_slot"` (and for a `\u00XX` escape of one
    /// of its letters), and one that may name it has its top level parsed (after a leading
    /// byte order mark, as above), other values skipped: a body with a top-level `id_slot`
    /// gets `PromptFacts` saying only that, with an empty chain, so that a router assigning
    /// a llama-server's slots
    /// ([`Backend::assign_slots`](crate::Backend::assign_slots)) gives the request the slot
    /// llama-server runs it in. The search costs every request left unread a pass over its
    /// bytes.
    ///
    /// This saves parsing the body when the key is in a header and headers win anyway, as
    /// with `FirstOf::new(HeaderKey::default(), ExtensionKey)` behind the layer. Leave it off
    /// if something behind the layer reads [`PromptFacts`](crate::key::PromptFacts).
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
    /// driver. (tower-http's `RequestBodyTimeoutLayer` in front of this layer does the same,
    /// but its body error reads here as any failed body: `400`.)
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

    /// Asks a streaming request that did not ask for its usage to carry it, and takes the
    /// usage chunk out of the answer again, so that the service behind can read what the
    /// backend reused (see [`ResponseBody::usage`](crate::ResponseBody::usage)) while the client gets
    /// the stream it asked for. Off by default.
    ///
    /// OpenAI-compatible servers put usage in a stream only when the request says
    /// `"stream_options": {"include_usage": true}`, in a last chunk of its own (`"choices":
    /// []`); vLLM and SGLang send no other figure, and theirs says what they reused only
    /// with `--enable-prompt-tokens-details` (vLLM) or `--enable-cache-report` (SGLang).
    /// llama.cpp puts its `timings` on the last
    /// chunk of every stream, so a fleet of llama-servers does not need this. Turn it on only
    /// for backends that take `stream_options` (OpenAI's API, vLLM, SGLang and llama.cpp
    /// do): one that refused the member would refuse the request.
    ///
    /// - Asked: a request to a path ending in `/completions` (chat or legacy completions)
    ///   whose body is a JSON object with `"stream": true` and no `stream_options` at all. Its
    ///   body gets `"stream_options":{"include_usage":true}` as its first member (and its
    ///   `Content-Length`, if it has one, the new length). A client that gave
    ///   `stream_options`, whatever it says, is left as it is, and so are Anthropic's and the
    ///   Responses API's requests, whose streams carry usage anyway. A body this layer does
    ///   not read ([`skip_when_header`](Self::skip_when_header)) is not asked.
    /// - Taken out, when the answer is an uncompressed `text/event-stream`: the first event
    ///   whose data is a chunk with `"choices": []` and a `usage` object. Its other members
    ///   that the chunk before it lacks are put at the end of that chunk, which is where a
    ///   backend that moves them onto its last chunk had them without usage asked for
    ///   (llama.cpp's `timings`). The chunk finishing a choice is held back until the next
    ///   event for this; every other event passes on as soon as it is whole. The answer's
    ///   `Content-Length`, if it had one, is removed. At most 1 MiB is held back: past it (an
    ///   event that never ends with a blank line of LF or CRLF, as in a stream whose lines
    ///   end with a lone CR), nothing is taken out, and the rest passes as it comes.
    ///
    /// So a client gets the very bytes it would have had without the router from a backend
    /// whose stream with usage is its stream without it plus that chunk, with members moved as
    /// above (llama.cpp, SGLang and vLLM by their sources; OpenAI's own API also writes
    /// `"usage": null` into every other chunk, which is left there). A stream that fails ends
    /// with its error, without the chunk held at that moment.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http_body_util::{BodyExt, Full};
    /// use tower::{service_fn, Layer, ServiceExt};
    /// use tower_affinity::key::BodyKeyLayer;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// // A backend that streams its usage only when asked.
    /// let backend = service_fn(|req: http::Request<Full<Bytes>>| async move {
    ///     let body = req.into_body().collect().await.unwrap().to_bytes();
    ///     let asked = body.starts_with(br#"{"stream_options":{"include_usage":true},"#);
    ///     let mut stream = String::from("data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n");
    ///     if asked {
    ///         stream += "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9}}\n\n";
    ///     }
    ///     stream += "data: [DONE]\n\n";
    ///     let res = http::Response::builder()
    ///         .header("content-type", "text/event-stream")
    ///         .body(stream)
    ///         .unwrap();
    ///     Ok::<_, std::convert::Infallible>(res)
    /// });
    /// let svc = BodyKeyLayer::new().ask_stream_usage(true).layer(backend);
    /// let req = http::Request::post("/v1/chat/completions")
    ///     .body(Full::new(Bytes::from_static(br#"{"stream":true,"messages":[]}"#)))
    ///     .unwrap();
    /// let res = svc.oneshot(req).await.unwrap();
    /// let got = res.into_body().collect().await.unwrap().to_bytes();
    /// // The backend was asked; the client gets the stream it asked for.
    /// assert_eq!(
    ///     got,
    ///     "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n"
    /// );
    /// # }
    /// ```
    pub fn ask_stream_usage(mut self, ask: bool) -> Self {
        Arc::make_mut(&mut self.config).ask_stream_usage = ask;
        self
    }

    /// Whether a request that names a previous response (`previous_response_id`) goes to the
    /// backend that answered that response (default: it does). vLLM keeps stored responses
    /// in its process's memory, so any other backend answers 404: the layer
    /// remembers which backend answered each of the latest responses (from the answer's
    /// [`Decision`](crate::Decision), so the affinity service must keep its
    /// [`decision_extension`](crate::SessionAffinityLayer::decision_extension)) and puts it in
    /// the request's [`PromptFacts::stored_on`](crate::key::PromptFacts::stored_on), which the
    /// service follows whatever its policy. Turn it off when the backends share their stored
    /// responses, to let placement choose freely.
    ///
    /// ```
    /// use tower_affinity::key::BodyKeyLayer;
    ///
    /// // Backends behind a shared response store: any of them can continue a response.
    /// let layer = BodyKeyLayer::new().pin_stored_responses(false);
    /// # let _ = layer;
    /// ```
    pub fn pin_stored_responses(mut self, pin: bool) -> Self {
        Arc::make_mut(&mut self.config).pin_stored_responses = pin;
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
