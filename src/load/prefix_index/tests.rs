use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;
use std::rc::Rc;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::*;
use crate::shared::{MemoryStore, SetError};

const H1: Holder = Holder { slot: 1, tag: 0xa1 };
const H2: Holder = Holder { slot: 2, tag: 0xb2 };
const H3: Holder = Holder { slot: 3, tag: 0xc3 };
const H4: Holder = Holder { slot: 4, tag: 0xd4 };

/// Epoch milliseconds, as the host's clock gives them.
const T0: u64 = 1_700_000_000_000;

fn all_live(_: &PrefixEntry) -> bool {
    true
}

/// The chain of a prompt made of the given blocks, as the filter computes
/// it: each block's xxh3 seeded with the previous block's hash (the first
/// with a tenant+model seed). Blocks are named by numbers; equal leading
/// numbers are a shared prefix.
fn chain(blocks: &[u32]) -> Vec<u64> {
    let mut seed = 0x5eed_u64;
    blocks
        .iter()
        .map(|block| {
            seed = xxh3_64_with_seed(&block.to_le_bytes(), seed);
            seed
        })
        .collect()
}

fn tables(store: &MemoryStore) -> Tables<&MemoryStore> {
    Tables::new(store, "t", 16)
}

/// The bucket of a span whose first block is `hash` (so also of a
/// one-block chain `[hash]`), as stored.
fn bucket_of(index: &PrefixIndex, store: &MemoryStore, hash: u64) -> PrefixBucket {
    let key = index.key(&tables(store), index.bucket_of(hash));
    decoded(store, &key)
}

fn decoded(store: &MemoryStore, key: &str) -> PrefixBucket {
    store
        .get(key)
        .0
        .as_deref()
        .and_then(PrefixBucket::decode)
        .unwrap_or_default()
}

/// When `holder`'s entry of `hash` was last used, wherever it is stored.
fn last_used(store: &MemoryStore, hash: u64, holder: Holder) -> Option<u32> {
    store
        .keys()
        .iter()
        .find_map(|key| decoded(store, key).last_used(hash, holder))
}

/// True if `holder`'s entry of `hash` is stored.
fn stored(store: &MemoryStore, hash: u64, holder: Holder) -> bool {
    last_used(store, hash, holder).is_some()
}

/// Buckets the blocks of `chain` fall in (one per span, unless spans'
/// first blocks share a bucket).
fn distinct_buckets(index: &PrefixIndex, chain: &[u64]) -> u64 {
    let buckets: BTreeSet<u64> = (0..chain.len())
        .map(|i| index.bucket_of_block(chain, i))
        .collect();
    buckets.len() as u64
}

/// Hashes `0..count` apart by the bucket count: all in bucket `bucket`.
fn same_bucket(index: &PrefixIndex, bucket: u64, count: u64) -> Vec<u64> {
    (0..count).map(|k| bucket + k * index.buckets()).collect()
}

/// Removes `holder`'s entry of `hash` (what an eviction does to it).
fn evict(store: &MemoryStore, hash: u64, holder: Holder) {
    let key = store
        .keys()
        .into_iter()
        .find(|key| decoded(store, key).last_used(hash, holder).is_some())
        .expect("stored before it is evicted");
    let updated = tables(store).update(&key, |bucket: &mut PrefixBucket| {
        bucket
            .entries
            .retain(|e| !(e.hash == hash && e.holder == holder));
        Change::<(), ()>::Write(())
    });
    assert_eq!(updated, Updated::Written(()));
    assert!(!stored(store, hash, holder));
}

/// The longest prefix of `chain` held by a live holder, read afresh.
fn held<S: SharedStore>(index: &PrefixIndex, tables: &Tables<S>, chain: &[u64]) -> Held {
    index.longest_held(tables, chain, &all_live, &mut BucketReads::default())
}

/// Records `holder` as holding `chain` past its first `from` blocks, every
/// holder live, its buckets read afresh.
fn remembered<S: SharedStore>(
    index: &PrefixIndex,
    tables: &Tables<S>,
    chain: &[u64],
    from: usize,
    holder: Holder,
    now_ms: u64,
) -> Remembered {
    index.remember(
        tables,
        chain,
        from,
        holder,
        &all_live,
        now_ms,
        &mut BucketReads::default(),
    )
}

/// Routes one request the way the filter does: look up, then record the
/// chosen holder (the one found if any, else `fallback`) over the lookup's
/// reads.
fn route(
    index: &PrefixIndex,
    tables: &Tables<&MemoryStore>,
    chain: &[u64],
    fallback: Holder,
    now_ms: u64,
) -> (Held, Remembered) {
    let mut reads = BucketReads::default();
    let held = index.longest_held(tables, chain, &all_live, &mut reads);
    let (holder, from) = match held.holders.first() {
        Some(&holder) => (holder, held.blocks),
        None => (fallback, 0),
    };
    let done = index.remember(tables, chain, from, holder, &all_live, now_ms, &mut reads);
    (held, done)
}

