//! `loadgen`: runs one benchmark workload against an endpoint and prints a
//! summary (text on stderr, JSON on stdout or to `--json FILE`). A thin CLI
//! over `prefix_router_tools::loadgen::run_workload`.

use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use prefix_router_tools::loadgen::{
    run_workload, sharegpt, Api, Arrival, RunOptions, Workload, DATA_WORKLOAD_NAMES, WORKLOAD_NAMES,
};

/// Drives a workload (OpenAI chat or native invoke) and reports TTFT,
/// throughput, per-instance shares and the token-weighted cache hit rate.
#[derive(Parser, Debug)]
#[command(name = "loadgen", version)]
struct Cli {
    /// Base URL of the endpoint, e.g. http://127.0.0.1:10000.
    #[arg(long)]
    target: String,
    /// Workload: no-shared-prefix, long-shared-prefix, generated-shared-prefix,
    /// generated-shared-prefix-zipf, multi-turn.
    #[arg(long)]
    workload: String,
    /// API: chat or invoke.
    #[arg(long, default_value = "chat")]
    api: Api,
    /// Open-loop Poisson arrivals at this many requests per simulated second.
    #[arg(long, conflicts_with = "concurrency")]
    rate: Option<f64>,
    /// Closed loop with this many requests in flight (default 8 without --rate).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Stop issuing after this many requests.
    #[arg(long, default_value_t = 100)]
    requests: usize,
    /// Stop issuing after this many wall-clock seconds.
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    /// Fail a request after this many wall-clock seconds.
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// Multiply every token length of the workload (e.g. 0.25 for quick runs).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Override the number of prefix groups (shared-prefix workloads; rag: documents).
    #[arg(long)]
    groups: Option<usize>,
    /// Override the number of conversations (multi-turn: open at once; sharegpt: per run).
    #[arg(long)]
    conversations: Option<usize>,
    /// The instances' --time-scale; reported times and rates are simulated.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Seed of the traffic: arrivals, group choices, questions, conversations.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seed of the shared texts (group prefixes, system prompts); runs with the
    /// same shared seed share their prefixes.
    #[arg(long, default_value_t = prefix_router_tools::loadgen::workload::DEFAULT_SHARED_SEED)]
    shared_seed: u64,
    /// Model name sent on the chat API.
    #[arg(long, default_value_t = RunOptions::default().model)]
    model: String,
    /// Do not stream (TTFT is then the whole latency).
    #[arg(long)]
    no_stream: bool,
    /// Extra header NAME:VALUE (repeatable).
    #[arg(long = "header", value_name = "NAME:VALUE")]
    headers: Vec<String>,
    /// Expected instance names, comma separated (an idle one counts as share 0).
    #[arg(long, value_delimiter = ',')]
    instances: Vec<String>,
    /// Include every request's record in the JSON.
    #[arg(long)]
    records: bool,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

fn workload(cli: &Cli) -> anyhow::Result<Workload> {
    let mut w = Workload::by_name(&cli.workload).with_context(|| {
        format!(
            "unknown workload {:?}; use one of {}, {}",
            cli.workload,
            WORKLOAD_NAMES.join(", "),
            DATA_WORKLOAD_NAMES.join(", ")
        )
    })?;
    if !(cli.scale.is_finite() && cli.scale > 0.0) {
        anyhow::bail!("--scale must be positive");
    }
    w = w.scaled(cli.scale);
    match (&mut w, cli.groups, cli.conversations) {
        (Workload::LongSharedPrefix { groups, .. }, Some(g), _)
        | (Workload::GeneratedSharedPrefix { groups, .. }, Some(g), _) => *groups = g,
        (Workload::MultiTurn { conversations, .. }, _, Some(c))
        | (Workload::ShareGpt { conversations, .. }, _, Some(c)) => *conversations = c,
        (Workload::Rag { documents, .. }, Some(g), _) => *documents = g,
        (_, None, None) => {}
        _ => anyhow::bail!(
            "--groups / --conversations do not apply to {}",
            cli.workload
        ),
    }
    Ok(w)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let w = workload(&cli)?;
    let arrival = match (cli.rate, cli.concurrency) {
        (Some(rate), _) => Arrival::Poisson { rate },
        (None, c) => Arrival::Concurrency {
            clients: c.unwrap_or(8),
        },
    };
    let headers = cli
        .headers
        .iter()
        .map(|h| {
            h.split_once(':')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .with_context(|| format!("--header {h:?} is not NAME:VALUE"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let opts = RunOptions {
        api: cli.api,
        arrival,
        max_requests: cli.requests,
        max_duration: Duration::from_secs_f64(cli.duration.max(0.0)),
        request_timeout: Duration::from_secs_f64(cli.timeout.max(0.001)),
        seed: cli.seed,
        shared_seed: cli.shared_seed,
        time_scale: cli.time_scale,
        stream: !cli.no_stream,
        model: cli.model.clone(),
        headers,
        instances: cli.instances.clone(),
        keep_records: cli.records,
        // The real-data workloads read the installed ShareGPT package.
        corpus: if w.needs_corpus() {
            Some(sharegpt::load()?)
        } else {
            None
        },
        ..RunOptions::default()
    };
    let report = run_workload(&cli.target, &w, &opts).await?;
    eprint!("{}", report.to_text());
    let json = serde_json::to_string_pretty(&report)?;
    match &cli.json {
        Some(path) => std::fs::write(path, json + "\n")
            .with_context(|| format!("writing {}", path.display()))?,
        None => println!("{json}"),
    }
    Ok(())
}
