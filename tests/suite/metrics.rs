//! The filter's metrics as Prometheus scrapes them from Envoy: decision
//! counters and the bytes-inspected histogram, both held in the VM and handed
//! to Envoy on the filter's 1 s tick, arrive complete (every request counted
//! once, every sample recorded once, with its value).

use std::time::{Duration, Instant};

use harness::{bodies, Harness, Outgoing};

const REQUESTS: usize = 12;
/// Bytes of each request's body.
const BODY_BYTES: usize = 8192;
/// Every decision kind LONGEST_PREFIX makes for a keyed request.
const DECISION_KINDS: [&str; 4] = ["matched", "cold", "moved", "overflow"];

/// The value of the Prometheus sample line whose series is exactly `series`
/// (`name{labels}` as Envoy writes it, `{}` for none).
fn sample(scraped: &str, series: &str) -> Option<f64> {
    scraped.lines().find_map(|line| {
        let (metric, value) = line.rsplit_once(' ')?;
        (metric == series).then(|| value.parse().ok()).flatten()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decision_counters_and_the_bytes_histogram_reach_prometheus_complete() {
    let harness = Harness::start();
    let mut rng = bodies::rng(5);
    let requests = (0..REQUESTS)
        .map(|n| {
            Outgoing::post("/invocations", bodies::bytes(&mut rng, BODY_BYTES)).id(&n.to_string())
        })
        .collect();
    let replies = harness.send_all(requests, 4).await;
    assert!(replies.iter().all(|r| r.status == 200));

    // Counters flush on the filter's tick; histograms reach the admin output
    // at Envoy's stats flush (5 s by default).
    let deadline = Instant::now() + Duration::from_secs(20);
    let (count, sum, decisions) = loop {
        let scraped = harness.envoy.prometheus().expect("admin /stats/prometheus");
        let count = sample(&scraped, "prefix_router_bytes_inspected_count{}").unwrap_or(0.0);
        let sum = sample(&scraped, "prefix_router_bytes_inspected_sum{}").unwrap_or(0.0);
        let decisions: f64 = DECISION_KINDS
            .iter()
            .map(|kind| {
                sample(
                    &scraped,
                    &format!("prefix_router_decision{{kind=\"{kind}\"}}"),
                )
                .unwrap_or(0.0)
            })
            .sum();
        if (count >= REQUESTS as f64 && decisions >= REQUESTS as f64) || Instant::now() > deadline {
            break (count, sum, decisions);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(decisions, REQUESTS as f64, "prefix-aware decisions counted");
    assert_eq!(count, REQUESTS as f64, "bytes_inspected samples");
    // Each invoke request inspects its prefix: the shipped configuration
    // leaves prefix_length at its default, longer than the body, so the
    // whole body.
    // Envoy's histograms keep values in log-linear bins, so the sum is close,
    // not exact (seen: 48,593 for 49,152).
    let prefix_length = prefix_router::config::Config::default().prefix_length;
    assert!(prefix_length >= BODY_BYTES);
    let expected = (REQUESTS * BODY_BYTES) as f64;
    assert!(
        (sum - expected).abs() <= expected * 0.05,
        "bytes_inspected sum {sum}, expected about {expected}"
    );
}
