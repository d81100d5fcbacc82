//! The Prometheus example (`examples/prometheus/`): the scrape configuration
//! and alerting rules pass `promtool`, and the alerts' unit tests pass; every
//! shipped bootstrap carries the `stats_tags` docs/metrics.md gives, and a
//! real Envoy started from `envoy/envoy.yaml` is scraped with the labelled
//! series that docs/metrics.md lists and that every selector of the
//! dashboard, the alerts and the queries matches.
//! promtool comes from `PROMTOOL` or PATH (`cargo xtask test` provides it);
//! Envoy from `ENVOY_BIN` or PATH, the filter from `PREFIX_ROUTER_WASM` or the
//! release build.

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use prefix_router::engine_load::poller::PollFault;
use prefix_router::metrics::{Counter, DECISION_KINDS};
use prefix_router_tools::envoy::Envoy;
use prefix_router_tools::sim::metrics::{Histogram, MetricsSnapshot, TTFT_BUCKETS};
use prefix_router_tools::upstream::{MetricsReply, UpstreamFleet};
use serde_yaml::Value;

use support::*;

/// Every Envoy bootstrap the project ships.
const BOOTSTRAPS: [&str; 7] = [
    "envoy/envoy.yaml",
    "envoy/envoy-ecds.yaml",
    "envoy/envoy-ring-hash.yaml",
    "envoy/docker/envoy.yaml",
    "examples/kubernetes/envoy.yaml",
    "examples/envoy-eds/envoy.yaml",
    "examples/envoy-two-fleets/envoy.yaml",
];

/// Prometheus's `promtool` (`cargo xtask test` provides it in PROMTOOL).
fn promtool() -> PathBuf {
    match std::env::var_os("PROMTOOL").filter(|v| !v.is_empty()) {
        Some(path) => PathBuf::from(path),
        None => PathBuf::from("promtool"),
    }
}

/// Runs `promtool` in `examples/prometheus/`; panics with its output unless it succeeds.
fn run_promtool(args: &[&str]) {
    run_check(
        Command::new(promtool())
            .args(args)
            .current_dir(root().join("examples/prometheus")),
        "run the tests with `cargo xtask test`, which fetches it, or put Prometheus's \
         promtool on PATH or in PROMTOOL",
    );
}

#[test]
fn prometheus_configuration_and_alerts_pass_promtool_and_their_unit_tests() {
    // The scrape configuration, with the rule files it loads.
    run_promtool(&["check", "config", "prometheus.yml"]);
    run_promtool(&["check", "rules", "alerts.yml"]);
    // Each alert fires on the series that should fire it, and only then.
    run_promtool(&["test", "rules", "alerts.test.yml"]);
}

/// Every expression of `queries.promql` (one per unindented line, indented
/// lines continuing it; `#` lines are comments) and of the Grafana dashboard's
/// panels (its `fleet` variable's "All" standing for `$fleet`).
fn queries_and_dashboard_expressions() -> Vec<String> {
    let mut expressions: Vec<String> = Vec::new();
    for line in read("examples/prometheus/queries.promql").lines() {
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        match expressions.last_mut() {
            Some(last) if line.starts_with(char::is_whitespace) => {
                last.push(' ');
                last.push_str(line.trim());
            }
            _ => expressions.push(line.to_string()),
        }
    }
    expressions.extend(dashboard_panel_expressions());
    expressions
}

#[test]
fn the_queries_and_dashboard_expressions_parse() {
    let expressions = queries_and_dashboard_expressions();
    assert!(expressions.len() >= 30, "{} expressions", expressions.len());
    // promtool parses PromQL where it checks rules: each expression becomes
    // a recording rule of a throwaway rule file.
    let rules: Vec<serde_json::Value> = expressions
        .iter()
        .enumerate()
        .map(|(i, expr)| serde_json::json!({"record": format!("dashboard:expression_{i}"), "expr": expr}))
        .collect();
    let file = serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]});
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("dashboard-rules.yml");
    // JSON is YAML.
    std::fs::write(&path, file.to_string()).expect("write the rule file");
    run_promtool(&["check", "rules", path.to_str().expect("a UTF-8 path")]);
}

