//! Tests of the load tables through the tracker's public surface, with two (or
//! more) simulated worker VMs sharing one in-memory store.

use std::cell::Cell;
use std::rc::Rc;

use super::table::Record;
use super::*;
use crate::headers::PENDING_MARK;
use crate::shared::{MemoryStore, SetError, SharedStore};

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";
const C: &str = "10.0.0.3:8000";

fn config() -> LoadConfig {
    LoadConfig {
        vm_lease_ms: 1_000,
        instance_ttl_ms: 5_000,
        route_ttl_ms: 60_000,
        ..LoadConfig::default()
    }
}

fn worker(store: &Rc<MemoryStore>, nonce: u64) -> LoadTracker<Rc<MemoryStore>> {
    let mut tracker = LoadTracker::new(Rc::clone(store), config(), nonce);
    tracker.tick(0);
    tracker
}

fn start<'a>(address: &'a str, key: Option<&'a str>) -> UpstreamStart<'a> {
    UpstreamStart {
        address,
        key,
        overridden: false,
        counted: None,
    }
}

/// A request that starts and completes at `now`.
fn serve<S: SharedStore>(tracker: &mut LoadTracker<S>, start: UpstreamStart<'_>, now: u64) {
    if let Some(ticket) = tracker.upstream_started(start, now) {
        tracker.release(ticket, now);
    }
}

fn load_of(tracker: &mut LoadTracker<Rc<MemoryStore>>, address: &str, now: u64) -> u32 {
    tracker
        .snapshot(now)
        .into_iter()
        .find(|l| l.address == address)
        .map_or(0, |l| l.in_flight)
}

/// The addresses of `tracker`'s candidates at `now`, sorted.
fn candidate_addresses(tracker: &mut LoadTracker<Rc<MemoryStore>>, now: u64) -> Vec<String> {
    let mut all: Vec<String> = tracker
        .candidates(now)
        .into_iter()
        .map(|c| c.instance.address.to_string())
        .collect();
    all.sort();
    all
}

/// Where a full target's key would overflow, from the candidates `w` reads.
fn least_busy_other<S: SharedStore>(
    w: &mut LoadTracker<S>,
    target: &InstanceRef,
    random: u64,
    now: u64,
) -> Option<Candidate> {
    crate::strategy::least_busy_other(&w.candidates(now), target, random).cloned()
}

fn instance(tracker: &mut LoadTracker<Rc<MemoryStore>>, key: &str, now: u64) -> InstanceRef {
    tracker
        .target_of(key, now)
        .expect("target learned")
        .instance
}

#[test]
fn two_workers_take_different_columns() {
    let store = Rc::new(MemoryStore::new());
    let (w1, w2) = (worker(&store, 1), worker(&store, 2));
    assert!(w1.column().is_some());
    assert!(w2.column().is_some());
    assert_ne!(w1.column(), w2.column());
}

#[test]
fn counts_from_two_workers_add_up_and_release_to_zero() {
    let store = Rc::new(MemoryStore::new());
    let (mut w1, mut w2) = (worker(&store, 1), worker(&store, 2));
    let t1 = w1
        .upstream_started(start(A, Some("k")), 10)
        .expect("counted");
    let t2 = w2
        .upstream_started(start(A, Some("k")), 11)
        .expect("counted");
    let t3 = w2.upstream_started(start(B, None), 12).expect("counted");
    assert_eq!(load_of(&mut w1, A, 12), 2);
    assert_eq!(load_of(&mut w2, A, 12), 2);
    assert_eq!(load_of(&mut w1, B, 12), 1);
    w1.release(t1, 13);
    assert_eq!(load_of(&mut w2, A, 13), 1);
    w2.release(t2, 14);
    w2.release(t3, 14);
    assert_eq!(load_of(&mut w1, A, 14), 0);
    assert_eq!(load_of(&mut w1, B, 14), 0);
    assert_eq!(w1.local_in_flight() + w2.local_in_flight(), 0);
}

#[test]
fn the_tick_returns_the_snapshot_from_its_own_scan() {
    let store = Rc::new(MemoryStore::new());
    let (mut w1, mut w2) = (worker(&store, 1), worker(&store, 2));
    let t1 = w1.upstream_started(start(A, None), 10).expect("counted");
    let t2 = w2.upstream_started(start(A, None), 10).expect("counted");
    let t3 = w2.upstream_started(start(B, None), 10).expect("counted");
    serve(&mut w2, start(C, None), 10);
    let sorted = |mut loads: Vec<InstanceLoad>| {
        loads.sort_by(|x, y| x.address.cmp(&y.address));
        loads
            .into_iter()
            .map(|l| (l.address, l.in_flight, l.fresh))
            .collect::<Vec<_>>()
    };
    let expected = vec![
        (A.to_string(), 2, true),
        (B.to_string(), 1, true),
        (C.to_string(), 0, true),
    ];
    assert_eq!(sorted(w1.snapshot(20)), expected);
    let reads = store.reads();
    assert_eq!(sorted(w1.tick(20)), expected);
    let tick_reads = store.reads() - reads;
    // Past the instance TTL, forgotten instances are not fresh, in both.
    let later = config().instance_ttl_ms + 100;
    assert_eq!(sorted(w1.tick(later)), sorted(w1.snapshot(later)));
    assert!(w1.tick(later).iter().all(|l| !l.fresh));
    // One read per slot, not two: the tick reads no more for its loads
    // than the scan it already made (every slot, the epoch, the leases).
    let slots = u64::from(config().max_instances);
    assert!(
        tick_reads < 2 * slots,
        "{tick_reads} reads for {slots} slots"
    );
    w1.release(t1, later);
    w2.release(t2, later);
    w2.release(t3, later);
}

#[test]
fn a_request_counted_by_the_decision_is_not_counted_again() {
    let store = Rc::new(MemoryStore::new());
    let mut w = worker(&store, 1);
    let first = w.upstream_started(start(A, Some("k")), 10);
    let target = instance(&mut w, "k", 10);
    let claimed = match w.claim(&target, None, Some(5), 11) {
        Claim::Claimed(ticket) => ticket,
        other => panic!("expected a claim, got {other:?}"),
    };
    let again = w.upstream_started(
        UpstreamStart {
            counted: Some(A),
            ..start(A, Some("k"))
        },
        11,
    );
    assert_eq!(again, None);
    assert_eq!(load_of(&mut w, A, 11), 2);
    w.release(claimed, 12);
    w.release(first.expect("counted"), 12);
    assert_eq!(load_of(&mut w, A, 12), 0);
}

