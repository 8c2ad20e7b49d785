//! The schedule of a prefill step's phases, and its makespan: one description shared by the cost
//! model of `rackfill simulate` and (as the order the EP runtime is to follow) the engine.
//!
//! A step runs the model's layers in order for each of its micro-batches. Per layer and
//! micro-batch the phases, the resource each occupies and what each waits for:
//!
//! | phase            | resource | waits for                                                   |
//! |------------------|----------|-------------------------------------------------------------|
//! | `attention`      | compute  | the micro-batch's previous layer (its combine and FFN)       |
//! | `dense_ffn`      | compute  | `attention` (shared experts on MoE layers, the MLP on dense) |
//! | `solve`          | solver   | `attention` (the router's counts)                            |
//! | `replicate`      | link     | `solve`                                                      |
//! | `dispatch`       | link     | `solve`; and `replicate` unless the experts are pipelined     |
//! | `expert_main`    | compute  | `dispatch` (and `replicate` unless pipelined)                |
//! | `expert_replica` | compute  | `dispatch`, `replicate` and `expert_main`                    |
//! | `combine`        | link     | both expert phases                                           |
//!
//! Each resource runs one phase at a time: `compute` the GPU's SMs, `link` the rank's scale-up
//! links (replica weights and tokens share them), `solver` the planner (UltraEP's one-block GPU
//! solver, beside the rest). Phases are list-scheduled: whenever a resource is free, the ready
//! phase that can start earliest runs, ties going to the earlier layer, then the earlier
//! micro-batch, then the phase order above (with pipelined experts, `dispatch` before
//! `replicate`, so main experts start while replicas stream).
//!
//! UltraEP's schedule ([`Schedule::ULTRAEP`], its §4.2 Eq. 1) is one micro-batch with nothing
//! pipelined: `solve + replicate + dispatch + expert + combine` on the critical path of every MoE
//! layer. Two micro-batches ([`Schedule::OVERLAPPED`], the two-batch overlap DeepSeek's inference
//! system and SGLang run in prefill) let one micro-batch's solve, replica streaming and token
//! exchange run under the other's attention and expert GEMMs.

use serde::Serialize;

/// How a step's phases are scheduled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Schedule {
    /// Micro-batches a step's tokens are split into (1 or 2): each has its own load, plan and
    /// replicas (slots doubled with 2, so both micro-batches' replicas are resident together).
    pub micro_batches: usize,
    /// Dispatch and main-expert GEMMs start without waiting for the replicas; a replica's GEMM
    /// waits only for its own slot.
    pub pipelined_experts: bool,
}

impl Schedule {
    /// UltraEP's: one micro-batch, solve and replication on the critical path.
    pub const ULTRAEP: Self = Self {
        micro_batches: 1,
        pipelined_experts: false,
    };
    /// One micro-batch whose main experts compute while its replicas stream.
    pub const PIPELINED: Self = Self {
        micro_batches: 1,
        pipelined_experts: true,
    };
    /// Two micro-batches overlapping each other, experts not pipelined.
    pub const TWO_BATCH: Self = Self {
        micro_batches: 2,
        pipelined_experts: false,
    };
    /// Two micro-batches and pipelined experts: rackfill's default.
    pub const OVERLAPPED: Self = Self {
        micro_batches: 2,
        pipelined_experts: true,
    };
    /// Every named schedule: UltraEP's, each overlap alone, both (what `rackfill simulate`'s
    /// ablation costs).
    pub const ALL: [Self; 4] = [
        Self::ULTRAEP,
        Self::PIPELINED,
        Self::TWO_BATCH,
        Self::OVERLAPPED,
    ];

