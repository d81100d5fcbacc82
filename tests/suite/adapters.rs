//! LoRA adapters (`adapters`): a real Envoy with the built .wasm in front of
//! `vllm-sim` instances with adapter slots (`--max-loras 2`), in process so
//! each instance's adapter loads are read exactly.
//!
//! - An adapter's requests go to the first instance of its rendezvous order
//!   (xxh3 of the instance's address, seeded with the adapter name's xxh3),
//!   through either of two Envoys, so each adapter is loaded once; the same
//!   requests without `adapters` load adapters on more instances.
//! - A hot adapter's set grows along that order, and its requests spread.
//! - Base-model requests go where they go without `adapters`.
//! - With `engine_load`, an adapter's requests go only to instances whose
//!   `/v1/models` lists it, and leave one after it is unloaded there; an
//!   instance whose engine runs the adapter (`vllm:lora_requests_info`)
//!   joins the adapter's set; and the adapters the engines list are dealt
//!   out, each instance the first of as many as another (±1), alike through
//!   either of two Envoys.

use std::collections::BTreeSet;
use std::net::SocketAddr;

use harness::bodies::json_string;
use harness::client::{self, Outgoing, Reply};
use harness::load::{filter_counter, wait_for_counter};
use harness::runtime;
use prefix_router_tools::envoy::Envoy;
use prefix_router_tools::sim::{SimConfig, SimServer};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

const INSTANCES: usize = 5;
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
/// Adapters every instance serves: `lora-0` ... `lora-15`.
const SERVED_ADAPTERS: usize = 16;
const DECISION_HEADER: &str = "x-prefix-router-decision";
const CHAT: &str = "/v1/chat/completions";

fn sims(runtime: &tokio::runtime::Runtime) -> Vec<SimServer> {
    (1..=INSTANCES)
        .map(|i| {
            let cfg = SimConfig {
                name: format!("vllm-{i}"),
                model: MODEL.to_string(),
                max_loras: 2,
                lora_modules: (0..SERVED_ADAPTERS)
                    .map(|a| (format!("lora-{a}"), format!("/adapters/lora-{a}")))
                    .collect(),
                ..SimConfig::default()
            };
            runtime
                .block_on(SimServer::start(cfg, "127.0.0.1:0".parse().unwrap()))
                .expect("vllm-sim instance")
        })
        .collect()
}

/// An Envoy in front of `sims`, with `adapters` (and `load_margin`) if set.
/// One worker: a decision also reads the worker's own recent choices, so
/// two Envoys decide alike only if each request meets the same worker.
fn envoy(sims: &[SimServer], adapters: bool, load_margin: u32) -> Envoy {
    let mut config = serde_json::json!({
        "decision_header": DECISION_HEADER,
        "instances": ["127.0.0.1:8001"],
        "load_margin": load_margin,
    });
    if adapters {
        config["adapters"] = serde_json::json!({"base_models": [MODEL]});
    }
    Envoy::builder()
        .upstreams(sims.iter().map(SimServer::addr))
        .plugin_config(config.to_string())
        .concurrency(1)
        .start()
        .expect("Envoy")
}

/// The instances in `adapter`'s rendezvous order, as `vllm-<n>` names.
fn adapter_order(sims: &[SimServer], adapter: &str) -> Vec<String> {
    let seed = xxh3_64(adapter.as_bytes());
    let mut order: Vec<(u64, usize)> = sims
        .iter()
        .enumerate()
        .map(|(i, sim)| {
            (
                xxh3_64_with_seed(sim.addr().to_string().as_bytes(), seed),
                i,
            )
        })
        .collect();
    order.sort_unstable_by(|a, b| b.cmp(a));
    order
        .iter()
        .map(|(_, i)| format!("vllm-{}", i + 1))
        .collect()
}

/// A question that shares no prefix with another: without `adapters`, each
/// is placed by its own opening.
/// Four served adapters, no three of which have the same first instance
/// (an instance has two slots): each then loads once on its home.
fn four_adapters(sims: &[SimServer]) -> Vec<String> {
    let mut per_home = std::collections::BTreeMap::new();
    let mut chosen = Vec::new();
    for adapter in (0..SERVED_ADAPTERS).map(|a| format!("lora-{a}")) {
        let home = per_home
            .entry(adapter_order(sims, &adapter)[0].clone())
            .or_insert(0);
        if *home < 2 && chosen.len() < 4 {
            *home += 1;
            chosen.push(adapter);
        }
    }
    assert_eq!(chosen.len(), 4);
    chosen
}

