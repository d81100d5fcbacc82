//! The stats the filter exports, and which of them a decision moves. Kept
//! apart from the callbacks (`plugin`) so the mapping is tested on its own.
//!
//! Envoy files wasm metrics under the custom namespace `wasmcustom`
//! (`/stats`: `wasmcustom.prefix_router.no_key`). `/stats/prometheus`
//! strips that namespace, adds no `envoy_` prefix and turns every character
//! of a name outside `[a-zA-Z0-9_]` into `_` (Envoy's `prometheus_stats.cc`),
//! so `prefix_router.no_key` is scraped as `prefix_router_no_key`. The names
//! avoid the endings Envoy's default tag extractors match anywhere
//! (`_rq_<3 digits>`, `_rq_<digit>xx`), so they come out without surprise tags.
//! Same-named metrics from all worker VMs add up into one stat.
//!
//! What varies within one kind of stat is the last level of its name (a
//! decision's kind, an instance's address after a marker level `endpoint`),
//! so the `stats_tags` of the shipped bootstraps (`docs/metrics.md`) lift it
//! into a label: `prefix_router_decision{kind="matched"}`,
//! `prefix_router_in_flight{endpoint="10.0.0.11:8000"}`.
//!
//! A filter configured with a `fleet` names every stat of its own
//! `prefix_router.fleet.<fleet>.<rest>` ([`fleet_stat_name`]): several fleets
//! behind one Envoy (each its own filter under its own `vm_id`) keep their
//! stats apart, and one more `stats_tags` regex turns the fleet into a label.

use crate::classify::ApiKind;
use crate::request::KeyDerivation;
use crate::strategy::DecisionKind;
use crate::usage::check::Verdict;
use crate::usage::Usage;

/// Every routing decision kind, in a fixed order (one counter each).
pub const DECISION_KINDS: [DecisionKind; 8] = [
    DecisionKind::Matched,
    DecisionKind::Cold,
    DecisionKind::Moved,
    DecisionKind::Prefix,
    DecisionKind::Overflow,
    DecisionKind::LeastOutstanding,
    DecisionKind::Random,
    DecisionKind::NoKey,
];

/// Where a stat's name starts: every name here begins with it.
const NAMESPACE: &str = "prefix_router.";

/// The name of `name` (one of this module's `prefix_router.*` names) in a
/// filter configured with `fleet`: `prefix_router.fleet.<fleet>.<rest>`;
/// without one, `name` as it is. The marker level `fleet` keeps the names of
/// a filter with and without a fleet apart for Envoy's tag extraction (RE2
/// has no look-ahead to tell `prefix_router.<fleet>.decision` from
/// `prefix_router.decision.<kind>`).
pub fn fleet_stat_name(fleet: Option<&str>, name: &str) -> String {
    match (fleet, name.strip_prefix(NAMESPACE)) {
        (Some(fleet), Some(rest)) => format!("{NAMESPACE}fleet.{fleet}.{rest}"),
        _ => name.to_string(),
    }
}

/// Stat ids defined under one fleet's names ([`fleet_stat_name`]). Asked
/// for another fleet's, they start afresh from `T::default()`: the ids held
/// name the other fleet's stats, which Envoy keeps as they were.
#[derive(Debug, Default)]
pub struct FleetIds<T> {
    fleet: Option<String>,
    ids: T,
}

impl<T: Default> FleetIds<T> {
    /// The ids of `fleet`, emptied first if they were another fleet's.
    pub fn of(&mut self, fleet: Option<&str>) -> &mut T {
        if self.fleet.as_deref() != fleet {
            self.fleet = fleet.map(str::to_string);
            self.ids = T::default();
        }
        &mut self.ids
    }
}

/// Counter of routing decisions of one kind:
/// `prefix_router.decision.<kind>` (Prometheus `prefix_router_decision{kind="<kind>"}`).
pub fn decision_counter_name(kind: DecisionKind) -> String {
    format!("prefix_router.decision.{}", kind.as_str())
}

