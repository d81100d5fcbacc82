//! The upstream filter's mark: a shared record an upstream filter writes
//! when it first runs in a VM, so the listener filter can tell that
//! something counts its requests (see `crate::counting_check`). Its only
//! content is when it was first written.

use super::codec::{Reader, Writer};
use super::table::Record;

/// See the module documentation. The default (a missing key) is no mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct UpstreamFilterMark {
    /// When an upstream filter first marked (0: never).
    pub(crate) first_ms: u64,
}

impl UpstreamFilterMark {
    pub(crate) fn is_present(&self) -> bool {
        self.first_ms != 0
    }
}

impl Record for UpstreamFilterMark {
    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(8);
        w.u64(self.first_ms);
        w.finish()
    }

    fn decode(buf: &[u8]) -> Option<Self> {
        let mut r = Reader::new(buf);
        let first_ms = r.u64()?;
        r.is_empty().then_some(Self { first_ms })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_foreign_bytes() {
        let mark = UpstreamFilterMark { first_ms: 42 };
        assert_eq!(UpstreamFilterMark::decode(&mark.encode()), Some(mark));
        assert_eq!(UpstreamFilterMark::decode(&[1, 2]), None);
        assert!(!UpstreamFilterMark::default().is_present());
    }
}
