//! The one plan type every balancer produces: slot assignment `X`, per-instance quotas `U` and the
//! reroute split `Q` (UltraEP Table 1), plus [`Plan::validate`], which checks every invariant the
//! engine relies on before it moves a single byte.

use crate::instance::Instance;
use crate::reroute::{split_evenly, split_locality_first, SplitScratch};
use crate::{Layout, LoadMatrix};

/// A replica a planner decided to create: expert, host rank, and (for quota-driven planners) its quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Replica {
    pub expert: u32,
    pub rank: u32,
    pub quota: u64,
}

/// How a plan turns quotas into the per-source split `Q`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SplitPolicy {
    /// Quotas are given; tokens on a host rank consume its quota first, the rest is split
    /// proportionally to the remaining quotas (UltraEP §5.2).
    LocalityFirst,
    /// Quotas follow from splitting every source's tokens evenly (round-robin) among the instances,
    /// as EPLB deployments do.
    Even,
}

/// A replication plan for one layer.
///
/// Instances of expert `e` are `instances(e)`: the main instance first (always on `home(e)`), then
/// the replicas in ascending rank. For experts with replicas the split `Q` is stored densely as an
/// `R x |H(e)|` block; experts without replicas send every token to their main instance, so they
/// cost nothing to plan.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Plan {
    ranks: usize,
    slots_per_rank: usize,
    slots: Vec<Option<u32>>,
    instance_offsets: Vec<u32>,
    instances: Vec<Instance>,
    split_offsets: Vec<u32>,
    split: Vec<u64>,
}

impl Plan {
    /// The plan without balancing: every expert on its main instance only.
    pub fn main_only(layout: &Layout, expert_totals: &[u64]) -> Self {
        let mut replicas = Vec::new();
        Self::assemble(
            layout,
            None,
            expert_totals,
            &mut replicas,
            SplitPolicy::LocalityFirst,
        )
    }

    /// Builds a plan from main quotas and replicas. `load` is needed whenever an expert has
    /// replicas (to split its sources); `main_quota[e]` is ignored under [`SplitPolicy::Even`].
    pub(crate) fn assemble(
        layout: &Layout,
        load: Option<&LoadMatrix>,
        main_quota: &[u64],
        replicas: &mut [Replica],
        policy: SplitPolicy,
    ) -> Self {
        let ranks = layout.ranks();
        let experts = layout.experts();
        let n_slot = layout.slots_per_rank();
        replicas.sort_unstable_by_key(|r| (r.expert, r.rank));

        let mut instance_offsets = Vec::with_capacity(experts + 1);
        let mut instances = Vec::with_capacity(experts + replicas.len());
        let mut split_offsets = Vec::with_capacity(experts + 1);
        let mut split = Vec::new();
        let mut split_scratch = SplitScratch::default();
        let mut next = 0;
        for (e, &main_quota) in main_quota[..experts].iter().enumerate() {
            instance_offsets.push(instances.len() as u32);
            split_offsets.push(split.len() as u32);
            let first = instances.len();
            instances.push(Instance {
                rank: layout.home(e) as u32,
                quota: main_quota,
            });
            while next < replicas.len() && replicas[next].expert as usize == e {
                instances.push(Instance {
                    rank: replicas[next].rank,
                    quota: replicas[next].quota,
                });
                next += 1;
            }
            if instances.len() - first > 1 {
                let load = load.expect("a plan with replicas needs the load matrix");
                let block = split.len();
                split.resize(block + ranks * (instances.len() - first), 0);
                let group = &mut instances[first..];
                let block = &mut split[block..];
                match policy {
                    SplitPolicy::LocalityFirst => {
                        split_locality_first(load, e, group, block, &mut split_scratch)
                    }
                    SplitPolicy::Even => split_evenly(load, e, group, block),
                }
            }
        }
        instance_offsets.push(instances.len() as u32);
        split_offsets.push(split.len() as u32);

        let mut slots = vec![None; ranks * n_slot];
        let mut used = vec![0usize; ranks];
        for replica in replicas.iter() {
            let r = replica.rank as usize;
            debug_assert!(used[r] < n_slot, "planner overfilled rank {r}");
            if used[r] < n_slot {
                slots[r * n_slot + used[r]] = Some(replica.expert);
            }
            used[r] += 1;
        }
        Self {
            ranks,
            slots_per_rank: n_slot,
            slots,
            instance_offsets,
            instances,
            split_offsets,
            split,
        }
    }

