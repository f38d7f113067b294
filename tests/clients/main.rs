//! What coding agents send, and the key each is placed by: one test per row of the README's
//! "What clients send" table.
//!
//! Each test builds the request its client sends (path, headers, a small body in its shape) and
//! sends it through the stack the proxy example builds: `BodyKeyLayer::new()` in front of
//! `SessionAffinityLayer::new().key(FirstOf::new(HeaderKey::default(), ExtensionKey))` over a
//! `StaticFleet` of four backends on two nodes. The extractor is wrapped only to record the key
//! it returned; each response's `Decision` gives the outcome, and each backend reports the key
//! `BodyKeyLayer` found in the body, if any.

use std::convert::Infallible;
use std::num::NonZeroU32;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use parking_lot::Mutex;
use serde_json::json;
use tower::{service_fn, Layer, ServiceExt};
use tower_affinity::discover::StaticFleet;
use tower_affinity::key::{
    BodyKeyLayer, ExtensionKey, FirstOf, HeaderKey, KeyExtractor, PromptFacts, SessionKey,
};
use tower_affinity::{
    Backend, BackendId, Decision, Error, Outcome, PromptChain, SessionAffinityLayer,
};

type Req = http::Request<Full<Bytes>>;

/// What a backend saw: the key `BodyKeyLayer` read from the body, and the prompt's chain.
#[derive(Clone, Debug)]
struct BodyKeySeen(Option<SessionKey>, Option<PromptChain>);

/// Where one request went and by which key.
#[derive(Debug)]
struct Placed {
    /// The key `FirstOf::new(HeaderKey::default(), ExtensionKey)` returned for it.
    key: Option<SessionKey>,
    /// The key `BodyKeyLayer` found in its body (the headers may have won over it).
    body_key: Option<SessionKey>,
    outcome: Outcome,
    backend: BackendId,
    /// Its prompt's chain, as `BodyKeyLayer` read it.
    chain: Option<PromptChain>,
}

/// The proxy example's stack over four backends that answer at once, its extractor recorded.
struct Proxy {
    svc: tower::util::BoxCloneService<Req, http::Response<()>, Error>,
    last_key: Arc<Mutex<Vec<Option<SessionKey>>>>,
}

impl Proxy {
    fn new() -> Self {
        let backend = |name: &'static str| {
            service_fn(move |req: Req| async move {
                let seen = BodyKeySeen(
                    req.extensions().get::<SessionKey>().copied(),
                    req.extensions()
                        .get::<PromptFacts>()
                        .map(|f| f.chain.clone()),
                );
                let mut res = http::Response::new(name.to_string());
                res.extensions_mut().insert(seen);
                Ok::<_, Infallible>(res)
            })
        };
        let slots = NonZeroU32::new(4).unwrap();
        let fleet = StaticFleet::new([
            ("a1", Backend::new("node-a", backend("a1")).slots(slots)),
            ("a2", Backend::new("node-a", backend("a2")).slots(slots)),
            ("b1", Backend::new("node-b", backend("b1")).slots(slots)),
            ("b2", Backend::new("node-b", backend("b2")).slots(slots)),
        ]);
        let last_key = Arc::new(Mutex::new(Vec::new()));
        let recorded = {
            let key = FirstOf::new(HeaderKey::default(), ExtensionKey);
            let last_key = last_key.clone();
            move |req: &Req| {
                let found = key.extract(req);
                last_key.lock().push(found);
                found
            }
        };
        let affinity = SessionAffinityLayer::new()
            .key(recorded)
            .decision_headers(true)
            .layer(fleet);
        let svc = ServiceExt::<Req>::map_response(BodyKeyLayer::new().layer(affinity), |res| {
            // The body is dropped at once, which frees the backend's slot.
            res.map(|_| ())
        });
        Proxy {
            svc: tower::util::BoxCloneService::new(svc),
            last_key,
        }
    }

    async fn send(&self, path: &str, headers: &[(&str, &str)], body: serde_json::Value) -> Placed {
        let (res, keys) = self.round_trip(path, headers, body).await;
        assert!(!keys.is_empty(), "the request was placed by a key or none");
        assert!(keys.iter().all(|k| *k == keys[0]), "{keys:?}");
        let decision = res
            .extensions()
            .get::<Decision>()
            .expect("a Decision")
            .clone();
        assert_eq!(
            res.headers()["x-affinity-outcome"],
            decision.outcome.as_str(),
            "the decision header agrees with the extension"
        );
        let BodyKeySeen(body_key, chain) =
            res.extensions().get::<BodyKeySeen>().expect("seen").clone();
        Placed {
            key: keys[0],
            body_key,
            outcome: decision.outcome,
            backend: decision.backend,
            chain,
        }
    }
}

