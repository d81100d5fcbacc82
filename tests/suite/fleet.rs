//! The fleet is known before the first request: with the shipped
//! configuration (its `instances` list, rewritten by the launcher to the
//! test's upstreams), a fresh Envoy spreads a burst's overflow over the other
//! instances from its first burst, without any warm-up traffic, and still
//! does after a quiet spell longer than `instance_ttl_ms` (60 s). Both with
//! the upstream filter and with `counting: LISTENER`.
//!
//! The scenario: one request of a new prefix (its target is learned from
//! it), then 12 at once with `concurrency_threshold` 3, every instance
//! holding each request 1 s. Measured at the instances.

use std::collections::BTreeMap;
use std::time::Duration;

use harness::load::{assert_all_ok, prefix_request, served, shoot, shoot_all, Ending};
use harness::{envoy_config, Harness};

const THRESHOLD: u32 = 3;
const BURST: usize = 12;
/// Longer than the shipped `instance_ttl_ms` (60 s).
const IDLE: Duration = Duration::from_secs(65);
const HOLD: Duration = Duration::from_secs(1);

/// The listener filter's plugin configuration in `envoy/envoy.yaml`.
fn shipped_plugin_config() -> serde_json::Value {
    let text = std::fs::read_to_string(envoy_config("envoy.yaml")).expect("envoy/envoy.yaml");
    let config: serde_yaml::Value = serde_yaml::from_str(&text).expect("envoy.yaml is YAML");
    let filters = &config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"];
    let value = filters
        .as_sequence()
        .and_then(|filters| {
            filters
                .iter()
                .find_map(|f| f["typed_config"]["config"]["configuration"]["value"].as_str())
        })
        .expect("the listener's wasm filter configuration");
    serde_json::from_str(value).expect("the plugin configuration is JSON")
}

/// The shipped configuration, threshold lowered; `listener`: with
/// `counting: LISTENER` and no upstream filters.
fn start(listener: bool) -> Harness {
    let mut config = shipped_plugin_config();
    assert!(
        config.get("instances").is_some(),
        "envoy/envoy.yaml lists the fleet"
    );
    config["concurrency_threshold"] = THRESHOLD.into();
    if listener {
        config["counting"] = "LISTENER".into();
    }
    let config = config.to_string();
    let harness = Harness::start_with(move |b| {
        let b = b.concurrency(2).plugin_config(config);
        if listener {
            b.listener_filter_only()
        } else {
            b
        }
    });
    harness.fleet.set_hold_all(HOLD);
    harness
}

/// One request of prefix `label`, then [`BURST`] at once; checks the cap
/// and the spread.
async fn first_burst_is_capped_and_spread(harness: &Harness, what: &str, label: &str) {
    let addr = harness.envoy.listener_addr();
    let first = shoot(addr, prefix_request(label, 0), Ending::Complete).await;
    assert_all_ok(std::slice::from_ref(&first), &format!("{what}: first request"));
    let target = first.served_by.clone().expect("first request served");
    harness
        .fleet
        .wait_idle(Duration::from_secs(10))
        .expect("instances idle before the burst");
    harness.fleet.reset_max_in_flight();
    let requests = (1..=BURST).map(|n| prefix_request(label, n)).collect();
    let outcomes = shoot_all(addr, requests).await;
    let max_in_flight = harness.fleet.max_in_flight();
    assert_all_ok(&outcomes, &format!("{what}: burst"));
    let served = served(&outcomes);
    println!("{what}: target {target}; served {served:?}; max in flight {max_in_flight:?}");
    let on_target = max_in_flight.get(&target).copied().unwrap_or(0);
    assert!(
        on_target <= THRESHOLD,
        "{what}: the target {target} had {on_target} in flight (threshold {THRESHOLD}): {max_in_flight:?}"
    );
    let overflow: BTreeMap<&String, usize> = served
        .iter()
        .filter(|(name, _)| **name != target)
        .map(|(name, n)| (name, *n))
        .collect();
    assert_eq!(
        overflow.values().sum::<usize>(),
        BURST - THRESHOLD as usize,
        "{what}: {THRESHOLD} of {BURST} on the target {target}, the rest elsewhere: {served:?}"
    );
    assert!(
        overflow.len() >= 5,
        "{what}: the overflow went to only {} other instances: {served:?}",
        overflow.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fresh_envoy_spreads_its_first_burst_with_the_upstream_filter() {
    let harness = start(false);
    first_burst_is_capped_and_spread(&harness, "fresh, upstream filter", "fresh-upstream").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fresh_envoy_spreads_its_first_burst_counting_in_the_listener() {
    let harness = start(true);
    first_burst_is_capped_and_spread(&harness, "fresh, counting: LISTENER", "fresh-listener").await;
}

/// Both configurations side by side (two Envoys), so the idle spell is
/// waited once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_quiet_spell_longer_than_the_instance_ttl_the_fleet_is_still_known() {
    let (upstream, listener) = (start(false), start(true));
    tokio::join!(
        first_burst_is_capped_and_spread(&upstream, "fresh, upstream filter", "before-u"),
        first_burst_is_capped_and_spread(&listener, "fresh, counting: LISTENER", "before-l"),
    );
    // The scenario itself: no traffic for longer than instance_ttl_ms.
    tokio::time::sleep(IDLE).await;
    tokio::join!(
        first_burst_is_capped_and_spread(&upstream, "after 65 s idle, upstream filter", "after-u"),
        first_burst_is_capped_and_spread(
            &listener,
            "after 65 s idle, counting: LISTENER",
            "after-l"
        ),
    );
}
