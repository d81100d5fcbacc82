//! The engine-load poller as the plugin runs it (`engine_load`): from the
//! root tick, the one VM that holds the poller lease sends each due poll
//! with `dispatch_http_call`; the answer, at the same root context's
//! `on_http_call_response`, becomes the instance's shared sample, or clears
//! it. Requests never wait on any of this: they read whatever sample is in
//! shared data when they decide.
//!
//! What to poll and when, and what an answer means, is decided in
//! [`crate::engine_load::poller`]; the samples live in
//! [`crate::load::LoadTracker`]. This file makes the host calls, keeps the
//! stats and logs each instance's changes of state.

use std::collections::HashMap;

use super::poller_lease::PollerLease;
use super::vm::{define_metric, Vm};
use super::warn_on_error;
use crate::config::{Config, EngineLoadConfig};
use crate::engine_load::metrics_text::MAX_BODY_BYTES;
use crate::engine_load::models::{
    active_adapters, served_adapters, MAX_MODELS_BODY_BYTES, MODELS_PATH,
};
use crate::engine_load::poller::{judge, Change, PollFault, Poller};
use crate::engine_load::{
    poll_failure_counter_name, KV_USAGE_GAUGE_PREFIX, POLLS, POLLS_SKIPPED, REQUESTS_GAUGE_PREFIX,
    SAMPLE_AGE_GAUGE_PREFIX,
};
use crate::host::{Host, MetricKind};
use crate::load::{AdapterNames, EngineLoad, InstanceRef, PollerKind};
use crate::metrics::{fleet_stat_name, instance_stat_name, FleetIds};

/// The header that names the instance a poll is for, `ip:port`: what an
/// ORIGINAL_DST cluster with `use_http_header` connects to (Envoy's
/// `original_dst_cluster.cc`), and what a dedicated `override_host` cluster
/// can be told to read.
pub const ORIGINAL_DST_HOST_HEADER: &str = "x-envoy-original-dst-host";

/// How often the age gauges are set (the requests and KV gauges are set at
/// each sample).
const AGE_GAUGE_PERIOD_MS: u64 = 1_000;

/// How often the fleet to poll is read when no poll is due (new instances
/// are polled at most this late).
const TARGETS_REFRESH_MS: u64 = 1_000;

/// Most instances with gauges of their own (as the in-flight gauges).
const MAX_ENGINE_GAUGES: usize = super::vm::MAX_GAUGES;

/// The root tick period while `engine_load` is configured: a tenth of the
/// interval (so polls keep their jitter), 10 ms to 1 s.
pub fn tick_period_ms(engine: &EngineLoadConfig) -> u32 {
    u32::try_from((engine.interval_ms / 10).clamp(10, 1_000)).unwrap_or(1_000)
}

/// How long the poller lease lives without renewal before another VM takes
/// over: three intervals, at least a second.
pub fn lease_ms(engine: &EngineLoadConfig) -> u64 {
    (engine.interval_ms * 3).max(1_000)
}

/// The stat ids of the poller (defined by the VM that first polls).
#[derive(Debug, Default)]
struct PollStats {
    polls: Option<u32>,
    skipped: Option<u32>,
    failures: [Option<u32>; PollFault::REASONS.len()],
}

/// One instance's gauges.
#[derive(Debug, Clone, Copy, Default)]
struct InstanceGauges {
    requests: Option<u32>,
    kv_usage: Option<u32>,
    age: Option<u32>,
}

/// This VM's poller state (kept across configuration updates, like the VM).
#[derive(Debug, Default)]
pub struct EnginePolling {
    lease: PollerLease,
    poller: Poller,
    /// The poller's stats and per-instance gauges, under the configured
    /// fleet's names.
    ids: FleetIds<PollIds>,
    /// When each instance last gave a sample (for the age gauge).
    last_sample_ms: HashMap<String, u64>,
    last_age_publish_ms: u64,
    /// When the fleet to poll was last read.
    targets_read_ms: u64,
    /// Open `/v1/models` calls (`adapters`): token and instance.
    models_calls: Vec<(u32, InstanceRef)>,
}

impl EnginePolling {
    /// Calls open now (tests).
    pub fn open_calls(&self) -> usize {
        self.poller.open_calls()
    }
}

