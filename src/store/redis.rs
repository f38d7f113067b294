//! [`RedisStore`]: session homes in Redis (or Valkey), through the `redis` crate's connection
//! manager.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Value;
use tokio::time::Instant;

use super::home::placed_millis;
use super::{HomeStore, Lookup, ReadHome, ReadPrompts, StoredHome, WriteHome};
use crate::key::SessionKey;

/// A [`HomeStore`] on Redis (6.2 or later) or Valkey.
///
/// - **Keys:** the session's digest in hex (32 characters) under a prefix, by default
///   [`RedisStore::DEFAULT_PREFIX`]: `tower-affinity:home:ba7816bf8f01cfea414140de5dae2223`.
/// - **Values:** a [`StoredHome`] in its versioned format,
///   `{"v":1,"backend":..,"node":..,"tip":..,"placed":..}`.
/// - **Reads:** `GETRANGE key 0 16384` and `PEXPIRE key ttl`, in one round trip: the value,
///   of which no more than 16 KiB and a byte is sent (the end of a `GETRANGE` is inclusive:
///   the byte past 16 KiB tells a value too long from one that fits), and the active
///   session's home kept for the idle timeout again. A key of another type (`WRONGTYPE`), a value in another format, or one
///   longer than 16 KiB (a home is about a hundred bytes) reads as [`Lookup::Garbage`],
///   never as a failure of the store: a value of megabytes read whole could take longer than
///   the deadline, and hold up the connection every read shares. A home whose encoding is
///   longer than that (backend and node names of kilobytes) is not written: its write fails.
/// - **Writes:** a Lua script (`EVAL`) that runs `GETRANGE` and `SET key value PX ttl`: the
///   home is set unless the key holds a home placed after it, so that a write that lands late
///   (held up on the way, or in a Redis that stalled, after its sender gave up on it) never
///   replaces a later turn's home. One round trip, as a plain `SET`; on Redis, a read of the
///   key and a few pattern matches of its value. The script judges a value only in the form
///   [`StoredHome::encode`] writes, with names of printable ASCII other than `"` and `\`; any
///   other value it sends back, and the store judges it as a read does ([`StoredHome::decode`])
///   and sets the home only if the key still holds it (a second round trip). Among homes placed
///   in the same millisecond, and over a home that does not say when, the last write wins (see
///   the [module docs](crate::store)). A home without [`placed`](StoredHome::placed) is written
///   with a plain `SET`. A home written again after an outage ([`HomeStore::rewrite`]) is set
///   over no home, garbage, or a home placed before it, and not over one placed later or one
///   that does not say when, each as a read takes the value ([`StoredHome::decode`]): the key
///   is read as a read does, and the home set by a Lua script (`EVAL`) only if the key still
///   holds what was read; else read and judged again, up to 4 times (each time, another write
///   landed in between).
/// - **Keyless conversations:** the home of a turn's prompt under `prefix` +
///   [`PROMPT_PREFIX`](RedisStore::PROMPT_PREFIX) + the prompt's 64-bit digest in hex,
///   `tower-affinity:home:prompt:00abcdef01234567`, written as a session's home is; a keyless
///   request reads the digests of its prompt's last few boundaries in one round trip, a
///   `GETRANGE` of each, bounded as a session's read is.
/// - **Commands:** `GETRANGE`, `PEXPIRE`, `SET` and `EVAL` (of scripts that run `GETRANGE`
///   and `SET`), on keys under the prefix, and `PING`: what
///   a Redis ACL user for the store must be allowed; and `SELECT` if the URL names a database
///   other than 0 (`redis://user:pass@host/1`), which each connection selects as it opens.
///   Refused that, no connection opens: reads find the store down (they give up at their
///   deadline while the connection's attempts go on), the store logs "Redis server refused
///   to switch database" once its attempts have ended, seconds later, and it connects once
///   the user may.
/// - **Not Redis Cluster.** The store sends every command to the one server its URL names. A
///   cluster node answers a key in a slot it does not serve with `MOVED`, which fails the
///   read or write, and a failed read marks the store down: against a cluster of several
///   primaries it is down most of the time. Give it a single primary (or an address that
///   follows failovers to the new primary).
///
/// One multiplexed connection, kept by the `redis` crate's connection manager, carries every
/// command; when it breaks, the manager reconnects with exponential backoff, at most
/// [`reconnect_interval`](RedisStoreBuilder::reconnect_interval) apart. A server that
/// refuses the store's commands as a replica (`READONLY`: a primary demoted by a failover
/// while the store's address moved to the new one) is left for a new connection too, at
/// most once an interval. The service reads within its own deadline, so a reconnect never
/// holds up a request. Nor does a read see why a connection cannot open (it gives up at its
/// deadline while the manager still tries): the store logs that error itself, as a warning
/// naming the Redis's address and database (never its password), once for each error in a
/// row, and a line when a connection opens again.
///
/// ```no_run
/// use tower::Layer;
/// use tower_affinity::{discover::StaticFleet, Backend, SessionAffinityLayer};
/// use tower_affinity::store::RedisStore;
///
/// # fn backend() -> tower::util::BoxCloneSyncService<http::Request<()>, http::Response<()>, std::convert::Infallible> { unimplemented!() }
/// # #[tokio::main]
/// # async fn main() -> Result<(), tower_affinity::store::RedisOpenError> {
/// let store = RedisStore::builder()
///     .prefix("my-fleet:home:")
///     .open("redis://127.0.0.1:6379")?;
/// let fleet = StaticFleet::new([("gpu-0", Backend::new("host-a", backend()))]);
/// let svc = SessionAffinityLayer::new().home_store(store).layer(fleet);
/// # let _ = svc;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub struct RedisStore {
    conn: Arc<Connection>,
    prefix: Arc<str>,
}

