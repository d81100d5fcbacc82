//! The Envoy Gateway example (`examples/envoy-gateway/`): its resources refer
//! to each other and name the headers `envoy/envoy.yaml` uses; the names its
//! EnvoyPatchPolicy patches are the ones Envoy Gateway gives these resources.
//! No Envoy Gateway runs here, so the Envoy configuration it would generate
//! is written out from the resources (`generated_config`, following Envoy
//! Gateway's translator: names, a disabled wasm filter enabled per route, the
//! route's hash policy, override_host over Maglev, the listener's buffer
//! limit), the EnvoyPatchPolicy's JSON Patches are applied to it as Envoy
//! Gateway applies them (JSONPath, then the path appended), and a real
//! Envoy 1.40 validates and serves the result.
//!
//! Envoy comes from `ENVOY_BIN` or PATH; the filter from `PREFIX_ROUTER_WASM`
//! or the release build (`cargo xtask test` provides both).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use prefix_router_tools::envoy::Envoy;
use prefix_router_tools::upstream::UpstreamFleet;
use serde_json::json;
use serde_yaml::Value;

use support::*;

const DIR: &str = "examples/envoy-gateway";

/// Every resource of the example, by (kind, name).
fn resources() -> BTreeMap<(String, String), Value> {
    let mut out = BTreeMap::new();
    for doc in yaml_documents_under(DIR) {
        let key = (
            s(&doc["kind"], "kind").to_string(),
            s(&doc["metadata"]["name"], "metadata.name").to_string(),
        );
        assert!(out.insert(key.clone(), doc).is_none(), "{key:?} twice");
    }
    out
}

fn only<'a>(resources: &'a BTreeMap<(String, String), Value>, kind: &str) -> &'a Value {
    let found: Vec<&Value> = resources
        .iter()
        .filter(|((k, _), _)| k == kind)
        .map(|(_, v)| v)
        .collect();
    assert_eq!(found.len(), 1, "one {kind} in {DIR}");
    found[0]
}

fn name(resource: &Value) -> &str {
    s(&resource["metadata"]["name"], "metadata.name")
}

fn namespace(resource: &Value) -> &str {
    s(&resource["metadata"]["namespace"], "metadata.namespace")
}

/// The only target of a policy, as (kind, name).
fn target(policy: &Value) -> (String, String) {
    let targets = match policy["spec"].get("targetRefs") {
        Some(list) => seq(list, "targetRefs").clone(),
        None => vec![policy["spec"]["targetRef"].clone()],
    };
    assert_eq!(targets.len(), 1, "{} has one target", name(policy));
    let t = &targets[0];
    assert_eq!(t["group"], "gateway.networking.k8s.io");
    (
        s(&t["kind"], "target kind").to_string(),
        s(&t["name"], "target name").to_string(),
    )
}

/// The wasm filter's name in the listener Envoy Gateway generates:
/// `envoy.filters.http.wasm/envoyextensionpolicy/<namespace>/<name>/wasm/<index>`.
fn wasm_filter_name(policy: &Value) -> String {
    format!(
        "envoy.filters.http.wasm/envoyextensionpolicy/{}/{}/wasm/0",
        namespace(policy),
        name(policy)
    )
}

/// The listener's name: `<Gateway namespace>/<Gateway name>/<listener name>`.
fn listener_name(gateway: &Value) -> String {
    let listeners = seq(&gateway["spec"]["listeners"], "listeners");
    assert_eq!(listeners.len(), 1, "one listener");
    format!(
        "{}/{}/{}",
        namespace(gateway),
        name(gateway),
        s(&listeners[0]["name"], "listener name")
    )
}

/// The plugin configuration the EnvoyExtensionPolicy hands the filter (Envoy
/// Gateway passes `config` on as JSON).
fn plugin_config(extension: &Value) -> serde_json::Value {
    let wasm = seq(&extension["spec"]["wasm"], "wasm");
    assert_eq!(wasm.len(), 1, "one wasm module");
    serde_json::to_value(&wasm[0]["config"]).unwrap()
}

