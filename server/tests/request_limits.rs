//! What bounds one request's cost: a long text prompt is refused by the engine's cheap bound
//! before it is tokenized, and the tokens of all of a request's sequences are bounded together.
//! Real server on the built-in model (context 4096, longest token 38 bytes).

mod common;

use common::TestServer;
use rackfill_server::ServerConfig;
use serde_json::{json, Value};

/// `n` bytes of ordinary text.
fn text_of(n: usize) -> String {
    "The quick brown fox jumps over the lazy dog. "
        .chars()
        .cycle()
        .take(n)
        .collect()
}

fn assert_context_error(body: &Value, param: &str) -> String {
    let error = &body["error"];
    assert_eq!(error["code"], "context_length_exceeded", "{body}");
    assert_eq!(error["param"], param, "{body}");
    error["message"].as_str().unwrap().to_string()
}

/// A prompt of 4 MiB (the default body limit) cannot fit a 4096-token context whatever it
/// tokenizes to: the 400 names the limit and the text's size and token bound, and comes from
/// that bound, not from tokenizing the text (which peaked near 650 MB). Eight at once likewise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_text_prompt_is_refused_before_it_is_tokenized() {
    let server = TestServer::start(ServerConfig::default()).await;
    let text = text_of((4 << 20) - 1024);
    let request = json!({"prompt": text, "max_tokens": 16});
    let (status, body) = server.post("/v1/completions", &request).await;
    assert_eq!(status, 400, "{body}");
    let message = assert_context_error(&body, "prompt");
    let bytes = text.len().to_string();
    assert!(
        message.contains("4096") && message.contains(&bytes) && message.contains("at least"),
        "{message}"
    );

    let posts = (0..8).map(|_| server.post("/v1/completions", &request));
    for (status, body) in futures_util::future::join_all(posts).await {
        assert_eq!(status, 400, "{body}");
        assert_context_error(&body, "prompt");
    }

    // In a chat, and on /tokenize, the same.
    let chat = json!({"messages": [{"role": "user", "content": text}]});
    let (status, body) = server.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 400, "{body}");
    assert_context_error(&body, "messages");
    let (status, body) = server.post("/tokenize", &json!({"prompt": text})).await;
    assert_eq!(status, 400, "{body}");
    assert_context_error(&body, "prompt");

    // A text within the bound but over the context is tokenized and counted exactly.
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": text_of(64 << 10), "max_tokens": 16}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    let message = assert_context_error(&body, "prompt");
    assert!(
        message.contains("4096") && message.contains("prompt tokens plus max_tokens 16"),
        "{message}"
    );
    server.shutdown().await.unwrap();
}

/// With the body limit raised, a 24 MB prompt is refused as fast as a small one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raised_body_limit_does_not_let_a_huge_prompt_be_tokenized() {
    let server = TestServer::start(ServerConfig {
        max_body_bytes: 32 << 20,
        ..ServerConfig::default()
    })
    .await;
    let text = text_of(24_000_000);
    let (status, body) = server
        .post("/v1/completions", &json!({"prompt": text, "max_tokens": 1}))
        .await;
    assert_eq!(status, 400, "{body}");
    let message = assert_context_error(&body, "prompt");
    assert!(message.contains("24000000"), "{message}");
    server.shutdown().await.unwrap();
}

/// 256 prompts of 4000 token ids each fit the context one by one, but together would hold the
/// engine for minutes: the request is refused, naming its tokens and the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tokens_of_one_request_are_bounded() {
    let server = TestServer::start(ServerConfig::default()).await;
    let prompts = vec![vec![5u32; 4000]; 256];
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": prompts, "max_tokens": 16}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "prompt", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    // 256 x (4000 + 16) tokens against the default limit of 2^19.
    assert!(
        message.contains("1028096") && message.contains("524288"),
        "{message}"
    );
    // Fewer prompts of the same kind are served.
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": vec![vec![5u32; 40]; 4], "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    server.shutdown().await.unwrap();
}

/// A bad sampling parameter is the 400 that names it even when the prompt is also too long:
/// parameters are checked as soon as they are read, before admission and tokenization.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_parameter_is_named_before_the_prompt_is_looked_at() {
    let server = TestServer::start(ServerConfig::default()).await;
    let text = text_of(1 << 20);
    let request = json!({"prompt": text, "max_tokens": 10, "min_tokens": 20});
    let (status, body) = server.post("/v1/completions", &request).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "min_tokens", "{body}");
    let chat = json!({
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 10,
        "min_tokens": 20,
    });
    let (status, body) = server.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "min_tokens", "{body}");
    // Without max_tokens the chat's min_tokens is checked once the prompt fixes max_tokens (the
    // rest of the context): the stream starts (its 200 is enough; dropping it cancels).
    let chat = json!({
        "messages": [{"role": "user", "content": "Hi"}],
        "min_tokens": 20,
        "stream": true,
    });
    let response = server
        .client
        .post(server.url("/v1/chat/completions"))
        .json(&chat)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
}
