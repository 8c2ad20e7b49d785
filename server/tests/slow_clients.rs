//! Slow clients cannot hold the server: a client that never finishes its request head is
//! disconnected, one that declares a body and stops sending gets a 408 (or its 413) when the time
//! is up, one that stops reading its stream has the request cancelled and its admission slot
//! freed, and the server goes on serving everyone else.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::TestServer;
use rackfill_server::ServerConfig;
use serde_json::{json, Value};

const TIMEOUT: Duration = Duration::from_millis(600);

fn config() -> ServerConfig {
    ServerConfig {
        read_timeout: TIMEOUT,
        max_body_bytes: 64 * 1024,
        ..ServerConfig::default()
    }
}

/// Sends the request line, headers and `partial` body bytes of a body of `content_length`,
/// then stops sending while keeping the connection open; returns the status and JSON body of
/// the answer and how long it took to come. Blocking: run it off the runtime.
fn stall(server: SocketAddr, content_length: usize, partial: &[u8]) -> (u16, Value, Duration) {
    let mut stream = TcpStream::connect(server).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {content_length}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(partial).unwrap();
    let sent = Instant::now();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    // Read until the JSON body is complete (the server may keep the connection open).
    loop {
        let n = stream.read(&mut buf).expect("no answer within 30 s");
        answer.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&answer);
        if n == 0
            || text
                .split_once("\r\n\r\n")
                .is_some_and(|(_, b)| b.ends_with('}'))
        {
            break;
        }
    }
    let took = sent.elapsed();
    let text = String::from_utf8(answer).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(body).unwrap(), took)
}

/// A normal request is answered while a slow client holds its connection.
async fn served(server: &TestServer) {
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Hello", "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
}

/// The server acted on the slow client once the timeout passed, and well before 20 of them.
fn after_the_timeout(took: Duration) {
    assert!(
        took >= TIMEOUT && took < TIMEOUT * 20,
        "the server acted after {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_not_finished_in_time_gets_408_and_others_are_served() {
    let server = TestServer::start(config()).await;
    let addr = server.addr;
    let stalled = tokio::task::spawn_blocking(move || stall(addr, 100, br#"{"prompt": "#));
    served(&server).await;

    let (status, body, took) = stalled.await.unwrap();
    assert_eq!(status, 408, "{body}");
    assert_eq!(body["error"]["code"], "request_timeout", "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("0.6 s"),
        "{body}"
    );
    after_the_timeout(took);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_body_that_stalls_still_gets_its_413() {
    let server = TestServer::start(config()).await;
    let addr = server.addr;
    let (status, body, took) =
        tokio::task::spawn_blocking(move || stall(addr, 1 << 20, &[b' '; 1000]))
            .await
            .unwrap();
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["code"], "payload_too_large", "{body}");
    after_the_timeout(took);
    // A body sent whole and in time is served as before.
    served(&server).await;
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_not_finished_in_time_closes_the_connection() {
    let server = TestServer::start(config()).await;
    let addr = server.addr;
    let closed_after = tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        stream
            .write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            .unwrap();
        let sent = Instant::now();
        let mut buf = [0u8; 1024];
        // The server answers nothing and closes (0 bytes), or resets the connection.
        loop {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        sent.elapsed()
    });
    served(&server).await;
    let took = closed_after.await.unwrap();
    after_the_timeout(took);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_client_stopped_reading_is_cancelled_and_frees_its_slot() {
    // Small socket buffers on both sides (accepted connections inherit the listener's), so the
    // stream backs up behind the client after a few dozen chunks. One admission slot.
    let server = TestServer::start_on(
        common::small_send_buffer_listener(),
        ServerConfig {
            write_timeout: TIMEOUT,
            max_concurrent_requests: 1,
            ..ServerConfig::default()
        },
        common::engine_config(2),
    );
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let stream = socket
        .connect(server.addr)
        .await
        .unwrap()
        .into_std()
        .unwrap();
    stream.set_nonblocking(false).unwrap();
    let stream = tokio::task::spawn_blocking(move || {
        let mut stream = stream;
        let body = json!({"prompt": "Hello", "n": 4, "max_tokens": 4000, "logprobs": 20,
                          "ignore_eos": true, "stream": true})
        .to_string();
        let request = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).unwrap();
        // Read the start of the stream, then stop reading but keep the connection open.
        let mut buf = [0u8; 1024];
        let n = stream.read(&mut buf).unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        stream
    })
    .await
    .unwrap();
    // While the stream holds the only slot, others are refused; once the server gave up on the
    // client (well within 20 timeouts), the slot is free again.
    let started = Instant::now();
    loop {
        let (status, body) = server
            .post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 1}))
            .await;
        if status == 200 {
            break;
        }
        assert_eq!(status, 429, "{body}");
        assert!(
            started.elapsed() < TIMEOUT * 20,
            "the stalled stream still holds its slot"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(stream);
    server.shutdown().await.unwrap();
}
