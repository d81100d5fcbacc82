//! One HTTP stream's callbacks: feeds the sans-IO [`RequestReader`], runs the
//! policy once the key is known, writes the headers that carry the decision
//! out, counts in the upstream role (or at the response with `counting:
//! LISTENER`), and gives its in-flight count back exactly once at the end.

use std::rc::Rc;

use xxhash_rust::xxh3::xxh3_64;

use super::metric_ids::MetricIds;
use super::vm::Vm;
use super::{warn_on_error, Flow};
use crate::config::{Config, Counting};
use crate::counting_check::{AtResponse, MISSING_UPSTREAM_FILTER_WARNING};
use crate::engine_load::orca;
use crate::headers::OnceHeader;
use crate::headers::{COUNTED_HEADER, INTERNAL_REQUEST_HEADERS};
use crate::host::{HeaderMap, Host};
use crate::load::{adapter_hash, EngineView, Ticket, UpstreamStart, FAILED_RETRY_MS};
use crate::metrics::{Counter, UsageCounter};
use crate::request::{
    BodyKind, BodyVerdict, HeadersVerdict, KeyDerivation, LocalReply, RequestHead, RequestReader,
};
use crate::steering::{self, ListenerCount};
use crate::strategy::{
    AdapterDecision, DecisionKind, Explained, Policy, RouteHeaders, RouteRequest,
};
use crate::usage::check::{Prediction, Verdict};
use crate::usage::{Framing, UsageScanner};

/// See the module documentation.
#[derive(Debug)]
pub struct Stream {
    /// The configuration and policy this request started with.
    config: Rc<Config>,
    policy: Rc<Policy>,
    reader: RequestReader,
    metrics: Rc<MetricIds>,
    /// Runs as the cluster's upstream filter (counts, does not decide):
    /// the instance this attempt went to.
    upstream: Option<String>,
    /// Upstream role: the instance answered (response headers came).
    answered: bool,
    /// The in-flight count this stream holds; released once, in `on_done`.
    ticket: Option<Ticket>,
    /// The routing decision's kind and matched bytes, for the debug
    /// response header.
    decided: Option<(DecisionKind, Option<u64>)>,
    /// LONGEST_PREFIX, with a `decision_header`: the costs it compared.
    explained: Option<Explained>,
    /// `counting: LISTENER`: the decision's facts, for its response headers.
    listener_count: Option<ListenerCount>,
    /// LONGEST_PREFIX, a prompt Envoy placed (Maglev on its opening): its
    /// chain, recorded in the index once the response names the instance.
    placed_by_envoy: Option<Vec<u64>>,
    /// A response to a prefix-aware decision, read for the usage its
    /// engine reports.
    usage_watch: Option<UsageWatch>,
    /// LONGEST_PREFIX: what the decision predicted of the chosen instance,
    /// checked against its engine's usage.
    prediction: Option<Prediction>,
    /// `adapters.header`'s value, where the request carried it once.
    adapter_header: Option<Vec<u8>>,
    /// A request for a LoRA adapter: where it went against the set.
    adapter: Option<AdapterDecision>,
}

/// See [`Stream::watch_usage`].
#[derive(Debug)]
struct UsageWatch {
    /// `None` once a chunk could not be read: the usage is then unknown.
    scanner: Option<UsageScanner>,
    address: String,
    /// LONGEST_PREFIX: what the decision predicted there.
    prediction: Option<Prediction>,
}

impl Stream {
    pub fn new(config: Rc<Config>, policy: Rc<Policy>, metrics: Rc<MetricIds>) -> Self {
        Stream {
            reader: RequestReader::new(Rc::clone(&config)),
            config,
            policy,
            metrics,
            upstream: None,
            answered: false,
            ticket: None,
            decided: None,
            explained: None,
            listener_count: None,
            placed_by_envoy: None,
            usage_watch: None,
            prediction: None,
            adapter_header: None,
            adapter: None,
        }
    }