#[test]
fn counted_elsewhere_still_counts_where_it_really_went() {
    let store = Rc::new(MemoryStore::new());
    let mut w = worker(&store, 1);
    serve(&mut w, start(A, None), 1);
    let ticket = w.upstream_started(
        UpstreamStart {
            counted: Some(A),
            ..start(B, Some("k"))
        },
        2,
    );
    assert!(ticket.is_some(), "served by B although counted on A");
    assert_eq!(load_of(&mut w, B, 2), 1);
}

#[test]
fn claim_with_cap_stops_at_the_cap_across_workers() {
    let store = Rc::new(MemoryStore::new());
    let (mut w1, mut w2) = (worker(&store, 1), worker(&store, 2));
    serve(&mut w1, start(A, Some("k")), 1);
    let target = instance(&mut w1, "k", 2);
    let mut tickets = Vec::new();
    let mut full = 0;
    for i in 0..10 {
        let w = if i % 2 == 0 { &mut w1 } else { &mut w2 };
        match w.claim(&target, None, Some(3), 3) {
            Claim::Claimed(t) => tickets.push((i % 2, t)),
            Claim::Full { in_flight } => {
                assert_eq!(in_flight, 3);
                full += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(tickets.len(), 3);
    assert_eq!(full, 7);
    for (owner, t) in tickets {
        if owner == 0 {
            w1.release(t, 4)
        } else {
            w2.release(t, 4)
        }
    }
    assert!(matches!(
        w2.claim(&target, None, Some(3), 5),
        Claim::Claimed(_)
    ));
}

#[test]
fn learning_only_from_maglev_choices() {
    let store = Rc::new(MemoryStore::new());
    let mut w = worker(&store, 1);
    let overridden = UpstreamStart {
        overridden: true,
        ..start(B, Some("k"))
    };
    serve(&mut w, overridden, 1);
    assert_eq!(
        w.target_of("k", 1),
        None,
        "an overridden request teaches nothing"
    );
    serve(&mut w, start(A, Some("k")), 2);
    assert_eq!(
        w.target_of("k", 2).map(|t| t.instance.address.to_string()),
        Some(A.to_string())
    );
    serve(&mut w, start(C, Some("k")), 3);
    assert_eq!(
        w.target_of("k", 3).map(|t| t.instance.address.to_string()),
        Some(C.to_string()),
        "a key that moved (fleet change) is relearned at once"
    );
}

#[test]
fn learned_targets_expire_and_forgotten_instances_are_not_targets() {
    let store = Rc::new(MemoryStore::new());
    let mut w = worker(&store, 1);
    serve(&mut w, start(A, Some("k")), 0);
    assert!(w.target_of("k", 5_000).is_some());
    assert_eq!(
        w.target_of("k", 5_001),
        None,
        "instance unseen for instance_ttl"
    );
    serve(&mut w, start(A, Some("other")), 5_002);
    assert!(w.target_of("k", 5_002).is_some(), "seen again: known again");
    assert_eq!(w.target_of("k", 60_001), None, "route_ttl passed");
}

#[test]
fn least_busy_other_picks_the_emptiest_fresh_instance() {
    let store = Rc::new(MemoryStore::new());
    let (mut w1, mut w2) = (worker(&store, 1), worker(&store, 2));
    for addr in [A, B, C] {
        serve(&mut w1, start(addr, Some(addr)), 1);
    }
    let target = instance(&mut w1, A, 1);
    let _b1 = w2.upstream_started(start(B, None), 2);
    let _b2 = w2.upstream_started(start(B, None), 2);
    let _c1 = w1.upstream_started(start(C, None), 2);
    // w2 learns the instances w1 registered without waiting for a tick.
    let other = least_busy_other(&mut w2, &target, 0, 3).expect("a candidate");
    assert_eq!((&*other.instance.address, other.in_flight), (C, 1));
    assert_eq!(
        other.load, other.in_flight,
        "no engine load: the local count"
    );
    // C unseen for instance_ttl while B was just seen: B is the only candidate.
    serve(&mut w1, start(B, None), 5_002);
    let other = least_busy_other(&mut w1, &target, 0, 5_003).expect("a candidate");
    assert_eq!(&*other.instance.address, B);
}

#[test]
fn a_nominated_host_envoy_did_not_use_stops_being_a_candidate() {
    let store = Rc::new(MemoryStore::new());
    let mut w = worker(&store, 1);
    for addr in [A, B] {
        serve(&mut w, start(addr, Some(addr)), 1);
    }
    let target = instance(&mut w, A, 1);
    assert_eq!(
        least_busy_other(&mut w, &target, 0, 2).map(|c| c.instance.address.to_string()),
        Some(B.into())
    );
    // The decision nominated B, but Envoy fell back to A: B is gone.
    let gone = UpstreamStart {
        address: A,
        key: Some(A),
        overridden: true,
        counted: Some(B),
    };
    serve(&mut w, gone, 3);
    assert_eq!(least_busy_other(&mut w, &target, 0, 4), None);
}

#[test]
fn a_crashed_vm_stops_counting_when_its_lease_expires() {
    let store = Rc::new(MemoryStore::new());
    let mut survivor = worker(&store, 2);
    {
        let mut doomed = worker(&store, 1);
        for _ in 0..3 {
            // Tickets lost with the VM: never released.
            let _leaked = doomed.upstream_started(start(A, Some("k")), 10);
        }
    }
    assert_eq!(load_of(&mut survivor, A, 900), 3, "still leased");
    survivor.tick(900);
    assert_eq!(
        load_of(&mut survivor, A, 1_001),
        0,
        "lease of the dead VM expired"
    );
    // A replacement VM takes the dead VM's column and starts from zero.
    let mut replacement = LoadTracker::new(Rc::clone(&store), config(), 3);
    replacement.tick(1_100);
    assert!(replacement.column().is_some());
    let t = replacement
        .upstream_started(start(A, Some("k")), 1_100)
        .expect("counted");
    assert_eq!(load_of(&mut survivor, A, 1_100), 1);
    replacement.release(t, 1_101);
    assert_eq!(load_of(&mut survivor, A, 1_101), 0);
}

#[test]
fn dead_cells_are_cleared_by_the_tick() {
    let store = Rc::new(MemoryStore::new());
    let mut survivor = worker(&store, 2);
    {
        let mut doomed = worker(&store, 1);
        let _leaked = doomed.upstream_started(start(A, None), 10);
    }
    let record_of_a = || {
        store
            .keys()
            .iter()
            .filter(|k| k.contains("/inst/"))
            .filter_map(|k| store.get(k).0)
            .filter_map(|v| instances::InstanceRecord::decode(&v))
            .find(|r| r.address == A)
            .expect("A registered")
    };
    assert!(record_of_a().cells.iter().any(|c| c.count == 1));
    survivor.tick(2_000);
    assert!(
        record_of_a().cells.iter().all(|c| c.count == 0),
        "{:?}",
        record_of_a()
    );
    assert_eq!(load_of(&mut survivor, A, 2_000), 0);
}

#[test]
fn a_vm_that_lost_its_lease_moves_its_counts_to_a_new_column() {
    let store = Rc::new(MemoryStore::new());
    let mut slow = worker(&store, 1);
    let ticket = slow.upstream_started(start(A, None), 0).expect("counted");
    // `slow` misses its heartbeats; another VM takes its column.
    let mut other = LoadTracker::new(Rc::clone(&store), config(), 2);
    other.tick(1_500);
    assert_eq!(other.column(), Some(0), "expired column reused");
    assert_eq!(load_of(&mut other, A, 1_500), 0);
    slow.tick(1_600);
    assert!(slow.column().is_some());
    assert_ne!(slow.column(), Some(0));
    assert_eq!(
        load_of(&mut other, A, 1_600),
        1,
        "republished in the new column"
    );
    slow.release(ticket, 1_700);
    assert_eq!(load_of(&mut other, A, 1_700), 0);
}

/// A store that answers `CasMismatch` to the next `failures` conditional writes
/// (as if another worker had written in between).
struct Contended {
    inner: MemoryStore,
    failures: Cell<u32>,
}

impl SharedStore for Contended {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.inner.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        if cas.is_some() && self.failures.get() > 0 {
            self.failures.set(self.failures.get() - 1);
            return Err(SetError::CasMismatch);
        }
        self.inner.set(key, value, cas)
    }
}

#[test]
fn cas_retries_are_bounded_and_a_lost_release_is_repaired_by_the_tick() {
    let store = Contended {
        inner: MemoryStore::new(),
        failures: Cell::new(0),
    };
    let mut w = LoadTracker::new(&store, config(), 1);
    w.tick(0);
    let ticket = w.upstream_started(start(A, Some("k")), 1).expect("counted");
    let target = w.target_of("k", 1).expect("learned").instance;
    // Contention beyond the bound: a capped claim gives up instead of spinning.
    store.failures.set(1_000);
    assert_eq!(w.claim(&target, None, Some(5), 2), Claim::Contended);
    assert!(store.failures.get() >= 1_000 - config().cas_attempts);
    // A release under contention still takes effect locally at once...
    store.failures.set(1_000);
    w.release(ticket, 3);
    assert_eq!(w.local_in_flight(), 0);
    assert_eq!(w.in_flight(&target, 3), Some(0));
    // ...and the shared copy is corrected by the next tick.
    store.failures.set(0);
    w.tick(4);
    let mut reader = LoadTracker::new(&store, config(), 9);
    reader.tick(5);
    assert_eq!(reader.in_flight(&target, 5), Some(0));
}

#[test]
fn an_unconditional_count_under_contention_is_published_by_the_tick() {
    let store = Contended {
        inner: MemoryStore::new(),
        failures: Cell::new(0),
    };
    let mut w = LoadTracker::new(&store, config(), 1);
    w.tick(0);
    serve(&mut w, start(A, Some("k")), 1);
    store.failures.set(1_000);
    let ticket = w
        .upstream_started(start(A, Some("k")), 2)
        .expect("counted locally");
    store.failures.set(0);
    let mut reader = LoadTracker::new(&store, config(), 9);
    reader.tick(3);
    let target = reader.target_of("k", 3).expect("learned").instance;
    assert_eq!(reader.in_flight(&target, 3), Some(0), "not yet published");
    w.tick(4);
    assert_eq!(reader.in_flight(&target, 4), Some(1));
    w.release(ticket, 5);
    assert_eq!(reader.in_flight(&target, 5), Some(0));
}

#[test]
fn a_ticket_is_only_honoured_by_the_vm_that_issued_it() {
    let store = Rc::new(MemoryStore::new());
    let (mut w1, mut w2) = (worker(&store, 1), worker(&store, 2));
    let t = w1.upstream_started(start(A, None), 1).expect("counted");
    w2.release(t, 2);
    assert_eq!(load_of(&mut w1, A, 2), 1);
}

#[test]
fn every_table_is_bounded() {
    let store = Rc::new(MemoryStore::new());
    let small = LoadConfig {
        max_instances: 16,
        vm_slots: 4,
        route_buckets: 32,
        ..config()
    };
    let mut workers: Vec<_> = (1..=6)
        .map(|n| {
            let mut w = LoadTracker::new(Rc::clone(&store), small.clone(), n);
            w.tick(0);
            w
        })
        .collect();
    for i in 0..2_000u32 {
        let addr = format!("10.1.{}.{}:8000", i / 250, i % 250);
        let key = format!("{i:016x}");
        let w = &mut workers[i as usize % 6];
        let _ = w.route_blind(&key, u64::from(i));
        if let Some(t) = w.upstream_started(start(&addr, Some(&key)), u64::from(i)) {
            w.release(t, u64::from(i));
        }
    }
    let keys = store.keys();
    let count = |part: &str| keys.iter().filter(|k| k.contains(part)).count();
    assert!(count("/inst/") <= 16, "{}", count("/inst/"));
    assert!(count("/vm/") <= 4);
    assert!(count("/route/") <= 32);
    assert_eq!(count("/epoch"), 1);
    assert!(count("/pend/") <= 32);
    assert_eq!(
        keys.len(),
        count("/inst/") + count("/vm/") + count("/route/") + count("/pend/") + count("/epoch"),
        "no other keys: {keys:?}"
    );
    // Two VMs found no column: their counts stay local but still work.
    assert_eq!(workers.iter().filter(|w| w.column().is_none()).count(), 2);
}

#[test]
fn namespaces_do_not_see_each_other() {
    let store = Rc::new(MemoryStore::new());
    let mut one = LoadTracker::new(
        Rc::clone(&store),
        LoadConfig {
            namespace: "a".into(),
            ..config()
        },
        1,
    );
    let mut two = LoadTracker::new(
        Rc::clone(&store),
        LoadConfig {
            namespace: "b".into(),
            ..config()
        },
        2,
    );
    let _t = one.upstream_started(start(A, Some("k")), 1);
    assert_eq!(two.target_of("k", 1), None);
    assert!(two.snapshot(1).is_empty());
    assert!(store
        .keys()
        .iter()
        .all(|k| k.starts_with("prefix-router/a/v3/") || k.starts_with("prefix-router/b/v3/")));
}

#[test]
fn garbage_in_every_shared_value_breaks_nothing() {
    let store = Rc::new(MemoryStore::new());
    let mut w = worker(&store, 1);
    serve(&mut w, start(A, Some("k")), 1);
    let mut seed = 0x1234_5678_u64;
    for key in store.keys() {
        for _ in 0..3 {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            let len = (seed >> 59) as usize;
            let junk: Vec<u8> = (0..len).map(|i| (seed >> (i % 8)) as u8).collect();
            store.set(&key, &junk, None).unwrap();
            let _ = w.target_of("k", 2);
            let _ = w.snapshot(2);
            w.tick(3);
            if let Some(t) = w.upstream_started(start(A, Some("k")), 4) {
                w.release(t, 5);
            }
        }
    }
    assert_eq!(load_of(&mut w, A, 6), 0);
}

#[test]
fn oversized_or_empty_addresses_are_not_tracked() {
    let store = Rc::new(MemoryStore::new());
    let mut w = worker(&store, 1);
    assert_eq!(w.upstream_started(start("", None), 1), None);
    let long = "x".repeat(300);
    assert_eq!(w.upstream_started(start(&long, None), 1), None);
    assert!(w.snapshot(1).is_empty());
}

/// A worker whose registry has one slot, ticked at 0.
fn one_slot_worker() -> LoadTracker<Rc<MemoryStore>> {
    let tiny = LoadConfig {
        max_instances: 1,
        ..config()
    };
    let mut w = LoadTracker::new(Rc::new(MemoryStore::new()), tiny, 1);
    w.tick(0);
    w
}

#[test]
fn a_forgotten_idle_instance_gives_its_slot_to_a_new_one() {
    let mut w = one_slot_worker();
    let busy = w.upstream_started(start(A, None), 0).expect("counted");
    assert_eq!(
        w.upstream_started(start(B, None), 10_000),
        None,
        "A busy: no reuse"
    );
    w.release(busy, 10_001);
    let t = w
        .upstream_started(start(B, None), 10_002)
        .expect("A idle and stale: reused");
    let snapshot = w.snapshot(10_002);
    assert_eq!(snapshot.len(), 1);
    assert_eq!((&*snapshot[0].address, snapshot[0].in_flight), (B, 1));
    w.release(t, 10_003);
}

fn blind<'a>(address: &'a str, key: &'a str) -> UpstreamStart<'a> {
    UpstreamStart {
        counted: Some(PENDING_MARK),
        ..start(address, Some(key))
    }
}

#[test]
fn a_blind_request_counts_against_the_cap_until_its_upstream_filter_takes_over() {
    let store = Rc::new(MemoryStore::new());
    let (mut w1, mut w2) = (worker(&store, 1), worker(&store, 2));
    // Both workers route a first request of "k" before anyone knows its target.
    assert_eq!(w2.route_blind("k", 1), None);
    assert_eq!(w1.route_blind("k", 1), None);
    let t1 = w1.upstream_started(blind(A, "k"), 1).expect("counted");
    // w1 now knows the target; w2's request is still on its way to it.
    let target = instance(&mut w1, "k", 2);
    let t2 = match w1.claim(&target, Some("k"), Some(3), 2) {
        Claim::Claimed(t) => t,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        w1.claim(&target, Some("k"), Some(3), 2),
        Claim::Full { in_flight: 3 },
        "1 counted + 1 claimed + 1 pending"
    );
    let t3 = w2.upstream_started(blind(A, "k"), 3).expect("counted");
    assert_eq!(
        w2.claim(&target, Some("k"), Some(3), 3),
        Claim::Full { in_flight: 3 },
        "taken over: counted once, no longer pending"
    );
    w1.release(t1, 4);
    w1.release(t2, 4);
    w2.release(t3, 4);
    assert!(matches!(
        w2.claim(&target, Some("k"), Some(1), 5),
        Claim::Claimed(_)
    ));
}

/// A store on which another worker acts once, right after the first read of
/// a key containing `part`: the reader then works from what it read before.
struct ActsAfterFirstRead<'a> {
    inner: Rc<MemoryStore>,
    part: &'static str,
    act: std::cell::RefCell<Option<Box<dyn FnOnce() + 'a>>>,
}

impl SharedStore for ActsAfterFirstRead<'_> {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        let read = self.inner.get(key);
        if key.contains(self.part) {
            if let Some(act) = self.act.borrow_mut().take() {
                act();
            }
        }
        read
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.inner.set(key, value, cas)
    }
}

