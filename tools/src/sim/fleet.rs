//! Starting `vllm-sim` processes and reading their counters, for the demo,
//! the benchmark and tests that need instances as separate processes (one
//! runtime each, like real servers). Children are killed when dropped.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use http_body_util::{BodyExt, Full};
use hyper::Uri;

use super::metrics::parse_sample;
use super::SimConfig;

/// The command-line arguments that make `vllm-sim` run `cfg` on an ephemeral port.
pub fn sim_args(cfg: &SimConfig) -> Vec<String> {
    let mut args: Vec<String> = [
        ("--port", "0".to_string()),
        ("--name", cfg.name.clone()),
        ("--model", cfg.model.clone()),
        ("--kv-blocks", cfg.kv_blocks.to_string()),
        ("--block-size", cfg.block_size.to_string()),
        ("--max-num-seqs", cfg.max_num_seqs.to_string()),
        ("--time-scale", cfg.time_scale.to_string()),
        (
            "--prefill-us-per-token",
            cfg.prefill_us_per_token.to_string(),
        ),
        (
            "--prefill-attention-ns",
            cfg.prefill_attention_ns.to_string(),
        ),
        ("--decode-ms-per-token", cfg.decode_ms_per_token.to_string()),
        ("--decode-ms-per-seq", cfg.decode_ms_per_seq.to_string()),
        (
            "--min-chunk-interval-ms",
            cfg.min_chunk_interval_ms.to_string(),
        ),
        ("--default-max-tokens", cfg.default_max_tokens.to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect();
    for (flag, on) in [
        ("--enable-force-include-usage", cfg.force_include_usage),
        ("--enable-prompt-tokens-details", cfg.prompt_tokens_details),
    ] {
        if on {
            args.push(flag.to_string());
        }
    }
    if cfg.max_loras > 0 {
        args.extend([
            "--max-loras".to_string(),
            cfg.max_loras.to_string(),
            "--lora-load-ms".to_string(),
            cfg.lora_load_ms.to_string(),
        ]);
        if !cfg.lora_modules.is_empty() {
            args.push("--lora-modules".to_string());
            args.extend(
                cfg.lora_modules
                    .iter()
                    .map(|(name, path)| format!("{name}={path}")),
            );
        }
    }
    args
}

/// A `vllm-sim` child process.
pub struct SimProcess {
    /// Instance name (`x-served-by`).
    pub name: String,
    /// Where it listens.
    pub addr: SocketAddr,
    child: Child,
}

impl SimProcess {
    /// Starts `exe` (the `vllm-sim` binary) with `cfg` on an ephemeral
    /// loopback port and waits, at most `ready_timeout`, for it to announce
    /// its address.
    pub fn spawn(exe: &Path, cfg: &SimConfig, ready_timeout: Duration) -> anyhow::Result<Self> {
        Self::spawn_on(exe, cfg, 0, ready_timeout)
    }

    /// Kills the instance (its connections drop, its cache is gone) and
    /// starts it again on the same address, as an engine restarts.
    pub fn restart(
        &mut self,
        exe: &Path,
        cfg: &SimConfig,
        ready_timeout: Duration,
    ) -> anyhow::Result<()> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let restarted = Self::spawn_on(exe, cfg, self.addr.port(), ready_timeout)?;
        // The dead child is reaped: dropping the old value kills nothing alive.
        *self = restarted;
        Ok(())
    }

    fn spawn_on(
        exe: &Path,
        cfg: &SimConfig,
        port: u16,
        ready_timeout: Duration,
    ) -> anyhow::Result<Self> {
        let mut args = sim_args(cfg);
        if let Some(value) = args.iter().position(|a| a == "--port").map(|at| at + 1) {
            if let Some(slot) = args.get_mut(value) {
                *slot = port.to_string();
            }
        }
        let mut command = Command::new(exe);
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = crate::child::spawn_tied_to_process(command)
            .with_context(|| format!("starting {}", exe.display()))?;
        let stdout = child.stdout.take().context("no stdout pipe")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            let _ = tx.send(reader.read_line(&mut line).map(|_| line));
            // Keep draining so a chatty child never blocks on a full pipe.
            let mut sink = String::new();
            while matches!(reader.read_line(&mut sink), Ok(n) if n > 0) {
                sink.clear();
            }
        });
        let mut process = SimProcess {
            name: cfg.name.clone(),
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            child,
        };
        let line = match rx.recv_timeout(ready_timeout) {
            Ok(Ok(line)) => line,
            Ok(Err(e)) => bail!("reading {}'s stdout: {e}", cfg.name),
            Err(_) => bail!(
                "{} did not print its address within {:?}",
                cfg.name,
                ready_timeout
            ),
        };
        process.addr = line
            .trim()
            .strip_prefix("listening on ")
            .and_then(|a| a.parse().ok())
            .with_context(|| {
                format!(
                    "{}'s first line was {line:?}, not `listening on ADDR`",
                    cfg.name
                )
            })?;
        Ok(process)
    }

    /// `http://ADDR`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for SimProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An instance's prefix-cache counters (tokens), from `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheCounters {
    /// `vllm:prefix_cache_queries_total`
    pub queries: f64,
    /// `vllm:prefix_cache_hits_total`
    pub hits: f64,
}

