//! The HTTP/1.1 server of a simulated instance (hyper 1 on tokio): routes,
//! streaming, and the `x-served-by` header on every response. One task per
//! connection, one per streamed response, each sleeping on tokio timers.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, Instant};

use super::api::{self, ApiKind, ParsedRequest, ResponseMeta};
use super::engine::{Engine, Job, Ticket};
use super::metrics::{ORCA_FORMAT_HEADER, ORCA_REPORT_HEADER};
use super::prefix_cache::first_block_extra;
use super::tokenizer;
use super::SimConfig;

/// Largest request body accepted.
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

type Body = BoxBody<Bytes, Infallible>;

/// A running simulated instance. Dropping it stops accepting and closes
/// its connections.
pub struct SimServer {
    addr: SocketAddr,
    engine: Arc<Engine>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl SimServer {
    /// Binds `bind` (port 0 for an ephemeral port) and serves on the current runtime.
    pub async fn start(cfg: SimConfig, bind: SocketAddr) -> anyhow::Result<SimServer> {
        cfg.validate().map_err(anyhow::Error::msg)?;
        let listener = TcpListener::bind(bind)
            .await
            .with_context(|| format!("binding {bind}"))?;
        let addr = listener.local_addr()?;
        let engine = Engine::new(cfg);
        let (stop, stop_rx) = watch::channel(false);
        let shared = Arc::new(Shared {
            engine: Arc::clone(&engine),
            next_id: AtomicU64::new(0),
        });
        let task = tokio::spawn(accept_loop(listener, shared, stop_rx));
        Ok(SimServer {
            addr,
            engine,
            stop,
            task,
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The engine, for its counters.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }
}

impl Drop for SimServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.task.abort();
    }
}

struct Shared {
    engine: Arc<Engine>,
    next_id: AtomicU64,
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop.changed() => return,
        };
        let Ok((stream, _)) = accepted else {
            // Out of file descriptors and the like: back off instead of spinning.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let shared = Arc::clone(&shared);
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let shared = Arc::clone(&shared);
                async move { Ok::<_, Infallible>(handle(shared, req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = conn => {}
                _ = stop.changed() => {}
            }
        });
    }
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let cfg = shared.engine.config();
    let mut response = route(&shared, req).await;
    if let Ok(v) = HeaderValue::from_str(&cfg.name) {
        response.headers_mut().insert("x-served-by", v);
    }
    response
}

async fn route(shared: &Shared, req: Request<Incoming>) -> Response<Body> {
    let cfg = shared.engine.config();
    let path = req.uri().path().to_string();
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/health") => full(StatusCode::OK, "text/plain", Bytes::new()),
        (Method::GET, "/metrics") => full(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            Bytes::from({
                let mut text = shared.engine.snapshot().render(&cfg.model);
                if let Some(lora) = shared.engine.lora_metrics() {
                    text.push_str(&lora.render(&cfg.model));
                }
                text
            }),
        ),
        (Method::GET, "/v1/models") => {
            let mut data =
                vec![json!({"id": cfg.model, "object": "model", "owned_by": "vllm-sim"})];
            data.extend(shared.engine.adapters().into_iter().map(|(name, path)| {
                json!({"id": name, "object": "model", "owned_by": "vllm-sim", "root": path, "parent": cfg.model})
            }));
            json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
        }
        (Method::POST, "/v1/load_lora_adapter" | "/v1/unload_lora_adapter")
            if cfg.max_loras > 0 =>
        {
            let body = match read_body(req).await {
                Ok(body) => body,
                Err(response) => return response,
            };
            let (status, answer) = adapter_request(&shared.engine, &path, &body);
            match answer {
                Ok(text) => full(status, "text/plain; charset=utf-8", Bytes::from(text)),
                Err(error) => json_response(status, &error),
            }
        }
        // What SGLang's router asks each worker at registration. Neither names
        // a model or tokenizer path: the router would try to download it.
        (Method::GET, "/server_info" | "/get_server_info") => {
            json_response(StatusCode::OK, &json!({"served_model_name": cfg.model}))
        }
        (Method::GET, "/model_info" | "/get_model_info") => json_response(
            StatusCode::OK,
            &json!({"served_model_name": cfg.model, "is_generation": true}),
        ),
        (Method::POST, "/reset_prefix_cache") => {
            if shared.engine.reset_prefix_cache() {
                full(StatusCode::OK, "text/plain", Bytes::new())
            } else {
                json_response(
                    StatusCode::CONFLICT,
                    &api::error_body(
                        "requests are in flight; the prefix cache was not reset",
                        409,
                    ),
                )
            }
        }
        (Method::POST, _) => {
            let orca_format = req
                .headers()
                .get(ORCA_FORMAT_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let body = match read_body(req).await {
                Ok(body) => body,
                Err(response) => return response,
            };
            let kind = ApiKind::from_path(&path);
            match api::parse(kind, &body, &cfg.model, cfg.default_max_tokens) {
                Ok(parsed) if !shared.engine.serves_model(&parsed.model) => json_response(
                    StatusCode::NOT_FOUND,
                    &api::typed_error_body(
                        &format!("The model `{}` does not exist.", parsed.model),
                        "NotFoundError",
                        Some("model"),
                        404,
                    ),
                ),
                Ok(mut parsed) => {
                    // vLLM's --enable-force-include-usage: usage whether asked or not.
                    parsed.include_usage |= cfg.force_include_usage;
                    generate(shared, parsed, orca_format).await
                }
                Err(api::BadRequest(msg)) => {
                    json_response(StatusCode::BAD_REQUEST, &api::error_body(&msg, 400))
                }
            }
        }
        (
            _,
            "/health" | "/metrics" | "/v1/models" | "/server_info" | "/get_server_info"
            | "/model_info" | "/get_model_info",
        ) => json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &api::error_body("method not allowed", 405),
        ),
        _ => json_response(StatusCode::NOT_FOUND, &api::error_body("not found", 404)),
    }
}

