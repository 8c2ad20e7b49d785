//! The layer loop's operations with the model on the host (candle, f32) and the CPU data plane:
//! embedding, data-parallel attention, dense MLPs, routers, the plane's stages, shared experts,
//! residual and logits, each over every local rank of one micro-batch.

use std::time::{Duration, Instant};

use candle_core::Tensor;
use rayon::prelude::*;

use rackfill_balancer::Plan;
use rackfill_models::layers::moe::{rows_of, MoeBlock};
use rackfill_models::{FeedForward, LogitsFor, MoeModel, Routing, SeqChunk, SequenceInput};

use crate::error::{EngineError, Result};
use crate::fabric::Fabric;
use crate::plane::cpu::{Computed, MicroPlane, Sent};
use crate::plane::{LayerWork, PhaseTimes, PlaneOutput};

/// One micro-batch's residual stream on the host: per local rank, `None` without tokens.
pub(super) struct HostMicro {
    xs: RankTensors,
}

/// A host MoE layer between its route and its combine.
pub(super) struct HostFlight {
    /// Per local rank: the FFN input (the shared experts' input).
    inputs: RankTensors,
    /// Per local rank: the FFN input rows and their routing.
    routed: Vec<(Vec<f32>, Routing)>,
    sent: Option<Sent>,
    computed: Option<Computed>,
}

