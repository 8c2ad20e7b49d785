//! Prefix caching must not change what a request gets: with a cache hit, every request's
//! greedy tokens equal those of a run without the prefix cache, and its sampled and prompt
//! logprobs (echo) agree within [`TOLERANCE`], for every model family, EP size and balancer;
//! hits that end inside a block, a sequence cancelled mid-prefill, and eviction under memory
//! pressure included. The scheduler is driven step by step, so which request hits what is
//! deterministic.

use std::path::PathBuf;
use std::sync::Arc;

use rackfill_balancer::Algo;
use rackfill_engine::scheduler::Scheduler;
use rackfill_engine::sequence::{Sequence, SequenceParts};
use rackfill_engine::{
    EpConfig, EpRuntime, Event, GenerateRequest, SamplingParams, SchedulerConfig, TokenLogprob,
};
use rackfill_models::{ModelBundle, MoeModel, Tokenizer};
use tokio::sync::mpsc;

/// Max abs difference of any logprob between a run with cache hits and one without: the reused
/// KV was computed in other batches, whose GEMMs may round differently in the last bits.
const TOLERANCE: f32 = 1e-5;

const BLOCK: usize = 16;

fn builtin() -> (Arc<MoeModel>, Arc<Tokenizer>) {
    let bundle = ModelBundle::builtin().expect("built-in model");
    (Arc::new(bundle.model), Arc::new(bundle.tokenizer))
}

fn fixture(family: &str) -> Arc<MoeModel> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures")
        .join(family);
    Arc::new(MoeModel::load(&dir).expect("fixture loads"))
}

/// Deterministic tokens of request `seed` over the model's vocabulary.
fn tokens(vocab: usize, seed: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|j| ((seed * 7919 + j * 104_729 + j * j * 31) % vocab) as u32)
        .collect()
}

fn params(max_tokens: u32, echo: bool) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: true,
        logprobs: Some(2),
        prompt_logprobs: echo.then_some(3),
        ..SamplingParams::default()
    }
}

/// What one request got back.
#[derive(Debug, Default)]
struct Outcome {
    tokens: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    cached: usize,
    error: Option<String>,
}

/// A scheduler over an EP runtime, stepped by hand.
struct Bench {
    runtime: EpRuntime,
    scheduler: Scheduler,
    tokenizer: Arc<Tokenizer>,
    next_id: u64,
}

impl Bench {
    fn new(
        model: Arc<MoeModel>,
        tokenizer: Arc<Tokenizer>,
        ep: EpConfig,
        scheduler: SchedulerConfig,
    ) -> Self {
        Self {
            runtime: EpRuntime::new(model, ep).expect("runtime"),
            scheduler: Scheduler::new(ep.ep_size, scheduler, 7).expect("scheduler"),
            tokenizer,
            next_id: 1,
        }
    }

    /// Queues a request; returns its id and event stream.
    fn submit(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> (u64, mpsc::UnboundedReceiver<Event>) {
        let id = self.next_id;
        self.next_id += 1;
        let (tx, rx) = mpsc::unbounded_channel();
        let parts = SequenceParts {
            id,
            request: GenerateRequest { prompt, params },
            arrived: std::time::Instant::now(),
            fallback_seed: id,
            tokenizer: Arc::clone(&self.tokenizer),
            eos: Arc::from(Vec::new()),
            events: tx,
            kv_export: None,
        };
        let cache = self.runtime.new_cache(self.scheduler.block_tokens());
        self.scheduler.enqueue(Sequence::new(parts, cache));
        (id, rx)
    }

    fn step(&mut self) {
        self.scheduler.step(&mut self.runtime).expect("step");
    }

    fn run_to_idle(&mut self) {
        while !self.scheduler.is_idle() {
            self.step();
        }
    }

    /// Runs one request alone to its end.
    fn request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Outcome {
        let (_, mut rx) = self.submit(prompt, params);
        self.run_to_idle();
        collect(&mut rx)
    }
}

fn collect(rx: &mut mpsc::UnboundedReceiver<Event>) -> Outcome {
    let mut out = Outcome::default();
    while let Ok(event) = rx.try_recv() {
        match event {
            Event::Token(t) => {
                out.tokens.push(t.token);
                out.logprobs.extend(t.logprob);
            }
            Event::PromptLogprobs(lps) => out.prompt_logprobs = Some(lps),
            Event::Finished(f) => out.cached = f.usage.cached_tokens,
            Event::Error(e) => out.error = Some(e),
        }
    }
    out
}

fn ep(ep_size: usize, balancer: Algo) -> EpConfig {
    EpConfig {
        ep_size,
        balancer,
        verify_plans: true,
        ..EpConfig::default()
    }
}

fn scheduler(chunk_tokens: usize, kv: usize, prefix_caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        chunk_tokens,
        kv_tokens_per_rank: kv,
        block_tokens: BLOCK,
        prefix_caching,
    }
}

