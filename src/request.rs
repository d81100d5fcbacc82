//! The per-request state machine: from the request head and the body as it
//! arrives to a verdict the plugin (`plugin::Stream`) carries out. Sans-IO:
//! it never calls the host, so every path (chunked arrival, the late body callback
//! after `Continue`, the body limit, invalid tenants) is tested natively.
//!
//! Lifecycle, as Envoy drives it:
//! 1. [`RequestReader::on_request_headers`] once: validates the tenant
//!    header (invalid: [`HeadersVerdict::Reject`], before any body is read),
//!    classifies the path, and either decides at once (no body, or a
//!    strategy that needs no key) or asks to pause for the body.
//! 2. [`RequestReader::on_request_body`] per body callback. Envoy passes the
//!    whole buffered size each time; only the bytes not seen yet are read,
//!    each once. Once a decision is out, every later call answers
//!    [`BodyVerdict::AlreadyDecided`]: Envoy keeps calling after `Continue`
//!    (with `body_size` 0 and end of stream), and a header write then would
//!    be lost or, in Envoy's source, answered with an error the SDK panics on.

use std::rc::Rc;

use crate::blocks::PromptBlocks;
use crate::classify::{classify, ApiKind};
use crate::config::{Config, Matching, Strategy};
use crate::extract::{Extraction, Extractor, FallbackReason, Limits, PrefixSource, Progress};
use crate::headers::OnceHeader;
use crate::key::{routing_key, KeyMaterial};
use crate::tenant::{validate_header_tenant, InvalidTenant, TenantSource};

/// What the plugin reads from the request headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHead<'a> {
    /// `:path`, query included (classification strips it).
    pub path: &'a [u8],
    /// The configured tenant header, as the request has it.
    pub tenant_header: OnceHeader<'a>,
    /// The headers end the request: there is no body.
    pub end_of_stream: bool,
    /// What the headers say the body is.
    pub body: BodyKind,
}

/// What the request headers say the body is, which bounds how long it may be
/// held: a body that flows only once the response has begun, or a stream
/// whose client waits for an answer to its first message, would wait for
/// ever on a filter that holds it for `prefix_length` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// A request body: held until the prefix is read or the body ends.
    Plain,
    /// gRPC (`content-type: application/grpc...`): length-prefixed
    /// messages; held through its first message at most (a bidirectional
    /// stream's client may wait for a reply before it sends more).
    Grpc,
    /// An upgrade (WebSocket, `Upgrade` header) or `CONNECT`: the body is a
    /// stream that starts once Envoy answers. Nothing is held; no key.
    Upgrade,
}

impl BodyKind {
    /// From `:method`, whether an `upgrade` header is present, and
    /// `content-type`.
    pub fn of(method: Option<&[u8]>, upgrade: bool, content_type: Option<&[u8]>) -> BodyKind {
        let grpc = content_type.is_some_and(|t| {
            t.get(..16)
                .is_some_and(|start| start.eq_ignore_ascii_case(b"application/grpc"))
        });
        if upgrade || method.is_some_and(|m| m.eq_ignore_ascii_case(b"CONNECT")) {
            BodyKind::Upgrade
        } else if grpc {
            BodyKind::Grpc
        } else {
            BodyKind::Plain
        }
    }
}

/// A response the filter sends itself instead of forwarding the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// Why a request has no routing key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoKeyReason {
    /// No body bytes: the headers ended the stream, or the body was empty.
    NoBody,
    /// An upgrade or `CONNECT`: its body flows only once Envoy answers.
    Upgrade,
    /// The configured strategy routes without a prefix key.
    Strategy(Strategy),
}

/// How one request's routing key came out of its head and body (or why it
/// has none), and what metrics need of it. The policy then decides where the
/// request goes ([`crate::strategy::RouteHeaders`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyDerivation {
    /// The key header value (16 lowercase hex digits), or no key.
    pub key: Option<String>,
    /// Set exactly when `key` is `None`.
    pub no_key: Option<NoKeyReason>,
    pub api: ApiKind,
    /// The tenant hashed into the key (`None` when there is no key).
    pub tenant_source: TenantSource,
    /// What the prefix was made of (`None` when there is no key).
    pub prefix_source: Option<PrefixSource>,
    /// Set when an OpenAI-compatible body was routed on its raw bytes.
    pub fallback: Option<FallbackReason>,
    /// The prefix is shorter than `prefix_length`.
    pub short: bool,
    /// Body bytes fed to the extractor.
    pub bytes_inspected: usize,
    /// The prompt's chained blocks, for LONGEST_PREFIX (`None` otherwise,
    /// and when there is no key).
    pub blocks: Option<PromptBlocks>,
    /// The body's `model` where it is keyed (it names the LoRA adapter, if
    /// any).
    pub model: Option<String>,
}

/// What a key is derived with, from the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keying {
    /// The body's `model` is part of the key.
    pub include_model: bool,
    /// LONGEST_PREFIX: cut the prompt into blocks of this many bytes.
    pub block_bytes: Option<usize>,
}

impl Keying {
    pub fn of(config: &Config) -> Self {
        let longest =
            config.strategy == Strategy::PrefixAware && config.matching == Matching::LongestPrefix;
        Keying {
            include_model: config.include_model,
            block_bytes: longest.then_some(config.block_bytes),
        }
    }
}

