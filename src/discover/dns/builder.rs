//! [`DnsFleetBuilder`]: the resolver, the schedule, and how backends are made.

use std::convert::Infallible;
use std::fmt;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::config::{
    ConnectionConfig, LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig,
};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::system_conf::read_system_conf;
use hickory_resolver::TokioResolver;

use super::endpoint::DnsEndpoint;
use super::error::{DnsError, DnsErrorKind};
use super::fleet::DnsFleet;
use super::resolve::{nameservers, search_domains, Resolver};
use super::target::DnsTarget;
use super::task::{Make, NodeOf, Schedule};
use crate::{Backend, BoxError, NodeId};

/// Which address records a host target (and each SRV target) resolves to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IpStrategy {
    /// A records; AAAA only if there are none. The default: a dual-stack host is one backend.
    #[default]
    Ipv4ThenIpv6,
    /// AAAA records; A only if there are none.
    Ipv6ThenIpv4,
    /// A records only.
    Ipv4Only,
    /// AAAA records only.
    Ipv6Only,
    /// Both: a host with an A and an AAAA record is two backends.
    Ipv4AndIpv6,
}

impl IpStrategy {
    fn hickory(self) -> LookupIpStrategy {
        match self {
            IpStrategy::Ipv4ThenIpv6 => LookupIpStrategy::Ipv4thenIpv6,
            IpStrategy::Ipv6ThenIpv4 => LookupIpStrategy::Ipv6thenIpv4,
            IpStrategy::Ipv4Only => LookupIpStrategy::Ipv4Only,
            IpStrategy::Ipv6Only => LookupIpStrategy::Ipv6Only,
            IpStrategy::Ipv4AndIpv6 => LookupIpStrategy::Ipv4AndIpv6,
        }
    }
}

/// Configures a [`DnsFleet`]; made by [`DnsFleet::builder`].
///
/// ```no_run
/// use std::net::SocketAddr;
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use tower_affinity::discover::dns::{DnsEndpoint, DnsFleet};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let fleet = DnsFleet::builder("_llm._tcp.llm.service.consul".parse()?)
///     .nameserver("127.0.0.1:8600".parse::<SocketAddr>()?) // Consul's DNS, not the system's
///     .min_interval(Duration::from_secs(2))
///     .max_interval(Duration::from_secs(30))
///     .node(|ep: &DnsEndpoint| ep.srv_host().unwrap_or("unknown").to_string())
///     .slots(NonZeroU32::new(4).unwrap())
///     .build(|ep: &DnsEndpoint| ep.authority())?;
/// # let _ = fleet;
/// # Ok(())
/// # }
/// ```
pub struct DnsFleetBuilder {
    target: DnsTarget,
    nameservers: Vec<SocketAddr>,
    schedule: Schedule,
    ip_strategy: IpStrategy,
    timeout: Option<Duration>,
    attempts: Option<usize>,
    node: NodeOf,
    slots: Option<NonZeroU32>,
    cache_tokens: u64,
    context: Option<NonZeroU64>,
    request_context: Option<NonZeroU64>,
    assign_slots: bool,
    extensions: http::Extensions,
}

impl DnsFleetBuilder {
    /// The floor under the TTL when none is set: 5 s.
    pub const DEFAULT_MIN_INTERVAL: Duration = Duration::from_secs(5);
    /// The ceiling over the TTL when none is set: 60 s.
    pub const DEFAULT_MAX_INTERVAL: Duration = Duration::from_secs(60);
    /// The wait after a failed resolution when none is set: 5 s.
    pub const DEFAULT_RETRY_INTERVAL: Duration = Duration::from_secs(5);
    /// How long an address left out of the answers stays when none is set: not at all.
    pub const DEFAULT_REMOVAL_GRACE: Duration = Duration::ZERO;

