//! prefix-router: a proxy-wasm HTTP filter that sends LLM requests which begin
//! alike to the same inference instance, so its KV cache stays warm.
//!
//! Words used throughout, each for one thing:
//! - *routing* is the whole job: a request in, the instance it should reach
//!   out. The *routing key* is the framed xxh3 hash of the request's prefix.
//! - *reading* a request derives its routing key from the head and body
//!   ([`request::RequestReader`], giving a [`request::KeyDerivation`]).
//! - a *strategy* (the configuration field) selects a *policy*
//!   ([`strategy`]), which *decides* where the request goes: a
//!   [`strategy::RouteHeaders`], with the in-flight count it took.
//! - *steering* carries that decision out through Envoy's request headers
//!   ([`steering`]): Maglev hashes the key header, `override_host` obeys the
//!   host header, the route header picks a cluster.
//! - *counting* is the in-flight accounting in shared data ([`load`]).
//!
//! Everything that decides lives in plain Rust modules that know nothing of
//! the proxy-wasm ABI and are tested natively (and as 32-bit wasm):
//! - [`config`]: the plugin configuration, parsed and validated.
//! - [`counting_check`]: whether an upstream filter counts, or the listener
//!   must (a deployment that would otherwise cap nothing).
//! - [`classify`]: which API a request speaks, from its path.
//! - [`extract`]: the routing prefix (raw bytes or canonical text), read
//!   incrementally from the body.
//! - [`tenant`]: validation of the tenant header.
//! - [`key`]: the framed xxh3 routing key.
//! - [`request`]: the per-request state machine that ties them together.
//! - [`usage`]: what the engine reports it found cached, read from the
//!   response body.
//! - [`headers`]: the names of the headers the filter defines.
//! - [`metrics`]: the names of the stats the filter exports.
//! - [`shared`]: the proxy-wasm shared-data contract, with an in-memory store.
//! - [`load`]: in-flight accounting and learned tables in shared data.
//! - [`engine_load`]: the engines' own load, read from their `/metrics`
//!   (the parser, and when each instance is polled).
//! - [`steering`]: from a policy's decision to the headers the plugin writes.
//! - [`strategy`]: the routing policies (prefix-aware with overflow, least
//!   outstanding, random).
//! - [`plugin`]: what the filter does in each proxy-wasm callback, over the
//!   [`host::Host`] trait (Envoy's headers, buffers, metrics, properties,
//!   clock and shared data).
//!
//! The proxy-wasm glue (`wasm`: the SDK's traits forwarding to [`plugin`],
//! over the panic-free ABI calls of `host::AbiHost`) is compiled only into
//! the `.wasm` itself.

// No panic reachable from a request: a panic kills the worker's VM and every
// request on it. Tests may unwrap and index.
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing,
        clippy::unreachable,
        clippy::todo,
        clippy::unimplemented
    )
)]

pub mod blocks;
pub mod classify;
pub mod config;
pub mod counting_check;
pub mod discovery;
pub mod engine_load;
pub mod extract;
pub mod headers;
pub mod host;
pub mod key;
pub mod load;
pub mod metrics;
pub mod plugin;
pub mod request;
pub mod shared;
pub mod steering;
pub mod strategy;
pub mod tenant;
#[cfg(test)]
mod testing;
pub mod usage;

#[cfg(all(target_arch = "wasm32", not(test)))]
mod wasm;
