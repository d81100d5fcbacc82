//! `bench overhead`: what the filter adds to each request. The same Envoy
//! configuration (`envoy/envoy.yaml`) runs four ways in front of the same
//! fleet of 7 instant upstreams (listed as `instances`, as the shipped
//! configuration lists its 7): without the filter, with the filter routing
//! (PREFIX_AWARE, as shipped: listener filter and the cluster's upstream
//! filter), with the filter counting in the listener alone (PREFIX_AWARE,
//! `counting: LISTENER`, no upstream filter), and with the floor filter
//! (`tools/floor-filter`: the least a prefix router can do in proxy-wasm, in
//! the listener only), which tells what proxy-wasm costs on this machine apart
//! from what this filter adds to it. With `--baseline-wasm`, a fifth: another
//! build of the filter as shipped, so that two builds compare request by
//! request in one run rather than across runs on a noisy machine.
//! - latency: one request at a time per configuration, interleaved request by
//!   request across the configurations (so all see the same machine noise);
//!   each request's latency is its own cost, not queueing behind others;
//! - throughput: a closed loop at a concurrency that saturates Envoy's worker,
//!   in rounds that rotate the order of the configurations.
//!
//! Added latency is a configuration's percentile minus the no-filter one over
//! all rounds' samples pooled; the throughput ratio is the median over rounds
//! of that round's requests per second over the no-filter one. Envoy's own CPU
//! time per request, over the throughput phases and over the latency phases
//! (one request at a time, where every request starts on cold caches and costs
//! several times more), tells CPU cost apart from waiting.
//!
//! Then what `engine_load` costs, in front of as many upstreams serving
//! `/metrics` ([`super::engine_overhead`]): under requests and idle.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use bytes::Bytes;
use serde::Serialize;
use serde_json::json;

use super::closed_loop::{self, PhaseResult, Target};
use super::cpu::process_cpu_ns;
use super::instant_upstream::{CountsSnapshot, InstantFleet, FLEET_SIZE};
use super::stats::{median, percentile, sorted};
use super::{bodies, load_average};
use crate::envoy::{Envoy, EnvoyBuilder, ENVOY_VERSION};

/// The filter's default key header (the upstream counts requests carrying it).
const KEY_HEADER: &str = "x-prefix-route-key";

/// How long and how hard to measure.
#[derive(Debug, Clone)]
pub struct OverheadOptions {
    pub quick: bool,
    /// Rounds per case; each measures every configuration.
    pub rounds: usize,
    /// Length of one round's interleaved latency phase (all configurations).
    pub latency_phase: Duration,
    /// Length of one round's throughput phase, per configuration.
    pub throughput_phase: Duration,
    /// Warm-up per configuration and case, not measured.
    pub warmup: Duration,
    pub throughput_concurrency: usize,
    /// Envoy worker threads.
    pub envoy_workers: u32,
    /// The .wasm (default: the launcher's [`crate::envoy::wasm_path`]).
    pub wasm: Option<PathBuf>,
    /// The floor filter's .wasm (default: [`crate::envoy::floor_wasm_path`]).
    pub floor_wasm: Option<PathBuf>,
    /// The engine-load idle measurement: windows of this length, all idle
    /// Envoys measured over the same windows.
    pub idle_window: Duration,
    pub idle_windows: usize,
    /// The PREFIX_AWARE configurations' `match`; the filter's default if None.
    pub matching: Option<String>,
    /// Another build of the filter, measured as shipped beside the others.
    pub baseline_wasm: Option<PathBuf>,
    /// Plugin configuration fields set on the baseline (with no
    /// `baseline_wasm`, this build's): one configuration beside another.
    pub baseline_config: Option<serde_json::Map<String, serde_json::Value>>,
    /// Upstreams in the fleet, all listed as `instances`.
    pub instances: usize,
}

impl OverheadOptions {
    /// About 3 minutes on 2 cores.
    pub fn full() -> Self {
        OverheadOptions {
            quick: false,
            rounds: 8,
            latency_phase: Duration::from_millis(1500),
            throughput_phase: Duration::from_millis(750),
            warmup: Duration::from_millis(500),
            throughput_concurrency: 8,
            envoy_workers: 1,
            wasm: None,
            floor_wasm: None,
            idle_window: Duration::from_secs(10),
            idle_windows: 3,
            matching: None,
            baseline_wasm: None,
            baseline_config: None,
            instances: FLEET_SIZE,
        }
    }

    /// Under a minute.
    pub fn quick() -> Self {
        OverheadOptions {
            quick: true,
            rounds: 3,
            latency_phase: Duration::from_millis(800),
            throughput_phase: Duration::from_millis(300),
            warmup: Duration::from_millis(300),
            idle_window: Duration::from_secs(5),
            idle_windows: 2,
            ..Self::full()
        }
    }
}

/// One request shape to measure.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: &'static str,
    /// `invoke` or `chat`.
    pub api: &'static str,
    pub path: &'static str,
    pub body_bytes: usize,
    /// The filter's `prefix_length` for this case.
    pub prefix_length: usize,
    /// The target for the added p50, if the case has one.
    pub target: Option<P50Target>,
    /// The body asks for a streamed answer (the upstreams send an event
    /// stream, its usage in the last event).
    pub stream: bool,
}

