//! One probe of one backend: `GET /health`, then `GET /slots` if asked (llama-server's
//! `GET /props` before it, or after its 501), then `GET /v1/models` for a backend without
//! slots whose request context is learned.

use std::num::NonZeroU64;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;

/// The client the probe sends with.
pub(crate) type ProbeClient = Client<HttpConnector, Empty<Bytes>>;

/// The most of a probe answer read. `/slots` is a few KiB a slot, but a llama-server run with
/// `LLAMA_SERVER_SLOTS_DEBUG` (as releases before that switch did always) adds each slot's
/// last prompt and answer as text: 30,571 bytes for a slot that read 13,024 tokens of code,
/// so about 300 KB a slot of 128k tokens, and 32 MiB for a hundred of them.
const BODY_LIMIT: usize = 32 << 20;

/// The deadline of a probe whose timeout is past what the clock can count ahead: about 30
/// years from now.
const FAR_AHEAD: Duration = Duration::from_secs(86_400 * 365 * 30);

/// What `/health` said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Health {
    /// 200.
    Ready,
    /// 503: the model is loading.
    Loading,
    /// Anything else, or no answer.
    Failed(String),
}

/// What `/slots` (or llama-server's `/props`) said: how many slots, how many of them are
/// processing (`/slots` alone says), and the most tokens of context a slot has (`n_ctx`: one
/// request's most on the backend), if given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slots {
    pub(crate) total: u32,
    pub(crate) busy: Option<u32>,
    pub(crate) n_ctx: Option<NonZeroU64>,
}

/// The result of one probe.
#[derive(Clone, Debug)]
pub(crate) struct Checked {
    pub(crate) health: Health,
    /// `None` when not asked; why not, when asked and not readable.
    pub(crate) slots: Option<Result<Slots, String>>,
    /// Where the slots were read: `/slots`, or llama-server's `/props`.
    pub(crate) slots_from: &'static str,
    /// `/slots` answered that the backend has none: 404 (vLLM, SGLang), or 501
    /// (llama-server's `--no-slots`) and its `/props` answered without them (not one that
    /// gave no answer or failed with a server error: asked again at the next probe).
    pub(crate) no_slots: bool,
    /// The largest `max_model_len` of `/v1/models` (vLLM's and SGLang's most tokens one
    /// request can take): `None` when not asked; why not, when asked and not readable.
    pub(crate) max_model_len: Option<Result<NonZeroU64, String>>,
}