/// The poller's stat ids (defined by the VM that first polls) and each
/// instance's gauges.
#[derive(Debug, Default)]
struct PollIds {
    stats: Option<PollStats>,
    gauges: HashMap<String, InstanceGauges>,
}

/// Root tick with `engine_load` configured: takes or renews the poller
/// lease, gives up calls Envoy never answered, and sends the polls due.
pub fn tick<H: Host + Clone>(vm: &mut Vm<H>, config: &Config, engine: &EngineLoadConfig, now: u64) {
    let mut state = vm.take_engine_polling();
    let holding = state
        .lease
        .hold(vm, config, PollerKind::EngineLoad, lease_ms(engine), now);
    if holding {
        poll_round(vm, &mut state, config, engine, now);
    }
    vm.put_engine_polling(state);
}

fn poll_round<H: Host + Clone>(
    vm: &mut Vm<H>,
    state: &mut EnginePolling,
    config: &Config,
    engine: &EngineLoadConfig,
    now: u64,
) {
    let fleet = config.fleet.as_deref();
    let stats = state
        .ids
        .of(fleet)
        .stats
        .get_or_insert_with(|| define_stats(vm.host(), fleet));
    let skipped_id = stats.skipped;
    // Most ticks have nothing due: they skip reading the fleet (its shared
    // records), which is still read once a second for new instances.
    let idle = state
        .poller
        .next_due_ms(engine.timeout_ms)
        .is_some_and(|due| now < due);
    if idle && now.saturating_sub(state.targets_read_ms) < TARGETS_REFRESH_MS {
        return;
    }
    for instance in state.poller.give_up(now, engine.timeout_ms) {
        finish(
            vm,
            state,
            config,
            &instance,
            Err(PollFault::Timeout),
            None,
            now,
        );
    }
    state.targets_read_ms = now;
    let targets = vm.with_tracker(config, |t| t.engine_poll_targets(now));
    let due = state.poller.due(&targets, now);
    if due.skipped > 0 {
        let random = vm.random();
        state
            .poller
            .postpone_skipped(now, engine.interval_ms, random);
        if let Some(id) = skipped_id {
            for _ in 0..due.skipped {
                vm.count_later(id);
            }
        }
    }
    for instance in due.poll {
        if config.adapters.is_some() {
            send_models_call(vm.host(), state, engine, &instance);
        }
        let sent = send(vm.host(), engine, (&engine.path, "text/plain"), &instance);
        let random = vm.random();
        let token = sent.as_ref().ok().copied();
        state
            .poller
            .sent(&instance.address, token, now, engine.interval_ms, random);
        if let Some(id) = state.ids.of(fleet).stats.as_ref().and_then(|s| s.polls) {
            vm.count_later(id);
        }
        if let Err(status) = sent {
            let fault = PollFault::Unreachable(format!(
                "Envoy refused the call through cluster {}: {status}",
                engine.cluster
            ));
            finish(vm, state, config, &instance, Err(fault), None, now);
        }
    }
    if now.saturating_sub(state.last_age_publish_ms) >= AGE_GAUGE_PERIOD_MS {
        state.last_age_publish_ms = now;
        publish_ages(vm, state, fleet, &targets, now);
    }
}

/// Sends one poll: a GET of `path` for `accept`, with the instance in the
/// authority and in the header that picks the host.
fn send(
    host: &impl Host,
    engine: &EngineLoadConfig,
    (path, accept): (&str, &str),
    instance: &InstanceRef,
) -> Result<u32, crate::host::HostStatus> {
    let timeout = u32::try_from(engine.timeout_ms).unwrap_or(u32::MAX);
    host.dispatch_http_call(
        &engine.cluster,
        &[
            (":method", "GET"),
            (":path", path),
            (":authority", &instance.address),
            (ORIGINAL_DST_HOST_HEADER, &instance.address),
            ("accept", accept),
        ],
        timeout,
    )
}

/// With `adapters`, each poll also asks the instance which adapters it
/// serves. Envoy answers every call it accepted, by its timeout at the
/// latest, so the open calls stay as many as the polls in flight.
fn send_models_call(
    host: &impl Host,
    state: &mut EnginePolling,
    engine: &EngineLoadConfig,
    instance: &InstanceRef,
) {
    // A refused call leaves the last list standing, as a timeout does.
    if let Ok(token) = send(host, engine, (MODELS_PATH, "application/json"), instance) {
        state.models_calls.push((token, instance.clone()));
    }
}