impl CacheCounters {
    /// Counters accumulated since `earlier`.
    pub fn since(&self, earlier: &CacheCounters) -> CacheCounters {
        CacheCounters {
            queries: self.queries - earlier.queries,
            hits: self.hits - earlier.hits,
        }
    }

    /// Sum over instances.
    pub fn total<'a>(all: impl IntoIterator<Item = &'a CacheCounters>) -> CacheCounters {
        all.into_iter()
            .fold(CacheCounters::default(), |a, c| CacheCounters {
                queries: a.queries + c.queries,
                hits: a.hits + c.hits,
            })
    }

    /// Token-weighted hit rate (0 when nothing was queried).
    pub fn hit_rate(&self) -> f64 {
        if self.queries > 0.0 {
            self.hits / self.queries
        } else {
            0.0
        }
    }
}

async fn call(
    method: hyper::Method,
    addr: SocketAddr,
    path: &str,
) -> anyhow::Result<(u16, String)> {
    let client = crate::loadgen::client::http_client();
    let uri: Uri = format!("http://{addr}{path}").parse()?;
    let req = hyper::Request::builder()
        .method(method)
        .uri(uri)
        .body(Full::default())?;
    let resp = tokio::time::timeout(Duration::from_secs(5), client.request(req))
        .await
        .with_context(|| format!("timed out on {addr}{path}"))??;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Empties the prefix cache of the idle instance at `addr` (`POST /reset_prefix_cache`).
pub async fn reset_prefix_cache(addr: SocketAddr) -> anyhow::Result<()> {
    let (status, body) = call(hyper::Method::POST, addr, "/reset_prefix_cache").await?;
    if status != 200 {
        bail!("{addr} did not reset its prefix cache: {status} {body}");
    }
    Ok(())
}

/// Reads the prefix-cache counters of the instance at `addr`.
pub async fn scrape_cache_counters(addr: SocketAddr) -> anyhow::Result<CacheCounters> {
    let (_, text) = call(hyper::Method::GET, addr, "/metrics").await?;
    let read = |name| {
        parse_sample(&text, name).with_context(|| format!("{name} missing from {addr}/metrics"))
    };
    Ok(CacheCounters {
        queries: read("vllm:prefix_cache_queries_total")?,
        hits: read("vllm:prefix_cache_hits_total")?,
    })
}

/// Adapters the instance at `addr` has made resident since it started
/// (`vllm_sim:lora_loads_total`; 0 without LoRA slots).
pub async fn scrape_lora_loads(addr: SocketAddr) -> anyhow::Result<f64> {
    let (_, text) = call(hyper::Method::GET, addr, "/metrics").await?;
    Ok(parse_sample(&text, "vllm_sim:lora_loads_total").unwrap_or(0.0))
}
