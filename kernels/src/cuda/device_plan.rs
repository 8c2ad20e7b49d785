//! A plan in the flat form the device reads ([`PlanArrays`]) and in device memory
//! ([`DevicePlan`]): what the quota solver writes and the relay planner and token permute read,
//! so the solver, the permute and the tile planner depend on this file and not on each other.

use super::exec::{DeviceBuffer, Executor, ExecutorExt, Stream};
use super::{to_u32, CudaError};
use rackfill_balancer::{Instance, Layout, LoadMatrix, Plan, PlanParts, PlanViolation};

/// A plan in device memory, in the flat layout of [`PlanArrays`].
pub struct DevicePlan {
    ranks: usize,
    experts: usize,
    slots_per_rank: usize,
    /// i32 `[R * n_slot]`.
    pub(crate) slots: DeviceBuffer,
    /// u32 `[E + 1]`.
    pub(crate) inst_offsets: DeviceBuffer,
    /// u32 `[instances]`.
    pub(crate) inst_rank: DeviceBuffer,
    /// u64 `[instances]`.
    pub(crate) inst_quota: DeviceBuffer,
    /// u32 `[E + 1]`.
    pub(crate) split_offsets: DeviceBuffer,
    /// u64 `[cells]`.
    pub(crate) cumulative: DeviceBuffer,
}

impl DevicePlan {
    /// Buffers for any plan of `layout` whose split fits `cumulative_capacity` entries,
    /// allocated in `stream`'s order.
    pub(crate) fn alloc(
        exec: &dyn Executor,
        stream: Stream,
        layout: &Layout,
        cumulative_capacity: usize,
    ) -> Result<Self, CudaError> {
        let (r, e) = (layout.ranks(), layout.experts());
        let instances = e + r * layout.slots_per_rank();
        let alloc = |bytes: usize| exec.alloc_zeroed_on(stream, bytes);
        Ok(Self {
            ranks: r,
            experts: e,
            slots_per_rank: layout.slots_per_rank(),
            slots: alloc(4 * r * layout.slots_per_rank())?,
            inst_offsets: alloc(4 * (e + 1))?,
            inst_rank: alloc(4 * instances)?,
            inst_quota: alloc(8 * instances)?,
            split_offsets: alloc(4 * (e + 1))?,
            cumulative: alloc(8 * cumulative_capacity)?,
        })
    }

    /// Uploads a host plan (from any balancer) in `stream`'s order.
    pub fn upload(exec: &dyn Executor, stream: Stream, plan: &Plan) -> Result<Self, CudaError> {
        let a = PlanArrays::from_plan(plan)?;
        let up = |bytes: Vec<u8>| exec.upload_on(stream, &bytes);
        Ok(Self {
            ranks: plan.ranks(),
            experts: plan.experts(),
            slots_per_rank: plan.slots_per_rank(),
            slots: up(a.slots.iter().flat_map(|v| v.to_le_bytes()).collect())?,
            inst_offsets: up(le_u32(&a.inst_offsets))?,
            inst_rank: up(le_u32(&a.inst_rank))?,
            inst_quota: up(le_u64(&a.inst_quota))?,
            split_offsets: up(le_u32(&a.split_offsets))?,
            cumulative: up(le_u64(&a.cumulative))?,
        })
    }

    /// Downloads the arrays (sized by the plan's own offsets) after the work `stream` queued.
    pub fn download(&self, exec: &dyn Executor, stream: Stream) -> Result<PlanArrays, CudaError> {
        let inst_offsets = exec.download_u32_on(stream, &self.inst_offsets)?;
        let split_offsets = exec.download_u32_on(stream, &self.split_offsets)?;
        let instances = inst_offsets[self.experts] as usize;
        let cells = split_offsets[self.experts] as usize;
        if instances * 8 > self.inst_quota.bytes() || cells * 8 > self.cumulative.bytes() {
            return Err(PlanViolation::Shape.into());
        }
        let words = |buffer: &DeviceBuffer, n: usize, width: usize| {
            let mut bytes = vec![0u8; n * width];
            exec.read_on(stream, buffer, 0, &mut bytes).map(|()| bytes)
        };
        let slots = words(&self.slots, self.ranks * self.slots_per_rank, 4)?;
        let inst_rank = words(&self.inst_rank, instances, 4)?;
        let inst_quota = words(&self.inst_quota, instances, 8)?;
        let cumulative = words(&self.cumulative, cells, 8)?;
        Ok(PlanArrays {
            slots: slots
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect(),
            inst_rank: from_le_u32(&inst_rank),
            inst_quota: from_le_u64(&inst_quota),
            cumulative: from_le_u64(&cumulative),
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

fn le_u32(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn le_u64(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn from_le_u32(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect()
}

fn from_le_u64(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect()
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
