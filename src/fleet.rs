//! Nodes, backends and their slot counters: the fleet that discovery builds.
//!
//! The fleet keeps what placement reads (the [`Topology`]) apart from the backends' services, so
//! that the read-only [`FleetView`](crate::placement::FleetView) handed to a policy is not
//! generic over the service type.
//!
//! Backends live in a vector and are named internally by their index. An index and its
//! generation together name one backend for its lifetime: a session table entry that points at
//! a removed backend is recognised by a changed generation. Removing a backend frees its index
//! for reuse once 64 others have been removed after it, but re-inserting the same id before
//! that takes back the index and generation, so the sessions homed there stay.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::cache::ModelCell;
use crate::learn::Learned;
use crate::metrics::BackendMetrics;
use crate::placement::rendezvous::{RankSet, Ranked};
use crate::slots::{NamedSlot, SlotTable};
use crate::stats::Counters;
use crate::wait::WaitList;
use crate::{AssignedSlot, PromptChain};
use parking_lot::Mutex;
use tokio::time::Instant;

/// The name of a backend (one model-server process). Cheap to clone.
///
/// ```
/// use tower_affinity::BackendId;
///
/// let id = BackendId::from("gpu-0");
/// assert_eq!(id.as_str(), "gpu-0");
/// assert_eq!(id, "gpu-0"); // compares with a name as given
///
/// // From names kept elsewhere, by reference or shared.
/// let names = vec![String::from("gpu-1"), String::from("gpu-2")];
/// let ids: Vec<BackendId> = names.iter().map(BackendId::from).collect();
/// assert_eq!(ids, ["gpu-1", "gpu-2"]);
/// let shared: std::sync::Arc<str> = "gpu-3".into();
/// assert_eq!(BackendId::from(shared), "gpu-3");
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendId(Arc<str>);

/// The name of a node (a host that runs one or more backends). Cheap to clone.
///
/// ```
/// use tower_affinity::NodeId;
///
/// assert_eq!(NodeId::from("host-a").to_string(), "host-a");
/// assert_eq!(NodeId::from("host-a"), "host-a");
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(Arc<str>);

macro_rules! impl_name {
    ($t:ident) => {
        impl $t {
            /// The name as a string.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl std::borrow::Borrow<str> for $t {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $t {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl PartialEq<str> for $t {
            fn eq(&self, other: &str) -> bool {
                *self.0 == *other
            }
        }

        impl PartialEq<&str> for $t {
            fn eq(&self, other: &&str) -> bool {
                *self.0 == **other
            }
        }

        impl PartialEq<$t> for str {
            fn eq(&self, other: &$t) -> bool {
                *self == *other.0
            }
        }

        impl PartialEq<$t> for &str {
            fn eq(&self, other: &$t) -> bool {
                **self == *other.0
            }
        }

        impl From<&str> for $t {
            fn from(s: &str) -> Self {
                $t(s.into())
            }
        }

        impl From<String> for $t {
            fn from(s: String) -> Self {
                $t(s.into())
            }
        }

        impl From<&String> for $t {
            fn from(s: &String) -> Self {
                $t(s.as_str().into())
            }
        }

        impl From<Arc<str>> for $t {
            fn from(s: Arc<str>) -> Self {
                $t(s)
            }
        }

        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }
    };
}

impl_name!(BackendId);
impl_name!(NodeId);

/// A backend as discovery announces it: its service, its node, its slots, and its prompt-cache
/// budget if known.
///
/// `slots` is the number of requests the backend serves at once (llama.cpp's `--parallel`); the
/// router never sends more than that unless told to overcommit.
///
/// Its cache budget, in tokens, is what the [cache model](crate::placement) assumes it can hold
/// of the prompts it served: [`Backend::DEFAULT_CACHE_TOKENS`] unless [`cache_tokens`] says
/// otherwise.
///
/// ```
/// use std::num::NonZeroU32;
/// use tower_affinity::Backend;
///
/// let b = Backend::new("host-a", ())
///     .slots(NonZeroU32::new(4).unwrap())
///     .cache_tokens(4 * 32_768 + 65_536);
/// assert_eq!(b.slot_count().get(), 4);
/// assert_eq!(b.node().as_str(), "host-a");
/// assert_eq!(b.cache_budget(), 196_608);
/// ```
///
/// [`cache_tokens`]: Backend::cache_tokens
#[derive(Clone)]
pub struct Backend<S> {
    service: S,
    node: NodeId,
    slots: NonZeroU32,
    /// Whether `slots` was given, rather than the default of one.
    slots_given: bool,
    prompt_cache_bytes: Option<u64>,
    cache_tokens: u64,
    context: Option<NonZeroU64>,
    request_context: Option<NonZeroU64>,
    assign_slots: bool,
    extensions: http::Extensions,
}

impl<S> Backend<S> {
    /// A backend on `node` with one slot.
    pub fn new(node: impl Into<NodeId>, service: S) -> Self {
        Backend {
            service,
            node: node.into(),
            slots: NonZeroU32::MIN,
            slots_given: false,
            prompt_cache_bytes: None,
            cache_tokens: Self::DEFAULT_CACHE_TOKENS,
            context: None,
            request_context: None,
            assign_slots: false,
            extensions: http::Extensions::new(),
        }
    }

    /// The cache budget assumed when none is given: 131,072 tokens, llama.cpp's default 8 GiB
    /// host-memory prompt cache (`--cache-ram`) at 128 KiB of KV a token (a model of 8 to 30B
    /// parameters with grouped-query attention) and as much again in the slots' KV.
    pub const DEFAULT_CACHE_TOKENS: u64 = 131_072;

    /// The most slots a backend is counted with: a count above it (a typo, or a `/slots`
    /// gone wrong) is read as this many. No model server serves this many requests at once,
    /// and it keeps a fleet's sums of slots within range.
    pub const MAX_SLOTS: NonZeroU32 = NonZeroU32::new(1 << 16).unwrap();

    /// Sets how many tokens of prompt the backend keeps cached: its KV on the GPU plus its
    /// host-memory prompt cache. The cache model evicts, least recently used first, past this;
    /// when the backend's answers show it reused more than the model predicted (llama.cpp's
    /// slots keep their last prompt beyond `--cache-ram`), the model's budget grows by a
    /// sixteenth of this at a time, up to twice it.
    ///
    /// Each server states its own figures:
    ///
    /// - llama-server: its context (`-c`, shared by its slots) plus `--cache-ram` (MiB) times
    ///   1,048,576 divided by the model's KV bytes a token (2 x layers x KV heads x head size
    ///   x bytes an element: 128 KiB for 64 layers with 4 KV heads of 128 at f16, as the
    ///   study's 27B model has, so the default 8 GiB holds 65,536 tokens);
    /// - vLLM: the `GPU KV cache size: N tokens` it logs at start, plus the tokens its CPU
    ///   offloading holds, if on;
    /// - SGLang: the `max_total_num_tokens` it logs at start, plus its hierarchical cache's
    ///   host tokens, if on.
    ///
    /// 0 says the backend keeps nothing cached: every turn after the first finds its home
    /// cold ([`Outcome::ColdHome`](crate::Outcome::ColdHome)) and is placed like a new session.
    ///
    /// Announced again with another budget, the backend's model keeps to the new one from
    /// then on: a lower budget evicts its least recently used prompts at once, and the model
    /// keeps within the memory bound of the new budget, as if announced with it from the
    /// start.
    pub fn cache_tokens(mut self, tokens: u64) -> Self {
        self.cache_tokens = tokens;
        self
    }

    /// The cache budget in tokens.
    pub fn cache_budget(&self) -> u64 {
        self.cache_tokens
    }

    /// Sets how many requests the backend serves at once (at most
    /// [`MAX_SLOTS`](Self::MAX_SLOTS): more is read as that many).
    pub fn slots(mut self, slots: NonZeroU32) -> Self {
        self.slots = slots.min(Self::MAX_SLOTS);
        self.slots_given = true;
        self
    }

    /// Sets the tokens of context the backend's running requests share: llama-server's `-c`
    /// with a unified KV cache (its default when `-np` is not given, and with `--kv-unified`).
    /// The router then sends a request to the backend only while the prompts of its requests
    /// in flight and this one's fit in it, or while nothing is in flight there; otherwise the
    /// backend is full for that request, as when its slots are taken: the request goes
    /// elsewhere, or waits ([`overflow`](crate::SessionAffinityLayer::overflow)), or waits for
    /// this backend when it holds the request's cache and waiting costs less than reading the
    /// prompt again elsewhere
    /// ([`wait_versus_move`](crate::SessionAffinityLayer::wait_versus_move)). Without it, the
    /// default, only the slots count.
    ///
    /// A llama-server whose running requests overfill a unified KV cache clears its idle
    /// slots, halves its batch, and then fails every request it runs with `500 Context size
    /// has been exceeded.`: two prompts that each fit can fail together. With `-np` and no
    /// `--kv-unified`, each slot has its share of `-c` and the server refuses a longer prompt
    /// itself (400); the limit is not needed there.
    ///
    /// A prompt's tokens are the [prompt chain](crate::PromptChain)'s estimate (four bytes a
    /// token, a digit a token), scaled by what the backend's answers have taught of its own
    /// tokens per token of the estimate (see
    /// [`observe_usage`](crate::SessionAffinityLayer::observe_usage)).
    /// Until its first answer that reports its usage, a token is counted as two bytes, on the
    /// safe side: a prompt counted short could overfill the context, and the failures that
    /// follow report nothing to learn from. A request without a chain counts none. Tokens a
    /// request generates are not counted: give the context less the longest answer expected,
    /// and something for the chat template. Router replicas each count their own requests:
    /// `N` replicas can fill a backend's context `N` times over, so give each `1/N` of it. A
    /// long prompt waiting for room can be passed by shorter ones that fit meanwhile.
    ///
    /// vLLM and SGLang do not need it: they hold a request back until its KV fits.
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use tower_affinity::Backend;
    ///
    /// // llama-server -c 131072 (4 slots, one KV cache): answers of up to 8,192 tokens.
    /// let b = Backend::new("gpu-0", ()).context_tokens(NonZeroU64::new(131_072 - 8_192).unwrap());
    /// assert_eq!(b.context_limit().map(NonZeroU64::get), Some(122_880));
    /// ```
    pub fn context_tokens(mut self, tokens: NonZeroU64) -> Self {
        self.context = Some(tokens);
        self
    }

    /// The tokens of context the backend's running requests share, if given
    /// ([`context_tokens`](Self::context_tokens)).
    pub fn context_limit(&self) -> Option<NonZeroU64> {
        self.context
    }

    /// Sets the most tokens of context one request can take on the backend: with `-np N` and
    /// no `--kv-unified`, llama-server gives each slot `-c / N` and refuses a longer prompt
    /// (`400`, `exceed_context_size_error`); vLLM's `--max-model-len`; SGLang's
    /// `--context-length`. llama-server's `/slots` says it, as each slot's `n_ctx`, vLLM's and
    /// SGLang's `/v1/models` as `max_model_len`, and a
    /// [health probe](crate::health::HealthProbe) reads it there when it is not given. Without
    /// it, a backend given [`context_tokens`](Self::context_tokens) takes a request of up to
    /// those. Where none is known, a refusal read by [`ReadRefusals`](crate::ReadRefusals)
    /// and retried sets it (llama-server's `n_ctx`, the context vLLM's and SGLang's message
    /// states), until the backend is announced again.
    ///
    /// A request whose prompt is this long or longer (it must leave its answer a token) does
    /// not go to the backend while a backend up with a larger request context (or none)
    /// takes it: it is placed as if the backend were passed over (see
    /// [`Candidates::pass_over`](crate::placement::Candidates::pass_over)), so that a
    /// conversation that outgrows its home's slots moves to a backend whose slots hold it,
    /// rather than be refused at home. Where the policy offers no backend up that
    /// takes it, it is placed as if no backend had a limit, and the backend answers for
    /// itself. A prompt never moves between backends of the same limit, whose estimates of it
    /// differ only by what each has learned: one that a backend finds too long goes to a
    /// larger one or stays. A request that continues a response stored on a backend goes
    /// there all the same ([`PromptFacts::stored_on`](crate::key::PromptFacts::stored_on)).
    ///
    /// A prompt's tokens are the [prompt chain](crate::PromptChain)'s estimate, scaled by
    /// what the backend's answers have taught of its own tokens per token of the estimate;
    /// until then, the estimate as it is (four bytes a token, a digit a token): counted short,
    /// a prompt goes where it would have gone without the limit. A request without a chain counts none. A
    /// prompt of denser text than the backend's average can be more tokens than estimated and
    /// be refused: [`ReadRefusals`](crate::ReadRefusals) and [`RetryOnce`](crate::RetryOnce)
    /// retry it where it fits, counted as the backend counted it.
    ///
    /// ```
    /// use std::num::NonZeroU64;
    /// use tower_affinity::Backend;
    ///
    /// // llama-server -c 65536 -np 4: 16,384 tokens a slot.
    /// let b = Backend::new("gpu-0", ()).request_context_tokens(NonZeroU64::new(16_384).unwrap());
    /// assert_eq!(b.request_context_limit().map(NonZeroU64::get), Some(16_384));
    /// // One KV cache for all slots: a request may take all of it.
    /// let u = Backend::new("gpu-1", ()).context_tokens(NonZeroU64::new(65_536).unwrap());
    /// assert_eq!(u.request_context_limit().map(NonZeroU64::get), Some(65_536));
    /// ```
    pub fn request_context_tokens(mut self, tokens: NonZeroU64) -> Self {
        self.request_context = Some(tokens);
        self
    }

    /// The most tokens of context one request can take on the backend: those given with
    /// [`request_context_tokens`](Self::request_context_tokens), else those its running
    /// requests share ([`context_tokens`](Self::context_tokens)), if either was given.
    pub fn request_context_limit(&self) -> Option<NonZeroU64> {
        self.request_context.or(self.context)
    }

    /// Whether the request context was given with
    /// [`request_context_tokens`](Self::request_context_tokens); if not, a health probe
    /// reading llama-server's `/slots` sets it from the slots' `n_ctx`.
    pub fn request_context_given(&self) -> bool {
        self.request_context.is_some()
    }

