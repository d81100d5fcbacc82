//! Sends one request and measures it: time to the first content event of a
//! stream, end-to-end latency, the serving instance (`x-served-by`), and the
//! token usage the server reports (final SSE event or JSON body).
//!
//! Understands the three response shapes of [`crate::sim::api`] (OpenAI chat,
//! OpenAI completions, native invoke), which are also vLLM's.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::time::Instant;

/// The pooled HTTP/1.1 client the load generator uses.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A client with keep-alive pooling and `TCP_NODELAY`.
pub fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector)
}

/// Token counts from a response's `usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// `prompt_tokens`
    pub prompt_tokens: u64,
    /// `completion_tokens`
    pub completion_tokens: u64,
    /// `prompt_tokens_details.cached_tokens` (0 when absent)
    pub cached_tokens: u64,
}

/// What one request did.
#[derive(Debug, Clone, Default)]
pub struct Exchange {
    /// HTTP status, if a response arrived.
    pub status: Option<u16>,
    /// `x-served-by`
    pub instance: Option<String>,
    /// Time to the first non-empty content (for a non-streamed response, the whole response).
    pub first_content: Option<Duration>,
    /// Time to the end of the response (or the failure).
    pub latency: Duration,
    /// Usage, if the server sent it.
    pub usage: Option<Usage>,
    /// The generated text.
    pub content: String,
    /// Why the request failed, if it did.
    pub error: Option<String>,
}

fn usage_of(v: &Value) -> Option<Usage> {
    let u = v.get("usage")?;
    if !u.is_object() {
        return None;
    }
    let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
    Some(Usage {
        prompt_tokens: n("prompt_tokens"),
        completion_tokens: n("completion_tokens"),
        cached_tokens: u
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(0),
    })
}

/// The text an event or body carries, whichever API shaped it.
fn content_of(v: &Value) -> Option<&str> {
    if let Some(choice) = v.get("choices").and_then(|c| c.get(0)) {
        return choice
            .get("delta")
            .and_then(|d| d.get("content"))
            .or_else(|| choice.get("message").and_then(|m| m.get("content")))
            .or_else(|| choice.get("text"))
            .and_then(Value::as_str);
    }
    v.get("text")
        .or_else(|| v.get("generated_text"))
        .or_else(|| v.get("token").and_then(|t| t.get("text")))
        .and_then(Value::as_str)
}

/// Incremental server-sent-events parsing: feed bytes, get `data:` payloads.
#[derive(Default)]
pub struct SseParser {
    buf: BytesMut,
}

impl SseParser {
    /// Appends `bytes` and returns the data of every event completed by them.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(end) = find_event_end(&self.buf) {
            let raw = self.buf.split_to(end.0 + end.1);
            let text = String::from_utf8_lossy(&raw[..end.0]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                events.push(data.join("\n"));
            }
        }
        events
    }
}

/// Position and length of the first blank-line event terminator.
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// Sends `body` to `uri` and reads the whole response, within `timeout`.
pub async fn exchange(
    client: &HttpClient,
    uri: &Uri,
    headers: &[(HeaderName, HeaderValue)],
    body: Bytes,
    stream: bool,
    timeout: Duration,
) -> Exchange {
    let start = Instant::now();
    let mut ex = Exchange::default();
    let result = tokio::time::timeout(
        timeout,
        run(client, uri, headers, body, stream, start, &mut ex),
    )
    .await;
    ex.latency = start.elapsed();
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => ex.error = Some(e),
        Err(_) => ex.error = Some(format!("timeout after {} ms", timeout.as_millis())),
    }
    ex
}

async fn run(
    client: &HttpClient,
    uri: &Uri,
    headers: &[(HeaderName, HeaderValue)],
    body: Bytes,
    stream: bool,
    start: Instant,
    ex: &mut Exchange,
) -> Result<(), String> {
    let mut req = Request::builder().method(Method::POST).uri(uri.clone());
    for (k, v) in headers {
        req = req.header(k, v);
    }
    let req = req
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| format!("building the request: {e}"))?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| format!("connection: {e}"))?;
    ex.status = Some(resp.status().as_u16());
    ex.instance = resp
        .headers()
        .get("x-served-by")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let is_sse = resp
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    let ok = resp.status().is_success();
    let mut body = resp.into_body();
    if !ok || !stream || !is_sse {
        let bytes = body
            .collect()
            .await
            .map_err(|e| format!("reading the body: {e}"))?
            .to_bytes();
        if !ok {
            let snippet = String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned();
            return Err(format!("http {}: {snippet}", ex.status.unwrap_or(0)));
        }
        let v: Value =
            serde_json::from_slice(&bytes).map_err(|e| format!("response is not JSON: {e}"))?;
        ex.first_content = Some(start.elapsed());
        ex.usage = usage_of(&v);
        ex.content = content_of(&v).unwrap_or_default().to_string();
        return Ok(());
    }
    let mut parser = SseParser::default();
    let mut done = false;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("reading the stream: {e}"))?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        for event in parser.feed(data) {
            if event.trim() == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(&event) else {
                return Err(format!("stream event is not JSON: {event}"));
            };
            if let Some(text) = content_of(&v) {
                if !text.is_empty() && ex.first_content.is_none() {
                    ex.first_content = Some(start.elapsed());
                }
                ex.content.push_str(text);
            }
            if let Some(u) = usage_of(&v) {
                ex.usage = Some(u);
            }
            if v.get("error").is_some() || v.get("object").and_then(Value::as_str) == Some("error")
            {
                return Err(format!("error event: {event}"));
            }
        }
    }
    if !done {
        return Err("stream ended without [DONE]".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sse_events_split_across_reads() {
        let mut p = SseParser::default();
        assert!(p.feed(b"data: {\"a\"").is_empty());
        assert_eq!(p.feed(b":1}\n\ndata: [DONE]\n"), vec!["{\"a\":1}"]);
        assert_eq!(p.feed(b"\n: comment\n\r\n\r\n"), vec!["[DONE]"]);
        assert!(p.feed(b"event: ping\n\n").is_empty());
    }

    #[test]
    fn content_and_usage_of_each_shape() {
        let chat = json!({"choices":[{"delta":{"content":" hi"}}]});
        let chat_full = json!({"choices":[{"message":{"content":"x y"}}],
            "usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}});
        let cmpl = json!({"choices":[{"text":" yo"}]});
        let invoke = json!({"text":" a"});
        let invoke_full =
            json!({"generated_text":"abc","usage":{"prompt_tokens":3,"completion_tokens":1}});
        assert_eq!(content_of(&chat), Some(" hi"));
        assert_eq!(content_of(&chat_full), Some("x y"));
        assert_eq!(content_of(&cmpl), Some(" yo"));
        assert_eq!(content_of(&invoke), Some(" a"));
        assert_eq!(content_of(&invoke_full), Some("abc"));
        assert_eq!(
            usage_of(&chat_full),
            Some(Usage {
                prompt_tokens: 10,
                completion_tokens: 2,
                cached_tokens: 8
            })
        );
        assert_eq!(usage_of(&invoke_full).unwrap().cached_tokens, 0);
        assert_eq!(usage_of(&json!({"usage": null})), None);
    }
}
