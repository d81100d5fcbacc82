//! `bench routing`: routing quality against 7 simulated vLLM instances.
//! For each workload the fleet starts with a KV capacity sized to it; then
//! its arms run one after another on that fleet, each from cold caches
//! (every instance's prefix cache is emptied with `POST /reset_prefix_cache`,
//! and a fresh Envoy with the strategy's configuration, or a fresh SGLang
//! router, starts), a warm-up run that is not measured if the plan has one,
//! then the measured run. The arms ([`Peer`]) are the filter's strategies,
//! PREFIX_AWARE at its default matching (LONGEST_PREFIX) and fixed-prefix
//! matching at 4096 (the synthetic workloads' default), and for the
//! workloads on real data also fixed-prefix matching at 1024 and 16384,
//! SGLang's router and the oracle placement; `--peers` adds LONGEST_PREFIX
//! at other block sizes, two Envoy replicas, and the defaults with
//! `engine_load` through one Envoy or three. `runs` repeats every arm;
//! medians are reported. The hit rate comes from the instances' `/metrics`
//! counters (token-weighted, deltas over the measured run); TTFT,
//! throughput, shares and turn affinity from the load generator; the
//! filter's decision counts and engine polls from Envoy's `/stats` (deltas
//! over the measured run).
//!
//! The `lora` workload runs on instances with [`LORA_SLOTS`] adapter slots;
//! each arm also reports adapter loads per 1,000 requests (the instances'
//! `vllm_sim:lora_loads_total`, delta over the measured run) beside
//! [`adapter_loads_limit`] of the same requests, and the filter's adapter
//! decisions by reason (in the set, in a grown set, outside it).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;

use super::engine_load::poll_counts_of;
use super::fleet::{
    adapter_counts_of, counts_between, find_sim_exe, hit_rate_between, settled_decision_counts,
    start_envoy, usage_counts_of, SimFleet, Strategy,
};
use super::load_average;
use super::peers::{Peer, SglangRouter, DATA_PEERS, SYNTHETIC_PEERS};
use crate::envoy::ENVOY_VERSION;
use crate::loadgen::replay::ReplayGen;
use crate::loadgen::workload::{adapter_name, DEFAULT_SHARED_SEED};
use crate::loadgen::{run_workload, sharegpt, Api, Arrival, Corpus, Report, RunOptions, Workload};
use crate::sim::lora::LoraSlots;
use crate::sim::SimConfig;

/// Simulated instances.
pub const INSTANCES: usize = 7;

/// LoRA adapter slots per instance (`--max-loras`) for the `lora` workload.
pub const LORA_SLOTS: usize = 4;

