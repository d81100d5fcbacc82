//! Whether anything counts the requests: with the default `counting:
//! UPSTREAM_FILTER`, a deployment without the upstream filter (the listener
//! filter alone, the smallest configuration one writes), or with it under
//! another `vm_id` (so it counts in shared data the listener never reads),
//! would cap nothing and say nothing. The upstream filter leaves a mark in
//! shared data when it first runs in a VM; the listener looks for that mark
//! at the response of a request its decision left to be counted. Without the
//! mark, the listener counts the request itself, as `counting: LISTENER`
//! does, and warns once per VM with the fix.

/// How often a VM without the mark looks for it again (one shared-data read):
/// a fixed configuration is noticed within this long.
pub const RECHECK_MS: u64 = 1_000;

/// The warning, once per worker VM, when no upstream filter counts.
pub const MISSING_UPSTREAM_FILTER_WARNING: &str = "prefix-router: no upstream filter counted a request this listener filter routed: the cluster has no prefix_router upstream filter, or it runs under another vm_id (its counts are then in shared data the listener does not read). The listener filter counts the requests itself from now on, as with \"counting\": \"LISTENER\" (a new key is capped from its first response on; stat prefix_router.upstream_filter_missing). Fix: add the upstream filter with the same vm_id and code to the cluster (see envoy/envoy.yaml), or set \"counting\": \"LISTENER\" in the listener filter's configuration; list the fleet in \"instances\" so that overflow can name the other instances from the first request";

/// What the listener does at a response its decision left to be counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtResponse {
    /// An upstream filter counts: nothing to do here.
    UpstreamFilterCounts,
    /// Nothing else counts: count the request here; `warn`: the first time
    /// in this VM, so log the warning.
    CountHere { warn: bool },
}

/// One worker VM's view of whether an upstream filter counts.
#[derive(Debug, Default)]
pub struct UpstreamFilterCheck {
    /// The mark was seen: an upstream filter shares this VM's data. Final.
    seen: bool,
    /// When the mark was last looked for.
    checked_ms: Option<u64>,
    warned: bool,
}

impl UpstreamFilterCheck {
    /// This VM's own upstream filter ran (it shares the VM, so its data):
    /// no look at the shared mark is needed.
    pub fn upstream_filter_ran(&mut self) {
        self.seen = true;
    }

    /// Whether a decision should keep what counting at its response needs
    /// (nothing is known yet, or no upstream filter counts).
    pub fn may_count_at_response(&self) -> bool {
        !self.seen
    }

    /// At the response of a request whose decision left it to be counted.
    /// `mark_present` reads the shared mark; it is called only when a look
    /// is due (first time, then every [`RECHECK_MS`]).
    pub fn at_response(&mut self, now_ms: u64, mark_present: impl FnOnce() -> bool) -> AtResponse {
        if self.seen {
            return AtResponse::UpstreamFilterCounts;
        }
        let due = self
            .checked_ms
            .is_none_or(|checked| now_ms.saturating_sub(checked) >= RECHECK_MS);
        if due {
            self.checked_ms = Some(now_ms);
            if mark_present() {
                self.seen = true;
                return AtResponse::UpstreamFilterCounts;
            }
        }
        let warn = !self.warned;
        self.warned = true;
        AtResponse::CountHere { warn }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    #[test]
    fn a_mark_seen_once_ends_the_checks() {
        let mut check = UpstreamFilterCheck::default();
        assert!(check.may_count_at_response(), "nothing known yet");
        assert_eq!(
            check.at_response(5, || true),
            AtResponse::UpstreamFilterCounts
        );
        assert!(!check.may_count_at_response());
        let reads = Cell::new(0);
        let read = || {
            reads.set(reads.get() + 1);
            false
        };
        assert_eq!(
            check.at_response(10_000, read),
            AtResponse::UpstreamFilterCounts
        );
        assert_eq!(reads.get(), 0, "no more reads once seen");
    }

    #[test]
    fn an_upstream_filter_in_the_same_vm_needs_no_look() {
        let mut check = UpstreamFilterCheck::default();
        check.upstream_filter_ran();
        assert!(!check.may_count_at_response());
        assert_eq!(
            check.at_response(0, || panic!("no read")),
            AtResponse::UpstreamFilterCounts
        );
    }

    #[test]
    fn without_the_mark_the_listener_counts_and_warns_once() {
        let mut check = UpstreamFilterCheck::default();
        assert_eq!(
            check.at_response(100, || false),
            AtResponse::CountHere { warn: true }
        );
        let reads = Cell::new(0);
        let read = || {
            reads.set(reads.get() + 1);
            false
        };
        for now in [101, 500, 1_099] {
            assert_eq!(
                check.at_response(now, read),
                AtResponse::CountHere { warn: false }
            );
        }
        assert_eq!(reads.get(), 0, "looked again only after RECHECK_MS");
        assert_eq!(
            check.at_response(1_100, read),
            AtResponse::CountHere { warn: false }
        );
        assert_eq!(reads.get(), 1);
        assert!(check.may_count_at_response());
    }

    #[test]
    fn an_upstream_filter_added_later_is_noticed_at_the_next_look() {
        let mut check = UpstreamFilterCheck::default();
        assert_eq!(
            check.at_response(0, || false),
            AtResponse::CountHere { warn: true }
        );
        assert_eq!(
            check.at_response(RECHECK_MS, || true),
            AtResponse::UpstreamFilterCounts
        );
        assert!(!check.may_count_at_response());
    }
}
