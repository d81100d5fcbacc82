//! Seven `vllm-sim` processes behind Envoy with the filter, as the routing
//! benchmark and the demo use them: starting the fleet, an Envoy per
//! arm, cold caches between arms, the token-weighted hit rate from the
//! instances' own `/metrics` counters, and the filter's decision counts from
//! Envoy's `/stats`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;
use serde_json::json;

use crate::envoy::Envoy;
use crate::sim::fleet::{
    reset_prefix_cache, scrape_cache_counters, scrape_lora_loads, CacheCounters, SimProcess,
};
use crate::sim::SimConfig;

/// The filter's key header (the route's `hash_policy` in `envoy/envoy.yaml`).
const KEY_HEADER: &str = "x-prefix-route-key";

/// A routing strategy of the filter, as the benchmark runs it (how its
/// prefix is matched is the arm's: [`super::peers::Peer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Strategy {
    Random,
    LeastOutstandingRequests,
    PrefixAware,
}

impl Strategy {
    pub const ALL: [Strategy; 3] = [
        Strategy::Random,
        Strategy::LeastOutstandingRequests,
        Strategy::PrefixAware,
    ];

    /// The plugin configuration's `strategy` value.
    pub fn config_name(self) -> &'static str {
        match self {
            Strategy::Random => "RANDOM",
            Strategy::LeastOutstandingRequests => "LEAST_OUTSTANDING_REQUESTS",
            Strategy::PrefixAware => "PREFIX_AWARE",
        }
    }
}

/// The filter's `concurrency_threshold` in the benchmarks.
pub const CONCURRENCY_THRESHOLD: u32 = 64;

/// The cargo profile the tools are built with (the workspace's Cargo.toml):
/// optimised as `release`, without its whole-program LTO, and the profile
/// `cargo xtask` itself runs in, so one build of the dependencies serves
/// both. Cargo writes its binaries under `target/tools/`.
pub const TOOLS_PROFILE: &str = "tools";

/// Where the `vllm-sim` binary is: next to the running executable (the bench
/// binary is built with it), else in the target directory's `tools`, release or debug build.
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
    candidates.push(target.join(TOOLS_PROFILE).join("vllm-sim"));
    candidates.push(target.join("release").join("vllm-sim"));
    candidates.push(target.join("debug").join("vllm-sim"));
    candidates.into_iter().find(|c| c.is_file()).ok_or_else(|| {
        anyhow::anyhow!(
            "vllm-sim not found next to this binary or in {}: build it with \
                 `cargo build --profile tools -p prefix-router-tools --bin vllm-sim`",
            target.display()
        )
    })
}

/// Seven (or `count`) simulated instances `vllm-1` .. `vllm-N`.
pub struct SimFleet {
    exe: PathBuf,
    /// Each instance's configuration and process (locked to restart it).
    instances: Vec<(SimConfig, Mutex<SimProcess>)>,
}

/// How long a `vllm-sim` process may take to announce its address.
const SIM_READY_WITHIN: Duration = Duration::from_secs(10);

impl SimFleet {
    pub fn start(exe: &Path, count: usize, template: &SimConfig) -> anyhow::Result<Self> {
        let mut instances = Vec::with_capacity(count);
        for i in 1..=count {
            let cfg = SimConfig {
                name: format!("vllm-{i}"),
                ..template.clone()
            };
            let process = SimProcess::spawn(exe, &cfg, SIM_READY_WITHIN)
                .with_context(|| format!("starting {}", cfg.name))?;
            instances.push((cfg, Mutex::new(process)));
        }
        Ok(SimFleet {
            exe: exe.to_path_buf(),
            instances,
        })
    }

    fn each<T>(&self, f: impl Fn(&SimProcess) -> T) -> Vec<T> {
        self.instances
            .iter()
            .map(|(_, process)| f(&process.lock().unwrap_or_else(|e| e.into_inner())))
            .collect()
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.each(|p| p.addr)
    }

    pub fn names(&self) -> Vec<String> {
        self.each(|p| p.name.clone())
    }

