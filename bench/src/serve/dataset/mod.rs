//! Request datasets for `rackfill bench serve`: what each request sends and how many tokens it
//! asks for.
//!
//! - [`random`]: vLLM's random dataset. Input and output lengths are uniform integers in
//!   `[len * (1 - r), len * (1 + r)]`; prompts are random token ids (sent as a token array to
//!   `/v1/completions`, which OpenAI accepts, so the input length is exact without a tokenizer) or
//!   random English words for chat endpoints.
//! - [`load_sharegpt`]: ShareGPT JSON (`[{"conversations": [{"from": "human", "value": ...},
//!   {"from": "gpt", "value": ...}]}]`). The first human turn is the prompt; the length of the gpt
//!   reply that follows it sets `max_tokens`. Conversations are shuffled with the seed and
//!   filtered like vLLM (prompt or reply under 4 tokens, prompt over 1024, or both over 2048 are
//!   dropped). Lengths are counted with a real tokenizer when one is given, else estimated.
//! - [`load_trace`]: timestamped JSONL traces in the Mooncake format (`{"timestamp": ms,
//!   "input_length": n, "output_length": m, "hash_ids": [...]}`). Each hash id names one prompt
//!   block of `block_size` tokens; requests that share a hash id at the same position share those
//!   tokens exactly, so prefix caches see the trace's real reuse.
//!
//! - [`multi_turn`]: conversations whose every turn resends the whole conversation so far (a
//!   shared system prompt, the earlier turns and what the server generated for them) and adds a
//!   user message.
//! - [`eval`]: an evaluation harness's loglikelihood requests: several continuations of each
//!   context, scored with `echo` and `logprobs`.
//! - [`prefix_trace`]: writes a synthetic trace with Mooncake's prefix-sharing structure for
//!   [`load_trace`] to replay.
//!
//! Synthetic prompts are not stored: [`Synthesis`] regenerates them from seeds when a request is
//! sent, so a trace of ten thousand 10k-token prompts costs kilobytes, not gigabytes.

mod error;
mod eval;
mod multi_turn;
pub mod prefix_trace;
mod sharegpt;
mod spec;
mod trace;
mod words;

use std::path::Path;

use rackfill_models::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub use error::DatasetError;
pub use eval::{eval, EvalParams};
pub use multi_turn::{multi_turn, MultiTurnParams};
pub use sharegpt::{load_sharegpt, parse_sharegpt, ShareGptParams};
pub use spec::{Prompt, RequestSpec};
pub use trace::{load_trace, parse_trace};

/// How synthetic prompts are made: token ids in `0..vocab_size`, hash-id blocks of `block_size`
/// tokens, all derived from `seed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Synthesis {
    pub vocab_size: u32,
    pub block_size: usize,
    pub seed: u64,
}

/// Small enough for any real model's vocabulary, and the whole vocabulary of the built-in model.
pub const DEFAULT_VOCAB_SIZE: u32 = 4096;
/// The Mooncake traces' block size.
pub const DEFAULT_BLOCK_SIZE: usize = 512;

impl Default for Synthesis {
    fn default() -> Self {
        Self {
            vocab_size: DEFAULT_VOCAB_SIZE,
            block_size: DEFAULT_BLOCK_SIZE,
            seed: 0,
        }
    }
}

impl Synthesis {
    /// The prompt of `hash_ids`/`unique` as `len` token ids.
    pub fn tokens(&self, hash_ids: &[u64], unique: u64, len: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(len);
        self.fill(hash_ids, unique, len, |rng| {
            out.push(rng.gen_range(0..self.vocab_size.max(1)))
        });
        out
    }

    /// The same prompt as `len` words separated by spaces (one word per token, roughly: common
    /// English words are single tokens in most vocabularies), for chat endpoints, which take
    /// text only.
    pub fn words(&self, hash_ids: &[u64], unique: u64, len: usize) -> String {
        let mut out = String::with_capacity(len * 6);
        self.fill(hash_ids, unique, len, |rng| {
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(words::WORDS[rng.gen_range(0..words::WORDS.len())]);
        });
        out
    }

