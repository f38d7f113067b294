//! The prompt's members, cut into a [`PromptChain`].
//!
//! The parse keeps each prompt member of the top-level object: an array as its [`Items`], a
//! string as its text. The chain then takes the members in the order a chat template renders
//! them (tools, the system prompt, then the conversation) and ends a part at every item. A
//! string member is one part, hashed as its decoded text, marked apart from an array's items
//! and ended with a byte that no UTF-8 text holds: no text shares a link with an array whose
//! JSON it spells out, or with a longer prompt whose part boundaries it spells out. An
//! item is hashed in a canonical form of its JSON: no whitespace between tokens, and no
//! `cache_control` member (Anthropic clients move that marker to the newest message every
//! turn, which would otherwise change an old message's digest). The `cch=` value of Claude
//! Code's `x-anthropic-billing-header` system line, new with every request, is left out too:
//! llama-server replaces it before it compares prompts; the rest of the line stays. And a
//! message's `content` given as one text part (`[{"type":"text","text":"..."}]`, or
//! `input_text`, `output_text`) is hashed as the string it holds: chat templates render the two
//! alike, and clients switch an old message between them as they move their cache marks.
//!
//! A long string that is an encoded payload (base64, or a `data:` URI: an image, a document;
//! broken into lines of one length or not) is digested as any string, but counted as
//! [`OPAQUE_TOKENS`] tokens at most rather than a token per four bytes (and a digit): a vision
//! model reads an image as a few hundred to a few thousand tokens, however many bytes its
//! encoding takes.
//!
//! A `prompt` of token ids (an array of whole numbers, or of arrays of them) is what the model
//! reads as it stands: each id counts one token, not a token a digit, and a run of ids is one
//! part cut into blocks, as a text prompt is, not a part an id.

use std::borrow::Cow;
use std::ops::Range;

use crate::chain::ChainBuilder;
use crate::PromptChain;

/// A member of the request that is part of the prompt, in the order the chain takes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    /// `tools`: rendered into the system prompt by chat templates.
    Tools,
    /// Anthropic's `system`.
    System,
    /// The Responses API's `instructions`.
    Instructions,
    /// Chat's and Anthropic's `messages`.
    Messages,
    /// The Responses API's `input`.
    Input,
    /// Legacy completions' `prompt`.
    Prompt,
}

impl Part {
    pub(crate) const ALL: [Part; 6] = [
        Part::Tools,
        Part::System,
        Part::Instructions,
        Part::Messages,
        Part::Input,
        Part::Prompt,
    ];

    /// Whether a string is a value of this member (`messages` and `tools` are arrays only).
    fn takes_text(self) -> bool {
        !matches!(self, Part::Messages | Part::Tools)
    }

    pub(crate) fn of_name(name: &str) -> Option<Part> {
        Some(match name {
            "tools" => Part::Tools,
            "system" => Part::System,
            "instructions" => Part::Instructions,
            "messages" => Part::Messages,
            "input" => Part::Input,
            "prompt" => Part::Prompt,
            _ => return None,
        })
    }
}

/// Added to a [`Part`]'s mark where the member is a string, fed as its decoded text.
const TEXT: u8 = 0x80;

