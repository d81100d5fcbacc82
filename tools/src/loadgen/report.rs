//! Per-request records and the run summary (JSON via serde), in simulated
//! time: measured wall-clock latencies are multiplied by the time scale and
//! rates divided by it, so figures read as they would on the real hardware.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// One request's outcome.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RequestRecord {
    /// Order of issue.
    pub index: usize,
    /// When it was sent, ms after the run started (simulated).
    pub start_ms: f64,
    /// Completed with a 2xx status and a complete body.
    pub ok: bool,
    /// HTTP status, if any.
    pub status: Option<u16>,
    /// Why it failed.
    pub error: Option<String>,
    /// `x-served-by`.
    pub instance: Option<String>,
    /// Time to first content, ms (simulated).
    pub ttft_ms: Option<f64>,
    /// End-to-end latency, ms (simulated).
    pub latency_ms: f64,
    /// `usage.prompt_tokens`
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`
    pub cached_tokens: Option<u64>,
    /// `usage.completion_tokens`
    pub completion_tokens: Option<u64>,
    /// Prefix group, where the workload has groups.
    pub group: Option<usize>,
    /// Conversation, for multi-turn.
    pub conversation: Option<u64>,
}

/// One instance's part of the traffic.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct InstanceShare {
    /// Requests it answered.
    pub requests: usize,
    /// Fraction of all answered requests.
    pub share: f64,
}

/// The summary of a run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Report {
    /// Workload name.
    pub workload: String,
    /// `chat` or `invoke`.
    pub api: String,
    /// Simulated seconds per real second the figures were converted with.
    pub time_scale: f64,
    /// Requests issued.
    pub requests: usize,
    /// Requests that completed.
    pub successes: usize,
    /// Requests that failed.
    pub failures: usize,
    /// Failures by cause (first line of the error, status for HTTP errors).
    pub failure_kinds: BTreeMap<String, usize>,
    /// From the first send to the last completion, s (simulated).
    pub duration_s: f64,
    /// Completed requests per second (simulated).
    pub rps: f64,
    /// Output tokens per second (simulated).
    pub output_tokens_per_s: f64,
    /// Time to first token percentiles, ms (simulated).
    pub ttft_p50_ms: f64,
    /// 90th percentile.
    pub ttft_p90_ms: f64,
    /// 99th percentile.
    pub ttft_p99_ms: f64,
    /// Mean.
    pub ttft_mean_ms: f64,
    /// End-to-end latency percentiles, ms (simulated).
    pub latency_p50_ms: f64,
    /// 90th percentile.
    pub latency_p90_ms: f64,
    /// 99th percentile.
    pub latency_p99_ms: f64,
    /// Prompt tokens of completed requests (from usage).
    pub prompt_tokens: u64,
    /// Of those, cached tokens (from usage).
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`: the token-weighted hit rate seen by clients.
    pub hit_rate: f64,
    /// Requests per instance.
    pub instances: BTreeMap<String, InstanceShare>,
    /// Smallest instance share (0 if a known instance got nothing).
    pub share_min: f64,
    /// Largest instance share.
    pub share_max: f64,
    /// Distinct prefix groups (or conversations) each instance served: how
    /// evenly the keys, not the requests, are spread.
    pub groups_per_instance: BTreeMap<String, usize>,
    /// Groups served by more than one instance (affinity broken: overflow,
    /// a key moved, or no affinity at all).
    pub groups_split: usize,
    /// Of the conversation turns after a conversation's first (in order of
    /// issue, both answered), the fraction served by the instance that
    /// served the previous turn; None without such pairs.
    #[serde(default)]
    pub turns_on_previous_instance: Option<f64>,
    /// How many such pairs there were.
    #[serde(default)]
    pub turn_pairs: usize,
    /// Every request, when asked for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub records: Vec<RequestRecord>,
}

/// Nearest-rank percentile of sorted values (0 for none).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(|a, b| a.total_cmp(b));
    v
}

fn failure_kind(r: &RequestRecord) -> String {
    match (&r.error, r.status) {
        (_, Some(s)) if !(200..300).contains(&s) => format!("http {s}"),
        (Some(e), _) => e.split(':').next().unwrap_or(e).trim().to_string(),
        (None, _) => "unknown".into(),
    }
}

/// Distinct groups (or conversations) per instance, and how many groups more
/// than one instance served.
fn group_spread(
    records: &[RequestRecord],
    known_instances: &[String],
) -> (BTreeMap<String, usize>, usize) {
    let mut instances_of: BTreeMap<(bool, u64), std::collections::BTreeSet<&str>> = BTreeMap::new();
    for r in records {
        let group = match (r.group, r.conversation) {
            (Some(g), _) => (true, g as u64),
            (None, Some(c)) => (false, c),
            (None, None) => continue,
        };
        if let Some(instance) = &r.instance {
            instances_of.entry(group).or_default().insert(instance);
        }
    }
    let mut per_instance: BTreeMap<String, usize> =
        known_instances.iter().map(|i| (i.clone(), 0)).collect();
    for instances in instances_of.values() {
        for instance in instances {
            *per_instance.entry((*instance).to_string()).or_insert(0) += 1;
        }
    }
    let split = instances_of.values().filter(|i| i.len() > 1).count();
    (per_instance, split)
}

