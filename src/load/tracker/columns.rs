//! This VM's column in the shared count records: its lease (claim,
//! heartbeat, loss), which other columns are live, and writing this VM's exact
//! local counts into its column (at once when possible, else at the tick).

use super::*;

impl<S: SharedStore> LoadTracker<S> {
    /// Heartbeats our lease, or takes one if we have none (or lost ours).
    pub(super) fn maintain_lease(&mut self, now_ms: u64) {
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

    pub(super) fn acquire_lease(&mut self, now_ms: u64) {
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
    pub(super) fn ensure_lease(&mut self, now_ms: u64) {
        if self.column.is_none() && self.last_lease_attempt_ms != Some(now_ms) {
            self.acquire_lease(now_ms);
        }
    }

    pub(super) fn refresh_leases(&mut self) {
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
    pub(super) fn is_live(&mut self, column: u16, tag: u64, now_ms: u64) -> bool {
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

    pub(super) fn local_count(&self, slot: u16, address: &str) -> u32 {
        match self.local.get(&slot) {
            Some(local) if local.address == address => local.count,
            _ => 0,
        }
    }

    /// In flight on the record's instance: live VMs' cells plus our exact count
    /// (our own published cell may lag behind it).
    pub(super) fn total(&mut self, slot: u16, record: &InstanceRecord, now_ms: u64) -> u32 {
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

    /// Writes our exact local count for `slot` into our column (and, with
    /// `seen`, refreshes last-seen). Returns false if it could not be written
    /// now; the next tick repairs it.
    pub(super) fn publish_with(&mut self, slot: u16, seen_ms: Option<u64>) -> bool {
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

    pub(super) fn publish(&mut self, slot: u16) -> bool {
        self.publish_with(slot, None)
    }

    pub(super) fn bump_local(&mut self, slot: u16, address: &str) -> Ticket {
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
    pub(super) fn add(
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
        for attempt in 0..self.config.cas_attempts {
            let (record, cas) = if attempt == 0 {
                self.read_instance_at(slot, now_ms)
            } else {
                self.read_instance(slot)
            };
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

    pub(super) fn needs_repair(&mut self, slot: u16, record: &InstanceRecord, now_ms: u64) -> bool {
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
    pub(super) fn repair(&mut self, slot: u16, now_ms: u64) {
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
}