#[test]
fn the_budget_buys_whole_buckets_within_its_bounds() {
    assert_eq!(RECORD_BYTES, 1026);
    let full = PrefixBucket {
        entries: (0..ENTRIES as u64)
            .map(|hash| PrefixEntry {
                hash,
                holder: H1,
                last_used: 7,
            })
            .collect(),
    };
    assert_eq!(full.encode().len() as u64, RECORD_BYTES);

    let default = PrefixIndex::new(DEFAULT_BUDGET_BYTES);
    assert_eq!(default.buckets(), 8_176);
    assert_eq!(default.bytes(), 8_388_576);
    assert_eq!(default.capacity(), 523_264);
    // As many 256-byte blocks as 127 MiB of prompt text.
    assert_eq!((default.capacity() * 256) >> 20, 127);

    assert_eq!(PrefixIndex::new(MIN_BUDGET_BYTES).buckets(), 63);
    assert_eq!(PrefixIndex::new(MAX_BUDGET_BYTES).buckets(), 261_632);
    assert_eq!(PrefixIndex::new(0), PrefixIndex::new(MIN_BUDGET_BYTES));
    assert_eq!(
        PrefixIndex::new(MIN_BUDGET_BYTES - 1),
        PrefixIndex::new(MIN_BUDGET_BYTES)
    );
    assert_eq!(
        PrefixIndex::new(u64::MAX),
        PrefixIndex::new(MAX_BUDGET_BYTES)
    );
    for budget in [
        MIN_BUDGET_BYTES,
        MIN_BUDGET_BYTES + 1,
        MIN_BUDGET_BYTES + RECORD_BYTES,
        1_000_000,
        DEFAULT_BUDGET_BYTES,
        MAX_BUDGET_BYTES - 1,
        MAX_BUDGET_BYTES,
    ] {
        let index = PrefixIndex::new(budget);
        assert!(index.bytes() <= budget, "{budget}: over budget");
        assert!(
            budget - index.bytes() < RECORD_BYTES,
            "{budget}: a whole bucket more would fit"
        );
        assert_eq!(index.bytes(), index.buckets() * RECORD_BYTES);
        assert_eq!(index.capacity(), index.buckets() * ENTRIES as u64);
    }
}

#[test]
fn buckets_round_trip_and_anything_else_decodes_as_none() {
    let bucket = PrefixBucket {
        entries: (0..ENTRIES as u64)
            .map(|k| PrefixEntry {
                hash: u64::MAX - k,
                holder: Holder {
                    slot: k as u16,
                    tag: 0xffff - k as u16,
                },
                last_used: u32::MAX - k as u32,
            })
            .collect(),
    };
    let bytes = bucket.encode();
    assert_eq!(PrefixBucket::decode(&bytes), Some(bucket.clone()));
    assert_eq!(
        PrefixBucket::decode(&PrefixBucket::default().encode()),
        Some(PrefixBucket::default())
    );
    for cut in 0..bytes.len() {
        assert_eq!(PrefixBucket::decode(bytes.get(..cut).unwrap()), None);
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert_eq!(PrefixBucket::decode(&longer), None, "trailing byte");
    let mut other_version = bytes.clone();
    other_version[0] = 1;
    assert_eq!(PrefixBucket::decode(&other_version), None);
    let mut too_many = vec![BUCKET_VERSION, ENTRIES as u8 + 1];
    too_many.extend(std::iter::repeat_n(0, 16 * (ENTRIES + 1)));
    assert_eq!(PrefixBucket::decode(&too_many), None);
    // No other table's record reads as a bucket.
    for seed in [
        &include_bytes!("../../../fuzz/seeds/records/instance")[..],
        include_bytes!("../../../fuzz/seeds/records/epoch"),
        include_bytes!("../../../fuzz/seeds/records/lease"),
        include_bytes!("../../../fuzz/seeds/records/pending"),
        include_bytes!("../../../fuzz/seeds/records/route"),
        include_bytes!("../../../fuzz/seeds/records/mark"),
        b"",
        &[0xff; 40],
    ] {
        assert_eq!(PrefixBucket::decode(seed), None, "{seed:?}");
    }
}

#[test]
fn the_longest_held_prefix_is_found_among_chains_sharing_prefixes() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(DEFAULT_BUDGET_BYTES);
    let a = chain(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
    let b = chain(&[1, 2, 3, 4, 50, 60, 70]);
    remembered(&index, &tables, &a, 0, H1, T0);
    remembered(&index, &tables, &b, 0, H2, T0);

    let cases: [(&[u32], usize, &[Holder]); 10] = [
        (&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 10, &[H1]),
        (&[1, 2, 3, 4, 50, 60, 70], 7, &[H2]),
        // Shares 7 blocks with a, 4 with b.
        (&[1, 2, 3, 4, 5, 6, 7, 99], 7, &[H1]),
        // Shares 4 with both: both hold block 4.
        (&[1, 2, 3, 4, 99], 4, &[H1, H2]),
        (&[1, 2, 3, 4, 50, 99, 99, 99, 99], 5, &[H2]),
        (&[1, 99], 1, &[H1, H2]),
        (&[99, 2, 3], 0, &[]),
        // A strict prefix of a, and a extended.
        (&[1, 2, 3, 4, 5], 5, &[H1]),
        (&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], 10, &[H1]),
        (&[], 0, &[]),
    ];
    for (blocks, want, holders) in cases {
        let held = held(&index, &tables, &chain(blocks));
        let mut got = held.holders.clone();
        got.sort_by_key(|h| h.slot);
        assert_eq!((held.blocks, got.as_slice()), (want, holders), "{blocks:?}");
    }
    // The same blocks under another tenant+model seed share nothing.
    let other_seed: Vec<u64> = a.iter().map(|h| h ^ 1).collect();
    assert_eq!(held(&index, &tables, &other_seed).blocks, 0);
}

