# The prefix-router filter as an image Istio's `oci://` URLs load: a single
# layer holding /plugin.wasm, nothing else. `cargo xtask release` already
# writes this image as an OCI layout (target/dist/oci/, pushed with oras or
# skopeo, no Docker engine); this file builds the same content with Docker:
#
#   cargo xtask release          # fills target/dist/docker/ with this file and the module
#   docker buildx build --provenance=false -t REGISTRY/prefix-router:0.2.0 --push target/dist/docker
#
# --provenance=false: without it buildx pushes an index (image + attestation);
# Istio pins the image manifest's digest, not the index's (docs/istio.md).

FROM scratch
COPY prefix_router.wasm /plugin.wasm
