//! `DnsFleet` against a real authoritative DNS server on 127.0.0.1 (hickory-server, started by
//! each test on its own runtime), whose records the tests change between resolutions.
//!
//! Time is paused, so the TTL, the floor, the ceiling and the retry interval are tested to the
//! second without sleeping. A paused runtime with nothing to run moves its clock to the next
//! timer, which while a query is out is the resolver's query timeout: the answer from loopback
//! is normally in by then (the server runs on the same runtime, and the I/O that wakes it
//! stops the jump), but nothing promises it. So every wait for an answer runs inside
//! [`answered`], which holds the clock still until it ends; the one wait for a timeout (a
//! stopped server) lets the clock run.

mod server;
#[path = "../support/logs.rs"]
mod support_logs;

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use futures_core::Stream;
use hickory_server::proto::rr::RecordType;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};
use server::Dns;
use tower::discover::Change;
use tower::{service_fn, Layer, ServiceExt};
use tower_affinity::discover::dns::{
    DnsEndpoint, DnsErrorKind, DnsFleet, DnsFleetBuilder, IpStrategy,
};
use tower_affinity::{Backend, BackendId, Decision, SessionAffinityLayer};

/// Runs `fut` (a wait for DNS answers) with the paused clock held still: a blocking task
/// keeps tokio from moving it, so the resolver's timeouts cannot fire while the server's
/// answer is on its way over loopback. Bounded: after 10 s of real time the clock is let go,
/// the resolver times out, and the test fails on what it finds.
async fn answered<F: Future>(fut: F) -> F::Output {
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let hold = tokio::task::spawn_blocking(move || {
        let _ = wait.recv_timeout(Duration::from_secs(10));
    });
    let out = fut.await;
    drop(done);
    hold.await.unwrap();
    out
}

