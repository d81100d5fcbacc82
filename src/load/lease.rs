//! Worker-VM leases: which VM owns which column of the per-instance count
//! records. A VM heartbeats its lease on every tick; a VM that died (or was
//! replaced after a crash) stops heartbeating, and once its lease is older than
//! the lease time its counts stop counting. That is how the counts heal after a
//! VM restart without anyone resetting shared state.

use super::codec::{Reader, Writer};
use super::table::Record;
use super::table::{Change, Tables, Updated};
use crate::shared::SharedStore;

const LEASE_VERSION: u8 = 1;

/// One lease record. `nonce == 0` means free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Lease {
    pub(crate) nonce: u64,
    pub(crate) heartbeat_ms: u64,
}

impl Lease {
    /// Held by a VM whose last heartbeat is at most `lease_ms` old.
    pub(crate) fn is_live(&self, now_ms: u64, lease_ms: u64) -> bool {
        self.nonce != 0 && now_ms.saturating_sub(self.heartbeat_ms) <= lease_ms
    }
}

impl Record for Lease {
    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(17);
        w.u8(LEASE_VERSION).u64(self.nonce).u64(self.heartbeat_ms);
        w.finish()
    }

    /// A foreign or corrupt value decodes as `None` (treated as free).
    fn decode(buf: &[u8]) -> Option<Lease> {
        let mut r = Reader::new(buf);
        if r.u8()? != LEASE_VERSION {
            return None;
        }
        let lease = Lease {
            nonce: r.u64()?,
            heartbeat_ms: r.u64()?,
        };
        r.is_empty().then_some(lease)
    }
}

/// Outcome of a heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Heartbeat {
    /// Still ours, heartbeat written.
    Kept,
    /// Someone else owns the slot now (we were presumed dead).
    Lost,
    /// Could not write this time (contention or host error); try next tick.
    Unknown,
}

/// Renews the lease under `key` if `nonce` still holds it. A missing or
/// undecodable lease reads as free: lost.
pub(crate) fn heartbeat<S: SharedStore>(
    tables: &Tables<S>,
    key: &str,
    nonce: u64,
    now_ms: u64,
) -> Heartbeat {
    let renewed = tables.update(key, |lease: &mut Lease| {
        if lease.nonce != nonce {
            return Change::Keep(());
        }
        lease.heartbeat_ms = now_ms.max(lease.heartbeat_ms);
        Change::Write(())
    });
    match renewed {
        Updated::Written(()) => Heartbeat::Kept,
        Updated::Kept(()) => Heartbeat::Lost,
        Updated::Failed => Heartbeat::Unknown,
    }
}

/// Tries to take the lease under `key`: free, never written, undecodable or
/// expired. A missing key is created with our lease only if it is still
/// missing ([`crate::shared::SharedStore::create`]), so two VMs racing for
/// the same new slot cannot both win.
pub(crate) fn try_claim<S: SharedStore>(
    tables: &Tables<S>,
    key: &str,
    nonce: u64,
    now_ms: u64,
    lease_ms: u64,
) -> bool {
    let claimed = tables.update(key, |lease: &mut Lease| {
        if lease.nonce != nonce && lease.is_live(now_ms, lease_ms) {
            return Change::Keep(());
        }
        *lease = Lease {
            nonce,
            heartbeat_ms: now_ms,
        };
        Change::Write(())
    });
    claimed == Updated::Written(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::MemoryStore;

    #[test]
    fn encoding_round_trips_and_rejects_garbage() {
        let lease = Lease {
            nonce: 42,
            heartbeat_ms: 1_000,
        };
        assert_eq!(Lease::decode(&lease.encode()), Some(lease));
        assert_eq!(Lease::decode(b""), None);
        assert_eq!(Lease::decode(&[9; 17]), None);
        let mut long = lease.encode();
        long.push(0);
        assert_eq!(Lease::decode(&long), None);
    }

    #[test]
    fn liveness_follows_the_heartbeat() {
        let lease = Lease {
            nonce: 1,
            heartbeat_ms: 1_000,
        };
        assert!(lease.is_live(1_000, 500));
        assert!(lease.is_live(1_500, 500));
        assert!(!lease.is_live(1_501, 500));
        assert!(
            lease.is_live(0, 500),
            "a clock behind the heartbeat is not expiry"
        );
        assert!(!Lease::default().is_live(0, 500), "nonce 0 is free");
    }

    fn nonce_in(store: &MemoryStore, key: &str) -> Option<u64> {
        store
            .get(key)
            .0
            .as_deref()
            .and_then(Lease::decode)
            .map(|l| l.nonce)
    }

    #[test]
    fn a_live_slot_cannot_be_taken_and_an_expired_one_can() {
        let store = MemoryStore::new();
        let tables = Tables::new(&store, "t", 4);
        assert!(try_claim(&tables, "vm/0", 1, 1_000, 500));
        assert!(!try_claim(&tables, "vm/0", 2, 1_400, 500));
        assert!(try_claim(&tables, "vm/0", 2, 1_501, 500));
        assert_eq!(nonce_in(&store, "vm/0"), Some(2));
        assert_eq!(heartbeat(&tables, "vm/0", 1, 1_600), Heartbeat::Lost);
        assert_eq!(heartbeat(&tables, "vm/0", 2, 1_600), Heartbeat::Kept);
    }

    #[test]
    fn corrupt_slot_is_claimable() {
        let store = MemoryStore::new();
        store.set("vm/0", b"junk", None).unwrap();
        let tables = Tables::new(&store, "t", 4);
        assert!(try_claim(&tables, "vm/0", 7, 10, 500));
        assert_eq!(nonce_in(&store, "vm/0"), Some(7));
    }
}
