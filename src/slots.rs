//! Slots assigned by the router: which of a backend's slots each request takes.
//!
//! llama-server gives a request the idle slot whose last prompt shares the most with it,
//! even when another slot is empty, and keeps only what the request shares of the slot's
//! state when that is more than half of it. Two conversations of one system prompt whose
//! turns come out of step then take each other's slot, and each drops the other's tail.
//! A backend declared with [`Backend::assign_slots`](crate::Backend::assign_slots) has its
//! slots assigned by the router instead, which knows what it sent to each: a request is
//! given the slot holding its conversation's last prompt (or an earlier turn's prompt sent
//! again, the slot holding a later turn of it, when the prompt is at least half of what that
//! slot holds: llama-server reuses all of it there), else a slot never used, else the
//! one sharing the most with it when that is more than a tenth of it (among equals the least
//! recently used), else the least recently used; a request whose body names its own slot
//! (`id_slot`) is given that one, free or not: llama-server runs it there once the requests
//! on it have run, and the slot is taken until it ends too. The request carries the slot as
//! an [`AssignedSlot`] extension, which the backend's client sends as llama-server's
//! `id_slot` (with the `client` feature, `client::IdSlot` writes it into the body).

/// The slot of its backend that the router assigned a request to, as a request extension on
/// the request the backend's service receives (see
/// [`Backend::assign_slots`](crate::Backend::assign_slots)). Slots are numbered from 0, as
/// llama-server numbers them; its `id_slot` field takes the number.
///
/// ```
/// use tower_affinity::AssignedSlot;
///
/// # fn doc(req: http::Request<()>) {
/// if let Some(slot) = req.extensions().get::<AssignedSlot>() {
///     println!("slot {}", slot.index());
/// }
/// # }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AssignedSlot(u32);

impl AssignedSlot {
    /// The slot numbered `index`, from 0.
    pub const fn new(index: u32) -> Self {
        AssignedSlot(index)
    }

    /// The slot's number, from 0.
    pub const fn index(self) -> u32 {
        self.0
    }
}

use std::sync::LazyLock;

use memchr::memmem::Finder;

use crate::PromptChain;

/// What a request's body says of its own slot: a top-level `id_slot` member, which
/// llama-server reads before any slot the router would have it take (`client::IdSlot` adds
/// none to a body that has one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum NamedSlot {
    /// The body has no top-level `id_slot`, or was not read: the router may assign a slot.
    #[default]
    Absent,
    /// `id_slot` is this non-negative integer: llama-server runs the request in that slot,
    /// modulo its slots.
    Slot(u64),
    /// `id_slot` is anything else (`-1`, which has llama-server choose, `null`, a string, a
    /// fraction): llama-server chooses the slot, or runs the request where the router cannot
    /// tell.
    Other,
}

/// What the router knows of one slot of a backend whose slots it assigns: 48 bytes, and the
/// chains it keeps.
#[derive(Debug, Default)]
struct Slot {
    /// The chain of the last request sent to it, if it had one: what it holds once the
    /// requests on it have run.
    chain: Option<PromptChain>,
    /// While a request is on it, the chain it held before: what it holds still if the
    /// backend does not run the request (refuses it, or never gets it).
    before: Option<PromptChain>,
    /// Whether a request was ever sent to it (an empty slot takes a new conversation without
    /// dropping another's state).
    used: bool,
    /// While a request is on it, whether one was sent to it before.
    used_before: bool,
    /// Whether the request the slot was assigned to while free is on it.
    busy: bool,
    /// The requests that named the slot while it was taken, and wait for it or run in it:
    /// llama-server runs each there in turn.
    queued: u32,
    /// When a request last left it, on the table's own count.
    last_used: u64,
}

impl Slot {
    /// Whether a request is on it, or waits for it on the backend.
    fn taken(&self) -> bool {
        self.busy || self.queued > 0
    }
}

/// A slot the table gave a request: its number, and whether the request waits there behind
/// another (it named a slot that was taken).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Taken {
    pub(crate) index: u32,
    pub(crate) queued: bool,
}

/// The slots of a backend whose slots the router assigns: which are busy, and what each was
/// last sent.
#[derive(Debug, Default)]
pub(crate) struct SlotTable {
    slots: Vec<Slot>,
    clock: u64,
}

/// llama-server's default `--slot-prompt-similarity`: a slot sharing no more than this share
/// of a prompt is as good as any other for it.
const SIMILAR: f64 = 0.1;

impl SlotTable {
    /// Assigns one of the first `count` slots to a request with `chain` and marks it busy;
    /// `None` if each of them is taken (busy, or with a request queued there). In order of
    /// preference:
    ///
    /// 1. the slot whose last prompt the chain goes on from (the conversation's own), or
    ///    whose last prompt goes on from the whole chain (an earlier turn sent again, which
    ///    llama-server reuses whole there) when the chain is at least half of it: the one
    ///    sharing the most, and among equals the one holding the least past it;
    /// 2. a slot never used: nothing held there is dropped;
    /// 3. the slot sharing the longest prefix with the chain, when that is more than a tenth
    ///    of it, and among equals the least recently used;
    /// 4. the least recently used slot.
    ///
    /// O(slots x log links).
    pub(crate) fn assign(&mut self, count: u32, chain: Option<&PromptChain>) -> Option<u32> {
        let count = count as usize;
        if self.slots.len() < count {
            self.slots.resize_with(count, Slot::default);
        }
        let total = chain.map_or(0, PromptChain::tokens).max(1);
        let share = |tokens: u64| tokens as f64 / total as f64;
        // One pass over the idle slots: the longest own slot, the first empty one, the used
        // one sharing the most (among equals the least recently used), the least recently
        // used; each the first of its equals.
        let (mut own, mut empty, mut best, mut least_recent) = (None, None, None, None);
        let (mut own_key, mut best_key, mut least_at) = ((0, 0), (0, u64::MAX), u64::MAX);
        for (i, s) in self.slots[..count].iter().enumerate() {
            if s.taken() {
                continue;
            }
            let links = match (chain, &s.chain) {
                (Some(c), Some(held)) => common_links(c, held),
                _ => 0,
            };
            let tokens = chain.map_or(0, |c| c.tokens_at(links));
            let (held_links, held_tokens) =
                s.chain.as_ref().map_or((0, 0), |h| (h.len(), h.tokens()));
            let owned = links > 0 && links == held_links;
            // The slot's last prompt goes on from the whole chain: llama-server reuses all of
            // it there and drops what follows, which is worth less when it is more than the
            // chain (llama-server's own mark of a slot losing a large part of its state).
            let prefix = links > 0
                && chain.is_some_and(|c| links == c.len())
                && held_tokens <= tokens.saturating_mul(2);
            // Among equals, the slot dropping the least.
            let key = (tokens, u64::MAX - held_tokens);
            if (owned || prefix) && (own.is_none() || key > own_key) {
                (own, own_key) = (Some(i), key);
            }
            if !s.used {
                empty = empty.or(Some(i));
            } else if best.is_none() || (tokens, u64::MAX - s.last_used) > best_key {
                (best, best_key) = (Some(i), (tokens, u64::MAX - s.last_used));
            }
            if least_recent.is_none() || s.last_used < least_at {
                (least_recent, least_at) = (Some(i), s.last_used);
            }
        }
        let chosen = match (own, empty, best) {
            (Some(own), ..) => own,
            (None, Some(empty), _) => empty,
            (None, None, Some(best)) if share(best_key.0) > SIMILAR => best,
            _ => least_recent?,
        };
        Some(self.take(chosen, chain))
    }

