//! Tokenizer, chat template and generation config against real files: a byte-level BPE
//! `tokenizer.json` built by `data/tokenizer/make_tokenizer.py`, and the chat templates of Qwen2,
//! Qwen3, Mistral/Mixtral and DeepSeek-V3 as their `tokenizer_config.json` ship them. Expected
//! prompts come from `transformers` (`data/tokenizer/make_expected_prompts.py` writes
//! `expected_prompts.json`); the inline ones were checked against it too.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rackfill_models::chat_template::{
    load_chat_template, ChatMessage, ChatTemplate, SpecialTokens,
};
use rackfill_models::generation_config::GenerationConfig;
use rackfill_models::tokenizer::Tokenizer;
use rackfill_models::ModelError;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tokenizer")
        .join(name)
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_file(data("tokenizer.json")).expect("test tokenizer loads")
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

fn template(dir: &str) -> ChatTemplate {
    load_chat_template(&data(dir))
        .expect("loads")
        .expect("has a template")
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!("rackfill-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const SAMPLES: &[&str] = &[
    "Hello, world! The router picks the top experts.",
    "Le café est déjà prêt à être servi; Über die Brücke, señor.",
    "Emoji: 😀🎉 🚀 👍🏽 ❤️ 🇫🇷 done",
    "中文：你好，世界。日本語：こんにちは。한국어: 안녕하세요",
    "Tabs\tand\nnewlines\r\n  indented 12345 3.14",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
];

#[test]
fn encode_decode_round_trips_ascii_accents_emoji_cjk() {
    let tok = tokenizer();
    for text in SAMPLES {
        let ids = tok.encode(text, false).unwrap();
        assert!(!ids.is_empty());
        assert_eq!(tok.decode(&ids, false).unwrap(), *text, "ids {ids:?}");
        // This tokenizer has no post-processor: special tokens are never added around the text.
        assert_eq!(tok.encode(text, true).unwrap(), ids);
    }
}

#[test]
fn special_tokens_are_single_ids_after_the_learned_vocab() {
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), 515);
    let endoftext = tok.token_id("<|endoftext|>").unwrap();
    let im_start = tok.token_id("<|im_start|>").unwrap();
    let im_end = tok.token_id("<|im_end|>").unwrap();
    assert_eq!((endoftext, im_start, im_end), (512, 513, 514));
    assert_eq!(tok.token_id("<|not_a_token|>"), None);

    let ids = tok
        .encode("<|im_start|>user\nhi<|im_end|><|endoftext|>", false)
        .unwrap();
    assert_eq!(ids[0], im_start);
    assert_eq!(&ids[ids.len() - 2..], &[im_end, endoftext]);
    assert_eq!(ids.iter().filter(|&&id| id >= 512).count(), 3);
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
    assert_eq!(tok.token_text(im_end).as_deref(), Some("<|im_end|>"));
}

#[test]
fn token_text_falls_back_to_bytes_for_partial_utf8() {
    let tok = tokenizer();
    // "😀" is F0 9F 98 80; the corpus merged only F0 9F, so the emoji spans three tokens.
    let ids = tok.encode("😀", false).unwrap();
    assert_eq!(ids.len(), 3);
    assert_eq!(tok.token_text(ids[0]).as_deref(), Some("bytes:\\xf0\\x9f"));
    assert_eq!(tok.token_text(ids[1]).as_deref(), Some("bytes:\\x98"));
    // Whole characters decode normally, leading space included.
    let ids = tok.encode("Hello, world", false).unwrap();
    let texts: Vec<String> = ids.iter().map(|&id| tok.token_text(id).unwrap()).collect();
    assert_eq!(texts.concat(), "Hello, world");
    assert!(texts.iter().any(|t| t.starts_with(' ')));
    assert_eq!(tok.token_text(100_000), None);
}

