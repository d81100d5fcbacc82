//! Reading the configuration document: JSON into a `serde_json::Value` that
//! refuses a key named twice in one object, and a serde `Deserializer` over
//! that value whose errors name the field by its path
//! (`path_rules[1].suffix`) and show the value given.

use std::cell::RefCell;
use std::fmt;

use serde::de::{
    self, DeserializeSeed, Deserializer, IntoDeserializer, MapAccess, SeqAccess, Visitor,
};
use serde::forward_to_deserialize_any;
use serde_json::{Map, Number, Value};

use super::{error, shown, ConfigError};

/// Reads `bytes` as JSON. A key named twice in one object is refused, at any
/// depth: serde_json keeps the last one, so `{"x": 0, "x": 10}` would accept
/// the 0 it would refuse alone.
pub(super) fn read(bytes: &[u8]) -> Result<Value, ConfigError> {
    let refused = RefCell::new(None);
    let seed = Unique {
        at: &Path::Root,
        refused: &refused,
    };
    let mut reader = serde_json::Deserializer::from_slice(bytes);
    let read = seed.deserialize(&mut reader).and_then(|value| {
        reader.end()?;
        Ok(value)
    });
    read.map_err(|e| {
        refused
            .into_inner()
            .unwrap_or_else(|| error("configuration", format!("not valid JSON: {e}")))
    })
}

/// Where a value stands in the document, rendered only for an error.
enum Path<'a> {
    Root,
    Key(&'a Path<'a>, &'a str),
    Index(&'a Path<'a>, usize),
}

impl fmt::Display for Path<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Path::Root => Ok(()),
            Path::Key(Path::Root, key) => write!(f, "{key}"),
            Path::Key(parent, key) => write!(f, "{parent}.{key}"),
            Path::Index(parent, index) => write!(f, "{parent}[{index}]"),
        }
    }
}

/// A JSON value at `at`; a duplicate key is stored in `refused` (serde_json's
/// own error type cannot carry the field apart from the message).
#[derive(Clone, Copy)]
struct Unique<'a> {
    at: &'a Path<'a>,
    refused: &'a RefCell<Option<ConfigError>>,
}

impl<'de> DeserializeSeed<'de> for Unique<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Unique<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(item) = items.next_element_seed(Unique {
            at: &Path::Index(self.at, out.len()),
            ..self
        })? {
            out.push(item);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut entries: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = entries.next_key::<String>()? {
            let at = Path::Key(self.at, &key);
            let value = entries.next_value_seed(Unique { at: &at, ..self })?;
            if let Some(first) = out.get(&key) {
                let problem = format!(
                    "given twice ({}, then {}); a key may appear once in an object",
                    shown(first),
                    shown(&value)
                );
                *self.refused.borrow_mut() = Some(error(at.to_string(), problem));
                return Err(de::Error::custom("a key given twice"));
            }
            out.insert(key, value);
        }
        Ok(Value::Object(out))
    }
}

impl de::Error for ConfigError {
    fn custom<T: fmt::Display>(problem: T) -> Self {
        error("", problem.to_string())
    }

    fn unknown_field(field: &str, known: &'static [&'static str]) -> Self {
        error(
            field,
            format!("unknown field (known fields: {})", known.join(", ")),
        )
    }

    fn unknown_variant(variant: &str, allowed: &'static [&'static str]) -> Self {
        error(
            "",
            format!(
                "{} is not one of {}",
                shown(&Value::from(variant)),
                allowed.join(", ")
            ),
        )
    }

    fn missing_field(field: &'static str) -> Self {
        error(field, "missing")
    }
}

impl ConfigError {
    /// The error of a value found at `key` of the object it was in.
    fn under(self, key: &str) -> ConfigError {
        let field = match self.field.as_str() {
            "" => key.to_string(),
            inner if inner.starts_with('[') => format!("{key}{inner}"),
            inner => format!("{key}.{inner}"),
        };
        ConfigError { field, ..self }
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `expected <what>, got <type> (<value>)`, at the value itself (the caller
/// names the field).
pub(super) fn wrong_type(expected: impl fmt::Display, value: &Value) -> ConfigError {
    error(
        "",
        format!(
            "expected {expected}, got {} ({})",
            type_name(value),
            shown(value)
        ),
    )
}

/// A visitor's own words for what it expects (a struct's `expecting`).
struct Expecting<V>(V);

impl<'de, V: Visitor<'de>> fmt::Display for Expecting<&V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.expecting(f)
    }
}

/// Deserializes the plugin configuration's types from a [`Value`]: each
/// value only as the type the field asks for (no string is read as a number),
/// errors as [`ConfigError`]s whose field is the value's path.
pub(super) struct ValueDeserializer<'a> {
    value: &'a Value,
    /// Inside an `Option`: `null` was allowed too, and a wrong type says so.
    nullable: bool,
}

