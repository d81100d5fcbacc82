//! Request parsing and response bodies of the three APIs, kept apart from the
//! HTTP plumbing so each shape can be tested on its own.
//!
//! - OpenAI chat (`.../chat/completions`): messages rendered with the Llama 3
//!   chat template into tokens; each message's content is tokenised on its
//!   own between special tokens, so a conversation's next turn starts with
//!   exactly the tokens of the previous prompt and answer (multi-turn hits).
//!   Text parts of an array content are tokenised, other parts count as one
//!   media token.
//! - OpenAI completions (`.../completions`): `prompt` as a string, a
//!   one-string array, or an array of token ids.
//! - `/invocations` (any other POST), as vLLM's: a JSON object with
//!   `messages` is a chat request, one with `prompt` a completions request,
//!   each answered in its API's shape. Any other body is a native invoke
//!   (vLLM answers it 400; the benchmarks' invoke workloads send one): the raw
//!   body bytes are the prompt, whatever they are. If the body is JSON, `stream`,
//!   `max_tokens`, `max_new_tokens` or `parameters.max_new_tokens` are honoured.
//!   Responses: `{"generated_text": ..., "usage": {...}}`; streamed as SSE
//!   events `{"text": "..."}` and a last `{"text": "", "finish_reason":
//!   "length", "usage": {...}}`, then `[DONE]`.
//!
//! vLLM's `cache_salt` body field is mixed into block 0 (tenant isolation);
//! the request's `model` (else the served model) too.

use serde_json::{json, Value};

use super::tokenizer::{self, TokenId, BOS, END_HEADER, EOT, MEDIA_PART, START_HEADER};

/// Which API a request used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completions,
    /// Native invoke (`/invocations`).
    Invoke,
}

impl ApiKind {
    /// The API for a POST to `path` (query excluded).
    pub fn from_path(path: &str) -> ApiKind {
        if path.ends_with("/chat/completions") {
            ApiKind::Chat
        } else if path.ends_with("/completions") {
            ApiKind::Completions
        } else {
            ApiKind::Invoke
        }
    }
}

/// A request reduced to what the engine and the response need.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    /// The API used.
    pub api: ApiKind,
    /// Model named by the request, or the served one.
    pub model: String,
    /// Prompt tokens.
    pub prompt: Vec<TokenId>,
    /// Output tokens to produce.
    pub max_tokens: usize,
    /// Server-sent events instead of one JSON body.
    pub stream: bool,
    /// Send usage in the last streamed event (chat/completions; invoke always does).
    pub include_usage: bool,
    /// vLLM's `cache_salt`.
    pub cache_salt: Option<String>,
}

/// A client error, answered with 400 and vLLM's error body.
#[derive(Debug, PartialEq, Eq)]
pub struct BadRequest(pub String);

/// vLLM's error body.
pub fn error_body(message: &str, code: u16) -> Value {
    typed_error_body(message, "BadRequestError", None, code)
}

/// vLLM's error body with its error type and the field at fault.
pub fn typed_error_body(message: &str, err_type: &str, param: Option<&str>, code: u16) -> Value {
    json!({
        "object": "error",
        "message": message,
        "type": err_type,
        "param": param,
        "code": code,
    })
}

fn max_tokens_field(v: &Value) -> Option<usize> {
    ["max_completion_tokens", "max_tokens", "max_new_tokens"]
        .iter()
        .find_map(|k| v.get(*k).and_then(Value::as_u64))
        .or_else(|| {
            v.get("parameters")
                .and_then(|p| p.get("max_new_tokens"))
                .and_then(Value::as_u64)
        })
        .map(|n| n.max(1) as usize)
}