    /// A short name for reports and flags: `ultraep`, `pipelined`, `two-batch`, `overlapped`,
    /// or the fields.
    pub fn name(&self) -> String {
        match *self {
            Self::ULTRAEP => "ultraep".into(),
            Self::PIPELINED => "pipelined".into(),
            Self::TWO_BATCH => "two-batch".into(),
            Self::OVERLAPPED => "overlapped".into(),
            Self {
                micro_batches,
                pipelined_experts,
            } => format!(
                "{micro_batches}-batch{}",
                if pipelined_experts { "-pipelined" } else { "" }
            ),
        }
    }

    /// Checks the micro-batch count (1 or 2).
    pub fn check(&self) -> Result<(), String> {
        if !(1..=2).contains(&self.micro_batches) {
            return Err(format!(
                "a schedule runs 1 or 2 micro-batches, not {}",
                self.micro_batches
            ));
        }
        Ok(())
    }
}

impl Default for Schedule {
    fn default() -> Self {
        Self::OVERLAPPED
    }
}

impl std::str::FromStr for Schedule {
    type Err = String;

    /// `ultraep`, `pipelined`, `two-batch` or `overlapped`.
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|schedule| schedule.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown schedule '{s}' (expected ultraep, pipelined, two-batch or overlapped)"
                )
            })
    }
}

/// Where replicas live between steps (`--slot-memory`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SlotMemory {
    /// One set of redundant slots shared by every MoE layer (UltraEP §4.1): every layer's
    /// replicas are streamed afresh every step.
    #[default]
    Shared,
    /// Each MoE layer keeps its own slots: a replica still resident from the layer's previous
    /// plan is reused, only new ones are streamed. Costs `moe_layers` times the slot memory.
    PerLayer,
}

impl SlotMemory {
    pub fn name(self) -> &'static str {
        match self {
            Self::Shared => "shared",
            Self::PerLayer => "per-layer",
        }
    }
}

impl std::str::FromStr for SlotMemory {
    type Err = String;

    /// `shared` or `per-layer`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "shared" => Ok(Self::Shared),
            "per-layer" => Ok(Self::PerLayer),
            other => Err(format!(
                "unknown slot memory '{other}' (expected shared or per-layer)"
            )),
        }
    }
}

/// Time of each phase of one layer for one micro-batch, milliseconds (0 for a phase the layer
/// does not have: a dense layer has only `attention` and `dense_ffn`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LayerPhases {
    pub attention: f64,
    pub dense_ffn: f64,
    pub solve: f64,
    pub replicate: f64,
    pub dispatch: f64,
    /// Expert GEMMs of the main instances.
    pub expert_main: f64,
    /// Expert GEMMs of the replica instances (after the main ones on the same SMs).
    pub expert_replica: f64,
    pub combine: f64,
}

/// The resources phases occupy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resource {
    Compute,
    Link,
    Solver,
}

/// Phases of one (layer, micro-batch), in tie-break order; indices into [`Phase::ALL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Attention,
    DenseFfn,
    Solve,
    Dispatch,
    Replicate,
    ExpertMain,
    ExpertReplica,
    Combine,
}

impl Phase {
    const ALL: [Phase; 8] = [
        Phase::Attention,
        Phase::DenseFfn,
        Phase::Solve,
        Phase::Dispatch,
        Phase::Replicate,
        Phase::ExpertMain,
        Phase::ExpertReplica,
        Phase::Combine,
    ];

    fn resource(self) -> Resource {
        match self {
            Phase::Attention | Phase::DenseFfn | Phase::ExpertMain | Phase::ExpertReplica => {
                Resource::Compute
            }
            Phase::Solve => Resource::Solver,
            Phase::Dispatch | Phase::Replicate | Phase::Combine => Resource::Link,
        }
    }

    fn duration(self, p: &LayerPhases) -> f64 {
        match self {
            Phase::Attention => p.attention,
            Phase::DenseFfn => p.dense_ffn,
            Phase::Solve => p.solve,
            Phase::Dispatch => p.dispatch,
            Phase::Replicate => p.replicate,
            Phase::ExpertMain => p.expert_main,
            Phase::ExpertReplica => p.expert_replica,
            Phase::Combine => p.combine,
        }
    }

