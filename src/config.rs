//! The plugin configuration: parsed from Envoy's `configuration` JSON and
//! validated up front, so a typo, a key given twice or an out-of-range value
//! is rejected with a message naming the field instead of silently doing
//! something else.
//!
//! serde derives the reading of [`ConfigDocument`] (the fields as written,
//! unknown ones refused); [`ConfigDocument::validate`] then checks ranges and
//! the rules across fields once, giving the [`Config`] the filter uses.
//! `document` reads the JSON (refusing duplicate keys) and names the field
//! of every error by its path.

mod document;

use std::fmt;

use serde::{Deserialize, Deserializer};
use serde_json::Value;

use crate::classify::{default_path_rules, ApiKind, PathRule};
pub use crate::engine_load::metrics_text::Series;
use crate::headers::{
    DEFAULT_HOST_HEADER, DEFAULT_KEY_HEADER, DEFAULT_TENANT_HEADER, INTERNAL_REQUEST_HEADERS,
};
use crate::load::EngineBounds;

/// A configuration enum's spellings, written once: read by serde (an unknown
/// one lists them), written back by `as_str` (an exhaustive match, so a
/// variant without a spelling does not compile), and listed in the schema.
macro_rules! spellings {
    ($enum:ident { $($variant:ident => $spelling:literal),+ $(,)? }) => {
        impl $enum {
            const SPELLINGS: &'static [&'static str] = &[$($spelling),+];

            /// The configuration spelling.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($enum::$variant => $spelling),+
                }
            }
        }

        impl<'de> Deserialize<'de> for $enum {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let text = String::deserialize(deserializer)?;
                match text.as_str() {
                    $($spelling => Ok($enum::$variant),)+
                    _ => Err(serde::de::Error::unknown_variant(&text, Self::SPELLINGS)),
                }
            }
        }

        #[cfg(feature = "schema")]
        impl serde::Serialize for $enum {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        #[cfg(feature = "schema")]
        impl schemars::JsonSchema for $enum {
            fn inline_schema() -> bool {
                true
            }

            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($enum).into()
            }

            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                schemars::json_schema!({"type": "string", "enum": Self::SPELLINGS})
            }
        }
    };
}

spellings!(ApiKind {
    ChatCompletions => "chat_completions",
    Completions => "completions",
    Responses => "responses",
    Invoke => "invoke",
});

/// How requests are spread over the instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Requests that begin alike get the same key, hence the same instance.
    PrefixAware,
    /// Least outstanding requests: Envoy's `least_request` cluster, selected
    /// through the route header (the filter writes no key for it).
    LeastOutstandingRequests,
    /// No key: Envoy's hashing load balancer picks at random.
    Random,
}

spellings!(Strategy {
    PrefixAware => "PREFIX_AWARE",
    LeastOutstandingRequests => "LEAST_OUTSTANDING_REQUESTS",
    Random => "RANDOM",
});

/// How PREFIX_AWARE matches a request's prompt against what was routed before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Matching {
    /// The prompt, cut into chained blocks, goes to the instance that holds
    /// the longest prefix of it, weighed against load; cold prompts are
    /// placed by rendezvous hashing of their opening (`crate::blocks`).
    LongestPrefix,
    /// One key from the first `prefix_length` bytes or characters; Maglev on
    /// the key picks the instance (the reference system's semantics).
    FixedPrefix,
}

spellings!(Matching {
    LongestPrefix => "LONGEST_PREFIX",
    FixedPrefix => "FIXED_PREFIX",
});

impl Matching {
    /// `prefix_length` when the configuration does not set it: for
    /// LONGEST_PREFIX the most of a prompt considered, long enough to reach
    /// past a long system prompt into the conversation's own text; for
    /// FIXED_PREFIX the key's length.
    pub fn default_prefix_length(self) -> usize {
        match self {
            Matching::LongestPrefix => 16_384,
            Matching::FixedPrefix => 4_096,
        }
    }
}

/// Where requests are counted in flight on the instance that serves them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counting {
    /// The same module also runs as the cluster's upstream filter, which sees
    /// the chosen instance when the upstream request starts: exact counts, and
    /// a new key's target is learned from its first request on.
    UpstreamFilter,
    /// The listener filter alone: a request is counted where the decision
    /// predicted it would go, and corrected (or, for a key not learned yet,
    /// counted and learned) when its response headers name the instance. One
    /// filter fewer per request, and what Istio's `WasmPlugin` can deploy; but
    /// a new key's first requests are only pending until a response arrives.
    Listener,
}

spellings!(Counting {
    UpstreamFilter => "UPSTREAM_FILTER",
    Listener => "LISTENER",
});

/// How LONGEST_PREFIX places a prompt no instance holds (`cold_placement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColdPlacement {
    /// On its opening's first rendezvous choice: every replica places a
    /// cold prompt on the same instance, whatever traffic it saw.
    Consistent,
    /// On the first choice, or, for a first turn or single prompt of at
    /// least 2 KiB, the second when this worker placed more prompt bytes on
    /// the first: what the instances' KV caches hold evens out, and
    /// replicas whose traffic differs place such a prompt on one of the
    /// same two instances.
    Balanced,
}

spellings!(ColdPlacement {
    Consistent => "CONSISTENT",
    Balanced => "BALANCED",
});

/// The validated plugin configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub strategy: Strategy,
    /// PREFIX_AWARE's matching mode (configured as `match`).
    pub matching: Matching,
    /// Bytes (raw) or characters (canonical text) of prefix in the key
    /// (FIXED_PREFIX), or the most of a prompt matched (LONGEST_PREFIX).
    pub prefix_length: usize,
    /// LONGEST_PREFIX: bytes per block of the prompt (the unit of matching).
    pub block_bytes: usize,
    /// LONGEST_PREFIX: the prefix index's shared-data budget, in bytes.
    pub index_bytes: u64,
    /// LONGEST_PREFIX: requests in flight above the least loaded instance
    /// at which an instance is passed over for a less loaded one.
    pub load_margin: u32,
    /// LONGEST_PREFIX: how a prompt no instance holds is placed.
    pub cold_placement: ColdPlacement,
    /// In-flight cap per target instance (see `docs/design.md`).
    pub concurrency_threshold: u32,
    /// Request header the key is written to (lowercase).
    pub key_header: String,
    /// Request header naming the tenant (lowercase).
    pub tenant_header: String,
    /// Most body bytes the filter holds while extracting.
    pub max_body_bytes: usize,
    /// Whether the body's `model` is part of the key.
    pub include_model: bool,
    /// Whether a request without the tenant header takes its tenant from the
    /// body's top-level `prompt_cache_key`. That field may stand anywhere in
    /// the object, so the body is read to its end; `false` stops reading at
    /// the prefix (and `model`), as a request with the tenant header does.
    pub body_tenant: bool,
    /// First matching suffix wins.
    pub path_rules: Vec<PathRule>,
    /// Request header Envoy's `override_host` policy reads (`ip:port`): where
    /// overflow nominates another instance. `None` (configured as `null`):
    /// overflow re-keys with a salt instead.
    pub host_header: Option<String>,
    /// Response header carrying `<decision>; instance=<ip:port>` (debugging);
    /// `None`: not sent.
    pub decision_header: Option<String>,
    /// Whether the responses to prefix-aware decisions are read for the
    /// engine's `usage` (the `prefix_router.usage.*` counters).
    pub read_usage: bool,
    /// How long an instance not seen serving stays an overflow candidate.
    pub instance_ttl_ms: u64,
    /// Where in-flight requests are counted (see [`Counting`]).
    pub counting: Counting,
    /// The fleet, known before the first request: `ip:port` of every
    /// instance of the cluster, registered at start and never forgotten by
    /// `instance_ttl_ms` while listed (instances learned from traffic still
    /// are). Empty (the default): learned from traffic only.
    pub instances: std::rc::Rc<[String]>,
    /// Polling the engines' own load (`engine_load`); `None` (the default):
    /// no polling, decisions use this Envoy's counts alone.
    pub engine_load: Option<EngineLoadConfig>,
    /// Reading the fleet from Envoy's admin (`discovery`); `None` (the
    /// default): `instances`, or learned from traffic.
    pub discovery: Option<DiscoveryConfig>,
    /// LoRA adapters served by sticky sets of instances (`adapters`);
    /// `None` (the default): an adapter's requests route as any model's.
    pub adapters: Option<AdaptersConfig>,
    /// The fleet's name in the stat names (`prefix_router.fleet.<name>.*`),
    /// so that several fleets behind one Envoy keep their stats apart;
    /// `None` (the default): `prefix_router.*`.
    pub fleet: Option<String>,
}

/// Which engine's series names `engine_load` reads unless it names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Vllm,
    Sglang,
    Llamacpp,
}

spellings!(Engine {
    Vllm => "VLLM",
    Sglang => "SGLANG",
    Llamacpp => "LLAMACPP",
});

impl Engine {
    /// The series the engine exports: running, waiting, KV usage (0..1).
    pub fn series(self) -> Series {
        let (running, waiting, kv) = match self {
            Engine::Vllm => (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                Some("vllm:kv_cache_usage_perc"),
            ),
            Engine::Sglang => (
                "sglang:num_running_reqs",
                "sglang:num_queue_reqs",
                Some("sglang:token_usage"),
            ),
            Engine::Llamacpp => (
                "llamacpp:requests_processing",
                "llamacpp:requests_deferred",
                None,
            ),
        };
        Series {
            running: running.to_string(),
            waiting: waiting.to_string(),
            kv_usage: kv.map(str::to_string),
        }
    }
}

/// `engine_load`: where and how often the engines' `/metrics` are polled,
/// which series are read, and the fleet-wide bounds decisions apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineLoadConfig {
    /// The Envoy cluster the calls go through (see `docs/design.md`,
    /// "Engine load": an ORIGINAL_DST cluster that takes the host from a
    /// header).
    pub cluster: String,
    pub engine: Engine,
    /// The series names read: the engine's, or those configured.
    pub series: Series,
    /// The metrics path, e.g. `/metrics`.
    pub path: String,
    /// Mean time between two polls of one instance (each jittered by
    /// [`ENGINE_JITTER_PERCENT`]).
    pub interval_ms: u64,
    /// Most a poll may take; never more than the interval.
    pub timeout_ms: u64,
    /// A sample older than this is not used.
    pub max_age_ms: u64,
    /// Bound of an instance's running + waiting, as estimated.
    pub max_requests: Option<u32>,
    /// Bound of an instance's KV-cache usage, in thousandths.
    pub max_kv_usage_permille: Option<u16>,
}

impl EngineLoadConfig {
    /// What works but not as one would expect, for the configure log.
    pub fn warnings(&self, listed_instances: usize) -> Vec<String> {
        let mut warnings = Vec::new();
        // The next poll is sent up to the interval plus its jitter after the
        // last one and may take up to timeout_ms: a sample younger than that
        // at its end can lapse before the next one arrives.
        let next_sample_ms =
            self.interval_ms * (100 + ENGINE_JITTER_PERCENT) / 100 + self.timeout_ms;
        if self.max_age_ms < next_sample_ms {
            warnings.push(format!(
                "engine_load.max_age_ms {} is less than the interval and its jitter plus \
                 timeout_ms ({next_sample_ms}): an instance's sample may lapse before the \
                 next one arrives, and decisions then count only this Envoy's requests on it",
                self.max_age_ms
            ));
        }
        let instances = u64::try_from(listed_instances).unwrap_or(u64::MAX);
        let polls_per_second = instances.saturating_mul(1_000) / self.interval_ms.max(1);
        if polls_per_second > ENGINE_POLLS_PER_SECOND_WARN {
            let interval_ms = instances
                .saturating_mul(1_000)
                .div_ceil(ENGINE_POLLS_PER_SECOND_WARN);
            warnings.push(format!(
                "engine_load polls each of the {instances} listed instances every {} ms: \
                 {polls_per_second} polls a second, each about 0.12 to 0.2 ms of one worker \
                 (vLLM's /metrics of 45 KB), some {}-{} % of a core; an interval_ms of \
                 {interval_ms} or more keeps it to {ENGINE_POLLS_PER_SECOND_WARN} a second",
                self.interval_ms,
                polls_per_second * 12 / 1_000,
                polls_per_second * 2 / 100
            ));
        }
        warnings
    }

