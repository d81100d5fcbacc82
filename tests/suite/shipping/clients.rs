//! Real clients through a real Envoy with the filter: the official OpenAI
//! Python SDK (plain and streaming chat, completions, `prompt_cache_key`)
//! against in-process OpenAI-compatible instances and against vllm-sim, and
//! the client examples in `examples/clients/` run as documented. The SDK
//! comes from PYTHONPATH or the system (`cargo xtask test` installs it).
//!
//! Envoy comes from `ENVOY_BIN` or PATH; the filter from `PREFIX_ROUTER_WASM`
//! or the release build (`cargo xtask test` provides both).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::io::Write as _;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use prefix_router_tools::envoy::Envoy;
use serde_json::json;

use support::*;

/// Minimal OpenAI-compatible instances: chat (plain and SSE) and completions,
/// `x-served-by`, and the routing key they received echoed back as
/// `x-received-route-key`, so the client can see it.
///
/// Kept next to `openai_sdk_through_envoy_to_vllm_sim` because it echoes the
/// key, which vllm-sim does not.
struct OpenAiFleet {
    runtime: Option<tokio::runtime::Runtime>,
    addrs: Vec<SocketAddr>,
    names: Vec<String>,
    received: Arc<Mutex<Vec<(String, String)>>>,
}

impl OpenAiFleet {
    fn start(count: usize) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let received = Arc::new(Mutex::new(Vec::new()));
        let mut addrs = Vec::new();
        let mut names = Vec::new();
        for i in 1..=count {
            let name = format!("instance-{i}");
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.set_nonblocking(true).unwrap();
            addrs.push(listener.local_addr().unwrap());
            runtime.spawn(serve_openai(listener, name.clone(), Arc::clone(&received)));
            names.push(name);
        }
        OpenAiFleet {
            runtime: Some(runtime),
            addrs,
            names,
            received,
        }
    }

    /// (instance, path) of every request received.
    fn received(&self) -> Vec<(String, String)> {
        self.received.lock().unwrap().clone()
    }
}

