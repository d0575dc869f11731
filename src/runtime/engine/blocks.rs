//! The KV-cache block pool as the scheduler sees it: which blocks are free, which hold a
//! cached prefix, and how many sequences read each one. The memory itself lives in every
//! rank's executor; all ranks use the block ids the leading rank's pool hands out.
//!
//! Prefix caching: a full block is keyed by a hash of its tokens chained with the hash of
//! every block before it, so a key names the whole prefix up to the block's end. A block
//! whose last reader leaves keeps its contents and its key and becomes evictable; it is
//! reused least recently used first, only when no never-used block is free.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{Hash, Hasher};

/// A block id: an index into every rank's pool.
pub type BlockId = u32;

/// The key of a full block: the chained hash and, checked on every hit, its own tokens and
/// the key of the block before it (a hash collision then needs two equal 64-bit chains).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Key {
    chain: u64,
    parent: Option<u64>,
    tokens: Vec<i64>,
}

/// The chained hash of a block of `tokens` after the prefix whose chain is `parent`.
fn chain_hash(parent: Option<u64>, tokens: &[i64]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// The pool: reference counts, the free list, and the prefix cache.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    /// Sequences reading each block.
    refs: Vec<u32>,
    /// The key of each block that holds a cached full block.
    keys: Vec<Option<Key>>,
    /// Blocks with no reader and no cached content, taken first.
    free: VecDeque<BlockId>,
    /// Cached blocks with no reader, by the tick they were last released: evicted oldest
    /// first.
    evictable: BTreeMap<u64, BlockId>,
    /// Each evictable block's tick.
    released_at: Vec<u64>,
    by_chain: HashMap<u64, BlockId>,
    tick: u64,
    prefix_caching: bool,
}

impl BlockPool {
    /// `blocks` blocks of `block_size` tokens (both at least 1).
    pub fn new(blocks: usize, block_size: usize, prefix_caching: bool) -> BlockPool {
        BlockPool {
            block_size: block_size.max(1),
            refs: vec![0; blocks],
            keys: vec![None; blocks],
            free: (0..blocks as BlockId).collect(),
            evictable: BTreeMap::new(),
            released_at: vec![0; blocks],
            by_chain: HashMap::new(),
            tick: 0,
            prefix_caching,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks that can be handed out now (never used, or cached but unread).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks read by at least one sequence.
    pub fn in_use(&self) -> usize {
        self.total() - self.available()
    }

    /// Blocks `positions` tokens occupy.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_size)
    }

    /// The cached blocks that hold a prefix of `tokens`, in order, leaving at least the last
    /// token to compute (its logits are needed, and a shared block is never written). The
    /// blocks are not taken yet: [`BlockPool::take_cached`] does that.
    pub fn cached_prefix(&self, tokens: &[i64]) -> Vec<BlockId> {
        let mut found = Vec::new();
        if !self.prefix_caching {
            return found;
        }
        let whole = tokens.len().saturating_sub(1) / self.block_size;
        let mut parent = None;
        for block in tokens.chunks(self.block_size).take(whole) {
            let chain = chain_hash(parent, block);
            let Some(&id) = self.by_chain.get(&chain) else {
                break;
            };
            let hit = self.keys[id as usize]
                .as_ref()
                .is_some_and(|k| k.parent == parent && k.tokens == block);
            if !hit {
                break;
            }
            found.push(id);
            parent = Some(chain);
        }
        found
    }

    /// Takes cached blocks found by [`BlockPool::cached_prefix`] for one more reader.
    pub fn take_cached(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            let i = b as usize;
            if self.refs[i] == 0 {
                self.evictable.remove(&self.released_at[i]);
            }
            self.refs[i] += 1;
        }
    }