    /// The fleet-wide bounds decisions apply.
    pub fn bounds(&self) -> EngineBounds {
        EngineBounds {
            max_requests: self.max_requests,
            max_kv_usage_permille: self.max_kv_usage_permille,
        }
    }

    /// The settings, for the configure log line.
    pub fn describe(&self) -> String {
        let bound = |b: Option<String>| b.unwrap_or_else(|| "none".to_string());
        format!(
            "engine {}, cluster {}, path {}, series {} + {} (kv {}), interval_ms {}, timeout_ms {}, max_age_ms {}, max_requests {}, max_kv_usage {}",
            self.engine.as_str(),
            self.cluster,
            self.path,
            self.series.running,
            self.series.waiting,
            self.series.kv_usage.as_deref().unwrap_or("none"),
            self.interval_ms,
            self.timeout_ms,
            self.max_age_ms,
            bound(self.max_requests.map(|m| m.to_string())),
            bound(
                self.max_kv_usage_permille
                    .map(|m| format!("{}", f64::from(m) / 1000.0))
            ),
        )
    }
}

/// `discovery`: the fleet read from Envoy's admin `/clusters`
/// ([`crate::discovery`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryConfig {
    /// The Envoy cluster that leads to Envoy's own admin interface.
    pub admin_cluster: String,
    /// The cluster whose healthy hosts are the fleet.
    pub cluster: String,
    /// Time between two reads of the admin.
    pub interval_ms: u64,
}

impl DiscoveryConfig {
    /// Most a read may take: the admin is local, so a slow one is stuck.
    pub fn timeout_ms(&self) -> u64 {
        self.interval_ms.min(DISCOVERY_TIMEOUT_MS_MAX)
    }
}

/// `adapters`: which requests name a LoRA adapter, and how many instances
/// serve one ([`crate::strategy::LongestPrefix`]'s adapter set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdaptersConfig {
    /// The `model` values that name a base model; any other names an adapter.
    pub base_models: Vec<String>,
    /// A request header naming the adapter, read before the body's `model`
    /// (for APIs whose body names none).
    pub header: Option<String>,
    /// Instances an adapter's set has however cool it is.
    pub min_instances: u32,
    /// Instances an adapter's set has at most, however hot it is.
    pub max_instances: u32,
}

impl AdaptersConfig {
    /// The adapter a request names: the `header`'s value where the request
    /// carries it once, else the body's `model`. None: a base model, or no
    /// name. Any bytes, any length: decisions keep only its xxh3.
    pub fn adapter_name<'a>(
        &self,
        header: Option<&'a [u8]>,
        model: Option<&'a str>,
    ) -> Option<&'a [u8]> {
        let name = header.or(model.map(str::as_bytes))?;
        let base = self.base_models.iter().any(|b| b.as_bytes() == name);
        (!name.is_empty() && !base).then_some(name)
    }
}

pub const ADAPTER_INSTANCES_RANGE: (u64, u64) = (1, MAX_INSTANCES as u64);
/// The most base models `adapters.base_models` lists, and the longest name.
pub const MAX_BASE_MODELS: usize = 64;
pub const MAX_MODEL_NAME_BYTES: usize = 256;

/// `discovery.interval_ms` unless configured: a new or removed host is seen
/// within this, and each read is one local admin call per Envoy.
pub const DISCOVERY_INTERVAL_MS_DEFAULT: u64 = 2_000;
pub const DISCOVERY_INTERVAL_MS_RANGE: (u64, u64) = (100, 600_000);
const DISCOVERY_TIMEOUT_MS_MAX: u64 = 1_000;

/// `engine_load.interval_ms` unless configured: measured cost and the
/// reasoning are in `docs/configuration.md`.
pub const ENGINE_INTERVAL_MS_DEFAULT: u64 = 500;
pub const ENGINE_INTERVAL_MS_RANGE: (u64, u64) = (50, 60_000);
/// Polls a second past which `engine_load` is warned about at configure:
/// where polling costs one worker a few percent of a core (docs/benchmarks.md,
/// "Engine load").
pub const ENGINE_POLLS_PER_SECOND_WARN: u64 = 250;
/// Each poll is due `interval_ms` +- this share of it after the last one,
/// so that many proxies started together do not poll in step.
pub const ENGINE_JITTER_PERCENT: u64 = 20;
/// `engine_load.timeout_ms` unless configured: 80 % of the interval (so a
/// poll ends before the earliest jittered next one is due), at most this.
pub const ENGINE_TIMEOUT_MS_DEFAULT_MAX: u64 = 2_000;
pub const ENGINE_TIMEOUT_MS_MIN: u64 = 10;
pub const ENGINE_TIMEOUT_MS_MAX: u64 = 60_000;
/// `engine_load.max_age_ms` unless configured: this many intervals.
pub const ENGINE_MAX_AGE_INTERVALS: u64 = 3;
pub const ENGINE_MAX_AGE_MS_MAX: u64 = 600_000;
pub const ENGINE_MAX_REQUESTS_RANGE: (u64, u64) = (1, 1_000_000);
pub const PREFIX_LENGTH_RANGE: (u64, u64) = (1024, 65536);
/// From a quarter of a vLLM block of text (16 tokens, ~64 bytes) to 4 KiB.
pub const BLOCK_BYTES_RANGE: (u64, u64) = (64, 4096);
/// From 64 KiB to 256 MiB of shared data.
pub const INDEX_BYTES_RANGE: (u64, u64) = (64 * 1024, 256 * 1024 * 1024);
pub const LOAD_MARGIN_RANGE: (u64, u64) = (0, 1024);
pub const CONCURRENCY_THRESHOLD_RANGE: (u64, u64) = (1, 1024);
/// Upper bound well below anything Envoy would buffer by default; the lower
/// bound is also at least `prefix_length`.
pub const MAX_BODY_BYTES_RANGE: (u64, u64) = (1024, 64 * 1024 * 1024);
/// Bounds the per-request classification work.
pub const MAX_PATH_RULES: usize = 64;
/// From a second (shorter would forget instances between requests of a quiet
/// fleet) to an hour (longer keeps nominating instances long gone).
pub const INSTANCE_TTL_MS_RANGE: (u64, u64) = (1_000, 3_600_000);
/// The instance registry's size (`LoadConfig::max_instances`): a longer list
/// could not be tracked.
pub const MAX_INSTANCES: usize = crate::load::MAX_INSTANCES as usize;
/// Header names Envoy gives a meaning of its own (framing, hop-by-hop,
/// authority): writing a routing key into one would break the request.
const RESERVED_KEY_HEADERS: [&str; 9] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "upgrade",
    "expect",
];

impl Default for Config {
    fn default() -> Self {
        Config {
            strategy: Strategy::PrefixAware,
            matching: Matching::LongestPrefix,
            prefix_length: Matching::LongestPrefix.default_prefix_length(),
            block_bytes: 256,
            index_bytes: 8 * 1024 * 1024,
            load_margin: 4,
            cold_placement: ColdPlacement::Consistent,
            concurrency_threshold: 10,
            key_header: DEFAULT_KEY_HEADER.to_string(),
            tenant_header: DEFAULT_TENANT_HEADER.to_string(),
            max_body_bytes: 1024 * 1024,
            include_model: true,
            body_tenant: true,
            path_rules: default_path_rules(),
            host_header: Some(DEFAULT_HOST_HEADER.to_string()),
            decision_header: None,
            read_usage: true,
            instance_ttl_ms: 60_000,
            counting: Counting::UpstreamFilter,
            instances: std::rc::Rc::from([]),
            engine_load: None,
            discovery: None,
            adapters: None,
            fleet: None,
        }
    }
}

/// A rejected configuration. Displays as `<field>: <problem>`, e.g.
/// `prefix_length: 100 is out of range 1024..=65536`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The field, e.g. `prefix_length` or `path_rules[1].suffix`;
    /// `configuration` for the document as a whole.
    pub field: String,
    pub problem: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.problem)
    }
}

impl std::error::Error for ConfigError {}

fn error(field: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        problem: problem.into(),
    }
}

/// A value as JSON, shortened so a huge value cannot flood the log.
fn shown(value: &Value) -> String {
    const MAX: usize = 80;
    let text = value.to_string();
    if text.len() <= MAX {
        return text;
    }
    let mut end = MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", text.get(..end).unwrap_or_default())
}

/// The JSON Schema of the plugin configuration (draft 7, which editors read
/// widely), as checked in at `docs/configuration.schema.json`.
#[cfg(feature = "schema")]
pub fn json_schema() -> String {
    let schema = schemars::generate::SchemaSettings::draft07()
        .into_generator()
        .into_root_schema_for::<ConfigDocument>();
    let mut text = serde_json::to_string_pretty(&schema).unwrap_or_default();
    text.push('\n');
    text
}

/// A string as JSON, shortened like [`shown`].
fn quoted(text: &str) -> String {
    shown(&Value::from(text))
}

/// Fields still accepted for one release after they stop doing anything:
/// `(path, what replaces it)`, the path as in errors (`engine_load.x` for a
/// field of `engine_load`). A configuration that sets one loads with a
/// warning instead of being refused, so an upgrade never fails the reload.
const DEPRECATED_FIELDS: &[(&str, &str)] = &[];

/// Removes the `deprecated` fields the document sets, with a warning for each.
fn take_deprecated(document: &mut Value, deprecated: &[(&str, &str)]) -> Vec<String> {
    let mut warnings = Vec::new();
    for (path, replacement) in deprecated {
        let (parent, name) = match path.rsplit_once('.') {
            Some((parent, name)) => (document.get_mut(parent), name),
            None => (Some(&mut *document), *path),
        };
        let removed = parent
            .and_then(Value::as_object_mut)
            .and_then(|object| object.remove(name));
        if removed.is_some() {
            warnings.push(format!(
                "{path} is deprecated and has no effect; {replacement}. A later release \
                 refuses it: remove it from the configuration"
            ));
        }
    }
    warnings
}

/// For a field whose absence means something other than `null`: present, it
/// must be a value of its type (`null` only where that type allows it).
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    deserializer: D,
) -> Result<Option<T>, D::Error> {
    T::deserialize(deserializer).map(Some)
}