/// A Kubernetes quantity in bytes (`1Mi`, `512Ki`, `32768`).
fn quantity_bytes(value: &Value) -> u64 {
    let text = match value {
        Value::Number(n) => n.to_string(),
        other => s(other, "quantity").to_string(),
    };
    for (suffix, unit) in [("Ki", 1u64 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30)] {
        if let Some(number) = text.strip_suffix(suffix) {
            return number.parse::<u64>().expect("a whole quantity") * unit;
        }
    }
    text.parse().expect("a quantity in bytes")
}

#[test]
fn envoy_gateway_resources_refer_to_each_other_and_to_the_filters_headers() {
    let resources = resources();
    let gateway = only(&resources, "Gateway");
    let route = only(&resources, "HTTPRoute");
    let extension = only(&resources, "EnvoyExtensionPolicy");
    let backend = only(&resources, "BackendTrafficPolicy");
    let client = only(&resources, "ClientTrafficPolicy");
    let patch = only(&resources, "EnvoyPatchPolicy");
    let service = only(&resources, "Service");

    // One namespace: policies apply within theirs, and the patch's names spell it.
    let namespaces: BTreeSet<&str> = resources.values().map(namespace).collect();
    assert_eq!(namespaces.len(), 1, "one namespace: {namespaces:?}");

    assert_eq!(
        s(&route["spec"]["parentRefs"][0]["name"], "parentRef"),
        name(gateway)
    );
    let backend_ref = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(s(&backend_ref["name"], "backendRef"), name(service));
    assert_eq!(backend_ref["port"], service["spec"]["ports"][0]["port"]);
    // Generations stream for minutes; Envoy's default route timeout is 15 s.
    assert!(route["spec"]["rules"][0]["timeouts"]["request"].is_string());

    let on_route = ("HTTPRoute".to_string(), name(route).to_string());
    let on_gateway = ("Gateway".to_string(), name(gateway).to_string());
    assert_eq!(target(extension), on_route);
    assert_eq!(target(backend), on_route);
    assert_eq!(target(client), on_gateway);
    assert_eq!(target(patch), on_gateway);

    let plugin = plugin_config(extension);
    let discovered = assert_gateway_plugin_config(plugin.clone(), "the EnvoyExtensionPolicy");
    assert_eq!(
        discovered,
        route_cluster(route),
        "discovery reads another cluster"
    );
    let code = &seq(&extension["spec"]["wasm"], "wasm")[0]["code"];
    assert_eq!(code["type"], "Image");
    let url = s(&code["image"]["url"], "image url");
    let digest = url
        .split_once("@sha256:")
        .unwrap_or_else(|| panic!("the image is not pinned by digest: {url}"))
        .1;
    assert_eq!(s(&code["image"]["sha256"], "image sha256"), digest);
    assert_eq!(digest.len(), 64);

    let balancer = &backend["spec"]["loadBalancer"];
    assert_eq!(balancer["type"], "ConsistentHash");
    assert_eq!(balancer["consistentHash"]["type"], "Headers");
    assert_eq!(
        strings_at(&balancer["consistentHash"]["headers"], "name"),
        [plugin["key_header"].as_str().unwrap()]
    );
    assert_eq!(
        strings_at(&balancer["endpointOverride"]["extractFrom"], "header"),
        [plugin["host_header"].as_str().unwrap()]
    );

    let buffer = quantity_bytes(&client["spec"]["connection"]["bufferLimit"]);
    let max_body = plugin["max_body_bytes"].as_u64().unwrap();
    assert!(
        buffer >= 2 * max_body,
        "a listener buffer of {buffer} bytes leaves no room past max_body_bytes {max_body}"
    );

    // The patch names what Envoy Gateway generates for these resources, and
    // adds the admin cluster (Envoy Gateway's proxies: admin on 127.0.0.1:19000).
    let (added, patches): (Vec<&Value>, Vec<&Value>) =
        seq(&patch["spec"]["jsonPatches"], "jsonPatches")
            .iter()
            .partition(|config| config["type"] == CLUSTER_TYPE);
    assert_eq!(added.len(), 1, "one added cluster");
    assert_eq!(added[0]["operation"]["op"], "add");
    assert_eq!(added[0]["operation"]["path"], "");
    assert_eq!(added[0]["name"], added[0]["operation"]["value"]["name"]);
    assert_admin_cluster(&added[0]["operation"]["value"], 19000, "the added cluster");
    for config in patches {
        assert_eq!(config["type"], LISTENER_TYPE);
        assert_eq!(
            s(&config["name"], "patched listener"),
            listener_name(gateway)
        );
        let json_path = s(&config["operation"]["jsonPath"], "jsonPath");
        assert_eq!(
            json_path,
            format!(
                "..http_filters[?(@.name=='{}')]",
                wasm_filter_name(extension)
            )
        );
    }
}

