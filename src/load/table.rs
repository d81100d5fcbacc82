//! The one way a shared-data record is changed: read it, apply a pure
//! mutation to the decoded copy, write it back by compare-and-swap on the
//! token of that read, and read again when another VM wrote in between, at
//! most [`LoadConfig::cas_attempts`](super::LoadConfig) times.
//!
//! Why one helper: every table had its own retry loop, and two ways of
//! creating a missing key; one of them, a plain write over a key read as
//! missing, wiped the first mark another worker had just created (see
//! [`SharedStore::create`]). Here a missing key is created exactly one way:
//! the mutation sees the default record, and the result is written with
//! [`SharedStore::create`], which never overwrites; if another VM created
//! the key first, the attempt counts as contended and the next one starts
//! from their record.
//!
//! A value that does not decode (corrupt, truncated, or written by a build
//! with another layout) reads as the default record, with the token of what
//! was read: the mutation may then replace it, by compare-and-swap over
//! exactly those bytes. A table is never wedged by garbage, and a garbage
//! value changed by another VM meanwhile is not overwritten blindly.

use std::fmt;

use crate::shared::{SetError, SharedStore};

/// A value kept under one shared-data key, in a fixed binary encoding.
pub(crate) trait Record: Default {
    fn encode(&self) -> Vec<u8>;
    /// None for bytes this layout did not write: corrupt, truncated or foreign.
    fn decode(bytes: &[u8]) -> Option<Self>;
}

/// A record as read, with the token a write over it must present.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Read<R> {
    /// The record; the default one if the key is missing or does not decode.
    pub(crate) record: R,
    /// The CAS token; None: the key was missing (a write creates it).
    cas: Option<u32>,
}

impl<R> Read<R> {
    /// The key held a value (or the host read failed: then it reads as missing).
    pub(crate) fn exists(&self) -> bool {
        self.cas.is_some()
    }
}

/// What a mutation decided about the record it was shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change<W, K = W> {
    /// Write the mutated record; `W` is the result once it is written.
    Write(W),
    /// Write nothing (already as wanted, or not to be changed: the update
    /// ends here); `K` is the result at once. The mutated copy is dropped.
    Keep(K),
}

/// What [`Tables::update`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Updated<W, K = W> {
    /// The mutated record was written, over the read the mutation saw.
    Written(W),
    /// The mutation chose [`Change::Keep`]; nothing was written.
    Kept(K),
    /// Nothing was written: the host refused, or another VM wrote between
    /// the read and the write on every attempt.
    Failed,
}

/// The shared store as this VM's tables see it: the store, the namespace
/// every key lives under, and the bound of compare-and-swap attempts.
#[derive(Debug)]
pub(crate) struct Tables<S> {
    store: S,
    prefix: String,
    attempts: u32,
}

/// The shared data's layout, part of every key. Shared data outlives a
/// module swapped in without restarting Envoy (same `vm_id`), so a change of
/// what records mean takes a new layout rather than reading the old one's:
/// `v2` stamps times by Envoy's monotonic clock (`v1`'s wall-clock stamps
/// would read as ages of zero for ever) and records when an instance became
/// suspect; `v3` has 256 instance slots where `v2` had 64, so an address
/// probes from another slot.
pub(crate) const LAYOUT: &str = "v3";

impl<S: SharedStore> Tables<S> {
    /// Keys are `prefix-router/<namespace>/<LAYOUT>/<path>`; `attempts` (at
    /// least one) bounds every update.
    pub(crate) fn new(store: S, namespace: &str, attempts: u32) -> Self {
        Self {
            store,
            prefix: format!("prefix-router/{namespace}/{LAYOUT}"),
            attempts: attempts.max(1),
        }
    }

    /// The shared-data key of `path` in this namespace.
    pub(crate) fn key(&self, path: fmt::Arguments<'_>) -> String {
        format!("{}/{path}", self.prefix)
    }

    /// The record under `key` (the default one if missing or undecodable).
    pub(crate) fn read<R: Record>(&self, key: &str) -> Read<R> {
        let (value, cas) = self.store.get(key);
        let record = value.as_deref().and_then(R::decode).unwrap_or_default();
        Read { record, cas }
    }

    /// Changes the record under `key`: `mutate` sees a fresh copy of it on
    /// every attempt and says whether to write it (see the module docs).
    pub(crate) fn update<R: Record, W, K>(
        &self,
        key: &str,
        mutate: impl FnMut(&mut R) -> Change<W, K>,
    ) -> Updated<W, K> {
        self.update_from(key, None, mutate)
    }

