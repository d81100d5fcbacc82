#!/usr/bin/env python3
"""OpenAI Python SDK through Envoy + prefix-router (pip install openai).

    OPENAI_BASE_URL=http://localhost:10000/v1 python3 examples/clients/openai_chat.py

Every turn of a conversation begins with the turns before it, so the filter
sends it to the instance that served them, whose prefix cache already holds the
conversation so far (the first turn is placed by the conversation's opening,
its system prompt and first user message). prompt_cache_key separates tenants:
the same prompt with another key is matched and placed separately (and is never
served from another tenant's cache entry by routing). It goes through
extra_body, which every SDK version accepts. The instance printed is the one
the filter's `decision_header` names (x-prefix-route-decision, set in the
docker-compose configuration); without it, the x-served-by header vllm-sim
sends (vLLM sends none).
"""

import os

import openai

client = openai.OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://localhost:10000/v1"),
    api_key=os.environ.get("OPENAI_API_KEY", "not-needed"),
)
model = os.environ.get("MODEL", "Qwen/Qwen2.5-0.5B-Instruct")


def served_by(headers):
    """The instance that answered: `instance=` of the decision header."""
    decision = headers.get("x-prefix-route-decision") or ""
    for part in decision.split(";"):
        name, _, value = part.strip().partition("=")
        if name == "instance":
            return value
    return headers.get("x-served-by")


# A system prompt carrying a policy manual, as real assistants have: it does not
# decide where the conversation goes (many conversations share it); the turns
# follow the instance of the first.
system_prompt = "You are the support assistant of ACME. Follow the policy manual.\n" + "\n".join(
    f"Rule {i}: answer accurately and briefly, and cite the rule you applied." for i in range(1, 81)
)
messages = [
    {"role": "system", "content": system_prompt},
    {"role": "user", "content": "What does prefix caching do?"},
]

# A plain request; with_raw_response exposes the response headers.
raw = client.chat.completions.with_raw_response.create(
    model=model,
    messages=messages,
    max_tokens=32,
    extra_body={"prompt_cache_key": "tenant-acme"},
)
answer = raw.parse().choices[0].message.content
print(f"served by {served_by(raw.headers)}: {answer!r}")

# The next turn, streamed: same beginning, so the same instance.
messages += [
    {"role": "assistant", "content": answer},
    {"role": "user", "content": "And why does routing matter for it?"},
]
stream = client.chat.completions.with_raw_response.create(
    model=model,
    messages=messages,
    max_tokens=32,
    stream=True,
    extra_body={"prompt_cache_key": "tenant-acme"},
)
text = "".join(
    chunk.choices[0].delta.content or "" for chunk in stream.parse() if chunk.choices
)
print(f"served by {served_by(stream.headers)} (streamed): {text!r}")
