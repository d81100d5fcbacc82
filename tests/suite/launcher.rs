//! The harness itself, checked with plain Envoy (the same configuration
//! without the filter), so a failure elsewhere is about the filter, not the
//! launcher: it starts, forwards to the recording upstreams, exposes stats,
//! reports startup failures with Envoy's log, and stops Envoy when dropped.

use harness::bodies;
use harness::{Harness, Outgoing};
use prefix_router_tools::envoy::Envoy;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_envoy_forwards_bodies_and_reports_stats() {
    let harness = Harness::start_with(|b| b.without_filter());
    let body = bodies::bytes(&mut bodies::rng(7), 10_000);
    let reply = harness
        .send(Outgoing::post("/invocations", body.clone()).id("plain-1"))
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let record = harness.record_of("plain-1");
    assert_eq!(reply.served_by(), Some(record.instance.as_str()));
    assert_eq!(record.body_sha256, bodies::sha256(&body));
    assert_eq!(record.path, "/invocations");

    let sent = harness
        .envoy
        .stat("cluster.vllm.upstream_rq_completed")
        .unwrap();
    assert_eq!(sent, Some(1), "Envoy's own count of upstream requests");
    assert_eq!(harness.envoy.stat("no.such.stat").unwrap(), None);
    let prometheus = harness.envoy.prometheus().unwrap();
    assert!(prometheus.contains("envoy_cluster_upstream_rq_completed"));
    // Envoy flushes its log file on a timer: wait for the line, bounded.
    let line = harness
        .envoy
        .wait_for_log_line(std::time::Duration::from_secs(5), |l| {
            l.contains("starting main dispatch loop")
        })
        .unwrap();
    assert!(harness.envoy.log().contains(&line));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_envoy_spreads_keyless_requests() {
    // Without the filter no request carries a key: MAGLEV picks at random.
    // This is the baseline the affinity tests must beat.
    let harness = Harness::start_with(|b| b.without_filter());
    let prefix = bodies::text(&mut bodies::rng(8), 6000);
    let requests = (0..40)
        .map(|i| Outgoing::post("/invocations", format!("{prefix}{i}")).id(&format!("r{i}")))
        .collect();
    harness.send_all(requests, 8).await;
    let used = harness.fleet.counts().values().filter(|c| **c > 0).count();
    assert!(used >= 4, "40 keyless requests used only {used} instances");
}

#[test]
fn dropping_the_launcher_stops_envoy() {
    let harness = Harness::start_with(|b| b.without_filter());
    let pid = harness.envoy.pid().expect("running Envoy has a pid");
    let admin = harness.envoy.admin_addr();
    drop(harness);
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "Envoy {pid} still exists after drop"
    );
    assert!(std::net::TcpStream::connect(admin).is_err());
}

#[test]
fn a_missing_wasm_says_how_to_build_it() {
    let error = Envoy::builder()
        .wasm("/nonexistent/prefix_router.wasm")
        .start()
        .err()
        .expect("Envoy must not start without the filter");
    let message = error.to_string();
    assert!(message.contains("cargo xtask test"), "{message}");
    assert!(
        message.contains("/nonexistent/prefix_router.wasm"),
        "{message}"
    );
}

#[test]
fn a_startup_failure_carries_envoys_log() {
    // A configuration Envoy refuses: the error must quote Envoy's reason.
    let error = Envoy::builder()
        .without_filter()
        .edit(|config| {
            config["static_resources"]["clusters"][0]["lb_policy"] = "NOT_A_POLICY".into();
            Ok(())
        })
        .start()
        .err()
        .expect("Envoy must refuse an unknown lb_policy");
    let message = error.to_string();
    assert!(message.contains("NOT_A_POLICY"), "{message}");
    assert!(
        error.exit_status.is_some(),
        "Envoy should have exited by itself"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_served_from_a_file_change_without_a_restart() {
    let harness = Harness::start_with(|b| b.without_filter().endpoints_from_file());
    assert_eq!(
        harness.envoy.stat("cluster.vllm.membership_total").unwrap(),
        Some(harness::INSTANCES as u64)
    );
    let kept = &harness.fleet.addrs()[..2];
    harness.envoy.set_endpoints("vllm", kept).unwrap();
    let requests = (0..30)
        .map(|i| Outgoing::post("/invocations", format!("body {i}")).id(&format!("e{i}")))
        .collect();
    let replies = harness.send_all(requests, 6).await;
    assert!(replies.iter().all(|r| r.status == 200));
    let kept_names: Vec<&str> = kept
        .iter()
        .filter_map(|a| harness.fleet.name_of(*a))
        .collect();
    for record in harness.fleet.records() {
        assert!(
            kept_names.contains(&record.instance.as_str()),
            "{} served a request after it left the cluster",
            record.instance
        );
    }
    assert_eq!(harness.fleet.total(), 30);
}
