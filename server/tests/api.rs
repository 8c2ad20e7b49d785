//! The OpenAI API end to end: a real server on an ephemeral port serving the built-in model
//! (EP 2), a real HTTP client, streams parsed as SSE.

mod common;

use std::time::Duration;

use common::{json_chunks, read_sse, TestServer};
use rackfill_engine::{Event, GenerateRequest, RequestStream, SamplingParams};
use rackfill_models::{ChatMessage, BUILTIN_MODEL_NAME};
use rackfill_server::{Backend, ChatRender, ServerConfig};
use serde_json::{json, Value};

const PROMPT: &str = "The quick brown fox jumps over the lazy dog";

/// Validates and queues one sequence straight on the backend, as a handler would.
fn submit_one(backend: &dyn Backend, request: GenerateRequest) -> RequestStream {
    let validated = backend.validate(vec![request]).unwrap();
    backend.submit(validated).unwrap().remove(0)
}

fn choice_texts(body: &Value) -> Vec<String> {
    body["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_string_batch_and_token_ids() {
    let server = TestServer::start(ServerConfig::default()).await;
    let ids = server.state.backend().tokenize(PROMPT, true).unwrap();

    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"model": BUILTIN_MODEL_NAME, "prompt": PROMPT, "max_tokens": 6,
                    "temperature": 0, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["model"], BUILTIN_MODEL_NAME);
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(body["choices"].as_array().unwrap().len(), 1);
    assert_eq!(body["choices"][0]["index"], 0);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert!(body["choices"][0]["logprobs"].is_null());
    assert_eq!(body["usage"]["prompt_tokens"], ids.len());
    assert_eq!(body["usage"]["completion_tokens"], 6);
    assert_eq!(body["usage"]["total_tokens"], ids.len() + 6);
    let greedy = choice_texts(&body)[0].clone();

    // The same prompt as token ids gives the same greedy text; `model` may be omitted.
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(choice_texts(&body), vec![greedy.clone()]);

    // A batch of strings: one choice per prompt, in order.
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": [PROMPT, "Hello"], "max_tokens": 6, "temperature": 0,
                    "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let texts = choice_texts(&body);
    assert_eq!(texts.len(), 2);
    assert_eq!(texts[0], greedy);
    assert_eq!(body["choices"][1]["index"], 1);
    let hello = server.state.backend().tokenize("Hello", true).unwrap();
    assert_eq!(body["usage"]["prompt_tokens"], ids.len() + hello.len());
    assert_eq!(body["usage"]["completion_tokens"], 12);

    // A batch of token-id prompts.
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": [ids, hello], "max_tokens": 6, "temperature": 0,
                    "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(choice_texts(&body)[0], greedy);
    assert_eq!(body["choices"].as_array().unwrap().len(), 2);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_n_and_seed() {
    let server = TestServer::start(ServerConfig::default()).await;
    let request = json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "n": 2,
                         "seed": 1234, "ignore_eos": true});
    let (status, first) = server.post("/v1/completions", &request).await;
    assert_eq!(status, 200, "{first}");
    let texts = choice_texts(&first);
    assert_eq!(texts.len(), 2);
    assert_eq!(first["choices"][0]["index"], 0);
    assert_eq!(first["choices"][1]["index"], 1);
    assert_eq!(first["usage"]["completion_tokens"], 16);
    // Same seed, same samples.
    let (_, second) = server.post("/v1/completions", &request).await;
    assert_eq!(choice_texts(&second), texts);
    server.shutdown().await.unwrap();
}

/// Penalties, `min_p` and `logit_bias` change which tokens are drawn; the logprobs stay the
/// model's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_min_p_and_logit_bias_steer_sampling() {
    let server = TestServer::start(ServerConfig::default()).await;
    let greedy_request = json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                "ignore_eos": true, "logprobs": 1});
    let (status, greedy) = server.post("/v1/completions", &greedy_request).await;
    assert_eq!(status, 200, "{greedy}");
    let first = &greedy["choices"][0]["logprobs"]["top_logprobs"][0];
    let first_token = greedy["choices"][0]["logprobs"]["tokens"][0].clone();
    let first_logprob = greedy["choices"][0]["logprobs"]["token_logprobs"][0].clone();
    assert_eq!(first[first_token.as_str().unwrap()], first_logprob);

    // min_p = 1 keeps only the most likely token: sampling at temperature 1 is greedy.
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 1, "min_p": 1.0,
                    "ignore_eos": true, "logprobs": 1}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(choice_texts(&body), choice_texts(&greedy));

    // A +100 bias forces one token everywhere.
    let backend = server.state.backend();
    let forced = *backend.tokenize(" fox", false).unwrap().last().unwrap();
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": true,
                    "logit_bias": {forced.to_string(): 100}}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        choice_texts(&body)[0],
        backend.detokenize(&[forced; 4]).unwrap()
    );

    // A -100 bias on the greedy first token moves the pick, but the reported alternatives are
    // still the model's: the banned token stays the most likely one, with its logprob.
    let mut stream = submit_one(
        backend.as_ref(),
        GenerateRequest {
            prompt: backend.tokenize(PROMPT, true).unwrap(),
            params: SamplingParams {
                temperature: 0.0,
                max_tokens: 1,
                ..SamplingParams::default()
            },
        },
    );
    let mut greedy_id = None;
    while let Some(event) = stream.events.recv().await {
        if let Event::Token(token) = event {
            greedy_id = Some(token.token);
        }
    }
    let greedy_id = greedy_id.expect("one greedy token");
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": true,
                    "logprobs": 1,
                    "logit_bias": {greedy_id.to_string(): -100}}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let logprobs = &body["choices"][0]["logprobs"];
    assert_ne!(logprobs["tokens"][0], first_token);
    // Within 1e-5, not bit for bit: this request reuses the earlier ones' cached prompt KV
    // and computes only the prompt's last token, in a GEMM of another shape.
    let banned = logprobs["top_logprobs"][0][first_token.as_str().unwrap()].as_f64();
    assert!((banned.unwrap() - first_logprob.as_f64().unwrap()).abs() <= 1e-5);

    // Penalties are accepted on both routes and keep greedy decoding deterministic.
    let penalised = json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                           "ignore_eos": true, "presence_penalty": 1.5,
                           "frequency_penalty": 2.0, "repetition_penalty": 1.3});
    let (status, a) = server.post("/v1/completions", &penalised).await;
    assert_eq!(status, 200, "{a}");
    let (_, b) = server.post("/v1/completions", &penalised).await;
    assert_eq!(choice_texts(&a), choice_texts(&b));
    let (status, chat) = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "presence_penalty": -1, "frequency_penalty": 0.5, "min_p": 0.05,
                    "logit_bias": {"5": -5}}),
        )
        .await;
    assert_eq!(status, 200, "{chat}");
    server.shutdown().await.unwrap();
}

