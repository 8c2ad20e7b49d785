//! The engine's Prometheus metrics, recorded through the `metrics` facade (the server installs
//! the exporter and its buckets). Names follow vLLM's `prefix:name` style.

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};

use std::time::Duration;

use crate::ep::StepOutput;
use crate::kv_export::pool as kv_export;
use crate::prefix_cache::PrefixCacheStats;

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
/// Wall time of one engine step (all its layers, all ranks together).
pub const STEP_SECONDS: &str = "rackfill:step_seconds";
/// Bytes the fabric delivered to ranks from other ranks (tokens, outputs, replicas), all ranks.
pub const FABRIC_BYTES: &str = "rackfill:fabric_received_bytes";
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
/// Processes (EP ranks) of a multi-process group, on its leader.
pub const GROUP_RANKS: &str = "rackfill:group_ranks";
/// One rank's waiting sequences (`rank` label), on the leader of a multi-process group.
pub const RANK_WAITING: &str = "rackfill:rank_num_requests_waiting";
/// One rank's running sequences (`rank` label).
pub const RANK_RUNNING: &str = "rackfill:rank_num_requests_running";
/// One rank's reserved KV over its budget (`rank` label).
pub const RANK_KV_USAGE: &str = "rackfill:rank_kv_cache_usage_perc";
/// Bytes one rank received over the fabric (`rank` label).
pub const RANK_FABRIC_BYTES: &str = "rackfill:rank_fabric_received_bytes";
/// Sequences looked up in a rank's prefix cache (`rank` label).
pub const PREFIX_QUERIES: &str = "rackfill:prefix_cache_queries_total";
/// Sequences that reused at least one cached token (`rank` label).
pub const PREFIX_HITS: &str = "rackfill:prefix_cache_hits_total";
/// Prompt tokens of the sequences looked up (`rank` label).
pub const PREFIX_QUERIED_TOKENS: &str = "rackfill:prefix_cache_queried_tokens_total";
/// Prompt tokens reused from the prefix cache instead of computed (`rank` label).
pub const PREFIX_HIT_TOKENS: &str = "rackfill:prefix_cache_hit_tokens_total";
/// Reused over looked-up prompt tokens since start (`rank` label).
pub const PREFIX_HIT_RATE: &str = "rackfill:prefix_cache_hit_rate";
/// A rank's KV blocks by state (`rank`, `state` = used, cached or free).
pub const KV_BLOCKS: &str = "rackfill:kv_blocks";
/// Cached KV blocks evicted to make room (`rank` label).
pub const KV_BLOCKS_EVICTED: &str = "rackfill:kv_blocks_evicted_total";
/// Seconds since the leader last heard a rank's heartbeat (`rank` label).
pub const RANK_HEARTBEAT_AGE: &str = "rackfill:rank_heartbeat_age_seconds";
/// 1 for the path the MoE layers' rows and replicas take between ranks (`path` label: `cpu`,
/// host memory and the fabric; `device`, every rank on this process's device; `host`, device
/// ranks of several processes through host buffers and the fabric).
pub const MOE_DATA_PATH: &str = "rackfill:moe_data_path";
/// Bytes of the model on this process's device (`part` label: `uploaded`, written from the
/// host while loading; `home_experts`, the routed experts this process's ranks home).
pub const DEVICE_WEIGHT_BYTES: &str = "rackfill:device_weight_bytes";
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
    describe_histogram!(
        STEP_SECONDS,
        "Wall time of one engine step, all layers and ranks."
    );
    describe_gauge!(
        FABRIC_BYTES,
        "Bytes delivered to EP ranks from other ranks over the fabric since start."
    );
    describe_gauge!(
        RANK_FABRIC_BYTES,
        "Bytes one rank received from other ranks over the fabric since start."
    );
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
    describe_gauge!(
        GROUP_RANKS,
        "Processes (EP ranks) in the multi-process group."
    );
    describe_gauge!(RANK_WAITING, "Sequences waiting for admission on one rank.");
    describe_gauge!(
        RANK_RUNNING,
        "Sequences admitted and not finished on one rank."
    );
    describe_gauge!(
        RANK_KV_USAGE,
        "One rank's reserved KV cache over its budget, 0 to 1."
    );
    describe_counter!(
        PREFIX_QUERIES,
        "Sequences looked up in the rank's prefix cache."
    );
    describe_counter!(
        PREFIX_HITS,
        "Sequences that reused at least one prompt token from the prefix cache."
    );
    describe_counter!(
        PREFIX_QUERIED_TOKENS,
        "Prompt tokens of the sequences looked up in the prefix cache."
    );
    describe_counter!(
        PREFIX_HIT_TOKENS,
        "Prompt tokens reused from the prefix cache instead of computed."
    );
    describe_gauge!(
        PREFIX_HIT_RATE,
        "Prompt tokens reused over prompt tokens looked up since start, 0 to 1."
    );
    describe_gauge!(
        KV_BLOCKS,
        "KV blocks of a rank by state: used (held by running sequences), cached (kept for \
         later prefixes, evicted when room is needed) or free."
    );
    describe_counter!(
        KV_BLOCKS_EVICTED,
        "Cached KV blocks evicted to make room for new sequences."
    );
    describe_gauge!(
        RANK_HEARTBEAT_AGE,
        "Seconds since the leader last heard the rank's heartbeat."
    );
    describe_gauge!(
        MOE_DATA_PATH,
        "1 for the path MoE rows and replicas take between ranks: cpu, device (every rank on \
         this device), peer (device ranks of several processes, through peer memory) or host \
         (device ranks of several processes, through host buffers)."
    );
    describe_gauge!(
        DEVICE_WEIGHT_BYTES,
        "Bytes of the model on this process's device: uploaded (written from the host while \
         loading, each tensor once) and home_experts (the routed experts its ranks home)."
    );
    describe_gauge!(
        kv_export::KV_EXPORT_HELD_BLOCKS,
        "Blocks of the KV export arena held until a decode side reads them, per rank."
    );
    describe_gauge!(
        kv_export::KV_EXPORT_HELD_BYTES,
        "Bytes of exported KV held until a decode side reads them, per rank."
    );
    describe_gauge!(
        kv_export::KV_EXPORT_PEAK_HELD_BYTES,
        "The most exported KV bytes held at once since start, per rank."
    );
    describe_histogram!(
        kv_export::KV_EXPORT_COPY_SECONDS,
        "Seconds the engine thread spends copying one request's KV into the export arena."
    );
    describe_counter!(
        kv_export::KV_EXPORT_REQUESTS,
        "KV exports by event: exported, released (read and notified), expired, refused, \
         unknown_notification."
    );
}

