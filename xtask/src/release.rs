//! `cargo xtask release`: the release build of the filter, its sha256 and size
//! (so users can pin exactly what they deploy), and a ready build context for
//! the OCI image Istio's `oci://` URLs load (`target/oci/`: the Dockerfile from
//! `docker/plugin.Dockerfile`, `prefix_router.wasm`, `SHA256SUMS`).

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use prefix_router_tools::envoy;
use sha2::{Digest as _, Sha256};

/// The file name inside the build context; the Dockerfile copies it to /plugin.wasm.
const WASM_NAME: &str = "prefix_router.wasm";

/// What a release produced.
#[derive(Debug)]
pub struct Artifact {
    pub context: PathBuf,
    pub sha256: String,
    pub size: u64,
}

pub fn run() -> anyhow::Result<()> {
    crate::prereqs::ensure_all()?;
    let wasm = crate::run::build_wasm()?;
    let dockerfile = envoy::workspace_root()
        .join("docker")
        .join("plugin.Dockerfile");
    let context = envoy::target_dir().join("oci");
    let artifact = prepare_context(&wasm, &dockerfile, &context)?;
    println!("filter:  {}", wasm.display());
    println!("size:    {} bytes", artifact.size);
    println!("sha256:  {}", artifact.sha256);
    println!("context: {}", artifact.context.display());
    println!();
    println!("OCI image for Istio (docs/istio.md):");
    println!(
        "  docker build -t REGISTRY/prefix-router:TAG {}",
        artifact.context.display()
    );
    println!("  docker push REGISTRY/prefix-router:TAG");
    println!(
        "  then pin the image digest the push prints: oci://REGISTRY/prefix-router@sha256:<digest>"
    );
    Ok(())
}

/// Fills `context` with the Dockerfile, the module and its checksum; replaces
/// whatever an earlier release left there.
pub fn prepare_context(wasm: &Path, dockerfile: &Path, context: &Path) -> anyhow::Result<Artifact> {
    let bytes = fs::read(wasm).with_context(|| format!("reading {}", wasm.display()))?;
    if !bytes.starts_with(b"\0asm") {
        bail!("{} is not a WebAssembly module", wasm.display());
    }
    let sha256 = hex(&Sha256::digest(&bytes));
    if context.exists() {
        fs::remove_dir_all(context).with_context(|| format!("clearing {}", context.display()))?;
    }
    fs::create_dir_all(context).with_context(|| format!("creating {}", context.display()))?;
    fs::copy(dockerfile, context.join("Dockerfile"))
        .with_context(|| format!("copying {}", dockerfile.display()))?;
    fs::write(context.join(WASM_NAME), &bytes)?;
    fs::write(
        context.join("SHA256SUMS"),
        format!("{sha256}  {WASM_NAME}\n"),
    )?;
    Ok(Artifact {
        context: context.to_path_buf(),
        sha256,
        size: u64::try_from(bytes.len()).unwrap_or(u64::MAX),
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_holds_dockerfile_module_and_its_checksum() {
        let dir = std::env::temp_dir().join(format!("xtask-release-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let wasm = dir.join("in.wasm");
        fs::write(&wasm, b"\0asm\x01\0\0\0").unwrap();
        let dockerfile = envoy::workspace_root()
            .join("docker")
            .join("plugin.Dockerfile");
        let context = dir.join("oci");
        fs::create_dir_all(&context).unwrap();
        fs::write(context.join("stale"), b"old").unwrap();

        let artifact = prepare_context(&wasm, &dockerfile, &context).unwrap();
        // sha256 of the 8 bytes above, computed independently (sha256sum).
        let expected = "93a44bbb96c751218e4c00d479e4c14358122a389acca16205b1e4d0dc5f9476";
        assert_eq!(artifact.sha256, expected);
        assert_eq!(artifact.size, 8);
        assert_eq!(
            fs::read(context.join(WASM_NAME)).unwrap(),
            b"\0asm\x01\0\0\0"
        );
        assert_eq!(
            fs::read_to_string(context.join("Dockerfile")).unwrap(),
            fs::read_to_string(&dockerfile).unwrap()
        );
        assert_eq!(
            fs::read_to_string(context.join("SHA256SUMS")).unwrap(),
            format!("{expected}  {WASM_NAME}\n")
        );
        assert!(!context.join("stale").exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn refuses_a_file_that_is_not_wasm() {
        let dir = std::env::temp_dir().join(format!("xtask-release-bad-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let wasm = dir.join("in.wasm");
        fs::write(&wasm, b"not wasm").unwrap();
        let dockerfile = envoy::workspace_root()
            .join("docker")
            .join("plugin.Dockerfile");
        assert!(prepare_context(&wasm, &dockerfile, &dir.join("oci")).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }
}
