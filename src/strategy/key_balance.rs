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
//!
//! Where: this is a routing policy, so it lives with the policies; the load
//! tables answer it through [`KeyPlacements`], which is what it needs from
//! storage and nothing more. [`crate::load::LoadView::balance`] and
//! [`crate::load::LoadView::place_new`] stay the seam [`super::PrefixAware`]
//! calls (and its tests fake); the tracker answers them with this policy.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::load::{
    generation, key_hash, Census, Change, InstanceRef, RegistryEpoch, RouteEntry, RouteUpdate,
    Target, Updated,
};

/// What key balancing needs from the shared tables.
pub(crate) trait KeyPlacements {
    /// This VM's copy of the key's route (read or written here), however old.
    fn route_copy(&self, key_hash: u64) -> Option<RouteEntry>;
    /// The registry epoch and when it last changed.
    fn registry_epoch(&self) -> RegistryEpoch;
    /// Fresh registered instances with their address hashes (`epoch`: the
    /// registry epoch just read; the instance slots are rescanned if it
    /// changed since this VM last looked).
    fn fresh_instances(&mut self, epoch: u64, now_ms: u64) -> Vec<(InstanceRef, u64)>;
    /// Changes the key's entry in the shared key -> instance table by
    /// compare-and-swap: `change` sees the live entry (None: there is none)
    /// and a test of whether an entry's instance still serves, and returns
    /// the entry to write, or None to leave the table as it is.
    fn change_route(
        &mut self,
        key_hash: u64,
        now_ms: u64,
        change: impl FnMut(Option<RouteEntry>, &dyn Fn(&RouteEntry) -> bool) -> Option<RouteEntry>,
    ) -> RouteUpdate;
    /// Applies `change` to the shared census by compare-and-swap (`change`
    /// runs again on a retry).
    fn update_census<W, K>(
        &mut self,
        change: impl FnMut(&mut Census) -> Change<W, K>,
    ) -> Updated<W, K>;
    /// How long a learned route lives unused.
    fn route_ttl_ms(&self) -> u64;
}

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

/// See [`crate::load::LoadView::balance`] and the module documentation.
/// `target` is what [`crate::load::LoadView::target_of`] just returned for
/// `key`.
pub(crate) fn balance(
    store: &mut impl KeyPlacements,
    key: &str,
    target: Target,
    factor_percent: u32,
    now_ms: u64,
) -> Target {
    let Some(entry) = store.route_copy(key_hash(key)) else {
        return target;
    };
    if entry.slot != target.instance.slot {
        return target;
    }
    if entry.checked {
        let generation = generation(now_ms);
        if target.placed {
            refresh_placement(store, &entry, now_ms);
        }
        if entry.census_generation < generation {
            recount(store, &entry, generation, now_ms);
        }
        return target;
    }
    match check(store, &entry, &target.instance, factor_percent, now_ms) {
        Some(instance) => Target {
            instance,
            placed: true,
        },
        None => target,
    }
}

/// See [`crate::load::LoadView::place_new`]: a key with no live route is
/// placed on the first instance of its preference order below the bound.
pub(crate) fn place_new(
    store: &mut impl KeyPlacements,
    key: &str,
    factor_percent: u32,
    now_ms: u64,
) -> Option<Target> {
    let hash = key_hash(key);
    let RegistryEpoch { epoch, changed_ms } = store.registry_epoch();
    let settled = now_ms.saturating_sub(changed_ms) >= KNOWN_FLEET_SETTLED_MS;
    if !settled || hash % EXPLORE_ONE_IN == 0 {
        return None;
    }
    let instances = store.fresh_instances(epoch, now_ms);
    if instances.len() < 2 {
        return None;
    }
    let (first, _) = instances
        .iter()
        .max_by_key(|(_, addr_hash)| preference(hash, *addr_hash))?
        .clone();
    // Unless a worker routed the key meanwhile (to an instance that serves).
    let unrouted = |current: Option<RouteEntry>, serves: &dyn Fn(&RouteEntry) -> bool| {
        !current.is_some_and(|e| serves(&e))
    };
    let choice = Choice {
        key_hash: hash,
        first: &first,
        first_is_maglevs: false,
        instances: &instances,
        factor_percent,
    };
    let settled = settle(store, &choice, now_ms, unrouted)?;
    instance_of(&instances, &settled).map(|instance| Target {
        instance,
        placed: settled.placed,
    })
}

