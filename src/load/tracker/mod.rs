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
    Claim, InstanceLoad, InstanceRef, LoadConfig, LoadView, Target, Ticket, UpstreamStart,
};
use crate::headers::PENDING_MARK;
use crate::shared::{SetError, SharedStore};

mod balance;
#[cfg(test)]
pub(super) use balance::key_bound;
mod columns;
mod learned;
mod registry;

/// Slots probed for one address before the registry counts as full for it.
const PROBE_LEN: u16 = 8;

/// How long a VM trusts its own copy of a key's learned route before reading
/// the shared table again. Routes change only when the fleet does, and this
/// VM's own upstream filter updates its copy at once; other VMs' news waits
/// at most this long.
const ROUTE_COPY_MS: u64 = 1_000;

/// Most route copies a VM keeps (cleared when full, like `slot_of`); also
/// the most keys whose last response check it remembers.
const MAX_ROUTE_COPIES: usize = 4_096;

/// Counting in the listener, how often one VM checks at a response where a
/// request claimed on its key's learned target really went (reading
/// `upstream.address` and the instance record: two host calls). Fleet
/// changes remap keys rarely; a remapped key is counted on its old instance
/// for at most this long per VM.
pub const RESPONSE_CHECK_MS: u64 = 1_000;

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
    /// Copies of learned routes by key hash, with when they were last read
    /// or written here (see [`ROUTE_COPY_MS`]).
    route_copies: HashMap<u64, (RouteEntry, u64)>,
    /// When this VM last had a response checked for a key (by key hash),
    /// counting in the listener (see [`LoadTracker::response_check_due`]).
    checked_keys: HashMap<u64, u64>,
    /// The instance record a lookup just read, for the claim or check that
    /// follows it in the same decision (one shared-data read, a host call,
    /// fewer). See [`LoadTracker::read_instance_at`].
    recent: Option<RecentRead>,
}

/// One instance record as read at `at_ms`, with its CAS token.
#[derive(Debug)]
struct RecentRead {
    slot: u16,
    at_ms: u64,
    record: InstanceRecord,
    cas: Option<u32>,
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
            recent: None,
            route_copies: HashMap::new(),
            checked_keys: HashMap::new(),
            config,
        }
    }

    /// The configuration in use (sizes clamped).
    pub fn config(&self) -> &LoadConfig {
        &self.config
    }

    /// Changes how long an unseen instance stays known (a configuration
    /// update; the tables themselves are kept).
    pub fn set_instance_ttl_ms(&mut self, instance_ttl_ms: u64) {
        self.config.instance_ttl_ms = instance_ttl_ms;
    }

    /// This VM's column, if it holds a lease.
    pub fn column(&self) -> Option<u16> {
        self.column
    }

    /// Requests this VM currently holds tickets for, over all instances.
    pub fn local_in_flight(&self) -> u32 {
        self.local.values().map(|l| l.count).sum()
    }

    fn lease_key(&self, column: u16) -> String {
        format!("{}/vm/{column}", self.prefix)
    }

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
                .read_instance_at(slot, now_ms)
                .0
                .filter(|r| r.address == start.address)
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

    /// Counting in the listener: whether a request of `key` claimed on its
    /// learned target should have its response checked (true once per
    /// [`RESPONSE_CHECK_MS`] per key and VM; asking counts as checking, so
    /// concurrent requests do not all check).
    pub fn response_check_due(&mut self, key: &str, now_ms: u64) -> bool {
        let hash = key_hash(key);
        let due = self
            .checked_keys
            .get(&hash)
            .is_none_or(|at| now_ms.saturating_sub(*at) >= RESPONSE_CHECK_MS);
        if due {
            if self.checked_keys.len() >= MAX_ROUTE_COPIES {
                self.checked_keys.clear();
            }
            self.checked_keys.insert(hash, now_ms);
        }
        due
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
}

impl<S: SharedStore> LoadView for LoadTracker<S> {
    fn target_of(&mut self, key: &str, now_ms: u64) -> Option<Target> {
        let hash = key_hash(key);
        let entry = match self.route_copy(hash, now_ms) {
            Some(entry) => entry,
            None => {
                let (value, _) = self.store.get(&self.route_key(self.bucket_of(hash)));
                let entry = value.as_deref().and_then(RouteBucket::decode)?.lookup(
                    hash,
                    now_ms,
                    self.config.route_ttl_ms,
                )?;
                self.keep_route_copy(entry, now_ms);
                entry
            }
        };
        if entry.slot >= self.config.max_instances {
            return None;
        }
        let (record, cas) = self.read_instance(entry.slot);
        let record = record?;
        let valid = addr_hash(&record.address) == entry.addr_hash
            && record.is_fresh(now_ms, self.config.instance_ttl_ms);
        if !valid {
            return None;
        }
        let address = record.address.clone();
        self.remember_read(entry.slot, now_ms, record, cas);
        Some(Target {
            instance: InstanceRef {
                slot: entry.slot,
                address,
            },
            placed: entry.placed,
        })
    }

    fn in_flight(&mut self, instance: &InstanceRef, now_ms: u64) -> Option<u32> {
        let record = self.record_for(instance.slot, &instance.address)?;
        Some(self.total(instance.slot, &record, now_ms))
    }

    fn route_blind(&mut self, key: &str, now_ms: u64) -> Option<Target> {
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
            (Some(key), Some(_)) if self.may_have_pending(key, now_ms) => {
                self.pending_of(key, now_ms)
            }
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
        self.rescan_if_changed(self.read_epoch());
        self.fresh_candidates(exclude, random, now_ms)
    }

    fn balance(&mut self, key: &str, target: Target, factor_percent: u32, now_ms: u64) -> Target {
        self.balance_key(key, target, factor_percent, now_ms)
    }

    fn place_new(&mut self, key: &str, factor_percent: u32, now_ms: u64) -> Option<Target> {
        self.place_new_key(key, factor_percent, now_ms)
    }
}
