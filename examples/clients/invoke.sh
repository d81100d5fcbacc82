#!/usr/bin/env bash
# The SageMaker-style invoke API (`/invocations`) through Envoy + prefix-router, with curl.
#
#   PREFIX_ROUTER_URL=http://localhost:10000 examples/clients/invoke.sh
#
# vLLM's /invocations takes an OpenAI body and serves it by its shape (`messages`:
# chat, `prompt`: completions); this sends a completions body. The filter reads an
# invoke body as bytes: it goes to the instance that holds the longest prefix of its
# first `prefix_length` bytes (16384 by default); a body no instance holds is placed
# by its first 1024 bytes. The tenant header keeps tenants apart: the same body from
# another tenant is matched and placed separately. Tenant: 1 to 64 printable ASCII
# characters (0x20-0x7E); anything else is answered 400 with an OpenAI-shaped JSON
# error and never reaches an instance.
# Each answer is followed by the routing decision, from the `decision_header` the
# docker-compose configuration sets (empty where it is not configured).
# INVOKE_PATH: your model server's invoke path; MODEL: the model it serves.
set -euo pipefail
url="${PREFIX_ROUTER_URL:-http://localhost:10000}"
path="${INVOKE_PATH:-/invocations}"
model="${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"

body="{\"model\": \"${model}\", \"prompt\": \"You are a helpful assistant. Summarise the following ticket: printer on fire.\", \"max_tokens\": 16}"

for tenant in tenant-a tenant-a tenant-b; do
  curl -sS --fail-with-body \
    -w "\ntenant ${tenant}: HTTP %{http_code}, routed: %header{x-prefix-route-decision}\n" \
    -H 'content-type: application/json' \
    -H "x-amzn-sagemaker-prefix-aware-id: ${tenant}" \
    --data "${body}" "${url}${path}"
done

# An invalid tenant header (65 characters; the rule is 1 to 64 printable ASCII
# characters, 0x20-0x7E): answered 400 with a JSON error naming the header.
curl -sS -w '\nHTTP %{http_code}\n' \
  -H 'content-type: application/json' \
  -H "x-amzn-sagemaker-prefix-aware-id: $(printf 'x%.0s' $(seq 1 65))" \
  --data "${body}" "${url}${path}"
