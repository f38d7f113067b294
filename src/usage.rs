//! What a backend's answer says it did with the prompt: [`Usage`], and the scanner that reads
//! it from a JSON answer or an SSE stream as the bytes pass.
//!
//! The figures, by API:
//!
//! | answer | prompt tokens | of which reused |
//! |---|---|---|
//! | OpenAI chat / completions | `usage.prompt_tokens` | `usage.prompt_tokens_details.cached_tokens` |
//! | llama.cpp (any of its APIs) | `timings.prompt_n + timings.cache_n` | `timings.cache_n` |
//! | Anthropic Messages | `usage.input_tokens` + the two below | `usage.cache_read_input_tokens` (`cache_creation_input_tokens` was read) |
//! | OpenAI Responses | `usage.input_tokens` | `usage.input_tokens_details.cached_tokens` |
//! | SGLang's native `/generate` | not read (`meta_info.prompt_tokens`) | not read (`meta_info.cached_tokens`); its OpenAI endpoints are read as above |
//!
//! Which API an answer is in is the request's to say (its path): the figures alone do not
//! tell a Responses answer from one of vLLM's Anthropic endpoint, which both give
//! `input_tokens` without Anthropic's cache figures. Only what the figures mean depends on
//! it, not how they are read.
//!
//! llama.cpp's `timings` win where present: they are exact, and they ride on the last chunk
//! of a stream whether or not the client asked for usage. llama-server's usage, where it
//! gives one, says the same; timings that say otherwise beside a usage are not the
//! backend's, and the usage wins. A stream carries usage only when the client asked
//! (`stream_options.include_usage`), or
//! [`BodyKeyLayer::ask_stream_usage`](crate::key::BodyKeyLayer::ask_stream_usage) asked on
//! its behalf; vLLM reports `cached_tokens` only with `--enable-prompt-tokens-details`, and
//! leaves it out when it is 0, so an answer without it
//! says nothing about reuse (see [`Usage::reused_tokens`]) until its backend has once said
//! it, in that shape. SGLang reports it only with `--enable-cache-report` (0 included).
//! vLLM's Anthropic endpoint (`/v1/messages`) reports `input_tokens`
//! alone: its answers never say their reuse.
//!
//! The scanner looks for the members `"usage"` and `"timings"` wherever they are (top level of
//! a chat answer, inside `response` in a Responses stream, inside `message` in an Anthropic
//! one) and parses only the object that follows each: a 4 KiB answer is searched, not
//! parsed. A member name inside a string is escaped (`\"usage\"`) and is not taken for one.
//! A tool's input in an Anthropic answer is an object, not a string, so a model can write
//! members there: `timings` it writes disagree with the answer's usage, which wins over
//! them; a `usage` it writes comes before the answer's own (every API puts its usage after
//! its content), which replaces it whole: in an answer that is one JSON object, a usage
//! object with a prompt figure replaces every prompt figure before it, of any shape. In a
//! stream, which carries a tool's input as a string, later figures overwrite earlier ones
//! field by field, so the last chunk wins while a figure given only in its first event
//! (Anthropic's `message_start`) stays. An
//! object that is not what the APIs send (a count that is not a non-negative integer, say)
//! is passed over whole; a count past 2^32 tokens, which no prompt reaches, is left out.

use std::time::Duration;

use serde::Deserialize;

/// What one answer says about its prompt: how many tokens it had, and how many of them the
/// backend reused from its cache rather than read again.
///
/// Read from the answer's body as it passes through the service (see
/// [`ResponseBody::usage`](crate::ResponseBody::usage)).
///
/// ```
/// use tower_affinity::Usage;
///
/// let answer = br#"{"choices":[],"usage":{"prompt_tokens":30160,"completion_tokens":180,
///     "prompt_tokens_details":{"cached_tokens":30000}}}"#;
/// let usage = Usage::from_body(answer).unwrap();
/// assert_eq!(usage.prompt_tokens, 30_160);
/// assert_eq!(usage.reused_tokens, Some(30_000));
/// assert_eq!(usage.read_tokens(), Some(160));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct Usage {
    /// Tokens of prompt the answer was for, reused and read alike.
    pub prompt_tokens: u64,
    /// Of those, the tokens the backend took from its cache. `None` when the answer does not
    /// say (a backend that does not report it, vLLM without
    /// `--enable-prompt-tokens-details`, SGLang without `--enable-cache-report`).
    pub reused_tokens: Option<u64>,
    /// How long the backend took to read the rest (llama.cpp's `timings.prompt_ms`), if it says.
    pub prompt_time: Option<Duration>,
    /// The answer is in the OpenAI chat and completions shape (`usage.prompt_tokens`), where a
    /// backend may leave the reused figure out when it is 0: vLLM does. In the other shapes
    /// a missing figure means the backend does not report one (vLLM's Anthropic endpoint).
    pub(crate) zero_left_out: bool,
}

impl Usage {
    /// The figures of a whole answer body, JSON or SSE; `None` if it has none.
    pub fn from_body(body: &[u8]) -> Option<Usage> {
        let mut s = UsageScanner::default();
        s.feed(body);
        s.finish()
    }

    /// Tokens the backend read (`prompt_tokens - reused_tokens`), when reuse is known.
    pub fn read_tokens(&self) -> Option<u64> {
        self.reused_tokens
            .map(|r| self.prompt_tokens.saturating_sub(r))
    }
}

/// The most bytes of one `usage` or `timings` object kept while it is incomplete: the real
/// ones are a few hundred bytes. A longer one is passed over.
const CAPTURE_LIMIT: usize = 4096;

/// The member names looked for.
const USAGE: &[u8] = b"usage";
const TIMINGS: &[u8] = b"timings";
/// Bytes kept from the end of one chunk, to read a name before a `{` the next chunk begins
/// with: the name, its quotes, the colon and some whitespace.
const CARRY: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Member {
    Usage,
    Timings,
}

/// Finds the figures in a body fed to it chunk by chunk.
#[derive(Debug, Default)]
pub(crate) struct UsageScanner {
    /// The last bytes of the previous chunk, and how many there are.
    carry: [u8; CARRY],
    carry_len: usize,
    /// The bytes after a member name, while its value is incomplete.
    capture: Vec<u8>,
    capturing: Option<Member>,
    wire: Wire,
    /// How many `usage` and `timings` objects have been read.
    found: u32,
    /// Whether the body's first byte other than whitespace has been read.
    begun: bool,
}

/// The figures seen so far, field by field.
#[derive(Clone, Copy, Debug, Default)]
struct Wire {
    /// The body is one JSON object (its first byte other than whitespace is `{`), not a
    /// stream of events: its own usage comes after its content, and a usage object with a
    /// prompt figure replaces the prompt figures before it (see [`add_usage`]).
    one_object: bool,
    prompt_tokens: Option<u64>,
    prompt_cached: Option<u64>,
    input_tokens: Option<u64>,
    input_cached: Option<u64>,
    cache_read: Option<u64>,
    cache_creation: Option<u64>,
    prompt_n: Option<u64>,
    cache_n: Option<u64>,
    prompt_ms: Option<f64>,
}

