//! A `redis-server` on a loopback port, started by the test and killed when dropped; shared
//! by the tests that need one. Without `redis-server` on the `PATH` a test fails, unless
//! `TOWER_AFFINITY_SKIP_REDIS=1` is set, in which case it says loudly that it skipped.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A `redis-server` on a loopback port, killed when dropped.
pub(crate) struct RedisServer {
    child: Option<Child>,
    pub(crate) port: u16,
}

/// Whether the tests may skip for lack of `redis-server`; panics if they may not.
pub(crate) fn redis_missing() -> bool {
    let found = std::process::Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if found {
        return false;
    }
    if std::env::var("TOWER_AFFINITY_SKIP_REDIS").as_deref() == Ok("1") {
        eprintln!(
            "\n*** SKIPPED: redis-server is not installed (TOWER_AFFINITY_SKIP_REDIS=1) ***\n"
        );
        return true;
    }
    panic!("redis-server is not installed (apt-get install redis-server), and TOWER_AFFINITY_SKIP_REDIS=1 is not set");
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

impl RedisServer {
    /// A server on a free port; `None` if the tests skip.
    pub(crate) async fn start() -> Option<Self> {
        if redis_missing() {
            return None;
        }
        for _ in 0..5 {
            if let Some(s) = Self::start_on(free_port()).await {
                return Some(s);
            }
        }
        panic!("redis-server did not start on any of five free ports");
    }

    /// A server on `port`, once it says it accepts connections; `None` if it exits first
    /// (the port was taken).
    async fn start_on(port: u16) -> Option<Self> {
        let mut child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start redis-server");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = tokio::time::timeout(Duration::from_secs(10), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("Ready to accept connections") {
                    return true;
                }
            }
            false
        })
        .await
        .expect("redis-server neither ready nor gone within 10 s");
        if !ready {
            return None;
        }
        // Keep reading its log, so that it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Some(RedisServer {
            child: Some(child),
            port,
        })
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub(crate) async fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().await.unwrap();
        }
    }

    /// Starts it again on the same port.
    pub(crate) async fn restart(&mut self) {
        self.kill().await;
        let again = Self::start_on(self.port)
            .await
            .expect("restart on the same port");
        *self = again;
    }

    pub(crate) async fn client(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }
}
