//! What a body says: the pass over a JSON body that finds the session key, the leading
//! messages and the prompt's members, and the layer's settings that steer it.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::leading::LeadingMessages;
use super::prompt::{self, Items, Part, PartValue, PromptMembers};
use super::responses::StoredResponses;
use super::PromptFacts;
use crate::key::{HeaderKey, SessionKey};
use crate::slots::NamedSlot;

// === config ===

#[derive(Clone, Debug)]
pub(crate) struct Config {
    /// Each field as its path of object keys (`metadata.user_id` is `["metadata", "user_id"]`).
    fields: Vec<Vec<String>>,
    /// The distinct first keys of `fields`: the top-level values the parse looks into for a key.
    tops: Vec<String>,
    pub(crate) limit: usize,
    pub(crate) read_timeout: Option<Duration>,
    /// The body is left unread when these headers carry a key.
    pub(crate) skip_when: Option<HeaderKey>,
    /// The latest Responses API answers, for `previous_response_id`.
    pub(crate) responses: Arc<StoredResponses>,
    /// Whether a request naming a stored response is sent to the backend that answered it.
    pub(crate) pin_stored_responses: bool,
    /// Whether a stream that did not ask for its usage is asked for it on its behalf.
    pub(crate) ask_stream_usage: bool,
}

impl Config {
    pub(crate) fn new(limit: usize) -> Self {
        Config {
            fields: Vec::new(),
            tops: Vec::new(),
            limit,
            read_timeout: None,
            skip_when: None,
            responses: Arc::new(StoredResponses::new(
                StoredResponses::DEFAULT_CAPACITY,
                StoredResponses::DEFAULT_MAX_LINKS,
            )),
            pin_stored_responses: true,
            ask_stream_usage: false,
        }
    }

    pub(crate) fn set_fields(&mut self, fields: Vec<Vec<String>>) {
        let mut tops: Vec<String> = Vec::new();
        for first in fields.iter().filter_map(|path| path.first()) {
            if !tops.contains(first) {
                tops.push(first.clone());
            }
        }
        self.fields = fields;
        self.tops = tops;
    }

    /// Whether the body is read at all: not when a header already names the session, but for
    /// a Responses API request while stored responses are pinned. Its body may name a stored
    /// response that only the backend that answered it can continue, and its answer's id is
    /// what later requests name: the key in a header says neither. `responses`: whether the
    /// request is one to the Responses API.
    pub(crate) fn reads(&self, headers: &http::HeaderMap, responses: bool) -> bool {
        (self.skip_when.as_ref()).is_none_or(|header| !header.finds_key(headers))
            || (self.pin_stored_responses && responses)
    }

    /// What a body says about its session and its prompt.
    ///
    /// One pass over the body that keeps only what it needs: the string or number at the end
    /// of each key field's path, and the prompt's members (arrays as their items' raw JSON, an
    /// object item member by member, strings as their text; what an array keeps bounded by
    /// the bytes it takes); everything else is checked and skipped without being built. A
    /// body is taken as JSON exactly when it parses as a
    /// [`serde_json::Value`] after the byte order mark it may open with, which llama-server
    /// skips too (the same checks of strings and numbers, the same nesting limit),
    /// but inside the items of the prompt's arrays, which are checked as serde's raw values
    /// are: a lone surrogate's escape or a number past `f64`'s range is taken there.
    pub(crate) fn inspect(&self, body: &[u8]) -> (Option<SessionKey>, PromptFacts) {
        let i = self.inspect_with(body, true, true);
        (i.key, i.facts)
    }

    /// [`inspect`](Self::inspect), also saying what the layer does with the request besides:
    /// whether it asks to be streamed without asking for its usage, and whether it names a
    /// previous response.
    pub(crate) fn inspect_request(&self, body: &[u8]) -> Inspected {
        self.inspect_with(body, true, true)
    }

    /// [`inspect`](Self::inspect), with the items of the prompt's arrays always read whole,
    /// and every one of them kept, however many: the reference the member-by-member reading,
    /// and the bound on what it keeps, are held to.
    #[cfg(test)]
    pub(crate) fn inspect_whole(&self, body: &[u8]) -> (Option<SessionKey>, PromptFacts) {
        let i = self.inspect_with(body, false, false);
        (i.key, i.facts)
    }