/// A prompt member as the parse kept it.
#[derive(Debug, Default)]
pub(crate) enum PartValue<'de> {
    /// An array: its items.
    Items(Items<'de>),
    /// A string: its text.
    Text(Cow<'de, str>),
    /// An array whose items were parsed already: each item as `serde_json` writes it.
    Written(Vec<String>),
    /// Anything else: not part of the prompt.
    #[default]
    Other,
}

/// The prompt members of one body; a member given twice keeps its last value.
#[derive(Debug, Default)]
pub(crate) struct PromptMembers<'de> {
    parts: [PartValue<'de>; Part::ALL.len()],
}

impl<'de> PromptMembers<'de> {
    pub(crate) fn set(&mut self, part: Part, value: PartValue<'de>) {
        self.parts[part as usize] = value;
    }

    pub(crate) fn get(&self, part: Part) -> &PartValue<'de> {
        &self.parts[part as usize]
    }

    /// The chain of the whole prompt, or `None` if an item nests deeper than
    /// `serde_json::Value` would parse (the parse kept items raw, without that check).
    ///
    /// After `base`, the chain of the response a Responses request continues, only the new
    /// `input` goes on: the tools and instructions are the conversation's, in `base` already.
    pub(crate) fn chain(&self, base: Option<&PromptChain>) -> Option<PromptChain> {
        let block = super::PromptFacts::BLOCK_BYTES;
        let mut chain = match base {
            Some(base) => ChainBuilder::continuing(base, block),
            None => ChainBuilder::new(block),
        };
        let parts: &[Part] = match base {
            Some(_) => &[Part::Input],
            None => &Part::ALL,
        };
        for &part in parts {
            match self.get(part) {
                PartValue::Items(items) => {
                    let mut ids = false;
                    for item in &items.items {
                        if token_ids(part, items.whole(item), &mut chain, &mut ids) {
                            continue;
                        }
                        chain.mark(part as u8);
                        items.canonical(item, &mut chain).ok()?;
                        chain.boundary();
                    }
                    for item in items.rest() {
                        if token_ids(part, Some(item), &mut chain, &mut ids) {
                            continue;
                        }
                        chain.mark(part as u8);
                        canonical(item, &mut chain).ok()?;
                        chain.boundary();
                    }
                    chain.boundary();
                }
                PartValue::Written(items) => {
                    let mut ids = false;
                    for item in items {
                        if token_ids(part, Some(item.as_bytes()), &mut chain, &mut ids) {
                            continue;
                        }
                        chain.mark(part as u8);
                        canonical(item.as_bytes(), &mut chain).ok()?;
                        chain.boundary();
                    }
                    chain.boundary();
                }
                PartValue::Text(text) if !text.is_empty() && part.takes_text() => {
                    // Decoded text, not raw JSON: a kind of its own, so that no string shares
                    // a link with an array whose JSON it spells out.
                    chain.mark(part as u8 | TEXT);
                    let text = text.as_bytes();
                    if let Some(nonce) = billing_nonce(text) {
                        chain.feed(&text[..nonce.start]);
                        chain.feed(&text[nonce.end..]);
                    } else if let Some(tokens) = opaque_tokens(text) {
                        chain.feed_opaque(text, tokens);
                    } else {
                        chain.feed(text);
                    }
                    chain.text_boundary();
                }
                PartValue::Text(_) | PartValue::Other => {}
            }
        }
        Some(chain.finish())
    }
}

/// Added to [`Part::Prompt`]'s mark where its items are token ids.
const IDS: u8 = 0x40;

/// The longest token id taken, in digits: a vocabulary's ids run to six or seven.
const MAX_ID_DIGITS: usize = 19;

/// Feeds `raw`, an item of `prompt`, as token ids if it is one (a whole number) or an array of
/// them, and says whether it did. A model server reads such a prompt as those tokens: each id
/// (and the comma after it) counts one token, where its digits would count a token each. A
/// run of ids is one part, cut into blocks as a text prompt is, not a part an id: `ids` says
/// whether the run is open (the caller ends it with a boundary before any other item).
fn token_ids(part: Part, raw: Option<&[u8]>, chain: &mut ChainBuilder, ids: &mut bool) -> bool {
    let Some(raw) = raw.filter(|_| part == Part::Prompt) else {
        return false;
    };
    let raw = raw.trim_ascii();
    if token_id(raw) {
        if !std::mem::replace(ids, true) {
            chain.mark(part as u8 | IDS);
        }
        feed_id(raw, chain);
        return true;
    }
    if std::mem::take(ids) {
        chain.boundary();
    }
    let Some(inner) = raw.strip_prefix(b"[").and_then(|r| r.strip_suffix(b"]")) else {
        return false;
    };
    let list = inner.split(|&b| b == b',').map(<[u8]>::trim_ascii);
    if inner.trim_ascii().is_empty() || !list.clone().all(token_id) {
        return false;
    }
    chain.mark(part as u8 | IDS);
    list.for_each(|id| feed_id(id, chain));
    chain.boundary();
    true
}

/// Whether `raw` (a JSON value) is a whole number not below 0, of at most [`MAX_ID_DIGITS`]
/// digits.
fn token_id(raw: &[u8]) -> bool {
    (1..=MAX_ID_DIGITS).contains(&raw.len()) && raw.iter().all(u8::is_ascii_digit)
}

/// Feeds one token id and a comma, counted as one token.
fn feed_id(id: &[u8], chain: &mut ChainBuilder) {
    let mut buf = [0u8; MAX_ID_DIGITS + 2];
    buf[..id.len()].copy_from_slice(id);
    buf[id.len()] = b',';
    chain.feed_opaque(&buf[..=id.len()], 1);
}

