//! The leading messages: kept from the body as their JSON text, and digested only when asked.
//!
//! The digest is the SHA-256 of the messages as `serde_json::to_vec` writes them as `Value`s
//! (keys sorted, no whitespace, strings escaped as serde_json escapes them). Writing them out
//! costs about as much as reading a 12 KiB system prompt again, and nothing on the request
//! path reads the digest, so the parse keeps the text and [`PromptFacts::leading_digest`]
//! writes and hashes it.
//!
//! [`PromptFacts::leading_digest`]: super::PromptFacts::leading_digest

use std::fmt;

use bytes::Bytes;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::canonical;
use super::PromptFacts;

const MAX: usize = PromptFacts::LEADING_MESSAGES;

/// The JSON text of a body's first messages, one after another.
#[derive(Clone)]
pub(super) struct LeadingMessages {
    text: Bytes,
    /// Where each message ends in `text`; the first `count` are used.
    ends: [usize; MAX],
    count: usize,
}

impl LeadingMessages {
    /// The first [`PromptFacts::LEADING_MESSAGES`] of `messages` messages, each written as
    /// its JSON by `write(index, out)`; `None` if there are none.
    pub(super) fn new(messages: usize, mut write: impl FnMut(usize, &mut Vec<u8>)) -> Option<Self> {
        let count = messages.min(MAX);
        if count == 0 {
            return None;
        }
        let mut text = Vec::new();
        let mut ends = [0; MAX];
        for (i, end) in ends.iter_mut().enumerate().take(count) {
            write(i, &mut text);
            *end = text.len();
        }
        Some(LeadingMessages {
            text: Bytes::from(text),
            ends,
            count,
        })
    }

    /// The digest, if the messages are JSON.
    pub(super) fn digest(&self) -> Option<[u8; 32]> {
        let mut messages = [""; MAX];
        let mut start = 0;
        for (m, &end) in messages.iter_mut().zip(&self.ends[..self.count]) {
            *m = std::str::from_utf8(self.text.get(start..end)?).ok()?;
            start = end;
        }
        let messages = &messages[..self.count];
        // The same bytes as `serde_json::to_vec` of the messages as `Value`s, hashed as they
        // are written; without the `Value`s where the messages allow.
        let mut hasher = Sha256::new();
        if canonical::write_messages(messages, &mut hasher).is_some() {
            return Some(hasher.finalize().into());
        }
        let values = messages
            .iter()
            .map(|m| serde_json::from_str(m))
            .collect::<Result<Vec<Value>, _>>()
            .ok()?;
        serde_json::to_writer(&mut hasher, &values).ok()?;
        Some(hasher.finalize().into())
    }
}

impl fmt::Debug for LeadingMessages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeadingMessages")
            .field("messages", &self.count)
            .field("bytes", &self.text.len())
            .finish()
    }
}
