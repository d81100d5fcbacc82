//! The plugin configuration: parsed from Envoy's `configuration` JSON and
//! validated up front, so a typo or an out-of-range value is rejected with a
//! message naming the field instead of silently doing something else.
//!
//! Parsing walks a `serde_json::Value` by hand (the filter carries no serde
//! derive). Each field is one arm in [`Config::apply_field`] plus one parser
//! call, so adding a field is a three-line change.

use std::fmt;

use serde_json::{Map, Value};

use crate::classify::{default_path_rules, ApiKind, PathRule};
use crate::headers::{
    DEFAULT_HOST_HEADER, DEFAULT_KEY_HEADER, DEFAULT_TENANT_HEADER, INTERNAL_REQUEST_HEADERS,
};

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

impl Strategy {
    const NAMES: [(&'static str, Strategy); 3] = [
        ("PREFIX_AWARE", Strategy::PrefixAware),
        (
            "LEAST_OUTSTANDING_REQUESTS",
            Strategy::LeastOutstandingRequests,
        ),
        ("RANDOM", Strategy::Random),
    ];

    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::PrefixAware => "PREFIX_AWARE",
            Strategy::LeastOutstandingRequests => "LEAST_OUTSTANDING_REQUESTS",
            Strategy::Random => "RANDOM",
        }
    }
}

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

impl Matching {
    const NAMES: [(&'static str, Matching); 2] = [
        ("LONGEST_PREFIX", Matching::LongestPrefix),
        ("FIXED_PREFIX", Matching::FixedPrefix),
    ];

    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Matching::LongestPrefix => "LONGEST_PREFIX",
            Matching::FixedPrefix => "FIXED_PREFIX",
        }
    }

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

impl Counting {
    const NAMES: [(&'static str, Counting); 2] = [
        ("UPSTREAM_FILTER", Counting::UpstreamFilter),
        ("LISTENER", Counting::Listener),
    ];

    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Counting::UpstreamFilter => "UPSTREAM_FILTER",
            Counting::Listener => "LISTENER",
        }
    }
}

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
    /// How long an instance not seen serving stays an overflow candidate.
    pub instance_ttl_ms: u64,
    /// Where in-flight requests are counted (see [`Counting`]).
    pub counting: Counting,
    /// The fleet, known before the first request: `ip:port` of every
    /// instance of the cluster, registered at start and never forgotten by
    /// `instance_ttl_ms` while listed (instances learned from traffic still
    /// are). Empty (the default): learned from traffic only.
    pub instances: Vec<String>,
}

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
pub const MAX_INSTANCES: usize = 64;
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

const FIELDS: [&str; 18] = [
    "strategy",
    "match",
    "prefix_length",
    "block_bytes",
    "index_bytes",
    "load_margin",
    "concurrency_threshold",
    "key_header",
    "tenant_header",
    "max_body_bytes",
    "include_model",
    "body_tenant",
    "path_rules",
    "host_header",
    "decision_header",
    "instance_ttl_ms",
    "counting",
    "instances",
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
            concurrency_threshold: 10,
            key_header: DEFAULT_KEY_HEADER.to_string(),
            tenant_header: DEFAULT_TENANT_HEADER.to_string(),
            max_body_bytes: 1024 * 1024,
            include_model: true,
            body_tenant: true,
            path_rules: default_path_rules(),
            host_header: Some(DEFAULT_HOST_HEADER.to_string()),
            decision_header: None,
            instance_ttl_ms: 60_000,
            counting: Counting::UpstreamFilter,
            instances: Vec::new(),
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

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong_type(field: &str, expected: &str, value: &Value) -> ConfigError {
    error(
        field,
        format!(
            "expected {expected}, got {} ({})",
            type_name(value),
            shown(value)
        ),
    )
}

fn integer_in(field: &str, value: &Value, (lo, hi): (u64, u64)) -> Result<u64, ConfigError> {
    let out_of_range = || {
        error(
            field,
            format!("{} is out of range {lo}..={hi}", shown(value)),
        )
    };
    match value {
        Value::Number(n) => match n.as_u64() {
            Some(v) if (lo..=hi).contains(&v) => Ok(v),
            Some(_) => Err(out_of_range()),
            // Negative or fractional.
            None if n.is_i64() => Err(out_of_range()),
            None => Err(wrong_type(field, "an integer", value)),
        },
        _ => Err(wrong_type(field, "an integer", value)),
    }
}

/// One of the spellings in `names` (an enum's configuration names).
fn one_of<T: Copy>(name: &str, value: &Value, names: &[(&str, T)]) -> Result<T, ConfigError> {
    let text = string(name, value)?;
    names
        .iter()
        .find(|(spelling, _)| *spelling == text)
        .map(|(_, item)| *item)
        .ok_or_else(|| {
            let allowed: Vec<&str> = names.iter().map(|(spelling, _)| *spelling).collect();
            error(
                name,
                format!("{} is not one of {}", shown(value), allowed.join(", ")),
            )
        })
}

fn string<'v>(field: &str, value: &'v Value) -> Result<&'v str, ConfigError> {
    value
        .as_str()
        .ok_or_else(|| wrong_type(field, "a string", value))
}

