//! Steering: carrying a policy's decision out through Envoy's headers. From
//! the configuration and a [`RouteHeaders`] to what the filter does with the
//! request headers: which client-sent headers to strip, which headers the
//! decision sets, what the listener keeps for the response when it counts
//! there, and the debug response header. Kept out of the callbacks
//! (`plugin`) so every rule (spoofing, header ownership, the policy a
//! configuration selects) is tested on its own.

use crate::config::{Config, Counting, Matching, Strategy};
use crate::headers::{COUNTED_HEADER, DEFAULT_HOST_HEADER, PENDING_MARK, ROUTE_HEADER};
use crate::load::{LoadConfig, UpstreamStart};
use crate::strategy::{
    AdapterDecision, AdapterSets, Cost, DecisionKind, Explained, LongestPrefix, Policy,
    PrefixAware, RouteHeaders,
};

/// The routing policy a configuration selects (rebuilt on every configure).
pub fn policy_for(config: &Config) -> Policy {
    match config.strategy {
        Strategy::PrefixAware if config.matching == Matching::LongestPrefix => {
            Policy::LongestPrefix(LongestPrefix::new(
                config.concurrency_threshold,
                config.load_margin,
                config.cold_placement,
                config.adapters.as_ref().map(|a| AdapterSets {
                    min_instances: a.min_instances,
                    max_instances: a.max_instances,
                }),
            ))
        }
        Strategy::PrefixAware => Policy::PrefixAware(PrefixAware {
            engine_load: config.engine_load.is_some(),
            ..PrefixAware::new(config.concurrency_threshold, config.host_header.is_some())
        }),
        Strategy::LeastOutstandingRequests => Policy::LeastOutstanding,
        Strategy::Random => Policy::Random,
    }
}

/// Namespace of the shared tables. One for every plugin of the VM: the
/// downstream and the upstream filter must share tables, whatever their
/// names or root ids.
pub const LOAD_NAMESPACE: &str = "default";

/// The load tables' settings (the parts the plugin configuration controls).
pub fn load_config(config: &Config) -> LoadConfig {
    LoadConfig {
        namespace: LOAD_NAMESPACE.to_string(),
        instance_ttl_ms: config.instance_ttl_ms,
        index_bytes: config.index_bytes,
        ..LoadConfig::default()
    }
}

/// Request headers a client may not send: the filter owns them, and any of
/// them would let a client pin an instance or skew the counts. Removed from
/// every request before anything is decided. With `host_header` off, the
/// default host header is still removed: a cluster left with the shipped
/// `override_host` policy would otherwise obey a client-sent one.
pub fn owned_request_headers(config: &Config) -> Vec<&str> {
    let mut names = vec![config.key_header.as_str()];
    names.push(config.host_header.as_deref().unwrap_or(DEFAULT_HOST_HEADER));
    names.push(ROUTE_HEADER);
    names.push(COUNTED_HEADER);
    names
}

/// The request headers carrying out `decision`, with their values. A header
/// the decision leaves unset needs no removal: every header it governs is in
/// [`owned_request_headers`], removed when the request started, and nothing
/// but this filter writes them (one host call per header saved).
pub fn header_writes<'c>(config: &'c Config, decision: &RouteHeaders) -> Vec<(&'c str, String)> {
    let mut writes = Vec::with_capacity(3);
    let mut put = |name: &'c str, value: Option<&str>| {
        if let Some(value) = value {
            writes.push((name, value.to_string()));
        }
    };
    put(config.key_header.as_str(), decision.key.as_deref());
    if let Some(host) = &config.host_header {
        put(host.as_str(), decision.host_override.as_deref());
    }
    put(ROUTE_HEADER, decision.route);
    // Only an upstream filter reads it; counting in the listener, the stream
    // keeps it ([`ListenerCount`]) and a header write is saved.
    if config.counting == Counting::UpstreamFilter {
        put(COUNTED_HEADER, decision.counted.as_deref());
    }
    writes
}

/// With `counting: LISTENER`, what the listener keeps of its decision until
/// the response headers, where `upstream.address` names the instance Envoy
/// chose and the listener does what the upstream filter would have done at
/// the request's start: learn the key's target, count the request where it
/// went unless the decision already counted it there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerCount {
    key: Option<String>,
    overridden: bool,
    counted: Option<String>,
    check_due: bool,
}