/// Adapter loads of a placement that knows every adapter's popularity in
/// advance, for `adapters` (each request's adapter, in the order sent) over
/// `instances` instances of `slots` LRU slots each. Each adapter is placed,
/// hottest first, on the ceil(share × instances) least loaded instances (as
/// few as its share needs, so no instance is past its share from it) and
/// sends its requests to them in turn; each instance's slots are then
/// replayed on the requests it gets. Requests are taken one at a time (none
/// waits for a slot), so this is the loads of placement alone.
pub fn adapter_loads_limit(adapters: &[usize], instances: usize, slots: usize) -> u64 {
    let instances = instances.max(1);
    let mut counts: std::collections::BTreeMap<usize, usize> = Default::default();
    for &a in adapters {
        *counts.entry(a).or_default() += 1;
    }
    let total = adapters.len().max(1) as f64;
    let mut hottest_first: Vec<(usize, usize)> = counts.into_iter().collect();
    hottest_first.sort_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
    let mut load = vec![0.0f64; instances];
    let mut placement: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
    for (adapter, count) in hottest_first {
        let copies =
            ((count as f64 / total * instances as f64).ceil() as usize).clamp(1, instances);
        let mut order: Vec<usize> = (0..instances).collect();
        order.sort_by(|&x, &y| load[x].total_cmp(&load[y]).then(x.cmp(&y)));
        order.truncate(copies);
        for &i in &order {
            load[i] += count as f64 / copies as f64;
        }
        placement.insert(adapter, order);
    }
    let mut lru: Vec<LoraSlots> = (0..instances).map(|_| LoraSlots::new(slots)).collect();
    let mut turn: std::collections::BTreeMap<usize, usize> = Default::default();
    for &a in adapters {
        let targets = &placement[&a];
        let next = turn.entry(a).or_default();
        let instance = targets[*next % targets.len()];
        *next += 1;
        let name = a.to_string();
        lru[instance].acquire(&name);
        lru[instance].release(&name);
    }
    lru.iter().map(LoraSlots::loads).sum()
}

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
    /// KV blocks per instance from the workload's parameters; `run` sizes
    /// the workloads on real data to their text instead
    /// ([`reused_tokens_with`]).
    pub kv_blocks: usize,
    /// The arms it runs unless the options say otherwise.
    pub peers: Vec<Peer>,
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
        let mut peers = if workload.needs_corpus() {
            DATA_PEERS.to_vec()
        } else {
            SYNTHETIC_PEERS.to_vec()
        };
        if matches!(workload, Workload::Lora { .. }) {
            peers.push(Peer::Adapters);
        }
        Ok(WorkloadPlan {
            workload,
            api,
            rate,
            warmup_requests,
            requests,
            kv_blocks,
            peers,
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
    kv_blocks_for_tokens(reused_tokens(workload))
}

/// KV blocks per instance of [`INSTANCES`] so that `reused` tokens fill
/// [`SHARED_FRACTION_OF_FLEET_CACHE`] of the fleet's cache.
pub fn kv_blocks_for_tokens(reused: usize) -> usize {
    kv_blocks_over(reused, INSTANCES, SHARED_FRACTION_OF_FLEET_CACHE)
}

/// KV blocks per instance of `instances` so that `reused` tokens fill
/// `fraction` of the fleet's cache.
pub fn kv_blocks_over(reused: usize, instances: usize, fraction: f64) -> usize {
    let block_size = SimConfig::default().block_size;
    let fleet_tokens = reused as f64 / fraction;
    ((fleet_tokens / instances.max(1) as f64) / block_size as f64).ceil() as usize
}

/// [`reused_tokens`], for the workloads on real data from the text the
/// first measured run sends.
pub fn reused_tokens_with(workload: &Workload, corpus: Option<&Arc<Corpus>>) -> usize {
    match corpus {
        Some(corpus) if workload.needs_corpus() => ReplayGen::new(
            workload,
            Arc::clone(corpus),
            MEASURED_SEED,
            DEFAULT_SHARED_SEED,
        )
        .map(|g| g.reused_tokens())
        .unwrap_or_default(),
        _ => reused_tokens(workload),
    }
}

/// Seed of run 0's measured traffic (run `r` uses this + `r`).
const MEASURED_SEED: u64 = 1;
/// Seed of run 0's warm-up traffic.
const WARMUP_SEED: u64 = 1001;

/// How the benchmark runs.
#[derive(Debug, Clone)]
pub struct RoutingOptions {
    pub quick: bool,
    /// Simulated seconds per real second.
    pub time_scale: f64,
    pub plans: Vec<WorkloadPlan>,
    /// The arms to run on every plan instead of each plan's own.
    pub peers: Option<Vec<Peer>>,
    /// Repetitions (seeds 1.., every arm per repetition); medians are reported.
    pub runs: usize,
    pub envoy_workers: u32,
    pub wasm: Option<PathBuf>,
    /// The .wasm of the [`Peer::Baseline`] arms.
    pub baseline_wasm: Option<PathBuf>,
    /// The `vllm-sim` binary (default: [`find_sim_exe`]).
    pub sim_exe: Option<PathBuf>,
    /// Wall-clock bound of one run (warm-up or measured).
    pub max_run: Duration,
    /// Simulated instances in the fleet ([`INSTANCES`] unless told); the
    /// fleet's KV cache stays the same size, split over them.
    pub instances: usize,
    /// The fraction of the fleet's KV cache the reused tokens fill
    /// ([`SHARED_FRACTION_OF_FLEET_CACHE`] unless told).
    pub reused_fraction: f64,
    /// Restart the first instance this long into each measured run.
    pub restart_after: Option<Duration>,
}

impl RoutingOptions {
    /// The synthetic workloads (about 11 minutes a repetition on 2 cores) and
    /// the real-data ones (about 20 minutes a repetition with every peer,
    /// before `lora`'s arms), 3 repetitions.
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
                // Rates in conversations per simulated second; turns capped at 2,000.
                WorkloadPlan::new("sharegpt", Api::Chat, 2.0, 0, 2000)?,
                WorkloadPlan::new("sharegpt-system", Api::Chat, 2.0, 0, 2000)?,
                // 100 documents x 5 questions, every pair once.
                WorkloadPlan::new("rag", Api::Chat, 4.0, 0, 500)?.with_workload(|w| {
                    if let Workload::Rag { documents, .. } = w {
                        *documents = 100;
                    }
                }),
                WorkloadPlan::new("lora", Api::Chat, 2.0, 0, 2000)?,
                WorkloadPlan::new("lora-no-system", Api::Chat, 2.0, 0, 2000)?,
            ],
            peers: None,
            runs: 3,
            envoy_workers: 1,
            wasm: None,
            baseline_wasm: None,
            sim_exe: None,
            max_run: Duration::from_secs(180),
            instances: INSTANCES,
            reused_fraction: SHARED_FRACTION_OF_FLEET_CACHE,
            restart_after: None,
        })
    }

    /// Under 3 minutes for the synthetic workloads, under 10 for sharegpt,
    /// sharegpt-system and rag with every peer, about half a minute per arm
    /// for lora: fewer requests, a faster clock, one run.
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
                WorkloadPlan::new("sharegpt", Api::Chat, 2.0, 0, 1000)?
                    .with_workload(|w| set_conversations(w, 100)),
                WorkloadPlan::new("sharegpt-system", Api::Chat, 2.0, 0, 1000)?
                    .with_workload(|w| set_conversations(w, 100)),
                // 40 documents x 5 questions.
                WorkloadPlan::new("rag", Api::Chat, 4.0, 0, 200)?.with_workload(|w| {
                    if let Workload::Rag { documents, .. } = w {
                        *documents = 40;
                    }
                }),
                WorkloadPlan::new("lora", Api::Chat, 2.0, 0, 1000)?
                    .with_workload(|w| set_conversations(w, 100)),
                WorkloadPlan::new("lora-no-system", Api::Chat, 2.0, 0, 1000)?
                    .with_workload(|w| set_conversations(w, 100)),
            ],
            runs: 1,
            max_run: Duration::from_secs(60),
            ..Self::full()?
        })
    }
}

fn set_conversations(workload: &mut Workload, count: usize) {
    if let Workload::ShareGpt { conversations, .. } | Workload::Lora { conversations, .. } =
        workload
    {
        *conversations = count;
    }
}

/// One arm's figures on one workload (medians over the runs).
#[derive(Debug, Clone, Serialize)]
pub struct StrategyResult {
    /// The arm: a filter strategy (as the existing reports name it), a
    /// fixed-prefix length, SGLang's router or the oracle.
    pub strategy: Peer,
    /// How the arm was realised in this run.
    pub mechanism: String,
    /// Token-weighted prefix-cache hit rate from the instances' `/metrics`.
    pub hit_rate: f64,
    /// `hit_rate` over the oracle's in the same run (median of the runs'), if the oracle ran.
    pub hit_rate_of_oracle: Option<f64>,
    /// Each run's `hit_rate`.
    pub hit_rate_runs: Vec<f64>,
    /// The same from the responses' `usage.prompt_tokens_details.cached_tokens`.
    pub hit_rate_client: f64,
    /// Time to first token, simulated milliseconds.
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    /// Each run's `ttft_p90_ms`.
    pub ttft_p90_runs: Vec<f64>,
    /// LoRA adapters made resident per 1,000 requests (workloads with adapters).
    pub adapter_loads_per_1000: Option<f64>,
    /// [`adapter_loads_limit`] of the same requests, per 1,000.
    pub adapter_loads_limit_per_1000: Option<f64>,
    /// Successful requests per simulated second.
    pub rps: f64,
    pub output_tokens_per_s: f64,
    /// Smallest and largest per-instance share of the requests.
    pub share_min: f64,
    pub share_max: f64,
    /// Conversation turns served by the previous turn's instance (conversations only).
    pub turns_on_previous_instance: Option<f64>,
    pub failures: usize,
    pub requests: usize,
    /// The maps below are the median-hit-rate run's.
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
    /// The filter's decisions in the measured run by kind (its
    /// `prefix_router.decision.*` counters on Envoy's `/stats`, summed over
    /// the arm's Envoys); empty for arms without Envoy.
    pub decisions: std::collections::BTreeMap<String, u64>,
    /// The filter's LoRA decisions in the measured run by reason (in_set,
    /// set_grown, outside_set: `prefix_router.adapter.*`, summed over the
    /// arm's Envoys); empty without `adapters`.
    pub adapter_decisions: std::collections::BTreeMap<String, u64>,
    /// The engine poller's counters in the measured run (polls sent,
    /// skipped, failures by reason; `prefix_router.engine.poll*` on
    /// `/stats`, summed over the arm's Envoys); empty without `engine_load`.
    pub engine_polls: std::collections::BTreeMap<String, u64>,
    /// The filter's `prefix_router.usage.*` counters over the measured run,
    /// summed over instances and Envoys (responses read, with usage, with
    /// `cached_tokens`, index misses...); empty without the filter.
    pub filter_usage: std::collections::BTreeMap<String, u64>,
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
    /// Poisson arrivals per simulated second, of `arrivals`.
    pub rate_rps: f64,
    /// `requests`, or `conversations` for conversation replays.
    pub arrivals: &'static str,
    pub warmup_requests: usize,
    pub requests: usize,
    /// Repetitions the figures are medians of.
    pub runs: usize,
    /// The workload's parameters.
    pub parameters: Workload,
    pub kv_blocks_per_instance: usize,
    pub reused_tokens: usize,
    /// Reused tokens over the fleet's KV capacity.
    pub reused_fraction_of_fleet_cache: f64,
    /// Reused tokens over one instance's KV capacity.
    pub reused_over_one_instance: f64,
    /// The oracle's hit rate (median), if it ran.
    pub oracle_hit_rate: Option<f64>,
    pub strategies: Vec<StrategyResult>,
}

