//! One rank's KV blocks: its budget as a pool of fixed-size blocks, which sequences hold which
//! blocks, and the prefix cache that keeps the blocks of earlier sequences for later ones.
//!
//! Every full block a sequence computes is *registered* under the hash of its token ids chained
//! with the hash of the block before it (and a salt naming the model), so equal hashes mean an
//! equal prefix. A new sequence looks up its prompt's block hashes in order and reuses the
//! longest run found; it computes only the rest. A block nobody holds stays cached until the
//! pool runs out of free blocks, and then the least recently used such block is evicted first.
//!
//! Block ids come from the GPU path's [`BlockPool`], so both paths count the budget the same
//! way. The data of a cached block ([`KvBlock`], shared tensors) lives here while it is
//! cached, and in the sequences that use it.

use std::collections::{BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use rackfill_kernels::kv_blocks::BlockPool;
use rackfill_models::KvBlock;
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::sampling::TokenLogprob;

/// The chained hash of one block: 128 bits, so that two different prefixes sharing a hash is
/// not a risk a long-running server has to weigh.
pub type BlockHash = u128;

/// Prompt logprobs of a block's positions, each with the most likely alternatives up to
/// [`crate::sampling::MAX_LOGPROBS`] (a later request asking fewer gets a prefix of them); the
/// first position of a prompt has none.
pub type BlockLogprobs = Arc<[Option<TokenLogprob>]>;

/// Hashes a sequence's token blocks.
#[derive(Debug, Clone, Copy)]
pub struct BlockHasher {
    block_tokens: usize,
    /// Names what else the KV depends on (the model), so a cache is never read across models.
    salt: u64,
}

impl BlockHasher {
    /// A hasher for `block_tokens`-token blocks of the model `salt` names.
    pub fn new(block_tokens: usize, salt: u64) -> Self {
        Self {
            block_tokens: block_tokens.max(1),
            salt,
        }
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Extends `hashes` (the chain of the first `hashes.len()` blocks of `tokens`) to every full
    /// block of `tokens`.
    pub fn extend(&self, hashes: &mut Vec<BlockHash>, tokens: &[u32]) {
        for block in tokens.chunks_exact(self.block_tokens).skip(hashes.len()) {
            let parent = hashes.last().copied();
            hashes.push(self.hash(parent, block));
        }
    }

    /// The hash of `block` after the block hashed `parent` (none for the first block).
    fn hash(&self, parent: Option<BlockHash>, block: &[u32]) -> BlockHash {
        let half = |lane: u64| {
            let mut h = DefaultHasher::new();
            (lane, self.salt, parent, block).hash(&mut h);
            h.finish()
        };
        (u128::from(half(0)) << 64) | u128::from(half(1))
    }
}

/// A model's cache salt: any difference in what is hashed gives another salt.
pub fn model_salt(name: &str, fingerprint: impl Hash) -> u64 {
    let mut h = DefaultHasher::new();
    (name, fingerprint).hash(&mut h);
    h.finish()
}

/// A change to a rank's index of cached blocks, which a group's leader mirrors to route new
/// sequences to the rank holding their prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum IndexChange {
    Added(BlockHash),
    Removed(BlockHash),
}

/// What placing a sequence on one rank would cost and save.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankOffer {
    pub rank: usize,
    /// Tokens the rank's admitted and queued sequences still compute over their lives (prompt
    /// not reused, plus `max_tokens`).
    pub load: usize,
    /// Sequences running on the rank.
    pub running: usize,
    /// Prompt tokens the rank's cache would save.
    pub reused: usize,
}

/// Cache-aware placement. An offer is *over* by how much its load exceeds the least-loaded
/// offer's beyond the tokens it reuses plus `slack`; the chosen offer is the least over, then
/// the one reusing the most, then the least loaded (then fewer running sequences, lower rank).
/// So a cached prefix draws its sequence unless its rank is busier than the least-loaded one
/// by more than the prefix saves plus `slack` (the engine passes one step's token budget: a
/// rank is never kept more than a step behind to serve from its cache), and without any reuse
/// this is least-loaded placement.
pub fn choose_rank(offers: &[RankOffer], slack: usize) -> Option<usize> {
    let least = offers.iter().map(|o| o.load).min()?;
    offers
        .iter()
        .min_by_key(|o| {
            let over = (o.load - least).saturating_sub(o.reused + slack);
            (over, std::cmp::Reverse(o.reused), o.load, o.running, o.rank)
        })
        .map(|o| o.rank)
}