impl Proxy {
    /// Sends a request its session's key is not asked of (a token count): its decision, and
    /// the keys the extractor found meanwhile (none).
    async fn send_aside(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        body: serde_json::Value,
    ) -> (Decision, Vec<Option<SessionKey>>) {
        let (res, keys) = self.round_trip(path, headers, body).await;
        (res.extensions().get::<Decision>().unwrap().clone(), keys)
    }

    /// Posts `body` to `path` with `headers`: the response, and the keys the extractor found
    /// meanwhile.
    async fn round_trip(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        body: serde_json::Value,
    ) -> (http::Response<()>, Vec<Option<SessionKey>>) {
        let mut req = http::Request::post(path).header("content-type", "application/json");
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let body = Full::new(Bytes::from(serde_json::to_vec(&body).unwrap()));
        self.last_key.lock().clear();
        let res = self
            .svc
            .clone()
            .oneshot(req.body(body).unwrap())
            .await
            .unwrap();
        let keys = std::mem::take(&mut *self.last_key.lock());
        (res, keys)
    }
}

fn key(raw: &str) -> Option<SessionKey> {
    Some(SessionKey::from_bytes(raw.as_bytes()))
}

/// Two turns of one session: the second finds the first's backend.
fn assert_second_turn_is_home(first: &Placed, second: &Placed) {
    assert_eq!(second.key, first.key);
    assert_eq!(second.outcome, Outcome::HomeHit, "{second:?}");
    assert_eq!(second.backend, first.backend);
}

// === Claude Code ===

const CLAUDE_SESSION: &str = "7f3c1e2a-9b4d-4c1e-8f2a-3d5b6c7e8f90";
const CLAUDE_OTHER_SESSION: &str = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";

/// Claude Code's `metadata.user_id`: a JSON string that carries the session id.
fn claude_user_id(session: &str) -> String {
    json!({"device_id": "5d41402abc4b2a76b9719d911017c592", "account_uuid": "", "session_id": session})
        .to_string()
}

/// A Claude Code turn on the Anthropic Messages API.
fn claude_body(session: &str, turn: &str) -> serde_json::Value {
    json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": true,
        "system": [
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."}
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": turn}]}
        ],
        "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
        "metadata": {"user_id": claude_user_id(session)}
    })
}

fn claude_headers(session: Option<&str>) -> Vec<(&str, &str)> {
    let mut headers = vec![
        ("anthropic-version", "2023-06-01"),
        (
            "anthropic-beta",
            "claude-code-20250219,interleaved-thinking-2025-05-14",
        ),
        ("x-app", "cli"),
        ("user-agent", "claude-cli/2.1.88 (external, cli)"),
    ];
    if let Some(session) = session {
        headers.push(("x-claude-code-session-id", session));
    }
    headers
}

#[tokio::test(flavor = "current_thread")]
async fn claude_code_is_keyed_by_its_session_header() {
    let proxy = Proxy::new();
    let path = "/v1/messages?beta=true";
    let headers = claude_headers(Some(CLAUDE_SESSION));

    let first = proxy
        .send(path, &headers, claude_body(CLAUDE_SESSION, "fix the test"))
        .await;
    assert_eq!(first.key, key(CLAUDE_SESSION));
    assert_eq!(first.outcome, Outcome::NewSession);
    // The body names the session too, in its own form; the header wins.
    assert_eq!(first.body_key, key(&claude_user_id(CLAUDE_SESSION)));

    let second = proxy
        .send(path, &headers, claude_body(CLAUDE_SESSION, "now run it"))
        .await;
    assert_second_turn_is_home(&first, &second);
}

