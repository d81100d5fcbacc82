//! The fleet is known before the first request: with the shipped
//! configuration (its `instances` list, rewritten by the launcher to the
//! test's upstreams), a fresh Envoy spreads a burst's overflow over the other
//! instances from its first burst, without any warm-up traffic, and still
//! does after a quiet spell longer than `instance_ttl_ms` and a worker's
//! lease on its count column. Both with the upstream filter and with
//! `counting: LISTENER`.
//!
//! The scenario: one request of a new prefix (its target is learned from
//! it), then 12 at once with `concurrency_threshold` 3, every instance
//! holding each request 1 s. Measured at the instances.
//!
//! The compose and Kubernetes configurations, which read the fleet from
//! Envoy's admin (`discovery`) rather than list it, do the same.
//!
//! A deployment where nothing would count (the listener filter alone with
//! the default `counting`, or an upstream filter under another `vm_id`) is
//! not silent: Envoy's log says so once with the fix, a stat counts the
//! requests the listener counted in its place, and the cap holds.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use harness::load::{
    assert_all_ok, filter_counter, prefix_request, served, shoot, shoot_all, wait_for_counter,
    Ending, DECISION_HEADER,
};
use harness::{envoy_config, Harness, INSTANCES};
use prefix_router_tools::envoy::workspace_root;

const THRESHOLD: u32 = 3;
const BURST: usize = 12;
/// `instance_ttl_ms` for the quiet spell, lowered from the shipped 60 s so
/// that the spell is short.
const IDLE_TTL_MS: u64 = 5_000;
/// Longer than [`IDLE_TTL_MS`], and than a worker's lease on its count
/// column (10 s) and an instance's suspect spell (10 s), the longest timers
/// besides it.
const IDLE: Duration = Duration::from_secs(12);
const HOLD: Duration = Duration::from_secs(1);

/// The listener filter's plugin configuration in `envoy/envoy.yaml`.
fn shipped_plugin_config() -> serde_json::Value {
    plugin_config_of(&envoy_config("envoy.yaml"))
}

/// The listener filter's plugin configuration in the Envoy file at `path`.
fn plugin_config_of(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).expect("the Envoy configuration");
    let config: serde_yaml::Value = serde_yaml::from_str(&text).expect("Envoy's YAML");
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

/// The shipped configuration, threshold lowered, with `match: FIXED_PREFIX`
/// (see [`fixed_prefix`]); `listener`: with `counting: LISTENER` and no
/// upstream filters.
fn start(listener: bool) -> Harness {
    start_with_ttl(listener, None)
}

