//! The KV-cache block pool with automatic prefix caching, modelled on vLLM v1
//! (`vllm/v1/core/kv_cache_utils.py`, `block_pool.py`, `kv_cache_manager.py`,
//! `single_type_kv_cache_manager.py`), because the hit rate a router can reach
//! depends on exactly these rules:
//!
//! - Only full blocks (`block_size` tokens, 16 by default) are cached. A
//!   block's hash chains its parent's hash, its token ids and extra keys
//!   (`hash_block_tokens`); the first block's parent is a fixed seed
//!   (`NONE_HASH`) and its extra keys carry the model (vLLM: the LoRA name)
//!   and the request's cache salt (vLLM mixes `cache_salt` into the first
//!   block only), so equal text under another model or salt never hits.
//! - A hit is the longest run of cached blocks from block 0
//!   (`find_longest_cache_hit`), capped at `prompt_len - 1` tokens
//!   (`max_cache_hit_length`): the last prompt token is always computed to get
//!   logits, so a fully cached, block-aligned prompt recomputes its last block.
//! - Hit blocks are "touched": their reference count goes up and, if they were
//!   free, they leave the free queue. New blocks come from the head of the
//!   free queue; a block taken from there that still has a hash is evicted
//!   (`_maybe_evict_cached_block`).
//! - Blocks get their hash when their tokens are scheduled (`cache_blocks`
//!   in `allocate_slots`), so a later request can hit them even before the
//!   earlier one has finished its prefill; the scheduler serialises prefill
//!   compute, which keeps that consistent.
//! - A finished request's blocks are freed in reverse order (`free` passes
//!   `reversed(req_blocks)`), appended to the tail of the free queue, so its
//!   tail blocks are evicted before its prefix blocks, and blocks freed longer
//!   ago before those freed recently (LRU).
//!
//! Simplification: a request allocates all blocks it will ever need (prompt and
//! `max_tokens` outputs) on admission instead of one by one during decoding,
//! so there is no preemption; full output blocks are hashed when it finishes.

use std::collections::{BTreeMap, HashMap};

use xxhash_rust::xxh3::xxh3_64;

use super::tokenizer::TokenId;

/// The parent hash of block 0 (vLLM draws `NONE_HASH` at random per process
/// unless `PYTHONHASHSEED` is set; a constant keeps runs reproducible).
pub const NONE_HASH: u64 = 0x6e6f_6e65_6861_7368;

/// One block's hash: parent hash, token ids and extra keys, unambiguously framed.
pub fn hash_block(parent: u64, tokens: &[TokenId], extra: &[u8]) -> u64 {
    let mut buf = Vec::with_capacity(8 + 8 + tokens.len() * 4 + 8 + extra.len());
    buf.extend_from_slice(&parent.to_le_bytes());
    buf.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    buf.extend_from_slice(&(extra.len() as u64).to_le_bytes());
    buf.extend_from_slice(extra);
    xxh3_64(&buf)
}

/// Extra keys of block 0: the model and the cache salt, length-prefixed so
/// that ("ab", "c") and ("a", "bc") differ.
pub fn first_block_extra(model: &str, cache_salt: Option<&str>) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(model.len() as u64).to_le_bytes());
    out.extend_from_slice(model.as_bytes());
    match cache_salt {
        Some(salt) => {
            out.push(1);
            out.extend_from_slice(&(salt.len() as u64).to_le_bytes());
            out.extend_from_slice(salt.as_bytes());
        }
        None => out.push(0),
    }
    out
}

/// Hashes of every full block of `tokens`, chained from block 0.
pub fn block_hashes(tokens: &[TokenId], block_size: usize, first_extra: &[u8]) -> Vec<u64> {
    let mut parent = NONE_HASH;
    tokens
        .chunks_exact(block_size)
        .enumerate()
        .map(|(i, block)| {
            let extra: &[u8] = if i == 0 { first_extra } else { &[] };
            parent = hash_block(parent, block, extra);
            parent
        })
        .collect()
}

#[derive(Debug, Default, Clone)]
struct Block {
    ref_cnt: u32,
    hash: Option<u64>,
    /// Position in the free queue while free.
    free_seq: Option<u64>,
}

/// The blocks one admitted request holds, in token order.
#[derive(Debug)]
pub struct Allocation {
    blocks: Vec<usize>,
    /// Blocks that already had their hash when this request got them, or got it from it.
    hashed_blocks: usize,
    /// Prompt tokens served from the cache.
    pub hit_tokens: usize,
}

