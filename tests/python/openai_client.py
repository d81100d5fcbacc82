#!/usr/bin/env python3
"""Drives the official OpenAI Python SDK through Envoy and prefix-router for
tests/suite/shipping/clients.rs, so the routing is proven with a client nobody here wrote.

Reads a JSON plan on stdin:
  {"base_url": "http://127.0.0.1:PORT/v1", "model": "...",
   "requests": [{"id": "...", "api": "chat" | "chat_stream" | "completions",
                 "messages": [...] | "prompt": "...",
                 "prompt_cache_key": "..." (optional), "max_tokens": 8}]}
Prints one JSON object on stdout:
  {"sdk_version": "...", "results": [{"id", "served_by", "route_key", "text", "chunks"}]}
where served_by is the response's x-served-by header and route_key the
x-received-route-key header (the key the upstream received), both as the SDK
saw them. Any SDK error fails the run (exit status 1, message on stderr).

prompt_cache_key goes through extra_body: that works with every 1.x+ SDK, also
for the completions API, where the SDK has no such parameter.
"""

import json
import sys

import openai


def main() -> int:
    plan = json.load(sys.stdin)
    client = openai.OpenAI(
        base_url=plan["base_url"], api_key="not-needed", max_retries=0, timeout=30.0
    )
    results = [run(client, plan["model"], request) for request in plan["requests"]]
    json.dump({"sdk_version": openai.__version__, "results": results}, sys.stdout)
    return 0


def run(client: openai.OpenAI, model: str, request: dict) -> dict:
    extra_body = None
    if request.get("prompt_cache_key") is not None:
        extra_body = {"prompt_cache_key": request["prompt_cache_key"]}
    max_tokens = request.get("max_tokens", 8)
    api = request["api"]
    if api == "chat":
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=request["messages"], max_tokens=max_tokens, extra_body=extra_body
        )
        text = raw.parse().choices[0].message.content
        chunks = 1
    elif api == "chat_stream":
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=request["messages"],
            max_tokens=max_tokens,
            stream=True,
            extra_body=extra_body,
        )
        parts = []
        chunks = 0
        for chunk in raw.parse():
            chunks += 1
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        text = "".join(parts)
    elif api == "completions":
        raw = client.completions.with_raw_response.create(
            model=model, prompt=request["prompt"], max_tokens=max_tokens, extra_body=extra_body
        )
        text = raw.parse().choices[0].text
        chunks = 1
    else:
        raise ValueError(f"unknown api {api!r}")
    return {
        "id": request["id"],
        "served_by": raw.headers.get("x-served-by"),
        "route_key": raw.headers.get("x-received-route-key"),
        "text": text,
        "chunks": chunks,
    }


if __name__ == "__main__":
    sys.exit(main())
