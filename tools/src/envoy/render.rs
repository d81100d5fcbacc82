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
    /// The wasm filter in the listeners only: the clusters' upstream wasm
    /// filters are removed (the overhead benchmark's floor filter, which
    /// counts nothing).
    ListenerOnly,
}

pub(super) struct StandardEdits<'a> {
    pub filter: FilterMode,
    pub wasm: Option<&'a Path>,
    pub plugin_config: Option<&'a str>,
    pub upstreams: Option<&'a [SocketAddr]>,
    /// Serve endpoints from files in this directory (file-based EDS).
    pub eds_dir: Option<&'a Path>,
    /// Where the run keeps the files Envoy watches (the downstream filter's ECDS
    /// resource). Required when the configuration uses ECDS or
    /// `dynamic_plugin_config` is set.
    pub files_dir: Option<&'a Path>,
    /// Deliver an inline downstream wasm filter through file-based ECDS instead,
    /// so its configuration can change while Envoy runs.
    pub dynamic_plugin_config: bool,
    /// Add a static cluster of this name leading to Envoy's own admin (the
    /// filter's `discovery`), unless the file has one.
    pub admin_cluster: Option<&'a str>,
}

/// The ECDS file holding the downstream filter's configuration, as written.
#[derive(Debug, Clone)]
pub(super) struct EcdsFile {
    /// The filter's (and resource's) name.
    pub name: String,
    /// The file Envoy watches (replaced by rename).
    pub path: PathBuf,
    /// Its content: `{resources: [TypedExtensionConfig]}`.
    pub document: Value,
}

/// What the rendered configuration refers to, for updates while Envoy runs.
#[derive(Debug, Clone, Default)]
pub(super) struct Rendered {
    pub ecds: Option<EcdsFile>,
    /// Clusters fed from EDS files.
    pub eds_clusters: Vec<String>,
}

pub(super) fn standard_edits(
    config: &mut Value,
    edits: &StandardEdits<'_>,
) -> anyhow::Result<Rendered> {
    let mut rendered = Rendered::default();
    let admin_port = config
        .get("admin")
        .and_then(|a| a.get("address"))
        .and_then(|a| a.get("socket_address"))
        .and_then(|s| s.get("port_value"))
        .and_then(Value::as_u64)
        .ok_or_else(|| anyhow!("no `admin` address (the launcher needs the admin interface)"))?;
    if let Some(name) = edits.admin_cluster {
        add_admin_cluster(config, name, admin_port)?;
    }
    let admin_clusters = admin_cluster_names(config, admin_port)?;
    if admin_clusters.is_empty() {
        set_loopback_ephemeral(
            config.get_mut("admin").and_then(|a| a.get_mut("address")),
            "admin",
        )?;
    } else {
        // A cluster leads to the admin (the filter's `discovery`): the admin
        // gets a free port known before Envoy starts, and the cluster follows.
        let port = free_loopback_port()?;
        let socket = config["admin"]["address"]["socket_address"]
            .as_mapping_mut()
            .ok_or_else(|| anyhow!("admin has no address.socket_address"))?;
        socket.insert("address".into(), "127.0.0.1".into());
        socket.insert("port_value".into(), port.into());
        let admin = [SocketAddr::from(([127, 0, 0, 1], port))];
        for cluster in seq_mut(config, &["static_resources", "clusters"])? {
            if is_named(cluster, &admin_clusters) {
                set_endpoints(cluster, &admin)?;
            }
        }
    }
    let listeners = seq_mut(config, &["static_resources", "listeners"])?;
    for listener in listeners.iter_mut() {
        set_loopback_ephemeral(listener.get_mut("address"), "listener")?;
    }
    let wasm_filters = edit_wasm_filters(listeners, edits, &mut rendered)?;
    if wasm_filters == 0 && edits.filter != FilterMode::Without {
        bail!("no wasm HTTP filter ({WASM_FILTER_TYPE}) in any listener");
    }
    let clusters = seq_mut(config, &["static_resources", "clusters"])?;
    for cluster in clusters.iter_mut() {
        edit_upstream_wasm_filters(cluster, edits)?;
    }
    if rendered.ecds.is_some() {
        add_node(config)?;
    }
    if let Some(upstreams) = edits.upstreams {
        set_configured_instances(config, upstreams)?;
        let clusters = seq_mut(config, &["static_resources", "clusters"])?;
        for cluster in clusters.iter_mut() {
            if cluster.get("load_assignment").is_some() && !is_named(cluster, &admin_clusters) {
                set_endpoints(cluster, upstreams)?;
            }
        }
    }
    if let Some(dir) = edits.eds_dir {
        add_node(config)?;
        let clusters = seq_mut(config, &["static_resources", "clusters"])?;
        for cluster in clusters.iter_mut() {
            if cluster.get("load_assignment").is_some() && !is_named(cluster, &admin_clusters) {
                rendered
                    .eds_clusters
                    .push(endpoints_from_file(cluster, dir)?);
            }
        }
    }
    Ok(rendered)
}