/// Claude Code counts a conversation's tokens (at its start, for `/context`) under the
/// session's header: the count is placed apart from the session, which stays where it was.
#[tokio::test(flavor = "current_thread")]
async fn claude_codes_token_counts_are_placed_apart_from_its_session() {
    let proxy = Proxy::new();
    let headers = claude_headers(Some(CLAUDE_SESSION));
    let first = proxy
        .send(
            "/v1/messages?beta=true",
            &headers,
            claude_body(CLAUDE_SESSION, "fix the test"),
        )
        .await;
    let mut count = claude_body(CLAUDE_SESSION, "fix the test");
    count.as_object_mut().unwrap().remove("max_tokens");
    count.as_object_mut().unwrap().remove("stream");
    let (counted, keys) = proxy
        .send_aside("/v1/messages/count_tokens?beta=true", &headers, count)
        .await;
    assert_eq!(counted.outcome, Outcome::Keyless);
    assert!(keys.is_empty(), "its key was not asked for: {keys:?}");
    let second = proxy
        .send(
            "/v1/messages?beta=true",
            &headers,
            claude_body(CLAUDE_SESSION, "now run it"),
        )
        .await;
    assert_second_turn_is_home(&first, &second);
}

/// A Claude Code conversation as it sends it, `turns` exchanges long: the billing line that
/// opens its system prompt (its `cch` value new with every request), the newest message
/// marked with `cache_control`.
fn claude_conversation(session: &str, turns: usize, cch: &str) -> serde_json::Value {
    let mut messages = Vec::new();
    for t in 0..turns {
        if t > 0 {
            messages.push(json!({"role": "assistant", "content": [
                {"type": "tool_use", "id": format!("toolu_{t}"), "name": "Bash",
                 "input": {"command": "cargo test"}}]}));
            messages.push(json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": format!("toolu_{t}"),
                 "content": format!("test result: ok. {t} passed")}]}));
        } else {
            messages.push(json!({"role": "user", "content": [
                {"type": "text", "text": "fix the failing test"}]}));
        }
    }
    let last = messages.last_mut().unwrap()["content"][0]
        .as_object_mut()
        .unwrap();
    last.insert("cache_control".into(), json!({"type": "ephemeral"}));
    json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": true,
        "system": [
            {"type": "text", "text": format!(
                "x-anthropic-billing-header: cc_version=2.1.120.cf9; cc_entrypoint=cli; cch={cch};")},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": {"type": "ephemeral"}}
        ],
        "messages": messages,
        "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
        "metadata": {"user_id": claude_user_id(session)}
    })
}

/// Each turn's chain extends the last one's, whatever the billing line's nonce and wherever
/// the `cache_control` marks stand: every later turn goes home as a home hit.
#[tokio::test(flavor = "current_thread")]
async fn claude_codes_turns_extend_each_other_through_its_billing_nonce() {
    let proxy = Proxy::new();
    let path = "/v1/messages?beta=true";
    let headers = claude_headers(Some(CLAUDE_SESSION));
    let mut last: Option<Placed> = None;
    for (turn, cch) in ["fa690", "1c8b4", "defa0", "03e7b"].into_iter().enumerate() {
        let body = claude_conversation(CLAUDE_SESSION, turn + 1, cch);
        let placed = proxy.send(path, &headers, body).await;
        if let Some(last) = &last {
            assert_second_turn_is_home(last, &placed);
            let (now, before) = (placed.chain.as_ref().unwrap(), last.chain.as_ref().unwrap());
            assert_eq!(now.common_prefix(before), before.len(), "turn {turn}");
            assert!(now.len() > before.len());
        }
        last = Some(placed);
    }
}

#[tokio::test(flavor = "current_thread")]
async fn claude_code_before_its_session_header_is_keyed_by_metadata_user_id() {
    let proxy = Proxy::new();
    let path = "/v1/messages?beta=true";
    let headers = claude_headers(None);

    let first = proxy
        .send(path, &headers, claude_body(CLAUDE_SESSION, "fix the test"))
        .await;
    assert_eq!(first.key, key(&claude_user_id(CLAUDE_SESSION)));
    assert_eq!(first.outcome, Outcome::NewSession);
    let second = proxy
        .send(path, &headers, claude_body(CLAUDE_SESSION, "now run it"))
        .await;
    assert_second_turn_is_home(&first, &second);

    // Another session of the same user and device is another key.
    let other = proxy
        .send(
            path,
            &headers,
            claude_body(CLAUDE_OTHER_SESSION, "fix the test"),
        )
        .await;
    assert_eq!(other.key, key(&claude_user_id(CLAUDE_OTHER_SESSION)));
    assert_ne!(other.key, first.key);
}

