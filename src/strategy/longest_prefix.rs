//! PREFIX_AWARE with `match: LONGEST_PREFIX` (the default): where a request
//! goes, and why. The whole decision is here; the tables it reads
//! (`crate::load`) only count and remember.
//!
//! Every fresh instance gets a cost, in bytes of prompt computed:
//!
//! ```text
//! cost = load + prefill + share
//! ```
//!
//! - **prefill**: the prompt bytes the instance would compute, all but the
//!   prefix the prefix index says it holds. The opening's first choice is
//!   presumed to hold a later turn's history unless the index holds the
//!   previous turn elsewhere: the earlier turns went there, through this
//!   Envoy or a replica whose index this one does not see. System messages
//!   that set no instance apart count as held everywhere: those shorter
//!   than a request weighs ([`REQUEST_BYTES`]), those more than half the
//!   fleet holds, or whose holders took more than their share of recent
//!   decisions (a prompt every conversation shares, not one group's), so
//!   that they spread instead of piling up.
//! - **load**: its requests in flight past the load bound, twice the least
//!   loaded instance's plus `load_margin`, [`REQUEST_BYTES`] each.
//! - **share**: only for a request that adds to text this Envoy placed (a
//!   conversation's next turn, a new question about a held document): this
//!   worker's recent decisions for the instance past its even share plus
//!   [`SHARE_SLACK`], [`DECISION_BYTES`] each.
//!
//! Filters: a request for a LoRA adapter (`adapters`) goes to instances
//! whose engine lists it, if any does, and is served by the adapter's set
//! ([`adapter_set`]): its home where the engines list the fleet's adapters
//! ([`deal_homes`]), then its rendezvous order, more as they load, the
//! instances that hold a prefix of the prompt, and those whose engine runs
//! the adapter (`vllm:lora_requests_info`); outside the set only when every
//! instance in it is full.
//! An instance over a fleet-wide engine bound is left out while
//! another is within the bounds. Picker: the lowest cost; ties go to the
//! highest rendezvous rank of the prompt's opening, so replicas that see the
//! same instances agree with no shared state; where `share` counts, first to
//! the instance this worker chose least, which evens the shares. With
//! `cold_placement: BALANCED`, a first prompt of at least
//! [`BALANCED_MIN_BYTES`] goes to the second of two tied instances if this
//! worker placed fewer bytes there. The choice is claimed under
//! `concurrency_threshold` and the load at which it would stop being the
//! cheapest; a refused claim goes to the next in order; with every instance
//! full, the least loaded takes it, counted past the cap.
//!
//! A fleet that is not listed (`instances`, or read by `discovery`) is
//! learned from traffic: a prompt whose prefix sets no known instance apart
//! goes by Maglev on its opening, over every host Envoy has, and the index
//! learns where it went from the response.
//!
//! The chosen instance is named in the host-override header; the key header
//! carries the opening's hash, so Envoy falls back to Maglev on it, as every
//! replica would. The index then records that the instance holds the prompt.

use std::rc::Rc;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{salted_key, DecisionKind, RecentChoices, RouteHeaders, Routed};
use crate::blocks::PromptBlocks;
use crate::config::ColdPlacement;
use crate::load::{Candidate, Claim, LoadView, Ticket};

/// A request in flight past the load bound weighs as much as this much
/// prompt to compute: a request more mostly decodes beside the others, while
/// moving costs the prefill of all the instance holds.
pub const REQUEST_BYTES: u64 = 1024;

/// A recent decision past an instance's even share weighs this much prompt:
/// a conversation moves off an instance past its share while little of it is
/// held there, which evens the requests of conversations of uneven lengths.
pub const DECISION_BYTES: u64 = 256;

/// Decisions past its even share an instance may have before `share` counts.
pub const SHARE_SLACK: u32 = 2;

/// The even share, in decisions, is at least this: with fewer decisions made
/// shares say little (one conversation through a fresh Envoy stays).
pub const SHARE_MIN_DECISIONS: u32 = 8;