/// A case's target for the p50 the filter adds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum P50Target {
    /// At most the floor filter's p50 added plus this many µs.
    OverFloor(f64),
    /// At most this many µs.
    AtMost(f64),
}

impl P50Target {
    /// The most p50 added that meets it, given the floor filter's.
    pub fn limit_us(self, floor_p50_added_us: f64) -> f64 {
        match self {
            P50Target::OverFloor(us) => floor_p50_added_us + us,
            P50Target::AtMost(us) => us,
        }
    }
}

/// The overhead benchmark's six cases.
pub fn cases() -> Vec<Case> {
    const KIB: usize = 1024;
    vec![
        Case {
            name: "invoke-8KiB-prefix-4KiB",
            api: "invoke",
            path: "/invocations",
            body_bytes: 8 * KIB,
            prefix_length: 4096,
            target: Some(P50Target::OverFloor(100.0)),
            stream: false,
        },
        Case {
            name: "invoke-256KiB-prefix-64KiB",
            api: "invoke",
            path: "/invocations",
            body_bytes: 256 * KIB,
            prefix_length: 65536,
            target: None,
            stream: false,
        },
        Case {
            name: "chat-8KiB",
            api: "chat",
            path: "/v1/chat/completions",
            body_bytes: 8 * KIB,
            prefix_length: 4096,
            target: Some(P50Target::OverFloor(100.0)),
            stream: false,
        },
        Case {
            name: "chat-8KiB-stream",
            api: "chat",
            path: "/v1/chat/completions",
            body_bytes: 8 * KIB,
            prefix_length: 4096,
            target: None,
            stream: true,
        },
        Case {
            name: "chat-64KiB",
            api: "chat",
            path: "/v1/chat/completions",
            body_bytes: 64 * KIB,
            prefix_length: 4096,
            target: None,
            stream: false,
        },
        Case {
            name: "chat-1MiB",
            api: "chat",
            path: "/v1/chat/completions",
            body_bytes: 1024 * KIB,
            prefix_length: 4096,
            target: Some(P50Target::AtMost(600.0)),
            stream: false,
        },
    ]
}

