//! Two fleets behind one listener (`examples/envoy-two-fleets/`): the file
//! passes validation, and a real Envoy started from it in front of two fleets
//! routes each fleet's requests with that fleet's filter alone: every
//! decision names an instance of the request's own fleet, a prompt sent again
//! goes where it went, each request meets one filter, not both, and each
//! fleet's stats carry its own `fleet` label in Prometheus.
//!
//! Envoy comes from `ENVOY_BIN` or PATH; the filter from `PREFIX_ROUTER_WASM`
//! or the release build (`cargo xtask test` provides both).

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

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

/// The two fleets (3 and 2 instances), their addresses, and Envoy started
/// from the example pointed at them, with `edit` on top.
fn start_example(
    edit: impl FnOnce(&mut Value) + Send + 'static,
) -> ([UpstreamFleet; 2], Vec<Vec<SocketAddr>>, Envoy) {
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
            edit(config);
            Ok(())
        })
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    (fleets, addrs, envoy)
}

#[test]
fn each_fleets_requests_meet_only_its_own_filter_and_instances() {
    let (fleets, addrs, envoy) = start_example(|_| {});
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
    // One decision per request, each counted under its own fleet's label:
    // each request met one of the two filters, and each filter names its
    // fleet in every stat (`fleet` and the example's `stats_tags`).
    let expected: Vec<(String, u64)> = FLEETS
        .iter()
        .map(|(_, cluster, _)| (cluster.to_string(), 2 * PROMPTS as u64))
        .collect();
    let requests = 2 * PROMPTS as u64 * FLEETS.len() as u64;
    let counted =
        |scraped: &str| -> u64 { decisions_by_fleet(scraped).iter().map(|(_, n)| n).sum() };
    let scraped = wait_until(
        Duration::from_secs(10),
        || envoy.prometheus().expect("Envoy /stats/prometheus"),
        |scraped| counted(scraped) >= requests,
        |scraped| {
            format!(
                "decisions by fleet {:?}, expected {expected:?}",
                decisions_by_fleet(scraped)
            )
        },
    );
    assert_eq!(decisions_by_fleet(&scraped), expected, "decisions by fleet");
    let scraped = samples(&scraped);
    for ((_, cluster, _), own) in FLEETS.iter().zip(&addrs) {
        for addr in own {
            let endpoint = addr.to_string();
            assert!(
                scraped.iter().any(|s| s.name == "prefix_router_in_flight"
                    && s.label("endpoint") == Some(endpoint.as_str())
                    && s.label("fleet") == Some(*cluster)),
                "no prefix_router_in_flight{{endpoint=\"{endpoint}\",fleet=\"{cluster}\"}} in the scrape"
            );
        }
    }
    let unlabelled: Vec<&Sample> = scraped
        .iter()
        .filter(|s| s.name.starts_with("prefix_router_") && s.label("fleet").is_none())
        .collect();
    assert!(unlabelled.is_empty(), "stats of no fleet: {unlabelled:?}");
    assert!(
        !envoy.log().contains(FLEETS_DIFFER),
        "the example's filters agree on their fleets"
    );
}

/// The warning for two filters of one `vm_id` that name different fleets.
const FLEETS_DIFFER: &str = "filters of one vm_id name different fleets";

#[test]
fn an_upstream_filter_without_its_listener_filters_fleet_is_warned_about() {
    // Fleet llama's upstream filter without its `fleet`.
    let (_fleets, _, envoy) = start_example(|config| {
        let llama = clusters_mut(config)
            .iter_mut()
            .find(|c| c["name"].as_str() == Some("llama"))
            .expect("cluster llama");
        let upstream = &mut llama["typed_extension_protocol_options"]
            ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["http_filters"][0]
            ["typed_config"]["config"]["configuration"]["value"];
        assert_eq!(upstream.as_str(), Some(r#"{"fleet": "llama"}"#));
        *upstream = Value::from("{}");
    });
    let log = envoy.log();
    let warning = log
        .lines()
        .find(|line| line.contains(FLEETS_DIFFER))
        .unwrap_or_else(|| panic!("no warning that the fleets differ:\n{log}"));
    assert!(
        warning.contains("\"llama\"") && warning.contains("none"),
        "{warning}"
    );
    assert!(
        !warning.contains("mistral"),
        "fleet mistral's filters agree: {warning}"
    );
}

/// The `prefix_router_decision` counters of a Prometheus scrape, summed by
/// their `fleet` label (`(none)` for a counter without one), in the label's
/// order.
fn decisions_by_fleet(scraped: &str) -> Vec<(String, u64)> {
    let mut by_fleet = std::collections::BTreeMap::<String, u64>::new();
    for sample in samples(scraped)
        .iter()
        .filter(|s| s.name == "prefix_router_decision")
    {
        let fleet = sample.label("fleet").unwrap_or("(none)");
        *by_fleet.entry(fleet.to_string()).or_default() += sample.value as u64;
    }
    by_fleet.into_iter().collect()
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