    /// Has the router assign this backend's slots: each request it sends here that
    /// llama-server runs in the slot it names (a completion of OpenAI's APIs or
    /// llama-server's own; not an Anthropic Messages request, an embedding or a reranking,
    /// which llama-server places itself whatever they name, nor a token count) takes one of
    /// the backend's [`slots`](Self::slots),
    /// numbered from 0, and carries it as an
    /// [`AssignedSlot`] extension, which the `client` feature's `IdSlot` sends as
    /// llama-server's `id_slot`. For llama-server only: vLLM and SGLang share their KV by
    /// prefix and have no slots to assign. llama-server reads `id_slot` in its own
    /// `/completion`, in OpenAI's chat and completions and in the Responses API, but not in
    /// Anthropic's Messages (`/v1/messages`), whose conversion to a chat completion keeps only
    /// a few of the body's fields: such a request takes no slot, as an embedding does, and
    /// llama-server chooses one by similarity (a conversation's own, as long as it holds the
    /// conversation).
    ///
    /// llama-server, left to choose, gives a request the idle slot whose last prompt shares
    /// the most with it, even when another slot is empty, and keeps only what they share of
    /// that slot's state when it is more than half of it: two conversations of one system
    /// prompt whose turns come out of step take each other's slot, and each drops the other's
    /// tail. The router knows what it sent to each slot and gives a request the slot holding
    /// its conversation's last prompt, or, for an earlier turn's prompt sent again (an answer
    /// regenerated), the slot holding a later turn of it when the prompt is at least half of
    /// what that slot holds (llama-server reuses the whole prompt there, and drops the rest);
    /// else a slot never used; else the one sharing the most
    /// with it, if that is more than a tenth of it (among equals, the least recently used);
    /// else the least recently used. The slot is free again once the answer's last byte or
    /// event has been read; a request the backend does not run (it answers with an error,
    /// or fails with none) leaves the slot holding what it held. Each router replica assigns
    /// the slots on its own: with several in front of one backend, their requests take each
    /// other's slots, one sent to a busy slot waits there for it, and a conversation whose
    /// turns enter different replicas changes slots. Leave it off where several replicas share
    /// a backend: in the swarm's overload scenario at 8 GiB two replicas entered at random
    /// with the shared store reuse 59.2% of later turns with it and 84.2% without it, and
    /// entered by session 69.3% and 80.3% (means of 16 seeds).
    ///
    /// Only for llama-server with `-np` given, whose slots each keep their KV in a context of
    /// their own: llama-server searches no RAM cache (`--cache-ram`) for a request that names
    /// an empty slot, and with a unified KV cache (its default without `-np`, or
    /// `--kv-unified`) an idle slot's state is saved to RAM and cleared as each task starts,
    /// so a conversation sent to its own slot would find it empty and read its whole prompt
    /// again. In the swarm's overload at 8 GiB, slots sharing the VRAM as a unified cache
    /// does, this cost 8.8 points (86.8% of later turns warm without it, 78.0% with it, means
    /// of eight seeds), and more where idle slots are cleared. The router keeps 48
    /// bytes for each slot, and the prompt chain of the last request sent to it (and while a
    /// request is on it, of the one before; 24 bytes a link: at most 192 KiB, for a prompt of
    /// [`PromptChain::MAX_LINKS`] links).
    ///
    /// Three things make it work:
    ///
    /// - the slot must reach llama-server in the request's body: wrap the backend's service
    ///   in the `client` feature's `IdSlot` (`client::IdSlotLayer`; its docs wire a whole
    ///   proxy), or call `client::write_id_slot` in a service of your own. The extension is
    ///   put on the request the backend's service receives, after placement: a layer in
    ///   front of the balancer sees none. Without it llama-server chooses its slots, and the
    ///   router's count of them is wrong;
    /// - [`BodyKeyLayer`](crate::key::BodyKeyLayer) in front of the balancer reads each
    ///   request's prompt chain: without it every request is a new conversation to the
    ///   router, given an empty slot, else the least recently used;
    /// - the slot count llama-server has (its `-np`), given or learned by the health probe:
    ///   a number past its slots wraps around onto one that may be in use, where the request
    ///   waits while another slot is idle.
    ///
    /// A request sent while each of its slots is busy (with
    /// [`Overflow::Overcommit`](crate::Overflow::Overcommit), or a count that changed) is given
    /// none, and llama-server chooses; so is one whose body is in a content coding (a
    /// `Content-Encoding` other than `identity`), which `IdSlot` cannot write into.
    ///
    /// A request whose body names its own slot (a top-level `id_slot`, which `IdSlot` leaves
    /// as it is, and llama-server runs the request in) is assigned that slot, modulo the
    /// backend's slots as llama-server wraps it, and never another: its prompt is recorded
    /// there, and no other request is given the slot while it runs. If another request is
    /// on the slot, llama-server runs this one there after it: the slot is taken until both
    /// have ended, and then holds this one's prompt. A request whose `id_slot` names none
    /// (`-1`, with which llama-server chooses, or a value not a non-negative integer) is
    /// assigned none, and nothing is recorded of it. The router learns of `id_slot` from the
    /// facts [`BodyKeyLayer`](crate::key::BodyKeyLayer) reads in its one pass over the body;
    /// a body it leaves unread (a header names the session and
    /// [`skip_when_header`](crate::key::BodyKeyLayer::skip_when_header) says so) is still
    /// searched for `id_slot`, and one with a top-level `id_slot` gets facts saying only
    /// that: the slot it names, or that it names none (`-1`), so that it is assigned none.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use tower_affinity::Backend;
    ///
    /// # let service = ();
    /// // `service`: the backend's, in `client::IdSlot` (or one that sends the slot itself).
    /// let backend = Backend::new("gpu-0", service)
    ///     .slots(NonZeroU32::new(4).unwrap())
    ///     .assign_slots();
    /// assert!(backend.slots_assigned());
    /// ```
    pub fn assign_slots(mut self) -> Self {
        self.assign_slots = true;
        self
    }

    /// Whether the router assigns this backend's slots ([`assign_slots`](Self::assign_slots)).
    pub fn slots_assigned(&self) -> bool {
        self.assign_slots
    }

    /// Whether the slot count was given with [`slots`](Self::slots); if not, the backend has
    /// one slot until something (a health probe reading `/slots`, say) says how many.
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use tower_affinity::Backend;
    ///
    /// assert!(!Backend::new("n", ()).slots_given());
    /// assert!(Backend::new("n", ()).slots(NonZeroU32::MIN).slots_given());
    /// ```
    pub fn slots_given(&self) -> bool {
        self.slots_given
    }

    /// Records the backend's host-memory prompt-cache budget in bytes, for policies of your
    /// own that weigh it ([`BackendRef`](crate::placement::BackendRef) shows it). The cache
    /// model and the built-in policies do not read it: they go by
    /// [`cache_tokens`](Self::cache_tokens), the whole budget in tokens.
    pub fn prompt_cache_bytes(mut self, bytes: u64) -> Self {
        self.prompt_cache_bytes = Some(bytes);
        self
    }

    /// Attaches `value` to the backend, for policies of your own to read
    /// ([`BackendRef::extensions`](crate::placement::BackendRef::extensions)): the tenant it
    /// serves, its GPU, its region. One value a type; another of the same type replaces it.
    /// The service and the built-in policies read none.
    ///
    /// ```
    /// use tower_affinity::Backend;
    ///
    /// #[derive(Clone, Debug, PartialEq)]
    /// struct Tenant(&'static str);
    ///
    /// let backend = Backend::new("gpu-0", ()).extension(Tenant("acme"));
    /// assert_eq!(backend.extensions().get::<Tenant>(), Some(&Tenant("acme")));
    /// ```
    pub fn extension<T: Clone + Send + Sync + 'static>(mut self, value: T) -> Self {
        self.extensions.insert(value);
        self
    }

    /// The values attached with [`extension`](Self::extension).
    pub fn extensions(&self) -> &http::Extensions {
        &self.extensions
    }

    /// The values attached with [`extension`](Self::extension), mutably.
    pub fn extensions_mut(&mut self) -> &mut http::Extensions {
        &mut self.extensions
    }

    /// The backend's node.
    pub fn node(&self) -> &NodeId {
        &self.node
    }

    /// How many requests the backend serves at once.
    pub fn slot_count(&self) -> NonZeroU32 {
        self.slots
    }

    /// The prompt-cache budget, if known.
    pub fn prompt_cache_budget(&self) -> Option<u64> {
        self.prompt_cache_bytes
    }

    /// The service.
    pub fn service(&self) -> &S {
        &self.service
    }

    /// The same backend with another service: its node, slots, budgets, extensions and
    /// whether its slots are assigned kept.
    pub fn map_service<T>(self, f: impl FnOnce(S) -> T) -> Backend<T> {
        Backend {
            service: f(self.service),
            node: self.node,
            slots: self.slots,
            slots_given: self.slots_given,
            prompt_cache_bytes: self.prompt_cache_bytes,
            cache_tokens: self.cache_tokens,
            context: self.context,
            request_context: self.request_context,
            assign_slots: self.assign_slots,
            extensions: self.extensions,
        }
    }
}

impl<S> fmt::Debug for Backend<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backend")
            .field("node", &self.node)
            .field("slots", &self.slots)
            .field("slots_given", &self.slots_given)
            .field("prompt_cache_bytes", &self.prompt_cache_bytes)
            .field("cache_tokens", &self.cache_tokens)
            .field("context", &self.context)
            .field("request_context", &self.request_context)
            .field("assign_slots", &self.assign_slots)
            .finish_non_exhaustive()
    }
}

// === slots ===

/// Fleet-wide counters shared by every slot guard and waiter.
#[derive(Debug)]
pub(crate) struct Capacity {
    /// The decision and error counters behind [`Stats`](crate::Stats).
    pub(crate) counters: Counters,
    /// The origin of the fleet's millisecond clock (health cooldowns).
    epoch: Instant,
    /// Requests waiting for a slot.
    pub(crate) waiting: AtomicUsize,
    /// The requests waiting, in arrival order.
    pub(crate) waiters: Mutex<WaitList>,
}

impl Default for Capacity {
    fn default() -> Self {
        Capacity {
            counters: Counters::default(),
            // A millisecond back, so that the clock reads at least 1 from the start and its
            // clamp away from 0 never skews a duration.
            epoch: Instant::now()
                .checked_sub(std::time::Duration::from_millis(1))
                .unwrap_or_else(Instant::now),
            waiting: AtomicUsize::new(0),
            waiters: Mutex::default(),
        }
    }
}

impl Capacity {
    /// Milliseconds since the epoch, never 0 (0 means "up" in [`Load::down_until`]). The
    /// fleet's one clock: health cooldowns and the session table's idle times read it.
    pub(crate) fn now_ms(&self, now: Instant) -> u64 {
        let d = now.saturating_duration_since(self.epoch);
        // No 128-bit division: seconds fit in 64 bits for any real uptime.
        d.as_secs()
            .saturating_mul(1000)
            .saturating_add(u64::from(d.subsec_millis()))
            .clamp(1, u64::MAX - 1)
    }

    /// When a down mark of `cooldown` from `now` ends, on the fleet's clock: the millisecond
    /// its end falls in, but never the one it began in, so that a mark shorter than a
    /// millisecond still outlasts it (the retry that follows a failure at once passes the
    /// backend over). Zero ends now: up. `None`, or a time past the clock's end, is
    /// `u64::MAX`: until further notice.
    ///
    /// Not rounded up past its end: the time left of a mark, read on this clock (the
    /// `Retry-After` of a refusal, [`first_back`](crate::service)), is then never more than
    /// its cooldown, and a cooldown of whole seconds is said in those seconds, not one more.
    pub(crate) fn down_until(&self, now: Instant, cooldown: Option<Duration>) -> u64 {
        let Some((cooldown, end)) = cooldown.and_then(|c| Some((c, now.checked_add(c)?))) else {
            return u64::MAX;
        };
        let began = self.now_ms(now);
        if cooldown.is_zero() {
            return began;
        }
        self.now_ms(end).max(began.saturating_add(1))
    }

    /// The instant the fleet's clock reads `ms` at.
    pub(crate) fn instant_at(&self, ms: u64) -> Instant {
        self.epoch
            .checked_add(Duration::from_millis(ms))
            .unwrap_or_else(|| self.epoch + Duration::from_secs(30 * 365 * 86_400))
    }
}

/// The bit of [`Load::in_flight`] set once its backend left the fleet: no slot is taken on it
/// from then on, so that a count of 0 beside it stays 0 and its place can go to another.
const RETIRED: u32 = 1 << 31;

/// One backend's slot counter.
#[derive(Debug)]
pub(crate) struct Load {
    /// Requests holding a slot, and [`RETIRED`] once the backend has left the fleet: read it
    /// through [`in_flight`](Self::in_flight).
    pub(crate) in_flight: AtomicU32,
    pub(crate) slots: AtomicU32,
    /// Its node's index, as the latest fleet has it: a backend announced again on another
    /// node moves with its requests in flight, so that their slots, freed, wake the requests
    /// held for the node it is on now.
    pub(crate) node: AtomicU32,
    /// The tokens of context its running requests share ([`Backend::context_tokens`]); 0:
    /// no limit.
    pub(crate) context: AtomicU64,
    /// Of them, the tokens its requests holding a slot take, by the router's estimate.
    pub(crate) context_in_flight: AtomicU64,
    /// The most tokens of context one request can take ([`Backend::request_context_limit`]);
    /// 0: no limit.
    pub(crate) request_context: AtomicU64,
    /// Free slots promised to waiters woken for them and not yet running: other requests
    /// do not take them (see [`wait`](crate::wait)).
    pub(crate) reserved: AtomicU32,
    /// Down until this time (fleet milliseconds); 0 when up, `u64::MAX` until marked up.
    pub(crate) down_until: AtomicU64,
    /// Requests that failed on this backend before it answered.
    pub(crate) failures: AtomicU64,
    /// Answers it began and did not finish: their body failed.
    pub(crate) cut_answers: AtomicU64,
    /// Answers to requests sent to it again (see [`SentAgain`](crate::SentAgain)).
    pub(crate) sent_again: AtomicU64,
    /// What this backend's answers have taught.
    pub(crate) learned: Learned,
    /// Its event handles (nothing without the `metrics` feature).
    pub(crate) metrics: BackendMetrics,
    /// The fleet's counters, so that a slot guard needs this one `Arc` alone.
    pub(crate) capacity: Arc<Capacity>,
    /// The values of its decision headers, made once rather than for every response.
    pub(crate) headers: DecisionHeaders,
    /// The stamps ([`ModelCell::reserve`]) of the requests placed here with a prompt chain
    /// that are in flight, each at its place in a ring of [`ENDED_RING`] (0: none): a prefix
    /// first recorded by one still in flight is one the backend may not have finished
    /// reading, so that another request could not reuse it yet. The whole stamp is kept, not
    /// a bit, so that a request that ends a ring of stamps after its own (a long answer while
    /// others come and go) clears its own place only, not that of a newer request in flight
    /// there, and a record without a request here that takes the place of one still in
    /// flight does not read as in flight.
    in_flight_stamps: [AtomicU32; ENDED_RING],
    /// Whether the router assigns this backend's slots ([`Backend::assign_slots`]): read
    /// before `slot_table` is locked, so that other backends' requests do not lock it.
    assigns_slots: AtomicBool,
    /// Its slots, once the router has assigned them.
    slot_table: Mutex<Option<SlotTable>>,
}

