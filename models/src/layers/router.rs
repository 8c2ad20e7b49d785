//! Routers: hidden states to each token's top-k experts and combine weights.
//!
//! The output, [`Routing`], is the exact load information the balancer plans from; it is plain
//! data so the engine can count it per rank, exchange it and record it.

use candle_core::Tensor;

use crate::checkpoint::Weights;
use crate::config::{MoeConfig, RouterKind};
use crate::error::Result;

/// Each token's selected experts and their combine weights, `top_k` per token, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Routing {
    /// Number of routed tokens.
    pub fn num_tokens(&self) -> usize {
        self.experts.len().checked_div(self.top_k).unwrap_or(0)
    }

    /// Tokens per expert (each token counts once per selected expert).
    pub fn expert_counts(&self, num_experts: usize) -> Vec<u64> {
        let mut counts = vec![0u64; num_experts];
        for &e in &self.experts {
            counts[e as usize] += 1;
        }
        counts
    }
}

/// The gate of an MoE block.
#[derive(Debug, Clone)]
pub struct Router {
    /// `[E, H]`.
    pub(crate) weight: Tensor,
    /// DeepSeek's `e_score_correction_bias`: shifts selection, not the weights.
    pub(crate) correction_bias: Option<Vec<f32>>,
    pub(crate) kind: RouterKind,
    pub(crate) top_k: usize,
    pub(crate) num_experts: usize,
}

impl Router {
    /// Loads `gate.weight` (and `gate.e_score_correction_bias` for the sigmoid router).
    pub fn load(w: &Weights, hidden: usize, moe: &MoeConfig) -> Result<Self> {
        let weight = w.get(&[moe.num_experts, hidden], "weight")?;
        let correction_bias = match moe.router {
            RouterKind::SigmoidGrouped { .. } => Some(
                w.get(&[moe.num_experts], "e_score_correction_bias")?
                    .to_vec1::<f32>()?,
            ),
            RouterKind::SoftmaxTopK { .. } => None,
        };
        Ok(Self {
            weight,
            correction_bias,
            kind: moe.router.clone(),
            top_k: moe.top_k,
            num_experts: moe.num_experts,
        })
    }

    /// Routes `x` `[T, H]`.
    pub fn route(&self, x: &Tensor) -> Result<Routing> {
        let logits = x
            .matmul(&self.weight.t()?)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        Ok(self.select(&logits))
    }

    /// Routes tokens given their router logits, row-major `[T, E]`: the selection after the
    /// gate's product, and the reference the GPU router kernels (which take the logits from a
    /// cuBLAS GEMM) must reproduce.
    pub fn select(&self, logits: &[f32]) -> Routing {
        let k = self.top_k;
        let rows = logits.len() / self.num_experts.max(1);
        let mut routing = Routing {
            top_k: k,
            experts: Vec::with_capacity(rows * k),
            weights: Vec::with_capacity(rows * k),
        };
        for row in logits.chunks_exact(self.num_experts.max(1)) {
            let (experts, weights) = match &self.kind {
                RouterKind::SoftmaxTopK { norm_topk_prob } => {
                    softmax_top_k(row, k, *norm_topk_prob)
                }
                RouterKind::SigmoidGrouped {
                    n_group,
                    topk_group,
                    norm_topk_prob,
                    routed_scaling_factor,
                } => {
                    let bias = self.correction_bias.as_deref().unwrap_or(&[]);
                    let groups = GroupLimit {
                        n_group: *n_group,
                        topk_group: *topk_group,
                    };
                    let (experts, mut weights) = sigmoid_grouped_top_k(row, bias, k, groups);
                    if *norm_topk_prob {
                        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
                        weights.iter_mut().for_each(|w| *w /= sum);
                    }
                    weights.iter_mut().for_each(|w| *w *= routed_scaling_factor);
                    (experts, weights)
                }
            };
            routing.experts.extend(experts);
            routing.weights.extend(weights);
        }
        debug_assert!(routing
            .experts
            .iter()
            .all(|&e| (e as usize) < self.num_experts));
        routing
    }
}

