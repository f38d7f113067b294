//! The API a request speaks, told by its path, and what that says of its answer's stream.
//!
//! A chat, Anthropic or legacy completions stream sends nothing before its first token: its
//! first byte follows the backend's read of the prompt, and times it. A Responses stream
//! opens with lifecycle events (`response.created`, `response.in_progress`) that vLLM and
//! SGLang send as soon as the request is taken, before the read: its first byte does not.

/// The API a request speaks, by the end of its path (a prefix such as `/v1`, or the path a
/// router mounts the service at, does not matter).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Api {
    /// OpenAI chat completions, `…/chat/completions`.
    Chat,
    /// Legacy completions, `…/completions`.
    Completions,
    /// Anthropic Messages, `…/messages`.
    Messages,
    /// OpenAI Responses, `…/responses`.
    Responses,
    /// Any other path (SGLang's `/generate`, a path of the user's own).
    #[default]
    Other,
}

impl Api {
    /// The API of a request to `path`.
    pub(crate) fn of(path: &str) -> Api {
        let path = path.strip_suffix('/').unwrap_or(path);
        if path.ends_with("/completions") {
            if path.ends_with("/chat/completions") {
                Api::Chat
            } else {
                Api::Completions
            }
        } else if path.ends_with("/messages") {
            Api::Messages
        } else if path.ends_with("/responses") {
            Api::Responses
        } else {
            Api::Other
        }
    }

    /// Whether a stream of this API opens before its prompt is read: a Responses stream
    /// does.
    pub(crate) fn opens_before_read(self) -> bool {
        self == Api::Responses
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_api_is_told_by_the_end_of_the_path() {
        for (path, api) in [
            ("/v1/chat/completions", Api::Chat),
            ("/openai/deployments/d/chat/completions", Api::Chat),
            ("/v1/completions", Api::Completions),
            ("/v1/messages", Api::Messages),
            ("/v1/messages/", Api::Messages),
            ("/v1/responses", Api::Responses),
            ("/llm/v1/responses", Api::Responses),
            ("/v1/responses/resp_1", Api::Other),
            ("/v1/messages/count_tokens", Api::Other),
            ("/generate", Api::Other),
            ("/", Api::Other),
            ("", Api::Other),
        ] {
            assert_eq!(Api::of(path), api, "{path}");
        }
        assert!(Api::Responses.opens_before_read());
        for api in [Api::Chat, Api::Completions, Api::Messages, Api::Other] {
            assert!(!api.opens_before_read(), "{api:?}");
        }
    }
}
