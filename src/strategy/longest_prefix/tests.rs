use std::collections::{HashMap, HashSet};

use super::*;
use crate::extract::PrefixSource;
use crate::key::KeyMaterial;
use crate::load::{AdapterNames, HeldPrefix, InstanceRef, Target};
use crate::strategy::RecentChoices;

/// A fleet as the policy sees it: in-flight counts, an exact prefix
/// index (block hash -> slots), claims that respect the cap.
#[derive(Default)]
struct Fleet {
    in_flight: Vec<u32>,
    held: HashMap<u64, Vec<u16>>,
    contended: bool,
    /// Requests stay in flight after `route` (else each one completes).
    hold: bool,
    /// Requests other proxies have on each instance, as its engine
    /// reports them (None: no engine sample).
    engine: Vec<Option<u32>>,
    /// The fleet-wide bound of running + waiting.
    max_requests: Option<u32>,
    /// Instances over the fleet-wide bound of KV-cache usage.
    kv_full: Vec<u16>,
    /// The adapters each instance's engine lists (None: not known).
    served: Vec<Option<AdapterNames>>,
    /// The adapters each instance's engine runs (None: not reported).
    active: Vec<Option<AdapterNames>>,
    recent: RecentChoices,
    /// Slot 0 holds another instance than `Fleet::instance(0)` (the first
    /// one left, this one took its slot).
    reseated: bool,
    /// Its instances are listed (`instances`) or read from Envoy's admin
    /// (`discovery`); false: learned from traffic.
    listed: bool,
}

impl Fleet {
    fn new(instances: usize) -> Self {
        Fleet {
            in_flight: vec![0; instances],
            listed: true,
            ..Fleet::default()
        }
    }
    fn instance(slot: u16) -> InstanceRef {
        InstanceRef::new(slot, format!("10.0.0.{slot}:8000").into())
    }
    /// `policy`'s decision for `blocks` over this fleet and its recent
    /// choices.
    fn decide(
        &mut self,
        policy: &LongestPrefix,
        blocks: &PromptBlocks,
        adapter: Option<u64>,
        random: u64,
    ) -> Routed {
        let mut recent = std::mem::take(&mut self.recent);
        let routed = policy.decide(blocks, adapter, self, &mut recent, random, 0);
        self.recent = recent;
        routed
    }
    fn route(&mut self, policy: &LongestPrefix, blocks: &PromptBlocks) -> (DecisionKind, u16) {
        let routed = self.decide(policy, blocks, None, 0);
        let host = routed
            .headers
            .host_override
            .clone()
            .expect("names the instance");
        let slot = (0..self.in_flight.len() as u16)
            .find(|s| *Fleet::instance(*s).address == *host)
            .unwrap();
        assert_eq!(routed.headers.key.as_deref(), Some(&*blocks.opening_key()));
        if let Some(ticket) = routed.ticket {
            assert_eq!(ticket.slot(), slot);
            assert_eq!(routed.headers.counted.as_deref(), Some(&*host));
            if !self.hold {
                self.in_flight[usize::from(slot)] -= 1;
            }
            drop(ticket);
        }
        (routed.headers.kind, slot)
    }
}

impl LoadView for Fleet {
    fn target_of(&mut self, _: &str, _: u64) -> Option<Target> {
        None
    }
    fn route_blind(&mut self, _: &str, _: u64) -> Option<Target> {
        None
    }
    fn claim(&mut self, i: &InstanceRef, _: Option<&str>, cap: Option<u32>, _: u64) -> Claim {
        if self.contended {
            return Claim::Contended;
        }
        let count = &mut self.in_flight[usize::from(i.slot)];
        if cap.is_some_and(|cap| *count >= cap) {
            return Claim::Full { in_flight: *count };
        }
        *count += 1;
        Claim::Claimed(Ticket {
            slot: i.slot,
            addr_hash: 0,
            owner: 0,
        })
    }
    fn candidates(&mut self, _: u64) -> Vec<Candidate> {
        (0..self.in_flight.len() as u16)
            .map(|slot| {
                let in_flight = self.in_flight[usize::from(slot)];
                let instance = match slot {
                    0 if self.reseated => InstanceRef::new(slot, "10.0.9.9:8000".into()),
                    _ => Fleet::instance(slot),
                };
                let mut candidate = Candidate::local(instance, in_flight);
                if let Some(engine) = self.engine.get(usize::from(slot)).copied().flatten() {
                    candidate.load = (engine + in_flight).max(in_flight);
                    candidate.engine_room = self
                        .max_requests
                        .map(|max| max.saturating_sub(candidate.load));
                    candidate.over_bounds = candidate.engine_room == Some(0);
                }
                candidate.over_bounds |= self.kv_full.contains(&slot);
                candidate.served = self.served.get(usize::from(slot)).cloned().flatten();
                candidate.active_adapters = self.active.get(usize::from(slot)).cloned().flatten();
                candidate.listed = self.listed;
                candidate
            })
            .collect()
    }
    fn longest_held(&mut self, chain: &[u64], among: &[Candidate], _: u64) -> HeldPrefix {
        for blocks in (1..=chain.len()).rev() {
            let holders: Vec<u16> = self
                .held
                .get(&chain[blocks - 1])
                .into_iter()
                .flatten()
                .copied()
                .filter(|slot| among.iter().any(|c| c.instance.slot == *slot))
                .collect();
            if !holders.is_empty() {
                return HeldPrefix { blocks, holders };
            }
        }
        HeldPrefix::default()
    }
    fn remember_held(
        &mut self,
        chain: &[u64],
        known: usize,
        i: &InstanceRef,
        _: &[Candidate],
        _: u64,
    ) -> Option<u32> {
        for hash in chain.iter().skip(known.min(chain.len())) {
            let holders = self.held.entry(*hash).or_default();
            if !holders.contains(&i.slot) {
                holders.push(i.slot);
            }
        }
        None
    }
}

fn record(role: &str, text: &str) -> String {
    format!("role={role}\u{1f}text={text}\u{1f}\u{1e}")
}

fn prompt(text: &str) -> PromptBlocks {
    PromptBlocks::new(
        &KeyMaterial {
            tenant: None,
            model: Some(b"m"),
            source: PrefixSource::CanonicalText,
            prefix: text.as_bytes(),
        },
        256,
    )
}

fn conversation(system: &str, id: usize, turns: usize) -> Vec<PromptBlocks> {
    let mut text = system.to_string();
    let mut out = Vec::new();
    for turn in 0..turns {
        text.push_str(&record(
            "user",
            &format!("conversation {id} question {turn} {}", "q".repeat(300)),
        ));
        out.push(prompt(&text));
        text.push_str(&record("assistant", &"answer ".repeat(60)));
    }
    out
}

