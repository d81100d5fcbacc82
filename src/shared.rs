//! The proxy-wasm shared-data contract, as a trait, so the load accounting can be
//! written and tested natively (and two worker VMs simulated on one store).
//!
//! Semantics mirror Envoy's shared data (one process-wide map per `vm_id`):
//! `get` returns the value and its CAS token; `set` with a token fails with
//! [`SetError::CasMismatch`] if the value changed since; a `set` without a token
//! (or with token 0) overwrites unconditionally; a `set` on a missing key ignores
//! the token. There is no delete and no TTL, and no "create if missing": a
//! table's first write is [`SharedStore::create`], which never overwrites.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

/// Why a [`SharedStore::set`] did not happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetError {
    /// The value changed since the `get` that produced the token: read again.
    CasMismatch,
    /// The host refused for another reason (treated as "not written").
    Failed,
}

/// The token [`SharedStore::create`] writes with. On a missing key Envoy
/// ignores the token and creates the value; on an existing key it refuses
/// every token but the entry's own. Envoy's tokens count up from 1 across all
/// keys, so an entry holds this one for one write in 2^32.
pub const CREATE_ONLY_CAS: u32 = u32::MAX;

/// One shared key-value map with compare-and-swap, as proxy-wasm offers it.
pub trait SharedStore {
    /// The value and its CAS token, or `(None, None)` if the key was never set.
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes `value`; with `cas: Some(token)` only if the value is unchanged.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError>;

    /// Writes `value` only if `key` is missing: [`SetError::CasMismatch`] if
    /// it exists (another VM created it since it was read as missing: read
    /// again). A plain `set` without a token there would wipe that VM's write
    /// (seen: two workers marking a new key's first requests pending at once
    /// kept one mark, and the target took one request past its cap).
    fn create(&self, key: &str, value: &[u8]) -> Result<(), SetError> {
        self.set(key, value, Some(CREATE_ONLY_CAS))
    }

    /// Writes `value` over what a `get` returned with token `read`: by CAS if
    /// the key existed, by [`SharedStore::create`] if it was missing.
    fn replace(&self, key: &str, value: &[u8], read: Option<u32>) -> Result<(), SetError> {
        match read {
            Some(cas) => self.set(key, value, Some(cas)),
            None => self.create(key, value),
        }
    }
}

impl<T: SharedStore + ?Sized> SharedStore for &T {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        (**self).get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        (**self).set(key, value, cas)
    }
}

impl<T: SharedStore + ?Sized> SharedStore for Rc<T> {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        (**self).get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        (**self).set(key, value, cas)
    }
}

/// An in-memory [`SharedStore`] with Envoy's semantics, for tests. Share it
/// between several simulated worker VMs through `Rc<MemoryStore>` or `&MemoryStore`.
#[derive(Debug, Default)]
pub struct MemoryStore {
    entries: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    last_cas: Cell<u32>,
    sets: Cell<u64>,
    gets: Cell<u64>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of keys ever written (the store never shrinks, like Envoy's).
    pub fn len(&self) -> usize {
        self.entries.borrow().len()
    }

    /// True if nothing was ever written.
    pub fn is_empty(&self) -> bool {
        self.entries.borrow().is_empty()
    }

    /// All keys, sorted (for bound checks in tests).
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.entries.borrow().keys().cloned().collect();
        keys.sort();
        keys
    }

    /// Number of successful writes so far.
    pub fn successful_sets(&self) -> u64 {
        self.sets.get()
    }

    /// Number of reads so far (each one a host call in Envoy).
    pub fn reads(&self) -> u64 {
        self.gets.get()
    }

    fn next_cas(&self) -> u32 {
        // Envoy's tokens are never 0 (0 means "no check").
        let next = self.last_cas.get().wrapping_add(1).max(1);
        self.last_cas.set(next);
        next
    }
}

impl SharedStore for MemoryStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.gets.set(self.gets.get() + 1);
        match self.entries.borrow().get(key) {
            Some((value, cas)) => (Some(value.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        let next = self.next_cas();
        let mut entries = self.entries.borrow_mut();
        if let Some((_, current)) = entries.get(key) {
            if let Some(expected) = cas {
                if expected != 0 && expected != *current {
                    return Err(SetError::CasMismatch);
                }
            }
        }
        entries.insert(key.to_string(), (value.to_vec(), next));
        self.sets.set(self.sets.get() + 1);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_writes_a_missing_key_and_never_overwrites() {
        let store = MemoryStore::new();
        store.create("k", b"first").unwrap();
        assert_eq!(store.get("k").0.as_deref(), Some(&b"first"[..]));
        store.set("k", b"theirs", None).unwrap();
        assert_eq!(store.create("k", b"empty"), Err(SetError::CasMismatch));
        assert_eq!(store.get("k").0.as_deref(), Some(&b"theirs"[..]));
    }

    #[test]
    fn replace_writes_over_what_was_read_or_creates_what_was_missing() {
        let store = MemoryStore::new();
        let (_, missing) = store.get("k");
        store.replace("k", b"first", missing).unwrap();
        // Read as missing, but created since: not overwritten.
        assert_eq!(
            store.replace("k", b"late", missing),
            Err(SetError::CasMismatch)
        );
        let (_, read) = store.get("k");
        store.replace("k", b"second", read).unwrap();
        assert_eq!(
            store.replace("k", b"stale", read),
            Err(SetError::CasMismatch)
        );
        assert_eq!(store.get("k").0.as_deref(), Some(&b"second"[..]));
    }

    #[test]
    fn missing_key_reads_as_nothing() {
        let store = MemoryStore::new();
        assert_eq!(store.get("a"), (None, None));
        assert!(store.is_empty());
    }

    #[test]
    fn stale_token_is_refused_and_fresh_one_accepted() {
        let store = MemoryStore::new();
        store.set("a", b"1", None).unwrap();
        let (_, first) = store.get("a");
        store.set("a", b"2", first).unwrap();
        assert_eq!(store.set("a", b"3", first), Err(SetError::CasMismatch));
        let (value, second) = store.get("a");
        assert_eq!(value.as_deref(), Some(&b"2"[..]));
        assert_ne!(first, second);
        store.set("a", b"3", second).unwrap();
        assert_eq!(store.get("a").0.as_deref(), Some(&b"3"[..]));
    }

    #[test]
    fn missing_key_ignores_token_and_no_token_overwrites() {
        let store = MemoryStore::new();
        store.set("a", b"1", Some(12345)).unwrap();
        store.set("a", b"2", None).unwrap();
        store.set("a", b"3", Some(0)).unwrap();
        assert_eq!(store.get("a").0.as_deref(), Some(&b"3"[..]));
        assert_eq!(store.successful_sets(), 3);
    }

    #[test]
    fn shared_through_rc_between_two_users() {
        let store = Rc::new(MemoryStore::new());
        let (a, b) = (Rc::clone(&store), Rc::clone(&store));
        a.set("k", b"from-a", None).unwrap();
        assert_eq!(b.get("k").0.as_deref(), Some(&b"from-a"[..]));
        assert_eq!(store.keys(), vec!["k".to_string()]);
    }
}
