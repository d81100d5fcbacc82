//! Requests of a key that were routed before the key's target was known, and
//! that the upstream filter has not counted yet. They are on their way to the
//! target (Maglev is deterministic), so a claim on the target counts them too.
//! This closes the race in which one worker routes a key's first request
//! "blind" while another worker, which just learned the target, fills it up.
//!
//! Each pending request is one timestamp, so one that never reaches an
//! upstream filter (client gone first) expires on its own after a short time,
//! whatever happens to the key's other requests. Direct-mapped buckets keep
//! the table at a fixed size.

use super::codec::{decode_list, encode_list};
use super::table::Record;

const PENDING_VERSION: u8 = 1;

/// Keys per bucket.
pub(crate) const WAYS: usize = 4;
/// Pending requests remembered per key (at most one per worker is in flight
/// at a time; the rest are expired leftovers).
pub(crate) const PER_KEY: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct PendingKey {
    pub(crate) key_hash: u64,
    /// Start times of the pending requests, oldest first.
    pub(crate) since_ms: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct PendingBucket {
    pub(crate) keys: Vec<PendingKey>,
}

impl PendingBucket {
    /// Pending requests of `key_hash` younger than `ttl_ms`.
    pub(crate) fn count(&self, key_hash: u64, now_ms: u64, ttl_ms: u64) -> u32 {
        self.keys
            .iter()
            .filter(|k| k.key_hash == key_hash)
            .flat_map(|k| k.since_ms.iter())
            .filter(|since| now_ms.saturating_sub(**since) <= ttl_ms)
            .count() as u32
    }

    fn prune(&mut self, now_ms: u64, ttl_ms: u64) {
        for key in &mut self.keys {
            key.since_ms
                .retain(|since| now_ms.saturating_sub(*since) <= ttl_ms);
        }
        self.keys.retain(|k| !k.since_ms.is_empty());
    }

    /// Adds one pending request of `key_hash` (expired ones are dropped first;
    /// the oldest gives way when the key or the bucket is full).
    pub(crate) fn add(&mut self, key_hash: u64, now_ms: u64, ttl_ms: u64) {
        self.prune(now_ms, ttl_ms);
        if let Some(key) = self.keys.iter_mut().find(|k| k.key_hash == key_hash) {
            if key.since_ms.len() >= PER_KEY {
                key.since_ms.remove(0);
            }
            key.since_ms.push(now_ms);
            return;
        }
        if self.keys.len() >= WAYS {
            if let Some(oldest) = self
                .keys
                .iter()
                .enumerate()
                .min_by_key(|(_, k)| k.since_ms.last().copied().unwrap_or(0))
                .map(|(i, _)| i)
            {
                self.keys.remove(oldest);
            }
        }
        self.keys.push(PendingKey {
            key_hash,
            since_ms: vec![now_ms],
        });
    }

    /// Removes one pending request of `key_hash`: the newest, since a request
    /// is taken over by its upstream filter within moments of being marked,
    /// while an old mark is most likely one that was lost (and should expire).
    /// Returns false if there was none.
    pub(crate) fn remove(&mut self, key_hash: u64, now_ms: u64, ttl_ms: u64) -> bool {
        self.prune(now_ms, ttl_ms);
        let Some(key) = self.keys.iter_mut().find(|k| k.key_hash == key_hash) else {
            return false;
        };
        if key.since_ms.pop().is_none() {
            return false;
        }
        self.keys.retain(|k| !k.since_ms.is_empty());
        true
    }
}

impl Record for PendingBucket {
    fn encode(&self) -> Vec<u8> {
        encode_list(
            PENDING_VERSION,
            &self.keys,
            WAYS,
            9 + 8 * PER_KEY,
            |w, key| {
                let stamps = key.since_ms.get(..PER_KEY).unwrap_or(&key.since_ms);
                // At most PER_KEY stamps, far below 256.
                w.u64(key.key_hash).u8(stamps.len() as u8);
                for since in stamps {
                    w.u64(*since);
                }
            },
        )
    }

    fn decode(buf: &[u8]) -> Option<Self> {
        let keys = decode_list(buf, PENDING_VERSION, WAYS, |r| {
            let key_hash = r.u64()?;
            let stamps = usize::from(r.u8()?);
            if stamps > PER_KEY {
                return None;
            }
            let mut since_ms = Vec::with_capacity(stamps);
            for _ in 0..stamps {
                since_ms.push(r.u64()?);
            }
            Some(PendingKey { key_hash, since_ms })
        })?;
        Some(Self { keys })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_count_remove() {
        let mut bucket = PendingBucket::default();
        bucket.add(1, 100, 1_000);
        bucket.add(1, 101, 1_000);
        bucket.add(2, 102, 1_000);
        assert_eq!(bucket.count(1, 102, 1_000), 2);
        assert!(bucket.remove(1, 103, 1_000));
        assert_eq!(bucket.count(1, 103, 1_000), 1);
        assert!(bucket.remove(1, 103, 1_000));
        assert!(!bucket.remove(1, 103, 1_000), "nothing left to remove");
        assert_eq!(bucket.count(2, 103, 1_000), 1);
    }

    #[test]
    fn a_lost_pending_request_expires_even_while_the_key_stays_busy() {
        let mut bucket = PendingBucket::default();
        bucket.add(1, 0, 1_000); // never reaches an upstream filter
        for t in (100..3_000).step_by(100) {
            bucket.add(1, t, 1_000);
            assert!(bucket.remove(1, t, 1_000));
        }
        assert_eq!(bucket.count(1, 3_000, 1_000), 0);
    }

    #[test]
    fn bounded_per_key_and_per_bucket() {
        let mut bucket = PendingBucket::default();
        for t in 0..20 {
            bucket.add(1, t, 1_000);
        }
        assert_eq!(bucket.count(1, 20, 1_000), PER_KEY as u32);
        for key in 2..10 {
            bucket.add(key, 30 + key, 1_000);
        }
        assert_eq!(bucket.keys.len(), WAYS);
        assert_eq!(bucket.count(9, 40, 1_000), 1, "the newest key stays");
    }

    #[test]
    fn round_trip_and_garbage() {
        let mut bucket = PendingBucket::default();
        bucket.add(5, 10, 1_000);
        bucket.add(5, 11, 1_000);
        bucket.add(6, 12, 1_000);
        let bytes = bucket.encode();
        assert_eq!(PendingBucket::decode(&bytes), Some(bucket));
        for cut in 0..bytes.len() {
            assert_eq!(PendingBucket::decode(bytes.get(..cut).unwrap()), None);
        }
        assert_eq!(
            PendingBucket::decode(&[1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 99]),
            None
        );
    }
}
