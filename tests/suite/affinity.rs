//! Prefix affinity through a real Envoy: requests that share their first
//! `prefix_length` bytes (invoke) or characters (OpenAI chat) reach one
//! instance, and distinct prefixes spread over the fleet.
//!
//! The affinity checks run with `match: FIXED_PREFIX`, whose key is those
//! first bytes and whose instance is Maglev's (or the ring's) for the key,
//! whatever the load: LONGEST_PREFIX passes a hot prompt on to the next
//! instance at `load_margin`, and does not keep a shared system prompt's
//! conversations together (the chat bodies here).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use harness::load::{in_flight_gauges, parse_decision, DECISION_HEADER};
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

/// Rounds of one invoke request per prefix (8 at a time), tagged
/// `<label>-r<round>`; returns each request's decision kind by (label, round).
async fn rounds_of(
    harness: &Harness,
    prefixes: &[(String, String)],
    rounds: usize,
) -> BTreeMap<(String, usize), String> {
    let mut kinds = BTreeMap::new();
    for round in 0..rounds {
        let requests = prefixes
            .iter()
            .map(|(label, prefix)| {
                let body = format!("{prefix}|round {round}");
                Outgoing::post("/invocations", body).id(&format!("{label}-r{round}"))
            })
            .collect();
        let replies = harness.send_all(requests, 8).await;
        for ((label, _), reply) in prefixes.iter().zip(&replies) {
            assert_eq!(reply.status, 200, "{}", reply.text());
            let decision = reply.headers.get(DECISION_HEADER).expect("decision header");
            let (kind, _) = parse_decision(decision.to_str().unwrap());
            kinds.insert((label.clone(), round), kind);
        }
    }
    kinds
}

/// The instances each label's requests reached: `<label> first` for round 0,
/// `<label>` for the later rounds.
fn instances_by_round(harness: &Harness) -> BTreeMap<String, BTreeSet<String>> {
    instances_by_label(&harness.fleet.records(), |id| match id.split_once("-r") {
        Some((label, "0")) => format!("{label} first"),
        Some((label, _)) => label.to_string(),
        None => id.to_string(),
    })
}

/// How long the filter's known fleet must stay the same before it places
/// new keys directly (`KNOWN_FLEET_SETTLED_MS` in `src/strategy/key_balance.rs`).
const KNOWN_FLEET_SETTLED: Duration = Duration::from_secs(10);
/// Envoy dates a registration by the wall clock, the test by the monotonic one.
const CLOCK_MARGIN: Duration = Duration::from_millis(100);

/// The latest the filter's known fleet can have changed: it registers an
/// instance when it first sends it a request (the upstream filter, at the
/// request headers), before the instance records that request. Panics
/// unless every instance has received a request.
fn fleet_known_by(harness: &Harness) -> Instant {
    let records = harness.fleet.records();
    harness
        .fleet
        .names()
        .iter()
        .map(|name| {
            records
                .iter()
                .filter(|r| &r.instance == name)
                .map(|r| r.received_at)
                .min()
                .unwrap_or_else(|| {
                    panic!("{name} never received a request: the filter cannot know it")
                })
        })
        .max()
        .expect("a fleet")
}

fn labelled(rng: &mut impl rand::Rng, label: &str, count: usize) -> Vec<(String, String)> {
    (0..count)
        .map(|n| (format!("{label}{n}"), bodies::text(rng, PREFIX_BYTES)))
        .collect()
}

