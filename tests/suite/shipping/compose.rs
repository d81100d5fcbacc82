//! docker-compose.yml works as shipped: Envoy, three vLLM instances (or
//! their CPU stand-in, vllm-sim) and Prometheus, every file and build context
//! it references, and the Envoy configuration it mounts, which must pass
//! `envoy --mode validate` and differ from `envoy/envoy.yaml` only where
//! containers need it. No Docker engine runs here, so the file is checked as
//! a file.
//!
//! Envoy comes from `ENVOY_BIN` or PATH; the filter from `PREFIX_ROUTER_WASM`
//! or the release build (`cargo xtask test` provides both).

mod support;

use std::collections::{BTreeMap, BTreeSet};

use prefix_router_tools::envoy;
use serde_yaml::Value;

use support::*;

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
        for flag in ["--enable-prefix-caching", "--enable-prompt-tokens-details"] {
            assert!(args.iter().any(|a| a == flag), "{name}: {flag}: {args:?}");
        }
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
        assert!(
            args.iter().any(|a| a == "--enable-prompt-tokens-details"),
            "{name}: cached_tokens in the usage: {args:?}"
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
    // The binary copied is the one built: cargo writes a profile's output
    // under its name (`release` for --release).
    let profile = dockerfile
        .split_whitespace()
        .skip_while(|word| *word != "--profile")
        .nth(1)
        .unwrap_or(if dockerfile.contains(" --release ") {
            "release"
        } else {
            "debug"
        });
    assert!(
        dockerfile.contains(&format!(
            "COPY --from=build /src/target/{profile}/vllm-sim /usr/local/bin/vllm-sim"
        )),
        "the image copies another profile's vllm-sim than the {profile} one it builds"
    );
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
        if cluster["name"] == "envoy_admin" {
            // `discovery` reads the fleet from Envoy's own admin on loopback.
            assert_eq!(
                endpoints(&cluster["load_assignment"]),
                [("127.0.0.1".to_string(), admin)],
                "envoy_admin must lead to this Envoy's admin"
            );
            continue;
        }
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

/// Grafana (profile `metrics`) reads the compose file's Prometheus and shows
/// the shipped dashboard as its home page: the data source's URL is the
/// Prometheus service and port, the provisioned folder and the home page are
/// where the dashboard is mounted, and Grafana is published on loopback only.
#[test]
fn grafana_shows_the_dashboard_over_the_compose_prometheus() {
    let compose = compose::file();
    let grafana = compose::service(&compose, "grafana");
    assert_eq!(compose::profiles(grafana), ["metrics"]);
    let ports = strings(&grafana["ports"], "grafana ports");
    assert_eq!(ports, ["127.0.0.1:3000:3000"], "published beyond loopback?");
    let mounted: BTreeMap<String, String> = compose::binds(grafana)
        .into_iter()
        .map(|(source, target, _)| (target, source.trim_start_matches("./").to_string()))
        .collect();
    let source_of = |target_dir: &str| -> Vec<&String> {
        mounted
            .iter()
            .filter(|(target, _)| target.rsplit_once('/').map(|(dir, _)| dir) == Some(target_dir))
            .map(|(_, source)| source)
            .collect()
    };

    let datasources = source_of("/etc/grafana/provisioning/datasources");
    assert_eq!(datasources.len(), 1, "{mounted:?}");
    let datasources = yaml(datasources[0]);
    let datasource = &seq(&datasources["datasources"], "datasources")[0];
    assert_eq!(datasource["type"], "prometheus");
    assert_eq!(datasource["isDefault"], true);
    let url = s(&datasource["url"], "url");
    let prometheus_port =
        compose::published_container_ports(compose::service(&compose, "prometheus"));
    let (host, port) = url
        .strip_prefix("http://")
        .and_then(|rest| rest.split_once(':'))
        .unwrap_or_else(|| panic!("{url} is not http://host:port"));
    assert!(
        compose::dns_names("prometheus", compose::service(&compose, "prometheus"))
            .iter()
            .any(|name| name == host),
        "{url} is not the prometheus service"
    );
    assert!(
        prometheus_port.contains(&port.parse::<u16>().unwrap()),
        "{url}: Prometheus listens on {prometheus_port:?}"
    );

    let providers = source_of("/etc/grafana/provisioning/dashboards");
    assert_eq!(providers.len(), 1, "{mounted:?}");
    let providers = yaml(providers[0]);
    let provider = &seq(&providers["providers"], "providers")[0];
    let folder = s(&provider["options"]["path"], "dashboards path");
    assert_eq!(
        source_of(folder),
        ["examples/prometheus/grafana-dashboard.json"],
        "the dashboard is not in {folder}"
    );
    let home = s(
        &grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"],
        "home dashboard",
    );
    assert_eq!(
        mounted.get(home).map(String::as_str),
        Some("examples/prometheus/grafana-dashboard.json"),
        "the home page {home} is not the dashboard"
    );
}