/// A prompt member the parse kept as a whole value (it is also a key field's first key).
pub(crate) fn of_value(value: &serde_json::Value) -> PartValue<'static> {
    match value {
        serde_json::Value::Array(items) => PartValue::Written(
            items
                .iter()
                .map(|v| serde_json::to_string(v).unwrap_or_default())
                .collect(),
        ),
        serde_json::Value::String(s) => PartValue::Text(Cow::Owned(s.clone())),
        _ => PartValue::Other,
    }
}

// === the items of an array ===

/// Bytes of spans an array's [`Items`] keep however densely its items and members stand.
const SPAN_SLACK: usize = 4096;

/// Past [`SPAN_SLACK`], the [`Items`] of an array keep a byte of spans for at most this many
/// bytes of the body they have read: an item's members past that are not kept (the item is
/// kept whole), nor the items after it (they are cut from the body as the chain reads them),
/// so that no shape of array costs more than a part of its size. Messages of a few hundred
/// bytes take about a third of theirs.
const SPAN_DENSITY: usize = 2;

/// A prompt array's items, as raw JSON in the body: an object item member by member and an
/// array item element by element, as the parse met them, so that the chain writes their
/// strings as they stand without looking for where they end; any other item whole. What they
/// keep is bounded by the bytes they take (see [`SPAN_DENSITY`]): past it, an item is kept
/// whole, and the items after it as one span of the body.
#[derive(Debug, Default)]
pub(crate) struct Items<'de> {
    /// The body the items are spans of.
    body: &'de [u8],
    items: Vec<Item>,
    /// The members of the object items (raw key, raw value) and the elements of the array
    /// items (no key), one item after another.
    members: Vec<(Span, Span)>,
    /// Whether what they keep is bounded (not in the tests' reference parse).
    bounded: bool,
    /// Where in `body` the first span read starts, and where the last ends.
    from: Option<usize>,
    to: usize,
    /// The spans reached their bound (or the body is too long for a [`Span`]): the items
    /// after go to `rest`.
    full: bool,
    /// The items after those kept: where in `body` the first starts and the last ends, and
    /// how many there are.
    rest: (usize, usize, usize),
}

/// Where a raw value stands in the body.
#[derive(Clone, Copy, Debug, Default)]
struct Span {
    at: u32,
    len: u32,
}

#[derive(Debug)]
enum Item {
    /// The item's raw JSON.
    Whole(Span),
    /// An object: these `members`.
    Object(u32, u32),
    /// An array: these `members`, the elements.
    Array(u32, u32),
}

impl<'de> Items<'de> {
    /// The items of an array in `body`; with `bounded`, keeping spans within [`SPAN_DENSITY`].
    pub(crate) fn new(body: &'de [u8], bounded: bool) -> Self {
        Items {
            body,
            bounded,
            // Spans are 32-bit: the items of a longer body are all cut from it.
            full: u32::try_from(body.len()).is_err(),
            ..Items::default()
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.items.len() + self.rest.2
    }

    /// Whether the items read from now on go to [`push_rest`](Self::push_rest).
    pub(crate) fn full(&self) -> bool {
        self.full
    }

    /// Where `raw` (borrowed from the body) starts in the body.
    fn offset(&self, raw: &str) -> usize {
        (raw.as_ptr() as usize).wrapping_sub(self.body.as_ptr() as usize)
    }

    /// The span of `raw`, noted as read.
    fn read(&mut self, raw: &str) -> Span {
        let at = self.offset(raw);
        self.from.get_or_insert(at);
        self.to = at + raw.len();
        Span {
            at: at as u32,
            len: raw.len() as u32,
        }
    }

    /// The raw JSON of `item`, if it is kept whole.
    fn whole(&self, item: &Item) -> Option<&'de [u8]> {
        match *item {
            Item::Whole(span) => Some(self.text(span)),
            _ => None,
        }
    }