/// Envoy requires a node identity for any xDS source, files included.
fn add_node(config: &mut Value) -> anyhow::Result<()> {
    if config.get("node").is_none() {
        let node: Value = serde_yaml::from_str("{ id: prefix-router, cluster: prefix-router }")?;
        config
            .as_mapping_mut()
            .ok_or_else(|| anyhow!("the configuration is not a mapping"))?
            .insert("node".into(), node);
    }
    Ok(())
}

/// Writes an ECDS file aside and renames it into place (Envoy watches the
/// directory for files moved into it).
pub(super) fn write_ecds_file(ecds: &EcdsFile) -> anyhow::Result<()> {
    let dir = ecds
        .path
        .parent()
        .ok_or_else(|| anyhow!("ECDS file {} has no directory", ecds.path.display()))?;
    // Staged outside the watched directory, so only the rename is seen there.
    let staging_dir = dir.parent().unwrap_or(dir);
    let staging = staging_dir.join(format!(".ecds-{}.yaml.tmp", ecds.name));
    std::fs::write(&staging, serde_yaml::to_string(&ecds.document)?)?;
    std::fs::rename(&staging, &ecds.path)?;
    Ok(())
}

/// Sets the plugin configuration JSON in an ECDS document's resource.
pub(super) fn set_ecds_plugin_config(ecds: &mut EcdsFile, json: &str) -> anyhow::Result<()> {
    let plugin = ecds_plugin_mut(&mut ecds.document, &ecds.name)?;
    set_plugin_configuration(plugin, json)
}