#[test]
fn decode_stream_equals_decode_and_never_splits_characters() {
    let tok = tokenizer();
    for skip_special_tokens in [false, true] {
        for text in SAMPLES {
            let ids = tok.encode(text, false).unwrap();
            let mut stream = tok.decode_stream(skip_special_tokens);
            let mut out = String::new();
            for &id in &ids {
                if let Some(chunk) = stream.step(id).unwrap() {
                    assert!(!chunk.is_empty());
                    assert!(
                        !chunk.contains('\u{FFFD}'),
                        "partial character in {chunk:?}"
                    );
                    out.push_str(&chunk);
                }
            }
            assert_eq!(
                stream.flush().unwrap(),
                None,
                "nothing held back for {text:?}"
            );
            assert_eq!(out, tok.decode(&ids, skip_special_tokens).unwrap());
        }
    }
}

#[test]
fn decode_stream_holds_back_then_flushes_incomplete_characters() {
    let tok = tokenizer();
    let ids = tok.encode("a😀", false).unwrap();
    let mut stream = tok.decode_stream(false);
    let steps: Vec<Option<String>> = ids.iter().map(|&id| stream.step(id).unwrap()).collect();
    assert_eq!(steps.first().cloned().flatten().as_deref(), Some("a"));
    assert!(steps[1..ids.len() - 1].iter().all(Option::is_none));
    assert_eq!(steps.last().cloned().flatten().as_deref(), Some("😀"));

    // A sequence cut inside a character: the flush emits what `decode` shows.
    let mut stream = tok.decode_stream(false);
    let cut = &ids[..ids.len() - 1];
    let mut out: String = cut
        .iter()
        .filter_map(|&id| stream.step(id).unwrap())
        .collect();
    out.push_str(&stream.flush().unwrap().unwrap());
    assert_eq!(out, tok.decode(cut, false).unwrap());
    assert!(out.ends_with('\u{FFFD}'));
}

#[test]
fn unknown_ids_are_errors_not_silently_dropped() {
    let tok = tokenizer();
    let err = tok.decode(&[1, 100_000], false).unwrap_err();
    assert!(matches!(err, ModelError::Tokenize(_)), "{err}");
    assert!(err.to_string().contains("100000"));
    assert!(tok.decode_stream(false).step(515).is_err());
}

#[test]
fn missing_tokenizer_file_names_the_path() {
    let path = data("no_such_dir/tokenizer.json");
    let err = Tokenizer::from_file(&path).unwrap_err();
    assert!(matches!(err, ModelError::MissingFile { .. }), "{err}");
    assert!(err.to_string().contains("no_such_dir/tokenizer.json"));
}

#[test]
fn malformed_tokenizer_json_is_an_error_not_a_panic() {
    let dir = TempDir::new("bad-tokenizer");
    let path = dir.0.join("tokenizer.json");
    std::fs::write(&path, "{ not json").unwrap();
    let err = Tokenizer::from_file(&path).unwrap_err();
    assert!(matches!(err, ModelError::Tokenizer { .. }), "{err}");
    assert!(err.to_string().contains(&path.display().to_string()));

    let bad: &[&str] = &[
        "",
        "[]",
        r#"{"model": {"type": "Nope"}}"#,
        r#"{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}}"#,
        r#"{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}}"#,
    ];
    for text in bad {
        let err = Tokenizer::from_bytes(text.as_bytes(), "builtin:tokenizer.json").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("builtin:tokenizer.json: cannot load tokenizer"),
            "{text}: {err}"
        );
    }
}

#[test]
fn tokenizer_is_shared_across_threads() {
    let tok = Arc::new(tokenizer());
    let expected = tok.encode(SAMPLES[3], false).unwrap();
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let tok = Arc::clone(&tok);
            std::thread::spawn(move || tok.encode(SAMPLES[3], false).unwrap())
        })
        .collect();
    for handle in handles {
        assert_eq!(handle.join().unwrap(), expected);
    }
}

/// Renders `(role, content)` turns and compares with the prompt `transformers` produced.
fn assert_renders(
    t: &ChatTemplate,
    turns: &[(&str, &str)],
    generation_prompt: bool,
    expected: &str,
) {
    let messages: Vec<ChatMessage> = turns.iter().map(|&(role, text)| msg(role, text)).collect();
    assert_eq!(
        t.render(&messages, generation_prompt).unwrap(),
        expected,
        "{turns:?}"
    );
}

