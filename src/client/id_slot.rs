//! [`IdSlot`]: the slot the router assigned a request to, written into its body as
//! llama-server's `id_slot`.

use std::fmt;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use futures_util::FutureExt;
use http::header::{self, HeaderValue};
use http_body_util::{BodyExt, Full};
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
use tower::{Layer, Service};

use crate::AssignedSlot;

// === IdSlotLayer ===

/// A layer that wraps a backend's service in [`IdSlot`], which sends llama-server the slot
/// the router assigned each request to.
///
/// It goes between the balancer and each llama-server's HTTP client, around the service a
/// [`Backend`](crate::Backend) declared with
/// [`assign_slots`](crate::Backend::assign_slots) is given: the balancer puts the request's
/// [`AssignedSlot`] among its extensions just before it calls that service, so a layer in
/// front of the balancer sees none. In front of the balancer,
/// [`BodyKeyLayer`](crate::key::BodyKeyLayer) reads each request's prompt chain, by which
/// a conversation gets back the slot holding its last prompt, and hands the body on whole,
/// as the `Full<Bytes>` that `IdSlot` rewrites. A proxy of your own, served with hyper or
/// axum:
///
/// ```
/// use std::num::NonZeroU32;
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use tower::{Layer, ServiceBuilder};
/// use tower_affinity::client::{HttpBackend, IdSlotLayer};
/// use tower_affinity::discover::StaticFleet;
/// use tower_affinity::key::BodyKeyLayer;
/// use tower_affinity::{Backend, BoxError, ErrorToResponseLayer, SessionAffinityLayer};
///
/// # fn main() -> Result<(), BoxError> {
/// let http = HttpBackend::<Full<Bytes>>::builder();
/// let slots = NonZeroU32::new(4).unwrap(); // llama-server's `-np 4`
/// let mut fleet = Vec::new();
/// let servers = [
///     ("a1", "node-a", "http://10.0.0.1:8080"),
///     ("b1", "node-b", "http://10.0.0.2:8080"),
/// ];
/// for (id, node, url) in servers {
///     let llama = IdSlotLayer::new().layer(http.build(url)?);
///     fleet.push((id, Backend::new(node, llama).slots(slots).assign_slots()));
/// }
/// let affinity = SessionAffinityLayer::new().layer(StaticFleet::new(fleet));
/// let proxy = ServiceBuilder::new()
///     .layer(BodyKeyLayer::new())
///     .layer(ErrorToResponseLayer::new())
///     .service(affinity);
/// // Serve `proxy` (an `http::Request<hyper::body::Incoming>` service), e.g. with axum's
/// // `Router::new().fallback_service(proxy)` or hyper-util's `TowerToHyperService`.
/// # drop(proxy);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct IdSlotLayer {
    _priv: (),
}

impl IdSlotLayer {
    /// A layer of [`IdSlot`].
    pub fn new() -> Self {
        IdSlotLayer { _priv: () }
    }
}

impl<S> Layer<S> for IdSlotLayer {
    type Service = IdSlot<S>;

    fn layer(&self, inner: S) -> IdSlot<S> {
        IdSlot { inner }
    }
}

// === IdSlot ===