impl Allocation {
    /// How many blocks the request holds.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether the request holds no block.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// Why a request cannot be admitted.
#[derive(Debug, PartialEq, Eq)]
pub enum AllocError {
    /// Not enough free blocks now; retry when some are freed.
    NotNow,
    /// More blocks than the whole pool: it can never run.
    TooLarge { needed: usize, capacity: usize },
}

/// The block pool: free queue in eviction order plus the hash → block map.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    /// Free blocks by queue position; the smallest position is evicted first.
    free: BTreeMap<u64, usize>,
    next_seq: u64,
    cached: HashMap<u64, usize>,
}

impl BlockPool {
    /// A pool of `num_blocks` empty blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be positive");
        let mut pool = BlockPool {
            block_size,
            blocks: vec![Block::default(); num_blocks],
            free: BTreeMap::new(),
            next_seq: 0,
            cached: HashMap::new(),
        };
        for id in 0..num_blocks {
            pool.push_free(id);
        }
        pool
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Total blocks.
    pub fn capacity(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks in the free queue (empty or evictable).
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks whose hash can be hit.
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    fn push_free(&mut self, id: usize) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.blocks[id].free_seq = Some(seq);
        self.free.insert(seq, id);
    }

    fn remove_free(&mut self, id: usize) {
        if let Some(seq) = self.blocks[id].free_seq.take() {
            self.free.remove(&seq);
        }
    }

