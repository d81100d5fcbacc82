//! Benchmarks of the filter through a real Envoy: what it costs per request
//! (`overhead`), and what it buys in KV-cache hits and time to first token
//! against simulated vLLM instances (`routing`, `demo`). The entry points are
//! the `prefix-router-bench` binary (`bin.rs`, started by `cargo xtask bench`
//! built optimised, because a debug-built client would measure itself).

pub mod bodies;
pub mod chart;
pub mod cli;
pub mod closed_loop;
pub mod cpu;
pub mod demo;
pub mod engine_load;
pub mod engine_overhead;
pub mod fleet;
pub mod instant_upstream;
pub mod overhead;
pub mod peers;
pub mod routing;
pub mod stats;
pub mod vllm_metrics_body;

use std::path::{Path, PathBuf};

use anyhow::Context as _;

/// Where benchmark results are written: `<target>/bench`.
pub fn output_dir() -> PathBuf {
    crate::envoy::target_dir().join("bench")
}

/// The 1-, 5- and 15-minute load averages, to show how busy the machine was.
pub fn load_average() -> Option<[f64; 3]> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut fields = text.split_whitespace().map(|f| f.parse::<f64>().ok());
    Some([fields.next()??, fields.next()??, fields.next()??])
}

/// Writes a benchmark report as pretty JSON, creating its directory.
pub fn write_json(report: &impl serde::Serialize, path: &Path) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, serde_json::to_vec_pretty(report)?)
        .with_context(|| format!("writing {}", path.display()))
}