    pub(crate) fn new(target: DnsTarget) -> Self {
        DnsFleetBuilder {
            target,
            nameservers: Vec::new(),
            schedule: Schedule {
                min: Self::DEFAULT_MIN_INTERVAL,
                max: Self::DEFAULT_MAX_INTERVAL,
                retry: Self::DEFAULT_RETRY_INTERVAL,
                grace: Self::DEFAULT_REMOVAL_GRACE,
            },
            ip_strategy: IpStrategy::default(),
            timeout: None,
            attempts: None,
            node: Arc::new(|ep: &DnsEndpoint| NodeId::from(ep.ip().to_string())),
            slots: None,
            cache_tokens: Backend::<()>::DEFAULT_CACHE_TOKENS,
            context: None,
            request_context: None,
            assign_slots: false,
            extensions: http::Extensions::new(),
        }
    }

    /// Asks this nameserver (UDP, and TCP for long answers, on its port) instead of the
    /// system's configuration. Call again to add more. A query goes to two of them at once,
    /// the fastest so far first, and the first answer is taken whatever it says ("no such
    /// name" and a server failure included): give only nameservers that serve the same
    /// names. The others are asked when those fail to answer, within the
    /// [`timeout`](Self::timeout) and [`attempts`](Self::attempts).
    pub fn nameserver(mut self, addr: SocketAddr) -> Self {
        self.nameservers.push(addr);
        self
    }

    /// The shortest wait between resolutions, whatever the TTL says (a TTL of 0, as Consul
    /// gives by default, would otherwise mean resolving without pause). Default
    /// [`DEFAULT_MIN_INTERVAL`](Self::DEFAULT_MIN_INTERVAL).
    pub fn min_interval(mut self, interval: Duration) -> Self {
        self.schedule.min = interval;
        self
    }

    /// The longest wait between resolutions, whatever the TTL says. Default
    /// [`DEFAULT_MAX_INTERVAL`](Self::DEFAULT_MAX_INTERVAL); one under the floor is the floor.
    pub fn max_interval(mut self, interval: Duration) -> Self {
        self.schedule.max = interval;
        self
    }

    /// The wait after a failed resolution. Default
    /// [`DEFAULT_RETRY_INTERVAL`](Self::DEFAULT_RETRY_INTERVAL). It is not held to the
    /// [`min_interval`](Self::min_interval) floor: a wait of zero asks again at once, as
    /// often as the nameservers fail, which a nameserver that refuses at once makes a busy
    /// loop.
    pub fn retry_interval(mut self, interval: Duration) -> Self {
        self.schedule.retry = interval;
        self
    }

    /// How long an address stays in the fleet once answers leave it out, for a server that
    /// answers with a different subset of a large record set each time (round-robin DNS
    /// whose answers are cut short, some Consul setups). Default
    /// [`DEFAULT_REMOVAL_GRACE`](Self::DEFAULT_REMOVAL_GRACE): none, removed at the first
    /// answer that leaves it out.
    ///
    /// An address is removed once it has been missing from every successful answer for at
    /// least `grace`; one that comes back before is kept, and no change is announced at all.
    /// Failed resolutions count neither way. An address waiting out its grace is still in the
    /// fleet, and counts in [`DnsStats::backends`](super::DnsStats::backends). Meanwhile the
    /// next resolution comes when the grace ends, if the TTL says later (but never before
    /// [`min_interval`](Self::min_interval)), so that a long TTL does not put the removal off;
    /// after a failed resolution, the [`retry_interval`](Self::retry_interval) as always.
    ///
    /// The cost: a backend that is really gone stays in the fleet up to `grace` longer. Its
    /// requests fail, and each failure passes it over for the
    /// [failure cooldown](crate::SessionAffinityLayer::failure_cooldown) (see the
    /// [module docs](super)).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_affinity::discover::dns::{DnsEndpoint, DnsFleet};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // Each answer names some of the backends: one missing from answers for 30 s is gone.
    /// let fleet = DnsFleet::builder("llm.fleet.example:8080".parse()?)
    ///     .removal_grace(Duration::from_secs(30))
    ///     .build(|ep: &DnsEndpoint| ep.authority())?;
    /// # let _ = fleet;
    /// # Ok(())
    /// # }
    /// ```
    pub fn removal_grace(mut self, grace: Duration) -> Self {
        self.schedule.grace = grace;
        self
    }

