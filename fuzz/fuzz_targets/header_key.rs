//! The header key extractors over arbitrary header bytes.
//!
//! The input is a list of header lines, `\n`-separated. Each line's first byte picks its name
//! (one of `HeaderKey::DEFAULT_NAMES`, or the bytes up to the first `:`), the rest is its
//! value; lines whose name or value `http` refuses are skipped, as a server would refuse them.
//! `HeaderKey`, `FirstOf<HeaderKey, ExtensionKey>` and a `HeaderKey` with a configured name
//! are checked against a plain model of their rules. (A configured name may be Claude Code's
//! agent id header, which qualifies its session's.)

#![no_main]

use http::{HeaderName, HeaderValue, Request};
use libfuzzer_sys::fuzz_target;
use tower_affinity::key::{ExtensionKey, FirstOf, HeaderKey, KeyExtractor, SessionKey};

/// The model: the first named header (in order of names) whose first value is not blank;
/// Claude Code's session with a sub-agent's non-blank agent id, both.
fn model(headers: &http::HeaderMap, names: &[HeaderName]) -> Option<SessionKey> {
    for name in names {
        let Some(v) = headers.get(name) else { continue };
        let t = v.as_bytes().trim_ascii();
        if t.is_empty() {
            continue;
        }
        let agent = headers
            .get("x-claude-code-agent-id")
            .map(|a| a.as_bytes().trim_ascii())
            .filter(|a| !a.is_empty());
        return Some(match agent {
            Some(agent) if name == "x-claude-code-session-id" => {
                let mut both = t.to_vec();
                both.push(b'\n');
                both.extend_from_slice(agent);
                SessionKey::from_bytes(&both)
            }
            _ => SessionKey::from_bytes(t),
        });
    }
    None
}

fuzz_target!(|data: &[u8]| {
    let mut req = Request::new(());
    let mut custom: Option<HeaderName> = None;
    for line in data.split(|&b| b == b'\n') {
        let Some((&pick, rest)) = line.split_first() else {
            continue;
        };
        let defaults = HeaderKey::DEFAULT_NAMES;
        let (name, value) = match usize::from(pick) % (defaults.len() + 1) {
            i if i < defaults.len() => (Some(HeaderName::from_static(defaults[i])), rest),
            _ => match rest.iter().position(|&b| b == b':') {
                Some(i) => (HeaderName::from_bytes(&rest[..i]).ok(), &rest[i + 1..]),
                None => (None, rest),
            },
        };
        let (Some(name), Ok(value)) = (name, HeaderValue::from_bytes(value)) else {
            continue;
        };
        custom.get_or_insert_with(|| name.clone());
        req.headers_mut().append(name, value);
    }

    let default = HeaderKey::default();
    let found = default.extract(&req);
    assert_eq!(found, model(req.headers(), default.names()));

    // A configured name from the input, then the defaults.
    if let Some(name) = custom {
        let names = std::iter::once(name.as_str()).chain(HeaderKey::DEFAULT_NAMES.iter().copied());
        let configured = HeaderKey::try_new(names).expect("names http accepted");
        assert_eq!(
            configured.extract(&req),
            model(req.headers(), configured.names())
        );
    }

    // Behind the headers, a key an earlier layer attached.
    let first_of = FirstOf::new(HeaderKey::default(), ExtensionKey);
    assert_eq!(first_of.extract(&req), found);
    let attached = SessionKey::from_bytes(data);
    req.extensions_mut().insert(attached);
    assert_eq!(first_of.extract(&req), Some(found.unwrap_or(attached)));
    assert_eq!(ExtensionKey.extract(&req), Some(attached));
});