/// The dashboard's `fleet` variable (several fleets' filters under a `fleet`
/// label, docs/metrics.md) filters every panel on the filter's stats, and
/// its "All" matches series without the label too (one fleet, no `fleet`).
#[test]
fn every_dashboard_panel_on_the_filters_stats_follows_the_fleet_variable() {
    let dashboard = grafana_dashboard();
    let fleet = dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
        .iter()
        .find(|v| v["name"] == "fleet")
        .expect("a fleet variable");
    assert_eq!(fleet["includeAll"], true);
    assert_eq!(
        fleet["allValue"], ".*",
        "All must match series without the label"
    );
    let mut filtered = 0;
    for expr in dashboard_panel_expressions() {
        let selectors = expr.matches("prefix_router_").count();
        if selectors == 0 {
            continue;
        }
        assert_eq!(
            expr.matches(r#"fleet=~"$fleet""#).count(),
            selectors,
            "not every selector follows the fleet variable: {expr}"
        );
        filtered += 1;
    }
    assert!(
        filtered >= 12,
        "{filtered} expressions on the filter's stats"
    );
}

/// The `stats_config` block docs/metrics.md gives to paste.
fn documented_stats_config() -> Value {
    let doc = read("docs/metrics.md");
    let block = doc
        .split("```yaml")
        .skip(1)
        .filter_map(|after| after.split("```").next())
        .find(|block| block.contains("stats_tags"))
        .expect("a stats_tags block in docs/metrics.md");
    let documented: Value = serde_yaml::from_str(block)
        .unwrap_or_else(|e| panic!("the stats_tags block is not YAML ({e}):{block}"));
    documented["stats_config"].clone()
}

/// The alternatives of the value group of a tag regex:
/// `...decision(\.(matched|cold))$` -> {matched, cold}.
fn value_alternatives(regex: &str) -> BTreeSet<String> {
    let (_, group) = regex
        .split_once(r"(\.(")
        .unwrap_or_else(|| panic!("no value group in {regex}"));
    let (group, _) = group
        .split_once("))$")
        .unwrap_or_else(|| panic!("no value group in {regex}"));
    group.split('|').map(str::to_string).collect()
}

#[test]
fn every_shipped_bootstrap_carries_the_documented_stats_tags() {
    let documented = documented_stats_config();
    for bootstrap in BOOTSTRAPS {
        assert_eq!(
            yaml(bootstrap)["stats_config"],
            documented,
            "{bootstrap}'s stats_config is not docs/metrics.md's"
        );
    }
    // docs/istio.md's bootstrap override carries the same, as JSON.
    let istio = read("docs/istio.md");
    let config_map: Value = istio
        .split("```yaml")
        .skip(1)
        .filter_map(|after| after.split("```").next())
        .find(|block| block.contains("custom_bootstrap.json"))
        .map(|block| serde_yaml::from_str(block).expect("the ConfigMap is YAML"))
        .expect("a bootstrap override ConfigMap in docs/istio.md");
    let custom_bootstrap: Value = serde_yaml::from_str(s(
        &config_map["data"]["custom_bootstrap.json"],
        "custom_bootstrap.json",
    ))
    .expect("custom_bootstrap.json is JSON");
    assert_eq!(
        custom_bootstrap["stats_config"], documented,
        "docs/istio.md's bootstrap override is not docs/metrics.md's stats_config"
    );
    // The regexes that list their values list every value the filter names.
    let tags = seq(&documented["stats_tags"], "stats_tags");
    let regex_of = |tag: &str| -> String {
        let entry = tags
            .iter()
            .find(|t| t["tag_name"].as_str() == Some(tag))
            .unwrap_or_else(|| panic!("no stats_tags entry {tag}"));
        s(&entry["regex"], "regex").to_string()
    };
    let kinds: BTreeSet<String> = DECISION_KINDS
        .iter()
        .map(|k| k.as_str().to_string())
        .collect();
    assert_eq!(value_alternatives(&regex_of("kind")), kinds);
    let apis: BTreeSet<String> = Counter::ALL
        .iter()
        .filter_map(|c| c.name().strip_prefix("prefix_router.requests_keyed."))
        .map(str::to_string)
        .collect();
    assert_eq!(apis.len(), 4, "{apis:?}");
    assert_eq!(value_alternatives(&regex_of("api")), apis);
    let reasons: BTreeSet<String> = PollFault::REASONS.iter().map(|r| r.to_string()).collect();
    assert_eq!(value_alternatives(&regex_of("reason")), reasons);
}

/// One label matcher of a PromQL selector: `kind="matched"`, `api=~"a|b"`.
struct Matcher {
    label: String,
    op: String,
    value: String,
}

impl Matcher {
    fn matches(&self, sample: &Sample) -> bool {
        let value = sample.label(&self.label).unwrap_or("");
        let in_alternatives = || {
            // The dashboard's `fleet` variable, with "All" chosen.
            if self.value == "$fleet" || self.value == ".*" {
                return true;
            }
            assert!(
                !self.value.contains(|c: char| "()[]{}.*+?^$\\".contains(c)),
                "the test reads regex matchers as alternatives of literals only: {}",
                self.value
            );
            self.value.split('|').any(|v| v == value)
        };
        match self.op.as_str() {
            "=" => value == self.value,
            "!=" => value != self.value,
            "=~" => in_alternatives(),
            "!~" => !in_alternatives(),
            op => panic!("matcher operator {op}"),
        }
    }
}

/// A selector of one of the filter's series: `prefix_router_decision{kind="overflow"}`.
struct Selector {
    text: String,
    name: String,
    matchers: Vec<Matcher>,
}

/// The selectors of the filter's series in `expr` (names that start with
/// `prefix_router_`; Envoy's own `envoy_wasm_prefix_router_*` are not).
fn filter_selectors(expr: &str) -> Vec<Selector> {
    let in_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut selectors = Vec::new();
    let mut rest = expr;
    while let Some(found) = rest.find("prefix_router_") {
        let preceded_by_name = rest[..found].chars().next_back().is_some_and(in_name);
        let tail = &rest[found..];
        let end = tail.find(|c: char| !in_name(c)).unwrap_or(tail.len());
        let name = &tail[..end];
        let mut matchers = Vec::new();
        let mut consumed = end;
        if let Some(inside) = tail[end..].strip_prefix('{') {
            let (inside, _) = inside
                .split_once('}')
                .unwrap_or_else(|| panic!("unclosed selector in {expr}"));
            consumed += inside.len() + 2;
            for matcher in inside.split(',').map(str::trim) {
                let at = matcher
                    .find(['=', '!'])
                    .unwrap_or_else(|| panic!("matcher {matcher} in {expr}"));
                let (label, rest) = matcher.split_at(at);
                let op_len =
                    if rest.starts_with("=~") || rest.starts_with("!~") || rest.starts_with("!=") {
                        2
                    } else {
                        1
                    };
                let (op, value) = rest.split_at(op_len);
                matchers.push(Matcher {
                    label: label.trim().to_string(),
                    op: op.to_string(),
                    value: value.trim().trim_matches('"').to_string(),
                });
            }
        }
        if !preceded_by_name {
            selectors.push(Selector {
                text: tail[..consumed].to_string(),
                name: name.to_string(),
                matchers,
            });
        }
        rest = &tail[consumed..];
    }
    selectors
}

/// The labels an expression aggregates by (`sum by (kind, fleet) (...)`),
/// but those every scrape has (`instance`, `job`), a histogram's `le`, and
/// `fleet`, which only several fleets' filters carry.
fn aggregated_labels(expr: &str) -> BTreeSet<String> {
    let mut labels = BTreeSet::new();
    for (at, by) in expr.match_indices("by (") {
        let list = expr[at + by.len()..].split(')').next().unwrap_or("");
        for label in list.split(',').map(str::trim) {
            if !["instance", "job", "le", "fleet", ""].contains(&label) {
                labels.insert(label.to_string());
            }
        }
    }
    labels
}

/// The alerting rules' expressions.
fn alert_expressions() -> Vec<String> {
    let rules = yaml("examples/prometheus/alerts.yml");
    let mut expressions = Vec::new();
    for group in seq(&rules["groups"], "groups") {
        for rule in seq(&group["rules"], "rules") {
            expressions.push(s(&rule["expr"], "expr").to_string());
        }
    }
    expressions
}

/// How a sample is documented in docs/metrics.md: `` `name{label,...}` ``
/// with its labels but `fleet` (each series can have it) and `le`; a
/// histogram's `_sum` and `_count` under its `_bucket`.
fn documented_as(sample: &Sample, names: &BTreeSet<String>) -> String {
    let name = ["_sum", "_count"]
        .iter()
        .find_map(|suffix| {
            let base = sample.name.strip_suffix(suffix)?;
            let bucket = format!("{base}_bucket");
            names.contains(&bucket).then_some(bucket)
        })
        .unwrap_or_else(|| sample.name.clone());
    let labels: Vec<&str> = sample
        .labels
        .keys()
        .map(String::as_str)
        .filter(|l| !["fleet", "le"].contains(l))
        .collect();
    if labels.is_empty() {
        format!("`{name}`")
    } else {
        format!("`{name}{{{}}}`", labels.join(","))
    }
}

/// The LoRA adapter one request names: its set's gauge is labelled.
const ADAPTER: &str = "sql-lora";

/// The series of every per-instance stat, `endpoint` being `addr` as it is.
const PER_ENDPOINT: [&str; 5] = [
    "prefix_router_in_flight",
    "prefix_router_placed_bytes",
    "prefix_router_engine_requests",
    "prefix_router_engine_kv_usage_permille",
    "prefix_router_engine_sample_age_ms",
];

/// What a scrape lacks of the labelled series the filter's stats must give
/// with the shipped `stats_tags` (every kind, API, poll-failure reason, and
/// every per-instance stat of every instance of `addrs`), and of the series
/// the dashboard, alerts and queries select.
fn missing(samples: &[Sample], addrs: &[SocketAddr], expressions: &[String]) -> Vec<String> {
    let has = |name: &str, label: &str, value: &str| {
        samples
            .iter()
            .any(|s| s.name == name && s.label(label) == Some(value))
    };
    let mut missing = Vec::new();
    for kind in DECISION_KINDS {
        if !has("prefix_router_decision", "kind", kind.as_str()) {
            missing.push(format!(
                "prefix_router_decision{{kind=\"{}\"}}",
                kind.as_str()
            ));
        }
    }
    for api in ["chat_completions", "completions", "responses", "invoke"] {
        if !has("prefix_router_requests_keyed", "api", api) {
            missing.push(format!("prefix_router_requests_keyed{{api=\"{api}\"}}"));
        }
    }
    for reason in PollFault::REASONS {
        if !has("prefix_router_engine_poll_failures", "reason", reason) {
            missing.push(format!(
                "prefix_router_engine_poll_failures{{reason=\"{reason}\"}}"
            ));
        }
    }
    if !has("prefix_router_adapter_instances", "adapter", ADAPTER) {
        missing.push(format!(
            "prefix_router_adapter_instances{{adapter=\"{ADAPTER}\"}}"
        ));
    }
    for name in PER_ENDPOINT {
        for addr in addrs {
            if !has(name, "endpoint", &addr.to_string()) {
                missing.push(format!("{name}{{endpoint=\"{addr}\"}}"));
            }
        }
    }
    for expr in expressions {
        let by = aggregated_labels(expr);
        for selector in filter_selectors(expr) {
            let matched = samples.iter().any(|sample| {
                sample.name == selector.name
                    && selector.matchers.iter().all(|m| m.matches(sample))
                    && by.iter().all(|label| sample.label(label).is_some())
            });
            if !matched {
                missing.push(format!("{} (by {by:?}) of {expr}", selector.text));
            }
        }
    }
    missing
}

/// A real Envoy from `envoy/envoy.yaml`, `stats_config` edited by
/// `edit_stats_config`, with every stat of the filter defined (the fleet
/// listed, its engines polled, a keyed request on every instance), scraped
/// once the scrape has every labelled series and every selector of the
/// dashboard, alerts and queries matches one of it; panics with what is
/// missing if that takes over 20 s.
fn scrape_with_every_series(
    edit_stats_config: impl FnOnce(&mut Value) + Send + 'static,
) -> Vec<Sample> {
    let fleet = UpstreamFleet::start(3).expect("instances");
    let engine = MetricsSnapshot {
        prefix_cache_queries: 0,
        prefix_cache_hits: 0,
        prompt_tokens: 0,
        generation_tokens: 0,
        request_success: 0,
        num_requests_running: 2,
        num_requests_waiting: 1,
        kv_cache_usage: 0.25,
        ttft: Histogram::new(&TTFT_BUCKETS),
    };
    for i in 0..3 {
        fleet
            .set_metrics(i, MetricsReply::Text(engine.render("m")))
            .expect("metrics reply");
    }
    let addrs = fleet.addrs();
    // The launcher writes the run's instances into `instances`.
    let config = serde_json::json!({
        "instances": [],
        "engine_load": {"cluster": "engine_metrics", "interval_ms": 200},
        "adapters": {"base_models": ["m"]},
    });
    let envoy = Envoy::builder()
        .upstreams(addrs.clone())
        .plugin_config(config.to_string())
        .edit(|config| {
            edit_stats_config(&mut config["stats_config"]);
            Ok(())
        })
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    // Every instance gets a keyed request: its placed_bytes is defined.
    let mut served = BTreeSet::new();
    for i in 0..60 {
        let body = format!("prompt {i}: {}", "context ".repeat(40));
        served.insert(post(&envoy, "/invocations", &[], body.as_bytes()));
        if served.len() == addrs.len() {
            break;
        }
    }
    assert_eq!(
        served.len(),
        addrs.len(),
        "60 prompts reached only {served:?}"
    );
    let chat = format!(r#"{{"model":"{ADAPTER}","messages":[{{"role":"user","content":"hi"}}]}}"#);
    post(
        &envoy,
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        chat.as_bytes(),
    );

    let mut expressions = queries_and_dashboard_expressions();
    expressions.extend(alert_expressions());
    wait_until(
        Duration::from_secs(20),
        || samples(&envoy.prometheus().expect("Envoy /stats/prometheus")),
        |samples| missing(samples, &addrs, &expressions).is_empty(),
        |samples| {
            format!(
                "missing from the scrape: {:#?}\nthe filter's series:\n{}",
                missing(samples, &addrs, &expressions),
                samples
                    .iter()
                    .filter(|s| s.name.starts_with("prefix_router_"))
                    .map(|s| format!("{} {:?}", s.name, s.labels))
                    .collect::<Vec<_>>()
                    .join("\n")
            )
        },
    )
}

#[test]
fn a_real_scrape_has_the_labelled_series_the_docs_and_every_dashboard_alert_and_query_name() {
    let scraped = scrape_with_every_series(|_| {});
    let filters: Vec<&Sample> = scraped
        .iter()
        .filter(|s| s.name.starts_with("prefix_router_"))
        .collect();
    // No address or kind is left in a series' name.
    let names: BTreeSet<String> = filters.iter().map(|s| s.name.clone()).collect();
    for name in &names {
        assert!(
            !name.contains("endpoint") && !name.contains("127_0_0_1"),
            "an address in the series name {name}"
        );
        assert!(
            !name.starts_with("prefix_router_decision_")
                && !name.starts_with("prefix_router_requests_keyed_")
                && !name.starts_with("prefix_router_engine_poll_failures_")
                && !name.starts_with("prefix_router_adapter_instances_"),
            "a label value in the series name {name}"
        );
    }
    // A stat without a label stays as it is.
    assert!(
        filters
            .iter()
            .any(|s| s.name == "prefix_router_no_key" && s.labels.is_empty()),
        "no unlabelled prefix_router_no_key"
    );
    let doc = read("docs/metrics.md");
    for sample in &filters {
        let documented = documented_as(sample, &names);
        assert!(
            doc.contains(&documented),
            "docs/metrics.md does not list {documented}"
        );
    }
}

/// Istio's sidecar bootstrap's own tags (istio/istio
/// `tools/packaging/common/envoy_bootstrap.json`, no `extraStatTags`): some
/// match anywhere in a name (`cache.`, `component.`, `rbac.`).
const ISTIO_STATS_TAGS: &str = r#"
use_all_default_tags: false
stats_tags:
- {tag_name: cluster_name, regex: '^cluster\.((.+?(\..+?\.svc\.cluster\.local)?)\.)'}
- {tag_name: tcp_prefix, regex: '^tcp\.((.*?)\.)\w+?$'}
- {tag_name: response_code, regex: '_rq(_(\d{3}))$'}
- {tag_name: response_code_class, regex: '_rq(_(\dxx))$'}
- {tag_name: http_conn_manager_listener_prefix, regex: '^listener(?=\.).*?\.http\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)'}
- {tag_name: http_conn_manager_prefix, regex: '^http\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)'}
- {tag_name: listener_address, regex: '^listener\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)'}
- {tag_name: mongo_prefix, regex: '^mongo\.(.+?)\.(collection|cmd|cx_|op_|delays_|decoding_)(.*?)$'}
- {tag_name: cache, regex: '(cache\.(.+?)\.)'}
- {tag_name: component, regex: '(component\.(.+?)\.)'}
- {tag_name: tag, regex: '(tag\.(.+?);\.)'}
- {tag_name: wasm_filter, regex: '(wasm_filter\.(.+?)\.)'}
- {tag_name: authz_enforce_result, regex: 'rbac(\.(allowed|denied))'}
- {tag_name: authz_dry_run_action, regex: '(\.istio_dry_run_(allow|deny)_)'}
- {tag_name: authz_dry_run_result, regex: '(\.shadow_(allowed|denied))'}
"#;

/// docs/istio.md: on Istio the labels come from a `bootstrapOverride` whose
/// `stats_tags` istio-agent appends to its bootstrap's own (a repeated field
/// merges by appending). Merged so, the scrape has the same labelled series,
/// and none of Istio's tags lands on the filter's series.
#[test]
fn the_labels_hold_with_istios_bootstrap_tags_before_them() {
    let scraped = scrape_with_every_series(|stats_config| {
        let ours = seq(&stats_config["stats_tags"], "stats_tags").clone();
        *stats_config = serde_yaml::from_str(ISTIO_STATS_TAGS).expect("Istio's stats_config");
        stats_config["stats_tags"]
            .as_sequence_mut()
            .expect("Istio's stats_tags")
            .extend(ours);
    });
    let ours = [
        "kind", "api", "reason", "adapter", "endpoint", "fleet", "le",
    ];
    for sample in scraped
        .iter()
        .filter(|s| s.name.starts_with("prefix_router_"))
    {
        assert!(
            sample.labels.keys().all(|l| ours.contains(&l.as_str())),
            "one of Istio's tags on {sample:?}"
        );
    }
}
