//! [`StoredHome`]: a session's home as a shared store holds it, and its value format.

use std::fmt;
use std::time::{Duration, SystemTime};

use crate::{BackendId, NodeId};

/// A session's home as a shared store holds it: the backend and node by their names, so that
/// any router process with the same fleet can read it. (Inside one process, homes are held by
/// internal indexes that mean nothing to another.)
///
/// Its value format, version 1, is a small JSON object:
///
/// ```text
/// {"v":1,"backend":"gpu-0","node":"host-a","tip":"9f86d081884c7d65","placed":1796601600000}
/// ```
///
/// `placed`, optional, is when the turn that wrote the home was placed, in milliseconds since
/// the Unix epoch by the writing replica's clock: a home written again after an outage
/// replaces only an older one (see [`HomeStore::rewrite`](super::HomeStore::rewrite)).
/// `tip`, optional, is the digest of the prompt of the turn that placed the home, where that
/// turn ended (a [`PromptChain`](crate::PromptChain) link, 16 hex digits): a replica that reads
/// the home finds it in the next turn's prompt (the home holds the prompt up to there) or
/// does not (the client compacted its history). A home without it, as every value was
/// written before it came in, reads as a home whose cache is not known. A reader ignores
/// members it does not know, and a value whose `v` is not 1 is not read (a later format
/// that older readers must not read takes a new version). Build one with
/// [`new`](StoredHome::new), [`with_tip`](StoredHome::with_tip) and
/// [`with_placed`](StoredHome::with_placed); its fields are for reading.
///
/// ```
/// use tower_affinity::store::StoredHome;
///
/// let home = StoredHome::new("gpu-0", "host-a");
/// let value = home.encode();
/// assert_eq!(value, r#"{"v":1,"backend":"gpu-0","node":"host-a"}"#);
/// assert_eq!(StoredHome::decode(value.as_bytes()), Some(home.clone()));
/// assert_eq!(StoredHome::decode(b"not a home"), None);
///
/// let placed = home.with_tip(0x9f86_d081_884c_7d65);
/// let value = placed.encode();
/// assert_eq!(value, r#"{"v":1,"backend":"gpu-0","node":"host-a","tip":"9f86d081884c7d65"}"#);
/// assert_eq!(StoredHome::decode(value.as_bytes()), Some(placed.clone()));
///
/// let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(1_796_601_600_000);
/// let dated = placed.with_placed(at);
/// assert!(dated.encode().ends_with(r#","placed":1796601600000}"#));
/// assert_eq!(StoredHome::decode(dated.encode().as_bytes()), Some(dated));
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct StoredHome {
    /// The backend that served the session's last turn.
    pub backend: BackendId,
    /// Its node.
    pub node: NodeId,
    /// Where the prompt of the turn that placed the home ended: the digest of that chain
    /// link. `None` if the turn had no prompt chain, or the value was written without it.
    pub tip: Option<u64>,
    /// When the turn that wrote the home was placed, to the millisecond. `None` if the value
    /// was written without it.
    pub placed: Option<SystemTime>,
}

/// The version [`StoredHome::encode`] writes and [`StoredHome::decode`] reads.
const VERSION: u64 = 1;

impl StoredHome {
    /// A home on `backend`, which runs on `node`.
    pub fn new(backend: impl Into<BackendId>, node: impl Into<NodeId>) -> Self {
        StoredHome {
            backend: backend.into(),
            node: node.into(),
            tip: None,
            placed: None,
        }
    }

    /// The home with `tip`, the digest of the chain link where the prompt of the turn that
    /// placed it ended.
    pub fn with_tip(mut self, tip: u64) -> Self {
        self.tip = Some(tip);
        self
    }

    /// The home with `placed`, when the turn that wrote it was placed. Kept to the
    /// millisecond; a time before the Unix epoch is kept as the epoch.
    pub fn with_placed(mut self, placed: SystemTime) -> Self {
        let millis = Duration::from_millis(placed_millis(placed));
        self.placed = Some(SystemTime::UNIX_EPOCH.checked_add(millis).unwrap_or(placed));
        self
    }

