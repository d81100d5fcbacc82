//! Support for the integration tests: a [`Harness`] is one real Envoy (from
//! `envoy/envoy.yaml`, with the built filter) in front of 7 recording upstream
//! instances on loopback; [`client`] sends requests whose framing and chunking
//! the test controls; [`bodies`] makes request bodies.
//!
//! Every test starts its own harness on ephemeral ports, so tests run in
//! parallel and nothing is shared; dropping the harness stops everything.

pub mod bodies;
pub mod client;
pub mod load;
pub mod relay;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use prefix_router_tools::envoy::{Envoy, EnvoyBuilder};
use prefix_router_tools::upstream::{RecordedRequest, UpstreamFleet};

pub use client::{Framing, Outgoing, Reply};

/// Instances behind Envoy in every test (as in the demo and the reference fleet).
pub const INSTANCES: usize = 7;
/// The filter's default key header (see the briefing's conventions).
pub const KEY_HEADER: &str = "x-prefix-route-key";
/// The filter's default tenant header.
pub const TENANT_HEADER: &str = "x-amzn-sagemaker-prefix-aware-id";
/// The header tests put on each request to find it again at the upstream.
pub const TEST_ID_HEADER: &str = "x-test-id";

/// One Envoy with 7 recording upstreams.
pub struct Harness {
    pub envoy: Envoy,
    pub fleet: UpstreamFleet,
}

impl Harness {
    /// Envoy from `envoy/envoy.yaml` with the filter and its shipped configuration.
    pub fn start() -> Self {
        Self::start_with(|builder| builder)
    }

    /// Same, with the plugin configuration replaced.
    pub fn with_plugin_config(json: &str) -> Self {
        let json = json.to_string();
        Self::start_with(move |builder| builder.plugin_config(json))
    }

    /// Same, with any further launcher options.
    pub fn start_with(customise: impl FnOnce(EnvoyBuilder) -> EnvoyBuilder) -> Self {
        Self::start_prepared(|_| {}, customise)
    }

    /// [`Harness::start_with`], with the instances set up by `prepare`
    /// before Envoy starts (e.g. what their `/metrics` answers).
    pub fn start_prepared(
        prepare: impl FnOnce(&UpstreamFleet),
        customise: impl FnOnce(EnvoyBuilder) -> EnvoyBuilder,
    ) -> Self {
        Self::start_sized(INSTANCES, prepare, customise)
    }

    /// [`Harness::start_prepared`] in front of `instances` instances.
    pub fn start_sized(
        instances: usize,
        prepare: impl FnOnce(&UpstreamFleet),
        customise: impl FnOnce(EnvoyBuilder) -> EnvoyBuilder,
    ) -> Self {
        let fleet = UpstreamFleet::start(instances)
            .unwrap_or_else(|e| panic!("starting upstream instances: {e:#}"));
        prepare(&fleet);
        let builder = Envoy::builder().upstreams(fleet.addrs());
        let envoy = customise(builder).start().unwrap_or_else(|e| panic!("{e}"));
        Harness { envoy, fleet }
    }

    /// Sends one request to Envoy's listener; panics on a transport error.
    pub async fn send(&self, request: Outgoing) -> Reply {
        let what = format!("{} {}", request.method, request.path);
        client::send(self.envoy.listener_addr(), request)
            .await
            .unwrap_or_else(|e| {
                panic!("{what}: {e:#}\n--- Envoy log tail ---\n{}", self.log_tail())
            })
    }

    /// Sends many requests, at most `parallel` at a time; replies in input order.
    pub async fn send_all(&self, requests: Vec<Outgoing>, parallel: usize) -> Vec<Reply> {
        client::send_all(self.envoy.listener_addr(), requests, parallel)
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n--- Envoy log tail ---\n{}", self.log_tail()))
    }

    /// The single upstream record of the request tagged `test_id`; panics
    /// (with what was found) unless exactly one instance received it once.
    pub fn record_of(&self, test_id: &str) -> RecordedRequest {
        let found = self.fleet.records_with_header(TEST_ID_HEADER, test_id);
        match found.as_slice() {
            [one] => one.clone(),
            _ => panic!(
                "request {test_id} reached the upstreams {} times (expected once): {:?}",
                found.len(),
                found.iter().map(|r| &r.instance).collect::<Vec<_>>()
            ),
        }
    }

    /// The key header the upstream received for `test_id`, checked to be one
    /// value of 16 lowercase hex digits.
    pub fn key_of(&self, test_id: &str) -> String {
        let record = self.record_of(test_id);
        let values = record.header_values(KEY_HEADER);
        match values.as_slice() {
            [key] => {
                assert!(
                    is_key(key),
                    "request {test_id}: {KEY_HEADER} {key:?} is not 16 lowercase hex digits"
                );
                key.to_string()
            }
            _ => panic!(
                "request {test_id}: expected one {KEY_HEADER} value upstream, got {values:?}"
            ),
        }
    }

    /// The last lines of Envoy's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let log = self.envoy.log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

/// Whether `value` looks like the filter's key: 16 lowercase hex digits.
pub fn is_key(value: &str) -> bool {
    value.len() == 16
        && value
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Groups upstream records by a label derived from their test id, giving the
/// set of instances that served each label.
pub fn instances_by_label(
    records: &[RecordedRequest],
    label_of: impl Fn(&str) -> String,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut groups: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for record in records {
        if let Some(id) = record.header(TEST_ID_HEADER) {
            groups
                .entry(label_of(id))
                .or_default()
                .insert(record.instance.clone());
        }
    }
    groups
}

/// How often [`wait_until`] looks again.
const POLL_EVERY: Duration = Duration::from_millis(10);

/// Reads `probe` until `ready` holds of the reading, for at most `timeout`;
/// returns that reading and how long it took. Panics naming `what` (the
/// condition) with the last reading if it never holds: a test that goes on
/// without the state it needs cannot tell whether it tested.
pub async fn wait_until<T: std::fmt::Debug>(
    what: &str,
    timeout: Duration,
    mut probe: impl FnMut() -> T,
    ready: impl Fn(&T) -> bool,
) -> (T, Duration) {
    let start = Instant::now();
    loop {
        let reading = probe();
        if ready(&reading) {
            return (reading, start.elapsed());
        }
        assert!(
            start.elapsed() < timeout,
            "not true within {timeout:?}: {what}; last seen {reading:?}"
        );
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// A tokio runtime of two worker threads, for tests that run in-process
/// `vllm-sim` instances beside a blocking test body.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// The project's Envoy configuration files.
pub fn envoy_config(name: &str) -> PathBuf {
    prefix_router_tools::envoy::workspace_root()
        .join("envoy")
        .join(name)
}
