//! Balancer replay: every balancer on every step of every suite, side by side on the same loads.
//!
//! For each suite, every balancer gets a fresh instance (so `eplb-history` keeps its own window over
//! that suite's steps) and plans every step. Each plan is checked with [`Plan::validate`] against the
//! balancer's own `u_min`; only `Balancer::plan` itself is timed. Plans are evaluated with
//! [`metrics::evaluate`] and dropped: the report keeps per-group aggregates, never the plans.
//!
//! Groups (each with one row per balancer): `all`; `exact-load` (suites with 1024 or 4096 tokens per
//! rank, the regime exact-load planning is built for); one per shape, token count, popularity family
//! and temporal pattern.
//!
//! [`Plan::validate`]: rackfill_balancer::Plan::validate

use crate::markdown::{markdown_table, write_validation_failures, MAX_FAILURES_KEPT};
use crate::stats::percentile;
use crate::synthetic::{self, Suite};
use rackfill_balancer::relay::{direct_send_bytes, plan_transfers, RelayConfig};
use rackfill_balancer::{metrics, Algo, BalanceError, Plan, Settings};
use serde::Serialize;
use std::fmt::{self, Write as _};
use std::time::{Duration, Instant};

/// Token counts per rank that make up the `exact-load` group.
pub const EXACT_LOAD_TOKENS: [u64; 2] = [1024, 4096];

/// What to replay.
#[derive(Debug, Clone)]
pub struct BalanceRun {
    pub suites: Vec<Suite>,
    /// Master seed; suite `s` is generated with a seed mixed from it and the suite's name.
    pub seed: u64,
    pub settings: Settings,
    /// Balancers in report order.
    pub algos: Vec<Algo>,
}

impl BalanceRun {
    /// Every balancer of [`Algo::ALL`] over `suites`.
    pub fn new(suites: Vec<Suite>, seed: u64, settings: Settings) -> Self {
        Self {
            suites,
            seed,
            settings,
            algos: Algo::ALL.to_vec(),
        }
    }
}

/// Reported to the caller after every suite.
#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    /// Suites finished, including this one.
    pub done: usize,
    pub total: usize,
    pub suite: &'a Suite,
    pub elapsed: Duration,
}

/// Why one plan was not counted: the planner failed or its plan broke an invariant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Failure {
    pub balancer: String,
    pub suite: String,
    pub step: usize,
    pub error: String,
}

/// Aggregates of one balancer over one group of steps.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BalancerStats {
    pub balancer: String,
    /// Plans that passed validation (the statistics below are over these).
    pub plans: usize,
    /// Plans that failed validation or could not be made.
    pub validation_failures: usize,
    /// Mean imbalance with main experts only (the same for every balancer).
    pub imbalance_before_mean: f64,
    pub imbalance_mean: f64,
    pub imbalance_p99: f64,
    pub imbalance_max: f64,
    pub gap_mean: f64,
    pub gap_max: f64,
    pub replicas_mean: f64,
    pub max_fanout_mean: f64,
    pub max_fanout_max: usize,
    pub inflight_ratio_mean: f64,
    pub token_straggler_mean: f64,
    pub solve_us_median: f64,
    pub solve_us_p99: f64,
    /// Plans with a fan-out of at least [`RELAY_FANOUT`], where relay trees are measured.
    pub relay_plans: usize,
    /// Over those plans: busiest sender's bytes with direct fan-out divided by the same with relay
    /// trees (default [`RelayConfig`]), mean and worst.
    pub relay_gain_mean: f64,
    pub relay_gain_min: f64,
}

/// One slice of the suites (`kind` = `all`, `exact-load`, `shape`, `tokens`, `family`, `pattern`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupReport {
    pub kind: String,
    pub label: String,
    pub suites: usize,
    /// Load matrices (steps) in the group; every balancer planned each of them.
    pub steps: usize,
    pub balancers: Vec<BalancerStats>,
}

/// The result of a replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BalanceReport {
    pub source: String,
    pub seed: u64,
    pub u_min: u64,
    pub history_window: usize,
    pub rebalance_interval: usize,
    pub suites: usize,
    pub steps: usize,
    pub balancers: Vec<String>,
    /// Total failed plans over all balancers; anything but 0 is a bug in a planner.
    pub validation_failures: usize,
    /// The first failures (at most `MAX_FAILURES_KEPT`, 20), each verbatim.
    pub failures: Vec<Failure>,
    /// Time spent generating load matrices, in milliseconds.
    pub generate_ms: f64,
    pub wall_ms: f64,
    pub groups: Vec<GroupReport>,
}

