//! [`PromptChain`]: what a request's prompt shares with earlier ones.
//!
//! A chain is the prompt's digest at each message boundary, in order, and at fixed blocks
//! inside long messages; read from a body, at most 64 links plus one per 16 of its estimated
//! tokens (a run of tiny messages shares a link). Each digest covers everything before
//! it, so two requests share a link when they share the whole prompt up to it, as the bytes
//! read (see [`BodyKeyLayer`](crate::key::BodyKeyLayer) for what is left out): the longest run
//! of equal leading links is the longest prefix a model server could reuse. The
//! [cache model](crate::placement) keeps the links each backend probably still holds.
//!
//! Digests are 64-bit xxh3, not SHA-256: a chain digests every byte of every prompt on the
//! request path (a 256 KiB body is hashed in a few microseconds), and a collision costs at most
//! one mispredicted cache hit. They are the same in every process (fixed seeds), so a shared
//! [store](crate::store) can name a keyless conversation by the digest of its latest turn's
//! prompt; the prompt itself never leaves the process.

use std::fmt;
use std::sync::{Arc, LazyLock};

use memchr::memmem::Finder;

use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// One link of a [`PromptChain`]: the digest of the prompt up to a boundary, and the prompt's
/// size up to and including it. Read from [`PromptChain::links`]; a chain of your own is built
/// with [`PromptChain::from_blocks`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Link {
    /// Digest of the whole prompt up to this boundary.
    pub digest: u64,
    /// Bytes of the prompt up to this boundary.
    pub bytes: u64,
    /// Estimated tokens of the prompt up to this boundary. Read from a body: four bytes a
    /// token, and a digit a token (the digits of a JSON `\uXXXX` escape aside, where digits
    /// are dense); an encoded payload (an image) at most 1,024; a token id of a `prompt` one.
    pub tokens: u64,
}

/// The digests of a prompt at each message boundary, and at fixed blocks inside long
/// messages, in order.
///
/// [`BodyKeyLayer`](crate::key::BodyKeyLayer) builds one for every JSON request it reads (see
/// [`PromptFacts`](crate::key::PromptFacts)); a simulator or a custom layer builds one from its
/// own blocks with [`PromptChain::from_blocks`]. Cloning is cheap: the links are shared.
///
/// ```
/// use tower_affinity::PromptChain;
///
/// // Two turns of one conversation: the second repeats the first's blocks and adds two.
/// let first = PromptChain::from_blocks([(1, 2_000), (2, 4_500)]);
/// let second = PromptChain::from_blocks([(1, 2_000), (2, 4_500), (7, 300), (8, 160)]);
/// assert_eq!(second.common_prefix(&first), 2);
/// assert_eq!(second.tokens_at(2), 6_500);
/// assert_eq!(second.tokens(), 6_960);
/// // Another conversation that shares only the system prompt.
/// let other = PromptChain::from_blocks([(1, 2_000), (3, 900)]);
/// assert_eq!(other.common_prefix(&second), 1);
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct PromptChain {
    links: Arc<[Link]>,
}

impl PromptChain {
    /// The most links a chain keeps; a longer prompt is tracked up to here.
    pub const MAX_LINKS: usize = 8192;

    /// Builds a chain from blocks given as `(id, tokens)`: equal ids at equal positions are
    /// equal content (a Mooncake trace's `hash_ids`, or one id per message). Bytes are
    /// estimated at four a token.
    pub fn from_blocks<I>(blocks: I) -> Self
    where
        I: IntoIterator<Item = (u64, u32)>,
    {
        let mut digest = 0u64;
        let mut tokens = 0u64;
        let links: Vec<Link> = blocks
            .into_iter()
            .take(Self::MAX_LINKS)
            .map(|(id, t)| {
                let mut buf = [0u8; 16];
                buf[..8].copy_from_slice(&digest.to_le_bytes());
                buf[8..].copy_from_slice(&id.to_le_bytes());
                digest = xxh3_64_with_seed(&buf, BLOCK_SEED);
                tokens += u64::from(t);
                Link {
                    digest,
                    bytes: tokens * BYTES_PER_TOKEN,
                    tokens,
                }
            })
            .collect();
        PromptChain {
            links: links.into(),
        }
    }

