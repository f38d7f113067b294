//! Sixteen agents on twelve slots, through the proxy: the answers' usage teaches the service
//! each backend's prefill rate and request time, and a turn whose home is full waits for it
//! while that is cheaper than reading its prompt again elsewhere.
//!
//! The stubs take time as a modest GPU does (a cold prompt takes seconds to read, a warm one
//! a fraction of that) and the agents think between turns; the clock is tokio's paused one,
//! so the run takes milliseconds.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tokio::time::Instant;
use tower_affinity::Overflow;

use super::llama_stub::{Stub, Timing};
use super::{cli, start, Running};
use crate::app::Config;

const AGENTS: usize = 16;
const TURNS: usize = 8;
/// Tokens (bytes) a stub reads a second.
const PREFILL: f64 = 1_000.0;
const DECODE: Duration = Duration::from_secs(3);
/// A tool's run between an answer and the next turn: with it, the sixteen agents keep about
/// ten of the twelve slots busy on average, and more in bursts (a mild overload).
const THINK: Duration = Duration::from_secs(3);
/// The longest a turn may take, in the paused clock's time.
const TURN_DEADLINE: Duration = Duration::from_secs(3_600);

struct Turn {
    keyed: bool,
    /// Whether it reused at least 80% of the previous turn's prompt (`None` on the first).
    warm: Option<bool>,
    took: Duration,
}

fn system_prompt() -> String {
    "You are a coding agent working in a Rust repository. Read, then act. ".repeat(40)
}

fn spec() -> String {
    "SPEC: a todo service with an HTTP API, a store, and tests for both. ".repeat(15)
}

impl Running {
    async fn chat_within(&self, key: Option<&str>, body: &Value, deadline: Duration) -> Value {
        let mut req = Request::post(self.url("/v1/chat/completions"))
            .header("content-type", "application/json");
        if let Some(k) = key {
            req = req.header("x-session-id", k);
        }
        let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
        let res = tokio::time::timeout(deadline, self.client.request(req))
            .await
            .expect("an answer in time")
            .expect("the request went through");
        assert_eq!(res.status(), 200);
        let body = tokio::time::timeout(deadline, res.into_body().collect())
            .await
            .expect("a body in time")
            .expect("the body went through")
            .to_bytes();
        serde_json::from_slice(&body).expect("a JSON answer")
    }
}

async fn agent(proxy: Arc<Running>, n: usize, keyed: bool) -> Vec<Turn> {
    let name = format!("agent-{n}");
    let mut messages = vec![
        json!({"role": "system", "content": system_prompt()}),
        json!({"role": "user", "content": spec()}),
    ];
    let mut turns = Vec::with_capacity(TURNS);
    let mut previous: Option<u64> = None;
    // Agents start a little apart, as a swarm's do.
    tokio::time::sleep(Duration::from_millis(250 * n as u64)).await;
    for t in 0..TURNS {
        if t > 0 {
            let output = format!("tool output {t} of {name}: {}", "fn f() {} ".repeat(300));
            messages.push(json!({"role": "user", "content": output}));
        }
        let body = json!({"model": "stub", "messages": messages});
        let t0 = Instant::now();
        let key = keyed.then_some(name.as_str());
        let answer = proxy.chat_within(key, &body, TURN_DEADLINE).await;
        let took = t0.elapsed();
        let usage = &answer["usage"];
        let prompt = usage["prompt_tokens"].as_u64().unwrap();
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        turns.push(Turn {
            keyed,
            warm: previous.map(|p| cached as f64 >= 0.8 * p as f64),
            took,
        });
        previous = Some(prompt);
        let content = answer["choices"][0]["message"]["content"].clone();
        messages.push(json!({"role": "assistant", "content": content}));
        tokio::time::sleep(THINK).await;
    }
    turns
}

struct Run {
    keyed_warm: usize,
    warm: usize,
    later: usize,
    mean: Duration,
    served: Vec<usize>,
}

/// Sixteen agents, half keyed and half not, on 2 nodes x 2 backends x `slots`.
async fn run(slots: usize) -> Run {
    run_with(slots, None).await
}

/// The same, each backend with `context` tokens its requests in flight share, if given.
async fn run_with(slots: usize, context: Option<u64>) -> Run {
    let timing = Timing {
        prefill: PREFILL,
        decode: DECODE,
    };
    let names = ["a1", "a2", "b1", "b2"];
    let mut stubs = Vec::new();
    for name in names {
        stubs.push(Stub::start_timed(name, slots, timing).await);
    }
    let backends = stubs
        .iter()
        .zip(["node-a", "node-a", "node-b", "node-b"])
        .map(|(stub, node)| {
            let mut spec = format!("{node}={},slots={slots},id={}", stub.url(), stub.state.name);
            if let Some(tokens) = context {
                spec.push_str(&format!(",context={tokens}"));
            }
            cli::backend(&spec).unwrap().0
        })
        .collect();
    let mut config = Config::new(backends);
    config.probe_interval = None;
    config.overflow = Overflow::wait(TURN_DEADLINE, 1024);
    let proxy = Arc::new(start(config).await);
    let tasks: Vec<_> = (0..AGENTS)
        .map(|n| tokio::spawn(agent(proxy.clone(), n, n % 2 == 0)))
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("an agent finished"));
    }
    let later: Vec<&Turn> = all.iter().filter(|t| t.warm.is_some()).collect();
    let total: Duration = all.iter().map(|t| t.took).sum();
    Run {
        keyed_warm: later
            .iter()
            .filter(|t| t.keyed && t.warm == Some(true))
            .count(),
        warm: later.iter().filter(|t| t.warm == Some(true)).count(),
        later: later.len(),
        mean: total / all.len() as u32,
        served: stubs.iter().map(Stub::chats).collect(),
    }
}