#[derive(Debug, Default, Deserialize, PartialEq)]
struct UsageObject {
    prompt_tokens: Option<u64>,
    prompt_tokens_details: Option<Details>,
    input_tokens: Option<u64>,
    input_tokens_details: Option<Details>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

#[derive(Debug, Default, Deserialize, PartialEq)]
struct Details {
    cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct TimingsObject {
    prompt_n: Option<u64>,
    cache_n: Option<u64>,
    prompt_ms: Option<f64>,
}

/// What parsing a captured value gave.
enum Parsed {
    /// More bytes are needed.
    Incomplete,
    /// Done (taken or passed over); the value ended `n` bytes into the capture.
    Done(usize),
}

impl UsageScanner {
    /// Reads one chunk of the body.
    pub(crate) fn feed(&mut self, mut chunk: &[u8]) {
        if !self.begun {
            if let Some(&first) = chunk.iter().find(|b| !b.is_ascii_whitespace()) {
                self.begun = true;
                self.wire.one_object = first == b'{';
            }
        }
        while !chunk.is_empty() {
            match self.capturing {
                Some(member) => chunk = self.capture_more(member, chunk),
                None => return self.scan(chunk),
            }
        }
    }

    /// Looks for the objects in `bytes`, which follow the carry (everything scanned before).
    ///
    /// The search is for `{`, found a vector at a time, and a look back from each at what
    /// precedes it: a `"usage"` or `"timings"` member name and its colon. Braces are few in
    /// JSON's structure; in text (code in an answer) the look back fails at its first byte.
    fn scan(&mut self, mut bytes: &[u8]) {
        let mut from = 0;
        while let Some(k) = memchr::memchr(b'{', &bytes[from..]) {
            let at = from + k;
            from = at + 1;
            let Some(member) = self.member_before(bytes, at) else {
                continue;
            };
            self.carry_len = 0;
            match self.capture_from(member, &bytes[at..]) {
                Some(used) => {
                    bytes = &bytes[at + used..];
                    from = 0;
                }
                None => return,
            }
        }
        self.keep_carry(bytes);
    }

    /// The member whose value the `{` at `at` in `bytes` opens, if it is one looked for:
    /// `"usage"` or `"timings"`, a colon, whitespace anywhere between. Looks back into the
    /// carry where `bytes` does not reach.
    fn member_before(&self, bytes: &[u8], at: usize) -> Option<Member> {
        if at >= CARRY {
            return member_ending(&bytes[at - CARRY..at]);
        }
        let mut window = [0u8; 2 * CARRY];
        let carried = &self.carry[..self.carry_len];
        window[..carried.len()].copy_from_slice(carried);
        window[carried.len()..carried.len() + at].copy_from_slice(&bytes[..at]);
        member_ending(&window[..carried.len() + at])
    }

    /// Keeps the last bytes scanned, for a name the next chunk completes.
    fn keep_carry(&mut self, bytes: &[u8]) {
        if bytes.len() >= CARRY {
            self.carry.copy_from_slice(&bytes[bytes.len() - CARRY..]);
            self.carry_len = CARRY;
            return;
        }
        // Fewer new bytes than the carry holds: keep the newest CARRY in all.
        let n = bytes.len();
        let keep = (self.carry_len + n).min(CARRY);
        let old = keep - n;
        self.carry
            .copy_within(self.carry_len - old..self.carry_len, 0);
        self.carry[old..keep].copy_from_slice(bytes);
        self.carry_len = keep;
    }

    /// Starts reading a member's object from `rest`, which begins with its `{`. Returns how
    /// many bytes of `rest` it used when it is done with the object (read, or passed over), or
    /// `None` while the object goes on into the next chunk.
    fn capture_from(&mut self, member: Member, rest: &[u8]) -> Option<usize> {
        let take = rest.len().min(CAPTURE_LIMIT);
        // Parsed where it is: most objects end in the chunk they start in, and only one that
        // goes on into the next chunk is copied.
        match parse_object(&mut self.wire, &mut self.found, member, &rest[..take]) {
            Parsed::Done(end) => Some(end),
            // Too long to be a usage object: passed over, and scanning goes on after it.
            Parsed::Incomplete if take == CAPTURE_LIMIT => Some(take),
            Parsed::Incomplete => {
                self.capture.clear();
                self.capture.extend_from_slice(rest);
                self.capturing = Some(member);
                None
            }
        }
    }

    /// Goes on reading a value that an earlier chunk began; returns what is left of `bytes` to
    /// read after it.
    fn capture_more<'b>(&mut self, member: Member, bytes: &'b [u8]) -> &'b [u8] {
        let before = self.capture.len();
        let take = bytes.len().min(CAPTURE_LIMIT - before);
        self.capture.extend_from_slice(&bytes[..take]);
        let end = match self.parse(member) {
            Parsed::Done(end) => end,
            Parsed::Incomplete if self.capture.len() == CAPTURE_LIMIT => CAPTURE_LIMIT,
            Parsed::Incomplete => return &[],
        };
        self.capturing = None;
        self.carry_len = 0;
        if end >= before {
            return &bytes[end - before..];
        }
        // Not JSON after all: only its brace is passed over, and what follows it, which
        // earlier chunks brought, is scanned as reading the body whole scans it (a member
        // looked for may be there). Its own bytes are in the capture: the chunk goes on after
        // them.
        let mut captured = std::mem::take(&mut self.capture);
        self.scan(&captured[end..]);
        if self.capturing.is_none() {
            captured.clear();
            self.capture = captured;
        }
        &bytes[take..]
    }

    /// Parses the object captured from its `{`.
    fn parse(&mut self, member: Member) -> Parsed {
        parse_object(&mut self.wire, &mut self.found, member, &self.capture)
    }

    /// How many `usage` and `timings` objects have been read so far: a chunk that raises it
    /// held one.
    pub(crate) fn objects_read(&self) -> u32 {
        self.found
    }

    /// The figures of the whole body, once it has ended.
    pub(crate) fn finish(&self) -> Option<Usage> {
        if self.found == 0 {
            return None;
        }
        let w = &self.wire;
        // A time past what a `Duration` holds is not one a backend took: left out.
        let prompt_time = w
            .prompt_ms
            .and_then(|ms| Duration::try_from_secs_f64(ms / 1000.0).ok());
        let timings = match (w.prompt_n, w.cache_n) {
            (Some(read), Some(cached)) => Some(Usage {
                prompt_tokens: read.saturating_add(cached),
                reused_tokens: Some(cached),
                prompt_time,
                zero_left_out: false,
            }),
            _ => None,
        };
        let (prompt_tokens, reused_tokens) = if let Some(p) = w.prompt_tokens {
            (p, w.prompt_cached)
        } else if w.cache_read.is_some() || w.cache_creation.is_some() {
            // Anthropic: `input_tokens` counts only what followed the cache breakpoints.
            let read = w.cache_read.unwrap_or(0);
            let total = w
                .input_tokens
                .unwrap_or(0)
                .saturating_add(read)
                .saturating_add(w.cache_creation.unwrap_or(0));
            (total, Some(read))
        } else if let Some(p) = w.input_tokens {
            (p, w.input_cached)
        } else {
            return timings;
        };
        let reported = Usage {
            prompt_tokens,
            reused_tokens: reused_tokens.map(|r| r.min(prompt_tokens)),
            // Timings without their counts (an older llama-server's, a fork's) still time
            // the prompt; complete ones that disagree with the usage do not.
            prompt_time: prompt_time.filter(|_| timings.is_none()),
            zero_left_out: w.prompt_tokens.is_some(),
        };
        // llama-server's usage and timings say the same; timings that say otherwise are not
        // the backend's (a model's tool input, which an Anthropic answer carries as an
        // object, can hold any member), and the usage wins, without their time.
        match timings {
            Some(t)
                if t.prompt_tokens == reported.prompt_tokens
                    && reported
                        .reused_tokens
                        .is_none_or(|r| t.reused_tokens == Some(r)) =>
            {
                Some(t)
            }
            _ => Some(reported),
        }
    }
}