    /// Restarts instance `index` (0-based) on its address: its connections
    /// drop and its prefix cache starts empty.
    pub fn restart(&self, index: usize) -> anyhow::Result<()> {
        let (cfg, process) = self.instances.get(index).context("no such instance")?;
        let mut process = process.lock().unwrap_or_else(|e| e.into_inner());
        process.restart(&self.exe, cfg, SIM_READY_WITHIN)
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

    /// Adapter loads summed over the instances (0 without LoRA slots).
    pub async fn lora_loads(&self) -> anyhow::Result<f64> {
        let mut total = 0.0;
        for addr in self.addrs() {
            total += scrape_lora_loads(addr).await?;
        }
        Ok(total)
    }

    /// Every instance's prefix-cache counters, in instance order.
    pub async fn cache_counters(&self) -> anyhow::Result<Vec<CacheCounters>> {
        let mut all = Vec::with_capacity(self.instances.len());
        for addr in self.addrs() {
            all.push(scrape_cache_counters(addr).await?);
        }
        Ok(all)
    }
}

/// The plugin configuration every arm through Envoy shares, with the arm's
/// own fields (`strategy`, and how PREFIX_AWARE matches) added by the caller.
pub fn base_plugin_config(upstreams: &[SocketAddr]) -> serde_json::Map<String, serde_json::Value> {
    let config = json!({
        // Sized to what one instance serves well at once (the sims batch up to
        // max_num_seqs = 256; decode slows past ~64): the filter's default of 10
        // would overflow most requests of a streaming fleet at this load and
        // measure overload protection instead of prefix affinity.
        "concurrency_threshold": CONCURRENCY_THRESHOLD,
        "key_header": KEY_HEADER,
        // The fleet, as the shipped envoy.yaml lists it: every instance is known
        // from the first request (cold prefixes are placed over the known ones,
        // so two Envoys in front of the same fleet place them alike).
        "instances": upstreams.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
    });
    match config {
        serde_json::Value::Object(map) => map,
        _ => serde_json::Map::new(),
    }
}

/// Envoy from `envoy/envoy.yaml` with the filter configured by `plugin_config`,
/// in front of `upstreams`, with the cluster engine polls go through if the
/// configuration has `engine_load`.
pub fn start_envoy(
    plugin_config: &serde_json::Value,
    upstreams: &[SocketAddr],
    wasm: Option<&Path>,
    workers: u32,
) -> anyhow::Result<Envoy> {
    let mut builder = Envoy::builder()
        .upstreams(upstreams.iter().copied())
        .concurrency(workers)
        .log_level("warning")
        .plugin_config_json(plugin_config);
    if super::engine_load::polls_engines(plugin_config) {
        builder = super::engine_load::with_engine_cluster(builder);
    }
    if let Some(wasm) = wasm {
        builder = builder.wasm(wasm);
    }
    Ok(builder.start()?)
}

/// The filter's decision counters in Envoy's `/stats` text (e.g.
/// `wasmcustom.prefix_router.decision.prefix: 12`), by decision kind
/// (`prefix`). Any counter of the filter with `decision` in its name counts,
/// spelt `decision.` or `decisions_` alike, so renamed kinds still show.
pub fn decision_counts(stats: &str) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for line in stats.lines() {
        let Some((name, value)) = line.split_once(": ") else {
            continue;
        };
        let Ok(value) = value.trim().parse::<u64>() else {
            continue;
        };
        if !name.contains("prefix_router") {
            continue;
        }
        let Some(at) = name.rfind("decision") else {
            continue;
        };
        let kind = name[at + "decision".len()..]
            .trim_start_matches('s')
            .trim_start_matches(['.', '_']);
        if !kind.is_empty() {
            *counts.entry(kind.to_string()).or_insert(0) += value;
        }
    }
    counts
}

/// The filter's decision counts of every Envoy in `envoys`, summed.
pub fn decision_counts_of(envoys: &[Envoy]) -> BTreeMap<String, u64> {
    summed_over(envoys, "prefix_router", decision_counts)
}

/// The counters of an admin `/stats` text whose names hold `prefix`, summed
/// by `key` of what follows it (left out where `key` gives None).
pub fn counters_after(
    stats: &str,
    prefix: &str,
    key: impl Fn(&str) -> Option<&str>,
) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for line in stats.lines() {
        let Some((name, value)) = line.split_once(": ") else {
            continue;
        };
        let Some(rest) = name.find(prefix).map(|at| &name[at + prefix.len()..]) else {
            continue;
        };
        if let (Some(key), Ok(value)) = (key(rest), value.trim().parse::<u64>()) {
            *counts.entry(key.to_string()).or_insert(0) += value;
        }
    }
    counts
}

/// `parse` of the `/stats?filter=<filter>` of every Envoy in `envoys`,
/// summed. An Envoy whose admin interface does not answer adds nothing (the
/// counts are a side figure of the report).
pub fn summed_over(
    envoys: &[Envoy],
    filter: &str,
    parse: impl Fn(&str) -> BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    let mut total = BTreeMap::new();
    for envoy in envoys {
        let stats = envoy
            .admin_get(&format!("/stats?filter={filter}"))
            .unwrap_or_default();
        for (key, count) in parse(&stats) {
            *total.entry(key).or_insert(0) += count;
        }
    }
    total
}

/// The filter's usage counters (`prefix_router.usage.<name>.endpoint.<addr>`)
/// of every Envoy in `envoys`, summed over the instances by name.
pub fn usage_counts_of(envoys: &[Envoy]) -> BTreeMap<String, u64> {
    summed_over(envoys, "prefix_router.usage", |stats| {
        counters_after(stats, "prefix_router.usage.", |rest| {
            rest.split(".endpoint.").next()
        })
    })
}