    /// `on_http_request_headers`.
    pub fn on_request_headers<H: Host + Clone>(
        &mut self,
        vm: &mut Vm<H>,
        end_of_stream: bool,
    ) -> Flow {
        // Counting in the listener, the module runs nowhere else (the role
        // check is a host call saved).
        if self.config.counting == Counting::UpstreamFilter {
            if let Some(address) = upstream_address(vm.host()) {
                let flow = self.start_upstream(vm, &address);
                self.upstream = Some(address);
                return flow;
            }
        }
        let read = read_request_headers(vm.host());
        // First, whatever happens next: a client must never choose the key,
        // the instance, the route or the counts.
        remove_request_headers(
            vm.host(),
            steering::owned_request_headers(&self.config),
            read.as_ref(),
        );
        let headers = read.unwrap_or_default();
        if let Some(name) = self
            .config
            .adapters
            .as_ref()
            .and_then(|a| a.header.as_deref())
        {
            if let OnceHeader::Once(value) = headers.once(name) {
                self.adapter_header = Some(value.to_vec());
            }
        }
        let verdict = self.reader.on_request_headers(RequestHead {
            path: headers.get(":path").unwrap_or_default(),
            tenant_header: headers.once(&self.config.tenant_header),
            end_of_stream,
            body: BodyKind::of(
                headers.get(":method"),
                headers.contains("upgrade"),
                headers.get("content-type"),
            ),
        });
        match verdict {
            HeadersVerdict::Continue(derivation) => {
                self.route(vm, &derivation);
                Flow::Continue
            }
            HeadersVerdict::PauseForBody => Flow::Pause,
            HeadersVerdict::Reject(reply) => self.reject(vm, &reply),
        }
    }

    /// `on_http_request_body`.
    pub fn on_request_body<H: Host + Clone>(
        &mut self,
        vm: &mut Vm<H>,
        body_size: usize,
        end_of_stream: bool,
    ) -> Flow {
        if self.upstream.is_some() {
            return Flow::Continue;
        }
        let host = vm.host();
        let verdict = self
            .reader
            .on_request_body(body_size, end_of_stream, &mut |start, len| match host
                .request_body(start, len)
            {
                Ok(bytes) => bytes,
                Err(status) => {
                    log::warn!("prefix-router: cannot read request body: {status}");
                    None
                }
            });
        self.body_flow(vm, verdict)
    }

    /// `on_http_request_trailers`.
    pub fn on_request_trailers<H: Host + Clone>(&mut self, vm: &mut Vm<H>) -> Flow {
        if self.upstream.is_some() {
            return Flow::Continue;
        }
        let verdict = self.reader.on_request_trailers();
        self.body_flow(vm, verdict)
    }

    /// `on_http_response_headers`: with `counting: LISTENER`, counts the
    /// request where it went if its decision calls for it; writes the debug
    /// decision header if configured. Upstream role: the instance answered,
    /// so it is not failed (if it was).
    pub fn on_response_headers<H: Host + Clone>(&mut self, vm: &mut Vm<H>) -> Flow {
        if let Some(address) = &self.upstream {
            if !self.answered {
                self.answered = true;
                let now = vm.now_ms();
                vm.with_tracker(&self.config, |t| t.answered(address, now));
            }
            return Flow::Continue;
        }
        let mut count = self.listener_count.take();
        let mut instance = None;
        if count.is_some() && self.config.counting == Counting::UpstreamFilter {
            // Left to an upstream filter; does one count? Asked only of a
            // response from an instance (an upstream filter then ran).
            instance = upstream_address(vm.host());
            if instance.is_none() || !self.nothing_else_counts(vm) {
                count = None;
            }
        }
        let check = count.as_ref().is_some_and(ListenerCount::check_at_response);
        let placed_by_envoy = self.placed_by_envoy.take();
        // A prediction is checked against the usage only: with `read_usage` off,
        // the response is not asked where it came from for it.
        let predicted = self
            .decided
            .filter(|(kind, _)| self.config.read_usage && predicts(*kind));
        let engine_load = self.config.engine_load.is_some();
        // One host call for all the headers read below.
        let headers = (engine_load || predicted.is_some()).then(|| response_headers(vm.host()));
        let report = headers
            .as_ref()
            .filter(|_| engine_load)
            .and_then(|headers| headers.get(orca::REPORT_HEADER))
            .filter(|report| !report.is_empty());
        let wanted = check
            || predicted.is_some()
            || self.config.decision_header.is_some()
            || placed_by_envoy.is_some()
            || report.is_some();
        if wanted && instance.is_none() {
            instance = upstream_address(vm.host());
        }
        if let (Some(count), Some(address)) = (&count, &instance) {
            // Read for the debug header only: still acted on if it shows
            // the decision's count on the wrong instance.
            if check || !count.count_stands(address) {
                self.count_at_response(vm, count, address);
            }
        }
        if let (Some(chain), Some(address)) = (&placed_by_envoy, &instance) {
            let now = vm.now_ms();
            vm.with_tracker(&self.config, |t| {
                t.remember_where_served(chain, address, now)
            });
        }
        if let (Some(report), Some(address)) = (report, &instance) {
            self.use_orca_report(vm, report, address);
        }
        if let (Some(_), Some(headers), Some(address)) = (predicted, &headers, &instance) {
            self.watch_usage(headers, address);
        }
        if let (Some(header), Some((kind, matched))) = (&self.config.decision_header, self.decided)
        {
            let value = steering::decision_header_value(
                kind,
                instance.as_deref(),
                matched,
                self.explained.as_ref(),
                self.adapter,
            );
            warn_on_error(
                "write response header",
                header,
                vm.host().replace_response_header(header, value.as_bytes()),
            );
        }
        Flow::Continue
    }

