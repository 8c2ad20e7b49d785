//! `rackfill:http_body_bytes_buffered` counts the request-body bytes the server holds: those of
//! an authenticated upload in progress, none of an unauthenticated one (refused from its head),
//! and none once the upload's client went away; `rackfill:http_connections_open` follows the
//! connections. One test in its own binary: the Prometheus recorder is process-wide.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::TestServer;
use rackfill_server::ServerConfig;

const BUFFERED: &str = "rackfill:http_body_bytes_buffered";
const CONNECTIONS: &str = "rackfill:http_connections_open";

/// The value of an unlabelled gauge (0 when absent).
fn gauge(text: &str, name: &str) -> f64 {
    text.lines()
        .filter_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .filter_map(|value| value.trim().parse().ok())
        .next()
        .unwrap_or(0.0)
}

/// Reads `/metrics` through one pooled connection: a client that kept more idle connections
/// (a request may start before the last one's connection is back in the pool, and the pool then
/// opens another) would shift the connection gauge by one for good. With at most one idle
/// connection kept, an extra one is closed as soon as it is idle, so the gauge settles.
struct Scraper {
    client: reqwest::Client,
    url: String,
}

impl Scraper {
    fn new(server: &TestServer) -> Self {
        Self {
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(1)
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap(),
            url: server.url("/metrics"),
        }
    }

    async fn text(&self) -> String {
        let response = self.client.get(&self.url).send().await.unwrap();
        response.text().await.unwrap()
    }

    /// Polls until `ready` holds for the two gauges.
    async fn wait_for(&self, what: &str, ready: impl Fn(f64, f64) -> bool) {
        let mut text = String::new();
        for _ in 0..200 {
            text = self.text().await;
            if ready(gauge(&text, BUFFERED), gauge(&text, CONNECTIONS)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("never reached: {what}\n{text}");
    }

    /// The connections open while nothing else happens: the least of a few readings (a
    /// scrape racing its own pool only ever adds one for a moment).
    async fn settled_connections(&self) -> f64 {
        let mut least = f64::INFINITY;
        for _ in 0..5 {
            least = least.min(gauge(&self.text().await, CONNECTIONS));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        least
    }
}

/// A connection that sent the head of a 1 MiB completion request and `sent` bytes of its body.
fn upload(server: SocketAddr, key: &str, sent: usize) -> TcpStream {
    let mut stream = TcpStream::connect(server).unwrap();
    stream
        .set_write_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         authorization: Bearer {key}\r\ncontent-length: {}\r\n\r\n",
        1 << 20
    );
    stream.write_all(head.as_bytes()).unwrap();
    // The server may refuse and close while this is being sent.
    let _ = stream.write_all(&vec![b' '; sent]);
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_body_bytes_and_open_connections_are_counted() {
    let server = TestServer::start(ServerConfig {
        api_key: Some("sekret".into()),
        max_body_bytes: 2 << 20,
        ..ServerConfig::default()
    })
    .await;
    let scraper = Scraper::new(&server);
    scraper
        .wait_for("nothing buffered", |bytes, _| bytes == 0.0)
        .await;
    let before = scraper.settled_connections().await;

    let addr = server.addr;
    let authorized = tokio::task::spawn_blocking(move || upload(addr, "sekret", 200_000))
        .await
        .unwrap();
    scraper
        .wait_for("the authorized upload buffered", |bytes, open| {
            bytes == 200_000.0 && open == before + 1.0
        })
        .await;

    // An unauthenticated upload is refused from its head: none of its bytes are held.
    let refused = tokio::task::spawn_blocking(move || {
        let mut stream = upload(addr, "wrong", 300_000);
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&answer).contains('}') {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
        (stream, String::from_utf8_lossy(&answer).into_owned())
    })
    .await
    .unwrap();
    let (refused, answer) = refused;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    scraper
        .wait_for("still only the authorized bytes", |bytes, open| {
            bytes == 200_000.0 && open == before + 2.0
        })
        .await;

    // The clients go away: the authorized one's bytes and both connections are released.
    drop(authorized);
    drop(refused);
    scraper
        .wait_for("nothing held after the clients left", |bytes, open| {
            bytes == 0.0 && open == before
        })
        .await;
    server.shutdown().await.unwrap();
}