/// RFC 9110 token characters; returned lowercase because Envoy stores
/// header names lowercase and HTTP/2 requires it.
fn header_name(field: &str, value: &Value) -> Result<String, ConfigError> {
    let name = string(field, value)?;
    let is_tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.is_empty() || !name.bytes().all(is_tchar) {
        return Err(error(
            field,
            format!(
                "{} is not an HTTP header name (1 or more of A-Z a-z 0-9 !#$%&'*+-.^_`|~)",
                shown(value)
            ),
        ));
    }
    Ok(name.to_ascii_lowercase())
}

/// A header name, or `null` for "none".
fn optional_header_name(field: &str, value: &Value) -> Result<Option<String>, ConfigError> {
    match value {
        Value::Null => Ok(None),
        _ => header_name(field, value).map(Some),
    }
}

fn api_kind(field: &str, value: &Value) -> Result<ApiKind, ConfigError> {
    const NAMES: [(&str, ApiKind); 4] = [
        ("chat_completions", ApiKind::ChatCompletions),
        ("completions", ApiKind::Completions),
        ("responses", ApiKind::Responses),
        ("invoke", ApiKind::Invoke),
    ];
    one_of(field, value, &NAMES)
}

/// `instances`: distinct `host:port` strings (the form `upstream.address`
/// takes, so they must be spelled as Envoy prints the endpoint: an IPv4
/// address and port, or `[v6]:port`), at most [`MAX_INSTANCES`].
fn instances(value: &Value) -> Result<Vec<String>, ConfigError> {
    let field = "instances";
    let items = value
        .as_array()
        .ok_or_else(|| wrong_type(field, "an array of \"ip:port\" strings", value))?;
    if items.len() > MAX_INSTANCES {
        return Err(error(
            field,
            format!(
                "{} instances is out of range 0..={MAX_INSTANCES}",
                items.len()
            ),
        ));
    }
    let mut out: Vec<String> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let item_field = format!("{field}[{i}]");
        let text = string(&item_field, item)?;
        if !is_socket_address(text) {
            return Err(error(
                &item_field,
                format!(
                    "{} is not ip:port (e.g. \"10.0.0.7:8000\" or \"[fd00::7]:8000\", as Envoy prints upstream.address)",
                    shown(item)
                ),
            ));
        }
        if out.iter().any(|known| known == text) {
            return Err(error(
                &item_field,
                format!("{} is listed twice", shown(item)),
            ));
        }
        out.push(text.to_string());
    }
    Ok(out)
}

/// `a.b.c.d:port` or `[v6]:port` with a port in 1..=65535, spelled the way
/// Envoy prints an endpoint (so it matches `upstream.address` byte for byte).
fn is_socket_address(text: &str) -> bool {
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

fn path_rules(value: &Value) -> Result<Vec<PathRule>, ConfigError> {
    let field = "path_rules";
    let items = value
        .as_array()
        .ok_or_else(|| wrong_type(field, "an array of {\"suffix\", \"api\"} objects", value))?;
    if items.len() > MAX_PATH_RULES {
        return Err(error(
            field,
            format!("{} rules is out of range 0..={MAX_PATH_RULES}", items.len()),
        ));
    }
    let mut rules = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("{field}[{i}]");
        let object = item
            .as_object()
            .ok_or_else(|| wrong_type(&at, "an object with \"suffix\" and \"api\"", item))?;
        reject_unknown(&at, object, &["suffix", "api"])?;
        let suffix_field = format!("{at}.suffix");
        let suffix_value = object
            .get("suffix")
            .ok_or_else(|| error(&suffix_field, "missing"))?;
        let suffix = string(&suffix_field, suffix_value)?;
        if !suffix.starts_with('/') || suffix.contains(['?', '#']) {
            return Err(error(
                &suffix_field,
                format!(
                    "{} must start with '/' and contain no '?' or '#'",
                    shown(suffix_value)
                ),
            ));
        }
        let api_field = format!("{at}.api");
        let api_value = object
            .get("api")
            .ok_or_else(|| error(&api_field, "missing"))?;
        rules.push(PathRule {
            suffix: suffix.to_string(),
            api: api_kind(&api_field, api_value)?,
        });
    }
    Ok(rules)
}

fn reject_unknown(
    at: &str,
    object: &Map<String, Value>,
    known: &[&str],
) -> Result<(), ConfigError> {
    match object.keys().find(|k| !known.contains(&k.as_str())) {
        Some(unknown) => Err(error(
            if at.is_empty() {
                unknown.clone()
            } else {
                format!("{at}.{unknown}")
            },
            format!("unknown field (known fields: {})", known.join(", ")),
        )),
        None => Ok(()),
    }
}

