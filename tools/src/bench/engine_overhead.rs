//! `bench overhead`, engine load: what polling the engines' `/metrics`
//! (`engine_load`) costs Envoy, side by side in one run, in front of 7
//! instant upstreams (or `--instances`) that answer `GET /metrics` with a
//! vLLM-shaped body ([`super::vllm_metrics_body`]).
//! - Under requests: Envoy without the filter, with the filter at its
//!   defaults (the upstreams as `instances`), and the same plus
//!   `engine_load` (500 ms, the default interval), measured as the main
//!   cases are (latency one request at a time, interleaved across the three;
//!   throughput phases in rotating order; Envoy CPU per request over each).
//! - Idle: the filter at its defaults, with `engine_load` at 500 ms and at
//!   50 ms, and Envoy without the filter, all started and left without
//!   requests; Envoy's CPU over the same fixed windows (medians of the
//!   windows), and the polls each sent (its `prefix_router.engine.polls`).
//!   Beside them the fleet read from Envoy's admin (`discovery`, at 2 s and
//!   at 100 ms) instead of listed, with the reads each sent.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use bytes::Bytes;
use serde::Serialize;
use serde_json::json;

use super::bodies;
use super::closed_loop;
use super::engine_load::{engine_load_config, poll_counts_of, with_engine_cluster};
use super::instant_upstream::InstantFleet;
use super::overhead::{envoy_cpu_ns, figures, warmed_targets, OverheadOptions, Side, SideFigures};
use super::stats::median;
use super::vllm_metrics_body::vllm_metrics_body;
use crate::envoy::Envoy;

/// The filter's default key header (the upstreams count requests carrying it).
const KEY_HEADER: &str = "x-prefix-route-key";

/// The request measured: a chat completion of 8 KiB (within the default
/// `prefix_length`, so the whole prompt is read).
const PATH: &str = "/v1/chat/completions";
const BODY_BYTES: usize = 8 * 1024;

/// The fast interval measured idle (the least `interval_ms` takes).
pub const FAST_INTERVAL_MS: u64 = 50;

/// The configurations under requests, in the order of the arrays.
const WITHOUT: usize = 0;
const DEFAULTS: usize = 1;
const ENGINE: usize = 2;
const SIDES: usize = 3;

/// The request part's figures.
#[derive(Debug, Clone, Serialize)]
pub struct UnderRequests {
    pub path: String,
    pub body_bytes: usize,
    /// Filter at its defaults minus no filter, p50 of per-request latency.
    pub defaults_p50_added_us: f64,
    /// Defaults + engine_load minus no filter.
    pub engine_p50_added_us: f64,
    /// Defaults + engine_load minus defaults: what polling adds.
    pub engine_p50_over_defaults_us: f64,
    /// The same per round (the spread shows the noise).
    pub engine_p50_over_defaults_us_rounds: Vec<f64>,
    pub defaults_p99_added_us: f64,
    pub engine_p99_added_us: f64,
    pub defaults_cpu_added_us: f64,
    pub engine_cpu_added_us: f64,
    /// Defaults + engine_load minus defaults, Envoy CPU per request.
    pub engine_cpu_over_defaults_us: f64,
    pub defaults_cpu_added_one_at_a_time_us: f64,
    pub engine_cpu_added_one_at_a_time_us: f64,
    pub defaults_rps_ratio: f64,
    pub engine_rps_ratio: f64,
    /// `GET /metrics` the upstreams answered over the measured phases (all
    /// from the engine_load Envoy: the others do not poll).
    pub metrics_polls: u64,
    /// Seconds the measured phases lasted, for polls per second.
    pub measured_s: f64,
    pub without_filter: SideFigures,
    pub defaults: SideFigures,
    pub with_engine_load: SideFigures,
}

/// One configuration left idle.
#[derive(Debug, Clone, Serialize)]
pub struct IdleSide {
    pub configuration: String,
    /// `engine_load.interval_ms`, if it polls.
    pub interval_ms: Option<u64>,
    /// Envoy's CPU (all threads) per second of window, ms; median of windows.
    pub cpu_ms_per_s: f64,
    pub cpu_ms_per_s_windows: Vec<f64>,
    /// Polls sent per second (its `prefix_router.engine.polls`), median of windows.
    pub polls_per_s: f64,
}

/// The idle part's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Idle {
    pub window_ms: u64,
    pub windows: usize,
    pub sides: Vec<IdleSide>,
}

