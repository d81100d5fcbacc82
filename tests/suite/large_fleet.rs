//! A fleet of 100 instances behind one Envoy (two workers): more than the 64
//! the registry once held. Listed in `instances`, every instance is tracked
//! from the start: a burst of one prompt, larger than any 64 instances could
//! take under the cap, is served within `concurrency_threshold` on every
//! instance, and every instance has its in-flight gauge. Not listed, every
//! instance is learned from traffic, with no "registry full" warning.

use std::time::Duration;

use harness::load::{
    assert_all_ok, check_decisions_match, in_flight_gauges, plugin_config_with, prefix_request,
    served, shoot_all, BURST_HOLD,
};
use harness::Harness;
use prefix_router_tools::upstream::HOLD_HEADER;

const INSTANCES: usize = 100;
const THRESHOLD: u32 = 2;
/// More than 64 instances can take at [`THRESHOLD`] (128), fewer than 100 can.
const BURST: usize = 150;

fn start(listed: bool) -> Harness {
    // The launcher rewrites a listed fleet to the test's instances.
    let more = if listed {
        serde_json::json!({"instances": ["10.9.9.9:80"]})
    } else {
        serde_json::json!({})
    };
    let config = plugin_config_with("PREFIX_AWARE", THRESHOLD, more);
    Harness::start_sized(
        INSTANCES,
        |_| {},
        move |b| b.concurrency(2).plugin_config(config),
    )
}

/// Waits (bounded) until the filter's in-flight gauges name `count`
/// instances: the tick publishes them every second.
fn wait_for_gauges(harness: &Harness, count: usize) -> usize {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let gauges = in_flight_gauges(&harness.envoy).len();
        if gauges >= count || std::time::Instant::now() > deadline {
            return gauges;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_listed_fleet_of_100_is_tracked_whole_and_the_cap_holds_on_every_instance() {
    let harness = start(true);
    harness.fleet.set_hold_all(BURST_HOLD);
    harness.fleet.reset_max_in_flight();
    let requests = (0..BURST)
        .map(|n| prefix_request("large-fleet", n))
        .collect();
    let outcomes = shoot_all(harness.envoy.listener_addr(), requests).await;
    let max_in_flight = harness.fleet.max_in_flight();
    assert_all_ok(&outcomes, "the burst");
    check_decisions_match(&outcomes, &harness.fleet);
    let over: Vec<_> = max_in_flight
        .iter()
        .filter(|(_, n)| **n > THRESHOLD)
        .collect();
    assert!(
        over.is_empty(),
        "instances past the cap of {THRESHOLD}: {over:?}\n{}",
        harness.log_tail()
    );
    let served = served(&outcomes);
    assert!(
        served.len() >= BURST.div_ceil(THRESHOLD as usize),
        "{BURST} requests at a cap of {THRESHOLD} need {} instances, served by {}: {served:?}",
        BURST.div_ceil(THRESHOLD as usize),
        served.len()
    );
    let gauges = wait_for_gauges(&harness, INSTANCES);
    assert_eq!(gauges, INSTANCES, "an in-flight gauge per listed instance");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unlisted_fleet_of_100_is_learned_whole_from_traffic() {
    let harness = start(false);
    // Distinct prompts one after another until every instance served one
    // (Maglev spreads them over the cluster's hosts).
    let mut serving = std::collections::BTreeSet::new();
    let mut sent = 0;
    while serving.len() < INSTANCES {
        assert!(
            sent < 50 * INSTANCES,
            "{} instances served in {sent} requests",
            serving.len()
        );
        let requests = (0..INSTANCES)
            .map(|n| prefix_request(&format!("learned-{}", sent + n), 0).header(HOLD_HEADER, "0"))
            .collect();
        let outcomes = shoot_all(harness.envoy.listener_addr(), requests).await;
        assert_all_ok(&outcomes, "distinct prompts");
        serving.extend(outcomes.into_iter().filter_map(|o| o.served_by));
        sent += INSTANCES;
    }
    let gauges = wait_for_gauges(&harness, INSTANCES);
    assert_eq!(
        gauges,
        INSTANCES,
        "every instance that served is known\n{}",
        harness.log_tail()
    );
    assert!(
        !harness.envoy.log().contains("registry full"),
        "{}",
        harness.log_tail()
    );
}
