//! Scaling the fleet by file-based EDS, without restarting Envoy: 7 -> 6 -> 7
//! -> 8 instances with 1,000 keys. Few keys move (at most 1.3 × the ideal
//! share, at most 1% between instances that stayed), and the filter's learned
//! tables do not undo it: after each change every key goes exactly where
//! Maglev alone sends it, checked against a second, filter-less Envoy with the
//! same instances that is given the same key header.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use harness::load::prefix_request;
use harness::{Outgoing, KEY_HEADER};
use prefix_router_tools::envoy::Envoy;
use prefix_router_tools::upstream::{UpstreamFleet, HOLD_HEADER};

const KEYS: usize = 1000;

/// label -> (key, instance) through the filter's Envoy.
async fn route_keys(
    envoy: &Envoy,
    fleet: &UpstreamFleet,
    phase: &str,
) -> BTreeMap<usize, (String, String)> {
    fleet.clear();
    let requests = (0..KEYS)
        .map(|i| prefix_request(&format!("scale-{i}"), 0).header(HOLD_HEADER, "0"))
        .collect();
    // 8 at a time: fewer than the threshold (10), so nothing overflows.
    let replies = harness::client::send_all(envoy.listener_addr(), requests, 8)
        .await
        .unwrap();
    assert!(
        replies.iter().all(|r| r.status == 200),
        "{phase}: a request failed"
    );
    let mut routed = BTreeMap::new();
    for record in fleet.records() {
        let id = record.header(harness::TEST_ID_HEADER).unwrap_or_default();
        // prefix_request tags requests `scale-<i>#0`.
        let i: usize = id
            .trim_start_matches("scale-")
            .trim_end_matches("#0")
            .parse()
            .unwrap_or_else(|e| panic!("{phase}: test id {id:?}: {e}"));
        let key = record.header(KEY_HEADER).expect("keyed").to_string();
        routed.insert(i, (key, record.instance.clone()));
    }
    assert_eq!(routed.len(), KEYS, "{phase}");
    routed
}

/// label -> instance where the filter-less Envoy's Maglev sends each key.
async fn maglev_reference(
    reference: &Envoy,
    keys: &BTreeMap<usize, (String, String)>,
) -> BTreeMap<usize, String> {
    let requests = keys
        .iter()
        .map(|(i, (key, _))| {
            Outgoing::get("/reference")
                .header(KEY_HEADER, key)
                .id(&format!("ref-{i}"))
        })
        .collect();
    let replies = harness::client::send_all(reference.listener_addr(), requests, 8)
        .await
        .unwrap();
    keys.keys()
        .zip(replies)
        .map(|(i, r)| (*i, r.served_by().expect("served").to_string()))
        .collect()
}