    /// Assigns a request with `chain` the slot its body names, `named` modulo the first
    /// `count` slots (llama-server's own wrap); `None` if `count` is 0. A free slot is marked
    /// busy, as [`assign`](Self::assign) marks it. A taken one is given all the same, the
    /// request queued there: llama-server runs it in that slot once the requests on it
    /// have run, so the slot stays taken until it ends too, and holds its prompt then.
    /// O(1).
    pub(crate) fn assign_named(
        &mut self,
        count: u32,
        named: u64,
        chain: Option<&PromptChain>,
    ) -> Option<Taken> {
        if count == 0 {
            return None;
        }
        // Less than `count`: a `u32`.
        let index = (named % u64::from(count)) as usize;
        if self.slots.len() < count as usize {
            self.slots.resize_with(count as usize, Slot::default);
        }
        let slot = &mut self.slots[index];
        if !slot.taken() {
            return Some(Taken {
                index: self.take(index, chain),
                queued: false,
            });
        }
        // Run after the requests on it, the request leaves its own prompt there; what the
        // slot would hold were it not run depends on theirs, and is not kept.
        slot.queued += 1;
        slot.used = true;
        slot.chain = chain.cloned();
        slot.before = None;
        Some(Taken {
            index: index as u32,
            queued: true,
        })
    }

    /// Marks slot `index` busy with a request of `chain`, keeping what it held for
    /// [`put_back`](Self::put_back).
    fn take(&mut self, index: usize, chain: Option<&PromptChain>) -> u32 {
        let slot = &mut self.slots[index];
        slot.busy = true;
        slot.used_before = std::mem::replace(&mut slot.used, true);
        slot.before = std::mem::replace(&mut slot.chain, chain.cloned());
        index as u32
    }

    /// Forgets what each slot was sent, as the backend chooses its slots for a while: which
    /// are taken is kept, for the requests in flight on them. What a busy slot held before its
    /// request is forgotten too: were that request put back, the backend may have given the
    /// slot to another request since.
    pub(crate) fn forget(&mut self) {
        for slot in &mut self.slots {
            slot.chain = None;
            slot.before = None;
        }
    }

    /// The request given slot `index` (`queued` there, or not: see [`Taken`]) has ended.
    /// The slot is free once no other request is on it or queued there.
    pub(crate) fn release(&mut self, index: u32, queued: bool) {
        self.clock += 1;
        if let Some(slot) = self.slots.get_mut(index as usize) {
            if queued {
                slot.queued = slot.queued.saturating_sub(1);
            } else {
                slot.busy = false;
            }
            if !slot.taken() {
                slot.before = None;
            }
            slot.last_used = self.clock;
        }
    }

    /// The request given slot `index` (`queued` there, or not: see [`Taken`]) has ended
    /// without the backend running it there: it refused the request (llama-server answers
    /// 400 to a prompt longer than a slot's context, before it touches the slot) or never
    /// got it. A slot no request was queued on holds what it held before, and was used when
    /// it was used before: a conversation whose last prompt is there still gets it back. A
    /// request put back while one is queued there leaves the slot to the queued one, which
    /// runs there; a queued request put back leaves it holding what the others on it leave,
    /// which is not known.
    pub(crate) fn put_back(&mut self, index: u32, queued: bool) {
        let Some(slot) = self.slots.get_mut(index as usize) else {
            return;
        };
        if queued && slot.queued > 0 {
            slot.queued -= 1;
            (slot.chain, slot.before) = (None, None);
        } else if !queued && slot.busy {
            slot.busy = false;
            if slot.queued == 0 {
                slot.chain = slot.before.take();
                slot.used = slot.used_before;
            }
        }
    }
}

/// The UTF-8 byte order mark. llama-server's JSON parser skips it at the very start of a body
/// and nowhere else: after whitespace, or a second time, the body is no JSON to it.
const BOM: &[u8] = b"\xef\xbb\xbf";

/// `body` after the byte order mark it opens with, if any: the JSON llama-server reads.
pub(crate) fn after_bom(body: &[u8]) -> &[u8] {
    body.strip_prefix(BOM).unwrap_or(body)
}

/// Whether any string of `body` may read `id_slot`: it holds `"id_slot"` as written, or a
/// `\u00XX` escape of one of its letters (no other escape gives one). Cheap, so that a body
/// of megabytes is parsed only when it may need to be.
pub(crate) fn may_name_id_slot(body: &[u8]) -> bool {
    if memchr::memmem::find(body, b"\"id_slot\"").is_some() {
        return true;
    }
    memchr::memmem::find_iter(body, b"\\u00").any(|at| {
        let hex = body
            .get(at + 4..at + 6)
            .and_then(|h| std::str::from_utf8(h).ok());
        hex.and_then(|h| u8::from_str_radix(h, 16).ok())
            .is_some_and(|c| b"id_slot".contains(&c))
    })
}