/// The wasm `config` of the named resource in an ECDS document.
fn ecds_plugin_mut<'a>(document: &'a mut Value, name: &str) -> anyhow::Result<&'a mut Value> {
    let resources = document
        .get_mut("resources")
        .and_then(Value::as_sequence_mut)
        .ok_or_else(|| anyhow!("ECDS file without a `resources` list"))?;
    let count = resources.len();
    let resource = resources
        .iter_mut()
        .find(|r| r.get("name").and_then(Value::as_str) == Some(name) || count == 1)
        .ok_or_else(|| anyhow!("ECDS file without a resource named {name}"))?;
    let typed = resource
        .get_mut("typed_config")
        .ok_or_else(|| anyhow!("ECDS resource {name} without typed_config"))?;
    if type_of(typed) != Some(WASM_FILTER_TYPE) {
        bail!("ECDS resource {name} is not a wasm filter ({WASM_FILTER_TYPE})");
    }
    typed
        .get_mut("config")
        .ok_or_else(|| anyhow!("ECDS resource {name} without typed_config.config"))
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
fn endpoints_from_file(cluster: &mut Value, dir: &Path) -> anyhow::Result<String> {
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
    Ok(name)
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

/// The static clusters whose every endpoint is Envoy's own admin
/// (127.0.0.1 at the admin's port): the filter's way to the admin.
fn admin_cluster_names(config: &Value, admin_port: u64) -> anyhow::Result<Vec<String>> {
    let admin = SocketAddr::from(([127, 0, 0, 1], u16::try_from(admin_port)?));
    let mut names = Vec::new();
    let clusters = config
        .get("static_resources")
        .and_then(|r| r.get("clusters"))
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten();
    for cluster in clusters {
        if cluster.get("load_assignment").is_none() {
            continue;
        }
        let endpoints = static_endpoints(cluster).unwrap_or_default();
        if !endpoints.is_empty() && endpoints.iter().all(|e| *e == admin) {
            let name = cluster.get("name").and_then(Value::as_str);
            names.push(
                name.ok_or_else(|| anyhow!("a cluster without a name"))?
                    .to_string(),
            );
        }
    }
    Ok(names)
}

/// A static cluster `name` to 127.0.0.1 at the admin's port, unless the
/// configuration has a cluster of that name.
fn add_admin_cluster(config: &mut Value, name: &str, admin_port: u64) -> anyhow::Result<()> {
    let clusters = seq_mut(config, &["static_resources", "clusters"])?;
    if clusters.iter().any(|c| is_named(c, &[name.to_string()])) {
        return Ok(());
    }
    clusters.push(serde_yaml::from_str(&format!(
        "{{ name: {name}, type: STATIC, connect_timeout: 1s, load_assignment: {{ cluster_name: {name}, \
         endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: \
         {{ address: 127.0.0.1, port_value: {admin_port} }} }} }} }} ] }} ] }} }}"
    ))?);
    Ok(())
}

fn is_named(cluster: &Value, names: &[String]) -> bool {
    cluster
        .get("name")
        .and_then(Value::as_str)
        .is_some_and(|name| names.iter().any(|n| n == name))
}

/// A loopback port free now (bound, then released for Envoy to take).
fn free_loopback_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    Ok(listener.local_addr()?.port())
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
fn edit_wasm_filters(
    listeners: &mut [Value],
    edits: &StandardEdits<'_>,
    rendered: &mut Rendered,
) -> anyhow::Result<usize> {
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
                    http_filters.retain(|f| !is_wasm_filter(f) && !is_ecds_wasm_filter(f));
                    found += before - http_filters.len();
                    continue;
                }
                for filter in http_filters.iter_mut() {
                    if is_wasm_filter(filter) {
                        found += 1;
                        edit_plugin(filter, edits)?;
                        if edits.dynamic_plugin_config {
                            let ecds = inline_to_ecds(filter, edits)?;
                            keep_one_ecds(rendered, ecds)?;
                        }
                    } else if is_ecds_wasm_filter(filter) {
                        found += 1;
                        let ecds = relocate_ecds(filter, edits)?;
                        keep_one_ecds(rendered, ecds)?;
                    }
                }
            }
        }
    }
    Ok(found)
}

fn keep_one_ecds(rendered: &mut Rendered, ecds: EcdsFile) -> anyhow::Result<()> {
    if let Some(other) = &rendered.ecds {
        bail!(
            "two wasm filters delivered by ECDS ({} and {}): the launcher handles one",
            other.name,
            ecds.name
        );
    }
    rendered.ecds = Some(ecds);
    Ok(())
}

/// An HTTP filter whose configuration comes from ECDS and is the wasm filter.
fn is_ecds_wasm_filter(filter: &Value) -> bool {
    filter
        .get("config_discovery")
        .and_then(|d| d.get("type_urls"))
        .and_then(Value::as_sequence)
        .is_some_and(|urls| urls.iter().any(|u| u.as_str() == Some(WASM_FILTER_TYPE)))
}

fn filter_name(filter: &Value) -> anyhow::Result<String> {
    filter
        .get("name")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| anyhow!("HTTP filter without a name"))
}

fn files_dir<'a>(edits: &StandardEdits<'a>) -> anyhow::Result<&'a Path> {
    edits
        .files_dir
        .ok_or_else(|| anyhow!("an ECDS-delivered filter needs a directory for its file"))
}

