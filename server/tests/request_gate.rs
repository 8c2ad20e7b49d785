//! What the server decides from a request's head alone: with an API key set, anything under
//! `/v1` (unknown routes and wrong methods included) and vLLM's tokenizer routes get 401 without
//! the key, before a byte of the body is read; a body must be declared JSON (415 otherwise), so a
//! web page cannot drive a local server with a CORS "simple" `text/plain` request.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::TestServer;
use rackfill_server::ServerConfig;
use reqwest::Method;
use serde_json::Value;

fn with_key() -> ServerConfig {
    ServerConfig {
        api_key: Some("sekret".into()),
        ..ServerConfig::default()
    }
}

/// Status and JSON body of `method path` with an optional bearer key, content type and body.
async fn send(
    server: &TestServer,
    method: Method,
    path: &str,
    key: Option<&str>,
    content_type: Option<&str>,
    body: Option<&str>,
) -> (u16, Value) {
    let mut request = server.client.request(method, server.url(path));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    if let Some(content_type) = content_type {
        request = request.header("content-type", content_type);
    }
    if let Some(body) = body {
        request = request.body(body.to_string());
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_is_checked_before_the_body_is_read() {
    let server = TestServer::start(with_key()).await;
    let addr = server.addr;
    // A head announcing a 1 MiB body, and not one byte of it: the 401 comes at once, not after
    // the server waited for the body (the read timeout is 30 s; the client waits 10).
    let (answer, took) = tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream
            .write_all(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                  content-length: 1048576\r\n\r\n",
            )
            .unwrap();
        let sent = Instant::now();
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&answer).contains('}') {
            let n = stream
                .read(&mut buf)
                .expect("a 401 before the body is sent");
            assert!(n > 0, "closed without an answer");
            answer.extend_from_slice(&buf[..n]);
        }
        (String::from_utf8(answer).unwrap(), sent.elapsed())
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("invalid_api_key"), "{answer}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    server.shutdown().await.unwrap();
}

/// Writes a head and its whole `body_bytes`-byte body, then reads the answer to its end (a
/// chunked body's last chunk). Blocking: run it off the runtime.
fn send_whole_body_then_read(addr: SocketAddr, head: &str, body_bytes: usize) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream
        .set_write_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let head = format!("{head}content-length: {body_bytes}\r\n\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    stream
        .write_all(&vec![b' '; body_bytes])
        .expect("the server reads the body it refused instead of resetting the connection");
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&answer).ends_with("\r\n0\r\n\r\n") {
        let n = stream.read(&mut buf).expect("the answer");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&answer));
        answer.extend_from_slice(&buf[..n]);
    }
    String::from_utf8(answer).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sends_its_whole_body_first_reads_the_refusal() {
    // Many clients write the whole request before reading. A refused body larger than the
    // socket buffers must still be read (and thrown away) for them to get to the answer.
    let server = TestServer::start(with_key()).await;
    let addr = server.addr;
    let big = 4 << 20;
    let answers = tokio::task::spawn_blocking(move || {
        [
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             authorization: Bearer wrong\r\n",
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: text/plain\r\n\
             authorization: Bearer sekret\r\n",
        ]
        .map(|head| send_whole_body_then_read(addr, head, big))
    })
    .await
    .unwrap();
    let [unauthorized, not_json] = answers;
    assert!(unauthorized.starts_with("HTTP/1.1 401"), "{unauthorized}");
    assert!(unauthorized.contains("invalid_api_key"), "{unauthorized}");
    assert!(not_json.starts_with("HTTP/1.1 415"), "{not_json}");
    assert!(not_json.contains("unsupported_media_type"), "{not_json}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_routes_and_methods_under_v1_need_the_key_first() {
    let server = TestServer::start(with_key()).await;
    let json = Some("application/json");
    let body = Some(r#"{"prompt": "x", "max_tokens": 1}"#);
    for (method, path) in [
        (Method::GET, "/v1/nope"),
        (Method::POST, "/v1/nope"),
        (Method::GET, "/v1"),
        (Method::GET, "/v1/completions"),
        (Method::DELETE, "/v1/models"),
        (Method::POST, "/tokenize"),
        (Method::POST, "/detokenize"),
        (Method::GET, "/tokenizer_info"),
    ] {
        for key in [None, Some("wrong")] {
            let (status, answer) = send(&server, method.clone(), path, key, json, body).await;
            assert_eq!(status, 401, "{method} {path} {key:?}: {answer}");
            assert_eq!(answer["error"]["code"], "invalid_api_key", "{answer}");
            assert_eq!(answer["error"]["type"], "authentication_error", "{answer}");
        }
    }
    // With the key, the same requests reach the router.
    let key = Some("sekret");
    let (status, _) = send(&server, Method::GET, "/v1/nope", key, None, None).await;
    assert_eq!(status, 404);
    let (status, _) = send(&server, Method::GET, "/v1/completions", key, None, None).await;
    assert_eq!(status, 405);
    let (status, answer) = send(&server, Method::POST, "/v1/completions", key, json, body).await;
    assert_eq!(status, 200, "{answer}");
    // Probes, scrapers and routes outside the API stay open.
    for (path, expected) in [
        ("/health", 200),
        ("/metrics", 200),
        ("/version", 200),
        ("/nope", 404),
    ] {
        assert_eq!(server.get(path).await.0, expected, "{path}");
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_must_be_declared_json() {
    let server = TestServer::start(ServerConfig::default()).await;
    let completion = r#"{"prompt": "Hello", "max_tokens": 1}"#;
    let chat = r#"{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}"#;
    for (path, body) in [
        ("/v1/completions", completion),
        ("/v1/chat/completions", chat),
    ] {
        // What a page may send cross-origin without a preflight, and a body with no type.
        for content_type in [
            Some("text/plain"),
            Some("text/plain;charset=UTF-8"),
            Some("application/x-www-form-urlencoded"),
            Some("multipart/form-data; boundary=x"),
            None,
        ] {
            let (status, answer) =
                send(&server, Method::POST, path, None, content_type, Some(body)).await;
            assert_eq!(status, 415, "{path} {content_type:?}: {answer}");
            let error = &answer["error"];
            assert_eq!(error["type"], "invalid_request_error", "{answer}");
            assert_eq!(error["code"], "unsupported_media_type", "{answer}");
            assert!(
                error["message"]
                    .as_str()
                    .unwrap()
                    .contains("application/json"),
                "{answer}"
            );
        }
        for content_type in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
            "application/vnd.api+json",
        ] {
            let (status, answer) = send(
                &server,
                Method::POST,
                path,
                None,
                Some(content_type),
                Some(body),
            )
            .await;
            assert_eq!(status, 200, "{path} {content_type}: {answer}");
        }
    }
    // No body at all is not a media-type question: the handler says what is missing.
    let (status, answer) = send(&server, Method::POST, "/v1/completions", None, None, None).await;
    assert_eq!(status, 400, "{answer}");

    // With a key set, the key comes first.
    let keyed = TestServer::start(with_key()).await;
    let (status, _) = send(
        &keyed,
        Method::POST,
        "/v1/completions",
        None,
        Some("text/plain"),
        Some(completion),
    )
    .await;
    assert_eq!(status, 401);
    keyed.shutdown().await.unwrap();
    server.shutdown().await.unwrap();
}
