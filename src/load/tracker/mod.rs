//! The per-VM handle on the shared load tables: one `LoadTracker` per worker VM
//! (a VM-global in the glue, shared by every root and stream context of the VM,
//! and kept across configuration updates, which reuse the VM).
//!
//! It keeps the exact count of this VM's open tickets per instance locally, and
//! publishes that number into its own column of the shared record; readers sum
//! the columns of live VMs.

use std::rc::Rc;

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::engine::EngineView;
use super::mark::UpstreamFilterMark;
use super::prefix_index::{BucketReads, Holder, PrefixEntry, PrefixIndex, Remembered};
use super::table::{Change, Tables, Updated};
use super::{
    Candidate, Claim, HeldPrefix, InstanceLoad, InstanceRef, LoadConfig, LoadView, Target, Ticket,
    UpstreamStart,
};
use crate::headers::PENDING_MARK;
use crate::shared::SharedStore;

mod columns;
mod engine;
#[cfg(test)]
pub(crate) use engine::ENGINE_CACHE_MS;
mod learned;
mod registry;
pub use engine::PollerKind;
pub use registry::{RECORD_CACHE_MS, RECORD_READS_PER_DECISION};

use columns::{Columns, Count, Limit};
use learned::{Learned, Pending};
use registry::{Lookup, Registry};

/// Counting in the listener, how often one VM checks at a response where a
/// request claimed on its key's learned target really went (reading
/// `upstream.address` and the instance record: two host calls). Fleet
/// changes remap keys rarely; a remapped key is counted on its old instance
/// for at most this long per VM.
pub const RESPONSE_CHECK_MS: u64 = 1_000;

/// See the module documentation. Its parts each own their state and take
/// the shared tables as an argument; where one needs another (the registry
/// asks the columns whether a slot is idle), it is passed in.
#[derive(Debug)]
pub struct LoadTracker<S: SharedStore> {
    tables: Tables<S>,
    config: LoadConfig,
    columns: Columns,
    registry: Registry,
    learned: Learned,
    /// LONGEST_PREFIX: which instances hold which prompt blocks.
    index: PrefixIndex,
    /// What this VM's index writes did since [`LoadTracker::take_index_writes`].
    index_writes: Remembered,
    /// The prompt being decided and what its lookups read (see
    /// [`IndexSession`]).
    index_session: IndexSession,
    /// A deciding configuration sized the index (a VM that only counts, or
    /// only ticks, such as Envoy's main thread, has no index of its own).
    index_sized: bool,
    /// How decisions use the engines' samples (None: engine load is off,
    /// decisions see this Envoy's counts only).
    engine_view: Option<EngineView>,
    /// Engine samples as this VM last read them.
    engine_cache: engine::EngineCache,
}

/// Whether this VM's copy of a shared record, read at `read_ms`, may still
/// stand for it at `now_ms`, for `window_ms`. The host's clock is monotonic
/// ([`crate::host::Host::now_ms`]); should a host's clock go back all the
/// same, a copy read "after" now is read again rather than standing for as
/// long as the clock went back.
fn copy_is_fresh(read_ms: u64, now_ms: u64, window_ms: u64) -> bool {
    now_ms
        .checked_sub(read_ms)
        .is_some_and(|age| age < window_ms)
}

/// Of the copies a decision finds expired (when each was read, its slot),
/// the last it reads again: the [`RECORD_READS_PER_DECISION`] read longest
/// ago. A copy ordered after it stands as it is; None: every expired copy is
/// read again (there are no more than the budget).
fn last_read_again(mut expired: Vec<(u64, u16)>) -> Option<(u64, u16)> {
    if expired.len() <= RECORD_READS_PER_DECISION {
        return None;
    }
    let (_, last, _) = expired.select_nth_unstable(RECORD_READS_PER_DECISION - 1);
    Some(*last)
}

/// Values kept per instance slot (slots are below the registry's size), in a
/// vector: what a decision looks up for every instance takes no hashing.
#[derive(Debug)]
struct BySlot<T> {
    values: Vec<Option<T>>,
}

impl<T> Default for BySlot<T> {
    fn default() -> Self {
        Self { values: Vec::new() }
    }
}

impl<T> BySlot<T> {
    fn get(&self, slot: u16) -> Option<&T> {
        self.values.get(usize::from(slot))?.as_ref()
    }

    fn insert(&mut self, slot: u16, value: T) {
        let index = usize::from(slot);
        if self.values.len() <= index {
            self.values.resize_with(index + 1, || None);
        }
        if let Some(kept) = self.values.get_mut(index) {
            *kept = Some(value);
        }
    }

    fn remove(&mut self, slot: u16) {
        if let Some(kept) = self.values.get_mut(usize::from(slot)) {
            *kept = None;
        }
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.values.iter_mut().flatten()
    }
}

/// The hash an instance's address is known by: in every table, and where
/// a worker seats an instance's recent choices.
pub fn addr_hash(address: &str) -> u64 {
    xxh3_64(address.as_bytes())
}

/// The hash a key is known by in every table.
fn key_hash(key: &str) -> u64 {
    xxh3_64_with_seed(key.as_bytes(), 0x6b65_795f_726f_7574)
}