/// The fewest prompt bytes a first prompt needs for `BALANCED` to weigh its
/// two choices: documents and pasted text fill caches unevenly, short
/// openings and later turns keep the choice every replica agrees on.
pub const BALANCED_MIN_BYTES: usize = 2048;

/// See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LongestPrefix {
    /// Requests in flight from this Envoy at which an instance takes no more
    /// (1..=1024): the same exact, atomic cap as FIXED_PREFIX's.
    pub concurrency_threshold: u32,
    /// The load bound's slack above twice the least loaded instance.
    pub load_margin: u32,
    /// How a prompt no instance holds is placed among tied instances.
    pub cold_placement: ColdPlacement,
    /// LoRA adapters' sets (`adapters`); `None`: none.
    pub adapters: Option<AdapterSets>,
    /// The adapters' homes, as this worker dealt them last.
    pub homes: DealtHomes,
}

/// The bounds of an adapter's set, in instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterSets {
    pub min_instances: u32,
    pub max_instances: u32,
}

/// Where a request for an adapter went against the adapter's set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterPlacement {
    /// To one of the set's first `min_instances`.
    InSet,
    /// To an instance the set has because its first ones are loaded.
    SetGrown,
    /// Outside the set: every instance in it was full.
    OutsideSet,
}

impl AdapterPlacement {
    pub fn as_str(self) -> &'static str {
        match self {
            AdapterPlacement::InSet => "in_set",
            AdapterPlacement::SetGrown => "set_grown",
            AdapterPlacement::OutsideSet => "outside_set",
        }
    }
}

/// What the decision did with a request for an adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterDecision {
    pub placement: AdapterPlacement,
    /// Instances in the adapter's set at this decision.
    pub set_size: u32,
}

/// One instance's cost, term by term, in bytes of prompt computed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cost {
    pub load: u64,
    pub prefill: u64,
    pub share: u64,
}

impl Cost {
    pub fn total(&self) -> u64 {
        self.load
            .saturating_add(self.prefill)
            .saturating_add(self.share)
    }
}

/// Why the request went where it went: the chosen instance's cost and the
/// runner-up's, for the `decision_header`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Explained {
    pub cost: Cost,
    pub runner_up: Option<(Rc<str>, Cost)>,
}

/// What the decision reads of one candidate besides its load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// Prompt bytes the instance holds (or is presumed to hold).
    pub bytes: usize,
    /// It holds the longest prefix any instance holds.
    pub longest: bool,
}

/// A candidate scored: its cost and its rendezvous rank for ties.
#[derive(Debug, Clone, Copy)]
pub struct Scored<'a> {
    pub candidate: &'a Candidate,
    pub held: Held,
    pub cost: Cost,
    pub rank: u64,
}

/// The prompt as the cost sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prompt {
    pub bytes: usize,
    pub opening: u64,
    /// `share` counts: the request adds to text this Envoy placed.
    pub extends_placed: bool,
    /// `BALANCED` may weigh the two best-ranked tied instances.
    pub balances: bool,
}

/// Rendezvous score of `address` for a prompt opening.
pub fn rank(opening: u64, address: &str) -> u64 {
    xxh3_64_with_seed(address.as_bytes(), opening)
}

/// The load bound: twice the least loaded instance's load plus `margin`, so
/// the ordinary spread of in-flight counts under heavy load (which grows
/// with them) does not move prompts off the instances that hold them.
pub fn load_bound(least: u32, margin: u32) -> u32 {
    least.saturating_mul(2).saturating_add(margin)
}

/// The load bound over the candidates within the fleet-wide engine bounds
/// (all of them if none is).
fn fleet_load_bound(candidates: &[Candidate], margin: u32) -> u32 {
    let some_within = candidates.iter().any(|c| !c.over_bounds);
    let least = candidates
        .iter()
        .filter(|c| !c.over_bounds || !some_within)
        .map(|c| c.load)
        .min()
        .unwrap_or(0);
    load_bound(least, margin)
}

