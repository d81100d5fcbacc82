//! A fake Envoy in memory for the policy scenarios (the real one, launched by
//! `tools::envoy::Envoy`, runs in the integration tests): N instances behind a
//! Maglev stand-in (hash of the key header, random without one) with Envoy's
//! `override_host` rule (a nominated host in the cluster wins, an unknown one
//! falls back), W worker VMs sharing one in-memory store, and the upstream
//! filter running right after each decision on the same worker, as seen in
//! Envoy 1.40. It counts what each instance really has in flight, so the
//! scenarios check the cap where it matters: at the upstream.

use std::rc::Rc;

use xxhash_rust::xxh3::xxh3_64;

use crate::load::{LoadConfig, LoadTracker, Ticket, UpstreamStart};
use crate::shared::MemoryStore;
use crate::strategy::{
    DecisionKind, Policy, PrefixAware, RecentChoices, RouteHeaders, RouteRequest,
};

type Worker = LoadTracker<Rc<MemoryStore>>;

/// One request between its decision and its end.
#[derive(Debug)]
pub(crate) struct Stream {
    pub(crate) worker: usize,
    pub(crate) host: Option<usize>,
    pub(crate) headers: RouteHeaders,
    downstream: Option<Ticket>,
    upstream: Vec<Ticket>,
}

pub(crate) struct FakeEnvoy {
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

impl FakeEnvoy {
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

    fn route(&mut self, decision: &RouteHeaders) -> usize {
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
        let request = RouteRequest {
            key,
            ..RouteRequest::default()
        };
        let mut recent = RecentChoices::default();
        let routed =
            self.policy
                .route(request, &mut self.workers[worker], &mut recent, random, now);
        Stream {
            worker,
            host: None,
            headers: routed.headers,
            downstream: routed.ticket,
            upstream: Vec::new(),
        }
    }

    /// Envoy picks the host; the upstream filter on the same worker counts.
    pub(crate) fn send_upstream(&mut self, stream: &mut Stream) {
        if let Some(previous) = stream.host.take() {
            self.at_host[previous] -= 1;
        }
        let host = self.route(&stream.headers);
        let address = self.hosts[host].clone();
        let start = UpstreamStart {
            address: &address,
            key: stream.headers.key.as_deref(),
            overridden: stream.headers.host_override.is_some(),
            counted: stream.headers.counted.as_deref(),
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
    /// one through this FakeEnvoy (the registry is warm).
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
}

/// Keys whose Maglev host is `host` (deterministic search).
pub(crate) fn keys_on_host(envoy: &mut FakeEnvoy, host: usize, count: usize) -> Vec<String> {
    (0..10_000)
        .map(|i| format!("{i:016x}"))
        .filter(|k| envoy.maglev(Some(k)) == host)
        .take(count)
        .collect()
}

pub(crate) fn kinds(streams: &[Stream]) -> Vec<DecisionKind> {
    streams.iter().map(|s| s.headers.kind).collect()
}