/// The `(origin, message)` of a [`ModelError::Template`].
fn template_error<T: std::fmt::Debug>(result: rackfill_models::Result<T>) -> (String, String) {
    match result {
        Err(ModelError::Template { origin, message }) => (origin, message),
        other => panic!("expected a template error, got {other:?}"),
    }
}

#[test]
fn templates_render_like_transformers() {
    #[derive(serde::Deserialize)]
    struct Case {
        dir: String,
        messages: Vec<ChatMessage>,
        add_generation_prompt: bool,
        kwargs: serde_json::Map<String, serde_json::Value>,
        prompt: Option<String>,
        error: Option<String>,
    }
    let text = std::fs::read_to_string(data("expected_prompts.json")).unwrap();
    // Messages deserialize from the OpenAI request shape.
    let cases: Vec<Case> = serde_json::from_str(&text).unwrap();
    assert_eq!(cases.len(), 14);
    for case in cases {
        let t = template(&case.dir);
        let got = t.render_with_kwargs(&case.messages, case.add_generation_prompt, &case.kwargs);
        let context = format!("{} {:?}", case.dir, case.messages);
        match (case.prompt, case.error) {
            (Some(prompt), None) => assert_eq!(got.unwrap(), prompt, "{context}"),
            (None, Some(error)) => assert_eq!(template_error(got).1, error, "{context}"),
            _ => panic!("case needs a prompt or an error: {context}"),
        }
    }
}

#[test]
fn qwen3_template_keeps_only_the_last_turns_reasoning() {
    let t = template("qwen3");
    assert!(t.origin().ends_with("qwen3/tokenizer_config.json"));
    let special = t.special_tokens();
    assert_eq!(
        (special.bos_token.as_deref(), special.eos_token.as_deref()),
        (None, Some("<|im_end|>"))
    );
    // messages[::-1] + namespace() find the last user query; older <think> blocks are dropped.
    let history = [
        ("user", "What is 2+2?"),
        ("assistant", "<think>\nAdd them.\n</think>\n\n4"),
        ("user", "And 3+3?"),
        ("assistant", "<think>\nAgain.\n</think>\n\n6"),
    ];
    assert_renders(&t, &history, false, "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n<think>\nAgain.\n</think>\n\n6<|im_end|>\n");
    assert_renders(
        &t,
        &history[..1],
        true,
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    );
    let kwargs = serde_json::json!({"enable_thinking": false});
    let prompt = t.render_with_kwargs(&[msg("user", "Hi")], true, kwargs.as_object().unwrap());
    assert_eq!(
        prompt.unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
}

#[test]
fn load_chat_template_finds_the_source_and_special_tokens() {
    let bos = Some("<｜begin▁of▁sentence｜>");
    let cases = [
        (
            "qwen2",
            "qwen2/chat_template.jinja",
            None,
            Some("<|im_end|>"),
        ),
        (
            "mistral",
            "mistral/tokenizer_config.json",
            Some("<s>"),
            Some("</s>"),
        ),
        // DeepSeek writes its tokens as AddedToken objects.
        (
            "deepseek_v3",
            "deepseek_v3/tokenizer_config.json",
            bos,
            Some("<｜end▁of▁sentence｜>"),
        ),
    ];
    for (dir, origin, bos, eos) in cases {
        let t = template(dir);
        assert!(t.origin().ends_with(origin), "{}", t.origin());
        let special = t.special_tokens();
        assert_eq!(
            (special.bos_token.as_deref(), special.eos_token.as_deref()),
            (bos, eos)
        );
    }
}

#[test]
fn raise_exception_is_a_template_error_with_its_message() {
    let t = template("mistral");
    let (origin, message) = template_error(t.render(&[msg("user", "a"), msg("user", "b")], true));
    assert!(
        origin.ends_with("mistral/tokenizer_config.json"),
        "{origin}"
    );
    assert_eq!(message, "After the optional system message, conversation roles must alternate user/assistant/user/assistant/...");
}

#[test]
fn chat_template_jinja_takes_precedence_over_tokenizer_config() {
    let dir = TempDir::new("precedence");
    assert!(load_chat_template(&dir.0).unwrap().is_none());
    let config = r#"{"chat_template": "config:{{ messages[0].content }}", "bos_token": "<s>"}"#;
    std::fs::write(dir.0.join("tokenizer_config.json"), config).unwrap();
    assert_renders(
        &load_chat_template(&dir.0).unwrap().unwrap(),
        &[("user", "x")],
        false,
        "config:x",
    );
    let jinja = "{{ bos_token }}jinja:{{ messages[0].content }}\n";
    std::fs::write(dir.0.join("chat_template.jinja"), jinja).unwrap();
    assert_renders(
        &load_chat_template(&dir.0).unwrap().unwrap(),
        &[("user", "x")],
        false,
        "<s>jinja:x",
    );
}

#[test]
fn template_lists_use_default_and_configs_without_template_give_none() {
    let config = r#"{"chat_template": [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ eos_token }}default"}],
        "eos_token": {"content": "</s>", "special": true}}"#;
    let t = ChatTemplate::from_tokenizer_config_json(config, "builtin")
        .unwrap()
        .unwrap();
    assert_renders(&t, &[], false, "</s>default");
    let no_default = r#"{"chat_template": [{"name": "rag", "template": "x"}]}"#;
    let (origin, message) = template_error(ChatTemplate::from_tokenizer_config_json(
        no_default, "builtin",
    ));
    assert_eq!(
        (origin.as_str(), message.as_str()),
        ("builtin", "no template named \"default\" among [\"rag\"]")
    );
    for config in [r#"{"chat_template": null}"#, "{}"] {
        assert!(ChatTemplate::from_tokenizer_config_json(config, "b")
            .unwrap()
            .is_none());
    }
}

