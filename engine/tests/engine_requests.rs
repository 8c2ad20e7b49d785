//! The engine thread end to end on the built-in model: continuous batching with chunked prefill,
//! greedy generations identical across EP sizes and balancers, prompt logprobs equal to the
//! dense path, stop handling, admission limits, cancellation and routing traces.

use std::sync::Arc;
use std::time::Duration;

use rackfill_balancer::Algo;
use rackfill_engine::routing_trace::RoutingTraceConfig;
use rackfill_engine::{
    EngineConfig, EngineError, EngineHandle, EpConfig, Event, FinishReason, GenerateRequest,
    RequestError, RequestStream, SamplingParams, SchedulerConfig, StopReason, TokenLogprob,
};
use rackfill_models::{LogitsFor, ModelBundle, SequenceInput};

fn spawn(ep_size: usize, balancer: Algo, chunk_tokens: usize, kv: usize) -> EngineHandle {
    spawn_with(config(ep_size, balancer, chunk_tokens, kv))
}

fn spawn_recording(
    ep_size: usize,
    balancer: Algo,
    chunk_tokens: usize,
    kv: usize,
    record_routing: Option<std::path::PathBuf>,
) -> EngineHandle {
    spawn_with(EngineConfig {
        record_routing: record_routing.map(RoutingTraceConfig::new),
        ..config(ep_size, balancer, chunk_tokens, kv)
    })
}

fn config(ep_size: usize, balancer: Algo, chunk_tokens: usize, kv: usize) -> EngineConfig {
    EngineConfig {
        ep: EpConfig {
            ep_size,
            balancer,
            verify_plans: true,
            ..EpConfig::default()
        },
        scheduler: SchedulerConfig {
            chunk_tokens,
            kv_tokens_per_rank: kv,
            ..SchedulerConfig::default()
        },
        max_waiting: 64,
        ..EngineConfig::default()
    }
}

fn spawn_with(config: EngineConfig) -> EngineHandle {
    let bundle = ModelBundle::builtin().unwrap();
    EngineHandle::spawn(
        Arc::new(bundle.model),
        Arc::new(bundle.tokenizer),
        bundle.stop_token_ids,
        config,
    )
    .unwrap()
}

fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

/// Everything a request produced.
#[derive(Debug, Default)]
struct Outcome {
    tokens: Vec<u32>,
    text: String,
    prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    reason: Option<FinishReason>,
    stop: Option<StopReason>,
}

fn collect(mut stream: RequestStream) -> Outcome {
    let mut out = Outcome::default();
    while let Some(event) = stream.events.blocking_recv() {
        match event {
            Event::PromptLogprobs(lp) => out.prompt_logprobs = Some(lp),
            Event::Token(t) => {
                out.tokens.push(t.token);
                out.text.push_str(&t.text);
            }
            Event::Finished(f) => {
                out.text.push_str(&f.text);
                out.reason = Some(f.reason);
                out.stop = f.stop;
                break;
            }
            Event::Error(e) => panic!("request failed: {e}"),
        }
    }
    out
}

fn prompts() -> Vec<Vec<u32>> {
    let tokenizer = ModelBundle::builtin().unwrap().tokenizer;
    [
        "The quick brown fox jumps over the lazy dog because it wants to see what is there.",
        "Once upon a time",
        "In the beginning the engine balanced every layer on its exact load, and the rack was fast.",
        "Hello",
        "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30",
        "A B C",
    ]
    .iter()
    .map(|p| tokenizer.encode(p, false).unwrap())
    .collect()
}

/// Submits every prompt at once (so they batch together) and collects the outcomes.
fn run_all(engine: &EngineHandle, prompts: &[Vec<u32>], params: &SamplingParams) -> Vec<Outcome> {
    let streams: Vec<RequestStream> = prompts
        .iter()
        .map(|p| {
            engine
                .submit(GenerateRequest {
                    prompt: p.clone(),
                    params: params.clone(),
                })
                .unwrap()
        })
        .collect();
    streams.into_iter().map(collect).collect()
}

#[test]
fn greedy_generations_are_identical_across_ep_sizes_and_balancers() {
    let prompts = prompts();
    let params = greedy(6);
    let reference = run_all(&spawn(1, Algo::None, 4096, 4096), &prompts, &params);
    for out in &reference {
        assert_eq!(out.tokens.len(), 6);
        assert_eq!(out.reason, Some(FinishReason::Length));
    }
    // Chunks of 7 tokens split every long prompt across steps; decode steps interleave with
    // other sequences' prefill chunks.
    for (ep, algo) in [
        (2, Algo::Quota),
        (3, Algo::EplbExact),
        (4, Algo::GreedyMove),
        (8, Algo::Quota),
        (8, Algo::EplbHistory),
    ] {
        let got = run_all(&spawn(ep, algo, 7, 4096), &prompts, &params);
        for (i, (g, r)) in got.iter().zip(&reference).enumerate() {
            assert_eq!(g.tokens, r.tokens, "EP {ep} {algo}: prompt {i}");
            assert_eq!(g.text, r.text, "EP {ep} {algo}: prompt {i}");
        }
    }
}

