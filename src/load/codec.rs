//! Fixed little-endian encoding for the shared-data records: small, no
//! dependencies, and every read checked, so a corrupt or foreign value decodes
//! to `None` instead of panicking the VM.

/// Appends fixed-width little-endian fields to a buffer.
#[derive(Debug, Default)]
pub(crate) struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Self {
            buf: Vec::with_capacity(capacity),
        }
    }
    pub(crate) fn u8(&mut self, value: u8) -> &mut Self {
        self.buf.push(value);
        self
    }
    pub(crate) fn u16(&mut self, value: u16) -> &mut Self {
        self.buf.extend_from_slice(&value.to_le_bytes());
        self
    }
    pub(crate) fn u32(&mut self, value: u32) -> &mut Self {
        self.buf.extend_from_slice(&value.to_le_bytes());
        self
    }
    pub(crate) fn u64(&mut self, value: u64) -> &mut Self {
        self.buf.extend_from_slice(&value.to_le_bytes());
        self
    }
    pub(crate) fn bytes(&mut self, value: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(value);
        self
    }
    pub(crate) fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads fixed-width little-endian fields; every read is bounds-checked.
#[derive(Debug)]
pub(crate) struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { rest: buf }
    }
    pub(crate) fn bytes(&mut self, len: usize) -> Option<&'a [u8]> {
        let head = self.rest.get(..len)?;
        self.rest = self.rest.get(len..)?;
        Some(head)
    }
    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.bytes(N)?.try_into().ok()
    }
    pub(crate) fn u8(&mut self) -> Option<u8> {
        Some(self.array::<1>()?[0])
    }
    pub(crate) fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.array()?))
    }
    pub(crate) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.array()?))
    }
    pub(crate) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.array()?))
    }
    pub(crate) fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }
}

/// A versioned list: `version`, the count, then each of the first `max`
/// entries as `write` puts it (`entry_bytes` each, for the capacity). The
/// bucket records of the shared data are lists of at most a few dozen
/// entries, so the count fits a byte.
pub(crate) fn encode_list<T>(
    version: u8,
    entries: &[T],
    max: usize,
    entry_bytes: usize,
    write: impl Fn(&mut Writer, &T),
) -> Vec<u8> {
    let entries = entries
        .get(..max.min(usize::from(u8::MAX)))
        .unwrap_or(entries);
    let mut w = Writer::with_capacity(2 + entry_bytes * entries.len());
    // At most u8::MAX entries (above).
    w.u8(version).u8(entries.len() as u8);
    for entry in entries {
        write(&mut w, entry);
    }
    w.finish()
}

/// Reads what [`encode_list`] wrote: `None` for another version, more than
/// `max` entries, an entry `read` rejects, or bytes left over.
pub(crate) fn decode_list<T>(
    buf: &[u8],
    version: u8,
    max: usize,
    mut read: impl FnMut(&mut Reader<'_>) -> Option<T>,
) -> Option<Vec<T>> {
    let mut r = Reader::new(buf);
    if r.u8()? != version {
        return None;
    }
    let count = usize::from(r.u8()?);
    if count > max {
        return None;
    }
    let mut entries = Vec::with_capacity(count);
    for _ in 0..count {
        entries.push(read(&mut r)?);
    }
    r.is_empty().then_some(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_round_trips_and_rejects_version_count_and_length() {
        let write = |w: &mut Writer, v: &u16| {
            w.u16(*v);
        };
        let read = |r: &mut Reader<'_>| r.u16();
        let bytes = encode_list(3, &[1u16, 2, 3, 4], 3, 2, write);
        assert_eq!(bytes, [3, 3, 1, 0, 2, 0, 3, 0], "the first `max` entries");
        assert_eq!(decode_list(&bytes, 3, 3, read), Some(vec![1, 2, 3]));
        assert_eq!(decode_list(&bytes, 4, 3, read), None, "another version");
        assert_eq!(decode_list(&bytes, 3, 2, read), None, "more than max");
        for cut in 0..bytes.len() {
            assert_eq!(decode_list(&bytes[..cut], 3, 3, read), None, "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode_list(&longer, 3, 3, read), None, "a byte left over");
        assert_eq!(
            decode_list(&encode_list(3, &[] as &[u16], 3, 2, write), 3, 3, read),
            Some(vec![])
        );
    }

    #[test]
    fn round_trip_of_every_width() {
        let mut w = Writer::with_capacity(32);
        w.u8(7)
            .u16(0xBEEF)
            .u32(0xDEAD_BEEF)
            .u64(u64::MAX - 1)
            .bytes(b"ab");
        let buf = w.finish();
        let mut r = Reader::new(&buf);
        assert_eq!(r.u8(), Some(7));
        assert_eq!(r.u16(), Some(0xBEEF));
        assert_eq!(r.u32(), Some(0xDEAD_BEEF));
        assert_eq!(r.u64(), Some(u64::MAX - 1));
        assert_eq!(r.bytes(2), Some(&b"ab"[..]));
        assert!(r.is_empty());
    }

    #[test]
    fn short_input_reads_none_at_every_width() {
        assert_eq!(Reader::new(&[]).u8(), None);
        assert_eq!(Reader::new(&[1]).u16(), None);
        assert_eq!(Reader::new(&[1, 2, 3]).u32(), None);
        assert_eq!(Reader::new(&[1, 2, 3, 4, 5, 6, 7]).u64(), None);
        assert_eq!(Reader::new(&[1, 2]).bytes(3), None);
        assert_eq!(Reader::new(&[1, 2]).bytes(usize::MAX), None);
    }
}
