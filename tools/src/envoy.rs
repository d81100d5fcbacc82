//! Starts a real Envoy with the filter (placeholder).