impl<S: SharedStore> LoadTracker<S> {
    /// A tracker for one worker VM. `vm_nonce` must differ between VM
    /// incarnations (e.g. random at VM start); 0 is replaced by 1.
    pub fn new(store: S, config: LoadConfig, vm_nonce: u64) -> Self {
        let config = config.clamped();
        Self {
            tables: Tables::new(store, &config.namespace, config.cas_attempts),
            columns: Columns::new(vm_nonce.max(1), config.vm_slots, config.vm_lease_ms),
            registry: Registry::new(config.max_instances, config.instance_ttl_ms),
            learned: Learned::new(
                config.route_buckets,
                config.route_ttl_ms,
                config.pending_ttl_ms,
            ),
            index: PrefixIndex::new(config.index_bytes),
            index_writes: Remembered::default(),
            index_session: IndexSession::default(),
            index_sized: false,
            engine_view: None,
            engine_cache: engine::EngineCache::default(),
            config,
        }
    }

    /// The configuration in use (sizes clamped).
    pub fn config(&self) -> &LoadConfig {
        &self.config
    }

    /// The configured fleet (`instances`); registered before the next
    /// decision that needs the instances, kept fresh while listed.
    pub fn set_configured_instances(&mut self, instances: &Rc<[String]>) {
        self.registry.set_configured(instances);
    }

    /// Resizes the prefix index (a configuration update). Shared data cannot
    /// shrink: after a smaller budget the buckets past it stay allocated,
    /// unused, until Envoy restarts.
    pub fn set_index_bytes(&mut self, index_bytes: u64) {
        self.index_sized = true;
        if index_bytes != self.config.index_bytes {
            self.config.index_bytes = index_bytes;
            self.index = PrefixIndex::new(index_bytes);
        }
    }

    /// How decisions weigh the engines' samples (the deciding
    /// configuration's `engine_load`; None: not at all).
    pub fn set_engine_view(&mut self, view: Option<EngineView>) {
        self.engine_view = view;
    }

    /// Entries the prefix index holds at most, once a deciding
    /// configuration sized it.
    pub fn index_capacity(&self) -> Option<u64> {
        self.index_sized.then(|| self.index.capacity())
    }

    /// Shared-data bytes of the prefix index's values when it is full.
    pub fn index_bytes(&self) -> u64 {
        self.index.bytes()
    }

    /// What this VM's prefix-index writes did since the last call (for the
    /// occupancy gauge and the eviction counter).
    pub fn take_index_writes(&mut self) -> Remembered {
        std::mem::take(&mut self.index_writes)
    }

    /// Changes how long an unseen instance stays known (a configuration
    /// update; the tables themselves are kept).
    pub fn set_instance_ttl_ms(&mut self, instance_ttl_ms: u64) {
        self.config.instance_ttl_ms = instance_ttl_ms;
        self.registry.set_instance_ttl_ms(instance_ttl_ms);
    }

    /// This VM's column, if it holds a lease.
    pub fn column(&self) -> Option<u16> {
        self.columns.column()
    }

    /// Requests this VM currently holds tickets for, over all instances.
    pub fn local_in_flight(&self) -> u32 {
        self.columns.local_in_flight()
    }

    /// Upstream filter, `on_http_request_headers`: registers the instance,
    /// learns the key's target (when Maglev chose it), and counts the request
    /// unless the decision already counted it on this very instance. Keep the
    /// returned ticket in the upstream stream and release it in `on_done`.
    ///
    /// Without an upstream filter, the glue may call this from the downstream
    /// `on_http_response_headers` instead (counting then starts late).
    pub fn upstream_started(&mut self, start: UpstreamStart<'_>, now_ms: u64) -> Option<Ticket> {
        // Before counting, from the copy the count's slot lookup reads anyway.
        self.retry_if_due(start.address, now_ms);
        let ticket = self.count_upstream(start, now_ms);
        // Counted (or not countable) now: no longer pending. Counting first
        // means there is no instant where the request is neither.
        if let (Some(PENDING_MARK), Some(key)) = (start.counted, start.key) {
            let hash = key_hash(key);
            self.learned
                .mark_pending(&self.tables, hash, Pending::Withdraw, now_ms);
        }
        ticket
    }

    fn count_upstream(&mut self, start: UpstreamStart<'_>, now_ms: u64) -> Option<Ticket> {
        let tables = &self.tables;
        if start.overridden {
            if let Some(nominated) = start
                .counted
                .filter(|c| *c != start.address && *c != PENDING_MARK)
            {
                self.registry
                    .mark_unseen(tables, &mut self.columns, nominated, now_ms);
            }
        }
        let slot = self.registry.find_slot(
            tables,
            &mut self.columns,
            start.address,
            now_ms,
            Lookup::OrRegister,
        )?;
        if let (Some(key), false) = (start.key, start.overridden) {
            let (hash, instance) = (key_hash(key), addr_hash(start.address));
            self.learned.learn(tables, hash, slot, instance, now_ms);
        }
        if start.counted == Some(start.address) {
            // Already counted by the decision; just keep last-seen fresh.
            self.refresh_last_seen(slot, start.address, now_ms);
            return None;
        }
        let read = self.registry.take_recent(slot, now_ms);
        let counted = self
            .columns
            .add(tables, slot, start.address, Count::Serving, read, now_ms);
        // Seen serving: the copy's last seen and suspect flag are behind.
        self.registry.forget_copy(slot);
        match counted {
            Claim::Claimed(ticket) => Some(ticket),
            _ => None,
        }
    }

