//! An in-memory [`Host`] for the plugin tests: request and response header
//! maps, a body buffer, the plugin configuration, properties, a clock the
//! test sets, entropy the test chooses, recorded metrics and local replies,
//! and shared data in a [`MemoryStore`] that several hosts (worker VMs) can
//! share. Every host call is logged, so a test can count them.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use crate::host::{HeaderMap, Host, HostStatus, MetricKind};
use crate::shared::{MemoryStore, SetError, SharedStore};

/// A metric as the host keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MemoryMetric {
    pub(crate) kind: MetricKind,
    pub(crate) name: String,
    /// Every increment, in order (counters).
    pub(crate) increments: Vec<i64>,
    /// Every recorded value, in order (gauges, histograms).
    pub(crate) records: Vec<u64>,
}

/// A local reply the filter sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SentReply {
    pub(crate) status: u32,
    pub(crate) details: String,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
}

/// An answer to an HTTP call: its headers and body.
type CallAnswer = (Vec<(String, Vec<u8>)>, Vec<u8>);

/// An HTTP call the filter dispatched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SentCall {
    pub(crate) token: u32,
    pub(crate) cluster: String,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) timeout_ms: u32,
}

impl SentCall {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct MemoryHost {
    store: Rc<MemoryStore>,
    request_headers: RefCell<Vec<(String, Vec<u8>)>>,
    response_headers: RefCell<Vec<(String, Vec<u8>)>>,
    body: RefCell<Vec<u8>>,
    /// The response body chunk being delivered.
    response_chunk: RefCell<Vec<u8>>,
    configuration: RefCell<Vec<u8>>,
    properties: RefCell<HashMap<String, Vec<u8>>>,
    now_ms: Cell<u64>,
    /// The clock answers Unimplemented, as a host without WASI's monotonic
    /// clock would.
    clock_missing: Cell<bool>,
    entropy: Cell<Option<u64>>,
    metrics: RefCell<Vec<MemoryMetric>>,
    replies: RefCell<Vec<SentReply>>,
    tick_period_ms: Cell<Option<u32>>,
    calls: RefCell<Vec<String>>,
    http_calls: RefCell<Vec<SentCall>>,
    /// What dispatching answers instead of a token (`None`: a token).
    http_call_refusal: Cell<Option<HostStatus>>,
    /// The answer being delivered: headers and body (`None`: no response).
    http_call_answer: RefCell<Option<CallAnswer>>,
    /// Host calls that fail (by name: `request_headers`, `request_body`,
    /// `send_local_response`), as a host in trouble would answer them.
    failing: RefCell<Vec<&'static str>>,
}

impl MemoryHost {
    /// A host whose shared data is `store` (give two hosts the same store
    /// to simulate two worker VMs of one Envoy).
    pub(crate) fn with_store(store: Rc<MemoryStore>) -> Rc<MemoryHost> {
        Rc::new(MemoryHost {
            store,
            now_ms: Cell::new(1_000_000),
            entropy: Cell::new(Some(0x5EED)),
            ..MemoryHost::default()
        })
    }

    pub(crate) fn new() -> Rc<MemoryHost> {
        Self::with_store(Rc::new(MemoryStore::new()))
    }

    pub(crate) fn store(&self) -> &MemoryStore {
        &self.store
    }

    /// A new request: these headers, no body, no response, no properties.
    pub(crate) fn start_request(&self, headers: &[(&str, &str)]) {
        *self.request_headers.borrow_mut() = headers
            .iter()
            .map(|(n, v)| (n.to_ascii_lowercase(), v.as_bytes().to_vec()))
            .collect();
        self.response_headers.borrow_mut().clear();
        self.body.borrow_mut().clear();
        self.response_chunk.borrow_mut().clear();
        self.properties.borrow_mut().clear();
    }

    pub(crate) fn request_header(&self, name: &str) -> Option<String> {
        header(&self.request_headers.borrow(), name)
    }

