//! Conversations the server keeps: the OpenAI Responses API's `previous_response_id`.
//!
//! A request that names a previous response sends only its new input; the server puts the
//! conversation that response ended back in front of it. So the request's prompt is the
//! named response's prompt, then the new input, and its chain continues that prompt's chain.
//! And only the server that answered the response holds it (vLLM keeps stored responses in
//! its process's memory): another answers 404.
//!
//! The response's id is in its answer: the `id` of a JSON answer, or of the `response` in a
//! stream's first event. The layer reads it from the answer's first bytes as they pass and
//! remembers, for the latest responses (a bounded number of them), the chain of the request
//! each answered and the backend that answered it (from the answer's
//! [`Decision`](crate::Decision)). A response that a later one continues is forgotten
//! before any that none continues yet: a conversation goes on from its latest response, so
//! the bound is on conversations, not on turns.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_64;

use crate::{BackendId, PromptChain};

/// What is remembered of one response.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Stored {
    /// The chain of the request it answered; `None` when that request itself continued a
    /// response not remembered, so its whole prompt is not known here.
    pub(crate) chain: Option<PromptChain>,
    /// The backend that answered it, if the answer carried its [`Decision`](crate::Decision).
    pub(crate) backend: Option<BackendId>,
}

/// The latest responses, by their ids' digests. Past `capacity` responses, those a later
/// response continued (superseded) are forgotten first, the earliest superseded first; then the
/// oldest. Past `max_links` chain links in all (a response's chain is its whole prompt's, so a
/// few long conversations would otherwise hold gigabytes), the oldest chains are dropped first
/// (the superseded ones' first: the responses continuing them hold their prompts) and their
/// responses kept: the backend a continuation must go to outlasts the prompt it continues, so
/// that long chains, a client's own or another's, do not send continuations to backends that
/// never stored their responses.
pub(crate) struct StoredResponses {
    store: Mutex<Store>,
    capacity: usize,
    max_links: usize,
}

#[derive(Default)]
struct Store {
    responses: HashMap<u64, Stored>,
    /// The responses' digests, in the order they are forgotten: the superseded, then the
    /// rest, oldest first.
    order: VecDeque<u64>,
    /// How many of the first of `order` are superseded.
    superseded: usize,
    /// How many of the first of `order` have no chain left to drop.
    dropped: usize,
    /// The links of every remembered chain.
    links: usize,
}

/// The links a remembered response holds.
fn links_of(stored: &Stored) -> usize {
    stored.chain.as_ref().map_or(0, PromptChain::len)
}

/// What a response is remembered under: its id's digest.
pub(crate) fn digest(id: &[u8]) -> u64 {
    xxh3_64(id)
}

impl Store {
    /// Puts response `digest`, which a later one continues, after those superseded before it.
    /// A response superseded already, or not remembered, stays where it is.
    fn supersede(&mut self, digest: u64) {
        // The response continued is most often the conversation's latest: look from the
        // newest.
        let Some(at) = self.order.iter().rposition(|&d| d == digest) else {
            return;
        };
        if at < self.superseded {
            return;
        }
        self.order.remove(at);
        if at < self.dropped {
            self.dropped -= 1;
        }
        let to = self.superseded;
        self.order.insert(to, digest);
        self.superseded += 1;
        // The first `dropped` have no chain: the response joins them if it has none and
        // lands among them, and ends them if it has one.
        match self.responses.get(&digest).map(links_of) {
            Some(0) if to <= self.dropped => self.dropped += 1,
            Some(0) => {}
            _ => self.dropped = self.dropped.min(to),
        }
    }
}

impl StoredResponses {
    /// How many responses are remembered by default.
    pub(crate) const DEFAULT_CAPACITY: usize = 4096;

    /// How many chain links they hold at most by default: 2^20, 24 MiB of links (a link is
    /// 24 bytes), about 2 GiB of prompts at a link per 2 KiB.
    pub(crate) const DEFAULT_MAX_LINKS: usize = 1 << 20;

    pub(crate) fn new(capacity: usize, max_links: usize) -> Self {
        StoredResponses {
            store: Mutex::new(Store::default()),
            capacity: capacity.max(1),
            max_links,
        }
    }

    /// What is remembered of response `id`, if anything.
    pub(crate) fn get(&self, id: &str) -> Option<Stored> {
        self.store
            .lock()
            .responses
            .get(&digest(id.as_bytes()))
            .cloned()
    }

