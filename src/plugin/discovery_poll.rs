//! The fleet read from Envoy's admin as the plugin runs it (`discovery`):
//! from the root tick, the one VM that holds the discovery lease asks the
//! admin for the cluster's hosts every `interval_ms` and writes the healthy
//! ones to shared data; every VM reads that list on its tick (and, until it
//! has one, on each request), and its decisions take it as the configured
//! fleet (`instances`). Requests never wait on the admin: they use the last
//! list read.
//!
//! What the request and its answer look like is [`crate::discovery`].

use std::collections::HashMap;
use std::rc::Rc;

use super::engine_poll::read_answer;
use super::poller_lease::PollerLease;
use super::vm::{define_metric, Vm};
use super::warn_on_error;
use crate::config::{Config, DiscoveryConfig};
use crate::discovery::{self, DiscoveryFault, MAX_BODY_BYTES};
use crate::host::{Host, MetricKind};
use crate::load::PollerKind;
use crate::metrics::fleet_stat_name;

/// Counter of reads of the admin sent.
pub const READS: &str = "prefix_router.discovery.reads";
/// Counter of reads of the admin that gave no list.
pub const FAILURES: &str = "prefix_router.discovery.failures";
/// Gauge of the healthy hosts the last list held.
pub const INSTANCES: &str = "prefix_router.discovery.instances";

/// How long past its timeout a call Envoy never answered is given up.
const GIVE_UP_GRACE_MS: u64 = 1_000;

/// The shared-data key of `cluster`'s list: one per Envoy and cluster, so
/// every plugin naming the cluster reads the same list.
fn list_key(cluster: &str) -> String {
    format!("prefix-router/discovered/{cluster}")
}

/// One cluster's reads, on the VM that polls, and its list, on every VM.
#[derive(Debug, Default)]
struct ClusterState {
    /// The call open now: its token and when it was sent.
    open: Option<(u32, u64)>,
    next_due_ms: u64,
    /// Whether the last read failed (logged once per change).
    failing: bool,
    /// The list decisions use, and the shared record's CAS token it came from.
    fleet: Rc<[String]>,
    list_cas: Option<u32>,
    /// Its stats, under the configured fleet's names.
    reads: Option<Option<u32>>,
    failures: Option<Option<u32>>,
    instances: Option<Option<u32>>,
}

/// This VM's discovery state (kept across configuration updates).
#[derive(Debug, Default)]
pub struct DiscoveryPolling {
    lease: PollerLease,
    clusters: HashMap<String, ClusterState>,
}

impl DiscoveryPolling {
    /// The fleet of `cluster` as this VM last read it. A VM without one yet
    /// reads the shared list now: its requests can come before its first
    /// tick after the list was written, and would see no fleet.
    pub fn fleet(&mut self, host: &impl Host, cluster: &str) -> Rc<[String]> {
        // Looked up by `&str`: no key is allocated on a request once a list is read.
        if let Some(state) = self.clusters.get(cluster).filter(|s| !s.fleet.is_empty()) {
            return Rc::clone(&state.fleet);
        }
        let state = self.clusters.entry(cluster.to_string()).or_default();
        state.read_shared_list(host, cluster);
        Rc::clone(&state.fleet)
    }
}

impl ClusterState {
    /// One shared-data read of `cluster`'s list, decoded only if it changed
    /// since this VM last read it.
    fn read_shared_list(&mut self, host: &impl Host, cluster: &str) {
        let (list, cas) = host.get(&list_key(cluster));
        if cas.is_none() || cas != self.list_cas {
            self.list_cas = cas;
            let hosts = discovery::decode(&list.unwrap_or_default());
            if *self.fleet != *hosts {
                self.fleet = Rc::from(hosts);
            }
        }
    }
}

/// The root tick period while `discovery` is configured: a quarter of the
/// interval, so each VM takes a new list soon after it is read, and never
/// slower than the plugin's own tick.
pub fn tick_period_ms(discovery: &DiscoveryConfig) -> u32 {
    u32::try_from((discovery.interval_ms / 4).clamp(25, 1_000)).unwrap_or(1_000)
}

/// How long the lease lives without renewal: three intervals, at least a
/// second.
fn lease_ms(discovery: &DiscoveryConfig) -> u64 {
    (discovery.interval_ms * 3).max(1_000)
}

