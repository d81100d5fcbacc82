//! The demo (`cargo xtask demo` calls [`run`]): 7 `vllm-sim` instances behind
//! Envoy with the filter, a short `long-shared-prefix` run under RANDOM and
//! then PREFIX_AWARE from cold caches, and the comparison table. Under 3
//! minutes after the build; it needs the `vllm-sim` binary (built with
//! `cargo build --release -p prefix-router-tools --bin vllm-sim`) and the .wasm.

use std::path::PathBuf;
use std::time::Duration;

use super::fleet::Strategy;
use super::peers::Peer;
use super::routing::{self, RoutingOptions, RoutingReport, WorkloadPlan};
use crate::loadgen::Api;

/// What the demo runs.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// The .wasm (default: the launcher's [`crate::envoy::wasm_path`]).
    pub wasm: Option<PathBuf>,
    /// The `vllm-sim` binary (default: [`super::fleet::find_sim_exe`]).
    pub sim_exe: Option<PathBuf>,
    /// Requests per strategy after the warm-up.
    pub requests: usize,
    pub warmup_requests: usize,
    /// Requests per simulated second.
    pub rate: f64,
    /// Simulated seconds per real second.
    pub time_scale: f64,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            wasm: None,
            sim_exe: None,
            requests: 400,
            // Covers ~95 % of the 100 groups, so the measured run sees warm caches.
            warmup_requests: 300,
            rate: 12.0,
            time_scale: 4.0,
        }
    }
}

/// The figures the demo printed.
pub struct DemoOutcome {
    pub report: RoutingReport,
    /// The markdown table.
    pub table: String,
    /// One line: hit rate and TTFT p50, RANDOM → PREFIX_AWARE.
    pub headline: String,
}

/// Runs the demo, printing progress and the table through `print`.
pub fn run(opts: &DemoOptions, print: &mut dyn FnMut(&str)) -> anyhow::Result<DemoOutcome> {
    let plan = WorkloadPlan::new(
        "long-shared-prefix",
        Api::Chat,
        opts.rate,
        opts.warmup_requests,
        opts.requests,
    )?;
    let routing_opts = RoutingOptions {
        quick: true,
        time_scale: opts.time_scale,
        plans: vec![plan],
        peers: Some(vec![
            Peer::Filter(Strategy::Random),
            Peer::Filter(Strategy::PrefixAware),
        ]),
        runs: 1,
        envoy_workers: 1,
        wasm: opts.wasm.clone(),
        sim_exe: opts.sim_exe.clone(),
        max_run: Duration::from_secs(60),
    };
    print(&format!(
        "demo: {} simulated vLLM instances (Llama 3.1 70B timings, time x{}), Envoy with the filter; \
         long-shared-prefix: 100 groups of ~8,000-token shared prefixes, 1,200-token questions, 256 output tokens",
        routing::INSTANCES,
        opts.time_scale
    ));
    let report = routing::run(&routing_opts, print)?;
    let strategies = report
        .workloads
        .first()
        .map(|w| w.strategies.clone())
        .unwrap_or_default();
    let table = routing::strategy_table(&strategies);
    let find = |s: Strategy| strategies.iter().find(|r| r.strategy == Peer::Filter(s));
    let headline = match (find(Strategy::Random), find(Strategy::PrefixAware)) {
        (Some(random), Some(prefix)) => format!(
            "KV-cache hit rate {:.0}% -> {:.0}%, TTFT p50 {:.0} ms -> {:.0} ms ({:+.0}%), {:.2} -> {:.2} req/s",
            random.hit_rate * 100.0,
            prefix.hit_rate * 100.0,
            random.ttft_p50_ms,
            prefix.ttft_p50_ms,
            if random.ttft_p50_ms > 0.0 {
                (prefix.ttft_p50_ms / random.ttft_p50_ms - 1.0) * 100.0
            } else {
                0.0
            },
            random.rps,
            prefix.rps
        ),
        _ => String::new(),
    };
    print("");
    print(&table);
    print(&format!("RANDOM -> PREFIX_AWARE: {headline}"));
    Ok(DemoOutcome {
        report,
        table,
        headline,
    })
}