    fn inspect_with(&self, body: &[u8], walk: bool, bounded: bool) -> Inspected {
        let mut out = Inspected {
            key: None,
            facts: PromptFacts {
                body_bytes: body.len(),
                messages: 0,
                chain: Default::default(),
                stored_on: None,
                leading: None,
                model: None,
                named_slot: NamedSlot::Absent,
            },
            streams_unasked: false,
            continues: None,
            unstored: false,
        };
        // llama-server skips a byte order mark at the start of a body: the object after it
        // is the request it runs.
        let body = crate::slots::after_bom(body);
        // Most bodies that are not a JSON object are spotted without running the parser.
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return out;
        }
        // Items are read member by member where they can be; a body that parse refuses is
        // read again with its items whole, which takes exactly the bodies it took before.
        let found = match parse(body, self, walk, bounded) {
            Ok(found) => found,
            Err(_) if walk => parse(body, self, false, bounded).ok().flatten(),
            Err(_) => None,
        };
        let Some(found) = found else {
            return out;
        };
        out.facts.model = found.model.map(Arc::from);
        out.facts.named_slot = found.named_slot;
        out.streams_unasked = found.stream == Some(true) && !found.stream_options;
        out.unstored = found.store == Some(false);
        let previous = found.previous.as_deref().filter(|id| !id.is_empty());
        out.continues = previous.map(|id| super::responses::digest(id.as_bytes()));
        // A response not remembered (another router process answered it, or it was
        // forgotten) leaves the prompt unknown: its chain stays empty, as does that of a
        // response that itself continued one not remembered.
        let stored = previous.map(|id| self.responses.get(id).unwrap_or_default());
        let base = stored.as_ref().map(|s| s.chain.as_ref());
        let Some(chain) = found.prompt.chain(base.flatten()) else {
            return out;
        };
        let facts = &mut out.facts;
        if base.is_none_or(|b| b.is_some()) {
            facts.chain = chain;
        }
        if self.pin_stored_responses {
            facts.stored_on = stored.and_then(|s| s.backend);
        }
        match found.prompt.get(Part::Messages) {
            PartValue::Items(items) => {
                facts.messages = items.len();
                facts.leading = LeadingMessages::new(items.len(), |i, out| {
                    // The text is a copy of up to the whole body: sized before it is
                    // written, rather than grown to twice its size.
                    if i == 0 {
                        let first = items.len().min(PromptFacts::LEADING_MESSAGES);
                        out.reserve_exact((0..first).map(|i| items.json_len(i)).sum());
                    }
                    items.write_json(i, out)
                });
            }
            PartValue::Written(items) => {
                facts.messages = items.len();
                facts.leading = LeadingMessages::new(items.len(), |i, out| {
                    out.extend_from_slice(items[i].as_bytes())
                });
            }
            _ => {}
        }
        out.key = found.keys.into_iter().flatten().next();
        out
    }
}

/// What a body says, and what the layer does with the request because of it.
#[derive(Debug)]
pub(crate) struct Inspected {
    pub(crate) key: Option<SessionKey>,
    pub(crate) facts: PromptFacts,
    /// The body asks to be streamed (a top-level `"stream": true`) without saying anything
    /// of `stream_options`.
    pub(crate) streams_unasked: bool,
    /// The digest of the previous response it names (`previous_response_id`), if any.
    pub(crate) continues: Option<u64>,
    /// It asks that its answer not be stored (`"store": false`, as the Codex CLI sends): no
    /// later request can name that answer as its previous response.
    pub(crate) unstored: bool,
}

/// One pass over `body`: what it holds, `None` if there is more after the object, an error if
/// it is not JSON. With `walk`, the items of the prompt's arrays (but `prompt`'s) are read
/// member by member, which refuses an item that is neither an object nor an array.
fn parse<'de>(
    body: &'de [u8],
    config: &Config,
    walk: bool,
    bounded: bool,
) -> Result<Option<Found<'de>>, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let found = de.deserialize_map(TopLevel {
        fields: &config.fields,
        tops: &config.tops,
        seed: KeptSeed {
            walk,
            body,
            bounded,
        },
    })?;
    Ok(de.end().is_ok().then_some(found))
}

/// The key at `path` below `value`: a non-blank string (trimmed) or a number (its JSON text).
pub(crate) fn key_at(value: &Value, path: &[String]) -> Option<SessionKey> {
    let mut value = value;
    for name in path {
        value = value.as_object()?.get(name)?;
    }
    match value {
        Value::String(s) => key_of_str(s),
        Value::Number(n) => key_of_number(n),
        _ => None,
    }
}