/// Claude Code 2.1.139 and later: a sub-agent's requests carry `X-Claude-Code-Agent-Id` (its
/// own id) beside the session's header, the main agent's none. Each sub-agent, with a prompt
/// of its own, is a session of its own within the session, as a Codex thread is; the main
/// agent's key is its session's.
#[tokio::test(flavor = "current_thread")]
async fn claude_code_keys_each_sub_agent_by_its_agent_id_within_the_session() {
    let proxy = Proxy::new();
    let path = "/v1/messages?beta=true";
    let main_headers = claude_headers(Some(CLAUDE_SESSION));
    let main = proxy
        .send(
            path,
            &main_headers,
            claude_body(CLAUDE_SESSION, "fix the test"),
        )
        .await;
    assert_eq!(main.key, key(CLAUDE_SESSION));

    let mut subagents = Vec::new();
    for agent in ["a8f3c2e1b4d5f607", "a19e0d7c6b5a4f32"] {
        let mut headers = claude_headers(Some(CLAUDE_SESSION));
        headers.push(("x-claude-code-agent-id", agent));
        let first = proxy
            .send(
                path,
                &headers,
                claude_body(CLAUDE_SESSION, "search for callers"),
            )
            .await;
        assert_eq!(first.outcome, Outcome::NewSession, "sub-agent {agent}");
        assert_ne!(first.key, main.key, "sub-agent {agent}");
        assert_ne!(first.key, key(agent), "scoped to its session: {agent}");
        let second = proxy
            .send(
                path,
                &headers,
                claude_body(CLAUDE_SESSION, "and their tests"),
            )
            .await;
        assert_second_turn_is_home(&first, &second);
        subagents.push(first.key);
    }
    assert_ne!(subagents[0], subagents[1]);

    // The same agent id in another session is another key.
    let mut headers = claude_headers(Some(CLAUDE_OTHER_SESSION));
    headers.push(("x-claude-code-agent-id", "a8f3c2e1b4d5f607"));
    let other = proxy
        .send(
            path,
            &headers,
            claude_body(CLAUDE_OTHER_SESSION, "search for callers"),
        )
        .await;
    assert!(!subagents.contains(&other.key));
}

// === Codex CLI ===

const CODEX_SESSION: &str = "019a7c2e-5b1d-7d40-9c3e-2f8a6b4d1e07";
const CODEX_SUBAGENT_1: &str = "019a7c31-0c2f-7a11-8e54-61b9d3f0a2c8";
const CODEX_SUBAGENT_2: &str = "019a7c31-7e90-7b25-a1d3-0c6e4f28b951";

/// A Codex turn on the Responses API. `prompt_cache_key` is the thread's id.
fn codex_body(thread: &str, instructions: &str, turn: &str) -> serde_json::Value {
    json!({
        "model": "gpt-5-codex",
        "instructions": instructions,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": turn}]}
        ],
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": false,
        "store": false,
        "stream": true,
        "include": [],
        "prompt_cache_key": thread
    })
}

/// Codex 0.131 and later: `session-id` for the session, `thread-id` for the agent thread.
fn codex_headers<'a>(session: &'a str, thread: &'a str, subagent: bool) -> Vec<(&'a str, &'a str)> {
    let mut headers = vec![
        ("originator", "codex_cli_rs"),
        (
            "user-agent",
            "codex_cli_rs/0.131.0 (Ubuntu 24.4.0; x86_64) xterm-256color",
        ),
        ("session-id", session),
        ("thread-id", thread),
        ("x-client-request-id", thread),
    ];
    if subagent {
        headers.push(("x-openai-subagent", "collab_spawn"));
    }
    headers
}

