//! One worker VM's state, shared by every root and stream context of the VM
//! (listener and upstream filters, old and new configurations): the handle on
//! the shared load tables, the metric updates not yet handed to Envoy, the
//! per-instance stats (in-flight gauges, placed-bytes counters), when the
//! tick last did its work, the random source, and
//! the engine-load poller's state.
//! Kept across configuration updates (Envoy reuses the VM for them).

use std::collections::HashMap;
use std::rc::Rc;

use super::discovery_poll::DiscoveryPolling;
use super::engine_poll::EnginePolling;
use super::warn_on_error;
use crate::config::Config;
use crate::counting_check::{AtResponse, UpstreamFilterCheck};
use crate::host::{Host, MetricKind};
use crate::load::{InstanceLoad, LoadTracker};
use crate::metrics::{
    adapter_stat_name, fleet_stat_name, in_flight_gauge_name, placed_bytes_counter_name, FleetIds,
    UsageCounter,
};
use crate::steering;
use crate::strategy::RecentChoices;
use crate::usage::check::{check, ModelTokenBytes, Prediction, Verdict};
use crate::usage::Usage;

/// Most instances one VM defines a per-instance stat for, of each kind (the
/// in-flight gauges, the placed-bytes counters): Envoy never deletes a stat,
/// and the registry holds at most this many instances anyway.
pub const MAX_GAUGES: usize = crate::load::MAX_INSTANCES as usize;

/// Most adapters one VM defines a set-size gauge for: a bound on what
/// untrusted names can add to Envoy's stats.
pub const MAX_ADAPTER_GAUGES: usize = 64;

/// Most histogram samples a VM holds between ticks; past it a sample is
/// recorded at once.
pub const MAX_PENDING_SAMPLES: usize = 8_192;

/// See the module documentation.
#[derive(Debug)]
pub struct Vm<H: Host + Clone> {
    host: H,
    /// Created on first use (its nonce needs the random source).
    tracker: Option<LoadTracker<H>>,
    /// Where this VM's last decisions went (LONGEST_PREFIX's own state).
    recent: RecentChoices,
    /// When this VM last ran the tick's work (0: never).
    last_tick_ms: u64,
    /// In-flight gauge ids by instance address.
    gauges: FleetIds<HashMap<String, u32>>,
    /// Placed-bytes counter ids by instance address.
    placed_counters: FleetIds<HashMap<String, u32>>,
    /// Usage counter ids by instance address, one table per counter.
    usage_counters: [FleetIds<HashMap<String, u32>>; UsageCounter::ALL.len()],
    /// Adapters' set-size gauge ids by stat name.
    adapter_gauges: FleetIds<HashMap<String, u32>>,
    /// The `fleet` of the root configured last (`None` before any): the
    /// VM's roots share the per-instance stats, so they should agree.
    configured_fleet: Option<Option<String>>,
    /// Counter increments not yet handed to Envoy, by metric id: counting
    /// locally and flushing on the tick spares two host calls per request
    /// (Prometheus scrapes every few seconds; the counters lag by one tick).
    pending_counts: Vec<(u32, u64)>,
    /// Histogram samples not yet handed to Envoy, by metric id: recorded on
    /// the tick too, so the request's path makes one host call fewer (each
    /// sample is still recorded once, at most a tick late).
    pending_samples: Vec<(u32, u64)>,
    /// splitmix64 state; seeded on first use.
    random_state: Option<u64>,
    /// Listener role: whether an upstream filter counts (see
    /// `crate::counting_check`).
    upstream_check: UpstreamFilterCheck,
    /// Upstream role: this VM's upstream filter has left its mark.
    upstream_marked: bool,
    /// The engine-load poller's state (`engine_load`).
    engine_polling: EnginePolling,
    /// The fleet read from Envoy's admin (`discovery`).
    discovery_polling: DiscoveryPolling,
    /// An unreadable ORCA load report was warned about.
    orca_fault_warned: bool,
    /// Bytes per token of the prompts this VM routed, per model, from their
    /// usage.
    token_bytes: ModelTokenBytes,
}

impl<H: Host + Clone> Vm<H> {
    pub fn new(host: H) -> Self {
        Vm {
            host,
            tracker: None,
            recent: RecentChoices::default(),
            last_tick_ms: 0,
            gauges: FleetIds::default(),
            placed_counters: FleetIds::default(),
            usage_counters: Default::default(),
            adapter_gauges: FleetIds::default(),
            configured_fleet: None,
            pending_counts: Vec::new(),
            pending_samples: Vec::new(),
            random_state: None,
            upstream_check: UpstreamFilterCheck::default(),
            upstream_marked: false,
            engine_polling: EnginePolling::default(),
            discovery_polling: DiscoveryPolling::default(),
            orca_fault_warned: false,
            token_bytes: ModelTokenBytes::default(),
        }
    }

