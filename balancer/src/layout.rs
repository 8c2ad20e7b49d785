//! Static expert layout of one EP group: ranks, logical experts, their home ranks, and the number of
//! redundant slots each rank reserves for replicas (UltraEP §4.1).

use crate::BalanceError;

/// Most reroute-split counts a plan on a layout may need, [`Layout::max_split_cells`]: 2^25
/// (256 MiB), more than a hundred times 72 ranks x 256 experts x 32 slots. Past it a single
/// plan's split alone takes gigabytes (and plans index it with `u32` offsets).
pub const MAX_SPLIT_CELLS: u128 = 1 << 25;

/// Where every logical expert's main instance lives and how many replica slots each rank has.
///
/// The layout never changes while serving: main placement is immutable and balancing only fills the
/// redundant slots, so the same layout is shared by every layer and every plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    ranks: usize,
    slots_per_rank: usize,
    home: Vec<u32>,
    /// `main_offsets[r]..main_offsets[r + 1]` indexes `mains`, the main experts of rank `r`.
    main_offsets: Vec<u32>,
    mains: Vec<u32>,
}

impl Layout {
    /// The default layout: experts split into `ranks` contiguous runs whose sizes differ by at most
    /// one (the first `experts % ranks` ranks get one more), so that e.g. 256 experts on 72 ranks
    /// works without padding.
    pub fn contiguous(
        ranks: usize,
        experts: usize,
        slots_per_rank: usize,
    ) -> Result<Self, BalanceError> {
        if ranks == 0 {
            return Err(BalanceError::NoRanks);
        }
        let base = experts / ranks;
        let extra = experts % ranks;
        let mut home = Vec::with_capacity(experts);
        for r in 0..ranks {
            let run = base + usize::from(r < extra);
            home.extend(std::iter::repeat_n(r as u32, run));
        }
        Self::with_home(ranks, home, slots_per_rank)
    }

    /// A layout with an explicit home rank per expert (any placement, including ranks without main
    /// experts).
    pub fn with_home(
        ranks: usize,
        home: Vec<u32>,
        slots_per_rank: usize,
    ) -> Result<Self, BalanceError> {
        if ranks == 0 {
            return Err(BalanceError::NoRanks);
        }
        if ranks > u32::MAX as usize || home.len() > u32::MAX as usize {
            return Err(BalanceError::TooLarge);
        }
        // A rank never holds an expert twice, so more slots than experts can never be used;
        // refusing them also bounds every per-slot buffer by the load matrix's size.
        if slots_per_rank > home.len().max(1) {
            return Err(BalanceError::TooManySlots {
                slots: slots_per_rank,
                experts: home.len(),
            });
        }
        let cells = split_cells(ranks, home.len(), slots_per_rank);
        if cells > MAX_SPLIT_CELLS {
            return Err(BalanceError::PlanTooLarge {
                ranks,
                experts: home.len(),
                slots: slots_per_rank,
                cells,
            });
        }
        let mut counts = vec![0u32; ranks + 1];
        for (expert, &h) in home.iter().enumerate() {
            if h as usize >= ranks {
                return Err(BalanceError::HomeOutOfRange {
                    expert,
                    home: h as u64,
                    ranks,
                });
            }
            counts[h as usize + 1] += 1;
        }
        for r in 0..ranks {
            counts[r + 1] += counts[r];
        }
        let main_offsets = counts.clone();
        let mut mains = vec![0u32; home.len()];
        for (expert, &h) in home.iter().enumerate() {
            let at = &mut counts[h as usize];
            mains[*at as usize] = expert as u32;
            *at += 1;
        }
        Ok(Self {
            ranks,
            slots_per_rank,
            home,
            main_offsets,
            mains,
        })
    }

    /// Number of ranks `R` in the EP group.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Number of logical experts `E`.
    pub fn experts(&self) -> usize {
        self.home.len()
    }

    /// Redundant slots per rank, `n_slot`.
    pub fn slots_per_rank(&self) -> usize {
        self.slots_per_rank
    }

