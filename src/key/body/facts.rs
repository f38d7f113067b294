//! [`PromptFacts`]: what the body says about the prompt.

use std::sync::Arc;

use super::inspect::Config;
use super::leading::LeadingMessages;
use crate::slots::NamedSlot;
use crate::{BackendId, PromptChain};

/// What a [`BodyKey`](super::BodyKey) learned about a request's prompt, put in the request's
/// extensions for placement policies and metrics to read.
///
/// The [`chain`](Self::chain) is what the cache model works with: a digest of the prompt at
/// every message boundary and every [`BLOCK_BYTES`](Self::BLOCK_BYTES) inside a long message
/// or a text prompt (see [`BodyKeyLayer`](crate::key::BodyKeyLayer) for which members make the prompt). The service
/// reads it from the request's extensions; a layer of your own can put one there with
/// [`PromptFacts::from_chain`].
///
/// The [leading digest](Self::leading_digest) covers the first
/// [`LEADING_MESSAGES`](Self::LEADING_MESSAGES) entries of an OpenAI-style `messages` array
/// (as re-serialized, so insignificant whitespace does not matter): requests that share it
/// share their system prompt and first message. An Anthropic body's `messages` are digested
/// alike, but its system prompt stands apart, in `system`: there the digest covers the first
/// user message and the reply to it, and requests with other system prompts may share it.
/// It is a hint for grouping prefixes, never a session key: the agents of one swarm all
/// share it. The facts keep those messages' text and compute the digest when it is asked
/// for.
///
/// They keep the body's top-level `id_slot` too, read in the same pass: on a backend whose
/// slots the router assigns ([`Backend::assign_slots`](crate::Backend::assign_slots)), a
/// request that names its own slot is assigned that slot or none. A body
/// [`skip_when_header`](crate::key::BodyKeyLayer::skip_when_header) leaves unread gets facts
/// only when it has a top-level `id_slot` (one naming a slot, or none, as `-1` does), and
/// they say nothing else. Facts made with
/// [`from_chain`](Self::from_chain) name no slot.
///
/// ```
/// use tower_affinity::key::PromptFacts;
///
/// let body = br#"{"messages":[{"role":"system","content":"be brief"},
///                              {"role":"user","content":"hi"},
///                              {"role":"assistant","content":"hello"}]}"#;
/// let facts = PromptFacts::from_body(body);
/// assert_eq!(facts.body_bytes, body.len());
/// assert_eq!(facts.messages, 3);
/// assert!(facts.leading_digest().is_some());
///
/// assert_eq!(facts.chain.len(), 3);
///
/// // The next turn shares the three messages, and adds two.
/// let next = br#"{"messages":[{"role":"system","content":"be brief"},
///                              {"role":"user","content":"hi"},
///                              {"role":"assistant","content":"hello"},
///                              {"role":"user","content":"and now?"},
///                              {"role":"assistant","content":"now this"}]}"#;
/// assert_eq!(PromptFacts::from_body(next).chain.common_prefix(&facts.chain), 3);
///
/// let other = PromptFacts::from_body(b"not json");
/// assert_eq!((other.messages, other.leading_digest()), (0, None));
/// assert!(other.chain.is_empty());
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PromptFacts {
    /// The size of the request body in bytes.
    pub body_bytes: usize,
    /// How many entries the body's `messages` array has (0 if none).
    pub messages: usize,
    /// The prompt's chain: empty if the body has no prompt, or if it continues a stored
    /// response (`previous_response_id`) whose conversation the layer does not know.
    pub chain: PromptChain,
    /// The backend that answered the response this request continues (the OpenAI Responses
    /// API's `previous_response_id`), when the layer saw that answer. That backend stores the
    /// conversation and no other can continue it (vLLM keeps stored responses in its
    /// process's memory), so the service sends the request there, whatever the policy,
    /// waiting for a slot there if it must (as [`Overflow`](crate::Overflow) says) rather
    /// than spilling. A backend that has left the fleet or is down does not hold it back:
    /// it is then placed as any request is. See
    /// [`BodyKeyLayer::pin_stored_responses`](crate::key::BodyKeyLayer::pin_stored_responses).
    pub stored_on: Option<BackendId>,
    /// The leading messages' text, for [`leading_digest`](Self::leading_digest).
    pub(super) leading: Option<LeadingMessages>,
    /// The body's top-level `model`, for [`model`](Self::model).
    pub(super) model: Option<Arc<str>>,
    /// The body's top-level `id_slot`: the slot the client chose, which the router assigns
    /// rather than one of its own choosing (see
    /// [`Backend::assign_slots`](crate::Backend::assign_slots)).
    pub(crate) named_slot: NamedSlot,
}