#[test]
fn two_workers_marking_a_new_key_pending_at_once_keep_both_marks() {
    let store = Rc::new(MemoryStore::new());
    let w1 = Rc::new(std::cell::RefCell::new(worker(&store, 1)));
    let racer = Rc::clone(&w1);
    let racing = ActsAfterFirstRead {
        inner: Rc::clone(&store),
        part: "/pend/",
        act: std::cell::RefCell::new(Some(Box::new(move || {
            assert_eq!(racer.borrow_mut().route_blind("k", 1), None);
        }))),
    };
    let mut w2 = LoadTracker::new(&racing, config(), 2);
    w2.tick(0);
    // w2 reads the pending table as missing, w1 creates it with its mark,
    // then w2 creates it too: that must not wipe w1's mark.
    assert_eq!(w2.route_blind("k", 1), None);
    let mut w1 = w1.borrow_mut();
    let _counted = w1.upstream_started(blind(A, "k"), 2).expect("counted");
    let target = instance(&mut w1, "k", 2);
    assert_eq!(
        w1.claim(&target, Some("k"), Some(2), 2),
        Claim::Full { in_flight: 2 },
        "w1's request counted + w2's still pending"
    );
}

#[test]
fn route_blind_withdraws_its_mark_when_the_target_was_learned_meanwhile() {
    let store = Rc::new(MemoryStore::new());
    let (mut w1, mut w2) = (worker(&store, 1), worker(&store, 2));
    serve(&mut w1, start(A, Some("k")), 1);
    let target = w2.route_blind("k", 2).expect("learned by w1").instance;
    assert_eq!(&*target.address, A);
    assert!(
        matches!(w2.claim(&target, Some("k"), Some(1), 2), Claim::Claimed(_)),
        "no pending mark left behind"
    );
}

