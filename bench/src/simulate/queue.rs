//! Request-trace queueing: TTFT per request when a request trace is served on the simulated rack.
//!
//! Model (prefill only, as a prefill server in a disaggregated deployment; output lengths are not
//! simulated):
//! - arrivals: the trace's own timestamps, or re-timed as a seeded Poisson process at each
//!   `--rates` value (`rackfill_bench::serve::arrivals`, the load generator's own schedule);
//! - data-parallel attention: each request is assigned on arrival to the rank with the fewest
//!   outstanding prefill tokens (ties: lowest rank) and stays there;
//! - chunked prefill: every step, each rank takes up to `--chunk-tokens` tokens from its queue in
//!   arrival order (a request may span steps, later chunks attending to the earlier ones);
//! - a step lasts what the cost model says for that batch (all ranks step together, an idle rank
//!   included); a request's TTFT is the end of the step holding its last prompt token minus its
//!   arrival;
//! - routing: step `s` of every timeline uses step `s` of the same synthetic trace, generated at
//!   a full chunk per rank; ranks with fewer tokens keep a uniformly thinned share of their row
//!   ([`super::trace::thin_rows`]).
//!
//! One timeline per (balancer or ideal, rate); all of them advance in lockstep over one routing
//! stream so it is generated once.

use super::cost::Segment;
use super::error::SimError;
use super::report::RateReport;
use super::spec::{SimSpec, MAX_STEPS};
use super::step::StepCoster;
use super::trace::{thin_rows, LoadStream};
use crate::serve::arrivals::{schedule, Arrivals, RequestRate};
use crate::serve::dataset::RequestSpec;
use crate::serve::report::percentile;
use crate::synthetic::multilayer::TracePattern;
use rackfill_balancer::{Algo, LoadMatrix};
use rackfill_engine::Schedule;
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::collections::VecDeque;

/// Latest arrival the simulation accepts, seconds (about 32 years): the clock is an `f64` of
/// seconds, which at 1e9 s still resolves 0.1 us, far below a step; later arrivals (a rate like
/// 1e-18 req/s) would lose the step times in rounding.
pub const MAX_ARRIVAL_S: f64 = 1e9;

/// Longest prompt a request may have, tokens: above any model's context window (a few million),
/// so a longer one is a broken trace, not a workload.
pub const MAX_PROMPT_TOKENS: u64 = 1 << 24;

/// A request-trace simulation.
#[derive(Debug, Clone)]
pub struct RequestRun {
    pub spec: SimSpec,
    pub requests: Vec<RequestSpec>,
    /// Requests per second to re-time the trace at; empty replays its timestamps.
    pub rates: Vec<f64>,
}

/// A request waiting for (the rest of) its prefill on one rank.
#[derive(Debug, Clone, Copy)]
struct Pending {
    arrival: f64,
    remaining: u64,
    done: u64,
}

/// One balancer (or the ideal) serving the trace at one rate.
struct Timeline<'a> {
    coster: StepCoster<'a>,
    algo: Option<Algo>,
    rate: Option<f64>,
    /// Arrival times, seconds, non-decreasing, with each request's prompt length.
    arrivals: Vec<(f64, u64)>,
    next: usize,
    queues: Vec<VecDeque<Pending>>,
    outstanding: Vec<u64>,
    clock: f64,
    ttft: Vec<f64>,
    last_finish: f64,
    steps: usize,
    busy_ms: f64,
    rng: StdRng,
    done: bool,
    /// The spec's schedule, as an index into [`Schedule::ALL`] (what a step lasts).
    schedule: usize,
}

