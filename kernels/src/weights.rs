//! Where the weights of an expert instance live on the rank that computes it: its home weights
//! for the main instance, the redundant slot the plan streamed a replica into otherwise. One
//! lookup for every data plane (the CPU plane reads host slots, the GPU plane device buffers).

use rackfill_balancer::{Layout, Plan};

/// Where the weights of one expert instance live on the rank that computes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightSource {
    /// The rank's `local`-th main expert (its home weights, in [`Layout::main_experts`] order).
    Home { local: usize },
    /// The rank's redundant slot `slot`, where the replica was streamed.
    Slot { slot: usize },
}

/// The weights of instance `instance` of `expert`, computed on `rank`; `None` when the plan does
/// not put that instance on that rank (a misrouted row: the caller reports it).
pub fn weight_source(
    layout: &Layout,
    plan: &Plan,
    rank: usize,
    expert: u32,
    instance: u32,
) -> Option<WeightSource> {
    if expert as usize >= plan.experts() || rank >= plan.ranks() {
        return None;
    }
    let inst = plan.instances(expert as usize).get(instance as usize)?;
    if inst.rank as usize != rank {
        return None;
    }
    if instance == 0 {
        let local = layout
            .main_experts(rank)
            .iter()
            .position(|&e| e == expert)?;
        Some(WeightSource::Home { local })
    } else {
        let slot = plan
            .rank_slots(rank)
            .iter()
            .position(|s| *s == Some(expert))?;
        Some(WeightSource::Slot { slot })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfill_balancer::quota::QuotaPlanner;
    use rackfill_balancer::{Balancer, LoadMatrix};

    #[test]
    fn weight_sources_follow_the_plan() {
        let layout = Layout::contiguous(4, 4, 1).unwrap();
        let load = LoadMatrix::from_rows(&vec![vec![100u64, 0, 0, 0]; 4]).unwrap();
        let plan = QuotaPlanner::new(1).plan(&layout, &load).unwrap();
        assert_eq!(plan.instances(0).len(), 4);
        assert_eq!(
            weight_source(&layout, &plan, 0, 0, 0),
            Some(WeightSource::Home { local: 0 })
        );
        for i in 1..4u32 {
            let rank = plan.instances(0)[i as usize].rank as usize;
            assert_eq!(
                weight_source(&layout, &plan, rank, 0, i),
                Some(WeightSource::Slot { slot: 0 })
            );
            assert_eq!(weight_source(&layout, &plan, 0, 0, i), None);
        }
        assert_eq!(weight_source(&layout, &plan, 1, 0, 0), None);
        assert_eq!(
            weight_source(&layout, &plan, 1, 1, 0),
            Some(WeightSource::Home { local: 0 })
        );
        assert_eq!(weight_source(&layout, &plan, 0, 9, 0), None);
        assert_eq!(weight_source(&layout, &plan, 9, 0, 0), None);
        assert_eq!(weight_source(&layout, &plan, 0, 0, 9), None);
    }
}