    /// Remembers response `id`; `continues`, the digest of the response it continues, is
    /// superseded.
    fn put(&self, id: &[u8], stored: Stored, continues: Option<u64>) {
        let digest = digest(id);
        let mut store = self.store.lock();
        let store = &mut *store;
        if let Some(previous) = continues.filter(|&p| p != digest) {
            store.supersede(previous);
        }
        store.links += links_of(&stored);
        if let Some(old) = store.responses.insert(digest, stored) {
            // Put again under its id (rare): it moves to the newest.
            store.links -= links_of(&old);
            if let Some(at) = store.order.iter().position(|&d| d == digest) {
                store.order.remove(at);
                if at < store.superseded {
                    store.superseded -= 1;
                }
                if at < store.dropped {
                    store.dropped -= 1;
                }
            }
        }
        store.order.push_back(digest);
        while store.order.len() > self.capacity {
            let Some(old) = store.order.pop_front() else {
                break;
            };
            store.superseded = store.superseded.saturating_sub(1);
            store.dropped = store.dropped.saturating_sub(1);
            if let Some(old) = store.responses.remove(&old) {
                store.links -= links_of(&old);
            }
        }
        // The newest keeps its chain, whatever its size.
        while store.links > self.max_links && store.dropped + 1 < store.order.len() {
            let oldest = store.order[store.dropped];
            store.dropped += 1;
            if let Some(chain) = store
                .responses
                .get_mut(&oldest)
                .and_then(|s| s.chain.take())
            {
                store.links -= chain.len();
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.store.lock().responses.len()
    }

    #[cfg(test)]
    fn links(&self) -> usize {
        self.store.lock().links
    }

    /// Checks the store's counts against what it holds.
    #[cfg(test)]
    fn check(&self) {
        let store = self.store.lock();
        assert_eq!(store.order.len(), store.responses.len());
        assert!(store.responses.len() <= self.capacity);
        assert!(store.superseded <= store.order.len() && store.dropped <= store.order.len());
        let links: usize = store.responses.values().map(links_of).sum();
        assert_eq!(store.links, links);
        for d in store.order.range(..store.dropped) {
            assert_eq!(links_of(&store.responses[d]), 0);
        }
    }
}

impl fmt::Debug for StoredResponses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoredResponses")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

/// How far into an answer its id is looked for.
const LOOK: usize = 4096;

/// Reads a Responses API answer's id from its first bytes, and remembers under it the
/// request's chain and the backend that answered.
pub(crate) struct IdSniffer {
    seen: Vec<u8>,
    /// What to remember, while the id is looked for.
    stored: Option<Stored>,
    /// The digest of the response the request continues, if it names one.
    continues: Option<u64>,
    store: Arc<StoredResponses>,
}

impl IdSniffer {
    /// Looks for the id of the answer to a request whose chain is `chain` (`None`: not known)
    /// and that continues the response of digest `continues`, if any.
    pub(crate) fn new(
        chain: Option<PromptChain>,
        continues: Option<u64>,
        store: Arc<StoredResponses>,
    ) -> Self {
        IdSniffer {
            seen: Vec::new(),
            stored: Some(Stored {
                chain,
                backend: None,
            }),
            continues,
            store,
        }
    }

    /// The backend that answered, read from the answer's head.
    pub(crate) fn answered_by(&mut self, backend: Option<BackendId>) {
        if let Some(stored) = &mut self.stored {
            stored.backend = backend;
        }
    }

    /// Looks at the next bytes of the answer.
    pub(crate) fn feed(&mut self, bytes: &[u8]) {
        if self.stored.is_none() {
            return;
        }
        let room = LOOK.saturating_sub(self.seen.len());
        self.seen.extend_from_slice(&bytes[..bytes.len().min(room)]);
        if let Some(id) = response_id(&self.seen) {
            if let Some(stored) = self.stored.take() {
                self.store.put(id, stored, self.continues);
            }
        } else if self.seen.len() >= LOOK {
            self.stored = None;
        }
        if self.stored.is_none() {
            self.seen = Vec::new();
        }
    }
}

impl fmt::Debug for IdSniffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdSniffer")
            .field("seen", &self.seen.len())
            .field("looking", &self.stored.is_some())
            .finish()
    }
}