impl BalanceReport {
    /// The group of a kind and label, e.g. `("shape", "72/256/2")` or `("all", "all")`.
    pub fn group(&self, kind: &str, label: &str) -> Option<&GroupReport> {
        self.groups
            .iter()
            .find(|g| g.kind == kind && g.label == label)
    }
}

/// Runs every balancer of `run` over every step of every suite.
///
/// Planner errors and invalid plans are counted as failures (see [`BalanceReport::failures`]), not
/// returned; the error is for suites that cannot be generated or laid out.
pub fn run_balance(
    run: &BalanceRun,
    mut progress: impl FnMut(Progress<'_>),
) -> Result<BalanceReport, RunError> {
    let started = Instant::now();
    for suite in &run.suites {
        suite.check().map_err(|e| RunError(e.to_string()))?;
    }
    let mut groups = Groups::default();
    let mut failures = Vec::new();
    let mut failure_count = 0usize;
    let mut generate = Duration::ZERO;
    let mut steps_total = 0usize;
    let n_algos = run.algos.len();

    for (index, suite) in run.suites.iter().enumerate() {
        let layout = suite
            .layout()
            .map_err(|e: BalanceError| RunError(format!("suite '{}': {e}", suite.name)))?;
        let ids = groups.ids_for(suite, n_algos);
        let mut balancers: Vec<_> = run.algos.iter().map(|a| a.build(&run.settings)).collect();
        let mut generator = synthetic::generate(suite, suite_seed(run.seed, &suite.name))
            .map_err(|e| RunError(e.to_string()))?;
        let mut step = 0;
        loop {
            let t = Instant::now();
            let Some(load) = generator.next() else { break };
            generate += t.elapsed();
            for &g in &ids {
                groups.list[g].steps += 1;
            }
            for (b, balancer) in balancers.iter_mut().enumerate() {
                // In the engine the planner runs right after the load all-gather, with the matrix
                // in cache; touch it so that the timing is the solve, not the generator's misses.
                std::hint::black_box(load.total());
                let t = Instant::now();
                let result = balancer.plan(&layout, &load);
                let solve_us = t.elapsed().as_nanos() as f64 / 1e3;
                let checked = result
                    .map_err(|e| format!("planner error: {e}"))
                    .and_then(|plan| {
                        plan.validate(&layout, &load, balancer.u_min())
                            .map(|()| plan)
                            .map_err(|e| format!("invalid plan: {e}"))
                    });
                match checked {
                    Ok(plan) => {
                        let m = metrics::evaluate(&layout, &load, &plan);
                        let gain = (m.max_fanout >= RELAY_FANOUT).then(|| relay_gain(&plan));
                        for &g in &ids {
                            groups.list[g].accs[b].add(&m, solve_us, gain);
                        }
                    }
                    Err(error) => {
                        failure_count += 1;
                        for &g in &ids {
                            groups.list[g].accs[b].failures += 1;
                        }
                        if failures.len() < MAX_FAILURES_KEPT {
                            failures.push(Failure {
                                balancer: balancer.name().to_string(),
                                suite: suite.name.clone(),
                                step,
                                error,
                            });
                        }
                    }
                }
            }
            step += 1;
        }
        steps_total += step;
        progress(Progress {
            done: index + 1,
            total: run.suites.len(),
            suite,
            elapsed: started.elapsed(),
        });
    }

    let names: Vec<String> = run.algos.iter().map(|a| a.name().to_string()).collect();
    Ok(BalanceReport {
        source: "synthetic".into(),
        seed: run.seed,
        u_min: run.settings.u_min,
        history_window: run.settings.history_window,
        rebalance_interval: run.settings.rebalance_interval,
        suites: run.suites.len(),
        steps: steps_total,
        validation_failures: failure_count,
        failures,
        generate_ms: generate.as_secs_f64() * 1e3,
        wall_ms: started.elapsed().as_secs_f64() * 1e3,
        groups: groups.finish(&names),
        balancers: names,
    })
}

/// A suite that could not be generated or laid out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RunError(pub String);

/// The seed suite `name` is generated with under master seed `seed`: independent streams per suite,
/// stable across grids (a suite's loads do not depend on which other suites run).
pub fn suite_seed(seed: u64, name: &str) -> u64 {
    // FNV-1a of the name, then splitmix64 of the mix.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut z = (seed ^ h).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const KINDS: [&str; 6] = ["all", "exact-load", "shape", "tokens", "family", "pattern"];

#[derive(Default)]
struct Groups {
    list: Vec<Group>,
}

struct Group {
    kind: usize,
    label: String,
    suites: usize,
    steps: usize,
    accs: Vec<Acc>,
}

impl Groups {
    /// Indices of the groups `suite` belongs to (created on first sight), with its suite counted.
    fn ids_for(&mut self, suite: &Suite, n_algos: usize) -> Vec<usize> {
        let mut keys = vec![(0, "all".to_string())];
        if EXACT_LOAD_TOKENS.contains(&suite.tokens_per_rank) {
            keys.push((1, "tokens 1024-4096".to_string()));
        }
        keys.push((2, suite.shape().to_string()));
        keys.push((3, suite.tokens_per_rank.to_string()));
        keys.push((4, suite.family.label()));
        keys.push((5, suite.pattern.kind().to_string()));
        keys.into_iter()
            .map(|(kind, label)| {
                let id = match self
                    .list
                    .iter()
                    .position(|g| g.kind == kind && g.label == label)
                {
                    Some(id) => id,
                    None => {
                        self.list.push(Group {
                            kind,
                            label,
                            suites: 0,
                            steps: 0,
                            accs: (0..n_algos).map(|_| Acc::default()).collect(),
                        });
                        self.list.len() - 1
                    }
                };
                self.list[id].suites += 1;
                id
            })
            .collect()
    }

    fn finish(mut self, names: &[String]) -> Vec<GroupReport> {
        // Stable: within a kind, groups stay in order of first appearance.
        self.list.sort_by_key(|g| g.kind);
        self.list
            .into_iter()
            .map(|g| GroupReport {
                kind: KINDS[g.kind].to_string(),
                label: g.label,
                suites: g.suites,
                steps: g.steps,
                balancers: g
                    .accs
                    .into_iter()
                    .zip(names)
                    .map(|(acc, name)| acc.finish(name))
                    .collect(),
            })
            .collect()
    }
}

/// Fan-out from which the relay gain is reported (the target: >= 1.5x from 16 up).
pub const RELAY_FANOUT: usize = 16;

/// Bytes of one DeepSeek-V3 expert in FP8 (gate, up, down: 3 x 7168 x 2048).
pub const EXPERT_BYTES: u64 = 3 * 7168 * 2048;

/// Busiest sender with direct fan-out over busiest sender with relay trees.
fn relay_gain(plan: &Plan) -> f64 {
    let direct = direct_send_bytes(plan, EXPERT_BYTES);
    let relayed = plan_transfers(plan, EXPERT_BYTES, &RelayConfig::default()).send_bytes;
    let peak = |v: &[u64]| v.iter().copied().max().unwrap_or(0).max(1) as f64;
    peak(&direct) / peak(&relayed)
}

#[derive(Default)]
struct Acc {
    relay_gains: Vec<f64>,
    failures: usize,
    imbalance: Vec<f64>,
    solve_us: Vec<f64>,
    imbalance_before: f64,
    gap_sum: f64,
    gap_max: f64,
    replicas: f64,
    fanout_sum: f64,
    fanout_max: usize,
    inflight: f64,
    straggler: f64,
}

impl Acc {
    fn add(&mut self, m: &metrics::PlanMetrics, solve_us: f64, relay_gain: Option<f64>) {
        self.relay_gains.extend(relay_gain);
        self.imbalance.push(m.imbalance_after);
        self.solve_us.push(solve_us);
        self.imbalance_before += m.imbalance_before;
        self.gap_sum += m.gap;
        self.gap_max = self.gap_max.max(m.gap);
        self.replicas += m.replicas as f64;
        self.fanout_sum += m.max_fanout as f64;
        self.fanout_max = self.fanout_max.max(m.max_fanout);
        self.inflight += m.inflight_ratio;
        self.straggler += m.token_straggler;
    }

    fn finish(mut self, name: &str) -> BalancerStats {
        let n = self.imbalance.len();
        let mean = |sum: f64| if n == 0 { 0.0 } else { sum / n as f64 };
        self.imbalance.sort_by(f64::total_cmp);
        self.solve_us.sort_by(f64::total_cmp);
        BalancerStats {
            balancer: name.to_string(),
            plans: n,
            validation_failures: self.failures,
            imbalance_before_mean: mean(self.imbalance_before),
            imbalance_mean: mean(self.imbalance.iter().sum()),
            imbalance_p99: percentile(&self.imbalance, 0.99),
            imbalance_max: self.imbalance.last().copied().unwrap_or(0.0),
            gap_mean: mean(self.gap_sum),
            gap_max: self.gap_max,
            replicas_mean: mean(self.replicas),
            max_fanout_mean: mean(self.fanout_sum),
            max_fanout_max: self.fanout_max,
            inflight_ratio_mean: mean(self.inflight),
            token_straggler_mean: mean(self.straggler),
            solve_us_median: percentile(&self.solve_us, 0.5),
            solve_us_p99: percentile(&self.solve_us, 0.99),
            relay_plans: self.relay_gains.len(),
            relay_gain_mean: if self.relay_gains.is_empty() {
                0.0
            } else {
                self.relay_gains.iter().sum::<f64>() / self.relay_gains.len() as f64
            },
            relay_gain_min: self
                .relay_gains
                .iter()
                .copied()
                .reduce(f64::min)
                .unwrap_or(0.0),
        }
    }
}

impl BalanceReport {
    /// The report as markdown: a header, a loud failure section when any plan failed, then one
    /// fixed-width table per group.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# balance replay ({}): {} suites, {} steps, {} balancers, seed {}",
            self.source,
            self.suites,
            self.steps,
            self.balancers.len(),
            self.seed
        );
        let _ = writeln!(
            out,
            "u_min {}, history window {}, rebalance interval {}; generate {:.1} s, wall {:.1} s",
            self.u_min,
            self.history_window,
            self.rebalance_interval,
            self.generate_ms / 1e3,
            self.wall_ms / 1e3
        );
        write_validation_failures(
            &mut out,
            self.validation_failures,
            self.failures.iter().map(|f| {
                format!(
                    "{} on '{}' step {}: {}",
                    f.balancer, f.suite, f.step, f.error
                )
            }),
        );
        for g in &self.groups {
            let title = if g.kind == g.label {
                g.kind.clone()
            } else {
                format!("{} {}", g.kind, g.label)
            };
            let _ = writeln!(
                out,
                "\n## {title} ({} suites, {} steps; imbalance before {:.3})\n",
                g.suites,
                g.steps,
                g.balancers.first().map_or(0.0, |b| b.imbalance_before_mean)
            );
            out.push_str(&stats_table(&g.balancers));
        }
        out
    }
}

