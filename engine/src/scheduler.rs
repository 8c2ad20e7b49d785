//! Continuous batching with chunked prefill over `R` data-parallel ranks.
//!
//! New sequences wait in FIFO order and are admitted to the rank with the least reserved KV
//! (ties: fewest running sequences, then the lower rank) once their whole reservation (prompt
//! plus `max_tokens`) fits that rank's KV budget, so admission never over-commits it. Each step
//! gives every rank a budget of `chunk_tokens`: decode tokens of running sequences first (one
//! each, so generation never starves), then prefill chunks in admission order, a long prompt
//! split across as many steps as it needs. Finished and cancelled sequences release their KV at
//! the end of the step that saw them finish.

use std::collections::VecDeque;
use std::time::Instant;

use candle_core::Tensor;
use rackfill_models::{LogitsFor, SequenceInput};

use crate::ep::{EpRuntime, StepOutput};
use crate::error::{EngineError, Result};
use crate::sequence::Sequence;

/// Scheduling limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens one rank processes per step (prefill chunks plus decode tokens).
    pub chunk_tokens: usize,
    /// KV cache budget per rank, in tokens.
    pub kv_tokens_per_rank: usize,
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

/// Waiting and running sequences and the KV reservations of every rank.
pub struct Scheduler {
    config: SchedulerConfig,
    waiting: VecDeque<Sequence>,
    running: Vec<Vec<Sequence>>,
    kv_reserved: Vec<usize>,
}

impl Scheduler {
    /// An empty scheduler for `ranks` ranks.
    pub fn new(ranks: usize, config: SchedulerConfig) -> Result<Self> {
        if ranks == 0 || config.chunk_tokens == 0 || config.kv_tokens_per_rank == 0 {
            return Err(EngineError::Config(format!(
                "{ranks} ranks, chunk {} tokens, KV {} tokens per rank: all must be positive",
                config.chunk_tokens, config.kv_tokens_per_rank
            )));
        }
        Ok(Self {
            config,
            waiting: VecDeque::new(),
            running: (0..ranks).map(|_| Vec::new()).collect(),
            kv_reserved: vec![0; ranks],
        })
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

    /// Reserved KV over the whole budget, in `[0, 1]`.
    pub fn kv_usage(&self) -> f64 {
        let budget = self.config.kv_tokens_per_rank * self.running.len();
        self.kv_reserved.iter().sum::<usize>() as f64 / budget as f64
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
        self.kv_reserved.iter().sum::<usize>()
            + self.waiting.iter().map(|s| s.reserved).sum::<usize>()
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

    /// FIFO admission to the least-loaded rank that fits the head of the queue.
    fn admit(&mut self) {
        while let Some(head) = self.waiting.front() {
            if head.done {
                self.waiting.pop_front();
                continue;
            }
            let need = head.reserved;
            let rank = (0..self.running.len())
                .filter(|&r| self.kv_reserved[r] + need <= self.config.kv_tokens_per_rank)
                .min_by_key(|&r| (self.kv_reserved[r], self.running[r].len(), r));
            let Some(rank) = rank else { break };
            let mut seq = self.waiting.pop_front().expect("head exists");
            seq.scheduled = Some(Instant::now());
            self.kv_reserved[rank] += need;
            self.running[rank].push(seq);
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

    /// Drops finished sequences and those whose client is gone, releasing their KV.
    fn release_finished(&mut self) {
        self.waiting.retain(|s| !s.done && !s.client_gone());
        for (rank, seqs) in self.running.iter_mut().enumerate() {
            seqs.retain(|s| {
                let keep = !s.done && !s.client_gone();
                if !keep {
                    self.kv_reserved[rank] -= s.reserved;
                }
                keep
            });
        }
    }
}

/// Row-major rows of a logits tensor.
fn logits_rows(logits: &Tensor) -> Result<Vec<Vec<f32>>> {
    Ok(logits
        .to_vec2::<f32>()
        .map_err(rackfill_models::ModelError::from)?)
}