/// `POST /v1/load_lora_adapter` or `/v1/unload_lora_adapter`: vLLM's
/// checks, messages and codes; the answer is plain text on success.
fn adapter_request(
    engine: &Engine,
    path: &str,
    body: &[u8],
) -> (StatusCode, Result<String, Value>) {
    let invalid = |message: &str| {
        (
            StatusCode::BAD_REQUEST,
            Err(api::typed_error_body(
                message,
                "InvalidUserInput",
                None,
                400,
            )),
        )
    };
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return invalid("request body is not valid JSON");
    };
    let field = |k: &str| {
        v.get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let name = field("lora_name");
    if path == "/v1/load_lora_adapter" {
        let lora_path = field("lora_path");
        if name.is_empty() || lora_path.is_empty() {
            return invalid("Both 'lora_name' and 'lora_path' must be provided.");
        }
        if !engine.add_adapter(&name, &lora_path) {
            return invalid(&format!(
                "The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
            ));
        }
        (
            StatusCode::OK,
            Ok(format!(
                "Success: LoRA adapter '{name}' added successfully."
            )),
        )
    } else {
        if name.is_empty() {
            return invalid("'lora_name' needs to be provided to unload a LoRA adapter.");
        }
        if !engine.remove_adapter(&name) {
            return (
                StatusCode::NOT_FOUND,
                Err(api::typed_error_body(
                    &format!("The lora adapter '{name}' cannot be found."),
                    "NotFoundError",
                    None,
                    404,
                )),
            );
        }
        (
            StatusCode::OK,
            Ok(format!(
                "Success: LoRA adapter '{name}' removed successfully."
            )),
        )
    }
}

/// The whole request body, or the 400 to answer when it cannot be read.
async fn read_body(req: Request<Incoming>) -> Result<Bytes, Response<Body>> {
    match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => Err(json_response(
            StatusCode::BAD_REQUEST,
            &api::error_body(&format!("could not read the request body: {e}"), 400),
        )),
    }
}

