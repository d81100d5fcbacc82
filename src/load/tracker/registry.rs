//! The instance registry: one slot per instance address, found by hashing
//! and probing linearly over the whole table, reused only when its instance
//! is forgotten and idle; plus the epoch that tells other VMs to rescan
//! after a registration. It owns this VM's view of the slots (which are in
//! use, where an address lives, the record a lookup just read); whether a
//! slot is idle it asks the count columns. Instances the configuration lists
//! are registered before any traffic and stay fresh while listed; the others
//! are learned from traffic and forgotten after the instance TTL.

use std::collections::{BTreeSet, HashMap};
use std::rc::Rc;

use super::super::instances::{InstanceRecord, RegistryEpoch, MAX_ADDRESS_LEN};
use super::super::table::{Change, Read, Tables, Updated};
use super::super::{Candidate, InstanceRef};
use super::columns::Columns;
use super::{addr_hash, copy_is_fresh, last_read_again, BySlot};
use crate::shared::SharedStore;

/// How long after a failed registration of a configured instance it is
/// tried again.
const SEED_RETRY_MS: u64 = 1_000;

/// How long a VM decides on the instance records and registry epoch it read
/// before reading them again. Reading every instance's record is most of a
/// decision's host calls, and what decisions compare in them, other VMs'
/// in-flight counts, changes at the pace requests start and end: an
/// inference request lasts tens of milliseconds at the least, so a count
/// seen this late is the count of the same requests but those the other VMs
/// started or ended meanwhile. This VM's own counts are exact in every
/// decision (kept locally), its own changes to a record are seen at once
/// (the copy is dropped), and every write still goes by compare-and-swap on
/// a read of the same decision, so the cap stays exact; a claim that finds a
/// count moved since the copy outdates every copy (`LoadTracker::claim`).
pub const RECORD_CACHE_MS: u64 = 5;

/// The most expired copies one decision reads again, those read longest ago
/// first; the others stand as they are until a later decision or the tick
/// (which reads every record each second) reads them. A decision over a
/// large fleet then reads shared data as often as one over a few instances,
/// rather than once per instance (`cargo xtask bench overhead --instances
/// 64` measures the difference). Past the budget, what a copy may miss is
/// other VMs' counts since it was read (at most a tick old), the same kind
/// of lag as the copies' own; the cap still holds by the claim's
/// compare-and-swap. A fleet of up to this many instances reads every
/// expired copy.
pub const RECORD_READS_PER_DECISION: usize = 8;

/// What [`Registry::find_slot`] does with an address it does not find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lookup {
    /// Register it in the first free or reusable slot of its probe sequence.
    OrRegister,
    /// Nothing: only an address already registered has a slot.
    Only,
}

/// The shared-data key of instance slot `slot`.
pub(super) fn instance_key<S: SharedStore>(tables: &Tables<S>, slot: u16) -> String {
    tables.key(format_args!("inst/{slot}"))
}

fn epoch_key<S: SharedStore>(tables: &Tables<S>) -> String {
    tables.key(format_args!("epoch"))
}

/// One instance record as read at `at_ms`, with its CAS token.
#[derive(Debug)]
struct RecentRead {
    slot: u16,
    at_ms: u64,
    read: Read<InstanceRecord>,
}

/// Seen serving within `instance_ttl_ms`, or `listed` among the configured
/// instances; and neither suspected gone nor failing (`is_failed`).
fn is_fresh(listed: bool, instance_ttl_ms: u64, record: &InstanceRecord, now_ms: u64) -> bool {
    (listed && !record.is_suspect(now_ms) && !record.is_failed(now_ms))
        || record.is_fresh(now_ms, instance_ttl_ms)
}

/// This VM's copy of one instance record.
#[derive(Debug)]
struct RecordCopy {
    read_ms: u64,
    /// A claim found a count moved since some copy was read: read again
    /// before it is used, as an expired copy is.
    outdated: bool,
    /// Its address is among the configured instances: looked up once per
    /// read (and again when the list changes), not in every decision.
    listed: bool,
    /// The instance, shared by the candidates made from this copy: its
    /// address allocated and hashed when first read here, not per decision.
    instance: InstanceRef,
    record: InstanceRecord,
}