/// lm-eval-harness style scoring: `echo` + `logprobs` + `max_tokens: 0` returns the prompt with
/// one logprob per prompt token, the first `null`, the rest equal to the engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_logprobs_scores_the_prompt() {
    let server = TestServer::start(ServerConfig::default()).await;
    let ids = server.state.backend().tokenize(PROMPT, true).unwrap();
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 0, "echo": true, "logprobs": 1,
                    "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["text"], PROMPT);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 0);
    assert_eq!(body["usage"]["prompt_tokens"], ids.len());
    let lp = &choice["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    let token_logprobs = lp["token_logprobs"].as_array().unwrap();
    let top = lp["top_logprobs"].as_array().unwrap();
    assert_eq!(tokens.len(), ids.len());
    assert_eq!(token_logprobs.len(), ids.len());
    assert_eq!(top.len(), ids.len());
    assert_eq!(lp["text_offset"].as_array().unwrap().len(), ids.len());
    assert!(token_logprobs[0].is_null());
    assert!(top[0].is_null());
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(tokens[i], server.state.backend().token_text(id));
    }

    // The engine's own prompt logprobs for the same ids.
    let mut stream = submit_one(
        server.state.backend().as_ref(),
        GenerateRequest {
            prompt: ids.clone(),
            params: SamplingParams {
                temperature: 0.0,
                max_tokens: 0,
                prompt_logprobs: Some(1),
                ..SamplingParams::default()
            },
        },
    );
    let mut engine = None;
    while let Some(event) = stream.events.recv().await {
        if let Event::PromptLogprobs(lp) = event {
            engine = Some(lp);
        }
    }
    let engine = engine.expect("prompt logprobs");
    assert!(engine[0].is_none());
    for i in 1..ids.len() {
        let expected = engine[i].as_ref().unwrap();
        let got = token_logprobs[i]
            .as_f64()
            .expect("a number after the first token");
        // The engine request reuses the HTTP request's cached prefix: equal within 1e-5.
        assert!(
            (got as f32 - expected.logprob).abs() <= 1e-5,
            "position {i}"
        );
        assert!(got <= 0.0);
        // The scored token is among the alternatives, with its own logprob.
        let alternatives = top[i].as_object().unwrap();
        let text = server.state.backend().token_text(ids[i]);
        let alternative = alternatives[&text].as_f64().unwrap() as f32;
        assert!((alternative - expected.logprob).abs() <= 1e-5);
    }

    // Offsets index the returned text even where tokens split characters (byte-level BPE
    // shows those as `bytes:\xNN`), streamed or not.
    let text = "héllo wörld, 日本語 😀!";
    let request = json!({"prompt": text, "max_tokens": 0, "echo": true, "logprobs": 0});
    let (status, unicode) = server.post("/v1/completions", &request).await;
    assert_eq!(status, 200, "{unicode}");
    let chars: Vec<char> = text.chars().collect();
    let unicode_lp = &unicode["choices"][0]["logprobs"];
    let offsets: Vec<usize> = unicode_lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    assert!(offsets.iter().all(|&o| o < chars.len()), "{offsets:?}");
    let mut split = 0;
    for (token, &offset) in unicode_lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .zip(&offsets)
    {
        let token = token.as_str().unwrap();
        if token.starts_with("bytes:") {
            split += 1;
            continue;
        }
        let at: String = chars[offset..].iter().take(token.chars().count()).collect();
        assert_eq!(at, token, "offset {offset} in {offsets:?}");
    }
    assert!(split > 0, "no token splits a character: {unicode_lp}");
    let mut streamed = Vec::new();
    let response = server
        .client
        .post(server.url("/v1/completions"))
        .json(
            &json!({"prompt": text, "max_tokens": 0, "echo": true, "logprobs": 0,
                      "stream": true}),
        )
        .send()
        .await
        .unwrap();
    for chunk in json_chunks(&read_sse(response).await) {
        if let Some(o) = chunk["choices"][0]["logprobs"]["text_offset"].as_array() {
            streamed.extend(o.iter().map(|o| o.as_u64().unwrap() as usize));
        }
    }
    assert_eq!(streamed, offsets);

    // Token-id prompts score the same.
    let (status, by_ids) = server
        .post(
            "/v1/completions",
            &json!({"prompt": ids, "max_tokens": 0, "echo": true, "logprobs": 0}),
        )
        .await;
    assert_eq!(status, 200, "{by_ids}");
    // Within 1e-5: this request reuses the cached blocks (and stored logprobs) of the first.
    let by_ids = by_ids["choices"][0]["logprobs"]["token_logprobs"].clone();
    let by_text = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(by_ids.as_array().unwrap().len(), by_text.len());
    for (a, b) in by_ids.as_array().unwrap().iter().zip(by_text) {
        match (a.as_f64(), b.as_f64()) {
            (Some(a), Some(b)) => assert!((a - b).abs() <= 1e-5, "{a} vs {b}"),
            _ => assert_eq!(a, b),
        }
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_template_stop_and_seed() {
    let server = TestServer::start(ServerConfig::default()).await;
    let messages = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
    ]);
    let (status, body) = server
        .post(
            "/v1/chat/completions",
            &json!({"model": BUILTIN_MODEL_NAME, "messages": messages, "max_tokens": 12,
                    "temperature": 0, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    let content = choice["message"]["content"].as_str().unwrap().to_string();

    // The template was applied: the prompt is the rendered conversation's tokens.
    let backend = server.state.backend();
    let rendered = backend
        .render_chat(
            &[
                ChatMessage {
                    role: "system".into(),
                    content: "You are terse.".into(),
                },
                ChatMessage {
                    role: "user".into(),
                    content: "Name a colour.".into(),
                },
            ],
            &ChatRender::default(),
        )
        .unwrap();
    assert!(rendered.contains("Name a colour."));
    let prompt = backend.tokenize(&rendered, false).unwrap();
    let raw = backend
        .tokenize("You are terse.Name a colour.", false)
        .unwrap();
    assert_eq!(body["usage"]["prompt_tokens"], prompt.len());
    assert!(prompt.len() > raw.len());
    assert_eq!(body["usage"]["completion_tokens"], 12);

    // A stop string taken from the greedy output cuts it there.
    let chars: Vec<char> = content.chars().collect();
    let stop = (2..chars.len().saturating_sub(1))
        .map(|i| chars[i..i + 2].iter().collect::<String>())
        .find(|s| !s.trim().is_empty())
        .unwrap_or_else(|| panic!("greedy output too short for a stop test: {content:?}"));
    {
        let expected = &content[..content.find(&stop).unwrap()];
        let (status, body) = server
            .post(
                "/v1/chat/completions",
                &json!({"messages": messages, "max_tokens": 12, "temperature": 0,
                        "ignore_eos": true, "stop": [stop]}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"][0]["message"]["content"], expected);
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
    }

    // Same seed at temperature 1: same text; logprobs with alternatives.
    let seeded = json!({"messages": messages, "max_completion_tokens": 10, "temperature": 1.0,
                        "seed": 7, "ignore_eos": true, "logprobs": true, "top_logprobs": 3});
    let (status, a) = server.post("/v1/chat/completions", &seeded).await;
    assert_eq!(status, 200, "{a}");
    let (_, b) = server.post("/v1/chat/completions", &seeded).await;
    assert_eq!(
        a["choices"][0]["message"]["content"],
        b["choices"][0]["message"]["content"]
    );
    let lps = a["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(lps.len(), 10);
    for entry in lps {
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
        assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 3);
        assert!(entry["bytes"].is_array());
    }
    server.shutdown().await.unwrap();
}

/// A `stop_token_ids` token ends generation with `stop_reason` naming it (vLLM's field), on
/// completions and chat, streamed or not; a stop string is named as itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_reason_names_the_stop_token_or_string() {
    let server = TestServer::start(ServerConfig::default()).await;
    // A +100 bias makes a whole-word token the first one drawn.
    let id = server.state.backend().tokenize(" world", false).unwrap()[0];
    let text = server.state.backend().token_text(id);
    assert!(
        text.chars().all(|c| c.is_ascii_graphic() || c == ' '),
        "{text}"
    );
    let bias = json!({id.to_string(): 100});
    let forced = json!({"logit_bias": bias, "stop_token_ids": [id], "max_tokens": 5,
                        "temperature": 0});
    let user = json!([{"role": "user", "content": "hi"}]);
    for (route, mut request) in [
        ("/v1/completions", json!({"prompt": "hi"})),
        ("/v1/chat/completions", json!({"messages": user})),
    ] {
        request
            .as_object_mut()
            .unwrap()
            .extend(forced.as_object().unwrap().clone());
        let (status, body) = server.post(route, &request).await;
        assert_eq!(status, 200, "{route}: {body}");
        assert_eq!(body["choices"][0]["finish_reason"], "stop", "{route}");
        assert_eq!(body["choices"][0]["stop_reason"], id, "{route}");
        assert_eq!(body["usage"]["completion_tokens"], 1, "{route}");
        request["stream"] = json!(true);
        let response = server
            .client
            .post(server.url(route))
            .json(&request)
            .send()
            .await
            .unwrap();
        let chunks = json_chunks(&read_sse(response).await);
        let last = &chunks.last().unwrap()["choices"][0];
        assert_eq!(last["finish_reason"], "stop", "{route}");
        assert_eq!(last["stop_reason"], id, "{route}");
    }
    // Without the stop token, the forced token repeats to `max_tokens`; a stop string naming
    // its text stops there instead and is reported as a string.
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": "hi", "logit_bias": bias, "stop": [text.clone()],
                    "max_tokens": 5, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["stop_reason"], json!(text), "{body}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_completions_and_chat_with_usage() {
    let server = TestServer::start(ServerConfig::default()).await;
    let base = json!({"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": true});
    let (_, plain) = server.post("/v1/completions", &base).await;
    let expected = choice_texts(&plain)[0].clone();

    let mut streamed = base.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let response = server
        .client
        .post(server.url("/v1/completions"))
        .json(&streamed)
        .send()
        .await
        .unwrap();
    let chunks = json_chunks(&read_sse(response).await);
    let (usage, body) = chunks.split_last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage["usage"]["completion_tokens"], 10);
    assert_eq!(
        usage["usage"]["prompt_tokens"],
        plain["usage"]["prompt_tokens"]
    );
    let mut text = String::new();
    for chunk in body {
        assert_eq!(chunk["object"], "text_completion");
        assert!(chunk["usage"].is_null());
        text.push_str(chunk["choices"][0]["text"].as_str().unwrap());
    }
    assert_eq!(text, expected);
    assert_eq!(
        body.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );

    // Without include_usage there is no usage chunk, and no `usage` key.
    let mut no_usage = base.clone();
    no_usage["stream"] = json!(true);
    let response = server
        .client
        .post(server.url("/v1/completions"))
        .json(&no_usage)
        .send()
        .await
        .unwrap();
    let chunks = json_chunks(&read_sse(response).await);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    assert!(chunks
        .iter()
        .all(|c| c["choices"].as_array().unwrap().len() == 1));

    // Chat: role first, then content deltas, finish_reason last, usage, [DONE].
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                      "temperature": 0, "ignore_eos": true});
    let (_, plain) = server.post("/v1/chat/completions", &chat).await;
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let response = server
        .client
        .post(server.url("/v1/chat/completions"))
        .json(&streamed)
        .send()
        .await
        .unwrap();
    let chunks = json_chunks(&read_sse(response).await);
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let (usage, body) = chunks.split_last().unwrap();
    assert_eq!(usage["usage"], plain["usage"]);
    let content: String = body
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, plain["choices"][0]["message"]["content"]);
    assert_eq!(
        body.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );

    // Streamed scoring: the echoed prompt comes with its logprobs, the first null.
    let response = server
        .client
        .post(server.url("/v1/completions"))
        .json(
            &json!({"prompt": PROMPT, "max_tokens": 0, "echo": true, "logprobs": 2,
                      "stream": true}),
        )
        .send()
        .await
        .unwrap();
    let chunks = json_chunks(&read_sse(response).await);
    assert_eq!(chunks[0]["choices"][0]["text"], PROMPT);
    let lp = &chunks[0]["choices"][0]["logprobs"];
    assert!(lp["token_logprobs"][0].is_null());
    assert!(lp["token_logprobs"][1].is_number());
    assert_eq!(
        lp["tokens"].as_array().unwrap().len(),
        server.state.backend().tokenize(PROMPT, true).unwrap().len()
    );
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );

    // n = 2 streams interleave both choices, each finishing once.
    let mut two = base.clone();
    two["stream"] = json!(true);
    two["n"] = json!(2);
    let response = server
        .client
        .post(server.url("/v1/completions"))
        .json(&two)
        .send()
        .await
        .unwrap();
    let chunks = json_chunks(&read_sse(response).await);
    for index in 0..2 {
        let text: String = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == index)
            .map(|c| c["choices"][0]["text"].as_str().unwrap())
            .collect();
        assert_eq!(text, expected, "choice {index}");
        let finishes = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == index)
            .filter(|c| !c["choices"][0]["finish_reason"].is_null())
            .count();
        assert_eq!(finishes, 1);
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_version_metrics_and_request_ids() {
    let server = TestServer::start(ServerConfig::default()).await;
    let (status, models) = server.get("/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], BUILTIN_MODEL_NAME);
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["max_model_len"], 4096);
    let (status, card) = server
        .get(&format!("/v1/models/{BUILTIN_MODEL_NAME}"))
        .await;
    assert_eq!(status, 200, "{card}");
    let card: Value = serde_json::from_str(&card).unwrap();
    assert_eq!(card, models["data"][0]);
    // Ids may hold slashes (Hugging Face ids); an unknown one is a 404 naming it.
    let (status, missing) = server.get("/v1/models/Qwen/Qwen3-30B-A3B").await;
    assert_eq!(status, 404);
    let missing: Value = serde_json::from_str(&missing).unwrap();
    assert_eq!(missing["error"]["code"], "model_not_found");
    assert!(missing["error"]["message"]
        .as_str()
        .unwrap()
        .contains("`Qwen/Qwen3-30B-A3B`"));

    let (status, health) = server.get("/health").await;
    assert_eq!(status, 200, "{health}");
    let (status, version) = server.get("/version").await;
    assert_eq!(status, 200);
    assert!(version.contains(env!("CARGO_PKG_VERSION")));

    // Request ids: echoed when sent, generated otherwise.
    let response = server
        .client
        .post(server.url("/v1/completions"))
        .header("x-request-id", "abc-123")
        .json(&json!({"prompt": PROMPT, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.headers()["x-request-id"], "abc-123");
    let response = server
        .client
        .get(server.url("/health"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.headers()["x-request-id"].to_str().unwrap().len(),
        32
    );

    let (status, metrics) = server.get("/metrics").await;
    assert_eq!(status, 200);
    for name in [
        "rackfill:moe_imbalance_before",
        "rackfill:moe_imbalance_after_bucket",
        "rackfill:http_requests_total",
        "rackfill:http_request_duration_seconds_bucket",
        "rackfill:time_to_first_token_seconds_bucket",
        "rackfill:e2e_request_latency_seconds_bucket",
        "rackfill:request_queue_time_seconds_bucket",
        "rackfill:prompt_tokens_total",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
    assert!(metrics.contains("route=\"/v1/completions\""), "{metrics}");
    // Every series is described for the scraper's users.
    for line in metrics.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = line.split_whitespace().nth(2).unwrap();
        assert!(
            metrics.contains(&format!("# HELP {name} ")),
            "{name} has no HELP line"
        );
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required_on_v1() {
    let server = TestServer::start(ServerConfig {
        api_key: Some("sekret".into()),
        ..ServerConfig::default()
    })
    .await;
    let body = json!({"prompt": PROMPT, "max_tokens": 1});
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("Bearer sekre"),
        Some("sekret"),
    ] {
        let mut request = server
            .client
            .post(server.url("/v1/completions"))
            .json(&body);
        if let Some(auth) = auth {
            request = request.header("authorization", auth);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status().as_u16(), 401, "{auth:?}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["type"], "authentication_error");
        assert_eq!(body["error"]["code"], "invalid_api_key");
    }
    let response = server
        .client
        .post(server.url("/v1/completions"))
        .bearer_auth("sekret")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let response = server
        .client
        .get(server.url("/v1/models"))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    // Health and metrics stay open for probes and scrapers.
    assert_eq!(server.get("/health").await.0, 200);
    assert_eq!(server.get("/metrics").await.0, 200);
    assert_eq!(server.get("/v1/models").await.0, 401);
    server.shutdown().await.unwrap();
}

/// One bad input: name, route, raw body, expected status, `param` and `code`.
type Case = (
    &'static str,
    &'static str,
    Vec<u8>,
    u16,
    Option<&'static str>,
    Option<&'static str>,
);

/// Every bad input, its exact status, `param` and `code`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_table() {
    let server = TestServer::start(ServerConfig {
        max_body_bytes: 16 * 1024,
        ..ServerConfig::default()
    })
    .await;
    const C: &str = "/v1/completions";
    const CHAT: &str = "/v1/chat/completions";
    let user = json!([{"role": "user", "content": "hi"}]);
    let long_prompt: Vec<u32> = (0..100).map(|i| 10 + i).collect();
    let cases: Vec<Case> = vec![
        (
            "malformed json",
            C,
            b"{\"prompt\": ".to_vec(),
            400,
            None,
            Some("invalid_json"),
        ),
        (
            "trailing garbage",
            C,
            b"{\"prompt\": \"x\"} x".to_vec(),
            400,
            None,
            Some("invalid_json"),
        ),
        (
            "not an object",
            C,
            b"[1, 2]".to_vec(),
            400,
            None,
            Some("invalid_type"),
        ),
        ("empty body", C, Vec::new(), 400, None, Some("invalid_json")),
        (
            "missing prompt",
            C,
            b"{}".to_vec(),
            400,
            Some("prompt"),
            Some("invalid_type"),
        ),
        (
            "temperature type",
            C,
            body(json!({"prompt": "x", "temperature": "hot"})),
            400,
            Some("temperature"),
            Some("invalid_type"),
        ),
        (
            "max_tokens type",
            C,
            body(json!({"prompt": "x", "max_tokens": "ten"})),
            400,
            Some("max_tokens"),
            Some("invalid_type"),
        ),
        (
            "max_tokens float",
            C,
            body(json!({"prompt": "x", "max_tokens": 1.5})),
            400,
            Some("max_tokens"),
            Some("invalid_type"),
        ),
        (
            "stream type",
            C,
            body(json!({"prompt": "x", "stream": "yes"})),
            400,
            Some("stream"),
            Some("invalid_type"),
        ),
        (
            "include_usage type",
            C,
            body(json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}})),
            400,
            Some("stream_options.include_usage"),
            Some("invalid_type"),
        ),
        (
            "negative max_tokens",
            C,
            body(json!({"prompt": "x", "max_tokens": -1})),
            400,
            Some("max_tokens"),
            Some("invalid_value"),
        ),
        (
            "temperature 3",
            C,
            body(json!({"prompt": "x", "temperature": 3})),
            400,
            Some("temperature"),
            Some("invalid_value"),
        ),
        (
            "negative temperature",
            C,
            body(json!({"prompt": "x", "temperature": -0.5})),
            400,
            Some("temperature"),
            Some("invalid_value"),
        ),
        (
            "top_p 0",
            C,
            body(json!({"prompt": "x", "top_p": 0})),
            400,
            Some("top_p"),
            Some("invalid_value"),
        ),
        (
            "top_p 1.5",
            C,
            body(json!({"prompt": "x", "top_p": 1.5})),
            400,
            Some("top_p"),
            Some("invalid_value"),
        ),
        (
            "top_k -2",
            C,
            body(json!({"prompt": "x", "top_k": -2})),
            400,
            Some("top_k"),
            Some("invalid_value"),
        ),
        (
            "n 0",
            C,
            body(json!({"prompt": "x", "n": 0})),
            400,
            Some("n"),
            Some("invalid_value"),
        ),
        (
            "n too large",
            C,
            body(json!({"prompt": "x", "n": 1000})),
            400,
            Some("n"),
            Some("invalid_value"),
        ),
        (
            "logprobs 21",
            C,
            body(json!({"prompt": "x", "logprobs": 21})),
            400,
            Some("logprobs"),
            Some("invalid_value"),
        ),
        (
            "prompt number",
            C,
            body(json!({"prompt": 5})),
            400,
            Some("prompt"),
            Some("invalid_value"),
        ),
        (
            "prompt null",
            C,
            body(json!({"prompt": null})),
            400,
            Some("prompt"),
            Some("invalid_value"),
        ),
        (
            "prompt empty list",
            C,
            body(json!({"prompt": []})),
            400,
            Some("prompt"),
            Some("invalid_value"),
        ),
        (
            "prompt empty string",
            C,
            body(json!({"prompt": ""})),
            400,
            Some("prompt[0]"),
            Some("invalid_value"),
        ),
        (
            "prompt negative id",
            C,
            body(json!({"prompt": [1, -1]})),
            400,
            Some("prompt[1]"),
            Some("invalid_value"),
        ),
        (
            "prompt mixed list",
            C,
            body(json!({"prompt": ["a", 1]})),
            400,
            Some("prompt[1]"),
            Some("invalid_value"),
        ),
        (
            "prompt id outside vocab",
            C,
            body(json!({"prompt": [1, 99999999]})),
            400,
            Some("prompt"),
            Some("invalid_value"),
        ),
        (
            "prompt empty id list",
            C,
            body(json!({"prompt": [[1, 2], []]})),
            400,
            Some("prompt[1]"),
            Some("invalid_value"),
        ),
        (
            "stop number",
            C,
            body(json!({"prompt": "x", "stop": 5})),
            400,
            Some("stop"),
            Some("invalid_value"),
        ),
        (
            "five stops",
            C,
            body(json!({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]})),
            400,
            Some("stop"),
            Some("invalid_value"),
        ),
        (
            "empty stop",
            C,
            body(json!({"prompt": "x", "stop": [""]})),
            400,
            Some("stop"),
            Some("invalid_value"),
        ),
        (
            "stream_options without stream",
            C,
            body(json!({"prompt": "x", "stream_options": {"include_usage": true}})),
            400,
            Some("stream_options"),
            Some("invalid_value"),
        ),
        (
            "presence_penalty out of range",
            C,
            body(json!({"prompt": "x", "presence_penalty": 2.5})),
            400,
            Some("presence_penalty"),
            Some("invalid_value"),
        ),
        (
            "frequency_penalty out of range",
            CHAT,
            body(json!({"messages": user, "frequency_penalty": -3})),
            400,
            Some("frequency_penalty"),
            Some("invalid_value"),
        ),
        (
            "repetition_penalty zero",
            C,
            body(json!({"prompt": "x", "repetition_penalty": 0})),
            400,
            Some("repetition_penalty"),
            Some("invalid_value"),
        ),
        (
            "min_p above one",
            C,
            body(json!({"prompt": "x", "min_p": 1.5})),
            400,
            Some("min_p"),
            Some("invalid_value"),
        ),
        (
            "logit_bias key not a token id",
            C,
            body(json!({"prompt": "x", "logit_bias": {"cat": 1}})),
            400,
            Some("logit_bias.cat"),
            Some("invalid_value"),
        ),
        (
            "logit_bias value not a number",
            CHAT,
            body(json!({"messages": user, "logit_bias": {"5": "up"}})),
            400,
            Some("logit_bias.5"),
            Some("invalid_value"),
        ),
        (
            "logit_bias out of range",
            C,
            body(json!({"prompt": "x", "logit_bias": {"5": 101}})),
            400,
            Some("logit_bias"),
            Some("invalid_value"),
        ),
        (
            "logit_bias id outside the vocabulary",
            C,
            body(json!({"prompt": "x", "logit_bias": {"4096": 1}})),
            400,
            Some("logit_bias"),
            Some("invalid_value"),
        ),
        (
            "best_of",
            C,
            body(json!({"prompt": "x", "best_of": 3})),
            400,
            Some("best_of"),
            Some("invalid_value"),
        ),
        (
            "unknown model",
            C,
            body(json!({"prompt": "x", "model": "gpt-9"})),
            404,
            Some("model"),
            Some("model_not_found"),
        ),
        (
            "too long",
            C,
            body(json!({"prompt": long_prompt, "max_tokens": 5000})),
            400,
            Some("prompt"),
            Some("context_length_exceeded"),
        ),
        (
            "body too big",
            C,
            body(json!({"prompt": "x".repeat(64 * 1024)})),
            413,
            None,
            Some("payload_too_large"),
        ),
        (
            "chat missing messages",
            CHAT,
            body(json!({"model": BUILTIN_MODEL_NAME})),
            400,
            Some("messages"),
            Some("invalid_type"),
        ),
        (
            "chat empty messages",
            CHAT,
            body(json!({"messages": []})),
            400,
            Some("messages"),
            Some("invalid_value"),
        ),
        (
            "chat messages type",
            CHAT,
            body(json!({"messages": "hi"})),
            400,
            Some("messages"),
            Some("invalid_type"),
        ),
        (
            "chat missing role",
            CHAT,
            body(json!({"messages": [{"content": "hi"}]})),
            400,
            Some("messages[0].role"),
            Some("invalid_type"),
        ),
        (
            "chat bad role",
            CHAT,
            body(json!({"messages": [{"role": "wizard", "content": "hi"}]})),
            400,
            Some("messages[0].role"),
            Some("invalid_value"),
        ),
        (
            "chat content number",
            CHAT,
            body(json!({"messages": [{"role": "user", "content": 5}]})),
            400,
            Some("messages[0].content"),
            Some("invalid_value"),
        ),
        (
            "chat image part",
            CHAT,
            body(
                json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            ),
            400,
            Some("messages[0].content[0]"),
            Some("invalid_value"),
        ),
        (
            "chat top_logprobs without logprobs",
            CHAT,
            body(json!({"messages": user, "top_logprobs": 2})),
            400,
            Some("top_logprobs"),
            Some("invalid_value"),
        ),
        (
            "chat top_logprobs 21",
            CHAT,
            body(json!({"messages": user, "logprobs": true, "top_logprobs": 21})),
            400,
            Some("top_logprobs"),
            Some("invalid_value"),
        ),
        (
            "chat logprobs type",
            CHAT,
            body(json!({"messages": user, "logprobs": 3})),
            400,
            Some("logprobs"),
            Some("invalid_type"),
        ),
        (
            "chat negative max_completion_tokens",
            CHAT,
            body(json!({"messages": user, "max_completion_tokens": -5})),
            400,
            Some("max_completion_tokens"),
            Some("invalid_value"),
        ),
        (
            "chat temperature 3",
            CHAT,
            body(json!({"messages": user, "temperature": 3})),
            400,
            Some("temperature"),
            Some("invalid_value"),
        ),
        (
            "chat tools",
            CHAT,
            body(json!({"messages": user, "tools": [{"type": "function"}]})),
            400,
            Some("tools"),
            Some("invalid_value"),
        ),
        (
            // 2 x 200 sequences: more than the engine queues (256), so never admissible; a
            // 429 would have the client retry forever.
            "more sequences than the queue holds",
            C,
            body(json!({"prompt": ["a", "b"], "n": 200, "max_tokens": 1})),
            400,
            Some("n"),
            Some("invalid_value"),
        ),
        (
            "chat unknown model",
            CHAT,
            body(json!({"messages": user, "model": "nope"})),
            404,
            Some("model"),
            Some("model_not_found"),
        ),
        (
            "chat too long",
            CHAT,
            body(json!({"messages": user, "max_tokens": 4096})),
            400,
            Some("messages"),
            Some("context_length_exceeded"),
        ),
        (
            "chat body too big",
            CHAT,
            body(json!({"messages": [{"role": "user", "content": "y".repeat(64 * 1024)}]})),
            413,
            None,
            Some("payload_too_large"),
        ),
    ];
    for (name, route, raw, status, param, code) in cases {
        let (got, body) = server.post_raw(route, raw).await;
        assert_eq!(got, status, "{name}: {body}");
        let error = &body["error"];
        assert!(error.is_object(), "{name}: no error envelope: {body}");
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{name}"
        );
        assert!(error["type"].is_string(), "{name}");
        assert_eq!(error["param"].as_str(), param, "{name}: {body}");
        assert_eq!(error["code"].as_str(), code, "{name}: {body}");
    }

    // The context-length message names both numbers.
    let (_, body) = server
        .post(C, &json!({"prompt": long_prompt, "max_tokens": 5000}))
        .await;
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("4096") && message.contains("100") && message.contains("5000"),
        "{message}"
    );

    // Unknown routes and methods.
    let (status, text) = server.get("/v1/nope").await;
    assert_eq!(status, 404);
    assert!(text.contains("\"error\""));
    for (method, route, allow) in [
        (reqwest::Method::GET, C, "POST"),
        (reqwest::Method::PUT, CHAT, "POST"),
        (reqwest::Method::DELETE, "/v1/models", "GET,HEAD"),
    ] {
        let response = server
            .client
            .request(method.clone(), server.url(route))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 405, "{method} {route}");
        assert_eq!(response.headers()["allow"], allow, "{method} {route}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], "method_not_allowed", "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    }

    // The server still serves after all of that.
    let (status, _) = server
        .post(C, &json!({"prompt": "x", "max_tokens": 1}))
        .await;
    assert_eq!(status, 200);
    server.shutdown().await.unwrap();
}

