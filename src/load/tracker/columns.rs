//! This VM's column in the shared count records: its lease (claim,
//! heartbeat, loss), which other columns are live, this VM's exact count per
//! instance, and writing that count into its column (at once when possible,
//! else at the tick). It owns all of that state; the instance records it
//! writes into belong to the registry's slots, named by
//! [`super::registry::instance_key`].

use std::collections::BTreeMap;

use super::super::instances::{CountCell, InstanceRecord};
use super::super::lease::{self, Heartbeat, Lease};
use super::super::table::{Change, Read, Tables, Updated};
use super::super::{Claim, Ticket};
use super::addr_hash;
use super::registry::instance_key;
use crate::shared::SharedStore;

/// What kind of count [`Columns::add`] takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Count {
    /// A decision's claim, refused once the instance is full.
    Capped(Limit),
    /// A decision's claim, whatever the load.
    Uncapped,
    /// The instance is serving the request right now (the upstream
    /// filter): counted whatever the load, and its last-seen refreshed.
    Serving,
}

/// The bound of a capped claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Limit {
    /// In flight at which the instance is full.
    pub(super) cap: u32,
    /// Requests of the claim's key on their way to the instance, not
    /// counted on it yet.
    pub(super) pending: u32,
}

/// This VM's own count on one instance slot.
#[derive(Debug, Clone)]
struct LocalCount {
    address: String,
    addr_hash: u64,
    count: u32,
}

/// See the module documentation.
#[derive(Debug)]
pub(super) struct Columns {
    nonce: u64,
    vm_slots: u16,
    vm_lease_ms: u64,
    /// Our column in the count records, while we hold a lease.
    column: Option<u16>,
    /// Cached lease view, one entry per column (a free lease: none known).
    leases: Vec<Lease>,
    local: BTreeMap<u16, LocalCount>,
    last_lease_attempt_ms: Option<u64>,
}

/// How long a VM without a column waits before trying for one again on a
/// request (its tick tries every second too): a VM that finds every column
/// taken must not read them all on each request.
const LEASE_RETRY_MS: u64 = 1_000;

fn lease_key<S: SharedStore>(tables: &Tables<S>, column: u16) -> String {
    tables.key(format_args!("vm/{column}"))
}

impl Columns {
    pub(super) fn new(nonce: u64, vm_slots: u16, vm_lease_ms: u64) -> Self {
        Self {
            nonce,
            vm_slots,
            vm_lease_ms,
            column: None,
            leases: vec![Lease::default(); usize::from(vm_slots)],
            local: BTreeMap::new(),
            last_lease_attempt_ms: None,
        }
    }

    pub(super) fn column(&self) -> Option<u16> {
        self.column
    }

    /// Requests this VM holds tickets for, over all instances.
    pub(super) fn local_in_flight(&self) -> u32 {
        self.local.values().map(|l| l.count).sum()
    }

    /// Forgets instances this VM counts nothing on any more.
    pub(super) fn drop_idle(&mut self) {
        self.local.retain(|_, l| l.count > 0);
    }

    /// Heartbeats our lease, or takes one if we have none (or lost ours).
    pub(super) fn maintain_lease<S: SharedStore>(&mut self, tables: &Tables<S>, now_ms: u64) {
        if let Some(column) = self.column {
            let key = lease_key(tables, column);
            match lease::heartbeat(tables, &key, self.nonce, now_ms) {
                Heartbeat::Kept | Heartbeat::Unknown => return,
                Heartbeat::Lost => {
                    log::warn!("prefix-router: lost VM lease slot {column}; taking another");
                    self.column = None;
                }
            }
        }
        self.acquire_lease(tables, now_ms);
    }

    fn acquire_lease<S: SharedStore>(&mut self, tables: &Tables<S>, now_ms: u64) {
        self.last_lease_attempt_ms = Some(now_ms);
        for column in 0..self.vm_slots {
            let key = lease_key(tables, column);
            if !lease::try_claim(tables, &key, self.nonce, now_ms, self.vm_lease_ms) {
                continue;
            }
            self.column = Some(column);
            if let Some(entry) = self.leases.get_mut(usize::from(column)) {
                *entry = Lease {
                    nonce: self.nonce,
                    heartbeat_ms: now_ms,
                };
            }
            // Our counts now live in a new column: publish them there.
            let slots: Vec<u16> = self.local.keys().copied().collect();
            for slot in slots {
                self.publish(tables, slot, None);
            }
            return;
        }
        log::warn!(
            "prefix-router: all {} VM lease slots are taken",
            self.vm_slots
        );
    }

