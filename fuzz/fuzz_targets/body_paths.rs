//! Differential: (1) an item read member by member against the same item read whole (a
//! trailing scalar item makes the parse read every item whole); (2) a message's content as a
//! string against the same text as one text part, with whitespace, key order, kind and a
//! cache_control mark chosen by the first byte.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_affinity::key::PromptFacts;
use tower_affinity::Link;

fn links(body: &[u8]) -> Vec<Link> {
    PromptFacts::from_body(body).chain.links().to_vec()
}

/// Chain of `{"messages":[item]}` and of `{"messages":[item,0]}` (whole path): the first must
/// be a prefix of the second.
fn check_paths(item: &[u8]) -> Vec<Link> {
    let mut a = b"{\"messages\":[".to_vec();
    a.extend_from_slice(item);
    let mut w = a.clone();
    a.extend_from_slice(b"]}");
    w.extend_from_slice(b",0]}");
    let la = links(&a);
    let lw = links(&w);
    if !la.is_empty() {
        assert!(
            lw.len() >= la.len() && lw[..la.len()] == la[..],
            "member path and whole path disagree for {:?}\nwalk:  {la:?}\nwhole: {lw:?}",
            String::from_utf8_lossy(item)
        );
    }
    la
}

fuzz_target!(|data: &[u8]| {
    let [flags, rest @ ..] = data else {
        return;
    };
    if flags & 1 == 0 {
        // Only one JSON value: bytes that close the array could move items between members.
        if serde_json::from_slice::<serde::de::IgnoredAny>(rest).is_ok() {
            check_paths(rest);
        }
        return;
    }
    // A JSON string token: the bytes as they stand if they make one, else escaped.
    let mut tok = Vec::with_capacity(rest.len() + 2);
    tok.push(b'"');
    tok.extend_from_slice(rest);
    tok.push(b'"');
    if serde_json::from_slice::<String>(&tok).is_err() {
        tok = serde_json::to_vec(&String::from_utf8_lossy(rest)).unwrap();
    }
    let tok = String::from_utf8(tok).unwrap();
    let ws = [" ", "", "\n\t", "\r\n  "][usize::from(flags >> 1 & 3)];
    let kind = ["text", "input_text", "output_text", "text"][usize::from(flags >> 3 & 3)];
    let cc = if flags & 0x20 != 0 {
        format!(",{ws}\"cache_control\"{ws}:{ws}{{\"type\":\"ephemeral\"}}")
    } else {
        String::new()
    };
    let part = if flags & 0x40 != 0 {
        format!("{{{ws}\"text\"{ws}:{ws}{tok}{ws},{ws}\"type\"{ws}:{ws}\"{kind}\"{cc}{ws}}}")
    } else {
        format!(
            "{{{cc_first}{ws}\"type\"{ws}:{ws}\"{kind}\"{ws},{ws}\"text\"{ws}:{ws}{tok}{ws}}}",
            cc_first = if cc.is_empty() {
                String::new()
            } else {
                format!("{}{ws},", &cc[1..])
            }
        )
    };
    let string_form = format!("{{\"role\":\"user\",\"content\":{tok}}}");
    let part_form = format!("{{\"role\":\"user\",{ws}\"content\"{ws}:{ws}[{ws}{part}{ws}]{ws}}}");
    assert!(
        serde_json::from_str::<serde_json::Value>(&part_form).is_ok(),
        "{part_form}"
    );
    let a = check_paths(string_form.as_bytes());
    let b = check_paths(part_form.as_bytes());
    assert!(!a.is_empty());
    assert_eq!(
        a, b,
        "string and one text part differ:\n{string_form}\n{part_form}"
    );
});
