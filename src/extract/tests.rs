//! Behaviour of the extractor as the filter sees it: what prefix a body
//! yields, when `Done` comes, and that neither depends on chunking.
//!
//! Every body goes through [`extract`], which feeds it whole, byte by byte,
//! in fixed-size pieces and in random splits, and fails unless all give the
//! same `Extraction`, so chunking invariance is checked by every test.

use super::*;
use serde_json::{json, Value};

const US: char = '\u{1f}';
const RS: char = '\u{1e}';

/// Small deterministic PRNG (xorshift64*) so property tests are reproducible.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

fn limits(prefix_length: usize) -> Limits {
    Limits {
        prefix_length,
        max_body_bytes: 1 << 20,
        include_model: true,
        want_body_tenant: true,
    }
}

/// Feeds `body` split at `cuts` (sorted offsets); stops feeding after `Done`
/// as the filter does, and checks no `NeedMore` follows a `Done`.
fn feed_split(mut x: Extractor, body: &[u8], cuts: &[usize]) -> Extraction {
    let mut start = 0;
    for &cut in cuts.iter().chain(std::iter::once(&body.len())) {
        let cut = cut.clamp(start, body.len());
        if x.feed(&body[start..cut]) == Progress::Done {
            // Feeding more after Done changes nothing.
            assert_eq!(x.feed(&body[cut..]), Progress::Done);
            break;
        }
        start = cut;
    }
    x.finish()
}

fn feed_pieces(x: Extractor, body: &[u8], size: usize) -> Extraction {
    let cuts: Vec<usize> = (size..body.len()).step_by(size).collect();
    feed_split(x, body, &cuts)
}

/// The extraction of `body`, asserting it is the same for many chunkings.
fn extract(kind: ApiKind, limits: Limits, body: &[u8]) -> Extraction {
    extract_with(|| Extractor::new(kind, limits), body)
}

/// [`extract`] with the extractors `new` makes (one per chunking).
fn extract_with(new: impl Fn() -> Extractor, body: &[u8]) -> Extraction {
    let whole = feed_split(new(), body, &[]);
    let mut sizes = vec![1, 2, 3, 7, 64, 4096];
    if body.len() > 20_000 {
        sizes.retain(|&s| s > 2);
    }
    for size in sizes {
        let got = feed_pieces(new(), body, size);
        assert_eq!(got, whole, "pieces of {size} differ from one piece");
    }
    let mut rng = Rng::new(body.len() as u64);
    for _ in 0..8 {
        let mut cuts: Vec<usize> = (0..rng.below(12))
            .map(|_| rng.below(body.len() + 1))
            .collect();
        cuts.sort_unstable();
        let got = feed_split(new(), body, &cuts);
        assert_eq!(got, whole, "split at {cuts:?} differs from one piece");
    }
    whole
}

fn chat(body: &Value) -> Extraction {
    extract(
        ApiKind::ChatCompletions,
        limits(4096),
        body.to_string().as_bytes(),
    )
}

fn text(e: &Extraction) -> String {
    assert_eq!(e.source, PrefixSource::CanonicalText, "{e:?}");
    String::from_utf8(e.prefix.clone()).expect("canonical prefix is UTF-8")
}

/// Canonical text written readably: `|` for US, `;` for RS.
fn readable(e: &Extraction) -> String {
    text(e).replace(US, "|").replace(RS, ";")
}

// ---------------------------------------------------------------- invoke

#[test]
fn invoke_prefix_is_the_first_bytes_and_done_comes_as_soon_as_they_are_in() {
    let body: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    let e = extract(ApiKind::Invoke, limits(4096), &body);
    assert_eq!(e.prefix, &body[..4096]);
    assert_eq!(e.source, PrefixSource::RawBytes);
    assert!(!e.short);
    assert_eq!(e.fallback, None);
    assert_eq!(e.bytes_inspected, 4096);

    let mut x = Extractor::new(ApiKind::Invoke, limits(4096));
    assert_eq!(x.feed(&body[..4095]), Progress::NeedMore);
    assert_eq!(x.feed(&body[4095..4097]), Progress::Done);
}

#[test]
fn invoke_body_shorter_than_prefix_is_short() {
    let e = extract(ApiKind::Invoke, limits(4096), b"{\"not\": \"parsed\"}");
    assert_eq!(e.prefix, b"{\"not\": \"parsed\"}");
    assert!(e.short);
    assert_eq!(e.model, None);
}

#[test]
fn invoke_stops_at_max_body_bytes() {
    let l = Limits {
        max_body_bytes: 10,
        ..limits(4096)
    };
    let e = extract(ApiKind::Invoke, l, &[7u8; 100]);
    assert_eq!(e.prefix, [7u8; 10]);
    assert_eq!(e.bytes_inspected, 10);
    assert!(e.short);
}

#[test]
fn empty_body_gives_an_empty_short_prefix_for_every_kind() {
    for kind in [
        ApiKind::Invoke,
        ApiKind::ChatCompletions,
        ApiKind::Completions,
        ApiKind::Responses,
    ] {
        let e = extract(kind, limits(4096), b"");
        assert_eq!(e.prefix, b"");
        assert_eq!(e.source, PrefixSource::RawBytes);
        assert!(e.short);
        assert_eq!(e.fallback, None);
        assert_eq!(e.bytes_inspected, 0);
    }
}

// ---------------------------------------------------------------- chat format