    /// The links, in order.
    pub fn links(&self) -> &[Link] {
        &self.links
    }

    /// How many links the chain has.
    pub fn len(&self) -> usize {
        self.links.len()
    }

    /// Whether the chain has no link (a body with no prompt).
    pub fn is_empty(&self) -> bool {
        self.links.is_empty()
    }

    /// Estimated tokens of the whole prompt (as far as the chain goes).
    #[inline]
    pub fn tokens(&self) -> u64 {
        self.links.last().map_or(0, |l| l.tokens)
    }

    /// Estimated tokens of the first `links` links: what a cache holding them reuses.
    pub fn tokens_at(&self, links: usize) -> u64 {
        match links.min(self.links.len()) {
            0 => 0,
            n => self.links[n - 1].tokens,
        }
    }

    /// How many leading links this chain shares with `other`.
    pub fn common_prefix(&self, other: &PromptChain) -> usize {
        self.links
            .iter()
            .zip(other.links.iter())
            .take_while(|(a, b)| a.digest == b.digest)
            .count()
    }

    /// The positions of the links whose digests' low 16 bits are `tip` (see
    /// [`PromptChain::tip`]), last first: where the turn this chain extends may have ended.
    pub(crate) fn tip_positions(&self, tip: u16) -> impl Iterator<Item = usize> + '_ {
        self.links
            .iter()
            .enumerate()
            .rev()
            .filter(move |(_, l)| tip_of(l.digest) == tip)
            .map(|(i, _)| i)
    }

    /// A 16-bit fingerprint of where this turn ended, never 0 (0 means "no chain"), for the
    /// session table: the next turn of the same conversation contains it. It is the
    /// next-to-last link, not the last: a turn whose last block was partial has that block
    /// rewritten by the next turn (a Mooncake trace's chains do), and a client may rewrite
    /// the newest message too.
    pub(crate) fn tip(&self) -> u16 {
        let n = self.links.len();
        self.links
            .get(n.saturating_sub(2))
            .map_or(0, |l| tip_of(l.digest))
    }
}

impl PromptChain {
    /// The position of the link [`tip`](Self::tip) fingerprints (the next-to-last, or the
    /// only one): where this turn ended, as the next turn of the conversation contains it.
    pub(crate) fn tip_position(&self) -> Option<usize> {
        self.links
            .len()
            .checked_sub(1)
            .map(|last| last.saturating_sub(1))
    }

    /// The digest of the link at [`tip_position`](Self::tip_position).
    pub(crate) fn tip_digest(&self) -> Option<u64> {
        self.tip_position().map(|at| self.links[at].digest)
    }

    /// The position of the last link whose digest is `digest`.
    pub(crate) fn position_of(&self, digest: u64) -> Option<usize> {
        self.links.iter().rposition(|l| l.digest == digest)
    }
}

/// The 16-bit fingerprint of a link, as [`PromptChain::tip`] gives it.
pub(crate) fn tip_of(digest: u64) -> u16 {
    (digest as u16).max(1)
}

impl fmt::Debug for PromptChain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PromptChain")
            .field("links", &self.links.len())
            .field("tokens", &self.tokens())
            .finish()
    }
}

/// Bytes a token is estimated at: English prose and code run at three to five. Digits count a
/// token each (see [`digits`]).
pub(crate) const BYTES_PER_TOKEN: u64 = 4;

/// A chain read from bytes has at most one link per this many of its tokens, past its first
/// [`FREE_LINKS`]; the [cache model](crate::cache) tracks as many links a token of its budget.
pub(crate) const TOKENS_PER_LINK: u64 = 16;

/// Links a chain read from bytes may have before [`TOKENS_PER_LINK`] holds it back.
const FREE_LINKS: u64 = 64;

/// Seeds of the two ways chains are built, so a block chain never equals a byte chain.
const BLOCK_SEED: u64 = 0x6b6c_6f63_6b73;
const BYTE_SEED: u64 = 0x0062_7974_6573;

