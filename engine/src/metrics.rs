//! The engine's Prometheus metrics, recorded through the `metrics` facade (the server installs
//! the exporter and its buckets). Names follow vLLM's `prefix:name` style.

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};

use crate::scheduler::StepSummary;

/// Per-layer rank-load imbalance before balancing (`max L0 / mean L0`).
pub const IMBALANCE_BEFORE: &str = "rackfill:moe_imbalance_before";
/// Per-layer rank-load imbalance after balancing (`max L / mean L`).
pub const IMBALANCE_AFTER: &str = "rackfill:moe_imbalance_after";
/// Replicas created, summed over layers and steps.
pub const REPLICAS: &str = "rackfill:moe_replicas_total";
/// Replica weight bytes streamed.
pub const REPLICA_BYTES: &str = "rackfill:moe_replica_bytes_total";
/// Plan solve time per layer, microseconds.
pub const SOLVE_US: &str = "rackfill:moe_plan_solve_microseconds";
/// Wall time per MoE phase (`phase` label: route, solve, replicate, dispatch, experts, combine).
pub const PHASE_SECONDS: &str = "rackfill:moe_phase_seconds";
/// Tokens computed per step (all ranks).
pub const STEP_TOKENS: &str = "rackfill:step_tokens";
/// Steps run.
pub const STEPS: &str = "rackfill:steps_total";
/// Sequences waiting for admission.
pub const WAITING: &str = "rackfill:num_requests_waiting";
/// Sequences admitted and not finished.
pub const RUNNING: &str = "rackfill:num_requests_running";
/// Reserved KV over the KV budget, 0 to 1.
pub const KV_USAGE: &str = "rackfill:kv_cache_usage_perc";
/// 1 while `--record-routing` records, 0 once it stopped (its byte cap, or a failed write).
pub const ROUTING_TRACE_RECORDING: &str = "rackfill:routing_trace_recording";
/// Bytes of whole steps written to the routing trace.
pub const ROUTING_TRACE_BYTES: &str = "rackfill:routing_trace_bytes_total";

/// Gives every engine metric its `# HELP` text in the installed recorder (call once, after
/// installing it), so a scraper's users see what each series means.
pub fn describe() {
    describe_histogram!(
        IMBALANCE_BEFORE,
        "Per-layer rank-load imbalance before balancing (max over mean rank load)."
    );
    describe_histogram!(
        IMBALANCE_AFTER,
        "Per-layer rank-load imbalance after balancing (max over mean rank load)."
    );
    describe_counter!(
        REPLICAS,
        "Replica expert instances created, over layers and steps."
    );
    describe_counter!(
        REPLICA_BYTES,
        "Replica weight bytes streamed between ranks."
    );
    describe_histogram!(
        SOLVE_US,
        "Replication plan solve time per MoE layer, microseconds."
    );
    describe_histogram!(
        PHASE_SECONDS,
        "Wall time per MoE layer phase (route, solve, replicate, dispatch, experts, combine)."
    );
    describe_histogram!(STEP_TOKENS, "Tokens computed per engine step, all ranks.");
    describe_counter!(STEPS, "Engine steps run.");
    describe_gauge!(WAITING, "Sequences waiting for admission.");
    describe_gauge!(RUNNING, "Sequences admitted and not finished.");
    describe_gauge!(KV_USAGE, "Reserved KV cache over the KV budget, 0 to 1.");
    describe_gauge!(
        ROUTING_TRACE_RECORDING,
        "1 while --record-routing records every step, 0 once recording stopped \
         (--record-routing-max-bytes reached, or a write failed; see the log)."
    );
    describe_counter!(
        ROUTING_TRACE_BYTES,
        "Bytes of whole steps written to the --record-routing trace."
    );
}

/// Records one step's balancing figures and phase times.
pub fn record_step(summary: &StepSummary) {
    counter!(STEPS).increment(1);
    histogram!(STEP_TOKENS).record(summary.tokens.iter().sum::<usize>() as f64);
    for layer in &summary.output.layers {
        histogram!(IMBALANCE_BEFORE).record(layer.metrics.imbalance_before);
        histogram!(IMBALANCE_AFTER).record(layer.metrics.imbalance_after);
        counter!(REPLICAS).increment(layer.metrics.replicas as u64);
        counter!(REPLICA_BYTES).increment(layer.replica_bytes);
        histogram!(SOLVE_US).record(layer.solve_us);
        let p = &layer.phases;
        for (phase, took) in [
            ("route", p.route),
            ("solve", p.solve),
            ("replicate", p.replicate),
            ("dispatch", p.dispatch),
            ("experts", p.experts),
            ("combine", p.combine),
        ] {
            histogram!(PHASE_SECONDS, "phase" => phase).record(took.as_secs_f64());
        }
    }
}

/// Records the scheduler's queue and KV gauges.
pub fn record_queue(waiting: usize, running: usize, kv_usage: f64) {
    gauge!(WAITING).set(waiting as f64);
    gauge!(RUNNING).set(running as f64);
    gauge!(KV_USAGE).set(kv_usage);
}

/// Sets the routing-trace recording gauge (1 recording, 0 stopped).
pub fn routing_trace_recording(recording: bool) {
    gauge!(ROUTING_TRACE_RECORDING).set(if recording { 1.0 } else { 0.0 });
}

/// Counts bytes written to the routing trace.
pub fn routing_trace_written(bytes: u64) {
    counter!(ROUTING_TRACE_BYTES).increment(bytes);
}
