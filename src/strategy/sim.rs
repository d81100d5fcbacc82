//! A small simulated Envoy for the policy scenarios: N instances behind a
//! Maglev stand-in (hash of the key header, random without one) with Envoy's
//! `override_host` rule (a nominated host in the cluster wins, an unknown one
//! falls back), W worker VMs sharing one in-memory store, and the upstream
//! filter running right after each decision on the same worker, as seen in
//! Envoy 1.40. It counts what each instance really has in flight, so the
//! scenarios check the cap where the issue measures it: at the upstream.

use std::rc::Rc;

use xxhash_rust::xxh3::xxh3_64;

use super::{Decision, DecisionKind, Policy, PrefixAware, RoutingPolicy};
use crate::load::{LoadConfig, LoadTracker, Ticket, UpstreamStart};
use crate::shared::MemoryStore;

type Worker = LoadTracker<Rc<MemoryStore>>;

/// One request between its decision and its end.
#[derive(Debug)]
pub(crate) struct Stream {
    pub(crate) worker: usize,
    pub(crate) host: Option<usize>,
    pub(crate) decision: Decision,
    downstream: Option<Ticket>,
    upstream: Vec<Ticket>,
}

pub(crate) struct Envoy {
    pub(crate) store: Rc<MemoryStore>,
    pub(crate) workers: Vec<Worker>,
    pub(crate) hosts: Vec<String>,
    pub(crate) policy: Policy,
    pub(crate) at_host: Vec<u32>,
    pub(crate) max_at_host: Vec<u32>,
    pub(crate) now: u64,
    rng: u64,
    next_nonce: u64,
}

pub(crate) fn config() -> LoadConfig {
    LoadConfig {
        vm_lease_ms: 10_000,
        instance_ttl_ms: 60_000,
        ..LoadConfig::default()
    }
}

impl Envoy {
    pub(crate) fn new(hosts: usize, workers: usize, policy: Policy) -> Self {
        let store = Rc::new(MemoryStore::new());
        let mut envoy = Self {
            store,
            workers: Vec::new(),
            hosts: (0..hosts)
                .map(|i| format!("127.0.0.1:{}", 18_081 + i))
                .collect(),
            policy,
            at_host: vec![0; hosts],
            max_at_host: vec![0; hosts],
            now: 1_000,
            rng: 0x9E37_79B9_7F4A_7C15,
            next_nonce: 100,
        };
        for _ in 0..workers {
            let worker = envoy.new_worker();
            envoy.workers.push(worker);
        }
        envoy
    }

    pub(crate) fn prefix_aware(threshold: u32, host_header: bool) -> Self {
        Self::new(
            7,
            2,
            Policy::PrefixAware(PrefixAware::new(threshold, host_header)),
        )
    }

    fn new_worker(&mut self) -> Worker {
        self.next_nonce += 1;
        let mut worker = LoadTracker::new(Rc::clone(&self.store), config(), self.next_nonce);
        worker.tick(self.now);
        worker
    }