#[test]
fn a_lost_blind_request_stops_counting_after_the_pending_ttl() {
    let store = Rc::new(MemoryStore::new());
    let mut w = worker(&store, 1);
    assert_eq!(w.route_blind("k", 0), None); // the client leaves before upstream
    serve(&mut w, start(A, Some("k")), 1);
    let target = instance(&mut w, "k", 1);
    assert_eq!(
        w.claim(&target, Some("k"), Some(1), 2),
        Claim::Full { in_flight: 1 }
    );
    assert!(matches!(
        w.claim(&target, Some("k"), Some(1), config().pending_ttl_ms + 1),
        Claim::Claimed(_)
    ));
}

#[test]
fn a_response_check_is_due_once_a_second_per_key() {
    let store = Rc::new(MemoryStore::new());
    let mut w = worker(&store, 1);
    assert!(w.response_check_due("k", 5));
    assert!(!w.response_check_due("k", 6), "asked = checked");
    assert!(w.response_check_due("other", 6), "per key");
    assert!(!w.response_check_due("k", 5 + RESPONSE_CHECK_MS - 1));
    assert!(w.response_check_due("k", 5 + RESPONSE_CHECK_MS));
}

#[test]
fn a_new_instance_ttl_applies_to_the_kept_tables() {
    let store = Rc::new(MemoryStore::new());
    let mut w = worker(&store, 1);
    serve(&mut w, start(A, Some("k")), 0);
    assert!(w.target_of("k", 4_000).is_some());
    w.set_instance_ttl_ms(2_000);
    assert_eq!(w.config().instance_ttl_ms, 2_000);
    assert_eq!(
        w.target_of("k", 4_000),
        None,
        "unseen longer than the new ttl"
    );
    w.set_instance_ttl_ms(10_000);
    assert!(
        w.target_of("k", 4_000).is_some(),
        "the entry itself was kept"
    );
}