    /// The bytes of `span`.
    fn text(&self, span: Span) -> &'de [u8] {
        let at = span.at as usize;
        &self.body[at..at + span.len as usize]
    }

    /// Whether the spans kept are past their bound for the bytes read.
    fn over(&self) -> bool {
        let used = self.items.len() * std::mem::size_of::<Item>()
            + self.members.len() * std::mem::size_of::<(Span, Span)>();
        let read = self.to.saturating_sub(self.from.unwrap_or(self.to));
        self.bounded && used > SPAN_SLACK + read / SPAN_DENSITY
    }

    pub(crate) fn push_whole(&mut self, raw: &'de str) {
        let span = self.read(raw);
        self.items.push(Item::Whole(span));
        self.full = self.over();
    }

    /// An item read after the spans reached their bound.
    pub(crate) fn push_rest(&mut self, raw: &'de str) {
        let at = self.offset(raw);
        if self.rest.2 == 0 {
            self.rest.0 = at;
        }
        self.rest.1 = at + raw.len();
        self.rest.2 += 1;
    }

    /// Starts an object or an array item; its members follow with [`push_member`](Self::push_member).
    pub(crate) fn start(&mut self) -> usize {
        self.members.len()
    }

    /// Keeps a member of the current item (`key` empty for an element); `false` if that takes
    /// the spans past their bound, and the item is then to be kept whole
    /// ([`first_member`](Self::first_member)).
    pub(crate) fn push_member(&mut self, key: &'de str, value: &'de str) -> bool {
        let key = match key.is_empty() {
            true => Span::default(),
            false => Span {
                at: self.offset(key) as u32,
                len: key.len() as u32,
            },
        };
        let value = self.read(value);
        self.members.push((key, value));
        !self.over()
    }

    /// The item begun at `start` is to be kept whole: its members are let go, and where the
    /// first (its key, or the first element) stands returned, for [`end_whole`](Self::end_whole).
    pub(crate) fn first_member(&mut self, start: usize) -> Option<usize> {
        let first =
            (self.members.get(start)).map(|&(k, v)| if k.len == 0 { v.at } else { k.at } as usize);
        self.members.truncate(start);
        first
    }

    /// Notes a member of an item to be kept whole.
    pub(crate) fn skip_member(&mut self, value: &'de str) {
        self.read(value);
    }

    pub(crate) fn end_object(&mut self, start: usize) {
        let item = Item::Object(start as u32, self.members.len() as u32);
        self.items.push(item);
        self.full = self.over();
    }

    pub(crate) fn end_array(&mut self, start: usize) {
        let item = Item::Array(start as u32, self.members.len() as u32);
        self.items.push(item);
        self.full = self.over();
    }

    /// Ends an item kept whole whose first member (its key, or its first element) stands at
    /// `first`: its span runs from the bracket before that to the bracket after the last
    /// value read.
    pub(crate) fn end_whole(&mut self, first: usize) {
        let body = self.body;
        let mut open = first;
        while open > 0 && is_space(body[open - 1]) {
            open -= 1;
        }
        let open = open.saturating_sub(1);
        let close = skip_space(body, self.to) + 1;
        let span = Span {
            at: open as u32,
            len: close.min(body.len()).saturating_sub(open) as u32,
        };
        self.items.push(Item::Whole(span));
        self.full = self.over();
    }

    /// The items after those kept, cut from their span.
    fn rest(&self) -> impl Iterator<Item = &'de [u8]> + '_ {
        let (start, end, count) = self.rest;
        let raw: &'de [u8] = self.body.get(start..end).unwrap_or_default();
        let mut at = 0;
        (0..count).map(move |_| {
            let item = skip_space(raw, at);
            let end = value_end(raw, item);
            // Past the comma after the item.
            at = skip_space(raw, end) + 1;
            &raw[item..end]
        })
    }

    /// The members of an object or array item.
    fn members(&self, start: u32, end: u32) -> &[(Span, Span)] {
        &self.members[start as usize..end as usize]
    }

    /// At least the bytes [`write_json`](Self::write_json) writes for item `index`, and
    /// about as many: its raw text's length, or its members' and their punctuation's.
    pub(crate) fn json_len(&self, index: usize) -> usize {
        match self.items.get(index) {
            Some(&Item::Whole(raw)) => raw.len as usize,
            Some(&(Item::Object(start, end) | Item::Array(start, end))) => {
                let members = self.members(start, end).iter();
                members.fold(2, |n, (k, v)| n + k.len as usize + v.len as usize + 2)
            }
            None => self
                .rest()
                .nth(index - self.items.len())
                .map_or(0, <[u8]>::len),
        }
    }

    /// Writes item `index` as JSON: its raw text, or its members' without the whitespace
    /// between them.
    pub(crate) fn write_json(&self, index: usize, out: &mut Vec<u8>) {
        let (start, end, open, close) = match self.items.get(index) {
            Some(&Item::Whole(raw)) => return out.extend_from_slice(self.text(raw)),
            Some(&Item::Object(start, end)) => (start, end, b'{', b'}'),
            Some(&Item::Array(start, end)) => (start, end, b'[', b']'),
            None => {
                if let Some(raw) = self.rest().nth(index - self.items.len()) {
                    out.extend_from_slice(raw);
                }
                return;
            }
        };
        out.push(open);
        for (i, &(key, value)) in self.members(start, end).iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            if open == b'{' {
                out.extend_from_slice(self.text(key));
                out.push(b':');
            }
            out.extend_from_slice(self.text(value));
        }
        out.push(close);
    }

    /// Feeds the canonical form of `item` to `chain`: the same bytes as [`canonical`] of the
    /// item's raw JSON.
    fn canonical(&self, item: &Item, chain: &mut impl Feed) -> Result<(), TooDeep> {
        let mut out = Out::new(chain);
        match *item {
            Item::Whole(raw) => canonical_into(self.text(raw), 0, &mut out)?,
            Item::Object(start, end) => {
                out.put(b"{");
                let mut first = true;
                for &(key, value) in self.members(start, end) {
                    let key = self.text(key);
                    if key == CACHE_CONTROL {
                        continue;
                    }
                    if !std::mem::take(&mut first) {
                        out.put(b",");
                    }
                    // A key is a string token as any other, as the whole item's path has it.
                    out.put_string(key);
                    out.put(b":");
                    let value = self.text(value);
                    match one_text_part(key, value) {
                        Some(text) => out.put_string(text),
                        None => member(value, &mut out)?,
                    }
                }
                out.put(b"}");
            }
            Item::Array(start, end) => {
                out.put(b"[");
                for (i, &(_, value)) in self.members(start, end).iter().enumerate() {
                    if i > 0 {
                        out.put(b",");
                    }
                    member(self.text(value), &mut out)?;
                }
                out.put(b"]");
            }
        }
        out.flush();
        Ok(())
    }
}

