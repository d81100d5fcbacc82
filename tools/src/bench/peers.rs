//! What the routing benchmark compares on one fleet: the filter's
//! strategies through Envoy, SGLang's router (`sglang-router==0.3.2`, its
//! `cache_aware` policy) as a child process, and an oracle that needs no
//! proxy (the load generator sends every group straight to instance
//! `group mod 7`: the most hits a placement with even shares can get).

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::{Serialize, Serializer};

use super::fleet::Strategy;

/// The filter's `prefix_length` unless a peer says otherwise.
pub const DEFAULT_PREFIX_LENGTH: u32 = 4096;

/// The PyPI requirement of SGLang's router.
pub const SGLANG_ROUTER_REQUIREMENT: &str = "sglang-router==0.3.2";

/// One routing arm of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// The filter with this strategy at [`DEFAULT_PREFIX_LENGTH`].
    Filter(Strategy),
    /// The filter's PREFIX_AWARE (fixed-prefix matching) at this `prefix_length`.
    FixedPrefix(u32),
    /// SGLang's router, policy `cache_aware` at its defaults.
    SglangCacheAware,
    /// Every group pinned to one instance, spread evenly, no proxy.
    Oracle,
}

/// The arms the workloads on real data run by default.
pub const DATA_PEERS: [Peer; 7] = [
    Peer::Filter(Strategy::Random),
    Peer::Filter(Strategy::LeastOutstandingRequests),
    Peer::FixedPrefix(1024),
    Peer::FixedPrefix(4096),
    Peer::FixedPrefix(16384),
    Peer::SglangCacheAware,
    Peer::Oracle,
];

impl Peer {
    /// How reports name it.
    pub fn name(self) -> String {
        match self {
            Peer::Filter(strategy) => strategy.name().to_string(),
            Peer::FixedPrefix(length) => format!("PREFIX_AWARE@{length}"),
            Peer::SglangCacheAware => "sglang-router cache_aware".to_string(),
            Peer::Oracle => "oracle (group mod 7)".to_string(),
        }
    }

    /// How `--peers` names it (see [`Peer::parse`]).
    pub fn cli_name(self) -> String {
        match self {
            Peer::Filter(Strategy::Random) => "random".into(),
            Peer::Filter(Strategy::LeastOutstandingRequests) => "least-outstanding".into(),
            Peer::Filter(Strategy::PrefixAware) => "prefix-aware".into(),
            Peer::Filter(Strategy::PrefixAwareBalanced) => "prefix-aware-balanced".into(),
            Peer::FixedPrefix(length) => format!("prefix-{length}"),
            Peer::SglangCacheAware => "sglang".into(),
            Peer::Oracle => "oracle".into(),
        }
    }

    /// A `--peers` name: random, least-outstanding, prefix-aware,
    /// prefix-aware-balanced, prefix-N (PREFIX_AWARE at prefix_length N),
    /// sglang, oracle.
    pub fn parse(name: &str) -> Result<Peer, String> {
        Ok(match name {
            "random" => Peer::Filter(Strategy::Random),
            "least-outstanding" => Peer::Filter(Strategy::LeastOutstandingRequests),
            "prefix-aware" => Peer::Filter(Strategy::PrefixAware),
            "prefix-aware-balanced" => Peer::Filter(Strategy::PrefixAwareBalanced),
            "sglang" => Peer::SglangCacheAware,
            "oracle" => Peer::Oracle,
            other => match other.strip_prefix("prefix-").map(str::parse::<u32>) {
                Some(Ok(length)) if length > 0 => Peer::FixedPrefix(length),
                _ => {
                    return Err(format!(
                        "unknown peer {other:?}: random, least-outstanding, prefix-aware, \
                         prefix-aware-balanced, prefix-N, sglang or oracle"
                    ))
                }
            },
        })
    }

    /// The filter's strategy and `prefix_length`, for the arms that run through Envoy.
    pub fn filter_config(self) -> Option<(Strategy, u32)> {
        match self {
            Peer::Filter(strategy) => Some((strategy, DEFAULT_PREFIX_LENGTH)),
            Peer::FixedPrefix(length) => Some((Strategy::PrefixAware, length)),
            Peer::SglangCacheAware | Peer::Oracle => None,
        }
    }

    /// How the run realises it, for the report.
    pub fn mechanism(self) -> String {
        match self {
            Peer::Filter(strategy) => strategy.mechanism().to_string(),
            Peer::FixedPrefix(length) => format!(
                "filter strategy PREFIX_AWARE, prefix_length {length}: the key (the prompt's first {length} bytes) hashed by MAGLEV"
            ),
            Peer::SglangCacheAware => format!(
                "{SGLANG_ROUTER_REQUIREMENT} (python -m sglang_router.launch_router) --policy cache_aware \
                 --worker-startup-check-interval 1 --disable-retries --log-level warn, defaults otherwise"
            ),
            Peer::Oracle => "no proxy: the load generator sends group (or conversation) g straight to instance g mod 7".into(),
        }
    }
}

