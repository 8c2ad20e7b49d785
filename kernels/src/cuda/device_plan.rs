//! A plan in the flat form the device reads ([`PlanArrays`]) and in device memory
//! ([`DevicePlan`]): what the quota solver writes and the relay planner and token permute read,
//! so the solver, the permute and the tile planner depend on this file and not on each other.

use super::{to_u32, CudaError, Gpu};
use cudarc::driver::{CudaSlice, CudaStream};
use rackfill_balancer::{Instance, Layout, LoadMatrix, Plan, PlanParts, PlanViolation};
use std::sync::Arc;

/// A plan in device memory, in the flat layout of [`PlanArrays`].
pub struct DevicePlan {
    ranks: usize,
    experts: usize,
    slots_per_rank: usize,
    pub(crate) slots: CudaSlice<i32>,
    pub(crate) inst_offsets: CudaSlice<u32>,
    pub(crate) inst_rank: CudaSlice<u32>,
    pub(crate) inst_quota: CudaSlice<u64>,
    pub(crate) split_offsets: CudaSlice<u32>,
    pub(crate) cumulative: CudaSlice<u64>,
}

impl DevicePlan {
    /// Buffers for any plan of `layout` whose split fits `cumulative_capacity` entries.
    pub(crate) fn alloc(
        gpu: &Gpu,
        layout: &Layout,
        cumulative_capacity: usize,
    ) -> Result<Self, CudaError> {
        let s = gpu.stream();
        let (r, e) = (layout.ranks(), layout.experts());
        let instances = e + r * layout.slots_per_rank();
        Ok(Self {
            ranks: r,
            experts: e,
            slots_per_rank: layout.slots_per_rank(),
            slots: s.alloc_zeros((r * layout.slots_per_rank()).max(1))?,
            inst_offsets: s.alloc_zeros(e + 1)?,
            inst_rank: s.alloc_zeros(instances.max(1))?,
            inst_quota: s.alloc_zeros(instances.max(1))?,
            split_offsets: s.alloc_zeros(e + 1)?,
            cumulative: s.alloc_zeros(cumulative_capacity.max(1))?,
        })
    }

    /// Uploads a host plan (from any balancer).
    pub fn upload(gpu: &Gpu, plan: &Plan) -> Result<Self, CudaError> {
        let a = PlanArrays::from_plan(plan)?;
        let s = gpu.stream();
        let nonempty = |v: &[u64]| if v.is_empty() { vec![0] } else { v.to_vec() };
        Ok(Self {
            ranks: plan.ranks(),
            experts: plan.experts(),
            slots_per_rank: plan.slots_per_rank(),
            slots: s.clone_htod(&if a.slots.is_empty() {
                vec![-1]
            } else {
                a.slots
            })?,
            inst_offsets: s.clone_htod(&a.inst_offsets)?,
            inst_rank: s.clone_htod(&a.inst_rank)?,
            inst_quota: s.clone_htod(&nonempty(&a.inst_quota))?,
            split_offsets: s.clone_htod(&a.split_offsets)?,
            cumulative: s.clone_htod(&nonempty(&a.cumulative))?,
        })
    }

    /// Downloads the arrays (sized by the plan's own offsets) on `s`.
    pub fn download(&self, s: &Arc<CudaStream>) -> Result<PlanArrays, CudaError> {
        let inst_offsets = s.clone_dtoh(&self.inst_offsets)?;
        let split_offsets = s.clone_dtoh(&self.split_offsets)?;
        let instances = inst_offsets[self.experts] as usize;
        let cells = split_offsets[self.experts] as usize;
        if instances > self.inst_rank.len() || cells > self.cumulative.len() {
            return Err(rackfill_balancer::PlanViolation::Shape.into());
        }
        let slots = s.clone_dtoh(&self.slots)?;
        Ok(PlanArrays {
            slots: slots[..self.ranks * self.slots_per_rank].to_vec(),
            inst_rank: s.clone_dtoh(&self.inst_rank.slice(..instances))?,
            inst_quota: s.clone_dtoh(&self.inst_quota.slice(..instances))?,
            cumulative: s.clone_dtoh(&self.cumulative.slice(..cells))?,
            inst_offsets,
            split_offsets,
        })
    }

    /// Number of ranks.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Number of logical experts.
    pub fn experts(&self) -> usize {
        self.experts
    }
}

/// [`PlanArrays::inst_offsets`] of `plan` alone: expert `e`'s instances are
/// `offsets[e]..offsets[e + 1]` (what grouping by instance needs, without the rest of the arrays).
pub fn instance_offsets(plan: &Plan) -> Result<Vec<u32>, CudaError> {
    let mut offsets = Vec::with_capacity(plan.experts() + 1);
    let mut total = 0usize;
    offsets.push(0);
    for e in 0..plan.experts() {
        total += plan.instances(e).len();
        offsets.push(to_u32(total, "instances")?);
    }
    Ok(offsets)
}

/// A plan in the flat form the device uses (the quota solver's outputs, the permute's inputs).
///
/// Instances of expert `e` are `inst_offsets[e]..inst_offsets[e + 1]` of `inst_rank` /
/// `inst_quota` (main first); a replicated expert's reroute split is an `R x |H(e)|` block of
/// cumulative ends at `split_offsets[e]` in `cumulative` (row = source rank); `slots` holds the
/// expert in each redundant slot or -1.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanArrays {
    pub slots: Vec<i32>,
    pub inst_offsets: Vec<u32>,
    pub inst_rank: Vec<u32>,
    pub inst_quota: Vec<u64>,
    pub split_offsets: Vec<u32>,
    pub cumulative: Vec<u64>,
}