/// A VM keeps a copy of each learned route for a second: its own upstream
/// filter's news replaces the copy at once, another VM's news is seen within
/// the second, and an unlearned key is never cached as "unknown".
#[test]
fn route_copies_follow_own_news_at_once_and_other_vms_within_a_second() {
    let store = Rc::new(MemoryStore::new());
    let mut one = worker(&store, 1);
    let mut two = worker(&store, 2);
    assert_eq!(two.target_of("k", 100), None);
    serve(&mut one, start(A, Some("k")), 100);
    assert_eq!(
        &*instance(&mut two, "k", 100).address,
        A,
        "a miss is not remembered"
    );
    // The fleet changes: Maglev now sends the key to B.
    serve(&mut two, start(C, None), 200);
    serve(&mut one, start(B, Some("k")), 300);
    assert_eq!(
        &*instance(&mut one, "k", 300).address,
        B,
        "own news at once"
    );
    assert_eq!(
        &*instance(&mut two, "k", 400).address,
        A,
        "another VM's news may wait up to a second"
    );
    assert_eq!(&*instance(&mut two, "k", 1_100).address, B);
}

/// Learning the same route again within a second reads no route bucket:
/// the upstream filter's start reads the instance record once (for its
/// check and its count), and its release reads it once more.
#[test]
fn relearning_a_fresh_route_reads_only_the_instance_record() {
    let store = Rc::new(MemoryStore::new());
    let mut one = worker(&store, 1);
    serve(&mut one, start(A, Some("k")), 100);
    let reads = store.reads();
    serve(&mut one, start(A, Some("k")), 150);
    assert_eq!(
        store.reads() - reads,
        2,
        "start (record) and release (record)"
    );
}

/// `instances` listed in the configuration, as `Vm::with_tracker` passes
/// them on every call.
fn configured(
    store: &Rc<MemoryStore>,
    nonce: u64,
    fleet: &[String],
) -> LoadTracker<Rc<MemoryStore>> {
    let mut tracker = LoadTracker::new(Rc::clone(store), config(), nonce);
    tracker.set_configured_instances(&Rc::from(fleet));
    tracker
}

fn fleet(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("10.0.2.{i}:8000")).collect()
}

#[test]
fn a_list_applied_again_changes_nothing_and_another_list_takes_effect() {
    let store = Rc::new(MemoryStore::new());
    let two: Rc<[String]> = Rc::from(fleet(2));
    let mut w = LoadTracker::new(Rc::clone(&store), config(), 1);
    let listed = |w: &mut LoadTracker<Rc<MemoryStore>>, now| -> Vec<String> {
        let mut listed: Vec<String> = w
            .candidates(now)
            .into_iter()
            .filter(|c| c.listed)
            .map(|c| c.instance.address.to_string())
            .collect();
        listed.sort();
        listed
    };
    w.set_configured_instances(&two);
    assert_eq!(listed(&mut w, 1), fleet(2));
    // The same list, as the same Rc or as another with the same addresses.
    w.set_configured_instances(&two);
    w.set_configured_instances(&Rc::from(fleet(2)));
    assert_eq!(listed(&mut w, 2), fleet(2));
    // A longer list registers its new instance; a shorter one unlists it.
    w.set_configured_instances(&Rc::from(fleet(3)));
    assert_eq!(listed(&mut w, 3), fleet(3));
    w.set_configured_instances(&two);
    assert_eq!(listed(&mut w, 4), fleet(2));
}

#[test]
fn configured_instances_are_overflow_candidates_before_any_traffic() {
    let store = Rc::new(MemoryStore::new());
    let fleet = fleet(7);
    let mut w = configured(&store, 1, &fleet);
    // Only the target has served (it is how a key's target is learned).
    serve(&mut w, start(&fleet[0], Some("k")), 1);
    let target = instance(&mut w, "k", 1);
    let picked: std::collections::BTreeSet<String> = (0..64)
        .filter_map(|r| {
            least_busy_other(&mut w, &target, r, 2).map(|c| c.instance.address.to_string())
        })
        .collect();
    let others: std::collections::BTreeSet<String> = fleet[1..].iter().cloned().collect();
    assert_eq!(picked, others, "every configured instance but the target");
    // Another VM of the same Envoy, configured alike, knows them too.
    let mut w2 = configured(&store, 2, &fleet);
    assert!(least_busy_other(&mut w2, &target, 0, 3).is_some());
    // Without the list, nothing but the target is known.
    let store = Rc::new(MemoryStore::new());
    let mut bare = worker(&store, 1);
    serve(&mut bare, start(&fleet[0], Some("k")), 1);
    let target = instance(&mut bare, "k", 1);
    assert_eq!(least_busy_other(&mut bare, &target, 0, 2), None);
}

