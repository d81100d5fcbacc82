//! The benchmarks' command-line options, defined once: `prefix-router-bench`
//! parses them, and `cargo xtask bench` parses the same and hands them on
//! (after building the release binaries) with [`OverheadArgs::to_args`] and
//! [`RoutingArgs::to_args`].

use clap::Args;

/// `overhead [--quick]`.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct OverheadArgs {
    /// A shorter run (under a minute) with the same fields.
    #[arg(long)]
    pub quick: bool,
}

impl OverheadArgs {
    /// The command line that parses back into these options.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec!["overhead".to_string()];
        if self.quick {
            args.push("--quick".to_string());
        }
        args
    }
}

/// `routing [--quick] [--workload NAME]...`.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct RoutingArgs {
    /// A shorter run (under 3 minutes) with the same fields.
    #[arg(long)]
    pub quick: bool,
    /// Only these workloads (names as in the report, e.g. long-shared-prefix); repeatable.
    #[arg(long)]
    pub workload: Vec<String>,
}

impl RoutingArgs {
    /// The command line that parses back into these options.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec!["routing".to_string()];
        if self.quick {
            args.push("--quick".to_string());
        }
        for name in &self.workload {
            args.extend(["--workload".to_string(), name.clone()]);
        }
        args
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Parser, Subcommand};

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Command,
    }

    #[derive(Subcommand)]
    enum Command {
        Overhead(OverheadArgs),
        Routing(RoutingArgs),
    }

    fn parse(args: Vec<String>) -> Command {
        Cli::try_parse_from(std::iter::once("bench".to_string()).chain(args))
            .expect("parses")
            .command
    }

    #[test]
    fn options_survive_the_hand_over() {
        for quick in [false, true] {
            let overhead = OverheadArgs { quick };
            assert!(matches!(parse(overhead.to_args()), Command::Overhead(o) if o == overhead));
            for workload in [vec![], vec!["a".to_string(), "b-c".to_string()]] {
                let routing = RoutingArgs { quick, workload };
                assert!(matches!(parse(routing.to_args()), Command::Routing(r) if r == routing));
            }
        }
    }
}
