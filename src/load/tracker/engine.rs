//! The engines' samples in shared data, as this VM sees them: the poller's
//! lease and instance list, its writes of each instance's sample
//! (`engine/<slot>`), and the one reader decisions use, through a per-VM
//! cache so that a decision does not read every instance's key on every
//! request.

use super::super::engine::EngineRecord;
use super::super::lease::{self, Heartbeat, Lease};
use super::super::table::{Change, Tables, Updated};
use super::super::{AdapterNames, EngineLoad, InstanceRef};
use super::registry::Lookup;
use super::{addr_hash, copy_is_fresh, last_read_again, BySlot, LoadTracker};
use crate::shared::SharedStore;

/// How long a VM reuses an engine record it read before reading it again.
/// Samples arrive every `interval_ms` (500 ms by default, 50 ms at the
/// least), so reading a slot at most every 50 ms per VM adds at most 50 ms
/// to a sample's age (a cleared record, after a failed poll, is seen at most
/// 50 ms late), while a burst of requests reads each instance's key once.
pub(crate) const ENGINE_CACHE_MS: u64 = 50;

/// The shared-data key of instance slot `slot`'s engine sample.
fn engine_key<S: SharedStore>(tables: &Tables<S>, slot: u16) -> String {
    tables.key(format_args!("engine/{slot}"))
}

/// The pollers one VM per Envoy runs, each under a lease of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollerKind {
    /// The engines' `/metrics` (`engine_load`).
    EngineLoad,
    /// Envoy's admin `/clusters` (`discovery`).
    Discovery,
}

impl PollerKind {
    fn lease_name(self) -> &'static str {
        match self {
            PollerKind::EngineLoad => "engine-poller",
            PollerKind::Discovery => "discovery-poller",
        }
    }
}

/// A poller lease's key: one poller per Envoy (per shared-data map).
fn poller_key<S: SharedStore>(tables: &Tables<S>, poller: &str) -> String {
    tables.key(format_args!("{poller}"))
}

/// A sample once fresh and now older than `max_age_ms`: a copy holding it
/// must be read again (a newer sample has most likely arrived).
fn lapsed(record: &EngineRecord, max_age_ms: u64, now_ms: u64) -> bool {
    record.sampled_at_ms != 0 && now_ms.saturating_sub(record.sampled_at_ms) > max_age_ms
}

/// This VM's engine records as last read, by slot, with when.
#[derive(Debug, Default)]
pub(super) struct EngineCache {
    by_slot: BySlot<(u64, EngineRecord)>,
}

impl<S: SharedStore> LoadTracker<S> {
    /// Whether this VM (`nonce`, random per VM) makes `poller`'s calls: it
    /// holds its lease, or takes it because it is free or its holder has not
    /// renewed it for `lease_ms`. The holder renews it when a quarter of
    /// `lease_ms` has passed since it last did. One VM per Envoy holds each.
    pub fn hold_poller(
        &mut self,
        poller: PollerKind,
        nonce: u64,
        now_ms: u64,
        lease_ms: u64,
    ) -> bool {
        let key = poller_key(&self.tables, poller.lease_name());
        let key = key.as_str();
        let held: Lease = self.tables.read(key).record;
        if held.nonce == nonce && held.is_live(now_ms, lease_ms) {
            if now_ms.saturating_sub(held.heartbeat_ms) >= lease_ms / 4 {
                return lease::heartbeat(&self.tables, key, nonce, now_ms) != Heartbeat::Lost;
            }
            return true;
        }
        if held.is_live(now_ms, lease_ms) {
            return false;
        }
        lease::try_claim(&self.tables, key, nonce, now_ms, lease_ms)
    }

    /// The instances the poller polls: every fresh instance the tracker
    /// knows, configured and learned.
    pub fn engine_poll_targets(&mut self, now_ms: u64) -> Vec<InstanceRef> {
        self.fresh_candidates(now_ms)
            .into_iter()
            .map(|c| c.instance)
            .collect()
    }

