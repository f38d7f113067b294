//! What the parse computes, held still. Chain digests are kept in shared stores across router
//! versions, so a change to the parse that changes them is a change of format, never a
//! speed-up:
//! - the chains (every link's digest and bytes, and apart from them its estimated tokens),
//!   the key, the message count and the leading digest of a set of representative bodies,
//!   pinned as computed at `840f860`, and changed since by three changes of format only: a
//!   message's `content` of one text part is hashed as its text (the Anthropic and Responses
//!   bodies' chains); a string member is marked as text and ended with a byte no UTF-8 text
//!   holds (the chains of the Responses bodies, whose `instructions` or `input` is a string,
//!   and of the completions `prompt`); and a `prompt` of token ids is fed an id at a time as
//!   one part cut into blocks (its bodies were pinned then). The estimates (the last column)
//!   changed once, when digits came to count a token each; the digests did not;
//! - for random bodies, the parse that reads prompt items member by member against the one
//!   that keeps them whole (the parse of `840f860`).

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use serde_json::json;
use xxhash_rust::xxh3::xxh3_64;

use super::inspect::Config;
use super::*;

/// Code as a tool returns it: newlines, quotes and backslashes, so its JSON has escapes.
const CODE: &str =
    "fn main() {\n    println!(\"hello, {}\\n\", name);\n    let s = \"a \\\"b\\\" \\\\\";\n}\n";