/// Position of `kind` in [`DECISION_KINDS`].
pub fn decision_index(kind: DecisionKind) -> usize {
    DECISION_KINDS
        .iter()
        .position(|k| *k == kind)
        .unwrap_or_default()
}

/// A stat of one instance: `<prefix>.endpoint.<address>`, the address as it
/// is (`prefix_router.in_flight.endpoint.127.0.0.1:8001`). The marker level
/// `endpoint` lets one `stats_tags` regex take everything after it, dots and
/// colon included, as the `endpoint` label.
pub fn instance_stat_name(prefix: &str, address: &str) -> String {
    format!("{prefix}.{ENDPOINT_MARKER}.{address}")
}

/// The stat-name level before an instance's address.
const ENDPOINT_MARKER: &str = "endpoint";

/// Gauge of requests in flight from this Envoy on one instance.
pub fn in_flight_gauge_name(address: &str) -> String {
    instance_stat_name("prefix_router.in_flight", address)
}

/// Counter of the prompt bytes this Envoy's LONGEST_PREFIX decisions sent to
/// one instance past the prefix the index said it held: the prefill its
/// routing added there, what `cold_placement: BALANCED` evens out.
pub fn placed_bytes_counter_name(address: &str) -> String {
    instance_stat_name("prefix_router.placed_bytes", address)
}

/// Per-instance counters of what engines report in their responses' usage
/// ([`crate::usage`]), for 2xx responses to prefix-aware decisions:
/// `<prefix>.endpoint.<address>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageCounter {
    /// Responses watched for a usage.
    Responses,
    /// Of those, responses whose usage gave `prompt_tokens`.
    Reported,
    /// Of those, responses whose usage also gave `cached_tokens`.
    ReportedCached,
    /// `prompt_tokens` reported.
    PromptTokens,
    /// `cached_tokens` reported.
    CachedTokens,
    /// The decision's predicted matched bytes, for the responses that
    /// reported `cached_tokens` (LONGEST_PREFIX).
    MatchedBytes,
    /// Responses whose engine held under half of the predicted prefix
    /// ([`crate::usage::check`]).
    IndexMisses,
    /// Misses that moved the instance's forget mark: the index stopped
    /// believing its holdings used up to then.
    IndexForgets,
}

impl UsageCounter {
    pub const ALL: [UsageCounter; 8] = [
        UsageCounter::Responses,
        UsageCounter::Reported,
        UsageCounter::ReportedCached,
        UsageCounter::PromptTokens,
        UsageCounter::CachedTokens,
        UsageCounter::MatchedBytes,
        UsageCounter::IndexMisses,
        UsageCounter::IndexForgets,
    ];

    /// The name before `.endpoint.<address>`.
    pub fn prefix(self) -> &'static str {
        match self {
            UsageCounter::Responses => "prefix_router.usage.responses",
            UsageCounter::Reported => "prefix_router.usage.reported",
            UsageCounter::ReportedCached => "prefix_router.usage.reported_cached",
            UsageCounter::PromptTokens => "prefix_router.usage.prompt_tokens",
            UsageCounter::CachedTokens => "prefix_router.usage.cached_tokens",
            UsageCounter::MatchedBytes => "prefix_router.usage.matched_bytes",
            UsageCounter::IndexMisses => "prefix_router.usage.index_misses",
            UsageCounter::IndexForgets => "prefix_router.usage.index_forgets",
        }
    }

    /// Position in [`UsageCounter::ALL`], for id tables.
    pub fn index(self) -> usize {
        self as usize
    }

    /// What one response adds to each counter, in [`UsageCounter::ALL`]'s
    /// order: `usage` is what its body reported, `matched_bytes` the
    /// decision's prediction and `verdict` what the usage said of it.
    pub fn amounts(
        usage: Option<Usage>,
        matched_bytes: Option<u64>,
        verdict: Verdict,
    ) -> [(UsageCounter, u64); UsageCounter::ALL.len()] {
        let reported = usage.map(|u| u.prompt_tokens);
        let cached = usage.and_then(|u| u.cached_tokens);
        let predicted = cached.map(|_| matched_bytes.unwrap_or_default());
        let one_if = |known: bool| u64::from(known);
        [
            (UsageCounter::Responses, 1),
            (UsageCounter::Reported, one_if(reported.is_some())),
            (UsageCounter::ReportedCached, one_if(cached.is_some())),
            (UsageCounter::PromptTokens, reported.unwrap_or_default()),
            (UsageCounter::CachedTokens, cached.unwrap_or_default()),
            (UsageCounter::MatchedBytes, predicted.unwrap_or_default()),
            (
                UsageCounter::IndexMisses,
                one_if(matches!(verdict, Verdict::Missed { .. })),
            ),
            // Only the tracker knows whether the mark moved (the stream
            // counts it); defined here, at 0, with the others.
            (UsageCounter::IndexForgets, 0),
        ]
    }
}