/// A backend's tokens per token of the prompt chain's estimate (four bytes a token) that the
/// context limit counts until its answers have taught its own: two, as if a token were two
/// bytes, where code and English prose run three to four. Counting a prompt long holds a
/// request back until a first answer teaches the scale; counting it short can fail every
/// request the backend runs.
pub(crate) const UNLEARNED_CONTEXT_SCALE: f64 = 2.0;

/// Whether `need` tokens of context fit beside the `held` ones within `limit`: they do when
/// nothing is held, as a prompt longer than the whole context is the backend's to refuse.
fn context_fits(held: u64, need: u64, limit: u64) -> bool {
    held == 0 || held.saturating_add(need) <= limit
}

/// How many places [`Load`] has for the stamps of its requests in flight: a stamp keeps its
/// place until it ends or a stamp a ring later takes it.
pub(crate) const ENDED_RING: usize = 1024;

/// A backend's `x-affinity-backend` and `x-affinity-node` values. The id is the backend's for
/// good; its node can change (discovery moved it), so the node's value is kept with the name it
/// was made from and made again when a decision names another.
#[derive(Debug)]
pub(crate) struct DecisionHeaders {
    backend: Option<http::HeaderValue>,
    node: arc_swap::ArcSwapOption<(NodeId, http::HeaderValue)>,
}

impl DecisionHeaders {
    fn new(id: &BackendId, node: &NodeId) -> Self {
        let backend = http::HeaderValue::from_str(id.as_str()).ok();
        if backend.is_none() {
            tracing::warn!(backend = ?id.as_str(), "backend id is not a valid header value: x-affinity-backend is left off its answers");
        }
        if http::HeaderValue::from_str(node.as_str()).is_err() {
            tracing::warn!(node = ?node.as_str(), "node id is not a valid header value: x-affinity-node is left off its answers");
        }
        let headers = DecisionHeaders {
            backend,
            node: arc_swap::ArcSwapOption::empty(),
        };
        headers.node(node);
        headers
    }

    /// The backend's value (`None` if its id is not a valid header value).
    pub(crate) fn backend(&self) -> Option<http::HeaderValue> {
        self.backend.clone()
    }

    /// The value for `node` (`None` if it is not a valid header value).
    pub(crate) fn node(&self, node: &NodeId) -> Option<http::HeaderValue> {
        if let Some(kept) = &*self.node.load() {
            if kept.0 == *node {
                return Some(kept.1.clone());
            }
        }
        let value = http::HeaderValue::from_str(node.as_str()).ok()?;
        self.node
            .store(Some(Arc::new((node.clone(), value.clone()))));
        Some(value)
    }
}

impl Load {
    fn new(slots: NonZeroU32, capacity: Arc<Capacity>, id: &BackendId, node: &NodeId) -> Self {
        Load {
            in_flight: AtomicU32::new(0),
            slots: AtomicU32::new(slots.get()),
            node: AtomicU32::new(0),
            context: AtomicU64::new(0),
            context_in_flight: AtomicU64::new(0),
            request_context: AtomicU64::new(0),
            reserved: AtomicU32::new(0),
            down_until: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            cut_answers: AtomicU64::new(0),
            sent_again: AtomicU64::new(0),
            learned: Learned::default(),
            metrics: BackendMetrics::new(id, node, &capacity.counters.labels),
            capacity,
            headers: DecisionHeaders::new(id, node),
            // Every stamp not yet begun reads as ended: a record without a request here (one
            // learned from another replica) has nothing in flight.
            in_flight_stamps: std::array::from_fn(|_| AtomicU32::new(0)),
            assigns_slots: AtomicBool::new(false),
            slot_table: Mutex::new(None),
        }
    }

    /// Whether the router assigns this backend's slots from now on. A table already kept
    /// stays as it is while they are assigned. When they no longer are, it forgets what each
    /// slot was sent (the backend chooses the slots meanwhile) but stays: a request still in
    /// flight on a slot it was assigned keeps that slot busy, and its end frees that slot
    /// only, were they assigned again (a new table would give its slot to another request,
    /// and its end would free the slot of a request that came after).
    pub(crate) fn assign_slots(&self, on: bool) {
        let mut table = self.slot_table.lock();
        match (on, table.as_mut()) {
            (true, None) => *table = Some(SlotTable::default()),
            (false, Some(table)) => table.forget(),
            _ => {}
        }
        self.assigns_slots.store(on, Ordering::Relaxed);
    }

    /// The place of `stamp` in [`in_flight_stamps`](Self::in_flight_stamps).
    fn place_of(&self, stamp: u32) -> &AtomicU32 {
        &self.in_flight_stamps[stamp as usize % ENDED_RING]
    }

    /// The request that reserved `stamp` is in flight here, until [`end`](Self::end).
    pub(crate) fn begin(&self, stamp: u32) {
        self.place_of(stamp).store(stamp, Ordering::Relaxed);
    }

    /// The request that reserved `stamp` has ended. Its place is cleared only if it still
    /// holds `stamp`: a request a ring of stamps later may have taken it since.
    pub(crate) fn end(&self, stamp: u32) {
        let _ =
            self.place_of(stamp)
                .compare_exchange(stamp, 0, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Whether the request that reserved `stamp` had ended. A request reserved after it may
    /// be sent first (its response future polled first, or the earlier one's backend not ready
    /// yet), so whether it was reserved before or after the asking one does not matter. A
    /// stamp whose place a request a ring of stamps later has taken had ended, as far as the
    /// ring knows; stamp 0 (none) had.
    pub(crate) fn has_ended(&self, stamp: u32) -> bool {
        stamp == 0 || self.place_of(stamp).load(Ordering::Relaxed) != stamp
    }

    /// Whether the backend is down at `now_ms`, changing nothing: a cooldown that has passed
    /// is left for [`health`](Self::health) to clear and report.
    pub(crate) fn is_down(&self, now_ms: u64) -> bool {
        now_ms < self.down_until.load(Ordering::Relaxed)
    }

    /// Whether the backend is down at `now_ms`. A cooldown that has passed is cleared here,
    /// and reported as a transition (`true` in the second field) exactly once.
    pub(crate) fn health(&self, now_ms: u64) -> (bool, bool) {
        let until = self.down_until.load(Ordering::Relaxed);
        if until == 0 {
            return (false, false);
        }
        if now_ms < until {
            return (true, false);
        }
        let cleared = self
            .down_until
            .compare_exchange(until, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok();
        (false, cleared)
    }

    /// Marks the backend down until `until_ms`; returns whether the waiting requests must look
    /// again: it was up at `now_ms`, or its mark now ends sooner than the one it replaces (their
    /// timers are set for that one's end, or for none if it had none, and slots freed on the
    /// backend while it is down wake nobody).
    pub(crate) fn mark_down(&self, until_ms: u64, now_ms: u64) -> bool {
        let until_ms = until_ms.max(1);
        let was = self.down_until.swap(until_ms, Ordering::AcqRel);
        was <= now_ms || until_ms < was
    }

    /// Marks the backend down until `until_ms`, unless a longer mark stands (a failure does
    /// not bring back early a backend a probe marked down); returns whether it was up at
    /// `now_ms`.
    pub(crate) fn extend_down(&self, until_ms: u64, now_ms: u64) -> bool {
        let was = self.down_until.fetch_max(until_ms.max(1), Ordering::AcqRel);
        was <= now_ms
    }

    /// Takes a slot if one is free and not promised to a woken waiter. (A retired count is
    /// above any number of slots: nothing is taken on it.)
    pub(crate) fn try_acquire(&self) -> bool {
        let free = self
            .slots
            .load(Ordering::Relaxed)
            .saturating_sub(self.reserved.load(Ordering::Relaxed));
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < free).then_some(n + 1)
            })
            .is_ok()
    }

    /// Takes room for `need` tokens of context with the slot just taken
    /// ([`try_acquire`](Self::try_acquire)), or gives the slot back; returns the tokens
    /// taken (see [`take_context`](Self::take_context)), which the slot's guard gives back.
    ///
    /// The caller looked at the room first ([`has_context_for`](Self::has_context_for)), so
    /// that a prompt that does not fit never takes a slot, even for a moment in which the
    /// backend would look full to others. The slot is given back only when another request
    /// took the room between that look and the slot: that one is in flight, and its end
    /// wakes the waiters.
    #[cold]
    pub(crate) fn take_context_or_give_back(&self, need: u32) -> Option<u32> {
        let taken = self.take_context(need);
        if taken.is_none() {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
        taken
    }

    /// [`try_acquire`](Self::try_acquire), then
    /// [`take_context_or_give_back`](Self::take_context_or_give_back).
    #[cfg(test)]
    pub(crate) fn try_acquire_for(&self, need: u32) -> Option<u32> {
        if !self.try_acquire() {
            return None;
        }
        self.take_context_or_give_back(need)
    }

    /// Whether the backend has a context limit ([`Backend::context_tokens`]).
    #[inline]
    pub(crate) fn has_context_limit(&self) -> bool {
        self.context.load(Ordering::Relaxed) != 0
    }

    /// The tokens of context a prompt of `prompt_tokens` by the chain's estimate takes here,
    /// in the backend's own tokens as its answers taught, at most `u32::MAX`; 0 on a backend
    /// without a context limit. Until its answers have taught how many of its tokens a token
    /// of the estimate is, [`UNLEARNED_CONTEXT_SCALE`] of them: a prompt counted short could
    /// overfill the context, which fails every request running there, and such a failure
    /// teaches nothing.
    pub(crate) fn context_need(&self, prompt_tokens: u64) -> u32 {
        if prompt_tokens == 0 || self.context.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        let scale = (self.learned.token_scale()).unwrap_or(UNLEARNED_CONTEXT_SCALE);
        // A float past `u32::MAX` saturates.
        (prompt_tokens as f64 * scale).ceil() as u32
    }

    /// Takes `need` tokens of context if they fit beside those the requests in flight hold
    /// within the limit, or if those hold none (a prompt longer than the whole context is
    /// the backend's to refuse; requests without a prompt chain hold none); returns the
    /// tokens taken: `need`, or 0 on a backend without a limit.
    fn take_context(&self, need: u32) -> Option<u32> {
        let limit = self.context.load(Ordering::Relaxed);
        if need == 0 || limit == 0 {
            return Some(0);
        }
        let n = u64::from(need);
        self.context_in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |held| {
                context_fits(held, n, limit).then(|| held + n)
            })
            .ok()
            .map(|_| need)
    }

    /// Takes `need` tokens of context whether or not they fit (a request overcommitted);
    /// returns the tokens taken, as [`take_context`](Self::take_context).
    pub(crate) fn force_context(&self, need: u32) -> u32 {
        if need == 0 || self.context.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        (self.context_in_flight).fetch_add(u64::from(need), Ordering::AcqRel);
        need
    }

    /// The most tokens one request can take here ([`Backend::request_context_limit`]),
    /// `u64::MAX` without a limit.
    pub(crate) fn request_limit(&self) -> u64 {
        match self.request_context.load(Ordering::Relaxed) {
            0 => u64::MAX,
            n => n,
        }
    }

    /// Takes `tokens` as the most one request can take here, if no limit is known: what the
    /// backend said when it refused a prompt as too long. An announcement sets the limit as
    /// it gives it (none, say), until the next refusal.
    pub(crate) fn learn_request_limit(&self, tokens: u64) {
        let _ =
            self.request_context
                .compare_exchange(0, tokens, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Whether a prompt of `prompt_tokens` is too long here and `other`, whose limit is
    /// larger, takes it: the backends' own estimates of a prompt's tokens differ a little
    /// (each scales the chain's by what its answers taught), so between backends of the
    /// same limit neither is too small for the other.
    pub(crate) fn smaller_than(&self, other: &Load, prompt_tokens: u64) -> bool {
        self.request_limit() < other.request_limit()
            && self.too_small_for(prompt_tokens)
            && !other.too_small_for(prompt_tokens)
    }

    /// Whether a prompt of `prompt_tokens` by the chain's estimate is more than one request
    /// can take here ([`Backend::request_context_limit`]): scaled by the backend's own tokens
    /// per token of the estimate, as its answers taught, and until then as estimated. A
    /// prompt must leave the answer a token: llama-server refuses one of `n_ctx` tokens or
    /// more, vLLM one of `max_model_len` or more.
    pub(crate) fn too_small_for(&self, prompt_tokens: u64) -> bool {
        let limit = self.request_context.load(Ordering::Relaxed);
        if limit == 0 || prompt_tokens == 0 {
            return false;
        }
        let scale = self.learned.token_scale().unwrap_or(1.0);
        prompt_tokens as f64 * scale >= limit as f64
    }

    /// Whether `need` tokens of context fit here now (see [`take_context`](Self::take_context)).
    pub(crate) fn has_context_for(&self, need: u32) -> bool {
        let limit = self.context.load(Ordering::Relaxed);
        if need == 0 || limit == 0 {
            return true;
        }
        let held = self.context_in_flight.load(Ordering::Relaxed);
        context_fits(held, u64::from(need), limit)
    }

    /// Requests holding a slot.
    pub(crate) fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed) & !RETIRED
    }

    /// Whether a slot is free right now (and not promised to a woken waiter).
    pub(crate) fn has_free_slot(&self) -> bool {
        let promised = self.reserved.load(Ordering::Relaxed);
        self.in_flight.load(Ordering::Relaxed) + promised < self.slots.load(Ordering::Relaxed)
    }

