//! One root context per plugin: its configuration (read and validated on
//! every `on_configure`), the policy that configuration selects, its metric
//! ids, and the 1 s tick (metric flush, heartbeat, count repair, gauges), or a
//! faster one while the engines' load is polled (`engine_load`) or the fleet
//! is read from Envoy's admin (`discovery`).

use std::rc::Rc;

use super::discovery_poll;
use super::engine_poll;
use super::metric_ids::MetricIds;
use super::stream::Stream;
use super::vm::Vm;
use super::warn_on_error;
use crate::config::Config;
use crate::host::Host;
use crate::shared::{SetError, SharedStore};
use crate::steering;
use crate::strategy::Policy;

/// Root tick: heartbeat, count repair, gauges, metric flush.
pub const TICK_PERIOD_MS: u32 = 1_000;

/// See the module documentation.
#[derive(Debug)]
pub struct PluginRoot {
    config: Rc<Config>,
    policy: Rc<Policy>,
    metrics: Rc<MetricIds>,
}

impl Default for PluginRoot {
    /// The default configuration until `on_configure` brings one.
    fn default() -> Self {
        let config = Config::default();
        PluginRoot {
            policy: Rc::new(steering::policy_for(&config)),
            config: Rc::new(config),
            metrics: Rc::new(MetricIds::default()),
        }
    }
}

impl PluginRoot {
    /// `on_configure`: reads and validates the configuration; false (Envoy
    /// then rejects it) if it cannot be read or is invalid, and the previous
    /// configuration stays.
    pub fn configure<H: Host + Clone>(
        &mut self,
        vm: &mut Vm<H>,
        configuration_size: usize,
    ) -> bool {
        let host = vm.host().clone();
        // Every age and period the filter keeps is read off this clock; a
        // host without it would leave them all at 0, so nothing expired.
        if let Err(status) = host.now_ms() {
            log::error!(
                "prefix-router: the host gives no monotonic clock (WASI clock_time_get, \
                 CLOCK_MONOTONIC: {status}); the filter needs one, configuration rejected"
            );
            return false;
        }
        // No configuration at all means all defaults (no buffer to read).
        let bytes = match configuration_size {
            0 => Ok(None),
            size => host.plugin_configuration(size),
        };
        let bytes = match bytes {
            Ok(bytes) => bytes.unwrap_or_default(),
            Err(status) => {
                log::error!("prefix-router: cannot read the plugin configuration: {status}");
                return false;
            }
        };
        match Config::parse(&bytes) {
            Ok(config) => {
                // Envoy's name of this filter; unreadable, the plugins of a vm_id share one record.
                let plugin = host.property(&["plugin_name"]).ok().flatten();
                let plugin = String::from_utf8_lossy(plugin.as_deref().unwrap_or_default());
                if first_to_announce(&host, &plugin, &bytes) {
                    announce(&config);
                }
                vm.note_fleet(config.fleet.as_deref());
                self.policy = Rc::new(steering::policy_for(&config));
                self.config = Rc::new(config);
                // Once per root context and fleet: on_configure runs again on
                // updates, most of which keep the names.
                let fleet = self.config.fleet.as_deref();
                if !self.metrics.are_defined_for(fleet) {
                    self.metrics = Rc::new(MetricIds::define(&host, fleet));
                }
                // Polling ticks faster than the rest of the tick's work,
                // which `Vm::tick_due` keeps to once per TICK_PERIOD_MS.
                let engine_period = self
                    .config
                    .engine_load
                    .as_ref()
                    .map_or(TICK_PERIOD_MS, engine_poll::tick_period_ms);
                let discovery_period = self
                    .config
                    .discovery
                    .as_ref()
                    .map_or(TICK_PERIOD_MS, discovery_poll::tick_period_ms);
                let period = engine_period.min(discovery_period).min(TICK_PERIOD_MS);
                warn_on_error("set tick period", "root", host.set_tick_period_ms(period));
                true
            }
            Err(error) => {
                log::error!("prefix-router: invalid plugin configuration, rejected: {error}");
                false
            }
        }
    }

    /// `on_tick`: hands the VM's batched metrics to Envoy; once per period
    /// across the VM's roots, renews the VM's lease, repairs its counts and
    /// publishes the in-flight gauges.
    pub fn tick<H: Host + Clone>(&self, vm: &mut Vm<H>) {
        vm.flush_metrics();
        let now = vm.now_ms();
        if let Some(engine) = &self.config.engine_load {
            engine_poll::tick(vm, &self.config, engine, now);
        }
        if let Some(discovery) = &self.config.discovery {
            discovery_poll::tick(vm, &self.config, discovery, now);
        }
        if !vm.tick_due(now, TICK_PERIOD_MS) {
            return;
        }
        let (loads, index_writes, capacity) = vm.with_tracker(&self.config, |t| {
            (t.tick(now), t.take_index_writes(), t.index_capacity())
        });
        vm.publish_gauges(self.config.fleet.as_deref(), &loads);
        self.metrics.publish_index(vm, &index_writes, capacity);
    }

