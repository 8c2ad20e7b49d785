//! The launch geometry of the flash attention kernels (`kernels/cuda/attention.cu`): a layer's
//! head shape ([`AttentionShape`]), the compiled tile shapes ([`FlashTiles`]) and the default for
//! a head shape within a device's shared memory, grids, shared memory, and causal attention's
//! FLOPs. Pure Rust, shared by the whole-model path, its tests and `rackfill bench attention`.

use crate::kv_blocks::{PagedError, StepArrays};

/// Threads per block of the flash attention kernels (four warps; `kv_write` takes any block
/// size).
pub const ATTENTION_THREADS: u32 = 128;

/// Query vectors (one query row of one head) per flash attention block: the kernel's
/// `FLASH_ROWS`, 16 per warp.
const FLASH_ROWS: u32 = 64;

/// bf16 padding per shared row: the kernel's `FLASH_PAD`.
const FLASH_PAD: u32 = 8;

/// The tile shape of one flash attention kernel (`flash_attention_k{keys}_v{v_cols}` in
/// attention.cu): keys per shared-memory tile and value columns per block. Wider tiles reuse
/// each query fragment over more keys; narrower value tiles keep the accumulators in
/// registers for wide value heads (MLA's 512 columns take two `v256` blocks, each recomputing
/// the scores) and leave shared memory for more blocks per SM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashTiles {
    pub keys: u32,
    pub v_cols: u32,
}

impl FlashTiles {
    /// Every compiled tile shape, in the order the default prefers them for a value head that
    /// fits: `k32_v128` before `k64_v128`, measured 1.3x faster from 1k tokens on an H200
    /// (docs/gpu.md).
    pub const ALL: [Self; 4] = [
        Self {
            keys: 64,
            v_cols: 64,
        },
        Self {
            keys: 32,
            v_cols: 128,
        },
        Self {
            keys: 64,
            v_cols: 128,
        },
        Self {
            keys: 32,
            v_cols: 256,
        },
    ];

    /// The kernel's entry point.
    pub fn kernel(&self) -> String {
        format!("flash_attention_k{}_v{}", self.keys, self.v_cols)
    }

    /// The default tiles for `shape` within `shared_limit` bytes of shared memory per block:
    /// the first of [`Self::ALL`] whose value tile covers the head in one block (else the
    /// widest), falling back to any that fits.
    pub fn choose(shape: &AttentionShape, shared_limit: usize) -> Result<Self, PagedError> {
        let fits = |t: &Self| shape.shared_bytes(*t) as usize <= shared_limit;
        Self::ALL
            .iter()
            .find(|t| t.v_cols >= shape.v_dim && fits(t))
            .or_else(|| Self::ALL.iter().rev().find(|t| fits(t)))
            .copied()
            .ok_or(PagedError::SharedMemory {
                qk_dim: shape.qk_dim,
                v_dim: shape.v_dim,
                limit: shared_limit,
            })
    }
}

impl std::fmt::Display for FlashTiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "k{}_v{}", self.keys, self.v_cols)
    }
}

/// One layer's attention heads as the flash attention kernels see them. GQA: `qk_dim = v_dim
/// = head_dim`. DeepSeek MLA, absorbed: `kv_heads` 1, `qk_dim = kv_lora_rank +
/// qk_rope_head_dim`, `v_dim = kv_lora_rank` (V read out of the latent cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub q_heads: u32,
    pub kv_heads: u32,
    pub qk_dim: u32,
    pub v_dim: u32,
}

impl AttentionShape {
    /// Checks what the kernels assume: positive dimensions, query heads a multiple of the KV
    /// heads, head widths a multiple of 8 (rows move in 16-byte pieces).
    pub fn check(&self) -> Result<(), PagedError> {
        for (what, value) in [
            ("q_heads", self.q_heads),
            ("kv_heads", self.kv_heads),
            ("qk_dim", self.qk_dim),
            ("v_dim", self.v_dim),
        ] {
            if value == 0 {
                return Err(PagedError::ZeroDimension { what });
            }
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(PagedError::UnevenGroups {
                q_heads: self.q_heads,
                kv_heads: self.kv_heads,
            });
        }
        for (what, value) in [("qk_dim", self.qk_dim), ("v_dim", self.v_dim)] {
            if !value.is_multiple_of(8) {
                return Err(PagedError::Unaligned { what, value });
            }
        }
        Ok(())
    }

    /// The flash kernel's grid for `step` with `tiles`: (query-vector tiles of the longest
    /// chunk, KV heads x value-column blocks, sequences). A step of no sequence has nothing to
    /// launch.
    pub fn grid(&self, tiles: FlashTiles, step: &StepArrays) -> [u32; 3] {
        let vectors = step.max_q_len() * (self.q_heads / self.kv_heads);
        [
            vectors.div_ceil(FLASH_ROWS).max(1),
            self.kv_heads * self.v_dim.div_ceil(tiles.v_cols),
            step.q_len.len() as u32,
        ]
    }

