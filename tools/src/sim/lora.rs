//! LoRA adapter slots, as vLLM's scheduler and worker use them: at most
//! `max_loras` adapters resident at once, the least recently used idle one
//! evicted to make room, and a request whose adapter is not resident waiting
//! while every slot holds an adapter with requests running (vLLM's scheduler
//! never runs more than `max_loras` distinct adapters in one batch; the
//! worker's LRU cache of adapters evicts the least recently activated).

/// What [`LoraSlots::acquire`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    /// The adapter was resident: no load.
    Resident,
    /// The adapter was made resident (into a free slot or an evicted one's): one load.
    Loaded,
}

/// The resident adapters of one instance.
#[derive(Debug, Clone)]
pub struct LoraSlots {
    max_loras: usize,
    /// Resident adapters with their running requests, least recently used first.
    resident: Vec<(String, usize)>,
    loads: u64,
}

impl LoraSlots {
    /// No adapter resident, `max_loras` slots.
    pub fn new(max_loras: usize) -> Self {
        LoraSlots {
            max_loras,
            resident: Vec::new(),
            loads: 0,
        }
    }

    /// Whether a request for `adapter` can run now: it is resident, a slot
    /// is free, or a resident adapter has no request running.
    pub fn can_acquire(&self, adapter: &str) -> bool {
        self.resident.iter().any(|(a, _)| a == adapter)
            || self.resident.len() < self.max_loras
            || self.resident.iter().any(|&(_, running)| running == 0)
    }

    /// Starts a request for `adapter`: marks it most recently used, loading
    /// it (evicting the least recently used idle adapter if no slot is
    /// free). `None` if it must wait ([`LoraSlots::can_acquire`] is false).
    pub fn acquire(&mut self, adapter: &str) -> Option<Acquired> {
        if let Some(i) = self.resident.iter().position(|(a, _)| a == adapter) {
            let (name, running) = self.resident.remove(i);
            self.resident.push((name, running + 1));
            return Some(Acquired::Resident);
        }
        if self.resident.len() >= self.max_loras {
            let idle = self
                .resident
                .iter()
                .position(|&(_, running)| running == 0)?;
            self.resident.remove(idle);
        }
        self.resident.push((adapter.to_string(), 1));
        self.loads += 1;
        Some(Acquired::Loaded)
    }

    /// Ends a request for `adapter` (it stays resident).
    pub fn release(&mut self, adapter: &str) {
        if let Some((_, running)) = self.resident.iter_mut().find(|(a, _)| a == adapter) {
            *running = running.saturating_sub(1);
        }
    }

    /// Evicts every adapter with no request running.
    pub fn evict_idle(&mut self) {
        self.resident.retain(|&(_, running)| running > 0);
    }

    /// Resident adapters, least recently used first.
    pub fn resident(&self) -> impl Iterator<Item = &str> {
        self.resident.iter().map(|(a, _)| a.as_str())
    }

    /// Adapters made resident so far.
    pub fn loads(&self) -> u64 {
        self.loads
    }

    /// The number of slots.
    pub fn max_loras(&self) -> usize {
        self.max_loras
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resident(slots: &LoraSlots) -> Vec<&str> {
        slots.resident().collect()
    }

    #[test]
    fn adapters_load_once_and_stay_resident() {
        let mut slots = LoraSlots::new(2);
        assert_eq!(slots.acquire("a"), Some(Acquired::Loaded));
        assert_eq!(slots.acquire("a"), Some(Acquired::Resident));
        slots.release("a");
        slots.release("a");
        assert_eq!(slots.acquire("a"), Some(Acquired::Resident));
        assert_eq!(slots.loads(), 1);
    }

    #[test]
    fn the_least_recently_used_idle_adapter_is_evicted() {
        let mut slots = LoraSlots::new(2);
        for a in ["a", "b"] {
            slots.acquire(a);
            slots.release(a);
        }
        // Using `a` again makes `b` the least recently used.
        slots.acquire("a");
        slots.release("a");
        assert_eq!(slots.acquire("c"), Some(Acquired::Loaded));
        assert_eq!(resident(&slots), ["a", "c"]);
        assert_eq!(slots.loads(), 3);
    }

    #[test]
    fn a_busy_adapter_is_never_evicted_and_a_new_one_waits_for_a_slot() {
        let mut slots = LoraSlots::new(2);
        slots.acquire("a");
        slots.acquire("b");
        slots.release("a");
        // `a` is the least recently used but busy `b` is not evictable: `a` goes.
        slots.acquire("b");
        assert_eq!(slots.acquire("c"), Some(Acquired::Loaded));
        assert_eq!(resident(&slots), ["b", "c"]);
        // Both slots busy: `d` waits, resident ones still run.
        assert!(!slots.can_acquire("d"));
        assert_eq!(slots.acquire("d"), None);
        assert!(slots.can_acquire("b"));
        assert_eq!(resident(&slots), ["b", "c"]);
        slots.release("c");
        assert!(slots.can_acquire("d"));
        assert_eq!(slots.acquire("d"), Some(Acquired::Loaded));
        assert_eq!(resident(&slots), ["b", "d"]);
        assert_eq!(slots.loads(), 4);
    }

    #[test]
    fn evicting_idle_adapters_keeps_busy_ones() {
        let mut slots = LoraSlots::new(3);
        slots.acquire("a");
        slots.acquire("b");
        slots.release("a");
        slots.evict_idle();
        assert_eq!(resident(&slots), ["b"]);
        // A release for an adapter not resident changes nothing.
        slots.release("zz");
        assert_eq!(resident(&slots), ["b"]);
    }
}
