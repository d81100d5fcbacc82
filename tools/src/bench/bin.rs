//! `prefix-router-bench`: the benchmarks as an optimised binary (a
//! debug-built load client would measure itself). `cargo xtask bench ...`
//! builds the filter and runs this; it can also be run directly with
//! `PREFIX_ROUTER_WASM` and `ENVOY_BIN` set.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use prefix_router_tools::bench::cli::{
    BenchCli, BenchCommand as Command, OverheadArgs, RoutingArgs,
};
use prefix_router_tools::bench::{self, demo, overhead, routing};

fn main() -> ExitCode {
    let cli = BenchCli::parse();
    let outcome = match cli.command {
        Command::Overhead(args) => run_overhead(&args),
        Command::Routing(args) => run_routing(&args),
        Command::Demo => demo::run(&demo::DemoOptions::default(), &mut |line| {
            println!("{line}")
        })
        .map(|_| ()),
        Command::OverheadLoad {
            case,
            configuration,
            seconds,
            instances,
        } => run_overhead_load(&case, &configuration, seconds, instances),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("prefix-router-bench: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// `--baseline-wasm`, refused unless it names a file (checked here, not when
/// parsing, so that `cargo xtask` can hand on a path it has not built yet).
fn baseline_wasm(path: Option<&Path>) -> anyhow::Result<Option<PathBuf>> {
    match path {
        Some(wasm) if !wasm.is_file() => {
            anyhow::bail!("--baseline-wasm {}: no such file", wasm.display())
        }
        other => Ok(other.map(Path::to_path_buf)),
    }
}

/// `--baseline-config`: a JSON object, or an error saying what it is instead.
fn baseline_config(
    text: Option<&str>,
) -> anyhow::Result<Option<serde_json::Map<String, serde_json::Value>>> {
    let Some(text) = text else {
        return Ok(None);
    };
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(fields)) => Ok(Some(fields)),
        Ok(other) => {
            anyhow::bail!("--baseline-config {text}: a JSON object is needed, not {other}")
        }
        Err(error) => anyhow::bail!("--baseline-config {text}: not JSON: {error}"),
    }
}

fn run_overhead(args: &OverheadArgs) -> anyhow::Result<()> {
    let opts = overhead::OverheadOptions {
        matching: args.matching.clone(),
        baseline_wasm: baseline_wasm(args.baseline_wasm.as_deref())?,
        baseline_config: baseline_config(args.baseline_config.as_deref())?,
        instances: args.instances.map_or(
            prefix_router_tools::bench::instant_upstream::FLEET_SIZE,
            usize::from,
        ),
        ..if args.quick {
            overhead::OverheadOptions::quick()
        } else {
            overhead::OverheadOptions::full()
        }
    };
    eprintln!(
        "overhead: Envoy {} with {} worker(s) in front of {} instances, {} rounds, latency at concurrency 1 (interleaved), throughput at {}, match {}{}",
        prefix_router_tools::envoy::ENVOY_VERSION,
        opts.envoy_workers,
        opts.instances,
        opts.rounds,
        opts.throughput_concurrency,
        opts.matching.as_deref().unwrap_or("the default"),
        match (&opts.baseline_wasm, &opts.baseline_config) {
            (None, None) => String::new(),
            (wasm, config) => format!(
                ", baseline {}{}",
                wasm.as_ref()
                    .map_or_else(|| "this build".to_string(), |w| w.display().to_string()),
                config.as_ref().map_or_else(String::new, |c| format!(" with {}", serde_json::Value::Object(c.clone())))
            ),
        }
    );
    let report = overhead::run(&opts, &mut |line| eprintln!("{line}"))?;
    let path = bench::output_dir().join("overhead.json");
    bench::write_json(&report, &path)?;
    println!("{}", overhead::markdown(&report));
    println!(
        "load average {:?} -> {:?}; {:.0} s; written to {}",
        report.load_average_start.unwrap_or_default(),
        report.load_average_end.unwrap_or_default(),
        report.duration_s,
        path.display()
    );
    Ok(())
}

fn run_overhead_load(
    case: &str,
    configuration: &str,
    seconds: u64,
    instances: u16,
) -> anyhow::Result<()> {
    let configuration = match configuration {
        "without" => overhead::Configuration::Without,
        "idle" => overhead::Configuration::Idle,
        "with" => overhead::Configuration::With,
        other => anyhow::bail!("unknown configuration {other:?}: without, idle or with"),
    };
    let rps = overhead::load_for_profiling(
        &overhead::OverheadOptions {
            instances: usize::from(instances),
            ..overhead::OverheadOptions::full()
        },
        case,
        configuration,
        std::time::Duration::from_secs(seconds),
        &mut |pid| println!("envoy pid {pid}"),
    )?;
    println!("{rps:.0} requests/s");
    Ok(())
}

fn run_routing(args: &RoutingArgs) -> anyhow::Result<()> {
    let mut opts = if args.quick {
        routing::RoutingOptions::quick()?
    } else {
        routing::RoutingOptions::full()?
    };
    let only = &args.workload;
    if !only.is_empty() {
        opts.plans
            .retain(|p| only.iter().any(|w| w == p.workload.name()));
        if opts.plans.is_empty() {
            anyhow::bail!("no workload named {only:?}");
        }
    }
    if !args.peers.is_empty() {
        opts.peers = Some(args.peers.clone());
    }
    let baseline_arms = opts
        .peers
        .iter()
        .flatten()
        .any(|peer| matches!(peer, bench::peers::Peer::Baseline(_)));
    opts.baseline_wasm = baseline_wasm(args.baseline_wasm.as_deref())?;
    if baseline_arms && opts.baseline_wasm.is_none() {
        anyhow::bail!("the baseline-ARM arms need --baseline-wasm");
    }
    if let Some(runs) = args.runs {
        if runs == 0 {
            anyhow::bail!("--runs must be at least 1");
        }
        opts.runs = runs;
    }
    if let Some(workers) = args.envoy_workers {
        opts.envoy_workers = workers;
    }
    if let Some(instances) = args.instances {
        opts.instances = usize::from(instances);
    }
    if let Some(percent) = args.reused_percent {
        opts.reused_fraction = f64::from(percent) / 100.0;
    }
    opts.restart_after = args
        .restart_after
        .map(|seconds| std::time::Duration::from_secs(u64::from(seconds)));
    eprintln!(
        "routing: {} vllm-sim instances, Envoy {} with {} worker(s), time scale {}",
        opts.instances,
        prefix_router_tools::envoy::ENVOY_VERSION,
        opts.envoy_workers,
        opts.time_scale
    );
    let report = routing::run(&opts, &mut |line| eprintln!("{line}"))?;
    let dir = bench::output_dir();
    let json = dir.join("routing.json");
    bench::write_json(&report, &json)?;
    let svg = dir.join("routing.svg");
    std::fs::write(&svg, bench::chart::routing_svg(&report))?;
    println!("{}", routing::markdown(&report));
    println!(
        "load average {:?} -> {:?}; {:.0} s; written to {} and {}",
        report.load_average_start.unwrap_or_default(),
        report.load_average_end.unwrap_or_default(),
        report.duration_s,
        json.display(),
        svg.display()
    );
    Ok(())
}