fn assert_close(a: &TokenLogprob, b: &TokenLogprob, what: &str) {
    assert_eq!(a.token, b.token, "{what}: token");
    assert!(
        (a.logprob - b.logprob).abs() <= TOLERANCE,
        "{what}: logprob {} vs {}",
        a.logprob,
        b.logprob
    );
    let ids = |t: &TokenLogprob| t.top_logprobs.iter().map(|x| x.0).collect::<Vec<_>>();
    assert_eq!(ids(a), ids(b), "{what}: top tokens");
    for (x, y) in a.top_logprobs.iter().zip(&b.top_logprobs) {
        assert!(
            (x.1 - y.1).abs() <= TOLERANCE,
            "{what}: top logprob {x:?} vs {y:?}"
        );
    }
}

/// The same request with and without cache hits got the same answer.
fn assert_same(hit: &Outcome, miss: &Outcome, what: &str) {
    assert_eq!(hit.error, None, "{what}");
    assert_eq!(miss.error, None, "{what}");
    assert_eq!(hit.tokens, miss.tokens, "{what}: greedy tokens");
    assert_eq!(hit.logprobs.len(), miss.logprobs.len(), "{what}");
    for (i, (a, b)) in hit.logprobs.iter().zip(&miss.logprobs).enumerate() {
        assert_close(a, b, &format!("{what}: token {i}"));
    }
    match (&hit.prompt_logprobs, &miss.prompt_logprobs) {
        (Some(a), Some(b)) => {
            assert_eq!(a.len(), b.len(), "{what}: prompt logprobs");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                match (x, y) {
                    (Some(x), Some(y)) => {
                        assert_eq!(x.top_logprobs.len(), 3, "{what}: top 3 asked");
                        assert_close(x, y, &format!("{what}: prompt position {i}"));
                    }
                    (None, None) => assert_eq!(i, 0, "{what}: only position 0 has none"),
                    _ => panic!("{what}: prompt position {i}: {x:?} vs {y:?}"),
                }
            }
        }
        (None, None) => {}
        _ => panic!("{what}: prompt logprobs on one side only"),
    }
}

/// A conversation of requests over one shared prefix of 37 tokens (two blocks and five tokens,
/// so the shared part ends inside a block), run one after the other: returns each outcome.
fn conversation(bench: &mut Bench, vocab: usize) -> Vec<Outcome> {
    let shared = tokens(vocab, 1, 37);
    let with = |tail_seed: usize, tail: usize| {
        let mut prompt = shared.clone();
        prompt.extend(tokens(vocab, tail_seed, tail));
        prompt
    };
    let first = with(2, 9);
    let mut out = vec![
        bench.request(first.clone(), params(4, true)),
        bench.request(with(3, 11), params(4, true)),
        bench.request(with(4, 6), params(3, false)),
        bench.request(first.clone(), params(4, true)),
    ];
    // The next turn of the first request: its prompt, its answer, a new message.
    let mut turn = first;
    turn.extend(&out[0].tokens);
    turn.extend(tokens(vocab, 5, 20));
    out.push(bench.request(turn, params(3, false)));
    out
}

/// Cached tokens the conversation's requests reuse: echo requests reuse one token fewer than
/// the cached blocks hold; the next turn reuses its first turn's blocks (computed with the
/// answer: 46 + 4 - 1 tokens in the cache, three whole blocks).
const CONVERSATION_HITS: [usize; 5] = [0, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK - 1, 3 * BLOCK];

