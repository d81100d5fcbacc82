//! End to end without Envoy: simulated instances on ephemeral loopback ports,
//! driven by the load generator, checking what the benchmark will rely on:
//! repeated prefixes come back as cached tokens, `/metrics` agrees with the
//! usage clients saw, `x-served-by` names the instance, multi-turn history
//! hits, a vanished client frees its slot, and the binary announces its port.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use prefix_router_tools::loadgen::{run_workload, Api, Arrival, RunOptions, Workload};
use prefix_router_tools::sim::metrics::parse_sample;
use prefix_router_tools::sim::{SimConfig, SimServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod common;

use common::{sim, TIME_SCALE};

/// A raw HTTP/1.1 GET on a fresh connection; returns (head, body).
async fn get(addr: SocketAddr, path: &str) -> (String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    (head.to_string(), body.to_string())
}

async fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (_, body) = get(addr, "/metrics").await;
    parse_sample(&body, name).unwrap_or_else(|| panic!("{name} missing from /metrics:\n{body}"))
}

fn opts(api: Api, arrival: Arrival, max_requests: usize) -> RunOptions {
    RunOptions {
        api,
        arrival,
        max_requests,
        max_duration: Duration::from_secs(20),
        request_timeout: Duration::from_secs(10),
        time_scale: TIME_SCALE,
        keep_records: true,
        ..RunOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_prefixes_are_cached_and_metrics_agree_with_usage() {
    let a = sim("sim-a").await;
    let b = sim("sim-b").await;
    let workload = Workload::GeneratedSharedPrefix {
        groups: 4,
        prompts_per_group: 4,
        system_tokens: 512,
        question_tokens: 64,
        output_tokens: 16,
        zipf_alpha: None,
    };
    for (server, api) in [(&a, Api::Chat), (&b, Api::Invoke)] {
        let target = format!("http://{}", server.addr());
        let report = run_workload(
            &target,
            &workload,
            &opts(api, Arrival::Concurrency { clients: 4 }, 40),
        )
        .await
        .unwrap();
        let name = server.engine().config().name.clone();
        assert_eq!(report.failures, 0, "{:?}", report.failure_kinds);
        assert_eq!(report.successes, 40);
        assert_eq!(report.instances.keys().collect::<Vec<_>>(), vec![&name]);
        // 4 groups: at most 4 misses of the system prompt (plus concurrent
        // first requests), then every request reuses at least its 512 tokens.
        let with_hits = report
            .records
            .iter()
            .filter(|r| r.cached_tokens.unwrap_or(0) >= 496)
            .count();
        assert!(
            with_hits >= 32,
            "{api:?}: {with_hits} requests hit the shared prefix"
        );
        assert!(
            report.hit_rate > 0.6,
            "{api:?}: hit rate {}",
            report.hit_rate
        );
        for r in &report.records {
            assert!(r.ttft_ms.is_some() && r.ttft_ms <= Some(r.latency_ms));
            assert_eq!(r.completion_tokens, Some(16));
            assert_eq!(r.cached_tokens.unwrap() % 16, 0, "hits are whole blocks");
            assert!(r.cached_tokens < r.prompt_tokens);
        }
        let addr = server.addr();
        assert_eq!(
            metric(addr, "vllm:prefix_cache_queries_total").await,
            report.prompt_tokens as f64
        );
        assert_eq!(
            metric(addr, "vllm:prefix_cache_hits_total").await,
            report.cached_tokens as f64
        );
        assert_eq!(
            metric(addr, "vllm:time_to_first_token_seconds_count").await,
            40.0
        );
        assert_eq!(metric(addr, "vllm:num_requests_running").await, 0.0);
        assert_eq!(metric(addr, "vllm:num_requests_waiting").await, 0.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_history_including_answers_is_a_cached_prefix() {
    let a = sim("sim-mt").await;
    let workload = Workload::MultiTurn {
        conversations: 4,
        min_turns: 3,
        max_turns: 3,
        system_tokens: 100,
        user_tokens: 40,
        output_tokens: 40,
    };
    let target = format!("http://{}", a.addr());
    let report = run_workload(
        &target,
        &workload,
        &opts(Api::Chat, Arrival::Concurrency { clients: 4 }, 24),
    )
    .await
    .unwrap();
    assert_eq!(report.failures, 0, "{:?}", report.failure_kinds);
    let mut by_conversation: BTreeMap<u64, Vec<_>> = BTreeMap::new();
    for r in &report.records {
        by_conversation
            .entry(r.conversation.unwrap())
            .or_default()
            .push(r);
    }
    let mut checked = 0;
    for turns in by_conversation.values() {
        for pair in turns.windows(2) {
            let (prev, next) = (pair[0], pair[1]);
            // The previous prompt and its answer were cached when it finished.
            let seen = prev.prompt_tokens.unwrap() + prev.completion_tokens.unwrap();
            assert!(
                next.cached_tokens.unwrap() >= seen / 16 * 16,
                "turn after {seen} tokens hit only {:?}",
                next.cached_tokens
            );
            assert!(next.prompt_tokens.unwrap() > seen);
            checked += 1;
        }
    }
    assert!(checked >= 8, "{checked} follow-up turns checked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisson_arrivals_spread_over_two_instances_by_whoever_is_asked() {
    // Two instances, each driven directly: the report names who served.
    let a = sim("left").await;
    let b = sim("right").await;
    let workload = Workload::NoSharedPrefix {
        prompt_tokens: 200,
        output_tokens: 8,
    };
    let mut o = opts(Api::Chat, Arrival::Poisson { rate: 20.0 }, 20);
    o.instances = vec!["left".into(), "right".into()];
    let report = run_workload(&format!("http://{}", a.addr()), &workload, &o)
        .await
        .unwrap();
    assert_eq!(report.successes, 20);
    assert_eq!(report.instances["left"].requests, 20);
    assert_eq!(report.instances["right"].requests, 0);
    assert_eq!((report.share_min, report.share_max), (0.0, 1.0));
    assert_eq!(
        report.cached_tokens, 0,
        "fresh prompts share only the template's first tokens"
    );
    assert_eq!(
        metric(b.addr(), "vllm:prefix_cache_queries_total").await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_frees_its_slot() {
    let a = sim("sim-abort").await;
    let mut s = tokio::net::TcpStream::connect(a.addr()).await.unwrap();
    let body =
        r#"{"messages":[{"role":"user","content":"hello"}],"max_tokens":5000,"stream":true}"#;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(head.contains("x-served-by: sim-abort"), "{head}");
    assert_eq!(metric(a.addr(), "vllm:num_requests_running").await, 1.0);
    drop(s);
    // Readiness poll, bounded: the stream notices the closed connection at its next event.
    let mut running = 1.0;
    for _ in 0..200 {
        running = metric(a.addr(), "vllm:num_requests_running").await;
        if running == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(running, 0.0, "the aborted request still holds its slot");
}

/// Kills the child process when the test ends, however it ends.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_binary_announces_its_ephemeral_port_and_names_itself() {
    let mut child = Killed(
        Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
            .args(["--port", "0", "--name", "bin-sim", "--kv-blocks", "64"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn vllm-sim"),
    );
    let stdout = child.0.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).map(|_| line)
    })
    .await
    .unwrap()
    .unwrap();
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("first line was {line:?}"))
        .parse()
        .unwrap();
    assert_ne!(addr.port(), 0);
    let (head, _) = get(addr, "/health").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("x-served-by: bin-sim"), "{head}");
    let (head, body) = get(addr, "/nope").await;
    assert!(head.starts_with("HTTP/1.1 404") && head.contains("x-served-by: bin-sim"));
    assert!(body.contains("\"object\":\"error\""));
    // A request larger than the whole cache is refused with a clear 400.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = r#"{"prompt":"hi","max_tokens":2000}"#;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    assert!(out.contains("KV cache blocks"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spawned_fleet_counters_match_what_clients_saw() {
    use prefix_router_tools::sim::fleet::{scrape_cache_counters, CacheCounters, SimProcess};
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_vllm-sim"));
    let fleet: Vec<SimProcess> = ["p0", "p1"]
        .iter()
        .map(|name| {
            let cfg = SimConfig {
                name: name.to_string(),
                time_scale: TIME_SCALE,
                kv_blocks: 4096,
                prompt_tokens_details: true,
                ..SimConfig::default()
            };
            SimProcess::spawn(exe, &cfg, Duration::from_secs(10)).unwrap()
        })
        .collect();
    let workload = Workload::LongSharedPrefix {
        groups: 3,
        prefix_tokens: 800,
        question_tokens: 100,
        output_tokens: 8,
    };
    let mut before = Vec::new();
    for p in &fleet {
        before.push(scrape_cache_counters(p.addr).await.unwrap());
    }
    let mut reports = Vec::new();
    for (i, p) in fleet.iter().enumerate() {
        let mut o = opts(Api::Invoke, Arrival::Concurrency { clients: 2 }, 12);
        o.seed = i as u64;
        reports.push(run_workload(&p.url(), &workload, &o).await.unwrap());
        assert_eq!(reports[i].instances[&p.name].requests, 12);
    }
    let mut after = Vec::new();
    for p in &fleet {
        after.push(scrape_cache_counters(p.addr).await.unwrap());
    }
    let deltas: Vec<CacheCounters> = after.iter().zip(&before).map(|(a, b)| a.since(b)).collect();
    for (d, r) in deltas.iter().zip(&reports) {
        assert_eq!(d.queries, r.prompt_tokens as f64);
        assert_eq!(d.hits, r.cached_tokens as f64);
        assert!(d.hit_rate() > 0.5, "{}", d.hit_rate());
    }
    // After a reset, the same workload starts cold again.
    use prefix_router_tools::sim::fleet::reset_prefix_cache;
    reset_prefix_cache(fleet[0].addr).await.unwrap();
    let start = scrape_cache_counters(fleet[0].addr).await.unwrap();
    let mut o = opts(Api::Invoke, Arrival::Concurrency { clients: 1 }, 1);
    o.seed = 0;
    let cold = run_workload(&fleet[0].url(), &workload, &o).await.unwrap();
    assert_eq!(cold.cached_tokens, 0);
    let d = scrape_cache_counters(fleet[0].addr)
        .await
        .unwrap()
        .since(&start);
    assert_eq!((d.queries, d.hits), (cold.prompt_tokens as f64, 0.0));
    let total = CacheCounters::total(&deltas);
    assert_eq!(
        total.queries,
        (reports[0].prompt_tokens + reports[1].prompt_tokens) as f64
    );
}

/// One raw HTTP/1.1 POST on a fresh connection with extra header lines;
/// returns (head, body) once the server closes.
async fn post(addr: SocketAddr, path: &str, headers: &str, body: &str) -> (String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{headers}connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    (head.to_string(), body.to_string())
}

/// The value of response header `name` (lowercase) in a raw head.
fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orca_load_reports_match_metrics_on_non_streaming_openai_responses_only() {
    let a = sim("sim-orca").await;
    // A long streamed request holds KV blocks, so the report has something to show.
    let mut held = tokio::net::TcpStream::connect(a.addr()).await.unwrap();
    let body = r#"{"messages":[{"role":"user","content":"hold these blocks"}],"max_tokens":5000,"stream":true}"#;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    held.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = held.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).contains("200 OK"));
    let kv = metric(a.addr(), "vllm:kv_cache_usage_perc").await;
    assert!(kv > 0.0, "the held request holds no KV blocks");

    let chat = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
    let asked = "endpoint-load-metrics-format: TEXT\r\n";
    let (head, _) = post(a.addr(), "/v1/chat/completions", asked, chat).await;
    let expected = format!(
        "TEXT named_metrics.num_requests_waiting={:?}, named_metrics.kv_cache_usage_perc={kv:?}",
        metric(a.addr(), "vllm:num_requests_waiting").await
    );
    assert_eq!(
        header(&head, "endpoint-load-metrics"),
        Some(expected.as_str()),
        "{head}"
    );

    let completion = r#"{"prompt":"hi","max_tokens":2}"#;
    let (head, _) = post(
        a.addr(),
        "/v1/completions",
        "endpoint-load-metrics-format: json\r\n",
        completion,
    )
    .await;
    let report = header(&head, "endpoint-load-metrics").expect("no JSON report");
    let parsed: serde_json::Value =
        serde_json::from_str(report.strip_prefix("JSON ").unwrap()).unwrap();
    assert_eq!(parsed["named_metrics"]["kv_cache_usage_perc"], kv);

    // Not asked, streaming, native invoke, unknown format: no report, as in vLLM.
    let streamed = r#"{"prompt":"hi","max_tokens":2,"stream":true}"#;
    for (path, headers, body) in [
        ("/v1/chat/completions", "", chat),
        ("/v1/completions", asked, streamed),
        ("/invocations", asked, "hi"),
        (
            "/v1/chat/completions",
            "endpoint-load-metrics-format: BIN\r\n",
            chat,
        ),
    ] {
        let (head, _) = post(a.addr(), path, headers, body).await;
        assert!(head.contains("200 OK"), "{path}: {head}");
        assert_eq!(
            header(&head, "endpoint-load-metrics"),
            None,
            "{path} {headers:?}: {head}"
        );
    }
    drop(held);
}

#[tokio::test]
async fn sglang_router_registration_endpoints_name_the_model_and_no_path() {
    let a = sim("sim-sglang").await;
    for path in [
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
    ] {
        let (head, body) = get(a.addr(), path).await;
        assert!(head.contains("200 OK"), "{path}: {head}");
        let info: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            info["served_model_name"],
            SimConfig::default().model,
            "{path}"
        );
        // A path makes SGLang's router try to download a tokenizer.
        assert!(
            info.get("model_path").is_none() && info.get("tokenizer_path").is_none(),
            "{path}: {body}"
        );
    }
}

/// A non-streaming chat request naming `model`; returns (status line, body as JSON).
async fn chat(addr: SocketAddr, model: &str, text: &str) -> (String, serde_json::Value) {
    let body = serde_json::json!({
        "model": model, "max_tokens": 2,
        "messages": [{"role": "user", "content": text}],
    });
    let (head, body) = post(addr, "/v1/chat/completions", "", &body.to_string()).await;
    let status = head.lines().next().unwrap_or_default().to_string();
    (status, serde_json::from_str(&body).unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_adapters_are_served_listed_loaded_and_cached_apart() {
    let base = SimConfig::default().model;
    let server = SimServer::start(
        SimConfig {
            time_scale: TIME_SCALE,
            kv_blocks: 20_000,
            max_loras: 1,
            lora_modules: vec![("a0".into(), "/adapters/a0".into())],
            prompt_tokens_details: true,
            ..SimConfig::default()
        },
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let addr = server.addr();
    let (_, models) = get(addr, "/v1/models").await;
    let models: serde_json::Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], base.as_str());
    assert_eq!(models["data"][1]["id"], "a0");
    assert_eq!(models["data"][1]["parent"], base.as_str());
    assert_eq!(models["data"][1]["root"], "/adapters/a0");

    // vLLM's answers to load and unload.
    let load = |body: &'static str| post(addr, "/v1/load_lora_adapter", "", body);
    let (head, body) = load(r#"{"lora_name":"a1","lora_path":"/adapters/a1"}"#).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body, "Success: LoRA adapter 'a1' added successfully.");
    let (head, body) = load(r#"{"lora_name":"a1","lora_path":"/adapters/a1"}"#).await;
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    assert!(body.contains("The lora adapter 'a1' has already been loaded."));
    assert!(body.contains("InvalidUserInput"));
    let (head, body) = load(r#"{"lora_name":"a2"}"#).await;
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    assert!(body.contains("Both 'lora_name' and 'lora_path' must be provided."));
    let (head, body) = post(addr, "/v1/unload_lora_adapter", "", r#"{"lora_name":"a9"}"#).await;
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    assert!(body.contains("The lora adapter 'a9' cannot be found."));
    let (_, models) = get(addr, "/v1/models").await;
    assert!(models.contains("\"a1\""));

    // An unknown model is vLLM's 404.
    let (status, error) = chat(addr, "nope", "hello").await;
    assert!(status.contains(" 404 "), "{status}");
    assert_eq!(error["message"], "The model `nope` does not exist.");
    assert_eq!(error["type"], "NotFoundError");
    assert_eq!(error["param"], "model");

    // One cache per adapter: the same text hits under the same adapter only.
    let text = "the same long text under every adapter ".repeat(20);
    let cached = |v: &serde_json::Value| {
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let (status, first) = chat(addr, "a0", &text).await;
    assert!(status.contains(" 200 "), "{status}");
    assert_eq!(cached(&first), 0);
    assert!(cached(&chat(addr, "a0", &text).await.1) > 0);
    assert_eq!(cached(&chat(addr, &base, &text).await.1), 0);
    assert_eq!(cached(&chat(addr, "a1", &text).await.1), 0);
    // a0, then a1 evicting it from the only slot, then a0 again.
    chat(addr, "a0", &text).await;
    let (_, metrics) = get(addr, "/metrics").await;
    assert_eq!(
        parse_sample(&metrics, "vllm_sim:lora_loads_total"),
        Some(3.0)
    );
    assert!(metrics.contains(
        "vllm:lora_requests_info{max_lora=\"1\",waiting_lora_adapters=\"\",running_lora_adapters=\"a0\"} "
    ), "{metrics}");
    assert!(metrics.contains(
        "vllm:lora_requests_info{max_lora=\"1\",waiting_lora_adapters=\"\",running_lora_adapters=\"\"} "
    ));

    let (head, body) = post(addr, "/v1/unload_lora_adapter", "", r#"{"lora_name":"a1"}"#).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body, "Success: LoRA adapter 'a1' removed successfully.");
    assert!(chat(addr, "a1", "x").await.0.contains(" 404 "));

    // Without slots any model is served and nothing about LoRA shows.
    let plain = sim("plain").await;
    assert!(chat(plain.addr(), "anything", "x")
        .await
        .0
        .contains(" 200 "));
    let (_, models) = get(plain.addr(), "/v1/models").await;
    assert!(!models.contains("parent"));
    assert!(!get(plain.addr(), "/metrics").await.1.contains("lora"));
}

/// As vLLM: a non-streaming response always carries usage with its cached
/// tokens; a streamed one ends with a usage event only when the request sets
/// `stream_options.include_usage`, or the server forces it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_usage_only_when_asked_or_forced_and_cached_tokens_only_when_enabled() {
    let plain = sim("plain").await;
    let forced = SimServer::start(
        SimConfig {
            name: "forced".into(),
            time_scale: TIME_SCALE,
            force_include_usage: true,
            ..SimConfig::default()
        },
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .expect("start simulator");
    let chat = |stream: &str| {
        format!(r#"{{"messages":[{{"role":"user","content":"hi"}}],"max_tokens":3{stream}}}"#)
    };
    let unasked = chat(r#","stream":true"#);
    let asked = chat(r#","stream":true,"stream_options":{"include_usage":true}"#);
    let whole = chat("");
    let has_usage = |body: &str| body.contains(r#""usage":{"#);
    // `forced` runs without --enable-prompt-tokens-details: no cached_tokens.
    for (server, body, expected, details) in [
        (&plain, &whole, true, true),
        (&plain, &unasked, false, false),
        (&plain, &asked, true, true),
        (&forced, &unasked, true, false),
        (&forced, &whole, true, false),
    ] {
        let (_, answer) = post(server.addr(), "/v1/chat/completions", "", body).await;
        assert_eq!(has_usage(&answer), expected, "{body}: {answer}");
        let cached = answer.contains("prompt_tokens_details");
        assert_eq!(cached, details, "{body}: {answer}");
    }
}
