//! The engines' own load, polled from their `/metrics` endpoints into
//! shared data, so that decisions can see what every proxy in front of an
//! instance sent there, not only this Envoy's share.
//!
//! Split the way the rest of the filter is: [`metrics_text`] reads a body,
//! [`poller`] decides when each instance is polled and what a response
//! means, [`orca`] reads the KV usage a response's ORCA report gives,
//! [`models`] the adapters `/v1/models` lists, all
//! plain Rust tested natively; `crate::plugin` makes the calls
//! (`dispatch_http_call` from the root tick) and stores the samples
//! (`crate::load`, `engine/<slot>`). See `docs/design.md`, "Engine load".

pub mod metrics_text;
pub mod models;
pub mod orca;
pub mod poller;

/// Counter of polls sent.
pub const POLLS: &str = "prefix_router.engine.polls";
/// Counter of polls that gave no sample, one per reason
/// ([`poller::PollFault::reason`]): `prefix_router.engine.poll_failures.<reason>`.
pub const POLL_FAILURE_PREFIX: &str = "prefix_router.engine.poll_failures";
/// Counter of polls not sent because the instance's previous one was still
/// open when the next was due (polls never pile up).
pub const POLLS_SKIPPED: &str = "prefix_router.engine.polls_skipped";
/// Per-instance gauge prefixes (`<prefix>.<instance>`, the instance spelt
/// as in the in-flight gauges): the engine's running + waiting, its KV
/// usage in thousandths, and the age of its last good sample.
pub const REQUESTS_GAUGE_PREFIX: &str = "prefix_router.engine.requests";
pub const KV_USAGE_GAUGE_PREFIX: &str = "prefix_router.engine.kv_usage_permille";
pub const SAMPLE_AGE_GAUGE_PREFIX: &str = "prefix_router.engine.sample_age_ms";

/// `prefix_router.engine.poll_failures.<reason>`.
pub fn poll_failure_counter_name(reason: &str) -> String {
    format!("{POLL_FAILURE_PREFIX}.{reason}")
}

/// Every stat the poller defines, as `docs/metrics.md` names them
/// (per-instance ones as `<prefix>.endpoint.<ip>:<port>`, one per failure reason).
pub fn documented_stat_names() -> Vec<String> {
    let mut names = vec![POLLS.to_string(), POLLS_SKIPPED.to_string()];
    names.extend(
        poller::PollFault::REASONS
            .iter()
            .map(|r| poll_failure_counter_name(r)),
    );
    for prefix in [
        REQUESTS_GAUGE_PREFIX,
        KV_USAGE_GAUGE_PREFIX,
        SAMPLE_AGE_GAUGE_PREFIX,
    ] {
        names.push(crate::metrics::instance_stat_name(prefix, "<ip>:<port>"));
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instance_gauges_spell_the_address_like_the_in_flight_gauges() {
        let engine = |address| crate::metrics::instance_stat_name(REQUESTS_GAUGE_PREFIX, address);
        assert_eq!(
            engine("127.0.0.1:8001"),
            "prefix_router.engine.requests.endpoint.127.0.0.1:8001"
        );
        assert_eq!(
            engine("[fd00::7]:80"),
            "prefix_router.engine.requests.endpoint.[fd00::7]:80"
        );
        assert_eq!(
            crate::metrics::in_flight_gauge_name("[fd00::7]:80"),
            "prefix_router.in_flight.endpoint.[fd00::7]:80"
        );
    }
}
