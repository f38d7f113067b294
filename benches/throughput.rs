//! Service throughput against tower's power-of-two-choices balancer (issue 6, part 2).
//!
//! The same 16 mock backends (4 nodes x 4, 8 slots each) answer at once. In the same run:
//!
//! - `affinity`: [`SessionAffinity`] with its defaults (session id from the `x-session-id`
//!   header, hashed with SHA-256; `NodeThenBackend`);
//! - `affinity_noext`: the same with `.decision_extension(false)`: no [`Decision`] put in the
//!   response's extensions (it stays readable from the response body);
//! - `affinity_live` (paired rounds only): the defaults again, with the fleet from a
//!   discovery channel that stays open (as in a proxy whose backends come and go) instead of
//!   a fixed list whose stream ends;
//! - `affinity_bare` (paired rounds only): `affinity_noext` with a stand-in key extractor that
//!   reads the same headers as the default one but digests the id with a 64-bit FNV-1a hash
//!   instead of SHA-256. Not a configuration to deploy (the digest is the design's, and this
//!   one is weak); it measures what the router costs without the two things the design asks
//!   of every request, the `Decision` extension and the SHA-256 of the key;
//! - `p2c`: `tower::balance::p2c::Balance` over `PendingRequests` wrappers of the same backends;
//! - `p2c_buffer` (multi-threaded only): one `Balance` shared by every caller through
//!   `tower::buffer::Buffer`, the usual way to share a balancer that is not `Clone`.
//!
//! A last set of paired rounds runs `affinity` and `p2c` again over backends whose responses
//! already carry an extension, as responses through hyper-util's client do (its connection
//! info): there the `Decision` costs one allocation instead of three.
//!
//! `keyed` requests carry one of 10,000 session ids (a home hit once every session has been
//! placed); `keyless` requests carry none. Every request is built inside the timed loop, for
//! every balancer alike; `build` is the cost of building and dropping the request alone.
//!
//! `throughput_st` runs one caller on a current-thread runtime. `throughput_mt` runs 32
//! concurrent callers on a two-worker runtime: each caller owns a clone of the affinity
//! service, or its own `Balance` (its own load counters), or a clone of the buffered one.
//!
//! Criterion's time per element is the wall time per request over all callers; its
//! elements per second are requests per second. Criterion measures one contender after the
//! other, so a change in the machine's other load between them moves their ratio; the
//! `paired` rounds that follow measure the ratios again, in rounds that alternate the
//! contenders (median and range printed as a table).
//!
//! Run with `cargo bench --bench throughput` (`cargo bench --bench throughput -- paired` for
//! the rounds alone).
//!
//! [`SessionAffinity`]: tower_affinity::SessionAffinity
//! [`Decision`]: tower_affinity::Decision

use std::fmt::Debug;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use tokio::runtime::Runtime;
use tower::balance::p2c::Balance;
use tower::buffer::Buffer;
use tower::discover::ServiceList;
use tower::load::{CompleteOnResponse, PendingRequests};
use tower::{Layer, Service, ServiceExt};
use tower_affinity::key::{HeaderKey, KeyExtractor, SessionKey};
use tower_affinity::SessionAffinityLayer;

#[path = "common/mod.rs"]
mod common;

use common::{header_request, mix as mix64, mock, mock_with_extension, Mock, Req, Shape};

const SHAPE: Shape = Shape::new(4, 4);
const SLOTS: u32 = 8;
const SESSIONS: u64 = 10_000;
const CALLERS: u64 = 32;

type P2c = Balance<ServiceList<Vec<PendingRequests<Mock>>>, Req>;

fn p2c() -> P2c {
    p2c_of(mock)
}

/// `p2c` over backends made by `backend`.
fn p2c_of(backend: fn() -> Mock) -> P2c {
    let backends = SHAPE
        .names()
        .iter()
        .map(|_| PendingRequests::new(backend(), CompleteOnResponse::default()))
        .collect::<Vec<_>>();
    Balance::new(ServiceList::new(backends))
}

/// The `affinity_bare` key extractor: the default `HeaderKey`'s headers, in its order, with
/// FNV-1a in place of SHA-256 (bench only).
fn bare_key() -> impl Fn(&Req) -> Option<SessionKey> + Clone + Send + Sync + 'static {
    let names: Vec<http::HeaderName> = HeaderKey::DEFAULT_NAMES
        .iter()
        .copied()
        .map(http::HeaderName::from_static)
        .collect();
    move |req: &Req| {
        names.iter().find_map(|name| {
            let raw = req.headers().get(name)?.as_bytes().trim_ascii();
            let h = raw.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            (!raw.is_empty())
                .then(|| SessionKey::from_u128(u128::from(mix64(h)) << 64 | u128::from(h)))
        })
    }
}