/// `engine_load` in `overhead.json`.
#[derive(Debug, Clone, Serialize)]
pub struct EngineLoadOverhead {
    pub upstreams: usize,
    /// Bytes of each upstream's `/metrics` answer.
    pub metrics_body_bytes: usize,
    pub metrics_body_lines: usize,
    /// Whether the engine_load Envoys polled at all (a .wasm without the
    /// poller parses `engine_load` and polls nothing).
    pub polled: bool,
    pub under_requests: UnderRequests,
    pub idle: Idle,
}

/// Runs both parts; `progress` receives a line per step.
pub fn run(
    runtime: &tokio::runtime::Runtime,
    opts: &OverheadOptions,
    progress: &mut dyn FnMut(&str),
) -> anyhow::Result<EngineLoadOverhead> {
    let body = vllm_metrics_body(3, 1, 0.42);
    let metrics = Bytes::from(body.clone());
    let fleet = InstantFleet::start_sized(opts.instances, KEY_HEADER, Some(metrics))?;
    let addrs = fleet.addrs();
    progress(&format!(
        "engine load: {} upstreams answering GET /metrics with {} bytes ({} lines) shaped as vLLM's",
        opts.instances,
        body.len(),
        body.lines().count()
    ));
    let under_requests =
        under_requests(runtime, opts, &fleet, &addrs).context("engine load under requests")?;
    progress(&format!(
        "  p50 added over no filter: defaults +{:.0} µs, + engine_load +{:.0} µs (engine_load over defaults {:+.0} µs, rounds {:?}); Envoy CPU per request added: defaults +{:.0}, + engine_load +{:.0} µs (over defaults {:+.1} µs); {} polls answered in {:.1} s",
        under_requests.defaults_p50_added_us,
        under_requests.engine_p50_added_us,
        under_requests.engine_p50_over_defaults_us,
        under_requests
            .engine_p50_over_defaults_us_rounds
            .iter()
            .map(|v| v.round())
            .collect::<Vec<_>>(),
        under_requests.defaults_cpu_added_us,
        under_requests.engine_cpu_added_us,
        under_requests.engine_cpu_over_defaults_us,
        under_requests.metrics_polls,
        under_requests.measured_s,
    ));
    let idle = idle(opts, &addrs).context("engine load idle")?;
    for side in &idle.sides {
        progress(&format!(
            "  idle {:<34} Envoy CPU {:>7.2} ms/s (windows {:?}), {:.1} polls/s",
            side.configuration,
            side.cpu_ms_per_s,
            side.cpu_ms_per_s_windows
                .iter()
                .map(|v| (v * 100.0).round() / 100.0)
                .collect::<Vec<_>>(),
            side.polls_per_s
        ));
    }
    let polled = under_requests.metrics_polls > 0
        || idle
            .sides
            .iter()
            .any(|s| s.configuration.contains("engine_load") && s.polls_per_s > 0.0);
    Ok(EngineLoadOverhead {
        upstreams: opts.instances,
        metrics_body_bytes: body.len(),
        metrics_body_lines: body.lines().count(),
        polled,
        under_requests,
        idle,
    })
}

/// The filter at its defaults in front of `addrs` (listed as `instances`,
/// which the poller polls), plus `engine_load` if `interval` is given
/// (`Some(None)`: its default interval).
fn plugin_config(addrs: &[SocketAddr], engine: Option<Option<u64>>) -> serde_json::Value {
    let mut config = json!({
        "instances": addrs.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
    });
    if let Some(interval_ms) = engine {
        config["engine_load"] = engine_load_config(interval_ms);
    }
    config
}

/// Envoy from `envoy/envoy.yaml` in front of `addrs`, with the filter as
/// `plugin_config` says (and the engine cluster), or without the filter.
fn start_envoy(
    opts: &OverheadOptions,
    addrs: &[SocketAddr],
    plugin_config: Option<serde_json::Value>,
) -> anyhow::Result<Envoy> {
    let mut builder = Envoy::builder()
        .upstreams(addrs.iter().copied())
        .concurrency(opts.envoy_workers)
        .log_level("warning");
    match plugin_config {
        Some(config) => {
            if let Some(wasm) = &opts.wasm {
                builder = builder.wasm(wasm);
            }
            if config.get("discovery").is_some() {
                builder = builder.admin_cluster("envoy_admin");
            }
            builder = with_engine_cluster(builder.plugin_config_json(&config));
        }
        None => builder = builder.without_filter(),
    }
    Ok(builder.start()?)
}

