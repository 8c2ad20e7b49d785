//! One request's life inside the scheduler: its tokens, KV cache, sampler, detokenizer and stop
//! matching, and the events it sends back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rackfill_models::{DecodeStream, KvBlock, KvCache, Tokenizer};
use tokio::sync::mpsc;

use crate::error::Result;
use crate::kv_export::KvExport;
use crate::prefix_cache::{BlockHash, BlockHasher, BlockLogprobs};
use crate::request::{
    Event, FinishEvent, FinishReason, GenerateRequest, StopReason, TokenEvent, Usage,
};
use crate::sampling::{token_logprob, Sampler, SamplingParams, TokenLogprob, MAX_LOGPROBS};
use crate::stop::{StopMatcher, StopOutcome};

/// A sequence admitted to (or waiting for) a rank.
pub struct Sequence {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub generated: Vec<u32>,
    pub params: SamplingParams,
    pub cache: KvCache,
    /// Tokens already in the KV cache.
    pub computed: usize,
    /// KV tokens reserved at admission: prompt plus `max_tokens`, so admission never
    /// over-commits the budget.
    pub reserved: usize,
    /// The rank's KV block ids the sequence holds, in token order (see
    /// [`crate::prefix_cache::RankBlocks`]); empty until admitted.
    pub blocks: Vec<u32>,
    /// Full blocks already registered with the rank's prefix cache.
    pub registered: usize,
    /// Prompt tokens reused from the prefix cache.
    pub cached_tokens: usize,
    /// Chained hashes of the sequence's full blocks, as far as they were needed.
    block_hashes: Vec<BlockHash>,
    pub arrived: Instant,
    pub scheduled: Option<Instant>,
    sampler: Sampler,
    decoder: DecodeStream,
    stops: StopMatcher,
    stop_ids: Arc<[u32]>,
    /// Per prompt position so far, with [`MAX_LOGPROBS`] alternatives (cut to the request's
    /// count when sent): kept whole, since the blocks it covers may be cached with them.
    prompt_logprobs: Vec<Option<TokenLogprob>>,
    events: mpsc::UnboundedSender<Event>,
    /// Where the prompt's KV goes when the sequence finishes, if the request asked for it.
    kv_export: Option<Arc<KvExport>>,
    /// Set when the sequence has finished or its client is gone: the scheduler drops it.
    pub done: bool,
}

/// What the engine thread needs to build a sequence, besides its KV cache.
pub struct SequenceParts {
    pub id: u64,
    /// One sequence of a [`crate::ValidatedRequest`]: its parameters passed validation.
    pub request: GenerateRequest,
    /// When the request was submitted (its queue time runs from here).
    pub arrived: Instant,
    pub fallback_seed: u64,
    pub tokenizer: Arc<Tokenizer>,
    /// End-of-sequence ids of the model (ignored with `ignore_eos`).
    pub eos: Arc<[u32]>,
    pub events: mpsc::UnboundedSender<Event>,
    /// This process's KV exporter, when the request asked to export its prompt's KV
    /// (`kv_transfer_params.do_remote_decode`).
    pub kv_export: Option<Arc<KvExport>>,
}

