//! The proxy-wasm glue: one root context per plugin (configuration, policy,
//! metric ids, the 1 s tick) and one HTTP context per request, which feeds
//! the sans-IO [`RequestRouter`] and carries out its verdicts. Every decision
//! is made in `request`, `steering`, `strategy` and `load`; this file only
//! moves bytes between Envoy and them.
//!
//! The same module runs in two roles, told apart per stream: as the
//! listener's HTTP filter it decides (downstream); as the cluster's upstream
//! HTTP filter, where `upstream.address` is readable at request headers, it
//! counts the request on the instance Envoy chose and learns the key's target.
//! Both roles of a worker VM share one [`LoadTracker`] (a VM-global), and all
//! VMs with the same `vm_id` share its tables through shared data. With
//! `counting: LISTENER` there is no upstream filter: the listener does its
//! work when the response headers name the instance ([`ListenerCount`]).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

use crate::config::{Config, Counting};
use crate::host::{self, HostStatus, HostStore};
use crate::load::{LoadTracker, Ticket, COUNTED_HEADER};
use crate::metrics::{
    decision_counter_name, decision_index, in_flight_gauge_name, recording_for, Counter,
    BYTES_INSPECTED, DECISION_KINDS,
};
use crate::request::{
    BodyVerdict, Decision, HeadersVerdict, LocalReply, RequestHead, RequestRouter,
};
use crate::steering::{self, ListenerCount};
use crate::strategy::{DecisionKind, Policy};

/// Root tick: heartbeat, count repair, gauges.
const TICK_PERIOD_MS: u32 = 1_000;

/// Most in-flight gauges one VM defines (Envoy never deletes a stat); the
/// registry holds at most this many instances anyway.
const MAX_GAUGES: usize = 64;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        let config = Config::default();
        Box::new(PrefixRouterRoot {
            policy: Rc::new(steering::policy_for(&config)),
            config: Rc::new(config),
            metrics: Rc::new(MetricIds::default()),
        })
    });
}}

thread_local! {
    /// This worker VM's handle on the shared load tables: created once, kept
    /// across configuration updates (Envoy reuses the VM for them).
    static TRACKER: RefCell<Option<LoadTracker<HostStore>>> = const { RefCell::new(None) };
    /// When this VM last ran the tick's work.
    static LAST_TICK_MS: Cell<u64> = const { Cell::new(0) };
    /// In-flight gauge ids by instance address.
    static GAUGES: RefCell<HashMap<String, u32>> = RefCell::new(HashMap::new());
    /// Counter increments not yet handed to Envoy, by metric id: counting
    /// locally and flushing on the tick spares two host calls per request
    /// (Prometheus scrapes every few seconds; the counters lag by one tick).
    static PENDING_COUNTS: RefCell<Vec<(u32, u64)>> = const { RefCell::new(Vec::new()) };
    /// Histogram samples not yet handed to Envoy, by metric id: recorded on
    /// the tick too, so the request's path makes one host call fewer (each
    /// sample is still recorded once, at most a tick late).
    static PENDING_SAMPLES: RefCell<Vec<(u32, u64)>> = const { RefCell::new(Vec::new()) };
}

/// Most histogram samples a VM holds between ticks; past it a sample is
/// recorded at once.
const MAX_PENDING_SAMPLES: usize = 8_192;

fn count_later(id: u32) {
    PENDING_COUNTS.with(|cell| {
        let mut pending = cell.borrow_mut();
        match pending.iter_mut().find(|(pending_id, _)| *pending_id == id) {
            Some((_, delta)) => *delta += 1,
            None => pending.push((id, 1)),
        }
    });
}

fn record_later(id: u32, value: u64) {
    let held = PENDING_SAMPLES.with(|cell| {
        let mut pending = cell.borrow_mut();
        let room = pending.len() < MAX_PENDING_SAMPLES;
        if room {
            pending.push((id, value));
        }
        room
    });
    if !held {
        record_sample(id, value);
    }
}

