//! `cargo xtask bench overhead|routing [--quick]`: builds the filter and the
//! tools in release mode (a debug-built load client would measure itself) and
//! runs the `prefix-router-bench` binary, which prints markdown tables and
//! writes JSON under `target/bench/`.

use clap::Subcommand;

use crate::prereqs::{self, cargo, run};
use crate::run::build_wasm;

#[derive(Subcommand)]
pub enum Bench {
    /// The filter's cost per request: the same Envoy with and without it.
    Overhead {
        /// A shorter run (under a minute) with the same fields.
        #[arg(long)]
        quick: bool,
    },
}

pub fn run_bench(bench: &Bench) -> anyhow::Result<()> {
    let found = prereqs::ensure_all()?;
    let wasm = build_wasm()?;
    let args: Vec<&str> = match bench {
        Bench::Overhead { quick } => {
            let mut args = vec!["overhead"];
            if *quick {
                args.push("--quick");
            }
            args
        }
    };
    run(cargo()
        .args([
            "run",
            "--quiet",
            "--release",
            "-p",
            "prefix-router-tools",
            "--bin",
            "prefix-router-bench",
            "--",
        ])
        .args(args)
        .env("PREFIX_ROUTER_WASM", &wasm)
        .env("ENVOY_BIN", &found.envoy))
}
