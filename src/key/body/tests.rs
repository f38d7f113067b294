use std::collections::VecDeque;
use std::convert::Infallible;

use http_body_util::BodyExt;
use parking_lot::Mutex;
use tower::{service_fn, ServiceExt};

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, StatusCode};
use http_body::{Body, Frame};
use http_body_util::Full;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tower::Layer;

use super::inspect::{key_at, Config};
use super::*;
use crate::key::SessionKey;
use crate::BoxError;

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
                facts: parts.extensions.get::<PromptFacts>().cloned(),
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
async fn a_keys_text_is_trimmed_a_numbers_is_its_json_and_a_repeated_member_counts_last() {
    for body in [
        &br#"{"user":"12"}"#[..],
        br#"{"user":" 12 "}"#,
        br#"{"user":12}"#,
        br#"{"user":"x","user":12}"#,
        br#"{"metadata":{"user_id":"x","user_id":"12"}}"#,
    ] {
        let got = run(BodyKeyLayer::new(), post(Box::leak(body.into())))
            .await
            .1
            .key;
        assert_eq!(got, key("12"), "{}", String::from_utf8_lossy(body));
    }
    let float = run(BodyKeyLayer::new(), post(br#"{"user":12.0}"#))
        .await
        .1
        .key;
    assert_eq!(float, key("12.0"));
    // A dotted name reaches into objects; a member whose own name has a dot is not read.
    let dotted = br#"{"metadata.user_id":"m"}"#;
    assert_eq!(run(BodyKeyLayer::new(), post(dotted)).await.1.key, None);
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
    assert_eq!(res.headers()["content-type"], "application/json");
    let body: serde_json::Value = serde_json::from_str(res.body()).unwrap();
    assert_eq!(body["error"]["code"], 413);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("limit of 10 bytes"), "{message}");
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

#[tokio::test]
async fn a_body_over_a_limit_outside_the_layer_is_413_not_400() {
    // As tower-http's `RequestBodyLimitLayer` wraps a body without a `Content-Length`.
    let body = http_body_util::Limited::new(Chunks::new([b"12345", b"67890"]), 8);
    let (res, seen) = run(
        BodyKeyLayer::new(),
        http::Request::post("/").body(body).unwrap(),
    )
    .await;
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(seen.body.is_none());
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
    assert!(f1.leading_digest().is_some());
    assert_eq!(f1.leading_digest(), f2.leading_digest());
    assert_ne!(f1.leading_digest(), f3.leading_digest());
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
        r#"{"messages":[{"content":"a","role":"system"},{"role":"user","content":"b"},3,null]}"#
            .into(),
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
        r#"{"metadata":{"user_id":-0}}"#.into(),
        r#"{"metadata":{"user_id":-17,"x":[1,{"user_id":"no"}]}}"#.into(),
        r#"{"metadata":{"user_id":1e2},"user":18446744073709551615}"#.into(),
        r#"{"metadata":{"user_id":"a","user_id":{"b":1}}}"#.into(),
        r#"{"metadata":{"user_id":{"b":1},"user_id":" c "}}"#.into(),
        r#"{"metadata":{"user_id":"a","user_id":[]},"user":"u"}"#.into(),
        r#"{"metadata":[{"user_id":"in an array"}],"user":[0,0,"x"]}"#.into(),
        r#"{"metadata":{"us\u0065r_id":"escaped","user_id":"\t"}}"#.into(),
        r#"{"metadata":{"user_id":"m","n":1e400}}"#.into(),
        r#"{"metadata":{"user_id":"m","s":"\udc00"}}"#.into(),
        r#"{"metadata":"m","user":{"id":"u"}}"#.into(),
        r#"{"a":{"b":{"a":{"b":"deep"}},"b":"ab"}}"#.into(),
        r#"{"a":{"b":"first"},"a":{"c":"second"}}"#.into(),
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
    let configs: [&[&str]; 6] = [
        BodyKeyLayer::DEFAULT_FIELDS,
        &["messages", "user"],
        &["messages.0", "a.b"],
        &[
            "metadata.user_id.b",
            "a",
            "a.b.a.b",
            "metadata",
            "metadata.user_id",
            "a.c",
        ],
        &["user.id", "user"],
        &[],
    ];
    for fields in configs {
        let config = config(fields);
        for body in &bodies {
            let (key, facts) = config.inspect(body);
            let text = String::from_utf8_lossy(&body[..body.len().min(80)]);
            assert_eq!(
                (key, facts.messages, facts.leading_digest()),
                reference(fields, body),
                "fields {fields:?}, body {text}"
            );
            assert_eq!(facts.body_bytes, body.len());
        }
    }
}

/// `{"<part>":[items...]}`, the items joined by `sep`.
fn array_body(part: &str, items: impl Iterator<Item = String>, sep: &str) -> Vec<u8> {
    let items: Vec<String> = items.collect();
    format!(
        r#"{{"model":"m", "{part}" : [ {} ] , "user":"u"}}"#,
        items.join(sep)
    )
    .into_bytes()
}

/// A message of a mix of shapes: objects, arrays, a one-part content, a cache mark, escapes,
/// whitespace.
fn mixed_message(i: usize) -> String {
    match i % 5 {
        0 => format!(r#"{{"role":"user","content":"m{i} \"q\" \u00e9"}}"#),
        1 => format!(r#"[ "m" , {i} , {{"k" : [{i}, {{"cache_control":{{}}}}]}} ]"#),
        2 => format!(
            r#"{{ "role" : "assistant" , "content" : [ {{"type":"text","text":"m{i}","cache_control":{{"type":"ephemeral"}}}} ] }}"#
        ),
        3 => "{}".into(),
        _ => "[]".into(),
    }
}

/// An object item of `n` members, a cache mark and a one-part content among them.
fn wide_object(n: usize) -> String {
    let mut members: Vec<String> = (0..n).map(|j| format!(r#""k{j}" : [{j}]"#)).collect();
    members.insert(n / 2, r#""cache_control":{"type":"ephemeral"}"#.into());
    members.push(r#""content":[{"type":"text","text":"wide"}]"#.into());
    format!("{{ {} }}", members.join(" ,\n "))
}

/// An array item of `n` elements.
fn wide_array(n: usize) -> String {
    let elements: Vec<String> = (0..n).map(|j| format!(r#"{{"e":{j}}}"#)).collect();
    format!("[\t{}\t]", elements.join(" , "))
}

#[test]
fn arrays_past_the_bound_on_what_is_kept_give_the_chain_of_all_kept() {
    // Items kept whole once their members pass the bound, and items past it cut from the
    // body: every chain as the reference's, which keeps every item whole.
    let bodies = [
        array_body("messages", (0..20_000).map(mixed_message), ","),
        array_body("messages", (0..20_000).map(mixed_message), " ,\n\t"),
        array_body(
            "messages",
            [wide_object(5_000), wide_array(5_000), mixed_message(2)]
                .into_iter()
                .chain((0..3).map(|_| wide_object(3_000))),
            ",",
        ),
        array_body(
            "input",
            (0..4)
                .map(wide_array)
                .chain([wide_array(20_000), "{}".into()]),
            "\n,",
        ),
        array_body("messages", (0..30_000).map(|_| "[]".to_string()), ","),
        array_body("prompt", (0..30_000).map(|i| format!("{i}")), ", "),
        array_body("prompt", (0..30_000).map(|i| format!(r#""p{i}""#)), ","),
        array_body(
            "tools",
            (0..10_000).map(|i| format!(r#"{{"type":"function","name":"f{i}"}}"#)),
            ",",
        ),
        // An item neither an object nor an array: read again with items whole, past the
        // bound too.
        array_body(
            "messages",
            (0..20_000)
                .map(mixed_message)
                .chain(["\"x\"".into(), "[]".into()]),
            ",",
        ),
    ];
    for body in &bodies {
        let config = config(BodyKeyLayer::DEFAULT_FIELDS);
        let (key, facts) = config.inspect(body);
        let (whole_key, whole) = config.inspect_whole(body);
        let text = String::from_utf8_lossy(&body[..80]);
        assert!(whole.messages > 0 || !whole.chain.is_empty(), "{text}");
        assert_eq!(key, whole_key, "{text}");
        assert_eq!(facts.messages, whole.messages, "{text}");
        assert_eq!(facts.leading_digest(), whole.leading_digest(), "{text}");
        assert_eq!(facts.chain.links(), whole.chain.links(), "{text}");
        let reference = reference(BodyKeyLayer::DEFAULT_FIELDS, body);
        let got = (key, facts.messages, facts.leading_digest());
        assert_eq!(got, reference, "{text}");
    }
}

#[test]
fn an_item_nested_too_deep_past_the_bound_empties_the_facts() {
    let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
    for at in [0, 3, 10_000, 19_999] {
        let messages = (0..20_000).map(|i| {
            if i == at {
                deep.clone()
            } else {
                mixed_message(i)
            }
        });
        let facts = PromptFacts::from_body(&array_body("messages", messages, ","));
        assert_eq!((facts.messages, facts.chain.len()), (0, 0), "at {at}");
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
    assert_eq!(facts.leading_digest(), Some(expected));
    assert_eq!(facts.messages, 3);
}

#[test]
fn the_model_is_the_top_level_string_and_changes_nothing_else() {
    let model = |body: &[u8]| PromptFacts::from_body(body).model().map(str::to_owned);
    let chat = br#"{"model":"qwen3-coder","messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(model(chat).as_deref(), Some("qwen3-coder"));
    // Escapes are read; the last one given counts, as in a parsed `Value`.
    assert_eq!(
        model(br#"{"model":"a\u00e9\"b","model":"c\/d"}"#).as_deref(),
        Some("c/d")
    );
    assert_eq!(
        model(br#"{"model":"a\u00e9\"b"}"#).as_deref(),
        Some("a\u{e9}\"b")
    );
    // Not a string, not at the top, not JSON: none.
    for body in [
        &br#"{"model":7}"#[..],
        br#"{"model":["m"]}"#,
        br#"{"model":null}"#,
        br#"{"metadata":{"model":"m"}}"#,
        br#"{"model":"m""#,
        b"model",
    ] {
        assert_eq!(model(body), None, "{}", String::from_utf8_lossy(body));
    }
    // The rest of the facts are those of the body without it.
    let without = br#"{"messages":[{"role":"user","content":"hi"}]}"#;
    let (with, without) = (
        PromptFacts::from_body(chat),
        PromptFacts::from_body(without),
    );
    assert_eq!(with.chain, without.chain);
    assert_eq!(
        (with.messages, with.leading_digest()),
        (without.messages, without.leading_digest())
    );
    // A key field named `model` is a key, as any field is.
    let (found, _) = config(&["model"]).inspect(chat);
    assert_eq!(found, key("qwen3-coder"));
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

/// A body left unread still says which slot it names: llama-server runs the request in the
/// slot of its top-level `id_slot`, so the router must assign it that one. Only that is read.
#[tokio::test]
async fn a_body_left_unread_still_gives_the_slot_its_id_slot_names() {
    use crate::key::HeaderKey;
    use crate::slots::NamedSlot;
    let layer = BodyKeyLayer::new().skip_when_header(HeaderKey::default());
    for (body, named) in [
        (
            &br#"{"user":"u","id_slot":1,"messages":[{"role":"user","content":"hi"}]}"#[..],
            NamedSlot::Slot(1),
        ),
        (br#"{"id_slot":-1,"messages":[]}"#, NamedSlot::Other),
        (br#"{"\u0069d_slot":2}"#, NamedSlot::Slot(2)),
    ] {
        let (res, seen) = run(layer.clone(), with_session_header("run-1", body)).await;
        assert_eq!(res.status(), 200);
        assert_eq!(seen.key, None);
        let facts = seen.facts.expect("the slot's facts");
        assert_eq!(facts.named_slot, named);
        assert!(facts.chain.is_empty() && facts.model().is_none());
        assert_eq!(seen.body.as_deref(), Some(body));
    }
    // No top-level `id_slot`: nothing.
    for body in [
        &br#"{"messages":[{"role":"user","content":"id_slot"}]}"#[..],
        br#"{"metadata":{"id_slot":1}}"#,
        br#"["id_slot"]"#,
    ] {
        let (_, seen) = run(layer.clone(), with_session_header("run-1", body)).await;
        assert_eq!(seen.facts, None);
    }
}

/// A body left unread that opens with a byte order mark names the slot of the object after
/// it: llama-server skips the mark, and runs the request in that slot.
#[tokio::test]
async fn a_body_left_unread_gives_the_slot_its_id_slot_names_after_a_leading_byte_order_mark() {
    use crate::key::HeaderKey;
    use crate::slots::NamedSlot;
    let layer = BodyKeyLayer::new().skip_when_header(HeaderKey::default());
    for (body, named) in [
        (&b"\xef\xbb\xbf{\"id_slot\":1}"[..], NamedSlot::Slot(1)),
        (
            b"\xef\xbb\xbf \n{\"messages\":[],\"id_slot\":3}",
            NamedSlot::Slot(3),
        ),
    ] {
        let (_, seen) = run(layer.clone(), with_session_header("run-1", body)).await;
        assert_eq!(seen.key, None);
        let facts = seen.facts.expect("the slot's facts");
        assert_eq!(facts.named_slot, named);
        assert_eq!(facts.body_bytes, body.len());
        assert_eq!(seen.body.as_deref(), Some(body));
    }
    // A mark after whitespace, or a second one, is one llama-server refuses.
    for body in [
        &b" \xef\xbb\xbf{\"id_slot\":1}"[..],
        b"\xef\xbb\xbf\xef\xbb\xbf{\"id_slot\":1}",
    ] {
        let (_, seen) = run(layer.clone(), with_session_header("run-1", body)).await;
        assert_eq!(seen.facts, None);
    }
}

/// llama-server's JSON parser skips a UTF-8 byte order mark at the start of a body, and runs
/// the request the object after it describes: the layer reads that object as it would the
/// same body without the mark.
#[tokio::test]
async fn a_body_after_a_leading_byte_order_mark_is_read_as_without_it() {
    use crate::slots::NamedSlot;
    let plain = br#"{"user":"u","id_slot":1,"messages":[{"role":"user","content":"hi"}]}"#;
    let marked = b"\xef\xbb\xbf{\"user\":\"u\",\"id_slot\":1,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
    assert_eq!(&marked[3..], &plain[..]);
    let (_, without) = run(BodyKeyLayer::new(), post(plain)).await;
    let (res, seen) = run(BodyKeyLayer::new(), post(marked)).await;
    assert_eq!(res.status(), 200);
    assert_eq!(seen.key, key("u"));
    assert_eq!(seen.body.as_deref(), Some(&marked[..]));
    let (facts, without) = (seen.facts.unwrap(), without.facts.unwrap());
    assert_eq!(facts.named_slot, NamedSlot::Slot(1));
    assert_eq!(facts.messages, 1);
    assert!(!facts.chain.is_empty());
    assert_eq!(facts.chain, without.chain);
    assert_eq!(facts.leading_digest(), without.leading_digest());
    assert_eq!(facts.body_bytes, marked.len());
    // A mark after whitespace, or a second one, is one llama-server refuses: no JSON.
    for body in [
        &b" \xef\xbb\xbf{\"user\":\"u\",\"id_slot\":1}"[..],
        b"\xef\xbb\xbf\xef\xbb\xbf{\"user\":\"u\",\"id_slot\":1}",
    ] {
        let (_, seen) = run(BodyKeyLayer::new(), post(body)).await;
        assert_eq!(seen.key, None);
        let facts = seen.facts.unwrap();
        assert_eq!(facts.named_slot, NamedSlot::Absent);
        assert!(facts.chain.is_empty());
    }
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

// === prompt chains ===

fn chain_of(body: &str) -> crate::PromptChain {
    PromptFacts::from_body(body.as_bytes()).chain
}

#[test]
fn a_chat_chain_has_a_link_a_message_and_the_next_turn_extends_it() {
    let turn1 = r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u1"}]}"#;
    let turn2 = r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u1"},
                  {"role":"assistant","content":"a1"},{"role":"user","content":"u2"}]}"#;
    let (c1, c2) = (chain_of(turn1), chain_of(turn2));
    assert_eq!((c1.len(), c2.len()), (2, 4));
    assert_eq!(c2.common_prefix(&c1), 2);
    // Whitespace between tokens and the order of other members do not matter.
    let spaced = r#"{ "stream": true, "messages" : [ { "role" : "system" , "content" : "s" },
                     {"role":"user","content":"u1"} ] , "model":"m" }"#;
    assert_eq!(chain_of(spaced), c1);
    // The content does.
    let other = r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u9"}]}"#;
    assert_eq!(chain_of(other).common_prefix(&c1), 1);
}

#[test]
fn tools_come_first_and_change_the_whole_chain() {
    let plain = r#"{"messages":[{"role":"user","content":"u"}]}"#;
    let with_tools = r#"{"messages":[{"role":"user","content":"u"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#;
    let (a, b) = (chain_of(plain), chain_of(with_tools));
    assert_eq!((a.len(), b.len()), (1, 2));
    assert_eq!(a.common_prefix(&b), 0);
}

#[test]
fn an_anthropic_chain_covers_system_and_messages_and_ignores_moving_cache_markers() {
    // Claude Code marks its newest message with `cache_control`; the next turn moves it.
    let turn1 = r#"{"system":[{"type":"text","text":"you are an agent"}],
        "messages":[{"role":"user","content":[{"type":"text","text":"task",
            "cache_control":{"type":"ephemeral"}}]}]}"#;
    let turn2 = r#"{"system":[{"type":"text","text":"you are an agent"}],
        "messages":[{"role":"user","content":[{"type":"text","text":"task"}]},
            {"role":"assistant","content":[{"type":"text","text":"done"}]},
            {"role":"user","content":[{"type":"text","text":"next",
                "cache_control":{"type":"ephemeral"}}]}]}"#;
    let (c1, c2) = (chain_of(turn1), chain_of(turn2));
    assert_eq!((c1.len(), c2.len()), (2, 4));
    assert_eq!(c2.common_prefix(&c1), 2);
    // A system prompt given as a string is a part too.
    let text = r#"{"system":"you are an agent","messages":[{"role":"user","content":"task"}]}"#;
    assert_eq!(chain_of(text).len(), 2);
}

/// Claude Code's billing line, its `cch` value as one request has it.
fn billing(cch: &str) -> String {
    format!("x-anthropic-billing-header: cc_version=2.1.120.cf9; cc_entrypoint=cli; cch={cch};")
}

#[test]
fn claude_codes_billing_nonce_changes_no_digest_and_the_rest_of_its_line_does() {
    let turn = |cch: &str, version: &str, messages: &str| {
        let line = billing(cch).replace("2.1.120.cf9", version);
        format!(
            r#"{{"system":[{{"type":"text","text":"{line}"}},{{"type":"text","text":"You are Claude Code."}}],"messages":[{messages}]}}"#
        )
    };
    let first = r#"{"role":"user","content":[{"type":"text","text":"task"}]}"#;
    let second = format!(
        r#"{first},{{"role":"assistant","content":[{{"type":"text","text":"done"}}]}},{{"role":"user","content":"next"}}"#
    );
    let (c1, c2) = (
        chain_of(&turn("fa690", "2.1.120.cf9", first)),
        chain_of(&turn("1c8b4", "2.1.120.cf9", &second)),
    );
    assert_eq!((c1.len(), c2.len()), (3, 5));
    assert_eq!(c2.common_prefix(&c1), 3, "the next turn extends the last");
    // The same line given as a string system prompt.
    let as_text = |cch: &str| {
        chain_of(&format!(
            r#"{{"system":"{}\nYou are Claude Code."}}"#,
            billing(cch)
        ))
    };
    assert_eq!(as_text("fa690"), as_text("1c8b4"));
    // Another version of the client is another prompt; and a line that is not the billing
    // header keeps its `cch=`.
    let upgraded = chain_of(&turn("fa690", "2.1.121.0d9", first));
    assert_eq!(upgraded.common_prefix(&c1), 0);
    let quoted = |cch: &str| {
        chain_of(&format!(
            r#"{{"messages":[{{"role":"user","content":"about {}"}}]}}"#,
            billing(cch)
        ))
    };
    assert_ne!(quoted("fa690"), quoted("1c8b4"));
}

#[test]
fn content_of_one_text_part_is_its_text() {
    let chain = |content: &str| {
        chain_of(&format!(
            r#"{{"messages":[{{"role":"user","content":{content}}},{{"role":"user","content":"next"}}]}}"#
        ))
    };
    let text = chain(r#""fix the bug""#);
    for same in [
        r#"[{"type":"text","text":"fix the bug"}]"#,
        r#" [ { "text" : "fix the bug" , "type":"text", "cache_control":{"type":"ephemeral"} } ] "#,
        r#"[{"type":"input_text","text":"fix the bug"}]"#,
        r#"[{"type":"output_text","text":"fix the bug"}]"#,
    ] {
        assert_eq!(chain(same), text, "{same}");
    }
    for other in [
        r#"[{"type":"text","text":"fix the"},{"type":"text","text":" bug"}]"#,
        r#"[{"type":"text","text":"fix the bug","annotations":[]}]"#,
        r#"[{"type":"image_url","text":"fix the bug"}]"#,
        r#"[{"type":"text","text":["fix the bug"]}]"#,
        r#"[{"type":"text"}]"#,
        r#"["fix the bug"]"#,
        r#"[]"#,
    ] {
        assert_eq!(chain(other).common_prefix(&text), 0, "{other}");
    }
    // Only a message's own content: a tool result's inside a content block stays as it is.
    let nested = |inner: &str| {
        chain_of(&format!(
            r#"{{"messages":[{{"role":"user","content":[{{"type":"tool_result","content":{inner}}}]}}]}}"#
        ))
    };
    assert_ne!(
        nested(r#""ok""#),
        nested(r#"[{"type":"text","text":"ok"}]"#)
    );
    // Truncated or odd arrays do not panic.
    for bad in [
        r#"[{"type":"text","text":"x""#,
        r#"[{"type""#,
        r#"[{"#,
        r#"[{}]"#,
    ] {
        let _ = chain_of(&format!(r#"{{"messages":[{{"content":{bad}}}]}}"#));
    }
}

#[test]
fn an_encoded_image_is_digested_whole_and_counted_as_an_image() {
    // A megabyte of base64, as an Anthropic image block and as an OpenAI data URI.
    let data: String = (0..1 << 20)
        .map(|i| {
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"[i * 7 % 64] as char
        })
        .collect();
    let anthropic = |data: &str| {
        chain_of(&format!(
            r#"{{"messages":[{{"role":"user","content":[{{"type":"image","source":{{"type":"base64","media_type":"image/png","data":"{data}"}}}},{{"type":"text","text":"what is this?"}}]}}]}}"#
        ))
    };
    let openai = chain_of(&format!(
        r#"{{"messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{data}"}}}}]}}]}}"#
    ));
    let image = anthropic(&data);
    for chain in [&image, &openai] {
        let bytes = chain.links().last().unwrap().bytes;
        assert!(bytes >= 1 << 20, "every byte is digested: {bytes}");
        let tokens = chain.tokens();
        assert!((1024..1024 + 64).contains(&tokens), "{tokens} tokens");
    }
    // Blocks are cut through it as through any long message, as many as its tokens allow
    // (one per 16 past the chain's first 64), and every byte counts.
    let links = image.len() as u64;
    assert!(
        (64 + 1024 / 16..=64 + image.tokens() / 16).contains(&links),
        "{image:?}"
    );
    let mut other = data.clone().into_bytes();
    other[1 << 19] = b'A' + (other[1 << 19] == b'A') as u8;
    let other = anthropic(std::str::from_utf8(&other).unwrap());
    let shared = other.common_prefix(&image);
    assert!(
        shared > 1 && shared < image.len(),
        "{shared} of {}",
        image.len()
    );
    // A long text is counted by its bytes, as before; so are numbers and hex, one a line, as
    // tools print them (no payload has only digits, or letters of one case).
    let prose = "word ".repeat(1 << 12);
    let text = chain_of(&format!(
        r#"{{"messages":[{{"role":"user","content":"{prose}"}}]}}"#
    ));
    assert!(text.tokens() > 5_000, "{}", text.tokens());
    let tool = |output: String| {
        chain_of(&format!(
            r#"{{"messages":[{{"role":"tool","tool_call_id":"c","content":"{output}"}}]}}"#
        ))
        .tokens()
    };
    let numbers: String = (1..=2000).map(|n| format!("{n}\\n")).collect();
    let hashes: String = (0..500u64)
        .map(|n| {
            format!(
                "{:016x}{:016x}\\n",
                n.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                !n
            )
        })
        .collect();
    assert!(tool(numbers) > 2_000);
    assert!(tool(hashes) > 4_000);
    // A payload given as a whole string member counts as one too.
    let prompt = chain_of(&format!(r#"{{"prompt":"{}"}}"#, &data[..8_000]));
    assert!(
        (1024..1024 + 4).contains(&prompt.tokens()),
        "{}",
        prompt.tokens()
    );
}

#[test]
fn an_encoded_image_broken_into_lines_is_counted_as_an_image_not_as_text() {
    // 780 KB of base64 as MIME (76 a line) and PEM (64 a line) encoders write it, the breaks
    // escaped in the JSON as `\n` or `\r\n`.
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let lines = |width: usize, brk: &str| -> String {
        let data: Vec<u8> = (0..780_000).map(|i| alphabet[i * 7 % 64]).collect();
        let lines: Vec<&str> = data
            .chunks(width)
            .map(|l| std::str::from_utf8(l).unwrap())
            .collect();
        lines.join(brk)
    };
    for data in [lines(76, "\\n"), lines(76, "\\r\\n"), lines(64, "\\n")] {
        let anthropic = chain_of(&format!(
            r#"{{"messages":[{{"role":"user","content":[{{"type":"image","source":{{"type":"base64","media_type":"image/png","data":"{data}"}}}}]}}]}}"#
        ));
        let openai = chain_of(&format!(
            r#"{{"messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{data}"}}}}]}}]}}"#
        ));
        // A whole string member is read decoded: the breaks are line feeds there.
        let prompt = chain_of(&format!(r#"{{"prompt":"{data}"}}"#));
        for chain in [anthropic, openai, prompt] {
            let tokens = chain.tokens();
            assert!((1024..1024 + 64).contains(&tokens), "{tokens} tokens");
        }
    }
    // Text broken into lines stays text: long identifiers one a line (lines of many lengths), and
    // upper-case hex one a line (one length, but letters of one case: the `n` of the escape
    // is not a letter of the line).
    let tool = |output: String| {
        chain_of(&format!(
            r#"{{"messages":[{{"role":"tool","tool_call_id":"c","content":"{output}"}}]}}"#
        ))
        .tokens()
    };
    let names: String = (0..2_000)
        .map(|n| {
            let of = "AllUsers".repeat(n % 4 + 3);
            format!("getUserRecordNumber{n}From{of}TheDatabase\\n")
        })
        .collect();
    let hashes: String = (0..1_000u64)
        .map(|n| {
            format!(
                "{:016X}{:016X}{:016X}{:016X}\\n",
                n.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                !n,
                n,
                n ^ 0x5555
            )
        })
        .collect();
    assert!(tool(names) > 30_000);
    assert!(tool(hashes) > 16_000);
    // A break before a line long enough, or lines of two lengths, is not an encoding's.
    let short_first = format!("{}\\n{}", &lines(76, "")[..20], lines(76, "\\n"));
    assert!(tool(short_first) > 100_000);
    let uneven = lines(76, "\\n").replacen("\\n", "", 1);
    assert!(tool(uneven) > 100_000);
}

#[test]
fn a_token_id_of_nineteen_digits_is_an_id_and_one_of_twenty_is_text() {
    let (nineteen, twenty) = ("1".repeat(19), "1".repeat(20));
    let ids = chain_of(&format!(r#"{{"prompt":[{nineteen},{nineteen}]}}"#));
    assert_eq!(ids.tokens(), 2);
    // Past the longest id taken, a number is counted a token a digit.
    let text = chain_of(&format!(r#"{{"prompt":[{twenty}]}}"#));
    assert_eq!(text.tokens(), 20);
}

#[test]
fn base64_broken_into_lines_of_sixty_bytes_is_a_payload_and_of_fifty_nine_is_text() {
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let data: Vec<u8> = (0..60_000).map(|i| alphabet[i * 7 % 64]).collect();
    let tool = |width: usize| {
        let lines: Vec<&str> = data
            .chunks(width)
            .map(|l| std::str::from_utf8(l).unwrap())
            .collect();
        let output = lines.join("\\n");
        chain_of(&format!(
            r#"{{"messages":[{{"role":"tool","tool_call_id":"c","content":"{output}"}}]}}"#
        ))
        .tokens()
    };
    let (sixty, fifty_nine) = (tool(60), tool(59));
    assert!((1024..1024 + 64).contains(&sixty), "{sixty} tokens");
    assert!(fifty_nine > 15_000, "{fifty_nine} tokens");
}

#[test]
fn a_responses_chain_covers_instructions_and_input() {
    let turn1 = r#"{"instructions":"be brief","input":[{"role":"user","content":"q1"}]}"#;
    let turn2 = r#"{"instructions":"be brief","input":[{"role":"user","content":"q1"},
        {"type":"function_call_output","call_id":"c1","output":"42"}]}"#;
    let (c1, c2) = (chain_of(turn1), chain_of(turn2));
    assert_eq!((c1.len(), c2.len()), (2, 3));
    assert_eq!(c2.common_prefix(&c1), 2);
    // `input` as a plain string.
    assert_eq!(chain_of(r#"{"input":"hello"}"#).len(), 1);
}

#[test]
fn a_completions_prompt_is_cut_into_blocks_so_a_growing_text_shares_them() {
    let block = PromptFacts::BLOCK_BYTES;
    let text = "x".repeat(3 * block + 100);
    let longer = format!("{text}{}", "y".repeat(block));
    let short = chain_of(&format!(r#"{{"prompt":"{text}"}}"#));
    let long = chain_of(&format!(r#"{{"prompt":"{longer}"}}"#));
    // Three whole blocks and the rest; the longer text shares the three.
    assert_eq!(short.len(), 4);
    assert_eq!(long.common_prefix(&short), 3);
    assert_eq!(short.tokens_at(3), (3 * block as u64).div_ceil(4));
}

#[test]
fn a_prompt_of_token_ids_counts_a_token_an_id_and_is_cut_into_blocks_not_a_part_an_id() {
    let ids = |n: usize, from: usize| -> Vec<String> {
        (from..from + n)
            .map(|i| (100_000 + i * 7_919 % 50_000).to_string())
            .collect()
    };
    let flat = |ids: &[String]| chain_of(&format!(r#"{{"prompt":[{}]}}"#, ids.join(", ")));
    // Six digits an id, one token each.
    let first = ids(1_000, 0);
    let one = flat(&first);
    assert_eq!(one.tokens(), 1_000);
    // Cut into blocks of the ids' bytes, as a text prompt is: the next turn's ids, which
    // extend these, share every link but the last (a partial block).
    assert_eq!(
        one.len(),
        (7 * 1_000usize).div_ceil(PromptFacts::BLOCK_BYTES)
    );
    let next = flat(&[first.clone(), ids(500, 1_000)].concat());
    assert_eq!(next.tokens(), 1_500);
    assert_eq!(next.common_prefix(&one), one.len() - 1);
    // A long prompt is tracked to its end: one that differs near its end shares less than
    // all its links.
    let long = ids(100_000, 0);
    let mut late = long.clone();
    late[90_000] = "7".into();
    let (long, late) = (flat(&long), flat(&late));
    assert_eq!(long.tokens(), 100_000);
    assert!(late.common_prefix(&long) < long.len(), "{long:?}");
    // A batch of one, and whitespace, change nothing of the count.
    let nested = chain_of(&format!(r#"{{"prompt":[[{}]]}}"#, first.join(",")));
    assert_eq!(nested.tokens(), 1_000);
    assert_eq!(nested, one);
    // Ids split otherwise are another prompt; and text is text, as before.
    let two = chain_of(r#"{"prompt":[[12,3],[4]]}"#);
    assert_ne!(two, chain_of(r#"{"prompt":[[1,23],[4]]}"#));
    assert_ne!(two, chain_of(r#"{"prompt":[12,3,4]}"#));
    assert_eq!(chain_of(r#"{"prompt":["12345678"]}"#).tokens(), 8 + 1);
}

#[test]
fn a_long_message_is_cut_into_blocks_too() {
    let block = PromptFacts::BLOCK_BYTES;
    let tool = "z".repeat(5 * block);
    let body = format!(
        r#"{{"messages":[{{"role":"system","content":"s"}},{{"role":"tool","content":"{tool}"}}]}}"#
    );
    let c = chain_of(&body);
    assert!(c.len() >= 6, "{c:?}");
    // Sizes grow link by link.
    assert!(c.links().windows(2).all(|w| w[0].bytes < w[1].bytes));
    // A tool output that differs only past its first blocks (a longer run of the same
    // command, say) still matches up to the last whole block the two have in common: the
    // system prompt and the five whole blocks of the shorter message.
    let longer = format!("{tool}{}", "w".repeat(block));
    let other = chain_of(&format!(
        r#"{{"messages":[{{"role":"system","content":"s"}},{{"role":"tool","content":"{longer}"}}]}}"#
    ));
    // All but the first chain's last link, which ends inside a block.
    assert_eq!(other.common_prefix(&c), c.len() - 1, "{c:?}");
}

#[test]
fn bodies_that_are_not_json_objects_have_no_chain() {
    // The last: a string where chat's `messages` is an array is no prompt.
    for body in [
        "",
        "not json",
        "[1,2]",
        r#"{"messages":[1,2"#,
        r#"{"messages":"text"}"#,
    ] {
        assert!(chain_of(body).is_empty(), "{body}");
    }
}

// === previous_response_id ===

/// A Responses backend: answers each request with the next of `answers`, in the given frames,
/// as backend `gpu-<i>` for the `i`th answer (the answer's `Decision` says so), and records the
/// facts it was sent.
type ResponsesBackend = tower::util::BoxCloneService<
    http::Request<Full<Bytes>>,
    http::Response<http_body_util::StreamBody<Frames>>,
    Infallible,
>;

fn responses_backend(
    answers: Vec<Vec<&'static [u8]>>,
) -> (ResponsesBackend, Arc<Mutex<Vec<PromptFacts>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let answers = Arc::new(Mutex::new(
        answers.into_iter().enumerate().collect::<VecDeque<_>>(),
    ));
    let record = seen.clone();
    let svc = service_fn(move |req: http::Request<Full<Bytes>>| {
        let (record, answers) = (record.clone(), answers.clone());
        async move {
            let facts = req.extensions().get::<PromptFacts>().cloned();
            record
                .lock()
                .push(facts.unwrap_or_else(|| PromptFacts::from_chain(Default::default())));
            let (i, frames) = answers.lock().pop_front().unwrap_or_default();
            let stream = Frames(frames.into_iter().map(Bytes::from_static).collect());
            let mut res = http::Response::new(http_body_util::StreamBody::new(stream));
            res.extensions_mut().insert(crate::Decision {
                backend: format!("gpu-{i}").as_str().into(),
                node: "n".into(),
                outcome: crate::Outcome::Keyless,
                waited: None,
                overcommitted: false,
            });
            Ok::<_, Infallible>(res)
        }
    });
    (ResponsesBackend::new(svc), seen)
}

/// The frames of an answer.
struct Frames(VecDeque<Bytes>);

impl futures_core::Stream for Frames {
    type Item = Result<Frame<Bytes>, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }
}

/// Sends each body to `/v1/responses` through `svc`, reading each answer whole.
async fn send_responses(svc: &BodyKey<ResponsesBackend>, bodies: &[&'static str]) {
    for body in bodies {
        send_response_body(svc, *body).await;
    }
}

/// Sends one Responses request of `body` through `svc` and reads its answer whole.
async fn send_response_body(svc: &BodyKey<ResponsesBackend>, body: impl Into<Bytes>) {
    let req = http::Request::post("/v1/responses")
        .body(Full::new(body.into()))
        .unwrap();
    let res = svc.clone().oneshot(req).await.unwrap();
    // The answer passes unchanged.
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    assert!(bytes.starts_with(b"{\"id\"") || bytes.starts_with(b"event:"));
}

/// The layer over a backend that answers `n` requests with the ids `resp_0`, `resp_1` and on,
/// the `i`-th from backend `gpu-i`, and the facts each request carried.
fn numbered_responses(n: usize) -> (BodyKey<ResponsesBackend>, Arc<Mutex<Vec<PromptFacts>>>) {
    let answers = (0..n).map(|i| {
        let id: &'static str = Box::leak(format!(r#"{{"id":"resp_{i}"}}"#).into_boxed_str());
        vec![id.as_bytes()]
    });
    let (inner, seen) = responses_backend(answers.collect());
    (BodyKeyLayer::new().layer(inner), seen)
}

#[tokio::test]
async fn a_request_naming_a_previous_response_continues_that_responses_chain() {
    let (inner, seen) = responses_backend(vec![
        vec![br#"{"id":"resp_1","object":"response","output":[{"id":"msg_1"}]}"#],
        // A stream, its first event split over two frames.
        vec![
            b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"re",
            b"sp_2\"}}\n\n",
        ],
        vec![br#"{"id":"resp_3"}"#],
        vec![br#"{"id":"resp_4"}"#],
        vec![br#"{"id":"resp_5"}"#],
    ]);
    let svc = BodyKeyLayer::new().layer(inner);
    send_responses(
        &svc,
        &[
            r#"{"instructions":"be brief","input":[{"role":"user","content":"q1"}]}"#,
            r#"{"instructions":"be brief","previous_response_id":"resp_1","input":[{"role":"user","content":"q2"}]}"#,
            r#"{"instructions":"be brief","previous_response_id":"resp_2","input":[{"role":"user","content":"q3"}]}"#,
            r#"{"previous_response_id":"resp_none","input":[{"role":"user","content":"q3"}]}"#,
            r#"{"previous_response_id":"resp_4","input":[{"role":"user","content":"q4"}]}"#,
        ],
    )
    .await;
    let seen = seen.lock().clone();
    let [f1, f2, f3, f4, f5] = &seen[..] else {
        panic!("five requests");
    };
    let (c1, c2, c3) = (&f1.chain, &f2.chain, &f3.chain);
    assert_eq!(c1.len(), 2);
    // Each continues the whole chain of the response it names, then adds its input, and goes
    // to the backend that answered that response.
    assert_eq!((c2.len(), c2.common_prefix(c1)), (3, 2));
    assert_eq!((c3.len(), c3.common_prefix(c2)), (4, 3));
    assert_eq!(f1.stored_on, None);
    assert_eq!(f2.stored_on, Some("gpu-0".into()));
    assert_eq!(f3.stored_on, Some("gpu-1".into()));
    // A response the layer never saw: its conversation is not known here, nor is that of the
    // response continuing it; the backend that answered that one is.
    assert!(f4.chain.is_empty() && f4.stored_on.is_none());
    assert!(f5.chain.is_empty());
    assert_eq!(f5.stored_on, Some("gpu-3".into()));
}

#[tokio::test]
async fn a_layer_told_the_backends_share_stored_responses_pins_none() {
    let (inner, seen) = responses_backend(vec![
        vec![br#"{"id":"resp_1"}"#],
        vec![br#"{"id":"resp_2"}"#],
    ]);
    let svc = BodyKeyLayer::new().pin_stored_responses(false).layer(inner);
    send_responses(
        &svc,
        &[
            r#"{"input":"q1"}"#,
            r#"{"previous_response_id":"resp_1","input":"q2"}"#,
        ],
    )
    .await;
    let seen = seen.lock().clone();
    // The chain still continues; the request is not pinned.
    assert_eq!(seen[1].chain.common_prefix(&seen[0].chain), 1);
    assert_eq!(seen[1].stored_on, None);
}

/// A Responses request may name a stored response that only one backend can continue: its
/// body is read, and its answer's id remembered, whatever its headers say.
#[tokio::test]
async fn skip_when_header_still_reads_a_responses_body_for_its_stored_response() {
    use crate::key::HeaderKey;
    let (inner, seen) = responses_backend(vec![
        vec![br#"{"id":"resp_1"}"#],
        vec![br#"{"id":"resp_2"}"#],
    ]);
    let svc = BodyKeyLayer::new()
        .skip_when_header(HeaderKey::default())
        .layer(inner);
    for body in [
        r#"{"input":"q1"}"#,
        r#"{"previous_response_id":"resp_1","input":"q2"}"#,
    ] {
        let req = http::Request::post("/v1/responses")
            .header("x-session-id", "run-1")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap();
        let res = svc.clone().oneshot(req).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
    let seen = seen.lock().clone();
    assert_eq!(seen[1].stored_on, Some("gpu-0".into()));
    assert_eq!(seen[1].chain.common_prefix(&seen[0].chain), 1);

    // Where the backends share their stored responses, nothing needs the body.
    let layer = BodyKeyLayer::new()
        .skip_when_header(HeaderKey::default())
        .pin_stored_responses(false);
    let req = http::Request::post("/v1/responses")
        .header("x-session-id", "run-1")
        .body(Full::new(Bytes::from_static(br#"{"input":"q1"}"#)))
        .unwrap();
    let (_, seen) = run(layer, req).await;
    assert!(seen.facts.is_none());
}

/// A response to a request with `"store": false` (the Codex CLI's) is stored nowhere and can
/// never be continued: remembering it would push out the responses that can.
#[tokio::test]
async fn responses_stored_nowhere_do_not_push_out_those_stored() {
    let n = super::responses::StoredResponses::DEFAULT_CAPACITY;
    let (svc, seen) = numbered_responses(n + 2);
    let send = |body: String| send_response_body(&svc, body);
    send(r#"{"input":"stored"}"#.into()).await;
    for i in 0..n {
        send(format!(r#"{{"store":false,"input":"turn {i}"}}"#)).await;
    }
    send(r#"{"previous_response_id":"resp_0","input":"next"}"#.into()).await;
    let seen = seen.lock();
    let next = seen.last().unwrap();
    assert_eq!(next.stored_on, Some("gpu-0".into()));
    assert_eq!(next.chain.common_prefix(&seen[0].chain), 1);
}

/// One conversation of many turns, each continuing the last, keeps one response that can be
/// continued: those it continued are forgotten before another conversation's latest.
#[tokio::test]
async fn a_conversations_latest_response_outlasts_the_turns_another_conversation_moved_past() {
    let n = super::responses::StoredResponses::DEFAULT_CAPACITY;
    let (svc, seen) = numbered_responses(n + 3);
    let send = |body: String| send_response_body(&svc, body);
    send(r#"{"input":"the first conversation"}"#.into()).await;
    send(r#"{"input":"the second conversation"}"#.into()).await;
    for i in 1..=n {
        send(format!(
            r#"{{"previous_response_id":"resp_{i}","input":"turn {i}"}}"#
        ))
        .await;
    }
    send(r#"{"previous_response_id":"resp_0","input":"next"}"#.into()).await;
    let seen = seen.lock();
    let next = seen.last().unwrap();
    assert_eq!(next.stored_on, Some("gpu-0".into()));
    assert_eq!(next.chain.common_prefix(&seen[0].chain), 1);
    // The second conversation goes on from its latest response as well.
    let latest = &seen[n + 1];
    assert_eq!(latest.stored_on, Some(format!("gpu-{n}").as_str().into()));
    assert_eq!(latest.chain.common_prefix(&seen[1].chain), 1);
}

#[test]
fn a_string_member_shares_no_link_with_json_or_boundaries_written_in_its_text() {
    // A system prompt whose text is the JSON of a text block, against that block.
    let block = r#"{"type":"text","text":"hi"}"#;
    let as_text = serde_json::json!({ "system": block }).to_string();
    let as_block = format!(r#"{{"system":[{block}]}}"#);
    let (text, items) = (chain_of(&as_text), chain_of(&as_block));
    assert_eq!((text.len(), items.len()), (1, 1));
    assert_ne!(text.links()[0].digest, items.links()[0].digest);
    // The same when the text is long enough to be cut into blocks: not even the first is shared.
    let long = format!(r#"{{"type":"text","text":"{}"}}"#, "a".repeat(5_000));
    let as_text = serde_json::json!({ "system": long }).to_string();
    let as_block = format!(r#"{{"system":[{long}]}}"#);
    assert_eq!(chain_of(&as_text).common_prefix(&chain_of(&as_block)), 0);
    // A string whose text holds the bytes that end a part and begin a message does not end
    // on the digest of the prompt with that message.
    let message = r#"{"role":"user","content":"u"}"#;
    let two = format!(r#"{{"system":"s","messages":[{message}]}}"#);
    let forged =
        serde_json::json!({ "system": format!("s\u{1e}\u{1d}\u{3}{message}") }).to_string();
    let (two, forged) = (chain_of(&two), chain_of(&forged));
    assert_eq!((two.len(), forged.len()), (2, 1));
    for link in two.links() {
        assert_ne!(link.digest, forged.links()[0].digest);
    }
}

#[test]
fn a_member_the_layer_reads_for_itself_is_read_though_a_key_field_starts_with_it() {
    // `stream_options` given: the client's own usage chunk must not be taken out. A previous
    // response named: the request goes where that response is stored. `store: false`: the
    // answer is not remembered.
    let asked = br#"{"stream":true,"stream_options":{"include_usage":true},"user":"u"}"#;
    let continues = br#"{"previous_response_id":"resp_1","store":false,"input":"hi"}"#;
    let unasked = br#"{"stream":true,"user":"u"}"#;
    let plain = config(&["user"]);
    for field in [
        "stream",
        "stream.x",
        "stream_options",
        "stream_options.include_usage",
        "store",
        "previous_response_id",
    ] {
        let keyed = config(&[field, "user"]);
        for body in [&asked[..], continues, unasked] {
            let (want, got) = (plain.inspect_request(body), keyed.inspect_request(body));
            assert_eq!(
                (got.streams_unasked, got.continues, got.unstored),
                (want.streams_unasked, want.continues, want.unstored),
                "{field}: {}",
                String::from_utf8_lossy(body)
            );
        }
    }
    // The field is a key all the same.
    let i = config(&["previous_response_id"]).inspect_request(continues);
    assert_eq!(i.key, key("resp_1"));
    assert!(i.continues.is_some());
}