/// The store's connection manager, and what it takes to start another.
///
/// The `redis` crate's manager reconnects after an I/O error only: once its connection
/// attempts have all failed with another error (Redis refused the password in the URL, or the
/// `SELECT` of the URL's database), it answers every later command with that error and never
/// tries again, so a Redis whose password is set right after that would never be read again.
/// Nor does it reconnect when the server it is connected to refuses writes as a replica
/// (`READONLY`): a primary demoted by a failover, while the store's address moved to the new
/// one. A refused password, a `READONLY`, or a read that fails whole with an error other than
/// I/O (its commands fail one by one, in their places: an error of the whole is the
/// connection's) starts a new manager, at most once a reconnect interval.
struct Connection {
    client: redis::Client,
    config: ConnectionManagerConfig,
    /// What the log last said of the connection's attempts.
    report: Arc<Report>,
    /// The least time between two managers started.
    interval: Duration,
    /// The manager in use, how many were started before it, and when it was started.
    current: Mutex<(ConnectionManager, u64, Instant)>,
}

impl Connection {
    /// A manager, connecting in the background; how its first connection went is logged
    /// through `report`.
    fn start(
        client: &redis::Client,
        config: &ConnectionManagerConfig,
        report: &Arc<Report>,
    ) -> redis::RedisResult<ConnectionManager> {
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())?;
        // Connect now, in the background, so that the first request does not wait for the
        // connection and its handshake. The reads never see why a connection cannot open:
        // the manager retries for seconds, and they give up at their deadline; this `PING`
        // waits for the attempts' end, and logs their error.
        let mut first = conn.clone();
        let report = report.clone();
        tokio::spawn(async move {
            let answer = redis::cmd("PING").query_async::<()>(&mut first).await;
            report.connected(answer.err());
        });
        Ok(conn)
    }

    /// The manager to send a command on, and its number for [`failed`](Self::failed) and
    /// [`replace`](Self::replace).
    fn get(&self) -> (ConnectionManager, u64) {
        let current = self.current.lock();
        (current.0.clone(), current.1)
    }

    /// A command sent on manager number `generation` failed with `e`: a new manager if it is
    /// an error the manager does not reconnect after, and no other replaced that one yet.
    fn failed(&self, generation: u64, e: &redis::RedisError) {
        if e.kind() != redis::ErrorKind::AuthenticationFailed && e.code() != Some("READONLY") {
            return;
        }
        self.replace(generation);
    }

    /// A new manager in place of number `generation`, unless another replaced it already or it
    /// was started less than an interval ago.
    fn replace(&self, generation: u64) {
        let mut current = self.current.lock();
        if current.1 != generation || current.2.elapsed() < self.interval {
            return;
        }
        if let Ok(conn) = Self::start(&self.client, &self.config, &self.report) {
            *current = (conn, generation + 1, Instant::now());
        }
    }

    /// Sends `cmd`.
    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        let (mut conn, generation) = self.get();
        let result = cmd.query_async(&mut conn).await;
        if let Err(e) = &result {
            self.failed(generation, e);
        }
        result
    }

    /// Sends `pipe` (whose errors are ignored): each command's answer, or its error, in its
    /// place.
    async fn query_each(
        &self,
        pipe: &redis::Pipeline,
    ) -> redis::RedisResult<Vec<redis::RedisResult<Value>>> {
        let (mut conn, generation) = self.get();
        let result: redis::RedisResult<Vec<redis::RedisResult<Value>>> =
            pipe.query_async(&mut conn).await;
        match &result {
            // The pipeline's commands fail one by one, in their places: an error of the
            // whole is the connection's. The manager starts again after an I/O error only;
            // after another (a database that `SELECT` was refused, a handshake answered with
            // something else than Redis' answers), it would answer every command with it.
            Err(e) if !e.is_io_error() => self.replace(generation),
            Err(_) => {}
            Ok(answers) => {
                for e in answers.iter().filter_map(|a| a.as_ref().err()) {
                    self.failed(generation, e);
                }
            }
        }
        result
    }
}