/// An adapter's set among `candidates`, and the others that serve it: of
/// the instances whose engine lists the adapter (or whose list is not
/// known; all, if none lists it), the set is its `home` if it has one, then
/// the first of the adapter's rendezvous order (every replica computes the
/// same), in that order. It has `min_instances`, and one more while every
/// instance in it is at or past the load `bound` or an engine bound, up to
/// `max_instances`: a hot adapter
/// spreads, a cool one holds few of the fleet's adapter slots (each
/// instance it joins loads it), and the set shrinks back as its load falls.
pub fn adapter_set(
    adapter: u64,
    candidates: &[Candidate],
    bound: u32,
    sets: AdapterSets,
    home: Option<u16>,
) -> (Vec<Candidate>, Vec<Candidate>) {
    let loaded = |c: &Candidate| c.load >= bound || c.over_bounds;
    let min = usize::try_from(sets.min_instances).unwrap_or(usize::MAX);
    let max = usize::try_from(sets.max_instances).unwrap_or(usize::MAX);
    let mut rest: Vec<Candidate> = candidates
        .iter()
        .filter(|c| c.may_serve(adapter))
        .cloned()
        .collect();
    if rest.is_empty() {
        rest = candidates.to_vec();
    }
    let mut set: Vec<Candidate> = Vec::new();
    if let Some(home) = home {
        if let Some(at) = rest.iter().position(|c| c.instance.slot == home) {
            set.push(rest.swap_remove(at));
        }
    }
    while set.len() < max && (set.len() < min || set.iter().all(loaded)) {
        let next = rest
            .iter()
            .enumerate()
            .max_by_key(|(_, c)| rank(adapter, &c.instance.address))
            .map(|(at, _)| at);
        let Some(at) = next else { break };
        set.push(rest.swap_remove(at));
    }
    (set, rest)
}

/// The adapters' first instances where the engines list the fleet's
/// adapters (`/v1/models`; every replica reads the same lists): they are
/// dealt out in the order of their hashes, each to the first instance of its
/// rendezvous order that lists it and is the first of fewer adapters than
/// its even share, so no instance is the first of more adapters than
/// another but one. Sorted by adapter; empty where no list is known.
pub fn deal_homes(candidates: &[Candidate]) -> Homes {
    let mut fleet: Vec<u64> = candidates
        .iter()
        .filter_map(|c| c.served.as_ref())
        .flat_map(|served| served.listed().iter().copied())
        .collect();
    fleet.sort_unstable();
    fleet.dedup();
    // Each instance is the first of `even` adapters, `spare` of them of one more.
    let instances = candidates.len().max(1);
    let (even, mut spare) = (fleet.len() / instances, fleet.len() % instances);
    let mut count = vec![0usize; candidates.len()];
    let mut homes = Vec::with_capacity(fleet.len());
    for &name in &fleet {
        let room = |n: usize| n < even || (n == even && spare > 0);
        let Some(at) = candidates
            .iter()
            .enumerate()
            .filter(|&(i, c)| count.get(i).is_some_and(|&n| room(n)) && c.may_serve(name))
            .max_by_key(|(_, c)| rank(name, &c.instance.address))
            .map(|(i, _)| i)
        else {
            continue;
        };
        if let (Some(n), Some(c)) = (count.get_mut(at), candidates.get(at)) {
            if *n == even {
                spare = spare.saturating_sub(1);
            }
            *n += 1;
            homes.push((name, c.instance.slot));
        }
    }
    homes
}

/// Each adapter's home slot, sorted by adapter ([`deal_homes`]).
type Homes = Vec<(u64, u16)>;

/// The homes [`deal_homes`] dealt last, and over what (a fingerprint of the
/// candidates and their lists): a worker deals again only when they change.
#[derive(Debug, Default)]
pub struct DealtHomes {
    dealt: std::cell::RefCell<Option<(u64, Homes)>>,
}

