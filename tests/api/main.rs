//! The public API's auto traits, checked at compile time: the services, futures, bodies,
//! discovery streams, handles, stores and errors a proxy moves between tasks are `Send` (and
//! `Sync` or `Clone` where axum or tower need it). A change that loses one fails to build.

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use tower_affinity::client::HttpBackend;
use tower_affinity::discover::dns::DnsFleet;
use tower_affinity::discover::{FleetChannel, StaticFleet};
use tower_affinity::key::{BodyKey, HeaderKey};
use tower_affinity::placement::NodeThenBackend;
use tower_affinity::{ErrorToResponse, SessionAffinity};

fn send<T: Send>() {}
fn sync<T: Sync>() {}
fn clone<T: Clone>() {}
fn send_sync<T: Send + Sync>() {}
fn unpin<T: Unpin>() {}
/// What `BoxError` and `?` need of an error.
fn boxable<E: std::error::Error + Send + Sync + 'static>() {}

type Http = HttpBackend<Full<Bytes>>;
type Balancer<D> = SessionAffinity<D, HeaderKey, NodeThenBackend>;
type Future = tower_affinity::ResponseFuture<Http, NodeThenBackend, Full<Bytes>>;
type Probed = tower_affinity::health::Probed<DnsFleet<Http>, Http>;
type Answering = ErrorToResponse<Balancer<StaticFleet<Http>>>;

#[test]
fn the_balancer_its_future_and_its_body_are_send() {
    send_sync::<Balancer<StaticFleet<Http>>>();
    clone::<Balancer<StaticFleet<Http>>>();
    send_sync::<Balancer<FleetChannel<Http>>>();
    clone::<Balancer<FleetChannel<Http>>>();
    send_sync::<Balancer<DnsFleet<Http>>>();
    send_sync::<Balancer<Probed>>();
    send::<Future>();
    send_sync::<tower_affinity::ResponseBody<Incoming>>();
    // What an `HttpBackend` answers with, as hyper's own body is: axum needs it `Send`, and
    // `BodyExt::frame` on it, `Unpin`.
    send_sync::<tower_affinity::ResponseBody<tower_affinity::client::BackendBody>>();
    unpin::<tower_affinity::client::BackendBody>();
}

#[test]
fn the_layers_and_wrappers_are_send_and_clone_as_axum_needs() {
    send_sync::<Answering>();
    clone::<Answering>();
    send::<tower_affinity::ErrorToResponseFuture<Future>>();
    send_sync::<BodyKey<Answering>>();
    clone::<BodyKey<Answering>>();
    send::<tower_affinity::key::BodyKeyFuture<Answering, Incoming>>();
    send::<tower_affinity::key::BodyKeyResponseBody<tower_affinity::ResponseBody<Incoming>>>();
    send_sync::<tower_affinity::RetryOnce>();
    send_sync::<tower_affinity::SessionAffinityLayer>();
    send_sync::<tower_affinity::key::BodyKeyLayer>();
}

#[test]
fn backends_discovery_stores_and_probes_are_send() {
    send_sync::<Http>();
    send::<tower_affinity::client::ResponseFuture>();
    send::<StaticFleet<Http>>();
    send::<FleetChannel<Http>>();
    send::<DnsFleet<Http>>();
    send::<Probed>();
    send_sync::<tower_affinity::discover::FleetHandle<Http>>();
    send_sync::<tower_affinity::discover::dns::DnsHandle>();
    send_sync::<tower_affinity::store::RedisStore>();
    send_sync::<tower_affinity::health::Prober<Http>>();
    sync::<tower_affinity::Stats>();
    send_sync::<tower_affinity::Decision>();
}

#[test]
fn every_error_can_be_boxed() {
    boxable::<tower_affinity::Error>();
    boxable::<tower_affinity::client::HttpBackendError>();
    boxable::<tower_affinity::client::InvalidBackendUrl>();
    boxable::<tower_affinity::discover::dns::DnsError>();
    boxable::<tower_affinity::store::RedisOpenError>();
    boxable::<tower_affinity::key::InvalidHeaderKey>();
}