    /// An attempt's connection to `address` failed (refused, or reset before
    /// the request went out): it is no candidate until it answers
    /// ([`Self::answered`]), or [`crate::load::FAILED_RETRY_MS`] have passed
    /// and one request tries it again. True if it was not marked before.
    pub fn connection_failed(&mut self, address: &str, now_ms: u64) -> bool {
        let (tables, columns) = (&self.tables, &mut self.columns);
        self.registry
            .change_record(tables, columns, address, now_ms, |record| {
                if record.is_failed(now_ms) {
                    return Change::Keep(false);
                }
                let newly = record.failed_since_ms.is_none();
                record.failed_since_ms = Some(now_ms);
                Change::Write(newly)
            })
    }

    /// `address` answered a request: no longer failed. Writes only if this
    /// VM's copy of its record ([`RECORD_CACHE_MS`]) shows it marked.
    pub fn answered(&mut self, address: &str, now_ms: u64) {
        let marked = self
            .registry
            .copy_of(&self.tables, address, now_ms)
            .is_some_and(|record| record.failed_since_ms.is_some());
        if marked {
            let (tables, columns) = (&self.tables, &mut self.columns);
            self.registry
                .change_record(tables, columns, address, now_ms, |record| {
                    if record.failed_since_ms.take().is_none() {
                        return Change::Keep(false);
                    }
                    Change::Write(true)
                });
        }
    }

    /// `address`'s engine no longer holds a prefix the index had it hold
    /// since `through_s` (seconds): its forget mark moves there, so no
    /// decision believes its entries used then or earlier. Never moves back.
    /// True if it moved (not already there, by another worker or miss).
    pub fn forget_held_through(&mut self, address: &str, through_s: u32, now_ms: u64) -> bool {
        let behind = self
            .registry
            .copy_of(&self.tables, address, now_ms)
            .is_some_and(|record| record.forgotten_through_s < through_s);
        if !behind {
            return false;
        }
        let (tables, columns) = (&self.tables, &mut self.columns);
        self.registry
            .change_record(tables, columns, address, now_ms, |record| {
                if record.forgotten_through_s >= through_s {
                    return Change::Keep(false);
                }
                record.forgotten_through_s = through_s;
                Change::Write(true)
            })
    }

    /// A request is going to `address`: if its failed mark lapsed, this
    /// request tries it again and renews the mark, so the others keep away
    /// until it answers.
    fn retry_if_due(&mut self, address: &str, now_ms: u64) {
        let due = self
            .registry
            .copy_of(&self.tables, address, now_ms)
            .is_some_and(|record| record.is_due_for_retry(now_ms));
        if due {
            let (tables, columns) = (&self.tables, &mut self.columns);
            self.registry
                .change_record(tables, columns, address, now_ms, |record| {
                    if !record.is_due_for_retry(now_ms) {
                        return Change::Keep(false);
                    }
                    record.failed_since_ms = Some(now_ms);
                    Change::Write(false)
                });
        }
    }

    /// `address` in `slot` is serving: writes its last-seen time if this
    /// VM's copy of the record ([`registry::RECORD_CACHE_MS`]) shows it an
    /// eighth of the instance TTL old (or suspect), sparing a shared write
    /// per request otherwise.
    fn refresh_last_seen(&mut self, slot: u16, address: &str, now_ms: u64) {
        let refresh_ms = (self.config.instance_ttl_ms / 8).max(1);
        let stale = self
            .registry
            .keep_copy(&self.tables, slot, now_ms)
            .is_some_and(|record| {
                record.address == address
                    && (record.suspect_since_ms.is_some()
                        || now_ms.saturating_sub(record.last_seen_ms) >= refresh_ms)
            });
        if stale {
            self.columns.publish(&self.tables, slot, Some(now_ms));
            self.registry.forget_copy(slot);
        }
    }

    /// Counting in the listener, at the response from `start.address`: does
    /// what the upstream filter would have done at the request's start
    /// ([`Self::upstream_started`]) and keeps one count for the stream.
    /// `held` is the decision's ticket: given back if it counts the request
    /// on another instance than Envoy chose, kept if it stands (then nothing
    /// is counted again). Returns the one ticket the stream holds from now on.
    pub fn settle_at_response(
        &mut self,
        start: UpstreamStart<'_>,
        held: Option<Ticket>,
        now_ms: u64,
    ) -> Option<Ticket> {
        let held = match held {
            Some(stale) if !start.decision_count_stands() => {
                self.release(stale, now_ms);
                None
            }
            held => held,
        };
        match self.upstream_started(start, now_ms) {
            Some(counted) => {
                // A decision's count that stood made the tracker count
                // nothing; keep at most one count per stream regardless.
                if let Some(previous) = held {
                    self.release(previous, now_ms);
                }
                Some(counted)
            }
            None => held,
        }
    }

    /// Counting in the listener: whether a request of `key` claimed on its
    /// learned target should have its response checked (true once per
    /// [`RESPONSE_CHECK_MS`] per key and VM; asking counts as checking, so
    /// concurrent requests do not all check).
    pub fn response_check_due(&mut self, key: &str, now_ms: u64) -> bool {
        self.learned.response_check_due(key_hash(key), now_ms)
    }

