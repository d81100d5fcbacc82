//! `counting: LISTENER` through a real Envoy with two workers and no upstream
//! filter on the cluster: the listener counts each request where its decision
//! predicted it would go and learns a key's instance from the response
//! headers. A known key's burst is capped at its target as with the upstream
//! filter; counts return to zero; the filter's internal headers never reach an
//! instance; bodies arrive byte for byte.

use std::time::Duration;

use harness::load::{
    assert_all_ok, burst, check_burst, prefix_request, served, shoot, shoot_all, wait_gauges_zero,
    warm_up, Ending, BURST_HOLD, COUNTED_HEADER, DECISION_HEADER, ROUTE_HEADER,
};
use harness::{bodies, Harness, Outgoing, INSTANCES};

const WARM_UP_KEYS: usize = 40;

fn start(strategy: &str, threshold: u32) -> Harness {
    start_with_config(config(strategy, threshold))
}

fn config(strategy: &str, threshold: u32) -> serde_json::Value {
    serde_json::json!({
        "strategy": strategy,
        "concurrency_threshold": threshold,
        "decision_header": DECISION_HEADER,
        "counting": "LISTENER",
    })
}

fn start_with_config(config: serde_json::Value) -> Harness {
    let config = config.to_string();
    Harness::start_with(move |b| {
        b.concurrency(2)
            .listener_filter_only()
            .plugin_config(config)
    })
}

/// With `match: FIXED_PREFIX`: a key's target learned from its response and
/// the burst's overflow from it evenly to the least busy others are its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_known_keys_burst_is_capped_at_its_target_and_counts_return_to_zero() {
    let mut config = config("PREFIX_AWARE", 3);
    config["match"] = "FIXED_PREFIX".into();
    let harness = start_with_config(config);
    harness.fleet.set_hold_all(Duration::ZERO);
    warm_up(&harness, WARM_UP_KEYS).await;
    // Counting in the listener learns a key's instance from its first
    // response; until then its requests go out pending, uncapped (the burst
    // below would not be capped without this request).
    let first = shoot(
        harness.envoy.listener_addr(),
        prefix_request("known", 1000),
        Ending::Complete,
    )
    .await;
    assert_eq!(first.kind(), Some("prefix"), "{first:?}");
    harness.fleet.set_hold_all(BURST_HOLD);
    let report = burst(&harness, "known", 12, 5).await;
    assert_eq!(
        first.served_by.as_deref(),
        Some(report.target.as_str()),
        "the key moved between its first request and the follow-ups"
    );
    check_burst(
        &report,
        12,
        3,
        "12 concurrent requests of a known prefix, threshold 3, counting in the listener",
    );
    let (gauges, took) = wait_gauges_zero(&harness.envoy, Duration::from_secs(5));
    println!("gauges back to zero after {took:?}: {gauges:?}");
    assert_eq!(
        gauges.len(),
        INSTANCES,
        "one in-flight gauge per instance: {gauges:?}"
    );
}

/// Without the debug decision header the listener reads where a request
/// claimed on its key's target went only once a second per key: the cap must
/// hold all the same, and the counts return to zero. With the default
/// `match`, and the fleet listed (the launcher writes in the test's
/// upstreams): LONGEST_PREFIX places prompts over the instances it knows,
/// and the warm-up must reach them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cap_holds_without_the_decision_header() {
    let harness = start_with_config(serde_json::json!({
        "concurrency_threshold": 3,
        "counting": "LISTENER",
        "instances": [],
    }));
    harness.fleet.set_hold_all(Duration::ZERO);
    warm_up(&harness, WARM_UP_KEYS).await;
    let addr = harness.envoy.listener_addr();
    let first = shoot(addr, prefix_request("quiet", 1000), Ending::Complete).await;
    let target = first.served_by.clone().expect("served");
    harness.fleet.set_hold_all(BURST_HOLD);
    for round in 0..2 {
        harness.fleet.wait_idle(Duration::from_secs(10)).unwrap();
        harness.fleet.reset_max_in_flight();
        let requests = (0..12)
            .map(|n| prefix_request("quiet", round * 12 + n))
            .collect();
        let outcomes = shoot_all(addr, requests).await;
        assert_all_ok(&outcomes, "burst");
        let max = harness.fleet.max_in_flight();
        println!(
            "round {round}: served {:?}, max in flight {max:?}",
            served(&outcomes)
        );
        assert_eq!(
            max.get(&target).copied(),
            Some(3),
            "round {round}: the target {target} holds exactly the cap: {max:?}"
        );
        assert!(max.values().all(|n| *n <= 3), "{max:?}");
    }
    wait_gauges_zero(&harness.envoy, Duration::from_secs(5));
}

/// No upstream filter is there to strip the filter's internal headers: none
/// may reach an instance (the counted header is never written, the route
/// header is removed by the route), and bodies pass byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn internal_headers_never_reach_an_instance_and_bodies_pass_untouched() {
    for strategy in ["PREFIX_AWARE", "LEAST_OUTSTANDING_REQUESTS"] {
        let harness = start(strategy, 2);
        harness.fleet.set_hold_all(Duration::from_millis(200));
        let mut rng = bodies::rng(7);
        let sent: Vec<(String, Vec<u8>)> = (0..12)
            .map(|n| {
                let body = bodies::bytes(&mut rng, 4096 + 997 * n);
                (format!("{strategy}-{n}"), body)
            })
            .collect();
        // Concurrent; half of them share one prefix.
        let requests = sent
            .iter()
            .enumerate()
            .map(|(n, (id, body))| {
                let mut body = body.clone();
                if n % 2 == 0 {
                    body[..4096].fill(b'a');
                }
                Outgoing::post("/invocations", body).id(id)
            })
            .collect();
        let replies = harness.send_all(requests, 12).await;
        assert!(replies.iter().all(|r| r.status == 200), "{strategy}");
        for (n, (id, body)) in sent.iter().enumerate() {
            let record = harness.record_of(id);
            let mut expected = body.clone();
            if n % 2 == 0 {
                expected[..4096].fill(b'a');
            }
            assert_eq!(record.body_sha256, bodies::sha256(&expected), "{id}");
            for internal in [COUNTED_HEADER, ROUTE_HEADER] {
                assert_eq!(
                    record.header_values(internal),
                    Vec::<&str>::new(),
                    "{strategy}: {internal} reached the instance: {:?}",
                    record.headers
                );
            }
        }
        // LEAST_OUTSTANDING_REQUESTS is routed by the route header alone.
        let least = harness
            .envoy
            .stat("cluster.vllm_least_request.upstream_rq_total");
        let least = least.expect("admin /stats").unwrap_or(0);
        match strategy {
            "LEAST_OUTSTANDING_REQUESTS" => assert_eq!(least, 12, "{strategy}"),
            _ => assert_eq!(least, 0, "{strategy}"),
        }
        wait_gauges_zero(&harness.envoy, Duration::from_secs(5));
    }
}
