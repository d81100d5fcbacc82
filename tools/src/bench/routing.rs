//! `bench routing`: routing quality against 7 simulated vLLM instances
//! through Envoy with the filter. For each workload the fleet starts with a
//! KV capacity sized to it; then RANDOM, LEAST_OUTSTANDING_REQUESTS and
//! PREFIX_AWARE run one after another, each from cold caches (every
//! instance's prefix cache is emptied with `POST /reset_prefix_cache`, and a
//! fresh Envoy starts with the strategy's configuration), a warm-up run that
//! is not measured, then the measured run. The hit rate comes from the
//! instances' `/metrics` counters (token-weighted, deltas over the measured
//! run); TTFT, throughput and shares from the load generator.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;

use super::fleet::{find_sim_exe, hit_rate_between, start_envoy, SimFleet, Strategy};
use super::load_average;
use crate::envoy::ENVOY_VERSION;
use crate::loadgen::{run_workload, Api, Arrival, Report, RunOptions, Workload};
use crate::sim::SimConfig;

/// Simulated instances.
pub const INSTANCES: usize = 7;

/// Shared prefixes are sized to this fraction of the fleet's KV cache.
pub const SHARED_FRACTION_OF_FLEET_CACHE: f64 = 0.65;

/// One workload as the benchmark runs it.
#[derive(Debug, Clone)]
pub struct WorkloadPlan {
    pub workload: Workload,
    pub api: Api,
    /// Poisson arrivals, requests per simulated second.
    pub rate: f64,
    /// Requests sent before measuring (caches warm up), per strategy.
    pub warmup_requests: usize,
    /// Requests measured, per strategy.
    pub requests: usize,
    /// KV blocks per instance.
    pub kv_blocks: usize,
}

impl WorkloadPlan {
    /// A plan for a workload by name, with the KV cache sized to it.
    pub fn new(
        name: &str,
        api: Api,
        rate: f64,
        warmup_requests: usize,
        requests: usize,
    ) -> anyhow::Result<Self> {
        let workload = Workload::by_name(name).with_context(|| format!("no workload {name}"))?;
        let kv_blocks = kv_blocks_for(&workload);
        Ok(WorkloadPlan {
            workload,
            api,
            rate,
            warmup_requests,
            requests,
            kv_blocks,
        })
    }

    /// The same plan with the workload's parameters changed (the KV cache is resized to it).
    pub fn with_workload(mut self, change: impl FnOnce(&mut Workload)) -> Self {
        change(&mut self.workload);
        self.kv_blocks = kv_blocks_for(&self.workload);
        self
    }

    pub fn label(&self) -> String {
        format!("{} ({})", self.workload.name(), self.api.name())
    }
}

/// Tokens a workload keeps reusing: its shared prefixes, or for multi-turn the
/// conversations' histories (the shared system prompt alone is tiny).
pub fn reused_tokens(workload: &Workload) -> usize {
    match *workload {
        Workload::MultiTurn {
            conversations,
            min_turns,
            max_turns,
            system_tokens,
            user_tokens,
            output_tokens,
        } => {
            let mean_turns = (min_turns + max_turns) / 2;
            system_tokens + conversations * mean_turns * (user_tokens + output_tokens)
        }
        // Nothing is shared: the same fleet as long-shared-prefix, so the control
        // runs on the same hardware.
        Workload::NoSharedPrefix { .. } => Workload::by_name("long-shared-prefix")
            .map(|w| w.shared_prefix_tokens())
            .unwrap_or_default(),
        _ => workload.shared_prefix_tokens(),
    }
}

/// KV blocks per instance so that the reused tokens fill
/// [`SHARED_FRACTION_OF_FLEET_CACHE`] of the fleet's cache (so they are
/// 1 / 0.65 / 7 ≈ 4.6 × one instance's cache).
pub fn kv_blocks_for(workload: &Workload) -> usize {
    let block_size = SimConfig::default().block_size;
    let fleet_tokens = reused_tokens(workload) as f64 / SHARED_FRACTION_OF_FLEET_CACHE;
    ((fleet_tokens / INSTANCES as f64) / block_size as f64).ceil() as usize
}

/// How the benchmark runs.
#[derive(Debug, Clone)]
pub struct RoutingOptions {
    pub quick: bool,
    /// Simulated seconds per real second.
    pub time_scale: f64,
    pub plans: Vec<WorkloadPlan>,
    pub strategies: Vec<Strategy>,
    pub envoy_workers: u32,
    pub wasm: Option<PathBuf>,
    /// The `vllm-sim` binary (default: [`find_sim_exe`]).
    pub sim_exe: Option<PathBuf>,
    /// Wall-clock bound of one run (warm-up or measured).
    pub max_run: Duration,
}