fn body(value: Value) -> Vec<u8> {
    serde_json::to_vec(&value).unwrap()
}

/// Odd bodies never crash the server or produce a 5xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_panics_on_odd_inputs() {
    let server = TestServer::start(ServerConfig::default()).await;
    let values = [
        json!(null),
        json!(true),
        json!(-1),
        json!(1e300),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(""),
        json!("\u{0}\u{ffff}"),
        json!([]),
        json!([[]]),
        json!([null]),
        json!({}),
        json!({"a": [1, {"b": null}]}),
        json!(0.5),
        json!(4294967296u64),
    ];
    let fields = [
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stop",
        "seed",
        "stream",
        "stream_options",
        "logprobs",
        "echo",
        "user",
        "best_of",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "suffix",
        "stop_token_ids",
        "ignore_eos",
        "messages",
        "top_logprobs",
        "max_completion_tokens",
        "model",
    ];
    let mut checked = 0;
    for route in ["/v1/completions", "/v1/chat/completions"] {
        for field in fields {
            for value in &values {
                let mut request = if route == "/v1/completions" {
                    json!({"prompt": "hi", "max_tokens": 1})
                } else {
                    json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                           "max_completion_tokens": 1})
                };
                request[field] = value.clone();
                // Keep generations short whatever the field: a null cap means "up to the
                // context length".
                if field == "max_completion_tokens" && value.is_null() {
                    continue;
                }
                if request.get("stream") == Some(&json!(true)) {
                    continue;
                }
                let (status, body) = server.post(route, &request).await;
                assert!(
                    status == 200 || (400..500).contains(&status),
                    "{route} {field}={value}: {status} {body}"
                );
                if status != 200 {
                    assert!(body["error"]["message"].is_string(), "{body}");
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 500);
    let (status, _) = server.get("/health").await;
    assert_eq!(status, 200);
    server.shutdown().await.unwrap();
}

