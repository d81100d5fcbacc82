//! The filter as an OCI image layout (image-spec v1.1 `oci-layout`,
//! `index.json`, `blobs/sha256/`), written without a container engine: one
//! manifest, an image config and a single gzipped-tar layer holding
//! `plugin.wasm`. That is the "compat" Wasm image Istio's and Envoy Gateway's
//! `oci://` fetchers unpack (the last layer, media type
//! `application/vnd.oci.image.layer.v1.tar+gzip`, its `plugin.wasm`), and an
//! ordinary image `oras cp --from-oci-layout` and `skopeo copy oci:` push as is.
//!
//! Deterministic: no timestamps, owners or host paths, so the same module
//! always gives the same digests and the manifest digest can be pinned before
//! the push.

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use serde_json::json;
use sha2::{Digest as _, Sha256};

pub const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
pub const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// The file name Istio's fetcher looks for in the layer.
pub const WASM_FILE: &str = "plugin.wasm";
/// The annotation naming a manifest's tag in `index.json`.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// A content-addressed blob as a descriptor names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    /// `sha256:<hex>`
    pub digest: String,
    pub size: u64,
}

/// What [`write_layout`] wrote.
#[derive(Debug, Clone)]
pub struct Layout {
    pub dir: PathBuf,
    pub manifest: Blob,
    pub config: Blob,
    pub layer: Blob,
}

/// Writes the image layout of `wasm` into `dir` (replacing whatever is
/// there), its manifest tagged `tag`.
pub fn write_layout(wasm: &[u8], tag: &str, dir: &Path) -> anyhow::Result<Layout> {
    if !wasm.starts_with(b"\0asm") {
        bail!("not a WebAssembly module (no \\0asm magic)");
    }
    if dir.exists() {
        fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    let blobs = dir.join("blobs").join("sha256");
    fs::create_dir_all(&blobs).with_context(|| format!("creating {}", blobs.display()))?;
    let put = |bytes: &[u8]| -> anyhow::Result<Blob> {
        let hex = sha256_hex(bytes);
        fs::write(blobs.join(&hex), bytes)?;
        Ok(Blob {
            digest: format!("sha256:{hex}"),
            size: bytes.len() as u64,
        })
    };

    let tar = layer_tar(wasm)?;
    let diff_id = format!("sha256:{}", sha256_hex(&tar));
    let layer = put(&gzip(&tar)?)?;
    // image-spec requires architecture and os; GOARCH/GOOS name WASI modules this way.
    let config = put(&to_json(&json!({
        "architecture": "wasm",
        "os": "wasip1",
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "config": {},
    })))?;
    let manifest = put(&to_json(&json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": descriptor(CONFIG_MEDIA_TYPE, &config),
        "layers": [descriptor(LAYER_MEDIA_TYPE, &layer)],
    })))?;
    let mut tagged = descriptor(MANIFEST_MEDIA_TYPE, &manifest);
    tagged["annotations"] = json!({ REF_NAME: tag });
    fs::write(
        dir.join("index.json"),
        to_json(&json!({
            "schemaVersion": 2,
            "mediaType": INDEX_MEDIA_TYPE,
            "manifests": [tagged],
        })),
    )?;
    fs::write(
        dir.join("oci-layout"),
        to_json(&json!({"imageLayoutVersion": "1.0.0"})),
    )?;
    Ok(Layout {
        dir: dir.to_path_buf(),
        manifest,
        config,
        layer,
    })
}

/// A tar of `layout`'s directory (what `skopeo copy oci-archive:` reads), its
/// entries in a fixed order with no timestamps or owners.
pub fn write_archive(layout: &Path, archive: &Path) -> anyhow::Result<()> {
    let mut files = Vec::new();
    collect_files(layout, layout, &mut files)?;
    files.sort();
    let mut builder = tar::Builder::new(Vec::new());
    for rel in files {
        let bytes = fs::read(layout.join(&rel))?;
        let name = rel
            .iter()
            .map(|part| part.to_string_lossy())
            .collect::<Vec<_>>()
            .join("/");
        append(&mut builder, &name, &bytes)?;
    }
    fs::write(archive, builder.into_inner()?)
        .with_context(|| format!("writing {}", archive.display()))
}

fn collect_files(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            collect_files(root, &path, out)?;
        } else {
            out.push(path.strip_prefix(root)?.to_path_buf());
        }
    }
    Ok(())
}

/// The layer's uncompressed content: `plugin.wasm` alone.
fn layer_tar(wasm: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    append(&mut builder, WASM_FILE, wasm)?;
    Ok(builder.into_inner()?)
}

/// One regular file, mode 0644, owned by root, dated 1970.
fn append(builder: &mut tar::Builder<Vec<u8>>, name: &str, bytes: &[u8]) -> anyhow::Result<()> {
    let mut header = tar::Header::new_ustar();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_path(name)?;
    header.set_size(bytes.len() as u64);
    header.set_mode(0o644);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    header.set_cksum();
    builder.append(&header, bytes)?;
    Ok(())
}

/// gzip without a file name or time (flate2 writes neither unless asked).
fn gzip(bytes: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut encoder = flate2::GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), flate2::Compression::best());
    encoder.write_all(bytes)?;
    Ok(encoder.finish()?)
}

fn descriptor(media_type: &str, blob: &Blob) -> serde_json::Value {
    json!({"mediaType": media_type, "digest": blob.digest, "size": blob.size})
}

/// Compact JSON: the same value always gives the same bytes.
fn to_json(value: &serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}
