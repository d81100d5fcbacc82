//! Everything the filter asks of its host (Envoy), behind one trait,
//! [`Host`]: headers, body and configuration buffers, local replies, metrics,
//! properties, the clock, tick period, entropy, shared data and HTTP calls
//! (the engine-load poller's). The plugin
//! logic (`plugin`) is written against the trait, so it is tested natively
//! with an in-memory host; `AbiHost` implements it over the proxy-wasm ABI, in
//! the `.wasm` only.
//!
//! The ABI side makes the host calls itself, without panics:
//! `proxy-wasm` 0.2.5 `hostcalls` return `Result` but panic on any status
//! they do not expect (e.g. `set_map_value` on `BadArgument`, which Envoy
//! answers to a header write after the headers left), and `get_map_value`
//! unwraps the value as UTF-8 (a header with obs-text bytes would panic).
//! A panic kills the VM for every request on the worker, so these wrappers
//! call the same ABI functions and hand every status back as an error.
//! Buffers the host returns were allocated through the SDK's exported
//! `proxy_on_memory_allocate` (a boxed byte slice of exactly that size) and
//! are freed the way the SDK frees them.

/// A non-`Ok` host status (see the proxy-wasm ABI `WasmResult`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostStatus(pub u32);

impl HostStatus {
    /// What the host answers for a call it does not implement.
    pub const UNIMPLEMENTED: HostStatus = HostStatus(12);
}

impl std::fmt::Display for HostStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.0 {
            1 => "NotFound",
            2 => "BadArgument",
            3 => "SerializationFailure",
            4 => "ParseFailure",
            7 => "Empty",
            8 => "CasMismatch",
            10 => "InternalFailure",
            12 => "Unimplemented",
            _ => "unknown",
        };
        write!(f, "host status {} ({name})", self.0)
    }
}

/// The kinds of metric a host keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// What the filter asks of its host. Every call reports the host's refusal
/// as an error (or, for shared data, as the [`SharedStore`] contract says)
/// and never panics. One implementation per environment: `AbiHost` in the
/// `.wasm`, an in-memory one in the tests.
pub trait Host: SharedStore {
    /// Every request header, in one call.
    fn request_headers(&self) -> Result<HeaderMap, HostStatus>;
    fn replace_request_header(&self, name: &str, value: &[u8]) -> Result<(), HostStatus>;
    fn remove_request_header(&self, name: &str) -> Result<(), HostStatus>;
    fn replace_response_header(&self, name: &str, value: &[u8]) -> Result<(), HostStatus>;
    /// Every response header, in one call.
    fn response_headers(&self) -> Result<HeaderMap, HostStatus>;
    /// Up to `len` bytes of the buffered request body from `start`; `None`
    /// if there is no body buffer.
    fn request_body(&self, start: usize, len: usize) -> Result<Option<Vec<u8>>, HostStatus>;
    /// Up to `len` bytes of the response body chunk being delivered, from
    /// `start`; `None` if there is no body buffer.
    fn response_body(&self, start: usize, len: usize) -> Result<Option<Vec<u8>>, HostStatus>;
    /// The plugin configuration (`size` bytes, as `on_configure` announced).
    fn plugin_configuration(&self, size: usize) -> Result<Option<Vec<u8>>, HostStatus>;
    /// Answers the request locally; `details` names the reason in Envoy's
    /// access log (`%RESPONSE_CODE_DETAILS%`).
    fn send_local_response(
        &self,
        status: u32,
        details: &str,
        headers: &[(String, String)],
        body: &[u8],
    ) -> Result<(), HostStatus>;
    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, HostStatus>;
    fn increment_metric(&self, id: u32, delta: i64) -> Result<(), HostStatus>;
    /// Sets a gauge, or records a histogram sample.
    fn record_metric(&self, id: u32, value: u64) -> Result<(), HostStatus>;
    /// A property (e.g. `["upstream", "address"]`); `None` if not available.
    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostStatus>;
    /// The host's monotonic clock, in milliseconds from an origin of its
    /// own: Envoy's steady clock, one for every VM of the process (shared
    /// data compares stamps written by several VMs), which never steps back
    /// as the wall clock can (NTP, a VM resumed): every stamp's age and
    /// every period the filter keeps is a difference of two readings of it.
    fn now_ms(&self) -> Result<u64, HostStatus>;
    fn set_tick_period_ms(&self, period: u32) -> Result<(), HostStatus>;
    /// 64 random bits from the host's entropy source, `None` if it fails.
    fn random_u64(&self) -> Option<u64>;
    /// Sends an HTTP request through Envoy's `cluster` (from a root
    /// context); its answer arrives at that root context's
    /// `on_http_call_response` under the returned token, at the latest when
    /// `timeout_ms` has passed.
    fn dispatch_http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u32,
    ) -> Result<u32, HostStatus>;
    /// Inside `on_http_call_response`: the answer's headers (`:status`
    /// among them); empty when Envoy reports no response.
    fn http_call_response_headers(&self) -> Result<HeaderMap, HostStatus>;
    /// Inside `on_http_call_response`: up to `len` bytes of the answer's
    /// body from `start`; `None` if it has none.
    fn http_call_response_body(
        &self,
        start: usize,
        len: usize,
    ) -> Result<Option<Vec<u8>>, HostStatus>;
}