impl Clone for DealtHomes {
    fn clone(&self) -> Self {
        Self::default()
    }
}

/// A cache: every one equals every other.
impl PartialEq for DealtHomes {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for DealtHomes {}

impl DealtHomes {
    /// `adapter`'s first instance among `candidates` ([`deal_homes`]), if
    /// it has one.
    pub fn home_of(&self, adapter: u64, candidates: &[Candidate]) -> Option<u16> {
        // Order-free: replicas and workers list candidates in any order.
        let over = candidates.iter().fold(candidates.len() as u64, |sum, c| {
            let listed = c.served.as_ref().map_or(0, |s| s.listed_hash());
            sum.wrapping_add((c.instance.addr_hash() ^ listed).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        });
        let look_up = |homes: &[(u64, u16)]| {
            homes
                .binary_search_by_key(&adapter, |&(name, _)| name)
                .ok()
                .and_then(|at| homes.get(at))
                .map(|&(_, slot)| slot)
        };
        let Ok(mut dealt) = self.dealt.try_borrow_mut() else {
            return look_up(&deal_homes(candidates));
        };
        match &*dealt {
            Some((fingerprint, homes)) if *fingerprint == over => look_up(homes),
            _ => {
                let homes = deal_homes(candidates);
                let home = look_up(&homes);
                *dealt = Some((over, homes));
                home
            }
        }
    }
}

/// Whether `holders` are more than half of `instances`.
fn most(holders: usize, instances: usize) -> bool {
    holders.saturating_mul(2) > instances
}

/// Whether `holders` of `instances` took more than their even share of
/// `total` recent decisions (`holders_recent`), plus half an instance's,
/// plus [`SHARE_SLACK`].
fn past_their_share(holders: usize, instances: usize, holders_recent: u32, total: u32) -> bool {
    let instances = instances.max(1) as u64;
    let share = u64::from(total) * holders as u64 / instances
        + u64::from(total) / instances / 2
        + u64::from(SHARE_SLACK);
    u64::from(holders_recent) > share
}

/// Decisions past its even share plus [`SHARE_SLACK`], for an instance with
/// `recent` of `total` recent decisions among `instances`.
pub fn past_share(recent: u32, total: u32, instances: usize) -> u32 {
    let instances = u32::try_from(instances.max(1)).unwrap_or(u32::MAX);
    let even = (total / instances).max(SHARE_MIN_DECISIONS);
    recent.saturating_sub(even.saturating_add(SHARE_SLACK))
}

/// The eligible candidates scored, the cheapest first, and the load bound.
#[derive(Debug, Clone)]
pub struct Ranking<'a> {
    pub order: Vec<Scored<'a>>,
    pub bound: u32,
    /// Whether some candidate is within the fleet-wide engine bounds (then
    /// `order` holds only those).
    pub some_within: bool,
}

/// Scores every eligible candidate and orders them, the cheapest first.
/// `held[i]` is what `candidates[i]` holds of the prompt; `recent`, where
/// this worker's last decisions went; `bound` is the fleet's load bound
/// ([`fleet_load_bound`]).
pub fn score<'a>(
    candidates: &'a [Candidate],
    held: &[Held],
    prompt: &Prompt,
    recent: &RecentChoices,
    bound: u32,
) -> Ranking<'a> {
    // Over a fleet-wide engine bound: out while another is within them.
    let some_within = candidates.iter().any(|c| !c.over_bounds);
    let eligible = |c: &Candidate| !c.over_bounds || !some_within;
    let recent_of = |c: &Candidate| recent.count(c.instance.slot);
    let total_recent: u32 = candidates.iter().map(recent_of).sum();
    let mut scored: Vec<Scored<'a>> = candidates
        .iter()
        .zip(held)
        .filter(|(c, _)| eligible(c))
        .map(|(c, &held)| {
            let share = if prompt.extends_placed {
                past_share(recent_of(c), total_recent, candidates.len())
            } else {
                0
            };
            let cost = Cost {
                load: u64::from(c.load.saturating_sub(bound)).saturating_mul(REQUEST_BYTES),
                prefill: u64::try_from(prompt.bytes.saturating_sub(held.bytes)).unwrap_or(u64::MAX),
                share: u64::from(share).saturating_mul(DECISION_BYTES),
            };
            Scored {
                candidate: c,
                held,
                cost,
                rank: rank(prompt.opening, &c.instance.address),
            }
        })
        .collect();
    // Where `share` counts, of equals the one this worker chose least: a
    // request that moves evens the shares. Elsewhere the rank alone, as
    // every replica ranks.
    scored.sort_by_cached_key(|s| {
        let recent = if prompt.extends_placed {
            recent_of(s.candidate)
        } else {
            0
        };
        (s.cost.total(), recent, std::cmp::Reverse(s.rank))
    });
    // BALANCED: of two tied best, the one this worker placed fewer bytes on.
    if prompt.balances {
        if let [first, second, ..] = scored.as_mut_slice() {
            let placed = |s: &Scored<'_>| recent.placed_bytes(s.candidate.instance.slot);
            if first.cost == second.cost && placed(first) > placed(second) {
                std::mem::swap(first, second);
            }
        }
    }
    Ranking {
        order: scored,
        bound,
        some_within,
    }
}