/// Whether `headers` declare a content coding other than `identity` (`Content-Encoding:
/// gzip`, say): the body's bytes are then the coding's, not JSON, whatever they open with, so
/// no `id_slot` is written into it and none is assigned.
pub(crate) fn is_coded(headers: &http::HeaderMap) -> bool {
    headers
        .get_all(http::header::CONTENT_ENCODING)
        .iter()
        .any(|v| {
            v.as_bytes()
                .split(|&b| b == b',')
                .map(<[u8]>::trim_ascii)
                .any(|c| !c.is_empty() && !c.eq_ignore_ascii_case(b"identity"))
        })
}

/// Whether llama-server runs a request to `path` in the slot its `id_slot` names: a
/// completion (OpenAI's chat and completions, the Responses API, llama-server's own
/// `/completion` and `/infill`); not an Anthropic Messages request, whose conversion to a
/// chat completion drops `id_slot`, nor an embedding or a reranking, which it runs in slots
/// of its own choosing whatever the request names (a slot assigned to one would be counted as
/// holding its prompt while another slot does), nor a token count, a template, a
/// tokenization or a health check, which take none.
pub(crate) fn takes_a_slot(path: &str) -> bool {
    const ENDS: [&str; 4] = ["/completion", "/completions", "/responses", "/infill"];
    let path = path.strip_suffix('/').unwrap_or(path);
    ENDS.iter().any(|end| path.ends_with(end))
}

/// Whether an answer's chunk ends the answer: the last event of an OpenAI-compatible stream
/// (`data: [DONE]`, or `data:[DONE]` without the space, and its line end), of an Anthropic one
/// (`"message_stop"`), or of a Responses one (a whole `response.completed`, `response.failed`
/// or `response.incomplete` event: llama-server sends no `[DONE]` there). A client that reads
/// an event stream stops at it and may send its next turn before the stream's end is polled.
/// Neither is taken for one an answer's text holds: in a JSON string a line end is escaped, and
/// so are the quotes around `message_stop`, so a chunk cut just after an answer says `data:
/// [DONE]` frees nothing while the backend still generates. Looks at the chunk's last 64 bytes,
/// where the marker of a stream's last event is, and at its first 40 for a Responses event,
/// which names itself at its start and carries the whole response after: O(1) a chunk, whatever
/// its size. A marker split over two chunks (`[DONE]` from its line end too, or a Responses
/// event from its blank line) is missed, and the slot is free at the stream's end instead.
pub(crate) fn ends_answer(chunk: &[u8]) -> bool {
    const DONE: &[u8] = b"[DONE]";
    const STOP: &[u8] = b"\"message_stop\"";
    let tail = &chunk[chunk.len().saturating_sub(64)..];
    // `data:`, the one space SSE allows after a field's colon or none, `[DONE]`, a line end.
    // Each `[` of the tail, rather than a substring search, which a chunk of 64 bytes does
    // not repay setting up.
    let done = memchr::memchr_iter(b'[', tail).any(|at| {
        let before = &tail[..at];
        before
            .strip_suffix(b" ")
            .unwrap_or(before)
            .ends_with(b"data:")
            && tail[at..].starts_with(DONE)
            && matches!(tail.get(at + DONE.len()), Some(b'\n' | b'\r'))
    }) || tail.windows(STOP.len()).any(|w| w == STOP);
    done || ends_responses(chunk)
}

/// Whether the last `"finish_reason"` in a chunk is `null`: the chunk's choice goes on, as
/// in each token chunk of a stream that gives its figures in every chunk (vLLM with
/// `continuous_usage_stats`, llama-server with `timings_per_token`). An Anthropic stream's
/// `message_start`, whose figures come before the answer, goes on too. A chunk without
/// either (a usage chunk with no choices, another Anthropic or Responses event) or whose
/// last `"finish_reason"` names a reason (the choice's last chunk) does not go on, unless
/// the stream has `several` choices (see [`names_a_later_choice`]): one choice's finish
/// comes while the others may still stream, and only the chunk after the choices (the usage
/// chunk, `data: [DONE]`) ends it. Neither name in an answer's text is taken for one: its
/// quotes are escaped there.
/// Searched forward, a vector at a time: on `usage/sse_64`'s last chunk, about 370
/// instructions an answer against 1,100 for the reverse search (callgrind).
pub(crate) fn choice_goes_on(chunk: &[u8], several: bool) -> bool {
    const NAME: &[u8] = b"\"finish_reason\":";
    static FINISH: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(NAME));
    static START: LazyLock<Finder<'static>> =
        LazyLock::new(|| Finder::new(b"\"type\":\"message_start\""));
    let goes_on = FINISH.find_iter(chunk).last().is_some_and(|at| {
        several
            || chunk[at + NAME.len()..]
                .trim_ascii_start()
                .starts_with(b"null")
    });
    goes_on || START.find(chunk).is_some()
}

/// Whether a chunk names a choice other than the first (an `"index"` member whose number is
/// not 0): the request asked for several (`n`), and a stream of them goes on after one
/// choice's finish. A tool call's index (`tool_calls`, a second call's is 1) is taken for
/// one as well: a stream of parallel tool calls then ends at its usage chunk or
/// `data: [DONE]`, not at its finish. Only a member name, not text in a string, where its
/// quotes are escaped; `"output_index"` and the like are other names.
pub(crate) fn names_a_later_choice(chunk: &[u8]) -> bool {
    const NAME: &[u8] = b"\"index\":";
    static INDEX: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(NAME));
    INDEX.find_iter(chunk).any(|at| {
        let value = chunk[at + NAME.len()..].trim_ascii_start();
        let digits = value.iter().take_while(|b| b.is_ascii_digit()).count();
        digits > 0 && value[..digits] != *b"0"
    })
}

