//! Tools around the prefix-router filter, kept out of the `.wasm`:
//! the Envoy launcher used by tests, demo and benchmarks; the simulated vLLM
//! instance; the load generator.

pub mod bench;
pub mod child;
pub mod envoy;
pub mod loadgen;
pub mod oci;
pub mod schema;
pub mod sim;
pub mod upstream;
