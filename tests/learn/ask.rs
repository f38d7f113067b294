//! Asking a stream for its usage on the client's behalf (`BodyKeyLayer::ask_stream_usage`):
//! the service behind reads the figures, and the client gets the bytes it would have had
//! without the router.

use std::sync::Arc;

use parking_lot::Mutex;

use http_body_util::Full;
use tower_affinity::key::BodyKeyLayer;

use super::*;

const TIMINGS: &str = r#"{"cache_n":2000,"prompt_n":160,"prompt_ms":800.0}"#;

/// What llama-server streams for a chat request, with or without usage asked for: with it,
/// the `timings` of the last chunk move onto the usage chunk it adds.
fn llama_stream(asked: bool) -> String {
    let chunk = |choices: &str, tail: &str| {
        format!(
            "data: {{\"choices\":{choices},\"created\":1764547200,\"id\":\"chatcmpl-1\",\"model\":\"qwen\",\"system_fingerprint\":\"b7000-abc\",\"object\":\"chat.completion.chunk\"{tail}}}\n\n"
        )
    };
    let role = chunk(
        r#"[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}]"#,
        "",
    );
    let token = chunk(
        r#"[{"finish_reason":null,"index":0,"delta":{"content":"Done."}}]"#,
        "",
    );
    let finish = r#"[{"finish_reason":"stop","index":0,"delta":{}}]"#;
    let timings = format!(",\"timings\":{TIMINGS}");
    let mut s = role + &token;
    if asked {
        s += &chunk(finish, "");
        s += &chunk(
            "[]",
            &format!(
                ",\"usage\":{{\"completion_tokens\":2,\"prompt_tokens\":2160,\"total_tokens\":2162,\"prompt_tokens_details\":{{\"cached_tokens\":2000}}}}{timings}"
            ),
        );
    } else {
        s += &chunk(finish, &timings);
    }
    s + "data: [DONE]\n\n"
}

type AskReq = http::Request<Full<Bytes>>;

/// A backend answering as llama-server does, in frames of `piece` bytes (from the request's
/// `x-piece` header; all at once without it), the last of them failing when the request
/// says `x-fail`. It keeps the bodies it was sent.
fn llama(
    seen: Arc<Mutex<Vec<Bytes>>>,
) -> impl tower::Service<AskReq, Response = http::Response<Scripted>, Error = Infallible, Future: Send>
       + Clone
       + Send {
    service_fn(move |req: AskReq| {
        let seen = seen.clone();
        async move {
            let piece = req
                .headers()
                .get("x-piece")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(usize::MAX);
            let fail = req.headers().contains_key("x-fail");
            let gzip = req.headers().contains_key("x-gzip");
            // A server that ignores `stream_options` and ends its stream without `[DONE]`.
            let deaf = req.headers().contains_key("x-deaf");
            let body = req.into_body().collect().await.unwrap().to_bytes();
            seen.lock().push(body.clone());
            let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let asked = json["stream_options"]["include_usage"] == true && !deaf;
            let mut stream = llama_stream(asked);
            if deaf {
                stream.truncate(stream.len() - "data: [DONE]\n\n".len());
            }
            let mut frames: Vec<(Duration, Result<Bytes, &'static str>)> = stream
                .as_bytes()
                .chunks(piece.max(1))
                .map(|c| (Duration::ZERO, Ok(Bytes::copy_from_slice(c))))
                .collect();
            if fail {
                // The stream breaks after its last chunk but one has started.
                frames.truncate(frames.len() - 2);
                frames.push((Duration::ZERO, Err("connection reset")));
            }
            let mut res = http::Response::new(Scripted {
                frames: frames.into(),
                sleep: None,
            });
            res.headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            if gzip {
                res.headers_mut()
                    .insert("content-encoding", "gzip".parse().unwrap());
            }
            Ok::<_, Infallible>(res)
        }
    })
}

struct Rig<S> {
    affinity: SessionAffinity<
        StaticFleet<S>,
        tower_affinity::key::HeaderKey,
        tower_affinity::placement::NodeThenBackend,
    >,
    seen: Arc<Mutex<Vec<Bytes>>>,
}

fn rig() -> Rig<
    impl tower::Service<
            AskReq,
            Response = http::Response<Scripted>,
            Error = Infallible,
            Future: Send,
        > + Clone
        + Send,
> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let affinity = SessionAffinityLayer::new().layer(fleet(&[("a", "n")], llama(seen.clone())));
    Rig { affinity, seen }
}

