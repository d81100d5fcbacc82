//! The learned key -> instance table: which instance Maglev sends a key to,
//! as seen by the upstream filter. Direct-mapped buckets of a few ways each, so the table has a fixed
//! size however many keys pass; within a bucket the oldest (or expired) entry
//! gives way.

use super::codec::{decode_list, encode_list};
use super::table::Record;

const BUCKET_VERSION: u8 = 3;

/// Entries per bucket.
pub(crate) const WAYS: usize = 4;

/// One learned mapping. `addr_hash` guards against the instance slot having
/// been reused for another address since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RouteEntry {
    pub(crate) key_hash: u64,
    pub(crate) slot: u16,
    pub(crate) addr_hash: u64,
    pub(crate) learned_ms: u64,
}

impl RouteEntry {
    /// A fresh mapping of `key_hash` to `slot`.
    pub(crate) fn new(key_hash: u64, slot: u16, addr_hash: u64, learned_ms: u64) -> Self {
        Self {
            key_hash,
            slot,
            addr_hash,
            learned_ms,
        }
    }

    /// The same mapping (the same instance), whenever learned.
    pub(crate) fn same_instance(&self, other: &RouteEntry) -> bool {
        self.slot == other.slot && self.addr_hash == other.addr_hash
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct RouteBucket {
    pub(crate) entries: Vec<RouteEntry>,
}

impl RouteBucket {
    /// The entry for `key_hash` if learned within `ttl_ms`.
    pub(crate) fn lookup(&self, key_hash: u64, now_ms: u64, ttl_ms: u64) -> Option<RouteEntry> {
        self.entries
            .iter()
            .find(|e| e.key_hash == key_hash && now_ms.saturating_sub(e.learned_ms) <= ttl_ms)
            .copied()
    }

    /// Inserts or refreshes `entry`. Returns false if nothing needed writing
    /// (same mapping learned less than `refresh_ms` ago), to spare shared writes.
    pub(crate) fn upsert(&mut self, entry: RouteEntry, refresh_ms: u64) -> bool {
        if let Some(existing) = self
            .entries
            .iter_mut()
            .find(|e| e.key_hash == entry.key_hash)
        {
            if existing.same_instance(&entry)
                && entry.learned_ms.saturating_sub(existing.learned_ms) < refresh_ms
            {
                return false;
            }
            *existing = entry;
            return true;
        }
        if self.entries.len() < WAYS {
            self.entries.push(entry);
            return true;
        }
        if let Some(oldest) = self.entries.iter_mut().min_by_key(|e| e.learned_ms) {
            *oldest = entry;
        }
        true
    }
}

impl Record for RouteBucket {
    fn encode(&self) -> Vec<u8> {
        encode_list(BUCKET_VERSION, &self.entries, WAYS, 26, |w, e| {
            w.u64(e.key_hash)
                .u16(e.slot)
                .u64(e.addr_hash)
                .u64(e.learned_ms);
        })
    }

    fn decode(buf: &[u8]) -> Option<Self> {
        let entries = decode_list(buf, BUCKET_VERSION, WAYS, |r| {
            Some(RouteEntry::new(r.u64()?, r.u16()?, r.u64()?, r.u64()?))
        })?;
        Some(Self { entries })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key_hash: u64, slot: u16, learned_ms: u64) -> RouteEntry {
        RouteEntry::new(key_hash, slot, u64::from(slot) * 31, learned_ms)
    }

    #[test]
    fn lookup_respects_ttl() {
        let mut bucket = RouteBucket::default();
        assert!(bucket.upsert(entry(1, 3, 100), 10));
        assert_eq!(bucket.lookup(1, 150, 50).map(|e| e.slot), Some(3));
        assert_eq!(bucket.lookup(1, 151, 50), None);
        assert_eq!(bucket.lookup(2, 100, 50), None);
    }

    #[test]
    fn same_mapping_is_not_rewritten_until_refresh_is_due() {
        let mut bucket = RouteBucket::default();
        assert!(bucket.upsert(entry(1, 3, 100), 10));
        assert!(!bucket.upsert(entry(1, 3, 105), 10));
        assert!(bucket.upsert(entry(1, 3, 110), 10));
        assert!(
            bucket.upsert(entry(1, 4, 111), 10),
            "a moved key is rewritten at once"
        );
        assert_eq!(bucket.lookup(1, 111, 50).map(|e| e.slot), Some(4));
    }

    #[test]
    fn full_bucket_evicts_the_oldest() {
        let mut bucket = RouteBucket::default();
        for key in 0..WAYS as u64 {
            bucket.upsert(entry(key, 1, 100 + key), 0);
        }
        bucket.upsert(entry(99, 2, 500), 0);
        assert_eq!(bucket.entries.len(), WAYS);
        assert_eq!(bucket.lookup(0, 500, 1_000), None, "oldest evicted");
        assert!(bucket.lookup(99, 500, 1_000).is_some());
        assert!(bucket.lookup(1, 500, 1_000).is_some());
    }

    #[test]
    fn round_trip_and_garbage() {
        let mut bucket = RouteBucket::default();
        bucket.upsert(entry(5, 1, 9), 0);
        bucket.upsert(entry(6, 2, 10), 0);
        assert_eq!(RouteBucket::decode(&bucket.encode()), Some(bucket.clone()));
        let bytes = bucket.encode();
        for cut in 0..bytes.len() {
            assert_eq!(RouteBucket::decode(bytes.get(..cut).unwrap()), None);
        }
        assert_eq!(RouteBucket::decode(&[BUCKET_VERSION, 200]), None);
        let mut old_version = bytes;
        old_version[0] = 1;
        assert_eq!(RouteBucket::decode(&old_version), None);
    }
}
