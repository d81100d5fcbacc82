//! Where this worker VM sent its last [`RECENT_WINDOW`] decisions, per
//! instance slot (the decision's `share` term), and the prompt bytes it
//! placed on each instance (what `cold_placement: BALANCED` evens out).
//! Kept per VM, with no host call: each worker sees a like sample of the
//! traffic.
//!
//! Placed bytes: what each decision added to what the index says its
//! instance holds (the prompt's bytes past the prefix it already held
//! there). What fills an instance's KV cache is bytes, not requests: a long
//! document weighs as much as many short questions. The counts are halved
//! whenever their total passes [`PLACED_HORIZON_BYTES`], so they follow
//! what the instances hold lately, and an instance that joins late (placed
//! nothing) draws its second choices only until it has caught up with what
//! the others kept of the last horizon.
//!
//! Both are kept per slot for the instance seated there: an instance that
//! takes a departed one's slot starts from nothing, as the prefix index's
//! address tags make it start from nothing there.

/// Decisions the shares are taken over.
pub const RECENT_WINDOW: usize = 256;

/// Placed bytes are halved whenever their total passes this: 16 MiB of
/// prompt text, more than the KV caches of a fleet of a few dozen instances
/// hold (a Llama 3.1 70B instance keeps some 100,000 to 1,000,000 tokens,
/// about 0.4 to 4 MB of text), so the counts forget only what the caches
/// have long evicted.
pub const PLACED_HORIZON_BYTES: u64 = 16 << 20;

/// A ring entry whose decision belonged to an instance no longer seated.
const UNSEATED: u16 = u16::MAX;

/// See the module documentation.
#[derive(Debug, Clone, Default)]
pub struct RecentChoices {
    /// The instance seated in each slot (its address hash), once seen.
    owners: Vec<Option<u64>>,
    /// The last decisions' slots, oldest first once full (a ring;
    /// [`UNSEATED`] for a decision whose instance left its slot).
    ring: Vec<u16>,
    /// Next position to overwrite once the ring is full.
    next: usize,
    /// Decisions per slot within the ring.
    counts: Vec<u32>,
    /// Bytes placed per slot, halved past the horizon.
    placed: Vec<u64>,
    /// Their sum.
    placed_total: u64,
}

impl RecentChoices {
    /// The instance in `slot` is `owner` (its address hash): if another
    /// one sat there, its decisions and placed bytes are forgotten.
    pub fn seat(&mut self, slot: u16, owner: u64) {
        let index = usize::from(slot);
        if self.owners.len() <= index {
            self.owners.resize(index + 1, None);
        }
        let Some(seated) = self.owners.get_mut(index) else {
            return;
        };
        match seated.replace(owner) {
            Some(previous) if previous != owner => {}
            _ => return,
        }
        for entry in self.ring.iter_mut().filter(|entry| **entry == slot) {
            *entry = UNSEATED;
        }
        if let Some(count) = self.counts.get_mut(index) {
            *count = 0;
        }
        if let Some(placed) = self.placed.get_mut(index) {
            self.placed_total = self.placed_total.saturating_sub(*placed);
            *placed = 0;
        }
    }

    /// Counts one decision for `slot` that placed `placed_bytes` there,
    /// forgetting the oldest decision past the window.
    pub fn note(&mut self, slot: u16, placed_bytes: u64) {
        self.note_placed(slot, placed_bytes);
        if self.ring.len() < RECENT_WINDOW {
            self.ring.push(slot);
        } else if let Some(oldest) = self.ring.get_mut(self.next) {
            let old = std::mem::replace(oldest, slot);
            if let Some(count) = self.counts.get_mut(usize::from(old)) {
                *count = count.saturating_sub(1);
            }
            self.next = (self.next + 1) % RECENT_WINDOW;
        }
        let index = usize::from(slot);
        if self.counts.len() <= index {
            self.counts.resize(index + 1, 0);
        }
        if let Some(count) = self.counts.get_mut(index) {
            *count = count.saturating_add(1);
        }
    }

    fn note_placed(&mut self, slot: u16, bytes: u64) {
        let index = usize::from(slot);
        if self.placed.len() <= index {
            self.placed.resize(index + 1, 0);
        }
        if let Some(placed) = self.placed.get_mut(index) {
            *placed = placed.saturating_add(bytes);
        }
        self.placed_total = self.placed_total.saturating_add(bytes);
        if self.placed_total > PLACED_HORIZON_BYTES {
            for placed in &mut self.placed {
                *placed /= 2;
            }
            self.placed_total = self.placed.iter().sum();
        }
    }

