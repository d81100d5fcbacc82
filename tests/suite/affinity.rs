//! Prefix affinity through a real Envoy: requests that share their first
//! `prefix_length` bytes (invoke) or characters (OpenAI chat) reach one
//! instance, and distinct prefixes spread over the fleet.
//!
//! The affinity checks run with `match: FIXED_PREFIX`, whose key is those
//! first bytes and whose instance is Maglev's (or the ring's) for the key,
//! whatever the load: LONGEST_PREFIX passes a hot prompt on to the next
//! instance at `load_margin`, and does not keep a shared system prompt's
//! conversations together (the chat bodies here).

use std::collections::BTreeSet;

use harness::{bodies, envoy_config, instances_by_label, Harness, Outgoing, INSTANCES};
use rand::Rng;

const PREFIXES: usize = 50;
const REQUESTS_PER_PREFIX: usize = 10;
const PREFIX_BYTES: usize = 6000;

/// Sends `PREFIXES` × `REQUESTS_PER_PREFIX` requests built by `body(prefix, suffix)`,
/// then checks each prefix went to exactly one instance and at least 5 were used.
async fn check_affinity(harness: &Harness, path: &str, body: impl Fn(&str, &str) -> String) {
    let mut rng = bodies::rng(0xaff1);
    let prefixes: Vec<String> = (0..PREFIXES)
        .map(|_| bodies::text(&mut rng, PREFIX_BYTES))
        .collect();
    let mut requests = Vec::new();
    for (p, prefix) in prefixes.iter().enumerate() {
        for r in 0..REQUESTS_PER_PREFIX {
            let suffix_len = rng.gen_range(1..2000);
            let suffix = bodies::text(&mut rng, suffix_len);
            requests.push(Outgoing::post(path, body(prefix, &suffix)).id(&format!("p{p}-r{r}")));
        }
    }
    let replies = harness.send_all(requests, 8).await;
    for reply in &replies {
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    // Every request carried a well-formed key upstream.
    for p in 0..PREFIXES {
        for r in 0..REQUESTS_PER_PREFIX {
            harness.key_of(&format!("p{p}-r{r}"));
        }
    }
    let by_prefix = instances_by_label(&harness.fleet.records(), |id| {
        id.split('-').next().unwrap_or(id).to_string()
    });
    assert_eq!(by_prefix.len(), PREFIXES);
    let split: Vec<_> = by_prefix.iter().filter(|(_, i)| i.len() != 1).collect();
    assert!(
        split.is_empty(),
        "prefixes served by several instances: {split:?}"
    );
    let used: BTreeSet<&String> = by_prefix.values().flatten().collect();
    println!(
        "{path}: {PREFIXES} prefixes on {} instances: {:?}",
        used.len(),
        harness.fleet.counts()
    );
    assert!(
        used.len() >= 5,
        "only {} of {INSTANCES} instances used: {used:?}",
        used.len()
    );
}

/// `match: FIXED_PREFIX`, the fleet listed as the shipped configuration lists
/// it (the launcher writes in the test's upstreams).
const FIXED_PREFIX_CONFIG: &str = r#"{"match": "FIXED_PREFIX", "instances": []}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invoke_requests_sharing_a_prefix_reach_one_instance() {
    let harness = Harness::with_plugin_config(FIXED_PREFIX_CONFIG);
    check_affinity(&harness, "/invocations", |prefix, suffix| {
        format!("{prefix}{suffix}")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_requests_sharing_a_prefix_reach_one_instance() {
    // Two workers, two VMs: both must compute the same keys.
    let harness = Harness::start_with(|b| b.concurrency(2).plugin_config(FIXED_PREFIX_CONFIG));
    check_affinity(&harness, "/v1/chat/completions", |prefix, suffix| {
        bodies::chat("llama-3.1-70b", prefix, suffix)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_hash_variant_keeps_affinity_too() {
    let harness = Harness::start_with(|b| {
        b.config_file(envoy_config("envoy-ring-hash.yaml"))
            .plugin_config(FIXED_PREFIX_CONFIG)
    });
    check_affinity(&harness, "/invocations", |prefix, suffix| {
        format!("{prefix}{suffix}")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_prefixes_spread_evenly() {
    const KEYS: usize = 2000;
    let harness = Harness::start();
    let mut rng = bodies::rng(0x5a4e);
    let requests = (0..KEYS)
        .map(|i| Outgoing::post("/invocations", bodies::text(&mut rng, 4200)).id(&format!("k{i}")))
        .collect();
    let replies = harness.send_all(requests, 16).await;
    assert!(replies.iter().all(|r| r.status == 200));
    harness.key_of("k0");
    let counts = harness.fleet.counts();
    let ideal = 1.0 / INSTANCES as f64;
    let shares: Vec<(String, f64)> = counts
        .iter()
        .map(|(name, count)| (name.clone(), *count as f64 / KEYS as f64))
        .collect();
    let printed: Vec<String> = shares
        .iter()
        .map(|(name, share)| format!("{name} {:.2}%", share * 100.0))
        .collect();
    println!(
        "shares of {KEYS} distinct prefixes (ideal {:.2}%): {}",
        ideal * 100.0,
        printed.join(", ")
    );
    assert_eq!(counts.values().sum::<usize>(), KEYS);
    for (name, share) in &shares {
        assert!(
            (share - ideal).abs() <= 0.25 * ideal,
            "{name} got {:.2}% of requests, outside ±25% of {:.2}%: {printed:?}",
            share * 100.0,
            ideal * 100.0
        );
    }
}
