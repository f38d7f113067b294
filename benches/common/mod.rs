//! Helpers shared by the bench binaries: fleets of mock backends that answer at once, session
//! keys, and a driver that runs a service call to completion without a runtime.
//!
//! Each bench binary uses only some of these helpers.
#![allow(dead_code)]

use std::convert::Infallible;
use std::fmt::Debug;
use std::future::{ready, Future, Ready};
use std::num::NonZeroU32;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body_util::Empty;
use tower::{service_fn, Service};
use tower_affinity::discover::{self, FleetChannel, FleetHandle, StaticFleet};
use tower_affinity::key::SessionKey;
use tower_affinity::placement::Snapshot;
use tower_affinity::Backend;

/// The request every bench sends.
pub(crate) type Req = http::Request<()>;
/// The response every mock backend gives.
pub(crate) type Res = http::Response<Empty<Bytes>>;

/// A mock model server that answers at once with an empty body.
pub(crate) type Mock = tower::util::ServiceFn<fn(Req) -> Ready<Result<Res, Infallible>>>;

fn answer(_req: Req) -> Ready<Result<Res, Infallible>> {
    ready(Ok(http::Response::new(Empty::new())))
}

/// What a response through hyper-util's client carries in its extensions (its connection
/// info), so that its extensions map is already allocated when the router adds to it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnInfo(#[allow(dead_code)] u64);

fn answer_with_extension(_req: Req) -> Ready<Result<Res, Infallible>> {
    let mut res = http::Response::new(Empty::new());
    res.extensions_mut().insert(ConnInfo(1));
    ready(Ok(res))
}

thread_local! {
    /// When a [`mock_timed`] backend was last handed a request, on this thread.
    static HANDED: std::cell::Cell<Option<std::time::Instant>> = const { std::cell::Cell::new(None) };
}

fn answer_timed(_req: Req) -> Ready<Result<Res, Infallible>> {
    HANDED.with(|h| h.set(Some(std::time::Instant::now())));
    ready(Ok(http::Response::new(Empty::new())))
}

/// When a [`mock_timed`] backend was last handed a request on this thread (taken: the next
/// call gives `None` until another request is handed over).
#[allow(dead_code)]
pub(crate) fn handed() -> Option<std::time::Instant> {
    HANDED.with(|h| h.take())
}

/// One mock backend that notes when it is handed a request (see [`handed`]): where a
/// request's call path ends.
#[allow(dead_code)]
pub(crate) fn mock_timed() -> Mock {
    service_fn(answer_timed as fn(Req) -> Ready<Result<Res, Infallible>>)
}

/// One mock backend.
pub(crate) fn mock() -> Mock {
    service_fn(answer as fn(Req) -> Ready<Result<Res, Infallible>>)
}

/// One mock backend whose responses already carry an extension, as a real client's do.
#[allow(dead_code)]
pub(crate) fn mock_with_extension() -> Mock {
    service_fn(answer_with_extension as fn(Req) -> Ready<Result<Res, Infallible>>)
}

/// A fleet shape: nodes x backends per node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    pub(crate) nodes: usize,
    pub(crate) per_node: usize,
}

impl Shape {
    pub(crate) const fn new(nodes: usize, per_node: usize) -> Self {
        Shape { nodes, per_node }
    }

    pub(crate) fn label(&self) -> String {
        format!("{}x{}", self.nodes, self.per_node)
    }

    /// Every (backend id, node id) pair, node by node.
    pub(crate) fn names(&self) -> Vec<(String, String)> {
        let mut v = Vec::with_capacity(self.nodes * self.per_node);
        for n in 0..self.nodes {
            for b in 0..self.per_node {
                v.push((format!("n{n}-b{b}"), format!("n{n}")));
            }
        }
        v
    }

    /// The fleet as a static discovery stream of mock backends with `slots` slots each.
    pub(crate) fn fleet(&self, slots: u32) -> StaticFleet<Mock> {
        self.fleet_of(slots, mock)
    }

