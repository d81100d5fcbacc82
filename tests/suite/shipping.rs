//! What users copy out of this repository works: docker-compose.yml, the
//! Envoy configuration it mounts, the Istio and file-based EDS examples, the
//! Prometheus/Grafana snippets, and real clients (the official OpenAI Python
//! SDK, curl) through a real Envoy with the filter.
//!
//! No Docker engine or Istio runs here, so compose and Istio files are checked
//! as files (they parse, what they reference exists, ports and header names
//! agree) and every piece of Envoy configuration in them is fed to a real
//! Envoy 1.40 (`envoy --mode validate`, or started). Envoy comes from
//! `ENVOY_BIN` or PATH; the filter from `PREFIX_ROUTER_WASM` or the release
//! build (`cargo xtask test` provides both).

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use prefix_router_tools::envoy::{self, Envoy};
use prefix_router_tools::upstream::UpstreamFleet;
use serde_json::json;
use serde_yaml::{Mapping, Value};

const KEY_HEADER: &str = "x-prefix-route-key";
const TENANT_HEADER: &str = "x-amzn-sagemaker-prefix-aware-id";
/// The overload design's `host_header`, read by Envoy's override_host policy.
const HOST_HEADER: &str = "x-prefix-route-host";
const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
/// Where `cargo build --release --target wasm32-wasip1 -p prefix-router` writes the filter.
const WASM_BUILD_OUTPUT: &str = "target/wasm32-wasip1/release/prefix_router.wasm";

// ---------------------------------------------------------------------------
// Files and YAML
// ---------------------------------------------------------------------------

fn root() -> PathBuf {
    envoy::workspace_root()
}

fn read(rel: &str) -> String {
    let path = root().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// A YAML file with `<<:` merge keys resolved (compose uses them).
fn yaml(rel: &str) -> Value {
    let mut value: Value =
        serde_yaml::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel} is not valid YAML: {e}"));
    value
        .apply_merge()
        .unwrap_or_else(|e| panic!("{rel}: merge keys: {e}"));
    value
}

fn s<'a>(value: &'a Value, what: &str) -> &'a str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {value:?}"))
}

fn seq<'a>(value: &'a Value, what: &str) -> &'a Vec<Value> {
    value
        .as_sequence()
        .unwrap_or_else(|| panic!("{what} is not a list: {value:?}"))
}

