//! Stand-ins for what surrounds the filter, for native (and wasm32) tests:
//! a fake Envoy routing between simulated instances and worker VMs, and an
//! in-memory host for the plugin logic.

pub(crate) mod fake_envoy;
pub(crate) mod memory_host;