#[test]
fn a_configured_instance_is_never_forgotten_a_learned_one_is() {
    let store = Rc::new(MemoryStore::new());
    let listed = fleet(2);
    let mut w = configured(&store, 1, &listed);
    w.tick(0);
    serve(&mut w, start(C, Some("k")), 1);
    let target = instance(&mut w, "k", 1);
    // Long past instance_ttl_ms (5 s) with no traffic and no tick.
    let quiet = 1 + 3 * config().instance_ttl_ms;
    let picked: std::collections::BTreeSet<String> = (0..32)
        .filter_map(|r| {
            least_busy_other(&mut w, &target, r, quiet).map(|c| c.instance.address.to_string())
        })
        .collect();
    let expected: std::collections::BTreeSet<String> = listed.iter().cloned().collect();
    assert_eq!(picked, expected, "configured: still candidates");
    let other_target = InstanceRef::new(u16::MAX, listed[0].as_str().into());
    let candidates: Vec<String> = (0..32)
        .filter_map(|r| {
            least_busy_other(&mut w, &other_target, r, quiet)
                .map(|c| c.instance.address.to_string())
        })
        .collect();
    assert!(
        !candidates.iter().any(|a| a == C),
        "learned only, unseen for the TTL: forgotten ({candidates:?})"
    );
    // Dropped from the configuration: an ordinary learned instance again.
    w.set_configured_instances(&Rc::from([]));
    assert_eq!(
        least_busy_other(&mut w, &target, 0, quiet),
        None,
        "no longer listed, unseen for the TTL"
    );
}

#[test]
fn ticks_keep_configured_instances_fresh_for_vms_that_do_not_list_them() {
    let store = Rc::new(MemoryStore::new());
    let listed = fleet(3);
    let mut lister = configured(&store, 1, &listed);
    let mut bare = worker(&store, 2);
    serve(&mut bare, start(&listed[0], Some("k")), 1);
    let target = instance(&mut bare, "k", 1);
    let ttl = config().instance_ttl_ms;
    let mut now = 0;
    while now < 4 * ttl {
        lister.tick(now);
        now += 1_000;
    }
    bare.tick(now);
    let picked: std::collections::BTreeSet<String> = (0..32)
        .filter_map(|r| {
            least_busy_other(&mut bare, &target, r, now).map(|c| c.instance.address.to_string())
        })
        .collect();
    let expected: std::collections::BTreeSet<String> = listed[1..].iter().cloned().collect();
    assert_eq!(picked, expected);
}

#[test]
fn a_configured_instance_envoy_did_not_use_is_suspect_until_it_serves() {
    let store = Rc::new(MemoryStore::new());
    let listed = vec![A.to_string(), B.to_string()];
    let mut w = configured(&store, 1, &listed);
    serve(&mut w, start(A, Some(A)), 1);
    let target = instance(&mut w, A, 1);
    assert_eq!(
        least_busy_other(&mut w, &target, 0, 2).map(|c| c.instance.address.to_string()),
        Some(B.into())
    );
    let gone = UpstreamStart {
        address: A,
        key: Some(A),
        overridden: true,
        counted: Some(B),
    };
    serve(&mut w, gone, 3);
    w.tick(4_000);
    assert_eq!(
        least_busy_other(&mut w, &target, 0, 4_001),
        None,
        "listed but gone"
    );
    serve(&mut w, start(B, None), 4_002);
    assert!(
        least_busy_other(&mut w, &target, 0, 4_003).is_some(),
        "served again"
    );
}

#[test]
fn a_configured_instance_keeps_its_slot_when_idle() {
    let store = Rc::new(MemoryStore::new());
    let small = LoadConfig {
        max_instances: 2,
        ..config()
    };
    let mut w = LoadTracker::new(Rc::clone(&store), small.clone(), 1);
    w.set_configured_instances(&Rc::from([A.to_string()]));
    w.tick(0);
    let mut bare = LoadTracker::new(Rc::clone(&store), small, 2);
    // Two other instances want the two slots long after the TTL, served by
    // a VM that does not list A; A, kept fresh by the lister's ticks, keeps
    // its slot.
    let late = 10 * config().instance_ttl_ms;
    for now in (0..=late).step_by(1_000) {
        w.tick(now);
    }
    serve(&mut bare, start(B, None), late);
    serve(&mut bare, start(C, None), late);
    let addresses: Vec<String> = w.snapshot(late).into_iter().map(|l| l.address).collect();
    assert!(addresses.iter().any(|a| a == A), "{addresses:?}");
}

#[test]
fn nine_overflows_at_threshold_three_spread_over_six_other_instances() {
    let store = Rc::new(MemoryStore::new());
    let fleet = fleet(7);
    let (mut w1, mut w2) = (configured(&store, 1, &fleet), configured(&store, 2, &fleet));
    serve(&mut w1, start(&fleet[0], Some("k")), 1);
    let target = instance(&mut w1, "k", 1);
    let mut tickets = Vec::new();
    let mut landed: std::collections::BTreeMap<String, u32> = Default::default();
    for i in 0..9u64 {
        // Two workers alternate, as Envoy's do in a burst. Each claims the
        // instance it saw least busy only if its count has not moved since
        // (the other worker's claims reach its copy of the count later) and
        // asks again if it has, as the policy does.
        let w = if i % 2 == 0 { &mut w1 } else { &mut w2 };
        let claimed = (0..3).find_map(|attempt| {
            let Candidate {
                instance: other,
                in_flight: load,
                ..
            } = least_busy_other(w, &target, i.wrapping_mul(0x9E37_79B9) + attempt, 2)
                .expect("a candidate");
            match w.claim(&other, None, Some(load + 1), 2) {
                Claim::Claimed(ticket) => Some((other.address, ticket)),
                _ => None,
            }
        });
        let (address, ticket) = claimed.expect("claimed within three attempts");
        tickets.push(ticket);
        *landed.entry(address.to_string()).or_default() += 1;
    }
    assert_eq!(landed.len(), 6, "{landed:?}");
    assert!(landed.values().all(|&n| n <= 2), "{landed:?}");
}