    /// Gives a ticket back: the request it counted has ended. Call exactly once
    /// per ticket (the ticket is consumed), from the stream's `on_done`.
    pub fn release(&mut self, ticket: Ticket, now_ms: u64) {
        self.columns.release(&self.tables, ticket, now_ms);
    }

    /// Upstream filter: leaves the mark that tells the listener filter an
    /// upstream filter counts in these tables (`crate::counting_check`).
    /// True once the mark is there (call until it is, then never again).
    pub fn mark_upstream_filter(&mut self, now_ms: u64) -> bool {
        let key = self.tables.key(format_args!("upstream-filter"));
        let marked = self.tables.update(&key, |mark: &mut UpstreamFilterMark| {
            if mark.is_present() {
                return Change::Keep(());
            }
            mark.first_ms = now_ms.max(1);
            Change::Write(())
        });
        !matches!(marked, Updated::Failed)
    }

    /// Listener filter: whether an upstream filter has marked these tables.
    pub fn upstream_filter_marked(&self) -> bool {
        let key = self.tables.key(format_args!("upstream-filter"));
        self.tables
            .read::<UpstreamFilterMark>(&key)
            .record
            .is_present()
    }

    /// Root context tick (about every second): heartbeat the lease, refresh the
    /// lease view, republish our cells wherever the shared copy disagrees with
    /// our local truth, and clear cells of dead VMs. Returns what
    /// [`Self::snapshot`] would, from the same reads of every slot (the
    /// gauges'; one read of each slot a second, not two).
    pub fn tick(&mut self, now_ms: u64) -> Vec<InstanceLoad> {
        let tables = &self.tables;
        let columns = &mut self.columns;
        columns.maintain_lease(tables, now_ms);
        columns.refresh_leases(tables);
        self.registry.keep_configured(tables, columns, now_ms);
        let mut in_use = Vec::new();
        self.registry.scan_on_tick(tables, now_ms, |slot, record| {
            if columns.needs_repair(tables, slot, record, now_ms) {
                columns.repair(tables, slot, now_ms);
            }
            in_use.push((slot, record.clone()));
        });
        columns.drop_idle();
        if self.engine_view.is_some() {
            let slots: Vec<u16> = in_use.iter().map(|(slot, _)| *slot).collect();
            self.refresh_engine_copies(&slots, now_ms);
        }
        in_use
            .into_iter()
            .map(|(slot, record)| InstanceLoad {
                fresh: self.registry.is_fresh(&record, now_ms),
                in_flight: self.columns.total(&self.tables, slot, &record, now_ms),
                address: record.address,
            })
            .collect()
    }

    /// Every registered instance with its in-flight count, for the gauges.
    pub fn snapshot(&mut self, now_ms: u64) -> Vec<InstanceLoad> {
        let mut loads = Vec::new();
        for slot in 0..self.registry.max_instances() {
            let record = self.registry.read(&self.tables, slot).record;
            if record.is_free() {
                continue;
            }
            let in_flight = self.columns.total(&self.tables, slot, &record, now_ms);
            loads.push(InstanceLoad {
                fresh: self.registry.is_fresh(&record, now_ms),
                address: record.address,
                in_flight,
            });
        }
        loads
    }
}

impl<S: SharedStore> LoadView for LoadTracker<S> {
    fn target_of(&mut self, key: &str, now_ms: u64) -> Option<Target> {
        let entry = self.learned.lookup(&self.tables, key_hash(key), now_ms)?;
        if entry.slot >= self.registry.max_instances() {
            return None;
        }
        let read = self.registry.read(&self.tables, entry.slot);
        let valid = addr_hash(&read.record.address) == entry.addr_hash
            && self.registry.is_fresh(&read.record, now_ms);
        if !valid {
            return None;
        }
        let address = read.record.address.as_str().into();
        self.registry.remember_read(entry.slot, now_ms, read);
        Some(Target {
            instance: InstanceRef::new(entry.slot, address),
        })
    }

    fn route_blind(&mut self, key: &str, now_ms: u64) -> Option<Target> {
        // Mark first, then look again: either this lookup sees a target a
        // worker learned meanwhile, or that worker's claims see the mark.
        let hash = key_hash(key);
        self.learned
            .mark_pending(&self.tables, hash, Pending::Mark, now_ms);
        let target = self.target_of(key, now_ms)?;
        self.learned
            .mark_pending(&self.tables, hash, Pending::Withdraw, now_ms);
        Some(target)
    }

    fn claim(
        &mut self,
        instance: &InstanceRef,
        key: Option<&str>,
        cap: Option<u32>,
        now_ms: u64,
    ) -> Claim {
        if instance.slot >= self.registry.max_instances() {
            return Claim::Gone;
        }
        let count = cap.map_or(Count::Uncapped, |cap| {
            let pending = match key.map(key_hash) {
                Some(hash) if self.learned.may_have_pending(hash, now_ms) => {
                    self.learned.pending_of(&self.tables, hash, now_ms)
                }
                _ => 0,
            };
            Count::Capped(Limit { cap, pending })
        });
        let read = self.registry.take_recent(instance.slot, now_ms);
        let claim = self.columns.add(
            &self.tables,
            instance.slot,
            &instance.address,
            count,
            read,
            now_ms,
        );
        if !matches!(claim, Claim::Claimed(_)) {
            // Refused: the count (or the slot) changed since this VM's copy
            // was read, most likely by another VM deciding now too, whose
            // other claims the copies miss as well: the next choices read
            // the records again.
            self.registry.outdate_copies();
        }
        claim
    }