    /// The home in the value format, version 1.
    pub fn encode(&self) -> String {
        // By hand, so that the members come in this order; serde_json escapes the names.
        let quote = |s: &str| serde_json::Value::from(s).to_string();
        let tip = self
            .tip
            .map_or(String::new(), |t| format!(r#","tip":"{t:016x}""#));
        let placed = self.placed.map_or(String::new(), |p| {
            format!(r#","placed":{}"#, placed_millis(p))
        });
        format!(
            r#"{{"v":{VERSION},"backend":{},"node":{}{tip}{placed}}}"#,
            quote(self.backend.as_str()),
            quote(self.node.as_str())
        )
    }

    /// Reads a value in the format [`encode`](Self::encode) writes; `None` if it is anything
    /// else (not JSON, another version, a name missing or not a string, an empty backend). A
    /// `tip` that is not 16 hex digits, or a `placed` that is not a whole number of
    /// milliseconds a clock can hold, is left out: the home is still one.
    pub fn decode(value: &[u8]) -> Option<Self> {
        let v: serde_json::Value = serde_json::from_slice(value).ok()?;
        if v.get("v")?.as_u64()? != VERSION {
            return None;
        }
        let backend = v.get("backend")?.as_str()?;
        let node = v.get("node")?.as_str()?;
        if backend.is_empty() {
            return None;
        }
        let tip = v
            .get("tip")
            .and_then(|t| t.as_str())
            .filter(|t| t.len() == 16 && t.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|t| u64::from_str_radix(t, 16).ok());
        let placed = v
            .get("placed")
            .and_then(|p| p.as_u64())
            .and_then(|ms| SystemTime::UNIX_EPOCH.checked_add(Duration::from_millis(ms)));
        Some(StoredHome {
            tip,
            placed,
            ..StoredHome::new(backend, node)
        })
    }
}

/// Milliseconds since the Unix epoch; 0 before it, `u64::MAX` past what 64 bits hold.
pub(crate) fn placed_millis(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl fmt::Debug for StoredHome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoredHome({} on {}", self.backend, self.node)?;
        if let Some(t) = self.tip {
            write!(f, ", tip {t:016x}")?;
        }
        if let Some(p) = self.placed {
            write!(f, ", placed {}", placed_millis(p))?;
        }
        f.write_str(")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_name_survives_the_format() {
        for (b, n) in [("a b", "x\ny"), ("\"q\"", "{}"), ("ü", "")] {
            let h = StoredHome::new(b, n);
            assert_eq!(StoredHome::decode(h.encode().as_bytes()), Some(h));
        }
    }

    #[test]
    fn other_values_are_not_homes() {
        for v in [
            &b""[..],
            b"v1 gpu-0 host-a",
            b"{}",
            br#"{"v":2,"backend":"a","node":"n"}"#,
            br#"{"v":1,"backend":"","node":"n"}"#,
            br#"{"v":1,"backend":7,"node":"n"}"#,
            br#"{"v":1,"node":"n"}"#,
            br#"[1,2]"#,
            b"\xff\xfe",
        ] {
            assert_eq!(
                StoredHome::decode(v),
                None,
                "{:?}",
                String::from_utf8_lossy(v)
            );
        }
        // Members a later writer adds are ignored.
        assert_eq!(
            StoredHome::decode(br#"{"v":1,"backend":"a","node":"n","since":5}"#),
            Some(StoredHome::new("a", "n"))
        );
    }

    #[test]
    fn a_value_without_a_tip_or_with_a_bad_one_is_a_home_without_a_tip() {
        let home = StoredHome::new("a", "n");
        for v in [
            &br#"{"v":1,"backend":"a","node":"n"}"#[..],
            br#"{"v":1,"backend":"a","node":"n","tip":7}"#,
            br#"{"v":1,"backend":"a","node":"n","tip":"xyz"}"#,
            br#"{"v":1,"backend":"a","node":"n","tip":"+000000000000001"}"#,
            br#"{"v":1,"backend":"a","node":"n","tip":"00000000000000001"}"#,
        ] {
            assert_eq!(
                StoredHome::decode(v),
                Some(home.clone()),
                "{:?}",
                String::from_utf8_lossy(v)
            );
        }
        for tip in [0, 1, u64::MAX, 0x0123_4567_89ab_cdef] {
            let h = home.clone().with_tip(tip);
            assert_eq!(StoredHome::decode(h.encode().as_bytes()), Some(h));
        }
    }

    #[test]
    fn a_placed_time_survives_the_format_to_the_millisecond_and_a_bad_one_is_left_out() {
        let home = StoredHome::new("a", "n").with_tip(7);
        let at = SystemTime::UNIX_EPOCH + Duration::from_nanos(1_796_601_600_123_456_789);
        let dated = home.clone().with_placed(at);
        let millis = SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_601_600_123);
        assert_eq!(dated.placed, Some(millis));
        assert_eq!(StoredHome::decode(dated.encode().as_bytes()), Some(dated));
        let before = SystemTime::UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(
            home.clone().with_placed(before).placed,
            Some(SystemTime::UNIX_EPOCH)
        );
        for v in [
            &br#"{"v":1,"backend":"a","node":"n","tip":"0000000000000007","placed":"5"}"#[..],
            br#"{"v":1,"backend":"a","node":"n","tip":"0000000000000007","placed":-5}"#,
            br#"{"v":1,"backend":"a","node":"n","tip":"0000000000000007","placed":1.5}"#,
            br#"{"v":1,"backend":"a","node":"n","tip":"0000000000000007","placed":null}"#,
        ] {
            assert_eq!(
                StoredHome::decode(v),
                Some(home.clone()),
                "{:?}",
                String::from_utf8_lossy(v)
            );
        }
    }

    #[test]
    fn a_home_debugs_as_its_backend_node_tip_and_placed_millis() {
        let home = StoredHome::new("gpu-0", "host-a");
        assert_eq!(format!("{home:?}"), "StoredHome(gpu-0 on host-a)");
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_601_600_000);
        let dated = home.with_tip(0x9f).with_placed(at);
        assert_eq!(
            format!("{dated:?}"),
            "StoredHome(gpu-0 on host-a, tip 000000000000009f, placed 1796601600000)"
        );
    }
}