    /// [`Tables::update`] whose first attempt starts from `first`, a read of
    /// `key` the caller already made (one shared-data read fewer). Safe
    /// however old it is: a write over it is a compare-and-swap on its token.
    pub(crate) fn update_from<R: Record, W, K>(
        &self,
        key: &str,
        mut first: Option<Read<R>>,
        mut mutate: impl FnMut(&mut R) -> Change<W, K>,
    ) -> Updated<W, K> {
        for _ in 0..self.attempts {
            let Read { mut record, cas } = first.take().unwrap_or_else(|| self.read(key));
            let result = match mutate(&mut record) {
                Change::Keep(result) => return Updated::Kept(result),
                Change::Write(result) => result,
            };
            // `replace` creates a key read as missing, never over another VM's.
            match self.store.replace(key, &record.encode(), cas) {
                Ok(()) => return Updated::Written(result),
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Failed) => return Updated::Failed,
            }
        }
        Updated::Failed
    }
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};

    use super::*;
    use crate::shared::MemoryStore;

    /// A counter record: one little-endian u32, nothing else.
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    struct Counter(u32);

    impl Record for Counter {
        fn encode(&self) -> Vec<u8> {
            self.0.to_le_bytes().to_vec()
        }
        fn decode(bytes: &[u8]) -> Option<Self> {
            Some(Counter(u32::from_le_bytes(bytes.try_into().ok()?)))
        }
    }

    const KEY: &str = "prefix-router/t/v1/counter";

    /// What another VM does to the store.
    type OtherVm<'a> = Box<dyn FnOnce(&MemoryStore) + 'a>;

    /// A store that runs `between` right after the `at`-th read (1-based):
    /// another VM acting between our read and our write.
    struct Interleaved<'a> {
        inner: &'a MemoryStore,
        reads: Cell<u32>,
        at: u32,
        between: RefCell<Option<OtherVm<'a>>>,
        /// Answer `Failed` to every write (a host refusal).
        refuse: bool,
    }

    impl<'a> Interleaved<'a> {
        fn new(inner: &'a MemoryStore, at: u32, between: impl FnOnce(&MemoryStore) + 'a) -> Self {
            Self {
                inner,
                reads: Cell::new(0),
                at,
                between: RefCell::new(Some(Box::new(between))),
                refuse: false,
            }
        }
    }

    impl SharedStore for Interleaved<'_> {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            let read = self.inner.get(key);
            self.reads.set(self.reads.get() + 1);
            if self.reads.get() == self.at {
                if let Some(between) = self.between.borrow_mut().take() {
                    between(self.inner);
                }
            }
            read
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
            if self.refuse {
                return Err(SetError::Failed);
            }
            self.inner.set(key, value, cas)
        }
    }

    fn stored(store: &MemoryStore) -> Option<Counter> {
        store.get(KEY).0.as_deref().and_then(Counter::decode)
    }

    fn increment(counter: &mut Counter) -> Change<u32> {
        counter.0 += 1;
        Change::Write(counter.0)
    }

    #[test]
    fn keys_live_under_the_namespace() {
        let tables = Tables::new(MemoryStore::new(), "ns", 4);
        assert_eq!(
            tables.key(format_args!("inst/{}", 3)),
            "prefix-router/ns/v3/inst/3"
        );
    }

    #[test]
    fn a_missing_key_is_created_from_the_default_record() {
        let store = MemoryStore::new();
        let tables = Tables::new(&store, "t", 4);
        assert_eq!(tables.read::<Counter>(KEY).cas, None);
        assert_eq!(tables.update(KEY, increment), Updated::Written(1));
        assert_eq!(stored(&store), Some(Counter(1)));
        assert_eq!(tables.update(KEY, increment), Updated::Written(2));
        assert_eq!(
            (store.reads(), store.successful_sets()),
            (4, 2),
            "one read each"
        );
    }

    #[test]
    fn another_write_between_our_read_and_our_write_is_kept_and_we_retry_on_it() {
        let store = MemoryStore::new();
        store.set(KEY, &Counter(10).encode(), None).unwrap();
        let racing = Interleaved::new(&store, 1, |inner| {
            inner.set(KEY, &Counter(20).encode(), None).unwrap();
        });
        let tables = Tables::new(&racing, "t", 4);
        let mut seen = Vec::new();
        let updated = tables.update(KEY, |c: &mut Counter| {
            seen.push(c.0);
            increment(c)
        });
        assert_eq!(updated, Updated::Written(21));
        assert_eq!(seen, vec![10, 20], "the mutation ran again on their value");
        assert_eq!(stored(&store), Some(Counter(21)));
    }

    #[test]
    fn a_key_another_vm_creates_after_we_read_it_missing_is_not_overwritten() {
        let store = MemoryStore::new();
        let racing = Interleaved::new(&store, 1, |inner| {
            inner.create(KEY, &Counter(5).encode()).unwrap();
        });
        let tables = Tables::new(&racing, "t", 4);
        let mut seen = Vec::new();
        let updated = tables.update(KEY, |c: &mut Counter| {
            seen.push(c.0);
            increment(c)
        });
        assert_eq!(seen, vec![0, 5], "read missing, then theirs");
        assert_eq!(updated, Updated::Written(6), "their first write counted");
        assert_eq!(stored(&store), Some(Counter(6)));
    }

    #[test]
    fn attempts_are_bounded_when_another_vm_wins_every_time() {
        let store = MemoryStore::new();
        store.set(KEY, &Counter(0).encode(), None).unwrap();
        let tables = Tables::new(&store, "t", 3);
        let mut runs = 0;
        let updated = tables.update(KEY, |c: &mut Counter| {
            runs += 1;
            // Another VM writes after every read of ours.
            store.set(KEY, &Counter(100 + runs).encode(), None).unwrap();
            increment(c)
        });
        assert_eq!(updated, Updated::Failed);
        assert_eq!(runs, 3);
        assert_eq!(stored(&store), Some(Counter(103)), "theirs stands");
        assert_eq!(Tables::new(&store, "t", 0).attempts, 1, "at least one");
    }

    #[test]
    fn a_refused_write_fails_at_once() {
        let store = MemoryStore::new();
        let mut refusing = Interleaved::new(&store, 0, |_| {});
        refusing.refuse = true;
        let tables = Tables::new(&refusing, "t", 5);
        let mut runs = 0;
        let updated = tables.update(KEY, |c: &mut Counter| {
            runs += 1;
            increment(c)
        });
        assert_eq!((updated, runs), (Updated::Failed, 1));
        assert_eq!(stored(&store), None);
    }

    #[test]
    fn keep_writes_nothing_and_returns_at_once() {
        let store = MemoryStore::new();
        store.set(KEY, &Counter(7).encode(), None).unwrap();
        let tables = Tables::new(&store, "t", 4);
        let writes = store.successful_sets();
        let updated = tables.update(KEY, |c: &mut Counter| -> Change<(), u32> {
            c.0 = 99;
            Change::Keep(c.0)
        });
        assert_eq!(updated, Updated::Kept(99));
        assert_eq!(store.successful_sets(), writes);
        assert_eq!(stored(&store), Some(Counter(7)), "the changed copy dropped");
        // A missing key left as it is stays missing.
        let missing = "prefix-router/t/v1/other";
        assert_eq!(
            tables.update(missing, |_: &mut Counter| Change::<(), _>::Keep(())),
            Updated::Kept(())
        );
        assert_eq!(store.get(missing), (None, None));
    }

    /// Garbage reads as the default record, and is replaced only by a
    /// compare-and-swap over exactly the garbage that was read.
    #[test]
    fn undecodable_bytes_read_as_the_default_and_are_replaced_by_cas() {
        let store = MemoryStore::new();
        store.set(KEY, b"not a counter", None).unwrap();
        let tables = Tables::new(&store, "t", 4);
        let read = tables.read::<Counter>(KEY);
        assert_eq!(read.record, Counter(0));
        assert!(read.cas.is_some(), "the key exists: no create");
        assert_eq!(tables.update(KEY, increment), Updated::Written(1));
        assert_eq!(stored(&store), Some(Counter(1)));

        // Other garbage written between our read and our write: retried.
        store.set(KEY, b"junk", None).unwrap();
        let racing = Interleaved::new(&store, 1, |inner| {
            inner.set(KEY, &Counter(40).encode(), None).unwrap();
        });
        let tables = Tables::new(&racing, "t", 4);
        assert_eq!(tables.update(KEY, increment), Updated::Written(41));
    }

    #[test]
    fn a_kept_read_saves_the_first_read_and_a_stale_one_is_retried() {
        let store = MemoryStore::new();
        store.set(KEY, &Counter(1).encode(), None).unwrap();
        let tables = Tables::new(&store, "t", 4);
        let first = tables.read::<Counter>(KEY);
        let reads = store.reads();
        assert_eq!(
            tables.update_from(KEY, Some(first.clone()), increment),
            Updated::Written(2)
        );
        assert_eq!(store.reads(), reads, "no read of its own");
        // `first` is stale now: its write fails by CAS, and the retry reads.
        assert_eq!(
            tables.update_from(KEY, Some(first), increment),
            Updated::Written(3)
        );
        assert_eq!(store.reads(), reads + 1);
        assert_eq!(stored(&store), Some(Counter(3)));
    }
}
