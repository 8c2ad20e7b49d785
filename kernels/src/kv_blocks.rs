//! The host side of the paged KV cache (whole-model path): which cache blocks a sequence owns,
//! and the per-step arrays the attention kernels (`kernels/cuda/attention.cu`) read; their launch
//! geometry is [`crate::flash`]'s.
//!
//! The device cache of one layer is `[num_blocks, block_size, kv_heads, head_dim]` bf16. A
//! sequence's tokens live in fixed-size blocks listed by its [`BlockTable`]; a sequence grows by
//! taking one more block from the [`BlockPool`] when its last block is full, so it never copies
//! what it has cached, and a finished sequence hands its blocks back for the next one. Token `t`
//! of a sequence sits at *slot* `table[t / block_size] * block_size + t % block_size`.
//!
//! Pure Rust: what a step needs is decided here on the CPU, then uploaded with the step.

/// Marks the unused entries of a padded block-table row: the kernels never read past a
/// sequence's tokens, and a bad index would fault rather than read another sequence's keys.
pub const NO_BLOCK: u32 = u32::MAX;

/// A slot-mapping entry `kv_write` skips: a row of the step that caches nothing (padding).
pub const NO_SLOT: u32 = u32::MAX;

/// Why the cache refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PagedError {
    #[error("the KV cache is full: {needed} more blocks are needed, {free} are free")]
    Exhausted { needed: usize, free: usize },
    #[error("{what} must be positive")]
    ZeroDimension { what: &'static str },
    #[error("{what} {value} does not fit the kernels' 32-bit indices")]
    TooLarge { what: &'static str, value: u64 },
    #[error("{q_heads} query heads do not split evenly over {kv_heads} KV heads")]
    UnevenGroups { q_heads: u32, kv_heads: u32 },
    #[error("block {block} is not an allocated block of this pool ({capacity} blocks)")]
    NotAllocated { block: u32, capacity: u32 },
    #[error("{what} {value} is not a multiple of 8 (the attention kernels move 16-byte pieces)")]
    Unaligned { what: &'static str, value: u32 },
    #[error(
        "no flash attention tile fits {qk_dim}/{v_dim}-wide heads in {limit} bytes of shared \
         memory per block"
    )]
    SharedMemory {
        qk_dim: u32,
        v_dim: u32,
        limit: usize,
    },
}

/// The cache's blocks and which of them are free.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: u32,
    /// Free block ids, the next to hand out last: a block freed by a finished sequence is the
    /// first reused (its cache lines are the likeliest still in L2).
    free: Vec<u32>,
    allocated: Vec<bool>,
}

impl BlockPool {
    /// `num_blocks` blocks of `block_size` tokens. Every slot index (`num_blocks * block_size`)
    /// must fit a u32, the kernels' slot type.
    pub fn new(num_blocks: u32, block_size: u32) -> Result<Self, PagedError> {
        if block_size == 0 {
            return Err(PagedError::ZeroDimension { what: "block_size" });
        }
        let slots = u64::from(num_blocks) * u64::from(block_size);
        if slots > u64::from(u32::MAX) {
            return Err(PagedError::TooLarge {
                what: "the cache's slot count",
                value: slots,
            });
        }
        Ok(Self {
            block_size,
            free: (0..num_blocks).rev().collect(),
            allocated: vec![false; num_blocks as usize],
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Blocks in the pool, free or not.
    pub fn capacity(&self) -> u32 {
        self.allocated.len() as u32
    }

    /// Blocks not owned by any sequence.
    pub fn free_blocks(&self) -> u32 {
        self.free.len() as u32
    }

    /// Takes a free block.
    pub fn allocate(&mut self) -> Result<u32, PagedError> {
        let block = self
            .free
            .pop()
            .ok_or(PagedError::Exhausted { needed: 1, free: 0 })?;
        self.allocated[block as usize] = true;
        Ok(block)
    }

    /// Returns `block` to the free list; a block that is not allocated (a double free) is
    /// refused, since handing it out twice would let two sequences overwrite each other.
    pub fn free(&mut self, block: u32) -> Result<(), PagedError> {
        match self.allocated.get_mut(block as usize) {
            Some(owned @ true) => {
                *owned = false;
                self.free.push(block);
                Ok(())
            }
            _ => Err(PagedError::NotAllocated {
                block,
                capacity: self.capacity(),
            }),
        }
    }

    /// Blocks needed to hold `tokens` tokens.
    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size as usize)
    }
}

/// One sequence's blocks, in token order, and how many tokens they hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
    tokens: usize,
}

impl BlockTable {
    /// An empty table: the sequence owns no block yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Tokens cached (or reserved by [`Self::append`]) so far.
    pub fn len(&self) -> usize {
        self.tokens
    }