/// What was read from the ShareGPT data.
#[derive(Debug, Clone, Serialize)]
pub struct CorpusInfo {
    pub source: String,
    pub conversations_parsed: usize,
    pub conversations_kept: usize,
    pub documents: usize,
}

/// The whole `routing.json`.
#[derive(Debug, Clone, Serialize)]
pub struct RoutingReport {
    pub benchmark: &'static str,
    pub quick: bool,
    pub envoy_version: &'static str,
    pub envoy_workers: u32,
    pub instances: usize,
    /// The fraction of the fleet's KV cache the reused tokens were sized to.
    pub reused_fraction: f64,
    /// Seconds into each measured run the first instance was restarted.
    pub restart_after_s: Option<f64>,
    pub time_scale: f64,
    pub runs: usize,
    pub cold_start: &'static str,
    pub corpus: Option<CorpusInfo>,
    pub load_average_start: Option<[f64; 3]>,
    pub load_average_end: Option<[f64; 3]>,
    pub duration_s: f64,
    pub workloads: Vec<WorkloadResult>,
}

/// Runs every plan under every arm; `progress` gets a line per step.
pub fn run(opts: &RoutingOptions, progress: &mut dyn FnMut(&str)) -> anyhow::Result<RoutingReport> {
    let started = Instant::now();
    let load_average_start = load_average();
    let sim_exe = match &opts.sim_exe {
        Some(exe) => exe.clone(),
        None => find_sim_exe()?,
    };
    let corpus = if opts.plans.iter().any(|p| p.workload.needs_corpus()) {
        let corpus = sharegpt::load()?;
        progress(&format!(
            "ShareGPT V3 ({}): {} whole conversations, {} kept (alternating, no empty value), {} documents of {}-{} characters",
            sharegpt::REQUIREMENT,
            corpus.parsed,
            corpus.conversations.len(),
            corpus.documents.len(),
            sharegpt::DOCUMENT_CHARS.0,
            sharegpt::DOCUMENT_CHARS.1
        ));
        Some(corpus)
    } else {
        None
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the load generator runtime")?;
    let mut workloads = Vec::new();
    for plan in &opts.plans {
        let result = run_plan(&runtime, opts, plan, &sim_exe, corpus.as_ref(), progress)
            .with_context(|| format!("workload {}", plan.label()))?;
        workloads.push(result);
    }
    Ok(RoutingReport {
        benchmark: "routing",
        quick: opts.quick,
        envoy_version: ENVOY_VERSION,
        envoy_workers: opts.envoy_workers,
        instances: opts.instances,
        reused_fraction: opts.reused_fraction,
        restart_after_s: opts.restart_after.map(|d| d.as_secs_f64()),
        time_scale: opts.time_scale,
        runs: opts.runs.max(1),
        cold_start: "per arm and run: POST /reset_prefix_cache on every instance, a fresh Envoy \
                     (or SGLang router), then an unmeasured warm-up run if the plan has one",
        corpus: corpus.map(|c| CorpusInfo {
            source: format!("{} ({})", sharegpt::REQUIREMENT, sharegpt::DATA_FILE),
            conversations_parsed: c.parsed,
            conversations_kept: c.conversations.len(),
            documents: c.documents.len(),
        }),
        load_average_start,
        load_average_end: load_average(),
        duration_s: started.elapsed().as_secs_f64(),
        workloads,
    })
}

/// The arms a plan runs: the options' or the plan's own, without SGLang's
/// router on the invoke API (it has no such route).
fn peers_of(opts: &RoutingOptions, plan: &WorkloadPlan) -> Vec<Peer> {
    opts.peers
        .clone()
        .unwrap_or_else(|| plan.peers.clone())
        .into_iter()
        .filter(|&p| !(p == Peer::SglangCacheAware && plan.api == Api::Invoke))
        .collect()
}

fn run_plan(
    runtime: &tokio::runtime::Runtime,
    opts: &RoutingOptions,
    plan: &WorkloadPlan,
    sim_exe: &std::path::Path,
    corpus: Option<&Arc<Corpus>>,
    progress: &mut dyn FnMut(&str),
) -> anyhow::Result<WorkloadResult> {
    let reused = reused_tokens_with(&plan.workload, corpus);
    let kv_blocks = kv_blocks_over(reused, opts.instances, opts.reused_fraction);
    let template = sim_template(&plan.workload, kv_blocks, opts.time_scale);
    let instance_tokens = (kv_blocks * template.block_size) as f64;
    let arrivals = if plan.workload.is_conversation_replay() {
        "conversations"
    } else {
        "requests"
    };
    progress(&format!(
        "{}: {} {arrivals}/s (simulated), {} + {} requests per arm, {} run(s), {} KV blocks per instance (reused tokens = {:.0}% of the fleet's cache, {:.1}x one instance's)",
        plan.label(),
        plan.rate,
        plan.warmup_requests,
        plan.requests,
        opts.runs.max(1),
        kv_blocks,
        100.0 * reused as f64 / (instance_tokens * opts.instances as f64),
        reused as f64 / instance_tokens
    ));
    let peers = peers_of(opts, plan);
    let mut per_peer: Vec<Vec<StrategyResult>> = vec![Vec::new(); peers.len()];
    for run in 0..opts.runs.max(1) {
        // A fleet per run: its instances' ports are new, so each run also
        // samples where rendezvous hashing (which hashes the addresses)
        // places the workload's groups; every arm of the run shares it.
        let fleet = SimFleet::start(sim_exe, opts.instances, &template)?;
        let mut this_run = Vec::with_capacity(peers.len());
        for &peer in &peers {
            let result = run_peer(runtime, opts, plan, &fleet, peer, run as u64, corpus)
                .with_context(|| format!("{} (run {})", peer.name(), run + 1))?;
            progress(&format!(
                "  {:<34} hit {:>5.1}%  TTFT p50 {:>6.0} p90 {:>6.0} ms  {:.2} req/s  share {:.1}-{:.1}%{}{}{}  failures {}  ({:.0} s)",
                peer.name(),
                result.hit_rate * 100.0,
                result.ttft_p50_ms,
                result.ttft_p90_ms,
                result.rps,
                result.share_min * 100.0,
                result.share_max * 100.0,
                result
                    .turns_on_previous_instance
                    .map(|t| format!("  same instance as previous turn {:.0}%", t * 100.0))
                    .unwrap_or_default(),
                result
                    .adapter_loads_per_1000
                    .zip(result.adapter_loads_limit_per_1000)
                    .map(|(l, limit)| format!("  adapter loads {l:.1} per 1,000 (limit {limit:.1})"))
                    .unwrap_or_default(),
                result
                    .filter_usage
                    .get("reported_cached")
                    .map(|with| format!(
                        "  index misses {} of {with} with cached_tokens",
                        result.filter_usage.get("index_misses").unwrap_or(&0)
                    ))
                    .unwrap_or_default(),
                result.failures,
                result.wall_s
            ));
            this_run.push(result);
        }
        // Each arm against the oracle of the same run (same traffic, same machine state).
        let oracle = peers
            .iter()
            .position(|&p| p == Peer::Oracle)
            .map(|i| this_run[i].hit_rate);
        for (i, mut result) in this_run.into_iter().enumerate() {
            result.hit_rate_of_oracle = oracle.filter(|&o| o > 0.0).map(|o| result.hit_rate / o);
            per_peer[i].push(result);
        }
    }
    let strategies: Vec<StrategyResult> = per_peer.into_iter().map(median_result).collect();
    let oracle_hit_rate = strategies
        .iter()
        .find(|s| s.strategy == Peer::Oracle)
        .map(|s| s.hit_rate);
    Ok(WorkloadResult {
        workload: plan.workload.name().to_string(),
        api: plan.api.name().to_string(),
        rate_rps: plan.rate,
        arrivals,
        warmup_requests: plan.warmup_requests,
        requests: plan.requests,
        runs: opts.runs.max(1),
        parameters: plan.workload.clone(),
        kv_blocks_per_instance: kv_blocks,
        reused_tokens: reused,
        reused_fraction_of_fleet_cache: reused as f64 / (instance_tokens * opts.instances as f64),
        reused_over_one_instance: reused as f64 / instance_tokens,
        oracle_hit_rate,
        strategies,
    })
}

/// The instances' configuration for `workload`: with [`LORA_SLOTS`] slots
/// and every adapter served for `lora`, the base model alone otherwise.
fn sim_template(workload: &Workload, kv_blocks: usize, time_scale: f64) -> SimConfig {
    let (max_loras, lora_modules) = match *workload {
        Workload::Lora { adapters, .. } => (
            LORA_SLOTS,
            (0..adapters)
                .map(|a| (adapter_name(a), format!("/adapters/{}", adapter_name(a))))
                .collect(),
        ),
        _ => (0, Vec::new()),
    };
    SimConfig {
        kv_blocks,
        time_scale,
        max_loras,
        lora_modules,
        // As the engines the filter learns from run.
        prompt_tokens_details: true,
        ..SimConfig::default()
    }
}

/// The median of each figure over the runs; the maps from the run whose hit
/// rate is the median.
fn median_result(mut runs: Vec<StrategyResult>) -> StrategyResult {
    let hit_rate_runs: Vec<f64> = runs.iter().map(|r| r.hit_rate).collect();
    let median = |f: &dyn Fn(&StrategyResult) -> f64| {
        let values: Vec<f64> = runs.iter().map(f).collect();
        median_of(values).unwrap_or_default()
    };
    let optional_median =
        |f: &dyn Fn(&StrategyResult) -> Option<f64>| median_of(runs.iter().filter_map(f).collect());
    let mut out = StrategyResult {
        hit_rate: median(&|r| r.hit_rate),
        hit_rate_of_oracle: optional_median(&|r| r.hit_rate_of_oracle),
        hit_rate_client: median(&|r| r.hit_rate_client),
        ttft_p50_ms: median(&|r| r.ttft_p50_ms),
        ttft_p90_ms: median(&|r| r.ttft_p90_ms),
        ttft_p99_ms: median(&|r| r.ttft_p99_ms),
        ttft_p90_runs: runs.iter().map(|r| r.ttft_p90_ms).collect(),
        adapter_loads_per_1000: optional_median(&|r| r.adapter_loads_per_1000),
        adapter_loads_limit_per_1000: optional_median(&|r| r.adapter_loads_limit_per_1000),
        rps: median(&|r| r.rps),
        output_tokens_per_s: median(&|r| r.output_tokens_per_s),
        share_min: median(&|r| r.share_min),
        share_max: median(&|r| r.share_max),
        turns_on_previous_instance: optional_median(&|r| r.turns_on_previous_instance),
        failures: median(&|r| r.failures as f64).round() as usize,
        requests: median(&|r| r.requests as f64).round() as usize,
        latency_p50_ms: median(&|r| r.latency_p50_ms),
        duration_s: median(&|r| r.duration_s),
        wall_s: runs.iter().map(|r| r.wall_s).sum(),
        hit_rate_runs,
        ..runs[0].clone()
    };
    runs.sort_by(|a, b| a.hit_rate.total_cmp(&b.hit_rate));
    let middle = &runs[(runs.len() - 1) / 2];
    out.failure_kinds = middle.failure_kinds.clone();
    out.shares = middle.shares.clone();
    out.instance_hit_rates = middle.instance_hit_rates.clone();
    out.groups_per_instance = middle.groups_per_instance.clone();
    out.groups_split = middle.groups_split;
    out.decisions = middle.decisions.clone();
    out.adapter_decisions = middle.adapter_decisions.clone();
    out.engine_polls = middle.engine_polls.clone();
    out.filter_usage = middle.filter_usage.clone();
    out
}

/// The median (the mean of the middle two for an even count); None for none.
fn median_of(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let n = values.len();
    Some(if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    })
}

