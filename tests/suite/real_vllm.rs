//! Real vLLM (its CPU backend, SmolLM2-135M) behind a real Envoy with the
//! filter and the shipped configuration. `cargo xtask test` (or, alone,
//! `cargo xtask test --real-vllm`) installs vLLM, starts three instances
//! serving two LoRA adapters and names them here (`PREFIX_ROUTER_VLLM*`);
//! it runs the test that kills an instance last.
//!
//! - A conversation stays on one instance, and vLLM reports its history
//!   cached (`usage.prompt_tokens_details.cached_tokens`); the filter's
//!   usage counters hold what vLLM sent, streamed or not.
//! - The poller reads every instance's real `/metrics` without a failure.
//! - An adapter unloaded from the instance its requests go to (gone from
//!   its `/v1/models`) is served elsewhere after a poll, and there again
//!   once loaded again.
//! - An instance killed between requests loses none of the next ones.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use harness::load::{filter_counter, host_counter, wait_for_counter};
use prefix_router::engine_load::REQUESTS_GAUGE_PREFIX;
use prefix_router::load::FAILED_RETRY_MS;
use prefix_router::metrics::instance_stat_name;
use prefix_router_tools::envoy::Envoy;
use serde_json::{json, Value};

const DECISION_HEADER: &str = "x-prefix-router-decision";
/// Envoy's worker threads in the test that kills an instance.
const WORKERS: u32 = 2;

/// The instances `cargo xtask test --real-vllm` started.
struct Fleet {
    addrs: Vec<SocketAddr>,
    model: String,
    /// Each instance's process group, in `addrs`' order.
    pids: Vec<u32>,
    /// (name, folder) of the adapters every instance serves.
    adapters: Vec<(String, String)>,
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run this suite with `cargo xtask test --real-vllm`")
    })
}

fn fleet() -> Fleet {
    let list = |name: &str| -> Vec<String> { var(name).split(',').map(str::to_string).collect() };
    Fleet {
        addrs: list("PREFIX_ROUTER_VLLM")
            .iter()
            .map(|a| a.parse().expect("an instance address"))
            .collect(),
        model: var("PREFIX_ROUTER_VLLM_MODEL"),
        pids: list("PREFIX_ROUTER_VLLM_PIDS")
            .iter()
            .map(|p| p.parse().expect("a process id"))
            .collect(),
        adapters: list("PREFIX_ROUTER_VLLM_ADAPTERS")
            .iter()
            .map(|a| {
                let (name, path) = a.split_once('=').expect("name=folder");
                (name.to_string(), path.to_string())
            })
            .collect(),
    }
}

/// Envoy with the shipped configuration in front of `fleet`, the filter
/// configured as the default plus `more`, engine load polled.
fn envoy(fleet: &Fleet, workers: u32, more: Value) -> Envoy {
    let mut config = json!({
        "instances": [],
        "decision_header": DECISION_HEADER,
        "engine_load": {"cluster": "engine_metrics", "interval_ms": 250},
    });
    if let (Some(config), Some(more)) = (config.as_object_mut(), more.as_object()) {
        config.extend(more.clone());
    }
    let envoy = Envoy::builder()
        .upstreams(fleet.addrs.iter().copied())
        .plugin_config(config.to_string())
        .concurrency(workers)
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    // Two rounds of polls sent: every instance sampled before traffic.
    wait_for_counter(&envoy, "engine.polls", 2 * fleet.addrs.len() as u64);
    envoy
}

/// POSTs `body` to `envoy`'s chat completions: the status, the instance the
/// decision header names, and the body as text.
fn post_chat(envoy: &Envoy, body: &Value) -> (u16, Option<String>, String) {
    let response = ureq::post(&format!("{}/v1/chat/completions", envoy.base_url()))
        .timeout(Duration::from_secs(300))
        .set("content-type", "application/json")
        .send_string(&body.to_string());
    let response = match response {
        Ok(response) => response,
        Err(ureq::Error::Status(_, response)) => response,
        Err(error) => panic!("no answer from Envoy: {error}"),
    };
    let status = response.status();
    let instance = response
        .header(DECISION_HEADER)
        .and_then(|d| d.split("; ").find_map(|f| f.strip_prefix("instance=")))
        .map(str::to_string);
    (status, instance, response.into_string().unwrap_or_default())
}

/// A chat completion through `envoy`: its status, the instance the decision
/// header names, and the body.
fn chat(envoy: &Envoy, model: &str, messages: &Value) -> (u16, Option<String>, Value) {
    let body = json!({"model": model, "messages": messages, "max_tokens": 4, "temperature": 0});
    let (status, instance, text) = post_chat(envoy, &body);
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, instance, body)
}

