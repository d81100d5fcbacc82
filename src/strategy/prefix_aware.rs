//! PREFIX_AWARE: send each key to its target (Maglev on the key header) while
//! the target has fewer than `concurrency_threshold` requests in flight from
//! this Envoy; at the threshold, overflow to the least busy other instance
//! (host-override header), and come back as soon as the target drops below it.
//!
//! The target is never nominated through the override header: Maglev routes
//! to it. So a stale learned mapping can cause at most an unneeded overflow,
//! never pin a key to an instance Maglev no longer chooses.
//!
//! Without a host header (or when no other instance is known yet) overflow
//! re-keys with a salt: Maglev sends the salted key elsewhere. Salted keys are
//! learned like any key, so a salt whose target is known, not the target and
//! not busy is preferred; an unknown salt is explored only when none is.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{DecisionKind, RouteHeaders, Routed};
use crate::headers::PENDING_MARK;
use crate::load::{Candidate, Claim, InstanceRef, LoadView, Target, Ticket};

/// Salts tried for one overflow (bounds the lookups per request).
const DEFAULT_MAX_SALTS: u8 = 8;

/// Reads of the least busy other instance before an overflow claims one
/// regardless of concurrent claims.
const OVERFLOW_ATTEMPTS: usize = 4;

/// The key Maglev sees for overflow salt `salt`: 16 lowercase hex digits,
/// like every key (xxh3 of the key, seeded with the salt).
pub fn salted_key(key: &str, salt: u8) -> String {
    format!(
        "{:016x}",
        xxh3_64_with_seed(key.as_bytes(), u64::from(salt))
    )
}

/// Where a full target's key overflows with the host header: the other
/// instance within the fleet-wide engine bounds, then with the least load;
/// equal ones by a hash of the slot seeded with the decision's random
/// number, so concurrent overflows spread.
pub fn least_busy_other<'a>(
    candidates: &'a [Candidate],
    exclude: &InstanceRef,
    random: u64,
) -> Option<&'a Candidate> {
    candidates
        .iter()
        .filter(|c| c.instance.slot != exclude.slot && c.instance.address != exclude.address)
        .min_by_key(|c| {
            (
                c.over_bounds,
                c.load,
                xxh3_64_with_seed(&c.instance.slot.to_le_bytes(), random),
            )
        })
}

/// This Envoy's requests in flight on `instance`, if it is a candidate.
fn in_flight_of(candidates: &[Candidate], instance: &InstanceRef) -> Option<u32> {
    candidates
        .iter()
        .find(|c| c.instance == *instance)
        .map(|c| c.in_flight)
}

/// See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixAware {
    /// Requests in flight on a target at which its keys overflow (1..=1024).
    pub concurrency_threshold: u32,
    /// True if the `host_header` is configured (and read by Envoy's
    /// `override_host` policy); false: overflow re-keys with a salt.
    pub host_override: bool,
    /// Salts tried per overflow.
    pub max_salts: u8,
    /// Engine load on: the target is weighed by its engine's sample before
    /// it is claimed (a read of every instance; off, the claim alone).
    pub engine_load: bool,
}

impl PrefixAware {
    pub fn new(concurrency_threshold: u32, host_override: bool) -> Self {
        Self {
            concurrency_threshold: concurrency_threshold.max(1),
            host_override,
            max_salts: DEFAULT_MAX_SALTS,
            engine_load: false,
        }
    }

    /// To the key's target: Maglev gets there on the key. Counted if
    /// `ticket` is held.
    fn to_target(key: &str, target: &Target, ticket: Option<Ticket>) -> Routed {
        Routed {
            headers: RouteHeaders {
                key: Some(key.to_string()),
                counted: ticket.as_ref().map(|_| target.instance.address.to_string()),
                ..RouteHeaders::bare(DecisionKind::Prefix)
            },
            ticket,
            placed_bytes: 0,
        }
    }

    /// All instances are at least as busy as the target: stay (cache affinity
    /// is worth more than moving to an equally or more loaded instance).
    fn stay(key: &str, target: &Target, load: &mut dyn LoadView, now_ms: u64) -> Routed {
        match load.claim(&target.instance, None, None, now_ms) {
            Claim::Claimed(ticket) => Self::to_target(key, target, Some(ticket)),
            _ => Self::to_target(key, target, None),
        }
    }