/// Parses a request body for `api`.
pub fn parse(
    api: ApiKind,
    body: &[u8],
    served_model: &str,
    default_max_tokens: usize,
) -> Result<ParsedRequest, BadRequest> {
    if api == ApiKind::Invoke {
        let json: Option<Value> = serde_json::from_slice(body).ok();
        let json = json.as_ref();
        if let Some(shape) = json.and_then(openai_shape) {
            return parse(shape, body, served_model, default_max_tokens);
        }
        return Ok(ParsedRequest {
            api,
            model: served_model.to_string(),
            prompt: tokenizer::tokenize(body),
            max_tokens: json
                .and_then(max_tokens_field)
                .unwrap_or(default_max_tokens),
            stream: json
                .and_then(|v| v.get("stream"))
                .and_then(Value::as_bool)
                .unwrap_or(false),
            include_usage: true,
            cache_salt: None,
        });
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| BadRequest(format!("request body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(BadRequest("request body must be a JSON object".into()));
    }
    let prompt = match api {
        ApiKind::Chat => render_chat(
            v.get("messages")
                .ok_or_else(|| BadRequest("missing field `messages`".into()))?,
        )?,
        _ => render_completion(
            v.get("prompt")
                .ok_or_else(|| BadRequest("missing field `prompt`".into()))?,
        )?,
    };
    Ok(ParsedRequest {
        api,
        model: v
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or(served_model)
            .to_string(),
        prompt,
        max_tokens: max_tokens_field(&v).unwrap_or(default_max_tokens),
        stream: v.get("stream").and_then(Value::as_bool).unwrap_or(false),
        include_usage: v
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        cache_salt: v
            .get("cache_salt")
            .and_then(Value::as_str)
            .map(str::to_string),
    })
}

/// The OpenAI API whose body `v` is, as vLLM's `/invocations` tells them
/// apart (it tries a chat request first).
fn openai_shape(v: &Value) -> Option<ApiKind> {
    if v.get("messages").is_some() {
        Some(ApiKind::Chat)
    } else if v.get("prompt").is_some() {
        Some(ApiKind::Completions)
    } else {
        None
    }
}

/// Llama 3 chat template, rendered to tokens, ending with the assistant header.
fn render_chat(messages: &Value) -> Result<Vec<TokenId>, BadRequest> {
    let messages = messages
        .as_array()
        .ok_or_else(|| BadRequest("`messages` must be an array".into()))?;
    let mut out = vec![BOS];
    let header = |out: &mut Vec<TokenId>, role: &str| {
        out.push(START_HEADER);
        out.extend(tokenizer::tokenize(role.as_bytes()));
        out.push(END_HEADER);
        out.extend(tokenizer::tokenize(b"\n\n"));
    };
    for (i, m) in messages.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| BadRequest(format!("messages[{i}] has no string `role`")))?;
        header(&mut out, role);
        match m.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => out.extend(tokenizer::tokenize(s.as_bytes())),
            Some(Value::Array(parts)) => {
                for part in parts {
                    match part.get("text").and_then(Value::as_str) {
                        Some(text) => out.extend(tokenizer::tokenize(text.as_bytes())),
                        None => out.push(MEDIA_PART),
                    }
                }
            }
            Some(_) => {
                return Err(BadRequest(format!(
                    "messages[{i}].content must be a string or an array of parts"
                )))
            }
        }
        out.push(EOT);
    }
    header(&mut out, "assistant");
    Ok(out)
}

fn render_completion(prompt: &Value) -> Result<Vec<TokenId>, BadRequest> {
    let text_tokens = |s: &str| {
        let mut t = vec![BOS];
        t.extend(tokenizer::tokenize(s.as_bytes()));
        t
    };
    match prompt {
        Value::String(s) => Ok(text_tokens(s)),
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            Ok(text_tokens(items[0].as_str().unwrap_or_default()))
        }
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_u64) => Ok(items
            .iter()
            .filter_map(Value::as_u64)
            .map(|t| t.min(u64::from(u32::MAX)) as TokenId)
            .collect()),
        _ => Err(BadRequest(
            "`prompt` must be a string, a one-string array or an array of token ids".into(),
        )),
    }
}

/// The words the simulator answers with: each is exactly one token with its
/// leading space, so `n` words are `n` tokens.
const ANSWER_WORDS: [&str; 32] = [
    "the", "of", "and", "to", "in", "is", "it", "for", "on", "as", "are", "by", "be", "at", "or",
    "an", "we", "can", "new", "one", "all", "has", "its", "may", "use", "not", "but", "how", "our",
    "way", "who", "own",
];

