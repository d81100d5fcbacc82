//! Adapts a user-facing Envoy configuration for a run on loopback: ephemeral
//! ports, the run's upstream addresses, the .wasm and plugin configuration to
//! use, or no filter at all. Fails loudly when the file is not shaped as
//! expected, so a change to `envoy/envoy.yaml` cannot silently escape the tests.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail};
use serde_yaml::{Mapping, Value};

/// The `@type` of Envoy's wasm HTTP filter configuration.
pub const WASM_FILTER_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";

const HCM_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";

/// Whether the run keeps the wasm filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterMode {
    With,
    /// Plain Envoy: the wasm filter entries are removed (overhead baselines,
    /// harness checks).
    Without,
}

pub(super) struct StandardEdits<'a> {
    pub filter: FilterMode,
    pub wasm: Option<&'a Path>,
    pub plugin_config: Option<&'a str>,
    pub upstreams: Option<&'a [SocketAddr]>,
    /// Serve endpoints from files in this directory (file-based EDS).
    pub eds_dir: Option<&'a Path>,
}

pub(super) fn standard_edits(config: &mut Value, edits: &StandardEdits<'_>) -> anyhow::Result<()> {
    if let Some(admin) = config.get_mut("admin") {
        set_loopback_ephemeral(admin.get_mut("address"), "admin")?;
    } else {
        bail!("no `admin` section (the launcher needs the admin interface)");
    }
    let listeners = seq_mut(config, &["static_resources", "listeners"])?;
    for listener in listeners.iter_mut() {
        set_loopback_ephemeral(listener.get_mut("address"), "listener")?;
    }
    let wasm_filters = edit_wasm_filters(listeners, edits)?;
    if wasm_filters == 0 && edits.filter == FilterMode::With {
        bail!("no wasm HTTP filter ({WASM_FILTER_TYPE}) in any listener");
    }
    if let Some(upstreams) = edits.upstreams {
        let clusters = seq_mut(config, &["static_resources", "clusters"])?;
        for cluster in clusters.iter_mut() {
            if cluster.get("load_assignment").is_some() {
                set_endpoints(cluster, upstreams)?;
            }
        }
    }
    if let Some(dir) = edits.eds_dir {
        // Envoy requires a node identity for any xDS source, files included.
        if config.get("node").is_none() {
            let node: Value =
                serde_yaml::from_str("{ id: prefix-router, cluster: prefix-router }")?;
            config
                .as_mapping_mut()
                .ok_or_else(|| anyhow!("the configuration is not a mapping"))?
                .insert("node".into(), node);
        }
        let clusters = seq_mut(config, &["static_resources", "clusters"])?;
        for cluster in clusters.iter_mut() {
            if cluster.get("load_assignment").is_some() {
                endpoints_from_file(cluster, dir)?;
            }
        }
    }
    Ok(())
}

/// The EDS file of a cluster served from files in `dir`.
pub(super) fn eds_path(dir: &Path, cluster: &str) -> PathBuf {
    dir.join(format!("eds-{cluster}.yaml"))
}

/// Writes a cluster's endpoints for file-based EDS. Envoy watches for the file
/// being moved into place, so it is written aside and renamed.
pub(super) fn write_eds_file(
    dir: &Path,
    cluster: &str,
    addrs: &[SocketAddr],
) -> anyhow::Result<()> {
    let mut assignment = Mapping::new();
    assignment.insert(
        "@type".into(),
        "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment".into(),
    );
    assignment.insert("cluster_name".into(), cluster.into());
    assignment.insert("endpoints".into(), locality_endpoints(addrs)?);
    let mut response = Mapping::new();
    response.insert(
        "resources".into(),
        Value::Sequence(vec![Value::Mapping(assignment)]),
    );
    let final_path = eds_path(dir, cluster);
    let staging = dir.join(format!(".eds-{cluster}.yaml.tmp"));
    std::fs::write(&staging, serde_yaml::to_string(&Value::Mapping(response))?)?;
    std::fs::rename(&staging, &final_path)?;
    Ok(())
}

/// Turns a static cluster into one fed from an EDS file holding its current endpoints.
fn endpoints_from_file(cluster: &mut Value, dir: &Path) -> anyhow::Result<()> {
    let name = cluster
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("cluster without a name"))?
        .to_string();
    let addrs = static_endpoints(cluster)?;
    write_eds_file(dir, &name, &addrs)?;
    let path = eds_path(dir, &name);
    let cluster = cluster
        .as_mapping_mut()
        .ok_or_else(|| anyhow!("cluster {name} is not a mapping"))?;
    cluster.remove("load_assignment");
    cluster.insert("type".into(), "EDS".into());
    let eds: Value = serde_yaml::from_str(&format!(
        "{{ service_name: '{name}', eds_config: {{ resource_api_version: V3, path_config_source: {{ path: '{}' }} }} }}",
        path.display()
    ))?;
    cluster.insert("eds_cluster_config".into(), eds);
    Ok(())
}