impl Case {
    fn body(&self) -> Bytes {
        let body = match self.api {
            "invoke" => bodies::invoke_body(self.body_bytes, 42),
            _ => bodies::chat_body(self.body_bytes, 42),
        };
        if !self.stream {
            return Bytes::from(body);
        }
        // The same size: `"stream":false` becomes `"stream":true ` .
        let text = String::from_utf8(body).unwrap_or_default();
        Bytes::from(text.replacen(r#""stream":false"#, r#""stream":true "#, 1))
    }
}

/// One configuration's figures in one case, all rounds pooled.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SideFigures {
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    /// Requests per second at the throughput concurrency (median over rounds).
    pub rps: f64,
    /// Envoy's CPU time (all threads) per request over the throughput phases.
    pub cpu_us_per_request: f64,
    /// The same over the latency phases, one request at a time: what the
    /// latency can be made of; more than under throughput where every request
    /// starts on cold caches.
    pub cpu_us_per_request_one_at_a_time: f64,
    pub latency_samples: usize,
    pub failures: u64,
    /// Fraction of requests that reached the upstream with the key header.
    pub keyed_fraction: f64,
}

/// One case's result (`cases[]` in `overhead.json`).
#[derive(Debug, Clone, Serialize)]
pub struct CaseResult {
    pub name: String,
    pub api: String,
    pub path: String,
    pub body_bytes: usize,
    pub prefix_length: usize,
    /// PREFIX_AWARE filter minus no filter, p50 of per-request latency.
    pub p50_added_us: f64,
    pub p99_added_us: f64,
    /// PREFIX_AWARE filter over no filter, requests per second at saturation.
    pub rps_ratio: f64,
    /// PREFIX_AWARE filter minus no filter, Envoy CPU time per request.
    pub cpu_added_us: f64,
    /// The same over the latency phases (one request at a time).
    pub cpu_added_one_at_a_time_us: f64,
    /// PREFIX_AWARE minus the floor filter, p50: what this filter adds over
    /// the least a proxy-wasm prefix router costs.
    pub p50_added_over_floor_us: f64,
    /// The same as above for the floor filter.
    pub floor_p50_added_us: f64,
    pub floor_p99_added_us: f64,
    pub floor_rps_ratio: f64,
    pub floor_cpu_added_us: f64,
    pub floor_cpu_added_one_at_a_time_us: f64,
    /// The same for PREFIX_AWARE with `counting: LISTENER` (listener filter
    /// only), and whether its p50 added meets the case's target.
    pub listener_p50_added_us: f64,
    pub listener_p99_added_us: f64,
    pub listener_rps_ratio: f64,
    pub listener_cpu_added_us: f64,
    pub listener_cpu_added_one_at_a_time_us: f64,
    pub listener_target_met: Option<bool>,
    /// Per-round p50 added (PREFIX_AWARE): the spread shows the noise.
    pub p50_added_us_rounds: Vec<f64>,
    pub rps_ratio_rounds: Vec<f64>,
    /// The most p50 added that meets the case's target (for a target over
    /// the floor, `target_p50_added_us_over_floor` plus the floor's).
    pub target_p50_added_us: Option<f64>,
    pub target_p50_added_us_over_floor: Option<f64>,
    pub target_met: Option<bool>,
    pub without_filter: SideFigures,
    pub floor_filter: SideFigures,
    pub listener_counting: SideFigures,
    pub with_filter: SideFigures,
    /// The baseline (`--baseline-wasm`, `--baseline-config`), when given.
    pub baseline: Option<BaselineFigures>,
}

/// The baseline (the `--baseline-wasm` build, or this one, with
/// `--baseline-config`'s fields), beside this build in the same rounds
/// (`baseline` in `cases[]`).
#[derive(Debug, Clone, Serialize)]
pub struct BaselineFigures {
    /// This build's p50 minus the baseline's, all rounds pooled: negative
    /// when this build adds less.
    pub p50_shipped_minus_baseline_us: f64,
    /// The same per round (its spread is the run's noise).
    pub p50_shipped_minus_baseline_us_rounds: Vec<f64>,
    /// The baseline minus no filter, as for this build.
    pub p50_added_us: f64,
    pub p50_added_over_floor_us: f64,
    pub cpu_added_us: f64,
    pub cpu_added_one_at_a_time_us: f64,
    pub rps_ratio: f64,
    pub figures: SideFigures,
}

/// The whole `overhead.json`.
#[derive(Debug, Clone, Serialize)]
pub struct OverheadReport {
    pub benchmark: &'static str,
    pub quick: bool,
    /// The PREFIX_AWARE configurations' `match` (null: the filter's default).
    #[serde(rename = "match")]
    pub matching: Option<String>,
    pub envoy_version: &'static str,
    pub envoy_workers: u32,
    pub client: String,
    pub rounds: usize,
    pub latency_concurrency: usize,
    pub throughput_concurrency: usize,
    pub latency_phase_ms: u64,
    pub throughput_phase_ms: u64,
    pub cpus: usize,
    pub load_average_start: Option<[f64; 3]>,
    pub load_average_end: Option<[f64; 3]>,
    pub duration_s: f64,
    pub cases: Vec<CaseResult>,
    /// What polling the engines' `/metrics` costs (`engine_load`).
    pub engine_load: Option<super::engine_overhead::EngineLoadOverhead>,
}

/// The configurations compared, in the order of the measurement arrays.
const WITHOUT: usize = 0;
const FLOOR: usize = 1;
const LISTENER: usize = 2;
const WITH: usize = 3;
/// With `--baseline-wasm` only.
const BASELINE: usize = 4;

/// Runs every case; `progress` receives a line per step.
pub fn run(
    opts: &OverheadOptions,
    progress: &mut dyn FnMut(&str),
) -> anyhow::Result<OverheadReport> {
    let started = Instant::now();
    let load_average_start = load_average();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the client runtime")?;
    let floor_wasm = match &opts.floor_wasm {
        Some(path) => path.clone(),
        None => crate::envoy::require_floor_wasm()?,
    };
    let fleet = InstantFleet::start_sized(opts.instances, KEY_HEADER, None)?;
    let addrs = fleet.addrs();
    let without = start_envoy(opts, None, &addrs)?;
    let mut results = Vec::new();
    for case in cases() {
        progress(&format!(
            "{}: {} bytes to {}, prefix_length {}",
            case.name, case.body_bytes, case.path, case.prefix_length
        ));
        let with = start_envoy(
            opts,
            Some(prefix_aware_config(opts, case.prefix_length, &addrs)),
            &addrs,
        )?;
        let listener = start_listener_counting_envoy(opts, case.prefix_length, &addrs)?;
        let floor = start_floor_envoy(opts, &floor_wasm, case.prefix_length, &addrs)?;
        let baseline = if opts.baseline_wasm.is_some() || opts.baseline_config.is_some() {
            let mut config = prefix_aware_config(opts, case.prefix_length, &addrs);
            for (field, value) in opts.baseline_config.iter().flatten() {
                config[field] = value.clone();
            }
            Some(start_from(
                &OverheadOptions {
                    wasm: opts.baseline_wasm.clone().or_else(|| opts.wasm.clone()),
                    ..opts.clone()
                },
                envoy_builder(opts, &addrs),
                Some(config),
            )?)
        } else {
            None
        };
        let mut envoys = vec![&without, &floor, &listener, &with];
        envoys.extend(baseline.as_ref());
        let result = measure_case(&runtime, opts, &case, &envoys, &fleet)
            .with_context(|| format!("case {}", case.name))?;
        progress(&format!(
            "  p50 without {:.0} / floor {:.0} / listener counting {:.0} / as shipped {:.0} µs (added: floor +{:.0}, listener +{:.0}, shipped +{:.0}), p99 added +{:.0} / +{:.0}, rps ratio x{:.3} / x{:.3}, Envoy CPU per request {:.0} µs without (added: floor +{:.0}, listener +{:.0}, shipped +{:.0})",
            result.without_filter.p50_us,
            result.floor_filter.p50_us,
            result.listener_counting.p50_us,
            result.with_filter.p50_us,
            result.floor_p50_added_us,
            result.listener_p50_added_us,
            result.p50_added_us,
            result.listener_p99_added_us,
            result.p99_added_us,
            result.listener_rps_ratio,
            result.rps_ratio,
            result.without_filter.cpu_us_per_request,
            result.floor_cpu_added_us,
            result.listener_cpu_added_us,
            result.cpu_added_us,
        ));
        progress(&format!(
            "  Envoy CPU per request one at a time {:.0} µs without (added: floor +{:.0}, listener +{:.0}, shipped +{:.0})",
            result.without_filter.cpu_us_per_request_one_at_a_time,
            result.floor_cpu_added_one_at_a_time_us,
            result.listener_cpu_added_one_at_a_time_us,
            result.cpu_added_one_at_a_time_us,
        ));
        if let Some(baseline) = &result.baseline {
            progress(&format!(
                "  baseline build as shipped: p50 added +{:.0} µs (over the floor +{:.0}), Envoy CPU per request added +{:.0}; this build minus the baseline, p50: {:+.0} µs (per round: {})",
                baseline.p50_added_us,
                baseline.p50_added_over_floor_us,
                baseline.cpu_added_us,
                baseline.p50_shipped_minus_baseline_us,
                rounds_text(&baseline.p50_shipped_minus_baseline_us_rounds),
            ));
        }
        results.push(result);
    }
    drop(without);
    let engine_load = super::engine_overhead::run(&runtime, opts, progress)?;
    Ok(OverheadReport {
        benchmark: "overhead",
        quick: opts.quick,
        matching: opts.matching.clone(),
        envoy_version: ENVOY_VERSION,
        envoy_workers: opts.envoy_workers,
        client: format!(
            "hyper 1 HTTP/1.1 keep-alive, tokio current-thread runtime (1 thread); \
             upstreams: {}, listed as `instances`, hyper on one current-thread \
             runtime, each reads the body, answers 200",
            opts.instances
        ),
        rounds: opts.rounds,
        latency_concurrency: 1,
        throughput_concurrency: opts.throughput_concurrency,
        latency_phase_ms: opts.latency_phase.as_millis() as u64,
        throughput_phase_ms: opts.throughput_phase.as_millis() as u64,
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average_start,
        load_average_end: load_average(),
        duration_s: started.elapsed().as_secs_f64(),
        cases: results,
        engine_load: Some(engine_load),
    })
}

/// Which configuration [`load_for_profiling`] drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Configuration {
    Without,
    Idle,
    With,
}

