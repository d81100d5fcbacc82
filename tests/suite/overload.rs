//! Overload protection through a real Envoy with two workers: the
//! `concurrency_threshold` caps the requests in flight on a key's target
//! instance, measured at the instance; the rest overflow to the least busy
//! others and come back when the target has room; the cap is per instance
//! across keys; counts never leak (aborts, resets, timeouts, streams, 5xx,
//! local replies); a client cannot pin an instance.
//!
//! Instances hold each request 1.5 s so a burst really is concurrent. Each
//! test first warms the filter up with a few dozen distinct keys: overflow
//! nominates instances the filter has seen serving (the learning window, see
//! docs/design.md).
//!
//! The burst tests run with `match: FIXED_PREFIX`: a key's target is
//! Maglev's, and what passes its cap overflows evenly to the least busy
//! others. LONGEST_PREFIX fills instances in the order of its rendezvous
//! ranking up to `load_margin` above the least loaded, a shape of its own:
//! its burst test checks the cap alone.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use harness::load::{
    add_short_timeout_route, assert_all_ok, burst, check_burst, filter_counter, kinds,
    plugin_config_with, prefix_request, served, shoot, shoot_all, wait_for_counter,
    wait_gauges_zero, warm_up, Ending, Outcome, BURST_HOLD, COUNTED_HEADER, HOST_HEADER,
    ROUTE_HEADER, SHORT_TIMEOUT_HEADER,
};
use harness::{bodies, Harness};
use prefix_router_tools::upstream::{
    ACTION_HEADER, HOLD_HEADER, SSE_EVENTS_HEADER, SSE_INTERVAL_HEADER,
};
use rand::Rng;
use serde_json::json;

const WARM_UP_KEYS: usize = 40;

/// FIXED_PREFIX (see the module documentation).
fn start(threshold: u32) -> Harness {
    start_with_config(plugin_config_with(
        "PREFIX_AWARE",
        threshold,
        json!({"match": "FIXED_PREFIX"}),
    ))
}