impl RoutingOptions {
    /// About 11 minutes on 2 cores.
    pub fn full() -> anyhow::Result<Self> {
        Ok(RoutingOptions {
            quick: false,
            time_scale: 4.0,
            plans: vec![
                WorkloadPlan::new("no-shared-prefix", Api::Chat, 20.0, 100, 1200)?,
                WorkloadPlan::new("long-shared-prefix", Api::Chat, 12.0, 500, 2000)?,
                WorkloadPlan::new("long-shared-prefix", Api::Invoke, 12.0, 500, 1200)?,
                WorkloadPlan::new("generated-shared-prefix", Api::Chat, 8.0, 200, 1200)?,
                WorkloadPlan::new("generated-shared-prefix-zipf", Api::Chat, 8.0, 200, 1200)?,
                WorkloadPlan::new("multi-turn", Api::Chat, 16.0, 600, 1500)?,
            ],
            strategies: Strategy::ALL.to_vec(),
            envoy_workers: 1,
            wasm: None,
            sim_exe: None,
            max_run: Duration::from_secs(180),
        })
    }

    /// Under 3 minutes: fewer requests, a faster clock.
    pub fn quick() -> anyhow::Result<Self> {
        Ok(RoutingOptions {
            quick: true,
            time_scale: 8.0,
            plans: vec![
                WorkloadPlan::new("no-shared-prefix", Api::Chat, 20.0, 50, 300)?,
                WorkloadPlan::new("long-shared-prefix", Api::Chat, 12.0, 300, 500)?,
                WorkloadPlan::new("generated-shared-prefix", Api::Chat, 8.0, 100, 300)?,
                WorkloadPlan::new("generated-shared-prefix-zipf", Api::Chat, 8.0, 100, 300)?,
                // 64 conversations instead of 256, so a short run sees their later turns.
                WorkloadPlan::new("multi-turn", Api::Chat, 16.0, 150, 400)?.with_workload(|w| {
                    if let Workload::MultiTurn { conversations, .. } = w {
                        *conversations = 64;
                    }
                }),
            ],
            max_run: Duration::from_secs(60),
            ..Self::full()?
        })
    }
}

/// One strategy's figures on one workload.
#[derive(Debug, Clone, Serialize)]
pub struct StrategyResult {
    pub strategy: Strategy,
    /// How the strategy was realised in this run.
    pub mechanism: &'static str,
    /// Token-weighted prefix-cache hit rate from the instances' `/metrics`.
    pub hit_rate: f64,
    /// The same from the responses' `usage.prompt_tokens_details.cached_tokens`.
    pub hit_rate_client: f64,
    /// Time to first token, simulated milliseconds.
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    /// Successful requests per simulated second.
    pub rps: f64,
    pub output_tokens_per_s: f64,
    /// Smallest and largest per-instance share of the requests.
    pub share_min: f64,
    pub share_max: f64,
    pub failures: usize,
    pub requests: usize,
    pub failure_kinds: std::collections::BTreeMap<String, usize>,
    /// Per-instance share of the requests.
    pub shares: std::collections::BTreeMap<String, f64>,
    /// Per-instance token-weighted hit rate (from `/metrics`): shows an
    /// instance whose cache is too small for the prefixes routed to it.
    pub instance_hit_rates: std::collections::BTreeMap<String, f64>,
    /// Distinct prefix groups (multi-turn: conversations) each instance
    /// served in the measured run: how evenly the keys are spread.
    pub groups_per_instance: std::collections::BTreeMap<String, usize>,
    /// Groups served by more than one instance in the measured run.
    pub groups_split: usize,
    pub latency_p50_ms: f64,
    /// Simulated seconds the measured run lasted.
    pub duration_s: f64,
    pub wall_s: f64,
}

/// One workload's results.
#[derive(Debug, Clone, Serialize)]
pub struct WorkloadResult {
    pub workload: String,
    pub api: String,
    pub rate_rps: f64,
    pub warmup_requests: usize,
    pub requests: usize,
    pub kv_blocks_per_instance: usize,
    pub reused_tokens: usize,
    /// Reused tokens over the fleet's KV capacity.
    pub reused_fraction_of_fleet_cache: f64,
    /// Reused tokens over one instance's KV capacity.
    pub reused_over_one_instance: f64,
    pub strategies: Vec<StrategyResult>,
}