/// Writes an engine sample of `address` (registry `slot`) as the poller does.
fn engine_sample(store: &MemoryStore, slot: u16, address: &str, load: EngineLoad, at: u64) {
    let record = engine::EngineRecord {
        addr_hash: addr_hash(address),
        sampled_at_ms: at,
        load,
        base_in_flight: 0,
        served: None,
        active_adapters: None,
    };
    let key = format!("prefix-router/default/v3/engine/{slot}");
    store.set(&key, &record.encode(), None).expect("written");
}

#[test]
fn candidates_are_weighed_by_fresh_engine_samples_of_their_own_address() {
    let store = Rc::new(MemoryStore::new());
    let mut w = worker(&store, 1);
    for addr in [A, B, C] {
        serve(&mut w, start(addr, Some(addr)), 1);
    }
    let slot = |w: &mut LoadTracker<Rc<MemoryStore>>, addr: &str| instance(w, addr, 2).slot;
    let (a, b) = (slot(&mut w, A), slot(&mut w, B));
    let _a1 = w.upstream_started(start(A, None), 2);
    let requests = |running, waiting| EngineLoad {
        running,
        waiting,
        kv_usage_permille: None,
    };
    engine_sample(&store, a, A, requests(3, 1), 2);
    engine_sample(&store, b, C, requests(9, 9), 2);
    let weighed = |w: &mut LoadTracker<Rc<MemoryStore>>, now: u64| {
        w.candidates(now)
            .into_iter()
            .map(|c| (c.instance.address, (c.in_flight, c.load, c.over_bounds)))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    // Engine load off: this Envoy's counts only.
    assert_eq!(weighed(&mut w, 3)[A], (1, 1, false));
    w.set_engine_view(Some(EngineView {
        max_age_ms: 500,
        bounds: EngineBounds {
            max_requests: Some(5),
            max_kv_usage_permille: Some(900),
        },
    }));
    let now = weighed(&mut w, 3);
    // 3 running + 1 waiting + this Envoy's one request sent since (base 0).
    assert_eq!(now[A], (1, 5, true));
    // A sample of another address in B's slot is not B's.
    assert_eq!(now[B], (0, 0, false));
    assert_eq!(now[C], (0, 0, false));
    // The overflow choice avoids the instance at the fleet-wide bound.
    let (on_a, on_c) = (instance(&mut w, A, 3), instance(&mut w, C, 3));
    assert_eq!(
        w.candidates(3)
            .into_iter()
            .find(|c| c.instance == on_a)
            .map(|c| c.load),
        Some(5)
    );
    // The overflow choice takes an instance within the bounds before a
    // less loaded one over them: A with one request but its KV cache 95 %
    // used (bound 90 %), B with two requests of this Envoy.
    let kv_full = EngineLoad {
        kv_usage_permille: Some(950),
        ..requests(0, 0)
    };
    // (A later sample, read once this VM's cached read of A is older than
    // the cache's lifetime.)
    let later = 3 + tracker::ENGINE_CACHE_MS;
    engine_sample(&store, a, A, kv_full, later);
    let _b = [
        w.upstream_started(start(B, None), later),
        w.upstream_started(start(B, None), later),
    ];
    assert_eq!(weighed(&mut w, later)[A], (1, 1, true));
    let other = least_busy_other(&mut w, &on_c, 0, later).expect("one");
    assert_eq!((&*other.instance.address, other.load), (B, 2));
    // Older than max_age_ms: back to this Envoy's counts.
    assert_eq!(weighed(&mut w, later + 501)[A], (1, 1, false));
}

/// The registry holds as many instances as it has slots, whatever their
/// addresses hash to: a fleet of `max_instances` registers whole, every
/// instance counted in flight, from one VM and from another.
#[test]
fn a_fleet_as_large_as_the_registry_registers_whole() {
    let store = Rc::new(MemoryStore::new());
    let (mut w1, mut w2) = (worker(&store, 1), worker(&store, 2));
    let max = usize::from(config().max_instances);
    let fleet: Vec<String> = (0..max)
        .map(|i| format!("10.2.{}.{}:8000", i / 8, i % 8))
        .collect();
    let tickets: Vec<_> = fleet
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let w = if i % 2 == 0 { &mut w1 } else { &mut w2 };
            w.upstream_started(start(a, None), 1)
        })
        .collect();
    let snapshot = w1.snapshot(1);
    for (address, ticket) in fleet.iter().zip(&tickets) {
        assert!(ticket.is_some(), "{address} not counted");
        let load = snapshot.iter().find(|l| &l.address == address);
        assert_eq!(load.map(|l| l.in_flight), Some(1), "{address}");
    }
    // One more than the registry holds is refused, and nothing else moves.
    assert_eq!(w1.upstream_started(start("10.3.0.1:8000", None), 1), None);
    assert_eq!(w1.snapshot(1).len(), max);
}

/// A suspect mark lapses: an instance of a listed fleet that Envoy did not
/// use once (briefly out of the cluster) is a candidate again after
/// `SUSPECT_MS`, without having served, and marked again if Envoy still
/// does not use it.
#[test]
fn a_suspect_instance_is_tried_again_after_suspect_ms() {
    use super::instances::SUSPECT_MS;
    let store = Rc::new(MemoryStore::new());
    let listed = vec![A.to_string(), B.to_string()];
    let mut w = configured(&store, 1, &listed);
    serve(&mut w, start(A, Some(A)), 1);
    let fell_back = || UpstreamStart {
        address: A,
        key: None,
        overridden: true,
        counted: Some(B),
    };
    assert_eq!(candidate_addresses(&mut w, 2), [A, B], "both registered");
    serve(&mut w, fell_back(), 10);
    assert_eq!(candidate_addresses(&mut w, 11), [A]);
    assert_eq!(candidate_addresses(&mut w, 10 + SUSPECT_MS - 1), [A]);
    assert_eq!(
        candidate_addresses(&mut w, 10 + SUSPECT_MS),
        [A, B],
        "tried again"
    );
    let again = 10 + SUSPECT_MS + 5;
    serve(&mut w, fell_back(), again);
    assert_eq!(candidate_addresses(&mut w, again + 1), [A], "still gone");
    w.tick(again + 2);
    assert_eq!(candidate_addresses(&mut w, again + SUSPECT_MS - 1), [A]);
    assert_eq!(candidate_addresses(&mut w, again + SUSPECT_MS), [A, B]);
}