/// Whether a chunk is one whole last event of a Responses stream: it begins with the event (its
/// `event:` line, or its `data:` line when the stream names no events; a space after the colon
/// or none) and ends with the blank line after it. Its data is one line of JSON, so the blank
/// line is the event's.
fn ends_responses(chunk: &[u8]) -> bool {
    const LAST: [&[u8]; 3] = [b"completed", b"failed", b"incomplete"];
    let whole = chunk.ends_with(b"\n\n") || chunk.ends_with(b"\r\n\r\n");
    let named = |rest: &[u8], end: &[u8]| {
        LAST.iter().any(|name| {
            rest.strip_prefix(*name)
                .is_some_and(|rest| rest.starts_with(end))
        })
    };
    // A field's value follows its colon after one space or none.
    let field = |name: &[u8]| {
        let value = chunk.strip_prefix(name)?;
        Some(value.strip_prefix(b" ").unwrap_or(value))
    };
    whole
        && if let Some(rest) = field(b"event:").and_then(|v| v.strip_prefix(b"response.")) {
            named(rest, b"\n") || named(rest, b"\r\n")
        } else if let Some(rest) =
            field(b"data:").and_then(|v| v.strip_prefix(b"{\"type\":\"response."))
        {
            named(rest, b"\"")
        } else {
            false
        }
}