/// Facts are equal when their sizes, message counts, leading digests, chains, stored
/// responses' backends, models and `id_slot`s are: the leading messages' whitespace does not
/// count, as it does not in the digest.
impl PartialEq for PromptFacts {
    fn eq(&self, other: &Self) -> bool {
        self.body_bytes == other.body_bytes
            && self.messages == other.messages
            && self.chain == other.chain
            && self.stored_on == other.stored_on
            && self.leading_digest() == other.leading_digest()
            && self.model == other.model
            && self.named_slot == other.named_slot
    }
}

impl Eq for PromptFacts {}

impl PromptFacts {
    /// How many messages the digest covers: in an OpenAI-style `messages` array, the system
    /// prompt and the first user message.
    pub const LEADING_MESSAGES: usize = 2;

    /// The bytes of a block inside a long message or a text prompt: about 512 tokens, the
    /// block of a Mooncake trace's `hash_ids`. A message that is partly shared with an
    /// earlier one matches up to its last whole block in common; the backends reuse more
    /// finely (vLLM's KV cache blocks are 16 tokens by default, llama-server and SGLang
    /// reuse a prefix to the token), so up to a block more than the chain says.
    pub const BLOCK_BYTES: usize = 2048;

    /// The SHA-256 of the leading messages as `serde_json` writes them as `Value`s (keys
    /// sorted, no whitespace), if the body has any and they are JSON. It is computed on each
    /// call, from the messages' text the facts keep: about as long as reading them again.
    ///
    /// ```
    /// use tower_affinity::key::PromptFacts;
    /// use sha2::{Digest, Sha256};
    ///
    /// let body = br#"{"messages":[{"role":"system", "content":"be brief"},
    ///                              {"role":"user","content":"hi"},
    ///                              {"role":"assistant","content":"hello"}]}"#;
    /// let written = br#"[{"content":"be brief","role":"system"},{"content":"hi","role":"user"}]"#;
    /// let expected: [u8; 32] = Sha256::digest(written).into();
    /// assert_eq!(PromptFacts::from_body(body).leading_digest(), Some(expected));
    /// assert_eq!(PromptFacts::from_body(br#"{"prompt":"hi"}"#).leading_digest(), None);
    /// ```
    pub fn leading_digest(&self) -> Option<[u8; 32]> {
        self.leading.as_ref().and_then(LeadingMessages::digest)
    }

    /// The body's top-level `model`, if it is a string: the model the request asks for, to
    /// route by when one proxy fronts a fleet for each model (the README's "Several models"
    /// puts a balancer per model behind one [`BodyKeyLayer`](crate::key::BodyKeyLayer)). Read
    /// in the same pass as the rest, so that routing by it costs no second parse of the body.
    /// A key field starting with `model` ([`BodyKeyLayer::fields`](crate::key::BodyKeyLayer::fields))
    /// reads it as a key instead, and this is `None`.
    ///
    /// ```
    /// use tower_affinity::key::PromptFacts;
    ///
    /// let body = br#"{"model":"qwen3-coder","messages":[{"role":"user","content":"hi"}]}"#;
    /// assert_eq!(PromptFacts::from_body(body).model(), Some("qwen3-coder"));
    /// assert_eq!(PromptFacts::from_body(br#"{"model":7}"#).model(), None);
    /// ```
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// The facts of a whole request body.
    pub fn from_body(body: &[u8]) -> Self {
        Config::new(usize::MAX).inspect(body).1
    }

    /// Facts that carry only a chain, for a layer or a simulator that builds its own (see
    /// [`PromptChain::from_blocks`]).
    ///
    /// ```
    /// use tower_affinity::key::PromptFacts;
    /// use tower_affinity::PromptChain;
    ///
    /// let mut req = http::Request::new(());
    /// let chain = PromptChain::from_blocks([(1, 512), (2, 512)]);
    /// req.extensions_mut().insert(PromptFacts::from_chain(chain));
    /// ```
    pub fn from_chain(chain: PromptChain) -> Self {
        PromptFacts {
            body_bytes: chain.links().last().map_or(0, |l| l.bytes as usize),
            messages: 0,
            chain,
            stored_on: None,
            leading: None,
            model: None,
            named_slot: NamedSlot::Absent,
        }
    }
}