fn under_requests(
    runtime: &tokio::runtime::Runtime,
    opts: &OverheadOptions,
    fleet: &InstantFleet,
    addrs: &[SocketAddr],
) -> anyhow::Result<UnderRequests> {
    let envoys = [
        start_envoy(opts, addrs, None)?,
        start_envoy(opts, addrs, Some(plugin_config(addrs, None)))?,
        start_envoy(opts, addrs, Some(plugin_config(addrs, Some(None))))?,
    ];
    let body = Bytes::from(bodies::chat_body(BODY_BYTES, 42));
    let targets = warmed_targets(runtime, opts, &envoys, PATH, body)?;
    let mut sides: [Side; SIDES] = Default::default();
    let mut keyed_ok = [true; SIDES];
    let mut metrics_polls = 0;
    let mut measured = Duration::ZERO;
    for round in 0..opts.rounds {
        let cpu_before = cpu_of(&envoys)?;
        let polls_before = fleet.counts().metrics;
        let started = Instant::now();
        let latency = runtime.block_on(closed_loop::interleaved(&targets, opts.latency_phase))?;
        measured += started.elapsed();
        metrics_polls += fleet.counts().metrics - polls_before;
        let cpu_after = cpu_of(&envoys)?;
        for (index, (side, phase)) in sides.iter_mut().zip(latency).enumerate() {
            side.record_latency(phase, cpu_after[index].saturating_sub(cpu_before[index]))?;
        }
        for step in 0..SIDES {
            let index = (round + step) % SIDES;
            let before = fleet.counts();
            let cpu_before = envoy_cpu_ns(&envoys[index])?;
            let started = Instant::now();
            let throughput = runtime.block_on(closed_loop::run(
                &targets[index],
                opts.throughput_concurrency,
                opts.throughput_phase,
            ))?;
            measured += started.elapsed();
            let cpu_used = envoy_cpu_ns(&envoys[index])?.saturating_sub(cpu_before);
            let seen = fleet.counts().since(before);
            metrics_polls += seen.metrics;
            keyed_ok[index] &= sides[index].record_throughput(
                &throughput,
                seen,
                cpu_used,
                BODY_BYTES,
                index == WITHOUT,
            )?;
        }
    }
    if keyed_ok.contains(&false) {
        bail!(
            "every request through the filter must carry {KEY_HEADER}, none through plain Envoy \
             (without, defaults, + engine_load: {keyed_ok:?})"
        );
    }
    let figures: Vec<SideFigures> = sides.iter().map(figures).collect();
    let added =
        |index: usize, p: fn(&SideFigures) -> f64| p(&figures[index]) - p(&figures[WITHOUT]);
    let ratio = |index: usize| median(&sides[index].round_rps_over(&sides[WITHOUT]));
    Ok(UnderRequests {
        path: PATH.to_string(),
        body_bytes: BODY_BYTES,
        defaults_p50_added_us: added(DEFAULTS, |f| f.p50_us),
        engine_p50_added_us: added(ENGINE, |f| f.p50_us),
        engine_p50_over_defaults_us: figures[ENGINE].p50_us - figures[DEFAULTS].p50_us,
        engine_p50_over_defaults_us_rounds: sides[ENGINE].round_p50_minus(&sides[DEFAULTS]),
        defaults_p99_added_us: added(DEFAULTS, |f| f.p99_us),
        engine_p99_added_us: added(ENGINE, |f| f.p99_us),
        defaults_cpu_added_us: added(DEFAULTS, |f| f.cpu_us_per_request),
        engine_cpu_added_us: added(ENGINE, |f| f.cpu_us_per_request),
        engine_cpu_over_defaults_us: figures[ENGINE].cpu_us_per_request
            - figures[DEFAULTS].cpu_us_per_request,
        defaults_cpu_added_one_at_a_time_us: added(DEFAULTS, |f| {
            f.cpu_us_per_request_one_at_a_time
        }),
        engine_cpu_added_one_at_a_time_us: added(ENGINE, |f| f.cpu_us_per_request_one_at_a_time),
        defaults_rps_ratio: ratio(DEFAULTS),
        engine_rps_ratio: ratio(ENGINE),
        metrics_polls,
        measured_s: measured.as_secs_f64(),
        without_filter: figures[WITHOUT].clone(),
        defaults: figures[DEFAULTS].clone(),
        with_engine_load: figures[ENGINE].clone(),
    })
}

fn cpu_of(envoys: &[Envoy; SIDES]) -> anyhow::Result<[u64; SIDES]> {
    let mut cpu = [0; SIDES];
    for (cpu, envoy) in cpu.iter_mut().zip(envoys) {
        *cpu = envoy_cpu_ns(envoy)?;
    }
    Ok(cpu)
}

/// How long the idle Envoys run before the first window: startup, the VMs'
/// first ticks, the poller's lease and first polls are not idle cost.
const IDLE_SETTLE: Duration = Duration::from_secs(2);