    /// The number of leading blocks of `hashes` that are cached, capped so that
    /// at least one of `num_tokens` prompt tokens is computed.
    pub fn longest_hit_blocks(&self, hashes: &[u64], num_tokens: usize) -> usize {
        let max_hit_blocks = num_tokens.saturating_sub(1) / self.block_size;
        hashes
            .iter()
            .take(max_hit_blocks)
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Admits a request of `prompt_hashes` (its full prompt blocks) and
    /// `num_prompt_tokens`, reserving blocks for `total_tokens` (prompt plus
    /// outputs): touches the hit blocks, takes the rest from the free queue
    /// head (evicting), and hashes the prompt's full blocks.
    pub fn allocate(
        &mut self,
        prompt_hashes: &[u64],
        num_prompt_tokens: usize,
        total_tokens: usize,
    ) -> Result<Allocation, AllocError> {
        let needed_total = total_tokens.div_ceil(self.block_size).max(1);
        if needed_total > self.capacity() {
            return Err(AllocError::TooLarge {
                needed: needed_total,
                capacity: self.capacity(),
            });
        }
        let hit_blocks = self.longest_hit_blocks(prompt_hashes, num_prompt_tokens);
        let hit_ids: Vec<usize> = prompt_hashes[..hit_blocks]
            .iter()
            .map(|h| self.cached[h])
            .collect();
        // Touching a free hit block takes it out of the free queue too.
        let hits_in_free = hit_ids
            .iter()
            .filter(|&&id| self.blocks[id].ref_cnt == 0)
            .count();
        let new_blocks = needed_total - hit_blocks;
        if new_blocks + hits_in_free > self.free_blocks() {
            return Err(AllocError::NotNow);
        }
        for &id in &hit_ids {
            if self.blocks[id].ref_cnt == 0 {
                self.remove_free(id);
            }
            self.blocks[id].ref_cnt += 1;
        }
        let mut blocks = hit_ids;
        for _ in 0..new_blocks {
            let (_, id) = self.free.pop_first().expect("free count was checked above");
            self.blocks[id].free_seq = None;
            if let Some(old) = self.blocks[id].hash.take() {
                if self.cached.get(&old) == Some(&id) {
                    self.cached.remove(&old);
                }
            }
            self.blocks[id].ref_cnt = 1;
            blocks.push(id);
        }
        let mut allocation = Allocation {
            blocks,
            hashed_blocks: hit_blocks,
            hit_tokens: hit_blocks * self.block_size,
        };
        self.cache_full_blocks(&mut allocation, prompt_hashes);
        Ok(allocation)
    }

    /// Gives the allocation's blocks `hashes` (one per full block of the
    /// request's tokens so far) from the first block not yet hashed on. A hash
    /// that another block already holds stays with that block (vLLM keeps
    /// duplicates but hits the first one, which amounts to the same).
    pub fn cache_full_blocks(&mut self, allocation: &mut Allocation, hashes: &[u64]) {
        let upto = hashes.len().min(allocation.blocks.len());
        let range = allocation.hashed_blocks.min(upto)..upto;
        for (&id, &hash) in allocation.blocks[range.clone()].iter().zip(&hashes[range]) {
            if self.blocks[id].hash.is_none() && !self.cached.contains_key(&hash) {
                self.blocks[id].hash = Some(hash);
                self.cached.insert(hash, id);
            }
        }
        allocation.hashed_blocks = allocation.hashed_blocks.max(upto);
    }

    /// Forgets every cached hash, as vLLM's `reset_prefix_cache`; refuses
    /// (returns false) while any block is in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.blocks.iter().any(|b| b.ref_cnt > 0) {
            return false;
        }
        for b in &mut self.blocks {
            b.hash = None;
        }
        self.cached.clear();
        true
    }

    /// Releases a finished request's blocks, tail first, so that its last
    /// blocks are evicted before its first ones.
    pub fn free(&mut self, allocation: Allocation) {
        for &id in allocation.blocks.iter().rev() {
            let block = &mut self.blocks[id];
            block.ref_cnt = block.ref_cnt.saturating_sub(1);
            if block.ref_cnt == 0 {
                self.push_free(id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 16;

    fn tokens(seed: u32, n: usize) -> Vec<TokenId> {
        (0..n as u32).map(|i| seed * 100_000 + i).collect()
    }

    fn hashes(t: &[TokenId]) -> Vec<u64> {
        block_hashes(t, BS, &first_block_extra("m", None))
    }

    /// Admits and finishes a request, returning its hit tokens.
    fn run(pool: &mut BlockPool, t: &[TokenId], outputs: usize) -> usize {
        let alloc = pool
            .allocate(&hashes(t), t.len(), t.len() + outputs)
            .unwrap();
        let hit = alloc.hit_tokens;
        pool.free(alloc);
        hit
    }

    #[test]
    fn repeated_prompt_hits_its_full_blocks() {
        let mut pool = BlockPool::new(100, BS);
        let t = tokens(1, 100); // 6 full blocks + 4 tokens
        assert_eq!(run(&mut pool, &t, 10), 0);
        assert_eq!(run(&mut pool, &t, 10), 96);
        // A longer prompt with the same start hits the shared blocks only.
        let mut longer = t.clone();
        longer.extend(tokens(2, 50));
        assert_eq!(run(&mut pool, &longer, 10), 96);
    }

    #[test]
    fn hit_is_capped_one_token_short_of_the_prompt() {
        let mut pool = BlockPool::new(100, BS);
        let t = tokens(1, 64); // exactly 4 blocks
        assert_eq!(run(&mut pool, &t, 1), 0);
        // All 4 blocks are cached, but the last token must be computed: 3 blocks hit.
        assert_eq!(run(&mut pool, &t, 1), 48);
        let t65 = tokens(1, 65);
        assert_eq!(run(&mut pool, &t65, 1), 64);
    }

    #[test]
    fn hit_stops_at_the_first_missing_block() {
        let mut pool = BlockPool::new(100, BS);
        let t = tokens(1, 80);
        run(&mut pool, &t, 0);
        let mut changed = t.clone();
        changed[20] = 7; // inside block 1
        assert_eq!(run(&mut pool, &changed, 0), 16);
    }

    #[test]
    fn block_hash_chains_the_parent() {
        let a = tokens(1, 32);
        let mut b = tokens(9, 16);
        b.extend_from_slice(&a[16..]);
        let ha = hashes(&a);
        let hb = hashes(&b);
        // Same tokens in block 1, different block 0: block 1 differs too.
        assert_ne!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        assert_eq!(ha[1], hash_block(ha[0], &a[16..32], &[]));
        assert_eq!(hashes(&a[..31]).len(), 1, "a partial block has no hash");
    }

    #[test]
    fn model_and_salt_isolate_the_cache() {
        let mut pool = BlockPool::new(100, BS);
        let t = tokens(1, 64);
        let by =
            |model: &str, salt: Option<&str>| block_hashes(&t, BS, &first_block_extra(model, salt));
        let go = |pool: &mut BlockPool, h: Vec<u64>| {
            let a = pool.allocate(&h, 64, 65).unwrap();
            let hit = a.hit_tokens;
            pool.free(a);
            hit
        };
        assert_eq!(go(&mut pool, by("llama", None)), 0);
        assert_eq!(go(&mut pool, by("llama", None)), 48);
        assert_eq!(go(&mut pool, by("llama-lora", None)), 0);
        assert_eq!(go(&mut pool, by("llama", Some("tenant-a"))), 0);
        assert_eq!(go(&mut pool, by("llama", Some("tenant-b"))), 0);
        assert_eq!(go(&mut pool, by("llama", Some("tenant-a"))), 48);
        // Framing: the salt is not just appended to the model name.
        assert_ne!(
            first_block_extra("ab", Some("c")),
            first_block_extra("a", Some("bc"))
        );
        assert_ne!(
            first_block_extra("a", Some("")),
            first_block_extra("a", None)
        );
    }

    #[test]
    fn freed_blocks_are_evicted_tail_first_and_oldest_first() {
        // 8 blocks. Request A: 4 prompt blocks (+1 token to make the cap irrelevant).
        let mut pool = BlockPool::new(8, BS);
        let a = tokens(1, 65); // 4 full blocks + 1 token -> 5 blocks
        run(&mut pool, &a, 0);
        assert_eq!(pool.cached_blocks(), 4);
        // Free queue now: 3 never-used blocks, then A's blocks tail first.
        // B needs 3 + 2 = 5 blocks: 3 empty ones, then A's tail (partial) block
        // and A's block 3. A's blocks 0..3 stay cached.
        let b = tokens(2, 40); // 2 full + 8 tokens = 3 blocks
        let alloc_b = pool.allocate(&hashes(&b), 40, 80).unwrap();
        assert_eq!(alloc_b.len(), 5);
        assert_eq!(pool.cached_blocks(), 3 + 2);
        pool.free(alloc_b);
        // A again: blocks 0..2 hit (48 tokens), block 3 was evicted.
        assert_eq!(run(&mut pool, &a, 0), 48);
    }

    #[test]
    fn blocks_in_use_are_not_evicted_and_admission_waits() {
        let mut pool = BlockPool::new(6, BS);
        let a = tokens(1, 64);
        let alloc_a = pool.allocate(&hashes(&a), 64, 64).unwrap();
        let b = tokens(2, 64);
        assert_eq!(
            pool.allocate(&hashes(&b), 64, 64).unwrap_err(),
            AllocError::NotNow
        );
        // A sharer of A's prefix touches the in-use blocks and needs fewer new ones.
        let mut a2 = a[..48].to_vec();
        a2.extend(tokens(3, 17));
        let alloc_a2 = pool.allocate(&hashes(&a2), 65, 65).unwrap();
        assert_eq!(alloc_a2.hit_tokens, 48);
        assert_eq!(pool.free_blocks(), 0);
        pool.free(alloc_a);
        pool.free(alloc_a2);
        assert_eq!(pool.free_blocks(), 6);
        assert_eq!(
            pool.allocate(&[], 200, 200).unwrap_err(),
            AllocError::TooLarge {
                needed: 13,
                capacity: 6
            }
        );
    }

    #[test]
    fn reset_forgets_hashes_only_when_idle() {
        let mut pool = BlockPool::new(20, BS);
        let t = tokens(1, 40);
        run(&mut pool, &t, 0);
        let busy = pool.allocate(&hashes(&tokens(2, 20)), 20, 20).unwrap();
        assert!(!pool.reset_prefix_cache());
        pool.free(busy);
        assert!(pool.reset_prefix_cache());
        assert_eq!(pool.cached_blocks(), 0);
        assert_eq!(run(&mut pool, &t, 0), 0);
        assert_eq!(run(&mut pool, &t, 0), 32);
    }

    #[test]
    fn output_blocks_become_hittable_after_caching() {
        let mut pool = BlockPool::new(20, BS);
        let prompt = tokens(1, 40);
        let mut all = prompt.clone();
        all.extend(tokens(2, 40)); // outputs
        let mut alloc = pool.allocate(&hashes(&prompt), 40, 80).unwrap();
        pool.cache_full_blocks(&mut alloc, &hashes(&all));
        pool.free(alloc);
        let mut next_turn = all.clone();
        next_turn.extend(tokens(3, 30));
        assert_eq!(run(&mut pool, &next_turn, 0), 80);
    }
}