    /// [`fleet_with_cache`](Self::fleet_with_cache), the router assigning each backend's
    /// slots.
    #[allow(dead_code)]
    pub(crate) fn fleet_with_assigned_slots(&self, slots: u32, tokens: u64) -> StaticFleet<Mock> {
        let slots = NonZeroU32::new(slots).unwrap_or(NonZeroU32::MIN);
        StaticFleet::new(self.names().into_iter().map(|(id, node)| {
            let b = Backend::new(node, mock())
                .slots(slots)
                .cache_tokens(tokens)
                .assign_slots();
            (id, b)
        }))
    }

    /// The same fleet of backends made by `backend`.
    pub(crate) fn fleet_of(&self, slots: u32, backend: fn() -> Mock) -> StaticFleet<Mock> {
        let slots = NonZeroU32::new(slots).unwrap_or(NonZeroU32::MIN);
        StaticFleet::new(
            self.names()
                .into_iter()
                .map(|(id, node)| (id, Backend::new(node, backend()).slots(slots))),
        )
    }

    /// The fleet of mock backends with `slots` slots, each declaring a cache of `tokens`.
    #[allow(dead_code)]
    pub(crate) fn fleet_with_cache(&self, slots: u32, tokens: u64) -> StaticFleet<Mock> {
        self.fleet_with_cache_of(slots, tokens, mock)
    }

    /// The same fleet of backends made by `backend`.
    #[allow(dead_code)]
    pub(crate) fn fleet_with_cache_of(
        &self,
        slots: u32,
        tokens: u64,
        backend: fn() -> Mock,
    ) -> StaticFleet<Mock> {
        let slots = NonZeroU32::new(slots).unwrap_or(NonZeroU32::MIN);
        StaticFleet::new(self.names().into_iter().map(|(id, node)| {
            let b = Backend::new(node, backend())
                .slots(slots)
                .cache_tokens(tokens);
            (id, b)
        }))
    }

    /// [`fleet_with_cache`](Self::fleet_with_cache), each backend taking at most `context`
    /// tokens a request, as a health probe reading llama-server's `/slots` gives them.
    #[allow(dead_code)]
    pub(crate) fn fleet_with_request_context(
        &self,
        slots: u32,
        tokens: u64,
        context: u64,
    ) -> StaticFleet<Mock> {
        let slots = NonZeroU32::new(slots).unwrap_or(NonZeroU32::MIN);
        let context = std::num::NonZeroU64::new(context).unwrap_or(std::num::NonZeroU64::MIN);
        StaticFleet::new(self.names().into_iter().map(|(id, node)| {
            let b = Backend::new(node, mock())
                .slots(slots)
                .cache_tokens(tokens)
                .request_context_tokens(context);
            (id, b)
        }))
    }

    /// The same fleet as a live discovery channel, as a proxy whose backends come and go has:
    /// the stream stays open as long as the handle lives.
    pub(crate) fn live_fleet(&self, slots: u32) -> (FleetHandle<Mock>, FleetChannel<Mock>) {
        let slots = NonZeroU32::new(slots).unwrap_or(NonZeroU32::MIN);
        let (handle, stream) = discover::channel();
        for (id, node) in self.names() {
            handle.insert(id, Backend::new(node, mock()).slots(slots));
        }
        (handle, stream)
    }

    /// The fleet as a hand-built snapshot with `slots` slots each, all idle.
    pub(crate) fn snapshot(&self, slots: u32) -> Snapshot {
        self.names()
            .iter()
            .fold(Snapshot::new(), |s, (id, node)| s.backend(id, node, slots))
    }
}

/// The fleets of the issue: 2x2, 16x8, 64x8, 256x8.
pub(crate) const SHAPES: [Shape; 4] = [
    Shape::new(2, 2),
    Shape::new(16, 8),
    Shape::new(64, 8),
    Shape::new(256, 8),
];

