//! The instance registry: one slot per instance address, found by hashing
//! with bounded probing, reused only when its instance is forgotten and idle;
//! plus the epoch that tells other VMs to rescan after a registration.

use super::*;

impl<S: SharedStore> LoadTracker<S> {
    /// The record in `slot`: `(None, None)` if never written; an undecodable
    /// value reads as a free record (so it can be overwritten).
    /// Keeps a record just read for the next [`Self::read_instance_at`] of
    /// the same slot in the same millisecond.
    pub(super) fn remember_read(
        &mut self,
        slot: u16,
        now_ms: u64,
        record: InstanceRecord,
        cas: Option<u32>,
    ) {
        self.recent = Some(RecentRead {
            slot,
            at_ms: now_ms,
            record,
            cas,
        });
    }

    /// The record of `slot`: the one a lookup just read in this same
    /// millisecond of this decision if there is one (used once), else read
    /// now. Reusing it is safe for a write, which is a compare-and-swap on
    /// its token (a change since the read fails it and the caller re-reads),
    /// and as fresh as a read for a check (same decision, same millisecond).
    pub(super) fn read_instance_at(
        &mut self,
        slot: u16,
        now_ms: u64,
    ) -> (Option<InstanceRecord>, Option<u32>) {
        match self.recent.take() {
            Some(recent) if recent.slot == slot && recent.at_ms == now_ms => {
                (Some(recent.record), recent.cas)
            }
            _ => self.read_instance(slot),
        }
    }

    pub(super) fn read_instance(&self, slot: u16) -> (Option<InstanceRecord>, Option<u32>) {
        let (value, cas) = self.store.get(&self.instance_key(slot));
        match value {
            None => (None, cas),
            Some(bytes) => (
                Some(InstanceRecord::decode(&bytes).unwrap_or_default()),
                cas,
            ),
        }
    }

    pub(super) fn probe_start(&self, address: &str) -> u16 {
        // max_instances <= 4096, so the remainder fits in u16.
        (addr_hash(address) % u64::from(self.config.max_instances)) as u16
    }

    /// Finds the slot holding `address`; with `create`, registers it in the
    /// first free or reusable slot of its probe sequence.
    pub(super) fn find_slot(&mut self, address: &str, now_ms: u64, create: bool) -> Option<u16> {
        if address.is_empty() || address.len() > MAX_ADDRESS_LEN {
            return None;
        }
        if let Some(&slot) = self.slot_of.get(address) {
            match self.read_instance(slot) {
                (Some(record), cas) if record.address == address => {
                    self.remember_read(slot, now_ms, record, cas);
                    return Some(slot);
                }
                _ => {
                    self.slot_of.remove(address);
                }
            }
        }
        let start = self.probe_start(address);
        let max = self.config.max_instances;
        let mut candidate = None;
        for step in 0..PROBE_LEN.min(max) {
            let slot = ((u32::from(start) + u32::from(step)) % u32::from(max)) as u16;
            let (record, _) = self.read_instance(slot);
            match record {
                Some(record) if record.address == address => {
                    self.remember_slot(address, slot);
                    return Some(slot);
                }
                Some(record) if !record.is_free() => {
                    let reusable = !record.is_fresh(now_ms, self.config.instance_ttl_ms)
                        && self.total(slot, &record, now_ms) == 0;
                    if reusable && candidate.is_none() {
                        candidate = Some(slot);
                    }
                }
                _ => {
                    if candidate.is_none() {
                        candidate = Some(slot);
                    }
                }
            }
        }
        if !create {
            return None;
        }
        let Some(slot) = candidate else {
            log::warn!("prefix-router: instance registry full around {address}");
            return None;
        };
        self.register_in(slot, address, now_ms).then(|| {
            self.remember_slot(address, slot);
            slot
        })
    }

    pub(super) fn remember_slot(&mut self, address: &str, slot: u16) {
        // Bounded like the registry itself.
        if self.slot_of.len() >= usize::from(self.config.max_instances) * 2 {
            self.slot_of.clear();
        }
        self.slot_of.insert(address.to_string(), slot);
        self.known_slots.insert(slot);
    }