    /// Takes a slot whether or not one is free, unless the backend has left the fleet.
    pub(crate) fn force_acquire(&self) -> bool {
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n & RETIRED == 0).then_some(n + 1)
            })
            .is_ok()
    }

    /// The backend left the fleet: no slot is taken on it from now on.
    fn retire(&self) {
        self.in_flight.fetch_or(RETIRED, Ordering::AcqRel);
    }

    /// The backend is back in the fleet.
    fn unretire(&self) {
        self.in_flight.fetch_and(!RETIRED, Ordering::AcqRel);
    }

    /// Whether the backend has left the fleet and its last request has ended: its place can
    /// go to another, as no slot will be taken on it again.
    fn retired_and_idle(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) == RETIRED
    }
}

/// The backend index of a [`SlotGuard`] given back unannounced: no fleet has that many.
const UNANNOUNCED: u32 = u32::MAX;

/// A taken slot: released exactly once, when dropped.
pub(crate) struct SlotGuard {
    load: Arc<Load>,
    backend: u32,
    /// When the slot was taken (fleet milliseconds).
    since_ms: u64,
    /// Prompt tokens the backend is expected to read for this request and has not yet
    /// answered for: counted in its [`Learned::unread_tokens`] until the answer starts. 32
    /// bits (a prompt of more is counted as 2^32 - 1 tokens), so that the guard, which moves
    /// with every response future, stays 40 bytes with [`returns`](Self::returns).
    unread: u32,
    /// The stamp the request's prompt chain is recorded with on the backend's cache model (0:
    /// none), in flight there until the slot is released (see [`Load::has_ended`]).
    stamp: u32,
    /// The tokens of the backend's context the request takes (see
    /// [`Load::take_context_or_give_back`]): 32 bits, which fill the struct's padding.
    context: u32,
    /// The slot the router assigned the request, if it assigns the backend's slots
    /// ([`NO_SLOT`] if not), with [`SLOT_QUEUED`] set if the request was queued there
    /// behind another and [`SLOT_FREED`] once it is free again: 32 bits, which fill the
    /// struct's padding too.
    assigned: u32,
    /// The backend's [`Learned::returns`] when the slot was taken: its answer teaches nothing
    /// if the backend was announced again since.
    returns: u32,
}

/// [`SlotGuard::assigned`] when no slot is assigned.
const NO_SLOT: u32 = u32::MAX;

/// Set in [`SlotGuard::assigned`] once the slot is free again: its number stays, for the
/// answer's debug line. No backend has 2^31 slots.
const SLOT_FREED: u32 = 1 << 31;

/// Set in [`SlotGuard::assigned`] when the request named a slot that was taken, and was
/// queued there (see [`SlotTable::assign_named`]). No backend has 2^30 slots.
const SLOT_QUEUED: u32 = 1 << 30;

impl SlotGuard {
    /// Holds the slot just taken on `load`, at fleet time `now_ms`.
    pub(crate) fn new(load: &Arc<Load>, backend: u32, now_ms: u64) -> Self {
        load.learned.started_ms.fetch_add(now_ms, Ordering::Relaxed);
        SlotGuard {
            returns: load.learned.returns.load(Ordering::Relaxed),
            load: load.clone(),
            backend,
            since_ms: now_ms,
            unread: 0,
            stamp: 0,
            context: 0,
            assigned: NO_SLOT,
        }
    }

    /// Assigns the request one of the backend's slots for `chain`, if the router assigns
    /// them ([`Backend::assign_slots`]) and one is free by its count; it is free again when
    /// the guard drops. A request whose body names its slot (`named`) is assigned that one,
    /// free or not (queued behind the requests on it); one whose `id_slot` names no slot is
    /// assigned none.
    pub(crate) fn assign_slot(
        &mut self,
        chain: Option<&PromptChain>,
        named: NamedSlot,
    ) -> Option<AssignedSlot> {
        if !self.assigns_slots() {
            return None;
        }
        let slots = self.load.slots.load(Ordering::Relaxed);
        let mut table = self.load.slot_table.lock();
        let table = table.as_mut()?;
        let (index, queued) = match named {
            NamedSlot::Absent => (table.assign(slots, chain)?, false),
            NamedSlot::Slot(n) => {
                let taken = table.assign_named(slots, n, chain)?;
                (taken.index, taken.queued)
            }
            NamedSlot::Other => return None,
        };
        if index & (SLOT_FREED | SLOT_QUEUED) != 0 {
            return None;
        }
        self.assigned = if queued { index | SLOT_QUEUED } else { index };
        Some(AssignedSlot::new(index))
    }

    /// Whether the router assigns this backend's slots ([`Backend::assign_slots`]).
    pub(crate) fn assigns_slots(&self) -> bool {
        self.load.assigns_slots.load(Ordering::Relaxed)
    }

    /// Whether the request still holds a slot the router assigned it.
    pub(crate) fn holds_assigned_slot(&self) -> bool {
        self.assigned & SLOT_FREED == 0
    }

    /// The slot the router assigned the request, if any, held still or freed.
    pub(crate) fn assigned_slot(&self) -> Option<u32> {
        (self.assigned != NO_SLOT).then_some(self.assigned & !(SLOT_FREED | SLOT_QUEUED))
    }

    /// The slot the request still holds, and whether it was queued there, now marked free.
    fn free_assigned_slot(&mut self) -> Option<(u32, bool)> {
        let held = self.holds_assigned_slot().then_some((
            self.assigned & !SLOT_QUEUED,
            self.assigned & SLOT_QUEUED != 0,
        ));
        self.assigned |= SLOT_FREED;
        held
    }

    /// The backend has sent the whole answer: the slot assigned to the request is free for
    /// the next, though the answer may not have reached the client yet. A server drops a body
    /// of known length only once it has written it, and a client stops reading an event
    /// stream at its last event: either may send its next turn before the body's end is
    /// polled, and that turn's own slot is free on the backend already.
    pub(crate) fn release_assigned_slot(&mut self) {
        if let Some((index, queued)) = self.free_assigned_slot() {
            if let Some(table) = self.load.slot_table.lock().as_mut() {
                table.release(index, queued);
            }
        }
    }

    /// The backend did not run the request in the slot the router assigned it (it refused
    /// the request, or never got it): the slot is free, and is known to hold what it held
    /// before, as the backend's cache model takes back the request's chain.
    pub(crate) fn put_back_assigned_slot(&mut self) {
        if let Some((index, queued)) = self.free_assigned_slot() {
            if let Some(table) = self.load.slot_table.lock().as_mut() {
                table.put_back(index, queued);
            }
        }
    }

    /// The request holds `tokens` of the backend's context too, given back with the slot.
    pub(crate) fn with_context(mut self, tokens: u32) -> Self {
        self.context = tokens;
        self
    }

    /// The slot's backend, by internal index.
    pub(crate) fn backend(&self) -> u32 {
        self.backend
    }

    /// The node its backend is on now, by internal index.
    fn node(&self) -> u32 {
        self.load.node.load(Ordering::Relaxed)
    }

    /// Gives the slot back without waking a waiter for it: the caller holds the wake that
    /// brought it to this backend, and passes it on with the waiters that declined it.
    pub(crate) fn give_back_unannounced(mut self) {
        self.backend = UNANNOUNCED;
    }

    /// The backend is expected to read `tokens` of this request's prompt (what the cache
    /// model says it lacks): they count in its backlog until its answer starts.
    pub(crate) fn reading(&mut self, tokens: u64) {
        let room = u32::MAX - self.unread;
        let tokens = u32::try_from(tokens).map_or(room, |t| t.min(room));
        self.unread += tokens;
        let unread = &self.load.learned.unread_tokens;
        unread.fetch_add(u64::from(tokens), Ordering::Relaxed);
    }

    /// The backend has answered: it has read this request's prompt.
    pub(crate) fn prompt_read(&mut self) {
        let tokens = std::mem::take(&mut self.unread);
        if tokens > 0 {
            let unread = &self.load.learned.unread_tokens;
            unread.fetch_sub(u64::from(tokens), Ordering::Relaxed);
        }
    }

    /// When the slot was taken (fleet milliseconds).
    pub(crate) fn since_ms(&self) -> u64 {
        self.since_ms
    }

    /// The backend's [`Learned::returns`] when the slot was taken.
    pub(crate) fn returns(&self) -> u32 {
        self.returns
    }

    /// What the backend's answers have taught.
    pub(crate) fn learned(&self) -> &Learned {
        &self.load.learned
    }

    /// The request holds the slot with its prompt chain recorded under `stamp` (not 0).
    pub(crate) fn begin(&mut self, stamp: u32) {
        self.stamp = stamp;
        self.load.begin(stamp);
    }

    /// Whether the request that recorded `stamp` on this backend's cache model had ended when
    /// this one was sent.
    pub(crate) fn has_ended(&self, stamp: u32) -> bool {
        self.load.has_ended(stamp)
    }

    /// The values of the backend's decision headers.
    pub(crate) fn headers(&self) -> &DecisionHeaders {
        &self.load.headers
    }

    /// The backend's metric handles.
    pub(crate) fn metrics(&self) -> &BackendMetrics {
        &self.load.metrics
    }

    /// The fleet's counters.
    pub(crate) fn capacity(&self) -> &Capacity {
        &self.load.capacity
    }

    /// A waiter woken for a slot on this backend has taken it: on a backend with a context
    /// limit, the request whose end freed that slot may have freed room for more waiters than
    /// one, so while a slot is free here the next waiter it suits is woken too. Each that
    /// takes a slot wakes the next in turn; one that finds its prompt does not fit passes
    /// the wake on as for any slot it does not take. (Without a limit, one freed slot serves
    /// one waiter, and nothing more is woken.)
    pub(crate) fn pass_room_on(&self) {
        if self.load.has_context_limit() && self.load.has_free_slot() {
            self.capacity()
                .slot_freed(&self.load, self.backend, self.node());
        }
    }

    /// Counts a request that failed on this backend before it answered, for the backend and
    /// for the fleet.
    pub(crate) fn count_failure(&self) {
        self.load.failures.fetch_add(1, Ordering::Relaxed);
        self.load.metrics.failure();
        crate::stats::bump(&self.capacity().counters.backend_errors);
    }

    /// Counts an answer whose body failed after it began (the backend cut its stream).
    pub(crate) fn count_cut_answer(&self) {
        self.load.cut_answers.fetch_add(1, Ordering::Relaxed);
        self.load.metrics.cut_answer();
    }

    /// Counts an answer to a request that was sent to this backend again (see
    /// [`SentAgain`](crate::SentAgain)).
    pub(crate) fn count_sent_again(&self) {
        self.load.sent_again.fetch_add(1, Ordering::Relaxed);
        self.load.metrics.sent_again();
    }

    /// Marks the backend this slot belongs to down for `cooldown`, then releases the slot.
    pub(crate) fn fail(self, cooldown: std::time::Duration) {
        self.mark_down(cooldown);
    }

    /// Marks the backend this slot belongs to down for `cooldown`. A longer mark stays: a
    /// request that fails on a backend a probe has marked down until further notice does not
    /// bring it back when its cooldown ends.
    ///
    /// A backend that was up wakes the waiting requests, as a probe's mark does: those held
    /// for it take a slot elsewhere or wait for any, and each sets its timer for the
    /// backend's return, as slots freed on it meanwhile wake none.
    pub(crate) fn mark_down(&self, cooldown: std::time::Duration) {
        let now = Instant::now();
        let capacity = self.capacity();
        let until = capacity.down_until(now, Some(cooldown));
        if self.load.extend_down(until, capacity.now_ms(now)) {
            capacity.wake_all();
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.prompt_read();
        self.release_assigned_slot();
        if self.stamp != 0 {
            self.load.end(self.stamp);
        }
        self.load
            .learned
            .started_ms
            .fetch_sub(self.since_ms, Ordering::Relaxed);
        // The context first: a request that sees the slot free sees its context free too.
        if self.context > 0 {
            let context = u64::from(self.context);
            (self.load.context_in_flight).fetch_sub(context, Ordering::SeqCst);
        }
        // Sequentially consistent, as the wait queue's count is read next: see `wait`.
        let held = self.load.in_flight.fetch_sub(1, Ordering::SeqCst) & !RETIRED;
        // A request beyond the slots (overcommitted, or in flight as the backend's slots
        // were lowered) frees none as it ends: the backend is as full as before. Promised to
        // a waiter, that slot would not exist, and the one that frees next would go to
        // another waiter, which could take it before the first.
        let freed = held <= self.load.slots.load(Ordering::Relaxed);
        // A slot on a backend that is down serves no waiter: they looked when it went down,
        // and their timers bring them back when it comes back. Sequentially consistent, as
        // is the lifting of a mark (`mark_up`, an announcement), which then wakes the waiters
        // to look after a fence: either this sees the mark lifted and wakes one, or they see
        // this slot free.
        let down_until = self.load.down_until.load(Ordering::SeqCst);
        let capacity = self.capacity();
        let awake = down_until == 0 || capacity.now_ms(Instant::now()) >= down_until;
        if freed && awake && self.backend != UNANNOUNCED {
            capacity.slot_freed(&self.load, self.backend, self.node());
        }
    }
}

impl fmt::Debug for SlotGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotGuard").finish_non_exhaustive()
    }
}

// === topology ===

/// What placement may read about one backend.
#[derive(Clone, Debug)]
pub(crate) struct Member {
    pub(crate) id: BackendId,
    pub(crate) node: u32,
    pub(crate) digest: u64,
    pub(crate) generation: u16,
    pub(crate) live: bool,
    pub(crate) load: Arc<Load>,
    pub(crate) prompt_cache_bytes: Option<u64>,
    /// What its cache probably holds; shared by every copy of the topology, like `load`.
    pub(crate) cache: Arc<ModelCell>,
    /// Removed, and its model forgotten: see [`Topology::KEPT_REMOVED`].
    pub(crate) forgotten: bool,
    /// What its [`Backend::extension`]s attached, for policies to read.
    pub(crate) extensions: http::Extensions,
}

/// What placement may read about one node.
#[derive(Clone, Debug)]
pub(crate) struct NodeEntry {
    pub(crate) id: NodeId,
    pub(crate) digest: u64,
    /// Live backends on this node, in the order they came, with their rendezvous inputs
    /// (weighted by their slots).
    pub(crate) backends: RankSet,
    /// Sum of the live backends' slots.
    pub(crate) slots: u32,
    /// Backends, live or removed, whose node this is: at 0 the node is forgotten, and its
    /// index goes to a new node later.
    members: u32,
    /// Bumped each time the index is given to another node (12 bits), so that a session's
    /// record of its home's node (see [`Topology::node_mark`]) does not name the newcomer.
    generation: u16,
}