/// Prompt tokens a sequence reuses from `hit` cached blocks of `block_tokens` tokens: at most
/// all but the prompt's last token, whose logits the sequence needs; with prompt logprobs, one
/// token fewer than the blocks hold, because the first computed position's logprob comes from
/// the row before it, which only the cached blocks' stored logprobs still have.
pub fn reusable_tokens(hit: usize, block_tokens: usize, prompt: usize, logprobs: bool) -> usize {
    let whole = hit * block_tokens;
    let tokens = if logprobs {
        whole.saturating_sub(1)
    } else {
        whole
    };
    tokens.min(prompt.saturating_sub(1))
}

/// A registered block's content and what indexes it.
#[derive(Debug)]
struct CachedBlock {
    hash: BlockHash,
    kv: KvBlock,
    logprobs: Option<BlockLogprobs>,
}

/// One rank's counters and block states, for metrics and the bench.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefixCacheStats {
    /// Sequences looked up in the cache.
    pub queries: u64,
    /// Sequences that reused at least one token.
    pub hits: u64,
    /// Prompt tokens of the sequences looked up.
    pub queried_tokens: u64,
    /// Prompt tokens reused instead of computed.
    pub hit_tokens: u64,
    /// Blocks held by running sequences.
    pub blocks_used: usize,
    /// Blocks nobody holds, kept for later prefixes.
    pub blocks_cached: usize,
    /// Blocks neither held nor cached.
    pub blocks_free: usize,
    /// Cached blocks evicted to make room.
    pub blocks_evicted: u64,
}

impl PrefixCacheStats {
    /// The sum over `ranks` (a process's local ranks, as one).
    pub fn merged(ranks: &[Self]) -> Self {
        ranks.iter().fold(Self::default(), |sum, r| Self {
            queries: sum.queries + r.queries,
            hits: sum.hits + r.hits,
            queried_tokens: sum.queried_tokens + r.queried_tokens,
            hit_tokens: sum.hit_tokens + r.hit_tokens,
            blocks_used: sum.blocks_used + r.blocks_used,
            blocks_cached: sum.blocks_cached + r.blocks_cached,
            blocks_free: sum.blocks_free + r.blocks_free,
            blocks_evicted: sum.blocks_evicted + r.blocks_evicted,
        })
    }

    /// Reused over looked-up prompt tokens (0 before any query).
    pub fn hit_rate(&self) -> f64 {
        match self.queried_tokens {
            0 => 0.0,
            queried => self.hit_tokens as f64 / queried as f64,
        }
    }
}

/// One rank's KV blocks and prefix cache.
#[derive(Debug)]
pub struct RankBlocks {
    pool: BlockPool,
    /// Per block id: sequences holding it.
    holders: Vec<u32>,
    /// Per block id: what it caches, once registered.
    cached: Vec<Option<CachedBlock>>,
    index: HashMap<BlockHash, u32>,
    /// Registered blocks nobody holds, by when they were last released: the eviction order.
    unheld: BTreeSet<(u64, u32)>,
    /// Per block id: its key in `unheld`, while it is there.
    released_at: Vec<u64>,
    clock: u64,
    /// Whether blocks are kept for later sequences (`--no-prefix-cache` clears it).
    caching: bool,
    /// Index changes not yet taken, while a leader mirrors the index.
    journal: Option<Vec<IndexChange>>,
    stats: PrefixCacheStats,
}