/// The custom resources pass the CRD schemas of Envoy Gateway and the
/// Gateway API, the Service Kubernetes' own.
#[test]
fn envoy_gateway_resources_pass_their_schemas() {
    let (core, custom): (Vec<Value>, Vec<Value>) = yaml_documents_under(DIR)
        .into_iter()
        .partition(|doc| doc["apiVersion"] == "v1");
    assert_eq!(custom.len(), 6, "six custom resources");
    assert_crds_accept(&custom, DIR);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("core.yaml");
    let text: Vec<String> = core
        .iter()
        .map(|doc| serde_yaml::to_string(doc).unwrap())
        .collect();
    std::fs::write(&path, text.join("---\n")).unwrap();
    assert_kubernetes_schemas_accept(&[&path]);
}

/// The values of `field` in every entry of a list.
fn strings_at(list: &Value, field: &str) -> Vec<String> {
    seq(list, field)
        .iter()
        .map(|entry| s(&entry[field], field).to_string())
        .collect()
}

const LISTENER_TYPE: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

/// What the example's policies make of a request, as Envoy Gateway's
/// translator writes it.
struct Policies {
    /// ClientTrafficPolicy's buffer limit, else Envoy Gateway's 32 KiB.
    listener_buffer_limit: u64,
    /// The EnvoyPatchPolicy's operations, applied or not.
    patched: bool,
}