/// Parses the object that `b` begins with (at its `{`), adding its figures to `wire`; or says
/// that `b` ends before the object does.
fn parse_object(wire: &mut Wire, found: &mut u32, member: Member, b: &[u8]) -> Parsed {
    match b.first() {
        None => Parsed::Incomplete,
        Some(b'{') => {
            // A usage object as the APIs send it is read without serde (see `Plain`).
            if member == Member::Usage {
                if let Some((o, n)) = Plain::usage(b) {
                    add_usage(wire, o);
                    *found = found.saturating_add(1);
                    return Parsed::Done(n);
                }
            }
            // Typed at once: one pass over the object.
            let typed = match member {
                Member::Usage => {
                    parse_typed::<UsageObject>(b).map(|(o, n)| (add_usage(wire, o), n))
                }
                Member::Timings => {
                    parse_typed::<TimingsObject>(b).map(|(o, n)| (add_timings(wire, o), n))
                }
            };
            match typed {
                Ok(((), n)) => {
                    *found = found.saturating_add(1);
                    Parsed::Done(n)
                }
                Err(e) if e.is_eof() => Parsed::Incomplete,
                // Not what the APIs send: passed over whole, if it is JSON at all. A number
                // cut short at the end of `b` (`812.`) fails here too: the pass over it says
                // whether the object is whole, not the last byte of `b`, which may be the
                // text after a whole one.
                Err(_) => {
                    let mut values = serde_json::Deserializer::from_slice(b)
                        .into_iter::<serde::de::IgnoredAny>();
                    match values.next() {
                        Some(Ok(_)) => Parsed::Done(values.byte_offset()),
                        Some(Err(e)) if e.is_eof() || ends_in_a_number(b) => Parsed::Incomplete,
                        // Not JSON: skip the brace and go on.
                        _ => Parsed::Done(1),
                    }
                }
            }
        }
        Some(_) => Parsed::Done(1),
    }
}

/// Whether `b` ends where a number may go on (`812.`, `1e`, `1e+`, `-`): serde reads such an
/// end as a bad number, not as the end of its input, though the next chunk completes it.
fn ends_in_a_number(b: &[u8]) -> bool {
    matches!(b.last(), Some(b'.' | b'e' | b'E' | b'+' | b'-'))
}

/// A reader for the usage objects the APIs send, faster than serde's on them: member names
/// without escapes, values that are non-negative integers or `null`, and objects of such
/// members one level down (`prompt_tokens_details`, `completion_tokens_details`). On anything
/// else, and on an object cut short, it gives up (`None`) and serde decides; on what it reads,
/// it gives what serde would, where serde would (the two are compared in the tests).
struct Plain<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Plain<'a> {
    /// The usage object that `b` begins with (at its `{`), and where it ends.
    fn usage(b: &'a [u8]) -> Option<(UsageObject, usize)> {
        let mut p = Plain { b, at: 0 };
        let mut u = UsageObject::default();
        // Each field once: serde refuses a repeated one, and then so does this.
        let mut seen = 0u8;
        let mut once = |bit: u8| {
            let first = seen & bit == 0;
            seen |= bit;
            first.then_some(())
        };
        p.object(|name, p| {
            match name {
                b"prompt_tokens" => {
                    once(1)?;
                    u.prompt_tokens = p.scalar()?;
                }
                b"prompt_tokens_details" => {
                    once(2)?;
                    u.prompt_tokens_details = p.details()?;
                }
                b"input_tokens" => {
                    once(4)?;
                    u.input_tokens = p.scalar()?;
                }
                b"input_tokens_details" => {
                    once(8)?;
                    u.input_tokens_details = p.details()?;
                }
                b"cache_read_input_tokens" => {
                    once(16)?;
                    u.cache_read_input_tokens = p.scalar()?;
                }
                b"cache_creation_input_tokens" => {
                    once(32)?;
                    u.cache_creation_input_tokens = p.scalar()?;
                }
                // Another member: an integer, `null`, or an object of those.
                _ => match p.peek()? {
                    b'{' => p.object(|_, p| p.scalar().map(drop))?,
                    _ => drop(p.scalar()?),
                },
            }
            Some(())
        })?;
        Some((u, p.at))
    }

    /// `{"cached_tokens": N, ...}` or `null`.
    fn details(&mut self) -> Option<Option<Details>> {
        if self.peek()? != b'{' {
            return self.null().map(|()| None);
        }
        let mut d = Details::default();
        let mut seen = false;
        self.object(|name, p| {
            let value = p.scalar()?;
            if name == b"cached_tokens" {
                if std::mem::replace(&mut seen, true) {
                    return None;
                }
                d.cached_tokens = value;
            }
            Some(())
        })?;
        Some(Some(d))
    }

    /// An object, at its `{`: `member` reads each member's value, given its name.
    fn object(&mut self, mut member: impl FnMut(&'a [u8], &mut Self) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        self.ws();
        if self.eat(b'}').is_some() {
            return Some(());
        }
        loop {
            self.ws();
            let name = self.name()?;
            self.ws();
            self.eat(b':')?;
            self.ws();
            member(name, self)?;
            self.ws();
            match self.peek()? {
                b',' => self.at += 1,
                b'}' => {
                    self.at += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// A member name without escapes or control characters.
    fn name(&mut self) -> Option<&'a [u8]> {
        self.eat(b'"')?;
        let rest = &self.b[self.at..];
        let len = memchr::memchr2(b'"', b'\\', rest)?;
        let name = &rest[..len];
        if rest[len] != b'"' || name.iter().any(|&c| c < 0x20) {
            return None;
        }
        self.at += len + 1;
        Some(name)
    }

    /// A non-negative integer that fits a `u64`, or `null`.
    fn scalar(&mut self) -> Option<Option<u64>> {
        if !self.peek()?.is_ascii_digit() {
            return self.null().map(|()| None);
        }
        let start = self.at;
        let mut n = 0u64;
        while let Some(&d) = self.b.get(self.at).filter(|d| d.is_ascii_digit()) {
            n = n.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
            self.at += 1;
        }
        // JSON has no leading zeros; a fraction or an exponent is not an integer.
        let leading_zero = self.b[start] == b'0' && self.at - start > 1;
        if leading_zero || matches!(self.peek()?, b'.' | b'e' | b'E') {
            return None;
        }
        Some(Some(n))
    }

    fn null(&mut self) -> Option<()> {
        self.b[self.at..].starts_with(b"null").then(|| self.at += 4)
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.at).copied()
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.at += 1)
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.at += 1;
        }
    }
}