/// [`start`], with `instance_ttl_ms` set if `ttl_ms` is.
fn start_with_ttl(listener: bool, ttl_ms: Option<u64>) -> Harness {
    let mut config = shipped_plugin_config();
    assert!(
        config.get("instances").is_some(),
        "envoy/envoy.yaml lists the fleet"
    );
    config["concurrency_threshold"] = THRESHOLD.into();
    if let Some(ttl_ms) = ttl_ms {
        config["instance_ttl_ms"] = ttl_ms.into();
    }
    fixed_prefix(&mut config);
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

/// Sets `match: FIXED_PREFIX`: the spread checked here is its overflow,
/// from the key's target evenly to the least busy others. (LONGEST_PREFIX
/// fills instances in the order of its rendezvous ranking up to `load_margin`
/// above the least loaded: [`BURST`] at [`THRESHOLD`] fills 4 instances.)
/// Each response names its decision, which names the target.
fn fixed_prefix(config: &mut serde_json::Value) {
    config["match"] = "FIXED_PREFIX".into();
    config["decision_header"] = DECISION_HEADER.into();
}

/// One request of prefix `label`, then [`BURST`] at once; checks the cap
/// and the spread.
async fn first_burst_is_capped_and_spread(harness: &Harness, what: &str, label: &str) {
    let addr = harness.envoy.listener_addr();
    let first = shoot(addr, prefix_request(label, 0), Ending::Complete).await;
    assert_all_ok(
        std::slice::from_ref(&first),
        &format!("{what}: first request"),
    );
    let first_served = first.served_by.clone().expect("first request served");
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
    // The target is where the burst's `prefix` decisions went: Maglev's
    // choice for the key, learned from the first request, unless Envoy's
    // hash table changed since (seen on a loaded machine just after start).
    let targets: BTreeSet<&str> = outcomes
        .iter()
        .filter(|o| o.kind() == Some("prefix"))
        .filter_map(|o| o.served_by.as_deref())
        .collect();
    let [target] = targets.into_iter().collect::<Vec<_>>()[..] else {
        panic!("{what}: the burst's `prefix` decisions went to one instance: {outcomes:?}");
    };
    let target = target.to_string();
    println!(
        "{what}: target {target} (first request {first_served}); served {served:?}; max in flight {max_in_flight:?}"
    );
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

/// A configuration users deploy as is, whose endpoints are DNS names and
/// whose plugin configuration lists no fleet but reads it from Envoy's admin
/// (`discovery`), with the threshold lowered and `match: FIXED_PREFIX`. The
/// clusters' endpoints become the test's instances (still STRICT_DNS), and
/// the harness is ready once the filter has read every healthy instance.
fn start_deployment(rel: &str) -> Harness {
    let path = workspace_root().join(rel);
    let mut config = plugin_config_of(&path);
    assert!(
        config.get("instances").is_none() && config.get("discovery").is_some(),
        "{rel} reads its fleet from Envoy's admin: {config}"
    );
    config["concurrency_threshold"] = THRESHOLD.into();
    fixed_prefix(&mut config);
    let config = config.to_string();
    let harness =
        Harness::start_with(move |b| b.config_file(path).concurrency(2).plugin_config(config));
    harness.fleet.set_hold_all(HOLD);
    wait_for_counter(&harness.envoy, "discovery.instances", INSTANCES as u64);
    harness
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_compose_configuration_spreads_its_first_burst_over_the_fleet_it_discovered() {
    let harness = start_deployment("envoy/docker/envoy.yaml");
    first_burst_is_capped_and_spread(&harness, "compose", "compose").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_kubernetes_configuration_spreads_its_first_burst_over_the_fleet_it_discovered() {
    let harness = start_deployment("examples/kubernetes/envoy.yaml");
    first_burst_is_capped_and_spread(&harness, "kubernetes", "kubernetes").await;
}

/// Both configurations side by side (two Envoys), so the idle spell is
/// waited once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_quiet_spell_longer_than_the_instance_ttl_the_fleet_is_still_known() {
    let (upstream, listener) = (
        start_with_ttl(false, Some(IDLE_TTL_MS)),
        start_with_ttl(true, Some(IDLE_TTL_MS)),
    );
    tokio::join!(
        first_burst_is_capped_and_spread(&upstream, "fresh, upstream filter", "before-u"),
        first_burst_is_capped_and_spread(&listener, "fresh, counting: LISTENER", "before-l"),
    );
    // The scenario itself: no traffic for longer than instance_ttl_ms.
    tokio::time::sleep(IDLE).await;
    tokio::join!(
        first_burst_is_capped_and_spread(&upstream, "after 12 s idle, upstream filter", "after-u"),
        first_burst_is_capped_and_spread(
            &listener,
            "after 12 s idle, counting: LISTENER",
            "after-l"
        ),
    );
}

/// The filter's warning when no upstream filter counts (its start; the
/// fix follows in the same line).
const MISSING_WARNING: &str = "no upstream filter counted a request this listener filter routed";

/// Envoy's log has the warning, with the fix, on one line per worker VM at
/// most, and the stat counts the requests counted in the listener instead.
fn assert_says_why(harness: &Harness, what: &str, workers: usize) {
    wait_for_counter(&harness.envoy, "upstream_filter_missing", 1);
    let log = harness.envoy.log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(MISSING_WARNING))
        .collect();
    assert!(
        !warnings.is_empty() && warnings.len() <= workers,
        "{what}: expected the warning once per worker VM, got {}:\n{}",
        warnings.len(),
        harness.log_tail()
    );
    for line in &warnings {
        assert!(
            line.contains("add the upstream filter with the same vm_id")
                && line.contains("\"counting\": \"LISTENER\""),
            "{what}: the warning names no fix: {line}"
        );
    }
    println!(
        "{what}: prefix_router.upstream_filter_missing = {}; {}",
        filter_counter(&harness.envoy, "upstream_filter_missing"),
        warnings.first().copied().unwrap_or_default()
    );
}

/// The smallest configuration: the listener filter alone, the default
/// `counting` (UPSTREAM_FILTER), no fleet listed; only the threshold (and
/// the debug header, to read each decision) set. The filter counts in the
/// listener and caps what it sends to the target; with no other instance
/// known it overflows by re-keying, and Maglev may put such a request on the
/// target too (the warning names the fix: list the fleet, or add the
/// upstream filter). Re-keying with a salt is FIXED_PREFIX's overflow, hence
/// `match: FIXED_PREFIX`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_listener_filter_alone_with_default_counting_counts_and_says_so() {
    let config = serde_json::json!({
        "match": "FIXED_PREFIX",
        "concurrency_threshold": THRESHOLD,
        "decision_header": harness::load::DECISION_HEADER,
    })
    .to_string();
    let harness = Harness::start_with(move |b| {
        b.concurrency(2)
            .listener_filter_only()
            .plugin_config(config)
    });
    harness.fleet.set_hold_all(HOLD);
    let addr = harness.envoy.listener_addr();
    let first = shoot(addr, prefix_request("minimal", 0), Ending::Complete).await;
    assert_all_ok(std::slice::from_ref(&first), "minimal: first request");
    let target = first.served_by.clone().expect("served");
    harness.fleet.wait_idle(Duration::from_secs(10)).unwrap();
    harness.fleet.reset_max_in_flight();
    let requests = (1..=BURST).map(|n| prefix_request("minimal", n)).collect();
    let outcomes = shoot_all(addr, requests).await;
    let max_in_flight = harness.fleet.max_in_flight();
    assert_all_ok(&outcomes, "minimal: burst");
    println!(
        "minimal: target {target}; served {:?}; kinds {:?}; max in flight {max_in_flight:?}",
        served(&outcomes),
        outcomes.iter().map(|o| o.kind()).collect::<Vec<_>>()
    );
    let sent_to_target = outcomes
        .iter()
        .filter(|o| o.kind() == Some("prefix"))
        .count();
    let overflowed = outcomes
        .iter()
        .filter(|o| o.kind() == Some("overflow"))
        .count();
    assert_eq!(
        sent_to_target + overflowed,
        BURST,
        "minimal: every request of the burst goes to the target or overflows"
    );
    assert!(
        sent_to_target <= THRESHOLD as usize,
        "minimal: the filter sent {sent_to_target} to the target (threshold {THRESHOLD})"
    );
    // What reached the target past the cap can only be overflow that Maglev
    // placed there for lack of a known other instance.
    let overflow_on_target = outcomes
        .iter()
        .filter(|o| o.kind() == Some("overflow") && o.served_by.as_deref() == Some(&target))
        .count();
    let on_target = max_in_flight.get(&target).copied().unwrap_or(0) as usize;
    assert!(
        on_target <= THRESHOLD as usize + overflow_on_target,
        "minimal: the target {target} had {on_target} in flight, more than the {THRESHOLD} capped and {overflow_on_target} overflowed there: {max_in_flight:?}"
    );
    assert_says_why(&harness, "listener filter alone", 2);
}

/// The shipped configuration with the upstream filters under another
/// `vm_id`: they count in shared data the listener never reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_filter_under_another_vm_id_is_detected_and_the_cap_holds() {
    let mut config = shipped_plugin_config();
    config["concurrency_threshold"] = THRESHOLD.into();
    fixed_prefix(&mut config);
    let config = config.to_string();
    let harness = Harness::start_with(move |b| {
        b.concurrency(2).plugin_config(config).edit(|c| {
            let mut renamed = 0;
            let clusters = c["static_resources"]["clusters"].as_sequence_mut();
            for cluster in clusters.into_iter().flatten() {
                // get_mut, not indexing: indexing would add the path to the
                // clusters without upstream filters (the engine_metrics one).
                let filters = cluster
                    .get_mut("typed_extension_protocol_options")
                    .and_then(|o| {
                        o.get_mut("envoy.extensions.upstreams.http.v3.HttpProtocolOptions")
                    })
                    .and_then(|o| o.get_mut("http_filters"))
                    .and_then(|f| f.as_sequence_mut());
                for filter in filters.into_iter().flatten() {
                    // get_mut, not indexing: indexing would add the path to
                    // the codec filter too.
                    let vm_id = filter
                        .get_mut("typed_config")
                        .and_then(|t| t.get_mut("config"))
                        .and_then(|c| c.get_mut("vm_config"))
                        .and_then(|v| v.get_mut("vm_id"));
                    if let Some(vm_id) = vm_id {
                        *vm_id = "prefix_router_other".into();
                        renamed += 1;
                    }
                }
            }
            anyhow::ensure!(renamed > 0, "no upstream filter to rename");
            Ok(())
        })
    });
    harness.fleet.set_hold_all(HOLD);
    first_burst_is_capped_and_spread(&harness, "upstream filter under another vm_id", "vm-id")
        .await;
    assert_says_why(&harness, "upstream filter under another vm_id", 2);
}