/// The plugin configuration as written, every field at its default unless
/// set; [`ConfigDocument::validate`] turns it into a [`Config`]. Integers are
/// read whole (`i128`), so that a negative or huge one is reported against
/// its range.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(serde::Serialize, schemars::JsonSchema))]
#[serde(deny_unknown_fields, default, expecting = "a JSON object")]
#[cfg_attr(
    feature = "schema",
    schemars(
        title = "prefix-router plugin configuration",
        description = "The prefix-router filter's configuration (docs/configuration.md)."
    )
)]
pub struct ConfigDocument {
    /// How requests are spread over the instances.
    pub strategy: Strategy,
    /// How PREFIX_AWARE matches a prompt against what was routed before.
    #[serde(rename = "match")]
    pub matching: Matching,
    /// Bytes or characters of prompt considered (default 16384 with
    /// LONGEST_PREFIX, 4096 with FIXED_PREFIX).
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(
        feature = "schema",
        schemars(with = "u64", range(min = PREFIX_LENGTH_RANGE.0, max = PREFIX_LENGTH_RANGE.1))
    )]
    pub prefix_length: Option<i128>,
    /// LONGEST_PREFIX: bytes per block of the prompt, the unit of matching.
    #[cfg_attr(
        feature = "schema",
        schemars(with = "u64", range(min = BLOCK_BYTES_RANGE.0, max = BLOCK_BYTES_RANGE.1))
    )]
    pub block_bytes: i128,
    /// LONGEST_PREFIX: shared-data bytes of the prefix index.
    #[cfg_attr(
        feature = "schema",
        schemars(with = "u64", range(min = INDEX_BYTES_RANGE.0, max = INDEX_BYTES_RANGE.1))
    )]
    pub index_bytes: i128,
    /// LONGEST_PREFIX: requests in flight above the least loaded instance's
    /// at which an instance is passed over.
    #[cfg_attr(
        feature = "schema",
        schemars(with = "u64", range(min = LOAD_MARGIN_RANGE.0, max = LOAD_MARGIN_RANGE.1))
    )]
    pub load_margin: i128,
    /// LONGEST_PREFIX with instances listed: how a prompt no instance holds
    /// is placed.
    pub cold_placement: ColdPlacement,
    /// Requests this Envoy may have in flight on one instance before further
    /// ones go to another.
    #[cfg_attr(
        feature = "schema",
        schemars(
            with = "u64",
            range(min = CONCURRENCY_THRESHOLD_RANGE.0, max = CONCURRENCY_THRESHOLD_RANGE.1)
        )
    )]
    pub concurrency_threshold: i128,
    /// The request header the key is written to.
    pub key_header: String,
    /// The request header naming the tenant.
    pub tenant_header: String,
    /// The most body bytes the filter holds while it reads the prefix (at
    /// least prefix_length).
    #[cfg_attr(
        feature = "schema",
        schemars(with = "u64", range(min = MAX_BODY_BYTES_RANGE.0, max = MAX_BODY_BYTES_RANGE.1))
    )]
    pub max_body_bytes: i128,
    /// Whether the request's model is part of the key.
    pub include_model: bool,
    /// Without the tenant header, take the tenant from the body's
    /// prompt_cache_key.
    pub body_tenant: bool,
    /// Which path suffix means which API; the first matching rule wins.
    #[cfg_attr(feature = "schema", schemars(length(max = MAX_PATH_RULES)))]
    pub path_rules: Vec<PathRuleDocument>,
    /// Where the filter names an instance (ip:port) for Envoy's
    /// override_host policy; null: overflow re-keys instead.
    pub host_header: Option<String>,
    /// Debugging: the response header carrying the decision; null: off.
    pub decision_header: Option<String>,
    /// Whether responses are read for the engine's usage (cached tokens).
    pub read_usage: bool,
    /// How long an instance not seen serving stays an overflow target.
    #[cfg_attr(
        feature = "schema",
        schemars(with = "u64", range(min = INSTANCE_TTL_MS_RANGE.0, max = INSTANCE_TTL_MS_RANGE.1))
    )]
    pub instance_ttl_ms: i128,
    /// Where requests in flight are counted.
    pub counting: Counting,
    /// The fleet's instances as "ip:port", as Envoy prints upstream.address.
    #[cfg_attr(feature = "schema", schemars(length(max = MAX_INSTANCES)))]
    pub instances: Vec<String>,
    /// Polling the engines' own load from their /metrics; null: off.
    pub engine_load: Option<EngineLoadDocument>,
    /// Reading the fleet's hosts from Envoy's admin /clusters; null: off.
    pub discovery: Option<DiscoveryDocument>,
    /// LoRA adapters served by sticky sets of instances; null: off.
    pub adapters: Option<AdaptersDocument>,
    /// The fleet's name in the stat names (prefix_router.fleet.<name>.*).
    #[cfg_attr(
        feature = "schema",
        schemars(regex(pattern = r"^[A-Za-z0-9_-]{1,64}$"))
    )]
    pub fleet: Option<String>,
}

/// One of `path_rules` as written.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(serde::Serialize, schemars::JsonSchema))]
#[serde(
    deny_unknown_fields,
    expecting = "an object with \"suffix\" and \"api\""
)]
#[cfg_attr(
    feature = "schema",
    schemars(description = "A path suffix and the API a path ending in it speaks.")
)]
pub struct PathRuleDocument {
    /// The path's end, starting with '/', without '?' or '#'.
    pub suffix: String,
    /// The API a path ending in suffix speaks.
    pub api: ApiKind,
}

/// `engine_load` as written: a field left out takes the engine's or the
/// interval's default ([`EngineLoadDocument::validate`]).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(serde::Serialize, schemars::JsonSchema))]
#[serde(deny_unknown_fields, default, expecting = "an object")]
#[cfg_attr(
    feature = "schema",
    schemars(
        description = "Polling each instance's own load from its /metrics through an Envoy cluster.",
        extend("required" = ["cluster"])
    )
)]
pub struct EngineLoadDocument {
    /// The Envoy cluster the polls go through.
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub cluster: Option<String>,
    /// Which engine's series names are read (default VLLM).
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(feature = "schema", schemars(with = "Engine"))]
    pub engine: Option<Engine>,
    /// The series of running requests (default: the engine's).
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub running_metric: Option<String>,
    /// The series of waiting requests (default: the engine's).
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub waiting_metric: Option<String>,
    /// The series of KV-cache usage, a share (default: the engine's); null:
    /// none.
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(feature = "schema", schemars(with = "Option<String>"))]
    pub kv_usage_metric: Option<Option<String>>,
    /// The metrics path (default /metrics).
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub path: Option<String>,
    /// Mean time between two polls of one instance (default 500).
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(
        feature = "schema",
        schemars(
            with = "u64",
            range(min = ENGINE_INTERVAL_MS_RANGE.0, max = ENGINE_INTERVAL_MS_RANGE.1)
        )
    )]
    pub interval_ms: Option<i128>,
    /// Most a poll may take, at most interval_ms (default 80 % of it, at
    /// most 2000).
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(
        feature = "schema",
        schemars(with = "u64", range(min = ENGINE_TIMEOUT_MS_MIN, max = ENGINE_TIMEOUT_MS_MAX))
    )]
    pub timeout_ms: Option<i128>,
    /// A sample older than this is not used, at least interval_ms (default
    /// 3 intervals).
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(
        feature = "schema",
        schemars(
            with = "u64",
            range(min = ENGINE_INTERVAL_MS_RANGE.0, max = ENGINE_MAX_AGE_MS_MAX)
        )
    )]
    pub max_age_ms: Option<i128>,
    /// Fleet-wide bound of an instance's running + waiting requests; null:
    /// none.
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(
        feature = "schema",
        schemars(
            with = "Option<u64>",
            range(min = ENGINE_MAX_REQUESTS_RANGE.0, max = ENGINE_MAX_REQUESTS_RANGE.1)
        )
    )]
    pub max_requests: Option<i128>,
    /// Fleet-wide bound of an instance's KV-cache usage, a share in (0, 1];
    /// null: none.
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("exclusiveMinimum" = 0, "maximum" = 1))
    )]
    pub max_kv_usage: Option<f64>,
}

/// `discovery` as written.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(serde::Serialize, schemars::JsonSchema))]
#[serde(deny_unknown_fields, default, expecting = "an object")]
#[cfg_attr(
    feature = "schema",
    schemars(
        description = "Reading the fleet's healthy hosts from Envoy's own admin /clusters.",
        extend("required" = ["admin_cluster", "cluster"])
    )
)]
pub struct DiscoveryDocument {
    /// The Envoy cluster that leads to Envoy's own admin interface.
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub admin_cluster: Option<String>,
    /// The cluster whose healthy hosts are the fleet.
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub cluster: Option<String>,
    /// Time between two reads of the admin (default 2000).
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(
        feature = "schema",
        schemars(
            with = "u64",
            range(min = DISCOVERY_INTERVAL_MS_RANGE.0, max = DISCOVERY_INTERVAL_MS_RANGE.1)
        )
    )]
    pub interval_ms: Option<i128>,
}

impl DiscoveryDocument {
    /// The settings, each checked.
    pub fn validate(self) -> Result<DiscoveryConfig, ConfigError> {
        let name = |field: &str, value: Option<String>, what: &str| {
            let path = format!("discovery.{field}");
            let value = value.ok_or_else(|| error(&path, format!("missing ({what})")))?;
            cluster_name(&path, value)
        };
        let admin_cluster = name(
            "admin_cluster",
            self.admin_cluster,
            "the Envoy cluster that leads to Envoy's admin",
        )?;
        let cluster = name(
            "cluster",
            self.cluster,
            "the cluster whose hosts are the fleet",
        )?;
        let interval_ms = match self.interval_ms {
            Some(v) => in_range("discovery.interval_ms", v, DISCOVERY_INTERVAL_MS_RANGE)?,
            None => DISCOVERY_INTERVAL_MS_DEFAULT,
        };
        Ok(DiscoveryConfig {
            admin_cluster,
            cluster,
            interval_ms,
        })
    }
}

/// `adapters` as written.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(serde::Serialize, schemars::JsonSchema))]
#[serde(deny_unknown_fields, default, expecting = "an object")]
#[cfg_attr(
    feature = "schema",
    schemars(
        description = "LoRA adapters: each served by a sticky set of instances, prefix routing within it.",
        extend("required" = ["base_models"])
    )
)]
pub struct AdaptersDocument {
    /// The model names that are base models; every other model names an adapter.
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(
        feature = "schema",
        schemars(with = "Vec<String>", length(min = 1, max = MAX_BASE_MODELS))
    )]
    pub base_models: Option<Vec<String>>,
    /// A request header naming the adapter, read before the body's model.
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub header: Option<String>,
    /// Instances an adapter's set has however cool it is (default 1).
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(
        feature = "schema",
        schemars(
            with = "u64",
            range(min = ADAPTER_INSTANCES_RANGE.0, max = ADAPTER_INSTANCES_RANGE.1)
        )
    )]
    pub min_instances: Option<i128>,
    /// Instances an adapter's set has at most (default: the whole fleet).
    #[serde(deserialize_with = "present")]
    #[cfg_attr(feature = "schema", serde(skip_serializing_if = "Option::is_none"))]
    #[cfg_attr(
        feature = "schema",
        schemars(
            with = "u64",
            range(min = ADAPTER_INSTANCES_RANGE.0, max = ADAPTER_INSTANCES_RANGE.1)
        )
    )]
    pub max_instances: Option<i128>,
}

impl AdaptersDocument {
    /// The settings, each checked.
    pub fn validate(self) -> Result<AdaptersConfig, ConfigError> {
        let base_models = self.base_models.unwrap_or_default();
        if base_models.is_empty() || base_models.len() > MAX_BASE_MODELS {
            return Err(error(
                "adapters.base_models",
                format!(
                    "list 1 to {MAX_BASE_MODELS} base models (the `model` values that are not \
                     adapters)"
                ),
            ));
        }
        if let Some(name) = base_models
            .iter()
            .find(|m| m.is_empty() || m.len() > MAX_MODEL_NAME_BYTES)
        {
            return Err(error(
                "adapters.base_models",
                format!(
                    "{} is not a model name (1 to {MAX_MODEL_NAME_BYTES} bytes)",
                    quoted(name)
                ),
            ));
        }
        let header = self
            .header
            .map(|name| header_name("adapters.header", &name))
            .transpose()?;
        let instances = |field: &str, value: Option<i128>, default: u64| match value {
            Some(v) => in_range(&format!("adapters.{field}"), v, ADAPTER_INSTANCES_RANGE),
            None => Ok(default),
        };
        let min_instances = to_u32(instances("min_instances", self.min_instances, 1)?);
        let max_instances = to_u32(instances(
            "max_instances",
            self.max_instances,
            ADAPTER_INSTANCES_RANGE.1,
        )?);
        if min_instances > max_instances {
            return Err(error(
                "adapters.min_instances",
                format!("{min_instances} is more than max_instances ({max_instances})"),
            ));
        }
        Ok(AdaptersConfig {
            base_models,
            header,
            min_instances,
            max_instances,
        })
    }
}

/// An Envoy cluster name: 1 to 256 characters, no whitespace.
fn cluster_name(field: &str, name: String) -> Result<String, ConfigError> {
    if name.is_empty() || name.len() > 256 || name.chars().any(char::is_whitespace) {
        return Err(error(
            field,
            format!(
                "{} is not a cluster name (1 to 256 characters, no whitespace)",
                quoted(&name)
            ),
        ));
    }
    Ok(name)
}

