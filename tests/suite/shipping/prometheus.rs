//! The Prometheus example (`examples/prometheus/`): the scrape configuration
//! and alerting rules pass `promtool`, and the alerts' unit tests pass.
//! promtool comes from `PROMTOOL` or PATH (`cargo xtask test` provides it).

mod support;

use std::path::PathBuf;
use std::process::Command;

use support::*;

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
/// panels.
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
        filtered >= 15,
        "{filtered} expressions on the filter's stats"
    );
}