fn full(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<Body> {
    let mut r = Response::new(Full::new(body).boxed());
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    full(status, "application/json", Bytes::from(v.to_string()))
}

/// What one generation needs besides the engine ticket.
struct Generation {
    parsed: ParsedRequest,
    meta: ResponseMeta,
    seed: u64,
    min_chunk: Duration,
    /// `--enable-prompt-tokens-details`.
    prompt_tokens_details: bool,
}

impl Generation {
    fn text(&self, from: usize, to: usize) -> String {
        (from..to)
            .map(|i| api::answer_piece(self.seed, i))
            .collect()
    }

    fn usage(&self, hit_tokens: usize) -> Value {
        let cached = self.prompt_tokens_details.then_some(hit_tokens);
        api::usage(self.parsed.prompt.len(), self.parsed.max_tokens, cached)
    }
}

/// `orca_format`: the request's `endpoint-load-metrics-format`, if any. Like
/// vLLM, only a non-streaming OpenAI response (chat or completions) carries
/// the report, taken as the response leaves.
async fn generate(
    shared: &Shared,
    parsed: ParsedRequest,
    orca_format: Option<String>,
) -> Response<Body> {
    let engine = &shared.engine;
    let cfg = engine.config();
    let job = Job {
        prompt: parsed.prompt.clone(),
        max_tokens: parsed.max_tokens,
        first_extra: first_block_extra(&parsed.model, parsed.cache_salt.as_deref()),
        adapter: (cfg.max_loras > 0 && parsed.model != cfg.model).then(|| parsed.model.clone()),
    };
    let mut ticket = match engine.submit(job) {
        Ok(t) => t,
        Err(e) => {
            return json_response(
                StatusCode::BAD_REQUEST,
                &api::error_body(&e.to_string(), 400),
            )
        }
    };
    let n = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let prefix = if parsed.api == ApiKind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let token_bytes: Vec<u8> = parsed.prompt.iter().flat_map(|t| t.to_le_bytes()).collect();
    let gen = Generation {
        meta: ResponseMeta {
            id: format!("{prefix}-{}-{n}", cfg.name),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            model: parsed.model.clone(),
        },
        seed: xxhash_rust::xxh3::xxh3_64(&token_bytes),
        min_chunk: Duration::from_secs_f64(cfg.min_chunk_interval_ms / 1000.0),
        prompt_tokens_details: cfg.prompt_tokens_details,
        parsed,
    };
    if gen.parsed.stream {
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(stream_tokens(ticket, gen, tx));
        let mut r = Response::new(ChannelBody(rx).boxed());
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        r.headers_mut()
            .insert("cache-control", HeaderValue::from_static("no-cache"));
        return r;
    }
    let admission = ticket.admitted().await;
    let outputs = gen.parsed.max_tokens;
    let last_token_at =
        admission.first_token_at + admission.inter_token * (outputs.saturating_sub(1) as u32);
    sleep_until(last_token_at).await;
    let text = gen.text(0, outputs);
    ticket.finish(&tokenizer::tokenize(text.as_bytes()));
    let body = api::full_body(
        gen.parsed.api,
        &gen.meta,
        &text,
        gen.usage(admission.hit_tokens),
    );
    let mut response = json_response(StatusCode::OK, &body);
    let report = orca_format
        .filter(|_| gen.parsed.api != ApiKind::Invoke)
        .and_then(|format| engine.snapshot().orca_report(&format))
        .and_then(|report| HeaderValue::from_str(&report).ok());
    if let Some(report) = report {
        response.headers_mut().insert(ORCA_REPORT_HEADER, report);
    }
    response
}

/// Streams the tokens as they become due; returns early (freeing the
/// request's blocks through the ticket's drop) when the client goes away.
async fn stream_tokens(mut ticket: Ticket, gen: Generation, tx: mpsc::Sender<Bytes>) {
    let admission = tokio::select! {
        a = ticket.admitted() => a,
        _ = tx.closed() => return,
    };
    let send = |s: String| tx.send(Bytes::from(s));
    let total = gen.parsed.max_tokens;
    let first_at = admission.first_token_at;
    let step = admission.inter_token;
    let mut sent = 0;
    let mut last_send = first_at;
    while sent < total {
        // The first token goes alone; later ones as soon as due, but no more
        // often than every `min_chunk`.
        let next_due = first_at + step * (sent as u32);
        let wake = if sent == 0 {
            first_at
        } else {
            next_due.max(last_send + gen.min_chunk)
        };
        tokio::select! {
            _ = sleep_until(wake) => {}
            _ = tx.closed() => return,
        }
        let now = Instant::now();
        let due = if sent == 0 || step.is_zero() {
            if step.is_zero() {
                total
            } else {
                1
            }
        } else {
            let elapsed = now.saturating_duration_since(first_at);
            ((elapsed.as_nanos() / step.as_nanos()) as usize + 1).min(total)
        };
        let due = due.max(sent + 1);
        let chunk = api::stream_chunk(gen.parsed.api, &gen.meta, &gen.text(sent, due), sent == 0);
        if send(api::sse(&chunk)).await.is_err() {
            return;
        }
        sent = due;
        last_send = now;
    }
    // Finish before the tail, so the answer's blocks are cached by the time
    // the client sees the end (vLLM caches them as they fill).
    let text = gen.text(0, total);
    ticket.finish(&tokenizer::tokenize(text.as_bytes()));
    let tail = api::stream_tail(
        gen.parsed.api,
        &gen.meta,
        gen.parsed.include_usage,
        gen.usage(admission.hit_tokens),
    );
    for event in tail {
        if send(api::sse(&event)).await.is_err() {
            return;
        }
    }
    let _ = send(api::SSE_DONE.to_string()).await;
}

/// A response body fed by a channel, ending when the sender is dropped.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}
