use super::{KeyExtractor, SessionKey};

/// Reads a [`SessionKey`] that an earlier layer attached to the request's extensions.
///
/// This is how a layer that reads the body (which extractors must not consume) hands the key
/// over.
///
/// ```
/// use tower_affinity::key::{ExtensionKey, KeyExtractor, SessionKey};
///
/// let mut req = http::Request::get("/").body(()).unwrap();
/// assert_eq!(ExtensionKey.extract(&req), None);
/// req.extensions_mut().insert(SessionKey::from_bytes(b"s"));
/// assert_eq!(ExtensionKey.extract(&req), Some(SessionKey::from_bytes(b"s")));
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct ExtensionKey;

impl<B> KeyExtractor<http::Request<B>> for ExtensionKey {
    fn extract(&self, req: &http::Request<B>) -> Option<SessionKey> {
        req.extensions().get::<SessionKey>().copied()
    }
}