/// What to do after the request headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadersVerdict {
    /// Decided already (no body, or no key needed): let the request go.
    Continue(KeyDerivation),
    /// Hold the headers until the body callbacks decide.
    PauseForBody,
    /// Answer locally; nothing reaches an upstream.
    Reject(LocalReply),
}

/// What to do after a body callback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyVerdict {
    /// Keep buffering: not decided yet.
    Pause,
    /// Decided now: write the key (if any), then let the request go.
    Continue(KeyDerivation),
    /// Decided earlier (or rejected): touch nothing, let data flow.
    AlreadyDecided,
}

/// Largest single read of the buffered body: few host calls for a large
/// JSON body (a raw-byte prefix reads only what it still lacks).
pub const READ_SLICE_BYTES: usize = 64 * 1024;

#[derive(Debug)]
enum State {
    AwaitingHeaders,
    ReadingBody {
        api: ApiKind,
        header_tenant: Option<String>,
        extractor: Extractor,
        /// Body bytes already read (and fed), from the start of the body.
        seen: usize,
    },
    Decided,
}

/// Routes one request. Holds the configuration it started with, so a
/// configuration change never alters a request half-way.
#[derive(Debug)]
pub struct RequestReader {
    config: Rc<Config>,
    state: State,
}

impl RequestReader {
    pub fn new(config: Rc<Config>) -> Self {
        RequestReader {
            config,
            state: State::AwaitingHeaders,
        }
    }

    /// Called once, with the request headers. (A repeated call starts the
    /// request over; Envoy does not make one.)
    pub fn on_request_headers(&mut self, head: RequestHead<'_>) -> HeadersVerdict {
        self.state = State::Decided;
        let api = classify(head.path, &self.config.path_rules);
        let checked = match head.tenant_header {
            OnceHeader::Absent => None,
            OnceHeader::Once(value) => Some(validate_header_tenant(value)),
            OnceHeader::Repeated { count } => Some(Err(InvalidTenant::Repeated { count })),
        };
        let header_tenant = match checked {
            None => None,
            Some(Ok(tenant)) => Some(tenant.to_string()),
            // Checked whatever the strategy, so switching strategy never
            // changes which requests are accepted.
            Some(Err(problem)) => {
                return HeadersVerdict::Reject(invalid_tenant_reply(
                    &self.config.tenant_header,
                    &problem.to_string(),
                ))
            }
        };
        if head.end_of_stream {
            return HeadersVerdict::Continue(unkeyed_derivation(api, NoKeyReason::NoBody));
        }
        if head.body == BodyKind::Upgrade {
            return HeadersVerdict::Continue(unkeyed_derivation(api, NoKeyReason::Upgrade));
        }
        if self.config.strategy != Strategy::PrefixAware {
            return HeadersVerdict::Continue(unkeyed_derivation(
                api,
                NoKeyReason::Strategy(self.config.strategy),
            ));
        }
        let limits = extraction_limits(&self.config, header_tenant.is_some());
        let mut extractor = Extractor::new(api, limits);
        if head.body == BodyKind::Grpc {
            extractor = extractor.ending_raw_prefix_with_the_first_grpc_message();
        }
        self.state = State::ReadingBody {
            api,
            header_tenant,
            extractor,
            seen: 0,
        };
        HeadersVerdict::PauseForBody
    }

    /// Called per body callback with the whole buffered body size. `read`
    /// returns `len` bytes of the buffered body from `start` (or fewer, or
    /// `None` on failure); only bytes of `[seen, min(buffered_size,
    /// max_body_bytes))` not read before are asked for, in slices of at most
    /// [`READ_SLICE_BYTES`] and of what the extractor can still use, and no
    /// more once the extractor is done.
    pub fn on_request_body(
        &mut self,
        buffered_size: usize,
        end_of_stream: bool,
        read: &mut dyn FnMut(usize, usize) -> Option<Vec<u8>>,
    ) -> BodyVerdict {
        let State::ReadingBody {
            extractor, seen, ..
        } = &mut self.state
        else {
            return BodyVerdict::AlreadyDecided;
        };
        let max = self.config.max_body_bytes;
        let available = buffered_size.min(max);
        let mut progress = Progress::NeedMore;
        // In slices, so an extractor that is done early (an invoke prefix)
        // does not make the host copy a whole large buffer into the VM.
        while progress == Progress::NeedMore && available > *seen {
            let useful = extractor.max_useful_bytes().unwrap_or(READ_SLICE_BYTES);
            let want = (available - *seen).min(READ_SLICE_BYTES).min(useful);
            if want == 0 {
                break;
            }
            let Some(bytes) = read(*seen, want) else {
                break;
            };
            // A host returning more than asked must not make us feed bytes
            // twice or past the limit.
            let chunk = bytes.get(..want).unwrap_or(&bytes);
            if chunk.is_empty() {
                break;
            }
            *seen += chunk.len();
            progress = extractor.feed(chunk);
            if chunk.len() < want {
                // Short read: try the rest on the next callback.
                break;
            }
        }
        // Held while Envoy buffers less than the limit, whatever was read:
        // reads that keep failing must not hold a body past it (Envoy would
        // answer 413).
        if progress == Progress::NeedMore && !end_of_stream && buffered_size < max {
            return BodyVerdict::Pause;
        }
        BodyVerdict::Continue(self.decide())
    }