    /// Which address records to use. Default [`IpStrategy::Ipv4ThenIpv6`].
    pub fn ip_strategy(mut self, strategy: IpStrategy) -> Self {
        self.ip_strategy = strategy;
        self
    }

    /// How long one query waits for an answer. Default: the system configuration's, else
    /// the resolver's (5 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// How many times a query is retried before the resolution fails. Default: the system
    /// configuration's, else the resolver's (2).
    pub fn attempts(mut self, attempts: usize) -> Self {
        self.attempts = Some(attempts);
        self
    }

    /// Names each backend's node. Default: its IP address, so that the backends of one host
    /// (several ports, or several SRV records) share a node.
    ///
    /// Where backends come back under new addresses (pods rescheduled), each address is a
    /// node of its own: the router forgets a node once no backend it knows of (live, or
    /// removed and kept in case it returns) is on it, so churn does not pile nodes up. Name
    /// nodes by something stable, such as the host a pod runs on, for the same-node rule to
    /// mean the same host.
    pub fn node<F, N>(mut self, node: F) -> Self
    where
        F: Fn(&DnsEndpoint) -> N + Send + Sync + 'static,
        N: Into<NodeId>,
    {
        self.node = Arc::new(move |ep: &DnsEndpoint| node(ep).into());
        self
    }

    /// Each backend's slots (see [`Backend::slots`]). Not given (the default), a backend
    /// counts as one slot until something learns its count: a
    /// [`HealthProbe`](crate::health::HealthProbe) reads it from `/slots`.
    pub fn slots(mut self, slots: NonZeroU32) -> Self {
        self.slots = Some(slots);
        self
    }

    /// Each backend's prompt-cache budget in tokens (see [`Backend::cache_tokens`]).
    pub fn cache_tokens(mut self, tokens: u64) -> Self {
        self.cache_tokens = tokens;
        self
    }

    /// The tokens of context each backend's running requests share (see
    /// [`Backend::context_tokens`]). Default: none, only the slots count.
    pub fn context_tokens(mut self, tokens: NonZeroU64) -> Self {
        self.context = Some(tokens);
        self
    }

    /// The most tokens of context one request can take on each backend (see
    /// [`Backend::request_context_tokens`]). Default: none given; a
    /// [health probe](crate::health::HealthProbe) reads it from llama-server's `/slots`.
    pub fn request_context_tokens(mut self, tokens: NonZeroU64) -> Self {
        self.request_context = Some(tokens);
        self
    }

    /// Has the router assign each backend's slots (see [`Backend::assign_slots`]): for
    /// llama-servers. Default: not assigned.
    pub fn assign_slots(mut self) -> Self {
        self.assign_slots = true;
        self
    }