/// Root tick with `discovery` configured: takes or renews the lease, reads
/// the shared list, and, holding the lease, asks the admin when due.
pub fn tick<H: Host + Clone>(
    vm: &mut Vm<H>,
    config: &Config,
    discovery: &DiscoveryConfig,
    now: u64,
) {
    let mut state = vm.take_discovery_polling();
    let holding = state
        .lease
        .hold(vm, config, PollerKind::Discovery, lease_ms(discovery), now);
    let cluster = state.clusters.entry(discovery.cluster.clone()).or_default();
    // Every tick, so a new list reaches every VM soon after the one that
    // reads the admin.
    cluster.read_shared_list(vm.host(), &discovery.cluster);
    if holding {
        if let Some((_, sent_ms)) = cluster.open {
            if now.saturating_sub(sent_ms) > discovery.timeout_ms() + GIVE_UP_GRACE_MS {
                cluster.open = None;
            }
        }
        if cluster.open.is_none() && now >= cluster.next_due_ms {
            cluster.next_due_ms = now + discovery.interval_ms;
            let path = discovery::admin_path(&discovery.cluster);
            let sent = vm.host().dispatch_http_call(
                &discovery.admin_cluster,
                &[
                    (":method", "GET"),
                    (":path", &path),
                    (":authority", "envoy-admin"),
                    ("accept", "text/plain"),
                ],
                u32::try_from(discovery.timeout_ms()).unwrap_or(u32::MAX),
            );
            let host = vm.host();
            if let Some(id) = stat_id(host, config, &mut cluster.reads, MetricKind::Counter, READS)
            {
                warn_on_error("count", READS, host.increment_metric(id, 1));
            }
            match sent {
                Ok(token) => cluster.open = Some((token, now)),
                Err(status) => {
                    let fault = DiscoveryFault::Unreachable(format!(
                        "Envoy refused the call through cluster {}: {status}",
                        discovery.admin_cluster
                    ));
                    failed(vm.host(), config, discovery, cluster, &fault);
                }
            }
        }
    }
    vm.put_discovery_polling(state);
}

/// `on_http_call_response`: true if `token` was a read of the admin (then
/// the list is stored, or the failure counted).
pub fn answer<H: Host + Clone>(
    vm: &mut Vm<H>,
    config: &Config,
    token: u32,
    num_headers: usize,
    body_size: usize,
) -> bool {
    let Some(discovery) = &config.discovery else {
        return false;
    };
    let mut state = vm.take_discovery_polling();
    let ours = state
        .clusters
        .get_mut(&discovery.cluster)
        .filter(|c| c.open.is_some_and(|(open, _)| open == token));
    let Some(cluster) = ours else {
        vm.put_discovery_polling(state);
        return false;
    };
    cluster.open = None;
    let (status, body) = read_answer(vm.host(), num_headers, body_size, MAX_BODY_BYTES);
    let verdict = match status {
        None => Err(DiscoveryFault::Unreachable(
            "reset, refused or timed out".to_string(),
        )),
        Some(200) => discovery::healthy_hosts(&body, &discovery.cluster),
        Some(status) => Err(DiscoveryFault::Status(status)),
    };
    match verdict {
        Ok(hosts) => {
            if cluster.failing {
                log::info!(
                    "prefix-router: discovery: cluster {}: Envoy's admin answers again",
                    discovery.cluster
                );
                cluster.failing = false;
            }
            let host = vm.host();
            if *cluster.fleet != *hosts {
                log::info!(
                    "prefix-router: discovery: cluster {} has {} healthy hosts: {}",
                    discovery.cluster,
                    hosts.len(),
                    hosts.join(", ")
                );
                let key = list_key(&discovery.cluster);
                if let Err(error) = host.set(&key, &discovery::encode(&hosts), None) {
                    log::warn!(
                        "prefix-router: discovery: cannot share cluster {}'s fleet: {error:?}",
                        discovery.cluster
                    );
                }
                cluster.fleet = Rc::from(hosts);
            }
            let gauge = &mut cluster.instances;
            if let Some(id) = stat_id(host, config, gauge, MetricKind::Gauge, INSTANCES) {
                let count = u64::try_from(cluster.fleet.len()).unwrap_or(u64::MAX);
                warn_on_error("set gauge", INSTANCES, host.record_metric(id, count));
            }
        }
        Err(fault) => failed(vm.host(), config, discovery, cluster, &fault),
    }
    vm.put_discovery_polling(state);
    true
}

/// A read gave no list: counted, warned about when it starts failing; the
/// last list stays.
fn failed(
    host: &impl Host,
    config: &Config,
    discovery: &DiscoveryConfig,
    cluster: &mut ClusterState,
    fault: &DiscoveryFault,
) {
    let counter = &mut cluster.failures;
    if let Some(id) = stat_id(host, config, counter, MetricKind::Counter, FAILURES) {
        warn_on_error("count", FAILURES, host.increment_metric(id, 1));
    }
    if !cluster.failing {
        cluster.failing = true;
        log::warn!(
            "prefix-router: discovery: cluster {} through {}: {fault}; decisions keep the last \
             fleet read ({} hosts) (stat {FAILURES})",
            discovery.cluster,
            discovery.admin_cluster,
            cluster.fleet.len()
        );
    }
}

/// The id of stat `name` under the configured fleet's name, defined on first
/// use and kept in `slot`.
fn stat_id(
    host: &impl Host,
    config: &Config,
    slot: &mut Option<Option<u32>>,
    kind: MetricKind,
    name: &str,
) -> Option<u32> {
    *slot.get_or_insert_with(|| {
        define_metric(host, kind, &fleet_stat_name(config.fleet.as_deref(), name))
    })
}
