//! What each OpenAI-compatible API contributes to the canonical text, and the
//! shape checks that send a body to the raw-byte fallback.
//!
//! Until the prefix is known, each top-level value (or element of
//! `messages` / `prompt` / `input`) is parsed by `serde_json` once, when its
//! span is complete; values the key does not use are still parsed (as
//! `IgnoredAny`) so invalid JSON in the prefix region sends the body to the
//! raw-byte fallback. Once the prefix is known, only `model` and
//! `prompt_cache_key` are still read; everything else is skipped (delimited,
//! not parsed): checking it could only turn a key already determined into a
//! fallback, and the body is forwarded untouched either way.

use serde::de::IgnoredAny;
use serde_json::{Map, Value};

use super::canonical::{CanonicalText, Section};
use super::document::{reason_of, Sink, ValueUse};
use super::FallbackReason;
use crate::classify::ApiKind;

const SHAPE: FallbackReason = FallbackReason::UnexpectedShape;

/// Strings are cut to at least this many characters (the smallest
/// configurable `prefix_length`), far longer than any name compared.
const MIN_STRING_CAP: usize = 1024;

/// Content part types whose `text` is part of the conversation.
const TEXT_PART_TYPES: [&str; 3] = ["text", "input_text", "output_text"];

/// The top-level fields the reader cares about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Model,
    Tenant,
    Messages,
    Prompt,
    Instructions,
    Input,
    Other,
}

impl Field {
    fn bit(self) -> u8 {
        match self {
            Field::Model => 1,
            Field::Tenant => 2,
            Field::Messages => 4,
            Field::Prompt => 8,
            Field::Instructions => 16,
            Field::Input => 32,
            Field::Other => 0,
        }
    }
}

/// How a `/completions` prompt array is being read (decided by its first
/// element; OpenAI does not allow mixing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PromptArray {
    Unknown,
    /// `["a", "b"]`: one record per string.
    Strings,
    /// `[1, 2, 3]`: one record of token ids, still open.
    TokenIds,
    /// `[[1, 2], [3]]`: one record per inner array.
    TokenLists,
}

/// Reads the key material of one OpenAI-compatible body.
#[derive(Debug)]
pub(crate) struct OpenAiReader {
    kind: ApiKind,
    /// No string gives the text more characters than this (and a string cut
    /// to it never equals a key, role or type the reader compares with).
    string_cap: usize,
    include_model: bool,
    want_tenant: bool,
    pub(crate) text: CanonicalText,
    pub(crate) model: Option<String>,
    pub(crate) tenant: Option<String>,
    seen: u8,
    object_ended: bool,
    prompt_array: PromptArray,
}

/// Section indices: `/responses` reads `instructions` before `input`.
const INSTRUCTIONS: usize = 0;
const INPUT: usize = 1;
const ONLY: usize = 0;

impl OpenAiReader {
    pub(crate) fn new(
        kind: ApiKind,
        prefix_length: usize,
        include_model: bool,
        want_tenant: bool,
    ) -> Self {
        let sections = if kind == ApiKind::Responses { 2 } else { 1 };
        OpenAiReader {
            kind,
            string_cap: prefix_length.max(MIN_STRING_CAP),
            include_model,
            want_tenant,
            text: CanonicalText::new(sections, prefix_length),
            model: None,
            tenant: None,
            seen: 0,
            object_ended: false,
            prompt_array: PromptArray::Unknown,
        }
    }

    fn field(&self, key: &str) -> Field {
        match (key, self.kind) {
            ("model", _) if self.include_model => Field::Model,
            ("prompt_cache_key", _) if self.want_tenant => Field::Tenant,
            ("messages", ApiKind::ChatCompletions) => Field::Messages,
            ("prompt", ApiKind::Completions) => Field::Prompt,
            ("instructions", ApiKind::Responses) => Field::Instructions,
            ("input", ApiKind::Responses) => Field::Input,
            _ => Field::Other,
        }
    }

    fn seen(&self, field: Field) -> bool {
        self.seen & field.bit() != 0
    }

    fn section(&mut self, index: usize) -> Result<&mut Section, FallbackReason> {
        // Always present by construction; a missing one is a shape we do not read.
        self.text.section(index).ok_or(SHAPE)
    }

    fn complete(&mut self, index: usize) -> Result<(), FallbackReason> {
        self.section(index)?.complete = true;
        Ok(())
    }
}

fn parse<'a, T: serde::Deserialize<'a>>(span: &'a [u8]) -> Result<T, FallbackReason> {
    serde_json::from_slice(span).map_err(|e| reason_of(&e))
}