/// Options of a [`RedisStore`]: its key prefix and how it reconnects.
#[derive(Clone, Debug)]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub struct RedisStoreBuilder {
    prefix: String,
    reconnect_interval: Duration,
    connect_timeout: Duration,
}

impl RedisStore {
    /// The key prefix unless [`RedisStoreBuilder::prefix`] sets another.
    pub const DEFAULT_PREFIX: &'static str = "tower-affinity:home:";

    /// What follows the prefix in the keys of keyless conversations' homes (see
    /// [`key_of_prompt`](Self::key_of_prompt)).
    pub const PROMPT_PREFIX: &'static str = "prompt:";

    /// Waits until the store's first attempts to connect have ended, and says whether a
    /// connection opened. The store connects in the background from
    /// [`open`](RedisStoreBuilder::open) on; a read made before it is open waits for it, and
    /// the service gives up on a read at its deadline (5 ms by default) and marks the store
    /// down until a read answers in time. A proxy that awaits this before it serves (bounded:
    /// a Redis that is down makes the attempts go on for seconds) starts with the store up.
    /// `false` when they failed: the store has logged why, and keeps trying.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_affinity::store::RedisStore;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), tower_affinity::store::RedisOpenError> {
    /// let store = RedisStore::open("redis://127.0.0.1:6379")?;
    /// // At most a second: serving goes on without the store meanwhile.
    /// let _ = tokio::time::timeout(Duration::from_secs(1), store.connected()).await;
    /// # Ok(())
    /// # }
    /// ```
    pub fn connected(&self) -> impl std::future::Future<Output = bool> + Send + 'static {
        let mut opened = self.conn.report.opened.subscribe();
        async move {
            match opened.wait_for(Option::is_some).await {
                Ok(state) => state.unwrap_or(false),
                Err(_) => false,
            }
        }
    }

    /// A store on the Redis at `url` (`redis://host:port/db`) with the default options.
    /// See [`RedisStoreBuilder::open`].
    pub fn open(url: &str) -> Result<Self, RedisOpenError> {
        Self::builder().open(url)
    }

    /// Options for a store.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder {
            prefix: Self::DEFAULT_PREFIX.to_string(),
            reconnect_interval: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
        }
    }

    /// The Redis key of a session's home: the prefix, then the session's digest in hex.
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() {
    /// use tower_affinity::key::SessionKey;
    /// use tower_affinity::store::RedisStore;
    ///
    /// let store = RedisStore::open("redis://127.0.0.1:6379").unwrap();
    /// assert_eq!(
    ///     store.key_of(SessionKey::from_bytes(b"abc")),
    ///     "tower-affinity:home:ba7816bf8f01cfea414140de5dae2223"
    /// );
    /// # }
    /// ```
    pub fn key_of(&self, session: SessionKey) -> String {
        format!("{}{session}", self.prefix)
    }

    /// The Redis key of the home of a keyless conversation's prompt, by the prompt's digest:
    /// under the prefix and [`PROMPT_PREFIX`](Self::PROMPT_PREFIX), apart from every session
    /// key (those are hex digits only after the prefix).
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() {
    /// use tower_affinity::store::RedisStore;
    ///
    /// let store = RedisStore::open("redis://127.0.0.1:6379").unwrap();
    /// assert_eq!(
    ///     store.key_of_prompt(0x00ab_cdef_0123_4567),
    ///     "tower-affinity:home:prompt:00abcdef01234567"
    /// );
    /// # }
    /// ```
    pub fn key_of_prompt(&self, prompt: u64) -> String {
        format!("{}{}{prompt:016x}", self.prefix, Self::PROMPT_PREFIX)
    }
}

/// How long a request written to Redis may stay unacknowledged before the connection is
/// given up (Linux's `TCP_USER_TIMEOUT`), and how long an idle connection goes before it is
/// probed. A Redis that vanishes without closing its connections (its host gone, or a
/// failover to another address) otherwise leaves the connection open until the kernel's own
/// timeouts, many minutes, and redis' connection manager reconnects only when a connection
/// fails, not when a command times out.
const DEAD_CONNECTION: Duration = Duration::from_secs(10);

/// The TCP settings of the store's connection: `TCP_NODELAY` (its commands are small and
/// each one waited for), and the dead-connection detection of [`DEAD_CONNECTION`].
fn tcp_settings() -> redis::io::tcp::TcpSettings {
    use redis::io::tcp::socket2::TcpKeepalive;
    let keepalive = TcpKeepalive::new()
        .with_time(DEAD_CONNECTION)
        .with_interval(Duration::from_secs(2));
    let settings = redis::io::tcp::TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive);
    #[cfg(target_os = "linux")]
    let settings = settings.set_user_timeout(DEAD_CONNECTION);
    settings
}

