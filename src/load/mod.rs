//! In-flight accounting across worker VMs, kept in proxy-wasm shared data, and
//! what the filter has learned about the fleet: which instances exist and which
//! instance Maglev sends each key to.
//!
//! Why this shape (see `docs/design.md` for the Envoy evidence):
//! - The same `.wasm` also runs as an *upstream* HTTP filter on the cluster,
//!   where `upstream.address` names the chosen host at request start. It calls
//!   [`LoadTracker::upstream_started`]: the instance is registered, the key's
//!   target learned, and the request counted exactly, with no learning lag.
//! - The downstream decision *claims* a slot on a known target atomically
//!   ([`LoadView::claim`] with the cap), so two workers cannot both take the
//!   last slot; the upstream filter then skips counting it again (the
//!   `COUNTED_HEADER` names the instance already counted).
//! - Every count is held by a [`Ticket`] that the stream owns and gives back to
//!   [`LoadTracker::release`] exactly once, in `on_done`.
//! - Each worker VM writes only its own column of each count record and keeps
//!   the exact truth locally, so failed writes are repaired on the next
//!   [`LoadTracker::tick`]; a dead VM's column stops counting when its lease
//!   expires (healing after a VM restart).
//! - Every table has a fixed size ([`LoadConfig`]); time is a parameter.

mod codec;
mod engine;
// Only for the cargo-fuzz target (`--cfg fuzzing`) and its seed test: it
// asserts, which the filter itself never does.
#[cfg(any(fuzzing, test))]
pub mod fuzzing;
mod instances;
mod lease;
mod mark;
mod pending;
mod prefix_index;
mod routes;
mod table;
mod tracker;

#[cfg(test)]
mod tests;

pub use tracker::{
    addr_hash, LoadTracker, PollerKind, RECORD_CACHE_MS, RECORD_READS_PER_DECISION,
    RESPONSE_CHECK_MS,
};

use crate::headers::PENDING_MARK;

pub use engine::{adapter_hash, AdapterNames, EngineBounds, EngineLoad, EngineView};
pub use instances::{FAILED_RETRY_MS, SUSPECT_MS};
pub use prefix_index::Remembered;
pub(crate) use prefix_index::SPAN_BLOCKS;

/// Instance slots of the registry by default ([`LoadConfig::max_instances`]):
/// the most instances one Envoy tracks, so the most `instances` may list. A
/// decision's cost does not grow with them past a few
/// ([`RECORD_READS_PER_DECISION`] records read again per
/// decision); the tick reads every slot once a second.
pub const MAX_INSTANCES: u16 = 256;

/// Sizes, times and namespace of the shared tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadConfig {
    /// Prefix of every shared-data key, so several filters (or Istio, which sets
    /// no `vm_id`) never collide. Keys are `prefix-router/<namespace>/v2/...`.
    pub namespace: String,
    /// Instance slots (bound of the registry). 1..=4096.
    pub max_instances: u16,
    /// Worker-VM columns (bound of concurrent VMs counted). 1..=255.
    pub vm_slots: u16,
    /// Buckets of the key -> instance table (4 keys each). 1..=65536.
    pub route_buckets: u32,
    /// A VM whose heartbeat is older than this stops counting.
    pub vm_lease_ms: u64,
    /// An instance not seen serving for this long is forgotten (no overflow
    /// goes to it; its slot can be reused once nothing is in flight there).
    pub instance_ttl_ms: u64,
    /// A learned key -> instance mapping older than this is ignored.
    pub route_ttl_ms: u64,
    /// A request routed before its key's target was known stops counting as
    /// pending after this long if no upstream filter took it over (client gone).
    pub pending_ttl_ms: u64,
    /// Bound of every compare-and-swap retry loop.
    pub cas_attempts: u32,
    /// The prefix index's shared-data budget (LONGEST_PREFIX), in bytes.
    pub index_bytes: u64,
}

impl Default for LoadConfig {
    fn default() -> Self {
        Self {
            namespace: "default".to_string(),
            max_instances: MAX_INSTANCES,
            // A VM per Envoy worker thread and one for the main thread:
            // Envoy's default `--concurrency` is the host's core count.
            vm_slots: 255,
            route_buckets: 4096,
            vm_lease_ms: 10_000,
            instance_ttl_ms: 60_000,
            route_ttl_ms: 600_000,
            pending_ttl_ms: 1_000,
            cas_attempts: 16,
            index_bytes: prefix_index::DEFAULT_BUDGET_BYTES,
        }
    }
}

