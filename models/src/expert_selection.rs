//! Which routed experts a process loads. With one process per EP rank, a process holds only the
//! experts homed on its ranks (plus everything that is not a routed expert), so its memory and
//! load time shrink with the EP size; the same set applies to every MoE layer, as the EP layout
//! is shared by all layers.

use std::fmt;

use crate::error::{ModelError, Result};

/// The routed experts to load in every MoE layer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ExpertSelection {
    /// Every expert: the single-process model, and the only one the dense path can run.
    #[default]
    All,
    /// Only these expert ids (ascending, no repeats: build it with [`ExpertSelection::only`]).
    Only(Vec<u32>),
}

impl ExpertSelection {
    /// The selection of `experts`, sorted and deduplicated.
    pub fn only(experts: impl IntoIterator<Item = u32>) -> Self {
        let mut ids: Vec<u32> = experts.into_iter().collect();
        ids.sort_unstable();
        ids.dedup();
        Self::Only(ids)
    }

    /// Whether expert `expert` is loaded.
    pub fn contains(&self, expert: u32) -> bool {
        match self {
            Self::All => true,
            Self::Only(ids) => ids.binary_search(&expert).is_ok(),
        }
    }

    /// Whether every one of `num_experts` experts is loaded.
    pub fn is_complete(&self, num_experts: usize) -> bool {
        match self {
            Self::All => true,
            Self::Only(ids) => (0..num_experts as u32).all(|e| ids.binary_search(&e).is_ok()),
        }
    }

    /// Refuses a selection that is not sorted and free of repeats, or names an expert the model
    /// does not have: loading it would silently skip or double-load experts.
    pub fn check(&self, num_experts: usize) -> Result<()> {
        let Self::Only(ids) = self else {
            return Ok(());
        };
        if ids.windows(2).any(|w| w[0] >= w[1]) {
            return Err(ModelError::Input(format!(
                "expert selection {ids:?} is not ascending without repeats"
            )));
        }
        match ids.iter().find(|&&e| e as usize >= num_experts) {
            Some(e) => Err(ModelError::Input(format!(
                "expert selection names expert {e}, but the model has {num_experts} routed experts"
            ))),
            None => Ok(()),
        }
    }
}

/// `all experts`, or the ids as ranges: `experts 0-7, 16-23` (`no experts` when empty).
impl fmt::Display for ExpertSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids = match self {
            Self::All => return f.write_str("all experts"),
            Self::Only(ids) if ids.is_empty() => return f.write_str("no experts"),
            Self::Only(ids) => ids,
        };
        f.write_str(if ids.len() == 1 {
            "expert "
        } else {
            "experts "
        })?;
        let mut runs: Vec<(u32, u32)> = Vec::new();
        for &id in ids {
            match runs.last_mut() {
                Some((_, end)) if end.checked_add(1) == Some(id) => *end = id,
                _ => runs.push((id, id)),
            }
        }
        for (i, (start, end)) in runs.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            if start == end {
                write!(f, "{start}")?;
            } else {
                write!(f, "{start}-{end}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sorts_and_deduplicates_and_displays_runs() {
        let s = ExpertSelection::only([9, 1, 2, 3, 9, 7]);
        assert_eq!(s, ExpertSelection::Only(vec![1, 2, 3, 7, 9]));
        assert_eq!(s.to_string(), "experts 1-3, 7, 9");
        assert!(s.contains(7) && !s.contains(4));
        assert!(!s.is_complete(10));
        assert!(ExpertSelection::only(0..4).is_complete(4));
        assert_eq!(ExpertSelection::only([5]).to_string(), "expert 5");
        assert_eq!(ExpertSelection::only([]).to_string(), "no experts");
        assert_eq!(ExpertSelection::All.to_string(), "all experts");
    }

    #[test]
    fn check_refuses_unsorted_or_out_of_range_ids() {
        assert!(ExpertSelection::only([0, 3]).check(4).is_ok());
        let err = ExpertSelection::only([0, 4]).check(4).unwrap_err();
        assert!(err.to_string().contains("expert 4"), "{err}");
        let err = ExpertSelection::Only(vec![2, 1]).check(4).unwrap_err();
        assert!(err.to_string().contains("ascending"), "{err}");
        assert!(ExpertSelection::All.check(0).is_ok());
    }
}