impl Serialize for Peer {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            // The existing reports' values.
            Peer::Filter(strategy) => strategy.serialize(serializer),
            other => serializer.serialize_str(&other.name()),
        }
    }
}

/// A free loopback port (bound, read and released; the caller binds it next).
pub fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding an ephemeral port")?;
    Ok(listener.local_addr()?.port())
}

/// SGLang's router in front of the fleet, killed when dropped.
pub struct SglangRouter {
    child: Child,
    pub port: u16,
}

impl SglangRouter {
    /// Starts `python3 -m sglang_router.launch_router` (with `PYTHONPATH` as
    /// this process has it) in front of `workers`, and waits until it reports
    /// every worker healthy, at most `ready_within`. Its output goes to `log`.
    pub fn start(
        workers: &[SocketAddr],
        log: &Path,
        ready_within: Duration,
    ) -> anyhow::Result<SglangRouter> {
        let port = free_port()?;
        let prometheus_port = free_port()?;
        if let Some(dir) = log.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let out =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let mut command = Command::new("python3");
        command
            .args(["-m", "sglang_router.launch_router", "--host", "127.0.0.1"])
            .args(["--port", &port.to_string()])
            .args(["--prometheus-host", "127.0.0.1"])
            .args(["--prometheus-port", &prometheus_port.to_string()])
            .arg("--worker-urls")
            .args(workers.iter().map(|a| format!("http://{a}")))
            .args(["--policy", "cache_aware"])
            .args(["--worker-startup-check-interval", "1"])
            .arg("--disable-retries")
            // It logs every request at info: on 2 cores that is CPU the fleet needs.
            .args(["--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        let child = crate::child::spawn_tied_to_process(command)
            .context("starting python3 -m sglang_router.launch_router")?;
        let mut router = SglangRouter { child, port };
        router.wait_ready(workers.len(), ready_within, log)?;
        Ok(router)
    }

    /// `http://127.0.0.1:PORT`
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn wait_ready(&mut self, workers: usize, within: Duration, log: &Path) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait()? {
                anyhow::bail!(
                    "sglang-router exited ({status}) before it was ready; see {} (install {SGLANG_ROUTER_REQUIREMENT})",
                    log.display()
                );
            }
            if let Ok(body) = http_get(self.port, "/workers") {
                if healthy_workers(&body) == Some(workers) {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                anyhow::bail!(
                    "sglang-router did not report {workers} healthy workers within {} s; see {}",
                    within.as_secs(),
                    log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for SglangRouter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET path` on a loopback port: the body of a 200 response.
fn http_get(port: u16, path: &str) -> anyhow::Result<String> {
    Ok(ureq::get(&format!("http://127.0.0.1:{port}{path}"))
        .timeout(Duration::from_secs(2))
        .call()?
        .into_string()?)
}

/// Healthy workers in the router's `GET /workers` answer.
fn healthy_workers(body: &str) -> Option<usize> {
    let value: serde_json::Value = serde_json::from_str(body).ok()?;
    let workers = value.get("workers")?.as_array()?;
    Some(
        workers
            .iter()
            .filter(|w| w.get("is_healthy").and_then(|h| h.as_bool()) == Some(true))
            .count(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_names_parse_back() {
        for peer in DATA_PEERS
            .into_iter()
            .chain(Strategy::ALL.into_iter().map(Peer::Filter))
        {
            assert_eq!(Peer::parse(&peer.cli_name()), Ok(peer));
        }
        assert_eq!(Peer::parse("prefix-2048"), Ok(Peer::FixedPrefix(2048)));
        assert!(Peer::parse("prefix-0").is_err());
        assert!(Peer::parse("prefix-x").is_err());
        assert!(Peer::parse("round-robin").is_err());
    }

    #[test]
    fn existing_strategies_keep_their_report_names() {
        assert_eq!(
            serde_json::to_value(Peer::Filter(Strategy::PrefixAwareBalanced)).unwrap(),
            "PREFIX_AWARE_BALANCED"
        );
        assert_eq!(
            serde_json::to_value(Peer::FixedPrefix(1024)).unwrap(),
            "PREFIX_AWARE@1024"
        );
        assert_eq!(
            Peer::FixedPrefix(16384).filter_config(),
            Some((Strategy::PrefixAware, 16384))
        );
        assert_eq!(Peer::Oracle.filter_config(), None);
    }

    #[test]
    fn healthy_workers_are_counted_from_the_routers_answer() {
        let body = r#"{"workers":[{"url":"a","is_healthy":true},{"url":"b","is_healthy":false},{"url":"c","is_healthy":true}],"total":3}"#;
        assert_eq!(healthy_workers(body), Some(2));
        assert_eq!(healthy_workers("not json"), None);
        assert_eq!(healthy_workers("{}"), None);
    }
}
