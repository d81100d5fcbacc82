# vllm-sim: a simulated vLLM instance (OpenAI-compatible API, /health, /metrics
# with vLLM's metric names, `x-served-by` on every response), for trying
# prefix-router without a GPU. Built from this repository's `tools` crate.
#
#   docker build -f docker/vllm-sim.Dockerfile -t prefix-router/vllm-sim:local .
#   docker run --rm -p 8000:8000 prefix-router/vllm-sim:local --host 0.0.0.0 --port 8000 --name vllm-1
#
# Arguments after the image replace CMD, so pass --host 0.0.0.0 with them
# (vllm-sim listens on 127.0.0.1 by default, unreachable from outside).
#
# Build context: the repository root (docker-compose.yml's `cpu` profile builds it).
# docker/vllm-sim.Dockerfile.dockerignore keeps target/ and .git out of the context.

# The toolchain this repository is built and tested with.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# The workspace's `tools` profile: optimised as release, without the .wasm's LTO.
RUN cargo build --profile tools --locked -p prefix-router-tools --bin vllm-sim

FROM debian:bookworm-slim
# curl: the compose health check (GET /health).
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/tools/vllm-sim /usr/local/bin/vllm-sim
EXPOSE 8000
# Listen on all interfaces inside the container. Compose passes its own
# arguments per instance, --host 0.0.0.0 among them (they replace CMD).
ENTRYPOINT ["vllm-sim"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
