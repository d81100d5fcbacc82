//! A fleet-wide bound on the engines' queue, held by several proxies that
//! share nothing but the engines: 3 Envoy replicas, and 8 Envoys as sidecars
//! each seeing an eighth of the traffic, in front of 7 `vllm-sim` instances
//! (in process, so each engine's own peak of running + waiting is read
//! exactly, not sampled).
//!
//! One hot prompt is sent through all the proxies in turn. With `engine_load`
//! polling every instance's `/metrics` and `max_requests` set, the hot
//! prompt's instance never holds more than the bound, whichever proxy sent
//! what; the same traffic with only each proxy's own cap
//! (`concurrency_threshold` at the bound, engine load off) puts more on it,
//! since each proxy counts only its own requests. Both runs are in each
//! test, so the test fails if the traffic could not exceed the bound.
//!
//! Why paced, not a burst: a proxy learns what the others sent from the
//! next sample (every 100 ms with 3 replicas and 200 ms with 8 sidecars
//! here, jittered by 20 %, plus the filter's 50 ms cache of it); requests of
//! different proxies closer together than that are not seen by each other
//! (see `docs/design.md`, "Engine load"). Here one request leaves every
//! 300 ms (600 ms for the sidecars), through the proxies in turn. The two
//! tests take turns: each runs up to 8 Envoys, and a starved poller is a
//! late one.

use std::net::SocketAddr;
use std::time::Duration;

use harness::bodies::json_string;
use harness::client::{self, Outgoing};
use harness::load::{filter_counter, wait_for_counter};
use harness::runtime;
use prefix_router_tools::envoy::Envoy;
use prefix_router_tools::sim::{SimConfig, SimServer};

const INSTANCES: usize = 7;
/// The fleet-wide bound of the hot instance's running + waiting.
const BOUND: u32 = 4;
/// Requests sent, one every [`Pace::spacing`], through the proxies in turn.
const REQUESTS: usize = 24;

/// How often each proxy polls every instance, and how far apart the
/// requests leave: far enough that a request sees the previous ones in a
/// sample (an interval, jittered by 20 %, plus the 50 ms read cache, on a
/// machine busy with the proxies' own polls).
#[derive(Clone, Copy)]
struct Pace {
    interval_ms: u64,
    spacing: Duration,
    /// Output tokens per request, at vllm-sim's 22 ms per token: 200 is
    /// about 4.4 s, so about 15 requests are in flight at once across the
    /// fleet at 300 ms spacing (400 at 600 ms: the same).
    max_tokens: usize,
}
const CHAT: &str = "/v1/chat/completions";
const MODEL: &str = "meta-llama/Llama-3.1-70B-Instruct";

fn sims(runtime: &tokio::runtime::Runtime) -> Vec<SimServer> {
    (1..=INSTANCES)
        .map(|i| {
            let cfg = SimConfig {
                name: format!("vllm-{i}"),
                model: MODEL.to_string(),
                ..SimConfig::default()
            };
            runtime
                .block_on(SimServer::start(cfg, "127.0.0.1:0".parse().unwrap()))
                .expect("vllm-sim instance")
        })
        .collect()
}

/// The plugin configuration: engine load with the fleet-wide bound, or
/// (`engine: false`) only this proxy's cap at the same figure.
fn plugin_config(engine: bool, pace: Pace) -> String {
    let mut config = serde_json::json!({
        "decision_header": "x-prefix-router-decision",
        "instances": ["127.0.0.1:8001"],
    });
    if engine {
        config["engine_load"] = serde_json::json!({
            "cluster": "engine_metrics",
            "interval_ms": pace.interval_ms,
            "max_requests": BOUND,
        });
    } else {
        config["concurrency_threshold"] = BOUND.into();
    }
    config.to_string()
}

fn envoys(count: usize, workers: u32, sims: &[SimServer], engine: bool, pace: Pace) -> Vec<Envoy> {
    let config = plugin_config(engine, pace);
    let envoys: Vec<Envoy> = (0..count)
        .map(|n| {
            Envoy::builder()
                .upstreams(sims.iter().map(SimServer::addr))
                .concurrency(workers)
                .plugin_config(config.clone())
                .start()
                .unwrap_or_else(|e| panic!("Envoy {n}: {e}"))
        })
        .collect();
    if engine {
        // Each proxy's poller has sampled every instance (Envoy flushes the
        // filter's counters on its 1 s tick): what a deployed proxy has
        // before traffic comes.
        for envoy in &envoys {
            wait_for_counter(envoy, "engine.polls", 2 * INSTANCES as u64);
        }
    }
    envoys
}

/// Each proxy's polls and failed polls by reason (timeout, unreachable,
/// status, body), for the report.
fn poll_figures(proxies: &[Envoy]) -> Vec<(u64, [u64; 4])> {
    proxies
        .iter()
        .map(|envoy| {
            let failed = ["timeout", "unreachable", "status", "body"]
                .map(|reason| filter_counter(envoy, &format!("engine.poll_failures.{reason}")));
            (filter_counter(envoy, "engine.polls"), failed)
        })
        .collect()
}