    /// Stores `load` and the adapters in use (`active_adapters`), just read
    /// from `instance`'s engine, with this Envoy's in-flight count on it now
    /// (all worker VMs). False if the instance no longer holds its slot or
    /// the write did not get through.
    pub fn store_engine_sample(
        &mut self,
        instance: &InstanceRef,
        load: EngineLoad,
        active_adapters: Option<AdapterNames>,
        now_ms: u64,
    ) -> bool {
        let Some(base_in_flight) = self.in_flight(instance, now_ms) else {
            return false;
        };
        let hash = instance.addr_hash();
        self.rewrite_engine_record(instance.slot, now_ms, &mut |stored| {
            *stored = EngineRecord {
                addr_hash: hash,
                sampled_at_ms: now_ms.max(1),
                load,
                base_in_flight,
                // Its `/v1/models` answer stands until the next.
                served: stored.served.take().filter(|_| stored.addr_hash == hash),
                active_adapters: active_adapters.clone(),
            };
            true
        })
    }

    /// Stores the adapters `instance`'s engine lists (None: its `/v1/models`
    /// did not answer usably), kept beside its load sample.
    pub fn store_served_adapters(
        &mut self,
        instance: &InstanceRef,
        served: Option<AdapterNames>,
        now_ms: u64,
    ) -> bool {
        let hash = instance.addr_hash();
        self.rewrite_engine_record(instance.slot, now_ms, &mut |stored| {
            if stored.addr_hash != hash {
                *stored = EngineRecord {
                    addr_hash: hash,
                    ..EngineRecord::default()
                };
            }
            stored.served = served.clone();
            true
        })
    }

    /// The one writer of `engine/<slot>`: `change` edits a fresh copy of
    /// the record and says whether to write it; what is written becomes
    /// this VM's copy. True if written.
    fn rewrite_engine_record(
        &mut self,
        slot: u16,
        now_ms: u64,
        change: &mut dyn FnMut(&mut EngineRecord) -> bool,
    ) -> bool {
        let key = engine_key(&self.tables, slot);
        let updated = self.tables.update(&key, |stored: &mut EngineRecord| {
            if change(stored) {
                Change::Write(stored.clone())
            } else {
                Change::Keep(())
            }
        });
        match updated {
            Updated::Written(record) => {
                self.engine_cache.by_slot.insert(slot, (now_ms, record));
                true
            }
            _ => false,
        }
    }

    /// Reads the engine records of `slots` into this VM's copies: the tick's,
    /// so that copies past a decision's budget are at most a tick old.
    pub(super) fn refresh_engine_copies(&mut self, slots: &[u16], now_ms: u64) {
        for &slot in slots {
            let record: EngineRecord = self.tables.read(&engine_key(&self.tables, slot)).record;
            self.engine_cache.by_slot.insert(slot, (now_ms, record));
        }
    }

    /// Clears `instance`'s sample (its engine did not answer usably), so
    /// decisions fall back to this Envoy's own counts at once.
    pub fn clear_engine_sample(&mut self, instance: &InstanceRef, now_ms: u64) {
        let hash = instance.addr_hash();
        self.rewrite_engine_record(instance.slot, now_ms, &mut |stored| {
            let sampled = stored.sampled_at_ms != 0 && stored.addr_hash == hash;
            if sampled {
                *stored = EngineRecord::default();
            }
            sampled
        });
        self.engine_cache
            .by_slot
            .insert(instance.slot, (now_ms, EngineRecord::default()));
    }