fn record_sample(id: u32, value: u64) {
    warn_on_error("record metric", "histogram", host::record_metric(id, value));
}

/// Hands this VM's counted increments and held histogram samples to Envoy.
fn flush_metrics() {
    let pending = PENDING_COUNTS.with(|cell| std::mem::take(&mut *cell.borrow_mut()));
    for (id, delta) in pending {
        let delta = i64::try_from(delta).unwrap_or(i64::MAX);
        warn_on_error(
            "increment metric",
            "counter",
            host::increment_metric(id, delta),
        );
    }
    let samples = PENDING_SAMPLES.with(|cell| std::mem::take(&mut *cell.borrow_mut()));
    for (id, value) in samples {
        record_sample(id, value);
    }
}

fn now_ms() -> u64 {
    host::now_ms().unwrap_or_else(|status| {
        log::warn!("prefix-router: cannot read the clock: {status}");
        0
    })
}

fn random_u64(salt: u64) -> u64 {
    // WASI random_get seeds RandomState (seen working in Envoy).
    std::collections::hash_map::RandomState::new().hash_one(salt)
}

/// Runs `f` on this VM's tracker, creating it on first use. The tracker is
/// shared by every plugin of the VM (listener and upstream filters, old and
/// new configurations), so each call applies the caller's own
/// `instance_ttl_ms` rather than whichever plugin configured last.
fn with_tracker<R>(config: &Config, f: impl FnOnce(&mut LoadTracker<HostStore>) -> R) -> R {
    TRACKER.with(|cell| {
        let mut slot = cell.borrow_mut();
        let tracker = slot.get_or_insert_with(|| {
            let nonce = random_u64(now_ms());
            LoadTracker::new(HostStore, steering::load_config(config), nonce)
        });
        tracker.set_instance_ttl_ms(config.instance_ttl_ms);
        f(tracker)
    })
}

/// Envoy's ids for the filter's metrics; `None` where defining failed (the
/// filter then routes without counting rather than failing requests).
#[derive(Debug, Default)]
struct MetricIds {
    counters: [Option<u32>; Counter::ALL.len()],
    decisions: [Option<u32>; DECISION_KINDS.len()],
    bytes_inspected: Option<u32>,
}

impl MetricIds {
    fn define() -> MetricIds {
        let mut ids = MetricIds::default();
        for counter in Counter::ALL {
            if let Some(slot) = ids.counters.get_mut(counter.index()) {
                *slot = defined(host::METRIC_COUNTER, counter.name());
            }
        }
        for (slot, kind) in ids.decisions.iter_mut().zip(DECISION_KINDS) {
            *slot = defined(host::METRIC_COUNTER, &decision_counter_name(kind));
        }
        ids.bytes_inspected = defined(host::METRIC_HISTOGRAM, BYTES_INSPECTED);
        ids
    }

    fn is_empty(&self) -> bool {
        self.bytes_inspected.is_none()
            && self.counters.iter().all(Option::is_none)
            && self.decisions.iter().all(Option::is_none)
    }

    fn increment(&self, counter: Counter) {
        if let Some(Some(id)) = self.counters.get(counter.index()) {
            count_later(*id);
        }
    }

    fn increment_decision(&self, kind: DecisionKind) {
        if let Some(Some(id)) = self.decisions.get(decision_index(kind)) {
            count_later(*id);
        }
    }

    fn record_decision(&self, decision: &Decision) {
        let recording = recording_for(decision);
        for counter in recording.counters {
            self.increment(counter);
        }
        if let (Some(id), Some(bytes)) = (self.bytes_inspected, recording.bytes_inspected) {
            record_later(id, bytes);
        }
    }
}

fn defined(metric_type: u32, name: &str) -> Option<u32> {
    match host::define_metric(metric_type, name) {
        Ok(id) => Some(id),
        Err(status) => {
            log::warn!("prefix-router: cannot define metric {name}: {status}");
            None
        }
    }
}