/// For profiling: starts one configuration for `case_name`, warms it up, calls
/// `on_ready` with Envoy's pid (attach `perf record -p PID` there), then keeps
/// it under throughput load for `duration`; returns the requests per second.
pub fn load_for_profiling(
    opts: &OverheadOptions,
    case_name: &str,
    configuration: Configuration,
    duration: Duration,
    on_ready: &mut dyn FnMut(u32),
) -> anyhow::Result<f64> {
    let case = cases()
        .into_iter()
        .find(|c| c.name == case_name)
        .ok_or_else(|| anyhow::anyhow!("no case {case_name}"))?;
    let fleet = InstantFleet::start_sized(opts.instances, KEY_HEADER, None)?;
    let addrs = fleet.addrs();
    let plugin_config = match configuration {
        Configuration::Without => None,
        Configuration::Idle => Some(json!({"strategy": "RANDOM", "key_header": KEY_HEADER})),
        Configuration::With => Some(prefix_aware_config(opts, case.prefix_length, &addrs)),
    };
    let envoy = start_envoy(opts, plugin_config, &addrs)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let target = Target {
        addr: envoy.listener_addr(),
        path: case.path.to_string(),
        body: case.body(),
    };
    let warmup = runtime.block_on(closed_loop::run(
        &target,
        opts.throughput_concurrency,
        opts.warmup,
    ))?;
    check(&warmup, "warm-up")?;
    on_ready(envoy.pid().unwrap_or_default());
    let phase = runtime.block_on(closed_loop::run(
        &target,
        opts.throughput_concurrency,
        duration,
    ))?;
    check(&phase, "load")?;
    Ok(phase.rps())
}

/// The plugin configuration of the PREFIX_AWARE configurations.
fn prefix_aware_config(
    opts: &OverheadOptions,
    prefix_length: usize,
    fleet: &[SocketAddr],
) -> serde_json::Value {
    let mut config = json!({
        "strategy": "PREFIX_AWARE",
        "prefix_length": prefix_length,
        "key_header": KEY_HEADER,
        "instances": fleet.iter().map(SocketAddr::to_string).collect::<Vec<_>>(),
    });
    if let Some(matching) = &opts.matching {
        config["match"] = json!(matching);
    }
    config
}

/// Envoy from `envoy/envoy.yaml`, with the plugin configuration given, or without the filter.
fn start_envoy(
    opts: &OverheadOptions,
    plugin_config: Option<serde_json::Value>,
    fleet: &[SocketAddr],
) -> anyhow::Result<Envoy> {
    start_from(opts, envoy_builder(opts, fleet), plugin_config)
}

/// `builder` with this filter (its .wasm from `opts`) and `plugin_config`,
/// or without the filter.
fn start_from(
    opts: &OverheadOptions,
    mut builder: EnvoyBuilder,
    plugin_config: Option<serde_json::Value>,
) -> anyhow::Result<Envoy> {
    match plugin_config {
        Some(plugin_config) => {
            if let Some(wasm) = &opts.wasm {
                builder = builder.wasm(wasm);
            }
            builder = builder.plugin_config_json(&plugin_config);
        }
        None => builder = builder.without_filter(),
    }
    Ok(builder.start()?)
}

/// What every configuration shares: `envoy/envoy.yaml` in front of `fleet`.
fn envoy_builder(opts: &OverheadOptions, fleet: &[SocketAddr]) -> EnvoyBuilder {
    Envoy::builder()
        .upstreams(fleet.iter().copied())
        .concurrency(opts.envoy_workers)
        .log_level("warning")
}

