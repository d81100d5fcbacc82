//! Every HTTP header name the filter itself defines, and the values it gives
//! the internal ones, in one place: which headers a client may never send,
//! which the upstream filter strips and which a configuration may not reuse
//! are all decided from this list (see `steering` and `config`).

/// Default of `key_header`: the request header carrying the routing key
/// (Envoy's Maglev hashes it).
pub const DEFAULT_KEY_HEADER: &str = "x-prefix-route-key";

/// Default of `tenant_header`: the request header naming the tenant.
pub const DEFAULT_TENANT_HEADER: &str = "x-amzn-sagemaker-prefix-aware-id";

/// Default of `host_header`: the request header Envoy's `override_host`
/// policy reads (`ip:port`).
pub const DEFAULT_HOST_HEADER: &str = "x-prefix-route-host";

/// Request header that selects the Envoy route (and so the cluster) for
/// strategies Envoy's own load balancers implement. Internal: the filter
/// removes any client-sent value before deciding.
pub const ROUTE_HEADER: &str = "x-prefix-router-lb";

/// [`ROUTE_HEADER`] value routed to the `least_request` (FULL_SCAN) cluster.
pub const LEAST_REQUEST_ROUTE: &str = "least_request";

/// Request header naming the instance the downstream decision already counted
/// (the upstream filter then does not count the request again). Internal: the
/// filter removes any client-sent value before deciding.
pub const COUNTED_HEADER: &str = "x-prefix-router-counted";

/// [`COUNTED_HEADER`] value for a request routed before its key's target was
/// known: the upstream filter counts it and clears its pending mark.
pub const PENDING_MARK: &str = "pending";

/// The request headers only the filter writes and only the filter reads: no
/// configured header may reuse them, and the upstream filter removes them
/// before the request reaches the instance.
pub const INTERNAL_REQUEST_HEADERS: [&str; 2] = [ROUTE_HEADER, COUNTED_HEADER];

/// A request header that must come at most once, as the request has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnceHeader<'a> {
    Absent,
    Once(&'a [u8]),
    /// Sent `count` (2 or more) times: which value would count is nobody's
    /// guess, so the filter takes none of them.
    Repeated {
        count: usize,
    },
}