/// Records where the MoE data moves and what the device holds (`weights`: bytes uploaded and
/// bytes of home experts, with the model on a device).
pub fn record_placement(path: &'static str, weights: Option<(u64, u64)>) {
    gauge!(MOE_DATA_PATH, "path" => path).set(1.0);
    if let Some((uploaded, home_experts)) = weights {
        gauge!(DEVICE_WEIGHT_BYTES, "part" => "uploaded").set(uploaded as f64);
        gauge!(DEVICE_WEIGHT_BYTES, "part" => "home_experts").set(home_experts as f64);
    }
}

/// Records one step's balancing figures and phase times; `tokens` were computed over all ranks
/// in `took`.
pub fn record_step(output: &StepOutput, tokens: usize, took: Duration) {
    counter!(STEPS).increment(1);
    histogram!(STEP_SECONDS).record(took.as_secs_f64());
    histogram!(STEP_TOKENS).record(tokens as f64);
    for layer in &output.layers {
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

/// Sets the bytes the fabric delivered to every rank since start.
pub fn record_fabric(bytes: u64) {
    gauge!(FABRIC_BYTES).set(bytes as f64);
}

/// Records the scheduler's queue and KV gauges.
pub fn record_queue(waiting: usize, running: usize, kv_usage: f64) {
    gauge!(WAITING).set(waiting as f64);
    gauge!(RUNNING).set(running as f64);
    gauge!(KV_USAGE).set(kv_usage);
}

/// Records every rank's prefix-cache counters and KV block states (index = rank).
pub fn record_prefix_cache(ranks: &[PrefixCacheStats]) {
    for (rank, stats) in ranks.iter().enumerate() {
        let rank = rank.to_string();
        counter!(PREFIX_QUERIES, "rank" => rank.clone()).absolute(stats.queries);
        counter!(PREFIX_HITS, "rank" => rank.clone()).absolute(stats.hits);
        counter!(PREFIX_QUERIED_TOKENS, "rank" => rank.clone()).absolute(stats.queried_tokens);
        counter!(PREFIX_HIT_TOKENS, "rank" => rank.clone()).absolute(stats.hit_tokens);
        gauge!(PREFIX_HIT_RATE, "rank" => rank.clone()).set(stats.hit_rate());
        for (state, blocks) in [
            ("used", stats.blocks_used),
            ("cached", stats.blocks_cached),
            ("free", stats.blocks_free),
        ] {
            gauge!(KV_BLOCKS, "rank" => rank.clone(), "state" => state).set(blocks as f64);
        }
        counter!(KV_BLOCKS_EVICTED, "rank" => rank).absolute(stats.blocks_evicted);
    }
}

/// Sets the routing-trace recording gauge (1 recording, 0 stopped).
pub fn routing_trace_recording(recording: bool) {
    gauge!(ROUTING_TRACE_RECORDING).set(if recording { 1.0 } else { 0.0 });
}

/// Counts bytes written to the routing trace.
pub fn routing_trace_written(bytes: u64) {
    counter!(ROUTING_TRACE_BYTES).increment(bytes);
}