/// Envoy from `envoy/envoy.yaml` with this filter in the listener only,
/// PREFIX_AWARE and `counting: LISTENER`.
fn start_listener_counting_envoy(
    opts: &OverheadOptions,
    prefix_length: usize,
    fleet: &[SocketAddr],
) -> anyhow::Result<Envoy> {
    let mut config = prefix_aware_config(opts, prefix_length, fleet);
    config["counting"] = json!("LISTENER");
    let builder = envoy_builder(opts, fleet).listener_filter_only();
    start_from(opts, builder, Some(config))
}

/// Envoy from `envoy/envoy.yaml` with the floor filter in the listener only
/// (it counts nothing, so it has no upstream position).
fn start_floor_envoy(
    opts: &OverheadOptions,
    floor_wasm: &std::path::Path,
    prefix_length: usize,
    fleet: &[SocketAddr],
) -> anyhow::Result<Envoy> {
    Ok(envoy_builder(opts, fleet)
        .listener_filter_only()
        .wasm(floor_wasm)
        .plugin_config(prefix_length.to_string())
        .start()?)
}

/// Samples of one configuration over the rounds.
#[derive(Default)]
pub(super) struct Side {
    pub latencies_us: Vec<f64>,
    pub round_p50_us: Vec<f64>,
    pub round_rps: Vec<f64>,
    /// Envoy CPU time over the throughput phases (whose requests `counts` has).
    pub cpu_ns: u64,
    /// Envoy CPU time over the latency phases (one request per sample).
    pub one_at_a_time_cpu_ns: u64,
    pub failures: u64,
    pub counts: CountsSnapshot,
}

impl Side {
    /// Per round: this side's p50 minus `other`'s (same rounds, same noise).
    pub(super) fn round_p50_minus(&self, other: &Side) -> Vec<f64> {
        self.round_p50_us
            .iter()
            .zip(&other.round_p50_us)
            .map(|(mine, theirs)| mine - theirs)
            .collect()
    }

    /// Per round: this side's requests per second over `other`'s (0 where
    /// `other` completed none).
    pub(super) fn round_rps_over(&self, other: &Side) -> Vec<f64> {
        self.round_rps
            .iter()
            .zip(&other.round_rps)
            .map(|(mine, theirs)| if *theirs > 0.0 { mine / theirs } else { 0.0 })
            .collect()
    }

    /// Adds one latency phase, which used `cpu_ns` of this side's Envoy.
    pub(super) fn record_latency(&mut self, phase: PhaseResult, cpu_ns: u64) -> anyhow::Result<()> {
        check(&phase, "latency phase")?;
        self.one_at_a_time_cpu_ns += cpu_ns;
        self.round_p50_us
            .push(percentile(&sorted(phase.latencies_us.clone()), 50.0));
        self.failures += phase.failures;
        self.latencies_us.extend(phase.latencies_us);
        Ok(())
    }

    /// Adds one throughput phase: what the upstreams `seen` (requests of
    /// `body_bytes` each) and the `cpu_ns` this side's Envoy used. Fails if
    /// a body did not arrive whole; returns whether the requests carried the
    /// key header as this side should (`plain`: Envoy without a filter,
    /// none does; otherwise every one).
    pub(super) fn record_throughput(
        &mut self,
        phase: &PhaseResult,
        seen: CountsSnapshot,
        cpu_ns: u64,
        body_bytes: usize,
        plain: bool,
    ) -> anyhow::Result<bool> {
        check(phase, "throughput phase")?;
        self.counts.keyed += seen.keyed;
        self.counts.unkeyed += seen.unkeyed;
        self.counts.body_bytes += seen.body_bytes;
        self.round_rps.push(phase.rps());
        self.cpu_ns += cpu_ns;
        self.failures += phase.failures;
        let expected = seen.keyed + seen.unkeyed;
        if seen.body_bytes != expected * body_bytes as u64 {
            bail!(
                "the upstreams received {} body bytes in {expected} requests of {body_bytes} bytes",
                seen.body_bytes
            );
        }
        Ok(if plain {
            seen.keyed == 0
        } else {
            seen.unkeyed == 0
        })
    }
}

