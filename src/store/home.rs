//! [`StoredHome`]: a session's home as a shared store holds it, and its value format.

use std::fmt;

use crate::{BackendId, NodeId};

/// A session's home as a shared store holds it: the backend and node by their names, so that
/// any router process with the same fleet can read it. (Inside one process, homes are held by
/// internal indexes that mean nothing to another.)
///
/// Its value format, version 1, is a small JSON object:
///
/// ```text
/// {"v":1,"backend":"gpu-0","node":"host-a"}
/// ```
///
/// A reader ignores members it does not know, and a value whose `v` is not 1 is not read
/// (a later format takes a new version).
///
/// ```
/// use tower_affinity::store::StoredHome;
///
/// let home = StoredHome::new("gpu-0", "host-a");
/// let value = home.encode();
/// assert_eq!(value, r#"{"v":1,"backend":"gpu-0","node":"host-a"}"#);
/// assert_eq!(StoredHome::decode(value.as_bytes()), Some(home));
/// assert_eq!(StoredHome::decode(b"not a home"), None);
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct StoredHome {
    /// The backend that served the session's last turn.
    pub backend: BackendId,
    /// Its node.
    pub node: NodeId,
}

/// The version [`StoredHome::encode`] writes and [`StoredHome::decode`] reads.
const VERSION: u64 = 1;

impl StoredHome {
    /// A home on `backend`, which runs on `node`.
    pub fn new(backend: impl Into<BackendId>, node: impl Into<NodeId>) -> Self {
        StoredHome {
            backend: backend.into(),
            node: node.into(),
        }
    }

    /// The home in the value format, version 1.
    pub fn encode(&self) -> String {
        // By hand, so that the members come in this order; serde_json escapes the names.
        let quote = |s: &str| serde_json::Value::from(s).to_string();
        format!(
            r#"{{"v":{VERSION},"backend":{},"node":{}}}"#,
            quote(self.backend.as_str()),
            quote(self.node.as_str())
        )
    }

    /// Reads a value in the format [`encode`](Self::encode) writes; `None` if it is anything
    /// else (not JSON, another version, a name missing or not a string, an empty backend).
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
        Some(StoredHome::new(backend, node))
    }
}

impl fmt::Debug for StoredHome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoredHome({} on {})", self.backend, self.node)
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
}