#[test]
fn only_the_holders_of_the_longest_block_are_named() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(DEFAULT_BUDGET_BYTES);
    let long = chain(&[1, 2, 3, 4, 5, 6]);
    remembered(&index, &tables, &long, 0, H1, T0);
    remembered(&index, &tables, &long[..3], 0, H2, T0);
    remembered(&index, &tables, &long[..3], 0, H3, T0);
    assert_eq!(
        held(&index, &tables, &long),
        Held {
            blocks: 6,
            holders: vec![H1]
        }
    );
    let mut short = held(&index, &tables, &long[..3]);
    short.holders.sort_by_key(|h| h.slot);
    assert_eq!(
        short,
        Held {
            blocks: 3,
            holders: vec![H1, H2, H3]
        }
    );
    // Without H1, the longest held is H2's and H3's three blocks.
    let not_h1 = |e: &PrefixEntry| e.holder != H1;
    let mut without = index.longest_held(&tables, &long, &not_h1, &mut BucketReads::default());
    without.holders.sort_by_key(|h| h.slot);
    assert_eq!(
        without,
        Held {
            blocks: 3,
            holders: vec![H2, H3]
        }
    );
}

#[test]
fn holders_that_are_not_live_never_match_and_are_evicted_first() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(MIN_BUDGET_BYTES);
    let prompt = chain(&[1, 2, 3, 4]);
    remembered(&index, &tables, &prompt, 0, H1, T0);
    let h1_gone = |e: &PrefixEntry| e.holder != H1;
    assert_eq!(
        index.longest_held(&tables, &prompt, &h1_gone, &mut BucketReads::default()),
        Held::default()
    );
    // Its slot reused by another address: the old tag is not believed.
    let reused = Holder::new(H1.slot, 0x1234_5678_9abc_def0);
    assert_eq!(reused.tag, 0x1234);
    let only_reused = |e: &PrefixEntry| e.holder == reused;
    assert_eq!(
        index
            .longest_held(&tables, &prompt, &only_reused, &mut BucketReads::default())
            .blocks,
        0
    );

    // A full bucket: H2's entry is the newest, but H2 is gone.
    let store = MemoryStore::new();
    let tables = self::tables(&store);
    let hashes = same_bucket(&index, 7, ENTRIES as u64 + 1);
    for (k, &hash) in hashes.iter().take(ENTRIES).enumerate() {
        let holder = if k == ENTRIES - 1 { H2 } else { H3 };
        let done = remembered(&index, &tables, &[hash], 0, holder, T0 + k as u64 * 1000);
        assert_eq!(done.filled, 1);
    }
    let h2_gone = |e: &PrefixEntry| e.holder != H2;
    let done = index.remember(
        &tables,
        &hashes[ENTRIES..],
        0,
        H3,
        &h2_gone,
        T0 + 99_000,
        &mut BucketReads::default(),
    );
    assert_eq!((done.written, done.evicted, done.filled), (1, 1, 0));
    assert!(!stored(&store, hashes[ENTRIES - 1], H2), "gone first");
    for &hash in &hashes[..ENTRIES - 1] {
        assert!(stored(&store, hash, H3), "older, but live");
    }
    assert!(stored(&store, hashes[ENTRIES], H3));
}