impl RankBlocks {
    /// A rank with `num_blocks` blocks of `block_tokens` tokens; `caching` keeps finished
    /// blocks for later prefixes.
    pub fn new(num_blocks: usize, block_tokens: usize, caching: bool) -> Result<Self> {
        let num_blocks = u32::try_from(num_blocks)
            .map_err(|_| EngineError::Config(format!("{num_blocks} KV blocks per rank")))?;
        let pool = BlockPool::new(num_blocks, block_tokens as u32)
            .map_err(|e| EngineError::Config(format!("the KV block pool: {e}")))?;
        let n = num_blocks as usize;
        Ok(Self {
            pool,
            holders: vec![0; n],
            cached: (0..n).map(|_| None).collect(),
            index: HashMap::new(),
            unheld: BTreeSet::new(),
            released_at: vec![0; n],
            clock: 0,
            caching,
            journal: None,
            stats: PrefixCacheStats::default(),
        })
    }

    /// Starts recording index changes for [`Self::take_index_changes`].
    pub fn journal_index_changes(&mut self) {
        self.journal.get_or_insert_with(Vec::new);
    }

    /// The index changes since the last call (none unless journaling).
    pub fn take_index_changes(&mut self) -> Vec<IndexChange> {
        self.journal
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Blocks in the rank's budget.
    pub fn capacity(&self) -> usize {
        self.pool.capacity() as usize
    }

    /// Blocks held by running sequences.
    pub fn used(&self) -> usize {
        self.capacity() - self.pool.free_blocks() as usize - self.unheld.len()
    }

    /// The block ids of the longest cached run of `hashes` (a prompt's full blocks, in order);
    /// with `logprobs`, only blocks that kept their prompt logprobs count.
    pub fn lookup(&self, hashes: &[BlockHash], logprobs: bool) -> Vec<u32> {
        if !self.caching {
            return Vec::new();
        }
        hashes
            .iter()
            .map_while(|hash| {
                let id = *self.index.get(hash)?;
                let block = self.cached[id as usize].as_ref()?;
                (!logprobs || block.logprobs.is_some()).then_some(id)
            })
            .collect()
    }

    /// The content of cached block `id`.
    pub fn block(&self, id: u32) -> Option<(&KvBlock, Option<&BlockLogprobs>)> {
        let block = self.cached.get(id as usize)?.as_ref()?;
        Some((&block.kv, block.logprobs.as_ref()))
    }

    /// Whether a sequence can hold the cached blocks `shared` and `fresh` new ones, evicting
    /// cached blocks other than `shared` if it must.
    pub fn fits(&self, shared: &[u32], fresh: usize) -> bool {
        let pinned = shared
            .iter()
            .filter(|&&id| self.holders[id as usize] == 0)
            .count();
        self.pool.free_blocks() as usize + self.unheld.len() - pinned >= fresh
    }

    /// Holds `shared` (cached blocks a sequence reuses) and `fresh` new blocks, evicting the
    /// least recently used unheld blocks when no block is free; returns the sequence's block
    /// table. Refused, with nothing taken, unless [`Self::fits`].
    pub fn hold(&mut self, shared: &[u32], fresh: usize) -> Result<Vec<u32>> {
        if !self.fits(shared, fresh) {
            return Err(EngineError::KvBlocks(format!(
                "{fresh} blocks asked with {} free and {} evictable",
                self.pool.free_blocks(),
                self.unheld.len()
            )));
        }
        let mut table = Vec::with_capacity(shared.len() + fresh);
        for &id in shared {
            let at = self.released_at[id as usize];
            self.unheld.remove(&(at, id));
            self.holders[id as usize] += 1;
            table.push(id);
        }
        for _ in 0..fresh {
            if self.pool.free_blocks() == 0 {
                self.evict_one()?;
            }
            let id = self.pool.allocate().map_err(cache_error)?;
            self.holders[id as usize] = 1;
            table.push(id);
        }
        Ok(table)
    }

    /// Counts one sequence's lookup: `queried` prompt tokens, `hit` of them reused.
    pub fn count_query(&mut self, queried: usize, hit: usize) {
        if self.caching {
            self.stats.queries += 1;
            self.stats.hits += u64::from(hit > 0);
            self.stats.queried_tokens += queried as u64;
            self.stats.hit_tokens += hit as u64;
        }
    }

    /// Registers block `id`, held by the sequence that computed it, as the block of `hash`,
    /// with the content `kv` gives (asked only for a new hash). A block another sequence
    /// registered first keeps its place (this one stays private and is freed with its
    /// sequence), but gains `logprobs` if it had none.
    pub fn register(
        &mut self,
        id: u32,
        hash: BlockHash,
        kv: impl FnOnce() -> Option<KvBlock>,
        logprobs: Option<BlockLogprobs>,
    ) {
        if !self.caching {
            return;
        }
        if let Some(&first) = self.index.get(&hash) {
            if let Some(block) = self.cached[first as usize].as_mut() {
                if block.logprobs.is_none() {
                    block.logprobs = logprobs;
                }
            }
            return;
        }
        if self.cached[id as usize].is_some() {
            return;
        }
        if let Some(kv) = kv() {
            self.index.insert(hash, id);
            self.cached[id as usize] = Some(CachedBlock { hash, kv, logprobs });
            if let Some(journal) = &mut self.journal {
                journal.push(IndexChange::Added(hash));
            }
        }
    }

    /// A sequence lets go of its `table`: registered blocks nobody else holds become cached,
    /// the others free. The table's last blocks are released first, so they are evicted before
    /// the prefix blocks that more sequences are likely to share.
    pub fn release(&mut self, table: &[u32]) -> Result<()> {
        for &id in table.iter().rev() {
            let holders = &mut self.holders[id as usize];
            *holders = holders.saturating_sub(1);
            if *holders > 0 {
                continue;
            }
            if self.cached[id as usize].is_some() {
                self.clock += 1;
                self.released_at[id as usize] = self.clock;
                self.unheld.insert((self.clock, id));
            } else {
                self.pool.free(id).map_err(cache_error)?;
            }
        }
        Ok(())
    }

    /// The rank's counters and block states now.
    pub fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats {
            blocks_used: self.used(),
            blocks_cached: self.unheld.len(),
            blocks_free: self.pool.free_blocks() as usize,
            ..self.stats
        }
    }

