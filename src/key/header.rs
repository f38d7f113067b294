use std::sync::Arc;

use http::header::HeaderName;

use super::{KeyExtractor, SessionKey};

/// Reads the session key from request headers, trying each name in order.
///
/// The default reads `X-Session-Affinity`, then `X-Session-Id`. An empty value falls through to
/// the next name; so does a value made only of spaces or tabs. When a header is repeated, its
/// first value counts. Values are taken as raw bytes, so a value that is not UTF-8 still names
/// a session.
///
/// ```
/// use tower_affinity::key::{HeaderKey, KeyExtractor, SessionKey};
///
/// let key = HeaderKey::default();
/// let req = http::Request::get("/")
///     .header("x-session-affinity", "")
///     .header("x-session-id", "run-42")
///     .body(())
///     .unwrap();
/// assert_eq!(key.extract(&req), Some(SessionKey::from_bytes(b"run-42")));
///
/// let custom = HeaderKey::new(["x-conversation"]);
/// let req = http::Request::get("/").header("x-conversation", "c1").body(()).unwrap();
/// assert!(custom.extract(&req).is_some());
/// ```
#[derive(Clone, Debug)]
pub struct HeaderKey {
    names: Arc<[HeaderName]>,
}

impl HeaderKey {
    /// `X-Session-Affinity`: the header the study's agents send.
    pub const AFFINITY: HeaderName = HeaderName::from_static("x-session-affinity");
    /// `X-Session-Id`: the fallback header.
    pub const SESSION_ID: HeaderName = HeaderName::from_static("x-session-id");

    /// Reads the given header names, in order.
    ///
    /// # Panics
    ///
    /// If a name is not a valid header name. Use [`HeaderKey::try_new`] for names that come from
    /// configuration.
    pub fn new<I>(names: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        match Self::try_new(names) {
            Ok(key) => key,
            Err(e) => panic!("invalid header name for HeaderKey: {e}"),
        }
    }

    /// Reads the given header names, in order, or fails on the first invalid name.
    pub fn try_new<I>(names: I) -> Result<Self, http::header::InvalidHeaderName>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let names = names
            .into_iter()
            .map(|n| HeaderName::from_bytes(n.as_ref().as_bytes()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(HeaderKey {
            names: names.into(),
        })
    }

    /// The names read, in order.
    pub fn names(&self) -> &[HeaderName] {
        &self.names
    }
}

impl HeaderKey {
    /// Whether the headers carry a key, by the rules of [`extract`](KeyExtractor::extract),
    /// without digesting it.
    pub(crate) fn finds_key(&self, headers: &http::HeaderMap) -> bool {
        self.names.iter().any(|name| {
            headers
                .get(name)
                .is_some_and(|v| !v.as_bytes().trim_ascii().is_empty())
        })
    }
}

impl Default for HeaderKey {
    fn default() -> Self {
        HeaderKey {
            names: Arc::new([Self::AFFINITY, Self::SESSION_ID]),
        }
    }
}

impl<B> KeyExtractor<http::Request<B>> for HeaderKey {
    fn extract(&self, req: &http::Request<B>) -> Option<SessionKey> {
        let headers = req.headers();
        self.names.iter().find_map(|name| {
            let value = headers.get(name)?.as_bytes();
            let trimmed = value.trim_ascii();
            (!trimmed.is_empty()).then(|| SessionKey::from_bytes(trimmed))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(headers: &[(&str, &[u8])]) -> http::Request<()> {
        let mut b = http::Request::get("/");
        for (n, v) in headers {
            b = b.header(*n, http::HeaderValue::from_bytes(v).unwrap());
        }
        b.body(()).unwrap()
    }

    #[test]
    fn affinity_header_wins_over_session_id() {
        let r = req(&[("x-session-id", b"b"), ("x-session-affinity", b"a")]);
        assert_eq!(
            HeaderKey::default().extract(&r),
            Some(SessionKey::from_bytes(b"a"))
        );
    }

    #[test]
    fn empty_value_falls_through_to_the_next_header() {
        let r = req(&[("x-session-affinity", b"  "), ("x-session-id", b"b")]);
        assert_eq!(
            HeaderKey::default().extract(&r),
            Some(SessionKey::from_bytes(b"b"))
        );
    }

    #[test]
    fn no_header_means_no_key() {
        assert_eq!(HeaderKey::default().extract(&req(&[])), None);
        let r = req(&[("x-session-affinity", b""), ("x-session-id", b"")]);
        assert_eq!(HeaderKey::default().extract(&r), None);
    }

    #[test]
    fn repeated_header_uses_its_first_value() {
        let r = req(&[("x-session-id", b"first"), ("x-session-id", b"second")]);
        assert_eq!(
            HeaderKey::default().extract(&r),
            Some(SessionKey::from_bytes(b"first"))
        );
    }

    #[test]
    fn non_utf8_value_is_a_key() {
        let r = req(&[("x-session-id", &[0xff, 0xfe, b'a'])]);
        assert!(HeaderKey::default().extract(&r).is_some());
    }

    #[test]
    fn finds_key_agrees_with_extract() {
        let cases: [&[(&str, &[u8])]; 6] = [
            &[],
            &[("x-session-id", b"")],
            &[("x-session-affinity", b" \t"), ("x-session-id", b"")],
            &[("x-session-affinity", b" \t"), ("x-session-id", b"b")],
            &[("x-session-id", b"first"), ("x-session-id", b" ")],
            &[("x-other", b"a")],
        ];
        let key = HeaderKey::default();
        for headers in cases {
            let r = req(headers);
            assert_eq!(
                key.finds_key(r.headers()),
                key.extract(&r).is_some(),
                "{headers:?}"
            );
        }
    }

    #[test]
    fn invalid_configured_name_is_an_error() {
        assert!(HeaderKey::try_new(["bad name"]).is_err());
    }
}
