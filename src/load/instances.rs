//! One shared record per known instance: its address, when it was last seen
//! serving, and one in-flight cell per worker-VM column. A VM only ever changes
//! its own cell, and always to its own exact local count, so concurrent writers
//! never lose each other's counts (compare-and-swap on the whole record) and a
//! write that failed is simply repeated later with the then-current truth.

use super::codec::{Reader, Writer};
use super::table::Record;

const RECORD_VERSION: u8 = 4;

/// How long an instance Envoy did not use when it was nominated stays out of
/// the candidates. Then it is nominated again as any other: back in the
/// cluster, it serves and is no longer suspect; still gone, Envoy's
/// `override_host` falls back for that request (served elsewhere, nothing
/// lost) and it is suspect again. Without the retry, an instance of a listed
/// fleet that was briefly out of the cluster would never be nominated again.
pub const SUSPECT_MS: u64 = 10_000;

/// How long an instance whose connection failed stays out of the candidates
/// before one request may try it again: short, as a restarted engine should
/// be back in use within seconds, and each try of a still dead one costs a retry.
pub const FAILED_RETRY_MS: u64 = 3_000;

/// The longest address tracked (`ip:port` is far shorter; longer is refused).
pub(crate) const MAX_ADDRESS_LEN: usize = 255;

/// One VM column: whose count it is (the VM's nonce) and the count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct CountCell {
    pub(crate) tag: u64,
    pub(crate) count: u32,
}

/// An instance slot. An empty `address` means the slot is free.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct InstanceRecord {
    pub(crate) address: String,
    pub(crate) last_seen_ms: u64,
    /// When Envoy did not use this instance where it was nominated: probably
    /// gone, for [`SUSPECT_MS`]. Cleared the next time it is seen serving.
    pub(crate) suspect_since_ms: Option<u64>,
    /// When a connection to it failed (or, past [`FAILED_RETRY_MS`], when a
    /// request last went to try it again). Cleared only when it answers:
    /// a request merely sent there does not clear it, unlike `last_seen_ms`.
    pub(crate) failed_since_ms: Option<u64>,
    /// Its forget mark: the prefix index no longer believes its entries
    /// last used at or before this second (0: it believes them all).
    pub(crate) forgotten_through_s: u32,
    pub(crate) cells: Vec<CountCell>,
}

impl InstanceRecord {
    pub(crate) fn new(address: &str, now_ms: u64) -> Self {
        Self {
            address: address.to_string(),
            last_seen_ms: now_ms,
            suspect_since_ms: None,
            failed_since_ms: None,
            forgotten_through_s: 0,
            cells: Vec::new(),
        }
    }

    pub(crate) fn is_free(&self) -> bool {
        self.address.is_empty()
    }

    /// Seen serving within `ttl_ms`, and neither suspected gone nor failing.
    pub(crate) fn is_fresh(&self, now_ms: u64, ttl_ms: u64) -> bool {
        !self.is_free()
            && !self.is_suspect(now_ms)
            && !self.is_failed(now_ms)
            && now_ms.saturating_sub(self.last_seen_ms) <= ttl_ms
    }

    /// Marked suspect within the last [`SUSPECT_MS`].
    pub(crate) fn is_suspect(&self, now_ms: u64) -> bool {
        self.suspect_since_ms
            .is_some_and(|since| now_ms.saturating_sub(since) < SUSPECT_MS)
    }

    /// A connection to it failed within the last [`FAILED_RETRY_MS`] and it
    /// has not answered since.
    pub(crate) fn is_failed(&self, now_ms: u64) -> bool {
        self.failed_since_ms
            .is_some_and(|since| now_ms.saturating_sub(since) < FAILED_RETRY_MS)
    }

    /// Marked failed, but [`FAILED_RETRY_MS`] ago or more: the next request
    /// sent there tries it again (and marks it again, so the others wait).
    pub(crate) fn is_due_for_retry(&self, now_ms: u64) -> bool {
        self.failed_since_ms.is_some() && !self.is_failed(now_ms)
    }