/// The Envoy configuration Envoy Gateway would generate for the example
/// (static here, where Envoy Gateway serves it over xDS: the route inline
/// rather than RDS, the pods as static endpoints rather than EDS, the module
/// as a local file rather than Envoy Gateway's HTTP copy of the image's).
fn generated_config(policies: &Policies, pods: &[SocketAddr]) -> Value {
    let resources = resources();
    let gateway = only(&resources, "Gateway");
    let route = only(&resources, "HTTPRoute");
    let extension = only(&resources, "EnvoyExtensionPolicy");
    let backend = only(&resources, "BackendTrafficPolicy");
    let wasm = &seq(&extension["spec"]["wasm"], "wasm")[0];
    let listener = listener_name(gateway);
    let filter = wasm_filter_name(extension);
    let cluster = route_cluster(route);
    let balancer = &backend["spec"]["loadBalancer"];
    let key_header = strings_at(&balancer["consistentHash"]["headers"], "name");
    let host_header = strings_at(&balancer["endpointOverride"]["extractFrom"], "header");
    let endpoints: Vec<serde_json::Value> = pods
        .iter()
        .map(|pod| {
            json!({"endpoint": {"address": {"socket_address": {
                "address": pod.ip().to_string(), "port_value": pod.port()}}}})
        })
        .collect();
    let config = json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 19000}}},
        "static_resources": {
            "listeners": [{
                "name": listener,
                "address": {"socket_address": {"address": "0.0.0.0", "port_value": 10080}},
                "per_connection_buffer_limit_bytes": policies.listener_buffer_limit,
                "default_filter_chain": {"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "http-10080",
                        "common_http_protocol_options": {"headers_with_underscores_action": "REJECT_REQUEST"},
                        "route_config": {
                            "name": listener,
                            "virtual_hosts": [{
                                "name": format!("{listener}/*"),
                                "domains": ["*"],
                                "routes": [{
                                    "name": format!("httproute/{}/{}/rule/0/match/0/*", namespace(route), name(route)),
                                    "match": {"prefix": "/"},
                                    "route": {
                                        "cluster": cluster,
                                        "timeout": s(&route["spec"]["rules"][0]["timeouts"]["request"], "timeout"),
                                        "hash_policy": key_header.iter()
                                            .map(|h| json!({"header": {"header_name": h}}))
                                            .collect::<Vec<_>>(),
                                    },
                                    // Envoy Gateway adds every policy's wasm filter disabled
                                    // and enables it on the routes the policy targets.
                                    "typed_per_filter_config": {
                                        filter.clone(): {
                                            "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
                                            "config": {},
                                        },
                                    },
                                }],
                            }],
                        },
                        "http_filters": [
                            {
                                "name": filter,
                                "disabled": true,
                                "typed_config": {
                                    "@type": WASM_TYPE,
                                    "config": {
                                        "name": s(&wasm["name"], "wasm name"),
                                        "configuration": {
                                            "@type": "type.googleapis.com/google.protobuf.StringValue",
                                            "value": plugin_config(extension).to_string(),
                                        },
                                        "vm_config": {
                                            "vm_id": filter.trim_start_matches("envoy.filters.http.wasm/"),
                                            "runtime": "envoy.wasm.runtime.v8",
                                            "code": {"local": {"filename": "prefix_router.wasm"}},
                                        },
                                    },
                                },
                            },
                            {
                                "name": "envoy.filters.http.router",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                                    "suppress_envoy_headers": true,
                                },
                            },
                        ],
                    },
                }]},
            }],
            "clusters": [{
                "name": cluster,
                "type": "STATIC",
                "connect_timeout": "10s",
                "per_connection_buffer_limit_bytes": 32768,
                "load_balancing_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                        "override_host_sources": host_header.iter()
                            .map(|h| json!({"header": h}))
                            .collect::<Vec<_>>(),
                        "fallback_policy": {"policies": [{"typed_extension_config": {
                            "name": "envoy.load_balancing_policies.maglev",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.maglev.v3.Maglev",
                            },
                        }}]},
                    },
                }}]},
                "load_assignment": {"cluster_name": cluster, "endpoints": [{"lb_endpoints": endpoints}]},
            }],
        },
    });
    let mut config = config;
    if policies.patched {
        let patch = only(&resources, "EnvoyPatchPolicy");
        for patch_config in seq(&patch["spec"]["jsonPatches"], "jsonPatches") {
            let operation = &patch_config["operation"];
            // Envoy Gateway adds a whole resource for `add` at the empty path.
            if patch_config["type"] == CLUSTER_TYPE && operation["path"] == "" {
                let cluster = serde_json::to_value(&operation["value"]).unwrap();
                config["static_resources"]["clusters"]
                    .as_array_mut()
                    .unwrap()
                    .push(cluster);
                continue;
            }
            let listener_json = &mut config["static_resources"]["listeners"][0];
            assert_eq!(
                s(&patch_config["name"], "patched listener"),
                s_json(&listener_json["name"])
            );
            apply_operation(listener_json, operation);
        }
    }
    serde_yaml::to_value(&config).unwrap()
}

/// Envoy Gateway's name of the cluster for an HTTPRoute's first rule.
fn route_cluster(route: &Value) -> String {
    format!("httproute/{}/{}/rule/0", namespace(route), name(route))
}

fn s_json(value: &serde_json::Value) -> &str {
    value.as_str().expect("a string")
}