#[tokio::test(flavor = "current_thread")]
async fn codex_prefers_thread_id_over_session_id() {
    let proxy = Proxy::new();
    let main_prompt = "You are Codex, a coding agent.";
    let sub_prompt = "You are a sub-agent: review the diff you are given.";

    let main = proxy
        .send(
            "/v1/responses",
            &codex_headers(CODEX_SESSION, CODEX_SESSION, false),
            codex_body(CODEX_SESSION, main_prompt, "split the parser in two"),
        )
        .await;
    assert_eq!(main.key, key(CODEX_SESSION));

    // Two sub-agents of the same session: each its own thread, its own prompt, its own key.
    let mut subagents = Vec::new();
    for thread in [CODEX_SUBAGENT_1, CODEX_SUBAGENT_2] {
        let headers = codex_headers(CODEX_SESSION, thread, true);
        let first = proxy
            .send(
                "/v1/responses",
                &headers,
                codex_body(thread, sub_prompt, "review lexer.rs"),
            )
            .await;
        assert_eq!(first.key, key(thread));
        assert_eq!(first.outcome, Outcome::NewSession);
        let second = proxy
            .send(
                "/v1/responses",
                &headers,
                codex_body(thread, sub_prompt, "and parser.rs"),
            )
            .await;
        assert_second_turn_is_home(&first, &second);
        subagents.push(first.key);
    }
    assert_ne!(subagents[0], subagents[1]);
    assert!(!subagents.contains(&main.key));
}

/// Codex before 0.131, on the Chat Completions wire (`wire_api = "chat"`), as pointed at a
/// llama-server: `session_id` with an underscore, and no key in the body.
#[tokio::test(flavor = "current_thread")]
async fn codex_before_0_131_is_keyed_by_session_id() {
    let proxy = Proxy::new();
    let headers = [
        ("originator", "codex_cli_rs"),
        (
            "user-agent",
            "codex_cli_rs/0.60.1 (Ubuntu 24.4.0; x86_64) xterm-256color",
        ),
        ("session_id", CODEX_SESSION),
    ];
    let body = |turn: &str| {
        json!({
            "model": "qwen3-coder",
            "messages": [
                {"role": "system", "content": "You are Codex, a coding agent."},
                {"role": "user", "content": turn}
            ],
            "stream": true,
            "tools": []
        })
    };

    let first = proxy
        .send(
            "/v1/chat/completions",
            &headers,
            body("split the parser in two"),
        )
        .await;
    assert_eq!(first.key, key(CODEX_SESSION));
    assert_eq!(first.body_key, None);
    let second = proxy
        .send("/v1/chat/completions", &headers, body("now the tests"))
        .await;
    assert_second_turn_is_home(&first, &second);
}

/// Codex's last releases before 0.131 on the Chat Completions wire: `thread_id` beside
/// `session_id`, both with underscores, and no key in the body. A sub-agent's thread is its key.
#[tokio::test(flavor = "current_thread")]
async fn codex_before_0_131_with_thread_id_keys_each_sub_agent_by_its_thread() {
    let proxy = Proxy::new();
    let body = |system: &str, turn: &str| {
        json!({
            "model": "qwen3-coder",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": turn}
            ],
            "stream": true,
            "tools": []
        })
    };
    let headers = |thread| {
        [
            ("originator", "codex_cli_rs"),
            ("session_id", CODEX_SESSION),
            ("thread_id", thread),
        ]
    };
    let main_prompt = "You are Codex, a coding agent.";
    let sub_prompt = "You are a sub-agent: review the diff you are given.";

    let main = proxy
        .send(
            "/v1/chat/completions",
            &headers(CODEX_SESSION),
            body(main_prompt, "split the parser in two"),
        )
        .await;
    assert_eq!(main.key, key(CODEX_SESSION));
    assert_eq!(main.body_key, None);

    let mut subagents = Vec::new();
    for thread in [CODEX_SUBAGENT_1, CODEX_SUBAGENT_2] {
        let first = proxy
            .send(
                "/v1/chat/completions",
                &headers(thread),
                body(sub_prompt, "review lexer.rs"),
            )
            .await;
        assert_eq!(first.key, key(thread));
        assert_eq!(first.outcome, Outcome::NewSession);
        let second = proxy
            .send(
                "/v1/chat/completions",
                &headers(thread),
                body(sub_prompt, "and parser.rs"),
            )
            .await;
        assert_second_turn_is_home(&first, &second);
        subagents.push(first.key);
    }
    assert_ne!(subagents[0], subagents[1]);
    assert!(!subagents.contains(&main.key));

    // The main agent's next turn is still its own session's, not taken for a compaction.
    let next = proxy
        .send(
            "/v1/chat/completions",
            &headers(CODEX_SESSION),
            json!({
                "model": "qwen3-coder",
                "messages": [
                    {"role": "system", "content": main_prompt},
                    {"role": "user", "content": "split the parser in two"},
                    {"role": "assistant", "content": "Done: lexer.rs and parser.rs."},
                    {"role": "user", "content": "now the tests"}
                ],
                "stream": true,
                "tools": []
            }),
        )
        .await;
    assert_second_turn_is_home(&main, &next);
}

