//! The token side of one EP MoE layer, around the two all-to-alls (UltraEP §5.2):
//!
//! 1. [`permute_tokens`] (source rank): visit the token-expert pairs in token order, then top-k
//!    order; the `j`-th pair this rank routes to expert `e` goes to instance
//!    `instance_of(r, e, j)` (cumulative-quota lookup), whose rank gets the row. The result is one
//!    [`DispatchBuffers`] per destination rank: the all-to-all-v send side.
//! 2. [`group_by_instance`] (destination rank): gather everything received into one contiguous
//!    block per (expert, instance), so one GEMM per expert instance runs, then
//!    [`ExpertBatches::return_outputs`] puts the outputs back in the order each sender sent them.
//! 3. [`scatter_pairs`] (source rank): place each destination's returned rows at their pair
//!    indices; [`combine`] sums each token's pairs with the router weights in top-k order.
//!
//! Because the combine order is fixed by the pair index, never by where or in which batch a pair
//! was computed, the EP result is bitwise equal to the dense single-device path.

use crate::KernelError;
use rackfill_balancer::{Plan, TokenAssignment};
use std::ops::Range;

/// A plan's token-to-instance lookup together with the shape needed to check input against it.
///
/// [`TokenAssignment`] indexes its tables by expert id without bounds checks of its own and does
/// not expose the expert count; carrying `E` here lets every kernel reject an out-of-range expert
/// id as an error instead of panicking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceRouter {
    assignment: TokenAssignment,
    experts: usize,
}

impl InstanceRouter {
    /// Builds the cumulative-quota lookup of a plan.
    pub fn new(plan: &Plan) -> Self {
        Self {
            assignment: TokenAssignment::new(plan),
            experts: plan.experts(),
        }
    }

    /// The underlying lookup.
    pub fn assignment(&self) -> &TokenAssignment {
        &self.assignment
    }

    /// Number of logical experts `E`.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Number of ranks `R`.
    pub fn ranks(&self) -> usize {
        self.assignment.ranks()
    }
}

/// The token-expert pairs one source rank sends to one destination rank (all-to-all-v send side).
///
/// Row `i` is the hidden state of pair `pairs[i]` (`token * top_k + k` on the source), for expert
/// `experts[i]`, computed by instance `instances[i]` of that expert (0 = main). Rows are in the
/// source's pair order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DispatchBuffers {
    /// `len() x hidden`, row-major.
    pub rows: Vec<f32>,
    pub pairs: Vec<u32>,
    pub experts: Vec<u32>,
    pub instances: Vec<u32>,
}

impl DispatchBuffers {
    /// Number of rows (token-expert pairs).
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Whether nothing is sent.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Checks that the four arrays agree with each other and with `hidden`.
    fn check(&self, hidden: usize) -> Result<(), KernelError> {
        let n = self.len();
        check_len("experts", self.experts.len(), n)?;
        check_len("instances", self.instances.len(), n)?;
        let rows = n.checked_mul(hidden).ok_or(KernelError::Overflow {
            what: "rows x hidden",
        })?;
        check_len("rows", self.rows.len(), rows)
    }
}

/// Integer ids a dispatched row carries on the wire beside its activations: (pair, expert,
/// instance), as [`DispatchBuffers::into_wire`] writes them. Every data plane counts them the same
/// way ([`remote_recv_bytes`]).
pub const IDS_PER_ROW: usize = 3;

impl DispatchBuffers {
    /// The wire form: the activation rows, and (pair, expert, instance) per row.
    pub fn into_wire(self) -> (Vec<f32>, Vec<u32>) {
        let mut ids = Vec::with_capacity(self.len() * IDS_PER_ROW);
        for ((&p, &e), &i) in self.pairs.iter().zip(&self.experts).zip(&self.instances) {
            ids.extend_from_slice(&[p, e, i]);
        }
        (self.rows, ids)
    }