/// What an arm's requests go through while it runs (stopped when dropped).
enum Front {
    /// One Envoy, or replicas the load generator alternates between.
    Envoys(Vec<crate::envoy::Envoy>),
    Sglang(SglangRouter),
    Direct,
}

fn run_peer(
    runtime: &tokio::runtime::Runtime,
    opts: &RoutingOptions,
    plan: &WorkloadPlan,
    fleet: &SimFleet,
    peer: Peer,
    run: u64,
    corpus: Option<&Arc<Corpus>>,
) -> anyhow::Result<StrategyResult> {
    let started = Instant::now();
    runtime.block_on(fleet.reset_caches())?;
    let wasm = match peer {
        Peer::Baseline(_) => Some(
            opts.baseline_wasm
                .as_deref()
                .context("a baseline arm needs --baseline-wasm")?,
        ),
        _ => opts.wasm.as_deref(),
    };
    let front = match peer.plugin_config(&fleet.addrs()) {
        Some(config) => Front::Envoys(
            (0..peer.envoys())
                .map(|_| start_envoy(&config, &fleet.addrs(), wasm, opts.envoy_workers))
                .collect::<anyhow::Result<_>>()?,
        ),
        None if peer == Peer::SglangCacheAware => Front::Sglang(SglangRouter::start(
            &fleet.addrs(),
            &super::output_dir().join("sglang-router.log"),
            SGLANG_READY_WITHIN,
        )?),
        None => Front::Direct,
    };
    let direct: Vec<String> = fleet
        .addrs()
        .iter()
        .map(|a| format!("http://{a}"))
        .collect();
    let envoy_urls: Vec<String> = match &front {
        Front::Envoys(envoys) => envoys.iter().map(|e| e.base_url()).collect(),
        _ => Vec::new(),
    };
    let url = match &front {
        Front::Envoys(_) => envoy_urls.first().cloned().unwrap_or_default(),
        Front::Sglang(router) => router.base_url(),
        Front::Direct => direct[0].clone(),
    };
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
        corpus: corpus.cloned(),
        pinned_targets: if matches!(front, Front::Direct) {
            direct.clone()
        } else {
            Vec::new()
        },
        alternate_targets: if envoy_urls.len() > 1 {
            envoy_urls.clone()
        } else {
            Vec::new()
        },
        ..RunOptions::default()
    };
    let mut sent = 0;
    if plan.warmup_requests > 0 {
        sent += runtime
            .block_on(run_workload(
                &url,
                &plan.workload,
                &run_options(WARMUP_SEED + run, plan.warmup_requests),
            ))?
            .requests;
    }
    let decisions = |sent: usize| match &front {
        Front::Envoys(envoys) => settled_decision_counts(envoys, sent, DECISIONS_SETTLE_WITHIN),
        _ => Default::default(),
    };
    // The filter's counters of one kind, summed over the arm's Envoys.
    let counters =
        |of: fn(&[crate::envoy::Envoy]) -> std::collections::BTreeMap<String, u64>| match &front {
            Front::Envoys(envoys) => of(envoys),
            _ => Default::default(),
        };
    let decisions_before = decisions(sent);
    let polls_before = counters(poll_counts_of);
    let usage_before = counters(usage_counts_of);
    let adapters_before = counters(adapter_counts_of);
    let with_adapters = matches!(plan.workload, Workload::Lora { .. });
    let before = runtime.block_on(fleet.cache_counters())?;
    let loads_before = runtime.block_on(fleet.lora_loads())?;
    let measured = RunOptions {
        keep_records: with_adapters,
        ..run_options(MEASURED_SEED + run, plan.requests)
    };
    let report: Report = std::thread::scope(|scope| {
        let (done, finished) = std::sync::mpsc::channel::<()>();
        if let Some(after) = opts.restart_after {
            scope.spawn(move || {
                // Unless the run ends first.
                if finished.recv_timeout(after).is_err() {
                    if let Err(error) = fleet.restart(0) {
                        eprintln!("restarting the first instance: {error:#}");
                    }
                }
            });
        }
        let report = runtime.block_on(run_workload(&url, &plan.workload, &measured));
        let _ = done.send(());
        report
    })?;
    let after = runtime.block_on(fleet.cache_counters())?;
    let loads = runtime.block_on(fleet.lora_loads())? - loads_before;
    let (adapter_loads_per_1000, adapter_loads_limit_per_1000) = if with_adapters {
        let mut sent_in_order: Vec<_> = report.records.iter().filter(|r| r.ok).collect();
        sent_in_order.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
        let adapters: Vec<usize> = sent_in_order.iter().filter_map(|r| r.group).collect();
        let per_1000 = |n: f64| n * 1000.0 / adapters.len().max(1) as f64;
        (
            Some(per_1000(loads)),
            Some(per_1000(
                adapter_loads_limit(&adapters, opts.instances, LORA_SLOTS) as f64,
            )),
        )
    } else {
        (None, None)
    };
    sent += report.requests;
    let decisions = counts_between(&decisions_before, &decisions(sent));
    let engine_polls = counts_between(&polls_before, &counters(poll_counts_of));
    let filter_usage = counts_between(&usage_before, &counters(usage_counts_of));
    // Read after the decisions settled: the filter flushes both on one tick.
    let adapter_decisions = counts_between(&adapters_before, &counters(adapter_counts_of));
    drop(front);
    let (hit_rate, _) = hit_rate_between(&before, &after);
    let instance_hit_rates = fleet
        .names()
        .into_iter()
        .zip(after.iter().zip(&before))
        .map(|(name, (a, b))| (name, a.since(b).hit_rate()))
        .collect();
    Ok(StrategyResult {
        strategy: peer,
        mechanism: peer.mechanism(),
        hit_rate,
        hit_rate_of_oracle: None,
        hit_rate_runs: vec![hit_rate],
        hit_rate_client: report.hit_rate,
        ttft_p50_ms: report.ttft_p50_ms,
        ttft_p90_ms: report.ttft_p90_ms,
        ttft_p99_ms: report.ttft_p99_ms,
        ttft_p90_runs: vec![report.ttft_p90_ms],
        adapter_loads_per_1000,
        adapter_loads_limit_per_1000,
        rps: report.rps,
        output_tokens_per_s: report.output_tokens_per_s,
        share_min: report.share_min,
        share_max: report.share_max,
        turns_on_previous_instance: report.turns_on_previous_instance,
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
        decisions,
        adapter_decisions,
        engine_polls,
        filter_usage,
        latency_p50_ms: report.latency_p50_ms,
        duration_s: report.duration_s,
        wall_s: started.elapsed().as_secs_f64(),
    })
}

