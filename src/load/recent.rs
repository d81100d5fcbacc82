//! Where this worker VM sent its last [`RECENT_WINDOW`] decisions, per
//! instance slot: the request shares that keep a prompt matched only in its
//! system messages from piling onto the instances that hold them. And the
//! prompt bytes it placed on each instance, which `cold_placement: BALANCED`
//! evens out.
//!
//! A system prompt that every conversation shares is held first by the
//! instance of the first conversation; were it to attract every later one,
//! that instance would serve them all (what SGLang's router does at light
//! load). A group's own system prompt, among many, should attract its
//! requests (it is the group's cache). Only popularity tells the two apart,
//! so the holders of a system-only match take the request while their
//! share of recent decisions, together, is within
//! [`RecentChoices::share_bound`]; past it the request is placed as a cold
//! one, by its opening over every instance. A prompt all conversations
//! share soon has every instance as a holder and they spread by their
//! openings, while a group's prompt stays on its holder.
//! Kept per VM, with no host call: each worker sees a like sample of the
//! traffic.
//!
//! Placed bytes: what each decision added to what the index says its
//! instance holds (the prompt's bytes past the prefix it already held
//! there). What fills an instance's KV cache is bytes, not requests: a
//! 12,000-character document weighs as much as twenty short questions, and
//! documents of 500 to 12,000 characters placed evenly by count still fill
//! some caches twice as much as others. The counts are halved whenever
//! their total passes [`PLACED_HORIZON_BYTES`], so they follow what the
//! instances hold lately, and an instance that joins late (placed nothing)
//! draws its second choices only until it has caught up with what the
//! others kept of the last horizon.

/// Decisions the shares are taken over.
pub const RECENT_WINDOW: usize = 256;

/// Placed bytes are halved whenever their total passes this: 16 MiB of
/// prompt text, more than the KV caches of a fleet of a few dozen instances
/// hold (a Llama 3.1 70B instance keeps some 100,000 to 1,000,000 tokens,
/// about 0.4 to 4 MB of text), so the counts forget only what the caches
/// have long evicted.
pub const PLACED_HORIZON_BYTES: u64 = 16 << 20;

/// See the module documentation.
#[derive(Debug, Clone, Default)]
pub struct RecentChoices {
    /// The last decisions' slots, oldest first once full (a ring).
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

    /// The most of `total` recent decisions that `holders` of `instances`
    /// may have had together and still take a system-only match: their even
    /// share plus half of one instance's, plus two (so the first decisions,
    /// whose shares are all uneven, spread a shared system prompt at once).
    /// One holder may take half again its share; six of seven holders that
    /// take every decision are past it, and the seventh instance gets its
    /// share.
    pub fn share_bound(total: u32, holders: usize, instances: usize) -> u32 {
        let instances = instances.max(1) as u64;
        let even = u64::from(total) * holders as u64 / instances;
        let half_of_one = u64::from(total) / instances / 2;
        u32::try_from(even + half_of_one + 2).unwrap_or(u32::MAX)
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
    fn the_share_bound_is_half_an_instance_above_even_plus_two() {
        assert_eq!(RecentChoices::share_bound(0, 1, 7), 2);
        assert_eq!(RecentChoices::share_bound(7, 1, 7), 3);
        assert_eq!(RecentChoices::share_bound(256, 1, 7), 36 + 18 + 2);
        // Six holders of seven with every decision: past it.
        assert_eq!(RecentChoices::share_bound(256, 6, 7), 219 + 18 + 2);
        assert_eq!(RecentChoices::share_bound(256, 7, 7), 256 + 18 + 2);
        assert_eq!(RecentChoices::share_bound(10, 1, 0), 17);
    }
}