    fn candidates(&mut self, now_ms: u64) -> Vec<Candidate> {
        self.fresh_candidates(now_ms)
    }

    fn longest_held(&mut self, chain: &[u64], candidates: &[Candidate], now_ms: u64) -> HeldPrefix {
        self.index_session.begin(chain, now_ms);
        let live = LiveHolders::of(candidates);
        let held = self.index.longest_held(
            &self.tables,
            chain,
            &|e| live.believes(e),
            &mut self.index_session.reads,
        );
        HeldPrefix {
            blocks: held.blocks,
            holders: held.holders.iter().map(|h| h.slot).collect(),
        }
    }

    fn remember_held(
        &mut self,
        chain: &[u64],
        known: usize,
        instance: &InstanceRef,
        candidates: &[Candidate],
        now_ms: u64,
    ) -> Option<u32> {
        self.index_session.begin(chain, now_ms);
        let live = LiveHolders::of(candidates);
        let holder = holder_of(instance);
        let last_used = self.index.last_used(
            &self.tables,
            chain,
            known,
            holder,
            &mut self.index_session.reads,
        );
        self.remember_chain(chain, known, holder, &live, now_ms);
        last_used
    }
}

/// One prompt's use of the prefix index in one callback: the buckets its
/// lookups read (its recording writes over them instead of reading them
/// again). Whatever another prompt, or the same prompt at another
/// millisecond, left here is dropped first; a lookup of part of the prompt
/// (its system messages) is the same prompt's.
#[derive(Debug, Default)]
struct IndexSession {
    /// When, and the longest chain of the prompt these are for.
    prompt: Option<(u64, Vec<u64>)>,
    reads: BucketReads,
}

/// The holders of the live instances and their forget marks, by slot:
/// whether an index entry is believed takes one look-up, however large the
/// fleet.
#[derive(Debug, Default)]
struct LiveHolders {
    /// (tag, forget mark) by slot.
    marks: BySlot<(u16, u32)>,
}

impl LiveHolders {
    /// The prefix-index holders of `candidates` (the live instances).
    fn of(candidates: &[Candidate]) -> Self {
        let mut live = Self::default();
        for candidate in candidates {
            let holder = holder_of(&candidate.instance);
            live.marks
                .insert(holder.slot, (holder.tag, candidate.forgotten_through));
        }
        live
    }

    /// Its holder is live, and it was used after the holder's forget mark.
    fn believes(&self, entry: &PrefixEntry) -> bool {
        self.marks
            .get(entry.holder.slot)
            .is_some_and(|&(tag, mark)| tag == entry.holder.tag && entry.last_used > mark)
    }
}

impl IndexSession {
    fn begin(&mut self, chain: &[u64], now_ms: u64) {
        if let Some((at_ms, known)) = &mut self.prompt {
            if *at_ms == now_ms && known.starts_with(chain) {
                return;
            }
            if *at_ms == now_ms && chain.starts_with(known) {
                known.clear();
                known.extend_from_slice(chain);
                return;
            }
        }
        self.end();
        self.prompt = Some((now_ms, chain.to_vec()));
    }

    fn end(&mut self) {
        self.prompt = None;
        self.reads.clear();
    }
}

/// The prefix index's name for `instance`.
fn holder_of(instance: &InstanceRef) -> Holder {
    Holder::new(instance.slot, instance.addr_hash())
}

impl<S: SharedStore> LoadTracker<S> {
    /// Requests in flight on `instance` across all live worker VMs, fresh
    /// or not.
    pub fn in_flight(&mut self, instance: &InstanceRef, now_ms: u64) -> Option<u32> {
        let record = self
            .registry
            .record_for(&self.tables, instance.slot, &instance.address)?;
        Some(
            self.columns
                .total(&self.tables, instance.slot, &record, now_ms),
        )
    }

    /// LONGEST_PREFIX, at the response of a request Envoy placed (Maglev,
    /// no host override): records that the instance at `address` holds
    /// `chain`, if it is a fresh instance.
    pub fn remember_where_served(&mut self, chain: &[u64], address: &str, now_ms: u64) {
        let candidates = self.fresh_candidates(now_ms);
        let Some(served) = candidates.iter().find(|c| &*c.instance.address == address) else {
            return;
        };
        self.index_session.begin(chain, now_ms);
        let live = LiveHolders::of(&candidates);
        let holder = holder_of(&served.instance);
        let known = self
            .index
            .longest_held(
                &self.tables,
                chain,
                &|e| e.holder == holder && live.believes(e),
                &mut self.index_session.reads,
            )
            .blocks;
        self.remember_chain(chain, known, holder, &live, now_ms);
    }

    /// Records `chain` for `holder` (known to hold `known` blocks of it),
    /// over this prompt's reads, and ends its session.
    fn remember_chain(
        &mut self,
        chain: &[u64],
        known: usize,
        holder: Holder,
        live: &LiveHolders,
        now_ms: u64,
    ) {
        let written = self.index.remember(
            &self.tables,
            chain,
            known,
            holder,
            &|e| live.believes(e),
            now_ms,
            &mut self.index_session.reads,
        );
        self.index_session.end();
        self.index_writes.add(written);
    }

