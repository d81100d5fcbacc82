//! The key census: how many live keys each instance owns, for key balancing.
//! One shared record, updated by compare-and-swap, so every worker VM places
//! keys against the same counts (views built per VM lag each other by seconds
//! and over-fill the same instances).
//!
//! Keys are counted per generation of [`GENERATION_MS`]: each key is counted
//! once in each generation it is used in, on the instance it routes to. An
//! instance owns the larger of its current and previous generation's counts,
//! so keys that stop being used fade out within two generations without
//! anyone having to notice they stopped.

use std::collections::BTreeMap;

use super::codec::{Reader, Writer};
use super::table::Record;

const CENSUS_VERSION: u8 = 1;

/// Length of one census generation.
pub(crate) const GENERATION_MS: u64 = 60_000;

/// Most instance slots a census records (the registry holds at most 4096).
const MAX_SLOTS: usize = 4096;

/// The census generation of `now_ms`, from 1 (0 means "never counted").
pub(crate) fn generation(now_ms: u64) -> u32 {
    u32::try_from(now_ms / GENERATION_MS + 1).unwrap_or(u32::MAX)
}

fn add_to(counts: &mut BTreeMap<u16, u32>, slot: u16) {
    if counts.len() < MAX_SLOTS || counts.contains_key(&slot) {
        let count = counts.entry(slot).or_insert(0);
        *count = count.saturating_add(1);
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Census {
    pub(crate) generation: u32,
    current: BTreeMap<u16, u32>,
    previous: BTreeMap<u16, u32>,
}

impl Census {
    /// This census as of `generation`: the counts move back one generation
    /// per generation passed (two or more passed: nothing is current).
    pub(crate) fn rolled(mut self, generation: u32) -> Self {
        if generation > self.generation {
            self.previous = if generation == self.generation + 1 {
                std::mem::take(&mut self.current)
            } else {
                BTreeMap::new()
            };
            self.current.clear();
            self.generation = generation;
        }
        self
    }

    /// Live keys `slot` owns.
    pub(crate) fn owned(&self, slot: u16) -> u32 {
        let current = self.current.get(&slot).copied().unwrap_or(0);
        let previous = self.previous.get(&slot).copied().unwrap_or(0);
        current.max(previous)
    }

    /// Counts a key again on `slot` in the current generation (a key in use
    /// since the previous one, where it was counted already).
    pub(crate) fn recount(&mut self, slot: u16) {
        add_to(&mut self.current, slot);
    }

    /// Counts a key new to the census on `slot`, in both generations: it was
    /// in none of the previous generation's counts, which still stand for the
    /// keys not yet counted again in this one (counting it in the current
    /// generation alone would leave `owned` unchanged right after a roll, and
    /// let an instance take a previous generation's worth of new keys).
    pub(crate) fn add_new(&mut self, slot: u16) {
        add_to(&mut self.current, slot);
        add_to(&mut self.previous, slot);
    }

    /// Takes back an [`Census::add_new`] (a placement that lost its race).
    pub(crate) fn remove_new(&mut self, slot: u16) {
        for counts in [&mut self.current, &mut self.previous] {
            if let Some(count) = counts.get_mut(&slot) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    counts.remove(&slot);
                }
            }
        }
    }
}

impl Record for Census {
    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(13 + 6 * (self.current.len() + self.previous.len()));
        w.u8(CENSUS_VERSION).u32(self.generation);
        for counts in [&self.current, &self.previous] {
            // At most MAX_SLOTS entries.
            w.u32(counts.len() as u32);
            for (slot, count) in counts {
                w.u16(*slot).u32(*count);
            }
        }
        w.finish()
    }

    fn decode(buf: &[u8]) -> Option<Self> {
        let mut r = Reader::new(buf);
        if r.u8()? != CENSUS_VERSION {
            return None;
        }
        let generation = r.u32()?;
        let mut counts = [BTreeMap::new(), BTreeMap::new()];
        for map in &mut counts {
            let len = usize::try_from(r.u32()?).ok()?;
            if len > MAX_SLOTS {
                return None;
            }
            for _ in 0..len {
                map.insert(r.u16()?, r.u32()?);
            }
        }
        let [current, previous] = counts;
        r.is_empty().then_some(Self {
            generation,
            current,
            previous,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_start_at_one_and_advance_every_generation_ms() {
        assert_eq!(generation(0), 1);
        assert_eq!(generation(GENERATION_MS - 1), 1);
        assert_eq!(generation(GENERATION_MS), 2);
    }

    #[test]
    fn a_key_counted_in_either_of_the_last_two_generations_is_owned() {
        let mut census = Census::default().rolled(1);
        census.add_new(3);
        census.add_new(3);
        census.add_new(4);
        assert_eq!(
            (census.owned(3), census.owned(4), census.owned(5)),
            (2, 1, 0)
        );
        let mut next = census.clone().rolled(2);
        assert_eq!((next.owned(3), next.owned(4)), (2, 1), "previous counts");
        next.recount(4);
        assert_eq!(next.owned(4), 1, "counted again: still one key");
        next.add_new(4);
        assert_eq!(next.owned(4), 2, "and a new one");
        let later = next.clone().rolled(3);
        assert_eq!(
            (later.owned(3), later.owned(4)),
            (0, 2),
            "slot 3 unused in 2"
        );
        assert_eq!(next.clone().rolled(4), Census::default().rolled(4));
        assert_eq!(
            next.clone().rolled(1),
            next,
            "an older generation changes nothing"
        );
    }

    #[test]
    fn new_keys_right_after_a_roll_still_count() {
        let mut census = Census::default().rolled(1);
        for _ in 0..9 {
            census.add_new(3);
        }
        let mut next = census.rolled(2);
        for _ in 0..3 {
            next.add_new(3);
        }
        assert_eq!(next.owned(3), 12, "9 not yet counted again, 3 new");
    }

    #[test]
    fn remove_new_takes_back_an_add_new() {
        let mut census = Census::default().rolled(7);
        census.add_new(1);
        census.remove_new(1);
        census.remove_new(2);
        assert_eq!(census, Census::default().rolled(7));
    }

    #[test]
    fn round_trip_and_garbage() {
        let mut census = Census::default().rolled(5);
        census.add_new(1);
        census = census.rolled(6);
        census.recount(2);
        census.add_new(2);
        let bytes = census.encode();
        assert_eq!(Census::decode(&bytes), Some(census));
        for cut in 0..bytes.len() {
            assert_eq!(Census::decode(bytes.get(..cut).unwrap()), None);
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert_eq!(Census::decode(&trailing), None);
        let mut other_version = bytes;
        other_version[0] = 9;
        assert_eq!(Census::decode(&other_version), None);
    }
}