impl fmt::Display for BalanceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_table())
    }
}

fn stats_table(rows: &[BalancerStats]) -> String {
    let header = [
        "balancer",
        "imb mean",
        "imb p99",
        "imb max",
        "gap mean",
        "gap max",
        "replicas",
        "fanout",
        "fanout max",
        "inflight",
        "straggler",
        "solve p50 us",
        "solve p99 us",
        "relay x (fanout>=16)",
        "fails",
    ];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|s| {
            vec![
                s.balancer.clone(),
                format!("{:.3}", s.imbalance_mean),
                format!("{:.3}", s.imbalance_p99),
                format!("{:.3}", s.imbalance_max),
                format!("{:.3}", s.gap_mean),
                format!("{:.3}", s.gap_max),
                format!("{:.1}", s.replicas_mean),
                format!("{:.2}", s.max_fanout_mean),
                s.max_fanout_max.to_string(),
                format!("{:.3}", s.inflight_ratio_mean),
                format!("{:.0}", s.token_straggler_mean),
                format!("{:.1}", s.solve_us_median),
                format!("{:.1}", s.solve_us_p99),
                if s.relay_plans == 0 {
                    "-".to_string()
                } else {
                    format!("{:.2} (min {:.2})", s.relay_gain_mean, s.relay_gain_min)
                },
                s.validation_failures.to_string(),
            ]
        })
        .collect();
    markdown_table(&header, &cells)
}