    /// `on_http_call_response`: an answer to one of this root's reads of
    /// Envoy's admin or engine polls.
    pub fn http_call_response<H: Host + Clone>(
        &self,
        vm: &mut Vm<H>,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) {
        if discovery_poll::answer(vm, &self.config, token, num_headers, body_size) {
            return;
        }
        let now = vm.now_ms();
        engine_poll::answer(vm, &self.config, token, num_headers, body_size, now);
    }

    /// `create_http_context`: a stream that keeps this root's configuration,
    /// policy and metric ids for its whole life.
    pub fn new_stream(&self) -> Stream {
        Stream::new(
            Rc::clone(&self.config),
            Rc::clone(&self.policy),
            Rc::clone(&self.metrics),
        )
    }
}

/// Most reads of the announcement record before giving up (other VMs are
/// writing it, so one of them announces).
const ANNOUNCE_ATTEMPTS: u32 = 8;

/// Whether this VM is the first to apply `configuration` to `plugin` (the
/// filter's name): every worker VM and Envoy's canary VM run `on_configure`
/// with it and share one shared-data map per `vm_id`, whose record of each
/// plugin's last configuration makes its summary logged once, not per VM,
/// and again when a later update brings back an earlier configuration. A
/// host that refuses shared data gets the summary from every VM.
fn first_to_announce(store: &impl SharedStore, plugin: &str, configuration: &[u8]) -> bool {
    let key = format!("prefix-router/configured/{plugin}");
    let applied = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(configuration));
    for _ in 0..ANNOUNCE_ATTEMPTS {
        let (value, cas) = store.get(&key);
        if value.as_deref() == Some(applied.as_bytes()) {
            return false;
        }
        match store.replace(&key, applied.as_bytes(), cas) {
            Ok(()) | Err(SetError::Failed) => return true,
            Err(SetError::CasMismatch) => {}
        }
    }
    false
}

/// The configuration's summary and warnings (Envoy prefixes the plugin's name).
fn announce(config: &Config) {
    log::info!(
        "configured: strategy {}, match {}, prefix_length {}, block_bytes {}, index_bytes {}, load_margin {}, cold_placement {}, concurrency_threshold {}, max_body_bytes {}, key_header {}, host_header {}, tenant_header {}, decision_header {}, read_usage {}, instance_ttl_ms {}, include_model {}, body_tenant {}, counting {}, {} configured instances, discovery {}, {} path rules, engine_load {}, fleet {}",
        config.strategy.as_str(),
        config.matching.as_str(),
        config.prefix_length,
        config.block_bytes,
        config.index_bytes,
        config.load_margin,
        config.cold_placement.as_str(),
        config.concurrency_threshold,
        config.max_body_bytes,
        config.key_header,
        config.host_header.as_deref().unwrap_or("(none: overflow re-keys)"),
        config.tenant_header,
        config.decision_header.as_deref().unwrap_or("(none)"),
        config.read_usage,
        config.instance_ttl_ms,
        config.include_model,
        config.body_tenant,
        config.counting.as_str(),
        config.instances.len(),
        config.discovery.as_ref().map_or_else(
            || "off".to_string(),
            |d| format!(
                "(cluster {} through {}, interval_ms {})",
                d.cluster, d.admin_cluster, d.interval_ms
            )
        ),
        config.path_rules.len(),
        config
            .engine_load
            .as_ref()
            .map_or_else(|| "off".to_string(), |e| format!("({})", e.describe())),
        config.fleet.as_deref().unwrap_or("(none)")
    );
    let listed = config.instances.len();
    for warning in config.engine_load.iter().flat_map(|e| e.warnings(listed)) {
        log::warn!("prefix-router: {warning}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::MemoryStore;

    #[test]
    fn a_configuration_is_announced_by_the_first_vm_to_apply_it_only() {
        // The canary and two workers of one vm_id, each with a listener and
        // an upstream filter configured differently.
        let store = MemoryStore::new();
        let listener = br#"{"strategy":"LONGEST_PREFIX"}"#;
        let upstream = br#"{"key_header":"x-k"}"#;
        assert!(first_to_announce(&store, "listener", listener));
        assert!(first_to_announce(&store, "upstream", upstream));
        for _worker in 0..2 {
            assert!(!first_to_announce(&store, "listener", listener));
            assert!(!first_to_announce(&store, "upstream", upstream));
        }
        // An update, then back to the first configuration: each is announced once.
        let updated = br#"{"strategy":"LONGEST_PREFIX","prefix_length":8192}"#;
        for configuration in [&updated[..], &listener[..]] {
            assert!(first_to_announce(&store, "listener", configuration));
            assert!(!first_to_announce(&store, "listener", configuration));
        }
        // Another vm_id has its own shared data, and announces it again.
        assert!(first_to_announce(&MemoryStore::new(), "listener", listener));
    }
}
