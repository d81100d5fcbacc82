//! Two fleets behind one listener (`examples/envoy-two-fleets/`): the file
//! passes validation, and a real Envoy started from it in front of two fleets
//! routes each fleet's requests with that fleet's filter alone: every
//! decision names an instance of the request's own fleet, a prompt sent again
//! goes where it went, and each request meets one filter, not both.
//!
//! Envoy comes from `ENVOY_BIN` or PATH; the filter from `PREFIX_ROUTER_WASM`
//! or the release build (`cargo xtask test` provides both).

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use prefix_router_tools::envoy::{self, Envoy};
use prefix_router_tools::upstream::UpstreamFleet;
use serde_yaml::Value;

use support::*;

const EXAMPLE: &str = "examples/envoy-two-fleets/envoy.yaml";

/// The fleets of the example: the `x-model` its route matches, its cluster
/// and its listener filter.
const FLEETS: [(&str, &str, &str); 2] = [
    ("llama-3.1-70b", "llama", "prefix_router_llama"),
    ("mistral-7b", "mistral", "prefix_router_mistral"),
];

/// Distinct prompts sent to each fleet, each twice.
const PROMPTS: usize = 30;

#[test]
fn two_fleets_example_passes_envoy_validate() {
    let mut config = yaml(EXAMPLE);
    set_wasm_filename(&mut config, &built_wasm());
    assert_envoy_accepts(&config, EXAMPLE);
}

#[test]
fn each_fleets_requests_meet_only_its_own_filter_and_instances() {
    let fleets = [
        UpstreamFleet::start(3).expect("fleet llama"),
        UpstreamFleet::start(2).expect("fleet mistral"),
    ];
    let addrs: Vec<Vec<SocketAddr>> = fleets.iter().map(UpstreamFleet::addrs).collect();
    let edited = addrs.clone();
    let envoy = Envoy::builder()
        .config_file(root().join(EXAMPLE))
        .edit(move |config| {
            for ((_, cluster, filter), fleet) in FLEETS.iter().zip(&edited) {
                set_cluster_endpoints(config, cluster, fleet);
                set_filter_instances(config, filter, fleet);
            }
            Ok(())
        })
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    for (((model, cluster, _), fleet), own) in FLEETS.iter().zip(&fleets).zip(&addrs) {
        let own: BTreeSet<String> = own.iter().map(ToString::to_string).collect();
        let mut served = BTreeSet::new();
        for i in 0..PROMPTS {
            let body = serde_json::json!({
                "model": model,
                "messages": [
                    {"role": "system", "content": "You answer questions about the fleet."},
                    {"role": "user", "content": format!("{cluster} question {i}: {}", "why ".repeat(40))},
                ],
            })
            .to_string();
            let headers = [("x-model", *model), ("content-type", "application/json")];
            let first = post(&envoy, "/v1/chat/completions", &headers, body.as_bytes());
            let again = post(&envoy, "/v1/chat/completions", &headers, body.as_bytes());
            assert_eq!(first, again, "{cluster} question {i} sent again moved");
            served.insert(first);
        }
        let records = fleet.records();
        assert_eq!(
            records.len(),
            2 * PROMPTS,
            "fleet {cluster} received other than its own requests"
        );
        for record in &records {
            let named = record.header(HOST_HEADER).unwrap_or("(none)");
            assert!(
                own.contains(named),
                "a {cluster} request's decision named {named}, not one of {own:?}"
            );
        }
        assert_eq!(
            served.len(),
            own.len(),
            "{PROMPTS} {cluster} prompts reached only {served:?}"
        );
    }
    // One decision per request: each request met one of the two filters.
    let requests = (2 * PROMPTS * FLEETS.len()) as u64;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let decisions = decision_count(&envoy);
        if decisions == requests {
            break;
        }
        assert!(
            decisions < requests && Instant::now() < deadline,
            "{decisions} decisions for {requests} requests"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The summed `prefix_router_decision_<kind>` counters as Prometheus scrapes
/// them (flushed every second).
fn decision_count(envoy: &Envoy) -> u64 {
    let scraped = envoy.prometheus().expect("Envoy /stats/prometheus");
    scraped
        .lines()
        .filter(|line| line.starts_with("prefix_router_decision_"))
        .filter_map(|line| line.rsplit_once(' '))
        .map(|(_, value)| value.parse::<u64>().expect("a counter"))
        .sum()
}

/// Points the example's cluster `name` at `addrs`, as the launcher points a
/// one-fleet file at its upstreams.
fn set_cluster_endpoints(config: &mut Value, name: &str, addrs: &[SocketAddr]) {
    let cluster = clusters_mut(config)
        .iter_mut()
        .find(|c| c["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no cluster {name}"));
    envoy::set_endpoints(cluster, addrs).expect("cluster endpoints");
}

/// Lists `addrs` as the `instances` of the listener filter `name`.
fn set_filter_instances(config: &mut Value, name: &str, addrs: &[SocketAddr]) {
    let filters = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"]
        .as_sequence_mut()
        .expect("http_filters");
    let filter = filters
        .iter_mut()
        .find(|f| f["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no listener filter {name}"));
    envoy::set_configured_instances(filter, addrs).expect("filter instances");
}
