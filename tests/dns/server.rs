//! An authoritative DNS server for the zone `fleet.test.` on 127.0.0.1 (UDP and TCP, one
//! port), serving records from memory that a test changes between resolutions.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use hickory_server::net::runtime::Time;
use hickory_server::proto::op::{Header, HeaderCounts, ResponseCode};
use hickory_server::proto::rr::rdata::{A, AAAA, SOA, SRV};
use hickory_server::proto::rr::{LowerName, Name, RData, Record, RecordSet, RecordType, RrKey};
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::store::in_memory::InMemoryZoneHandler;
use hickory_server::zone_handler::{AxfrPolicy, Catalog, MessageResponseBuilder, ZoneType};
use hickory_server::Server;
use parking_lot::Mutex;
use tokio::net::{TcpListener, UdpSocket};

pub(crate) const ZONE: &str = "fleet.test.";

pub(crate) struct Dns {
    pub(crate) addr: SocketAddr,
    zone: Arc<InMemoryZoneHandler>,
    failing: Failing,
    asked: Asked,
    server: Option<Server<Flaky>>,
}

/// The (name, type) queries answered SERVFAIL (`true`) or not at all (`false`) instead of
/// from the zone.
type Failing = Arc<Mutex<Vec<((LowerName, RecordType), bool)>>>;

/// The zone's catalog, but SERVFAIL or no answer for the queries in `failing`: a server that
/// fails one record type of a name and answers the others, as an overloaded or broken
/// upstream does.
struct Flaky {
    catalog: Catalog,
    failing: Failing,
    asked: Asked,
}

/// The (name, type) of each query received, in order.
type Asked = Arc<Mutex<Vec<(LowerName, RecordType)>>>;

// `RequestHandler` is an `async_trait`: its method spelled out, without the macro.
impl RequestHandler for Flaky {
    fn handle_request<'a, 'b, 'f, R, T>(
        &'a self,
        request: &'b Request,
        mut response_handle: R,
    ) -> Pin<Box<dyn Future<Output = ResponseInfo> + Send + 'f>>
    where
        R: ResponseHandler + 'f,
        T: Time + 'f,
        'a: 'f,
        'b: 'f,
        Self: 'f,
    {
        Box::pin(async move {
            let fails = request.request_info().ok().and_then(|info| {
                let key = (info.query.name().clone(), info.query.query_type());
                self.asked.lock().push(key.clone());
                let failing = self.failing.lock();
                failing
                    .iter()
                    .find(|(k, _)| *k == key)
                    .map(|(_, servfail)| *servfail)
            });
            match fails {
                None => {
                    return self
                        .catalog
                        .handle_request::<R, T>(request, response_handle)
                        .await
                }
                // No answer: the query times out.
                Some(false) => {
                    return ResponseInfo::from(Header {
                        metadata: request.metadata,
                        counts: HeaderCounts::default(),
                    })
                }
                Some(true) => {}
            }
            let response = MessageResponseBuilder::new(&request.queries, None)
                .error_msg(&request.metadata, ResponseCode::ServFail);
            response_handle
                .send_response(response)
                .await
                .expect("a SERVFAIL sent")
        })
    }
}

impl Dns {
    /// Starts a server with an empty zone on a free port.
    pub(crate) async fn start() -> Dns {
        let origin = name(ZONE);
        let mut zone =
            InMemoryZoneHandler::empty(origin.clone(), ZoneType::Primary, AxfrPolicy::Deny);
        let soa = SOA::new(
            name("ns.fleet.test."),
            name("admin.fleet.test."),
            1,
            3600,
            600,
            86_400,
            5,
        );
        assert!(zone.upsert_mut(Record::from_rdata(origin, 3600, RData::SOA(soa)), 1));
        let zone = Arc::new(zone);
        // UDP on a free port, TCP on the same one: a resolver asks both at one address.
        for _ in 0..20 {
            let udp = UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let addr = udp.local_addr().unwrap();
            let Ok(tcp) = TcpListener::bind(addr).await else {
                continue;
            };
            let mut dns = Dns {
                addr,
                zone,
                failing: Failing::default(),
                asked: Asked::default(),
                server: None,
            };
            dns.serve(udp, tcp);
            return dns;
        }
        panic!("no free port for both UDP and TCP on 127.0.0.1");
    }