    /// Home rank `home(e)` of expert `e`'s main instance.
    pub fn home(&self, expert: usize) -> usize {
        self.home[expert] as usize
    }

    /// The home map, one rank per expert.
    pub fn home_map(&self) -> &[u32] {
        &self.home
    }

    /// The most reroute-split counts a plan on this layout can hold,
    /// `R x (min(E, R x n_slot) + R x n_slot)`: every source rank's share of every instance of a
    /// replicated expert (at most that many mains and `R x n_slot` replicas). Layouts above
    /// [`MAX_SPLIT_CELLS`] are refused.
    pub fn max_split_cells(&self) -> u128 {
        split_cells(self.ranks, self.experts(), self.slots_per_rank)
    }

    /// Main experts of rank `r`, in ascending expert id.
    pub fn main_experts(&self, rank: usize) -> &[u32] {
        &self.mains[self.main_offsets[rank] as usize..self.main_offsets[rank + 1] as usize]
    }
}

fn split_cells(ranks: usize, experts: usize, slots_per_rank: usize) -> u128 {
    let (r, e, s) = (ranks as u128, experts as u128, slots_per_rank as u128);
    r * (e.min(r * s) + r * s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_splits_uneven_counts_into_near_equal_runs() {
        let layout = Layout::contiguous(72, 256, 2).unwrap();
        let sizes: Vec<usize> = (0..72).map(|r| layout.main_experts(r).len()).collect();
        assert_eq!(sizes.iter().sum::<usize>(), 256);
        assert_eq!(*sizes.iter().max().unwrap(), 4);
        assert_eq!(*sizes.iter().min().unwrap(), 3);
        // 256 = 72 * 3 + 40: the first 40 ranks hold four experts.
        assert_eq!(sizes.iter().filter(|&&s| s == 4).count(), 40);
        assert_eq!(layout.home(0), 0);
        assert_eq!(layout.home(255), 71);
        for r in 0..72 {
            for &e in layout.main_experts(r) {
                assert_eq!(layout.home(e as usize), r);
            }
        }
    }

    #[test]
    fn explicit_home_out_of_range_is_rejected() {
        let err = Layout::with_home(2, vec![0, 2], 1).unwrap_err();
        assert!(err.to_string().contains("expert 1"), "{err}");
        assert!(matches!(
            Layout::contiguous(0, 4, 1),
            Err(BalanceError::NoRanks)
        ));
    }

    #[test]
    fn layouts_whose_plans_could_take_gigabytes_are_refused() {
        // 1024 ranks x 4096 experts x 4096 slots: eplb-exact fills every slot, and the split of
        // its plan would be 1024 x (4096 + 1024 x 4096) counts, 34 GB.
        let err = Layout::contiguous(1024, 4096, 4096).unwrap_err();
        assert!(matches!(err, BalanceError::PlanTooLarge { .. }), "{err}");
        assert!(err.to_string().contains("1024 ranks"), "{err}");
        // A tiny load on many ranks is just as large: 16384 ranks x 2 experts x 1 slot.
        assert!(Layout::contiguous(16384, 2, 1).is_err());
        // The biggest shapes the benches take with a few slots stay well inside.
        let layout = Layout::contiguous(1024, 4096, 16).unwrap();
        assert_eq!(layout.max_split_cells(), 1024 * (4096 + 1024 * 16));
        assert_eq!(
            Layout::contiguous(4, 64, 2).unwrap().max_split_cells(),
            4 * (8 + 8)
        );
        // Without slots there are no replicas: any rank count is fine.
        assert!(Layout::contiguous(1 << 20, 2, 0).is_ok());
    }

    #[test]
    fn ranks_may_hold_no_main_expert() {
        let layout = Layout::contiguous(8, 3, 1).unwrap();
        assert_eq!(layout.main_experts(7), &[] as &[u32]);
        assert_eq!(layout.main_experts(2), &[2]);
    }
}