/// Lets `secs` of (paused) time pass, and the tasks due run: for checking that nothing
/// resolved meanwhile.
async fn quiet(secs: u64) {
    tokio::time::advance(Duration::from_secs(secs)).await;
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

/// One change as the tests compare them: `+id@node` or `-id`.
fn show<S>(change: &Change<BackendId, Backend<S>>) -> String {
    match change {
        Change::Insert(id, b) => format!("+{id}@{}", b.node()),
        Change::Remove(id) => format!("-{id}"),
    }
}

/// The changes the stream has ready, in order. Outside tokio's cooperative budget, as the
/// service drains discovery: the channel behind the stream would otherwise say "pending"
/// after a hundred-odd changes.
async fn ready<S>(fleet: &mut DnsFleet<S>) -> Vec<Change<BackendId, Backend<S>>> {
    tokio::task::coop::unconstrained(std::future::poll_fn(|cx| {
        let mut out = Vec::new();
        for _ in 0..1_000 {
            match Pin::new(&mut *fleet).poll_next(cx) {
                Poll::Ready(Some(Ok(change))) => out.push(change),
                Poll::Ready(Some(Err(e))) => match e {},
                Poll::Ready(None) | Poll::Pending => break,
            }
        }
        Poll::Ready(out)
    }))
    .await
}

async fn ready_shown<S>(fleet: &mut DnsFleet<S>) -> Vec<String> {
    let mut shown: Vec<String> = ready(fleet).await.iter().map(show).collect();
    shown.sort();
    shown
}

fn builder(dns: &Dns, target: &str) -> DnsFleetBuilder {
    DnsFleet::builder(target.parse().unwrap())
        .nameserver(dns.addr)
        .timeout(Duration::from_secs(1))
        .attempts(1)
}

#[tokio::test(start_paused = true)]
async fn a_records_with_a_port_become_backends() {
    let dns = start_dns().await;
    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.1", "10.0.0.2"])
        .await;
    let mut fleet = builder(&dns, "llm.fleet.test.:8080")
        .slots(NonZeroU32::new(4).unwrap())
        .cache_tokens(65_536)
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    let handle = fleet.handle();
    assert_eq!(answered(handle.resolved(1)).await, 1);

    let changes = ready(&mut fleet).await;
    let mut shown: Vec<String> = changes.iter().map(show).collect();
    shown.sort();
    // Default node: the IP address.
    assert_eq!(
        shown,
        ["+10.0.0.1:8080@10.0.0.1", "+10.0.0.2:8080@10.0.0.2"]
    );
    for change in &changes {
        let Change::Insert(id, b) = change else {
            unreachable!()
        };
        assert_eq!(b.service().to_string(), id.as_str());
        assert_eq!(b.slot_count().get(), 4);
        assert!(b.slots_given());
        assert_eq!(b.cache_budget(), 65_536);
    }
    let stats = handle.stats();
    assert_eq!(
        (stats.resolutions, stats.failures, stats.backends),
        (1, 0, 2)
    );
    assert!(stats.last_error.is_none());
}

#[tokio::test(start_paused = true)]
async fn a_changed_record_set_is_an_insert_and_a_removal() {
    let dns = start_dns().await;
    dns.set_ips("llm.fleet.test.", 10, &["10.0.0.1", "10.0.0.2"])
        .await;
    let mut fleet = builder(&dns, "llm.fleet.test.:8080")
        .min_interval(Duration::from_secs(1))
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    let handle = fleet.handle();
    answered(handle.resolved(1)).await;
    assert_eq!(ready(&mut fleet).await.len(), 2);

    // The same answer again: nothing to announce.
    tokio::time::advance(Duration::from_secs(10)).await;
    answered(handle.resolved(2)).await;
    assert!(ready(&mut fleet).await.is_empty());

    dns.set_ips("llm.fleet.test.", 10, &["10.0.0.2", "10.0.0.3"])
        .await;
    tokio::time::advance(Duration::from_secs(10)).await;
    answered(handle.resolved(3)).await;
    assert_eq!(
        ready_shown(&mut fleet).await,
        ["+10.0.0.3:8080@10.0.0.3", "-10.0.0.1:8080"]
    );
    assert_eq!(handle.stats().backends, 2);

    // A refresh resolves at once, without waiting for the TTL.
    dns.set_ips("llm.fleet.test.", 10, &["10.0.0.3"]).await;
    handle.refresh();
    answered(handle.resolved(4)).await;
    assert_eq!(ready_shown(&mut fleet).await, ["-10.0.0.2:8080"]);
}

#[tokio::test(start_paused = true)]
async fn an_address_missing_within_the_removal_grace_is_kept_without_a_change() {
    let dns = start_dns().await;
    let all = ["10.0.0.1", "10.0.0.2", "10.0.0.3"];
    dns.set_ips("llm.fleet.test.", 5, &all).await;
    let mut fleet = builder(&dns, "llm.fleet.test.:8080")
        .min_interval(Duration::from_secs(1))
        .removal_grace(Duration::from_secs(20))
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    let handle = fleet.handle();
    answered(handle.resolved(1)).await;
    assert_eq!(ready(&mut fleet).await.len(), 3);

    // An answer every 5 s (the TTL), each with a subset of the three: no change at all.
    let answers: [&[&str]; 7] = [
        &["10.0.0.2", "10.0.0.3"], // t = 5 s: 10.0.0.1 missing
        &["10.0.0.1", "10.0.0.3"], // 10 s: back; 10.0.0.2 missing
        &["10.0.0.1", "10.0.0.2"], // 15 s
        &["10.0.0.2", "10.0.0.3"], // 20 s: 10.0.0.1 missing again, its grace from now
        &["10.0.0.2", "10.0.0.3"], // 25 s
        // 25 s after 10.0.0.1 first went missing, but 10 s since it last did: kept.
        &["10.0.0.2", "10.0.0.3"], // 30 s
        &all,                      // 35 s
    ];
    for (n, ips) in (2..).zip(answers) {
        dns.set_ips("llm.fleet.test.", 5, ips).await;
        tokio::time::advance(Duration::from_secs(5)).await;
        answered(handle.resolved(n)).await;
        assert!(ready(&mut fleet).await.is_empty(), "answer {n}: {ips:?}");
        // Still in the fleet, so still counted.
        assert_eq!(handle.stats().backends, 3, "answer {n}: {ips:?}");
    }
    assert_eq!(handle.failures(), 0);
}

#[tokio::test(start_paused = true)]
async fn an_address_missing_past_the_removal_grace_is_removed() {
    let dns = start_dns().await;
    // A TTL of an hour under a ceiling as long: only the grace brings a resolution sooner.
    let both = ["10.0.0.1", "10.0.0.2"];
    dns.set_ips("llm.fleet.test.", 3600, &both).await;
    let mut fleet = builder(&dns, "llm.fleet.test.:8080")
        .min_interval(Duration::from_secs(5))
        .max_interval(Duration::from_secs(3600))
        .removal_grace(Duration::from_secs(10))
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    let handle = fleet.handle();
    answered(handle.resolved(1)).await;
    assert_eq!(ready(&mut fleet).await.len(), 2);
    let start = tokio::time::Instant::now();

    // t = 0: 10.0.0.1 goes missing; its grace ends at 10 s, which is when the next
    // resolution comes, and removes it.
    dns.set_ips("llm.fleet.test.", 3600, &["10.0.0.2"]).await;
    handle.refresh();
    answered(handle.resolved(2)).await;
    assert!(
        ready(&mut fleet).await.is_empty(),
        "removed within its grace"
    );
    assert_eq!(handle.stats().backends, 2);
    quiet(9).await;
    assert_eq!(
        handle.resolutions(),
        2,
        "resolved again before the grace ended"
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    answered(handle.resolved(3)).await;
    assert_eq!(start.elapsed(), Duration::from_secs(10));
    assert_eq!(ready_shown(&mut fleet).await, ["-10.0.0.1:8080"]);
    assert_eq!(handle.stats().backends, 1);

    // Back (a new insert), and missing again at 10 s: its grace ends at 20 s.
    dns.set_ips("llm.fleet.test.", 3600, &both).await;
    handle.refresh();
    answered(handle.resolved(4)).await;
    assert_eq!(ready_shown(&mut fleet).await, ["+10.0.0.1:8080@10.0.0.1"]);
    dns.set_ips("llm.fleet.test.", 3600, &["10.0.0.2"]).await;
    handle.refresh();
    answered(handle.resolved(5)).await;
    assert!(
        ready(&mut fleet).await.is_empty(),
        "removed within its grace"
    );
    // A resolution at 18 s still keeps it; its grace ends 2 s later, under the 5 s floor:
    // the next resolution comes at the floor, 23 s.
    quiet(8).await;
    handle.refresh();
    answered(handle.resolved(6)).await;
    assert!(
        ready(&mut fleet).await.is_empty(),
        "removed within its grace"
    );
    quiet(4).await;
    assert_eq!(handle.resolutions(), 6, "resolved again before the floor");
    tokio::time::advance(Duration::from_secs(1)).await;
    answered(handle.resolved(7)).await;
    assert_eq!(start.elapsed(), Duration::from_secs(23));
    assert_eq!(ready_shown(&mut fleet).await, ["-10.0.0.1:8080"]);

    // No grace running: the TTL decides again.
    quiet(600).await;
    assert_eq!(
        handle.resolutions(),
        7,
        "resolved again before the TTL ran out"
    );
    assert_eq!(handle.failures(), 0);
}

#[tokio::test(start_paused = true)]
async fn without_a_removal_grace_a_missing_address_is_removed_at_once() {
    let dns = start_dns().await;
    let both = ["10.0.0.1", "10.0.0.2"];
    // The default, and a grace of zero given.
    for grace in [None, Some(Duration::ZERO)] {
        dns.set_ips("llm.fleet.test.", 30, &both).await;
        let mut b = builder(&dns, "llm.fleet.test.:8080");
        if let Some(grace) = grace {
            b = b.removal_grace(grace);
        }
        let mut fleet = b.build(|ep: &DnsEndpoint| ep.addr()).unwrap();
        let handle = fleet.handle();
        answered(handle.resolved(1)).await;
        assert_eq!(ready(&mut fleet).await.len(), 2);

        dns.set_ips("llm.fleet.test.", 30, &["10.0.0.2"]).await;
        handle.refresh();
        answered(handle.resolved(2)).await;
        assert_eq!(
            ready_shown(&mut fleet).await,
            ["-10.0.0.1:8080"],
            "{grace:?}"
        );
        assert_eq!(handle.stats().backends, 1);

        // Back in the next answer: inserted anew.
        dns.set_ips("llm.fleet.test.", 30, &both).await;
        handle.refresh();
        answered(handle.resolved(3)).await;
        assert_eq!(
            ready_shown(&mut fleet).await,
            ["+10.0.0.1:8080@10.0.0.1"],
            "{grace:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_large_record_set_comes_over_tcp() {
    let dns = start_dns().await;
    // 200 A records do not fit in a UDP answer (it carries 74 and says it was truncated): all
    // 200 arrive only if the resolver asks again over TCP, at the same address.
    let ips: Vec<String> = (0..200)
        .map(|i| format!("10.0.{}.{}", i / 100, i % 100 + 1))
        .collect();
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    dns.set_ips("big.fleet.test.", 30, &ips).await;
    let mut fleet = builder(&dns, "big.fleet.test.:8080")
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    answered(fleet.handle().resolved(1)).await;
    assert_eq!(fleet.handle().last_error().map(|e| e.to_string()), None);
    assert_eq!(ready(&mut fleet).await.len(), 200);
}

#[tokio::test(start_paused = true)]
async fn aaaa_records_and_the_ip_strategy() {
    let dns = start_dns().await;
    dns.set_ips("v6.fleet.test.", 30, &["fd00::1", "fd00::2"])
        .await;
    dns.set_ips("dual.fleet.test.", 30, &["10.0.0.1", "fd00::1"])
        .await;

    // Only AAAA records: the default (A, else AAAA) takes them.
    let mut v6 = builder(&dns, "v6.fleet.test.:8080")
        .build(|ep: &DnsEndpoint| ep.authority())
        .unwrap();
    answered(v6.handle().resolved(1)).await;
    let changes = ready(&mut v6).await;
    let mut shown: Vec<String> = changes.iter().map(show).collect();
    shown.sort();
    assert_eq!(
        shown,
        ["+[fd00::1]:8080@fd00::1", "+[fd00::2]:8080@fd00::2"]
    );
    let Change::Insert(_, b) = &changes[0] else {
        unreachable!()
    };
    assert!(b.service().as_str().starts_with("[fd00::"));
    // No slot count given: one until a probe reads `/slots`, which it does only for a
    // backend whose count was not given.
    assert_eq!(b.slot_count().get(), 1);
    assert!(!b.slots_given());

    // Both families: the default takes A; Ipv4AndIpv6 takes both; Ipv6Only the AAAA.
    for (strategy, want) in [
        (IpStrategy::default(), vec!["+10.0.0.1:8080@10.0.0.1"]),
        (
            IpStrategy::Ipv4AndIpv6,
            vec!["+10.0.0.1:8080@10.0.0.1", "+[fd00::1]:8080@fd00::1"],
        ),
        (IpStrategy::Ipv6Only, vec!["+[fd00::1]:8080@fd00::1"]),
    ] {
        let mut dual = builder(&dns, "dual.fleet.test.:8080")
            .ip_strategy(strategy)
            .build(|ep: &DnsEndpoint| ep.addr())
            .unwrap();
        answered(dual.handle().resolved(1)).await;
        assert_eq!(ready_shown(&mut dual).await, want, "{strategy:?}");
    }
}

/// A server failure for one record type of a dual-stack name is a failed resolution, as for
/// the name: it keeps the fleet, rather than answer with the other family alone.
#[tokio::test(start_paused = true)]
async fn a_server_failure_for_one_address_family_keeps_the_fleet() {
    let dns = start_dns().await;
    dns.set_ips("dual.fleet.test.", 30, &["10.0.0.1", "fd00::1"])
        .await;
    for (strategy, fails, want) in [
        // A first, AAAA only if there are none: an A query that fails is not "none".
        (
            IpStrategy::Ipv4ThenIpv6,
            RecordType::A,
            vec!["+10.0.0.1:8080@10.0.0.1"],
        ),
        (
            IpStrategy::Ipv6ThenIpv4,
            RecordType::AAAA,
            vec!["+[fd00::1]:8080@fd00::1"],
        ),
        // Both: one family failing does not take the other's backends away.
        (
            IpStrategy::Ipv4AndIpv6,
            RecordType::AAAA,
            vec!["+10.0.0.1:8080@10.0.0.1", "+[fd00::1]:8080@fd00::1"],
        ),
        (
            IpStrategy::Ipv4AndIpv6,
            RecordType::A,
            vec!["+10.0.0.1:8080@10.0.0.1", "+[fd00::1]:8080@fd00::1"],
        ),
    ] {
        let mut fleet = builder(&dns, "dual.fleet.test.:8080")
            .ip_strategy(strategy)
            .build(|ep: &DnsEndpoint| ep.addr())
            .unwrap();
        let handle = fleet.handle();
        answered(handle.resolved(1)).await;
        assert_eq!(ready_shown(&mut fleet).await, want, "{strategy:?}");

        dns.servfail("dual.fleet.test.", fails, true);
        handle.refresh();
        answered(handle.resolved(2)).await;
        dns.servfail("dual.fleet.test.", fails, false);
        assert_eq!(
            ready_shown(&mut fleet).await,
            Vec::<String>::new(),
            "{strategy:?}, {fails} failing: the fleet changed"
        );
        let stats = handle.stats();
        assert_eq!(
            (stats.failures, stats.backends),
            (1, want.len()),
            "{strategy:?}, {fails} failing: {stats:?}"
        );
        let e = stats.last_error.unwrap();
        assert_eq!(e.kind(), DnsErrorKind::ServerFailure, "{e}");
    }

    // An SRV target's addresses alike.
    dns.set_srv(
        "_llm._tcp.fleet.test.",
        30,
        &[(10, 5, 8001, "dual.fleet.test.")],
    )
    .await;
    let mut fleet = builder(&dns, "_llm._tcp.fleet.test.")
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    let handle = fleet.handle();
    answered(handle.resolved(1)).await;
    assert_eq!(ready_shown(&mut fleet).await, ["+10.0.0.1:8001@10.0.0.1"]);
    dns.servfail("dual.fleet.test.", RecordType::A, true);
    handle.refresh();
    answered(handle.resolved(2)).await;
    assert_eq!(ready_shown(&mut fleet).await, Vec::<String>::new());
    assert_eq!(handle.failures(), 1);
}

#[tokio::test(start_paused = true)]
async fn srv_records_give_targets_and_ports() {
    let dns = start_dns().await;
    dns.set_srv(
        "_llm._tcp.fleet.test.",
        30,
        &[
            (10, 5, 8001, "gpu-a.fleet.test."),
            (10, 5, 8002, "gpu-a.fleet.test."),
            (20, 1, 8001, "gpu-b.fleet.test."),
            // A target with no address is left out; the others still count.
            (10, 5, 8001, "gone.fleet.test."),
        ],
    )
    .await;
    dns.set_ips("gpu-a.fleet.test.", 30, &["10.0.0.1"]).await;
    dns.set_ips("gpu-b.fleet.test.", 30, &["10.0.0.2"]).await;

    let mut fleet = builder(&dns, "_llm._tcp.fleet.test.")
        .node(|ep: &DnsEndpoint| ep.srv_host().unwrap_or("?").to_string())
        .build(|ep: &DnsEndpoint| ep.clone())
        .unwrap();
    let handle = fleet.handle();
    answered(handle.resolved(1)).await;
    let changes = ready(&mut fleet).await;
    let mut shown: Vec<String> = changes.iter().map(show).collect();
    shown.sort();
    assert_eq!(
        shown,
        [
            "+10.0.0.1:8001@gpu-a.fleet.test",
            "+10.0.0.1:8002@gpu-a.fleet.test",
            "+10.0.0.2:8001@gpu-b.fleet.test",
        ]
    );
    let b_record = changes
        .iter()
        .find_map(|c| match c {
            Change::Insert(id, b) if id.as_str() == "10.0.0.2:8001" => Some(b.service().clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        (b_record.srv_priority(), b_record.srv_weight()),
        (Some(20), Some(1))
    );

    // A target's address changes: its backends move.
    dns.set_ips("gpu-b.fleet.test.", 30, &["10.0.0.3"]).await;
    handle.refresh();
    answered(handle.resolved(2)).await;
    assert_eq!(
        ready_shown(&mut fleet).await,
        ["+10.0.0.3:8001@gpu-b.fleet.test", "-10.0.0.2:8001"]
    );

    // A target that cannot be resolved now (here refused: outside the server's zone) may
    // still be there: the whole resolution fails and the fleet stays.
    dns.set_srv(
        "_llm._tcp.fleet.test.",
        30,
        &[
            (10, 5, 8001, "gpu-a.fleet.test."),
            (10, 5, 8001, "gpu-c.elsewhere.test."),
        ],
    )
    .await;
    handle.refresh();
    answered(handle.resolved(3)).await;
    let e = handle
        .last_error()
        .expect("a target's failure fails the resolution");
    assert_eq!(e.kind(), DnsErrorKind::ServerFailure, "{e}");
    assert!(e.to_string().contains("gpu-c.elsewhere.test"), "{e}");
    assert!(ready(&mut fleet).await.is_empty());
    assert_eq!(handle.stats().backends, 3);
}

/// An SRV answer's targets are looked up at most eight at a time: an answer with many
/// targets is no burst of queries at the nameserver, one a target at once.
#[tokio::test(start_paused = true)]
async fn an_srv_answer_s_targets_are_looked_up_at_most_eight_at_a_time() {
    let dns = start_dns().await;
    let targets: Vec<String> = (0..20).map(|i| format!("gpu-{i}.fleet.test.")).collect();
    let records: Vec<(u16, u16, u16, &str)> =
        targets.iter().map(|t| (10, 5, 8001, t.as_str())).collect();
    dns.set_srv("_llm._tcp.fleet.test.", 30, &records).await;
    for (i, target) in targets.iter().enumerate() {
        dns.set_ips(target, 30, &[&format!("10.0.1.{}", i + 1)])
            .await;
    }
    let mut fleet = builder(&dns, "_llm._tcp.fleet.test.")
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    let handle = fleet.handle();
    // Every target looked up, eight at a time.
    answered(handle.resolved(1)).await;
    assert_eq!(ready(&mut fleet).await.len(), 20);

    // No target answers: the first eight queries wait out their timeout together, and the
    // resolution fails on the first before another target is asked.
    for target in &targets {
        dns.silent(target, RecordType::A, true);
    }
    let before = dns.asked().len();
    handle.refresh();
    // Unanswered: the (paused) clock runs on to the queries' timeout.
    handle.resolved(2).await;
    let asked: BTreeSet<String> = dns.asked()[before..]
        .iter()
        .filter(|(name, _)| name.starts_with("gpu-"))
        .map(|(name, _)| name.clone())
        .collect();
    assert_eq!(asked.len(), 8, "{asked:?}");
    let e = handle.last_error().unwrap();
    assert_eq!(e.kind(), DnsErrorKind::Timeout, "{e}");
    assert_eq!(handle.stats().backends, 20);
}

/// An SRV record on port 0 names no reachable server (Consul answers so for a service
/// registered without a port): it is left out, as a target of "." is, and as a host target
/// on port 0 is refused. Priority and weight 0 are records like any other.
#[tokio::test(start_paused = true)]
async fn an_srv_record_on_port_0_is_left_out() {
    let dns = start_dns().await;
    dns.set_ips("gpu-a.fleet.test.", 30, &["10.0.0.1"]).await;
    dns.set_ips("gpu-b.fleet.test.", 30, &["10.0.0.2"]).await;
    dns.set_srv(
        "_llm._tcp.fleet.test.",
        30,
        &[
            (10, 5, 0, "gpu-a.fleet.test."),
            (0, 0, 8001, "gpu-b.fleet.test."),
        ],
    )
    .await;
    let mut fleet = builder(&dns, "_llm._tcp.fleet.test.")
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    let handle = fleet.handle();
    answered(handle.resolved(1)).await;
    assert_eq!(ready_shown(&mut fleet).await, ["+10.0.0.2:8001@10.0.0.2"]);

    // Every record on port 0: no address, a failed resolution that keeps the fleet.
    dns.set_srv(
        "_llm._tcp.fleet.test.",
        30,
        &[
            (10, 5, 0, "gpu-a.fleet.test."),
            (0, 0, 0, "gpu-b.fleet.test."),
        ],
    )
    .await;
    handle.refresh();
    answered(handle.resolved(2)).await;
    assert_eq!(ready_shown(&mut fleet).await, Vec::<String>::new());
    let e = handle.last_error().unwrap();
    assert_eq!(e.kind(), DnsErrorKind::NoRecords, "{e}");
}

/// An SRV answer none of whose records gives an address keeps the fleet, and its error says
/// why: the records are there, and their targets have no address (with what the first
/// target's lookup said), or name no server. "No addresses" alone sends an operator to the
/// SRV records, which are fine.
#[tokio::test(start_paused = true)]
async fn an_srv_answer_without_addresses_says_which_targets_have_none_and_why() {
    let dns = start_dns().await;
    dns.set_ips("gpu-a.fleet.test.", 30, &["10.0.0.1"]).await;
    dns.set_srv(
        "_llm._tcp.fleet.test.",
        30,
        &[(10, 5, 8001, "gpu-a.fleet.test.")],
    )
    .await;
    let mut fleet = builder(&dns, "_llm._tcp.fleet.test.")
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    let handle = fleet.handle();
    answered(handle.resolved(1)).await;
    assert_eq!(ready_shown(&mut fleet).await, ["+10.0.0.1:8001@10.0.0.1"]);

    dns.set_srv(
        "_llm._tcp.fleet.test.",
        30,
        &[
            (10, 5, 8001, "gone-b.fleet.test."),
            (10, 5, 8002, "gone-b.fleet.test."),
            (10, 5, 8001, "gone-c.fleet.test."),
            (10, 5, 0, "gpu-a.fleet.test."),
        ],
    )
    .await;
    handle.refresh();
    answered(handle.resolved(2)).await;
    assert!(ready(&mut fleet).await.is_empty(), "the fleet changed");
    let e = handle.last_error().unwrap();
    assert_eq!(e.kind(), DnsErrorKind::NoRecords, "{e}");
    assert_eq!(
        e.to_string(),
        "SRV _llm._tcp.fleet.test.: no addresses: 3 records whose target has none \
         (gone-b.fleet.test. A: no such name (NXDOMAIN); \
         gone-b.fleet.test. AAAA: no such name (NXDOMAIN); and 1 more target), \
         1 record on port 0 or with the target \".\""
    );

    // Every record naming no server.
    dns.set_srv(
        "_llm._tcp.fleet.test.",
        30,
        &[(10, 5, 0, "gpu-a.fleet.test."), (10, 5, 8001, ".")],
    )
    .await;
    handle.refresh();
    answered(handle.resolved(3)).await;
    assert_eq!(
        handle.last_error().unwrap().to_string(),
        "SRV _llm._tcp.fleet.test.: no addresses: 2 records on port 0 or with the target \".\""
    );
    assert_eq!(handle.stats().backends, 1);
}

#[tokio::test(start_paused = true)]
async fn the_ttl_decides_the_next_resolution_between_floor_and_ceiling() {
    let dns = start_dns().await;
    // TTL 1 s under a 10 s floor: the floor.
    dns.set_ips("llm.fleet.test.", 1, &["10.0.0.1"]).await;
    let fleet = builder(&dns, "llm.fleet.test.:8080")
        .min_interval(Duration::from_secs(10))
        .max_interval(Duration::from_secs(60))
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    let handle = fleet.handle();
    answered(handle.resolved(1)).await;

    quiet(9).await;
    assert_eq!(handle.resolutions(), 1, "resolved again before the floor");
    // The TTL in bounds from now on: 30 s.
    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.1"]).await;
    tokio::time::advance(Duration::from_secs(1)).await;
    answered(handle.resolved(2)).await;

    quiet(29).await;
    assert_eq!(
        handle.resolutions(),
        2,
        "resolved again before the TTL ran out"
    );
    dns.set_ips("llm.fleet.test.", 86_400, &["10.0.0.1"]).await;
    tokio::time::advance(Duration::from_secs(1)).await;
    answered(handle.resolved(3)).await;

    // A day's TTL over a 60 s ceiling: the ceiling.
    quiet(59).await;
    assert_eq!(handle.resolutions(), 3, "resolved again before the ceiling");
    tokio::time::advance(Duration::from_secs(1)).await;
    answered(handle.resolved(4)).await;
    assert_eq!(handle.failures(), 0);
    drop(fleet);
}

/// Starts a DNS server for a test, the binary's one subscriber first (every test starts
/// with it): one global subscriber, rather than one set per test for its thread, leaves no
/// callsite whose interest another thread's first use decided without it.
async fn start_dns() -> Dns {
    support_logs::install(tracing::Level::INFO);
    Dns::start().await
}

#[tokio::test(start_paused = true)]
async fn nxdomain_keeps_the_fleet_counts_and_logs_once() {
    let logs = support_logs::capture(tracing::Level::INFO);
    let dns = start_dns().await;
    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.1", "10.0.0.2"])
        .await;
    let mut fleet = builder(&dns, "llm.fleet.test.:8080")
        .retry_interval(Duration::from_secs(3))
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    let handle = fleet.handle();
    answered(handle.resolved(1)).await;
    assert_eq!(ready(&mut fleet).await.len(), 2);

    // The name goes: three failed resolutions, one warning, no change.
    dns.set_ips("llm.fleet.test.", 30, &[]).await;
    handle.refresh();
    answered(handle.resolved(2)).await;
    for n in 3..=4 {
        tokio::time::advance(Duration::from_secs(3)).await; // the retry interval
        answered(handle.resolved(n)).await;
    }
    let stats = handle.stats();
    assert_eq!((stats.resolutions, stats.failures), (4, 3));
    assert_eq!((stats.consecutive_failures, stats.backends), (3, 2));
    let e = stats.last_error.unwrap();
    assert_eq!(e.kind(), DnsErrorKind::NoSuchName, "{e}");
    assert!(e.to_string().contains("llm.fleet.test"), "{e}");
    assert!(
        ready(&mut fleet).await.is_empty(),
        "a failure changed the fleet"
    );
    assert_eq!(
        logs.count(&["DNS resolution failed; keeping the last fleet"]),
        1
    );

    // Back, with one address fewer: recovered, logged once, the difference announced.
    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.2"]).await;
    tokio::time::advance(Duration::from_secs(3)).await;
    answered(handle.resolved(5)).await;
    assert_eq!(ready_shown(&mut fleet).await, ["-10.0.0.1:8080"]);
    let stats = handle.stats();
    assert_eq!((stats.failures, stats.consecutive_failures), (3, 0));
    assert_eq!(
        stats.last_error.map(|e| e.kind()),
        Some(DnsErrorKind::NoSuchName)
    );
    assert_eq!(logs.count(&["DNS resolution recovered"]), 1);

    // A name outside the server's zone is refused: a server failure, also kept.
    let other = builder(&dns, "llm.elsewhere.test.:8080")
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    answered(other.handle().resolved(1)).await;
    let e = other.handle().last_error().unwrap();
    assert_eq!(e.kind(), DnsErrorKind::ServerFailure, "{e}");
    // It names the nameserver that refused.
    assert!(
        e.to_string().contains(&format!("nameserver {}", dns.addr)),
        "{e}"
    );
    // It never resolved: there is no fleet of it to keep, and the warning says so.
    assert_eq!(
        logs.count(&["DNS resolution failed; no backend from this name yet"]),
        1
    );
    assert_eq!(
        logs.count(&["DNS resolution failed; keeping the last fleet"]),
        1
    );
}

#[tokio::test(start_paused = true)]
async fn a_name_without_addresses_keeps_the_fleet_and_says_no_records() {
    let dns = start_dns().await;
    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.1"]).await;
    let mut fleet = builder(&dns, "llm.fleet.test.:8080")
        .ip_strategy(IpStrategy::Ipv4Only)
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    let handle = fleet.handle();
    answered(handle.resolved(1)).await;
    assert_eq!(ready(&mut fleet).await.len(), 1);
    // The name stays, with an AAAA record only: no address of the kind asked.
    dns.set_ips("llm.fleet.test.", 30, &["fd00::1"]).await;
    handle.refresh();
    answered(handle.resolved(2)).await;
    let e = handle.last_error().unwrap();
    assert_eq!(e.kind(), DnsErrorKind::NoRecords, "{e}");
    assert!(
        ready(&mut fleet).await.is_empty(),
        "a failure changed the fleet"
    );
    assert_eq!(handle.stats().backends, 1);
}

/// A name with no address says what each record type's query answered: the default asks A,
/// then AAAA, and an error naming the last alone ("AAAA: no records") would send an operator
/// looking at IPv6 when the name's A records are what is missing.
#[tokio::test(start_paused = true)]
async fn a_name_without_addresses_is_reported_for_each_record_type_asked() {
    let dns = start_dns().await;
    // The name exists, with an SRV record and no address.
    dns.set_srv("bare.fleet.test.", 30, &[(10, 5, 8001, "gpu.fleet.test.")])
        .await;
    for (target, strategy, want) in [
        (
            "gone.fleet.test.:8080",
            IpStrategy::Ipv4ThenIpv6,
            "gone.fleet.test. A: no such name (NXDOMAIN); gone.fleet.test. AAAA: no such name (NXDOMAIN)",
        ),
        (
            "bare.fleet.test.:8080",
            IpStrategy::Ipv6ThenIpv4,
            "bare.fleet.test. AAAA: no records; bare.fleet.test. A: no records",
        ),
        (
            "bare.fleet.test.:8080",
            IpStrategy::Ipv4AndIpv6,
            "bare.fleet.test. A: no records; bare.fleet.test. AAAA: no records",
        ),
        (
            "bare.fleet.test.:8080",
            IpStrategy::Ipv4Only,
            "bare.fleet.test. A: no records",
        ),
    ] {
        let fleet = builder(&dns, target)
            .ip_strategy(strategy)
            .build(|ep: &DnsEndpoint| ep.addr())
            .unwrap();
        answered(fleet.handle().resolved(1)).await;
        let e = fleet.handle().last_error().unwrap();
        assert_eq!(e.to_string(), want, "{strategy:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_stopped_server_keeps_the_fleet_until_it_answers_again() {
    let mut dns = start_dns().await;
    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.1"]).await;
    let mut fleet = builder(&dns, "llm.fleet.test.:8080")
        .retry_interval(Duration::from_secs(2))
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    let handle = fleet.handle();
    answered(handle.resolved(1)).await;
    assert_eq!(ready(&mut fleet).await.len(), 1);

    dns.stop().await;
    handle.refresh();
    // Unanswered: the (paused) clock runs on to the query's timeout.
    handle.resolved(2).await;
    let e = handle
        .last_error()
        .expect("a resolution without a server failed");
    assert!(
        matches!(e.kind(), DnsErrorKind::Timeout | DnsErrorKind::Connection),
        "{e:?}"
    );
    assert_eq!(handle.stats().backends, 1);
    assert!(ready(&mut fleet).await.is_empty());

    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.1", "10.0.0.9"])
        .await;
    dns.restart().await;
    let before = handle.resolutions();
    let mut n = before;
    // The retries run on their interval; the first after the restart is answered.
    for _ in 0..5 {
        handle.refresh();
        n = answered(handle.resolved(n + 1)).await;
        if handle.stats().consecutive_failures == 0 {
            break;
        }
    }
    assert_eq!(
        handle.stats().consecutive_failures,
        0,
        "{:?}",
        handle.stats()
    );
    assert_eq!(ready_shown(&mut fleet).await, ["+10.0.0.9:8080@10.0.0.9"]);
}

#[tokio::test(start_paused = true)]
async fn the_node_function_names_each_backend_s_node() {
    let dns = start_dns().await;
    dns.set_ips("llm.fleet.test.", 30, &["10.0.1.1", "10.0.1.2", "10.0.2.1"])
        .await;
    let mut fleet = builder(&dns, "llm.fleet.test.:8080")
        .node(|ep: &DnsEndpoint| match ep.ip() {
            std::net::IpAddr::V4(ip) => format!("rack-{}", ip.octets()[2]),
            std::net::IpAddr::V6(_) => "v6".to_string(),
        })
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    answered(fleet.handle().resolved(1)).await;
    assert_eq!(
        ready_shown(&mut fleet).await,
        [
            "+10.0.1.1:8080@rack-1",
            "+10.0.1.2:8080@rack-1",
            "+10.0.2.1:8080@rack-2",
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn an_extension_a_context_and_assigned_slots_given_to_the_builder_are_on_each_backend() {
    #[derive(Clone, Debug, PartialEq)]
    struct Tenant(&'static str);
    let dns = start_dns().await;
    dns.set_ips("acme.fleet.test.", 30, &["10.0.3.1", "10.0.3.2"])
        .await;
    let context = std::num::NonZeroU64::new(32_768).unwrap();
    let mut fleet = builder(&dns, "acme.fleet.test.:8080")
        .extension(Tenant("acme"))
        .context_tokens(context)
        .assign_slots()
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    answered(fleet.handle().resolved(1)).await;
    let changes = ready(&mut fleet).await;
    assert_eq!(changes.len(), 2);
    for change in changes {
        let Change::Insert(_, backend) = change else {
            panic!("not an insert");
        };
        assert_eq!(backend.extensions().get::<Tenant>(), Some(&Tenant("acme")));
        assert_eq!(backend.context_limit(), Some(context));
        assert!(backend.slots_assigned());
    }
}

#[tokio::test(start_paused = true)]
async fn a_service_that_cannot_be_made_is_left_out_and_tried_again() {
    let dns = start_dns().await;
    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.1", "10.0.0.2"])
        .await;
    let refuse = Arc::new(AtomicBool::new(true));
    let refusing = refuse.clone();
    let mut fleet = builder(&dns, "llm.fleet.test.:8080")
        .try_build(move |ep: &DnsEndpoint| {
            if ep.ip().to_string() == "10.0.0.2" && refusing.load(Ordering::SeqCst) {
                return Err("no client for this one");
            }
            Ok(ep.addr())
        })
        .unwrap();
    let handle = fleet.handle();
    answered(handle.resolved(1)).await;
    assert_eq!(ready_shown(&mut fleet).await, ["+10.0.0.1:8080@10.0.0.1"]);
    assert_eq!(handle.stats().backends, 1);

    handle.refresh();
    answered(handle.resolved(2)).await;
    assert!(ready(&mut fleet).await.is_empty());

    refuse.store(false, Ordering::SeqCst);
    handle.refresh();
    answered(handle.resolved(3)).await;
    assert_eq!(ready_shown(&mut fleet).await, ["+10.0.0.2:8080@10.0.0.2"]);
    assert_eq!((handle.stats().backends, handle.failures()), (2, 0));
}

#[tokio::test(start_paused = true)]
async fn an_answer_whose_new_services_all_fail_keeps_the_old_backends() {
    let dns = start_dns().await;
    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.1"]).await;
    let mut fleet = builder(&dns, "llm.fleet.test.:8080")
        .try_build(|ep: &DnsEndpoint| {
            if ep.ip().to_string() == "10.0.0.2" {
                return Err("no client for this one");
            }
            Ok(ep.addr())
        })
        .unwrap();
    let handle = fleet.handle();
    answered(handle.resolved(1)).await;
    assert_eq!(ready_shown(&mut fleet).await, ["+10.0.0.1:8080@10.0.0.1"]);

    // The backend moved to an address whose service cannot be made: removing the old one
    // would empty the fleet, so it stays.
    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.2"]).await;
    handle.refresh();
    answered(handle.resolved(2)).await;
    assert!(ready(&mut fleet).await.is_empty());
    assert_eq!(handle.stats().backends, 1);

    // Once one of the answer's addresses is made, the old one goes.
    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.2", "10.0.0.3"])
        .await;
    handle.refresh();
    answered(handle.resolved(3)).await;
    assert_eq!(
        ready_shown(&mut fleet).await,
        ["+10.0.0.3:8080@10.0.0.3", "-10.0.0.1:8080"]
    );
    assert_eq!((handle.stats().backends, handle.failures()), (1, 0));
}

#[tokio::test]
async fn a_fleet_built_outside_a_runtime_starts_on_its_first_poll() {
    let dns = start_dns().await;
    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.1"]).await;
    let b = builder(&dns, "llm.fleet.test.:8080");
    let mut fleet = std::thread::spawn(move || b.build(|ep: &DnsEndpoint| ep.addr()).unwrap())
        .join()
        .unwrap();
    let handle = fleet.handle();
    assert_eq!(handle.resolutions(), 0);
    assert!(ready(&mut fleet).await.is_empty()); // spawns the resolving task
    tokio::time::timeout(Duration::from_secs(10), handle.resolved(1))
        .await
        .unwrap();
    assert_eq!(ready_shown(&mut fleet).await, ["+10.0.0.1:8080@10.0.0.1"]);
    // The handle outlives the stream, and its waiters do not hang on a dropped one.
    drop(fleet);
    assert_eq!(handle.resolved(100).await, 1);
}

/// A fleet polled outside a tokio runtime cannot start its resolving task: it panics, as
/// tokio's own spawn does, rather than end the stream, which a later poll inside a runtime
/// would start again (a stream that has ended yields nothing more).
#[tokio::test]
async fn a_fleet_polled_outside_a_runtime_panics_rather_than_ends() {
    let dns = start_dns().await;
    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.1"]).await;
    let b = builder(&dns, "llm.fleet.test.:8080");
    let (mut fleet, polled) = std::thread::spawn(move || {
        let mut fleet = b.build(|ep: &DnsEndpoint| ep.addr()).unwrap();
        let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            let poll = Pin::new(&mut fleet).poll_next(&mut cx);
            format!("{:?}", poll.map(|c| c.map(|c| c.map(|c| show(&c)))))
        }));
        let polled = polled.map_err(|panic| match panic.downcast::<String>() {
            Ok(message) => *message,
            Err(panic) => panic
                .downcast::<&str>()
                .map(|m| m.to_string())
                .unwrap_or_default(),
        });
        (fleet, polled)
    })
    .join()
    .unwrap();
    let message = polled.expect_err("polled outside a runtime without a panic");
    assert!(message.contains("outside a tokio runtime"), "{message}");

    // It never ended: polled inside a runtime, it resolves.
    let handle = fleet.handle();
    assert!(ready(&mut fleet).await.is_empty()); // spawns the resolving task
    tokio::time::timeout(Duration::from_secs(10), handle.resolved(1))
        .await
        .unwrap();
    assert_eq!(ready_shown(&mut fleet).await, ["+10.0.0.1:8080@10.0.0.1"]);
}

// === end to end: SessionAffinity over DNS, HTTP to stub backends ===

/// A backend on `listener` that answers every request with its name.
fn stub(name: &'static str, listener: std::net::TcpListener) -> tokio::task::JoinHandle<()> {
    listener.set_nonblocking(true).unwrap();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((io, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |_req: http::Request<Incoming>| async move {
                        Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from(name))))
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(io), svc)
                    .await;
            });
        }
    })
}

/// Listeners on two loopback addresses with one port: A records carry no port. Both are held
/// from the start, so that no other test can take the port on either address meanwhile.
fn two_listeners() -> (std::net::TcpListener, std::net::TcpListener) {
    for _ in 0..20 {
        let a = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
        let port = a.local_addr().unwrap().port();
        if let Ok(b) = std::net::TcpListener::bind(("127.0.0.3", port)) {
            return (a, b);
        }
    }
    panic!("no port free on both 127.0.0.2 and 127.0.0.3");
}

#[tokio::test]
async fn session_affinity_over_dns_routes_to_http_backends_and_follows_a_change() {
    let dns = start_dns().await;
    let (listen_a, listen_b) = two_listeners();
    let (a, b) = (
        listen_a.local_addr().unwrap(),
        listen_b.local_addr().unwrap(),
    );
    let _a = stub("a", listen_a);
    let _b = stub("b", listen_b);
    dns.set_ips("llm.fleet.test.", 30, &["127.0.0.2"]).await;

    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let fleet = builder(&dns, &format!("llm.fleet.test.:{}", a.port()))
        .build(move |ep: &DnsEndpoint| {
            let client = client.clone();
            let authority = ep.authority();
            service_fn(move |req: http::Request<Full<Bytes>>| {
                let (client, authority) = (client.clone(), authority.clone());
                async move {
                    let mut parts = req.uri().clone().into_parts();
                    parts.scheme = Some(http::uri::Scheme::HTTP);
                    parts.authority = Some(authority);
                    let (mut head, body) = req.into_parts();
                    head.uri = http::Uri::from_parts(parts)?;
                    let res = client
                        .request(http::Request::from_parts(head, body))
                        .await?;
                    Ok::<_, Box<dyn std::error::Error + Send + Sync>>(res)
                }
            })
        })
        .unwrap();
    let handle = fleet.handle();
    let svc = SessionAffinityLayer::new().layer(fleet);
    tokio::time::timeout(Duration::from_secs(10), handle.resolved(1))
        .await
        .unwrap();

    let turn = |session: &str| {
        http::Request::post("/v1/chat/completions")
            .header("x-session-id", session)
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let ask = |session: &'static str| {
        let svc = svc.clone();
        async move {
            let res = svc.oneshot(turn(session)).await.unwrap();
            let decision = res.extensions().get::<Decision>().unwrap().clone();
            let body = res.into_body().collect().await.unwrap().to_bytes();
            (String::from_utf8(body.to_vec()).unwrap(), decision)
        }
    };
    let (body, d) = ask("agent-1").await;
    assert_eq!(body, "a");
    assert_eq!(d.backend.as_str(), a.to_string());
    assert_eq!(svc.backends().len(), 1);

    // The record moves to the other address: the session follows it there.
    dns.set_ips("llm.fleet.test.", 30, &["127.0.0.3"]).await;
    handle.refresh();
    tokio::time::timeout(Duration::from_secs(10), handle.resolved(2))
        .await
        .unwrap();
    let (body, d) = ask("agent-1").await;
    assert_eq!(body, "b");
    assert_eq!(d.backend.as_str(), b.to_string());
    let backends: BTreeMap<String, String> = svc
        .backends()
        .into_iter()
        .map(|s| (s.id.to_string(), s.node.to_string()))
        .collect();
    assert_eq!(
        backends,
        BTreeMap::from([(b.to_string(), "127.0.0.3".to_string())])
    );
    assert_eq!(handle.failures(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_panicking_node_function_ends_the_stream_and_wakes_resolved() {
    let dns = start_dns().await;
    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.1"]).await;
    // A node function written for SRV targets, given a host target: it panics in the task.
    let mut fleet = builder(&dns, "llm.fleet.test.:8080")
        .node(|ep: &DnsEndpoint| ep.srv_host().expect("an SRV target").to_string())
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    let handle = fleet.handle();
    // The task is gone: a proxy waiting for the first answer is told so, not left waiting.
    let done = answered(tokio::time::timeout(
        Duration::from_secs(3600),
        handle.resolved(1),
    ))
    .await;
    assert_eq!(done, Ok(0), "resolved(1) still waits on a dead task");
    assert!(ready(&mut fleet).await.is_empty());
    let end = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut fleet).poll_next(cx))).await;
    assert!(
        matches!(end, Poll::Ready(None)),
        "the stream ends with its task"
    );
}

/// An answer whose addresses all changed (a one-backend fleet whose pod came back elsewhere)
/// announces the new backends before it removes the old ones: a balancer that applies the
/// changes between the two (a request's readiness on another thread, while the new backend's
/// service is being made) never finds its fleet empty, and answers no request 503 for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_whose_addresses_all_change_is_never_empty_between_the_changes() {
    let dns = start_dns().await;
    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.1"]).await;
    // The new address's service is made while the test looks at the balancer.
    let (making, mut made) = tokio::sync::mpsc::unbounded_channel::<()>();
    let (release, held) = std::sync::mpsc::channel::<()>();
    let held = Arc::new(Mutex::new(held));
    let fleet = builder(&dns, "llm.fleet.test.:8080")
        .build(move |ep: &DnsEndpoint| {
            if ep.addr().ip().to_string() == "10.0.0.2" {
                let _ = making.send(());
                let _ = held.lock().recv_timeout(Duration::from_secs(10));
            }
            let name = ep.addr().to_string();
            service_fn(move |_req: http::Request<String>| {
                let name = name.clone();
                async move { Ok::<_, Infallible>(http::Response::new(name)) }
            })
        })
        .unwrap();
    let handle = fleet.handle();
    let svc = SessionAffinityLayer::new().layer(fleet);
    tokio::time::timeout(Duration::from_secs(10), handle.resolved(1))
        .await
        .unwrap();
    svc.apply_discovery();
    let ids = |svc: &tower_affinity::SessionAffinity<_, _, _>| -> Vec<String> {
        svc.backends().iter().map(|b| b.id.to_string()).collect()
    };
    assert_eq!(ids(&svc), ["10.0.0.1:8080"]);

    dns.set_ips("llm.fleet.test.", 30, &["10.0.0.2"]).await;
    handle.refresh();
    tokio::time::timeout(Duration::from_secs(10), made.recv())
        .await
        .unwrap()
        .unwrap();
    // The new backend's service is being made: the old backend still serves.
    svc.apply_discovery();
    assert_eq!(ids(&svc), ["10.0.0.1:8080"]);
    let turn = http::Request::post("/v1/chat/completions")
        .header("x-session-id", "agent-1")
        .body(String::new())
        .unwrap();
    let res = svc
        .clone()
        .oneshot(turn)
        .await
        .expect("served by the old backend");
    let decision = res.extensions().get::<Decision>().unwrap();
    assert_eq!(decision.backend.as_str(), "10.0.0.1:8080");

    release.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), handle.resolved(2))
        .await
        .unwrap();
    svc.apply_discovery();
    assert_eq!(ids(&svc), ["10.0.0.2:8080"]);
}