/// A backend's service that sends llama-server the slot the router assigned a request to.
///
/// A request that carries an [`AssignedSlot`] extension and whose body is a JSON object goes
/// on with `"id_slot": N` added as the object's first member, and its `Content-Length` (if
/// it has one) set to the new length. llama-server then gives the request that slot instead
/// of choosing one by prompt similarity; when the slot is busy, the request waits for it
/// (a number past the backend's slots wraps around: llama-server takes it modulo its
/// slots). vLLM and SGLang have no such field: wrap only llama-server backends in it.
///
/// The request goes on as it came when it carries no `AssignedSlot`, when its body is not a
/// JSON object (a leading byte order mark and whitespace aside, which llama-server skips too),
/// when it is in a content coding (a `Content-Encoding` other than `identity`: its bytes are
/// the coding's, whatever they open with), or when the object already has a top-level
/// `id_slot` member: a slot the client chose itself wins. The router assigns such a request
/// the slot it names (queued behind the request on it, if any), or none when `id_slot` names
/// none (see
/// [`Backend::assign_slots`](crate::Backend::assign_slots)), so that what it knows of each
/// slot stays true; `IdSlot` then has a slot to write only where the client wrote the same,
/// modulo the slots. A body whose top level does not
/// parse, which is parsed (its top level only, values skipped) only when it may name
/// `id_slot`, goes on as it came too. The request never fails for this; the response and
/// errors are the inner service's.
///
/// It takes the body the balancer hands its backends behind
/// [`BodyKeyLayer`](crate::key::BodyKeyLayer), a `Full<Bytes>`, already in memory.
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http_body_util::{BodyExt, Full};
/// use tower::{service_fn, ServiceExt};
/// use tower_affinity::client::IdSlot;
/// use tower_affinity::AssignedSlot;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let inner = service_fn(|req: http::Request<Full<Bytes>>| async move {
///     assert_eq!(req.headers()["content-length"], "39");
///     let body = req.into_body().collect().await.unwrap().to_bytes();
///     assert_eq!(body, r#"{"id_slot":1,"model":"m","messages":[]}"#);
///     Ok::<_, Infallible>(http::Response::new(()))
/// });
/// let body = r#"{"model":"m","messages":[]}"#;
/// let mut req = http::Request::post("/v1/chat/completions")
///     .header("content-length", body.len())
///     .body(Full::new(Bytes::from(body)))
///     .unwrap();
/// // The router puts it there on a backend that assigns slots.
/// req.extensions_mut().insert(AssignedSlot::new(1));
/// IdSlot::new(inner).oneshot(req).await.unwrap();
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct IdSlot<S> {
    inner: S,
}

impl<S> IdSlot<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        IdSlot { inner }
    }

    /// A layer that wraps services in `IdSlot`.
    pub fn layer() -> IdSlotLayer {
        IdSlotLayer::new()
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

impl<S> Service<http::Request<Full<Bytes>>> for IdSlot<S>
where
    S: Service<http::Request<Full<Bytes>>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Full<Bytes>>) -> Self::Future {
        self.inner.call(write_id_slot(req))
    }
}

// === the rewrite ===

/// What [`IdSlot`] does to a request, for a backend service of your own that cannot be
/// wrapped: the request with its [`AssignedSlot`] written into its JSON body as
/// `"id_slot": N` (and its `Content-Length` to match), or as it came (see [`IdSlot`] for
/// when).
///
/// ```
/// use bytes::Bytes;
/// use http_body_util::{BodyExt, Full};
/// use tower_affinity::client::write_id_slot;
/// use tower_affinity::AssignedSlot;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let mut req = http::Request::new(Full::new(Bytes::from_static(br#"{"messages":[]}"#)));
/// req.extensions_mut().insert(AssignedSlot::new(1));
/// let body = write_id_slot(req).into_body().collect().await.unwrap().to_bytes();
/// assert_eq!(body, r#"{"id_slot":1,"messages":[]}"#);
/// # }
/// ```
pub fn write_id_slot(req: http::Request<Full<Bytes>>) -> http::Request<Full<Bytes>> {
    let Some(slot) = req.extensions().get::<AssignedSlot>().copied() else {
        return req;
    };
    if crate::slots::is_coded(req.headers()) {
        return req;
    }
    let (mut parts, body) = req.into_parts();
    let bytes = into_bytes(body);
    let body = match insert_id_slot(&bytes, slot.index()) {
        Some(rewritten) => {
            if parts.headers.contains_key(header::CONTENT_LENGTH) {
                parts
                    .headers
                    .insert(header::CONTENT_LENGTH, HeaderValue::from(rewritten.len()));
            }
            rewritten
        }
        None => bytes,
    };
    http::Request::from_parts(parts, Full::new(body))
}

/// A `Full` body's bytes: its one frame is ready at once, so no executor is needed.
fn into_bytes(mut body: Full<Bytes>) -> Bytes {
    match body.frame().now_or_never() {
        Some(Some(Ok(frame))) => frame.into_data().unwrap_or_default(),
        // An empty `Full` ends at once; it never errs, nor waits.
        _ => Bytes::new(),
    }
}