#[test]
fn malformed_tokenizer_config_is_a_json_error() {
    let cases = [
        "{",
        "[1]",
        r#"{"bos_token": 5}"#,
        r#"{"chat_template": 3}"#,
        r#"{"chat_template": [{"name": "default"}]}"#,
    ];
    for text in cases {
        let err = ChatTemplate::from_tokenizer_config_json(text, "cfg.json").unwrap_err();
        assert!(matches!(err, ModelError::Json { .. }), "{text}: {err}");
        assert!(
            err.to_string().starts_with("cfg.json: invalid JSON"),
            "{err}"
        );
    }
    assert!(SpecialTokens::from_tokenizer_config_json(r#"{"eos_token": {"id": 2}}"#, "c").is_err());
}

#[test]
fn broken_template_is_a_template_error_naming_its_origin() {
    let origin = "models/x/chat_template.jinja";
    let result = ChatTemplate::new(
        "{% for m in messages %}{{ m.content }}",
        origin,
        SpecialTokens::default(),
    );
    let err = result.as_ref().unwrap_err().to_string();
    assert!(
        err.starts_with("chat template (models/x/chat_template.jinja): syntax error"),
        "{err}"
    );
    assert_eq!(template_error(result).0, origin);
}

#[test]
fn hf_globals_filters_and_python_methods() {
    let render = |source: &str| {
        ChatTemplate::new(source, "inline", SpecialTokens::default())
            .and_then(|t| t.render(&[msg("user", "  Hi there  ")], false))
    };
    let x = "{% set x = {'b': [1, 2.5, \"é<>&'\"], 'a': {'c': none, 'd': true}} %}";
    let compact = "{{ x | tojson }}|{{ x | tojson(sort_keys=true) }}|{{ x | tojson(ensure_ascii=true) }}|{{ x | tojson(separators=[',', ':']) }}";
    assert_eq!(
        render(&format!("{x}{compact}")).unwrap(),
        r#"{"b": [1, 2.5, "é<>&'"], "a": {"c": null, "d": true}}|{"a": {"c": null, "d": true}, "b": [1, 2.5, "é<>&'"]}|{"b": [1, 2.5, "\u00e9<>&'"], "a": {"c": null, "d": true}}|{"b":[1,2.5,"é<>&'"],"a":{"c":null,"d":true}}"#
    );
    let indented =
        "{{ x | tojson(indent=2) }}|{{ [] | tojson(indent=2) }}|{{ {'a': []} | tojson(2) }}";
    assert_eq!(
        render(&format!("{x}{indented}")).unwrap(),
        "{\n  \"b\": [\n    1,\n    2.5,\n    \"é<>&'\"\n  ],\n  \"a\": {\n    \"c\": null,\n    \"d\": true\n  }\n}|[]|{\n  \"a\": []\n}"
    );
    let methods = "{% set c = messages[0].content %}[{{ c.strip() }}]{{ c.lstrip() | length }}{{ c.split('e') | length }}{% if c.strip().startswith('Hi') %}!{% endif %}";
    assert_eq!(render(methods).unwrap(), "[Hi there]103!");
    let loop_controls = "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}";
    assert_eq!(render(loop_controls).unwrap(), "02");
    // Absent special tokens are undefined, not `none`.
    assert_eq!(render("[{{ bos_token }}{{ eos_token }}]").unwrap(), "[]");
    let year = render("{{ strftime_now('%Y') }}").unwrap();
    assert!(year.len() == 4 && year.as_str() >= "2024", "{year}");
    let err = render("{{ raise_exception('no ' ~ messages[0].role ~ ' here') }}").unwrap_err();
    assert_eq!(err.to_string(), "chat template (inline): no user here");
}

#[test]
fn generation_config_eos_int_or_list() {
    let qwen3 = GenerationConfig::load(&data("qwen3")).unwrap().unwrap();
    assert_eq!(
        qwen3,
        GenerationConfig {
            bos_token_id: Some(151643),
            eos_token_ids: vec![151645, 151643],
            pad_token_id: Some(151643),
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(20),
            min_p: None,
            repetition_penalty: None,
            max_new_tokens: None,
            do_sample: Some(true),
        }
    );
    let mistral = GenerationConfig::load(&data("mistral")).unwrap().unwrap();
    assert_eq!(
        (mistral.bos_token_id, mistral.eos_token_ids.clone()),
        (Some(1), vec![2])
    );
    assert_eq!(mistral.temperature, None);
    assert_eq!(GenerationConfig::load(&data("qwen2")).unwrap(), None);
    let empty = GenerationConfig::from_json_str(
        r#"{"eos_token_id": null, "max_new_tokens": 64, "repetition_penalty": 1.05, "min_p": 0.0}"#,
        "g",
    )
    .unwrap();
    assert_eq!(
        (
            empty.eos_token_ids.len(),
            empty.max_new_tokens,
            empty.repetition_penalty,
            empty.min_p
        ),
        (0, Some(64), Some(1.05), Some(0.0))
    );
}

#[test]
fn generation_config_wrong_types_name_the_file() {
    for text in [
        r#"{"eos_token_id": "x"}"#,
        r#"{"eos_token_id": [1, -2]}"#,
        r#"{"top_p": "high"}"#,
        "[]",
        "{",
    ] {
        let err = GenerationConfig::from_json_str(text, "ckpt/generation_config.json").unwrap_err();
        assert!(matches!(err, ModelError::Json { .. }), "{text}: {err}");
        assert!(
            err.to_string()
                .starts_with("ckpt/generation_config.json: invalid JSON"),
            "{err}"
        );
    }
    let dir = TempDir::new("gen-config");
    std::fs::write(
        dir.0.join("generation_config.json"),
        r#"{"do_sample": "yes"}"#,
    )
    .unwrap();
    let err = GenerationConfig::load(&dir.0).unwrap_err();
    assert!(err.to_string().contains("generation_config.json"), "{err}");
}
