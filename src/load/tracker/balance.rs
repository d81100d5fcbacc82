//! Key balancing: consistent hashing with bounded loads (Mirrokni, Thorup
//! and Zadimoghaddam, 2018), bounding how many live keys each instance owns
//! rather than how many requests it has in flight.
//!
//! Why: Maglev spreads the *hash space* evenly, but a fleet serving a few
//! dozen hot prefixes gets balls-into-bins placement: with 100 keys on 7
//! instances, one instance owns 7 keys and another 22. The crowded one cannot
//! keep all its prefixes cached and serves a fifth of the traffic
//! (`tools/models/kv_lru_model.py`, `docs/benchmarks.md`).
//!
//! How: a new key is placed before its first request, on the first instance
//! of the key's own rendezvous order (highest random weight: consistent like
//! Maglev, and the same in every VM and replica) that owns fewer than its
//! bound, `ceil(factor × live keys / instances)`, of the keys counted in the
//! shared census (`load/census.rs`). Deciding and counting is one
//! compare-and-swap on the census, so concurrent workers never fill the same
//! instance past its bound; the placement is written into the shared key ->
//! instance table, where every worker finds it, and requests reach it
//! through the host-override header. A key is placed once: it never moves
//! while its instance serves. A placement is dropped when its instance is
//! gone or the key is unused for the route TTL.
//!
//! The filter only knows instances that have served through it, so new keys
//! go by Maglev first until no instance has registered for
//! [`KNOWN_FLEET_SETTLED_MS`] (the first seconds of an Envoy, and after an
//! instance joins), and one in [`EXPLORE_ONE_IN`] always does (so an added
//! instance becomes known). Such a key is checked once its Maglev
//! target is learned, the same way with that target as first choice; moving
//! it then costs its new instance one more prefill.
//!
//! Cost: a registry scan and two shared writes (census, route) per new key,
//! one census write per key per census generation; nothing for a steady key
//! within a generation.
//!
//! Trade-off (why it is opt-in): placements live in this Envoy's shared data,
//! so separate Envoy replicas may place the same key differently.

use super::super::census::{generation, Census};
use super::learned::RouteUpdate;
use super::*;

/// A new key is placed directly only once no instance has registered (served
/// through this Envoy for the first time) for this long; until then new keys
/// go by Maglev (which finds the instances the filter has not seen yet) and
/// are checked afterwards.
const KNOWN_FLEET_SETTLED_MS: u64 = 10_000;

/// One new key in this many (by key hash, so every VM and replica agrees)
/// still goes by Maglev first: how an instance added to the cluster gets
/// its first keys and becomes known.
const EXPLORE_ONE_IN: u64 = 8;

/// The most live keys one instance may own: `factor_percent` % of an even
/// share of `keys` over `instances`, rounded up, at least 1.
pub(crate) fn key_bound(keys: u64, instances: usize, factor_percent: u32) -> u64 {
    let instances = (instances as u64).max(1);
    let scaled = keys.saturating_mul(u64::from(factor_percent));
    scaled.div_ceil(100 * instances).max(1)
}

/// Rendezvous score of an instance for a key: each key ranks the instances
/// in its own order, the same in every VM and every Envoy.
fn preference(key_hash: u64, instance_addr_hash: u64) -> u64 {
    xxh3_64_with_seed(&key_hash.to_le_bytes(), instance_addr_hash)
}

/// Where a key goes given the census: its target while the target is below
/// the bound, else the first instance in its preference order below it (the
/// target if none is).
fn choose<'a>(
    census: &Census,
    instances: &'a [(InstanceRef, u64)],
    target: &InstanceRef,
    key_hash: u64,
    factor_percent: u32,
) -> Option<&'a (InstanceRef, u64)> {
    let at_target = instances.iter().find(|(i, _)| i.slot == target.slot)?;
    let owned = |slot: u16| u64::from(census.owned(slot));
    let live: u64 = instances.iter().map(|(i, _)| owned(i.slot)).sum();
    let bound = key_bound(live + 1, instances.len(), factor_percent);
    if owned(target.slot) < bound {
        return Some(at_target);
    }
    let elsewhere = instances
        .iter()
        .filter(|(i, _)| i.slot != target.slot && owned(i.slot) < bound)
        .max_by_key(|(_, addr_hash)| preference(key_hash, *addr_hash));
    Some(elsewhere.unwrap_or(at_target))
}