fn idle(opts: &OverheadOptions, addrs: &[SocketAddr]) -> anyhow::Result<Idle> {
    let configurations: [(&str, Option<serde_json::Value>, Option<u64>); 6] = [
        ("no filter", None, None),
        ("filter defaults", Some(plugin_config(addrs, None)), None),
        (
            "defaults + engine_load (500 ms)",
            Some(plugin_config(addrs, Some(None))),
            Some(DEFAULT_INTERVAL_MS),
        ),
        (
            "defaults + engine_load (50 ms)",
            Some(plugin_config(addrs, Some(Some(FAST_INTERVAL_MS)))),
            Some(FAST_INTERVAL_MS),
        ),
        (
            DISCOVERY_DEFAULT,
            Some(discovery_config(DISCOVERY_INTERVAL_MS)),
            Some(DISCOVERY_INTERVAL_MS),
        ),
        (
            DISCOVERY_FAST,
            Some(discovery_config(DISCOVERY_FAST_INTERVAL_MS)),
            Some(DISCOVERY_FAST_INTERVAL_MS),
        ),
    ];
    let mut envoys = Vec::with_capacity(configurations.len());
    for (_, config, _) in &configurations {
        envoys.push(start_envoy(opts, addrs, config.clone())?);
    }
    std::thread::sleep(IDLE_SETTLE);
    let windows = opts.idle_windows.max(1);
    let mut cpu_windows: Vec<Vec<f64>> = vec![Vec::new(); envoys.len()];
    let mut poll_windows: Vec<Vec<f64>> = vec![Vec::new(); envoys.len()];
    for _ in 0..windows {
        let cpu_before: Vec<u64> = envoys
            .iter()
            .map(envoy_cpu_ns)
            .collect::<anyhow::Result<_>>()?;
        let polls_before: Vec<u64> = envoys.iter().map(calls_of).collect();
        let started = Instant::now();
        std::thread::sleep(opts.idle_window);
        let cpu_after: Vec<u64> = envoys
            .iter()
            .map(envoy_cpu_ns)
            .collect::<anyhow::Result<_>>()?;
        let polls_after: Vec<u64> = envoys.iter().map(calls_of).collect();
        let seconds = started.elapsed().as_secs_f64();
        for i in 0..envoys.len() {
            let cpu_ms = cpu_after[i].saturating_sub(cpu_before[i]) as f64 / 1e6;
            cpu_windows[i].push(cpu_ms / seconds);
            poll_windows[i].push(polls_after[i].saturating_sub(polls_before[i]) as f64 / seconds);
        }
    }
    let sides = configurations
        .iter()
        .zip(cpu_windows.into_iter().zip(poll_windows))
        .map(|((name, _, interval_ms), (cpu, polls))| IdleSide {
            configuration: name.to_string(),
            interval_ms: *interval_ms,
            cpu_ms_per_s: median(&cpu),
            cpu_ms_per_s_windows: cpu,
            polls_per_s: median(&polls),
        })
        .collect();
    Ok(Idle {
        window_ms: opts.idle_window.as_millis() as u64,
        windows,
        sides,
    })
}

/// `engine_load.interval_ms` when not configured (the filter's
/// `ENGINE_INTERVAL_MS_DEFAULT`; this crate does not link the filter).
const DEFAULT_INTERVAL_MS: u64 = 500;

/// The fleet read from Envoy's admin (`discovery`) instead of listed, at
/// its default interval and at a fast one.
const DISCOVERY_DEFAULT: &str = "discovery instead of instances (2000 ms)";
const DISCOVERY_FAST: &str = "discovery instead of instances (100 ms)";
const DISCOVERY_INTERVAL_MS: u64 = 2_000;
const DISCOVERY_FAST_INTERVAL_MS: u64 = 100;

/// The filter at its defaults reading the `vllm` cluster's hosts from the
/// admin through the `envoy_admin` cluster [`start_envoy`] adds.
fn discovery_config(interval_ms: u64) -> serde_json::Value {
    json!({
        "discovery": {"admin_cluster": "envoy_admin", "cluster": "vllm", "interval_ms": interval_ms},
    })
}

/// The calls an Envoy's filter sent so far: its engine polls and its reads
/// of the admin (`prefix_router.discovery.reads`).
fn calls_of(envoy: &Envoy) -> u64 {
    let reads = envoy
        .stat("wasmcustom.prefix_router.discovery.reads")
        .ok()
        .flatten()
        .unwrap_or(0);
    polls_of(envoy) + reads
}

