//! vLLM's tokenizer routes on a real server: `/tokenize` counts what `usage.prompt_tokens`
//! counts for the same prompt or chat, `/detokenize` inverts it, `/tokenizer_info` gives what a
//! remote tokenizer needs, and all three sit behind the API key.

mod common;

use common::TestServer;
use rackfill_models::BUILTIN_MODEL_NAME;
use rackfill_server::ServerConfig;
use serde_json::{json, Value};

const PROMPT: &str = "The quick brown fox jumps over the lazy dog";

fn ids(body: &Value) -> Vec<u64> {
    body["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_agrees_with_usage_and_detokenize_inverts_it() {
    let server = TestServer::start(ServerConfig::default()).await;

    let (status, tokenized) = server.post("/tokenize", &json!({"prompt": PROMPT})).await;
    assert_eq!(status, 200, "{tokenized}");
    let (_, completion) = server
        .post(
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 1}),
        )
        .await;
    assert_eq!(tokenized["count"], completion["usage"]["prompt_tokens"]);
    assert_eq!(tokenized["count"], ids(&tokenized).len());
    assert_eq!(tokenized["max_model_len"], 4096);
    assert!(tokenized["token_strs"].is_null());
    let expected = server.state.backend().tokenize(PROMPT, true).unwrap();
    assert_eq!(
        ids(&tokenized),
        expected.iter().map(|&t| t as u64).collect::<Vec<_>>()
    );

    let (status, text) = server
        .post("/detokenize", &json!({"tokens": tokenized["tokens"]}))
        .await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(text["prompt"], PROMPT);

    // Token strings are the vocabulary's (byte-level: a leading space is `Ġ`).
    let (_, with_strs) = server
        .post(
            "/tokenize",
            &json!({"prompt": PROMPT, "return_token_strs": true, "model": BUILTIN_MODEL_NAME}),
        )
        .await;
    let strs = with_strs["token_strs"].as_array().unwrap();
    assert_eq!(strs.len(), ids(&with_strs).len());
    assert!(
        strs.iter().any(|s| s.as_str().unwrap().starts_with('Ġ')),
        "{strs:?}"
    );

    // A chat counts what the chat route counts: template rendered, no extra special tokens.
    let messages = json!([{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": PROMPT}]);
    let (status, chat_tokens) = server
        .post("/tokenize", &json!({"messages": messages}))
        .await;
    assert_eq!(status, 200, "{chat_tokens}");
    let (_, chat) = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 1}),
        )
        .await;
    assert_eq!(
        chat_tokens["count"], chat["usage"]["prompt_tokens"],
        "{chat}"
    );
    let (_, continued) = server
        .post(
            "/tokenize",
            &json!({"messages": messages, "add_generation_prompt": false,
                    "continue_final_message": true}),
        )
        .await;
    assert!(
        continued["count"].as_u64() < chat_tokens["count"].as_u64(),
        "{continued}"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenizer_routes_refuse_bad_input_with_the_error_envelope() {
    let server = TestServer::start(ServerConfig::default()).await;
    let cases = [
        ("/tokenize", json!({}), "prompt"),
        (
            "/tokenize",
            json!({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}),
            "prompt",
        ),
        ("/tokenize", json!({"prompt": 5}), "prompt"),
        ("/tokenize", json!({"messages": []}), "messages"),
        (
            "/tokenize",
            json!({"messages": [{"role": "user", "content": "a"}], "chat_template": "x"}),
            "chat_template",
        ),
        ("/detokenize", json!({"tokens": [1, 99999999]}), "tokens"),
        ("/detokenize", json!({"tokens": [-1]}), "tokens[0]"),
        ("/detokenize", json!({"tokens": vec![1; 4097]}), "tokens"),
    ];
    for (path, request, param) in cases {
        let (status, body) = server.post(path, &request).await;
        assert_eq!(status, 400, "{path} {request}: {body}");
        assert_eq!(body["error"]["param"], param, "{path} {request}: {body}");
    }
    let (status, body) = server
        .post("/tokenize", &json!({"prompt": "a", "model": "other"}))
        .await;
    assert_eq!(status, 404, "{body}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenizer_info_serves_a_remote_tokenizer_behind_the_api_key() {
    let server = TestServer::start(ServerConfig {
        api_key: Some("sesame".into()),
        ..ServerConfig::default()
    })
    .await;
    let (status, _) = server.get("/tokenizer_info").await;
    assert_eq!(status, 401);
    let (status, body) = server.post("/tokenize", &json!({"prompt": "a"})).await;
    assert_eq!(status, 401, "{body}");
    let (status, _) = server.post("/detokenize", &json!({"tokens": [1]})).await;
    assert_eq!(status, 401);

    let authed = |request: reqwest::RequestBuilder| request.bearer_auth("sesame");
    let info: Value = authed(server.client.get(server.url("/tokenizer_info")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["eos_token"], "<|im_end|>", "{info}");
    assert_eq!(info["model_max_length"], 4096);
    assert!(info["tokenizer_class"].is_string());
    assert!(
        info["chat_template"].as_str().unwrap().contains("im_start"),
        "{info}"
    );
    // The eos token a harness appends tokenizes to the engine's end-of-sequence id.
    let eos: Value = authed(server.client.post(server.url("/tokenize")))
        .json(&json!({"prompt": info["eos_token"], "add_special_tokens": false}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(eos["count"], 1, "{eos}");
    server.shutdown().await.unwrap();
}