    /// `n` blocks for one reader, never-used ones first, then the least recently released
    /// cached ones (forgetting their contents); `None` (taking nothing) if there are fewer.
    pub fn take_new(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.available() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = match self.free.pop_front() {
                Some(b) => b,
                None => {
                    let (_, b) = self.evictable.pop_first()?;
                    self.forget(b);
                    b
                }
            };
            self.refs[b as usize] = 1;
            out.push(b);
        }
        Some(out)
    }

    /// Drops one reader of each block; unread blocks become evictable (cached) or free.
    pub fn release(&mut self, blocks: &[BlockId]) {
        // The last blocks of a sequence are the least useful to keep: released first, they
        // are evicted first.
        for &b in blocks.iter().rev() {
            let i = b as usize;
            if self.refs[i] == 0 {
                continue;
            }
            self.refs[i] -= 1;
            if self.refs[i] == 0 {
                if self.keys[i].is_some() {
                    self.tick += 1;
                    self.released_at[i] = self.tick;
                    self.evictable.insert(self.tick, b);
                } else {
                    self.free.push_back(b);
                }
            }
        }
    }

    /// Records that the full blocks of `table` hold `tokens` (the sequence's tokens whose
    /// keys and values are computed), so later prompts may share them. Blocks cached
    /// already, and blocks whose prefix another block caches, are left as they are.
    pub fn cache_full_blocks(&mut self, table: &[BlockId], tokens: &[i64]) {
        if !self.prefix_caching {
            return;
        }
        let mut parent = None;
        for (&b, block) in table.iter().zip(tokens.chunks_exact(self.block_size)) {
            let chain = chain_hash(parent, block);
            let i = b as usize;
            match self.by_chain.get(&chain) {
                Some(&owner) if owner == b => {}
                Some(_) => {}
                None if self.keys[i].is_none() => {
                    self.keys[i] = Some(Key {
                        chain,
                        parent,
                        tokens: block.to_vec(),
                    });
                    self.by_chain.insert(chain, b);
                }
                None => {}
            }
            parent = Some(chain);
        }
    }

    fn forget(&mut self, b: BlockId) {
        if let Some(key) = self.keys[b as usize].take() {
            if self.by_chain.get(&key.chain) == Some(&b) {
                self.by_chain.remove(&key.chain);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_handed_out_once_and_come_back() {
        let mut pool = BlockPool::new(4, 2, false);
        let a = pool.take_new(3).unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(pool.available(), 1);
        assert!(pool.take_new(2).is_none(), "only one block is left");
        assert_eq!(pool.available(), 1, "a refused request takes nothing");
        pool.release(&a);
        assert_eq!(pool.available(), 4);
        assert_eq!(pool.in_use(), 0);
    }

    #[test]
    fn a_cached_prefix_is_found_for_full_blocks_only_and_never_the_last_token() {
        let mut pool = BlockPool::new(8, 2, true);
        let tokens = [1, 2, 3, 4, 5];
        let table = pool.take_new(3).unwrap();
        pool.cache_full_blocks(&table, &tokens);
        // Two full blocks cached; the partial third is not.
        assert_eq!(pool.cached_prefix(&[1, 2, 3, 4, 9]), table[..2]);
        // Same tokens: the last token must be computed, so its block is not shared.
        assert_eq!(pool.cached_prefix(&[1, 2, 3, 4]), table[..1]);
        // A different first block shares nothing, even with equal later blocks.
        assert!(pool.cached_prefix(&[7, 2, 3, 4, 5]).is_empty());
        assert_eq!(pool.cached_prefix(&[1, 2, 8, 4, 5]), table[..1]);
    }

    #[test]
    fn shared_blocks_live_until_the_last_reader_and_are_evicted_least_recent_first() {
        let mut pool = BlockPool::new(3, 2, true);
        let a = pool.take_new(2).unwrap();
        pool.cache_full_blocks(&a, &[1, 2, 3, 4]);
        let hit = pool.cached_prefix(&[1, 2, 3, 4, 5]);
        assert_eq!(hit, a);
        pool.take_cached(&hit);
        pool.release(&a);
        assert_eq!(pool.in_use(), 2, "the second reader still holds both");
        pool.release(&hit);
        assert_eq!(pool.in_use(), 0);
        assert_eq!(pool.available(), 3);
        // The never-used block goes first, then the cached ones, the last block first
        // (released first), so the prefix's first block survives longest.
        let one = pool.take_new(1).unwrap();
        assert!(!a.contains(&one[0]));
        assert_eq!(pool.cached_prefix(&[1, 2, 3, 4, 5]), a);
        let two = pool.take_new(1).unwrap();
        assert_eq!(two, [a[1]]);
        assert_eq!(pool.cached_prefix(&[1, 2, 3, 4, 5]), a[..1]);
        let three = pool.take_new(1).unwrap();
        assert_eq!(three, [a[0]]);
        assert!(pool.cached_prefix(&[1, 2, 3, 4, 5]).is_empty());
    }

    #[test]
    fn turning_prefix_caching_off_caches_nothing() {
        let mut pool = BlockPool::new(4, 2, false);
        let a = pool.take_new(2).unwrap();
        pool.cache_full_blocks(&a, &[1, 2, 3, 4]);
        pool.release(&a);
        assert!(pool.cached_prefix(&[1, 2, 3, 4, 5]).is_empty());
    }
}