    /// The receiving side of [`Self::into_wire`]; `ids` must hold [`IDS_PER_ROW`] per row.
    pub fn from_wire(rows: Vec<f32>, ids: &[u32]) -> Result<Self, KernelError> {
        if !ids.len().is_multiple_of(IDS_PER_ROW) {
            return Err(KernelError::NotMultiple {
                what: "dispatch ids",
                len: ids.len(),
                of: IDS_PER_ROW,
            });
        }
        let column =
            |c: usize| -> Vec<u32> { ids.chunks_exact(IDS_PER_ROW).map(|row| row[c]).collect() };
        Ok(Self {
            pairs: column(0),
            experts: column(1),
            instances: column(2),
            rows,
        })
    }
}

/// Bytes one rank receives from other ranks over a layer's two all-to-alls: the rows other
/// sources dispatch to it (`rows_from[src]`, activations and [`IDS_PER_ROW`] ids each) and the
/// outputs of its own rows computed elsewhere (`rows_to[dst]`, activations only). Its own entry
/// in either list never crosses the fabric.
pub fn remote_recv_bytes(
    rank: usize,
    rows_from: &[usize],
    rows_to: &[usize],
    hidden: usize,
) -> u64 {
    let row = hidden as u64 * 4;
    let ids = IDS_PER_ROW as u64 * 4;
    let remote = |counts: &[usize]| -> u64 {
        counts
            .iter()
            .enumerate()
            .filter(|&(peer, _)| peer != rank)
            .map(|(_, &n)| n as u64)
            .sum()
    };
    remote(rows_from) * (row + ids) + remote(rows_to) * row
}

/// Groups one source rank's token-expert pairs by the rank of the instance that computes them.
///
/// `x` is the source's `tokens x hidden` activations, `experts` its `tokens * top_k` routed expert
/// ids (pair `p = token * top_k + k`). Returns one [`DispatchBuffers`] per rank (index = rank).
pub fn permute_tokens(
    src_rank: usize,
    x: &[f32],
    hidden: usize,
    top_k: usize,
    experts: &[u32],
    router: &InstanceRouter,
) -> Result<Vec<DispatchBuffers>, KernelError> {
    if hidden == 0 {
        return Err(KernelError::ZeroDimension { what: "hidden" });
    }
    if top_k == 0 {
        return Err(KernelError::ZeroDimension { what: "top_k" });
    }
    if !experts.len().is_multiple_of(top_k) {
        return Err(KernelError::NotMultiple {
            what: "experts",
            len: experts.len(),
            of: top_k,
        });
    }
    let tokens = experts.len() / top_k;
    let expected = tokens.checked_mul(hidden).ok_or(KernelError::Overflow {
        what: "tokens x hidden",
    })?;
    check_len("x", x.len(), expected)?;
    if src_rank >= router.ranks() {
        return Err(out_of_range("source rank", src_rank, router.ranks()));
    }
    if u32::try_from(experts.len()).is_err() {
        return Err(KernelError::Overflow { what: "pair index" });
    }
    if let Some((pair, &expert)) = experts
        .iter()
        .enumerate()
        .find(|(_, &e)| e as usize >= router.experts())
    {
        return Err(KernelError::ExpertOutOfRange {
            pair,
            expert,
            experts: router.experts(),
        });
    }

    let assignment = router.assignment();
    let mut seen = vec![0u64; router.experts()];
    let mut out = vec![DispatchBuffers::default(); router.ranks()];
    for (pair, &expert) in experts.iter().enumerate() {
        let e = expert as usize;
        let instance = assignment.instance_of(src_rank, e, seen[e]);
        seen[e] += 1;
        let rank = assignment.instances(e)[instance] as usize;
        let buf = &mut out[rank];
        let token = pair / top_k;
        buf.rows
            .extend_from_slice(&x[token * hidden..(token + 1) * hidden]);
        buf.pairs.push(pair as u32);
        buf.experts.push(expert);
        buf.instances.push(instance as u32);
    }
    Ok(out)
}

/// The rows of one expert instance in an [`ExpertBatches`] block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceGroup {
    pub expert: u32,
    /// Instance index of the expert (0 = main), as in [`Plan::instances`].
    pub instance: u32,
    /// Row range in [`ExpertBatches::rows`] (and in the gathered output).
    pub rows: Range<usize>,
}

/// Everything one rank received, regrouped by expert instance for one GEMM each.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertBatches {
    hidden: usize,
    groups: Vec<InstanceGroup>,
    rows: Vec<f32>,
    /// For each gathered row: (sender index, row index in that sender's buffer).
    origin: Vec<(u32, u32)>,
    /// Rows received from each sender.
    received: Vec<usize>,
}