/// One EnvoyPatchPolicy operation as Envoy Gateway applies it to a resource:
/// the JSONPath selects nodes (it must select at least one), `path` is
/// appended to each one's JSON Pointer, and the JSON Patch operation is
/// applied there.
fn apply_operation(resource: &mut serde_json::Value, operation: &Value) {
    let op = s(&operation["op"], "op");
    let path = operation["path"].as_str().unwrap_or("");
    let json_path = s(&operation["jsonPath"], "jsonPath");
    // Envoy Gateway's JSONPath library takes `..x` for `$..x`; RFC 9535 needs the `$`.
    let rfc_path = if json_path.starts_with('$') {
        json_path.to_string()
    } else {
        format!("${json_path}")
    };
    let query = serde_json_path::JsonPath::parse(&rfc_path)
        .unwrap_or_else(|e| panic!("jsonPath {json_path}: {e}"));
    let pointers: Vec<String> = query
        .query_located(resource)
        .locations()
        .map(|location| {
            format!(
                "{}/{}",
                location.to_json_pointer().trim_end_matches('/'),
                path.trim_start_matches('/')
            )
        })
        .collect();
    assert!(
        !pointers.is_empty(),
        "jsonPath {json_path} selects nothing in the generated listener:\n{resource:#}"
    );
    for pointer in pointers {
        let value = serde_json::to_value(&operation["value"]).unwrap();
        let patch: json_patch::Patch =
            serde_json::from_value(json!([{"op": op, "path": pointer, "value": value}])).unwrap();
        json_patch::patch(resource, &patch)
            .unwrap_or_else(|e| panic!("{op} {pointer} on the generated listener: {e}"));
    }
}

/// The example's policies as Envoy Gateway applies them.
fn with_the_example_policies() -> Policies {
    let resources = resources();
    Policies {
        listener_buffer_limit: quantity_bytes(
            &only(&resources, "ClientTrafficPolicy")["spec"]["connection"]["bufferLimit"],
        ),
        patched: true,
    }
}

/// The listener's one filter chain as a list, where the test launcher finds
/// the wasm filter (Envoy treats both alike for a chain without a match).
fn as_filter_chains(mut config: Value) -> Value {
    let listener = config["static_resources"]["listeners"][0]
        .as_mapping_mut()
        .unwrap();
    let chain = listener.remove("default_filter_chain").unwrap();
    listener.insert("filter_chains".into(), Value::Sequence(vec![chain]));
    config
}

fn start(config: Value) -> Envoy {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("envoy.yaml");
    std::fs::write(
        &path,
        serde_yaml::to_string(&as_filter_chains(config)).unwrap(),
    )
    .unwrap();
    Envoy::builder()
        .config_file(&path)
        .start()
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A chat request: a system prompt of `size` bytes that names the
/// conversation, then `question`.
fn chat_body(conversation: &str, size: usize, question: &str) -> String {
    let sentence = format!("{conversation}: the same long context again. ");
    let system = sentence.repeat(size / sentence.len() + 1);
    json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": &system[..size]},
            {"role": "user", "content": question},
        ],
    })
    .to_string()
}

fn post_chat(
    envoy: &Envoy,
    body: &str,
    timeout: Duration,
) -> Result<ureq::Response, Box<ureq::Error>> {
    ureq::post(&format!("{}/v1/chat/completions", envoy.base_url()))
        .timeout(timeout)
        .set("content-type", "application/json")
        .send_string(body)
        .map_err(Box::new)
}

#[test]
fn envoy_gateway_generated_config_with_the_patch_passes_envoy_validate() {
    let mut config = generated_config(
        &with_the_example_policies(),
        &["10.0.0.7:8000".parse().unwrap()],
    );
    set_wasm_filename(&mut config, &built_wasm());
    let plugin = &seq(
        &config["static_resources"]["listeners"][0]["default_filter_chain"]["filters"][0]
            ["typed_config"]["http_filters"],
        "http_filters",
    )[0]["typed_config"]["config"];
    assert_eq!(plugin["allow_on_headers_stop_iteration"], Value::Bool(true));
    assert_eq!(plugin["failure_policy"], "FAIL_RELOAD");
    assert_envoy_accepts(
        &config,
        "Envoy Gateway's configuration for the example, patched by its EnvoyPatchPolicy",
    );
}