/// The counters, one Envoy stat each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    KeyedInvoke,
    KeyedChatCompletions,
    KeyedCompletions,
    KeyedResponses,
    /// An OpenAI-compatible body routed on its raw bytes.
    RawFallback,
    /// A keyed request whose prefix is shorter than `prefix_length`.
    ShortBody,
    /// A 400 for an invalid tenant header.
    TenantRejected,
    /// Forwarded without a key (no body, or a strategy that needs none).
    NoKey,
    /// Counted by the listener filter at its response because no upstream
    /// filter counts (none on the cluster, or another `vm_id`).
    UpstreamFilterMissing,
    /// `engine_load`: a response's ORCA load report refreshed its
    /// instance's KV usage.
    OrcaReportUsed,
    /// `engine_load`: a response carried an ORCA load report the filter
    /// could not read (ignored; the poll's figure stands).
    OrcaReportUnreadable,
    /// An upstream attempt whose connection failed (refused, or reset
    /// before the request went out); Envoy retries it elsewhere.
    ConnectionFailed,
    /// An instance marked failed by a connection failure (it was not
    /// already): no candidate until it answers.
    InstanceFailed,
    /// A request for a LoRA adapter went to one of its set's first
    /// `min_instances`.
    AdapterInSet,
    /// ... to an instance its set grew by because the first were loaded.
    AdapterSetGrown,
    /// ... outside its set: every instance in the set was full.
    AdapterOutsideSet,
}

impl Counter {
    pub const ALL: [Counter; 16] = [
        Counter::KeyedInvoke,
        Counter::KeyedChatCompletions,
        Counter::KeyedCompletions,
        Counter::KeyedResponses,
        Counter::RawFallback,
        Counter::ShortBody,
        Counter::TenantRejected,
        Counter::NoKey,
        Counter::UpstreamFilterMissing,
        Counter::OrcaReportUsed,
        Counter::OrcaReportUnreadable,
        Counter::ConnectionFailed,
        Counter::InstanceFailed,
        Counter::AdapterInSet,
        Counter::AdapterSetGrown,
        Counter::AdapterOutsideSet,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Counter::KeyedInvoke => "prefix_router.requests_keyed.invoke",
            Counter::KeyedChatCompletions => "prefix_router.requests_keyed.chat_completions",
            Counter::KeyedCompletions => "prefix_router.requests_keyed.completions",
            Counter::KeyedResponses => "prefix_router.requests_keyed.responses",
            Counter::RawFallback => "prefix_router.raw_fallback",
            Counter::ShortBody => "prefix_router.short_body",
            Counter::TenantRejected => "prefix_router.tenant_rejected",
            Counter::NoKey => "prefix_router.no_key",
            Counter::UpstreamFilterMissing => "prefix_router.upstream_filter_missing",
            Counter::OrcaReportUsed => "prefix_router.engine.orca_reports",
            Counter::OrcaReportUnreadable => "prefix_router.engine.orca_reports_unreadable",
            Counter::ConnectionFailed => "prefix_router.upstream.connection_failures",
            Counter::InstanceFailed => "prefix_router.upstream.instances_failed",
            Counter::AdapterInSet => "prefix_router.adapter.in_set",
            Counter::AdapterSetGrown => "prefix_router.adapter.set_grown",
            Counter::AdapterOutsideSet => "prefix_router.adapter.outside_set",
        }
    }

    /// Position in [`Counter::ALL`], for id tables.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Histogram of body bytes inspected per keyed request.