fn bodies() -> Vec<(&'static str, Vec<u8>)> {
    let to = |v: serde_json::Value| serde_json::to_vec(&v).unwrap();
    let mut long_chat = vec![
        json!({"role": "system", "content": "You are a coding agent. ".repeat(350)}),
        json!({"role": "user", "content": "Build the todo app in the spec.\n".repeat(120)}),
    ];
    for n in 0..40 {
        long_chat.push(json!({
            "role": "assistant",
            "content": format!("Step {n}: reading the file."),
            "tool_calls": [{"id": format!("call_{n}"), "type": "function",
                "function": {"name": "read_file", "arguments": "{\"path\":\"src/main.rs\"}"}}]
        }));
        long_chat.push(json!({
            "role": "tool", "tool_call_id": format!("call_{n}"), "content": CODE.repeat(40 + n)
        }));
    }
    let chat = json!({
        "model": "qwen", "user": "u-1", "stream": true,
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Fix the bug in src/main.rs."},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "read_file", "arguments": "{\"path\":\"src/main.rs\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": CODE},
            {"role": "assistant", "content": "Done."}
        ],
        "tools": [{"type": "function", "function": {"name": "read_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
    });
    let anthropic = json!({
        "model": "claude", "max_tokens": 1024, "metadata": {"user_id": "m-7"},
        "system": [{"type": "text", "text": "You are a coding agent.",
                    "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "bash", "input_schema": {"type": "object"},
                   "cache_control": {"type": "ephemeral", "ttl": "5m"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi",
                "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash",
                "input": {"cmd": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                "content": CODE.repeat(30), "cache_control": {"type": "ephemeral"}}]}
        ]
    });
    let responses = json!({
        "model": "gpt", "instructions": "Be brief.", "prompt_cache_key": "pk",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
            {"type": "function_call_output", "call_id": "c", "output": CODE.repeat(3)}
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {}}]
    });
    let responses_text = json!({"model": "gpt", "input": "just a question", "instructions": ""});
    let prompt = json!({"model": "qwen",
        "prompt": "Once upon a time, é ü 漢字 😀 and \"quotes\" \\ back.\n".repeat(200)});
    let pretty = serde_json::to_vec_pretty(&chat).unwrap();
    let escapes = concat!(
        r#"{"messages":[{"role":"user","content":"a\\\"b\\\\\"c\\\\\\\"d\"\\"},"#,
        r#"{"role":"user","content":"\u00e9\u0000\ud83d\ude00\/\b\f\n\r\t"},"#,
        r#"{"role":"user","content":"cache_control","cache_control":{"a":"\"}\\"},"x":"\\"},"#,
        r#"{"cache_control" : [1,{"b":"]"}] , "role":"user","content":"x"},"#,
        r#"{"role":"user","content":"\\\\\\\\"}]}"#,
    );
    let unicode = "{\"messages\":[{\"role\":\"user\",\"content\":\"h\u{e9}llo \u{1F600} \u{6F22}\u{5B57}\"},{\"role\":\"user\",\"content\":\"\u{2028}\u{7f}\"}]}";
    let spaced = " \r\n{ \"messages\" :\t[ { \"role\" : \"user\" ,\n \"content\" : \"a  b\" } ,\r\n\t{\"role\":\"user\",\"n\":[ 1 , 2.50 , -3e2 , true , null ]} ] ,\"user\" : \" spaced \" } \n";
    let numbers = r#"{"messages":[{"role":"user","content":"x","n":1e2},{"z":-0,"a":1.50}]}"#;
    let ids: Vec<u32> = (0..3_000u32)
        .map(|n| n.wrapping_mul(2_654_435_761) % 151_936)
        .collect();
    let deep = format!(r#"{{"messages":[{}{}]}}"#, "[".repeat(126), "]".repeat(126));
    vec![
        ("chat", to(chat)),
        (
            "long chat",
            to(json!({"model": "qwen", "messages": long_chat})),
        ),
        ("anthropic", to(anthropic)),
        ("responses", to(responses)),
        ("responses text", to(responses_text)),
        ("prompt", to(prompt)),
        ("pretty chat", pretty),
        ("escapes", escapes.as_bytes().to_vec()),
        ("unicode", unicode.as_bytes().to_vec()),
        ("whitespace", spaced.as_bytes().to_vec()),
        ("numbers", numbers.as_bytes().to_vec()),
        ("deep", deep.into_bytes()),
        (
            "too deep",
            format!(r#"{{"messages":[{}{}]}}"#, "[".repeat(127), "]".repeat(127)).into_bytes(),
        ),
        (
            "not json",
            b"{\"messages\":[{\"role\":\"user\"}],}".to_vec(),
        ),
        (
            "messages twice",
            br#"{"messages":[{"a":"1"}],"messages":[{"b":"2"},{"c":"3"}]}"#.to_vec(),
        ),
        (
            "lone surrogate",
            br#"{"messages":[{"a":"\ud800"},"\udc00"]}"#.to_vec(),
        ),
        (
            "huge number",
            br#"{"messages":[{"a":1e400},18446744073709551616,-0.0]}"#.to_vec(),
        ),
        (
            "scalar items",
            br#"{"messages":["text",null,true,[1,"a"],{}],"user":"x"}"#.to_vec(),
        ),
        ("prompt ids", to(json!({"model": "qwen", "prompt": ids}))),
        (
            "prompt id lists",
            br#"{"prompt":[[151644, 8948],[ 198 ],"text",[1,"a"],7,8]}"#.to_vec(),
        ),
    ]
}

/// One line per body: key, messages, leading digest, links, the last link's digest, and one
/// xxh3 over every link's digest, bytes and tokens.
fn fingerprint(config: &Config, body: &[u8]) -> String {
    let (key, facts) = config.inspect(body);
    let leading = facts.leading_digest().map_or_else(
        || "-".to_string(),
        |d| d.iter().map(|b| format!("{b:02x}")).collect(),
    );
    let links = facts.chain.links();
    // The links' digests and bytes (the format), apart from their token estimates.
    let mut all = Vec::with_capacity(links.len() * 16);
    let mut tokens = Vec::with_capacity(links.len() * 8);
    for l in links {
        all.extend_from_slice(&l.digest.to_le_bytes());
        all.extend_from_slice(&l.bytes.to_le_bytes());
        tokens.extend_from_slice(&l.tokens.to_le_bytes());
    }
    format!(
        "{} {} {leading} {} {:016x} {:016x} {:016x}",
        key.map_or_else(|| "-".to_string(), |k| k.to_string()),
        facts.messages,
        links.len(),
        links.last().map_or(0, |l| l.digest),
        xxh3_64(&all),
        xxh3_64(&tokens),
    )
}

fn configs() -> [(&'static str, Config); 2] {
    let mut with_messages = Config::new(usize::MAX);
    // `messages` as a key field's first key: the parse keeps it whole, as `Value`s.
    with_messages.set_fields(vec![
        vec!["messages".into(), "0".into()],
        vec!["user".into()],
    ]);
    let mut default = Config::new(usize::MAX);
    default.set_fields(
        BodyKeyLayer::DEFAULT_FIELDS
            .iter()
            .map(|f| f.split('.').map(str::to_owned).collect())
            .collect(),
    );
    [("default", default), ("messages", with_messages)]
}

const PINNED: &[&str] = &[
    "default/chat: a24a7f55f278dd49fb1f99c5507800cb 5 9579c1aa1fe5d09baa0578619f873483d1e165ddc17d21cd08986c395380d6de 6 b25a60a741057716 2815276db02dd4d7 714221fb8fb2786a",
    "default/long chat: - 82 4910828240e3f912f5caac8ea876724bd62313073f44f9bc1424504bd2948125 174 37973b2a45472c0c 59a8c9d83d1f7533 d1e3c014448e5c50",
    "default/anthropic: 76f768bd67e2f88ad056626942cb142b 3 d2bd7405b018f66f3a53845649eef057932321934811ab9993341a0fae3370b0 6 f5a13e1bffd6d351 f2d04379011b9656 78fde535ff980a14",
    "default/responses: eb3102a6cb586765d01fad324523ec0b 0 - 4 fc37a981b843faa9 73419cae1b4ef5e6 6c3e42cf53dae6f0",
    "default/responses text: - 0 - 1 5bdc406b5deaa2b5 baab9d4796b238a2 ca22290ad95e7178",
    "default/prompt: - 0 - 6 aea9df1431144120 79a42661133044c6 6638dd8c47c5cd22",
    "default/pretty chat: a24a7f55f278dd49fb1f99c5507800cb 5 9579c1aa1fe5d09baa0578619f873483d1e165ddc17d21cd08986c395380d6de 6 b25a60a741057716 2815276db02dd4d7 714221fb8fb2786a",
    "default/escapes: - 5 3b30c8318b9c015d872c5c22ce71a80922d7427969b72f26ab41cbd574e079be 5 299df30ce5701e16 a597050aeffdc13e c6699a67da2b5c0a",
    "default/unicode: - 2 35ea14e01efbc87c92e104ffb9d352e3b5d0ae62135c68a763c23a4fdfc4a3b2 2 f4e52b197c806def c800eda164e63db1 3867dbca3722d60a",
    "default/whitespace: 4cf28831d09470e8185fbb6ace85c0ae 2 87dca167f821386b42bba23dd2c9d781429ef9e2783e196f3279e1ac1bbde85d 2 d72ea4225b3d57e8 8df01a2a196983c3 fe7a2d6a5a005d51",
    "default/numbers: - 2 0992fca74d4cc8060ab7669a2ad122a6f059ce70475a5efabd808f3df4968aef 2 b23b9f5b541cf4c9 735223c40a03eab2 67fcacc2cdf098f1",
    "default/deep: - 1 0d0ce008686806cefb2386af80bbb495dc8279da83466a8fc0bb25faa9660142 1 549e01a8bd8e46ab b8a7de4cbce0437a 73db933494b531da",
    "default/too deep: - 0 - 0 0000000000000000 2d06800538d394c2 2d06800538d394c2",
    "default/not json: - 0 - 0 0000000000000000 2d06800538d394c2 2d06800538d394c2",
    "default/messages twice: - 2 f5084a39404ce7f4167fd02b477c2e1993867e60d0f22f3f6a9c29ace05d0095 2 827b80fec4ef9ce0 eb4849ee2a96949b 84fb2a0114c59cd4",
    "default/lone surrogate: - 2 - 2 e6cfd4e1021a2709 706e62e078e75581 68da59f670931ae6",
    "default/huge number: - 3 - 3 6a35ff4679a3da5d 4af16eafeb5b98e2 5185e5e9c356469c",
    "default/scalar items: 2d711642b726b04401627ca9fbac32f5 5 e549e0082769274e3fe3d6cf06317bd2b58086ad4d9af9d9b9b7d2a19fb890ee 5 a4b2e5ec88d8eb5a 671d26a36412f75e 49ea4df0a1ca5f8c",
    "default/prompt ids: - 0 - 10 67cc2ee9f938ac75 bb866df266b43455 25089725688f6d89",
    "default/prompt id lists: - 0 - 5 2b7b8d61a7a0f0f3 4e6946fad26f0878 cb00040ee4e52758",
    "messages/chat: a24a7f55f278dd49fb1f99c5507800cb 5 9579c1aa1fe5d09baa0578619f873483d1e165ddc17d21cd08986c395380d6de 6 b25a60a741057716 2815276db02dd4d7 714221fb8fb2786a",
    "messages/long chat: - 82 4910828240e3f912f5caac8ea876724bd62313073f44f9bc1424504bd2948125 174 37973b2a45472c0c 59a8c9d83d1f7533 d1e3c014448e5c50",
    "messages/anthropic: - 3 d2bd7405b018f66f3a53845649eef057932321934811ab9993341a0fae3370b0 6 f5a13e1bffd6d351 f2d04379011b9656 78fde535ff980a14",
    "messages/responses: - 0 - 4 fc37a981b843faa9 73419cae1b4ef5e6 6c3e42cf53dae6f0",
    "messages/responses text: - 0 - 1 5bdc406b5deaa2b5 baab9d4796b238a2 ca22290ad95e7178",
    "messages/prompt: - 0 - 6 aea9df1431144120 79a42661133044c6 6638dd8c47c5cd22",
    "messages/pretty chat: a24a7f55f278dd49fb1f99c5507800cb 5 9579c1aa1fe5d09baa0578619f873483d1e165ddc17d21cd08986c395380d6de 6 b25a60a741057716 2815276db02dd4d7 714221fb8fb2786a",
    "messages/escapes: - 5 3b30c8318b9c015d872c5c22ce71a80922d7427969b72f26ab41cbd574e079be 5 f53bf5357c5772a4 b8bf58f3e28c79b4 c78d720a1d2e65a7",
    "messages/unicode: - 2 35ea14e01efbc87c92e104ffb9d352e3b5d0ae62135c68a763c23a4fdfc4a3b2 2 f406e6e95e246ac3 888680cc3f5b959e 3867dbca3722d60a",
    "messages/whitespace: 4cf28831d09470e8185fbb6ace85c0ae 2 87dca167f821386b42bba23dd2c9d781429ef9e2783e196f3279e1ac1bbde85d 2 ed1c7077fcf5edb5 7965d5bd52110c05 555c886d9b23c0cb",
    "messages/numbers: - 2 0992fca74d4cc8060ab7669a2ad122a6f059ce70475a5efabd808f3df4968aef 2 97f4722546f5fe09 ee0c8b960f125da4 eccb8cf908a3019d",
    "messages/deep: - 0 - 0 0000000000000000 2d06800538d394c2 2d06800538d394c2",
    "messages/too deep: - 0 - 0 0000000000000000 2d06800538d394c2 2d06800538d394c2",
    "messages/not json: - 0 - 0 0000000000000000 2d06800538d394c2 2d06800538d394c2",
    "messages/messages twice: - 2 f5084a39404ce7f4167fd02b477c2e1993867e60d0f22f3f6a9c29ace05d0095 2 827b80fec4ef9ce0 eb4849ee2a96949b 84fb2a0114c59cd4",
    "messages/lone surrogate: - 0 - 0 0000000000000000 2d06800538d394c2 2d06800538d394c2",
    "messages/huge number: - 0 - 0 0000000000000000 2d06800538d394c2 2d06800538d394c2",
    "messages/scalar items: 2d711642b726b04401627ca9fbac32f5 5 e549e0082769274e3fe3d6cf06317bd2b58086ad4d9af9d9b9b7d2a19fb890ee 5 a4b2e5ec88d8eb5a 671d26a36412f75e 49ea4df0a1ca5f8c",
    "messages/prompt ids: - 0 - 10 67cc2ee9f938ac75 bb866df266b43455 25089725688f6d89",
    "messages/prompt id lists: - 0 - 5 2b7b8d61a7a0f0f3 4e6946fad26f0878 cb00040ee4e52758",
];

#[test]
fn chains_keys_and_leading_digests_are_as_pinned() {
    let mut got = Vec::new();
    for (config_name, config) in configs() {
        for (body_name, body) in bodies() {
            got.push(format!(
                "{config_name}/{body_name}: {}",
                fingerprint(&config, &body)
            ));
        }
    }
    assert_eq!(got, PINNED, "got:\n{}", got.join("\n"));
}

// === reading items member by member, against reading them whole ===

/// A string token long enough to count as an encoded payload.
static BASE64_LEAF: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "\"{}\"",
        "QUJDRGVmZ2hJSktMbW5vcFFSU1R1dnd4WVphYmMxMjM0NTY3ODkrLz0x".repeat(19)
    )
});