/// Points an HTTP filter's `config_discovery` at the run's copy of its file.
fn discovery_from(filter: &mut Value, path: &Path, dir: &Path) -> anyhow::Result<()> {
    let discovery: Value = serde_yaml::from_str(&format!(
        "{{ config_source: {{ resource_api_version: V3, path_config_source: {{ path: '{}', watched_directory: {{ path: '{}' }} }} }}, type_urls: ['{WASM_FILTER_TYPE}'] }}",
        path.display(),
        dir.display()
    ))?;
    let filter = filter
        .as_mapping_mut()
        .ok_or_else(|| anyhow!("HTTP filter is not a mapping"))?;
    filter.remove("typed_config");
    filter.insert("config_discovery".into(), discovery);
    Ok(())
}

/// Moves an inline wasm filter's configuration (already edited) into an ECDS file.
fn inline_to_ecds(filter: &mut Value, edits: &StandardEdits<'_>) -> anyhow::Result<EcdsFile> {
    let name = filter_name(filter)?;
    let typed = filter
        .get("typed_config")
        .cloned()
        .ok_or_else(|| anyhow!("wasm filter {name} without typed_config"))?;
    let mut resource = Mapping::new();
    resource.insert(
        "@type".into(),
        "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig".into(),
    );
    resource.insert("name".into(), name.clone().into());
    resource.insert("typed_config".into(), typed);
    let mut document = Mapping::new();
    document.insert(
        "resources".into(),
        Value::Sequence(vec![Value::Mapping(resource)]),
    );
    let dir = files_dir(edits)?.join("ecds");
    std::fs::create_dir_all(&dir)?;
    let ecds = EcdsFile {
        path: dir.join(format!("{name}.yaml")),
        name,
        document: Value::Mapping(document),
    };
    write_ecds_file(&ecds)?;
    discovery_from(filter, &ecds.path, &dir)?;
    Ok(ecds)
}

/// Copies an ECDS filter's resource file (path relative to the workspace root)
/// into the run's directory, with the run's .wasm and plugin configuration.
fn relocate_ecds(filter: &mut Value, edits: &StandardEdits<'_>) -> anyhow::Result<EcdsFile> {
    let name = filter_name(filter)?;
    let source = filter
        .get("config_discovery")
        .and_then(|d| d.get("config_source"))
        .and_then(|s| s.get("path_config_source"))
        .and_then(|p| p.get("path"))
        .and_then(Value::as_str)
        .ok_or_else(|| {
            anyhow!("ECDS filter {name}: only config_source.path_config_source.path is supported")
        })?;
    let source = super::workspace_root().join(source);
    let text = std::fs::read_to_string(&source)
        .map_err(|e| anyhow!("reading the ECDS file {}: {e}", source.display()))?;
    let mut document: Value = serde_yaml::from_str(&text)
        .map_err(|e| anyhow!("parsing the ECDS file {}: {e}", source.display()))?;
    let plugin = ecds_plugin_mut(&mut document, &name)?;
    edit_plugin_config(plugin, edits)?;
    if let Some(upstreams) = edits.upstreams {
        set_configured_instances(&mut document, upstreams)?;
    }
    let dir = files_dir(edits)?.join("ecds");
    std::fs::create_dir_all(&dir)?;
    let ecds = EcdsFile {
        path: dir.join(format!("{name}.yaml")),
        name,
        document,
    };
    write_ecds_file(&ecds)?;
    discovery_from(filter, &ecds.path, &dir)?;
    Ok(ecds)
}