/// The facts of a body left unread (see [`Config::reads`]) that names its own slot: its
/// top-level `id_slot` and its size, and nothing else (no chain, no model). `None` if it has
/// no top-level `id_slot` or is no JSON object (a leading byte order mark aside, which
/// llama-server skips too). Only a body that may name `id_slot` is parsed
/// (its top level, other values skipped); any other costs a search of its bytes.
pub(crate) fn unread_facts(body: &[u8]) -> Option<PromptFacts> {
    if !crate::slots::may_name_id_slot(body) {
        return None;
    }
    let TopIdSlot(named_slot) = serde_json::from_slice(crate::slots::after_bom(body)).ok()?;
    (named_slot != NamedSlot::Absent).then(|| PromptFacts {
        body_bytes: body.len(),
        messages: 0,
        chain: Default::default(),
        stored_on: None,
        leading: None,
        model: None,
        named_slot,
    })
}

/// A JSON object's top-level `id_slot` (the last one given), its other values skipped.
struct TopIdSlot(NamedSlot);

impl<'de> Deserialize<'de> for TopIdSlot {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(TopIdSlotVisitor)
    }
}

struct TopIdSlotVisitor;

impl<'de> Visitor<'de> for TopIdSlotVisitor {
    type Value = TopIdSlot;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TopIdSlot, A::Error> {
        let mut named = NamedSlot::Absent;
        // Keys come unescaped; a body reaches here only when it may name `id_slot`.
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if key == "id_slot" {
                named = map.next_value::<Scalar>()?.slot();
            } else {
                map.next_value::<Skip>()?;
            }
        }
        Ok(TopIdSlot(named))
    }
}

/// The slot an `id_slot` value names: a non-negative integer's, else none.
fn named_slot_of(value: &Value) -> NamedSlot {
    value.as_u64().map_or(NamedSlot::Other, NamedSlot::Slot)
}

/// The key a string names: its text trimmed, unless blank.
fn key_of_str(s: &str) -> Option<SessionKey> {
    let trimmed = s.trim_ascii();
    (!trimmed.is_empty()).then(|| SessionKey::from_bytes(trimmed.as_bytes()))
}

/// The key a number names: its JSON text as `Value` writes it.
fn key_of_number(n: &serde_json::Number) -> Option<SessionKey> {
    Some(SessionKey::from_bytes(n.to_string().as_bytes()))
}

// === the parse ===

/// What the top-level object holds that [`Config::inspect`] needs.
#[derive(Default)]
struct Found<'de> {
    /// The key each field names (by its index in `Config::fields`), if any. A member given
    /// twice counts as its last value, as in a parsed `Value`.
    keys: Vec<Option<SessionKey>>,
    /// The prompt's members.
    prompt: PromptMembers<'de>,
    /// The Responses API's `previous_response_id`, if it is a string.
    previous: Option<Cow<'de, str>>,
    /// `model`, if it is a string (the last one given).
    model: Option<Cow<'de, str>>,
    /// `stream`, if it is a boolean (the last one given).
    stream: Option<bool>,
    /// Whether `stream_options` is given at all.
    stream_options: bool,
    /// `store`, if it is a boolean (the last one given).
    store: Option<bool>,
    /// `id_slot`, if given (the last one given).
    named_slot: NamedSlot,
}

/// Whether the layer reads the top-level member `name` for itself: a key field starting with
/// it leaves it read all the same. (`model` is not one: a key field starting with it reads it
/// as a key only, as [`PromptFacts::model`] says.)
fn read_for_itself(name: &str) -> bool {
    matches!(
        name,
        "id_slot" | "previous_response_id" | "stream" | "stream_options" | "store"
    )
}

impl Found<'_> {
    /// Reads `value` as the member `name` the layer reads for itself, as the parse of that
    /// member alone reads it.
    fn set_own(&mut self, name: &str, value: &Value) {
        match name {
            "id_slot" => self.named_slot = named_slot_of(value),
            "previous_response_id" => {
                self.previous = value.as_str().map(|s| Cow::Owned(s.to_owned()));
            }
            "stream" => self.stream = value.as_bool(),
            "stream_options" => self.stream_options = true,
            "store" => self.store = value.as_bool(),
            _ => {}
        }
    }
}

/// The top-level object: keeps the members named in `tops` and the prompt's members, skips
/// the rest.
struct TopLevel<'a, 'de> {
    fields: &'a [Vec<String>],
    tops: &'a [String],
    /// How prompt arrays' items are read.
    seed: KeptSeed<'de>,
}

