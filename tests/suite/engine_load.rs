//! Engine load in a real Envoy (`engine_load`): the filter polls each
//! instance's `/metrics` through the shipped `engine_metrics` cluster
//! (ORIGINAL_DST, the instance named in `x-envoy-original-dst-host`), and
//! each instance's figure shows in Envoy's stats.
//!
//! What is checked, at the instances and in Envoy:
//! - every poll reaches the instance it names, and the per-instance gauge
//!   equals what that instance's `/metrics` says;
//! - endpoints that hang, answer 500, answer garbage, reset the connection
//!   or are closed: no request fails, none waits on them (each request's
//!   latency, measured at the client, stays far below the time a hanging
//!   poll is held open), each failure reason is counted, Envoy's log warns
//!   once per instance, and once the endpoints answer again their figures
//!   are used again (gauges, an info line);
//! - with two workers, one VM polls: each instance gets about one poll per
//!   interval, not two;
//! - with vllm-sim instances, requests another proxy sent to one of them show
//!   in this Envoy's engine figure for it (equal to what its `/metrics`
//!   says), while this Envoy's own in-flight count there stays 0.
//! - Envoy's wall clock stepped back an hour (`tests/wall-clock-shim`
//!   preloaded; its monotonic clock left alone): the polls, which the
//!   filter's tick sends, go on at once, requests are served and the index's
//!   gauge, which the tick publishes, follows their prompts: the filter keeps
//!   time by Envoy's monotonic clock;
//! - vLLM's ORCA load report on a response (asked for by the client)
//!   refreshes the instance's KV usage before the next poll: the next
//!   request of a prompt its holder can no longer take under `max_kv_usage`
//!   is moved, and the client gets the report unchanged.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use harness::load::{filter_counter, prefix_request, shoot_all};
use harness::{wait_until, Harness, INSTANCES};
use prefix_router::engine_load::{KV_USAGE_GAUGE_PREFIX, REQUESTS_GAUGE_PREFIX};
use prefix_router::metrics::instance_stat_name;
use prefix_router::plugin::ORIGINAL_DST_HOST_HEADER;
use prefix_router_tools::sim::{SimConfig, SimServer};
use prefix_router_tools::upstream::{MetricsReply, UpstreamFleet, METRICS_PATH};

/// The shipped cluster the polls go through (`envoy/envoy.yaml`).
const CLUSTER: &str = "engine_metrics";