    fn serve(&mut self, udp: UdpSocket, tcp: TcpListener) {
        let mut catalog = Catalog::new();
        catalog.upsert(LowerName::from(name(ZONE)), vec![self.zone.clone()]);
        let mut server = Server::new(Flaky {
            catalog,
            failing: self.failing.clone(),
            asked: self.asked.clone(),
        });
        server.register_socket(udp);
        server.register_listener(tcp, Duration::from_secs(5), 1024);
        self.server = Some(server);
    }

    /// Stops answering: the port is closed, queries go unanswered.
    pub(crate) async fn stop(&mut self) {
        if let Some(mut server) = self.server.take() {
            server.shutdown_gracefully().await.unwrap();
        }
    }

    /// Answers again, on the same port, from the same zone.
    pub(crate) async fn restart(&mut self) {
        self.stop().await;
        let udp = UdpSocket::bind(self.addr).await.unwrap();
        let tcp = TcpListener::bind(self.addr).await.unwrap();
        self.serve(udp, tcp);
    }

    /// Replaces `owner`'s records of `rtype` with `data` (none: removes them).
    pub(crate) async fn set(&self, owner: &str, rtype: RecordType, ttl: u32, data: Vec<RData>) {
        let owner = name(owner);
        let key = RrKey::new(LowerName::from(owner.clone()), rtype);
        let mut records = self.zone.records_mut().await;
        records.remove(&key);
        if data.is_empty() {
            return;
        }
        let mut set = RecordSet::with_ttl(owner, rtype, ttl);
        for d in data {
            set.add_rdata(d);
        }
        records.insert(key, Arc::new(set));
    }

    /// Answers queries for `owner`'s records of `rtype` with SERVFAIL (`fail`), or from the
    /// zone again.
    pub(crate) fn servfail(&self, owner: &str, rtype: RecordType, fail: bool) {
        self.fail(owner, rtype, fail.then_some(true));
    }

    /// Leaves queries for `owner`'s records of `rtype` unanswered, so that they time out
    /// (`silent`), or answers them from the zone again.
    pub(crate) fn silent(&self, owner: &str, rtype: RecordType, silent: bool) {
        self.fail(owner, rtype, silent.then_some(false));
    }

    fn fail(&self, owner: &str, rtype: RecordType, servfail: Option<bool>) {
        let key = (LowerName::from(name(owner)), rtype);
        let mut failing = self.failing.lock();
        failing.retain(|(k, _)| *k != key);
        if let Some(servfail) = servfail {
            failing.push((key, servfail));
        }
    }

    /// The name and type of each query received so far, in order.
    pub(crate) fn asked(&self) -> Vec<(String, RecordType)> {
        let asked = self.asked.lock();
        asked.iter().map(|(n, t)| (n.to_string(), *t)).collect()
    }

    /// `owner`'s A or AAAA records, by the addresses' family.
    pub(crate) async fn set_ips(&self, owner: &str, ttl: u32, ips: &[&str]) {
        let ips: Vec<IpAddr> = ips.iter().map(|ip| ip.parse().unwrap()).collect();
        let v4 = ips.iter().filter_map(|ip| match ip {
            IpAddr::V4(ip) => Some(RData::A(A(*ip))),
            IpAddr::V6(_) => None,
        });
        let v6 = ips.iter().filter_map(|ip| match ip {
            IpAddr::V6(ip) => Some(RData::AAAA(AAAA(*ip))),
            IpAddr::V4(_) => None,
        });
        self.set(owner, RecordType::A, ttl, v4.collect()).await;
        self.set(owner, RecordType::AAAA, ttl, v6.collect()).await;
    }

    /// `owner`'s SRV records: (priority, weight, port, target).
    pub(crate) async fn set_srv(&self, owner: &str, ttl: u32, records: &[(u16, u16, u16, &str)]) {
        let data = records
            .iter()
            .map(|&(priority, weight, port, target)| {
                RData::SRV(SRV::new(priority, weight, port, name(target)))
            })
            .collect();
        self.set(owner, RecordType::SRV, ttl, data).await;
    }
}

fn name(s: &str) -> Name {
    Name::from_ascii(s).unwrap()
}
