//! One probe of one backend: `GET /health`, then `GET /slots` if asked.

use std::time::Duration;

use bytes::Bytes;
use http::{StatusCode, Uri};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;

/// The client the probe sends with.
pub(crate) type ProbeClient = Client<HttpConnector, Empty<Bytes>>;

/// The most of a probe answer read: `/slots` of a large server is a few KiB a slot.
const BODY_LIMIT: usize = 1 << 20;

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

/// What `/slots` said: how many slots, and how many of them are processing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slots {
    pub(crate) total: u32,
    pub(crate) busy: u32,
}

/// The result of one probe.
#[derive(Clone, Debug)]
pub(crate) struct Checked {
    pub(crate) health: Health,
    /// `None` when not asked; why not, when asked and not readable.
    pub(crate) slots: Option<Result<Slots, String>>,
}

/// Probes `base`: `/health`, then `/slots` if `slots` and the backend is ready.
pub(crate) async fn check(
    client: ProbeClient,
    base: Uri,
    timeout: Duration,
    slots: bool,
) -> Checked {
    let health = match get(&client, &base, "/health", timeout).await {
        Ok((StatusCode::OK, _)) => Health::Ready,
        Ok((StatusCode::SERVICE_UNAVAILABLE, _)) => Health::Loading,
        Ok((status, _)) => Health::Failed(format!("/health answered {status}")),
        Err(e) => Health::Failed(format!("/health: {e}")),
    };
    let slots = if slots && health == Health::Ready {
        Some(match get(&client, &base, "/slots", timeout).await {
            Ok((StatusCode::OK, body)) => parse_slots(&body).ok_or_else(|| {
                "/slots gave no count: a non-empty JSON array was expected".to_string()
            }),
            Ok((status, _)) => Err(format!("/slots answered {status}")),
            Err(e) => Err(format!("/slots: {e}")),
        })
    } else {
        None
    };
    Checked { health, slots }
}

/// llama-server's `/slots`: a JSON array, one object per slot, each with `is_processing`.
pub(crate) fn parse_slots(body: &[u8]) -> Option<Slots> {
    let slots: Vec<serde_json::Value> = serde_json::from_slice(body).ok()?;
    let total = u32::try_from(slots.len()).ok().filter(|&n| n > 0)?;
    let busy = slots
        .iter()
        .filter(|s| s.get("is_processing").and_then(serde_json::Value::as_bool) == Some(true))
        .count();
    Some(Slots {
        total,
        busy: u32::try_from(busy).unwrap_or(total),
    })
}

/// `GET base + path`: its status and body, within `timeout`.
async fn get(
    client: &ProbeClient,
    base: &Uri,
    path: &'static str,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), String> {
    let mut parts = base.clone().into_parts();
    parts.path_and_query = Some(http::uri::PathAndQuery::from_static(path));
    let uri = Uri::from_parts(parts).map_err(|e| e.to_string())?;
    let fetch = async {
        let res = client
            .get(uri)
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
    tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| format!("no answer within {timeout:?}"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_counted_and_busy_ones_too() {
        let body = br#"[{"id":0,"is_processing":true},{"id":1,"is_processing":false},{"id":2}]"#;
        assert_eq!(parse_slots(body), Some(Slots { total: 3, busy: 1 }));
        assert_eq!(parse_slots(b"[]"), None);
        assert_eq!(parse_slots(b"{}"), None);
        assert_eq!(parse_slots(b"not json"), None);
    }
}
