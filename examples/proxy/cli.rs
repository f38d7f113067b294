//! The proxy's command line.

use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr};
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::uri::{Authority, Scheme};
use http::Uri;
use tower_affinity::discover::dns::DnsTarget;
use tower_affinity::Overflow;

use crate::app::{
    one_id_each, redis_url_shown, refuse_redis_tls, BackendSpec, Config, DnsSpec, Policy,
    UpstreamMode,
};

pub(crate) const USAGE: &str = "\
usage: proxy [--listen ADDR] (--backend NODE=URL[,...] | --backend-dns NAME:PORT)... [options]

An OpenAI-compatible reverse proxy that keeps each agent session on the llama-server
that holds its prompt cache: same backend, else same node, else elsewhere.

  --listen ADDR              address to serve on (default 127.0.0.1:8080)
  --backend NODE=URL[,slots=N][,id=NAME][,cache=TOKENS][,context=TOKENS][,request-context=TOKENS][,model=NAME][,assign-slots]
                             a backend on host NODE (repeat for each). slots: requests
                             it serves at once (llama-server -np); without it, read from
                             /slots. id: its name (default: the URL's host:port, port
                             80 when the URL gives none).
                             cache: tokens of prompt it keeps cached, its slots' KV
                             plus its --cache-ram, as 65536 or 64k (k = 1024; default
                             128k). context: for a llama-server whose slots share one
                             KV cache (no -np, or --kv-unified), its -c less the longest
                             answer; the requests in flight there are kept within it,
                             by their prompts (default: only slots count).
                             request-context: the most tokens one request can take
                             there (llama-server's -c divided by -np); a prompt
                             longer goes to a backend that takes it, if one is up
                             (default: read from /slots, each slot's n_ctx, else
                             context). model: the model it serves (see Models below).
                             assign-slots: for a llama-server started with -np, the
                             proxy gives each request a slot (as id_slot): a
                             conversation's own slot, else an empty one, not another
                             conversation's that shares its system prompt (default:
                             llama-server chooses; leave it off with a unified KV
                             cache, which empties idle slots)
  --backend-dns NAME:PORT[,slots=N][,cache=TOKENS][,context=TOKENS][,request-context=TOKENS][,model=NAME][,assign-slots]
                             the backends behind a DNS name: its A/AAAA records with
                             PORT, or SRV records for _SVC._PROTO.NAME (a Kubernetes
                             headless service, Consul, docker compose), re-resolved as
                             their TTL says (5s to 60s); each backend's node is its IP;
                             slots, cache, context, request-context, model and
                             assign-slots as for --backend, for each backend (give
                             slots for vLLM and SGLang, which have no /slots)
  --dns-server IP:PORT       ask this nameserver for --backend-dns names (repeat for
                             more; default: the system's resolver configuration)
  --dns-removal-grace DURATION
                             how long a backend that the answers leave out stays, for
                             a server that answers with a different subset each time
                             (default 0s: gone at the first answer without it)
  --redis URL                share session homes with other proxy instances through
                             Redis (or Valkey), e.g. redis://127.0.0.1:6379: a session
                             that moved on one instance is followed by all (no TLS:
                             rediss:// is refused)
  --redis-timeout DURATION   longest wait for Redis's answer before placing from the
                             local table (default 5ms; more than 0)
  --replicas N               this instance is one of N behind a balancer that spreads
                             turns evenly: it sees about 1/N of each backend's
                             requests, so it models 1/N of its cache (default 1);
                             each instance counts all of a backend's slots, and the
                             backend queues the excess (slots=S/N caps an instance)
  --policy P                 node-then-backend (default) | round-robin | least-loaded |
                             rendezvous
  --live-window DURATION     node-then-backend spreads new conversations by those
                             with a turn within it (default 5m; 0: every
                             conversation the cache models remember)
  --overflow O               wait (default) | overcommit | reject: when every
                             candidate is full
  --max-wait DURATION        longest wait for a slot with --overflow wait (default 60s)
  --max-queued N             most requests waiting at once (default 1024; 0: none
                             wait, as with --overflow reject)
  --connect-timeout DURATION backend connect timeout (default 2s; 0 turns it off)
  --response-timeout DURATION
                             longest wait for a backend's response headers (default
                             10m; 0 turns it off); a backend past it is passed over
                             for the failure cooldown, the request is retried once
                             elsewhere, else 504
  --body-idle-timeout DURATION
                             longest silence between two frames of a backend's
                             answer once its first came (default 0: none); past it
                             the answer is cut short and its connection closed
  --tcp-keepalive DURATION   TCP keepalive on backend connections: after this long
                             without a byte either way the system probes the backend's
                             host, again every third of it, and closes the connection
                             after three probes unanswered, so that a host that
                             vanished fails its requests (default 30s; 0 turns it off;
                             whole seconds, at most 32767s)
  --client-tcp-keepalive DURATION
                             TCP keepalive on client connections, as --tcp-keepalive
                             on backend ones, so that a client whose host vanished
                             (lid closed, network cut) in a long prompt's reading is
                             disconnected and its request ended, its slot freed
                             (default 30s; 0 turns it off; whole seconds, at most
                             32767s)
  --failure-cooldown DURATION
                             how long a backend that failed a request is passed over
                             (default 5s)
  --probe-interval DURATION  how often /health (and /slots) is polled; 0 turns the
                             probe off (default 2s)
  --probe-timeout DURATION   longest a probe takes, /slots included (default 2s)
  --probe-failures N         failed probes in a row that take a backend down
                             (default 1; a 503, loading, does at once)
  --probe-successes N        ready probes in a row that bring it up again (default 1)
  --no-slots-probe           do not read slot counts and slot contexts from /slots, nor
                             vLLM's and SGLang's contexts from /v1/models
  --probe-header 'NAME: VALUE'
                             a header to send with every probe request (repeat for
                             others; none by default), e.g. 'Authorization: Bearer KEY'
                             for backends run with --api-key: their /health answers
                             without the key, but llama-server's /slots and vLLM's and
                             SGLang's /v1/models do not. The value is never shown.
                             Requests are forwarded with their clients' own headers,
                             not these
  --ask-stream-usage         ask a chat or completions stream that did not ask for its
                             usage to carry it, and take that chunk out of the answer
                             again (for vLLM and SGLang, whose streams otherwise report
                             nothing)
  --no-decision-headers      leave out the x-affinity-backend, -node and -outcome headers
                             (they tell a client where its prompt was placed, and so
                             what the caches hold: leave them out between tenants)
  --no-resend-on-close       fail a request whose backend connection closed before any
                             answer, rather than send it once more on another (on by
                             default: llama-server closes its connection after each
                             streamed answer; off for backends whose requests must not
                             run twice)
  --body-limit SIZE          largest request body, e.g. 16MiB (default); larger is 413
  --read-timeout DURATION    longest time to receive a request body (default 60s;
                             0 turns it off); slower is 408
  --header-timeout DURATION  longest time to receive a request's headers, and to hold
                             a connection with no request open: before its first
                             bytes, between HTTP/1 requests, an idle HTTP/2
                             connection (GOAWAY, closed after as long again), an
                             HTTP/2 ping's answer (default 30s; 0 turns it off);
                             slower closes the connection
  --upstream U               pooled (default): one pool of backend connections for
                             all clients | per-client: each HTTP/1 client connection
                             opens and drives its own (fewer hand-offs; more
                             connections, which llama-server pays a thread each for)
  --worker-threads N         tokio worker threads, at most 1024 (default: tokio's, one
                             per CPU unless TOKIO_WORKER_THREADS says otherwise)
  -v, --verbose              debug logs
  -h, --help                 this text

DURATION: 500ms, 2s, 1.5m, 1h, or plain seconds. SIZE: bytes, or with KiB, MiB, GiB.
GET /metrics on the listen address serves Prometheus metrics; every other request goes
to a backend.
Session keys: the headers X-Session-Affinity, X-Session-Id, X-Claude-Code-Session-Id,
thread-id, thread_id, session-id, session_id, agent-session-id, then the JSON body's
prompt_cache_key, user, metadata.user_id.
Models: backends given model=NAME form a fleet of their own, with its own sessions,
cache models and metrics (labelled model=NAME); a request whose JSON body's \"model\" is
NAME goes there. Every other request goes to the backends given without a model, or if
every backend has one, to the fleet of the first model given. GET /v1/models then lists
the models given, and GET /v1/models/NAME answers for each.";

/// What the command line asks for.
#[derive(Debug)]
pub(crate) enum Command {
    Run(Box<Args>),
    Help,
}

#[derive(Debug)]
pub(crate) struct Args {
    pub(crate) listen: SocketAddr,
    pub(crate) verbose: bool,
    /// `None`: tokio's default.
    pub(crate) worker_threads: Option<NonZeroUsize>,
    pub(crate) config: Config,
}

/// Reads the arguments after the program's name. Each must be UTF-8 text: one that is not is
/// an error that names it, where `std::env::args` would panic on it.
pub(crate) fn parse<I>(args: I) -> Result<Command, String>
where
    I: IntoIterator,
    I::Item: Into<OsString>,
{
    let mut text = Vec::new();
    for (n, arg) in args.into_iter().enumerate() {
        match arg.into().into_string() {
            Ok(arg) => text.push(arg),
            Err(arg) => {
                return Err(format!(
                    "argument {} ({arg:?}) is not UTF-8: every argument is text",
                    n + 1
                ))
            }
        }
    }
    let mut args = text.into_iter();
    let mut listen: SocketAddr = ([127, 0, 0, 1], 8080).into();
    let mut verbose = false;
    let mut worker_threads = None;
    let mut backends = Vec::new();
    let mut config = Config::new(Vec::new());
    let mut overflow = "wait".to_string();
    let mut max_wait = Duration::from_secs(60);
    let mut max_queued = 1024;
    // The options of one value given so far: a second would silently replace the first.
    let mut given: Vec<String> = Vec::new();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg, None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        let switch = matches!(
            flag.as_str(),
            "--help"
                | "--verbose"
                | "--no-slots-probe"
                | "--ask-stream-usage"
                | "--no-decision-headers"
                | "--no-resend-on-close"
        );
        if let (true, Some(v)) = (switch, &inline) {
            // `--ask-stream-usage=false` would otherwise turn it on.
            return Err(format!(
                "{flag}={v}: {flag} takes no value (leave it out to turn it off)"
            ));
        }
        let repeatable = matches!(
            flag.as_str(),
            "--backend" | "--backend-dns" | "--dns-server" | "--probe-header"
        );
        if !switch && !repeatable && flag.starts_with("--") {
            if given.contains(&flag) {
                return Err(format!(
                    "{flag} is given twice: it takes one value, and the second would replace the first"
                ));
            }
            given.push(flag.clone());
        }
        match flag.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "-v" | "--verbose" => verbose = true,
            "--no-slots-probe" => config.probe_slots = false,
            "--ask-stream-usage" => config.ask_stream_usage = true,
            "--no-decision-headers" => config.decision_headers = false,
            "--no-resend-on-close" => config.resend_on_close = false,
            "--listen" => {
                let v = value()?;
                listen = v
                    .parse()
                    .map_err(|e| format!("--listen {v:?}: {e} (expected IP:PORT)"))?;
            }
            "--backend" => {
                let (spec, cache) = backend(&value()?)?;
                if let Some(tokens) = cache {
                    config.cache_tokens.insert(spec.id.clone(), tokens);
                }
                backends.push(spec);
            }
            "--backend-dns" => {
                let v = value()?;
                let bad = |why: &str| {
                    format!(
                        "--backend-dns {v:?}: {why} (expected NAME:PORT[,slots=N][,cache=TOKENS][,context=TOKENS][,request-context=TOKENS][,model=NAME][,assign-slots])"
                    )
                };
                let mut parts = v.split(',');
                let name = parts.next().unwrap_or_default();
                let (mut model, mut context, mut request_context) = (None, None, None);
                let (mut slots, mut cache_tokens) = (None, None);
                let mut assign_slots = false;
                let mut given: Vec<&str> = Vec::new();
                for option in parts {
                    if option == "assign-slots" {
                        if assign_slots {
                            return Err(bad("assign-slots is given twice"));
                        }
                        assign_slots = true;
                        continue;
                    }
                    if let Some((name, _)) = option.split_once('=') {
                        if given.contains(&name) {
                            return Err(bad(&format!("{name}= is given twice")));
                        }
                        given.push(name);
                    }
                    match option.split_once('=') {
                        Some(("model", m)) => model = Some(model_name(m).map_err(|why| bad(&why))?),
                        Some(("slots", n)) => slots = Some(slot_count(n).map_err(|why| bad(&why))?),
                        Some(("cache", n)) => {
                            cache_tokens = Some(tokens("cache", n).map_err(|why| bad(&why))?)
                        }
                        Some((name @ ("context" | "request-context"), n)) => {
                            let n = tokens(name, n).map_err(|why| bad(&why))?;
                            let n = NonZeroU64::new(n);
                            match name {
                                "context" => context = n,
                                _ => request_context = n,
                            }
                        }
                        _ => return Err(bad(&format!("unknown option {option:?}"))),
                    }
                }
                let target = name.parse::<DnsTarget>().map_err(|e| bad(&e.to_string()))?;
                if config
                    .backend_dns
                    .iter()
                    .any(|d| d.target == target && d.model == model)
                {
                    return Err(bad("given twice for the same model"));
                }
                config.backend_dns.push(DnsSpec {
                    target,
                    slots,
                    cache_tokens,
                    model,
                    context,
                    request_context,
                    assign_slots,
                });
            }
            "--dns-server" => {
                let v = value()?;
                let addr = v
                    .parse::<SocketAddr>()
                    .map_err(|e| format!("--dns-server {v:?}: {e} (expected IP:PORT)"))?;
                config.dns_servers.push(addr);
            }
            "--dns-removal-grace" => config.dns_removal_grace = duration(&flag, &value()?)?,
            "--redis" => {
                let url = value()?;
                // Read here, without connecting, so that a URL the store cannot use is a
                // command-line error; shown without its password.
                refuse_redis_tls(&url)?;
                if let Err(e) = redis::IntoConnectionInfo::into_connection_info(url.as_str()) {
                    return Err(format!("--redis {:?}: {e}", redis_url_shown(&url)));
                }
                config.redis = Some(url);
            }
            "--redis-timeout" => {
                config.redis_timeout = duration(&flag, &value()?)?;
                if config.redis_timeout.is_zero() {
                    return Err(
                        "--redis-timeout must be more than 0: a read that may not wait gets no answer, and the store would be down for good".into(),
                    );
                }
            }
            "--replicas" => {
                let v = value()?;
                config.replicas = v.parse().map_err(|_| {
                    format!(
                        "--replicas {v:?}: expected a number of instances, at least 1 and at most {}",
                        u32::MAX
                    )
                })?;
            }
            "--policy" => {
                let v = value()?;
                config.policy = Policy::NAMES
                    .iter()
                    .find(|(n, _)| *n == v)
                    .map(|(_, p)| *p)
                    .ok_or_else(|| format!("--policy {v:?}: expected one of {}", names()))?;
            }
            "--live-window" => config.live_window = duration(&flag, &value()?)?,
            "--overflow" => overflow = value()?,
            "--max-wait" => max_wait = duration(&flag, &value()?)?,
            "--max-queued" => {
                let v = value()?;
                max_queued = v.parse().map_err(|_| {
                    format!(
                        "--max-queued {v:?}: expected a number of requests, 0 or more and at most {}",
                        usize::MAX
                    )
                })?;
            }
            "--connect-timeout" => {
                let d = duration(&flag, &value()?)?;
                config.connect_timeout = (!d.is_zero()).then_some(d);
            }
            "--response-timeout" => {
                let d = duration(&flag, &value()?)?;
                config.response_timeout = (!d.is_zero()).then_some(d);
            }
            "--body-idle-timeout" => {
                let d = duration(&flag, &value()?)?;
                config.body_idle_timeout = (!d.is_zero()).then_some(d);
            }
            "--tcp-keepalive" => config.tcp_keepalive = tcp_keepalive(&flag, &value()?)?,
            "--client-tcp-keepalive" => {
                config.client_tcp_keepalive = tcp_keepalive(&flag, &value()?)?
            }
            "--failure-cooldown" => config.failure_cooldown = duration(&flag, &value()?)?,
            "--probe-interval" => {
                let d = duration(&flag, &value()?)?;
                config.probe_interval = (!d.is_zero()).then_some(d);
            }
            "--probe-timeout" => {
                config.probe_timeout = duration(&flag, &value()?)?;
                if config.probe_timeout.is_zero() {
                    return Err(
                        "--probe-timeout must be more than 0: a probe that may not wait gets no answer (--probe-interval 0 turns probing off)".into(),
                    );
                }
            }
            "--probe-header" => {
                let (name, value) = probe_header(&value()?)?;
                if config.probe_headers.iter().any(|(n, _)| *n == name) {
                    return Err(format!("--probe-header {:?}: given twice", name.as_str()));
                }
                config.probe_headers.push((name, value));
            }
            "--probe-failures" => config.probe_failures = count(&flag, &value()?)?,
            "--probe-successes" => config.probe_successes = count(&flag, &value()?)?,
            "--body-limit" => {
                config.body_limit = size(&flag, &value()?)?;
                if config.body_limit == 0 {
                    return Err(
                        "--body-limit must be more than 0: every request with a body would be 413"
                            .into(),
                    );
                }
            }
            "--read-timeout" => {
                let d = duration(&flag, &value()?)?;
                config.read_timeout = (!d.is_zero()).then_some(d);
            }
            "--header-timeout" => {
                let d = duration(&flag, &value()?)?;
                config.header_timeout = (!d.is_zero()).then_some(d);
            }
            "--upstream" => {
                config.upstream = match value()?.as_str() {
                    "pooled" => UpstreamMode::Pooled,
                    "per-client" => UpstreamMode::PerClient,
                    v => return Err(format!("--upstream {v:?}: expected pooled or per-client")),
                }
            }
            "--worker-threads" => {
                let v = value()?;
                worker_threads = Some(thread_count(&v).ok_or_else(|| {
                    format!("--worker-threads {v:?}: expected a number of threads, at least 1 and at most {MOST_WORKER_THREADS}")
                })?);
            }
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    if backends.is_empty() && config.backend_dns.is_empty() {
        return Err(
            "at least one --backend NODE=URL or --backend-dns NAME:PORT is needed (see --help)"
                .into(),
        );
    }
    config.overflow = match overflow.as_str() {
        "wait" => Overflow::wait(max_wait, max_queued),
        "overcommit" => Overflow::Overcommit,
        "reject" => Overflow::Reject,
        v => {
            return Err(format!(
                "--overflow {v:?}: expected wait, overcommit or reject"
            ))
        }
    };
    one_id_each(&backends).map_err(|e| format!("--backend: {e}"))?;
    // An option that another turns off would be ignored without a word.
    let alone = |flag: &str, needs: &str| {
        format!("{flag} is given without {needs}, and would do nothing: give {needs}, or leave {flag} out")
    };
    for flag in ["--max-wait", "--max-queued"] {
        if overflow != "wait" && given.iter().any(|g| g == flag) {
            return Err(alone(flag, "--overflow wait"));
        }
    }
    if config.redis.is_none() && given.iter().any(|g| g == "--redis-timeout") {
        return Err(alone("--redis-timeout", "--redis"));
    }
    if config.backend_dns.is_empty() {
        if !config.dns_servers.is_empty() {
            return Err(alone("--dns-server", "--backend-dns"));
        }
        if given.iter().any(|g| g == "--dns-removal-grace") {
            return Err(alone("--dns-removal-grace", "--backend-dns"));
        }
    }
    if !matches!(config.policy, Policy::NodeThenBackend)
        && given.iter().any(|g| g == "--live-window")
    {
        return Err(alone("--live-window", "--policy node-then-backend"));
    }
    refuse_own_address(&backends, listen, listen, false)?;
    config.backends = backends;
    Ok(Command::Run(Box::new(Args {
        listen,
        verbose,
        worker_threads,
        config,
    })))
}

fn names() -> String {
    let names: Vec<_> = Policy::NAMES.iter().map(|(n, _)| *n).collect();
    names.join(", ")
}

/// `NODE=URL[,slots=N][,id=NAME][,cache=TOKENS][,context=TOKENS][,request-context=TOKENS][,model=NAME][,assign-slots]`: the backend, and its `cache=`
/// in tokens if given.
pub(crate) fn backend(spec: &str) -> Result<(BackendSpec, Option<u64>), String> {
    let bad = |why: &str| {
        format!("--backend {spec:?}: {why} (expected NODE=URL[,slots=N][,id=NAME][,cache=TOKENS][,context=TOKENS][,request-context=TOKENS][,model=NAME][,assign-slots])")
    };
    let (node, rest) = spec.split_once('=').ok_or_else(|| bad("no NODE="))?;
    if node.is_empty() {
        return Err(bad("empty NODE"));
    }
    if node.trim() != node {
        // `gpu-a ` and `gpu-a` would be two nodes, and spills between them cross nodes.
        return Err(bad(&format!(
            "NODE {node:?} has spaces around it, which would make it another node than the \
             same name without them"
        )));
    }
    let mut parts = rest.split(',');
    let url = parts.next().unwrap_or_default();
    let uri: Uri = url.parse().map_err(|e| bad(&format!("URL: {e}")))?;
    let scheme = uri
        .scheme()
        .cloned()
        .ok_or_else(|| bad("URL needs http://"))?;
    if scheme != Scheme::HTTP {
        return Err(bad("only http:// backends are supported"));
    }
    let authority = uri
        .authority()
        .filter(|a| !a.host().is_empty())
        .cloned()
        .ok_or_else(|| bad("URL has no host"))?;
    if authority.as_str().contains('@') {
        // Refused here, before anything logs the URL with its password.
        return Err(bad(
            "user info (user:password@) is not supported in a backend URL",
        ));
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(bad(
            "URL must be scheme://host:port only: paths are forwarded as sent",
        ));
    }
    let mut slots = None;
    let mut id = default_id(&authority).map_err(|why| bad(&why))?;
    let mut cache = None;
    let mut context = None;
    let mut request_context = None;
    let mut model = None;
    let mut assign_slots = false;
    let mut given: Vec<&str> = Vec::new();
    for option in parts {
        if option == "assign-slots" {
            if assign_slots {
                return Err(bad("assign-slots is given twice"));
            }
            assign_slots = true;
            continue;
        }
        if let Some((name, _)) = option.split_once('=') {
            if given.contains(&name) {
                return Err(bad(&format!("{name}= is given twice")));
            }
            given.push(name);
        }
        match option.split_once('=') {
            Some(("slots", n)) => slots = Some(slot_count(n).map_err(|why| bad(&why))?),
            Some(("id", name)) => id = id_name(name).map_err(|why| bad(&why))?,
            Some(("cache", n)) => cache = Some(tokens("cache", n).map_err(|why| bad(&why))?),
            Some(("context", n)) => {
                let n = tokens("context", n).map_err(|why| bad(&why))?;
                context = NonZeroU64::new(n);
            }
            Some(("request-context", n)) => {
                let n = tokens("request-context", n).map_err(|why| bad(&why))?;
                request_context = NonZeroU64::new(n);
            }
            Some(("model", name)) => model = Some(model_name(name).map_err(|why| bad(&why))?),
            _ => return Err(bad(&format!("unknown option {option:?}"))),
        }
    }
    let spec = BackendSpec {
        id,
        node: node.to_string(),
        scheme,
        authority,
        slots,
        context,
        request_context,
        model,
        assign_slots,
    };
    Ok((spec, cache))
}

/// A backend's id unless given `id=`: its URL's `host:port`, written one way for each server,
/// so that one server given twice is refused as such and an address that a `--backend-dns`
/// name resolves to is that name's backend: the port 80 when the URL leaves it out (`http://x`
/// is `http://x:80`), a host name in lower case (as DNS compares names), an IP address as
/// `DnsEndpoint::id` writes it (`[fd00::7]:8080`).
fn default_id(authority: &Authority) -> Result<String, String> {
    let host = authority.host();
    // `:99999` parses, but reads as no port; `:0` reaches no server. Refused here, with the
    // other command-line errors, rather than by the client once the proxy has started.
    let port_given = authority.as_str().len() > host.len();
    let port = match authority.port_u16() {
        Some(port) if port > 0 => port,
        None if !port_given => 80,
        // `http://gpu-a:`, as `http://gpu-a:$PORT` reads with the variable unset: port 80
        // would be a guess.
        None if authority.as_str().ends_with(':') => {
            return Err(
                "the URL's port is empty (an unset variable?): give it, or leave out the colon for port 80"
                    .into(),
            )
        }
        _ => return Err("the URL's port must be a number from 1 to 65535".into()),
    };
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    Ok(match bare.parse::<IpAddr>() {
        Ok(ip) => SocketAddr::new(ip, port).to_string(),
        Err(_) => format!("{}:{port}", host.to_ascii_lowercase()),
    })
}

/// Refuses a backend whose URL reaches the proxy's own listening socket, bound to `listen`
/// (`--listen` is `given`; see [`is_listen`]): the proxy would send each request to itself.
fn refuse_own_address(
    backends: &[BackendSpec],
    listen: SocketAddr,
    given: SocketAddr,
    dual_stack: bool,
) -> Result<(), String> {
    match (backends.iter()).find(|b| is_listen(&b.authority, listen, dual_stack)) {
        Some(b) => Err(format!(
            "--backend {}={}://{}: the proxy listens there (--listen {given}) and would send each request to itself; give --listen another address",
            b.node, b.scheme, b.authority
        )),
        None => Ok(()),
    }
}

/// Refuses a backend whose URL reaches `listener`, the socket bound to `--listen` (`given`),
/// once it is bound: [`parse`] refuses what the address alone says, and only the socket says
/// whether one on `[::]` takes IPv4 connections too (a dual-stack socket, the default on Linux
/// and macOS), so that a backend on IPv4 loopback at its port is the proxy itself.
pub(crate) fn refuse_own_listener(
    listener: &tokio::net::TcpListener,
    given: SocketAddr,
    backends: &[BackendSpec],
) -> Result<(), String> {
    let listen = listener
        .local_addr()
        .map_err(|e| format!("--listen {given}: {e}"))?;
    let dual_stack = listen.is_ipv6()
        && listen.ip().is_unspecified()
        && socket2::SockRef::from(listener)
            .only_v6()
            .is_ok_and(|only| !only);
    refuse_own_address(backends, listen, given, dual_stack)
}

/// Whether a backend's URL (`authority`) reaches the proxy's own listening socket, `listen`:
/// the same port on the same IP address, on a loopback address or `localhost` when the proxy
/// listens on every address of that family (and on an IPv4 one too when `dual_stack`, a socket
/// on `[::]` that takes IPv4 connections), or on `localhost` when it listens on loopback. An
/// IPv4 address may be written as IPv6, as `[::ffff:127.0.0.1]`.
fn is_listen(authority: &Authority, listen: SocketAddr, dual_stack: bool) -> bool {
    if authority.port_u16().unwrap_or(80) != listen.port() {
        return false;
    }
    let host = authority.host();
    let bare = (host.strip_prefix('[').and_then(|h| h.strip_suffix(']'))).unwrap_or(host);
    let own = listen.ip();
    // An IPv4 address written as IPv6 (`[::ffff:127.0.0.1]`) is reached over IPv4, at that
    // IPv4 address.
    match bare.parse::<IpAddr>().map(|ip| ip.to_canonical()) {
        Ok(ip) => {
            ip == own
                || (own.is_unspecified()
                    && (own.is_ipv4() == ip.is_ipv4() || (dual_stack && ip.is_ipv4()))
                    && (ip.is_loopback() || ip.is_unspecified()))
        }
        Err(_) => {
            bare.eq_ignore_ascii_case("localhost") && (own.is_loopback() || own.is_unspecified())
        }
    }
}

/// An `id=` name: what headers and metrics call the backend, so neither empty (which read
/// as an unknown option) nor with spaces around it, which its `x-affinity-backend` header
/// would lose and its metrics' labels keep.
fn id_name(name: &str) -> Result<String, String> {
    if name.is_empty() {
        Err("id= needs a name (left out, the URL's host:port)".into())
    } else if name.trim() != name {
        Err(format!(
            "id={name:?} has spaces around it, which its x-affinity-backend header would lose"
        ))
    } else {
        Ok(name.to_string())
    }
}

/// A `model=` name: what a request body's `model` must be to go to its fleet, so neither empty
/// nor with spaces around it, which no body would match.
fn model_name(name: &str) -> Result<String, String> {
    if name.is_empty() {
        Err("model= needs the name requests give in their body's \"model\"".into())
    } else if name.trim() != name {
        Err(format!(
            "model={name:?} has spaces around it, which no request's model would match"
        ))
    } else {
        Ok(name.to_string())
    }
}

/// A `slots=` count: at least 1.
fn slot_count(n: &str) -> Result<NonZeroU32, String> {
    let n: u32 = n
        .parse()
        .map_err(|_| format!("slots must be a number from 1 to {}", u32::MAX))?;
    NonZeroU32::new(n).ok_or_else(|| "slots must be at least 1".into())
}

/// A count of tokens for the option `name`: `131072`, or with `k`/`K` for 1024, `128k`. At
/// least 1.
pub(crate) fn tokens(name: &str, v: &str) -> Result<u64, String> {
    let bad = || {
        format!(
            "{name}={v:?} must be a number of tokens such as 65536 or 64k, at most {}",
            u64::MAX
        )
    };
    let (number, scale) = match v.strip_suffix(['k', 'K']) {
        Some(number) => (number, 1024),
        None => (v, 1),
    };
    let n: u64 = number.parse().map_err(|_| bad())?;
    let n = n.checked_mul(scale).ok_or_else(bad)?;
    if n == 0 {
        return Err(format!("{name} must be at least 1 token"));
    }
    Ok(n)
}

/// The most worker threads the runtime is given. Tokio starts every worker thread when the
/// runtime is built; a count far past the CPUs (`80000` for `8`) ran out of memory or threads
/// there and panicked, or left the proxy hung.
pub(crate) const MOST_WORKER_THREADS: usize = 1024;

/// A count of worker threads, from 1 to [`MOST_WORKER_THREADS`].
fn thread_count(v: &str) -> Option<NonZeroUsize> {
    v.parse()
        .ok()
        .filter(|n: &NonZeroUsize| n.get() <= MOST_WORKER_THREADS)
}

/// The runtime's worker threads: `--worker-threads` if given, else `TOKIO_WORKER_THREADS`
/// (`env`) if set, else `None`, tokio's default. The variable is read here, not by tokio,
/// which panics on a value that is not a count of at least 1, and both are held to
/// [`MOST_WORKER_THREADS`].
pub(crate) fn worker_threads(
    given: Option<NonZeroUsize>,
    env: Option<&std::ffi::OsStr>,
) -> Result<Option<NonZeroUsize>, String> {
    match (given, env) {
        (Some(n), _) => Ok(Some(n)),
        (None, None) => Ok(None),
        (None, Some(v)) => (v.to_str())
            .and_then(thread_count)
            .map(Some)
            .ok_or_else(|| {
                format!(
                    "TOKIO_WORKER_THREADS={v:?}: expected a number of threads, at least 1 and at most {MOST_WORKER_THREADS} (or --worker-threads N)"
                )
            }),
    }
}

/// `--probe-header 'NAME: VALUE'`: the header, its value marked sensitive. No error shows
/// the value, which is a key as a rule.
pub(crate) fn probe_header(v: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (name, value) = v.split_once(':').ok_or_else(|| {
        "--probe-header: expected NAME: VALUE, such as 'Authorization: Bearer KEY'".to_string()
    })?;
    let name = HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| {
        format!(
            "--probe-header {:?}: not a header name (expected NAME: VALUE, such as 'Authorization: Bearer KEY')",
            name.trim()
        )
    })?;
    let value = value.trim();
    let bad = |why: &str| format!("--probe-header {:?}: {why}", name.as_str());
    if value.is_empty() {
        return Err(bad("the value is empty"));
    }
    if name == http::header::AUTHORIZATION && value.eq_ignore_ascii_case("bearer") {
        // `Bearer $KEY` with the variable unset.
        return Err(bad("Bearer with no key after it (an unset variable?)"));
    }
    let mut value = HeaderValue::from_str(value)
        .map_err(|_| bad("the value may hold only visible ASCII characters, spaces and tabs"))?;
    value.set_sensitive(true);
    Ok((name, value))
}