/// With the example's policies, prompts from 100 bytes to past what the
/// filter reads reach the pods whole and keyed, and the turns of a
/// conversation stay on one pod.
#[test]
fn envoy_gateway_generated_config_routes_prompts_by_prefix() {
    let fleet = UpstreamFleet::start(3).unwrap();
    let envoy = start(generated_config(
        &with_the_example_policies(),
        &fleet.addrs(),
    ));
    for size in [100, 40_000, 300_000, 700_000] {
        let body = chat_body(&format!("prompt of {size}"), size, "and the question");
        post_chat(&envoy, &body, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("a {size}-byte prompt: {e}\n{}", envoy.log()));
        let record = fleet.records().pop().unwrap();
        assert_eq!(record.body_len, body.len(), "the {size}-byte prompt's body");
        assert!(
            record.header(KEY_HEADER).is_some(),
            "the filter wrote no key for the {size}-byte prompt"
        );
    }
    let pods: BTreeSet<String> = (0..4)
        .map(|turn| {
            let body = chat_body("one conversation", 20_000, &format!("question {turn}"));
            post_chat(&envoy, &body, Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("turn {turn}: {e}\n{}", envoy.log()))
                .header("x-served-by")
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(pods.len(), 1, "one conversation went to {pods:?}");
}

/// What the EnvoyPatchPolicy is for: without it (what Envoy Gateway
/// generates from the EnvoyExtensionPolicy alone) a request with a body hangs.
#[test]
fn without_the_patch_requests_with_a_body_hang() {
    let fleet = UpstreamFleet::start(1).unwrap();
    let policies = Policies {
        patched: false,
        ..with_the_example_policies()
    };
    let envoy = start(generated_config(&policies, &fleet.addrs()));
    let outcome = post_chat(&envoy, &chat_body("c", 1000, "q"), Duration::from_secs(2));
    // No answer within the client's timeout (a transport error, not a status).
    assert!(
        matches!(
            outcome.as_ref().map_err(|e| &**e),
            Err(ureq::Error::Transport(_))
        ) && fleet.records().is_empty(),
        "answered without allow_on_headers_stop_iteration: {outcome:?}"
    );
}

/// What the ClientTrafficPolicy is for: under Envoy Gateway's own 32 KiB
/// listener buffer Envoy refuses a 40 KB prompt while the filter reads it.
#[test]
fn without_the_client_traffic_policy_a_40_kb_prompt_is_refused() {
    let fleet = UpstreamFleet::start(1).unwrap();
    let policies = Policies {
        listener_buffer_limit: 32768,
        ..with_the_example_policies()
    };
    let envoy = start(generated_config(&policies, &fleet.addrs()));
    match post_chat(
        &envoy,
        &chat_body("c", 40_000, "q"),
        Duration::from_secs(10),
    ) {
        Err(error) if matches!(*error, ureq::Error::Status(413, _)) => {}
        other => panic!("a 40 KB prompt under a 32 KiB listener buffer: {other:?}"),
    }
}

/// Envoy with the example policies in front of `fleet`'s pods, and the
/// plugin's `concurrency_threshold`, once the filter read the pods from
/// Envoy's admin (`discovery`, through the cluster the EnvoyPatchPolicy
/// adds), not from traffic.
fn discovered(fleet: &UpstreamFleet) -> (Envoy, usize) {
    let envoy = start(generated_config(
        &with_the_example_policies(),
        &fleet.addrs(),
    ));
    let threshold = plugin_config(only(&resources(), "EnvoyExtensionPolicy"))
        ["concurrency_threshold"]
        .as_u64()
        .unwrap() as usize;
    wait_until(
        Duration::from_secs(10),
        || {
            envoy
                .stat("wasmcustom.prefix_router.discovery.instances")
                .unwrap()
        },
        |pods| *pods == Some(fleet.addrs().len() as u64),
        |pods| format!("the filter read {pods:?} pods from Envoy's admin"),
    );
    (envoy, threshold)
}

/// Sends `bodies` at once, each held 5 s at its pod so that all are in
/// flight together; the pod that served each.
fn burst(envoy: &Envoy, bodies: &[String]) -> Vec<String> {
    std::thread::scope(|scope| {
        let requests: Vec<_> = bodies
            .iter()
            .map(|body| {
                scope.spawn(move || {
                    ureq::post(&format!("{}/v1/chat/completions", envoy.base_url()))
                        .timeout(Duration::from_secs(20))
                        .set(prefix_router_tools::upstream::HOLD_HEADER, "5000")
                        .send_string(body)
                        .map_err(Box::new)
                        .unwrap_or_else(|e| panic!("burst: {e}"))
                        .header("x-served-by")
                        .unwrap()
                        .to_string()
                })
            })
            .collect();
        requests.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

/// Every request `fleet` received from the `from`th on named the pod that
/// served it in the host header: Envoy's override_host sent it to exactly
/// the pod the filter chose, not where Maglev maps its key.
fn assert_each_named_its_pod(fleet: &UpstreamFleet, from: usize) {
    let address_of: BTreeMap<String, String> = fleet
        .names()
        .into_iter()
        .zip(fleet.addrs().iter().map(SocketAddr::to_string))
        .collect();
    for record in &fleet.records()[from..] {
        assert_eq!(
            record.header(HOST_HEADER),
            Some(address_of[&record.instance].as_str()),
            "{} received a request naming another pod (or none)",
            record.instance
        );
    }
}

/// Overflow through the cluster the BackendTrafficPolicy makes: a burst on
/// one conversation past `concurrency_threshold` puts at most that many on
/// its pod; the filter names the pod of every request in the host header and
/// Envoy's override_host sends each one to exactly the pod named, those it
/// sends elsewhere included. The burst is the conversation's second request.
#[test]
fn envoy_gateway_generated_config_overflows_to_the_pod_the_filter_names() {
    let fleet = UpstreamFleet::start(3).unwrap();
    let (envoy, threshold) = discovered(&fleet);
    let body = chat_body("the hot conversation", 2000, "q");
    let target = post_chat(&envoy, &body, Duration::from_secs(10))
        .unwrap()
        .header("x-served-by")
        .unwrap()
        .to_string();
    let before = fleet.records().len();
    let served = burst(&envoy, &vec![body; threshold + 4]);
    // The cap holds on the conversation's pod; the rest went elsewhere.
    let on_target = served.iter().filter(|pod| **pod == target).count();
    assert!(on_target <= threshold, "the burst's pods: {served:?}");
    let elsewhere = fleet.records()[before..]
        .iter()
        .filter(|record| record.instance != target)
        .count();
    assert!(
        elsewhere >= served.len() - threshold,
        "the burst's pods: {served:?}"
    );
    assert_each_named_its_pod(&fleet, before);
}

/// Copies of one new prompt, all at once: none is held anywhere yet, and
/// still at most `concurrency_threshold` go to the pod they all rank first;
/// the filter places them itself over the pods it read, rather than leaving
/// them to Maglev, which maps them all alike.
#[test]
fn envoy_gateway_generated_config_caps_a_burst_of_new_conversations() {
    let fleet = UpstreamFleet::start(3).unwrap();
    let (envoy, threshold) = discovered(&fleet);
    let bodies = vec![chat_body("a new prompt", 2000, "q"); threshold + 4];
    let served = burst(&envoy, &bodies);
    let mut per_pod: BTreeMap<&str, usize> = BTreeMap::new();
    for pod in &served {
        *per_pod.entry(pod).or_default() += 1;
    }
    assert!(
        per_pod.values().all(|n| *n <= threshold),
        "the burst's pods: {per_pod:?}"
    );
    assert_each_named_its_pod(&fleet, 0);
}
