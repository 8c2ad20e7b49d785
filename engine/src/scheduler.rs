//! Continuous batching with chunked prefill over `R` data-parallel ranks.
//!
//! Each rank's KV budget is a pool of fixed-size blocks with a prefix cache over them
//! ([`RankBlocks`]). New sequences wait in FIFO order; the head is admitted once the blocks of
//! its whole reservation (prompt plus `max_tokens`) fit a rank, so admission never
//! over-commits it. Among the ranks it fits, it goes to the one holding its longest cached
//! prefix unless that rank holds more blocks than the least-loaded one by more than the prefix
//! saves (*cache-aware admission*); otherwise to the rank holding the fewest blocks (ties:
//! fewest running sequences, then the lower rank). A reused prefix is not computed again. Each
//! step
//! gives every rank a budget of `chunk_tokens`: decode tokens of running sequences first (one
//! each, so generation never starves), then prefill chunks in admission order, a long prompt
//! split across as many steps as it needs. After every step the blocks a sequence completed
//! join its rank's prefix cache; finished and cancelled sequences release their blocks at the
//! end of the step that saw them finish.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use candle_core::Tensor;
use rackfill_models::{KvBlock, LogitsFor, SequenceInput, KV_BLOCK_TOKENS};

use crate::ep::{EpRuntime, StepOutput};
use crate::error::{EngineError, Result};
use crate::prefix_cache::{
    choose_rank, reusable_tokens, BlockHash, BlockHasher, BlockLogprobs, IndexChange,
    PrefixCacheStats, RankBlocks, RankOffer,
};
use crate::sequence::Sequence;

/// Scheduling limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens one rank processes per step (prefill chunks plus decode tokens).
    pub chunk_tokens: usize,
    /// KV cache budget per rank, in tokens (whole blocks of it are used).
    pub kv_tokens_per_rank: usize,
    /// Tokens per KV block: the unit of the budget and of prefix reuse.
    pub block_tokens: usize,
    /// Keep the blocks of earlier sequences for later ones with the same prefix.
    pub prefix_caching: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            chunk_tokens: 4096,
            kv_tokens_per_rank: 65_536,
            block_tokens: KV_BLOCK_TOKENS,
            prefix_caching: true,
        }
    }
}

impl SchedulerConfig {
    /// Blocks per rank.
    pub fn kv_blocks_per_rank(&self) -> usize {
        self.kv_tokens_per_rank / self.block_tokens.max(1)
    }

    /// Tokens the blocks of one rank hold: the longest sequence it can admit.
    pub fn kv_capacity_tokens(&self) -> usize {
        self.kv_blocks_per_rank() * self.block_tokens
    }
}

/// One sequence's share of a step: `len` tokens from position `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slice {
    index: usize,
    start: usize,
    len: usize,
}

/// What a step did, for metrics and the bench.
pub struct StepSummary {
    pub output: StepOutput,
    /// Tokens computed per rank.
    pub tokens: Vec<usize>,
}

/// Waiting and running sequences and the KV blocks of every rank.
pub struct Scheduler {
    config: SchedulerConfig,
    waiting: VecDeque<Sequence>,
    running: Vec<Vec<Sequence>>,
    blocks: Vec<RankBlocks>,
    hasher: BlockHasher,
}

/// One rank's prompt blocks that running sequences are computing, by hash: whether one of
/// them scores its prompt (so the block will keep prompt logprobs).
type Computing = HashMap<BlockHash, bool>;

/// What admission does with the head of the queue.
enum Admission {
    Now(Placement),
    /// Wait: a rank is computing more of its prefix.
    Later,
}

/// The tokens `offers` reuse on `rank`.
fn offers_reused(offers: &[RankOffer], rank: usize) -> usize {
    offers
        .iter()
        .find(|o| o.rank == rank)
        .map_or(0, |o| o.reused)
}

/// Where the head of the queue can go: a rank, and what of its prompt that rank has cached.
struct Placement {
    rank: usize,
    /// Cached blocks of the prompt's prefix on that rank, in order (the last maybe partly used).
    hit: Vec<u32>,
    /// Prompt tokens reused from them.
    tokens: usize,
}