impl<T: Host + ?Sized> Host for std::rc::Rc<T> {
    fn request_headers(&self) -> Result<HeaderMap, HostStatus> {
        (**self).request_headers()
    }
    fn replace_request_header(&self, name: &str, value: &[u8]) -> Result<(), HostStatus> {
        (**self).replace_request_header(name, value)
    }
    fn remove_request_header(&self, name: &str) -> Result<(), HostStatus> {
        (**self).remove_request_header(name)
    }
    fn replace_response_header(&self, name: &str, value: &[u8]) -> Result<(), HostStatus> {
        (**self).replace_response_header(name, value)
    }
    fn response_headers(&self) -> Result<HeaderMap, HostStatus> {
        (**self).response_headers()
    }
    fn request_body(&self, start: usize, len: usize) -> Result<Option<Vec<u8>>, HostStatus> {
        (**self).request_body(start, len)
    }
    fn response_body(&self, start: usize, len: usize) -> Result<Option<Vec<u8>>, HostStatus> {
        (**self).response_body(start, len)
    }
    fn plugin_configuration(&self, size: usize) -> Result<Option<Vec<u8>>, HostStatus> {
        (**self).plugin_configuration(size)
    }
    fn send_local_response(
        &self,
        status: u32,
        details: &str,
        headers: &[(String, String)],
        body: &[u8],
    ) -> Result<(), HostStatus> {
        (**self).send_local_response(status, details, headers, body)
    }
    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, HostStatus> {
        (**self).define_metric(kind, name)
    }
    fn increment_metric(&self, id: u32, delta: i64) -> Result<(), HostStatus> {
        (**self).increment_metric(id, delta)
    }
    fn record_metric(&self, id: u32, value: u64) -> Result<(), HostStatus> {
        (**self).record_metric(id, value)
    }
    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostStatus> {
        (**self).property(path)
    }
    fn now_ms(&self) -> Result<u64, HostStatus> {
        (**self).now_ms()
    }
    fn set_tick_period_ms(&self, period: u32) -> Result<(), HostStatus> {
        (**self).set_tick_period_ms(period)
    }
    fn random_u64(&self) -> Option<u64> {
        (**self).random_u64()
    }
    fn dispatch_http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u32,
    ) -> Result<u32, HostStatus> {
        (**self).dispatch_http_call(cluster, headers, timeout_ms)
    }
    fn http_call_response_headers(&self) -> Result<HeaderMap, HostStatus> {
        (**self).http_call_response_headers()
    }
    fn http_call_response_body(
        &self,
        start: usize,
        len: usize,
    ) -> Result<Option<Vec<u8>>, HostStatus> {
        (**self).http_call_response_body(start, len)
    }
}

use crate::headers::OnceHeader;
use crate::shared::SharedStore;

/// A property path in the ABI's encoding: segments separated by NUL (as
/// the proxy-wasm SDK sends it).
pub fn serialize_property_path(path: &[&str]) -> Vec<u8> {
    path.join("\0").into_bytes()
}