/// The callgrind bench's arguments after its scenario: `N [FLEET] [SESSIONS]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CallgrindArgs {
    /// Calls (or policy decisions) inside `measure*`.
    pub(crate) n: u64,
    /// The fleet.
    pub(crate) shape: Shape,
    /// Sessions placed first.
    pub(crate) sessions: u64,
}

impl CallgrindArgs {
    /// Reads `N [FLEET] [SESSIONS]` (defaults 10,000, 16x8, 1,024). What it cannot read is an
    /// error, not the default: the total is divided by `N`, and a fleet mistyped would be
    /// another run's.
    pub(crate) fn parse(args: &[String]) -> Result<Self, String> {
        let n = count_arg(args, 0, "N", 10_000)?;
        let shape = match args.get(1) {
            None => Shape::new(16, 8),
            Some(f) => SHAPES
                .into_iter()
                .find(|s| s.label() == *f)
                .ok_or_else(|| format!("FLEET is 2x2, 16x8, 64x8 or 256x8, not {f:?}"))?,
        };
        // Home hits cycle over the sessions placed first.
        let sessions = count_arg(args, 2, "SESSIONS", 1024)?;
        if sessions == 0 {
            return Err("SESSIONS must be at least 1".into());
        }
        Ok(CallgrindArgs { n, shape, sessions })
    }
}

/// The redis bench's arguments, `[ROUNDS] [REQUESTS]` (the words after `--`, options left
/// out): rounds, and requests a round, each at least one (medians and percentiles of none do
/// not exist). What it cannot read is an error, not the default.
pub(crate) fn redis_args(args: &[String]) -> Result<(usize, u64), String> {
    let rounds = count_arg(args, 0, "ROUNDS", 21)?;
    let n = count_arg(args, 1, "REQUESTS", 2_000)?;
    if rounds == 0 || n == 0 {
        return Err("ROUNDS and REQUESTS must be at least 1".into());
    }
    let rounds = usize::try_from(rounds).map_err(|_| format!("ROUNDS {rounds} is too many"))?;
    Ok((rounds, n))
}

/// The usage bench's arguments after `callgrind`: `json_4k|sse_64 [observed|unobserved]
/// [COUNT]`: the answer, whether it is observed, and the count. What it cannot read is an
/// error, not the default.
pub(crate) fn usage_args(args: &[String]) -> Result<(&str, bool, u64), String> {
    let answer = args
        .first()
        .filter(|a| ["json_4k", "sse_64"].contains(&a.as_str()))
        .ok_or(
            "the answer is json_4k or sse_64 (callgrind json_4k|sse_64 observed|unobserved COUNT)",
        )?;
    let observed = match args.get(1).map(String::as_str) {
        None | Some("observed") => true,
        Some("unobserved") => false,
        Some(v) => return Err(format!("observed or unobserved, not {v:?}")),
    };
    let count = count_arg(args, 2, "COUNT", 10_000)?;
    Ok((answer, observed, count))
}

/// The whole number `args[at]`, called `what` in an error, or `default` without one.
fn count_arg(args: &[String], at: usize, what: &str, default: u64) -> Result<u64, String> {
    match args.get(at) {
        None => Ok(default),
        Some(v) => v
            .parse()
            .map_err(|_| format!("{what} must be a whole number, not {v:?}")),
    }
}

/// A finaliser that spreads every input bit over the output (SplitMix64).
pub(crate) const fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Something carried in a request's extensions that the service does not read: a request as
/// costly to build and drop as one carrying `T`, for a baseline.
#[allow(dead_code)]
#[derive(Clone, Debug)]
pub(crate) struct Unread<T>(pub(crate) T);

/// Fills a service's cache models to their budgets with `n` finished conversations of 40
/// links (keyed from `1 << 50`), so that what follows runs at steady state: each new link
/// recorded evicts an old one, and no table grows.
#[allow(dead_code)]
pub(crate) fn fill_caches<S>(svc: &mut S, n: u64)
where
    S: Service<Req>,
    S::Error: Debug,
{
    for d in 0..n {
        let chain = tower_affinity::PromptChain::from_blocks((0..40).map(|i| (d << 32 | i, 50)));
        let mut req = request(Some(key((1 << 50) + d)));
        req.extensions_mut()
            .insert(tower_affinity::key::PromptFacts::from_chain(chain));
        drop(call_now(svc, req));
    }
}

