//! Where this worker VM sent its last [`RECENT_WINDOW`] decisions, per
//! instance slot: the request shares that keep a prompt matched only in its
//! system messages from piling onto the instances that hold them, and that
//! move a conversation or document off a holder past its share while little
//! of it is held there ([`RecentChoices::holder_share_bound`]). And the
//! prompt bytes it placed on each instance, which `cold_placement:
//! BALANCED` evens out.
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

/// Decisions above its even share a holder may have had before a request
/// moves off it, besides what it holds ([`RecentChoices::holder_share_bound`]).
pub const SHARE_SLACK: u32 = 2;

/// Bytes of a conversation's or document's own text a holder must hold for
/// each decision above [`SHARE_SLACK`] it may have had before the request
/// moves off it.
pub const OWN_BYTES_PER_DECISION: usize = 256;

/// Decisions per instance the window must hold before shares move a
/// request: 56 of 256 over 7 instances; a fleet of more than 32 instances
/// never fills it that far, and its requests move for load only.
pub const SHARE_DECISIONS_PER_INSTANCE: u32 = 8;

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

    /// The most of `total` recent decisions that a holder of a
    /// conversation's or document's own text (a match that attracts) may
    /// have had among `instances` and still take the request: its even
    /// share plus [`SHARE_SLACK`], plus one per [`OWN_BYTES_PER_DECISION`]
    /// of `own_bytes`, what moving the request costs in prefill: the own
    /// text it holds, and the system messages before it unless they are the
    /// fleet's (the caller's to say). `None` while the window holds fewer
    /// than [`SHARE_DECISIONS_PER_INSTANCE`] decisions per instance: too few
    /// for shares to say anything (one conversation alone through a fresh
    /// Envoy stays where it is).
    pub fn holder_share_bound(total: u32, instances: usize, own_bytes: usize) -> Option<u32> {
        let instances = u32::try_from(instances.max(1)).unwrap_or(u32::MAX);
        if total < instances.saturating_mul(SHARE_DECISIONS_PER_INSTANCE) {
            return None;
        }
        let cost = u32::try_from(own_bytes / OWN_BYTES_PER_DECISION).unwrap_or(u32::MAX);
        Some(
            (total / instances)
                .saturating_add(SHARE_SLACK)
                .saturating_add(cost),
        )
    }

    /// Whether an instance with `recent` of `total` decisions among
    /// `instances` is within its even share: where a request moved off a
    /// holder past [`RecentChoices::holder_share_bound`] goes first.
    pub fn within_even_share(recent: u32, total: u32, instances: usize) -> bool {
        u64::from(recent) * instances as u64 <= u64::from(total)
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

    #[test]
    fn a_holders_share_bound_is_even_plus_the_slack_plus_what_it_holds() {
        // 7 instances: none below 56 decisions.
        assert_eq!(RecentChoices::holder_share_bound(55, 7, 0), None);
        assert_eq!(RecentChoices::holder_share_bound(56, 7, 0), Some(8 + 2));
        assert_eq!(RecentChoices::holder_share_bound(256, 7, 255), Some(36 + 2));
        assert_eq!(
            RecentChoices::holder_share_bound(256, 7, 256),
            Some(36 + 2 + 1)
        );
        assert_eq!(
            RecentChoices::holder_share_bound(256, 7, 12_000),
            Some(36 + 2 + 46)
        );
        // More than 32 instances never have 8 decisions each in the window.
        assert_eq!(RecentChoices::holder_share_bound(256, 32, 0), Some(8 + 2));
        assert_eq!(RecentChoices::holder_share_bound(256, 33, 0), None);
        assert!(RecentChoices::within_even_share(36, 256, 7));
        assert!(!RecentChoices::within_even_share(37, 256, 7));
        assert!(RecentChoices::within_even_share(10, 70, 7));
        assert!(!RecentChoices::within_even_share(11, 70, 7));
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