    /// Drops the least recently released cached block, freeing its id.
    fn evict_one(&mut self) -> Result<()> {
        let (_, id) = self.unheld.pop_first().ok_or_else(|| {
            EngineError::KvBlocks("the KV block pool is exhausted with nothing to evict".into())
        })?;
        if let Some(block) = self.cached[id as usize].take() {
            self.index.remove(&block.hash);
            if let Some(journal) = &mut self.journal {
                journal.push(IndexChange::Removed(block.hash));
            }
        }
        self.stats.blocks_evicted += 1;
        self.pool.free(id).map_err(cache_error)
    }
}

fn cache_error(err: rackfill_kernels::kv_blocks::PagedError) -> EngineError {
    EngineError::KvBlocks(err.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};
    use rackfill_models::BlockKv;

    fn kv() -> KvBlock {
        let t = Tensor::zeros((1, 4, 2), DType::F32, &Device::Cpu).unwrap();
        KvBlock {
            layers: vec![BlockKv {
                keys: t.clone(),
                values: t,
                latent: None,
            }],
        }
    }

    fn hashes(tokens: &[u32]) -> Vec<BlockHash> {
        let mut hashes = Vec::new();
        BlockHasher::new(4, 1).extend(&mut hashes, tokens);
        hashes
    }

    #[test]
    fn hashes_chain_the_prefix_and_the_salt() {
        let a = hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(a.len(), 2, "only full blocks");
        let b = hashes(&[0, 2, 3, 4, 5, 6, 7, 8]);
        assert_ne!(a[1], b[1], "same block after another prefix");
        let mut other_model = Vec::new();
        BlockHasher::new(4, 2).extend(&mut other_model, &[1, 2, 3, 4]);
        assert_ne!(a[0], other_model[0]);
        let mut extended = a[..1].to_vec();
        BlockHasher::new(4, 1).extend(&mut extended, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(extended, a, "extending continues the chain");
    }

    #[test]
    fn released_blocks_stay_cached_until_room_is_needed() {
        let mut blocks = RankBlocks::new(4, 4, true).unwrap();
        let h = hashes(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let table = blocks.hold(&[], 3).unwrap();
        blocks.register(table[0], h[0], || Some(kv()), None);
        blocks.register(table[1], h[1], || Some(kv()), None);
        assert_eq!(blocks.lookup(&h, false), &table[..2]);
        assert!(blocks.lookup(&h, true).is_empty(), "no logprobs kept");
        blocks.release(&table).unwrap();
        let stats = blocks.stats();
        assert_eq!(
            (stats.blocks_used, stats.blocks_cached, stats.blocks_free),
            (0, 2, 2)
        );
        // Holding the first cached block pins it: three fresh blocks need the other one.
        assert!(blocks.fits(&table[..1], 3));
        assert!(!blocks.fits(&table[..1], 4));
        let next = blocks.hold(&table[..1], 3).unwrap();
        assert_eq!(blocks.stats().blocks_evicted, 1);
        assert_eq!(
            blocks.lookup(&h, false),
            &table[..1],
            "the tail block went first"
        );
        assert_eq!(blocks.used(), 4);
        blocks.release(&next).unwrap();
        assert_eq!(blocks.stats().blocks_cached, 1);
    }

    #[test]
    fn a_block_registered_twice_keeps_the_first_and_gains_logprobs() {
        let mut blocks = RankBlocks::new(4, 4, true).unwrap();
        blocks.journal_index_changes();
        let h = hashes(&[1, 2, 3, 4]);
        let (a, b) = (blocks.hold(&[], 1).unwrap(), blocks.hold(&[], 1).unwrap());
        blocks.register(a[0], h[0], || Some(kv()), None);
        let scored: BlockLogprobs = vec![None; 4].into();
        blocks.register(b[0], h[0], || Some(kv()), Some(scored));
        assert_eq!(
            blocks.lookup(&h, true),
            a,
            "the first block, now with logprobs"
        );
        blocks.release(&b).unwrap();
        assert_eq!(blocks.stats().blocks_free, 3, "the duplicate is freed");
        blocks.release(&a).unwrap();
        blocks.hold(&[], 4).unwrap();
        let changes = blocks.take_index_changes();
        assert_eq!(
            changes,
            [IndexChange::Added(h[0]), IndexChange::Removed(h[0])]
        );
    }

    #[test]
    fn a_pool_without_caching_frees_every_block() {
        let mut blocks = RankBlocks::new(2, 4, false).unwrap();
        let h = hashes(&[1, 2, 3, 4]);
        let table = blocks.hold(&[], 2).unwrap();
        blocks.register(table[0], h[0], || Some(kv()), None);
        blocks.release(&table).unwrap();
        assert!(blocks.lookup(&h, false).is_empty());
        assert_eq!(blocks.stats().blocks_free, 2);
    }

    #[test]
    fn placement_trades_reuse_against_load() {
        let offer = |rank, load, reused| RankOffer {
            rank,
            load,
            running: 0,
            reused,
        };
        assert_eq!(choose_rank(&[offer(0, 10, 0), offer(1, 0, 0)], 64), Some(1));
        assert_eq!(choose_rank(&[offer(0, 10, 32), offer(1, 0, 0)], 0), Some(0));
        assert_eq!(choose_rank(&[offer(0, 40, 32), offer(1, 0, 0)], 0), Some(1));
        assert_eq!(choose_rank(&[offer(0, 40, 32), offer(1, 0, 0)], 8), Some(0));
        assert_eq!(choose_rank(&[offer(0, 41, 32), offer(1, 0, 0)], 8), Some(1));
        let two_hits = [offer(0, 0, 16), offer(1, 0, 48), offer(2, 0, 0)];
        assert_eq!(choose_rank(&two_hits, 0), Some(1), "the longer prefix");
        assert_eq!(choose_rank(&[], 0), None);
        assert_eq!(reusable_tokens(2, 16, 100, false), 32);
        assert_eq!(reusable_tokens(2, 16, 100, true), 31);
        assert_eq!(
            reusable_tokens(2, 16, 32, false),
            31,
            "the last token is computed"
        );
        assert_eq!(reusable_tokens(0, 16, 32, true), 0);
    }
}