/// The fleet's shape: nodes, backends and slot counters, without the services. A clone shares
/// the slot counters (each backend's [`Load`]) with the original.
#[derive(Clone, Debug, Default)]
pub(crate) struct Topology {
    /// The router replicas sharing the backends' traffic (0 is read as 1): each models its
    /// share of their caches and homes its share of their conversations.
    pub(crate) replicas: u32,
    /// The fleet's counters, shared by every backend's [`Load`].
    pub(crate) capacity: Arc<Capacity>,
    pub(crate) members: Vec<Member>,
    pub(crate) nodes: Vec<NodeEntry>,
    /// Live backends, in insertion order, with their rendezvous inputs (weighted by their
    /// slots).
    pub(crate) live: RankSet,
    /// Nodes with at least one live backend, with their rendezvous inputs (weighted by their
    /// live backends' slots).
    pub(crate) live_nodes: RankSet,
    /// Sum of the live backends' slots.
    pub(crate) total_slots: u32,
    by_id: HashMap<BackendId, u32>,
    node_by_id: HashMap<NodeId, u32>,
    /// Forgotten nodes' indexes, the earliest forgotten first; one is given to a new node only
    /// once [`NODES_KEPT_FORGOTTEN`](Topology::NODES_KEPT_FORGOTTEN) more wait behind it.
    free_nodes: VecDeque<u32>,
    /// Removed backends' indexes, the earliest removed first: a new backend takes the
    /// earliest's, so that those removed last keep their models longest.
    free: VecDeque<u32>,
}

/// A stable 64-bit digest of a name, the same in every process.
pub(crate) fn name_digest(name: &str) -> u64 {
    let d = Sha256::digest(name.as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_be_bytes(b)
}

impl Topology {
    pub(crate) fn member(&self, index: u32) -> &Member {
        &self.members[index as usize]
    }

    pub(crate) fn node(&self, index: u32) -> &NodeEntry {
        &self.nodes[index as usize]
    }

    pub(crate) fn index_of(&self, id: &str) -> Option<u32> {
        self.by_id
            .get(id)
            .copied()
            .filter(|&i| self.members[i as usize].live)
    }

    /// The index of backend `id`, live or removed (until its index is reused).
    pub(crate) fn index_any(&self, id: &str) -> Option<u32> {
        self.by_id.get(id).copied()
    }

    /// The index of a live backend named by `index` and `generation`, if it still exists.
    pub(crate) fn resolve(&self, index: u32, generation: u16) -> Option<u32> {
        let m = self.members.get(index as usize)?;
        (m.live && m.generation == generation).then_some(index)
    }

    /// A node's index takes the low 20 bits of its mark, its generation the other 12.
    const NODE_INDEX_BITS: u32 = 20;
    const NODE_INDEX_MASK: u32 = (1 << Self::NODE_INDEX_BITS) - 1;
    /// The mark of a node whose index does not fit (past a million nodes at once): it names
    /// none.
    const NO_NODE: u32 = u32::MAX;
    /// How many forgotten nodes' indexes wait before the earliest is given to a new node: with
    /// the 12-bit generation, a session's record of a forgotten node could name a newcomer
    /// only after 4,096 x 65 nodes forgotten since, far more than come and go within a
    /// session's idle timeout.
    const NODES_KEPT_FORGOTTEN: usize = 64;

    /// Node `index` as a session records its home's node: the index and the node's
    /// generation, so that the record names no other node once this one is forgotten.
    pub(crate) fn node_mark(&self, index: u32) -> u32 {
        if index >= Self::NODE_INDEX_MASK {
            return Self::NO_NODE;
        }
        index | u32::from(self.nodes[index as usize].generation) << Self::NODE_INDEX_BITS
    }

    /// The node a [`node_mark`](Topology::node_mark) names, if it is still known.
    pub(crate) fn resolve_node(&self, mark: u32) -> Option<u32> {
        if mark == Self::NO_NODE {
            return None;
        }
        let index = mark & Self::NODE_INDEX_MASK;
        let n = self.nodes.get(index as usize)?;
        let generation = mark >> Self::NODE_INDEX_BITS;
        (n.members > 0 && u32::from(n.generation) == generation).then_some(index)
    }

    /// The index of node `id`, now named by one backend more: a node no backend names is
    /// forgotten, so that nodes named by addresses that churn (pods rescheduled) do not pile
    /// up for as long as the router runs.
    fn node_index(&mut self, id: &NodeId) -> u32 {
        if let Some(&i) = self.node_by_id.get(id) {
            self.nodes[i as usize].members += 1;
            return i;
        }
        let entry = |generation| NodeEntry {
            id: id.clone(),
            digest: name_digest(id.as_str()),
            backends: RankSet::default(),
            slots: 0,
            members: 1,
            generation,
        };
        let reuse = self.free_nodes.len() > Self::NODES_KEPT_FORGOTTEN;
        let i = match reuse.then(|| self.free_nodes.pop_front()).flatten() {
            Some(i) => {
                let n = &mut self.nodes[i as usize];
                *n = entry((n.generation + 1) & 0x0fff);
                i
            }
            None => {
                self.nodes.push(entry(0));
                (self.nodes.len() - 1) as u32
            }
        };
        self.node_by_id.insert(id.clone(), i);
        i
    }

    /// Node `index` is named by one backend fewer.
    fn release_node(&mut self, index: u32) {
        let n = &mut self.nodes[index as usize];
        n.members -= 1;
        if n.members == 0 {
            debug_assert!(n.backends.is_empty());
            self.node_by_id.remove(&n.id);
            self.free_nodes.push_back(index);
        }
    }

    fn attach(&mut self, index: u32) {
        let m = &self.members[index as usize];
        let (node, slots) = (m.node, m.load.slots.load(Ordering::Relaxed));
        // What its slots, freed, wake: the requests held for the node it is on now.
        m.load.node.store(node, Ordering::Relaxed);
        let ranked = self.ranked(index);
        let n = &mut self.nodes[node as usize];
        n.backends.put(ranked);
        // Saturating: past `u32::MAX` slots (65,537 backends of the most slots) the sums stay
        // there, and weigh nodes and spread load a little off.
        n.slots = n.slots.saturating_add(slots);
        self.total_slots = self.total_slots.saturating_add(slots);
        self.live.put(ranked);
        self.refresh_node(node);
    }

    fn detach(&mut self, index: u32) {
        let m = &self.members[index as usize];
        let (node, slots) = (m.node, m.load.slots.load(Ordering::Relaxed));
        let n = &mut self.nodes[node as usize];
        n.backends.remove(index);
        n.slots = n.slots.saturating_sub(slots);
        self.total_slots = self.total_slots.saturating_sub(slots);
        self.live.remove(index);
        self.refresh_node(node);
    }

    /// Backend `index`'s rendezvous inputs, weighted by its slots.
    fn ranked(&self, index: u32) -> Ranked {
        let m = &self.members[index as usize];
        Ranked {
            digest: m.digest,
            weight: m.load.slots.load(Ordering::Relaxed),
            index,
        }
    }

    /// Brings `node`'s place and weight among the live nodes up to date after one of its
    /// backends came or went: a node with no live backend leaves, a new one comes last.
    /// Runs on discovery changes only.
    fn refresh_node(&mut self, node: u32) {
        let n = &self.nodes[node as usize];
        if n.backends.is_empty() {
            self.live_nodes.remove(node);
        } else {
            self.live_nodes.put(Ranked {
                digest: n.digest,
                weight: n.slots,
                index: node,
            });
        }
    }

    /// Inserts or updates a backend; returns its index.
    pub(crate) fn insert(
        &mut self,
        id: BackendId,
        node: &NodeId,
        slots: NonZeroU32,
        prompt_cache_bytes: Option<u64>,
        cache_tokens: u64,
    ) -> u32 {
        let node_id = node;
        let node = self.node_index(node);
        let slots = slots.min(Backend::<()>::MAX_SLOTS);
        if let Some(&index) = self.by_id.get(&id) {
            let m = &self.members[index as usize];
            if m.live {
                // An update: same index and generation, so its sessions stay.
                self.detach(index);
            } else {
                // Re-inserted before its index was reused: take it back, sessions and all. It
                // was announced again, so it starts healthy.
                self.free.retain(|&f| f != index);
                m.load.unretire();
                m.load.learned.returned();
                m.load.metrics.returned();
                m.load.down_until.store(0, Ordering::SeqCst);
            }
            let m = &mut self.members[index as usize];
            let old_node = std::mem::replace(&mut m.node, node);
            m.live = true;
            m.forgotten = false;
            m.prompt_cache_bytes = prompt_cache_bytes;
            m.cache.lock().set_budget(cache_tokens);
            m.load.slots.store(slots.get(), Ordering::Relaxed);
            self.release_node(old_node);
            self.attach(index);
            return index;
        }
        let digest = name_digest(id.as_str());
        // The index removed longest ago of those that forgot their models (see
        // `KEPT_REMOVED`: the latest removed keep theirs, and their places, for their return)
        // and whose last requests have ended: one still streaming keeps its member, so that
        // `in_flight` counts them until they end. Retired, it takes no request again, even one
        // placed on a fleet from before its removal.
        let reusable = self.free.iter().position(|&i| {
            let m = &self.members[i as usize];
            m.forgotten && m.load.retired_and_idle()
        });
        let index = if let Some(index) = reusable.and_then(|at| self.free.remove(at)) {
            let m = &mut self.members[index as usize];
            self.by_id.remove(&m.id);
            let old_node = m.node;
            *m = Member {
                id: id.clone(),
                node,
                digest,
                generation: m.generation.wrapping_add(1),
                live: true,
                load: Arc::new(Load::new(slots, self.capacity.clone(), &id, node_id)),
                prompt_cache_bytes,
                cache: Arc::new(ModelCell::new(cache_tokens)),
                forgotten: false,
                extensions: http::Extensions::new(),
            };
            self.release_node(old_node);
            index
        } else {
            let index = self.members.len() as u32;
            self.members.push(Member {
                id: id.clone(),
                node,
                digest,
                generation: 0,
                live: true,
                load: Arc::new(Load::new(slots, self.capacity.clone(), &id, node_id)),
                prompt_cache_bytes,
                cache: Arc::new(ModelCell::new(cache_tokens)),
                forgotten: false,
                extensions: http::Extensions::new(),
            });
            index
        };
        self.by_id.insert(id, index);
        self.attach(index);
        index
    }

    /// How many removed backends keep their cache models and their places, the latest
    /// removed: one that comes back (a restart, a flapping DNS record) finds its sessions and
    /// what its cache held, however many backends joined meanwhile. Older ones forget theirs (up to 770 KB each at the default budget, 1.1 MB once
    /// grown to twice it: see [`cache`](crate::cache)), so that a fleet scaled down
    /// by thousands does not keep their models for good; their sessions are placed anew if
    /// they return.
    pub(crate) const KEPT_REMOVED: usize = 64;

    /// Removes a backend; returns its index if it was live.
    pub(crate) fn remove(&mut self, id: &BackendId) -> Option<u32> {
        let index = self.index_of(id.as_str())?;
        self.detach(index);
        let member = &mut self.members[index as usize];
        member.live = false;
        // Down until further notice: the slots its requests still hold, freed, wake no
        // waiter (none may take them), and a request failing there wakes none either. It is
        // up again if announced again before its index is reused.
        member.load.down_until.store(u64::MAX, Ordering::Release);
        member.load.retire();
        member.load.metrics.removed();
        self.free.push_back(index);
        if let Some(at) = self.free.len().checked_sub(Self::KEPT_REMOVED + 1) {
            let m = &mut self.members[self.free[at] as usize];
            if !m.forgotten {
                // A new generation: its sessions' homes are gone, as its model is.
                let budget = m.cache.lock().budget();
                m.cache = Arc::new(ModelCell::after(&m.cache, budget));
                m.generation = m.generation.wrapping_add(1);
                m.forgotten = true;
            }
        }
        Some(index)
    }
}

/// The topology together with the backends' services.
#[derive(Clone)]
pub(crate) struct Fleet<B> {
    pub(crate) topology: Topology,
    pub(crate) backends: Vec<Option<B>>,
}

impl<B> Fleet<B> {
    /// An empty fleet, seen by one of `replicas` router replicas, that adds `labels` to the
    /// series it writes.
    pub(crate) fn new(replicas: u32, labels: crate::metrics::Labels) -> Self {
        let mut capacity = Capacity::default();
        capacity.counters.labels = labels;
        Fleet {
            topology: Topology {
                replicas,
                capacity: Arc::new(capacity),
                ..Topology::default()
            },
            backends: Vec::new(),
        }
    }
}

impl<S> Fleet<Backend<S>> {
    pub(crate) fn insert(&mut self, id: BackendId, backend: Backend<S>) {
        // This replica sees about one request in `replicas` of those the backend serves, so
        // its cache model keeps that share of the backend's budget, rounded up: least
        // recently used eviction over a thinned stream of requests evicts about as the whole
        // cache does over the whole stream, at the same fraction of its size.
        let budget = backend
            .cache_tokens
            .div_ceil(u64::from(self.topology.replicas.max(1)));
        let index = self.topology.insert(
            id,
            &backend.node,
            backend.slots,
            backend.prompt_cache_bytes,
            budget,
        ) as usize;
        let m = &mut self.topology.members[index];
        m.extensions = backend.extensions.clone();
        let context = backend.context.map_or(0, NonZeroU64::get);
        m.load.context.store(context, Ordering::Relaxed);
        let request_context = backend.request_context_limit().map_or(0, NonZeroU64::get);
        m.load
            .request_context
            .store(request_context, Ordering::Relaxed);
        m.load.assign_slots(backend.assign_slots);
        if self.backends.len() <= index {
            self.backends.resize_with(index + 1, || None);
        }
        self.backends[index] = Some(backend);
    }

    pub(crate) fn remove(&mut self, id: &BackendId) -> bool {
        match self.topology.remove(id) {
            Some(index) => {
                self.backends[index as usize] = None;
                true
            }
            None => false,
        }
    }

    pub(crate) fn service(&self, index: u32) -> Option<&S> {
        self.backends
            .get(index as usize)?
            .as_ref()
            .map(|b| &b.service)
    }
}

/// A snapshot of one backend's state, for metrics and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BackendStatus {
    /// The backend.
    pub id: BackendId,
    /// Its node.
    pub node: NodeId,
    /// How many requests it serves at once.
    pub slots: u32,
    /// Requests dispatched to it whose response has not ended.
    pub in_flight: u32,
    /// Whether it is taking requests (not marked down).
    pub healthy: bool,
    /// Requests that failed on it before it answered (its readiness or its call failed, or
    /// the body of a `400` that [`ReadRefusals`](crate::ReadRefusals) read), or that it
    /// answered with 503 Service Unavailable, counted since it joined the fleet. A backend
    /// removed and announced again keeps its counts, unless a backend announced after 64
    /// others were removed after it took its place meanwhile: then it starts again from 0,
    /// while its `metrics` series go on from where they were. (Once 64 others were removed
    /// after it, its cache model and its sessions are forgotten, place taken or not.) The
    /// fleet's total, removed backends' included, is
    /// [`Stats::backend_errors`](crate::Stats::backend_errors).
    pub failures: u64,
    /// Answers it began and did not finish (their body failed: the backend cut its stream,
    /// or its connection dropped), counted as [`failures`](Self::failures) are. Such an answer
    /// does not mark the backend down, as the client has part of it already; this count is
    /// how an operator sees a backend that keeps cutting its answers. (A `400` whose body
    /// fails while [`ReadRefusals`](crate::ReadRefusals) reads it reached no client: it
    /// counts among the `failures`, and marks the backend down.)
    pub cut_answers: u64,
    /// Answers it gave to requests sent to it a second time, their first connection closed
    /// before any answer (a backend service marks such an answer [`SentAgain`](crate::SentAgain):
    /// [`HttpBackend`'s](crate::client::HttpBackend)
    /// [`resend_on_close`](crate::client::Builder::resend_on_close) does), counted as
    /// [`failures`](Self::failures) are. The requests were answered; a count that grows says the
    /// backend closes connections a request was sent on (llama-server after each streamed
    /// answer).
    pub sent_again: u64,
    /// Conversations the cache model says it homes: the tips of the prompts it holds.
    pub conversations: u32,
    /// Tokens of prompt the cache model says it holds.
    pub cached_tokens: u64,
    /// The budget the cache model keeps it to, in tokens: the
    /// [`cache_tokens`](crate::Backend::cache_tokens) it declared (this replica's share of
    /// it, with [`replicas`](crate::SessionAffinityLayer::replicas)), grown up to twice that
    /// while its answers show it holds more. `cached_tokens / cache_budget` is how full the
    /// model says it is.
    pub cache_budget: u64,
    /// Prompt-chain links the cache model tracks for it.
    pub cached_blocks: usize,
    /// Links the cache model evicted to stay within the backend's budget.
    pub evicted_blocks: u64,
    /// Prompt tokens of its requests in flight that it has not answered yet and that the
    /// cache model said it lacked: what it is still reading, by the model's estimate. A
    /// request that would move here waits behind them (see
    /// [`wait_versus_move`](crate::SessionAffinityLayer::wait_versus_move)).
    pub unread_tokens: u64,
    /// The tokens of context its running requests share, if given
    /// ([`Backend::context_tokens`]).
    pub context_limit: Option<u64>,
    /// Of them, the tokens its requests in flight take, by the router's estimate.
    pub context_in_flight: u64,
    /// The most tokens of context one request can take, if known
    /// ([`Backend::request_context_limit`], or learned by a health probe or from a refusal).
    pub request_context_limit: Option<u64>,
    /// Answers that reported their usage (see
    /// [`SessionAffinityLayer::observe_usage`](crate::SessionAffinityLayer::observe_usage)).
    pub usage_reports: u64,
    /// Prompt tokens of those answers that said how many they reused.
    pub prompt_tokens: u64,
    /// Of them, the tokens the backend said it reused from its cache: `reused_tokens /
    /// prompt_tokens` is the reuse its placement achieved.
    pub reused_tokens: u64,
    /// Prompt tokens of the answers that did not say how many they reused.
    pub unreported_prompt_tokens: u64,
    /// Answers that reused less than half the share of their prompt the cache model
    /// predicted, where it predicted at least a quarter; each corrected the model. Few against `usage_reports` means the model predicts well.
    pub corrections: u64,
    /// The prompt tokens it reads a second, learned from its answers that read at least 256
    /// tokens of their prompt (reused tokens aside: a shorter read's time is mostly the
    /// request's fixed cost). `None` until one has, however many shorter ones came.
    pub prefill_rate: Option<u32>,
    /// How long its requests take, dispatch to the end of the answer: a moving average of
    /// medians, as [`first_byte_time`](Self::first_byte_time) is.
    pub request_time: Option<Duration>,
    /// Its time to first byte, over its successful answers (an error comes at once): a moving
    /// average that gives the newest answer a weight of 1/4, of the median of each answer's
    /// time and the two before it, so that one odd answer does not move it and a backend that
    /// got slower or faster is followed from its second answer on. The first answer's time
    /// stands until the third, whose median of the three replaces it. For a Responses stream,
    /// the time to its first event after `response.created` and `response.in_progress`, which
    /// the backend sends before it has read the prompt.
    pub first_byte_time: Option<Duration>,
}