/// Gathers the buffers rank `rank` received (`received[s]` from sender `s`) into one contiguous
/// block per (expert, instance), groups ascending by expert then instance, rows within a group in
/// sender order then received order. Rejects rows whose instance is not on `rank`.
pub fn group_by_instance(
    rank: usize,
    received: &[DispatchBuffers],
    hidden: usize,
    router: &InstanceRouter,
) -> Result<ExpertBatches, KernelError> {
    if hidden == 0 {
        return Err(KernelError::ZeroDimension { what: "hidden" });
    }
    if u32::try_from(received.len()).is_err() {
        return Err(KernelError::Overflow {
            what: "sender index",
        });
    }
    let mut keyed = Vec::new();
    for (sender, buf) in received.iter().enumerate() {
        buf.check(hidden)?;
        if u32::try_from(buf.len()).is_err() {
            return Err(KernelError::Overflow { what: "row index" });
        }
        for (row, (&expert, &instance)) in buf.experts.iter().zip(&buf.instances).enumerate() {
            if expert as usize >= router.experts() {
                return Err(KernelError::ExpertOutOfRange {
                    pair: buf.pairs[row] as usize,
                    expert,
                    experts: router.experts(),
                });
            }
            let ranks = router.assignment().instances(expert as usize);
            let owner = *ranks
                .get(instance as usize)
                .ok_or_else(|| out_of_range("instance", instance as usize, ranks.len()))?;
            if owner as usize != rank {
                return Err(KernelError::Misrouted {
                    sender,
                    row,
                    expert,
                    instance,
                    owner,
                    rank,
                });
            }
            keyed.push(((expert, instance), (sender as u32, row as u32)));
        }
    }
    // Stable: rows of a group keep sender order, then received order.
    keyed.sort_by_key(|&(key, _)| key);

    let mut groups: Vec<InstanceGroup> = Vec::new();
    let mut rows = Vec::with_capacity(keyed.len() * hidden);
    let mut origin = Vec::with_capacity(keyed.len());
    for (i, &((expert, instance), (sender, row))) in keyed.iter().enumerate() {
        match groups.last_mut() {
            Some(g) if (g.expert, g.instance) == (expert, instance) => g.rows.end = i + 1,
            _ => groups.push(InstanceGroup {
                expert,
                instance,
                rows: i..i + 1,
            }),
        }
        let (sender, row) = (sender as usize, row as usize);
        rows.extend_from_slice(&received[sender].rows[row * hidden..(row + 1) * hidden]);
        origin.push((sender as u32, row as u32));
    }
    Ok(ExpertBatches {
        hidden,
        groups,
        rows,
        origin,
        received: received.iter().map(DispatchBuffers::len).collect(),
    })
}

impl ExpertBatches {
    /// Row width (input and output).
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// The groups, ascending by (expert, instance).
    pub fn groups(&self) -> &[InstanceGroup] {
        &self.groups
    }

    /// All gathered rows, `rows x hidden`, group after group.
    pub fn rows(&self) -> &[f32] {
        &self.rows
    }

    /// The input block of `group` (`group.rows.len() x hidden`).
    pub fn block(&self, group: &InstanceGroup) -> Option<&[f32]> {
        self.rows
            .get(group.rows.start * self.hidden..group.rows.end * self.hidden)
    }

    /// Runs `f(group, input block, output block)` for every group (output blocks are zeroed,
    /// `rows x hidden`), then routes the outputs back: one buffer per sender, rows in the order
    /// that sender sent them.
    pub fn run<E>(
        &self,
        mut f: impl FnMut(&InstanceGroup, &[f32], &mut [f32]) -> Result<(), E>,
    ) -> Result<Vec<Vec<f32>>, E> {
        let h = self.hidden;
        let mut outputs = vec![0f32; self.rows.len()];
        for group in &self.groups {
            let range = group.rows.start * h..group.rows.end * h;
            f(group, &self.rows[range.clone()], &mut outputs[range])?;
        }
        Ok(self.unpermute(&outputs))
    }

