//! A stub llama-server on a loopback port: OpenAI chat completions (plain and streamed), with
//! a prefix cache per stub so `usage.prompt_tokens_details.cached_tokens` tells whether a turn
//! found its previous prompt here; `/health`, `/slots`; and an echo of anything else.
//!
//! Tokens are counted as bytes of message content: a turn's cached tokens are those of the
//! longest run of leading messages it shares with a conversation (prompt and answer) this stub
//! served before.

#[path = "server.rs"]
mod server;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// The most prompts a stub remembers.
const CACHED_PROMPTS: usize = 16;

/// A request the stub saw outside the chat endpoint.
#[derive(Clone, Debug)]
pub(crate) struct Echoed {
    pub(crate) method: Method,
    pub(crate) uri: Uri,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

#[derive(Debug)]
pub(crate) struct StubState {
    pub(crate) name: String,
    slots: usize,
    health: AtomicU16,
    /// Prompts served, as their messages, most recent last.
    cache: Mutex<Vec<Vec<Value>>>,
    pub(crate) chats: AtomicUsize,
    /// Each chat's `id_slot`, in the order they came (`None`: not given).
    pub(crate) id_slots: Mutex<Vec<Option<u64>>>,
    pub(crate) streams_finished: AtomicUsize,
    /// Streams send their first chunk, then take a permit before the rest.
    gate: Semaphore,
    pub(crate) echoed: Mutex<Vec<Echoed>>,
    /// Connections accepted.
    pub(crate) connections: Arc<AtomicUsize>,
    /// How long a chat takes, if it takes time at all.
    timing: Option<Timing>,
    /// With a timing, a chat holds one of `slots` permits from its start to its last byte.
    busy: Arc<Semaphore>,
    /// Streams as vLLM does: usage only when the request asks
    /// (`stream_options.include_usage`), in a chunk of its own; no timings.
    usage_when_asked: std::sync::atomic::AtomicBool,
    /// Each slot's context when set (0: not set, `/slots` says 4096 and nothing is refused):
    /// a longer prompt is refused as llama-server with `-np` refuses it.
    context: AtomicUsize,
    /// Prompts refused as longer than `context`.
    pub(crate) refused: AtomicUsize,
    /// Tokens an ASCII digit counts (1 until set), as a tokenizer that reads numbers digit by
    /// digit counts a text of numbers denser than prose.
    digit_tokens: AtomicUsize,
    /// Refuses a prompt too long in vLLM's words rather than llama-server's fields.
    refuses_as_vllm: std::sync::atomic::AtomicBool,
    /// The key of a llama-server run with `--api-key`, if set: `/slots` answers 401 without
    /// it (`/health` does not want it).
    api_key: Mutex<Option<String>>,
}

/// How long a timed stub takes over a chat: the tokens it reads (not cached) at `prefill`
/// tokens a second, then `decode` for the answer. It reports the read time in llama-server's
/// `timings`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timing {
    pub(crate) prefill: f64,
    pub(crate) decode: std::time::Duration,
}

/// A running stub. Dropping it, or [`Stub::kill`], closes its listener and every connection.
#[derive(Debug)]
pub(crate) struct Stub {
    pub(crate) addr: SocketAddr,
    pub(crate) state: Arc<StubState>,
    server: server::Served,
}

impl Stub {
    /// A stub with `slots` slots, streams not held, answering at once.
    pub(crate) async fn start(name: &str, slots: usize) -> Stub {
        Stub::start_with(name, slots, None).await
    }

    /// A stub that takes time over each chat as `timing` says, serving at most `slots` at once
    /// (more wait, as llama-server's requests wait for a slot).
    pub(crate) async fn start_timed(name: &str, slots: usize, timing: Timing) -> Stub {
        Stub::start_with(name, slots, Some(timing)).await
    }