/// Beyond `max_concurrent_requests` requests get 429; the admitted ones all complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_limit_gives_429_and_loses_nothing() {
    use futures_util::StreamExt;
    let server = TestServer::start(ServerConfig {
        max_concurrent_requests: 2,
        ..ServerConfig::default()
    })
    .await;
    let request = json!({"prompt": PROMPT, "max_tokens": 48, "temperature": 0,
                         "ignore_eos": true, "stream": true});
    // Two admitted streams, each holding its permit until it ends.
    let mut streams = Vec::new();
    for _ in 0..2 {
        let response = server
            .client
            .post(server.url("/v1/completions"))
            .json(&request)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 200);
        streams.push(response);
    }
    assert_eq!(server.state.in_flight(), 2);
    for _ in 0..3 {
        let (status, body) = server
            .post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}))
            .await;
        assert_eq!(status, 429, "{body}");
        assert_eq!(body["error"]["type"], "rate_limit_error");
    }
    // Both admitted requests deliver every token.
    for response in streams {
        let mut parser = common::SseParser::default();
        let mut events = Vec::new();
        let mut bytes = response.bytes_stream();
        while let Some(chunk) = bytes.next().await {
            events.extend(parser.feed(&chunk.unwrap()));
        }
        let chunks = json_chunks(&events);
        let text: String = chunks
            .iter()
            .map(|c| c["choices"][0]["text"].as_str().unwrap())
            .collect();
        assert!(!text.is_empty());
        assert_eq!(
            chunks.last().unwrap()["choices"][0]["finish_reason"],
            "length"
        );
    }
    wait_until(|| server.state.in_flight() == 0).await;
    let (status, _) = server
        .post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}))
        .await;
    assert_eq!(status, 200);
    server.shutdown().await.unwrap();
}

