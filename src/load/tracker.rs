//! The per-VM handle on the shared load tables: one `LoadTracker` per worker VM
//! (a VM-global in the glue, shared by every root and stream context of the VM,
//! and kept across configuration updates, which reuse the VM).
//!
//! It keeps the exact count of this VM's open tickets per instance locally, and
//! publishes that number into its own column of the shared record; readers sum
//! the columns of live VMs.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::instances::{CountCell, InstanceRecord, MAX_ADDRESS_LEN};
use super::lease::{self, Heartbeat, Lease};
use super::pending::PendingBucket;
use super::routes::{RouteBucket, RouteEntry};
use super::{
    Claim, InstanceLoad, InstanceRef, LoadConfig, LoadView, Ticket, UpstreamStart, PENDING_MARK,
};
use crate::shared::{SetError, SharedStore};

/// Slots probed for one address before the registry counts as full for it.
const PROBE_LEN: u16 = 8;

/// This VM's own count on one instance slot.
#[derive(Debug, Clone)]
struct LocalCount {
    address: String,
    addr_hash: u64,
    count: u32,
}

/// See the module documentation.
#[derive(Debug)]
pub struct LoadTracker<S: SharedStore> {
    store: S,
    config: LoadConfig,
    prefix: String,
    nonce: u64,
    /// Our column in the count records, while we hold a lease.
    column: Option<u16>,
    /// Cached lease view, one entry per column.
    leases: Vec<Option<Lease>>,
    local: BTreeMap<u16, LocalCount>,
    slot_of: HashMap<String, u16>,
    known_slots: BTreeSet<u16>,
    last_lease_attempt_ms: Option<u64>,
    /// Registry epoch seen at our last full scan of the instance slots.
    scanned_epoch: Option<u64>,
}

fn addr_hash(address: &str) -> u64 {
    xxh3_64(address.as_bytes())
}

fn key_hash(key: &str) -> u64 {
    xxh3_64_with_seed(key.as_bytes(), 0x6b65_795f_726f_7574)
}

impl<S: SharedStore> LoadTracker<S> {
    /// A tracker for one worker VM. `vm_nonce` must differ between VM
    /// incarnations (e.g. random at VM start); 0 is replaced by 1.
    pub fn new(store: S, config: LoadConfig, vm_nonce: u64) -> Self {
        let config = config.clamped();
        let prefix = format!("prefix-router/{}/v1", config.namespace);
        let columns = usize::from(config.vm_slots);
        Self {
            store,
            prefix,
            nonce: vm_nonce.max(1),
            column: None,
            leases: vec![None; columns],
            local: BTreeMap::new(),
            slot_of: HashMap::new(),
            known_slots: BTreeSet::new(),
            last_lease_attempt_ms: None,
            scanned_epoch: None,
            config,
        }
    }

    /// The configuration in use (sizes clamped).
    pub fn config(&self) -> &LoadConfig {
        &self.config
    }

    /// This VM's column, if it holds a lease.
    pub fn column(&self) -> Option<u16> {
        self.column
    }

    /// Requests this VM currently holds tickets for, over all instances.
    pub fn local_in_flight(&self) -> u32 {
        self.local.values().map(|l| l.count).sum()
    }

    // ----- keys -------------------------------------------------------------

    fn lease_key(&self, column: u16) -> String {
        format!("{}/vm/{column}", self.prefix)
    }

    fn instance_key(&self, slot: u16) -> String {
        format!("{}/inst/{slot}", self.prefix)
    }

    fn epoch_key(&self) -> String {
        format!("{}/epoch", self.prefix)
    }

    fn read_epoch(&self) -> u64 {
        let (value, _) = self.store.get(&self.epoch_key());
        value
            .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
            .map_or(0, u64::from_le_bytes)
    }

    /// Announces a registry change, so other VMs rescan the slots before
    /// their next overflow choice instead of waiting for their tick.
    fn bump_epoch(&self) {
        let key = self.epoch_key();
        for _ in 0..self.config.cas_attempts {
            let (value, cas) = self.store.get(&key);
            let current = value
                .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
                .map_or(0, u64::from_le_bytes);
            let next = current.wrapping_add(1).to_le_bytes();
            match self.store.set(&key, &next, cas) {
                Err(SetError::CasMismatch) => continue,
                _ => return,
            }
        }
    }

