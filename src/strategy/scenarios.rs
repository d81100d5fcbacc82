//! The prefix-aware policy in scenarios on a fake Envoy (several instances
//! and worker VMs, the upstream filter counting after each decision): caps,
//! spreading and recovery as the instances would see them.

use crate::strategy::{DecisionKind, RouteHeaders};
use crate::testing::fake_envoy::*;

const KEY: &str = "00c0ffee00c0ffee";

fn count(kinds: &[DecisionKind], kind: DecisionKind) -> usize {
    kinds.iter().filter(|k| **k == kind).count()
}

#[test]
fn burst_of_a_new_key_is_capped_and_spread_then_returns_to_target() {
    let mut envoy = FakeEnvoy::prefix_aware(3, true);
    envoy.warm();
    let target = envoy.maglev(Some(KEY));
    let streams: Vec<Stream> = (0..12).map(|i| envoy.start(i % 2, Some(KEY))).collect();
    assert_eq!(
        envoy.max_at_host[target], 3,
        "target capped at the threshold"
    );
    assert_eq!(envoy.at_host[target], 3);
    let kinds = kinds(&streams);
    assert_eq!(count(&kinds, DecisionKind::Prefix), 3);
    assert_eq!(count(&kinds, DecisionKind::Overflow), 9);
    let others: Vec<u32> = (0..7)
        .filter(|h| *h != target)
        .map(|h| envoy.at_host[h])
        .collect();
    assert_eq!(others.iter().sum::<u32>(), 9);
    assert!(
        others.iter().all(|n| (1..=2).contains(n)),
        "spread evenly: {others:?}"
    );
    assert_eq!(
        envoy.gauge(),
        envoy.at_host,
        "the gauge matches the instances"
    );
    for stream in streams {
        envoy.finish(stream);
    }
    for _ in 0..5 {
        let stream = envoy.start(0, Some(KEY));
        assert_eq!(stream.host, Some(target));
        assert_eq!(stream.headers.kind, DecisionKind::Prefix);
        assert_eq!(stream.headers.host_override, None);
        envoy.finish(stream);
    }
    assert!(envoy.gauge().iter().all(|n| *n == 0));
}

#[test]
fn decisions_racing_ahead_of_the_upstream_filters_still_respect_the_cap() {
    let mut envoy = FakeEnvoy::prefix_aware(3, true);
    envoy.warm();
    let first = envoy.start(0, Some(KEY));
    envoy.finish(first);
    let target = envoy.maglev(Some(KEY));
    // All 12 decisions (both workers) before any upstream filter runs.
    let mut streams: Vec<Stream> = (0..12).map(|i| envoy.decide(i % 2, Some(KEY))).collect();
    for stream in &mut streams {
        envoy.send_upstream(stream);
    }
    assert_eq!(envoy.max_at_host[target], 3);
    for stream in streams {
        envoy.finish(stream);
    }
}

#[test]
fn a_blind_first_request_racing_another_workers_learning_is_counted() {
    let mut envoy = FakeEnvoy::prefix_aware(3, true);
    envoy.warm();
    let target = envoy.maglev(Some(KEY));
    // Worker 1 decides blind; before its upstream filter runs (preempted),
    // worker 0 routes, learns the target and keeps claiming.
    let mut late = envoy.decide(1, Some(KEY));
    let mut streams: Vec<Stream> = (0..5).map(|_| envoy.start(0, Some(KEY))).collect();
    envoy.send_upstream(&mut late);
    streams.push(late);
    assert_eq!(envoy.max_at_host[target], 3);
    assert_eq!(streams.iter().filter(|s| s.host == Some(target)).count(), 3);
    for stream in streams {
        envoy.finish(stream);
    }
}

#[test]
fn two_keys_sharing_a_target_share_its_cap() {
    let mut envoy = FakeEnvoy::prefix_aware(4, true);
    envoy.warm();
    let target = 3;
    let keys = keys_on_host(&mut envoy, target, 2);
    for key in &keys {
        let stream = envoy.start(0, Some(key));
        envoy.finish(stream);
    }
    let streams: Vec<Stream> = (0..20)
        .map(|i| {
            let key = keys[i % 2].clone();
            envoy.start((i / 2) % 2, Some(&key))
        })
        .collect();
    assert_eq!(envoy.max_at_host[target], 4);
    let on_target: Vec<&Stream> = streams.iter().filter(|s| s.host == Some(target)).collect();
    assert_eq!(on_target.len(), 4);
    assert!(on_target
        .iter()
        .any(|s| s.headers.key.as_deref() == Some(&keys[0])));
    assert!(on_target
        .iter()
        .any(|s| s.headers.key.as_deref() == Some(&keys[1])));
    for stream in streams {
        envoy.finish(stream);
    }
}