fn start_with_config(config: String) -> Harness {
    let harness = Harness::start_with(move |b| {
        b.concurrency(2)
            .plugin_config(config)
            .edit(|c| add_short_timeout_route(c, Duration::from_millis(500)))
    });
    harness.fleet.set_hold_all(BURST_HOLD);
    harness
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_of_one_prefix_is_capped_at_its_target() {
    let harness = start(3);
    warm_up(&harness, WARM_UP_KEYS).await;
    let report = burst(&harness, "burst", 12, 5).await;
    check_burst(
        &report,
        12,
        3,
        "12 concurrent requests of one new prefix, threshold 3",
    );
}

/// The same burst with the default `match` (LONGEST_PREFIX) and the fleet
/// listed (the launcher writes in the test's upstreams): no instance ever
/// has more than the threshold in flight, measured at the instances; the
/// prompt's first instance takes exactly the threshold, and the requests
/// after the burst are matched there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_of_one_prompt_is_capped_on_every_instance_with_the_default_match() {
    const THRESHOLD: u32 = 3;
    let harness = start_with_config(plugin_config_with(
        "PREFIX_AWARE",
        THRESHOLD,
        json!({"instances": []}),
    ));
    let report = burst(&harness, "burst-default", 12, 5).await;
    println!("12 concurrent requests of one new prompt, threshold {THRESHOLD}: {report:#?}");
    assert!(
        report.max_in_flight.values().all(|n| *n <= THRESHOLD),
        "an instance had more than {THRESHOLD} in flight: {:?}",
        report.max_in_flight
    );
    assert!(
        report.follow_ups.iter().all(|i| *i == report.target),
        "the requests after the burst did not all go to one instance: {:?}",
        report.follow_ups
    );
    assert_eq!(
        report.follow_up_kinds.get("matched"),
        Some(&report.follow_ups.len()),
        "{:?}",
        report.follow_up_kinds
    );
    assert_eq!(
        report.served.get(&report.target),
        Some(&(THRESHOLD as usize)),
        "the prompt's first instance {} takes the threshold: {:?}",
        report.target,
        report.served
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_prefixes_sharing_a_target_share_its_cap() {
    let harness = start(4);
    warm_up(&harness, WARM_UP_KEYS).await;
    // Probe prefixes one at a time until two land on the same instance
    // (8 probes suffice over 7 instances).
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    let mut pair = None;
    for i in 0..8 {
        let label = format!("pair-{i}");
        let request = prefix_request(&label, 0).header(HOLD_HEADER, "0");
        let outcome = shoot(harness.envoy.listener_addr(), request, Ending::Complete).await;
        let instance = outcome.served_by.expect("probe served");
        if let Some(first) = seen.get(&instance) {
            pair = Some((first.clone(), label, instance));
            break;
        }
        seen.insert(instance, label);
    }
    let (a, b, target) = pair.expect("two of 8 prefixes share an instance");
    harness.fleet.wait_idle(Duration::from_secs(5)).unwrap();
    harness.fleet.reset_max_in_flight();
    let requests = (1..=10)
        .flat_map(|n| [prefix_request(&a, n), prefix_request(&b, n)])
        .collect();
    let outcomes = shoot_all(harness.envoy.listener_addr(), requests).await;
    let max = harness.fleet.max_in_flight();
    assert_all_ok(&outcomes, "two-prefix burst");
    println!(
        "prefixes {a} and {b} share {target}; 10 + 10 concurrent, threshold 4: max in flight per instance {max:?}, served {:?}, decisions {:?}",
        served(&outcomes),
        kinds(&outcomes)
    );
    let on_target = max.get(&target).copied().unwrap_or(0);
    assert!(
        on_target <= 4,
        "{target} had {on_target} in flight from the two prefixes (threshold 4)"
    );
    assert_eq!(
        on_target, 4,
        "the burst should fill {target} up to the threshold"
    );
}

/// How a mixed request ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Plain,
    Streamed,
    ClientAbort,
    ClientAbortMidStream,
    UpstreamReset,
    UpstreamTimeout,
    /// The instance answers 500.
    UpstreamError,
    /// The filter answers itself (400, invalid tenant header).
    LocalReply,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn counts_return_to_zero_after_aborts_resets_timeouts_errors_and_streams() {
    const REQUESTS: usize = 2000;
    const CLIENTS: usize = 40;
    const KEYS: usize = 20;
    let harness = start(3);
    warm_up(&harness, WARM_UP_KEYS).await;
    let mut rng = bodies::rng(0x1eaf);
    let plan: Vec<(usize, Fate, u64)> = (0..REQUESTS)
        .map(|_| {
            let roll = rng.gen_range(0..100);
            let fate = match roll {
                0..=4 => Fate::ClientAbort,
                5..=9 => Fate::ClientAbortMidStream,
                10..=14 => Fate::UpstreamReset,
                15..=19 => Fate::UpstreamTimeout,
                20..=21 => Fate::UpstreamError,
                22..=23 => Fate::LocalReply,
                24..=49 => Fate::Streamed,
                _ => Fate::Plain,
            };
            (rng.gen_range(0..KEYS), fate, rng.gen_range(5..100))
        })
        .collect();
    let addr = harness.envoy.listener_addr();
    let started = Instant::now();
    let queue = std::sync::Arc::new(std::sync::Mutex::new(plan.into_iter().enumerate()));
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let queue = std::sync::Arc::clone(&queue);
        clients.push(tokio::spawn(async move {
            let mut outcomes: Vec<(Fate, Outcome)> = Vec::new();
            loop {
                let next = queue.lock().unwrap().next();
                let Some((n, (key, fate, hold))) = next else {
                    break;
                };
                let request = prefix_request(&format!("mixed-{key}"), n);
                let (request, ending) = match fate {
                    Fate::Plain => (
                        request.header(HOLD_HEADER, hold.to_string()),
                        Ending::Complete,
                    ),
                    Fate::Streamed => (
                        request
                            .header(HOLD_HEADER, hold.to_string())
                            .header(ACTION_HEADER, "sse")
                            .header(SSE_EVENTS_HEADER, "5")
                            .header(SSE_INTERVAL_HEADER, "20"),
                        Ending::Complete,
                    ),
                    Fate::ClientAbort => (
                        request.header(HOLD_HEADER, "1000"),
                        Ending::AbortAfter(Duration::from_millis(150)),
                    ),
                    Fate::ClientAbortMidStream => (
                        request
                            .header(HOLD_HEADER, "0")
                            .header(ACTION_HEADER, "sse")
                            .header(SSE_EVENTS_HEADER, "20")
                            .header(SSE_INTERVAL_HEADER, "50"),
                        Ending::AbortAfterFirstChunk,
                    ),
                    Fate::UpstreamReset => (
                        request
                            .header(HOLD_HEADER, hold.to_string())
                            .header(ACTION_HEADER, "reset"),
                        Ending::Complete,
                    ),
                    Fate::UpstreamError => (
                        request
                            .header(HOLD_HEADER, hold.to_string())
                            .header(ACTION_HEADER, "fail"),
                        Ending::Complete,
                    ),
                    Fate::LocalReply => (
                        request.header(harness::TENANT_HEADER, "bad\ttenant"),
                        Ending::Complete,
                    ),
                    Fate::UpstreamTimeout => (
                        request
                            .header(HOLD_HEADER, "0")
                            .header(ACTION_HEADER, "hang")
                            .header(SHORT_TIMEOUT_HEADER, "1"),
                        Ending::Complete,
                    ),
                };
                outcomes.push((fate, shoot(addr, request, ending).await));
            }
            outcomes
        }));
    }
    let mut outcomes = Vec::new();
    for client in clients {
        outcomes.extend(client.await.unwrap());
    }
    let elapsed = started.elapsed();
    let mut table: BTreeMap<String, usize> = BTreeMap::new();
    for (fate, o) in &outcomes {
        let what = match (o.aborted, o.status, &o.error) {
            (true, _, _) => "client abort".to_string(),
            (_, Some(s), None) => s.to_string(),
            (_, _, Some(e)) => format!("error {e}"),
            (_, None, None) => "nothing".to_string(),
        };
        *table.entry(format!("{fate:?} -> {what}")).or_default() += 1;
    }
    println!("{REQUESTS} mixed requests from {CLIENTS} clients in {elapsed:?}: {table:#?}");
    for (fate, o) in &outcomes {
        let expected = match fate {
            Fate::Plain | Fate::Streamed => Some(200),
            Fate::UpstreamReset => Some(503),
            Fate::UpstreamTimeout => Some(504),
            Fate::UpstreamError => Some(500),
            Fate::LocalReply => Some(400),
            Fate::ClientAbort | Fate::ClientAbortMidStream => None,
        };
        match expected {
            Some(status) => assert_eq!(o.status, Some(status), "{fate:?}: {o:?}"),
            None => assert!(o.aborted, "{fate:?} was not aborted: {o:?}"),
        }
    }
    assert_eq!(outcomes.len(), REQUESTS);

    let (gauges, took) = wait_gauges_zero(&harness.envoy, Duration::from_secs(15));
    println!("in-flight gauges all zero {took:?} after the mix: {gauges:?}");
    assert!(
        gauges.len() >= harness::INSTANCES,
        "expected a gauge per instance: {gauges:?}"
    );
    harness.fleet.wait_idle(Duration::from_secs(10)).unwrap();
    let report = burst(&harness, "after-the-mix", 12, 5).await;
    check_burst(&report, 12, 3, "the burst after 2,000 mixed requests");
}

/// With the default `match`, and the fleet listed (the launcher writes in the
/// test's upstreams): LONGEST_PREFIX places prompts over the instances it
/// knows, and the warm-up must reach them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_cannot_pin_an_instance() {
    let harness = start_with_config(plugin_config_with(
        "PREFIX_AWARE",
        10,
        json!({"instances": []}),
    ));
    harness.fleet.set_hold_all(Duration::ZERO);
    warm_up(&harness, WARM_UP_KEYS).await;
    let addr = harness.envoy.listener_addr();
    let honest = shoot(addr, prefix_request("pinned", 0), Ending::Complete).await;
    let target = honest.served_by.clone().expect("served");
    let other = harness
        .fleet
        .names()
        .into_iter()
        .find(|n| *n != target)
        .unwrap();
    let other_addr = harness.fleet.addr_of(&other).unwrap().to_string();
    let target_addr = harness.fleet.addr_of(&target).unwrap().to_string();
    let lr_before = filter_counter(&harness.envoy, "decision.least_outstanding");
    let matched_before = filter_counter(&harness.envoy, "decision.matched");
    let mut outcomes = Vec::new();
    for n in 1..=10 {
        let request = prefix_request("pinned", n)
            .header(HOST_HEADER, &other_addr)
            .header(ROUTE_HEADER, "least_request")
            .header(COUNTED_HEADER, &target_addr);
        outcomes.push(shoot(addr, request, Ending::Complete).await);
    }
    assert_all_ok(&outcomes, "spoofing requests");
    println!(
        "client asked for {other} ({other_addr}) and the least_request route; served {:?}, decisions {:?}",
        served(&outcomes),
        kinds(&outcomes)
    );
    assert!(
        outcomes.iter().all(|o| o.served_by.as_deref() == Some(target.as_str())),
        "a client-sent {HOST_HEADER} or {ROUTE_HEADER} moved requests off the target {target}: {:?}",
        served(&outcomes)
    );
    assert!(
        // The honest request placed the prompt: the prefix index holds it there.
        outcomes.iter().all(|o| o.kind() == Some("matched")),
        "{:?}",
        kinds(&outcomes)
    );
    // The filter hands its counters to Envoy once per tick: wait until this
    // run's ten decisions are counted, then nothing else may have been.
    wait_for_counter(&harness.envoy, "decision.matched", matched_before + 10);
    assert_eq!(
        filter_counter(&harness.envoy, "decision.least_outstanding"),
        lr_before
    );
    for n in 1..=10 {
        let record = harness.record_of(&format!("pinned#{n}"));
        assert!(
            !record
                .header_values(HOST_HEADER)
                .contains(&other_addr.as_str()),
            "the client's {HOST_HEADER} reached the instance: {:?}",
            record.headers
        );
        assert_eq!(record.header_values(ROUTE_HEADER), Vec::<&str>::new());
        assert_eq!(
            record.header_values(COUNTED_HEADER),
            Vec::<&str>::new(),
            "the internal {COUNTED_HEADER} reached the instance"
        );
    }
}

