//! The benchmarks' command-line options, defined once: `prefix-router-bench`
//! parses them ([`BenchCli`]), and `cargo xtask bench` parses the same and hands them on
//! (after building the release binaries) with [`OverheadArgs::to_args`] and
//! [`RoutingArgs::to_args`].

use clap::{Args, Parser, Subcommand};

use super::instant_upstream::FLEET_SIZE;
use super::peers::Peer;
use crate::loadgen::{DATA_WORKLOAD_NAMES, WORKLOAD_NAMES};

/// `overhead [--quick] [--match MATCH] [--baseline-wasm PATH] [--baseline-config JSON] [--instances N]`.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct OverheadArgs {
    /// A shorter run (under a minute) with the same fields.
    #[arg(long)]
    pub quick: bool,
    /// The PREFIX_AWARE configurations' `match` (LONGEST_PREFIX or
    /// FIXED_PREFIX); the filter's default unless given.
    #[arg(long = "match", value_parser = ["LONGEST_PREFIX", "FIXED_PREFIX"])]
    pub matching: Option<String>,
    /// Another build of the filter (a .wasm), measured as shipped beside the
    /// others, request by request: two builds side by side in one run.
    #[arg(long)]
    pub baseline_wasm: Option<std::path::PathBuf>,
    /// Plugin configuration fields (a JSON object) set on the baseline: the
    /// --baseline-wasm build's, or without it this build's, beside itself
    /// as shipped (e.g. `{"read_usage": false}`: what reading usage costs).
    #[arg(long)]
    pub baseline_config: Option<String>,
    /// Instant upstreams in the fleet, all listed as `instances` (default 7,
    /// as `envoy/envoy.yaml`'s fleet): what a decision costs with more.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=INSTANCES_MAX))]
    pub instances: Option<u16>,
}

/// The most instances `--instances` takes: the filter's `instances` limit.
const INSTANCES_MAX: i64 = 256;

impl OverheadArgs {
    /// The command line that parses back into these options.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec!["overhead".to_string()];
        if self.quick {
            args.push("--quick".to_string());
        }
        if let Some(matching) = &self.matching {
            args.extend(["--match".to_string(), matching.clone()]);
        }
        if let Some(wasm) = &self.baseline_wasm {
            args.extend(["--baseline-wasm".to_string(), wasm.display().to_string()]);
        }
        if let Some(config) = &self.baseline_config {
            args.extend(["--baseline-config".to_string(), config.clone()]);
        }
        if let Some(instances) = self.instances {
            args.extend(["--instances".to_string(), instances.to_string()]);
        }
        args
    }
}

/// `routing [--quick] [--workloads NAME,...] [--peers NAME,...] [--runs N] [--envoy-workers N]
/// [--instances N] [--reused-percent P] [--restart-after S]`.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct RoutingArgs {
    /// A shorter run with the same fields (one run; under 3 minutes for the
    /// synthetic workloads, under 10 for sharegpt, sharegpt-system and rag,
    /// about half a minute per arm for lora).
    #[arg(long)]
    pub quick: bool,
    /// Only these workloads (names as in the report, e.g. long-shared-prefix
    /// or sharegpt,rag); repeatable, or comma-separated.
    #[arg(long, alias = "workloads", value_delimiter = ',', value_parser = workload_name)]
    pub workload: Vec<String>,
    /// Only these arms, on every workload: random, least-outstanding,
    /// prefix-aware (the filter's default matching, LONGEST_PREFIX), prefix-N
    /// (FIXED_PREFIX at prefix_length N), longest-B (LONGEST_PREFIX with
    /// block_bytes B), margin-M (LONGEST_PREFIX with load_margin M),
    /// balanced (LONGEST_PREFIX with cold_placement BALANCED),
    /// prefix-aware-engine (prefix-aware with engine_load), adapters
    /// (prefix-aware with adapters), adapters-engine (adapters with
    /// engine_load), sglang, oracle,
    /// ARM-N-envoys (ARM, an arm through one Envoy, through N Envoys the load
    /// generator alternates between: e.g. prefix-aware-2-envoys,
    /// balanced-3-envoys), baseline-ARM (ARM, an arm through Envoy, with the
    /// filter of --baseline-wasm); comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = Peer::parse)]
    pub peers: Vec<Peer>,
    /// Another build of the filter (a .wasm), which the baseline-ARM arms
    /// run: two builds side by side on the same fleets and traffic.
    #[arg(long)]
    pub baseline_wasm: Option<std::path::PathBuf>,
    /// Repetitions to take medians over (default 3, or 1 with --quick).
    #[arg(long)]
    pub runs: Option<usize>,
    /// Worker threads of each Envoy (default 1): with more, a filter VM per
    /// worker decides, and the VMs share their counts through shared data.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub envoy_workers: Option<u32>,
    /// Simulated vLLM instances (default 7): the same workloads and total KV
    /// cache over a larger fleet.
    #[arg(long, value_parser = clap::value_parser!(u16).range(2..=INSTANCES_MAX))]
    pub instances: Option<u16>,
    /// The reused tokens as a percentage of the fleet's KV cache (default
    /// 65): above 100 the instances cannot keep every prefix, so the
    /// filter's index believes more than they hold.
    #[arg(long, value_parser = clap::value_parser!(u16).range(10..=1000))]
    pub reused_percent: Option<u16>,
    /// Restart the first instance (its connections drop, its cache empties)
    /// this many seconds into each measured run.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=3600))]
    pub restart_after: Option<u16>,
}