impl Topology {
    /// Requests in flight over every backend discovery knows, live or removed (a removed
    /// backend's last requests may still be streaming). O(backends): no request updates a
    /// fleet-wide counter.
    pub(crate) fn in_flight(&self) -> usize {
        self.members
            .iter()
            .map(|m| m.load.in_flight() as usize)
            .sum()
    }

    /// Bytes the live backends' cache models hold.
    pub(crate) fn cache_model_bytes(&self) -> usize {
        self.live
            .indexes()
            .map(|i| self.member(i).cache.lock().memory_bytes())
            .sum()
    }

    pub(crate) fn status(&self, now_ms: u64) -> Vec<BackendStatus> {
        self.live
            .indexes()
            .map(|i| self.status_of(i, now_ms))
            .collect()
    }

    /// Sets each live backend's level gauges, through its own handles: under the labels its
    /// counters have, those of the node discovery first gave it, which its removal zeroes.
    #[cfg(feature = "metrics")]
    pub(crate) fn publish_levels(&self, now_ms: u64) {
        for i in self.live.indexes() {
            let status = self.status_of(i, now_ms);
            self.member(i).load.metrics.publish(&status);
        }
    }

    /// Whether a backend up other than `except` has room for a prompt of `tokens` tokens:
    /// a request context larger than that, or none known.
    pub(crate) fn takes_elsewhere(&self, tokens: u64, except: Option<&str>, now_ms: u64) -> bool {
        self.live.indexes().map(|i| self.member(i)).any(|m| {
            except != Some(m.id.as_str())
                && !m.load.is_down(now_ms)
                && m.load.request_limit() > tokens
        })
    }

    /// Backend `index`'s status.
    fn status_of(&self, i: u32, now_ms: u64) -> BackendStatus {
        let m = self.member(i);
        let cache = m.cache.lock();
        let l = &m.load.learned;
        BackendStatus {
            id: m.id.clone(),
            node: self.node(m.node).id.clone(),
            slots: m.load.slots.load(Ordering::Relaxed),
            in_flight: m.load.in_flight(),
            // Read only: a cooldown that has passed is placement's to clear, and to log as the
            // backend's return.
            healthy: !m.load.is_down(now_ms),
            failures: m.load.failures.load(Ordering::Relaxed),
            cut_answers: m.load.cut_answers.load(Ordering::Relaxed),
            sent_again: m.load.sent_again.load(Ordering::Relaxed),
            conversations: cache.conversations(),
            cached_tokens: cache.tokens(),
            cache_budget: cache.budget(),
            cached_blocks: cache.blocks(),
            evicted_blocks: cache.evicted(),
            unread_tokens: l.unread_tokens.load(Ordering::Relaxed),
            context_limit: Some(m.load.context.load(Ordering::Relaxed)).filter(|&c| c > 0),
            context_in_flight: m.load.context_in_flight.load(Ordering::Relaxed),
            request_context_limit: Some(m.load.request_context.load(Ordering::Relaxed))
                .filter(|&c| c > 0),
            usage_reports: l.reports.load(Ordering::Relaxed),
            prompt_tokens: l.prompt_tokens.load(Ordering::Relaxed),
            reused_tokens: l.reused_tokens.load(Ordering::Relaxed),
            unreported_prompt_tokens: l.unreported_prompt_tokens.load(Ordering::Relaxed),
            corrections: l.corrections.load(Ordering::Relaxed),
            prefill_rate: l
                .prefill_rate()
                .map(|r| r.round().min(f64::from(u32::MAX)) as u32),
            request_time: l.request_time(),
            first_byte_time: l.first_byte_time(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    /// The guard moves with every response future: 40 bytes. Its prompt tokens not yet read
    /// are 32 bits; a prompt past them counts as 2^32 - 1 tokens, added to the backend's
    /// backlog and taken off it as one.
    #[test]
    fn a_slot_guard_is_forty_bytes_and_takes_off_the_backlog_what_it_put_on() {
        assert_eq!(std::mem::size_of::<SlotGuard>(), 40);
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"n1".into(), nz(1), None, 1000);
        let load = t.member(a).load.clone();
        assert!(load.try_acquire());
        let mut guard = SlotGuard::new(&load, a, 5);
        guard.reading(3);
        guard.reading(u64::MAX);
        assert_eq!(load.learned.backlog(), u64::from(u32::MAX));
        guard.prompt_read();
        assert_eq!(load.learned.backlog(), 0);
        guard.reading(7);
        drop(guard);
        assert_eq!(load.learned.backlog(), 0);
    }

    #[test]
    fn reinserting_an_id_keeps_its_index_and_generation() {
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"n1".into(), nz(1), None, 1000);
        let g = t.member(a).generation;
        assert_eq!(t.insert("a".into(), &"n2".into(), nz(3), None, 1000), a);
        assert_eq!(t.member(a).generation, g);
        assert_eq!(t.node(t.member(a).node).id.as_str(), "n2");
        assert_eq!(t.node(0).slots, 0);
        assert_eq!(t.node(1).slots, 3);
        // Removed then re-inserted before reuse: still the same backend.
        t.remove(&"a".into());
        assert_eq!(t.resolve(a, g), None);
        assert_eq!(t.insert("a".into(), &"n2".into(), nz(3), None, 1000), a);
        assert_eq!(t.resolve(a, g), Some(a));
    }

    #[test]
    fn a_node_no_backend_names_is_forgotten_and_a_record_of_it_names_no_newcomer() {
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"10.0.0.1".into(), nz(1), None, 1000);
        let stays = t.insert("s".into(), &"host".into(), nz(1), None, 1000);
        let mark = t.node_mark(t.member(a).node);
        assert_eq!(t.resolve_node(mark), Some(t.member(a).node));
        // Pods rescheduled under new addresses, one at a time, the node named by address.
        for i in 0..10_000u32 {
            let old = if i == 0 {
                "a".into()
            } else {
                (i - 1).to_string()
            };
            t.remove(&old.into());
            let ip = format!("10.1.{}.{}", i / 256, i % 256);
            t.insert(i.to_string().into(), &ip.as_str().into(), nz(1), None, 1000);
        }
        // Each newcomer took the index of a backend that forgot its model, which let go of
        // its node: the nodes known are the host's, the last address's and those of the
        // removed backends that keep their places, and the indexes of those forgotten last
        // wait to be given again.
        let most = 3 + Topology::KEPT_REMOVED + Topology::NODES_KEPT_FORGOTTEN;
        assert!(t.nodes.len() <= most, "{} nodes", t.nodes.len());
        assert_eq!(t.node_by_id.len(), 2 + Topology::KEPT_REMOVED);
        assert_eq!(
            t.resolve_node(mark),
            None,
            "the first address's node is gone"
        );
        let host = t.member(stays).node;
        assert_eq!(t.resolve_node(t.node_mark(host)), Some(host));
        assert_eq!(t.node(host).id.as_str(), "host");
        // A backend moved to another node lets go of the one it left.
        t.insert("s".into(), &"other".into(), nz(1), None, 1000);
        assert!(!t.node_by_id.contains_key("host"));
        assert_eq!(t.resolve_node(t.node_mark(host)), None);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]

