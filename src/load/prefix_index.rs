//! The prefix index: which instances hold which prompt blocks, shared by all
//! worker VMs of one Envoy, so that LONGEST_PREFIX routing sends a request to
//! the instance that already holds the longest prefix of its prompt (its KV
//! cache can skip recomputing it).
//!
//! What is indexed: the caller cuts a prompt into blocks and hashes them as a
//! chain (block i's hash is seeded with block i-1's), so `chain[i]` stands
//! for the whole prefix through block i. After routing, the chosen instance
//! is recorded as holding every block of the chain; a lookup finds the longest
//! `n` such that a live instance holds `chain[n-1]`. An instance's entries
//! last used at or before its forget mark are not believed: its engine
//! reported that it no longer holds a prefix used then (`usage::check`).
//!
//! Layout: shared data has no delete, no TTL and no size cap, so the index is
//! a fixed number N of keys, `prefix/<b>` for b < N, computed from a byte
//! budget ([`PrefixIndex::new`]). The chain is cut into spans of
//! [`SPAN_BLOCKS`] (4) consecutive blocks, and every block of a span lives in
//! the bucket of the span's first block: its hash mod N (the hashes are xxh3
//! outputs, already uniform). So one write records four blocks, and one read
//! shows how far into a span a prompt is held: a new 16-block prompt costs
//! four bucket writes, not sixteen, and every block is still recorded, so a
//! match is as long as what was sent (a conversation's next turn matches
//! every full block of the last one, a document's next question every block
//! up to where the questions differ). Each bucket is one [`Record`] of at
//! most [`ENTRIES`] (64) entries of [`ENTRY_BYTES`] bytes: block hash (u64),
//! holder slot (u16), holder tag (u16), last used (u32 seconds), plus a
//! version and a count byte: [`RECORD_BYTES`] (1,026) bytes at most. Sixteen
//! spans' worth of entries let a bucket hold a hot prefix's span for several
//! instances beside other prefixes' spans: with only a few ways, which spans
//! happen to share a bucket, rather than their age, would decide what is
//! evicted. The price of spans: prompts that agree up to a span's start and
//! differ inside it put their blocks of that span in one bucket, which
//! keeps the most recent sixteen or so of them; their later spans are each
//! their own, so a prompt that outgrew that span is still found past it.
//! Chat prompts avoid it where it would hurt most: `PromptBlocks` pads the
//! system messages to whole spans, so conversations behind one system
//! prompt begin their own text in spans of their own. The default
//! budget of 8 MiB buys 8,176 buckets: 523,264 entries, as many 256-byte
//! blocks as 127 MiB of prompt text held by one instance each. Outside the
//! budget, Envoy also keeps each key's name
//! (`prefix-router/<namespace>/v2/prefix/<b>`, about 40 bytes) and its map
//! entry.
//!
//! Eviction, within a full bucket: an entry not believed (its holder gone,
//! or past its forget mark) first, else the least recently used one; an entry written by
//! the same call last. The same (block, holder) pair is never stored twice (it
//! is refreshed instead); several holders of one block coexist.
//!
//! Cost (each shared-data read or write is a host call of a few us): a lookup
//! reads the chain's last span (a repeated prompt, or one that ends in the
//! span where the held prefix ends: one read), then binary-searches the
//! spans, at most 1 + ceil(log2(spans)) reads; the buckets one decision read
//! are kept in a [`BucketReads`] and not read again by its other lookups or
//! by its recording. Recording a chain the instance already holds writes
//! nothing while that holding was last refreshed less than [`REFRESH_SECS`]
//! ago; new blocks cost one read-modify-CAS ([`Tables::update`]) per bucket
//! touched, starting from the lookup's read where there is one. Measured
//! with `MemoryStore` (tests below): a held 32-block prompt, lookup and
//! record, 1 read and 0 writes (2 and 0 with one bucket per block); a new
//! 16-block prompt placed by Maglev, 3 reads at the decision, then 4 reads
//! and 4 writes at its response (5, then 5 + 16 reads and 16 writes); a new
//! 64-block prompt (16 spans), 5 reads to look it up and, with those reads
//! reused, 11 more reads and 16 writes to record it (7, then 64 and 64).