    /// Called when request trailers arrive: the body has ended without an
    /// end-of-stream body callback, and every body callback already read all
    /// that had arrived, so decide on what was read (else the request would
    /// wait for a body end that never comes).
    pub fn on_request_trailers(&mut self) -> BodyVerdict {
        match self.state {
            State::ReadingBody { .. } => BodyVerdict::Continue(self.decide()),
            _ => BodyVerdict::AlreadyDecided,
        }
    }

    /// Ends body reading and computes the decision.
    fn decide(&mut self) -> KeyDerivation {
        let State::ReadingBody {
            api,
            header_tenant,
            extractor,
            seen,
        } = std::mem::replace(&mut self.state, State::Decided)
        else {
            // Only called while reading; a harmless answer otherwise.
            return unkeyed_derivation(ApiKind::Invoke, NoKeyReason::NoBody);
        };
        if seen == 0 {
            return unkeyed_derivation(api, NoKeyReason::NoBody);
        }
        keyed_derivation(
            api,
            header_tenant.as_deref(),
            extractor.finish(),
            Keying::of(&self.config),
        )
    }
}

/// What the extractor is asked for: the body tenant only when no header
/// named one, so extraction can stop as soon as it has the prefix.
pub fn extraction_limits(config: &Config, have_header_tenant: bool) -> Limits {
    Limits {
        prefix_length: config.prefix_length,
        max_body_bytes: config.max_body_bytes,
        include_model: config.include_model,
        want_body_tenant: config.body_tenant && !have_header_tenant,
    }
}

/// The key and metrics of a request whose body was read. The header tenant
/// wins over the body's `prompt_cache_key`.
pub fn keyed_derivation(
    api: ApiKind,
    header_tenant: Option<&str>,
    extraction: Extraction,
    keying: Keying,
) -> KeyDerivation {
    let (tenant, tenant_source) = match (header_tenant, &extraction.body_tenant) {
        (Some(t), _) => (Some(t.as_bytes()), TenantSource::Header),
        (None, Some(t)) => (Some(t.as_bytes()), TenantSource::Body),
        (None, None) => (None, TenantSource::None),
    };
    // Also enforced here, whatever the extractor returned.
    let model = if keying.include_model {
        extraction.model.as_deref().map(str::as_bytes)
    } else {
        None
    };
    let material = KeyMaterial {
        tenant,
        model,
        source: extraction.source,
        prefix: &extraction.prefix,
    };
    let key = routing_key(&material);
    let blocks = keying
        .block_bytes
        .map(|block_bytes| PromptBlocks::new(&material, block_bytes));
    let model = if keying.include_model {
        extraction.model
    } else {
        None
    };
    KeyDerivation {
        key: Some(key),
        no_key: None,
        api,
        tenant_source,
        prefix_source: Some(extraction.source),
        fallback: extraction.fallback,
        short: extraction.short,
        bytes_inspected: extraction.bytes_inspected,
        blocks,
        model,
    }
}

fn unkeyed_derivation(api: ApiKind, reason: NoKeyReason) -> KeyDerivation {
    KeyDerivation {
        key: None,
        no_key: Some(reason),
        api,
        tenant_source: TenantSource::None,
        prefix_source: None,
        fallback: None,
        short: false,
        bytes_inspected: 0,
        blocks: None,
        model: None,
    }
}

