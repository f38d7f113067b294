//! The API a request speaks, told by its path, and where its answer's stream says the
//! backend has read the prompt.
//!
//! A chat, Anthropic or legacy completions stream sends nothing before its first token: its
//! first byte follows the backend's read of the prompt. A Responses stream opens with
//! lifecycle events (`response.created`, `response.in_progress`) that vLLM and SGLang send as
//! soon as the request is taken, before the read (llama-server sends them with the first
//! token, or with its prompt progress while it reads); the first event after them
//! (`response.output_item.added`, a `response.output_text.delta`, or `response.completed`
//! for an empty answer) follows the read. And llama-server, asked for its prompt's progress
//! (`"return_progress": true`, as its web UI asks), sends chunks carrying `prompt_progress`
//! while it reads, in a stream of any API: the first chunk without it follows the read.
//! [`Opening`] finds it as the bytes pass.

use std::sync::LazyLock;

use memchr::memmem::Finder;

/// The API a request speaks, by the end of its path (a prefix such as `/v1`, or the path a
/// router mounts the service at, does not matter).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Api {
    /// OpenAI chat completions, `…/chat/completions`.
    Chat,
    /// Legacy completions, `…/completions`.
    Completions,
    /// Anthropic Messages, `…/messages`.
    Messages,
    /// OpenAI Responses, `…/responses`.
    Responses,
    /// Any other path (SGLang's `/generate`, a path of the user's own).
    #[default]
    Other,
}

impl Api {
    /// The API of a request to `path`.
    pub(crate) fn of(path: &str) -> Api {
        let path = path.strip_suffix('/').unwrap_or(path);
        if path.ends_with("/completions") {
            if path.ends_with("/chat/completions") {
                Api::Chat
            } else {
                Api::Completions
            }
        } else if path.ends_with("/messages") {
            Api::Messages
        } else if path.ends_with("/responses") {
            Api::Responses
        } else {
            Api::Other
        }
    }

    /// Whether a stream of this API may open with the Responses API's lifecycle events,
    /// before its prompt is read: a Responses stream does, and one of a path not known is
    /// watched for the same events (which a stream of another shape does not send: its first
    /// event ends the watch). A stream of any API may open with llama-server's progress
    /// chunks (see [`Opening`]).
    pub(crate) fn may_open_before_read(self) -> bool {
        matches!(self, Api::Responses | Api::Other)
    }
}

/// The ends of the paths that count or convert a prompt's tokens without reading it into a
/// cache: Anthropic's `/v1/messages/count_tokens` and OpenAI's `/v1/responses/input_tokens`
/// (llama-server serves both, and `/v1/chat/completions/input_tokens`, tokenizing without a
/// slot), llama-server's, vLLM's and SGLang's `/tokenize` and `/detokenize`, and
/// llama-server's `/apply-template`.
const ASIDE: [&str; 5] = [
    "/count_tokens",
    "/input_tokens",
    "/tokenize",
    "/detokenize",
    "/apply-template",
];

/// Whether a request to `path` reads no prompt into a backend's cache (see [`ASIDE`]): it is
/// sent where there is room, without its session, its prompt chain, a wait or an answer
/// watched, so that it neither moves its session's home nor tells the cache model of a
/// prompt no cache holds.
pub(crate) fn reads_no_prompt(path: &str) -> bool {
    let path = path.strip_suffix('/').unwrap_or(path);
    ASIDE.iter().any(|a| path.ends_with(a))
}

/// The events a Responses stream opens with, before the prompt is read.
const OPENERS: [&[u8]; 3] = [
    b"response.created",
    b"response.in_progress",
    b"response.queued",
];

/// What each of them starts with as a JSON string, as a data line without an `event` field
/// carries them.
static QUOTE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"response."));

/// The member llama-server puts on the chunks it sends while it reads a prompt, asked to
/// (`return_progress`). As the name of a member, not text in a string, where its quotes are
/// escaped.
const PROGRESS: &[u8] = b"\"prompt_progress\":";