/// JSON's insignificant whitespace.
fn is_json_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// `body` with `"id_slot":slot` as its object's first member, or `None` to send it as it
/// came: not an object, or one whose top level names `id_slot` already, or may and does not
/// parse.
fn insert_id_slot(body: &[u8], slot: u32) -> Option<Bytes> {
    // A body that opens with a byte order mark is one llama-server reads, and runs in the
    // slot it names: the mark stays, and the object after it is looked for as after none.
    let from = body.len() - crate::slots::after_bom(body).len();
    let open = from + body[from..].iter().position(|&b| !is_json_space(b))?;
    if body[open] != b'{' {
        return None;
    }
    let after = &body[open + 1..];
    // An object's next token is its first member's key or its end; anything else is no
    // JSON object, which is not ours to touch.
    let comma = match after.iter().find(|&&b| !is_json_space(b))? {
        b'"' => ",",
        b'}' => "",
        _ => return None,
    };
    if crate::slots::may_name_id_slot(body) && !top_level_lacks_id_slot(&body[from..]) {
        return None;
    }
    let member = format!("\"id_slot\":{slot}{comma}");
    let mut out = BytesMut::with_capacity(body.len() + member.len());
    out.put_slice(&body[..=open]);
    out.put_slice(member.as_bytes());
    out.put_slice(after);
    Some(out.freeze())
}

/// Whether `body` parses as a JSON object none of whose top-level keys is `id_slot`. Values
/// are skipped, not built; the parse stops at the first `id_slot` key.
fn top_level_lacks_id_slot(body: &[u8]) -> bool {
    serde_json::from_slice::<LacksIdSlot>(body).is_ok()
}

/// A JSON object without a top-level `id_slot`: anything else fails to deserialize.
struct LacksIdSlot;

impl<'de> Deserialize<'de> for LacksIdSlot {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(LacksIdSlot)
    }
}

impl<'de> Visitor<'de> for LacksIdSlot {
    type Value = LacksIdSlot;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object without an `id_slot` member")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        // Keys come unescaped; a body reaches here only when it may name `id_slot`, so the
        // key's allocation is rare.
        while let Some(key) = map.next_key::<String>()? {
            if key == "id_slot" {
                return Err(de::Error::custom("the object has an `id_slot` member"));
            }
            map.next_value::<IgnoredAny>()?;
        }
        Ok(LacksIdSlot)
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http_body_util::BodyExt;
    use parking_lot::Mutex;
    use std::sync::Arc;
    use tower::{service_fn, ServiceExt};

    use super::*;

    /// What the inner service saw of one request.
    type SeenRequest = (http::HeaderMap, Bytes);

    /// Sends `body` through `IdSlot`, with `slot` assigned and a `Content-Length` if
    /// `length`, and says what the inner service got.
    async fn send(body: &'static str, slot: Option<u32>, length: bool) -> SeenRequest {
        let mut req = http::Request::post("/v1/chat/completions");
        if length {
            req = req.header(header::CONTENT_LENGTH, body.len());
        }
        let mut req = req
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap();
        if let Some(slot) = slot {
            req.extensions_mut().insert(AssignedSlot::new(slot));
        }
        send_request(req).await
    }

    /// Sends `req` through `IdSlot`, and says what the inner service got.
    async fn send_request(req: http::Request<Full<Bytes>>) -> SeenRequest {
        let seen = Arc::new(Mutex::new(None));
        let inner = {
            let seen = seen.clone();
            service_fn(move |req: http::Request<Full<Bytes>>| {
                let seen = seen.clone();
                async move {
                    let (parts, body) = req.into_parts();
                    let bytes = body.collect().await.unwrap().to_bytes();
                    *seen.lock() = Some((parts.headers, bytes));
                    Ok::<_, Infallible>(http::Response::new("answer"))
                }
            })
        };
        let res = IdSlot::new(inner).oneshot(req).await.unwrap();
        assert_eq!(res.into_body(), "answer");
        let seen = seen.lock().take();
        seen.expect("the inner service was called")
    }

    async fn body_sent(body: &'static str, slot: u32) -> Bytes {
        send(body, Some(slot), false).await.1
    }

