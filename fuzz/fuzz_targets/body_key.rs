//! The JSON body reader of `BodyKeyLayer` over arbitrary bodies.
//!
//! The first input byte picks the body limit and whether a `Content-Length` is declared, the
//! second the chunk size the body arrives in; the rest is the body. The layer runs on a
//! current-thread runtime in front of a service that checks what it is handed: the body byte
//! for byte, and a key only when the body is a JSON object. Oversize bodies must be 413.

#![no_main]

#[path = "support.rs"]
mod support;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use libfuzzer_sys::fuzz_target;
use tower::{Layer, ServiceExt};

use support::{runtime, Chunks};
use tower_affinity::key::{BodyKeyLayer, PromptFacts, SessionKey};

fuzz_target!(|data: &[u8]| {
    let [mode, chunk, body @ ..] = data else {
        return;
    };
    let limit = [0, 1, 64, 1024, BodyKeyLayer::DEFAULT_LIMIT][usize::from(mode % 5)];
    let declare = mode & 0x80 != 0;
    let chunk = usize::from(*chunk).max(1);

    let facts = PromptFacts::from_body(body);
    assert_eq!(facts.body_bytes, body.len());
    assert!(facts.leading_digest().is_none() || facts.messages > 0);
    // A chain only from a JSON object, bounded, its sizes growing link by link.
    let links = facts.chain.links();
    assert!(links.len() <= tower_affinity::PromptChain::MAX_LINKS);
    if !links.is_empty() {
        assert!(
            matches!(serde_json_value(body), Some(true)),
            "a chain only from JSON"
        );
    }
    assert!(links
        .windows(2)
        .all(|w| w[0].bytes < w[1].bytes && w[0].tokens <= w[1].tokens));

    let mut fields = vec!["prompt_cache_key", "user", "metadata.user_id"];
    if mode & 0x40 != 0 {
        fields.insert(0, "a.b.c");
    }
    let layer = BodyKeyLayer::new()
        .limit(limit)
        .fields(fields)
        .read_timeout(Duration::from_secs(60));
    let expected = Bytes::copy_from_slice(body);
    let seen = expected.clone();
    let inner = tower::service_fn(move |req: Request<Full<Bytes>>| {
        let seen = seen.clone();
        async move {
            let key = req.extensions().get::<SessionKey>().copied();
            let facts = req.extensions().get::<PromptFacts>().cloned();
            let got = req.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(got, seen, "forwarded byte for byte");
            assert_eq!(facts.map(|f| f.body_bytes), Some(got.len()));
            if key.is_some() {
                assert!(
                    matches!(serde_json_value(&got), Some(true)),
                    "a key only from a JSON object"
                );
            }
            Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
        }
    });
    let svc = layer.layer(inner);
    let chunks: VecDeque<Bytes> = expected
        .chunks(chunk)
        .map(|c| expected.slice_ref(c))
        .collect();
    let status = runtime().block_on(async move {
        let res = if declare {
            let req = Request::post("/")
                .header(header::CONTENT_LENGTH, body.len())
                .body(Chunks(chunks))
                .unwrap();
            svc.oneshot(req).await
        } else {
            svc.oneshot(Request::post("/").body(Chunks(chunks)).unwrap())
                .await
        };
        let res = res.unwrap();
        let status = res.status();
        res.into_body().collect().await.unwrap();
        status
    });
    if body.len() > limit {
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    } else {
        assert_eq!(status, StatusCode::OK);
    }
});

/// Whether `bytes` is a JSON object, by a parser of its own.
fn serde_json_value(bytes: &[u8]) -> Option<bool> {
    let v: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    Some(v.is_object())
}
