//! Seven `vllm-sim` processes behind Envoy with the filter, as the routing
//! benchmark and the demo use them: starting the fleet, an Envoy per
//! strategy, cold caches between strategies, and the token-weighted hit rate
//! from the instances' own `/metrics` counters.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;
use serde_json::json;

use crate::envoy::Envoy;
use crate::sim::fleet::{reset_prefix_cache, scrape_cache_counters, CacheCounters, SimProcess};
use crate::sim::SimConfig;

/// The filter's key header (the route's `hash_policy` in `envoy/envoy.yaml`).
const KEY_HEADER: &str = "x-prefix-route-key";

/// A routing strategy as the benchmark runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Strategy {
    Random,
    LeastOutstandingRequests,
    PrefixAware,
    /// PREFIX_AWARE with `key_balance_factor` [`KEY_BALANCE_FACTOR`].
    PrefixAwareBalanced,
}

/// The `key_balance_factor` of [`Strategy::PrefixAwareBalanced`]: as even as
/// the keys allow.
pub const KEY_BALANCE_FACTOR: u32 = 100;

impl Strategy {
    pub const ALL: [Strategy; 4] = [
        Strategy::Random,
        Strategy::LeastOutstandingRequests,
        Strategy::PrefixAware,
        Strategy::PrefixAwareBalanced,
    ];

    /// The plugin configuration's `strategy` value.
    pub fn config_name(self) -> &'static str {
        match self {
            Strategy::Random => "RANDOM",
            Strategy::LeastOutstandingRequests => "LEAST_OUTSTANDING_REQUESTS",
            Strategy::PrefixAware | Strategy::PrefixAwareBalanced => "PREFIX_AWARE",
        }
    }

    /// The plugin configuration's `key_balance_factor` (JSON null: off).
    pub fn key_balance_factor(self) -> Option<u32> {
        (self == Strategy::PrefixAwareBalanced).then_some(KEY_BALANCE_FACTOR)
    }

    /// How reports name it.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::PrefixAwareBalanced => "PREFIX_AWARE+balance",
            other => other.config_name(),
        }
    }

    /// How the run realises the strategy, for the report.
    pub fn mechanism(self) -> &'static str {
        match self {
            Strategy::Random => "filter strategy RANDOM (no key): Envoy's MAGLEV picks a random host",
            Strategy::LeastOutstandingRequests => {
                "filter strategy LEAST_OUTSTANDING_REQUESTS: routed to the least_request (FULL_SCAN) cluster"
            }
            Strategy::PrefixAware => "filter strategy PREFIX_AWARE: key header hashed by MAGLEV",
            Strategy::PrefixAwareBalanced => {
                "filter strategy PREFIX_AWARE with key_balance_factor 100: MAGLEV, keys past an even share placed through override_host"
            }
        }
    }
}

/// The filter's `concurrency_threshold` in the benchmarks.
pub const CONCURRENCY_THRESHOLD: u32 = 64;

/// Where the `vllm-sim` binary is: next to the running executable (the bench
/// binary is built with it), else in the target directory's release or debug build.
pub fn find_sim_exe() -> anyhow::Result<PathBuf> {
    let mut candidates = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            candidates.push(dir.join("vllm-sim"));
            // Test and example binaries live one level deeper (deps/, examples/).
            if let Some(parent) = dir.parent() {
                candidates.push(parent.join("vllm-sim"));
            }
        }
    }
    let target = crate::envoy::target_dir();
    candidates.push(target.join("release").join("vllm-sim"));
    candidates.push(target.join("debug").join("vllm-sim"));
    candidates.into_iter().find(|c| c.is_file()).ok_or_else(|| {
        anyhow::anyhow!(
            "vllm-sim not found next to this binary or in {}: build it with \
                 `cargo build --release -p prefix-router-tools --bin vllm-sim`",
            target.display()
        )
    })
}

/// Seven (or `count`) simulated instances `vllm-1` .. `vllm-N`.
pub struct SimFleet {
    processes: Vec<SimProcess>,
}

impl SimFleet {
    pub fn start(exe: &Path, count: usize, template: &SimConfig) -> anyhow::Result<Self> {
        let mut processes = Vec::with_capacity(count);
        for i in 1..=count {
            let cfg = SimConfig {
                name: format!("vllm-{i}"),
                ..template.clone()
            };
            processes.push(
                SimProcess::spawn(exe, &cfg, Duration::from_secs(10))
                    .with_context(|| format!("starting {}", cfg.name))?,
            );
        }
        Ok(SimFleet { processes })
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.processes.iter().map(|p| p.addr).collect()
    }

    pub fn names(&self) -> Vec<String> {
        self.processes.iter().map(|p| p.name.clone()).collect()
    }

    /// Empties every instance's prefix cache (they must be idle).
    pub async fn reset_caches(&self) -> anyhow::Result<()> {
        for addr in self.addrs() {
            // An instance finishing its last stream may still count it for a moment.
            let mut attempt = 0;
            loop {
                match reset_prefix_cache(addr).await {
                    Ok(()) => break,
                    Err(_) if attempt < 50 => {
                        attempt += 1;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(error) => return Err(error),
                }
            }
        }
        Ok(())
    }

    /// Every instance's prefix-cache counters, in instance order.
    pub async fn cache_counters(&self) -> anyhow::Result<Vec<CacheCounters>> {
        let mut all = Vec::with_capacity(self.processes.len());
        for addr in self.addrs() {
            all.push(scrape_cache_counters(addr).await?);
        }
        Ok(all)
    }
}

/// Envoy from `envoy/envoy.yaml` with the filter, in front of `upstreams`,
/// configured for `strategy`.
pub fn start_envoy(
    strategy: Strategy,
    upstreams: &[SocketAddr],
    wasm: Option<&Path>,
    workers: u32,
) -> anyhow::Result<Envoy> {
    start_envoy_at(
        strategy,
        super::peers::DEFAULT_PREFIX_LENGTH,
        upstreams,
        wasm,
        workers,
    )
}

/// [`start_envoy`] with the filter's `prefix_length` given.
pub fn start_envoy_at(
    strategy: Strategy,
    prefix_length: u32,
    upstreams: &[SocketAddr],
    wasm: Option<&Path>,
    workers: u32,
) -> anyhow::Result<Envoy> {
    let mut builder = Envoy::builder()
        .upstreams(upstreams.iter().copied())
        .concurrency(workers)
        .log_level("warning")
        .plugin_config_json(&json!({
            "strategy": strategy.config_name(),
            "key_balance_factor": strategy.key_balance_factor(),
            "prefix_length": prefix_length,
            // Sized to what one instance serves well at once (the sims batch up to
            // max_num_seqs = 256; decode slows past ~64): the filter's default of 10
            // would overflow most requests of a streaming fleet at this load and
            // measure overload protection instead of prefix affinity.
            "concurrency_threshold": CONCURRENCY_THRESHOLD,
            "key_header": KEY_HEADER,
        }));
    if let Some(wasm) = wasm {
        builder = builder.wasm(wasm);
    }
    Ok(builder.start()?)
}

/// Token-weighted hit rate over the instances, between two scrapes.
pub fn hit_rate_between(before: &[CacheCounters], after: &[CacheCounters]) -> (f64, CacheCounters) {
    let deltas: Vec<CacheCounters> = after.iter().zip(before).map(|(a, b)| a.since(b)).collect();
    let total = CacheCounters::total(&deltas);
    (total.hit_rate(), total)
}
