//! Configuration end to end: the shipped Envoy files are accepted by Envoy
//! (`--mode validate`, which also loads the .wasm and runs its configuration
//! check) and follow the conventions the filter relies on; an invalid plugin
//! configuration (a key given twice included, also under `--mode validate`)
//! is refused with a log line naming the field; a valid non-default one
//! takes effect.

use std::time::Duration;

use harness::{bodies, envoy_config, Harness, Outgoing};
use prefix_router_tools::envoy::{self, Envoy};
use serde_yaml::Value;

/// The .wasm path written in the shipped files, relative to the repository root.
const SHIPPED_WASM_PATH: &str = "target/wasm32-wasip1/release/prefix_router.wasm";
const SHIPPED_CONFIGS: [(&str, &str); 2] = [
    ("envoy.yaml", "MAGLEV"),
    ("envoy-ring-hash.yaml", "RING_HASH"),
];

#[test]
fn shipped_configs_pass_envoy_validation() {
    let wasm = envoy::require_wasm().unwrap_or_else(|e| panic!("{e:#}"));
    let scratch = tempfile::tempdir().unwrap();
    for (name, _) in SHIPPED_CONFIGS {
        let text = std::fs::read_to_string(envoy_config(name)).unwrap();
        assert!(
            text.contains(SHIPPED_WASM_PATH),
            "{name} must load {SHIPPED_WASM_PATH}"
        );
        // The file as shipped, except the .wasm path when this run's build lives elsewhere.
        let text = text.replace(SHIPPED_WASM_PATH, &wasm.to_string_lossy());
        let path = scratch.path().join(name);
        std::fs::write(&path, text).unwrap();
        let validation = envoy::validate_config(&path, &envoy::workspace_root()).unwrap();
        assert!(
            validation.accepted,
            "Envoy refuses {name}:\n{}",
            validation.output
        );
    }
}