/// The `i`-th output word of a response seeded by `seed`, with its leading space.
pub fn answer_piece(seed: u64, i: usize) -> String {
    let h = xxhash_rust::xxh3::xxh3_64_with_seed(&(i as u64).to_le_bytes(), seed);
    format!(
        " {}",
        ANSWER_WORDS[(h % ANSWER_WORDS.len() as u64) as usize]
    )
}

/// Usage object as vLLM returns it: `cached_tokens` only where given
/// (`--enable-prompt-tokens-details`).
pub fn usage(
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: Option<usize>,
) -> Value {
    let mut usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    });
    if let Some(cached_tokens) = cached_tokens {
        usage["prompt_tokens_details"] = json!({"cached_tokens": cached_tokens});
    }
    usage
}

/// Fields shared by every body of one response.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// `chatcmpl-...` / `cmpl-...`
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Model echoed back.
    pub model: String,
}

/// A non-streamed response body.
pub fn full_body(api: ApiKind, meta: &ResponseMeta, text: &str, usage: Value) -> Value {
    match api {
        ApiKind::Chat => json!({
            "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": null, "finish_reason": "length"}],
            "usage": usage,
        }),
        ApiKind::Completions => json!({
            "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}],
            "usage": usage,
        }),
        ApiKind::Invoke => json!({"generated_text": text, "usage": usage}),
    }
}

/// One streamed event carrying `text` (the first chat event also carries the role).
pub fn stream_chunk(api: ApiKind, meta: &ResponseMeta, text: &str, first: bool) -> Value {
    match api {
        ApiKind::Chat => {
            let delta = if first {
                json!({"role": "assistant", "content": text})
            } else {
                json!({"content": text})
            };
            json!({
                "id": meta.id, "object": "chat.completion.chunk", "created": meta.created,
                "model": meta.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}],
            })
        }
        ApiKind::Completions => json!({
            "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": null}],
        }),
        ApiKind::Invoke => json!({"text": text}),
    }
}

/// The streamed events after the last token: a finish event, then usage if asked.
pub fn stream_tail(
    api: ApiKind,
    meta: &ResponseMeta,
    include_usage: bool,
    usage: Value,
) -> Vec<Value> {
    match api {
        ApiKind::Invoke => vec![json!({"text": "", "finish_reason": "length", "usage": usage})],
        ApiKind::Chat | ApiKind::Completions => {
            let (object, choice) = if api == ApiKind::Chat {
                (
                    "chat.completion.chunk",
                    json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "length"}),
                )
            } else {
                (
                    "text_completion",
                    json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}),
                )
            };
            let mut out = vec![json!({
                "id": meta.id, "object": object, "created": meta.created, "model": meta.model,
                "choices": [choice],
            })];
            if include_usage {
                out.push(json!({
                    "id": meta.id, "object": object, "created": meta.created, "model": meta.model,
                    "choices": [], "usage": usage,
                }));
            }
            out
        }
    }
}

/// One SSE event.
pub fn sse(data: &Value) -> String {
    format!("data: {data}\n\n")
}