fn check_model(
    model: Arc<MoeModel>,
    tokenizer: &Arc<Tokenizer>,
    ep_sizes: &[usize],
    algos: &[Algo],
) {
    let vocab = model.config().vocab_size;
    let mut reference = Bench::new(
        Arc::clone(&model),
        Arc::clone(tokenizer),
        ep(1, Algo::None),
        scheduler(24, 4096, false),
    );
    let misses = conversation(&mut reference, vocab);
    assert!(misses.iter().all(|o| o.cached == 0));
    for &ep_size in ep_sizes {
        for &algo in algos {
            let mut bench = Bench::new(
                Arc::clone(&model),
                Arc::clone(tokenizer),
                ep(ep_size, algo),
                scheduler(24, 4096, true),
            );
            let hits = conversation(&mut bench, vocab);
            let what = format!("{:?} EP {ep_size} {algo}", model.config().family);
            let cached: Vec<usize> = hits.iter().map(|o| o.cached).collect();
            assert_eq!(cached, CONVERSATION_HITS, "{what}: cached tokens");
            for (i, (hit, miss)) in hits.iter().zip(&misses).enumerate() {
                assert_same(hit, miss, &format!("{what}, request {i}"));
            }
        }
    }
}

#[test]
fn cache_hits_give_the_tokens_and_logprobs_of_no_cache_on_the_builtin_model() {
    let (model, tokenizer) = builtin();
    check_model(model, &tokenizer, &[1, 3, 8], &Algo::ALL);
}

#[test]
fn cache_hits_give_the_tokens_and_logprobs_of_no_cache_for_every_family() {
    let (_, tokenizer) = builtin();
    for family in ["qwen2_moe", "deepseek_v3", "mixtral", "qwen3_moe"] {
        check_model(
            fixture(family),
            &tokenizer,
            &[2, 4],
            &[Algo::Quota, Algo::EplbExact, Algo::None],
        );
    }
}

#[test]
fn a_sequence_cancelled_mid_prefill_leaves_its_computed_blocks_to_the_next() {
    let (model, tokenizer) = builtin();
    let vocab = model.config().vocab_size;
    let prompt = tokens(vocab, 9, 70);
    let mut bench = Bench::new(
        Arc::clone(&model),
        Arc::clone(&tokenizer),
        ep(3, Algo::Quota),
        scheduler(BLOCK * 2, 4096, true),
    );
    let (id, mut cancelled) = bench.submit(prompt.clone(), params(4, false));
    bench.step(); // the first 32 prompt tokens: two blocks
    bench.scheduler.cancel(id);
    let again = bench.request(prompt.clone(), params(4, false));
    assert_eq!(collect(&mut cancelled).tokens, Vec::<u32>::new());
    assert_eq!(
        again.cached,
        2 * BLOCK,
        "the cancelled prefill's two blocks"
    );
    let mut reference = Bench::new(
        model,
        tokenizer,
        ep(1, Algo::None),
        scheduler(64, 4096, false),
    );
    let miss = reference.request(prompt, params(4, false));
    assert_same(&again, &miss, "after a cancelled prefill");
}

#[test]
fn eviction_under_memory_pressure_drops_the_least_recently_used_tail_first() {
    let (model, tokenizer) = builtin();
    let vocab = model.config().vocab_size;
    // Four blocks per rank: one 40 + 4 token request holds three.
    let mut bench = Bench::new(
        Arc::clone(&model),
        Arc::clone(&tokenizer),
        ep(1, Algo::Quota),
        scheduler(64, 4 * BLOCK, true),
    );
    let a = tokens(vocab, 11, 40);
    let d = tokens(vocab, 12, 36);
    let first = bench.request(a.clone(), params(4, false));
    let stats = bench.scheduler.prefix_stats()[0];
    assert_eq!(
        (stats.blocks_cached, stats.blocks_free),
        (2, 2),
        "{stats:?}"
    );
    // Three blocks for `d`: one of `a`'s two cached blocks must go, its tail.
    let other = bench.request(d.clone(), params(4, false));
    assert_eq!(bench.scheduler.prefix_stats()[0].blocks_evicted, 1);
    let again = bench.request(a.clone(), params(4, false));
    assert_eq!(again.cached, BLOCK, "only the first block of `a` survived");
    assert_eq!(bench.scheduler.prefix_stats()[0].blocks_evicted, 2);
    assert_same(&again, &first, "after eviction");
    let mut reference = Bench::new(
        model,
        tokenizer,
        ep(1, Algo::None),
        scheduler(64, 4096, false),
    );
    assert_same(&other, &reference.request(d, params(4, false)), "evicting");
    let stats = bench.scheduler.prefix_stats()[0];
    assert_eq!(stats.queries, 3);
    assert_eq!(stats.hits, 1);
    assert_eq!(stats.hit_tokens, BLOCK as u64);
    assert_eq!(stats.queried_tokens, 40 + 36 + 40);
}