/// Envoy runs a VM per worker thread (its default `--concurrency` is the
/// core count) and one on the main thread: well past 64 VMs on a large host
/// each take a column of their own, so every VM's counts are seen by all.
#[test]
fn a_hundred_vms_each_take_a_column() {
    let store = Rc::new(MemoryStore::new());
    let workers: Vec<_> = (1..=100).map(|n| worker(&store, n)).collect();
    let columns: std::collections::BTreeSet<u16> =
        workers.iter().filter_map(|w| w.column()).collect();
    assert_eq!(columns.len(), 100);
}

/// A tick re-reads the leases of the columns VMs have held, not every one
/// `vm_slots` allows: its reads are the same with 8 columns and with 255.
#[test]
fn a_ticks_reads_do_not_grow_with_vm_slots() {
    let reads_of_a_tick = |vm_slots: u16| {
        let store = Rc::new(MemoryStore::new());
        let config = LoadConfig {
            vm_slots,
            ..config()
        };
        let mut workers: Vec<_> = (1..=3)
            .map(|n| LoadTracker::new(Rc::clone(&store), config.clone(), n))
            .collect();
        for w in &mut workers {
            w.tick(0);
        }
        let before = store.reads();
        workers[0].tick(1_000);
        store.reads() - before
    };
    assert_eq!(reads_of_a_tick(8), reads_of_a_tick(255));
}

#[test]
fn a_decision_over_a_large_fleet_reads_a_bounded_number_of_expired_engine_samples() {
    const FLEET: usize = 40;
    let store = Rc::new(MemoryStore::new());
    let mut w = worker(&store, 1);
    let addresses: Vec<String> = (0..FLEET).map(|i| format!("10.0.2.{i}:8000")).collect();
    for address in &addresses {
        serve(&mut w, start(address, None), 1);
    }
    let slots: Vec<(u16, String)> = w
        .candidates(1)
        .into_iter()
        .map(|c| (c.instance.slot, c.instance.address.to_string()))
        .collect();
    assert_eq!(slots.len(), FLEET);
    let sample_all = |running: u32, at: u64| {
        for (slot, address) in &slots {
            let load = EngineLoad {
                running,
                waiting: 0,
                kv_usage_permille: None,
            };
            engine_sample(&store, *slot, address, load, at);
        }
    };
    sample_all(3, 2);
    w.set_engine_view(Some(EngineView {
        max_age_ms: 2_000,
        bounds: EngineBounds::default(),
    }));
    let weighed_at = |w: &mut LoadTracker<Rc<MemoryStore>>, running: u32, now: u64| {
        w.candidates(now)
            .iter()
            .filter(|c| c.load == running)
            .count()
    };
    // Every sample read once (no copies yet).
    assert_eq!(weighed_at(&mut w, 3, 2), FLEET);
    // Newer samples: a decision whose copies expired reads the budget of
    // them, those read longest ago; the others stand, still fresh.
    sample_all(5, 100);
    let budget = RECORD_READS_PER_DECISION;
    assert_eq!(weighed_at(&mut w, 5, 100), budget);
    assert_eq!(weighed_at(&mut w, 5, 101), 2 * budget, "the next oldest");
    // The tick reads every sample again, and its copies stand for their
    // window: the next decision reads nothing.
    w.tick(102);
    let reads = store.reads();
    assert_eq!(weighed_at(&mut w, 5, 103), FLEET);
    assert_eq!(store.reads(), reads, "the tick's copies");
    // A standing copy whose sample lapses is read again, whatever the
    // budget: every instance keeps its sample.
    sample_all(7, 2_200);
    assert_eq!(
        weighed_at(&mut w, 7, 2_200),
        FLEET,
        "the copies of 102 hold samples of 100, lapsed at 2100"
    );
}

/// An instance whose connection failed is no candidate, on any worker, and
/// no key's target, until it answers; past `FAILED_RETRY_MS` one request
/// may try it again, and that request keeps the others away until it
/// answers.
#[test]
fn a_failed_instance_is_skipped_until_it_answers() {
    use super::instances::FAILED_RETRY_MS;
    let store = Rc::new(MemoryStore::new());
    let listed = vec![A.to_string(), B.to_string()];
    let mut w1 = configured(&store, 1, &listed);
    let mut w2 = configured(&store, 2, &listed);
    serve(&mut w1, start(A, Some("on-a")), 1);
    serve(&mut w1, start(B, Some("on-b")), 1);
    assert_eq!(candidate_addresses(&mut w2, 2), [A, B]);
    assert!(w2.target_of("on-b", 2).is_some());

    // A request to B started (counted there, B seen) and its connection failed.
    let ticket = w1.upstream_started(start(B, None), 10);
    assert!(w1.connection_failed(B, 10), "newly failed");
    if let Some(ticket) = ticket {
        w1.release(ticket, 10);
    }
    assert!(!w1.connection_failed(B, 11), "already failed");
    let later = 10 + RECORD_CACHE_MS;
    assert_eq!(candidate_addresses(&mut w1, 11), [A]);
    assert_eq!(candidate_addresses(&mut w2, later), [A], "on every worker");
    assert!(w2.target_of("on-b", later).is_none(), "no key's target");
    let on_a = instance(&mut w2, "on-a", later);
    assert!(least_busy_other(&mut w2, &on_a, 0, later).is_none());
    // A request sent there before the mark (or by Envoy's own choice)
    // starting does not clear it: only an answer does.
    serve(&mut w2, start(B, None), later + 1);
    assert_eq!(
        candidate_addresses(&mut w2, later + 1 + RECORD_CACHE_MS),
        [A]
    );

    // Past the back-off: a candidate again, until one request goes there.
    let due = 10 + FAILED_RETRY_MS;
    assert_eq!(candidate_addresses(&mut w1, due - 1), [A]);
    assert_eq!(candidate_addresses(&mut w1, due), [A, B], "tried again");
    serve(&mut w1, start(B, None), due);
    assert_eq!(
        candidate_addresses(&mut w1, due),
        [A],
        "one request tries it"
    );
    assert_eq!(candidate_addresses(&mut w2, due + RECORD_CACHE_MS), [A]);
    // It answers: back on every worker at once.
    w1.answered(B, due + 20);
    assert_eq!(candidate_addresses(&mut w1, due + 20), [A, B]);
    assert_eq!(
        candidate_addresses(&mut w2, due + 20 + RECORD_CACHE_MS),
        [A, B]
    );
    assert!(w2.target_of("on-b", due + 20 + RECORD_CACHE_MS).is_some());
    // Failing again later is a new failure.
    assert!(w2.connection_failed(B, due + 100));
}