use super::codec::{decode_list, encode_list};
use super::table::{Change, Read, Record, Tables, Updated};
use crate::shared::SharedStore;

/// First byte of a bucket record; no other record of the shared tables
/// starts with it, so a value of another table never decodes as a bucket.
const BUCKET_VERSION: u8 = 0x50;

/// Consecutive blocks of a chain whose entries share one bucket (the bucket
/// of the span's first block). Four: the overhead benchmark's 16-block
/// prompts cost four bucket writes, while a bucket stays about a kilobyte.
pub(crate) const SPAN_BLOCKS: usize = 4;

/// Entries per bucket (the bucket's ways): sixteen spans' worth.
pub(crate) const ENTRIES: usize = 16 * SPAN_BLOCKS;

/// Encoded size of one entry: hash 8, slot 2, tag 2, last used 4.
pub(crate) const ENTRY_BYTES: u64 = 16;

/// Encoded size of a full bucket: version, count, entries.
pub(crate) const RECORD_BYTES: u64 = 2 + ENTRY_BYTES * ENTRIES as u64;

/// Smallest budget (64 KiB: 63 buckets).
pub(crate) const MIN_BUDGET_BYTES: u64 = 64 << 10;
/// Largest budget (256 MiB: 261,632 buckets).
pub(crate) const MAX_BUDGET_BYTES: u64 = 256 << 20;
/// Default budget (8 MiB: 8,176 buckets, 523,264 entries).
pub(crate) const DEFAULT_BUDGET_BYTES: u64 = 8 << 20;

/// An instance's holding is refreshed (its entries' last-used time set to now)
/// when it was last refreshed this long ago or more. Until then recording it
/// again writes nothing. The price: within a bucket, least-recently-used is
/// exact to this many seconds only, so an active prefix can lose to newer
/// entries only in a bucket whose entries all turn over faster than this (at
/// the default budget, over 50,000 new entries a second). A refresh costs one
/// read and at most one write per bucket of the chain.
pub(crate) const REFRESH_SECS: u32 = 10;

/// An instance as the index knows it: its registry slot and a 16-bit tag of
/// its address hash, so that entries of an address whose slot was reused by
/// another address are not believed (one in 65,536 reuses is).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Holder {
    pub(crate) slot: u16,
    pub(crate) tag: u16,
}

impl Holder {
    /// The holder of the instance in `slot` whose address hashes to `addr_hash`.
    pub(crate) fn new(slot: u16, addr_hash: u64) -> Self {
        Self {
            slot,
            tag: (addr_hash >> 48) as u16,
        }
    }
}

/// Whether an entry stands: its holder is a live instance, and the entry
/// is newer than what that instance is known to have lost
/// ([`crate::load::Candidate::forgotten_through`]).
pub(crate) type Believed<'a> = dyn Fn(&PrefixEntry) -> bool + 'a;

/// One indexed block held by one instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PrefixEntry {
    pub(crate) hash: u64,
    pub(crate) holder: Holder,
    /// Seconds (`now_ms / 1000`) when the holding was last recorded.
    pub(crate) last_used: u32,
}

/// The ways of a bucket one mutation wrote (bit i: way i).
type WrittenWays = u128;
const _: () = assert!(ENTRIES <= WrittenWays::BITS as usize && ENTRIES < 256);

/// One bucket: at most [`ENTRIES`] entries, no (hash, holder) pair twice.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct PrefixBucket {
    pub(crate) entries: Vec<PrefixEntry>,
}

/// What putting one entry into a bucket did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Put {
    /// Already there, at least as recent.
    Unchanged,
    /// Already there; its last-used time moved forward.
    Refreshed,
    /// Stored in an empty way.
    Filled,
    /// Stored over an evicted entry.
    Evicted,
}

impl PrefixBucket {
    /// The holders of `hash` whose entries are believed.
    fn believed_holders(&self, hash: u64, believed: &Believed<'_>) -> Vec<Holder> {
        self.entries
            .iter()
            .filter(|e| e.hash == hash && believed(e))
            .map(|e| e.holder)
            .collect()
    }