impl RedisStoreBuilder {
    /// The prefix of every key the store reads and writes. Default
    /// [`RedisStore::DEFAULT_PREFIX`].
    ///
    /// Give each fleet sharing a Redis a prefix of its own (a fleet for each model, say): the
    /// same session key sent to two fleets (an agent's turns and its title requests, to two
    /// models) is one key under one prefix, and each fleet would write its own backend over
    /// the other's, find a backend it does not know ([`StoreStats::unknown_backends`]), and
    /// share none of that session's moves between its replicas.
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() {
    /// use tower_affinity::key::SessionKey;
    /// use tower_affinity::store::RedisStore;
    ///
    /// let coder = RedisStore::builder()
    ///     .prefix("tower-affinity:home:model=coder:")
    ///     .open("redis://127.0.0.1:6379")
    ///     .unwrap();
    /// let key = coder.key_of(SessionKey::from_bytes(b"abc"));
    /// assert_eq!(key, "tower-affinity:home:model=coder:ba7816bf8f01cfea414140de5dae2223");
    /// # }
    /// ```
    ///
    /// [`StoreStats::unknown_backends`]: crate::store::StoreStats::unknown_backends
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The longest wait between two attempts to reconnect to a Redis that went away. Default
    /// 1 s; the first attempts come sooner (from about 10 ms, doubling, with a random jitter).
    /// Once Redis is back, the service reads from it again within this long.
    pub fn reconnect_interval(mut self, interval: Duration) -> Self {
        self.reconnect_interval = interval;
        self
    }

    /// How long one attempt to connect may take. Default 1 s.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The store on the Redis at `url`. It starts connecting in the background and returns at
    /// once, so a Redis that is down at start does not stop the router; an error here is a URL
    /// it cannot use (a TLS one, `rediss://`, among them: this crate builds the `redis` crate
    /// without TLS), or a call outside a Tokio runtime (the store runs its connection on it).
    pub fn open(self, url: &str) -> Result<RedisStore, RedisOpenError> {
        let info = redis::IntoConnectionInfo::into_connection_info(url)
            .map_err(|e| RedisOpenError(OpenKind::Redis(e)))?
            .set_tcp_settings(tcp_settings());
        let client = redis::Client::open(info).map_err(|e| RedisOpenError(OpenKind::Redis(e)))?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(RedisOpenError(OpenKind::NoRuntime));
        }
        // The manager adds a random jitter of up to the delay itself: half the interval
        // keeps attempts at most one interval apart.
        let cap = self.reconnect_interval / 2;
        let config = ConnectionManagerConfig::new()
            .set_min_delay(Duration::from_millis(10).min(cap))
            .set_max_delay(cap)
            .set_exponent_base(2.0)
            // Past its last retry the manager starts again at the next command (after an I/O
            // error; after a refused password the store starts a new manager, see
            // `Connection`): the service reads (and probes) on every keyed request, so no
            // retry limit is needed.
            .set_number_of_retries(12)
            .set_connection_timeout(Some(self.connect_timeout))
            // The service bounds reads by its deadline and writes by a second.
            .set_response_timeout(None);
        let prefix: Arc<str> = self.prefix.into();
        let report = Arc::new(Report {
            prefix: prefix.clone(),
            addr: client.get_connection_info().addr().to_string(),
            db: client.get_connection_info().redis_settings().db(),
            last: Mutex::new(None),
            opened: tokio::sync::watch::Sender::new(None),
        });
        let conn = Connection::start(&client, &config, &report)
            .map_err(|e| RedisOpenError(OpenKind::Redis(e)))?;
        Ok(RedisStore {
            conn: Arc::new(Connection {
                client,
                config,
                report,
                interval: self.reconnect_interval,
                current: Mutex::new((conn, 0, Instant::now())),
            }),
            prefix,
        })
    }
}

