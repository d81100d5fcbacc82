//! proxy-wasm glue (placeholder).