    /// Seen serving at `now_ms`.
    pub(crate) fn seen(&mut self, now_ms: u64) {
        self.last_seen_ms = self.last_seen_ms.max(now_ms);
        self.suspect_since_ms = None;
    }

    pub(crate) fn cell(&self, column: u16) -> CountCell {
        self.cells
            .get(usize::from(column))
            .copied()
            .unwrap_or_default()
    }

    /// Sets one column, growing the cell list if needed; trailing empty cells
    /// are trimmed so records stay as short as the highest column in use.
    pub(crate) fn set_cell(&mut self, column: u16, cell: CountCell) {
        let index = usize::from(column);
        if self.cells.len() <= index {
            self.cells.resize(index + 1, CountCell::default());
        }
        if let Some(slot) = self.cells.get_mut(index) {
            *slot = cell;
        }
        while self.cells.last().is_some_and(|c| c.count == 0) {
            self.cells.pop();
        }
    }
}

impl Record for InstanceRecord {
    fn encode(&self) -> Vec<u8> {
        let address = self.address.as_bytes();
        let address = address.get(..MAX_ADDRESS_LEN).unwrap_or(address);
        let cells = self.cells.get(..255).unwrap_or(&self.cells);
        let mut w = Writer::with_capacity(33 + address.len() + 12 * cells.len());
        w.u8(RECORD_VERSION)
            .u8(u8::from(self.suspect_since_ms.is_some()))
            .u64(self.suspect_since_ms.unwrap_or_default())
            .u8(u8::from(self.failed_since_ms.is_some()))
            .u64(self.failed_since_ms.unwrap_or_default())
            .u32(self.forgotten_through_s)
            // Both lengths are capped at 255 just above.
            .u8(address.len() as u8)
            .bytes(address)
            .u64(self.last_seen_ms)
            .u8(cells.len() as u8);
        for cell in cells {
            w.u64(cell.tag).u32(cell.count);
        }
        w.finish()
    }

    /// A foreign or corrupt value decodes as `None`.
    fn decode(buf: &[u8]) -> Option<Self> {
        let mut r = Reader::new(buf);
        if r.u8()? != RECORD_VERSION {
            return None;
        }
        let suspect_since_ms = optional_time(&mut r)?;
        let failed_since_ms = optional_time(&mut r)?;
        let forgotten_through_s = r.u32()?;
        let address_len = usize::from(r.u8()?);
        let address = std::str::from_utf8(r.bytes(address_len)?).ok()?.to_string();
        let last_seen_ms = r.u64()?;
        let cell_count = usize::from(r.u8()?);
        let mut cells = Vec::with_capacity(cell_count);
        for _ in 0..cell_count {
            cells.push(CountCell {
                tag: r.u64()?,
                count: r.u32()?,
            });
        }
        r.is_empty().then_some(Self {
            address,
            last_seen_ms,
            suspect_since_ms,
            failed_since_ms,
            forgotten_through_s,
            cells,
        })
    }
}

/// A flag byte (0 or 1) and a time: the time if the flag is set; None (the
/// record is undecodable) for any other flag.
fn optional_time(r: &mut Reader<'_>) -> Option<Option<u64>> {
    let flag = r.u8()?;
    let time = r.u64()?;
    match flag {
        0 => Some(None),
        1 => Some(Some(time)),
        _ => None,
    }
}

/// The registry epoch: counts registrations, so other VMs know to rescan the
/// instance slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct RegistryEpoch {
    pub(crate) epoch: u64,
}

