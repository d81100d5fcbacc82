//! The record decoders, for the fuzz target (`fuzz/fuzz_targets/records.rs`):
//! every shared-data value was written by some VM, possibly of another build
//! or half-corrupted, and decoding it must never panic.

use super::instances::{InstanceRecord, RegistryEpoch};
use super::lease::Lease;
use super::mark::UpstreamFilterMark;
use super::pending::PendingBucket;
use super::prefix_index::PrefixBucket;
use super::routes::RouteBucket;
use super::table::Record;

/// Decodes `bytes` as every record kind of the shared tables; for each that
/// decodes, checks that encoding it and decoding the result gives the same
/// record (panics if not). Returns how many kinds decoded.
pub fn decode_as_every_record(bytes: &[u8]) -> usize {
    [
        round_trip::<InstanceRecord>(bytes),
        round_trip::<RegistryEpoch>(bytes),
        round_trip::<Lease>(bytes),
        round_trip::<PendingBucket>(bytes),
        round_trip::<RouteBucket>(bytes),
        round_trip::<PrefixBucket>(bytes),
        round_trip::<UpstreamFilterMark>(bytes),
    ]
    .into_iter()
    .filter(|decoded| *decoded)
    .count()
}

fn round_trip<R: Record + PartialEq + std::fmt::Debug>(bytes: &[u8]) -> bool {
    let Some(record) = R::decode(bytes) else {
        return false;
    };
    let again = R::decode(&record.encode());
    assert_eq!(again.as_ref(), Some(&record), "decode(encode(x)) != x");
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_encoded_record_decodes_as_itself() {
        let lease = Lease {
            nonce: 3,
            heartbeat_ms: 9,
        };
        // The epoch decodes from anything, the lease from its own bytes.
        assert_eq!(decode_as_every_record(&lease.encode()), 2);
        assert_eq!(
            decode_as_every_record(&InstanceRecord::new("a:1", 5).encode()),
            2
        );
        assert_eq!(decode_as_every_record(b""), 1);
        assert_eq!(decode_as_every_record(&[0xff; 40]), 1);
    }

    /// A prefix-index bucket decodes as itself (and, like anything, as an
    /// epoch), empty or full.
    #[test]
    fn a_prefix_bucket_decodes_as_its_own_kind() {
        use super::super::prefix_index::{Holder, PrefixEntry, ENTRIES};
        let full = PrefixBucket {
            entries: (0..ENTRIES as u64)
                .map(|hash| PrefixEntry {
                    hash,
                    holder: Holder { slot: 1, tag: 2 },
                    last_used: 3,
                })
                .collect(),
        };
        for bucket in [PrefixBucket::default(), full] {
            assert_eq!(decode_as_every_record(&bucket.encode()), 2);
            assert_eq!(PrefixBucket::decode(&bucket.encode()), Some(bucket));
        }
    }

    /// The fuzz target's seeds (`fuzz/seeds/records`) are valid records:
    /// each decodes as its own kind (and, like anything, as an epoch).
    #[test]
    fn every_fuzz_seed_is_a_record() {
        let seeds: [(&[u8], usize); 6] = [
            (include_bytes!("../../fuzz/seeds/records/instance"), 2),
            (include_bytes!("../../fuzz/seeds/records/epoch"), 1),
            (include_bytes!("../../fuzz/seeds/records/lease"), 2),
            (include_bytes!("../../fuzz/seeds/records/pending"), 2),
            (include_bytes!("../../fuzz/seeds/records/route"), 2),
            (include_bytes!("../../fuzz/seeds/records/mark"), 2),
        ];
        for (seed, kinds) in seeds {
            assert_eq!(decode_as_every_record(seed), kinds, "{seed:?}");
        }
        assert!(InstanceRecord::decode(seeds[0].0).is_some());
        assert!(Lease::decode(seeds[2].0).is_some());
        assert!(PendingBucket::decode(seeds[3].0).is_some());
        assert!(RouteBucket::decode(seeds[4].0).is_some());
        assert!(UpstreamFilterMark::decode(seeds[5].0).is_some_and(|m| m.is_present()));
    }
}
