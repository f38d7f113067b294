//! Allocations on the call path, counted by the allocator: a request placed on its home, its
//! decision kept in its body (`decision_extension(false)`), allocates nothing, with the
//! `metrics` feature too (its series by outcome are looked up by keys built without
//! allocating, in whichever recorder is installed then).
//!
//! The allocator counts the whole process, so this is a binary of its own, with one test.

#[path = "../../benches/common/mod.rs"]
mod common;

use std::alloc::System;
use std::hint::black_box;

use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use tower::Layer;
use tower_affinity::key::ExtensionKey;
use tower_affinity::SessionAffinityLayer;

use common::{call_now, key, request, Req, Shape};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

#[test]
fn a_home_hit_without_the_decision_extension_allocates_nothing() {
    const HOT: u64 = 64;
    const N: u64 = 1_000;
    let mut svc = SessionAffinityLayer::new()
        .key(ExtensionKey)
        .decision_extension(false)
        .layer(Shape::new(2, 2).fleet(1));
    for i in 0..HOT {
        drop(call_now(&mut svc, request(Some(key(i)))));
    }
    let reqs: Vec<Req> = (0..N).map(|i| request(Some(key(i % HOT)))).collect();
    let region = Region::new(GLOBAL);
    for req in reqs {
        drop(black_box(call_now(&mut svc, req)));
    }
    let s = region.change();
    assert_eq!((s.allocations, s.bytes_allocated), (0, 0), "{N} requests");
}