    pub(crate) fn random(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    /// Maglev stand-in: the key's host, or a random one without a key.
    /// Rendezvous hashing, so that, like Maglev, adding a host moves only
    /// about 1/N of the keys.
    pub(crate) fn maglev(&mut self, key: Option<&str>) -> usize {
        let n = self.hosts.len() as u64;
        match key {
            Some(key) => (0..self.hosts.len())
                .max_by_key(|&h| xxh3_64(format!("{key}@{}", self.hosts[h]).as_bytes()))
                .unwrap_or(0),
            None => (self.random() % n) as usize,
        }
    }

    fn route(&mut self, decision: &Decision) -> usize {
        if let Some(host) = &decision.host_override {
            if let Some(index) = self.hosts.iter().position(|h| h == host) {
                return index;
            }
        }
        self.maglev(decision.key.as_deref())
    }

    pub(crate) fn decide(&mut self, worker: usize, key: Option<&str>) -> Stream {
        let random = self.random();
        let now = self.now;
        let routed = self
            .policy
            .decide(key, &mut self.workers[worker], random, now);
        Stream {
            worker,
            host: None,
            decision: routed.decision,
            downstream: routed.ticket,
            upstream: Vec::new(),
        }
    }

    /// Envoy picks the host; the upstream filter on the same worker counts.
    pub(crate) fn send_upstream(&mut self, stream: &mut Stream) {
        if let Some(previous) = stream.host.take() {
            self.at_host[previous] -= 1;
        }
        let host = self.route(&stream.decision);
        let address = self.hosts[host].clone();
        let start = UpstreamStart {
            address: &address,
            key: stream.decision.key.as_deref(),
            overridden: stream.decision.host_override.is_some(),
            counted: stream.decision.counted.as_deref(),
        };
        let now = self.now;
        if let Some(ticket) = self.workers[stream.worker].upstream_started(start, now) {
            stream.upstream.push(ticket);
        }
        self.at_host[host] += 1;
        self.max_at_host[host] = self.max_at_host[host].max(self.at_host[host]);
        stream.host = Some(host);
    }

    /// The upstream attempt ends early (reset, timeout): its ticket goes back.
    pub(crate) fn end_attempt(&mut self, stream: &mut Stream) {
        if let Some(host) = stream.host.take() {
            self.at_host[host] -= 1;
        }
        let now = self.now;
        for ticket in stream.upstream.drain(..) {
            self.workers[stream.worker].release(ticket, now);
        }
    }

    pub(crate) fn start(&mut self, worker: usize, key: Option<&str>) -> Stream {
        let mut stream = self.decide(worker, key);
        self.send_upstream(&mut stream);
        stream
    }

    /// `on_done` of both the upstream and the downstream stream.
    pub(crate) fn finish(&mut self, mut stream: Stream) {
        self.end_attempt(&mut stream);
        if let Some(ticket) = stream.downstream.take() {
            let now = self.now;
            self.workers[stream.worker].release(ticket, now);
        }
    }

    pub(crate) fn advance(&mut self, ms: u64) {
        self.now += ms;
    }

    pub(crate) fn tick_all(&mut self) {
        let now = self.now;
        for worker in &mut self.workers {
            worker.tick(now);
        }
    }

    /// Sequential requests of distinct keys until every instance has served
    /// one through this Envoy (the registry is warm).
    pub(crate) fn warm(&mut self) {
        for i in 0..1_000 {
            if self.workers[0].snapshot(self.now).len() == self.hosts.len() {
                return;
            }
            let key = format!("warm-{i}");
            let stream = self.start(i % self.workers.len(), Some(&key));
            self.finish(stream);
        }
        panic!("the registry never learned every instance");
    }

    /// In flight as the filter's gauge would show it (read through worker 0).
    pub(crate) fn gauge(&mut self) -> Vec<u32> {
        let now = self.now;
        let snapshot = self.workers[0].snapshot(now);
        self.hosts
            .iter()
            .map(|h| {
                snapshot
                    .iter()
                    .find(|l| &l.address == h)
                    .map_or(0, |l| l.in_flight)
            })
            .collect()
    }

    /// Kills worker VM `index` (FAIL_RELOAD): its streams die with it (Envoy
    /// resets them, so the instances stop serving them) and nothing it held
    /// is released; a new VM with a new nonce takes its place.
    pub(crate) fn crash_worker(&mut self, index: usize, streams: Vec<Stream>) {
        for stream in streams {
            assert_eq!(stream.worker, index);
            if let Some(host) = stream.host {
                self.at_host[host] -= 1;
            }
            // Lost with the VM: never released.
            let _lost = (stream.downstream, stream.upstream);
        }
        let replacement = self.new_worker();
        self.workers[index] = replacement;
    }

    pub(crate) fn reset_max(&mut self) {
        self.max_at_host = self.at_host.clone();
    }

    /// Scales out: one more instance in the cluster (the Maglev stand-in
    /// now hashes over it too).
    pub(crate) fn add_host(&mut self) {
        let port = 18_081 + self.hosts.len();
        self.hosts.push(format!("127.0.0.1:{port}"));
        self.at_host.push(0);
        self.max_at_host.push(0);
    }
}

/// Keys whose Maglev host is `host` (deterministic search).
pub(crate) fn keys_on_host(envoy: &mut Envoy, host: usize, count: usize) -> Vec<String> {
    (0..10_000)
        .map(|i| format!("{i:016x}"))
        .filter(|k| envoy.maglev(Some(k)) == host)
        .take(count)
        .collect()
}

pub(crate) fn kinds(streams: &[Stream]) -> Vec<DecisionKind> {
    streams.iter().map(|s| s.decision.kind).collect()
}

mod scenarios {
    use super::*;