// === Goose ===

fn goose_body(turn: &str) -> serde_json::Value {
    json!({
        "model": "qwen3-coder",
        "messages": [
            {"role": "system", "content": "You are a general-purpose AI agent called goose."},
            {"role": "user", "content": turn}
        ],
        "tools": [{"type": "function", "function": {"name": "developer__shell", "parameters": {"type": "object"}}}],
        "stream": true,
        "stream_options": {"include_usage": true}
    })
}

#[tokio::test(flavor = "current_thread")]
async fn goose_is_keyed_by_agent_session_id() {
    let proxy = Proxy::new();
    let path = "/v1/chat/completions";
    let headers = [("user-agent", "goose"), ("agent-session-id", "20260809_29")];

    let first = proxy
        .send(path, &headers, goose_body("list the crates"))
        .await;
    assert_eq!(first.key, key("20260809_29"));
    assert_eq!(first.outcome, Outcome::NewSession);
    let second = proxy
        .send(path, &headers, goose_body("now build them"))
        .await;
    assert_second_turn_is_home(&first, &second);

    let other = proxy
        .send(
            path,
            &[("user-agent", "goose"), ("agent-session-id", "20260809_30")],
            goose_body("list the crates"),
        )
        .await;
    assert_eq!(other.key, key("20260809_30"));
    assert_eq!(other.outcome, Outcome::NewSession);
}

/// A Goose conversation `n + 1` tool calls long, as it sends it: before each call Goose puts an
/// `<info-msg>` (the time, the working directory, the tokens used) in front of the latest
/// assistant message's tool results, and never keeps it, so it stands one exchange later in
/// the next turn.
fn goose_conversation(n: usize) -> serde_json::Value {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a general-purpose AI agent called goose."}),
        json!({"role": "user", "content": "list the crates and build them"}),
    ];
    for k in 0..=n {
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": format!("call_{k}"), "type": "function", "function": {
                "name": "developer__shell",
                "arguments": format!("{{\"command\":\"cargo build -p c{k}\"}}")}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": format!("call_{k}"),
            "content": format!("Compiling c{k} ").repeat(100)}));
    }
    let info = json!({"role": "user", "content": format!(
        "<info-msg>\nIt is currently 2026-12-04 23:{n:02}:00\nWorking directory: /src/app\n</info-msg>")});
    let latest = messages.len() - 2;
    messages.insert(latest, info);
    json!({"model": "qwen3-coder", "messages": messages, "stream": true,
        "tools": [{"type": "function", "function": {"name": "developer__shell", "parameters": {"type": "object"}}}]})
}

/// Goose's moving info message: each turn's prompt differs from the last a few messages from
/// its end, so it does not extend it and reads as a *compaction*, and goes home, whose cache
/// still holds the prompt up to those messages. (The outcome says compaction where the cache
/// is mostly warm: a known limit of comparing a turn with the last one's end only.)
#[tokio::test(flavor = "current_thread")]
async fn gooses_moving_info_message_reads_as_a_compaction_and_goes_home() {
    let proxy = Proxy::new();
    let path = "/v1/chat/completions";
    let headers = [("user-agent", "goose"), ("agent-session-id", "20260809_31")];
    let first = proxy.send(path, &headers, goose_conversation(0)).await;
    for n in 1..4 {
        let next = proxy.send(path, &headers, goose_conversation(n)).await;
        assert_eq!(
            (next.outcome, &next.backend),
            (Outcome::Compaction, &first.backend),
            "turn {n}"
        );
        let (now, before) = (next.chain.as_ref().unwrap(), first.chain.as_ref().unwrap());
        // All but the turn's last few messages are shared with the first turn's prompt.
        assert!(now.common_prefix(before) >= 3, "turn {n}");
    }
}

// === opencode ===

