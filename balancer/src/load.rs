//! The exact load matrix `load[r][e]` read after gating: token-expert pairs routed from source rank
//! `r` to logical expert `e` (a token with top-k routing counts k times).

use crate::{BalanceError, Layout};

/// Dense row-major `R x E` matrix of token-expert pair counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadMatrix {
    ranks: usize,
    experts: usize,
    counts: Vec<u64>,
}

impl LoadMatrix {
    /// An all-zero matrix, for callers that fill it in place (the engine's count exchange).
    pub fn zeros(ranks: usize, experts: usize) -> Self {
        Self {
            ranks,
            experts,
            counts: vec![0; ranks * experts],
        }
    }

    /// Builds the matrix from rows, one per source rank; rows must all have the same length.
    pub fn from_rows<R: AsRef<[u64]>>(rows: &[R]) -> Result<Self, BalanceError> {
        let experts = rows.first().map_or(0, |row| row.as_ref().len());
        let mut counts = Vec::with_capacity(rows.len() * experts);
        for (rank, row) in rows.iter().enumerate() {
            let row = row.as_ref();
            if row.len() != experts {
                return Err(BalanceError::RaggedLoad {
                    rank,
                    len: row.len(),
                    expected: experts,
                });
            }
            counts.extend_from_slice(row);
        }
        Self::from_flat(rows.len(), experts, counts)
    }

    /// Builds the matrix from a row-major buffer of `ranks * experts` counts.
    pub fn from_flat(ranks: usize, experts: usize, counts: Vec<u64>) -> Result<Self, BalanceError> {
        if counts.len() != ranks * experts {
            return Err(BalanceError::LoadSize {
                len: counts.len(),
                ranks,
                experts,
            });
        }
        // Totals are summed in u64 everywhere; refuse inputs whose sum could overflow. Quick
        // bound first (an OR vectorises, a checked sum is one long chain): no count above
        // `2^bits - 1` and `len * (2^bits - 1)` fits, so no sum of them overflows.
        let bits = 64 - counts.iter().fold(0, |a, &c| a | c).leading_zeros();
        let bound = (counts.len() as u128) * ((1u128 << bits) - 1);
        if bound > u128::from(u64::MAX) {
            let mut total: u64 = 0;
            for &c in &counts {
                total = total.checked_add(c).ok_or(BalanceError::TooLarge)?;
            }
        }
        Ok(Self {
            ranks,
            experts,
            counts,
        })
    }

    /// Number of source ranks (rows).
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Number of logical experts (columns).
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// `load[r][e]`.
    pub fn get(&self, rank: usize, expert: usize) -> u64 {
        self.counts[rank * self.experts + expert]
    }

    /// Mutable access to `load[r][e]`.
    pub fn get_mut(&mut self, rank: usize, expert: usize) -> &mut u64 {
        &mut self.counts[rank * self.experts + expert]
    }

    /// Row `r`: the counts source rank `r` routes to every expert.
    pub fn row(&self, rank: usize) -> &[u64] {
        &self.counts[rank * self.experts..(rank + 1) * self.experts]
    }

    /// The whole matrix, row-major.
    pub fn as_flat(&self) -> &[u64] {
        &self.counts
    }

    /// Total load of every expert, `lambda_e = sum_r load[r][e]`.
    pub fn expert_totals(&self) -> Vec<u64> {
        let mut totals = vec![0u64; self.experts];
        self.expert_totals_into(&mut totals);
        totals
    }

    /// [`Self::expert_totals`] into a caller-owned buffer (the planners reuse theirs across layers).
    pub fn expert_totals_into(&self, totals: &mut Vec<u64>) {
        totals.clear();
        totals.resize(self.experts, 0);
        for row in self.counts.chunks_exact(self.experts.max(1)) {
            for (t, &c) in totals.iter_mut().zip(row) {
                *t += c;
            }
        }
    }

    /// `self + other`, element by element: the load of two micro-batches of one step (the
    /// shapes must match).
    pub fn sum(&self, other: &LoadMatrix) -> Result<LoadMatrix, BalanceError> {
        if (self.ranks, self.experts) != (other.ranks, other.experts) {
            return Err(BalanceError::LoadSize {
                len: other.counts.len(),
                ranks: self.ranks,
                experts: self.experts,
            });
        }
        let counts = self
            .counts
            .iter()
            .zip(&other.counts)
            .map(|(a, b)| a.checked_add(*b).ok_or(BalanceError::TooLarge))
            .collect::<Result<_, _>>()?;
        Self::from_flat(self.ranks, self.experts, counts)
    }

    /// Sum of all token-expert pairs.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Checks that the matrix matches a layout's rank and expert counts.
    pub fn check_shape(&self, layout: &Layout) -> Result<(), BalanceError> {
        if self.ranks != layout.ranks() || self.experts != layout.experts() {
            return Err(BalanceError::ShapeMismatch {
                load_ranks: self.ranks,
                load_experts: self.experts,
                ranks: layout.ranks(),
                experts: layout.experts(),
            });
        }
        Ok(())
    }
}

/// Initial rank loads `L0[r] = sum_{e in E_r} lambda_e`: what each rank computes with main experts only.
pub fn main_rank_loads(layout: &Layout, expert_totals: &[u64]) -> Vec<u64> {
    (0..layout.ranks())
        .map(|r| {
            layout
                .main_experts(r)
                .iter()
                .map(|&e| expert_totals[e as usize])
                .sum()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ragged_rows_are_rejected_with_the_rank() {
        let err = LoadMatrix::from_rows(&[vec![1, 2], vec![3]]).unwrap_err();
        assert_eq!(err.to_string(), "load row 1 has 1 experts, row 0 has 2");
    }

    #[test]
    fn totals_and_rank_loads() {
        let load = LoadMatrix::from_rows(&[vec![1, 2, 3], vec![4, 5, 6]]).unwrap();
        assert_eq!(load.expert_totals(), vec![5, 7, 9]);
        assert_eq!(load.total(), 21);
        let layout = Layout::contiguous(2, 3, 1).unwrap();
        assert_eq!(main_rank_loads(&layout, &load.expert_totals()), vec![12, 9]);
    }

    #[test]
    fn overflowing_totals_are_rejected() {
        let err = LoadMatrix::from_rows(&[vec![u64::MAX, 1]]).unwrap_err();
        assert!(matches!(err, BalanceError::TooLarge));
        let err = LoadMatrix::from_rows(&[vec![1 << 62; 4]]).unwrap_err();
        assert!(matches!(err, BalanceError::TooLarge));
        // Large counts whose sum still fits pass the exact check the quick bound defers to.
        assert!(LoadMatrix::from_rows(&[vec![u64::MAX - 1, 1]]).is_ok());
        assert!(LoadMatrix::from_rows(&[vec![1 << 62; 3]]).is_ok());
    }
}
