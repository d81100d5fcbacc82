//! The prefix index: which instances hold which prompt blocks, shared by all
//! worker VMs of one Envoy, so that LONGEST_PREFIX routing sends a request to
//! the instance that already holds the longest prefix of its prompt (its KV
//! cache can skip recomputing it).
//!
//! What is indexed: the caller cuts a prompt into blocks and hashes them as a
//! chain (block i's hash is seeded with block i-1's), so `chain[i]` stands
//! for the whole prefix through block i. After routing, the chosen instance
//! is recorded as holding every block of the chain; a lookup finds the longest
//! `n` such that a live instance holds `chain[n-1]`.
//!
//! Layout: shared data has no delete, no TTL and no size cap, so the index is
//! a fixed number N of keys, `prefix/<b>` for b < N, computed from a byte
//! budget ([`PrefixIndex::new`]). A block's bucket is its hash mod N (the
//! hashes are xxh3 outputs, already uniform). Each bucket is one [`Record`]
//! of at most [`ENTRIES`] entries of [`ENTRY_BYTES`] bytes: block hash (u64),
//! holder slot (u16), holder tag (u16), last used (u32 seconds), plus a
//! version and a count byte: [`RECORD_BYTES`] (258) bytes at most. Sixteen
//! entries keep the record a few hundred bytes (it is copied in and out of
//! the VM on every read) while letting a bucket hold a hot prefix's block for
//! several instances beside other prefixes' blocks: with only a few ways,
//! which blocks happen to share a bucket, rather than their age, would decide
//! what is evicted. The default budget of 8 MiB buys 32,513 buckets: 520,208
//! entries, as many 256-byte blocks as 127 MiB of prompt text held by one
//! instance each. Outside the budget, Envoy also keeps each key's name
//! (`prefix-router/<namespace>/v1/prefix/<b>`, about 40 bytes) and its map
//! entry.
//!
//! Eviction, within a full bucket: an entry of a holder that is no longer a
//! live instance first, else the least recently used one; an entry written by
//! the same call last. The same (block, holder) pair is never stored twice (it
//! is refreshed instead); several holders of one block coexist.
//!
//! Cost (each shared-data read or write is a host call of a few us): a lookup
//! probes the full chain first, then binary-searches its length, at most
//! 1 + ceil(log2(n)) reads; never one read per block. Recording a chain the
//! instance already holds reads one bucket and writes nothing while that
//! holding was last refreshed less than [`REFRESH_SECS`] ago; new blocks cost
//! one read-modify-CAS ([`Tables::update`]) per bucket touched. Measured
//! with `MemoryStore` (tests below): a held 32-block prompt, lookup and
//! record, 2 reads and 0 writes; a new 64-block prompt, 7 reads to look it up
//! and one read and one write per bucket (64) to record it.

use super::codec::{Reader, Writer};
use super::table::{Change, Read, Record, Tables, Updated};
use crate::shared::SharedStore;

/// First byte of a bucket record; no other record of the shared tables
/// starts with it, so a value of another table never decodes as a bucket.
const BUCKET_VERSION: u8 = 0x50;

/// Entries per bucket (the bucket's ways).
pub(crate) const ENTRIES: usize = 16;

/// Encoded size of one entry: hash 8, slot 2, tag 2, last used 4.
pub(crate) const ENTRY_BYTES: u64 = 16;

/// Encoded size of a full bucket: version, count, entries.
pub(crate) const RECORD_BYTES: u64 = 2 + ENTRY_BYTES * ENTRIES as u64;

/// Smallest budget (64 KiB: 254 buckets).
pub(crate) const MIN_BUDGET_BYTES: u64 = 64 << 10;
/// Largest budget (256 MiB: 1,040,447 buckets).
pub(crate) const MAX_BUDGET_BYTES: u64 = 256 << 20;
/// Default budget (8 MiB: 32,513 buckets, 520,208 entries).
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

/// One indexed block held by one instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PrefixEntry {
    pub(crate) hash: u64,
    pub(crate) holder: Holder,
    /// Seconds (`now_ms / 1000`) when the holding was last recorded.
    pub(crate) last_used: u32,
}

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
    /// The live holders of `hash`.
    fn live_holders(&self, hash: u64, live: &dyn Fn(Holder) -> bool) -> Vec<Holder> {
        self.entries
            .iter()
            .filter(|e| e.hash == hash && live(e.holder))
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
        live: &dyn Fn(Holder) -> bool,
        written: &mut u32,
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
            .min_by_key(|(way, e)| (live(e.holder), *written & (1 << way) != 0, e.last_used));
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
        let entries = self.entries.get(..ENTRIES).unwrap_or(&self.entries);
        let mut w = Writer::with_capacity(2 + 16 * entries.len());
        // At most ENTRIES entries, well below 256.
        w.u8(BUCKET_VERSION).u8(entries.len() as u8);
        for e in entries {
            w.u64(e.hash)
                .u16(e.holder.slot)
                .u16(e.holder.tag)
                .u32(e.last_used);
        }
        w.finish()
    }

    fn decode(buf: &[u8]) -> Option<Self> {
        let mut r = Reader::new(buf);
        if r.u8()? != BUCKET_VERSION {
            return None;
        }
        let count = usize::from(r.u8()?);
        if count > ENTRIES {
            return None;
        }
        let mut entries = Vec::with_capacity(count);
        for _ in 0..count {
            let hash = r.u64()?;
            let holder = Holder {
                slot: r.u16()?,
                tag: r.u16()?,
            };
            entries.push(PrefixEntry {
                hash,
                holder,
                last_used: r.u32()?,
            });
        }
        r.is_empty().then_some(Self { entries })
    }
}