/// opencode, with a provider of the user's own (not one of OpenCode's): `x-session-affinity`
/// and `X-Session-Id` name the session; a sub-agent is a child session with an id of its own.
#[tokio::test(flavor = "current_thread")]
async fn opencode_is_keyed_by_its_session_affinity_header() {
    let proxy = Proxy::new();
    let path = "/v1/chat/completions";
    let parent = "ses_2b4e1c7f9ffeY3kQ8mN1pR5tVw";
    let child = "ses_2b4e1d03affe8LmZ2xC6vB9nQa";
    let body = |turn: &str| {
        json!({
            "model": "qwen3-coder",
            "messages": [
                {"role": "system", "content": "You are opencode, an interactive CLI tool."},
                {"role": "user", "content": [{"type": "text", "text": turn}]}
            ],
            "stream": true
        })
    };
    let ua = ("user-agent", "opencode/1.0.150");

    let headers = [ua, ("x-session-affinity", parent), ("x-session-id", parent)];
    let first = proxy.send(path, &headers, body("explain main.rs")).await;
    assert_eq!(first.key, key(parent));
    let second = proxy.send(path, &headers, body("and lib.rs")).await;
    assert_second_turn_is_home(&first, &second);

    let headers = [
        ua,
        ("x-session-affinity", child),
        ("x-session-id", child),
        ("x-parent-session-id", parent),
    ];
    let sub = proxy
        .send(path, &headers, body("find the callers of parse"))
        .await;
    assert_eq!(sub.key, key(child));
    assert_eq!(sub.outcome, Outcome::NewSession);
}

// === OpenAI SDK users ===

#[tokio::test(flavor = "current_thread")]
async fn openai_sdk_users_are_keyed_by_prompt_cache_key_else_by_user() {
    let proxy = Proxy::new();
    let path = "/v1/chat/completions";
    let headers = [
        ("user-agent", "OpenAI/Python 1.109.1"),
        ("x-stainless-lang", "python"),
    ];
    let body = |turn: &str| {
        json!({
            "model": "qwen3-coder",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": turn}
            ],
            "prompt_cache_key": "conversation-8841",
            "user": "team-a"
        })
    };

    let first = proxy.send(path, &headers, body("summarise the log")).await;
    assert_eq!(first.key, key("conversation-8841"));
    assert_eq!(first.body_key, first.key);
    let second = proxy.send(path, &headers, body("shorter")).await;
    assert_second_turn_is_home(&first, &second);

    // Without `prompt_cache_key`, `user` names the session.
    let by_user = |turn: &str| {
        let mut body = body(turn);
        body.as_object_mut().unwrap().remove("prompt_cache_key");
        body
    };
    let first = proxy
        .send(path, &headers, by_user("summarise the log"))
        .await;
    assert_eq!(first.key, key("team-a"));
    assert_eq!(first.body_key, first.key);
    let second = proxy.send(path, &headers, by_user("shorter")).await;
    assert_second_turn_is_home(&first, &second);
}

// === Clients that send no key ===

/// The first turn of a client that names no session is keyless. (Later turns may be placed by
/// other means; only the first is asserted.)
async fn assert_keyless(
    proxy: &Proxy,
    path: &str,
    headers: &[(&str, &str)],
    body: serde_json::Value,
) {
    let first = proxy.send(path, headers, body).await;
    assert_eq!(first.key, None);
    assert_eq!(first.body_key, None);
    assert_eq!(first.outcome, Outcome::Keyless, "{first:?}");
}

/// Aider calls litellm's `completion` with the model, the messages, `temperature` and
/// `stream`; nothing names the session.
#[tokio::test(flavor = "current_thread")]
async fn aider_sends_no_key_and_is_keyless() {
    let body = json!({
        "model": "qwen3-coder",
        "messages": [
            {"role": "system", "content": "Act as an expert software developer."},
            {"role": "user", "content": "Add a --verbose flag to cli.py"}
        ],
        "stream": true,
        "temperature": 0
    });
    let headers = [("user-agent", "OpenAI/Python 1.99.9")];
    assert_keyless(&Proxy::new(), "/v1/chat/completions", &headers, body).await;
}

/// Cline's OpenAI-compatible provider sends the headers the user configured, and none of its
/// own that name the task.
#[tokio::test(flavor = "current_thread")]
async fn cline_sends_no_key_and_is_keyless() {
    let body = json!({
        "model": "qwen3-coder",
        "messages": [
            {"role": "system", "content": "You are Cline, a highly skilled software engineer."},
            {"role": "user", "content": [{"type": "text", "text": "<task>\nRename Foo to Bar\n</task>"}]}
        ],
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true}
    });
    let headers = [
        ("user-agent", "OpenAI/JS 4.96.0"),
        ("x-stainless-lang", "js"),
    ];
    assert_keyless(&Proxy::new(), "/v1/chat/completions", &headers, body).await;
}