    /// Re-reads every instance slot into `known_slots`.
    fn scan_slots(&mut self) {
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

    fn pending_key(&self, bucket: u32) -> String {
        format!("{}/pend/{bucket}", self.prefix)
    }

    fn pending_of(&self, key: &str, now_ms: u64) -> u32 {
        let hash = key_hash(key);
        let (value, _) = self.store.get(&self.pending_key(self.bucket_of(hash)));
        value
            .as_deref()
            .and_then(PendingBucket::decode)
            .map_or(0, |b| b.count(hash, now_ms, self.config.pending_ttl_ms))
    }

    /// Adds or removes one pending request of `key`. A missing bucket is
    /// created empty first (a write on a missing key cannot be conditional).
    fn update_pending(&mut self, key: &str, add: bool, now_ms: u64) {
        let hash = key_hash(key);
        let name = self.pending_key(self.bucket_of(hash));
        let ttl = self.config.pending_ttl_ms;
        for _ in 0..self.config.cas_attempts {
            let (value, cas) = self.store.get(&name);
            if cas.is_none() {
                if !add {
                    return;
                }
                if self
                    .store
                    .set(&name, &PendingBucket::default().encode(), None)
                    .is_err()
                {
                    return;
                }
                continue;
            }
            let mut bucket = value
                .as_deref()
                .and_then(PendingBucket::decode)
                .unwrap_or_default();
            if add {
                bucket.add(hash, now_ms, ttl);
            } else if !bucket.remove(hash, now_ms, ttl) {
                return;
            }
            match self.store.set(&name, &bucket.encode(), cas) {
                Err(SetError::CasMismatch) => continue,
                _ => return,
            }
        }
    }

    fn route_key(&self, bucket: u32) -> String {
        format!("{}/route/{bucket}", self.prefix)
    }

    // ----- leases -----------------------------------------------------------

    /// Heartbeats our lease, or takes one if we have none (or lost ours).
    fn maintain_lease(&mut self, now_ms: u64) {
        if let Some(column) = self.column {
            let key = self.lease_key(column);
            match lease::heartbeat(
                &self.store,
                &key,
                self.nonce,
                now_ms,
                self.config.cas_attempts,
            ) {
                Heartbeat::Kept | Heartbeat::Unknown => return,
                Heartbeat::Lost => {
                    log::warn!("prefix-router: lost VM lease slot {column}; taking another");
                    self.column = None;
                }
            }
        }
        self.acquire_lease(now_ms);
    }

    fn acquire_lease(&mut self, now_ms: u64) {
        self.last_lease_attempt_ms = Some(now_ms);
        for column in 0..self.config.vm_slots {
            let key = self.lease_key(column);
            if lease::try_claim(
                &self.store,
                &key,
                self.nonce,
                now_ms,
                self.config.vm_lease_ms,
            ) {
                self.column = Some(column);
                if let Some(entry) = self.leases.get_mut(usize::from(column)) {
                    *entry = Some(Lease {
                        nonce: self.nonce,
                        heartbeat_ms: now_ms,
                    });
                }
                // Our counts now live in a new column: publish them there.
                let slots: Vec<u16> = self.local.keys().copied().collect();
                for slot in slots {
                    self.publish(slot);
                }
                return;
            }
        }
        log::warn!(
            "prefix-router: all {} VM lease slots are taken",
            self.config.vm_slots
        );
    }

    /// Before the first tick, take a lease on first use (at most once per instant).
    fn ensure_lease(&mut self, now_ms: u64) {
        if self.column.is_none() && self.last_lease_attempt_ms != Some(now_ms) {
            self.acquire_lease(now_ms);
        }
    }

    fn refresh_leases(&mut self) {
        for column in 0..self.config.vm_slots {
            let key = self.lease_key(column);
            let (lease, _) = lease::read(&self.store, &key);
            let index = usize::from(column);
            if let Some(entry) = self.leases.get_mut(index) {
                *entry = lease;
            }
        }
    }

    /// Whether a cell written by `tag` in `column` counts: its VM holds that
    /// column's lease and heartbeats. A cached "no" is checked against the
    /// store (a VM may have joined since the last tick); dead VMs' cells, the
    /// other source of re-reads, are cleared by the next tick.
    fn is_live(&mut self, column: u16, tag: u64, now_ms: u64) -> bool {
        let index = usize::from(column);
        let lease_ms = self.config.vm_lease_ms;
        let matches = |lease: &Option<Lease>| {
            lease.is_some_and(|l| l.nonce == tag && l.is_live(now_ms, lease_ms))
        };
        match self.leases.get(index) {
            None => return false,
            Some(cached) if matches(cached) => return true,
            Some(_) => {}
        }
        let key = self.lease_key(column);
        let (fresh, _) = lease::read(&self.store, &key);
        if let Some(entry) = self.leases.get_mut(index) {
            *entry = fresh;
        }
        matches(&fresh)
    }

    // ----- instance records -------------------------------------------------

    /// The record in `slot`: `(None, None)` if never written; an undecodable
    /// value reads as a free record (so it can be overwritten).
    fn read_instance(&self, slot: u16) -> (Option<InstanceRecord>, Option<u32>) {
        let (value, cas) = self.store.get(&self.instance_key(slot));
        match value {
            None => (None, cas),
            Some(bytes) => (
                Some(InstanceRecord::decode(&bytes).unwrap_or_default()),
                cas,
            ),
        }
    }

    fn local_count(&self, slot: u16, address: &str) -> u32 {
        match self.local.get(&slot) {
            Some(local) if local.address == address => local.count,
            _ => 0,
        }
    }

    /// In flight on the record's instance: live VMs' cells plus our exact count
    /// (our own published cell may lag behind it).
    fn total(&mut self, slot: u16, record: &InstanceRecord, now_ms: u64) -> u32 {
        let mut total = self.local_count(slot, &record.address);
        for (index, cell) in record.cells.iter().enumerate() {
            let Ok(column) = u16::try_from(index) else {
                break;
            };
            if Some(column) == self.column || cell.count == 0 {
                continue;
            }
            if self.is_live(column, cell.tag, now_ms) {
                total = total.saturating_add(cell.count);
            }
        }
        total
    }

    fn probe_start(&self, address: &str) -> u16 {
        // max_instances <= 4096, so the remainder fits in u16.
        (addr_hash(address) % u64::from(self.config.max_instances)) as u16
    }

    /// Finds the slot holding `address`; with `create`, registers it in the
    /// first free or reusable slot of its probe sequence.
    fn find_slot(&mut self, address: &str, now_ms: u64, create: bool) -> Option<u16> {
        if address.is_empty() || address.len() > MAX_ADDRESS_LEN {
            return None;
        }
        if let Some(&slot) = self.slot_of.get(address) {
            match self.read_instance(slot).0 {
                Some(record) if record.address == address => return Some(slot),
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

    fn remember_slot(&mut self, address: &str, slot: u16) {
        // Bounded like the registry itself.
        if self.slot_of.len() >= usize::from(self.config.max_instances) * 2 {
            self.slot_of.clear();
        }
        self.slot_of.insert(address.to_string(), slot);
        self.known_slots.insert(slot);
    }

    /// Writes a new record for `address` into `slot` (free, never written, or
    /// reusable). A missing key is first created empty, since a write on a
    /// missing key cannot be conditional; the real record goes in by CAS.
    fn register_in(&mut self, slot: u16, address: &str, now_ms: u64) -> bool {
        let key = self.instance_key(slot);
        for _ in 0..self.config.cas_attempts {
            let (record, cas) = self.read_instance(slot);
            let Some(record) = record else {
                if self
                    .store
                    .set(&key, &InstanceRecord::default().encode(), None)
                    .is_err()
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
                    self.bump_epoch();
                    return true;
                }
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Failed) => return false,
            }
        }
        false
    }

    /// Reads the record in `slot` if it still belongs to `address`.
    fn record_for(&self, slot: u16, address: &str) -> Option<InstanceRecord> {
        self.read_instance(slot)
            .0
            .filter(|record| record.address == address)
    }

    /// Writes our exact local count for `slot` into our column (and, with
    /// `seen`, refreshes last-seen). Returns false if it could not be written
    /// now; the next tick repairs it.
    fn publish_with(&mut self, slot: u16, seen_ms: Option<u64>) -> bool {
        let Some(column) = self.column else {
            return false;
        };
        let key = self.instance_key(slot);
        for _ in 0..self.config.cas_attempts {
            let (Some(mut record), cas) = self.read_instance(slot) else {
                return true;
            };
            if record.is_free() {
                return true;
            }
            let count = self.local_count(slot, &record.address);
            let cell = CountCell {
                tag: self.nonce,
                count,
            };
            let seen_stale = seen_ms.is_some_and(|s| s > record.last_seen_ms || record.suspect);
            if record.cell(column) == cell && !seen_stale {
                return true;
            }
            record.set_cell(
                column,
                if count == 0 {
                    CountCell::default()
                } else {
                    cell
                },
            );
            if let Some(seen) = seen_ms {
                record.seen(seen);
            }
            match self.store.set(&key, &record.encode(), cas) {
                Ok(()) => return true,
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Failed) => return false,
            }
        }
        false
    }

    fn publish(&mut self, slot: u16) -> bool {
        self.publish_with(slot, None)
    }

    fn bump_local(&mut self, slot: u16, address: &str) -> Ticket {
        let hash = addr_hash(address);
        let entry = self.local.entry(slot).or_insert_with(|| LocalCount {
            address: address.to_string(),
            addr_hash: hash,
            count: 0,
        });
        if entry.address != address {
            // The slot was reused for another instance; our old count there
            // was for an instance that is gone.
            *entry = LocalCount {
                address: address.to_string(),
                addr_hash: hash,
                count: 0,
            };
        }
        entry.count = entry.count.saturating_add(1);
        Ticket {
            slot,
            addr_hash: hash,
            owner: self.nonce,
        }
    }

    /// Counts one request on `slot`/`address`: atomically against `cap` (with
    /// `pending` requests on their way added to the count) if given, else
    /// unconditionally (a failed publish is repaired at the tick). `seen`: the
    /// instance is serving right now (refreshes last-seen).
    fn add(
        &mut self,
        slot: u16,
        address: &str,
        cap: Option<u32>,
        pending: u32,
        seen: bool,
        now_ms: u64,
    ) -> Claim {
        self.ensure_lease(now_ms);
        let Some(column) = self.column else {
            // No column to publish into: count locally only.
            if let Some(cap) = cap {
                let Some(record) = self.record_for(slot, address) else {
                    return Claim::Gone;
                };
                let in_flight = self.total(slot, &record, now_ms).saturating_add(pending);
                if in_flight >= cap {
                    return Claim::Full { in_flight };
                }
            }
            return Claim::Claimed(self.bump_local(slot, address));
        };
        let key = self.instance_key(slot);
        for _ in 0..self.config.cas_attempts {
            let (record, cas) = self.read_instance(slot);
            let Some(mut record) = record.filter(|r| r.address == address) else {
                return Claim::Gone;
            };
            if let Some(cap) = cap {
                let in_flight = self.total(slot, &record, now_ms).saturating_add(pending);
                if in_flight >= cap {
                    return Claim::Full { in_flight };
                }
            }
            let count = self.local_count(slot, address).saturating_add(1);
            record.set_cell(
                column,
                CountCell {
                    tag: self.nonce,
                    count,
                },
            );
            if seen {
                record.seen(now_ms);
            }
            match self.store.set(&key, &record.encode(), cas) {
                Ok(()) => return Claim::Claimed(self.bump_local(slot, address)),
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Failed) => break,
            }
        }
        if cap.is_some() {
            return Claim::Contended;
        }
        // Unconditional count: keep the truth locally; the tick publishes it.
        Claim::Claimed(self.bump_local(slot, address))
    }