#[test]
fn a_full_bucket_evicts_the_least_recently_used_in_order() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(MIN_BUDGET_BYTES);
    let hashes = same_bucket(&index, 3, ENTRIES as u64 + 3);
    // Stored oldest first; a filled bucket is not written again.
    for (k, &hash) in hashes.iter().take(ENTRIES).enumerate() {
        remembered(&index, &tables, &[hash], 0, H1, T0 + k as u64 * 1000);
    }
    // The oldest one used again: now the second oldest is least recent.
    let refreshed = remembered(&index, &tables, &[hashes[0]], 0, H1, T0 + 100_000);
    assert_eq!((refreshed.written, refreshed.filled), (1, 0));
    for (k, &hash) in hashes[ENTRIES..].iter().enumerate() {
        let done = remembered(&index, &tables, &[hash], 0, H1, T0 + 200_000);
        assert_eq!(done.evicted, 1);
        assert_eq!(bucket_of(&index, &store, hash).entries.len(), ENTRIES);
        // Evicted so far: hashes[1..=k+1], in age order.
        for (j, &old) in hashes.iter().enumerate().take(ENTRIES) {
            let evicted = (1..=k + 1).contains(&j);
            assert_eq!(!stored(&store, old, H1), evicted, "{k} {j}");
        }
    }
    // A bucket full of one call's own blocks keeps the last ones.
    let index = PrefixIndex::new(MIN_BUDGET_BYTES);
    let store = MemoryStore::new();
    let tables = self::tables(&store);
    let many = same_bucket(&index, 5, ENTRIES as u64 + 2);
    let done = remembered(&index, &tables, &many, 0, H1, T0);
    assert_eq!(
        (done.written, done.filled, done.evicted),
        (ENTRIES as u32 + 2, ENTRIES as u32, 2)
    );
    assert_eq!(bucket_of(&index, &store, many[0]).entries.len(), ENTRIES);
    assert!(stored(&store, many[ENTRIES + 1], H1));
}

#[test]
fn a_pair_is_stored_once_and_several_holders_of_a_block_coexist() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(DEFAULT_BUDGET_BYTES);
    let prompt = chain(&[1, 2, 3]);
    for holder in [H1, H2, H1, H3, H2] {
        remembered(&index, &tables, &prompt, 0, holder, T0);
    }
    let later = T0 + u64::from(REFRESH_SECS) * 1000;
    remembered(&index, &tables, &prompt, 0, H1, later);
    // The chain is one span: one bucket.
    let bucket = bucket_of(&index, &store, prompt[0]);
    for &hash in &prompt {
        let mut pairs: Vec<(u64, u16)> = bucket
            .entries
            .iter()
            .filter(|e| e.hash == hash)
            .map(|e| (e.hash, e.holder.slot))
            .collect();
        pairs.sort_unstable();
        assert_eq!(pairs, vec![(hash, 1), (hash, 2), (hash, 3)]);
        assert_eq!(bucket.last_used(hash, H1), Some((later / 1000) as u32));
        assert_eq!(bucket.last_used(hash, H2), Some((T0 / 1000) as u32));
    }
}

/// The steady case (a prompt its instance already holds): one read, no
/// write until the holding is due a refresh; then one write per bucket.
#[test]
fn a_held_prompt_costs_one_read_and_no_write_until_its_refresh() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(DEFAULT_BUDGET_BYTES);
    // 8 KiB of prompt in 256-byte blocks: 8 spans.
    let prompt = chain(&(1..=32).collect::<Vec<_>>());
    let buckets = distinct_buckets(&index, &prompt);
    assert_eq!(buckets, 8, "this chain's spans share no bucket");
    route(&index, &tables, &prompt, H1, T0);

    let due = T0 + u64::from(REFRESH_SECS) * 1000;
    for now in [T0 + 1000, due - 1000] {
        let (reads, writes) = (store.reads(), store.successful_sets());
        let (held, done) = route(&index, &tables, &prompt, H2, now);
        assert_eq!((held.blocks, held.holders), (32, vec![H1]));
        assert_eq!(done, Remembered::default());
        assert_eq!(
            store.reads() - reads,
            1,
            "one lookup probe, the check on its read"
        );
        assert_eq!(store.successful_sets() - writes, 0);
    }
    // Due: every bucket rewritten once (the lookup's read reused).
    let (reads, writes) = (store.reads(), store.successful_sets());
    let (_, done) = route(&index, &tables, &prompt, H2, due);
    assert_eq!(done.written, 32);
    assert_eq!(store.reads() - reads, buckets);
    assert_eq!(store.successful_sets() - writes, buckets);
    // And quiet again.
    let (reads, writes) = (store.reads(), store.successful_sets());
    route(&index, &tables, &prompt, H2, due + 1000);
    assert_eq!(
        (store.reads() - reads, store.successful_sets() - writes),
        (1, 0)
    );
}

