//! The Istio example (`examples/istio/`): the EnvoyFilter, DestinationRule
//! and override_host cluster patch have the shape Istio expects, name the
//! same headers as `envoy/envoy.yaml`, and, applied to it, pass a real
//! Envoy's validation and route as intended. No Istio runs here.
//!
//! Envoy comes from `ENVOY_BIN` or PATH; the filter from `PREFIX_ROUTER_WASM`
//! or the release build (`cargo xtask test` provides both).

mod support;

use std::collections::BTreeSet;

use prefix_router_tools::envoy::Envoy;
use prefix_router_tools::upstream::UpstreamFleet;
use serde_yaml::Value;

use support::*;

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
    // Envoy refuses an http_uri without a cluster, even one istio-agent fetches.
    assert!(!s(&remote["http_uri"]["cluster"], "http_uri cluster").is_empty());
    let discovered =
        assert_gateway_plugin_config(plugin_config_json(config), "Istio's EnvoyFilter");
    // Istio names a Service's outbound cluster `outbound|<port>||<host>`.
    let rule = yaml("examples/istio/destinationrule.yaml");
    let host = s(&rule["spec"]["host"], "host");
    assert_eq!(discovered, format!("outbound|8000||{host}"));
    let admin = patch(&filter, "CLUSTER");
    assert_eq!(admin["patch"]["operation"], "ADD");
    assert_eq!(admin["match"]["context"], "GATEWAY");
    // istio-proxy's admin listens on 127.0.0.1:15000.
    assert_admin_cluster(&admin["patch"]["value"], 15000, "Istio's admin cluster");

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
    let admin = patch(&filter, "CLUSTER")["patch"]["value"].clone();
    clusters_mut(&mut config).push(admin);
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

/// Istio's sidecar bootstrap keeps only the stats its inclusion list names
/// (istio/istio `tools/packaging/common/envoy_bootstrap.json`, the same list
/// from 1.8 on): its `wasm` prefix also matches the `wasmcustom.` namespace
/// the filter's stats live in.
const ISTIO_STATS_MATCHER: &str = r#"
stats_matcher:
  inclusion_list:
    patterns:
    - prefix: "reporter="
    - prefix: cluster_manager
    - prefix: listener_manager
    - prefix: server
    - prefix: cluster.xds-grpc
    - prefix: wasm
    - suffix: rbac.allowed
    - suffix: rbac.denied
    - suffix: shadow_allowed
    - suffix: shadow_denied
    - prefix: component
"#;

/// Under Istio's stats inclusion list the filter's stats still reach the
/// Prometheus scrape (what Istio's merged metrics on port 15020 serve),
/// while the stats the list leaves out, such as the cluster's request
/// counts, do not.
#[test]
fn the_filters_stats_pass_istios_stats_inclusion_list() {
    let fleet = UpstreamFleet::start(3).unwrap();
    let envoy = Envoy::builder()
        .upstreams(fleet.addrs())
        .edit(|config| {
            config["stats_config"] = serde_yaml::from_str(ISTIO_STATS_MATCHER)?;
            Ok(())
        })
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    for i in 0..5 {
        post(
            &envoy,
            "/invocations",
            &[],
            format!("prompt {i}: {}", "context ".repeat(20)).as_bytes(),
        );
    }
    let keyed = |scraped: &str| -> Option<String> {
        scraped
            .lines()
            .find(|l| l.starts_with("prefix_router_requests_keyed_invoke"))
            .and_then(|l| l.rsplit_once(' '))
            .map(|(_, v)| v.to_string())
    };
    let scraped = wait_until(
        std::time::Duration::from_secs(10),
        || envoy.prometheus().expect("Envoy /stats/prometheus"),
        |scraped| keyed(scraped).as_deref() == Some("5"),
        |scraped| {
            format!(
                "prefix_router_requests_keyed_invoke is {:?} under Istio's inclusion list, \
                 not 5:\n{scraped}",
                keyed(scraped)
            )
        },
    );
    assert!(
        scraped.contains("prefix_router_decision_"),
        "no decision counters:\n{scraped}"
    );
    assert!(
        !scraped.contains("envoy_cluster_upstream_rq_total"),
        "the inclusion list is not in force: the cluster's request counts are scraped"
    );
}

/// Every resource in `examples/istio/` (the ingress gateway's and the
/// Gateway API variant's) passes the CRD schemas of Istio and the Gateway API.
#[test]
fn istio_resources_pass_their_crd_schemas() {
    let documents = yaml_documents_under("examples/istio");
    assert_eq!(
        documents.len(),
        7,
        "three resources and four of the Gateway API variant"
    );
    assert_crds_accept(&documents, "examples/istio");
}

/// The Gateway API variant (`examples/istio/gateway-api/`): the same patches
/// as the ingress gateway's, on the pods Istio deploys for its Gateway
/// (selected by the label Istio gives them, from the Gateway's namespace),
/// whose route goes to the Service the DestinationRule and the cluster patch
/// name.
#[test]
fn gateway_api_variant_patches_the_pods_istio_deploys_for_its_gateway() {
    let resources = yaml_documents("examples/istio/gateway-api/gateway.yaml");
    let gateway = resources
        .iter()
        .find(|d| d["kind"] == "Gateway")
        .expect("a Gateway");
    let route = resources
        .iter()
        .find(|d| d["kind"] == "HTTPRoute")
        .expect("an HTTPRoute");
    assert_eq!(gateway["spec"]["gatewayClassName"], "istio");
    let gateway_name = s(&gateway["metadata"]["name"], "Gateway name");
    let namespace = s(&gateway["metadata"]["namespace"], "Gateway namespace");
    assert_eq!(route["spec"]["parentRefs"][0]["name"], gateway_name);
    assert_eq!(route["metadata"]["namespace"], namespace);
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    let host = format!(
        "{}.{namespace}.svc.cluster.local",
        s(&backend["name"], "backendRef name")
    );
    assert_eq!(
        yaml("examples/istio/destinationrule.yaml")["spec"]["host"],
        host.as_str(),
        "the DestinationRule hashes another Service"
    );

    for file in ["envoyfilter.yaml", "override-host-cluster.yaml"] {
        let ingress = yaml(&format!("examples/istio/{file}"));
        let variant = yaml(&format!("examples/istio/gateway-api/{file}"));
        assert_eq!(
            variant["spec"]["configPatches"], ingress["spec"]["configPatches"],
            "gateway-api/{file} patches otherwise than {file}"
        );
        assert_eq!(variant["metadata"]["name"], ingress["metadata"]["name"]);
        assert_eq!(
            variant["metadata"]["namespace"], namespace,
            "gateway-api/{file}: a workloadSelector selects pods of its own namespace"
        );
        let labels = variant["spec"]["workloadSelector"]["labels"]
            .as_mapping()
            .expect("workloadSelector labels");
        assert_eq!(labels.len(), 1, "gateway-api/{file}: {labels:?}");
        assert_eq!(
            labels.get("gateway.networking.k8s.io/gateway-name"),
            Some(&Value::from(gateway_name)),
            "gateway-api/{file} selects other pods than the Gateway's"
        );
    }
    let override_host = yaml("examples/istio/gateway-api/override-host-cluster.yaml");
    let cluster = patch(&override_host, "CLUSTER");
    assert_eq!(cluster["match"]["cluster"]["service"], host.as_str());
}