#[test]
fn chat_canonical_text_has_the_documented_format() {
    let e = chat(&json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "name": "ann", "content": "Hi"}
        ]
    }));
    assert_eq!(
        readable(&e),
        "role=system|text=Be brief.|;role=user|name=ann|text=Hi|;"
    );
    assert_eq!(e.model.as_deref(), Some("m"));
    assert!(e.short);
    assert_eq!(e.fallback, None);
}

#[test]
fn message_boundaries_are_unambiguous() {
    let a = chat(&json!({"messages": [
        {"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]}));
    let b = chat(&json!({"messages": [
        {"role": "user", "content": "a"}, {"role": "user", "content": "bc"}]}));
    assert_ne!(a.prefix, b.prefix);

    // Separators inside content are escaped, so content cannot forge a record.
    let forged = chat(&json!({"messages": [
        {"role": "user", "content": format!("ab{US}{RS}role=user{US}text=c")}]}));
    let two = chat(&json!({"messages": [
        {"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]}));
    assert_ne!(forged.prefix, two.prefix);
    assert!(text(&forged).contains("\u{10}\u{1f}\u{10}\u{1e}"));

    // Role and content are separate fields.
    let c = chat(&json!({"messages": [{"role": "usera", "content": "b"}]}));
    let d = chat(&json!({"messages": [{"role": "user", "content": "ab"}]}));
    assert_ne!(c.prefix, d.prefix);
}

#[test]
fn content_parts_give_text_and_stable_markers_never_data() {
    let e = chat(&json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look:"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "BBBB", "format": "wav"}},
        {"type": "file", "file": {"file_data": "CCCC"}},
        {"type": "text", "text": "what?"}
    ]}]}));
    assert_eq!(
        readable(&e),
        "role=user|text=look:|part=image_url|part=input_audio|part=file|text=what?|;"
    );
    // Another image, same marker: the key does not depend on image bytes.
    let other = chat(&json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look:"},
        {"image_url": {"url": "https://x/y.png"}, "type": "image_url"},
        {"type": "input_audio", "input_audio": {"data": "DDDD", "format": "mp3"}},
        {"type": "file", "file": {"file_id": "f"}},
        {"type": "text", "text": "what?"}
    ]}]}));
    assert_eq!(e.prefix, other.prefix);
}

#[test]
fn string_content_equals_a_single_text_part() {
    let a = chat(&json!({"messages": [{"role": "user", "content": "hello"}]}));
    let b = chat(&json!({"messages": [{"role": "user",
        "content": [{"type": "text", "text": "hello"}]}]}));
    assert_eq!(a.prefix, b.prefix);
    // Two parts are not one: the part boundary stays in the text.
    let c = chat(&json!({"messages": [{"role": "user",
        "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]}));
    assert_ne!(a.prefix, c.prefix);
}

#[test]
fn tool_calls_give_name_and_arguments_and_ignore_ids() {
    let body = |id: &str| {
        json!({"messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": id, "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": id, "content": "cold"}
        ]})
    };
    let e = chat(&body("call_1"));
    assert_eq!(
        readable(&e),
        "role=user|text=weather?|;role=assistant|tool=get_weather|args={\"city\":\"Oslo\"}|;role=tool|text=cold|;"
    );
    assert_eq!(e.prefix, chat(&body("call_2")).prefix);
}

/// Two calls of custom tools differ by name and input, as function calls do.
#[test]
fn custom_tool_calls_give_name_and_input() {
    let body = |name: &str, input: &str| {
        json!({"messages": [
            {"role": "user", "content": "run it"},
            {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "custom", "custom": {"name": name, "input": input}}]}
        ]})
    };
    let e = chat(&body("shell", "ls"));
    assert_eq!(
        readable(&e),
        "role=user|text=run it|;role=assistant|custom=shell|input=ls|;"
    );
    assert_ne!(e.prefix, chat(&body("shell", "pwd")).prefix);
    assert_ne!(e.prefix, chat(&body("sql", "ls")).prefix);
    // Neither kind: its type alone, as before.
    let other = json!({"messages": [{"role": "assistant", "tool_calls": [{"type": "mcp"}]}]});
    assert_eq!(readable(&chat(&other)), "role=assistant|part=mcp|;");
}

// ---------------------------------------------------------------- canonical

/// Writes `value` as JSON with shuffled keys, random whitespace and,
/// optionally, every non-ASCII character and `/` escaped.
fn write_variant(value: &Value, rng: &mut Rng, escape: bool, out: &mut String) {
    let ws = |rng: &mut Rng, out: &mut String| {
        for _ in 0..rng.below(3) {
            out.push([' ', '\n', '\t', '\r'][rng.below(4)]);
        }
    };
    let string = |s: &str, out: &mut String| {
        let plain = serde_json::to_string(s).unwrap();
        if !escape {
            out.push_str(&plain);
            return;
        }
        for c in plain.chars() {
            if c == '/' {
                out.push_str("\\/");
            } else if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    };
    ws(rng, out);
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            for i in (1..entries.len()).rev() {
                entries.swap(i, rng.below(i + 1));
            }
            out.push('{');
            for (n, (k, v)) in entries.into_iter().enumerate() {
                if n > 0 {
                    out.push(',');
                }
                ws(rng, out);
                string(k, out);
                ws(rng, out);
                out.push(':');
                write_variant(v, rng, escape, out);
            }
            ws(rng, out);
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (n, v) in items.iter().enumerate() {
                if n > 0 {
                    out.push(',');
                }
                write_variant(v, rng, escape, out);
            }
            ws(rng, out);
            out.push(']');
        }
        Value::String(s) => string(s, out),
        other => out.push_str(&other.to_string()),
    }
    ws(rng, out);
}