/// `key_balance_factor: 100` through a real Envoy with two worker VMs, 7
/// instances. A fresh Envoy sends 35 new prefixes by Maglev first (it does
/// not know the fleet yet) and checks each once: from its second request on
/// a prefix stays on one instance, `placed` exactly when it left Maglev's,
/// and every instance owns 35 / 7 = 5 where Maglev alone owns them unevenly.
/// Once the known fleet has been the same for 10 s, new prefixes are placed
/// before their first request (all but the one in eight that explores), and
/// the 70 prefixes end at 10 per instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_balancing_gives_every_instance_an_even_share_of_prefixes() {
    const HOT: usize = 35;
    let config = serde_json::json!({
        "key_balance_factor": 100,
        "decision_header": DECISION_HEADER,
    })
    .to_string();
    // The filter places keys only on instances that served through it, so the
    // test needs Maglev's first requests to reach all 7. With 35 keys that
    // fails for ~3 % of fleets (their ports decide Maglev's table; seen: one
    // instance got none), no fault of the filter: then start a new fleet.
    let mut attempts = 0;
    let (harness, mut rng, early, kinds, seen) = loop {
        attempts += 1;
        let config = config.clone();
        let harness = Harness::start_with(move |b| b.concurrency(2).plugin_config(config));
        let mut rng = bodies::rng(0xba1a);
        let early = labelled(&mut rng, "p", HOT);
        let kinds = rounds_of(&harness, &early, 4).await;
        let seen = instances_by_round(&harness);
        let reached: BTreeSet<&String> = early
            .iter()
            .filter_map(|(label, _)| seen[&format!("{label} first")].first())
            .collect();
        let reached = reached.len();
        if reached == INSTANCES || attempts == 3 {
            break (harness, rng, early, kinds, seen);
        }
        println!("Maglev's first requests reached {reached} of {INSTANCES} instances: new fleet");
    };
    let owned_by = |labels: &[(String, String)], seen: &BTreeMap<String, BTreeSet<String>>| {
        let mut owned: BTreeMap<String, usize> = BTreeMap::new();
        for (label, _) in labels {
            let instances = &seen[label];
            assert_eq!(
                instances.len(),
                1,
                "{label} moved after its first request: {instances:?}"
            );
            *owned.entry(instances.first().unwrap().clone()).or_default() += 1;
        }
        owned
    };
    let owned = owned_by(&early, &seen);
    let mut maglev: BTreeMap<&str, usize> = BTreeMap::new();
    for (label, _) in &early {
        let first = seen[&format!("{label} first")].first().unwrap();
        *maglev.entry(first).or_default() += 1;
        assert_eq!(
            kinds[&(label.clone(), 0)],
            "prefix",
            "{label}: by Maglev first"
        );
        let moved = !seen[label].contains(first);
        for round in 1..4 {
            let expected = if moved { "placed" } else { "prefix" };
            assert_eq!(
                kinds[&(label.clone(), round)],
                expected,
                "{label}, round {round}"
            );
        }
    }
    println!("prefixes per instance: balanced {owned:?}, first requests (Maglev) {maglev:?}");
    assert_eq!(
        owned.len(),
        INSTANCES,
        "every instance owns prefixes: {owned:?}"
    );
    assert!(
        owned.values().all(|n| *n == HOT / INSTANCES),
        "uneven: {owned:?} (Maglev: {maglev:?})"
    );

    // The filter places new keys directly once its known fleet has been the
    // same for KNOWN_FLEET_SETTLED. Its in-flight gauges show which
    // instances it knows (all 7, no other), but no stat shows when that set
    // last changed, so the test dates the change from the instances' records
    // (counted from Envoy's start instead, a slow first round on a busy
    // machine left the fleet unsettled: seen 0 of 35 placed at once).
    let addrs = harness.fleet.addrs();
    harness::wait_until(
        &format!("the filter's in-flight gauges name the {INSTANCES} instances, no other"),
        Duration::from_secs(5),
        || in_flight_gauges(&harness.envoy),
        |gauges| {
            gauges.len() == INSTANCES
                && addrs.iter().all(|addr| {
                    let name = prefix_router::metrics::in_flight_gauge_name(&addr.to_string());
                    gauges.keys().any(|g| g.ends_with(&name))
                })
        },
    )
    .await;
    let settled_at = fleet_known_by(&harness) + KNOWN_FLEET_SETTLED + CLOCK_MARGIN;
    println!(
        "the known fleet settles {:?} after the early rounds end",
        settled_at.saturating_duration_since(Instant::now())
    );
    tokio::time::sleep_until(settled_at.into()).await;
    let late = labelled(&mut rng, "q", HOT);
    let kinds = rounds_of(&harness, &late, 3).await;
    let seen = instances_by_round(&harness);
    let mut placed_first = 0;
    for (label, _) in &late {
        if kinds[&(label.clone(), 0)] == "placed" {
            placed_first += 1;
            assert_eq!(
                seen[&format!("{label} first")],
                seen[label],
                "{label} never moves"
            );
        }
    }
    assert!(
        placed_first >= HOT * 3 / 4,
        "{placed_first} of {HOT} placed at once"
    );
    let all: Vec<(String, String)> = early.into_iter().chain(late).collect();
    let owned = owned_by(&all, &seen);
    println!("after 35 more: {owned:?}, {placed_first} placed before their first request");
    assert!(
        owned.values().all(|n| *n == 2 * HOT / INSTANCES),
        "uneven: {owned:?}"
    );
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