/// A count of at least 1.
pub(crate) fn count(flag: &str, v: &str) -> Result<u32, String> {
    v.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
        format!(
            "{flag} {v:?}: expected a number, at least 1 and at most {}",
            u32::MAX
        )
    })
}

/// `500ms`, `2s`, `1.5m`, `1h`, or plain seconds.
pub(crate) fn duration(flag: &str, v: &str) -> Result<Duration, String> {
    let bad = || format!("{flag} {v:?}: expected a duration such as 500ms, 2s, 1.5m");
    let split = v.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(v.len());
    let (number, unit) = v.split_at(split);
    let number: f64 = number.trim().parse().map_err(|_| bad())?;
    let scale = match unit {
        "ms" => 0.001,
        "" | "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => return Err(bad()),
    };
    let d = Duration::try_from_secs_f64(number * scale).map_err(|_| {
        if number < 0.0 {
            format!("{flag} {v:?}: a duration cannot be negative")
        } else {
            format!("{flag} {v:?}: too long, at most {}s", u64::MAX)
        }
    })?;
    // Below a millisecond a timeout or interval means nothing here (the balancer counts in
    // milliseconds), and one that rounds to 0 would turn its option off.
    if number != 0.0 && d < Duration::from_millis(1) {
        return Err(format!(
            "{flag} {v:?}: at least 1ms, or 0 where 0 turns the option off"
        ));
    }
    Ok(d)
}