fn strings(value: &Value, what: &str) -> Vec<String> {
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

fn hcm(config: &Value) -> &Value {
    &config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
}

fn wasm_filter(config: &Value) -> &Value {
    seq(&hcm(config)["http_filters"], "http_filters")
        .iter()
        .find(|f| f["typed_config"]["@type"] == WASM_TYPE)
        .expect("no wasm HTTP filter")
}

fn plugin_config_json(plugin: &Value) -> serde_json::Value {
    let text = s(
        &plugin["configuration"]["value"],
        "plugin configuration value",
    );
    serde_json::from_str(text).expect("plugin configuration is not JSON")
}

/// Points every wasm filter (listener and clusters' upstream filters) at `filename`.
fn set_wasm_filename(config: &mut Value, filename: &str) {
    let mut count = 0;
    replace_wasm_filenames(config, filename, &mut count);
    assert!(count > 0, "no wasm module path in the configuration");
}

fn replace_wasm_filenames(node: &mut Value, filename: &str, count: &mut usize) {
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

fn port(socket_address: &Value, what: &str) -> u16 {
    socket_address["port_value"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .unwrap_or_else(|| panic!("{what} has no port_value"))
}

/// (host, port) of every endpoint of a cluster's load assignment.
fn endpoints(assignment: &Value) -> Vec<(String, u16)> {
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
fn remove(value: &mut Value, path: &[&str]) {
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

fn first_cluster(config: &mut Value) -> &mut Value {
    &mut config["static_resources"]["clusters"][0]
}

fn clusters_mut(config: &mut Value) -> &mut Vec<Value> {
    config["static_resources"]["clusters"]
        .as_sequence_mut()
        .expect("no static clusters")
}

/// Runs `envoy --mode validate` on `config` (written to a temp file) and fails
/// the test with Envoy's output if it is refused.
/// `copy` (with its expected differences already removed) equals
/// `envoy/envoy.yaml` (likewise trimmed). Mapping equality ignores key order,
/// so reordering a file is not drift.
fn assert_no_drift(copy: &Value, shipped: &Value, copy_path: &str, expected_differences: &str) {
    assert!(
        copy == shipped,
        "{copy_path} drifted from envoy/envoy.yaml beyond {expected_differences}:\n{}\n---\n{}",
        serde_yaml::to_string(copy).unwrap(),
        serde_yaml::to_string(shipped).unwrap()
    );
}

fn assert_envoy_accepts(config: &Value, what: &str) {
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

fn built_wasm() -> String {
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

mod compose {
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

#[test]
fn compose_defines_envoy_three_vllm_instances_their_cpu_swap_and_prometheus() {
    let compose = compose::file();
    let envoy_svc = compose::service(&compose, "envoy");
    let image = s(&envoy_svc["image"], "envoy image");
    let minor = envoy::ENVOY_VERSION.rsplit_once('.').unwrap().0;
    assert!(
        image == format!("envoyproxy/envoy:v{minor}-latest")
            || image == format!("envoyproxy/envoy:v{}", envoy::ENVOY_VERSION),
        "Envoy image {image} is not the official v{minor} image the tests use"
    );
    assert!(
        compose::profiles(envoy_svc).is_empty(),
        "Envoy must run in every profile"
    );

    for name in ["vllm-1", "vllm-2", "vllm-3"] {
        let svc = compose::service(&compose, name);
        assert_eq!(compose::profiles(svc), ["gpu"], "{name}");
        assert!(
            s(&svc["image"], "image").starts_with("vllm/vllm-openai:"),
            "{name}"
        );
        let args = compose::args(svc, name);
        assert!(
            args.iter().any(|a| a == "--enable-prefix-caching"),
            "{name}: {args:?}"
        );
        let model = &args[0];
        assert!(
            model.contains('/') && !model.starts_with('-'),
            "{name}: model first: {args:?}"
        );
        let devices = seq(
            &svc["deploy"]["resources"]["reservations"]["devices"],
            "devices",
        );
        assert!(
            devices.iter().any(|d| d["driver"] == "nvidia"
                && strings(&d["capabilities"], "capabilities").contains(&"gpu".to_string())),
            "{name} reserves no NVIDIA GPU"
        );
        let health = strings(&svc["healthcheck"]["test"], "healthcheck").join(" ");
        let port = compose::flag(&args, "--port").unwrap();
        assert!(
            health.contains(&format!(":{port}/health")),
            "{name}: {health}"
        );
    }
    for i in 1..=3 {
        let name = format!("vllm-sim-{i}");
        let svc = compose::service(&compose, &name);
        assert_eq!(compose::profiles(svc), ["cpu"], "{name}");
        let args = compose::args(svc, &name);
        assert_eq!(
            compose::flag(&args, "--name"),
            Some(format!("vllm-{i}").as_str())
        );
        assert_eq!(
            compose::flag(&args, "--host"),
            Some("0.0.0.0"),
            "{name} must listen beyond loopback"
        );
        let health = strings(&svc["healthcheck"]["test"], "healthcheck").join(" ");
        let port = compose::flag(&args, "--port").unwrap();
        assert!(
            health.contains(&format!(":{port}/health")),
            "{name}: {health}"
        );
    }
    let prometheus = compose::service(&compose, "prometheus");
    assert_eq!(compose::profiles(prometheus), ["metrics"]);
}

#[test]
fn compose_references_only_files_volumes_and_build_contexts_that_exist() {
    let compose = compose::file();
    let declared_volumes: BTreeSet<String> = compose["volumes"]
        .as_mapping()
        .map(|m| m.keys().map(|k| s(k, "volume").to_string()).collect())
        .unwrap_or_default();
    let mut checked = 0;
    for (name, svc) in compose::services(&compose) {
        let name = s(name, "service");
        for (source, _, mount) in compose::binds(svc) {
            let rel = source.trim_start_matches("./");
            if rel == WASM_BUILD_OUTPUT {
                // A build artifact: the mount must refuse to invent it.
                assert_eq!(
                    mount["bind"]["create_host_path"],
                    Value::Bool(false),
                    "{name}: a missing .wasm must fail `up`, not mount an empty directory"
                );
                continue;
            }
            assert!(
                root().join(rel).is_file(),
                "{name} mounts {source}, which does not exist"
            );
            checked += 1;
        }
        for volume in compose::named_volumes(svc) {
            assert!(
                declared_volumes.contains(&volume),
                "{name} uses undeclared volume {volume}"
            );
        }
        if let Some(build) = svc.get("build") {
            let context = root().join(s(&build["context"], "build context"));
            assert!(context.is_dir(), "{name}: build context missing");
            let dockerfile = context.join(s(&build["dockerfile"], "dockerfile"));
            assert!(
                dockerfile.is_file(),
                "{name}: {} missing",
                dockerfile.display()
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 5,
        "expected the config, Prometheus and build files; checked {checked}"
    );
    let wasm_mounted = compose::binds(compose::service(&compose, "envoy"))
        .into_iter()
        .any(|(source, target, _)| {
            source.trim_start_matches("./") == WASM_BUILD_OUTPUT
                && target == "/etc/envoy/prefix_router.wasm"
        });
    assert!(wasm_mounted, "Envoy does not mount the built filter");
}

#[test]
fn vllm_sim_image_builds_the_tools_crates_vllm_sim_binary() {
    let dockerfile = read("docker/vllm-sim.Dockerfile");
    assert!(
        dockerfile.contains("-p prefix-router-tools --bin vllm-sim"),
        "{dockerfile}"
    );
    assert!(dockerfile.contains("ENTRYPOINT [\"vllm-sim\"]"));
    let ignore = read("docker/vllm-sim.Dockerfile.dockerignore");
    assert!(
        ignore.lines().any(|l| l.trim() == "target/"),
        "the build context would ship target/"
    );
    // The binary the image builds, and the flags compose passes to it.
    let source = read("tools/src/bin/vllm-sim.rs");
    let compose = compose::file();
    let args = compose::args(compose::service(&compose, "vllm-sim-1"), "vllm-sim-1");
    for flag in args.iter().filter(|a| a.starts_with("--")) {
        let field = flag.trim_start_matches("--").replace('-', "_");
        assert!(
            source.contains(&format!("    {field}: ")),
            "compose passes {flag}, which vllm-sim does not define"
        );
    }
}

#[test]
fn the_envoy_config_compose_mounts_passes_envoy_validate() {
    let compose = compose::file();
    let rel = compose::envoy_config_source(&compose);
    let mut config = yaml(&rel);
    let plugin = &wasm_filter(&config)["typed_config"]["config"];
    assert_eq!(
        plugin["vm_config"]["code"]["local"]["filename"], "/etc/envoy/prefix_router.wasm",
        "{rel} must load the .wasm where compose mounts it"
    );
    assert_eq!(plugin["allow_on_headers_stop_iteration"], Value::Bool(true));
    // Only the .wasm path changes: /etc/envoy does not exist on this machine.
    set_wasm_filename(&mut config, &built_wasm());
    assert_envoy_accepts(&config, &rel);
}

#[test]
fn the_compose_envoy_config_differs_from_envoy_yaml_only_where_containers_need_it() {
    let compose = compose::file();
    assert_only_deployment_differs(&compose::envoy_config_source(&compose));
}

/// The Envoy configuration at `rel` (for containers or a cluster: DNS-named,
/// health-checked instances) is `envoy/envoy.yaml` but for the admin address,
/// the `.wasm` path and the clusters' endpoints.
fn assert_only_deployment_differs(rel: &str) {
    let mut copy = yaml(rel);
    let mut shipped = yaml("envoy/envoy.yaml");
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

#[test]
fn ports_and_names_agree_between_compose_envoy_and_prometheus() {
    let compose = compose::file();
    let config = yaml(&compose::envoy_config_source(&compose));
    let envoy_svc = compose::service(&compose, "envoy");
    let published = compose::published_container_ports(envoy_svc);
    let listener = port(
        &config["static_resources"]["listeners"][0]["address"]["socket_address"],
        "listener",
    );
    let admin_socket = &config["admin"]["address"]["socket_address"];
    let admin = port(admin_socket, "admin");
    assert!(
        published.contains(&listener),
        "listener {listener} not published: {published:?}"
    );
    assert!(
        published.contains(&admin),
        "admin {admin} not published: {published:?}"
    );
    assert_eq!(
        admin_socket["address"], "0.0.0.0",
        "Prometheus (another container) must reach admin"
    );
    let admin_mapping = strings(&envoy_svc["ports"], "ports")
        .into_iter()
        .find(|p| p.ends_with(&format!(":{admin}")))
        .unwrap();
    assert!(
        admin_mapping.starts_with("127.0.0.1:"),
        "admin published beyond loopback: {admin_mapping}"
    );

    let clusters = seq(&config["static_resources"]["clusters"], "clusters");
    let cluster_endpoints: BTreeMap<String, u16> = endpoints(&clusters[0]["load_assignment"])
        .into_iter()
        .collect();
    assert_eq!(cluster_endpoints.len(), 3);
    for cluster in clusters {
        assert_eq!(cluster["type"], "STRICT_DNS", "{:?}", cluster["name"]);
        let these: BTreeMap<String, u16> =
            endpoints(&cluster["load_assignment"]).into_iter().collect();
        assert_eq!(
            these, cluster_endpoints,
            "clusters must list the same instances"
        );
    }
    for profile in ["gpu", "cpu"] {
        let instances = compose::instances_in_profile(&compose, profile);
        assert_eq!(
            instances.len(),
            cluster_endpoints.len(),
            "profile {profile}: {instances:?}"
        );
        // Every cluster endpoint is exactly one instance of the profile, on its port.
        for (host, port) in &cluster_endpoints {
            let serving: Vec<u16> = instances
                .iter()
                .filter(|(names, _)| names.contains(host))
                .map(|(_, p)| *p)
                .collect();
            assert_eq!(
                serving,
                [*port],
                "profile {profile}: {host}:{port} is served by {serving:?}"
            );
        }
    }

    let prometheus_rel = compose::binds(compose::service(&compose, "prometheus"))
        .into_iter()
        .find(|(_, target, _)| target == "/etc/prometheus/prometheus.yml")
        .map(|(source, _, _)| source.trim_start_matches("./").to_string())
        .expect("prometheus mounts no configuration");
    let prometheus = yaml(&prometheus_rel);
    // Each rule file Prometheus loads (relative to its configuration) is the
    // repository's file of that name, mounted beside the configuration.
    let binds = compose::binds(compose::service(&compose, "prometheus"));
    let rule_files = strings(&prometheus["rule_files"], "rule_files");
    assert!(
        !rule_files.is_empty(),
        "{prometheus_rel} loads no alerting rules"
    );
    for rule_file in rule_files {
        let target = format!("/etc/prometheus/{rule_file}");
        let source = binds
            .iter()
            .find(|(_, t, _)| *t == target)
            .map(|(source, _, _)| source.trim_start_matches("./").to_string())
            .unwrap_or_else(|| panic!("prometheus loads {target}, which compose does not mount"));
        assert_eq!(source, format!("examples/prometheus/{rule_file}"));
    }
    let jobs = seq(&prometheus["scrape_configs"], "scrape_configs");
    let targets = |job: &Value| -> BTreeSet<String> {
        seq(&job["static_configs"], "static_configs")
            .iter()
            .flat_map(|c| strings(&c["targets"], "targets"))
            .collect()
    };
    let envoy_job = jobs
        .iter()
        .find(|j| j["job_name"] == "envoy")
        .expect("no envoy job");
    assert_eq!(envoy_job["metrics_path"], "/stats/prometheus");
    assert_eq!(
        targets(envoy_job),
        BTreeSet::from([format!("envoy:{admin}")])
    );
    let vllm_job = jobs
        .iter()
        .find(|j| j["job_name"] == "vllm")
        .expect("no vllm job");
    assert_eq!(vllm_job["metrics_path"], "/metrics");
    let expected: BTreeSet<String> = cluster_endpoints
        .iter()
        .map(|(h, p)| format!("{h}:{p}"))
        .collect();
    assert_eq!(targets(vllm_job), expected);
}

// ---------------------------------------------------------------------------
// OCI artifact
// ---------------------------------------------------------------------------

#[test]
fn the_oci_image_is_scratch_with_only_plugin_wasm() {
    let instructions: Vec<String> = read("docker/plugin.Dockerfile")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    assert_eq!(
        instructions,
        ["FROM scratch", "COPY prefix_router.wasm /plugin.wasm"]
    );
}

// ---------------------------------------------------------------------------
// Istio
// ---------------------------------------------------------------------------

fn istio_envoy_filter() -> Value {
    yaml("examples/istio/envoyfilter.yaml")
}

fn patch<'a>(filter: &'a Value, apply_to: &str) -> &'a Value {
    seq(&filter["spec"]["configPatches"], "configPatches")
        .iter()
        .find(|p| p["applyTo"] == apply_to)
        .unwrap_or_else(|| panic!("no {apply_to} patch"))
}

#[test]
fn istio_envoy_filter_adds_the_wasm_extension_config_and_the_http_filter() {
    let filter = istio_envoy_filter();
    assert_eq!(filter["kind"], "EnvoyFilter");
    assert!(s(&filter["apiVersion"], "apiVersion").starts_with("networking.istio.io/"));
    let extension = patch(&filter, "EXTENSION_CONFIG");
    assert_eq!(extension["patch"]["operation"], "ADD");
    let value = &extension["patch"]["value"];
    let name = s(&value["name"], "extension config name");
    assert_eq!(value["typed_config"]["@type"], WASM_TYPE);
    let config = &value["typed_config"]["config"];
    assert_eq!(config["allow_on_headers_stop_iteration"], Value::Bool(true));
    let remote = &config["vm_config"]["code"]["remote"];
    let uri = s(&remote["http_uri"]["uri"], "module uri");
    assert!(
        uri.starts_with("oci://") && uri.contains("@sha256:"),
        "module not pinned by digest: {uri}"
    );
    assert_eq!(s(&remote["sha256"], "sha256").len(), 64);
    let mut plugin = plugin_config_json(config);
    let mut shipped =
        plugin_config_json(&wasm_filter(&yaml("envoy/envoy.yaml"))["typed_config"]["config"]);
    // Istio relies on the listener's buffer limit (1 MiB by default): half of it at most.
    let max_body = plugin["max_body_bytes"]
        .as_u64()
        .expect("Istio's max_body_bytes");
    assert!(
        max_body <= 512 * 1024,
        "max_body_bytes {max_body} risks 413s under a 1 MiB listener limit"
    );
    plugin["max_body_bytes"] = json!(null);
    shipped["max_body_bytes"] = json!(null);
    // No upstream filter in the cluster: the listener filter must count.
    assert_eq!(plugin["counting"], "LISTENER", "Istio's counting");
    if let Some(fields) = plugin.as_object_mut() {
        fields.remove("counting");
    }
    assert_eq!(
        plugin, shipped,
        "Istio's plugin configuration differs from envoy/envoy.yaml's"
    );

    let http = patch(&filter, "HTTP_FILTER");
    assert_eq!(http["patch"]["operation"], "INSERT_BEFORE");
    assert_eq!(
        http["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"],
        "envoy.filters.http.router"
    );
    let discovery = &http["patch"]["value"]["config_discovery"];
    assert_eq!(
        http["patch"]["value"]["name"], name,
        "HTTP filter must name the extension config"
    );
    assert!(discovery["config_source"].get("ads").is_some());
    assert_eq!(strings(&discovery["type_urls"], "type_urls"), [WASM_TYPE]);
}

#[test]
fn istio_destination_rule_hashes_the_key_header_with_maglev() {
    let rule = yaml("examples/istio/destinationrule.yaml");
    assert_eq!(rule["kind"], "DestinationRule");
    let hash = &rule["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"];
    let shipped =
        plugin_config_json(&wasm_filter(&yaml("envoy/envoy.yaml"))["typed_config"]["config"]);
    assert_eq!(hash["httpHeaderName"], s_json(&shipped["key_header"]));
    assert_eq!(s_json(&shipped["key_header"]), KEY_HEADER);
    assert!(
        hash["maglev"].is_mapping(),
        "consistentHash must use maglev: {hash:?}"
    );
    assert!(hash.get("ringHash").is_none());
}

fn s_json(value: &serde_json::Value) -> &str {
    value.as_str().expect("string")
}

#[test]
fn istio_override_host_cluster_patch_merges_override_host_with_maglev_fallback() {
    let filter = yaml("examples/istio/override-host-cluster.yaml");
    let cluster = patch(&filter, "CLUSTER");
    assert_eq!(cluster["patch"]["operation"], "MERGE");
    assert!(cluster["match"]["cluster"]["service"].is_string());
    let policy = &cluster["patch"]["value"]["load_balancing_policy"]["policies"][0]
        ["typed_extension_config"];
    assert_eq!(
        policy["name"],
        "envoy.load_balancing_policies.override_host"
    );
    assert_eq!(
        policy["typed_config"]["override_host_sources"][0]["header"],
        HOST_HEADER
    );
    assert_eq!(
        policy["typed_config"]["fallback_policy"]["policies"][0]["typed_extension_config"]["name"],
        "envoy.load_balancing_policies.maglev"
    );
}

/// envoy/envoy.yaml with the Istio patches applied the way Istio would hand
/// them to Envoy: the ECDS filter configuration inline (with the module as the
/// local file istio-agent turns the oci:// download into), and the cluster
/// patch merged into the cluster.
fn envoy_yaml_with_istio_patches() -> Value {
    let mut config = yaml("envoy/envoy.yaml");
    let filter = istio_envoy_filter();
    let mut typed = patch(&filter, "EXTENSION_CONFIG")["patch"]["value"]["typed_config"].clone();
    typed["config"]["vm_config"]["code"] =
        serde_yaml::from_str(&format!("local: {{ filename: '{}' }}", built_wasm())).unwrap();
    let filters = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"]
        .as_sequence_mut()
        .unwrap();
    let wasm = filters
        .iter_mut()
        .find(|f| f["typed_config"]["@type"] == WASM_TYPE)
        .unwrap();
    wasm["typed_config"] = typed;
    let cluster_patch = yaml("examples/istio/override-host-cluster.yaml");
    let merge = patch(&cluster_patch, "CLUSTER")["patch"]["value"].clone();
    let cluster = first_cluster(&mut config).as_mapping_mut().unwrap();
    for (k, v) in merge.as_mapping().unwrap() {
        cluster.insert(k.clone(), v.clone());
    }
    config
}

#[test]
fn istio_wasm_configuration_and_cluster_patch_pass_envoy_validate() {
    assert_envoy_accepts(
        &envoy_yaml_with_istio_patches(),
        "the Istio patches applied to envoy/envoy.yaml",
    );
}

/// The override_host patch really takes over from the MAGLEV lb_policy Istio
/// sets: a named host is used; without it Maglev on the key header decides.
/// Plain Envoy (no filter), so the key and host headers are the client's.
#[test]
fn override_host_patch_routes_to_the_named_host_and_falls_back_to_maglev() {
    let fleet = UpstreamFleet::start(3).unwrap();
    let merge = patch(
        &yaml("examples/istio/override-host-cluster.yaml"),
        "CLUSTER",
    )["patch"]["value"]
        .clone();
    let envoy = Envoy::builder()
        .without_filter()
        .upstreams(fleet.addrs())
        .edit(move |config| {
            let cluster = config["static_resources"]["clusters"][0]
                .as_mapping_mut()
                .unwrap();
            for (k, v) in merge.as_mapping().unwrap() {
                cluster.insert(k.clone(), v.clone());
            }
            Ok(())
        })
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    let target = fleet.addrs()[2];
    for i in 0..12 {
        let served = post(
            &envoy,
            "/invocations",
            &[
                (KEY_HEADER, &format!("{i:016x}")),
                (HOST_HEADER, &target.to_string()),
            ],
            b"x",
        );
        assert_eq!(
            served,
            fleet.names()[2],
            "request {i} ignored {HOST_HEADER}"
        );
    }
    // Fallback: one key, one instance; many keys, several instances.
    let same: BTreeSet<String> = (0..6)
        .map(|_| {
            post(
                &envoy,
                "/invocations",
                &[(KEY_HEADER, "00000000000000aa")],
                b"x",
            )
        })
        .collect();
    assert_eq!(same.len(), 1, "one key went to {same:?}");
    let spread: BTreeSet<String> = (0..30)
        .map(|i| {
            post(
                &envoy,
                "/invocations",
                &[(KEY_HEADER, &format!("{:016x}", i * 7919))],
                b"x",
            )
        })
        .collect();
    assert!(spread.len() >= 2, "30 keys all went to {spread:?}");
}

/// POST through Envoy; returns `x-served-by`, failing on a non-200.
fn post(envoy: &Envoy, path: &str, headers: &[(&str, &str)], body: &[u8]) -> String {
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
// Kubernetes (examples/kubernetes): not run on a cluster here; its manifests
// are checked against Kubernetes' schemas, each other and the Envoy config.
// ---------------------------------------------------------------------------

mod kube {
    use super::*;

    pub const DIR: &str = "examples/kubernetes";

    /// The documents of a manifest file.
    pub fn documents(rel: &str) -> Vec<Value> {
        serde_yaml::Deserializer::from_str(&read(rel))
            .map(|doc| {
                <Value as serde::Deserialize>::deserialize(doc)
                    .unwrap_or_else(|e| panic!("{rel}: {e}"))
            })
            .filter(|doc| !doc.is_null())
            .collect()
    }

    /// Every resource kustomization.yaml lists, by (kind, name).
    pub fn resources() -> BTreeMap<(String, String), Value> {
        let kustomization = yaml(&format!("{DIR}/kustomization.yaml"));
        let mut out = BTreeMap::new();
        for rel in strings(&kustomization["resources"], "resources") {
            for doc in documents(&format!("{DIR}/{rel}")) {
                let kind = s(&doc["kind"], "kind").to_string();
                let name = s(&doc["metadata"]["name"], "metadata.name").to_string();
                out.insert((kind, name), doc);
            }
        }
        out
    }

    pub fn get<'a>(
        resources: &'a BTreeMap<(String, String), Value>,
        kind: &str,
        name: &str,
    ) -> &'a Value {
        resources
            .get(&(kind.to_string(), name.to_string()))
            .unwrap_or_else(|| panic!("kustomization.yaml has no {kind} {name}"))
    }

    /// configMapGenerator: name -> its files.
    pub fn generated_config_maps() -> BTreeMap<String, Vec<String>> {
        let kustomization = yaml(&format!("{DIR}/kustomization.yaml"));
        seq(&kustomization["configMapGenerator"], "configMapGenerator")
            .iter()
            .map(|g| {
                (
                    s(&g["name"], "generator name").to_string(),
                    strings(&g["files"], "files"),
                )
            })
            .collect()
    }
}

#[test]
fn kubernetes_manifests_pass_kubernetes_schemas() {
    let kustomization = yaml(&format!("{}/kustomization.yaml", kube::DIR));
    let files: Vec<String> = strings(&kustomization["resources"], "resources")
        .into_iter()
        .map(|rel| format!("{}/{rel}", kube::DIR))
        .collect();
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
            .args(&files)
            .current_dir(root()),
        "install kubernetes-validate (`python3 -m pip install kubernetes-validate`; \
         cargo xtask test does this)",
    );
}

#[test]
fn kubernetes_envoy_config_differs_from_envoy_yaml_only_where_the_cluster_needs_it() {
    assert_only_deployment_differs(&format!("{}/envoy.yaml", kube::DIR));
}

#[test]
fn kubernetes_envoy_config_passes_envoy_validate() {
    let rel = format!("{}/envoy.yaml", kube::DIR);
    let mut config = yaml(&rel);
    set_wasm_filename(&mut config, &built_wasm());
    assert_envoy_accepts(&config, &rel);
}

#[test]
fn kubernetes_manifests_agree_with_each_other_envoy_and_compose() {
    let resources = kube::resources();
    let config = yaml(&format!("{}/envoy.yaml", kube::DIR));
    let generated = kube::generated_config_maps();
    let deployment = kube::get(&resources, "Deployment", "prefix-router");
    let pod = &deployment["spec"]["template"];
    assert_eq!(
        deployment["spec"]["selector"]["matchLabels"]["app"],
        pod["metadata"]["labels"]["app"]
    );
    let containers = seq(&pod["spec"]["containers"], "containers");
    let envoy = &containers[0];

    // The image and arguments compose runs.
    let compose = compose::file();
    let compose_envoy = compose::service(&compose, "envoy");
    assert_eq!(envoy["image"], compose_envoy["image"]);
    assert_eq!(
        strings(&envoy["args"], "args"),
        strings(&compose_envoy["command"], "command")
    );

    // Every mount is a generated ConfigMap holding the files Envoy reads there.
    let volumes: BTreeMap<String, String> = seq(&pod["spec"]["volumes"], "volumes")
        .iter()
        .map(|v| {
            (
                s(&v["name"], "volume").to_string(),
                s(&v["configMap"]["name"], "configMap").to_string(),
            )
        })
        .collect();
    let mut mounted_files = BTreeSet::new();
    for mount in seq(&envoy["volumeMounts"], "volumeMounts") {
        let config_map = &volumes[s(&mount["name"], "mount name")];
        let files = generated
            .get(config_map)
            .unwrap_or_else(|| panic!("{config_map} is not generated by kustomization.yaml"));
        for file in files {
            assert!(
                root().join(kube::DIR).join(file).is_file() || file.ends_with(".wasm"),
                "{file} missing"
            );
            mounted_files.insert(format!("{}/{file}", s(&mount["mountPath"], "mountPath")));
        }
    }
    let args = strings(&envoy["args"], "args");
    let config_path = &args[args.iter().position(|a| a == "-c").expect("no -c") + 1];
    assert!(
        mounted_files.contains(config_path),
        "{config_path} not in {mounted_files:?}"
    );
    let plugin = &wasm_filter(&config)["typed_config"]["config"];
    let wasm_path = s(
        &plugin["vm_config"]["code"]["local"]["filename"],
        "wasm filename",
    );
    assert!(
        mounted_files.contains(wasm_path),
        "{wasm_path} not in {mounted_files:?}"
    );

    // Ports: the listener and admin are the container's, probes use admin, the
    // Service targets the listener.
    let ports: BTreeMap<String, u16> = seq(&envoy["ports"], "ports")
        .iter()
        .map(|p| {
            (
                s(&p["name"], "port name").to_string(),
                p["containerPort"].as_u64().unwrap() as u16,
            )
        })
        .collect();
    let listener = port(
        &config["static_resources"]["listeners"][0]["address"]["socket_address"],
        "listener",
    );
    let admin = port(&config["admin"]["address"]["socket_address"], "admin");
    assert_eq!(ports["http"], listener);
    assert_eq!(ports["admin"], admin);
    assert_eq!(envoy["readinessProbe"]["httpGet"]["port"], "admin");
    let annotations = &pod["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/port"], admin.to_string());
    assert_eq!(annotations["prometheus.io/path"], "/stats/prometheus");
    let service = kube::get(&resources, "Service", "prefix-router");
    assert_eq!(
        service["spec"]["selector"]["app"],
        pod["metadata"]["labels"]["app"]
    );
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "http");
    assert!(
        !seq(&service["spec"]["ports"], "ports")
            .iter()
            .any(|p| p["targetPort"] == "admin"),
        "the Service must not expose Envoy's admin"
    );

    // Envoy's clusters resolve the headless Service, on its port.
    let headless = kube::get(&resources, "Service", "vllm-headless");
    assert_eq!(headless["spec"]["clusterIP"], "None");
    let headless_port = headless["spec"]["ports"][0]["port"].as_u64().unwrap() as u16;
    let mut config = config;
    for cluster in clusters_mut(&mut config) {
        assert_eq!(cluster["type"], "STRICT_DNS");
        assert_eq!(
            endpoints(&cluster["load_assignment"]),
            [(
                format!(
                    "{}.default.svc.cluster.local",
                    s(&headless["metadata"]["name"], "name")
                ),
                headless_port
            )]
        );
    }
}

// ---------------------------------------------------------------------------
// Plain Envoy with file-based EDS
// ---------------------------------------------------------------------------

#[test]
fn eds_example_differs_from_envoy_yaml_only_in_where_endpoints_come_from() {
    let mut eds = yaml("examples/envoy-eds/envoy.yaml");
    let mut shipped = yaml("envoy/envoy.yaml");
    for config in [&mut eds, &mut shipped] {
        for cluster in clusters_mut(config) {
            remove(cluster, &["type"]);
        }
    }
    for cluster in clusters_mut(&mut eds) {
        remove(cluster, &["eds_cluster_config"]);
    }
    for cluster in clusters_mut(&mut shipped) {
        remove(cluster, &["load_assignment"]);
    }
    assert_no_drift(
        &eds,
        &shipped,
        "examples/envoy-eds/envoy.yaml",
        "the EDS cluster",
    );
}

#[test]
fn eds_example_passes_envoy_validate() {
    let mut config = yaml("examples/envoy-eds/envoy.yaml");
    set_wasm_filename(&mut config, &built_wasm());
    assert_envoy_accepts(&config, "examples/envoy-eds/envoy.yaml");
    let endpoints_file = yaml("examples/envoy-eds/endpoints.yaml");
    let assignment = &endpoints_file["resources"][0];
    assert_eq!(
        assignment["@type"],
        "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
    );
    for cluster in seq(&config["static_resources"]["clusters"], "clusters") {
        assert_eq!(
            assignment["cluster_name"], cluster["eds_cluster_config"]["service_name"],
            "every cluster must read the file's assignment"
        );
    }
    assert_eq!(endpoints(assignment).len(), 3);
}

/// Writes the example's endpoints file listing `addrs` into `dir`, atomically
/// (write then rename), as the example tells users to.
fn write_endpoints(dir: &Path, addrs: &[SocketAddr], version: u32) {
    let mut file = yaml("examples/envoy-eds/endpoints.yaml");
    file["version_info"] = Value::String(version.to_string());
    let lb: Vec<Value> = addrs
        .iter()
        .map(|a| {
            serde_yaml::from_str(&format!(
                "endpoint: {{ address: {{ socket_address: {{ address: '{}', port_value: {} }} }} }}",
                a.ip(),
                a.port()
            ))
            .unwrap()
        })
        .collect();
    file["resources"][0]["endpoints"][0]["lb_endpoints"] = Value::Sequence(lb);
    let tmp = dir.join("endpoints.yaml.new");
    std::fs::write(&tmp, serde_yaml::to_string(&file).unwrap()).unwrap();
    std::fs::rename(&tmp, dir.join("endpoints.yaml")).unwrap();
}

/// Hosts of the `vllm` cluster as Envoy currently has them (admin /clusters).
fn cluster_hosts(envoy: &Envoy) -> BTreeSet<String> {
    envoy
        .admin_get("/clusters")
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("vllm::"))
        .filter_map(|l| {
            l.split_once("::health_flags::")
                .map(|(addr, _)| addr.to_string())
        })
        .collect()
}

fn wait_for_hosts(envoy: &Envoy, want: &BTreeSet<String>) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let hosts = cluster_hosts(envoy);
        if &hosts == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "cluster hosts {hosts:?}, expected {want:?}\n{}",
            envoy.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends `count` invoke requests with distinct prefixes; returns the instances that served.
fn spread_requests(envoy: &Envoy, count: usize, salt: &str) -> BTreeMap<String, usize> {
    let mut served = BTreeMap::new();
    for i in 0..count {
        let body = format!("{salt} prompt number {i}: {}", "context ".repeat(20));
        *served
            .entry(post(envoy, "/invocations", &[], body.as_bytes()))
            .or_insert(0) += 1;
    }
    served
}

#[test]
fn eds_example_loads_endpoints_from_the_file_and_follows_updates() {
    let fleet = UpstreamFleet::start(3).unwrap();
    let addrs = fleet.addrs();
    let dir = tempfile::tempdir().unwrap();
    write_endpoints(dir.path(), &addrs, 1);
    let dir_path = dir.path().to_string_lossy().into_owned();
    let envoy = Envoy::builder()
        .config_file(root().join("examples/envoy-eds/envoy.yaml"))
        .edit(move |config| {
            for cluster in clusters_mut(config) {
                let source = &mut cluster["eds_cluster_config"]["eds_config"]["path_config_source"];
                source["path"] = Value::String(format!("{dir_path}/endpoints.yaml"));
                source["watched_directory"]["path"] = Value::String(dir_path.clone());
            }
            Ok(())
        })
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    let all: BTreeSet<String> = addrs.iter().map(ToString::to_string).collect();
    wait_for_hosts(&envoy, &all);
    let served = spread_requests(&envoy, 30, "first");
    assert_eq!(served.len(), 3, "30 prefixes reached only {served:?}");

    // Scale down by replacing the file: no restart, the removed instance gets nothing.
    write_endpoints(dir.path(), &addrs[..2], 2);
    let kept: BTreeSet<String> = addrs[..2].iter().map(ToString::to_string).collect();
    wait_for_hosts(&envoy, &kept);
    fleet.clear();
    let served = spread_requests(&envoy, 30, "second");
    let kept_names: BTreeSet<String> = fleet.names()[..2].iter().cloned().collect();
    assert_eq!(
        served.keys().cloned().collect::<BTreeSet<_>>(),
        kept_names,
        "{served:?}"
    );

    // The filter's stats are scraped under the names the dashboards use.
    let scraped = envoy.prometheus().unwrap();
    for name in dashboard_metric_names() {
        assert!(
            scraped.lines().any(|l| l.starts_with(&name)),
            "{name} (used in examples/prometheus) is not in Envoy's /stats/prometheus:\n{}",
            scraped
                .lines()
                .filter(|l| l.contains("prefix_router"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

// ---------------------------------------------------------------------------
// Metrics documentation and dashboards
// ---------------------------------------------------------------------------

/// The filter's metric names used in the PromQL snippet and the Grafana dashboard.
fn dashboard_metric_names() -> BTreeSet<String> {
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

/// Prometheus's `promtool` (`cargo xtask test` provides it in PROMTOOL).
fn promtool() -> PathBuf {
    match std::env::var_os("PROMTOOL").filter(|v| !v.is_empty()) {
        Some(path) => PathBuf::from(path),
        None => PathBuf::from("promtool"),
    }
}

/// Runs `promtool` in `examples/prometheus/`; panics with its output unless it succeeds.
fn run_promtool(args: &[&str]) {
    run_check(
        Command::new(promtool())
            .args(args)
            .current_dir(root().join("examples/prometheus")),
        "run the tests with `cargo xtask test`, which fetches it, or put Prometheus's \
         promtool on PATH or in PROMTOOL",
    );
}

/// Runs a checking tool; panics with its output unless it succeeds, and with
/// `install_hint` too, in case the tool (or a module it loads) is missing.
fn run_check(command: &mut Command, install_hint: &str) {
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

#[test]
fn prometheus_configuration_and_alerts_pass_promtool_and_their_unit_tests() {
    // The scrape configuration, with the rule files it loads.
    run_promtool(&["check", "config", "prometheus.yml"]);
    run_promtool(&["check", "rules", "alerts.yml"]);
    // Each alert fires on the series that should fire it, and only then.
    run_promtool(&["test", "rules", "alerts.test.yml"]);
}

/// `prefix_router.requests_keyed.invoke` -> `prefix_router_requests_keyed_invoke`.
fn prometheus_name(stat: &str) -> String {
    stat.replace('.', "_")
}

#[test]
fn metrics_doc_and_dashboards_name_every_stat_the_filter_defines() {
    let doc = read("docs/metrics.md");
    let mut defined: Vec<String> = prefix_router::metrics::Counter::ALL
        .iter()
        .map(|c| c.name().to_string())
        .collect();
    defined.push(prefix_router::metrics::BYTES_INSPECTED.to_string());
    // Decision counters are documented once, as `prefix_router.decision.<kind>`
    // with every kind listed.
    for kind in prefix_router::metrics::DECISION_KINDS {
        assert!(
            doc.contains(&format!("`{}`", kind.as_str())),
            "docs/metrics.md does not list the decision kind {}",
            kind.as_str()
        );
    }
    assert!(doc.contains("`prefix_router.decision.<kind>`"));
    assert!(doc.contains("`prefix_router_decision_<kind>`"));
    for stat in &defined {
        assert!(
            doc.contains(&format!("`{stat}`")),
            "docs/metrics.md does not document {stat}"
        );
        assert!(
            doc.contains(&prometheus_name(stat)),
            "docs/metrics.md lacks the Prometheus name of {stat}"
        );
    }
    let decisions = prefix_router::metrics::DECISION_KINDS
        .iter()
        .map(|k| prefix_router::metrics::decision_counter_name(*k));
    let known: BTreeSet<String> = defined
        .iter()
        .cloned()
        .chain(decisions)
        .map(|s| prometheus_name(&s))
        .collect();
    // Envoy's own stats about the plugin (`envoy_wasm_<plugin>_vm_reload`) are
    // checked against a real scrape only.
    for name in dashboard_metric_names()
        .into_iter()
        .filter(|name| !name.starts_with("envoy_"))
    {
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .unwrap_or(&name);
        assert!(
            known.contains(base),
            "dashboards use {name}, which the filter does not define"
        );
    }
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("examples/prometheus/grafana-dashboard.json"))
            .expect("dashboard JSON");
    let exprs: Vec<&str> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter_map(|t| t["expr"].as_str())
        .collect();
    assert!(
        exprs
            .iter()
            .any(|e| e.contains("vllm:prefix_cache_hits_total")),
        "{exprs:?}"
    );
    assert!(
        exprs.iter().any(|e| e.contains("prefix_router_")),
        "{exprs:?}"
    );
}

// ---------------------------------------------------------------------------
// Real clients: the OpenAI Python SDK and curl
// ---------------------------------------------------------------------------

/// Minimal OpenAI-compatible instances: chat (plain and SSE) and completions,
/// `x-served-by`, and the routing key they received echoed back as
/// `x-received-route-key`, so the client can see it.
///
/// Kept next to `openai_sdk_through_envoy_to_vllm_sim` because it echoes the
/// key, which vllm-sim does not.
struct OpenAiFleet {
    runtime: Option<tokio::runtime::Runtime>,
    addrs: Vec<SocketAddr>,
    names: Vec<String>,
    received: Arc<Mutex<Vec<(String, String)>>>,
}

impl OpenAiFleet {
    fn start(count: usize) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let received = Arc::new(Mutex::new(Vec::new()));
        let mut addrs = Vec::new();
        let mut names = Vec::new();
        for i in 1..=count {
            let name = format!("instance-{i}");
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.set_nonblocking(true).unwrap();
            addrs.push(listener.local_addr().unwrap());
            runtime.spawn(serve_openai(listener, name.clone(), Arc::clone(&received)));
            names.push(name);
        }
        OpenAiFleet {
            runtime: Some(runtime),
            addrs,
            names,
            received,
        }
    }

    /// (instance, path) of every request received.
    fn received(&self) -> Vec<(String, String)> {
        self.received.lock().unwrap().clone()
    }
}

impl Drop for OpenAiFleet {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn serve_openai(
    listener: std::net::TcpListener,
    name: String,
    received: Arc<Mutex<Vec<(String, String)>>>,
) {
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let name = name.clone();
        let received = Arc::clone(&received);
        tokio::spawn(async move {
            let service =
                service_fn(move |req| answer_openai(req, name.clone(), Arc::clone(&received)));
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn answer_openai(
    req: Request<Incoming>,
    name: String,
    received: Arc<Mutex<Vec<(String, String)>>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path().to_string();
    let key = req
        .headers()
        .get(KEY_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    received.lock().unwrap().push((name.clone(), path.clone()));
    let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or(json!({}));
    let model = request["model"].as_str().unwrap_or("unknown").to_string();
    let text = format!("served by {name}");
    let (content_type, payload) = if path.ends_with("/chat/completions")
        && request["stream"] == true
    {
        let mut sse = String::new();
        for (i, piece) in ["served ", "by ", name.as_str()].iter().enumerate() {
            let delta = if i == 0 {
                json!({"role": "assistant", "content": piece})
            } else {
                json!({"content": piece})
            };
            let chunk = json!({"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": null}]});
            sse.push_str(&format!("data: {chunk}\n\n"));
        }
        let last = json!({"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
        sse.push_str(&format!("data: {last}\n\ndata: [DONE]\n\n"));
        ("text/event-stream", sse)
    } else if path.ends_with("/chat/completions") {
        ("application/json", json!({"id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}).to_string())
    } else if path.ends_with("/completions") {
        (
            "application/json",
            json!({"id": "cmpl-test", "object": "text_completion", "created": 0, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": null}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}})
            .to_string(),
        )
    } else {
        ("application/json", json!({"served_by": name}).to_string())
    };
    let response = Response::builder()
        .header("content-type", content_type)
        .header("x-served-by", &name)
        .header("x-received-route-key", key)
        .body(Full::new(Bytes::from(payload)))
        .unwrap();
    Ok(response)
}

/// Envoy (envoy/envoy.yaml, the built filter) in front of three OpenAI instances.
fn openai_setup() -> (OpenAiFleet, Envoy) {
    let fleet = OpenAiFleet::start(3);
    let envoy = Envoy::builder()
        .upstreams(fleet.addrs.clone())
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    (fleet, envoy)
}

const SDK_INSTALL_HINT: &str =
    "install the OpenAI Python SDK: `python3 -m pip install openai` (cargo xtask test does this)";

/// Runs `python3 <script>` with `stdin`, bounded in time; returns stdout.
fn run_python(script: &str, stdin: &str, env: &[(&str, String)]) -> String {
    let probe = Command::new("python3")
        .args(["-c", "import openai"])
        .output();
    match probe {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!(
            "{SDK_INSTALL_HINT}\n{}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => panic!("python3 not found ({e}); {SDK_INSTALL_HINT}"),
    }
    let mut child = Command::new("python3")
        .arg(root().join(script))
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let stdout = drain(child.stdout.take().unwrap());
    let stderr = drain(child.stderr.take().unwrap());
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{script} did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = stdout.recv().unwrap_or_default();
    assert!(
        status.success(),
        "{script} failed ({status}):\n{}\n{stdout}",
        stderr.recv().unwrap_or_default()
    );
    stdout
}

/// Reads a pipe to its end on a thread (so a full pipe never blocks the child).
fn drain(mut pipe: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        let _ = tx.send(text);
    });
    rx
}

/// One request of a plan for tests/python/openai_client.py.
fn chat(
    id: &str,
    api: &str,
    messages: &serde_json::Value,
    cache_key: Option<&str>,
) -> serde_json::Value {
    json!({"id": id, "api": api, "messages": messages, "prompt_cache_key": cache_key, "max_tokens": 8})
}

/// Runs a plan through the SDK; returns the results by id.
fn run_sdk(envoy: &Envoy, requests: Vec<serde_json::Value>) -> BTreeMap<String, SdkResult> {
    let plan = json!({"base_url": format!("{}/v1", envoy.base_url()), "model": "Qwen/Qwen2.5-0.5B-Instruct", "requests": requests});
    let stdout = run_python("tests/python/openai_client.py", &plan.to_string(), &[]);
    let output: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    output["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let result = SdkResult {
                served_by: r["served_by"].as_str().expect("x-served-by").to_string(),
                route_key: r["route_key"].as_str().unwrap_or("").to_string(),
                text: r["text"].as_str().unwrap_or("").to_string(),
                chunks: r["chunks"].as_u64().unwrap_or(0),
            };
            assert!(
                result.route_key.len() == 16
                    && result
                        .route_key
                        .bytes()
                        .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
                "request {} reached the instance without a 16-hex-digit key: {:?}",
                r["id"],
                result.route_key
            );
            assert_eq!(
                result.text,
                format!("served by {}", result.served_by),
                "the SDK parsed another body"
            );
            (r["id"].as_str().unwrap().to_string(), result)
        })
        .collect()
}

#[derive(Debug)]
struct SdkResult {
    served_by: String,
    route_key: String,
    text: String,
    chunks: u64,
}

/// A conversation whose shared beginning (system prompt) is longer than the
/// default `prefix_length` (4,096): only then do later turns share the key.
fn long_conversation(turns: usize) -> serde_json::Value {
    let system = format!(
        "You are the support assistant of ACME. Policy manual follows. {}",
        "Section: be accurate, be brief, cite the manual. ".repeat(100)
    );
    assert!(system.len() > 4096);
    let mut messages = vec![json!({"role": "system", "content": system})];
    for turn in 0..turns {
        messages.push(json!({"role": "user", "content": format!("Question {turn}: how do I reset my password?")}));
        if turn + 1 < turns {
            messages.push(json!({"role": "assistant", "content": format!("Answer {turn}: use the reset link.")}));
        }
    }
    serde_json::Value::Array(messages)
}

#[test]
fn openai_sdk_conversations_stick_to_one_instance_through_envoy() {
    let (fleet, envoy) = openai_setup();
    let short = json!([{"role": "user", "content": "Say hello."}]);
    let mut plan = Vec::new();
    for i in 0..3 {
        plan.push(chat(
            &format!("repeat-{i}"),
            "chat",
            &short,
            Some("tenant-a"),
        ));
    }
    for i in 0..2 {
        plan.push(chat(
            &format!("stream-{i}"),
            "chat_stream",
            &short,
            Some("tenant-a"),
        ));
    }
    for turns in 1..=4 {
        plan.push(chat(
            &format!("turn-{turns}"),
            "chat",
            &long_conversation(turns),
            Some("tenant-a"),
        ));
    }
    for i in 0..3 {
        plan.push(json!({"id": format!("completion-{i}"), "api": "completions", "prompt": "Once upon a time", "max_tokens": 8}));
    }
    for i in 0..12 {
        plan.push(chat(
            &format!("spread-{i}"),
            "chat",
            &json!([{"role": "user", "content": format!("Topic number {i}: tell me something.")}]),
            None,
        ));
    }
    let results = run_sdk(&envoy, plan);

    let group = |prefix: &str| -> Vec<&SdkResult> {
        results
            .iter()
            .filter(|(id, _)| id.starts_with(prefix))
            .map(|(_, r)| r)
            .collect()
    };
    for prefix in ["repeat-", "stream-", "turn-", "completion-"] {
        let members = group(prefix);
        assert!(members.len() >= 2, "{prefix}");
        let keys: BTreeSet<&str> = members.iter().map(|r| r.route_key.as_str()).collect();
        let instances: BTreeSet<&str> = members.iter().map(|r| r.served_by.as_str()).collect();
        assert_eq!(
            keys.len(),
            1,
            "{prefix}*: one conversation got several keys: {members:?}"
        );
        assert_eq!(
            instances.len(),
            1,
            "{prefix}*: one conversation went to several instances: {members:?}"
        );
    }
    assert!(
        group("stream-").iter().all(|r| r.chunks >= 3),
        "the SDK did not read an SSE stream"
    );
    let spread = group("spread-");
    let keys: BTreeSet<&str> = spread.iter().map(|r| r.route_key.as_str()).collect();
    let instances: BTreeSet<&str> = spread.iter().map(|r| r.served_by.as_str()).collect();
    assert_eq!(keys.len(), 12, "12 different prompts must get 12 keys");
    assert!(
        instances.len() >= 2,
        "12 different prompts all went to {instances:?}"
    );
    // What the SDK saw is what the instances recorded.
    let recorded = fleet.received();
    assert_eq!(recorded.len(), results.len());
    assert!(recorded.iter().any(|(_, path)| path == "/v1/completions"));
    assert!(recorded.iter().all(|(name, _)| fleet.names.contains(name)));
}

/// prompt_cache_key (through extra_body) separates tenants even when the
/// prompt is identical, and the `stream` flag is not part of the key. Both
/// need the OpenAI JSON extractor (canonical text + body tenant), not the
/// raw-byte placeholder: with the placeholder, a prefix longer than
/// `prefix_length` never reaches prompt_cache_key at the end of the body.
#[test]
fn openai_sdk_prompt_cache_key_separates_tenants_and_stream_flag_does_not() {
    let (_fleet, envoy) = openai_setup();
    let conversation = long_conversation(2);
    let mut plan = vec![
        chat("plain", "chat", &conversation, Some("tenant-0")),
        chat("streamed", "chat_stream", &conversation, Some("tenant-0")),
    ];
    for i in 0..12 {
        plan.push(chat(
            &format!("tenant-{i}"),
            "chat",
            &conversation,
            Some(&format!("tenant-{i}")),
        ));
    }
    let results = run_sdk(&envoy, plan);
    assert_eq!(
        results["plain"].route_key, results["streamed"].route_key,
        "streaming changed the key of the same conversation"
    );
    assert_eq!(results["plain"].route_key, results["tenant-0"].route_key);
    let tenants: Vec<&SdkResult> = (0..12).map(|i| &results[&format!("tenant-{i}")]).collect();
    let keys: BTreeSet<&str> = tenants.iter().map(|r| r.route_key.as_str()).collect();
    let instances: BTreeSet<&str> = tenants.iter().map(|r| r.served_by.as_str()).collect();
    assert_eq!(
        keys.len(),
        12,
        "12 prompt_cache_keys gave {} keys",
        keys.len()
    );
    assert!(instances.len() >= 2, "12 tenants all went to {instances:?}");
}

#[test]
fn client_examples_run_as_documented() {
    let (fleet, envoy) = openai_setup();
    let out = run_python(
        "examples/clients/openai_chat.py",
        "",
        &[("OPENAI_BASE_URL", format!("{}/v1", envoy.base_url()))],
    );
    let served: Vec<&str> = out
        .lines()
        .filter_map(|l| l.strip_prefix("served by "))
        .collect();
    assert_eq!(served.len(), 2, "{out}");
    let instance = |line: &str| line.split([' ', ':']).next().unwrap_or("").to_string();
    assert_eq!(
        instance(served[0]),
        instance(served[1]),
        "the example's two turns went to two instances:\n{out}"
    );
    assert!(fleet.names.contains(&instance(served[0])), "{out}");

    let output = Command::new("bash")
        .arg(root().join("examples/clients/invoke.sh"))
        .env("PREFIX_ROUTER_URL", envoy.base_url())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "invoke.sh failed: {}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].starts_with("tenant tenant-a: HTTP 200, served by instance-"),
        "{stdout}"
    );
    assert_eq!(
        lines[0].replace("tenant-a", ""),
        lines[1].replace("tenant-a", ""),
        "same tenant, same body, another instance:\n{stdout}"
    );
    assert!(
        stdout.contains("\"invalid_tenant_header\"") && stdout.contains(TENANT_HEADER),
        "{stdout}"
    );
    assert!(stdout.trim_end().ends_with("HTTP 400"), "{stdout}");
    let invokes = fleet
        .received()
        .iter()
        .filter(|(_, p)| p == "/invocations")
        .count();
    assert_eq!(
        invokes, 3,
        "the rejected request must not reach an instance"
    );
}

/// The access-log snippet in docs/troubleshooting.md is accepted by Envoy
/// where the page says to put it.
#[test]
fn troubleshooting_access_log_snippet_passes_envoy_validate() {
    let doc = read("docs/troubleshooting.md");
    let start = doc.find("```yaml\n").expect("no yaml block") + "```yaml\n".len();
    let end = start + doc[start..].find("```").unwrap();
    let snippet: Value = serde_yaml::from_str(&doc[start..end]).expect("snippet is not YAML");
    assert!(doc[start..end].contains("%REQ(X-PREFIX-ROUTE-KEY)%"));
    let mut config = yaml("envoy/envoy.yaml");
    set_wasm_filename(&mut config, &built_wasm());
    let hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]
        .as_mapping_mut()
        .unwrap();
    for (k, v) in snippet.as_mapping().unwrap() {
        hcm.insert(k.clone(), v.clone());
    }
    assert_envoy_accepts(&config, "envoy/envoy.yaml with the access-log snippet");
}

/// The same SDK run against the project's simulated vLLM (`vllm-sim`'s
/// server, in process): the API shapes a real vLLM answers with, streaming
/// included. vllm-sim does not echo the key, so this checks instances only.
#[test]
fn openai_sdk_through_envoy_to_vllm_sim() {
    use prefix_router_tools::sim::{SimConfig, SimServer};
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let servers: Vec<SimServer> = (1..=3)
        .map(|i| {
            let cfg = SimConfig {
                name: format!("vllm-{i}"),
                model: "Qwen/Qwen2.5-0.5B-Instruct".to_string(),
                time_scale: 10.0,
                ..SimConfig::default()
            };
            runtime
                .block_on(SimServer::start(cfg, "127.0.0.1:0".parse().unwrap()))
                .unwrap()
        })
        .collect();
    let envoy = Envoy::builder()
        .upstreams(servers.iter().map(SimServer::addr))
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    let conversation = long_conversation(2);
    let mut plan = Vec::new();
    for i in 0..2 {
        plan.push(chat(
            &format!("plain-{i}"),
            "chat",
            &conversation,
            Some("t"),
        ));
        plan.push(chat(
            &format!("stream-{i}"),
            "chat_stream",
            &conversation,
            Some("t"),
        ));
        plan.push(
            json!({"id": format!("completion-{i}"), "api": "completions",
            "prompt": "Once upon a time", "max_tokens": 8}),
        );
    }
    for i in 0..12 {
        plan.push(chat(
            &format!("tenant-{i}"),
            "chat",
            &conversation,
            Some(&format!("tenant-{i}")),
        ));
    }
    let stdout = run_python(
        "tests/python/openai_client.py",
        &json!({"base_url": format!("{}/v1", envoy.base_url()),
            "model": "Qwen/Qwen2.5-0.5B-Instruct", "requests": plan})
        .to_string(),
        &[],
    );
    let output: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let served: BTreeMap<String, String> = output["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            assert!(
                r["chunks"].as_u64().unwrap_or(0) >= 1 && r["text"].is_string(),
                "{r}"
            );
            (
                r["id"].as_str().unwrap().to_string(),
                r["served_by"]
                    .as_str()
                    .expect("vllm-sim sends x-served-by")
                    .to_string(),
            )
        })
        .collect();
    let conversation_instances: BTreeSet<&String> = served
        .iter()
        .filter(|(id, _)| id.starts_with("plain-") || id.starts_with("stream-"))
        .map(|(_, s)| s)
        .collect();
    assert_eq!(
        conversation_instances.len(),
        1,
        "one conversation, several instances: {served:?}"
    );
    assert_eq!(served["completion-0"], served["completion-1"]);
    let tenants: BTreeSet<&String> = (0..12).map(|i| &served[&format!("tenant-{i}")]).collect();
    assert!(tenants.len() >= 2, "12 tenants all went to {tenants:?}");
    drop(envoy);
    drop(servers);
    runtime.shutdown_background();
}