    fn overflow_to(
        key: String,
        host_override: Option<String>,
        instance: Option<&InstanceRef>,
        load: &mut dyn LoadView,
        now_ms: u64,
    ) -> Routed {
        let ticket = match instance.map(|i| load.claim(i, None, None, now_ms)) {
            Some(Claim::Claimed(ticket)) => Some(ticket),
            _ => None,
        };
        Self::overflowed(key, host_override, instance, ticket)
    }

    /// An overflow decision, counted on `instance` if `ticket` is held.
    fn overflowed(
        key: String,
        host_override: Option<String>,
        instance: Option<&InstanceRef>,
        ticket: Option<Ticket>,
    ) -> Routed {
        let counted = ticket.as_ref().and(instance).map(|i| i.address.to_string());
        Routed {
            headers: RouteHeaders {
                key: Some(key),
                host_override,
                counted,
                ..RouteHeaders::bare(DecisionKind::Overflow)
            },
            ticket,
            placed_bytes: 0,
        }
    }

    /// The target is full (`target_over`: over a fleet-wide engine bound,
    /// else at this Envoy's cap) with `target_load`: to the least loaded
    /// other instance if it is less loaded, else stay. `read`: the
    /// candidates as the target was weighed, if it was.
    #[allow(clippy::too_many_arguments)]
    fn overflow(
        &self,
        key: &str,
        target: &Target,
        target_load: u32,
        target_over: bool,
        mut read: Option<Vec<Candidate>>,
        load: &mut dyn LoadView,
        random: u64,
        now_ms: u64,
    ) -> Routed {
        if self.host_override {
            for attempt in 1..=OVERFLOW_ATTEMPTS {
                // Read again at each attempt but a first one the weighing
                // made: a refused claim means the counts moved since.
                let candidates = read.take().unwrap_or_else(|| load.candidates(now_ms));
                let Some(other) = least_busy_other(&candidates, &target.instance, random).cloned()
                else {
                    break;
                };
                if (other.over_bounds, other.load) >= (target_over, target_load) {
                    return Self::stay(key, target, load, now_ms);
                }
                // Claimed only if no other worker took a slot there since its
                // count was read (the same atomic claim as the target's), so
                // workers overflowing at the same moment spread out instead of
                // all landing on the one instance they each saw as least busy.
                // The last attempt claims whatever the count, as a tie-break.
                let cap = (attempt < OVERFLOW_ATTEMPTS)
                    .then(|| other.local_cap(other.load.saturating_add(1)));
                let ticket = match load.claim(&other.instance, None, cap, now_ms) {
                    Claim::Claimed(ticket) => Some(ticket),
                    Claim::Full { .. } | Claim::Gone => continue,
                    // Left to the upstream filter to count.
                    Claim::Contended => None,
                };
                let host = Some(other.instance.address.to_string());
                return Self::overflowed(key.to_string(), host, Some(&other.instance), ticket);
            }
        }
        self.salted(key, target, target_load, read, load, now_ms)
    }