/// Qwen Code's default OpenAI-compatible provider sends its User-Agent and the custom headers
/// the user configured; its session header goes to DashScope hosts only.
#[tokio::test(flavor = "current_thread")]
async fn qwen_code_sends_no_key_and_is_keyless() {
    let body = json!({
        "model": "qwen3-coder",
        "messages": [
            {"role": "system", "content": "You are Qwen Code, an interactive CLI agent."},
            {"role": "user", "content": "Why does the build fail?"}
        ],
        "stream": true,
        "stream_options": {"include_usage": true},
        "tools": [{"type": "function", "function": {"name": "run_shell_command", "parameters": {"type": "object"}}}]
    });
    let headers = [("user-agent", "QwenCode/0.2.0 (linux; x64)")];
    assert_keyless(&Proxy::new(), "/v1/chat/completions", &headers, body).await;
}

/// A Responses API backend that stores its responses in its own memory, as vLLM does:
/// a request naming a response another backend stored is answered 404.
fn storing_backend(
    name: &'static str,
) -> impl tower::Service<
    Req,
    Response = http::Response<String>,
    Error = Infallible,
    Future = impl Send,
> + Clone
       + Send {
    let stored = Arc::new(Mutex::new(Vec::<String>::new()));
    service_fn(move |req: Req| {
        let stored = stored.clone();
        async move {
            use http_body_util::BodyExt;
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let mut stored = stored.lock();
            if let Some(previous) = body["previous_response_id"].as_str() {
                if !stored.iter().any(|id| id == previous) {
                    let mut res =
                        http::Response::new(format!("Response with id '{previous}' not found."));
                    *res.status_mut() = http::StatusCode::NOT_FOUND;
                    return Ok(res);
                }
            }
            let id = format!("resp_{name}_{}", stored.len());
            stored.push(id.clone());
            Ok(http::Response::new(
                json!({"id": id, "object": "response"}).to_string(),
            ))
        }
    })
}

/// Clients of the Responses API that let the server keep the conversation (the OpenAI Agents
/// SDK, `previous_response_id`) send only the new input. Only the backend that stored the
/// response can continue it, so the request waits for that backend rather than spilling.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_responses_client_continuing_a_stored_response_reaches_the_backend_storing_it() {
    use http_body_util::BodyExt;
    let slot = NonZeroU32::new(1).unwrap();
    let fleet = StaticFleet::new([
        (
            "a1",
            Backend::new("node-a", storing_backend("a1")).slots(slot),
        ),
        (
            "a2",
            Backend::new("node-a", storing_backend("a2")).slots(slot),
        ),
    ]);
    let affinity = SessionAffinityLayer::new()
        .key(FirstOf::new(HeaderKey::default(), ExtensionKey))
        .layer(fleet);
    let svc = BodyKeyLayer::new().layer(affinity);
    let send = |body: serde_json::Value| {
        let req = http::Request::post("/v1/responses")
            .header("x-session-id", "s")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        svc.clone().oneshot(req)
    };
    let answer = |res: http::Response<_>| async move {
        let status = res.status();
        let bytes = BodyExt::collect(res.into_body()).await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
        (status, body["id"].as_str().unwrap_or_default().to_string())
    };
    let (status, first) = answer(send(json!({"input": "q1"})).await.unwrap()).await;
    assert_eq!(status, 200);
    // A turn of the session's in flight takes its home's only slot.
    let held = send(json!({"input": "q1, again"})).await.unwrap();
    let home = held.extensions().get::<Decision>().unwrap().backend.clone();
    assert!(first.starts_with(&format!("resp_{home}")));
    // The turn continuing the first response waits for that slot, where a turn of the session
    // would spill to the other backend, which would answer 404.
    let mut next =
        tokio_test::task::spawn(send(json!({"previous_response_id": first, "input": "q2"})));
    assert!(next.poll().is_pending());
    drop(held);
    let res = next.await.unwrap();
    assert_eq!(res.extensions().get::<Decision>().unwrap().backend, home);
    let (status, id) = answer(res).await;
    assert_eq!(status, 200);
    assert!(id.starts_with(&format!("resp_{home}")));
}