#[test]
fn a_new_chain_costs_a_binary_search_over_its_spans_and_one_write_per_span() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(DEFAULT_BUDGET_BYTES);
    let prompt = chain(&(1..=64).collect::<Vec<_>>());
    let buckets = distinct_buckets(&index, &prompt);
    assert_eq!(buckets, 16, "this chain's 16 spans share no bucket");
    let mut reads = BucketReads::default();
    let before = store.reads();
    let held = index.longest_held(&tables, &prompt, &all_live, &mut reads);
    assert_eq!(held, Held::default());
    let lookup_reads = store.reads() - before;
    assert_eq!(lookup_reads, 1 + 4, "the last span, then log2(16)");

    let (before, writes) = (store.reads(), store.successful_sets());
    let done = index.remember(&tables, &prompt, 0, H1, &all_live, T0, &mut reads);
    assert_eq!(
        done,
        Remembered {
            written: 64,
            filled: 64,
            evicted: 0,
            failed: 0
        }
    );
    assert_eq!(
        store.reads() - before,
        buckets - lookup_reads,
        "the buckets the lookup read are not read again"
    );
    assert_eq!(store.successful_sets() - writes, buckets);
    assert_eq!(store.len() as u64, buckets);
    assert!(prompt.iter().all(|&h| stored(&store, h, H1)));

    // The conversation goes on: 64 more blocks after the 64 held.
    let longer = chain(&(1..=128).collect::<Vec<_>>());
    let mut reads = BucketReads::default();
    let before = store.reads();
    let held = index.longest_held(&tables, &longer, &all_live, &mut reads);
    assert_eq!((held.blocks, held.holders), (64, vec![H1]));
    let lookup_reads = store.reads() - before;
    assert!(lookup_reads <= 1 + 5, "{lookup_reads}: over 1 + log2(32)");
    let (before, writes) = (store.reads(), store.successful_sets());
    let done = index.remember(&tables, &longer, 64, H1, &all_live, T0 + 1000, &mut reads);
    assert_eq!((done.written, done.filled), (64, 64));
    // Each bucket the lookup and the recording need is read once: the
    // check's (the 64th block's span) and the 16 new spans'.
    let needed: BTreeSet<u64> = (63..128)
        .map(|i| index.bucket_of_block(&longer, i))
        .collect();
    assert_eq!(lookup_reads + store.reads() - before, needed.len() as u64);
    assert_eq!(store.successful_sets() - writes, needed.len() as u64 - 1);
}

/// A new prompt Envoy placed (Maglev: no instance list), as the tracker
/// drives the index: the decision's lookup, then at the response, in a new
/// callback, the serving instance's lookup and the recording over that
/// lookup's reads. A 4 KiB prefix (16 blocks, 4 spans): 3 reads, then 4
/// reads and 4 writes.
#[test]
fn a_new_prompt_placed_by_maglev_costs_three_reads_then_four_reads_and_four_writes() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(DEFAULT_BUDGET_BYTES);
    let prompt = chain(&(1..=16).collect::<Vec<_>>());
    assert_eq!(distinct_buckets(&index, &prompt), 4);
    let before = store.reads();
    let held = held(&index, &tables, &prompt);
    assert_eq!(held, Held::default());
    assert_eq!(store.reads() - before, 3, "the last span, then log2(4)");

    let (before, writes) = (store.reads(), store.successful_sets());
    let mut reads = BucketReads::default();
    let served = |e: &PrefixEntry| e.holder == H1;
    let known = index
        .longest_held(&tables, &prompt, &served, &mut reads)
        .blocks;
    assert_eq!(known, 0);
    let done = index.remember(&tables, &prompt, known, H1, &all_live, T0, &mut reads);
    assert_eq!((done.written, done.filled), (16, 16));
    assert_eq!(
        (store.reads() - before, store.successful_sets() - writes),
        (4, 4)
    );
    assert_eq!(
        index
            .longest_held(&tables, &prompt, &served, &mut reads)
            .blocks,
        16
    );
}

/// Along a growing conversation every block of the chain stays younger
/// than the refresh interval, the first ones included, while turns within
/// the interval write only their new blocks.
#[test]
fn a_growing_conversation_keeps_its_early_blocks_fresh() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(DEFAULT_BUDGET_BYTES);
    let mut refreshes = 0;
    for turn in 0..40u32 {
        let now = T0 + u64::from(turn) * 3000;
        let prompt = chain(&(0..2 * turn + 2).collect::<Vec<_>>());
        let (held, done) = route(&index, &tables, &prompt, H1, now);
        assert_eq!(held.blocks, if turn == 0 { 0 } else { prompt.len() - 2 });
        if done.written > 2 {
            refreshes += 1;
        }
        let ages: Vec<u32> = prompt
            .iter()
            .map(|&h| {
                let used = last_used(&store, h, H1);
                (now / 1000) as u32 - used.unwrap_or(0)
            })
            .collect();
        assert!(
            ages.iter().all(|&age| age < REFRESH_SECS),
            "turn {turn}: {ages:?}"
        );
        assert!(
            ages.windows(2).all(|w| w[0] <= w[1]),
            "turn {turn}: an early block older than a later one: {ages:?}"
        );
    }
    // Every 3 s, refreshed every 4th turn (12 s >= 10 s).
    assert_eq!(refreshes, 9);
}