    const KEY: &str = "00c0ffee00c0ffee";

    fn count(kinds: &[DecisionKind], kind: DecisionKind) -> usize {
        kinds.iter().filter(|k| **k == kind).count()
    }

    #[test]
    fn burst_of_a_new_key_is_capped_and_spread_then_returns_to_target() {
        let mut envoy = Envoy::prefix_aware(3, true);
        envoy.warm();
        let target = envoy.maglev(Some(KEY));
        let streams: Vec<Stream> = (0..12).map(|i| envoy.start(i % 2, Some(KEY))).collect();
        assert_eq!(
            envoy.max_at_host[target], 3,
            "target capped at the threshold"
        );
        assert_eq!(envoy.at_host[target], 3);
        let kinds = kinds(&streams);
        assert_eq!(count(&kinds, DecisionKind::Prefix), 3);
        assert_eq!(count(&kinds, DecisionKind::Overflow), 9);
        let others: Vec<u32> = (0..7)
            .filter(|h| *h != target)
            .map(|h| envoy.at_host[h])
            .collect();
        assert_eq!(others.iter().sum::<u32>(), 9);
        assert!(
            others.iter().all(|n| (1..=2).contains(n)),
            "spread evenly: {others:?}"
        );
        assert_eq!(
            envoy.gauge(),
            envoy.at_host,
            "the gauge matches the instances"
        );
        for stream in streams {
            envoy.finish(stream);
        }
        for _ in 0..5 {
            let stream = envoy.start(0, Some(KEY));
            assert_eq!(stream.host, Some(target));
            assert_eq!(stream.decision.kind, DecisionKind::Prefix);
            assert_eq!(stream.decision.host_override, None);
            envoy.finish(stream);
        }
        assert!(envoy.gauge().iter().all(|n| *n == 0));
    }

    #[test]
    fn decisions_racing_ahead_of_the_upstream_filters_still_respect_the_cap() {
        let mut envoy = Envoy::prefix_aware(3, true);
        envoy.warm();
        let first = envoy.start(0, Some(KEY));
        envoy.finish(first);
        let target = envoy.maglev(Some(KEY));
        // All 12 decisions (both workers) before any upstream filter runs.
        let mut streams: Vec<Stream> = (0..12).map(|i| envoy.decide(i % 2, Some(KEY))).collect();
        for stream in &mut streams {
            envoy.send_upstream(stream);
        }
        assert_eq!(envoy.max_at_host[target], 3);
        for stream in streams {
            envoy.finish(stream);
        }
    }

    #[test]
    fn a_blind_first_request_racing_another_workers_learning_is_counted() {
        let mut envoy = Envoy::prefix_aware(3, true);
        envoy.warm();
        let target = envoy.maglev(Some(KEY));
        // Worker 1 decides blind; before its upstream filter runs (preempted),
        // worker 0 routes, learns the target and keeps claiming.
        let mut late = envoy.decide(1, Some(KEY));
        let mut streams: Vec<Stream> = (0..5).map(|_| envoy.start(0, Some(KEY))).collect();
        envoy.send_upstream(&mut late);
        streams.push(late);
        assert_eq!(envoy.max_at_host[target], 3);
        assert_eq!(streams.iter().filter(|s| s.host == Some(target)).count(), 3);
        for stream in streams {
            envoy.finish(stream);
        }
    }