/// A JSON text of up to `depth` levels, with whitespace between its tokens, escapes, the
/// member `cache_control`, and the values serde's raw values take and a `Value` does not.
fn json(depth: u32) -> BoxedStrategy<String> {
    let leaf = select(vec![
        r#""a""#,
        r#""x\"y\\""#,
        r#""\\\"""#,
        r#""é 漢""#,
        r#""\u00e9\n""#,
        r#""\ud800""#,
        r#""cache_control""#,
        r#""""#,
        r#"" s p ""#,
        r#""text""#,
        r#""input_text""#,
        r#""x-anthropic-billing-header: cc_version=1; cch=ab12f;""#,
        BASE64_LEAF.as_str(),
        "1",
        "-0",
        "1.50",
        "2e3",
        "1e400",
        "18446744073709551616",
        "true",
        "false",
        "null",
    ])
    .prop_map(str::to_owned);
    leaf.prop_recursive(depth, 48, 5, |inner| {
        let ws = || select(vec!["", "", "", " ", "\n\t", "\r\n  "]);
        prop_oneof![
            vec((ws(), inner.clone(), ws()), 0..5).prop_map(|items| {
                let items: Vec<String> = items
                    .into_iter()
                    .map(|(a, v, b)| format!("{a}{v}{b}"))
                    .collect();
                format!("[{}]", items.join(","))
            }),
            vec(
                (
                    select(vec![
                        r#""role""#,
                        r#""content""#,
                        r#""content""#,
                        r#""type""#,
                        r#""cache_control""#,
                        r#""text""#,
                        r#""\u0061""#,
                        r#""cache_control" "#,
                        r#""x-anthropic-billing-header: cch=ab12f;""#,
                        BASE64_LEAF.as_str(),
                    ]),
                    ws(),
                    inner,
                    ws(),
                ),
                0..5
            )
            .prop_map(|members| {
                let members: Vec<String> = members
                    .into_iter()
                    .map(|(k, a, v, b)| format!("{a}{k}:{a}{v}{b}"))
                    .collect();
                format!("{{{}}}", members.join(","))
            }),
        ]
    })
    .boxed()
}