    /// Marks an instance as not seen (a nominated host Envoy did not use is
    /// probably gone), so it stops being an overflow candidate until it serves
    /// again.
    fn mark_unseen(&mut self, address: &str, now_ms: u64) {
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

    // ----- routes -----------------------------------------------------------

    fn bucket_of(&self, key_hash: u64) -> u32 {
        // route_buckets <= 65536, so the remainder fits in u32.
        (key_hash % u64::from(self.config.route_buckets)) as u32
    }

    fn learn(&mut self, key: &str, slot: u16, address: &str, now_ms: u64) {
        let hash = key_hash(key);
        let key_name = self.route_key(self.bucket_of(hash));
        let entry = RouteEntry {
            key_hash: hash,
            slot,
            addr_hash: addr_hash(address),
            learned_ms: now_ms,
        };
        let refresh_ms = self.config.route_ttl_ms / 8;
        for _ in 0..self.config.cas_attempts {
            let (value, cas) = self.store.get(&key_name);
            let mut bucket = value
                .as_deref()
                .and_then(RouteBucket::decode)
                .unwrap_or_default();
            if !bucket.upsert(entry, refresh_ms) {
                return;
            }
            match self.store.set(&key_name, &bucket.encode(), cas) {
                Err(SetError::CasMismatch) => continue,
                _ => return,
            }
        }
    }

    // ----- the glue's entry points -----------------------------------------

    /// Upstream filter, `on_http_request_headers`: registers the instance,
    /// learns the key's target (when Maglev chose it), and counts the request
    /// unless the decision already counted it on this very instance. Keep the
    /// returned ticket in the upstream stream and release it in `on_done`.
    ///
    /// Without an upstream filter, the glue may call this from the downstream
    /// `on_http_response_headers` instead (counting then starts late).
    pub fn upstream_started(&mut self, start: UpstreamStart<'_>, now_ms: u64) -> Option<Ticket> {
        let ticket = self.count_upstream(start, now_ms);
        // Counted (or not countable) now: no longer pending. Counting first
        // means there is no instant where the request is neither.
        if let (Some(PENDING_MARK), Some(key)) = (start.counted, start.key) {
            self.update_pending(key, false, now_ms);
        }
        ticket
    }

    fn count_upstream(&mut self, start: UpstreamStart<'_>, now_ms: u64) -> Option<Ticket> {
        if start.overridden {
            if let Some(nominated) = start
                .counted
                .filter(|c| *c != start.address && *c != PENDING_MARK)
            {
                self.mark_unseen(nominated, now_ms);
            }
        }
        let slot = self.find_slot(start.address, now_ms, true)?;
        if let (Some(key), false) = (start.key, start.overridden) {
            self.learn(key, slot, start.address, now_ms);
        }
        if start.counted == Some(start.address) {
            // Already counted by the decision; just keep last-seen fresh.
            let refresh_ms = (self.config.instance_ttl_ms / 8).max(1);
            let stale = self
                .record_for(slot, start.address)
                .is_some_and(|r| r.suspect || now_ms.saturating_sub(r.last_seen_ms) >= refresh_ms);
            if stale {
                self.publish_with(slot, Some(now_ms));
            }
            return None;
        }
        match self.add(slot, start.address, None, 0, true, now_ms) {
            Claim::Claimed(ticket) => Some(ticket),
            _ => None,
        }
    }

    /// Gives a ticket back: the request it counted has ended. Call exactly once
    /// per ticket (the ticket is consumed), from the stream's `on_done`.
    pub fn release(&mut self, ticket: Ticket, now_ms: u64) {
        if ticket.owner != self.nonce {
            log::warn!("prefix-router: ticket of another VM released here; ignored");
            return;
        }
        let Some(local) = self.local.get_mut(&ticket.slot) else {
            return;
        };
        if local.addr_hash != ticket.addr_hash || local.count == 0 {
            return;
        }
        local.count -= 1;
        self.ensure_lease(now_ms);
        // A failed publish leaves the shared copy high until the next tick.
        self.publish(ticket.slot);
    }

    /// Root context tick (about every second): heartbeat the lease, refresh the
    /// lease view, republish our cells wherever the shared copy disagrees with
    /// our local truth, and clear cells of dead VMs.
    pub fn tick(&mut self, now_ms: u64) {
        self.maintain_lease(now_ms);
        self.refresh_leases();
        self.scanned_epoch = Some(self.read_epoch());
        for slot in 0..self.config.max_instances {
            let (record, _) = self.read_instance(slot);
            let Some(record) = record.filter(|r| !r.is_free()) else {
                self.known_slots.remove(&slot);
                continue;
            };
            self.known_slots.insert(slot);
            if self.needs_repair(slot, &record, now_ms) {
                self.repair(slot, now_ms);
            }
        }
        self.local.retain(|_, l| l.count > 0);
    }

    fn needs_repair(&mut self, slot: u16, record: &InstanceRecord, now_ms: u64) -> bool {
        if let Some(column) = self.column {
            let count = self.local_count(slot, &record.address);
            let mine = record.cell(column);
            let expected = if count == 0 {
                CountCell::default()
            } else {
                CountCell {
                    tag: self.nonce,
                    count,
                }
            };
            if mine != expected {
                return true;
            }
        }
        record.cells.iter().enumerate().any(|(index, cell)| {
            let column = u16::try_from(index).unwrap_or(u16::MAX);
            cell.count > 0 && Some(column) != self.column && !self.is_live(column, cell.tag, now_ms)
        })
    }

    /// Rewrites our cell from the local truth and zeroes dead VMs' cells.
    fn repair(&mut self, slot: u16, now_ms: u64) {
        let key = self.instance_key(slot);
        for _ in 0..self.config.cas_attempts {
            let (Some(mut record), cas) = self.read_instance(slot) else {
                return;
            };
            if record.is_free() {
                return;
            }
            let columns = record.cells.len();
            for index in 0..columns {
                let Ok(column) = u16::try_from(index) else {
                    break;
                };
                let cell = record.cell(column);
                if Some(column) == self.column {
                    continue;
                }
                if cell.count > 0 && !self.is_live(column, cell.tag, now_ms) {
                    record.set_cell(column, CountCell::default());
                }
            }
            if let Some(column) = self.column {
                let count = self.local_count(slot, &record.address);
                let cell = if count == 0 {
                    CountCell::default()
                } else {
                    CountCell {
                        tag: self.nonce,
                        count,
                    }
                };
                record.set_cell(column, cell);
            }
            match self.store.set(&key, &record.encode(), cas) {
                Err(SetError::CasMismatch) => continue,
                _ => return,
            }
        }
    }

    /// Every registered instance with its in-flight count, for the gauges.
    pub fn snapshot(&mut self, now_ms: u64) -> Vec<InstanceLoad> {
        let mut loads = Vec::new();
        for slot in 0..self.config.max_instances {
            let (Some(record), _) = self.read_instance(slot) else {
                continue;
            };
            if record.is_free() {
                continue;
            }
            let in_flight = self.total(slot, &record, now_ms);
            loads.push(InstanceLoad {
                fresh: record.is_fresh(now_ms, self.config.instance_ttl_ms),
                address: record.address,
                in_flight,
            });
        }
        loads
    }

    fn fresh_candidates(
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
            let (Some(record), _) = self.read_instance(slot) else {
                continue;
            };
            if !record.is_fresh(now_ms, self.config.instance_ttl_ms)
                || record.address == exclude.address
            {
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
}

impl<S: SharedStore> LoadView for LoadTracker<S> {
    fn target_of(&mut self, key: &str, now_ms: u64) -> Option<InstanceRef> {
        let hash = key_hash(key);
        let (value, _) = self.store.get(&self.route_key(self.bucket_of(hash)));
        let entry = value.as_deref().and_then(RouteBucket::decode)?.lookup(
            hash,
            now_ms,
            self.config.route_ttl_ms,
        )?;
        if entry.slot >= self.config.max_instances {
            return None;
        }
        let record = self.read_instance(entry.slot).0?;
        let valid = addr_hash(&record.address) == entry.addr_hash
            && record.is_fresh(now_ms, self.config.instance_ttl_ms);
        valid.then_some(InstanceRef {
            slot: entry.slot,
            address: record.address,
        })
    }

    fn in_flight(&mut self, instance: &InstanceRef, now_ms: u64) -> Option<u32> {
        let record = self.record_for(instance.slot, &instance.address)?;
        Some(self.total(instance.slot, &record, now_ms))
    }

    fn route_blind(&mut self, key: &str, now_ms: u64) -> Option<InstanceRef> {
        // Mark first, then look again: either this lookup sees a target a
        // worker learned meanwhile, or that worker's claims see the mark.
        self.update_pending(key, true, now_ms);
        let target = self.target_of(key, now_ms)?;
        self.update_pending(key, false, now_ms);
        Some(target)
    }

    fn claim(
        &mut self,
        instance: &InstanceRef,
        key: Option<&str>,
        cap: Option<u32>,
        now_ms: u64,
    ) -> Claim {
        if instance.slot >= self.config.max_instances {
            return Claim::Gone;
        }
        let pending = match (key, cap) {
            (Some(key), Some(_)) => self.pending_of(key, now_ms),
            _ => 0,
        };
        self.add(
            instance.slot,
            &instance.address,
            cap,
            pending,
            false,
            now_ms,
        )
    }

    fn least_busy_other(
        &mut self,
        exclude: &InstanceRef,
        random: u64,
        now_ms: u64,
    ) -> Option<(InstanceRef, u32)> {
        // Another VM registered an instance since we last looked: rescan.
        if self.scanned_epoch != Some(self.read_epoch()) {
            self.scan_slots();
        }
        self.fresh_candidates(exclude, random, now_ms)
    }
}