    async fn start_with(name: &str, slots: usize, timing: Option<Timing>) -> Stub {
        let state = Arc::new(StubState {
            name: name.to_string(),
            slots,
            health: AtomicU16::new(200),
            cache: Mutex::new(Vec::new()),
            chats: AtomicUsize::new(0),
            id_slots: Mutex::new(Vec::new()),
            streams_finished: AtomicUsize::new(0),
            gate: Semaphore::new(Semaphore::MAX_PERMITS),
            echoed: Mutex::new(Vec::new()),
            connections: Arc::default(),
            timing,
            busy: Arc::new(Semaphore::new(slots)),
            usage_when_asked: Default::default(),
            context: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
            digit_tokens: AtomicUsize::new(1),
            refuses_as_vllm: Default::default(),
            api_key: Mutex::new(None),
        });
        let router = Router::new()
            .route("/health", get(health))
            .route("/slots", get(slots_list))
            .route("/v1/chat/completions", post(chat))
            .fallback(echo)
            .with_state(state.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = server::spawn_counted(listener, router, state.connections.clone());
        Stub {
            addr,
            state,
            server,
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops the stub: new connections are refused, open ones are closed. Returns once its
    /// serving task and every connection have ended, so that no request sent after it, on a
    /// pooled connection either, is answered.
    pub(crate) async fn kill(&self) {
        self.server.stop().await;
    }

    /// From now on, wants `key` as llama-server run with `--api-key KEY` does: `/slots`
    /// answers 401 unless sent `Authorization: Bearer KEY`.
    pub(crate) fn require_api_key(&self, key: &str) {
        *self.state.api_key.lock() = Some(key.to_string());
    }

    /// What `/health` answers: 200 ready, 503 loading.
    pub(crate) fn set_health(&self, status: u16) {
        self.state.health.store(status, Ordering::Relaxed);
    }

    /// Gives each slot `tokens` of context: `/slots` says so (`n_ctx`), and a longer prompt is
    /// refused with llama-server's 400 (`exceed_context_size_error`).
    pub(crate) fn set_context(&self, tokens: usize) {
        self.state.context.store(tokens, Ordering::Relaxed);
    }

    /// Prompts refused as longer than a slot's context so far.
    pub(crate) fn refused(&self) -> usize {
        self.state.refused.load(Ordering::Relaxed)
    }

    /// From now on, refuses a prompt too long as vLLM does: a `400` whose message states its
    /// context length, without llama-server's counts.
    pub(crate) fn refuse_as_vllm(&self) {
        self.state.refuses_as_vllm.store(true, Ordering::Relaxed);
    }

    /// Counts each ASCII digit of a prompt as `tokens` tokens (a byte of anything else is one).
    pub(crate) fn set_digit_tokens(&self, tokens: usize) {
        self.state.digit_tokens.store(tokens, Ordering::Relaxed);
    }

    /// From now on, streams carry usage as vLLM's do: only when asked, in a last chunk of its
    /// own with `"choices": []`, and no `timings`.
    pub(crate) fn stream_usage_when_asked(&self) {
        self.state.usage_when_asked.store(true, Ordering::Relaxed);
    }

    /// Streams stop after their first chunk until [`Stub::release_streams`].
    pub(crate) fn hold_streams(&self) {
        let held = self.state.gate.available_permits();
        self.state.gate.forget_permits(held);
    }

    pub(crate) fn release_streams(&self) {
        self.state
            .gate
            .add_permits(Semaphore::MAX_PERMITS - self.state.gate.available_permits());
    }

    /// Connections the stub has accepted.
    pub(crate) fn connections(&self) -> usize {
        self.state.connections.load(Ordering::Relaxed)
    }

    /// Each chat's `id_slot`, in the order they came (`None`: not given).
    pub(crate) fn id_slots(&self) -> Vec<Option<u64>> {
        self.state.id_slots.lock().clone()
    }

    pub(crate) fn chats(&self) -> usize {
        self.state.chats.load(Ordering::Relaxed)
    }

    pub(crate) fn echoed(&self) -> Vec<Echoed> {
        self.state.echoed.lock().clone()
    }
}

async fn health(State(s): State<Arc<StubState>>) -> Response {
    let status = StatusCode::from_u16(s.health.load(Ordering::Relaxed)).unwrap();
    let body = if status == StatusCode::OK {
        json!({"status": "ok"})
    } else {
        json!({"error": {"code": status.as_u16(), "message": "Loading model", "type": "unavailable_error"}})
    };
    (status, axum::Json(body)).into_response()
}

async fn slots_list(State(s): State<Arc<StubState>>, headers: HeaderMap) -> Response {
    if let Some(key) = s.api_key.lock().as_deref() {
        let given = headers.get("authorization").and_then(|v| v.to_str().ok());
        if given != Some(format!("Bearer {key}").as_str()) {
            let error = json!({"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}});
            return (StatusCode::UNAUTHORIZED, axum::Json(error)).into_response();
        }
    }
    let n_ctx = match s.context.load(Ordering::Relaxed) {
        0 => 4096,
        n => n,
    };
    let slots: Vec<Value> = (0..s.slots)
        .map(|id| json!({"id": id, "n_ctx": n_ctx, "is_processing": false}))
        .collect();
    axum::Json(slots).into_response()
}

fn tokens(s: &StubState, messages: &[Value]) -> usize {
    let digit = s.digit_tokens.load(Ordering::Relaxed);
    messages
        .iter()
        .filter_map(|m| m["content"].as_str())
        .map(|text| text.len() + (digit - 1) * text.bytes().filter(u8::is_ascii_digit).count())
        .sum()
}

/// Looks the prompt up in the prefix cache, then remembers it with its answer, as a slot's KV
/// cache holds the generated tokens too.
fn cached_tokens(s: &StubState, messages: &[Value], answer: &str) -> usize {
    let mut cache = s.cache.lock();
    let best = cache
        .iter()
        .map(|prompt| {
            let shared = prompt
                .iter()
                .zip(messages)
                .take_while(|(a, b)| a == b)
                .count();
            tokens(s, &messages[..shared])
        })
        .max()
        .unwrap_or(0);
    let mut served = messages.to_vec();
    served.push(json!({"role": "assistant", "content": answer}));
    cache.push(served);
    if cache.len() > CACHED_PROMPTS {
        cache.remove(0);
    }
    best
}

async fn chat(State(s): State<Arc<StubState>>, body: Bytes) -> Response {
    let Ok(req) = serde_json::from_slice::<Value>(&body) else {
        return (StatusCode::BAD_REQUEST, "body is not JSON").into_response();
    };
    let messages = req["messages"].as_array().cloned().unwrap_or_default();
    let prompt = tokens(&s, &messages);
    let context = s.context.load(Ordering::Relaxed);
    // As llama-server: a prompt must leave its answer a token.
    if context > 0 && prompt >= context {
        s.refused.fetch_add(1, Ordering::Relaxed);
        let message = format!(
            "request ({prompt} tokens) exceeds the available context size ({context} tokens), try increasing it"
        );
        let error = if s.refuses_as_vllm.load(Ordering::Relaxed) {
            let message = format!(
                "This model's maximum context length is {context} tokens. However, you requested {} tokens ({prompt} in the messages, 3 in the completion). Please reduce the length of the messages or completion.",
                prompt + 3
            );
            json!({"object": "error", "message": message, "type": "BadRequestError",
                "param": null, "code": 400})
        } else {
            json!({"error": {"code": 400, "message": message,
                "type": "exceed_context_size_error", "n_prompt_tokens": prompt, "n_ctx": context}})
        };
        return (StatusCode::BAD_REQUEST, axum::Json(error)).into_response();
    }
    s.id_slots.lock().push(req["id_slot"].as_u64());
    let n = s.chats.fetch_add(1, Ordering::Relaxed) + 1;
    let answer = format!("{} answer {n}", s.name);
    // A timed stub holds a slot from here to the answer's last byte.
    let slot = match s.timing {
        Some(_) => Some(s.busy.clone().acquire_owned().await.unwrap()),
        None => None,
    };
    let cached = cached_tokens(&s, &messages, &answer);
    let usage = json!({
        "prompt_tokens": prompt,
        "completion_tokens": 3,
        "total_tokens": prompt + 3,
        "prompt_tokens_details": {"cached_tokens": cached},
    });
    let mut timings = Value::Null;
    if let Some(t) = s.timing {
        let read = prompt - cached;
        let read_time = std::time::Duration::from_secs_f64(read as f64 / t.prefill);
        tokio::time::sleep(read_time).await;
        timings = json!({"prompt_n": read, "cache_n": cached, "prompt_ms": read_time.as_secs_f64() * 1000.0});
        if req["stream"].as_bool() != Some(true) {
            tokio::time::sleep(t.decode).await;
        }
    }
    let decode = s.timing.map(|t| t.decode);
    if req["stream"].as_bool() != Some(true) {
        drop(slot);
        let res = json!({
            "id": format!("chatcmpl-{n}"),
            "object": "chat.completion",
            "model": "stub",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
            "usage": usage,
            "timings": timings,
        });
        return ([("x-stub", s.name.clone())], axum::Json(res)).into_response();
    }
    let vllm = s.usage_when_asked.load(Ordering::Relaxed);
    let asked = req["stream_options"]["include_usage"] == true;
    let chunk = move |delta: Value, finish: Value, usage: Value| {
        let mut c = json!({
            "id": format!("chatcmpl-{n}"),
            "object": "chat.completion.chunk",
            "model": "stub",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            "usage": usage,
        });
        if vllm {
            c.as_object_mut().unwrap().remove("usage");
        }
        Ok::<_, std::convert::Infallible>(Bytes::from(format!("data: {c}\n\n")))
    };
    let words: Vec<String> = answer.split(' ').map(str::to_string).collect();
    let state = s.clone();
    let stream = async_stream(move |tx| async move {
        let _ = tx
            .send(chunk(
                json!({"role": "assistant"}),
                Value::Null,
                Value::Null,
            ))
            .await;
        // Held here, after the first chunk, while a test checks the client already has it.
        let permit = state.gate.acquire().await.unwrap();
        drop(permit);
        if let Some(decode) = decode {
            tokio::time::sleep(decode).await;
        }
        for w in words {
            let _ = tx
                .send(chunk(
                    json!({"content": format!("{w} ")}),
                    Value::Null,
                    Value::Null,
                ))
                .await;
        }
        let mut last = json!({
            "id": format!("chatcmpl-{n}"),
            "object": "chat.completion.chunk",
            "model": "stub",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": usage.clone(),
        });
        if vllm {
            last.as_object_mut().unwrap().remove("usage");
        } else if !timings.is_null() {
            // llama-server puts its timings on the last chunk.
            last["timings"] = timings;
        }
        let last = Ok(Bytes::from(format!("data: {last}\n\n")));
        let _ = tx.send(last).await;
        if vllm && asked {
            let u = json!({
                "id": format!("chatcmpl-{n}"),
                "object": "chat.completion.chunk",
                "model": "stub",
                "choices": [],
                "usage": usage,
            });
            let _ = tx.send(Ok(Bytes::from(format!("data: {u}\n\n")))).await;
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
        state.streams_finished.fetch_add(1, Ordering::Relaxed);
        drop(slot);
    });
    (
        [
            ("content-type", "text/event-stream"),
            ("x-stub", s.name.as_str()),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

/// A stream fed by a task through a channel of one: each chunk is written before the next is
/// produced.
fn async_stream<F, Fut>(
    produce: F,
) -> impl futures_core::Stream<Item = Result<Bytes, std::convert::Infallible>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Bytes, std::convert::Infallible>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(produce(tx));
    ReceiverStream(rx)
}

struct ReceiverStream<T>(tokio::sync::mpsc::Receiver<T>);

impl<T> futures_core::Stream for ReceiverStream<T> {
    type Item = T;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<T>> {
        self.0.poll_recv(cx)
    }
}

async fn echo(
    State(s): State<Arc<StubState>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    s.echoed.lock().push(Echoed {
        method,
        uri,
        headers,
        body: body.clone(),
    });
    (StatusCode::CREATED, [("x-stub", s.name.clone())], body).into_response()
}
