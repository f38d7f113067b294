//! Hop-by-hop headers (RFC 9110, section 7.6.1): they describe one connection, not the
//! message, so a proxy drops them in both directions. `Trailer`, which declares the trailer
//! fields a message ends with, is end-to-end and passes.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// The hop-by-hop headers that are such by name, besides those that `Connection` names:
/// `Connection` itself, `TE`, `Transfer-Encoding`, `Upgrade`, the obsolete `Keep-Alive` and
/// `Proxy-Connection` (RFC 9110, section 7.6.1), and `Proxy-Authorization`, the client's
/// credentials for the proxy itself.
///
/// [`strip_hop_by_hop`] removes these and every header `Connection` names.
///
/// ```
/// use tower_affinity::client::HOP_BY_HOP;
///
/// assert!(HOP_BY_HOP.contains(&http::header::TRANSFER_ENCODING));
/// assert!(!HOP_BY_HOP.contains(&http::header::HOST));
/// ```
pub static HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
];

/// The index in [`HOP_BY_HOP`] of `name`, if it is there: one match on the name's text.
fn index(name: &HeaderName) -> Option<usize> {
    Some(match name.as_str() {
        "connection" => 0,
        "te" => 1,
        "transfer-encoding" => 2,
        "upgrade" => 3,
        "proxy-authorization" => 4,
        "keep-alive" => 5,
        "proxy-connection" => 6,
        _ => return None,
    })
}

/// Removes the hop-by-hop headers from `headers`: those of [`HOP_BY_HOP`] and every header
/// that a `Connection` header names, and with `Transfer-Encoding` the `Content-Length` it
/// overrode (RFC 9112, section 6.3: the next hop frames the body by what it is).
///
/// One pass over the names; it allocates nothing unless `Connection` has more than one line,
/// and leaves a map without hop-by-hop headers untouched.
///
/// ```
/// use http::HeaderMap;
/// use tower_affinity::client::strip_hop_by_hop;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("connection", "keep-alive, x-trace".parse().unwrap());
/// headers.insert("keep-alive", "timeout=5".parse().unwrap());
/// headers.insert("x-trace", "1".parse().unwrap());
/// headers.insert("content-type", "application/json".parse().unwrap());
/// strip_hop_by_hop(&mut headers);
/// assert_eq!(headers.len(), 1);
/// assert!(headers.contains_key("content-type"));
/// ```
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    strip(headers);
}

/// [`strip_hop_by_hop`]; returns whether the message's `Transfer-Encoding`, if it has one,
/// named `chunked` alone. Another coding (`gzip, chunked`) would pass on still coded and
/// unmarked once the field goes: the caller refuses such a message.
pub(crate) fn strip(headers: &mut HeaderMap) -> bool {
    // Which of `HOP_BY_HOP` are present, one bit each. Most messages have none.
    let mut present = 0u8;
    // Whether every `Connection` line is `keep-alive` alone, as a backend's usually is: it
    // names no header but `Keep-Alive`, which goes anyway.
    let mut plain = true;
    for (name, value) in headers.iter() {
        if let Some(i) = index(name) {
            present |= 1 << i;
            if i == 0 {
                let v = value.as_bytes().trim_ascii();
                plain &= v.eq_ignore_ascii_case(b"keep-alive");
            }
        }
    }
    if present == 0 {
        return true;
    }
    let mut chunked = true;
    if present & 1 << 2 != 0 {
        chunked = chunked_only(headers);
        headers.remove(header::CONTENT_LENGTH);
    }
    if present & 1 != 0 && !plain {
        // `Connection`: its values are handles on the bytes received, not copies, kept so that
        // the headers they name can be removed.
        let mut connection = headers.get_all(header::CONNECTION).iter();
        let first = connection.next().cloned();
        let more: Vec<HeaderValue> = connection.cloned().collect();
        for value in first.iter().chain(&more) {
            let Ok(value) = value.to_str() else { continue };
            for name in value.split(',').map(str::trim) {
                // Looked up by `&str`: an invalid name finds nothing. Those of `HOP_BY_HOP`
                // go below.
                if !name.is_empty()
                    && !HOP_BY_HOP
                        .iter()
                        .any(|h| name.eq_ignore_ascii_case(h.as_str()))
                {
                    headers.remove(name);
                }
            }
        }
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(name);
        }
    }
    chunked
}