/// Feeds the canonical form of a member of an item (one level down): a string or a scalar
/// stands as it is.
fn member<F: Feed>(raw: &[u8], out: &mut Out<'_, F>) -> Result<(), TooDeep> {
    match raw.first() {
        Some(b'{' | b'[') => canonical_into(raw, 1, out),
        Some(b'"') => {
            out.put_string(raw);
            Ok(())
        }
        _ => {
            out.put(raw);
            Ok(())
        }
    }
}

// === what clients change and servers see through, and payloads ===

const CONTENT: &[u8] = b"\"content\"";

/// The text of `value` (raw JSON), if `key` is `"content"` and `value` is an array of one
/// text part: an object of `type` `"text"` (or `"input_text"`, `"output_text"`), `text` a
/// string, and nothing else but a `cache_control` mark. The text is returned as its raw
/// string token, quotes and all.
fn one_text_part<'a>(key: &[u8], value: &'a [u8]) -> Option<&'a [u8]> {
    if key != CONTENT || value.first() != Some(&b'[') {
        return None;
    }
    let mut i = skip_space(value, 1);
    if value.get(i) != Some(&b'{') {
        return None;
    }
    let (mut kind, mut text) = (None, None);
    loop {
        i = skip_space(value, i + 1);
        if value.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(value, i);
        let key = value.get(i..key_end)?;
        let colon = skip_space(value, key_end);
        if value.get(colon) != Some(&b':') {
            return None;
        }
        let start = skip_space(value, colon + 1);
        let end = value_end(value, start);
        let member = value.get(start..end)?;
        match key {
            b"\"type\"" => kind = Some(member),
            b"\"text\"" if member.first() == Some(&b'"') => text = Some(member),
            _ if key == CACHE_CONTROL => {}
            _ => return None,
        }
        i = skip_space(value, end);
        match value.get(i) {
            Some(b',') => continue,
            Some(b'}') => break,
            _ => return None,
        }
    }
    let rest = skip_space(value, i + 1);
    let closed = value.get(rest) == Some(&b']') && skip_space(value, rest + 1) == value.len();
    let text_kind = matches!(kind?, b"\"text\"" | b"\"input_text\"" | b"\"output_text\"");
    (closed && text_kind).then_some(text?)
}

