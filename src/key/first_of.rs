use super::{KeyExtractor, SessionKey};

/// The key of the first extractor that finds one.
///
/// Chain more than two by nesting: `FirstOf::new(a, FirstOf::new(b, c))`.
///
/// ```
/// use tower_affinity::key::{ExtensionKey, FirstOf, HeaderKey, KeyExtractor, SessionKey};
///
/// let key = FirstOf::new(HeaderKey::default(), ExtensionKey);
/// let mut req = http::Request::get("/").body(()).unwrap();
/// req.extensions_mut().insert(SessionKey::from_bytes(b"from-body"));
/// assert_eq!(key.extract(&req), Some(SessionKey::from_bytes(b"from-body")));
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct FirstOf<A, B> {
    first: A,
    second: B,
}

impl<A, B> FirstOf<A, B> {
    /// Tries `first`, then `second`.
    pub const fn new(first: A, second: B) -> Self {
        FirstOf { first, second }
    }
}

impl<Req, A, B> KeyExtractor<Req> for FirstOf<A, B>
where
    A: KeyExtractor<Req>,
    B: KeyExtractor<Req>,
{
    fn extract(&self, req: &Req) -> Option<SessionKey> {
        self.first.extract(req).or_else(|| self.second.extract(req))
    }
}
