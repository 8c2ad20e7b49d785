//! The accept loop: HTTP/1.1 connections served by hyper, at most `max_connections` at once
//! (beyond that the loop stops accepting, and new connections wait in the kernel's listen
//! backlog until one closes), with a read timeout on every request head (a client that connects
//! and never finishes its request line and headers, or leaves a keep-alive connection idle, is
//! disconnected instead of holding a task and a socket forever), a read buffer of at most
//! 64 KiB per connection, half-closed connections answered, TCP_NODELAY on every connection, and
//! a graceful end: stop accepting, let each connection finish the request it is serving, then
//! return.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use ::metrics::gauge;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::{metrics, ServerConfig};

/// The most a connection's read buffer grows to (hyper's default is about 400 KiB): what each
/// connection holds while a body streams in (kept or discarded), and so also about the largest
/// request head taken (hyper answers 431 beyond).
const MAX_READ_BUFFER: usize = 64 << 10;

/// How long to wait before accepting again after an error such as running out of file
/// descriptors (retrying at once would spin).
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// Serves `router` on `listener` until `stop` resolves, then waits for the open connections to
/// finish their current request. `config.read_timeout` bounds the time from the moment a
/// connection waits for a request head until the head is complete; `config.max_connections`
/// bounds the connections open at once.
pub(crate) async fn serve_until(
    listener: TcpListener,
    router: Router,
    config: &ServerConfig,
    stop: impl Future<Output = ()>,
) -> io::Result<()> {
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(config.read_timeout)
        // HTTP/1.1 lets a client shut down its sending side once the request is out; without
        // this, hyper takes the end of input for a client gone and drops the response.
        .half_close(true)
        .max_buf_size(MAX_READ_BUFFER);
    let slots = Arc::new(Semaphore::new(config.max_connections.max(1)));
    let connections = GracefulShutdown::new();
    tokio::pin!(stop);
    loop {
        let (tcp, slot) = tokio::select! {
            accepted = accept(&listener, &slots) => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    tracing::warn!(%err, "accept failed");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        // Streamed tokens are small writes: without TCP_NODELAY, Nagle's algorithm holds each
        // one back until the client acknowledges the previous (tens of milliseconds with
        // delayed ACKs).
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::warn!(%err, "cannot set TCP_NODELAY");
        }
        let open = OpenConnection::new(slot);
        let service = TowerToHyperService::new(router.clone());
        let connection = connections.watch(http.serve_connection(TokioIo::new(tcp), service));
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!(%err, "connection ended with an error");
            }
            drop(open);
        });
    }
    drop(listener);
    connections.shutdown().await;
    Ok(())
}

/// The next connection, once a slot is free: while all are taken, nothing is accepted.
async fn accept(
    listener: &TcpListener,
    slots: &Arc<Semaphore>,
) -> io::Result<(TcpStream, OwnedSemaphorePermit)> {
    let slot = Arc::clone(slots)
        .acquire_owned()
        .await
        .expect("the connection semaphore is never closed");
    let (tcp, _) = listener.accept().await?;
    Ok((tcp, slot))
}

/// One served connection: holds its slot and counts in `rackfill:http_connections_open` until
/// dropped.
struct OpenConnection {
    _slot: OwnedSemaphorePermit,
}

impl OpenConnection {
    fn new(slot: OwnedSemaphorePermit) -> Self {
        gauge!(metrics::HTTP_CONNECTIONS_OPEN).increment(1.0);
        Self { _slot: slot }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        gauge!(metrics::HTTP_CONNECTIONS_OPEN).decrement(1.0);
    }
}