impl RoutingArgs {
    /// The command line that parses back into these options.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec!["routing".to_string()];
        if self.quick {
            args.push("--quick".to_string());
        }
        for name in &self.workload {
            args.extend(["--workload".to_string(), name.clone()]);
        }
        if !self.peers.is_empty() {
            let names: Vec<String> = self.peers.iter().map(|peer| peer.cli_name()).collect();
            args.extend(["--peers".to_string(), names.join(",")]);
        }
        if let Some(runs) = self.runs {
            args.extend(["--runs".to_string(), runs.to_string()]);
        }
        if let Some(wasm) = &self.baseline_wasm {
            args.extend(["--baseline-wasm".to_string(), wasm.display().to_string()]);
        }
        if let Some(workers) = self.envoy_workers {
            args.extend(["--envoy-workers".to_string(), workers.to_string()]);
        }
        if let Some(instances) = self.instances {
            args.extend(["--instances".to_string(), instances.to_string()]);
        }
        if let Some(percent) = self.reused_percent {
            args.extend(["--reused-percent".to_string(), percent.to_string()]);
        }
        if let Some(seconds) = self.restart_after {
            args.extend(["--restart-after".to_string(), seconds.to_string()]);
        }
        args
    }
}

/// A `--workloads` name: refused at parse time unless a workload has it, so
/// that a misspelt name is not silently left out of the run.
fn workload_name(name: &str) -> Result<String, String> {
    if WORKLOAD_NAMES.contains(&name) || DATA_WORKLOAD_NAMES.contains(&name) {
        Ok(name.to_string())
    } else {
        Err(format!(
            "no workload {name:?}: {}, {}",
            WORKLOAD_NAMES.join(", "),
            DATA_WORKLOAD_NAMES.join(", ")
        ))
    }
}

/// The command line of `prefix-router-bench`.
#[derive(Debug, Parser)]
#[command(
    name = "prefix-router-bench",
    about = "prefix-router benchmarks through a real Envoy"
)]
pub struct BenchCli {
    #[command(subcommand)]
    pub command: BenchCommand,
}