/// The SSE end marker.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_classify_by_suffix() {
        assert_eq!(ApiKind::from_path("/v1/chat/completions"), ApiKind::Chat);
        assert_eq!(
            ApiKind::from_path("/endpoints/x/openai/v1/chat/completions"),
            ApiKind::Chat
        );
        assert_eq!(ApiKind::from_path("/v1/completions"), ApiKind::Completions);
        assert_eq!(ApiKind::from_path("/invocations"), ApiKind::Invoke);
    }

    #[test]
    fn chat_fields_are_read() {
        let body = br#"{"model":"m1","messages":[{"role":"user","content":"hello there"}],
            "max_tokens":7,"stream":true,"stream_options":{"include_usage":true},"cache_salt":"s"}"#;
        let p = parse(ApiKind::Chat, body, "served", 99).unwrap();
        assert_eq!(p.model, "m1");
        assert_eq!(p.max_tokens, 7);
        assert!(p.stream && p.include_usage);
        assert_eq!(p.cache_salt.as_deref(), Some("s"));
        // BOS, header(user)+"\n\n" (4), "hello there" (2 + 2), EOT, header(assistant)+"\n\n" (6).
        assert_eq!(p.prompt.len(), 1 + 4 + 4 + 1 + 6);
    }

    #[test]
    fn next_turn_starts_with_previous_prompt_and_answer() {
        let answer: String = (0..40).map(|i| answer_piece(5, i)).collect();
        assert_eq!(tokenizer::count_tokens(answer.as_bytes()), 40);
        let turn1 = json!({"messages": [{"role": "user", "content": "What is a KV cache?"}]});
        let turn2 = json!({"messages": [
            {"role": "user", "content": "What is a KV cache?"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And prefix caching?"}]});
        let p1 = parse(ApiKind::Chat, turn1.to_string().as_bytes(), "m", 1).unwrap();
        let p2 = parse(ApiKind::Chat, turn2.to_string().as_bytes(), "m", 1).unwrap();
        let mut expected = p1.prompt.clone();
        expected.extend(tokenizer::tokenize(answer.as_bytes()));
        assert_eq!(&p2.prompt[..expected.len()], &expected[..]);
    }

    #[test]
    fn invoke_takes_any_other_body_as_its_raw_bytes() {
        let raw = parse(ApiKind::Invoke, b"\xff\xfe not json", "m", 12).unwrap();
        assert_eq!(raw.max_tokens, 12);
        assert!(!raw.stream);
        assert_eq!(raw.prompt, tokenizer::tokenize(b"\xff\xfe not json"));
        let body = br#"{"inputs":"abc","parameters":{"max_new_tokens":3},"stream":true}"#;
        let j = parse(ApiKind::Invoke, body, "m", 12).unwrap();
        assert_eq!(j.api, ApiKind::Invoke);
        assert_eq!(j.max_tokens, 3);
        assert!(j.stream);
        assert_eq!(j.prompt, tokenizer::tokenize(body));
    }

    #[test]
    fn invocations_answers_an_openai_body_in_its_apis_shape() {
        let chat = br#"{"model":"m1","messages":[{"role":"user","content":"hello there"}],"max_tokens":7}"#;
        let on_invoke = parse(ApiKind::Invoke, chat, "m", 12).unwrap();
        let on_chat = parse(ApiKind::Chat, chat, "m", 12).unwrap();
        assert_eq!(on_invoke.api, ApiKind::Chat);
        assert_eq!(
            (on_invoke.prompt, on_invoke.model, on_invoke.max_tokens),
            (on_chat.prompt, on_chat.model, on_chat.max_tokens)
        );
        let completion = br#"{"prompt":"Once upon a time","max_tokens":5}"#;
        let on_invoke = parse(ApiKind::Invoke, completion, "m", 12).unwrap();
        assert_eq!(on_invoke.api, ApiKind::Completions);
        assert_eq!(
            on_invoke.prompt,
            parse(ApiKind::Completions, completion, "m", 12)
                .unwrap()
                .prompt
        );
        assert_eq!(on_invoke.max_tokens, 5);
        // An OpenAI-shaped body that is not valid for its API is a 400, as in vLLM.
        assert!(parse(ApiKind::Invoke, br#"{"prompt":{}}"#, "m", 1).is_err());
    }

    #[test]
    fn bad_openai_bodies_are_400s() {
        assert!(parse(ApiKind::Chat, b"{", "m", 1).is_err());
        assert!(parse(ApiKind::Chat, b"[]", "m", 1).is_err());
        assert!(parse(ApiKind::Chat, br#"{"messages":"x"}"#, "m", 1).is_err());
        assert!(parse(ApiKind::Chat, br#"{"messages":[{"content":"x"}]}"#, "m", 1).is_err());
        assert!(parse(ApiKind::Completions, br#"{"prompt":{}}"#, "m", 1).is_err());
        let ids = parse(ApiKind::Completions, br#"{"prompt":[1,2,3]}"#, "m", 1).unwrap();
        assert_eq!(ids.prompt, vec![1, 2, 3]);
    }
}
