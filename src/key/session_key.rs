use std::fmt;

use sha2::{Digest, Sha256};

/// The identity of a session: the first 128 bits of the SHA-256 of its raw key.
///
/// 128 bits make an accidental collision between two live sessions practically impossible
/// (about one in 10^20 at a billion sessions) while keeping the session table small. The raw
/// value is not kept anywhere.
///
/// ```
/// use tower_affinity::key::SessionKey;
///
/// let a = SessionKey::from_bytes(b"agent-7");
/// assert_eq!(a, SessionKey::from_bytes(b"agent-7"));
/// assert_ne!(a, SessionKey::from_bytes(b"agent-8"));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionKey(u128);

/// The longest raw key that fits one 64-byte SHA-256 block with its padding: the `0x80` byte
/// and the 8-byte length.
const ONE_BLOCK: usize = 55;

/// SHA-256's initial hash value (FIPS 180-4, 5.3.3).
const SHA256_INIT: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

impl SessionKey {
    /// Digests a raw key.
    pub fn from_bytes(raw: &[u8]) -> Self {
        if raw.len() <= ONE_BLOCK {
            return Self::from_short(raw);
        }
        let digest = Sha256::digest(raw);
        let mut first = [0u8; 16];
        first.copy_from_slice(&digest[..16]);
        SessionKey(u128::from_be_bytes(first))
    }

    /// The same digest for a raw key that fits one SHA-256 block with its padding (session ids
    /// do): the block is built in place and compressed once, without the streaming hasher's
    /// buffering.
    fn from_short(raw: &[u8]) -> Self {
        let mut block = [0u8; 64];
        block[..raw.len()].copy_from_slice(raw);
        block[raw.len()] = 0x80;
        block[56..].copy_from_slice(&(raw.len() as u64 * 8).to_be_bytes());
        let mut state = SHA256_INIT;
        sha2::compress256(&mut state, &[block.into()]);
        let word = |i: usize| u128::from(state[i]);
        SessionKey(word(0) << 96 | word(1) << 64 | word(2) << 32 | word(3))
    }

    /// Rebuilds a key from a digest produced by [`SessionKey::to_u128`], for example one kept
    /// in a shared store.
    pub const fn from_u128(digest: u128) -> Self {
        SessionKey(digest)
    }

    /// The digest as a number.
    pub const fn to_u128(self) -> u128 {
        self.0
    }

    /// 64 well-mixed bits of the digest: used for table sharding and rendezvous scores.
    pub(crate) const fn lo64(self) -> u64 {
        self.0 as u64
    }

    /// The other 64 bits.
    pub(crate) const fn hi64(self) -> u64 {
        (self.0 >> 64) as u64
    }
}

impl fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionKey({:016x})", self.hi64())
    }
}

impl fmt::Display for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_is_a_prefix_of_the_sha256_of_the_raw_value() {
        // SHA-256("abc") = ba7816bf 8f01cfea 414140de 5dae2223 ...
        let k = SessionKey::from_bytes(b"abc");
        assert_eq!(format!("{k}"), "ba7816bf8f01cfea414140de5dae2223");
    }

    #[test]
    fn one_block_keys_digest_like_the_streaming_hasher() {
        // Every length up to the one-block limit and past it, against sha2's own digest.
        for len in 0..=130usize {
            let raw: Vec<u8> = (0..len).map(|i| (i * 37 + len) as u8).collect();
            let digest = Sha256::digest(&raw);
            let mut first = [0u8; 16];
            first.copy_from_slice(&digest[..16]);
            assert_eq!(
                SessionKey::from_bytes(&raw).to_u128(),
                u128::from_be_bytes(first),
                "length {len}"
            );
        }
    }

    #[test]
    fn key_size_does_not_depend_on_the_raw_value() {
        let long = vec![b'x'; 64 * 1024];
        let _ = SessionKey::from_bytes(&long);
        assert_eq!(std::mem::size_of::<SessionKey>(), 16);
    }
}