    pub(crate) fn request_header_names(&self) -> Vec<String> {
        self.request_headers
            .borrow()
            .iter()
            .map(|(n, _)| n.clone())
            .collect()
    }

    pub(crate) fn response_header(&self, name: &str) -> Option<String> {
        header(&self.response_headers.borrow(), name)
    }

    /// The response body chunk the next `on_response_body` reads; returns
    /// its size.
    pub(crate) fn deliver_response_chunk(&self, bytes: &[u8]) -> usize {
        *self.response_chunk.borrow_mut() = bytes.to_vec();
        bytes.len()
    }

    /// Appends to the buffered request body; returns its size now.
    pub(crate) fn arrive(&self, bytes: &[u8]) -> usize {
        let mut body = self.body.borrow_mut();
        body.extend_from_slice(bytes);
        body.len()
    }

    pub(crate) fn set_configuration(&self, json: &str) -> usize {
        *self.configuration.borrow_mut() = json.as_bytes().to_vec();
        json.len()
    }

    /// Sets (or, with `None`, removes) the `.`-joined property `path`.
    pub(crate) fn set_property(&self, path: &str, value: Option<&str>) {
        let mut properties = self.properties.borrow_mut();
        match value {
            Some(value) => properties.insert(path.to_string(), value.as_bytes().to_vec()),
            None => properties.remove(path),
        };
    }

    pub(crate) fn advance_ms(&self, ms: u64) {
        self.now_ms.set(self.now_ms.get() + ms);
    }

    /// Makes the host call `name` fail (`true`) or answer again.
    pub(crate) fn set_failing(&self, name: &'static str, failing: bool) {
        let mut calls = self.failing.borrow_mut();
        calls.retain(|c| *c != name);
        if failing {
            calls.push(name);
        }
    }

    /// `Err` if the host call `name` is made to fail.
    fn fails(&self, name: &str) -> Result<(), HostStatus> {
        if self.failing.borrow().contains(&name) {
            return Err(HostStatus(2)); // BadArgument, as Envoy answers a bad call
        }
        Ok(())
    }

    /// Makes the clock fail (`true`) or answer again.
    pub(crate) fn set_clock_missing(&self, missing: bool) {
        self.clock_missing.set(missing);
    }

    /// What [`Host::random_u64`] answers (`None`: the entropy source fails).
    pub(crate) fn set_entropy(&self, entropy: Option<u64>) {
        self.entropy.set(entropy);
    }

    pub(crate) fn metric(&self, name: &str) -> Option<MemoryMetric> {
        self.metrics
            .borrow()
            .iter()
            .find(|m| m.name == name)
            .cloned()
    }

    /// A counter's value: the sum of its increments (0 if never defined).
    pub(crate) fn counter(&self, name: &str) -> i64 {
        self.metric(name).map_or(0, |m| m.increments.iter().sum())
    }

    /// A gauge's value: the last recorded one.
    pub(crate) fn gauge(&self, name: &str) -> Option<u64> {
        self.metric(name).and_then(|m| m.records.last().copied())
    }

    /// Every metric defined, by name, in order of definition.
    pub(crate) fn metric_names(&self) -> Vec<String> {
        self.metrics
            .borrow()
            .iter()
            .map(|m| m.name.clone())
            .collect()
    }

    pub(crate) fn defined(&self, kind: MetricKind) -> usize {
        self.metrics
            .borrow()
            .iter()
            .filter(|m| m.kind == kind)
            .count()
    }

    pub(crate) fn replies(&self) -> Vec<SentReply> {
        self.replies.borrow().clone()
    }

    pub(crate) fn tick_period_ms(&self) -> Option<u32> {
        self.tick_period_ms.get()
    }

    /// The HTTP calls dispatched since the last call of this.
    pub(crate) fn take_http_calls(&self) -> Vec<SentCall> {
        std::mem::take(&mut *self.http_calls.borrow_mut())
    }