impl Scheduler {
    /// An empty scheduler for `ranks` ranks; `cache_salt` names the model (and anything else
    /// its KV depends on) in the prefix cache's block hashes.
    pub fn new(ranks: usize, config: SchedulerConfig, cache_salt: u64) -> Result<Self> {
        if ranks == 0 || config.chunk_tokens == 0 || config.block_tokens == 0 {
            return Err(EngineError::Config(format!(
                "{ranks} ranks, chunk {} tokens, KV blocks of {} tokens: all must be positive",
                config.chunk_tokens, config.block_tokens
            )));
        }
        if config.kv_blocks_per_rank() == 0 {
            return Err(EngineError::Config(format!(
                "a KV budget of {} tokens per rank holds no block of {} tokens",
                config.kv_tokens_per_rank, config.block_tokens
            )));
        }
        let blocks = (0..ranks)
            .map(|_| {
                RankBlocks::new(
                    config.kv_blocks_per_rank(),
                    config.block_tokens,
                    config.prefix_caching,
                )
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            config,
            waiting: VecDeque::new(),
            running: (0..ranks).map(|_| Vec::new()).collect(),
            blocks,
            hasher: BlockHasher::new(config.block_tokens, cache_salt),
        })
    }

    /// Tokens per KV block (new sequences' caches must use it).
    pub fn block_tokens(&self) -> usize {
        self.config.block_tokens
    }

    /// The hasher of the ranks' prefix caches.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// Starts recording the ranks' prefix-cache index changes (for a group's leader to mirror).
    pub fn journal_index_changes(&mut self) {
        self.blocks
            .iter_mut()
            .for_each(RankBlocks::journal_index_changes);
    }

    /// Every rank's index changes since the last call, in rank order.
    pub fn take_index_changes(&mut self) -> Vec<IndexChange> {
        let changes = self.blocks.iter_mut().map(RankBlocks::take_index_changes);
        changes.flatten().collect()
    }

    /// Every rank's prefix-cache counters and block states.
    pub fn prefix_stats(&self) -> Vec<PrefixCacheStats> {
        self.blocks.iter().map(RankBlocks::stats).collect()
    }

    /// Queues a sequence. Its reservation must fit one rank's KV budget (request validation
    /// bounds prompt plus `max_tokens` by it), or it would wait forever.
    pub fn enqueue(&mut self, sequence: Sequence) {
        self.waiting.push_back(sequence);
    }

    /// Sequences waiting for admission.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences admitted and not finished.
    pub fn running(&self) -> usize {
        self.running.iter().map(Vec::len).sum()
    }

    /// KV blocks held by running sequences over all blocks, in `[0, 1]` (cached blocks nobody
    /// holds count as free: they are evicted when the room is needed).
    pub fn kv_usage(&self) -> f64 {
        let used: usize = self.blocks.iter().map(RankBlocks::used).sum();
        let capacity: usize = self.blocks.iter().map(RankBlocks::capacity).sum();
        used as f64 / capacity.max(1) as f64
    }