#[tokio::test(start_paused = true)]
async fn sixteen_agents_on_twelve_slots_stay_warm_by_waiting_for_their_caches() {
    let tight = run(3).await;
    let roomy = run(4).await;
    let share = tight.warm as f64 / tight.later as f64;
    let ratio = tight.mean.as_secs_f64() / roomy.mean.as_secs_f64();
    let report = format!(
        "12 slots: {}/{} later turns warm ({:.1}%; {} of the keyed {}), mean turn {:.1} s, served {:?}; \
         16 slots: {}/{} warm, mean turn {:.1} s, served {:?}; ratio {ratio:.2}",
        tight.warm,
        tight.later,
        100.0 * share,
        tight.keyed_warm,
        tight.later / 2,
        tight.mean.as_secs_f64(),
        tight.served,
        roomy.warm,
        roomy.later,
        roomy.mean.as_secs_f64(),
        roomy.served,
    );
    println!("{report}");
    assert!(share >= 0.9, "{report}");
    assert!(ratio <= 1.2, "{report}");
}

/// The same agents on backends of four slots whose context holds about two of their later
/// prompts at once: the fleet is full by its contexts long before its slots, and a turn that
/// found every backend full waits for its own when a slot elsewhere frees, while that is
/// cheaper than reading its prompt again there. (Every later turn is warm here; when such a
/// turn took the first slot freed anywhere, 106 of the 112 were.)
#[tokio::test(start_paused = true)]
async fn sixteen_agents_on_backends_full_by_their_context_stay_warm_by_waiting_for_their_caches() {
    let run = run_with(4, Some(40_000)).await;
    let share = run.warm as f64 / run.later as f64;
    let report = format!(
        "{}/{} later turns warm ({:.1}%; {} of the keyed {}), mean turn {:.1} s, served {:?}",
        run.warm,
        run.later,
        100.0 * share,
        run.keyed_warm,
        run.later / 2,
        run.mean.as_secs_f64(),
        run.served,
    );
    println!("{report}");
    assert!(share >= 0.97, "{report}");
}

/// The sum over `/metrics` of one counter's series.
fn metric_sum(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(start_paused = true)]
async fn metrics_add_up_the_prompt_and_reused_tokens_the_backends_reported() {
    let timing = Timing {
        prefill: PREFILL,
        decode: Duration::from_millis(100),
    };
    let stub = Stub::start_timed("a1", 2, timing).await;
    let backend = format!("node-a={},slots=2,id=a1", stub.url());
    let mut config = Config::new(vec![cli::backend(&backend).unwrap().0]);
    config.probe_interval = None;
    let proxy = start(config).await;
    let mut messages = vec![json!({"role": "system", "content": system_prompt()})];
    let (mut prompt, mut reused) = (0, 0);
    for turn in 0..4 {
        messages.push(json!({"role": "user", "content": format!("turn {turn}: {}", spec())}));
        let answer = proxy
            .chat_within(
                Some("s"),
                &json!({"model": "stub", "messages": messages}),
                TURN_DEADLINE,
            )
            .await;
        prompt += answer["usage"]["prompt_tokens"].as_u64().unwrap();
        reused += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        messages.push(answer["choices"][0]["message"].clone());
    }
    let metrics = proxy.get("/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert_eq!(
        metric_sum(&text, "tower_affinity_backend_prompt_tokens_total"),
        prompt,
        "{text}"
    );
    assert_eq!(
        metric_sum(&text, "tower_affinity_backend_reused_tokens_total"),
        reused,
        "{text}"
    );
    assert!(reused > 0);
    // The same figures by how their requests were placed: one new session, then home hits
    // that reused all of it.
    assert_eq!(
        metric_sum(&text, "tower_affinity_prompt_tokens_total"),
        prompt
    );
    assert_eq!(
        metric_sum(&text, "tower_affinity_reused_tokens_total"),
        reused
    );
    let by_outcome = |name: &str, outcome: &str| {
        let series = format!("{name}{{outcome=\"{outcome}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&series)?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {series}in {text}"))
    };
    assert_eq!(
        by_outcome("tower_affinity_reused_tokens_total", "new-session"),
        0
    );
    assert_eq!(
        by_outcome("tower_affinity_reused_tokens_total", "home-hit"),
        reused
    );
    assert!(
        text.contains("tower_affinity_backend_prefill_tokens_per_second{"),
        "{text}"
    );
}