/// A body of prompt members (and a key field), sometimes cut short or with a byte changed.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let member = (
        select(vec![
            "messages", "messages", "input", "tools", "system", "prompt", "user", "metadata",
        ]),
        json(4),
    );
    (vec(member, 0..5), any::<u16>(), any::<u8>(), 0..6u8).prop_map(
        |(members, at, byte, damage)| {
            let members: Vec<String> = members
                .into_iter()
                .map(|(name, value)| format!(r#""{name}": {value}"#))
                .collect();
            let mut body = format!("{{{}}}", members.join(",")).into_bytes();
            let at = usize::from(at) % body.len();
            match damage {
                0 => body.truncate(at),
                1 => body[at] = byte,
                _ => {}
            }
            body
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn items_read_member_by_member_give_what_whole_items_give(body in body()) {
        for (name, config) in configs() {
            let (key, facts) = config.inspect(&body);
            let (whole_key, whole) = config.inspect_whole(&body);
            let text = String::from_utf8_lossy(&body);
            prop_assert_eq!(key, whole_key, "{}: {}", name, text);
            prop_assert_eq!(facts.messages, whole.messages, "{}: {}", name, text);
            prop_assert_eq!(facts.leading_digest(), whole.leading_digest(), "{}: {}", name, text);
            prop_assert_eq!(facts.chain.links(), whole.chain.links(), "{}: {}", name, text);
        }
    }
}