/// The first `"id": "resp..."` in `bytes`: a response's id (an answer's items have ids of
/// their own, `msg_...`, `fc_...`). `None` until the id's closing quote has arrived.
fn response_id(bytes: &[u8]) -> Option<&[u8]> {
    let finder = memchr::memmem::Finder::new(b"\"id\"");
    for at in finder.find_iter(bytes) {
        let mut i = at + 4;
        let skip = |i: &mut usize| {
            while bytes.get(*i).is_some_and(|b| b.is_ascii_whitespace()) {
                *i += 1;
            }
        };
        skip(&mut i);
        if bytes.get(i) != Some(&b':') {
            continue;
        }
        i += 1;
        skip(&mut i);
        if bytes.get(i) != Some(&b'"') {
            continue;
        }
        let start = i + 1;
        let len = memchr::memchr2(b'"', b'\\', bytes.get(start..)?)?;
        let id = &bytes[start..start + len];
        if bytes[start + len] == b'"' && id.starts_with(b"resp") {
            return Some(id);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_response_id_is_found_in_a_json_answer_and_in_a_streams_first_event() {
        let json = br#"{"id": "resp_67ccd2bed", "object":"response","output":[{"id":"msg_1"}]}"#;
        assert_eq!(response_id(json), Some(&b"resp_67ccd2bed"[..]));
        let sse = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_9\",\"status\":\"in_progress\"}}\n\n";
        assert_eq!(response_id(sse), Some(&b"resp_9"[..]));
        // An item's id is not the response's; an id not yet whole is not found yet.
        assert_eq!(response_id(br#"{"item":{"id":"msg_1"}}"#), None);
        assert_eq!(response_id(br#"{"id":"resp_12"#), None);
    }

    #[test]
    fn an_id_split_over_frames_is_found_and_the_chain_remembered() {
        let store = Arc::new(StoredResponses::new(2, usize::MAX));
        let chain = PromptChain::from_blocks([(1, 10)]);
        let mut sniff = IdSniffer::new(Some(chain.clone()), None, store.clone());
        sniff.answered_by(Some(BackendId::from("gpu-1")));
        sniff.feed(br#"{"id":"re"#);
        assert!(store.get("resp_1").is_none());
        sniff.feed(br#"sp_1","object":"response"}"#);
        let stored = store.get("resp_1").unwrap();
        assert_eq!(stored.chain, Some(chain));
        assert_eq!(stored.backend, Some(BackendId::from("gpu-1")));
    }

    #[test]
    fn an_answer_without_an_id_is_given_up_after_its_first_bytes() {
        let store = Arc::new(StoredResponses::new(2, usize::MAX));
        let mut sniff = IdSniffer::new(
            Some(PromptChain::from_blocks([(1, 10)])),
            None,
            store.clone(),
        );
        sniff.feed(&[b'x'; LOOK + 10]);
        sniff.feed(br#"{"id":"resp_late"}"#);
        assert_eq!(store.len(), 0);
    }

    #[test]
    fn the_oldest_responses_are_forgotten_first() {
        let store = StoredResponses::new(2, usize::MAX);
        for (i, id) in ["resp_a", "resp_b", "resp_c"].iter().enumerate() {
            let chain = Some(PromptChain::from_blocks([(i as u64, 1)]));
            store.put(
                id.as_bytes(),
                Stored {
                    chain,
                    backend: None,
                },
                None,
            );
        }
        assert!(store.get("resp_a").is_none());
        assert!(store.get("resp_b").is_some() && store.get("resp_c").is_some());
    }

    /// Puts response `id`, answered by a backend of the same name, with `chain`, continuing
    /// the response `continues` names; then checks the store's counts.
    fn put_continuing(
        store: &StoredResponses,
        id: &str,
        chain: PromptChain,
        continues: Option<&str>,
    ) {
        let stored = Stored {
            chain: Some(chain),
            backend: Some(BackendId::from(id)),
        };
        store.put(
            id.as_bytes(),
            stored,
            continues.map(|c| digest(c.as_bytes())),
        );
        store.check();
    }

    #[test]
    fn a_response_continued_is_forgotten_before_those_none_continues() {
        let store = StoredResponses::new(4, usize::MAX);
        let put = |id: &str, continues| {
            let chain = PromptChain::from_blocks([(digest(id.as_bytes()), 1)]);
            put_continuing(&store, id, chain, continues);
        };
        let kept = |id: &str| {
            store
                .get(id)
                .map(|s| (s.backend.is_some(), s.chain.is_some()))
        };
        // The oldest is another conversation's latest, then a conversation of three turns.
        put("resp_other", None);
        put("resp_1", None);
        put("resp_2", Some("resp_1"));
        put("resp_3", Some("resp_2"));
        // Under the capacity, the turns continued keep their backends and chains (a branch
        // goes on from them).
        for id in ["resp_other", "resp_1", "resp_2", "resp_3"] {
            assert_eq!(kept(id), Some((true, true)));
        }
        // Past the capacity, the earliest superseded goes first, then the next; the oldest
        // response that none continues stays.
        put("resp_4", Some("resp_3"));
        assert_eq!(kept("resp_1"), None);
        assert_eq!(kept("resp_2"), Some((true, true)));
        put("resp_new", None);
        assert_eq!(kept("resp_2"), None);
        assert_eq!(kept("resp_other"), Some((true, true)));
        // A branch from a response superseded already moves nothing; the last superseded
        // goes.
        put("resp_branch", Some("resp_3"));
        assert_eq!(kept("resp_3"), None);
        assert_eq!(kept("resp_other"), Some((true, true)));
        // With nothing superseded left, the oldest goes. One continuing a response not
        // remembered, or itself, supersedes nothing.
        put("resp_5", Some("resp_gone"));
        assert_eq!(kept("resp_other"), None);
        put("resp_5", Some("resp_5"));
        assert_eq!(kept("resp_5"), Some((true, true)));
        assert_eq!(store.len(), 4);
    }

    #[test]
    fn a_response_continued_loses_its_chain_before_those_none_continues() {
        let store = StoredResponses::new(100, 6);
        let put = |id: &str, continues| {
            let chain = PromptChain::from_blocks([(1, 1), (2, 1)]);
            put_continuing(&store, id, chain, continues);
        };
        let has_chain = |id: &str| store.get(id).is_some_and(|s| s.chain.is_some());
        put("resp_other", None);
        put("resp_1", None);
        put("resp_2", Some("resp_1"));
        assert!(has_chain("resp_other") && has_chain("resp_1") && has_chain("resp_2"));
        // Past the links, the chain of the turn continued goes before the older one's.
        put("resp_3", Some("resp_2"));
        assert!(!has_chain("resp_1") && has_chain("resp_other"));
        assert!(has_chain("resp_2") && has_chain("resp_3"));
        assert_eq!(store.links(), 6);
        // A branch from a superseded response whose chain is gone leaves it without one; the
        // next superseded goes first still, and its backend stays.
        put("resp_branch", Some("resp_1"));
        assert!(!has_chain("resp_2") && has_chain("resp_other"));
        assert_eq!(
            store.get("resp_2").and_then(|s| s.backend),
            Some(BackendId::from("resp_2"))
        );
    }

    proptest::proptest! {
        /// Whatever is put and continued, the store keeps its bounds and its counts.
        #[test]
        fn the_store_keeps_its_bounds_whatever_is_continued(
            puts in proptest::collection::vec((0..12u8, proptest::option::of(0..12u8), 0..5u64), 1..80),
            capacity in 1..8usize,
            max_links in 0..12usize,
        ) {
            let store = StoredResponses::new(capacity, max_links);
            for (id, continues, links) in puts {
                let id = format!("resp_{id}");
                let stored = Stored {
                    chain: Some(PromptChain::from_blocks((0..links).map(|i| (i, 1)))),
                    backend: None,
                };
                let continues = continues.map(|c| digest(format!("resp_{c}").as_bytes()));
                store.put(id.as_bytes(), stored, continues);
                store.check();
                proptest::prop_assert!(store.len() <= capacity);
                proptest::prop_assert!(store.get(&id).is_some());
            }
        }
    }

    #[test]
    fn the_remembered_chains_are_bounded_by_their_links_too() {
        let store = StoredResponses::new(100, 10);
        let chain = |n: u64| Some(PromptChain::from_blocks((0..n).map(|i| (i, 1))));
        let put = |id: &str, n| {
            let stored = Stored {
                chain: chain(n),
                backend: Some(BackendId::from("gpu-1")),
            };
            store.put(id.as_bytes(), stored, None);
        };
        let backend = |id: &str| store.get(id).and_then(|s| s.backend);
        let has_chain = |id: &str| store.get(id).is_some_and(|s| s.chain.is_some());
        put("resp_a", 4);
        put("resp_b", 4);
        assert_eq!((store.len(), store.links()), (2, 8));
        // A third of 4 links is past the budget of 10: the oldest chain goes, and the
        // response stays, with the backend that answered it.
        put("resp_c", 4);
        assert_eq!((store.len(), store.links()), (3, 8));
        assert!(!has_chain("resp_a") && has_chain("resp_b") && has_chain("resp_c"));
        assert_eq!(backend("resp_a"), Some(BackendId::from("gpu-1")));
        // Put again under its id, a response's links are counted once, and it is the newest.
        put("resp_b", 6);
        assert_eq!((store.len(), store.links()), (3, 10));
        put("resp_e", 1);
        assert_eq!((store.len(), store.links()), (4, 7));
        assert!(!has_chain("resp_c") && has_chain("resp_b"));
        // One longer than the whole budget keeps its chain, alone.
        put("resp_d", 30);
        assert_eq!((store.len(), store.links()), (5, 30));
        assert!(has_chain("resp_d") && !has_chain("resp_b") && !has_chain("resp_e"));
        // Past the responses' capacity, the oldest go, chain or not.
        for i in 0..100 {
            put(&format!("resp_{i}"), 0);
        }
        assert_eq!((store.len(), store.links()), (100, 0));
        assert!(backend("resp_a").is_none());
        assert_eq!(backend("resp_99"), Some(BackendId::from("gpu-1")));
    }
}
