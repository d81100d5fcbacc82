//! Stand-ins for what surrounds the filter, for native (and wasm32) tests:
//! a fake Envoy routing between simulated instances and worker VMs.

pub(crate) mod fake_envoy;
