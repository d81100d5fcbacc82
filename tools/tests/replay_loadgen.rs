//! The real-data workloads end to end against simulated instances, on a
//! small corpus the test makes (no data set needed): a conversation's next
//! turn waits for the previous answer and hits its history in the cache,
//! pinned targets send every group or conversation to instance
//! `key mod n`, and alternated targets send each turn through another target
//! than the turn before.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use prefix_router_tools::loadgen::sharegpt::Turn;
use prefix_router_tools::loadgen::{run_workload, Api, Arrival, Corpus, RunOptions, Workload};

mod common;

use common::{sim, TIME_SCALE};

/// Eight conversations of 3 turns with long-ish messages, and 4 documents.
fn corpus() -> Arc<Corpus> {
    let text =
        |what: &str, c: usize, t: usize| format!("{what} {t} of conversation {c}. ").repeat(20);
    Arc::new(Corpus {
        conversations: (0..8)
            .map(|c| {
                (0..3)
                    .map(|t| Turn {
                        human: text("question", c, t),
                        gpt: text("answer", c, t),
                    })
                    .collect()
            })
            .collect(),
        documents: (0..4)
            .map(|d| format!("Document {d} says this. ").repeat(40))
            .collect(),
        parsed: 8,
        skipped: 0,
    })
}

fn opts(arrival: Arrival, max_requests: usize) -> RunOptions {
    RunOptions {
        api: Api::Chat,
        arrival,
        max_requests,
        max_duration: Duration::from_secs(30),
        request_timeout: Duration::from_secs(10),
        time_scale: TIME_SCALE,
        keep_records: true,
        corpus: Some(corpus()),
        ..RunOptions::default()
    }
}