impl PlanArrays {
    /// The arrays of a host plan (to upload a CPU plan for the GPU permute).
    pub fn from_plan(plan: &Plan) -> Result<Self, CudaError> {
        let mut a = Self {
            slots: plan
                .slots()
                .iter()
                .map(|s| s.map_or(Ok(-1), i32::try_from))
                .collect::<Result<_, _>>()
                .map_err(|_| crate::KernelError::Overflow { what: "expert id" })?,
            inst_offsets: instance_offsets(plan)?,
            ..Self::default()
        };
        for e in 0..plan.experts() {
            a.split_offsets.push(to_u32(a.cumulative.len(), "split")?);
            let inst = plan.instances(e);
            a.inst_rank.extend(inst.iter().map(|i| i.rank));
            a.inst_quota.extend(inst.iter().map(|i| i.quota));
            for r in 0..plan.ranks() {
                if let Some(row) = plan.split(r, e) {
                    let mut end = 0u64;
                    a.cumulative.extend(row.iter().map(|&q| {
                        end += q;
                        end
                    }));
                }
            }
        }
        a.split_offsets.push(to_u32(a.cumulative.len(), "split")?);
        Ok(a)
    }

    /// Rebuilds and validates the plan ([`Plan::from_parts`]); cumulative rows become the split.
    pub fn into_plan(
        self,
        layout: &Layout,
        load: &LoadMatrix,
        u_min: u64,
    ) -> Result<Plan, PlanViolation> {
        let experts = layout.experts();
        if self.inst_offsets.len() != experts + 1
            || self.split_offsets.len() != experts + 1
            || self.inst_rank.len() != self.inst_quota.len()
        {
            return Err(PlanViolation::Shape);
        }
        let mut split = self.cumulative;
        for e in 0..experts {
            let n = (self.inst_offsets[e + 1].saturating_sub(self.inst_offsets[e])) as usize;
            let block = self.split_offsets[e] as usize..self.split_offsets[e + 1] as usize;
            let Some(cells) = split.get_mut(block) else {
                return Err(PlanViolation::Shape);
            };
            if n == 0 {
                continue;
            }
            for row in cells.chunks_mut(n) {
                for i in (1..row.len()).rev() {
                    row[i] = row[i].checked_sub(row[i - 1]).ok_or(PlanViolation::Shape)?;
                }
            }
        }
        let parts = PlanParts {
            slots: self.slots.iter().map(|&s| u32::try_from(s).ok()).collect(),
            instance_offsets: self.inst_offsets,
            instances: self
                .inst_rank
                .iter()
                .zip(&self.inst_quota)
                .map(|(&rank, &quota)| Instance { rank, quota })
                .collect(),
            split_offsets: self.split_offsets,
            split,
        };
        Plan::from_parts(layout, load, u_min, parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfill_balancer::quota::QuotaPlanner;
    use rackfill_balancer::Balancer;

    fn skewed(ranks: usize, experts: usize, seed: u64) -> LoadMatrix {
        let mut x = seed;
        let mut next = || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            x >> 33
        };
        let hot = (next() as usize) % experts;
        let rows: Vec<Vec<u64>> = (0..ranks)
            .map(|_| {
                (0..experts)
                    .map(|e| {
                        if e == hot {
                            500 + next() % 300
                        } else {
                            next() % 40
                        }
                    })
                    .collect()
            })
            .collect();
        LoadMatrix::from_rows(&rows).unwrap()
    }

    #[test]
    fn plan_arrays_round_trip_a_quota_plan() {
        for seed in 0..8 {
            let layout = Layout::contiguous(8, 24, 2).unwrap();
            let load = skewed(8, 24, seed);
            let plan = QuotaPlanner::new(1).plan(&layout, &load).unwrap();
            assert!(plan.replicas() > 0);
            let arrays = PlanArrays::from_plan(&plan).unwrap();
            assert_eq!(arrays.into_plan(&layout, &load, 1).unwrap(), plan);
        }
    }

    #[test]
    fn corrupted_arrays_are_rejected_not_trusted() {
        let layout = Layout::contiguous(8, 24, 2).unwrap();
        let load = skewed(8, 24, 3);
        let plan = QuotaPlanner::new(1).plan(&layout, &load).unwrap();
        let good = PlanArrays::from_plan(&plan).unwrap();
        let mut moved = good.clone();
        let replicated = (0..24).find(|&e| plan.instances(e).len() > 1).unwrap();
        let at = good.inst_offsets[replicated] as usize + 1;
        moved.inst_quota[at] += 1;
        assert!(moved.into_plan(&layout, &load, 1).is_err());
        let mut shrunk = good.clone();
        shrunk.cumulative.pop();
        assert_eq!(
            shrunk.into_plan(&layout, &load, 1),
            Err(PlanViolation::Shape)
        );
        let mut decreasing = good.clone();
        let row = good.split_offsets[replicated] as usize;
        decreasing.cumulative[row] = u64::MAX;
        assert!(decreasing.into_plan(&layout, &load, 1).is_err());
        let mut stray = good;
        let free = stray.slots.iter().position(|&s| s < 0).unwrap();
        stray.slots[free] = 0;
        assert!(stray.into_plan(&layout, &load, 1).is_err());
    }
}
