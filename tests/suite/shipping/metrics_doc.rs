//! docs/metrics.md names every stat the filter defines under its Envoy name,
//! and the dashboards read the vLLM series next to the filter's. (Their
//! Prometheus series are checked against a real scrape in
//! `tests/suite/shipping/prometheus.rs`.)

mod support;

use support::*;

#[test]
fn metrics_doc_names_every_stat_the_filter_defines() {
    let doc = read("docs/metrics.md");
    let mut defined: Vec<String> = prefix_router::metrics::Counter::ALL
        .iter()
        .map(|c| c.name().to_string())
        .collect();
    for stat in [
        prefix_router::metrics::BYTES_INSPECTED,
        prefix_router::metrics::MATCHED_BYTES,
        prefix_router::metrics::ADAPTER_SET_INSTANCES,
        prefix_router::metrics::INDEX_ENTRIES,
        prefix_router::metrics::INDEX_CAPACITY,
        prefix_router::metrics::INDEX_EVICTIONS,
    ] {
        defined.push(stat.to_string());
    }
    defined.extend(prefix_router::engine_load::documented_stat_names());
    defined.push(format!(
        "{}.adapter.<name>",
        prefix_router::metrics::ADAPTER_INSTANCES_PREFIX
    ));
    // Per-instance stats, documented as `<prefix>.endpoint.<ip>:<port>`.
    for name_of in [
        prefix_router::metrics::in_flight_gauge_name,
        prefix_router::metrics::placed_bytes_counter_name,
    ] {
        defined.push(name_of("<ip>:<port>"));
    }
    for counter in prefix_router::metrics::UsageCounter::ALL {
        defined.push(prefix_router::metrics::instance_stat_name(
            counter.prefix(),
            "<ip>:<port>",
        ));
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
    for stat in &defined {
        assert!(
            doc.contains(&format!("`{stat}`")),
            "docs/metrics.md does not document {stat}"
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