fn sharegpt(conversations: usize) -> Workload {
    Workload::ShareGpt {
        conversations,
        max_turns: 3,
        max_message_chars: 6_000,
        max_output_tokens: 8,
        system_prompt: false,
        think_time_ms: 200.0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_waits_for_the_previous_answer_and_hits_its_history() {
    let a = sim("sim-a").await;
    let report = run_workload(
        &format!("http://{}", a.addr()),
        &sharegpt(6),
        &opts(Arrival::Poisson { rate: 20.0 }, 100),
    )
    .await
    .unwrap();
    assert_eq!(report.failures, 0, "{:?}", report.failure_kinds);
    assert_eq!(report.requests, 18, "6 conversations x 3 turns");
    let mut by_conversation: BTreeMap<u64, Vec<_>> = BTreeMap::new();
    for r in &report.records {
        by_conversation
            .entry(r.conversation.unwrap())
            .or_default()
            .push(r);
    }
    assert_eq!(by_conversation.len(), 6);
    for turns in by_conversation.values() {
        assert_eq!(turns.len(), 3);
        for pair in turns.windows(2) {
            let (before, after) = (pair[0], pair[1]);
            // Sent after the previous response ended.
            assert!(
                after.start_ms >= before.start_ms + before.latency_ms,
                "{before:?} then {after:?}"
            );
            // The previous prompt is cached: at least its tokens, less a partial block.
            let previous = before.prompt_tokens.unwrap();
            assert!(
                after.cached_tokens.unwrap() + 16 >= previous,
                "{previous} prompt tokens before, {} cached after",
                after.cached_tokens.unwrap()
            );
        }
    }
    assert_eq!(report.turns_on_previous_instance, Some(1.0));
    assert_eq!(report.turn_pairs, 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_targets_put_each_key_on_instance_key_mod_n() {
    let a = sim("sim-a").await;
    let b = sim("sim-b").await;
    let pinned = vec![
        format!("http://{}", a.addr()),
        format!("http://{}", b.addr()),
    ];
    let instance = |key: u64| if key % 2 == 0 { "sim-a" } else { "sim-b" };
    let rag = Workload::Rag {
        documents: 4,
        questions: 5,
        output_tokens: 4,
    };
    for (workload, arrival, requests) in [
        (rag, Arrival::Concurrency { clients: 4 }, 20),
        (sharegpt(8), Arrival::Concurrency { clients: 4 }, 100),
    ] {
        let o = RunOptions {
            pinned_targets: pinned.clone(),
            instances: vec!["sim-a".into(), "sim-b".into()],
            ..opts(arrival, requests)
        };
        // The target URL is not used when targets are pinned.
        let report = run_workload("http://127.0.0.1:9", &workload, &o)
            .await
            .unwrap();
        assert_eq!(
            report.failures,
            0,
            "{}: {:?}",
            workload.name(),
            report.failure_kinds
        );
        assert!(report.requests >= 20, "{}", report.requests);
        for r in &report.records {
            let key = r.group.map(|g| g as u64).or(r.conversation).unwrap();
            assert_eq!(r.instance.as_deref(), Some(instance(key)), "{r:?}");
        }
        assert_eq!(
            report.instances["sim-a"].requests,
            report.instances["sim-b"].requests
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alternated_targets_take_consecutive_turns_in_turn() {
    let a = sim("sim-a").await;
    let b = sim("sim-b").await;
    let targets = vec![
        format!("http://{}", a.addr()),
        format!("http://{}", b.addr()),
    ];
    let name = |slot: u64| if slot % 2 == 0 { "sim-a" } else { "sim-b" };
    let o = RunOptions {
        alternate_targets: targets.clone(),
        instances: vec!["sim-a".into(), "sim-b".into()],
        ..opts(Arrival::Concurrency { clients: 4 }, 100)
    };
    // The target URL is not used when targets are alternated.
    let report = run_workload("http://127.0.0.1:9", &sharegpt(8), &o)
        .await
        .unwrap();
    assert_eq!(report.failures, 0, "{:?}", report.failure_kinds);
    assert_eq!(report.requests, 24, "8 conversations x 3 turns");
    let mut by_conversation: BTreeMap<u64, Vec<_>> = BTreeMap::new();
    for r in &report.records {
        by_conversation
            .entry(r.conversation.unwrap())
            .or_default()
            .push(r);
    }
    for (conversation, turns) in &mut by_conversation {
        turns.sort_by(|x, y| x.start_ms.total_cmp(&y.start_ms));
        for (turn, r) in turns.iter().enumerate() {
            assert_eq!(
                r.instance.as_deref(),
                Some(name(conversation + turn as u64)),
                "turn {turn} of conversation {conversation}: {r:?}"
            );
        }
    }
    assert_eq!(report.turns_on_previous_instance, Some(0.0));

    let rag = Workload::Rag {
        documents: 4,
        questions: 5,
        output_tokens: 4,
    };
    let report = run_workload(
        "http://127.0.0.1:9",
        &rag,
        &RunOptions {
            alternate_targets: targets,
            instances: vec!["sim-a".into(), "sim-b".into()],
            ..opts(Arrival::Concurrency { clients: 1 }, 10)
        },
    )
    .await
    .unwrap();
    assert_eq!(report.requests, 10);
    for r in &report.records {
        assert_eq!(r.instance.as_deref(), Some(name(r.index as u64)), "{r:?}");
    }
}

#[tokio::test]
async fn pinned_and_alternated_targets_exclude_each_other() {
    let o = RunOptions {
        pinned_targets: vec!["http://127.0.0.1:9".into()],
        alternate_targets: vec!["http://127.0.0.1:9".into()],
        ..opts(Arrival::Concurrency { clients: 1 }, 1)
    };
    let error = run_workload("http://127.0.0.1:9", &sharegpt(1), &o)
        .await
        .unwrap_err();
    assert!(
        format!("{error:#}").contains("exclude each other"),
        "{error:#}"
    );
}

#[tokio::test]
async fn a_data_workload_without_the_corpus_is_refused() {
    let o = RunOptions {
        corpus: None,
        ..opts(Arrival::Concurrency { clients: 1 }, 1)
    };
    let error = run_workload("http://127.0.0.1:9", &sharegpt(1), &o)
        .await
        .unwrap_err();
    assert!(
        format!("{error:#}").contains("needs the ShareGPT data"),
        "{error:#}"
    );
}