/// Probes `base`: `/health`, then `/slots` if `slots` and the backend is ready (first
/// `/props`, with `props`: a llama-server, whose `/props` answers for its slots too; and
/// after a 501, llama-server's `--no-slots`, if not asked first). With `models`, a ready
/// backend without slots (its `/slots` answered so now, or was not asked) is asked
/// `/v1/models` for its `max_model_len`.
///
/// All of it within `timeout`: each request has what its predecessors left of it, so that a
/// probe is never out longer than the timeout the operator gave, whatever it asks.
pub(crate) async fn check(
    client: ProbeClient,
    base: Uri,
    headers: &HeaderMap,
    timeout: Duration,
    slots: bool,
    models: bool,
    props: bool,
) -> Checked {
    // A timeout past what the clock can count ahead (`Duration::MAX`) waits as long as one
    // that is as good as none.
    let now = tokio::time::Instant::now();
    let timeout = Timeout {
        deadline: now.checked_add(timeout).unwrap_or_else(|| now + FAR_AHEAD),
        whole: timeout,
    };
    let health = match get(&client, &base, "/health", headers, timeout).await {
        Ok((StatusCode::OK, _)) => Health::Ready,
        Ok((StatusCode::SERVICE_UNAVAILABLE, _)) => Health::Loading,
        Ok((status, _)) => Health::Failed(format!("/health answered {status}")),
        Err(e) => Health::Failed(format!("/health: {e}")),
    };
    let mut no_slots = false;
    let mut slots_from = "/slots";
    let slots = if slots && health == Health::Ready {
        // A llama-server run with `--sleep-idle-seconds` unloads its model once idle that
        // long, and reloads it for the next request. `/slots` is one: asked at every probe,
        // it would keep the server from ever sleeping, and it wakes one asleep. `/props` is
        // none, and gives the slot count and a slot's context too (not the busy slots);
        // whatever it does not give, `/slots` is asked.
        let asked = if props {
            Some(read_props(&client, &base, headers, timeout).await)
        } else {
            None
        };
        Some(match asked {
            Some(Props::Read(read)) => {
                slots_from = "/props";
                Ok(read)
            }
            asked => match get(&client, &base, "/slots", headers, timeout).await {
                // A llama-server run with `--no-slots`: it has slots, and only its `/slots`
                // is turned off; its `/props` still gives their count and context (asked
                // now, unless just asked). vLLM and SGLang answer 404, and are not asked it.
                Ok((StatusCode::NOT_IMPLEMENTED, _)) => {
                    let props = match asked {
                        Some(props) => props,
                        None => read_props(&client, &base, headers, timeout).await,
                    };
                    match props {
                        Props::Read(read) => {
                            slots_from = "/props";
                            Ok(read)
                        }
                        Props::Without => {
                            no_slots = true;
                            Err(format!("/slots answered {}", StatusCode::NOT_IMPLEMENTED))
                        }
                        // A `/props` that gave no answer (busy, slow, or failing) has not
                        // said that there are none: asked again at the next probe.
                        Props::Unanswered(e) => Err(format!(
                            "/slots answered {}, and /props did not say: {e}",
                            StatusCode::NOT_IMPLEMENTED
                        )),
                    }
                }
                Ok((StatusCode::NOT_FOUND, _)) => {
                    no_slots = true;
                    Err(format!("/slots answered {}", StatusCode::NOT_FOUND))
                }
                Ok((StatusCode::OK, body)) => parse_slots(&body).ok_or_else(|| {
                    "/slots gave no count: a non-empty JSON array of slot objects was expected"
                        .to_string()
                }),
                // llama-server run with `--api-key`: its `/health` answers without the key.
                Ok((status @ (StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN), _)) => {
                    Err(format!(
                        "/slots answered {status}: the backend wants an API key, and the probe \
                         was given none or another (HealthProbe::header)"
                    ))
                }
                Ok((status, _)) => Err(format!("/slots answered {status}")),
                Err(e) => Err(format!("/slots: {e}")),
            },
        })
    } else {
        None
    };
    let models = models && health == Health::Ready && (no_slots || slots.is_none());
    let max_model_len = if models {
        Some(
            match get(&client, &base, "/v1/models", headers, timeout).await {
                Ok((StatusCode::OK, body)) => parse_max_model_len(&body).ok_or_else(|| {
                    "/v1/models gave no max_model_len: a JSON object whose `data` lists \
                     models with `max_model_len` was expected"
                        .to_string()
                }),
                // vLLM and SGLang run with `--api-key` want it on every path under `/v1`.
                Ok((status @ (StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN), _)) => {
                    Err(format!(
                        "/v1/models answered {status}: the backend wants an API key, and the \
                         probe was given none or another (HealthProbe::header)"
                    ))
                }
                Ok((status, _)) => Err(format!("/v1/models answered {status}")),
                Err(e) => Err(format!("/v1/models: {e}")),
            },
        )
    } else {
        None
    };
    Checked {
        health,
        slots,
        slots_from,
        no_slots,
        max_model_len,
    }
}

/// What a llama-server's `/props` said of its slots.
enum Props {
    /// Their count and context ([`parse_props`]).
    Read(Slots),
    /// It answered without them.
    Without,
    /// It gave no answer in time, its connection failed, or it answered with a server error
    /// other than 501 (why): nothing said.
    Unanswered(String),
}

/// `GET /props`, read as llama-server's ([`parse_props`]).
async fn read_props(
    client: &ProbeClient,
    base: &Uri,
    headers: &HeaderMap,
    timeout: Timeout,
) -> Props {
    match get(client, base, "/props", headers, timeout).await {
        Ok((StatusCode::OK, body)) => parse_props(&body).map_or(Props::Without, Props::Read),
        // A server busy or failing (500, 503) has not said that it has no slots; 501 says
        // that it has no `/props`.
        Ok((status, _)) if status.is_server_error() && status != StatusCode::NOT_IMPLEMENTED => {
            Props::Unanswered(format!("it answered {status}"))
        }
        Ok(_) => Props::Without,
        Err(e) => Props::Unanswered(e),
    }
}

