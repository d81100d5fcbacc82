//! The other strategies through a real Envoy with two workers:
//! LEAST_OUTSTANDING_REQUESTS keeps the instances' in-flight counts balanced
//! under steady load (sampled at the instances), RANDOM spreads requests
//! uniformly, and the same balance measure tells RANDOM apart (so it can fail).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::load::{
    assert_all_ok, kinds, overload_harness, plugin_config, prefix_request, shoot, Ending, Outcome,
};
use harness::{Harness, INSTANCES};
use prefix_router_tools::upstream::HOLD_HEADER;

/// Per-instance holds: seven instances of different speeds.
const HOLDS_MS: [u64; INSTANCES] = [100, 200, 300, 450, 600, 800, 1000];
const CLIENTS: usize = 21;
const SAMPLE_EVERY: Duration = Duration::from_millis(50);
/// Bound on the ramp-up (every client's first request answered).
const RAMP_UP_LIMIT: Duration = Duration::from_secs(10);

/// The tests of this file, one at a time: each puts an Envoy and a closed
/// loop of clients (or a burst of 1,400 requests) on the machine's cores, and
/// a concurrent burst delays the other's Envoy enough to skew the in-flight
/// counts it samples (seen: spreads of 4 and 5 for a second under
/// LEAST_OUTSTANDING_REQUESTS while RANDOM's burst ran on two cores).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Balance {
    /// Samples with the load in steady state (all clients' requests in flight, ±2).
    samples: usize,
    /// Samples with max − min ≤ 2.
    balanced: usize,
    /// Spread (max − min) -> samples.
    histogram: BTreeMap<u32, usize>,
    outcomes: Vec<Outcome>,
    /// From the clients' start until every one had its first request answered.
    ramp_up: Duration,
}

impl Balance {
    fn fraction(&self) -> f64 {
        self.balanced as f64 / self.samples.max(1) as f64
    }
}

/// `CLIENTS` closed-loop clients for `duration`, counted from the moment
/// every client has had its first request answered (the ramp-up: until then
/// the in-flight counts are those of the clients' common start, not of the
/// closed loop); in-flight counts sampled at the instances.
async fn steady_load(harness: &Harness, duration: Duration) -> Balance {
    for (index, hold) in HOLDS_MS.iter().enumerate() {
        harness
            .fleet
            .set_hold(index, Duration::from_millis(*hold))
            .unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let first_answered = Arc::new(AtomicUsize::new(0));
    let addr = harness.envoy.listener_addr();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let stop = Arc::clone(&stop);
            let first_answered = Arc::clone(&first_answered);
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    let request = prefix_request(&format!("steady-{}", n % 5), client * 10_000 + n);
                    outcomes.push(shoot(addr, request, Ending::Complete).await);
                    if n == 0 {
                        first_answered.fetch_add(1, Ordering::SeqCst);
                    }
                    n += 1;
                }
                outcomes
            })
        })
        .collect();
    let (_, ramp_up) = harness::wait_until(
        &format!("every one of the {CLIENTS} clients has had its first request answered"),
        RAMP_UP_LIMIT,
        || first_answered.load(Ordering::SeqCst),
        |answered| *answered >= CLIENTS,
    )
    .await;
    let end = Instant::now() + duration;
    let mut histogram = BTreeMap::new();
    let (mut samples, mut balanced) = (0, 0);
    while Instant::now() < end {
        let counts = harness.fleet.in_flight();
        let total: u32 = counts.iter().sum();
        if total as usize + 2 >= CLIENTS {
            let spread = counts.iter().max().unwrap() - counts.iter().min().unwrap();
            *histogram.entry(spread).or_default() += 1;
            samples += 1;
            if spread <= 2 {
                balanced += 1;
            }
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    stop.store(true, Ordering::SeqCst);
    let mut outcomes = Vec::new();
    for client in clients {
        outcomes.extend(client.await.unwrap());
    }
    Balance {
        samples,
        balanced,
        histogram,
        outcomes,
        ramp_up,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn least_outstanding_keeps_instances_balanced_under_steady_load() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let harness = overload_harness(&plugin_config("LEAST_OUTSTANDING_REQUESTS", 10));
    let balance = steady_load(&harness, Duration::from_secs(10)).await;
    assert_all_ok(&balance.outcomes, "LEAST_OUTSTANDING_REQUESTS");
    println!(
        "LEAST_OUTSTANDING_REQUESTS, {CLIENTS} clients, holds {HOLDS_MS:?} ms, ramp-up {:?}: {} requests, {:.1}% of {} samples with max-min <= 2, spreads {:?}, requests per instance {:?}, decisions {:?}",
        balance.ramp_up,
        balance.outcomes.len(),
        balance.fraction() * 100.0,
        balance.samples,
        balance.histogram,
        harness.fleet.counts(),
        kinds(&balance.outcomes)
    );
    assert!(
        balance.samples >= 100,
        "too few steady samples: {}",
        balance.samples
    );
    assert!(
        balance.fraction() >= 0.95,
        "in-flight counts balanced (max-min <= 2) in only {:.1}% of samples: {:?}",
        balance.fraction() * 100.0,
        balance.histogram
    );
    let all_lor = kinds(&balance.outcomes).get("least_outstanding").copied();
    assert_eq!(
        all_lor,
        Some(balance.outcomes.len()),
        "{:?}",
        kinds(&balance.outcomes)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn random_spreads_uniformly_and_does_not_balance_in_flight() {
    let _turn = ONE_AT_A_TIME.lock().await;
    const REQUESTS: usize = 1400;
    let harness = overload_harness(&plugin_config("RANDOM", 10));
    // Uniform: one prefix, no hold, each instance near 1/7.
    let requests = (0..REQUESTS)
        .map(|n| prefix_request("random", n).header(HOLD_HEADER, "0"))
        .collect();
    let replies = harness.send_all(requests, 8).await;
    assert!(replies.iter().all(|r| r.status == 200));
    let counts = harness.fleet.counts();
    let ideal = REQUESTS as f64 / INSTANCES as f64;
    println!("RANDOM, {REQUESTS} requests of one prefix: {counts:?} (ideal {ideal:.0} each)");
    for (name, count) in &counts {
        assert!(
            (*count as f64 - ideal).abs() <= 0.25 * ideal,
            "{name} got {count} of {REQUESTS} requests (ideal {ideal:.0}): {counts:?}"
        );
    }
    // The balance measure of the test above discriminates: RANDOM fails it.
    harness.fleet.clear();
    let balance = steady_load(&harness, Duration::from_secs(5)).await;
    assert_all_ok(&balance.outcomes, "RANDOM");
    println!(
        "RANDOM under the same steady load, ramp-up {:?}: {:.1}% of {} samples with max-min <= 2, spreads {:?}",
        balance.ramp_up,
        balance.fraction() * 100.0,
        balance.samples,
        balance.histogram
    );
    // Without steady samples the fraction below is 0 and says nothing (a
    // 5 s load under two busy loops gave 60).
    assert!(
        balance.samples >= 20,
        "too few steady samples: {}",
        balance.samples
    );
    assert!(balance.fraction() < 0.95, "{:?}", balance.histogram);
    let all_random = kinds(&balance.outcomes).get("random").copied();
    assert_eq!(
        all_random,
        Some(balance.outcomes.len()),
        "{:?}",
        kinds(&balance.outcomes)
    );
}
