//! What the shipping tests share: reading the repository's files and YAML,
//! navigating and rewriting Envoy configurations, `envoy --mode validate`,
//! the docker-compose file's structure (the compose and Kubernetes tests both
//! read it), and small HTTP and tool-running helpers.
//!
//! Each `tests/suite/shipping/*.rs` is its own test binary and uses only part
//! of this module, so unused items are expected in any one of them.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use prefix_router_tools::envoy::{self, Envoy};
use serde_yaml::{Mapping, Value};

pub const KEY_HEADER: &str = "x-prefix-route-key";
pub const TENANT_HEADER: &str = "x-amzn-sagemaker-prefix-aware-id";
/// The overload design's `host_header`, read by Envoy's override_host policy.
pub const HOST_HEADER: &str = "x-prefix-route-host";
pub const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
/// Where `cargo build --release --target wasm32-wasip1 -p prefix-router` writes the filter.
pub const WASM_BUILD_OUTPUT: &str = "target/wasm32-wasip1/release/prefix_router.wasm";

// ---------------------------------------------------------------------------
// Files and YAML
// ---------------------------------------------------------------------------

pub fn root() -> PathBuf {
    envoy::workspace_root()
}

pub fn read(rel: &str) -> String {
    let path = root().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// A YAML file with `<<:` merge keys resolved (compose uses them).
pub fn yaml(rel: &str) -> Value {
    let mut value: Value =
        serde_yaml::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel} is not valid YAML: {e}"));
    value
        .apply_merge()
        .unwrap_or_else(|e| panic!("{rel}: merge keys: {e}"));
    value
}

/// The documents of a multi-document YAML file (Kubernetes manifests).
pub fn yaml_documents(rel: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(&read(rel))
        .map(|doc| {
            <Value as serde::Deserialize>::deserialize(doc).unwrap_or_else(|e| panic!("{rel}: {e}"))
        })
        .filter(|doc| !doc.is_null())
        .collect()
}

pub fn s<'a>(value: &'a Value, what: &str) -> &'a str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {value:?}"))
}

pub fn seq<'a>(value: &'a Value, what: &str) -> &'a Vec<Value> {
    value
        .as_sequence()
        .unwrap_or_else(|| panic!("{what} is not a list: {value:?}"))
}

