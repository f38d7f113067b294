//! The changes the resolving task announced and the stream has not yielded yet, merged as
//! they come: at most one a backend.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use parking_lot::Mutex;
use tower::discover::Change;

use crate::{Backend, BackendId};

/// What the stream owes its consumer, from the resolving task.
///
/// The consumer (a balancer) takes changes only as requests come, so a quiet spell can hold
/// any number of answers. Kept as a queue, an address that came and went meanwhile would be
/// held, service and all, until then, and the first requests after the spell would apply
/// the answers one by one. Merged, what is owed is what differs from what the consumer has:
/// bounded by the addresses seen, and never a state that is no longer true.
pub(crate) struct Changes<S> {
    state: Mutex<State<S>>,
}

struct State<S> {
    /// Backends to insert, each with whether the consumer has it already: new to it, or
    /// (after a removal not taken yet) an update of one it has.
    inserts: BTreeMap<BackendId, (bool, Backend<S>)>,
    /// Backends the consumer has, to remove.
    removes: BTreeSet<BackendId>,
    /// The resolving task is gone: once what is owed is taken, the stream ends.
    closed: bool,
    waker: Option<Waker>,
}

impl<S> Changes<S> {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Changes {
            state: Mutex::new(State {
                inserts: BTreeMap::new(),
                removes: BTreeSet::new(),
                closed: false,
                waker: None,
            }),
        })
    }

    /// Announces a change, merged with what is owed for the same backend. The task announces
    /// an insert only of a backend the consumer will not have once it has taken all owed, and
    /// a removal only of one it will.
    pub(crate) fn send(&self, change: Change<BackendId, Backend<S>>) {
        let waker = {
            let mut state = self.state.lock();
            match change {
                Change::Insert(id, backend) => {
                    // A removal not taken yet and an insert: the consumer keeps the backend,
                    // updated.
                    let had = state.removes.remove(&id)
                        || state.inserts.get(&id).is_some_and(|(had, _)| *had);
                    state.inserts.insert(id, (had, backend));
                }
                Change::Remove(id) => {
                    // An insert not taken yet and a removal: nothing owed if the consumer
                    // never had the backend, its removal if the insert was an update.
                    let had = match state.inserts.remove(&id) {
                        Some((had, _)) => had,
                        None => true,
                    };
                    if had {
                        state.removes.insert(id);
                    }
                }
            }
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// The resolving task is gone.
    pub(crate) fn close(&self) {
        let waker = {
            let mut state = self.state.lock();
            state.closed = true;
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// The next change owed, the inserts first (a consumer that applies some of them never
    /// finds its fleet emptied by a removal that the answer paired with an insert); `None`
    /// once the task is gone and nothing is owed.
    pub(crate) fn poll_next(
        &self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Change<BackendId, Backend<S>>>> {
        let mut state = self.state.lock();
        if let Some((id, (_, backend))) = state.inserts.pop_first() {
            return Poll::Ready(Some(Change::Insert(id, backend)));
        }
        if let Some(id) = state.removes.pop_first() {
            return Poll::Ready(Some(Change::Remove(id)));
        }
        if state.closed {
            return Poll::Ready(None);
        }
        match &mut state.waker {
            Some(waker) if waker.will_wake(cx.waker()) => {}
            waker => *waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    use super::*;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn insert(id: &str) -> Change<BackendId, Backend<()>> {
        Change::Insert(id.into(), Backend::new("node", ()))
    }

    fn remove(id: &str) -> Change<BackendId, Backend<()>> {
        Change::Remove(id.into())
    }

    /// Everything owed now, as `+id` and `-id`, in the order yielded.
    fn owed(changes: &Changes<()>) -> Vec<String> {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count);
        let mut cx = Context::from_waker(&waker);
        let mut out = Vec::new();
        for _ in 0..100 {
            match changes.poll_next(&mut cx) {
                Poll::Ready(Some(Change::Insert(id, _))) => out.push(format!("+{id}")),
                Poll::Ready(Some(Change::Remove(id))) => out.push(format!("-{id}")),
                Poll::Ready(None) => out.push("end".to_string()),
                Poll::Pending => break,
            }
            if out.last().is_some_and(|last| last == "end") {
                break;
            }
        }
        out
    }

    #[test]
    fn what_is_owed_is_the_difference_from_what_the_consumer_has() {
        let changes = Changes::new();
        // New to the consumer, and gone before it looked: nothing.
        changes.send(insert("a"));
        changes.send(remove("a"));
        assert!(owed(&changes).is_empty());

        changes.send(insert("a"));
        changes.send(insert("b"));
        assert_eq!(owed(&changes), ["+a", "+b"]);

        // Gone and back: an update of the backend the consumer has.
        changes.send(remove("a"));
        changes.send(insert("a"));
        assert_eq!(owed(&changes), ["+a"]);

        // Gone, back, gone: gone.
        changes.send(remove("a"));
        changes.send(insert("a"));
        changes.send(remove("a"));
        assert_eq!(owed(&changes), ["-a"]);

        // The inserts first, whatever the order they came in.
        changes.send(remove("b"));
        changes.send(insert("c"));
        assert_eq!(owed(&changes), ["+c", "-b"]);
    }

    #[test]
    fn a_change_wakes_the_stream_and_a_close_ends_it_once_drained() {
        let changes = Changes::new();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(changes.poll_next(&mut cx).is_pending());
        changes.send(insert("a"));
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        changes.close();
        assert_eq!(owed(&changes), ["+a", "end"]);
    }
}