#[test]
fn a_conversation_stays_on_the_instance_of_its_first_turn() {
    let policy = LongestPrefix::new(10, 2, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(7);
    let turns = conversation("", 1, 5);
    let (kind, first) = fleet.route(&policy, &turns[0]);
    assert_eq!(kind, DecisionKind::Cold);
    for turn in &turns[1..] {
        assert_eq!(fleet.route(&policy, turn), (DecisionKind::Matched, first));
    }
}

/// Slots of `blocks`' opening's two top rendezvous ranks over `fleet`.
fn top_two(blocks: &PromptBlocks, instances: u16) -> [u16; 2] {
    let mut slots: Vec<u16> = (0..instances).collect();
    slots.sort_by_key(|&s| std::cmp::Reverse(rank(blocks.opening, &Fleet::instance(s).address)));
    [slots[0], slots[1]]
}

/// A document of its own, long enough for BALANCED to weigh it.
fn distinct_prompt(id: usize) -> PromptBlocks {
    let blocks = prompt(&record(
        "user",
        &format!("document {id} {}", "d".repeat(BALANCED_MIN_BYTES)),
    ));
    assert!(blocks.prefix_bytes >= BALANCED_MIN_BYTES);
    blocks
}

#[test]
fn a_later_turn_this_index_lacks_keeps_its_openings_first_choice_as_a_holder_would() {
    let policy = LongestPrefix::new(10, 2, ColdPlacement::Consistent, None);
    let question = record("user", &format!("conversation 7 {}", "q".repeat(300)));
    let first_turn = prompt(&question);
    let history = question + &record("assistant", &"a".repeat(4000));
    let later = prompt(&(history.clone() + &record("user", "and then?")));
    assert_eq!(later.opening, first_turn.opening);
    assert_eq!(later.history_bytes, history.len());
    let [first, _] = top_two(&later, 7);
    // Neither is held in this index; the others have nothing in flight,
    // so the bound is 2, and 2 + 4 (one per KiB of history) for the
    // later turn on its first choice.
    let place = |blocks: &PromptBlocks, first_in_flight: u32| {
        let mut fleet = Fleet::new(7);
        fleet.hold = true;
        fleet.in_flight[usize::from(first)] = first_in_flight;
        fleet.route(&policy, blocks)
    };
    assert_eq!(place(&later, 6), (DecisionKind::Cold, first));
    let (kind, slot) = place(&later, 7);
    assert_eq!(kind, DecisionKind::Cold);
    assert_ne!(slot, first, "passed over");
    let (kind, slot) = place(&first_turn, 3);
    assert_eq!(kind, DecisionKind::Cold);
    assert_ne!(slot, first, "a first turn has no history");
    // Held here only as far as its first turn (the others went through
    // other replicas), its bound is still that of its history.
    let mut fleet = Fleet::new(7);
    fleet.hold = true;
    assert_eq!(
        fleet.route(&policy, &first_turn),
        (DecisionKind::Cold, first)
    );
    fleet.in_flight[usize::from(first)] = 6;
    assert_eq!(fleet.route(&policy, &later), (DecisionKind::Matched, first));
}

#[test]
fn balanced_cold_placement_evens_the_shares_consistent_is_a_binomial() {
    let spread = |placement: ColdPlacement| {
        let policy = LongestPrefix::new(10, 1000, placement, None);
        let mut fleet = Fleet::new(7);
        let mut shares = [0usize; 7];
        for id in 0..1400 {
            let blocks = distinct_prompt(id);
            let (kind, slot) = fleet.route(&policy, &blocks);
            assert_eq!(kind, DecisionKind::Cold);
            assert!(top_two(&blocks, 7).contains(&slot));
            shares[usize::from(slot)] += 1;
        }
        shares
    };
    // Within a few of the even 200: the prompts are all but equal in
    // size, so evening the bytes placed evens the requests.
    let balanced = spread(ColdPlacement::Balanced);
    assert!(
        balanced.iter().all(|n| (192..=208).contains(n)),
        "{balanced:?}"
    );
    // These 1,400 openings by their first choice alone, a binomial
    // (standard deviation 13): 179 to 212.
    let consistent = spread(ColdPlacement::Consistent);
    assert!(
        !consistent.iter().all(|n| (192..=208).contains(n)),
        "{consistent:?}"
    );
}

#[test]
fn balanced_cold_placement_evens_the_bytes_placed_not_the_request_counts() {
    // Documents whose opening ranks instance 0 first are 8,000 bytes
    // long, the others 2,100 (their first 512 bytes, the opening, alike).
    let document = |id: usize, long: bool| {
        let body = "d".repeat(if long { 8000 } else { 2100 });
        prompt(&record("user", &format!("document {id} {body}")))
    };
    let placed = |placement: ColdPlacement| {
        let policy = LongestPrefix::new(10, 1000, placement, None);
        let mut fleet = Fleet::new(7);
        let mut bytes = [0usize; 7];
        let mut requests = [0usize; 7];
        for id in 0..700 {
            let short = document(id, false);
            let long = top_two(&short, 7)[0] == 0;
            let blocks = document(id, long);
            assert_eq!(blocks.opening, short.opening);
            let (kind, slot) = fleet.route(&policy, &blocks);
            assert_eq!(kind, DecisionKind::Cold);
            bytes[usize::from(slot)] += blocks.prefix_bytes;
            requests[usize::from(slot)] += 1;
        }
        (bytes, requests)
    };
    let (bytes, requests) = placed(ColdPlacement::Balanced);
    let (most, least) = (bytes.iter().max().unwrap(), bytes.iter().min().unwrap());
    // Within a fifth of each other (by request counts, evened as the
    // count rule would, instance 0 alone would hold three times as much).
    assert!(most * 5 <= least * 6, "{bytes:?} ({requests:?} requests)");
    // Many of instance 0's long first choices went to their second
    // choices: under three quarters of its even share of requests
    // (evening request counts leaves it at about its even 100).
    assert!(requests[0] < 75, "{requests:?}");
    let (bytes, _) = placed(ColdPlacement::Consistent);
    let least = bytes.iter().min().unwrap();
    assert!(bytes[0] > 3 * least, "{bytes:?}");
}

#[test]
fn balanced_keeps_short_prompts_and_later_turns_on_their_first_choice() {
    let policy = LongestPrefix::new(10, 1000, ColdPlacement::Balanced, None);
    let mut fleet = Fleet::new(7);
    // Placing a long document on every instance but one.
    let spare = top_two(&distinct_prompt(0), 7)[0];
    let mut id = 1;
    while (0..7u16).any(|s| s != spare && fleet.recent.placed_bytes(s) == 0) {
        let blocks = distinct_prompt(id);
        if top_two(&blocks, 7)[0] != spare {
            fleet.route(&policy, &blocks);
        }
        id += 1;
    }
    assert_eq!(fleet.recent.placed_bytes(spare), 0);
    // A short prompt whose first choice holds more bytes than its second
    // stays there; as long as BALANCED_MIN_BYTES, it goes to the second.
    let ranked = |text: &str| {
        let blocks = prompt(&record("user", text));
        let [first, second] = top_two(&blocks, 7);
        (blocks, first, second)
    };
    let (short, first, _) = (0..)
        .map(|n| ranked(&format!("question {n}")))
        .find(|(_, first, second)| *first != spare && *second == spare)
        .unwrap();
    assert!(short.prefix_bytes < BALANCED_MIN_BYTES);
    assert_eq!(fleet.route(&policy, &short), (DecisionKind::Cold, first));
    let (long, first, second_of_long) = (0..)
        .map(|n| ranked(&format!("question {n} {}", "q".repeat(BALANCED_MIN_BYTES))))
        .find(|(_, first, second)| *first != spare && *second == spare)
        .unwrap();
    assert_eq!(
        fleet.route(&policy, &long),
        (DecisionKind::Cold, second_of_long)
    );
    assert_ne!(first, second_of_long);
    // A later turn this index lacks (another replica saw the earlier
    // ones) stays on its opening's first choice however long, though
    // its second holds fewer bytes.
    let later_turn = |n: usize| {
        let history = record("user", &format!("conversation {n}"))
            + &record("assistant", &"a".repeat(BALANCED_MIN_BYTES));
        prompt(&(history + &record("user", "and then?")))
    };
    let later = (0..)
        .map(later_turn)
        .find(|blocks| {
            let [first, second] = top_two(blocks, 7);
            first != spare && second == spare
        })
        .unwrap();
    assert!(later.history_bytes > 0 && later.prefix_bytes >= BALANCED_MIN_BYTES);
    let [first_of_later, _] = top_two(&later, 7);
    assert_eq!(
        fleet.route(&policy, &later),
        (DecisionKind::Cold, first_of_later)
    );
}

#[test]
fn replicas_that_saw_different_traffic_place_a_cold_prompt_on_one_of_two() {
    for placement in [ColdPlacement::Balanced, ColdPlacement::Consistent] {
        let balanced = placement == ColdPlacement::Balanced;
        let policy = LongestPrefix::new(10, 1000, placement, None);
        let (mut a, mut b) = (Fleet::new(7), Fleet::new(7));
        // Each replica saw other prompts first, and the same ones
        // unevenly: the bytes each placed per instance differ.
        for id in 0..300 {
            a.route(&policy, &distinct_prompt(1000 + id));
            b.route(&policy, &distinct_prompt(2000 + id % 7));
        }
        let mut apart = 0;
        for id in 0..200 {
            let blocks = distinct_prompt(id);
            let (_, on_a) = a.route(&policy, &blocks);
            let (_, on_b) = b.route(&policy, &blocks);
            let [first, second] = top_two(&blocks, 7);
            if balanced {
                assert!([first, second].contains(&on_a), "prompt {id}");
                assert!([first, second].contains(&on_b), "prompt {id}");
            } else {
                assert_eq!((on_a, on_b), (first, first), "prompt {id}");
            }
            apart += usize::from(on_a != on_b);
        }
        // BALANCED trades exact agreement for even placement.
        assert_eq!(apart > 0, balanced, "{apart} of 200 apart");
    }
}

#[test]
fn cold_placement_is_the_same_on_every_replica_and_spreads() {
    let policy = LongestPrefix::new(10, 1000, ColdPlacement::Consistent, None);
    let system = record("system", &"shared system prompt ".repeat(300));
    let mut shares = [0usize; 7];
    for id in 0..700 {
        let first_turn = &conversation(&system, id, 1)[0];
        // Two replicas, each with its own (empty) index.
        let (mut a, mut b) = (Fleet::new(7), Fleet::new(7));
        let (_, on_a) = a.route(&policy, first_turn);
        let (_, on_b) = b.route(&policy, first_turn);
        assert_eq!(on_a, on_b);
        shares[usize::from(on_a)] += 1;
    }
    for share in shares {
        assert!((70..=130).contains(&share), "{shares:?}");
    }
}

#[test]
fn a_system_prompt_every_conversation_shares_spreads_them_over_every_instance() {
    let policy = LongestPrefix::new(10, 1000, ColdPlacement::Consistent, None);
    let system = record("system", &"shared system prompt ".repeat(300));
    let mut fleet = Fleet::new(7);
    let mut shares = [0usize; 7];
    let mut later = [0usize; 7];
    let mut kinds = HashMap::new();
    for id in 0..700 {
        let (kind, slot) = fleet.route(&policy, &conversation(&system, id, 1)[0]);
        shares[usize::from(slot)] += 1;
        if id >= 350 {
            later[usize::from(slot)] += 1;
        }
        *kinds.entry(kind).or_insert(0) += 1;
    }
    // Its first holders take a few (matched), until past their share of
    // recent decisions (no load moves at this margin) it sets no instance
    // apart, and once more than half the fleet holds it neither does it:
    // every first turn is placed by its opening.
    for share in shares {
        assert!((70..=130).contains(&share), "{shares:?}");
    }
    for share in later {
        assert!((35..=65).contains(&share), "{later:?}");
    }
    assert!(kinds[&DecisionKind::Cold] >= 690, "{kinds:?}");
    assert!(kinds.get(&DecisionKind::Matched) > Some(&0), "{kinds:?}");
    assert!(!kinds.contains_key(&DecisionKind::Moved), "{kinds:?}");
    // Its second turn is matched where the first went.
    let turns = conversation(&system, 9999, 2);
    let (_, first) = fleet.route(&policy, &turns[0]);
    assert_eq!(
        fleet.route(&policy, &turns[1]),
        (DecisionKind::Matched, first)
    );
}

#[test]
fn a_groups_own_system_prompt_attracts_its_new_questions() {
    let policy = LongestPrefix::new(10, 1000, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(7);
    let mut instances_of: HashMap<usize, Vec<u16>> = HashMap::new();
    let mut matched = 0;
    for request in 0..1400 {
        let group = request % 28;
        let system = record("system", &format!("group {group} ").repeat(300));
        let question = record("user", &format!("question {request} {}", "q".repeat(200)));
        let (kind, slot) = fleet.route(&policy, &prompt(&(system + &question)));
        matched += usize::from(kind == DecisionKind::Matched);
        let on = instances_of.entry(group).or_default();
        if !on.contains(&slot) {
            on.push(slot);
        }
    }
    // Without the share bound each group's questions would go where
    // their openings rank first: every group on all 7 instances.
    let spread: Vec<usize> = instances_of.values().map(Vec::len).collect();
    assert!(spread.iter().all(|&n| n <= 4), "{spread:?}");
    assert!(spread.iter().sum::<usize>() <= 28 * 2, "{spread:?}");
    assert!(matched >= 1300, "{matched}");
}

#[test]
fn questions_about_one_document_stay_together() {
    let policy = LongestPrefix::new(10, 2, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(7);
    let document = "a pasted document ".repeat(200);
    let ask = |q: &str| prompt(&record("user", &format!("{document}\n\n{q}")));
    let (_, first) = fleet.route(&policy, &ask("Summarise the text above."));
    for q in ["List its key points.", "Who wrote it?", "Translate it."] {
        assert_eq!(
            fleet.route(&policy, &ask(q)),
            (DecisionKind::Matched, first)
        );
    }
}

/// Notes `per_slot[s]` recent decisions for slot `s`.
fn note_recent(fleet: &mut Fleet, per_slot: &[u32]) {
    for (slot, n) in per_slot.iter().enumerate() {
        for _ in 0..*n {
            fleet.recent.note(slot as u16, 0);
        }
    }
}

#[test]
fn a_holder_past_its_share_gives_a_conversation_to_an_instance_within_its_share() {
    let policy = LongestPrefix::new(10, 2, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(7);
    let turns = conversation("", 3, 4);
    let (_, first) = fleet.route(&policy, &turns[0]);
    // 78 decisions, 11 each is even: the first choice has had 17, 4 past
    // its share and slack (a KiB), more than the history it holds; of the
    // others, the one with the fewest decisions takes it.
    let mut counts = [11u32; 7];
    counts[usize::from(first)] = 16;
    counts[usize::from((first + 1) % 7)] = 6;
    note_recent(&mut fleet, &counts);
    let (kind, moved_to) = fleet.route(&policy, &turns[1]);
    assert_eq!(kind, DecisionKind::Moved);
    assert_eq!(moved_to, (first + 1) % 7);
    // The conversation is held there from then on.
    for turn in &turns[2..] {
        assert_eq!(
            fleet.route(&policy, turn),
            (DecisionKind::Matched, moved_to)
        );
    }
    // A new conversation's first turn is placed by its opening whatever
    // the shares, as every replica places it.
    let mut fleet = Fleet::new(7);
    let other = conversation("", 4, 1);
    let [opening_first, _] = top_two(&other[0], 7);
    let mut counts = [9u32; 7];
    counts[usize::from(opening_first)] = 40;
    note_recent(&mut fleet, &counts);
    assert_eq!(
        fleet.route(&policy, &other[0]),
        (DecisionKind::Cold, opening_first)
    );
}

#[test]
fn a_holder_keeps_a_conversation_within_its_share_with_few_decisions_or_much_held() {
    let policy = LongestPrefix::new(10, 2, ColdPlacement::Consistent, None);
    let shares_past = |counts_first: u32, others: u32, turns: &[PromptBlocks]| {
        let mut fleet = Fleet::new(7);
        let (_, first) = fleet.route(&policy, &turns[0]);
        let mut counts = [others; 7];
        counts[usize::from(first)] = counts_first;
        note_recent(&mut fleet, &counts);
        let last = turns.len() - 1;
        for turn in &turns[1..last] {
            fleet.route(&policy, turn);
        }
        (fleet.route(&policy, &turns[last]), first)
    };
    let short = conversation("", 5, 2);
    // 15 of 69 (4 past 9 + 2: a KiB) moves it, past the history its
    // first choice holds; 12 of 66 does not.
    let ((kind, _), _) = shares_past(14, 9, &short);
    assert_eq!(kind, DecisionKind::Moved);
    let ((kind, slot), first) = shares_past(11, 9, &short);
    assert_eq!((kind, slot), (DecisionKind::Matched, first));
    // Few decisions made: the even share is taken as 8, so 10 of 28 is
    // within it (one conversation alone stays where it is).
    let ((kind, slot), first) = shares_past(9, 3, &short);
    assert_eq!((kind, slot), (DecisionKind::Matched, first));
    // Holding some 3 KiB of the conversation's own text (at its fifth
    // turn: one decision more per 256 bytes), 14 of 68 keeps it.
    let long = conversation("", 5, 5);
    let ((kind, slot), first) = shares_past(10, 9, &long);
    assert_eq!((kind, slot), (DecisionKind::Matched, first));
}

#[test]
fn a_groups_system_prompt_counts_in_what_its_holder_holds_the_fleets_does_not() {
    let policy = LongestPrefix::new(10, 2, ColdPlacement::Consistent, None);
    let system = record("system", &"group prompt ".repeat(200));
    // A conversation's second turn matches past the system prompt into
    // its own text: the first question, one block of it.
    let turns = conversation(&system, 8, 2);
    let place = |system_holders: &[u16]| {
        let mut fleet = Fleet::new(7);
        let (_, first) = fleet.route(&policy, &turns[0]);
        let blocks = turns[1].padding.0;
        for &slot in system_holders {
            for hash in &turns[1].chain[..blocks] {
                fleet.held.entry(*hash).or_default().push(slot);
            }
        }
        let mut counts = [9u32; 7];
        counts[usize::from(first)] = 20;
        note_recent(&mut fleet, &counts);
        (fleet.route(&policy, &turns[1]), first)
    };
    // Held by its holder alone, the 2.6 KB prompt is the group's cache:
    // 21 of 75 stays within 10 + 2 + 11.
    let ((kind, slot), first) = place(&[]);
    assert_eq!((kind, slot), (DecisionKind::Matched, first));
    // Held by more than half the fleet, it is the fleet's: only the
    // first question counts (10 + 2 + 1), and the turn moves.
    let ((kind, slot), first) = place(&[0, 1, 2, 3, 4, 5, 6]);
    assert_eq!(kind, DecisionKind::Moved);
    assert_ne!(slot, first);
}

#[test]
fn a_single_prompt_sent_again_stays_with_its_holder_whatever_the_shares() {
    let policy = LongestPrefix::new(10, 2, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(7);
    let question = prompt(&record("user", &format!("question {}", "why ".repeat(40))));
    let (_, first) = fleet.route(&policy, &question);
    let mut counts = [9u32; 7];
    counts[usize::from(first)] = 40;
    note_recent(&mut fleet, &counts);
    assert_eq!(
        fleet.route(&policy, &question),
        (DecisionKind::Matched, first)
    );
}

#[test]
fn a_new_question_about_a_document_moves_off_a_holder_past_its_share() {
    let policy = LongestPrefix::new(10, 2, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(7);
    let document = "a short pasted note ".repeat(20);
    let ask = |q: &str| prompt(&record("user", &format!("{document}\n\n{q}")));
    let (_, first) = fleet.route(&policy, &ask("Summarise the text above."));
    // 400 bytes held (bound 11 + 2 + 1): 16 of 78 is past it.
    let mut counts = [11u32; 7];
    counts[usize::from(first)] = 16;
    counts[usize::from((first + 1) % 7)] = 6;
    note_recent(&mut fleet, &counts);
    // The same question again stays where it is held whole.
    assert_eq!(
        fleet.route(&policy, &ask("Summarise the text above.")),
        (DecisionKind::Matched, first)
    );
    // A new one moves to the instance with the fewest decisions, which
    // holds the document from then on.
    let (kind, moved_to) = fleet.route(&policy, &ask("Who wrote it?"));
    assert_eq!((kind, moved_to), (DecisionKind::Moved, (first + 1) % 7));
    assert_eq!(
        fleet.route(&policy, &ask("Translate it.")),
        (DecisionKind::Matched, moved_to)
    );
}

#[test]
fn a_turn_whose_previous_turn_another_replica_routed_stays_past_the_share() {
    let policy = LongestPrefix::new(10, 2, ColdPlacement::Consistent, None);
    let turns = conversation("", 6, 3);
    // Replica A routes the first turn, replica B the second (B's index
    // lacks the conversation: the opening's first choice), A the third.
    let (mut a, mut b) = (Fleet::new(7), Fleet::new(7));
    let (_, first) = a.route(&policy, &turns[0]);
    assert_eq!(b.route(&policy, &turns[1]), (DecisionKind::Cold, first));
    // A has seen the first choice take far more than its share.
    let mut counts = [9u32; 7];
    counts[usize::from(first)] = 30;
    note_recent(&mut a, &counts);
    // A holds the first turn only: it keeps the third where B sent the
    // second, rather than split the conversation.
    assert_eq!(a.route(&policy, &turns[2]), (DecisionKind::Matched, first));
    // Had A routed the second turn itself, it would have moved the third.
    let mut c = Fleet::new(7);
    c.route(&policy, &turns[0]);
    c.route(&policy, &turns[1]);
    note_recent(&mut c, &counts);
    let (kind, slot) = c.route(&policy, &turns[2]);
    assert_eq!(kind, DecisionKind::Moved);
    assert_ne!(slot, first);
}

#[test]
fn a_turn_whose_earlier_turns_other_replicas_routed_goes_where_they_sent_them() {
    let policy = LongestPrefix::new(10, 2, ColdPlacement::Consistent, None);
    let turns = conversation("", 8, 4);
    // Replica A places the first turn while its opening's first choice is
    // loaded past the bound: on another instance.
    let mut a = Fleet::new(7);
    let (_, first) = Fleet::new(7).route(&policy, &turns[0]);
    a.in_flight[usize::from(first)] = 5;
    let (_, elsewhere) = a.route(&policy, &turns[0]);
    assert_ne!(elsewhere, first);
    a.in_flight[usize::from(first)] = 0;
    // Replicas B and C, which never saw the conversation, send the second
    // and third turns to the opening's first choice.
    assert_eq!(Fleet::new(7).route(&policy, &turns[1]).1, first);
    assert_eq!(Fleet::new(7).route(&policy, &turns[2]).1, first);
    // A holds the first turn only: the history its index lacks is where
    // the others sent it, so the fourth follows it rather than split the
    // conversation.
    assert_eq!(a.route(&policy, &turns[3]).1, first);
    // Had A routed every turn, the conversation would stay where it is.
    let mut d = Fleet::new(7);
    d.in_flight[usize::from(first)] = 5;
    d.route(&policy, &turns[0]);
    d.in_flight[usize::from(first)] = 0;
    d.route(&policy, &turns[1]);
    d.route(&policy, &turns[2]);
    assert_eq!(
        d.route(&policy, &turns[3]),
        (DecisionKind::Matched, elsewhere)
    );
}

#[test]
fn conversations_of_uneven_lengths_share_the_requests_evenly() {
    // 200 conversations of 1 to 8 turns, started one at a time while
    // earlier ones go on; each next step advances a conversation picked
    // by a hash. Placed by their openings alone, the instances' request
    // counts are a binomial of conversations times their lengths, wider
    // than the bounds below; `share` moves a few conversations early.
    let policy = LongestPrefix::new(64, 1000, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(7);
    let mut served = [0usize; 7];
    let mut rebalanced = 0;
    let mut active: Vec<(Vec<PromptBlocks>, usize)> = Vec::new();
    let mut started = 0;
    let mut step = 0u64;
    while started < 200 || !active.is_empty() {
        step += 1;
        let pick = xxh3_64_with_seed(b"step", step);
        if started < 200 && (active.len() < 20 || pick % 3 == 0) {
            let turns = 1 + (xxh3_64_with_seed(b"turns", started as u64) % 8) as usize;
            active.push((conversation("", started, turns), 0));
            started += 1;
            continue;
        }
        let index = (pick as usize / 3) % active.len();
        let (turns, next) = &mut active[index];
        let (kind, slot) = fleet.route(&policy, &turns[*next]);
        rebalanced += usize::from(kind == DecisionKind::Moved);
        served[usize::from(slot)] += 1;
        *next += 1;
        if *next == turns.len() {
            active.swap_remove(index);
        }
    }
    let total: usize = served.iter().sum();
    assert!(
        served
            .iter()
            .all(|&n| (125 * total..=165 * total).contains(&(n * 1000))),
        "{served:?} of {total}"
    );
    assert!(
        rebalanced * 10 < total,
        "{rebalanced} of {total} rebalanced"
    );
}

#[test]
fn a_holder_loaded_past_the_margin_is_passed_over_and_the_cap_is_exact() {
    // A cap above the bound, so that the bound alone moves it.
    let policy = LongestPrefix::new(10, 2, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(4);
    fleet.hold = true;
    let turns = conversation("", 7, 2);
    let (_, home) = fleet.route(&policy, &turns[0]);
    fleet.in_flight = vec![0; 4];
    // The holder at the margin plus a request per KiB it holds (of
    // turn 0: one full block) above the least loaded: still matched.
    assert_eq!(turns[0].prefix_bytes / 256, 1);
    fleet.in_flight[usize::from(home)] = 2;
    assert_eq!(
        fleet.route(&policy, &turns[1]),
        (DecisionKind::Matched, home)
    );
    // It now holds all of turn 1 (over a KiB): one more is within.
    assert_eq!(turns[1].prefix_bytes / 1024, 1);
    assert_eq!(
        fleet.route(&policy, &turns[1]),
        (DecisionKind::Matched, home)
    );
    // Four above: moved to a less loaded instance, which then holds
    // the prompt as well.
    let (kind, other) = fleet.route(&policy, &turns[1]);
    assert_eq!(kind, DecisionKind::Moved);
    assert_ne!(other, home);
    // At the cap on every instance but one: that one, whatever holds.
    let policy = LongestPrefix::new(3, 2, ColdPlacement::Consistent, None);
    fleet.in_flight = vec![3; 4];
    fleet.in_flight[3] = 2;
    let (_, slot) = fleet.route(&policy, &turns[1]);
    assert_eq!(slot, 3);
    assert_eq!(fleet.in_flight, vec![3; 4]);
    // Every instance at the cap: the least loaded takes it past the cap.
    fleet.in_flight = vec![3, 4, 5, 6];
    assert_eq!(fleet.route(&policy, &turns[1]), (DecisionKind::Overflow, 0));
    assert_eq!(fleet.in_flight[0], 4);
}

#[test]
fn a_contended_claim_still_names_the_instance_uncounted() {
    let policy = LongestPrefix::new(3, 2, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(3);
    fleet.contended = true;
    let blocks = prompt(&record("user", "hello"));
    let routed = fleet.decide(&policy, &blocks, None, 0);
    assert!(routed.headers.host_override.is_some());
    assert_eq!(routed.ticket, None);
    assert_eq!(routed.headers.counted, None);
}

#[test]
fn with_no_instance_known_maglev_on_the_opening_decides() {
    let policy = LongestPrefix::new(3, 2, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(0);
    let blocks = prompt(&record("user", "hello"));
    let routed = fleet.decide(&policy, &blocks, None, 0);
    assert_eq!(routed.headers.kind, DecisionKind::Cold);
    assert_eq!(routed.headers.key, Some(blocks.opening_key()));
    assert_eq!(routed.headers.host_override, None);
    assert_eq!(routed.ticket, None);
}

#[test]
fn matched_and_placed_bytes_report_what_the_chosen_instance_held_and_gains() {
    let policy = LongestPrefix::new(10, 2, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(3);
    let turns = conversation("", 3, 2);
    let first = fleet.decide(&policy, &turns[0], None, 0);
    assert_eq!(first.headers.matched_bytes, Some(0));
    assert_eq!(first.placed_bytes, turns[0].prefix_bytes as u64);
    drop(first);
    let second = fleet.decide(&policy, &turns[1], None, 0);
    // Turn 0 is its opening (its first message, cut as a block of its
    // own): all of it is a prefix of turn 1.
    assert_eq!(turns[0].cuts[1], turns[0].prefix_bytes);
    let opening = turns[0].prefix_bytes;
    assert_eq!(second.headers.matched_bytes, Some(opening as u64));
    assert_eq!(
        second.placed_bytes,
        (turns[1].prefix_bytes - opening) as u64
    );
    drop(second);
    let again = fleet.decide(&policy, &turns[1], None, 0);
    assert_eq!(again.placed_bytes, 0, "a repeated prompt adds nothing");
    drop(again);
}

#[test]
fn an_unlisted_fleet_leaves_cold_prompts_to_maglev_and_explores_when_full() {
    let policy = LongestPrefix::new(3, 2, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(2);
    fleet.listed = false;
    fleet.hold = true;
    let blocks = prompt(&record("user", "a cold question"));
    let routed = fleet.decide(&policy, &blocks, None, 0);
    assert_eq!(routed.headers.kind, DecisionKind::Cold);
    assert_eq!(routed.headers.key, Some(blocks.opening_key()));
    assert_eq!(routed.headers.host_override, None);
    assert_eq!(routed.ticket, None);
    assert!(fleet.held.is_empty(), "learned from the response, not here");
    // Held on slot 1 (as the response would record it): matched there.
    fleet.remember_held(&blocks.chain, 0, &Fleet::instance(1), &[], 0);
    assert_eq!(fleet.route(&policy, &blocks), (DecisionKind::Matched, 1));
    // Every known instance full: a salted opening lets Maglev explore.
    fleet.in_flight = vec![3, 3];
    let routed = fleet.decide(&policy, &blocks, None, 5);
    assert_eq!(routed.headers.kind, DecisionKind::Overflow);
    assert_eq!(routed.headers.host_override, None);
    assert_eq!(
        routed.headers.key,
        Some(salted_key(&blocks.opening_key(), 6))
    );
    assert_eq!(fleet.in_flight, vec![3, 3], "nothing counted past the cap");
}

/// A known fleet (listed, or read from Envoy's admin by `discovery`): a cold
/// prompt is placed here and claimed under the cap, not left to Maglev
/// (which maps a prompt's every copy to one instance, however many are in
/// flight there).
#[test]
fn a_known_fleet_places_cold_prompts_under_the_cap() {
    let policy = LongestPrefix::new(3, 100, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(2);
    fleet.hold = true;
    let blocks = prompt(&record("user", "the same new question"));
    let mut served = Vec::new();
    for _ in 0..4 {
        let routed = fleet.decide(&policy, &blocks, None, 0);
        assert!(routed.ticket.is_some(), "{:?}", routed.headers);
        served.push(routed.headers.host_override.unwrap());
    }
    // The first choice up to the cap, the fourth on the other.
    let mut counts = fleet.in_flight.clone();
    counts.sort_unstable();
    assert_eq!(counts, [1, 3], "{served:?}");
    assert!(served[1..3].iter().all(|s| *s == served[0]), "{served:?}");
    assert_ne!(served[3], served[0]);
}

#[test]
fn a_moved_request_reports_and_extends_what_its_new_instance_held() {
    let policy = LongestPrefix::new(10, 0, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(2);
    let turns = conversation("", 5, 3);
    let (_, home) = fleet.route(&policy, &turns[0]);
    let other = 1 - home;
    // Turn 1 moved to the other instance (home busy), turn 2 back home:
    // the other instance holds turn 1's prefix, home only turn 0's.
    fleet.in_flight[usize::from(home)] = 1;
    assert_eq!(
        fleet.route(&policy, &turns[1]),
        (DecisionKind::Moved, other)
    );
    fleet.in_flight = vec![0, 0];
    // Past its bound: turn 1's prefix (a KiB) allows it one request.
    fleet.in_flight[usize::from(other)] = 2;
    let routed = fleet.decide(&policy, &turns[2], None, 0);
    assert_eq!(routed.headers.kind, DecisionKind::Moved);
    let turn0 = turns[0].prefix_bytes as u64;
    assert_eq!(routed.headers.matched_bytes, Some(turn0));
}

#[test]
fn the_load_bound_grows_with_the_least_loaded_instance() {
    assert_eq!(load_bound(0, 4), 4);
    assert_eq!(load_bound(3, 4), 10);
    assert_eq!(load_bound(u32::MAX, 4), u32::MAX);
}

#[test]
fn a_holder_may_be_a_request_past_the_bound_per_kib_it_holds() {
    // Instance 0 holds 4 KiB of a 5 KiB prompt; instance 1 nothing, idle:
    // the bound is 2, and the holder stays the cheaper up to 4 past it.
    let prompt = Prompt {
        bytes: 5 * 1024,
        opening: 7,
        extends_placed: false,
        balances: false,
    };
    let held = [
        Held {
            bytes: 4 * 1024,
            longest: true,
        },
        Held {
            bytes: 0,
            longest: false,
        },
    ];
    let first_at = |holder_load: u32| {
        let candidates = [
            Candidate::local(Fleet::instance(0), holder_load),
            Candidate::local(Fleet::instance(1), 0),
        ];
        let ranking = score(
            &candidates,
            &held,
            &prompt,
            &RecentChoices::default(),
            fleet_load_bound(&candidates, 2),
        );
        assert_eq!(ranking.bound, 2);
        let first = ranking.order[0];
        (first.candidate.instance.slot, first.cost)
    };
    assert_eq!(
        first_at(5),
        (
            0,
            Cost {
                load: 3 * 1024,
                prefill: 1024,
                share: 0
            }
        )
    );
    assert_eq!(first_at(7).0, 1);
    assert_eq!(
        first_at(7).1,
        Cost {
            load: 0,
            prefill: 5 * 1024,
            share: 0
        }
    );
}

#[test]
fn a_long_held_prefix_stays_at_a_load_that_moves_a_short_one() {
    let policy = LongestPrefix::new(64, 2, ColdPlacement::Consistent, None);
    let long = prompt(&record("user", &"a document ".repeat(745)));
    let short = prompt(&record("user", &"b question ".repeat(50)));
    assert!(long.prefix_bytes >= 8 * 1024 && short.prefix_bytes < 1024);
    for blocks in [&long, &short] {
        let mut fleet = Fleet::new(4);
        let (_, home) = fleet.route(&policy, blocks);
        // Six busier than every other instance: past the flat bound (2).
        fleet.in_flight[usize::from(home)] = 6;
        let (kind, slot) = fleet.route(&policy, blocks);
        if std::ptr::eq(blocks, &long) {
            assert_eq!((kind, slot), (DecisionKind::Matched, home));
        } else {
            assert_eq!(kind, DecisionKind::Moved);
            assert_ne!(slot, home);
        }
    }
}

#[test]
fn load_other_proxies_sent_moves_a_prompt_off_its_holder() {
    let policy = LongestPrefix::new(10, 2, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(4);
    let turns = conversation("", 3, 2);
    let (_, home) = fleet.route(&policy, &turns[0]);
    // This Envoy has nothing in flight anywhere; the engines report
    // five requests on the holder (other proxies'), none elsewhere.
    fleet.engine = vec![Some(0); 4];
    fleet.engine[usize::from(home)] = Some(2);
    assert_eq!(
        fleet.route(&policy, &turns[1]),
        (DecisionKind::Matched, home),
        "two above the least loaded: within the margin"
    );
    fleet.engine[usize::from(home)] = Some(5);
    let (kind, other) = fleet.route(&policy, &turns[1]);
    assert_eq!(kind, DecisionKind::Moved);
    assert_ne!(other, home);
}

#[test]
fn the_fleet_wide_bound_passes_an_instance_over_while_another_is_within_it() {
    let policy = LongestPrefix::new(10, 1000, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(4);
    fleet.max_requests = Some(3);
    let turns = conversation("", 4, 2);
    let (_, home) = fleet.route(&policy, &turns[0]);
    fleet.engine = vec![Some(0); 4];
    fleet.engine[usize::from(home)] = Some(3);
    let (kind, other) = fleet.route(&policy, &turns[1]);
    assert_eq!(kind, DecisionKind::Moved, "the margin alone would keep it");
    assert_ne!(other, home);
    // Every instance at the bound: a holder of the prompt (both hold it
    // now), the least loaded (equal loads: the cheapest), counted.
    fleet.engine = vec![Some(3); 4];
    fleet.hold = true;
    fleet.in_flight = vec![0; 4];
    let (kind, slot) = fleet.route(&policy, &turns[1]);
    assert_eq!(kind, DecisionKind::Overflow);
    assert!([home, other].contains(&slot), "{slot}");
    assert_eq!(fleet.in_flight.iter().sum::<u32>(), 1);
}

/// An instance over the KV-usage bound with few requests does not set
/// the others' load bound: the prompt stays on the instance that holds it.
#[test]
fn an_instance_over_a_bound_does_not_set_the_load_bound() {
    let policy = LongestPrefix::new(100, 4, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(3);
    let turns = conversation("", 6, 2);
    let (_, home) = fleet.route(&policy, &turns[0]);
    let idle = (0..3u16).find(|s| *s != home).expect("another");
    fleet.in_flight = vec![11; 3];
    fleet.in_flight[usize::from(home)] = 12;
    fleet.in_flight[usize::from(idle)] = 2;
    fleet.kv_full = vec![idle];
    assert_eq!(
        fleet.route(&policy, &turns[1]),
        (DecisionKind::Matched, home),
        "within 2 x 11 + 4 of the least loaded instance that may take it"
    );
}

/// Without `instances`, a cold prompt goes by Maglev only while no known
/// instance is over a fleet-wide bound: Maglev could pick that one.
#[test]
fn an_unlisted_fleet_places_cold_prompts_among_its_instances_while_one_is_over_a_bound() {
    let policy = LongestPrefix::new(10, 4, ColdPlacement::Consistent, None);
    let blocks = distinct_prompt(3);
    let mut fleet = Fleet::new(4);
    fleet.listed = false;
    let routed = fleet.decide(&policy, &blocks, None, 0);
    assert_eq!(routed.headers.host_override, None, "left to Maglev");
    let first = top_two(&blocks, 4)[0];
    fleet.kv_full = vec![first];
    let (kind, slot) = fleet.route(&policy, &blocks);
    assert_eq!(kind, DecisionKind::Cold, "nothing held");
    assert_eq!(slot, top_two(&blocks, 4)[1], "the opening's next choice");
}

/// Every instance at the fleet-wide bound: the least loaded takes the
/// request, listed fleet or not, not the first where this Envoy happens
/// to have nothing in flight.
#[test]
fn at_the_bound_everywhere_the_least_loaded_takes_the_request() {
    for listed in [true, false] {
        let policy = LongestPrefix::new(10, 1000, ColdPlacement::Consistent, None);
        let mut fleet = Fleet::new(3);
        fleet.listed = listed;
        fleet.max_requests = Some(3);
        fleet.engine = vec![Some(9), Some(3), Some(5)];
        fleet.in_flight = vec![0, 1, 1];
        fleet.hold = true;
        let (_, slot) = fleet.route(&policy, &conversation("", 7, 1)[0]);
        assert_eq!(slot, 1, "listed: {listed}");
    }
}

#[test]
fn claims_stay_within_the_room_the_engines_report() {
    let policy = LongestPrefix::new(10, 1000, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(4);
    fleet.hold = true;
    fleet.max_requests = Some(4);
    // Two requests of other proxies on every instance: room for two
    // more each under the fleet-wide bound of four.
    fleet.engine = vec![Some(2); 4];
    let turns = conversation("", 5, 1);
    for _ in 0..8 {
        fleet.route(&policy, &turns[0]);
    }
    assert_eq!(fleet.in_flight, vec![2; 4]);
    // The ninth finds every instance at the bound: the least loaded
    // takes it all the same (no request is refused).
    fleet.route(&policy, &turns[0]);
    assert_eq!(fleet.in_flight.iter().sum::<u32>(), 9);
}

#[test]
fn an_instance_in_a_departed_ones_slot_starts_with_none_of_its_recent_choices() {
    let policy = LongestPrefix::new(64, 2, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(1);
    let blocks = prompt(&"a question ".repeat(100));
    for _ in 0..5 {
        fleet.decide(&policy, &blocks, None, 0);
    }
    assert_eq!(fleet.recent.count(0), 5);
    fleet.reseated = true;
    let routed = fleet.decide(&policy, &blocks, None, 0);
    assert_eq!(
        routed.headers.host_override.as_deref(),
        Some("10.0.9.9:8000")
    );
    assert_eq!(fleet.recent.count(0), 1, "this decision only");
}

#[test]
fn share_counts_decisions_past_even_plus_the_slack() {
    assert_eq!(past_share(38, 256, 7), 0);
    assert_eq!(past_share(40, 256, 7), 2);
    // The even share is at least 8 decisions, however few were made or
    // however many instances share them.
    assert_eq!(past_share(10, 10, 7), 0);
    assert_eq!(past_share(11, 11, 7), 1);
    assert_eq!(past_share(12, 256, 64), 2);
    assert_eq!(past_share(u32::MAX, u32::MAX, 0), 0);
}

#[test]
fn a_tie_goes_to_the_openings_rank_and_balanced_weighs_the_two_best() {
    let candidates: Vec<Candidate> = (0..5)
        .map(|slot| Candidate::local(Fleet::instance(slot), 0))
        .collect();
    let mut recent = RecentChoices::default();
    for slot in 0..5 {
        recent.note(slot, 1000 * u64::from(slot));
    }
    let held = [Held {
        bytes: 0,
        longest: false,
    }; 5];
    let mut prompt = Prompt {
        bytes: 4096,
        opening: 42,
        extends_placed: false,
        balances: false,
    };
    let slots = |prompt: &Prompt| -> Vec<u16> {
        score(
            &candidates,
            &held,
            prompt,
            &recent,
            fleet_load_bound(&candidates, 2),
        )
        .order
        .iter()
        .map(|s| s.candidate.instance.slot)
        .collect()
    };
    let mut by_rank: Vec<u16> = (0..5).collect();
    by_rank.sort_by_key(|&s| std::cmp::Reverse(rank(42, &Fleet::instance(s).address)));
    assert_eq!(slots(&prompt), by_rank);
    prompt.balances = true;
    let balanced = slots(&prompt);
    let [first, second] = [by_rank[0], by_rank[1]];
    if first > second {
        assert_eq!(&balanced[..2], &[second, first], "fewer bytes placed first");
    } else {
        assert_eq!(balanced, by_rank);
    }
}

#[test]
fn a_prompt_of_system_messages_alone_sent_again_stays_with_its_holder_past_the_share() {
    // A group's long system prompt that fills the whole prefix: every
    // request of the group is the same prefix, held whole.
    let policy = LongestPrefix::new(10, 2, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(7);
    let group = prompt(&record("system", &"group prompt ".repeat(400)));
    let (_, first) = fleet.route(&policy, &group);
    let mut counts = [9u32; 7];
    counts[usize::from(first)] = 60;
    note_recent(&mut fleet, &counts);
    assert_eq!(fleet.route(&policy, &group), (DecisionKind::Matched, first));
}

/// `policy` for a fleet of `instances` with adapters' sets of
/// `min..=max` instances.
fn with_adapters(min: u32, max: u32, threshold: u32, margin: u32) -> LongestPrefix {
    let sets = AdapterSets {
        min_instances: min,
        max_instances: max,
    };
    LongestPrefix::new(threshold, margin, ColdPlacement::Consistent, Some(sets))
}

/// Routes `blocks` for `adapter`: the instance chosen and the adapter's part
/// of the decision; the request stays in flight while `fleet.hold`.
fn route_adapter(
    fleet: &mut Fleet,
    policy: &LongestPrefix,
    blocks: &PromptBlocks,
    adapter: Option<u64>,
) -> (u16, Option<AdapterDecision>) {
    let routed = fleet.decide(policy, blocks, adapter, 0);
    let host = routed
        .headers
        .host_override
        .clone()
        .expect("names the instance");
    let slot = (0..fleet.in_flight.len() as u16)
        .find(|s| *Fleet::instance(*s).address == *host)
        .unwrap();
    if routed.ticket.is_some() && !fleet.hold {
        fleet.in_flight[usize::from(slot)] -= 1;
    }
    (slot, routed.headers.adapter)
}

/// The adapter's instances in its rendezvous order.
fn adapter_order(fleet: &mut Fleet, adapter: u64) -> Vec<u16> {
    let all = fleet.candidates(0);
    let sets = AdapterSets {
        min_instances: 1,
        max_instances: 1024,
    };
    let (order, _) = adapter_set(adapter, &all, 0, sets, None);
    order.iter().map(|c| c.instance.slot).collect()
}

#[test]
fn an_adapters_requests_stay_on_its_set_and_base_model_requests_route_as_before() {
    let policy = with_adapters(1, 1024, 10, 4);
    let plain = LongestPrefix::new(10, 4, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(7);
    let home = adapter_order(&mut fleet, 42)[0];
    // One at a time, so never loaded: the set stays one instance, however
    // far past its share of this worker's decisions its home is.
    for i in 0..40 {
        let blocks = prompt(&record(
            "user",
            &format!("question {i} {}", "x".repeat(600)),
        ));
        let (slot, adapter) = route_adapter(&mut fleet, &policy, &blocks, Some(42));
        assert_eq!(slot, home, "request {i}");
        let in_set = AdapterDecision {
            placement: AdapterPlacement::InSet,
            set_size: 1,
        };
        assert_eq!(adapter, Some(in_set));
    }
    // The base model, held in flight: as the policy without adapters
    // decides, request by request.
    let (mut with, mut without) = (Fleet::new(7), Fleet::new(7));
    with.hold = true;
    without.hold = true;
    let mut base_slots = std::collections::HashSet::new();
    for (i, turn) in (0..12)
        .flat_map(|c| conversation("system", c, 3))
        .enumerate()
    {
        let routed = route_adapter(&mut with, &policy, &turn, None);
        assert_eq!(
            routed,
            route_adapter(&mut without, &plain, &turn, None),
            "request {i}"
        );
        base_slots.insert(routed.0);
    }
    assert!(base_slots.len() >= 4, "{base_slots:?}");
}

#[test]
fn a_loaded_set_grows_in_the_adapters_order_and_shrinks_as_it_cools() {
    // Bound 2 x 0 + 2: an instance with 2 in flight is loaded.
    let policy = with_adapters(1, 1024, 10, 2);
    let mut fleet = Fleet::new(7);
    fleet.hold = true;
    let order = adapter_order(&mut fleet, 7);
    let mut sizes = Vec::new();
    for i in 0..8 {
        let blocks = prompt(&record(
            "user",
            &format!("question {i} {}", "x".repeat(600)),
        ));
        let (slot, adapter) = route_adapter(&mut fleet, &policy, &blocks, Some(7));
        let adapter = adapter.unwrap();
        let size = adapter.set_size as usize;
        assert!(
            order[..size].contains(&slot),
            "request {i}: {slot} not in {order:?}[..{size}]"
        );
        let grown = order[1..size].contains(&slot);
        assert_eq!(grown, adapter.placement == AdapterPlacement::SetGrown);
        sizes.push(size);
    }
    // The set grows one instance at a time, each joining only once those
    // before it are at the bound; none is more than a request past it.
    assert!(
        sizes.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1),
        "{sizes:?}"
    );
    assert!(sizes[7] >= 3, "{sizes:?}");
    let top = fleet.in_flight.iter().max().copied();
    assert_eq!(top, Some(3), "{:?}", fleet.in_flight);
    // Cooled: the set is its first instance again.
    fleet.in_flight.iter_mut().for_each(|n| *n = 0);
    let blocks = prompt(&record("user", &format!("later {}", "x".repeat(600))));
    let (slot, adapter) = route_adapter(&mut fleet, &policy, &blocks, Some(7));
    assert_eq!((slot, adapter.unwrap().set_size), (order[0], 1));
}

#[test]
fn past_the_cap_the_rest_of_the_set_first_outside_only_when_it_is_full() {
    // Sets of exactly 2; a cap of 2 per instance; no load bound in the way.
    let policy = with_adapters(2, 2, 2, 1000);
    let mut fleet = Fleet::new(5);
    fleet.hold = true;
    let order = adapter_order(&mut fleet, 9);
    // Prompts that share nothing: no instance holds any (which would put
    // it in the set).
    let question = |i: usize| {
        prompt(&record(
            "user",
            &format!("question {i} {}", "x".repeat(600)),
        ))
    };
    let mut went = Vec::new();
    for i in 0..6 {
        went.push(route_adapter(&mut fleet, &policy, &question(i), Some(9)));
    }
    let in_set = went.iter().take(4).all(|(slot, a)| {
        order[..2].contains(slot) && a.unwrap().placement != AdapterPlacement::OutsideSet
    });
    assert!(in_set, "{went:?}");
    for (slot, adapter) in &went[4..] {
        assert!(!order[..2].contains(slot), "{went:?}");
        assert_eq!(adapter.unwrap().placement, AdapterPlacement::OutsideSet);
    }
    // Every instance full: the least loaded of the set, past the cap.
    fleet.in_flight = vec![2; 5];
    fleet.in_flight[usize::from(order[1])] = 3;
    let (slot, adapter) = route_adapter(&mut fleet, &policy, &question(6), Some(9));
    assert_eq!(slot, order[0]);
    assert_eq!(adapter.unwrap().placement, AdapterPlacement::InSet);
}

#[test]
fn replicas_agree_on_an_adapters_order_whatever_order_they_list_the_fleet_in() {
    let mut fleet = Fleet::new(9);
    let all = fleet.candidates(0);
    let mut reversed = all.clone();
    reversed.reverse();
    let sets = AdapterSets {
        min_instances: 3,
        max_instances: 9,
    };
    for adapter in 0..50u64 {
        let names = |c: &[Candidate]| {
            let (set, _) = adapter_set(adapter, c, 4, sets, None);
            set.iter()
                .map(|c| c.instance.address.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&all), names(&reversed));
    }
    // Adapters' first instances spread over the fleet.
    let firsts: std::collections::HashSet<u16> = (0..50u64)
        .map(|a| adapter_order(&mut fleet, a)[0])
        .collect();
    assert_eq!(firsts.len(), 9);
}

#[test]
fn an_instance_holding_the_adapters_conversation_is_in_its_set() {
    let policy = with_adapters(1, 1, 10, 4);
    let plain = LongestPrefix::new(10, 4, ColdPlacement::Consistent, None);
    let mut fleet = Fleet::new(7);
    let turns = conversation("", 3, 2);
    let (held_by, _) = route_adapter(&mut fleet, &plain, &turns[0], None);
    let adapter = (0..64u64)
        .find(|&a| adapter_order(&mut fleet, a)[0] != held_by)
        .unwrap();
    let (slot, decision) = route_adapter(&mut fleet, &policy, &turns[1], Some(adapter));
    assert_eq!(slot, held_by);
    let in_set = AdapterDecision {
        placement: AdapterPlacement::InSet,
        set_size: 2,
    };
    assert_eq!(decision, Some(in_set));
    // A new conversation of the adapter: its set alone.
    let other = conversation("", 4, 1);
    let (slot, _) = route_adapter(&mut fleet, &policy, &other[0], Some(adapter));
    assert_eq!(slot, adapter_order(&mut fleet, adapter)[0]);
}

#[test]
fn an_instance_whose_engine_runs_the_adapter_joins_its_set() {
    // Cap 1, held in flight: the set's one instance and the instance whose
    // engine runs the adapter take the first two requests; without the
    // engine's report the second goes outside the set.
    let policy = with_adapters(1, 1, 1, 100);
    let ask = |i: usize| {
        prompt(&record(
            "user",
            &format!("question {i} {}", "x".repeat(600)),
        ))
    };
    let mut running = AdapterNames::default();
    running.insert(42);
    for reported in [false, true] {
        let mut fleet = Fleet::new(7);
        fleet.hold = true;
        let order = adapter_order(&mut fleet, 42);
        let runner = order[4];
        if reported {
            fleet.active = vec![Some(AdapterNames::default()); 7];
            fleet.active[usize::from(runner)] = Some(running.clone());
        }
        let routed: Vec<_> = (0..2)
            .map(|i| route_adapter(&mut fleet, &policy, &ask(i), Some(42)))
            .collect();
        let slots: Vec<u16> = routed.iter().map(|(slot, _)| *slot).collect();
        let placements: Vec<_> = routed
            .iter()
            .map(|(_, a)| a.map(|a| (a.placement, a.set_size)))
            .collect();
        if reported {
            assert!(
                slots.contains(&order[0]) && slots.contains(&runner),
                "{slots:?}"
            );
            assert_eq!(placements, [Some((AdapterPlacement::InSet, 2)); 2]);
        } else {
            assert_eq!(slots[0], order[0]);
            assert_eq!(
                placements,
                [
                    Some((AdapterPlacement::InSet, 1)),
                    Some((AdapterPlacement::OutsideSet, 1))
                ]
            );
        }
    }
}

#[test]
fn an_adapter_goes_only_to_instances_whose_engine_lists_it_or_whose_list_is_unknown() {
    // Cap 2: the first lister takes two requests held in flight, then the
    // next lister in the adapter's order; never an instance that does not
    // list it, however idle.
    let policy = with_adapters(1, 1024, 2, 100);
    let mut fleet = Fleet::new(7);
    let order = adapter_order(&mut fleet, 42);
    let listing = |adapters: &[u64]| {
        let mut served = AdapterNames::default();
        adapters.iter().for_each(|&a| served.insert(a));
        Some(served)
    };
    fleet.served = vec![listing(&[7]); 7];
    let (first, second) = (order[3], order[5]);
    fleet.served[usize::from(first)] = listing(&[7, 42]);
    fleet.served[usize::from(second)] = listing(&[42]);
    fleet.hold = true;
    let ask = |i: usize| {
        prompt(&record(
            "user",
            &format!("question {i} {}", "x".repeat(600)),
        ))
    };
    let slots: Vec<u16> = (0..6)
        .map(|i| route_adapter(&mut fleet, &policy, &ask(i), Some(42)).0)
        .collect();
    assert_eq!(slots[..4], [first, first, second, second]);
    // Both full: the least loaded of the two, counted past the cap.
    assert!(
        slots[4..].iter().all(|s| [first, second].contains(s)),
        "{slots:?}"
    );
    // An instance whose list is not known may serve it: its home again.
    let mut fleet = Fleet::new(7);
    fleet.served = vec![listing(&[7]); 7];
    fleet.served[usize::from(order[0])] = None;
    assert_eq!(
        route_adapter(&mut fleet, &policy, &ask(9), Some(42)).0,
        order[0]
    );
    // Listed nowhere: routed as without the lists (the engine answers).
    fleet.served[usize::from(order[0])] = listing(&[7]);
    assert_eq!(
        route_adapter(&mut fleet, &policy, &ask(9), Some(42)).0,
        order[0]
    );
}

#[test]
fn a_short_system_prompt_sets_no_instance_apart() {
    // Worth less prefill than a request in flight: each first turn goes
    // where its opening ranks first, from the first conversation on.
    let policy = LongestPrefix::new(64, 4, ColdPlacement::Consistent, None);
    let system = record("system", "You are a helpful support assistant.");
    let mut fleet = Fleet::new(3);
    let mut homes = HashSet::new();
    for id in 0..8 {
        let first_turn = &conversation(&system, id, 1)[0];
        let (kind, slot) = fleet.route(&policy, first_turn);
        assert_eq!(
            (kind, slot),
            (DecisionKind::Cold, top_two(first_turn, 3)[0]),
            "{id}"
        );
        homes.insert(slot);
    }
    assert!(homes.len() > 1, "{homes:?}");
    // A longer one still draws new conversations to its holder.
    let system = record("system", &"shared system prompt ".repeat(60));
    let mut fleet = Fleet::new(3);
    let (_, holder) = fleet.route(&policy, &conversation(&system, 0, 1)[0]);
    let (kind, slot) = fleet.route(&policy, &conversation(&system, 1, 1)[0]);
    assert_eq!((kind, slot), (DecisionKind::Matched, holder));
}

/// Seven instances whose engines all list `adapters` (and the base model).
fn listing_every_adapter(adapters: &[u64]) -> Vec<Candidate> {
    let names: Vec<(u64, bool)> = adapters
        .iter()
        .map(|&a| (a, true))
        .chain([(1, false)])
        .collect();
    (1..=7u16)
        .map(|slot| {
            let mut c = Candidate::local(
                InstanceRef::new(slot, format!("10.0.0.{slot}:8000").into()),
                0,
            );
            c.served = Some(AdapterNames::of_list(names.clone()));
            c
        })
        .collect()
}

#[test]
fn listed_adapters_are_dealt_evenly_and_every_replica_deals_them_alike() {
    let adapters: Vec<u64> = (0..40u64)
        .map(|a| crate::load::adapter_hash(format!("adapter-{a}").as_bytes()))
        .collect();
    let fleet = listing_every_adapter(&adapters);
    let dealt = DealtHomes::default();
    let home_of = |a: u64, fleet: &[Candidate]| DealtHomes::default().home_of(a, fleet);
    let mut homes: HashMap<u16, usize> = HashMap::new();
    for &a in &adapters {
        let home = dealt
            .home_of(a, &fleet)
            .expect("a listed adapter has a home");
        *homes.entry(home).or_default() += 1;
    }
    let mut counts: Vec<usize> = homes.values().copied().collect();
    counts.sort_unstable();
    assert_eq!(counts, [5, 5, 6, 6, 6, 6, 6], "{homes:?}");
    // Another replica's candidates in another order: the same homes.
    let mut reversed = fleet.clone();
    reversed.reverse();
    for &a in &adapters {
        assert_eq!(home_of(a, &reversed), dealt.home_of(a, &fleet));
    }
    // Not listed, or no list known: no home (rendezvous, as before).
    assert_eq!(dealt.home_of(99, &fleet), None);
    let unknown: Vec<Candidate> = fleet
        .iter()
        .map(|c| Candidate {
            served: None,
            ..c.clone()
        })
        .collect();
    assert_eq!(dealt.home_of(adapters[0], &unknown), None);
    // The same worker deals again when the lists change: one adapter fewer.
    let fewer = listing_every_adapter(&adapters[1..]);
    assert_eq!(dealt.home_of(adapters[0], &fewer), None);
    assert!(dealt.home_of(adapters[1], &fewer).is_some());
}
