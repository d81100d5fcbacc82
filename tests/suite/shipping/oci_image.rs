//! The plugin's OCI image (`docker/plugin.Dockerfile`): a `FROM scratch`
//! image holding only `/plugin.wasm`, the layout Istio's `oci://` URLs expect.

mod support;

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