#[test]
fn an_unlearned_key_can_pass_a_full_target_once_per_worker_at_most() {
    // The documented limit: a key's very first request is routed before
    // its target is known, so it is not checked against the cap.
    let mut envoy = FakeEnvoy::prefix_aware(4, true);
    envoy.warm();
    let target = 2;
    let keys = keys_on_host(&mut envoy, target, 2);
    let warm = envoy.start(0, Some(&keys[0]));
    envoy.finish(warm);
    let mut streams: Vec<Stream> = (0..8).map(|i| envoy.start(i % 2, Some(&keys[0]))).collect();
    assert_eq!(envoy.at_host[target], 4);
    streams.extend((0..8).map(|i| envoy.start(i % 2, Some(&keys[1]))));
    assert_eq!(
        envoy.max_at_host[target], 5,
        "one unchecked first request, then capped"
    );
    for stream in streams {
        envoy.finish(stream);
    }
}

#[test]
fn overflow_ends_as_soon_as_the_target_drops_below_the_cap() {
    let mut envoy = FakeEnvoy::prefix_aware(3, true);
    envoy.warm();
    let target = envoy.maglev(Some(KEY));
    let mut on_target: Vec<Stream> = (0..3).map(|i| envoy.start(i % 2, Some(KEY))).collect();
    let overflow = envoy.start(1, Some(KEY));
    assert_eq!(overflow.headers.kind, DecisionKind::Overflow);
    assert_ne!(overflow.host, Some(target));
    let done = on_target.pop().expect("three streams");
    envoy.finish(done);
    let back = envoy.start(1, Some(KEY));
    assert_eq!(back.headers.kind, DecisionKind::Prefix);
    assert_eq!(back.host, Some(target));
    for stream in on_target.into_iter().chain([overflow, back]) {
        envoy.finish(stream);
    }
}