pub const BYTES_INSPECTED: &str = "prefix_router.bytes_inspected";

/// Histogram of the prompt bytes the chosen instance was known to hold, per
/// LONGEST_PREFIX decision (0 for a cold prompt).
pub const MATCHED_BYTES: &str = "prefix_router.matched_bytes";

/// Histogram of the instances in a LoRA adapter's set, per decision for
/// an adapter.
pub const ADAPTER_SET_INSTANCES: &str = "prefix_router.adapter.set_instances";

/// Gauges of one adapter's set size at its latest decision:
/// `<prefix>.adapter.<name>` ([`adapter_stat_name`]).
pub const ADAPTER_INSTANCES_PREFIX: &str = "prefix_router.adapter.instances";

/// The longest adapter name a stat name keeps.
pub const MAX_ADAPTER_STAT_NAME: usize = 64;

/// An adapter's stat: `<prefix>.adapter.<name>`, the name cut to
/// [`MAX_ADAPTER_STAT_NAME`] bytes and every byte but `A-Za-z0-9_-` made
/// `_`, so that an untrusted name is one level a `stats_tags` regex lifts
/// into the `adapter` label whole.
pub fn adapter_stat_name(name: &[u8]) -> String {
    let name: String = name
        .iter()
        .take(MAX_ADAPTER_STAT_NAME)
        .map(|&b| {
            if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
                char::from(b)
            } else {
                '_'
            }
        })
        .collect();
    format!("{ADAPTER_INSTANCES_PREFIX}.adapter.{name}")
}

/// Gauge of the prefix index's entries in use (grows to the capacity).
pub const INDEX_ENTRIES: &str = "prefix_router.index.entries";

/// Gauge of the entries the prefix index's byte budget holds.
pub const INDEX_CAPACITY: &str = "prefix_router.index.capacity";

/// Counter of index entries evicted to make room (least recently used, or
/// of an instance that left).
pub const INDEX_EVICTIONS: &str = "prefix_router.index.evictions";

/// What one decision records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recording {
    pub counters: Vec<Counter>,
    /// A sample for [`BYTES_INSPECTED`], for requests whose body was read.
    pub bytes_inspected: Option<u64>,
}