/// vLLM's three series, as vLLM prints them (one engine, labelled).
fn vllm_text(running: u32, waiting: u32, kv: f64) -> String {
    let labels = r#"{engine="0",model_name="m"}"#;
    format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{labels} {running}.0\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{labels} {waiting}.0\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{labels} {kv}\n\
         vllm:time_to_first_token_seconds_bucket{{le=\"+Inf\"}} 3\n"
    )
}

/// Instance `i`'s chosen figures: (running, waiting, KV usage).
fn figures(i: usize) -> (u32, u32, f64) {
    let i = u32::try_from(i).unwrap();
    (i + 1, 2 * i, f64::from(i) / 10.0)
}

/// The listener's plugin configuration: the fleet listed (the launcher
/// writes the run's instances in) and `engine_load` with `engine`.
fn plugin_config(engine: serde_json::Value) -> String {
    serde_json::json!({
        "instances": ["127.0.0.1:1"],
        "engine_load": engine,
    })
    .to_string()
}

fn start(engine: serde_json::Value, prepare: impl FnOnce(&UpstreamFleet)) -> Harness {
    let config = plugin_config(engine);
    Harness::start_prepared(prepare, move |b| b.concurrency(2).plugin_config(config))
}

/// [`start`], with one more instance listed whose port is closed: taken
/// from the system once the fleet listens (so it cannot be one of theirs),
/// then released. Returns its address too.
fn start_with_closed_instance(
    engine: serde_json::Value,
    prepare: impl FnOnce(&UpstreamFleet),
) -> (Harness, SocketAddr) {
    let config = plugin_config(engine);
    let closed = std::rc::Rc::new(std::cell::Cell::new(None));
    let chosen = std::rc::Rc::clone(&closed);
    let harness = Harness::start_prepared(prepare, move |b| {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free loopback port");
        chosen.set(Some(addr));
        b.concurrency(2)
            .plugin_config(config)
            .edit(move |c| add_configured_instance(c, addr))
    });
    let addr = closed.get().expect("chosen when Envoy was configured");
    (harness, addr)
}

/// Appends `addr` to the listener filter's `instances` (after the launcher
/// wrote the run's upstreams there): an instance the filter polls that is
/// not among the cluster's endpoints.
fn add_configured_instance(config: &mut serde_yaml::Value, addr: SocketAddr) -> anyhow::Result<()> {
    let filters = &mut config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"];
    let value = filters[0]["typed_config"]["config"]["configuration"]["value"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("no listener plugin configuration"))?;
    let mut json: serde_json::Value = serde_json::from_str(value)?;
    json["instances"]
        .as_array_mut()
        .ok_or_else(|| anyhow::anyhow!("no instances list"))?
        .push(addr.to_string().into());
    filters[0]["typed_config"]["config"]["configuration"]["value"] = json.to_string().into();
    Ok(())
}

fn gauge(harness: &Harness, prefix: &str, addr: SocketAddr) -> Option<u64> {
    let name = format!(
        "wasmcustom.{}",
        instance_stat_name(prefix, &addr.to_string())
    );
    harness.envoy.stat(&name).expect("admin /stats")
}

/// The `/metrics` requests each instance received, by instance address.
fn polls_by_instance(fleet: &UpstreamFleet) -> BTreeMap<SocketAddr, Vec<Option<String>>> {
    let mut polls: BTreeMap<SocketAddr, Vec<Option<String>>> = BTreeMap::new();
    for record in fleet.records() {
        if record.path == METRICS_PATH {
            let addr = fleet.addr_of(&record.instance).unwrap();
            polls
                .entry(addr)
                .or_default()
                .push(record.header(ORIGINAL_DST_HOST_HEADER).map(str::to_string));
        }
    }
    polls
}

/// Every instance's `/metrics` says it is idle.
fn idle_engines(fleet: &UpstreamFleet) {
    for i in 0..INSTANCES {
        fleet
            .set_metrics(i, MetricsReply::Text(vllm_text(0, 0, 0.0)))
            .unwrap();
    }
}

/// Waits until every instance has been polled at least once.
async fn every_instance_polled(harness: &Harness) {
    wait_until(
        "every instance polled",
        Duration::from_secs(10),
        || polls_by_instance(&harness.fleet).len(),
        |n| *n == INSTANCES,
    )
    .await;
}

fn failures(harness: &Harness, reason: &str) -> u64 {
    filter_counter(&harness.envoy, &format!("engine.poll_failures.{reason}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_instance_is_polled_and_its_figures_are_in_envoys_stats() {
    let harness = start(
        serde_json::json!({"cluster": CLUSTER, "interval_ms": 200}),
        |fleet| {
            for i in 0..INSTANCES {
                let (running, waiting, kv) = figures(i);
                fleet
                    .set_metrics(i, MetricsReply::Text(vllm_text(running, waiting, kv)))
                    .unwrap();
            }
        },
    );
    let addrs = harness.fleet.addrs();
    let expected: Vec<(Option<u64>, Option<u64>)> = (0..INSTANCES)
        .map(|i| {
            let (running, waiting, kv) = figures(i);
            (
                Some(u64::from(running + waiting)),
                Some((kv * 1000.0).round() as u64),
            )
        })
        .collect();
    wait_until(
        "every instance's engine gauges equal its /metrics",
        Duration::from_secs(15),
        || {
            addrs
                .iter()
                .map(|a| {
                    (
                        gauge(&harness, REQUESTS_GAUGE_PREFIX, *a),
                        gauge(&harness, KV_USAGE_GAUGE_PREFIX, *a),
                    )
                })
                .collect::<Vec<_>>()
        },
        |seen| *seen == expected,
    )
    .await;
    // Every poll reached the instance it named, and each instance got some.
    let polls = polls_by_instance(&harness.fleet);
    for addr in &addrs {
        let received = polls.get(addr).map(Vec::as_slice).unwrap_or_default();
        assert!(!received.is_empty(), "{addr} was never polled");
        for named in received {
            assert_eq!(named.as_deref(), Some(addr.to_string().as_str()));
        }
    }
    for reason in ["timeout", "unreachable", "status", "body"] {
        assert_eq!(failures(&harness, reason), 0, "{reason}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_workers_each_instance_is_polled_about_once_per_interval() {
    const INTERVAL: Duration = Duration::from_millis(200);
    const WINDOW: Duration = Duration::from_secs(4);
    let harness = start(
        serde_json::json!({"cluster": CLUSTER, "interval_ms": 200}),
        idle_engines,
    );
    every_instance_polled(&harness).await;
    harness.fleet.clear();
    // The measurement window itself: polls are counted over it.
    tokio::time::sleep(WINDOW).await;
    let per_interval = WINDOW.as_millis() / INTERVAL.as_millis();
    let counts: BTreeMap<SocketAddr, usize> = polls_by_instance(&harness.fleet)
        .into_iter()
        .map(|(a, p)| (a, p.len()))
        .collect();
    assert_eq!(counts.len(), INSTANCES, "{counts:?}");
    for (addr, count) in &counts {
        let count = *count as u128;
        // One poller: ~20 in 4 s (jitter +-20 %, tick granularity 20 ms);
        // two would give ~40.
        assert!(
            count * 4 >= per_interval && count <= per_interval * 5 / 4 + 1,
            "{addr}: {count} polls in {WINDOW:?} at a {INTERVAL:?} interval: {counts:?}"
        );
    }
}

/// The `LD_PRELOAD` library that sets Envoy's wall clock back
/// (`tests/wall-clock-shim`; `cargo xtask test` builds it and names it in
/// WALL_CLOCK_SHIM).
fn wall_clock_shim() -> PathBuf {
    std::env::var_os("WALL_CLOCK_SHIM")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            panic!(
                "WALL_CLOCK_SHIM is not set: run `cargo xtask test`, or build \
                 prefix-router-wall-clock-shim and name its .so there"
            )
        })
}

/// Sets the wall clock of the processes that read `file` back by `secs`:
/// its 8 bytes rewritten in place (the shim maps them).
fn set_wall_clock_back(file: &Path, secs: i64) {
    use std::os::unix::fs::FileExt;
    let out = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    out.write_all_at(&secs.to_le_bytes(), 0).unwrap();
}

/// How far Envoy's wall clock is behind this process's: the `date` of an
/// admin answer (whole seconds).
fn envoy_wall_clock_behind(harness: &Harness) -> Duration {
    let url = format!("http://{}/ready", harness.envoy.admin_addr());
    let response = ureq::get(&url).call().expect("admin /ready");
    let date = response.header("date").expect("a date header");
    let envoy_now = httpdate::parse_http_date(date).expect("an HTTP date");
    SystemTime::now()
        .duration_since(envoy_now)
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ticks_work_goes_on_when_envoys_wall_clock_steps_back() {
    const STEP: Duration = Duration::from_secs(3600);
    let offset = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(offset.path(), 0i64.to_le_bytes()).unwrap();
    let config = plugin_config(serde_json::json!({"cluster": CLUSTER, "interval_ms": 200}));
    let harness = Harness::start_prepared(idle_engines, |b| {
        b.concurrency(2)
            .plugin_config(config)
            .env("LD_PRELOAD", wall_clock_shim())
            .env("WALL_CLOCK_SHIM_FILE", offset.path())
    });
    every_instance_polled(&harness).await;
    assert!(envoy_wall_clock_behind(&harness) < Duration::from_secs(5));

    set_wall_clock_back(offset.path(), STEP.as_secs() as i64);
    // Envoy's date header is refreshed every half second.
    wait_until(
        "Envoy's wall clock an hour behind",
        Duration::from_secs(5),
        || envoy_wall_clock_behind(&harness),
        |behind| *behind > STEP - Duration::from_secs(60),
    )
    .await;
    harness.fleet.clear();
    // Two polls each take about 0.4 s at a 200 ms interval; a tick that
    // waited for the wall clock to catch up would send none for an hour.
    wait_until(
        "every instance polled twice after the step",
        Duration::from_secs(5),
        || {
            polls_by_instance(&harness.fleet)
                .values()
                .filter(|polls| polls.len() >= 2)
                .count()
        },
        |n| *n == INSTANCES,
    )
    .await;
    // Requests are served, and the prompts they add to the index show in its
    // gauge, which the tick publishes once per period.
    let index_entries = || filter_counter(&harness.envoy, "index.entries");
    let before = index_entries();
    let requests = (0..INSTANCES)
        .map(|n| prefix_request(&format!("after-step-{n}"), 0))
        .collect();
    for outcome in shoot_all(harness.envoy.listener_addr(), requests).await {
        assert_eq!(outcome.status, Some(200), "{outcome:?}");
    }
    wait_until(
        "the new prompts in the index's gauge",
        Duration::from_secs(5),
        index_entries,
        |n| *n > before,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faulty_endpoints_never_delay_or_fail_requests_and_recover() {
    // A poll of the hanging endpoint stays open for its whole timeout.
    const HANG: Duration = Duration::from_millis(1_000);
    // Indexes of the faulty instances and what each does.
    let faults = [
        (0, MetricsReply::Hang, "timeout"),
        (1, MetricsReply::Status(500), "status"),
        (
            2,
            MetricsReply::Text("<html>no metrics here</html>".into()),
            "body",
        ),
        (3, MetricsReply::Reset, "unreachable"),
    ];
    // And an instance that is gone: listed, its port closed.
    let fault_setup = faults.clone();
    let (harness, closed) = start_with_closed_instance(
        serde_json::json!({"cluster": CLUSTER, "interval_ms": 1000, "timeout_ms": 1000}),
        move |fleet| {
            for i in 0..INSTANCES {
                let (running, waiting, kv) = figures(i);
                fleet
                    .set_metrics(i, MetricsReply::Text(vllm_text(running, waiting, kv)))
                    .unwrap();
            }
            for (i, reply, _) in fault_setup {
                fleet.set_metrics(i, reply).unwrap();
            }
        },
    );
    let addrs = harness.fleet.addrs();
    wait_until(
        "every fault counted at least twice",
        Duration::from_secs(20),
        || ["timeout", "status", "body", "unreachable"].map(|reason| failures(&harness, reason)),
        // unreachable: the reset and the closed port.
        |[timeout, status, body, unreachable]| {
            *timeout >= 2 && *status >= 2 && *body >= 2 && *unreachable >= 4
        },
    )
    .await;

    // Requests while the endpoints fail: all answered, none waiting on a poll.
    let requests: Vec<_> = (0..70)
        .map(|n| prefix_request(&format!("engine-{n}"), 0))
        .collect();
    let started = Instant::now();
    let outcomes = shoot_all(harness.envoy.listener_addr(), requests).await;
    let took = started.elapsed();
    let mut served: BTreeMap<String, usize> = BTreeMap::new();
    for outcome in &outcomes {
        assert_eq!(
            outcome.status,
            Some(200),
            "{outcome:?}\n{}",
            harness.log_tail()
        );
        let latency = outcome.finished - outcome.started;
        assert!(
            latency < HANG / 2,
            "a request took {latency:?} (a hanging poll is held {HANG:?}): {outcome:?}"
        );
        *served
            .entry(outcome.served_by.clone().unwrap_or_default())
            .or_default() += 1;
    }
    let hanging = harness.fleet.names()[0].clone();
    assert!(
        served.get(&hanging).copied().unwrap_or(0) > 0,
        "no request reached the instance whose /metrics hangs: {served:?}"
    );
    assert!(took < HANG * 5, "70 requests took {took:?}");

    // Envoy's log warns once per faulty instance, however many polls failed.
    let log = harness.envoy.log();
    let warned = |addr: &str| {
        log.lines()
            .filter(|l| {
                l.contains(&format!("engine load of {addr}:")) && l.contains("until it answers")
            })
            .count()
    };
    for (i, _, _) in &faults {
        assert_eq!(warned(&addrs[*i].to_string()), 1, "{}\n{log}", addrs[*i]);
    }
    assert_eq!(warned(&closed.to_string()), 1, "the closed port\n{log}");
    for addr in &addrs[4..] {
        assert_eq!(warned(&addr.to_string()), 0, "{addr} answers well");
    }

    // The endpoints answer again: their figures are used again.
    for (i, _, _) in &faults {
        let (running, waiting, kv) = figures(*i);
        harness
            .fleet
            .set_metrics(*i, MetricsReply::Text(vllm_text(running, waiting, kv)))
            .unwrap();
    }
    let expected: Vec<Option<u64>> = faults
        .iter()
        .map(|(i, _, _)| {
            let (running, waiting, _) = figures(*i);
            Some(u64::from(running + waiting))
        })
        .collect();
    wait_until(
        "the recovered instances' figures in Envoy's stats",
        Duration::from_secs(15),
        || {
            faults
                .iter()
                .map(|(i, _, _)| gauge(&harness, REQUESTS_GAUGE_PREFIX, addrs[*i]))
                .collect::<Vec<_>>()
        },
        |seen| *seen == expected,
    )
    .await;
    for (i, _, _) in &faults {
        let addr = addrs[*i].to_string();
        harness
            .envoy
            .wait_for_log_line(Duration::from_secs(5), |l| {
                l.contains(&format!("engine load of {addr}: answering again"))
            })
            .unwrap();
    }
}

/// Three vllm-sim instances `sim-0` .. `sim-2` on loopback, each configured
/// by `configure`, and their addresses.
async fn start_sims(configure: impl Fn(&mut SimConfig)) -> (Vec<SimServer>, Vec<SocketAddr>) {
    let mut sims = Vec::new();
    for i in 0..3 {
        let mut config = SimConfig {
            name: format!("sim-{i}"),
            ..SimConfig::default()
        };
        configure(&mut config);
        sims.push(
            SimServer::start(config, "127.0.0.1:0".parse().unwrap())
                .await
                .unwrap(),
        );
    }
    let addrs = sims.iter().map(SimServer::addr).collect();
    (sims, addrs)
}

/// vllm-sim instances, whose `/metrics` follows their engine state: requests
/// another proxy sent (here straight to the instance) show in this Envoy's
/// engine figure for it, while its own in-flight count there stays 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_sim_load_from_another_proxy_shows_in_envoys_engine_figures() {
    use harness::client::{self, Outgoing};
    use prefix_router_tools::envoy::Envoy;
    use prefix_router_tools::sim::metrics::parse_sample;

    // Two run at once; more wait.
    let (_sims, addrs) = start_sims(|c| c.max_num_seqs = 2).await;
    let envoy = Envoy::builder()
        .upstreams(addrs.clone())
        .concurrency(2)
        .plugin_config(plugin_config(
            serde_json::json!({"cluster": CLUSTER, "interval_ms": 200}),
        ))
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    // Another proxy's requests: long generations straight to the first instance.
    let busy = addrs[0];
    let body = r#"{"model": "m", "prompt": "tell a long story", "max_tokens": 5000}"#;
    let others: Vec<_> = (0..5)
        .map(|_| tokio::spawn(client::send(busy, Outgoing::post("/v1/completions", body))))
        .collect();
    let stat = |name: String| {
        envoy
            .stat(&format!("wasmcustom.{name}"))
            .expect("admin /stats")
    };
    let sim_figures = || async {
        let reply = client::send(busy, Outgoing::get("/metrics")).await.unwrap();
        let text = String::from_utf8_lossy(&reply.body).into_owned();
        let sample = |name: &str| parse_sample(&text, name).unwrap() as u64;
        (
            sample("vllm:num_requests_running"),
            sample("vllm:num_requests_waiting"),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (running, waiting) = sim_figures().await;
        let engine = stat(instance_stat_name(REQUESTS_GAUGE_PREFIX, &busy.to_string()));
        if (running, waiting) == (2, 3) && engine == Some(5) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the simulator says running {running}, waiting {waiting}; Envoy's figure {engine:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let own = stat(prefix_router::metrics::in_flight_gauge_name(
        &busy.to_string(),
    ));
    assert_eq!(own.unwrap_or(0), 0, "this Envoy sent none of them");
    for idle in &addrs[1..] {
        let engine = stat(instance_stat_name(REQUESTS_GAUGE_PREFIX, &idle.to_string()));
        assert_eq!(engine, Some(0), "{idle}");
    }
    for task in others {
        task.abort();
    }
}

/// vLLM's ORCA load report on a response refreshes the instance's KV usage
/// between polls: with one poll a minute, an instance whose KV cache filled
/// since its poll keeps taking a prompt it holds until a response through
/// this Envoy reports the usage; the next request then goes elsewhere
/// (`max_kv_usage`). The report reaches the client unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_sims_orca_report_refreshes_the_kv_usage_before_the_next_poll() {
    use harness::client::{self, Outgoing};
    use prefix_router::engine_load::orca;
    use prefix_router_tools::envoy::Envoy;
    use prefix_router_tools::sim::metrics::parse_sample;

    // 400 blocks of 16 tokens: one long generation fills most of it.
    let (_sims, addrs) = start_sims(|c| c.kv_blocks = 400).await;
    let config = serde_json::json!({
        "instances": ["127.0.0.1:1"],
        "decision_header": "x-decision",
        "engine_load": {"cluster": CLUSTER, "interval_ms": 60_000, "max_kv_usage": 0.5},
    });
    let envoy = Envoy::builder()
        .upstreams(addrs.clone())
        .plugin_config(config.to_string())
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    let stat = |name: &str| {
        envoy
            .stat(&format!("wasmcustom.{name}"))
            .expect("admin /stats")
    };
    let kv_gauge = |addr: SocketAddr| {
        stat(&instance_stat_name(
            KV_USAGE_GAUGE_PREFIX,
            &addr.to_string(),
        ))
    };
    // The first (and, within the test, only) poll of every instance.
    wait_until(
        "the first polls",
        Duration::from_secs(10),
        || addrs.iter().map(|a| kv_gauge(*a)).collect::<Vec<_>>(),
        |gauges| gauges.iter().all(|g| *g == Some(0)),
    )
    .await;
    let prompt = serde_json::json!({
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Summarise this document. ".repeat(60)}],
    })
    .to_string();
    let through_envoy = |orca_format: Option<&str>| {
        let mut request = Outgoing::post("/v1/chat/completions", prompt.clone());
        if let Some(format) = orca_format {
            request = request.header(orca::FORMAT_HEADER, format);
        }
        client::send(envoy.listener_addr(), request)
    };
    let first = through_envoy(None).await.unwrap();
    assert_eq!(first.status, 200, "{}", first.text());
    let holder = first.served_by().unwrap().to_string();
    let index: usize = holder.strip_prefix("sim-").unwrap().parse().unwrap();
    let holder_addr = addrs[index];
    // Another proxy's long generation fills the holder's KV cache past the
    // bound after its poll.
    let hog = serde_json::json!({"model": "m", "prompt": "tell a long story", "max_tokens": 4000});
    let hog = tokio::spawn(client::send(
        holder_addr,
        Outgoing::post("/v1/completions", hog.to_string()),
    ));
    let kv_now = || async {
        let reply = client::send(holder_addr, Outgoing::get("/metrics"))
            .await
            .unwrap();
        parse_sample(&reply.text(), "vllm:kv_cache_usage_perc").unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while kv_now().await <= 0.5 {
        assert!(Instant::now() < deadline, "the hog never filled the cache");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Held there, and the poll still says 0: sent there again, and this
    // client asks for the report.
    let second = through_envoy(Some("TEXT")).await.unwrap();
    assert_eq!(second.served_by(), Some(holder.as_str()));
    let report = second
        .headers
        .get(orca::REPORT_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    assert!(
        report
            .as_deref()
            .is_some_and(|r| r.starts_with("TEXT ") && r.contains("kv_cache_usage_perc=0.")),
        "the client gets vLLM's report unchanged: {report:?}"
    );
    // Now at the bound: the prompt moves.
    let third = through_envoy(None).await.unwrap();
    let decision = third
        .headers
        .get("x-decision")
        .and_then(|v| v.to_str().ok());
    assert_ne!(
        third.served_by(),
        Some(holder.as_str()),
        "decision {decision:?}"
    );
    assert!(
        decision.is_some_and(|d| d.starts_with("moved")),
        "{decision:?}"
    );
    wait_until(
        "the report counted",
        Duration::from_secs(5),
        || stat("prefix_router.engine.orca_reports"),
        |count| *count == Some(1),
    )
    .await;
    assert_eq!(kv_gauge(holder_addr), Some(0), "no poll since the first");
    hog.abort();
}
