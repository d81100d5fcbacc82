//! Stand-ins for what surrounds the filter, for native (and wasm32) tests:
//! a fake Envoy routing between simulated instances and worker VMs, and an
//! in-memory host for the plugin logic.

pub(crate) mod fake_envoy;
pub(crate) mod memory_host;

/// `json` (a configuration object) with `"match": "FIXED_PREFIX"` unless it
/// names a match: for tests that pin the mechanics of Maglev keys.
#[cfg(test)]
pub(crate) fn fixed_prefix_unless_named(json: &str) -> String {
    let mut value: serde_json::Value = serde_json::from_str(json).unwrap();
    if let Some(object) = value.as_object_mut() {
        object
            .entry("match")
            .or_insert_with(|| serde_json::json!("FIXED_PREFIX"));
    }
    value.to_string()
}