impl Default for ConfigDocument {
    /// [`Config::default`], as written (`prefix_length` left to `match`).
    fn default() -> Self {
        let config = Config::default();
        ConfigDocument {
            strategy: config.strategy,
            matching: config.matching,
            prefix_length: None,
            block_bytes: config.block_bytes as i128,
            index_bytes: config.index_bytes.into(),
            load_margin: config.load_margin.into(),
            cold_placement: config.cold_placement,
            concurrency_threshold: config.concurrency_threshold.into(),
            key_header: config.key_header,
            tenant_header: config.tenant_header,
            max_body_bytes: config.max_body_bytes as i128,
            include_model: config.include_model,
            body_tenant: config.body_tenant,
            path_rules: config
                .path_rules
                .into_iter()
                .map(|rule| PathRuleDocument {
                    suffix: rule.suffix,
                    api: rule.api,
                })
                .collect(),
            host_header: config.host_header,
            decision_header: config.decision_header,
            read_usage: config.read_usage,
            instance_ttl_ms: config.instance_ttl_ms.into(),
            counting: config.counting,
            instances: config.instances.to_vec(),
            engine_load: None,
            discovery: None,
            adapters: None,
            fleet: config.fleet,
        }
    }
}

/// `value` as a `u64` in `lo..=hi`, or an error naming the field and range.
fn in_range(field: &str, value: i128, (lo, hi): (u64, u64)) -> Result<u64, ConfigError> {
    u64::try_from(value)
        .ok()
        .filter(|v| (lo..=hi).contains(v))
        .ok_or_else(|| {
            let value = integer_text(value);
            error(field, format!("{value} is out of range {lo}..={hi}"))
        })
}

/// An integer read from JSON (an `i64` or a `u64`), formatted as the one it
/// fits: the .wasm then carries no `i128` formatting for this one message.
fn integer_text(value: i128) -> String {
    match (i64::try_from(value), u64::try_from(value)) {
        (Ok(v), _) => v.to_string(),
        (_, Ok(v)) => v.to_string(),
        (Err(_), Err(_)) => "an integer beyond 64 bits".to_string(),
    }
}

/// The ranges above fit in 32 bits, so these never saturate in practice.
fn to_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

fn to_u32(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// RFC 9110 token characters; returned lowercase because Envoy stores
/// header names lowercase and HTTP/2 requires it.
fn header_name(field: &str, name: &str) -> Result<String, ConfigError> {
    let is_tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.is_empty() || !name.bytes().all(is_tchar) {
        return Err(error(
            field,
            format!(
                "{} is not an HTTP header name (1 or more of A-Z a-z 0-9 !#$%&'*+-.^_`|~)",
                quoted(name)
            ),
        ));
    }
    Ok(name.to_ascii_lowercase())
}

/// Most characters of a `fleet` name.
pub const MAX_FLEET_CHARS: usize = 64;

/// `fleet`: 1 to [`MAX_FLEET_CHARS`] of `A-Z a-z 0-9 _ -`: one level of a
/// stat name (no dot, which would add a level) that Envoy's tag extraction
/// can lift into a label as it stands.
fn fleet(name: String) -> Result<String, ConfigError> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if name.is_empty() || name.chars().count() > MAX_FLEET_CHARS || !name.chars().all(allowed) {
        return Err(error(
            "fleet",
            format!(
                "\"{name}\" is not a fleet name: 1 to {MAX_FLEET_CHARS} of A-Z a-z 0-9 _ - \
                 (it becomes one level of the stat names)"
            ),
        ));
    }
    Ok(name)
}

/// `instances`: distinct `host:port` strings (the form `upstream.address`
/// takes, so they must be spelled as Envoy prints the endpoint: an IPv4
/// address and port, or `[v6]:port`), at most [`MAX_INSTANCES`].
fn instances(items: Vec<String>) -> Result<Vec<String>, ConfigError> {
    if items.len() > MAX_INSTANCES {
        return Err(error(
            "instances",
            format!(
                "{} instances is out of range 0..={MAX_INSTANCES}",
                items.len()
            ),
        ));
    }
    for (i, text) in items.iter().enumerate() {
        let field = format!("instances[{i}]");
        if !is_socket_address(text) {
            return Err(error(
                field,
                format!(
                    "{} is not ip:port (e.g. \"10.0.0.7:8000\" or \"[fd00::7]:8000\", as Envoy prints upstream.address)",
                    quoted(text)
                ),
            ));
        }
        if items.iter().take(i).any(|known| known == text) {
            return Err(error(field, format!("{} is listed twice", quoted(text))));
        }
    }
    Ok(items)
}
/// `a.b.c.d:port` or `[v6]:port` with a port in 1..=65535, spelled the way
/// Envoy prints an endpoint (so it matches `upstream.address` byte for byte).
pub(crate) fn is_socket_address(text: &str) -> bool {
    let Some((host, port)) = text.rsplit_once(':') else {
        return false;
    };
    let port_ok = !port.starts_with('0') && port.parse::<u16>().is_ok_and(|p| p > 0);
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6
            .parse::<std::net::Ipv6Addr>()
            .is_ok_and(|a| a.to_string() == v6),
        None => host
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|a| a.to_string() == host),
    };
    port_ok && host_ok
}

fn path_rules(rules: Vec<PathRuleDocument>) -> Result<Vec<PathRule>, ConfigError> {
    if rules.len() > MAX_PATH_RULES {
        return Err(error(
            "path_rules",
            format!("{} rules is out of range 0..={MAX_PATH_RULES}", rules.len()),
        ));
    }
    rules
        .into_iter()
        .enumerate()
        .map(|(i, PathRuleDocument { suffix, api })| {
            if !suffix.starts_with('/') || suffix.contains(['?', '#']) {
                return Err(error(
                    format!("path_rules[{i}].suffix"),
                    format!(
                        "{} must start with '/' and contain no '?' or '#'",
                        quoted(&suffix)
                    ),
                ));
            }
            Ok(PathRule { suffix, api })
        })
        .collect()
}

/// A Prometheus metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`).
fn metric_name(field: &str, name: String) -> Result<String, ConfigError> {
    let first_ok = name
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_' || b == b':');
    let rest_ok = name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':');
    if !(first_ok && rest_ok) {
        return Err(error(
            field,
            format!(
                "{} is not a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)",
                quoted(&name)
            ),
        ));
    }
    Ok(name)
}

impl EngineLoadDocument {
    /// The settings, each checked, the ones left out at their defaults.
    pub fn validate(self) -> Result<EngineLoadConfig, ConfigError> {
        let field = |name: &str| format!("engine_load.{name}");
        let cluster = self.cluster.ok_or_else(|| {
            error(
                field("cluster"),
                "missing (the Envoy cluster the polls go through)",
            )
        })?;
        let cluster = cluster_name(&field("cluster"), cluster)?;
        let engine = self.engine.unwrap_or(Engine::Vllm);
        let mut series = engine.series();
        if let Some(name) = self.running_metric {
            series.running = metric_name(&field("running_metric"), name)?;
        }
        if let Some(name) = self.waiting_metric {
            series.waiting = metric_name(&field("waiting_metric"), name)?;
        }
        if let Some(name) = self.kv_usage_metric {
            series.kv_usage = name
                .map(|name| metric_name(&field("kv_usage_metric"), name))
                .transpose()?;
        }
        // A line is read as one series only: a name given two roles would leave
        // the other missing from every answer, and every poll would fail.
        let roles = [
            ("running_metric", Some(&series.running)),
            ("waiting_metric", Some(&series.waiting)),
            ("kv_usage_metric", series.kv_usage.as_ref()),
        ];
        for (i, (role, name)) in roles.iter().enumerate() {
            let Some(name) = name else { continue };
            if let Some((other, _)) = roles.iter().skip(i + 1).find(|(_, n)| *n == Some(*name)) {
                return Err(error(
                    field(other),
                    format!("{name:?} is already the {role}: each series is read for one role"),
                ));
            }
        }
        let path = self.path.unwrap_or_else(|| "/metrics".to_string());
        let printable = path.bytes().all(|b| b.is_ascii_graphic());
        if !path.starts_with('/') || !printable || path.len() > 1024 {
            return Err(error(
                field("path"),
                format!(
                    "{} must start with '/' and hold only printable ASCII without spaces",
                    quoted(&path)
                ),
            ));
        }
        let interval_ms = match self.interval_ms {
            Some(v) => in_range(&field("interval_ms"), v, ENGINE_INTERVAL_MS_RANGE)?,
            None => ENGINE_INTERVAL_MS_DEFAULT,
        };
        let timeout_ms = match self.timeout_ms {
            Some(v) => {
                let range = (ENGINE_TIMEOUT_MS_MIN, ENGINE_TIMEOUT_MS_MAX);
                let timeout = in_range(&field("timeout_ms"), v, range)?;
                if timeout > interval_ms {
                    return Err(error(
                        field("timeout_ms"),
                        format!(
                            "{timeout} exceeds interval_ms ({interval_ms}); a poll must end before the next one is due"
                        ),
                    ));
                }
                timeout
            }
            None => {
                (interval_ms * 4 / 5).clamp(ENGINE_TIMEOUT_MS_MIN, ENGINE_TIMEOUT_MS_DEFAULT_MAX)
            }
        };
        let max_age_ms = match self.max_age_ms {
            Some(v) => in_range(
                &field("max_age_ms"),
                v,
                (interval_ms, ENGINE_MAX_AGE_MS_MAX),
            )
            .map_err(|e| ConfigError {
                problem: format!(
                    "{} (at least interval_ms: a sample must live until the next poll)",
                    e.problem
                ),
                ..e
            })?,
            None => interval_ms * ENGINE_MAX_AGE_INTERVALS,
        };
        let max_requests = self
            .max_requests
            .map(|v| in_range(&field("max_requests"), v, ENGINE_MAX_REQUESTS_RANGE).map(to_u32))
            .transpose()?;
        let max_kv_usage_permille = match self.max_kv_usage {
            None => None,
            Some(share) => {
                if !(share > 0.0 && share <= 1.0) {
                    return Err(error(
                        field("max_kv_usage"),
                        format!("{share} is out of range (0, 1] (a share of the KV cache)"),
                    ));
                }
                if series.kv_usage.is_none() {
                    return Err(error(
                        field("max_kv_usage"),
                        "set, but no KV-usage series is read (the engine exports none, or kv_usage_metric is null)",
                    ));
                }
                // At least one thousandth: 0 would hold every instance over.
                Some(((share * 1000.0).round() as u16).max(1))
            }
        };
        Ok(EngineLoadConfig {
            cluster,
            engine,
            series,
            path,
            interval_ms,
            timeout_ms,
            max_age_ms,
            max_requests,
            max_kv_usage_permille,
        })
    }
}

impl ConfigDocument {
    /// Reads a document: JSON whose keys each appear once, its deprecated
    /// fields taken out (with a warning each), the rest read by serde.
    fn read(bytes: &[u8], deprecated: &[(&str, &str)]) -> Result<(Self, Vec<String>), ConfigError> {
        let mut value = document::read(bytes)?;
        let warnings = take_deprecated(&mut value, deprecated);
        let document = ConfigDocument::deserialize(document::ValueDeserializer::new(&value))
            .map_err(|e| match e.field.as_str() {
                "" => ConfigError {
                    field: "configuration".to_string(),
                    ..e
                },
                _ => e,
            })?;
        Ok((document, warnings))
    }