fn variants(value: &Value, seed: u64) -> Vec<String> {
    let mut rng = Rng::new(seed);
    let mut out = vec![
        value.to_string(),
        serde_json::to_string_pretty(value).unwrap(),
    ];
    for n in 0..6 {
        let mut s = String::new();
        write_variant(value, &mut rng, n % 2 == 1, &mut s);
        out.push(s);
    }
    out
}

#[test]
fn whitespace_key_order_and_escapes_do_not_change_the_prefix() {
    let conversation = json!({
        "model": "llama/3",
        "temperature": 0.5,
        "prompt_cache_key": "tenant/é",
        "messages": [
            {"role": "system", "content": "Réponds en français. 🚀 a/b \"q\" \\ \n tab\t"},
            {"role": "user", "name": "zoë", "content": [
                {"type": "text", "text": "日本語のテキスト"},
                {"type": "image_url", "image_url": {"url": "https://e/x.png", "detail": "low"}}
            ]},
            {"role": "assistant", "content": "ok", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
        ],
        "stream": false
    });
    let bodies = variants(&conversation, 1);
    assert!(
        bodies[3].contains("\\u00e9") && bodies[3].contains("\\/"),
        "{}",
        bodies[3]
    );
    let first = chat(&conversation);
    assert!(text(&first).starts_with("role=system|text=Réponds".replace('|', "\u{1f}").as_str()));
    for body in &bodies {
        for prefix_length in [1, 5, 37, 80, 4096] {
            let l = limits(prefix_length);
            let one = extract(
                ApiKind::ChatCompletions,
                l,
                conversation.to_string().as_bytes(),
            );
            let e = extract(ApiKind::ChatCompletions, l, body.as_bytes());
            assert_eq!(e.prefix, one.prefix, "{body}");
            assert_eq!(e.source, PrefixSource::CanonicalText);
            assert_eq!(e.model.as_deref(), Some("llama/3"));
            assert_eq!(e.body_tenant.as_deref(), Some("tenant/é"));
            assert_eq!(e.short, one.short);
        }
    }
}

#[test]
fn a_multi_byte_character_is_never_split_at_prefix_length() {
    // "é" is 2 bytes, "🚀" 4 bytes; the cut must land on whole characters.
    let content = "aé🚀".repeat(50);
    let body = json!({"messages": [{"role": "user", "content": content}]});
    let header = "role=user\u{1f}text=".chars().count();
    for prefix_length in header..header + 12 {
        let e = extract(
            ApiKind::ChatCompletions,
            limits(prefix_length),
            body.to_string().as_bytes(),
        );
        let t = text(&e);
        assert_eq!(t.chars().count(), prefix_length);
        let expected: String = "role=user\u{1f}text="
            .chars()
            .chain(content.chars())
            .take(prefix_length)
            .collect();
        assert_eq!(t, expected);
        assert!(!e.short);
    }
}

#[test]
fn prefix_length_counts_characters_not_bytes() {
    let body = json!({"messages": [{"role": "user", "content": "é".repeat(5000)}]});
    let e = extract(
        ApiKind::ChatCompletions,
        limits(4096),
        body.to_string().as_bytes(),
    );
    assert_eq!(text(&e).chars().count(), 4096);
    assert!(e.prefix.len() > 4096);
}

// ---------------------------------------------------------------- completions

fn completion(body: &Value) -> Extraction {
    extract(
        ApiKind::Completions,
        limits(4096),
        body.to_string().as_bytes(),
    )
}

#[test]
fn completions_prompt_strings_and_token_ids() {
    assert_eq!(
        readable(&completion(&json!({"prompt": "Once"}))),
        "text=Once|;"
    );
    assert_eq!(
        completion(&json!({"prompt": "Once"})).prefix,
        completion(&json!({"prompt": ["Once"]})).prefix
    );
    assert_eq!(
        readable(&completion(&json!({"prompt": ["a", "b"]}))),
        "text=a|;text=b|;"
    );
    assert_eq!(
        readable(&completion(&json!({"prompt": [1, 22, 333]}))),
        "tokens=1 22 333|;"
    );
    assert_eq!(
        readable(&completion(&json!({"prompt": [[1, 2], [3]]}))),
        "tokens=1 2|;tokens=3|;"
    );
    // Token ids never collide with a text that reads the same.
    assert_ne!(
        completion(&json!({"prompt": [1, 2]})).prefix,
        completion(&json!({"prompt": "1 2"})).prefix
    );
    assert_eq!(readable(&completion(&json!({"prompt": []}))), "");
}

#[test]
fn completions_prompt_of_the_wrong_shape_falls_back() {
    for body in [
        json!({"prompt": ["a", 1]}),
        json!({"prompt": [1, "a"]}),
        json!({"prompt": [-1]}),
        json!({"prompt": [1.5]}),
        json!({"prompt": [[1, "x"]]}),
        json!({"prompt": null}),
        json!({"prompt": {"text": "a"}}),
        json!({"model": "m"}),
    ] {
        let e = completion(&body);
        assert_eq!(e.fallback, Some(FallbackReason::UnexpectedShape), "{body}");
        assert_eq!(e.source, PrefixSource::RawBytes);
        assert_eq!(e.prefix, body.to_string().as_bytes());
    }
}

// ---------------------------------------------------------------- responses

fn responses(body: &str) -> Extraction {
    extract(ApiKind::Responses, limits(4096), body.as_bytes())
}

#[test]
fn responses_instructions_come_first_whatever_the_key_order() {
    let a = responses(r#"{"instructions":"Be kind.","input":"Hi"}"#);
    let b = responses(r#"{"input":"Hi","model":"m","instructions":"Be kind."}"#);
    assert_eq!(readable(&a), "instructions=Be kind.|;role=user|text=Hi|;");
    assert_eq!(a.prefix, b.prefix);
    // A string input is a user message.
    let c = responses(r#"{"instructions":"Be kind.","input":[{"role":"user","content":"Hi"}]}"#);
    assert_eq!(a.prefix, c.prefix);
    let d = responses(r#"{"input":"Hi"}"#);
    assert_eq!(readable(&d), "role=user|text=Hi|;");
    let e = responses(r#"{"instructions":null,"input":"Hi"}"#);
    assert_eq!(d.prefix, e.prefix);
}

#[test]
fn responses_items_and_parts() {
    let e = responses(
        r#"{"input":[
            {"type":"message","role":"user","content":[
                {"type":"input_text","text":"see"},
                {"type":"input_image","image_url":"data:xyz"}]},
            {"type":"function_call","call_id":"c1","name":"f","arguments":"{\"a\":1}"},
            {"type":"function_call_output","call_id":"c1","output":"42"},
            {"type":"custom_tool_call","call_id":"c2","name":"sh","input":"ls"},
            {"type":"custom_tool_call_output","call_id":"c2","output":"a.txt"},
            {"type":"reasoning","summary":[]},
            {"role":"assistant","content":[{"type":"output_text","text":"done","annotations":[]}]}
        ]}"#,
    );
    assert_eq!(
        readable(&e),
        "role=user|text=see|part=input_image|;\
         item=function_call|tool=f|args={\"a\":1}|;\
         item=function_call_output|text=42|;\
         item=custom_tool_call|custom=sh|input=ls|;\
         item=custom_tool_call_output|text=a.txt|;\
         item=reasoning|;\
         role=assistant|text=done|;"
    );
}

#[test]
fn responses_input_before_instructions_waits_for_the_end_of_the_object() {
    let l = limits(10);
    let body = br#"{"input":"a long enough input","tools":[],"instructions":"I"}"#;
    let e = extract(ApiKind::Responses, l, body);
    assert_eq!(readable(&e), "instructio");
    assert_eq!(e.bytes_inspected, body.len());
}

#[test]
fn responses_without_input_or_instructions_falls_back() {
    let e = responses(r#"{"model":"m","previous_response_id":"r"}"#);
    assert_eq!(e.fallback, Some(FallbackReason::UnexpectedShape));
}

// ---------------------------------------------------------------- model, tenant

#[test]
fn model_and_prompt_cache_key_are_read_anywhere_when_asked_for() {
    let body =
        br#"{"messages":[{"role":"user","content":"x"}],"prompt_cache_key":"t1","model":"m1"}"#;
    let e = extract(ApiKind::ChatCompletions, limits(4096), body);
    assert_eq!(e.model.as_deref(), Some("m1"));
    assert_eq!(e.body_tenant.as_deref(), Some("t1"));

    let l = Limits {
        include_model: false,
        want_body_tenant: false,
        ..limits(4096)
    };
    let e = extract(ApiKind::ChatCompletions, l, body);
    assert_eq!(e.model, None);
    assert_eq!(e.body_tenant, None);
    assert_eq!(readable(&e), "role=user|text=x|;");

    let e = extract(
        ApiKind::ChatCompletions,
        limits(4096),
        br#"{"messages":[],"model":null}"#,
    );
    assert_eq!(e.model, None);
    assert_eq!(e.fallback, None);

    let e = extract(
        ApiKind::ChatCompletions,
        limits(4096),
        br#"{"messages":[],"model":7}"#,
    );
    assert_eq!(e.fallback, Some(FallbackReason::UnexpectedShape));
    // Not asked for, a number model is just another field.
    let l = Limits {
        include_model: false,
        ..limits(4096)
    };
    let e = extract(ApiKind::ChatCompletions, l, br#"{"messages":[],"model":7}"#);
    assert_eq!(e.fallback, None);
}

// ---------------------------------------------------------------- early Done

#[test]
fn done_as_soon_as_prefix_model_and_tenant_are_known() {
    let head =
        r#"{"model":"m","prompt_cache_key":"t","messages":[{"role":"user","content":"0123456789"}"#;
    let body = format!(
        r#"{head},{{"role":"user","content":"{}"}}],"x":1}}"#,
        "z".repeat(10_000)
    );
    let e = extract(ApiKind::ChatCompletions, limits(20), body.as_bytes());
    assert_eq!(
        e.bytes_inspected,
        head.len(),
        "stops after the first message"
    );
    assert_eq!(readable(&e), "role=user|text=01234");
    assert_eq!(e.model.as_deref(), Some("m"));

    let mut x = Extractor::new(ApiKind::ChatCompletions, limits(20));
    assert_eq!(
        x.feed(&body.as_bytes()[..head.len() - 1]),
        Progress::NeedMore
    );
    assert_eq!(x.feed(&body.as_bytes()[head.len() - 1..]), Progress::Done);
}

#[test]
fn done_waits_for_a_model_that_comes_later_or_the_end_of_the_object() {
    let l = Limits {
        want_body_tenant: false,
        ..limits(20)
    };
    let body = format!(
        r#"{{"messages":[{{"role":"user","content":"{}"}}],"stream":true,"model":"m"}}  "#,
        "z".repeat(100)
    );
    let e = extract(ApiKind::ChatCompletions, l, body.as_bytes());
    assert_eq!(
        e.bytes_inspected,
        body.trim_end().len() - 1,
        "done right after the model"
    );
    assert_eq!(e.model.as_deref(), Some("m"));

    let no_model = format!(
        r#"{{"messages":[{{"role":"user","content":"{}"}}],"stream":true}}  "#,
        "z".repeat(100)
    );
    let e = extract(ApiKind::ChatCompletions, l, no_model.as_bytes());
    assert_eq!(
        e.bytes_inspected,
        no_model.trim_end().len(),
        "done at the closing brace"
    );
    assert_eq!(e.model, None);
    assert!(!e.short);
}

#[test]
fn without_model_or_tenant_wanted_done_comes_right_after_the_prefix() {
    let l = Limits {
        include_model: false,
        want_body_tenant: false,
        ..limits(12)
    };
    let body = br#"{"messages":[{"role":"user","content":"abc"},{"role":"user","content":"d"}],"model":"m"}"#;
    let e = extract(ApiKind::ChatCompletions, l, body);
    assert_eq!(
        e.bytes_inspected,
        r#"{"messages":[{"role":"user","content":"abc"}"#.len()
    );
}

// ---------------------------------------------------------------- max_body_bytes

#[test]
fn limit_cut_routes_on_the_text_found_so_far() {
    let first = r#"{"messages":[{"role":"user","content":"first"}"#;
    let body = format!(
        r#"{first},{{"role":"user","content":"{}"}}],"model":"m"}}"#,
        "z".repeat(5000)
    );
    let l = Limits {
        max_body_bytes: first.len() + 100,
        ..limits(4096)
    };
    let e = extract(ApiKind::ChatCompletions, l, body.as_bytes());
    assert_eq!(readable(&e), "role=user|text=first|;");
    assert_eq!(e.bytes_inspected, first.len() + 100);
    assert!(e.short);
    assert_eq!(e.fallback, None);
    assert_eq!(e.model, None, "the model lay past the limit");
}

#[test]
fn limit_cut_before_any_text_falls_back_to_raw_bytes() {
    let body = format!(
        r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "z".repeat(5000)
    );
    let l = Limits {
        max_body_bytes: 2000,
        ..limits(1024)
    };
    let e = extract(ApiKind::ChatCompletions, l, body.as_bytes());
    assert_eq!(e.fallback, Some(FallbackReason::LimitReached));
    assert_eq!(e.source, PrefixSource::RawBytes);
    assert_eq!(e.prefix, &body.as_bytes()[..1024]);
    assert_eq!(e.bytes_inspected, 2000);
}

#[test]
fn never_inspects_more_than_max_body_bytes() {
    let body = format!(r#"{{"messages":[],"x":"{}"}}"#, "z".repeat(5000));
    for max in [0, 1, 15, 16, 100, 4999] {
        let l = Limits {
            max_body_bytes: max,
            ..limits(1024)
        };
        let e = extract(ApiKind::ChatCompletions, l, body.as_bytes());
        assert_eq!(e.bytes_inspected, max);
    }
}

// ---------------------------------------------------------------- fallbacks

#[test]
fn invalid_json_falls_back_to_the_raw_prefix() {
    for body in [
        &br#"{"messages": [}"#[..],
        br#"{"temperature": 0.7x, "messages": [{"role": "user", "content": "x"}]}"#,
        br#"{"messages": [{"role": "user", "content": "\q"}]}"#,
        br#"{"messages": [{"role": "user", "content": "x"}],}"#,
        br#"{"messages" [{"role": "user", "content": "x"}]}"#,
        b"not json at all",
        b"\xff\xfe{}",
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xc3\x28\"}]}",
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"\\ud800\"}]}",
    ] {
        let e = extract(ApiKind::ChatCompletions, limits(10), body);
        let shown = String::from_utf8_lossy(body);
        assert_eq!(e.fallback, Some(FallbackReason::InvalidJson), "{shown}");
        assert_eq!(e.source, PrefixSource::RawBytes);
        assert_eq!(e.prefix, &body[..10.min(body.len())], "{shown}");
    }
}

#[test]
fn truncated_json_is_noticed_at_the_end_of_the_body() {
    let body = br#"{"messages": [{"role": "user", "content": "x"}]"#;
    let e = extract(ApiKind::ChatCompletions, limits(4096), body);
    assert_eq!(e.fallback, Some(FallbackReason::InvalidJson));
    assert_eq!(e.prefix, body);
    assert!(e.short);
}

#[test]
fn fallback_keeps_reading_raw_bytes_up_to_prefix_length() {
    let mut body = br#"{"messages": oops "#.to_vec();
    body.extend(std::iter::repeat_n(b'q', 3000));
    let e = extract(ApiKind::ChatCompletions, limits(1024), &body);
    assert_eq!(e.prefix, &body[..1024]);
    assert_eq!(e.bytes_inspected, 1024);
    assert!(!e.short);
}

#[test]
fn unexpected_shapes_fall_back() {
    for body in [
        json!([{"role": "user", "content": "x"}]),
        json!({"messages": {"role": "user", "content": "x"}}),
        json!({"messages": "hello"}),
        json!({"messages": ["hello"]}),
        json!({"messages": [{"content": "no role"}]}),
        json!({"messages": [{"role": 1, "content": "x"}]}),
        json!({"messages": [{"role": "user", "content": 5}]}),
        json!({"messages": [{"role": "user", "content": [5]}]}),
        json!({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}),
        json!({"messages": [{"role": "user", "name": 3, "content": "x"}]}),
        json!({"messages": [{"role": "assistant", "tool_calls": {}}]}),
        json!({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]}),
        json!({"model": "m", "stream": true}),
        json!({"messages": [], "prompt_cache_key": ["t"]}),
    ] {
        let e = chat(&body);
        assert_eq!(e.fallback, Some(FallbackReason::UnexpectedShape), "{body}");
        assert_eq!(e.source, PrefixSource::RawBytes);
    }
}

#[test]
fn values_past_the_prefix_are_checked_neither_as_json_nor_as_messages() {
    let body = |second: &str| {
        format!(r#"{{"messages":[{{"role":"user","content":"0123456789"}},{second}],"model":"m"}}"#)
    };
    let l = Limits {
        want_body_tenant: false,
        ..limits(10)
    };
    let e = extract(
        ApiKind::ChatCompletions,
        l,
        body(r#"{"content":5}"#).as_bytes(),
    );
    assert_eq!(e.fallback, None);
    assert_eq!(readable(&e), "role=user|");
    assert_eq!(e.model.as_deref(), Some("m"));
    // Not even as JSON: the key is already determined.
    let e = extract(
        ApiKind::ChatCompletions,
        l,
        body(r#"{"content":tru,"x":"\"]}"}"#).as_bytes(),
    );
    assert_eq!(e.fallback, None);
    assert_eq!(e.model.as_deref(), Some("m"));
    // Nor a top-level value after the prefix; `prompt_cache_key` is still read.
    let e = extract(
        ApiKind::ChatCompletions,
        limits(10),
        br#"{"messages":[{"role":"user","content":"0123456789"}],"n":[1,,tru],"prompt_cache_key":"t"}"#,
    );
    assert_eq!(e.fallback, None);
    assert_eq!(e.body_tenant.as_deref(), Some("t"));
    // But the glue of the top-level object is, since it locates the keys.
    let e = extract(
        ApiKind::ChatCompletions,
        l,
        body(r#"{"content":5"#).as_bytes(),
    );
    assert_eq!(e.fallback, Some(FallbackReason::InvalidJson));
    // Within the prefix the same message is a shape error.
    let e = extract(
        ApiKind::ChatCompletions,
        limits(4096),
        body(r#"{"content":5}"#).as_bytes(),
    );
    assert_eq!(e.fallback, Some(FallbackReason::UnexpectedShape));
}

#[test]
fn a_repeated_field_is_ambiguous_and_falls_back() {
    let e = extract(
        ApiKind::ChatCompletions,
        limits(4096),
        br#"{"model":"a","messages":[],"model":"b"}"#,
    );
    assert_eq!(e.fallback, Some(FallbackReason::UnexpectedShape));
    // Unread fields may repeat.
    let e = extract(
        ApiKind::ChatCompletions,
        limits(4096),
        br#"{"n":1,"messages":[],"n":2}"#,
    );
    assert_eq!(e.fallback, None);
}

#[test]
fn escaped_keys_are_decoded() {
    let e = extract(
        ApiKind::ChatCompletions,
        limits(4096),
        br#"{"m\u0065ssages":[{"r\u006fle":"user","content":"x"}],"mod\u0065l":"m"}"#,
    );
    assert_eq!(readable(&e), "role=user|text=x|;");
    assert_eq!(e.model.as_deref(), Some("m"));
}

#[test]
fn deep_nesting_never_overflows_the_stack() {
    let nest = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    // Values the key does not read are checked without recursion: deep is
    // fine there, before the prefix is known and after it.
    for body in [
        format!(r#"{{"x":{},"messages":[]}}"#, nest(100_000)),
        format!(r#"{{"messages":[],"x":{}}}"#, nest(100_000)),
    ] {
        let e = extract(ApiKind::ChatCompletions, limits(1024), body.as_bytes());
        assert_eq!(e.fallback, None);
    }
    let body = format!(
        r#"{{"x":{},"messages":[]}}"#,
        nest(100_000).replacen(']', "}", 1)
    );
    let e = extract(ApiKind::ChatCompletions, limits(1024), body.as_bytes());
    assert_eq!(e.fallback, Some(FallbackReason::InvalidJson));
    // Values the key reads stop at serde_json's nesting limit.
    let body = format!(
        r#"{{"messages":[{{"role":"user","content":"x","extra":{}}}]}}"#,
        nest(100_000)
    );
    let e = extract(ApiKind::ChatCompletions, limits(1024), body.as_bytes());
    assert_eq!(e.fallback, Some(FallbackReason::InvalidJson));
}

// ---------------------------------------------------------------- properties

/// A random conversation-shaped value for `kind`, sometimes off-shape.
fn random_request(kind: ApiKind, rng: &mut Rng) -> Value {
    let words = [
        "a", "é", "日本", "🚀", "\u{1f}", "\u{10}", "\\", "\"", "/", " ", "\n", "xyz",
    ];
    let text = |rng: &mut Rng| -> String {
        (0..rng.below(12))
            .map(|_| words[rng.below(words.len())])
            .collect()
    };
    let message = |rng: &mut Rng| -> Value {
        let content = match rng.below(4) {
            0 => Value::String(text(rng)),
            1 => Value::Null,
            _ => Value::Array(
                (0..rng.below(4))
                    .map(|_| match rng.below(3) {
                        0 => json!({"type": "image_url", "image_url": {"url": text(rng)}}),
                        _ => json!({"type": "text", "text": text(rng)}),
                    })
                    .collect(),
            ),
        };
        let role = ["user", "assistant", "system"][rng.below(3)];
        let mut m = json!({"role": role, "content": content});
        if rng.chance(20) {
            m["name"] = Value::String(text(rng));
        }
        if rng.chance(10) {
            m["tool_calls"] = json!([{"id": "x", "type": "function",
                "function": {"name": text(rng), "arguments": text(rng)}}]);
        }
        if rng.chance(3) {
            m["content"] = json!(42);
        }
        m
    };
    let mut body = serde_json::Map::new();
    match kind {
        ApiKind::ChatCompletions => {
            body.insert(
                "messages".into(),
                Value::Array((0..rng.below(6)).map(|_| message(rng)).collect()),
            );
        }
        ApiKind::Completions => {
            let prompt = match rng.below(4) {
                0 => Value::String(text(rng)),
                1 => Value::Array(
                    (0..rng.below(4))
                        .map(|_| Value::String(text(rng)))
                        .collect(),
                ),
                2 => Value::Array(
                    (0..rng.below(6))
                        .map(|_| json!(rng.below(100_000)))
                        .collect(),
                ),
                _ => json!([[1, 2], [rng.below(9)]]),
            };
            body.insert("prompt".into(), prompt);
        }
        _ => {
            if rng.chance(70) {
                body.insert("instructions".into(), Value::String(text(rng)));
            }
            let input = if rng.chance(30) {
                Value::String(text(rng))
            } else {
                Value::Array((0..rng.below(5)).map(|_| message(rng)).collect())
            };
            body.insert("input".into(), input);
        }
    }
    if rng.chance(80) {
        body.insert("model".into(), Value::String(text(rng)));
    }
    if rng.chance(50) {
        body.insert("prompt_cache_key".into(), Value::String(text(rng)));
    }
    if rng.chance(50) {
        body.insert("temperature".into(), json!(0.25));
        body.insert("metadata".into(), json!({"k": [1, {"v": text(rng)}]}));
    }
    Value::Object(body)
}

fn random_limits(rng: &mut Rng) -> Limits {
    Limits {
        prefix_length: [0, 1, 3, 16, 64, 4096][rng.below(6)],
        max_body_bytes: if rng.chance(70) {
            1 << 20
        } else {
            rng.below(300)
        },
        include_model: rng.chance(50),
        want_body_tenant: rng.chance(50),
    }
}

const KINDS: [ApiKind; 4] = [
    ApiKind::Invoke,
    ApiKind::ChatCompletions,
    ApiKind::Completions,
    ApiKind::Responses,
];

#[test]
fn property_serialisation_never_changes_the_canonical_result() {
    let mut rng = Rng::new(7);
    let mut compared = 0;
    for case in 0..300 {
        let kind = KINDS[1 + rng.below(3)];
        let request = random_request(kind, &mut rng);
        let l = Limits {
            max_body_bytes: 1 << 20,
            ..random_limits(&mut rng)
        };
        let reference = extract(kind, l, request.to_string().as_bytes());
        if reference.fallback.is_some() {
            // Off-shape requests: which bad value is seen first (if any,
            // before Done) depends on key order, so only valid ones compare.
            continue;
        }
        compared += 1;
        for body in variants(&request, case) {
            let e = extract(kind, l, body.as_bytes());
            assert_eq!(e.fallback, None, "{body}");
            assert_eq!(e.prefix, reference.prefix, "case {case}: {body}");
            assert_eq!(e.source, reference.source);
            assert_eq!(e.model, reference.model);
            assert_eq!(e.body_tenant, reference.body_tenant);
            assert_eq!(e.short, reference.short);
        }
    }
    assert!(compared > 200, "only {compared} valid requests generated");
}

#[test]
fn property_any_chunking_of_any_body_gives_the_same_result() {
    let mut rng = Rng::new(11);
    for case in 0..400 {
        let kind = KINDS[rng.below(4)];
        let mut body = random_request(kind, &mut rng).to_string().into_bytes();
        // Damage some bodies: truncate, flip or insert bytes.
        match rng.below(5) {
            0 => body.truncate(rng.below(body.len() + 1)),
            1 => {
                for _ in 0..1 + rng.below(3) {
                    let at = rng.below(body.len());
                    body[at] = b"{}[]\":,\\ x\x00\xff"[rng.below(12)];
                }
            }
            2 => {
                let at = rng.below(body.len() + 1);
                body.insert(at, b"{}[]\":,\\ "[rng.below(9)]);
            }
            _ => {}
        }
        let l = random_limits(&mut rng);
        let e = extract(kind, l, &body);
        // Basic invariants of every result.
        assert!(
            e.bytes_inspected <= l.max_body_bytes.min(body.len()),
            "case {case}"
        );
        match e.source {
            PrefixSource::RawBytes => {
                assert!(e.prefix.len() <= l.prefix_length);
                assert!(body.starts_with(&e.prefix));
            }
            PrefixSource::CanonicalText => {
                let t = String::from_utf8(e.prefix.clone()).expect("UTF-8");
                assert!(t.chars().count() <= l.prefix_length);
                assert_eq!(e.fallback, None);
            }
        }
        assert!(kind != ApiKind::Invoke || e.fallback.is_none());
    }
}

#[test]
fn a_long_string_is_read_only_as_far_as_the_prefix_can_use() {
    let body = |content: &str| {
        format!(r#"{{"messages":[{{"role":"system","content":"{content}"}}],"model":"m"}}"#)
    };
    let long = "é".repeat(3000);
    let e = extract(
        ApiKind::ChatCompletions,
        limits(1024),
        body(&long).as_bytes(),
    );
    let expected = format!("role=system|text={}", "é".repeat(1024 - 17));
    assert_eq!(readable(&e), expected);
    // Past the characters the prefix can use, the string is not checked...
    let e = extract(
        ApiKind::ChatCompletions,
        limits(1024),
        body(&format!("{long}\\q")).as_bytes(),
    );
    assert_eq!(e.fallback, None);
    assert_eq!(readable(&e), expected);
    assert_eq!(e.model.as_deref(), Some("m"));
    // ...within them it is.
    let e = extract(
        ApiKind::ChatCompletions,
        limits(1024),
        body(&format!("\\q{long}")).as_bytes(),
    );
    assert_eq!(e.fallback, Some(FallbackReason::InvalidJson));
}

// ---------------------------------------------------------------- fuzz inputs

/// An extractor that cuts long strings while they arrive as the fuzz build's
/// does, from a few dozen bytes on.
fn cutting_as_fuzzed(kind: ApiKind, limits: Limits) -> Extractor {
    super::fuzzing::fuzz_extractor(kind, limits, false)
}

#[test]
fn a_grpc_prefix_shorter_than_a_message_header_inspects_what_it_keeps_in_any_chunking() {
    // A prefix_length below the 5-byte gRPC header (the filter's is at
    // least 1024; the extractor takes any): the header read first, alone,
    // must not count bytes the prefix does not keep, or the bytes inspected
    // depend on how the body was split.
    let mut data = vec![0x80 | 0x20, 2, 0, 0, 0, 7, 7, 7, 7, 7, 7, 7, 7];
    data.extend_from_slice(&[0, 0, 0, 0, 3, b'a', b'b', b'c']);
    let case = super::fuzzing::FuzzCase::decode(&data).expect("a whole header");
    assert_eq!(
        (case.kind, case.grpc, case.limits.prefix_length),
        (ApiKind::Invoke, true, 2)
    );
    let e = case.run();
    assert_eq!((e.prefix, e.bytes_inspected), (vec![0, 0], 2));
}

#[test]
fn a_quote_in_a_scalar_element_opens_no_string_to_cut() {
    // Found by the fuzzer: the first element of `messages` starts with a
    // byte that is no JSON value (so it is delimited as a scalar, up to the
    // first space at 1360), and holds a `"` followed by over 1024 characters
    // with no other quote. Cut while arriving, that quote was read as opening
    // a long string, so the bytes up to the next quote were dropped unscanned.
    let data = include_bytes!("../../fuzz/seeds/extract/scalar-element-with-a-quote");
    let case = super::fuzzing::FuzzCase::decode(data).expect("a whole header");
    let (kind, limits, body) = (case.kind, case.limits, case.body);
    let e = case.run();
    assert_eq!(kind, ApiKind::ChatCompletions);
    assert_eq!(
        (limits.prefix_length, limits.max_body_bytes),
        (40, usize::MAX)
    );
    let expected = Extraction {
        source: PrefixSource::RawBytes,
        prefix: body[..40].to_vec(),
        model: Some("m".to_string()),
        body_tenant: None,
        fallback: Some(FallbackReason::InvalidJson),
        short: false,
        bytes_inspected: 1360,
    };
    assert_eq!(e, expected);
    assert_eq!(body[1360], b' ');
    assert_eq!(extract(kind, limits, body), expected);
}

/// `body` (a chat body broken at byte `end`, with a body limit just past it)
/// gives the raw-byte `InvalidJson` extraction that inspects exactly `end`
/// bytes, cut while arriving as the fuzz build cuts and in one piece alike.
fn assert_invalid_json_ending_at(body: &[u8], end: usize) {
    let l = Limits {
        max_body_bytes: end + 10,
        ..limits(64)
    };
    let expected = Extraction {
        source: PrefixSource::RawBytes,
        prefix: body[..64].to_vec(),
        model: None,
        body_tenant: None,
        fallback: Some(FallbackReason::InvalidJson),
        short: false,
        bytes_inspected: end,
    };
    let kind = ApiKind::ChatCompletions;
    assert_eq!(extract_with(|| cutting_as_fuzzed(kind, l), body), expected);
    assert_eq!(extract(kind, l, body), expected);
}

#[test]
fn a_scalar_element_ends_at_its_delimiter_even_after_a_long_quoted_run() {
    // The dropped bytes held the scalar's end: read on to the body limit, the
    // element never ended, and the first message's text became the prefix.
    let mut body = br#"{"messages":[{"role":"user","content":"hi"},x""#.to_vec();
    let end = body.len() + 1100;
    body.resize(end, b'a');
    body.extend_from_slice(b" bbbbbbbbbbbbbbbbbbbb],\"model\":\"m\"}");
    assert_invalid_json_ending_at(&body, end);
}

#[test]
fn a_string_cut_inside_a_malformed_escape_still_ends_where_it_did() {
    // `\u12a\` is no escape, and counted as one character it ends just after
    // a backslash that escapes the next quote. Cut there while arriving, the
    // quote put after it read as escaped, so a later cut of the same element
    // took the bytes after `"k":` for a long string and dropped them up to a
    // next quote that never came: the element never ended before the limit.
    let mut body = br#"{"messages":[{"role":"user","content":"hi"},{"content":""#.to_vec();
    body.resize(body.len() + 1023, b'a');
    body.extend_from_slice(br#"\u12a\"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb","k":["#);
    body.extend_from_slice("1,".repeat(2000).as_bytes());
    body.extend_from_slice(b"1]}");
    let end = body.len();
    body.extend_from_slice(b" ], 1111111111111111");
    assert_invalid_json_ending_at(&body, end);
}
