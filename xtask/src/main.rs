//! `cargo xtask demo|test`: the project's two commands (placeholder).
fn main() {}