/// How many leading links two chains share: a link's digest covers its whole prefix, so
/// equal links at one place mean equal prefixes up to there. O(log links).
fn common_links(a: &PromptChain, b: &PromptChain) -> usize {
    let (a, b) = (a.links(), b.links());
    let (mut lo, mut hi) = (0, a.len().min(b.len()));
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if a[mid].digest == b[mid].digest {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chain of 100-token blocks with these ids.
    fn chain(ids: &[u64]) -> PromptChain {
        PromptChain::from_blocks(ids.iter().map(|&id| (id, 100)))
    }

    /// A table of as many slots as `chains`, slot `i` given `chains[i]` (each new chain
    /// takes the next empty slot while the others are busy), then all released in order.
    fn table_holding(chains: &[Option<PromptChain>]) -> SlotTable {
        let mut t = SlotTable::default();
        let n = chains.len() as u32;
        for (i, c) in chains.iter().enumerate() {
            assert_eq!(t.assign(n, c.as_ref()), Some(i as u32));
        }
        for i in 0..n {
            t.release(i, false);
        }
        t
    }

    #[test]
    fn a_conversation_goes_back_to_the_slot_holding_its_last_prompt() {
        // Slot 0 holds the conversation's last prompt; slot 1 another that goes on from it
        // (a branch), sharing as much with the next turn, and used less recently.
        let mut t = table_holding(&[Some(chain(&[1, 2])), Some(chain(&[1, 2, 3, 4]))]);
        assert_eq!(t.assign(2, Some(&chain(&[1, 2]))), Some(0));
        t.release(0, false);
        assert_eq!(t.assign(2, Some(&chain(&[1, 2, 5]))), Some(0));
    }

    #[test]
    fn an_earlier_turn_sent_again_takes_the_slot_holding_a_later_one_rather_than_an_empty_one() {
        // Slot 0 holds the conversation's second turn; its first turn is sent again (its
        // answer regenerated): llama-server reuses the whole prompt there.
        let mut t = SlotTable::default();
        assert_eq!(t.assign(3, Some(&chain(&[1, 2, 3]))), Some(0));
        t.release(0, false);
        assert_eq!(t.assign(3, Some(&chain(&[1, 2]))), Some(0));
        t.release(0, false);
        // A slot holding that prompt exactly drops nothing: it is taken rather than one
        // holding a later turn.
        let mut t = table_holding(&[Some(chain(&[1, 2, 3])), Some(chain(&[1, 2])), None]);
        assert_eq!(t.assign(3, Some(&chain(&[1, 2]))), Some(1));
    }

    #[test]
    fn a_prompt_less_than_half_of_a_slots_last_prompt_takes_an_empty_slot_rather_than_drop_the_rest(
    ) {
        // Another conversation of the same system prompt and first message, sent while the
        // first has gone on: taking slot 0 would drop three blocks to reuse two.
        let mut t = SlotTable::default();
        assert_eq!(t.assign(3, Some(&chain(&[1, 2, 3, 4, 5]))), Some(0));
        t.release(0, false);
        assert_eq!(t.assign(3, Some(&chain(&[1, 2]))), Some(1));
        t.release(1, false);
        // Half of it is enough.
        let mut t = SlotTable::default();
        assert_eq!(t.assign(3, Some(&chain(&[1, 2, 3, 4]))), Some(0));
        t.release(0, false);
        assert_eq!(t.assign(3, Some(&chain(&[1, 2]))), Some(0));
    }

    #[test]
    fn a_new_conversation_takes_an_empty_slot_rather_than_drop_anothers_tail() {
        // Slot 0 holds a conversation whose first two blocks (a system prompt) a new one
        // shares: llama-server would take slot 0 by similarity, keep two thirds of it, and
        // drop its last block.
        let held = chain(&[1, 2, 3]);
        let mut t = SlotTable::default();
        assert_eq!(t.assign(3, Some(&held)), Some(0));
        t.release(0, false);
        assert_eq!(t.assign(3, Some(&chain(&[1, 2, 9]))), Some(1));
    }

    #[test]
    fn among_slots_sharing_as_much_the_least_recently_used_is_taken() {
        let mut t = table_holding(&[Some(chain(&[1, 2, 3])), Some(chain(&[1, 2, 4]))]);
        // Slot 0 was released first: least recently used.
        assert_eq!(t.assign(2, Some(&chain(&[1, 2, 5]))), Some(0));
        t.release(0, false);
        // Now slot 1 is.
        assert_eq!(t.assign(2, Some(&chain(&[1, 2, 6]))), Some(1));
    }

    #[test]
    fn with_no_slot_empty_a_prompt_sharing_a_tenth_takes_the_slot_sharing_most() {
        let mut t = table_holding(&[Some(chain(&[1, 2, 3])), Some(chain(&[5, 6, 7]))]);
        // Shares 100 of 500 tokens with slot 1 (a fifth), nothing with slot 0.
        assert_eq!(t.assign(2, Some(&chain(&[5, 9, 10, 11, 12]))), Some(1));
    }

    #[test]
    fn a_prompt_sharing_exactly_a_tenth_with_a_slot_takes_the_least_recently_used() {
        let mut t = table_holding(&[Some(chain(&[1, 2, 3])), Some(chain(&[5, 6, 7]))]);
        // Shares 100 of 1,000 tokens with slot 1: a tenth, not more. Slot 0 was released
        // first.
        let prompt = chain(&[5, 9, 10, 11, 12, 13, 14, 15, 16, 17]);
        assert_eq!(t.assign(2, Some(&prompt)), Some(0));
    }

    #[test]
    fn a_named_slot_past_the_slot_count_wraps_around() {
        let mut t = SlotTable::default();
        assert_eq!(t.assign_named(3, 4, None).map(|s| s.index), Some(1));
        assert_eq!(t.assign_named(3, 6, None).map(|s| s.index), Some(0));
        assert_eq!(t.assign_named(3, 5, None).map(|s| s.index), Some(2));
    }

    #[test]
    fn a_prompt_sharing_nothing_takes_the_least_recently_used_slot() {
        let mut t = table_holding(&[Some(chain(&[1, 2, 3])), Some(chain(&[5, 6, 7]))]);
        t.assign(2, Some(&chain(&[5, 6, 7, 8])));
        t.release(1, false);
        assert_eq!(t.assign(2, Some(&chain(&[20, 21]))), Some(0));
    }

    #[test]
    fn a_request_without_a_chain_takes_an_empty_slot_then_the_least_recently_used() {
        let mut t = SlotTable::default();
        assert_eq!(t.assign(2, Some(&chain(&[1]))), Some(0));
        assert_eq!(t.assign(2, None), Some(1));
        t.release(1, false);
        t.release(0, false);
        // Slot 1 was released first; it held no chain, so what it holds is not known.
        assert_eq!(t.assign(2, None), Some(1));
        assert!(t.slots[1].chain.is_none());
    }

    #[test]
    fn no_slot_is_assigned_while_every_slot_is_busy_and_a_released_one_is_free_again() {
        let mut t = SlotTable::default();
        assert_eq!(t.assign(2, None), Some(0));
        assert_eq!(t.assign(2, None), Some(1));
        assert_eq!(t.assign(2, None), None);
        t.release(1, false);
        assert_eq!(t.assign(2, None), Some(1));
    }

    #[test]
    fn a_slot_count_that_shrinks_assigns_only_the_slots_left_and_one_that_grows_adds_empty_ones() {
        let mut t = SlotTable::default();
        assert_eq!(t.assign(4, Some(&chain(&[1]))), Some(0));
        assert_eq!(t.assign(1, Some(&chain(&[2]))), None);
        t.release(0, false);
        assert_eq!(t.assign(1, Some(&chain(&[2]))), Some(0));
        assert_eq!(t.assign(6, Some(&chain(&[3]))), Some(1));
    }

    #[test]
    fn a_table_that_forgets_keeps_its_busy_slots_and_drops_their_chains() {
        let mut t = table_holding(&[Some(chain(&[1, 2])), Some(chain(&[5, 6]))]);
        assert_eq!(t.assign(3, Some(&chain(&[1, 2, 3]))), Some(0));
        t.forget();
        assert!(t.slots.iter().all(|s| s.chain.is_none()));
        // Slot 0 is still busy; slot 2 was never used.
        assert_eq!(t.assign(3, Some(&chain(&[5, 6, 7]))), Some(2));
        t.release(0, false);
        assert_eq!(t.assign(3, None), Some(1));
    }

    #[test]
    fn a_slot_put_back_after_its_table_forgot_holds_nothing_known() {
        let mut t = table_holding(&[Some(chain(&[5, 6])), Some(chain(&[1, 2]))]);
        // The conversation of slot 1 goes on there, and the table forgets while it is on.
        assert_eq!(t.assign(2, Some(&chain(&[1, 2, 3]))), Some(1));
        t.forget();
        // The backend did not run it; meanwhile it chooses its slots, and may have given this
        // one to another request: what the slot holds is not known.
        t.put_back(1, false);
        assert!(t.slots[1].chain.is_none());
        // So the conversation's next prompt is no more at home on slot 1 than on slot 0,
        // the least recently used.
        assert_eq!(t.assign(2, Some(&chain(&[1, 2, 4]))), Some(0));
    }

    #[test]
    fn a_slot_named_while_taken_stays_taken_until_the_request_queued_there_ends() {
        let mut t = SlotTable::default();
        assert_eq!(t.assign(2, Some(&chain(&[1, 2]))), Some(0));
        // Another request names slot 0 while the first is on it: llama-server runs it
        // there next.
        let queued = Taken {
            index: 0,
            queued: true,
        };
        assert_eq!(t.assign_named(2, 0, Some(&chain(&[7]))), Some(queued));
        t.release(0, false);
        // The first request's conversation goes on; slot 0 is not free, though its first
        // request has ended.
        assert_eq!(t.assign(2, Some(&chain(&[1, 2, 3]))), Some(1));
        assert_eq!(t.assign(2, None), None);
        t.release(0, true);
        // Free now, and holding the queued request's prompt: its conversation goes back
        // there.
        t.release(1, false);
        assert_eq!(t.assign(2, Some(&chain(&[7, 8]))), Some(0));
    }

    #[test]
    fn a_request_put_back_before_the_one_queued_behind_it_leaves_the_slot_to_that_one() {
        let mut t = table_holding(&[Some(chain(&[1, 2]))]);
        assert_eq!(t.assign(1, Some(&chain(&[1, 2, 3]))), Some(0));
        t.assign_named(1, 0, Some(&chain(&[7])));
        // The first is refused: the queued one runs there, and leaves its prompt.
        t.put_back(0, false);
        assert_eq!(t.assign(1, None), None);
        t.release(0, true);
        assert_eq!(t.slots[0].chain, Some(chain(&[7])));
        // A queued request put back leaves the slot holding what is not known.
        t.assign(1, Some(&chain(&[7, 8])));
        t.assign_named(1, 0, Some(&chain(&[9])));
        t.put_back(0, true);
        t.release(0, false);
        assert_eq!(t.slots[0].chain, None);
    }

    #[test]
    fn releasing_a_slot_never_assigned_changes_nothing() {
        let mut t = SlotTable::default();
        t.release(7, false);
        assert_eq!(t.assign(1, None), Some(0));
    }

    /// What a slot held before its request is kept only while a request is on it, for
    /// [`SlotTable::put_back`]: a free slot keeps no chain but its own.
    #[test]
    fn a_free_slot_keeps_no_chain_from_before_its_last_request() {
        let mut t = table_holding(&[Some(chain(&[1, 2]))]);
        assert_eq!(t.assign(1, Some(&chain(&[1, 2, 3]))), Some(0));
        assert_eq!(t.slots[0].before, Some(chain(&[1, 2])));
        t.release(0, false);
        assert!(t.slots[0].before.is_none());
        assert_eq!(t.slots[0].chain, Some(chain(&[1, 2, 3])));
    }

    /// A queued request put back on a slot no request is queued on (its end counted once
    /// already) changes nothing: the count does not go below zero, and what the slot holds
    /// is kept.
    #[test]
    fn putting_back_a_queued_request_where_none_is_queued_changes_nothing() {
        let mut t = table_holding(&[Some(chain(&[1, 2]))]);
        t.put_back(0, true);
        assert_eq!(t.slots[0].queued, 0);
        assert_eq!(t.slots[0].chain, Some(chain(&[1, 2])));
        assert_eq!(t.assign(1, Some(&chain(&[1, 2, 3]))), Some(0));
    }

    #[test]
    fn an_event_streams_last_event_ends_the_answer() {
        assert!(ends_answer(b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n"));
        assert!(ends_answer(
            b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
        ));
        assert!(!ends_answer(b"data: {\"choices\":[{\"delta\":{}}]}\n\n"));
        assert!(!ends_answer(
            b"{\"content\":\"data: [DONE] was said early\"}"
                .iter()
                .chain([b' '; 80].iter())
                .copied()
                .collect::<Vec<u8>>()
                .as_slice()
        ));
        assert!(!ends_answer(b""));
        assert!(ends_answer(b"data: [DONE]\r\n\r\n"));
    }

    #[test]
    fn a_responses_streams_last_event_ends_the_answer_whole_and_only_whole() {
        // The whole response follows the event's name: far more than 64 bytes.
        let text = "x".repeat(300);
        let last = |head: &str, end: &str| {
            format!(
                "{head}data: {{\"type\":\"response.completed\",\"response\":{{\"output_text\":\"{text}\"}}}}{end}"
            )
        };
        assert!(ends_answer(
            last("event: response.completed\n", "\n\n").as_bytes()
        ));
        assert!(ends_answer(
            last("event: response.completed\r\n", "\r\n\r\n").as_bytes()
        ));
        // A stream that names no events.
        assert!(ends_answer(last("", "\n\n").as_bytes()));
        for name in ["failed", "incomplete"] {
            let event = format!("event: response.{name}\ndata: {{}}\n\n");
            assert!(ends_answer(event.as_bytes()), "{name}");
        }
        // Cut before its blank line, it may go on in the next chunk.
        assert!(!ends_answer(
            last("event: response.completed\n", "").as_bytes()
        ));
        assert!(!ends_answer(
            last("event: response.completed\n", "\n").as_bytes()
        ));
        // Other events, and names that only begin alike.
        for event in [
            "event: response.output_text.delta\ndata: {\"delta\":\"response.completed\"}\n\n",
            "event: response.completed_soon\ndata: {}\n\n",
            "data: {\"type\":\"response.created\"}\n\n",
            "data: {\"type\":\"response.completedx\"}\n\n",
        ] {
            assert!(!ends_answer(event.as_bytes()), "{event}");
        }
    }

    #[test]
    fn a_responses_streams_last_event_ends_the_answer_without_a_space_after_its_colons() {
        let last = |head: &str| format!("{head}data:{{\"type\":\"response.completed\"}}\n\n");
        assert!(ends_answer(last("event:response.completed\n").as_bytes()));
        assert!(ends_answer(last("").as_bytes()));
        assert!(!ends_answer(last("event:response.created\n").as_bytes()));
    }

    #[test]
    fn an_answer_that_says_what_ends_a_stream_in_its_text_does_not_end_it() {
        // A frame cut in the middle of an event, just after the answer's words.
        assert!(!ends_answer(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"ends with data: [DONE]"
        ));
        assert!(!ends_answer(br#"{"content":"data: [DONE]"}"#));
        assert!(!ends_answer(br#"{"text":"\"message_stop\""#));
        // The stream's own last event, whole.
        assert!(ends_answer(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"data: [DONE]\"}}]}\n\ndata: [DONE]\n\n"
        ));
    }

    #[test]
    fn a_choice_goes_on_while_its_last_finish_reason_in_the_chunk_is_null() {
        // vLLM's token chunk and its finish, llama-server's, one frame with both.
        let token = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":{\"prompt_tokens\":12}}\n\n";
        let finish = b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\",\"stop_reason\":null}],\"usage\":{\"prompt_tokens\":12}}\n\n";
        assert!(choice_goes_on(token, false));
        assert!(!choice_goes_on(finish, false));
        assert!(choice_goes_on(
            b"{\"choices\":[{\"finish_reason\": null,\"index\":0}]}",
            false
        ));
        assert!(!choice_goes_on(&[&token[..], &finish[..]].concat(), false));
        assert!(choice_goes_on(&[&finish[..], &token[..]].concat(), false));
        // An Anthropic stream's first event, whose figures come before the answer, goes on.
        assert!(choice_goes_on(
            b"data: {\"type\":\"message_start\",\"message\":{\"stop_reason\":null}}\n\n",
            false
        ));
        // No choice: a usage chunk, Anthropic's last events; names in the answer's text.
        assert!(!choice_goes_on(
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12}}\n\n",
            false
        ));
        assert!(!choice_goes_on(
            b"data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":9}}\n\n",
            false
        ));
        assert!(!choice_goes_on(
            br#"{"delta":{"content":"\"finish_reason\":null"}}"#,
            false
        ));
        assert!(!choice_goes_on(
            br#"{"delta":{"text":"\"type\":\"message_start\""}}"#,
            false
        ));
        assert!(!choice_goes_on(b"", false));
    }

    /// A body is in a content coding when any coding it lists is not `identity`, in any
    /// case, among empty list members.
    #[test]
    fn a_body_is_coded_when_a_coding_it_lists_is_not_identity() {
        let coded = |values: &[&str]| {
            let mut headers = http::HeaderMap::new();
            for v in values {
                headers.append(http::header::CONTENT_ENCODING, v.parse().unwrap());
            }
            is_coded(&headers)
        };
        assert!(!coded(&[]));
        assert!(!coded(&["identity"]));
        assert!(!coded(&["IDENTITY", " , identity"]));
        assert!(coded(&["gzip"]));
        assert!(coded(&["identity, gzip"]));
        assert!(coded(&["identity", "br"]));
    }

    /// A stream of several choices (`n`) goes on after one choice's finish: only the chunk
    /// with no finish at all (the usage chunk after the choices) does not go on.
    #[test]
    fn a_choices_finish_in_a_stream_of_several_is_not_the_answers_end() {
        let first = b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":null}],\"usage\":{\"prompt_tokens\":12}}\n\n";
        let second = b"data: {\"choices\":[{\"index\":1,\"delta\":{},\"finish_reason\":null}],\"usage\":{\"prompt_tokens\":12}}\n\n";
        let finish = b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":12}}\n\n";
        let usage = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12}}\n\n";
        assert!(!names_a_later_choice(first));
        assert!(names_a_later_choice(second));
        assert!(names_a_later_choice(b"{\"index\": 10}"));
        assert!(!names_a_later_choice(b"{\"index\":0,\"output_index\":3}"));
        assert!(!names_a_later_choice(br#"{"content":"\"index\":1"}"#));
        // An index that is no number names no choice (a tool call's `"index": null`).
        assert!(!names_a_later_choice(b"{\"index\": null}"));
        assert!(choice_goes_on(finish, true));
        assert!(!choice_goes_on(finish, false));
        assert!(!choice_goes_on(usage, true));
    }

    #[test]
    fn completions_take_a_slot_and_anthropic_messages_embeddings_and_token_counts_do_not() {
        for path in [
            "/v1/chat/completions",
            "/chat/completions/",
            "/v1/completions",
            "/completion",
            "/v1/responses",
            "/infill",
        ] {
            assert!(takes_a_slot(path), "{path}");
        }
        for path in [
            "/v1/messages",
            "/v1/embeddings",
            "/embedding",
            "/v1/rerank",
            "/reranking",
            "/v1/messages/count_tokens",
            "/v1/responses/input_tokens",
            "/v1/chat/completions/input_tokens",
            "/v1/chat/completions/control",
            "/tokenize",
            "/detokenize",
            "/apply-template",
            "/health",
            "/slots",
            "/",
            "",
        ] {
            assert!(!takes_a_slot(path), "{path}");
        }
    }

    #[test]
    fn a_slot_takes_48_bytes_besides_its_chains() {
        assert_eq!(std::mem::size_of::<Slot>(), 48);
    }

    #[test]
    fn a_slot_put_back_holds_what_it_held_before_and_keeps_its_place_in_the_lru_order() {
        let mut t = table_holding(&[Some(chain(&[1, 2])), Some(chain(&[5, 6]))]);
        // Slot 0 is the least recently used: a prompt sharing nothing takes it, and is
        // refused there.
        assert_eq!(t.assign(2, Some(&chain(&[20, 21]))), Some(0));
        t.put_back(0, false);
        // Slot 0 still holds [1, 2]: its conversation goes back there.
        assert_eq!(t.assign(2, Some(&chain(&[1, 2, 3]))), Some(0));
        t.release(0, false);
        // An empty slot put back is empty still; one released after a run is not.
        let mut t = SlotTable::default();
        assert_eq!(t.assign(2, Some(&chain(&[1]))), Some(0));
        t.put_back(0, false);
        assert_eq!(t.assign(2, Some(&chain(&[2]))), Some(0));
        t.release(0, false);
        assert_eq!(t.assign(2, Some(&chain(&[3]))), Some(1));
        // Putting back a slot no request is on changes nothing.
        t.put_back(0, false);
        assert_eq!(t.slots[0].chain, Some(chain(&[2])));
    }

    /// A step of the property test below.
    #[derive(Clone, Debug)]
    enum Step {
        /// A request with the chain of these blocks (none: no chain) assigned one of the
        /// first `count` slots.
        Assign(u32, Vec<u8>),
        /// A request with the chain of these blocks naming slot `named` of the first `count`.
        Named(u32, u64, Vec<u8>),
        /// The `i`th request in flight (modulo how many) released.
        Release(usize),
        /// The `i`th request in flight (modulo how many) put back.
        PutBack(usize),
        /// The table forgets what its slots hold.
        Forget,
    }

    /// The tokens of block `id`: uneven, so that shares above and below a tenth both occur.
    fn block_tokens(id: u8) -> u32 {
        [40, 300, 900, 15][usize::from(id) % 4]
    }

    /// What the router knows of one slot, kept the plain way.
    #[derive(Clone, Debug, Default)]
    struct Known {
        held: Option<Vec<u8>>,
        before: Option<Vec<u8>>,
        used: bool,
        used_before: bool,
        busy: bool,
        queued: u32,
        /// The step at which a request last left it (0: never).
        left: u64,
    }

    impl Known {
        fn taken(&self) -> bool {
            self.busy || self.queued > 0
        }

        /// Given to a request of `blocks` while free.
        fn take(&mut self, blocks: Vec<u8>) {
            self.busy = true;
            self.used_before = std::mem::replace(&mut self.used, true);
            self.before = std::mem::replace(&mut self.held, (!blocks.is_empty()).then_some(blocks));
        }
    }

    /// Tokens of the blocks `a` and `b` share from the start.
    fn shared_tokens(a: &[u8], b: &[u8]) -> u64 {
        a.iter()
            .zip(b)
            .take_while(|(x, y)| x == y)
            .map(|(&x, _)| u64::from(block_tokens(x)))
            .sum()
    }

    /// The slot the rules of [`SlotTable::assign`] give `chain` among the first `count`,
    /// each rule read the plain way, the first of equals taken.
    fn rule_choice(slots: &[Known], count: usize, chain: &[u8]) -> Option<usize> {
        let idle: Vec<usize> = (0..count).filter(|&i| !slots[i].taken()).collect();
        let tokens = |h: &[u8]| shared_tokens(chain, h);
        let all = |h: &[u8]| h.iter().map(|&b| u64::from(block_tokens(b))).sum::<u64>();
        let own = idle
            .iter()
            .copied()
            .filter(|&i| {
                slots[i].held.as_ref().is_some_and(|h| {
                    !h.is_empty() && chain.starts_with(h)
                        || !chain.is_empty() && h.starts_with(chain) && all(h) <= 2 * all(chain)
                })
            })
            .fold(None, |best: Option<usize>, i| {
                let key = |i: usize| {
                    let h = slots[i].held.as_ref().unwrap();
                    (tokens(h), std::cmp::Reverse(all(h)))
                };
                match best {
                    Some(b) if key(b) >= key(i) => Some(b),
                    _ => Some(i),
                }
            });
        if own.is_some() {
            return own;
        }
        if let Some(&empty) = idle.iter().find(|&&i| !slots[i].used) {
            return Some(empty);
        }
        let share = |i: usize| slots[i].held.as_deref().map_or(0, tokens);
        let total = chain
            .iter()
            .map(|&b| u64::from(block_tokens(b)))
            .sum::<u64>()
            .max(1);
        let best = idle
            .iter()
            .copied()
            .fold(None, |best: Option<usize>, i| match best {
                Some(b)
                    if (share(b), std::cmp::Reverse(slots[b].left))
                        >= (share(i), std::cmp::Reverse(slots[i].left)) =>
                {
                    Some(b)
                }
                _ => Some(i),
            });
        if let Some(b) = best.filter(|&b| share(b) as f64 / total as f64 > SIMILAR) {
            return Some(b);
        }
        idle.iter().copied().min_by_key(|&i| slots[i].left)
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (1u32..=5, proptest::collection::vec(0u8..4, 0..6))
                .prop_map(|(count, blocks)| Step::Assign(count, blocks)),
            1 => (1u32..=5, 0u64..8, proptest::collection::vec(0u8..4, 0..6))
                .prop_map(|(count, named, blocks)| Step::Named(count, named, blocks)),
            3 => (0usize..8).prop_map(Step::Release),
            1 => (0usize..8).prop_map(Step::PutBack),
            1 => Just(Step::Forget),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]

        /// Requests assigned (by the rules or by the slot they name), released and put back
        /// in any order, slot counts that grow and shrink, and tables that forget: no slot is
        /// given by the rules to a request while another is on it or queued there, none at or
        /// past the count, a request is refused a slot only when each is taken, each choice
        /// is the one the rules make over what the router knows of each slot, and a slot is
        /// taken exactly while a request given it has not ended.
        #[test]
        fn slots_assigned_in_any_order_follow_the_rules_and_are_never_shared(
            steps in proptest::collection::vec(step(), 1..60),
        ) {
            let mut t = SlotTable::default();
            let mut known: Vec<Known> = Vec::new();
            // The requests in flight: the slot each was given, and whether it was queued.
            let mut on: Vec<(usize, bool)> = Vec::new();
            let mut clock = 0;
            let chain_of = |blocks: &[u8]| {
                (!blocks.is_empty()).then(|| {
                    PromptChain::from_blocks(
                        blocks.iter().map(|&b| (u64::from(b), block_tokens(b))),
                    )
                })
            };
            for step in steps {
                match step {
                    Step::Assign(count, blocks) => {
                        let n = count as usize;
                        if known.len() < n {
                            known.resize_with(n, Known::default);
                        }
                        let chain = chain_of(&blocks);
                        let got = t.assign(count, chain.as_ref()).map(|i| i as usize);
                        let want = rule_choice(&known, n, &blocks);
                        proptest::prop_assert_eq!(got, want, "{:?}", known);
                        if let Some(i) = got {
                            proptest::prop_assert!(i < n);
                            proptest::prop_assert!(!known[i].taken());
                            known[i].take(blocks);
                            on.push((i, false));
                        } else {
                            proptest::prop_assert!(known[..n].iter().all(Known::taken));
                        }
                    }
                    Step::Named(count, named, blocks) => {
                        let n = count as usize;
                        if known.len() < n {
                            known.resize_with(n, Known::default);
                        }
                        let chain = chain_of(&blocks);
                        let got = t.assign_named(count, named, chain.as_ref());
                        let i = (named % u64::from(count)) as usize;
                        let queued = known[i].taken();
                        proptest::prop_assert_eq!(got, Some(Taken { index: i as u32, queued }));
                        let k = &mut known[i];
                        if queued {
                            k.queued += 1;
                            k.used = true;
                            k.held = (!blocks.is_empty()).then_some(blocks);
                            k.before = None;
                        } else {
                            k.take(blocks);
                        }
                        on.push((i, queued));
                    }
                    Step::Release(r) if !on.is_empty() => {
                        let (i, queued) = on.remove(r % on.len());
                        t.release(i as u32, queued);
                        clock += 1;
                        let k = &mut known[i];
                        if queued {
                            k.queued -= 1;
                        } else {
                            k.busy = false;
                        }
                        if !k.taken() {
                            k.before = None;
                        }
                        k.left = clock;
                    }
                    Step::PutBack(r) if !on.is_empty() => {
                        let (i, queued) = on.remove(r % on.len());
                        t.put_back(i as u32, queued);
                        let k = &mut known[i];
                        if queued {
                            k.queued -= 1;
                            (k.held, k.before) = (None, None);
                        } else {
                            k.busy = false;
                            if k.queued == 0 {
                                k.held = k.before.take();
                                k.used = k.used_before;
                            }
                        }
                    }
                    Step::Forget => {
                        t.forget();
                        for k in &mut known {
                            (k.held, k.before) = (None, None);
                        }
                    }
                    Step::Release(_) | Step::PutBack(_) => {}
                }
                for (i, k) in known.iter().enumerate() {
                    proptest::prop_assert_eq!(t.slots[i].busy, k.busy);
                    proptest::prop_assert_eq!(t.slots[i].queued, k.queued);
                    let requests = on.iter().filter(|&&(at, _)| at == i).count();
                    proptest::prop_assert_eq!(k.taken(), requests > 0);
                }
            }
        }
    }

    #[test]
    fn common_links_finds_the_shared_prefix() {
        assert_eq!(common_links(&chain(&[1, 2, 3]), &chain(&[1, 2, 4, 5])), 2);
        assert_eq!(common_links(&chain(&[1, 2]), &chain(&[1, 2, 3])), 2);
        assert_eq!(common_links(&chain(&[9]), &chain(&[1, 2, 3])), 0);
        assert_eq!(common_links(&chain(&[]), &chain(&[1])), 0);
    }
}