fn warn_on_error(what: &str, subject: &str, result: Result<(), HostStatus>) {
    if let Err(status) = result {
        log::warn!("prefix-router: {what} {subject} failed: {status}");
    }
}

/// Sets every known instance's in-flight gauge (each VM computes the same
/// totals from shared data; same-named gauges are one Envoy stat). Gauges of
/// instances no longer registered drop to 0.
fn publish_gauges(loads: &[crate::load::InstanceLoad]) {
    GAUGES.with(|cell| {
        let mut gauges = cell.borrow_mut();
        for (address, id) in gauges.iter() {
            if !loads.iter().any(|l| &l.address == address) {
                warn_on_error("set gauge", address, host::record_metric(*id, 0));
            }
        }
        for load in loads {
            let id = match gauges.get(&load.address) {
                Some(id) => Some(*id),
                None if gauges.len() < MAX_GAUGES => {
                    let id = defined(host::METRIC_GAUGE, &in_flight_gauge_name(&load.address));
                    if let Some(id) = id {
                        gauges.insert(load.address.clone(), id);
                    }
                    id
                }
                None => None,
            };
            if let Some(id) = id {
                warn_on_error(
                    "set gauge",
                    &load.address,
                    host::record_metric(id, u64::from(load.in_flight)),
                );
            }
        }
    });
}

struct PrefixRouterRoot {
    config: Rc<Config>,
    policy: Rc<Policy>,
    metrics: Rc<MetricIds>,
}

impl Context for PrefixRouterRoot {}

