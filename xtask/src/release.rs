//! `cargo xtask release`: the release build of the filter and everything a
//! release publishes, in `target/dist/`:
//!
//! - `prefix_router.wasm` and `SHA256SUMS` (the module's and the archive's);
//! - `oci/`: the module as an OCI image layout (`prefix_router_tools::oci`),
//!   tagged with the package version, for `oras cp --from-oci-layout` or
//!   `skopeo copy oci:` to push to a registry (Istio's `oci://` URLs);
//! - `prefix-router-<version>-oci.tar`: the same layout as one file
//!   (`skopeo copy oci-archive:`);
//! - `docker/`: a build context for the same image with `docker build`
//!   (`docker/plugin.Dockerfile` and the module).

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use prefix_router_tools::envoy;
use prefix_router_tools::oci::{self, Blob};

/// The module's file name in `target/dist/` and the Docker build context.
const WASM_NAME: &str = "prefix_router.wasm";

/// What a release produced.
#[derive(Debug)]
pub struct Release {
    pub dir: PathBuf,
    pub wasm_sha256: String,
    pub wasm_size: u64,
    pub manifest: Blob,
    pub archive: PathBuf,
}

pub fn run() -> anyhow::Result<()> {
    crate::prereqs::ensure_all()?;
    let wasm = crate::run::build_wasm()?;
    let root = envoy::workspace_root();
    let version = package_version(&fs::read_to_string(root.join("Cargo.toml"))?)?;
    let dockerfile = root.join("docker").join("plugin.Dockerfile");
    let release = prepare(
        &wasm,
        &version,
        &dockerfile,
        &envoy::target_dir().join("dist"),
    )?;
    let reference = format!("REGISTRY/prefix-router:{version}");
    println!("version:  {version}");
    println!(
        "filter:   {} ({} bytes)",
        release.dir.join(WASM_NAME).display(),
        release.wasm_size
    );
    println!(
        "sha256:   {}  (the module; https:// URLs pin this)",
        release.wasm_sha256
    );
    println!(
        "image:    {} (OCI layout)",
        release.dir.join("oci").display()
    );
    println!("archive:  {}", release.archive.display());
    println!(
        "manifest: {}  (the image; oci:// URLs pin this)",
        release.manifest.digest
    );
    println!();
    println!("Push the image as it is, so the registry keeps this digest (docs/istio.md):");
    println!(
        "  oras cp --from-oci-layout {}:{version} {reference}",
        release.dir.join("oci").display()
    );
    println!(
        "  # or: skopeo copy --preserve-digests oci:{}:{version} docker://{reference}",
        release.dir.join("oci").display()
    );
    println!(
        "then deploy oci://REGISTRY/prefix-router@{}",
        release.manifest.digest
    );
    Ok(())
}