/// Builds a chain from a prompt's bytes: a link at every [`boundary`](Self::boundary) and
/// every `block` bytes inside a part.
pub(crate) struct ChainBuilder {
    hasher: Xxh3,
    links: Vec<Link>,
    /// Bytes fed so far, over the whole prompt.
    bytes: u64,
    /// Of them, bytes not counted at [`BYTES_PER_TOKEN`] (see [`feed_opaque`](Self::feed_opaque)).
    opaque_bytes: u64,
    /// Of the others, ASCII digits: a token each (see [`digits`]).
    digits: u64,
    /// The tokens counted for those bytes instead.
    opaque_tokens: u64,
    /// Bytes fed since the last boundary.
    in_part: u64,
    block: u64,
}

impl ChainBuilder {
    pub(crate) fn new(block: usize) -> Self {
        ChainBuilder {
            hasher: Xxh3::with_seed(BYTE_SEED),
            links: Vec::new(),
            bytes: 0,
            opaque_bytes: 0,
            digits: 0,
            opaque_tokens: 0,
            in_part: 0,
            block: block.max(1) as u64,
        }
    }

    /// A builder whose chain goes on from `base`: the prompt is `base`'s, then what is fed.
    pub(crate) fn continuing(base: &PromptChain, block: usize) -> Self {
        let last = base.links.last();
        let (bytes, tokens) = last.map_or((0, 0), |l| (l.bytes, l.tokens));
        // Counted on from the base's tokens where they are not its bytes' estimate.
        let (opaque_bytes, opaque_tokens) = if tokens == bytes.div_ceil(BYTES_PER_TOKEN) {
            (0, 0)
        } else {
            (bytes, tokens)
        };
        ChainBuilder {
            hasher: Xxh3::with_seed(last.map_or(BYTE_SEED, |l| l.digest ^ BYTE_SEED)),
            links: base.links.to_vec(),
            bytes,
            opaque_bytes,
            digits: 0,
            opaque_tokens,
            in_part: 0,
            block: block.max(1) as u64,
        }
    }

    fn full(&self) -> bool {
        self.links.len() >= PromptChain::MAX_LINKS
    }

    /// Adds a link where the prompt is now, unless the chain has as many links as its tokens
    /// allow: one per [`TOKENS_PER_LINK`] past the first [`FREE_LINKS`]. A prompt of many tiny
    /// messages (or an encoded image, cut into blocks of few tokens) then has a link only
    /// every few of them. Whether a link is made depends only on the prompt up to it, so a
    /// prompt that extends another has every link the other has; the digests go on covering
    /// everything before them. Without the allowance, a prompt of 8,192 empty messages (some
    /// 57,000 tokens) would fill a backend's model with links and evict every conversation
    /// it held, where the backend's cache keeps them.
    fn link(&mut self) {
        if self.full() {
            return;
        }
        let tokens = self.tokens();
        if self.links.len() as u64 >= FREE_LINKS + tokens / TOKENS_PER_LINK {
            return;
        }
        self.links.push(Link {
            digest: self.hasher.digest(),
            bytes: self.bytes,
            tokens,
        });
    }

    /// The estimated tokens of the bytes fed so far.
    fn tokens(&self) -> u64 {
        let text = self.bytes - self.opaque_bytes - self.digits;
        text.div_ceil(BYTES_PER_TOKEN) + self.digits + self.opaque_tokens
    }

    /// Feeds prompt bytes, adding a link each time the current part crosses a block.
    pub(crate) fn feed(&mut self, bytes: &[u8]) {
        self.feed_counted(bytes, None);
    }

    /// Feeds bytes that a model reads as `tokens` tokens whatever their length (an encoded
    /// image): digested and cut into blocks as any bytes, counted as `tokens`, spread over
    /// them (a link inside counts its share so far).
    pub(crate) fn feed_opaque(&mut self, bytes: &[u8], tokens: u64) {
        self.feed_counted(bytes, Some(tokens));
    }