/// Of consecutive turns of a conversation (records in order of issue,
/// both with an instance), how many pairs there are and how many stayed on
/// one instance.
fn turn_stickiness(records: &[RequestRecord]) -> (usize, usize) {
    let mut previous: BTreeMap<u64, &str> = BTreeMap::new();
    let (mut pairs, mut stayed) = (0, 0);
    for r in records {
        let (Some(conversation), Some(instance)) = (r.conversation, r.instance.as_deref()) else {
            continue;
        };
        if let Some(before) = previous.insert(conversation, instance) {
            pairs += 1;
            if before == instance {
                stayed += 1;
            }
        }
    }
    (pairs, stayed)
}

/// Summarises `records` of a run that lasted `duration_s` simulated seconds.
/// `known_instances` are counted even if they served nothing.
pub fn summarize(
    workload: &str,
    api: &str,
    time_scale: f64,
    duration_s: f64,
    records: Vec<RequestRecord>,
    known_instances: &[String],
    keep_records: bool,
) -> Report {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok).collect();
    let ttft = sorted(ok.iter().filter_map(|r| r.ttft_ms).collect());
    let latency = sorted(ok.iter().map(|r| r.latency_ms).collect());
    let prompt_tokens: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
    let cached_tokens: u64 = ok.iter().filter_map(|r| r.cached_tokens).sum();
    let output_tokens: u64 = ok.iter().filter_map(|r| r.completion_tokens).sum();
    let mut failure_kinds = BTreeMap::new();
    for r in records.iter().filter(|r| !r.ok) {
        *failure_kinds.entry(failure_kind(r)).or_insert(0) += 1;
    }
    let mut counts: BTreeMap<String, usize> =
        known_instances.iter().map(|i| (i.clone(), 0)).collect();
    for r in &records {
        if let Some(i) = &r.instance {
            *counts.entry(i.clone()).or_insert(0) += 1;
        }
    }
    let answered: usize = counts.values().sum();
    let instances: BTreeMap<String, InstanceShare> = counts
        .into_iter()
        .map(|(name, requests)| {
            let share = if answered == 0 {
                0.0
            } else {
                requests as f64 / answered as f64
            };
            (name, InstanceShare { requests, share })
        })
        .collect();
    let shares = || instances.values().map(|s| s.share);
    let (groups_per_instance, groups_split) = group_spread(&records, known_instances);
    let mut in_order: Vec<RequestRecord> = records.iter().filter(|r| r.ok).cloned().collect();
    in_order.sort_by_key(|r| r.index);
    let (turn_pairs, turns_stayed) = turn_stickiness(&in_order);
    let per_s = |n: f64| {
        if duration_s > 0.0 {
            n / duration_s
        } else {
            0.0
        }
    };
    Report {
        workload: workload.to_string(),
        api: api.to_string(),
        time_scale,
        requests: records.len(),
        successes: ok.len(),
        failures: records.len() - ok.len(),
        failure_kinds,
        duration_s,
        rps: per_s(ok.len() as f64),
        output_tokens_per_s: per_s(output_tokens as f64),
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p90_ms: percentile(&ttft, 90.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        ttft_mean_ms: if ttft.is_empty() {
            0.0
        } else {
            ttft.iter().sum::<f64>() / ttft.len() as f64
        },
        latency_p50_ms: percentile(&latency, 50.0),
        latency_p90_ms: percentile(&latency, 90.0),
        latency_p99_ms: percentile(&latency, 99.0),
        prompt_tokens,
        cached_tokens,
        hit_rate: if prompt_tokens == 0 {
            0.0
        } else {
            cached_tokens as f64 / prompt_tokens as f64
        },
        share_min: if answered == 0 {
            0.0
        } else {
            shares().fold(f64::INFINITY, f64::min)
        },
        share_max: shares().fold(0.0, f64::max),
        instances,
        groups_per_instance,
        groups_split,
        turns_on_previous_instance: (turn_pairs > 0)
            .then(|| turns_stayed as f64 / turn_pairs as f64),
        turn_pairs,
        records: if keep_records { records } else { Vec::new() },
    }
}