    /// [`LoadView::candidates`], with the configured instances registered,
    /// each weighed by its engine's sample where one is fresh.
    fn fresh_candidates(&mut self, now_ms: u64) -> Vec<Candidate> {
        self.registry
            .seed_configured(&self.tables, &mut self.columns, now_ms);
        self.registry.rescan_if_changed(&self.tables, now_ms);
        let mut candidates = self
            .registry
            .candidates(&self.tables, &mut self.columns, now_ms);
        if let Some(view) = self.engine_view {
            let last = self.engine_copies_read_again(
                candidates.iter().map(|c| c.instance.slot),
                view.max_age_ms,
                now_ms,
            );
            for candidate in &mut candidates {
                self.weigh(candidate, view, now_ms, last);
            }
        }
        candidates
    }

    /// Weighs `candidate` by its engine's sample, if one is fresh; an
    /// expired copy ordered after `last_read_again` stands.
    fn weigh(
        &mut self,
        candidate: &mut Candidate,
        view: EngineView,
        now_ms: u64,
        last_read_again: Option<(u64, u16)>,
    ) {
        let sample = self.engine_sample_within(
            &candidate.instance,
            view.max_age_ms,
            now_ms,
            last_read_again,
        );
        let Some(sample) = sample else {
            return;
        };
        candidate.load = sample.estimated_requests(candidate.in_flight);
        candidate.engine_room = sample.room(&view.bounds, candidate.in_flight);
        candidate.over_bounds = sample.over(&view.bounds, candidate.in_flight);
        candidate.served = sample.served;
        candidate.active_adapters = sample.active_adapters;
    }
}

#[cfg(test)]
mod index_session_tests {
    use std::rc::Rc;

    use super::registry::RECORD_CACHE_MS;
    use super::*;
    use crate::shared::MemoryStore;

    const A: &str = "10.0.0.1:8000";
    const B: &str = "10.0.0.2:8000";
    const NOW: u64 = 1_700_000_000_000;

    /// A worker's tracker over `store`, having seen A and B serve.
    fn tracker(store: &Rc<MemoryStore>, vm_nonce: u64) -> LoadTracker<Rc<MemoryStore>> {
        tracker_serving(store, vm_nonce, &[A, B])
    }

    /// A worker's tracker over `store`, having seen each of `addresses` serve.
    fn tracker_serving(
        store: &Rc<MemoryStore>,
        vm_nonce: u64,
        addresses: &[&str],
    ) -> LoadTracker<Rc<MemoryStore>> {
        let mut tracker = LoadTracker::new(Rc::clone(store), LoadConfig::default(), vm_nonce);
        for &address in addresses {
            let start = UpstreamStart {
                address,
                key: None,
                overridden: false,
                counted: None,
            };
            if let Some(ticket) = tracker.upstream_started(start, NOW) {
                tracker.release(ticket, NOW);
            }
        }
        tracker
    }

    /// 16 blocks: 4 spans, whose first blocks fall in 4 distinct buckets.
    fn chain(salt: u64) -> Vec<u64> {
        (1..=16u64)
            .map(|k| xxh3_64_with_seed(&k.to_le_bytes(), salt))
            .collect()
    }