/// Polls an Envoy's filter sent so far (its `prefix_router.engine.polls`).
fn polls_of(envoy: &Envoy) -> u64 {
    poll_counts_of(std::slice::from_ref(envoy))
        .get("polls")
        .copied()
        .unwrap_or(0)
}

/// The engine-load tables as markdown.
pub fn markdown(report: &EngineLoadOverhead) -> String {
    let r = &report.under_requests;
    let mut out = String::new();
    out.push_str(&format!(
        "\n**Engine load**: {} upstreams answering `GET /metrics` with {} bytes ({} lines, vLLM-shaped); {} {} requests; the poller {}\n\n",
        report.upstreams,
        report.metrics_body_bytes,
        report.metrics_body_lines,
        human(r.body_bytes),
        r.path,
        if report.polled {
            format!("answered {} polls in {:.1} s of measured phases", r.metrics_polls, r.measured_s)
        } else {
            "sent no poll (this .wasm has no poller): no engine-load figure below shows polling".to_string()
        }
    ));
    out.push_str("| configuration | p50 (µs) | p50 added (µs) | p99 added (µs) | rps ratio | Envoy CPU per request (µs) | CPU added (µs) | CPU added one at a time (µs) |\n");
    out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|\n");
    out.push_str(&format!(
        "| no filter | {:.0} | – | – | 1 | {:.0} | – | – |\n",
        r.without_filter.p50_us, r.without_filter.cpu_us_per_request
    ));
    out.push_str(&format!(
        "| filter defaults | {:.0} | +{:.0} | +{:.0} | {:.3} | {:.0} | +{:.0} | +{:.0} |\n",
        r.defaults.p50_us,
        r.defaults_p50_added_us,
        r.defaults_p99_added_us,
        r.defaults_rps_ratio,
        r.defaults.cpu_us_per_request,
        r.defaults_cpu_added_us,
        r.defaults_cpu_added_one_at_a_time_us
    ));
    out.push_str(&format!(
        "| defaults + engine_load | {:.0} | +{:.0} | +{:.0} | {:.3} | {:.0} | +{:.0} | +{:.0} |\n",
        r.with_engine_load.p50_us,
        r.engine_p50_added_us,
        r.engine_p99_added_us,
        r.engine_rps_ratio,
        r.with_engine_load.cpu_us_per_request,
        r.engine_cpu_added_us,
        r.engine_cpu_added_one_at_a_time_us
    ));
    out.push_str(&format!(
        "\nengine_load over defaults: p50 {:+.0} µs (per round: {}), Envoy CPU per request {:+.1} µs\n",
        r.engine_p50_over_defaults_us,
        r.engine_p50_over_defaults_us_rounds
            .iter()
            .map(|v| format!("{v:+.0}"))
            .collect::<Vec<_>>()
            .join(", "),
        r.engine_cpu_over_defaults_us
    ));
    out.push_str(&format!(
        "\nIdle: Envoy CPU over {} window(s) of {:.1} s without requests (median)\n\n",
        report.idle.windows,
        report.idle.window_ms as f64 / 1000.0
    ));
    out.push_str("| configuration | Envoy CPU (ms per s) | over filter defaults (ms per s) | polls or admin reads per s |\n");
    out.push_str("|---|---:|---:|---:|\n");
    let defaults = report
        .idle
        .sides
        .iter()
        .find(|s| s.configuration == "filter defaults")
        .map_or(0.0, |s| s.cpu_ms_per_s);
    for side in &report.idle.sides {
        let over = if side.interval_ms.is_some() {
            format!("{:+.2}", side.cpu_ms_per_s - defaults)
        } else {
            "–".to_string()
        };
        out.push_str(&format!(
            "| {} | {:.2} | {} | {:.1} |\n",
            side.configuration, side.cpu_ms_per_s, over, side.polls_per_s
        ));
    }
    out
}

fn human(bytes: usize) -> String {
    if bytes % 1024 == 0 {
        format!("{} KiB", bytes / 1024)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configurations_differ_by_engine_load_alone() {
        let addrs: Vec<SocketAddr> = vec!["127.0.0.1:8001".parse().unwrap()];
        let defaults = plugin_config(&addrs, None);
        assert_eq!(defaults, json!({"instances": ["127.0.0.1:8001"]}));
        let mut engine = plugin_config(&addrs, Some(None));
        assert_eq!(
            engine.as_object_mut().unwrap().remove("engine_load"),
            Some(json!({"cluster": "engine_metrics"}))
        );
        assert_eq!(engine, defaults);
        assert_eq!(
            plugin_config(&addrs, Some(Some(50)))["engine_load"]["interval_ms"],
            50
        );
    }
}
