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

use serde_yaml::Value;

use support::*;

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
