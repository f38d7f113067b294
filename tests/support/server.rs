//! Serves an axum router on a loopback listener: one task accepts, and every connection it
//! accepts runs in a task of a set the handle keeps, so that stopping the server closes the
//! listener and every connection, as a killed process would.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

/// The longest [`Served::stop`] waits for the server's tasks to end. Aborted tasks end at
/// their next poll, so this bounds a hang, not a wait.
const STOP_BOUND: Duration = Duration::from_secs(10);

/// A running server: its accepting task and the connections it accepted. Dropping it aborts
/// them all without waiting.
#[derive(Debug)]
pub(crate) struct Served {
    accept: Mutex<Option<JoinHandle<()>>>,
    connections: Arc<Mutex<JoinSet<()>>>,
}

impl Served {
    /// Closes the listener and every connection, and returns once the accepting task and
    /// every connection task have ended: nothing the server accepted answers again, whatever
    /// worker of the runtime ran it. Stopping a server stopped already does nothing.
    pub(crate) async fn stop(&self) {
        let accept = self.accept.lock().take();
        let stopped = async {
            if let Some(accept) = accept {
                accept.abort();
                // Ended, it spawns no connection after those taken below.
                let _ = accept.await;
            }
            let mut connections = std::mem::take(&mut *self.connections.lock());
            connections.shutdown().await;
        };
        tokio::time::timeout(STOP_BOUND, stopped)
            .await
            .expect("a stopped server's tasks end");
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(accept) = self.accept.lock().take() {
            accept.abort();
        }
        self.connections.lock().abort_all();
    }
}

pub(crate) fn spawn(listener: TcpListener, router: Router) -> Served {
    spawn_counted(listener, router, Arc::default())
}

/// [`spawn`], counting the connections it accepts in `accepted`.
pub(crate) fn spawn_counted(
    listener: TcpListener,
    router: Router,
    accepted: Arc<AtomicUsize>,
) -> Served {
    let connections: Arc<Mutex<JoinSet<()>>> = Arc::default();
    let set = connections.clone();
    let accept = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            accepted.fetch_add(1, Ordering::Relaxed);
            let service = TowerToHyperService::new(router.clone());
            let mut set = set.lock();
            set.spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
            while set.try_join_next().is_some() {}
        }
    });
    Served {
        accept: Mutex::new(Some(accept)),
        connections,
    }
}