/// Changes the stream has not yielded yet are merged as they come: a balancer that takes no
/// request for a while (it applies discovery as requests come) finds, after the quiet spell,
/// where the fleet is now, not every answer on the way there, and the services built for
/// addresses that came and went meanwhile are dropped rather than held until then.
#[tokio::test(start_paused = true)]
async fn changes_not_yet_taken_are_merged_into_what_changed_since() {
    let dns = start_dns().await;
    dns.set_ips("llm.fleet.test.", 5, &["10.0.0.1", "10.0.0.2"])
        .await;
    let built = Arc::new(());
    let mut fleet = builder(&dns, "llm.fleet.test.:8080")
        .min_interval(Duration::from_secs(1))
        .build({
            let built = built.clone();
            move |ep: &DnsEndpoint| (ep.addr(), built.clone())
        })
        .unwrap();
    let handle = fleet.handle();
    answered(handle.resolved(1)).await;
    assert_eq!(ready(&mut fleet).await.len(), 2);

    // A server that names one of 10.0.0.2, 10.0.0.3 and 10.0.0.4 beside 10.0.0.1 each time,
    // thirty times, while nobody takes the changes.
    for n in 2..=31u64 {
        let other = format!("10.0.0.{}", 2 + n % 3);
        dns.set_ips("llm.fleet.test.", 5, &["10.0.0.1", &other])
            .await;
        tokio::time::advance(Duration::from_secs(5)).await;
        answered(handle.resolved(n)).await;
        // The services the stream holds for its consumer: one an address at most.
        assert!(
            Arc::strong_count(&built) <= 1 + 4,
            "answer {n}: {} services held",
            Arc::strong_count(&built) - 1
        );
    }
    // The last answer named 10.0.0.1 and 10.0.0.3 (31 % 3 == 1): 10.0.0.2 went, 10.0.0.3 came.
    assert_eq!(
        ready_shown(&mut fleet).await,
        ["+10.0.0.3:8080@10.0.0.3", "-10.0.0.2:8080"]
    );
    assert_eq!(handle.stats().backends, 2);
    assert_eq!(handle.failures(), 0);
}