    /// The engine-load poller's state, taken out while the poller works on
    /// the VM (give it back with [`Self::put_engine_polling`]).
    pub fn take_engine_polling(&mut self) -> EnginePolling {
        std::mem::take(&mut self.engine_polling)
    }

    pub fn put_engine_polling(&mut self, state: EnginePolling) {
        self.engine_polling = state;
    }

    /// The discovery state, taken out while it works on the VM (give it
    /// back with [`Self::put_discovery_polling`]).
    pub fn take_discovery_polling(&mut self) -> DiscoveryPolling {
        std::mem::take(&mut self.discovery_polling)
    }

    pub fn put_discovery_polling(&mut self, state: DiscoveryPolling) {
        self.discovery_polling = state;
    }

    /// With `discovery`, the fleet last read from Envoy's admin, which
    /// `config`'s decisions take as their `instances`.
    pub fn discovered_fleet(&mut self, config: &Config) -> Option<Rc<[String]>> {
        let discovery = config.discovery.as_ref()?;
        Some(self.discovery_polling.fleet(&self.host, &discovery.cluster))
    }

    /// The engine-load poller's state (tests).
    pub fn engine_polling(&self) -> &EnginePolling {
        &self.engine_polling
    }

    /// True the first time it is asked: an unreadable ORCA load report is
    /// warned about once per VM (each one is counted).
    pub fn first_unreadable_orca_report(&mut self) -> bool {
        !std::mem::replace(&mut self.orca_fault_warned, true)
    }

    /// Judges a response's usage against its decision's prediction,
    /// learning this VM's bytes per token for the model from it.
    pub fn check_usage(&mut self, prediction: &Prediction, usage: Usage) -> Verdict {
        check(prediction, usage, &mut self.token_bytes)
    }

    /// Listener role: whether decisions should keep what counting at the
    /// response needs (no upstream filter seen counting yet).
    pub fn may_count_at_response(&self) -> bool {
        self.upstream_check.may_count_at_response()
    }

    /// Listener role, at the response of a request its decision left to an
    /// upstream filter to count: does one count (reads the shared mark when
    /// a look is due)?
    pub fn upstream_filter_check(&mut self, config: &Config, now_ms: u64) -> AtResponse {
        let mut check = std::mem::take(&mut self.upstream_check);
        let verdict = check.at_response(now_ms, || {
            self.with_tracker(config, |t| t.upstream_filter_marked())
        });
        self.upstream_check = check;
        verdict
    }

    /// Upstream role: leaves the mark that an upstream filter counts, once
    /// (this VM's listener knows at once; other VMs read the mark).
    pub fn mark_upstream_filter(&mut self, config: &Config, now_ms: u64) {
        self.upstream_check.upstream_filter_ran();
        if !self.upstream_marked {
            self.upstream_marked = self.with_tracker(config, |t| t.mark_upstream_filter(now_ms));
        }
    }

    pub fn host(&self) -> &H {
        &self.host
    }

    /// A root of this VM was configured with `fleet`. The VM's roots (the
    /// listener filter and its clusters' upstream filters under one `vm_id`)
    /// share the per-instance stats and the index stats, named by whichever
    /// root sets them: warns when this one names another fleet than the one
    /// configured before it (also, for a moment, while an update renames
    /// the fleet in one filter before the other).
    pub fn note_fleet(&mut self, fleet: Option<&str>) {
        let shown = |fleet: Option<&str>| fleet.map_or("none".to_string(), |f| format!("\"{f}\""));
        if let Some(previous) = &self.configured_fleet {
            if previous.as_deref() != fleet {
                log::warn!(
                    "prefix-router: filters of one vm_id name different fleets ({} and {}): \
                     their stats go under both names; give the listener filter and its \
                     clusters' upstream filter the same `fleet`",
                    shown(previous.as_deref()),
                    shown(fleet)
                );
            }
        }
        self.configured_fleet = Some(fleet.map(str::to_string));
    }

    /// The host clock; 0, with a warning, if the host cannot tell.
    pub fn now_ms(&self) -> u64 {
        self.host.now_ms().unwrap_or_else(|status| {
            log::warn!("prefix-router: cannot read the clock: {status}");
            0
        })
    }