impl ListenerCount {
    /// What `decision` left for the response (the same facts the upstream
    /// filter reads from the headers [`header_writes`] sets). `check_due`:
    /// [`crate::load::LoadTracker::response_check_due`] for its key.
    pub fn of(config: &Config, decision: &RouteHeaders, check_due: bool) -> Self {
        Self {
            key: decision.key.clone(),
            overridden: config.host_header.is_some() && decision.host_override.is_some(),
            counted: decision.counted.clone(),
            check_due,
        }
    }

    /// Whether to read, at the response, where the request went. Always for
    /// a request not counted yet (to count it and learn its key's target) or
    /// sent by the host-override header (to notice a nominated instance that
    /// is gone); a request claimed on its key's learned target only when the
    /// key's periodic check is due: Maglev sends the key there until the
    /// fleet changes.
    pub fn check_at_response(&self) -> bool {
        let claimed_on_target = !self.overridden
            && self
                .counted
                .as_deref()
                .is_some_and(|counted| counted != PENDING_MARK);
        self.check_due || !claimed_on_target
    }

    /// For [`crate::load::LoadTracker::settle_at_response`] (and
    /// `upstream_started`), once the response came from `address`.
    pub fn start<'a>(&'a self, address: &'a str) -> UpstreamStart<'a> {
        UpstreamStart {
            address,
            key: self.key.as_deref(),
            overridden: self.overridden,
            counted: self.counted.as_deref(),
        }
    }

    /// True if the decision's count (if any) stands: it was taken on
    /// `address`, or none was taken. False: the decision counted the request
    /// on another instance than Envoy chose.
    pub fn count_stands(&self, address: &str) -> bool {
        self.start(address).decision_count_stands()
    }
}

/// Value of the debug `decision_header`: `<kind>; instance=<ip:port>`, or
/// just the kind when no upstream host was chosen; LONGEST_PREFIX adds
/// `; matched=<bytes>`, the prefix the chosen instance was known to hold,
/// and the cost of the chosen instance and the runner-up, term by term in
/// KiB of prompt computed: `; cost 4.5 = load 0 + prefill 4.5 + share 0;
/// runner-up 10.0.0.3:8000 cost 18.0 = load 0 + prefill 18.0 + share 0`.
/// A request for a LoRA adapter adds where it went against the adapter's
/// set and the set's size: `; adapter=set_grown; set=2`.
pub fn decision_header_value(
    kind: DecisionKind,
    instance: Option<&str>,
    matched_bytes: Option<u64>,
    explained: Option<&Explained>,
    adapter: Option<AdapterDecision>,
) -> String {
    let mut value = kind.as_str().to_string();
    if let Some(address) = instance {
        value.push_str("; instance=");
        value.push_str(address);
    }
    if let Some(bytes) = matched_bytes {
        value.push_str(&format!("; matched={bytes}"));
    }
    if let Some(explained) = explained {
        value.push_str("; ");
        push_cost(&mut value, &explained.cost);
        if let Some((address, cost)) = &explained.runner_up {
            value.push_str("; runner-up ");
            value.push_str(address);
            value.push(' ');
            push_cost(&mut value, cost);
        }
    }
    if let Some(adapter) = adapter {
        value.push_str(&format!(
            "; adapter={}; set={}",
            adapter.placement.as_str(),
            adapter.set_size
        ));
    }
    value
}

/// `cost <total> = load <l> + prefill <p> + share <s>`, in KiB.
fn push_cost(value: &mut String, cost: &Cost) {
    value.push_str(&format!(
        "cost {} = load {} + prefill {} + share {}",
        Kib(cost.total()),
        Kib(cost.load),
        Kib(cost.prefill),
        Kib(cost.share)
    ));
}

/// Bytes as KiB with one decimal, in integer arithmetic (no float
/// formatting in the `.wasm`).
struct Kib(u64);