impl Timeline<'_> {
    /// Queues every request that has arrived by `self.clock`.
    fn admit(&mut self) {
        while let Some(&(at, len)) = self.arrivals.get(self.next) {
            if at > self.clock {
                break;
            }
            let rank = (0..self.queues.len())
                .min_by_key(|&r| (self.outstanding[r], r))
                .expect("at least one rank");
            self.queues[rank].push_back(Pending {
                arrival: at,
                remaining: len,
                done: 0,
            });
            self.outstanding[rank] += len;
            self.next += 1;
        }
    }

    /// Runs one step (jumping to the next arrival when idle); marks the timeline done when every
    /// request has finished.
    fn advance(
        &mut self,
        loads: Option<&[LoadMatrix]>,
        chunk: u64,
        top_k: usize,
    ) -> Result<(), SimError> {
        self.admit();
        if self.queues.iter().all(VecDeque::is_empty) {
            match self.arrivals.get(self.next) {
                Some(&(at, _)) => {
                    self.clock = at;
                    self.admit();
                }
                None => {
                    self.done = true;
                    return Ok(());
                }
            }
        }
        let mut batch = Vec::with_capacity(self.queues.len());
        let mut finished = Vec::new();
        for (queue, outstanding) in self.queues.iter_mut().zip(&mut self.outstanding) {
            let mut budget = chunk;
            let mut segments = Vec::new();
            while budget > 0 {
                let Some(front) = queue.front_mut() else {
                    break;
                };
                let take = front.remaining.min(budget);
                segments.push(Segment {
                    tokens: take,
                    context: front.done,
                });
                front.done += take;
                front.remaining -= take;
                *outstanding -= take;
                budget -= take;
                if front.remaining == 0 {
                    finished.push(front.arrival);
                    queue.pop_front();
                }
            }
            batch.push(segments);
        }
        let step_ms = match (self.algo, loads) {
            (Some(_), Some(loads)) => {
                let tokens: Vec<u64> = batch
                    .iter()
                    .map(|s| s.iter().map(|x| x.tokens).sum())
                    .collect();
                let thinned: Vec<LoadMatrix> = loads
                    .iter()
                    .map(|l| thin_rows(l, chunk, &tokens, top_k, &mut self.rng))
                    .collect();
                self.coster.step(&batch, &thinned)?[0].schedules[self.schedule].step_ms
            }
            _ => self.coster.ideal(&batch).schedules[self.schedule].step_ms,
        };
        self.clock += step_ms / 1e3;
        self.busy_ms += step_ms;
        self.steps += 1;
        for arrival in finished {
            self.ttft.push(self.clock - arrival);
            self.last_finish = self.clock;
        }
        Ok(())
    }

    fn report(&self, input_tokens: u64) -> RateReport {
        let mut ttft_ms: Vec<f64> = self.ttft.iter().map(|t| t * 1e3).collect();
        ttft_ms.sort_by(f64::total_cmp);
        let first = self.arrivals.first().map_or(0.0, |a| a.0);
        let duration_s = (self.last_finish - first).max(f64::MIN_POSITIVE);
        let completed = ttft_ms.len();
        RateReport {
            balancer: self.algo.map_or("ideal", Algo::name).to_string(),
            request_rate: self.rate,
            completed,
            duration_s,
            request_throughput: completed as f64 / duration_s,
            input_throughput: input_tokens as f64 / duration_s,
            mean_ttft_ms: ttft_ms.iter().sum::<f64>() / completed.max(1) as f64,
            median_ttft_ms: percentile(&ttft_ms, 50.0),
            p99_ttft_ms: percentile(&ttft_ms, 99.0),
            steps: self.steps,
            mean_step_ms: self.busy_ms / self.steps.max(1) as f64,
        }
    }
}