impl Config {
    /// Parses the plugin configuration. Empty (or only whitespace) means all
    /// defaults; otherwise a JSON object whose fields override the defaults.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Config::default());
        }
        let document: Value = serde_json::from_slice(bytes)
            .map_err(|e| error("configuration", format!("not valid JSON: {e}")))?;
        let object = document
            .as_object()
            .ok_or_else(|| wrong_type("configuration", "a JSON object", &document))?;
        reject_unknown("", object, &FIELDS)?;
        let mut config = Config::default();
        for (name, value) in object {
            config.apply_field(name, value)?;
        }
        if !object.contains_key("prefix_length") {
            config.prefix_length = config.matching.default_prefix_length();
        }
        config.check_consistency()?;
        Ok(config)
    }

    fn apply_field(&mut self, name: &str, value: &Value) -> Result<(), ConfigError> {
        match name {
            "strategy" => self.strategy = one_of(name, value, &Strategy::NAMES)?,
            "match" => self.matching = one_of(name, value, &Matching::NAMES)?,
            "block_bytes" => {
                self.block_bytes = to_usize(integer_in(name, value, BLOCK_BYTES_RANGE)?)
            }
            "index_bytes" => self.index_bytes = integer_in(name, value, INDEX_BYTES_RANGE)?,
            "load_margin" => {
                let v = integer_in(name, value, LOAD_MARGIN_RANGE)?;
                self.load_margin = u32::try_from(v).unwrap_or(u32::MAX);
            }
            "prefix_length" => {
                self.prefix_length = to_usize(integer_in(name, value, PREFIX_LENGTH_RANGE)?)
            }
            "concurrency_threshold" => {
                let v = integer_in(name, value, CONCURRENCY_THRESHOLD_RANGE)?;
                self.concurrency_threshold = u32::try_from(v).unwrap_or(u32::MAX);
            }
            "key_header" => self.key_header = header_name(name, value)?,
            "tenant_header" => self.tenant_header = header_name(name, value)?,
            "max_body_bytes" => {
                self.max_body_bytes = to_usize(integer_in(name, value, MAX_BODY_BYTES_RANGE)?)
            }
            "include_model" => {
                self.include_model = value
                    .as_bool()
                    .ok_or_else(|| wrong_type(name, "true or false", value))?
            }
            "body_tenant" => {
                self.body_tenant = value
                    .as_bool()
                    .ok_or_else(|| wrong_type(name, "true or false", value))?
            }
            "path_rules" => self.path_rules = path_rules(value)?,
            "host_header" => self.host_header = optional_header_name(name, value)?,
            "decision_header" => self.decision_header = optional_header_name(name, value)?,
            "instance_ttl_ms" => {
                self.instance_ttl_ms = integer_in(name, value, INSTANCE_TTL_MS_RANGE)?
            }
            "counting" => self.counting = one_of(name, value, &Counting::NAMES)?,
            "instances" => self.instances = instances(value)?,
            // `reject_unknown` ran first; kept total so a field listed in
            // FIELDS but not handled here is still an error, not a no-op.
            _ => return Err(error(name, "unknown field")),
        }
        Ok(())
    }

    /// Rules that involve more than one field.
    fn check_consistency(&self) -> Result<(), ConfigError> {
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
        if let Some(host) = &self.host_header {
            for (other, name) in [
                ("key_header", &self.key_header),
                ("tenant_header", &self.tenant_header),
            ] {
                if host == name {
                    return Err(error(
                        "host_header",
                        format!("\"{host}\" is also the {other}; they must differ"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The ranges above fit in 32 bits, so this never saturates in practice.
fn to_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The README's "complete example" is what it says: every field at its
    /// default except the opt-in debugging header, and accepted as pasted.
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
        let config = Config::parse(json.as_bytes()).expect("the README example is accepted");
        let expected = Config {
            decision_header: Some("x-prefix-route-decision".to_string()),
            ..Config::default()
        };
        assert_eq!(config, expected);
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
            instance_ttl_ms: 60_000,
            counting: Counting::UpstreamFilter,
            instances: Vec::new(),
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
        let tuned = parse(r#"{"block_bytes":64,"index_bytes":65536,"load_margin":0}"#).unwrap();
        assert_eq!(
            (tuned.block_bytes, tuned.index_bytes, tuned.load_margin),
            (64, 65536, 0)
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
            r#"path_rules: expected an array of {"suffix", "api"} objects, got an object ({"suffix":"/a"})"#
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
            "host_header: expected a string, got a boolean (true)"
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
            c.instances,
            vec!["10.0.0.7:8000", "127.0.0.1:1", "[fd00::7]:65535"]
        );
        assert_eq!(
            parse(r#"{"instances":[]}"#).map(|c| c.instances),
            Ok(vec![])
        );
    }

    #[test]
    fn instances_are_validated() {
        assert_eq!(
            err(r#"{"instances":"10.0.0.7:8000"}"#),
            "instances: expected an array of \"ip:port\" strings, got a string (\"10.0.0.7:8000\")"
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
            Ok(64)
        );
        assert_eq!(
            err(&list(MAX_INSTANCES + 1)),
            "instances: 65 instances is out of range 0..=64"
        );
    }
}
