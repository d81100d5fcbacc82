//! Envoy with file-based EDS (`examples/envoy-eds/`): it differs from
//! `envoy/envoy.yaml` only in where endpoints come from (and the filter reads
//! them from Envoy's admin), passes validation, and a real Envoy started
//! from it, filter included, follows updates of the endpoints file.
//!
//! Envoy comes from `ENVOY_BIN` or PATH; the filter from `PREFIX_ROUTER_WASM`
//! or the release build (`cargo xtask test` provides both).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use prefix_router_tools::envoy::Envoy;
use prefix_router_tools::upstream::UpstreamFleet;
use serde_yaml::Value;

use support::*;

#[test]
fn eds_example_differs_from_envoy_yaml_only_in_where_endpoints_come_from() {
    let mut eds = yaml("examples/envoy-eds/envoy.yaml");
    // The filter reads the fleet EDS delivers from Envoy's admin.
    remove_discovery(&mut eds);
    let mut shipped = yaml("envoy/envoy.yaml");
    // EDS delivers the endpoints; a static `instances` list would go stale.
    remove_configured_fleet(&mut shipped);
    remove_engine_metrics_cluster(&mut shipped);
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
        if cluster["name"] == "envoy_admin" {
            assert_admin_cluster(cluster, 9901, "the EDS example's admin cluster");
            continue;
        }
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
    wait_until(
        Duration::from_secs(15),
        || cluster_hosts(envoy),
        |hosts| hosts == want,
        |hosts| {
            format!(
                "cluster hosts {hosts:?}, expected {want:?}\n{}",
                envoy.log()
            )
        },
    );
}

/// Waits until the filter's fleet, read from Envoy's admin (`discovery`),
/// has `count` instances.
fn wait_for_discovered(envoy: &Envoy, count: u64) {
    wait_until(
        Duration::from_secs(15),
        || {
            envoy
                .stat("wasmcustom.prefix_router.discovery.instances")
                .unwrap()
        },
        |discovered| *discovered == Some(count),
        |discovered| format!("the filter discovered {discovered:?} instances, not {count}"),
    );
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
                if cluster["name"] == "envoy_admin" {
                    continue;
                }
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
    wait_for_discovered(&envoy, 3);
    let served = spread_requests(&envoy, 30, "first");
    assert_eq!(served.len(), 3, "30 prefixes reached only {served:?}");

    // Scale down by replacing the file: no restart, the removed instance gets nothing.
    write_endpoints(dir.path(), &addrs[..2], 2);
    let kept: BTreeSet<String> = addrs[..2].iter().map(ToString::to_string).collect();
    wait_for_hosts(&envoy, &kept);
    wait_for_discovered(&envoy, 2);
    fleet.clear();
    let served = spread_requests(&envoy, 30, "second");
    let kept_names: BTreeSet<String> = fleet.names()[..2].iter().cloned().collect();
    assert_eq!(
        served.keys().cloned().collect::<BTreeSet<_>>(),
        kept_names,
        "{served:?}"
    );

    // The filter's stats are scraped under the names the dashboards use
    // (the per-instance gauges are defined on the filter's 1 s tick).
    let names = dashboard_metric_names();
    let missing = |scraped: &str| -> Vec<String> {
        names
            .iter()
            .filter(|name| !scraped.lines().any(|l| l.starts_with(name.as_str())))
            .cloned()
            .collect()
    };
    wait_until(
        Duration::from_secs(10),
        || envoy.prometheus().unwrap(),
        |scraped| missing(scraped).is_empty(),
        |scraped| {
            format!(
                "{:?} (used in examples/prometheus) not in Envoy's /stats/prometheus:\n{}",
                missing(scraped),
                scraped
                    .lines()
                    .filter(|l| l.contains("prefix_router"))
                    .collect::<Vec<_>>()
                    .join("\n")
            )
        },
    );
}