impl<'de> Visitor<'de> for TopLevel<'_, 'de> {
    type Value = Found<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found<'de>, A::Error> {
        let mut found = Found {
            keys: vec![None; self.fields.len()],
            ..Found::default()
        };
        while let Some(member) = map.next_key_seed(MemberName { tops: self.tops })? {
            let (top, part) = match member {
                Member::Other => {
                    map.next_value::<Skip>()?;
                    continue;
                }
                Member::Prompt(part) => {
                    // `prompt`'s items are strings or token ids: kept whole.
                    let walk = self.seed.walk && part != Part::Prompt;
                    let seed = KeptSeed { walk, ..self.seed };
                    found.prompt.set(part, map.next_value_seed(seed)?.0);
                    continue;
                }
                Member::Previous | Member::Model => {
                    let seed = KeptSeed {
                        walk: false,
                        ..self.seed
                    };
                    let text = match map.next_value_seed(seed)?.0 {
                        PartValue::Text(text) => Some(text),
                        _ => None,
                    };
                    match member {
                        Member::Previous => found.previous = text,
                        _ => found.model = text,
                    }
                    continue;
                }
                Member::Stream => {
                    found.stream = map.next_value::<Scalar>()?.flag();
                    continue;
                }
                Member::StreamOptions => {
                    map.next_value::<Skip>()?;
                    found.stream_options = true;
                    continue;
                }
                Member::Store => {
                    found.store = map.next_value::<Scalar>()?.flag();
                    continue;
                }
                Member::IdSlot => {
                    found.named_slot = map.next_value::<Scalar>()?.slot();
                    continue;
                }
                Member::Top { index, part } => (index, part),
            };
            // A key field's first key: each field that starts with it, and the rest of its
            // path.
            let first = &self.tops[top];
            let paths: Vec<(usize, &[String])> = (self.fields.iter().enumerate())
                .filter(|(_, path)| path.first() == Some(first))
                .map(|(field, path)| (field, &path[1..]))
                .collect();
            // A prompt member too (a field set so), or a member the layer reads for itself:
            // kept whole, and read as it would be without the field. Else only the string or
            // number at the end of each path is kept: the rest is checked and skipped,
            // nothing built.
            let keys = if part.is_some() || read_for_itself(first) {
                let value: Value = map.next_value()?;
                match part {
                    Some(part) => found.prompt.set(part, prompt::of_value(&value)),
                    None => found.set_own(first, &value),
                }
                let keys = paths
                    .iter()
                    .map(|&(field, rest)| (field, key_at(&value, rest)));
                keys.collect()
            } else {
                map.next_value_seed(KeyAt { paths })?
            };
            for (field, key) in keys {
                found.keys[field] = key;
            }
        }
        Ok(found)
    }
}

/// What a member of the top-level object is to the parse.
enum Member {
    /// The first key of a key field (at this index of `tops`), and the prompt member it also
    /// is, if it is one.
    Top {
        index: usize,
        part: Option<Part>,
    },
    /// A prompt member, not a key field.
    Prompt(Part),
    /// `previous_response_id`, not a key field.
    Previous,
    /// `model`, not a key field.
    Model,
    /// `stream` and `stream_options`, not key fields.
    Stream,
    StreamOptions,
    /// `store`, not a key field.
    Store,
    /// `id_slot`, not a key field.
    IdSlot,
    /// Anything else: skipped.
    Other,
}

/// Classifies a member name without keeping it.
struct MemberName<'a> {
    tops: &'a [String],
}

impl<'de> DeserializeSeed<'de> for MemberName<'_> {
    type Value = Member;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Member, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for MemberName<'_> {
    type Value = Member;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_str<E: de::Error>(self, name: &str) -> Result<Member, E> {
        let part = Part::of_name(name);
        Ok(match (self.tops.iter().position(|t| t == name), part) {
            (Some(index), part) => Member::Top { index, part },
            (None, Some(part)) => Member::Prompt(part),
            (None, None) if name == "previous_response_id" => Member::Previous,
            (None, None) if name == "model" => Member::Model,
            (None, None) if name == "stream" => Member::Stream,
            (None, None) if name == "stream_options" => Member::StreamOptions,
            (None, None) if name == "store" => Member::Store,
            (None, None) if name == "id_slot" => Member::IdSlot,
            (None, None) => Member::Other,
        })
    }
}