    /// Whether the sequence holds no token.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// The block ids, in token order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Blocks more that `n` new tokens need: only once the last block is full does the
    /// sequence take another.
    fn blocks_needed(&self, pool: &BlockPool, n: usize) -> usize {
        pool.blocks_for(self.tokens + n) - self.blocks.len()
    }

    /// Reserves room for `n` more tokens, taking blocks from `pool` as needed. On
    /// [`PagedError::Exhausted`] nothing is taken.
    pub fn append(&mut self, pool: &mut BlockPool, n: usize) -> Result<(), PagedError> {
        let needed = self.blocks_needed(pool, n);
        if needed > pool.free.len() {
            return Err(PagedError::Exhausted {
                needed,
                free: pool.free.len(),
            });
        }
        for _ in 0..needed {
            self.blocks.push(pool.allocate()?);
        }
        self.tokens += n;
        Ok(())
    }

    /// The cache slot of token `position` (which must be below [`Self::len`]).
    pub fn slot(&self, position: usize, block_size: u32) -> u32 {
        let size = block_size as usize;
        self.blocks[position / size] * block_size + (position % size) as u32
    }

    /// Hands every block back to `pool`: the sequence ended.
    pub fn release(&mut self, pool: &mut BlockPool) -> Result<(), PagedError> {
        for block in self.blocks.drain(..) {
            pool.free(block)?;
        }
        self.tokens = 0;
        Ok(())
    }
}

/// The arrays one attention step uploads for a batch of sequences, in batch order: sequence
/// `s` has `ctx_len[s]` tokens cached before the step and `q_len[s]` new tokens whose rows are
/// `q_start[s]..q_start[s] + q_len[s]` of the step's matrix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepArrays {
    /// `kv_write`'s slot of every new token row.
    pub slot_mapping: Vec<u32>,
    /// `[seqs, max_blocks]`, each sequence's blocks then [`NO_BLOCK`].
    pub block_tables: Vec<u32>,
    /// Row length of `block_tables`.
    pub max_blocks: u32,
    pub q_start: Vec<u32>,
    pub q_len: Vec<u32>,
    pub ctx_len: Vec<u32>,
}

impl StepArrays {
    /// Grows each `(table, new tokens)` of the batch and lays out the step's arrays. The whole
    /// batch's blocks are checked up front: on [`PagedError::Exhausted`] no table changes, so
    /// the caller can drop a sequence from the step and retry.
    pub fn prepare(
        pool: &mut BlockPool,
        batch: &mut [(&mut BlockTable, usize)],
    ) -> Result<Self, PagedError> {
        let needed: usize = batch.iter().map(|(t, n)| t.blocks_needed(pool, *n)).sum();
        if needed > pool.free.len() {
            return Err(PagedError::Exhausted {
                needed,
                free: pool.free.len(),
            });
        }
        let rows: usize = batch.iter().map(|(_, n)| n).sum();
        let u32_of = |what, value: usize| {
            u32::try_from(value).map_err(|_| PagedError::TooLarge {
                what,
                value: value as u64,
            })
        };
        u32_of("the step's row count", rows)?;
        let mut step = Self {
            slot_mapping: Vec::with_capacity(rows),
            block_tables: Vec::new(),
            max_blocks: 0,
            q_start: Vec::with_capacity(batch.len()),
            q_len: Vec::with_capacity(batch.len()),
            ctx_len: Vec::with_capacity(batch.len()),
        };
        for (table, n) in batch.iter_mut() {
            let ctx = table.len();
            table.append(pool, *n)?;
            step.q_start.push(step.slot_mapping.len() as u32);
            step.q_len.push(*n as u32);
            step.ctx_len
                .push(u32_of("a sequence's length", ctx + *n)? - *n as u32);
            let size = pool.block_size();
            step.slot_mapping
                .extend((ctx..ctx + *n).map(|t| table.slot(t, size)));
        }
        let widest = batch.iter().map(|(t, _)| t.blocks.len()).max().unwrap_or(0);
        step.max_blocks = widest.max(1) as u32;
        for (table, _) in batch.iter() {
            step.block_tables.extend_from_slice(&table.blocks);
            let pad = step.max_blocks as usize - table.blocks.len();
            step.block_tables.extend(std::iter::repeat_n(NO_BLOCK, pad));
        }
        Ok(step)
    }