/// The `n`-th distinct session key of a bench: a well-spread 128-bit digest, as SHA-256 would
/// give, without paying for SHA-256.
pub(crate) fn key(n: u64) -> SessionKey {
    SessionKey::from_u128(u128::from(mix(n)) << 64 | u128::from(mix(!n)))
}

/// A request carrying `key` in its extensions (for [`ExtensionKey`]), or none.
///
/// [`ExtensionKey`]: tower_affinity::key::ExtensionKey
pub(crate) fn request(key: Option<SessionKey>) -> Req {
    let mut req = http::Request::new(());
    if let Some(k) = key {
        req.extensions_mut().insert(k);
    }
    req
}

/// A request with the headers an OpenAI Python client sends and no session key: the default
/// `HeaderKey` looks every one of its names up and finds none.
pub(crate) fn keyless_request() -> Req {
    let mut req = http::Request::new(());
    for (name, value) in [
        ("host", "127.0.0.1:8080"),
        ("content-type", "application/json"),
        ("authorization", "Bearer sk-no-key"),
        ("user-agent", "OpenAI/Python 1.99.0"),
        ("accept", "application/json"),
        ("x-stainless-lang", "python"),
    ] {
        req.headers_mut()
            .insert(name, http::HeaderValue::from_static(value));
    }
    req
}

/// A request carrying session `n` in the `x-session-id` header (for the default `HeaderKey`).
pub(crate) fn header_request(n: u64) -> Req {
    let mut req = http::Request::new(());
    let value = http::HeaderValue::from_str(&format!("agent-{n:08}"))
        .expect("ascii digits are a valid header value");
    req.headers_mut().insert("x-session-id", value);
    req
}

/// Runs one call to completion: readiness, `call`, and a single poll of the response future,
/// which must be ready at once (the backends answer at once and never wait for a slot).
pub(crate) fn call_now<S, R>(svc: &mut S, req: R) -> S::Response
where
    S: Service<R>,
    S::Error: Debug,
{
    let mut cx = Context::from_waker(Waker::noop());
    match svc.poll_ready(&mut cx) {
        Poll::Ready(Ok(())) => {}
        Poll::Ready(Err(e)) => panic!("service failed: {e:?}"),
        Poll::Pending => panic!("service not ready at once"),
    }
    let mut fut = pin!(svc.call(req));
    match fut.as_mut().poll(&mut cx) {
        Poll::Ready(Ok(res)) => res,
        Poll::Ready(Err(e)) => panic!("call failed: {e:?}"),
        Poll::Pending => panic!("call did not complete at once"),
    }
}

/// The `main` of a bench with paired rounds: criterion's groups, then the paired rounds as
/// [`paired_rounds`] says for the binary's arguments.
#[allow(dead_code)]
pub(crate) fn main_with_paired(groups: fn(), paired: impl FnOnce(bool)) {
    let args: Vec<String> = std::env::args().skip(1).collect();
    groups();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
    match paired_rounds(&args) {
        Rounds::Full => paired(true),
        Rounds::Brief => paired(false),
        Rounds::Skipped => {}
    }
}

/// How a bench's paired rounds run for the arguments criterion was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rounds {
    /// Measured: `cargo bench`, no filter or one that "paired" contains.
    Full,
    /// Run once and brief, as criterion runs each benchmark once: `cargo test` (no
    /// `--bench`), or `--test`.
    Brief,
    /// Not run: a filter the rounds do not match, `--list`, or `--ignored`.
    Skipped,
}