    /// Attaches `value` to each backend of this name (see [`Backend::extension`]): the
    /// tenant or the GPU the name stands for, for a policy of your own to read.
    pub fn extension<T: Clone + Send + Sync + 'static>(mut self, value: T) -> Self {
        self.extensions.insert(value);
        self
    }

    /// Builds the stream; `service` makes each new backend's service from its endpoint.
    ///
    /// Resolution starts at once if called inside a tokio runtime, else when the stream is
    /// first polled, which must be inside one (see [`DnsFleet`]). Fails only if the resolver
    /// cannot be set up (as with no usable system configuration); a name that does not resolve
    /// yet is a failed resolution, retried.
    pub fn build<S, F>(self, service: F) -> Result<DnsFleet<S>, DnsError>
    where
        F: Fn(&DnsEndpoint) -> S + Send + Sync + 'static,
        S: Send + 'static,
    {
        self.try_build(move |ep: &DnsEndpoint| Ok::<_, Infallible>(service(ep)))
    }

    /// As [`build`](Self::build), for a service that can fail to be made (a client whose
    /// configuration is refused): an address whose service fails is left out of the fleet,
    /// logged once, and tried again at each resolution. Where no address of an answer could
    /// be made, the backends it left out stay until one is: the fleet is never emptied by
    /// services that fail.
    pub fn try_build<S, F, E>(self, service: F) -> Result<DnsFleet<S>, DnsError>
    where
        F: Fn(&DnsEndpoint) -> Result<S, E> + Send + Sync + 'static,
        E: Into<BoxError>,
        S: Send + 'static,
    {
        let resolver = self.resolver()?;
        let make = Make {
            service: Arc::new(move |ep: &DnsEndpoint| service(ep).map_err(Into::into)),
            node: self.node,
            slots: self.slots,
            cache_tokens: self.cache_tokens,
            context: self.context,
            request_context: self.request_context,
            assign_slots: self.assign_slots,
            extensions: self.extensions,
        };
        Ok(DnsFleet::start(resolver, self.target, self.schedule, make))
    }

    /// The resolver, which names the nameservers it asks in its errors: those given, else
    /// the system configuration's.
    fn resolver(&self) -> Result<Resolver, DnsError> {
        let config = |e: &dyn fmt::Display| {
            DnsError::new(
                DnsErrorKind::Config,
                format!("setting up the resolver for {}: {e}", self.target),
            )
        };
        let (mut builder, asked, search) = if self.nameservers.is_empty() {
            // As `TokioResolver::builder_tokio` does, with the configuration kept to name
            // its nameservers and to search names under its domains.
            let (system, options) = read_system_conf().map_err(|e| config(&e))?;
            let asked = nameservers(&system);
            let search = search_domains(&system);
            let mut builder =
                TokioResolver::builder_with_config(system, TokioRuntimeProvider::default());
            *builder.options_mut() = options;
            (builder, asked, search)
        } else {
            let servers = self
                .nameservers
                .iter()
                .map(|addr| {
                    let (mut udp, mut tcp) = (ConnectionConfig::udp(), ConnectionConfig::tcp());
                    udp.port = addr.port();
                    tcp.port = addr.port();
                    NameServerConfig::new(addr.ip(), true, vec![udp, tcp])
                })
                .collect();
            let mut builder = TokioResolver::builder_with_config(
                ResolverConfig::from_name_servers(servers),
                TokioRuntimeProvider::default(),
            );
            // The nameserver given is the whole truth: no /etc/hosts.
            builder.options_mut().use_hosts_file = ResolveHosts::Never;
            (builder, self.nameservers.clone(), Vec::new())
        };
        let options = builder.options_mut();
        // Every resolution asks the server; the schedule honours the TTL instead.
        options.cache_size = 0;
        options.ip_strategy = self.ip_strategy.hickory();
        if let Some(timeout) = self.timeout {
            options.timeout = timeout;
        }
        if let Some(attempts) = self.attempts {
            options.attempts = attempts;
        }
        let resolver = builder.build().map_err(|e| config(&e))?;
        Ok(Resolver::new(resolver, &asked, search))
    }
}

impl fmt::Debug for DnsFleetBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DnsFleetBuilder")
            .field("target", &self.target)
            .field("nameservers", &self.nameservers)
            .field("schedule", &self.schedule)
            .field("ip_strategy", &self.ip_strategy)
            .field("timeout", &self.timeout)
            .field("attempts", &self.attempts)
            .field("slots", &self.slots)
            .field("cache_tokens", &self.cache_tokens)
            .field("context", &self.context)
            .field("request_context", &self.request_context)
            .field("assign_slots", &self.assign_slots)
            .finish_non_exhaustive()
    }
}