/// The first JSON value in `bytes` as a `T`, and where it ends.
fn parse_typed<'de, T: Deserialize<'de>>(
    bytes: &'de [u8],
) -> Result<(T, usize), serde_json::Error> {
    let mut values = serde_json::Deserializer::from_slice(bytes).into_iter::<T>();
    match values.next() {
        Some(Ok(v)) => Ok((v, values.byte_offset())),
        Some(Err(e)) => Err(e),
        None => Err(serde::de::Error::custom("no value")),
    }
}

/// The largest count taken for one: 2^32 tokens, far past any model's context. A larger one is
/// not a figure its backend measured (a C++ server's `size_t` gone below zero reads as
/// 18446744073709551615), and is left out, so that the sums of figures kept per backend and
/// per outcome cannot overflow.
const MAX_COUNT: u64 = 1 << 32;

/// `n`, if it is a count a backend may have measured (see [`MAX_COUNT`]).
fn count(n: Option<u64>) -> Option<u64> {
    n.filter(|&n| n <= MAX_COUNT)
}

/// Adds a usage object's figures: field by field in a stream, where an Anthropic stream gives
/// some in its first event and others in its last, and a model's text is in strings; in an
/// answer that is one object, a usage object with a prompt figure first clears those before
/// it, which can only be what a model wrote into a tool's input (an object in an Anthropic
/// answer), of any shape and fields.
fn add_usage(w: &mut Wire, u: UsageObject) {
    let prompt_figure = [
        u.prompt_tokens,
        u.input_tokens,
        u.cache_read_input_tokens,
        u.cache_creation_input_tokens,
    ]
    .into_iter()
    .any(|n| count(n).is_some());
    if w.one_object && prompt_figure {
        *w = Wire {
            one_object: true,
            prompt_n: w.prompt_n,
            cache_n: w.cache_n,
            prompt_ms: w.prompt_ms,
            ..Wire::default()
        };
    }
    set(&mut w.prompt_tokens, count(u.prompt_tokens));
    set(
        &mut w.prompt_cached,
        count(u.prompt_tokens_details.and_then(|d| d.cached_tokens)),
    );
    set(&mut w.input_tokens, count(u.input_tokens));
    set(
        &mut w.input_cached,
        count(u.input_tokens_details.and_then(|d| d.cached_tokens)),
    );
    set(&mut w.cache_read, count(u.cache_read_input_tokens));
    set(&mut w.cache_creation, count(u.cache_creation_input_tokens));
}

fn add_timings(w: &mut Wire, t: TimingsObject) {
    set(&mut w.prompt_n, count(t.prompt_n));
    set(&mut w.cache_n, count(t.cache_n));
    set(
        &mut w.prompt_ms,
        t.prompt_ms.filter(|ms| ms.is_finite() && *ms >= 0.0),
    );
}

/// The member named by what `before` ends with (the bytes just before a `{`): `"usage"` or
/// `"timings"` and a colon, with whitespace anywhere between, and no backslash just before the
/// name's opening quote: the opening quote of a member name follows `{`, `,` or whitespace,
/// and a quote after a backslash is inside a string or ends one. Counting the run of
/// backslashes instead would miscount one longer than the bytes looked back at.
fn member_ending(before: &[u8]) -> Option<Member> {
    let name = before
        .trim_ascii_end()
        .strip_suffix(b":")?
        .trim_ascii_end()
        .strip_suffix(b"\"")?;
    let (member, rest) = if let Some(rest) = name.strip_suffix(USAGE) {
        (Member::Usage, rest)
    } else {
        (Member::Timings, name.strip_suffix(TIMINGS)?)
    };
    let rest = rest.strip_suffix(b"\"")?;
    (rest.last() != Some(&b'\\')).then_some(member)
}