static PROGRESS_FINDER: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(PROGRESS));

/// Whether `data` holds one of the openers' names as a JSON string.
fn names_an_opener(data: &[u8]) -> bool {
    QUOTE.find_iter(data).any(|at| {
        let name = &data[at + 1..];
        OPENERS
            .iter()
            .any(|o| name.starts_with(o) && name.get(o.len()) == Some(&b'"'))
    })
}

/// The bytes kept of each line: enough for `event: response.in_progress`, and for a data
/// line's `{"type":"response.in_progress"` with some space about it.
const HEAD: usize = 64;

/// Finds, in an SSE stream fed to it chunk by chunk, the first event that is not one sent
/// before the prompt is read: a Responses stream's opening lifecycle events (for the APIs
/// that send them, see [`Api::may_open_before_read`]), and llama-server's progress chunks
/// (a data line with a `prompt_progress` member, in a stream of any API).
///
/// An event's type is its `event` field (vLLM, llama-server and OpenAI send one with each);
/// without one, its data names an opening type as a string within its first bytes
/// (`{"type":"response.created",…`), or it is taken to follow the read, as a chat stream's
/// first event does, unless it carries `prompt_progress` anywhere. Only the head of each line
/// is kept, and its last few bytes (for a member name that a chunk's end cuts): the memory is
/// fixed, however long an event (`response.created` echoes the request's instructions and
/// tools) or however it is cut into chunks. Lines end with LF, CRLF or CR, as SSE has it.
#[derive(Debug)]
pub(crate) struct Opening {
    /// Whether the Responses API's lifecycle events are looked for.
    lifecycle: bool,
    /// The first bytes of the current line.
    head: [u8; HEAD],
    /// The bytes of the current line so far, its head and the rest.
    line: usize,
    /// The last bytes of the current line, for a `prompt_progress` name cut between chunks.
    tail: [u8; PROGRESS.len() - 1],
    /// The current line holds a `prompt_progress` member name.
    progress: bool,
    /// The last byte read ended a line with CR: an LF right after it ends no other line.
    after_cr: bool,
    /// The current event has said that it is one of the opening events.
    opener: bool,
}

impl Opening {
    /// A scanner for a stream of an API that sends the Responses lifecycle events before the
    /// read (`lifecycle`), or only llama-server's progress chunks.
    pub(crate) fn new(lifecycle: bool) -> Self {
        Opening {
            lifecycle,
            head: [0; HEAD],
            line: 0,
            tail: [0; PROGRESS.len() - 1],
            progress: false,
            after_cr: false,
            opener: false,
        }
    }