/// How long the filter's decision counts may take to cover the requests sent
/// (it flushes them every second).
const DECISIONS_SETTLE_WITHIN: Duration = Duration::from_secs(3);

/// How long SGLang's router may take to report the fleet healthy.
const SGLANG_READY_WITHIN: Duration = Duration::from_secs(60);

/// A markdown table per workload.
pub fn markdown(report: &RoutingReport) -> String {
    let mut out = String::new();
    for workload in &report.workloads {
        let arms = if workload.runs > 1 {
            format!("per arm, medians of {} runs", workload.runs)
        } else {
            "per arm".to_string()
        };
        // Conversation replays end when their conversations do, before the cap.
        let sent = workload
            .strategies
            .iter()
            .map(|s| s.requests)
            .max()
            .unwrap_or(0);
        let measured = if sent < workload.requests {
            format!("{sent} (at most {})", workload.requests)
        } else {
            workload.requests.to_string()
        };
        out.push_str(&format!(
            "\n**{} ({})**: {} {}/s Poisson (simulated), {measured} measured requests {arms} after {} warm-up\n\n",
            workload.workload,
            workload.api,
            workload.rate_rps,
            if workload.arrivals == "requests" { "req" } else { workload.arrivals },
            workload.warmup_requests
        ));
        let peers_table = workload.oracle_hit_rate.is_some()
            || workload
                .strategies
                .iter()
                .any(|s| matches!(s.strategy, Peer::SglangCacheAware | Peer::Oracle));
        if peers_table {
            out.push_str(&peer_table(&workload.strategies));
        } else {
            out.push_str(&strategy_table(&workload.strategies));
        }
        out.push_str(&adapter_load_lines(&workload.strategies));
        out.push_str(&decision_lines(&workload.strategies));
        out.push_str(&engine_poll_lines(&workload.strategies));
        out.push_str(&replica_lines(&workload.strategies));
    }
    out
}

