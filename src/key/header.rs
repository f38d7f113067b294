use std::fmt;
use std::sync::Arc;

use http::header::HeaderName;

use super::{KeyExtractor, SessionKey};

/// Reads the session key from request headers, trying each name in order.
///
/// The default reads the headers that agents send today ([`DEFAULT_NAMES`](Self::DEFAULT_NAMES)):
///
/// | header | sent by |
/// |---|---|
/// | `X-Session-Affinity` | opencode (custom providers), and any client told to |
/// | `X-Session-Id` | opencode (custom providers), and any client told to |
/// | `X-Claude-Code-Session-Id` | Claude Code (2.1.86 on); with a sub-agent's `X-Claude-Code-Agent-Id` (2.1.139 on), both together |
/// | `thread-id` | Codex CLI: the agent thread; a sub-agent has its own |
/// | `thread_id` | Codex CLI before 0.131 (its last releases): the agent thread |
/// | `session-id` | Codex CLI: the session, shared by its threads |
/// | `session_id` | Codex CLI before 0.131 |
/// | `agent-session-id` | Goose |
///
/// Codex sends `thread-id` and `session-id` together (its last releases before 0.131,
/// `thread_id` and `session_id`); the thread comes first because each has a prompt of its
/// own. Claude Code's sub-agents, each with a prompt of its own too, share their session's
/// `X-Claude-Code-Session-Id` and add an `X-Claude-Code-Agent-Id` of their own: where the key
/// is read from the first, it is the digest of both, so each sub-agent is a session of its
/// own within its session (the main agent, which sends no agent id, keeps its session's key;
/// the agent id qualifies no other header). An empty value falls through to the next name; so
/// does a value made only of spaces or tabs. When a header is repeated, its first value
/// counts. Values are taken as raw bytes without the ASCII whitespace around them (HTTP/1
/// parsers strip it anyway, so `" v "` and `"v"` are one session), and a value that is not
/// UTF-8 still names a session.
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
/// // A Codex sub-agent: its thread, not the session it belongs to.
/// let req = http::Request::post("/v1/responses")
///     .header("session-id", "019a-session")
///     .header("thread-id", "019a-thread-2")
///     .body(())
///     .unwrap();
/// assert_eq!(key.extract(&req), Some(SessionKey::from_bytes(b"019a-thread-2")));
///
/// let custom = HeaderKey::new(["x-conversation"]);
/// let req = http::Request::get("/").header("x-conversation", "c1").body(()).unwrap();
/// assert!(custom.extract(&req).is_some());
///
/// // The defaults, then a header of your own.
/// let extended = HeaderKey::new(HeaderKey::DEFAULT_NAMES.iter().copied().chain(["x-conversation"]));
/// assert_eq!(extended.names().len(), HeaderKey::DEFAULT_NAMES.len() + 1);
/// ```
#[derive(Clone, Debug)]
pub struct HeaderKey {
    names: Arc<[HeaderName]>,
}

impl HeaderKey {
    /// `X-Session-Affinity`: the header the study's agents send; opencode sends it too.
    pub const AFFINITY: HeaderName = HeaderName::from_static("x-session-affinity");
    /// `X-Session-Id`: the fallback header; opencode sends it beside `X-Session-Affinity`.
    pub const SESSION_ID: HeaderName = HeaderName::from_static("x-session-id");
    /// `X-Claude-Code-Session-Id`: Claude Code's session, on every request since 2.1.86.
    pub const CLAUDE_CODE_SESSION_ID: HeaderName =
        HeaderName::from_static("x-claude-code-session-id");
    /// `X-Claude-Code-Agent-Id`: a Claude Code sub-agent's own id (2.1.139 on), beside its
    /// session's; the main agent sends none. Not a key by itself: it qualifies
    /// [`CLAUDE_CODE_SESSION_ID`](Self::CLAUDE_CODE_SESSION_ID), so that each sub-agent, with a
    /// prompt of its own, is a session of its own within its session.
    pub const CLAUDE_CODE_AGENT_ID: HeaderName = HeaderName::from_static("x-claude-code-agent-id");
    /// `thread-id`: the Codex CLI's agent thread. A sub-agent is a thread of its own, with its
    /// own prompt, in the session of the agent that spawned it.
    pub const THREAD_ID: HeaderName = HeaderName::from_static("thread-id");
    /// `thread_id`: the Codex CLI's agent thread as its last releases before 0.131 sent it,
    /// beside `session_id`.
    pub const CODEX_LEGACY_THREAD_ID: HeaderName = HeaderName::from_static("thread_id");
    /// `session-id`: the Codex CLI's session, shared by all its threads.
    pub const CODEX_SESSION_ID: HeaderName = HeaderName::from_static("session-id");
    /// `session_id`: the Codex CLI's session header before 0.131. An underscore is a valid
    /// header-name character, though some proxies drop such headers (nginx does unless
    /// `underscores_in_headers on`).
    pub const CODEX_LEGACY_SESSION_ID: HeaderName = HeaderName::from_static("session_id");
    /// `agent-session-id`: Goose's session.
    pub const AGENT_SESSION_ID: HeaderName = HeaderName::from_static("agent-session-id");