        /// Whatever backends come, move and go: every backend the topology keeps (live or
        /// removed) names the node it was last announced on, every node it knows is named
        /// by a backend, and a forgotten node's records resolve to nothing.
        #[test]
        fn every_node_known_is_one_a_backend_is_on(
            ops in proptest::collection::vec((0u8..10, 0u8..6, proptest::bool::ANY), 1..200),
        ) {
            let mut t = Topology::default();
            let mut on: HashMap<String, String> = HashMap::new();
            let mut marks: Vec<(u32, String)> = Vec::new();
            for (backend, node, insert) in ops {
                let (id, node) = (format!("b{backend}"), format!("n{node}"));
                if insert {
                    let i = t.insert(id.as_str().into(), &node.as_str().into(), nz(1), None, 100);
                    marks.push((t.node_mark(t.member(i).node), node.clone()));
                    on.insert(id, node);
                } else {
                    t.remove(&id.as_str().into());
                }
                let mut named: HashMap<u32, u32> = HashMap::new();
                for m in &t.members {
                    let node = t.node(m.node);
                    if let Some(want) = t.by_id.get(&m.id).and(on.get(m.id.as_str())) {
                        proptest::prop_assert_eq!(node.id.as_str(), want.as_str());
                    }
                    *named.entry(m.node).or_default() += 1;
                }
                for (id, &i) in &t.node_by_id {
                    proptest::prop_assert_eq!(&t.node(i).id, id);
                    proptest::prop_assert_eq!(named.get(&i).copied(), Some(t.node(i).members));
                }
                proptest::prop_assert_eq!(named.len(), t.node_by_id.len());
                // A backend moving takes its new node's index before it lets go of its old;
                // forgotten nodes' indexes wait before they are given again.
                let most = t.members.len() + 1 + Topology::NODES_KEPT_FORGOTTEN;
                proptest::prop_assert!(t.nodes.len() <= most);
                for (mark, node) in &marks {
                    if let Some(i) = t.resolve_node(*mark) {
                        proptest::prop_assert_eq!(t.node(i).id.as_str(), node.as_str());
                    }
                }
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Whatever backends come, change slots, move, go and come back, with requests in
        /// flight throughout: the sums of slots are those of the live backends, each node
        /// ranks its live backends and only nodes with one are ranked, the requests in flight
        /// are those held, a removed backend takes no slot, and a session's record of a
        /// backend names that backend or none.
        #[test]
        fn the_fleets_counts_and_sets_are_those_of_its_live_backends(
            ops in proptest::collection::vec((0u8..4, 0u8..8, 0u8..4, 1u32..5), 1..150),
        ) {
            let mut t = Topology::default();
            let mut held: Vec<(String, Arc<Load>)> = Vec::new();
            let mut records: Vec<(String, u32, u16)> = Vec::new();
            for (op, backend, node, slots) in ops {
                let id = format!("b{backend}");
                match op {
                    0 | 1 => {
                        let i = t.insert(
                            id.as_str().into(),
                            &format!("n{node}").as_str().into(),
                            nz(slots),
                            None,
                            100,
                        );
                        records.push((id, i, t.member(i).generation));
                    }
                    2 => {
                        t.remove(&id.as_str().into());
                    }
                    _ => {
                        if let Some(i) = t.index_of(&id) {
                            let load = t.member(i).load.clone();
                            if load.try_acquire() || load.force_acquire() {
                                held.push((id, load));
                            }
                        } else if let Some(at) = (!held.is_empty()).then(|| slots as usize % held.len()) {
                            let (_, load) = held.swap_remove(at);
                            load.in_flight.fetch_sub(1, Ordering::SeqCst);
                        }
                    }
                }
                let live: Vec<u32> = (0..t.members.len() as u32)
                    .filter(|&i| t.member(i).live)
                    .collect();
                let slots_of = |i: u32| t.member(i).load.slots.load(Ordering::Relaxed);
                proptest::prop_assert_eq!(t.total_slots, live.iter().map(|&i| slots_of(i)).sum::<u32>());
                let mut ranked: Vec<u32> = t.live.indexes().collect();
                ranked.sort_unstable();
                proptest::prop_assert_eq!(&ranked, &live);
                for (n, entry) in t.nodes.iter().enumerate() {
                    let on: Vec<u32> = live.iter().copied().filter(|&i| t.member(i).node == n as u32).collect();
                    let mut ranked: Vec<u32> = entry.backends.indexes().collect();
                    ranked.sort_unstable();
                    proptest::prop_assert_eq!(&ranked, &on, "node {}", n);
                    proptest::prop_assert_eq!(entry.slots, on.iter().map(|&i| slots_of(i)).sum::<u32>());
                    let drawn = t.live_nodes.indexes().any(|x| x == n as u32);
                    proptest::prop_assert_eq!(drawn, !on.is_empty(), "node {} drawn", n);
                    for &i in &on {
                        proptest::prop_assert_eq!(t.member(i).load.node.load(Ordering::Relaxed), n as u32);
                    }
                }
                proptest::prop_assert_eq!(t.in_flight(), held.len());
                let mut free: Vec<u32> = t.free.iter().copied().collect();
                free.sort_unstable();
                free.dedup();
                proptest::prop_assert_eq!(free.len(), t.free.len(), "an index freed twice");
                proptest::prop_assert!(free.iter().all(|&i| !t.member(i).live));
                for (id, &i) in &t.by_id {
                    proptest::prop_assert_eq!(&t.member(i).id, id);
                }
                for m in &t.members {
                    if !m.live {
                        proptest::prop_assert!(!m.load.try_acquire() && !m.load.force_acquire());
                    }
                }
                for (id, i, generation) in &records {
                    if let Some(r) = t.resolve(*i, *generation) {
                        proptest::prop_assert_eq!(t.member(r).id.as_str(), id.as_str());
                    }
                }
                for (id, load) in &held {
                    let same = t.index_of(id).is_some_and(|i| Arc::ptr_eq(&t.member(i).load, load));
                    if !same {
                        proptest::prop_assert!(t.members.iter().any(|m| Arc::ptr_eq(&m.load, load)), "{} in flight and not counted", id);
                    }
                }
            }
        }
    }

    #[test]
    fn a_backend_announced_again_with_the_same_budget_keeps_what_its_model_learned() {
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"n".into(), nz(1), None, 1_600);
        // Its answers showed it holds more than it declared: its model grows, and fills.
        let cell = t.member(a).cache.clone();
        for _ in 0..4 {
            cell.lock().correct(crate::cache::Verdict::HeldMore, 0, 0);
        }
        assert_eq!(cell.lock().budget(), 2_000);
        let chain = crate::PromptChain::from_blocks((0..20).map(|i| (i, 100)));
        cell.lock().record(chain.links(), 0, cell.reserve());
        // Its slot count learned (a probe read /slots): announced again, same budget.
        assert_eq!(t.insert("a".into(), &"n".into(), nz(4), None, 1_600), a);
        assert_eq!(cell.lock().budget(), 2_000);
        assert_eq!(cell.lock().held(chain.links()), 20);
        // Another budget declared: it starts over from that.
        t.insert("a".into(), &"n".into(), nz(4), None, 1_000);
        assert_eq!(cell.lock().budget(), 1_000);
        assert_eq!(cell.lock().held(chain.links()), 10);
    }

    #[test]
    fn a_record_of_a_forgotten_node_names_none_of_the_many_that_come_after_it() {
        // One index reused over and over would wrap its generation: a session's old record
        // would name a newcomer again (after 256 reuses, with 8 bits and no wait).
        let mut t = Topology::default();
        t.insert("stays".into(), &"host".into(), nz(1), None, 1000);
        let a = t.insert("a0".into(), &"ip0".into(), nz(1), None, 1000);
        let mark = t.node_mark(t.member(a).node);
        for i in 1..20_000u32 {
            t.remove(&format!("a{}", i - 1).into());
            let ip = format!("ip{i}");
            t.insert(
                format!("a{i}").into(),
                &ip.as_str().into(),
                nz(1),
                None,
                1000,
            );
            // Its node is known while a0 keeps its place (see `KEPT_REMOVED`), then never
            // again: the mark names no newcomer's.
            let named = t.resolve_node(mark).map(|n| t.node(n).id.clone());
            assert!(named.is_none_or(|n| n.as_str() == "ip0"), "named {ip}");
        }
        assert_eq!(t.resolve_node(mark), None);
    }

    #[test]
    fn a_record_of_a_node_on_an_index_given_again_names_that_node() {
        let mut t = Topology::default();
        let mut reused = 0;
        for i in 0..1_000u32 {
            if i > 0 {
                t.remove(&format!("a{}", i - 1).into());
            }
            let ip = format!("ip{i}");
            let b = t.insert(
                format!("a{i}").into(),
                &ip.as_str().into(),
                nz(1),
                None,
                1000,
            );
            let node = t.member(b).node;
            reused += usize::from(t.node(node).generation > 0);
            assert_eq!(t.resolve_node(t.node_mark(node)), Some(node), "{ip}");
        }
        assert!(reused > 0, "no node index was given again");
    }