/// `affinity_bare` stands in for the default extractor: it finds a key in a request carrying
/// any one of the default names, as the default does, and looks every name up in a request
/// carrying none.
fn check_bare_key() {
    let (bare, default) = (bare_key(), HeaderKey::default());
    for name in HeaderKey::DEFAULT_NAMES {
        let mut req = http::Request::new(());
        req.headers_mut()
            .insert(*name, http::HeaderValue::from_static("agent-1"));
        assert!(default.extract(&req).is_some(), "the default reads {name}");
        assert!(
            bare(&req).is_some(),
            "affinity_bare reads {name} as the default does"
        );
    }
    let keyless = Mix::Keyless.request(0);
    assert!(bare(&keyless).is_none() && default.extract(&keyless).is_none());
}

/// How a bench makes its `i`-th request.
#[derive(Clone, Copy, Debug)]
enum Mix {
    Keyed,
    Keyless,
}

impl Mix {
    const ALL: [Mix; 2] = [Mix::Keyed, Mix::Keyless];

    fn name(self) -> &'static str {
        match self {
            Mix::Keyed => "keyed",
            Mix::Keyless => "keyless",
        }
    }

    fn request(self, i: u64) -> Req {
        match self {
            Mix::Keyed => header_request(i % SESSIONS),
            Mix::Keyless => http::Request::new(()),
        }
    }
}

/// Sends requests `first, first + step, ...` (`n` of them) one after the other, dropping each
/// response (which frees its slot).
async fn drive<S>(svc: &mut S, mix: Mix, first: u64, step: u64, n: u64)
where
    S: Service<Req>,
    S::Error: Debug,
{
    for j in 0..n {
        let req = mix.request(first + j * step);
        let res = svc
            .ready()
            .await
            .expect("ready")
            .call(req)
            .await
            .expect("answered");
        drop(black_box(res));
    }
}

/// One caller, `iters` requests, on a current-thread runtime.
fn single<S>(rt: &Runtime, svc: &mut S, mix: Mix, cursor: &mut u64, iters: u64) -> Duration
where
    S: Service<Req>,
    S::Error: Debug,
{
    let first = *cursor;
    *cursor += iters;
    rt.block_on(async {
        let start = Instant::now();
        drive(svc, mix, first, 1, iters).await;
        start.elapsed()
    })
}

/// `CALLERS` concurrent callers sharing `iters` requests, each with its own service handle.
/// The handles are moved into the tasks and handed back, so that none is built while timed.
fn concurrent<S>(
    rt: &Runtime,
    svcs: &mut Vec<S>,
    mix: Mix,
    cursor: &mut u64,
    iters: u64,
) -> Duration
where
    S: Service<Req> + Send + 'static,
    S::Error: Debug,
    S::Future: Send,
    S::Response: Send,
{
    let first = *cursor;
    *cursor += iters;
    rt.block_on(async {
        let start = Instant::now();
        let tasks: Vec<_> = svcs
            .drain(..)
            .zip(0..CALLERS)
            .map(|(mut svc, c)| {
                let n = iters / CALLERS + u64::from(c < iters % CALLERS);
                tokio::spawn(async move {
                    drive(&mut svc, mix, first + c, CALLERS, n).await;
                    svc
                })
            })
            .collect();
        for t in tasks {
            svcs.push(t.await.expect("caller finished"));
        }
        start.elapsed()
    })
}

fn current_thread() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn two_workers() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// "median (min to max)" of the rounds' ratios of `theirs` to `ours` (rates: ours over theirs).
fn ratio<const N: usize>(times: &[[Duration; N]], ours: usize, theirs: usize) -> String {
    let mut r: Vec<f64> = times
        .iter()
        .map(|t| t[theirs].as_secs_f64() / t[ours].as_secs_f64())
        .collect();
    r.sort_by(f64::total_cmp);
    let (median, min, max) = (r[r.len() / 2], r[0], r[r.len() - 1]);
    format!("{median:.2}x ({min:.2}x to {max:.2}x)")
}

fn single_threaded(c: &mut Criterion) {
    let rt = current_thread();
    let mut g = c.benchmark_group("throughput_st");
    g.throughput(Throughput::Elements(1));
    for mix in Mix::ALL {
        g.bench_function(BenchmarkId::new("build", mix.name()), |b| {
            let mut i = 0u64;
            b.iter(|| {
                i += 1;
                drop(black_box(mix.request(i)))
            })
        });
        let mut affinity = SessionAffinityLayer::new().layer(SHAPE.fleet(SLOTS));
        let mut cursor = 0;
        g.bench_function(BenchmarkId::new("affinity", mix.name()), |b| {
            b.iter_custom(|iters| single(&rt, &mut affinity, mix, &mut cursor, iters))
        });
        let mut noext = SessionAffinityLayer::new()
            .decision_extension(false)
            .layer(SHAPE.fleet(SLOTS));
        let mut cursor = 0;
        g.bench_function(BenchmarkId::new("affinity_noext", mix.name()), |b| {
            b.iter_custom(|iters| single(&rt, &mut noext, mix, &mut cursor, iters))
        });
        let mut balance = p2c();
        let mut cursor = 0;
        g.bench_function(BenchmarkId::new("p2c", mix.name()), |b| {
            b.iter_custom(|iters| single(&rt, &mut balance, mix, &mut cursor, iters))
        });
    }
    g.finish();
}