/// The wasm filters a cluster runs on its upstream requests
/// (`typed_extension_protocol_options.*.http_filters`): the .wasm path is the
/// run's; without the filter they are removed.
fn edit_upstream_wasm_filters(
    cluster: &mut Value,
    edits: &StandardEdits<'_>,
) -> anyhow::Result<()> {
    let Some(options) = cluster
        .get_mut("typed_extension_protocol_options")
        .and_then(Value::as_mapping_mut)
    else {
        return Ok(());
    };
    for (_, option) in options.iter_mut() {
        let Some(filters) = option
            .get_mut("http_filters")
            .and_then(Value::as_sequence_mut)
        else {
            continue;
        };
        if edits.filter != FilterMode::With {
            filters.retain(|f| !is_wasm_filter(f));
            continue;
        }
        for filter in filters.iter_mut().filter(|f| is_wasm_filter(f)) {
            let plugin = filter
                .get_mut("typed_config")
                .and_then(|c| c.get_mut("config"))
                .ok_or_else(|| anyhow!("upstream wasm filter without typed_config.config"))?;
            set_wasm_path(plugin, edits.wasm)?;
        }
    }
    Ok(())
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
    edit_plugin_config(plugin, edits)
}

/// Sets the .wasm path and plugin configuration of a wasm filter's `config`.
fn edit_plugin_config(plugin: &mut Value, edits: &StandardEdits<'_>) -> anyhow::Result<()> {
    set_wasm_path(plugin, edits.wasm)?;
    if let Some(json) = edits.plugin_config {
        set_plugin_configuration(plugin, json)?;
    }
    Ok(())
}