/// Runs every (ideal and balancer) x rate timeline to completion; `progress(steps)` after every
/// lockstep step. Reports are ordered rate-major, ideal first, then the balancers in order.
pub fn run_requests(
    run: &RequestRun,
    mut progress: impl FnMut(usize),
) -> Result<Vec<RateReport>, SimError> {
    let spec = &run.spec;
    spec.validate()?;
    if run.requests.is_empty() {
        return Err(SimError::Input("the request trace has no requests".into()));
    }
    check_work(run)?;
    let schedules: Vec<(Option<f64>, Vec<f64>)> = if run.rates.is_empty() {
        vec![(None, arrival_times(Arrivals::Replay { speedup: 1.0 }, run)?)]
    } else {
        run.rates
            .iter()
            .map(|&rate| {
                if !(rate.is_finite() && rate > 0.0) {
                    return Err(SimError::Input(format!(
                        "--rates must be positive numbers of requests/s, got {rate}"
                    )));
                }
                let arrivals = Arrivals::Rate {
                    rate: RequestRate::PerSecond(rate),
                    burstiness: 1.0,
                };
                let times = arrival_times(arrivals, run)
                    .map_err(|e| SimError::Input(format!("--rates {rate:?}: {e}")))?;
                Ok((Some(rate), times))
            })
            .collect::<Result<_, _>>()?
    };
    let mut timelines = Vec::new();
    for (rate, times) in &schedules {
        let mut arrivals: Vec<(f64, u64)> = times
            .iter()
            .zip(&run.requests)
            .map(|(&t, r)| (t, r.input_len as u64))
            .collect();
        arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
        let algos = std::iter::once(None).chain(spec.algos.iter().copied().map(Some));
        for algo in algos {
            let index = timelines.len() as u64;
            timelines.push(Timeline {
                coster: StepCoster::chosen_schedule_only(spec, algo.as_slice())?,
                algo,
                rate: *rate,
                arrivals: arrivals.clone(),
                next: 0,
                queues: vec![VecDeque::new(); spec.ep],
                outstanding: vec![0; spec.ep],
                clock: 0.0,
                ttft: Vec::new(),
                last_finish: 0.0,
                steps: 0,
                busy_ms: 0.0,
                rng: StdRng::seed_from_u64(spec.seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                done: false,
                schedule: Schedule::ALL
                    .iter()
                    .position(|s| *s == spec.schedule)
                    .unwrap_or(Schedule::ALL.len() - 1),
            });
        }
    }
    let mut routing = LoadStream::synthetic(TracePattern::Mixed, spec, usize::MAX)?;
    let mut step = 0;
    while timelines.iter().any(|t| !t.done) {
        let loads = if timelines.iter().any(|t| !t.done && t.algo.is_some()) {
            Some(
                routing
                    .next_step()
                    .expect("the synthetic trace is unbounded")?,
            )
        } else {
            None
        };
        for timeline in timelines.iter_mut().filter(|t| !t.done) {
            timeline.advance(loads.as_deref(), spec.chunk_tokens, spec.shape.top_k)?;
        }
        step += 1;
        progress(step);
    }
    let input_tokens: u64 = run.requests.iter().map(|r| r.input_len as u64).sum();
    Ok(timelines.iter().map(|t| t.report(input_tokens)).collect())
}

/// Arrival times in seconds, all within [`MAX_ARRIVAL_S`].
fn arrival_times(arrivals: Arrivals, run: &RequestRun) -> Result<Vec<f64>, SimError> {
    let times: Vec<f64> = schedule(arrivals, &run.requests, run.spec.seed)
        .map_err(|e| SimError::Input(e.to_string()))?
        .iter()
        .map(|d| d.as_secs_f64())
        .collect();
    match times.iter().position(|&t| t > MAX_ARRIVAL_S) {
        Some(i) => Err(SimError::Input(format!(
            "request {i} would arrive {:e} s after the first, later than the {MAX_ARRIVAL_S:e} s a \
             simulation spans",
            times[i]
        ))),
        None => Ok(times),
    }
}

/// Refuses prompts over [`MAX_PROMPT_TOKENS`] and traces that need more than [`MAX_STEPS`] steps
/// whatever the arrivals: a request of `n` prompt tokens needs `n / chunk` steps, and all of them
/// `total / (chunk x ranks)` (an input length of 2^64-1 stepped for ever).
fn check_work(run: &RequestRun) -> Result<(), SimError> {
    let spec = &run.spec;
    let chunk = u128::from(spec.chunk_tokens);
    let lengths = run.requests.iter().map(|r| r.input_len as u128);
    let (longest, i) = lengths
        .clone()
        .zip(0..)
        .max()
        .expect("the trace has requests");
    let total: u128 = lengths.sum();
    if longest > u128::from(MAX_PROMPT_TOKENS) {
        return Err(SimError::Input(format!(
            "request {i} has {longest} prompt tokens, more than {MAX_PROMPT_TOKENS} (longer than \
             any model's context)"
        )));
    }
    let too_many = |steps: u128| steps > MAX_STEPS as u128;
    if too_many(longest.div_ceil(chunk)) {
        return Err(SimError::Input(format!(
            "request {i} has {longest} prompt tokens: at least {} steps of --chunk-tokens {chunk}, \
             more than the {MAX_STEPS} a simulation runs",
            longest.div_ceil(chunk)
        )));
    }
    let steps = total.div_ceil(chunk * spec.ep as u128);
    if too_many(steps) {
        return Err(SimError::Input(format!(
            "the request trace holds {total} prompt tokens: at least {steps} steps of \
             --chunk-tokens {chunk} on each of {} ranks, more than the {MAX_STEPS} a simulation \
             runs",
            spec.ep
        )));
    }
    Ok(())
}