/// A docker compose service named `llama_server` is reachable as that name: an underscore
/// inside a label is no valid host name, but DNS carries it, and docker's DNS (and Consul's,
/// for a node so named) answers for it. Taken as a target, and as an SRV record's target.
#[tokio::test(start_paused = true)]
async fn a_name_with_an_underscore_resolves() {
    let dns = start_dns().await;
    dns.set_ips("llama_server.fleet.test.", 30, &["10.0.0.1"])
        .await;
    let mut fleet = builder(&dns, "llama_server.fleet.test.:8080")
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    answered(fleet.handle().resolved(1)).await;
    assert_eq!(fleet.handle().last_error().map(|e| e.to_string()), None);
    assert_eq!(ready_shown(&mut fleet).await, ["+10.0.0.1:8080@10.0.0.1"]);

    dns.set_srv(
        "_llm._tcp.fleet.test.",
        30,
        &[(10, 5, 8001, "llama_server.fleet.test.")],
    )
    .await;
    let mut fleet = builder(&dns, "_llm._tcp.fleet.test.")
        .build(|ep: &DnsEndpoint| ep.clone())
        .unwrap();
    answered(fleet.handle().resolved(1)).await;
    assert_eq!(fleet.handle().last_error().map(|e| e.to_string()), None);
    let changes = ready(&mut fleet).await;
    let [Change::Insert(id, backend)] = &changes[..] else {
        panic!("{:?}", changes.iter().map(show).collect::<Vec<_>>());
    };
    assert_eq!(id.as_str(), "10.0.0.1:8001");
    assert_eq!(
        backend.service().srv_host(),
        Some("llama_server.fleet.test")
    );
}

/// A resolution that no nameserver answers names the nameserver it asked, and the name: a
/// fleet given a wrong resolver address says which one.
#[tokio::test(start_paused = true)]
async fn a_resolution_no_nameserver_answers_names_the_nameserver_asked() {
    support_logs::install(tracing::Level::INFO);
    // A nameserver that receives and never answers.
    let silent = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let fleet = DnsFleet::builder("llm.fleet.test.:8080".parse().unwrap())
        .nameserver(addr)
        .timeout(Duration::from_secs(1))
        .attempts(1)
        .build(|ep: &DnsEndpoint| ep.addr())
        .unwrap();
    // Unanswered: the (paused) clock runs on to the query's timeout.
    fleet.handle().resolved(1).await;
    let e = fleet.handle().last_error().unwrap();
    assert!(
        matches!(e.kind(), DnsErrorKind::Timeout | DnsErrorKind::Connection),
        "{e:?}"
    );
    let text = e.to_string();
    assert!(text.contains("llm.fleet.test."), "{text}");
    assert!(text.contains(&format!("nameserver {addr}")), "{text}");
}
