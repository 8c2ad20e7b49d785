//! [`GpuModel::load`]: a checkpoint's weights from its memory map straight to the device.
//!
//! Every tensor is uploaded once, as stored: a bf16 tensor (or an f32 one the model keeps in
//! f32: routers, DeepSeek's correction bias, Qwen2-MoE's shared-expert gate) byte for byte from
//! the map into its device buffer; an f32 or f16 tensor into a device staging buffer, converted
//! to bf16 there (`convert.cu`); a block-quantized FP8 tensor with its f32 block scales,
//! dequantized to bf16 there. The host holds no converted copy: what a load costs in host
//! memory is the pages of the map the copies read (file-backed, dropped under pressure), not a
//! model in f32.
//!
//! Routed experts go where [`ExpertPlacement`] says: inside the model (every one, for
//! [`GpuModel::forward`]), or each local rank's home experts written in place in the
//! [`HomeExperts`] an EP data plane runs from (no other expert read), or nowhere.
//!
//! The checkpoint names are the CPU loaders' (`families/`): the MoE block's prefix and part names
//! come from the same per-family table ([`crate::families::FamilyLoader::moe_names`]), fused
//! (`experts.gate_up_proj`) or per-expert layouts alike.

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::Arc;

use rackfill_balancer::Layout;
use rackfill_kernels::cuda::exec::{DType, DeviceBuffer, Executor, ExecutorExt};
use rackfill_kernels::cuda::local_experts::LocalExperts;
use rackfill_kernels::cuda::moe::HomeExperts;

use super::model::{check_kernel_limits, GpuModel};
use super::ops::{ConvertFrom, DeviceWeight, Ops, RopeTables};
use super::weights::{
    Experts, GpuAttention, GpuFfn, GpuGqa, GpuLayer, GpuLinear, GpuMla, GpuMlp, GpuMoe, GpuNorm,
    GpuWeights,
};
use crate::checkpoint::{Checkpoint, Dtype, RawTensor, Weights};
use crate::config::{ModelConfig, RouterKind};
use crate::error::{ModelError, Result};
use crate::families::deepseek_v3::{softmax_scale, LATENT_NORM_EPS};
use crate::layers::moe::MoeNames;
use crate::layers::rope::Rope;
use crate::layers::MlpNames;

/// Which routed experts [`GpuModel::load`] uploads, and where.
#[derive(Debug, Clone)]
pub enum ExpertPlacement<'a> {
    /// Every expert, inside the model, for its own [`GpuModel::forward`] (the single-device
    /// reference).
    Here,
    /// The home experts of the local ranks `local` of `layout` (`layout.main_experts(rank)`),
    /// each written in place at its offset in the returned [`HomeExperts`] (one buffer per local
    /// rank, in order) for an EP data plane; the model holds none, and no other expert is read.
    Homes {
        layout: &'a Layout,
        local: Range<usize>,
    },
    /// None: an EP data plane elsewhere (another process, the host) holds them.
    Elsewhere,
}

