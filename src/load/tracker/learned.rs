//! What the upstream filter teaches: key -> instance mappings (the shared
//! table, and this VM's short-lived copies of it), the pending marks of
//! requests routed before their key's target was known, and when each key
//! last had a response checked. It owns the copies.

use std::collections::HashMap;

use super::super::pending::PendingBucket;
use super::super::routes::{RouteBucket, RouteEntry};
use super::super::table::{Change, Tables, Updated};
use super::{copy_is_fresh, RESPONSE_CHECK_MS};
use crate::shared::SharedStore;

/// How long a VM trusts its own copy of a key's learned route before reading
/// the shared table again. Routes change only when the fleet does, and this
/// VM's own upstream filter updates its copy at once; other VMs' news waits
/// at most this long.
const ROUTE_COPY_MS: u64 = 1_000;

/// Most route copies a VM keeps (cleared when full, like the registry's
/// address map); also the most keys whose last response check it remembers.
const MAX_ROUTE_COPIES: usize = 4_096;

/// What a pending-mark update does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pending {
    /// One more request of the key is on its way to a target not known yet.
    Mark,
    /// One of them was counted (or found its target): take its mark back.
    Withdraw,
}

/// See the module documentation.
#[derive(Debug)]
pub(super) struct Learned {
    route_buckets: u32,
    route_ttl_ms: u64,
    pending_ttl_ms: u64,
    /// Copies of learned routes by key hash, with when they were last read
    /// or written here (see [`ROUTE_COPY_MS`]).
    route_copies: HashMap<u64, (RouteEntry, u64)>,
    /// When this VM last had a response checked for a key (by key hash),
    /// counting in the listener (see [`Learned::response_check_due`]).
    checked_keys: HashMap<u64, u64>,
}

impl Learned {
    pub(super) fn new(route_buckets: u32, route_ttl_ms: u64, pending_ttl_ms: u64) -> Self {
        Self {
            route_buckets,
            route_ttl_ms,
            pending_ttl_ms,
            route_copies: HashMap::new(),
            checked_keys: HashMap::new(),
        }
    }

    fn bucket_of(&self, key_hash: u64) -> u32 {
        // route_buckets <= 65536, so the remainder fits in u32.
        (key_hash % u64::from(self.route_buckets)) as u32
    }

    fn route_key<S: SharedStore>(&self, tables: &Tables<S>, key_hash: u64) -> String {
        tables.key(format_args!("route/{}", self.bucket_of(key_hash)))
    }

    fn pending_key<S: SharedStore>(&self, tables: &Tables<S>, key_hash: u64) -> String {
        tables.key(format_args!("pend/{}", self.bucket_of(key_hash)))
    }

    /// Whether a request of the key should have its response checked (see
    /// [`super::LoadTracker::response_check_due`]).
    pub(super) fn response_check_due(&mut self, key_hash: u64, now_ms: u64) -> bool {
        let due = self
            .checked_keys
            .get(&key_hash)
            .is_none_or(|at| now_ms.saturating_sub(*at) >= RESPONSE_CHECK_MS);
        if due {
            if self.checked_keys.len() >= MAX_ROUTE_COPIES {
                self.checked_keys.clear();
            }
            self.checked_keys.insert(key_hash, now_ms);
        }
        due
    }

    /// Pending requests of the key, younger than the pending TTL.
    pub(super) fn pending_of<S: SharedStore>(
        &self,
        tables: &Tables<S>,
        key_hash: u64,
        now_ms: u64,
    ) -> u32 {
        let bucket: PendingBucket = tables.read(&self.pending_key(tables, key_hash)).record;
        bucket.count(key_hash, now_ms, self.pending_ttl_ms)
    }

    /// Whether the key may have pending requests, which only a worker that
    /// found no target for it marks (then at most `pending_ttl_ms` long). A
    /// key this VM copied the route of within [`ROUTE_COPY_MS`], learned
    /// longer ago than that, has none left but those of a worker that lost
    /// its entry meanwhile (a full bucket evicted it): the read of the
    /// pending table, a host call on every claim, is saved.
    pub(super) fn may_have_pending(&self, key_hash: u64, now_ms: u64) -> bool {
        self.route_copy(key_hash, now_ms)
            .is_none_or(|copy| now_ms.saturating_sub(copy.learned_ms) <= self.pending_ttl_ms)
    }

