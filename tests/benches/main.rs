//! What the bench binaries do with their own arguments, and that they hold to the commands
//! BENCHMARKS.md gives for them.

#[path = "../../benches/common/mod.rs"]
mod common;

use common::{measures, paired_rounds, Rounds};

fn rounds(args: &str) -> Rounds {
    let args: Vec<String> = args.split_whitespace().map(str::to_owned).collect();
    paired_rounds(&args)
}

#[test]
fn cargo_bench_measures_the_paired_rounds_with_no_filter_or_paired() {
    assert_eq!(rounds("--bench"), Rounds::Full);
    assert_eq!(rounds("--bench paired"), Rounds::Full);
    assert_eq!(rounds("--bench pair"), Rounds::Full);
}

#[test]
fn a_filter_of_criterion_benchmarks_skips_the_paired_rounds() {
    assert_eq!(rounds("--bench chained/"), Rounds::Skipped);
    assert_eq!(
        rounds("--bench chain/(from_body|serde_skip)/256KiB$ --noplot"),
        Rounds::Skipped
    );
    assert_eq!(
        rounds("--bench policy/home_hit --warm-up-time 1 --measurement-time 2"),
        Rounds::Skipped
    );
}

#[test]
fn an_options_value_is_no_filter() {
    assert_eq!(rounds("--bench --sample-size 10"), Rounds::Full);
    assert_eq!(
        rounds("--bench --save-baseline before paired"),
        Rounds::Full
    );
    assert_eq!(rounds("--bench --measurement-time=5"), Rounds::Full);
    assert_eq!(rounds("--bench -s before"), Rounds::Full);
}

#[test]
fn test_mode_runs_brief_rounds_as_criterion_runs_each_benchmark_once() {
    // `cargo test --all-targets` runs the binary without `--bench`.
    assert_eq!(rounds(""), Rounds::Brief);
    assert_eq!(rounds("--bench --test"), Rounds::Brief);
    assert_eq!(rounds("--bench paired --test"), Rounds::Brief);
}

#[test]
fn only_cargo_bench_measures_at_full_size() {
    let measures = |args: &str| {
        let args: Vec<String> = args.split_whitespace().map(str::to_owned).collect();
        measures(&args)
    };
    assert!(measures("--bench"));
    assert!(measures("--bench table/ --sample-size 10"));
    // `cargo test --all-targets`, and criterion's own test mode: the brief sizes.
    assert!(!measures(""));
    assert!(!measures("--bench --test"));
    assert!(!measures("table/"));
}

#[test]
fn listing_the_benchmarks_runs_no_rounds() {
    assert_eq!(rounds("--bench --list"), Rounds::Skipped);
    assert_eq!(rounds("--list"), Rounds::Skipped);
    assert_eq!(rounds("--bench --ignored"), Rounds::Skipped);
}

/// The functions of `source` whose names callgrind's `--toggle-collect='*measure*'` matches.
fn toggled(source: &str) -> Vec<&str> {
    source
        .split("fn ")
        .skip(1)
        .map(|rest| {
            rest.split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .next()
        })
        .filter_map(|name| name.filter(|n| n.contains("measure")))
        .collect()
}

/// BENCHMARKS.md divides what callgrind counts under `--toggle-collect='*measure*'` by the
/// number of measured calls: nothing else, a warm-up say, may run inside a function so named.
#[test]
fn callgrind_counts_only_the_measured_loops() {
    assert_eq!(
        toggled(include_str!("../../benches/callgrind.rs")),
        ["measure_calls", "measure_policy"]
    );
    assert_eq!(toggled(include_str!("../../benches/usage.rs")), ["measure"]);
}

fn callgrind(args: &str) -> Result<(u64, String, u64), String> {
    let args: Vec<String> = args.split_whitespace().map(str::to_owned).collect();
    let a = common::CallgrindArgs::parse(&args)?;
    Ok((a.n, a.shape.label(), a.sessions))
}

#[test]
fn callgrind_takes_its_documented_arguments_and_defaults() {
    assert_eq!(callgrind(""), Ok((10_000, "16x8".into(), 1024)));
    assert_eq!(callgrind("10000 16x8"), Ok((10_000, "16x8".into(), 1024)));
    assert_eq!(callgrind("5000 256x8"), Ok((5_000, "256x8".into(), 1024)));
    assert_eq!(
        callgrind("20000 64x8 100000"),
        Ok((20_000, "64x8".into(), 100_000))
    );
    assert_eq!(callgrind("200 2x2"), Ok((200, "2x2".into(), 1024)));
}

/// A count the run is divided by, or a fleet, that the bench cannot read is refused, not
/// replaced by the default: the figures would be another run's.
#[test]
fn callgrind_refuses_arguments_it_cannot_read() {
    assert!(callgrind("10k").is_err());
    assert!(callgrind("10000 64X8").is_err());
    assert!(callgrind("10000 32x8").is_err());
    assert!(callgrind("10000 16x8 many").is_err());
    // Home hits cycle over the sessions placed first: there must be one.
    assert!(callgrind("10000 16x8 0").is_err());
}

fn redis(args: &str) -> Result<(usize, u64), String> {
    let args: Vec<String> = args.split_whitespace().map(str::to_owned).collect();
    common::redis_args(&args)
}

#[test]
fn the_redis_bench_takes_rounds_and_requests() {
    assert_eq!(redis(""), Ok((21, 2_000)));
    assert_eq!(redis("5"), Ok((5, 2_000)));
    assert_eq!(redis("5 100"), Ok((5, 100)));
}

/// Medians and percentiles of no rounds, or of rounds of no requests, do not exist: the
/// bench refuses them rather than panic, and refuses a count it cannot read rather than
/// measure another.
#[test]
fn the_redis_bench_refuses_no_rounds_no_requests_and_what_it_cannot_read() {
    assert!(redis("0").is_err());
    assert!(redis("21 0").is_err());
    assert!(redis("twenty").is_err());
    assert!(redis("21 2k").is_err());
}

fn usage(args: &str) -> Result<(String, bool, u64), String> {
    let args: Vec<String> = args.split_whitespace().map(str::to_owned).collect();
    common::usage_args(&args).map(|(a, o, n)| (a.to_owned(), o, n))
}

#[test]
fn the_usage_bench_takes_an_answer_whether_observed_and_a_count() {
    assert_eq!(
        usage("json_4k observed 10000"),
        Ok(("json_4k".into(), true, 10_000))
    );
    assert_eq!(
        usage("sse_64 unobserved 500"),
        Ok(("sse_64".into(), false, 500))
    );
    assert_eq!(usage("sse_64"), Ok(("sse_64".into(), true, 10_000)));
}

/// The observer's cost is observed less unobserved: a mistyped `unobserved` measured as
/// observed, or a count that is not the one the total is divided by, gives a wrong figure
/// with nothing said.
#[test]
fn the_usage_bench_refuses_what_it_cannot_read() {
    assert!(usage("").is_err());
    assert!(usage("json_8k observed 10000").is_err());
    assert!(usage("json_4k unobservd 10000").is_err());
    assert!(usage("json_4k observed 10k").is_err());
}
