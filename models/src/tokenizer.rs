//! Text <-> token ids with the checkpoint's own `tokenizer.json`, plus the two views of ids that
//! an OpenAI endpoint needs besides plain decoding: the text of one token (logprobs show it) and an
//! incremental detokenizer for streaming, which must never emit half a UTF-8 character.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use crate::{ModelError, Result};

/// A Hugging Face fast tokenizer loaded from `tokenizer.json`.
///
/// Cheap to clone (the tokenizer itself sits behind an `Arc`) and `Send + Sync`, so one instance
/// serves every request thread; [`DecodeStream`]s keep their own clone and need no lifetime.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    /// Sorted ids that have a token. Other ids are rejected instead of being dropped silently,
    /// as `tokenizers` would do.
    known: Arc<[u32]>,
    /// The most bytes of (normalized) text one token of the vocabulary stands for.
    max_token_bytes: usize,
}

// The engine shares one tokenizer across threads; fail the build if that ever stops being sound.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<Tokenizer>();
    shareable::<DecodeStream>();
};

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` from disk; a missing file is [`ModelError::MissingFile`] and a file
    /// that does not parse is [`ModelError::Tokenizer`], both naming `path`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => ModelError::MissingFile { path: path.into() },
            _ => ModelError::Io {
                path: path.into(),
                source,
            },
        })?;
        Self::from_bytes(&bytes, &path.display().to_string())
    }

    /// Parses the contents of a `tokenizer.json` (the built-in model embeds its files); `origin`
    /// names the source in errors.
    pub fn from_bytes(bytes: &[u8], origin: &str) -> Result<Self> {
        let error = |message: String| ModelError::Tokenizer {
            path: origin.into(),
            message,
        };
        // `tokenizers` panics on some well-formed JSON with inconsistent contents (merges naming
        // tokens absent from the vocabulary); a bad file must not take the server down.
        let inner = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(bytes))
            .map_err(|panic| {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                error(format!("inconsistent tokenizer: {message}"))
            })?
            .map_err(|e| error(e.to_string()))?;
        let vocab = inner.get_vocab(true);
        let max_token_bytes = vocab
            .keys()
            .map(|token| raw_token_bytes(token).len())
            .max()
            .unwrap_or(1)
            .max(1);
        let mut known: Vec<u32> = vocab.into_values().collect();
        known.sort_unstable();
        Ok(Self {
            inner: Arc::new(inner),
            known: known.into(),
            max_token_bytes,
        })
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) become their
    /// single ids; `add_special_tokens` only controls what the post-processor adds around the
    /// text (a BOS for Llama-style tokenizers). Chat prompts rendered by a template already hold
    /// their special tokens and are encoded with `false`, as `apply_chat_template` does.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| ModelError::Tokenize(e.to_string()))
    }

    /// Text of `ids`. An id with no token is an error rather than silently skipped, so a model
    /// that samples a padding row of its embedding is noticed. Bytes that do not form UTF-8
    /// become U+FFFD, as in Hugging Face `decode`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        for &id in ids {
            self.check_id(id)?;
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| ModelError::Tokenize(e.to_string()))
    }

    /// Text of one token as OpenAI-style logprobs show it: the decoded token, or `bytes:\xNN..`
    /// (lowercase hex, one `\x` per byte) when the token is only part of a UTF-8 character, so
    /// that no information is replaced by U+FFFD. `None` when `id` has no token.
    pub fn token_text(&self, id: u32) -> Option<String> {
        let token = self.inner.id_to_token(id)?;
        let text = self.inner.decode(&[id], false).ok()?;
        if !text.contains('\u{FFFD}') {
            return Some(text);
        }
        let bytes = raw_token_bytes(&token);
        if std::str::from_utf8(&bytes).is_ok() {
            // The token really spells U+FFFD (or is not byte-level); keep the decoded form.
            return Some(text);
        }
        let hex: String = bytes.iter().map(|b| format!("\\x{b:02x}")).collect();
        Some(format!("bytes:{hex}"))
    }

    /// The most bytes of text one token stands for (after the tokenizer's normalizer): the
    /// longest vocabulary entry, byte-level and `<0xNN>` tokens counted as the bytes they encode.
    /// A text of `b` normalized bytes is therefore at least `b / max_token_bytes` tokens, which
    /// lets a server refuse an overlong prompt before paying for its tokenization.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// The vocabulary string of `id` (`Ġthe`, `<|im_end|>`): Hugging Face's
    /// `convert_ids_to_tokens`. `None` when `id` has no token.
    pub fn token_str(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of tokens, added (special) tokens included: the `len(tokenizer)` of Hugging Face.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Id of a token given by its exact vocabulary string (`"<|im_end|>"`), for stop tokens.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// A fresh incremental detokenizer for one generated sequence.
    pub fn decode_stream(&self, skip_special_tokens: bool) -> DecodeStream {
        DecodeStream {
            tokenizer: self.clone(),
            skip_special_tokens,
            ids: Vec::new(),
            read_offset: 0,
            prefix_text: String::new(),
        }
    }

    fn check_id(&self, id: u32) -> Result<()> {
        match self.known.binary_search(&id) {
            Ok(_) => Ok(()),
            Err(_) => Err(ModelError::Tokenize(format!(
                "token id {id} is not in the vocabulary ({} tokens)",
                self.vocab_size()
            ))),
        }
    }
}

/// Streams text out of generated ids one id at a time (the vLLM / TGI scheme).
///
/// Decoding a token alone is wrong twice over: byte-level tokens may hold part of a character,
/// and decoders such as Metaspace change a token's text depending on its position. The stream
/// therefore decodes a short window of recent ids, and emits the new text only once the window no
/// longer ends in an incomplete character. Concatenating every `step` output and the final
/// [`flush`](Self::flush) gives exactly `decode(all_ids)`.
#[derive(Debug, Clone)]
pub struct DecodeStream {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    /// The window: ids whose text was emitted by the last successful step, then the ids held
    /// back since. Text before the window has been emitted and is never decoded again.
    ids: Vec<u32>,
    /// Number of ids at the start of the window whose text has been emitted.
    read_offset: usize,
    /// Text of `ids[..read_offset]` decoded on its own, the part of the window already emitted.
    prefix_text: String,
}

impl DecodeStream {
    /// Adds one generated id; returns the new text once it forms complete characters, `None`
    /// while more ids are needed (nothing is lost: it comes out with a later step or the flush).
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.tokenizer.check_id(id)?;
        self.ids.push(id);
        let text = self.window_text()?;
        if text.len() <= self.prefix_text.len() || text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let new_text = self.new_suffix(&text)?;
        // Slide the window: the ids just emitted become its prefix.
        self.ids.drain(..self.read_offset);
        self.read_offset = self.ids.len();
        self.prefix_text = self.window_text()?;
        Ok(Some(new_text))
    }

    /// Emits whatever the steps held back (an incomplete character at the end of the sequence,
    /// rendered as U+FFFD like `decode` does) and resets the stream. Call it once the sequence is
    /// finished.
    pub fn flush(&mut self) -> Result<Option<String>> {
        let text = self.window_text()?;
        let rest = if text.len() > self.prefix_text.len() {
            Some(self.new_suffix(&text)?)
        } else {
            None
        };
        self.ids.clear();
        self.read_offset = 0;
        self.prefix_text.clear();
        Ok(rest)
    }

    fn window_text(&self) -> Result<String> {
        self.tokenizer.decode(&self.ids, self.skip_special_tokens)
    }

    /// The part of `text` after the already emitted prefix. Decoders used by LLM tokenizers never
    /// rewrite earlier text when tokens are appended; one that does cannot be streamed exactly.
    fn new_suffix(&self, text: &str) -> Result<String> {
        match text.strip_prefix(self.prefix_text.as_str()) {
            Some(rest) => Ok(rest.to_owned()),
            None => Err(ModelError::Tokenize(format!(
                "streaming decode: appending a token rewrote earlier text {:?} into {text:?}",
                self.prefix_text
            ))),
        }
    }
}

/// The bytes a vocabulary token stands for: `<0xNN>` byte-fallback tokens are one byte,
/// byte-level (GPT-2 alphabet) tokens map char by char, anything else is its own UTF-8.
fn raw_token_bytes(token: &str) -> Vec<u8> {
    if let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>')) {
        if let Ok(byte) = u8::from_str_radix(hex, 16) {
            if hex.len() == 2 {
                return vec![byte];
            }
        }
    }
    token
        .chars()
        .map(byte_level_byte)
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

/// Inverse of GPT-2's `bytes_to_unicode`: printable Latin-1 bytes stand for themselves, the 68
/// other bytes were shifted to U+0100.. in increasing order.
fn byte_level_byte(c: char) -> Option<u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let code = u32::from(c);
    if let Ok(b) = u8::try_from(code) {
        return printable(b).then_some(b);
    }
    let shifted = usize::try_from(code.checked_sub(0x100)?).ok()?;
    (0..=255u8).filter(|&b| !printable(b)).nth(shifted)
}