/// Header pairs in the ABI's map encoding: count, then (name length, value
/// length) per pair as u32 little-endian, then each name and value followed
/// by a NUL byte.
pub fn serialize_pairs(pairs: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    let len32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    out.extend_from_slice(&len32(pairs.len()));
    for (name, value) in pairs {
        out.extend_from_slice(&len32(name.len()));
        out.extend_from_slice(&len32(value.len()));
    }
    for (name, value) in pairs {
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.extend_from_slice(value.as_bytes());
        out.push(0);
    }
    out
}

/// A header map as one host call returns it (names as Envoy keeps them:
/// lowercase). Reading the whole map once costs one host call where reading,
/// and removing, header by header cost one each.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderMap {
    pairs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl HeaderMap {
    /// Decodes the ABI's map encoding (see [`serialize_pairs`]); `None` if
    /// the bytes do not follow it.
    pub fn decode(bytes: &[u8]) -> Option<HeaderMap> {
        let u32_at = |at: usize| -> Option<usize> {
            let raw: [u8; 4] = bytes.get(at..at + 4)?.try_into().ok()?;
            usize::try_from(u32::from_le_bytes(raw)).ok()
        };
        let count = u32_at(0)?;
        // Each pair takes at least 10 bytes: two lengths and two NULs.
        if count > bytes.len() / 10 {
            return None;
        }
        let mut data = 4 + 8 * count;
        let mut pairs = Vec::with_capacity(count);
        for index in 0..count {
            let name_len = u32_at(4 + 8 * index)?;
            let value_len = u32_at(8 + 8 * index)?;
            let name = bytes.get(data..data.checked_add(name_len)?)?;
            data += name_len + 1;
            let value = bytes.get(data..data.checked_add(value_len)?)?;
            data += value_len + 1;
            pairs.push((name.to_vec(), value.to_vec()));
        }
        (data <= bytes.len()).then_some(HeaderMap { pairs })
    }

    /// The first value of `name` (compared ignoring ASCII case).
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.pairs
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v.as_slice())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// `name` as a header that must come at most once.
    pub fn once(&self, name: &str) -> OnceHeader<'_> {
        let mut values = self
            .pairs
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v.as_slice());
        match (values.next(), values.count()) {
            (None, _) => OnceHeader::Absent,
            (Some(value), 0) => OnceHeader::Once(value),
            (Some(_), more) => OnceHeader::Repeated { count: more + 1 },
        }
    }

    /// A map of these (name, value) pairs, in this order.
    pub fn from_pairs(pairs: Vec<(Vec<u8>, Vec<u8>)>) -> HeaderMap {
        HeaderMap { pairs }
    }
}

#[cfg(target_arch = "wasm32")]
mod abi {
    use super::{HeaderMap, Host, HostStatus, MetricKind};
    use crate::shared::{SetError, SharedStore};
    use std::ptr::{null, null_mut};

    const STATUS_OK: u32 = 0;
    const STATUS_NOT_FOUND: u32 = 1;
    const STATUS_SERIALIZATION_FAILURE: u32 = 3;
    const STATUS_CAS_MISMATCH: u32 = 8;

    const MAP_HTTP_REQUEST_HEADERS: u32 = 0;
    const MAP_HTTP_RESPONSE_HEADERS: u32 = 2;
    const MAP_HTTP_CALL_RESPONSE_HEADERS: u32 = 6;
    const BUFFER_HTTP_REQUEST_BODY: u32 = 0;
    const BUFFER_HTTP_RESPONSE_BODY: u32 = 1;
    const BUFFER_HTTP_CALL_RESPONSE_BODY: u32 = 4;
    const BUFFER_PLUGIN_CONFIGURATION: u32 = 7;

    /// The ABI's `MetricType`.
    fn metric_type(kind: MetricKind) -> u32 {
        match kind {
            MetricKind::Counter => 0,
            MetricKind::Gauge => 1,
            MetricKind::Histogram => 2,
        }
    }