/// The metrics a decision moves.
pub fn recording_for(decision: &KeyDerivation) -> Recording {
    if decision.key.is_none() {
        return Recording {
            counters: vec![Counter::NoKey],
            bytes_inspected: None,
        };
    }
    let mut counters = vec![match decision.api {
        ApiKind::Invoke => Counter::KeyedInvoke,
        ApiKind::ChatCompletions => Counter::KeyedChatCompletions,
        ApiKind::Completions => Counter::KeyedCompletions,
        ApiKind::Responses => Counter::KeyedResponses,
    }];
    if decision.fallback.is_some() {
        counters.push(Counter::RawFallback);
    }
    if decision.short {
        counters.push(Counter::ShortBody);
    }
    Recording {
        counters,
        bytes_inspected: Some(u64::try_from(decision.bytes_inspected).unwrap_or(u64::MAX)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extract::{FallbackReason, PrefixSource};
    use crate::request::NoKeyReason;
    use crate::tenant::TenantSource;

    fn keyed(api: ApiKind) -> KeyDerivation {
        KeyDerivation {
            key: Some("0123456789abcdef".into()),
            no_key: None,
            api,
            tenant_source: TenantSource::None,
            prefix_source: Some(PrefixSource::CanonicalText),
            fallback: None,
            short: false,
            bytes_inspected: 5000,
            blocks: None,
            model: None,
        }
    }

    #[test]
    fn names_are_unique_prometheus_safe_and_indexed() {
        let names: Vec<&str> = Counter::ALL.iter().map(|c| c.name()).collect();
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(c.index(), i);
            assert_eq!(names.iter().filter(|n| **n == c.name()).count(), 1);
        }
        let more = [
            BYTES_INSPECTED,
            MATCHED_BYTES,
            ADAPTER_SET_INSTANCES,
            INDEX_ENTRIES,
            INDEX_CAPACITY,
            INDEX_EVICTIONS,
        ];
        for name in names.iter().chain(more.iter()) {
            assert!(name.starts_with("prefix_router."), "{name}");
            assert!(
                name.bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_' || b == b'.'),
                "{name}"
            );
            assert!(!name.contains("_rq_"), "{name}");
        }
    }

    #[test]
    fn usage_counters_are_per_instance_and_count_only_what_was_reported() {
        for (i, counter) in UsageCounter::ALL.iter().enumerate() {
            assert_eq!(counter.index(), i);
            assert!(counter.prefix().starts_with("prefix_router.usage."));
            assert!(!counter.prefix().contains("_rq_"));
        }
        assert_eq!(
            instance_stat_name(UsageCounter::CachedTokens.prefix(), "10.0.0.1:80"),
            "prefix_router.usage.cached_tokens.endpoint.10.0.0.1:80"
        );
        use UsageCounter::*;
        assert_eq!(
            UsageCounter::amounts(None, Some(512), Verdict::Unchecked),
            [
                (Responses, 1),
                (Reported, 0),
                (ReportedCached, 0),
                (PromptTokens, 0),
                (CachedTokens, 0),
                (MatchedBytes, 0),
                (IndexMisses, 0),
                (IndexForgets, 0)
            ]
        );
        let no_cached = Usage {
            prompt_tokens: 40,
            cached_tokens: None,
        };
        assert_eq!(
            UsageCounter::amounts(Some(no_cached), Some(512), Verdict::Unchecked),
            [
                (Responses, 1),
                (Reported, 1),
                (ReportedCached, 0),
                (PromptTokens, 40),
                (CachedTokens, 0),
                (MatchedBytes, 0),
                (IndexMisses, 0),
                (IndexForgets, 0)
            ]
        );
        let cached = Usage {
            prompt_tokens: 40,
            cached_tokens: Some(32),
        };
        assert_eq!(
            UsageCounter::amounts(Some(cached), Some(128), Verdict::Held),
            [
                (Responses, 1),
                (Reported, 1),
                (ReportedCached, 1),
                (PromptTokens, 40),
                (CachedTokens, 32),
                (MatchedBytes, 128),
                (IndexMisses, 0),
                (IndexForgets, 0)
            ]
        );
        let missed = Verdict::Missed {
            forget_through_s: None,
        };
        let amounts = UsageCounter::amounts(Some(cached), Some(4096), missed);
        assert_eq!(amounts[IndexMisses.index()], (IndexMisses, 1));
        for (i, (counter, _)) in UsageCounter::amounts(None, None, Verdict::Unchecked)
            .iter()
            .enumerate()
        {
            assert_eq!(counter.index(), i);
        }
    }

    #[test]
    fn an_adapters_stat_is_one_bounded_level_of_safe_bytes() {
        assert_eq!(
            adapter_stat_name(b"sql-lora_2"),
            "prefix_router.adapter.instances.adapter.sql-lora_2"
        );
        assert_eq!(
            adapter_stat_name("org/llama-3.1:é\n".as_bytes()),
            "prefix_router.adapter.instances.adapter.org_llama-3_1____"
        );
        let long = adapter_stat_name(&[b'a'; 300]);
        assert_eq!(
            long.len(),
            ADAPTER_INSTANCES_PREFIX.len() + ".adapter.".len() + 64
        );
        assert!(adapter_stat_name(&[0xff, 0, b'.']).ends_with(".adapter.___"));
    }

    #[test]
    fn decision_and_gauge_names_are_prometheus_safe() {
        let names: Vec<String> = DECISION_KINDS
            .iter()
            .map(|k| decision_counter_name(*k))
            .collect();
        assert_eq!(
            names,
            [
                "prefix_router.decision.matched",
                "prefix_router.decision.cold",
                "prefix_router.decision.moved",
                "prefix_router.decision.prefix",
                "prefix_router.decision.overflow",
                "prefix_router.decision.least_outstanding",
                "prefix_router.decision.random",
                "prefix_router.decision.no_key",
            ]
        );
        for (i, kind) in DECISION_KINDS.iter().enumerate() {
            assert_eq!(decision_index(*kind), i);
        }
        assert_eq!(
            in_flight_gauge_name("127.0.0.1:8001"),
            "prefix_router.in_flight.endpoint.127.0.0.1:8001"
        );
        assert_eq!(
            placed_bytes_counter_name("[::1]:80"),
            "prefix_router.placed_bytes.endpoint.[::1]:80"
        );
    }

    #[test]
    fn a_fleet_is_one_level_after_a_marker_and_no_fleet_changes_nothing() {
        assert_eq!(
            fleet_stat_name(Some("llama"), "prefix_router.decision.matched"),
            "prefix_router.fleet.llama.decision.matched"
        );
        assert_eq!(
            fleet_stat_name(Some("mistral-7b"), &in_flight_gauge_name("127.0.0.1:8001")),
            "prefix_router.fleet.mistral-7b.in_flight.endpoint.127.0.0.1:8001"
        );
        for counter in Counter::ALL {
            assert_eq!(fleet_stat_name(None, counter.name()), counter.name());
            let named = fleet_stat_name(Some("f"), counter.name());
            assert_eq!(
                named.replacen("prefix_router.fleet.f.", "prefix_router.", 1),
                counter.name()
            );
        }
    }

    #[test]
    fn fleet_ids_start_afresh_for_another_fleet_only() {
        let mut ids = FleetIds::<Vec<u32>>::default();
        ids.of(None).push(1);
        ids.of(None).push(2);
        assert_eq!(ids.of(None), &[1, 2]);
        ids.of(Some("llama")).push(3);
        assert_eq!(ids.of(Some("llama")), &[3]);
        assert!(ids.of(None).is_empty());
    }

    #[test]
    fn keyed_requests_count_per_api_with_bytes_inspected() {
        for (api, counter) in [
            (ApiKind::Invoke, Counter::KeyedInvoke),
            (ApiKind::ChatCompletions, Counter::KeyedChatCompletions),
            (ApiKind::Completions, Counter::KeyedCompletions),
            (ApiKind::Responses, Counter::KeyedResponses),
        ] {
            assert_eq!(
                recording_for(&keyed(api)),
                Recording {
                    counters: vec![counter],
                    bytes_inspected: Some(5000)
                }
            );
        }
    }

    #[test]
    fn fallback_and_short_add_their_counters() {
        let mut d = keyed(ApiKind::ChatCompletions);
        d.fallback = Some(FallbackReason::UnexpectedShape);
        d.short = true;
        assert_eq!(
            recording_for(&d).counters,
            vec![
                Counter::KeyedChatCompletions,
                Counter::RawFallback,
                Counter::ShortBody
            ]
        );
    }

    #[test]
    fn no_key_counts_once_without_histogram() {
        let mut d = keyed(ApiKind::Invoke);
        d.key = None;
        d.no_key = Some(NoKeyReason::NoBody);
        assert_eq!(
            recording_for(&d),
            Recording {
                counters: vec![Counter::NoKey],
                bytes_inspected: None
            }
        );
    }
}