/// Decides where an unchecked key lives, counts it there and marks it
/// checked. Some: placed on that instance (by this worker or, if this VM's
/// copy was stale, by another); None: it stays (or a shared write failed:
/// checked later).
fn check(
    store: &mut impl KeyPlacements,
    entry: &RouteEntry,
    target: &InstanceRef,
    factor_percent: u32,
    now_ms: u64,
) -> Option<InstanceRef> {
    let epoch = store.registry_epoch().epoch;
    let instances = store.fresh_instances(epoch, now_ms);
    let unchecked = |current: Option<RouteEntry>, _: &dyn Fn(&RouteEntry) -> bool| {
        current.is_some_and(|c| !c.checked && c.same_instance(entry))
    };
    let choice = Choice {
        key_hash: entry.key_hash,
        first: target,
        first_is_maglevs: true,
        instances: &instances,
        factor_percent,
    };
    let settled = settle(store, &choice, now_ms, unchecked)?;
    if settled.placed {
        instance_of(&instances, &settled)
    } else {
        None
    }
}

/// What one placement decides over.
struct Choice<'a> {
    key_hash: u64,
    /// Where the key goes while it owns fewer keys than the bound.
    first: &'a InstanceRef,
    /// `first` is Maglev's choice for the key (then staying there is not a
    /// placement).
    first_is_maglevs: bool,
    instances: &'a [(InstanceRef, u64)],
    factor_percent: u32,
}

/// Decides where the key lives (`first` while it owns fewer keys than the
/// bound, else the first instance of the key's preference order below it),
/// counts it there and writes the route, checked, where `open` says the
/// table is still open to it; placed unless it stays on `first` and `first`
/// is Maglev's choice. If another worker got there first, takes the count
/// back. Returns the route now in the table.
fn settle(
    store: &mut impl KeyPlacements,
    choice: &Choice<'_>,
    now_ms: u64,
    open: impl Fn(Option<RouteEntry>, &dyn Fn(&RouteEntry) -> bool) -> bool,
) -> Option<RouteEntry> {
    let generation = generation(now_ms);
    let counted = update_census(store, generation, |census| {
        let Some(chosen) = choose(
            census,
            choice.instances,
            choice.first,
            choice.key_hash,
            choice.factor_percent,
        ) else {
            return Change::Keep(());
        };
        census.add_new(chosen.0.slot);
        Change::Write(chosen.clone())
    });
    let Updated::Written((chosen, chosen_addr_hash)) = counted else {
        return None;
    };
    let entry = RouteEntry {
        placed: !(choice.first_is_maglevs && chosen.slot == choice.first.slot),
        checked: true,
        census_generation: generation,
        ..RouteEntry::new(choice.key_hash, chosen.slot, chosen_addr_hash, now_ms)
    };
    let update = store.change_route(choice.key_hash, now_ms, |current, serves| {
        open(current, serves).then_some(entry)
    });
    let theirs = match update {
        RouteUpdate::Written => return Some(entry),
        RouteUpdate::Kept(theirs) => Some(theirs),
        RouteUpdate::Missing => None,
    };
    update_census(store, generation, |census| -> Change<()> {
        census.remove_new(chosen.slot);
        Change::Write(())
    });
    theirs
}

/// Counts a checked key in this census generation (once: the route entry
/// records the generation first).
fn recount(store: &mut impl KeyPlacements, entry: &RouteEntry, generation: u32, now_ms: u64) {
    let update = store.change_route(entry.key_hash, now_ms, |current, _| {
        current
            .filter(|c| c.checked && c.same_instance(entry) && c.census_generation < generation)
            .map(|c| RouteEntry {
                census_generation: generation,
                ..c
            })
    });
    if let RouteUpdate::Written = update {
        update_census(store, generation, |census| -> Change<()> {
            census.recount(entry.slot);
            Change::Write(())
        });
    }
}

/// Keeps a placement in use from expiring: rewrites its time once per eighth
/// of the route TTL, as learning does for Maglev's routes (placed keys are
/// not learned: their requests carry the host override).
fn refresh_placement(store: &mut impl KeyPlacements, entry: &RouteEntry, now_ms: u64) {
    let refresh_ms = store.route_ttl_ms() / 8;
    if now_ms.saturating_sub(entry.learned_ms) < refresh_ms {
        return;
    }
    store.change_route(entry.key_hash, now_ms, |current, _| {
        current
            .filter(|c| c.placed && c.same_instance(entry))
            .map(|c| RouteEntry {
                learned_ms: now_ms,
                ..c
            })
    });
}

/// Applies `change` to the census as of `generation` (`change` runs again
/// on a retry).
fn update_census<W, K>(
    store: &mut impl KeyPlacements,
    generation: u32,
    mut change: impl FnMut(&mut Census) -> Change<W, K>,
) -> Updated<W, K> {
    store.update_census(|census| {
        *census = std::mem::take(census).rolled(generation);
        change(census)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_bound_is_the_rounded_up_share_times_the_factor() {
        assert_eq!(key_bound(100, 7, 100), 15);
        assert_eq!(key_bound(100, 7, 110), 16);
        assert_eq!(key_bound(98, 7, 100), 14);
        assert_eq!(key_bound(99, 7, 100), 15);
        assert_eq!(key_bound(0, 7, 100), 1);
        assert_eq!(key_bound(8, 7, 100), 2);
        assert_eq!(key_bound(8, 0, 100), 8);
    }
}