    /// Rebuilds a plan from its raw arrays, the form a device-side solver emits (the GPU quota
    /// solver in rackfill-kernels), and checks every invariant against the layout and load
    /// ([`Plan::validate`] with `u_min`): a corrupted or wrong device result is an error, never a
    /// plan the engine would act on.
    pub fn from_parts(
        layout: &Layout,
        load: &LoadMatrix,
        u_min: u64,
        parts: PlanParts,
    ) -> Result<Self, PlanViolation> {
        let experts = layout.experts();
        let offsets_ok = |offsets: &[u32], len: usize| {
            offsets.len() == experts + 1
                && offsets[0] == 0
                && offsets.windows(2).all(|w| w[0] <= w[1])
                && offsets[experts] as usize == len
        };
        let n_slot = layout.slots_per_rank();
        if !offsets_ok(&parts.instance_offsets, parts.instances.len())
            || !offsets_ok(&parts.split_offsets, parts.split.len())
            || parts.slots.len() != layout.ranks() * n_slot
        {
            return Err(PlanViolation::Shape);
        }
        let plan = Self {
            ranks: layout.ranks(),
            slots_per_rank: n_slot,
            slots: parts.slots,
            instance_offsets: parts.instance_offsets,
            instances: parts.instances,
            split_offsets: parts.split_offsets,
            split: parts.split,
        };
        plan.validate(layout, load, u_min)?;
        Ok(plan)
    }

    /// The plan with the slots `filled(rank, expert)` says are filled already left empty: what a
    /// replica stream must still fill (its instances, quotas and split unchanged). Not a plan to
    /// dispatch with: [`Plan::validate`] refuses its instances without slots.
    pub(crate) fn without_filled_slots(&self, filled: impl Fn(usize, u32) -> bool) -> Plan {
        let n_slot = self.slots_per_rank;
        let mut stream = self.clone();
        for (i, slot) in stream.slots.iter_mut().enumerate() {
            if slot.is_some_and(|expert| filled(i / n_slot.max(1), expert)) {
                *slot = None;
            }
        }
        stream
    }

    /// Number of ranks the plan was made for.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Number of logical experts.
    pub fn experts(&self) -> usize {
        self.instance_offsets.len() - 1
    }

    /// Redundant slots per rank.
    pub fn slots_per_rank(&self) -> usize {
        self.slots_per_rank
    }

    /// Slot assignment `X`: `slots()[r * n_slot + s]` is the expert replicated in slot `s` of rank `r`.
    pub fn slots(&self) -> &[Option<u32>] {
        &self.slots
    }

    /// The redundant slots of rank `r`.
    pub fn rank_slots(&self, rank: usize) -> &[Option<u32>] {
        &self.slots[rank * self.slots_per_rank..(rank + 1) * self.slots_per_rank]
    }

    /// Physical instances `H(e)` with their quotas: main first, then replicas by ascending rank.
    pub fn instances(&self, expert: usize) -> &[Instance] {
        &self.instances
            [self.instance_offsets[expert] as usize..self.instance_offsets[expert + 1] as usize]
    }

    /// Reroute split of source rank `r` for expert `e`: `q[r][e][t]` for every instance of `e`, in
    /// the order of [`Self::instances`]. `None` means the expert has no replica and all of the
    /// source's tokens go to the main instance.
    pub fn split(&self, rank: usize, expert: usize) -> Option<&[u64]> {
        let start = self.split_offsets[expert] as usize;
        let end = self.split_offsets[expert + 1] as usize;
        if start == end {
            return None;
        }
        let n = self.instances(expert).len();
        Some(&self.split[start + rank * n..start + (rank + 1) * n])
    }

    /// Post-reroute rank loads `L[t] = sum_e quota[e][t]`.
    pub fn rank_loads(&self) -> Vec<u64> {
        let mut loads = vec![0u64; self.ranks];
        for inst in &self.instances {
            loads[inst.rank as usize] += inst.quota;
        }
        loads
    }

    /// Replicas created, `sum_e (|H(e)| - 1)`.
    pub fn replicas(&self) -> usize {
        self.instances.len() - self.experts()
    }

    /// Largest fan-out `max_e (|H(e)| - 1)`: the most copies one main expert must send.
    pub fn max_fanout(&self) -> usize {
        (0..self.experts())
            .map(|e| self.instances(e).len() - 1)
            .max()
            .unwrap_or(0)
    }