    /// Routes gathered outputs (`rows x hidden`, same row order as [`Self::rows`], e.g. from a
    /// grouped GEMM run elsewhere) back to their senders, in the order each sender sent them.
    pub fn return_outputs(&self, outputs: &[f32]) -> Result<Vec<Vec<f32>>, KernelError> {
        check_len("outputs", outputs.len(), self.rows.len())?;
        Ok(self.unpermute(outputs))
    }

    fn unpermute(&self, outputs: &[f32]) -> Vec<Vec<f32>> {
        let h = self.hidden;
        let mut back: Vec<Vec<f32>> = self.received.iter().map(|&n| vec![0f32; n * h]).collect();
        for (y, &(sender, row)) in outputs.chunks_exact(h).zip(&self.origin) {
            let row = row as usize;
            back[sender as usize][row * h..(row + 1) * h].copy_from_slice(y);
        }
        back
    }
}

/// Places returned expert outputs into a pair-indexed `[tokens * top_k, hidden]` buffer: row `i`
/// of `rows` is the output of pair `pairs[i]` (the `pairs` of the [`DispatchBuffers`] the source
/// sent to that destination).
pub fn scatter_pairs(
    pair_outputs: &mut [f32],
    hidden: usize,
    pairs: &[u32],
    rows: &[f32],
) -> Result<(), KernelError> {
    if hidden == 0 {
        return Err(KernelError::ZeroDimension { what: "hidden" });
    }
    if !pair_outputs.len().is_multiple_of(hidden) {
        return Err(KernelError::NotMultiple {
            what: "pair_outputs",
            len: pair_outputs.len(),
            of: hidden,
        });
    }
    let expected = pairs
        .len()
        .checked_mul(hidden)
        .ok_or(KernelError::Overflow {
            what: "pairs x hidden",
        })?;
    check_len("rows", rows.len(), expected)?;
    let n_pairs = pair_outputs.len() / hidden;
    if let Some(&bad) = pairs.iter().find(|&&p| p as usize >= n_pairs) {
        return Err(out_of_range("pair index", bad as usize, n_pairs));
    }
    for (&p, y) in pairs.iter().zip(rows.chunks_exact(hidden)) {
        let p = p as usize;
        pair_outputs[p * hidden..(p + 1) * hidden].copy_from_slice(y);
    }
    Ok(())
}

/// `out[token] = sum over k = 0..top_k, in that order, of weights[p] * pair_outputs[p]` with
/// `p = token * top_k + k`, accumulated from zero exactly as the dense path does, so the result is
/// bitwise independent of where each pair was computed.
pub fn combine(
    pair_outputs: &[f32],
    weights: &[f32],
    tokens: usize,
    top_k: usize,
    hidden: usize,
) -> Result<Vec<f32>, KernelError> {
    if hidden == 0 {
        return Err(KernelError::ZeroDimension { what: "hidden" });
    }
    let n_pairs = tokens.checked_mul(top_k).ok_or(KernelError::Overflow {
        what: "tokens x top_k",
    })?;
    check_len("weights", weights.len(), n_pairs)?;
    let expected = n_pairs.checked_mul(hidden).ok_or(KernelError::Overflow {
        what: "pairs x hidden",
    })?;
    check_len("pair_outputs", pair_outputs.len(), expected)?;
    let mut out = vec![0f32; tokens * hidden];
    for (t, acc) in out.chunks_exact_mut(hidden).enumerate() {
        for p in t * top_k..(t + 1) * top_k {
            let w = weights[p];
            let y = &pair_outputs[p * hidden..(p + 1) * hidden];
            for (a, &v) in acc.iter_mut().zip(y) {
                *a += w * v;
            }
        }
    }
    Ok(out)
}

/// `len == expected`, or a [`KernelError::Length`] naming `what` (the CUDA launchers use it too).
pub(crate) fn check_len(
    what: &'static str,
    len: usize,
    expected: usize,
) -> Result<(), KernelError> {
    if len == expected {
        Ok(())
    } else {
        Err(KernelError::Length {
            what,
            len,
            expected,
        })
    }
}

fn out_of_range(what: &'static str, value: usize, limit: usize) -> KernelError {
    KernelError::OutOfRange {
        what,
        value: value as u64,
        limit: limit as u64,
    }
}