impl RootContext for PrefixRouterRoot {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        true
    }

    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        // No configuration at all means all defaults (no buffer to read).
        let bytes = match plugin_configuration_size {
            0 => Ok(None),
            size => host::get_buffer(host::BUFFER_PLUGIN_CONFIGURATION, 0, size),
        };
        let bytes = match bytes {
            Ok(bytes) => bytes.unwrap_or_default(),
            Err(status) => {
                log::error!("prefix-router: cannot read the plugin configuration: {status}");
                return false;
            }
        };
        match Config::parse(&bytes) {
            Ok(config) => {
                log::info!(
                    "prefix-router: configured: strategy {}, prefix_length {}, concurrency_threshold {}, max_body_bytes {}, key_header {}, host_header {}, tenant_header {}, decision_header {}, instance_ttl_ms {}, include_model {}, body_tenant {}, counting {}, {} path rules",
                    config.strategy.as_str(),
                    config.prefix_length,
                    config.concurrency_threshold,
                    config.max_body_bytes,
                    config.key_header,
                    config.host_header.as_deref().unwrap_or("(none: overflow re-keys)"),
                    config.tenant_header,
                    config.decision_header.as_deref().unwrap_or("(none)"),
                    config.instance_ttl_ms,
                    config.include_model,
                    config.body_tenant,
                    config.counting.as_str(),
                    config.path_rules.len()
                );
                self.policy = Rc::new(steering::policy_for(&config));
                self.config = Rc::new(config);
                // Once per root context: on_configure runs again on updates.
                if self.metrics.is_empty() {
                    self.metrics = Rc::new(MetricIds::define());
                }
                warn_on_error(
                    "set tick period",
                    "root",
                    host::set_tick_period_ms(TICK_PERIOD_MS),
                );
                true
            }
            Err(error) => {
                log::error!("prefix-router: invalid plugin configuration, rejected: {error}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        flush_metrics();
        let now = now_ms();
        // Every plugin of the VM (listener filter, each cluster's upstream
        // filter) has a root that ticks; one tick per period does the work.
        let due = LAST_TICK_MS.with(|last| {
            let due = now.saturating_sub(last.get()) >= u64::from(TICK_PERIOD_MS / 2);
            if due {
                last.set(now);
            }
            due
        });
        if !due {
            return;
        }
        let loads = with_tracker(&self.config, |t| {
            t.tick(now);
            t.snapshot(now)
        });
        publish_gauges(&loads);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(PrefixRouterHttp {
            context_id,
            config: Rc::clone(&self.config),
            policy: Rc::clone(&self.policy),
            router: RequestRouter::new(Rc::clone(&self.config)),
            metrics: Rc::clone(&self.metrics),
            upstream: false,
            ticket: None,
            decided: None,
            listener_count: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct PrefixRouterHttp {
    context_id: u32,
    /// The configuration and policy this request started with.
    config: Rc<Config>,
    policy: Rc<Policy>,
    router: RequestRouter,
    metrics: Rc<MetricIds>,
    /// Runs as the cluster's upstream filter (counts, does not decide).
    upstream: bool,
    /// The in-flight count this stream holds; released once, in `on_done`.
    ticket: Option<Ticket>,
    /// The routing decision's kind, for the debug response header.
    decided: Option<DecisionKind>,
    /// `counting: LISTENER`: the decision's facts, for its response headers.
    listener_count: Option<ListenerCount>,
}

impl PrefixRouterHttp {
    fn config(&self) -> &Config {
        &self.config
    }

    /// Runs the policy and writes every header it governs.
    fn route(&mut self, decision: &Decision) {
        self.metrics.record_decision(decision);
        let now = now_ms();
        let random = random_u64(now ^ u64::from(self.context_id));
        let policy = Rc::clone(&self.policy);
        let listener = self.config.counting == Counting::Listener;
        let (routed, check_due) = with_tracker(&self.config, |t| {
            let routed = steering::route(&policy, decision.key.as_deref(), t, random, now);
            let key = routed.decision.key.as_deref().filter(|_| listener);
            let check_due = key.is_some_and(|key| t.response_check_due(key, now));
            (routed, check_due)
        });
        for (name, value) in steering::header_writes(&self.config, &routed.decision) {
            warn_on_error(
                "write header",
                name,
                host::replace_request_header(name, value.as_bytes()),
            );
        }
        self.metrics.increment_decision(routed.decision.kind);
        self.decided = Some(routed.decision.kind);
        if listener {
            let count = ListenerCount::of(&self.config, &routed.decision, check_due);
            self.listener_count = Some(count);
        }
        self.ticket = routed.ticket;
    }

    /// `counting: LISTENER`, at the response headers: the request reached
    /// `address`. Moves the decision's count there if it was taken elsewhere,
    /// counts it if it was not counted yet, learns the key's target.
    fn count_at_response(&mut self, count: &ListenerCount, address: &str) {
        let now = now_ms();
        let held = self.ticket.take();
        self.ticket = with_tracker(&self.config, |t| {
            t.settle_at_response(count.start(address), held, now)
        });
    }

    fn reject(&self, reply: &LocalReply) -> Action {
        self.metrics.increment(Counter::TenantRejected);
        warn_on_error(
            "send local reply",
            "invalid_tenant_header",
            host::send_local_response(
                reply.status,
                "prefix_router_invalid_tenant_header",
                &reply.headers,
                &reply.body,
            ),
        );
        // The local reply ends the stream; nothing goes upstream.
        Action::Pause
    }

    fn body_action(&mut self, verdict: BodyVerdict) -> Action {
        match verdict {
            BodyVerdict::Pause => Action::Pause,
            BodyVerdict::Continue(decision) => {
                // Before Continue: once the headers leave, writes are lost.
                self.route(&decision);
                Action::Continue
            }
            BodyVerdict::AlreadyDecided => Action::Continue,
        }
    }

    /// Upstream role: count the request on the chosen instance, learn the
    /// key's target, and keep the internal headers from the instance.
    fn start_upstream(&mut self, address: &str) -> Action {
        let headers = read_request_headers();
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|value| std::str::from_utf8(value).ok())
        };
        let overridden = self
            .config()
            .host_header
            .as_deref()
            .is_some_and(|h| headers.contains(h));
        let start = steering::upstream_start(
            address,
            text(&self.config().key_header),
            overridden,
            text(COUNTED_HEADER),
        );
        let now = now_ms();
        self.ticket = with_tracker(&self.config, |t| t.upstream_started(start, now));
        for name in steering::UPSTREAM_STRIPPED {
            if headers.contains(name) {
                warn_on_error("remove header", name, host::remove_request_header(name));
            }
        }
        Action::Continue
    }
}

impl Context for PrefixRouterHttp {
    fn on_done(&mut self) -> bool {
        // Every stream end (completed, aborted, reset, timed out, local
        // reply) comes here once: the count is given back exactly once.
        if let Some(ticket) = self.ticket.take() {
            let now = now_ms();
            with_tracker(&self.config, |t| t.release(ticket, now));
        }
        true
    }
}

impl HttpContext for PrefixRouterHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // Counting in the listener, the module runs nowhere else (the role
        // check is a host call saved).
        if self.config.counting == Counting::UpstreamFilter {
            if let Some(address) = upstream_address() {
                self.upstream = true;
                return self.start_upstream(&address);
            }
        }
        let headers = read_request_headers();
        // First, whatever happens next: a client must never choose the key,
        // the instance, the route or the counts.
        for name in steering::owned_request_headers(&self.config) {
            if headers.contains(name) {
                warn_on_error("remove header", name, host::remove_request_header(name));
            }
        }
        let verdict = self.router.on_request_headers(RequestHead {
            path: headers.get(":path").unwrap_or_default(),
            tenant_header: headers.get(&self.config().tenant_header),
            end_of_stream,
        });
        match verdict {
            HeadersVerdict::Continue(decision) => {
                self.route(&decision);
                Action::Continue
            }
            HeadersVerdict::PauseForBody => Action::Pause,
            HeadersVerdict::Reject(reply) => self.reject(&reply),
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.upstream {
            return Action::Continue;
        }
        let verdict = self
            .router
            .on_request_body(
                body_size,
                end_of_stream,
                &mut |start, len| match host::get_buffer(host::BUFFER_HTTP_REQUEST_BODY, start, len)
                {
                    Ok(bytes) => bytes,
                    Err(status) => {
                        log::warn!("prefix-router: cannot read request body: {status}");
                        None
                    }
                },
            );
        self.body_action(verdict)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.upstream {
            return Action::Continue;
        }
        let verdict = self.router.on_request_trailers();
        self.body_action(verdict)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.upstream {
            return Action::Continue;
        }
        let count = self.listener_count.take();
        let check = count.as_ref().is_some_and(ListenerCount::check_at_response);
        let wanted = check || self.config.decision_header.is_some();
        let instance = if wanted { upstream_address() } else { None };
        if let (Some(count), Some(address)) = (&count, &instance) {
            // Read for the debug header only: still acted on if it shows
            // the decision's count on the wrong instance.
            if check || !count.count_stands(address) {
                self.count_at_response(count, address);
            }
        }
        if let (Some(header), Some(kind)) = (&self.config.decision_header, self.decided) {
            let value = steering::decision_header_value(kind, instance.as_deref());
            warn_on_error(
                "write response header",
                header,
                host::replace_header(host::MAP_HTTP_RESPONSE_HEADERS, header, value.as_bytes()),
            );
        }
        Action::Continue
    }
}

/// `upstream.address` (`ip:port`): readable in the upstream filter from the
/// request headers on, and downstream once a response came from upstream.
fn upstream_address() -> Option<String> {
    match host::get_property(&["upstream", "address"]) {
        Ok(Some(bytes)) if !bytes.is_empty() => String::from_utf8(bytes).ok(),
        Ok(_) => None,
        Err(status) => {
            log::debug!("prefix-router: upstream.address unavailable: {status}");
            None
        }
    }
}

/// All request headers in one host call (empty, with a warning, if the
/// host refuses: the request then goes on unrouted rather than failing).
fn read_request_headers() -> host::HeaderMap {
    host::get_request_headers().unwrap_or_else(|status| {
        log::warn!("prefix-router: cannot read the request headers: {status}");
        host::HeaderMap::default()
    })
}