#[test]
fn without_a_host_header_overflow_rekeys_and_learns_to_avoid_the_target() {
    let mut envoy = FakeEnvoy::prefix_aware(3, false);
    envoy.warm();
    let target = envoy.maglev(Some(KEY));
    let first: Vec<Stream> = (0..12).map(|i| envoy.start(i % 2, Some(KEY))).collect();
    for stream in first
        .iter()
        .filter(|s| s.headers.kind == DecisionKind::Overflow)
    {
        let key = stream.headers.key.as_deref().expect("salted key");
        assert_ne!(key, KEY);
        assert_eq!(key.len(), 16);
        assert!(key
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        assert_eq!(stream.headers.host_override, None);
    }
    assert_eq!(count(&kinds(&first), DecisionKind::Overflow), 9);
    for stream in first {
        envoy.finish(stream);
    }
    // Second burst: every salt it uses has been learned, and none that
    // maps to the target is used again.
    envoy.reset_max();
    let second: Vec<Stream> = (0..12).map(|i| envoy.start(i % 2, Some(KEY))).collect();
    assert_eq!(envoy.max_at_host[target], 3);
    for stream in second {
        envoy.finish(stream);
    }
}

#[test]
fn on_a_cold_registry_overflow_explores_with_salted_keys_then_uses_what_it_learned() {
    let mut envoy = FakeEnvoy::prefix_aware(3, true);
    let target = envoy.maglev(Some(KEY));
    let streams: Vec<Stream> = (0..6).map(|i| envoy.start(i % 2, Some(KEY))).collect();
    let overflow: Vec<&Stream> = streams
        .iter()
        .filter(|s| s.headers.kind == DecisionKind::Overflow)
        .collect();
    assert_eq!(overflow.len(), 3);
    // Only the target is known: the first overflow can only re-key.
    let first = &overflow[0].headers;
    assert_eq!(first.host_override, None);
    assert_ne!(first.key.as_deref(), Some(KEY));
    // Where it went is now known, and nominated when it is the least busy.
    let explored = overflow[0].host.expect("sent");
    if explored != target {
        let nominated = overflow
            .iter()
            .skip(1)
            .filter(|s| s.headers.host_override.is_some());
        assert!(nominated.clone().count() >= 1);
        assert!(nominated.into_iter().all(|s| s.host != Some(target)));
    }
    for stream in streams {
        envoy.finish(stream);
    }
}

#[test]
fn no_leak_under_aborts_resets_timeouts_retries_and_streaming() {
    let mut envoy = FakeEnvoy::prefix_aware(3, true);
    envoy.warm();
    let keys = keys(0..40);
    let mut open: Vec<Stream> = Vec::new();
    let mut started = 0;
    while started < 2_000 || !open.is_empty() {
        let roll = envoy.random() % 100;
        if started < 2_000 && (open.len() < 30 || roll < 40) {
            let worker = (envoy.random() % 2) as usize;
            let key = if roll < 5 {
                None
            } else {
                Some(keys[(envoy.random() % 40) as usize].clone())
            };
            let mut stream = envoy.decide(worker, key.as_deref());
            started += 1;
            if roll % 10 == 9 {
                // Client aborts while the body is still held: no upstream.
                envoy.finish(stream);
                continue;
            }
            envoy.send_upstream(&mut stream);
            open.push(stream);
            continue;
        }
        if open.is_empty() {
            continue;
        }
        let index = (envoy.random() % open.len() as u64) as usize;
        let mut stream = open.swap_remove(index);
        match envoy.random() % 20 {
            // 5% upstream reset and 5% upstream timeout with a retry.
            0 | 1 => {
                envoy.end_attempt(&mut stream);
                envoy.send_upstream(&mut stream);
                open.push(stream);
            }
            // 10% client aborts mid-stream; the rest complete (streamed or not).
            _ => envoy.finish(stream),
        }
        let step = envoy.random() % 50;
        envoy.advance(step);
        if envoy.now % 1_000 < 50 {
            envoy.tick_all();
        }
    }
    assert_eq!(envoy.at_host.iter().sum::<u32>(), 0);
    assert!(
        envoy.gauge().iter().all(|n| *n == 0),
        "gauge {:?}",
        envoy.gauge()
    );
    assert_eq!(
        envoy
            .workers
            .iter()
            .map(|w| w.local_in_flight())
            .sum::<u32>(),
        0
    );
    // A fresh burst now behaves as on a fresh (warmed) Envoy.
    let target = envoy.maglev(Some(KEY));
    envoy.reset_max();
    let burst: Vec<Stream> = (0..12).map(|i| envoy.start(i % 2, Some(KEY))).collect();
    assert_eq!(envoy.max_at_host[target], 3);
    assert_eq!(count(&kinds(&burst), DecisionKind::Overflow), 9);
    for stream in burst {
        envoy.finish(stream);
    }
}

#[test]
fn counts_heal_after_a_worker_vm_restart() {
    let mut envoy = FakeEnvoy::prefix_aware(3, true);
    envoy.warm();
    let target = envoy.maglev(Some(KEY));
    let doomed: Vec<Stream> = (0..3).map(|_| envoy.start(0, Some(KEY))).collect();
    assert_eq!(envoy.at_host[target], 3);
    envoy.crash_worker(0, doomed);
    assert_eq!(envoy.at_host[target], 0);
    // Until the dead VM's lease expires its counts still count.
    let stream = envoy.start(1, Some(KEY));
    assert_eq!(stream.headers.kind, DecisionKind::Overflow);
    envoy.finish(stream);
    envoy.advance(config().vm_lease_ms + 1);
    envoy.tick_all();
    assert!(envoy.gauge().iter().all(|n| *n == 0), "{:?}", envoy.gauge());
    for worker in [0, 1] {
        let stream = envoy.start(worker, Some(KEY));
        assert_eq!(stream.headers.kind, DecisionKind::Prefix);
        assert_eq!(stream.host, Some(target));
        envoy.finish(stream);
    }
}

#[test]
fn requests_without_a_key_are_not_steered() {
    let mut envoy = FakeEnvoy::prefix_aware(3, true);
    let stream = envoy.start(0, None);
    assert_eq!(stream.headers, RouteHeaders::bare(DecisionKind::NoKey));
    envoy.finish(stream);
}

/// Distinct keys, numbered.
fn keys(range: std::ops::Range<u64>) -> Vec<String> {
    range.map(|i| format!("{:016x}", i * 7919)).collect()
}