/// The answer to a `/v1/models` call: the adapters the instance lists, or
/// not known (an unusable answer); with no response at all (a timeout, a
/// reset) the last list stands.
fn models_answer<H: Host + Clone>(
    vm: &mut Vm<H>,
    config: &Config,
    instance: &InstanceRef,
    num_headers: usize,
    body_size: usize,
    now: u64,
) {
    let (status, body) = read_answer(vm.host(), num_headers, body_size, MAX_MODELS_BODY_BYTES);
    if status.is_none() {
        return;
    }
    let served = served_adapters(status, &body);
    vm.with_tracker(config, |t| t.store_served_adapters(instance, served, now));
}

/// `on_http_call_response` of the root that sent call `token`: judges the
/// answer and stores or clears the instance's sample.
pub fn answer<H: Host + Clone>(
    vm: &mut Vm<H>,
    config: &Config,
    token: u32,
    num_headers: usize,
    body_size: usize,
    now: u64,
) {
    let mut state = vm.take_engine_polling();
    if let Some(at) = state.models_calls.iter().position(|(t, _)| *t == token) {
        let (_, instance) = state.models_calls.swap_remove(at);
        models_answer(vm, config, &instance, num_headers, body_size, now);
        vm.put_engine_polling(state);
        return;
    }
    let answered = state.poller.answered(token);
    if let (Some((instance, sent_ms)), Some(engine)) = (answered, &config.engine_load) {
        let (status, body) = read_answer(vm.host(), num_headers, body_size, MAX_BODY_BYTES);
        let verdict = judge(
            status,
            &body,
            now.saturating_sub(sent_ms),
            engine.timeout_ms,
            &engine.series,
        );
        // With `adapters`, the same body says which adapters are in use.
        let active = config
            .adapters
            .as_ref()
            .filter(|_| verdict.is_ok())
            .and_then(|_| active_adapters(&body));
        finish(vm, &mut state, config, &instance, verdict, active, now);
    }
    vm.put_engine_polling(state);
}

/// The answer's status (None: no response) and the body, at most one byte
/// past `max_body` (so that the parser knows the body was cut).
pub(super) fn read_answer(
    host: &impl Host,
    num_headers: usize,
    body_size: usize,
    max_body: usize,
) -> (Option<u32>, Vec<u8>) {
    if num_headers == 0 {
        return (None, Vec::new());
    }
    let status = match host.http_call_response_headers() {
        Ok(headers) => headers
            .get(":status")
            .and_then(|s| std::str::from_utf8(s).ok())
            .and_then(|s| s.parse::<u32>().ok()),
        Err(status) => {
            log::warn!("prefix-router: cannot read an HTTP call's response headers: {status}");
            None
        }
    };
    let body = match body_size {
        0 => Vec::new(),
        size => host
            .http_call_response_body(0, size.min(max_body + 1))
            .unwrap_or_else(|status| {
                log::warn!("prefix-router: cannot read an HTTP call's body: {status}");
                None
            })
            .unwrap_or_default(),
    };
    (status, body)
}

