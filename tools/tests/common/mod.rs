//! What the tools' integration tests share: a simulated instance on an
//! ephemeral loopback port.

use prefix_router_tools::sim::{SimConfig, SimServer};

/// Simulated seconds per real second in these tests.
pub const TIME_SCALE: f64 = 50.0;

/// A simulated instance named `name`, at [`TIME_SCALE`], with room for the
/// tests' prompts.
pub async fn sim(name: &str) -> SimServer {
    let cfg = SimConfig {
        name: name.to_string(),
        time_scale: TIME_SCALE,
        kv_blocks: 20_000,
        prompt_tokens_details: true,
        ..SimConfig::default()
    };
    SimServer::start(cfg, "127.0.0.1:0".parse().unwrap())
        .await
        .expect("start simulator")
}