/// Logs why the store's connection cannot open, which its reads cannot say: they give up at
/// their deadline ("no answer") while the manager still tries, and only its last attempt's
/// error (a refused password or database, a host that does not resolve, a port that refuses
/// connections) tells the operator what to fix. Once for each error in a row, and once when a
/// connection opens again, so that a password wrong for hours is one line, not one a second.
struct Report {
    prefix: Arc<str>,
    /// Where the store connects (`host:port`), never its password.
    addr: String,
    db: i64,
    /// The error last logged, until a connection opens.
    last: Mutex<Option<String>>,
    /// Whether the last manager's first connection opened; `None` while its first attempts
    /// go on.
    opened: tokio::sync::watch::Sender<Option<bool>>,
}

impl Report {
    /// A manager's first connection opened (`None`) or failed with `error`.
    fn connected(&self, error: Option<redis::RedisError>) {
        self.opened.send_replace(Some(error.is_none()));
        let error = error.map(|e| e.to_string());
        let mut last = self.last.lock();
        if *last == error {
            return;
        }
        let was = std::mem::replace(&mut *last, error.clone());
        drop(last);
        let store = StoreName(&self.prefix);
        match error {
            Some(error) => tracing::warn!(
                store = ?store,
                redis = %self.addr,
                db = self.db,
                %error,
                "cannot connect to the shared session store; trying again"
            ),
            None if was.is_some() => tracing::info!(
                store = ?store,
                redis = %self.addr,
                db = self.db,
                "connected to the shared session store"
            ),
            None => {}
        }
    }
}

/// A store named in the log as its `Debug` names it.
struct StoreName<'a>(&'a str);

impl fmt::Debug for StoreName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.0)
            .finish_non_exhaustive()
    }
}

/// Why a [`RedisStore`] could not be opened: a URL the `redis` crate cannot use, or a call
/// outside a Tokio runtime. Its `Display` and [source](std::error::Error::source) are the
/// `redis` crate's error's, when it is one.
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub struct RedisOpenError(OpenKind);

enum OpenKind {
    Redis(redis::RedisError),
    NoRuntime,
}

impl fmt::Debug for RedisOpenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            OpenKind::Redis(e) => f.debug_tuple("RedisOpenError").field(e).finish(),
            OpenKind::NoRuntime => f.write_str("RedisOpenError(NoRuntime)"),
        }
    }
}

