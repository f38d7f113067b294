//! [`BodyKeyLayer`]: buffers a request body (bounded), reads the session key and the prompt
//! facts from it, and forwards the body unchanged.
//!
//! The body is parsed once. The pass keeps the key fields, the leading messages and the raw
//! text of the prompt's members, and checks and skips the rest without building it. The
//! prompt members are then cut into a [`PromptChain`](crate::PromptChain): a digest at every
//! message boundary and every [`BLOCK_BYTES`](PromptFacts::BLOCK_BYTES) inside a long
//! message, over each message's JSON with the whitespace between tokens and Anthropic's
//! `cache_control` markers taken out (clients move those from turn to turn).
//!
//! | request | the prompt, in order |
//! |---|---|
//! | OpenAI chat, `/v1/chat/completions` | `tools`, then each of `messages` |
//! | Anthropic Messages, `/v1/messages` | `tools`, `system`, then each of `messages` |
//! | OpenAI Responses, `/v1/responses` | `tools`, `instructions`, then `input` (each item) |
//! | legacy completions, `/v1/completions` | `prompt`, as text (each string of an array) |

// Layout, as tower-http lays out a middleware:
//   layer.rs    BodyKeyLayer, the builder
//   service.rs  BodyKey, the service
//   future.rs   BodyKeyFuture: reading the body, then calling the inner service
//   body.rs     BodyKeyResponseBody
//   inspect.rs  the one pass over the JSON, and the settings that steer it
//   prompt.rs   the prompt's members cut into a chain
//   facts.rs    PromptFacts

// `body` as tower-http names a middleware's response body, though the folder is `body` too.
#[allow(clippy::module_inception)]
mod body;
mod facts;
mod future;
mod inspect;
mod layer;
mod prompt;
mod service;

pub use body::BodyKeyResponseBody;
pub use facts::PromptFacts;
pub use future::BodyKeyFuture;
pub use layer::BodyKeyLayer;
pub use service::BodyKey;

#[cfg(test)]
mod tests;
