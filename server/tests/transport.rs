//! The connection level: a client that shuts down its sending side after its request still gets
//! the whole response, and no more than `max_connections` connections are served at once (the
//! next one waits until one closes, then is served).

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::Duration;

use common::TestServer;
use rackfill_server::ServerConfig;
use serde_json::{json, Value};

/// Sends one `POST /v1/completions`, shuts down the write side, and reads until the server
/// closes; returns everything read. Blocking: run it off the runtime.
fn request_then_half_close(server: SocketAddr, body: &str) -> String {
    let mut stream = TcpStream::connect(server).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    stream.shutdown(Shutdown::Write).unwrap();
    let mut answer = Vec::new();
    // A reset instead of the response reads as an error: whatever came before it is returned.
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_closed_client_gets_its_whole_response() {
    let server = TestServer::start(ServerConfig::default()).await;
    let addr = server.addr;
    let body =
        json!({"prompt": "Once upon a time", "max_tokens": 1, "ignore_eos": true}).to_string();
    // Without half-close support most of these lose their response (all of them, measured);
    // 10 in a row all answered does not happen by chance.
    let answers = tokio::task::spawn_blocking(move || {
        (0..10)
            .map(|_| request_then_half_close(addr, &body))
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    for (i, answer) in answers.iter().enumerate() {
        let (head, body) = answer
            .split_once("\r\n\r\n")
            .unwrap_or_else(|| panic!("request {i}: no response, got {answer:?}"));
        assert!(head.starts_with("HTTP/1.1 200"), "request {i}: {head}");
        let body: Value = serde_json::from_str(body)
            .unwrap_or_else(|err| panic!("request {i}: incomplete body ({err}): {body}"));
        assert_eq!(body["usage"]["completion_tokens"], 1, "request {i}: {body}");
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_limit_wait_for_a_free_slot() {
    let server = TestServer::start(ServerConfig {
        max_connections: 2,
        ..ServerConfig::default()
    })
    .await;
    // Two idle connections take both slots (the head timeout, 30 s, is far away).
    let mut held: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(server.addr).unwrap())
        .collect();
    // The kernel completes a third connection in the listen backlog, but the server does not
    // take it while both slots are held.
    let client = server.client.clone();
    let url = server.url("/health");
    let third = tokio::spawn(async move { client.get(url).send().await.map(|r| r.status()) });
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        !third.is_finished(),
        "a third connection was served while two held both slots: {:?}",
        third.await
    );
    // Closing one frees its slot: the waiting connection is accepted and served.
    drop(held.pop());
    let status = tokio::time::timeout(Duration::from_secs(30), third)
        .await
        .expect("the waiting connection is served once a slot is free")
        .unwrap()
        .unwrap();
    assert_eq!(status.as_u16(), 200);
    drop(held);
    server.shutdown().await.unwrap();
}
