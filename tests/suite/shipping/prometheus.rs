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
