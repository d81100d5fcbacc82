"""How many decisions behind one shared system prompt are not cold?

LONGEST_PREFIX (src/strategy/longest_prefix.rs) lets a match that ends in
the system messages prefer the instances holding it while they are at most
half the fleet and took, together, at most their even share of the deciding
worker's recent decisions plus half of one instance's, plus two
(src/load/recent.rs, `RecentChoices::share_bound`). Past that bound the
request is placed by its opening (rendezvous hashing: a uniformly random
instance for a new conversation), and its instance holds the prompt too.
Once more than half the fleet holds it, every first turn behind it is cold.

This model replays that rule for conversations behind one system prompt
arriving at an Envoy whose workers (VMs) share the prefix index but each
keep their own recent decisions, a uniformly random worker per request, and
counts the decisions before the prompt is held by more than half the fleet:
the warm-up the integration tests in tests/suite/longest_prefix.rs bound
(`SYSTEM_WARM_UP`).

Run: python3 system_warm_up_model.py
"""
import random

INSTANCES = 7
RUNS = 20_000


def share_bound(total, holders, instances):
    """`RecentChoices::share_bound`."""
    return total * holders // instances + total // instances // 2 + 2


def warm_up(workers, rng):
    """Decisions that are not cold before more than half the fleet holds it."""
    holders = set()
    recent = [dict() for _ in range(workers)]
    decisions = 0
    while len(holders) * 2 <= INSTANCES:
        mine = recent[rng.randrange(workers)]
        order = rng.sample(range(INSTANCES), INSTANCES)  # the opening's ranking
        if not holders:
            chosen = order[0]  # the first conversation: cold
        else:
            decisions += 1
            total = sum(mine.values())
            of_holders = sum(mine.get(h, 0) for h in holders)
            if of_holders <= share_bound(total, len(holders), INSTANCES):
                chosen = next(i for i in order if i in holders)
            else:
                chosen = order[0]
        holders.add(chosen)
        mine[chosen] = mine.get(chosen, 0) + 1
    return decisions


def main():
    rng = random.Random(1)
    for workers in (1, 2):
        runs = sorted(warm_up(workers, rng) for _ in range(RUNS))
        print(
            f"{workers} worker(s), {RUNS} runs: median {runs[RUNS // 2]}, "
            f"99th percentile {runs[RUNS * 99 // 100]}, "
            f"99.99th {runs[RUNS * 9999 // 10000]}, most {runs[-1]}"
        )


if __name__ == "__main__":
    main()