/// llama-server's `/props`: its slot count (`total_slots`, its `-np`) and a slot's context
/// (`default_generation_settings.n_ctx`, as each slot of `/slots` gives it), both needed;
/// busy slots it does not say. Anything else gives none.
pub(crate) fn parse_props(body: &[u8]) -> Option<Slots> {
    #[derive(serde::Deserialize)]
    struct Props {
        total_slots: u64,
        default_generation_settings: Settings,
    }
    #[derive(serde::Deserialize)]
    struct Settings {
        n_ctx: u64,
    }
    let props: Props = serde_json::from_slice(body).ok()?;
    Some(Slots {
        total: u32::try_from(props.total_slots).ok().filter(|&n| n > 0)?,
        busy: None,
        n_ctx: Some(NonZeroU64::new(props.default_generation_settings.n_ctx)?),
    })
}

/// vLLM's and SGLang's `/v1/models`: `{"data": [{"id": .., "max_model_len": ..}, ..]}`, the
/// largest of the models' (a server's LoRA adapters share its base model's).
pub(crate) fn parse_max_model_len(body: &[u8]) -> Option<NonZeroU64> {
    let list: serde_json::Value = serde_json::from_slice(body).ok()?;
    list.get("data")?
        .as_array()?
        .iter()
        .filter_map(|m| m.get("max_model_len").and_then(serde_json::Value::as_u64))
        .max()
        .and_then(NonZeroU64::new)
}

/// llama-server's `/slots`: a JSON array, one object per slot, each with `is_processing` and
/// `n_ctx` (the slot's share of `-c`, or all of it with `--kv-unified`); releases of 2024
/// give `state` in place of `is_processing` (0 idle, 1 processing). Anything else, an array
/// of anything but objects included, gives no count.
pub(crate) fn parse_slots(body: &[u8]) -> Option<Slots> {
    // Read one slot object at a time, keeping only the counts: a body of millions of empty
    // objects (the probe reads up to its limit) costs no more memory than one slot's.
    let tally: SlotsTally = serde_json::from_slice(body).ok()?;
    let total = u32::try_from(tally.total).ok().filter(|&n| n > 0)?;
    Some(Slots {
        total,
        busy: Some(u32::try_from(tally.busy).unwrap_or(total)),
        n_ctx: NonZeroU64::new(tally.n_ctx),
    })
}

/// What a `/slots` array says: how many slot objects, how many of them are busy
/// (`"is_processing": true`, or without it a `state` other than 0), and the largest `n_ctx`
/// that is a whole number (0 if none). A member given twice counts as its last, as a JSON
/// object read whole keeps it.
#[derive(Default)]
struct SlotsTally {
    total: u64,
    busy: u64,
    n_ctx: u64,
}

impl<'de> serde::Deserialize<'de> for SlotsTally {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Each;
        impl<'de> serde::de::Visitor<'de> for Each {
            type Value = SlotsTally;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array of slot objects")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<SlotsTally, A::Error> {
                let mut tally = SlotsTally::default();
                while let Some(slot) = seq.next_element::<Slot>()? {
                    tally.total += 1;
                    tally.busy += u64::from(slot.busy);
                    tally.n_ctx = tally.n_ctx.max(slot.n_ctx);
                }
                Ok(tally)
            }
        }
        d.deserialize_seq(Each)
    }
}

/// One slot object of `/slots`, of which only whether it is busy and its `n_ctx` are kept;
/// anything but an object is an error, and so no count.
struct Slot {
    busy: bool,
    n_ctx: u64,
}