/// Fills `dir` (replacing what an earlier release left there) from the
/// built module `wasm`.
pub fn prepare(
    wasm: &Path,
    version: &str,
    dockerfile: &Path,
    dir: &Path,
) -> anyhow::Result<Release> {
    let bytes = fs::read(wasm).with_context(|| format!("reading {}", wasm.display()))?;
    if !bytes.starts_with(b"\0asm") {
        bail!("{} is not a WebAssembly module", wasm.display());
    }
    if dir.exists() {
        fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    let docker = dir.join("docker");
    fs::create_dir_all(&docker).with_context(|| format!("creating {}", docker.display()))?;
    fs::write(dir.join(WASM_NAME), &bytes)?;
    fs::write(docker.join(WASM_NAME), &bytes)?;
    fs::copy(dockerfile, docker.join("Dockerfile"))
        .with_context(|| format!("copying {}", dockerfile.display()))?;

    let layout = oci::write_layout(&bytes, version, &dir.join("oci"))?;
    let archive_name = format!("prefix-router-{version}-oci.tar");
    let archive = dir.join(&archive_name);
    oci::write_archive(&layout.dir, &archive)?;

    let wasm_sha256 = oci::sha256_hex(&bytes);
    let archive_sha256 = oci::sha256_hex(&fs::read(&archive)?);
    fs::write(
        dir.join("SHA256SUMS"),
        format!("{wasm_sha256}  {WASM_NAME}\n{archive_sha256}  {archive_name}\n"),
    )?;
    Ok(Release {
        dir: dir.to_path_buf(),
        wasm_sha256,
        wasm_size: bytes.len() as u64,
        manifest: layout.manifest,
        archive,
    })
}

/// The `version` of the `[package]` section of a Cargo.toml.
fn package_version(manifest: &str) -> anyhow::Result<String> {
    let mut in_package = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_package = line == "[package]";
        } else if let (true, Some(value)) = (in_package, line.strip_prefix("version")) {
            let value = value.trim_start().trim_start_matches('=').trim();
            if let Some(version) = value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
                return Ok(version.to_string());
            }
        }
    }
    bail!("no version in the [package] section of Cargo.toml")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_release_holds_the_module_its_checksums_the_image_and_a_docker_context() {
        let dir = tempfile::tempdir().unwrap();
        let wasm = dir.path().join("in.wasm");
        fs::write(&wasm, b"\0asm\x01\0\0\0").unwrap();
        let dockerfile = envoy::workspace_root()
            .join("docker")
            .join("plugin.Dockerfile");
        let out = dir.path().join("dist");
        fs::create_dir_all(&out).unwrap();
        fs::write(out.join("stale"), b"old").unwrap();

        let release = prepare(&wasm, "9.8.7", &dockerfile, &out).unwrap();
        // sha256 of the 8 bytes above, computed independently (sha256sum).
        let expected = "93a44bbb96c751218e4c00d479e4c14358122a389acca16205b1e4d0dc5f9476";
        assert_eq!(release.wasm_sha256, expected);
        assert_eq!(release.wasm_size, 8);
        for copy in [out.join(WASM_NAME), out.join("docker").join(WASM_NAME)] {
            assert_eq!(fs::read(copy).unwrap(), b"\0asm\x01\0\0\0");
        }
        assert_eq!(
            fs::read(out.join("docker/Dockerfile")).unwrap(),
            fs::read(&dockerfile).unwrap()
        );
        let archive = out.join("prefix-router-9.8.7-oci.tar");
        assert_eq!(release.archive, archive);
        assert_eq!(
            fs::read_to_string(out.join("SHA256SUMS")).unwrap(),
            format!(
                "{expected}  {WASM_NAME}\n{}  prefix-router-9.8.7-oci.tar\n",
                oci::sha256_hex(&fs::read(&archive).unwrap())
            )
        );
        let index = fs::read_to_string(out.join("oci/index.json")).unwrap();
        assert!(
            index.contains(&release.manifest.digest) && index.contains("\"9.8.7\""),
            "{index}"
        );
        assert!(!out.join("stale").exists());
    }

    #[test]
    fn refuses_a_file_that_is_not_wasm() {
        let dir = tempfile::tempdir().unwrap();
        let wasm = dir.path().join("in.wasm");
        fs::write(&wasm, b"not wasm").unwrap();
        let dockerfile = envoy::workspace_root()
            .join("docker")
            .join("plugin.Dockerfile");
        assert!(prepare(&wasm, "1.0.0", &dockerfile, &dir.path().join("dist")).is_err());
    }

    #[test]
    fn the_version_is_the_package_sections() {
        let manifest = "[workspace]\nversion = \"0.0.1\"\n\n[package]\nname = \"x\"\nversion = \"0.2.0\"\n\n[dependencies]\nversion = \"9\"\n";
        assert_eq!(package_version(manifest).unwrap(), "0.2.0");
        assert!(package_version("[package]\nname = \"x\"\n").is_err());
        let root = fs::read_to_string(envoy::workspace_root().join("Cargo.toml")).unwrap();
        assert!(package_version(&root).is_ok());
    }
}