/// How Claude Code opens its system prompt: `x-anthropic-billing-header: cc_version=...;
/// cc_entrypoint=...; cch=XXXXX;`, the `cch` value new with every request.
const BILLING_HEADER: &[u8] = b"x-anthropic-billing-header:";

/// Where the `cch` value stands in `text` (a string's content), if `text` is Claude Code's
/// billing line: left out of the digest, as llama-server leaves it out of its comparison of
/// prompts, or no turn would share more than the tools with the turn before.
fn billing_nonce(text: &[u8]) -> Option<Range<usize>> {
    if !text.starts_with(BILLING_HEADER) {
        return None;
    }
    let line = &text[..text.len().min(512)];
    let at = memchr::memmem::find(line, b"cch=")? + 4;
    let len = text[at..]
        .iter()
        .take_while(|b| b.is_ascii_alphanumeric())
        .count();
    Some(at..at + len)
}

/// Bytes a string reaches before it may be taken for an encoded payload.
const OPAQUE_MIN_BYTES: usize = 1024;

/// The most tokens an encoded payload is counted at: about what a vision model reads an image
/// as (a few hundred to a few thousand tokens, by the model and the image's size), far less
/// than its encoding's bytes.
pub(crate) const OPAQUE_TOKENS: u64 = 1024;

/// The tokens to count `text` (a string's content, raw or decoded) at, if it is an encoded
/// payload: base64 (or base64url) from its start, or a `data:` URI. Only the first 256 bytes
/// of the payload are looked at: nothing but the alphabet (a `\` only as JSON's escape of
/// `/`), and letters of both cases, which numbers, hex and words run together lack. The
/// alphabet may be broken into lines, as MIME and PEM encoders write it: line breaks (raw or
/// JSON-escaped, `\n` or `\r\n`) after lines of one length, at least
/// [`OPAQUE_MIN_LINE`] bytes long.
fn opaque_tokens(text: &[u8]) -> Option<u64> {
    if text.len() < OPAQUE_MIN_BYTES {
        return None;
    }
    let payload = match text.strip_prefix(b"data:") {
        Some(uri) => {
            let comma = memchr::memchr(b',', &uri[..uri.len().min(128)])?;
            &uri[comma + 1..]
        }
        None => text,
    };
    let probe = &payload[..payload.len().min(256)];
    let (mut line, mut width, mut chars) = (0, None, 0);
    let (mut upper, mut lower) = (false, false);
    let mut i = 0;
    while i < probe.len() {
        let (step, breaks) = match (probe[i], probe.get(i + 1)) {
            (b'\\', Some(b'/')) => (2, false),
            (b'\\', Some(b'n' | b'r')) => (2, true),
            (b'\n' | b'\r', _) => (1, true),
            (b, _)
                if b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'=' | b'-' | b'_') =>
            {
                (1, false)
            }
            _ => return None,
        };
        if !breaks {
            (line, chars) = (line + 1, chars + 1);
            upper |= probe[i].is_ascii_uppercase();
            lower |= probe[i].is_ascii_lowercase();
        } else if line > 0 {
            // The first line sets the width; every later one that the probe holds whole
            // keeps it (a `\r\n` ends one line, not two).
            match width {
                None if line >= OPAQUE_MIN_LINE => width = Some(line),
                Some(w) if w == line => {}
                _ => return None,
            }
            line = 0;
        }
        i += step;
    }
    if width.is_some_and(|w| line > w) {
        return None;
    }
    (chars >= 64 && upper && lower).then(|| (text.len() as u64).div_ceil(4).min(OPAQUE_TOKENS))
}

/// The shortest line of an encoded payload broken into lines: PEM writes 64 bytes a line,
/// MIME 76.
const OPAQUE_MIN_LINE: usize = 60;

// === the canonical form ===

const CACHE_CONTROL: &[u8] = b"\"cache_control\"";

/// Where the canonical bytes go.
trait Feed {
    fn feed(&mut self, bytes: &[u8]);

    /// Bytes counted as `tokens` tokens (see [`ChainBuilder::feed_opaque`]).
    fn feed_opaque(&mut self, bytes: &[u8], tokens: u64) {
        let _ = tokens;
        self.feed(bytes);
    }
}

impl Feed for ChainBuilder {
    fn feed(&mut self, bytes: &[u8]) {
        ChainBuilder::feed(self, bytes);
    }