/// The instance of `instances` a route entry names, if it is one of them.
fn instance_of(instances: &[(InstanceRef, u64)], entry: &RouteEntry) -> Option<InstanceRef> {
    instances
        .iter()
        .find(|(i, addr_hash)| i.slot == entry.slot && *addr_hash == entry.addr_hash)
        .map(|(instance, _)| instance.clone())
}

impl<S: SharedStore> LoadTracker<S> {
    /// See [`LoadView::balance`] and the module documentation. `target` is
    /// what [`LoadView::target_of`] just returned for `key`.
    pub(super) fn balance_key(
        &mut self,
        key: &str,
        target: Target,
        factor_percent: u32,
        now_ms: u64,
    ) -> Target {
        let hash = key_hash(key);
        let Some((entry, _)) = self.route_copies.get(&hash).copied() else {
            return target;
        };
        if entry.slot != target.instance.slot {
            return target;
        }
        if entry.checked {
            let generation = generation(now_ms);
            if target.placed {
                self.refresh_placement(&entry, now_ms);
            }
            if entry.census_generation < generation {
                self.recount(&entry, generation, now_ms);
            }
            return target;
        }
        match self.check(&entry, &target.instance, factor_percent, now_ms) {
            Some(instance) => Target {
                instance,
                placed: true,
            },
            None => target,
        }
    }

    /// See [`LoadView::place_new`]: a key with no live route is placed on
    /// the first instance of its preference order below the bound.
    pub(super) fn place_new_key(
        &mut self,
        key: &str,
        factor_percent: u32,
        now_ms: u64,
    ) -> Option<Target> {
        let hash = key_hash(key);
        let (epoch, registered_ms) = self.read_epoch_record();
        let settled = now_ms.saturating_sub(registered_ms) >= KNOWN_FLEET_SETTLED_MS;
        if !settled || hash % EXPLORE_ONE_IN == 0 {
            return None;
        }
        let instances = self.fresh_instances(epoch, now_ms);
        if instances.len() < 2 {
            return None;
        }
        let (first, _) = instances
            .iter()
            .max_by_key(|(_, addr_hash)| preference(hash, *addr_hash))?
            .clone();
        // Unless a worker routed the key meanwhile (to an instance that serves).
        let unrouted = |tracker: &Self, current: Option<RouteEntry>| {
            !current.is_some_and(|e| tracker.serves(e.slot, e.addr_hash, now_ms))
        };
        let settled = self.settle(
            hash,
            &first,
            false,
            &instances,
            factor_percent,
            now_ms,
            unrouted,
        )?;
        instance_of(&instances, &settled).map(|instance| Target {
            instance,
            placed: settled.placed,
        })
    }

    /// Fresh registered instances with their address hashes (`epoch`: the
    /// registry epoch just read).
    fn fresh_instances(&mut self, epoch: u64, now_ms: u64) -> Vec<(InstanceRef, u64)> {
        self.rescan_if_changed(epoch);
        let slots: Vec<u16> = self.known_slots.iter().copied().collect();
        slots
            .into_iter()
            .filter_map(|slot| {
                let address = self.fresh_record(slot, now_ms)?.address;
                let hash = addr_hash(&address);
                Some((InstanceRef { slot, address }, hash))
            })
            .collect()
    }

    /// Decides where an unchecked key lives, counts it there and marks it
    /// checked. Some: placed on that instance (by this worker or, if this
    /// VM's copy was stale, by another); None: it stays (or a shared write
    /// failed: checked later).
    fn check(
        &mut self,
        entry: &RouteEntry,
        target: &InstanceRef,
        factor_percent: u32,
        now_ms: u64,
    ) -> Option<InstanceRef> {
        let instances = self.fresh_instances(self.read_epoch(), now_ms);
        let unchecked = |_: &Self, current: Option<RouteEntry>| {
            current.is_some_and(|c| !c.checked && c.same_instance(entry))
        };
        let settled = self.settle(
            entry.key_hash,
            target,
            true,
            &instances,
            factor_percent,
            now_ms,
            unchecked,
        )?;
        if settled.placed {
            instance_of(&instances, &settled)
        } else {
            None
        }
    }

