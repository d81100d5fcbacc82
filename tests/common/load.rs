//! Support for the overload, strategy, scaling and reconfiguration tests:
//! requests of a chosen prefix, requests that end early (client aborts),
//! the filter's debug decision header and in-flight gauges, and the burst
//! scenario (a new key's concurrent requests against the cap) shared by several tests.
//!
//! What the wired filter is expected to provide (the conventions the overload tests rely on):
//! a `decision_header` setting whose response header reads
//! `<kind>; instance=<ip:port>`, per-instance in-flight gauges named
//! `...prefix_router...in_flight...`, the `host_header` (default
//! `x-prefix-route-host`) read by Envoy's `override_host` policy, and the
//! route header `x-prefix-router-lb`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;
use prefix_router_tools::envoy::Envoy;
use prefix_router_tools::upstream::{UpstreamFleet, HOLD_HEADER};

use crate::client::AbortOnDrop;
use crate::{bodies, Harness, Outgoing, INSTANCES};

/// The response header the tests ask the filter to write (`decision_header`).
pub const DECISION_HEADER: &str = "x-prefix-router-decision";
/// The filter's default host-override header (read by `override_host`).
pub const HOST_HEADER: &str = "x-prefix-route-host";
/// The filter's route-selection header.
pub const ROUTE_HEADER: &str = "x-prefix-router-lb";
/// The filter's internal "already counted" header.
pub const COUNTED_HEADER: &str = "x-prefix-router-counted";
/// Bytes of body that make the routing key (the filter's default `prefix_length`).
pub const PREFIX_BYTES: usize = 4096;
/// How long instances hold each request in the overload scenarios.
pub const BURST_HOLD: Duration = Duration::from_millis(1500);

/// A plugin configuration with the given strategy and threshold and the debug
/// decision header on.
pub fn plugin_config(strategy: &str, threshold: u32) -> String {
    plugin_config_with(strategy, threshold, serde_json::json!({}))
}

/// [`plugin_config`] with the fields of the JSON object `more` added (e.g.
/// `{"match": "FIXED_PREFIX"}`).
pub fn plugin_config_with(strategy: &str, threshold: u32, more: serde_json::Value) -> String {
    let mut config = serde_json::json!({
        "strategy": strategy,
        "concurrency_threshold": threshold,
        "decision_header": DECISION_HEADER,
    });
    let fields = more.as_object().expect("`more` is a JSON object");
    for (name, value) in fields {
        config[name] = value.clone();
    }
    config.to_string()
}

/// Envoy with two workers (two VMs sharing state) and 7 recording instances,
/// the filter configured with `config`; the filter's configuration delivered
/// by ECDS so tests can change it while Envoy runs.
pub fn overload_harness(config: &str) -> Harness {
    let config = config.to_string();
    Harness::start_with(move |b| {
        b.concurrency(2)
            .plugin_config(config)
            .dynamic_plugin_config()
    })
}

/// The first [`PREFIX_BYTES`] of a body for prefix `label` (same label, same prefix).
pub fn prefix_of(label: &str) -> String {
    let seed = xxhash(label);
    bodies::text(&mut bodies::rng(seed), PREFIX_BYTES)
}

fn xxhash(label: &str) -> u64 {
    // A stable seed from the label (FNV-1a; no extra crate).
    label.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// An invoke request whose key is `label`'s prefix; `n` makes the rest unique.
pub fn prefix_request(label: &str, n: usize) -> Outgoing {
    let body = format!("{}|request {n} of {label}", prefix_of(label));
    Outgoing::post("/invocations", body).id(&format!("{label}#{n}"))
}

/// What became of one request.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The response status, if a response (head) arrived.
    pub status: Option<u16>,
    pub served_by: Option<String>,
    /// The decision header: (kind, instance).
    pub decision: Option<(String, Option<String>)>,
    pub started: Instant,
    pub finished: Instant,
    /// The client gave up on purpose (timeout or mid-stream abort).
    pub aborted: bool,
    /// Transport error, if any.
    pub error: Option<String>,
}

impl Outcome {
    pub fn kind(&self) -> Option<&str> {
        self.decision.as_ref().map(|(k, _)| k.as_str())
    }
}

/// How the client ends a request.
#[derive(Debug, Clone, Copy)]
pub enum Ending {
    /// Reads the whole response.
    Complete,
    /// Closes the connection after this long, whatever the state.
    AbortAfter(Duration),
    /// Closes the connection after the response head and first body piece.
    AbortAfterFirstChunk,
}

