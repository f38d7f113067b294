//! Two proxy instances on one real `redis-server` (`--redis`): a turn that spilled on one is
//! followed by the other. Real time (Redis is a real process on real sockets), every wait
//! bounded; nothing sleeps.

use serde_json::json;

use super::llama_stub::Stub;
use super::redis_server::RedisServer;
use super::{cli, start, Conversation, Running};

/// An instance over `stubs` (`(node, stub)`), one slot each, sharing homes through `redis`.
async fn instance(stubs: &[(&str, &Stub)], redis: Option<&RedisServer>) -> Running {
    let mut args = Vec::new();
    for (node, stub) in stubs {
        args.push("--backend".to_string());
        args.push(format!(
            "{node}={},slots=1,id={}",
            stub.url(),
            stub.state.name
        ));
    }
    args.extend([
        "--probe-interval".into(),
        "0".into(),
        "--overflow".into(),
        "reject".into(),
    ]);
    if let Some(r) = redis {
        // Generous: a loaded CI machine must not turn a slow answer into a miss.
        args.extend([
            "--redis".into(),
            r.url(),
            "--redis-timeout".into(),
            "1s".into(),
        ]);
    }
    let cli::Command::Run(parsed) = cli::parse(args).unwrap() else {
        panic!("a run");
    };
    start(parsed.config).await
}

/// A spill on instance one, then the session's next turn through instance two: where it
/// lands, and where the spill went.
async fn spill_then_other_instance(redis: Option<&RedisServer>) -> (String, String, String) {
    let (a, b) = (Stub::start("a1", 1).await, Stub::start("b1", 1).await);
    let stubs = [("node-a", &a), ("node-b", &b)];
    let one = instance(&stubs, redis).await;
    let two = instance(&stubs, redis).await;
    let key = [("x-session-id", "s")];
    let mut convo = Conversation::new("s");
    let first = one.post_json(&key, &convo.next(json!({}))).await;
    convo.answered(&first);
    let home = first.backend().to_string();
    let home_stub = if home == "a1" { &a } else { &b };
    // A streamed turn held open on the home: instance one's slot there is taken.
    home_stub.hold_streams();
    let held = one
        .send(
            http::Request::post(one.url("/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("x-session-id", "s")
                .body(http_body_util::Full::new(bytes::Bytes::from(
                    convo.next(json!({"stream": true})).to_string(),
                )))
                .unwrap(),
        )
        .await;
    assert_eq!(held.headers()["x-affinity-backend"], home.as_str());
    // The next turn spills on instance one.
    let spilled = one.post_json(&key, &convo.next(json!({}))).await;
    assert_ne!(spilled.backend(), home, "the home is full on instance one");
    convo.answered(&spilled);
    home_stub.release_streams();
    drop(held);
    // And the next enters instance two.
    let next = two.post_json(&key, &convo.next(json!({}))).await;
    (
        home,
        spilled.backend().to_string(),
        next.backend().to_string(),
    )
}

#[tokio::test]
async fn a_turn_entering_another_instance_follows_a_spill_through_redis() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let (_, spilled, next) = spill_then_other_instance(Some(&redis)).await;
    assert_eq!(
        next, spilled,
        "instance two read the spilled home from Redis"
    );
    // Without Redis, instance two knows nothing of the spill and sends the turn back to the
    // session's first home, which no longer holds its latest turn.
    let (home, spilled, next) = spill_then_other_instance(None).await;
    assert_ne!(spilled, home);
    assert_eq!(next, home);
}