    /// `on_http_response_body`: a watched response's chunk goes through the
    /// usage scanner; the body is never held or changed.
    pub fn on_response_body<H: Host + Clone>(
        &mut self,
        vm: &mut Vm<H>,
        body_size: usize,
        end_of_stream: bool,
    ) -> Flow {
        let Some(watch) = self.usage_watch.as_mut() else {
            return Flow::Continue;
        };
        if body_size > 0 && watch.scanner.is_some() {
            match vm.host().response_body(0, body_size) {
                Ok(Some(chunk)) => {
                    if let Some(scanner) = watch.scanner.as_mut() {
                        scanner.feed(&chunk);
                    }
                }
                Ok(None) => {}
                Err(status) => {
                    log::debug!("prefix-router: cannot read a response body chunk: {status}");
                    watch.scanner = None;
                }
            }
        }
        if end_of_stream {
            self.count_usage(vm);
        }
        Flow::Continue
    }

    /// A 2xx response from `address` to a prefix-aware decision, not
    /// content-encoded: its body is scanned for the engine's usage.
    fn watch_usage(&mut self, headers: &HeaderMap, address: &str) {
        let success = headers
            .get(":status")
            .is_some_and(|status| status.first() == Some(&b'2'));
        if !success {
            return;
        }
        // Compressed bodies are not decoded: no usage, and not counted.
        let encoded = headers.get("content-encoding").is_some_and(|encoding| {
            !encoding.is_empty() && !encoding.eq_ignore_ascii_case(b"identity")
        });
        if encoded {
            return;
        }
        let framing = Framing::of_content_type(headers.get("content-type"));
        self.usage_watch = Some(UsageWatch {
            scanner: Some(UsageScanner::new(framing)),
            address: address.to_string(),
            prediction: self.prediction.take(),
        });
    }

    /// Counts a watched response and what its usage reported, once.
    fn count_usage<H: Host + Clone>(&mut self, vm: &mut Vm<H>) {
        let Some(watch) = self.usage_watch.take() else {
            return;
        };
        let usage = watch.scanner.and_then(UsageScanner::finish);
        let verdict = match (usage, &watch.prediction) {
            (Some(usage), Some(prediction)) => vm.check_usage(prediction, usage),
            _ => Verdict::Unchecked,
        };
        let fleet = self.config.fleet.as_deref();
        let matched_bytes = watch.prediction.map(|p| p.matched_bytes);
        for (counter, amount) in UsageCounter::amounts(usage, matched_bytes, verdict) {
            vm.count_usage(fleet, counter, &watch.address, amount);
        }
        if let Verdict::Missed {
            forget_through_s: Some(through_s),
        } = verdict
        {
            let now = vm.now_ms();
            let moved = vm.with_tracker(&self.config, |t| {
                t.forget_held_through(&watch.address, through_s, now)
            });
            if moved {
                vm.count_usage(fleet, UsageCounter::IndexForgets, &watch.address, 1);
            }
        }
    }

