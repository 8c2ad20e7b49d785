//! The prefix cache through the API: a prompt that repeats an earlier one's prefix reports the
//! reused tokens as OpenAI's `usage.prompt_tokens_details.cached_tokens` (whole responses, the
//! closing usage chunk of a stream, chat), its answer is the one computed without the cache,
//! and `/metrics` counts queries, hits and blocks per rank. One test binary of its own: the
//! Prometheus recorder is process-wide.

mod common;

use common::{engine_config, json_chunks, read_sse, sample, TestServer};
use rackfill_engine::EngineConfig;
use rackfill_server::ServerConfig;
use serde_json::{json, Value};

fn cached(body: &Value) -> u64 {
    body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {body}"))
}

/// Prompt token ids `0..len` spread over the built-in vocabulary.
fn prompt(len: usize) -> Vec<u32> {
    (0..len).map(|i| (i * 37 % 500) as u32 + 10).collect()
}

async fn complete(server: &TestServer, tokens: &[u32], echo: bool) -> Value {
    let body = json!({
        "prompt": tokens, "max_tokens": 3, "temperature": 0, "ignore_eos": true,
        "echo": echo, "logprobs": 2,
    });
    let (status, body) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{body}");
    body
}

fn no_cache() -> EngineConfig {
    let mut config = engine_config(2);
    config.scheduler.prefix_caching = false;
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_prefixes_are_reported_in_usage_and_metrics() {
    let server = TestServer::start(ServerConfig::default()).await;
    let reference = TestServer::start_with(ServerConfig::default(), no_cache()).await;
    let first = prompt(80);
    let mut second = first.clone();
    second.extend(prompt(13));

    let body = complete(&server, &first, false).await;
    assert_eq!(cached(&body), 0);
    // The first request cached 80 + 2 tokens: five whole blocks of 16 shared with `second`.
    let hit = complete(&server, &second, false).await;
    assert_eq!(cached(&hit), 80);
    assert_eq!(hit["usage"]["prompt_tokens"], 93);
    let miss = complete(&reference, &second, false).await;
    assert_eq!(cached(&miss), 0);
    assert_eq!(hit["choices"][0]["text"], miss["choices"][0]["text"]);

    // Echo reuses one token fewer than the blocks hold, and returns every prompt logprob.
    complete(&server, &second, true).await;
    let echoed = complete(&server, &second, true).await;
    assert_eq!(cached(&echoed), 5 * 16 - 1);
    let reference_echo = complete(&reference, &second, true).await;
    let logprobs = |b: &Value| b["choices"][0]["logprobs"]["token_logprobs"].clone();
    let (a, b) = (logprobs(&echoed), logprobs(&reference_echo));
    assert_eq!(a.as_array().unwrap().len(), 93 + 3);
    for (x, y) in a.as_array().unwrap().iter().zip(b.as_array().unwrap()) {
        match (x.as_f64(), y.as_f64()) {
            (Some(x), Some(y)) => assert!((x - y).abs() <= 1e-5, "{x} vs {y}"),
            _ => assert_eq!(x, y),
        }
    }

    // A stream reports the cached tokens in its closing usage chunk.
    let request = json!({
        "prompt": second, "max_tokens": 2, "stream": true,
        "stream_options": {"include_usage": true},
    });
    let response = reqwest::Client::new()
        .post(server.url("/v1/completions"))
        .json(&request)
        .send()
        .await
        .unwrap();
    let chunks = json_chunks(&read_sse(response).await);
    let last = chunks.last().expect("a usage chunk");
    assert_eq!(cached(last), 80);

    // Chat: the same conversation again reuses its templated prompt's whole blocks.
    let messages = json!([{"role": "user", "content": "tell me a story about a cat ".repeat(8)}]);
    let chat = json!({"messages": messages, "max_tokens": 2});
    let (_, first_chat) = server.post("/v1/chat/completions", &chat).await;
    let (_, again) = server.post("/v1/chat/completions", &chat).await;
    let prompt_tokens = again["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(cached(&first_chat), 0);
    let whole_blocks = prompt_tokens / 16 * 16;
    assert_eq!(
        cached(&again),
        whole_blocks.min(prompt_tokens - 1),
        "{again}"
    );

    // The engine records its gauges after the step that sent the last response: poll.
    let mut metrics = String::new();
    for _ in 0..100 {
        metrics = server.get("/metrics").await.1;
        let used = sample(&metrics, "rackfill:kv_blocks", &["state=\"used\""]);
        if sample(&metrics, "rackfill:prefix_cache_queries_total", &[]) == 7.0 && used == 0.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let total = |name: &str| sample(&metrics, name, &[]);
    // Seven requests; the first echo found no block with stored logprobs, so four hit.
    assert_eq!(
        total("rackfill:prefix_cache_queries_total"),
        7.0,
        "{metrics}"
    );
    assert_eq!(total("rackfill:prefix_cache_hits_total"), 4.0);
    let hit_tokens = total("rackfill:prefix_cache_hit_tokens_total");
    assert_eq!(hit_tokens as u64, 80 + 79 + 80 + cached(&again));
    assert!(total("rackfill:prefix_cache_queried_tokens_total") > hit_tokens);
    assert!(sample(&metrics, "rackfill:kv_blocks", &["state=\"cached\""]) >= 5.0);
    assert_eq!(
        sample(&metrics, "rackfill:kv_blocks", &["state=\"used\""]),
        0.0
    );
    assert_eq!(total("rackfill:kv_blocks_evicted_total"), 0.0);
    let rate = sample(&metrics, "rackfill:prefix_cache_hit_rate", &["rank=\"0\""]);
    assert!(rate > 0.0 && rate < 1.0, "{rate}");
}