#[test]
fn prompt_logprobs_match_the_dense_path() {
    let bundle = ModelBundle::builtin().unwrap();
    let prompt = prompts().remove(0);
    let mut cache = bundle.model.new_cache();
    let logits = bundle
        .model
        .forward(
            &mut [SequenceInput {
                tokens: &prompt,
                cache: &mut cache,
            }],
            LogitsFor::AllPositions,
        )
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let engine = spawn(4, Algo::Quota, 5, 4096);
    let params = SamplingParams {
        max_tokens: 0,
        prompt_logprobs: Some(2),
        ..greedy(0)
    };
    let out = run_all(&engine, std::slice::from_ref(&prompt), &params).remove(0);
    assert_eq!(out.reason, Some(FinishReason::Length));
    assert!(out.tokens.is_empty());
    let lp = out.prompt_logprobs.expect("prompt logprobs were sent");
    assert_eq!(lp.len(), prompt.len());
    assert!(lp[0].is_none());
    for (i, entry) in lp.iter().enumerate().skip(1) {
        let entry = entry.as_ref().unwrap();
        assert_eq!(entry.token, prompt[i]);
        let row = &logits[i - 1];
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
        let want = row[prompt[i] as usize] - lse;
        assert!((entry.logprob - want).abs() < 1e-4, "position {i}");
        assert_eq!(entry.top_logprobs.len(), 2);
    }
}

#[test]
fn stop_strings_and_seeded_sampling() {
    let engine = spawn(2, Algo::Quota, 16, 4096);
    let prompt = prompts().remove(1);
    let free = run_all(&engine, std::slice::from_ref(&prompt), &greedy(12)).remove(0);
    // Stop on a piece of the greedy continuation (two characters from the first non-space one
    // at or after the middle): the text must end right before its first occurrence.
    let middle = free.text.len() / 2;
    let start = free
        .text
        .char_indices()
        .find(|&(i, c)| i >= middle && !c.is_whitespace())
        .expect("the greedy continuation has visible text")
        .0;
    let stop: String = free.text[start..].chars().take(2).collect();
    let params = SamplingParams {
        stop: vec![stop.clone()],
        ..greedy(12)
    };
    let out = run_all(&engine, std::slice::from_ref(&prompt), &params).remove(0);
    assert_eq!(out.reason, Some(FinishReason::Stop));
    assert_eq!(out.stop, Some(StopReason::String(stop.clone())));
    assert_eq!(out.text, free.text[..free.text.find(&stop).unwrap()]);
    // Stop on a token of the greedy continuation: generation ends with its first occurrence,
    // and the stop reason names the token (as vLLM's `stop_reason` does).
    let stop_token = free.tokens[free.tokens.len() / 2];
    let first = free.tokens.iter().position(|&t| t == stop_token).unwrap();
    let params = SamplingParams {
        stop_token_ids: vec![stop_token],
        ..greedy(12)
    };
    let out = run_all(&engine, std::slice::from_ref(&prompt), &params).remove(0);
    assert_eq!(out.reason, Some(FinishReason::Stop));
    assert_eq!(out.stop, Some(StopReason::Token(stop_token)));
    assert_eq!(out.tokens, free.tokens[..=first]);
    let seeded = SamplingParams {
        temperature: 1.0,
        seed: Some(7),
        ..greedy(10)
    };
    let a = run_all(&engine, std::slice::from_ref(&prompt), &seeded).remove(0);
    let b = run_all(&engine, &[prompt.clone(), prompts().remove(0)], &seeded).remove(0);
    assert_eq!(
        a.tokens, b.tokens,
        "a seed reproduces regardless of the batch"
    );
}

#[test]
fn admission_limits_and_bad_requests_are_typed_errors() {
    let engine = spawn(2, Algo::Quota, 64, 100);
    let too_long = GenerateRequest {
        prompt: vec![5; 90],
        params: greedy(20),
    };
    assert!(matches!(
        engine.submit(too_long),
        Err(EngineError::Request(RequestError::ContextLength(_)))
    ));
    let empty = GenerateRequest {
        prompt: vec![],
        params: greedy(1),
    };
    assert!(matches!(
        engine.submit(empty),
        Err(EngineError::Request(RequestError::EmptyPrompt { .. }))
    ));
    let bad_token = GenerateRequest {
        prompt: vec![1_000_000],
        params: greedy(1),
    };
    assert!(matches!(
        engine.submit(bad_token),
        Err(EngineError::Request(RequestError::OutOfVocabulary { .. }))
    ));
    let bad_param = GenerateRequest {
        prompt: vec![5],
        params: SamplingParams {
            top_p: 0.0,
            ..greedy(1)
        },
    };
    assert!(matches!(
        engine.submit(bad_param),
        Err(EngineError::Request(RequestError::Sampling(_)))
    ));
    // Reservations of 60 tokens: one per rank fits a 100-token budget, the rest wait and still
    // finish once KV is released.
    let params = greedy(10);
    let prompts = vec![vec![7u32; 50]; 5];
    let outs = run_all(&engine, &prompts, &params);
    assert!(outs.iter().all(|o| o.tokens.len() == 10));
}

