//! Mock backends whose answers the test controls.

// Shared by several test crates, each using part of it.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http_body::Frame;
use http_body_util::StreamBody;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tower::util::BoxCloneSyncService;
use tower_affinity::BoxError;

pub(crate) type Chunk = Result<Frame<Bytes>, Infallible>;
pub(crate) type MockBody = StreamBody<UnboundedReceiverStream<Chunk>>;
pub(crate) type Req = http::Request<String>;
pub(crate) type MockService = BoxCloneSyncService<Req, http::Response<MockBody>, BoxError>;

/// An open stream: the backend that opened it and the sender that feeds its body.
pub(crate) type OpenStream = (String, mpsc::UnboundedSender<Chunk>);

/// What a backend does with a request, chosen by the request's `x-mode` header.
///
/// - none: answer at once with a body holding the backend's name;
/// - `stream`: answer at once with a body that stays open until the test ends it through
///   [`Streams`];
/// - `hang`: never answer;
/// - `fail`: fail without answering.
///
/// A request whose `x-fail-on` header names the backend fails there, whatever its mode; one
/// whose `x-unavailable-on` headers name it is answered 503 there, as llama-server answers
/// while it loads its model.
#[derive(Clone, Default)]
pub(crate) struct Streams(Arc<Mutex<VecDeque<OpenStream>>>);

impl Streams {
    /// The open streams' senders, oldest first, with the backend that opened each.
    pub(crate) fn take(&self) -> Option<OpenStream> {
        self.0.lock().pop_front()
    }

    /// The stream opened most recently.
    pub(crate) fn take_last(&self) -> Option<OpenStream> {
        self.0.lock().pop_back()
    }
}

pub(crate) fn backend(name: &str, streams: &Streams) -> MockService {
    let name = name.to_string();
    let streams = streams.clone();
    BoxCloneSyncService::new(tower::service_fn(move |req: Req| {
        let name = name.clone();
        let streams = streams.clone();
        let fut: Pin<Box<dyn Future<Output = Result<http::Response<MockBody>, BoxError>> + Send>> =
            Box::pin(async move {
                let mode = req
                    .headers()
                    .get("x-mode")
                    .map(|v| v.to_str().unwrap_or("").to_string());
                if req
                    .headers()
                    .get("x-fail-on")
                    .is_some_and(|v| v == name.as_str())
                {
                    return Err(format!("{name} refused the connection").into());
                }
                let (tx, rx) = mpsc::unbounded_channel();
                let unavailable = req
                    .headers()
                    .get_all("x-unavailable-on")
                    .iter()
                    .any(|v| v == name.as_str());
                if unavailable {
                    tx.send(Ok(Frame::data(Bytes::from_static(b"Loading model"))))
                        .unwrap();
                    let body = StreamBody::new(UnboundedReceiverStream::new(rx));
                    return Ok(http::Response::builder()
                        .status(http::StatusCode::SERVICE_UNAVAILABLE)
                        .header("x-served-by", name)
                        .body(body)
                        .unwrap());
                }
                match mode.as_deref() {
                    Some("hang") => std::future::pending::<()>().await,
                    Some("fail") => return Err(format!("{name} refused the connection").into()),
                    Some("stream") => streams.0.lock().push_back((name.clone(), tx)),
                    _ => {
                        tx.send(Ok(Frame::data(Bytes::from(name.clone())))).unwrap();
                    }
                }
                let body = StreamBody::new(UnboundedReceiverStream::new(rx));
                Ok(http::Response::builder()
                    .header("x-served-by", name)
                    .body(body)
                    .unwrap())
            });
        fut
    }))
}