    #[test]
    fn two_keys_sharing_a_target_share_its_cap() {
        let mut envoy = Envoy::prefix_aware(4, true);
        envoy.warm();
        let target = 3;
        let keys = keys_on_host(&mut envoy, target, 2);
        for key in &keys {
            let stream = envoy.start(0, Some(key));
            envoy.finish(stream);
        }
        let streams: Vec<Stream> = (0..20)
            .map(|i| {
                let key = keys[i % 2].clone();
                envoy.start((i / 2) % 2, Some(&key))
            })
            .collect();
        assert_eq!(envoy.max_at_host[target], 4);
        let on_target: Vec<&Stream> = streams.iter().filter(|s| s.host == Some(target)).collect();
        assert_eq!(on_target.len(), 4);
        assert!(on_target
            .iter()
            .any(|s| s.decision.key.as_deref() == Some(&keys[0])));
        assert!(on_target
            .iter()
            .any(|s| s.decision.key.as_deref() == Some(&keys[1])));
        for stream in streams {
            envoy.finish(stream);
        }
    }

    #[test]
    fn an_unlearned_key_can_pass_a_full_target_once_per_worker_at_most() {
        // The documented limit: a key's very first request is routed before
        // its target is known, so it is not checked against the cap.
        let mut envoy = Envoy::prefix_aware(4, true);
        envoy.warm();
        let target = 2;
        let keys = keys_on_host(&mut envoy, target, 2);
        let warm = envoy.start(0, Some(&keys[0]));
        envoy.finish(warm);
        let mut streams: Vec<Stream> = (0..8).map(|i| envoy.start(i % 2, Some(&keys[0]))).collect();
        assert_eq!(envoy.at_host[target], 4);
        streams.extend((0..8).map(|i| envoy.start(i % 2, Some(&keys[1]))));
        assert_eq!(
            envoy.max_at_host[target], 5,
            "one unchecked first request, then capped"
        );
        for stream in streams {
            envoy.finish(stream);
        }
    }

    #[test]
    fn overflow_ends_as_soon_as_the_target_drops_below_the_cap() {
        let mut envoy = Envoy::prefix_aware(3, true);
        envoy.warm();
        let target = envoy.maglev(Some(KEY));
        let mut on_target: Vec<Stream> = (0..3).map(|i| envoy.start(i % 2, Some(KEY))).collect();
        let overflow = envoy.start(1, Some(KEY));
        assert_eq!(overflow.decision.kind, DecisionKind::Overflow);
        assert_ne!(overflow.host, Some(target));
        let done = on_target.pop().expect("three streams");
        envoy.finish(done);
        let back = envoy.start(1, Some(KEY));
        assert_eq!(back.decision.kind, DecisionKind::Prefix);
        assert_eq!(back.host, Some(target));
        for stream in on_target.into_iter().chain([overflow, back]) {
            envoy.finish(stream);
        }
    }