impl<'a> ValueDeserializer<'a> {
    pub(super) fn new(value: &'a Value) -> Self {
        ValueDeserializer {
            value,
            nullable: false,
        }
    }

    fn wrong_type(&self, expected: impl fmt::Display) -> ConfigError {
        if self.nullable {
            wrong_type(format_args!("{expected} or null"), self.value)
        } else {
            wrong_type(expected, self.value)
        }
    }

    fn integer<'de, V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        match self.value {
            Value::Number(n) if n.is_u64() => visitor.visit_u64(n.as_u64().unwrap_or_default()),
            Value::Number(n) if n.is_i64() => visitor.visit_i64(n.as_i64().unwrap_or_default()),
            _ => Err(self.wrong_type("an integer")),
        }
    }
}

/// The integer methods: each reads any JSON integer (the visitor bounds it).
macro_rules! integers {
    ($($method:ident)+) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
            self.integer(visitor)
        }
    )+};
}

impl<'de> Deserializer<'de> for ValueDeserializer<'_> {
    type Error = ConfigError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        match self.value {
            Value::Null => visitor.visit_unit(),
            Value::Bool(b) => visitor.visit_bool(*b),
            Value::Number(n) if n.is_f64() => visitor.visit_f64(n.as_f64().unwrap_or_default()),
            Value::Number(_) => self.integer(visitor),
            Value::String(s) => visitor.visit_str(s),
            Value::Array(_) => self.deserialize_seq(visitor),
            Value::Object(_) => self.deserialize_map(visitor),
        }
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        match self.value {
            Value::Bool(b) => visitor.visit_bool(*b),
            _ => Err(self.wrong_type("true or false")),
        }
    }

    integers! {
        deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64 deserialize_i128
        deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64 deserialize_u128
    }

    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        self.deserialize_f64(visitor)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        match self.value {
            Value::Number(n) => visitor.visit_f64(n.as_f64().unwrap_or_default()),
            _ => Err(self.wrong_type("a number")),
        }
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        match self.value {
            Value::String(s) => visitor.visit_str(s),
            _ => Err(self.wrong_type("a string")),
        }
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        self.deserialize_str(visitor)
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        self.deserialize_str(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        match self.value {
            Value::Null => visitor.visit_none(),
            _ => visitor.visit_some(ValueDeserializer {
                nullable: true,
                ..self
            }),
        }
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        match self.value {
            Value::Array(items) => visitor.visit_seq(Items {
                items: items.iter().enumerate(),
            }),
            _ => Err(self.wrong_type("an array")),
        }
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        match self.value {
            Value::Object(entries) => visitor.visit_map(Entries {
                entries: entries.iter(),
                value: None,
            }),
            _ => Err(self.wrong_type(Expecting(&visitor))),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ConfigError> {
        self.deserialize_map(visitor)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ConfigError> {
        match self.value {
            Value::String(s) => visitor.visit_enum(s.as_str().into_deserializer()),
            _ => Err(self.wrong_type("a string")),
        }
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ConfigError> {
        visitor.visit_unit()
    }

    forward_to_deserialize_any! {
        char bytes byte_buf unit unit_struct newtype_struct tuple tuple_struct
    }
}

struct Items<'a> {
    items: std::iter::Enumerate<std::slice::Iter<'a, Value>>,
}

impl<'de> SeqAccess<'de> for Items<'_> {
    type Error = ConfigError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, ConfigError> {
        let Some((index, item)) = self.items.next() else {
            return Ok(None);
        };
        seed.deserialize(ValueDeserializer::new(item))
            .map(Some)
            .map_err(|e| e.under(&format!("[{index}]")))
    }
}

struct Entries<'a> {
    entries: serde_json::map::Iter<'a>,
    /// The entry whose key was just read.
    value: Option<(&'a str, &'a Value)>,
}

impl<'de> MapAccess<'de> for Entries<'_> {
    type Error = ConfigError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, ConfigError> {
        let Some((key, value)) = self.entries.next() else {
            return Ok(None);
        };
        self.value = Some((key, value));
        // An unknown key names itself (`unknown_field`).
        seed.deserialize(key.as_str().into_deserializer()).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, ConfigError> {
        let (key, value) = self
            .value
            .take()
            .ok_or_else(|| error("configuration", "a value read before its key"))?;
        seed.deserialize(ValueDeserializer::new(value))
            .map_err(|e| e.under(key))
    }
}