/// Counts as "name count, name count".
fn counts_listed(counts: &std::collections::BTreeMap<String, u64>) -> String {
    let listed: Vec<String> = counts
        .iter()
        .map(|(name, count)| format!("{name} {count}"))
        .collect();
    listed.join(", ")
}

/// The engine poller's counters per arm that has any, one line each.
pub fn engine_poll_lines(strategies: &[StrategyResult]) -> String {
    let polled: Vec<&StrategyResult> = strategies
        .iter()
        .filter(|s| !s.engine_polls.is_empty())
        .collect();
    let expected: Vec<&StrategyResult> = strategies
        .iter()
        .filter(|s| {
            matches!(
                s.strategy,
                Peer::PrefixAwareEngine
                    | Peer::Replicated {
                        arm: Peer::PrefixAwareEngine,
                        ..
                    }
            )
        })
        .collect();
    if polled.is_empty() && expected.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "\nEngine polls in the measured run (Envoy `/stats`, `prefix_router.engine.poll*`):\n\n",
    );
    for s in expected.iter().filter(|s| s.engine_polls.is_empty()) {
        out.push_str(&format!(
            "- {}: none counted (this .wasm has no poller, or it never polled)\n",
            s.strategy.name()
        ));
    }
    for s in polled {
        out.push_str(&format!(
            "- {}: {}\n",
            s.strategy.name(),
            counts_listed(&s.engine_polls)
        ));
    }
    out
}

/// Three Envoys with engine load against one, and against three without
/// it, for the pairs that ran: TTFT p90 and hit rate, the ratio of the
/// medians and each run's.
pub fn replica_lines(strategies: &[StrategyResult]) -> String {
    let find = |peer: Peer| strategies.iter().find(|s| s.strategy == peer);
    let through_three = |arm: &'static Peer| find(Peer::Replicated { arm, envoys: 3 });
    let engine_one = find(Peer::PrefixAwareEngine);
    let engine_three = through_three(&Peer::PrefixAwareEngine);
    let default_three = through_three(&Peer::Filter(Strategy::PrefixAware));
    let mut out = String::new();
    if let (Some(one), Some(three)) = (engine_one, engine_three) {
        out.push_str(&compare(
            "3 Envoys over 1, both with engine load",
            three,
            one,
        ));
    }
    if let (Some(without), Some(with)) = (default_three, engine_three) {
        out.push_str(&compare(
            "3 Envoys with engine load over 3 without",
            with,
            without,
        ));
    }
    out
}

/// `label`: `a`'s TTFT p90 over `b`'s (medians, each run's) and hit rates.
fn compare(label: &str, a: &StrategyResult, b: &StrategyResult) -> String {
    let ratio = |x: f64, y: f64| if y > 0.0 { x / y } else { f64::NAN };
    let per_run: Vec<String> = a
        .ttft_p90_runs
        .iter()
        .zip(&b.ttft_p90_runs)
        .map(|(x, y)| format!("{:.2}", ratio(*x, *y)))
        .collect();
    format!(
        "\n{label}: TTFT p90 x{:.2} (medians; per run: {}), hit rate {:.1}% vs {:.1}% ({:+.1} points)\n",
        ratio(a.ttft_p90_ms, b.ttft_p90_ms),
        per_run.join(", "),
        a.hit_rate * 100.0,
        b.hit_rate * 100.0,
        (a.hit_rate - b.hit_rate) * 100.0
    )
}

/// The filter's decisions per arm through Envoy, one line each (nothing if
/// no arm counted any).
pub fn decision_lines(strategies: &[StrategyResult]) -> String {
    let counted: Vec<&StrategyResult> = strategies
        .iter()
        .filter(|s| !s.decisions.is_empty())
        .collect();
    if counted.is_empty() {
        return String::new();
    }
    let mut out =
        String::from("\nThe filter's decisions in the measured run (Envoy `/stats`):\n\n");
    for s in counted {
        let adapters = if s.adapter_decisions.is_empty() {
            String::new()
        } else {
            format!("; adapters: {}", counts_listed(&s.adapter_decisions))
        };
        out.push_str(&format!(
            "- {}: {}{adapters}\n",
            s.strategy.name(),
            counts_listed(&s.decisions)
        ));
    }
    out
}