    /// The token ids of `spec`'s prompt; `None` for text. `history` is what a later
    /// conversation turn continues: the previous turn's prompt and the ids of the text generated
    /// for it (ignored by every other prompt).
    pub fn prompt_tokens(&self, spec: &RequestSpec, history: &[u32]) -> Option<Vec<u32>> {
        Some(match &spec.prompt {
            Prompt::Text(_) => return None,
            Prompt::Synthetic { hash_ids, unique } => {
                self.tokens(hash_ids, *unique, spec.input_len)
            }
            &Prompt::Scored {
                context,
                context_len,
                continuation,
            } => {
                let mut ids = self.segment(&[CONTEXT, context], context_len);
                let rest = spec.input_len.saturating_sub(context_len);
                ids.extend(self.segment(&[CONTINUATION, context, continuation], rest));
                ids
            }
            &Prompt::Turn {
                conversation,
                turn,
                system_len,
                user_len,
            } => {
                let mut ids = if turn == 0 {
                    self.segment(&[SYSTEM], system_len)
                } else {
                    history.to_vec()
                };
                ids.extend(self.segment(&[USER, conversation, turn as u64], user_len));
                ids
            }
        })
    }

    /// `len` token ids seeded by `key` alone: every prompt naming the same key gets the same
    /// tokens (`key` starts with one of the segment kinds below, so kinds never collide).
    fn segment(&self, key: &[u64], len: usize) -> Vec<u32> {
        let mut parts = vec![self.seed, 2];
        parts.extend_from_slice(key);
        let mut rng = StdRng::seed_from_u64(mix(&parts));
        (0..len)
            .map(|_| rng.gen_range(0..self.vocab_size.max(1)))
            .collect()
    }

    /// Calls `emit` once per position with the generator of that position's block; block `b`
    /// is seeded by its hash id when the request names one, else by `unique` and `b`.
    fn fill(&self, hash_ids: &[u64], unique: u64, len: usize, mut emit: impl FnMut(&mut StdRng)) {
        let block = self.block_size.max(1);
        let mut left = len;
        let mut b = 0;
        while left > 0 {
            let key = match hash_ids.get(b) {
                Some(&id) => mix(&[self.seed, 0, id]),
                None => mix(&[self.seed, 1, unique, b as u64]),
            };
            let mut rng = StdRng::seed_from_u64(key);
            for _ in 0..block.min(left) {
                emit(&mut rng);
            }
            left -= block.min(left);
            b += 1;
        }
    }
}

/// Segment kinds of [`Synthesis::segment`] keys.
const SYSTEM: u64 = 0;
const USER: u64 = 1;
const CONTEXT: u64 = 2;
const CONTINUATION: u64 = 3;

/// SplitMix64 over the parts: distinct inputs give unrelated seeds.
fn mix(parts: &[u64]) -> u64 {
    let mut h = 0x9E37_79B9_7F4A_7C15u64;
    for &p in parts {
        h ^= p.wrapping_add(0x9E37_79B9_7F4A_7C15).wrapping_add(h << 6);
        h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        h ^= h >> 31;
    }
    h
}

/// `--random-*` settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomParams {
    pub input_len: usize,
    pub output_len: usize,
    /// Lengths are uniform in `[len * (1 - r), len * (1 + r)]`; `0 <= r < 1`.
    pub range_ratio: f64,
}

/// `n` random requests (vLLM's random dataset), deterministic in `seed`.
pub fn random(
    params: &RandomParams,
    n: usize,
    seed: u64,
) -> Result<Vec<RequestSpec>, DatasetError> {
    let r = params.range_ratio;
    if !(0.0..1.0).contains(&r) {
        return Err(DatasetError::Invalid(format!(
            "--random-range-ratio must be in [0, 1), got {r}"
        )));
    }
    if params.input_len == 0 || params.output_len == 0 {
        return Err(DatasetError::Invalid(
            "--random-input-len and --random-output-len must be at least 1".into(),
        ));
    }
    let bounds = |len: usize| {
        let lo = ((len as f64 * (1.0 - r)) as usize).max(1);
        let hi = ((len as f64 * (1.0 + r)) as usize).max(lo);
        (lo, hi)
    };
    let (in_lo, in_hi) = bounds(params.input_len);
    let (out_lo, out_hi) = bounds(params.output_len);
    let mut rng = StdRng::seed_from_u64(seed);
    Ok((0..n)
        .map(|i| RequestSpec {
            prompt: Prompt::Synthetic {
                hash_ids: Vec::new(),
                unique: i as u64,
            },
            input_len: rng.gen_range(in_lo..=in_hi),
            output_len: rng.gen_range(out_lo..=out_hi),
            timestamp_ms: None,
        })
        .collect())
}

