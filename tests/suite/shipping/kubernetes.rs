//! The Kubernetes example without a mesh (`examples/kubernetes/`): its
//! manifests pass Kubernetes' schemas and agree with each other, with the
//! Envoy configuration they mount and with docker-compose; that Envoy
//! configuration passes `envoy --mode validate`. Not applied to a cluster.
//!
//! Envoy comes from `ENVOY_BIN` or PATH; the filter from `PREFIX_ROUTER_WASM`
//! or the release build (`cargo xtask test` provides both).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use prefix_router_tools::envoy::Envoy;
use prefix_router_tools::upstream::UpstreamFleet;
use serde_yaml::Value;

use support::*;

mod kube {
    use super::*;

    pub const DIR: &str = "examples/kubernetes";

    /// Every resource kustomization.yaml lists, by (kind, name).
    pub fn resources() -> BTreeMap<(String, String), Value> {
        let kustomization = yaml(&format!("{DIR}/kustomization.yaml"));
        let mut out = BTreeMap::new();
        for rel in strings(&kustomization["resources"], "resources") {
            for doc in yaml_documents(&format!("{DIR}/{rel}")) {
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
    assert_kubernetes_schemas_accept(&files);
}

/// The decision header is on here (vLLM does not name the pod that served),
/// off in `envoy/envoy.yaml`: removes its line from the listener filter's
/// configuration, failing unless it is there once with that name.
fn remove_decision_header(config: &mut Value) {
    let filter = seq(&hcm(config)["http_filters"], "http_filters")
        .iter()
        .position(|f| f["typed_config"]["@type"] == WASM_TYPE)
        .expect("no wasm HTTP filter");
    let value = &mut config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"][filter]["typed_config"]["config"]["configuration"]
        ["value"];
    let text = s(value, "plugin configuration").to_string();
    let line = format!("\"decision_header\": \"{DECISION_HEADER}\"");
    let mut lines: Vec<&str> = text.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.trim() == line)
        .unwrap_or_else(|| panic!("no `{line}` line in the plugin configuration:\n{text}"));
    lines.remove(at);
    let previous = lines[at - 1].trim_end_matches(',').to_string();
    lines[at - 1] = &previous;
    *value = Value::String(lines.join("\n") + "\n");
}

const DECISION_HEADER: &str = "x-prefix-route-decision";

#[test]
fn kubernetes_envoy_config_differs_from_envoy_yaml_only_where_the_cluster_needs_it() {
    let rel = format!("{}/envoy.yaml", kube::DIR);
    let mut config = yaml(&rel);
    remove_discovery(&mut config);
    remove_decision_header(&mut config);
    assert_config_only_deployment_differs(config, &rel);
}

#[test]
fn kubernetes_envoy_config_passes_envoy_validate() {
    let rel = format!("{}/envoy.yaml", kube::DIR);
    let mut config = yaml(&rel);
    set_wasm_filename(&mut config, &built_wasm());
    assert_envoy_accepts(&config, &rel);
}

/// The filter travels as a ConfigMap's binaryData, base64 in the object, and
/// a ConfigMap holds at most 1 MiB. Applied client-side, kubectl would also
/// copy the whole object into an annotation of at most 256 KiB, so every
/// documented apply is server-side.
#[test]
fn the_filter_fits_a_config_map_and_is_applied_server_side() {
    let bytes = std::fs::metadata(built_wasm())
        .expect("the built filter")
        .len();
    let base64 = bytes.div_ceil(3) * 4;
    let room = (1u64 << 20) - 4096; // what a ConfigMap's name and labels leave
    assert!(
        base64 <= room,
        "the filter is {bytes} bytes, {base64} as base64: over a ConfigMap's 1 MiB"
    );
    for rel in [
        "docs/kubernetes.md",
        "examples/kubernetes/kustomization.yaml",
        "examples/kubernetes/prefix-router.yaml",
    ] {
        let text = read(rel);
        let applies: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("kubectl apply"))
            .collect();
        assert!(!applies.is_empty(), "{rel} says how to apply");
        for line in applies {
            assert!(line.contains("--server-side"), "{rel}: {line}");
        }
    }
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
        if cluster["name"] == "envoy_admin" {
            // `discovery` reads the fleet from Envoy's own admin in the pod.
            assert_eq!(
                endpoints(&cluster["load_assignment"]),
                [("127.0.0.1".to_string(), admin)]
            );
            continue;
        }
        assert_eq!(cluster["type"], "STRICT_DNS");
        assert_eq!(
            endpoints(&cluster["load_assignment"]),
            // The short name, resolved in the pod's namespace (see
            // the_clusters_short_name_resolves_in_the_pods_namespace).
            [(
                s(&headless["metadata"]["name"], "name").to_string(),
                headless_port
            )]
        );
    }
}