/// Whether every `Transfer-Encoding` line of `headers` names `chunked` alone, which the
/// connections decode and code again.
fn chunked_only(headers: &HeaderMap) -> bool {
    headers.get_all(header::TRANSFER_ENCODING).iter().all(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .all(|c| c.eq_ignore_ascii_case("chunked"))
        })
    })
}

/// Whether `headers`' `TE` accepts trailers (`TE: trailers`): the client reads a response's
/// trailer fields, so the proxy, which passes them on, may ask its backend for them.
pub(crate) fn accepts_trailers(headers: &HeaderMap) -> bool {
    headers.get_all(header::TE).iter().any(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',').any(|t| {
                t.split(';')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .eq_ignore_ascii_case("trailers")
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_content_length_goes_with_the_transfer_encoding_that_overrode_it() {
        let framed = |codings: &[&'static str]| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
            for c in codings {
                h.append(header::TRANSFER_ENCODING, HeaderValue::from_static(c));
            }
            h
        };
        let mut h = framed(&[]);
        assert!(strip(&mut h));
        assert_eq!(h[header::CONTENT_LENGTH], "5", "no Transfer-Encoding: kept");
        for (codings, chunked) in [
            (&["chunked"][..], true),
            (&["Chunked , chunked"][..], true),
            (&["gzip, chunked"][..], false),
            (&["gzip", "chunked"][..], false),
        ] {
            let mut h = framed(codings);
            assert_eq!(strip(&mut h), chunked, "{codings:?}");
            assert!(h.is_empty(), "{codings:?}: {h:?}");
        }
    }

    #[test]
    fn index_finds_each_name_in_order() {
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(index(name), Some(i), "{name}");
        }
        assert_eq!(index(&header::HOST), None);
        assert_eq!(index(&HeaderName::from_static("x-session-id")), None);
    }

    #[test]
    fn strip_removes_what_connection_names_and_nothing_else() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert("x-session-id", HeaderValue::from_static("s"));
        let untouched = headers.clone();
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers, untouched);

        headers.append(
            header::CONNECTION,
            HeaderValue::from_static("Keep-Alive, X-Hop"),
        );
        headers.append(
            header::CONNECTION,
            HeaderValue::from_static(" x-other ,, close"),
        );
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert("x-hop", HeaderValue::from_static("1"));
        headers.insert("x-other", HeaderValue::from_static("2"));
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert(header::UPGRADE, HeaderValue::from_static("h2c"));
        headers.insert(header::PROXY_AUTHORIZATION, HeaderValue::from_static("x"));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers, untouched);
    }

    #[test]
    fn connection_keep_alive_goes_with_keep_alive_and_nothing_else() {
        for value in ["keep-alive", " Keep-Alive ", "KEEP-ALIVE"] {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONNECTION, HeaderValue::from_static(value));
            headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("2"));
            strip_hop_by_hop(&mut headers);
            assert_eq!(headers.len(), 1, "{value}");
            assert!(headers.contains_key(header::CONTENT_LENGTH));
        }
        // Another line beside it still names what it names.
        let mut headers = HeaderMap::new();
        headers.append(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        headers.append(header::CONNECTION, HeaderValue::from_static("x-hop"));
        headers.insert("x-hop", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut headers);
        assert!(headers.is_empty());
    }

    #[test]
    fn a_connection_value_that_is_not_text_names_nothing() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_bytes(b"x-a\xff").unwrap(),
        );
        headers.insert("x-a", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut headers);
        assert!(!headers.contains_key(header::CONNECTION));
        assert!(headers.contains_key("x-a"));
    }
}