    /// The longest chunk of the step: `paged_attention`'s grid covers it.
    pub fn max_q_len(&self) -> u32 {
        self.q_len.iter().copied().max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_takes_a_block_only_when_its_last_is_full() {
        let mut pool = BlockPool::new(8, 4).unwrap();
        let mut seq = BlockTable::new();
        seq.append(&mut pool, 3).unwrap();
        assert_eq!(
            (seq.blocks(), seq.len(), pool.free_blocks()),
            (&[0][..], 3, 7)
        );
        seq.append(&mut pool, 1).unwrap();
        assert_eq!(seq.blocks(), &[0]);
        seq.append(&mut pool, 1).unwrap();
        assert_eq!(seq.blocks(), &[0, 1]);
        seq.append(&mut pool, 8).unwrap();
        assert_eq!((seq.blocks(), seq.len()), (&[0, 1, 2, 3][..], 13));
        seq.append(&mut pool, 0).unwrap();
        assert_eq!(seq.blocks().len(), 4);
        assert_eq!((pool.capacity(), pool.free_blocks()), (8, 4));
    }

    #[test]
    fn slots_follow_the_block_table() {
        let mut pool = BlockPool::new(6, 4).unwrap();
        let (mut a, mut b) = (BlockTable::new(), BlockTable::new());
        // Interleaved growth: a gets blocks 0 and 2, b gets 1.
        a.append(&mut pool, 4).unwrap();
        b.append(&mut pool, 2).unwrap();
        a.append(&mut pool, 2).unwrap();
        assert_eq!((a.blocks(), b.blocks()), (&[0, 2][..], &[1][..]));
        let slots: Vec<u32> = (0..6).map(|t| a.slot(t, 4)).collect();
        assert_eq!(slots, [0, 1, 2, 3, 8, 9]);
        assert_eq!(b.slot(1, 4), 5);
    }

    #[test]
    fn freed_blocks_are_reused_after_a_sequence_ends() {
        let mut pool = BlockPool::new(4, 2).unwrap();
        let (mut a, mut b) = (BlockTable::new(), BlockTable::new());
        a.append(&mut pool, 3).unwrap();
        b.append(&mut pool, 2).unwrap();
        assert_eq!((a.blocks(), b.blocks()), (&[0, 1][..], &[2][..]));
        a.release(&mut pool).unwrap();
        assert!(a.is_empty() && a.blocks().is_empty());
        assert_eq!(pool.free_blocks(), 3);
        let mut c = BlockTable::new();
        c.append(&mut pool, 4).unwrap();
        let mut reused = c.blocks().to_vec();
        reused.sort_unstable();
        assert_eq!(reused, [0, 1]);
        // A block already free cannot be freed again.
        assert_eq!(
            pool.free(3),
            Err(PagedError::NotAllocated {
                block: 3,
                capacity: 4
            })
        );
        assert!(pool.free(9).is_err());
    }

    #[test]
    fn exhaustion_is_an_error_that_takes_nothing() {
        let mut pool = BlockPool::new(3, 4).unwrap();
        let mut a = BlockTable::new();
        a.append(&mut pool, 9).unwrap();
        let before = a.clone();
        assert_eq!(
            a.append(&mut pool, 4),
            Err(PagedError::Exhausted { needed: 1, free: 0 })
        );
        assert_eq!(a, before);
        // Three more tokens still fit the last block.
        a.append(&mut pool, 3).unwrap();
        let mut b = BlockTable::new();
        assert_eq!(
            pool.allocate(),
            Err(PagedError::Exhausted { needed: 1, free: 0 })
        );
        assert!(b.append(&mut pool, 1).is_err() && b.is_empty());
        assert_eq!(
            BlockPool::new(1, 0).unwrap_err(),
            PagedError::ZeroDimension { what: "block_size" }
        );
        assert!(BlockPool::new(u32::MAX, 2).is_err());
    }

    #[test]
    fn a_step_lays_out_slots_tables_and_chunks() {
        let mut pool = BlockPool::new(8, 4).unwrap();
        let (mut a, mut b, mut c) = (BlockTable::new(), BlockTable::new(), BlockTable::new());
        a.append(&mut pool, 5).unwrap(); // blocks 0, 1
        let step =
            StepArrays::prepare(&mut pool, &mut [(&mut a, 4), (&mut b, 1), (&mut c, 0)]).unwrap();
        // a: positions 5..9 in blocks 1 and 2; b: position 0 in block 3.
        assert_eq!(step.slot_mapping, [5, 6, 7, 8, 12]);
        assert_eq!(step.max_blocks, 3);
        assert_eq!(
            step.block_tables,
            [0, 1, 2, 3, NO_BLOCK, NO_BLOCK, NO_BLOCK, NO_BLOCK, NO_BLOCK]
        );
        assert_eq!(step.max_q_len(), 4);
        assert_eq!(
            (step.q_start, step.q_len, step.ctx_len),
            (vec![0, 4, 5], vec![4, 1, 0], vec![5, 0, 0])
        );
    }

    #[test]
    fn a_step_that_does_not_fit_changes_no_table() {
        let mut pool = BlockPool::new(3, 4).unwrap();
        let (mut a, mut b) = (BlockTable::new(), BlockTable::new());
        let err = StepArrays::prepare(&mut pool, &mut [(&mut a, 8), (&mut b, 5)]).unwrap_err();
        assert_eq!(err, PagedError::Exhausted { needed: 4, free: 3 });
        assert!(a.is_empty() && b.is_empty());
        assert_eq!(pool.free_blocks(), 3);
    }
}