    /// Reads a chunk; `true` if an event that follows the prompt's read begins in it. Once
    /// it has said so, the scanner has nothing more to find, and is fed no more.
    pub(crate) fn feed(&mut self, mut bytes: &[u8]) -> bool {
        if self.after_cr && !bytes.is_empty() {
            self.after_cr = false;
            if bytes[0] == b'\n' {
                bytes = &bytes[1..];
            }
        }
        while let Some(at) = memchr::memchr2(b'\n', b'\r', bytes) {
            self.keep(&bytes[..at]);
            let cr = bytes[at] == b'\r';
            bytes = &bytes[at + 1..];
            if cr {
                match bytes.first() {
                    Some(b'\n') => bytes = &bytes[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
            if self.line_ended() {
                return true;
            }
        }
        self.keep(bytes);
        false
    }

    /// Keeps what fits of `part`, the next bytes of the current line, in its head, and looks
    /// for a `prompt_progress` name in it, also one that the bytes before it began.
    fn keep(&mut self, part: &[u8]) {
        if part.is_empty() {
            return;
        }
        if let Some(room) = self.head.get_mut(self.line..) {
            let n = room.len().min(part.len());
            room[..n].copy_from_slice(&part[..n]);
        }
        if !self.progress {
            let t = self.tail.len();
            let before = self.line.min(t);
            // The name across the line's bytes before `part` and its first ones.
            let mut window = [0u8; 2 * (PROGRESS.len() - 1)];
            let first = part.len().min(t);
            window[..before].copy_from_slice(&self.tail[t - before..]);
            window[before..before + first].copy_from_slice(&part[..first]);
            self.progress = PROGRESS_FINDER
                .find(&window[..before + first])
                .or_else(|| PROGRESS_FINDER.find(part))
                .is_some();
            // The line's last bytes, newest at the end.
            if part.len() >= t {
                self.tail.copy_from_slice(&part[part.len() - t..]);
            } else {
                self.tail.copy_within(part.len().., 0);
                self.tail[t - part.len()..].copy_from_slice(part);
            }
        }
        self.line = self.line.saturating_add(part.len());
    }

    /// The current line has ended: `true` if it shows that its event follows the read.
    fn line_ended(&mut self) -> bool {
        let len = std::mem::take(&mut self.line);
        let progress = std::mem::take(&mut self.progress);
        if len == 0 {
            // A blank line ends the event.
            self.opener = false;
            return false;
        }
        let line = &self.head[..len.min(HEAD)];
        // A line without a colon is a field without a value; one that starts with it is a
        // comment (`: ping`). Neither says what the event is.
        let Some(colon) = memchr::memchr(b':', line) else {
            return false;
        };
        let value = &line[colon + 1..];
        let value = value.strip_prefix(b" ").unwrap_or(value);
        match &line[..colon] {
            b"event" if self.lifecycle => {
                // A name longer than the head is none of the openers.
                self.opener = len <= HEAD && OPENERS.contains(&value);
                !self.opener
            }
            b"data" if !self.opener => {
                self.opener = progress || self.lifecycle && names_an_opener(value);
                !self.opener
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_api_is_told_by_the_end_of_the_path() {
        for (path, api) in [
            ("/v1/chat/completions", Api::Chat),
            ("/openai/deployments/d/chat/completions", Api::Chat),
            ("/v1/completions", Api::Completions),
            ("/v1/messages", Api::Messages),
            ("/v1/messages/", Api::Messages),
            ("/v1/responses", Api::Responses),
            ("/llm/v1/responses", Api::Responses),
            ("/v1/responses/resp_1", Api::Other),
            ("/v1/messages/count_tokens", Api::Other),
            ("/generate", Api::Other),
            ("/", Api::Other),
            ("", Api::Other),
        ] {
            assert_eq!(Api::of(path), api, "{path}");
        }
        assert!(Api::Responses.may_open_before_read() && Api::Other.may_open_before_read());
        for api in [Api::Chat, Api::Completions, Api::Messages] {
            assert!(!api.may_open_before_read(), "{api:?}");
        }
    }

    #[test]
    fn token_counts_and_conversions_read_no_prompt() {
        for path in [
            "/v1/messages/count_tokens",
            "/v1/messages/count_tokens/",
            "/anthropic/v1/messages/count_tokens",
            "/v1/responses/input_tokens",
            "/v1/chat/completions/input_tokens",
            "/tokenize",
            "/detokenize",
            "/apply-template",
        ] {
            assert!(reads_no_prompt(path), "{path}");
        }
        for path in [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/messages",
            "/v1/responses",
            "/v1/responses/resp_1",
            "/generate",
            "/v1/count_tokens_of_mine",
            "/s",
            "/",
            "",
        ] {
            assert!(!reads_no_prompt(path), "{path}");
        }
    }

    /// vLLM's stream of a short answer: the lifecycle events when the request is taken, the
    /// output once the prompt is read.
    const VLLM: &[u8] = b"event: response.created\ndata: {\"response\":{\"id\":\"resp_1\",\"instructions\":\"be brief: \\\"response.output_text.delta\\\"\",\"object\":\"response\",\"output\":[],\"status\":\"in_progress\",\"text\":{\"format\":{\"type\":\"text\"}}},\"sequence_number\":0,\"type\":\"response.created\"}\n\n\
event: response.in_progress\ndata: {\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"output\":[],\"status\":\"in_progress\"},\"sequence_number\":1,\"type\":\"response.in_progress\"}\n\n\
event: response.output_item.added\ndata: {\"item\":{\"id\":\"m1\",\"content\":[],\"role\":\"assistant\",\"status\":\"in_progress\",\"type\":\"message\"},\"output_index\":0,\"sequence_number\":2,\"type\":\"response.output_item.added\"}\n\n\
event: response.output_text.delta\ndata: {\"delta\":\"hi\",\"sequence_number\":3,\"type\":\"response.output_text.delta\"}\n\n";

    /// Where in `body`, fed in pieces of `piece` bytes, the scanner first says the read is
    /// past: the end of the piece it says it in.
    fn found_in_pieces(body: &[u8], piece: usize) -> Option<usize> {
        found_in_pieces_of(body, piece, true)
    }

    /// As [`found_in_pieces`], by a scanner that looks for the lifecycle events or not.
    fn found_in_pieces_of(body: &[u8], piece: usize, lifecycle: bool) -> Option<usize> {
        let mut o = Opening::new(lifecycle);
        let mut at = 0;
        for chunk in body.chunks(piece) {
            at += chunk.len();
            if o.feed(chunk) {
                return Some(at);
            }
        }
        None
    }

    #[test]
    fn the_first_event_after_the_opening_ones_follows_the_read_however_the_stream_is_cut() {
        let output = memchr::memmem::find(VLLM, b"event: response.output_item.added").unwrap();
        // Told at the end of the output event's first line.
        let told = output + "event: response.output_item.added\n".len();
        for piece in 1..=VLLM.len() {
            let at = found_in_pieces(VLLM, piece).expect("found");
            assert!(
                at >= told && at < told + piece,
                "{piece}: at {at}, told at {told}"
            );
        }
        // Nothing before it is taken for it.
        assert_eq!(found_in_pieces(&VLLM[..told - 1], 7), None);
    }

    #[test]
    fn line_ends_of_every_kind_are_read() {
        for end in ["\n", "\r\n", "\r"] {
            let body = format!(
                "event: response.created{end}data: {{}}{end}{end}: ping{end}{end}event: response.in_progress{end}data: {{}}{end}{end}event: response.output_text.delta{end}data: {{}}{end}{end}"
            );
            let b = body.as_bytes();
            let told = body.find("event: response.output_text.delta").unwrap()
                + "event: response.output_text.delta".len()
                + 1;
            for piece in 1..=b.len() {
                let at = found_in_pieces(b, piece).expect("found");
                assert!(
                    at >= told && at < told + piece,
                    "{end:?} {piece}: at {at}, told at {told}"
                );
            }
        }
    }

    #[test]
    fn without_an_event_field_the_data_says_its_type_in_its_first_bytes() {
        let opened = b"data: {\"type\":\"response.created\",\"response\":{\"id\":\"r\"}}\n\n\
data: { \"type\": \"response.in_progress\" }\n\n";
        let mut o = Opening::new(true);
        assert!(!o.feed(opened));
        assert!(o.feed(b"data: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\"}\n\n"));
        // A chat stream's first event follows the read.
        let mut o = Opening::new(true);
        assert!(o.feed(b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n"));
        // An event field wins over the data.
        let mut o = Opening::new(true);
        assert!(!o.feed(b"event: response.created\ndata: {\"type\":\"x\"}\n\n"));
        assert!(
            o.feed(b"event: response.output_item.added\ndata: {\"type\":\"response.created\"}\n\n")
        );
    }

    #[test]
    fn a_long_line_is_kept_to_its_head() {
        let mut o = Opening::new(true);
        assert!(!o.feed(b"event: response.created\ndata: {\"response\":{\"instructions\":\""));
        for _ in 0..1_000 {
            assert!(!o.feed(&[b'x'; 1024]));
        }
        assert!(!o.feed(b"\"}}\n\n"));
        // An event name longer than the head is no opener.
        let long = format!("event: response.created{}\n", "x".repeat(HEAD));
        assert!(Opening::new(true).feed(long.as_bytes()));
        // Nor is one that only begins as an opener does.
        assert!(Opening::new(true).feed(b"event: response.created.later\n"));
    }

    #[test]
    fn comments_and_other_fields_say_nothing() {
        let mut o = Opening::new(true);
        assert!(!o.feed(b": keep-alive\n\nid: 1\nretry: 10\n\nevent\n\n"));
        assert!(o.feed(b"event: error\ndata: {}\n\n"));
    }

    /// A chunk of llama-server's chat stream, with `tail` at the end of its object.
    fn llama_chunk(delta: &str, tail: &str) -> String {
        format!(
            "data: {{\"choices\":[{{\"finish_reason\":null,\"index\":0,\"delta\":{delta}}}],\"created\":1764547200,\"id\":\"chatcmpl-1\",\"model\":\"qwen\",\"system_fingerprint\":\"b7000-abc\",\"object\":\"chat.completion.chunk\"{tail}}}\n\n"
        )
    }

    /// llama-server asked for its prompt's progress (`return_progress`) sends a chunk with a
    /// `prompt_progress` member, at the end of its object, as it reads each batch of the
    /// prompt: the first chunk without it (the first token) follows the read, in a stream of
    /// any API, however the stream is cut.
    #[test]
    fn llama_servers_progress_chunks_come_before_the_read_however_the_stream_is_cut() {
        let role = r#"{"role":"assistant","content":null}"#;
        let progress = |processed: u32| {
            llama_chunk(
                role,
                &format!(
                    r#","prompt_progress":{{"total":30000,"cache":0,"processed":{processed},"time_ms":10240.5}}"#
                ),
            )
        };
        let token = llama_chunk(r#"{"content":"the \"prompt_progress\": field"}"#, "");
        let stream = progress(2048) + &progress(30000) + &token;
        let b = stream.as_bytes();
        // Told at the end of the token's data line.
        let told = stream.len() - 1;
        for lifecycle in [false, true] {
            for piece in 1..=b.len() {
                let at = found_in_pieces_of(b, piece, lifecycle).expect("found");
                assert!(
                    at >= told && at < told + piece,
                    "{lifecycle} {piece}: at {at}, told at {told}"
                );
            }
            // The name written in a token's text is escaped: no progress.
            let one = token.as_bytes();
            assert_eq!(found_in_pieces_of(one, 1, lifecycle), Some(one.len() - 1));
        }
        // CRLF line ends (told at the CR), and a progress chunk with an event field.
        let crlf = stream.replace("\n", "\r\n");
        let told = crlf.len() - "\n\r\n".len();
        assert_eq!(found_in_pieces_of(crlf.as_bytes(), 1, false), Some(told));
        let evented = format!("event: response.in_progress\n{}{token}", progress(2048));
        let told = evented.len() - 1;
        assert_eq!(found_in_pieces_of(evented.as_bytes(), 1, false), Some(told));
    }

    /// A stream of an API other than Responses is not watched for its lifecycle events: a
    /// chat stream's first event follows the read, whatever it says.
    #[test]
    fn only_a_responses_stream_is_watched_for_the_lifecycle_events() {
        let opened = b"event: response.created\ndata: {\"type\":\"response.created\"}\n\n";
        assert!(!Opening::new(true).feed(opened));
        assert!(Opening::new(false).feed(opened));
        // A comment or an event field alone is no first event, in a stream of any API.
        let mut o = Opening::new(false);
        assert!(!o.feed(b": ping\n\nevent: message_start\n"));
        assert!(o.feed(b"data: {\"type\":\"message_start\"}\n\n"));
    }
}