    /// An inner service that is as ready as it is told.
    struct Readiness(Poll<Result<(), &'static str>>);

    impl Service<http::Request<Full<Bytes>>> for Readiness {
        type Response = ();
        type Error = &'static str;
        type Future = std::future::Ready<Result<(), &'static str>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            self.0
        }

        fn call(&mut self, _: http::Request<Full<Bytes>>) -> Self::Future {
            std::future::ready(Ok(()))
        }
    }

    #[test]
    fn id_slot_is_ready_only_when_its_inner_service_is() {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        for inner in [Poll::Pending, Poll::Ready(Err("gone")), Poll::Ready(Ok(()))] {
            let mut svc = IdSlot::new(Readiness(inner));
            assert_eq!(svc.poll_ready(&mut cx), inner);
        }
    }

    #[tokio::test]
    async fn an_object_with_members_gets_id_slot_first() {
        let sent = body_sent(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            3,
        );
        assert_eq!(
            sent.await,
            r#"{"id_slot":3,"model":"m","messages":[{"role":"user","content":"hi"}]}"#
        );
    }

    #[tokio::test]
    async fn an_empty_object_gets_id_slot_without_a_comma() {
        assert_eq!(body_sent("{}", 0).await, r#"{"id_slot":0}"#);
        assert_eq!(body_sent("{ \n}", 7).await, "{\"id_slot\":7 \n}");
    }

    #[tokio::test]
    async fn leading_whitespace_is_kept_and_the_object_still_found() {
        assert_eq!(
            body_sent(" \r\n\t{ \"n\":1}", 2).await,
            " \r\n\t{\"id_slot\":2, \"n\":1}"
        );
    }

    #[tokio::test]
    async fn a_body_after_a_byte_order_mark_gets_id_slot_as_llama_server_reads_it() {
        assert_eq!(
            body_sent("\u{feff}{\"n\":1}", 2).await,
            "\u{feff}{\"id_slot\":2,\"n\":1}"
        );
        assert_eq!(
            body_sent("\u{feff} \n{}", 2).await,
            "\u{feff} \n{\"id_slot\":2}"
        );
        // Its own `id_slot` is still found.
        let own = "\u{feff}{\"id_slot\":1,\"n\":1}";
        assert_eq!(body_sent(own, 2).await, own);
    }

    #[tokio::test]
    async fn a_top_level_id_slot_of_the_client_wins() {
        for body in [
            r#"{"model":"m","id_slot":1}"#,
            r#"{"id_slot":-1,"messages":[]}"#,
            r#"{ "id_slot" : 0 }"#,
            // Escaped, it is the same key.
            r#"{"model":"m","id\u005fslot":1}"#,
            r#"{"\u0069\u0064_slot":1,"n":2}"#,
        ] {
            assert_eq!(body_sent(body, 4).await, body, "{body}");
        }
        // Beside it, a slot is added.
        assert_eq!(
            body_sent(r#"{"model":"m","slot":1}"#, 4).await,
            r#"{"id_slot":4,"model":"m","slot":1}"#
        );
    }

    #[tokio::test]
    async fn id_slot_in_a_string_or_a_nested_object_is_not_the_clients_choice() {
        assert_eq!(
            body_sent(
                r#"{"messages":[{"role":"user","content":"set \"id_slot\": 1"}]}"#,
                5
            )
            .await,
            r#"{"id_slot":5,"messages":[{"role":"user","content":"set \"id_slot\": 1"}]}"#
        );
        assert_eq!(
            body_sent(r#"{"messages":[{"role":"user","content":"id_slot"}]}"#, 5).await,
            r#"{"id_slot":5,"messages":[{"role":"user","content":"id_slot"}]}"#
        );
        assert_eq!(
            body_sent(r#"{"metadata":{"id_slot":1},"n":1}"#, 5).await,
            r#"{"id_slot":5,"metadata":{"id_slot":1},"n":1}"#
        );
        assert_eq!(
            body_sent(r#"{"prompt":"\u00e9\u0069","n":1}"#, 5).await,
            r#"{"id_slot":5,"prompt":"\u00e9\u0069","n":1}"#
        );
        assert_eq!(
            body_sent(r#"{"messages":[],"xid_slot":1,"id_slots":2}"#, 5).await,
            r#"{"id_slot":5,"messages":[],"xid_slot":1,"id_slots":2}"#
        );
    }

    #[tokio::test]
    async fn a_body_that_is_no_json_object_goes_as_it_came() {
        for body in [
            r#"[{"model":"m"}]"#,
            "model=m&n=1",
            "",
            "   ",
            "{",
            "{x}",
            "\"id_slot\"",
            // A byte order mark after whitespace, which llama-server refuses.
            " \u{feff}{\"n\":1}",
            // Unreadable where it may name `id_slot`: not ours to fix.
            r#"{"id_slot":}"#,
            r#"{"n":1,"id\u005fslot"#,
        ] {
            let (headers, sent) = send(body, Some(1), true).await;
            assert_eq!(sent, body, "{body:?}");
            assert_eq!(headers[header::CONTENT_LENGTH], body.len().to_string());
        }
        // Beside it, a slot is added.
        assert_eq!(body_sent(r#"{"n":1}"#, 1).await, r#"{"id_slot":1,"n":1}"#);
    }

    #[tokio::test]
    async fn a_request_without_an_assigned_slot_goes_as_it_came() {
        let body = r#"{"model":"m","messages":[]}"#;
        let (headers, sent) = send(body, None, true).await;
        assert_eq!(sent, body);
        assert_eq!(headers[header::CONTENT_LENGTH], body.len().to_string());
        // Beside it, a slot is added.
        let (_, sent) = send(body, Some(0), true).await;
        assert_eq!(sent, r#"{"id_slot":0,"model":"m","messages":[]}"#);
    }

    #[tokio::test]
    async fn a_body_in_a_content_coding_goes_as_it_came() {
        async fn sent(coding: &'static str) -> Bytes {
            let mut req = http::Request::post("/v1/chat/completions")
                .header(header::CONTENT_ENCODING, coding)
                .body(Full::new(Bytes::from_static(br#"{"n":1}"#)))
                .unwrap();
            req.extensions_mut().insert(AssignedSlot::new(2));
            send_request(req).await.1
        }
        // Bytes that open like a JSON object are the coding's all the same.
        for coding in ["br", "gzip", "identity, gzip", " Deflate "] {
            assert_eq!(sent(coding).await, r#"{"n":1}"#, "{coding}");
        }
        // Beside them, `identity` is no coding.
        for coding in ["identity", "IDENTITY", ""] {
            assert_eq!(sent(coding).await, r#"{"id_slot":2,"n":1}"#, "{coding:?}");
        }
    }

    #[tokio::test]
    async fn content_length_follows_the_new_body() {
        let body = r#"{"model":"m","messages":[]}"#;
        let (headers, sent) = send(body, Some(12), true).await;
        assert_eq!(sent, r#"{"id_slot":12,"model":"m","messages":[]}"#);
        assert_eq!(headers[header::CONTENT_LENGTH], sent.len().to_string());

        // None is made up where there was none.
        let (headers, sent) = send(body, Some(12), false).await;
        assert_eq!(sent, r#"{"id_slot":12,"model":"m","messages":[]}"#);
        assert!(!headers.contains_key(header::CONTENT_LENGTH));
    }

    #[tokio::test]
    async fn the_largest_slot_number_is_written_whole() {
        assert_eq!(
            body_sent(r#"{"n":1}"#, u32::MAX).await,
            r#"{"id_slot":4294967295,"n":1}"#
        );
    }

    #[test]
    fn a_deeply_nested_body_is_left_alone_without_overflowing() {
        let mut body = String::from(r#"{"a":"#);
        body.push_str(&"[".repeat(100_000));
        body.push_str(r#""id_slot""#);
        assert_eq!(insert_id_slot(body.as_bytes(), 0), None);
        // Beside it, a slot is added.
        let shallow = insert_id_slot(br#"{"a":[["id_slot"]]}"#, 0);
        assert_eq!(
            shallow.as_deref(),
            Some(&br#"{"id_slot":0,"a":[["id_slot"]]}"#[..])
        );
    }

    /// `write_id_slot` over any body: arbitrary bytes, and JSON of every shape written every
    /// way JSON allows (keys with escapes, duplicate keys, huge numbers, whitespace), whole
    /// or cut short, after a byte order mark or not.
    mod properties {
        use std::collections::BTreeMap;

        use proptest::collection::vec;
        use proptest::prelude::*;
        use proptest::sample::select;
        use serde_json::value::RawValue;

        use super::*;

        /// A JSON value, to be written out with the liberties JSON allows.
        #[derive(Clone, Debug)]
        enum Json {
            Literal(&'static str),
            Str(String),
            Arr(Vec<Json>),
            Obj(Vec<(String, Json)>),
        }

        /// JSON's literals, and numbers, some of which no 64-bit float or integer holds.
        const LITERALS: &[&str] = &[
            "null",
            "true",
            "false",
            "0",
            "-0",
            "-1",
            "1.5",
            "1e400",
            "-1e-400",
            "123456789012345678901234567890123456789",
        ];

        const STRINGS: &[&str] = &[
            "",
            "id_slot",
            "\"id_slot\": 1",
            "data: [DONE]",
            "\\",
            "\"",
            "é",
            "\u{0}",
            "\u{feff}",
            "\n",
            "{",
        ];

        const KEYS: &[&str] = &[
            "id_slot", "model", "messages", "n", "id_slots", "xid_slot", "", "Id_slot",
        ];

        fn json() -> impl Strategy<Value = Json> {
            let leaf = prop_oneof![
                select(LITERALS).prop_map(Json::Literal),
                select(STRINGS).prop_map(|s| Json::Str(s.to_string())),
                any::<String>().prop_map(Json::Str),
            ];
            leaf.prop_recursive(4, 24, 5, |inner| {
                let key = prop_oneof![
                    4 => select(KEYS).prop_map(str::to_string),
                    1 => any::<String>(),
                ];
                prop_oneof![
                    vec(inner.clone(), 0..4).prop_map(Json::Arr),
                    vec((key, inner), 0..5).prop_map(Json::Obj),
                ]
            })
        }

        /// Writes `s` as a JSON string, escaping each character as `\uXXXX` where `escape`
        /// says (cycled), else only where JSON must.
        fn write_str(out: &mut String, s: &str, escape: &[bool]) {
            out.push('"');
            for (i, c) in s.chars().enumerate() {
                let forced = c == '"' || c == '\\' || (c as u32) < 0x20;
                let chosen = !escape.is_empty() && escape[i % escape.len()];
                // What JSON must escape is in the Basic Multilingual Plane, as `\uXXXX` is.
                if forced || (chosen && (c as u32) < 0x10000) {
                    out.push_str(&format!("\\u{:04x}", c as u32));
                } else {
                    out.push(c);
                }
            }
            out.push('"');
        }

        /// Writes `j` with `space` (cycled) between its tokens, and keys escaped by `escape`.
        fn write(out: &mut String, j: &Json, space: &[&str], escape: &[bool], at: &mut usize) {
            let ws = |out: &mut String, at: &mut usize| {
                if !space.is_empty() {
                    out.push_str(space[*at % space.len()]);
                    *at += 1;
                }
            };
            match j {
                Json::Literal(l) => out.push_str(l),
                Json::Str(s) => write_str(out, s, &[]),
                Json::Arr(items) => {
                    out.push('[');
                    for (i, item) in items.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        ws(out, at);
                        write(out, item, space, escape, at);
                    }
                    ws(out, at);
                    out.push(']');
                }
                Json::Obj(members) => {
                    out.push('{');
                    for (i, (key, value)) in members.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        ws(out, at);
                        write_str(out, key, escape);
                        ws(out, at);
                        out.push(':');
                        ws(out, at);
                        write(out, value, space, escape, at);
                    }
                    ws(out, at);
                    out.push('}');
                }
            }
        }

        /// What a body is: its top-level members (each value as written; a duplicate key's
        /// last), if it is a JSON object after a byte order mark llama-server skips; `Err` if
        /// it is JSON of another kind; `Ok(None)` if it is no JSON.
        fn members(body: &[u8]) -> Result<Option<BTreeMap<String, String>>, ()> {
            let body = body.strip_prefix(b"\xef\xbb\xbf").unwrap_or(body);
            if let Ok(map) = serde_json::from_slice::<BTreeMap<String, Box<RawValue>>>(body) {
                let map = map.into_iter().map(|(k, v)| (k, v.get().to_string()));
                return Ok(Some(map.collect()));
            }
            match serde_json::from_slice::<IgnoredAny>(body) {
                Ok(_) => Err(()),
                Err(_) => Ok(None),
            }
        }

        /// Sends `body` through `write_id_slot` with `slot` assigned and its length declared,
        /// and checks what comes out.
        fn check(body: &[u8], slot: u32) -> Result<(), TestCaseError> {
            let mut req = http::Request::post("/v1/chat/completions")
                .header(header::CONTENT_LENGTH, body.len())
                .body(Full::new(Bytes::copy_from_slice(body)))
                .unwrap();
            req.extensions_mut().insert(AssignedSlot::new(slot));
            let (parts, out) = write_id_slot(req).into_parts();
            let out = into_bytes(out);
            prop_assert_eq!(
                &parts.headers[header::CONTENT_LENGTH],
                &out.len().to_string()
            );
            match members(body) {
                Ok(Some(before)) if !before.contains_key("id_slot") => {
                    let Ok(Some(mut after)) = members(&out) else {
                        return Err(TestCaseError::fail(format!("no JSON object: {out:?}")));
                    };
                    prop_assert_eq!(after.remove("id_slot"), Some(slot.to_string()));
                    prop_assert_eq!(&after, &before);
                    // Only the member is added, first: the rest goes byte for byte.
                    let at = body.iter().position(|&b| b == b'{').unwrap();
                    let comma = if before.is_empty() { "" } else { "," };
                    let member = format!("\"id_slot\":{slot}{comma}");
                    let want = [&body[..=at], member.as_bytes(), &body[at + 1..]].concat();
                    prop_assert_eq!(&out[..], &want[..]);
                }
                // Another kind of JSON, or an object with an `id_slot` of its own.
                Ok(Some(_)) | Err(()) => prop_assert_eq!(&out[..], body),
                // No JSON: it may gain the member (it is only parsed if it may name
                // `id_slot`), but stays no JSON, for the backend to refuse as it would have.
                Ok(None) => prop_assert!(out == body || matches!(members(&out), Ok(None))),
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(3000))]

            #[test]
            fn json_of_any_shape_gets_id_slot_only_where_its_top_level_lacks_one(
                j in json(),
                top in vec((select(&["id_slot", "model", "n", "Id_slot"][..]), json()), 0..4),
                space in vec(select(&["", " ", "\n\t ", "\r\n"][..]), 0..4),
                escape in vec(any::<bool>(), 0..4),
                lead in select(&["", " ", "\u{feff}", "\u{feff} \n", " \u{feff}"][..]),
                trail in select(&["", " \n", "x", "}", ",", "{\"id_slot\":1}"][..]),
                cut in any::<Option<prop::sample::Index>>(),
                slot in prop_oneof![Just(0u32), Just(u32::MAX), any::<u32>()],
            ) {
                // The value itself, or an object of members around it.
                let j = match top.is_empty() {
                    true => j,
                    false => Json::Obj(
                        top.into_iter().map(|(k, v)| (k.to_string(), v)).chain([("v".into(), j)])
                            .collect(),
                    ),
                };
                let mut text = String::from(lead);
                write(&mut text, &j, &space, &escape, &mut 0);
                text.push_str(trail);
                let mut body = text.into_bytes();
                if let Some(cut) = cut {
                    body.truncate(cut.index(body.len() + 1));
                }
                check(&body, slot)?;
            }

            #[test]
            fn any_bytes_go_through_without_a_panic(
                body in prop_oneof![
                    vec(any::<u8>(), 0..64),
                    vec(select(&b"{}[]\":,\\u005fidslot 0\n\xef\xbb\xbf"[..]), 0..48),
                ],
                slot in any::<u32>(),
            ) {
                check(&body, slot)?;
            }
        }
    }
}
