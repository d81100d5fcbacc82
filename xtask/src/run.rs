//! `cargo xtask test`: builds the filter, then runs the native unit and
//! integration tests, the core's unit tests compiled to wasm32-wasip1, and
//! the suite against real vLLM (`tests/suite/real_vllm.rs`; alone:
//! `--real-vllm`).

use std::path::PathBuf;

use anyhow::{bail, Context as _};
use prefix_router_tools::envoy;

use crate::prereqs::{self, cargo, run};
use crate::vllm;

/// Builds the release .wasm and returns its absolute path.
pub fn build_wasm() -> anyhow::Result<PathBuf> {
    build_wasm_package("prefix-router", "prefix_router.wasm")
}

/// Builds the overhead benchmark's floor filter (`tools/floor-filter`).
pub fn build_floor_wasm() -> anyhow::Result<PathBuf> {
    build_wasm_package(
        "prefix-router-floor-filter",
        "prefix_router_floor_filter.wasm",
    )
}

/// Builds the clock test's `LD_PRELOAD` library (`tests/wall-clock-shim`)
/// for this machine and returns its absolute path.
pub fn build_wall_clock_shim() -> anyhow::Result<PathBuf> {
    run(cargo().args(["build", "-p", "prefix-router-wall-clock-shim"]))?;
    built(
        envoy::target_dir()
            .join("debug")
            .join("libprefix_router_wall_clock_shim.so"),
    )
}

/// The absolute path of `path`, which a build just produced.
fn built(path: PathBuf) -> anyhow::Result<PathBuf> {
    std::fs::canonicalize(&path)
        .with_context(|| format!("the build did not produce {}", path.display()))
}

/// Builds one cdylib package for wasm32-wasip1 in release mode and returns
/// the absolute path of `file`, what it produced.
pub fn build_wasm_package(package: &str, file: &str) -> anyhow::Result<PathBuf> {
    run(cargo().args([
        "build",
        "--release",
        "--target",
        "wasm32-wasip1",
        "-p",
        package,
    ]))?;
    built(
        envoy::target_dir()
            .join("wasm32-wasip1")
            .join("release")
            .join(file),
    )
}

pub fn test(cargo_test_args: &[String]) -> anyhow::Result<()> {
    let found = prereqs::ensure_all()?;
    prereqs::ensure_node()?;
    let python_path = prereqs::ensure_python_deps()?;
    let promtool = prereqs::ensure_promtool()?;
    let crd_validators = prereqs::ensure_crd_validators()?;
    let umoci = prereqs::ensure_umoci()?;
    let wasm = build_wasm()?;
    let floor_wasm = build_floor_wasm()?;
    let wall_clock_shim = build_wall_clock_shim()?;
    // Both suites run even if the first fails, so one run shows every failure.
    let mut native_tests = cargo();
    native_tests
        .args(["test", "--workspace", "--no-fail-fast"])
        .args(cargo_test_args)
        .env("PREFIX_ROUTER_WASM", &wasm)
        .env("PREFIX_ROUTER_FLOOR_WASM", &floor_wasm)
        .env("ENVOY_BIN", &found.envoy)
        .env("PROMTOOL", &promtool)
        .env("CRD_VALIDATORS", &crd_validators)
        .env("UMOCI", &umoci)
        .env("WALL_CLOCK_SHIM", &wall_clock_shim);
    if let Some(dir) = &python_path {
        native_tests.env("PYTHONPATH", dir);
    }
    let native = run(&mut native_tests);
    let wasm32 = run(cargo().args([
        "test",
        "--target",
        "wasm32-wasip1",
        "-p",
        "prefix-router",
        "--lib",
    ]));
    // Arguments pick tests of the native run: the real-vLLM suite runs with
    // every test only.
    let real_vllm = if cargo_test_args.is_empty() {
        test_real_vllm(&[])
    } else {
        Ok(())
    };
    let failed: Vec<String> = [
        ("native and integration tests", native),
        ("wasm32-wasip1 unit tests", wasm32),
        ("the real-vLLM suite", real_vllm),
    ]
    .into_iter()
    .filter_map(|(what, outcome)| outcome.err().map(|e| format!("{what}: {e:#}")))
    .collect();
    if !failed.is_empty() {
        bail!("tests failed:\n  {}", failed.join("\n  "));
    }
    eprintln!("xtask: all tests passed");
    Ok(())
}

/// LoRA adapters the real-vLLM instances serve.
const REAL_VLLM_ADAPTERS: usize = 2;

/// `cargo xtask test --real-vllm`: installs vLLM (CPU) and two LoRA
/// adapters, starts three instances serving both, and runs
/// `tests/suite/real_vllm.rs` against them, the test that kills an
/// instance last. Each phase's time is printed.
pub fn test_real_vllm(cargo_test_args: &[String]) -> anyhow::Result<()> {
    let vllm_run = vllm::VllmRun::start(
        REAL_VLLM_ADAPTERS,
        3,
        vllm::Precision::of_this_cpu(),
        &envoy::target_dir().join("test-real-vllm"),
    )?;
    let (fleet, adapters) = (&vllm_run.fleet, &vllm_run.adapters);
    let healthy_s = vllm_run.started.elapsed().as_secs_f64();
    let join = |items: Vec<String>| items.join(",");
    let suite = |filter: &[&str]| {
        let mut command = cargo();
        command
            .args([
                "test",
                "-p",
                "prefix-router-integration-tests",
                "--test",
                "real_vllm",
            ])
            .args(cargo_test_args)
            .arg("--")
            .args(["--test-threads", "1"])
            .args(filter)
            .env("PREFIX_ROUTER_WASM", &vllm_run.wasm)
            .env(
                "PREFIX_ROUTER_VLLM",
                join(fleet.addrs().iter().map(|a| a.to_string()).collect()),
            )
            .env("PREFIX_ROUTER_VLLM_MODEL", vllm::SERVED_MODEL)
            .env(
                "PREFIX_ROUTER_VLLM_PIDS",
                join(
                    fleet
                        .instances
                        .iter()
                        .map(|i| i.pid().to_string())
                        .collect(),
                ),
            )
            .env(
                "PREFIX_ROUTER_VLLM_ADAPTERS",
                join(
                    adapters
                        .iter()
                        .map(|(name, path)| format!("{name}={}", path.display()))
                        .collect(),
                ),
            );
        run(&mut command)
    };
    // Every test but the one that kills an instance, then that one.
    let outcome = suite(&["--skip", "killed"]).and_then(|()| suite(&["killed"]));
    eprintln!(
        "xtask: real vLLM: instances healthy in {:.0} s, the suite took {:.0} s ({})",
        vllm_run.startup_s,
        vllm_run.started.elapsed().as_secs_f64() - healthy_s,
        fleet.placement()
    );
    outcome
}