fn multi_threaded(c: &mut Criterion) {
    let rt = two_workers();
    let mut g = c.benchmark_group("throughput_mt");
    g.throughput(Throughput::Elements(1));
    for mix in Mix::ALL {
        let affinity = SessionAffinityLayer::new().layer(SHAPE.fleet(SLOTS));
        let mut handles: Vec<_> = (0..CALLERS).map(|_| affinity.clone()).collect();
        let mut cursor = 0;
        g.bench_function(BenchmarkId::new("affinity", mix.name()), |b| {
            b.iter_custom(|iters| concurrent(&rt, &mut handles, mix, &mut cursor, iters))
        });
        let noext = SessionAffinityLayer::new()
            .decision_extension(false)
            .layer(SHAPE.fleet(SLOTS));
        let mut handles: Vec<_> = (0..CALLERS).map(|_| noext.clone()).collect();
        let mut cursor = 0;
        g.bench_function(BenchmarkId::new("affinity_noext", mix.name()), |b| {
            b.iter_custom(|iters| concurrent(&rt, &mut handles, mix, &mut cursor, iters))
        });
        let mut balancers: Vec<P2c> = (0..CALLERS).map(|_| p2c()).collect();
        let mut cursor = 0;
        g.bench_function(BenchmarkId::new("p2c", mix.name()), |b| {
            b.iter_custom(|iters| concurrent(&rt, &mut balancers, mix, &mut cursor, iters))
        });
        let buffered = {
            let _guard = rt.enter();
            Buffer::new(p2c(), 1024)
        };
        let mut buffers: Vec<_> = (0..CALLERS).map(|_| buffered.clone()).collect();
        let mut cursor = 0;
        g.bench_function(BenchmarkId::new("p2c_buffer", mix.name()), |b| {
            b.iter_custom(|iters| concurrent(&rt, &mut buffers, mix, &mut cursor, iters))
        });
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20)
}

criterion_group! {
    name = benches;
    config = config();
    targets = single_threaded, multi_threaded
}

/// The ratios, measured in alternating rounds: in each round every contender serves the same
/// number of requests, one after the other, in an order that rotates from round to round. A
/// change in the machine's other load then touches every contender alike, and the median of
/// the rounds' ratios is what the targets are judged on.
fn paired(rounds: usize, per_round: u64) {
    let st = current_thread();
    let mt = two_workers();
    println!("\n## Paired rounds ({rounds} rounds of {per_round} requests a contender)\n");
    println!(
        "| runtime | requests | affinity / p2c: median (min to max) | affinity_noext / p2c: median (min to max) | affinity_live / p2c: median (min to max) | affinity_bare / p2c: median (min to max) | p2c, median |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|");
    for mix in Mix::ALL {
        let mut affinity = SessionAffinityLayer::new().layer(SHAPE.fleet(SLOTS));
        let mut noext = SessionAffinityLayer::new()
            .decision_extension(false)
            .layer(SHAPE.fleet(SLOTS));
        let (_handle, stream) = SHAPE.live_fleet(SLOTS);
        let mut live = SessionAffinityLayer::new().layer(stream);
        let mut bare = SessionAffinityLayer::new()
            .key(bare_key())
            .decision_extension(false)
            .layer(SHAPE.fleet(SLOTS));
        let mut balance = p2c();
        let mut cursors = [0u64; CONTENDERS];
        let times = common::rotating_rounds::<_, CONTENDERS>(rounds, |who| match who {
            0 => single(&st, &mut affinity, mix, &mut cursors[0], per_round),
            1 => single(&st, &mut noext, mix, &mut cursors[1], per_round),
            2 => single(&st, &mut live, mix, &mut cursors[2], per_round),
            3 => single(&st, &mut bare, mix, &mut cursors[3], per_round),
            _ => single(&st, &mut balance, mix, &mut cursors[P2C], per_round),
        });
        report("current-thread, 1 caller", mix, per_round, &times);
    }
    for mix in Mix::ALL {
        let affinity = SessionAffinityLayer::new().layer(SHAPE.fleet(SLOTS));
        let mut affinity: Vec<_> = (0..CALLERS).map(|_| affinity.clone()).collect();
        let noext = SessionAffinityLayer::new()
            .decision_extension(false)
            .layer(SHAPE.fleet(SLOTS));
        let mut noext: Vec<_> = (0..CALLERS).map(|_| noext.clone()).collect();
        let (_handle, stream) = SHAPE.live_fleet(SLOTS);
        let live = SessionAffinityLayer::new().layer(stream);
        let mut live: Vec<_> = (0..CALLERS).map(|_| live.clone()).collect();
        let bare = SessionAffinityLayer::new()
            .key(bare_key())
            .decision_extension(false)
            .layer(SHAPE.fleet(SLOTS));
        let mut bare: Vec<_> = (0..CALLERS).map(|_| bare.clone()).collect();
        let mut balancers: Vec<P2c> = (0..CALLERS).map(|_| p2c()).collect();
        let mut cursors = [0u64; CONTENDERS];
        let n = 2 * per_round;
        let times = common::rotating_rounds::<_, CONTENDERS>(rounds, |who| match who {
            0 => concurrent(&mt, &mut affinity, mix, &mut cursors[0], n),
            1 => concurrent(&mt, &mut noext, mix, &mut cursors[1], n),
            2 => concurrent(&mt, &mut live, mix, &mut cursors[2], n),
            3 => concurrent(&mt, &mut bare, mix, &mut cursors[3], n),
            _ => concurrent(&mt, &mut balancers, mix, &mut cursors[P2C], n),
        });
        report("2 workers, 32 callers", mix, n, &times);
    }
}