/// The in-flight count below which `chosen` stays no costlier than
/// `runner_up` (its load term grows a request at a time past the bound).
fn claim_bound(chosen: &Scored<'_>, runner_up: Option<&Scored<'_>>, bound: u32) -> Option<u32> {
    let runner_up = runner_up?;
    let lead = runner_up
        .cost
        .total()
        .saturating_sub(chosen.cost.prefill.saturating_add(chosen.cost.share));
    let requests = u32::try_from(lead / REQUEST_BYTES).unwrap_or(u32::MAX);
    Some(bound.saturating_add(requests).saturating_add(1))
}

impl LongestPrefix {
    pub fn new(
        concurrency_threshold: u32,
        load_margin: u32,
        cold_placement: ColdPlacement,
        adapters: Option<AdapterSets>,
    ) -> Self {
        Self {
            concurrency_threshold: concurrency_threshold.max(1),
            load_margin,
            cold_placement,
            adapters,
            homes: DealtHomes::default(),
        }
    }

    /// Maglev on `key`, counted where it lands by the upstream filter; the
    /// index learns the instance from the response.
    fn by_maglev(kind: DecisionKind, key: String) -> Routed {
        Routed::untracked(RouteHeaders {
            key: Some(key),
            matched_bytes: Some(0),
            ..RouteHeaders::bare(kind)
        })
    }

