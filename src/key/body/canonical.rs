//! The leading messages written out as `serde_json::to_writer(&Vec<Value>)` writes them (keys
//! in order, no whitespace, strings escaped as serde_json escapes them), without building a
//! `Value`: strings are borrowed from the body where they have no escapes, and an object is
//! one vector rather than a tree of nodes and a `String` per key and value.
//!
//! Numbers are left to `Value`: how it prints one (`1e2` as `100.0`) is its own. A message
//! with a number, or with the key serde_json reserves for its raw values, is not written here
//! (`None`), and the caller takes the `Value` path as before.

use std::borrow::Cow;
use std::fmt;
use std::io::{self, Write};

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

/// A JSON value without numbers, as `Value` would hold it.
enum Canon<'de> {
    Null,
    Bool(bool),
    Str(Text<'de>),
    Array(Vec<Canon<'de>>),
    /// The members as they came; sorted, and a repeated key's last value kept, when written,
    /// as `Value`'s map has them.
    Object(Vec<(Text<'de>, Canon<'de>)>),
}

/// A string, borrowed from the body unless it had escapes.
struct Text<'de>(Cow<'de, str>);

/// The key that makes serde_json's `Value` read an object as a raw value.
const RAW_VALUE_KEY: &str = "$serde_json::private::RawValue";

/// Writes `messages` (each one message's JSON) as a JSON array to `out`, as `Value`s would be
/// written; `None`, with nothing written, if one of them is not for this writer (see the
/// module's docs) or is not JSON (or if `out` fails).
pub(super) fn write_messages(messages: &[&str], out: &mut impl Write) -> Option<()> {
    let parsed: Vec<Canon<'_>> = messages
        .iter()
        .map(|m| serde_json::from_str(m).ok())
        .collect::<Option<_>>()?;
    // All parsed before anything is written: what is left can only fail in `out` itself.
    write(&mut Canon::Array(parsed), out).ok()
}

/// Writes `value`, its objects' members sorted where they are.
fn write(value: &mut Canon<'_>, out: &mut impl Write) -> io::Result<()> {
    match value {
        Canon::Null => out.write_all(b"null"),
        Canon::Bool(true) => out.write_all(b"true"),
        Canon::Bool(false) => out.write_all(b"false"),
        Canon::Str(s) => serde_json::to_writer(&mut *out, s.0.as_ref()).map_err(io::Error::from),
        Canon::Array(items) => {
            out.write_all(b"[")?;
            for (i, item) in items.iter_mut().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                write(item, out)?;
            }
            out.write_all(b"]")
        }
        Canon::Object(members) => {
            // Stable: of a repeated key, the last stays last, and is the one written.
            members.sort_by(|a, b| a.0 .0.cmp(&b.0 .0));
            out.write_all(b"{")?;
            let mut first = true;
            for i in 0..members.len() {
                if members
                    .get(i + 1)
                    .is_some_and(|next| next.0 .0 == members[i].0 .0)
                {
                    continue;
                }
                if !first {
                    out.write_all(b",")?;
                }
                first = false;
                let (key, value) = &mut members[i];
                serde_json::to_writer(&mut *out, key.0.as_ref()).map_err(io::Error::from)?;
                out.write_all(b":")?;
                write(value, out)?;
            }
            out.write_all(b"}")
        }
    }
}

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(s.to_owned())))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(s)))
            }
        }
        deserializer.deserialize_str(V)
    }
}

impl<'de> Deserialize<'de> for Canon<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(CanonVisitor)
    }
}

struct CanonVisitor;

impl<'de> Visitor<'de> for CanonVisitor {
    type Value = Canon<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value without numbers")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Canon<'de>, E> {
        Ok(Canon::Null)
    }

    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Canon<'de>, E> {
        Ok(Canon::Bool(b))
    }

    fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Canon<'de>, E> {
        Ok(Canon::Str(Text(Cow::Borrowed(s))))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Canon<'de>, E> {
        Ok(Canon::Str(Text(Cow::Owned(s.to_owned()))))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Canon<'de>, E> {
        Ok(Canon::Str(Text(Cow::Owned(s))))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Canon<'de>, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Canon::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Canon<'de>, A::Error> {
        let mut members = Vec::new();
        while let Some(key) = map.next_key::<Text<'de>>()? {
            if key.0 == RAW_VALUE_KEY {
                return Err(de::Error::custom("a raw value: left to Value"));
            }
            members.push((key, map.next_value()?));
        }
        Ok(Canon::Object(members))
    }

    // Numbers (`visit_u64`, `visit_i64`, `visit_f64`) are not taken: the default refuses them.
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// What the `Value` path writes for `messages`, if they parse.
    fn by_value(messages: &[&str]) -> Option<Vec<u8>> {
        let values: Vec<Value> = messages
            .iter()
            .map(|m| serde_json::from_str(m).ok())
            .collect::<Option<_>>()?;
        serde_json::to_vec(&values).ok()
    }

    fn by_canon(messages: &[&str]) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        write_messages(messages, &mut out).map(|()| out)
    }

    #[test]
    fn messages_are_written_as_values_would_be() {
        for messages in [
            &[r#"{"role":"system","content":"You are a coding agent."}"#][..],
            &[
                r#" { "role" : "system", "content" : "s" } "#,
                r#"{"role":"user","content":[{"type":"text","text":"t\u00e9\n\"q\"\/"}]}"#,
            ],
            &[r#"{"b":1e0,"a":2}"#],
            &[r#"{"z":null,"a":[true,false,{}],"m":{"y":"1","x":[]}}"#],
            &[r#"{"k":"first","k":"last","a":"\u0001\u001f\u007f"}"#],
            &[r#"{"\u00e9":"é","e":"\ud83d\ude00"}"#],
            &[r#"{"$serde_json::private::RawValue":"[1]"}"#],
            &[r#"{"a":"\ud800"}"#],
            &[r#"{"a":}"#],
            &[r#""just a string""#, "null", "[]"],
        ] {
            let canon = by_canon(messages);
            if canon.is_some() {
                assert_eq!(canon, by_value(messages), "{messages:?}");
            }
        }
        // What this writer takes: the messages the APIs send, without numbers.
        assert!(by_canon(&[r#"{"role":"user","content":"hi"}"#]).is_some());
        assert!(by_canon(&[r#"{"k":"first","k":"last"}"#]).is_some());
        assert!(by_canon(&[r#"{"a":1}"#]).is_none());
    }

    proptest::proptest! {
        #[test]
        fn whatever_this_writes_a_value_writes_alike(
            tokens in proptest::collection::vec(proptest::sample::select(vec![
                "{", "}", "[", "]", ":", ",", " ", "\"a\"", "\"b\"", "\"role\"", "\"\\u00e9\"",
                "\"\\n\\\"\"", "\"x\\u0000y\"", "\"é\"", "null", "true", "false", "1", "\"\"",
            ]), 1..20),
        ) {
            let text: String = tokens.concat();
            let messages = [text.as_str()];
            if let Some(canon) = by_canon(&messages) {
                proptest::prop_assert_eq!(Some(canon), by_value(&messages), "{}", text);
            }
        }
    }
}