    /// `engine_load`: a response's ORCA load report from the instance at
    /// `address` refreshes that instance's KV usage between polls
    /// (`crate::engine_load::orca`). An unreadable report is counted,
    /// warned about once per worker, and changes nothing.
    fn use_orca_report<H: Host + Clone>(&self, vm: &mut Vm<H>, report: &[u8], address: &str) {
        match orca::kv_usage_permille(report) {
            Ok(Some(kv_usage_permille)) => {
                let now = vm.now_ms();
                let stored = vm.with_tracker(&self.config, |t| {
                    t.refresh_engine_kv_usage(address, kv_usage_permille, now)
                });
                if stored {
                    self.metrics.increment(vm, Counter::OrcaReportUsed);
                }
            }
            Ok(None) => {}
            Err(fault) => {
                if vm.first_unreadable_orca_report() {
                    log::warn!(
                        "prefix-router: {address} answered with an {} header the filter cannot read ({fault}): ignored, its KV usage stays the last poll's (stat {}; this warning once per worker)",
                        orca::REPORT_HEADER,
                        Counter::OrcaReportUnreadable.name()
                    );
                }
                self.metrics.increment(vm, Counter::OrcaReportUnreadable);
            }
        }
    }

    /// `counting: UPSTREAM_FILTER`, at a response from an instance: true if
    /// no upstream filter counts in this VM's shared data (then this
    /// listener counts the request, and the first time says so).
    fn nothing_else_counts<H: Host + Clone>(&self, vm: &mut Vm<H>) -> bool {
        let now = vm.now_ms();
        match vm.upstream_filter_check(&self.config, now) {
            AtResponse::UpstreamFilterCounts => false,
            AtResponse::CountHere { warn } => {
                if warn {
                    log::warn!("{MISSING_UPSTREAM_FILTER_WARNING}");
                }
                self.metrics.increment(vm, Counter::UpstreamFilterMissing);
                true
            }
        }
    }

    /// `on_done`: every stream end (completed, aborted, reset, timed out,
    /// local reply) comes here once, so the count is given back exactly once.
    /// Upstream role: an attempt that ended unanswered because its
    /// connection failed marks its instance failed.
    pub fn on_done<H: Host + Clone>(&mut self, vm: &mut Vm<H>) {
        // A response cut short: counted with what arrived of it.
        self.count_usage(vm);
        if let Some(ticket) = self.ticket.take() {
            let now = vm.now_ms();
            vm.with_tracker(&self.config, |t| t.release(ticket, now));
        }
        if let Some(address) = self.upstream.as_deref().filter(|_| !self.answered) {
            if let Some(reason) = transport_failure(vm.host()) {
                self.connection_failed(vm, address, &reason);
            }
        }
    }

    /// The attempt to `address` found no connection (`reason`, Envoy's):
    /// counted, and the instance marked failed (said once per failure).
    fn connection_failed<H: Host + Clone>(&self, vm: &mut Vm<H>, address: &str, reason: &str) {
        self.metrics.increment(vm, Counter::ConnectionFailed);
        let now = vm.now_ms();
        if vm.with_tracker(&self.config, |t| t.connection_failed(address, now)) {
            self.metrics.increment(vm, Counter::InstanceFailed);
            log::warn!(
                "prefix-router: no connection to {address} ({reason}): not chosen until it answers, tried again every {} ms (stat {})",
                FAILED_RETRY_MS,
                Counter::InstanceFailed.name()
            );
        }
    }