    /// Checks every range and the rules across fields: the configuration the
    /// filter uses, or the first problem found.
    pub fn validate(self) -> Result<Config, ConfigError> {
        let prefix_length = match self.prefix_length {
            Some(v) => to_usize(in_range("prefix_length", v, PREFIX_LENGTH_RANGE)?),
            None => self.matching.default_prefix_length(),
        };
        let optional_header = |field: &str, name: Option<String>| {
            name.map(|name| header_name(field, &name)).transpose()
        };
        let config = Config {
            strategy: self.strategy,
            matching: self.matching,
            prefix_length,
            block_bytes: to_usize(in_range(
                "block_bytes",
                self.block_bytes,
                BLOCK_BYTES_RANGE,
            )?),
            index_bytes: in_range("index_bytes", self.index_bytes, INDEX_BYTES_RANGE)?,
            load_margin: to_u32(in_range(
                "load_margin",
                self.load_margin,
                LOAD_MARGIN_RANGE,
            )?),
            cold_placement: self.cold_placement,
            concurrency_threshold: to_u32(in_range(
                "concurrency_threshold",
                self.concurrency_threshold,
                CONCURRENCY_THRESHOLD_RANGE,
            )?),
            key_header: header_name("key_header", &self.key_header)?,
            tenant_header: header_name("tenant_header", &self.tenant_header)?,
            max_body_bytes: to_usize(in_range(
                "max_body_bytes",
                self.max_body_bytes,
                MAX_BODY_BYTES_RANGE,
            )?),
            include_model: self.include_model,
            body_tenant: self.body_tenant,
            path_rules: path_rules(self.path_rules)?,
            host_header: optional_header("host_header", self.host_header)?,
            decision_header: optional_header("decision_header", self.decision_header)?,
            read_usage: self.read_usage,
            instance_ttl_ms: in_range(
                "instance_ttl_ms",
                self.instance_ttl_ms,
                INSTANCE_TTL_MS_RANGE,
            )?,
            counting: self.counting,
            instances: instances(self.instances)?.into(),
            engine_load: self
                .engine_load
                .map(EngineLoadDocument::validate)
                .transpose()?,
            discovery: self
                .discovery
                .map(DiscoveryDocument::validate)
                .transpose()?,
            adapters: self.adapters.map(AdaptersDocument::validate).transpose()?,
            fleet: self.fleet.map(fleet).transpose()?,
        };
        config.check_consistency()?;
        Ok(config)
    }
}