/// Visitor methods for the JSON values a visitor takes in and ignores: scalars and, skipped
/// member by member, objects. The depth limit of `serde_json` applies to them all.
macro_rules! ignore_other_values {
    () => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok(Default::default())
        }

        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }

        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }

        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }

        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok(Default::default())
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Default::default())
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<Skip, Skip>()?.is_some() {}
            Ok(Default::default())
        }
    };
}

/// A prompt member as the parse keeps it: an array's items as raw JSON, a string's text.
struct Kept<'de>(PartValue<'de>);

/// Reads a [`Kept`] from `body`; with `walk`, an array's items member by member; with
/// `bounded`, keeping spans within the bound [`Items`] sets.
#[derive(Clone, Copy)]
struct KeptSeed<'de> {
    walk: bool,
    body: &'de [u8],
    bounded: bool,
}

impl<'de> DeserializeSeed<'de> for KeptSeed<'de> {
    type Value = Kept<'de>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Kept<'de>, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for KeptSeed<'de> {
    type Value = Kept<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Kept<'de>, A::Error> {
        let mut items = Items::new(self.body, self.bounded);
        loop {
            let more = if items.full() {
                // Past the bound: the items are only counted, and cut from the body later.
                let item = seq.next_element::<&'de RawValue>()?;
                item.map(|item| items.push_rest(item.get()))
            } else if self.walk {
                seq.next_element_seed(ItemSeed(&mut items))?
            } else {
                let item = seq.next_element::<&'de RawValue>()?;
                item.map(|item| items.push_whole(item.get()))
            };
            if more.is_none() {
                break;
            }
        }
        Ok(Kept(PartValue::Items(items)))
    }

    fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Kept<'de>, E> {
        Ok(Kept(PartValue::Text(Cow::Borrowed(s))))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Kept<'de>, E> {
        Ok(Kept(PartValue::Text(Cow::Owned(s.to_owned()))))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Kept<'de>, E> {
        Ok(Kept::default())
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Kept<'de>, E> {
        Ok(Kept::default())
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Kept<'de>, E> {
        Ok(Kept::default())
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Kept<'de>, E> {
        Ok(Kept::default())
    }

    fn visit_unit<E: de::Error>(self) -> Result<Kept<'de>, E> {
        Ok(Kept::default())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Kept<'de>, A::Error> {
        while map.next_entry::<Skip, Skip>()?.is_some() {}
        Ok(Kept::default())
    }
}

impl Default for Kept<'_> {
    fn default() -> Self {
        Kept(PartValue::Other)
    }
}

/// One item of a prompt array, read member by member into the [`Items`]: an object's members
/// and an array's elements as raw JSON, with the checks of serde's raw values. Any other item
/// is refused (its raw text is not at hand here), and the body read again with items whole.
struct ItemSeed<'a, 'de>(&'a mut Items<'de>);

impl<'de> DeserializeSeed<'de> for ItemSeed<'_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ItemSeed<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object or an array")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let start = self.0.start();
        // Once the item is to be kept whole: its first key.
        let mut whole = None;
        while let Some(key) = map.next_key::<&'de RawValue>()? {
            let value = map.next_value::<&'de RawValue>()?;
            if whole.is_some() {
                self.0.skip_member(value.get());
            } else if !self.0.push_member(key.get(), value.get()) {
                whole = self.0.first_member(start);
            }
        }
        match whole {
            Some(first) => self.0.end_whole(first),
            None => self.0.end_object(start),
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let start = self.0.start();
        // Once the item is to be kept whole: its first element.
        let mut whole = None;
        while let Some(element) = seq.next_element::<&'de RawValue>()? {
            if whole.is_some() {
                self.0.skip_member(element.get());
            } else if !self.0.push_member("", element.get()) {
                whole = self.0.first_member(start);
            }
        }
        match whole {
            Some(first) => self.0.end_whole(first),
            None => self.0.end_array(start),
        }
        Ok(())
    }
}

/// Any JSON value, checked as `serde_json::Value` would be and then forgotten: nothing is
/// built, and strings are borrowed from the body where they have no escapes.
#[derive(Default)]
struct Skip;

impl<'de> Deserialize<'de> for Skip {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(Skip)
    }
}

impl<'de> Visitor<'de> for Skip {
    type Value = Skip;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Skip, A::Error> {
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(Skip)
    }

    ignore_other_values!();
}

