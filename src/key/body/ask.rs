//! Asking a stream for its usage on the client's behalf, and taking the answer's usage chunk
//! out again: see [`BodyKeyLayer::ask_stream_usage`](super::BodyKeyLayer::ask_stream_usage).

use std::collections::HashMap;
use std::sync::LazyLock;

use bytes::{Bytes, BytesMut};
use memchr::memmem::Finder;
use serde_json::value::RawValue;

/// What is put in front of the body's other members.
const ASK: &[u8] = br#""stream_options":{"include_usage":true},"#;

/// Whether an answer with `headers` is an SSE stream, not compressed.
pub(super) fn is_plain_event_stream(headers: &http::HeaderMap) -> bool {
    let stream = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.as_bytes().split(|&b| b == b';').next())
        .is_some_and(|essence| {
            essence
                .trim_ascii()
                .eq_ignore_ascii_case(b"text/event-stream")
        });
    let encoded = headers
        .get(http::header::CONTENT_ENCODING)
        .is_some_and(|e| !e.as_bytes().eq_ignore_ascii_case(b"identity"));
    stream && !encoded
}

/// Whether a request to `path` is one whose stream carries usage only when asked: OpenAI chat
/// and legacy completions (Anthropic's and the Responses API's streams always carry it).
pub(super) fn asks_for(path: &str) -> bool {
    path.ends_with("/completions")
}

/// `body` (a JSON object with at least one member) asking for its stream's usage.
pub(super) fn ask(body: &[u8]) -> Option<Bytes> {
    let open = body.iter().position(|&b| b == b'{')?;
    let mut out = BytesMut::with_capacity(body.len() + ASK.len());
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(ASK);
    out.extend_from_slice(&body[open + 1..]);
    Some(out.freeze())
}

/// The most bytes [`UsageStrip`] holds back; past it, it takes nothing out.
const HOLD_LIMIT: usize = 1 << 20;

/// Takes the usage chunk the client did not ask for out of an SSE stream, as its bytes pass.
///
/// Events are passed on as soon as they are whole, but for a chunk that finishes a choice (a
/// `finish_reason` that is not null): it is held until the next event, because the usage
/// chunk that follows may carry members the backend would have put on it had usage not been
/// asked for (llama.cpp moves its `timings` onto the last chunk it sends). When the usage chunk
/// comes (`"choices": []` and a `usage` object), it is dropped, and its members other than
/// `choices` and `usage` that the held chunk lacks are put at the end of that chunk. After the
/// one usage chunk, the rest of the stream passes as it comes. It holds back at most
/// [`HOLD_LIMIT`] bytes: from a stream that would make it hold more (an event that does not
/// end with a blank line of LF or CRLF), it takes nothing out, and all passes as it comes.
#[derive(Debug, Default)]
pub(super) struct UsageStrip {
    /// Whole events held back: the chunks that finish a choice.
    held: Vec<u8>,
    /// Where the last held event starts in `held`.
    last_held: usize,
    /// The bytes of the event not yet whole.
    partial: Vec<u8>,
    /// The usage chunk has been taken out: everything else passes.
    stripped: bool,
    /// Trailers that came while bytes were held: they follow those bytes.
    pub(super) trailers: Option<http::HeaderMap>,
}

impl UsageStrip {
    /// Takes in a chunk of the stream; returns the bytes to pass on now (maybe none).
    pub(super) fn feed(&mut self, chunk: Bytes) -> Bytes {
        if self.is_empty() && (self.stripped || passes_whole(&chunk)) {
            // Whole events, none to hold or take out (or nothing left to take out): the chunk
            // goes on as it came.
            return chunk;
        }
        let mut out = Vec::new();
        // Only the new bytes can end the partial event (and the byte before them, for a
        // blank line split across chunks).
        let mut from = self.partial.len().saturating_sub(1);
        self.partial.extend_from_slice(&chunk);
        let mut start = 0;
        while let Some(end) = event_end(&self.partial, from.max(start)) {
            let event = &self.partial[start..end];
            self.event_at(event.to_vec(), &mut out);
            start = end;
            from = end;
        }
        self.partial.drain(..start);
        // More held back than any usage chunk's wait needs (an event that does not end, as
        // in a stream whose lines end with a lone CR, or a run of finishing chunks): nothing
        // is taken out, and all passes as it comes, in fixed memory.
        if self.held.len() + self.partial.len() > HOLD_LIMIT {
            self.stripped = true;
        }
        if self.stripped {
            out.append(&mut self.held);
            out.append(&mut self.partial);
        }
        Bytes::from(out)
    }