pub fn strings(value: &Value, what: &str) -> Vec<String> {
    seq(value, what)
        .iter()
        .map(|v| match v {
            Value::String(text) => text.clone(),
            Value::Number(n) => n.to_string(),
            other => panic!("{what}: {other:?} is not a string"),
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Envoy configuration helpers
// ---------------------------------------------------------------------------

pub fn hcm(config: &Value) -> &Value {
    &config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
}

pub fn wasm_filter(config: &Value) -> &Value {
    seq(&hcm(config)["http_filters"], "http_filters")
        .iter()
        .find(|f| f["typed_config"]["@type"] == WASM_TYPE)
        .expect("no wasm HTTP filter")
}

pub fn plugin_config_json(plugin: &Value) -> serde_json::Value {
    let text = s(
        &plugin["configuration"]["value"],
        "plugin configuration value",
    );
    serde_json::from_str(text).expect("plugin configuration is not JSON")
}

/// Points every wasm filter (listener and clusters' upstream filters) at `filename`.
pub fn set_wasm_filename(config: &mut Value, filename: &str) {
    let mut count = 0;
    replace_wasm_filenames(config, filename, &mut count);
    assert!(count > 0, "no wasm module path in the configuration");
}

pub fn replace_wasm_filenames(node: &mut Value, filename: &str, count: &mut usize) {
    match node {
        Value::Mapping(map) => {
            for (key, value) in map.iter_mut() {
                let is_module = key == "filename"
                    && value
                        .as_str()
                        .is_some_and(|f| f.ends_with("prefix_router.wasm"));
                if is_module {
                    *value = Value::String(filename.to_string());
                    *count += 1;
                } else {
                    replace_wasm_filenames(value, filename, count);
                }
            }
        }
        Value::Sequence(items) => {
            for item in items {
                replace_wasm_filenames(item, filename, count);
            }
        }
        _ => {}
    }
}

pub fn port(socket_address: &Value, what: &str) -> u16 {
    socket_address["port_value"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .unwrap_or_else(|| panic!("{what} has no port_value"))
}

/// (host, port) of every endpoint of a cluster's load assignment.
pub fn endpoints(assignment: &Value) -> Vec<(String, u16)> {
    let mut out = Vec::new();
    for locality in seq(&assignment["endpoints"], "endpoints") {
        for lb in seq(&locality["lb_endpoints"], "lb_endpoints") {
            let socket = &lb["endpoint"]["address"]["socket_address"];
            out.push((
                s(&socket["address"], "endpoint address").to_string(),
                port(socket, "endpoint"),
            ));
        }
    }
    out
}

/// Removes `path` (mapping keys) from `value`, failing if it is absent, so a
/// declared difference that disappears is noticed too.
pub fn remove(value: &mut Value, path: &[&str]) {
    let (last, parents) = path.split_last().expect("empty path");
    let mut node = value;
    for key in parents {
        node = node
            .get_mut(*key)
            .unwrap_or_else(|| panic!("no {} to remove", path.join(".")));
    }
    node.as_mapping_mut()
        .and_then(|m| m.remove(*last))
        .unwrap_or_else(|| panic!("no {} to remove", path.join(".")));
}

pub fn first_cluster(config: &mut Value) -> &mut Value {
    &mut config["static_resources"]["clusters"][0]
}

pub fn clusters_mut(config: &mut Value) -> &mut Vec<Value> {
    config["static_resources"]["clusters"]
        .as_sequence_mut()
        .expect("no static clusters")
}

/// Runs `envoy --mode validate` on `config` (written to a temp file) and fails
/// the test with Envoy's output if it is refused.
/// `copy` (with its expected differences already removed) equals
/// `envoy/envoy.yaml` (likewise trimmed). Mapping equality ignores key order,
/// so reordering a file is not drift.
pub fn assert_no_drift(copy: &Value, shipped: &Value, copy_path: &str, expected_differences: &str) {
    assert!(
        copy == shipped,
        "{copy_path} drifted from envoy/envoy.yaml beyond {expected_differences}:\n{}\n---\n{}",
        serde_yaml::to_string(copy).unwrap(),
        serde_yaml::to_string(shipped).unwrap()
    );
}

pub fn assert_envoy_accepts(config: &Value, what: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("envoy.yaml");
    std::fs::write(&path, serde_yaml::to_string(config).unwrap()).unwrap();
    let validation = envoy::validate_config(&path, &root())
        .unwrap_or_else(|e| panic!("cannot run envoy --mode validate: {e:#}"));
    assert!(
        validation.accepted,
        "Envoy refused {what}:\n{}",
        validation.output
    );
}

pub fn built_wasm() -> String {
    envoy::require_wasm()
        .unwrap_or_else(|e| panic!("{e:#}"))
        .canonicalize()
        .unwrap()
        .to_string_lossy()
        .into_owned()
}
// ---------------------------------------------------------------------------
// docker-compose.yml
// ---------------------------------------------------------------------------

pub mod compose {
    use super::*;

    pub fn file() -> Value {
        yaml("docker-compose.yml")
    }

    pub fn services(compose: &Value) -> &Mapping {
        compose["services"]
            .as_mapping()
            .expect("compose has no services")
    }

    pub fn service<'a>(compose: &'a Value, name: &str) -> &'a Value {
        compose["services"]
            .get(name)
            .unwrap_or_else(|| panic!("compose has no service {name}"))
    }

    pub fn profiles(service: &Value) -> Vec<String> {
        match service.get("profiles") {
            None => Vec::new(),
            Some(list) => strings(list, "profiles"),
        }
    }

    pub fn args(service: &Value, what: &str) -> Vec<String> {
        strings(&service["command"], what)
    }

    pub fn flag<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map(String::as_str)
    }

    /// Bind mounts as (source, target, mount), long and short syntax.
    pub fn binds(service: &Value) -> Vec<(String, String, Value)> {
        let Some(volumes) = service.get("volumes") else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for volume in seq(volumes, "volumes") {
            match volume {
                Value::String(short) => {
                    let parts: Vec<&str> = short.split(':').collect();
                    if parts[0].starts_with('.') || parts[0].starts_with('/') {
                        out.push((parts[0].to_string(), parts[1].to_string(), volume.clone()));
                    }
                }
                long if long["type"] == "bind" => out.push((
                    s(&long["source"], "bind source").to_string(),
                    s(&long["target"], "bind target").to_string(),
                    long.clone(),
                )),
                _ => {}
            }
        }
        out
    }

    /// Named volumes a service uses.
    pub fn named_volumes(service: &Value) -> Vec<String> {
        let Some(volumes) = service.get("volumes") else {
            return Vec::new();
        };
        seq(volumes, "volumes")
            .iter()
            .filter_map(|v| match v {
                Value::String(short) if !short.starts_with('.') && !short.starts_with('/') => {
                    short.split(':').next().map(str::to_string)
                }
                long if long["type"] == "volume" => long["source"].as_str().map(str::to_string),
                _ => None,
            })
            .collect()
    }

    /// Container ports a service publishes.
    pub fn published_container_ports(service: &Value) -> BTreeSet<u16> {
        match service.get("ports") {
            None => BTreeSet::new(),
            Some(ports) => strings(ports, "ports")
                .iter()
                .map(|p| {
                    p.rsplit(':')
                        .next()
                        .and_then(|c| c.parse().ok())
                        .unwrap_or_else(|| panic!("port mapping {p:?}"))
                })
                .collect(),
        }
    }

    /// The names a service answers to on the default network.
    pub fn dns_names(name: &str, service: &Value) -> Vec<String> {
        let mut names = vec![name.to_string()];
        if let Some(aliases) = service
            .get("networks")
            .and_then(|n| n.get("default"))
            .and_then(|d| d.get("aliases"))
        {
            names.extend(strings(aliases, "aliases"));
        }
        names
    }

    /// The Envoy configuration file compose mounts at /etc/envoy/envoy.yaml.
    pub fn envoy_config_source(compose: &Value) -> String {
        binds(service(compose, "envoy"))
            .into_iter()
            .find(|(_, target, _)| target == "/etc/envoy/envoy.yaml")
            .map(|(source, _, _)| source.trim_start_matches("./").to_string())
            .expect("envoy mounts no /etc/envoy/envoy.yaml")
    }

    /// Instance services active under `profile`: (DNS names, port) each.
    pub fn instances_in_profile(compose: &Value, profile: &str) -> Vec<(Vec<String>, u16)> {
        let mut out = Vec::new();
        for (name, svc) in services(compose) {
            let name = s(name, "service name");
            if name == "envoy"
                || name == "prometheus"
                || !profiles(svc).contains(&profile.to_string())
            {
                continue;
            }
            let args = args(svc, name);
            let port: u16 = flag(&args, "--port")
                .unwrap_or_else(|| panic!("{name} sets no --port"))
                .parse()
                .unwrap();
            out.push((dns_names(name, svc), port));
        }
        out
    }
}
/// Removes the plugin configuration's `"instances"` line(s) (the fleet as
/// `ip:port`, where the endpoints are static IPs) from every wasm filter's
/// configuration text, leaving the rest byte for byte: a deployment whose
/// endpoints are DNS names or come from EDS lists no fleet there.
pub fn remove_configured_fleet(config: &mut Value) {
    remove_plugin_field(config, "instances", ']');
}

/// Removes the plugin configuration's debug `"decision_header"` (a
/// deployment may name the serving instance to its clients: the compose
/// one does, for the client examples) the same way.
pub fn remove_decision_header(config: &mut Value) {
    remove_plugin_field(config, "decision_header", '\n');
}

/// Removes the plugin configuration's `"discovery"` (written on one line)
/// and the `envoy_admin` cluster it reads Envoy's admin through, if there.
pub fn remove_discovery(config: &mut Value) {
    remove_plugin_field(config, "discovery", '}');
    clusters_mut(config).retain(|cluster| cluster["name"] != "envoy_admin");
}

/// `…,<ws>"field": … end…` → `……`: from the comma before `field` to the
/// first `end` after it (kept if a line break), in every wasm filter's
/// configuration text.
fn remove_plugin_field(config: &mut Value, field: &str, end: char) {
    fn strip(text: &str, field: &str, end: char) -> String {
        let Some(at) = text.find(&format!("\"{field}\"")) else {
            return text.to_string();
        };
        let comma = text[..at].rfind(',');
        let close = text[at..].find(end);
        match (comma, close) {
            (Some(comma), Some(close)) => {
                let kept = if end == '\n' { close } else { close + 1 };
                format!("{}{}", &text[..comma], &text[at + kept..])
            }
            _ => text.to_string(),
        }
    }
    match config {
        Value::Mapping(map) => {
            for (key, child) in map.iter_mut() {
                match child {
                    Value::String(text) if key.as_str() == Some("value") => {
                        *text = strip(text, field, end);
                    }
                    _ => remove_plugin_field(child, field, end),
                }
            }
        }
        Value::Sequence(items) => items
            .iter_mut()
            .for_each(|item| remove_plugin_field(item, field, end)),
        _ => {}
    }
}

/// `envoy/envoy.yaml` ships the `engine_metrics` cluster (ORIGINAL_DST, no
/// endpoints) that `engine_load` polls through; the deployment copies carry
/// it commented out. Removes it, failing unless there is exactly one.
pub fn remove_engine_metrics_cluster(config: &mut Value) {
    let clusters = clusters_mut(config);
    let before = clusters.len();
    clusters.retain(|cluster| cluster["name"] != "engine_metrics");
    assert_eq!(
        clusters.len() + 1,
        before,
        "one engine_metrics cluster in envoy/envoy.yaml"
    );
}

/// The Envoy configuration at `rel` (for containers or a cluster: DNS-named,
/// health-checked instances) is `envoy/envoy.yaml` but for the admin address,
/// the `.wasm` path and the clusters' endpoints (the `instances` the plugin
/// configuration lists among them, where `rel` reads them from Envoy's admin
/// by `discovery` through an `envoy_admin` cluster), and may add the
/// `decision_header`.
pub fn assert_only_deployment_differs(rel: &str) {
    assert_config_only_deployment_differs(yaml(rel), rel);
}

/// [`assert_only_deployment_differs`] for a configuration already read (and
/// trimmed of what else its deployment declares different).
pub fn assert_config_only_deployment_differs(mut copy: Value, rel: &str) {
    let mut shipped = yaml("envoy/envoy.yaml");
    remove_discovery(&mut copy);
    remove_decision_header(&mut copy);
    remove_configured_fleet(&mut shipped);
    remove_engine_metrics_cluster(&mut shipped);
    for config in [&mut copy, &mut shipped] {
        remove(config, &["admin", "address"]);
        set_wasm_filename(config, "WASM");
        for cluster in clusters_mut(config) {
            remove(cluster, &["type"]);
            remove(cluster, &["load_assignment"]);
        }
    }
    for cluster in clusters_mut(&mut copy) {
        remove(cluster, &["dns_lookup_family"]);
        remove(cluster, &["health_checks"]);
    }
    assert_no_drift(
        &copy,
        &shipped,
        rel,
        "admin address, .wasm path and cluster endpoints",
    );
}

/// A gateway's plugin configuration (Istio's, Envoy Gateway's) is
/// `envoy/envoy.yaml`'s but for the settings a gateway needs: a
/// `max_body_bytes` of at most half the 1 MiB listener buffer limit the
/// gateway runs with (Envoy answers 413 past it while the filter reads),
/// `counting: LISTENER` (no upstream filter runs on the gateway's clusters)
/// and `discovery` through an `envoy_admin` cluster instead of `instances`
/// (the pods come from EDS). Returns the `discovery` cluster it reads.
pub fn assert_gateway_plugin_config(mut plugin: serde_json::Value, what: &str) -> String {
    let mut shipped =
        plugin_config_json(&wasm_filter(&yaml("envoy/envoy.yaml"))["typed_config"]["config"]);
    let max_body = plugin["max_body_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("{what} sets no max_body_bytes"));
    assert!(
        max_body <= 512 * 1024,
        "{what}: max_body_bytes {max_body} risks 413s under a 1 MiB listener limit"
    );
    assert_eq!(plugin.get("instances"), None, "{what} lists no fleet");
    assert_eq!(plugin["counting"], "LISTENER", "{what}'s counting");
    assert_eq!(
        plugin["discovery"]["admin_cluster"], "envoy_admin",
        "{what} reads its fleet from Envoy's admin"
    );
    let discovered = plugin["discovery"]["cluster"]
        .as_str()
        .unwrap_or_else(|| panic!("{what}: discovery names no cluster"))
        .to_string();
    for (config, fields) in [
        (&mut plugin, ["max_body_bytes", "counting", "discovery"]),
        (&mut shipped, ["max_body_bytes", "instances", "discovery"]),
    ] {
        let config = config.as_object_mut().expect("a JSON object");
        for field in fields {
            config.remove(field);
        }
    }
    assert_eq!(
        plugin, shipped,
        "{what}'s plugin configuration differs from envoy/envoy.yaml's"
    );
    discovered
}

/// An `envoy_admin` cluster leads to Envoy's admin on `port` of loopback.
pub fn assert_admin_cluster(cluster: &Value, port: u16, what: &str) {
    assert_eq!(cluster["name"], "envoy_admin", "{what}");
    assert_eq!(cluster["type"], "STATIC", "{what}");
    assert_eq!(
        endpoints(&cluster["load_assignment"]),
        [("127.0.0.1".to_string(), port)],
        "{what}: the admin cluster must lead to this Envoy's own admin"
    );
}

// ---------------------------------------------------------------------------
// HTTP through Envoy (the Istio and EDS tests)
// ---------------------------------------------------------------------------

/// POST through Envoy; returns `x-served-by`, failing on a non-200.
pub fn post(envoy: &Envoy, path: &str, headers: &[(&str, &str)], body: &[u8]) -> String {
    let mut request =
        ureq::post(&format!("{}{path}", envoy.base_url())).timeout(Duration::from_secs(10));
    for (name, value) in headers {
        request = request.set(name, value);
    }
    let response = request
        .send_bytes(body)
        .unwrap_or_else(|e| panic!("POST {path}: {e}\n{}", envoy.log()));
    assert_eq!(response.status(), 200);
    response
        .header("x-served-by")
        .expect("no x-served-by")
        .to_string()
}

// ---------------------------------------------------------------------------
// Dashboards (the EDS and the metrics-doc tests) and checking tools
// ---------------------------------------------------------------------------

/// The filter's metric names used in the PromQL snippet and the Grafana dashboard.
pub fn dashboard_metric_names() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let in_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    for rel in [
        "examples/prometheus/queries.promql",
        "examples/prometheus/grafana-dashboard.json",
        "examples/prometheus/alerts.yml",
    ] {
        // Expressions only: comments name plugins and files, not metrics.
        let text: String = read(rel)
            .lines()
            .filter(|line| !line.trim_start().starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n");
        let mut rest = text.as_str();
        while let Some(found) = rest.find("prefix_router_") {
            // The whole name, also when it is Envoy's (`envoy_wasm_prefix_router_...`).
            let start = rest[..found]
                .rfind(|c: char| !in_name(c))
                .map_or(0, |i| i + 1);
            let tail = &rest[start..];
            let end = tail.find(|c: char| !in_name(c)).unwrap_or(tail.len());
            names.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    assert!(
        names.len() >= 4,
        "dashboards use too few filter metrics: {names:?}"
    );
    names
}

/// `examples/prometheus/grafana-dashboard.json`, parsed.
pub fn grafana_dashboard() -> serde_json::Value {
    serde_json::from_str(&read("examples/prometheus/grafana-dashboard.json"))
        .expect("the dashboard is JSON")
}

/// The PromQL of every panel target of the Grafana dashboard, in order.
pub fn dashboard_panel_expressions() -> Vec<String> {
    let dashboard = grafana_dashboard();
    let mut expressions = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            expressions.push(target["expr"].as_str().expect("expr").to_string());
        }
    }
    expressions
}

/// Runs a checking tool; panics with its output unless it succeeds, and with
/// `install_hint` too, in case the tool (or a module it loads) is missing.
pub fn run_check(command: &mut Command, install_hint: &str) {
    let shown = format!("{command:?}");
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {shown} ({e}): {install_hint}"));
    assert!(
        output.status.success(),
        "{shown} failed (if it is missing: {install_hint}):\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Kubernetes 1.31's schemas accept the manifests at `paths` (relative to
/// the repository or absolute), in strict mode: no unknown field.
pub fn assert_kubernetes_schemas_accept<P: AsRef<std::ffi::OsStr>>(paths: &[P]) {
    run_check(
        Command::new("python3")
            .args([
                "-m",
                "kubernetes_validate",
                "--strict",
                "--quiet",
                "--kubernetes-version",
                "1.31",
            ])
            .args(paths)
            .current_dir(root()),
        "install kubernetes-validate (`python3 -m pip install kubernetes-validate`; \
         cargo xtask test does this)",
    );
}

/// Checks custom resources against the CRDs of their API group, with the
/// validators the `@kubernetes-models/*` npm packages generate from them
/// (`CRD_VALIDATORS`: the folder whose node_modules holds them; `cargo xtask
/// test` installs them there). A kind with no validator fails too. The
/// schemas check types, enums, patterns and required fields; like a CRD's
/// schema they let unknown fields through (the API server's strict field
/// validation would not).
pub fn assert_crds_accept(documents: &[Value], what: &str) {
    const SCRIPT: &str = r#"
import { join } from "node:path";
import { pathToFileURL } from "node:url";
const packages = {
  "gateway.envoyproxy.io": "envoy-gateway",
  "gateway.networking.k8s.io": "gateway-api",
  "networking.istio.io": "istio",
  "extensions.istio.io": "istio",
};
let input = "";
for await (const chunk of process.stdin) input += chunk;
const failures = [];
for (const doc of JSON.parse(input)) {
  const what = `${doc.kind} ${doc.metadata?.name}`;
  const [group, version] = doc.apiVersion.split("/");
  const pkg = packages[group];
  if (!pkg) { failures.push(`${what}: no validator for ${doc.apiVersion}`); continue; }
  const file = join(process.env.CRD_VALIDATORS, "node_modules", "@kubernetes-models", pkg, group, version, "index.js");
  const Kind = (await import(pathToFileURL(file).href))[doc.kind];
  if (!Kind) { failures.push(`${what}: no ${doc.kind} in ${doc.apiVersion}`); continue; }
  try { new Kind(doc).validate(); } catch (e) { failures.push(`${what}: ${e.message}`); }
}
if (failures.length) { console.error(failures.join("\n")); process.exit(1); }
"#;
    let dir = std::env::var_os("CRD_VALIDATORS")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| envoy::target_dir().join("crd-validators"));
    let mut child = Command::new("node")
        .args(["--input-type=module", "-e", SCRIPT])
        .env("CRD_VALIDATORS", &dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run node ({e}): Node.js checks {what}"));
    let input = serde_json::to_vec(documents).unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), &input).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "the CRD schemas refuse {what} (validators in {}: `cargo xtask test` installs them):\n{}",
        dir.display(),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Every document of every `.yaml` file under `dir` (recursively), in path order.
pub fn yaml_documents_under(dir: &str) -> Vec<Value> {
    fn files(path: &std::path::Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(path).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                files(&path, out);
            } else if path.extension().is_some_and(|e| e == "yaml") {
                out.push(path);
            }
        }
    }
    let mut paths = Vec::new();
    files(&root().join(dir), &mut paths);
    paths.sort();
    paths
        .iter()
        .flat_map(|path| yaml_documents(&path.strip_prefix(root()).unwrap().to_string_lossy()))
        .collect()
}

/// Reads `probe` every 50 ms until `ready` holds of the reading, for at most
/// `timeout`, and returns that reading; panics with `failure(&reading)` of
/// the last one if it never holds (the filter hands its stats to Envoy on a
/// 1 s tick, Envoy applies configuration files as it reads them).
pub fn wait_until<T>(
    timeout: Duration,
    mut probe: impl FnMut() -> T,
    ready: impl Fn(&T) -> bool,
    failure: impl Fn(&T) -> String,
) -> T {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let reading = probe();
        if ready(&reading) {
            return reading;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not within {timeout:?}: {}",
            failure(&reading)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ---------------------------------------------------------------------------
// Envoy's /stats/prometheus (the Prometheus and two-fleets tests)
// ---------------------------------------------------------------------------

/// One sample line of a Prometheus text scrape.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: std::collections::BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.get(name).map(String::as_str)
    }
}

/// The sample lines of `scraped` (Prometheus text format, as Envoy writes
/// it: `name{a="x",b="y"} value`), comments skipped.
pub fn samples(scraped: &str) -> Vec<Sample> {
    scraped
        .lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| {
            let (series, value) = line
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("not a sample line: {line}"));
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, parse_labels(rest.trim_end_matches('}'), line)),
                None => (series, Default::default()),
            };
            Sample {
                name: name.to_string(),
                labels,
                value: value
                    .parse()
                    .unwrap_or_else(|e| panic!("{e}: not a sample line: {line}")),
            }
        })
        .collect()
}

/// `a="x",b="y\"z"` -> {a: x, b: y"z}.
fn parse_labels(mut text: &str, line: &str) -> std::collections::BTreeMap<String, String> {
    let mut labels = std::collections::BTreeMap::new();
    while let Some((name, rest)) = text.split_once("=\"") {
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => panic!("unterminated label value: {line}"),
                },
                Some((i, '"')) => break i,
                Some((_, c)) => value.push(c),
                None => panic!("unterminated label value: {line}"),
            }
        };
        labels.insert(name.trim_start_matches(',').to_string(), value);
        text = &rest[end + 1..];
    }
    labels
}