    /// Decides for a prompt cut into `blocks`, for `adapter` (its name
    /// hashed) if it names one: reads the candidates and what each holds,
    /// scores them ([`score`]), claims once, records once. An adapter's set
    /// is tried first, the rest of the fleet only when the set is full.
    /// `random` salts the opening when an unlisted fleet's known instances
    /// are all full.
    pub fn decide(
        &self,
        blocks: &PromptBlocks,
        adapter: Option<u64>,
        load: &mut dyn LoadView,
        recent: &mut RecentChoices,
        random: u64,
        now_ms: u64,
    ) -> Routed {
        let opening_key = blocks.opening_key();
        let all = load.candidates(now_ms);
        if all.is_empty() {
            return Self::by_maglev(DecisionKind::Cold, opening_key);
        }
        for c in &all {
            recent.seat(c.instance.slot, c.instance.addr_hash());
        }
        let bound = fleet_load_bound(&all, self.load_margin);
        // An adapter's set, then the rest of the fleet; else the fleet.
        let (tiers, set) = match (adapter, self.adapters) {
            (Some(adapter), Some(sets)) => {
                let home = self.homes.home_of(adapter, &all);
                let (mut in_set, mut rest) = adapter_set(adapter, &all, bound, sets, home);
                let min = usize::try_from(sets.min_instances).unwrap_or(usize::MAX);
                let grown: Vec<u16> = in_set.iter().skip(min).map(|c| c.instance.slot).collect();
                // An instance that holds a prefix of the prompt (salted by
                // the adapter) served the adapter, and one whose engine runs
                // it has it in a slot: they serve it too.
                let found = load.longest_held(&blocks.chain, &rest, now_ms);
                let (serving, others) = rest.into_iter().partition(|c: &Candidate| {
                    c.runs(adapter)
                        || (found.blocks > 0 && found.holders.contains(&c.instance.slot))
                });
                in_set.extend::<Vec<Candidate>>(serving);
                rest = others;
                let size = in_set.len();
                (Some([in_set, rest]), Some((size, grown)))
            }
            _ => (None, None),
        };
        let groups: Vec<&[Candidate]> = match &tiers {
            Some(tiers) => tiers.iter().map(Vec::as_slice).collect(),
            None => vec![all.as_slice()],
        };
        // A known fleet (configured, or read from Envoy's admin) has every
        // prompt placed here, under the cap; an adapter's request stays on
        // its set. Else Maglev places what sets no instance apart.
        let listed = set.is_some() || all.iter().any(|c| c.listed);
        let mut chosen = None;
        let mut some_within = false;
        // The tiers whose every candidate refused its claim.
        let mut full: Vec<(usize, Ranking<'_>)> = Vec::new();
        for (tier, candidates) in groups.iter().enumerate() {
            if candidates.is_empty() {
                continue;
            }
            let Some(read) = self.read(blocks, candidates, listed, load, recent, now_ms) else {
                return Self::by_maglev(DecisionKind::Cold, opening_key);
            };
            let ranking = score(candidates, &read.held, &read.prompt, recent, bound);
            some_within |= ranking.some_within;
            let Some((scored, ticket)) = self.claim(&ranking, load, now_ms) else {
                full.push((tier, ranking));
                continue;
            };
            let kind = if read.set_apart == 0 {
                DecisionKind::Cold
            } else if scored.held.longest {
                DecisionKind::Matched
            } else {
                DecisionKind::Moved
            };
            let runner_up = ranking
                .order
                .iter()
                .find(|s| s.candidate.instance.slot != scored.candidate.instance.slot)
                .map(|s| (s.candidate.instance.address.clone(), s.cost));
            let explained = Explained {
                cost: scored.cost,
                runner_up,
            };
            let known = if read.holders.contains(&scored.candidate.instance.slot) {
                read.longest
            } else {
                load.longest_held(
                    &blocks.chain,
                    std::slice::from_ref(scored.candidate),
                    now_ms,
                )
                .blocks
            };
            let kind = if tier > 0 {
                DecisionKind::Overflow
            } else {
                kind
            };
            chosen = Some((
                scored.candidate.clone(),
                kind,
                ticket,
                Some(explained),
                known,
            ));
            break;
        }
        let (candidate, kind, ticket, explained, known) = match chosen {
            Some(chosen) => chosen,
            // Instances not learned yet may have room: Maglev on a salted
            // opening explores them (salts 1..=8, as FIXED_PREFIX's).
            None if !listed && some_within => {
                let salt = u8::try_from(random % 8).unwrap_or_default() + 1;
                return Self::by_maglev(DecisionKind::Overflow, salted_key(&opening_key, salt));
            }
            // Every instance full: the least loaded (of the set first; of
            // equals, the cheapest), counted past the cap.
            None => {
                let Some(least_loaded) = full
                    .iter()
                    .flat_map(|(tier, r)| r.order.iter().map(move |s| (*tier, s.candidate)))
                    .min_by_key(|(tier, c)| (c.over_bounds, *tier, c.load))
                    .map(|(_, c)| c.clone())
                else {
                    return Routed::untracked(RouteHeaders::bare(DecisionKind::Cold));
                };
                let ticket = match load.claim(&least_loaded.instance, None, None, now_ms) {
                    Claim::Claimed(ticket) => Some(ticket),
                    _ => None,
                };
                let known = load
                    .longest_held(&blocks.chain, std::slice::from_ref(&least_loaded), now_ms)
                    .blocks;
                (least_loaded, DecisionKind::Overflow, ticket, None, known)
            }
        };
        let adapter = set.map(|(size, grown)| {
            let in_set = groups
                .first()
                .is_some_and(|g| g.iter().any(|c| c.instance.slot == candidate.instance.slot));
            let placement = if !in_set {
                AdapterPlacement::OutsideSet
            } else if grown.contains(&candidate.instance.slot) {
                AdapterPlacement::SetGrown
            } else {
                AdapterPlacement::InSet
            };
            AdapterDecision {
                placement,
                set_size: u32::try_from(size).unwrap_or(u32::MAX),
            }
        });
        // Recorded: what the chosen instance held (a shorter prefix if it
        // was not a holder) and that it now holds the prompt.
        let matched_bytes = blocks.bytes_of(known);
        let placed_bytes = u64::try_from(blocks.placed_bytes(matched_bytes)).unwrap_or(u64::MAX);
        recent.note(candidate.instance.slot, placed_bytes);
        let held_since_s =
            load.remember_held(&blocks.chain, known, &candidate.instance, &all, now_ms);
        let address = candidate.instance.address.to_string();
        Routed {
            headers: RouteHeaders {
                key: Some(opening_key),
                host_override: Some(address.clone()),
                counted: ticket.as_ref().map(|_| address),
                matched_bytes: Some(u64::try_from(matched_bytes).unwrap_or(u64::MAX)),
                prompt_bytes: Some(u64::try_from(blocks.prefix_bytes).unwrap_or(u64::MAX)),
                held_since_s,
                explained,
                adapter,
                ..RouteHeaders::bare(kind)
            },
            ticket,
            placed_bytes,
        }
    }

    /// What the cost needs of the prompt and of each candidate: what it
    /// holds, from the prefix index. None: Maglev places the prompt (no
    /// instance known, or an unlisted fleet and nothing sets one apart).
    fn read(
        &self,
        blocks: &PromptBlocks,
        candidates: &[Candidate],
        listed: bool,
        load: &mut dyn LoadView,
        recent: &RecentChoices,
        now_ms: u64,
    ) -> Option<Read> {
        let found = load.longest_held(&blocks.chain, candidates, now_ms);
        let longest_bytes = blocks.bytes_of(found.blocks);
        let holds_longest = |c: &Candidate| found.holders.contains(&c.instance.slot);
        let recent_of = |c: &Candidate| recent.count(c.instance.slot);
        let total_recent: u32 = candidates.iter().map(recent_of).sum();
        let holders_recent: u32 = candidates
            .iter()
            .filter(|c| holds_longest(c))
            .map(recent_of)
            .sum();
        // System messages, and nothing of the request's own, that save less
        // prefill than a request weighs, that most of the fleet holds, or
        // that their holders took past their share for (a prompt that is
        // all system messages, held whole, is one sent again).
        let system_only = found.blocks > 0
            && found.blocks < blocks.chain.len()
            && longest_bytes <= blocks.cuts[0];
        let common = system_only
            && (longest_bytes < usize::try_from(REQUEST_BYTES).unwrap_or(usize::MAX)
                || most(found.holders.len(), candidates.len())
                || past_their_share(
                    found.holders.len(),
                    candidates.len(),
                    holders_recent,
                    total_recent,
                ));
        let set_apart = if common { 0 } else { found.blocks };
        // Maglev knows nothing of engine bounds: while one is over, an
        // unlisted fleet's cold prompt is placed among the known instances.
        let some_over_bounds = candidates.iter().any(|c| c.over_bounds);
        if candidates.is_empty() || (set_apart == 0 && !listed && !some_over_bounds) {
            return None;
        }
        let prompt = Prompt {
            bytes: blocks.prefix_bytes,
            opening: blocks.opening,
            extends_placed: set_apart > 0 && blocks.extends_held(set_apart),
            balances: self.cold_placement == ColdPlacement::Balanced
                && blocks.history_bytes == 0
                && blocks.prefix_bytes >= BALANCED_MIN_BYTES,
        };
        // Whether most of the fleet holds the system messages before the
        // conversation's own text (then they set no instance apart either):
        // read only when `share` may move the request off a holder.
        let system_bytes = blocks.cuts[0].min(longest_bytes);
        let system_common = prompt.extends_placed
            && system_bytes > 0
            && system_bytes < longest_bytes
            && candidates.iter().any(|c| {
                holds_longest(c) && past_share(recent_of(c), total_recent, candidates.len()) > 0
            })
            && {
                let system = blocks.chain.get(..blocks.padding.0).unwrap_or_default();
                let of_system = load.longest_held(system, candidates, now_ms);
                of_system.blocks == system.len() && most(of_system.holders.len(), candidates.len())
            };
        // The opening's first choice holds the history unless this index
        // holds the previous turn elsewhere: turns it did not see went where
        // other replicas presume it too.
        let first_choice = candidates
            .iter()
            .max_by_key(|c| rank(blocks.opening, &c.instance.address))
            .map(|c| c.instance.slot);
        let own_text_held =
            longest_bytes > blocks.cuts[0] && !common && blocks.previous_turn_held(longest_bytes);
        let held = candidates
            .iter()
            .map(|c| {
                let longest = common || holds_longest(c);
                let mut bytes = if longest { longest_bytes } else { 0 };
                if system_common {
                    bytes = bytes.max(system_bytes);
                }
                if first_choice == Some(c.instance.slot) && (!own_text_held || longest) {
                    bytes = bytes.max(blocks.history_bytes);
                }
                Held { bytes, longest }
            })
            .collect();
        Some(Read {
            prompt,
            held,
            set_apart,
            longest: found.blocks,
            holders: found.holders,
        })
    }

    /// Claims the first instance of `order` that has room: under the cap
    /// and the load at which it would stop being the cheapest. None: every
    /// instance full (or over a fleet-wide engine bound).
    fn claim<'a>(
        &self,
        ranking: &Ranking<'a>,
        load: &mut dyn LoadView,
        now_ms: u64,
    ) -> Option<(Scored<'a>, Option<Ticket>)> {
        if !ranking.some_within {
            return None;
        }
        let order = &ranking.order;
        for (at, scored) in order.iter().enumerate() {
            let cap = claim_bound(scored, order.get(at + 1), ranking.bound)
                .map_or(self.concurrency_threshold, |b| {
                    self.concurrency_threshold
                        .min(scored.candidate.local_cap(b))
                })
                .max(1);
            match load.claim(&scored.candidate.instance, None, Some(cap), now_ms) {
                Claim::Claimed(ticket) => return Some((*scored, Some(ticket))),
                // Left to the upstream filter to count.
                Claim::Contended => return Some((*scored, None)),
                Claim::Full { .. } | Claim::Gone => {}
            }
        }
        None
    }
}

/// What [`LongestPrefix::decide`] read before scoring.
struct Read {
    prompt: Prompt,
    /// What each candidate holds, in the candidates' order.
    held: Vec<Held>,
    /// Blocks of the longest held prefix that set its holders apart (0:
    /// none held, or one that sets no instance apart).
    set_apart: usize,
    /// Blocks of the longest held prefix, and its holders.
    longest: usize,
    holders: Vec<u16>,
}

#[cfg(test)]
mod tests;
