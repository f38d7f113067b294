//! Starts the proxy example on a loopback port, for the tests that drive it over HTTP. The
//! including test declares the example's `app` module at its root.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::app::{self, Config, Proxy};

/// A proxy serving on `addr` until `stop` is sent or dropped.
pub(crate) struct Served {
    pub(crate) addr: SocketAddr,
    pub(crate) proxy: Arc<Proxy>,
    pub(crate) stop: oneshot::Sender<()>,
    pub(crate) server: JoinHandle<std::io::Result<()>>,
}

pub(crate) async fn serve(config: Config) -> Served {
    let proxy = Arc::new(Proxy::new(config).await.unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let stopping = async {
        let _ = stopped.await;
    };
    let never = std::future::pending();
    let server = tokio::spawn(app::serve(listener, proxy.front(), stopping, never));
    Served {
        addr,
        proxy,
        stop,
        server,
    }
}