impl Record for RegistryEpoch {
    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(8);
        w.u64(self.epoch);
        w.finish()
    }

    /// Lenient on purpose, as it always was: the first word is the epoch
    /// (a longer value from another build keeps it), and a word that is not
    /// there reads as 0.
    fn decode(buf: &[u8]) -> Option<Self> {
        let epoch = buf
            .get(..8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map_or(0, u64::from_le_bytes);
        Some(Self { epoch })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_with_cells_and_a_forget_mark() {
        let mut rec = InstanceRecord::new("10.0.0.1:8000", 77);
        rec.forgotten_through_s = 0x0102_0304;
        rec.set_cell(3, CountCell { tag: 9, count: 2 });
        rec.set_cell(0, CountCell { tag: 5, count: 1 });
        assert_eq!(rec.cells.len(), 4);
        assert_eq!(InstanceRecord::decode(&rec.encode()), Some(rec.clone()));
        assert_eq!(rec.cell(3), CountCell { tag: 9, count: 2 });
        assert_eq!(rec.cell(200), CountCell::default());
    }

    #[test]
    fn zeroed_trailing_cells_are_trimmed() {
        let mut rec = InstanceRecord::new("a:1", 0);
        rec.set_cell(0, CountCell { tag: 5, count: 1 });
        rec.set_cell(4, CountCell { tag: 9, count: 2 });
        rec.set_cell(4, CountCell { tag: 9, count: 0 });
        assert_eq!(rec.cells.len(), 1);
    }

    #[test]
    fn garbage_and_truncation_decode_as_none() {
        let rec = InstanceRecord::new("10.0.0.1:8000", 77).encode();
        for cut in 0..rec.len() {
            assert_eq!(
                InstanceRecord::decode(rec.get(..cut).unwrap()),
                None,
                "cut {cut}"
            );
        }
        assert_eq!(InstanceRecord::decode(&[1, 2, 0xff, 0xfe]), None);
        assert_eq!(InstanceRecord::decode(&[0; 40]), None);
    }

    #[test]
    fn the_epoch_round_trips_and_a_longer_value_keeps_its_first_word() {
        let epoch = RegistryEpoch { epoch: 7 };
        assert_eq!(RegistryEpoch::decode(&epoch.encode()), Some(epoch));
        let longer = [9u64.to_le_bytes(), 1_234u64.to_le_bytes()].concat();
        assert_eq!(
            RegistryEpoch::decode(&longer),
            Some(RegistryEpoch { epoch: 9 })
        );
        assert_eq!(
            RegistryEpoch::decode(b"abc"),
            Some(RegistryEpoch::default())
        );
    }

    #[test]
    fn freshness_and_free_slots() {
        let mut rec = InstanceRecord::new("a:1", 1_000);
        assert!(rec.is_fresh(1_500, 500));
        assert!(!rec.is_fresh(1_501, 500));
        rec.suspect_since_ms = Some(1_000);
        assert!(!rec.is_fresh(1_000, 500));
        assert!(rec.is_suspect(1_000 + SUSPECT_MS - 1));
        assert!(!rec.is_suspect(1_000 + SUSPECT_MS), "tried again");
        assert!(rec.is_fresh(1_000 + SUSPECT_MS, SUSPECT_MS));
        assert_eq!(InstanceRecord::decode(&rec.encode()), Some(rec.clone()));
        rec.seen(1_200);
        assert_eq!(rec.suspect_since_ms, None);
        assert!(rec.is_fresh(1_500, 500));
        rec.seen(900);
        assert_eq!(rec.last_seen_ms, 1_200, "time never goes back");
        assert!(InstanceRecord::default().is_free());
        assert!(!InstanceRecord::default().is_fresh(0, u64::MAX));
    }

    #[test]
    fn a_failed_mark_lapses_into_a_retry_and_round_trips() {
        let mut rec = InstanceRecord::new("a:1", 1_000);
        rec.failed_since_ms = Some(1_000);
        assert!(rec.is_failed(1_000 + FAILED_RETRY_MS - 1));
        assert!(!rec.is_fresh(1_100, 5_000));
        assert!(!rec.is_due_for_retry(1_000 + FAILED_RETRY_MS - 1));
        assert!(rec.is_due_for_retry(1_000 + FAILED_RETRY_MS));
        assert!(rec.is_fresh(1_000 + FAILED_RETRY_MS, 5_000));
        assert_eq!(InstanceRecord::decode(&rec.encode()), Some(rec.clone()));
        rec.seen(1_200);
        assert_eq!(
            rec.failed_since_ms,
            Some(1_000),
            "a request sent is no answer"
        );
    }
}