    /// A fresh random number (the random policy's choice, the tracker's VM
    /// nonce). A splitmix64 sequence seeded once per VM from the host's
    /// entropy (WASI `random_get`, through a call that reports failure), or,
    /// should that fail, from the clock: std's `RandomState::new` panics when
    /// `random_get` fails, and a panic kills the VM for every request of the
    /// worker. The numbers need to be uniform, not secret; host entropy keeps
    /// the seeds (so the nonces) of VMs started in the same millisecond apart.
    pub fn random(&mut self) -> u64 {
        let state = match self.random_state {
            Some(state) => state,
            None => self.host.random_u64().unwrap_or_else(|| {
                log::warn!("prefix-router: no host entropy; random numbers seeded from the clock");
                self.now_ms()
            }),
        };
        let (next, output) = splitmix64(state);
        self.random_state = Some(next);
        output
    }

    /// Runs `f` on this VM's tracker ([`Self::decision_state`]).
    pub fn with_tracker<R>(
        &mut self,
        config: &Config,
        f: impl FnOnce(&mut LoadTracker<H>) -> R,
    ) -> R {
        f(self.decision_state(config).0)
    }

    /// This VM's tracker, created on first use, and its recent decisions:
    /// what a decision reads. The tracker is shared by every plugin of the
    /// VM, so each call applies the caller's own `instance_ttl_ms` (and
    /// `instances`, when it lists any) rather than whichever plugin
    /// configured last.
    pub fn decision_state(&mut self, config: &Config) -> (&mut LoadTracker<H>, &mut RecentChoices) {
        let nonce = if self.tracker.is_none() {
            self.random()
        } else {
            0
        };
        let host = &self.host;
        let tracker = self.tracker.get_or_insert_with(|| {
            LoadTracker::new(host.clone(), steering::load_config(config), nonce)
        });
        tracker.set_instance_ttl_ms(config.instance_ttl_ms);
        // An upstream filter's configuration need not repeat the list; the
        // listener's decisions apply theirs, empty included (see Stream::route).
        if !config.instances.is_empty() {
            tracker.set_configured_instances(&config.instances);
        }
        (tracker, &mut self.recent)
    }

    /// Counts one increment of counter `id`, handed to Envoy on the tick.
    pub fn count_later(&mut self, id: u32) {
        self.add_later(id, 1);
    }

    /// Adds `amount` to counter `id`, handed to Envoy on the tick.
    fn add_later(&mut self, id: u32, amount: u64) {
        match self
            .pending_counts
            .iter_mut()
            .find(|(pending_id, _)| *pending_id == id)
        {
            Some((_, delta)) => *delta = delta.saturating_add(amount),
            None => self.pending_counts.push((id, amount)),
        }
    }

    /// Adds `bytes` to the placed-bytes counter of `address` (named for
    /// `fleet`), handed to Envoy on the tick (nothing past [`MAX_GAUGES`]
    /// instances).
    pub fn count_placed_bytes(&mut self, fleet: Option<&str>, address: &str, bytes: u64) {
        let id = instance_stat_id(
            &self.host,
            &mut self.placed_counters,
            fleet,
            MetricKind::Counter,
            placed_bytes_counter_name,
            address,
        );
        if let Some(id) = id {
            self.add_later(id, bytes);
        }
    }

    /// Adds `amount` to `counter` of `address` (named for `fleet`), handed
    /// to Envoy on the tick (nothing past [`MAX_GAUGES`] instances). A zero
    /// defines the stat, so an instance's usage series all appear at once.
    pub fn count_usage(
        &mut self,
        fleet: Option<&str>,
        counter: UsageCounter,
        address: &str,
        amount: u64,
    ) {
        let Some(ids) = self.usage_counters.get_mut(counter.index()) else {
            return;
        };
        let name = |address: &str| crate::metrics::instance_stat_name(counter.prefix(), address);
        let id = instance_stat_id(&self.host, ids, fleet, MetricKind::Counter, name, address);
        if let (Some(id), true) = (id, amount > 0) {
            self.add_later(id, amount);
        }
    }

    /// Sets adapter `name`'s gauge to the `instances` of its set (named for
    /// `fleet`); past [`MAX_ADAPTER_GAUGES`] adapters none is defined.
    pub fn set_adapter_instances(&mut self, fleet: Option<&str>, name: &[u8], instances: u32) {
        let stat = adapter_stat_name(name);
        let ids = &mut self.adapter_gauges;
        let id = stat_id_of(
            &self.host,
            ids,
            fleet,
            MetricKind::Gauge,
            |s| s.to_string(),
            &stat,
            MAX_ADAPTER_GAUGES,
        );
        if let Some(id) = id {
            warn_on_error(
                "set gauge",
                &stat,
                self.host.record_metric(id, u64::from(instances)),
            );
        }
    }