    fn named<'a>(candidates: &'a [Candidate], address: &str) -> &'a Candidate {
        candidates
            .iter()
            .find(|c| &*c.instance.address == address)
            .expect("a known instance")
    }

    #[test]
    fn a_claim_right_after_the_candidates_reuses_their_read_once() {
        let store = Rc::new(MemoryStore::new());
        let mut tracker = tracker(&store, 1);
        let candidates = tracker.candidates(NOW);
        let b = named(&candidates, B).instance.clone();
        let (reads, writes) = (store.reads(), store.successful_sets());
        let Claim::Claimed(first) = tracker.claim(&b, None, Some(5), NOW) else {
            panic!("room on B");
        };
        assert_eq!(
            (store.reads() - reads, store.successful_sets() - writes),
            (0, 1),
            "the candidates' read of B, then one write"
        );
        // The reads are used up: the next claim reads B's record again,
        // with the first claim's count in it.
        let reads = store.reads();
        let Claim::Claimed(second) = tracker.claim(&b, None, Some(5), NOW) else {
            panic!("room on B");
        };
        assert_eq!(store.reads() - reads, 1);
        assert_eq!(tracker.in_flight(&b, NOW), Some(2));
        // A read of another millisecond is not reused.
        tracker.candidates(NOW);
        let reads = store.reads();
        let Claim::Claimed(third) = tracker.claim(&b, None, Some(5), NOW + 1) else {
            panic!("room on B");
        };
        assert_eq!(store.reads() - reads, 1);
        for ticket in [first, second, third] {
            tracker.release(ticket, NOW + 1);
        }
        assert_eq!(tracker.in_flight(&b, NOW + 1), Some(0));
    }

    #[test]
    fn decisions_read_records_once_per_window_and_see_their_own_claims_at_once() {
        let store = Rc::new(MemoryStore::new());
        let (mut vm_a, mut vm_b) = (tracker(&store, 1), tracker(&store, 2));
        let load_on = |vm: &mut LoadTracker<Rc<MemoryStore>>, address, now| {
            named(&vm.candidates(now), address).in_flight
        };
        vm_a.candidates(NOW);
        let reads = store.reads();
        let candidates = vm_a.candidates(NOW + 1);
        assert_eq!(store.reads(), reads, "no read within the window");
        // Its own claim: seen at once, from the copy.
        let b = named(&candidates, B).instance.clone();
        let Claim::Claimed(own) = vm_a.claim(&b, None, Some(5), NOW + 1) else {
            panic!("room on B");
        };
        assert_eq!(load_on(&mut vm_a, B, NOW + 2), 1);
        // Its upstream filter finds the decision's count there: no read.
        let reads = store.reads();
        let counted = UpstreamStart {
            address: B,
            key: None,
            overridden: true,
            counted: Some(B),
        };
        assert!(vm_a.upstream_started(counted, NOW + 2).is_none());
        assert_eq!(store.reads(), reads, "the copy's slot and last seen");
        // Another VM's claim: seen once the copy is RECORD_CACHE_MS old.
        let a = named(&candidates, A).instance.clone();
        let Claim::Claimed(other) = vm_b.claim(&a, None, Some(5), NOW + 2) else {
            panic!("room on A");
        };
        assert_eq!(load_on(&mut vm_a, A, NOW + 3), 0, "the copy of NOW");
        assert_eq!(load_on(&mut vm_a, A, NOW + RECORD_CACHE_MS), 1);
        // A claim that finds a count moved since the copy outdates every copy,
        // so the next choice sees the counts at once.
        let (mut vm_c, mut vm_d) = (tracker(&store, 3), tracker(&store, 4));
        assert_eq!(load_on(&mut vm_c, A, NOW + 10), 1);
        let Claim::Claimed(moved) = vm_d.claim(&a, None, Some(5), NOW + 10) else {
            panic!("room on A");
        };
        assert!(matches!(
            vm_c.claim(&a, None, Some(2), NOW + 11),
            Claim::Full { .. }
        ));
        assert_eq!(load_on(&mut vm_c, A, NOW + 11), 2);
        vm_a.release(own, NOW + 12);
        vm_b.release(other, NOW + 12);
        vm_d.release(moved, NOW + 12);
        // A clock gone back leaves no copy standing.
        vm_a.candidates(NOW + 1_000);
        let reads = store.reads();
        vm_a.candidates(NOW + 500);
        assert!(store.reads() > reads, "read again");
    }

    /// A worker's tracker over `store`, having seen `instances` instances
    /// serve (`10.0.1.<i>:8000`).
    fn fleet_tracker(
        store: &Rc<MemoryStore>,
        vm_nonce: u64,
        instances: u16,
    ) -> LoadTracker<Rc<MemoryStore>> {
        let addresses: Vec<String> = (0..instances).map(|i| format!("10.0.1.{i}:8000")).collect();
        let addresses: Vec<&str> = addresses.iter().map(String::as_str).collect();
        tracker_serving(store, vm_nonce, &addresses)
    }

    #[test]
    fn a_decision_over_a_large_fleet_reads_a_bounded_number_of_expired_copies() {
        use super::registry::RECORD_READS_PER_DECISION;
        let store = Rc::new(MemoryStore::new());
        let mut vm = fleet_tracker(&store, 1, 20);
        assert_eq!(vm.candidates(NOW).len(), 20);
        // Expired copies: the oldest RECORD_READS_PER_DECISION are read again
        // per decision (the first also reads the registry epoch), so in three
        // decisions every record is read again once.
        let mut now = NOW + RECORD_CACHE_MS;
        let budget = RECORD_READS_PER_DECISION as u64;
        for expected in [1 + budget, budget, 20 - 2 * budget] {
            let reads = store.reads();
            assert_eq!(
                vm.candidates(now).len(),
                20,
                "every instance, copies or not"
            );
            assert_eq!(store.reads() - reads, expected, "at {now}");
            now += 1;
        }
        // Another VM's claims on every instance: the copies that stand miss
        // them until they are read again...
        let mut other = fleet_tracker(&store, 2, 20);
        let instances: Vec<InstanceRef> = other
            .candidates(now)
            .into_iter()
            .map(|c| c.instance)
            .collect();
        let tickets: Vec<Ticket> = instances
            .iter()
            .map(|instance| match other.claim(instance, None, Some(5), now) {
                Claim::Claimed(ticket) => ticket,
                claim => panic!("room on {}: {claim:?}", instance.address),
            })
            .collect();
        now += RECORD_CACHE_MS;
        let seen = |vm: &mut LoadTracker<Rc<MemoryStore>>, now| {
            vm.candidates(now)
                .iter()
                .filter(|c| c.in_flight == 1)
                .count()
        };
        assert_eq!(seen(&mut vm, now), RECORD_READS_PER_DECISION);
        // ... or the tick reads them all, and its copies stand for a window.
        vm.tick(now + 1);
        let reads = store.reads();
        assert_eq!(seen(&mut vm, now + 2), 20);
        assert_eq!(store.reads() - reads, 0, "the tick's copies");
        // A refused claim outdates every copy; the next decisions read them
        // again within the budget too.
        let first = &instances[0];
        assert!(matches!(
            vm.claim(first, None, Some(1), now + 3),
            Claim::Full { .. }
        ));
        let reads = store.reads();
        vm.candidates(now + 3);
        assert_eq!(
            store.reads() - reads,
            budget,
            "outdated copies, the epoch read lately"
        );
        for ticket in tickets {
            other.release(ticket, now + 4);
        }
    }

    #[test]
    fn a_copy_stands_for_its_window_and_never_for_a_clock_gone_back() {
        assert!(copy_is_fresh(1_000, 1_000, 5));
        assert!(copy_is_fresh(1_000, 1_004, 5));
        assert!(!copy_is_fresh(1_000, 1_005, 5));
        assert!(!copy_is_fresh(1_000, 999, 5));
        assert!(!copy_is_fresh(1_000, 0, 5));
    }

    #[test]
    fn a_decision_reads_each_bucket_once_and_the_next_one_reads_again() {
        let store = Rc::new(MemoryStore::new());
        let mut tracker = tracker(&store, 1);
        let prompt = chain(7);
        let candidates = tracker.candidates(NOW);
        let a = named(&candidates, A).clone();
        let reads = store.reads();
        let held = tracker.longest_held(&prompt, &candidates, NOW);
        assert_eq!(held, HeldPrefix::default());
        assert_eq!(store.reads() - reads, 3, "the last span, then log2(4)");
        // The decision's second lookup, for the instance it chose: no read.
        let reads = store.reads();
        assert_eq!(
            tracker
                .longest_held(&prompt, std::slice::from_ref(&a), NOW)
                .blocks,
            0
        );
        assert_eq!(store.reads(), reads);
        // Its recording reads only the one bucket no lookup read.
        let (reads, writes) = (store.reads(), store.successful_sets());
        tracker.remember_held(&prompt, 0, &a.instance, &candidates, NOW);
        assert_eq!(
            (store.reads() - reads, store.successful_sets() - writes),
            (1, 4)
        );
        // The next decision, a millisecond later, reads the index again.
        let reads = store.reads();
        let held = tracker.longest_held(&prompt, &candidates, NOW + 1);
        assert_eq!(held.blocks, 16);
        assert_eq!(held.holders, vec![a.instance.slot]);
        assert_eq!(store.reads() - reads, 1);
    }

    #[test]
    fn a_lookup_of_part_of_the_prompt_keeps_the_prompts_reads_and_another_prompt_drops_them() {
        let store = Rc::new(MemoryStore::new());
        let mut tracker = tracker(&store, 1);
        let prompt = chain(7);
        let candidates = tracker.candidates(NOW);
        let a = named(&candidates, A).clone();
        tracker.remember_held(&prompt, 0, &a.instance, &candidates, NOW);
        // A decision reads the last span, then its system messages' (the
        // first 5 blocks: another bucket), and records the whole prompt
        // without reading the last span again.
        let reads = store.reads();
        assert_eq!(
            tracker.longest_held(&prompt, &candidates, NOW + 1).blocks,
            16
        );
        let system = &prompt[..5];
        assert_eq!(tracker.longest_held(system, &candidates, NOW + 1).blocks, 5);
        assert_eq!(store.reads() - reads, 2);
        let reads = store.reads();
        tracker.remember_held(&prompt, 16, &a.instance, &candidates, NOW + 1);
        assert_eq!(store.reads(), reads, "the session kept the last span");
        // Another prompt in the same millisecond reads for itself, and the
        // first prompt's reads are gone.
        assert_eq!(
            tracker.longest_held(&chain(8), &candidates, NOW + 1).blocks,
            0
        );
        let reads = store.reads();
        assert_eq!(tracker.longest_held(system, &candidates, NOW + 1).blocks, 5);
        assert_eq!(store.reads() - reads, 1);
    }

    #[test]
    fn a_later_decision_sees_what_another_vm_recorded_after_the_last_one() {
        let store = Rc::new(MemoryStore::new());
        let (mut vm_a, mut vm_b) = (tracker(&store, 1), tracker(&store, 2));
        let prompt = chain(8);
        let candidates = vm_a.candidates(NOW);
        // A decides without recording (Maglev), B records the prompt on B.
        assert_eq!(vm_a.longest_held(&prompt, &candidates, NOW).blocks, 0);
        vm_b.remember_where_served(&prompt, B, NOW);
        let held = vm_a.longest_held(&prompt, &candidates, NOW + 1);
        assert_eq!(
            (held.blocks, held.holders),
            (16, vec![named(&candidates, B).instance.slot])
        );
    }

    #[test]
    fn a_recording_over_reads_another_vm_wrote_since_loses_nothing() {
        let store = Rc::new(MemoryStore::new());
        let (mut vm_a, mut vm_b) = (tracker(&store, 1), tracker(&store, 2));
        let prompt = chain(9);
        // VM A decides (Maglev: nothing recorded yet) and keeps its reads;
        // VM B records the same prompt on B meanwhile; then A's response
        // records it on A, in the same millisecond, over A's old reads.
        let candidates = vm_a.candidates(NOW);
        assert_eq!(vm_a.longest_held(&prompt, &candidates, NOW).blocks, 0);
        vm_b.remember_where_served(&prompt, B, NOW);
        vm_a.remember_where_served(&prompt, A, NOW);
        let later = vm_b.candidates(NOW + 1);
        let mut held = vm_b.longest_held(&prompt, &later, NOW + 1);
        held.holders.sort_unstable();
        let mut both = vec![
            named(&candidates, A).instance.slot,
            named(&candidates, B).instance.slot,
        ];
        both.sort_unstable();
        assert_eq!((held.blocks, held.holders), (16, both));
    }
}
