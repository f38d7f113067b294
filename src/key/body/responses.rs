//! Conversations the server keeps: the OpenAI Responses API's `previous_response_id`.
//!
//! A request that names a previous response sends only its new input; the server puts the
//! conversation that response ended back in front of it. So the request's prompt is the
//! named response's prompt, then the new input, and its chain continues that prompt's chain.
//! The response's id is in its answer: the `id` of a JSON answer, or of the `response` in a
//! stream's first event. The layer reads it from the answer's first bytes as they pass and
//! remembers the chains of the latest responses, a bounded number of them.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_64;

use crate::PromptChain;

/// The chains of the latest responses, by their ids' digests; the oldest is forgotten first.
pub(crate) struct ResponseChains {
    store: Mutex<Store>,
    capacity: usize,
}

#[derive(Default)]
struct Store {
    chains: HashMap<u64, PromptChain>,
    order: VecDeque<u64>,
}

impl ResponseChains {
    /// How many responses' chains are kept by default.
    pub(crate) const DEFAULT_CAPACITY: usize = 4096;

    pub(crate) fn new(capacity: usize) -> Self {
        ResponseChains {
            store: Mutex::new(Store::default()),
            capacity: capacity.max(1),
        }
    }

    /// The chain of the request that response `id` answered, if it is remembered.
    pub(crate) fn get(&self, id: &str) -> Option<PromptChain> {
        self.store
            .lock()
            .chains
            .get(&xxh3_64(id.as_bytes()))
            .cloned()
    }

    fn put(&self, id: &[u8], chain: PromptChain) {
        let digest = xxh3_64(id);
        let mut store = self.store.lock();
        if store.chains.insert(digest, chain).is_none() {
            store.order.push_back(digest);
        }
        while store.order.len() > self.capacity {
            if let Some(old) = store.order.pop_front() {
                store.chains.remove(&old);
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.store.lock().chains.len()
    }
}

impl fmt::Debug for ResponseChains {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseChains")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

/// How far into an answer its id is looked for.
const LOOK: usize = 4096;

/// Reads a Responses API answer's id from its first bytes, and remembers the request's chain
/// under it.
pub(crate) struct IdSniffer {
    seen: Vec<u8>,
    chain: Option<PromptChain>,
    store: Arc<ResponseChains>,
}

impl IdSniffer {
    pub(crate) fn new(chain: PromptChain, store: Arc<ResponseChains>) -> Self {
        IdSniffer {
            seen: Vec::new(),
            chain: Some(chain),
            store,
        }
    }

    /// Looks at the next bytes of the answer.
    pub(crate) fn feed(&mut self, bytes: &[u8]) {
        if self.chain.is_none() {
            return;
        }
        let room = LOOK.saturating_sub(self.seen.len());
        self.seen.extend_from_slice(&bytes[..bytes.len().min(room)]);
        if let Some(id) = response_id(&self.seen) {
            if let Some(chain) = self.chain.take() {
                self.store.put(id, chain);
            }
        } else if self.seen.len() >= LOOK {
            self.chain = None;
        }
        if self.chain.is_none() {
            self.seen = Vec::new();
        }
    }
}

impl fmt::Debug for IdSniffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdSniffer")
            .field("seen", &self.seen.len())
            .field("looking", &self.chain.is_some())
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
        let store = Arc::new(ResponseChains::new(2));
        let chain = PromptChain::from_blocks([(1, 10)]);
        let mut sniff = IdSniffer::new(chain.clone(), store.clone());
        sniff.feed(br#"{"id":"re"#);
        assert!(store.get("resp_1").is_none());
        sniff.feed(br#"sp_1","object":"response"}"#);
        assert_eq!(store.get("resp_1"), Some(chain));
    }

    #[test]
    fn an_answer_without_an_id_is_given_up_after_its_first_bytes() {
        let store = Arc::new(ResponseChains::new(2));
        let mut sniff = IdSniffer::new(PromptChain::from_blocks([(1, 10)]), store.clone());
        sniff.feed(&[b'x'; LOOK + 10]);
        sniff.feed(br#"{"id":"resp_late"}"#);
        assert_eq!(store.len(), 0);
    }

    #[test]
    fn the_oldest_responses_are_forgotten_first() {
        let store = ResponseChains::new(2);
        for (i, id) in ["resp_a", "resp_b", "resp_c"].iter().enumerate() {
            store.put(id.as_bytes(), PromptChain::from_blocks([(i as u64, 1)]));
        }
        assert!(store.get("resp_a").is_none());
        assert!(store.get("resp_b").is_some() && store.get("resp_c").is_some());
    }
}