impl fmt::Display for RedisOpenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            OpenKind::Redis(e) => fmt::Display::fmt(e, f),
            OpenKind::NoRuntime => {
                f.write_str("RedisStore::open must be called within a Tokio runtime")
            }
        }
    }
}

impl std::error::Error for RedisOpenError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.0 {
            OpenKind::Redis(e) => e.source(),
            OpenKind::NoRuntime => None,
        }
    }
}

/// The longest `PX`: the session table's longest idle timeout, `u32::MAX` seconds (about
/// 136 years). Redis refuses one that takes the expiry past its clock's range (`i64`
/// milliseconds), and an idle timeout of `Duration::MAX` (never forgotten) would make every
/// read and write fail.
const MAX_PX: u64 = u32::MAX as u64 * 1000;

/// Milliseconds for `PX`: at least 1 (Redis refuses 0), at most [`MAX_PX`].
fn px(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis())
        .unwrap_or(u64::MAX)
        .clamp(1, MAX_PX)
}

/// The longest value the store reads, in bytes. A home is a hundred bytes or so; a longer
/// value is not one, and is not read whole: a value of megabytes (another program's, under
/// the same prefix), read whole, could take longer than the read's deadline to arrive, hold
/// up every other command on the one connection meanwhile, and be taken for an outage.
const MAX_VALUE: usize = 16 * 1024;

/// Sets `KEYS[1]` to the home `ARGV[1]` with `PX` `ARGV[2]` if it still holds what a read
/// of it found: `GETRANGE KEYS[1] 0 ARGV[4]` answers the string `ARGV[3]` (`ARGV[5]` is
/// `s`), or fails (`ARGV[5]` is `e`: a key of another type). `1` if it set the home.
///
/// Whether the value read is a home that must stay is judged by [`StoredHome::decode`] in
/// the store, not here: a JSON reader in Lua takes values that `decode` does not (`1.0` for
/// `1`, hex numbers, `Infinity`, names that are not UTF-8) and reads some numbers otherwise.
const SET_IF_HELD: &str = r#"
local held = redis.pcall('GETRANGE', KEYS[1], 0, tonumber(ARGV[4]))
local same
if type(held) == 'string' then
  same = ARGV[5] == 's' and held == ARGV[3]
else
  same = ARGV[5] == 'e'
end
if not same then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"#;

/// Sets `KEYS[1]` to the home `ARGV[1]`, placed at `ARGV[3]` (milliseconds since the Unix
/// epoch, in decimal), with `PX` `ARGV[2]`, unless it holds a home placed later: `1` if it set
/// the home, `0` if it kept the one held. Values up to `ARGV[4]` bytes (the longest a read
/// takes) are judged here only in the form [`StoredHome::encode`] writes, with names of
/// printable ASCII other than `"` and `\`, where no JSON reader could read them otherwise:
/// no key, an empty string, a key of another type or a value too long to be a home is set
/// over; a home that does not say when it was placed is set over; a home placed later is
/// kept. Any other value is answered as it is, nothing set, for the store to judge as a read
/// takes it ([`StoredHome::decode`]).
const SET_UNLESS_LATER: &str = r#"
local function set()
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
local max = tonumber(ARGV[4])
local held = redis.pcall('GETRANGE', KEYS[1], 0, max)
if type(held) ~= 'string' or held == '' or #held > max then
  return set()
end
if string.find(held, '[^ -~]') then
  return held
end
local head = '^{"v":1,"backend":"[^"\\]+","node":"[^"\\]*"'
local tip = ',"tip":"' .. string.rep('%x', 16) .. '"'
if string.find(held, head .. '}$') or string.find(held, head .. tip .. '}$') then
  return set()
end
local placed = ',"placed":(%d+)}$'
local at = string.match(held, head .. placed) or string.match(held, head .. tip .. placed)
if not at or #at > 18 or (#at > 1 and string.sub(at, 1, 1) == '0') then
  return held
end
local mine = ARGV[3]
if #at > #mine or (#at == #mine and at > mine) then
  return 0
end
return set()
"#;

/// How many times a home sent again is read and set before the store gives up: each time,
/// the key changed between the read and the set (another write landed), and the next read
/// judges the new value.
const REWRITE_ATTEMPTS: usize = 4;

