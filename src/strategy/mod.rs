//! Routing policies (the configured `strategy`): given the routing key the
//! request reader derived, decide where the request goes, as the values of
//! the headers that steer Envoy (key header for Maglev, host-override header,
//! route-selection header), and claim the in-flight slot the request will
//! use. [`Policy::route`] dispatches on the configured strategy in one
//! match: LONGEST_PREFIX (`longest_prefix.rs`, the default) and FIXED_PREFIX
//! (`prefix_aware.rs`) choose an instance; LEAST_OUTSTANDING_REQUESTS and
//! RANDOM leave the choice to Envoy's balancers.
//!
//! `steering` writes a [`RouteHeaders`] onto the request (every header it
//! governs was removed from the client's request first), and the stream keeps
//! the [`Routed::ticket`] until its `on_done`.

mod longest_prefix;
mod prefix_aware;
mod recent;

#[cfg(test)]
mod scenarios;

pub use longest_prefix::{
    AdapterDecision, AdapterPlacement, AdapterSets, Cost, Explained, LongestPrefix,
};
pub use prefix_aware::{least_busy_other, salted_key, PrefixAware};
pub use recent::{RecentChoices, RECENT_WINDOW};

use crate::blocks::PromptBlocks;
use crate::headers::LEAST_REQUEST_ROUTE;
use crate::load::{LoadView, Ticket};
use crate::request::KeyDerivation;

/// Why a request went where it went (one metric per kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecisionKind {
    /// LONGEST_PREFIX: to a holder of the longest held prefix.
    Matched,
    /// LONGEST_PREFIX: nothing held sets an instance apart: placed by its
    /// opening.
    Cold,
    /// LONGEST_PREFIX: to another instance than the holders of its longest
    /// prefix, which cost more (load, share) or are over an engine bound.
    Moved,
    /// To the key's target (Maglev on the key).
    Prefix,
    /// The target was at the concurrency threshold: elsewhere.
    Overflow,
    /// Least outstanding requests (Envoy's least_request cluster).
    LeastOutstanding,
    /// Uniformly random (Maglev without a key).
    Random,
    /// Prefix-aware, but the request has no key (no body).
    NoKey,
}

impl DecisionKind {
    /// Lowercase name for metrics and the debug header.
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionKind::Matched => "matched",
            DecisionKind::Cold => "cold",
            DecisionKind::Moved => "moved",
            DecisionKind::Prefix => "prefix",
            DecisionKind::Overflow => "overflow",
            DecisionKind::LeastOutstanding => "least_outstanding",
            DecisionKind::Random => "random",
            DecisionKind::NoKey => "no_key",
        }
    }
}

/// What a policy decided for one request: why (`kind`, for metrics and the
/// debug header) and the value of each request header that carries it out;
/// `None` leaves the header absent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteHeaders {
    pub kind: DecisionKind,
    /// Value of the key header (Maglev hashes it); may be a salted key.
    pub key: Option<String>,
    /// Value of the configured host header (`ip:port`, for `override_host`).
    pub host_override: Option<String>,
    /// Value of [`crate::headers::ROUTE_HEADER`].
    pub route: Option<&'static str>,
    /// Value of [`crate::headers::COUNTED_HEADER`]: the instance this decision
    /// already counted the request on.
    pub counted: Option<String>,
    /// LONGEST_PREFIX: bytes of the prompt the chosen instance was known to
    /// hold (for the histogram and the debug header).
    pub matched_bytes: Option<u64>,
    /// LONGEST_PREFIX: bytes of the prompt the decision saw.
    pub prompt_bytes: Option<u64>,
    /// LONGEST_PREFIX: when the index last recorded the chosen instance's
    /// holding of the matched prefix, before this decision (seconds).
    pub held_since_s: Option<u32>,
    /// LONGEST_PREFIX: the chosen instance's cost and the runner-up's.
    pub explained: Option<Explained>,
    /// LONGEST_PREFIX, a request for a LoRA adapter: where it went against
    /// the adapter's set.
    pub adapter: Option<AdapterDecision>,
}

impl RouteHeaders {
    /// A decision of `kind` that sets no header.
    pub fn bare(kind: DecisionKind) -> Self {
        Self {
            kind,
            key: None,
            host_override: None,
            route: None,
            counted: None,
            matched_bytes: None,
            prompt_bytes: None,
            held_since_s: None,
            explained: None,
            adapter: None,
        }
    }
}

