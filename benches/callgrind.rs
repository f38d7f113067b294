//! Fixed-count scenarios for `valgrind --tool=callgrind`, which counts instructions exactly
//! where timings on a shared machine are noisy (issue 6: profiling a missed target).
//!
//! Each scenario sets up a fleet and runs `N` calls inside `measure*` functions, so that
//! `--toggle-collect='*measure*'` counts only the measured calls; divide by `N`:
//!
//! ```text
//! cargo bench --bench callgrind --no-run
//! valgrind --tool=callgrind --toggle-collect='*measure*' \
//!     target/release/deps/callgrind-<hash> home_hit 10000 16x8
//! callgrind_annotate --inclusive=yes callgrind.out.<pid>
//! ```
//!
//! Scenarios (whole call path unless `policy_`): `direct`, `home_hit`, `home_hit_chain` (a
//! prompt chain on every request, growing two links a turn), `home_hit_chain_unread` (the same
//! chains where the service does not look), `home_hit_chain_limited` (the same, each backend
//! taking at most 32,768 tokens a request, as a probe of llama-server's `/slots` gives),
//! `home_hit_chain_completions` (the same on a chat completion's path),
//! `home_hit_chain_assigned` (that, on backends whose slots the router assigns),
//! `new_session`,
//! `keyless`, `header_home_hit`, `header_keyless` (a request with an OpenAI client's headers
//! and no key, through the default `HeaderKey`: every name looked up), `header_keyless_7` (the
//! same, the defaults less `thread_id`, as they were before it), `policy_home_hit`, `policy_new_session`, `policy_keyless`,
//! `policy_view`; `home_hit_noext`, `new_session_noext` and `keyless_noext` build the service
//! with `.decision_extension(false)`; `direct_resext` and `home_hit_resext` use backends whose
//! responses already carry an extension, as responses through hyper-util's client do;
//! `chain_body` is `PromptFacts::from_body` alone on the 256 KiB chat body of
//! `--bench chain`. Optional arguments: the fleet (`2x2`, `16x8`, `64x8`, `256x8`; default 16x8)
//! and the number of sessions placed first (default 1024; home hits cycle over them). An
//! unknown scenario, or an argument it cannot read, is an error (exit status 2), not the
//! default.
//!
//! Run by `cargo bench` without a scenario, it prints this usage and exits.

use std::hint::black_box;

use tower::Layer;
use tower_affinity::key::{ExtensionKey, HeaderKey, PromptFacts};
use tower_affinity::placement::NodeThenBackend;
use tower_affinity::{PromptChain, SessionAffinityLayer, Sessions};

#[path = "common/mod.rs"]
mod common;

use common::{
    call_now, chat_body, header_request, key, keyless_request, mock, mock_with_extension, request,
    CallgrindArgs, Mock, Req,
};

/// The cache budget of each backend in the chain scenarios: room for its share of the live
/// sessions' chains, with older conversations filling the rest.
const CACHE_TOKENS: u64 = 200_000;

/// Runs `f` on every request; the only code callgrind counts for call-path scenarios.
#[inline(never)]
fn measure_calls(reqs: Vec<Req>, f: &mut dyn FnMut(Req)) {
    for r in reqs {
        f(r);
    }
}