/// `GETRANGE key 0 MAX_VALUE`: a value up to a byte past the longest the store reads, so
/// that a longer one is known as such without being sent whole.
fn get_bounded(pipe: &mut redis::Pipeline, key: &str) {
    pipe.cmd("GETRANGE").arg(key).arg(0).arg(MAX_VALUE);
}

/// What a `GETRANGE` of [`get_bounded`] found, given that an empty string is no home: a
/// value of another type (`WRONGTYPE`), or longer than [`MAX_VALUE`], is garbage.
fn lookup(answer: redis::RedisResult<Value>, empty: Lookup) -> Result<Lookup, redis::RedisError> {
    match answer {
        Ok(Value::BulkString(v)) if v.is_empty() => Ok(empty),
        Ok(Value::BulkString(v)) if v.len() <= MAX_VALUE => {
            Ok(StoredHome::decode(&v).map_or(Lookup::Garbage, Lookup::Home))
        }
        Ok(_) => Ok(Lookup::Garbage),
        Err(e) if e.code() == Some("WRONGTYPE") => Ok(Lookup::Garbage),
        Err(e) => Err(e),
    }
}

impl HomeStore for RedisStore {
    fn read(&self, session: SessionKey, ttl: Duration) -> ReadHome {
        let conn = self.conn.clone();
        let key = self.key_of(session);
        // One round trip: the value, bounded, and its expiry set again (`1` if the key
        // exists, which tells an empty string from no key).
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        get_bounded(&mut pipe, &key);
        pipe.cmd("PEXPIRE").arg(&key).arg(px(ttl));
        Box::pin(async move {
            let mut answers = conn.query_each(&pipe).await?.into_iter();
            let (Some(value), Some(kept)) = (answers.next(), answers.next()) else {
                return Ok(Lookup::Garbage);
            };
            // A server that does not take the expiry (`READONLY`: a replica) fails the read,
            // as it would fail the write that follows.
            let empty = match kept? {
                Value::Int(0) => Lookup::Missing,
                _ => Lookup::Garbage,
            };
            Ok(lookup(value, empty)?)
        })
    }

    fn write(&self, session: SessionKey, home: StoredHome, ttl: Duration) -> WriteHome {
        self.set(self.key_of(session), &home, ttl, false)
    }

    fn rewrite(&self, session: SessionKey, home: StoredHome, ttl: Duration) -> WriteHome {
        self.set(self.key_of(session), &home, ttl, true)
    }

    fn read_prompts(&self, prompts: &[u64], _ttl: Duration) -> ReadPrompts {
        let conn = self.conn.clone();
        // One round trip. The keys' expiry stays as it is: each turn of a conversation writes
        // its own prompt's key, with a fresh one.
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for &p in prompts {
            get_bounded(&mut pipe, &self.key_of_prompt(p));
        }
        let asked = prompts.len();
        Box::pin(async move {
            if asked == 0 {
                return Ok(Vec::new());
            }
            let answers = conn.query_each(&pipe).await?;
            if answers.len() != asked {
                return Ok(vec![Lookup::Garbage; asked]);
            }
            // A missing key reads as an empty string.
            let found = answers.into_iter().map(|a| lookup(a, Lookup::Missing));
            Ok(found.collect::<Result<_, _>>()?)
        })
    }

    fn write_prompt(&self, prompt: u64, home: StoredHome, ttl: Duration) -> WriteHome {
        self.set(self.key_of_prompt(prompt), &home, ttl, false)
    }
}