async fn wait_until(mut condition: impl FnMut() -> bool) {
    for _ in 0..400 {
        if condition() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("condition not reached in 10 s");
}

/// A client that goes away mid-stream cancels its request (its admission permit is released
/// long before `max_tokens` could have been generated).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels() {
    use futures_util::StreamExt;
    let server = TestServer::start(ServerConfig::default()).await;
    let response = server
        .client
        .post(server.url("/v1/completions"))
        .json(
            &json!({"prompt": PROMPT, "max_tokens": 3900, "ignore_eos": true,
                      "stream": true}),
        )
        .send()
        .await
        .unwrap();
    let mut bytes = response.bytes_stream();
    let first = bytes.next().await.unwrap().unwrap();
    assert!(!first.is_empty());
    assert_eq!(server.state.in_flight(), 1);
    drop(bytes);
    wait_until(|| server.state.in_flight() == 0).await;
    server.shutdown().await.unwrap();
}

/// Shutdown lets an in-flight stream finish, then refuses new connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_drains_in_flight() {
    let mut server = TestServer::start(ServerConfig::default()).await;
    let response = server
        .client
        .post(server.url("/v1/completions"))
        .json(
            &json!({"prompt": PROMPT, "max_tokens": 40, "ignore_eos": true,
                      "temperature": 0, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    server.trigger_shutdown();
    wait_until(|| server.state.is_draining()).await;
    let chunks = json_chunks(&read_sse(response).await);
    let finished = chunks.last().unwrap();
    assert_eq!(finished["choices"][0]["finish_reason"], "length");
    let addr = server.addr;
    let state = server.state.clone();
    server.join().await.unwrap();
    assert!(
        !state.backend().health().is_alive(),
        "the engine was shut down"
    );
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

/// While it drains, the server keeps its listener open for `health_grace` after the last
/// request finished: new connections get 503 (generation and `/health`), not a refused
/// connection, so a load balancer's probes see it go; then the listener closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_server_answers_503_for_the_health_grace_then_closes() {
    let grace = Duration::from_millis(1500);
    let mut server = TestServer::start(ServerConfig {
        health_grace: grace,
        ..ServerConfig::default()
    })
    .await;
    assert_eq!(server.get("/health").await.0, 200);
    server.trigger_shutdown();
    let asked = std::time::Instant::now();
    wait_until(|| server.state.is_draining()).await;
    // A fresh client: a new connection, as a prober or a new user opens.
    let fresh = reqwest::Client::new();
    let health = fresh.get(server.url("/health")).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 503);
    let body: Value = health.json().await.unwrap();
    assert_eq!(body["error"]["message"], "the server is shutting down");
    let late = fresh
        .post(server.url("/v1/completions"))
        .json(&json!({"prompt": PROMPT, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(late.status().as_u16(), 503);
    let addr = server.addr;
    server.join().await.unwrap();
    assert!(
        asked.elapsed() >= grace,
        "closed after {:?}",
        asked.elapsed()
    );
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

/// Past `shutdown_timeout`, in-flight streams are cancelled with a final error event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_timeout_cancels_stragglers() {
    let mut server = TestServer::start(ServerConfig {
        shutdown_timeout: Duration::from_millis(200),
        ..ServerConfig::default()
    })
    .await;
    let response = server
        .client
        .post(server.url("/v1/chat/completions"))
        .json(
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3900,
                      "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    server.trigger_shutdown();
    let events = read_sse(response).await;
    let chunks = json_chunks(&events);
    let last = chunks.last().unwrap();
    assert_eq!(last["error"]["code"], "service_unavailable", "{last}");
    server.join().await.unwrap();
}

/// A stopped engine: `/health` and generation requests answer 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_engine_gives_503() {
    let server = TestServer::start(ServerConfig::default()).await;
    let backend = std::sync::Arc::clone(server.state.backend());
    tokio::task::spawn_blocking(move || backend.shutdown())
        .await
        .unwrap();
    let (status, body) = server.get("/health").await;
    assert_eq!(status, 503, "{body}");
    for (route, request) in [
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 1})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
        ),
    ] {
        let (status, body) = server.post(route, &request).await;
        assert_eq!(status, 503, "{route}: {body}");
        assert_eq!(body["error"]["code"], "service_unavailable");
    }
    server.shutdown().await.unwrap();
}

/// `min_tokens` (vLLM's): before it, no stop token is drawn and no stop string matches; then
/// they work as usual. Above `max_tokens` it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_tokens_holds_off_stop_tokens_and_strings() {
    let server = TestServer::start(ServerConfig::default()).await;
    // A +100 bias makes this token the one drawn whenever it may be.
    let id = server.state.backend().tokenize(" world", false).unwrap()[0];
    let text = server.state.backend().token_text(id);
    let bias = json!({id.to_string(): 100});
    let eos = rackfill_models::ModelBundle::load(None)
        .unwrap()
        .stop_token_ids[0];
    let user = json!([{"role": "user", "content": "hi"}]);
    for (route, base) in [
        ("/v1/completions", json!({"prompt": "hi"})),
        ("/v1/chat/completions", json!({"messages": user})),
    ] {
        let post = |extra: Value| {
            let mut request = base.clone();
            request
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let server = &server;
            async move { server.post(route, &request).await }
        };
        // A stop token: the first token without `min_tokens`, the 5th with 4.
        for (min_tokens, completion_tokens) in [(0, 1), (4, 5)] {
            let (status, body) = post(json!({"logit_bias": bias, "stop_token_ids": [id],
                "max_tokens": 8, "min_tokens": min_tokens, "temperature": 0}))
            .await;
            assert_eq!(status, 200, "{route}: {body}");
            let choice = &body["choices"][0];
            assert_eq!(choice["finish_reason"], "stop", "{route}: {body}");
            assert_eq!(choice["stop_reason"], id, "{route}: {body}");
            assert_eq!(
                body["usage"]["completion_tokens"], completion_tokens,
                "{route}: {body}"
            );
        }
        // End-of-sequence alike (`stop_reason` null).
        let (status, body) = post(json!({"logit_bias": {eos.to_string(): 100},
            "max_tokens": 8, "min_tokens": 3, "temperature": 0}))
        .await;
        assert_eq!(status, 200, "{route}: {body}");
        assert_eq!(
            body["choices"][0]["finish_reason"], "stop",
            "{route}: {body}"
        );
        assert!(body["choices"][0]["stop_reason"].is_null(), "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 4, "{route}: {body}");
        // A stop string naming the forced token's text matches from the 4th token on.
        let request = json!({"logit_bias": bias, "stop": [text.clone()], "max_tokens": 8,
                             "min_tokens": 3, "temperature": 0});
        let (status, body) = post(request.clone()).await;
        assert_eq!(status, 200, "{route}: {body}");
        assert_eq!(body["choices"][0]["stop_reason"], json!(text), "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 4, "{route}: {body}");
        let content = match route {
            "/v1/completions" => body["choices"][0]["text"].clone(),
            _ => body["choices"][0]["message"]["content"].clone(),
        };
        assert_eq!(content, json!(text.repeat(3)), "{route}: {body}");
        // Streamed, the same text.
        let mut streamed = base.clone();
        streamed
            .as_object_mut()
            .unwrap()
            .extend(request.as_object().unwrap().clone());
        streamed["stream"] = json!(true);
        let response = server
            .client
            .post(server.url(route))
            .json(&streamed)
            .send()
            .await
            .unwrap();
        let chunks = json_chunks(&read_sse(response).await);
        let joined: String = chunks
            .iter()
            .filter_map(|c| {
                let choice = &c["choices"][0];
                choice["text"]
                    .as_str()
                    .or_else(|| choice["delta"]["content"].as_str())
                    .map(str::to_owned)
            })
            .collect();
        assert_eq!(joined, text.repeat(3), "{route}");
        // Above `max_tokens`, or negative: 400 on `min_tokens`.
        for (min_tokens, max_tokens) in [(9, json!(8)), (-1, json!(8))] {
            let (status, body) =
                post(json!({"min_tokens": min_tokens, "max_tokens": max_tokens})).await;
            assert_eq!(status, 400, "{route}: {body}");
            assert_eq!(body["error"]["param"], "min_tokens", "{route}: {body}");
        }
    }
    // Chat without a cap: checked against the room the context leaves.
    let (status, body) = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": user, "min_tokens": 5000}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "min_tokens", "{body}");
    server.shutdown().await.unwrap();
}

/// Tool calling is refused whichever field asks for it (`tools`, the deprecated `functions`, a
/// `tool_choice` / `function_call` that demands a call); `none` and `auto` are plain chat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_are_refused_in_every_form() {
    let server = TestServer::start(ServerConfig::default()).await;
    let user = json!([{"role": "user", "content": "hi"}]);
    let function = json!({"name": "f", "parameters": {"type": "object"}});
    let refused = [
        ("tools", json!([{"type": "function", "function": function}])),
        ("functions", json!([function])),
        ("tool_choice", json!("required")),
        (
            "tool_choice",
            json!({"type": "function", "function": {"name": "f"}}),
        ),
        ("function_call", json!({"name": "f"})),
        ("tool_choice", json!("any")),
    ];
    for (field, value) in refused {
        let mut request = json!({"messages": user, "max_tokens": 1});
        request[field] = value.clone();
        let (status, body) = server.post("/v1/chat/completions", &request).await;
        assert_eq!(status, 400, "{field}={value}: {body}");
        assert_eq!(body["error"]["param"], field, "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    }
    for (field, value) in [
        ("tool_choice", json!("none")),
        ("tool_choice", json!("auto")),
        ("function_call", json!("none")),
        ("tools", json!([])),
        ("functions", json!(null)),
    ] {
        let mut request = json!({"messages": user, "max_tokens": 1});
        request[field] = value.clone();
        let (status, body) = server.post("/v1/chat/completions", &request).await;
        assert_eq!(status, 200, "{field}={value}: {body}");
    }
    server.shutdown().await.unwrap();
}

/// A model id that is not UTF-8 once percent-decoded gets the error envelope, not plain text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_id_that_is_not_utf8_gets_the_error_envelope() {
    let server = TestServer::start(ServerConfig::default()).await;
    let response = server
        .client
        .get(server.url("/v1/models/%ff%fe"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert_eq!(body["error"]["param"], "model", "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");
    server.shutdown().await.unwrap();
}

/// A `top_p` too small for `f32` is still a valid (positive) `top_p`: it keeps the most likely
/// token only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_top_p_is_greedy_not_zero() {
    let server = TestServer::start(ServerConfig::default()).await;
    let (status, greedy) = server
        .post(
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "{greedy}");
    let (status, tiny) = server
        .post(
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 1, "top_p": 1e-50,
                    "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "{tiny}");
    assert_eq!(choice_texts(&tiny), choice_texts(&greedy));
    server.shutdown().await.unwrap();
}

/// A streaming client that stopped reading does not hold the shutdown past
/// `shutdown_timeout`: its sequences are cancelled although the stream waits on the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_timeout_cancels_a_stream_whose_client_stopped_reading() {
    // Small socket buffers on both sides (accepted connections inherit the listener's), so the
    // stream backs up behind the client after a few dozen chunks.
    let mut server = TestServer::start_on(
        common::small_send_buffer_listener(),
        ServerConfig {
            shutdown_timeout: Duration::from_millis(500),
            ..ServerConfig::default()
        },
        common::engine_config(2),
    );
    let body = json!({"prompt": PROMPT, "n": 4, "max_tokens": 4000, "logprobs": 20,
                      "ignore_eos": true, "stream": true})
    .to_string();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let stream = socket.connect(server.addr).await.unwrap();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut written = 0;
    while written < request.len() {
        stream.writable().await.unwrap();
        match stream.try_write(&request.as_bytes()[written..]) {
            Ok(n) => written += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("{e}"),
        }
    }
    // Read until tokens arrive, then stop reading.
    let mut seen = Vec::new();
    let mut buffer = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("token_logprobs") {
        tokio::time::timeout(Duration::from_secs(60), stream.readable())
            .await
            .expect("the stream starts")
            .unwrap();
        match stream.try_read(&mut buffer) {
            Ok(n) => {
                assert!(n > 0, "{}", String::from_utf8_lossy(&seen));
                seen.extend_from_slice(&buffer[..n]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("{e}"),
        }
    }
    // Let the stream back up behind the client while tokens are generated (16,000 of them
    // would take far longer than the test waits).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let state = server.state.clone();
    server.trigger_shutdown();
    tokio::time::timeout(Duration::from_secs(15), server.join())
        .await
        .expect("serve returns soon after the shutdown timeout")
        .unwrap();
    assert!(
        !state.backend().health().is_alive(),
        "the engine was shut down"
    );
    drop(stream);
}