/// Criterion's options that take a value (the next argument unless given as `--name=value`):
/// that value is no filter.
const VALUED: [&str; 20] = [
    "-c",
    "--color",
    "--colour",
    "-s",
    "--save-baseline",
    "-b",
    "--baseline",
    "--baseline-lenient",
    "--format",
    "--profile-time",
    "--load-baseline",
    "--sample-size",
    "--warm-up-time",
    "--measurement-time",
    "--nresamples",
    "--noise-threshold",
    "--confidence-level",
    "--significance-level",
    "--plotting-backend",
    "--output-format",
];

/// What the paired rounds do for a bench binary's arguments (the program's name left out).
/// The filter is taken as a part of "paired", as criterion takes a plain word as a part of a
/// benchmark's name.
#[allow(dead_code)]
pub(crate) fn paired_rounds(args: &[String]) -> Rounds {
    let flag = |f: &str| args.iter().any(|a| a == f);
    if flag("--list") || flag("--ignored") {
        return Rounds::Skipped;
    }
    let mut filter = None;
    let mut valued = false;
    for a in args {
        if std::mem::take(&mut valued) {
            continue;
        }
        if a.starts_with('-') {
            valued = VALUED.contains(&a.as_str());
        } else if filter.is_none() {
            filter = Some(a.as_str());
        }
    }
    if filter.is_some_and(|f| !"paired".contains(f)) {
        Rounds::Skipped
    } else if measures(args) {
        Rounds::Full
    } else {
        Rounds::Brief
    }
}

/// Whether a bench binary given `args` (the program's name left out) measures: `cargo bench`
/// passes `--bench`; `cargo test`, which runs every bench once to show that it works, passes
/// neither it nor criterion's `--test`.
#[allow(dead_code)]
pub(crate) fn measures(args: &[String]) -> bool {
    let flag = |f: &str| args.iter().any(|a| a == f);
    flag("--bench") && !flag("--test")
}

/// `full` when this binary measures ([`measures`] its arguments), else `brief`: a setup that
/// alone takes long unoptimised (a million sessions placed, a mebibyte's prompt chain) runs
/// at the brief size under `cargo test`, which only shows that the bench works.
#[allow(dead_code)]
pub(crate) fn sized<T>(full: T, brief: T) -> T {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if measures(&args) {
        full
    } else {
        brief
    }
}

/// Runs `N` contenders once a round, each round starting with a different one, after one
/// unmeasured round (caches warm, sessions placed); returns each round's `N` results.
#[allow(dead_code)]
pub(crate) fn rotating_rounds<T: Copy + Default, const N: usize>(
    rounds: usize,
    mut run: impl FnMut(usize) -> T,
) -> Vec<[T; N]> {
    for who in 0..N {
        run(who);
    }
    (0..rounds)
        .map(|r| {
            let mut t = [T::default(); N];
            for k in 0..N {
                let who = (r + k) % N;
                t[who] = run(who);
            }
            t
        })
        .collect()
}

/// A coding agent's chat body of about `bytes` bytes: an 8 KiB system prompt, a spec, then
/// tool calls and tool outputs of about 3 KiB of code, with escapes.
pub(crate) fn chat_body(bytes: usize) -> Vec<u8> {
    let code = "fn main() {\n    println!(\"hello, {}\", name);\n}\n".repeat(64);
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a coding agent. ".repeat(350)}),
        serde_json::json!({"role": "user", "content": "Build the todo app in the spec.\n".repeat(120)}),
    ];
    let mut n = 0;
    while serde_json::to_vec(&messages).map_or(0, |v| v.len()) < bytes {
        n += 1;
        messages.push(serde_json::json!({
            "role": "assistant",
            "content": format!("Step {n}: reading the file."),
            "tool_calls": [{"id": format!("call_{n}"), "type": "function",
                "function": {"name": "read_file", "arguments": "{\"path\":\"src/main.rs\"}"}}]
        }));
        messages.push(serde_json::json!({
            "role": "tool", "tool_call_id": format!("call_{n}"), "content": code
        }));
    }
    serde_json::to_vec(&serde_json::json!({
        "model": "qwen", "stream": true, "messages": messages
    }))
    .expect("a body")
}