impl Sink for OpenAiReader {
    fn begin_value(&mut self, key: &str) -> Result<ValueUse, FallbackReason> {
        let field = self.field(key);
        if field != Field::Other {
            // A repeated field is ambiguous (parsers disagree on which wins).
            if self.seen(field) {
                return Err(SHAPE);
            }
            self.seen |= field.bit();
        }
        Ok(match field {
            Field::Model | Field::Tenant => ValueUse::Whole,
            _ if self.text.prefix_known() => ValueUse::Skip,
            Field::Messages | Field::Prompt | Field::Input => ValueUse::Elements,
            _ => ValueUse::Whole,
        })
    }

    fn wants_element(&self, key: &str) -> bool {
        // Past the prefix an element's content no longer matters (not even
        // whether it is valid JSON), so it is only delimited.
        let index = if self.field(key) == Field::Input {
            INPUT
        } else {
            ONLY
        };
        self.text
            .sections()
            .get(index)
            .is_some_and(|s| !s.is_full())
    }

    fn value(&mut self, key: &str, span: &[u8]) -> Result<(), FallbackReason> {
        match self.field(key) {
            Field::Model => self.model = parse::<Option<String>>(span)?,
            Field::Tenant => self.tenant = parse::<Option<String>>(span)?,
            Field::Messages => {
                parse::<IgnoredAny>(span)?;
                return Err(SHAPE);
            }
            Field::Prompt => {
                let prompt = parse::<String>(span)?;
                let section = self.section(ONLY)?;
                section.field("text", &prompt);
                section.end_record();
                self.complete(ONLY)?;
            }
            Field::Instructions => {
                if let Some(instructions) = parse::<Option<String>>(span)? {
                    let section = self.section(INSTRUCTIONS)?;
                    section.field("instructions", &instructions);
                    section.end_record();
                }
                self.complete(INSTRUCTIONS)?;
            }
            Field::Input => {
                // A string input is one user message.
                let input = parse::<String>(span)?;
                let section = self.section(INPUT)?;
                section.field("role", "user");
                section.field("text", &input);
                section.end_record();
                self.complete(INPUT)?;
            }
            Field::Other => {
                parse::<IgnoredAny>(span)?;
            }
        }
        Ok(())
    }

    fn element(&mut self, key: &str, span: &[u8]) -> Result<(), FallbackReason> {
        let field = self.field(key);
        let value = parse::<Value>(span)?;
        match field {
            Field::Messages => chat_message(self.section(ONLY)?, &value),
            Field::Prompt => self.prompt_element(&value),
            Field::Input => response_item(self.section(INPUT)?, &value),
            _ => Err(SHAPE),
        }
    }

    fn end_array(&mut self, key: &str) -> Result<(), FallbackReason> {
        match self.field(key) {
            Field::Messages | Field::Prompt => {
                if self.prompt_array == PromptArray::TokenIds {
                    let section = self.section(ONLY)?;
                    section.end_field();
                    section.end_record();
                }
                self.complete(ONLY)
            }
            Field::Input => self.complete(INPUT),
            _ => Err(SHAPE),
        }
    }

    fn end_object(&mut self) -> Result<(), FallbackReason> {
        self.object_ended = true;
        self.text.complete_all();
        let required_seen = match self.kind {
            ApiKind::ChatCompletions => self.seen(Field::Messages),
            ApiKind::Completions => self.seen(Field::Prompt),
            ApiKind::Responses => self.seen(Field::Input) || self.seen(Field::Instructions),
            ApiKind::Invoke => false,
        };
        if required_seen {
            Ok(())
        } else {
            Err(SHAPE)
        }
    }

    fn string_cap(&self, key: &str, element: bool) -> Option<usize> {
        // Only the first `prefix_length` characters of a string can count.
        // `model`, `prompt_cache_key` and other fields are read whole, and so
        // is a `messages` that is not an array (it is only checked).
        match self.field(key) {
            Field::Prompt | Field::Instructions | Field::Input => Some(self.string_cap),
            Field::Messages if element => Some(self.string_cap),
            _ => None,
        }
    }

    fn satisfied(&self) -> bool {
        let model_known = !self.include_model || self.seen(Field::Model) || self.object_ended;
        let tenant_known = !self.want_tenant || self.seen(Field::Tenant) || self.object_ended;
        model_known && tenant_known && self.text.prefix_known()
    }
}

impl OpenAiReader {
    fn prompt_element(&mut self, value: &Value) -> Result<(), FallbackReason> {
        let kind = match value {
            Value::String(_) => PromptArray::Strings,
            Value::Number(_) => PromptArray::TokenIds,
            Value::Array(_) => PromptArray::TokenLists,
            _ => return Err(SHAPE),
        };
        let first = self.prompt_array == PromptArray::Unknown;
        if !first && self.prompt_array != kind {
            return Err(SHAPE);
        }
        self.prompt_array = kind;
        let section = self.section(ONLY)?;
        match value {
            Value::String(text) => {
                section.field("text", text);
                section.end_record();
            }
            Value::Number(_) => {
                if first {
                    section.push_plain("tokens=");
                } else {
                    section.push_plain(" ");
                }
                section.push_number(token_id(value)?);
            }
            Value::Array(ids) => {
                section.push_plain("tokens=");
                for (n, id) in ids.iter().enumerate() {
                    if n > 0 {
                        section.push_plain(" ");
                    }
                    section.push_number(token_id(id)?);
                }
                section.end_field();
                section.end_record();
            }
            _ => return Err(SHAPE),
        }
        Ok(())
    }
}