// ---------------------------------------------------------------------------
// kustomize: what `kubectl apply -k` would send
// ---------------------------------------------------------------------------

/// `examples/kubernetes` copied into `dir/base` (with the built filter unless
/// `with_wasm` is false) and an overlay `dir/overlay` that sets `namespace`.
fn kustomize_tree(dir: &std::path::Path, namespace: &str, with_wasm: bool) {
    let base = dir.join("base");
    std::fs::create_dir_all(&base).unwrap();
    for entry in std::fs::read_dir(root().join(kube::DIR)).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            std::fs::copy(&path, base.join(path.file_name().unwrap())).unwrap();
        }
    }
    if with_wasm {
        std::fs::copy(built_wasm(), base.join("prefix_router.wasm")).unwrap();
    }
    let overlay = dir.join("overlay");
    std::fs::create_dir_all(&overlay).unwrap();
    std::fs::write(
        overlay.join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\n\
             kind: Kustomization\n\
             namespace: {namespace}\n\
             resources:\n  - ../base\n"
        ),
    )
    .unwrap();
}

/// `kubectl kustomize DIR`: the rendered YAML, or kustomize's error.
fn kustomize(dir: &std::path::Path) -> Result<String, String> {
    let output = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run kubectl ({e}): install kubectl, whose `kustomize` renders the example"
            )
        });
    if output.status.success() {
        Ok(String::from_utf8(output.stdout).expect("kustomize output is UTF-8"))
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

/// A kustomize `namespace:` (an overlay's, as users set it) moves every
/// object, and nothing in the rendered objects, the Envoy configuration
/// included, still names the `default` namespace; the rendered Envoy
/// configuration passes `envoy --mode validate` and every rendered object
/// (the generated ConfigMaps too) passes Kubernetes' schemas.
#[test]
fn a_kustomize_namespace_moves_everything_and_envoy_accepts_the_rendered_config() {
    let dir = tempfile::tempdir().unwrap();
    kustomize_tree(dir.path(), "llm", true);
    let rendered = kustomize(&dir.path().join("overlay")).unwrap_or_else(|e| panic!("{e}"));
    let documents: Vec<Value> = serde_yaml::Deserializer::from_str(&rendered)
        .map(|doc| <Value as serde::Deserialize>::deserialize(doc).unwrap())
        .collect();
    assert_eq!(documents.len(), 5, "2 Services, a Deployment, 2 ConfigMaps");
    for doc in &documents {
        assert_eq!(
            doc["metadata"]["namespace"],
            "llm",
            "{} {:?} is not in the overlay's namespace",
            s(&doc["kind"], "kind"),
            doc["metadata"]["name"]
        );
    }
    let envoy_config_map = documents
        .iter()
        .find(|d| {
            d["kind"] == "ConfigMap"
                && s(&d["metadata"]["name"], "name").starts_with("prefix-router-envoy-")
        })
        .expect("no generated prefix-router-envoy ConfigMap");
    let envoy_yaml = s(&envoy_config_map["data"]["envoy.yaml"], "envoy.yaml");
    for text in [rendered.as_str(), envoy_yaml] {
        assert!(
            !text.contains(".default.") && !text.contains("namespace: default"),
            "the default namespace is still named:\n{text}"
        );
    }
    let mut config: Value = serde_yaml::from_str(envoy_yaml).unwrap();
    set_wasm_filename(&mut config, &built_wasm());
    assert_envoy_accepts(
        &config,
        "the rendered prefix-router-envoy ConfigMap's envoy.yaml",
    );

    let rendered_path = dir.path().join("rendered.yaml");
    std::fs::write(&rendered_path, &rendered).unwrap();
    assert_kubernetes_schemas_accept(&[&rendered_path]);
}

/// Before the documented `cp` of the built filter, `kubectl apply -k`
/// applies nothing: kustomize stops and names the file it misses.
#[test]
fn without_the_built_filter_kustomize_stops_and_names_the_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    kustomize_tree(dir.path(), "llm", false);
    let error = kustomize(&dir.path().join("overlay"))
        .expect_err("kustomize rendered the example without the filter");
    assert!(
        error.contains("base/prefix_router.wasm") && error.contains("no such file"),
        "kustomize's error does not name the missing filter:\n{error}"
    );
}

// ---------------------------------------------------------------------------
// The Service's short name, resolved the way a pod resolves it
// ---------------------------------------------------------------------------