fn chat(model: &str, question: &str, max_tokens: usize) -> Outgoing {
    let body = format!(
        r#"{{"model":{},"max_tokens":{max_tokens},"messages":[{{"role":"user","content":{}}}]}}"#,
        json_string(model),
        json_string(&format!(
            "{question} {}",
            "Explain the details. ".repeat(40)
        ))
    );
    Outgoing::post(CHAT, body).header("content-type", "application/json")
}

/// Sends `requests` to `addr`, at most `parallel` at once; every one is
/// answered 200 by an instance that names itself.
fn send(
    runtime: &tokio::runtime::Runtime,
    addr: SocketAddr,
    requests: Vec<Outgoing>,
    parallel: usize,
) -> Vec<Reply> {
    let replies = runtime
        .block_on(client::send_all(addr, requests, parallel))
        .expect("every request reaches Envoy");
    for reply in &replies {
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert!(reply.served_by().is_some());
    }
    replies
}

fn decision(reply: &Reply) -> String {
    reply
        .headers
        .get(DECISION_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// Adapter loads over the fleet since the start; every adapter is then
/// evicted (the instances are idle), so the next arm starts from none.
fn loads_then_evict(sims: &[SimServer]) -> u64 {
    sims.iter()
        .map(|sim| {
            let loads = sim.engine().lora_metrics().map_or(0, |m| m.loads);
            assert!(sim.engine().reset_prefix_cache(), "an idle instance");
            loads
        })
        .sum()
}

#[test]
fn an_adapters_requests_stay_on_its_first_instance_through_either_envoy() {
    let runtime = runtime();
    let sims = sims(&runtime);
    let proxies = [envoy(&sims, true, 4), envoy(&sims, true, 4)];
    let adapters = four_adapters(&sims);
    // Four questions each, one at a time, through the two Envoys in turn:
    // no instance is ever loaded, so no set grows.
    let requests = |proxy: usize| {
        (0..4)
            .flat_map(|q| adapters.iter().map(move |a| (a, q)))
            .enumerate()
            .filter(move |(n, _)| n % 2 == proxy)
            .map(|(_, (a, q))| (a.to_string(), chat(a, &format!("question {q} for {a}"), 4)))
            .collect::<Vec<_>>()
    };
    for proxy in [0, 1] {
        for (adapter, request) in requests(proxy) {
            let reply = send(&runtime, proxies[proxy].listener_addr(), vec![request], 1).remove(0);
            let home = &adapter_order(&sims, &adapter)[0];
            assert_eq!(reply.served_by(), Some(home.as_str()), "{adapter}");
            assert!(
                decision(&reply).ends_with("; adapter=in_set; set=1"),
                "{}",
                decision(&reply)
            );
        }
    }
    let sticky = loads_then_evict(&sims);
    assert_eq!(sticky, 4, "each adapter loaded once, on its home");
    for proxy in &proxies {
        wait_for_counter(proxy, "adapter.in_set", 8);
        assert_eq!(filter_counter(proxy, "adapter.outside_set"), 0);
    }

    // The same requests without `adapters`: placed by their prompts.
    let plain = envoy(&sims, false, 4);
    for proxy in [0, 1] {
        let requests = requests(proxy).into_iter().map(|(_, r)| r).collect();
        send(&runtime, plain.listener_addr(), requests, 1);
    }
    // Fails only if each adapter's four questions fell on one instance by
    // chance, about 5^-3 per adapter.
    let spread = loads_then_evict(&sims) - sticky;
    assert!(
        spread > sticky,
        "without adapters {spread} loads, with {sticky}"
    );
}

#[test]
fn a_hot_adapters_set_grows_along_its_order() {
    let runtime = runtime();
    let sims = sims(&runtime);
    // Bound 2 x 0 + 1: an instance with a request in flight is loaded.
    let proxy = envoy(&sims, true, 1);
    let order = adapter_order(&sims, "lora-0");
    // Long answers, so that the burst's requests are in flight together.
    let burst: Vec<Outgoing> = (0..6)
        .map(|q| chat("lora-0", &format!("hot question {q}"), 120))
        .collect();
    let replies = send(&runtime, proxy.listener_addr(), burst, 6);
    let used: BTreeSet<String> = replies
        .iter()
        .map(|r| r.served_by().unwrap().to_string())
        .collect();
    let sizes: Vec<usize> = replies
        .iter()
        .map(|r| {
            let value = decision(r);
            let size = value
                .rsplit_once("; set=")
                .map(|(_, s)| s)
                .unwrap_or_default();
            size.parse().unwrap_or_else(|_| panic!("{value}"))
        })
        .collect();
    let grown = sizes.iter().copied().max().unwrap_or(0);
    assert!(grown >= 2, "{sizes:?}");
    // Every instance the set grew past was used; none beyond it was.
    let within: BTreeSet<String> = order[..grown].iter().cloned().collect();
    assert!(used.is_subset(&within), "{used:?} not within {within:?}");
    for name in &order[..grown - 1] {
        assert!(used.contains(name), "{name} of {order:?}: {used:?}");
    }
    wait_for_counter(&proxy, "adapter.set_grown", 1);
}

#[test]
fn base_model_requests_route_as_without_adapters() {
    let runtime = runtime();
    let sims = sims(&runtime);
    let requests = || {
        (0..16)
            .map(|q| chat(MODEL, &format!("base question {q}"), 4))
            .collect::<Vec<_>>()
    };
    let served = |proxy: &Envoy| -> Vec<String> {
        loads_then_evict(&sims);
        send(&runtime, proxy.listener_addr(), requests(), 1)
            .iter()
            .map(|r| {
                assert!(!decision(r).contains("adapter="), "{}", decision(r));
                r.served_by().unwrap().to_string()
            })
            .collect()
    };
    let with = served(&envoy(&sims, true, 4));
    let without = served(&envoy(&sims, false, 4));
    assert_eq!(with, without);
    let instances: BTreeSet<&String> = with.iter().collect();
    assert!(instances.len() >= 3, "{with:?}");
}

/// An Envoy in front of `sims` with `adapters` and `engine_load` polling
/// every 100 ms, once three rounds of polls were sent: every instance's
/// lists have been read.
fn envoy_with_engine_load(sims: &[SimServer]) -> Envoy {
    let config = serde_json::json!({
        "decision_header": DECISION_HEADER,
        "instances": ["127.0.0.1:8001"],
        "adapters": {"base_models": [MODEL]},
        "engine_load": {"cluster": "engine_metrics", "interval_ms": 100},
    });
    let proxy = Envoy::builder()
        .upstreams(sims.iter().map(SimServer::addr))
        .plugin_config(config.to_string())
        .concurrency(1)
        .start()
        .expect("Envoy");
    wait_for_counter(&proxy, "engine.polls", 3 * INSTANCES as u64);
    proxy
}

#[test]
fn with_engine_load_an_adapter_goes_only_where_its_engine_lists_it() {
    let runtime = runtime();
    let sims = sims(&runtime);
    let order = adapter_order(&sims, "lora-3");
    let sim_named = |name: &str| &sims[name["vllm-".len()..].parse::<usize>().unwrap() - 1];
    // Loaded only on the third and fifth of its order.
    for name in [&order[0], &order[1], &order[3]] {
        assert!(sim_named(name).engine().remove_adapter("lora-3"));
    }
    let proxy = envoy_with_engine_load(&sims);
    let ask = |q: usize| chat("lora-3", &format!("question {q}"), 4);
    // Its home is one of the two that list it (which one, the dealing of
    // every listed adapter decides); the other is the one left.
    let home = send(&runtime, proxy.listener_addr(), vec![ask(0)], 1)
        .remove(0)
        .served_by()
        .expect("named")
        .to_string();
    assert!(
        home == order[2] || home == order[4],
        "{home} lists no lora-3"
    );
    let other = if home == order[2] {
        &order[4]
    } else {
        &order[2]
    };
    for q in 1..6 {
        let reply = send(&runtime, proxy.listener_addr(), vec![ask(q)], 1).remove(0);
        assert_eq!(reply.served_by(), Some(home.as_str()), "request {q}");
    }
    // Unloaded there through vLLM's API: after a poll, the other serves it.
    let unload = Outgoing::post("/v1/unload_lora_adapter", r#"{"lora_name":"lora-3"}"#)
        .header("content-type", "application/json");
    let replies = runtime
        .block_on(client::send_all(sim_named(&home).addr(), vec![unload], 1))
        .expect("vllm-sim answers");
    assert_eq!(replies[0].status, 200, "{}", replies[0].text());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut q = 6;
    loop {
        let replies = runtime
            .block_on(client::send_all(proxy.listener_addr(), vec![ask(q)], 1))
            .expect("Envoy answers");
        q += 1;
        if replies[0].served_by() == Some(other.as_str()) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still {:?}",
            replies[0].served_by()
        );
    }
    for q in q..q + 6 {
        let reply = send(&runtime, proxy.listener_addr(), vec![ask(q)], 1).remove(0);
        assert_eq!(reply.served_by(), Some(other.as_str()), "request {q}");
    }
}

#[test]
fn with_engine_load_an_instance_whose_engine_runs_the_adapter_joins_its_set() {
    let runtime = runtime();
    let sims = sims(&runtime);
    let proxy = envoy_with_engine_load(&sims);
    let ask = |q: usize| chat("lora-5", &format!("question {q}"), 4);
    let first = send(&runtime, proxy.listener_addr(), vec![ask(0)], 1).remove(0);
    assert!(decision(&first).ends_with("set=1"), "{}", decision(&first));
    let home = first.served_by().unwrap_or_default().to_string();
    // Another instance runs the adapter: a long answer asked of it directly,
    // which this Envoy neither sent nor indexed.
    let runner = (1..=INSTANCES)
        .find(|i| format!("vllm-{i}") != home)
        .map(|i| &sims[i - 1])
        .expect("another instance");
    let long_answer = runtime.spawn(client::send_all(
        runner.addr(),
        vec![chat("lora-5", "a long answer", 2_000)],
        1,
    ));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !runs(runner, "lora-5") {
        assert!(std::time::Instant::now() < deadline, "lora-5 never ran");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Two rounds of polls since: every instance's gauge has been read.
    let polls = filter_counter(&proxy, "engine.polls");
    wait_for_counter(&proxy, "engine.polls", polls + 2 * INSTANCES as u64);
    assert!(runs(runner, "lora-5"), "still running");
    let reply = send(&runtime, proxy.listener_addr(), vec![ask(1)], 1).remove(0);
    assert!(decision(&reply).ends_with("set=2"), "{}", decision(&reply));
    long_answer.abort();
}

/// Whether `sim`'s latest `vllm:lora_requests_info` state runs `adapter`.
fn runs(sim: &SimServer, adapter: &str) -> bool {
    let metrics = sim.engine().lora_metrics().expect("adapter slots");
    metrics
        .states
        .iter()
        .max_by(|a, b| a.2.total_cmp(&b.2))
        .is_some_and(|(running, _, _)| running.split(',').any(|a| a == adapter))
}

#[test]
fn with_engine_load_the_listed_adapters_are_dealt_out_evenly_and_alike_through_either_envoy() {
    let runtime = runtime();
    let sims = sims(&runtime);
    let (first, second) = (envoy_with_engine_load(&sims), envoy_with_engine_load(&sims));
    let mut headed: std::collections::BTreeMap<String, usize> = Default::default();
    for a in 0..SERVED_ADAPTERS {
        let adapter = format!("lora-{a}");
        let ask = |proxy: &Envoy, question: &str| {
            send(
                &runtime,
                proxy.listener_addr(),
                vec![chat(&adapter, question, 4)],
                1,
            )
            .remove(0)
            .served_by()
            .expect("named")
            .to_string()
        };
        let home = ask(&first, "through the first Envoy");
        assert_eq!(ask(&second, "through the second Envoy"), home, "{adapter}");
        *headed.entry(home).or_default() += 1;
    }
    // 16 adapters over 5 instances: 3 each, one of them 4.
    let mut counts: Vec<usize> = headed.values().copied().collect();
    counts.sort_unstable();
    assert_eq!(
        counts,
        [3, 3, 3, 3, 4],
        "adapters headed per instance: {headed:?}"
    );
}