    /// Decides where `key_hash` lives (`first` while it owns fewer keys than
    /// the bound, else the first instance of the key's preference order
    /// below it), counts it there and writes the route, checked, where
    /// `open` says the table is still open to it; placed unless it stays on
    /// `first` and `first` is Maglev's choice. If another worker got there
    /// first, takes the count back. Returns the route now in the table.
    #[allow(clippy::too_many_arguments)]
    fn settle(
        &mut self,
        key_hash: u64,
        first: &InstanceRef,
        first_is_maglevs: bool,
        instances: &[(InstanceRef, u64)],
        factor_percent: u32,
        now_ms: u64,
        open: impl Fn(&Self, Option<RouteEntry>) -> bool,
    ) -> Option<RouteEntry> {
        let generation = generation(now_ms);
        let (choice, choice_addr_hash) = self.update_census(generation, |census| {
            let choice = choose(census, instances, first, key_hash, factor_percent)?;
            census.add_new(choice.0.slot);
            Some(choice.clone())
        })??;
        let entry = RouteEntry {
            placed: !(first_is_maglevs && choice.slot == first.slot),
            checked: true,
            census_generation: generation,
            ..RouteEntry::new(key_hash, choice.slot, choice_addr_hash, now_ms)
        };
        let update = self.change_route(key_hash, now_ms, |tracker, current| {
            open(tracker, current).then_some(entry)
        });
        let theirs = match update {
            RouteUpdate::Written => return Some(entry),
            RouteUpdate::Kept(theirs) => Some(theirs),
            RouteUpdate::Missing => None,
        };
        self.update_census(generation, |census| census.remove_new(choice.slot));
        theirs
    }

    /// Counts a checked key in this census generation (once: the route
    /// entry records the generation first).
    fn recount(&mut self, entry: &RouteEntry, generation: u32, now_ms: u64) {
        let update = self.change_route(entry.key_hash, now_ms, |_, current| {
            current
                .filter(|c| c.checked && c.same_instance(entry) && c.census_generation < generation)
                .map(|c| RouteEntry {
                    census_generation: generation,
                    ..c
                })
        });
        if let RouteUpdate::Written = update {
            self.update_census(generation, |census| census.recount(entry.slot));
        }
    }

    /// Keeps a placement in use from expiring: rewrites its time once per
    /// eighth of the route TTL, as learning does for Maglev's routes (placed
    /// keys are not learned: their requests carry the host override).
    fn refresh_placement(&mut self, entry: &RouteEntry, now_ms: u64) {
        let refresh_ms = self.config.route_ttl_ms / 8;
        if now_ms.saturating_sub(entry.learned_ms) < refresh_ms {
            return;
        }
        self.change_route(entry.key_hash, now_ms, |_, current| {
            current
                .filter(|c| c.placed && c.same_instance(entry))
                .map(|c| RouteEntry {
                    learned_ms: now_ms,
                    ..c
                })
        });
    }

    fn census_key(&self) -> String {
        format!("{}/census", self.prefix)
    }

    /// Applies `change` to the census as of `generation`, by compare-and-swap
    /// (`change` runs again on a retry). None if it could not be written.
    fn update_census<R>(
        &mut self,
        generation: u32,
        mut change: impl FnMut(&mut Census) -> R,
    ) -> Option<R> {
        let name = self.census_key();
        for _ in 0..self.config.cas_attempts {
            let (value, cas) = self.store.get(&name);
            if cas.is_none() {
                // Create it empty (Err(CasMismatch): another VM did
                // meanwhile), then update it like any other.
                if let Err(SetError::Failed) = self.store.create(&name, &Census::default().encode())
                {
                    return None;
                }
                continue;
            }
            let mut census = value
                .as_deref()
                .and_then(Census::decode)
                .unwrap_or_default()
                .rolled(generation);
            let result = change(&mut census);
            match self.store.set(&name, &census.encode(), cas) {
                Ok(()) => return Some(result),
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Failed) => return None,
            }
        }
        None
    }

    /// True if `slot` still holds the instance with `addr_hash` and it has
    /// served within the instance TTL.
    pub(super) fn serves(&self, slot: u16, instance_addr_hash: u64, now_ms: u64) -> bool {
        self.fresh_record(slot, now_ms)
            .is_some_and(|record| addr_hash(&record.address) == instance_addr_hash)
    }
}