    /// The stream has ended (or failed): everything held, as it came.
    pub(super) fn finish(&mut self) -> Bytes {
        let mut out = std::mem::take(&mut self.held);
        out.append(&mut self.partial);
        self.last_held = 0;
        Bytes::from(out)
    }

    /// Whether bytes are held back.
    pub(super) fn is_empty(&self) -> bool {
        self.held.is_empty() && self.partial.is_empty()
    }

    fn event_at(&mut self, event: Vec<u8>, out: &mut Vec<u8>) {
        if self.stripped {
            out.extend_from_slice(&event);
            return;
        }
        match classify(&event) {
            Kind::Usage(extra) => {
                if !self.held.is_empty() {
                    let last = self.held.split_off(self.last_held);
                    self.held.extend_from_slice(&with_members(last, &extra));
                }
                out.append(&mut self.held);
                self.stripped = true;
            }
            Kind::Finish => {
                self.last_held = self.held.len();
                self.held.extend_from_slice(&event);
            }
            Kind::Other => {
                out.append(&mut self.held);
                out.extend_from_slice(&event);
            }
        }
    }
}

/// Whether `chunk` is whole events that neither finish a choice nor carry usage: most of a
/// stream's chunks, one token each.
fn passes_whole(chunk: &[u8]) -> bool {
    let mut start = 0;
    while start < chunk.len() {
        let Some(end) = event_end(chunk, start) else {
            return false;
        };
        if !plainly_other(&chunk[start..end]) {
            return false;
        }
        start = end;
    }
    true
}

/// Whether an event is neither a usage chunk nor one finishing a choice, by a look at its
/// bytes: no `"usage"` in it, and no `"finish_reason"` but null ones.
fn plainly_other(event: &[u8]) -> bool {
    USAGE.find(event).is_none() && !finishes(event)
}

static USAGE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"usage\""));
static FINISH_REASON: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(FINISH_REASON_NAME));
const FINISH_REASON_NAME: &[u8] = b"\"finish_reason\"";

/// Where the first event in `buf` ends (just past its blank line), looking for line ends from
/// `from` on. Lines end with LF or CRLF.
fn event_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while let Some(at) = memchr::memchr(b'\n', buf.get(i..)?) {
        let nl = i + at;
        // The line this LF ends is blank, or a lone CR: the byte before it is the LF before
        // (or the CR after one), or there is none (`buf` starts where a line starts).
        let blank = match nl.checked_sub(1).map(|p| buf[p]) {
            None | Some(b'\n') => true,
            Some(b'\r') => nl == 1 || buf[nl - 2] == b'\n',
            _ => false,
        };
        if blank {
            return Some(nl + 1);
        }
        i = nl + 1;
    }
    None
}

enum Kind {
    /// The usage chunk, with the members it would move: each name and its value as written.
    Usage(Vec<(String, Box<RawValue>)>),
    /// A chunk that finishes a choice.
    Finish,
    Other,
}

/// The event's data: its one `data:` line, without the field name and the space after it.
fn data_line(event: &[u8]) -> Option<&[u8]> {
    let mut data = None;
    for line in event.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            if data.is_some() {
                return None;
            }
            data = Some(rest.strip_prefix(b" ").unwrap_or(rest));
        }
    }
    data
}

/// The top-level members of a chunk, each as it was written.
type Members = HashMap<String, Box<RawValue>>;

fn classify(event: &[u8]) -> Kind {
    let Some(data) = data_line(event) else {
        return Kind::Other;
    };
    // Cheap looks first: most chunks carry a token and `"finish_reason":null`.
    if plainly_other(data) {
        return Kind::Other;
    }
    let Ok(members) = serde_json::from_slice::<Members>(data) else {
        return Kind::Other;
    };
    let choices = members.get("choices").map(|c| c.get().trim_ascii());
    let is_usage = choices
        .is_some_and(|c| c.starts_with('[') && c[1..].trim_ascii_start().starts_with(']'))
        && members
            .get("usage")
            .is_some_and(|u| u.get().trim_ascii_start().starts_with('{'));
    if is_usage {
        let mut extra: Vec<(String, Box<RawValue>)> = members
            .into_iter()
            .filter(|(name, _)| name != "choices" && name != "usage")
            .collect();
        extra.sort_by(|a, b| a.0.cmp(&b.0));
        return Kind::Usage(extra);
    }
    if finishes(data) {
        Kind::Finish
    } else {
        Kind::Other
    }
}

