//! vLLM's request extensions end to end: `include_stop_str_in_output`, `skip_special_tokens`,
//! the chat rendering fields (`add_generation_prompt`, `continue_final_message`,
//! `chat_template_kwargs`), and the vLLM fields rackfill does not implement, refused by name.

mod common;

use common::{engine_config, json_chunks, read_sse, TestServer};
use rackfill_models::{ChatMessage, ModelBundle};
use rackfill_server::{ChatRender, ServerConfig};
use serde_json::{json, Value};

const C: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";
/// The built-in tokenizer's end-of-turn token (a special token, and an end-of-sequence id).
const IM_END: &str = "<|im_end|>";

fn text(body: &Value) -> String {
    body["choices"][0]["text"].as_str().unwrap().to_string()
}

/// The concatenated text of a streamed completion.
async fn streamed_text(server: &TestServer, body: &Value) -> String {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let response = server
        .client
        .post(server.url(C))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    json_chunks(&read_sse(response).await)
        .iter()
        .filter_map(|chunk| chunk["choices"][0]["text"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_and_special_tokens_in_the_output_on_request() {
    let server = TestServer::start(ServerConfig::default()).await;
    let base = json!({"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
                      "ignore_eos": true});
    let (status, body) = server.post(C, &base).await;
    assert_eq!(status, 200, "{body}");
    let full = text(&body);
    let chars: Vec<char> = full.chars().collect();
    let stop = (2..chars.len().saturating_sub(1))
        .map(|i| chars[i..i + 2].iter().collect::<String>())
        .find(|s| !s.trim().is_empty())
        .unwrap_or_else(|| panic!("greedy output too short for a stop test: {full:?}"));
    let cut = full.find(&stop).unwrap();

    let mut with_stop = base.clone();
    with_stop["stop"] = json!([stop]);
    let (_, body) = server.post(C, &with_stop).await;
    assert_eq!(text(&body), full[..cut]);
    with_stop["include_stop_str_in_output"] = json!(true);
    let (_, body) = server.post(C, &with_stop).await;
    assert_eq!(text(&body), full[..cut + stop.len()], "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["choices"][0]["stop_reason"], json!(stop));
    assert_eq!(
        streamed_text(&server, &with_stop).await,
        full[..cut + stop.len()]
    );

    // A special token forced by the bias: left out of the text unless asked for.
    let ids = server.state.backend().tokenize(IM_END, false).unwrap();
    assert_eq!(ids.len(), 1, "{IM_END} is one token");
    let special = json!({"prompt": "Hello", "max_tokens": 2, "temperature": 0,
                         "ignore_eos": true, "logit_bias": {ids[0].to_string(): 100}});
    let (_, body) = server.post(C, &special).await;
    assert_eq!(text(&body), "", "{body}");
    let mut shown = special.clone();
    shown["skip_special_tokens"] = json!(false);
    let (_, body) = server.post(C, &shown).await;
    assert_eq!(text(&body), IM_END.repeat(2), "{body}");
    assert_eq!(streamed_text(&server, &shown).await, IM_END.repeat(2));

    // A stop token's own text comes back with include_stop_str_in_output (when not skipped).
    let stop_token = json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                            "logit_bias": {ids[0].to_string(): 100},
                            "stop_token_ids": [ids[0]], "include_stop_str_in_output": true,
                            "skip_special_tokens": false});
    let (_, body) = server.post(C, &stop_token).await;
    assert_eq!(text(&body), IM_END, "{body}");
    assert_eq!(body["choices"][0]["stop_reason"], json!(ids[0]));
    let mut skipped = stop_token.clone();
    skipped["skip_special_tokens"] = json!(true);
    let (_, body) = server.post(C, &skipped).await;
    assert_eq!(text(&body), "", "{body}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_vllm_fields_are_refused_by_name() {
    let server = TestServer::start(ServerConfig::default()).await;
    let messages = json!([{"role": "user", "content": "Hi"}]);
    for (route, field, value) in [
        (C, "guided_json", json!({"type": "object"})),
        (C, "guided_choice", json!(["yes", "no"])),
        (C, "guided_regex", json!("[0-9]+")),
        (C, "structured_outputs", json!({"json": {}})),
        (C, "use_beam_search", json!(true)),
        (C, "prompt_logprobs", json!(1)),
        (CHAT, "guided_grammar", json!("root ::= \"a\"")),
        (CHAT, "echo", json!(true)),
    ] {
        let mut body = if route == C {
            json!({"prompt": "Hi", "max_tokens": 1})
        } else {
            json!({"messages": messages, "max_tokens": 1})
        };
        body[field] = value;
        let (status, body) = server.post(route, &body).await;
        assert_eq!(status, 400, "{field}: {body}");
        assert_eq!(body["error"]["param"], field, "{body}");
    }
    // Unset is fine: null, false, and fields rackfill does not know at all.
    let (status, body) = server
        .post(
            C,
            &json!({"prompt": "Hi", "max_tokens": 1, "guided_json": null,
                    "use_beam_search": false, "some_future_field": 1}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = server
        .post(
            CHAT,
            &json!({"messages": messages, "max_tokens": 1, "echo": false}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_prompts_follow_the_rendering_fields() {
    let server = TestServer::start(ServerConfig::default()).await;
    let backend = server.state.backend().clone();
    let chat = [
        ChatMessage {
            role: "user".into(),
            content: "Name a colour.".into(),
        },
        ChatMessage {
            role: "assistant".into(),
            content: "The colour is".into(),
        },
    ];
    let messages = json!([{"role": "user", "content": "Name a colour."},
                          {"role": "assistant", "content": "The colour is"}]);
    let prompt_tokens = |options: ChatRender| {
        let text = backend.render_chat(&chat, &options).unwrap();
        backend.tokenize(&text, false).unwrap().len()
    };
    let header = prompt_tokens(ChatRender::default());
    let closed = prompt_tokens(ChatRender {
        add_generation_prompt: false,
        ..ChatRender::default()
    });
    let open = prompt_tokens(ChatRender {
        add_generation_prompt: false,
        continue_final_message: true,
        ..ChatRender::default()
    });
    // The header adds tokens; continuing drops the end-of-turn marker after the last message.
    assert!(header > closed && closed > open, "{header} {closed} {open}");
    let rendered = backend
        .render_chat(
            &chat,
            &ChatRender {
                add_generation_prompt: false,
                continue_final_message: true,
                ..ChatRender::default()
            },
        )
        .unwrap();
    assert!(rendered.ends_with("The colour is"), "{rendered:?}");

    for (fields, want) in [
        (json!({}), header),
        (json!({"add_generation_prompt": false}), closed),
        (json!({"continue_final_message": true}), open),
        (
            json!({"continue_final_message": true, "add_generation_prompt": false}),
            open,
        ),
    ] {
        let mut body = json!({"messages": messages, "max_tokens": 1});
        body.as_object_mut()
            .unwrap()
            .extend(fields.as_object().unwrap().clone());
        let (status, body) = server.post(CHAT, &body).await;
        assert_eq!(status, 200, "{fields}: {body}");
        assert_eq!(body["usage"]["prompt_tokens"], want, "{fields}");
    }
    let (status, body) = server
        .post(
            CHAT,
            &json!({"messages": messages, "continue_final_message": true,
                    "add_generation_prompt": true}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "continue_final_message");
    let (status, body) = server
        .post(
            CHAT,
            &json!({"messages": [{"role": "user", "content": ""}],
                    "continue_final_message": true}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_template_kwargs_reach_the_template() {
    // The built-in model, with a template that prints a variable when it is given.
    let dir = tempfile::tempdir().unwrap();
    let builtin = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/builtin");
    for entry in std::fs::read_dir(builtin).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let config_path = dir.path().join("tokenizer_config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["chat_template"] = json!(
        "{%- for message in messages %}{{ message['content'] }}{%- endfor %}\
         {%- if greeting is defined %} {{ greeting }}{%- endif %}"
    );
    std::fs::write(&config_path, config.to_string()).unwrap();
    let bundle = ModelBundle::load(Some(dir.path().to_str().unwrap())).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server =
        TestServer::start_bundle(listener, bundle, ServerConfig::default(), engine_config(2));
    let model = server.state.backend().info().name.clone();
    let ask = |kwargs: Value| {
        json!({"model": model, "messages": [{"role": "user", "content": "Hi"}],
               "max_tokens": 1, "chat_template_kwargs": kwargs})
    };
    let (status, plain) = server.post(CHAT, &ask(json!({}))).await;
    assert_eq!(status, 200, "{plain}");
    let (status, greeted) = server
        .post(CHAT, &ask(json!({"greeting": "and a warm welcome to you"})))
        .await;
    assert_eq!(status, 200, "{greeted}");
    let tokens = |body: &Value| body["usage"]["prompt_tokens"].as_u64().unwrap();
    let backend = server.state.backend();
    let count = |text: &str| backend.tokenize(text, false).unwrap().len() as u64;
    assert_eq!(tokens(&plain), count("Hi"), "{plain}");
    assert_eq!(
        tokens(&greeted),
        count("Hi and a warm welcome to you"),
        "{greeted}"
    );
    server.shutdown().await.unwrap();
}
