//! Session keys and the extractors that find them on a request.
//!
//! A [`SessionKey`] is a fixed-size digest of whatever identifies an agent run: the raw value
//! is hashed with SHA-256 the moment it is read and never kept, so a 64 KiB header costs the
//! same memory as a 4-byte one.
//!
//! A [`KeyExtractor`] reads a key from a request without consuming it. The built-ins:
//!
//! - [`HeaderKey`]: `X-Session-Affinity`, then `X-Session-Id`, then the headers coding agents
//!   send (Claude Code, Codex CLI, Goose; see [`HeaderKey::DEFAULT_NAMES`]); configurable;
//! - [`ExtensionKey`]: a [`SessionKey`] that an earlier layer put in the request's extensions;
//! - [`FirstOf`]: the first of two extractors that finds a key;
//! - [`NoKey`]: never a key, so that every request is placed by its prompt chain, else by
//!   load;
//! - any `Fn(&Req) -> Option<SessionKey>` closure.
//!
//! [`BodyKeyLayer`] reads keys from JSON bodies (`prompt_cache_key`, `user`, ...) in front of
//! the service and hands them over as extensions, with the body's [`PromptFacts`] and its
//! prompt chain, which the cache model places by.
//!
//! Keys are never derived from the prompt: agents of one swarm share their system prompt and
//! first message, so a prompt hash would make them all one session. A request without a key
//! is placed by its prompt chain where it has one (the backend holding its own conversation's
//! prefix), else by load.

mod body;
mod extension;
mod first_of;
mod header;
mod session_key;

pub use body::{BodyKey, BodyKeyFuture, BodyKeyLayer, BodyKeyResponseBody, PromptFacts};
pub use extension::ExtensionKey;
pub use first_of::FirstOf;
pub use header::{HeaderKey, InvalidHeaderKey};
pub use session_key::SessionKey;

/// Finds the session key of a request.
///
/// Extraction is synchronous and must not consume the request. Return `None` when the request
/// carries no key; it is then placed by its prompt chain where it has one (the backend
/// holding its own conversation's prefix), else by load.
///
/// Closures implement the trait:
///
/// ```
/// use tower_affinity::key::{KeyExtractor, SessionKey};
///
/// let by_user = |req: &http::Request<()>| {
///     req.uri().query().map(|q| SessionKey::from_bytes(q.as_bytes()))
/// };
/// let req = http::Request::get("/v1/chat/completions?user=7").body(()).unwrap();
/// assert_eq!(by_user.extract(&req), Some(SessionKey::from_bytes(b"user=7")));
/// ```
///
/// The extractor sees the request as the balancer gets it: behind [`BodyKeyLayer`], whose
/// body is `http_body_util::Full<Bytes>`, not your server's body type, so a closure names
/// `http::Request<Full<Bytes>>`. A key scoped to a tenant digests both parts:
///
/// ```
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use tower_affinity::key::{HeaderKey, KeyExtractor, SessionKey};
///
/// let agents = HeaderKey::default();
/// let by_tenant = move |req: &http::Request<Full<Bytes>>| {
///     let tenant = req.headers().get("x-tenant")?.as_bytes();
///     let session = agents.extract(req)?;
///     Some(SessionKey::from_bytes(&[tenant, &session.to_u128().to_le_bytes()].concat()))
/// };
/// let req = http::Request::post("/v1/chat/completions")
///     .header("x-tenant", "acme")
///     .header("x-claude-code-session-id", "c1")
///     .body(Full::new(Bytes::new()))
///     .unwrap();
/// assert!(by_tenant.extract(&req).is_some());
/// ```
///
/// A type of your own implements the trait for the requests it reads. Implemented for
/// `http::Request<B>` of any body `B`, it serves behind [`BodyKeyLayer`] and without it alike;
/// one implemented for your server's body type only (hyper's `Incoming`) does not compile
/// behind the layer. The balancer clones its extractor, so derive `Clone`. Here the bearer
/// token of `Authorization` names the session, after the agents' headers:
///
/// ```
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use tower::Layer;
/// use tower_affinity::discover::StaticFleet;
/// use tower_affinity::key::{ExtensionKey, FirstOf, HeaderKey, KeyExtractor, SessionKey};
/// use tower_affinity::{Backend, SessionAffinityLayer};
///
/// /// The token of `Authorization: Bearer TOKEN`.
/// #[derive(Clone, Copy, Debug)]
/// struct BearerKey;
///
/// impl<B> KeyExtractor<http::Request<B>> for BearerKey {
///     fn extract(&self, req: &http::Request<B>) -> Option<SessionKey> {
///         let value = req.headers().get(http::header::AUTHORIZATION)?.as_bytes();
///         let token = value.strip_prefix(b"Bearer ")?.trim_ascii();
///         (!token.is_empty()).then(|| SessionKey::from_bytes(token))
///     }
/// }
///
/// let req = http::Request::post("/v1/chat/completions")
///     .header("authorization", "Bearer sk-agent-7")
///     .body(Full::new(Bytes::new()))
///     .unwrap();
/// assert_eq!(BearerKey.extract(&req), Some(SessionKey::from_bytes(b"sk-agent-7")));
///
/// // The agents' headers first, then the token, then a key a `BodyKeyLayer` read.
/// let key = FirstOf::new(HeaderKey::default(), FirstOf::new(BearerKey, ExtensionKey));
/// # let backend = tower::service_fn(|_: http::Request<Full<Bytes>>| async {
/// #     Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
/// # });
/// let svc = SessionAffinityLayer::new()
///     .key(key)
///     .layer(StaticFleet::new([("gpu-0", Backend::new("host-a", backend))]));
/// # let _ = svc;
/// ```
pub trait KeyExtractor<Req> {
    /// The session key of `req`, if it has one.
    fn extract(&self, req: &Req) -> Option<SessionKey>;
}

impl<F, Req> KeyExtractor<Req> for F
where
    F: Fn(&Req) -> Option<SessionKey>,
{
    fn extract(&self, req: &Req) -> Option<SessionKey> {
        self(req)
    }
}

/// An extractor that never finds a key: every request is placed as keyless, by its prompt
/// chain where it has one, else by load.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoKey;

impl<Req> KeyExtractor<Req> for NoKey {
    fn extract(&self, _: &Req) -> Option<SessionKey> {
        None
    }
}