    /// The names [`HeaderKey::default`] reads, in order, for extending the default list:
    /// `HeaderKey::new(HeaderKey::DEFAULT_NAMES.iter().copied().chain(["x-mine"]))`.
    pub const DEFAULT_NAMES: &'static [&'static str] = &[
        "x-session-affinity",
        "x-session-id",
        "x-claude-code-session-id",
        "thread-id",
        "thread_id",
        "session-id",
        "session_id",
        "agent-session-id",
    ];

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
            Err(e) => panic!("{e}"),
        }
    }

    /// Reads the given header names, in order, or fails on the first invalid name, which the
    /// error names. An empty list is valid and finds no key: every request is then keyless.
    ///
    /// ```
    /// use tower_affinity::key::HeaderKey;
    ///
    /// let err = HeaderKey::try_new(["x-session-id", "bad name"]).unwrap_err();
    /// assert_eq!(err.name(), "bad name");
    /// assert_eq!(err.to_string(), "invalid header name for HeaderKey: \"bad name\"");
    /// ```
    pub fn try_new<I>(names: I) -> Result<Self, InvalidHeaderKey>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let names = names
            .into_iter()
            .map(|n| {
                let n = n.as_ref();
                HeaderName::from_bytes(n.as_bytes()).map_err(|source| InvalidHeaderKey {
                    name: n.to_owned(),
                    source,
                })
            })
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

/// A name given to [`HeaderKey::try_new`] that is not a valid header name.
#[derive(Debug)]
pub struct InvalidHeaderKey {
    name: String,
    source: http::header::InvalidHeaderName,
}

impl InvalidHeaderKey {
    /// The name, as given.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl fmt::Display for InvalidHeaderKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid header name for HeaderKey: {:?}", self.name)
    }
}

impl std::error::Error for InvalidHeaderKey {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
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
            names: Arc::new([
                Self::AFFINITY,
                Self::SESSION_ID,
                Self::CLAUDE_CODE_SESSION_ID,
                Self::THREAD_ID,
                Self::CODEX_LEGACY_THREAD_ID,
                Self::CODEX_SESSION_ID,
                Self::CODEX_LEGACY_SESSION_ID,
                Self::AGENT_SESSION_ID,
            ]),
        }
    }
}

impl<B> KeyExtractor<http::Request<B>> for HeaderKey {
    fn extract(&self, req: &http::Request<B>) -> Option<SessionKey> {
        let headers = req.headers();
        self.names.iter().find_map(|name| {
            let value = headers.get(name)?.as_bytes();
            let trimmed = value.trim_ascii();
            if trimmed.is_empty() {
                return None;
            }
            if *name == Self::CLAUDE_CODE_SESSION_ID {
                if let Some(agent) = claude_code_agent(headers) {
                    // A line break is in no header value: no plain value digests alike.
                    return Some(SessionKey::from_bytes(&[trimmed, b"\n", agent].concat()));
                }
            }
            Some(SessionKey::from_bytes(trimmed))
        })
    }
}

