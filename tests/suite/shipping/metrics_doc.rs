//! docs/metrics.md and the dashboards (`examples/prometheus/`) name every
//! stat the filter defines, under its Envoy and its Prometheus name, and the
//! dashboards use no metric the filter does not define.

mod support;

use std::collections::BTreeSet;

use support::*;

/// `prefix_router.requests_keyed.invoke` -> `prefix_router_requests_keyed_invoke`.
fn prometheus_name(stat: &str) -> String {
    stat.replace('.', "_")
}

#[test]
fn metrics_doc_and_dashboards_name_every_stat_the_filter_defines() {
    let doc = read("docs/metrics.md");
    let mut defined: Vec<String> = prefix_router::metrics::Counter::ALL
        .iter()
        .map(|c| c.name().to_string())
        .collect();
    for stat in [
        prefix_router::metrics::BYTES_INSPECTED,
        prefix_router::metrics::MATCHED_BYTES,
        prefix_router::metrics::INDEX_ENTRIES,
        prefix_router::metrics::INDEX_CAPACITY,
        prefix_router::metrics::INDEX_EVICTIONS,
    ] {
        defined.push(stat.to_string());
    }
    defined.extend(prefix_router::engine_load::documented_stat_names());
    // Per-instance stats, documented as `<prefix>.<ip>_<port>`.
    for name_of in [
        prefix_router::metrics::in_flight_gauge_name,
        prefix_router::metrics::placed_bytes_counter_name,
    ] {
        defined.push(format!("{}<ip>_<port>", name_of("")));
    }
    // Decision counters are documented once, as `prefix_router.decision.<kind>`
    // with every kind listed.
    for kind in prefix_router::metrics::DECISION_KINDS {
        assert!(
            doc.contains(&format!("`{}`", kind.as_str())),
            "docs/metrics.md does not list the decision kind {}",
            kind.as_str()
        );
    }
    assert!(doc.contains("`prefix_router.decision.<kind>`"));
    assert!(doc.contains("`prefix_router_decision_<kind>`"));
    for stat in &defined {
        assert!(
            doc.contains(&format!("`{stat}`")),
            "docs/metrics.md does not document {stat}"
        );
        assert!(
            doc.contains(&prometheus_name(stat)),
            "docs/metrics.md lacks the Prometheus name of {stat}"
        );
    }
    let decisions = prefix_router::metrics::DECISION_KINDS
        .iter()
        .map(|k| prefix_router::metrics::decision_counter_name(*k));
    let known: BTreeSet<String> = defined
        .iter()
        .cloned()
        .chain(decisions)
        .map(|s| prometheus_name(&s))
        .collect();
    // Envoy's own stats about the plugin (`envoy_wasm_<plugin>_vm_reload`) are
    // checked against a real scrape only.
    for name in dashboard_metric_names()
        .into_iter()
        .filter(|name| !name.starts_with("envoy_"))
    {
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .unwrap_or(&name);
        // A per-instance stat's prefix, matched by `__name__=~"<prefix>.+"`.
        let per_instance = format!("{base}<ip>_<port>");
        assert!(
            known.contains(base) || known.contains(&per_instance),
            "dashboards use {name}, which the filter does not define"
        );
    }
    let exprs = dashboard_panel_expressions();
    assert!(
        exprs
            .iter()
            .any(|e| e.contains("vllm:prefix_cache_hits_total")),
        "{exprs:?}"
    );
    assert!(
        exprs.iter().any(|e| e.contains("prefix_router_")),
        "{exprs:?}"
    );
}