impl LoadConfig {
    /// The same configuration with every size clamped into its allowed range.
    pub fn clamped(mut self) -> Self {
        self.max_instances = self.max_instances.clamp(1, 4096);
        self.vm_slots = self.vm_slots.clamp(1, 255);
        self.route_buckets = self.route_buckets.clamp(1, 65_536);
        self.cas_attempts = self.cas_attempts.clamp(1, 1_000);
        self
    }
}

/// An instance as the tables know it: its registry slot and `ip:port` address
/// (what the host-override header takes).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InstanceRef {
    pub slot: u16,
    pub address: std::rc::Rc<str>,
    /// [`addr_hash`] of `address`, hashed once where the record is read
    /// rather than wherever a decision looks the instance up.
    addr_hash: u64,
}

impl InstanceRef {
    pub fn new(slot: u16, address: std::rc::Rc<str>) -> Self {
        let addr_hash = addr_hash(&address);
        Self {
            slot,
            address,
            addr_hash,
        }
    }

    /// The hash its address is known by ([`addr_hash`]).
    pub fn addr_hash(&self) -> u64 {
        self.addr_hash
    }
}

/// Where a key's requests go: the instance Maglev chooses for it (the key
/// header alone gets there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub instance: InstanceRef,
}

/// Proof that one request is counted on one instance. Not `Clone`: give it
/// back to [`LoadTracker::release`] exactly once, when the stream ends.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a ticket left unreleased keeps its instance counted until the VM's lease expires"]
pub struct Ticket {
    pub(crate) slot: u16,
    pub(crate) addr_hash: u64,
    pub(crate) owner: u64,
}

impl Ticket {
    /// Registry slot of the counted instance (for logs and tests).
    pub fn slot(&self) -> u16 {
        self.slot
    }
}

/// Result of trying to count a request on an instance.
#[derive(Debug, PartialEq, Eq)]
pub enum Claim {
    /// Counted; the caller holds the ticket.
    Claimed(Ticket),
    /// The instance already has `in_flight >= cap`; nothing counted.
    Full { in_flight: u32 },
    /// Too much write contention to claim atomically; nothing counted (let the
    /// upstream filter count the request instead).
    Contended,
    /// The instance is no longer in the registry (forgotten or slot reused).
    Gone,
}

/// What the upstream filter knows when the upstream request starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpstreamStart<'a> {
    /// `upstream.address`: the host Envoy chose.
    pub address: &'a str,
    /// The routing key header, if the request carries one.
    pub key: Option<&'a str>,
    /// True if the request carried a host-override header (then the host was
    /// not Maglev's choice for the key, and nothing is learned about the key).
    pub overridden: bool,
    /// The [`crate::headers::COUNTED_HEADER`] value, if any.
    pub counted: Option<&'a str>,
}

impl UpstreamStart<'_> {
    /// True if the decision's count (if any) stands: it was taken on
    /// `address`, or none was taken. False: the decision counted the request
    /// on another instance than Envoy chose.
    pub fn decision_count_stands(&self) -> bool {
        match self.counted {
            None | Some(PENDING_MARK) => true,
            Some(counted) => counted == self.address,
        }
    }
}

/// One instance's load, for the in-flight gauge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceLoad {
    pub address: String,
    pub in_flight: u32,
    /// Seen serving within `instance_ttl_ms`.
    pub fresh: bool,
}

