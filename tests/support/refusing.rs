//! A loopback address that refuses connections for as long as it is held: a socket bound to
//! it that never listens. A port found free, closed and used later may meanwhile be taken by
//! another test's listener, or be the local end of a connection, and answer.

use std::net::SocketAddr;

use tokio::net::TcpSocket;

/// Refuses every connection to [`Refusing::addr`] until dropped.
#[derive(Debug)]
pub(crate) struct Refusing {
    pub(crate) addr: SocketAddr,
    _socket: TcpSocket,
}

impl Refusing {
    pub(crate) fn new() -> Self {
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind(([127, 0, 0, 1], 0).into()).unwrap();
        Refusing {
            addr: socket.local_addr().unwrap(),
            _socket: socket,
        }
    }
}