/// A policy's decision plus the count it took, if any.
#[derive(Debug, PartialEq, Eq)]
pub struct Routed {
    pub headers: RouteHeaders,
    /// Hold it in the stream; give it to `LoadTracker::release` in `on_done`.
    pub ticket: Option<Ticket>,
    /// LONGEST_PREFIX: prompt bytes the decision sends to the instance it
    /// names past what the index said that instance held (0 otherwise).
    pub placed_bytes: u64,
}

impl Routed {
    fn untracked(headers: RouteHeaders) -> Self {
        Self {
            headers,
            ticket: None,
            placed_bytes: 0,
        }
    }
}

/// What a decision is made on: the request as its reading derived it.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteRequest<'a> {
    /// The routing key (16 hex digits); None: no key (no body, or one that
    /// could not be read).
    pub key: Option<&'a str>,
    /// LONGEST_PREFIX: the prompt's chained blocks.
    pub blocks: Option<&'a PromptBlocks>,
    /// The LoRA adapter the request names, hashed.
    pub adapter: Option<u64>,
}

impl<'a> RouteRequest<'a> {
    /// The request `derivation` describes, for `adapter`.
    pub fn of(derivation: &'a KeyDerivation, adapter: Option<u64>) -> Self {
        Self {
            key: derivation.key.as_deref(),
            blocks: derivation.blocks.as_ref(),
            adapter,
        }
    }
}

/// The configured strategy (enum dispatch; build it in `on_configure`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Policy {
    LongestPrefix(LongestPrefix),
    PrefixAware(PrefixAware),
    /// Envoy's least_request cluster, chosen by the route header.
    LeastOutstanding,
    /// Maglev without a key: uniformly random.
    Random,
}

impl Policy {
    /// Decides for `request`: `random` is a fresh random number, `recent`
    /// where this worker's last decisions went (LONGEST_PREFIX reads and adds
    /// to it).
    pub fn route(
        &self,
        request: RouteRequest<'_>,
        load: &mut dyn LoadView,
        recent: &mut RecentChoices,
        random: u64,
        now_ms: u64,
    ) -> Routed {
        match self {
            Policy::LongestPrefix(p) => match request.blocks {
                Some(blocks) => p.decide(blocks, request.adapter, load, recent, random, now_ms),
                // No key: where Maglev puts a request without one.
                None => Routed::untracked(RouteHeaders::bare(DecisionKind::NoKey)),
            },
            Policy::PrefixAware(p) => p.decide(request.key, load, random, now_ms),
            Policy::LeastOutstanding => Routed::untracked(RouteHeaders {
                route: Some(LEAST_REQUEST_ROUTE),
                ..RouteHeaders::bare(DecisionKind::LeastOutstanding)
            }),
            Policy::Random => Routed::untracked(RouteHeaders::bare(DecisionKind::Random)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::{LoadConfig, LoadTracker};
    use crate::shared::MemoryStore;

    fn route(policy: &Policy) -> Routed {
        let store = MemoryStore::new();
        let mut load = LoadTracker::new(&store, LoadConfig::default(), 1);
        let request = RouteRequest {
            key: Some("0123456789abcdef"),
            ..RouteRequest::default()
        };
        policy.route(request, &mut load, &mut RecentChoices::default(), 7, 0)
    }

    #[test]
    fn random_sets_no_header_and_counts_nothing() {
        let routed = route(&Policy::Random);
        assert_eq!(routed.headers, RouteHeaders::bare(DecisionKind::Random));
        assert_eq!(routed.ticket, None);
    }

    #[test]
    fn least_outstanding_selects_the_least_request_route_without_key_or_override() {
        let routed = route(&Policy::LeastOutstanding);
        assert_eq!(routed.headers.kind, DecisionKind::LeastOutstanding);
        assert_eq!(routed.headers.route, Some(LEAST_REQUEST_ROUTE));
        assert_eq!(routed.headers.key, None);
        assert_eq!(routed.headers.host_override, None);
        assert_eq!(routed.ticket, None);
    }

    #[test]
    fn longest_prefix_without_blocks_is_left_to_maglev_without_a_key() {
        let policy = Policy::LongestPrefix(LongestPrefix::new(
            4,
            4,
            crate::config::ColdPlacement::Consistent,
            None,
        ));
        let routed = route(&policy);
        assert_eq!(routed.headers, RouteHeaders::bare(DecisionKind::NoKey));
        assert_eq!(routed.ticket, None);
    }
}
