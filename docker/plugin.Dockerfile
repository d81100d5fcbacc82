# The prefix-router filter as an OCI image in the layout Istio's `oci://` URLs
# expect: a single layer holding /plugin.wasm, nothing else.
#
#   cargo xtask release          # builds the .wasm, prints its sha256, prepares target/oci/
#   docker build -f target/oci/Dockerfile -t REGISTRY/prefix-router:0.1.0 target/oci
#   docker push REGISTRY/prefix-router:0.1.0   # note the digest it prints; pin it (docs/istio.md)
#
# The build context is target/oci/, which `cargo xtask release` fills with this
# file and prefix_router.wasm.

FROM scratch
COPY prefix_router.wasm /plugin.wasm