/// A streamed chat completion through `envoy` that asks for its usage: the
/// status, the instance the decision header names, and the usage of the
/// last event that has one.
fn chat_streamed(envoy: &Envoy, model: &str, messages: &Value) -> (u16, Option<String>, Value) {
    let body = json!({
        "model": model, "messages": messages, "max_tokens": 4, "temperature": 0,
        "stream": true, "stream_options": {"include_usage": true},
    });
    let (status, instance, text) = post_chat(envoy, &body);
    let usage = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .map(|event| event["usage"].clone())
        .filter(|usage| !usage.is_null())
        .last()
        .unwrap_or_else(|| panic!("no usage in the stream ({status}): {text}"));
    (status, instance, usage)
}

/// A short question no other shares (vLLM's CPU blocks are 128 tokens: it
/// never hits).
fn question(n: usize) -> Value {
    json!([{"role": "user", "content": format!("Question {n}: name a colour.")}])
}

#[test]
fn a_conversation_stays_on_one_instance_and_vllm_reports_its_history_cached() {
    let fleet = fleet();
    let envoy = envoy(&fleet, 1, json!({}));
    let document = (0..120)
        .map(|i| format!("Clause {i} sets out duty {} of the parties.", i * 7 % 101))
        .collect::<Vec<_>>()
        .join(" ");
    let mut messages = vec![
        json!({"role": "system", "content": format!("Answer from this contract. {document}")}),
    ];
    let mut instances = Vec::new();
    // (prompt_tokens, cached_tokens) of every answer, as the client read them.
    let mut reported = Vec::new();
    for turn in 0..4 {
        messages.push(json!({"role": "user", "content": format!("Summarise clause {turn}.")}));
        let (status, instance, body) = chat(&envoy, &fleet.model, &Value::from(messages.clone()));
        assert_eq!(status, 200, "turn {turn}: {body}");
        let usage = &body["usage"];
        let prompt = usage["prompt_tokens"].as_u64().expect("prompt_tokens");
        let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
        if turn > 0 {
            // The history, whole 128-token blocks of it, was in its cache.
            let cached = cached.expect("cached_tokens (--enable-prompt-tokens-details)");
            assert!(
                cached * 10 >= prompt * 8,
                "turn {turn}: {cached} of {prompt} cached"
            );
        }
        let answer = body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("");
        messages.push(json!({"role": "assistant", "content": answer}));
        instances.push(instance.expect("the decision names the instance"));
        reported.push((prompt, cached));
    }
    // A fifth turn streamed, its usage in the last event.
    messages.push(json!({"role": "user", "content": "Summarise clause 4."}));
    let (status, instance, usage) = chat_streamed(&envoy, &fleet.model, &Value::from(messages));
    assert_eq!(status, 200, "{usage}");
    instances.push(instance.expect("the decision names the instance"));
    let prompt = usage["prompt_tokens"].as_u64().expect("prompt_tokens");
    let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert!(cached.is_some_and(|c| c * 10 >= prompt * 8), "{usage}");
    reported.push((prompt, cached));
    assert!(
        instances.iter().all(|i| *i == instances[0]),
        "{instances:?}"
    );
    // The filter read every usage vLLM sent, streamed or not, as sent.
    let stat = |name: &str| format!("usage.{name}.endpoint.{}", instances[0]);
    let counter = |name: &str| filter_counter(&envoy, &stat(name));
    wait_for_counter(&envoy, &stat("responses"), 5);
    let with_cached = reported.iter().filter(|(_, c)| c.is_some()).count() as u64;
    assert_eq!(
        [
            counter("responses"),
            counter("reported"),
            counter("reported_cached"),
            counter("prompt_tokens"),
            counter("cached_tokens"),
        ],
        [
            5,
            5,
            with_cached,
            reported.iter().map(|(p, _)| p).sum(),
            reported.iter().filter_map(|(_, c)| *c).sum(),
        ]
    );
}

#[test]
fn the_poller_reads_every_real_instance_without_a_failure() {
    let fleet = fleet();
    let envoy = envoy(&fleet, 1, json!({}));
    let polls = filter_counter(&envoy, "engine.polls");
    wait_for_counter(&envoy, "engine.polls", polls + 2 * fleet.addrs.len() as u64);
    // A slow answer on a busy machine is a timeout, not a misreading.
    for reason in ["unreachable", "status", "body"] {
        let failed = filter_counter(&envoy, &format!("engine.poll_failures.{reason}"));
        assert_eq!(failed, 0, "{reason}");
    }
    for addr in &fleet.addrs {
        let name = instance_stat_name(REQUESTS_GAUGE_PREFIX, &addr.to_string());
        let gauge = envoy
            .stat(&format!("wasmcustom.{name}"))
            .expect("admin /stats");
        assert!(gauge.is_some(), "no running + waiting sampled from {addr}");
    }
}