    #[link(wasm_import_module = "env")]
    extern "C" {
        fn proxy_get_header_map_pairs(
            map_type: u32,
            return_map_data: *mut *mut u8,
            return_map_size: *mut usize,
        ) -> u32;
        fn proxy_replace_header_map_value(
            map_type: u32,
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
        fn proxy_remove_header_map_value(
            map_type: u32,
            key_data: *const u8,
            key_size: usize,
        ) -> u32;
        fn proxy_get_buffer_bytes(
            buffer_type: u32,
            start: usize,
            max_size: usize,
            return_buffer_data: *mut *mut u8,
            return_buffer_size: *mut usize,
        ) -> u32;
        #[allow(clippy::too_many_arguments)]
        fn proxy_send_local_response(
            status_code: u32,
            status_code_details_data: *const u8,
            status_code_details_size: usize,
            body_data: *const u8,
            body_size: usize,
            headers_data: *const u8,
            headers_size: usize,
            grpc_status: i32,
        ) -> u32;
        fn proxy_define_metric(
            metric_type: u32,
            name_data: *const u8,
            name_size: usize,
            return_id: *mut u32,
        ) -> u32;
        fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
        fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
        fn proxy_get_shared_data(
            key_data: *const u8,
            key_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
            return_cas: *mut u32,
        ) -> u32;
        fn proxy_set_shared_data(
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
            cas: u32,
        ) -> u32;
        fn proxy_get_property(
            path_data: *const u8,
            path_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> u32;
        fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    }

    #[link(wasm_import_module = "wasi_snapshot_preview1")]
    extern "C" {
        /// WASI's entropy source (the same import Rust's std uses); returns
        /// an errno, 0 on success.
        fn random_get(buf: *mut u8, buf_len: usize) -> i32;
        /// WASI's clocks; Envoy's host answers `CLOCK_MONOTONIC` with its
        /// steady clock (proxy-wasm's own time call is the wall clock).
        /// Returns an errno, 0 on success.
        fn clock_time_get(clock_id: u32, precision: u64, time: *mut u64) -> i32;
    }

    /// WASI's `CLOCKID_MONOTONIC`.
    const CLOCK_MONOTONIC: u32 = 1;

    fn check(status: u32) -> Result<(), HostStatus> {
        if status == STATUS_OK {
            Ok(())
        } else {
            Err(HostStatus(status))
        }
    }

    /// Takes ownership of a host-returned buffer.
    ///
    /// # Safety
    /// `data` must be null or come from `proxy_on_memory_allocate(size)`.
    unsafe fn take(data: *mut u8, size: usize) -> Vec<u8> {
        if data.is_null() {
            Vec::new()
        } else {
            // SAFETY: allocated by the SDK as exactly `size` bytes.
            unsafe { Vec::from_raw_parts(data, size, size) }
        }
    }

    /// Every header of `map`, in one host call.
    fn get_header_map(map: u32) -> Result<HeaderMap, HostStatus> {
        let mut data: *mut u8 = null_mut();
        let mut size: usize = 0;
        // SAFETY: pointers are valid for the call; the host writes a buffer
        // it allocated through our allocator.
        let status = unsafe { proxy_get_header_map_pairs(map, &mut data, &mut size) };
        match status {
            // SAFETY: see `take`.
            STATUS_OK => HeaderMap::decode(&unsafe { take(data, size) })
                .ok_or(HostStatus(STATUS_SERIALIZATION_FAILURE)),
            STATUS_NOT_FOUND => Ok(HeaderMap::default()),
            other => Err(HostStatus(other)),
        }
    }

    fn replace_header(map: u32, name: &str, value: &[u8]) -> Result<(), HostStatus> {
        // SAFETY: pointers valid for the call.
        check(unsafe {
            proxy_replace_header_map_value(
                map,
                name.as_ptr(),
                name.len(),
                value.as_ptr(),
                value.len(),
            )
        })
    }

    fn remove_header(map: u32, name: &str) -> Result<(), HostStatus> {
        // SAFETY: pointers valid for the call.
        check(unsafe { proxy_remove_header_map_value(map, name.as_ptr(), name.len()) })
    }

    fn get_buffer(
        buffer_type: u32,
        start: usize,
        max_size: usize,
    ) -> Result<Option<Vec<u8>>, HostStatus> {
        let mut data: *mut u8 = null_mut();
        let mut size: usize = 0;
        // SAFETY: as in `get_header_map`.
        let status =
            unsafe { proxy_get_buffer_bytes(buffer_type, start, max_size, &mut data, &mut size) };
        match status {
            // SAFETY: see `take`.
            STATUS_OK => Ok(Some(unsafe { take(data, size) })),
            STATUS_NOT_FOUND => Ok(None),
            other => Err(HostStatus(other)),
        }
    }

    fn send_local_response(
        status_code: u32,
        details: &str,
        headers: &[(String, String)],
        body: &[u8],
    ) -> Result<(), HostStatus> {
        let headers = super::serialize_pairs(headers);
        // SAFETY: pointers valid for the call.
        check(unsafe {
            proxy_send_local_response(
                status_code,
                details.as_ptr(),
                details.len(),
                if body.is_empty() {
                    null()
                } else {
                    body.as_ptr()
                },
                body.len(),
                headers.as_ptr(),
                headers.len(),
                -1,
            )
        })
    }

    fn define_metric(metric_type: u32, name: &str) -> Result<u32, HostStatus> {
        let mut id: u32 = 0;
        // SAFETY: pointers valid for the call.
        check(unsafe { proxy_define_metric(metric_type, name.as_ptr(), name.len(), &mut id) })?;
        Ok(id)
    }

    fn increment_metric(id: u32, offset: i64) -> Result<(), HostStatus> {
        // SAFETY: no pointers.
        check(unsafe { proxy_increment_metric(id, offset) })
    }

    fn record_metric(id: u32, value: u64) -> Result<(), HostStatus> {
        // SAFETY: no pointers.
        check(unsafe { proxy_record_metric(id, value) })
    }

    fn get_property(path: &[&str]) -> Result<Option<Vec<u8>>, HostStatus> {
        let path = super::serialize_property_path(path);
        let mut data: *mut u8 = null_mut();
        let mut size: usize = 0;
        // SAFETY: as in `get_header_map`.
        let status = unsafe { proxy_get_property(path.as_ptr(), path.len(), &mut data, &mut size) };
        match status {
            // SAFETY: see `take`.
            STATUS_OK => Ok(Some(unsafe { take(data, size) })),
            STATUS_NOT_FOUND => Ok(None),
            other => Err(HostStatus(other)),
        }
    }

    fn now_ms() -> Result<u64, HostStatus> {
        let mut nanos: u64 = 0;
        // SAFETY: pointer valid for the call.
        let errno = unsafe { clock_time_get(CLOCK_MONOTONIC, 1_000_000, &mut nanos) };
        if errno != 0 {
            // The host lacks the clock (ENOTSUP) or refused the pointer.
            return Err(HostStatus::UNIMPLEMENTED);
        }
        Ok(nanos / 1_000_000)
    }

    fn set_tick_period_ms(period: u32) -> Result<(), HostStatus> {
        // SAFETY: no pointers.
        check(unsafe { proxy_set_tick_period_milliseconds(period) })
    }

    /// The one call made through the SDK rather than the ABI: the SDK's
    /// dispatcher must record which context sent the call (its
    /// `proxy_on_http_call_response` export panics on a token it does not
    /// know), and only `hostcalls::dispatch_http_call` records it. That
    /// function panics on a status other than Ok, BadArgument and
    /// InternalFailure; Envoy's `Context::httpCall`
    /// (`source/extensions/common/wasm/context.cc`) answers no other. The
    /// headers it checks (`:method`, `:path`, `:authority`) are always sent,
    /// and an empty cluster name is refused here, before the call.
    fn dispatch_http_call(
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u32,
    ) -> Result<u32, HostStatus> {
        const STATUS_BAD_ARGUMENT: u32 = 2;
        const STATUS_INTERNAL_FAILURE: u32 = 10;
        if cluster.is_empty() {
            return Err(HostStatus(STATUS_BAD_ARGUMENT));
        }
        let timeout = std::time::Duration::from_millis(u64::from(timeout_ms));
        proxy_wasm::hostcalls::dispatch_http_call(cluster, headers.to_vec(), None, vec![], timeout)
            .map_err(|status| match status {
                proxy_wasm::types::Status::BadArgument => HostStatus(STATUS_BAD_ARGUMENT),
                _ => HostStatus(STATUS_INTERNAL_FAILURE),
            })
    }

    fn random_u64() -> Option<u64> {
        let mut bytes = [0u8; 8];
        // SAFETY: the pointer is valid for `bytes.len()` bytes for the call.
        let errno = unsafe { random_get(bytes.as_mut_ptr(), bytes.len()) };
        (errno == 0).then(|| u64::from_le_bytes(bytes))
    }

    /// The host the `.wasm` runs in, through the proxy-wasm ABI. Its shared
    /// data is Envoy's (one map per `vm_id`, shared by all workers).
    #[derive(Debug, Clone, Copy, Default)]
    pub struct AbiHost;

    impl Host for AbiHost {
        fn request_headers(&self) -> Result<HeaderMap, HostStatus> {
            get_header_map(MAP_HTTP_REQUEST_HEADERS)
        }
        fn replace_request_header(&self, name: &str, value: &[u8]) -> Result<(), HostStatus> {
            replace_header(MAP_HTTP_REQUEST_HEADERS, name, value)
        }
        fn remove_request_header(&self, name: &str) -> Result<(), HostStatus> {
            remove_header(MAP_HTTP_REQUEST_HEADERS, name)
        }
        fn replace_response_header(&self, name: &str, value: &[u8]) -> Result<(), HostStatus> {
            replace_header(MAP_HTTP_RESPONSE_HEADERS, name, value)
        }
        fn response_headers(&self) -> Result<HeaderMap, HostStatus> {
            get_header_map(MAP_HTTP_RESPONSE_HEADERS)
        }
        fn request_body(&self, start: usize, len: usize) -> Result<Option<Vec<u8>>, HostStatus> {
            get_buffer(BUFFER_HTTP_REQUEST_BODY, start, len)
        }
        fn response_body(&self, start: usize, len: usize) -> Result<Option<Vec<u8>>, HostStatus> {
            get_buffer(BUFFER_HTTP_RESPONSE_BODY, start, len)
        }
        fn plugin_configuration(&self, size: usize) -> Result<Option<Vec<u8>>, HostStatus> {
            get_buffer(BUFFER_PLUGIN_CONFIGURATION, 0, size)
        }
        fn send_local_response(
            &self,
            status: u32,
            details: &str,
            headers: &[(String, String)],
            body: &[u8],
        ) -> Result<(), HostStatus> {
            send_local_response(status, details, headers, body)
        }
        fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, HostStatus> {
            define_metric(metric_type(kind), name)
        }
        fn increment_metric(&self, id: u32, delta: i64) -> Result<(), HostStatus> {
            increment_metric(id, delta)
        }
        fn record_metric(&self, id: u32, value: u64) -> Result<(), HostStatus> {
            record_metric(id, value)
        }
        fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostStatus> {
            get_property(path)
        }
        fn now_ms(&self) -> Result<u64, HostStatus> {
            now_ms()
        }
        fn set_tick_period_ms(&self, period: u32) -> Result<(), HostStatus> {
            set_tick_period_ms(period)
        }
        fn random_u64(&self) -> Option<u64> {
            random_u64()
        }
        fn dispatch_http_call(
            &self,
            cluster: &str,
            headers: &[(&str, &str)],
            timeout_ms: u32,
        ) -> Result<u32, HostStatus> {
            dispatch_http_call(cluster, headers, timeout_ms)
        }
        fn http_call_response_headers(&self) -> Result<HeaderMap, HostStatus> {
            get_header_map(MAP_HTTP_CALL_RESPONSE_HEADERS)
        }
        fn http_call_response_body(
            &self,
            start: usize,
            len: usize,
        ) -> Result<Option<Vec<u8>>, HostStatus> {
            get_buffer(BUFFER_HTTP_CALL_RESPONSE_BODY, start, len)
        }
    }

    impl SharedStore for AbiHost {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            let mut data: *mut u8 = null_mut();
            let mut size: usize = 0;
            let mut cas: u32 = 0;
            // SAFETY: as in `get_header_map`.
            let status = unsafe {
                proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas)
            };
            match status {
                // SAFETY: see `take`.
                STATUS_OK => (Some(unsafe { take(data, size) }), Some(cas)),
                // Not found, or a failure: both read as "never set".
                _ => (None, None),
            }
        }

        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
            // SAFETY: pointers valid for the call.
            let status = unsafe {
                proxy_set_shared_data(
                    key.as_ptr(),
                    key.len(),
                    value.as_ptr(),
                    value.len(),
                    cas.unwrap_or(0),
                )
            };
            match status {
                STATUS_OK => Ok(()),
                STATUS_CAS_MISMATCH => Err(SetError::CasMismatch),
                _ => Err(SetError::Failed),
            }
        }
    }
}