/// Indices of the `k` largest values, largest first; ties keep the lower index first.
fn top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// Softmax over all experts, top-k, optional renormalisation over the chosen k.
fn softmax_top_k(logits: &[f32], k: usize, renormalise: bool) -> (Vec<u32>, Vec<f32>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let probs: Vec<f32> = exps.iter().map(|e| e / sum).collect();
    let chosen = top_k_indices(&probs, k);
    let mut weights: Vec<f32> = chosen.iter().map(|&e| probs[e]).collect();
    if renormalise {
        let total: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= total);
    }
    (chosen.into_iter().map(|e| e as u32).collect(), weights)
}

/// DeepSeek-V3's group-limited selection parameters.
#[derive(Debug, Clone, Copy)]
struct GroupLimit {
    n_group: usize,
    topk_group: usize,
}

/// Sigmoid scores; experts chosen on `score + bias` within the `topk_group` groups whose two best
/// corrected scores sum highest (experts of other groups count as 0, as in transformers); weights
/// are the uncorrected scores of the chosen experts.
fn sigmoid_grouped_top_k(
    logits: &[f32],
    bias: &[f32],
    k: usize,
    groups: GroupLimit,
) -> (Vec<u32>, Vec<f32>) {
    let scores: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
    let mut choice: Vec<f32> = scores
        .iter()
        .enumerate()
        .map(|(e, s)| s + bias.get(e).copied().unwrap_or(0.0))
        .collect();
    let per_group = scores.len() / groups.n_group;
    let group_scores: Vec<f32> = choice
        .chunks(per_group)
        .map(|g| top_k_indices(g, 2).iter().map(|&i| g[i]).sum())
        .collect();
    let kept = top_k_indices(&group_scores, groups.topk_group);
    for (g, members) in choice.chunks_mut(per_group).enumerate() {
        if !kept.contains(&g) {
            members.fill(0.0);
        }
    }
    let chosen = top_k_indices(&choice, k);
    let weights = chosen.iter().map(|&e| scores[e]).collect();
    (chosen.into_iter().map(|e| e as u32).collect(), weights)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_top_k_picks_largest_and_renormalises() {
        let (experts, weights) = softmax_top_k(&[0.0, 2.0, 1.0, -1.0], 2, true);
        assert_eq!(experts, vec![1, 2]);
        assert!((weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(weights[0] > weights[1]);
        let (_, raw) = softmax_top_k(&[0.0, 2.0, 1.0, -1.0], 2, false);
        assert!(raw.iter().sum::<f32>() < 1.0);
    }

    #[test]
    fn grouped_selection_ignores_experts_outside_the_best_groups() {
        // Group 0 = experts 0..2, group 1 = experts 2..4. Expert 0 alone is the best single
        // score, but group 1's two best sum higher, so with topk_group 1 only group 1 competes.
        let logits = [3.0, -3.0, 1.5, 1.5];
        let groups = GroupLimit {
            n_group: 2,
            topk_group: 1,
        };
        let (experts, weights) = sigmoid_grouped_top_k(&logits, &[0.0; 4], 2, groups);
        assert_eq!(experts, vec![2, 3]);
        assert!((weights[0] - 1.0 / (1.0 + (-1.5f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn correction_bias_changes_selection_but_not_weights() {
        let groups = GroupLimit {
            n_group: 1,
            topk_group: 1,
        };
        let (experts, weights) =
            sigmoid_grouped_top_k(&[1.0, 0.0, -1.0], &[0.0, 0.0, 2.0], 1, groups);
        assert_eq!(experts, vec![2]);
        assert!((weights[0] - 1.0 / (1.0 + 1f32.exp())).abs() < 1e-6);
    }
}
