//! What the upstream filter teaches: key -> instance mappings, and the
//! pending marks of requests routed before their key's target was known.

use super::*;

impl<S: SharedStore> LoadTracker<S> {
    pub(super) fn pending_key(&self, bucket: u32) -> String {
        format!("{}/pend/{bucket}", self.prefix)
    }

    pub(super) fn pending_of(&self, key: &str, now_ms: u64) -> u32 {
        let hash = key_hash(key);
        let (value, _) = self.store.get(&self.pending_key(self.bucket_of(hash)));
        value
            .as_deref()
            .and_then(PendingBucket::decode)
            .map_or(0, |b| b.count(hash, now_ms, self.config.pending_ttl_ms))
    }

    /// Whether `key` may have pending requests, which only a worker that
    /// found no target for it marks (then at most `pending_ttl_ms` long). A
    /// key this VM copied the route of within [`ROUTE_COPY_MS`], learned
    /// longer ago than that, has none left but those of a worker that lost
    /// its entry meanwhile (a full bucket evicted it): the read of the
    /// pending table, a host call on every claim, is saved.
    pub(super) fn may_have_pending(&self, key: &str, now_ms: u64) -> bool {
        self.route_copy(key_hash(key), now_ms)
            .is_none_or(|copy| now_ms.saturating_sub(copy.learned_ms) <= self.config.pending_ttl_ms)
    }

    /// Adds or removes one pending request of `key`. A missing bucket is
    /// created empty first, never over another VM's ([`SharedStore::create`]).
    pub(super) fn update_pending(&mut self, key: &str, add: bool, now_ms: u64) {
        let hash = key_hash(key);
        let name = self.pending_key(self.bucket_of(hash));
        let ttl = self.config.pending_ttl_ms;
        for _ in 0..self.config.cas_attempts {
            let (value, cas) = self.store.get(&name);
            if cas.is_none() {
                if !add {
                    return;
                }
                // Err(CasMismatch): another VM created it meanwhile (with its
                // mark in it, which a plain set would wipe); read it again.
                if let Err(SetError::Failed) =
                    self.store.create(&name, &PendingBucket::default().encode())
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

    pub(super) fn bucket_of(&self, key_hash: u64) -> u32 {
        // route_buckets <= 65536, so the remainder fits in u32.
        (key_hash % u64::from(self.config.route_buckets)) as u32
    }

    pub(super) fn route_key(&self, bucket: u32) -> String {
        format!("{}/route/{bucket}", self.prefix)
    }

    /// This VM's copy of `key_hash`'s route, if read or written here within
    /// [`ROUTE_COPY_MS`] and not expired.
    pub(super) fn route_copy(&self, key_hash: u64, now_ms: u64) -> Option<RouteEntry> {
        let (entry, copied_ms) = self.route_copies.get(&key_hash)?;
        let recent = now_ms.saturating_sub(*copied_ms) < ROUTE_COPY_MS;
        let live = now_ms.saturating_sub(entry.learned_ms) <= self.config.route_ttl_ms;
        (recent && live).then_some(*entry)
    }

    pub(super) fn keep_route_copy(&mut self, entry: RouteEntry, now_ms: u64) {
        if self.route_copies.len() >= MAX_ROUTE_COPIES {
            self.route_copies.clear();
        }
        self.route_copies.insert(entry.key_hash, (entry, now_ms));
    }

    pub(super) fn learn(&mut self, key: &str, slot: u16, address: &str, now_ms: u64) {
        let hash = key_hash(key);
        let learned = RouteEntry::new(hash, slot, addr_hash(address), now_ms);
        // Learned here within the last second: the shared table has it (or
        // had it: a full bucket may have evicted it, relearned next second).
        if self
            .route_copy(hash, now_ms)
            .is_some_and(|copy| copy.same_instance(&learned))
        {
            return;
        }
        let refresh_ms = self.config.route_ttl_ms / 8;
        self.change_route(hash, now_ms, |tracker, existing| match existing {
            // Maglev's choice for a key placed elsewhere (a request routed
            // before this VM saw the placement) changes nothing while the
            // placed instance still serves.
            Some(placed)
                if placed.placed
                    && !placed.same_instance(&learned)
                    && tracker.serves(placed.slot, placed.addr_hash, now_ms) =>
            {
                None
            }
            // The same instance again: rewritten (balancing's marks kept)
            // only once `refresh_ms` old, to spare shared writes.
            Some(known) if known.same_instance(&learned) => {
                (now_ms.saturating_sub(known.learned_ms) >= refresh_ms).then_some(RouteEntry {
                    learned_ms: now_ms,
                    ..known
                })
            }
            _ => Some(learned),
        });
    }

    /// Changes `key_hash`'s entry in the shared key -> instance table by
    /// compare-and-swap: `change` sees the live entry (None: there is none)
    /// and returns the entry to write, or None to leave the table as it is.
    /// This VM's copy follows the table.
    pub(super) fn change_route(
        &mut self,
        key_hash: u64,
        now_ms: u64,
        mut change: impl FnMut(&Self, Option<RouteEntry>) -> Option<RouteEntry>,
    ) -> RouteUpdate {
        let name = self.route_key(self.bucket_of(key_hash));
        for _ in 0..self.config.cas_attempts {
            let (value, cas) = self.store.get(&name);
            let mut bucket = value
                .as_deref()
                .and_then(RouteBucket::decode)
                .unwrap_or_default();
            let current = bucket.lookup(key_hash, now_ms, self.config.route_ttl_ms);
            let Some(changed) = change(self, current) else {
                let Some(current) = current else {
                    return RouteUpdate::Missing;
                };
                self.keep_route_copy(current, now_ms);
                return RouteUpdate::Kept(current);
            };
            bucket.upsert(changed, 0);
            // A new bucket is created, never over another VM's first entries.
            match self.store.replace(&name, &bucket.encode(), cas) {
                Ok(()) => {
                    self.keep_route_copy(changed, now_ms);
                    return RouteUpdate::Written;
                }
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Failed) => return RouteUpdate::Missing,
            }
        }
        RouteUpdate::Missing
    }
}

/// What [`LoadTracker::change_route`] did.
pub(super) enum RouteUpdate {
    /// The change was written.
    Written,
    /// The table was left as it is; the live entry in it.
    Kept(RouteEntry),
    /// No live entry and nothing written, or the write failed.
    Missing,
}