    fn feed_opaque(&mut self, bytes: &[u8], tokens: u64) {
        ChainBuilder::feed_opaque(self, bytes, tokens);
    }
}

impl Feed for Vec<u8> {
    fn feed(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Tokens are gathered here and fed in runs; long strings are fed as they stand.
struct Out<'a, F> {
    chain: &'a mut F,
    buf: [u8; 256],
    len: usize,
}

impl<'a, F: Feed> Out<'a, F> {
    fn new(chain: &'a mut F) -> Self {
        Out {
            chain,
            buf: [0; 256],
            len: 0,
        }
    }

    fn put(&mut self, bytes: &[u8]) {
        if self.len + bytes.len() > self.buf.len() || bytes.len() > 64 {
            self.flush();
            if bytes.len() > 64 {
                self.chain.feed(bytes);
                return;
            }
        }
        self.buf[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }

    fn flush(&mut self) {
        self.chain.feed(&self.buf[..self.len]);
        self.len = 0;
    }

    /// Puts a string token, quotes and all: a billing line without its nonce, a payload
    /// counted as one.
    fn put_string(&mut self, raw: &[u8]) {
        let Some(text) = raw.get(1..raw.len().saturating_sub(1)) else {
            return self.put(raw);
        };
        if let Some(nonce) = billing_nonce(text) {
            self.put(&raw[..nonce.start + 1]);
            self.put(&raw[nonce.end + 1..]);
        } else if let Some(tokens) = opaque_tokens(text) {
            self.flush();
            self.chain.feed_opaque(raw, tokens);
        } else {
            self.put(raw);
        }
    }
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

fn skip_space(raw: &[u8], mut i: usize) -> usize {
    while raw.get(i).is_some_and(|&b| is_space(b)) {
        i += 1;
    }
    i
}

/// The index just past the string that starts (with its quote) at `i`: the next quote that
/// an odd run of backslashes does not escape.
fn string_end(raw: &[u8], i: usize) -> usize {
    let mut j = i + 1;
    while let Some(at) = raw.get(j..).and_then(|r| memchr::memchr(b'"', r)) {
        let quote = j + at;
        let backslashes = raw[j..quote]
            .iter()
            .rev()
            .take_while(|&&b| b == b'\\')
            .count();
        if backslashes % 2 == 0 {
            return quote + 1;
        }
        j = quote + 1;
    }
    raw.len()
}

/// The index just past a number, `true`, `false` or `null` starting at `i`.
fn scalar_end(raw: &[u8], mut i: usize) -> usize {
    while raw
        .get(i)
        .is_some_and(|&b| !matches!(b, b',' | b'}' | b']' | b':') && !is_space(b))
    {
        i += 1;
    }
    i
}

/// The index just past the value starting at `i`.
fn value_end(raw: &[u8], i: usize) -> usize {
    match raw.get(i) {
        Some(b'"') => string_end(raw, i),
        Some(b'{' | b'[') => {
            let mut depth = 0usize;
            let mut j = i;
            while let Some(&b) = raw.get(j) {
                match b {
                    b'"' => {
                        j = string_end(raw, j);
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return j + 1;
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            raw.len()
        }
        _ => scalar_end(raw, i),
    }
}

/// How deep an item of a top-level array may nest: `serde_json::Value` parses 128 levels, two
/// of which are the body's object and the array.
const MAX_DEPTH: usize = 126;

/// An item nests deeper than [`MAX_DEPTH`].
#[derive(Debug)]
struct TooDeep;

/// Feeds the canonical form of one JSON value (already checked by the parse) to `chain`.
fn canonical(raw: &[u8], chain: &mut impl Feed) -> Result<(), TooDeep> {
    let mut out = Out::new(chain);
    canonical_into(raw, 0, &mut out)?;
    out.flush();
    Ok(())
}

/// Puts the canonical form of one JSON value that starts `depth` levels down in an item.
fn canonical_into<F: Feed>(
    raw: &[u8],
    mut depth: usize,
    out: &mut Out<'_, F>,
) -> Result<(), TooDeep> {
    // A comma seen and not yet written: it is written before the next token, unless the
    // member after it is dropped.
    let mut comma = false;
    // The member just dropped was the first of its object: the comma after it goes too.
    let mut drop_comma = false;
    let mut i = 0;
    while let Some(&b) = raw.get(i) {
        match b {
            _ if is_space(b) => i += 1,
            b',' => {
                comma = !std::mem::take(&mut drop_comma);
                i += 1;
            }
            b'"' => {
                let end = string_end(raw, i);
                let key_of_dropped = raw.get(i..end) == Some(CACHE_CONTROL) && {
                    let colon = skip_space(raw, end);
                    raw.get(colon) == Some(&b':')
                };
                if key_of_dropped {
                    let value = skip_space(raw, skip_space(raw, end) + 1);
                    i = value_end(raw, value);
                    if !std::mem::take(&mut comma) {
                        drop_comma = true;
                    }
                    continue;
                }
                if std::mem::take(&mut comma) {
                    out.put(b",");
                }
                out.put_string(&raw[i..end]);
                // A message's `content` as one text part: the text it holds, as the member
                // path writes it.
                if depth == 1 {
                    let colon = skip_space(raw, end);
                    let value = skip_space(raw, colon + 1);
                    if raw.get(colon) == Some(&b':') && raw.get(value) == Some(&b'[') {
                        let value_end = value_end(raw, value);
                        if let Some(text) = one_text_part(&raw[i..end], &raw[value..value_end]) {
                            out.put(b":");
                            out.put_string(text);
                            i = value_end;
                            continue;
                        }
                    }
                }
                i = end;
            }
            b'{' | b'[' | b'}' | b']' | b':' => {
                if std::mem::take(&mut comma) && !matches!(b, b'}' | b']') {
                    out.put(b",");
                }
                match b {
                    b'{' | b'[' => {
                        depth += 1;
                        if depth > MAX_DEPTH {
                            return Err(TooDeep);
                        }
                    }
                    b'}' | b']' => depth = depth.saturating_sub(1),
                    _ => {}
                }
                drop_comma = false;
                out.put(&[b]);
                i += 1;
            }
            _ => {
                let end = scalar_end(raw, i).max(i + 1);
                if std::mem::take(&mut comma) {
                    out.put(b",");
                }
                out.put(&raw[i..end.min(raw.len())]);
                i = end;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(json: &str) -> String {
        let mut got = Vec::new();
        canonical(json.as_bytes(), &mut got).unwrap();
        String::from_utf8(got).unwrap()
    }

    #[test]
    fn whitespace_between_tokens_goes_and_strings_stay() {
        assert_eq!(
            canon(
                r#" { "role" : "user",  "content" : "a  b\n\"c\"" , "n": [1, 2.5e3 , true, null] } "#
            ),
            r#"{"role":"user","content":"a  b\n\"c\"","n":[1,2.5e3,true,null]}"#
        );
    }

    #[test]
    fn cache_control_members_are_dropped_wherever_they_stand() {
        let bare = r#"{"type":"text","text":"hi"}"#;
        for marked in [
            r#"{"type":"text","text":"hi","cache_control":{"type":"ephemeral"}}"#,
            r#"{"cache_control":{"type":"ephemeral"},"type":"text","text":"hi"}"#,
            r#"{"type":"text", "cache_control" : {"type":"ephemeral", "ttl":"5m"} ,"text":"hi"}"#,
        ] {
            assert_eq!(canon(marked), bare, "{marked}");
        }
        assert_eq!(canon(r#"{"cache_control":{}}"#), "{}");
        // Only a member named so: the same text as a value stays.
        assert_eq!(
            canon(r#"["cache_control",{"k":"cache_control"}]"#),
            r#"["cache_control",{"k":"cache_control"}]"#
        );
    }

    #[test]
    fn nested_markers_go_too() {
        assert_eq!(
            canon(
                r#"{"content":[{"type":"text","text":"a","cache_control":{"type":"ephemeral"}},{"type":"text","text":"b"}]}"#
            ),
            r#"{"content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}"#
        );
    }

    #[test]
    fn truncated_input_does_not_panic() {
        for bad in [
            r#"{"a":"#,
            r#""abc"#,
            r#"{"cache_control":"#,
            r#"[1,"#,
            "\\",
            "}",
        ] {
            let _ = canonical(bad.as_bytes(), &mut Vec::new());
        }
    }

    #[test]
    fn items_nest_as_deep_as_a_value_parses() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(canonical(deep(MAX_DEPTH).as_bytes(), &mut Vec::new()).is_ok());
        assert!(canonical(deep(MAX_DEPTH + 1).as_bytes(), &mut Vec::new()).is_err());
    }
}
