//! `BodyKeyLayer::ask_stream_usage` over arbitrary answers.
//!
//! The first input byte is the size of the chunks the answer arrives in; the rest is the
//! answer, sent as an SSE stream to a streaming chat request the layer asks for its usage.
//! The bytes the client gets must not depend on the chunking, and must be the answer itself
//! when it carries no usage.

#![no_main]

#[path = "support.rs"]
mod support;

use std::convert::Infallible;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use libfuzzer_sys::fuzz_target;
use tower::{Layer, ServiceExt};

use support::{runtime, Chunks};
use tower_affinity::key::BodyKeyLayer;

/// What the client gets for `answer` sent in chunks of `chunk` bytes.
fn through(answer: &Bytes, chunk: usize) -> Vec<u8> {
    let answer = answer.clone();
    let backend = tower::service_fn(move |req: Request<Full<Bytes>>| {
        let answer = answer.clone();
        async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            assert!(body.starts_with(br#"{"stream_options":{"include_usage":true},"#));
            let chunks = answer.chunks(chunk).map(|c| answer.slice_ref(c)).collect();
            let res = http::Response::builder()
                .header("content-type", "text/event-stream")
                .body(Chunks(chunks))
                .unwrap();
            Ok::<_, Infallible>(res)
        }
    });
    let svc = BodyKeyLayer::new().ask_stream_usage(true).layer(backend);
    let req = Request::post("/v1/chat/completions")
        .body(Full::new(Bytes::from_static(
            br#"{"stream":true,"messages":[]}"#,
        )))
        .unwrap();
    runtime().block_on(async move {
        let res = svc.oneshot(req).await.unwrap();
        res.into_body().collect().await.unwrap().to_bytes().to_vec()
    })
}

fuzz_target!(|data: &[u8]| {
    let [chunk, answer @ ..] = data else {
        return;
    };
    let answer = Bytes::copy_from_slice(answer);
    let whole = through(&answer, answer.len().max(1));
    assert_eq!(through(&answer, usize::from(*chunk).max(1)), whole);
    if usage_at(&answer).is_none() {
        assert_eq!(whole, answer, "a stream without usage passes whole");
    }
});

fn usage_at(b: &[u8]) -> Option<usize> {
    b.windows(7).position(|w| w == b"\"usage\"")
}