    /// Checks every invariant of a plan against its layout and load. `u_min` is the smallest quota
    /// a replica may carry (pass 0 for planners that do not honour a floor).
    pub fn validate(
        &self,
        layout: &Layout,
        load: &LoadMatrix,
        u_min: u64,
    ) -> Result<(), PlanViolation> {
        use PlanViolation as V;
        let experts = layout.experts();
        if self.ranks != layout.ranks()
            || self.experts() != experts
            || self.slots_per_rank != layout.slots_per_rank()
            || load.ranks() != layout.ranks()
            || load.experts() != experts
            || self.slots.len() != self.ranks * self.slots_per_rank
            || self.split_offsets.len() != experts + 1
        {
            return Err(V::Shape);
        }
        let totals = load.expert_totals();
        let mut replica_slots_seen = 0usize;
        for (e, &total) in totals.iter().enumerate() {
            let inst = self.instances(e);
            let Some(main) = inst.first() else {
                return Err(V::NoMainInstance { expert: e });
            };
            if main.rank as usize != layout.home(e) {
                return Err(V::MainMoved {
                    expert: e,
                    rank: main.rank as usize,
                    home: layout.home(e),
                });
            }
            for pair in inst[1..].windows(2) {
                if pair[0].rank >= pair[1].rank {
                    return Err(V::Duplicate {
                        expert: e,
                        rank: pair[1].rank as usize,
                    });
                }
            }
            for replica in &inst[1..] {
                let rank = replica.rank as usize;
                if rank >= self.ranks {
                    return Err(V::Shape);
                }
                if rank == main.rank as usize {
                    return Err(V::Duplicate { expert: e, rank });
                }
                let hosted = self
                    .rank_slots(rank)
                    .iter()
                    .filter(|s| **s == Some(e as u32))
                    .count();
                if hosted != 1 {
                    return Err(V::SlotMismatch { expert: e, rank });
                }
                replica_slots_seen += 1;
                if replica.quota < u_min {
                    return Err(V::BelowFloor {
                        expert: e,
                        rank,
                        quota: replica.quota,
                        u_min,
                    });
                }
            }
            let quota_sum: u64 = inst.iter().map(|i| i.quota).sum();
            if quota_sum != total {
                return Err(V::QuotaSum {
                    expert: e,
                    quotas: quota_sum,
                    load: total,
                });
            }
            self.validate_split(load, e)?;
        }
        let occupied = self.slots.iter().filter(|s| s.is_some()).count();
        if occupied != replica_slots_seen {
            return Err(V::StraySlot);
        }
        Ok(())
    }

    fn validate_split(&self, load: &LoadMatrix, e: usize) -> Result<(), PlanViolation> {
        let inst = self.instances(e);
        let block = (self.split_offsets[e + 1] - self.split_offsets[e]) as usize;
        if inst.len() == 1 {
            return if block == 0 {
                Ok(())
            } else {
                Err(PlanViolation::Shape)
            };
        }
        if block != self.ranks * inst.len() {
            return Err(PlanViolation::Shape);
        }
        let mut column = vec![0u64; inst.len()];
        let start = self.split_offsets[e] as usize;
        let rows = self.split[start..start + block].chunks_exact(inst.len());
        for (r, row) in rows.enumerate() {
            let sent: u64 = row.iter().sum();
            if sent != load.get(r, e) {
                return Err(PlanViolation::SourceSplit {
                    expert: e,
                    rank: r,
                    split: sent,
                    load: load.get(r, e),
                });
            }
            for (c, &q) in column.iter_mut().zip(row) {
                *c += q;
            }
        }
        for (i, (c, instance)) in column.iter().zip(inst).enumerate() {
            if *c != instance.quota {
                return Err(PlanViolation::InstanceSplit {
                    expert: e,
                    instance: i,
                    split: *c,
                    quota: instance.quota,
                });
            }
        }
        Ok(())
    }
}

/// The raw arrays of a [`Plan`], laid out as the plan stores them, for [`Plan::from_parts`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanParts {
    /// Slot assignment `X`, `R x n_slot` row-major (see [`Plan::slots`]).
    pub slots: Vec<Option<u32>>,
    /// `E + 1` offsets into `instances`: expert `e` owns `instance_offsets[e]..[e + 1]`.
    pub instance_offsets: Vec<u32>,
    /// Every expert's instances, main first, then replicas by ascending rank.
    pub instances: Vec<Instance>,
    /// `E + 1` offsets into `split`: a replicated expert owns an `R x |H(e)|` block, any other
    /// expert an empty one.
    pub split_offsets: Vec<u32>,
    /// Reroute split `Q`, one block per replicated expert (see [`Plan::split`]).
    pub split: Vec<u64>,
}

/// A broken plan invariant, named precisely enough to debug the planner that produced it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanViolation {
    #[error("plan dimensions do not match the layout and load")]
    Shape,
    #[error("expert {expert} has no main instance")]
    NoMainInstance { expert: usize },
    #[error("expert {expert}: main instance on rank {rank}, home is {home}")]
    MainMoved {
        expert: usize,
        rank: usize,
        home: usize,
    },
    #[error("expert {expert} appears more than once on rank {rank}")]
    Duplicate { expert: usize, rank: usize },
    #[error("expert {expert}: replica on rank {rank} does not match exactly one slot")]
    SlotMismatch { expert: usize, rank: usize },
    #[error("a slot names a replica that is not an instance")]
    StraySlot,
    #[error("expert {expert}: replica on rank {rank} has quota {quota} < u_min {u_min}")]
    BelowFloor {
        expert: usize,
        rank: usize,
        quota: u64,
        u_min: u64,
    },
    #[error("expert {expert}: quotas sum to {quotas}, load is {load}")]
    QuotaSum {
        expert: usize,
        quotas: u64,
        load: u64,
    },
    #[error("expert {expert}: source rank {rank} splits {split} tokens, its load is {load}")]
    SourceSplit {
        expert: usize,
        rank: usize,
        split: u64,
        load: u64,
    },
    #[error("expert {expert}: instance {instance} receives {split} tokens, its quota is {quota}")]
    InstanceSplit {
        expert: usize,
        instance: usize,
        split: u64,
        quota: u64,
    },
}