    /// A response's ORCA load report (`crate::engine_load::orca`): the KV
    /// usage of the engine at `address` as the response left it. Replaces
    /// the KV usage of the instance's sample, if it holds one of this
    /// address; the running and waiting counts and the sample's age stay
    /// the poll's (the report has no running count to refresh them with),
    /// and without a sample (no poll yet, or the last one failed) nothing is
    /// stored: the instance is weighed by this Envoy's counts until a poll
    /// answers. True if the KV usage was stored.
    pub fn refresh_engine_kv_usage(
        &mut self,
        address: &str,
        kv_usage_permille: u16,
        now_ms: u64,
    ) -> bool {
        let Some(slot) = self.registry.find_slot(
            &self.tables,
            &mut self.columns,
            address,
            now_ms,
            Lookup::Only,
        ) else {
            return false;
        };
        let hash = addr_hash(address);
        let kv = Some(kv_usage_permille.min(1000));
        self.rewrite_engine_record(slot, now_ms, &mut |stored| {
            let sampled = stored.sampled_at_ms != 0 && stored.addr_hash == hash;
            if sampled {
                stored.load.kv_usage_permille = kv;
            }
            sampled
        })
    }

    /// `instance`'s engine sample if there is one of its address at most
    /// `max_age_ms` old, read through this VM's cache (at most
    /// [`ENGINE_CACHE_MS`] stale): [`Self::engine_sample_within`] with no
    /// copy standing past its window.
    #[cfg(test)]
    pub(crate) fn engine_sample(
        &mut self,
        instance: &InstanceRef,
        max_age_ms: u64,
        now_ms: u64,
    ) -> Option<EngineRecord> {
        self.engine_sample_within(instance, max_age_ms, now_ms, None)
    }

    /// Of the engine copies of `slots` a decision finds expired, the last it
    /// reads again ([`last_read_again`]); a copy whose sample has lapsed is
    /// always read again, so the budget never costs an instance its sample.
    pub(super) fn engine_copies_read_again(
        &self,
        slots: impl Iterator<Item = u16>,
        max_age_ms: u64,
        now_ms: u64,
    ) -> Option<(u64, u16)> {
        let expired = slots
            .filter_map(|slot| {
                let (read_at, record) = self.engine_cache.by_slot.get(slot)?;
                let expired = !copy_is_fresh(*read_at, now_ms, ENGINE_CACHE_MS);
                (expired && !lapsed(record, max_age_ms, now_ms)).then_some((*read_at, slot))
            })
            .collect();
        last_read_again(expired)
    }

