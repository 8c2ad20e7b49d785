//! `bench forward` and `bench ep` refuse sizes they could not run (a prompt longer than the
//! model's context, more tokens than a step holds, EP sizes beyond the experts) before anything
//! is allocated, on the built-in model.

use rackfill_balancer::Algo;
use rackfill_bench::ep::{random_prompts, run_ep, EpBenchError, EpCase, MAX_STEP_TOKENS};
use rackfill_bench::forward::{run_forward, ForwardBenchError};
use rackfill_engine::{Rack, Schedule, SlotMemory};
use rackfill_models::ModelBundle;
use std::sync::Arc;

fn model() -> rackfill_models::MoeModel {
    ModelBundle::builtin().expect("built-in model").model
}

#[test]
fn forward_lengths_are_checked_before_any_run() {
    let model = model();
    let context = model.config().max_position_embeddings;
    // 2^64-1 overflowed the prompt's allocation; every length is checked before the first runs.
    for bad in [usize::MAX, 1 << 32, context + 1] {
        let err = run_forward(&model, "tiny", &[8, bad], 1, 0).unwrap_err();
        assert!(
            matches!(err, ForwardBenchError::TooLong { tokens, .. } if tokens == bad),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            format!("prompt length {bad} exceeds the model's context of {context} tokens")
        );
    }
    let report = run_forward(&model, "tiny", &[8], 1, 0).unwrap();
    assert_eq!(report.results[0].tokens, 8);
}

#[test]
fn ep_sizes_and_prompt_volumes_are_bounded() {
    let model = model();
    let (context, experts) = (
        model.config().max_position_embeddings,
        model.config().moe.num_experts,
    );
    let err = random_prompts(&model, 1, context + 1, 0).unwrap_err();
    assert!(matches!(err, EpBenchError::PromptTooLong { .. }), "{err}");
    // Counted without allocating: 2^64-1 one-token prompts stop at the first excess token.
    let err = random_prompts(&model, usize::MAX, 1, 0).unwrap_err();
    assert!(matches!(err, EpBenchError::TooManyTokens), "{err}");
    assert!(random_prompts(&model, MAX_STEP_TOKENS, 1, 0).is_ok());

    let prompts = random_prompts(&model, 2, 4, 0).unwrap();
    let model = Arc::new(model);
    for ep_size in [usize::MAX, experts + 1] {
        let case = EpCase {
            ep_size,
            balancer: Algo::Quota,
            schedule: Schedule::PIPELINED,
            slot_memory: SlotMemory::Shared,
        };
        let err = run_ep(
            Arc::clone(&model),
            "tiny",
            &prompts,
            &[case],
            2,
            &Rack::nvl72(),
            1,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "EP size {ep_size} must be in 1..={experts}: the model has {experts} routed \
                 experts, and a rank beyond them would home none"
            )
        );
    }
    let case = EpCase {
        ep_size: 2,
        balancer: Algo::Quota,
        schedule: Schedule::ULTRAEP,
        slot_memory: SlotMemory::Shared,
    };
    let report = run_ep(model, "tiny", &prompts, &[case], 2, &Rack::nvl72(), 1).unwrap();
    assert_eq!(report.tokens_per_step, 8);
}
