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

impl SessionKey {
    /// Digests a raw key.
    pub fn from_bytes(raw: &[u8]) -> Self {
        let digest = Sha256::digest(raw);
        let mut first = [0u8; 16];
        first.copy_from_slice(&digest[..16]);
        SessionKey(u128::from_be_bytes(first))
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
    fn key_size_does_not_depend_on_the_raw_value() {
        let long = vec![b'x'; 64 * 1024];
        let _ = SessionKey::from_bytes(&long);
        assert_eq!(std::mem::size_of::<SessionKey>(), 16);
    }
}