    /// Runs the policy and writes every header it governs.
    fn route<H: Host + Clone>(&mut self, vm: &mut Vm<H>, derivation: &KeyDerivation) {
        self.metrics.record_derivation(vm, derivation);
        let now = vm.now_ms();
        let random = vm.random();
        let policy = Rc::clone(&self.policy);
        let adapter_name = self.config.adapters.as_ref().and_then(|a| {
            a.adapter_name(self.adapter_header.as_deref(), derivation.model.as_deref())
        });
        let adapter = adapter_name.map(adapter_hash);
        let listener = self.config.counting == Counting::Listener;
        // Until an upstream filter is seen counting, a request left to one
        // keeps what counting it here at the response needs.
        let unchecked = !listener && vm.may_count_at_response();
        let discovered = vm.discovered_fleet(&self.config);
        let instances = discovered.unwrap_or_else(|| Rc::clone(&self.config.instances));
        let index_bytes = self.config.index_bytes;
        let engine_view = self.config.engine_load.as_ref().map(|engine| EngineView {
            max_age_ms: engine.max_age_ms,
            bounds: engine.bounds(),
        });
        let (routed, placed_by_envoy, keep, check_due) = {
            let (t, recent) = vm.decision_state(&self.config);
            // The deciding configuration's fleet, also when it lists none
            // (a configuration update that removed the list), and index
            // size (an upstream filter's configuration need not repeat it).
            t.set_configured_instances(&instances);
            t.set_index_bytes(index_bytes);
            t.set_engine_view(engine_view);
            let request = RouteRequest::of(derivation, adapter);
            let routed = policy.route(request, t, recent, random, now);
            // A LONGEST_PREFIX request Envoy placed: indexed where it went,
            // and counted there if no upstream filter does, at the response.
            let placed_by_envoy = routed.headers.host_override.is_none()
                && matches!(*policy, Policy::LongestPrefix(_));
            let keep =
                listener || (unchecked && (routed.headers.counted.is_some() || placed_by_envoy));
            let key = routed.headers.key.as_deref().filter(|_| keep);
            let check_due = key.is_some_and(|key| t.response_check_due(key, now));
            (routed, placed_by_envoy, keep, check_due)
        };
        for (name, value) in steering::header_writes(&self.config, &routed.headers) {
            warn_on_error(
                "write header",
                name,
                vm.host().replace_request_header(name, value.as_bytes()),
            );
        }
        self.metrics.increment_decision(vm, routed.headers.kind);
        if let Some(adapter) = routed.headers.adapter {
            self.metrics.record_adapter(vm, adapter);
            if let Some(name) = adapter_name {
                let fleet = self.config.fleet.as_deref();
                vm.set_adapter_instances(fleet, name, adapter.set_size);
            }
        }
        self.adapter = routed.headers.adapter;
        if let Some(bytes) = routed.headers.matched_bytes {
            self.metrics.record_matched_bytes(vm, bytes);
        }
        // What the decision adds to the instance it names (LONGEST_PREFIX).
        if let Some(address) = routed.headers.host_override.as_deref() {
            if routed.placed_bytes > 0 {
                vm.count_placed_bytes(self.config.fleet.as_deref(), address, routed.placed_bytes);
            }
        }
        self.decided = Some((routed.headers.kind, routed.headers.matched_bytes));
        let model = derivation.model.as_deref();
        self.prediction = prediction_of(&routed.headers, &self.config, model, now);
        if self.config.decision_header.is_some() {
            self.explained = routed.headers.explained.clone();
        }
        if keep {
            let count = ListenerCount::of(&self.config, &routed.headers, check_due);
            self.listener_count = Some(count);
        }
        if placed_by_envoy {
            self.placed_by_envoy = derivation.blocks.as_ref().map(|b| b.chain.clone());
        }
        self.ticket = routed.ticket;
    }

    /// `counting: LISTENER`, at the response headers: the request reached
    /// `address`. Moves the decision's count there if it was taken elsewhere,
    /// counts it if it was not counted yet, learns the key's target.
    fn count_at_response<H: Host + Clone>(
        &mut self,
        vm: &mut Vm<H>,
        count: &ListenerCount,
        address: &str,
    ) {
        let now = vm.now_ms();
        let held = self.ticket.take();
        self.ticket = vm.with_tracker(&self.config, |t| {
            t.settle_at_response(count.start(address), held, now)
        });
    }

    fn reject<H: Host + Clone>(&self, vm: &mut Vm<H>, reply: &LocalReply) -> Flow {
        self.metrics.increment(vm, Counter::TenantRejected);
        let sent = vm.host().send_local_response(
            reply.status,
            "prefix_router_invalid_tenant_header",
            &reply.headers,
            &reply.body,
        );
        warn_on_error("send local reply", "invalid_tenant_header", sent);
        if sent.is_err() {
            // Nothing ends the stream then: forwarded without a key rather
            // than held until it times out.
            return Flow::Continue;
        }
        // The local reply ends the stream; nothing goes upstream.
        Flow::Pause
    }

    fn body_flow<H: Host + Clone>(&mut self, vm: &mut Vm<H>, verdict: BodyVerdict) -> Flow {
        match verdict {
            BodyVerdict::Pause => Flow::Pause,
            BodyVerdict::Continue(derivation) => {
                // Before Continue: once the headers leave, writes are lost.
                self.route(vm, &derivation);
                Flow::Continue
            }
            BodyVerdict::AlreadyDecided => Flow::Continue,
        }
    }