/// A `prefix-router-bench` subcommand.
#[derive(Debug, PartialEq, Eq, Subcommand)]
pub enum BenchCommand {
    /// The filter's cost per request: the same Envoy with and without it.
    Overhead(OverheadArgs),
    /// Routing quality against 7 simulated vLLM instances, per strategy.
    Routing(RoutingArgs),
    /// The demo (what `cargo xtask demo` shows): RANDOM, PREFIX_AWARE@1024 and
    /// PREFIX_AWARE at its default matching on short sharegpt and
    /// long-shared-prefix runs.
    Demo,
    /// For profiling: one overhead case under throughput load, printing Envoy's
    /// pid once warm (e.g. `perf record -g -p PID -- sleep 5`).
    OverheadLoad {
        /// A case name, e.g. chat-1MiB.
        #[arg(long)]
        case: String,
        /// without, idle (filter with RANDOM) or with (PREFIX_AWARE).
        #[arg(long, default_value = "with")]
        configuration: String,
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Instant upstreams, all listed as `instances`.
        #[arg(long, default_value_t = FLEET_SIZE as u16, value_parser = clap::value_parser!(u16).range(1..=INSTANCES_MAX))]
        instances: u16,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: Vec<String>) -> BenchCommand {
        BenchCli::try_parse_from(std::iter::once("bench".to_string()).chain(args))
            .expect("parses")
            .command
    }

    #[test]
    fn options_survive_the_hand_over() {
        for quick in [false, true] {
            for (matching, baseline_wasm, baseline_config, instances) in [
                (None, None, None, None),
                (Some("FIXED_PREFIX".to_string()), None, None, Some(64)),
                (
                    None,
                    Some("/tmp/previous build/prefix_router.wasm".into()),
                    None,
                    None,
                ),
                (
                    None,
                    None,
                    Some(r#"{"read_usage": false}"#.to_string()),
                    None,
                ),
            ] {
                let overhead = OverheadArgs {
                    quick,
                    matching,
                    baseline_wasm,
                    baseline_config,
                    instances,
                };
                assert!(
                    matches!(parse(overhead.to_args()), BenchCommand::Overhead(o) if o == overhead)
                );
            }
            for workload in [vec![], vec!["rag".to_string(), "multi-turn".to_string()]] {
                for (peers, runs, baseline_wasm, envoy_workers) in [
                    ("", None, None, None),
                    (
                        "sglang,prefix-1024,balanced-3-envoys",
                        Some(5),
                        None,
                        Some(2),
                    ),
                    (
                        "balanced,baseline-balanced,baseline-prefix-aware-2-envoys",
                        Some(3),
                        Some("/tmp/previous build/prefix_router.wasm".into()),
                        None,
                    ),
                ] {
                    let routing = RoutingArgs {
                        quick,
                        workload: workload.clone(),
                        peers: peers
                            .split(',')
                            .filter(|name| !name.is_empty())
                            .map(|name| Peer::parse(name).unwrap())
                            .collect(),
                        runs,
                        baseline_wasm,
                        envoy_workers,
                        instances: envoy_workers.map(|_| 32),
                        reused_percent: runs.map(|_| 200),
                        restart_after: runs.map(|_| 30),
                    };
                    assert!(
                        matches!(parse(routing.to_args()), BenchCommand::Routing(r) if r == routing)
                    );
                }
            }
        }
    }

    #[test]
    fn workloads_and_peers_take_comma_lists() {
        let args = [
            "routing",
            "--workloads",
            "sharegpt,rag",
            "--workload",
            "multi-turn",
        ]
        .into_iter()
        .chain(["--peers", "sglang,random", "--runs", "2"])
        .map(String::from)
        .collect();
        let BenchCommand::Routing(r) = parse(args) else {
            panic!("not routing");
        };
        assert_eq!(r.workload, ["sharegpt", "rag", "multi-turn"]);
        assert_eq!(
            r.peers,
            [
                Peer::SglangCacheAware,
                Peer::Filter(super::super::fleet::Strategy::Random)
            ]
        );
        assert_eq!(r.runs, Some(2));
    }

    #[test]
    fn unknown_workloads_and_peers_are_refused_at_parse_time() {
        for (flag, list) in [
            ("--workloads", "sharegpt,sharegtp"),
            ("--workload", "rag,"),
            ("--peers", "prefix-aware,two-envoys"),
            ("--peers", "random,baseline-oracle"),
        ] {
            let args = ["bench", "routing", flag, list];
            let error = BenchCli::try_parse_from(args).expect_err(list);
            let bad = list.rsplit(',').next().unwrap();
            assert!(error.to_string().contains(&format!("{bad:?}")), "{error}");
        }
    }
}