    /// True when there is nothing to do.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.iter().all(Vec::is_empty)
    }

    /// Marks sequence `id` cancelled wherever it is; it is dropped at the next step.
    pub fn cancel(&mut self, id: u64) {
        for seq in self
            .waiting
            .iter_mut()
            .chain(self.running.iter_mut().flatten())
        {
            if seq.id == id {
                seq.finish(crate::request::FinishReason::Cancelled, None);
            }
        }
    }

    /// Fails every sequence (the engine is stopping on an unrecoverable error).
    pub fn fail_all(&mut self, message: &str) {
        for seq in self
            .waiting
            .iter_mut()
            .chain(self.running.iter_mut().flatten())
        {
            seq.fail(message.to_string());
        }
        self.release_finished();
    }

    /// Admits waiting sequences, runs one step on the runtime, samples, and releases finished
    /// sequences. Returns `None` when no rank had work.
    pub fn step(&mut self, runtime: &mut EpRuntime) -> Result<Option<StepSummary>> {
        self.step_ranks(runtime, false)
    }

    /// [`Self::step`] for a process whose EP group steps now (some process has work): the
    /// runtime runs even when these ranks have no tokens, so they join every collective of the
    /// step with zero tokens.
    pub fn step_with_group(&mut self, runtime: &mut EpRuntime) -> Result<StepSummary> {
        Ok(self
            .step_ranks(runtime, true)?
            .expect("a joined step always runs"))
    }

    /// Tokens reserved on these ranks, waiting sequences included: what a leader balances new
    /// sequences over processes by.
    pub fn reserved_tokens(&self) -> usize {
        let running: usize = (0..self.running.len()).map(|r| self.rank_load(r)).sum();
        running + self.waiting.iter().map(|s| s.reserved).sum::<usize>()
    }

    /// Tokens one rank may run over the least-loaded one to serve a request from its cached
    /// prefix, beyond the tokens the prefix saves: one step's budget.
    pub fn cache_slack(&self) -> usize {
        self.config.chunk_tokens
    }

    fn step_ranks(&mut self, runtime: &mut EpRuntime, joined: bool) -> Result<Option<StepSummary>> {
        self.release_finished();
        self.admit();
        let plan = self.plan_step();
        if !joined && plan.iter().all(Vec::is_empty) {
            return Ok(None);
        }
        let tokens: Vec<Vec<Vec<u32>>> = plan
            .iter()
            .zip(&self.running)
            .map(|(slices, seqs)| {
                slices
                    .iter()
                    .map(|s| seqs[s.index].tokens(s.start, s.len))
                    .collect()
            })
            .collect();
        let which: Vec<Vec<LogitsFor>> = plan
            .iter()
            .zip(&self.running)
            .map(|(slices, seqs)| {
                slices
                    .iter()
                    .map(|s| match seqs[s.index].wants_all_rows() {
                        true => LogitsFor::AllPositions,
                        false => LogitsFor::LastPosition,
                    })
                    .collect()
            })
            .collect();
        let output = self.forward(runtime, &plan, &tokens, &which);
        let output = match output {
            Ok(output) => output,
            Err(err) => {
                // The step's sequences cannot continue (their caches may be half-written);
                // the others are untouched.
                for (slices, seqs) in plan.iter().zip(self.running.iter_mut()) {
                    for s in slices {
                        seqs[s.index].fail(format!("engine step failed: {err}"));
                    }
                }
                self.release_finished();
                return Err(err);
            }
        };
        for ((slices, seqs), (logits, which)) in plan
            .iter()
            .zip(self.running.iter_mut())
            .zip(output.logits.iter().zip(&which))
        {
            let Some(logits) = logits else { continue };
            let mut rows = logits_rows(logits)?.into_iter();
            for (s, w) in slices.iter().zip(which) {
                let take = match w {
                    LogitsFor::AllPositions => s.len,
                    LogitsFor::LastPosition => 1,
                };
                let mine: Vec<Vec<f32>> = rows.by_ref().take(take).collect();
                let seq = &mut seqs[s.index];
                if let Err(err) = seq.absorb(s.start, s.len, &mine) {
                    seq.fail(err.to_string());
                }
            }
        }
        let tokens = plan
            .iter()
            .map(|slices| slices.iter().map(|s| s.len).sum())
            .collect();
        self.register_blocks();
        self.release_finished();
        Ok(Some(StepSummary { output, tokens }))
    }

    fn forward(
        &mut self,
        runtime: &mut EpRuntime,
        plan: &[Vec<Slice>],
        tokens: &[Vec<Vec<u32>>],
        which: &[Vec<LogitsFor>],
    ) -> Result<StepOutput> {
        let mut batches: Vec<Vec<SequenceInput<'_>>> = Vec::with_capacity(plan.len());
        for ((slices, seqs), tokens) in plan.iter().zip(self.running.iter_mut()).zip(tokens) {
            let mut refs: Vec<Option<&mut Sequence>> = seqs.iter_mut().map(Some).collect();
            let mut batch = Vec::with_capacity(slices.len());
            for (s, toks) in slices.iter().zip(tokens) {
                let seq = refs[s.index].take().expect("one slice per sequence");
                batch.push(SequenceInput {
                    tokens: toks,
                    cache: &mut seq.cache,
                });
            }
            batches.push(batch);
        }
        runtime.forward(&mut batches, which)
    }

    /// FIFO admission of the queue's head to the rank [`Self::place`] picks, as long as one
    /// fits it.
    fn admit(&mut self) {
        if self.waiting.is_empty() {
            return;
        }
        let mut computing = self.computing();
        while let Some(head) = self.waiting.front_mut() {
            if head.done {
                self.waiting.pop_front();
                continue;
            }
            let hashes = match self.config.prefix_caching {
                true => head.prompt_block_hashes(&self.hasher).to_vec(),
                false => Vec::new(),
            };
            // Wait for a prefix another sequence is computing now: the next step reuses it.
            let head = &self.waiting[0];
            let Some(Admission::Now(placement)) = self.place(head, &hashes, &computing) else {
                break;
            };
            let mut seq = self.waiting.pop_front().expect("head exists");
            seq.scheduled = Some(Instant::now());
            self.start(&mut seq, &placement);
            self.note_computing(&mut computing[placement.rank], &seq);
            self.running[placement.rank].push(seq);
        }
    }

    /// Where `seq` goes, by [`choose_rank`] over the ranks its blocks fit; `None` while no rank
    /// fits it. When the choice would be another one if the prompt blocks that running
    /// sequences are still computing were cached already, the sequence waits for them
    /// ([`Admission::Later`]): several requests that share a context and arrive together (an
    /// evaluation harness's continuations) then compute it once.
    fn place(
        &self,
        seq: &Sequence,
        hashes: &[BlockHash],
        computing: &[Computing],
    ) -> Option<Admission> {
        let bt = self.config.block_tokens;
        let logprobs = seq.wants_prompt_logprobs();
        let reserved_blocks = seq.reserved.div_ceil(bt);
        let mut candidates = Vec::new();
        let mut offers = Vec::new();
        let mut later = Vec::new();
        for (rank, blocks) in self.blocks.iter().enumerate() {
            let mut hit = blocks.lookup(hashes, logprobs);
            let cached = hit.len();
            let tokens = reusable_tokens(cached, bt, seq.prompt.len(), logprobs);
            hit.truncate(tokens.div_ceil(bt));
            let shared = &hit[..tokens / bt];
            if !blocks.fits(shared, reserved_blocks - shared.len()) {
                continue;
            }
            let offer = RankOffer {
                rank,
                load: self.rank_load(rank),
                running: self.running[rank].len(),
                reused: tokens,
            };
            let computing = Self::computing_prefix(&computing[rank], hashes, cached, logprobs);
            later.push(RankOffer {
                reused: reusable_tokens(computing, bt, seq.prompt.len(), logprobs),
                ..offer
            });
            offers.push(offer);
            candidates.push(Placement { rank, hit, tokens });
        }
        let slack = self.config.chunk_tokens;
        let rank = choose_rank(&offers, slack)?;
        let soon = choose_rank(&later, slack)?;
        if later
            .iter()
            .any(|o| o.rank == soon && o.reused > offers_reused(&offers, soon))
        {
            return Some(Admission::Later);
        }
        candidates
            .into_iter()
            .find(|c| c.rank == rank)
            .map(Admission::Now)
    }

    /// Tokens the sequences running on `rank` compute over their lives (prompt not reused, plus
    /// `max_tokens`): the load admission balances.
    fn rank_load(&self, rank: usize) -> usize {
        let seqs = self.running[rank].iter();
        seqs.map(|s| s.reserved - s.cached_tokens).sum()
    }

    /// How many leading blocks of `hashes` `rank` will have once its running sequences computed
    /// their prompts: the `cached` it has, then those of its running sequences' prompt blocks
    /// not registered yet (with `logprobs`, only of sequences that score their prompts).
    fn computing_prefix(
        computing: &Computing,
        hashes: &[BlockHash],
        cached: usize,
        logprobs: bool,
    ) -> usize {
        let more = hashes[cached..]
            .iter()
            .take_while(|h| computing.get(h).is_some_and(|&scored| scored || !logprobs));
        cached + more.count()
    }

    /// Per rank, the prompt blocks its running sequences are computing (see [`Computing`]).
    fn computing(&self) -> Vec<Computing> {
        let mut ranks: Vec<Computing> = vec![Computing::new(); self.running.len()];
        if self.config.prefix_caching {
            for (computing, seqs) in ranks.iter_mut().zip(&self.running) {
                for seq in seqs.iter().filter(|s| !s.done) {
                    self.note_computing(computing, seq);
                }
            }
        }
        ranks
    }

    /// Adds `seq`'s unregistered prompt blocks to its rank's `computing`.
    fn note_computing(&self, computing: &mut Computing, seq: &Sequence) {
        let scored = seq.wants_prompt_logprobs();
        for &hash in seq.unregistered_prompt_hashes(self.config.block_tokens) {
            *computing.entry(hash).or_default() |= scored;
        }
    }

    /// Gives `seq` its blocks on the placement's rank and starts its KV cache from the cached
    /// prefix there; a sequence that cannot start is failed with the reason (and released with
    /// the finished ones).
    fn start(&mut self, seq: &mut Sequence, placement: &Placement) {
        let bt = self.config.block_tokens;
        let blocks = &mut self.blocks[placement.rank];
        // Taken before `hold`, which may evict the partly used last block to make room.
        let cached: Vec<(KvBlock, Option<BlockLogprobs>)> = placement
            .hit
            .iter()
            .filter_map(|&id| blocks.block(id))
            .map(|(kv, logprobs)| (kv.clone(), logprobs.cloned()))
            .collect();
        let shared = placement.tokens / bt;
        match blocks.hold(&placement.hit[..shared], seq.reserved.div_ceil(bt) - shared) {
            Ok(table) => seq.blocks = table,
            Err(err) => return seq.fail(format!("cannot hold KV blocks: {err}")),
        }
        seq.registered = shared;
        blocks.count_query(seq.prompt.len(), placement.tokens);
        let (kv, logprobs): (Vec<KvBlock>, Vec<Option<BlockLogprobs>>) = cached.into_iter().unzip();
        let logprobs: Vec<BlockLogprobs> = logprobs.into_iter().flatten().collect();
        if let Err(err) = seq.reuse_prefix(&kv, &logprobs, placement.tokens) {
            seq.fail(format!("cannot reuse the cached prefix: {err}"));
        }
    }

    /// Registers the full blocks every running sequence completed with its rank's prefix cache.
    fn register_blocks(&mut self) {
        if !self.config.prefix_caching {
            return;
        }
        let bt = self.config.block_tokens;
        for (blocks, seqs) in self.blocks.iter_mut().zip(self.running.iter_mut()) {
            for seq in seqs.iter_mut() {
                while seq.registered < seq.cache.full_blocks() {
                    let index = seq.registered;
                    let (Some(hash), Some(&id)) =
                        (seq.block_hash(&self.hasher, index), seq.blocks.get(index))
                    else {
                        break;
                    };
                    let logprobs = seq.block_logprobs(index, bt);
                    blocks.register(id, hash, || seq.cache.block(index), logprobs);
                    seq.registered += 1;
                }
            }
        }
    }

    /// Per rank: decode tokens first, then prefill chunks, within `chunk_tokens`.
    fn plan_step(&self) -> Vec<Vec<Slice>> {
        self.running
            .iter()
            .map(|seqs| {
                let mut budget = self.config.chunk_tokens;
                let mut slices = Vec::new();
                let decoding = seqs.iter().enumerate().filter(|(_, s)| !s.prefilling());
                let prefilling = seqs.iter().enumerate().filter(|(_, s)| s.prefilling());
                for (index, seq) in decoding.chain(prefilling) {
                    if budget == 0 {
                        break;
                    }
                    if seq.done || seq.pending() == 0 {
                        continue;
                    }
                    let len = seq.pending().min(budget);
                    budget -= len;
                    slices.push(Slice {
                        index,
                        start: seq.computed,
                        len,
                    });
                }
                slices
            })
            .collect()
    }

    /// Drops finished sequences and those whose client is gone, releasing their blocks.
    fn release_finished(&mut self) {
        self.waiting.retain(|s| !s.done && !s.client_gone());
        for (blocks, seqs) in self.blocks.iter_mut().zip(self.running.iter_mut()) {
            for seq in seqs.extract_if(.., |s| s.done || s.client_gone()) {
                if let Err(err) = blocks.release(&seq.blocks) {
                    tracing::error!(%err, id = seq.id, "releasing a sequence's KV blocks failed");
                }
            }
        }
    }
}

/// Row-major rows of a logits tensor.
fn logits_rows(logits: &Tensor) -> Result<Vec<Vec<f32>>> {
    Ok(logits
        .to_vec2::<f32>()
        .map_err(rackfill_models::ModelError::from)?)
}