    /// When `holder`'s holding of `hash` was last recorded, if it is here.
    fn last_used(&self, hash: u64, holder: Holder) -> Option<u32> {
        self.entries
            .iter()
            .find(|e| e.hash == hash && e.holder == holder)
            .map(|e| e.last_used)
    }

    /// Records that `holder` holds `hash`, used at `stamp` (a time never
    /// moves back). `written` marks the ways this mutation already wrote
    /// (bit i: way i), which are evicted last.
    fn put(
        &mut self,
        hash: u64,
        holder: Holder,
        stamp: u32,
        believed: &Believed<'_>,
        written: &mut WrittenWays,
    ) -> Put {
        let entry = PrefixEntry {
            hash,
            holder,
            last_used: stamp,
        };
        if let Some((way, existing)) = self
            .entries
            .iter_mut()
            .enumerate()
            .find(|(_, e)| e.hash == hash && e.holder == holder)
        {
            *written |= 1 << way;
            if existing.last_used >= stamp {
                return Put::Unchanged;
            }
            existing.last_used = stamp;
            return Put::Refreshed;
        }
        if self.entries.len() < ENTRIES {
            *written |= 1 << self.entries.len();
            self.entries.push(entry);
            return Put::Filled;
        }
        let victim = self
            .entries
            .iter_mut()
            .enumerate()
            .min_by_key(|(way, e)| (believed(e), *written & (1 << way) != 0, e.last_used));
        match victim {
            Some((way, slot)) => {
                *written |= 1 << way;
                *slot = entry;
                Put::Evicted
            }
            // Unreachable: a full bucket has ENTRIES > 0 ways.
            None => Put::Unchanged,
        }
    }
}

impl Record for PrefixBucket {
    fn encode(&self) -> Vec<u8> {
        encode_list(BUCKET_VERSION, &self.entries, ENTRIES, 16, |w, e| {
            w.u64(e.hash)
                .u16(e.holder.slot)
                .u16(e.holder.tag)
                .u32(e.last_used);
        })
    }

    fn decode(buf: &[u8]) -> Option<Self> {
        let entries = decode_list(buf, BUCKET_VERSION, ENTRIES, |r| {
            Some(PrefixEntry {
                hash: r.u64()?,
                holder: Holder {
                    slot: r.u16()?,
                    tag: r.u16()?,
                },
                last_used: r.u32()?,
            })
        })?;
        Some(Self { entries })
    }
}

/// What [`PrefixIndex::longest_held`] found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Held {
    /// Blocks of the chain held (0: none).
    pub(crate) blocks: usize,
    /// The believed holders of `chain[blocks - 1]` (empty when `blocks` is 0).
    pub(crate) holders: Vec<Holder>,
}

/// What [`PrefixIndex::remember`] did, in entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Remembered {
    /// Entries written (new or refreshed), in writes that went through.
    pub(crate) written: u32,
    /// Empty ways newly used (part of `written`).
    pub(crate) filled: u32,
    /// Entries evicted to make room (part of `written`).
    pub(crate) evicted: u32,
    /// Blocks not recorded: their bucket's update failed (host refusal, or
    /// other VMs writing it on every attempt).
    pub(crate) failed: u32,
}

impl Remembered {
    pub(crate) fn add(&mut self, other: Remembered) {
        self.written += other.written;
        self.filled += other.filled;
        self.evicted += other.evicted;
        self.failed += other.failed;
    }
}

/// The sizes of the prefix index; its state lives in shared data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PrefixIndex {
    buckets: u64,
}

impl PrefixIndex {
    /// The index `budget_bytes` buys (clamped to
    /// `MIN_BUDGET_BYTES..=MAX_BUDGET_BYTES`): as many full buckets as fit.
    pub(crate) fn new(budget_bytes: u64) -> Self {
        let budget = budget_bytes.clamp(MIN_BUDGET_BYTES, MAX_BUDGET_BYTES);
        Self {
            buckets: budget / RECORD_BYTES,
        }
    }

    /// Number of buckets (shared-data keys).
    #[cfg(test)]
    pub(crate) fn buckets(&self) -> u64 {
        self.buckets
    }

    /// Shared-data bytes of the values when every bucket is full.
    pub(crate) fn bytes(&self) -> u64 {
        self.buckets * RECORD_BYTES
    }

