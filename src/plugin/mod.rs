//! What the filter does in each proxy-wasm callback, over any [`Host`]: one
//! [`PluginRoot`] per plugin (configuration, policy, metric ids, the 1 s
//! tick), one [`Stream`] per HTTP stream, and one [`Vm`] per worker VM for
//! what they all share (the load tracker, batched metrics, gauges, the last
//! tick, the random source). The proxy-wasm glue (`wasm`) only forwards
//! Envoy's callbacks here and turns the [`Flow`] into an `Action`, so this
//! logic is tested natively and as wasm32 with an in-memory host.
//!
//! The same module runs in two roles, told apart per stream: as the
//! listener's HTTP filter it decides (downstream); as the cluster's upstream
//! HTTP filter, where `upstream.address` is readable at request headers, it
//! counts the request on the instance Envoy chose and learns the key's target.
//! Both roles of a worker VM share one [`crate::load::LoadTracker`] (in the
//! [`Vm`]), and all VMs with the same `vm_id` share its tables through shared
//! data. With `counting: LISTENER` there is no upstream filter: the listener
//! does its work when the response headers name the instance
//! ([`crate::steering::ListenerCount`]).
//!
//! [`Host`]: crate::host::Host

mod discovery_poll;
mod engine_poll;
mod metric_ids;
mod poller_lease;
mod root;
mod stream;
mod vm;

#[cfg(test)]
mod discovery_poll_tests;
#[cfg(test)]
mod engine_poll_tests;
#[cfg(test)]
mod tests;

pub use engine_poll::{EnginePolling, ORIGINAL_DST_HOST_HEADER};
pub use metric_ids::MetricIds;
pub use root::{PluginRoot, TICK_PERIOD_MS};
pub use stream::Stream;
pub use vm::{Vm, MAX_GAUGES, MAX_PENDING_SAMPLES};

use crate::host::HostStatus;

/// What Envoy does with the stream after a callback (proxy-wasm's `Action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Pause,
}

/// Logs a refused host call: the filter goes on without it rather than
/// failing the request.
fn warn_on_error(what: &str, subject: &str, result: Result<(), HostStatus>) {
    if let Err(status) = result {
        log::warn!("prefix-router: {what} {subject} failed: {status}");
    }
}