    /// `instance`'s engine sample if there is one of its address at most
    /// `max_age_ms` old, read through this VM's cache (at most
    /// [`ENGINE_CACHE_MS`] stale, or longer for an expired copy ordered
    /// after `last_read_again`: [`Self::engine_copies_read_again`]). The
    /// decision side's one reader.
    pub(super) fn engine_sample_within(
        &mut self,
        instance: &InstanceRef,
        max_age_ms: u64,
        now_ms: u64,
        last_read_again: Option<(u64, u16)>,
    ) -> Option<EngineRecord> {
        let slot = instance.slot;
        let cached = self
            .engine_cache
            .by_slot
            .get(slot)
            .filter(|(read_at, record)| {
                copy_is_fresh(*read_at, now_ms, ENGINE_CACHE_MS)
                    || (last_read_again.is_some_and(|last| (*read_at, slot) > last)
                        && !lapsed(record, max_age_ms, now_ms))
            })
            .map(|(_, record)| record.clone());
        let record = match cached {
            Some(record) => record,
            None => {
                let key = engine_key(&self.tables, instance.slot);
                let record: EngineRecord = self.tables.read(&key).record;
                self.engine_cache
                    .by_slot
                    .insert(instance.slot, (now_ms, record.clone()));
                record
            }
        };
        record
            .is_fresh(instance.addr_hash(), now_ms, max_age_ms)
            .then_some(record)
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;
    use crate::load::LoadConfig;
    use crate::shared::MemoryStore;

    const A: &str = "10.0.0.1:8000";

    fn tracker(store: &Rc<MemoryStore>, nonce: u64) -> LoadTracker<Rc<MemoryStore>> {
        let mut tracker = LoadTracker::new(Rc::clone(store), LoadConfig::default(), nonce);
        tracker.set_configured_instances(&Rc::from([A.to_string()]));
        tracker
    }

    fn load(running: u32) -> EngineLoad {
        EngineLoad {
            running,
            waiting: 1,
            kv_usage_permille: None,
        }
    }

    #[test]
    fn a_stored_sample_is_read_by_every_vm_until_it_is_cleared_or_too_old() {
        let store = Rc::new(MemoryStore::new());
        let mut poller = tracker(&store, 1);
        let mut reader = tracker(&store, 2);
        let instance = poller.engine_poll_targets(1_000).pop().unwrap();
        assert_eq!(&*instance.address, A);
        assert!(poller.store_engine_sample(&instance, load(3), None, 1_000));
        let record = reader.engine_sample(&instance, 500, 1_000).unwrap();
        assert_eq!((record.load, record.sampled_at_ms), (load(3), 1_000));
        assert_eq!(reader.engine_sample(&instance, 500, 1_501), None, "too old");
        // Another instance in the same slot does not inherit it.
        let stranger = InstanceRef::new(instance.slot, "10.9.9.9:1".into());
        assert_eq!(reader.engine_sample(&stranger, 500, 1_100), None);
        assert!(poller.store_engine_sample(&instance, load(4), None, 1_600));
        assert!(reader.engine_sample(&instance, 500, 1_700).is_some());
        poller.clear_engine_sample(&instance, 1_750);
        assert_eq!(poller.engine_sample(&instance, 500, 1_750), None);
        assert_eq!(reader.engine_sample(&instance, 500, 1_800), None, "cleared");
    }

    #[test]
    fn the_reader_reads_each_key_at_most_once_per_cache_period() {
        let store = Rc::new(MemoryStore::new());
        let mut poller = tracker(&store, 1);
        let mut reader = tracker(&store, 2);
        let instance = poller.engine_poll_targets(1_000).pop().unwrap();
        poller.store_engine_sample(&instance, load(3), None, 1_000);
        let reads = store.reads();
        assert!(reader.engine_sample(&instance, 5_000, 1_000).is_some());
        assert_eq!(store.reads(), reads + 1);
        poller.store_engine_sample(&instance, load(7), None, 1_010);
        let reads = store.reads() - 1;
        let cached = reader.engine_sample(&instance, 5_000, 1_000 + ENGINE_CACHE_MS - 1);
        assert_eq!(cached.map(|r| r.load.running), Some(3), "the cached copy");
        assert_eq!(store.reads(), reads + 1, "no read within the period");
        let fresh = reader.engine_sample(&instance, 5_000, 1_000 + ENGINE_CACHE_MS);
        assert_eq!(fresh.map(|r| r.load.running), Some(7));
        assert_eq!(store.reads(), reads + 2);
    }

    #[test]
    fn one_poller_lease_per_store_taken_over_when_not_renewed() {
        let store = Rc::new(MemoryStore::new());
        let mut first = tracker(&store, 1);
        let mut second = tracker(&store, 2);
        assert!(first.hold_poller(PollerKind::EngineLoad, 11, 1_000, 1_500));
        assert!(!second.hold_poller(PollerKind::EngineLoad, 22, 1_000, 1_500));
        // Renewed at a quarter of the lease time: still held later.
        assert!(first.hold_poller(PollerKind::EngineLoad, 11, 1_400, 1_500));
        assert!(!second.hold_poller(PollerKind::EngineLoad, 22, 2_800, 1_500));
        assert!(
            second.hold_poller(PollerKind::EngineLoad, 22, 2_901, 1_500),
            "expired"
        );
        assert!(
            !first.hold_poller(PollerKind::EngineLoad, 11, 2_950, 1_500),
            "lost it"
        );
    }
}