    /// Entries the index holds at most.
    pub(crate) fn capacity(&self) -> u64 {
        self.buckets * ENTRIES as u64
    }

    fn bucket_of(&self, hash: u64) -> u64 {
        // `buckets` is at least MIN_BUDGET_BYTES / RECORD_BYTES > 0.
        hash % self.buckets.max(1)
    }

    /// The bucket of `chain[i]`: that of the first block of its span.
    fn bucket_of_block(&self, chain: &[u64], i: usize) -> u64 {
        let first = i - i % SPAN_BLOCKS;
        self.bucket_of(chain.get(first).copied().unwrap_or_default())
    }

    fn key<S: SharedStore>(&self, tables: &Tables<S>, bucket: u64) -> String {
        tables.key(format_args!("prefix/{bucket}"))
    }

    /// The longest prefix of `chain` ending in span `span` that a holder is
    /// believed to hold, if any (one read, unless `reads` has the bucket).
    fn longest_in_span<S: SharedStore>(
        &self,
        tables: &Tables<S>,
        chain: &[u64],
        span: usize,
        believed: &Believed<'_>,
        reads: &mut BucketReads,
    ) -> Option<Held> {
        let first = span * SPAN_BLOCKS;
        let end = (first + SPAN_BLOCKS).min(chain.len());
        let record = reads.get(self, tables, self.bucket_of_block(chain, first));
        (first..end).rev().find_map(|i| {
            let holders = record.believed_holders(*chain.get(i)?, believed);
            (!holders.is_empty()).then_some(Held {
                blocks: i + 1,
                holders,
            })
        })
    }

    /// The longest `n` (0..=chain.len()) such that a holder is believed to
    /// hold `chain[n-1]`, with those holders.
    ///
    /// Reads the chain's last span first (a repeated prompt, or a turn whose
    /// held prefix ends in it: one read), then binary-searches the spans for
    /// the last one holding anything, then takes the longest held prefix in
    /// it: at most 1 + ceil(log2(spans)) reads, none for a bucket `reads`
    /// already has. The search assumes that a held block's predecessors are
    /// held too (they were recorded for the same holder at the same time or
    /// earlier). When eviction broke that (a block of the chain evicted,
    /// later ones kept), the answer is still a block that a believed holder
    /// holds, read from the index: maybe a shorter match than the longest,
    /// or a longer one past the evicted block (still true: its hash stands
    /// for the whole prefix), never a block nobody holds.
    pub(crate) fn longest_held<S: SharedStore>(
        &self,
        tables: &Tables<S>,
        chain: &[u64],
        believed: &Believed<'_>,
        reads: &mut BucketReads,
    ) -> Held {
        let Some(last) = chain.len().div_ceil(SPAN_BLOCKS).checked_sub(1) else {
            return Held::default();
        };
        if let Some(held) = self.longest_in_span(tables, chain, last, believed, reads) {
            return held;
        }
        // Invariant: spans before `low` hold something, the match being in
        // span `low - 1` (`held`); spans from `high` on hold nothing.
        let (mut low, mut high) = (0, last);
        let mut held = Held::default();
        while low < high {
            let mid = low + (high - low) / 2;
            match self.longest_in_span(tables, chain, mid, believed, reads) {
                Some(found) => {
                    held = found;
                    low = mid + 1;
                }
                None => high = mid,
            }
        }
        held
    }

    /// When `holder`'s holding of the first `blocks` blocks of `chain` was
    /// last recorded (seconds), if the index has it: the age of what a
    /// decision predicted. Reads the bucket a lookup of `blocks` already read.
    pub(crate) fn last_used<S: SharedStore>(
        &self,
        tables: &Tables<S>,
        chain: &[u64],
        blocks: usize,
        holder: Holder,
        reads: &mut BucketReads,
    ) -> Option<u32> {
        let i = blocks.checked_sub(1)?;
        let hash = *chain.get(i)?;
        reads
            .get(self, tables, self.bucket_of_block(chain, i))
            .last_used(hash, holder)
    }

