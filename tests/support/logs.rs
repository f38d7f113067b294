//! What the crate logs on one test's thread, for the tests that count its log lines.
//!
//! Each test that counts has a buffer of its own, so that another test logging the same line
//! at the same time does not count. One global subscriber a test binary routes each event to
//! the buffer of the test on the thread that logged it (a current-thread runtime runs that
//! test's tasks on its thread), or nowhere; a thread's own default subscriber would race the
//! other tests over tracing's global per-callsite cache.

use std::io::Write;
use std::sync::Arc;

use parking_lot::Mutex;

/// The lines a test's thread logged.
#[derive(Clone, Default)]
pub(crate) struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    /// All of it.
    #[allow(dead_code)] // Each test binary uses a part of this module.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock()).into_owned()
    }

    /// The lines that contain each of `needles`.
    #[allow(dead_code)]
    pub(crate) fn count(&self, needles: &[&str]) -> usize {
        String::from_utf8_lossy(&self.0.lock())
            .lines()
            .filter(|l| needles.iter().all(|n| l.contains(n)))
            .count()
    }
}

thread_local! {
    // The buffer of the test on this thread, if it counts log lines.
    static CAPTURE: std::cell::RefCell<Option<Logs>> = const { std::cell::RefCell::new(None) };
}

/// Writes to the buffer of the test on the current thread, if any.
struct ThreadLogs;

impl Write for ThreadLogs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        CAPTURE.with(|c| {
            if let Some(logs) = c.borrow().as_ref() {
                logs.0.lock().extend_from_slice(buf);
            }
        });
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Sets the binary's one subscriber, at `level`, if no test has yet: before any test logs.
pub(crate) fn install(level: tracing::Level) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(level)
            .with_writer(|| ThreadLogs)
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("the binary's one subscriber");
    });
}

/// What this thread logs at `level` and above from now on.
#[allow(dead_code)]
pub(crate) fn capture(level: tracing::Level) -> Logs {
    install(level);
    let logs = Logs::default();
    CAPTURE.with(|c| *c.borrow_mut() = Some(logs.clone()));
    logs
}