/// Measures `envoys` (without, floor, listener counting, as shipped, and the
/// baseline build if given) over the rounds.
fn measure_case(
    runtime: &tokio::runtime::Runtime,
    opts: &OverheadOptions,
    case: &Case,
    envoys: &[&Envoy],
    fleet: &InstantFleet,
) -> anyhow::Result<CaseResult> {
    let count = envoys.len();
    let targets = warmed_targets(runtime, opts, envoys, case.path, case.body())?;
    let mut sides: Vec<Side> = envoys.iter().map(|_| Side::default()).collect();
    let mut keyed_ok = vec![true; count];
    for round in 0..opts.rounds {
        // The key header tells which configuration a request went through only
        // per phase, so count the interleaved phase in aggregate.
        let cpu_before = envoys_cpu_ns(envoys)?;
        let latency = runtime.block_on(closed_loop::interleaved(&targets, opts.latency_phase))?;
        let cpu_after = envoys_cpu_ns(envoys)?;
        for (index, (side, phase)) in sides.iter_mut().zip(latency).enumerate() {
            side.record_latency(phase, cpu_after[index].saturating_sub(cpu_before[index]))?;
        }
        for step in 0..count {
            let index = (round + step) % count;
            let before = fleet.counts();
            let cpu_before = envoy_cpu_ns(envoys[index])?;
            let throughput = runtime.block_on(closed_loop::run(
                &targets[index],
                opts.throughput_concurrency,
                opts.throughput_phase,
            ))?;
            let cpu_used = envoy_cpu_ns(envoys[index])?.saturating_sub(cpu_before);
            let seen = fleet.counts().since(before);
            keyed_ok[index] &= sides[index].record_throughput(
                &throughput,
                seen,
                cpu_used,
                case.body_bytes,
                index == WITHOUT,
            )?;
        }
    }
    if keyed_ok.contains(&false) {
        bail!(
            "the filters did not behave as configured: every request through a filter must carry \
             {KEY_HEADER}, none through plain Envoy \
             (without, floor, listener counting, as shipped, baseline if given: {keyed_ok:?})"
        );
    }
    let figures: Vec<SideFigures> = sides.iter().map(figures).collect();
    let added =
        |index: usize, p: fn(&SideFigures) -> f64| p(&figures[index]) - p(&figures[WITHOUT]);
    let ratio_rounds = |index: usize| sides[index].round_rps_over(&sides[WITHOUT]);
    let p50_added_us = added(WITH, |f| f.p50_us);
    let listener_p50_added_us = added(LISTENER, |f| f.p50_us);
    let cpu_added = |index: usize| added(index, |f| f.cpu_us_per_request);
    let cpu_added_one_at_a_time =
        |index: usize| added(index, |f| f.cpu_us_per_request_one_at_a_time);
    let rps_ratio_rounds = ratio_rounds(WITH);
    let floor_p50_added_us = added(FLOOR, |f| f.p50_us);
    let target_p50_added_us = case.target.map(|t| t.limit_us(floor_p50_added_us));
    let baseline = (count > BASELINE).then(|| BaselineFigures {
        p50_shipped_minus_baseline_us: figures[WITH].p50_us - figures[BASELINE].p50_us,
        p50_shipped_minus_baseline_us_rounds: sides[WITH].round_p50_minus(&sides[BASELINE]),
        p50_added_us: added(BASELINE, |f| f.p50_us),
        p50_added_over_floor_us: figures[BASELINE].p50_us - figures[FLOOR].p50_us,
        cpu_added_us: cpu_added(BASELINE),
        cpu_added_one_at_a_time_us: cpu_added_one_at_a_time(BASELINE),
        rps_ratio: median(&ratio_rounds(BASELINE)),
        figures: figures[BASELINE].clone(),
    });
    Ok(CaseResult {
        name: case.name.to_string(),
        api: case.api.to_string(),
        path: case.path.to_string(),
        body_bytes: case.body_bytes,
        prefix_length: case.prefix_length,
        p50_added_us,
        p99_added_us: added(WITH, |f| f.p99_us),
        rps_ratio: median(&rps_ratio_rounds),
        cpu_added_us: cpu_added(WITH),
        cpu_added_one_at_a_time_us: cpu_added_one_at_a_time(WITH),
        p50_added_over_floor_us: figures[WITH].p50_us - figures[FLOOR].p50_us,
        floor_p50_added_us,
        floor_p99_added_us: added(FLOOR, |f| f.p99_us),
        floor_rps_ratio: median(&ratio_rounds(FLOOR)),
        floor_cpu_added_us: cpu_added(FLOOR),
        floor_cpu_added_one_at_a_time_us: cpu_added_one_at_a_time(FLOOR),
        listener_p50_added_us,
        listener_p99_added_us: added(LISTENER, |f| f.p99_us),
        listener_rps_ratio: median(&ratio_rounds(LISTENER)),
        listener_cpu_added_us: cpu_added(LISTENER),
        listener_cpu_added_one_at_a_time_us: cpu_added_one_at_a_time(LISTENER),
        listener_target_met: target_p50_added_us.map(|t| listener_p50_added_us <= t),
        p50_added_us_rounds: sides[WITH].round_p50_minus(&sides[WITHOUT]),
        rps_ratio_rounds,
        target_p50_added_us,
        target_p50_added_us_over_floor: match case.target {
            Some(P50Target::OverFloor(over)) => Some(over),
            _ => None,
        },
        target_met: target_p50_added_us.map(|t| p50_added_us <= t),
        without_filter: figures[WITHOUT].clone(),
        floor_filter: figures[FLOOR].clone(),
        listener_counting: figures[LISTENER].clone(),
        with_filter: figures[WITH].clone(),
        baseline,
    })
}

/// Per-round figures, rounded, comma-separated.
fn rounds_text(rounds: &[f64]) -> String {
    let rounded: Vec<String> = rounds.iter().map(|r| format!("{r:+.0}")).collect();
    rounded.join(", ")
}

/// Envoy's CPU time so far (all threads).
/// One target per Envoy, each sending `body` to `path`, warmed up (not
/// measured) for `opts.warmup` at the throughput concurrency.
pub(super) fn warmed_targets<E: std::borrow::Borrow<Envoy>>(
    runtime: &tokio::runtime::Runtime,
    opts: &OverheadOptions,
    envoys: &[E],
    path: &str,
    body: Bytes,
) -> anyhow::Result<Vec<Target>> {
    let targets: Vec<Target> = envoys
        .iter()
        .map(|envoy| Target {
            addr: envoy.borrow().listener_addr(),
            path: path.to_string(),
            body: body.clone(),
        })
        .collect();
    for target in &targets {
        let warmup = runtime.block_on(closed_loop::run(
            target,
            opts.throughput_concurrency,
            opts.warmup,
        ))?;
        check(&warmup, "warm-up")?;
    }
    Ok(targets)
}