/// The harness itself, through plain Envoy: instances hold requests and
/// measure their in-flight maximum, reset, hang until Envoy's route timeout
/// (and count the request done when Envoy gives up), and stream SSE.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upstream_behaviours_through_plain_envoy() {
    let harness = Harness::start_with(|b| {
        b.without_filter()
            .concurrency(2)
            .edit(|c| add_short_timeout_route(c, Duration::from_millis(500)))
    });
    let addr = harness.envoy.listener_addr();
    harness.fleet.set_hold_all(Duration::from_millis(300));
    harness
        .fleet
        .set_hold(0, Duration::from_millis(900))
        .unwrap();
    let started = Instant::now();
    let outcomes = shoot_all(addr, (0..14).map(|n| prefix_request("plain", n)).collect()).await;
    assert_all_ok(&outcomes, "held requests");
    let max = harness.fleet.max_in_flight();
    let total_max: u32 = max.values().sum();
    println!(
        "14 held requests in {:?}; max in flight per instance {max:?}",
        started.elapsed()
    );
    assert!(
        total_max >= 14,
        "requests were not held concurrently: {max:?}"
    );
    let slow = outcomes
        .iter()
        .filter(|o| o.served_by.as_deref() == Some("instance-1"))
        .map(|o| o.finished - o.started)
        .min();
    if let Some(slow) = slow {
        assert!(
            slow >= Duration::from_millis(900),
            "instance-1 held only {slow:?}"
        );
    }
    harness.fleet.wait_idle(Duration::from_secs(5)).unwrap();
    harness.fleet.set_hold_all(Duration::ZERO);

    let reset = shoot(
        addr,
        prefix_request("plain", 100).header(ACTION_HEADER, "reset"),
        Ending::Complete,
    )
    .await;
    assert_eq!(reset.status, Some(503), "{reset:?}");
    let fail = shoot(
        addr,
        prefix_request("plain", 99).header(ACTION_HEADER, "fail"),
        Ending::Complete,
    )
    .await;
    assert_eq!(fail.status, Some(500), "{fail:?}");
    let hang = prefix_request("plain", 101)
        .header(ACTION_HEADER, "hang")
        .header(SHORT_TIMEOUT_HEADER, "1");
    let hang = shoot(addr, hang, Ending::Complete).await;
    assert_eq!(hang.status, Some(504), "{hang:?}");
    // Envoy closed the upstream connection at its timeout: the instance's count ends.
    harness.fleet.wait_idle(Duration::from_secs(5)).unwrap();
    let sse = prefix_request("plain", 102)
        .header(ACTION_HEADER, "sse")
        .header(SSE_EVENTS_HEADER, "4")
        .header(SSE_INTERVAL_HEADER, "100");
    let reply = harness.send(sse).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.text().matches("data: ").count(),
        4,
        "{}",
        reply.text()
    );
    assert!(reply.text().ends_with("data: [DONE]\n\n"));
    let mid = prefix_request("plain", 103)
        .header(ACTION_HEADER, "sse")
        .header(SSE_EVENTS_HEADER, "100")
        .header(SSE_INTERVAL_HEADER, "100");
    let aborted = shoot(addr, mid, Ending::AbortAfterFirstChunk).await;
    assert!(
        aborted.aborted && aborted.status == Some(200),
        "{aborted:?}"
    );
    let held = prefix_request("plain", 104).header(HOLD_HEADER, "5000");
    let gave_up = shoot(addr, held, Ending::AbortAfter(Duration::from_millis(200))).await;
    assert!(gave_up.aborted, "{gave_up:?}");
    // Client aborts propagate through Envoy to the instance.
    harness.fleet.wait_idle(Duration::from_secs(3)).unwrap();
}
