"""How much of long-shared-prefix's hit rate is lost to uneven group placement.

A model of one vLLM prefix cache per instance (docs/benchmarks.md, "Synthetic
workloads"): 16-token blocks, a hit is the run of cached blocks from block 0,
blocks of a finished request are freed tail first to the end of an LRU free
list and evicted from its head. Requests run one after another (no batching),
100 groups of a 500-block prefix with a 75-block question and 16 output
blocks, 10,990 blocks per instance as `cargo xtask bench routing` sizes them.

It compares groups assigned at random (what consistent hashing of 100 keys
does) with groups spread evenly (14-15 per instance). Run: python3 kv_lru_model.py
"""
import collections
import random


def serve(cache, capacity, prompt, own):
    """One request on an instance's cache (an OrderedDict of blocks, least
    recently freed first): the run of `prompt`'s blocks cached from block 0
    is the hit; the rest, and the request's `own` blocks, are computed,
    evicting from the head; all are freed tail first."""
    hit = 0
    while hit < len(prompt) and prompt[hit] in cache:
        hit += 1
    for block in prompt[:hit]:
        del cache[block]  # in use, no longer evictable
    needed = len(prompt) - hit + len(own)
    for _ in range(min(len(cache), max(0, needed - (capacity - len(cache))))):
        cache.popitem(last=False)  # evict the free list's head
    for block in reversed(prompt + own):  # freed tail first
        cache[block] = None
    return hit


def hit_rate(owner, groups=100, capacity=10_990, prefix=500, question=75,
             output=16, warmup=500, measured=2_000, seed=1):
    rnd = random.Random(seed)
    caches = [collections.OrderedDict() for _ in range(max(owner) + 1)]
    hits = queried = unique = 0
    for i in range(warmup + measured):
        group = rnd.randrange(groups)
        blocks = [("prefix", group, b) for b in range(prefix)]
        own = [("own", unique, b) for b in range(question + output)]
        unique += 1
        hit = serve(caches[owner[group]], capacity, blocks, own)
        if i >= warmup:
            hits += hit
            queried += prefix + question
    return hits / queried


def main():
    instances, groups = 7, 100
    print(f"ceiling (whole prefix cached): {500 / 575:.3f}")
    for seed in range(1, 6):
        placement = random.Random(seed)
        owner = [placement.randrange(instances) for _ in range(groups)]
        counts = sorted(collections.Counter(owner).values())
        print(f"random placement {counts}: {hit_rate(owner, seed=seed):.3f}")
    even = [g % instances for g in range(groups)]
    for seed in (1, 2):
        print(f"even placement: {hit_rate(even, seed=seed):.3f}")


if __name__ == "__main__":
    main()