/// The whole `routing.json`.
#[derive(Debug, Clone, Serialize)]
pub struct RoutingReport {
    pub benchmark: &'static str,
    pub quick: bool,
    pub envoy_version: &'static str,
    pub envoy_workers: u32,
    pub instances: usize,
    pub time_scale: f64,
    pub cold_start: &'static str,
    pub load_average_start: Option<[f64; 3]>,
    pub load_average_end: Option<[f64; 3]>,
    pub duration_s: f64,
    pub workloads: Vec<WorkloadResult>,
}

/// Runs every plan under every strategy; `progress` gets a line per step.
pub fn run(opts: &RoutingOptions, progress: &mut dyn FnMut(&str)) -> anyhow::Result<RoutingReport> {
    let started = Instant::now();
    let load_average_start = load_average();
    let sim_exe = match &opts.sim_exe {
        Some(exe) => exe.clone(),
        None => find_sim_exe()?,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the load generator runtime")?;
    let mut workloads = Vec::new();
    for plan in &opts.plans {
        let result = run_plan(&runtime, opts, plan, &sim_exe, progress)
            .with_context(|| format!("workload {}", plan.label()))?;
        workloads.push(result);
    }
    Ok(RoutingReport {
        benchmark: "routing",
        quick: opts.quick,
        envoy_version: ENVOY_VERSION,
        envoy_workers: opts.envoy_workers,
        instances: INSTANCES,
        time_scale: opts.time_scale,
        cold_start: "per strategy: POST /reset_prefix_cache on every instance, a fresh Envoy, \
                     then an unmeasured warm-up run",
        load_average_start,
        load_average_end: load_average(),
        duration_s: started.elapsed().as_secs_f64(),
        workloads,
    })
}

fn run_plan(
    runtime: &tokio::runtime::Runtime,
    opts: &RoutingOptions,
    plan: &WorkloadPlan,
    sim_exe: &std::path::Path,
    progress: &mut dyn FnMut(&str),
) -> anyhow::Result<WorkloadResult> {
    let template = SimConfig {
        kv_blocks: plan.kv_blocks,
        time_scale: opts.time_scale,
        ..SimConfig::default()
    };
    let reused = reused_tokens(&plan.workload);
    let instance_tokens = (plan.kv_blocks * template.block_size) as f64;
    progress(&format!(
        "{}: {} req/s (simulated), {} + {} requests per strategy, {} KV blocks per instance (reused tokens = {:.0}% of the fleet's cache, {:.1}x one instance's)",
        plan.label(),
        plan.rate,
        plan.warmup_requests,
        plan.requests,
        plan.kv_blocks,
        100.0 * reused as f64 / (instance_tokens * INSTANCES as f64),
        reused as f64 / instance_tokens
    ));
    let fleet = SimFleet::start(sim_exe, INSTANCES, &template)?;
    let mut strategies = Vec::new();
    for &strategy in &opts.strategies {
        let result = run_strategy(runtime, opts, plan, &fleet, strategy)
            .with_context(|| format!("strategy {}", strategy.name()))?;
        progress(&format!(
            "  {:<26} hit {:>5.1}%  TTFT p50 {:>6.0} p90 {:>6.0} p99 {:>6.0} ms  {:.2} req/s  share {:.1}-{:.1}%  groups/instance {}-{} (split {})  failures {}  ({:.0} s)",
            strategy.name(),
            result.hit_rate * 100.0,
            result.ttft_p50_ms,
            result.ttft_p90_ms,
            result.ttft_p99_ms,
            result.rps,
            result.share_min * 100.0,
            result.share_max * 100.0,
            result.groups_per_instance.values().min().unwrap_or(&0),
            result.groups_per_instance.values().max().unwrap_or(&0),
            result.groups_split,
            result.failures,
            result.wall_s
        ));
        strategies.push(result);
    }
    Ok(WorkloadResult {
        workload: plan.workload.name().to_string(),
        api: plan.api.name().to_string(),
        rate_rps: plan.rate,
        warmup_requests: plan.warmup_requests,
        requests: plan.requests,
        kv_blocks_per_instance: plan.kv_blocks,
        reused_tokens: reused,
        reused_fraction_of_fleet_cache: reused as f64 / (instance_tokens * INSTANCES as f64),
        reused_over_one_instance: reused as f64 / instance_tokens,
        strategies,
    })
}

fn run_strategy(
    runtime: &tokio::runtime::Runtime,
    opts: &RoutingOptions,
    plan: &WorkloadPlan,
    fleet: &SimFleet,
    strategy: Strategy,
) -> anyhow::Result<StrategyResult> {
    let started = Instant::now();
    runtime.block_on(fleet.reset_caches())?;
    let envoy = start_envoy(
        strategy,
        &fleet.addrs(),
        opts.wasm.as_deref(),
        opts.envoy_workers,
    )?;
    let url = envoy.base_url();
    let run_options = |seed: u64, requests: usize| RunOptions {
        api: plan.api,
        arrival: Arrival::Poisson { rate: plan.rate },
        max_requests: requests,
        max_duration: opts.max_run,
        request_timeout: Duration::from_secs(120),
        seed,
        time_scale: opts.time_scale,
        stream: true,
        instances: fleet.names(),
        ..RunOptions::default()
    };
    if plan.warmup_requests > 0 {
        runtime.block_on(run_workload(
            &url,
            &plan.workload,
            &run_options(1001, plan.warmup_requests),
        ))?;
    }
    let before = runtime.block_on(fleet.cache_counters())?;
    let report: Report = runtime.block_on(run_workload(
        &url,
        &plan.workload,
        &run_options(1, plan.requests),
    ))?;
    let after = runtime.block_on(fleet.cache_counters())?;
    drop(envoy);
    let (hit_rate, _) = hit_rate_between(&before, &after);
    let instance_hit_rates = fleet
        .names()
        .into_iter()
        .zip(after.iter().zip(&before))
        .map(|(name, (a, b))| (name, a.since(b).hit_rate()))
        .collect();
    Ok(StrategyResult {
        strategy,
        mechanism: strategy.mechanism(),
        hit_rate,
        hit_rate_client: report.hit_rate,
        ttft_p50_ms: report.ttft_p50_ms,
        ttft_p90_ms: report.ttft_p90_ms,
        ttft_p99_ms: report.ttft_p99_ms,
        rps: report.rps,
        output_tokens_per_s: report.output_tokens_per_s,
        share_min: report.share_min,
        share_max: report.share_max,
        failures: report.failures,
        requests: report.requests,
        failure_kinds: report.failure_kinds.clone(),
        shares: report
            .instances
            .iter()
            .map(|(name, share)| (name.clone(), share.share))
            .collect(),
        instance_hit_rates,
        groups_per_instance: report.groups_per_instance.clone(),
        groups_split: report.groups_split,
        latency_p50_ms: report.latency_p50_ms,
        duration_s: report.duration_s,
        wall_s: started.elapsed().as_secs_f64(),
    })
}

/// A markdown table per workload.
pub fn markdown(report: &RoutingReport) -> String {
    let mut out = String::new();
    for workload in &report.workloads {
        out.push_str(&format!(
            "\n**{} ({})**: {} req/s Poisson (simulated), {} measured requests per strategy after {} warm-up\n\n",
            workload.workload, workload.api, workload.rate_rps, workload.requests, workload.warmup_requests
        ));
        out.push_str(&strategy_table(&workload.strategies));
    }
    out
}

/// The table of one workload's strategies.
pub fn strategy_table(strategies: &[StrategyResult]) -> String {
    let mut out = String::new();
    out.push_str("| strategy | hit rate | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | req/s | output tok/s | share min–max | failures |\n");
    out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for s in strategies {
        let name = match s.strategy {
            Strategy::LeastOutstandingRequests => "LEAST_OUTSTANDING_REQUESTS¹".to_string(),
            other => other.name().to_string(),
        };
        out.push_str(&format!(
            "| {} | {:.1}% | {:.0} | {:.0} | {:.0} | {:.2} | {:.0} | {:.1}–{:.1}% | {} |\n",
            name,
            s.hit_rate * 100.0,
            s.ttft_p50_ms,
            s.ttft_p90_ms,
            s.ttft_p99_ms,
            s.rps,
            s.output_tokens_per_s,
            s.share_min * 100.0,
            s.share_max * 100.0,
            s.failures
        ));
    }
    if strategies
        .iter()
        .any(|s| s.strategy == Strategy::LeastOutstandingRequests)
    {
        out.push_str("\n¹ The filter routes to Envoy's least_request cluster (`selection_method: FULL_SCAN`).\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caches_are_sized_to_65_percent_and_over_4_instances() {
        for name in crate::loadgen::WORKLOAD_NAMES {
            let workload = Workload::by_name(name).unwrap();
            let blocks = kv_blocks_for(&workload);
            let instance = (blocks * SimConfig::default().block_size) as f64;
            let reused = reused_tokens(&workload) as f64;
            let fraction = reused / (instance * INSTANCES as f64);
            assert!((0.64..=0.65).contains(&fraction), "{name}: {fraction}");
            assert!(reused / instance > 4.0, "{name}");
        }
    }

    #[test]
    fn long_shared_prefix_gets_about_11k_blocks() {
        let workload = Workload::by_name("long-shared-prefix").unwrap();
        // 100 × 8,000 tokens / 0.65 / 7 / 16 = 10,990 blocks.
        assert_eq!(kv_blocks_for(&workload), 10_990);
    }
}
