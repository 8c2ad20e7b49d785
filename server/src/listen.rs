//! The accept loop: HTTP/1.1 connections served by hyper with a read timeout on every request
//! head (a client that connects and never finishes its request line and headers, or leaves a
//! keep-alive connection idle, is disconnected instead of holding a task and a socket forever),
//! TCP_NODELAY on every connection, and a graceful end: stop accepting, let each connection
//! finish the request it is serving, then return.

use std::future::Future;
use std::io;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

/// How long to wait before accepting again after an error such as running out of file
/// descriptors (retrying at once would spin).
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// Serves `router` on `listener` until `stop` resolves, then waits for the open connections to
/// finish their current request. `head_timeout` bounds the time from the moment a connection
/// waits for a request head until the head is complete.
pub(crate) async fn serve_until(
    listener: TcpListener,
    router: Router,
    head_timeout: Duration,
    stop: impl Future<Output = ()>,
) -> io::Result<()> {
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(head_timeout);
    let connections = GracefulShutdown::new();
    tokio::pin!(stop);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
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
        let service = TowerToHyperService::new(router.clone());
        let connection = connections.watch(http.serve_connection(TokioIo::new(tcp), service));
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!(%err, "connection ended with an error");
            }
        });
    }
    drop(listener);
    connections.shutdown().await;
    Ok(())
}
