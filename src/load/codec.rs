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

#[cfg(test)]
mod tests {
    use super::*;

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
