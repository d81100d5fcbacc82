//! The plugin's OCI image, as `cargo xtask release` writes it
//! (`prefix_router_tools::oci`): an image layout per the OCI image spec whose
//! single gzipped-tar layer holds `plugin.wasm`, the "compat" Wasm image
//! Istio's `oci://` fetcher unpacks; every digest and size checked here
//! from the bytes, the whole layout by `umoci` (`cargo xtask test` provides
//! it in UMOCI, from Debian's package). Also the Docker path
//! (`docker/plugin.Dockerfile`): a `FROM scratch` image holding only
//! `/plugin.wasm`.

mod support;

use std::collections::BTreeSet;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use prefix_router_tools::oci;
use serde_json::Value;

use support::*;

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

fn built_module() -> Vec<u8> {
    std::fs::read(built_wasm()).unwrap()
}

/// The built module, and its image layout (tagged 1.2.3) in a fresh
/// directory (`oci/` in the temporary directory returned with it).
fn layout_of_the_built_module() -> (Vec<u8>, tempfile::TempDir, PathBuf, oci::Layout) {
    let wasm = built_module();
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("oci");
    let written = oci::write_layout(&wasm, "1.2.3", &layout).unwrap();
    (wasm, dir, layout, written)
}

fn json_file(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The blob a descriptor names, after checking that its digest and size are
/// those of the file's bytes.
fn blob(layout: &Path, descriptor: &Value, media_type: &str) -> Vec<u8> {
    assert_eq!(descriptor["mediaType"], media_type, "{descriptor}");
    let digest = descriptor["digest"].as_str().expect("digest");
    let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
    let bytes = std::fs::read(layout.join("blobs/sha256").join(hex)).unwrap();
    assert_eq!(
        oci::sha256_hex(&bytes),
        hex,
        "blob content is not its digest"
    );
    assert_eq!(descriptor["size"].as_u64(), Some(bytes.len() as u64));
    bytes
}

#[test]
fn the_release_image_layout_is_a_valid_oci_image_holding_plugin_wasm() {
    let (wasm, _dir, layout, written) = layout_of_the_built_module();

    assert_eq!(
        json_file(&layout.join("oci-layout")),
        serde_json::json!({"imageLayoutVersion": "1.0.0"})
    );
    let index = json_file(&layout.join("index.json"));
    assert_eq!(index["schemaVersion"], 2);
    assert_eq!(index["mediaType"], oci::INDEX_MEDIA_TYPE);
    let manifests = index["manifests"].as_array().unwrap();
    assert_eq!(manifests.len(), 1, "{index}");
    assert_eq!(manifests[0]["annotations"][oci::REF_NAME], "1.2.3");
    assert_eq!(manifests[0]["digest"], written.manifest.digest.as_str());

    let manifest: Value =
        serde_json::from_slice(&blob(&layout, &manifests[0], oci::MANIFEST_MEDIA_TYPE)).unwrap();
    assert_eq!(manifest["schemaVersion"], 2);
    assert_eq!(manifest["mediaType"], oci::MANIFEST_MEDIA_TYPE);
    let config: Value =
        serde_json::from_slice(&blob(&layout, &manifest["config"], oci::CONFIG_MEDIA_TYPE))
            .unwrap();
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "{manifest}");
    let layer = blob(&layout, &layers[0], oci::LAYER_MEDIA_TYPE);

    // The config's diff_id is the digest of the layer uncompressed.
    let mut tar_bytes = Vec::new();
    flate2::read::GzDecoder::new(&layer[..])
        .read_to_end(&mut tar_bytes)
        .unwrap();
    assert_eq!(config["rootfs"]["type"], "layers");
    assert_eq!(
        config["rootfs"]["diff_ids"],
        serde_json::json!([format!("sha256:{}", oci::sha256_hex(&tar_bytes))])
    );
    assert!(config["architecture"].is_string() && config["os"].is_string());

    // The layer: plugin.wasm alone, byte for byte the module.
    let mut archive = tar::Archive::new(&tar_bytes[..]);
    let mut entries = Vec::new();
    for entry in archive.entries().unwrap() {
        let mut entry = entry.unwrap();
        let name = entry.path().unwrap().to_string_lossy().into_owned();
        let mut content = Vec::new();
        entry.read_to_end(&mut content).unwrap();
        entries.push((name, content));
    }
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].0, oci::WASM_FILE);
    assert!(
        entries[0].1 == wasm,
        "the layer's plugin.wasm is not the module"
    );

    // Nothing in blobs/ that no descriptor names.
    let stored: BTreeSet<String> = std::fs::read_dir(layout.join("blobs/sha256"))
        .unwrap()
        .map(|e| format!("sha256:{}", e.unwrap().file_name().to_string_lossy()))
        .collect();
    let named: BTreeSet<String> = [&written.manifest, &written.config, &written.layer]
        .iter()
        .map(|b| b.digest.clone())
        .collect();
    assert_eq!(stored, named);
}

