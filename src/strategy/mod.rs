//! Routing policies (the configured `strategy`): given the routing key the
//! request reader derived, decide where the request goes, as the values of
//! the headers that steer Envoy (key header for Maglev, host-override header,
//! route-selection header), and claim the in-flight slot the request will
//! use. One file per policy behind one trait, like SGLang router's
//! `policies/`; [`Policy`] dispatches on the configured strategy.
//!
//! `steering` writes a [`RouteHeaders`] onto the request (every header it
//! governs was removed from the client's request first), and the stream keeps
//! the [`Routed::ticket`] until its `on_done`.

mod least_outstanding;
mod longest_prefix;
mod prefix_aware;
mod random;
mod recent;

#[cfg(test)]
mod scenarios;

pub use least_outstanding::LeastOutstanding;
pub use longest_prefix::{
    AdapterDecision, AdapterPlacement, AdapterSets, Cost, Explained, LongestPrefix,
};
pub use prefix_aware::{least_busy_other, salted_key, PrefixAware};
pub use random::RandomPolicy;
pub use recent::{RecentChoices, RECENT_WINDOW};

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

/// A routing strategy.
pub trait RoutingPolicy {
    /// Decides for one request. `key` is the computed routing key (None: no
    /// body); `random` is a fresh random number; `now_ms` the current time.
    fn decide(
        &self,
        key: Option<&str>,
        load: &mut dyn LoadView,
        random: u64,
        now_ms: u64,
    ) -> Routed;
}

/// The configured strategy (enum dispatch; build it in `on_configure`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Policy {
    LongestPrefix(LongestPrefix),
    PrefixAware(PrefixAware),
    LeastOutstanding(LeastOutstanding),
    Random(RandomPolicy),
}

impl RoutingPolicy for Policy {
    fn decide(
        &self,
        key: Option<&str>,
        load: &mut dyn LoadView,
        random: u64,
        now_ms: u64,
    ) -> Routed {
        match self {
            // Without blocks (no key): where Maglev puts a request without one.
            Policy::LongestPrefix(_) => Routed::untracked(RouteHeaders::bare(DecisionKind::NoKey)),
            Policy::PrefixAware(p) => p.decide(key, load, random, now_ms),
            Policy::LeastOutstanding(p) => p.decide(key, load, random, now_ms),
            Policy::Random(p) => p.decide(key, load, random, now_ms),
        }
    }
}

impl Policy {
    /// Decides for a request as its reading derived it: LONGEST_PREFIX on
    /// the prompt's blocks (and the LoRA adapter it names, hashed), every
    /// other policy on the key. `recent`: where this worker's last decisions
    /// went, which LONGEST_PREFIX reads and adds to.
    pub fn route(
        &self,
        derivation: &KeyDerivation,
        adapter: Option<u64>,
        load: &mut dyn LoadView,
        recent: &mut RecentChoices,
        random: u64,
        now_ms: u64,
    ) -> Routed {
        match (self, &derivation.blocks) {
            (Policy::LongestPrefix(p), Some(blocks)) => {
                p.decide(blocks, adapter, load, recent, random, now_ms)
            }
            _ => self.decide(derivation.key.as_deref(), load, random, now_ms),
        }
    }
}
