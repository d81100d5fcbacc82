//! What the benchmarks need to run the filter with `engine_load`: its
//! plugin fields, the Envoy cluster the poller's `dispatch_http_call` goes
//! through (added to the rendered configuration unless the file has one of
//! that name), and the poller's counters on Envoy's `/stats`, which show
//! whether it polled at all.

use std::collections::BTreeMap;

use anyhow::{anyhow, Context as _};
use serde_json::json;
use serde_yaml::Value;

use super::fleet::{counters_after, summed_over};
use crate::envoy::{Envoy, EnvoyBuilder};

/// The cluster `engine_load.cluster` names.
pub const ENGINE_CLUSTER: &str = "engine_metrics";

/// The `engine_load` object: the cluster, and `interval_ms` if given
/// (otherwise the filter's default); every other field at its default.
pub fn engine_load_config(interval_ms: Option<u64>) -> serde_json::Value {
    let mut config = json!({ "cluster": ENGINE_CLUSTER });
    if let Some(interval_ms) = interval_ms {
        config["interval_ms"] = json!(interval_ms);
    }
    config
}

/// The cluster the poller calls through, as Envoy's `original_dst_cluster`
/// reads a call: ORIGINAL_DST with `use_http_header`, so each call goes to
/// the `ip:port` in its `x-envoy-original-dst-host` header (the instance
/// polled), over plain HTTP/1.1 with no filter of its own.
pub fn engine_cluster_yaml() -> String {
    format!(
        "name: {ENGINE_CLUSTER}\n\
         type: ORIGINAL_DST\n\
         lb_policy: CLUSTER_PROVIDED\n\
         connect_timeout: 1s\n\
         original_dst_lb_config:\n  use_http_header: true\n"
    )
}

/// Adds [`engine_cluster_yaml`] to `static_resources.clusters` unless a
/// cluster of that name is there (the file's own is kept as it is).
pub fn ensure_engine_cluster(config: &mut Value) -> anyhow::Result<()> {
    let clusters = config
        .get_mut("static_resources")
        .and_then(|s| s.get_mut("clusters"))
        .and_then(Value::as_sequence_mut)
        .ok_or_else(|| anyhow!("no static_resources.clusters list"))?;
    let present = clusters
        .iter()
        .any(|c| c.get("name").and_then(Value::as_str) == Some(ENGINE_CLUSTER));
    if !present {
        let cluster: Value =
            serde_yaml::from_str(&engine_cluster_yaml()).context("the engine cluster")?;
        clusters.push(cluster);
    }
    Ok(())
}

/// `builder` with the engine cluster in its rendered configuration.
pub fn with_engine_cluster(builder: EnvoyBuilder) -> EnvoyBuilder {
    builder.edit(ensure_engine_cluster)
}

/// Whether a plugin configuration polls engines (has a non-null `engine_load`).
pub fn polls_engines(plugin_config: &serde_json::Value) -> bool {
    plugin_config
        .get("engine_load")
        .is_some_and(|v| !v.is_null())
}

/// The poller's counters in Envoy's `/stats` text, by what they count:
/// `polls`, `polls_skipped`, `poll_failures.<reason>` (from
/// `wasmcustom.prefix_router.engine.*`). Gauges (requests, KV usage, sample
/// age per instance) are left out: they are not counts.
pub fn poll_counts(stats: &str) -> BTreeMap<String, u64> {
    counters_after(stats, "prefix_router.engine.", |kind| {
        kind.starts_with("poll").then_some(kind)
    })
}

/// [`poll_counts`] of every Envoy in `envoys`, summed (an Envoy whose admin
/// interface does not answer adds nothing).
pub fn poll_counts_of(envoys: &[Envoy]) -> BTreeMap<String, u64> {
    summed_over(envoys, "prefix_router.engine", poll_counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_cluster_is_added_once_and_a_files_own_is_kept() {
        let mut config: Value = serde_yaml::from_str(
            "static_resources:\n  clusters:\n  - name: vllm\n    type: STATIC\n",
        )
        .unwrap();
        ensure_engine_cluster(&mut config).unwrap();
        ensure_engine_cluster(&mut config).unwrap();
        let clusters = config["static_resources"]["clusters"]
            .as_sequence()
            .unwrap();
        assert_eq!(clusters.len(), 2);
        assert_eq!(clusters[1]["type"].as_str(), Some("ORIGINAL_DST"));
        assert_eq!(
            clusters[1]["original_dst_lb_config"]["use_http_header"].as_bool(),
            Some(true)
        );
        let mut own: Value = serde_yaml::from_str(&format!(
            "static_resources:\n  clusters:\n  - name: {ENGINE_CLUSTER}\n    type: STRICT_DNS\n"
        ))
        .unwrap();
        ensure_engine_cluster(&mut own).unwrap();
        let clusters = own["static_resources"]["clusters"].as_sequence().unwrap();
        assert_eq!(clusters.len(), 1);
        assert_eq!(clusters[0]["type"].as_str(), Some("STRICT_DNS"));
    }

    #[test]
    fn engine_load_names_the_cluster_and_the_interval_if_given() {
        assert_eq!(
            engine_load_config(None),
            json!({"cluster": "engine_metrics"})
        );
        assert_eq!(engine_load_config(Some(50))["interval_ms"], 50);
        assert!(polls_engines(
            &json!({"engine_load": engine_load_config(None)})
        ));
        assert!(!polls_engines(&json!({"engine_load": null})));
        assert!(!polls_engines(&json!({"strategy": "PREFIX_AWARE"})));
    }

    #[test]
    fn poll_counters_are_read_and_gauges_left_out() {
        let stats = "\
wasmcustom.prefix_router.engine.polls: 120
wasmcustom.prefix_router.engine.polls_skipped: 2
wasmcustom.prefix_router.engine.poll_failures.timeout: 3
wasmcustom.prefix_router.engine.requests.127_0_0_1_8001: 4
wasmcustom.prefix_router.decision.prefix: 9
";
        let counts = poll_counts(stats);
        let expected: BTreeMap<String, u64> = [
            ("polls", 120),
            ("polls_skipped", 2),
            ("poll_failures.timeout", 3),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        assert_eq!(counts, expected);
    }
}