    /// Feeds `bytes`, counted at [`BYTES_PER_TOKEN`], or as `opaque` tokens in all.
    fn feed_counted(&mut self, mut bytes: &[u8], opaque: Option<u64>) {
        let (total, mut fed) = (bytes.len() as u64, 0u64);
        while !bytes.is_empty() {
            let room = self.block - self.in_part % self.block;
            let take = (room as usize).min(bytes.len());
            self.hasher.update(&bytes[..take]);
            self.bytes += take as u64;
            if let Some(tokens) = opaque {
                // This stretch's share of the payload's tokens.
                let before = tokens * fed / total;
                fed += take as u64;
                self.opaque_bytes += take as u64;
                self.opaque_tokens += tokens * fed / total - before;
            } else {
                self.digits += digits(&bytes[..take]);
            }
            self.in_part += take as u64;
            bytes = &bytes[take..];
            if self.in_part.is_multiple_of(self.block) {
                self.link();
            }
        }
    }

    /// Marks where a part of a kind starts, in the digest only (it counts no bytes).
    pub(crate) fn mark(&mut self, kind: u8) {
        self.hasher.update(&[0x1d, kind]);
    }

    /// Ends a part of decoded text (a string member): marks its end with a byte that UTF-8 text
    /// never holds, then ends it as [`boundary`](Self::boundary) does. Decoded text may hold
    /// the bytes that mark parts and boundaries (`\u001e`, written in JSON), which raw JSON
    /// never does: without this, a string could end on the digest of a prompt whose next
    /// part it spells out.
    pub(crate) fn text_boundary(&mut self) {
        self.hasher.update(&[0xff]);
        self.boundary();
    }

    /// Ends a part (a message): adds a link unless the last block just added one, and marks
    /// the boundary in the digest so that the same bytes split otherwise differ.
    pub(crate) fn boundary(&mut self) {
        if self.in_part == 0 {
            return;
        }
        if !self.in_part.is_multiple_of(self.block) {
            self.link();
        }
        self.hasher.update(&[0x1e]);
        self.in_part = 0;
    }

    pub(crate) fn finish(mut self) -> PromptChain {
        self.boundary();
        PromptChain {
            links: self.links.into(),
        }
    }
}

/// The ASCII digits in `bytes`, but those of JSON's `\uXXXX` escapes (a character each, of
/// text that is not ASCII, as Python's `json.dumps` writes it by default). Tokenizers split
/// numbers into single digits (Qwen's, Gemma's, Mistral's) or runs of up to three (Llama 3's,
/// OpenAI's): a digit is estimated at a token, not a quarter of one, and the backend's learned
/// scale takes the rest.
fn digits(bytes: &[u8]) -> u64 {
    static ESCAPE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(br"\u"));
    if bytes.len() < SHORT {
        return short_digits(bytes);
    }
    let mut n = ascii_digits(bytes);
    // Escapes are looked for only where digits are dense (more than a byte in eight), as in
    // escaped text (half its bytes) or numbers: in code or prose (a digit in twenty bytes or
    // so) the odd escaped character counts a few tokens long, and the search would cost more
    // than the count. An escaped backslash before a `u` reads as an escape too.
    if n * 8 <= bytes.len() as u64 {
        return n;
    }
    // An escape's four bytes, past those of the one before: a `\u` among them (as in the
    // text `\u\u1234`, escaped) takes off no digit twice.
    let mut done = 0;
    for escape in ESCAPE.find_iter(bytes) {
        let end = (escape + 6).min(bytes.len());
        let hex = &bytes[(escape + 2).max(done)..end];
        done = end;
        n -= short_digits(hex);
    }
    n
}

/// Bytes under which [`digits`] counts one by one: most of what a body's parse feeds a chain
/// is short (names, roles, punctuation), where setting up a vector count or a search costs
/// more than it saves.
const SHORT: usize = 64;

/// [`digits`], one byte at a time.
fn short_digits(bytes: &[u8]) -> u64 {
    let mut n = 0;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' if bytes.get(i + 1) == Some(&b'u') => i += 6,
            b'\\' => i += 2,
            b => {
                n += u64::from(b.is_ascii_digit());
                i += 1;
            }
        }
    }
    n
}