impl RedisStore {
    /// [`write_once`] until done, which sets the home unless the key holds a home placed after
    /// it (`SET key home PX ttl` for a home that does not say when it was placed), or
    /// (`again`) [`rewrite_once`] until done, which also keeps a home that does not say when;
    /// an error, sending nothing, for a home longer than the store reads.
    fn set(&self, key: String, home: &StoredHome, ttl: Duration, again: bool) -> WriteHome {
        let conn = self.conn.clone();
        let value = home.encode();
        if value.len() > MAX_VALUE {
            let error = format!(
                "a home of {} bytes, longer than the {MAX_VALUE} a store reads (its backend's and node's names)",
                value.len()
            );
            return Box::pin(std::future::ready(Err(error.into())));
        }
        if again {
            let placed = home.placed.map(placed_millis);
            return Box::pin(async move {
                for _ in 0..REWRITE_ATTEMPTS {
                    if rewrite_once(&conn, &key, &value, placed, ttl).await? {
                        return Ok(());
                    }
                }
                // Written over at every attempt: by writes that came after this home's.
                Ok(())
            });
        }
        let Some(placed) = home.placed.map(placed_millis) else {
            // Nothing to compare: the last write wins.
            let mut cmd = redis::cmd("SET");
            cmd.arg(key).arg(value).arg("PX").arg(px(ttl));
            return Box::pin(async move {
                conn.query::<()>(&cmd).await?;
                Ok(())
            });
        };
        Box::pin(async move {
            for _ in 0..REWRITE_ATTEMPTS {
                if write_once(&conn, &key, &value, placed, ttl).await? {
                    return Ok(());
                }
            }
            // Written over at every attempt: by writes of homes placed after this one.
            Ok(())
        })
    }
}

/// One attempt of a write of `value`, placed at `placed` (milliseconds): [`SET_UNLESS_LATER`]
/// in one round trip, and, for a value held that the script leaves to the store, that value
/// judged as a read takes it and `value` set over it only if it is not a home placed later and
/// the key still holds it. `true` when done (kept or set), `false` when the key changed in
/// between.
async fn write_once(
    conn: &Connection,
    key: &str,
    value: &str,
    placed: u64,
    ttl: Duration,
) -> Result<bool, crate::BoxError> {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(SET_UNLESS_LATER)
        .arg(1)
        .arg(key)
        .arg(value)
        .arg(px(ttl));
    cmd.arg(placed).arg(MAX_VALUE);
    let held = match conn.query::<Value>(&cmd).await? {
        Value::Int(_) => return Ok(true),
        Value::BulkString(held) => held,
        other => return Err(format!("EVAL answered {other:?}").into()),
    };
    if let Lookup::Home(h) = lookup(Ok(Value::BulkString(held.clone())), Lookup::Missing)? {
        if h.placed.is_some_and(|h| placed_millis(h) > placed) {
            return Ok(true);
        }
    }
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(SET_IF_HELD).arg(1).arg(key).arg(value).arg(px(ttl));
    cmd.arg(held).arg(MAX_VALUE).arg("s");
    let set: i64 = conn.query(&cmd).await?;
    Ok(set == 1)
}

/// One attempt of a home sent again, `value`, placed at `placed` (milliseconds): reads the
/// key as a read does, and keeps what it holds if that reads as a home placed later than
/// `placed`, or one that does not say when (any home, for a `value` that does not say
/// either); else sets `value` if the key still holds what was read. `true` when done (kept
/// or set), `false` when the key changed in between.
async fn rewrite_once(
    conn: &Connection,
    key: &str,
    value: &str,
    placed: Option<u64>,
    ttl: Duration,
) -> Result<bool, crate::BoxError> {
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    get_bounded(&mut pipe, key);
    let answer = conn.query_each(&pipe).await?.into_iter().next();
    let answer = answer.ok_or("no answer to GETRANGE")?;
    let (kind, held) = match &answer {
        Ok(Value::BulkString(v)) => ("s", v.clone()),
        Ok(other) => return Err(format!("GETRANGE answered {other:?}").into()),
        // A key of another type; any other error fails the lookup below.
        Err(_) => ("e", Vec::new()),
    };
    if let Lookup::Home(h) = lookup(answer, Lookup::Missing)? {
        let held_placed = h.placed.map(placed_millis);
        let keep = match (held_placed, placed) {
            (None, _) | (Some(_), None) => true,
            (Some(h), Some(p)) => h > p,
        };
        if keep {
            return Ok(true);
        }
    }
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(SET_IF_HELD).arg(1).arg(key).arg(value).arg(px(ttl));
    cmd.arg(held).arg(MAX_VALUE).arg(kind);
    let set: i64 = conn.query(&cmd).await?;
    Ok(set == 1)
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        StoreName(&self.prefix).fmt(f)
    }
}
