//! The HTTP metrics follow a request to the end of its response body: a stream counts as in
//! flight until it ends or its client goes away, and a non-streamed request whose client closed
//! its connection (which the server cannot tell from a half-close) runs to its end, is counted
//! and leaves the in-flight gauge. One test in its own binary: the Prometheus recorder is
//! process-wide, and other tests' requests would move the gauge.

mod common;

use std::io::Write as _;
use std::time::Duration;

use common::{sample, TestServer};
use futures_util::StreamExt;
use rackfill_server::ServerConfig;
use serde_json::json;

const IN_FLIGHT: &str = "rackfill:http_requests_in_flight";

async fn metrics(server: &TestServer) -> String {
    let (status, text) = server.get("/metrics").await;
    assert_eq!(status, 200);
    text
}

/// Polls `/metrics` until `ready` holds for its text (the metrics of a request that just ended
/// are recorded by the server's threads, not before the client sees the end).
async fn wait_for(server: &TestServer, what: &str, ready: impl Fn(&str) -> bool) -> String {
    for _ in 0..200 {
        let text = metrics(server).await;
        if ready(&text) {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never reached: {what}\n{}", metrics(server).await);
}

/// The gauge reads `in_flight` (the `/metrics` request itself included) and `/v1/completions`
/// has been answered `answered` times (with `status` when given).
async fn wait_for_completions(
    server: &TestServer,
    in_flight: f64,
    answered: f64,
    status: Option<&str>,
) -> String {
    let route = "route=\"/v1/completions\"";
    let labels: Vec<&str> = std::iter::once(route).chain(status).collect();
    wait_for(server, "completions counted and out of flight", |text| {
        sample(text, IN_FLIGHT, &[]) == in_flight
            && sample(text, "rackfill:http_requests_total", &labels) == answered
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_observed_to_the_end_of_their_body() {
    let server = TestServer::start(ServerConfig::default()).await;
    let long = json!({"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": true});

    // Only the /metrics request itself is in flight.
    wait_for_completions(&server, 1.0, 0.0, None).await;

    // A stream is in flight from its first event until its client goes away.
    let mut stream_request = long.clone();
    stream_request["stream"] = json!(true);
    let response = server
        .client
        .post(server.url("/v1/completions"))
        .json(&stream_request)
        .send()
        .await
        .unwrap();
    let mut body = response.bytes_stream();
    assert!(!body.next().await.unwrap().unwrap().is_empty());
    assert_eq!(sample(&metrics(&server).await, IN_FLIGHT, &[]), 2.0);
    drop(body);
    // Counted once it ended, and no longer in flight.
    let text = wait_for_completions(&server, 1.0, 1.0, None).await;
    // Its duration covers the events sent, not just the response head.
    let duration = sample(
        &text,
        "rackfill:http_request_duration_seconds_sum",
        &["route=\"/v1/completions\""],
    );
    assert!(duration > 0.0, "{duration}");

    // A client that leaves before a non-streamed response: its request is counted once it
    // ended, and not left in flight.
    let shorter = json!({"prompt": "Once upon a time", "max_tokens": 50, "ignore_eos": true});
    let payload = serde_json::to_vec(&shorter).unwrap();
    let mut socket = std::net::TcpStream::connect(server.addr).unwrap();
    write!(
        socket,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        payload.len()
    )
    .unwrap();
    socket.write_all(&payload).unwrap();
    wait_for(&server, "the request in flight", |text| {
        sample(text, IN_FLIGHT, &[]) == 2.0
    })
    .await;
    drop(socket);
    wait_for_completions(&server, 1.0, 2.0, None).await;
    server.shutdown().await.unwrap();
}