/// Parses `<kind>; instance=<ip:port>`.
pub fn parse_decision(value: &str) -> (String, Option<String>) {
    let mut parts = value.split(';').map(str::trim);
    let kind = parts.next().unwrap_or_default().to_string();
    let instance = parts
        .filter_map(|p| p.strip_prefix("instance="))
        .map(str::to_string)
        .next();
    (kind, instance)
}

/// Sends one request on its own connection and ends it as told.
pub async fn shoot(addr: SocketAddr, request: Outgoing, ending: Ending) -> Outcome {
    let started = Instant::now();
    let mut outcome = Outcome {
        status: None,
        served_by: None,
        decision: None,
        started,
        finished: started,
        aborted: false,
        error: None,
    };
    let result = match ending {
        Ending::AbortAfter(after) => {
            match tokio::time::timeout(after, exchange(addr, request, false, &mut outcome)).await {
                Ok(result) => result,
                Err(_) => {
                    outcome.aborted = true;
                    Ok(())
                }
            }
        }
        Ending::Complete => exchange(addr, request, false, &mut outcome).await,
        Ending::AbortAfterFirstChunk => exchange(addr, request, true, &mut outcome).await,
    };
    if let Err(error) = result {
        outcome.error = Some(format!("{error:#}"));
    }
    outcome.finished = Instant::now();
    outcome
}

async fn exchange(
    addr: SocketAddr,
    request: Outgoing,
    abort_after_first_chunk: bool,
    outcome: &mut Outcome,
) -> anyhow::Result<()> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    let _connection = AbortOnDrop(tokio::spawn(connection));
    let mut builder = hyper::Request::builder()
        .method(request.method.as_str())
        .uri(request.path.as_str())
        .header("host", "prefix-router.test");
    for (name, value) in &request.headers {
        builder = builder.header(name.as_str(), value.as_slice());
    }
    let body = request.body.unwrap_or_default();
    let response = sender.send_request(builder.body(Full::new(body))?).await?;
    outcome.status = Some(response.status().as_u16());
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    outcome.served_by = header("x-served-by");
    outcome.decision = header(DECISION_HEADER).map(|v| parse_decision(&v));
    let mut body = response.into_body();
    if abort_after_first_chunk {
        let _ = body.frame().await;
        outcome.aborted = true;
        return Ok(());
    }
    body.collect().await?;
    Ok(())
}

/// Sends requests all at once (one connection each); outcomes in input order.
pub async fn shoot_all(addr: SocketAddr, requests: Vec<Outgoing>) -> Vec<Outcome> {
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|r| tokio::spawn(shoot(addr, r, Ending::Complete)))
        .collect();
    let mut outcomes = Vec::with_capacity(tasks.len());
    for task in tasks {
        outcomes.push(task.await.expect("request task panicked"));
    }
    outcomes
}

/// Asserts every outcome is a 200 with `x-served-by`.
pub fn assert_all_ok(outcomes: &[Outcome], what: &str) {
    let bad: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.status != Some(200) || o.served_by.is_none())
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: {} of {} requests failed, e.g. {:?}",
        bad.len(),
        outcomes.len(),
        bad.first()
    );
}

/// Sends requests of distinct new prefixes (at least `keys`, then more until
/// every instance has served one, at most 10 × `keys`), so the filter has seen
/// every instance serve: overflow nominates known instances (the learning
/// window). Panics if some instance never served.
pub async fn warm_up(harness: &Harness, keys: usize) {
    let mut sent = 0;
    loop {
        let batch = if sent == 0 { keys } else { 8 };
        let requests = (sent..sent + batch)
            .map(|i| prefix_request(&format!("warm-up-{i}"), 0).header(HOLD_HEADER, "0"))
            .collect();
        sent += batch;
        let replies = harness.send_all(requests, 8).await;
        assert!(replies.iter().all(|r| r.status == 200), "warm-up failed");
        let counts = harness.fleet.counts();
        if counts.values().all(|c| *c > 0) {
            return;
        }
        assert!(
            sent < 10 * keys,
            "{sent} warm-up keys did not reach every instance: {counts:?}"
        );
    }
}

