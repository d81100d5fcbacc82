//! The proxy-wasm glue: one root context per plugin (configuration,
//! metric ids) and one HTTP context per request, which feeds the sans-IO
//! [`RequestRouter`] and carries out its verdicts. Every decision is made in
//! `request`; this file only moves bytes between Envoy and it.

use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

use crate::config::Config;
use crate::host::{self, HostStatus};
use crate::metrics::{recording_for, Counter, BYTES_INSPECTED};
use crate::request::{
    BodyVerdict, Decision, HeadersVerdict, LocalReply, RequestHead, RequestRouter,
};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(PrefixRouterRoot {
            config: Rc::new(Config::default()),
            metrics: Rc::new(MetricIds::default()),
        })
    });
}}

/// Envoy's ids for the filter's metrics; `None` where defining failed (the
/// filter then routes without counting rather than failing requests).
#[derive(Debug, Default)]
struct MetricIds {
    counters: [Option<u32>; Counter::ALL.len()],
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
        ids.bytes_inspected = defined(host::METRIC_HISTOGRAM, BYTES_INSPECTED);
        ids
    }

    fn increment(&self, counter: Counter) {
        if let Some(Some(id)) = self.counters.get(counter.index()) {
            warn_on_error(
                "increment metric",
                counter.name(),
                host::increment_metric(*id, 1),
            );
        }
    }

    fn record_decision(&self, decision: &Decision) {
        let recording = recording_for(decision);
        for counter in recording.counters {
            self.increment(counter);
        }
        if let (Some(id), Some(bytes)) = (self.bytes_inspected, recording.bytes_inspected) {
            warn_on_error(
                "record metric",
                BYTES_INSPECTED,
                host::record_metric(id, bytes),
            );
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

struct PrefixRouterRoot {
    config: Rc<Config>,
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
                    "prefix-router: configured: strategy {}, prefix_length {}, max_body_bytes {}, key_header {}, tenant_header {}, include_model {}, {} path rules",
                    config.strategy.as_str(),
                    config.prefix_length,
                    config.max_body_bytes,
                    config.key_header,
                    config.tenant_header,
                    config.include_model,
                    config.path_rules.len()
                );
                self.config = Rc::new(config);
                // Once per root context: on_configure runs again on updates.
                if self.metrics.bytes_inspected.is_none()
                    && self.metrics.counters.iter().all(Option::is_none)
                {
                    self.metrics = Rc::new(MetricIds::define());
                }
                true
            }
            Err(error) => {
                log::error!("prefix-router: invalid plugin configuration, rejected: {error}");
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(PrefixRouterHttp {
            config: Rc::clone(&self.config),
            router: RequestRouter::new(Rc::clone(&self.config)),
            metrics: Rc::clone(&self.metrics),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct PrefixRouterHttp {
    /// The configuration this request started with (header names).
    config: Rc<Config>,
    router: RequestRouter,
    metrics: Rc<MetricIds>,
}

impl PrefixRouterHttp {
    fn config(&self) -> &Config {
        &self.config
    }

    fn write_key(&self, decision: &Decision) {
        if let Some(key) = &decision.key {
            let header = &self.config().key_header;
            warn_on_error(
                "write header",
                header,
                host::replace_request_header(header, key.as_bytes()),
            );
        }
        self.metrics.record_decision(decision);
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

    fn body_action(&self, verdict: BodyVerdict) -> Action {
        match verdict {
            BodyVerdict::Pause => Action::Pause,
            BodyVerdict::Continue(decision) => {
                // Before Continue: once the headers leave, writes are lost.
                self.write_key(&decision);
                Action::Continue
            }
            BodyVerdict::AlreadyDecided => Action::Continue,
        }
    }
}

impl Context for PrefixRouterHttp {}

impl HttpContext for PrefixRouterHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // First, whatever happens next: a client must never choose the key.
        let key_header = self.config().key_header.clone();
        warn_on_error(
            "remove header",
            &key_header,
            host::remove_request_header(&key_header),
        );
        let path = read_header(":path");
        let tenant = read_header(&self.config().tenant_header);
        let verdict = self.router.on_request_headers(RequestHead {
            path: path.as_deref().unwrap_or_default(),
            tenant_header: tenant.as_deref(),
            end_of_stream,
        });
        match verdict {
            HeadersVerdict::Continue(decision) => {
                self.write_key(&decision);
                Action::Continue
            }
            HeadersVerdict::PauseForBody => Action::Pause,
            HeadersVerdict::Reject(reply) => self.reject(&reply),
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
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
        let verdict = self.router.on_request_trailers();
        self.body_action(verdict)
    }
}

fn read_header(name: &str) -> Option<Vec<u8>> {
    match host::get_request_header(name) {
        Ok(value) => value,
        Err(status) => {
            log::warn!("prefix-router: cannot read header {name}: {status}");
            None
        }
    }
}