    /// The phases of the same (layer, micro-batch) this one waits for.
    fn waits_for(self, pipelined: bool) -> &'static [Phase] {
        match (self, pipelined) {
            (Phase::Attention, _) => &[],
            (Phase::DenseFfn | Phase::Solve, _) => &[Phase::Attention],
            (Phase::Replicate, _) | (Phase::Dispatch, true) => &[Phase::Solve],
            (Phase::Dispatch, false) => &[Phase::Solve, Phase::Replicate],
            (Phase::ExpertMain, true) => &[Phase::Dispatch],
            (Phase::ExpertMain, false) => &[Phase::Dispatch, Phase::Replicate],
            (Phase::ExpertReplica, _) => &[Phase::Dispatch, Phase::Replicate, Phase::ExpertMain],
            (Phase::Combine, _) => &[Phase::ExpertMain, Phase::ExpertReplica],
        }
    }

    /// Without pipelining, replicas stream before the dispatch (the UltraEP order).
    fn rank(self, pipelined: bool) -> usize {
        match (self, pipelined) {
            (Phase::Replicate, false) => Phase::Dispatch as usize,
            (Phase::Dispatch, false) => Phase::Replicate as usize,
            (phase, _) => phase as usize,
        }
    }
}

/// The step's makespan under `schedule`, milliseconds: `layers[l][m]` is layer `l`'s phases for
/// micro-batch `m` (`schedule.micro_batches` of them per layer). A micro-batch's layer starts
/// once its previous layer has finished (combine and FFN); everything else as the module says.
pub fn makespan(schedule: &Schedule, layers: &[Vec<LayerPhases>]) -> f64 {
    let phases = Phase::ALL.len();
    let micro = schedule.micro_batches.max(1);
    let pipelined = schedule.pipelined_experts;
    // finish[(l * micro + m) * phases + p], NaN until scheduled.
    let mut finish = vec![f64::NAN; layers.len() * micro * phases];
    let mut free = [0.0f64; 3];
    let resource_index = |r: Resource| r as usize;
    // Per micro-batch: the layer it is in and the phases of it not yet run.
    let mut next_layer = vec![0usize; micro];
    let mut done_in_layer = vec![[false; 8]; micro];
    let mut remaining: usize = layers.len() * micro * phases;
    let mut makespan = 0.0f64;
    while remaining > 0 {
        // The ready phase that can start earliest (ties: layer, micro-batch, phase rank).
        let mut best: Option<(f64, usize, usize, Phase)> = None;
        for m in 0..micro {
            let l = next_layer[m];
            if l >= layers.len() {
                continue;
            }
            let at = |p: Phase| finish[(l * micro + m) * phases + p as usize];
            let layer_start = if l == 0 {
                0.0
            } else {
                let base = ((l - 1) * micro + m) * phases;
                finish[base + Phase::Combine as usize].max(finish[base + Phase::DenseFfn as usize])
            };
            for phase in Phase::ALL {
                if done_in_layer[m][phase as usize] {
                    continue;
                }
                let deps = phase.waits_for(pipelined);
                if deps.iter().any(|&d| !done_in_layer[m][d as usize]) {
                    continue;
                }
                let ready = deps.iter().map(|&d| at(d)).fold(layer_start, f64::max);
                let start = ready.max(free[resource_index(phase.resource())]);
                let key = (start, l, m, phase.rank(pipelined));
                let better = match best {
                    None => true,
                    Some((s, bl, bm, bp)) => {
                        (key.0, key.1, key.2, key.3) < (s, bl, bm, bp.rank(pipelined))
                    }
                };
                if better {
                    best = Some((start, l, m, phase));
                }
            }
        }
        let (start, l, m, phase) = best.expect("a ready phase while phases remain");
        let duration = phase.duration(&layers[l][m]).max(0.0);
        let end = start + duration;
        // A zero-length phase occupies nothing.
        if duration > 0.0 {
            free[resource_index(phase.resource())] = end;
        }
        finish[(l * micro + m) * phases + phase as usize] = end;
        makespan = makespan.max(end);
        done_in_layer[m][phase as usize] = true;
        remaining -= 1;
        if done_in_layer[m].iter().all(|&d| d) {
            done_in_layer[m] = [false; 8];
            next_layer[m] += 1;
        }
    }
    makespan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(attention: f64, solve: f64, replicate: f64, exchange: f64, expert: f64) -> LayerPhases {
        LayerPhases {
            attention,
            solve,
            replicate,
            dispatch: exchange,
            expert_main: expert,
            combine: exchange,
            ..LayerPhases::default()
        }
    }

    #[test]
    fn ultraep_runs_every_phase_one_after_another() {
        let layer = moe(1.0, 0.5, 0.25, 0.5, 2.0);
        let step = vec![vec![layer]; 3];
        // 1 + 0.5 + 0.25 + 0.5 + 2 + 0.5 = 4.75 per layer.
        assert!((makespan(&Schedule::ULTRAEP, &step) - 3.0 * 4.75).abs() < 1e-12);
    }

    #[test]
    fn two_micro_batches_hide_communication_under_the_other_half_s_compute() {
        // Half the tokens each: compute 1.5 per micro-batch and layer, communication 0.625.
        let half = moe(0.5, 0.0, 0.125, 0.25, 1.0);
        let layers = 20;
        let overlapped = makespan(&Schedule::TWO_BATCH, &vec![vec![half; 2]; layers]);
        let serial = makespan(
            &Schedule::ULTRAEP,
            &vec![vec![moe(1.0, 0.0, 0.25, 0.5, 2.0)]; layers],
        );
        // Compute alone takes 3 per layer: the overlapped step approaches it, the serial one
        // pays all 4.25.
        assert!(overlapped < serial, "{overlapped} vs {serial}");
        assert!(overlapped >= 3.0 * layers as f64 - 1e-9);
        assert!(overlapped <= 3.0 * layers as f64 + 2.0, "{overlapped}");
    }

    #[test]
    fn pipelined_experts_start_the_mains_before_the_replicas_land() {
        let layer = LayerPhases {
            attention: 1.0,
            replicate: 2.0,
            dispatch: 0.5,
            expert_main: 2.0,
            expert_replica: 0.5,
            combine: 0.5,
            ..LayerPhases::default()
        };
        let waits = Schedule {
            micro_batches: 1,
            pipelined_experts: false,
        };
        let pipelined = Schedule {
            micro_batches: 1,
            pipelined_experts: true,
        };
        // Waiting: 1 + 2 + 0.5 + 2 + 0.5 + 0.5 = 6.5. Pipelined: dispatch at 1-1.5, mains
        // 1.5-3.5, replicas stream 1.5-3.5, replica GEMMs 3.5-4, combine 4-4.5.
        assert!((makespan(&waits, &[vec![layer]]) - 6.5).abs() < 1e-12);
        assert!((makespan(&pipelined, &[vec![layer]]) - 4.5).abs() < 1e-12);
    }

    #[test]
    fn a_dense_layer_is_attention_then_its_mlp() {
        let dense = LayerPhases {
            attention: 1.0,
            dense_ffn: 2.0,
            ..LayerPhases::default()
        };
        assert!((makespan(&Schedule::ULTRAEP, &[vec![dense]]) - 3.0).abs() < 1e-12);
        assert!(makespan(&Schedule::OVERLAPPED, &[]) == 0.0);
    }

    #[test]
    fn schedules_parse_by_name() {
        for s in Schedule::ALL {
            assert_eq!(s.name().parse::<Schedule>(), Ok(s));
        }
        assert!("three-batch".parse::<Schedule>().is_err());
        assert!(Schedule {
            micro_batches: 3,
            pipelined_experts: false
        }
        .check()
        .is_err());
    }
}
