//! What the routing benchmark compares on one fleet: the filter's
//! strategies and matching modes through Envoy (one, or replicas the load
//! generator alternates between), its defaults with `engine_load`,
//! SGLang's router (`sglang-router==0.3.2`, its
//! `cache_aware` policy) as a child process, and an oracle that needs no
//! proxy (the load generator sends every group straight to instance
//! `group mod N` of N instances: the most hits a placement with even shares
//! can get).

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::{Serialize, Serializer};
use serde_json::json;

use super::engine_load::engine_load_config;
use super::fleet::{base_plugin_config, Strategy};

/// The PyPI requirement of SGLang's router.
pub const SGLANG_ROUTER_REQUIREMENT: &str = "sglang-router==0.3.2";

/// One routing arm of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// The filter with this strategy at its defaults: for PREFIX_AWARE that
    /// is its default matching (LONGEST_PREFIX), with no `match` or
    /// `prefix_length` sent.
    Filter(Strategy),
    /// PREFIX_AWARE, `match` FIXED_PREFIX at this `prefix_length`: MAGLEV on
    /// the hash of the prompt's first `prefix_length` bytes.
    FixedPrefix(u32),
    /// PREFIX_AWARE, `match` LONGEST_PREFIX with this `block_bytes`.
    LongestPrefix(u32),
    /// PREFIX_AWARE, `match` LONGEST_PREFIX with this `load_margin`.
    LoadMargin(u32),
    /// PREFIX_AWARE, `match` LONGEST_PREFIX with `cold_placement` BALANCED.
    Balanced,
    /// [`Peer::Filter`]`(PrefixAware)` with `adapters` (the base model
    /// [`super::bodies::MODEL`]): each LoRA adapter served by its set.
    Adapters,
    /// [`Peer::Adapters`] with `engine_load` as [`Peer::PrefixAwareEngine`]:
    /// the engines also say which adapters they run.
    AdaptersEngine,
    /// [`Peer::Filter`]`(PrefixAware)` with `engine_load` (the cluster
    /// [`super::engine_load::ENGINE_CLUSTER`], every other field at its
    /// default): decisions weigh each instance by its engine's running +
    /// waiting from `/metrics`.
    PrefixAwareEngine,
    /// An arm through `envoys` Envoys (2 or more), each with the arm's
    /// configuration, in front of the same fleet; the load generator
    /// alternates between them ([`crate::loadgen::alternating_target`]), so
    /// consecutive turns of a conversation, or questions about a document,
    /// go through different ones. With `engine_load` each polls every
    /// instance itself, and so sees the others' requests in the engines'
    /// figures.
    Replicated { arm: &'static Peer, envoys: usize },
    /// SGLang's router, policy `cache_aware` at its defaults.
    SglangCacheAware,
    /// Every group pinned to one instance, spread evenly, no proxy.
    Oracle,
    /// An arm through Envoy run again with the `.wasm` of `--baseline-wasm`
    /// (another build of the filter), on the same fleet and traffic: two
    /// builds side by side in one run.
    Baseline(&'static Peer),
}

/// The arms the workloads on real data run by default.
pub const DATA_PEERS: [Peer; 8] = [
    Peer::Filter(Strategy::Random),
    Peer::Filter(Strategy::LeastOutstandingRequests),
    Peer::FixedPrefix(1024),
    Peer::FixedPrefix(4096),
    Peer::FixedPrefix(16384),
    Peer::Filter(Strategy::PrefixAware),
    Peer::SglangCacheAware,
    Peer::Oracle,
];

/// The arms the synthetic workloads run by default.
pub const SYNTHETIC_PEERS: [Peer; 4] = [
    Peer::Filter(Strategy::Random),
    Peer::Filter(Strategy::LeastOutstandingRequests),
    Peer::FixedPrefix(4096),
    Peer::Filter(Strategy::PrefixAware),
];

impl Peer {
    /// How reports name it.
    pub fn name(self) -> String {
        match self {
            Peer::Filter(Strategy::PrefixAware) => "PREFIX_AWARE (longest)".to_string(),
            Peer::Filter(strategy) => strategy.config_name().to_string(),
            Peer::FixedPrefix(length) => format!("PREFIX_AWARE@{length}"),
            Peer::LongestPrefix(block) => format!("PREFIX_AWARE (longest, {block}-byte blocks)"),
            Peer::LoadMargin(margin) => format!("PREFIX_AWARE (longest, load margin {margin})"),
            Peer::Balanced => "PREFIX_AWARE (longest, BALANCED)".to_string(),
            Peer::Adapters => "PREFIX_AWARE (longest) + adapters".to_string(),
            Peer::AdaptersEngine => "PREFIX_AWARE (longest) + adapters + engine load".to_string(),
            Peer::PrefixAwareEngine => "PREFIX_AWARE (longest) + engine load".to_string(),
            Peer::Replicated { arm, envoys } => format!("{}, {envoys} Envoys", arm.name()),
            Peer::SglangCacheAware => "sglang-router cache_aware".to_string(),
            Peer::Oracle => "oracle (group mod the instances)".to_string(),
            Peer::Baseline(peer) => format!("{} [baseline .wasm]", peer.name()),
        }
    }

    /// How `--peers` names it (see [`Peer::parse`]).
    pub fn cli_name(self) -> String {
        match self {
            Peer::Filter(Strategy::Random) => "random".into(),
            Peer::Filter(Strategy::LeastOutstandingRequests) => "least-outstanding".into(),
            Peer::Filter(Strategy::PrefixAware) => "prefix-aware".into(),
            Peer::FixedPrefix(length) => format!("prefix-{length}"),
            Peer::LongestPrefix(block) => format!("longest-{block}"),
            Peer::LoadMargin(margin) => format!("margin-{margin}"),
            Peer::Balanced => "balanced".into(),
            Peer::Adapters => "adapters".into(),
            Peer::AdaptersEngine => "adapters-engine".into(),
            Peer::PrefixAwareEngine => "prefix-aware-engine".into(),
            Peer::Replicated { arm, envoys } => format!("{}-{envoys}-envoys", arm.cli_name()),
            Peer::SglangCacheAware => "sglang".into(),
            Peer::Oracle => "oracle".into(),
            Peer::Baseline(peer) => format!("baseline-{}", peer.cli_name()),
        }
    }

    /// A `--peers` name: random, least-outstanding, prefix-aware (the
    /// filter's default matching), prefix-N (FIXED_PREFIX at prefix_length
    /// N), longest-B (LONGEST_PREFIX with block_bytes B), margin-M
    /// (LONGEST_PREFIX with load_margin M, 0 allowed), balanced
    /// (LONGEST_PREFIX with cold_placement BALANCED), adapters (the defaults
    /// with adapters), prefix-aware-engine
    /// (the defaults with engine_load), sglang, oracle;
    /// ARM-N-envoys: an arm through one Envoy, run through N (2 or more);
    /// baseline-ARM: an arm through Envoy with the `--baseline-wasm` build.
    pub fn parse(name: &str) -> Result<Peer, String> {
        // Leaked: a handful per benchmark process, so that arms stay `Copy`.
        let leak = |peer: Peer| -> &'static Peer { Box::leak(Box::new(peer)) };
        if let Some(arm) = name.strip_prefix("baseline-") {
            return match Peer::parse(arm)? {
                Peer::Baseline(_) | Peer::SglangCacheAware | Peer::Oracle => Err(format!(
                    "{name:?}: baseline-ARM takes an arm that runs through Envoy"
                )),
                peer => Ok(Peer::Baseline(leak(peer))),
            };
        }
        if let Some((arm, envoys)) = name
            .strip_suffix("-envoys")
            .and_then(|rest| rest.rsplit_once('-'))
        {
            let envoys = envoys.parse::<usize>().ok().filter(|&n| n >= 2);
            return match (Peer::parse(arm)?, envoys) {
                (peer, Some(envoys)) if peer.envoys() == 1 => Ok(Peer::Replicated {
                    arm: leak(peer),
                    envoys,
                }),
                _ => Err(format!(
                    "{name:?}: ARM-N-envoys takes an arm that runs through one Envoy \
                     and N of 2 or more"
                )),
            };
        }
        let number = |prefix: &str| {
            name.strip_prefix(prefix)
                .map(|n| n.parse::<u32>().ok().filter(|&n| n > 0))
        };
        Ok(match name {
            "random" => Peer::Filter(Strategy::Random),
            "least-outstanding" => Peer::Filter(Strategy::LeastOutstandingRequests),
            "prefix-aware" => Peer::Filter(Strategy::PrefixAware),
            "balanced" => Peer::Balanced,
            "adapters" => Peer::Adapters,
            "adapters-engine" => Peer::AdaptersEngine,
            "prefix-aware-engine" => Peer::PrefixAwareEngine,
            "sglang" => Peer::SglangCacheAware,
            "oracle" => Peer::Oracle,
            _ if name.starts_with("margin-") => match name["margin-".len()..].parse::<u32>() {
                Ok(margin) => Peer::LoadMargin(margin),
                Err(_) => {
                    return Err(format!(
                        "{name:?}: margin-M takes a load_margin M of 0 or more"
                    ))
                }
            },
            _ => match (number("prefix-"), number("longest-")) {
                (Some(Some(length)), _) => Peer::FixedPrefix(length),
                (_, Some(Some(block))) => Peer::LongestPrefix(block),
                _ => {
                    return Err(format!(
                        "unknown peer {name:?}: random, least-outstanding, prefix-aware, \
                         prefix-N, longest-B, margin-M, balanced, adapters, prefix-aware-engine, sglang, \
                         oracle, ARM-N-envoys or baseline-ARM"
                    ))
                }
            },
        })
    }

    /// The filter's plugin configuration for the arms that run through
    /// Envoy (None for the others): the fields every arm shares
    /// ([`base_plugin_config`]) and the arm's own.
    pub fn plugin_config(self, upstreams: &[SocketAddr]) -> Option<serde_json::Value> {
        let (strategy, matching) = match self {
            Peer::Filter(strategy) => (strategy, json!({})),
            Peer::FixedPrefix(length) => (
                Strategy::PrefixAware,
                json!({"match": "FIXED_PREFIX", "prefix_length": length}),
            ),
            Peer::LongestPrefix(block) => (
                Strategy::PrefixAware,
                json!({"match": "LONGEST_PREFIX", "block_bytes": block}),
            ),
            Peer::LoadMargin(margin) => (
                Strategy::PrefixAware,
                json!({"match": "LONGEST_PREFIX", "load_margin": margin}),
            ),
            Peer::Adapters => (
                Strategy::PrefixAware,
                json!({"adapters": {"base_models": [super::bodies::MODEL]}}),
            ),
            Peer::AdaptersEngine => (
                Strategy::PrefixAware,
                json!({
                    "adapters": {"base_models": [super::bodies::MODEL]},
                    "engine_load": engine_load_config(None),
                }),
            ),
            Peer::Balanced => (
                Strategy::PrefixAware,
                json!({"match": "LONGEST_PREFIX", "cold_placement": "BALANCED"}),
            ),
            Peer::PrefixAwareEngine => (
                Strategy::PrefixAware,
                json!({"engine_load": engine_load_config(None)}),
            ),
            Peer::Replicated { arm: peer, .. } | Peer::Baseline(peer) => {
                return peer.plugin_config(upstreams)
            }
            Peer::SglangCacheAware | Peer::Oracle => return None,
        };
        let mut config = base_plugin_config(upstreams);
        config.insert("strategy".into(), strategy.config_name().into());
        if let serde_json::Value::Object(fields) = matching {
            config.extend(fields);
        }
        Some(serde_json::Value::Object(config))
    }

    /// Envoys the arm runs (each with [`Peer::plugin_config`]).
    pub fn envoys(self) -> usize {
        match self {
            Peer::Replicated { envoys, .. } => envoys,
            Peer::SglangCacheAware | Peer::Oracle => 0,
            Peer::Baseline(peer) => peer.envoys(),
            _ => 1,
        }
    }

    /// How the run realises it, for the report.
    pub fn mechanism(self) -> String {
        match self {
            Peer::Filter(Strategy::Random) => {
                "filter strategy RANDOM (no key): Envoy's MAGLEV picks a random host".into()
            }
            Peer::Filter(Strategy::LeastOutstandingRequests) => {
                "filter strategy LEAST_OUTSTANDING_REQUESTS: routed to the least_request (FULL_SCAN) cluster".into()
            }
            Peer::Filter(Strategy::PrefixAware) => {
                "filter strategy PREFIX_AWARE at its defaults (no match, prefix_length or block_bytes sent): \
                 LONGEST_PREFIX, the instance holding the longest chain of the prompt's block hashes".into()
            }
            Peer::FixedPrefix(length) => format!(
                "filter strategy PREFIX_AWARE, match FIXED_PREFIX, prefix_length {length}: the key (the prompt's first {length} bytes) hashed by MAGLEV"
            ),
            Peer::LongestPrefix(block) => format!(
                "filter strategy PREFIX_AWARE, match LONGEST_PREFIX, block_bytes {block}, other fields at their defaults"
            ),
            Peer::LoadMargin(margin) => format!(
                "filter strategy PREFIX_AWARE, match LONGEST_PREFIX, load_margin {margin}, other fields at their defaults"
            ),
            Peer::Replicated { arm, envoys } => format!(
                "{envoys} Envoys, each as {} ({}), in front of the same fleet; the load generator sends \
                 turn t of conversation c to Envoy (c + t) mod {envoys} (consecutive turns through different \
                 Envoys), other requests i to Envoy i mod {envoys}",
                arm.cli_name(),
                arm.mechanism()
            ),
            Peer::Adapters => format!(
                "filter strategy PREFIX_AWARE at its defaults with adapters {{base_models: [{}]}}: each \
                 adapter's requests within its set (rendezvous on the adapter, grown past the load bound)",
                super::bodies::MODEL
            ),
            Peer::AdaptersEngine => format!(
                "{}, with engine_load {{cluster: {}}}: the instances whose engine runs an adapter \
                 (vllm:lora_requests_info) join its set",
                Peer::Adapters.mechanism(),
                super::engine_load::ENGINE_CLUSTER
            ),
            Peer::Balanced => "filter strategy PREFIX_AWARE, match LONGEST_PREFIX, cold_placement BALANCED, \
                 other fields at their defaults"
                .into(),
            Peer::PrefixAwareEngine => format!(
                "filter strategy PREFIX_AWARE at its defaults with engine_load {{cluster: {}}} (every other \
                 engine_load field at its default: vLLM's series, /metrics every 500 ms, no fleet-wide bound): \
                 an instance's load is its engine's running + waiting plus what this Envoy sent since the sample",
                super::engine_load::ENGINE_CLUSTER
            ),
            Peer::SglangCacheAware => format!(
                "{SGLANG_ROUTER_REQUIREMENT} (python -m sglang_router.launch_router) --policy cache_aware \
                 --worker-startup-check-interval 1 --disable-retries --log-level warn, defaults otherwise"
            ),
            Peer::Oracle => "no proxy: the load generator sends group (or conversation) g straight to instance g mod the number of instances".into(),
            Peer::Baseline(peer) => format!("{}; the filter built as --baseline-wasm names", peer.mechanism()),
        }
    }
}

impl Serialize for Peer {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            // The existing reports' values.
            Peer::Filter(strategy @ (Strategy::Random | Strategy::LeastOutstandingRequests)) => {
                strategy.serialize(serializer)
            }
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
            .chain(SYNTHETIC_PEERS)
            .chain(Strategy::ALL.into_iter().map(Peer::Filter))
            .chain([
                Peer::LongestPrefix(64),
                Peer::LoadMargin(0),
                Peer::LoadMargin(16),
                Peer::Balanced,
                Peer::Adapters,
                Peer::AdaptersEngine,
                Peer::PrefixAwareEngine,
                Peer::Replicated {
                    arm: &Peer::Filter(Strategy::PrefixAware),
                    envoys: 2,
                },
                Peer::Replicated {
                    arm: &Peer::LoadMargin(16),
                    envoys: 3,
                },
                Peer::Replicated {
                    arm: &Peer::PrefixAwareEngine,
                    envoys: 3,
                },
            ])
        {
            assert_eq!(Peer::parse(&peer.cli_name()), Ok(peer));
        }
        for arm in [
            "balanced",
            "prefix-aware",
            "prefix-aware-2-envoys",
            "prefix-1024",
            "random",
        ] {
            let baseline = Peer::parse(&format!("baseline-{arm}")).unwrap();
            let inner = Peer::parse(arm).unwrap();
            assert!(matches!(baseline, Peer::Baseline(peer) if *peer == inner));
            assert_eq!(
                baseline.plugin_config(&fleet()),
                inner.plugin_config(&fleet())
            );
            assert_eq!(baseline.envoys(), inner.envoys());
            assert_eq!(Peer::parse(&baseline.cli_name()), Ok(baseline));
        }
        assert_eq!(Peer::parse("prefix-2048"), Ok(Peer::FixedPrefix(2048)));
        assert_eq!(Peer::parse("longest-1024"), Ok(Peer::LongestPrefix(1024)));
        assert_eq!(
            Peer::parse("prefix-aware-engine-3-envoys"),
            Ok(Peer::Replicated {
                arm: &Peer::PrefixAwareEngine,
                envoys: 3
            })
        );
        assert_eq!(
            Peer::parse("prefix-4096-12-envoys"),
            Ok(Peer::Replicated {
                arm: &Peer::FixedPrefix(4096),
                envoys: 12
            })
        );
        for bad in [
            "prefix-0",
            "prefix-x",
            "longest-0",
            "longest-",
            "margin-",
            "margin-x",
            "round-robin",
            "prefix-aware-balanced",
            "baseline-sglang",
            "baseline-oracle",
            "baseline-baseline-balanced",
            "baseline-",
            "two-envoys",
            "prefix-aware-1-envoys",
            "prefix-aware-0-envoys",
            "prefix-aware-x-envoys",
            "prefix-aware--envoys",
            "-2-envoys",
            "sglang-2-envoys",
            "oracle-2-envoys",
            "prefix-aware-2-envoys-2-envoys",
            "baseline-balanced-2-envoys-3-envoys",
        ] {
            assert!(Peer::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn existing_strategies_keep_their_report_names() {
        assert_eq!(
            serde_json::to_value(Peer::Filter(Strategy::Random)).unwrap(),
            "RANDOM"
        );
        assert_eq!(
            serde_json::to_value(Peer::Filter(Strategy::LeastOutstandingRequests)).unwrap(),
            "LEAST_OUTSTANDING_REQUESTS"
        );
        assert_eq!(
            serde_json::to_value(Peer::FixedPrefix(1024)).unwrap(),
            "PREFIX_AWARE@1024"
        );
        // Not "PREFIX_AWARE": in earlier reports that was fixed-prefix matching at 4096.
        assert_eq!(
            serde_json::to_value(Peer::Filter(Strategy::PrefixAware)).unwrap(),
            "PREFIX_AWARE (longest)"
        );
    }

    fn fleet() -> Vec<SocketAddr> {
        vec![
            "127.0.0.1:8001".parse().unwrap(),
            "127.0.0.1:8002".parse().unwrap(),
        ]
    }

    /// The arm's plugin configuration without the fields every arm shares.
    fn own_fields(peer: Peer) -> serde_json::Value {
        let mut config = peer.plugin_config(&fleet()).expect("runs through Envoy");
        let object = config.as_object_mut().expect("an object");
        for shared in base_plugin_config(&fleet()).keys() {
            assert!(object.remove(shared).is_some(), "{peer:?} lacks {shared}");
        }
        config
    }

    #[test]
    fn fixed_prefix_arms_ask_for_fixed_prefix_matching_at_their_length() {
        assert_eq!(
            own_fields(Peer::FixedPrefix(1024)),
            json!({"strategy": "PREFIX_AWARE", "match": "FIXED_PREFIX", "prefix_length": 1024})
        );
        assert_eq!(own_fields(Peer::FixedPrefix(16384))["prefix_length"], 16384);
    }

    #[test]
    fn the_default_arm_sends_neither_match_nor_prefix_length() {
        assert_eq!(
            own_fields(Peer::Filter(Strategy::PrefixAware)),
            json!({"strategy": "PREFIX_AWARE"})
        );
        assert_eq!(Peer::Filter(Strategy::PrefixAware).envoys(), 1);
        assert_eq!(
            own_fields(Peer::Balanced),
            json!({"strategy": "PREFIX_AWARE", "match": "LONGEST_PREFIX", "cold_placement": "BALANCED"})
        );
    }

    #[test]
    fn replicated_arms_run_their_arm_through_their_envoys() {
        for name in [
            "prefix-aware",
            "balanced",
            "prefix-aware-engine",
            "prefix-1024",
            "random",
        ] {
            let arm = Peer::parse(name).unwrap();
            for envoys in [2, 3] {
                let replicated = Peer::parse(&format!("{name}-{envoys}-envoys")).unwrap();
                assert_eq!(own_fields(replicated), own_fields(arm), "{name}");
                assert_eq!(replicated.envoys(), envoys);
                assert_eq!(
                    replicated.name(),
                    format!("{}, {envoys} Envoys", arm.name())
                );
            }
        }
        // The report names earlier runs recorded.
        let names: Vec<String> = [
            "prefix-aware-2-envoys",
            "balanced-2-envoys",
            "prefix-aware-engine-3-envoys",
            "prefix-aware-3-envoys",
            "balanced-3-envoys",
        ]
        .into_iter()
        .map(|name| Peer::parse(name).unwrap().name())
        .collect();
        assert_eq!(
            names,
            [
                "PREFIX_AWARE (longest), 2 Envoys",
                "PREFIX_AWARE (longest, BALANCED), 2 Envoys",
                "PREFIX_AWARE (longest) + engine load, 3 Envoys",
                "PREFIX_AWARE (longest), 3 Envoys",
                "PREFIX_AWARE (longest, BALANCED), 3 Envoys",
            ]
        );
    }

    #[test]
    fn engine_arms_add_engine_load_to_the_defaults_and_nothing_else() {
        assert_eq!(
            own_fields(Peer::PrefixAwareEngine),
            json!({"strategy": "PREFIX_AWARE", "engine_load": {"cluster": "engine_metrics"}})
        );
        assert_eq!(Peer::PrefixAwareEngine.envoys(), 1);
    }

    #[test]
    fn longest_arms_send_their_block_size_and_other_arms_no_prefix_fields() {
        assert_eq!(
            own_fields(Peer::LongestPrefix(64)),
            json!({"strategy": "PREFIX_AWARE", "match": "LONGEST_PREFIX", "block_bytes": 64})
        );
        assert_eq!(
            own_fields(Peer::Filter(Strategy::Random)),
            json!({"strategy": "RANDOM"})
        );
        assert_eq!(
            own_fields(Peer::Filter(Strategy::LeastOutstandingRequests)),
            json!({"strategy": "LEAST_OUTSTANDING_REQUESTS"})
        );
        for peer in [Peer::SglangCacheAware, Peer::Oracle] {
            assert_eq!(peer.plugin_config(&fleet()), None);
            assert_eq!(peer.envoys(), 0);
        }
    }

    #[test]
    fn no_arm_sends_key_balancing() {
        for peer in DATA_PEERS.into_iter().chain(SYNTHETIC_PEERS) {
            if let Some(config) = peer.plugin_config(&fleet()) {
                assert!(config.get("key_balance_factor").is_none(), "{peer:?}");
            }
        }
    }

    #[test]
    fn healthy_workers_are_counted_from_the_routers_answer() {
        let body = r#"{"workers":[{"url":"a","is_healthy":true},{"url":"b","is_healthy":false},{"url":"c","is_healthy":true}],"total":3}"#;
        assert_eq!(healthy_workers(body), Some(2));
        assert_eq!(healthy_workers("not json"), None);
        assert_eq!(healthy_workers("{}"), None);
    }
}