    /// Adds or withdraws one pending request of the key.
    pub(super) fn mark_pending<S: SharedStore>(
        &self,
        tables: &Tables<S>,
        key_hash: u64,
        change: Pending,
        now_ms: u64,
    ) {
        let ttl = self.pending_ttl_ms;
        tables.update(
            &self.pending_key(tables, key_hash),
            |bucket: &mut PendingBucket| {
                match change {
                    Pending::Mark => bucket.add(key_hash, now_ms, ttl),
                    Pending::Withdraw if !bucket.remove(key_hash, now_ms, ttl) => {
                        return Change::Keep(());
                    }
                    Pending::Withdraw => {}
                }
                Change::Write(())
            },
        );
    }

    /// This VM's copy of the key's route, if read or written here within
    /// [`ROUTE_COPY_MS`] and not expired.
    pub(super) fn route_copy(&self, key_hash: u64, now_ms: u64) -> Option<RouteEntry> {
        let (entry, copied_ms) = self.route_copies.get(&key_hash)?;
        let recent = copy_is_fresh(*copied_ms, now_ms, ROUTE_COPY_MS);
        let live = now_ms.saturating_sub(entry.learned_ms) <= self.route_ttl_ms;
        (recent && live).then_some(*entry)
    }

    fn keep_route_copy(&mut self, entry: RouteEntry, now_ms: u64) {
        if self.route_copies.len() >= MAX_ROUTE_COPIES {
            self.route_copies.clear();
        }
        self.route_copies.insert(entry.key_hash, (entry, now_ms));
    }

    /// The key's live route: this VM's copy if recent, else the shared
    /// table's entry (copied). None: not learned, or expired.
    pub(super) fn lookup<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        key_hash: u64,
        now_ms: u64,
    ) -> Option<RouteEntry> {
        if let Some(copy) = self.route_copy(key_hash, now_ms) {
            return Some(copy);
        }
        let bucket: RouteBucket = tables.read(&self.route_key(tables, key_hash)).record;
        let entry = bucket.lookup(key_hash, now_ms, self.route_ttl_ms)?;
        self.keep_route_copy(entry, now_ms);
        Some(entry)
    }

    /// The upstream filter saw Maglev send the key to `slot` (holding the
    /// instance with `addr_hash`).
    pub(super) fn learn<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        key_hash: u64,
        slot: u16,
        addr_hash: u64,
        now_ms: u64,
    ) {
        let learned = RouteEntry::new(key_hash, slot, addr_hash, now_ms);
        // Learned here within the last second: the shared table has it (or
        // had it: a full bucket may have evicted it, relearned next second).
        if self
            .route_copy(key_hash, now_ms)
            .is_some_and(|copy| copy.same_instance(&learned))
        {
            return;
        }
        let refresh_ms = self.route_ttl_ms / 8;
        self.change_route(tables, key_hash, now_ms, |existing| match existing {
            // The same instance again: rewritten only once `refresh_ms` old,
            // to spare shared writes.
            Some(known) if known.same_instance(&learned) => {
                (now_ms.saturating_sub(known.learned_ms) >= refresh_ms).then_some(learned)
            }
            _ => Some(learned),
        });
    }

    /// Changes the key's entry in the shared key -> instance table:
    /// `change` sees the live entry (None: there is none) and returns the
    /// entry to write, or None to leave the table as it is. This VM's copy
    /// follows the table.
    fn change_route<S: SharedStore>(
        &mut self,
        tables: &Tables<S>,
        key_hash: u64,
        now_ms: u64,
        mut change: impl FnMut(Option<RouteEntry>) -> Option<RouteEntry>,
    ) {
        let ttl = self.route_ttl_ms;
        let changed = tables.update(
            &self.route_key(tables, key_hash),
            |bucket: &mut RouteBucket| {
                let current = bucket.lookup(key_hash, now_ms, ttl);
                match change(current) {
                    Some(changed) => {
                        bucket.upsert(changed, 0);
                        Change::Write(changed)
                    }
                    None => Change::Keep(current),
                }
            },
        );
        if let Updated::Written(entry) | Updated::Kept(Some(entry)) = changed {
            self.keep_route_copy(entry, now_ms);
        }
    }
}