impl GpuModel {
    /// Uploads the model `config` describes from `checkpoint` to `exec`, with a paged KV cache
    /// of `kv_tokens` tokens (rounded up to whole blocks) in every layer, and its routed experts
    /// as `experts` says: the home experts of [`ExpertPlacement::Homes`] come back beside the
    /// model. Every tensor is read once from the checkpoint's map and converted (to bf16, or f32
    /// for the routers) on the device; no copy of the model is made in host memory.
    pub fn load(
        exec: Arc<dyn Executor>,
        config: &ModelConfig,
        checkpoint: &Checkpoint,
        kv_tokens: usize,
        experts: ExpertPlacement<'_>,
    ) -> Result<(GpuModel, Option<HomeExperts>)> {
        check_kernel_limits(config)?;
        checkpoint.set_quantization(config.quantization.as_ref());
        let moe_layers = config.num_sparse_layers();
        let (hidden, inter) = (config.hidden_size, config.moe.intermediate_size);
        let (homes, local_experts) = match &experts {
            ExpertPlacement::Homes { layout, local } => {
                if layout.experts() != config.moe.num_experts {
                    return Err(ModelError::Input(format!(
                        "an EP layout of {} experts for a model of {}",
                        layout.experts(),
                        config.moe.num_experts
                    )));
                }
                let homes = HomeExperts::allocate(
                    exec.as_ref(),
                    layout,
                    local.clone(),
                    moe_layers,
                    (hidden, inter),
                )?;
                let mine = local
                    .clone()
                    .flat_map(|rank| layout.main_experts(rank).iter().copied())
                    .collect();
                (Some(homes), mine)
            }
            ExpertPlacement::Here | ExpertPlacement::Elsewhere => (None, BTreeSet::new()),
        };
        let loader = Loader {
            exec: exec.as_ref(),
            ops: Ops {
                exec: exec.as_ref(),
            },
            config,
        };
        let root = checkpoint.root();
        let model = root.pp("model");
        let (vocab, eps) = (config.vocab_size, config.rms_norm_eps);
        let embed = loader.weight(&model.pp("embed_tokens"), [vocab, hidden], DType::Bf16)?;
        let mut moe_index = 0;
        let layers = (0..config.num_layers)
            .map(|i| {
                let w = model.pp("layers").pp(i);
                let ffn = if config.sparse_layers[i] {
                    let routed = match (&experts, homes.as_ref()) {
                        (ExpertPlacement::Here, _) => RoutedPlacement::Here,
                        (ExpertPlacement::Homes { layout, local }, Some(homes)) => {
                            RoutedPlacement::Homes {
                                layout,
                                local: local.clone(),
                                homes,
                                layer: moe_index,
                                mine: &local_experts,
                            }
                        }
                        _ => RoutedPlacement::Nowhere,
                    };
                    moe_index += 1;
                    GpuFfn::Moe(Box::new(loader.moe(&w, routed)?))
                } else {
                    // Every family's dense layers: `families::shared::dense_mlp`'s names.
                    let mlp = loader.mlp(&w.pp("mlp"), config.intermediate_size, MlpNames::HF)?;
                    GpuFfn::Dense(mlp)
                };
                Ok(GpuLayer {
                    input_norm: loader.norm(&w.pp("input_layernorm"), hidden, eps)?,
                    attention: loader.attention(&w.pp("self_attn"))?,
                    post_norm: loader.norm(&w.pp("post_attention_layernorm"), hidden, eps)?,
                    ffn,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = loader.norm(&model.pp("norm"), hidden, eps)?;
        // Tied embeddings: the embedding serves as the LM head, uploaded once.
        let lm_head = if config.tie_word_embeddings && !root.contains("lm_head.weight") {
            None
        } else {
            Some(loader.weight(&root.pp("lm_head"), [vocab, hidden], DType::Bf16)?)
        };
        checkpoint.warn_unused(config);
        let weights = GpuWeights {
            embed,
            layers,
            norm,
            lm_head,
        };
        let held = match experts {
            ExpertPlacement::Here => Experts::Here,
            ExpertPlacement::Homes { .. } | ExpertPlacement::Elsewhere => Experts::Elsewhere,
        };
        let model = GpuModel::new(exec, config.clone(), weights, kv_tokens, held)?;
        Ok((model, homes))
    }
}

/// Where one MoE layer's routed experts go.
enum RoutedPlacement<'a> {
    Here,
    Homes {
        layout: &'a Layout,
        local: Range<usize>,
        homes: &'a HomeExperts,
        /// The layer's index among the MoE layers.
        layer: usize,
        /// Every local rank's home experts.
        mine: &'a BTreeSet<u32>,
    },
    Nowhere,
}

/// Uploads tensors from the checkpoint into device buffers.
struct Loader<'a> {
    exec: &'a dyn Executor,
    ops: Ops<'a>,
    config: &'a ModelConfig,
}

impl Loader<'_> {
    /// Writes `raw`'s values as `to` into `dst` from byte `offset`: byte for byte from the map
    /// when it is stored as `to`, else its stored bytes into a staging buffer and converted
    /// there (f32 and f16 rounded to bf16, bf16 widened to f32, FP8 dequantized by its block
    /// scales); a synthetic tensor's values generated in place.
    fn fill(
        &self,
        raw: &RawTensor<'_>,
        dst: &DeviceBuffer,
        offset: usize,
        to: DType,
    ) -> Result<()> {
        let n = raw.elements();
        if offset + n * to.size() > dst.bytes() {
            return Err(ModelError::Input(format!(
                "{n} values at byte {offset} of a {}-byte device buffer",
                dst.bytes()
            )));
        }
        if let Some(values) = raw.synthetic {
            self.ops.fill_synthetic(values, n, dst.at(offset), to)?;
            return Ok(());
        }
        let from = match (raw.dtype, to) {
            (Dtype::BF16, DType::Bf16) | (Dtype::F32, DType::F32) => {
                self.exec.write(dst, offset, raw.bytes)?;
                return Ok(());
            }
            (Dtype::F32, _) => ConvertFrom::F32,
            (Dtype::BF16, _) => ConvertFrom::Bf16,
            (Dtype::F16, _) => ConvertFrom::F16,
            (Dtype::F8_E4M3, _) => return self.dequantize(raw, dst, offset, to),
            (other, _) => {
                return Err(ModelError::Input(format!(
                    "a tensor of dtype {other:?} (the checkpoint refuses those)"
                )))
            }
        };
        // The staging buffer is freed in the stream's order, after the conversion has read it.
        let staging = self.exec.upload(raw.bytes)?;
        self.ops
            .convert(staging.ptr(), from, n, dst.at(offset), to)?;
        Ok(())
    }

    /// An FP8 tensor's bytes and block scales staged on the device and dequantized into `dst`.
    fn dequantize(
        &self,
        raw: &RawTensor<'_>,
        dst: &DeviceBuffer,
        offset: usize,
        to: DType,
    ) -> Result<()> {
        let scales = raw.scales.ok_or_else(|| {
            ModelError::Input("an F8_E4M3 tensor without its block scales".into())
        })?;
        let (matrices, rows, cols) = raw.matrices();
        let [br, bc] = scales.block;
        let per_matrix = rows.div_ceil(br) * cols.div_ceil(bc);
        let values = self.exec.upload(raw.bytes)?;
        let factors = self.exec.upload(scales.bytes)?;
        for m in 0..matrices {
            self.ops.dequant_fp8(
                values.at(m * rows * cols),
                factors.at(m * per_matrix * 4),
                (rows, cols),
                scales.block,
                dst.at(offset + m * rows * cols * to.size()),
                to,
            )?;
        }
        Ok(())
    }

    /// A new device buffer holding `raw` as `to`.
    fn buffer(&self, raw: &RawTensor<'_>, to: DType) -> Result<DeviceBuffer> {
        let buffer = self.exec.alloc_zeroed(raw.elements() * to.size())?;
        self.fill(raw, &buffer, 0, to)?;
        Ok(buffer)
    }

    /// `w.weight` `[out, in]` as `to`.
    fn weight(&self, w: &Weights<'_>, [out, inp]: [usize; 2], to: DType) -> Result<DeviceWeight> {
        let raw = w.raw(&[out, inp], "weight")?;
        Ok(DeviceWeight {
            buffer: self.buffer(&raw, to)?,
            dtype: to,
            out_dim: out,
            in_dim: inp,
        })
    }

    /// A linear layer `w` from `inp` to `out` (with `w.bias` when `bias`), bf16.
    fn linear(&self, w: &Weights<'_>, inp: usize, out: usize, bias: bool) -> Result<GpuLinear> {
        Ok(GpuLinear {
            weight: self.weight(w, [out, inp], DType::Bf16)?,
            bias: bias
                .then(|| self.buffer(&w.raw(&[out], "bias")?, DType::Bf16))
                .transpose()?,
        })
    }

    /// An RMSNorm `w.weight` `[dim]`, bf16.
    fn norm(&self, w: &Weights<'_>, dim: usize, eps: f64) -> Result<GpuNorm> {
        Ok(GpuNorm {
            weight: self.buffer(&w.raw(&[dim], "weight")?, DType::Bf16)?,
            eps: eps as f32,
        })
    }

    /// A gated MLP `w.{gate, up, down}` of width `inter`: gate's rows then up's in one
    /// `[2I, H]` buffer, down `[H, I]`.
    fn mlp(&self, w: &Weights<'_>, inter: usize, names: MlpNames) -> Result<GpuMlp> {
        let h = self.config.hidden_size;
        let gate_up = self.exec.alloc_zeroed(2 * inter * h * 2)?;
        let down = self.exec.alloc_zeroed(h * inter * 2)?;
        self.fill_mlp(w, inter, names, (&gate_up, 0), (&down, 0))?;
        Ok(self.mlp_of(gate_up, down, inter))
    }

    fn mlp_of(&self, gate_up: DeviceBuffer, down: DeviceBuffer, inter: usize) -> GpuMlp {
        let h = self.config.hidden_size;
        GpuMlp {
            gate_up: DeviceWeight {
                buffer: gate_up,
                dtype: DType::Bf16,
                out_dim: 2 * inter,
                in_dim: h,
            },
            down: DeviceWeight {
                buffer: down,
                dtype: DType::Bf16,
                out_dim: h,
                in_dim: inter,
            },
        }
    }

    /// Writes MLP `w`'s bf16 gate and up rows at `gate_up` (a buffer, a byte offset) and its
    /// down rows at `down`.
    fn fill_mlp(
        &self,
        w: &Weights<'_>,
        inter: usize,
        names: MlpNames,
        gate_up: (&DeviceBuffer, usize),
        down: (&DeviceBuffer, usize),
    ) -> Result<()> {
        let h = self.config.hidden_size;
        let gate = w.pp(names.gate).raw(&[inter, h], "weight")?;
        let up = w.pp(names.up).raw(&[inter, h], "weight")?;
        let down_raw = w.pp(names.down).raw(&[h, inter], "weight")?;
        self.fill(&gate, gate_up.0, gate_up.1, DType::Bf16)?;
        self.fill(&up, gate_up.0, gate_up.1 + inter * h * 2, DType::Bf16)?;
        self.fill(&down_raw, down.0, down.1, DType::Bf16)
    }

    /// Routed expert `e` of the block's `experts` (per-expert tensors, or slices of fused
    /// ones) written at `gate_up` and `down`.
    fn fill_expert(
        &self,
        experts: &Weights<'_>,
        names: MlpNames,
        e: usize,
        gate_up: (&DeviceBuffer, usize),
        down: (&DeviceBuffer, usize),
    ) -> Result<()> {
        let (n, h, i) = self.expert_dims();
        if experts.contains("gate_up_proj") {
            let fused = experts.raw_index(&[n, 2 * i, h], "gate_up_proj", e)?;
            let down_raw = experts.raw_index(&[n, h, i], "down_proj", e)?;
            self.fill(&fused, gate_up.0, gate_up.1, DType::Bf16)?;
            self.fill(&down_raw, down.0, down.1, DType::Bf16)
        } else {
            self.fill_mlp(&experts.pp(e), i, names, gate_up, down)
        }
    }

    /// Checks routed expert `e`'s tensors in the header without reading them (another
    /// process's, or a data plane's elsewhere).
    fn skip_expert(&self, experts: &Weights<'_>, names: MlpNames, e: usize) -> Result<()> {
        let (n, h, i) = self.expert_dims();
        if experts.contains("gate_up_proj") {
            experts.skip(&[n, 2 * i, h], "gate_up_proj")?;
            return experts.skip(&[n, h, i], "down_proj");
        }
        let w = experts.pp(e);
        for (name, shape) in [
            (names.gate, [i, h]),
            (names.up, [i, h]),
            (names.down, [h, i]),
        ] {
            w.pp(name).skip(&shape, "weight")?;
        }
        Ok(())
    }

    /// `(E, H, I)` of the routed experts.
    fn expert_dims(&self) -> (usize, usize, usize) {
        let c = self.config;
        (c.moe.num_experts, c.hidden_size, c.moe.intermediate_size)
    }

    /// A layer's MoE block (below the layer's weights `w`): router (f32), correction bias,
    /// shared experts and their gate, and the routed experts as `routed` says.
    fn moe(&self, w: &Weights<'_>, routed: RoutedPlacement<'_>) -> Result<GpuMoe> {
        let c = self.config;
        let (n, h, inter) = self.expert_dims();
        let (block, names): (Weights<'_>, MoeNames) =
            (crate::families::loader(c.family).moe_names)(w);
        let gate = block.pp("gate");
        let router = self.weight(&gate, [n, h], DType::F32)?;
        let correction_bias = match c.moe.router {
            RouterKind::SigmoidGrouped { .. } => {
                Some(self.buffer(&gate.raw(&[n], "e_score_correction_bias")?, DType::F32)?)
            }
            RouterKind::SoftmaxTopK { .. } => None,
        };
        let (shared, shared_gate) = match &c.moe.shared {
            Some(s) => (
                Some(self.mlp(&block.pp(names.shared), s.intermediate_size, MlpNames::HF)?),
                s.gated
                    .then(|| self.weight(&block.pp(names.shared_gate), [1, h], DType::F32))
                    .transpose()?,
            ),
            None => (None, None),
        };
        let experts_w = block.pp("experts");
        let experts = match routed {
            RoutedPlacement::Here => (0..n)
                .map(|e| {
                    let gate_up = self.exec.alloc_zeroed(2 * inter * h * 2)?;
                    let down = self.exec.alloc_zeroed(h * inter * 2)?;
                    self.fill_expert(&experts_w, names.experts, e, (&gate_up, 0), (&down, 0))?;
                    Ok(self.mlp_of(gate_up, down, inter))
                })
                .collect::<Result<Vec<_>>>()?,
            RoutedPlacement::Homes {
                layout,
                local,
                homes,
                layer,
                mine,
            } => {
                for e in (0..n).filter(|e| !mine.contains(&(*e as u32))) {
                    self.skip_expert(&experts_w, names.experts, e)?;
                }
                let gate_up_bytes = 2 * inter * h * 2;
                for (index, rank) in local.enumerate() {
                    for &e in layout.main_experts(rank) {
                        let at = homes.offsets[layer][e as usize] as usize;
                        let buffer = &homes.buffers[index];
                        self.fill_expert(
                            &experts_w,
                            names.experts,
                            e as usize,
                            (buffer, at),
                            (buffer, at + gate_up_bytes),
                        )?;
                    }
                }
                Vec::new()
            }
            RoutedPlacement::Nowhere => {
                for e in 0..n {
                    self.skip_expert(&experts_w, names.experts, e)?;
                }
                Vec::new()
            }
        };
        let pointers: Vec<(u64, u64)> = experts
            .iter()
            .map(|m| (m.gate_up.buffer.ptr(), m.down.buffer.ptr()))
            .collect();
        let local = match pointers.is_empty() {
            true => None,
            false => Some(LocalExperts::upload(self.exec, &pointers, (h, inter))?),
        };
        Ok(GpuMoe {
            router,
            correction_bias,
            kind: c.moe.router.clone(),
            top_k: c.moe.top_k,
            experts,
            local,
            shared,
            shared_gate,
        })
    }

    fn rope(&self, rope: &Rope) -> Result<RopeTables> {
        Ok(RopeTables {
            inv_freq: self.exec.upload_f32(rope.inv_freq())?,
            rot_dim: 2 * rope.inv_freq().len(),
            attention_factor: rope.attention_factor(),
            interleaved: rope.interleaved(),
        })
    }

    /// A layer's attention below `self_attn` (`w`): GQA, or DeepSeek's latent attention.
    fn attention(&self, w: &Weights<'_>) -> Result<GpuAttention> {
        let c = self.config;
        let (hidden, heads) = (c.hidden_size, c.num_heads);
        let Some(dims) = &c.mla else {
            let (kv_heads, d) = (c.num_kv_heads, c.head_dim);
            let bias = c.attention_bias;
            let norm = |name: &str| self.norm(&w.pp(name), d, c.rms_norm_eps);
            return Ok(GpuAttention::Gqa(Box::new(GpuGqa {
                q: self.linear(&w.pp("q_proj"), hidden, heads * d, bias)?,
                k: self.linear(&w.pp("k_proj"), hidden, kv_heads * d, bias)?,
                v: self.linear(&w.pp("v_proj"), hidden, kv_heads * d, bias)?,
                o: self.linear(&w.pp("o_proj"), heads * d, hidden, c.attention_out_bias)?,
                q_norm: c.qk_norm.then(|| norm("q_norm")).transpose()?,
                k_norm: c.qk_norm.then(|| norm("k_norm")).transpose()?,
                rope: self.rope(&Rope::new(&c.rope, d, false))?,
                heads,
                kv_heads,
                head_dim: d,
            })));
        };
        // The names and shapes of `families::deepseek_v3`'s attention loader.
        let bias = c.attention_bias;
        let qk_head = dims.qk_nope_head_dim + dims.qk_rope_head_dim;
        let (q_direct, q_low_rank) = match dims.q_lora_rank {
            None => (
                Some(self.linear(&w.pp("q_proj"), hidden, heads * qk_head, false)?),
                None,
            ),
            Some(rank) => (
                None,
                Some((
                    self.linear(&w.pp("q_a_proj"), hidden, rank, bias)?,
                    self.norm(&w.pp("q_a_layernorm"), rank, LATENT_NORM_EPS)?,
                    self.linear(&w.pp("q_b_proj"), rank, heads * qk_head, false)?,
                )),
            ),
        };
        let lora = dims.kv_lora_rank;
        Ok(GpuAttention::Mla(Box::new(GpuMla {
            q_direct,
            q_low_rank,
            kv_a: self.linear(
                &w.pp("kv_a_proj_with_mqa"),
                hidden,
                lora + dims.qk_rope_head_dim,
                bias,
            )?,
            kv_norm: self.norm(&w.pp("kv_a_layernorm"), lora, LATENT_NORM_EPS)?,
            kv_b: self.linear(
                &w.pp("kv_b_proj"),
                lora,
                heads * (dims.qk_nope_head_dim + dims.v_head_dim),
                false,
            )?,
            o: self.linear(&w.pp("o_proj"), heads * dims.v_head_dim, hidden, bias)?,
            rope: self.rope(&Rope::new(
                &c.rope,
                dims.qk_rope_head_dim,
                dims.rope_interleave,
            ))?,
            heads,
            kv_lora: lora,
            nope: dims.qk_nope_head_dim,
            rot: dims.qk_rope_head_dim,
            v_dim: dims.v_head_dim,
            scale: softmax_scale(c, dims) as f32,
        })))
    }
}