/// `affinity` against `p2c` over backends whose responses carry an extension, as a real
/// client's do, on both runtimes and for both kinds of request.
fn paired_client_like(rounds: usize, per_round: u64) {
    let st = current_thread();
    let mt = two_workers();
    println!(
        "\n## Paired rounds over backends whose responses carry an extension \
         ({rounds} rounds of {per_round} requests a contender)\n"
    );
    println!("| runtime | requests | affinity / p2c: median (min to max) |");
    println!("|---|---|---:|");
    for mix in Mix::ALL {
        let mut affinity =
            SessionAffinityLayer::new().layer(SHAPE.fleet_of(SLOTS, mock_with_extension));
        let mut balance = p2c_of(mock_with_extension);
        let mut cursors = [0u64; 2];
        let times = common::rotating_rounds::<_, 2>(rounds, |who| match who {
            0 => single(&st, &mut affinity, mix, &mut cursors[0], per_round),
            _ => single(&st, &mut balance, mix, &mut cursors[1], per_round),
        });
        println!(
            "| current-thread, 1 caller | {} | {} |",
            mix.name(),
            ratio(&times, 0, 1)
        );
    }
    for mix in Mix::ALL {
        let affinity =
            SessionAffinityLayer::new().layer(SHAPE.fleet_of(SLOTS, mock_with_extension));
        let mut affinity: Vec<_> = (0..CALLERS).map(|_| affinity.clone()).collect();
        let mut balancers: Vec<P2c> = (0..CALLERS).map(|_| p2c_of(mock_with_extension)).collect();
        let mut cursors = [0u64; 2];
        let n = 2 * per_round;
        let times = common::rotating_rounds::<_, 2>(rounds, |who| match who {
            0 => concurrent(&mt, &mut affinity, mix, &mut cursors[0], n),
            _ => concurrent(&mt, &mut balancers, mix, &mut cursors[1], n),
        });
        println!(
            "| 2 workers, 32 callers | {} | {} |",
            mix.name(),
            ratio(&times, 0, 1)
        );
    }
}

/// The contenders of a paired round: `affinity`, `affinity_noext`, `affinity_live`,
/// `affinity_bare`, `p2c`.
const CONTENDERS: usize = 5;
const P2C: usize = CONTENDERS - 1;

fn report(runtime: &str, mix: Mix, n: u64, times: &[[Duration; CONTENDERS]]) {
    let mut p2c: Vec<f64> = times.iter().map(|t| t[P2C].as_secs_f64()).collect();
    p2c.sort_by(f64::total_cmp);
    let p2c_rate = n as f64 / p2c[p2c.len() / 2] / 1e6;
    println!(
        "| {runtime} | {} | {} | {} | {} | {} | {p2c_rate:.2} M/s |",
        mix.name(),
        ratio(times, 0, P2C),
        ratio(times, 1, P2C),
        ratio(times, 2, P2C),
        ratio(times, 3, P2C),
    );
}

fn main() {
    check_bare_key();
    common::main_with_paired(benches, |full| {
        if full {
            paired(21, 100_000);
            paired_client_like(21, 100_000);
        } else {
            paired(1, 1_000);
            paired_client_like(1, 1_000);
        }
    });
}