/// Every file under `dir`, by relative path, with its bytes.
fn tree(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else {
                let bytes = std::fs::read(&path).unwrap();
                files.push((path.strip_prefix(dir).unwrap().to_path_buf(), bytes));
            }
        }
    }
    files.sort();
    files
}

#[test]
fn the_same_module_gives_the_same_image_and_archive_byte_for_byte() {
    let wasm = built_module();
    let dir = tempfile::tempdir().unwrap();
    let mut builds = Vec::new();
    for run in ["a", "b"] {
        let layout = dir.path().join(run);
        let written = oci::write_layout(&wasm, "1.2.3", &layout).unwrap();
        let archive = dir.path().join(format!("{run}.tar"));
        oci::write_archive(&layout, &archive).unwrap();
        builds.push((
            written.manifest,
            tree(&layout),
            std::fs::read(archive).unwrap(),
        ));
    }
    assert_eq!(builds[0].0, builds[1].0, "manifest digests differ");
    assert!(builds[0].1 == builds[1].1, "layouts differ");
    assert!(builds[0].2 == builds[1].2, "archives differ");

    // Another module, another image.
    let mut other = wasm.clone();
    other.push(0);
    let written = oci::write_layout(&other, "1.2.3", &dir.path().join("c")).unwrap();
    assert_ne!(written.manifest, builds[0].0);
}

/// `umoci` (`cargo xtask test` provides it in UMOCI).
fn umoci() -> PathBuf {
    match std::env::var_os("UMOCI").filter(|v| !v.is_empty()) {
        Some(path) => PathBuf::from(path),
        None => PathBuf::from("umoci"),
    }
}

const UMOCI_HINT: &str =
    "run the tests with `cargo xtask test`, which fetches it, or put umoci on PATH or in UMOCI";

/// `umoci raw unpack` of `layout:tag` into `rootfs`: reads the index, the
/// manifest and the config and extracts the layers, checking each blob's
/// digest and size.
fn umoci_unpack(layout: &Path, tag: &str, rootfs: &Path) -> std::process::Output {
    Command::new(umoci())
        .args(["raw", "unpack", "--rootless", "--image"])
        .arg(format!("{}:{tag}", layout.display()))
        .arg(rootfs)
        .output()
        .unwrap_or_else(|e| panic!("umoci: {e}; {UMOCI_HINT}"))
}

#[test]
fn umoci_unpacks_the_image_to_plugin_wasm_and_refuses_a_corrupted_copy() {
    let (wasm, dir, layout, written) = layout_of_the_built_module();
    let rootfs = dir.path().join("rootfs");
    let out = umoci_unpack(&layout, "1.2.3", &rootfs);
    assert!(
        out.status.success(),
        "umoci refused the layout:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let names: Vec<String> = std::fs::read_dir(&rootfs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, [oci::WASM_FILE]);
    assert!(std::fs::read(rootfs.join(oci::WASM_FILE)).unwrap() == wasm);

    // The same layout with one byte of the layer changed: umoci must notice.
    let hex = written.layer.digest.trim_start_matches("sha256:");
    let path = layout.join("blobs/sha256").join(hex);
    let mut layer = std::fs::read(&path).unwrap();
    let last = layer.len() - 1;
    layer[last] ^= 0xff;
    std::fs::write(&path, layer).unwrap();
    let out = umoci_unpack(&layout, "1.2.3", &dir.path().join("rootfs-corrupted"));
    assert!(
        !out.status.success(),
        "umoci unpacked a layer whose bytes are not its digest"
    );
}