/// Runs `f(i)` for `i` in `0..n`; the only code callgrind counts for policy scenarios.
#[inline(never)]
fn measure_policy(n: u64, f: &mut dyn FnMut(u64)) {
    for i in 0..n {
        f(i);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(what) = args.first().filter(|a| !a.starts_with('-')) else {
        println!("usage: callgrind SCENARIO N [FLEET] [SESSIONS] (see the source's doc comment)");
        return;
    };
    let CallgrindArgs { n, shape, sessions } = match CallgrindArgs::parse(&args[1..]) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("callgrind: {e}");
            std::process::exit(2);
        }
    };
    // `home_hit_noext` and the like: the same scenario with `.decision_extension(false)`;
    // `direct_resext`, `home_hit_resext`: backends whose responses already carry an extension.
    let (what, extension) = match what.strip_suffix("_noext") {
        Some(base) => (base, false),
        None => (what.as_str(), true),
    };
    let (what, backend): (&str, fn() -> Mock) = match what.strip_suffix("_resext") {
        Some(base) => (base, mock_with_extension),
        None => (what, mock),
    };
    match what {
        "chain_body" => {
            let body = chat_body(256 << 10);
            measure_policy(n, &mut |_| {
                drop(black_box(PromptFacts::from_body(black_box(&body))));
            });
        }
        "direct" => {
            let mut b = backend();
            let reqs = (0..n).map(|i| request(Some(key(i % sessions)))).collect();
            measure_calls(reqs, &mut |r| drop(black_box(call_now(&mut b, r))));
        }
        "home_hit" | "new_session" | "keyless" => {
            let bound = usize::try_from(sessions + sessions / 10).expect("fits");
            let mut svc = SessionAffinityLayer::new()
                .key(ExtensionKey)
                .decision_extension(extension)
                .sessions(Sessions::new().max_entries(bound.max(100_000)))
                .layer(shape.fleet_of(1, backend));
            for i in 0..sessions {
                drop(call_now(&mut svc, request(Some(key(i)))));
            }
            let reqs = (0..n)
                .map(|i| match what {
                    "home_hit" => request(Some(key(i * 999_983 % sessions))),
                    "new_session" => request(Some(key((1 << 40) + i))),
                    _ => request(None),
                })
                .collect();
            measure_calls(reqs, &mut |r| drop(black_box(call_now(&mut svc, r))));
            eprintln!("{:?}", svc.stats());
        }
        "home_hit_chain"
        | "home_hit_chain_unread"
        | "home_hit_chain_limited"
        | "home_hit_chain_completions"
        | "home_hit_chain_assigned" => {
            // Home hits whose requests carry a prompt chain that grows by two links a turn, as
            // `BodyKeyLayer` would attach: the cache model's lookup and update on each. With
            // `_unread`, the same chains under a type the service does not read: the requests
            // cost the same to build and drop, and the difference is the cache model's.
            let unread = what.ends_with("_unread");
            let chain = |s: u64, t: u64| {
                let links = (0..20 + 2 * t).map(|i| (s << 32 | i, 50));
                PromptFacts::from_chain(PromptChain::from_blocks(links))
            };
            // A completion's path, which a backend whose slots the router assigns is given
            // one for (the other cases' requests have none).
            let completions = matches!(
                what,
                "home_hit_chain_completions" | "home_hit_chain_assigned"
            );
            let with = |s: u64, t: u64| {
                let mut r = request(Some(key(s)));
                if completions {
                    *r.uri_mut() = http::Uri::from_static("/v1/chat/completions");
                }
                if unread {
                    r.extensions_mut().insert(common::Unread(chain(s, t)));
                } else {
                    r.extensions_mut().insert(chain(s, t));
                }
                r
            };
            // Caches at their budgets, as in a fleet that has run a while (see `fill_caches`).
            let fleet = match what {
                "home_hit_chain_limited" => {
                    shape.fleet_with_request_context(1, CACHE_TOKENS, 32_768)
                }
                "home_hit_chain_assigned" => shape.fleet_with_assigned_slots(1, CACHE_TOKENS),
                _ => shape.fleet_with_cache(1, CACHE_TOKENS),
            };
            let mut svc = SessionAffinityLayer::new()
                .key(ExtensionKey)
                .decision_extension(extension)
                .layer(fleet);
            common::fill_caches(&mut svc, 20 * sessions);
            for i in 0..sessions {
                drop(call_now(&mut svc, with(i, 0)));
            }
            let reqs = (0..n)
                .map(|i| with(i % sessions, 1 + i / sessions))
                .collect();
            measure_calls(reqs, &mut |r| drop(black_box(call_now(&mut svc, r))));
            eprintln!("{:?}", svc.stats());
        }
        "header_home_hit" => {
            let mut svc = SessionAffinityLayer::new().layer(shape.fleet(1));
            for i in 0..sessions {
                drop(call_now(&mut svc, header_request(i)));
            }
            let reqs = (0..n).map(|i| header_request(i % sessions)).collect();
            measure_calls(reqs, &mut |r| drop(black_box(call_now(&mut svc, r))));
        }
        "header_keyless" | "header_keyless_7" => {
            let names = HeaderKey::DEFAULT_NAMES
                .iter()
                .filter(|n| what == "header_keyless" || **n != "thread_id");
            let mut svc = SessionAffinityLayer::new()
                .key(HeaderKey::new(names))
                .layer(shape.fleet(1));
            let reqs = (0..n).map(|_| keyless_request()).collect();
            measure_calls(reqs, &mut |r| drop(black_box(call_now(&mut svc, r))));
        }
        "policy_home_hit" | "policy_new_session" | "policy_keyless" | "policy_view" => {
            let p = NodeThenBackend::new();
            let snap = shape.snapshot(1);
            let k = key(0);
            let home = snap.choose(&p, Some(k), None).expect("room");
            let home = home.as_str().to_owned();
            measure_policy(n, &mut |i| match what {
                "policy_home_hit" => drop(black_box(snap.choose(&p, Some(k), Some(&home)))),
                "policy_new_session" => {
                    drop(black_box(snap.choose(&p, Some(key(i % sessions)), None)))
                }
                "policy_view" => drop(black_box(snap.view().len())),
                _ => drop(black_box(snap.choose(&p, None, None))),
            });
        }
        other => {
            eprintln!("callgrind: unknown scenario {other} (see the source's doc comment)");
            std::process::exit(2);
        }
    }
}