/// A store that runs another VM's work right after the `at`-th read: that
/// VM writes between this VM's read and its compare-and-swap.
struct Racing<'a> {
    inner: Rc<MemoryStore>,
    reads: Cell<u32>,
    at: u32,
    between: RefCell<Option<Box<dyn FnOnce() + 'a>>>,
}

impl SharedStore for Racing<'_> {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        let read = self.inner.get(key);
        self.reads.set(self.reads.get() + 1);
        if self.reads.get() == self.at {
            if let Some(between) = self.between.borrow_mut().take() {
                between();
            }
        }
        read
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.inner.set(key, value, cas)
    }
}

#[test]
fn two_vms_writing_one_bucket_lose_nothing() {
    let store = Rc::new(MemoryStore::new());
    let index = PrefixIndex::new(MIN_BUDGET_BYTES);
    let hashes = same_bucket(&index, 11, 3);
    let vm_b = Tables::new(Rc::clone(&store), "t", 16);
    let vm_a = Tables::new(
        Racing {
            inner: Rc::clone(&store),
            reads: Cell::new(0),
            at: 1,
            between: RefCell::new(Some(Box::new(|| {
                let done = remembered(&index, &vm_b, &hashes[1..], 0, H2, T0);
                assert_eq!(done.filled, 2, "vm b's write went first");
            }))),
        },
        "t",
        16,
    );
    let writes = store.successful_sets();
    let done = remembered(&index, &vm_a, &hashes[..2], 0, H1, T0);
    assert_eq!((done.written, done.filled, done.failed), (2, 2, 0));
    assert_eq!(store.successful_sets() - writes, 2, "b's write, then a's");
    assert_eq!(
        store.reads(),
        1 + 1 + 1,
        "a's read, b's read, a's read again after its CAS failed"
    );
    let bucket = bucket_of(&index, &store, hashes[0]);
    let mut entries: Vec<(u64, Holder)> =
        bucket.entries.iter().map(|e| (e.hash, e.holder)).collect();
    entries.sort_by_key(|(hash, holder)| (*hash, holder.slot));
    assert_eq!(
        entries,
        vec![
            (hashes[0], H1),
            (hashes[1], H1),
            (hashes[1], H2),
            (hashes[2], H2)
        ]
    );
    assert_eq!(store.keys().len(), 1);
}

#[test]
fn a_flood_of_prefixes_stays_within_the_buckets_and_counts_its_evictions() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(MIN_BUDGET_BYTES);
    let holders = [H1, H2, H3, H4];
    let prefixes = 50_000u32;
    let mut total = Remembered::default();
    // A shared system prompt of one span, then a block of its own (in a
    // span of its own: see the next test for blocks that share a span).
    let prompt_of = |i: u32| chain(&[0, 0, 0, 0, i + 1]);
    for i in 0..prefixes {
        let prompt = prompt_of(i);
        let fallback = holders[i as usize % holders.len()];
        let (_, done) = route(&index, &tables, &prompt, fallback, T0 + u64::from(i) * 10);
        total.add(done);
    }
    let keys = store.keys();
    assert!(keys.len() as u64 <= index.buckets(), "{} keys", keys.len());
    let mut entries = 0;
    for key in &keys {
        let bucket = store.get(key).0.as_deref().and_then(PrefixBucket::decode);
        let bucket = bucket.unwrap_or_else(|| panic!("{key} does not decode"));
        assert!(bucket.entries.len() <= ENTRIES);
        entries += bucket.entries.len() as u32;
    }
    assert_eq!(total.failed, 0);
    assert_eq!(total.filled, entries, "every stored entry was filled once");
    assert!(u64::from(entries) <= index.capacity());
    assert!(
        total.evicted >= prefixes - entries,
        "{} evicted, {entries} stored",
        total.evicted
    );
    // The newest prefixes are still found whole, the first ones are not.
    let last = prefixes - 50..prefixes;
    for i in last {
        assert_eq!(held(&index, &tables, &prompt_of(i)).blocks, 5, "{i}");
    }
    let first_found = (0..50)
        .filter(|i| held(&index, &tables, &prompt_of(*i)).blocks == 5)
        .count();
    assert_eq!(first_found, 0);
    // The shared system prompt, used by every request, is still held.
    assert_eq!(held(&index, &tables, &chain(&[0, 0, 0, 0])).blocks, 4);
}

