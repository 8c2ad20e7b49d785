//! The bytes of an exported block: exactly what a vLLM 0.33 decode instance of the same model
//! keeps in one block of its KV cache, so its READ lands them where its attention reads them.
//!
//! Every layer is one region of blocks; a block holds `heads` runs of `block_size` rows, and
//! positions past the prompt's end in its last block are zero:
//! - attention with K and V per head (FLASH_ATTN, layout `LBHNC`): `[num_blocks, kv_heads,
//!   block_size, 2 * head_size]`, each row K then V;
//! - multi-head latent attention (DeepSeek-V3): `[num_blocks, block_size, kv_lora_rank +
//!   qk_rope_head_dim]`, each row the normalised latent then the rotated shared key (one
//!   "head").

use candle_core::{DType, Tensor};
use rackfill_models::BlockKv;

use super::error::KvExportError;

/// The element type of the exported KV: the checkpoint's dtype unless configured otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    Bf16,
    F16,
}

impl KvDtype {
    /// From a `config.json` dtype or a flag value (`bfloat16`, `torch.float16`, `fp32`...).
    pub fn parse(name: &str) -> Option<Self> {
        match name.trim_start_matches("torch.") {
            "float32" | "fp32" | "float" => Some(Self::F32),
            "bfloat16" | "bf16" => Some(Self::Bf16),
            "float16" | "fp16" | "half" => Some(Self::F16),
            _ => None,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 | Self::F16 => 2,
        }
    }

    /// The name vLLM's compatibility hash uses (`str(torch.dtype)`).
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "torch.float32",
            Self::Bf16 => "torch.bfloat16",
            Self::F16 => "torch.float16",
        }
    }
}

/// The shape of one exported block, the same in every layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    pub layers: usize,
    /// KV heads (1 for MLA).
    pub heads: usize,
    /// Elements of one token's row in one head: `2 * head_dim` (K then V), or MLA's
    /// `kv_lora_rank + qk_rope_head_dim`.
    pub row: usize,
    /// Whether the rows are MLA's compressed KV.
    pub mla: bool,
    /// Tokens per block (the engine's `--kv-block-tokens`, which a decode's `--block-size`
    /// must equal).
    pub block_tokens: usize,
    pub dtype: KvDtype,
}

impl BlockLayout {
    /// Bytes of one block of one layer.
    pub fn block_bytes(&self) -> usize {
        self.heads * self.block_tokens * self.row * self.dtype.size()
    }

    /// Blocks that hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_tokens)
    }

    /// One layer's rows as the blocks hold them, as pieces `[heads, len, width]` laid side by
    /// side in each row: keys then values per head, or MLA's compressed rows as one head.
    pub fn rows(&self, kv: &BlockKv) -> Result<Vec<Tensor>, KvExportError> {
        if !self.mla {
            return Ok(vec![kv.keys.clone(), kv.values.clone()]);
        }
        let latent = kv.latent.as_ref().ok_or_else(|| {
            KvExportError::Layout("the cache holds no compressed MLA rows".into())
        })?;
        Ok(vec![latent.unsqueeze(0)?])
    }

    /// Writes positions `0..tokens` of one layer's rows (`parts`, see [`BlockLayout::rows`],
    /// each `[heads, len >= tokens, width]`) into `blocks`, one `block_bytes()` slice per block
    /// in order, converting to the export dtype on the way (one read of the cache, no
    /// intermediate tensors).
    pub fn write_layer(
        &self,
        parts: &[Tensor],
        tokens: usize,
        blocks: &mut [&mut [u8]],
    ) -> Result<(), KvExportError> {
        let mut pieces = Vec::with_capacity(parts.len());
        for part in parts {
            let (heads, len, width) = part.dims3()?;
            if heads != self.heads || len < tokens {
                return Err(KvExportError::Layout(format!(
                    "the cache holds [{heads}, {len}, {width}], the export expects [{}, >= \
                     {tokens}, _]",
                    self.heads
                )));
            }
            let values = part
                .narrow(1, 0, tokens)?
                .to_dtype(DType::F32)?
                .contiguous()?
                .flatten_all()?
                .to_vec1::<f32>()?;
            pieces.push((encode(self.dtype, &values), width));
        }
        let row: usize = pieces.iter().map(|(_, width)| width).sum();
        if row != self.row {
            return Err(KvExportError::Layout(format!(
                "rows of {row} values, the export expects {}",
                self.row
            )));
        }
        let size = self.dtype.size();
        for (b, block) in blocks.iter_mut().enumerate() {
            block.fill(0);
            let first = b * self.block_tokens;
            let here = tokens.saturating_sub(first).min(self.block_tokens);
            for h in 0..self.heads {
                for t in 0..here {
                    let mut dst = (h * self.block_tokens + t) * row * size;
                    for (bytes, width) in &pieces {
                        let len = width * size;
                        let src = (h * tokens + first + t) * len;
                        block[dst..dst + len].copy_from_slice(&bytes[src..src + len]);
                        dst += len;
                    }
                }
            }
        }
        Ok(())
    }
}