impl Config {
    /// Parses the plugin configuration. Empty (or only whitespace) means all
    /// defaults; otherwise a JSON object whose fields override the defaults.
    /// A deprecated field is logged as a warning.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        let (config, warnings) = Config::parse_with_warnings(bytes, DEPRECATED_FIELDS)?;
        for warning in warnings {
            log::warn!("prefix-router: {warning}");
        }
        Ok(config)
    }

    /// [`Config::parse`] with the given deprecated fields, returning the
    /// warnings about those the configuration sets.
    fn parse_with_warnings(
        bytes: &[u8],
        deprecated: &[(&str, &str)],
    ) -> Result<(Config, Vec<String>), ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok((Config::default(), Vec::new()));
        }
        let (document, warnings) = ConfigDocument::read(bytes, deprecated)?;
        Ok((document.validate()?, warnings))
    }
    /// Rules that involve more than one field.
    fn check_consistency(&self) -> Result<(), ConfigError> {
        if self.adapters.is_some() {
            let longest =
                self.strategy == Strategy::PrefixAware && self.matching == Matching::LongestPrefix;
            let problem = if !longest {
                Some("needs strategy PREFIX_AWARE with match LONGEST_PREFIX (the decision that serves an adapter from its set)")
            } else if !self.include_model {
                Some("needs include_model: true (an adapter's prompts are cached apart from the base model's)")
            } else if self.instances.is_empty() && self.discovery.is_none() {
                Some("needs the fleet known, from instances or discovery (an adapter's set is chosen among them)")
            } else {
                None
            };
            if let Some(problem) = problem {
                return Err(error("adapters", problem));
            }
        }
        if self.discovery.is_some() && !self.instances.is_empty() {
            return Err(error(
                "discovery",
                "set with instances: both name the fleet; keep instances for a static fleet, \
                 discovery where Envoy discovers it",
            ));
        }
        if self.max_body_bytes < self.prefix_length {
            return Err(error(
                "max_body_bytes",
                format!(
                    "{} is less than prefix_length ({}); it must be at least prefix_length",
                    self.max_body_bytes, self.prefix_length
                ),
            ));
        }
        if self.key_header == self.tenant_header {
            return Err(error(
                "key_header",
                format!(
                    "\"{}\" is also the tenant_header; they must differ",
                    self.key_header
                ),
            ));
        }
        // Every configured header: the ones the filter writes, and the tenant
        // header it reads (Envoy's own headers are not a tenant, and a
        // client could set an internal one).
        let configured = [
            ("key_header", Some(&self.key_header)),
            ("host_header", self.host_header.as_ref()),
            ("decision_header", self.decision_header.as_ref()),
            ("tenant_header", Some(&self.tenant_header)),
        ];
        for (field, name) in configured {
            let Some(name) = name else { continue };
            if RESERVED_KEY_HEADERS.contains(&name.as_str()) {
                return Err(error(
                    field,
                    format!(
                        "\"{name}\" is a header Envoy itself relies on; choose another (not one of {})",
                        RESERVED_KEY_HEADERS.join(", ")
                    ),
                ));
            }
            if INTERNAL_REQUEST_HEADERS.contains(&name.as_str()) {
                return Err(error(
                    field,
                    format!("\"{name}\" is used by the filter internally; choose another"),
                ));
            }
        }
        if self.strategy == Strategy::PrefixAware
            && self.matching == Matching::LongestPrefix
            && self.host_header.is_none()
        {
            return Err(error(
                "host_header",
                "null, but match LONGEST_PREFIX names the chosen instance in it (Envoy's \
                 override_host policy); configure it, or set match to FIXED_PREFIX to route \
                 by Maglev on the key alone",
            ));
        }
        for (other, name) in [
            ("key_header", &self.key_header),
            ("tenant_header", &self.tenant_header),
        ] {
            match &self.host_header {
                Some(host) if host == name => {
                    return Err(error(
                        "host_header",
                        format!("\"{host}\" is also the {other}; they must differ"),
                    ));
                }
                // Without a host header the filter still removes the default
                // one from every request, so that no client names an instance.
                None if name == DEFAULT_HOST_HEADER => {
                    return Err(error(
                        other,
                        format!(
                            "\"{name}\" is removed from every request while host_header is \
                             null (no client may name an instance); choose another"
                        ),
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The README's "complete example" is what it says: every field, each at
    /// its default except the opt-in debugging header, and accepted as pasted.
    #[test]
    fn readme_complete_example_is_the_defaults_plus_the_decision_header() {
        let readme = include_str!("../README.md");
        let after = readme
            .split("A complete example")
            .nth(1)
            .expect("README has the complete example");
        let json = after
            .split("```json")
            .nth(1)
            .and_then(|block| block.split("```").next())
            .expect("a json block follows");
        // That it lists every field: tools/tests/configuration_schema.rs.
        let config = Config::parse(json.as_bytes()).expect("the README example is accepted");
        let expected = Config {
            decision_header: Some("x-prefix-route-decision".to_string()),
            ..Config::default()
        };
        assert_eq!(config, expected);
    }

    /// Every example of docs/configuration.md's error table gives the message
    /// the table shows (up to a closing `...`, where the table shortens it).
    #[test]
    fn the_documented_errors_are_the_errors() {
        let doc = include_str!("../docs/configuration.md");
        let mut checked = 0;
        for row in doc.lines().filter(|l| l.starts_with("| `")) {
            let cells: Vec<&str> = row.split(" | ").collect();
            let (Some(json), Some(message)) = (
                cells
                    .first()
                    .and_then(|c| c.strip_prefix("| `")?.strip_suffix('`')),
                cells
                    .get(1)
                    .and_then(|c| c.strip_prefix('`')?.strip_suffix("` |")),
            ) else {
                continue;
            };
            if !json.starts_with(['{', '[']) {
                continue;
            }
            let error = Config::parse(json.as_bytes()).expect_err(json).to_string();
            let shown = message.strip_suffix("...)").unwrap_or(message);
            let shown = shown.strip_suffix("...").unwrap_or(shown);
            assert!(
                error.starts_with(shown),
                "{json}:\n  doc:  {message}\n  code: {error}"
            );
            checked += 1;
        }
        assert!(checked >= 10, "{checked} examples found");
    }

    /// The README's engine-load example is accepted as pasted and turns the
    /// fleet-wide bound on.
    #[test]
    fn readme_engine_load_example_is_accepted() {
        let readme = include_str!("../README.md");
        let json = readme
            .split("## Which rule protects what")
            .nth(1)
            .and_then(|after| after.split("```json").nth(1))
            .and_then(|block| block.split("```").next())
            .expect("a json block in the section");
        let config = Config::parse(json.as_bytes()).expect("the README example is accepted");
        let engine = config.engine_load.expect("engine_load is set");
        assert_eq!(engine.cluster, "engine_metrics");
        assert_eq!(engine.bounds().max_requests, Some(64));
    }

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text.as_bytes())
    }

    fn err(text: &str) -> String {
        match parse(text) {
            Ok(c) => panic!("accepted {text}: {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn empty_configuration_is_all_defaults() {
        let defaults = Config {
            strategy: Strategy::PrefixAware,
            matching: Matching::LongestPrefix,
            prefix_length: 16_384,
            block_bytes: 256,
            index_bytes: 8_388_608,
            load_margin: 4,
            cold_placement: ColdPlacement::Consistent,
            concurrency_threshold: 10,
            key_header: "x-prefix-route-key".into(),
            tenant_header: "x-amzn-sagemaker-prefix-aware-id".into(),
            max_body_bytes: 1_048_576,
            include_model: true,
            body_tenant: true,
            path_rules: vec![
                PathRule {
                    suffix: "/chat/completions".into(),
                    api: ApiKind::ChatCompletions,
                },
                PathRule {
                    suffix: "/completions".into(),
                    api: ApiKind::Completions,
                },
                PathRule {
                    suffix: "/responses".into(),
                    api: ApiKind::Responses,
                },
            ],
            host_header: Some("x-prefix-route-host".into()),
            decision_header: None,
            read_usage: true,
            instance_ttl_ms: 60_000,
            counting: Counting::UpstreamFilter,
            instances: std::rc::Rc::from([]),
            engine_load: None,
            discovery: None,
            adapters: None,
            fleet: None,
        };
        assert_eq!(parse(""), Ok(defaults.clone()));
        assert_eq!(parse(" \n"), Ok(defaults.clone()));
        assert_eq!(parse("{}"), Ok(defaults));
    }

    #[test]
    fn prefix_length_defaults_by_match_and_longest_prefix_needs_the_host_header() {
        let fixed = parse(r#"{"match":"FIXED_PREFIX"}"#).unwrap();
        assert_eq!(
            (fixed.matching, fixed.prefix_length),
            (Matching::FixedPrefix, 4096)
        );
        let set = parse(r#"{"prefix_length":2048}"#).unwrap();
        assert_eq!(
            (set.matching, set.prefix_length),
            (Matching::LongestPrefix, 2048)
        );
        assert_eq!(
            err(r#"{"match":"LONGEST"}"#),
            r#"match: "LONGEST" is not one of LONGEST_PREFIX, FIXED_PREFIX"#
        );
        assert!(err(r#"{"host_header":null}"#)
            .starts_with("host_header: null, but match LONGEST_PREFIX"));
        assert!(parse(r#"{"host_header":null,"match":"FIXED_PREFIX"}"#).is_ok());
        assert!(parse(r#"{"host_header":null,"strategy":"RANDOM"}"#).is_ok());
        assert_eq!(
            err(r#"{"block_bytes":32}"#),
            "block_bytes: 32 is out of range 64..=4096"
        );
        assert_eq!(
            err(r#"{"index_bytes":1000}"#),
            "index_bytes: 1000 is out of range 65536..=268435456"
        );
        assert_eq!(
            err(r#"{"load_margin":-1}"#),
            "load_margin: -1 is out of range 0..=1024"
        );
        let tuned = parse(
            r#"{"block_bytes":64,"index_bytes":65536,"load_margin":0,"cold_placement":"BALANCED"}"#,
        )
        .unwrap();
        assert_eq!(
            (
                tuned.block_bytes,
                tuned.index_bytes,
                tuned.load_margin,
                tuned.cold_placement
            ),
            (64, 65536, 0, ColdPlacement::Balanced)
        );
        assert_eq!(
            err(r#"{"cold_placement":"RENDEZVOUS"}"#),
            r#"cold_placement: "RENDEZVOUS" is not one of CONSISTENT, BALANCED"#
        );
    }

    #[test]
    fn every_field_is_read() {
        let c = parse(
            r#"{"strategy":"RANDOM","prefix_length":2048,"concurrency_threshold":3,
                "key_header":"X-Key","tenant_header":"X-Tenant","max_body_bytes":65536,
                "include_model":false,"body_tenant":false,
                "path_rules":[{"suffix":"/generate","api":"completions"}]}"#,
        )
        .unwrap();
        assert!(!c.body_tenant);
        assert_eq!(c.strategy, Strategy::Random);
        assert_eq!(c.prefix_length, 2048);
        assert_eq!(c.concurrency_threshold, 3);
        assert_eq!(c.key_header, "x-key");
        assert_eq!(c.tenant_header, "x-tenant");
        assert_eq!(c.max_body_bytes, 65536);
        assert!(!c.include_model);
        assert_eq!(
            c.path_rules,
            vec![PathRule {
                suffix: "/generate".into(),
                api: ApiKind::Completions
            }]
        );
        assert_eq!(
            parse(r#"{"strategy":"LEAST_OUTSTANDING_REQUESTS"}"#)
                .unwrap()
                .strategy,
            Strategy::LeastOutstandingRequests
        );
    }

    #[test]
    fn range_bounds_are_inclusive() {
        assert_eq!(
            parse(r#"{"prefix_length":1024}"#).unwrap().prefix_length,
            1024
        );
        let c = parse(r#"{"prefix_length":65536,"max_body_bytes":67108864}"#).unwrap();
        assert_eq!((c.prefix_length, c.max_body_bytes), (65536, 67_108_864));
        assert_eq!(
            parse(r#"{"concurrency_threshold":1}"#)
                .unwrap()
                .concurrency_threshold,
            1
        );
        assert_eq!(
            parse(r#"{"concurrency_threshold":1024}"#)
                .unwrap()
                .concurrency_threshold,
            1024
        );
    }

    #[test]
    fn out_of_range_names_field_value_and_range() {
        assert_eq!(
            err(r#"{"prefix_length":100}"#),
            "prefix_length: 100 is out of range 1024..=65536"
        );
        assert_eq!(
            err(r#"{"prefix_length":65537}"#),
            "prefix_length: 65537 is out of range 1024..=65536"
        );
        assert_eq!(
            err(r#"{"prefix_length":-5}"#),
            "prefix_length: -5 is out of range 1024..=65536"
        );
        assert_eq!(
            err(r#"{"prefix_length":18446744073709551615}"#),
            "prefix_length: 18446744073709551615 is out of range 1024..=65536"
        );
        assert_eq!(
            err(r#"{"engine_load":{"cluster":"c","max_requests":-9223372036854775808}}"#),
            "engine_load.max_requests: -9223372036854775808 is out of range 1..=1000000"
        );
        assert_eq!(
            integer_text(i128::from(u64::MAX) + 1),
            "an integer beyond 64 bits"
        );
        assert_eq!(
            err(r#"{"concurrency_threshold":0}"#),
            "concurrency_threshold: 0 is out of range 1..=1024"
        );
        assert_eq!(
            err(r#"{"max_body_bytes":67108865}"#),
            "max_body_bytes: 67108865 is out of range 1024..=67108864"
        );
        assert_eq!(
            err(r#"{"max_body_bytes":2048}"#),
            "max_body_bytes: 2048 is less than prefix_length (16384); it must be at least prefix_length"
        );
    }

    #[test]
    fn wrong_types_are_named() {
        assert_eq!(
            err(r#"{"prefix_length":"4096"}"#),
            r#"prefix_length: expected an integer, got a string ("4096")"#
        );
        assert_eq!(
            err(r#"{"prefix_length":4096.5}"#),
            "prefix_length: expected an integer, got a number (4096.5)"
        );
        assert_eq!(
            err(r#"{"include_model":"yes"}"#),
            r#"include_model: expected true or false, got a string ("yes")"#
        );
        assert_eq!(
            err(r#"{"body_tenant":0}"#),
            "body_tenant: expected true or false, got a number (0)"
        );
        assert_eq!(
            err(r#"{"strategy":1}"#),
            "strategy: expected a string, got a number (1)"
        );
        assert_eq!(
            err(r#"{"counting":true}"#),
            "counting: expected a string, got a boolean (true)"
        );
        assert_eq!(
            err("[1]"),
            "configuration: expected a JSON object, got an array ([1])"
        );
        assert!(err("{").starts_with("configuration: not valid JSON"));
        assert!(err("\u{FEFF}{}").starts_with("configuration: not valid JSON"));
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let e = err(r#"{"prefix_lenght":4096}"#);
        assert!(
            e.starts_with(
                "prefix_lenght: unknown field (known fields: strategy, match, prefix_length"
            ),
            "{e}"
        );
        let e = err(r#"{"path_rules":[{"suffix":"/x","api":"invoke","weight":1}]}"#);
        assert_eq!(
            e,
            "path_rules[0].weight: unknown field (known fields: suffix, api)"
        );
    }

    #[test]
    fn enumerations_list_allowed_values() {
        assert_eq!(
            err(r#"{"strategy":"prefix_aware"}"#),
            r#"strategy: "prefix_aware" is not one of PREFIX_AWARE, LEAST_OUTSTANDING_REQUESTS, RANDOM"#
        );
        assert_eq!(
            err(r#"{"path_rules":[{"suffix":"/x","api":"chat"}]}"#),
            r#"path_rules[0].api: "chat" is not one of chat_completions, completions, responses, invoke"#
        );
    }

    #[test]
    fn header_names_are_validated_and_lowercased() {
        assert_eq!(
            parse(r#"{"tenant_header":"X-Tenant-ID"}"#)
                .unwrap()
                .tenant_header,
            "x-tenant-id"
        );
        for bad in [r#""""#, r#""x key""#, r#""x:key""#, r#"":path""#, r#""é""#] {
            let e = err(&format!(r#"{{"key_header":{bad}}}"#));
            assert!(
                e.starts_with(&format!("key_header: {bad} is not an HTTP header name")),
                "{e}"
            );
        }
        assert_eq!(
            err(r#"{"key_header":"Content-Length"}"#),
            "key_header: \"content-length\" is a header Envoy itself relies on; choose another (not one of host, content-length, transfer-encoding, connection, keep-alive, proxy-connection, te, upgrade, expect)"
        );
        assert_eq!(
            err(r#"{"key_header":"X-T","tenant_header":"x-t"}"#),
            "key_header: \"x-t\" is also the tenant_header; they must differ"
        );
        assert!(
            err(r#"{"tenant_header":"Host"}"#)
                .starts_with("tenant_header: \"host\" is a header Envoy itself relies on"),
            "{}",
            err(r#"{"tenant_header":"Host"}"#)
        );
        for internal in ["x-prefix-router-counted", "x-prefix-router-lb"] {
            assert_eq!(
                err(&format!(r#"{{"tenant_header":"{internal}"}}"#)),
                format!("tenant_header: \"{internal}\" is used by the filter internally; choose another")
            );
        }
    }

    #[test]
    fn path_rules_are_validated() {
        assert_eq!(parse(r#"{"path_rules":[]}"#).unwrap().path_rules, vec![]);
        assert_eq!(
            err(r#"{"path_rules":[{"suffix":"","api":"invoke"}]}"#),
            r#"path_rules[0].suffix: "" must start with '/' and contain no '?' or '#'"#
        );
        assert_eq!(
            err(
                r#"{"path_rules":[{"suffix":"/a","api":"invoke"},{"suffix":"chat","api":"invoke"}]}"#
            ),
            r#"path_rules[1].suffix: "chat" must start with '/' and contain no '?' or '#'"#
        );
        assert_eq!(
            err(r#"{"path_rules":[{"suffix":"/a?b","api":"invoke"}]}"#),
            r#"path_rules[0].suffix: "/a?b" must start with '/' and contain no '?' or '#'"#
        );
        assert_eq!(
            err(r#"{"path_rules":[{"api":"invoke"}]}"#),
            "path_rules[0].suffix: missing"
        );
        assert_eq!(
            err(r#"{"path_rules":[{"suffix":"/a"}]}"#),
            "path_rules[0].api: missing"
        );
        assert_eq!(
            err(r#"{"path_rules":{"suffix":"/a"}}"#),
            r#"path_rules: expected an array, got an object ({"suffix":"/a"})"#
        );
        let many = vec![r#"{"suffix":"/a","api":"invoke"}"#; MAX_PATH_RULES + 1].join(",");
        assert_eq!(
            err(&format!(r#"{{"path_rules":[{many}]}}"#)),
            "path_rules: 65 rules is out of range 0..=64"
        );
    }

    #[test]
    fn overload_fields_are_read() {
        let c = parse(
            r#"{"host_header":"X-Host","decision_header":"X-Decision","instance_ttl_ms":5000}"#,
        )
        .unwrap();
        assert_eq!(c.host_header.as_deref(), Some("x-host"));
        assert_eq!(c.decision_header.as_deref(), Some("x-decision"));
        assert_eq!(c.instance_ttl_ms, 5000);
        // null turns the host header off (overflow re-keys) and keeps the
        // decision header off.
        let c =
            parse(r#"{"host_header":null,"decision_header":null,"match":"FIXED_PREFIX"}"#).unwrap();
        assert_eq!((c.host_header, c.decision_header), (None, None));
    }

    #[test]
    fn counting_is_upstream_filter_or_listener() {
        let counting = |text: &str| parse(text).map(|c| c.counting);
        assert_eq!(counting("{}"), Ok(Counting::UpstreamFilter));
        assert_eq!(
            counting(r#"{"counting":"UPSTREAM_FILTER"}"#),
            Ok(Counting::UpstreamFilter)
        );
        assert_eq!(
            counting(r#"{"counting":"LISTENER"}"#),
            Ok(Counting::Listener)
        );
        // Spellings are exact (the wrong type is in `wrong_types_are_named`).
        assert_eq!(
            err(r#"{"counting":"listener"}"#),
            r#"counting: "listener" is not one of UPSTREAM_FILTER, LISTENER"#
        );
    }

    #[test]
    fn key_balance_factor_is_refused_as_an_unknown_field() {
        for text in [
            r#"{"match":"FIXED_PREFIX","key_balance_factor":100}"#,
            r#"{"key_balance_factor":null}"#,
        ] {
            assert!(
                err(text).starts_with("key_balance_factor: unknown field (known fields: "),
                "{text}: {}",
                err(text)
            );
        }
    }

    #[test]
    fn overload_fields_are_validated() {
        assert_eq!(
            err(r#"{"instance_ttl_ms":999}"#),
            "instance_ttl_ms: 999 is out of range 1000..=3600000"
        );
        assert_eq!(
            err(r#"{"instance_ttl_ms":3600001}"#),
            "instance_ttl_ms: 3600001 is out of range 1000..=3600000"
        );
        assert_eq!(
            parse(r#"{"instance_ttl_ms":3600000}"#)
                .unwrap()
                .instance_ttl_ms,
            3_600_000
        );
        assert_eq!(
            err(r#"{"host_header":true}"#),
            "host_header: expected a string or null, got a boolean (true)"
        );
        assert!(err(r#"{"decision_header":"a b"}"#)
            .starts_with(r#"decision_header: "a b" is not an HTTP header name"#));
        assert_eq!(
            err(r#"{"host_header":"X-Prefix-Route-Key"}"#),
            "host_header: \"x-prefix-route-key\" is also the key_header; they must differ"
        );
        assert_eq!(
            err(r#"{"host_header":"x-amzn-sagemaker-prefix-aware-id"}"#),
            "host_header: \"x-amzn-sagemaker-prefix-aware-id\" is also the tenant_header; they must differ"
        );
        assert_eq!(
            err(
                r#"{"match":"FIXED_PREFIX","host_header":null,"tenant_header":"x-prefix-route-host"}"#
            ),
            "tenant_header: \"x-prefix-route-host\" is removed from every request while \
             host_header is null (no client may name an instance); choose another"
        );
        assert!(err(r#"{"host_header":"host"}"#)
            .starts_with("host_header: \"host\" is a header Envoy itself relies on"));
        assert!(err(r#"{"decision_header":"Content-Length"}"#)
            .starts_with("decision_header: \"content-length\" is a header Envoy itself relies on"));
        for internal in ["x-prefix-router-lb", "x-prefix-router-counted"] {
            for field in ["key_header", "host_header", "decision_header"] {
                assert_eq!(
                    err(&format!(r#"{{"{field}":"{internal}"}}"#)),
                    format!(
                        "{field}: \"{internal}\" is used by the filter internally; choose another"
                    )
                );
            }
        }
    }

    #[test]
    fn a_key_given_twice_is_refused_wherever_it_stands() {
        // serde_json alone keeps the last: this read as 10 would be accepted.
        assert_eq!(
            err(r#"{"concurrency_threshold": 0, "concurrency_threshold": 10}"#),
            "concurrency_threshold: given twice (0, then 10); a key may appear once in an object"
        );
        assert_eq!(
            err(r#"{"engine_load": {"cluster": "a", "interval_ms": 100, "interval_ms": 100}}"#),
            "engine_load.interval_ms: given twice (100, then 100); a key may appear once in \
             an object"
        );
        assert!(err(r#"{"path_rules": [{"suffix": "/a", "api": "invoke"},
                               {"suffix": "/b", "api": "invoke", "suffix": "/c"}]}"#)
        .starts_with(r#"path_rules[1].suffix: given twice ("/b", then "/c")"#));
        // Unknown fields too: the duplicate is the first problem found.
        assert!(err(r#"{"x": 1, "x": 1}"#).starts_with("x: given twice"));
        // Equal values in different objects, and a key again in a sibling
        // object, are not duplicates.
        assert!(parse(
            r#"{"path_rules": [{"suffix": "/a", "api": "invoke"}, {"suffix": "/b", "api": "invoke"}]}"#
        )
        .is_ok());
    }

    #[test]
    fn a_deprecated_field_is_accepted_with_a_warning_naming_its_replacement() {
        let deprecated = [
            (
                "key_balance_factor",
                "set \"match\": \"LONGEST_PREFIX\" instead",
            ),
            (
                "engine_load.scrape_ms",
                "engine_load.interval_ms replaces it",
            ),
        ];
        let read = |json: &str| Config::parse_with_warnings(json.as_bytes(), &deprecated);
        let (config, warnings) = read(r#"{"key_balance_factor": 0.5, "concurrency_threshold": 3}"#)
            .expect("a deprecated field does not refuse the configuration");
        assert_eq!(config.concurrency_threshold, 3);
        assert_eq!(
            warnings,
            [
                "key_balance_factor is deprecated and has no effect; set \"match\": \
              \"LONGEST_PREFIX\" instead. A later release refuses it: remove it from the \
              configuration"
            ]
        );
        let (config, warnings) =
            read(r#"{"engine_load": {"cluster": "c", "scrape_ms": 100}}"#).expect("accepted");
        assert_eq!(config.engine_load.map(|e| e.cluster).as_deref(), Some("c"));
        assert!(warnings[0].starts_with("engine_load.scrape_ms is deprecated"));
        assert_eq!(read("{}").map(|(_, w)| w), Ok(vec![]));
        // Without the table the same field is unknown: it is only accepted
        // while listed.
        assert!(err(r#"{"key_balance_factor": 0.5}"#).starts_with("key_balance_factor: unknown"));
        // A field listed as deprecated is one the configuration no longer has.
        for (path, _) in DEPRECATED_FIELDS {
            let json = match path.split_once('.') {
                Some((parent, name)) => {
                    format!(r#"{{"{parent}": {{"cluster": "c", "{name}": 1}}}}"#)
                }
                None => format!(r#"{{"{path}": 1}}"#),
            };
            assert!(err(&json).contains("unknown field"), "{path}");
        }
    }

    #[test]
    fn the_defaults_are_the_document_defaults_validated() {
        assert_eq!(ConfigDocument::default().validate(), Ok(Config::default()));
    }

    #[test]
    fn long_values_are_shortened_in_errors() {
        let long = "A".repeat(1000);
        let e = err(&format!(r#"{{"strategy":"{long}"}}"#));
        assert!(e.len() < 200, "{e}");
        assert!(e.contains("..."), "{e}");
    }

    #[test]
    fn instances_are_parsed_in_order() {
        let c = parse(r#"{"instances":["10.0.0.7:8000","127.0.0.1:1","[fd00::7]:65535"]}"#)
            .expect("valid");
        assert_eq!(
            c.instances.to_vec(),
            vec!["10.0.0.7:8000", "127.0.0.1:1", "[fd00::7]:65535"]
        );
        assert_eq!(
            parse(r#"{"instances":[]}"#).map(|c| c.instances.to_vec()),
            Ok(vec![])
        );
    }

    #[test]
    fn instances_are_validated() {
        assert_eq!(
            err(r#"{"instances":"10.0.0.7:8000"}"#),
            "instances: expected an array, got a string (\"10.0.0.7:8000\")"
        );
        assert_eq!(
            err(r#"{"instances":[8000]}"#),
            "instances[0]: expected a string, got a number (8000)"
        );
        for bad in [
            "10.0.0.7",
            "10.0.0.7:0",
            "10.0.0.7:65536",
            "10.0.0.7:080",
            "vllm-0:8000",
            "10.0.0:8000",
            "fd00::7:8000",
            "[FD00::7]:8000",
            ":8000",
            "",
        ] {
            let e = err(&format!(r#"{{"instances":["10.0.0.1:1","{bad}"]}}"#));
            assert!(
                e.starts_with(&format!("instances[1]: \"{bad}\" is not ip:port")),
                "{bad}: {e}"
            );
        }
        assert_eq!(
            err(r#"{"instances":["10.0.0.7:8000","10.0.0.8:8000","10.0.0.7:8000"]}"#),
            "instances[2]: \"10.0.0.7:8000\" is listed twice"
        );
        let list = |n: usize| {
            let items: Vec<String> = (0..n).map(|i| format!("\"10.0.1.{i}:80\"")).collect();
            format!(r#"{{"instances":[{}]}}"#, items.join(","))
        };
        assert_eq!(
            parse(&list(MAX_INSTANCES)).map(|c| c.instances.len()),
            Ok(MAX_INSTANCES)
        );
        assert_eq!(
            err(&list(MAX_INSTANCES + 1)),
            "instances: 257 instances is out of range 0..=256"
        );
    }

    #[test]
    fn fleet_is_one_stat_name_level_or_null() {
        assert_eq!(Config::default().fleet, None);
        assert_eq!(parse(r#"{"fleet":null}"#).unwrap().fleet, None);
        for good in ["llama", "Llama-3_1-70B", "a", &"x".repeat(MAX_FLEET_CHARS)] {
            let json = format!(r#"{{"fleet":"{good}"}}"#);
            assert_eq!(parse(&json).unwrap().fleet.as_deref(), Some(good));
        }
        for bad in [
            "",
            "llama.70b",
            "llama 70b",
            "lläma",
            "a/b",
            &"x".repeat(MAX_FLEET_CHARS + 1),
        ] {
            let e = err(&format!(r#"{{"fleet":"{bad}"}}"#));
            assert!(
                e.starts_with(&format!("fleet: \"{bad}\" is not a fleet name: 1 to 64 of")),
                "{bad}: {e}"
            );
        }
        assert_eq!(
            err(r#"{"fleet":7}"#),
            "fleet: expected a string or null, got a number (7)"
        );
    }

    fn engine(json: &str) -> Result<EngineLoadConfig, String> {
        parse(&format!("{{\"engine_load\": {json}}}"))
            .map(|c| c.engine_load.expect("engine_load set"))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn adapters_name_the_base_models_and_need_a_known_fleet_and_longest_prefix() {
        let fleet = r#""instances": ["10.0.0.1:80"]"#;
        let c = parse(&format!(
            r#"{{{fleet}, "adapters": {{"base_models": ["llama"]}}}}"#
        ))
        .unwrap();
        let adapters = c.adapters.unwrap();
        assert_eq!(
            (
                adapters.min_instances,
                adapters.max_instances,
                adapters.header.clone()
            ),
            (1, 256, None)
        );
        assert_eq!(adapters.adapter_name(None, Some("llama")), None);
        assert_eq!(adapters.adapter_name(None, None), None);
        assert_eq!(adapters.adapter_name(None, Some("")), None);
        let sql: Option<&[u8]> = Some(b"sql-lora");
        assert_eq!(adapters.adapter_name(None, Some("sql-lora")), sql);
        // The header wins over the body; any bytes are a name.
        assert_eq!(adapters.adapter_name(Some(b"sql-lora"), Some("llama")), sql);
        assert_eq!(
            adapters.adapter_name(Some(b"llama"), Some("sql-lora")),
            None
        );
        let odd: &[u8] = &[0xff, 0, 0x80];
        assert_eq!(adapters.adapter_name(Some(odd), None), Some(odd));
        let c = parse(&format!(
            r#"{{{fleet}, "adapters": {{"base_models": ["a", "b"], "header": "X-Adapter", "min_instances": 2, "max_instances": 3}}}}"#
        ))
        .unwrap()
        .adapters
        .unwrap();
        assert_eq!(
            (
                c.base_models.len(),
                c.header.as_deref(),
                c.min_instances,
                c.max_instances
            ),
            (2, Some("x-adapter"), 2, 3)
        );
        let refused =
            |adapters: &str, rest: &str| err(&format!(r#"{{{rest}"adapters": {adapters}}}"#));
        let listed = format!("{fleet}, ");
        assert_eq!(
            refused("{}", &listed),
            "adapters.base_models: list 1 to 64 base models (the `model` values that are not adapters)"
        );
        assert_eq!(
            refused(r#"{"base_models": [""]}"#, &listed),
            "adapters.base_models: \"\" is not a model name (1 to 256 bytes)"
        );
        assert_eq!(
            refused(
                r#"{"base_models": ["m"], "min_instances": 3, "max_instances": 2}"#,
                &listed
            ),
            "adapters.min_instances: 3 is more than max_instances (2)"
        );
        assert_eq!(
            refused(r#"{"base_models": ["m"], "min_instances": 0}"#, &listed),
            "adapters.min_instances: 0 is out of range 1..=256"
        );
        assert!(
            refused(r#"{"base_models": ["m"], "slots": 2}"#, &listed).starts_with("adapters.slots")
        );
        assert!(
            refused(r#"{"base_models": ["m"]}"#, "").starts_with("adapters: needs the fleet known")
        );
        assert!(refused(
            r#"{"base_models": ["m"]}"#,
            &format!(r#"{listed}"include_model": false, "#)
        )
        .starts_with("adapters: needs include_model: true"));
        assert!(refused(
            r#"{"base_models": ["m"]}"#,
            &format!(r#"{listed}"match": "FIXED_PREFIX", "#)
        )
        .starts_with("adapters: needs strategy PREFIX_AWARE with match LONGEST_PREFIX"));
        let discovered = r#""discovery": {"admin_cluster": "a", "cluster": "v"}, "#;
        assert!(parse(&format!(
            r#"{{{discovered}"adapters": {{"base_models": ["m"]}}}}"#
        ))
        .is_ok());
    }

    #[test]
    fn discovery_reads_its_two_clusters_and_refuses_a_listed_fleet_beside_it() {
        assert_eq!(Config::default().discovery, None);
        let c = parse(r#"{"discovery": {"admin_cluster": "envoy_admin", "cluster": "vllm"}}"#)
            .expect("valid");
        assert_eq!(
            c.discovery,
            Some(DiscoveryConfig {
                admin_cluster: "envoy_admin".into(),
                cluster: "vllm".into(),
                interval_ms: DISCOVERY_INTERVAL_MS_DEFAULT,
            })
        );
        assert_eq!(
            err(r#"{"discovery": {"cluster": "vllm"}}"#),
            "discovery.admin_cluster: missing (the Envoy cluster that leads to Envoy's admin)"
        );
        assert_eq!(
            err(r#"{"discovery": {"admin_cluster": "a", "cluster": "v m"}}"#),
            "discovery.cluster: \"v m\" is not a cluster name (1 to 256 characters, no whitespace)"
        );
        assert_eq!(
            err(r#"{"discovery": {"admin_cluster": "a", "cluster": "v", "interval_ms": 99}}"#),
            "discovery.interval_ms: 99 is out of range 100..=600000"
        );
        assert!(err(
            r#"{"instances": ["10.0.0.1:80"], "discovery": {"admin_cluster": "a", "cluster": "v"}}"#
        )
        .starts_with("discovery: set with instances"));
    }

    #[test]
    fn engine_load_is_off_unless_configured_and_null_is_off() {
        assert_eq!(Config::default().engine_load, None);
        assert_eq!(parse(r#"{"engine_load": null}"#).unwrap().engine_load, None);
    }

    #[test]
    fn engine_load_defaults_follow_the_interval() {
        let config = engine(r#"{"cluster": "engine_metrics"}"#).unwrap();
        assert_eq!(
            config,
            EngineLoadConfig {
                cluster: "engine_metrics".into(),
                engine: Engine::Vllm,
                series: Series {
                    running: "vllm:num_requests_running".into(),
                    waiting: "vllm:num_requests_waiting".into(),
                    kv_usage: Some("vllm:kv_cache_usage_perc".into()),
                },
                path: "/metrics".into(),
                interval_ms: 500,
                timeout_ms: 400,
                max_age_ms: 1_500,
                max_requests: None,
                max_kv_usage_permille: None,
            }
        );
        assert_eq!(config.bounds(), EngineBounds::default());
        let slow = engine(r#"{"cluster": "c", "interval_ms": 60000}"#).unwrap();
        assert_eq!((slow.timeout_ms, slow.max_age_ms), (2_000, 180_000));
        let fast = engine(r#"{"cluster": "c", "interval_ms": 50}"#).unwrap();
        assert_eq!((fast.timeout_ms, fast.max_age_ms), (40, 150));
    }

    #[test]
    fn engine_presets_and_overrides() {
        let sglang = engine(r#"{"cluster": "c", "engine": "SGLANG"}"#).unwrap();
        assert_eq!(sglang.series.running, "sglang:num_running_reqs");
        assert_eq!(sglang.series.waiting, "sglang:num_queue_reqs");
        assert_eq!(
            sglang.series.kv_usage.as_deref(),
            Some("sglang:token_usage")
        );
        let llama = engine(r#"{"cluster": "c", "engine": "LLAMACPP"}"#).unwrap();
        assert_eq!(llama.series.running, "llamacpp:requests_processing");
        assert_eq!(llama.series.waiting, "llamacpp:requests_deferred");
        assert_eq!(llama.series.kv_usage, None);
        let custom = engine(
            r#"{"cluster": "c", "running_metric": "my:running", "waiting_metric": "my_waiting",
                "kv_usage_metric": null, "path": "/stats/engine?format=prom"}"#,
        )
        .unwrap();
        assert_eq!(
            custom.series,
            Series {
                running: "my:running".into(),
                waiting: "my_waiting".into(),
                kv_usage: None
            }
        );
        assert_eq!(custom.path, "/stats/engine?format=prom");
        let kv =
            engine(r#"{"cluster": "c", "engine": "LLAMACPP", "kv_usage_metric": "kv"}"#).unwrap();
        assert_eq!(kv.series.kv_usage.as_deref(), Some("kv"));
    }

    #[test]
    fn a_series_is_read_for_one_role() {
        let twice = engine(r#"{"cluster": "c", "running_metric": "q", "waiting_metric": "q"}"#);
        assert_eq!(
            twice.unwrap_err().to_string(),
            "engine_load.waiting_metric: \"q\" is already the running_metric: each series is \
             read for one role"
        );
        let kv = engine(r#"{"cluster": "c", "kv_usage_metric": "vllm:num_requests_waiting"}"#);
        assert!(kv
            .unwrap_err()
            .to_string()
            .starts_with("engine_load.kv_usage_metric:"));
        assert!(engine(r#"{"cluster": "c", "kv_usage_metric": null}"#).is_ok());
    }

    #[test]
    fn a_sample_age_that_can_lapse_between_polls_is_warned_about() {
        let defaults = engine(r#"{"cluster": "c"}"#).unwrap();
        assert_eq!(defaults.warnings(7), Vec::<String>::new());
        let short = engine(r#"{"cluster": "c", "interval_ms": 1000, "max_age_ms": 1000}"#).unwrap();
        let warnings = short.warnings(7);
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("(2000)"), "{warnings:?}");
        let enough = engine(r#"{"cluster": "c", "interval_ms": 1000, "max_age_ms": 2000}"#);
        assert_eq!(enough.unwrap().warnings(7), Vec::<String>::new());
    }

    #[test]
    fn polling_many_instances_often_is_warned_about_with_the_interval_that_would_not_be() {
        let defaults = engine(r#"{"cluster": "c"}"#).unwrap();
        // 125 instances every 500 ms: 250 polls a second.
        assert_eq!(defaults.warnings(125), Vec::<String>::new());
        let warnings = defaults.warnings(256);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].starts_with(
                "engine_load polls each of the 256 listed instances every 500 ms: 512 polls a \
                 second"
            ) && warnings[0].contains("some 6-10 % of a core; an interval_ms of 1024 or more"),
            "{warnings:?}"
        );
        let slower = engine(r#"{"cluster": "c", "interval_ms": 1024}"#).unwrap();
        assert_eq!(slower.warnings(256), Vec::<String>::new());
        let fastest = engine(r#"{"cluster": "c", "interval_ms": 50}"#).unwrap();
        assert_eq!(fastest.warnings(12), Vec::<String>::new());
        assert_eq!(fastest.warnings(13).len(), 1);
        // Unlisted, the fleet is learned: nothing to count at configure.
        assert_eq!(fastest.warnings(0), Vec::<String>::new());
    }

    #[test]
    fn engine_bounds_are_parsed_into_thousandths() {
        let config = engine(
            r#"{"cluster": "c", "max_requests": 24, "max_kv_usage": 0.9,
                "interval_ms": 1000, "timeout_ms": 1000, "max_age_ms": 1000}"#,
        )
        .unwrap();
        assert_eq!(
            config.bounds(),
            EngineBounds {
                max_requests: Some(24),
                max_kv_usage_permille: Some(900)
            }
        );
        assert_eq!((config.timeout_ms, config.max_age_ms), (1_000, 1_000));
        let tiny = engine(r#"{"cluster": "c", "max_kv_usage": 0.0001}"#).unwrap();
        assert_eq!(tiny.max_kv_usage_permille, Some(1));
        let full = engine(r#"{"cluster": "c", "max_kv_usage": 1}"#).unwrap();
        assert_eq!(full.max_kv_usage_permille, Some(1000));
    }

    #[test]
    fn engine_load_refuses_what_cannot_work() {
        let cases = [
            (
                "[]",
                "engine_load: expected an object or null, got an array ([])",
            ),
            ("{}", "engine_load.cluster: missing"),
            (
                r#"{"cluster": ""}"#,
                "engine_load.cluster: \"\" is not a cluster name",
            ),
            (
                r#"{"cluster": "a b"}"#,
                "engine_load.cluster: \"a b\" is not a cluster name",
            ),
            (
                r#"{"cluster": 7}"#,
                "engine_load.cluster: expected a string",
            ),
            (
                r#"{"cluster": "c", "engine": "TGI"}"#,
                "engine_load.engine: \"TGI\" is not one of VLLM, SGLANG, LLAMACPP",
            ),
            (
                r#"{"cluster": "c", "clustr": "c"}"#,
                "engine_load.clustr: unknown field",
            ),
            (
                r#"{"cluster": "c", "interval_ms": 49}"#,
                "engine_load.interval_ms: 49 is out of range 50..=60000",
            ),
            (
                r#"{"cluster": "c", "interval_ms": 60001}"#,
                "engine_load.interval_ms: 60001 is out of range",
            ),
            (
                r#"{"cluster": "c", "interval_ms": 100, "timeout_ms": 101}"#,
                "engine_load.timeout_ms: 101 exceeds interval_ms (100)",
            ),
            (
                r#"{"cluster": "c", "timeout_ms": 5}"#,
                "engine_load.timeout_ms: 5 is out of range 10..=60000",
            ),
            (
                r#"{"cluster": "c", "interval_ms": 100, "max_age_ms": 99}"#,
                "engine_load.max_age_ms: 99 is out of range 100..=600000 (at least interval_ms",
            ),
            (
                r#"{"cluster": "c", "max_requests": 0}"#,
                "engine_load.max_requests: 0 is out of range 1..=1000000",
            ),
            (
                r#"{"cluster": "c", "max_requests": 1.5}"#,
                "engine_load.max_requests: expected an integer",
            ),
            (
                r#"{"cluster": "c", "max_kv_usage": 0}"#,
                "engine_load.max_kv_usage: 0 is out of range (0, 1]",
            ),
            (
                r#"{"cluster": "c", "max_kv_usage": 1.01}"#,
                "engine_load.max_kv_usage: 1.01 is out of range (0, 1]",
            ),
            (
                r#"{"cluster": "c", "max_kv_usage": "90%"}"#,
                "engine_load.max_kv_usage: expected a number or null, got a string (\"90%\")",
            ),
            (
                r#"{"cluster": "c", "engine": "LLAMACPP", "max_kv_usage": 0.9}"#,
                "engine_load.max_kv_usage: set, but no KV-usage series is read",
            ),
            (
                r#"{"cluster": "c", "running_metric": "1abc"}"#,
                "engine_load.running_metric: \"1abc\" is not a Prometheus metric name",
            ),
            (
                r#"{"cluster": "c", "waiting_metric": "a-b"}"#,
                "engine_load.waiting_metric: \"a-b\" is not a Prometheus metric name",
            ),
            (
                r#"{"cluster": "c", "kv_usage_metric": ""}"#,
                "engine_load.kv_usage_metric: \"\" is not a Prometheus metric name",
            ),
            (
                r#"{"cluster": "c", "path": "metrics"}"#,
                "engine_load.path: \"metrics\" must start with '/'",
            ),
            (
                r#"{"cluster": "c", "path": "/a b"}"#,
                "engine_load.path: \"/a b\" must start with '/'",
            ),
        ];
        for (json, expected) in cases {
            let problem = engine(json).unwrap_err();
            assert!(
                problem.starts_with(expected),
                "{json}: got {problem:?}, expected it to start with {expected:?}"
            );
        }
    }

    #[test]
    fn engine_load_settings_are_described_for_the_configure_log() {
        let config =
            engine(r#"{"cluster": "m", "max_requests": 8, "max_kv_usage": 0.85}"#).unwrap();
        assert_eq!(
            config.describe(),
            "engine VLLM, cluster m, path /metrics, series vllm:num_requests_running + \
             vllm:num_requests_waiting (kv vllm:kv_cache_usage_perc), interval_ms 500, \
             timeout_ms 400, max_age_ms 1500, max_requests 8, max_kv_usage 0.85"
        );
    }
}