/// A DNS server on loopback for one name: answers `name` with 127.0.0.1
/// and every other query with NXDOMAIN, and records what was asked.
struct OneNameDns {
    addr: std::net::SocketAddr,
    asked: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl OneNameDns {
    fn start(name: &str) -> Self {
        use std::sync::atomic::Ordering;
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        socket
            .set_read_timeout(Some(std::time::Duration::from_millis(100)))
            .unwrap();
        let addr = socket.local_addr().unwrap();
        let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (name, log, halt) = (name.to_string(), asked.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while !halt.load(Ordering::Relaxed) {
                let Ok((len, from)) = socket.recv_from(&mut buf) else {
                    continue;
                };
                if let Some((reply, asked)) = Self::answer(&buf[..len], &name) {
                    log.lock().unwrap().push(asked);
                    let _ = socket.send_to(&reply, from);
                }
            }
        });
        OneNameDns { addr, asked, stop }
    }

    /// The reply to one query (header, its question, an A record for the
    /// name) and the name asked; None for what is not a query.
    fn answer(query: &[u8], name: &str) -> Option<(Vec<u8>, String)> {
        let mut at = 12;
        let mut labels = Vec::new();
        while *query.get(at)? != 0 {
            let len = usize::from(query[at]);
            labels.push(String::from_utf8_lossy(query.get(at + 1..at + 1 + len)?).into_owned());
            at += 1 + len;
        }
        let question_end = at + 5; // the root label, QTYPE, QCLASS
        let qtype = u16::from_be_bytes([*query.get(at + 1)?, *query.get(at + 2)?]);
        let asked = labels.join(".");
        let found = asked == name && qtype == 1;
        let mut reply = query[..2].to_vec(); // the query's id
        reply.extend_from_slice(&if found { [0x81, 0x80] } else { [0x81, 0x83] });
        reply.extend_from_slice(&[0, 1, 0, u8::from(found), 0, 0, 0, 0]);
        reply.extend_from_slice(query.get(12..question_end)?);
        if found {
            // A pointer to the question's name, type A, class IN, TTL 5 s, 127.0.0.1.
            reply.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 5, 0, 4, 127, 0, 0, 1]);
        }
        Some((reply, asked))
    }

    fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().clone()
    }
}

impl Drop for OneNameDns {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// What a pod's /etc/resolv.conf gives Envoy in namespace `llm`: its search
/// path (here through c-ares' LOCALDOMAIN) and the cluster's DNS server
/// (here a loopback one that knows only the Service's full name in `llm`).
/// The shipped configuration's short name reaches the pods there: requests
/// are served, through the filter, whose decision header names the pod.
#[test]
fn the_clusters_short_name_resolves_in_the_pods_namespace() {
    let fleet = UpstreamFleet::start(1).unwrap();
    let dns = OneNameDns::start("vllm-headless.llm.svc.cluster.local");
    let (dns_addr, port) = (dns.addr, fleet.addrs()[0].port());
    let envoy = Envoy::builder()
        .config_file(root().join(kube::DIR).join("envoy.yaml"))
        .env(
            "LOCALDOMAIN",
            "llm.svc.cluster.local svc.cluster.local cluster.local",
        )
        .edit(move |config| {
            let resolver: Value = serde_yaml::from_str(&format!(
                "name: envoy.network.dns_resolver.cares\n\
                 typed_config:\n  \
                 \"@type\": type.googleapis.com/envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig\n  \
                 resolvers: [{{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }}]\n",
                dns_addr.port()
            ))?;
            for cluster in clusters_mut(config) {
                let socket = &mut cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
                    ["endpoint"]["address"]["socket_address"];
                socket["port_value"] = Value::from(port);
                cluster["typed_dns_resolver_config"] = resolver.clone();
            }
            Ok(())
        })
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    let response = wait_until(
        std::time::Duration::from_secs(15),
        || {
            ureq::post(&format!("{}/v1/completions", envoy.base_url()))
                .timeout(std::time::Duration::from_secs(5))
                .send_string(r#"{"model": "m", "prompt": "hello"}"#)
                .map_err(Box::new)
        },
        |response| response.is_ok(),
        |response| format!("{response:?}; DNS asked {:?}\n{}", dns.asked(), envoy.log()),
    )
    .unwrap();
    assert_eq!(
        response.header("x-served-by"),
        Some(fleet.names()[0].as_str())
    );
    let decision = response
        .header(DECISION_HEADER)
        .unwrap_or_else(|| panic!("no {DECISION_HEADER} in the response"));
    assert!(
        decision.contains(&format!("instance={}", fleet.addrs()[0])),
        "{DECISION_HEADER}: {decision}"
    );
    assert!(
        dns.asked()
            .iter()
            .all(|name| name.starts_with("vllm-headless.")),
        "Envoy asked for {:?}",
        dns.asked()
    );
}