/// `values` as little-endian `dtype` elements, converted in one pass over the slice.
fn encode(dtype: KvDtype, values: &[f32]) -> Vec<u8> {
    use half::slice::HalfFloatSliceExt;
    match dtype {
        KvDtype::F32 => bytemuck::cast_slice(values).to_vec(),
        KvDtype::Bf16 => {
            let mut out = vec![half::bf16::ZERO; values.len()];
            out.convert_from_f32_slice(values);
            bytemuck::cast_slice(out.reinterpret_cast()).to_vec()
        }
        KvDtype::F16 => {
            let mut out = vec![half::f16::ZERO; values.len()];
            out.convert_from_f32_slice(values);
            bytemuck::cast_slice(out.reinterpret_cast()).to_vec()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn blocks_hold_each_head_then_each_token_k_before_v_and_zeros_past_the_end() {
        let layout = BlockLayout {
            layers: 1,
            heads: 2,
            row: 4,
            mla: false,
            block_tokens: 2,
            dtype: KvDtype::F32,
        };
        // keys[h][t][c] = 100h + 10t + c, values = keys + 1000; three tokens: two blocks.
        let k: Vec<f32> = (0..2)
            .flat_map(|h| {
                (0..3).flat_map(move |t| (0..2).map(move |c| (100 * h + 10 * t + c) as f32))
            })
            .collect();
        let keys = Tensor::from_vec(k.clone(), (2, 3, 2), &Device::Cpu).unwrap();
        let values = (keys.clone() + 1000.0).unwrap();
        let mut a = vec![0xffu8; layout.block_bytes()];
        let mut b = vec![0xffu8; layout.block_bytes()];
        let kv = BlockKv {
            keys,
            values,
            latent: None,
        };
        let rows = layout.rows(&kv).unwrap();
        layout.write_layer(&rows, 3, &mut [&mut a, &mut b]).unwrap();
        let floats = |x: &[u8]| bytemuck::cast_slice::<u8, f32>(x).to_vec();
        assert_eq!(
            floats(&a),
            [
                0., 1., 1000., 1001., 10., 11., 1010., 1011., 100., 101., 1100., 1101., 110., 111.,
                1110., 1111.
            ]
        );
        assert_eq!(
            floats(&b),
            [20., 21., 1020., 1021., 0., 0., 0., 0., 120., 121., 1120., 1121., 0., 0., 0., 0.]
        );
    }

    #[test]
    fn half_precision_blocks_hold_the_rounded_values_little_endian() {
        let layout = BlockLayout {
            layers: 1,
            heads: 1,
            row: 2,
            mla: true,
            block_tokens: 2,
            dtype: KvDtype::Bf16,
        };
        let latent = Tensor::from_vec(vec![1.0f32, -2.0], (1, 1, 2), &Device::Cpu).unwrap();
        let mut block = vec![0xffu8; layout.block_bytes()];
        layout.write_layer(&[latent], 1, &mut [&mut block]).unwrap();
        // bf16 1.0 = 0x3f80, -2.0 = 0xc000; the second position is past the prompt: zero.
        assert_eq!(block, [0x80, 0x3f, 0x00, 0xc0, 0, 0, 0, 0]);
    }

    #[test]
    fn dtypes_parse_from_config_and_flag_spellings() {
        assert_eq!(KvDtype::parse("bfloat16"), Some(KvDtype::Bf16));
        assert_eq!(KvDtype::parse("torch.float16"), Some(KvDtype::F16));
        assert_eq!(KvDtype::parse("float32"), Some(KvDtype::F32));
        assert_eq!(KvDtype::parse("int8"), None);
        assert_eq!(KvDtype::Bf16.torch_name(), "torch.bfloat16");
    }
}
