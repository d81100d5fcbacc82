//! The engines' samples in shared data, as this VM sees them: the poller's
//! lease and instance list, its writes of each instance's sample
//! (`engine/<slot>`), and the one reader decisions use, through a per-VM
//! cache so that a decision does not read every instance's key on every
//! request.

use std::collections::HashMap;

use super::super::engine::EngineRecord;
use super::super::lease::{self, Heartbeat, Lease};
use super::super::table::{Change, Tables, Updated};
use super::super::{EngineLoad, InstanceRef, LoadView};
use super::{addr_hash, LoadTracker};
use crate::shared::SharedStore;

/// How long a VM reuses an engine record it read before reading it again.
/// Samples arrive every `interval_ms` (500 ms by default, 50 ms at the
/// least), so reading a slot at most every 50 ms per VM adds at most 50 ms
/// to a sample's age (a cleared record, after a failed poll, is seen at most
/// 50 ms late), while a burst of requests reads each instance's key once.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const ENGINE_CACHE_MS: u64 = 50;

/// The shared-data key of instance slot `slot`'s engine sample.
fn engine_key<S: SharedStore>(tables: &Tables<S>, slot: u16) -> String {
    tables.key(format_args!("engine/{slot}"))
}

/// The poller lease's key: one poller per Envoy (per shared-data map).
fn poller_key<S: SharedStore>(tables: &Tables<S>) -> String {
    tables.key(format_args!("engine-poller"))
}

/// This VM's engine records as last read, by slot, with when.
#[derive(Debug, Default)]
pub(super) struct EngineCache {
    by_slot: HashMap<u16, (u64, EngineRecord)>,
}

impl<S: SharedStore> LoadTracker<S> {
    /// Whether this VM (`nonce`, random per VM) polls the engines: it holds
    /// the poller lease, or takes it because it is free or its holder has
    /// not renewed it for `lease_ms`. The holder renews it when a quarter of
    /// `lease_ms` has passed since it last did.
    pub fn hold_engine_poller(&mut self, nonce: u64, now_ms: u64, lease_ms: u64) -> bool {
        let key = poller_key(&self.tables);
        let held: Lease = self.tables.read(&key).record;
        if held.nonce == nonce && held.is_live(now_ms, lease_ms) {
            if now_ms.saturating_sub(held.heartbeat_ms) >= lease_ms / 4 {
                return lease::heartbeat(&self.tables, &key, nonce, now_ms) != Heartbeat::Lost;
            }
            return true;
        }
        if held.is_live(now_ms, lease_ms) {
            return false;
        }
        lease::try_claim(&self.tables, &key, nonce, now_ms, lease_ms)
    }

    /// The instances the poller polls: every fresh instance the tracker
    /// knows, configured and learned.
    pub fn engine_poll_targets(&mut self, now_ms: u64) -> Vec<InstanceRef> {
        self.fresh_candidates(now_ms)
            .into_iter()
            .map(|c| c.instance)
            .collect()
    }

    /// Stores `load`, just read from `instance`'s engine, with this Envoy's
    /// in-flight count on it now (all worker VMs). False if the instance no
    /// longer holds its slot or the write did not get through.
    pub fn store_engine_sample(
        &mut self,
        instance: &InstanceRef,
        load: EngineLoad,
        now_ms: u64,
    ) -> bool {
        let Some(base_in_flight) = self.in_flight(instance, now_ms) else {
            return false;
        };
        let record = EngineRecord {
            addr_hash: addr_hash(&instance.address),
            sampled_at_ms: now_ms.max(1),
            load,
            base_in_flight,
        };
        let key = engine_key(&self.tables, instance.slot);
        let written = self.tables.update(&key, |stored: &mut EngineRecord| {
            *stored = record;
            Change::<(), ()>::Write(())
        });
        self.engine_cache
            .by_slot
            .insert(instance.slot, (now_ms, record));
        written == Updated::Written(())
    }

    /// Clears `instance`'s sample (its engine did not answer usably), so
    /// decisions fall back to this Envoy's own counts at once.
    pub fn clear_engine_sample(&mut self, instance: &InstanceRef, now_ms: u64) {
        let key = engine_key(&self.tables, instance.slot);
        let hash = addr_hash(&instance.address);
        self.tables.update(&key, |stored: &mut EngineRecord| {
            if stored.sampled_at_ms == 0 || stored.addr_hash != hash {
                return Change::<(), ()>::Keep(());
            }
            *stored = EngineRecord::default();
            Change::Write(())
        });
        self.engine_cache
            .by_slot
            .insert(instance.slot, (now_ms, EngineRecord::default()));
    }

    /// `instance`'s engine sample if there is one of its address at most
    /// `max_age_ms` old, read through this VM's cache (at most
    /// [`ENGINE_CACHE_MS`] stale). The decision side's one reader.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn engine_sample(
        &mut self,
        instance: &InstanceRef,
        max_age_ms: u64,
        now_ms: u64,
    ) -> Option<EngineRecord> {
        let cached = self
            .engine_cache
            .by_slot
            .get(&instance.slot)
            .filter(|(read_at, _)| now_ms.saturating_sub(*read_at) < ENGINE_CACHE_MS)
            .map(|(_, record)| *record);
        let record = match cached {
            Some(record) => record,
            None => {
                let key = engine_key(&self.tables, instance.slot);
                let record: EngineRecord = self.tables.read(&key).record;
                self.engine_cache
                    .by_slot
                    .insert(instance.slot, (now_ms, record));
                record
            }
        };
        record
            .is_fresh(addr_hash(&instance.address), now_ms, max_age_ms)
            .then_some(record)
    }
}