    /// Decisions for `slot` within the window.
    pub fn count(&self, slot: u16) -> u32 {
        self.counts.get(usize::from(slot)).copied().unwrap_or(0)
    }

    /// Bytes placed on `slot` (halved once per horizon passed).
    pub fn placed_bytes(&self, slot: u16) -> u64 {
        self.placed.get(usize::from(slot)).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_last_window_of_decisions() {
        let mut recent = RecentChoices::default();
        assert_eq!(recent.count(3), 0);
        for _ in 0..RECENT_WINDOW {
            recent.note(3, 0);
        }
        assert_eq!(recent.count(3), RECENT_WINDOW as u32);
        for _ in 0..10 {
            recent.note(1, 0);
        }
        assert_eq!(recent.count(1), 10);
        assert_eq!(recent.count(3), RECENT_WINDOW as u32 - 10);
        for _ in 0..RECENT_WINDOW {
            recent.note(2, 0);
        }
        assert_eq!((recent.count(1), recent.count(3)), (0, 0));
        assert_eq!(recent.count(2), RECENT_WINDOW as u32);
    }

    #[test]
    fn placed_bytes_add_up_per_slot_and_halve_past_the_horizon() {
        let mut recent = RecentChoices::default();
        assert_eq!(recent.placed_bytes(4), 0);
        recent.note(4, 3_000);
        recent.note(4, 500);
        recent.note(1, 0);
        recent.note(1, 7);
        assert_eq!((recent.placed_bytes(4), recent.placed_bytes(1)), (3_500, 7));
        // The decision window does not forget bytes: 256 more decisions
        // elsewhere leave them.
        for _ in 0..RECENT_WINDOW {
            recent.note(2, 1);
        }
        assert_eq!(recent.count(4), 0);
        assert_eq!(recent.placed_bytes(4), 3_500);
        // Passing the horizon halves every slot, the one that passed it too.
        let to_horizon = PLACED_HORIZON_BYTES - (3_500 + 7 + RECENT_WINDOW as u64);
        recent.note(6, to_horizon);
        assert_eq!(recent.placed_bytes(6), to_horizon);
        recent.note(6, 2);
        assert_eq!(
            (
                recent.placed_bytes(4),
                recent.placed_bytes(1),
                recent.placed_bytes(2),
                recent.placed_bytes(6)
            ),
            (1_750, 3, 128, (to_horizon + 2) / 2)
        );
        // Halved again only once the total passes the horizon again.
        recent.note(6, PLACED_HORIZON_BYTES / 2 - 1_000);
        assert_eq!(recent.placed_bytes(4), 1_750);
        recent.note(6, 2_000);
        assert_eq!(recent.placed_bytes(4), 875);
    }

    #[test]
    fn an_instance_seated_in_a_departed_ones_slot_starts_from_nothing() {
        let mut recent = RecentChoices::default();
        recent.seat(3, 0xaaaa);
        recent.seat(5, 0xbbbb);
        for _ in 0..100 {
            recent.note(3, 1_000);
        }
        recent.note(5, 10);
        // Seating the same instance again changes nothing.
        recent.seat(3, 0xaaaa);
        assert_eq!((recent.count(3), recent.placed_bytes(3)), (100, 100_000));
        // Another instance in slot 3: nothing of the first one's.
        recent.seat(3, 0xcccc);
        assert_eq!((recent.count(3), recent.placed_bytes(3)), (0, 0));
        assert_eq!((recent.count(5), recent.placed_bytes(5)), (1, 10));
        recent.note(3, 7);
        assert_eq!((recent.count(3), recent.placed_bytes(3)), (1, 7));
        // The first one's decisions leaving the window take nothing from
        // the new one's count; the horizon counts only what is kept.
        for _ in 0..RECENT_WINDOW - 2 {
            recent.note(5, 0);
        }
        assert_eq!(recent.count(3), 1);
        assert_eq!(recent.count(5), RECENT_WINDOW as u32 - 1);
        recent.note(5, PLACED_HORIZON_BYTES - 17);
        assert_eq!(recent.placed_bytes(3), 7);
        recent.note(5, 1);
        assert_eq!(recent.placed_bytes(3), 3);
    }
}
