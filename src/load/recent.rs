//! Where this worker VM sent its last [`RECENT_WINDOW`] decisions, per
//! instance slot: the request shares that keep a prompt matched only in its
//! system messages from piling onto the instances that hold them.
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

/// Decisions the shares are taken over.
pub const RECENT_WINDOW: usize = 256;

/// See the module documentation.
#[derive(Debug, Clone, Default)]
pub struct RecentChoices {
    /// The last decisions' slots, oldest first once full (a ring).
    ring: Vec<u16>,
    /// Next position to overwrite once the ring is full.
    next: usize,
    /// Decisions per slot within the ring.
    counts: Vec<u32>,
}

impl RecentChoices {
    /// Counts one decision for `slot`, forgetting the oldest past the window.
    pub fn note(&mut self, slot: u16) {
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

    /// Decisions for `slot` within the window.
    pub fn count(&self, slot: u16) -> u32 {
        self.counts.get(usize::from(slot)).copied().unwrap_or(0)
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

    /// The most of `total` recent decisions one of `instances` may have had
    /// and still be the first choice of a cold prompt: its even share plus
    /// two (within the ordinary spread of a few decisions, the rendezvous
    /// order stands).
    pub fn even_bound(total: u32, instances: usize) -> u32 {
        let instances = u32::try_from(instances.max(1)).unwrap_or(u32::MAX);
        (total / instances).saturating_add(2)
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
            recent.note(3);
        }
        assert_eq!(recent.count(3), RECENT_WINDOW as u32);
        for _ in 0..10 {
            recent.note(1);
        }
        assert_eq!(recent.count(1), 10);
        assert_eq!(recent.count(3), RECENT_WINDOW as u32 - 10);
        for _ in 0..RECENT_WINDOW {
            recent.note(2);
        }
        assert_eq!((recent.count(1), recent.count(3)), (0, 0));
        assert_eq!(recent.count(2), RECENT_WINDOW as u32);
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
