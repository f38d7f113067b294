//! A bound for a test that can hang inside a single poll (a slot handed from waiter to waiter
//! forever in the balancer's own loop): no timer of tokio's fires then, paused or not, and no
//! count kept by the test is reached, so the bound is a watch from another thread.

use std::io::Write;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

/// Real time a test watched by [`within_a_minute`] may take: far more than any of them needs,
/// even on a loaded machine. A bound for a hang, not a timing.
const LIMIT: Duration = Duration::from_secs(60);

/// Runs `test` on a thread of its own, passing on its panic; if it has not returned within a
/// minute, says so, with `what` it was doing, and ends the test binary, since the hung thread
/// cannot be stopped (and a panic would leave it spinning, or under proptest start a shrink
/// whose every case could hang as long).
pub(crate) fn within_a_minute(what: &str, test: impl FnOnce() + Send + 'static) {
    let (done, finished) = mpsc::channel();
    let name = std::thread::current().name().map(str::to_string);
    let mut thread = std::thread::Builder::new();
    if let Some(name) = name.clone() {
        thread = thread.name(name);
    }
    let thread = thread
        .spawn(move || {
            test();
            let _ = done.send(());
        })
        .unwrap();
    match finished.recv_timeout(LIMIT) {
        // Returned, or panicked (the sender dropped as it unwound).
        Ok(()) | Err(RecvTimeoutError::Disconnected) => {
            if let Err(panic) = thread.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(RecvTimeoutError::Timeout) => {
            // Past libtest's capture of the test's output, which exiting would lose.
            let _ = writeln!(
                std::io::stderr(),
                "test {} still running after {LIMIT:?}: it hangs (a poll that never returns?) \
                 on {what}",
                name.as_deref().unwrap_or("?")
            );
            std::process::exit(101);
        }
    }
}

/// A current-thread runtime on paused time, as `#[tokio::test(start_paused = true)]` builds.
#[allow(dead_code)]
pub(crate) fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}