/// A fresh instance with its load, as the policies weigh it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub instance: InstanceRef,
    /// This Envoy's requests in flight there: exact, what claims count.
    pub in_flight: u32,
    /// The load decisions compare: the engine's fleet-wide estimate where a
    /// fresh engine sample exists (never below `in_flight`), else `in_flight`.
    pub load: u32,
    /// Requests the instance may still take under the fleet-wide
    /// `max_requests` bound (None: no bound, or no fresh sample).
    pub engine_room: Option<u32>,
    /// At or over a fleet-wide engine bound (requests or KV usage).
    pub over_bounds: bool,
    /// The adapters its engine lists (with a fresh sample); None: not known.
    pub served: Option<AdapterNames>,
    /// The adapters with requests running or waiting on its engine (with a
    /// fresh sample); None: not reported.
    pub active_adapters: Option<AdapterNames>,
    /// Its forget mark ([`crate::usage::check`]): the prefix index does not
    /// believe its entries last used at or before this second.
    pub forgotten_through: u32,
    /// In the fleet as configured (`instances`) or read from Envoy's admin
    /// (`discovery`), not only learned from traffic.
    pub listed: bool,
}

impl Candidate {
    /// An instance known only by this Envoy's counts.
    pub fn local(instance: InstanceRef, in_flight: u32) -> Self {
        Self {
            instance,
            in_flight,
            load: in_flight,
            engine_room: None,
            over_bounds: false,
            served: None,
            active_adapters: None,
            forgotten_through: 0,
            listed: false,
        }
    }

    /// Whether the instance may serve `adapter`: its engine lists it, runs
    /// it, or what it lists is not known.
    pub fn may_serve(&self, adapter: u64) -> bool {
        self.served
            .as_ref()
            .is_none_or(|served| served.contains(adapter))
            || self.runs(adapter)
    }

    /// Whether its engine has requests for `adapter` running or waiting
    /// (then the adapter is in one of its slots, or about to be).
    pub fn runs(&self, adapter: u64) -> bool {
        self.active_adapters
            .as_ref()
            .is_some_and(|active| active.contains(adapter))
    }

    /// The local in-flight count at which this instance's load reaches
    /// `load_cap` (claims count local requests; bounds are in load terms),
    /// lowered to stay within the engine's room.
    pub fn local_cap(&self, load_cap: u32) -> u32 {
        let cap = self
            .in_flight
            .saturating_add(load_cap.saturating_sub(self.load));
        match self.engine_room {
            Some(room) => cap.min(self.in_flight.saturating_add(room)),
            None => cap,
        }
    }
}

/// The longest prefix of a chain some candidate holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeldPrefix {
    /// Blocks of the chain held (0: none).
    pub blocks: usize,
    /// Registry slots of the candidates holding all of them.
    pub holders: Vec<u16>,
}

/// What routing policies may ask of the load tables (implemented by
/// [`LoadTracker`]; policies stay testable against any implementation).
pub trait LoadView {
    /// The learned target of `key`, if known, fresh, and still registered.
    fn target_of(&mut self, key: &str, now_ms: u64) -> Option<Target>;
    /// Marks one request of `key` as pending (about to be routed before its
    /// target is known), then looks the target up again: if another worker
    /// learned it meanwhile, withdraws the mark and returns the target (claim
    /// it as usual); otherwise returns None and the request goes out with
    /// [`PENDING_MARK`] in [`crate::headers::COUNTED_HEADER`].
    fn route_blind(&mut self, key: &str, now_ms: u64) -> Option<Target>;
    /// Counts one request on `instance` if its in-flight count, plus the
    /// pending requests of `key` (which are on their way to it), is below
    /// `cap` (always, with `cap: None`), atomically across workers.
    fn claim(
        &mut self,
        instance: &InstanceRef,
        key: Option<&str>,
        cap: Option<u32>,
        now_ms: u64,
    ) -> Claim;
    /// Every fresh instance (the configured and the learned ones) with its
    /// in-flight count, weighed by its engine's sample with engine load on.
    fn candidates(&mut self, now_ms: u64) -> Vec<Candidate>;
    /// The longest prefix of `chain` the prefix index says one of
    /// `candidates` holds.
    fn longest_held(&mut self, chain: &[u64], candidates: &[Candidate], now_ms: u64) -> HeldPrefix;
    /// Records in the prefix index that `instance` now holds all of `chain`,
    /// of which it was known to hold the first `known` blocks; returns when
    /// that known holding was last recorded before (seconds), if it was.
    fn remember_held(
        &mut self,
        chain: &[u64],
        known: usize,
        instance: &InstanceRef,
        candidates: &[Candidate],
        now_ms: u64,
    ) -> Option<u32>;
}
