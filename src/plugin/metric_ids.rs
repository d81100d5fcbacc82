//! Envoy's ids for the filter's counters and histogram, defined once per root
//! context, and how a request's derivation and decision move them (through
//! the VM's batch, handed to Envoy on the tick).

use super::vm::{define_metric, Vm};
use super::warn_on_error;
use crate::host::{Host, MetricKind};
use crate::load::Remembered;
use crate::metrics::{
    decision_counter_name, decision_index, fleet_stat_name, recording_for, Counter,
    ADAPTER_SET_INSTANCES, BYTES_INSPECTED, DECISION_KINDS, INDEX_CAPACITY, INDEX_ENTRIES,
    INDEX_EVICTIONS, MATCHED_BYTES,
};
use crate::request::KeyDerivation;
use crate::strategy::{AdapterDecision, AdapterPlacement, DecisionKind};

/// `None` where defining failed (the filter then routes without counting
/// rather than failing requests).
#[derive(Debug, Default)]
pub struct MetricIds {
    /// The `fleet` the names were defined for.
    fleet: Option<String>,
    counters: [Option<u32>; Counter::ALL.len()],
    decisions: [Option<u32>; DECISION_KINDS.len()],
    bytes_inspected: Option<u32>,
    matched_bytes: Option<u32>,
    adapter_set_instances: Option<u32>,
    index_entries: Option<u32>,
    index_capacity: Option<u32>,
    index_evictions: Option<u32>,
}

impl MetricIds {
    /// Defines every stat under the names of `fleet` (see
    /// [`fleet_stat_name`]).
    pub fn define(host: &impl Host, fleet: Option<&str>) -> MetricIds {
        let define = |kind, name: &str| define_metric(host, kind, &fleet_stat_name(fleet, name));
        let mut ids = MetricIds {
            fleet: fleet.map(str::to_string),
            ..MetricIds::default()
        };
        for counter in Counter::ALL {
            if let Some(slot) = ids.counters.get_mut(counter.index()) {
                *slot = define(MetricKind::Counter, counter.name());
            }
        }
        for (slot, kind) in ids.decisions.iter_mut().zip(DECISION_KINDS) {
            *slot = define(MetricKind::Counter, &decision_counter_name(kind));
        }
        ids.bytes_inspected = define(MetricKind::Histogram, BYTES_INSPECTED);
        ids.matched_bytes = define(MetricKind::Histogram, MATCHED_BYTES);
        ids.adapter_set_instances = define(MetricKind::Histogram, ADAPTER_SET_INSTANCES);
        ids.index_entries = define(MetricKind::Gauge, INDEX_ENTRIES);
        ids.index_capacity = define(MetricKind::Gauge, INDEX_CAPACITY);
        ids.index_evictions = define(MetricKind::Counter, INDEX_EVICTIONS);
        ids
    }

    /// Whether these ids are `fleet`'s and defined: nothing to define again
    /// (an update that names another fleet defines that fleet's; Envoy keeps
    /// the old names' stats as they were).
    pub fn are_defined_for(&self, fleet: Option<&str>) -> bool {
        let defined = self.bytes_inspected.is_some()
            || self.counters.iter().any(Option::is_some)
            || self.decisions.iter().any(Option::is_some);
        defined && self.fleet.as_deref() == fleet
    }

    pub fn increment<H: Host + Clone>(&self, vm: &mut Vm<H>, counter: Counter) {
        if let Some(Some(id)) = self.counters.get(counter.index()) {
            vm.count_later(*id);
        }
    }

    pub fn increment_decision<H: Host + Clone>(&self, vm: &mut Vm<H>, kind: DecisionKind) {
        if let Some(Some(id)) = self.decisions.get(decision_index(kind)) {
            vm.count_later(*id);
        }
    }

    /// On the tick: the prefix index's entries newly filled and evicted by
    /// this VM (every VM adds its own to the same stats), and its capacity.
    pub fn publish_index<H: Host + Clone>(
        &self,
        vm: &mut Vm<H>,
        writes: &Remembered,
        capacity: Option<u64>,
    ) {
        let host = vm.host();
        if let (Some(id), true) = (self.index_entries, writes.filled > 0) {
            warn_on_error(
                "increment gauge",
                INDEX_ENTRIES,
                host.increment_metric(id, i64::from(writes.filled)),
            );
        }
        if let (Some(id), true) = (self.index_evictions, writes.evicted > 0) {
            warn_on_error(
                "increment counter",
                INDEX_EVICTIONS,
                host.increment_metric(id, i64::from(writes.evicted)),
            );
        }
        if let (Some(id), Some(capacity)) = (self.index_capacity, capacity) {
            warn_on_error(
                "set gauge",
                INDEX_CAPACITY,
                host.record_metric(id, capacity),
            );
        }
    }

    pub fn record_matched_bytes<H: Host + Clone>(&self, vm: &mut Vm<H>, bytes: u64) {
        if let Some(id) = self.matched_bytes {
            vm.record_later(id, bytes);
        }
    }

    /// A decision for a LoRA adapter: where it went against the set, and
    /// the set's size.
    pub fn record_adapter<H: Host + Clone>(&self, vm: &mut Vm<H>, decision: AdapterDecision) {
        self.increment(
            vm,
            match decision.placement {
                AdapterPlacement::InSet => Counter::AdapterInSet,
                AdapterPlacement::SetGrown => Counter::AdapterSetGrown,
                AdapterPlacement::OutsideSet => Counter::AdapterOutsideSet,
            },
        );
        if let Some(id) = self.adapter_set_instances {
            vm.record_later(id, u64::from(decision.set_size));
        }
    }

    pub fn record_derivation<H: Host + Clone>(&self, vm: &mut Vm<H>, derivation: &KeyDerivation) {
        let recording = recording_for(derivation);
        for counter in recording.counters {
            self.increment(vm, counter);
        }
        if let (Some(id), Some(bytes)) = (self.bytes_inspected, recording.bytes_inspected) {
            vm.record_later(id, bytes);
        }
    }
}
