//! The narrow interface between the HTTP layer and whatever generates tokens.
//!
//! Handlers see only [`Backend`]: submit a tokenized request, tokenize, render a chat, name
//! tokens, probe health, read the served model's limits. [`EngineBackend`] implements it over the
//! engine thread ([`EngineHandle`]); tests or benches can put anything else behind it.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rackfill_engine::{EngineError, EngineHandle, GenerateRequest, RequestStream};
use rackfill_models::{ChatMessage, ChatTemplate, GenerationConfig, Tokenizer};

/// What clients may know about the served model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The id clients put in `"model"` and `/v1/models` lists.
    pub name: String,
    /// Unix seconds the server started serving it (`created` in `/v1/models`).
    pub created: u64,
    /// Token ids are `0..vocab_size`.
    pub vocab_size: usize,
    /// Prompt plus generated tokens may not exceed this (the smaller of the model's context
    /// length and the KV budget of one rank).
    pub max_context: usize,
    /// Sequences the engine queues at most: a request of more sequences (prompts times `n`) can
    /// never be admitted, so it gets a 400 instead of a 429 to retry.
    pub max_queued_sequences: usize,
    /// Whether `/v1/chat/completions` can render prompts.
    pub has_chat_template: bool,
    /// Sampling defaults from `generation_config.json`, used when a request omits them.
    pub generation: GenerationConfig,
}

/// Everything the HTTP layer needs from a generation backend. Methods documented as blocking
/// are called from `spawn_blocking`, never on the async runtime.
pub trait Backend: Send + Sync + 'static {
    /// The served model's name and limits.
    fn info(&self) -> &ModelInfo;

    /// Validates and queues one sequence; never blocks. Dropping the returned stream cancels it.
    fn submit(&self, request: GenerateRequest) -> Result<RequestStream, EngineError>;

    /// Token ids of `text` (blocking: CPU work).
    fn tokenize(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String>;

    /// Text of `ids` (blocking: CPU work).
    fn detokenize(&self, ids: &[u32]) -> Result<String, String>;

    /// Renders a conversation with the model's chat template as `options` ask (blocking: CPU
    /// work). `Err` when the model has no template or the template refuses.
    fn render_chat(&self, messages: &[ChatMessage], options: &ChatRender)
        -> Result<String, String>;

    /// How one token is shown in logprobs (`bytes:\xNN` for partial UTF-8); cheap.
    fn token_text(&self, id: u32) -> String;

    /// Whether requests can be served now.
    fn is_healthy(&self) -> bool;

    /// Lets in-flight work finish and stops the backend (blocking).
    fn shutdown(&self);
}

/// Metadata a [`rackfill_models::ModelBundle`] carries besides the weights and tokenizer.
#[derive(Debug, Clone, Default)]
pub struct ModelMeta {
    pub name: String,
    pub chat_template: Option<ChatTemplate>,
    pub generation: GenerationConfig,
}

/// [`Backend`] over the engine thread.
pub struct EngineBackend {
    engine: EngineHandle,
    tokenizer: Arc<Tokenizer>,
    chat_template: Option<ChatTemplate>,
    info: ModelInfo,
}

impl EngineBackend {
    /// Serves `engine` under `meta.name`; tokenizes with the engine's own tokenizer.
    pub fn new(engine: EngineHandle, meta: ModelMeta) -> Self {
        let engine_info = engine.info();
        let info = ModelInfo {
            name: meta.name,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            vocab_size: engine_info.vocab_size,
            max_context: engine_info.max_model_len.min(engine_info.max_reservation),
            max_queued_sequences: engine_info.max_waiting,
            has_chat_template: meta.chat_template.is_some(),
            generation: meta.generation,
        };
        Self {
            tokenizer: Arc::clone(engine.tokenizer()),
            engine,
            chat_template: meta.chat_template,
            info,
        }
    }

    /// The engine this backend submits to.
    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }
}

impl Backend for EngineBackend {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn submit(&self, request: GenerateRequest) -> Result<RequestStream, EngineError> {
        self.engine.submit(request)
    }

    fn tokenize(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| e.to_string())
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, String> {
        self.tokenizer.decode(ids, false).map_err(|e| e.to_string())
    }

    fn render_chat(
        &self,
        messages: &[ChatMessage],
        options: &ChatRender,
    ) -> Result<String, String> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or_else(|| format!("the model `{}` has no chat template", self.info.name))?;
        let text = template
            .render_with_kwargs(messages, options.add_generation_prompt, &options.kwargs)
            .map_err(|e| e.to_string())?;
        if !options.continue_final_message {
            return Ok(text);
        }
        // As vLLM: the prompt ends right after the final message's text, so the model goes on
        // with that message instead of starting a new one.
        let last = messages.last().map_or("", |m| m.content.as_str());
        match text.rfind(last) {
            Some(at) if !last.is_empty() => Ok(text[..at + last.len()].to_owned()),
            _ => Err(
                "continue_final_message: the final message's text is empty or does not \
                      appear in the rendered prompt"
                    .into(),
            ),
        }
    }

    fn token_text(&self, id: u32) -> String {
        self.tokenizer.token_text(id).unwrap_or_default()
    }

    fn is_healthy(&self) -> bool {
        self.engine.is_alive()
    }

    fn shutdown(&self) {
        self.engine.shutdown();
    }
}

/// How a chat is rendered (vLLM's chat request fields).
#[derive(Debug, Clone)]
pub struct ChatRender {
    /// End with the assistant header so the model answers (default true).
    pub add_generation_prompt: bool,
    /// End right after the final message's text, so the model continues that message
    /// (default false; exclusive with `add_generation_prompt`).
    pub continue_final_message: bool,
    /// Extra template variables (`chat_template_kwargs`, e.g. `{"enable_thinking": false}`).
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

impl Default for ChatRender {
    fn default() -> Self {
        Self {
            add_generation_prompt: true,
            continue_final_message: false,
            kwargs: serde_json::Map::new(),
        }
    }
}
