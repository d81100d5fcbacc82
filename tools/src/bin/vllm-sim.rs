//! `vllm-sim`: one simulated vLLM instance (see `prefix_router_tools::sim`).
//! Prints `listening on HOST:PORT` as its first stdout line so launchers can
//! start it on port 0 and read the port.

use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};

use clap::Parser;
use prefix_router_tools::sim::{SimConfig, SimServer};

/// A simulated vLLM instance: OpenAI-compatible and native invoke APIs,
/// vLLM's prefix caching, continuous batching and a calibrated cost model.
#[derive(Parser, Debug)]
#[command(name = "vllm-sim", version)]
struct Cli {
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to bind; 0 picks a free one.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Instance name, sent in every response's `x-served-by` header.
    #[arg(long, default_value = "vllm-sim")]
    name: String,
    /// Model name served.
    #[arg(long, default_value_t = SimConfig::default().model)]
    model: String,
    /// KV cache capacity in blocks.
    #[arg(long, default_value_t = SimConfig::default().kv_blocks)]
    kv_blocks: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = SimConfig::default().block_size)]
    block_size: usize,
    /// Most requests running (batched) at once.
    #[arg(long, default_value_t = SimConfig::default().max_num_seqs)]
    max_num_seqs: usize,
    /// Simulated seconds per real second (10 runs an hour in 6 minutes).
    #[arg(long, default_value_t = SimConfig::default().time_scale)]
    time_scale: f64,
    /// Prefill cost per uncached prompt token, µs.
    #[arg(long, default_value_t = SimConfig::default().prefill_us_per_token)]
    prefill_us_per_token: f64,
    /// Prefill attention cost per uncached token per context position, ns.
    #[arg(long, default_value_t = SimConfig::default().prefill_attention_ns)]
    prefill_attention_ns: f64,
    /// Decode time per output token with an empty batch, ms.
    #[arg(long, default_value_t = SimConfig::default().decode_ms_per_token)]
    decode_ms_per_token: f64,
    /// Decode time added per running sequence, ms.
    #[arg(long, default_value_t = SimConfig::default().decode_ms_per_seq)]
    decode_ms_per_seq: f64,
    /// Shortest real time between two streamed events of one response, ms.
    #[arg(long, default_value_t = SimConfig::default().min_chunk_interval_ms)]
    min_chunk_interval_ms: f64,
    /// Output tokens when a request does not set max_tokens.
    #[arg(long, default_value_t = SimConfig::default().default_max_tokens)]
    default_max_tokens: usize,
    /// LoRA adapter slots (as vLLM's --max-loras); 0 serves the base model only.
    #[arg(long, default_value_t = 0)]
    max_loras: usize,
    /// Adapters served from the start: NAME=PATH, or NAME alone (the path is then the name).
    #[arg(long, num_args = 1..)]
    lora_modules: Vec<String>,
    /// Simulated ms to make a non-resident adapter resident.
    #[arg(long, default_value_t = SimConfig::default().lora_load_ms)]
    lora_load_ms: f64,
    /// End every streamed response with a usage event, asked for or not
    /// (vLLM's flag of the same name).
    #[arg(long)]
    enable_force_include_usage: bool,
    /// `usage.prompt_tokens_details.cached_tokens` in every response (vLLM's
    /// flag of the same name; without it the field is left out).
    #[arg(long)]
    enable_prompt_tokens_details: bool,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let cfg = SimConfig {
        name: cli.name,
        model: cli.model,
        kv_blocks: cli.kv_blocks,
        block_size: cli.block_size,
        max_num_seqs: cli.max_num_seqs,
        time_scale: cli.time_scale,
        prefill_us_per_token: cli.prefill_us_per_token,
        prefill_attention_ns: cli.prefill_attention_ns,
        decode_ms_per_token: cli.decode_ms_per_token,
        decode_ms_per_seq: cli.decode_ms_per_seq,
        min_chunk_interval_ms: cli.min_chunk_interval_ms,
        default_max_tokens: cli.default_max_tokens,
        max_loras: cli.max_loras,
        lora_modules: cli
            .lora_modules
            .iter()
            .map(|m| match m.split_once('=') {
                Some((name, path)) => (name.to_string(), path.to_string()),
                None => (m.clone(), m.clone()),
            })
            .collect(),
        lora_load_ms: cli.lora_load_ms,
        force_include_usage: cli.enable_force_include_usage,
        prompt_tokens_details: cli.enable_prompt_tokens_details,
    };
    let server = SimServer::start(cfg, SocketAddr::new(cli.host, cli.port)).await?;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "listening on {}", server.addr())?;
    stdout.flush()?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}