fn token_id(value: &Value) -> Result<u64, FallbackReason> {
    value.as_u64().ok_or(SHAPE)
}

/// `null` or absent reads as absent; anything else must be a string.
fn optional_str<'a>(
    object: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, FallbackReason> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(SHAPE),
    }
}

fn required_str<'a>(object: &'a Map<String, Value>, key: &str) -> Result<&'a str, FallbackReason> {
    optional_str(object, key)?.ok_or(SHAPE)
}

/// A chat message: `role`, optional `name`, content, tool calls.
fn chat_message(section: &mut Section, value: &Value) -> Result<(), FallbackReason> {
    let message = value.as_object().ok_or(SHAPE)?;
    message_record(section, message)?;
    Ok(())
}

/// The record shared by chat messages and `/responses` message items.
fn message_record(
    section: &mut Section,
    message: &Map<String, Value>,
) -> Result<(), FallbackReason> {
    section.field("role", required_str(message, "role")?);
    if let Some(name) = optional_str(message, "name")? {
        section.field("name", name);
    }
    content(section, message.get("content"))?;
    tool_calls(section, message.get("tool_calls"))?;
    section.end_record();
    Ok(())
}

/// Content as a string or an array of parts; `null`/absent adds nothing.
fn content(section: &mut Section, content: Option<&Value>) -> Result<(), FallbackReason> {
    match content {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(text)) => {
            section.field("text", text);
            Ok(())
        }
        Some(Value::Array(parts)) => parts
            .iter()
            .try_for_each(|part| content_part(section, part)),
        Some(_) => Err(SHAPE),
    }
}

/// A text part adds its text; any other part (image, audio, file...) adds only
/// its type, never its data.
fn content_part(section: &mut Section, part: &Value) -> Result<(), FallbackReason> {
    match part {
        Value::String(text) => {
            section.field("text", text);
            Ok(())
        }
        Value::Object(part) => {
            let kind = required_str(part, "type")?;
            if TEXT_PART_TYPES.contains(&kind) {
                section.field("text", required_str(part, "text")?);
            } else {
                section.field("part", kind);
            }
            Ok(())
        }
        _ => Err(SHAPE),
    }
}

/// Assistant tool calls: the function name and its arguments string, or a
/// custom tool's name and input; call ids are ignored. A call of any other
/// kind adds its type only.
fn tool_calls(section: &mut Section, calls: Option<&Value>) -> Result<(), FallbackReason> {
    let calls = match calls {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Array(calls)) => calls,
        Some(_) => return Err(SHAPE),
    };
    for call in calls {
        let call = call.as_object().ok_or(SHAPE)?;
        match (call.get("function"), call.get("custom")) {
            (Some(Value::Object(function)), _) => function_call(section, function)?,
            (None | Some(Value::Null), Some(Value::Object(custom))) => {
                custom_call(section, custom)?
            }
            (None | Some(Value::Null), None | Some(Value::Null)) => {
                section.field("part", required_str(call, "type")?)
            }
            _ => return Err(SHAPE),
        }
    }
    Ok(())
}

fn custom_call(section: &mut Section, call: &Map<String, Value>) -> Result<(), FallbackReason> {
    section.field("custom", required_str(call, "name")?);
    if let Some(input) = optional_str(call, "input")? {
        section.field("input", input);
    }
    Ok(())
}

fn function_call(
    section: &mut Section,
    function: &Map<String, Value>,
) -> Result<(), FallbackReason> {
    section.field("tool", required_str(function, "name")?);
    if let Some(arguments) = optional_str(function, "arguments")? {
        section.field("args", arguments);
    }
    Ok(())
}

/// One `/responses` input item: a message (it has a `role`), a function call
/// or its output, or any other item type as a marker.
fn response_item(section: &mut Section, value: &Value) -> Result<(), FallbackReason> {
    let item = value.as_object().ok_or(SHAPE)?;
    if item.contains_key("role") {
        return message_record(section, item);
    }
    let kind = required_str(item, "type")?;
    section.field("item", kind);
    match kind {
        "function_call" => function_call(section, item)?,
        "custom_tool_call" => custom_call(section, item)?,
        "function_call_output" | "custom_tool_call_output" => content(section, item.get("output"))?,
        _ => {}
    }
    section.end_record();
    Ok(())
}