/// The micro-batch's tokens embedded.
pub(super) fn begin(model: &MoeModel, seqs: &[&mut [SequenceInput<'_>]]) -> Result<HostMicro> {
    Ok(HostMicro {
        xs: embed_ranks(model, seqs)?,
    })
}

/// A dense layer: attention, MLP and residual.
pub(super) fn dense_layer(
    model: &MoeModel,
    layer: usize,
    micro: &mut HostMicro,
    seqs: &mut [&mut [SequenceInput<'_>]],
) -> Result<()> {
    let (hs, inputs) = attention_ranks(model, layer, &micro.xs, seqs)?;
    let FeedForward::Dense(mlp) = model.layers()[layer].ffn() else {
        return Err(EngineError::Config(format!("layer {layer} is not dense")));
    };
    micro.xs = add_residual(hs, dense_ranks(mlp, &inputs)?)?;
    Ok(())
}

/// An MoE layer's attention, FFN norm and router: the layer in flight and every local rank's
/// expert counts.
pub(super) fn route_layer(
    model: &MoeModel,
    layer: usize,
    micro: &mut HostMicro,
    seqs: &mut [&mut [SequenceInput<'_>]],
) -> Result<(HostFlight, Vec<Vec<u64>>)> {
    let (hs, inputs) = attention_ranks(model, layer, &micro.xs, seqs)?;
    let routed = route(moe_block(model, layer)?, &inputs, model.config().moe.top_k)?;
    micro.xs = hs;
    let experts = model.config().moe.num_experts;
    let counts = routed
        .iter()
        .map(|(_, routing)| routing.expert_counts(experts))
        .collect();
    let flight = HostFlight {
        inputs,
        routed,
        sent: None,
        computed: None,
    };
    Ok((flight, counts))
}

/// The layer's work for the data plane, once its plan is known.
fn work<'w>(
    model: &'w MoeModel,
    layer: usize,
    plan: &'w Plan,
    flight: &'w HostFlight,
) -> Result<LayerWork<'w>> {
    let mc = model.config();
    Ok(LayerWork {
        layer,
        block: moe_block(model, layer)?,
        plan,
        routed: &flight.routed,
        hidden: mc.hidden_size,
        top_k: mc.moe.top_k,
    })
}

/// Replicas (unless they stream under the experts: `pipelined`) and dispatch.
pub(super) fn send(
    (model, plane, fabric): (&MoeModel, &mut MicroPlane<'_>, &dyn Fabric),
    (layer, plan): (usize, &Plan),
    flight: &mut HostFlight,
    pipelined: bool,
) -> Result<()> {
    let sent = plane.send(fabric, &work(model, layer, plan, flight)?, !pipelined)?;
    flight.sent = Some(sent);
    Ok(())
}

/// Main and replica experts on the received rows; with `pipelined` the replicas stream over
/// `fabric` while the main experts compute.
pub(super) fn experts(
    (model, plane, fabric): (&MoeModel, &mut MicroPlane<'_>, Option<&dyn Fabric>),
    (layer, plan): (usize, &Plan),
    flight: &mut HostFlight,
    pipelined: bool,
) -> Result<()> {
    let sent = flight
        .sent
        .take()
        .ok_or_else(|| EngineError::Config(format!("layer {layer}'s experts before its send")))?;
    let work = work(model, layer, plan, flight)?;
    let computed = match (pipelined, fabric) {
        (false, _) => plane.compute(&work, sent)?,
        (true, Some(fabric)) => plane.compute_streaming(fabric, &work, sent)?,
        (true, None) => {
            return Err(EngineError::Config(
                "pipelined experts stream replicas over the fabric: not on a compute thread".into(),
            ))
        }
    };
    flight.computed = Some(computed);
    Ok(())
}

/// The combine, the shared experts and the residual: what the layer moved and its phases.
pub(super) fn combine(
    (model, plane, fabric): (&MoeModel, &mut MicroPlane<'_>, &dyn Fabric),
    (layer, plan): (usize, &Plan),
    mut flight: HostFlight,
    micro: &mut HostMicro,
) -> Result<((u64, Vec<u64>), PhaseTimes)> {
    let computed = flight.computed.take().ok_or_else(|| {
        EngineError::Config(format!("layer {layer}'s combine before its experts"))
    })?;
    let PlaneOutput {
        routed,
        recv_bytes,
        replica_bytes,
        phases,
    } = plane.combine(fabric, &work(model, layer, plan, &flight)?, computed)?;
    let started = Instant::now();
    let outs = add_shared_ranks(moe_block(model, layer)?, &flight.inputs, routed)?;
    let shared: Duration = started.elapsed();
    micro.xs = add_residual(std::mem::take(&mut micro.xs), outs)?;
    Ok((
        (replica_bytes, recv_bytes),
        PhaseTimes {
            combine: phases.combine + shared,
            ..phases
        },
    ))
}

/// Per local rank: the logits of the rows `which` asks for (`None` without tokens).
pub(super) fn logits(
    model: &MoeModel,
    micro: HostMicro,
    seqs: &[&mut [SequenceInput<'_>]],
    which: &[&[LogitsFor]],
) -> Result<Vec<Option<Tensor>>> {
    micro
        .xs
        .into_iter()
        .zip(seqs)
        .zip(which)
        .map(|((x, seqs), which)| {
            let lens: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
            x.map(|x| model.logits_for(x, &lens, which))
                .transpose()
                .map_err(EngineError::from)
        })
        .collect()
}

/// The MoE block of model layer `layer`.
fn moe_block(model: &MoeModel, layer: usize) -> Result<&MoeBlock> {
    match model.layers()[layer].ffn() {
        FeedForward::Moe(block) => Ok(block),
        FeedForward::Dense(_) => Err(EngineError::Config(format!(
            "layer {layer} is not an MoE layer"
        ))),
    }
}

/// Per local rank: a tensor, or `None` for a rank without tokens.
type RankTensors = Vec<Option<Tensor>>;

/// Every local rank's tokens embedded, its sequences' tokens in order.
fn embed_ranks(model: &MoeModel, seqs: &[&mut [SequenceInput<'_>]]) -> Result<RankTensors> {
    seqs.iter()
        .map(|seqs| {
            let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
            (!tokens.is_empty())
                .then(|| model.embed(&tokens))
                .transpose()
        })
        .collect::<Result<_, _>>()
        .map_err(EngineError::from)
}

/// Data-parallel attention of model layer `layer`: every rank on its own sequences, each
/// continuing its KV cache. Returns the residual stream after attention and the FFN input.
fn attention_ranks(
    model: &MoeModel,
    layer: usize,
    xs: &[Option<Tensor>],
    seqs: &mut [&mut [SequenceInput<'_>]],
) -> Result<(RankTensors, RankTensors)> {
    let block = &model.layers()[layer];
    let hs: RankTensors = xs
        .par_iter()
        .zip(seqs.par_iter_mut())
        .map(|(x, seqs)| {
            let Some(x) = x else { return Ok(None) };
            let mut chunks: Vec<SeqChunk<'_>> = seqs
                .iter_mut()
                .map(|s| SeqChunk {
                    len: s.tokens.len(),
                    cache: &mut s.cache.layers[layer],
                })
                .collect();
            block.attention_residual(x, &mut chunks).map(Some)
        })
        .collect::<Result<_, _>>()?;
    let inputs = hs
        .iter()
        .map(|h| h.as_ref().map(|h| block.ffn_input(h)).transpose())
        .collect::<Result<_, _>>()?;
    Ok((hs, inputs))
}

/// A dense MLP on every rank's FFN input.
fn dense_ranks(mlp: &impl candle_core::Module, inputs: &[Option<Tensor>]) -> Result<RankTensors> {
    inputs
        .iter()
        .map(|x| x.as_ref().map(|x| mlp.forward(x)).transpose())
        .collect::<Result<_, _>>()
        .map_err(|e| rackfill_models::ModelError::from(e).into())
}

/// The routed experts' output plus the shared experts' (on the FFN input) on every rank with
/// tokens.
fn add_shared_ranks(
    block: &MoeBlock,
    inputs: &[Option<Tensor>],
    routed: RankTensors,
) -> Result<RankTensors> {
    inputs
        .par_iter()
        .zip(routed)
        .map(|(x, routed)| match (x, routed) {
            (Some(x), Some(routed)) => Ok(Some(block.add_shared(x, routed)?)),
            _ => Ok(None),
        })
        .collect()
}

/// The residual stream after a layer: `h + out` on every rank with tokens.
fn add_residual(hs: RankTensors, outs: RankTensors) -> Result<RankTensors> {
    hs.into_iter()
        .zip(outs)
        .map(|(h, out)| match (h, out) {
            (Some(h), Some(out)) => Ok(Some((h + out)?)),
            _ => Ok(None),
        })
        .collect::<Result<_, candle_core::Error>>()
        .map_err(|e| rackfill_models::ModelError::from(e).into())
}

/// The router on every local rank: each rank's FFN input rows and their top-k routing (empty
/// for a rank without tokens).
fn route(
    block: &MoeBlock,
    inputs: &[Option<Tensor>],
    top_k: usize,
) -> Result<Vec<(Vec<f32>, Routing)>> {
    inputs
        .iter()
        .map(|x| match x {
            Some(x) => Ok((rows_of(x)?, block.router.route(x)?)),
            None => Ok((
                Vec::new(),
                Routing {
                    top_k,
                    experts: Vec::new(),
                    weights: Vec::new(),
                },
            )),
        })
        .collect::<Result<_, rackfill_models::ModelError>>()
        .map_err(EngineError::from)
}