/// The filter's LoRA decisions by reason (`prefix_router.adapter.in_set`,
/// `set_grown`, `outside_set`) in an admin `/stats` text; the per-adapter
/// set-size gauges under the same prefix are left out.
pub fn adapter_counts(stats: &str) -> BTreeMap<String, u64> {
    counters_after(stats, "prefix_router.adapter.", |reason| {
        matches!(reason, "in_set" | "set_grown" | "outside_set").then_some(reason)
    })
}

/// [`adapter_counts`] of every Envoy in `envoys`, summed.
pub fn adapter_counts_of(envoys: &[Envoy]) -> BTreeMap<String, u64> {
    summed_over(envoys, "prefix_router.adapter", adapter_counts)
}

/// [`decision_counts_of`] once they add up to at least `decided`, polled for
/// at most `within`: the filter hands its counters to Envoy on its 1 s tick,
/// so the last second's decisions show up to a second late. After `within`
/// the counts as they are (the caller's `decided` may count requests that
/// never reached a decision).
pub fn settled_decision_counts(
    envoys: &[Envoy],
    decided: usize,
    within: Duration,
) -> BTreeMap<String, u64> {
    let deadline = std::time::Instant::now() + within;
    loop {
        let counts = decision_counts_of(envoys);
        let total: u64 = counts.values().sum();
        if total >= decided as u64 || std::time::Instant::now() >= deadline {
            return counts;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `after - before` per kind (kinds that did not grow are left out).
pub fn counts_between(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter_map(|(kind, &a)| {
            let delta = a.saturating_sub(before.get(kind).copied().unwrap_or(0));
            (delta > 0).then(|| (kind.clone(), delta))
        })
        .collect()
}

/// Token-weighted hit rate over the instances, between two scrapes.
pub fn hit_rate_between(before: &[CacheCounters], after: &[CacheCounters]) -> (f64, CacheCounters) {
    let deltas: Vec<CacheCounters> = after.iter().zip(before).map(|(a, b)| a.since(b)).collect();
    let total = CacheCounters::total(&deltas);
    (total.hit_rate(), total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decision_counters_are_read_by_kind_whatever_their_spelling() {
        let stats = "\
wasmcustom.prefix_router.decision.prefix: 12
wasmcustom.prefix_router.decision.overflow: 3
wasmcustom.prefix_router_decisions_longest_match: 7
wasmcustom.prefix_router.requests_keyed.chat_completions: 22
wasmcustom.prefix_router.decision.placed: No recorded values
cluster.vllm.upstream_rq_total: 40
other.decision.prefix: 99
";
        let counts = decision_counts(stats);
        let expected: BTreeMap<String, u64> =
            [("prefix", 12), ("overflow", 3), ("longest_match", 7)]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
        assert_eq!(counts, expected);
    }

    #[test]
    fn adapter_decisions_are_read_by_reason_without_the_set_size_gauges() {
        let stats = "\
wasmcustom.prefix_router.adapter.in_set: 40
wasmcustom.prefix_router.adapter.set_grown: 6
wasmcustom.prefix_router.adapter.outside_set: 1
wasmcustom.prefix_router.adapter.instances.adapter.sql-lora: 2
wasmcustom.prefix_router.decision.cold: 12
";
        let expected: BTreeMap<String, u64> =
            [("in_set", 40), ("set_grown", 6), ("outside_set", 1)]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
        assert_eq!(adapter_counts(stats), expected);
        // Nor do they count as decisions, whose total tells when the counts settled.
        let decisions: BTreeMap<String, u64> = [("cold".to_string(), 12)].into_iter().collect();
        assert_eq!(decision_counts(stats), decisions);
    }

    #[test]
    fn decision_counts_between_two_reads_keep_only_what_grew() {
        let map = |pairs: &[(&str, u64)]| -> BTreeMap<String, u64> {
            pairs.iter().map(|&(k, v)| (k.to_string(), v)).collect()
        };
        let before = map(&[("prefix", 5), ("overflow", 1)]);
        let after = map(&[("prefix", 9), ("overflow", 1), ("placed", 2)]);
        assert_eq!(
            counts_between(&before, &after),
            map(&[("prefix", 4), ("placed", 2)])
        );
    }

    #[test]
    fn every_arm_lists_the_fleet_and_the_benchmarks_threshold() {
        let upstreams: Vec<SocketAddr> = vec![
            "127.0.0.1:8001".parse().unwrap(),
            "127.0.0.1:8002".parse().unwrap(),
        ];
        let config = serde_json::Value::Object(base_plugin_config(&upstreams));
        assert_eq!(
            config,
            json!({
                "concurrency_threshold": 64,
                "key_header": "x-prefix-route-key",
                "instances": ["127.0.0.1:8001", "127.0.0.1:8002"],
            })
        );
    }
}