/// One poll of `instance` ended: the sample (with the adapters in use, if
/// read) is stored (or cleared), the gauges and failure stats move, and a
/// change of state is logged.
fn finish<H: Host + Clone>(
    vm: &mut Vm<H>,
    state: &mut EnginePolling,
    config: &Config,
    instance: &InstanceRef,
    verdict: Result<EngineLoad, PollFault>,
    active_adapters: Option<AdapterNames>,
    now: u64,
) {
    let address = &*instance.address;
    match &verdict {
        Ok(load) => {
            let load = *load;
            vm.with_tracker(config, |t| {
                t.store_engine_sample(instance, load, active_adapters, now)
            });
            state.last_sample_ms.insert(address.to_string(), now);
            publish_sample(vm.host(), state, config.fleet.as_deref(), address, &load);
        }
        Err(fault) => {
            // A slow answer (common on a busy host) leaves the last sample
            // to age out at max_age_ms: it is still the best figure. An
            // endpoint that answers wrongly or is gone is not trusted.
            if *fault != PollFault::Timeout {
                vm.with_tracker(config, |t| t.clear_engine_sample(instance, now));
            }
            let index = PollFault::REASONS.iter().position(|r| *r == fault.reason());
            let id = state
                .ids
                .of(config.fleet.as_deref())
                .stats
                .as_ref()
                .and_then(|s| index.and_then(|i| s.failures.get(i).copied().flatten()));
            if let Some(id) = id {
                vm.count_later(id);
            }
        }
    }
    match state.poller.ended(address, verdict.as_ref().map(|_| ())) {
        Some(Change::Failing(fault)) => log::warn!(
            "prefix-router: engine load of {address}: {fault}; until it answers with its \
             figures, decisions count only this Envoy's requests on it{} (stat {})",
            if fault == PollFault::Timeout {
                " once its last sample is older than max_age_ms"
            } else {
                ""
            },
            poll_failure_counter_name(fault.reason())
        ),
        Some(Change::Recovered) => log::info!(
            "prefix-router: engine load of {address}: answering again; its engine's figures \
             are used again"
        ),
        None => {}
    }
}

fn define_stats(host: &impl Host, fleet: Option<&str>) -> PollStats {
    let define =
        |name: &str| define_metric(host, MetricKind::Counter, &fleet_stat_name(fleet, name));
    let mut stats = PollStats {
        polls: define(POLLS),
        skipped: define(POLLS_SKIPPED),
        failures: Default::default(),
    };
    for (slot, reason) in stats.failures.iter_mut().zip(PollFault::REASONS) {
        *slot = define(&poll_failure_counter_name(reason));
    }
    stats
}

/// The gauges of `address`, defined on first use (none past
/// [`MAX_ENGINE_GAUGES`] instances).
fn gauges_of(
    host: &impl Host,
    state: &mut EnginePolling,
    fleet: Option<&str>,
    address: &str,
    with_kv: bool,
) -> Option<InstanceGauges> {
    let all = &mut state.ids.of(fleet).gauges;
    if !all.contains_key(address) && all.len() >= MAX_ENGINE_GAUGES {
        return None;
    }
    let gauges = all.entry(address.to_string()).or_default();
    let define = |prefix: &str| {
        define_metric(
            host,
            MetricKind::Gauge,
            &fleet_stat_name(fleet, &instance_stat_name(prefix, address)),
        )
    };
    if gauges.requests.is_none() {
        gauges.requests = define(REQUESTS_GAUGE_PREFIX);
        gauges.age = define(SAMPLE_AGE_GAUGE_PREFIX);
    }
    if with_kv && gauges.kv_usage.is_none() {
        gauges.kv_usage = define(KV_USAGE_GAUGE_PREFIX);
    }
    Some(*gauges)
}

fn publish_sample(
    host: &impl Host,
    state: &mut EnginePolling,
    fleet: Option<&str>,
    address: &str,
    load: &EngineLoad,
) {
    let Some(gauges) = gauges_of(
        host,
        state,
        fleet,
        address,
        load.kv_usage_permille.is_some(),
    ) else {
        return;
    };
    let requests = u64::from(load.running) + u64::from(load.waiting);
    let set = |id: Option<u32>, value: u64| {
        if let Some(id) = id {
            warn_on_error("set gauge", address, host.record_metric(id, value));
        }
    };
    set(gauges.requests, requests);
    set(gauges.age, 0);
    if let Some(kv) = load.kv_usage_permille {
        set(gauges.kv_usage, u64::from(kv));
    }
}

/// Sets the age gauge of every polled instance that gave a sample once.
fn publish_ages<H: Host + Clone>(
    vm: &mut Vm<H>,
    state: &mut EnginePolling,
    fleet: Option<&str>,
    targets: &[InstanceRef],
    now: u64,
) {
    state
        .last_sample_ms
        .retain(|address, _| targets.iter().any(|t| *t.address == **address));
    let gauges = &state.ids.of(fleet).gauges;
    for (address, at) in &state.last_sample_ms {
        if let Some(Some(id)) = gauges.get(address).map(|g| g.age) {
            warn_on_error(
                "set gauge",
                address,
                vm.host().record_metric(id, now.saturating_sub(*at)),
            );
        }
    }
}