    /// Overflow by a salted key, which Maglev sends elsewhere. `read`: the
    /// candidates as the target was weighed, if no claim has been refused
    /// since (else read again).
    fn salted(
        &self,
        key: &str,
        target: &Target,
        target_load: u32,
        read: Option<Vec<Candidate>>,
        load: &mut dyn LoadView,
        now_ms: u64,
    ) -> Routed {
        let mut best: Option<(String, InstanceRef, u32)> = None;
        let mut unexplored: Option<String> = None;
        let mut candidates = read;
        for salt in 1..=self.max_salts {
            let salted = salted_key(key, salt);
            match load.target_of(&salted, now_ms).map(|t| t.instance) {
                Some(instance) if instance.slot != target.instance.slot => {
                    let candidates = candidates.get_or_insert_with(|| load.candidates(now_ms));
                    let Some(in_flight) = in_flight_of(candidates, &instance) else {
                        continue;
                    };
                    if best.as_ref().is_none_or(|(_, _, b)| in_flight < *b) {
                        best = Some((salted, instance, in_flight));
                    }
                }
                Some(_) => {}
                None => {
                    if unexplored.is_none() {
                        unexplored = Some(salted);
                    }
                }
            }
        }
        match (best, unexplored) {
            (Some((salted, instance, in_flight)), unexplored)
                if in_flight < self.concurrency_threshold =>
            {
                // Claimed below the cap, as a target is: another worker may
                // have taken the last slot there since the count was read.
                let cap = Some(self.concurrency_threshold);
                match load.claim(&instance, None, cap, now_ms) {
                    Claim::Claimed(ticket) => {
                        Self::overflowed(salted, None, Some(&instance), Some(ticket))
                    }
                    // Left to the upstream filter to count.
                    Claim::Contended => Self::overflowed(salted, None, Some(&instance), None),
                    Claim::Full { .. } | Claim::Gone => match unexplored {
                        Some(salted) => Self::overflow_to(salted, None, None, load, now_ms),
                        None => Self::stay(key, target, load, now_ms),
                    },
                }
            }
            // Explore: Maglev picks the salted key's instance; the upstream
            // filter counts the request and learns where it went.
            (_, Some(salted)) => Self::overflow_to(salted, None, None, load, now_ms),
            (Some((salted, instance, in_flight)), None) if in_flight < target_load => {
                Self::overflow_to(salted, None, Some(&instance), load, now_ms)
            }
            _ => Self::stay(key, target, load, now_ms),
        }
    }