/// The ASCII digits in `bytes`, summed in a byte over each stretch of 224 (at most 255, and
/// whole rounds of the 16- and 32-byte vector registers the compiler counts them in; a plain
/// count is several times slower).
fn ascii_digits(bytes: &[u8]) -> u64 {
    bytes
        .chunks(224)
        .map(|stretch| {
            let n = stretch
                .iter()
                .fold(0u8, |n, &b| n + u8::from(b.wrapping_sub(b'0') < 10));
            u64::from(n)
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(parts: &[&[u8]], block: usize) -> PromptChain {
        let mut b = ChainBuilder::new(block);
        for p in parts {
            b.feed(p);
            b.boundary();
        }
        b.finish()
    }

    #[test]
    fn a_digit_is_estimated_at_a_token_and_other_bytes_at_four_a_token() {
        assert_eq!(chain(&[b"abcdefgh"], 64).tokens(), 2);
        assert_eq!(chain(&[b"abcdefgh", b"12345678"], 64).tokens(), 2 + 8);
        // Counted over the whole prompt, whatever the parts and blocks.
        let c = chain(&[b"ab1", b"cd2efgh3"], 2);
        assert_eq!(c.tokens(), (8u64 - 3).div_ceil(4) + 3);
        assert_eq!((c.tokens_at(1), c.tokens_at(2)), (1, 2), "ab, then ab1");
        // A prompt going on from another (a stored response's) counts on from its tokens.
        let base = chain(&[b"12345678"], 64);
        let mut more = ChainBuilder::continuing(&base, 64);
        more.feed(b"abcd");
        assert_eq!(more.finish().tokens(), 8 + 1);
    }

    #[test]
    fn digits_are_counted_as_a_plain_count_would_at_every_length() {
        // Past stretches of 224 bytes too, each counted in a byte.
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        let bytes: Vec<u8> = (0..20_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let plain = |b: &[u8]| b.iter().filter(|c| c.is_ascii_digit()).count() as u64;
        for n in [0, 1, 15, 16, 17, 223, 224, 225, 448, 449, 4_081, 20_000] {
            assert_eq!(ascii_digits(&bytes[..n]), plain(&bytes[..n]), "{n} bytes");
        }
        let all = vec![b'7'; 20_000];
        assert_eq!(ascii_digits(&all), 20_000);
    }

    #[test]
    fn the_digits_of_a_json_unicode_escape_are_not_counted() {
        // "是 12", as `json.dumps` writes it.
        assert_eq!(digits(br"\u662f 12"), 2);
        assert_eq!(digits(br"a\nb\u00e9\ud83d\ude00 7"), 1);
        // Cut short at the end of the bytes fed.
        assert_eq!(digits(br"1\u66"), 1);
        assert_eq!(digits(br"1\"), 1);
        // Long and short alike.
        let long = br"\u662f 12 ".repeat(20);
        assert!(long.len() >= SHORT);
        assert_eq!(digits(&long), 40);
        assert_eq!(short_digits(&long), 40);
        assert_eq!(short_digits(br"\\u662f"), 3, "an escaped backslash");
    }

    #[test]
    fn escapes_are_looked_for_only_where_digits_are_more_than_one_byte_in_eight() {
        // Sixty-four bytes, eight of them digits: one byte in eight, the escape's counted.
        let mut bytes = br"\u1234 5678".to_vec();
        bytes.resize(64, b'x');
        assert_eq!(digits(&bytes), 8);
        // One digit more: the escape's four are taken off.
        bytes[63] = b'9';
        assert_eq!(digits(&bytes), 9 - 4);
    }

    #[test]
    fn no_digit_is_taken_off_twice_for_escapes_that_overlap() {
        // The text `\u\u5555`, escaped in JSON: each `\u` found (an escaped backslash's
        // second byte, then `u`) has the next one in its four bytes.
        let text = br"\\u\\u5555".repeat(8);
        assert!(text.len() >= SHORT);
        let n = digits(&text);
        assert!(n <= ascii_digits(&text), "{n} digits");
        let mut b = ChainBuilder::new(64);
        b.feed(&text);
        let c = b.finish();
        assert!(c.tokens() <= text.len() as u64, "{} tokens", c.tokens());
    }

    #[test]
    fn a_link_at_every_boundary_and_every_block() {
        let c = chain(&[b"system", &[b'x'; 10], b"hi"], 4);
        // "system": 6 bytes -> a block at 4, the boundary at 6; ten x: 4, 8, 10; "hi": 2.
        let bytes: Vec<u64> = c.links().iter().map(|l| l.bytes).collect();
        assert_eq!(bytes, [4, 6, 10, 14, 16, 18]);
        assert_eq!(c.tokens(), 5);
    }

    #[test]
    fn opaque_bytes_are_digested_and_cut_but_counted_as_their_tokens() {
        let mut b = ChainBuilder::new(4);
        b.feed(b"sys");
        b.boundary();
        b.feed_opaque(&[b'A'; 10], 100);
        b.boundary();
        b.feed(b"question");
        b.boundary();
        let c = b.finish();
        let bytes: Vec<u64> = c.links().iter().map(|l| l.bytes).collect();
        assert_eq!(bytes, [3, 7, 11, 13, 17, 21]);
        let tokens: Vec<u64> = c.links().iter().map(|l| l.tokens).collect();
        // "sys" is 1 token; the payload 100 however long, spread over its blocks (4 and 8 of
        // its 10 bytes: 40 and 80); "question" 2 more.
        assert_eq!(tokens, [1, 41, 81, 101, 102, 103]);
        // A chain continued from it counts on from its tokens.
        let mut more = ChainBuilder::continuing(&c, 4);
        more.feed(b"next");
        more.boundary();
        assert_eq!(more.finish().tokens(), 104);
        // From a chain without payloads, as if built in one go.
        let plain = chain(&[b"sys", b"x"], 4);
        let mut more = ChainBuilder::continuing(&plain, 4);
        more.feed(b"yyyyy");
        more.boundary();
        assert_eq!(more.finish().tokens(), (4u64 + 5).div_ceil(BYTES_PER_TOKEN));
    }

    #[test]
    fn equal_prefixes_share_links_and_nothing_after_a_difference() {
        let a = chain(&[b"sys", b"user one", b"answer"], 1024);
        let b = chain(&[b"sys", b"user one", b"answer", b"tool"], 1024);
        let c = chain(&[b"sys", b"user two", b"answer"], 1024);
        assert_eq!(b.common_prefix(&a), 3);
        assert_eq!(c.common_prefix(&a), 1);
        // Moving a boundary changes the digest even when the bytes are the same.
        let d = chain(&[b"sysuser one"], 1024);
        assert_eq!(d.common_prefix(&a), 0);
    }

    #[test]
    fn a_block_link_covers_every_block_before_it() {
        let a = PromptChain::from_blocks([(1, 10), (2, 10), (3, 10)]);
        let b = PromptChain::from_blocks([(9, 10), (2, 10), (3, 10)]);
        // The same blocks after another first one: no link is shared.
        for (x, y) in a.links().iter().zip(b.links()) {
            assert_ne!(x.digest, y.digest);
        }
    }

    #[test]
    fn only_leading_links_count_as_a_common_prefix() {
        // Hand-made digests: a chain's digests cover their prefix, so equal links after a
        // difference take a collision; they are still not part of the shared prefix.
        let made = |digests: &[u64]| PromptChain {
            links: digests
                .iter()
                .enumerate()
                .map(|(i, &digest)| Link {
                    digest,
                    bytes: 4 * (i as u64 + 1),
                    tokens: i as u64 + 1,
                })
                .collect(),
        };
        assert_eq!(made(&[1, 2, 3]).common_prefix(&made(&[1, 9, 3])), 1);
        assert_eq!(made(&[1, 2, 3]).common_prefix(&made(&[8, 2, 3])), 0);
    }

    #[test]
    fn a_continued_chain_covers_the_chain_it_continues() {
        let go_on = |base: &PromptChain| {
            let mut b = ChainBuilder::continuing(base, 64);
            b.feed(b"the same new input");
            b.boundary();
            b.finish()
        };
        let (one, two) = (chain(&[b"first"], 64), chain(&[b"second"], 64));
        let (a, b) = (go_on(&one), go_on(&two));
        assert_eq!((a.len(), b.len()), (2, 2));
        assert_eq!(a.common_prefix(&one), 1);
        // The same input after another response is another prompt.
        assert_ne!(a.links()[1].digest, b.links()[1].digest);
    }

    #[test]
    fn a_chain_continued_from_one_of_text_counts_on_as_if_built_in_one_go() {
        // Five bytes, two tokens: not a whole number of tokens' bytes.
        let base = chain(&[b"abcde"], 64);
        assert_eq!(base.tokens(), 2);
        let mut more = ChainBuilder::continuing(&base, 64);
        more.feed(b"fgh");
        more.boundary();
        assert_eq!(more.finish().tokens(), chain(&[b"abcdefgh"], 64).tokens());
    }

    #[test]
    fn a_tip_fingerprint_is_never_zero() {
        // 0 means "no chain": a digest whose low 16 bits are 0 takes 1.
        assert_eq!(tip_of(0xabcd_0000), 1);
        assert_eq!(tip_of(0xabcd_0001), 1);
        assert_eq!(tip_of(0xabcd_1234), 0x1234);
    }

    #[test]
    fn the_position_of_a_digest_is_that_of_its_last_link() {
        // Hand-made digests: a chain's digests cover their prefix, so a digest given twice
        // takes a collision; the later link is the one a turn ending there went on from.
        let c = PromptChain {
            links: [5, 6, 5, 7]
                .iter()
                .enumerate()
                .map(|(i, &digest)| Link {
                    digest,
                    bytes: 4 * (i as u64 + 1),
                    tokens: i as u64 + 1,
                })
                .collect(),
        };
        assert_eq!(c.position_of(5), Some(2));
        assert_eq!(c.position_of(7), Some(3));
        assert_eq!(c.position_of(8), None);
    }

    #[test]
    fn a_block_boundary_at_the_end_of_a_part_is_one_link() {
        let c = chain(&[b"abcd", b"efgh"], 4);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn chains_are_bounded() {
        let c = PromptChain::from_blocks((0..20_000).map(|i| (i, 1)));
        assert_eq!(c.len(), PromptChain::MAX_LINKS);
        // 150,000 tokens in blocks of 16: as many links as the tokens allow, up to the bound.
        let mut b = ChainBuilder::new(64);
        b.feed(&vec![0u8; 600_000]);
        assert_eq!(b.finish().len(), PromptChain::MAX_LINKS);
    }

    #[test]
    fn a_chain_of_tiny_parts_has_a_link_per_sixteen_tokens_past_its_first_sixty_four() {
        let tiny = |n: usize| {
            let mut b = ChainBuilder::new(2048);
            for _ in 0..n {
                // Eight bytes, two tokens, a part.
                b.feed(b"{\"a\":\"\"}");
                b.boundary();
            }
            b.finish()
        };
        let short = tiny(64);
        assert_eq!(short.len(), 64, "a link at every part up to the first 64");
        let long = tiny(8_192);
        assert_eq!(long.tokens(), 16_384);
        assert_eq!(long.len() as u64, FREE_LINKS + 16_384 / TOKENS_PER_LINK);
        // A link every eight parts: a last part may be past the last link.
        assert_eq!(tiny(8_193).tokens(), 16_384);
        // Made from the prompt before it only: a longer prompt has every link of a shorter.
        let longer = tiny(9_000);
        assert_eq!(longer.common_prefix(&long), long.len());
        assert!(longer.len() > long.len());
        // Parts of sixteen tokens or more get a link each, as before.
        let mut b = ChainBuilder::new(2048);
        for _ in 0..1_000 {
            b.feed(&[b'x'; 64]);
            b.boundary();
        }
        assert_eq!(b.finish().len(), 1_000);
    }

    #[test]
    fn the_tip_is_found_where_the_last_turn_ended() {
        let first = PromptChain::from_blocks([(1, 10), (2, 10), (3, 5)]);
        // The next turn rewrites the partial last block and goes on.
        let next = PromptChain::from_blocks([(1, 10), (2, 10), (4, 10), (5, 10)]);
        assert_ne!(first.tip(), 0);
        assert_eq!(next.tip_positions(first.tip()).next(), Some(1));
        // A compaction keeps only the first block.
        let compacted = PromptChain::from_blocks([(1, 10), (9, 10)]);
        assert_eq!(compacted.tip_positions(first.tip()).next(), None);
        assert_ne!(PromptChain::from_blocks([(1, 10)]).tip(), 0);
        assert_eq!(PromptChain::default().tip(), 0);
    }
}