    /// Before the first tick, take a lease on first use (at most once per
    /// [`LEASE_RETRY_MS`]).
    fn ensure_lease<S: SharedStore>(&mut self, tables: &Tables<S>, now_ms: u64) {
        let due = self
            .last_lease_attempt_ms
            .is_none_or(|at| now_ms.saturating_sub(at) >= LEASE_RETRY_MS);
        if self.column.is_none() && due {
            self.acquire_lease(tables, now_ms);
        }
    }

    /// Re-reads the lease of every column a VM ever held. A VM takes the
    /// lowest column whose lease is free or expired, and a lease is never
    /// removed, so no column past the first one never written was ever held:
    /// the reads stop there, as many as the VMs the process has had, not
    /// `vm_slots`.
    pub(super) fn refresh_leases<S: SharedStore>(&mut self, tables: &Tables<S>) {
        for column in 0..self.vm_slots {
            let read = tables.read(&lease_key(tables, column));
            if let Some(entry) = self.leases.get_mut(usize::from(column)) {
                *entry = read.record;
            }
            if !read.exists() {
                break;
            }
        }
    }

    /// Whether a cell written by `tag` in `column` counts: its VM holds that
    /// column's lease and heartbeats. A cached "no" is checked against the
    /// store (a VM may have joined since the last tick); dead VMs' cells, the
    /// other source of re-reads, are cleared by the next tick.
    fn is_live<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        column: u16,
        tag: u64,
        now_ms: u64,
    ) -> bool {
        let index = usize::from(column);
        let lease_ms = self.vm_lease_ms;
        let matches = |lease: &Lease| lease.nonce == tag && lease.is_live(now_ms, lease_ms);
        match self.leases.get(index) {
            None => return false,
            Some(cached) if matches(cached) => return true,
            Some(_) => {}
        }
        let fresh = tables.read(&lease_key(tables, column)).record;
        if let Some(entry) = self.leases.get_mut(index) {
            *entry = fresh;
        }
        matches(&fresh)
    }

    fn local_count(&self, slot: u16, address: &str) -> u32 {
        match self.local.get(&slot) {
            Some(local) if local.address == address => local.count,
            _ => 0,
        }
    }

    /// What our cell should say for `address` in `slot`: our exact count,
    /// or an empty cell when we count nothing there.
    fn own_cell(&self, slot: u16, address: &str) -> CountCell {
        match self.local_count(slot, address) {
            0 => CountCell::default(),
            count => CountCell {
                tag: self.nonce,
                count,
            },
        }
    }

    /// In flight on the record's instance: live VMs' cells plus our exact count
    /// (our own published cell may lag behind it).
    pub(super) fn total<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        slot: u16,
        record: &InstanceRecord,
        now_ms: u64,
    ) -> u32 {
        let mut total = self.local_count(slot, &record.address);
        for (index, cell) in record.cells.iter().enumerate() {
            let Ok(column) = u16::try_from(index) else {
                break;
            };
            if Some(column) == self.column || cell.count == 0 {
                continue;
            }
            if self.is_live(tables, column, cell.tag, now_ms) {
                total = total.saturating_add(cell.count);
            }
        }
        total
    }

    /// Writes our exact local count for `slot` into our column (and, with
    /// `seen_ms`, refreshes last-seen). Returns false if it could not be
    /// written now; the next tick repairs it.
    pub(super) fn publish<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        slot: u16,
        seen_ms: Option<u64>,
    ) -> bool {
        let Some(column) = self.column else {
            return false;
        };
        let published = tables.update(
            &instance_key(tables, slot),
            |record: &mut InstanceRecord| {
                if record.is_free() {
                    return Change::Keep(());
                }
                let count = self.local_count(slot, &record.address);
                let cell = CountCell {
                    tag: self.nonce,
                    count,
                };
                let seen_stale = seen_ms
                    .is_some_and(|s| s > record.last_seen_ms || record.suspect_since_ms.is_some());
                if record.cell(column) == cell && !seen_stale {
                    return Change::Keep(());
                }
                record.set_cell(column, self.own_cell(slot, &record.address));
                if let Some(seen) = seen_ms {
                    record.seen(seen);
                }
                Change::Write(())
            },
        );
        published != Updated::Failed
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

    /// `Full` if the record's instance has `limit.cap` or more requests in
    /// flight, counting the `limit.pending` ones on their way to it.
    fn full_at<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        slot: u16,
        record: &InstanceRecord,
        limit: Limit,
        now_ms: u64,
    ) -> Option<Claim> {
        let in_flight = self
            .total(tables, slot, record, now_ms)
            .saturating_add(limit.pending);
        (in_flight >= limit.cap).then_some(Claim::Full { in_flight })
    }

    /// [`Columns::add`] without a column to publish into: counts locally
    /// only (published once the VM holds a lease).
    fn add_locally<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        slot: u16,
        address: &str,
        limit: Option<Limit>,
        now_ms: u64,
    ) -> Claim {
        if let Some(limit) = limit {
            let record: InstanceRecord = tables.read(&instance_key(tables, slot)).record;
            if record.address != address {
                return Claim::Gone;
            }
            if let Some(full) = self.full_at(tables, slot, &record, limit, now_ms) {
                return full;
            }
        }
        Claim::Claimed(self.bump_local(slot, address))
    }

    /// Counts one request on `slot`/`address`: atomically against the
    /// limit of a [`Count::Capped`] claim, else unconditionally (a failed
    /// publish is repaired at the tick). `read`: the record as a lookup in
    /// this decision just read it, if it did.
    pub(super) fn add<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        slot: u16,
        address: &str,
        count: Count,
        read: Option<Read<InstanceRecord>>,
        now_ms: u64,
    ) -> Claim {
        self.ensure_lease(tables, now_ms);
        let limit = match count {
            Count::Capped(limit) => Some(limit),
            Count::Uncapped | Count::Serving => None,
        };
        let key = instance_key(tables, slot);
        let Some(column) = self.column else {
            return self.add_locally(tables, slot, address, limit, now_ms);
        };
        let counted = tables.update_from(&key, read, |record: &mut InstanceRecord| {
            if record.address != address {
                return Change::Keep(Claim::Gone);
            }
            if let Some(full) = limit.and_then(|l| self.full_at(tables, slot, record, l, now_ms)) {
                return Change::Keep(full);
            }
            let ours = CountCell {
                tag: self.nonce,
                count: self.local_count(slot, address).saturating_add(1),
            };
            record.set_cell(column, ours);
            if count == Count::Serving {
                record.seen(now_ms);
            }
            Change::Write(())
        });
        match counted {
            Updated::Written(()) => Claim::Claimed(self.bump_local(slot, address)),
            Updated::Kept(refused) => refused,
            Updated::Failed if limit.is_some() => Claim::Contended,
            // Unconditional count: keep the truth locally; the tick publishes it.
            Updated::Failed => Claim::Claimed(self.bump_local(slot, address)),
        }
    }

    /// Gives a ticket back (see [`super::LoadTracker::release`]).
    pub(super) fn release<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        ticket: Ticket,
        now_ms: u64,
    ) {
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
        self.ensure_lease(tables, now_ms);
        // A failed publish leaves the shared copy high until the next tick.
        self.publish(tables, ticket.slot, None);
    }

    /// Whether `record` (in `slot`) disagrees with our local truth or holds
    /// a count of a dead VM.
    pub(super) fn needs_repair<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        slot: u16,
        record: &InstanceRecord,
        now_ms: u64,
    ) -> bool {
        if let Some(column) = self.column {
            if record.cell(column) != self.own_cell(slot, &record.address) {
                return true;
            }
        }
        record.cells.iter().enumerate().any(|(index, cell)| {
            let column = u16::try_from(index).unwrap_or(u16::MAX);
            cell.count > 0
                && Some(column) != self.column
                && !self.is_live(tables, column, cell.tag, now_ms)
        })
    }

    /// Rewrites our cell from the local truth and zeroes dead VMs' cells.
    pub(super) fn repair<S: SharedStore>(&mut self, tables: &Tables<S>, slot: u16, now_ms: u64) {
        tables.update(
            &instance_key(tables, slot),
            |record: &mut InstanceRecord| -> Change<()> {
                if record.is_free() {
                    return Change::Keep(());
                }
                for index in 0..record.cells.len() {
                    let Ok(column) = u16::try_from(index) else {
                        break;
                    };
                    let cell = record.cell(column);
                    if Some(column) == self.column {
                        continue;
                    }
                    if cell.count > 0 && !self.is_live(tables, column, cell.tag, now_ms) {
                        record.set_cell(column, CountCell::default());
                    }
                }
                if let Some(column) = self.column {
                    record.set_cell(column, self.own_cell(slot, &record.address));
                }
                Change::Write(())
            },
        );
    }
}