/// Prompts that agree up to a span's start and differ inside it (here:
/// one shared block, then one of their own) keep their blocks of that span
/// in its one bucket: the most recent ones stay, LRU, within the bounds;
/// a prompt that goes on past that span is still found past it.
#[test]
fn prompts_that_differ_inside_a_span_share_its_bucket_and_the_newest_stay() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(DEFAULT_BUDGET_BYTES);
    let holders = [H1, H2, H3, H4];
    let prompts = 1000u32;
    let prompt_of = |i: u32| chain(&[0, i + 1]);
    let mut total = Remembered::default();
    for i in 0..prompts {
        let holder = holders[i as usize % holders.len()];
        // One per refresh interval: each is stamped with its own time, so
        // LRU tells every prompt's entries apart.
        let now = T0 + u64::from(i) * u64::from(REFRESH_SECS) * 1000;
        let prompt = prompt_of(i);
        let mut reads = BucketReads::default();
        let held = index.longest_held(&tables, &prompt, &all_live, &mut reads);
        let from = if held.holders.contains(&holder) {
            held.blocks
        } else {
            0
        };
        total.add(index.remember(&tables, &prompt, from, holder, &all_live, now, &mut reads));
    }
    assert_eq!(store.keys().len(), 1, "one span: one bucket");
    let bucket = bucket_of(&index, &store, prompt_of(0)[0]);
    assert_eq!(bucket.entries.len(), ENTRIES);
    assert_eq!(total.failed, 0);
    // The shared block's entry of each holder, and the newest own blocks.
    let kept = ENTRIES as u32 - holders.len() as u32;
    let found = |i: u32| held(&index, &tables, &prompt_of(i)).blocks;
    for i in prompts - kept..prompts {
        assert_eq!(found(i), 2, "{i}");
    }
    assert_eq!(found(prompts - kept - 1), 1, "older: only the shared block");
    assert_eq!(found(0), 1);
    // Such a prompt that went on past its first span is found whole after
    // its first span's own blocks were evicted: the later spans are its own.
    let store = MemoryStore::new();
    let tables = self::tables(&store);
    let long = chain(&[0, 1, 2, 3, 4, 5, 6]);
    remembered(&index, &tables, &long, 0, H1, T0);
    for &i in &[1, 2, 3] {
        evict(&store, long[i], H1);
    }
    let held = held(&index, &tables, &long);
    assert_eq!((held.blocks, held.holders), (7, vec![H1]));
}

/// Eviction can remove a block while later blocks of its chain stay; the
/// binary search then still answers a block that is held.
#[test]
fn a_chain_with_an_evicted_block_still_gets_a_true_match() {
    let prompt = chain(&(1..=10).collect::<Vec<_>>());
    let index = PrefixIndex::new(DEFAULT_BUDGET_BYTES);
    let setup = |evicted: &[usize]| {
        let store = MemoryStore::new();
        remembered(&index, &tables(&store), &prompt, 0, H1, T0);
        for &i in evicted {
            evict(&store, prompt[i], H1);
        }
        store
    };
    // Every single block evicted in turn.
    for i in 0..prompt.len() {
        let store = setup(&[i]);
        let held = held(&index, &tables(&store), &prompt);
        assert_ne!(held.blocks, i + 1, "block {i} is held by nobody");
        assert!(held.blocks > 0, "{i}");
        assert!(stored(&store, prompt[held.blocks - 1], H1), "{i}");
        assert_eq!(held.holders, vec![H1]);
    }
    // The last block gone: the match stops before it.
    let store = setup(&[9]);
    assert_eq!(held(&index, &tables(&store), &prompt).blocks, 9);
    // A middle block gone: the full chain is still held (its hash stands
    // for the whole prefix), so the match is longer than the unbroken run.
    let store = setup(&[4]);
    assert_eq!(held(&index, &tables(&store), &prompt).blocks, 10);
    // Blocks 5 and 10 gone: the last span still holds block 9.
    let store = setup(&[4, 9]);
    assert_eq!(held(&index, &tables(&store), &prompt).blocks, 9);
    // 16 blocks (4 spans), the second and the last span gone: the search's
    // probe of the second misses, and the answer is the shorter 4 although
    // 12 is held.
    let long = chain(&(1..=16).collect::<Vec<_>>());
    let store = MemoryStore::new();
    remembered(&index, &tables(&store), &long, 0, H1, T0);
    for i in (4..8).chain(12..16) {
        evict(&store, long[i], H1);
    }
    assert!(stored(&store, long[11], H1));
    assert_eq!(
        held(&index, &tables(&store), &long),
        Held {
            blocks: 4,
            holders: vec![H1]
        }
    );
    // Recording the chain again heals it, the evicted blocks included.
    remembered(&index, &tables(&store), &long, 4, H1, T0 + 1000);
    assert!(long.iter().all(|&h| stored(&store, h, H1)));
    assert_eq!(held(&index, &tables(&store), &long).blocks, 16);
}

