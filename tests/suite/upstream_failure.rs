//! An instance that dies, through a real Envoy with the shipped
//! configuration: no request fails at the client (a connection refused is
//! retried on another instance), the filter stops choosing the dead
//! instance after its first failure, and chooses it again once it is back.
//!
//! The instance "dies" by its port closing ([`Relay::stop`]): connections
//! are refused, as when its process is killed. Counts come from Envoy's own
//! per-host stats (`/clusters`), never from timing.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use harness::load::{
    assert_all_ok, filter_counter, host_counter, prefix_request, shoot_all, wait_for_counter,
    Outcome, HOST_HEADER,
};
use harness::relay::Relay;
use harness::{wait_until, Harness, Outgoing, KEY_HEADER};
use prefix_router::load::FAILED_RETRY_MS;
use prefix_router_tools::envoy::{Envoy, EnvoyBuilder};
use prefix_router_tools::upstream::{UpstreamFleet, HOLD_HEADER};

/// Envoy's worker threads: each runs its own VM, deciding on its own.
const WORKERS: u32 = 2;
/// Requests sent at once: enough that both workers decide while the first
/// failure is being seen.
const WAVE: usize = 8;

/// Six recording instances and a seventh behind a relay (the one that
/// dies), all seven in Envoy's cluster and the filter's `instances`.
async fn start(customise: impl FnOnce(EnvoyBuilder) -> EnvoyBuilder) -> (Harness, Relay) {
    let fleet = UpstreamFleet::start(7).expect("starting upstream instances");
    let mut addrs = fleet.addrs();
    let victim = addrs.pop().expect("seven instances");
    let relay = Relay::start(victim).await.expect("starting the relay");
    addrs.push(relay.addr());
    let envoy = customise(Envoy::builder().upstreams(addrs).concurrency(WORKERS))
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    (Harness { envoy, fleet }, relay)
}

/// Sends `requests` in waves of [`WAVE`] at once.
async fn send_in_waves(addr: SocketAddr, requests: Vec<Outgoing>) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    let mut requests = requests.into_iter().peekable();
    while requests.peek().is_some() {
        let wave: Vec<Outgoing> = requests.by_ref().take(WAVE).collect();
        outcomes.extend(shoot_all(addr, wave).await);
    }
    outcomes
}

fn served_by_victim(harness: &Harness) -> usize {
    harness
        .fleet
        .counts()
        .get("instance-7")
        .copied()
        .unwrap_or(0)
}

/// Request `n`, its override header naming the instance at `host`.
fn overridden_to(host: SocketAddr, n: usize) -> Outgoing {
    Outgoing::post("/invocations", format!("request {n}"))
        .header(HOST_HEADER, host.to_string())
        .header(KEY_HEADER, format!("{n:016x}"))
}

/// The shipped route and cluster alone (no filter): a request whose override
/// header names an instance that refuses connections tries it first, then
/// is retried on another instance (MAGLEV, skipping the hosts tried).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_leaves_the_overridden_instance_when_its_connection_fails() {
    const REQUESTS: usize = 12;
    let (harness, mut relay) = start(|b| b.without_filter()).await;
    relay.stop().await;
    let dead = relay.addr();
    for n in 0..REQUESTS {
        let reply = harness.send(overridden_to(dead, n)).await;
        assert_eq!(reply.status, 200, "request {n}: {}", reply.text());
        assert!(reply.served_by().is_some_and(|s| s != "instance-7"));
    }
    assert_eq!(
        host_counter(&harness.envoy, dead, "cx_connect_fail"),
        REQUESTS as u64,
        "every first attempt went where the override header said"
    );
}