/// The in-flight gauges the filter exports, by stat name.
pub fn in_flight_gauges(envoy: &Envoy) -> BTreeMap<String, u64> {
    let text = envoy
        .admin_get("/stats?filter=in_flight")
        .expect("admin /stats");
    text.lines()
        .filter_map(|line| line.split_once(": "))
        .filter(|(name, _)| name.contains("prefix_router") && name.contains("in_flight"))
        .filter_map(|(name, value)| Some((name.to_string(), value.trim().parse().ok()?)))
        .collect()
}

/// One of Envoy's per-host counters in the `vllm` cluster (`/clusters`).
pub fn host_counter(envoy: &Envoy, host: SocketAddr, name: &str) -> u64 {
    let text = envoy.admin_get("/clusters").expect("admin /clusters");
    let prefix = format!("vllm::{host}::{name}::");
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {prefix} in /clusters"))
}

/// A counter of the filter (`wasmcustom.prefix_router.<name>`), 0 if absent.
pub fn filter_counter(envoy: &Envoy, name: &str) -> u64 {
    envoy
        .stat(&format!("wasmcustom.prefix_router.{name}"))
        .expect("admin /stats")
        .unwrap_or(0)
}

/// Waits (bounded) until the filter's counter `name` reaches `at_least`: the
/// filter counts in the VM and flushes to Envoy on its 1 s tick.
pub fn wait_for_counter(envoy: &Envoy, name: &str, at_least: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let value = filter_counter(envoy, name);
        if value >= at_least {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "counter {name} stayed at {value}, expected at least {at_least} within 5 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Decision kinds among outcomes.
pub fn kinds(outcomes: &[Outcome]) -> BTreeMap<String, usize> {
    let mut kinds = BTreeMap::new();
    for o in outcomes {
        *kinds
            .entry(o.kind().unwrap_or("<no decision header>").to_string())
            .or_default() += 1;
    }
    kinds
}

/// Requests per serving instance.
pub fn served(outcomes: &[Outcome]) -> BTreeMap<String, usize> {
    let mut served = BTreeMap::new();
    for o in outcomes {
        *served
            .entry(o.served_by.clone().unwrap_or_else(|| "<none>".into()))
            .or_default() += 1;
    }
    served
}

/// What one burst of a new prefix did.
#[derive(Debug)]
pub struct BurstReport {
    /// The instance the key's sequential requests went to after the burst.
    pub target: String,
    /// Burst requests per instance.
    pub served: BTreeMap<String, usize>,
    /// Most requests in flight per instance during the burst (at the instance).
    pub max_in_flight: BTreeMap<String, u32>,
    /// Decision kinds in the burst.
    pub kinds: BTreeMap<String, usize>,
    /// Instances of the sequential requests after the burst.
    pub follow_ups: Vec<String>,
    /// Decision kinds of the sequential requests.
    pub follow_up_kinds: BTreeMap<String, usize>,
}

/// The overload burst: `size` concurrent requests of the new prefix `label`,
/// held [`BURST_HOLD`] by the instances; then `follow_ups` sequential ones.
/// The instances must be holding [`BURST_HOLD`] and otherwise idle.
pub async fn burst(harness: &Harness, label: &str, size: usize, follow_ups: usize) -> BurstReport {
    harness
        .fleet
        .wait_idle(Duration::from_secs(10))
        .expect("instances idle before the burst");
    harness.fleet.reset_max_in_flight();
    let requests = (0..size).map(|n| prefix_request(label, n)).collect();
    let outcomes = shoot_all(harness.envoy.listener_addr(), requests).await;
    let max_in_flight = harness.fleet.max_in_flight();
    assert_all_ok(&outcomes, &format!("burst {label}"));
    check_decisions_match(&outcomes, &harness.fleet);
    let mut after = Vec::new();
    for n in 0..follow_ups {
        let request = prefix_request(label, size + n).header(HOLD_HEADER, "0");
        after.push(shoot(harness.envoy.listener_addr(), request, Ending::Complete).await);
    }
    assert_all_ok(&after, &format!("after the burst {label}"));
    let follow_ups: Vec<String> = after.iter().filter_map(|o| o.served_by.clone()).collect();
    BurstReport {
        target: follow_ups.first().cloned().unwrap_or_default(),
        served: served(&outcomes),
        max_in_flight,
        kinds: kinds(&outcomes),
        follow_ups,
        follow_up_kinds: kinds(&after),
    }
}

/// The decision header's instance must be the one that served the request.
pub fn check_decisions_match(outcomes: &[Outcome], fleet: &UpstreamFleet) {
    for o in outcomes {
        let Some((kind, Some(instance))) = &o.decision else {
            continue;
        };
        let named = instance
            .parse::<SocketAddr>()
            .ok()
            .and_then(|a| fleet.name_of(a));
        assert_eq!(
            named,
            o.served_by.as_deref(),
            "decision {kind}; instance={instance} but served by {:?}",
            o.served_by
        );
    }
}

/// Checks a burst report against what the cap allows for
/// `threshold`; prints the figures.
pub fn check_burst(report: &BurstReport, size: usize, threshold: usize, what: &str) {
    println!("{what}: {report:#?}");
    let target = report.target.as_str();
    assert!(
        report.follow_ups.iter().all(|i| i == target),
        "{what}: the sequential requests after the burst did not all go to one instance: {:?}",
        report.follow_ups
    );
    assert_eq!(
        report.follow_up_kinds.get("prefix"),
        Some(&report.follow_ups.len()),
        "{what}: sequential requests after the burst must be `prefix` decisions"
    );
    let on_target_max = report.max_in_flight.get(target).copied().unwrap_or(0);
    assert!(
        on_target_max as usize <= threshold,
        "{what}: the target {target} had {on_target_max} in flight (threshold {threshold}), measured at the instance: {:?}",
        report.max_in_flight
    );
    let on_target = report.served.get(target).copied().unwrap_or(0);
    assert_eq!(
        on_target, threshold,
        "{what}: {threshold} of the burst should be served by the target {target}: {:?}",
        report.served
    );
    assert_eq!(report.kinds.get("prefix"), Some(&threshold), "{what}");
    assert_eq!(
        report.kinds.get("overflow"),
        Some(&(size - threshold)),
        "{what}"
    );
    // Spread over the least busy others: with all of them idle, evenly. Two
    // workers deciding at the same moment read the same counts, but an overflow
    // claims its instance only if its count is still what was read (the same
    // atomic claim as the target's), so they cannot both land on one instance
    // (before that claim, CI once saw [1, 1, 3, 2, 1, 1]).
    let others: Vec<usize> = report
        .served
        .iter()
        .filter(|(name, _)| name.as_str() != target)
        .map(|(_, n)| *n)
        .chain(std::iter::repeat(0))
        .take(INSTANCES - 1)
        .collect();
    let (min, max) = (
        others.iter().min().copied().unwrap_or(0),
        others.iter().max().copied().unwrap_or(0),
    );
    assert!(
        max - min <= 1,
        "{what}: the overflow is not spread over the least busy instances (per other instance {others:?})"
    );
}

/// Waits (bounded) until every in-flight gauge reads zero; returns the last
/// reading and how long it took. Panics with the gauges if they do not.
pub fn wait_gauges_zero(envoy: &Envoy, timeout: Duration) -> (BTreeMap<String, u64>, Duration) {
    let start = Instant::now();
    loop {
        let gauges = in_flight_gauges(envoy);
        if !gauges.is_empty() && gauges.values().all(|v| *v == 0) {
            return (gauges, start.elapsed());
        }
        assert!(
            start.elapsed() < timeout,
            "in-flight gauges not all zero after {timeout:?}: {gauges:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Request header that selects the test's short-timeout route (see
/// [`add_short_timeout_route`]).
pub const SHORT_TIMEOUT_HEADER: &str = "x-test-short-timeout";

/// Adds, before all others, a copy of the default route (the last one) that
/// matches [`SHORT_TIMEOUT_HEADER`]`: 1` and times out after `timeout`, so a
/// test can make some requests hit Envoy's route timeout without shortening it
/// for the rest.
pub fn add_short_timeout_route(
    config: &mut serde_yaml::Value,
    timeout: Duration,
) -> anyhow::Result<()> {
    let hcm = &mut config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"];
    let routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        .as_sequence_mut()
        .ok_or_else(|| anyhow::anyhow!("no inline routes in the first listener"))?;
    let mut route = routes
        .last()
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no routes"))?;
    let matcher: serde_yaml::Value = serde_yaml::from_str(&format!(
        "{{ prefix: '/', headers: [{{ name: {SHORT_TIMEOUT_HEADER}, string_match: {{ exact: '1' }} }}] }}"
    ))?;
    route["match"] = matcher;
    route["route"]["timeout"] = format!("{}s", timeout.as_secs_f64()).into();
    routes.insert(0, route);
    Ok(())
}