/// The `X-Claude-Code-Agent-Id` of a Claude Code sub-agent's request, trimmed, if not blank.
fn claude_code_agent(headers: &http::HeaderMap) -> Option<&[u8]> {
    let agent = headers.get(HeaderKey::CLAUDE_CODE_AGENT_ID)?.as_bytes();
    Some(agent.trim_ascii()).filter(|a| !a.is_empty())
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
    #[should_panic(expected = "invalid header name for HeaderKey: \"bad name\"")]
    fn new_names_the_invalid_name_it_panics_on() {
        let _ = HeaderKey::new(["x-ok", "bad name"]);
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
    fn default_reads_the_default_names_in_order() {
        let key = HeaderKey::default();
        let names: Vec<&str> = key.names().iter().map(HeaderName::as_str).collect();
        assert_eq!(names, HeaderKey::DEFAULT_NAMES);
        // The order the docs and the README give: the explicit affinity headers, Claude Code,
        // then Codex's thread before its session (each older spelling after the newer),
        // then Goose.
        assert_eq!(
            names,
            [
                "x-session-affinity",
                "x-session-id",
                "x-claude-code-session-id",
                "thread-id",
                "thread_id",
                "session-id",
                "session_id",
                "agent-session-id",
            ]
        );
        assert_eq!(
            HeaderKey::new(HeaderKey::DEFAULT_NAMES).names(),
            HeaderKey::default().names()
        );
    }

    #[test]
    fn each_default_name_wins_over_every_later_one() {
        let names = HeaderKey::DEFAULT_NAMES;
        for (i, first) in names.iter().enumerate() {
            for later in &names[i + 1..] {
                // The later header comes first on the wire: order of names counts, not of lines.
                let r = req(&[(later, b"later"), (first, b"first")]);
                assert_eq!(
                    HeaderKey::default().extract(&r),
                    Some(SessionKey::from_bytes(b"first")),
                    "{first} before {later}"
                );
            }
            let alone = req(&[(first, b"only")]);
            assert_eq!(
                HeaderKey::default().extract(&alone),
                Some(SessionKey::from_bytes(b"only")),
                "{first} alone"
            );
        }
    }

    #[test]
    fn codex_thread_id_wins_and_a_blank_one_falls_through_to_its_session() {
        let both = req(&[("session-id", b"s"), ("thread-id", b"t")]);
        assert_eq!(
            HeaderKey::default().extract(&both),
            Some(SessionKey::from_bytes(b"t"))
        );
        let legacy = req(&[("session_id", b"s"), ("thread-id", b"t")]);
        assert_eq!(
            HeaderKey::default().extract(&legacy),
            Some(SessionKey::from_bytes(b"t"))
        );
        let legacy_thread = req(&[("session_id", b"s"), ("thread_id", b"t")]);
        assert_eq!(
            HeaderKey::default().extract(&legacy_thread),
            Some(SessionKey::from_bytes(b"t"))
        );
        let blank = req(&[("thread-id", b" "), ("session-id", b"s")]);
        assert_eq!(
            HeaderKey::default().extract(&blank),
            Some(SessionKey::from_bytes(b"s"))
        );
    }

    #[test]
    fn a_claude_code_sub_agent_is_keyed_by_its_agent_id_within_its_session() {
        let session = SessionKey::from_bytes(b"s");
        let key = |headers: &[(&str, &[u8])]| HeaderKey::default().extract(&req(headers));
        let sub = key(&[
            ("x-claude-code-session-id", b"s"),
            ("x-claude-code-agent-id", b"a1"),
        ]);
        assert!(sub.is_some());
        assert_ne!(sub, Some(session));
        assert_ne!(sub, Some(SessionKey::from_bytes(b"a1")));
        // Its id, as the session's, trimmed; another agent, or session, another key.
        let spaced = key(&[
            ("x-claude-code-session-id", b" s"),
            ("x-claude-code-agent-id", b"a1 "),
        ]);
        assert_eq!(spaced, sub);
        let other_agent = key(&[
            ("x-claude-code-session-id", b"s"),
            ("x-claude-code-agent-id", b"a2"),
        ]);
        let other_session = key(&[
            ("x-claude-code-session-id", b"t"),
            ("x-claude-code-agent-id", b"a1"),
        ]);
        assert_ne!(other_agent, sub);
        assert_ne!(other_session, sub);
        // A blank agent id is the main agent: the session's key.
        let main = key(&[
            ("x-claude-code-session-id", b"s"),
            ("x-claude-code-agent-id", b" "),
        ]);
        assert_eq!(main, Some(session));
        // An agent id alone names nothing, and qualifies no other header.
        assert_eq!(key(&[("x-claude-code-agent-id", b"a1")]), None);
        let affinity = key(&[
            ("x-session-affinity", b"s"),
            ("x-claude-code-agent-id", b"a1"),
        ]);
        assert_eq!(affinity, Some(session));
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
        let cases: [&[(&str, &[u8])]; 10] = [
            &[],
            &[("x-session-id", b"")],
            &[("x-session-affinity", b" \t"), ("x-session-id", b"")],
            &[("x-session-affinity", b" \t"), ("x-session-id", b"b")],
            &[("x-session-id", b"first"), ("x-session-id", b" ")],
            &[("x-other", b"a")],
            &[("thread-id", b""), ("session-id", b" ")],
            &[("thread-id", b""), ("session_id", b"s")],
            &[("x-claude-code-session-id", b"c")],
            &[("agent-session-id", b"\t"), ("x-client-request-id", b"r")],
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
    fn invalid_configured_name_is_an_error_that_names_it() {
        let e = HeaderKey::try_new(["x-ok", "bad name", "also bad"]).unwrap_err();
        assert_eq!(e.name(), "bad name");
        assert!(e.to_string().contains("\"bad name\""), "{e}");
        assert!(std::error::Error::source(&e).is_some());
        let panic = std::panic::catch_unwind(|| HeaderKey::new(["x-ok", "bad\nname"]))
            .unwrap_err()
            .downcast::<String>()
            .unwrap();
        assert_eq!(*panic, "invalid header name for HeaderKey: \"bad\\nname\"");
    }
}