    /// The flash kernel's dynamic shared memory with `tiles`: the block's queries and two
    /// stages of key and value tiles, rows padded (bf16).
    pub fn shared_bytes(&self, tiles: FlashTiles) -> u32 {
        let qk_row = self.qk_dim.div_ceil(16) * 16 + FLASH_PAD;
        let v_row = tiles.v_cols + FLASH_PAD;
        let elements = (FLASH_ROWS + 2 * tiles.keys) * qk_row + 2 * tiles.keys * v_row;
        elements.saturating_mul(2)
    }

    /// Multiply-adds of causal attention over `step` (scores and values, masked keys not
    /// counted), times two: the FLOPs figures of merit count.
    pub fn causal_flops(&self, step: &StepArrays) -> f64 {
        let pairs: f64 = step
            .q_len
            .iter()
            .zip(&step.ctx_len)
            .map(|(&n, &ctx)| {
                let (n, ctx) = (f64::from(n), f64::from(ctx));
                n * ctx + n * (n + 1.0) / 2.0
            })
            .sum();
        2.0 * pairs * f64::from(self.q_heads) * f64::from(self.qk_dim + self.v_dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_blocks::{BlockPool, BlockTable};

    #[test]
    fn attention_shapes_are_checked_and_sized() {
        let deepseek = AttentionShape {
            q_heads: 128,
            kv_heads: 1,
            qk_dim: 576,
            v_dim: 512,
        };
        deepseek.check().unwrap();
        let wide = FlashTiles {
            keys: 32,
            v_cols: 256,
        };
        // Queries and two stages of 32 keys, rows of 576 + 8; two stages of 256 + 8 values.
        assert_eq!(
            deepseek.shared_bytes(wide),
            2 * ((64 + 64) * 584 + 64 * 264)
        );
        let mut pool = BlockPool::new(16, 16).unwrap();
        let (mut a, mut b) = (BlockTable::new(), BlockTable::new());
        let step = StepArrays::prepare(&mut pool, &mut [(&mut a, 3), (&mut b, 1)]).unwrap();
        // 3 rows x 128 heads = 384 vectors: 6 blocks of 64; 512 values: 2 blocks of 256.
        assert_eq!(deepseek.grid(wide, &step), [6, 2, 2]);
        let gqa = AttentionShape {
            q_heads: 4,
            kv_heads: 2,
            qk_dim: 128,
            v_dim: 128,
        };
        assert_eq!(gqa.grid(FlashTiles::ALL[1], &step), [1, 2, 2]);
        for bad in [
            AttentionShape { q_heads: 5, ..gqa },
            AttentionShape { kv_heads: 0, ..gqa },
            AttentionShape { v_dim: 132, ..gqa },
            AttentionShape { qk_dim: 20, ..gqa },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_default_tiles_cover_the_value_head_within_shared_memory() {
        let shape = |qk_dim, v_dim| AttentionShape {
            q_heads: 8,
            kv_heads: 1,
            qk_dim,
            v_dim,
        };
        let choose = |s: AttentionShape, limit| FlashTiles::choose(&s, limit).unwrap().to_string();
        let h100 = 227 * 1024;
        assert_eq!(choose(shape(64, 64), h100), "k64_v64");
        assert_eq!(choose(shape(128, 128), h100), "k32_v128");
        assert_eq!(choose(shape(576, 512), h100), "k32_v256");
        // Less shared memory: DeepSeek's latent falls back to narrower value tiles.
        assert_eq!(choose(shape(576, 512), 170 * 1024), "k32_v128");
        assert!(matches!(
            FlashTiles::choose(&shape(576, 512), 48 * 1024),
            Err(PagedError::SharedMemory { .. })
        ));
    }

    #[test]
    fn the_launch_constants_are_the_kernels() {
        let source = include_str!("../cuda/attention.cu");
        for (name, value) in [("FLASH_ROWS", FLASH_ROWS), ("FLASH_PAD", FLASH_PAD)] {
            let define = format!("#define {name} {value}u");
            assert!(source.contains(&define), "attention.cu lacks `{define}`");
        }
        assert!(source.contains(&format!("#define FLASH_THREADS {ATTENTION_THREADS}")));
        for tiles in FlashTiles::ALL {
            let entry = format!(
                "{}(FLASH_ARGS) {{\n    flash_attention<{}, {}>",
                tiles.kernel(),
                tiles.keys,
                tiles.v_cols
            );
            assert!(source.contains(&entry), "attention.cu lacks `{entry}`");
        }
    }
}