/// A member's value kept only if it is a boolean (`stream`'s, `store`'s) or a whole number
/// not below 0 (`id_slot`'s): anything else is checked as [`Skip`] checks it and forgotten,
/// nothing built.
enum Scalar {
    Bool(bool),
    Whole(u64),
    Other,
}

impl Scalar {
    /// The boolean it is, if it is one.
    fn flag(self) -> Option<bool> {
        match self {
            Scalar::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The slot it names as `id_slot`: a whole number's, else none.
    fn slot(self) -> NamedSlot {
        match self {
            Scalar::Whole(n) => NamedSlot::Slot(n),
            _ => NamedSlot::Other,
        }
    }
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ScalarVisitor)
    }
}

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Scalar, E> {
        Ok(Scalar::Bool(b))
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Scalar, E> {
        Ok(Scalar::Whole(n))
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<Scalar, E> {
        Ok(u64::try_from(n).map_or(Scalar::Other, Scalar::Whole))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Scalar, E> {
        Ok(Scalar::Other)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Scalar, E> {
        Ok(Scalar::Other)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Scalar, E> {
        Ok(Scalar::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(Scalar::Other)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
        while map.next_entry::<Skip, Skip>()?.is_some() {}
        Ok(Scalar::Other)
    }
}

/// The keys a key field's value holds: for each field (its index in `Config::fields`, and the
/// rest of its path below this value), the string or number at the end of its path. Everything
/// else is checked as [`Skip`] checks it and forgotten, so a value of any size costs no more
/// than its parse: only the members on a path are looked into.
struct KeyAt<'a> {
    paths: Vec<(usize, &'a [String])>,
}

impl KeyAt<'_> {
    /// The keys when the value here is not an object: `key` for the paths that end here.
    fn ending_here(self, key: impl Fn() -> Option<SessionKey>) -> Vec<(usize, Option<SessionKey>)> {
        let at = |rest: &[String]| if rest.is_empty() { key() } else { None };
        self.paths
            .iter()
            .map(|&(field, rest)| (field, at(rest)))
            .collect()
    }
}

impl<'de> DeserializeSeed<'de> for KeyAt<'_> {
    type Value = Vec<(usize, Option<SessionKey>)>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for KeyAt<'_> {
    type Value = Vec<(usize, Option<SessionKey>)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        Ok(self.ending_here(|| key_of_str(s)))
    }

    // Numbers as `Value` holds them, so that a key is the text `Value` would write.
    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Self::Value, E> {
        Ok(self.ending_here(|| key_of_number(&n.into())))
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<Self::Value, E> {
        Ok(self.ending_here(|| key_of_number(&n.into())))
    }

    fn visit_f64<E: de::Error>(self, n: f64) -> Result<Self::Value, E> {
        Ok(self.ending_here(|| {
            serde_json::Number::from_f64(n)
                .as_ref()
                .and_then(key_of_number)
        }))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(self.ending_here(|| None))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(self.ending_here(|| None))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(self.ending_here(|| None))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        // A path that ends at an object names no key; one that goes on takes the last member
        // of its next name, as `Value`'s map keeps the last.
        let mut keys: Self::Value = self.paths.iter().map(|&(field, _)| (field, None)).collect();
        while let Some(below) = map.next_key_seed(PathsThrough { paths: &self.paths })? {
            if below.is_empty() {
                map.next_value::<Skip>()?;
                continue;
            }
            for (field, key) in map.next_value_seed(KeyAt { paths: below })? {
                if let Some(slot) = keys.iter_mut().find(|(f, _)| *f == field) {
                    slot.1 = key;
                }
            }
        }
        Ok(keys)
    }
}

/// Reads a member name: the paths that go on through it (the rest of each below it), without
/// keeping the name.
struct PathsThrough<'p, 'a> {
    paths: &'p [(usize, &'a [String])],
}

impl<'de, 'a> DeserializeSeed<'de> for PathsThrough<'_, 'a> {
    type Value = Vec<(usize, &'a [String])>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de, 'a> Visitor<'de> for PathsThrough<'_, 'a> {
    type Value = Vec<(usize, &'a [String])>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_str<E: de::Error>(self, name: &str) -> Result<Self::Value, E> {
        Ok(self
            .paths
            .iter()
            .filter_map(|&(field, rest)| match rest.split_first() {
                Some((first, below)) if first == name => Some((field, below)),
                _ => None,
            })
            .collect())
    }
}
