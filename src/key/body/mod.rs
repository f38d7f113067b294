//! [`BodyKeyLayer`]: buffers a request body (bounded), reads the session key and the prompt
//! facts from it, and forwards the body unchanged (or asking a stream for its usage on the
//! client's behalf, when told to).
//!
//! The body is parsed once (a second time only if it is not JSON, or if an array of the
//! prompt holds an item that is neither an object nor an array); what it keeps and how the
//! prompt becomes a chain is in [`BodyKeyLayer`]'s documentation.

// Layout, as tower-http lays out a middleware:
//   layer.rs    BodyKeyLayer, the builder
//   service.rs  BodyKey, the service
//   future.rs   BodyKeyFuture: reading the body, then calling the inner service
//   body.rs     BodyKeyResponseBody
//   inspect.rs  the one pass over the JSON, and the settings that steer it
//   leading.rs  the leading messages, kept as text and digested when asked
//   canonical.rs  the leading messages written out as `Value`s would be, without them
//   prompt.rs   the prompt's members cut into a chain
//   responses.rs  the Responses API answers seen (their chains, the backends that gave them), for `previous_response_id`
//   facts.rs    PromptFacts
//   ask.rs      asking a stream for its usage, and taking the usage chunk out of the answer

mod ask;
// `body` as tower-http names a middleware's response body, though the folder is `body` too.
#[allow(clippy::module_inception)]
mod body;
mod canonical;
mod facts;
mod future;
mod inspect;
mod layer;
mod leading;
mod prompt;
mod responses;
mod service;

pub use body::BodyKeyResponseBody;
pub use facts::PromptFacts;
pub use future::BodyKeyFuture;
pub use layer::BodyKeyLayer;
pub use service::BodyKey;

#[cfg(test)]
mod pinned;
#[cfg(test)]
mod tests;