/// What [`PrefixIndex::longest_held`] found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Held {
    /// Blocks of the chain held (0: none).
    pub(crate) blocks: usize,
    /// The live holders of `chain[blocks - 1]` (empty when `blocks` is 0).
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

    fn key<S: SharedStore>(&self, tables: &Tables<S>, bucket: u64) -> String {
        tables.key(format_args!("prefix/{bucket}"))
    }

    fn read<S: SharedStore>(&self, tables: &Tables<S>, hash: u64) -> Read<PrefixBucket> {
        tables.read(&self.key(tables, self.bucket_of(hash)))
    }

    /// The longest `n` (0..=chain.len()) such that a live holder holds
    /// `chain[n-1]`, with those holders.
    ///
    /// Probes the full chain first (a repeated prompt: one read), then
    /// binary-searches the length: at most 1 + ceil(log2(len)) reads. The
    /// search assumes that a held block's predecessors are held too (they
    /// were recorded for the same holder at the same time or earlier). When
    /// eviction broke that (a block of the chain evicted, later ones kept),
    /// the answer is still a block that a live holder holds, read from the
    /// index: maybe a shorter match than the longest, or a longer one past
    /// the evicted block (still true: its hash stands for the whole prefix),
    /// never a block nobody holds.
    pub(crate) fn longest_held<S: SharedStore>(
        &self,
        tables: &Tables<S>,
        chain: &[u64],
        live: &dyn Fn(Holder) -> bool,
    ) -> Held {
        let holders_of = |n: usize| -> Vec<Holder> {
            match n.checked_sub(1).and_then(|i| chain.get(i)) {
                Some(&hash) => self.read(tables, hash).record.live_holders(hash, live),
                None => Vec::new(),
            }
        };
        let holders = holders_of(chain.len());
        if !holders.is_empty() {
            return Held {
                blocks: chain.len(),
                holders,
            };
        }
        // Invariant: `held` is a true match of `held.blocks` blocks (0 at
        // first); `missing` blocks are not held.
        let mut held = Held::default();
        let mut missing = chain.len();
        while missing - held.blocks > 1 {
            let mid = held.blocks + (missing - held.blocks) / 2;
            let holders = holders_of(mid);
            if holders.is_empty() {
                missing = mid;
            } else {
                held = Held {
                    blocks: mid,
                    holders,
                };
            }
        }
        held
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
    /// per bucket touched, none for a bucket where nothing changes.
    pub(crate) fn remember<S: SharedStore>(
        &self,
        tables: &Tables<S>,
        chain: &[u64],
        from: usize,
        holder: Holder,
        live: &dyn Fn(Holder) -> bool,
        now_ms: u64,
    ) -> Remembered {
        let now = u32::try_from(now_ms / 1000).unwrap_or(u32::MAX);
        let from = from.min(chain.len());
        let mut first: Option<(u64, Read<PrefixBucket>)> = None;
        let (start, stamp) = match from.checked_sub(1).and_then(|i| chain.get(i)) {
            None => (0, now),
            Some(&known) => {
                let read = self.read(tables, known);
                let used = read.record.last_used(known, holder);
                first = Some((self.bucket_of(known), read));
                match used {
                    Some(used) if now.saturating_sub(used) < REFRESH_SECS => (from, used),
                    _ => (0, now),
                }
            }
        };
        let mut blocks: Vec<(u64, u64)> = chain
            .get(start..)
            .unwrap_or_default()
            .iter()
            .map(|&hash| (self.bucket_of(hash), hash))
            .collect();
        blocks.sort_unstable();
        let mut done = Remembered::default();
        for group in blocks.chunk_by(|a, b| a.0 == b.0) {
            let Some(&(bucket, _)) = group.first() else {
                continue;
            };
            let read = match first.take() {
                Some((read_bucket, read)) if read_bucket == bucket => Some(read),
                other => {
                    first = other;
                    None
                }
            };
            let updated = tables.update_from(
                &self.key(tables, bucket),
                read,
                |record: &mut PrefixBucket| {
                    let mut counts = Remembered::default();
                    let mut written_ways = 0u32;
                    for &(_, hash) in group {
                        let put = record.put(hash, holder, stamp, live, &mut written_ways);
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

#[cfg(test)]
mod tests;