impl RecordCopy {
    /// A copy of `record`, read from `slot`; the instance of the copy it
    /// replaces (`previous`) stands while the address is the same.
    fn new(
        read_ms: u64,
        slot: u16,
        record: InstanceRecord,
        configured: &BTreeSet<String>,
        previous: Option<&RecordCopy>,
    ) -> Self {
        let instance = match previous {
            Some(previous) if *previous.instance.address == *record.address => {
                previous.instance.clone()
            }
            _ => InstanceRef::new(slot, record.address.as_str().into()),
        };
        Self {
            read_ms,
            outdated: false,
            listed: configured.contains(&record.address),
            instance,
            record,
        }
    }

    /// Read within [`RECORD_CACHE_MS`] and not outdated since.
    fn is_current(&self, now_ms: u64) -> bool {
        !self.outdated && copy_is_fresh(self.read_ms, now_ms, RECORD_CACHE_MS)
    }

    /// [`is_fresh`], with the list looked up when the copy was made.
    fn is_fresh(&self, instance_ttl_ms: u64, now_ms: u64) -> bool {
        is_fresh(self.listed, instance_ttl_ms, &self.record, now_ms)
    }
}

/// The record in `slot`; a missing or undecodable one reads as free (so it
/// can be overwritten).
fn read_record<S: SharedStore>(tables: &Tables<S>, slot: u16) -> Read<InstanceRecord> {
    tables.read(&instance_key(tables, slot))
}

/// Keeps a record just read in `recent` for the next
/// [`Registry::take_recent`] of the same slot in the same millisecond.
fn remember_read(recent: &mut Vec<RecentRead>, slot: u16, now_ms: u64, read: Read<InstanceRecord>) {
    recent.retain(|kept| kept.slot != slot && kept.at_ms == now_ms);
    recent.push(RecentRead {
        slot,
        at_ms: now_ms,
        read,
    });
}

/// See the module documentation.
#[derive(Debug)]
pub(super) struct Registry {
    max_instances: u16,
    /// An instance not seen serving for this long is not fresh.
    instance_ttl_ms: u64,
    slot_of: HashMap<String, u16>,
    known_slots: BTreeSet<u16>,
    /// Registry epoch seen at our last full scan of the instance slots.
    scanned_epoch: Option<u64>,
    /// The instance records a lookup or the candidates just read, for the
    /// claim or check that follows in the same decision (one shared-data
    /// read, a host call, fewer). See [`Registry::take_recent`].
    recent: Vec<RecentRead>,
    /// Every instance record as this VM last read it, with when: what
    /// decisions compare (never a write's token).
    cached: BySlot<RecordCopy>,
    /// When this VM last read the registry epoch.
    epoch_read_ms: Option<u64>,
    /// The configured instances (`instances`): fresh whatever their last
    /// seen time, unless suspected gone.
    configured: BTreeSet<String>,
    /// The same, in the order the configuration lists them.
    configured_list: Rc<[String]>,
    /// Some configured instance may have no slot in `slot_of`: the list
    /// changed, or a slot was forgotten, since every one had.
    maybe_unseeded: bool,
    /// When registering a configured instance last failed.
    seed_failed_ms: Option<u64>,
}

impl Registry {
    pub(super) fn new(max_instances: u16, instance_ttl_ms: u64) -> Self {
        Self {
            max_instances,
            instance_ttl_ms,
            slot_of: HashMap::new(),
            known_slots: BTreeSet::new(),
            scanned_epoch: None,
            recent: Vec::new(),
            cached: BySlot::default(),
            epoch_read_ms: None,
            configured: BTreeSet::new(),
            configured_list: Rc::from([]),
            maybe_unseeded: false,
            seed_failed_ms: None,
        }
    }

    /// The configured instances. Every tracker call of a request applies
    /// its plugin's list: the list it applied last (the same `Rc`) is
    /// known without comparing a string, another one by its contents. A new
    /// list is registered at the next [`Self::seed_configured`].
    pub(super) fn set_configured(&mut self, instances: &Rc<[String]>) {
        if Rc::ptr_eq(&self.configured_list, instances) {
            return;
        }
        if *self.configured_list != **instances {
            self.configured = instances.iter().cloned().collect();
            for copy in self.cached.values_mut() {
                copy.listed = self.configured.contains(&copy.record.address);
            }
            self.maybe_unseeded = true;
        }
        self.configured_list = Rc::clone(instances);
    }