fn set<T>(slot: &mut Option<T>, value: Option<T>) {
    if value.is_some() {
        *slot = value;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_in_pieces(body: &[u8], piece: usize) -> Option<Usage> {
        let mut s = UsageScanner::default();
        for chunk in body.chunks(piece) {
            s.feed(chunk);
        }
        s.finish()
    }

    const CHAT: &[u8] = br#"{"id":"x","choices":[{"message":{"content":"the \"usage\": {\"prompt_tokens\": 1} field"}}],"usage":{"prompt_tokens":1200,"completion_tokens":12,"prompt_tokens_details":{"cached_tokens":1024}}}"#;

    #[test]
    fn openai_chat_answer_gives_prompt_and_cached_tokens() {
        let u = Usage::from_body(CHAT).unwrap();
        assert_eq!((u.prompt_tokens, u.reused_tokens), (1200, Some(1024)));
    }

    #[test]
    fn the_same_figures_whatever_the_chunking() {
        let whole = Usage::from_body(CHAT);
        for piece in 1..CHAT.len() {
            assert_eq!(scan_in_pieces(CHAT, piece), whole, "pieces of {piece}");
        }
    }

    #[test]
    fn llama_cpp_timings_win_over_usage() {
        let body = br#"{"usage":{"prompt_tokens":900},"timings":{"prompt_n":100,"cache_n":800,"prompt_ms":250.0}}"#;
        let u = Usage::from_body(body).unwrap();
        assert_eq!((u.prompt_tokens, u.reused_tokens), (900, Some(800)));
        assert_eq!(u.prompt_time, Some(Duration::from_millis(250)));
    }

    /// llama-server's whole answer, its usage then its whole timings object, with the float
    /// members the scanner does not read: a chunk may end inside any of them (`812.`, `1e`),
    /// which serde reads as a bad number rather than an early end. The timings, which agree
    /// with the usage, give the prompt's time.
    #[test]
    fn llama_cpp_whole_timings_read_the_same_whatever_the_chunking() {
        let body: &[u8] = br#"{"choices":[],"usage":{"completion_tokens":3,"prompt_tokens":2160,"total_tokens":2163,"prompt_tokens_details":{"cached_tokens":2000}},"timings":{"cache_n":2000,"prompt_n":160,"prompt_ms":812.5,"prompt_per_token_ms":5.078125,"prompt_per_second":1.9692e2,"predicted_n":3,"predicted_ms":30.1,"predicted_per_token_ms":-1.0E+1,"predicted_per_second":99.66}}"#;
        let whole = Usage::from_body(body).unwrap();
        assert_eq!(
            (whole.prompt_tokens, whole.reused_tokens),
            (2160, Some(2000))
        );
        assert_eq!(whole.prompt_time, Some(Duration::from_micros(812_500)));
        for piece in 1..body.len() {
            assert_eq!(
                scan_in_pieces(body, piece),
                Some(whole),
                "pieces of {piece}"
            );
        }
    }

    /// A JSON number of any of the forms JSON allows, as text.
    fn json_number() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        (
            any::<bool>(),
            0u32..100_000,
            proptest::option::of(0u32..1000),
            proptest::option::of((any::<bool>(), proptest::option::of(any::<bool>()), 0u8..40)),
        )
            .prop_map(|(neg, int, frac, exp)| {
                let mut n = format!("{}{int}", if neg { "-" } else { "" });
                if let Some(f) = frac {
                    n += &format!(".{f}");
                }
                if let Some((upper, sign, e)) = exp {
                    n.push(if upper { 'E' } else { 'e' });
                    match sign {
                        Some(true) => n.push('+'),
                        Some(false) => n.push('-'),
                        None => {}
                    }
                    n += &e.to_string();
                }
                n
            })
    }

    proptest::proptest! {
        /// A report read whole is read the same in chunks of any size, whatever numbers the
        /// members around its figures hold (a chunk may end anywhere inside one).
        #[test]
        fn a_report_reads_the_same_in_chunks_of_any_size(
            numbers in proptest::collection::vec(json_number(), 1..6),
            prompt in 0u64..1_000_000,
            cached in 0u64..1_000_000,
            timings in proptest::bool::ANY,
            piece in 1usize..40,
        ) {
            let extra: String = numbers
                .iter()
                .enumerate()
                .map(|(i, n)| format!(",\"x{i}\":{n}"))
                .collect();
            let body = if timings {
                format!(r#"{{"choices":[],"timings":{{"cache_n":{cached}{extra},"prompt_n":{prompt}{extra},"prompt_ms":1.5}}}}"#)
            } else {
                format!(r#"{{"id":"x","usage":{{"prompt_tokens":{prompt}{extra},"prompt_tokens_details":{{"cached_tokens":{cached}}}}},"n":{}}}"#, numbers[0])
            };
            let whole = Usage::from_body(body.as_bytes());
            proptest::prop_assert!(whole.is_some(), "{}", body);
            proptest::prop_assert_eq!(scan_in_pieces(body.as_bytes(), piece), whole, "{}", body);
        }
    }

    /// One member of an answer's object: figures as the APIs send them, figures of the wrong
    /// type (as a tool's input that a model wrote may hold), other members whose numbers end
    /// where a chunk may cut them, a value that is not JSON (a broken answer), and objects
    /// nesting these.
    fn answer_member() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let leaf = proptest::sample::select(vec![
            r#""usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":3}}"#,
            r#""usage":{"input_tokens":50,"cache_read_input_tokens":2000}"#,
            r#""usage":{"prompt_tokens":12,"x":[1,2,{"y":-3}],"z":"e"}"#,
            r#""usage":{"completion_tokens":2,"prompt_tokens":-0}"#,
            r#""timings":{"prompt_n":5,"cache_n":2,"prompt_ms":1.5e2}"#,
            r#""usage":{"prompt_tokens":1.5}"#,
            r#""usage":{"prompt_tokens":1e2}"#,
            r#""usage":{"input_tokens":"many"}"#,
            r#""usage":[1,2.5]"#,
            r#""usage":null"#,
            r#""timings":{"prompt_n":-1,"cache_n":2}"#,
            r#""timings":{"prompt_ms":"fast","prompt_n":3}"#,
            r#""s":"a \"usage\":{\"prompt_tokens\":9} e""#,
            r#""n":-1.5E+3"#,
            r#""m":1e5"#,
            r#""broken":{"q":?}"#,
        ])
        .prop_map(str::to_string);
        leaf.prop_recursive(3, 20, 4, |inner| {
            (
                proptest::sample::select(vec!["input", "usage", "timings", "message"]),
                proptest::collection::vec(inner, 0..4),
            )
                .prop_map(|(name, members)| format!("\"{name}\":{{{}}}", members.join(",")))
        })
    }

    proptest::proptest! {
        /// An answer, whole or a stream of events, reads the same wherever the network cuts
        /// it: a mistyped object at the end of a chunk does not hide what follows it.
        #[test]
        fn an_answer_reads_the_same_wherever_it_is_cut(
            events in proptest::collection::vec(proptest::collection::vec(answer_member(), 0..5), 1..4),
            stream in proptest::bool::ANY,
            spaced in proptest::bool::ANY,
            cuts in proptest::collection::btree_set(0usize..600, 0..4),
        ) {
            let sep = if spaced { " ,\n " } else { "," };
            let objects: Vec<String> =
                events.iter().map(|members| format!("{{{}}}", members.join(sep))).collect();
            let body = if stream {
                objects.iter().map(|o| format!("data: {o}\n\n")).collect::<String>() + "data: [DONE]\n\n"
            } else {
                objects[0].clone()
            };
            let b = body.as_bytes();
            let mut s = UsageScanner::default();
            let mut at = 0;
            for cut in cuts.into_iter().filter(|&c| c < b.len()) {
                s.feed(&b[at..cut]);
                at = cut;
            }
            s.feed(&b[at..]);
            proptest::prop_assert_eq!(s.finish(), Usage::from_body(b), "{}", body);
        }
    }

    /// A tool's input in an Anthropic answer is an object a model wrote: `timings` in it
    /// disagree with the answer's usage, which wins, without their time. Timings that agree
    /// with the usage win wherever they are, before it too (a server that sorts its keys).
    #[test]
    fn timings_that_disagree_with_the_usage_are_not_the_backends() {
        let body = br#"{"type":"message","content":[{"type":"tool_use","id":"t","name":"report","input":{"timings":{"prompt_n":3,"cache_n":0,"prompt_ms":9.0}}}],"usage":{"input_tokens":50,"cache_read_input_tokens":2000,"cache_creation_input_tokens":10,"output_tokens":5}}"#;
        let u = Usage::from_body(body).unwrap();
        assert_eq!((u.prompt_tokens, u.reused_tokens), (2060, Some(2000)));
        assert_eq!(u.prompt_time, None);
        let sorted = br#"{"choices":[],"timings":{"cache_n":800,"prompt_ms":250.0,"prompt_n":100},"usage":{"prompt_tokens":900,"prompt_tokens_details":{"cached_tokens":800}}}"#;
        let u = Usage::from_body(sorted).unwrap();
        assert_eq!((u.prompt_tokens, u.reused_tokens), (900, Some(800)));
        assert_eq!(u.prompt_time, Some(Duration::from_millis(250)));
        // Timings alone, wherever they are, are read.
        let alone = br#"{"content":[{"input":{"timings":{"prompt_n":3,"cache_n":1}}}]}"#;
        let u = Usage::from_body(alone).unwrap();
        assert_eq!((u.prompt_tokens, u.reused_tokens), (4, Some(1)));
    }

    /// Timings without `cache_n` (an older llama-server's, a fork's) give no counts, but still
    /// the prompt's time, beside the usage's counts.
    #[test]
    fn timings_without_their_counts_still_time_the_prompt() {
        let body = br#"{"usage":{"prompt_tokens":900,"prompt_tokens_details":{"cached_tokens":800}},"timings":{"prompt_n":100,"prompt_ms":250.0}}"#;
        let u = Usage::from_body(body).unwrap();
        assert_eq!((u.prompt_tokens, u.reused_tokens), (900, Some(800)));
        assert_eq!(u.prompt_time, Some(Duration::from_millis(250)));
    }

    #[test]
    fn a_prompt_time_past_what_a_duration_holds_is_left_out_not_a_panic() {
        let body = br#"{"timings":{"prompt_n":100,"cache_n":800,"prompt_ms":1e300}}"#;
        let u = Usage::from_body(body).unwrap();
        assert_eq!((u.prompt_tokens, u.reused_tokens), (900, Some(800)));
        assert_eq!(u.prompt_time, None);
    }

    #[test]
    fn anthropic_input_tokens_exclude_the_cached_ones() {
        let body = br#"{"type":"message","usage":{"input_tokens":50,"cache_read_input_tokens":2000,"cache_creation_input_tokens":10,"output_tokens":5}}"#;
        let u = Usage::from_body(body).unwrap();
        assert_eq!((u.prompt_tokens, u.reused_tokens), (2060, Some(2000)));
    }

    #[test]
    fn responses_api_input_tokens_details() {
        let body = br#"{"object":"response","usage":{"input_tokens":3000,"input_tokens_details":{"cached_tokens":2900},"output_tokens":7}}"#;
        let u = Usage::from_body(body).unwrap();
        assert_eq!((u.prompt_tokens, u.reused_tokens), (3000, Some(2900)));
    }

    #[test]
    fn vllm_without_cached_tokens_says_nothing_about_reuse() {
        let body = br#"{"usage":{"prompt_tokens":3000,"completion_tokens":7,"prompt_tokens_details":null}}"#;
        let u = Usage::from_body(body).unwrap();
        assert_eq!((u.prompt_tokens, u.reused_tokens), (3000, None));
    }

    #[test]
    fn sse_stream_final_usage_chunk() {
        let body = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n\
data: [DONE]\n\n";
        for piece in [1, 3, 7, 64, body.len()] {
            let u = scan_in_pieces(body, piece).unwrap();
            assert_eq!(
                (u.prompt_tokens, u.reused_tokens),
                (40, Some(32)),
                "{piece}"
            );
        }
    }

    #[test]
    fn anthropic_stream_keeps_message_start_figures() {
        let body = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":5,\"cache_read_input_tokens\":95}}}\n\n\
event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\n\n";
        let u = Usage::from_body(body).unwrap();
        assert_eq!((u.prompt_tokens, u.reused_tokens), (100, Some(95)));
    }

    #[test]
    fn malformed_or_mistyped_usage_gives_no_figure() {
        for body in [
            &br#"{"usage":{"prompt_tokens":"12"}}"#[..],
            br#"{"usage":{"prompt_tokens":-3}}"#,
            br#"{"usage":[1,2]}"#,
            br#"{"usage":{"prompt_tokens":12,"#,
            br#"{"usage":"#,
            br#"not json at all, "usage" said"#,
            br#"{"timings":{"prompt_n":1.5,"cache_n":2}}"#,
        ] {
            assert_eq!(
                Usage::from_body(body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    /// What serde makes of the object `b` begins with, and where it ends.
    fn by_serde(b: &[u8]) -> Option<(UsageObject, usize)> {
        parse_typed::<UsageObject>(b).ok()
    }

    #[test]
    fn the_plain_reader_reads_what_the_apis_send_as_serde_does() {
        for b in [
            &br#"{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}"#[..],
            br#"{"prompt_tokens":1200,"completion_tokens":12,"prompt_tokens_details":{"cached_tokens":1024}}"#,
            br#"{ "prompt_tokens" : 3000 , "completion_tokens": 7, "prompt_tokens_details": null }"#,
            br#"{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":3}}"#,
            br#"{"input_tokens":50,"cache_read_input_tokens":2000,"cache_creation_input_tokens":10,"output_tokens":5}"#,
            br#"{"input_tokens":3000,"input_tokens_details":{"cached_tokens":2900},"output_tokens":7}"#,
            b"{\n\t\"prompt_tokens\": 0\r\n}",
            br#"{}"#,
            br#"{"prompt_tokens":18446744073709551615}"#,
            br#"{"prompt_tokens":1}, "more": 2}"#,
        ] {
            let plain = Plain::usage(b);
            assert!(plain.is_some(), "{}", String::from_utf8_lossy(b));
            assert_eq!(plain, by_serde(b), "{}", String::from_utf8_lossy(b));
        }
    }

    #[test]
    fn the_plain_reader_leaves_the_rest_to_serde() {
        for b in [
            &br#"{"prompt_tokens":1.5}"#[..],
            br#"{"prompt_tokens":-0}"#,
            br#"{"prompt_tokens":01}"#,
            br#"{"prompt_tokens":1e3}"#,
            br#"{"prompt_tokens":18446744073709551616}"#,
            br#"{"prompt_tokens":1,"prompt_tokens":2}"#,
            br#"{"prompt_tokens_details":{"cached_tokens":1,"cached_tokens":1}}"#,
            br#"{"prompt_tokens":"12"}"#,
            br#"{"model":"m","prompt_tokens":1}"#,
            br#"{"prompt\u005ftokens":1}"#,
            br#"{"x":{"y":{"z":1}}}"#,
            br#"{"prompt_tokens":1,}"#,
            br#"{"prompt_tokens":12"#,
            br#"{"prompt_tokens":nul"#,
            br#"{"prompt_tokens":nullx}"#,
        ] {
            assert_eq!(Plain::usage(b), None, "{}", String::from_utf8_lossy(b));
        }
    }

    proptest::proptest! {
        #[test]
        fn whatever_the_plain_reader_reads_serde_reads_alike(
            tokens in proptest::collection::vec(proptest::sample::select(vec![
                "{", "}", ":", ",", " ", "\n", "0", "7", "12", "007", "1.5", "-1", "2e1", "null",
                "true", "18446744073709551615", "18446744073709551616", "\"prompt_tokens\"",
                "\"prompt_tokens_details\"", "\"cached_tokens\"", "\"input_tokens\"",
                "\"cache_read_input_tokens\"", "\"x\"", "\"a\\\"b\"", "\"s\"", "[1]",
            ]), 0..24),
        ) {
            let mut b = b"{".to_vec();
            for t in tokens {
                b.extend_from_slice(t.as_bytes());
            }
            if let Some(plain) = Plain::usage(&b) {
                proptest::prop_assert_eq!(Some(plain), by_serde(&b), "{}", String::from_utf8_lossy(&b));
            }
        }
    }

    #[test]
    fn an_overlong_object_is_passed_over_and_scanning_goes_on() {
        let mut body = br#"{"usage":{"pad":""#.to_vec();
        body.extend(std::iter::repeat_n(b'x', CAPTURE_LIMIT * 2));
        body.extend_from_slice(br#""},"timings":{"prompt_n":1,"cache_n":2}}"#);
        for piece in [5, 1000, body.len()] {
            let u = scan_in_pieces(&body, piece).unwrap();
            assert_eq!(u.reused_tokens, Some(2), "{piece}");
        }
    }

    #[test]
    fn the_tokens_read_are_the_prompt_less_the_reused_ones() {
        let u = Usage::from_body(CHAT).unwrap();
        assert_eq!(u.read_tokens(), Some(176));
        let vllm = Usage::from_body(br#"{"usage":{"prompt_tokens":3000}}"#).unwrap();
        assert_eq!(vllm.read_tokens(), None);
    }

    #[test]
    fn a_negative_prompt_time_leaves_the_one_before_it() {
        let body =
            b"data: {\"timings\":{\"prompt_n\":100,\"cache_n\":800,\"prompt_ms\":250.0}}\n\n\
data: {\"timings\":{\"prompt_n\":100,\"cache_n\":800,\"prompt_ms\":-1.0}}\n\n";
        let u = Usage::from_body(body).unwrap();
        assert_eq!(u.prompt_time, Some(Duration::from_millis(250)));
    }

    #[test]
    fn an_overlong_object_is_never_kept_past_the_limit() {
        let mut body = br#"{"usage":{"pad":""#.to_vec();
        body.extend(std::iter::repeat_n(b'x', CAPTURE_LIMIT * 3));
        body.extend_from_slice(br#""}}"#);
        let mut s = UsageScanner::default();
        for chunk in body.chunks(1000) {
            s.feed(chunk);
            assert!(s.capture.len() <= CAPTURE_LIMIT, "{}", s.capture.len());
        }
    }

    #[test]
    fn a_member_name_inside_a_string_is_not_taken_for_one() {
        let body = br#"{"choices":[{"message":{"content":"the \"usage\": {\"prompt_tokens\": 1} field"}}]}"#;
        assert_eq!(Usage::from_body(body), None);
        // A member named `x "usage`: its name ends in `usage"`, after an escaped quote.
        let body = br#"{"x \"usage":{"prompt_tokens":1}}"#;
        assert_eq!(Usage::from_body(body), None);
    }

    /// A mistyped object (in a tool's input, which a model writes; a float count) in a chunk
    /// that ends where a number may go on (`e`, `.`, `-`) is whole all the same: it is passed
    /// over, and what follows it in its chunk is read.
    #[test]
    fn what_follows_a_mistyped_object_in_its_chunk_is_read_whatever_the_chunk_ends_with() {
        let anthropic: &[u8] = br#"{"content":[{"type":"tool_use","id":"t","name":"f","input":{"usage":{"input_tokens":"many"}}}],"usage":{"input_tokens":50,"cache_read_input_tokens":2000,"output_tokens":5,"service_tier":"standard"}}"#;
        let stream: &[u8] = b"data: {\"usage\":{\"prompt_tokens\":1.5}}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"prompt_tokens_details\":{\"cached_tokens\":3}},\"model\":\"some-model\"}\n\ndata: [DONE]\n\n";
        for body in [anthropic, stream] {
            let whole = Usage::from_body(body);
            assert!(whole.is_some(), "{}", String::from_utf8_lossy(body));
            reads_alike_wherever_cut(body, whole);
        }
    }

    /// Checks that `body`, cut in two anywhere and fed a piece at a time, reads as `whole`.
    fn reads_alike_wherever_cut(body: &[u8], whole: Option<Usage>) {
        for cut in 1..body.len() {
            let mut s = UsageScanner::default();
            s.feed(&body[..cut]);
            s.feed(&body[cut..]);
            assert_eq!(
                s.finish(),
                whole,
                "cut at {cut}: {}",
                String::from_utf8_lossy(&body[..cut])
            );
        }
    }

    /// A value that is not JSON at all (a broken answer) is passed over by its brace alone,
    /// and what follows the brace is read, also where earlier chunks brought it: an answer
    /// reads the same wherever it is cut, broken or not.
    #[test]
    fn what_follows_the_brace_of_a_value_that_is_not_json_is_read_wherever_the_chunk_ends() {
        let broken: &[u8] =
            br#"{"usage":{"a":{"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":3}}},"b":!}}"#;
        let stream: &[u8] = b"data: {\"timings\":{\"x\":[{\"timings\":{\"prompt_n\":4,\"cache_n\":2}}],\"y\":tru}}\n\n\
data: {\"usage\":{\"e\":{\"usage\":{\"input_tokens\":9}},\"f\":?}}\n\ndata: [DONE]\n\n";
        for (body, want) in [(broken, (5, Some(3))), (stream, (9, None))] {
            let whole = Usage::from_body(body).expect("a figure");
            assert_eq!((whole.prompt_tokens, whole.reused_tokens), want);
            reads_alike_wherever_cut(body, Some(whole));
            for piece in [1, 2, 3, 7] {
                assert_eq!(
                    scan_in_pieces(body, piece),
                    Some(whole),
                    "pieces of {piece}"
                );
            }
        }
    }

    /// A model writes a tool's input in an Anthropic answer as an object, where it can write
    /// a `usage` of any shape (a request body it means to send, say). In an answer that is
    /// one JSON object, the answer's own usage comes after its content, and replaces such a
    /// one whole, figures it does not give and its shape too.
    #[test]
    fn a_usage_a_model_wrote_into_a_tools_input_gives_way_to_the_answers_own() {
        let anthropic: &[u8] = br#"{"id":"m1","type":"message","role":"assistant","content":[{"type":"tool_use","id":"t","name":"post","input":{"url":"/v1/chat/completions","body":{"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":0},"cache_creation_input_tokens":7000}}}}],"model":"m","stop_reason":"tool_use","stop_sequence":null,"usage":{"cache_read_input_tokens":2000,"input_tokens":50,"output_tokens":5}}"#;
        // vLLM's Anthropic endpoint, which gives `input_tokens` alone: no reuse is said.
        let vllm: &[u8] = br#"{"id":"m1","type":"message","role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":{"usage":{"input_tokens":1,"cache_read_input_tokens":900}}}],"usage":{"input_tokens":1100,"output_tokens":5}}"#;
        for (body, want) in [(anthropic, (2050, Some(2000))), (vllm, (1100, None))] {
            let u = Usage::from_body(body).unwrap();
            assert_eq!((u.prompt_tokens, u.reused_tokens), want);
            assert!(!u.zero_left_out);
            for piece in [1, 5, 64] {
                assert_eq!(scan_in_pieces(body, piece), Some(u), "pieces of {piece}");
            }
        }
        // Leading whitespace before the object is still one object.
        let mut spaced = b" \r\n".to_vec();
        spaced.extend_from_slice(anthropic);
        let u = scan_in_pieces(&spaced, 1).unwrap();
        assert_eq!((u.prompt_tokens, u.reused_tokens), (2050, Some(2000)));
    }

    /// An answer's prompt tokens and the reused ones.
    type Figures = (u64, Option<u64>);

    /// Answers in the shapes the servers send, with what each says: llama-server's chat
    /// stream (usage and timings on its last chunk), its Anthropic answer, Anthropic's stream
    /// (figures in `message_start`, cumulative ones in `message_delta`), a Responses stream's
    /// last event, and vLLM's chat answer. Their text holds what is looked for: escapes,
    /// quoted member names, characters of several bytes.
    const REAL_ANSWERS: [(&[u8], Figures); 5] = [
        (
            "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"content\":\"caf\u{e9} \\\"usage\\\":{\\\"prompt_tokens\\\":1} \u{1f600}\"}}],\"created\":1754523863,\"id\":\"chatcmpl-1\",\"model\":\"m\",\"system_fingerprint\":\"b6097\",\"object\":\"chat.completion.chunk\"}\n\n\
data: {\"choices\":[{\"finish_reason\":\"stop\",\"index\":0,\"delta\":{}}],\"created\":1754523863,\"id\":\"chatcmpl-1\",\"model\":\"m\",\"system_fingerprint\":\"b6097\",\"object\":\"chat.completion.chunk\"}\n\n\
data: {\"choices\":[],\"created\":1754523863,\"id\":\"chatcmpl-1\",\"model\":\"m\",\"system_fingerprint\":\"b6097\",\"object\":\"chat.completion.chunk\",\"usage\":{\"completion_tokens\":247,\"prompt_tokens\":1085,\"total_tokens\":1332},\"timings\":{\"cache_n\":1024,\"prompt_n\":61,\"prompt_ms\":203.378,\"prompt_per_token_ms\":3.334,\"prompt_per_second\":299.9,\"predicted_n\":247,\"predicted_ms\":933.63,\"predicted_per_token_ms\":3.77,\"predicted_per_second\":264.55}}\n\n\
data: [DONE]\n\n".as_bytes(),
            (1085, Some(1024)),
        ),
        (
            br#"{"id":"chatcmpl-2","type":"message","role":"assistant","content":[{"type":"text","text":"\u00e9 \"usage\": {"},{"type":"tool_use","id":"t1","name":"post","input":{"usage":{"input_tokens":1,"cache_read_input_tokens":9},"note":"x\\"}}],"model":"m","stop_reason":"tool_use","stop_sequence":null,"usage":{"cache_read_input_tokens":1900,"input_tokens":150,"output_tokens":12}}"#,
            (2050, Some(1900)),
        ),
        (
            b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":100,\"cache_creation_input_tokens\":20,\"cache_read_input_tokens\":3000,\"output_tokens\":1,\"service_tier\":\"standard\"}}}\n\n\
event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"f\",\"input\":{}}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"usage\\\": {\\\"input_tokens\\\": 7\"}}\n\n\
event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n\
event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\",\"stop_sequence\":null},\"usage\":{\"input_tokens\":100,\"cache_creation_input_tokens\":20,\"cache_read_input_tokens\":3000,\"output_tokens\":15}}\n\n\
event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
            (3120, Some(3000)),
        ),
        (
            b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"in_progress\",\"usage\":null}}\n\n\
event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"item_id\":\"msg_1\",\"delta\":\"\\\"timings\\\":{\\\"prompt_n\\\":5}\"}\n\n\
event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"completed\",\"output\":[],\"usage\":{\"input_tokens\":5000,\"input_tokens_details\":{\"cached_tokens\":4864},\"output_tokens\":40,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":5040}}}\n\n",
            (5000, Some(4864)),
        ),
        (
            br#"{"id":"chatcmpl-3","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"usage\": {\"prompt_tokens\": 3}}"}}]},"finish_reason":"tool_calls"}],"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":812,"total_tokens":830,"completion_tokens":18,"prompt_tokens_details":{"cached_tokens":768}},"prompt_logprobs":null,"kv_transfer_params":null}"#,
            (812, Some(768)),
        ),
    ];

    /// Each answer in a real shape, cut anywhere into three pieces or fed a byte at a time,
    /// gives the figures it gives whole, and those are the ones its server reported.
    #[test]
    fn a_real_answer_reads_alike_however_its_bytes_are_split() {
        for (body, want) in REAL_ANSWERS {
            let whole = Usage::from_body(body).expect("a figure");
            assert_eq!((whole.prompt_tokens, whole.reused_tokens), want);
            reads_alike_wherever_cut(body, Some(whole));
            assert_eq!(scan_in_pieces(body, 1), Some(whole));
        }
    }

    proptest::proptest! {
        #[test]
        fn a_real_answer_cut_in_three_anywhere_reads_as_it_does_whole(
            which in 0..REAL_ANSWERS.len(),
            a in proptest::prelude::any::<proptest::sample::Index>(),
            b in proptest::prelude::any::<proptest::sample::Index>(),
        ) {
            let (body, _) = REAL_ANSWERS[which];
            let (a, b) = (a.index(body.len() + 1), b.index(body.len() + 1));
            let (x, y) = (a.min(b), a.max(b));
            let mut s = UsageScanner::default();
            for piece in [&body[..x], &body[x..y], &body[y..]] {
                s.feed(piece);
            }
            proptest::prop_assert_eq!(s.finish(), Usage::from_body(body), "cuts at {} and {}", x, y);
        }
    }

    /// A member name the plain reader cannot read as it is (an escape, a control character)
    /// is left to serde, which refuses what JSON does not allow: a usage object with such a
    /// name gives no figure, however its other members read.
    #[test]
    fn a_name_with_a_bad_escape_or_a_control_character_is_left_to_serde() {
        for b in [
            &br#"{"prompt_tokens\:1200,"completion_tokens":12}"#[..],
            b"{\"completion\x01tokens\":12,\"prompt_tokens\":1200}",
        ] {
            assert_eq!(Plain::usage(b), None, "{}", String::from_utf8_lossy(b));
            assert_eq!(by_serde(b), None, "{}", String::from_utf8_lossy(b));
            let mut body = br#"{"choices":[],"usage":"#.to_vec();
            body.extend_from_slice(b);
            body.push(b'}');
            assert_eq!(
                Usage::from_body(&body),
                None,
                "{}",
                String::from_utf8_lossy(b)
            );
        }
    }

    /// A usage object of the wrong type is passed over whole: a member looked for inside it (a
    /// `timings` a model wrote into a tool's input, in an Anthropic answer) is not read.
    #[test]
    fn what_a_mistyped_object_holds_is_passed_over_with_it() {
        let body: &[u8] = br#"{"id":"m1","type":"message","role":"assistant","content":[{"type":"tool_use","id":"t","name":"report","input":{"usage":{"input_tokens":"many","timings":{"prompt_ms":9000.0}}}}],"model":"m","stop_reason":"tool_use","stop_sequence":null,"usage":{"cache_read_input_tokens":2000,"input_tokens":50,"output_tokens":5}}"#;
        let u = Usage::from_body(body).unwrap();
        assert_eq!(
            (u.prompt_tokens, u.reused_tokens, u.prompt_time),
            (2050, Some(2000), None)
        );
    }

    /// A member named `x\\\\…"usage` (backslashes, then an escaped quote) is not `usage`,
    /// however long the run of backslashes before the quote is.
    #[test]
    fn a_name_ending_in_usage_after_a_long_run_of_backslashes_is_not_taken_for_one() {
        let mut body = br#"{"content":[{"type":"tool_use","input":{"x"#.to_vec();
        body.extend(std::iter::repeat_n(b'\\', 25));
        body.extend_from_slice(br#""usage":{"input_tokens":1,"cache_read_input_tokens":9}}}]}"#);
        assert!(serde_json::from_slice::<serde::de::IgnoredAny>(&body).is_ok());
        assert_eq!(Usage::from_body(&body), None);
        assert_eq!(scan_in_pieces(&body, 1), None);
    }
}