impl std::fmt::Display for Kib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tenths = self.0.saturating_mul(10).saturating_add(512) / 1024;
        write!(f, "{}.{}", tenths / 10, tenths % 10)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ColdPlacement;
    use crate::headers::LEAST_REQUEST_ROUTE;
    use crate::load::LoadView;
    use crate::load::{LoadTracker, Ticket};
    use crate::shared::MemoryStore;
    use crate::strategy::{RecentChoices, RouteRequest, Routed};

    /// `policy`'s decision for a request with `key`.
    fn decide(
        policy: &Policy,
        key: Option<&str>,
        load: &mut dyn LoadView,
        random: u64,
        now: u64,
    ) -> Routed {
        let request = RouteRequest {
            key,
            ..RouteRequest::default()
        };
        policy.route(request, load, &mut RecentChoices::default(), random, now)
    }

    /// With `match: FIXED_PREFIX` unless `json` names a match: these tests
    /// pin the steering of Maglev keys.
    fn config(json: &str) -> Config {
        Config::parse(crate::testing::fixed_prefix_unless_named(json).as_bytes()).unwrap()
    }

    const KEY: &str = "0123456789abcdef";

    #[test]
    fn every_header_a_client_could_pin_with_is_stripped() {
        let c = config(r#"{"key_header":"x-k","host_header":"x-h"}"#);
        assert_eq!(
            owned_request_headers(&c),
            vec![
                "x-k",
                "x-h",
                "x-prefix-router-lb",
                "x-prefix-router-counted"
            ]
        );
        // Host header off: the shipped override_host header is still removed.
        let c = config(r#"{"host_header":null}"#);
        assert_eq!(
            owned_request_headers(&c),
            vec![
                "x-prefix-route-key",
                "x-prefix-route-host",
                "x-prefix-router-lb",
                "x-prefix-router-counted"
            ]
        );
    }

    #[test]
    fn the_configured_strategy_selects_the_policy() {
        let c = config(r#"{"concurrency_threshold":3}"#);
        assert_eq!(
            policy_for(&c),
            Policy::PrefixAware(PrefixAware::new(3, true))
        );
        let c = Config::parse(br#"{"concurrency_threshold":3,"load_margin":5}"#).unwrap();
        assert_eq!(
            policy_for(&c),
            Policy::LongestPrefix(LongestPrefix::new(3, 5, ColdPlacement::Consistent, None))
        );
        let c = Config::parse(br#"{"cold_placement":"BALANCED"}"#).unwrap();
        assert_eq!(
            policy_for(&c),
            Policy::LongestPrefix(LongestPrefix::new(10, 4, ColdPlacement::Balanced, None))
        );
        let c = config(r#"{"concurrency_threshold":5,"host_header":null}"#);
        assert_eq!(
            policy_for(&c),
            Policy::PrefixAware(PrefixAware::new(5, false))
        );
        assert_eq!(
            policy_for(&config(r#"{"strategy":"LEAST_OUTSTANDING_REQUESTS"}"#)),
            Policy::LeastOutstanding
        );
        assert_eq!(
            policy_for(&config(r#"{"strategy":"RANDOM"}"#)),
            Policy::Random
        );
    }

    #[test]
    fn instance_ttl_reaches_the_load_tables() {
        let l = load_config(&config(r#"{"instance_ttl_ms":7000}"#));
        assert_eq!(l.instance_ttl_ms, 7000);
        assert_eq!(l.namespace, LOAD_NAMESPACE);
        assert_eq!(l.max_instances, LoadConfig::default().max_instances);
    }

    #[test]
    fn a_decision_sets_the_headers_it_governs_and_all_of_them_are_stripped_first() {
        let c = config("{}");
        let decision = RouteHeaders {
            key: Some(KEY.into()),
            host_override: Some("10.0.0.2:8000".into()),
            counted: Some("10.0.0.2:8000".into()),
            ..RouteHeaders::bare(DecisionKind::Overflow)
        };
        assert_eq!(
            header_writes(&c, &decision),
            vec![
                ("x-prefix-route-key", KEY.to_string()),
                ("x-prefix-route-host", "10.0.0.2:8000".to_string()),
                ("x-prefix-router-counted", "10.0.0.2:8000".to_string()),
            ]
        );
        let bare = RouteHeaders::bare(DecisionKind::Random);
        assert_eq!(
            header_writes(&config(r#"{"host_header":null}"#), &bare),
            vec![]
        );
        // Writes only set; what a decision leaves unset must already be gone:
        // every header any decision can write is stripped at request start.
        let everything = RouteHeaders {
            route: Some(LEAST_REQUEST_ROUTE),
            ..decision
        };
        for json in [
            "{}",
            r#"{"host_header":null}"#,
            r#"{"key_header":"x-k","host_header":"x-h"}"#,
        ] {
            let c = config(json);
            let owned = owned_request_headers(&c);
            let written = header_writes(&c, &everything);
            assert!(written.len() >= 3, "{json}: {written:?}");
            for (name, _) in written {
                assert!(
                    owned.contains(&name),
                    "{json}: {name} written but not stripped"
                );
            }
        }
    }

    /// The whole downstream -> upstream path on one store: the first request
    /// of a key goes out pending, the upstream filter counts it and learns the
    /// target, the next ones are claimed on the target until the threshold,
    /// then overflow nominates another known instance; releases bring every
    /// count back to zero.
    #[test]
    fn decisions_and_upstream_starts_cap_a_burst_and_release_to_zero() {
        let c = config(r#"{"concurrency_threshold":2}"#);
        let policy = policy_for(&c);
        let store = MemoryStore::new();
        let mut load = LoadTracker::new(&store, load_config(&c), 42);
        // Another instance becomes known through an unrelated request.
        let other = load.upstream_started(
            UpstreamStart {
                address: "10.0.0.9:80",
                key: None,
                overridden: false,
                counted: None,
            },
            0,
        );
        let mut tickets = Vec::new();
        tickets.extend(other);

        let first = decide(&policy, Some(KEY), &mut load, 1, 10);
        assert_eq!(first.headers.kind, DecisionKind::Prefix);
        assert_eq!(first.headers.counted.as_deref(), Some(PENDING_MARK));
        let t = load.upstream_started(
            UpstreamStart {
                address: "10.0.0.1:80",
                key: Some(KEY),
                overridden: false,
                counted: Some(PENDING_MARK),
            },
            11,
        );
        tickets.extend(t);

        let second = decide(&policy, Some(KEY), &mut load, 2, 12);
        assert_eq!(second.headers.kind, DecisionKind::Prefix);
        assert_eq!(second.headers.counted.as_deref(), Some("10.0.0.1:80"));
        assert_eq!(second.headers.host_override, None);
        // Counted by the decision: the upstream filter does not count again.
        assert_eq!(
            load.upstream_started(
                UpstreamStart {
                    address: "10.0.0.1:80",
                    key: Some(KEY),
                    overridden: false,
                    counted: Some("10.0.0.1:80"),
                },
                13
            ),
            None
        );
        tickets.extend(second.ticket);

        let third = decide(&policy, Some(KEY), &mut load, 3, 14);
        assert_eq!(third.headers.kind, DecisionKind::Overflow);
        assert_eq!(third.headers.host_override.as_deref(), Some("10.0.0.9:80"));
        assert_eq!(
            header_writes(&c, &third.headers).get(1),
            Some(&("x-prefix-route-host", "10.0.0.9:80".to_string()))
        );
        tickets.extend(third.ticket);

        let loads = load.snapshot(15);
        let in_flight = |addr: &str| {
            loads
                .iter()
                .find(|l| l.address == addr)
                .map(|l| l.in_flight)
        };
        assert_eq!(in_flight("10.0.0.1:80"), Some(2));
        assert_eq!(in_flight("10.0.0.9:80"), Some(2));
        for t in tickets {
            load.release(t, 16);
        }
        assert!(load.snapshot(17).iter().all(|l| l.in_flight == 0));
    }

    /// Each shared-data access is a host call with a lock and a copy in
    /// Envoy: a request of a known key, from decision to release, makes three
    /// reads and two writes (the key's route comes from the VM's copy, the
    /// decision's lookup of the target record is reused by its claim, and the
    /// upstream filter's by its check), and one read more within a second of
    /// the key being learned, when its pending marks may still count.
    #[test]
    fn a_steady_request_costs_three_shared_reads_and_two_writes() {
        let c = config(r#"{"concurrency_threshold":4}"#);
        let policy = policy_for(&c);
        let store = MemoryStore::new();
        let mut load = LoadTracker::new(&store, load_config(&c), 7);
        let address = "10.0.0.1:80";
        let steady = |load: &mut LoadTracker<&MemoryStore>, now: u64| {
            let (reads, writes) = (store.reads(), store.successful_sets());
            let routed = decide(&policy, Some(KEY), load, 2, now);
            let counted = routed.headers.counted.clone();
            let started = UpstreamStart {
                address,
                key: Some(KEY),
                overridden: false,
                counted: counted.as_deref(),
            };
            let upstream = load.upstream_started(started, now);
            for ticket in upstream.into_iter().chain(routed.ticket) {
                load.release(ticket, now + 1);
            }
            let cost = (store.reads() - reads, store.successful_sets() - writes);
            assert!(load.snapshot(now + 2).iter().all(|l| l.in_flight == 0));
            (counted, cost.0, cost.1)
        };
        // The key's first request learns its target.
        let (first, ..) = steady(&mut load, 10);
        assert_eq!(first.as_deref(), Some(PENDING_MARK));
        let claimed = Some(address.to_string());
        assert_eq!(
            steady(&mut load, 20),
            (claimed.clone(), 4, 2),
            "just learned"
        );
        // The VM's route copy is a second old: read again, kept.
        steady(&mut load, 1_500);
        assert_eq!(
            steady(&mut load, 1_600),
            (claimed, 3, 2),
            "learned long ago"
        );
    }

    #[test]
    fn counting_in_the_listener_writes_no_counted_header() {
        let decision = RouteHeaders {
            key: Some(KEY.into()),
            counted: Some("10.0.0.2:8000".into()),
            ..RouteHeaders::bare(DecisionKind::Prefix)
        };
        let names = |json: &str| -> Vec<String> {
            let c = config(json);
            let writes = header_writes(&c, &decision);
            writes
                .into_iter()
                .map(|(name, _)| name.to_string())
                .collect()
        };
        assert_eq!(names("{}"), vec!["x-prefix-route-key", COUNTED_HEADER]);
        assert_eq!(
            names(r#"{"counting":"LISTENER"}"#),
            vec!["x-prefix-route-key"]
        );
    }

    /// `counting: LISTENER` on one store: a new key's first request is
    /// pending until its response names the instance, which counts it and
    /// learns the target; the next is claimed there at the decision and its
    /// response confirms the count; one that Envoy sent elsewhere than
    /// predicted moves its count; releases bring every count back to zero.
    #[test]
    fn listener_counting_learns_and_corrects_at_the_response() {
        let c = config(r#"{"concurrency_threshold":4,"counting":"LISTENER"}"#);
        let policy = policy_for(&c);
        let store = MemoryStore::new();
        let mut load = LoadTracker::new(&store, load_config(&c), 42);
        let (a, b) = ("10.0.0.1:80", "10.0.0.2:80");
        let in_flight = |load: &mut LoadTracker<&MemoryStore>, addr: &str| {
            load.snapshot(50)
                .into_iter()
                .find(|l| l.address == addr)
                .map(|l| l.in_flight)
        };

        let first = decide(&policy, Some(KEY), &mut load, 1, 10);
        assert_eq!(first.ticket, None);
        let first_count = ListenerCount::of(&c, &first.headers, false);
        assert!(first_count.check_at_response(), "pending: always checked");
        let first_ticket = load.settle_at_response(first_count.start(a), first.ticket, 11);
        assert!(first_ticket.is_some(), "counted at its response");
        assert_eq!(in_flight(&mut load, a), Some(1));

        let second = decide(&policy, Some(KEY), &mut load, 2, 12);
        assert_eq!(
            second.headers.counted.as_deref(),
            Some(a),
            "claimed: learned"
        );
        let second_count = ListenerCount::of(&c, &second.headers, false);
        assert!(
            !second_count.check_at_response(),
            "claimed on target, not due"
        );
        assert!(ListenerCount::of(&c, &second.headers, true).check_at_response());
        let claimed = second.ticket.as_ref().map(Ticket::slot);
        let second_ticket = load.settle_at_response(second_count.start(a), second.ticket, 13);
        assert_eq!(second_ticket.as_ref().map(Ticket::slot), claimed, "kept");
        assert_eq!(in_flight(&mut load, a), Some(2), "not counted twice");

        let third = decide(&policy, Some(KEY), &mut load, 3, 14);
        assert!(third.ticket.is_some(), "claimed on a");
        let third_count = ListenerCount::of(&c, &third.headers, false);
        assert!(!third_count.count_stands(b), "predicted a, went to b");
        let moved = load.settle_at_response(third_count.start(b), third.ticket, 15);
        assert!(moved.is_some());
        assert_eq!(
            in_flight(&mut load, a),
            Some(2),
            "the claim on a given back"
        );
        assert_eq!(in_flight(&mut load, b), Some(1));
        let fourth = decide(&policy, Some(KEY), &mut load, 4, 16);
        assert_eq!(fourth.headers.counted.as_deref(), Some(b), "relearned: b");

        let tickets = [first_ticket, second_ticket, moved, fourth.ticket];
        for t in tickets.into_iter().flatten() {
            load.release(t, 16);
        }
        assert!(load.snapshot(17).iter().all(|l| l.in_flight == 0));
    }

    #[test]
    fn requests_sent_by_the_host_override_or_not_counted_are_always_checked() {
        let c = config(r#"{"counting":"LISTENER"}"#);
        let decision = |host: Option<&str>, counted: Option<&str>| RouteHeaders {
            key: Some(KEY.into()),
            host_override: host.map(String::from),
            counted: counted.map(String::from),
            ..RouteHeaders::bare(DecisionKind::Overflow)
        };
        let at = "10.0.0.2:8000";
        let checked = |d: RouteHeaders| ListenerCount::of(&c, &d, false).check_at_response();
        assert!(!checked(decision(None, Some(at))));
        assert!(checked(decision(Some(at), Some(at))));
        assert!(checked(decision(None, None)));
        assert!(checked(decision(None, Some(PENDING_MARK))));
        // Without a host header nothing is sent by override.
        let c = config(r#"{"counting":"LISTENER","host_header":null}"#);
        assert!(!ListenerCount::of(&c, &decision(Some(at), Some(at)), false).check_at_response());
    }

    #[test]
    fn least_outstanding_selects_the_least_request_route() {
        let c = config(r#"{"strategy":"LEAST_OUTSTANDING_REQUESTS"}"#);
        let store = MemoryStore::new();
        let mut load = LoadTracker::new(&store, load_config(&c), 1);
        let routed = decide(&policy_for(&c), None, &mut load, 0, 0);
        assert_eq!(
            header_writes(&c, &routed.headers),
            vec![("x-prefix-router-lb", LEAST_REQUEST_ROUTE.to_string())]
        );
    }

    #[test]
    fn decision_header_names_kind_and_instance() {
        assert_eq!(
            decision_header_value(
                DecisionKind::Overflow,
                Some("10.0.0.2:8000"),
                None,
                None,
                None
            ),
            "overflow; instance=10.0.0.2:8000"
        );
        assert_eq!(
            decision_header_value(DecisionKind::NoKey, None, None, None, None),
            "no_key"
        );
        assert_eq!(
            decision_header_value(
                DecisionKind::Matched,
                Some("10.0.0.2:8000"),
                Some(1536),
                None,
                None
            ),
            "matched; instance=10.0.0.2:8000; matched=1536"
        );
        assert_eq!(
            decision_header_value(
                DecisionKind::Overflow,
                Some("10.0.0.2:8000"),
                Some(0),
                None,
                Some(AdapterDecision {
                    placement: crate::strategy::AdapterPlacement::OutsideSet,
                    set_size: 3
                })
            ),
            "overflow; instance=10.0.0.2:8000; matched=0; adapter=outside_set; set=3"
        );
        let explained = Explained {
            cost: Cost {
                load: 3 * 1024,
                prefill: 4608,
                share: 0,
            },
            runner_up: Some((
                "10.0.0.3:8000".into(),
                Cost {
                    load: 0,
                    prefill: 18 * 1024 + 100,
                    share: 512,
                },
            )),
        };
        assert_eq!(
            decision_header_value(
                DecisionKind::Moved,
                Some("10.0.0.2:8000"),
                Some(0),
                Some(&explained),
                None
            ),
            "moved; instance=10.0.0.2:8000; matched=0; \
             cost 7.5 = load 3.0 + prefill 4.5 + share 0.0; \
             runner-up 10.0.0.3:8000 cost 18.6 = load 0.0 + prefill 18.1 + share 0.5"
        );
    }
}