/// One long prompt every request shares.
fn hot_body(max_tokens: usize) -> String {
    let document = "The quarterly report lists revenue by region and product line. ".repeat(60);
    format!(
        r#"{{"model":{},"max_tokens":{max_tokens},"messages":[{{"role":"system","content":"You answer questions about the document."}},{{"role":"user","content":{}}}]}}"#,
        json_string(MODEL),
        json_string(&format!("{document}\n\nSummarise it."))
    )
}

/// What the traffic did: each engine's peak of running + waiting, how many
/// requests each instance served, and each proxy's (polls, failed polls).
struct Outcome {
    peaks: Vec<usize>,
    served: Vec<usize>,
    polls: Vec<(u64, [u64; 4])>,
}

impl Outcome {
    fn hottest(&self) -> usize {
        self.peaks.iter().copied().max().unwrap_or(0)
    }
}

/// Sends the hot prompt [`REQUESTS`] times, one every `pace.spacing`, through
/// the proxies in turn; every request must succeed.
fn hot_traffic(
    runtime: &tokio::runtime::Runtime,
    sims: &[SimServer],
    proxies: &[Envoy],
    pace: Pace,
) -> Outcome {
    for sim in sims {
        sim.engine().take_peak_requests();
    }
    let body = hot_body(pace.max_tokens);
    let addrs: Vec<SocketAddr> = proxies.iter().map(Envoy::listener_addr).collect();
    let replies = runtime.block_on(async {
        let mut tasks = Vec::new();
        for i in 0..REQUESTS {
            let addr = addrs[i % addrs.len()];
            let request =
                Outgoing::post(CHAT, body.clone()).header("content-type", "application/json");
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(pace.spacing * i as u32).await;
                client::send(addr, request).await
            }));
        }
        let mut replies = Vec::new();
        for task in tasks {
            replies.push(
                task.await
                    .expect("task")
                    .expect("the request reaches Envoy"),
            );
        }
        replies
    });
    let names: Vec<String> = (1..=INSTANCES).map(|i| format!("vllm-{i}")).collect();
    let mut served = vec![0; INSTANCES];
    for reply in &replies {
        assert_eq!(reply.status, 200, "{}", reply.text());
        let by = reply.served_by().expect("vllm-sim names itself");
        let n = names
            .iter()
            .position(|name| name == by)
            .expect("one of the fleet");
        served[n] += 1;
    }
    let peaks = sims
        .iter()
        .map(|sim| sim.engine().take_peak_requests())
        .collect();
    Outcome {
        peaks,
        served,
        polls: poll_figures(proxies),
    }
}

/// The tests of this file, one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The bound holds with engine load and is exceeded without it, through
/// `proxies` Envoys with `workers` each.
fn bound_holds_across(proxies: usize, workers: u32, pace: Pace) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let runtime = runtime();
    let sims = sims(&runtime);
    let with_engine = {
        let envoys = envoys(proxies, workers, &sims, true, pace);
        hot_traffic(&runtime, &sims, &envoys, pace)
    };
    let local_only = {
        let envoys = envoys(proxies, workers, &sims, false, pace);
        hot_traffic(&runtime, &sims, &envoys, pace)
    };
    println!(
        "{proxies} proxies, bound {BOUND}: peaks of running + waiting per instance {:?} (served {:?}; polls and failed polls by reason per proxy {:?}) with engine load; {:?} (served {:?}) with each proxy's cap only",
        with_engine.peaks, with_engine.served, with_engine.polls, local_only.peaks, local_only.served
    );
    assert!(
        local_only.hottest() > BOUND as usize,
        "the traffic must be able to exceed the bound without engine load: peaks {:?}",
        local_only.peaks
    );
    assert_eq!(
        with_engine.hottest(),
        BOUND as usize,
        "the hot instance reaches the fleet-wide bound and no more: peaks {:?}",
        with_engine.peaks
    );
    let used = with_engine.served.iter().filter(|&&n| n > 0).count();
    assert!(
        used >= 4,
        "what the bound turned away spreads: served {:?}",
        with_engine.served
    );
}

#[test]
fn three_replicas_hold_the_fleet_wide_bound() {
    let pace = Pace {
        interval_ms: 100,
        spacing: Duration::from_millis(300),
        max_tokens: 200,
    };
    bound_holds_across(3, 2, pace);
}

#[test]
fn eight_sidecars_hold_the_fleet_wide_bound() {
    // 8 pollers on 2 cores: at 100 ms, 10-15 % of polls timed out.
    let pace = Pace {
        interval_ms: 200,
        spacing: Duration::from_millis(600),
        max_tokens: 400,
    };
    bound_holds_across(8, 1, pace);
}