    /// Writes a new record for `address` into `slot` (free, never written, or
    /// reusable). A missing key is first created empty (never over another VM's
    /// record: [`SharedStore::create`]); the real record goes in by CAS.
    pub(super) fn register_in(&mut self, slot: u16, address: &str, now_ms: u64) -> bool {
        let key = self.instance_key(slot);
        for _ in 0..self.config.cas_attempts {
            let (record, cas) = self.read_instance(slot);
            let Some(record) = record else {
                // Err(CasMismatch): another VM registered here meanwhile.
                if let Err(SetError::Failed) =
                    self.store.create(&key, &InstanceRecord::default().encode())
                {
                    return false;
                }
                continue;
            };
            if record.address == address {
                return true;
            }
            let reusable = record.is_free()
                || (!record.is_fresh(now_ms, self.config.instance_ttl_ms)
                    && self.total(slot, &record, now_ms) == 0);
            if !reusable {
                return false;
            }
            let fresh = InstanceRecord::new(address, now_ms);
            match self.store.set(&key, &fresh.encode(), cas) {
                Ok(()) => {
                    self.bump_epoch(now_ms);
                    return true;
                }
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Failed) => return false,
            }
        }
        false
    }

    /// Reads the record in `slot` if it still belongs to `address`.
    pub(super) fn record_for(&self, slot: u16, address: &str) -> Option<InstanceRecord> {
        self.read_instance(slot)
            .0
            .filter(|record| record.address == address)
    }

    /// Marks an instance as not seen (a nominated host Envoy did not use is
    /// probably gone), so it stops being an overflow candidate until it serves
    /// again.
    pub(super) fn mark_unseen(&mut self, address: &str, now_ms: u64) {
        let Some(slot) = self.find_slot(address, now_ms, false) else {
            return;
        };
        let key = self.instance_key(slot);
        for _ in 0..self.config.cas_attempts {
            let (record, cas) = self.read_instance(slot);
            let Some(mut record) = record.filter(|r| r.address == address) else {
                return;
            };
            if record.suspect {
                return;
            }
            record.suspect = true;
            match self.store.set(&key, &record.encode(), cas) {
                Err(SetError::CasMismatch) => continue,
                _ => return,
            }
        }
    }

    pub(super) fn epoch_key(&self) -> String {
        format!("{}/epoch", self.prefix)
    }

    pub(super) fn read_epoch(&self) -> u64 {
        self.read_epoch_record().0
    }

    /// The registry epoch and when it last changed (0: never).
    pub(super) fn read_epoch_record(&self) -> (u64, u64) {
        let (value, _) = self.store.get(&self.epoch_key());
        value.as_deref().map_or((0, 0), decode_epoch)
    }

    /// Announces a registry change, so other VMs rescan the slots before
    /// their next overflow choice instead of waiting for their tick.
    pub(super) fn bump_epoch(&self, now_ms: u64) {
        let key = self.epoch_key();
        for _ in 0..self.config.cas_attempts {
            let (value, cas) = self.store.get(&key);
            let (current, _) = value.as_deref().map_or((0, 0), decode_epoch);
            let mut next = current.wrapping_add(1).to_le_bytes().to_vec();
            next.extend_from_slice(&now_ms.to_le_bytes());
            // The first bump creates the key, never over another VM's.
            match self.store.replace(&key, &next, cas) {
                Err(SetError::CasMismatch) => continue,
                _ => return,
            }
        }
    }

    /// Re-reads every instance slot into `known_slots`.
    pub(super) fn scan_slots(&mut self) {
        self.scanned_epoch = Some(self.read_epoch());
        for slot in 0..self.config.max_instances {
            match self.read_instance(slot).0 {
                Some(record) if !record.is_free() => {
                    self.known_slots.insert(slot);
                }
                _ => {
                    self.known_slots.remove(&slot);
                }
            }
        }
    }

    /// Rescans the slots if another VM registered an instance since this VM
    /// last looked (`epoch`: the registry epoch just read).
    pub(super) fn rescan_if_changed(&mut self, epoch: u64) {
        if self.scanned_epoch != Some(epoch) {
            self.scan_slots();
        }
    }

    /// The record in `slot` if its instance has served within the instance
    /// TTL (and is not suspect).
    pub(super) fn fresh_record(&self, slot: u16, now_ms: u64) -> Option<InstanceRecord> {
        self.read_instance(slot)
            .0
            .filter(|record| record.is_fresh(now_ms, self.config.instance_ttl_ms))
    }

    pub(super) fn fresh_candidates(
        &mut self,
        exclude: &InstanceRef,
        random: u64,
        now_ms: u64,
    ) -> Option<(InstanceRef, u32)> {
        let slots: Vec<u16> = self.known_slots.iter().copied().collect();
        let mut best: Option<(InstanceRef, u32, u64)> = None;
        for slot in slots {
            if slot == exclude.slot {
                continue;
            }
            let Some(record) = self.fresh_record(slot, now_ms) else {
                continue;
            };
            if record.address == exclude.address {
                continue;
            }
            let in_flight = self.total(slot, &record, now_ms);
            let tie_break = xxh3_64_with_seed(&slot.to_le_bytes(), random);
            let better = match &best {
                None => true,
                Some((_, best_load, best_tie)) => {
                    in_flight < *best_load || (in_flight == *best_load && tie_break < *best_tie)
                }
            };
            if better {
                let instance = InstanceRef {
                    slot,
                    address: record.address,
                };
                best = Some((instance, in_flight, tie_break));
            }
        }
        best.map(|(instance, in_flight, _)| (instance, in_flight))
    }

    pub(super) fn instance_key(&self, slot: u16) -> String {
        format!("{}/inst/{slot}", self.prefix)
    }
}

/// The epoch record: the epoch, then (since key balancing) the time of the
/// change; an 8-byte record from an older build has no time.
fn decode_epoch(value: &[u8]) -> (u64, u64) {
    let word = |at: usize| {
        value
            .get(at..at + 8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map_or(0, u64::from_le_bytes)
    };
    (word(0), word(8))
}