impl Report {
    /// A few human-readable lines.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{} ({}): {} requests, {} ok, {} failed {:?}",
            self.workload,
            self.api,
            self.requests,
            self.successes,
            self.failures,
            self.failure_kinds
        );
        let _ = writeln!(
            s,
            "  TTFT p50/p90/p99 {:.0}/{:.0}/{:.0} ms; latency p50 {:.0} ms; {:.2} req/s; {:.0} output tok/s",
            self.ttft_p50_ms, self.ttft_p90_ms, self.ttft_p99_ms, self.latency_p50_ms, self.rps,
            self.output_tokens_per_s
        );
        let _ = writeln!(
            s,
            "  hit rate {:.1}% ({} of {} prompt tokens cached); share min {:.1}% max {:.1}%",
            self.hit_rate * 100.0,
            self.cached_tokens,
            self.prompt_tokens,
            self.share_min * 100.0,
            self.share_max * 100.0
        );
        for (name, share) in &self.instances {
            let _ = writeln!(
                s,
                "    {name}: {} ({:.1}%)",
                share.requests,
                share.share * 100.0
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(
        i: usize,
        ok: bool,
        instance: &str,
        ttft: f64,
        prompt: u64,
        cached: u64,
    ) -> RequestRecord {
        RequestRecord {
            index: i,
            start_ms: 0.0,
            ok,
            status: Some(if ok { 200 } else { 503 }),
            error: (!ok).then(|| "http 503: no healthy upstream".to_string()),
            instance: Some(instance.to_string()),
            ttft_ms: ok.then_some(ttft),
            latency_ms: ttft * 2.0,
            prompt_tokens: ok.then_some(prompt),
            cached_tokens: ok.then_some(cached),
            completion_tokens: ok.then_some(10),
            group: None,
            conversation: None,
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 90.0), 90.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn summary_weights_hits_by_tokens_and_counts_shares() {
        let records = vec![
            rec(0, true, "a", 100.0, 1000, 900),
            rec(1, true, "a", 200.0, 100, 0),
            rec(2, true, "b", 300.0, 900, 100),
            rec(3, false, "b", 0.0, 0, 0),
        ];
        let r = summarize(
            "w",
            "chat",
            1.0,
            2.0,
            records,
            &["a".into(), "b".into(), "c".into()],
            false,
        );
        assert_eq!((r.requests, r.successes, r.failures), (4, 3, 1));
        assert_eq!(r.failure_kinds.get("http 503"), Some(&1));
        assert!((r.hit_rate - 0.5).abs() < 1e-9);
        assert_eq!(r.ttft_p50_ms, 200.0);
        assert_eq!(r.rps, 1.5);
        assert_eq!(r.output_tokens_per_s, 15.0);
        assert_eq!(r.instances["a"].requests, 2);
        assert_eq!(r.instances["c"].requests, 0);
        assert_eq!((r.share_min, r.share_max), (0.0, 0.5));
        assert!(r.records.is_empty());
        let json = serde_json::to_value(&r).unwrap();
        for field in [
            "hit_rate",
            "ttft_p50_ms",
            "ttft_p90_ms",
            "ttft_p99_ms",
            "rps",
            "share_min",
            "share_max",
            "failures",
        ] {
            assert!(json.get(field).is_some(), "{field}");
        }
    }

    #[test]
    fn groups_are_counted_per_instance_and_splits_found() {
        let served = |i, instance, group, conversation| RequestRecord {
            group,
            conversation,
            ..rec(i, true, instance, 1.0, 10, 0)
        };
        let records = vec![
            served(0, "a", Some(1), None),
            served(1, "a", Some(1), None),
            served(2, "b", Some(2), None),
            served(3, "a", Some(2), None),
            served(4, "b", None, Some(1)),
            served(5, "b", None, None),
        ];
        let known = ["a".to_string(), "b".to_string(), "c".to_string()];
        let r = summarize("w", "chat", 1.0, 1.0, records, &known, false);
        // Group 1 on a; group 2 on a and b (split); conversation 1 on b.
        assert_eq!(r.groups_per_instance["a"], 2);
        assert_eq!(r.groups_per_instance["b"], 2);
        assert_eq!(r.groups_per_instance["c"], 0);
        assert_eq!(r.groups_split, 1);
        assert_eq!(r.turns_on_previous_instance, None);
    }

    #[test]
    fn turns_that_stay_on_the_previous_turns_instance_are_counted() {
        let turn = |i, instance, conversation| RequestRecord {
            conversation: Some(conversation),
            ..rec(i, true, instance, 1.0, 10, 0)
        };
        // Issued out of order on purpose: the summary orders by index.
        let records = vec![
            turn(3, "b", 1), // conversation 1: a, a, b: 1 of 2 stayed
            turn(0, "a", 1),
            turn(1, "c", 2), // conversation 2: c, c: 1 of 1
            turn(2, "a", 1),
            turn(4, "c", 2),
            RequestRecord {
                ok: false,
                ..turn(5, "a", 2) // failed: not a turn served
            },
            turn(6, "a", 3), // a single turn: no pair
        ];
        let r = summarize("w", "chat", 1.0, 1.0, records, &[], false);
        assert_eq!(r.turn_pairs, 3);
        assert_eq!(r.turns_on_previous_instance, Some(2.0 / 3.0));
    }
}