    #[test]
    fn without_a_host_header_overflow_rekeys_and_learns_to_avoid_the_target() {
        let mut envoy = Envoy::prefix_aware(3, false);
        envoy.warm();
        let target = envoy.maglev(Some(KEY));
        let first: Vec<Stream> = (0..12).map(|i| envoy.start(i % 2, Some(KEY))).collect();
        for stream in first
            .iter()
            .filter(|s| s.decision.kind == DecisionKind::Overflow)
        {
            let key = stream.decision.key.as_deref().expect("salted key");
            assert_ne!(key, KEY);
            assert_eq!(key.len(), 16);
            assert!(key
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
            assert_eq!(stream.decision.host_override, None);
        }
        assert_eq!(count(&kinds(&first), DecisionKind::Overflow), 9);
        for stream in first {
            envoy.finish(stream);
        }
        // Second burst: every salt it uses has been learned, and none that
        // maps to the target is used again.
        envoy.reset_max();
        let second: Vec<Stream> = (0..12).map(|i| envoy.start(i % 2, Some(KEY))).collect();
        assert_eq!(envoy.max_at_host[target], 3);
        for stream in second {
            envoy.finish(stream);
        }
    }

    #[test]
    fn on_a_cold_registry_overflow_explores_with_salted_keys_then_uses_what_it_learned() {
        let mut envoy = Envoy::prefix_aware(3, true);
        let target = envoy.maglev(Some(KEY));
        let streams: Vec<Stream> = (0..6).map(|i| envoy.start(i % 2, Some(KEY))).collect();
        let overflow: Vec<&Stream> = streams
            .iter()
            .filter(|s| s.decision.kind == DecisionKind::Overflow)
            .collect();
        assert_eq!(overflow.len(), 3);
        // Only the target is known: the first overflow can only re-key.
        let first = &overflow[0].decision;
        assert_eq!(first.host_override, None);
        assert_ne!(first.key.as_deref(), Some(KEY));
        // Where it went is now known, and nominated when it is the least busy.
        let explored = overflow[0].host.expect("sent");
        if explored != target {
            let nominated = overflow
                .iter()
                .skip(1)
                .filter(|s| s.decision.host_override.is_some());
            assert!(nominated.clone().count() >= 1);
            assert!(nominated.into_iter().all(|s| s.host != Some(target)));
        }
        for stream in streams {
            envoy.finish(stream);
        }
    }

    #[test]
    fn no_leak_under_aborts_resets_timeouts_retries_and_streaming() {
        let mut envoy = Envoy::prefix_aware(3, true);
        envoy.warm();
        let keys = keys(0..40);
        let mut open: Vec<Stream> = Vec::new();
        let mut started = 0;
        while started < 2_000 || !open.is_empty() {
            let roll = envoy.random() % 100;
            if started < 2_000 && (open.len() < 30 || roll < 40) {
                let worker = (envoy.random() % 2) as usize;
                let key = if roll < 5 {
                    None
                } else {
                    Some(keys[(envoy.random() % 40) as usize].clone())
                };
                let mut stream = envoy.decide(worker, key.as_deref());
                started += 1;
                if roll % 10 == 9 {
                    // Client aborts while the body is still held: no upstream.
                    envoy.finish(stream);
                    continue;
                }
                envoy.send_upstream(&mut stream);
                open.push(stream);
                continue;
            }
            if open.is_empty() {
                continue;
            }
            let index = (envoy.random() % open.len() as u64) as usize;
            let mut stream = open.swap_remove(index);
            match envoy.random() % 20 {
                // 5% upstream reset and 5% upstream timeout with a retry.
                0 | 1 => {
                    envoy.end_attempt(&mut stream);
                    envoy.send_upstream(&mut stream);
                    open.push(stream);
                }
                // 10% client aborts mid-stream; the rest complete (streamed or not).
                _ => envoy.finish(stream),
            }
            let step = envoy.random() % 50;
            envoy.advance(step);
            if envoy.now % 1_000 < 50 {
                envoy.tick_all();
            }
        }
        assert_eq!(envoy.at_host.iter().sum::<u32>(), 0);
        assert!(
            envoy.gauge().iter().all(|n| *n == 0),
            "gauge {:?}",
            envoy.gauge()
        );
        assert_eq!(
            envoy
                .workers
                .iter()
                .map(|w| w.local_in_flight())
                .sum::<u32>(),
            0
        );
        // A fresh burst now behaves as on a fresh (warmed) Envoy.
        let target = envoy.maglev(Some(KEY));
        envoy.reset_max();
        let burst: Vec<Stream> = (0..12).map(|i| envoy.start(i % 2, Some(KEY))).collect();
        assert_eq!(envoy.max_at_host[target], 3);
        assert_eq!(count(&kinds(&burst), DecisionKind::Overflow), 9);
        for stream in burst {
            envoy.finish(stream);
        }
    }

    #[test]
    fn counts_heal_after_a_worker_vm_restart() {
        let mut envoy = Envoy::prefix_aware(3, true);
        envoy.warm();
        let target = envoy.maglev(Some(KEY));
        let doomed: Vec<Stream> = (0..3).map(|_| envoy.start(0, Some(KEY))).collect();
        assert_eq!(envoy.at_host[target], 3);
        envoy.crash_worker(0, doomed);
        assert_eq!(envoy.at_host[target], 0);
        // Until the dead VM's lease expires its counts still count.
        let stream = envoy.start(1, Some(KEY));
        assert_eq!(stream.decision.kind, DecisionKind::Overflow);
        envoy.finish(stream);
        envoy.advance(config().vm_lease_ms + 1);
        envoy.tick_all();
        assert!(envoy.gauge().iter().all(|n| *n == 0), "{:?}", envoy.gauge());
        for worker in [0, 1] {
            let stream = envoy.start(worker, Some(KEY));
            assert_eq!(stream.decision.kind, DecisionKind::Prefix);
            assert_eq!(stream.host, Some(target));
            envoy.finish(stream);
        }
    }

    #[test]
    fn requests_without_a_key_are_not_steered() {
        let mut envoy = Envoy::prefix_aware(3, true);
        let stream = envoy.start(0, None);
        assert_eq!(stream.decision, Decision::bare(DecisionKind::NoKey));
        envoy.finish(stream);
    }

    /// 7 instances, 2 workers, PREFIX_AWARE with `key_balance_factor` 100.
    fn balanced_envoy() -> Envoy {
        let policy = PrefixAware::new(64, true).with_key_balance(Some(100));
        Envoy::new(7, 2, Policy::PrefixAware(policy))
    }

    /// Distinct keys, numbered.
    fn keys(range: std::ops::Range<u64>) -> Vec<String> {
        range.map(|i| format!("{:016x}", i * 7919)).collect()
    }

    /// Rounds of one request per key (workers alternating), each key's
    /// hosts in order; ticks every simulated second.
    fn rounds(envoy: &mut Envoy, keys: &[String], rounds: usize) -> Vec<Vec<usize>> {
        let mut hosts = vec![Vec::new(); keys.len()];
        for round in 0..rounds {
            for (i, key) in keys.iter().enumerate() {
                let stream = envoy.start((i + round) % 2, Some(key));
                hosts[i].push(stream.host.expect("sent"));
                envoy.finish(stream);
                envoy.advance(10);
            }
            envoy.tick_all();
        }
        hosts
    }

    fn keys_per_host(envoy: &Envoy, hosts: &[Vec<usize>]) -> Vec<usize> {
        let mut per_host = vec![0; envoy.hosts.len()];
        for key_hosts in hosts {
            per_host[*key_hosts.last().expect("served")] += 1;
        }
        per_host
    }

    #[test]
    fn key_balancing_spreads_100_keys_evenly_and_each_key_stays_put() {
        let keys = keys(0..100);
        let mut maglev_only = Envoy::prefix_aware(64, true);
        let hosts = rounds(&mut maglev_only, &keys, 3);
        let uneven = keys_per_host(&maglev_only, &hosts);
        assert!(
            uneven.iter().max() > Some(&16),
            "these keys are unevenly hashed: {uneven:?}"
        );

        let mut envoy = balanced_envoy();
        let hosts = rounds(&mut envoy, &keys, 4);
        let per_host = keys_per_host(&envoy, &hosts);
        // 100 / 7 = 14.3: the census bounds every instance at 15 keys.
        assert!(
            per_host.iter().all(|n| (14..=15).contains(n)),
            "balanced: {per_host:?} (Maglev alone: {uneven:?})"
        );
        for (key, key_hosts) in keys.iter().zip(&hosts) {
            // The first request goes by Maglev; the second is checked.
            let settled = &key_hosts[1..];
            assert!(
                settled.iter().all(|h| *h == settled[0]),
                "{key} moved after its second request: {key_hosts:?}"
            );
        }
        // Keys are bounded as they arrive (the bound grows with them), so
        // more move than an offline assignment would need.
        let moved = hosts.iter().filter(|h| h[0] != h[1]).count();
        assert!(moved <= 50, "{moved} keys placed off their Maglev host");
    }

    #[test]
    fn once_the_fleet_is_known_new_keys_are_placed_before_their_first_request() {
        let mut envoy = balanced_envoy();
        let old = keys(0..70);
        // 0.7 s a round: the known fleet stays the same for over 10 s.
        rounds(&mut envoy, &old, 20);
        let new = keys(70..140);
        let hosts = rounds(&mut envoy, &new, 3);
        let moved = hosts.iter().filter(|h| h[0] != h[1]).count();
        // Only the one key in eight that explores goes by Maglev first.
        assert!(
            moved <= 8,
            "{moved} of 70 new keys moved after their first request"
        );
        let mut all = rounds(&mut envoy, &old, 1);
        all.extend(hosts);
        let per_host = keys_per_host(&envoy, &all);
        assert!(
            per_host.iter().all(|n| *n == 20),
            "140 keys on 7 instances: {per_host:?}"
        );
    }

    #[test]
    fn an_added_instance_is_found_by_exploring_keys_and_then_gets_new_keys() {
        let mut envoy = balanced_envoy();
        // Every instance known, the known fleet settled: keys are placed
        // directly from now on (the warm-up keys are not used again).
        envoy.warm();
        envoy.advance(11_000);
        envoy.tick_all();
        let old = keys(0..70);
        rounds(&mut envoy, &old, 3);
        envoy.add_host();
        // New keys keep arriving (old ones stay in use). Only the one new key
        // in eight that explores by Maglev can reach the added instance and
        // register it; 10 s after the known fleet changed, new keys are placed
        // on it.
        let mut all = old.clone();
        for batch in 0..6 {
            let new = keys(70 + batch * 20..90 + batch * 20);
            all.extend(new);
            rounds(&mut envoy, &all, 2);
            envoy.advance(3_000);
        }
        let hosts = rounds(&mut envoy, &all, 1);
        let per_host = keys_per_host(&envoy, &hosts);
        // 190 keys on 8 instances: at most ceil(190 / 8) = 24 each.
        assert!(per_host[7] >= 15, "the new instance owns {per_host:?}");
        assert!(per_host.iter().all(|n| *n <= 24), "{per_host:?}");
    }

    #[test]
    fn keys_placed_across_a_census_generation_stay_within_the_bound() {
        let mut envoy = balanced_envoy();
        envoy.warm();
        // Half the keys just before the census rolls to its next generation
        // (every 60 s), half just after, before the first half is used again.
        envoy.advance(55_000 - envoy.now);
        envoy.tick_all();
        let early = keys(0..50);
        rounds(&mut envoy, &early, 1);
        envoy.advance(61_000 - envoy.now);
        envoy.tick_all();
        let late = keys(50..100);
        rounds(&mut envoy, &late, 1);
        let all: Vec<String> = early.into_iter().chain(late).collect();
        let hosts = rounds(&mut envoy, &all, 2);
        let per_host = keys_per_host(&envoy, &hosts);
        assert!(
            per_host.iter().all(|n| (14..=15).contains(n)),
            "100 keys on 7 instances: {per_host:?}"
        );
    }
}