#[cfg(target_arch = "wasm32")]
pub use abi::AbiHost;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_use_the_abi_map_encoding() {
        let pairs = vec![
            ("content-type".to_string(), "application/json".to_string()),
            ("x".to_string(), String::new()),
        ];
        let mut expected = vec![2, 0, 0, 0, 12, 0, 0, 0, 16, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0];
        expected.extend_from_slice(b"content-type\0application/json\0x\0\0");
        assert_eq!(serialize_pairs(&pairs), expected);
        assert_eq!(serialize_pairs(&[]), vec![0, 0, 0, 0]);
    }

    #[test]
    fn header_maps_decode_from_the_abi_encoding() {
        let pairs = vec![
            (":path".to_string(), "/v1/chat/completions".to_string()),
            ("x-tenant".to_string(), String::new()),
            ("x-dup".to_string(), "first".to_string()),
            ("x-dup".to_string(), "second".to_string()),
        ];
        let map = HeaderMap::decode(&serialize_pairs(&pairs)).unwrap();
        assert_eq!(map.get(":path"), Some(&b"/v1/chat/completions"[..]));
        assert_eq!(map.get("X-Tenant"), Some(&b""[..]), "present though empty");
        assert_eq!(map.get("x-dup"), Some(&b"first"[..]));
        assert!(!map.contains("x-missing"));
        assert_eq!(
            HeaderMap::decode(&serialize_pairs(&[])),
            Some(HeaderMap::default())
        );
        // Non-UTF-8 values are kept as bytes.
        let mut raw = serialize_pairs(&[("a".to_string(), "b".to_string())]);
        let at = raw.len() - 2;
        raw[at] = 0xE9;
        assert_eq!(HeaderMap::decode(&raw).unwrap().get("a"), Some(&[0xE9][..]));
    }

    #[test]
    fn a_header_that_must_come_once_is_told_apart_from_a_repeated_one() {
        let map = HeaderMap::from_pairs(vec![
            (b"x-tenant".to_vec(), b"a".to_vec()),
            (b"x-other".to_vec(), b"o".to_vec()),
            (b"X-Tenant".to_vec(), b"b".to_vec()),
            (b"x-one".to_vec(), b"1".to_vec()),
        ]);
        assert_eq!(map.once("x-tenant"), OnceHeader::Repeated { count: 2 });
        assert_eq!(map.once("x-one"), OnceHeader::Once(b"1"));
        assert_eq!(map.once("x-none"), OnceHeader::Absent);
        assert_eq!(map.get("x-tenant"), Some(&b"a"[..]), "get keeps the first");
    }

    #[test]
    fn malformed_header_maps_are_refused() {
        let good = serialize_pairs(&[("name".to_string(), "value".to_string())]);
        for cut in 0..good.len() - 1 {
            assert_eq!(HeaderMap::decode(&good[..cut]), None, "cut at {cut}");
        }
        assert_eq!(HeaderMap::decode(&[0xff, 0xff, 0xff, 0xff]), None);
        let mut huge = good.clone();
        huge[4] = 0xff;
        assert_eq!(HeaderMap::decode(&huge), None);
    }

    #[test]
    fn property_paths_separate_segments_with_nul_and_end_without_one() {
        assert_eq!(
            serialize_property_path(&["upstream", "address"]),
            b"upstream\0address".to_vec()
        );
        assert_eq!(serialize_property_path(&[]), Vec::<u8>::new());
    }
}
