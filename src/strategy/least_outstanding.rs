//! LEAST_OUTSTANDING_REQUESTS: hand the request to Envoy's `least_request`
//! cluster (`selection_method: FULL_SCAN`), selected through the route header.
//! Envoy knows every healthy host, including ones this filter never saw, and
//! its in-flight count is one atomic per host shared by all workers, which
//! the filter's own counts could not beat (`docs/design.md`).

use super::{DecisionKind, RouteHeaders, Routed, RoutingPolicy};
use crate::headers::LEAST_REQUEST_ROUTE;
use crate::load::LoadView;

/// See the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LeastOutstanding;

impl RoutingPolicy for LeastOutstanding {
    fn decide(
        &self,
        _key: Option<&str>,
        _load: &mut dyn LoadView,
        _random: u64,
        _now_ms: u64,
    ) -> Routed {
        // The upstream filter still counts the request for the in-flight gauge.
        Routed::untracked(RouteHeaders {
            route: Some(LEAST_REQUEST_ROUTE),
            ..RouteHeaders::bare(DecisionKind::LeastOutstanding)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::{LoadConfig, LoadTracker};
    use crate::shared::MemoryStore;

    #[test]
    fn routes_to_the_least_request_cluster_without_key_or_override() {
        let store = MemoryStore::new();
        let mut load = LoadTracker::new(&store, LoadConfig::default(), 1);
        let routed = LeastOutstanding.decide(Some("0123456789abcdef"), &mut load, 7, 0);
        assert_eq!(routed.headers.kind, DecisionKind::LeastOutstanding);
        assert_eq!(routed.headers.route, Some(LEAST_REQUEST_ROUTE));
        assert_eq!(routed.headers.key, None);
        assert_eq!(routed.headers.host_override, None);
        assert_eq!(routed.ticket, None);
    }
}