/// The addresses listed in a static cluster's load_assignment.
fn static_endpoints(cluster: &Value) -> anyhow::Result<Vec<SocketAddr>> {
    let mut addrs = Vec::new();
    let localities = cluster
        .get("load_assignment")
        .and_then(|a| a.get("endpoints"))
        .and_then(Value::as_sequence)
        .ok_or_else(|| anyhow!("cluster without load_assignment.endpoints"))?;
    for locality in localities {
        for endpoint in locality
            .get("lb_endpoints")
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
        {
            let socket = endpoint
                .get("endpoint")
                .and_then(|e| e.get("address"))
                .and_then(|a| a.get("socket_address"))
                .ok_or_else(|| anyhow!("endpoint without address.socket_address"))?;
            let ip = socket
                .get("address")
                .and_then(Value::as_str)
                .ok_or_else(|| anyhow!("endpoint without an address"))?;
            let port = socket
                .get("port_value")
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok())
                .ok_or_else(|| anyhow!("endpoint without a port"))?;
            addrs.push(SocketAddr::new(ip.parse()?, port));
        }
    }
    Ok(addrs)
}

/// The name of the first static listener (the one clients use).
pub(super) fn first_listener_name(config: &Value) -> anyhow::Result<String> {
    config
        .get("static_resources")
        .and_then(|r| r.get("listeners"))
        .and_then(|l| l.get(0))
        .and_then(|l| l.get("name"))
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| anyhow!("the first static listener has no name"))
}

fn set_loopback_ephemeral(address: Option<&mut Value>, what: &str) -> anyhow::Result<()> {
    let socket = address
        .and_then(|a| a.get_mut("socket_address"))
        .and_then(Value::as_mapping_mut)
        .ok_or_else(|| anyhow!("{what} has no address.socket_address"))?;
    socket.insert("address".into(), "127.0.0.1".into());
    socket.insert("port_value".into(), 0.into());
    Ok(())
}

/// Rewrites (or removes) every wasm filter; returns how many there were.
fn edit_wasm_filters(listeners: &mut [Value], edits: &StandardEdits<'_>) -> anyhow::Result<usize> {
    let mut found = 0;
    for listener in listeners {
        let Some(chains) = listener
            .get_mut("filter_chains")
            .and_then(Value::as_sequence_mut)
        else {
            continue;
        };
        for chain in chains {
            let Some(filters) = chain.get_mut("filters").and_then(Value::as_sequence_mut) else {
                continue;
            };
            for network_filter in filters {
                let Some(hcm) = network_filter.get_mut("typed_config") else {
                    continue;
                };
                if type_of(hcm) != Some(HCM_TYPE) {
                    continue;
                }
                let Some(http_filters) =
                    hcm.get_mut("http_filters").and_then(Value::as_sequence_mut)
                else {
                    continue;
                };
                let before = http_filters.len();
                if edits.filter == FilterMode::Without {
                    http_filters.retain(|f| !is_wasm_filter(f));
                    found += before - http_filters.len();
                    continue;
                }
                for filter in http_filters.iter_mut().filter(|f| is_wasm_filter(f)) {
                    found += 1;
                    edit_plugin(filter, edits)?;
                }
            }
        }
    }
    Ok(found)
}

fn is_wasm_filter(filter: &Value) -> bool {
    filter
        .get("typed_config")
        .is_some_and(|c| type_of(c) == Some(WASM_FILTER_TYPE))
}

fn type_of(typed_config: &Value) -> Option<&str> {
    typed_config.get("@type").and_then(Value::as_str)
}

fn edit_plugin(filter: &mut Value, edits: &StandardEdits<'_>) -> anyhow::Result<()> {
    let plugin = filter
        .get_mut("typed_config")
        .and_then(|c| c.get_mut("config"))
        .ok_or_else(|| anyhow!("wasm filter without typed_config.config"))?;
    if let Some(wasm) = edits.wasm {
        let local = plugin
            .get_mut("vm_config")
            .and_then(|v| v.get_mut("code"))
            .and_then(|c| c.get_mut("local"))
            .and_then(Value::as_mapping_mut)
            .ok_or_else(|| anyhow!("wasm filter without vm_config.code.local"))?;
        local.clear();
        local.insert(
            "filename".into(),
            wasm.to_string_lossy().into_owned().into(),
        );
    }
    if let Some(json) = edits.plugin_config {
        let plugin = plugin
            .as_mapping_mut()
            .ok_or_else(|| anyhow!("wasm filter config is not a mapping"))?;
        let mut configuration = Mapping::new();
        configuration.insert(
            "@type".into(),
            "type.googleapis.com/google.protobuf.StringValue".into(),
        );
        configuration.insert("value".into(), json.into());
        plugin.insert("configuration".into(), Value::Mapping(configuration));
    }
    Ok(())
}