fn set_wasm_path(plugin: &mut Value, wasm: Option<&Path>) -> anyhow::Result<()> {
    if let Some(wasm) = wasm {
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
    Ok(())
}

fn set_plugin_configuration(plugin: &mut Value, json: &str) -> anyhow::Result<()> {
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
    Ok(())
}

/// A plugin configuration listing the fleet (`"instances"`) lists the run's
/// upstreams instead, like the clusters' endpoints: every wasm filter's
/// `configuration.value` under `config` (a whole file, or one filter) that
/// has that field.
pub fn set_configured_instances(
    config: &mut Value,
    upstreams: &[SocketAddr],
) -> anyhow::Result<()> {
    fn visit(value: &mut Value, upstreams: &[SocketAddr]) -> anyhow::Result<()> {
        match value {
            Value::Mapping(map) => {
                let is_plugin_configuration = map
                    .get("@type")
                    .and_then(Value::as_str)
                    .is_some_and(|t| t == "type.googleapis.com/google.protobuf.StringValue");
                if is_plugin_configuration {
                    if let Some(text) = map.get("value").and_then(Value::as_str) {
                        if let Ok(serde_json::Value::Object(mut json)) =
                            serde_json::from_str::<serde_json::Value>(text)
                        {
                            if json.contains_key("instances") {
                                let list: Vec<serde_json::Value> =
                                    upstreams.iter().map(|a| a.to_string().into()).collect();
                                json.insert("instances".into(), list.into());
                                let text = serde_json::to_string_pretty(&json)?;
                                map.insert("value".into(), text.into());
                            }
                        }
                    }
                }
                for (_, child) in map.iter_mut() {
                    visit(child, upstreams)?;
                }
            }
            Value::Sequence(items) => {
                for item in items {
                    visit(item, upstreams)?;
                }
            }
            _ => {}
        }
        Ok(())
    }
    visit(config, upstreams)
}

/// A statically defined cluster's endpoints become `upstreams` (one locality).
pub fn set_endpoints(cluster: &mut Value, upstreams: &[SocketAddr]) -> anyhow::Result<()> {
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

    /// The admin's port and the endpoints of cluster `name`.
    fn admin_and_endpoints(config: &Value, name: &str) -> (u64, Vec<SocketAddr>) {
        let port = config["admin"]["address"]["socket_address"]["port_value"]
            .as_u64()
            .unwrap();
        let cluster = config["static_resources"]["clusters"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no cluster {name}"));
        (port, static_endpoints(cluster).unwrap())
    }

    #[test]
    fn an_admin_cluster_leads_to_the_admin_on_a_port_known_up_front() {
        let upstreams: Vec<SocketAddr> = vec!["127.0.0.1:1111".parse().unwrap()];
        let dir = tempfile::tempdir().unwrap();
        let edits = |admin_cluster| StandardEdits {
            filter: FilterMode::With,
            wasm: Some(Path::new("/abs/filter.wasm")),
            plugin_config: None,
            upstreams: Some(&upstreams),
            eds_dir: None,
            files_dir: Some(dir.path()),
            dynamic_plugin_config: false,
            admin_cluster,
        };
        // A file with its own (compose), and one the builder adds.
        let compose = super::super::workspace_root().join("envoy/docker/envoy.yaml");
        let mut config: Value =
            serde_yaml::from_str(&std::fs::read_to_string(compose).unwrap()).unwrap();
        standard_edits(&mut config, &edits(None)).unwrap();
        let mut shipped = shipped_config();
        standard_edits(&mut shipped, &edits(Some("envoy_admin"))).unwrap();
        for config in [&config, &shipped] {
            let (port, admin) = admin_and_endpoints(config, "envoy_admin");
            assert_ne!(port, 0, "the admin's port is known before the start");
            assert_eq!(admin, [SocketAddr::from(([127, 0, 0, 1], port as u16))]);
            assert_eq!(admin_and_endpoints(config, "vllm").1, upstreams);
        }
        // Without one, the admin takes an ephemeral port.
        let mut plain = shipped_config();
        standard_edits(&mut plain, &edits(None)).unwrap();
        assert_eq!(plain["admin"]["address"]["socket_address"]["port_value"], 0);
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
                        count += http
                            .iter()
                            .filter(|h| is_wasm_filter(h) || is_ecds_wasm_filter(h))
                            .count();
                    }
                }
            }
        }
        count
    }

    #[test]
    fn a_configured_fleet_lists_the_runs_upstreams() {
        let mut config = shipped_config();
        let upstreams: Vec<SocketAddr> = vec![
            "127.0.0.1:1111".parse().unwrap(),
            "127.0.0.1:2222".parse().unwrap(),
        ];
        let dir = tempfile::tempdir().unwrap();
        standard_edits(
            &mut config,
            &StandardEdits {
                filter: FilterMode::With,
                wasm: Some(Path::new("/abs/filter.wasm")),
                plugin_config: Some(r#"{"instances":["10.9.9.9:80"]}"#),
                upstreams: Some(&upstreams),
                eds_dir: None,
                files_dir: Some(dir.path()),
                dynamic_plugin_config: false,
                admin_cluster: None,
            },
        )
        .unwrap();
        let text = serde_yaml::to_string(&config).unwrap();
        assert!(!text.contains("10.9.9.9:80"), "{text}");
        assert!(text.contains("127.0.0.1:2222"), "{text}");
    }

    #[test]
    fn rewrites_ports_endpoints_wasm_and_plugin_config() {
        let mut config = shipped_config();
        let upstreams: Vec<SocketAddr> = vec![
            "127.0.0.1:1111".parse().unwrap(),
            "127.0.0.1:2222".parse().unwrap(),
        ];
        let dir = tempfile::tempdir().unwrap();
        let rendered = standard_edits(
            &mut config,
            &StandardEdits {
                filter: FilterMode::With,
                wasm: Some(Path::new("/abs/filter.wasm")),
                plugin_config: Some(r#"{"prefix_length":2048}"#),
                upstreams: Some(&upstreams),
                eds_dir: None,
                files_dir: Some(dir.path()),
                dynamic_plugin_config: false,
                admin_cluster: None,
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
        // The downstream filter is inline or in its ECDS file, depending on the layout.
        let mut text = serde_yaml::to_string(&config).unwrap();
        if let Some(ecds) = &rendered.ecds {
            text.push_str(&std::fs::read_to_string(&ecds.path).unwrap());
        }
        assert!(text.contains("/abs/filter.wasm"));
        assert!(text.contains(r#"{"prefix_length":2048}"#));
        assert!(
            !text.contains("target/wasm32-wasip1"),
            "a .wasm path was left as shipped"
        );
        assert_eq!(wasm_filter_count(&config), 1);
        // Every cluster listing instances got the run's endpoints.
        for cluster in config["static_resources"]["clusters"]
            .as_sequence()
            .unwrap()
        {
            if let Some(assignment) = cluster.get("load_assignment") {
                let lb = &assignment["endpoints"][0]["lb_endpoints"];
                assert_eq!(lb.as_sequence().unwrap().len(), 2, "{cluster:?}");
            }
        }
    }

    #[test]
    fn dynamic_plugin_config_moves_the_filter_into_an_ecds_file() {
        let mut config = shipped_config();
        let dir = tempfile::tempdir().unwrap();
        let rendered = standard_edits(
            &mut config,
            &StandardEdits {
                filter: FilterMode::With,
                wasm: Some(Path::new("/abs/filter.wasm")),
                plugin_config: Some(r#"{"strategy":"RANDOM"}"#),
                upstreams: None,
                eds_dir: None,
                files_dir: Some(dir.path()),
                dynamic_plugin_config: true,
                admin_cluster: None,
            },
        )
        .unwrap();
        let mut ecds = rendered.ecds.expect("an ECDS file");
        assert!(config.get("node").is_some(), "ECDS needs a node identity");
        let file = std::fs::read_to_string(&ecds.path).unwrap();
        assert!(
            file.contains("/abs/filter.wasm") && file.contains("RANDOM"),
            "{file}"
        );
        let text = serde_yaml::to_string(&config).unwrap();
        assert!(text.contains(&ecds.path.display().to_string()), "{text}");
        assert!(
            !text.contains("RANDOM"),
            "the config stayed inline too: {text}"
        );
        set_ecds_plugin_config(&mut ecds, r#"{"strategy":"PREFIX_AWARE"}"#).unwrap();
        write_ecds_file(&ecds).unwrap();
        let file = std::fs::read_to_string(&ecds.path).unwrap();
        assert!(
            file.contains("PREFIX_AWARE") && !file.contains("RANDOM"),
            "{file}"
        );
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
                files_dir: None,
                dynamic_plugin_config: false,
                admin_cluster: None,
            },
        )
        .unwrap();
        assert_eq!(wasm_filter_count(&config), 0);
        assert!(serde_yaml::to_string(&config)
            .unwrap()
            .contains("envoy.filters.http.router"));
    }

    /// Wasm filters in the clusters' upstream filter chains.
    fn upstream_wasm_filter_count(config: &Value) -> usize {
        let clusters = config["static_resources"]["clusters"]
            .as_sequence()
            .unwrap();
        clusters
            .iter()
            .filter_map(|c| c.get("typed_extension_protocol_options")?.as_mapping())
            .flat_map(|options| options.values())
            .filter_map(|option| option.get("http_filters")?.as_sequence())
            .map(|filters| filters.iter().filter(|f| is_wasm_filter(f)).count())
            .sum()
    }

    #[test]
    fn listener_only_keeps_the_listener_filter_and_drops_the_upstream_ones() {
        let edits = |filter| StandardEdits {
            filter,
            wasm: Some(Path::new("/abs/floor.wasm")),
            plugin_config: Some("4096"),
            upstreams: None,
            eds_dir: None,
            files_dir: None,
            dynamic_plugin_config: false,
            admin_cluster: None,
        };
        let mut both = shipped_config();
        standard_edits(&mut both, &edits(FilterMode::With)).unwrap();
        let mut listener_only = shipped_config();
        standard_edits(&mut listener_only, &edits(FilterMode::ListenerOnly)).unwrap();
        assert!(upstream_wasm_filter_count(&both) > 0);
        assert_eq!(upstream_wasm_filter_count(&listener_only), 0);
        assert_eq!(wasm_filter_count(&listener_only), wasm_filter_count(&both));
        assert!(serde_yaml::to_string(&listener_only)
            .unwrap()
            .contains("/abs/floor.wasm"));
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
            files_dir: None,
            dynamic_plugin_config: false,
            admin_cluster: None,
        };
        standard_edits(&mut config, &edits).unwrap();
        let wanted = StandardEdits {
            filter: FilterMode::With,
            ..edits
        };
        assert!(standard_edits(&mut config, &wanted).is_err());
    }
}