impl Drop for OpenAiFleet {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn serve_openai(
    listener: std::net::TcpListener,
    name: String,
    received: Arc<Mutex<Vec<(String, String)>>>,
) {
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let name = name.clone();
        let received = Arc::clone(&received);
        tokio::spawn(async move {
            let service =
                service_fn(move |req| answer_openai(req, name.clone(), Arc::clone(&received)));
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn answer_openai(
    req: Request<Incoming>,
    name: String,
    received: Arc<Mutex<Vec<(String, String)>>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path().to_string();
    let key = req
        .headers()
        .get(KEY_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    received.lock().unwrap().push((name.clone(), path.clone()));
    let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or(json!({}));
    let model = request["model"].as_str().unwrap_or("unknown").to_string();
    let text = format!("served by {name}");
    let (content_type, payload) = if path.ends_with("/chat/completions")
        && request["stream"] == true
    {
        let mut sse = String::new();
        for (i, piece) in ["served ", "by ", name.as_str()].iter().enumerate() {
            let delta = if i == 0 {
                json!({"role": "assistant", "content": piece})
            } else {
                json!({"content": piece})
            };
            let chunk = json!({"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": null}]});
            sse.push_str(&format!("data: {chunk}\n\n"));
        }
        let last = json!({"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
        sse.push_str(&format!("data: {last}\n\ndata: [DONE]\n\n"));
        ("text/event-stream", sse)
    } else if path.ends_with("/chat/completions") {
        ("application/json", json!({"id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}).to_string())
    } else if path.ends_with("/completions") {
        (
            "application/json",
            json!({"id": "cmpl-test", "object": "text_completion", "created": 0, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": null}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}})
            .to_string(),
        )
    } else {
        ("application/json", json!({"served_by": name}).to_string())
    };
    let response = Response::builder()
        .header("content-type", content_type)
        .header("x-served-by", &name)
        .header("x-received-route-key", key)
        .body(Full::new(Bytes::from(payload)))
        .unwrap();
    Ok(response)
}

/// Envoy (envoy/envoy.yaml, the built filter) in front of three OpenAI instances.
fn openai_setup() -> (OpenAiFleet, Envoy) {
    let fleet = OpenAiFleet::start(3);
    let envoy = Envoy::builder()
        .upstreams(fleet.addrs.clone())
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    (fleet, envoy)
}

const SDK_INSTALL_HINT: &str =
    "install the OpenAI Python SDK: `python3 -m pip install openai` (cargo xtask test does this)";

/// Runs `python3 <script>` with `stdin`, bounded in time; returns stdout.
fn run_python(script: &str, stdin: &str, env: &[(&str, String)]) -> String {
    let probe = Command::new("python3")
        .args(["-c", "import openai"])
        .output();
    match probe {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!(
            "{SDK_INSTALL_HINT}\n{}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => panic!("python3 not found ({e}); {SDK_INSTALL_HINT}"),
    }
    let mut child = Command::new("python3")
        .arg(root().join(script))
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let stdout = drain(child.stdout.take().unwrap());
    let stderr = drain(child.stderr.take().unwrap());
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{script} did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = stdout.recv().unwrap_or_default();
    assert!(
        status.success(),
        "{script} failed ({status}):\n{}\n{stdout}",
        stderr.recv().unwrap_or_default()
    );
    stdout
}

/// Reads a pipe to its end on a thread (so a full pipe never blocks the child).
fn drain(mut pipe: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        let _ = tx.send(text);
    });
    rx
}

/// One request of a plan for tests/python/openai_client.py.
fn chat(
    id: &str,
    api: &str,
    messages: &serde_json::Value,
    cache_key: Option<&str>,
) -> serde_json::Value {
    json!({"id": id, "api": api, "messages": messages, "prompt_cache_key": cache_key, "max_tokens": 8})
}

/// Runs a plan through the SDK; returns the results by id.
fn run_sdk(envoy: &Envoy, requests: Vec<serde_json::Value>) -> BTreeMap<String, SdkResult> {
    let plan = json!({"base_url": format!("{}/v1", envoy.base_url()), "model": "Qwen/Qwen2.5-0.5B-Instruct", "requests": requests});
    let stdout = run_python("tests/python/openai_client.py", &plan.to_string(), &[]);
    let output: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    output["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let result = SdkResult {
                served_by: r["served_by"].as_str().expect("x-served-by").to_string(),
                route_key: r["route_key"].as_str().unwrap_or("").to_string(),
                text: r["text"].as_str().unwrap_or("").to_string(),
                chunks: r["chunks"].as_u64().unwrap_or(0),
            };
            assert!(
                result.route_key.len() == 16
                    && result
                        .route_key
                        .bytes()
                        .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
                "request {} reached the instance without a 16-hex-digit key: {:?}",
                r["id"],
                result.route_key
            );
            assert_eq!(
                result.text,
                format!("served by {}", result.served_by),
                "the SDK parsed another body"
            );
            (r["id"].as_str().unwrap().to_string(), result)
        })
        .collect()
}

#[derive(Debug)]
struct SdkResult {
    served_by: String,
    route_key: String,
    text: String,
    chunks: u64,
}

/// A conversation whose shared beginning (system prompt) is longer than the
/// default `prefix_length` (4,096): only then do later turns share the key.
fn long_conversation(turns: usize) -> serde_json::Value {
    let system = format!(
        "You are the support assistant of ACME. Policy manual follows. {}",
        "Section: be accurate, be brief, cite the manual. ".repeat(100)
    );
    assert!(system.len() > 4096);
    let mut messages = vec![json!({"role": "system", "content": system})];
    for turn in 0..turns {
        messages.push(json!({"role": "user", "content": format!("Question {turn}: how do I reset my password?")}));
        if turn + 1 < turns {
            messages.push(json!({"role": "assistant", "content": format!("Answer {turn}: use the reset link.")}));
        }
    }
    serde_json::Value::Array(messages)
}

#[test]
fn openai_sdk_conversations_stick_to_one_instance_through_envoy() {
    let (fleet, envoy) = openai_setup();
    let short = json!([{"role": "user", "content": "Say hello."}]);
    let mut plan = Vec::new();
    for i in 0..3 {
        plan.push(chat(
            &format!("repeat-{i}"),
            "chat",
            &short,
            Some("tenant-a"),
        ));
    }
    for i in 0..2 {
        plan.push(chat(
            &format!("stream-{i}"),
            "chat_stream",
            &short,
            Some("tenant-a"),
        ));
    }
    for turns in 1..=4 {
        plan.push(chat(
            &format!("turn-{turns}"),
            "chat",
            &long_conversation(turns),
            Some("tenant-a"),
        ));
    }
    for i in 0..3 {
        plan.push(json!({"id": format!("completion-{i}"), "api": "completions", "prompt": "Once upon a time", "max_tokens": 8}));
    }
    for i in 0..12 {
        plan.push(chat(
            &format!("spread-{i}"),
            "chat",
            &json!([{"role": "user", "content": format!("Topic number {i}: tell me something.")}]),
            None,
        ));
    }
    let results = run_sdk(&envoy, plan);

    let group = |prefix: &str| -> Vec<&SdkResult> {
        results
            .iter()
            .filter(|(id, _)| id.starts_with(prefix))
            .map(|(_, r)| r)
            .collect()
    };
    for prefix in ["repeat-", "stream-", "turn-", "completion-"] {
        let members = group(prefix);
        assert!(members.len() >= 2, "{prefix}");
        let keys: BTreeSet<&str> = members.iter().map(|r| r.route_key.as_str()).collect();
        let instances: BTreeSet<&str> = members.iter().map(|r| r.served_by.as_str()).collect();
        assert_eq!(
            keys.len(),
            1,
            "{prefix}*: one conversation got several keys: {members:?}"
        );
        assert_eq!(
            instances.len(),
            1,
            "{prefix}*: one conversation went to several instances: {members:?}"
        );
    }
    assert!(
        group("stream-").iter().all(|r| r.chunks >= 3),
        "the SDK did not read an SSE stream"
    );
    let spread = group("spread-");
    let keys: BTreeSet<&str> = spread.iter().map(|r| r.route_key.as_str()).collect();
    let instances: BTreeSet<&str> = spread.iter().map(|r| r.served_by.as_str()).collect();
    assert_eq!(keys.len(), 12, "12 different prompts must get 12 keys");
    assert!(
        instances.len() >= 2,
        "12 different prompts all went to {instances:?}"
    );
    // What the SDK saw is what the instances recorded.
    let recorded = fleet.received();
    assert_eq!(recorded.len(), results.len());
    assert!(recorded.iter().any(|(_, path)| path == "/v1/completions"));
    assert!(recorded.iter().all(|(name, _)| fleet.names.contains(name)));
}

/// prompt_cache_key (through extra_body) separates tenants even when the
/// prompt is identical, and the `stream` flag is not part of the key. Both
/// need the OpenAI JSON extractor (canonical text + body tenant), not the
/// raw-byte placeholder: with the placeholder, a prefix longer than
/// `prefix_length` never reaches prompt_cache_key at the end of the body.
#[test]
fn openai_sdk_prompt_cache_key_separates_tenants_and_stream_flag_does_not() {
    let (_fleet, envoy) = openai_setup();
    let conversation = long_conversation(2);
    let mut plan = vec![
        chat("plain", "chat", &conversation, Some("tenant-0")),
        chat("streamed", "chat_stream", &conversation, Some("tenant-0")),
    ];
    for i in 0..12 {
        plan.push(chat(
            &format!("tenant-{i}"),
            "chat",
            &conversation,
            Some(&format!("tenant-{i}")),
        ));
    }
    let results = run_sdk(&envoy, plan);
    assert_eq!(
        results["plain"].route_key, results["streamed"].route_key,
        "streaming changed the key of the same conversation"
    );
    assert_eq!(results["plain"].route_key, results["tenant-0"].route_key);
    let tenants: Vec<&SdkResult> = (0..12).map(|i| &results[&format!("tenant-{i}")]).collect();
    let keys: BTreeSet<&str> = tenants.iter().map(|r| r.route_key.as_str()).collect();
    let instances: BTreeSet<&str> = tenants.iter().map(|r| r.served_by.as_str()).collect();
    assert_eq!(
        keys.len(),
        12,
        "12 prompt_cache_keys gave {} keys",
        keys.len()
    );
    assert!(instances.len() >= 2, "12 tenants all went to {instances:?}");
}

/// Three vllm-sim instances (`vllm-sim`'s server, in process), named
/// `vllm-1`..`vllm-3`, answering ten times faster than the modelled GPU.
struct SimFleet {
    runtime: Option<tokio::runtime::Runtime>,
    servers: Vec<prefix_router_tools::sim::SimServer>,
}

impl SimFleet {
    fn start() -> Self {
        use prefix_router_tools::sim::{SimConfig, SimServer};
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let servers = (1..=3)
            .map(|i| {
                let cfg = SimConfig {
                    name: format!("vllm-{i}"),
                    model: "Qwen/Qwen2.5-0.5B-Instruct".to_string(),
                    time_scale: 10.0,
                    ..SimConfig::default()
                };
                runtime
                    .block_on(SimServer::start(cfg, "127.0.0.1:0".parse().unwrap()))
                    .unwrap()
            })
            .collect();
        SimFleet {
            runtime: Some(runtime),
            servers,
        }
    }

    fn addrs(&self) -> Vec<SocketAddr> {
        self.servers.iter().map(|s| s.addr()).collect()
    }

    /// Requests the instances answered, all together.
    fn served(&self) -> u64 {
        self.servers
            .iter()
            .map(|s| s.engine().snapshot().request_success)
            .sum()
    }
}

impl Drop for SimFleet {
    fn drop(&mut self) {
        self.servers.clear();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// The instance a decision header names (`...; instance=ip:port; ...`).
fn decided_instance(decision: &str) -> Option<&str> {
    decision
        .split(';')
        .find_map(|part| part.trim().strip_prefix("instance="))
}

/// The client examples, run as documented, against vllm-sim through Envoy
/// with the docker-compose configuration: each prints the instance its
/// `decision_header` names, the same for a conversation's two turns and for
/// one tenant's repeated invoke; `/invocations` is answered as vLLM answers
/// the OpenAI completions body there; the invalid tenant gets OpenAI's error
/// shape and reaches no instance.
#[test]
fn client_examples_run_against_vllm_sim_through_the_compose_envoy() {
    let fleet = SimFleet::start();
    let instances: BTreeSet<String> = fleet.addrs().iter().map(|a| a.to_string()).collect();
    let compose = compose::file();
    let envoy = Envoy::builder()
        .config_file(root().join(compose::envoy_config_source(&compose)))
        .upstreams(fleet.addrs())
        .start()
        .unwrap_or_else(|e| panic!("{e}"));

    let out = run_python(
        "examples/clients/openai_chat.py",
        "",
        &[("OPENAI_BASE_URL", format!("{}/v1", envoy.base_url()))],
    );
    let served: Vec<String> = out
        .lines()
        .filter_map(|l| l.strip_prefix("served by "))
        .map(|rest| {
            let first = rest.split_whitespace().next().unwrap_or("");
            first.trim_end_matches(':').to_string()
        })
        .collect();
    assert_eq!(served.len(), 2, "{out}");
    assert_eq!(
        served[0], served[1],
        "the example's two turns went to two instances:\n{out}"
    );
    assert!(instances.contains(&served[0]), "{out}");

    let output = Command::new("bash")
        .arg(root().join("examples/clients/invoke.sh"))
        .env("PREFIX_ROUTER_URL", envoy.base_url())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "invoke.sh failed: {}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    let mut routed = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(summary) = line.strip_prefix("tenant ") else {
            continue;
        };
        let (_, decision) = summary
            .split_once(": HTTP 200, routed: ")
            .unwrap_or_else(|| panic!("not answered 200 with a decision:\n{stdout}"));
        routed.push(decided_instance(decision).unwrap_or("").to_string());
        let answer: serde_json::Value = serde_json::from_str(lines[i - 1])
            .unwrap_or_else(|e| panic!("{e}: the answer before {line:?}:\n{stdout}"));
        assert_eq!(
            answer["object"], "text_completion",
            "/invocations did not serve the body as a completion:\n{stdout}"
        );
    }
    assert_eq!(routed.len(), 3, "{stdout}");
    assert!(instances.contains(&routed[0]), "{stdout}");
    assert_eq!(
        routed[0], routed[1],
        "same tenant, same body, another instance:\n{stdout}"
    );
    assert_eq!(lines.last(), Some(&"HTTP 400"), "{stdout}");
    let error: serde_json::Value = serde_json::from_str(lines[lines.len() - 2]).unwrap();
    assert_eq!(error["error"]["code"], "invalid_tenant_header", "{stdout}");
    assert_eq!(error["error"]["param"], TENANT_HEADER, "{stdout}");
    assert_eq!(
        fleet.served(),
        5,
        "two chat turns and three invokes; the rejected request must not reach an instance"
    );
}

/// The same SDK run against the project's simulated vLLM (`vllm-sim`'s
/// server, in process): the API shapes a real vLLM answers with, streaming
/// included. vllm-sim does not echo the key, so this checks instances only.
#[test]
fn openai_sdk_through_envoy_to_vllm_sim() {
    let fleet = SimFleet::start();
    let envoy = Envoy::builder()
        .upstreams(fleet.addrs())
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    let conversation = long_conversation(2);
    let mut plan = Vec::new();
    for i in 0..2 {
        plan.push(chat(
            &format!("plain-{i}"),
            "chat",
            &conversation,
            Some("t"),
        ));
        plan.push(chat(
            &format!("stream-{i}"),
            "chat_stream",
            &conversation,
            Some("t"),
        ));
        plan.push(
            json!({"id": format!("completion-{i}"), "api": "completions",
            "prompt": "Once upon a time", "max_tokens": 8}),
        );
    }
    for i in 0..12 {
        plan.push(chat(
            &format!("tenant-{i}"),
            "chat",
            &conversation,
            Some(&format!("tenant-{i}")),
        ));
    }
    let stdout = run_python(
        "tests/python/openai_client.py",
        &json!({"base_url": format!("{}/v1", envoy.base_url()),
            "model": "Qwen/Qwen2.5-0.5B-Instruct", "requests": plan})
        .to_string(),
        &[],
    );
    let output: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let served: BTreeMap<String, String> = output["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            assert!(
                r["chunks"].as_u64().unwrap_or(0) >= 1 && r["text"].is_string(),
                "{r}"
            );
            (
                r["id"].as_str().unwrap().to_string(),
                r["served_by"]
                    .as_str()
                    .expect("vllm-sim sends x-served-by")
                    .to_string(),
            )
        })
        .collect();
    let conversation_instances: BTreeSet<&String> = served
        .iter()
        .filter(|(id, _)| id.starts_with("plain-") || id.starts_with("stream-"))
        .map(|(_, s)| s)
        .collect();
    assert_eq!(
        conversation_instances.len(),
        1,
        "one conversation, several instances: {served:?}"
    );
    assert_eq!(served["completion-0"], served["completion-1"]);
    let tenants: BTreeSet<&String> = (0..12).map(|i| &served[&format!("tenant-{i}")]).collect();
    assert!(tenants.len() >= 2, "12 tenants all went to {tenants:?}");
}