/// Whether a chunk names a `finish_reason` that is not null.
fn finishes(data: &[u8]) -> bool {
    const NAME: &[u8] = FINISH_REASON_NAME;
    let mut rest = data;
    while let Some(at) = FINISH_REASON.find(rest) {
        let after = rest[at + NAME.len()..].trim_ascii_start();
        if let Some(value) = after.strip_prefix(b":") {
            let value = value.trim_ascii_start();
            if !value.is_empty() && !value.starts_with(b"null") {
                return true;
            }
        }
        rest = &rest[at + NAME.len()..];
    }
    false
}

/// `event` (one `data:` line holding a JSON object) with the members of `extra` it lacks put
/// at the end of its object; unchanged if it is not so.
fn with_members(event: Vec<u8>, extra: &[(String, Box<RawValue>)]) -> Vec<u8> {
    let Some(data) = data_line(&event) else {
        return event;
    };
    let Ok(members) = serde_json::from_slice::<Members>(data) else {
        return event;
    };
    let missing: Vec<&(String, Box<RawValue>)> = extra
        .iter()
        .filter(|(name, _)| !members.contains_key(name))
        .collect();
    let Some(close) = event.iter().rposition(|&b| b == b'}') else {
        return event;
    };
    if missing.is_empty() {
        return event;
    }
    let mut out = Vec::with_capacity(event.len() + 256);
    out.extend_from_slice(&event[..close]);
    for (name, value) in missing {
        out.push(b',');
        // A member name read from JSON writes back as JSON.
        out.extend_from_slice(serde_json::to_string(name).unwrap_or_default().as_bytes());
        out.push(b':');
        out.extend_from_slice(value.get().as_bytes());
    }
    out.extend_from_slice(&event[close..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"content\":\"Hi\"}}],\"created\":1,\"id\":\"c\",\"model\":\"m\",\"system_fingerprint\":\"b1\",\"object\":\"chat.completion.chunk\"}\n\n";
    const TIMINGS: &str = "{\"cache_n\":2000,\"prompt_n\":160,\"prompt_ms\":812.5}";

    fn finish(timings: bool) -> String {
        let t = if timings {
            format!(",\"timings\":{TIMINGS}")
        } else {
            String::new()
        };
        format!("data: {{\"choices\":[{{\"finish_reason\":\"stop\",\"index\":0,\"delta\":{{}}}}],\"created\":1,\"id\":\"c\",\"model\":\"m\",\"system_fingerprint\":\"b1\",\"object\":\"chat.completion.chunk\"{t}}}\n\n")
    }

    fn usage_chunk() -> String {
        format!("data: {{\"choices\":[],\"created\":1,\"id\":\"c\",\"model\":\"m\",\"system_fingerprint\":\"b1\",\"object\":\"chat.completion.chunk\",\"usage\":{{\"completion_tokens\":1,\"prompt_tokens\":2160,\"total_tokens\":2161}},\"timings\":{TIMINGS}}}\n\n")
    }

    /// llama-server's stream, with and without usage asked for.
    fn llama_stream(asked: bool) -> String {
        if asked {
            format!("{TOKEN}{}{}data: [DONE]\n\n", finish(false), usage_chunk())
        } else {
            format!("{TOKEN}{}data: [DONE]\n\n", finish(true))
        }
    }

    fn strip_in_pieces(stream: &[u8], piece: usize) -> Vec<u8> {
        let mut s = UsageStrip::default();
        let mut out = Vec::new();
        for chunk in stream.chunks(piece) {
            out.extend_from_slice(&s.feed(Bytes::copy_from_slice(chunk)));
        }
        out.extend_from_slice(&s.finish());
        out
    }

    #[test]
    fn the_usage_chunk_is_taken_out_and_its_timings_go_back_on_the_last_chunk() {
        let asked = llama_stream(true);
        let unasked = llama_stream(false);
        for piece in 1..=asked.len() {
            let out = strip_in_pieces(asked.as_bytes(), piece);
            assert_eq!(String::from_utf8_lossy(&out), unasked, "pieces of {piece}");
        }
    }

    #[test]
    fn a_stream_whose_events_never_end_passes_once_a_mebibyte_is_held() {
        // Lines that end with a lone CR: no event ends, as far as the strip can tell.
        let event = format!("data: {}\r\r", r#"{"choices":[{"delta":{"content":"x"}}]}"#);
        let mut strip = UsageStrip::default();
        let (mut fed, mut out) = (0, 0);
        for _ in 0..(2 * HOLD_LIMIT / event.len()) {
            fed += event.len();
            out += strip.feed(Bytes::from(event.clone())).len();
            assert!(strip.held.len() + strip.partial.len() <= HOLD_LIMIT + event.len());
        }
        out += strip.finish().len();
        assert_eq!(out, fed, "every byte passes, once");
        assert!(strip.stripped && strip.is_empty());
    }

    #[test]
    fn crlf_line_ends_are_events_too() {
        let asked = llama_stream(true).replace("\n\n", "\r\n\r\n");
        let unasked = llama_stream(false).replace("\n\n", "\r\n\r\n");
        for piece in [1, 2, 7, 64, asked.len()] {
            assert_eq!(
                String::from_utf8_lossy(&strip_in_pieces(asked.as_bytes(), piece)),
                unasked
            );
        }
    }

    #[test]
    fn a_usage_chunk_that_moves_nothing_is_only_dropped() {
        // vLLM's and SGLang's shape: the usage chunk carries nothing the last chunk lacks.
        let last = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n";
        let usage = "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1}}\n\n";
        let asked = format!("{TOKEN}{last}{usage}data: [DONE]\n\n");
        let want = format!("{TOKEN}{last}data: [DONE]\n\n");
        assert_eq!(strip_in_pieces(asked.as_bytes(), 5), want.as_bytes());
    }

    #[test]
    fn a_stream_without_a_usage_chunk_passes_whole() {
        let stream = llama_stream(false);
        for piece in [1, 3, 100, stream.len()] {
            assert_eq!(strip_in_pieces(stream.as_bytes(), piece), stream.as_bytes());
        }
        // Not SSE at all, and cut short: every byte comes out.
        let junk = b"data: {\"choices\":[{\"finish_reason\":\"stop\"}]}\n\ndata: {\"choi";
        assert_eq!(strip_in_pieces(junk, 4), junk);
    }

    #[test]
    fn a_blank_line_that_starts_a_frame_stays_a_line_of_its_own() {
        // Found by the fuzzer: an empty line at the start of a frame was read as part of the
        // event after it, and taken out with it.
        let stream = format!("{TOKEN}\n{}data: [DONE]\n\n", usage_chunk());
        let want = format!("{TOKEN}\ndata: [DONE]\n\n");
        for piece in 1..=stream.len() {
            assert_eq!(
                String::from_utf8_lossy(&strip_in_pieces(stream.as_bytes(), piece)),
                want,
                "pieces of {piece}"
            );
        }
        let mut s = UsageStrip::default();
        assert_eq!(
            s.feed(Bytes::from_static(TOKEN.as_bytes())),
            TOKEN.as_bytes()
        );
        let mut out = s.feed(Bytes::from_static(b"\n")).to_vec();
        out.extend_from_slice(&s.feed(Bytes::from(usage_chunk())));
        out.extend_from_slice(&s.finish());
        assert_eq!(out, b"\n");
    }

    #[test]
    fn a_finishing_chunk_that_carries_usage_is_not_taken_out() {
        // Some backends put the usage on the chunk that finishes the choice, not on one of
        // its own: that chunk is the client's, and stays.
        let last = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1}}\n\n";
        let stream = format!("{TOKEN}{last}data: [DONE]\n\n");
        for piece in [1, 7, stream.len()] {
            assert_eq!(
                String::from_utf8_lossy(&strip_in_pieces(stream.as_bytes(), piece)),
                stream,
                "pieces of {piece}"
            );
        }
    }

    #[test]
    fn only_one_usage_chunk_is_taken_out() {
        let twice = format!("{}{}", usage_chunk(), usage_chunk());
        assert_eq!(
            strip_in_pieces(twice.as_bytes(), 9),
            usage_chunk().as_bytes()
        );
    }

    #[test]
    fn a_token_chunk_is_passed_on_as_soon_as_it_is_whole() {
        let mut s = UsageStrip::default();
        let token = Bytes::from_static(TOKEN.as_bytes());
        let passed = s.feed(token.clone());
        assert_eq!(passed, token);
        assert_eq!(passed.as_ptr(), token.as_ptr(), "not copied");
        // A finishing chunk waits for what follows it.
        assert!(s.feed(Bytes::from(finish(false))).is_empty());
        assert_eq!(
            s.feed(Bytes::from_static(b"data: [DONE]\n\n")),
            format!("{}data: [DONE]\n\n", finish(false)).as_bytes()
        );
        assert!(s.is_empty());
    }

    mod properties {
        use proptest::collection::vec;
        use proptest::prelude::*;
        use proptest::sample::select;

        use super::*;

        /// The events a stream is made of, some of them odd: comments, other fields, events
        /// in two data lines, a blank line of its own, a chunk that is not JSON.
        const EVENTS: &[&str] = &[
            TOKEN,
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9},\"timings\":{\"cache_n\":1}}\n\n",
            "data: {\"choices\": [ ], \"usage\": {\"prompt_tokens\": 9}}\n\n",
            "data: {\"choices\":[],\"usage\":null}\n\n",
            "data: [DONE]\n\n",
            ": keep-alive\n\n",
            "event: message\ndata: {\"choices\":[{\"finish_reason\":\"length\"}]}\n\n",
            "data: {\"choices\":\ndata: []}\n\n",
            "\n",
            "data: {\"usage\":\"finish_reason\"\n\n",
        ];

        fn stream(events: &[&str], crlf: bool) -> Vec<u8> {
            let s: String = events.concat();
            if crlf { s.replace('\n', "\r\n") } else { s }.into_bytes()
        }

        fn through(bytes: &[u8], cuts: &[usize]) -> Vec<u8> {
            let mut s = UsageStrip::default();
            let mut out = Vec::new();
            let mut at = 0;
            let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            for cut in cuts.into_iter().chain([bytes.len()]) {
                out.extend_from_slice(&s.feed(Bytes::copy_from_slice(&bytes[at..cut])));
                at = cut;
            }
            out.extend_from_slice(&s.finish());
            out
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// However a stream is cut into frames, the same bytes come out; a stream with no
            /// usage chunk comes out as it went in; one usage chunk at most is taken out, and
            /// nothing else is lost.
            #[test]
            fn the_bytes_out_do_not_depend_on_the_frames(
                events in vec(select(EVENTS), 0..12),
                cuts in vec(any::<usize>(), 0..8),
                crlf in any::<bool>(),
            ) {
                let bytes = stream(&events, crlf);
                let whole = through(&bytes, &[]);
                prop_assert_eq!(&through(&bytes, &cuts), &whole);
                let usage = events.iter().position(|e| *e == EVENTS[2] || *e == EVENTS[3]);
                match usage {
                    None => prop_assert_eq!(&whole, &bytes),
                    Some(_) => prop_assert!(whole.len() < bytes.len() + 64),
                }
                // Everything but the taken chunk is still there, in order.
                let events_out = String::from_utf8_lossy(&whole).matches("data:").count()
                    + String::from_utf8_lossy(&whole).matches(": keep-alive").count();
                let events_in = String::from_utf8_lossy(&bytes).matches("data:").count()
                    + String::from_utf8_lossy(&bytes).matches(": keep-alive").count();
                prop_assert_eq!(events_out + usize::from(usage.is_some()), events_in);
            }
        }
    }

    #[test]
    fn asking_puts_stream_options_first() {
        let body = b" {\"stream\":true,\"messages\":[]}";
        let asked = ask(body).unwrap();
        assert_eq!(
            &asked[..],
            &b" {\"stream_options\":{\"include_usage\":true},\"stream\":true,\"messages\":[]}"[..]
        );
        let v: serde_json::Value = serde_json::from_slice(&asked).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert!(asks_for("/v1/chat/completions") && asks_for("/v1/completions"));
        assert!(!asks_for("/v1/messages") && !asks_for("/v1/responses"));
    }
}