    /// Decides for a request with `key` (None: no key); `random` is a fresh
    /// random number.
    pub fn decide(
        &self,
        key: Option<&str>,
        load: &mut dyn LoadView,
        random: u64,
        now_ms: u64,
    ) -> Routed {
        let Some(key) = key else {
            return Routed::untracked(RouteHeaders::bare(DecisionKind::NoKey));
        };
        let target = load
            .target_of(key, now_ms)
            .or_else(|| load.route_blind(key, now_ms));
        let Some(target) = target else {
            // Not learned yet: Maglev routes; the request is pending for its
            // key until the upstream filter counts it and learns the target
            // (before this worker decides again: it runs right after us).
            return Routed::untracked(RouteHeaders {
                key: Some(key.to_string()),
                counted: Some(PENDING_MARK.to_string()),
                ..RouteHeaders::bare(DecisionKind::Prefix)
            });
        };
        // With engine load on: the target weighed by its engine's sample; at
        // a fleet-wide bound its keys overflow as at this Envoy's cap.
        let read = self.engine_load.then(|| load.candidates(now_ms));
        let weighed = read
            .as_ref()
            .and_then(|all| all.iter().find(|c| c.instance == target.instance))
            .map(|c| (c.load, c.over_bounds));
        if let Some((target_load, true)) = weighed {
            return self.overflow(key, &target, target_load, true, read, load, random, now_ms);
        }
        let cap = Some(self.concurrency_threshold);
        match load.claim(&target.instance, Some(key), cap, now_ms) {
            Claim::Claimed(ticket) => Self::to_target(key, &target, Some(ticket)),
            Claim::Full { in_flight } => {
                let target_load = weighed.map_or(in_flight, |(l, _)| l.max(in_flight));
                self.overflow(key, &target, target_load, false, read, load, random, now_ms)
            }
            // Could not claim atomically, or the target is gone: let Maglev
            // route and the upstream filter count.
            Claim::Contended | Claim::Gone => Self::to_target(key, &target, None),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::load::{HeldPrefix, Ticket};

    const KEY: &str = "0123456789abcdef";

    fn instance(slot: u16) -> InstanceRef {
        InstanceRef::new(slot, format!("10.0.0.{slot}:8000").into())
    }

    fn ticket(slot: u16) -> Ticket {
        Ticket {
            slot,
            addr_hash: 0,
            owner: 1,
        }
    }

    /// A scripted load view: fixed targets and loads, claims as configured.
    #[derive(Default)]
    struct Script {
        targets: HashMap<String, InstanceRef>,
        loads: HashMap<u16, u32>,
        contended: bool,
        /// Overflow candidates; the least loaded (per `loads`) is offered.
        others: Vec<InstanceRef>,
        /// A slot another worker claims just before our first claim there.
        raced: Option<u16>,
        /// A slot another worker claims just before each capped claim there.
        always_raced: Option<u16>,
        claims: Vec<(u16, Option<u32>)>,
        blind: Vec<String>,
        /// Engine-weighed load and whether it is over the fleet-wide bounds,
        /// per slot (absent: engine load off for it).
        engine: HashMap<u16, (u32, bool)>,
        /// Reads of the candidates.
        reads: usize,
    }

    impl Script {
        fn weighed(&self, instance: &InstanceRef) -> Candidate {
            let in_flight = self.loads.get(&instance.slot).copied().unwrap_or(0);
            let mut candidate = Candidate::local(instance.clone(), in_flight);
            if let Some(&(load, over)) = self.engine.get(&instance.slot) {
                candidate.load = load;
                candidate.over_bounds = over;
            }
            candidate
        }
    }

    impl Script {
        fn target(&self, key: &str) -> Option<Target> {
            self.targets.get(key).map(|instance| Target {
                instance: instance.clone(),
            })
        }
    }

    impl LoadView for Script {
        fn target_of(&mut self, key: &str, _now_ms: u64) -> Option<Target> {
            self.target(key)
        }
        fn route_blind(&mut self, key: &str, _now_ms: u64) -> Option<Target> {
            self.blind.push(key.to_string());
            self.target(key)
        }
        fn claim(
            &mut self,
            instance: &InstanceRef,
            _key: Option<&str>,
            cap: Option<u32>,
            _now_ms: u64,
        ) -> Claim {
            self.claims.push((instance.slot, cap));
            if self.contended {
                return Claim::Contended;
            }
            let raced = self.raced.take_if(|slot| *slot == instance.slot).is_some()
                || (cap.is_some() && self.always_raced == Some(instance.slot));
            if raced {
                *self.loads.entry(instance.slot).or_insert(0) += 1;
            }
            let load = self.loads.entry(instance.slot).or_insert(0);
            match cap {
                Some(cap) if *load >= cap => Claim::Full { in_flight: *load },
                _ => {
                    *load += 1;
                    Claim::Claimed(ticket(instance.slot))
                }
            }
        }
        /// The instances it knows: targets (salted or not) and `others`.
        fn candidates(&mut self, _now_ms: u64) -> Vec<Candidate> {
            self.reads += 1;
            let mut known: Vec<InstanceRef> = self.targets.values().cloned().collect();
            known.extend(self.others.iter().cloned());
            known.sort_by_key(|i| i.slot);
            known.dedup();
            known.iter().map(|i| self.weighed(i)).collect()
        }
        fn longest_held(&mut self, _: &[u64], _: &[Candidate], _: u64) -> HeldPrefix {
            unreachable!("a key's policy reads no prefix index")
        }
        fn remember_held(
            &mut self,
            _: &[u64],
            _: usize,
            _: &InstanceRef,
            _: &[Candidate],
            _: u64,
        ) -> Option<u32> {
            unreachable!("a key's policy records nothing in the prefix index")
        }
    }

    fn weighing(policy: PrefixAware) -> PrefixAware {
        PrefixAware {
            engine_load: true,
            ..policy
        }
    }

    fn script_with_full_target(load: u32) -> Script {
        let mut script = Script::default();
        script.targets.insert(KEY.to_string(), instance(1));
        script.loads.insert(1, load);
        script
    }

    /// The target (instance 1) with `in_flight` here and one other
    /// (instance 2), each with its engine's (load, over the bounds).
    fn script_weighed(in_flight: u32, target: (u32, bool), other: (u32, bool)) -> Script {
        let mut script = script_with_full_target(in_flight);
        script.engine.insert(1, target);
        script.others = vec![instance(2)];
        script.engine.insert(2, other);
        script
    }

    #[test]
    fn salted_keys_are_hex_keys_that_differ_per_salt_and_key() {
        let one = salted_key(KEY, 1);
        assert_eq!(one.len(), 16);
        assert!(one
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(one, salted_key(KEY, 1));
        assert_ne!(one, salted_key(KEY, 2));
        assert_ne!(one, salted_key("fedcba9876543210", 1));
        assert_ne!(one, KEY);
    }

    #[test]
    fn known_target_under_the_cap_is_claimed_with_the_cap() {
        let mut script = script_with_full_target(2);
        let routed = PrefixAware::new(3, true).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.kind, DecisionKind::Prefix);
        assert_eq!(
            routed.headers.counted,
            Some(instance(1).address.to_string())
        );
        assert_eq!(routed.ticket, Some(ticket(1)));
        assert_eq!(script.claims, vec![(1, Some(3))]);
    }

    #[test]
    fn full_target_overflows_to_a_less_busy_instance_with_the_host_header() {
        let mut script = script_with_full_target(3);
        script.others = vec![instance(2)];
        script.loads.insert(2, 1);
        let routed = PrefixAware::new(3, true).decide(Some(KEY), &mut script, 0, 0);
        let d = &routed.headers;
        assert_eq!(d.kind, DecisionKind::Overflow);
        assert_eq!(d.host_override, Some(instance(2).address.to_string()));
        assert_eq!(d.counted, Some(instance(2).address.to_string()));
        assert_eq!(
            d.key.as_deref(),
            Some(KEY),
            "the key stays for Maglev's fallback"
        );
        assert_eq!(routed.ticket, Some(ticket(2)));
    }

    #[test]
    fn a_target_over_the_fleet_wide_bound_overflows_before_this_envoys_cap() {
        // One request of this Envoy in flight (cap 3), but the engine
        // reports the target at its fleet-wide bound.
        let mut script = script_with_full_target(1);
        script.engine.insert(1, (8, true));
        script.others = vec![instance(2), instance(3)];
        script.engine.insert(2, (5, false));
        script.engine.insert(3, (2, false));
        let routed = weighing(PrefixAware::new(3, true)).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.kind, DecisionKind::Overflow);
        assert_eq!(
            routed.headers.host_override,
            Some(instance(3).address.to_string())
        );
        assert_eq!(routed.ticket, Some(ticket(3)));
        assert_eq!(
            script.claims,
            vec![(3, Some(1))],
            "the target is not claimed; the other only if its count is unchanged"
        );
    }

    #[test]
    fn a_target_over_the_bound_stays_when_every_other_is_over_it_and_busier() {
        let mut script = script_weighed(1, (8, true), (9, true));
        let routed = weighing(PrefixAware::new(3, true)).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.kind, DecisionKind::Prefix);
        assert_eq!(routed.headers.host_override, None);
        assert_eq!(routed.ticket, Some(ticket(1)));
        // Over the bound but less loaded than the target: moved there.
        script.engine.insert(2, (7, true));
        let routed = weighing(PrefixAware::new(3, true)).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.kind, DecisionKind::Overflow);
        assert_eq!(
            routed.headers.host_override,
            Some(instance(2).address.to_string())
        );
    }

    #[test]
    fn at_this_envoys_cap_the_overflow_compares_engine_loads() {
        // At the cap here; the engine counts the target's load as 4 and
        // the other's as 6 (other proxies'): staying is better.
        let mut script = script_weighed(3, (4, false), (6, false));
        let routed = weighing(PrefixAware::new(3, true)).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.kind, DecisionKind::Prefix);
        assert_eq!(routed.headers.host_override, None);
    }

    #[test]
    fn with_engine_load_a_full_targets_overflow_claims_from_the_read_that_weighed_it() {
        let mut script = script_weighed(3, (3, false), (1, false));
        script.loads.insert(2, 1);
        let routed = weighing(PrefixAware::new(3, true)).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.kind, DecisionKind::Overflow);
        assert_eq!(routed.ticket, Some(ticket(2)));
        assert_eq!(script.claims, vec![(1, Some(3)), (2, Some(2))]);
        assert_eq!(
            script.reads, 1,
            "one read weighs the target and picks the other"
        );
    }

    #[test]
    fn overflow_claims_the_least_busy_only_if_no_other_worker_took_it_meanwhile() {
        let mut script = script_with_full_target(3);
        script.others = vec![instance(2), instance(3)];
        // Two idle others; a decision whose random number ranks 2 first.
        let idle = [instance(2), instance(3)].map(|i| Candidate::local(i, 0));
        let random = (0..)
            .find(|r| least_busy_other(&idle, &instance(1), *r).map(|c| c.instance.slot) == Some(2))
            .expect("some random number ranks instance 2 first");
        // Another worker claims instance 2 between our read and our claim.
        script.raced = Some(2);
        let routed = PrefixAware::new(3, true).decide(Some(KEY), &mut script, random, 0);
        assert_eq!(routed.headers.kind, DecisionKind::Overflow);
        assert_eq!(
            routed.headers.host_override,
            Some(instance(3).address.to_string())
        );
        assert_eq!(
            routed.headers.counted,
            Some(instance(3).address.to_string())
        );
        assert_eq!(routed.ticket, Some(ticket(3)));
        assert_eq!(
            script.claims,
            vec![(1, Some(3)), (2, Some(1)), (3, Some(1))],
            "target, then instance 2 refused (now 1 in flight), then instance 3"
        );
    }

    #[test]
    fn overflow_claims_regardless_after_repeated_races() {
        let mut script = script_with_full_target(10);
        script.others = vec![instance(2)];
        // Every capped claim on instance 2 finds it one fuller than just read.
        script.always_raced = Some(2);
        let routed = PrefixAware::new(10, true).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.kind, DecisionKind::Overflow);
        assert_eq!(routed.ticket, Some(ticket(2)));
        assert_eq!(
            script.claims,
            vec![
                (1, Some(10)),
                (2, Some(1)),
                (2, Some(2)),
                (2, Some(3)),
                (2, None)
            ],
            "three refused capped claims, then the last attempt claims uncapped"
        );
    }

    #[test]
    fn overflow_goes_to_the_least_busy_other_within_the_bounds_ties_by_the_random_number() {
        let weighed = |slot: u16, load: u32, over_bounds: bool| Candidate {
            load,
            over_bounds,
            ..Candidate::local(instance(slot), 0)
        };
        let target = instance(1);
        let all = [
            weighed(1, 0, false),
            weighed(2, 4, false),
            weighed(3, 1, true),
        ];
        let pick = |all: &[Candidate], random| {
            least_busy_other(all, &target, random).map(|c| c.instance.slot)
        };
        assert_eq!(pick(&all, 0), Some(2), "within the bounds, though busier");
        assert_eq!(pick(&all[..1], 0), None, "the target alone");
        let tied: Vec<Candidate> = (1..=6).map(|slot| weighed(slot, 2, false)).collect();
        let picked: std::collections::BTreeSet<u16> =
            (0..64).filter_map(|random| pick(&tied, random)).collect();
        assert!(picked.len() >= 3, "ties spread: {picked:?}");
        assert!(!picked.contains(&1));
    }

    #[test]
    fn stays_on_the_target_when_every_other_instance_is_as_busy() {
        let mut script = script_with_full_target(3);
        script.others = vec![instance(2)];
        script.loads.insert(2, 3);
        let routed = PrefixAware::new(3, true).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.kind, DecisionKind::Prefix);
        assert_eq!(routed.headers.host_override, None);
        assert_eq!(routed.ticket, Some(ticket(1)));
        assert_eq!(script.claims.last(), Some(&(1, None)));
    }

    #[test]
    fn contention_or_a_vanished_target_routes_uncounted_to_maglev() {
        let mut script = script_with_full_target(0);
        script.contended = true;
        let routed = PrefixAware::new(3, true).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.kind, DecisionKind::Prefix);
        assert_eq!(
            routed.headers.counted, None,
            "the upstream filter will count it"
        );
        assert_eq!(routed.ticket, None);
    }

    #[test]
    fn an_unknown_target_is_left_to_maglev_marked_pending() {
        let mut script = Script::default();
        let routed = PrefixAware::new(3, true).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.kind, DecisionKind::Prefix);
        assert_eq!(routed.headers.key.as_deref(), Some(KEY));
        assert_eq!(routed.headers.counted.as_deref(), Some(PENDING_MARK));
        assert_eq!(routed.ticket, None);
        assert_eq!(script.blind, vec![KEY.to_string()]);
        assert!(script.claims.is_empty());
    }

    #[test]
    fn salted_overflow_prefers_a_known_salt_under_the_cap_to_exploring() {
        let mut script = script_with_full_target(3);
        // Salt 1 maps to the target, salt 2 is unknown, salt 3 is known and idle.
        script.targets.insert(salted_key(KEY, 1), instance(1));
        script.targets.insert(salted_key(KEY, 3), instance(5));
        let routed = PrefixAware::new(3, false).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.kind, DecisionKind::Overflow);
        assert_eq!(routed.headers.key, Some(salted_key(KEY, 3)));
        assert_eq!(routed.headers.host_override, None);
        assert_eq!(
            routed.headers.counted,
            Some(instance(5).address.to_string())
        );
    }

    #[test]
    fn salted_overflow_claims_a_known_salt_under_the_cap() {
        let mut script = script_with_full_target(3);
        script.targets.insert(salted_key(KEY, 1), instance(5));
        script.loads.insert(5, 2);
        let routed = PrefixAware::new(3, false).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.key, Some(salted_key(KEY, 1)));
        assert_eq!(routed.ticket, Some(ticket(5)));
        assert_eq!(script.claims, vec![(1, Some(3)), (5, Some(3))]);
        // Another worker takes the salt's last slot between the read and the
        // claim: the cap holds, and the next unknown salt is explored.
        let mut script = script_with_full_target(3);
        script.targets.insert(salted_key(KEY, 1), instance(5));
        script.loads.insert(5, 2);
        script.raced = Some(5);
        let routed = PrefixAware::new(3, false).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(script.loads.get(&5), Some(&3), "the cap held");
        assert_eq!(routed.headers.key, Some(salted_key(KEY, 2)));
        assert_eq!(routed.ticket, None);
    }

    #[test]
    fn with_engine_load_a_salted_overflow_compares_loads_from_the_read_that_weighed_the_target() {
        let mut script = script_with_full_target(3);
        script.engine.insert(1, (3, false));
        script.targets.insert(salted_key(KEY, 1), instance(5));
        script.loads.insert(5, 1);
        let routed = weighing(PrefixAware::new(3, false)).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.key, Some(salted_key(KEY, 1)));
        assert_eq!(routed.ticket, Some(ticket(5)));
        assert_eq!(
            script.reads, 1,
            "one read weighs the target and the salts' instances"
        );
    }

    #[test]
    fn salted_overflow_explores_when_known_salts_are_busy() {
        let mut script = script_with_full_target(3);
        script.targets.insert(salted_key(KEY, 1), instance(5));
        script.loads.insert(5, 3);
        let routed = PrefixAware::new(3, false).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.key, Some(salted_key(KEY, 2)));
        assert_eq!(
            routed.headers.counted, None,
            "unknown instance: upstream counts"
        );
        assert_eq!(routed.ticket, None);
    }

    #[test]
    fn when_every_salt_maps_to_the_target_the_request_stays() {
        let mut script = script_with_full_target(3);
        for salt in 1..=DEFAULT_MAX_SALTS {
            script.targets.insert(salted_key(KEY, salt), instance(1));
        }
        let routed = PrefixAware::new(3, false).decide(Some(KEY), &mut script, 0, 0);
        assert_eq!(routed.headers.kind, DecisionKind::Prefix);
        assert_eq!(routed.headers.key.as_deref(), Some(KEY));
    }

    #[test]
    fn no_key_sets_nothing() {
        let mut script = Script::default();
        let routed = PrefixAware::new(3, true).decide(None, &mut script, 0, 0);
        assert_eq!(routed.headers, RouteHeaders::bare(DecisionKind::NoKey));
        assert_eq!(routed.ticket, None);
    }

    #[test]
    fn threshold_zero_is_treated_as_one() {
        assert_eq!(PrefixAware::new(0, true).concurrency_threshold, 1);
    }
}
