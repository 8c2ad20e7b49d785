//! The chunks of streamed completions and chats: the finishing chunk's `logprobs` is well formed
//! when logprobs were asked for, and `stream_options.continuous_usage_stats` puts each choice's
//! usage so far in every chunk (as vLLM does).

mod common;

use common::{json_chunks, read_sse, TestServer};
use rackfill_server::ServerConfig;
use serde_json::{json, Value};

const PROMPT: &str = "The quick brown fox jumps over the lazy dog";

async fn stream(server: &TestServer, path: &str, request: &Value) -> Vec<Value> {
    let response = server
        .client
        .post(server.url(path))
        .json(request)
        .send()
        .await
        .unwrap();
    json_chunks(&read_sse(response).await)
}

fn finishing(chunks: &[Value]) -> Vec<&Value> {
    chunks
        .iter()
        .filter(|c| {
            c["choices"]
                .get(0)
                .is_some_and(|choice| !choice["finish_reason"].is_null())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_finishing_chunk_has_well_formed_logprobs() {
    let server = TestServer::start(ServerConfig::default()).await;
    let request = json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                         "ignore_eos": true, "logprobs": 2, "stream": true});
    let chunks = stream(&server, "/v1/completions", &request).await;
    let last = finishing(&chunks);
    assert_eq!(last.len(), 1, "{chunks:?}");
    let choice = &last[0]["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    for list in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(choice["logprobs"][list], json!([]), "{choice}");
    }
    // Every chunk's logprobs is an object with parallel lists.
    for chunk in &chunks {
        let lp = &chunk["choices"][0]["logprobs"];
        assert!(lp.is_object(), "{chunk}");
        let n = lp["tokens"].as_array().unwrap().len();
        assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n);
    }

    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                      "temperature": 0, "ignore_eos": true, "logprobs": true,
                      "top_logprobs": 1, "stream": true});
    let chunks = stream(&server, "/v1/chat/completions", &chat).await;
    let last = finishing(&chunks);
    assert_eq!(last.len(), 1, "{chunks:?}");
    assert_eq!(last[0]["choices"][0]["logprobs"], json!({"content": []}));
    // Without logprobs, the finishing chunk's stays null.
    let mut plain = chat.clone();
    plain.as_object_mut().unwrap().remove("logprobs");
    plain.as_object_mut().unwrap().remove("top_logprobs");
    let chunks = stream(&server, "/v1/chat/completions", &plain).await;
    assert!(finishing(&chunks)[0]["choices"][0]["logprobs"].is_null());
    server.shutdown().await.unwrap();
}

/// Checks continuous usage: every chunk with a choice carries its usage, completion tokens
/// never decrease per choice and reach `max_tokens` on the finishing chunk; the closing chunk
/// has the request's totals.
fn check_continuous(chunks: &[Value], prompt_tokens: u64, max_tokens: u64, choices: u64) {
    let (closing, body) = chunks.split_last().unwrap();
    assert_eq!(closing["choices"], json!([]));
    assert_eq!(
        closing["usage"]["completion_tokens"],
        max_tokens * choices,
        "{closing}"
    );
    let mut seen = vec![0u64; choices as usize];
    for chunk in body {
        let usage = &chunk["usage"];
        assert!(usage.is_object(), "no usage in {chunk}");
        let index = chunk["choices"][0]["index"].as_u64().unwrap() as usize;
        let completion = usage["completion_tokens"].as_u64().unwrap();
        assert_eq!(usage["prompt_tokens"], prompt_tokens, "{chunk}");
        assert_eq!(usage["total_tokens"], prompt_tokens + completion);
        assert!(completion >= seen[index], "{chunk}");
        seen[index] = completion;
        if !chunk["choices"][0]["finish_reason"].is_null() {
            assert_eq!(completion, max_tokens, "{chunk}");
        }
    }
    assert_eq!(seen, vec![max_tokens; choices as usize]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuous_usage_stats_put_usage_in_every_chunk() {
    let server = TestServer::start(ServerConfig::default()).await;
    let options = json!({"include_usage": true, "continuous_usage_stats": true});
    let request = json!({"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "n": 2,
                         "ignore_eos": true, "stream": true, "stream_options": options});
    let prompt_tokens = server.state.backend().tokenize(PROMPT, true).unwrap().len() as u64;
    let chunks = stream(&server, "/v1/completions", &request).await;
    check_continuous(&chunks, prompt_tokens, 5, 2);

    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                      "temperature": 0, "ignore_eos": true, "stream": true,
                      "stream_options": options});
    let (_, whole) = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        )
        .await;
    let prompt_tokens = whole["usage"]["prompt_tokens"].as_u64().unwrap();
    let chunks = stream(&server, "/v1/chat/completions", &chat).await;
    check_continuous(&chunks, prompt_tokens, 5, 1);
    assert_eq!(chunks[0]["usage"]["completion_tokens"], 0, "{}", chunks[0]);

    // Without `continuous_usage_stats`, chunks keep `usage: null` until the closing chunk.
    let mut closing_only = request.clone();
    closing_only["stream_options"] = json!({"include_usage": true});
    let chunks = stream(&server, "/v1/completions", &closing_only).await;
    let (closing, body) = chunks.split_last().unwrap();
    assert!(body.iter().all(|c| c["usage"].is_null()));
    assert_eq!(closing["usage"]["completion_tokens"], 10);
    server.shutdown().await.unwrap();
}