    /// Records that `holder` holds every block of `chain`, at `now_ms`.
    /// `from`: how many blocks it was known to hold (`longest_held`'s
    /// `blocks` if it is one of the holders, else 0).
    ///
    /// Reads `holder`'s entry of `chain[from-1]`. If it was recorded less
    /// than [`REFRESH_SECS`] ago, only `chain[from..]` is written, stamped
    /// with that entry's time; otherwise (or if it is missing) the whole
    /// chain is written, stamped now. So along any recorded chain a block is
    /// never older than the blocks after it, and one read of the last block
    /// tells whether the early blocks, which LRU would otherwise evict first,
    /// need refreshing. Writes are grouped by bucket: one [`Tables::update`]
    /// per bucket touched, none for a bucket where nothing changes, each
    /// starting from the read in `reads` if there is one (which it uses up).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn remember<S: SharedStore>(
        &self,
        tables: &Tables<S>,
        chain: &[u64],
        from: usize,
        holder: Holder,
        believed: &Believed<'_>,
        now_ms: u64,
        reads: &mut BucketReads,
    ) -> Remembered {
        let now = u32::try_from(now_ms / 1000).unwrap_or(u32::MAX);
        let from = from.min(chain.len());
        let (start, stamp) = match self.last_used(tables, chain, from, holder, reads) {
            Some(used) if now.saturating_sub(used) < REFRESH_SECS => (from, used),
            _ => (0, now),
        };
        let mut blocks: Vec<(u64, u64)> = chain
            .iter()
            .enumerate()
            .skip(start)
            .map(|(i, &hash)| (self.bucket_of_block(chain, i), hash))
            .collect();
        blocks.sort_unstable();
        let mut done = Remembered::default();
        for group in blocks.chunk_by(|a, b| a.0 == b.0) {
            let Some(&(bucket, _)) = group.first() else {
                continue;
            };
            let updated = tables.update_from(
                &self.key(tables, bucket),
                reads.take(bucket),
                |record: &mut PrefixBucket| {
                    let mut counts = Remembered::default();
                    let mut written_ways: WrittenWays = 0;
                    for &(_, hash) in group {
                        let put = record.put(hash, holder, stamp, believed, &mut written_ways);
                        counts.written += u32::from(put != Put::Unchanged);
                        counts.filled += u32::from(put == Put::Filled);
                        counts.evicted += u32::from(put == Put::Evicted);
                    }
                    if counts.written == 0 {
                        Change::Keep(())
                    } else {
                        Change::Write(counts)
                    }
                },
            );
            match updated {
                Updated::Written(counts) => done.add(counts),
                Updated::Kept(()) => {}
                Updated::Failed => done.failed += group.len() as u32,
            }
        }
        done
    }
}

/// The buckets read while deciding for one prompt, so that the decision's
/// lookups and its recording read each bucket once. A kept read is only
/// where a write starts from (a compare-and-swap on its token: if another
/// VM wrote since, the write reads again), so it is safe however old; the
/// caller still drops them once the prompt is recorded, so that a later
/// lookup sees other VMs' writes.
#[derive(Debug, Default)]
pub(crate) struct BucketReads {
    reads: Vec<(u64, Read<PrefixBucket>)>,
}

impl BucketReads {
    pub(crate) fn clear(&mut self) {
        self.reads.clear();
    }

    /// Bucket `bucket` as read, reading it if it is not here yet.
    fn get<S: SharedStore>(
        &mut self,
        index: &PrefixIndex,
        tables: &Tables<S>,
        bucket: u64,
    ) -> &PrefixBucket {
        let at = match self.reads.iter().position(|(b, _)| *b == bucket) {
            Some(at) => at,
            None => {
                let read = tables.read(&index.key(tables, bucket));
                self.reads.push((bucket, read));
                self.reads.len() - 1
            }
        };
        static EMPTY: PrefixBucket = PrefixBucket {
            entries: Vec::new(),
        };
        self.reads.get(at).map_or(&EMPTY, |(_, read)| &read.record)
    }

    /// The read of `bucket`, if here, taken out (a write is about to use it).
    fn take(&mut self, bucket: u64) -> Option<Read<PrefixBucket>> {
        let at = self.reads.iter().position(|(b, _)| *b == bucket)?;
        Some(self.reads.swap_remove(at).1)
    }
}

#[cfg(test)]
mod tests;
