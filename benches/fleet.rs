//! What announcing a fleet costs: `n` backends (8 a node) announced one after the other, each
//! applied to the fleet's topology as discovery applies it (placement's rendezvous inputs kept
//! up to date), through `Snapshot`, which builds the same topology without services.
//!
//! Run with `cargo bench --bench fleet`. A discovery change is rare next to requests; this
//! bench is here so that a fleet of thousands of backends stays cheap to announce and churn.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use tower_affinity::placement::Snapshot;

fn announce(c: &mut Criterion) {
    let mut g = c.benchmark_group("fleet");
    for n in [256usize, 2048, 8192] {
        let names: Vec<(String, String)> = (0..n)
            .map(|i| (format!("b{i}"), format!("n{}", i / 8)))
            .collect();
        g.bench_function(BenchmarkId::new("announce", n), |b| {
            b.iter(|| {
                let mut fleet = Snapshot::new();
                for (id, node) in &names {
                    fleet = fleet.backend(id, node, 4);
                }
                black_box(fleet)
            })
        });
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(10)
}

criterion_group! {
    name = benches;
    config = config();
    targets = announce
}
criterion_main!(benches);