    /// Registers every configured instance this VM has no slot for yet, so
    /// overflow can use the whole fleet before it served any request. No
    /// host call once each has its slot, and no look-up either until the
    /// list changes or a slot is forgotten; a registration that failed
    /// (registry full, contended) is retried a second later.
    pub(super) fn seed_configured<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        columns: &mut Columns,
        now_ms: u64,
    ) {
        if !self.maybe_unseeded {
            return;
        }
        let missing: Vec<String> = self
            .configured
            .iter()
            .filter(|a| !self.slot_of.contains_key(*a))
            .cloned()
            .collect();
        let retry_due = self
            .seed_failed_ms
            .is_none_or(|failed| now_ms.saturating_sub(failed) >= SEED_RETRY_MS);
        if missing.is_empty() {
            self.maybe_unseeded = false;
            return;
        }
        if !retry_due {
            return;
        }
        self.seed_failed_ms = None;
        for address in &missing {
            if self
                .find_slot(tables, columns, address, now_ms, Lookup::OrRegister)
                .is_none()
            {
                self.seed_failed_ms = Some(now_ms);
            }
        }
    }

    /// The tick's part for configured instances: writes their last-seen
    /// time an eighth of the TTL before it would expire, so VMs whose
    /// configuration does not list them (an upstream filter configured
    /// apart) do not forget them either, and registers again any whose
    /// slot was reused. Leaves a suspect mark as it is: serving clears it,
    /// or it lapses after `SUSPECT_MS`.
    pub(super) fn keep_configured<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        columns: &mut Columns,
        now_ms: u64,
    ) {
        let refresh_ms = (self.instance_ttl_ms / 8).max(1);
        let held: Vec<(String, u16)> = self
            .configured
            .iter()
            .filter_map(|a| Some((a.clone(), *self.slot_of.get(a)?)))
            .collect();
        for (address, slot) in held {
            let kept = tables.update(
                &instance_key(tables, slot),
                |record: &mut InstanceRecord| {
                    if record.address != address {
                        return Change::Keep(false);
                    }
                    if now_ms.saturating_sub(record.last_seen_ms) < refresh_ms {
                        return Change::Keep(true);
                    }
                    record.last_seen_ms = now_ms;
                    Change::Write(())
                },
            );
            match kept {
                Updated::Kept(false) => {
                    self.slot_of.remove(&address);
                    self.maybe_unseeded = true;
                    self.seed_failed_ms = None;
                }
                Updated::Written(()) => self.forget_copy(slot),
                Updated::Kept(true) | Updated::Failed => {}
            }
        }
        self.seed_configured(tables, columns, now_ms);
    }

    pub(super) fn max_instances(&self) -> u16 {
        self.max_instances
    }

    pub(super) fn set_instance_ttl_ms(&mut self, instance_ttl_ms: u64) {
        self.instance_ttl_ms = instance_ttl_ms;
    }

    /// Seen serving within the instance TTL, or configured; and not
    /// suspected gone.
    pub(super) fn is_fresh(&self, record: &InstanceRecord, now_ms: u64) -> bool {
        let listed = self.configured.contains(&record.address);
        is_fresh(listed, self.instance_ttl_ms, record, now_ms)
    }

    /// The record in `slot` ([`read_record`]).
    pub(super) fn read<S: SharedStore>(
        &self,
        tables: &Tables<S>,
        slot: u16,
    ) -> Read<InstanceRecord> {
        read_record(tables, slot)
    }

    /// This VM's copy of `slot`'s record, read now unless it read one within
    /// [`RECORD_CACHE_MS`]; a read made now is also kept for this decision's
    /// claim ([`Self::take_recent`]).
    pub(super) fn keep_copy<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        slot: u16,
        now_ms: u64,
    ) -> Option<&InstanceRecord> {
        self.copy_within(tables, slot, now_ms, None)
            .map(|copy| &copy.record)
    }

    /// This VM's copy of `slot`'s record if it is current, or expired but
    /// ordered after `last_read_again` ([`last_read_again`]: past the
    /// decision's budget); else one read now, kept as the copy and for this
    /// decision's claim ([`Self::take_recent`]). (Always there: None only
    /// to need no panic.)
    fn copy_within<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        slot: u16,
        now_ms: u64,
        last_read_again: Option<(u64, u16)>,
    ) -> Option<&RecordCopy> {
        let stands = self.cached.get(slot).is_some_and(|copy| {
            copy.is_current(now_ms)
                || last_read_again.is_some_and(|last| (copy.read_ms, slot) > last)
        });
        if !stands {
            let read = read_record(tables, slot);
            let copy = RecordCopy::new(
                now_ms,
                slot,
                read.record.clone(),
                &self.configured,
                self.cached.get(slot),
            );
            remember_read(&mut self.recent, slot, now_ms, read);
            self.cached.insert(slot, copy);
        }
        self.cached.get(slot)
    }

    /// Drops this VM's copy of `slot`'s record: it just changed the record
    /// beyond its own count cell (registration, last seen, suspect), which
    /// its next decision must see.
    pub(super) fn forget_copy(&mut self, slot: u16) {
        self.cached.remove(slot);
    }

    /// Outdates every copy: the next decisions read them again, those read
    /// longest ago first, [`RECORD_READS_PER_DECISION`] at a time.
    pub(super) fn outdate_copies(&mut self) {
        for copy in self.cached.values_mut() {
            copy.outdated = true;
        }
    }

    /// Keeps a record just read for the next [`Self::take_recent`] of the
    /// same slot in the same millisecond.
    pub(super) fn remember_read(&mut self, slot: u16, now_ms: u64, read: Read<InstanceRecord>) {
        remember_read(&mut self.recent, slot, now_ms, read);
    }

    /// The record of `slot` a lookup just read in this same millisecond of
    /// this decision, if there is one. The first take uses up every kept
    /// read, so none outlives the decision's first write. Reusing it is safe
    /// for a write, which is a compare-and-swap on its token (a change since
    /// the read fails it and the caller re-reads), and as fresh as a read for
    /// a check (same decision, same millisecond).
    pub(super) fn take_recent(&mut self, slot: u16, now_ms: u64) -> Option<Read<InstanceRecord>> {
        let found = self
            .recent
            .iter()
            .position(|recent| recent.slot == slot && recent.at_ms == now_ms)
            .map(|index| self.recent.swap_remove(index).read);
        self.recent.clear();
        found
    }

    fn probe_start(&self, address: &str) -> u16 {
        // max_instances <= 4096, so the remainder fits in u16.
        (addr_hash(address) % u64::from(self.max_instances)) as u16
    }

    /// Finds the slot holding `address`, registering it if `lookup` says so.
    pub(super) fn find_slot<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        columns: &mut Columns,
        address: &str,
        now_ms: u64,
        lookup: Lookup,
    ) -> Option<u16> {
        if address.is_empty() || address.len() > MAX_ADDRESS_LEN {
            return None;
        }
        if let Some(&slot) = self.slot_of.get(address) {
            if self
                .keep_copy(tables, slot, now_ms)
                .is_some_and(|record| record.address == address)
            {
                return Some(slot);
            }
            self.slot_of.remove(address);
            self.maybe_unseeded = true;
        }
        // Linear probing over the whole table, so it holds as many instances
        // as it has slots. A registration takes the first free or reusable
        // slot of the sequence and no slot is ever freed again (a reused one
        // changes address), so an address is never past the first free slot.
        let start = self.probe_start(address);
        let max = self.max_instances;
        let mut candidate = None;
        for step in 0..max {
            let slot = ((u32::from(start) + u32::from(step)) % u32::from(max)) as u16;
            let record = self.read(tables, slot).record;
            if record.address == address {
                self.remember_slot(address, slot);
                return Some(slot);
            }
            let reusable = self.is_reusable(tables, columns, slot, &record, now_ms);
            if reusable && candidate.is_none() {
                candidate = Some(slot);
            }
            if record.is_free() {
                break;
            }
        }
        if lookup == Lookup::Only {
            return None;
        }
        let Some(slot) = candidate else {
            log::warn!("prefix-router: instance registry full around {address}");
            return None;
        };
        self.register_in(tables, columns, slot, address, now_ms)
            .then(|| {
                self.remember_slot(address, slot);
                slot
            })
    }

    /// Free, or its instance is forgotten (not merely failing: its mark is
    /// kept) and nothing is in flight there.
    fn is_reusable<S: SharedStore>(
        &self,
        tables: &Tables<S>,
        columns: &mut Columns,
        slot: u16,
        record: &InstanceRecord,
        now_ms: u64,
    ) -> bool {
        record.is_free()
            || (!self.is_fresh(record, now_ms)
                && !record.is_failed(now_ms)
                && columns.total(tables, slot, record, now_ms) == 0)
    }

    fn remember_slot(&mut self, address: &str, slot: u16) {
        // Bounded like the registry itself.
        if self.slot_of.len() >= usize::from(self.max_instances) * 2 {
            self.slot_of.clear();
            self.maybe_unseeded = true;
        }
        self.slot_of.insert(address.to_string(), slot);
        self.known_slots.insert(slot);
    }

    /// Writes a new record for `address` into `slot` if it is still free or
    /// reusable (true if `address` holds it now), and announces it.
    fn register_in<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        columns: &mut Columns,
        slot: u16,
        address: &str,
        now_ms: u64,
    ) -> bool {
        let registered = tables.update(
            &instance_key(tables, slot),
            |record: &mut InstanceRecord| {
                if record.address == address {
                    return Change::Keep(true);
                }
                if !self.is_reusable(tables, columns, slot, record, now_ms) {
                    return Change::Keep(false);
                }
                *record = InstanceRecord::new(address, now_ms);
                Change::Write(())
            },
        );
        match registered {
            Updated::Written(()) => {
                self.forget_copy(slot);
                Self::bump_epoch(tables);
                true
            }
            Updated::Kept(ours) => ours,
            Updated::Failed => false,
        }
    }

    /// The record in `slot` if it still belongs to `address`.
    pub(super) fn record_for<S: SharedStore>(
        &self,
        tables: &Tables<S>,
        slot: u16,
        address: &str,
    ) -> Option<InstanceRecord> {
        Some(self.read(tables, slot).record).filter(|record| record.address == address)
    }

    /// Marks an instance suspect (a nominated host Envoy did not use is
    /// probably gone), so it is no candidate until it serves again or
    /// `SUSPECT_MS` have passed; a mark that lapsed is set again.
    pub(super) fn mark_unseen<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        columns: &mut Columns,
        address: &str,
        now_ms: u64,
    ) {
        let Some(slot) = self.find_slot(tables, columns, address, now_ms, Lookup::Only) else {
            return;
        };
        let marked = tables.update(
            &instance_key(tables, slot),
            |record: &mut InstanceRecord| -> Change<()> {
                if record.address != address || record.is_suspect(now_ms) {
                    return Change::Keep(());
                }
                record.suspect_since_ms = Some(now_ms);
                Change::Write(())
            },
        );
        if marked == Updated::Written(()) {
            self.forget_copy(slot);
        }
    }

    /// Changes `address`'s record by `change` (which writes or keeps, its
    /// record's address already checked); true if written. An address not
    /// registered has no record to change.
    pub(super) fn change_record<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        columns: &mut Columns,
        address: &str,
        now_ms: u64,
        mut change: impl FnMut(&mut InstanceRecord) -> Change<bool>,
    ) -> bool {
        let Some(slot) = self.find_slot(tables, columns, address, now_ms, Lookup::Only) else {
            return false;
        };
        let changed = tables.update(
            &instance_key(tables, slot),
            |record: &mut InstanceRecord| -> Change<bool> {
                if record.address != address {
                    return Change::Keep(false);
                }
                change(record)
            },
        );
        if matches!(changed, Updated::Written(_)) {
            self.forget_copy(slot);
        }
        matches!(changed, Updated::Written(true))
    }

    /// This VM's copy of `address`'s record (read again if older than
    /// [`RECORD_CACHE_MS`]), if the address is registered.
    pub(super) fn copy_of<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        address: &str,
        now_ms: u64,
    ) -> Option<&InstanceRecord> {
        let slot = *self.slot_of.get(address)?;
        self.keep_copy(tables, slot, now_ms)
            .filter(|record| record.address == address)
    }

    /// The registry epoch.
    pub(super) fn epoch<S: SharedStore>(tables: &Tables<S>) -> RegistryEpoch {
        tables.read(&epoch_key(tables)).record
    }

    /// Announces a registry change, so other VMs rescan the slots before
    /// their next overflow choice instead of waiting for their tick.
    fn bump_epoch<S: SharedStore>(tables: &Tables<S>) {
        tables.update(
            &epoch_key(tables),
            |epoch: &mut RegistryEpoch| -> Change<()> {
                epoch.epoch = epoch.epoch.wrapping_add(1);
                Change::Write(())
            },
        );
    }

    /// Re-reads every instance slot into the known slots, and calls `each`
    /// with every slot in use and its record.
    pub(super) fn scan<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        each: impl FnMut(u16, &InstanceRecord),
    ) {
        self.scan_keeping(tables, None, each);
    }

    /// The tick's [`Self::scan`], which also keeps what it read as this VM's
    /// copies: those past a decision's [`RECORD_READS_PER_DECISION`] are
    /// then at most a tick old. (A decision's own rescan leaves the reads to
    /// its candidates, which keep them for its claim.)
    pub(super) fn scan_on_tick<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        now_ms: u64,
        each: impl FnMut(u16, &InstanceRecord),
    ) {
        self.scan_keeping(tables, Some(now_ms), each);
    }

    fn scan_keeping<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        copies_read_ms: Option<u64>,
        mut each: impl FnMut(u16, &InstanceRecord),
    ) {
        self.scanned_epoch = Some(Self::epoch(tables).epoch);
        for slot in 0..self.max_instances {
            let record = self.read(tables, slot).record;
            if record.is_free() {
                self.known_slots.remove(&slot);
                self.forget_copy(slot);
                continue;
            }
            self.known_slots.insert(slot);
            each(slot, &record);
            if let Some(read_ms) = copies_read_ms {
                let previous = self.cached.get(slot);
                let copy = RecordCopy::new(read_ms, slot, record, &self.configured, previous);
                self.cached.insert(slot, copy);
            }
        }
    }

    /// Rescans the slots if another VM registered an instance since this VM
    /// last looked, reading the registry epoch at most every
    /// [`RECORD_CACHE_MS`].
    pub(super) fn rescan_if_changed<S: SharedStore>(&mut self, tables: &Tables<S>, now_ms: u64) {
        let read_lately = self
            .epoch_read_ms
            .is_some_and(|read_ms| copy_is_fresh(read_ms, now_ms, RECORD_CACHE_MS));
        if read_lately {
            return;
        }
        self.epoch_read_ms = Some(now_ms);
        if self.scanned_epoch != Some(Self::epoch(tables).epoch) {
            self.scan(tables, |_, _| {});
        }
    }

    /// Every fresh known instance with its in-flight count, from this VM's
    /// copies of their records ([`RECORD_CACHE_MS`]), of which it reads again
    /// every missing one and of the expired ones at most
    /// [`RECORD_READS_PER_DECISION`], those read longest ago. The reads made
    /// now are kept for the decision's claim ([`Self::take_recent`]).
    pub(super) fn candidates<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        columns: &mut Columns,
        now_ms: u64,
    ) -> Vec<Candidate> {
        let slots: Vec<u16> = self.known_slots.iter().copied().collect();
        // The budget read longest ago first: past the last of them, the
        // expired copies stand (none in a fleet within the budget).
        let last_read_again = if slots.len() > RECORD_READS_PER_DECISION {
            last_read_again(
                slots
                    .iter()
                    .filter_map(|slot| {
                        let copy = self.cached.get(*slot)?;
                        (!copy.is_current(now_ms)).then_some((copy.read_ms, *slot))
                    })
                    .collect(),
            )
        } else {
            None
        };
        let mut out = Vec::with_capacity(slots.len());
        self.recent.clear();
        let instance_ttl_ms = self.instance_ttl_ms;
        for slot in slots {
            let copy = self.copy_within(tables, slot, now_ms, last_read_again);
            let Some(copy) = copy.filter(|copy| copy.is_fresh(instance_ttl_ms, now_ms)) else {
                continue;
            };
            let record = &copy.record;
            let in_flight = columns.total(tables, slot, record, now_ms);
            let mut candidate = Candidate::local(copy.instance.clone(), in_flight);
            candidate.forgotten_through = record.forgotten_through_s;
            candidate.listed = copy.listed;
            out.push(candidate);
        }
        out
    }
}