pub(super) fn envoy_cpu_ns(envoy: &Envoy) -> anyhow::Result<u64> {
    let pid = envoy.pid().context("Envoy exited during the benchmark")?;
    process_cpu_ns(pid)
}

/// Each Envoy's CPU time so far, in the order given.
fn envoys_cpu_ns(envoys: &[&Envoy]) -> anyhow::Result<Vec<u64>> {
    envoys.iter().map(|envoy| envoy_cpu_ns(envoy)).collect()
}

pub(super) fn check(phase: &PhaseResult, what: &str) -> anyhow::Result<()> {
    if phase.latencies_us.is_empty() || phase.failures > 0 {
        bail!(
            "{what}: {} requests succeeded, {} failed (first failure: {})",
            phase.latencies_us.len(),
            phase.failures,
            phase.first_failure.as_deref().unwrap_or("none")
        );
    }
    Ok(())
}

pub(super) fn figures(side: &Side) -> SideFigures {
    let samples = sorted(side.latencies_us.clone());
    let requests = side.counts.keyed + side.counts.unkeyed;
    SideFigures {
        p50_us: percentile(&samples, 50.0),
        p90_us: percentile(&samples, 90.0),
        p99_us: percentile(&samples, 99.0),
        rps: median(&side.round_rps),
        cpu_us_per_request: per_request(side.cpu_ns as f64 / 1_000.0, requests),
        cpu_us_per_request_one_at_a_time: per_request(
            side.one_at_a_time_cpu_ns as f64 / 1_000.0,
            samples.len() as u64,
        ),
        latency_samples: samples.len(),
        failures: side.failures,
        keyed_fraction: per_request(side.counts.keyed as f64, requests),
    }
}

/// `total` over `requests`, 0 without requests.
fn per_request(total: f64, requests: u64) -> f64 {
    if requests > 0 {
        total / requests as f64
    } else {
        0.0
    }
}

/// The results as a markdown table.
pub fn markdown(report: &OverheadReport) -> String {
    let mut out = String::new();
    out.push_str(
        "| case | body | prefix_length | p50 without (µs) | p50 added: as shipped / `counting: LISTENER` / floor (µs) | p99 added: as shipped / LISTENER (µs) | rps ratio: as shipped / LISTENER | Envoy CPU per request without (µs) | CPU added: as shipped / LISTENER / floor (µs) | CPU added one at a time: as shipped / LISTENER / floor (µs) | target p50 added: as shipped / LISTENER |\n",
    );
    out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for case in &report.cases {
        let verdict = |met: Option<bool>| match met {
            Some(true) => "met",
            Some(false) => "**missed**",
            None => "-",
        };
        let target = match case.target_p50_added_us {
            Some(t) => format!(
                "≤ {t:.0} µs{}: {} / {}",
                match case.target_p50_added_us_over_floor {
                    Some(over) => format!(" (floor + {over:.0})"),
                    None => String::new(),
                },
                verdict(case.target_met),
                verdict(case.listener_target_met)
            ),
            None => "-".to_string(),
        };
        out.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} | {:.3} / {:.3} | {:.0} | +{:.0} / +{:.0} / +{:.0} | +{:.0} / +{:.0} / +{:.0} | {} |\n",
            case.name,
            human_bytes(case.body_bytes),
            case.prefix_length,
            case.without_filter.p50_us,
            case.p50_added_us,
            case.listener_p50_added_us,
            case.floor_p50_added_us,
            case.p99_added_us,
            case.listener_p99_added_us,
            case.rps_ratio,
            case.listener_rps_ratio,
            case.without_filter.cpu_us_per_request,
            case.cpu_added_us,
            case.listener_cpu_added_us,
            case.floor_cpu_added_us,
            case.cpu_added_one_at_a_time_us,
            case.listener_cpu_added_one_at_a_time_us,
            case.floor_cpu_added_one_at_a_time_us,
            target
        ));
    }
    if report.cases.iter().any(|case| case.baseline.is_some()) {
        out.push_str(
            "\nThe baseline (the `--baseline-wasm` build, or this one, with `--baseline-config`'s fields), in the same rounds:\n\n\
             | case | p50 added: this build / baseline (µs) | over the floor: this build / baseline (µs) | this build minus baseline, p50 (µs) | per round (µs) | CPU added: this build / baseline (µs) |\n\
             |---|---:|---:|---:|---|---:|\n",
        );
    }
    for case in &report.cases {
        let Some(baseline) = &case.baseline else {
            continue;
        };
        out.push_str(&format!(
            "| {} | {:.0} / {:.0} | {:.0} / {:.0} | {:+.0} | {} | {:.0} / {:.0} |\n",
            case.name,
            case.p50_added_us,
            baseline.p50_added_us,
            case.p50_added_over_floor_us,
            baseline.p50_added_over_floor_us,
            baseline.p50_shipped_minus_baseline_us,
            rounds_text(&baseline.p50_shipped_minus_baseline_us_rounds),
            case.cpu_added_us,
            baseline.cpu_added_us,
        ));
    }
    if let Some(engine_load) = &report.engine_load {
        out.push_str(&super::engine_overhead::markdown(engine_load));
    }
    out
}

