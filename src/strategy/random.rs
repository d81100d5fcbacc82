//! RANDOM: no key and no override, so Maglev has nothing to hash and picks a
//! host at random (Envoy's `thread_aware_lb_impl.cc`), uniformly over the
//! healthy hosts (each holds an equal share of the Maglev table).

use super::{DecisionKind, RouteHeaders, Routed, RoutingPolicy};
use crate::load::LoadView;

/// See the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RandomPolicy;

impl RoutingPolicy for RandomPolicy {
    fn decide(
        &self,
        _key: Option<&str>,
        _load: &mut dyn LoadView,
        _random: u64,
        _now_ms: u64,
    ) -> Routed {
        Routed::untracked(RouteHeaders::bare(DecisionKind::Random))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::{LoadConfig, LoadTracker};
    use crate::shared::MemoryStore;

    #[test]
    fn removes_key_override_and_route() {
        let store = MemoryStore::new();
        let mut load = LoadTracker::new(&store, LoadConfig::default(), 1);
        let routed = RandomPolicy.decide(Some("0123456789abcdef"), &mut load, 7, 0);
        assert_eq!(routed.headers, RouteHeaders::bare(DecisionKind::Random));
        assert_eq!(routed.ticket, None);
    }
}