/// vLLM's `/v1/load_lora_adapter` or `/v1/unload_lora_adapter` on `addr`.
fn lora_admin(addr: SocketAddr, action: &str, body: &Value) {
    let answer = ureq::post(&format!("http://{addr}/v1/{action}_lora_adapter"))
        .timeout(Duration::from_secs(120))
        .set("content-type", "application/json")
        .send_string(&body.to_string());
    assert!(answer.is_ok(), "{action} on {addr}: {answer:?}");
}

#[test]
fn an_adapter_unloaded_where_it_goes_is_served_elsewhere_after_a_poll_and_back_once_loaded() {
    let fleet = fleet();
    let envoy = envoy(
        &fleet,
        1,
        json!({"adapters": {"base_models": [fleet.model]}}),
    );
    let (adapter, path) = fleet.adapters.last().expect("an adapter");
    let ask = |n: usize| chat(&envoy, adapter, &question(n));
    let served = |n: usize| {
        let (status, instance, body) = ask(n);
        assert_eq!(status, 200, "request {n}: {body}");
        instance.expect("the decision names the instance")
    };
    // Every instance lists every adapter, so the adapter's home is whichever
    // instance the listed adapters were dealt to: the first request shows it.
    let home = served(0);
    let home_addr: SocketAddr = home.parse().expect("an instance address");
    let after_a_poll = || {
        let polls = filter_counter(&envoy, "engine.polls");
        wait_for_counter(&envoy, "engine.polls", polls + 2 * fleet.addrs.len() as u64);
    };
    lora_admin(home_addr, "unload", &json!({"lora_name": adapter}));
    after_a_poll();
    let elsewhere = served(1);
    assert_ne!(elsewhere, home, "served where it was unloaded");
    assert_eq!(served(2), elsewhere);
    lora_admin(
        home_addr,
        "load",
        &json!({"lora_name": adapter, "lora_path": path}),
    );
    after_a_poll();
    assert_eq!(served(3), home);
}

#[test]
fn an_instance_killed_between_requests_loses_none_of_the_next() {
    let fleet = fleet();
    let envoy = envoy(&fleet, WORKERS, json!({}));
    let mut victim = None;
    for n in 0..12 {
        let (status, instance, body) = chat(&envoy, &fleet.model, &question(n));
        assert_eq!(status, 200, "request {n}: {body}");
        victim = victim.or(instance);
    }
    let victim: SocketAddr = victim
        .expect("a served request")
        .parse()
        .expect("an address");
    let pid = fleet.pids[fleet
        .addrs
        .iter()
        .position(|a| *a == victim)
        .expect("one of the fleet")];
    let killed = std::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{pid}")])
        .status()
        .expect("kill");
    assert!(killed.success(), "kill -KILL -{pid}");
    // Dead once its port refuses connections: until the dying processes'
    // sockets are closed, a connection is accepted and then reset, and a
    // request written on it is never retried (the instance may have read it).
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect_timeout(&victim, Duration::from_millis(200)).is_ok() {
        assert!(
            Instant::now() < deadline,
            "{victim} still accepts connections 10 s after the kill"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Envoy has seen its pooled connections there close (a request written
    // on one before that fails, as the instance may have read it: never
    // retried), as in `upstream_failure.rs`.
    let deadline = Instant::now() + Duration::from_secs(10);
    while host_counter(&envoy, victim, "cx_active") > 0 {
        assert!(
            Instant::now() < deadline,
            "connections to {victim} still open 10 s after the kill"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let died = Instant::now();
    for n in 12..36 {
        let (status, _, body) = chat(&envoy, &fleet.model, &question(n));
        assert_eq!(status, 200, "request {n} after {victim} died: {body}");
    }
    let tried = host_counter(&envoy, victim, "cx_connect_fail");
    assert!(
        tried >= 1,
        "no request tried the dead instance: nothing was tested"
    );
    // As `upstream_failure.rs`: at most two per worker after the first
    // failure, plus one per worker and one by Envoy per FAILED_RETRY_MS.
    let periods = died.elapsed().as_millis() as u64 / FAILED_RETRY_MS;
    let bound = 1 + u64::from(WORKERS) * (2 + 2 * periods);
    assert!(
        tried <= bound,
        "{tried} connections tried to the dead instance (at most {bound})"
    );
    wait_for_counter(&envoy, "upstream.instances_failed", 1);
}