fn human_bytes(bytes: usize) -> String {
    match bytes {
        b if b >= 1024 * 1024 && b % (1024 * 1024) == 0 => format!("{} MiB", b / (1024 * 1024)),
        b if b >= 1024 && b % 1024 == 0 => format!("{} KiB", b / 1024),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_match_the_issue() {
        let cases = cases();
        let names: Vec<&str> = cases.iter().map(|c| c.name).collect();
        assert_eq!(
            names,
            [
                "invoke-8KiB-prefix-4KiB",
                "invoke-256KiB-prefix-64KiB",
                "chat-8KiB",
                "chat-8KiB-stream",
                "chat-64KiB",
                "chat-1MiB"
            ]
        );
        for case in &cases {
            let body = case.body();
            assert_eq!(body.len(), case.body_bytes, "{}", case.name);
            let asked = body.windows(14).any(|w| w == br#""stream":true "#);
            assert_eq!(asked, case.stream, "{}", case.name);
        }
    }

    fn case_result(name: &str, baseline: Option<BaselineFigures>) -> CaseResult {
        CaseResult {
            name: name.to_string(),
            api: "chat".into(),
            path: "/v1/chat/completions".into(),
            body_bytes: 8192,
            prefix_length: 4096,
            p50_added_us: 120.0,
            p99_added_us: 300.0,
            rps_ratio: 0.5,
            cpu_added_us: 40.0,
            cpu_added_one_at_a_time_us: 100.0,
            p50_added_over_floor_us: 80.0,
            floor_p50_added_us: 40.0,
            floor_p99_added_us: 90.0,
            floor_rps_ratio: 0.8,
            floor_cpu_added_us: 10.0,
            floor_cpu_added_one_at_a_time_us: 30.0,
            listener_p50_added_us: 110.0,
            listener_p99_added_us: 280.0,
            listener_rps_ratio: 0.6,
            listener_cpu_added_us: 35.0,
            listener_cpu_added_one_at_a_time_us: 90.0,
            listener_target_met: Some(true),
            p50_added_us_rounds: vec![120.0],
            rps_ratio_rounds: vec![0.5],
            target_p50_added_us: Some(140.0),
            target_p50_added_us_over_floor: Some(100.0),
            target_met: Some(true),
            without_filter: SideFigures::default(),
            floor_filter: SideFigures::default(),
            listener_counting: SideFigures::default(),
            with_filter: SideFigures::default(),
            baseline,
        }
    }

    fn report(cases: Vec<CaseResult>) -> OverheadReport {
        OverheadReport {
            benchmark: "overhead",
            quick: true,
            matching: None,
            envoy_version: ENVOY_VERSION,
            envoy_workers: 1,
            client: String::new(),
            rounds: 3,
            latency_concurrency: 1,
            throughput_concurrency: 8,
            latency_phase_ms: 800,
            throughput_phase_ms: 300,
            cpus: 2,
            load_average_start: None,
            load_average_end: None,
            duration_s: 1.0,
            cases,
            engine_load: None,
        }
    }

    #[test]
    fn a_baseline_build_gets_its_own_table_with_the_difference_per_round() {
        let without = markdown(&report(vec![case_result("chat-8KiB", None)]));
        assert!(!without.contains("--baseline-wasm"), "{without}");
        let baseline = BaselineFigures {
            p50_shipped_minus_baseline_us: -14.2,
            p50_shipped_minus_baseline_us_rounds: vec![-45.0, -27.4, 13.0],
            p50_added_us: 134.2,
            p50_added_over_floor_us: 94.2,
            cpu_added_us: 47.0,
            cpu_added_one_at_a_time_us: 110.0,
            rps_ratio: 0.45,
            figures: SideFigures::default(),
        };
        let with = markdown(&report(vec![
            case_result("invoke-8KiB-prefix-4KiB", None),
            case_result("chat-8KiB", Some(baseline)),
        ]));
        assert!(
            with.contains("| chat-8KiB | 120 / 134 | 80 / 94 | -14 | -45, -27, +13 | 40 / 47 |\n"),
            "{with}"
        );
        assert!(
            !with.contains("| invoke-8KiB-prefix-4KiB | 120 / "),
            "{with}"
        );
    }

    #[test]
    fn sides_compare_round_by_round() {
        let side = |p50: &[f64], rps: &[f64]| Side {
            round_p50_us: p50.to_vec(),
            round_rps: rps.to_vec(),
            ..Side::default()
        };
        let with = side(&[130.0, 150.0, 120.0], &[500.0, 600.0, 700.0]);
        let without = side(&[100.0, 110.0, 125.0], &[1000.0, 0.0, 1400.0]);
        assert_eq!(with.round_p50_minus(&without), [30.0, 40.0, -5.0]);
        assert_eq!(with.round_rps_over(&without), [0.5, 0.0, 0.5]);
    }

    #[test]
    fn human_bytes_names_binary_units() {
        assert_eq!(human_bytes(8192), "8 KiB");
        assert_eq!(human_bytes(1 << 20), "1 MiB");
        assert_eq!(human_bytes(1000), "1000 B");
    }
}