    /// Holds a sample of histogram `id` for the tick (recorded at once if
    /// [`MAX_PENDING_SAMPLES`] are held already).
    pub fn record_later(&mut self, id: u32, value: u64) {
        if self.pending_samples.len() < MAX_PENDING_SAMPLES {
            self.pending_samples.push((id, value));
        } else {
            self.record_sample(id, value);
        }
    }

    fn record_sample(&self, id: u32, value: u64) {
        warn_on_error(
            "record metric",
            "histogram",
            self.host.record_metric(id, value),
        );
    }

    /// Hands this VM's counted increments and held histogram samples to Envoy.
    pub fn flush_metrics(&mut self) {
        for (id, delta) in std::mem::take(&mut self.pending_counts) {
            let delta = i64::try_from(delta).unwrap_or(i64::MAX);
            warn_on_error(
                "increment metric",
                "counter",
                self.host.increment_metric(id, delta),
            );
        }
        for (id, value) in std::mem::take(&mut self.pending_samples) {
            self.record_sample(id, value);
        }
    }

    /// Whether the tick's work is due at `now` (and if so, marks it done):
    /// every plugin of the VM (listener filter, each cluster's upstream
    /// filter) has a root that ticks; one tick per period does the work.
    pub fn tick_due(&mut self, now: u64, period_ms: u32) -> bool {
        let due = now.saturating_sub(self.last_tick_ms) >= u64::from(period_ms / 2);
        if due {
            self.last_tick_ms = now;
        }
        due
    }

    /// Sets every known instance's in-flight gauge, named for `fleet` (each
    /// VM computes the same totals from shared data; same-named gauges are
    /// one Envoy stat). Gauges of instances no longer registered drop to 0;
    /// past [`MAX_GAUGES`] no gauge is defined.
    pub fn publish_gauges(&mut self, fleet: Option<&str>, loads: &[InstanceLoad]) {
        for (address, id) in self.gauges.of(fleet).iter() {
            if !loads.iter().any(|l| &l.address == address) {
                warn_on_error("set gauge", address, self.host.record_metric(*id, 0));
            }
        }
        for load in loads {
            let id = instance_stat_id(
                &self.host,
                &mut self.gauges,
                fleet,
                MetricKind::Gauge,
                in_flight_gauge_name,
                &load.address,
            );
            if let Some(id) = id {
                warn_on_error(
                    "set gauge",
                    &load.address,
                    self.host.record_metric(id, u64::from(load.in_flight)),
                );
            }
        }
    }
}

/// The id of `fleet`'s per-instance stat `name(address)` in `ids`, defined
/// on first use; None past [`MAX_GAUGES`] instances or if the host refuses.
fn instance_stat_id(
    host: &impl Host,
    ids: &mut FleetIds<HashMap<String, u32>>,
    fleet: Option<&str>,
    kind: MetricKind,
    name: impl Fn(&str) -> String,
    address: &str,
) -> Option<u32> {
    stat_id_of(host, ids, fleet, kind, name, address, MAX_GAUGES)
}

/// The id of `fleet`'s stat `name(key)` in `ids`, defined on first use;
/// None past `max` keys or if the host refuses.
fn stat_id_of(
    host: &impl Host,
    ids: &mut FleetIds<HashMap<String, u32>>,
    fleet: Option<&str>,
    kind: MetricKind,
    name: impl Fn(&str) -> String,
    key: &str,
    max: usize,
) -> Option<u32> {
    let ids = ids.of(fleet);
    if let Some(id) = ids.get(key) {
        return Some(*id);
    }
    if ids.len() >= max {
        return None;
    }
    let id = define_metric(host, kind, &fleet_stat_name(fleet, &name(key)))?;
    ids.insert(key.to_string(), id);
    Some(id)
}

/// Defines a metric; `None`, with a warning, if the host refuses (the filter
/// then routes without that metric rather than failing requests).
pub(super) fn define_metric(host: &impl Host, kind: MetricKind, name: &str) -> Option<u32> {
    match host.define_metric(kind, name) {
        Ok(id) => Some(id),
        Err(status) => {
            log::warn!("prefix-router: cannot define metric {name}: {status}");
            None
        }
    }
}

/// One splitmix64 step: (next state, output).
fn splitmix64(state: u64) -> (u64, u64) {
    let next = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = next;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (next, z ^ (z >> 31))
}