impl<'de> serde::Deserialize<'de> for Slot {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Members;
        impl<'de> serde::de::Visitor<'de> for Members {
            type Value = Slot;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a slot object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Slot, A::Error> {
                let mut slot = Slot {
                    busy: false,
                    n_ctx: 0,
                };
                // `is_processing` where given; else `state` (llama-server's of 2024).
                let (mut processing, mut state) = (None, None);
                while let Some(key) = map.next_key::<SlotMember>()? {
                    match key {
                        SlotMember::IsProcessing => {
                            let v: serde_json::Value = map.next_value()?;
                            processing = Some(v.as_bool() == Some(true));
                        }
                        SlotMember::State => {
                            let v: serde_json::Value = map.next_value()?;
                            state = Some(v.as_u64().is_some_and(|n| n != 0));
                        }
                        SlotMember::NCtx => {
                            let v: serde_json::Value = map.next_value()?;
                            slot.n_ctx = v.as_u64().unwrap_or(0);
                        }
                        SlotMember::Other => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                        }
                    }
                }
                slot.busy = processing.or(state).unwrap_or(false);
                Ok(slot)
            }
        }
        d.deserialize_map(Members)
    }
}

/// A slot object's member name, as far as the count reads it.
#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum SlotMember {
    IsProcessing,
    State,
    NCtx,
    #[serde(other)]
    Other,
}

/// When a probe's time runs out, and how long it was given (for the error).
#[derive(Clone, Copy)]
struct Timeout {
    deadline: tokio::time::Instant,
    whole: Duration,
}

/// `path` under `base`: after the base's path, less its trailing `/` (a target sent under a
/// prefix, `http://gateway/llama-a/`, is probed at `/llama-a/health`), with the base's query
/// after it, if it has one.
fn under(base: &Uri, path: &'static str) -> Result<Uri, String> {
    let prefix = base.path().trim_end_matches('/');
    let mut parts = base.clone().into_parts();
    parts.path_and_query = Some(if prefix.is_empty() && base.query().is_none() {
        http::uri::PathAndQuery::from_static(path)
    } else {
        let query = base.query().map(|q| format!("?{q}")).unwrap_or_default();
        format!("{prefix}{path}{query}")
            .parse()
            .map_err(|e: http::uri::InvalidUri| e.to_string())?
    });
    Uri::from_parts(parts).map_err(|e| e.to_string())
}

