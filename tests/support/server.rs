//! Serves an axum router on a loopback listener in one task that owns every connection, so
//! aborting the task closes them all, as a killed process would.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

pub(crate) fn spawn(listener: TcpListener, router: Router) -> JoinHandle<()> {
    spawn_counted(listener, router, Arc::default())
}

/// [`spawn`], counting the connections it accepts in `accepted`.
pub(crate) fn spawn_counted(
    listener: TcpListener,
    router: Router,
    accepted: Arc<AtomicUsize>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut connections = JoinSet::new();
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            accepted.fetch_add(1, Ordering::Relaxed);
            let service = TowerToHyperService::new(router.clone());
            connections.spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
            while connections.try_join_next().is_some() {}
        }
    })
}