    #[test]
    fn a_prompt_is_taken_elsewhere_only_by_another_backend_up_whose_request_context_is_larger() {
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"n".into(), nz(1), None, 1000);
        let b = t.insert("b".into(), &"n".into(), nz(1), None, 1000);
        t.member(a).load.learn_request_limit(100);
        t.member(b).load.learn_request_limit(200);
        assert!(t.takes_elsewhere(150, Some("a"), 0));
        // A prompt as long as the request context does not fit it.
        assert!(!t.takes_elsewhere(200, Some("a"), 0));
        assert!(!t.takes_elsewhere(150, Some("b"), 0));
        assert!(t.takes_elsewhere(150, None, 0));
        assert!(t.member(b).load.mark_down(1_000, 0));
        assert!(!t.takes_elsewhere(150, Some("a"), 500));
        assert!(t.takes_elsewhere(150, Some("a"), 1_000));
        t.remove(&"b".into());
        assert!(!t.takes_elsewhere(150, Some("a"), 1_000));
        // A backend with no limit known takes any prompt.
        t.insert("c".into(), &"n".into(), nz(1), None, 1000);
        assert!(t.takes_elsewhere(u64::MAX - 1, Some("a"), 1_000));
    }

    #[test]
    fn a_status_names_no_context_limit_that_is_not_known() {
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"n".into(), nz(1), None, 1000);
        let s = &t.status(0)[0];
        assert_eq!((s.context_limit, s.request_context_limit), (None, None));
        t.member(a).load.context.store(4_000, Ordering::Relaxed);
        t.member(a).load.learn_request_limit(1_000);
        let s = &t.status(0)[0];
        assert_eq!(
            (s.context_limit, s.request_context_limit),
            (Some(4_000), Some(1_000))
        );
    }

    #[test]
    fn the_slot_a_request_was_assigned_is_named_without_its_queued_and_freed_marks() {
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"n".into(), nz(4), None, 1000);
        let load = t.member(a).load.clone();
        assert!(load.try_acquire());
        let mut guard = SlotGuard::new(&load, a, 0);
        assert_eq!(guard.assigned_slot(), None);
        guard.assigned = 3 | SLOT_QUEUED;
        assert_eq!(
            (guard.assigned_slot(), guard.holds_assigned_slot()),
            (Some(3), true)
        );
        guard.release_assigned_slot();
        assert_eq!(
            (guard.assigned_slot(), guard.holds_assigned_slot()),
            (Some(3), false)
        );
    }

    #[test]
    fn a_slot_taken_after_its_backend_returned_records_how_often_it_returned() {
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"n".into(), nz(1), None, 1000);
        for _ in 0..2 {
            t.remove(&"a".into());
            assert_eq!(t.insert("a".into(), &"n".into(), nz(1), None, 1000), a);
        }
        let load = t.member(a).load.clone();
        assert!(load.try_acquire());
        let guard = SlotGuard::new(&load, a, 0);
        assert_eq!(guard.returns(), 2);
    }

    /// Removes `KEPT_REMOVED` backends named `prefix{i}` that were never announced before
    /// (announcing them first): every backend removed before them forgets its model.
    fn push_out_removed(t: &mut Topology, prefix: &str) {
        let ids: Vec<BackendId> = (0..Topology::KEPT_REMOVED)
            .map(|i| format!("{prefix}{i}").into())
            .collect();
        for id in &ids {
            t.insert(id.clone(), &"n".into(), nz(1), None, 1000);
        }
        for id in &ids {
            t.remove(id);
        }
    }

    #[test]
    fn a_newcomer_takes_no_place_a_removed_backend_keeps() {
        let mut t = Topology::default();
        let b0 = t.insert("b0".into(), &"n".into(), nz(1), None, 1000);
        let g0 = t.member(b0).generation;
        let chain = crate::PromptChain::from_blocks([(1, 100), (2, 100)]);
        t.member(b0).cache.lock().record(chain.links(), 0, 1);
        t.remove(&"b0".into());
        // A newcomer while b0 restarts (a rolling restart with the fleet scaled up, or a
        // flapping DNS record): a place of its own.
        let c = t.insert("c".into(), &"n".into(), nz(1), None, 1000);
        assert_ne!(c, b0);
        assert_eq!(t.insert("b0".into(), &"n".into(), nz(1), None, 1000), b0);
        assert_eq!(t.resolve(b0, g0), Some(b0), "b0 takes its sessions back");
        assert_eq!(t.member(b0).cache.lock().held(chain.links()), 2);
    }

    #[test]
    fn a_newcomer_takes_the_place_of_the_backend_forgotten_earliest() {
        let mut t = Topology::default();
        let b0 = t.insert("b0".into(), &"n".into(), nz(1), None, 1000);
        let b1 = t.insert("b1".into(), &"n".into(), nz(1), None, 1000);
        t.remove(&"b0".into());
        t.remove(&"b1".into());
        push_out_removed(&mut t, "f");
        let members = t.members.len();
        assert_eq!(t.insert("c".into(), &"n".into(), nz(1), None, 1000), b0);
        assert_eq!(t.insert("d".into(), &"n".into(), nz(1), None, 1000), b1);
        // The latest removed keep their places: the next newcomer takes a new one.
        t.insert("e".into(), &"n".into(), nz(1), None, 1000);
        assert_eq!(t.members.len(), members + 1);
    }

    #[test]
    fn a_removed_backends_place_waits_for_its_last_request_and_it_takes_none_meanwhile() {
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"n".into(), nz(2), None, 1000);
        let load = t.member(a).load.clone();
        assert!(load.try_acquire());
        t.remove(&"a".into());
        // Placed on a fleet from before the removal, a request takes no slot on it now.
        assert!(!load.try_acquire() && !load.force_acquire());
        assert_eq!(load.in_flight(), 1);
        push_out_removed(&mut t, "f");
        let b = t.insert("b".into(), &"n".into(), nz(1), None, 1000);
        assert_ne!(b, a, "a's request still streams");
        assert_eq!(t.in_flight(), 1);
        load.in_flight.fetch_sub(1, Ordering::SeqCst);
        assert_eq!(t.insert("c".into(), &"n".into(), nz(1), None, 1000), a);
        // Taken back before its place went to another, a backend takes slots again.
        let d = t.insert("d".into(), &"n".into(), nz(1), None, 1000);
        let load = t.member(d).load.clone();
        t.remove(&"d".into());
        assert!(!load.try_acquire());
        assert_eq!(t.insert("d".into(), &"n".into(), nz(1), None, 1000), d);
        assert!(load.try_acquire());
    }

    #[test]
    fn only_the_backends_removed_last_keep_their_models() {
        let mut t = Topology::default();
        let n = Topology::KEPT_REMOVED as u32 + 2;
        let chain = crate::PromptChain::from_blocks([(1, 100), (2, 100)]);
        let ids: Vec<BackendId> = (0..n).map(|i| format!("b{i}").into()).collect();
        let indices: Vec<u32> = ids
            .iter()
            .map(|id| t.insert(id.clone(), &"n".into(), nz(1), None, 1000))
            .collect();
        let generations: Vec<u16> = indices.iter().map(|&i| t.member(i).generation).collect();
        for &i in &indices {
            t.member(i).cache.lock().record(chain.links(), 0, 1);
        }
        for id in &ids {
            t.remove(id);
        }
        // The first two removed forgot their models and their sessions; the rest kept both.
        let held = |t: &Topology, i: u32| t.member(i).cache.lock().held(chain.links());
        for (k, &i) in indices.iter().enumerate() {
            let kept = k >= 2;
            assert_eq!(held(&t, i), if kept { 2 } else { 0 }, "b{k}");
            assert_eq!(t.member(i).generation == generations[k], kept, "b{k}");
        }
        // Back before its index is reused, a forgotten one is a new backend: its sessions'
        // homes do not resolve; a kept one takes its back.
        let (first, last) = (indices[0], indices[n as usize - 1]);
        assert_eq!(
            t.insert(ids[0].clone(), &"n".into(), nz(1), None, 1000),
            first
        );
        assert_eq!(t.resolve(first, generations[0]), None);
        let back = t.insert(ids[n as usize - 1].clone(), &"n".into(), nz(1), None, 1000);
        assert_eq!(back, last);
        assert_eq!(t.resolve(last, generations[n as usize - 1]), Some(last));
        assert_eq!(held(&t, last), 2);
    }

    #[test]
    fn a_reused_index_gets_a_new_generation() {
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"n".into(), nz(1), None, 1000);
        let g = t.member(a).generation;
        t.remove(&"a".into());
        push_out_removed(&mut t, "f");
        let b = t.insert("b".into(), &"n".into(), nz(1), None, 1000);
        assert_eq!(a, b);
        assert_eq!(t.resolve(a, g), None);
        assert_eq!(t.index_of("a"), None);
        assert_eq!(t.live_nodes.indexes().collect::<Vec<_>>(), vec![0]);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_down_mark_ends_in_the_millisecond_of_its_time_and_one_of_zero_now() {
        let capacity = Capacity::default();
        // 1.3 ms on the fleet's clock: between two of its ticks.
        let now = Instant::now() + Duration::from_micros(300);
        let now_ms = capacity.now_ms(now);
        let until = |c: Option<Duration>| capacity.down_until(now, c);
        assert_eq!(until(Some(Duration::ZERO)), now_ms, "up at once");
        assert_eq!(until(Some(Duration::from_micros(100))), now_ms + 1);
        assert_eq!(
            until(Some(Duration::from_micros(700))),
            now_ms + 1,
            "on a tick"
        );
        // 3.3 ms: the tick of 3 ms, not the next.
        assert_eq!(until(Some(Duration::from_millis(2))), now_ms + 2);
        assert_eq!(until(None), u64::MAX);
        assert_eq!(until(Some(Duration::MAX)), u64::MAX);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_failure_cooldown_never_shortens_a_longer_mark() {
        let load = Arc::new(Load::new(nz(1), Arc::default(), &"a".into(), &"n".into()));
        let _ = load.mark_down(u64::MAX, 0);
        assert!(load.try_acquire());
        SlotGuard::new(&load, 0, 1).fail(std::time::Duration::from_secs(5));
        assert_eq!(load.down_until.load(Ordering::Relaxed), u64::MAX);
        // Up, then failed: down for the cooldown only.
        load.down_until.store(0, Ordering::Relaxed);
        assert!(load.try_acquire());
        SlotGuard::new(&load, 0, 1).fail(std::time::Duration::from_secs(5));
        let until = load.down_until.load(Ordering::Relaxed);
        assert!(until > 0 && until < u64::MAX);
    }

    #[test]
    fn reading_a_backends_status_leaves_the_end_of_its_cooldown_to_placement() {
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"n".into(), nz(1), None, 1000);
        let load = t.member(a).load.clone();
        assert!(load.mark_down(2_000, 1_000));
        assert!(!t.status(1_500)[0].healthy);
        // The cooldown is over: the status says so, and placement still finds the backend's
        // return to log.
        assert!(t.status(2_500)[0].healthy);
        assert_eq!(load.health(2_500), (false, true));
    }

    #[test]
    fn a_backend_is_up_in_the_millisecond_its_down_mark_ends_by_every_reading() {
        let l = Load::new(nz(1), Arc::default(), &"a".into(), &"n".into());
        assert!(l.mark_down(2_000, 1_000));
        assert!(l.is_down(1_999));
        assert_eq!(l.health(1_999), (true, false));
        // The status, placement and the refusals read `is_down`; placement clears the mark
        // with `health`: both say up from the millisecond the mark ends in.
        assert!(!l.is_down(2_000), "up at its end, as health says");
        assert_eq!(l.health(2_000), (false, true));
    }

    #[test]
    fn decision_header_values_follow_a_backend_to_its_new_node() {
        let h = DecisionHeaders::new(&"a".into(), &"n1".into());
        assert_eq!(h.backend().unwrap(), "a");
        assert_eq!(h.node(&"n1".into()).unwrap(), "n1");
        assert_eq!(h.node(&"n2".into()).unwrap(), "n2");
        assert_eq!(h.node(&"n1".into()).unwrap(), "n1");
        let bad = DecisionHeaders::new(&"a\nb".into(), &"n\n".into());
        assert_eq!((bad.backend(), bad.node(&"n\n".into())), (None, None));
    }

    #[test]
    fn a_stamp_in_flight_reads_in_flight_until_it_ends_or_a_ring_later_takes_its_place() {
        let l = Load::new(nz(2), Arc::default(), &"a".into(), &"n".into());
        // 10 placed first; 11 placed after it, sent and recorded first.
        l.begin(10);
        l.begin(11);
        assert!(!l.has_ended(10) && !l.has_ended(11));
        l.end(11);
        assert!(l.has_ended(11) && !l.has_ended(10));
        // Across the clock's wrap (stamp 0 is never reserved).
        l.begin(u32::MAX - 1);
        l.begin(2);
        assert!(!l.has_ended(u32::MAX - 1) && !l.has_ended(2));
        // More than half a ring apart, both in flight (a backend with many slots).
        let far = 10 + ENDED_RING as u32 / 2;
        l.begin(far);
        assert!(!l.has_ended(10) && !l.has_ended(far));
        // Its place taken a ring later: ended, as far as the ring knows. Never begun, or
        // stamp 0 (none): ended.
        l.begin(10 + ENDED_RING as u32);
        assert!(l.has_ended(10));
        assert!(l.has_ended(12) && l.has_ended(0));
    }

    #[test]
    fn a_request_ending_a_ring_of_stamps_late_leaves_the_newer_stamps_as_they_are() {
        let l = Load::new(nz(2), Arc::default(), &"a".into(), &"n".into());
        let ring = ENDED_RING as u32;
        // A request in flight for long, while a ring's worth of others come and go.
        l.begin(5);
        for s in 6..5 + ring {
            l.begin(s);
            l.end(s);
        }
        // The request a ring later, on the same bit, is in flight when the long one ends.
        let newer = 5 + ring;
        l.begin(newer);
        l.end(5);
        assert!(!l.has_ended(newer), "still in flight");
        l.end(newer);
        assert!(l.has_ended(newer));
        // Another long request; a ring later, a record with no request here (one learned
        // from another replica) takes its bit: it has nothing in flight.
        l.begin(newer + 1);
        for s in newer + 2..newer + 1 + ring {
            l.begin(s);
            l.end(s);
        }
        let learned = newer + 1 + ring;
        assert!(l.has_ended(learned), "never began here");
    }

    /// `BackendStatus::failures` and the counts beside it: a backend whose model was
    /// forgotten (64 others removed after it) but whose place no newcomer took keeps them
    /// when announced again; one whose place was taken starts again from 0.
    #[test]
    fn a_backend_announced_again_keeps_its_counts_unless_its_place_was_taken() {
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"n".into(), nz(1), None, 1000);
        t.member(a).load.failures.fetch_add(1, Ordering::Relaxed);
        t.remove(&"a".into());
        push_out_removed(&mut t, "b");
        assert!(t.member(a).forgotten);
        assert_eq!(t.insert("a".into(), &"n".into(), nz(1), None, 1000), a);
        assert_eq!(t.status_of(a, 0).failures, 1, "forgotten, its place kept");
        t.remove(&"a".into());
        push_out_removed(&mut t, "c");
        let mut n = 0;
        while t.member(a).id.as_str() == "a" {
            t.insert(format!("z{n}").into(), &"n".into(), nz(1), None, 1000);
            n += 1;
        }
        let back = t.insert("a".into(), &"n".into(), nz(1), None, 1000);
        assert_ne!(back, a);
        assert_eq!(t.status_of(back, 0).failures, 0, "its place taken");
    }

    #[test]
    fn a_forgotten_model_stamps_on_from_where_it_stopped() {
        let mut t = Topology::default();
        let a = t.insert("a".into(), &"n".into(), nz(1), None, 1000);
        let others: Vec<BackendId> = (0..Topology::KEPT_REMOVED)
            .map(|i| format!("b{i}").into())
            .collect();
        for id in &others {
            t.insert(id.clone(), &"n".into(), nz(1), None, 1000);
        }
        // A request placed on a, still streaming when a goes; enough go after it for its
        // model to be forgotten.
        let load = t.member(a).load.clone();
        let old = t.member(a).cache.reserve();
        load.begin(old);
        t.remove(&"a".into());
        for id in &others {
            t.remove(id);
        }
        assert!(t.member(a).forgotten);
        // Back before its index is reused: its first request is in flight when the old one
        // ends.
        assert_eq!(t.insert("a".into(), &"n".into(), nz(1), None, 1000), a);
        let new = t.member(a).cache.reserve();
        assert_ne!(new, old);
        t.member(a).load.begin(new);
        load.end(old);
        assert!(!t.member(a).load.has_ended(new));
    }

    #[test]
    fn slot_counter_never_exceeds_slots_without_force() {
        let l = Load::new(nz(2), Arc::default(), &"a".into(), &"n".into());
        assert!(l.try_acquire());
        assert!(l.try_acquire());
        assert!(!l.try_acquire());
        assert!(l.force_acquire());
        assert_eq!(l.in_flight(), 3);
    }

    #[test]
    fn a_slot_promised_to_a_woken_waiter_is_not_free() {
        let l = Load::new(nz(2), Arc::default(), &"a".into(), &"n".into());
        assert!(l.try_acquire());
        assert!(l.has_free_slot());
        // The other slot is promised: none is free, to the look as to the taking.
        l.reserved.store(1, Ordering::Relaxed);
        assert!(!l.has_free_slot());
        assert!(!l.try_acquire());
    }

    #[test]
    fn a_prompt_is_too_long_for_a_request_context_by_the_backends_own_tokens() {
        let l = Load::new(nz(4), Arc::default(), &"a".into(), &"n".into());
        assert!(!l.too_small_for(u64::MAX), "no limit");
        l.request_context.store(1_000, Ordering::Relaxed);
        // Until answers teach the scale, as estimated; a prompt of the whole limit leaves
        // the answer no token, and is refused.
        assert!(!l.too_small_for(999));
        assert!(l.too_small_for(1_000));
        l.learned.set_token_scale(1.25);
        assert!(!l.too_small_for(799));
        assert!(l.too_small_for(800));
        assert!(!l.too_small_for(0), "a request without a chain counts none");
        // Smaller than another only with a smaller limit.
        let same = Load::new(nz(4), Arc::default(), &"b".into(), &"n".into());
        same.request_context.store(1_000, Ordering::Relaxed);
        assert!(
            !l.smaller_than(&same, 900),
            "1,125 here, 900 there, of the same 1,000"
        );
        let larger = Load::new(nz(4), Arc::default(), &"c".into(), &"n".into());
        larger.request_context.store(2_000, Ordering::Relaxed);
        assert!(l.smaller_than(&larger, 900));
        assert!(!l.smaller_than(&larger, 700), "taken here");
        assert!(!l.smaller_than(&larger, 2_001), "too long there too");
        let unlimited = Load::new(nz(4), Arc::default(), &"d".into(), &"n".into());
        assert!(l.smaller_than(&unlimited, 900));
    }

    #[test]
    fn no_need_or_no_limit_fits_beside_any_context_held() {
        let l = Load::new(nz(4), Arc::default(), &"a".into(), &"n".into());
        l.context.store(1_000, Ordering::Relaxed);
        // Overcommitted: more held than the limit.
        assert_eq!(l.force_context(1_500), 1_500);
        assert!(!l.has_context_for(1));
        assert!(
            l.has_context_for(0),
            "a request without a prompt needs no room"
        );
        // The limit taken away (announced again without one) while those still hold it.
        l.context.store(0, Ordering::Relaxed);
        assert!(l.has_context_for(600));
    }

    #[test]
    fn a_forced_request_counts_no_context_on_a_backend_without_a_limit() {
        let l = Load::new(nz(4), Arc::default(), &"a".into(), &"n".into());
        assert_eq!(l.force_context(600), 0);
        assert_eq!(l.context_in_flight.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_slot_comes_with_context_only_while_the_prompt_fits_and_is_given_back_with_it() {
        let l = Arc::new(Load::new(nz(4), Arc::default(), &"a".into(), &"n".into()));
        // No limit: nothing counted.
        assert_eq!((l.context_need(500), l.try_acquire_for(500)), (0, Some(0)));
        l.in_flight.fetch_sub(1, Ordering::SeqCst);
        l.context.store(1_000, Ordering::Relaxed);
        // Until the backend's answers teach its scale, a token of the estimate counts as two.
        assert_eq!(l.context_need(600), 1_200);
        l.learned.set_token_scale(1.0);
        assert_eq!(l.context_need(600), 600);
        assert_eq!(l.try_acquire_for(600), Some(600));
        let first = SlotGuard::new(&l, 0, 0).with_context(600);
        // 600 more would pass 1,000: no slot is kept for it.
        assert!(!l.has_context_for(600));
        assert_eq!(l.try_acquire_for(600), None);
        assert_eq!(l.in_flight(), 1);
        assert_eq!(l.try_acquire_for(400), Some(400));
        let second = SlotGuard::new(&l, 0, 0).with_context(400);
        assert_eq!(l.context_in_flight.load(Ordering::Relaxed), 1_000);
        drop((first, second));
        assert_eq!(
            (l.in_flight(), l.context_in_flight.load(Ordering::Relaxed)),
            (0, 0)
        );
        // Alone, a prompt longer than the whole context is taken.
        assert_eq!(l.try_acquire_for(5_000), Some(5_000));
        assert_eq!(l.force_context(10), 10);
        assert_eq!(l.context_in_flight.load(Ordering::Relaxed), 5_010);
        // The backend's own tokens, once its answers taught how many a token of the
        // estimate is.
        l.learned.set_token_scale(3.5);
        assert_eq!(l.context_need(100), 350);
    }
}