#[test]
fn admission_follows_a_cached_prefix_while_the_load_gap_is_smaller() {
    let (model, tokenizer) = builtin();
    let vocab = model.config().vocab_size;
    let shared = tokens(vocab, 21, 40);
    for (busy_tokens, expected_rank) in [(5, 0), (200, 1)] {
        let mut bench = Bench::new(
            Arc::clone(&model),
            Arc::clone(&tokenizer),
            ep(2, Algo::Quota),
            scheduler(64, 4096, true),
        );
        bench.request(shared.clone(), params(2, false)); // rank 0 caches two blocks
                                                         // Rank 0 then runs a sequence of `busy_tokens` + 10 tokens: the prefix (32 tokens)
                                                         // plus one step (64 tokens) outweighs 15 tokens of extra load, not 210.
        let (_, _busy) = bench.submit(tokens(vocab, 22, busy_tokens), params(10, false));
        bench.step();
        let mut prompt = shared.clone();
        prompt.extend(tokens(vocab, 23, 8));
        let (_, mut rx) = bench.submit(prompt, params(2, false));
        bench.run_to_idle();
        let hit = collect(&mut rx);
        let stats = bench.scheduler.prefix_stats();
        let hits: Vec<u64> = stats.iter().map(|s| s.hits).collect();
        let expected_hits = if expected_rank == 0 {
            vec![1, 0]
        } else {
            vec![0, 0]
        };
        assert_eq!(hits, expected_hits, "busy {busy_tokens}: hits per rank");
        assert_eq!(hit.cached, if expected_rank == 0 { 2 * BLOCK } else { 0 });
        assert_eq!(
            stats[expected_rank].queries,
            1 + u64::from(expected_rank == 0) * 2
        );
    }
}

/// An evaluation harness sends one context with four continuations at once: the first computes
/// the context, the other three wait a step for it and reuse it (all on the same rank), and
/// every score equals the scores without the cache.
#[test]
fn continuations_arriving_together_wait_for_their_context_and_reuse_it() {
    let (model, tokenizer) = builtin();
    let vocab = model.config().vocab_size;
    let context = tokens(vocab, 41, 100);
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let mut prompt = context.clone();
            prompt.extend(tokens(vocab, 50 + i, 8));
            prompt
        })
        .collect();
    let score = || params(0, true);
    let run = |caching: bool| {
        let mut bench = Bench::new(
            Arc::clone(&model),
            Arc::clone(&tokenizer),
            ep(2, Algo::Quota),
            scheduler(256, 4096, caching),
        );
        let mut streams: Vec<_> = prompts
            .iter()
            .map(|p| bench.submit(p.clone(), score()).1)
            .collect();
        bench.run_to_idle();
        let outcomes: Vec<Outcome> = streams.iter_mut().map(collect).collect();
        (outcomes, bench.scheduler.prefix_stats())
    };
    let (hits, stats) = run(true);
    let (misses, _) = run(false);
    // Six whole blocks of context, less the one echoed position computed again.
    let cached: Vec<usize> = hits.iter().map(|o| o.cached).collect();
    assert_eq!(cached, [0, 95, 95, 95]);
    assert_eq!(stats.iter().map(|s| s.hits).collect::<Vec<_>>(), [3, 0]);
    for (i, (hit, miss)) in hits.iter().zip(&misses).enumerate() {
        assert_eq!(hit.prompt_logprobs.as_ref().map(Vec::len), Some(108));
        assert_same(hit, miss, &format!("continuation {i}"));
    }
}

#[test]
fn without_the_prefix_cache_nothing_is_reused_or_kept() {
    let (model, tokenizer) = builtin();
    let vocab = model.config().vocab_size;
    let mut bench = Bench::new(
        model,
        tokenizer,
        ep(2, Algo::Quota),
        scheduler(64, 4096, false),
    );
    let prompt = tokens(vocab, 31, 50);
    for _ in 0..2 {
        assert_eq!(bench.request(prompt.clone(), params(2, false)).cached, 0);
    }
    for stats in bench.scheduler.prefix_stats() {
        assert_eq!(
            (stats.queries, stats.blocks_cached, stats.blocks_used),
            (0, 0, 0)
        );
    }
}