    /// Makes dispatching refuse with `status` (`None`: accept again).
    pub(crate) fn refuse_http_calls(&self, status: Option<HostStatus>) {
        self.http_call_refusal.set(status);
    }

    /// The answer the next `http_call_response_*` calls read: `status` and
    /// `body`, or (`None`) no response at all.
    pub(crate) fn set_http_call_answer(&self, answer: Option<(u32, &[u8])>) {
        *self.http_call_answer.borrow_mut() = answer.map(|(status, body)| {
            (
                vec![(":status".to_string(), status.to_string().into_bytes())],
                body.to_vec(),
            )
        });
    }

    /// The host calls made since the last call of this, by name (e.g.
    /// `replace_request_header x-prefix-route-key`).
    pub(crate) fn take_calls(&self) -> Vec<String> {
        std::mem::take(&mut *self.calls.borrow_mut())
    }

    fn log(&self, call: String) {
        self.calls.borrow_mut().push(call);
    }

    fn metric_mut<R>(
        &self,
        id: u32,
        f: impl FnOnce(&mut MemoryMetric) -> R,
    ) -> Result<R, HostStatus> {
        let mut metrics = self.metrics.borrow_mut();
        let index = usize::try_from(id).map_err(|_| HostStatus(1))?;
        metrics.get_mut(index).map(f).ok_or(HostStatus(1))
    }
}

fn header(map: &[(String, Vec<u8>)], name: &str) -> Option<String> {
    map.iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
}

/// `map` as one host call hands a header map over.
fn header_map(map: &[(String, Vec<u8>)]) -> HeaderMap {
    HeaderMap::from_pairs(
        map.iter()
            .map(|(n, v)| (n.as_bytes().to_vec(), v.clone()))
            .collect(),
    )
}

fn replace(map: &mut Vec<(String, Vec<u8>)>, name: &str, value: &[u8]) {
    map.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
    map.push((name.to_ascii_lowercase(), value.to_vec()));
}

impl Host for MemoryHost {
    fn request_headers(&self) -> Result<HeaderMap, HostStatus> {
        self.log("request_headers".into());
        self.fails("request_headers")?;
        Ok(header_map(&self.request_headers.borrow()))
    }

    fn replace_request_header(&self, name: &str, value: &[u8]) -> Result<(), HostStatus> {
        self.log(format!("replace_request_header {name}"));
        replace(&mut self.request_headers.borrow_mut(), name, value);
        Ok(())
    }

    fn remove_request_header(&self, name: &str) -> Result<(), HostStatus> {
        self.log(format!("remove_request_header {name}"));
        self.request_headers
            .borrow_mut()
            .retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        Ok(())
    }

    fn replace_response_header(&self, name: &str, value: &[u8]) -> Result<(), HostStatus> {
        self.log(format!("replace_response_header {name}"));
        replace(&mut self.response_headers.borrow_mut(), name, value);
        Ok(())
    }

    fn response_headers(&self) -> Result<HeaderMap, HostStatus> {
        self.log("response_headers".into());
        self.fails("response_headers")?;
        Ok(header_map(&self.response_headers.borrow()))
    }

    fn request_body(&self, start: usize, len: usize) -> Result<Option<Vec<u8>>, HostStatus> {
        self.log("request_body".into());
        self.fails("request_body")?;
        Ok(window(&self.body.borrow(), start, len))
    }

    fn response_body(&self, start: usize, len: usize) -> Result<Option<Vec<u8>>, HostStatus> {
        self.log("response_body".into());
        self.fails("response_body")?;
        Ok(window(&self.response_chunk.borrow(), start, len))
    }

    fn plugin_configuration(&self, size: usize) -> Result<Option<Vec<u8>>, HostStatus> {
        self.log("plugin_configuration".into());
        let configuration = self.configuration.borrow();
        Ok(configuration.get(..size).map(<[u8]>::to_vec))
    }