#[test]
fn dropped_streams_cancel_and_free_their_kv() {
    let engine = spawn(1, Algo::None, 8, 400);
    // Fills the only rank's KV budget; dropping the stream must release it.
    let hog = engine
        .submit(GenerateRequest {
            prompt: vec![9; 100],
            params: greedy(290),
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(hog);
    let out = run_all(&engine, &[vec![9; 100]], &greedy(250)).remove(0);
    assert_eq!(out.tokens.len(), 250);
    engine.shutdown();
    assert!(!engine.is_alive());
    let after = engine.submit(GenerateRequest {
        prompt: vec![1],
        params: greedy(1),
    });
    assert!(matches!(after, Err(EngineError::Unavailable)));
}

#[test]
fn routing_trace_records_every_step_and_moe_layer() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("routing.jsonl");
    let engine = spawn_recording(4, Algo::Quota, 16, 4096, Some(path.clone()));
    let prompts = prompts();
    let outs = run_all(&engine, &prompts, &greedy(2));
    engine.shutdown();
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let layers = 4;
    assert!(!lines.is_empty() && lines.len().is_multiple_of(layers));
    // Every token computed (prompts once, then each generated token but the last) appears top-k
    // times in every layer's matrix, summed over steps.
    let tokens: usize = prompts.iter().map(Vec::len).sum::<usize>()
        + outs.iter().map(|o| o.tokens.len() - 1).sum::<usize>();
    for layer in 0..layers {
        let mut pairs = 0u64;
        for line in lines.iter().filter(|l| l["layer"] == layer) {
            assert_eq!(line["ranks"], 4);
            assert_eq!(line["experts"], 32);
            let load = line["load"].as_array().unwrap();
            assert_eq!(load.len(), 4);
            pairs += load
                .iter()
                .flat_map(|row| row.as_array().unwrap())
                .map(|v| v.as_u64().unwrap())
                .sum::<u64>();
        }
        assert_eq!(pairs, tokens as u64 * 4, "layer {layer}");
    }
}

/// A request's sequences are queued together or not at all, and a full queue says what it
/// counts: sequences (every prompt times `n`), not requests.
#[test]
fn requests_queue_whole_and_a_full_queue_counts_sequences() {
    let engine = spawn_with(EngineConfig {
        max_waiting: 3,
        ..config(1, Algo::None, 64, 2000)
    });
    let long = |prompt: u32| GenerateRequest {
        prompt: vec![prompt; 100],
        params: greedy(1890),
    };
    // The hog takes the only rank's whole KV budget, so everything after it waits.
    let hog = engine.submit(long(9)).unwrap();
    while engine.queued() > 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let pair = engine
        .enqueue(engine.validate(vec![long(10), long(11)]).unwrap())
        .unwrap();
    assert_eq!(pair.len(), 2);
    assert_eq!(engine.queued(), 2);
    let refused = engine.enqueue(engine.validate(vec![long(12), long(13)]).unwrap());
    let err = refused.unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::QueueFull {
                waiting: 2,
                needed: 2,
                limit: 3
            }
        ),
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.contains("2 of its 3 sequences") && message.contains("needs 2 more"),
        "{message}"
    );
    // Nothing of the refused request was queued; one more sequence still fits.
    assert_eq!(engine.queued(), 2);
    let one = engine.submit(long(14)).unwrap();
    assert_eq!(engine.queued(), 3);
    drop((hog, pair, one));
    engine.shutdown();
}

/// `max_request_tokens` bounds prompt plus `max_tokens` over all sequences of one request.
#[test]
fn the_tokens_of_one_request_are_bounded() {
    let engine = spawn_with(EngineConfig {
        max_request_tokens: 1000,
        ..config(1, Algo::None, 64, 4096)
    });
    let sequence = GenerateRequest {
        prompt: vec![5; 200],
        params: greedy(50),
    };
    assert!(engine.validate(vec![sequence.clone(); 4]).is_ok());
    let err = engine.validate(vec![sequence; 5]).unwrap_err();
    assert_eq!(
        err,
        RequestError::TooManyTokens {
            tokens: 1250,
            sequences: 5,
            limit: 1000
        }
    );
    engine.shutdown();
}
