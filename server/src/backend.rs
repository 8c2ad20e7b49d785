//! The narrow interface between the HTTP layer and whatever generates tokens.
//!
//! Handlers see only [`Backend`]: validate and submit a tokenized request, tokenize, render a
//! chat, name tokens, probe health, read the served model's limits. [`EngineBackend`] implements
//! it over the engine thread ([`EngineHandle`]), which is the one place requests are checked
//! ([`ValidatedRequest`]).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rackfill_engine::{
    EngineError, EngineHandle, EngineHealth, GenerateRequest, RequestError, RequestLimits,
    RequestStream, ValidatedRequest,
};
use rackfill_models::{ChatMessage, ChatTemplate, GenerationConfig, Tokenizer};

/// What clients may know about the served model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The id clients put in `"model"` and `/v1/models` lists.
    pub name: String,
    /// Unix seconds the server started serving it (`created` in `/v1/models`).
    pub created: u64,
    /// What the engine validates requests against: vocabulary, context (`max_context`, the
    /// smaller of the model's context length and the KV budget of one rank), sequences and
    /// tokens per request, and the bound on a text's tokens
    /// ([`RequestLimits::check_text`]).
    pub limits: RequestLimits,
    /// Sampling defaults from `generation_config.json`, used when a request omits them.
    pub generation: GenerationConfig,
    /// The chat template's source; `None` when the model has none (chat requests are refused).
    pub chat_template: Option<String>,
    /// The texts of the special tokens, as `tokenizer_config.json` names them.
    pub special_tokens: SpecialTokenTexts,
}

/// Special tokens by their text (`/tokenizer_info` reports them; a remote tokenizer in an
/// evaluation harness ends documents with `eos_token`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokenTexts {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
}

/// Everything the HTTP layer needs from a generation backend. Methods documented as blocking
/// are called from `spawn_blocking`, never on the async runtime.
pub trait Backend: Send + Sync + 'static {
    /// The served model's name and limits.
    fn info(&self) -> &ModelInfo;

    /// Checks the sequences of one request (every prompt times `n`) against the engine's
    /// limits; the only checks of sampling parameters, token ids and lengths. Cheap.
    fn validate(&self, sequences: Vec<GenerateRequest>) -> Result<ValidatedRequest, RequestError>;

    /// As `validate`, for one sequence whose prompt's KV is handed to a decode engine when it
    /// finishes (`kv_transfer_params.do_remote_decode`); refused, naming why, where the engine
    /// cannot export.
    fn validate_kv_export(
        &self,
        sequence: GenerateRequest,
    ) -> Result<ValidatedRequest, RequestError>;

    /// Queues every sequence of a validated request or none; never blocks. The streams are in
    /// the request's order; dropping one cancels its sequence.
    fn submit(&self, request: ValidatedRequest) -> Result<Vec<RequestStream>, EngineError>;

    /// Token ids of `text` (blocking: CPU work, and memory many times the text's length; bound
    /// the text first with [`RequestLimits::check_text`]).
    fn tokenize(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String>;

    /// Text of `ids` (blocking: CPU work).
    fn detokenize(&self, ids: &[u32]) -> Result<String, String>;

    /// Renders a conversation with the model's chat template as `options` ask (blocking: CPU
    /// work). `Err` when the model has no template or the template refuses.
    fn render_chat(&self, messages: &[ChatMessage], options: &ChatRender)
        -> Result<String, String>;

    /// How one token is shown in logprobs (`bytes:\xNN` for partial UTF-8); cheap.
    fn token_text(&self, id: u32) -> String;

    /// The vocabulary string of a token (`Ġthe`), `None` for an id without one; cheap.
    fn token_str(&self, id: u32) -> Option<String>;

    /// Whether requests can be served now and why not; also says when the engine's group is
    /// about to stop (the server then answers every open request with the reason) and when
    /// another process of the group was asked to stop (the server then drains).
    fn health(&self) -> &EngineHealth;

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
        let tokenizer = Arc::clone(engine.tokenizer());
        let engine_info = engine.info();
        let special = meta
            .chat_template
            .as_ref()
            .map(|t| t.special_tokens().clone())
            .unwrap_or_default();
        let special_tokens = SpecialTokenTexts {
            bos_token: special
                .bos_token
                .or_else(|| (meta.generation.bos_token_id).and_then(|id| tokenizer.token_str(id))),
            eos_token: special.eos_token.or_else(|| {
                engine_info
                    .eos
                    .first()
                    .and_then(|&id| tokenizer.token_str(id))
            }),
            pad_token: (meta.generation.pad_token_id).and_then(|id| tokenizer.token_str(id)),
        };
        let info = ModelInfo {
            name: meta.name,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            limits: engine_info.limits.clone(),
            generation: meta.generation,
            chat_template: meta.chat_template.as_ref().map(|t| t.source().to_owned()),
            special_tokens,
        };
        Self {
            tokenizer,
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

    fn validate(&self, sequences: Vec<GenerateRequest>) -> Result<ValidatedRequest, RequestError> {
        self.engine.validate(sequences)
    }

    fn validate_kv_export(
        &self,
        sequence: GenerateRequest,
    ) -> Result<ValidatedRequest, RequestError> {
        self.engine.validate_kv_export(sequence)
    }

    fn submit(&self, request: ValidatedRequest) -> Result<Vec<RequestStream>, EngineError> {
        self.engine.enqueue(request)
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

    fn token_str(&self, id: u32) -> Option<String> {
        self.tokenizer.token_str(id)
    }

    fn health(&self) -> &EngineHealth {
        self.engine.health()
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