/// The 400 answer to an invalid tenant header, in OpenAI's error shape so
/// OpenAI clients surface it: `param` names the header, `code` the problem.
pub fn invalid_tenant_reply(header: &str, problem: &str) -> LocalReply {
    let body = serde_json::json!({
        "error": {
            "message": format!("{header}: {problem}"),
            "type": "invalid_request_error",
            "param": header,
            "code": "invalid_tenant_header",
        }
    });
    LocalReply {
        status: 400,
        headers: vec![("content-type".to_string(), "application/json".to_string())],
        body: body.to_string().into_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXED: Keying = Keying {
        include_model: true,
        block_bytes: None,
    };
    use crate::key::routing_key;

    /// A fake of Envoy's buffered request body: what has arrived so far,
    /// and a log of every read.
    struct FakeBody {
        buffered: Vec<u8>,
        reads: Vec<(usize, usize)>,
    }

    impl FakeBody {
        fn new() -> Self {
            FakeBody {
                buffered: Vec::new(),
                reads: Vec::new(),
            }
        }

        /// Appends a chunk and runs the body callback as Envoy would.
        fn arrive(&mut self, reader: &mut RequestReader, chunk: &[u8], eos: bool) -> BodyVerdict {
            self.buffered.extend_from_slice(chunk);
            let size = self.buffered.len();
            let buffered = &self.buffered;
            let reads = &mut self.reads;
            reader.on_request_body(size, eos, &mut |start, len| {
                reads.push((start, len));
                let end = start.checked_add(len)?.min(buffered.len());
                buffered.get(start..end).map(<[u8]>::to_vec)
            })
        }
    }

    fn config(json: &str) -> Rc<Config> {
        Rc::new(Config::parse(json.as_bytes()).unwrap())
    }

    fn small() -> Rc<Config> {
        config(r#"{"prefix_length":1024,"max_body_bytes":4096}"#)
    }

    fn head<'a>(path: &'a str, tenant: Option<&'a [u8]>) -> RequestHead<'a> {
        RequestHead {
            path: path.as_bytes(),
            tenant_header: tenant.map_or(OnceHeader::Absent, OnceHeader::Once),
            end_of_stream: false,
            body: BodyKind::Plain,
        }
    }

    fn raw_key(tenant: Option<&[u8]>, prefix: &[u8]) -> String {
        routing_key(&KeyMaterial {
            tenant,
            model: None,
            source: PrefixSource::RawBytes,
            prefix,
        })
    }

    fn continued(verdict: BodyVerdict) -> KeyDerivation {
        match verdict {
            BodyVerdict::Continue(d) => d,
            other => panic!("expected Continue, got {other:?}"),
        }
    }

    fn body(len: usize) -> Vec<u8> {
        (0..len).map(|i| b'a' + (i % 26) as u8).collect()
    }

    #[test]
    fn the_body_kind_comes_from_method_upgrade_and_content_type() {
        use BodyKind::*;
        /// `:method`, an `upgrade` header present, `content-type`, the kind.
        type Case<'a> = (&'a [u8], bool, Option<&'a [u8]>, BodyKind);
        let cases: [Case; 8] = [
            (b"POST", false, Some(b"application/json"), Plain),
            (b"POST", false, None, Plain),
            (b"GET", true, None, Upgrade),
            (b"CONNECT", false, None, Upgrade),
            (b"connect", false, Some(b"application/grpc"), Upgrade),
            (b"POST", false, Some(b"application/grpc"), Grpc),
            (b"POST", false, Some(b"Application/GRPC+proto"), Grpc),
            (b"POST", false, Some(b"application/grp"), Plain),
        ];
        for (method, upgrade, content_type, expected) in cases {
            assert_eq!(
                BodyKind::of(Some(method), upgrade, content_type),
                expected,
                "{method:?} {upgrade} {content_type:?}"
            );
        }
    }

    /// A WebSocket upgrade's or CONNECT's body flows only once Envoy has
    /// answered: held for it, the request would wait for ever.
    #[test]
    fn an_upgrade_is_decided_at_its_headers_without_a_key() {
        let mut reader = RequestReader::new(small());
        let verdict = reader.on_request_headers(RequestHead {
            body: BodyKind::Upgrade,
            ..head("/v1/realtime", None)
        });
        let HeadersVerdict::Continue(d) = verdict else {
            panic!("{verdict:?}")
        };
        assert_eq!((d.key, d.no_key), (None, Some(NoKeyReason::Upgrade)));
    }

    /// A gRPC stream's client may wait for a reply to its first message:
    /// the prefix ends with that message, however the body arrives.
    #[test]
    fn a_grpc_body_is_held_through_its_first_message_at_most() {
        let mut first = vec![0, 0, 0, 0, 40];
        first.extend(body(40));
        let mut stream = first.clone();
        stream.extend([0, 0, 0, 0, 3, b'x', b'y', b'z']);
        for step in 1..=stream.len() {
            let mut reader = RequestReader::new(small());
            let verdict = reader.on_request_headers(RequestHead {
                body: BodyKind::Grpc,
                ..head("/inference.GRPCInferenceService/ModelStreamInfer", None)
            });
            assert_eq!(verdict, HeadersVerdict::PauseForBody);
            let mut fake = FakeBody::new();
            let mut decided = None;
            for piece in stream.chunks(step) {
                match fake.arrive(&mut reader, piece, false) {
                    BodyVerdict::Pause => {}
                    BodyVerdict::Continue(d) => {
                        decided = Some((d, fake.buffered.len()));
                        break;
                    }
                    BodyVerdict::AlreadyDecided => panic!("decided twice"),
                }
            }
            let (d, arrived) = decided.expect("decided without the end of the stream");
            assert!(arrived < first.len() + step, "held past the first message");
            assert_eq!(d.key, Some(raw_key(None, &first)), "pieces of {step}");
        }
        // A first message longer than the prefix: the prefix, as for any body.
        let mut reader = RequestReader::new(small());
        reader.on_request_headers(RequestHead {
            body: BodyKind::Grpc,
            ..head("/svc/Method", None)
        });
        let mut long = vec![0, 0, 0, 8, 0];
        long.extend(body(2048));
        let d = continued(FakeBody::new().arrive(&mut reader, &long, false));
        assert_eq!(d.key, Some(raw_key(None, &long[..1024])));
    }

    #[test]
    fn chunked_body_is_read_once_and_keyed_on_its_prefix() {
        let mut reader = RequestReader::new(small());
        assert_eq!(
            reader.on_request_headers(head("/invocations", None)),
            HeadersVerdict::PauseForBody
        );
        let data = body(3000);
        let mut fake = FakeBody::new();
        assert_eq!(
            fake.arrive(&mut reader, &data[..10], false),
            BodyVerdict::Pause
        );
        assert_eq!(
            fake.arrive(&mut reader, &data[10..600], false),
            BodyVerdict::Pause
        );
        let d = continued(fake.arrive(&mut reader, &data[600..2000], false));
        // Each byte read once, from where the last read stopped, and no
        // more than the prefix still lacks.
        assert_eq!(fake.reads, vec![(0, 10), (10, 590), (600, 424)]);
        assert_eq!(d.key, Some(raw_key(None, &data[..1024])));
        assert_eq!(d.no_key, None);
        assert_eq!(d.api, ApiKind::Invoke);
        assert_eq!(d.prefix_source, Some(PrefixSource::RawBytes));
        assert!(!d.short);
        assert_eq!(d.tenant_source, TenantSource::None);
    }

    #[test]
    fn callbacks_after_the_decision_read_nothing_and_change_nothing() {
        let mut reader = RequestReader::new(small());
        reader.on_request_headers(head("/invocations", None));
        let mut fake = FakeBody::new();
        continued(fake.arrive(&mut reader, &body(2000), false));
        let reads = fake.reads.len();
        // Envoy's late callback after Continue: size 0, end of stream.
        assert_eq!(
            reader.on_request_body(0, true, &mut |_, _| panic!("read after decision")),
            BodyVerdict::AlreadyDecided
        );
        assert_eq!(
            fake.arrive(&mut reader, b"more", true),
            BodyVerdict::AlreadyDecided
        );
        assert_eq!(fake.reads.len(), reads);
    }

    #[test]
    fn short_body_is_decided_at_end_of_stream() {
        let mut reader = RequestReader::new(small());
        reader.on_request_headers(head("/invocations", None));
        let mut fake = FakeBody::new();
        assert_eq!(
            fake.arrive(&mut reader, b"hello ", false),
            BodyVerdict::Pause
        );
        let d = continued(fake.arrive(&mut reader, b"world", true));
        assert_eq!(d.key, Some(raw_key(None, b"hello world")));
        assert!(d.short);
        assert_eq!(d.bytes_inspected, 11);
    }

    #[test]
    fn end_of_stream_with_no_new_bytes_still_decides() {
        let mut reader = RequestReader::new(small());
        reader.on_request_headers(head("/invocations", None));
        let mut fake = FakeBody::new();
        assert_eq!(fake.arrive(&mut reader, b"abc", false), BodyVerdict::Pause);
        let d = continued(fake.arrive(&mut reader, b"", true));
        assert_eq!(d.key, Some(raw_key(None, b"abc")));
        assert_eq!(fake.reads, vec![(0, 3)]);
    }

    #[test]
    fn no_body_gets_no_key() {
        let mut reader = RequestReader::new(small());
        let verdict = reader.on_request_headers(RequestHead {
            end_of_stream: true,
            ..head("/v1/chat/completions", None)
        });
        let HeadersVerdict::Continue(d) = verdict else {
            panic!("{verdict:?}")
        };
        assert_eq!((d.key, d.no_key), (None, Some(NoKeyReason::NoBody)));
        assert_eq!(d.api, ApiKind::ChatCompletions);
        assert_eq!(
            reader.on_request_body(0, true, &mut |_, _| None),
            BodyVerdict::AlreadyDecided
        );
    }

    #[test]
    fn empty_body_gets_no_key() {
        let mut reader = RequestReader::new(small());
        reader.on_request_headers(head("/invocations", None));
        let mut fake = FakeBody::new();
        let d = continued(fake.arrive(&mut reader, b"", true));
        assert_eq!((d.key, d.no_key), (None, Some(NoKeyReason::NoBody)));
        assert!(fake.reads.is_empty());
    }

    #[test]
    fn body_limit_decides_without_holding_more() {
        // prefix_length 4096 = max_body_bytes: the prefix fills exactly at the limit.
        let mut reader =
            RequestReader::new(config(r#"{"prefix_length":4096,"max_body_bytes":4096}"#));
        reader.on_request_headers(head("/invocations", None));
        let data = body(10_000);
        let mut fake = FakeBody::new();
        assert_eq!(
            fake.arrive(&mut reader, &data[..3000], false),
            BodyVerdict::Pause
        );
        // One chunk crossing the limit: only up to the limit is read.
        let d = continued(fake.arrive(&mut reader, &data[3000..6000], false));
        assert_eq!(fake.reads, vec![(0, 3000), (3000, 1096)]);
        assert_eq!(d.bytes_inspected, 4096);
        assert_eq!(d.key, Some(raw_key(None, &data[..4096])));
    }

    #[test]
    fn limit_reached_before_extractor_is_done_still_continues() {
        // A chat body whose text never reaches prefix_length within the
        // limit must not be held past max_body_bytes.
        let mut reader =
            RequestReader::new(config(r#"{"prefix_length":4096,"max_body_bytes":4096}"#));
        reader.on_request_headers(head("/v1/chat/completions", None));
        let mut fake = FakeBody::new();
        let mut data = br#"{"messages":[{"role":"user","content":""#.to_vec();
        data.extend(std::iter::repeat_n(b' ', 8000));
        assert_eq!(
            fake.arrive(&mut reader, &data[..2000], false),
            BodyVerdict::Pause
        );
        let d = continued(fake.arrive(&mut reader, &data[2000..], false));
        assert_eq!(d.bytes_inspected, 4096);
        assert!(d.key.is_some());
        assert_eq!(fake.reads.last(), Some(&(2000, 2096)));
    }

    #[test]
    fn large_buffer_is_read_in_slices_only_while_needed() {
        let mut reader = RequestReader::new(config(
            r#"{"prefix_length":40000,"max_body_bytes":1048576}"#,
        ));
        reader.on_request_headers(head("/invocations", None));
        let data = body(200_000);
        let mut fake = FakeBody::new();
        let d = continued(fake.arrive(&mut reader, &data, false));
        // One read of exactly the 40000-byte prefix; the rest is never copied.
        assert_eq!(fake.reads, vec![(0, 40000)]);
        assert_eq!(d.key, Some(raw_key(None, &data[..40000])));
    }

    #[test]
    fn json_is_read_in_large_slices_up_to_the_limit() {
        let mut reader =
            RequestReader::new(config(r#"{"prefix_length":1024,"max_body_bytes":150000}"#));
        reader.on_request_headers(head("/v1/chat/completions", None));
        // No tenant header: the body is read on for a `prompt_cache_key`.
        let mut data = br#"{"messages":[{"role":"user","content":"hi"}],"x":""#.to_vec();
        data.extend(std::iter::repeat_n(b'a', 200_000));
        let mut fake = FakeBody::new();
        let d = continued(fake.arrive(&mut reader, &data, false));
        let slice = READ_SLICE_BYTES;
        assert_eq!(
            fake.reads,
            vec![(0, slice), (slice, slice), (2 * slice, 150_000 - 2 * slice)]
        );
        assert_eq!(d.bytes_inspected, 150_000);
    }

    #[test]
    fn a_read_failure_waits_for_the_next_callback() {
        let mut reader = RequestReader::new(small());
        reader.on_request_headers(head("/invocations", None));
        assert_eq!(
            reader.on_request_body(100, false, &mut |_, _| None),
            BodyVerdict::Pause
        );
        let data = body(1500);
        let mut reads = Vec::new();
        let d = continued(reader.on_request_body(1500, false, &mut |start, len| {
            reads.push((start, len));
            data.get(start..start + len).map(<[u8]>::to_vec)
        }));
        assert_eq!(reads, vec![(0, 1024)]);
        assert_eq!(d.key, Some(raw_key(None, &data[..1024])));
    }

    #[test]
    fn short_and_oversized_reads_feed_each_byte_once() {
        let mut reader = RequestReader::new(small());
        reader.on_request_headers(head("/invocations", None));
        let data = body(2000);
        // Host gives back only 100 of the 500 asked.
        assert_eq!(
            reader.on_request_body(500, false, &mut |s, _| data
                .get(s..s + 100)
                .map(<[u8]>::to_vec)),
            BodyVerdict::Pause
        );
        // Host gives back more than asked (everything from start); asked
        // only for what the 1024-byte prefix still lacks.
        let d = continued(reader.on_request_body(1500, false, &mut |s, len| {
            assert_eq!((s, len), (100, 924));
            data.get(s..).map(<[u8]>::to_vec)
        }));
        // Only the 1024-byte prefix is fed and inspected.
        assert_eq!(d.bytes_inspected, 1024);
        assert_eq!(d.key, Some(raw_key(None, &data[..1024])));
    }

    #[test]
    fn invalid_tenant_header_is_rejected_before_the_body() {
        let cfg = small();
        for bad in [&b""[..], b"tab\there", &[b'x'; 65]] {
            let mut reader = RequestReader::new(cfg.clone());
            let HeadersVerdict::Reject(reply) =
                reader.on_request_headers(head("/invocations", Some(bad)))
            else {
                panic!("accepted {bad:?}")
            };
            assert_eq!(reply.status, 400);
            assert_eq!(
                reply.headers,
                vec![("content-type".to_string(), "application/json".to_string())]
            );
            let json: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
            let error = json["error"].as_object().unwrap();
            let mut fields: Vec<&str> = error.keys().map(String::as_str).collect();
            fields.sort_unstable();
            assert_eq!(
                fields,
                ["code", "message", "param", "type"],
                "OpenAI's shape"
            );
            assert_eq!(error["type"], "invalid_request_error");
            assert_eq!(error["code"], "invalid_tenant_header");
            assert_eq!(error["param"], "x-amzn-sagemaker-prefix-aware-id");
            let message = error["message"].as_str().unwrap();
            assert!(
                message.starts_with("x-amzn-sagemaker-prefix-aware-id: ")
                    && message.contains("1 to 64 printable ASCII"),
                "{message}"
            );
            assert_eq!(
                reader.on_request_body(10, true, &mut |_, _| panic!("body read after reject")),
                BodyVerdict::AlreadyDecided
            );
        }
    }

    #[test]
    fn a_repeated_tenant_header_is_rejected_whatever_its_values() {
        let cfg = small();
        // Two valid values, and a valid one before an invalid one: neither
        // may be keyed on (nor pass unchecked).
        for count in [2, 3] {
            let mut reader = RequestReader::new(cfg.clone());
            let head = RequestHead {
                path: b"/invocations",
                tenant_header: OnceHeader::Repeated { count },
                end_of_stream: false,
                body: BodyKind::Plain,
            };
            let HeadersVerdict::Reject(reply) = reader.on_request_headers(head) else {
                panic!("accepted a tenant header sent {count} times")
            };
            assert_eq!(reply.status, 400);
            let json: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
            assert_eq!(json["error"]["code"], "invalid_tenant_header");
            assert_eq!(
                json["error"]["message"],
                format!("x-amzn-sagemaker-prefix-aware-id: the tenant header must be sent once; it was sent {count} times")
            );
        }
    }

    #[test]
    fn invalid_tenant_is_rejected_even_without_body_or_key() {
        let mut reader = RequestReader::new(config(r#"{"strategy":"RANDOM"}"#));
        let verdict = reader.on_request_headers(RequestHead {
            end_of_stream: true,
            ..head("/x", Some(b"\x01"))
        });
        assert!(
            matches!(verdict, HeadersVerdict::Reject(ref r) if r.status == 400),
            "{verdict:?}"
        );
    }

    #[test]
    fn tenant_header_is_part_of_the_key() {
        let cfg = small();
        let data = body(1100);
        let key_for = |tenant: Option<&[u8]>| {
            let mut reader = RequestReader::new(cfg.clone());
            assert_eq!(
                reader.on_request_headers(head("/invocations", tenant)),
                HeadersVerdict::PauseForBody
            );
            continued(FakeBody::new().arrive(&mut reader, &data, true))
        };
        let a = key_for(Some(b"team-a"));
        let b = key_for(Some(b"team-b"));
        let none = key_for(None);
        assert_eq!(a.tenant_source, TenantSource::Header);
        assert_eq!(a.key, Some(raw_key(Some(b"team-a"), &data[..1024])));
        assert_ne!(a.key, b.key);
        assert_ne!(a.key, none.key);
    }

    fn extraction(body_tenant: Option<&str>, model: Option<&str>) -> Extraction {
        Extraction {
            source: PrefixSource::CanonicalText,
            prefix: b"user\0hello".to_vec(),
            model: model.map(str::to_string),
            body_tenant: body_tenant.map(str::to_string),
            fallback: None,
            short: true,
            bytes_inspected: 42,
        }
    }

    fn canonical_key(tenant: Option<&str>, model: Option<&str>) -> Option<String> {
        Some(routing_key(&KeyMaterial {
            tenant: tenant.map(str::as_bytes),
            model: model.map(str::as_bytes),
            source: PrefixSource::CanonicalText,
            prefix: b"user\0hello",
        }))
    }

    /// With `body_tenant: false`, a chat body is read only up to its prefix
    /// and model, and a `prompt_cache_key` after them changes nothing.
    #[test]
    fn without_body_tenant_reading_stops_at_the_prefix() {
        let messages = format!(r#"[{{"role":"user","content":"{}"}}]"#, "x".repeat(1500));
        // Delivered in 2 KiB pieces: how far the body had to arrive before
        // the filter decided.
        let keyed = |json: &str, body: &str| {
            let mut reader = RequestReader::new(config(json));
            reader.on_request_headers(head("/v1/chat/completions", None));
            let mut fake = FakeBody::new();
            let pieces: Vec<&[u8]> = body.as_bytes().chunks(2048).collect();
            for (index, piece) in pieces.iter().enumerate() {
                let last = index + 1 == pieces.len();
                if let BodyVerdict::Continue(decision) = fake.arrive(&mut reader, piece, last) {
                    return (decision, (index + 1) * 2048);
                }
            }
            panic!("no decision at the end of the body");
        };
        let filler = "y".repeat(60_000);
        let with_key = format!(
            r#"{{"model":"m","messages":{messages},"filler":"{filler}","prompt_cache_key":"tenant-1"}}"#
        );
        let without_key = format!(r#"{{"model":"m","messages":{messages},"filler":"{filler}"}}"#);
        let off = r#"{"prefix_length":1024,"body_tenant":false}"#;
        let (a, arrived_a) = keyed(off, &with_key);
        let (b, _) = keyed(off, &without_key);
        assert_eq!(a.key, b.key, "prompt_cache_key ignored");
        assert_eq!(a.tenant_source, TenantSource::None);
        assert!(arrived_a <= 4096, "decided after {arrived_a} bytes");
        let (c, arrived_c) = keyed(r#"{"prefix_length":1024}"#, &with_key);
        assert_eq!(c.tenant_source, TenantSource::Body);
        assert_ne!(c.key, a.key);
        assert!(
            arrived_c >= with_key.len(),
            "read to the end for prompt_cache_key"
        );
    }

    #[test]
    fn header_tenant_wins_over_body_tenant() {
        let d = keyed_derivation(
            ApiKind::ChatCompletions,
            Some("hdr"),
            extraction(Some("body"), None),
            FIXED,
        );
        assert_eq!(d.tenant_source, TenantSource::Header);
        assert_eq!(d.key, canonical_key(Some("hdr"), None));
        let d = keyed_derivation(
            ApiKind::ChatCompletions,
            None,
            extraction(Some("body"), None),
            FIXED,
        );
        assert_eq!(d.tenant_source, TenantSource::Body);
        assert_eq!(d.key, canonical_key(Some("body"), None));
        let d = keyed_derivation(
            ApiKind::ChatCompletions,
            None,
            extraction(None, None),
            FIXED,
        );
        assert_eq!(d.tenant_source, TenantSource::None);
        assert_eq!(d.key, canonical_key(None, None));
    }

    #[test]
    fn model_is_keyed_only_when_configured() {
        let d = keyed_derivation(
            ApiKind::ChatCompletions,
            None,
            extraction(None, Some("m1")),
            FIXED,
        );
        assert_eq!(d.key, canonical_key(None, Some("m1")));
        let d = keyed_derivation(
            ApiKind::ChatCompletions,
            None,
            extraction(None, Some("m1")),
            Keying {
                include_model: false,
                block_bytes: None,
            },
        );
        assert_eq!(d.key, canonical_key(None, None));
    }

    #[test]
    fn decision_carries_what_metrics_need() {
        let mut x = extraction(None, None);
        x.fallback = Some(FallbackReason::InvalidJson);
        x.source = PrefixSource::RawBytes;
        let d = keyed_derivation(ApiKind::Responses, None, x, FIXED);
        assert_eq!(d.api, ApiKind::Responses);
        assert_eq!(d.fallback, Some(FallbackReason::InvalidJson));
        assert_eq!(d.prefix_source, Some(PrefixSource::RawBytes));
        assert!(d.short);
        assert_eq!(d.bytes_inspected, 42);
        assert_eq!(d.no_key, None);
    }

    #[test]
    fn body_tenant_is_asked_for_only_without_header() {
        let cfg = small();
        assert!(extraction_limits(&cfg, false).want_body_tenant);
        assert!(!extraction_limits(&cfg, true).want_body_tenant);
        let off = config(r#"{"body_tenant":false}"#);
        assert!(!extraction_limits(&off, false).want_body_tenant);
        let limits = extraction_limits(
            &config(r#"{"prefix_length":2048,"include_model":false}"#),
            false,
        );
        assert_eq!(
            (
                limits.prefix_length,
                limits.max_body_bytes,
                limits.include_model
            ),
            (2048, 1_048_576, false)
        );
        let mut reader = RequestReader::new(cfg);
        reader.on_request_headers(head("/v1/chat/completions", Some(b"t")));
        let State::ReadingBody { header_tenant, .. } = &reader.state else {
            panic!("not reading")
        };
        assert_eq!(header_tenant.as_deref(), Some("t"));
    }

    #[test]
    fn strategies_without_prefix_key_continue_at_headers() {
        for (strategy, value) in [
            ("RANDOM", Strategy::Random),
            (
                "LEAST_OUTSTANDING_REQUESTS",
                Strategy::LeastOutstandingRequests,
            ),
        ] {
            let mut reader = RequestReader::new(config(&format!(r#"{{"strategy":"{strategy}"}}"#)));
            let verdict = reader.on_request_headers(head("/v1/responses", None));
            let HeadersVerdict::Continue(d) = verdict else {
                panic!("{verdict:?}")
            };
            assert_eq!(d.key, None);
            assert_eq!(d.no_key, Some(NoKeyReason::Strategy(value)));
            assert_eq!(d.api, ApiKind::Responses);
            assert_eq!(
                FakeBody::new().arrive(&mut reader, b"{}", true),
                BodyVerdict::AlreadyDecided
            );
        }
    }

    #[test]
    fn classification_uses_configured_rules() {
        let mut reader = RequestReader::new(config(
            r#"{"path_rules":[{"suffix":"/generate","api":"completions"}]}"#,
        ));
        reader.on_request_headers(head("/v1/generate?x=1", None));
        let d = continued(FakeBody::new().arrive(&mut reader, b"{\"prompt\":\"hi\"}", true));
        assert_eq!(d.api, ApiKind::Completions);
        let mut reader = RequestReader::new(config(r#"{"path_rules":[]}"#));
        reader.on_request_headers(head("/v1/chat/completions", None));
        let d = continued(FakeBody::new().arrive(&mut reader, b"{}", true));
        assert_eq!(d.api, ApiKind::Invoke);
    }

    #[test]
    fn trailers_end_the_body() {
        let mut reader = RequestReader::new(small());
        reader.on_request_headers(head("/invocations", None));
        let mut fake = FakeBody::new();
        assert_eq!(
            fake.arrive(&mut reader, b"short body", false),
            BodyVerdict::Pause
        );
        let d = continued(reader.on_request_trailers());
        assert_eq!(d.key, Some(raw_key(None, b"short body")));
        assert_eq!(reader.on_request_trailers(), BodyVerdict::AlreadyDecided);
        // Trailers right after headers: no body bytes, no key.
        let mut reader = RequestReader::new(small());
        reader.on_request_headers(head("/invocations", None));
        assert_eq!(
            continued(reader.on_request_trailers()).no_key,
            Some(NoKeyReason::NoBody)
        );
    }

    #[test]
    fn body_before_headers_reads_nothing() {
        let mut reader = RequestReader::new(small());
        assert_eq!(
            reader.on_request_body(10, true, &mut |_, _| panic!("read before headers")),
            BodyVerdict::AlreadyDecided
        );
    }
}