#[test]
fn shipped_configs_follow_the_filter_conventions() {
    for (name, lb_policy) in SHIPPED_CONFIGS {
        let config: Value =
            serde_yaml::from_str(&std::fs::read_to_string(envoy_config(name)).unwrap()).unwrap();
        let listener = &config["static_resources"]["listeners"][0];
        assert_eq!(
            listener["address"]["socket_address"]["address"], "0.0.0.0",
            "{name}"
        );
        assert_eq!(
            listener["address"]["socket_address"]["port_value"], 10000,
            "{name}"
        );
        assert_eq!(
            config["admin"]["address"]["socket_address"]["address"], "127.0.0.1",
            "{name}"
        );
        assert_eq!(
            config["admin"]["address"]["socket_address"]["port_value"], 9901,
            "{name}"
        );

        let hcm = &listener["filter_chains"][0]["filters"][0]["typed_config"];
        let filters = hcm["http_filters"].as_sequence().expect("http_filters");
        let wasm = &filters[0]["typed_config"];
        assert_eq!(
            wasm["@type"],
            envoy::WASM_FILTER_TYPE,
            "{name}: the filter comes first"
        );
        assert_eq!(
            filters.last().unwrap()["name"],
            "envoy.filters.http.router",
            "{name}"
        );
        let plugin = &wasm["config"];
        assert_eq!(
            plugin["allow_on_headers_stop_iteration"], true,
            "{name}: requests would hang"
        );
        assert_eq!(
            plugin["vm_config"]["runtime"], "envoy.wasm.runtime.v8",
            "{name}"
        );
        let plugin_json: serde_json::Value = serde_json::from_str(
            plugin["configuration"]["value"]
                .as_str()
                .expect("StringValue"),
        )
        .unwrap();
        let key_header = plugin_json["key_header"]
            .as_str()
            .unwrap_or("x-prefix-route-key");
        let max_body_bytes = plugin_json["max_body_bytes"].as_u64().unwrap_or(1 << 20);

        let route = &hcm["route_config"]["virtual_hosts"][0]["routes"][0];
        assert_eq!(
            route["route"]["hash_policy"][0]["header"]["header_name"], key_header,
            "{name}: hash_policy must hash the filter's key header"
        );
        let limit = route["request_body_buffer_limit"]
            .as_u64()
            .expect("request_body_buffer_limit");
        assert!(
            limit >= 2 * max_body_bytes,
            "{name}: buffer limit {limit} too close to max_body_bytes {max_body_bytes} (413s)"
        );
        let timeout = route["route"]["timeout"].as_str().unwrap_or("15s");
        let seconds: u64 = timeout.trim_end_matches('s').parse().unwrap();
        assert!(
            seconds == 0 || seconds >= 300,
            "{name}: route timeout {timeout} cuts LLM streams"
        );

        let cluster = &config["static_resources"]["clusters"][0];
        assert_eq!(cluster["name"], "vllm", "{name}");
        assert_eq!(cluster["lb_policy"], lb_policy, "{name}");
        let ports: Vec<u64> = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|e| {
                e["endpoint"]["address"]["socket_address"]["port_value"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(
            ports,
            (8001..=8007).collect::<Vec<_>>(),
            "{name}: the demo's 7 instances"
        );
    }
}

/// Starts Envoy with a plugin configuration that must be refused; returns
/// Envoy's log, checked to contain a line logged by the plugin itself
/// (Envoy prefixes those with `wasm log`) that mentions all of `must_mention`.
fn refused(plugin_config: &str, must_mention: &[&str]) -> String {
    let fleet = prefix_router_tools::upstream::UpstreamFleet::start(1).unwrap();
    let outcome = Envoy::builder()
        .upstreams(fleet.addrs())
        .plugin_config(plugin_config)
        .startup_timeout(Duration::from_secs(15))
        .start();
    let error = match outcome {
        Ok(envoy) => {
            let log = envoy.log();
            let lines: Vec<&str> = log.lines().collect();
            panic!(
                "Envoy started and serves with the invalid plugin configuration {plugin_config}\n{}",
                lines[lines.len().saturating_sub(30)..].join("\n")
            )
        }
        Err(error) => error,
    };
    let line = error
        .log
        .lines()
        .filter(|line| line.contains("wasm log"))
        .find(|line| must_mention.iter().all(|word| line.contains(word)));
    assert!(
        line.is_some(),
        "no log line names {must_mention:?} for {plugin_config}:\n{}",
        error.log_tail()
    );
    error.log
}

#[test]
fn prefix_length_out_of_range_is_refused_with_the_reason() {
    refused(r#"{"prefix_length": 100}"#, &["prefix_length", "100"]);
    refused(r#"{"prefix_length": 70000}"#, &["prefix_length", "70000"]);
}

#[test]
fn an_unknown_field_is_refused_with_its_name() {
    // A typo must never silently do nothing.
    refused(r#"{"prefix_lenght": 4096}"#, &["prefix_lenght"]);
}

#[test]
fn other_invalid_values_are_refused_with_the_field_name() {
    refused(
        r#"{"concurrency_threshold": 0}"#,
        &["concurrency_threshold"],
    );
    refused(r#"{"strategy": "FASTEST"}"#, &["strategy"]);
    // Not JSON at all: no field to name, but the plugin must still say why.
    refused("not json", &[]);
}

#[test]
fn a_key_given_twice_is_refused_by_envoy_validate() {
    // serde_json alone keeps the last value: 10, accepted, where 0 alone is
    // refused. `--mode validate` runs the filter's configure like a start.
    let validate = |plugin_config: &str| {
        Envoy::builder()
            .plugin_config(plugin_config)
            .validate()
            .unwrap_or_else(|e| panic!("{e:#}"))
    };
    let twice = validate(r#"{"concurrency_threshold": 0, "concurrency_threshold": 10}"#);
    assert!(
        !twice.accepted,
        "Envoy accepts a duplicate key:\n{}",
        twice.output
    );
    let named = twice.output.lines().any(|line| {
        line.contains("wasm log")
            && line.contains("concurrency_threshold: given twice (0, then 10)")
    });
    assert!(
        named,
        "the plugin's log line does not name the key:\n{}",
        twice.output
    );
    let once = validate(r#"{"concurrency_threshold": 10}"#);
    assert!(
        once.accepted,
        "Envoy refuses the key given once:\n{}",
        once.output
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_prefix_length_takes_effect() {
    // Two bodies alike for their first 1024 bytes and different after: one key
    // with prefix_length 1024, two keys with the default 4096. FIXED_PREFIX:
    // its key is made of the first prefix_length bytes.
    let mut rng = bodies::rng(11);
    let shared = bodies::text(&mut rng, 1024);
    let first = format!("{shared}{}", bodies::text(&mut rng, 5000));
    let second = format!("{shared}{}", bodies::text(&mut rng, 5000));
    for (config, same) in [
        (r#"{"match": "FIXED_PREFIX", "prefix_length": 1024}"#, true),
        (r#"{"match": "FIXED_PREFIX"}"#, false),
    ] {
        let harness = Harness::with_plugin_config(config);
        for (id, body) in [("first", &first), ("second", &second)] {
            let reply = harness
                .send(Outgoing::post("/invocations", body.clone()).id(id))
                .await;
            assert_eq!(reply.status, 200, "{}", reply.text());
        }
        let keys = (harness.key_of("first"), harness.key_of("second"));
        assert_eq!(
            keys.0 == keys.1,
            same,
            "plugin configuration {config}: keys {keys:?}"
        );
    }
}

/// How many times each configuration summary is in Envoy's log, by the text
/// after `wasm log`; fails on the doubled prefix.
fn configuration_summaries(log: &str) -> std::collections::BTreeMap<&str, usize> {
    let mut summaries = std::collections::BTreeMap::new();
    for line in log.lines().filter(|l| l.contains("configured: strategy")) {
        assert!(
            !line.contains("prefix-router: configured"),
            "doubled prefix: {line}"
        );
        let from = line.find("wasm log").unwrap_or(0);
        *summaries.entry(&line[from..]).or_default() += 1;
    }
    assert!(!summaries.is_empty(), "no configuration summary:\n{log}");
    summaries
}

/// Requests on both workers: their VMs are configured by then.
async fn send_on_both_workers(harness: &Harness) {
    for i in 0..4 {
        let reply = harness
            .send(Outgoing::post("/invocations", format!("request {i}")))
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
}

/// Every worker VM and Envoy's canary VM apply each plugin configuration; its
/// summary is logged once all the same, under Envoy's own plugin prefix only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_configuration_summary_is_logged_once() {
    let harness = Harness::start_with(|builder| builder.concurrency(2));
    send_on_both_workers(&harness).await;
    let log = harness.envoy.log();
    for (summary, count) in configuration_summaries(&log) {
        assert_eq!(count, 1, "logged {count} times: {summary}");
    }
}

/// Live updates (ECDS) to a new configuration, another, then back to the
/// first: each application is logged once, the return included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_configuration_update_is_logged_once_returns_included() {
    let harness = Harness::start_with(|builder| builder.concurrency(2).dynamic_plugin_config());
    for key_header in ["x-a", "x-b", "x-a"] {
        let config = format!(r#"{{"key_header":"{key_header}"}}"#);
        harness.envoy.set_plugin_config(&config).unwrap();
        send_on_both_workers(&harness).await;
    }
    let log = harness.envoy.log();
    let summaries = configuration_summaries(&log);
    let count = |key_header: &str| -> usize {
        summaries
            .iter()
            .filter(|(summary, _)| summary.contains(&format!("key_header {key_header},")))
            .map(|(_, count)| count)
            .sum()
    };
    assert_eq!(count("x-a"), 2, "{summaries:#?}");
    assert_eq!(count("x-b"), 1, "{summaries:#?}");
    for (summary, count) in &summaries {
        if !summary.contains("key_header x-a,") {
            assert_eq!(*count, 1, "logged {count} times: {summary}");
        }
    }
}