/// The shipped route and cluster alone: more refused connections at once
/// than Envoy's default of 3 retries in flight per cluster, each retry held
/// by its instance (as a generation is), are all retried, none answered 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_refused_connections_is_retried_in_full_while_the_retries_run() {
    const BURST: usize = 8;
    let (harness, mut relay) = start(|b| b.without_filter()).await;
    relay.stop().await;
    let dead = relay.addr();
    let requests = (0..BURST)
        .map(|n| overridden_to(dead, n).header(HOLD_HEADER, "1500"))
        .collect();
    let outcomes = shoot_all(harness.envoy.listener_addr(), requests).await;
    let overflowed = harness
        .envoy
        .stat("cluster.vllm.upstream_rq_retry_overflow")
        .expect("admin /stats")
        .unwrap_or(0);
    assert_all_ok(&outcomes, "a burst at a dead instance");
    assert_eq!(overflowed, 0, "retries refused by the circuit breaker");
    // Outlier detection ejects the instance at its 5th failure in a row;
    // requests chosen after that skip it. Five is past the default of 3.
    let tried = host_counter(&harness.envoy, dead, "cx_connect_fail");
    assert!(
        tried >= 5,
        "{tried} first attempts at the dead instance: fewer than Envoy's default allows retried"
    );
}

/// The scenario of the module documentation, with the shipped filter
/// configuration (LONGEST_PREFIX on the listed fleet) and two workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_instance_that_dies_loses_no_request_and_is_chosen_again_once_back() {
    let (harness, mut relay) = start(|b| b).await;
    let addr = harness.envoy.listener_addr();
    let labels: Vec<String> = (0..70).map(|i| format!("prompt-{i}")).collect();
    let requests = |round: usize| {
        labels
            .iter()
            .map(|label| prefix_request(label, round))
            .collect::<Vec<_>>()
    };
    let outcomes = send_in_waves(addr, requests(0)).await;
    assert_all_ok(&outcomes, "before the instance dies");
    assert!(
        served_by_victim(&harness) > 0,
        "the instance that dies served before"
    );

    relay.stop().await;
    let dead = relay.addr();
    // Envoy has seen its pooled connections there close (a request written
    // on one before that fails, as the instance may have read it: never
    // retried).
    wait_until(
        "Envoy closed its connections to the dead instance",
        Duration::from_secs(10),
        || host_counter(&harness.envoy, dead, "cx_active"),
        |active| *active == 0,
    )
    .await;
    let died = Instant::now();
    // The same prompts again (some held by the dead instance) and new ones.
    let mut after = requests(1);
    after.extend((70..140).map(|i| prefix_request(&format!("prompt-{i}"), 1)));
    let outcomes = send_in_waves(addr, after).await;
    let dead_for = died.elapsed();
    assert_all_ok(&outcomes, "after the instance died (retried elsewhere)");
    let tried = host_counter(&harness.envoy, dead, "cx_connect_fail");
    assert!(
        tried >= 1,
        "no request tried the dead instance: nothing was tested"
    );
    // After the first failure: at most two per worker (decided before the
    // mark was seen), plus, per FAILED_RETRY_MS dead, one try per worker by
    // the filter and one at the end of Envoy's ejection (as long, 3 s).
    let periods = dead_for.as_millis() as u64 / FAILED_RETRY_MS;
    let bound = 1 + u64::from(WORKERS) * (2 + 2 * periods);
    assert!(
        tried <= bound,
        "{tried} connections tried to the dead instance in {dead_for:?} (at most {bound})"
    );
    // The filter saw the failure and marked the instance (its stats flush
    // on the tick).
    wait_for_counter(&harness.envoy, "upstream.instances_failed", 1);
    assert!(filter_counter(&harness.envoy, "upstream.connection_failures") >= 1);

    relay.restart().await.expect("restarting the instance");
    let before = served_by_victim(&harness);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut round = 2;
    while served_by_victim(&harness) == before {
        assert!(
            Instant::now() < deadline,
            "the instance was not chosen again within 30 s of coming back"
        );
        let outcomes = send_in_waves(addr, requests(round)).await;
        assert_all_ok(&outcomes, "after the instance came back");
        round += 1;
    }
}