/// Sends `body` to `path` through a `BodyKeyLayer` (asking on the client's behalf when
/// `ask`) and the service; the bytes the client got, and whether the body failed.
async fn send<S>(
    rig: &Rig<S>,
    ask: bool,
    path: &str,
    body: &'static str,
    headers: &[(&str, &str)],
) -> (Vec<u8>, bool)
where
    S: tower::Service<AskReq, Response = http::Response<Scripted>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    let svc = BodyKeyLayer::new()
        .ask_stream_usage(ask)
        .layer(rig.affinity.clone());
    let mut req = http::Request::post(path).header("content-length", body.len());
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    let res = svc.oneshot(req).await.expect("an answer");
    let mut body = res.into_body();
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => bytes.extend_from_slice(f.data_ref().map_or(&[][..], |d| d)),
            Err(_) => return (bytes, true),
        }
    }
    (bytes, false)
}

const UNASKED: &str =
    r#"{"model":"qwen","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
const ASKED: &str = r#"{"model":"qwen","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}"#;

#[tokio::test(start_paused = true)]
async fn a_stream_that_did_not_ask_for_usage_gets_the_bytes_it_would_have_had_and_the_figures_are_read(
) {
    let rig = rig();
    let want = llama_stream(false);
    let whole = llama_stream(true).len();
    let mut sent = 0;
    for piece in (1..=64).chain([100, 333, whole]) {
        let piece = piece.to_string();
        let (got, failed) = send(
            &rig,
            true,
            "/v1/chat/completions",
            UNASKED,
            &[("x-piece", &piece)],
        )
        .await;
        sent += 1;
        assert!(!failed);
        assert_eq!(
            String::from_utf8_lossy(&got),
            want,
            "frames of {piece} bytes"
        );
    }
    // The backend was asked, every time, and the service read what it said.
    let seen = rig.seen.lock().clone();
    assert!(seen.iter().all(|b| b.starts_with(
        br#"{"stream_options":{"include_usage":true},"model":"qwen","stream":true,"#
    )));
    let stats = rig.affinity.stats();
    assert_eq!(
        (
            stats.usage_reports,
            stats.prompt_tokens,
            stats.reused_tokens
        ),
        (sent, 2160 * sent, 2000 * sent)
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_that_asked_for_usage_gets_the_stream_unchanged() {
    let rig = rig();
    for piece in ["1", "7", "4096"] {
        let (got, _) = send(
            &rig,
            true,
            "/v1/chat/completions",
            ASKED,
            &[("x-piece", piece)],
        )
        .await;
        assert_eq!(String::from_utf8_lossy(&got), llama_stream(true));
    }
    let seen = rig.seen.lock().clone();
    assert!(seen.iter().all(|b| b == ASKED), "its body went as it was");
}

#[tokio::test(start_paused = true)]
async fn requests_that_are_not_asked_go_as_they_came() {
    let rig = rig();
    let cases = [
        // Asking is off.
        (false, "/v1/chat/completions", UNASKED),
        // The client said something of stream_options itself.
        (
            true,
            "/v1/chat/completions",
            r#"{"stream":true,"stream_options":{"include_usage":false},"messages":[]}"#,
        ),
        (
            true,
            "/v1/chat/completions",
            r#"{"stream":true,"stream_options":null,"messages":[]}"#,
        ),
        // Not a stream.
        (
            true,
            "/v1/chat/completions",
            r#"{"stream":false,"messages":[]}"#,
        ),
        (true, "/v1/chat/completions", r#"{"messages":[]}"#),
        (
            true,
            "/v1/chat/completions",
            r#"{"stream":"yes","messages":[]}"#,
        ),
        // APIs whose streams carry usage anyway.
        (true, "/v1/messages", r#"{"stream":true,"messages":[]}"#),
        (true, "/v1/responses", r#"{"stream":true,"input":"hi"}"#),
    ];
    for (ask, path, body) in cases {
        let _ = send(&rig, ask, path, body, &[]).await;
        let seen = rig.seen.lock().pop().unwrap();
        assert_eq!(seen, body, "{path} {body}");
    }
    // Legacy completions are asked.
    let _ = send(
        &rig,
        true,
        "/v1/completions",
        r#"{"stream":true,"prompt":"hi"}"#,
        &[],
    )
    .await;
    let seen = rig.seen.lock().pop().unwrap();
    assert_eq!(
        seen,
        r#"{"stream_options":{"include_usage":true},"stream":true,"prompt":"hi"}"#
    );
}

#[tokio::test(start_paused = true)]
async fn an_asked_request_declares_its_new_length() {
    let seen_len = Arc::new(Mutex::new(None));
    let seen = seen_len.clone();
    let backend = service_fn(move |req: AskReq| {
        let seen = seen.clone();
        async move {
            let declared = req.headers()["content-length"].to_str().unwrap().to_owned();
            let body = req.into_body().collect().await.unwrap().to_bytes();
            *seen.lock() = Some((declared, body.len()));
            Ok::<_, Infallible>(http::Response::new(String::new()))
        }
    });
    let svc = BodyKeyLayer::new().ask_stream_usage(true).layer(backend);
    let req = http::Request::post("/v1/chat/completions")
        .header("content-length", UNASKED.len())
        .body(Full::new(Bytes::from_static(UNASKED.as_bytes())))
        .unwrap();
    svc.oneshot(req).await.unwrap();
    let (declared, len) = seen_len.lock().clone().unwrap();
    assert_eq!(declared, len.to_string());
    assert!(len > UNASKED.len());
}

#[tokio::test(start_paused = true)]
async fn a_stream_cut_short_ends_with_its_error_and_no_figure() {
    let rig = rig();
    let (got, failed) = send(
        &rig,
        true,
        "/v1/chat/completions",
        UNASKED,
        &[("x-piece", "40"), ("x-fail", "")],
    )
    .await;
    assert!(failed, "the client sees the stream fail");
    // What came before the break came through.
    let want = llama_stream(false);
    assert!(want.as_bytes().starts_with(&got) && !got.is_empty());
    assert_eq!(rig.affinity.stats().usage_reports, 0);
}

#[tokio::test(start_paused = true)]
async fn an_encoded_answer_passes_untouched() {
    // A compressed stream cannot be read: neither the service nor the layer touches it.
    let rig = rig();
    let (got, _) = send(
        &rig,
        true,
        "/v1/chat/completions",
        UNASKED,
        &[("x-gzip", ""), ("x-piece", "9")],
    )
    .await;
    assert_eq!(String::from_utf8_lossy(&got), llama_stream(true));
    assert_eq!(rig.affinity.stats().usage_reports, 0);
}

#[tokio::test(start_paused = true)]
async fn the_services_body_behind_the_layer_tells_its_answers_usage_and_decision() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let affinity = SessionAffinityLayer::new()
        .decision_extension(false)
        .layer(fleet(&[("a", "n")], llama(seen)));
    let svc = BodyKeyLayer::new().ask_stream_usage(true).layer(affinity);
    // Asked on the client's behalf, in frames; asked of a server that does not answer it, so
    // that the layer holds the last events back until the stream's end; and as the client
    // asked itself.
    for (body, piece, deaf) in [
        (UNASKED, "7", false),
        (UNASKED, "4096", false),
        (UNASKED, "7", true),
        (ASKED, "7", false),
    ] {
        let mut req = http::Request::post("/v1/chat/completions")
            .header("content-length", body.len())
            .header("x-piece", piece);
        if deaf {
            req = req.header("x-deaf", "");
        }
        let req = req
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap();
        let mut res = svc.clone().oneshot(req).await.unwrap().into_body();
        let inner = res.get_ref().expect("the service's body");
        assert_eq!(inner.decision().map(|d| d.backend.as_str()), Some("a"));
        assert_eq!(inner.usage(), None, "not before the end");
        let mut got = Vec::new();
        while let Some(frame) = res.frame().await {
            got.extend_from_slice(frame.unwrap().data_ref().unwrap());
        }
        assert!(res.is_end_stream());
        assert!(res.frame().await.is_none(), "the end, again");
        let mut want = llama_stream(body == ASKED);
        if deaf {
            want.truncate(want.len() - "data: [DONE]\n\n".len());
        }
        assert_eq!(String::from_utf8_lossy(&got), want, "{body} in {piece}");
        let usage = res
            .get_ref()
            .and_then(|inner| inner.usage())
            .expect("usage");
        assert_eq!(
            (usage.prompt_tokens, usage.reused_tokens),
            (2160, Some(2000))
        );
    }
    // A request the layer refuses never reached the service: no body of its.
    let small = BodyKeyLayer::new()
        .limit(10)
        .layer(SessionAffinityLayer::new().layer(fleet(
            &[("a", "n")],
            llama(Arc::new(Mutex::new(Vec::new()))),
        )));
    let req = http::Request::post("/v1/chat/completions")
        .header("content-length", UNASKED.len())
        .body(Full::new(Bytes::from_static(UNASKED.as_bytes())))
        .unwrap();
    let res = small.oneshot(req).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::PAYLOAD_TOO_LARGE);
    assert!(res.body().get_ref().is_none());
}