/// Adapter loads per arm, beside the limit of its requests and its shares.
pub fn adapter_load_lines(strategies: &[StrategyResult]) -> String {
    let mut out = String::new();
    for s in strategies {
        let (Some(loads), Some(limit)) = (s.adapter_loads_per_1000, s.adapter_loads_limit_per_1000)
        else {
            continue;
        };
        if out.is_empty() {
            out.push_str("\nAdapter loads per 1,000 requests (limit: the same requests placed by known popularity):\n\n");
        }
        let shares: Vec<String> = s
            .shares
            .iter()
            .map(|(name, share)| format!("{name} {:.1}%", share * 100.0))
            .collect();
        out.push_str(&format!(
            "- {}: {loads:.1} (limit {limit:.1}); shares {}\n",
            s.strategy.name(),
            shares.join(", ")
        ));
    }
    out
}

/// The table of one workload's arms with the oracle ratio and turn affinity.
pub fn peer_table(strategies: &[StrategyResult]) -> String {
    let mut out = String::new();
    out.push_str("| peer | hit rate | of oracle | TTFT p50 (ms) | TTFT p90 (ms) | share min–max | turns on previous turn's instance | req/s | failures |\n");
    out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    let percent = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{:.0}%", v * 100.0));
    for s in strategies {
        out.push_str(&format!(
            "| {} | {:.1}% | {} | {:.0} | {:.0} | {:.1}–{:.1}% | {} | {:.2} | {} |\n",
            s.strategy.name(),
            s.hit_rate * 100.0,
            percent(s.hit_rate_of_oracle),
            s.ttft_p50_ms,
            s.ttft_p90_ms,
            s.share_min * 100.0,
            s.share_max * 100.0,
            percent(s.turns_on_previous_instance),
            s.rps,
            s.failures
        ));
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
            Peer::Filter(Strategy::LeastOutstandingRequests) => {
                "LEAST_OUTSTANDING_REQUESTS¹".to_string()
            }
            other => other.name(),
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
        .any(|s| s.strategy == Peer::Filter(Strategy::LeastOutstandingRequests))
    {
        out.push_str("\n¹ The filter routes to Envoy's least_request cluster (`selection_method: FULL_SCAN`).\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapter_loads_are_listed_for_the_arms_that_have_them() {
        let mut lora = result(Peer::Filter(Strategy::Random), 0.5, 100.0, "");
        lora.adapter_loads_per_1000 = Some(120.0);
        lora.adapter_loads_limit_per_1000 = Some(30.5);
        let lines = adapter_load_lines(&[
            lora,
            result(Peer::Filter(Strategy::PrefixAware), 0.5, 100.0, ""),
        ]);
        assert!(
            lines.contains("- RANDOM: 120.0 (limit 30.5); shares "),
            "{lines}"
        );
        assert!(!lines.contains("PREFIX_AWARE"), "{lines}");
        assert_eq!(
            adapter_load_lines(&[result(Peer::Oracle, 0.5, 1.0, "")]),
            ""
        );
    }

    #[test]
    fn lora_instances_have_four_slots_and_serve_every_adapter() {
        let lora = Workload::by_name("lora").unwrap();
        let cfg = sim_template(&lora, 100, 8.0);
        assert_eq!(cfg.max_loras, 4);
        assert_eq!(cfg.lora_modules.len(), 40);
        assert_eq!(cfg.lora_modules[39].0, "adapter-39");
        assert_eq!(cfg.validate(), Ok(()));
        let plain = sim_template(&Workload::by_name("sharegpt").unwrap(), 100, 8.0);
        assert_eq!((plain.max_loras, plain.lora_modules.len()), (0, 0));
        assert_eq!(plain.kv_blocks, 100);
    }

    #[test]
    fn one_instance_is_plain_lru() {
        // a b c a d with 2 slots: a, b; c evicts a; a evicts b; d evicts c.
        assert_eq!(adapter_loads_limit(&[0, 1, 2, 0, 3], 1, 2), 5);
        assert_eq!(adapter_loads_limit(&[0, 1, 0, 1, 0], 1, 2), 2);
        assert_eq!(adapter_loads_limit(&[], 3, 2), 0);
    }

    #[test]
    fn adapters_of_equal_share_each_get_one_instance_and_load_once() {
        // 4 adapters over 2 instances: 2 each, they fit in 2 slots.
        let requests: Vec<usize> = (0..100).map(|i| i % 4).collect();
        assert_eq!(adapter_loads_limit(&requests, 2, 2), 4);
        // One slot each: the two adapters of an instance alternate.
        assert_eq!(adapter_loads_limit(&requests, 2, 1), 100);
    }

    #[test]
    fn the_hottest_adapter_is_spread_over_as_many_instances_as_its_share_needs() {
        // Adapter 0 has 60% of 3 instances' requests: 2 copies; adapters 1
        // and 2 (20% each) go to the least loaded instances.
        let mut requests = Vec::new();
        for _ in 0..20 {
            requests.extend([0, 0, 0, 1, 2]);
        }
        // Placement: 0 on instances 0 and 1 (30% each), 1 on 2, 2 on 2
        // (the least loaded): with one slot, instances 0 and 1 load 0 once
        // and instance 2 alternates between 1 and 2 on every request.
        assert_eq!(adapter_loads_limit(&requests, 3, 1), 2 + 40);
        // Two slots hold both of instance 2's adapters.
        assert_eq!(adapter_loads_limit(&requests, 3, 2), 4);
    }

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

    fn result(peer: Peer, hit_rate: f64, ttft_p50_ms: f64, mark: &str) -> StrategyResult {
        StrategyResult {
            strategy: peer,
            mechanism: peer.mechanism(),
            hit_rate,
            hit_rate_of_oracle: Some(hit_rate / 0.8),
            hit_rate_runs: vec![hit_rate],
            hit_rate_client: hit_rate,
            adapter_loads_per_1000: None,
            adapter_loads_limit_per_1000: None,
            ttft_p50_ms,
            ttft_p90_ms: ttft_p50_ms * 2.0,
            ttft_p99_ms: ttft_p50_ms * 3.0,
            ttft_p90_runs: vec![ttft_p50_ms * 2.0],
            rps: 1.0,
            output_tokens_per_s: 10.0,
            share_min: 0.1,
            share_max: 0.2,
            turns_on_previous_instance: None,
            failures: 0,
            requests: 309,
            failure_kinds: Default::default(),
            shares: [(mark.to_string(), 1.0)].into_iter().collect(),
            instance_hit_rates: Default::default(),
            groups_per_instance: Default::default(),
            groups_split: 0,
            decisions: [(format!("{mark}-kind"), 3)].into_iter().collect(),
            adapter_decisions: Default::default(),
            engine_polls: Default::default(),
            filter_usage: Default::default(),
            latency_p50_ms: 1.0,
            duration_s: 1.0,
            wall_s: 2.0,
        }
    }

    #[test]
    fn runs_are_summarised_by_their_medians() {
        let peer = Peer::FixedPrefix(1024);
        let m = median_result(vec![
            result(peer, 0.5, 10.0, "first"),
            result(peer, 0.1, 30.0, "second"),
            result(peer, 0.3, 50.0, "third"),
        ]);
        assert_eq!(m.hit_rate, 0.3);
        assert_eq!(m.ttft_p50_ms, 30.0);
        assert_eq!(m.hit_rate_of_oracle, Some(0.3 / 0.8));
        assert_eq!(m.hit_rate_runs, vec![0.5, 0.1, 0.3]);
        assert_eq!(m.wall_s, 6.0);
        // The maps are the median-hit-rate run's.
        assert!(m.shares.contains_key("third"), "{:?}", m.shares);
        assert!(m.decisions.contains_key("third-kind"), "{:?}", m.decisions);
        assert_eq!(median_of(vec![4.0, 1.0]), Some(2.5));
        assert_eq!(median_of(Vec::new()), None);
    }

    #[test]
    fn workloads_with_peers_get_the_peer_table() {
        let workload = |strategies: Vec<StrategyResult>, oracle_hit_rate| WorkloadResult {
            workload: "sharegpt".into(),
            api: "chat".into(),
            rate_rps: 2.0,
            arrivals: "conversations",
            warmup_requests: 0,
            requests: 1000,
            runs: 3,
            parameters: Workload::by_name("sharegpt").unwrap(),
            kv_blocks_per_instance: 1,
            reused_tokens: 1,
            reused_fraction_of_fleet_cache: 0.65,
            reused_over_one_instance: 4.5,
            oracle_hit_rate,
            strategies,
        };
        let report = |workloads| RoutingReport {
            benchmark: "routing",
            quick: true,
            envoy_version: ENVOY_VERSION,
            envoy_workers: 1,
            instances: INSTANCES,
            reused_fraction: SHARED_FRACTION_OF_FLEET_CACHE,
            restart_after_s: None,
            time_scale: 8.0,
            runs: 3,
            cold_start: "",
            corpus: None,
            load_average_start: None,
            load_average_end: None,
            duration_s: 1.0,
            workloads,
        };
        let with_oracle = markdown(&report(vec![workload(
            vec![
                result(Peer::FixedPrefix(1024), 0.4, 10.0, "a"),
                result(Peer::Oracle, 0.8, 10.0, "b"),
            ],
            Some(0.8),
        )]));
        assert!(
            with_oracle.contains("| PREFIX_AWARE@1024 | 40.0% | 50% |"),
            "{with_oracle}"
        );
        assert!(
            with_oracle.contains("309 (at most 1000) measured requests per arm, medians of 3 runs")
        );
        let filter_only = markdown(&report(vec![workload(
            vec![result(Peer::Filter(Strategy::Random), 0.1, 10.0, "a")],
            None,
        )]));
        assert!(
            filter_only.contains("| strategy | hit rate |"),
            "{filter_only}"
        );
        assert!(!filter_only.contains("of oracle"));
    }

    #[test]
    fn synthetic_arms_get_the_strategy_table_with_the_default_and_decisions() {
        let strategies: Vec<StrategyResult> = SYNTHETIC_PEERS
            .into_iter()
            .map(|peer| result(peer, 0.5, 10.0, &peer.cli_name()))
            .collect();
        let table = strategy_table(&strategies);
        for name in ["RANDOM", "PREFIX_AWARE@4096", "PREFIX_AWARE (longest)"] {
            assert!(
                table.contains(&format!("| {name} | 50.0% |")),
                "{name}: {table}"
            );
        }
        let lines = decision_lines(&strategies);
        assert!(
            lines.contains("- PREFIX_AWARE (longest): prefix-aware-kind 3\n"),
            "{lines}"
        );
        assert!(
            lines.contains("- PREFIX_AWARE@4096: prefix-4096-kind 3\n"),
            "{lines}"
        );
        let mut adapters = strategies.clone();
        adapters[0].adapter_decisions = [("in_set".to_string(), 5), ("set_grown".to_string(), 2)]
            .into_iter()
            .collect();
        let lines = decision_lines(&adapters);
        assert!(
            lines.contains(&format!(
                "- {}: {}-kind 3; adapters: in_set 5, set_grown 2\n",
                adapters[0].strategy.name(),
                adapters[0].strategy.cli_name()
            )),
            "{lines}"
        );
        let mut none = strategies;
        for s in &mut none {
            s.decisions.clear();
        }
        assert_eq!(decision_lines(&none), "");
    }

    #[test]
    fn engine_arms_show_their_polls_and_three_envoys_are_compared_with_one() {
        let mut one = result(Peer::PrefixAwareEngine, 0.5, 100.0, "one");
        one.ttft_p90_runs = vec![200.0, 100.0];
        one.engine_polls = [("polls".to_string(), 40)].into_iter().collect();
        let mut three = result(
            Peer::Replicated {
                arm: &Peer::PrefixAwareEngine,
                envoys: 3,
            },
            0.45,
            110.0,
            "three",
        );
        three.ttft_p90_runs = vec![220.0, 120.0];
        let strategies = [
            result(Peer::Filter(Strategy::PrefixAware), 0.5, 10.0, "d"),
            one,
            three,
        ];
        let polls = engine_poll_lines(&strategies);
        assert!(
            polls.contains("- PREFIX_AWARE (longest) + engine load: polls 40\n"),
            "{polls}"
        );
        assert!(polls.contains("3 Envoys: none counted"), "{polls}");
        let lines = replica_lines(&strategies);
        assert!(
            lines.contains("TTFT p90 x1.10 (medians; per run: 1.10, 1.20)"),
            "{lines}"
        );
        assert!(
            lines.contains("hit rate 45.0% vs 50.0% (-5.0 points)"),
            "{lines}"
        );
        assert_eq!(replica_lines(&strategies[..2]), "");
        let mut without = result(
            Peer::Replicated {
                arm: &Peer::Filter(Strategy::PrefixAware),
                envoys: 3,
            },
            0.45,
            100.0,
            "w",
        );
        without.ttft_p90_runs = vec![200.0, 100.0];
        let with_both = [strategies[2].clone(), without];
        let lines = replica_lines(&with_both);
        assert!(
            lines.contains("3 Envoys with engine load over 3 without: TTFT p90 x1.10"),
            "{lines}"
        );
        assert_eq!(engine_poll_lines(&strategies[..1]), "");
    }
}