/// `GET base + path` with `headers`: its status and body, before `timeout` runs out.
async fn get(
    client: &ProbeClient,
    base: &Uri,
    path: &'static str,
    headers: &HeaderMap,
    timeout: Timeout,
) -> Result<(StatusCode, Bytes), String> {
    if tokio::time::Instant::now() >= timeout.deadline {
        // Spent on what was asked before.
        return Err(format!(
            "not asked: the probe's {:?} ran out before",
            timeout.whole
        ));
    }
    let uri = under(base, path)?;
    let mut req = Request::new(Empty::new());
    *req.uri_mut() = uri;
    *req.headers_mut() = headers.clone();
    let fetch = async {
        let res = client
            .request(req)
            .await
            .map_err(|e| crate::client::HttpBackendError::classify(e.into()).to_string())?;
        let status = res.status();
        let body = Limited::new(res.into_body(), BODY_LIMIT)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, body))
    };
    tokio::time::timeout_at(timeout.deadline, fetch)
        .await
        .map_err(|_| format!("no answer within {:?}", timeout.whole))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_path_is_joined_to_the_base_uri_whatever_its_form() {
        for (base, want) in [
            ("http://10.0.0.1:8080/", "http://10.0.0.1:8080/health"),
            ("http://10.0.0.1:8080", "http://10.0.0.1:8080/health"),
            ("http://[::1]:8080/", "http://[::1]:8080/health"),
            ("http://[fe80::1]:8080", "http://[fe80::1]:8080/health"),
            ("http://gw/llama-a/", "http://gw/llama-a/health"),
            ("http://gw/llama-a", "http://gw/llama-a/health"),
            ("http://gw/a/b//", "http://gw/a/b/health"),
            ("http://gw/llama-a/?t=1", "http://gw/llama-a/health?t=1"),
        ] {
            let uri = under(&Uri::from_static(base), "/health").unwrap();
            assert_eq!(uri.to_string(), want, "{base}");
        }
    }

    #[test]
    fn slots_are_counted_and_busy_ones_too() {
        let body = br#"[{"id":0,"is_processing":true},{"id":1,"is_processing":false},{"id":2}]"#;
        let n_ctx = None;
        assert_eq!(
            parse_slots(body),
            Some(Slots {
                total: 3,
                busy: Some(1),
                n_ctx
            })
        );
        // llama-server 0.94's shape, `-np 2 -c 8192`: each slot has half.
        let body = br#"[{"id":0,"n_ctx":4096,"speculative":false,"is_processing":false},
            {"id":1,"n_ctx":4096,"speculative":false,"is_processing":true}]"#;
        let n_ctx = NonZeroU64::new(4096);
        assert_eq!(
            parse_slots(body),
            Some(Slots {
                total: 2,
                busy: Some(1),
                n_ctx
            })
        );
        // A count that is not one is left out.
        let body = br#"[{"id":0,"n_ctx":-1},{"id":1,"n_ctx":"8192"},{"id":2,"n_ctx":0}]"#;
        assert_eq!(parse_slots(body).unwrap().n_ctx, None);
        assert_eq!(parse_slots(b"[]"), None);
        assert_eq!(parse_slots(b"{}"), None);
        assert_eq!(parse_slots(b"not json"), None);
    }

    /// llama-server releases of 2024 give no `is_processing`, but `state`: 0 idle, 1
    /// processing.
    #[test]
    fn a_slot_whose_state_is_not_idle_is_busy_where_is_processing_is_not_given() {
        let body = br#"[{"n_ctx":4096,"id":0,"id_task":7,"state":1,"prompt":"hi"},
            {"n_ctx":4096,"id":1,"id_task":-1,"state":0,"prompt":""}]"#;
        assert_eq!(parse_slots(body).and_then(|s| s.busy), Some(1));
        // `is_processing`, where given, says, whatever the order.
        let body = br#"[{"state":1,"is_processing":false},{"is_processing":true,"state":0}]"#;
        assert_eq!(parse_slots(body).and_then(|s| s.busy), Some(1));
    }

    /// Another server's answer at `/slots` (a catch-all route, a proxy's error list) is no
    /// count: a hundred thousand zeros would otherwise be read as 65,536 slots, and the
    /// balancer would send that backend as many requests at once.
    #[test]
    fn an_array_of_anything_but_slot_objects_gives_no_count() {
        assert_eq!(parse_slots(b"[0,0,0]"), None);
        assert_eq!(parse_slots(br#"["slot-0","slot-1"]"#), None);
        assert_eq!(parse_slots(br#"[{"id":0},null]"#), None);
        assert_eq!(parse_slots(br#"[[{"id":0}]]"#), None);
        let zeros = format!("[{}0]", "0,".repeat(100_000));
        assert_eq!(parse_slots(zeros.as_bytes()), None);
        // An object without the fields llama-server gives is still a slot.
        assert_eq!(parse_slots(b"[{}]").map(|s| s.total), Some(1));
    }

    use proptest::strategy::Strategy as _;

    /// The count as it was read before, whole: the reference the count one slot at a time
    /// must agree with.
    fn parse_slots_whole(body: &[u8]) -> Option<Slots> {
        let slots: Vec<serde_json::Value> = serde_json::from_slice(body).ok()?;
        if !slots.iter().all(serde_json::Value::is_object) {
            return None;
        }
        let total = u32::try_from(slots.len()).ok().filter(|&n| n > 0)?;
        let busy = slots
            .iter()
            .filter(|s| match s.get("is_processing") {
                Some(v) => v.as_bool() == Some(true),
                None => s
                    .get("state")
                    .and_then(serde_json::Value::as_u64)
                    .is_some_and(|n| n != 0),
            })
            .count();
        let n_ctx = slots
            .iter()
            .filter_map(|s| s.get("n_ctx").and_then(serde_json::Value::as_u64))
            .max()
            .and_then(NonZeroU64::new);
        Some(Slots {
            total,
            busy: Some(u32::try_from(busy).unwrap_or(total)),
            n_ctx,
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]

        /// Any array of slot-like objects (and some that are not objects) is counted one slot
        /// at a time as it was read whole: members given twice, of any type, escaped names.
        #[test]
        fn slots_counted_one_at_a_time_agree_with_the_body_read_whole(
            slots in proptest::collection::vec(
                proptest::prop_oneof![
                    8 => proptest::collection::vec(
                        (
                            proptest::prop_oneof![
                                proptest::strategy::Just("is_processing"),
                                proptest::strategy::Just("state"),
                                proptest::strategy::Just("n_ctx"),
                                proptest::strategy::Just("id"),
                                proptest::strategy::Just("n_\\u0063tx"),
                                proptest::strategy::Just("is_processing\\u0000"),
                            ],
                            proptest::prop_oneof![
                                proptest::strategy::Just("true"),
                                proptest::strategy::Just("false"),
                                proptest::strategy::Just("null"),
                                proptest::strategy::Just("0"),
                                proptest::strategy::Just("-1"),
                                proptest::strategy::Just("4096"),
                                proptest::strategy::Just("1.5"),
                                proptest::strategy::Just("18446744073709551615"),
                                proptest::strategy::Just("18446744073709551616"),
                                proptest::strategy::Just("\"8192\""),
                                proptest::strategy::Just("[true]"),
                                proptest::strategy::Just("{\"n_ctx\":5}"),
                            ],
                        ),
                        0..4,
                    )
                    .prop_map(|members: Vec<(&str, &str)>| {
                        let members: Vec<String> =
                            members.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
                        format!("{{{}}}", members.join(","))
                    }),
                    1 => proptest::prop_oneof![
                        proptest::strategy::Just("0".to_string()),
                        proptest::strategy::Just("null".to_string()),
                        proptest::strategy::Just("[]".to_string()),
                        proptest::strategy::Just("\"slot\"".to_string()),
                    ],
                ],
                0..6,
            ),
        ) {
            let body = format!("[{}]", slots.join(","));
            proptest::prop_assert_eq!(
                parse_slots(body.as_bytes()),
                parse_slots_whole(body.as_bytes()),
                "{}",
                body
            );
        }
    }

    #[test]
    fn props_give_the_slots_and_their_context_but_not_the_busy_ones() {
        // llama-server 0.94's shape, `-np 2 -c 8192`, cut short (asleep or not alike).
        let body = br#"{"default_generation_settings":{"params":{"seed":4294967295},"n_ctx":4096},
            "total_slots":2,"model_alias":"m","endpoint_slots":true,"is_sleeping":true}"#;
        let n_ctx = NonZeroU64::new(4096);
        let busy = None;
        assert_eq!(
            parse_props(body),
            Some(Slots {
                total: 2,
                busy,
                n_ctx
            })
        );
        // Each is needed, and a count that is one.
        for body in [
            &br#"{"total_slots":2}"#[..],
            br#"{"default_generation_settings":{"n_ctx":4096}}"#,
            br#"{"total_slots":0,"default_generation_settings":{"n_ctx":4096}}"#,
            br#"{"total_slots":2,"default_generation_settings":{"n_ctx":0}}"#,
            br#"{"total_slots":"2","default_generation_settings":{"n_ctx":4096}}"#,
            br#"{"total_slots":-1,"default_generation_settings":{"n_ctx":4096}}"#,
            b"[]",
            b"not json",
        ] {
            assert_eq!(parse_props(body), None, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn max_model_len_is_the_largest_a_models_list_gives() {
        // vLLM's shape: a base model and a LoRA adapter on it.
        let body = br#"{"object":"list","data":[
            {"id":"qwen","object":"model","owned_by":"vllm","root":"qwen","max_model_len":32768},
            {"id":"qwen-lora","object":"model","owned_by":"vllm","parent":"qwen","max_model_len":32768}]}"#;
        assert_eq!(parse_max_model_len(body), NonZeroU64::new(32768));
        let body =
            br#"{"data":[{"id":"a","max_model_len":8192},{"id":"b","max_model_len":131072}]}"#;
        assert_eq!(parse_max_model_len(body), NonZeroU64::new(131072));
        // llama-server's shape has none (its `meta.n_ctx_train` is the model's training
        // context, not the server's); neither has a count that is not one.
        let body = br#"{"object":"list","data":[{"id":"m","meta":{"n_ctx_train":131072}}]}"#;
        assert_eq!(parse_max_model_len(body), None);
        for body in [
            &br#"{"data":[{"id":"a","max_model_len":0}]}"#[..],
            br#"{"data":[{"id":"a","max_model_len":"8192"}]}"#,
            br#"{"data":[{"id":"a","max_model_len":-1}]}"#,
            br#"{"data":{}}"#,
            br#"[]"#,
            b"not json",
        ] {
            assert_eq!(
                parse_max_model_len(body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }
}