impl Sequence {
    /// A new sequence with its (empty) KV cache, made by the engine thread for the model it runs.
    pub fn new(parts: SequenceParts, cache: KvCache) -> Self {
        let SequenceParts {
            id,
            request: GenerateRequest { prompt, params },
            arrived,
            fallback_seed,
            tokenizer,
            eos,
            events,
            kv_export,
        } = parts;
        let sampler = Sampler::from_checked(&params, &prompt, fallback_seed);
        let mut stop_ids: Vec<u32> = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop_ids.extend(eos.iter().copied());
        }
        let reserved = prompt.len() + params.max_tokens as usize;
        Self {
            id,
            generated: Vec::new(),
            cache,
            computed: 0,
            reserved,
            blocks: Vec::new(),
            registered: 0,
            cached_tokens: 0,
            block_hashes: Vec::new(),
            arrived,
            scheduled: None,
            sampler,
            decoder: tokenizer.decode_stream(params.skip_special_tokens),
            stops: StopMatcher::new(&params.stop),
            stop_ids: stop_ids.into(),
            prompt_logprobs: Vec::new(),
            events,
            kv_export,
            done: false,
            prompt,
            params,
        }
    }

    /// Every token the sequence has: prompt then generated.
    pub fn len(&self) -> usize {
        self.prompt.len() + self.generated.len()
    }

    /// True for a sequence with no tokens (never admitted: prompts are non-empty).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens not yet in the KV cache (the rest of the prompt, or the last generated token).
    pub fn pending(&self) -> usize {
        self.len() - self.computed
    }

    /// Whether the sequence is still prefilling its prompt.
    pub fn prefilling(&self) -> bool {
        self.computed < self.prompt.len()
    }

    /// The token ids at positions `start..start + n`.
    pub fn tokens(&self, start: usize, n: usize) -> Vec<u32> {
        self.prompt
            .iter()
            .chain(&self.generated)
            .skip(start)
            .take(n)
            .copied()
            .collect()
    }

    /// Whether this chunk's logits must include every row (prompt logprobs) or only the last.
    pub fn wants_all_rows(&self) -> bool {
        self.params.prompt_logprobs.is_some() && self.prefilling()
    }

    /// Whether the request asked for prompt logprobs (so only cached blocks that kept theirs
    /// can stand in for computing its prompt).
    pub fn wants_prompt_logprobs(&self) -> bool {
        self.params.prompt_logprobs.is_some()
    }

    /// The chained hashes of the prompt's full blocks.
    pub fn prompt_block_hashes(&mut self, hasher: &BlockHasher) -> &[BlockHash] {
        hasher.extend(&mut self.block_hashes, &self.prompt);
        let prompt_blocks = self.prompt.len() / hasher.block_tokens();
        &self.block_hashes[..prompt_blocks]
    }

    /// Hashes of the prompt's full blocks not yet registered with the prefix cache: the blocks
    /// this sequence is still computing (empty before admission hashed the prompt).
    pub fn unregistered_prompt_hashes(&self, block_tokens: usize) -> &[BlockHash] {
        let prompt_blocks = (self.prompt.len() / block_tokens).min(self.block_hashes.len());
        &self.block_hashes[self.registered.min(prompt_blocks)..prompt_blocks]
    }

    /// The chained hash of full block `index` of the sequence's tokens (prompt then
    /// generated), which must be in its KV cache.
    pub fn block_hash(&mut self, hasher: &BlockHasher, index: usize) -> Option<BlockHash> {
        if self.block_hashes.len() <= index {
            let tokens = self.tokens(0, (index + 1) * hasher.block_tokens());
            hasher.extend(&mut self.block_hashes, &tokens);
        }
        self.block_hashes.get(index).copied()
    }

    /// The prompt logprobs of block `index`'s positions, if the sequence scored all of them.
    pub fn block_logprobs(&self, index: usize, block_tokens: usize) -> Option<BlockLogprobs> {
        let span = index * block_tokens..(index + 1) * block_tokens;
        (self.wants_prompt_logprobs() && span.end <= self.prompt_logprobs.len())
            .then(|| self.prompt_logprobs[span].into())
    }

    /// Starts the sequence from the first `tokens` positions of `blocks`, cached blocks of an
    /// earlier sequence with the same prefix (`logprobs`, theirs, when this request wants
    /// prompt logprobs: they must cover every position up to `tokens`, inclusive, because the
    /// first computed row scores the position after it). Only the rest is computed.
    pub fn reuse_prefix(
        &mut self,
        blocks: &[KvBlock],
        logprobs: &[BlockLogprobs],
        tokens: usize,
    ) -> Result<()> {
        if tokens == 0 {
            return Ok(());
        }
        self.cache.reuse(blocks, tokens)?;
        if self.wants_prompt_logprobs() {
            self.prompt_logprobs = logprobs
                .iter()
                .flat_map(|block| block.iter().cloned())
                .take(tokens + 1)
                .collect();
        }
        self.computed = tokens;
        self.cached_tokens = tokens;
        Ok(())
    }

    /// True once the client has dropped its stream.
    pub fn client_gone(&self) -> bool {
        self.events.is_closed()
    }

    /// Consumes the logits of a chunk of `n` tokens starting at `start` (`rows` holds every
    /// row or only the last, see [`Sequence::wants_all_rows`]): prompt logprobs, then, when the
    /// chunk reached the end of the known tokens, the next token.
    pub fn absorb(&mut self, start: usize, n: usize, rows: &[Vec<f32>]) -> Result<()> {
        self.computed = start + n;
        if self.wants_prompt_logprobs() && start < self.prompt.len() {
            self.score_prompt(start, n, rows)?;
        }
        if self.computed < self.len() {
            return Ok(());
        }
        if let Some(top_n) = self
            .params
            .prompt_logprobs
            .filter(|_| self.computed == self.prompt.len())
        {
            let logprobs = self
                .prompt_logprobs
                .iter()
                .map(|scored| {
                    scored.clone().map(|mut scored| {
                        scored.top_logprobs.truncate(top_n as usize);
                        scored
                    })
                })
                .collect();
            self.send(Event::PromptLogprobs(logprobs));
        }
        if self.generated.len() >= self.params.max_tokens as usize {
            self.finish(FinishReason::Length, None);
            return Ok(());
        }
        let last = rows.last().map(Vec::as_slice).unwrap_or_default();
        // Before `min_tokens`, no stop token may end the sequence.
        let excluded: &[u32] = if self.generated.len() < self.params.min_tokens as usize {
            &self.stop_ids
        } else {
            &[]
        };
        let sampled = self.sampler.sample_excluding(last, excluded)?;
        self.push_token(sampled);
        Ok(())
    }

    /// Prompt logprobs of the chunk: row `i` (position `start + i`) predicts position
    /// `start + i + 1`; the first prompt token has none. Every position keeps
    /// [`MAX_LOGPROBS`] alternatives, so its block can serve any later request.
    fn score_prompt(&mut self, start: usize, n: usize, rows: &[Vec<f32>]) -> Result<()> {
        if start == 0 {
            self.prompt_logprobs.push(None);
        }
        for (i, row) in rows.iter().enumerate().take(n) {
            let next = start + i + 1;
            if next >= self.prompt.len() {
                break;
            }
            let scored = token_logprob(row, self.prompt[next], MAX_LOGPROBS as usize)?;
            self.prompt_logprobs.push(Some(scored));
        }
        Ok(())
    }

    /// Appends a sampled token, emits its text, and finishes on a stop token, a stop string or
    /// `max_tokens`. Stop strings are matched only in the text of tokens after the first
    /// `min_tokens` (as vLLM does), so the text of those first tokens is emitted as it comes.
    fn push_token(&mut self, sampled: TokenLogprob) {
        let token = sampled.token;
        self.generated.push(token);
        let logprob = self.params.logprobs.is_some().then_some(sampled);
        if self.stop_ids.contains(&token) {
            // The stop token's own text only with `include_stop_str_in_output` (as vLLM), and
            // then only what the decoder shows (nothing for a skipped special token), after the
            // text held back for a possible stop string; otherwise `finish` releases that.
            let text = if self.params.include_stop_str_in_output {
                let mut text = self.stops.finish();
                text.push_str(&self.decoder.step(token).ok().flatten().unwrap_or_default());
                text
            } else {
                String::new()
            };
            self.send(Event::Token(TokenEvent {
                token,
                text,
                logprob,
            }));
            // vLLM reports a requested stop token, not end-of-sequence.
            let stop = self
                .params
                .stop_token_ids
                .contains(&token)
                .then_some(StopReason::Token(token));
            self.finish(FinishReason::Stop, stop);
            return;
        }
        let delta = self.decoder.step(token).ok().flatten().unwrap_or_default();
        let mut outcome = if self.generated.len() <= self.params.min_tokens as usize {
            StopOutcome {
                text: delta,
                stop: None,
            }
        } else {
            self.stops.push(&delta)
        };
        if let Some(stop) = outcome
            .stop
            .as_ref()
            .filter(|_| self.params.include_stop_str_in_output)
        {
            outcome.text.push_str(stop);
        }
        self.send(Event::Token(TokenEvent {
            token,
            text: outcome.text,
            logprob,
        }));
        if let Some(stop) = outcome.stop {
            self.finish(FinishReason::Stop, Some(StopReason::String(stop)));
        } else if self.generated.len() >= self.params.max_tokens as usize {
            self.finish(FinishReason::Length, None);
        }
    }

    /// Sends the final event; the scheduler frees the sequence at the end of the step.
    pub fn finish(&mut self, reason: FinishReason, stop: Option<StopReason>) {
        if self.done {
            return;
        }
        // Text held back as a possible start of a stop string is dropped when one matched, and
        // released otherwise.
        let text = if matches!(stop, Some(StopReason::String(_))) {
            String::new()
        } else {
            let tail = self.decoder.flush().ok().flatten().unwrap_or_default();
            let mut held = if self.generated.len() <= self.params.min_tokens as usize {
                tail
            } else {
                self.stops.push(&tail).text
            };
            held.push_str(&self.stops.finish());
            held
        };
        let queue_time = self
            .scheduled
            .map_or(Duration::ZERO, |at| at.duration_since(self.arrived));
        let kv_transfer = match (&self.kv_export, reason) {
            (Some(export), FinishReason::Stop | FinishReason::Length) => {
                match export.export(self.id, &self.cache, self.prompt.len()) {
                    Ok(params) => Some(params),
                    Err(err) => return self.fail(err.to_string()),
                }
            }
            _ => None,
        };
        self.send(Event::Finished(FinishEvent {
            reason,
            text,
            stop,
            usage: Usage {
                prompt_tokens: self.prompt.len(),
                completion_tokens: self.generated.len(),
                cached_tokens: self.cached_tokens,
            },
            queue_time,
            kv_transfer,
        }));
        self.done = true;
    }

    /// Fails the sequence with an error event.
    pub fn fail(&mut self, message: String) {
        if !self.done {
            self.send(Event::Error(message));
            self.done = true;
        }
    }

    fn send(&mut self, event: Event) {
        if self.events.send(event).is_err() {
            self.done = true;
        }
    }
}