    fn send_local_response(
        &self,
        status: u32,
        details: &str,
        headers: &[(String, String)],
        body: &[u8],
    ) -> Result<(), HostStatus> {
        self.log("send_local_response".into());
        self.fails("send_local_response")?;
        self.replies.borrow_mut().push(SentReply {
            status,
            details: details.to_string(),
            headers: headers.to_vec(),
            body: body.to_vec(),
        });
        Ok(())
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, HostStatus> {
        self.log(format!("define_metric {name}"));
        let mut metrics = self.metrics.borrow_mut();
        // Like Envoy: defining a name again returns the same metric.
        if let Some(index) = metrics.iter().position(|m| m.name == name) {
            return u32::try_from(index).map_err(|_| HostStatus(10));
        }
        metrics.push(MemoryMetric {
            kind,
            name: name.to_string(),
            increments: Vec::new(),
            records: Vec::new(),
        });
        u32::try_from(metrics.len() - 1).map_err(|_| HostStatus(10))
    }

    fn increment_metric(&self, id: u32, delta: i64) -> Result<(), HostStatus> {
        self.log("increment_metric".into());
        self.metric_mut(id, |m| m.increments.push(delta))
    }

    fn record_metric(&self, id: u32, value: u64) -> Result<(), HostStatus> {
        self.log("record_metric".into());
        self.metric_mut(id, |m| m.records.push(value))
    }

    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostStatus> {
        let path = path.join(".");
        self.log(format!("property {path}"));
        Ok(self.properties.borrow().get(&path).cloned())
    }

    fn now_ms(&self) -> Result<u64, HostStatus> {
        self.log("now_ms".into());
        if self.clock_missing.get() {
            return Err(HostStatus::UNIMPLEMENTED);
        }
        Ok(self.now_ms.get())
    }

    fn set_tick_period_ms(&self, period: u32) -> Result<(), HostStatus> {
        self.log("set_tick_period_ms".into());
        self.tick_period_ms.set(Some(period));
        Ok(())
    }

    fn random_u64(&self) -> Option<u64> {
        self.log("random_u64".into());
        self.entropy.get()
    }

    fn dispatch_http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u32,
    ) -> Result<u32, HostStatus> {
        self.log(format!("dispatch_http_call {cluster}"));
        if let Some(status) = self.http_call_refusal.get() {
            return Err(status);
        }
        static NEXT_TOKEN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
        let token = NEXT_TOKEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.http_calls.borrow_mut().push(SentCall {
            token,
            cluster: cluster.to_string(),
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            timeout_ms,
        });
        Ok(token)
    }

    fn http_call_response_headers(&self) -> Result<HeaderMap, HostStatus> {
        self.log("http_call_response_headers".into());
        let answer = self.http_call_answer.borrow();
        let pairs = answer
            .as_ref()
            .map(|(headers, _)| {
                headers
                    .iter()
                    .map(|(n, v)| (n.as_bytes().to_vec(), v.clone()))
                    .collect()
            })
            .unwrap_or_default();
        Ok(HeaderMap::from_pairs(pairs))
    }

    fn http_call_response_body(
        &self,
        start: usize,
        len: usize,
    ) -> Result<Option<Vec<u8>>, HostStatus> {
        self.log("http_call_response_body".into());
        let answer = self.http_call_answer.borrow();
        Ok(answer
            .as_ref()
            .and_then(|(_, body)| window(body, start, len)))
    }
}

/// Up to `len` bytes of `buffer` from `start`, as a host hands a buffer's
/// slice over (`None` past its end).
fn window(buffer: &[u8], start: usize, len: usize) -> Option<Vec<u8>> {
    let end = start.saturating_add(len).min(buffer.len());
    buffer.get(start..end).map(<[u8]>::to_vec)
}

impl SharedStore for MemoryHost {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.store.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.store.set(key, value, cas)
    }
}
