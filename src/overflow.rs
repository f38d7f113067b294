//! What a request does when no candidate has a free slot.

use std::time::Duration;

/// What a request does when every candidate is full.
///
/// ```
/// use std::time::Duration;
/// use tower_affinity::Overflow;
///
/// let o = Overflow::wait(Duration::from_secs(30), 256);
/// assert_eq!(Overflow::default(), Overflow::wait(Duration::from_secs(60), 1024));
/// if let Overflow::Wait { max_wait, .. } = o {
///     assert_eq!(max_wait, Duration::from_secs(30));
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Overflow {
    /// Wait inside the response future, up to `max_wait`, and be placed again, in the same
    /// preference order, as soon as any slot frees: a home that frees first gets its session
    /// back. At most `max_queued` requests wait at once; beyond that, and after `max_wait`, the
    /// request fails with [`Error::Saturated`](crate::Error::Saturated). A `max_queued` of 0,
    /// or a `max_wait` of zero, lets no request wait: it fails as under [`Overflow::Reject`]
    /// (and needs no time driver). A `max_wait` too long for the clock waits as long as it
    /// takes.
    ///
    /// The queue is the service's, shared by every request it places: where requests must
    /// not wait behind each other's (tenants with backends of their own), give each its own
    /// service over its own fleet, as the proxy example does for each model.
    ///
    /// Waiting needs tokio's time driver. Built with [`Overflow::wait`].
    #[non_exhaustive]
    Wait {
        /// The longest a request waits for a slot.
        max_wait: Duration,
        /// The most requests waiting at once.
        max_queued: usize,
    },
    /// Send the request to the first candidate anyway, beyond its slots: the backend queues
    /// it. Fails only when the policy offers no candidate at all: with
    /// [`Error::NoBackends`](crate::Error::NoBackends) when none is up (or the policy passed
    /// over every one that is), else [`Error::Saturated`](crate::Error::Saturated).
    Overcommit,
    /// Fail at once with [`Error::Saturated`](crate::Error::Saturated).
    Reject,
}

impl Overflow {
    /// [`Overflow::Wait`]: wait up to `max_wait`, at most `max_queued` requests at once.
    pub const fn wait(max_wait: Duration, max_queued: usize) -> Self {
        Overflow::Wait {
            max_wait,
            max_queued,
        }
    }

    /// The `Retry-After` hint given when a request is refused for lack of slots.
    pub(crate) const RETRY_AFTER: Duration = Duration::from_secs(1);
}

impl Default for Overflow {
    /// Wait up to 60 s, at most 1024 requests at once.
    fn default() -> Self {
        Overflow::wait(Duration::from_secs(60), 1024)
    }
}