/// A tokenizer for `--tokenizer SPEC`: the built-in model's name, a `tokenizer.json` file, or a
/// checkpoint directory or Hugging Face id (resolved like `--model`, offline cache included)
/// holding one.
pub fn load_tokenizer(spec: &str) -> Result<Tokenizer, DatasetError> {
    let error = |message: String| DatasetError::Tokenizer {
        spec: spec.to_string(),
        message,
    };
    if spec == rackfill_models::BUILTIN_MODEL_NAME {
        return rackfill_models::ModelBundle::builtin()
            .map(|bundle| bundle.tokenizer)
            .map_err(|e| error(e.to_string()));
    }
    let path = Path::new(spec);
    let file = if path.is_file() {
        path.to_path_buf()
    } else {
        rackfill_models::source::resolve(spec)
            .map_err(|e| error(e.to_string()))?
            .join("tokenizer.json")
    };
    Tokenizer::from_file(&file).map_err(|e| error(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_hash_ids_share_prompt_blocks_exactly() {
        let s = Synthesis {
            vocab_size: 1000,
            block_size: 4,
            seed: 9,
        };
        let a = s.tokens(&[1, 2, 3], 0, 11);
        let b = s.tokens(&[1, 2, 4], 1, 12);
        let c = s.tokens(&[5], 2, 8);
        assert_eq!((a.len(), b.len(), c.len()), (11, 12, 8));
        assert_eq!(a[..8], b[..8]);
        assert_ne!(a[8..11], b[8..11]);
        assert_ne!(a[..4], c[..4]);
        // A truncated last block is a prefix of the full block.
        assert_eq!(s.tokens(&[1, 2, 3], 5, 10)[..], a[..10]);
        // No hash ids: unique per request, reproducible.
        assert_ne!(s.tokens(&[], 0, 8), s.tokens(&[], 1, 8));
        assert_eq!(s.tokens(&[], 3, 8), s.tokens(&[], 3, 8));
        assert!(a.iter().all(|&t| t < 1000));
        let wa = s.words(&[1, 2], 0, 10);
        let wb = s.words(&[1, 2], 1, 10);
        assert_eq!(wa.split(' ').count(), 10);
        assert_eq!(
            wa.split(' ').take(8).collect::<Vec<_>>(),
            wb.split(' ').take(8).collect::<Vec<_>>()
        );
    }

    #[test]
    fn random_lengths_stay_in_range_and_follow_the_seed() {
        let p = RandomParams {
            input_len: 100,
            output_len: 10,
            range_ratio: 0.5,
        };
        let specs = random(&p, 500, 1).unwrap();
        assert!(specs.iter().all(|s| (50..=150).contains(&s.input_len)));
        assert!(specs.iter().all(|s| (5..=15).contains(&s.output_len)));
        assert!(specs.iter().any(|s| s.input_len < 70) && specs.iter().any(|s| s.input_len > 130));
        assert_eq!(specs, random(&p, 500, 1).unwrap());
        assert_ne!(specs, random(&p, 500, 2).unwrap());
        let fixed = random(
            &RandomParams {
                range_ratio: 0.0,
                ..p
            },
            5,
            0,
        )
        .unwrap();
        assert!(fixed
            .iter()
            .all(|s| s.input_len == 100 && s.output_len == 10));
        for bad in [1.0, -0.1, f64::NAN] {
            assert!(random(
                &RandomParams {
                    range_ratio: bad,
                    ..p
                },
                1,
                0
            )
            .is_err());
        }
        assert!(random(&RandomParams { input_len: 0, ..p }, 1, 0).is_err());
    }
}