fn set_endpoints(cluster: &mut Value, upstreams: &[SocketAddr]) -> anyhow::Result<()> {
    let endpoints = locality_endpoints(upstreams)?;
    let assignment = cluster
        .get_mut("load_assignment")
        .and_then(Value::as_mapping_mut)
        .ok_or_else(|| anyhow!("cluster load_assignment is not a mapping"))?;
    assignment.insert("endpoints".into(), endpoints);
    Ok(())
}

/// `[{lb_endpoints: [...]}]`: one locality holding the given addresses.
fn locality_endpoints(upstreams: &[SocketAddr]) -> anyhow::Result<Value> {
    let endpoints: Vec<Value> = upstreams
        .iter()
        .map(|addr| {
            let yaml = format!(
                "endpoint: {{ address: {{ socket_address: {{ address: '{}', port_value: {} }} }} }}",
                addr.ip(),
                addr.port()
            );
            serde_yaml::from_str(&yaml)
        })
        .collect::<Result<_, _>>()?;
    let mut locality = Mapping::new();
    locality.insert("lb_endpoints".into(), Value::Sequence(endpoints));
    Ok(Value::Sequence(vec![Value::Mapping(locality)]))
}

fn seq_mut<'a>(config: &'a mut Value, path: &[&str]) -> anyhow::Result<&'a mut Vec<Value>> {
    let mut node = config;
    for key in path {
        node = node
            .get_mut(*key)
            .ok_or_else(|| anyhow!("no `{}` in the configuration", path.join(".")))?;
    }
    node.as_sequence_mut()
        .ok_or_else(|| anyhow!("`{}` is not a list", path.join(".")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shipped_config() -> Value {
        let path = super::super::default_config_path();
        serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn wasm_filter_count(config: &Value) -> usize {
        let mut count = 0;
        let listeners = config["static_resources"]["listeners"]
            .as_sequence()
            .unwrap();
        for listener in listeners {
            for chain in listener["filter_chains"].as_sequence().unwrap() {
                for f in chain["filters"].as_sequence().unwrap() {
                    if let Some(http) = f["typed_config"]["http_filters"].as_sequence() {
                        count += http.iter().filter(|h| is_wasm_filter(h)).count();
                    }
                }
            }
        }
        count
    }

    #[test]
    fn rewrites_ports_endpoints_wasm_and_plugin_config() {
        let mut config = shipped_config();
        let upstreams: Vec<SocketAddr> = vec![
            "127.0.0.1:1111".parse().unwrap(),
            "127.0.0.1:2222".parse().unwrap(),
        ];
        standard_edits(
            &mut config,
            &StandardEdits {
                filter: FilterMode::With,
                wasm: Some(Path::new("/abs/filter.wasm")),
                plugin_config: Some(r#"{"prefix_length":2048}"#),
                upstreams: Some(&upstreams),
                eds_dir: None,
            },
        )
        .unwrap();
        let listener = &config["static_resources"]["listeners"][0]["address"]["socket_address"];
        assert_eq!(listener["address"], "127.0.0.1");
        assert_eq!(listener["port_value"], 0);
        assert_eq!(
            config["admin"]["address"]["socket_address"]["port_value"],
            0
        );
        let endpoints = &config["static_resources"]["clusters"][0]["load_assignment"]["endpoints"]
            [0]["lb_endpoints"];
        assert_eq!(endpoints.as_sequence().unwrap().len(), 2);
        assert_eq!(
            endpoints[1]["endpoint"]["address"]["socket_address"]["port_value"],
            2222
        );
        let text = serde_yaml::to_string(&config).unwrap();
        assert!(text.contains("/abs/filter.wasm"));
        assert!(text.contains(r#"{"prefix_length":2048}"#));
        assert_eq!(wasm_filter_count(&config), 1);
    }

    #[test]
    fn without_filter_removes_the_wasm_filter_only() {
        let mut config = shipped_config();
        standard_edits(
            &mut config,
            &StandardEdits {
                filter: FilterMode::Without,
                wasm: None,
                plugin_config: None,
                upstreams: None,
                eds_dir: None,
            },
        )
        .unwrap();
        assert_eq!(wasm_filter_count(&config), 0);
        assert!(serde_yaml::to_string(&config)
            .unwrap()
            .contains("envoy.filters.http.router"));
    }

    #[test]
    fn a_config_without_the_filter_is_an_error_when_the_filter_is_wanted() {
        let mut config = shipped_config();
        let edits = StandardEdits {
            filter: FilterMode::Without,
            wasm: None,
            plugin_config: None,
            upstreams: None,
            eds_dir: None,
        };
        standard_edits(&mut config, &edits).unwrap();
        let wanted = StandardEdits {
            filter: FilterMode::With,
            ..edits
        };
        assert!(standard_edits(&mut config, &wanted).is_err());
    }
}