/// `--tcp-keepalive` and `--client-tcp-keepalive` (`flag`): a duration in whole seconds, the
/// system's unit, from 1 s to 32767 s, the most Linux takes (`TCP_KEEPIDLE`; past it the
/// system would keep its own two hours); `0` turns keepalive off.
pub(crate) fn tcp_keepalive(flag: &str, v: &str) -> Result<Option<Duration>, String> {
    const MOST: Duration = Duration::from_secs(32767);
    let d = duration(flag, v)?;
    if d.is_zero() {
        return Ok(None);
    }
    if d.subsec_nanos() != 0 || d > MOST {
        return Err(format!(
            "{flag} {v:?}: whole seconds from 1s to 32767s (the system counts keepalive in seconds, up to that), or 0 to turn it off"
        ));
    }
    Ok(Some(d))
}

/// Bytes, or with `KiB`, `MiB`, `GiB`.
pub(crate) fn size(flag: &str, v: &str) -> Result<usize, String> {
    let bad = || {
        format!(
            "{flag} {v:?}: expected a size such as 1048576, 512KiB, 16MiB, at most {} bytes",
            usize::MAX
        )
    };
    let split = v.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(v.len());
    let (number, unit) = v.split_at(split);
    let number: usize = number.trim().parse().map_err(|_| bad())?;
    let shift = match unit {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        _ => return Err(bad()),
    };
    number.checked_mul(1 << shift).ok_or_else(bad)
}