#[test]
fn a_recorded_block_whose_entry_is_missing_rewrites_the_whole_chain() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(DEFAULT_BUDGET_BYTES);
    let prompt = chain(&[1, 2, 3, 4]);
    remembered(&index, &tables, &prompt, 0, H1, T0);
    evict(&store, prompt[1], H1);
    evict(&store, prompt[3], H1);
    // Claimed held through block 4, but its entry is gone: all rewritten.
    let done = remembered(&index, &tables, &prompt, 4, H1, T0 + 1000);
    assert_eq!((done.written, done.filled), (4, 2));
    assert!(prompt.iter().all(|&h| stored(&store, h, H1)));
}

#[test]
fn garbage_in_a_bucket_reads_as_empty_and_is_replaced() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(DEFAULT_BUDGET_BYTES);
    let prompt = chain(&[1]);
    let key = index.key(&tables, index.bucket_of(prompt[0]));
    store.set(&key, b"written by another build", None).unwrap();
    assert_eq!(held(&index, &tables, &prompt), Held::default());
    let done = remembered(&index, &tables, &prompt, 0, H1, T0);
    assert_eq!(done.filled, 1);
    assert_eq!(store.keys(), vec![key]);
    assert_eq!(held(&index, &tables, &prompt).blocks, 1);
}

/// A store whose every write the host refuses.
struct Refusing(MemoryStore);

impl SharedStore for Refusing {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.0.get(key)
    }
    fn set(&self, _: &str, _: &[u8], _: Option<u32>) -> Result<(), SetError> {
        Err(SetError::Failed)
    }
}

#[test]
fn refused_writes_count_as_failed_blocks() {
    let store = Refusing(MemoryStore::new());
    let tables = Tables::new(&store, "t", 16);
    let index = PrefixIndex::new(DEFAULT_BUDGET_BYTES);
    let prompt = chain(&[1, 2, 3, 4, 5]);
    let done = remembered(&index, &tables, &prompt, 0, H1, T0);
    assert_eq!(
        done,
        Remembered {
            written: 0,
            filled: 0,
            evicted: 0,
            failed: 5
        }
    );
    assert!(store.0.is_empty());
}

/// New blocks of a growing chain are stamped with the time of the block
/// before them, which can be older than the bucket's other entries; the
/// blocks one call writes still do not evict each other while others remain.
#[test]
fn a_call_does_not_evict_the_blocks_it_just_wrote() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(MIN_BUDGET_BYTES);
    let n = index.buckets();
    // A first span in bucket 1; the second span (x, y) in bucket 9.
    let first = [1 + 3 * n, 1 + 4 * n, 1 + 5 * n, 1 + 6 * n];
    let [x, y] = [9 + n, 9 + 2 * n];
    remembered(&index, &tables, &first, 0, H1, T0);
    for (k, &hash) in same_bucket(&index, 9, 100)
        .iter()
        .skip(3)
        .take(ENTRIES)
        .enumerate()
    {
        remembered(&index, &tables, &[hash], 0, H2, T0 + 5000 + k as u64);
    }
    let prompt = [first[0], first[1], first[2], first[3], x, y];
    let done = remembered(&index, &tables, &prompt, 4, H1, T0 + 6000);
    assert_eq!((done.written, done.evicted), (2, 2));
    let bucket = bucket_of(&index, &store, x);
    assert_eq!(bucket.last_used(x, H1), Some((T0 / 1000) as u32));
    assert_eq!(bucket.last_used(y, H1), Some((T0 / 1000) as u32));
    let others = bucket.entries.iter().filter(|e| e.holder == H2).count();
    assert_eq!(others, ENTRIES - 2);
}

#[test]
fn blocks_sharing_a_bucket_are_written_in_one_update() {
    let store = MemoryStore::new();
    let tables = tables(&store);
    let index = PrefixIndex::new(MIN_BUDGET_BYTES);
    let n = index.buckets();
    // Three spans: the first two start in bucket 20, the third in 21.
    let prompt = [20, 1, 2, 3, 20 + n, 4, 5, 6, 21 + 2 * n];
    let done = remembered(&index, &tables, &prompt, 0, H1, T0);
    assert_eq!((done.written, done.filled), (9, 9));
    assert_eq!((store.reads(), store.successful_sets()), (2, 2));
    assert_eq!(store.keys().len(), 2);
    assert_eq!(bucket_of(&index, &store, 20).entries.len(), 8);
    assert_eq!(bucket_of(&index, &store, 21).entries.len(), 1);
    // Due a refresh: again one read and one write per bucket.
    let later = T0 + u64::from(REFRESH_SECS) * 1000;
    let (reads, writes) = (store.reads(), store.successful_sets());
    let done = remembered(&index, &tables, &prompt, 9, H1, later);
    assert_eq!(done.written, 9);
    assert_eq!(
        (store.reads() - reads, store.successful_sets() - writes),
        (2, 2),
        "the check's read of bucket 21 reused"
    );
}