    /// Upstream role: count the request on the chosen instance, learn the
    /// key's target, and keep the internal headers from the instance.
    fn start_upstream<H: Host + Clone>(&mut self, vm: &mut Vm<H>, address: &str) -> Flow {
        let read = read_request_headers(vm.host());
        let unread = HeaderMap::default();
        let headers = read.as_ref().unwrap_or(&unread);
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|value| std::str::from_utf8(value).ok())
        };
        let overridden = self
            .config
            .host_header
            .as_deref()
            .is_some_and(|h| headers.contains(h));
        let start = UpstreamStart {
            address,
            key: text(&self.config.key_header),
            overridden,
            counted: text(COUNTED_HEADER),
        };
        let now = vm.now_ms();
        self.ticket = vm.with_tracker(&self.config, |t| t.upstream_started(start, now));
        vm.mark_upstream_filter(&self.config, now);
        remove_request_headers(vm.host(), INTERNAL_REQUEST_HEADERS, read.as_ref());
        Flow::Continue
    }
}

/// What a LONGEST_PREFIX decision predicted of the instance it named, for
/// a request for `model`.
fn prediction_of(
    headers: &RouteHeaders,
    config: &Config,
    model: Option<&str>,
    now_ms: u64,
) -> Option<Prediction> {
    let prompt_bytes = headers.prompt_bytes?;
    Some(Prediction {
        matched_bytes: headers.matched_bytes?,
        prompt_bytes,
        // Fewer bytes than `prefix_length` characters: nothing was cut.
        whole_prompt: prompt_bytes < u64::try_from(config.prefix_length).unwrap_or(u64::MAX),
        held_since_s: headers.held_since_s,
        decided_s: u32::try_from(now_ms / 1000).unwrap_or(u32::MAX),
        model: model.map(|m| xxh3_64(m.as_bytes())),
    })
}

/// Whether a decision of `kind` predicted where the prompt's prefix is
/// cached (a prefix-aware decision with a key).
fn predicts(kind: DecisionKind) -> bool {
    !matches!(
        kind,
        DecisionKind::LeastOutstanding | DecisionKind::Random | DecisionKind::NoKey
    )
}

/// `upstream.address` (`ip:port`): readable in the upstream filter from the
/// request headers on, and downstream once a response came from upstream.
fn upstream_address(host: &impl Host) -> Option<String> {
    match host.property(&["upstream", "address"]) {
        Ok(Some(bytes)) if !bytes.is_empty() => String::from_utf8(bytes).ok(),
        Ok(_) => None,
        Err(status) => {
            log::debug!("prefix-router: upstream.address unavailable: {status}");
            None
        }
    }
}

/// `upstream.transport_failure_reason`, if set: the attempt's connection
/// failed (seen in Envoy 1.40 at the upstream filter's end of an attempt to
/// a closed port: "delayed connect error: Connection refused"). Empty or
/// absent for an attempt that connected, however it ended.
fn transport_failure(host: &impl Host) -> Option<String> {
    match host.property(&["upstream", "transport_failure_reason"]) {
        Ok(Some(bytes)) if !bytes.is_empty() => Some(String::from_utf8_lossy(&bytes).into_owned()),
        Ok(_) => None,
        Err(status) => {
            log::debug!("prefix-router: upstream.transport_failure_reason unavailable: {status}");
            None
        }
    }
}

/// The response's headers, in one host call (none, logged, if the host
/// refuses them).
fn response_headers(host: &impl Host) -> HeaderMap {
    host.response_headers().unwrap_or_else(|status| {
        log::debug!("prefix-router: cannot read the response headers: {status}");
        HeaderMap::default()
    })
}

/// All request headers in one host call (empty, with a warning, if the
/// host refuses: the request then goes on unrouted rather than failing).
/// Removes each of `names` the request has, per `read`; every one of them
/// when the headers could not be read (`None`), unseen.
fn remove_request_headers<'a>(
    host: &impl Host,
    names: impl IntoIterator<Item = &'a str>,
    read: Option<&HeaderMap>,
) {
    for name in names {
        if read.is_none_or(|headers| headers.contains(name)) {
            warn_on_error("remove header", name, host.remove_request_header(name));
        }
    }
}

fn read_request_headers(host: &impl Host) -> Option<HeaderMap> {
    host.request_headers()
        .inspect_err(|status| {
            log::warn!("prefix-router: cannot read the request headers: {status}");
        })
        .ok()
}
