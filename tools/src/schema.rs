//! The plugin configuration's JSON Schema, generated from the filter's own
//! `ConfigDocument` and checked in for editors and validators;
//! `cargo xtask schema` rewrites it, and `tests/configuration_schema.rs`
//! fails while it is stale.

use std::path::PathBuf;

use anyhow::Context;

/// Where the schema is checked in, relative to the repository root.
pub const SCHEMA_FILE: &str = "docs/configuration.schema.json";

/// The checked-in schema's path.
pub fn schema_path() -> PathBuf {
    crate::envoy::workspace_root().join(SCHEMA_FILE)
}

/// The schema as the filter's configuration types describe it now.
pub fn generate() -> String {
    prefix_router::config::json_schema()
}

/// Rewrites the checked-in schema; returns its path.
pub fn write() -> anyhow::Result<PathBuf> {
    let path = schema_path();
    std::fs::write(&path, generate()).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}