struct Step {
    name: &'static str,
    before: Vec<SocketAddr>,
    after: Vec<SocketAddr>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fleet_changes_move_few_keys_and_learned_tables_follow_maglev() {
    let fleet = UpstreamFleet::start(8).unwrap();
    let all = fleet.addrs();
    let seven = all[..7].to_vec();
    let six: Vec<SocketAddr> = seven.iter().copied().filter(|a| *a != all[2]).collect();
    let eight = all.clone();
    // No decision header: nothing here needs it. FIXED_PREFIX: keys that
    // Maglev places and learned tables are what is under test.
    let config = r#"{"strategy":"PREFIX_AWARE","match":"FIXED_PREFIX","concurrency_threshold":10}"#;
    let envoy = Envoy::builder()
        .upstreams(seven.clone())
        .endpoints_from_file()
        .concurrency(2)
        .plugin_config(config)
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    let reference = Envoy::builder()
        .without_filter()
        .upstreams(seven.clone())
        .endpoints_from_file()
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    println!("clusters fed from files: {:?}", envoy.eds_clusters());

    let mut previous = route_keys(&envoy, &fleet, "7").await;
    let truth = maglev_reference(&reference, &previous).await;
    let mut previous_truth = truth.clone();
    let mismatches = previous
        .iter()
        .filter(|(i, (_, inst))| truth[i] != *inst)
        .count();
    println!("7 instances: {mismatches} of {KEYS} keys off Maglev's choice");
    assert_eq!(
        mismatches, 0,
        "before any change the filter must follow Maglev"
    );

    let steps = [
        Step {
            name: "7 -> 6 (one leaves)",
            before: seven.clone(),
            after: six.clone(),
        },
        Step {
            name: "6 -> 7 (it comes back)",
            before: six.clone(),
            after: seven.clone(),
        },
        Step {
            name: "7 -> 8 (a new one joins)",
            before: seven.clone(),
            after: eight.clone(),
        },
    ];
    let mut at_six = BTreeMap::new();
    for (n, step) in steps.iter().enumerate() {
        envoy.set_fleet(&step.after).unwrap();
        reference.set_fleet(&step.after).unwrap();
        let now = route_keys(&envoy, &fleet, &format!("step{n}")).await;
        let truth = maglev_reference(&reference, &now).await;
        let before_names: BTreeSet<String> = step
            .before
            .iter()
            .map(|a| fleet.name_of(*a).unwrap().to_string())
            .collect();
        let after_names: BTreeSet<String> = step
            .after
            .iter()
            .map(|a| fleet.name_of(*a).unwrap().to_string())
            .collect();
        let changed = before_names.symmetric_difference(&after_names).count();
        let ideal = changed as f64 / before_names.len().max(after_names.len()) as f64;
        let moved = now
            .iter()
            .filter(|(i, (_, inst))| previous[i].1 != *inst)
            .count();
        let on_kept: Vec<&usize> = previous
            .iter()
            .filter(|(_, (_, inst))| after_names.contains(inst))
            .map(|(i, _)| i)
            .collect();
        let moved_between_kept = on_kept
            .iter()
            .filter(|i| {
                let (old, new) = (&previous[**i].1, &now[**i].1);
                old != new && before_names.contains(new)
            })
            .count();
        let off_maglev = now
            .iter()
            .filter(|(i, (_, inst))| truth[i] != *inst)
            .count();
        // Maglev's own movement between kept instances, from the filterless
        // reference Envoy: it depends on the hosts' (ephemeral) addresses,
        // 0-4 of ~860 keys in most runs, 13 seen once.
        let maglev_between_kept = on_kept
            .iter()
            .filter(|i| {
                let (old, new) = (&previous_truth[**i], &truth[**i]);
                old != new && before_names.contains(new)
            })
            .count();
        let keys_changed = now
            .iter()
            .filter(|(i, (key, _))| previous[i].0 != *key)
            .count();
        println!(
            "{}: {moved} of {KEYS} keys moved ({:.1}%, ideal {:.1}%, bound {:.1}%); {moved_between_kept} of {} keys on kept instances moved between kept instances (Maglev itself: {maglev_between_kept}); {off_maglev} keys off Maglev's choice; requests per instance this step (filter + reference Envoy) {:?}",
            step.name,
            moved as f64 / KEYS as f64 * 100.0,
            ideal * 100.0,
            1.3 * ideal * 100.0,
            on_kept.len(),
            fleet.counts()
        );
        assert_eq!(keys_changed, 0, "the keys themselves must not change");
        assert_eq!(
            off_maglev, 0,
            "{}: requests not where Maglev sends them (stale learned tables?)",
            step.name
        );
        assert!(
            moved as f64 <= 1.3 * ideal * KEYS as f64,
            "{}: {moved} keys moved",
            step.name
        );
        assert!(
            moved_between_kept <= maglev_between_kept,
            "{}: {moved_between_kept} keys moved between instances that stayed, Maglev itself moved {maglev_between_kept}",
            step.name
        );
        assert!(
            moved_between_kept as f64 <= 0.03 * on_kept.len() as f64,
            "{}: {moved_between_kept} keys moved between instances that stayed",
            step.name
        );
        if step.after.len() == 6 {
            at_six = now.clone();
        }
        previous = now;
        previous_truth = truth;
    }
    // The spec's 7 -> 6 -> 8 read as one change from 6 to 8 (two join): ideal 2/8.
    let moved = previous
        .iter()
        .filter(|(i, (_, inst))| at_six[i].1 != *inst)
        .count();
    println!(
        "6 -> 8 overall: {moved} of {KEYS} keys moved ({:.1}%, ideal 25.0%, bound 32.5%)",
        moved as f64 / KEYS as f64 * 100.0
    );
    assert!(
        moved as f64 <= 1.3 * 0.25 * KEYS as f64,
        "6 -> 8: {moved} keys moved"
    );
}
