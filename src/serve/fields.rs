//! Typed reads of a request's JSON fields, each refusal a 400 naming the field and what it
//! must be. `null` counts as absent, as OpenAI's servers take it.

use super::api_error::ApiError;
use serde_json::{Map, Value};

/// Stop strings a request may give: each is searched for after every token (OpenAI allows
/// 4; vLLM sets no limit, which lets one request make every token slow).
pub const MAX_STOP_STRINGS: usize = 64;

/// A request body's top-level object.
pub struct Fields<'a>(pub &'a Map<String, Value>);

/// What a JSON value is, for messages.
pub fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn wrong(name: &str, want: &str, found: &Value) -> ApiError {
    ApiError::param(
        name,
        format!("`{name}` must be {want}, found {}", kind_of(found)),
    )
}

impl<'a> Fields<'a> {
    /// The body as an object, or a 400 saying it must be one.
    pub fn of(body: &'a Value) -> Result<Fields<'a>, ApiError> {
        body.as_object().map(Fields).ok_or_else(|| {
            ApiError::invalid(format!(
                "the request body must be a JSON object, found {}",
                kind_of(body)
            ))
        })
    }

    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    pub fn f64(&self, name: &str) -> Result<Option<f64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| wrong(name, "a number", v)),
        }
    }

    /// A whole number (a float with no fraction, such as `5.0`, is taken too, as Python
    /// clients may send one).
    pub fn i64(&self, name: &str) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => {
                if let Some(i) = v.as_i64() {
                    return Ok(Some(i));
                }
                match v.as_f64() {
                    Some(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(Some(f as i64)),
                    _ => Err(wrong(name, "a whole number", v)),
                }
            }
        }
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| wrong(name, "true or false", v)),
        }
    }

    pub fn str(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| wrong(name, "a string", v)),
        }
    }

    pub fn object(&self, name: &str) -> Result<Option<Fields<'a>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_object()
                .map(|o| Some(Fields(o)))
                .ok_or_else(|| wrong(name, "an object", v)),
        }
    }

    /// A list of token ids (whole numbers), at most [`MAX_STOP_STRINGS`]; absent: none.
    pub fn ids(&self, name: &str) -> Result<Vec<i64>, ApiError> {
        let list = match self.get(name) {
            None | Some(Value::Null) => return Ok(vec![]),
            Some(Value::Array(items)) => items
                .iter()
                .map(Value::as_i64)
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    ApiError::param(name, format!("`{name}` must be a list of token ids"))
                })?,
            Some(v) => return Err(wrong(name, "a list of token ids", v)),
        };
        at_most_stops(name, list.len(), "ids")?;
        Ok(list)
    }

    /// `stop`: a string or a list of strings, none empty, at most [`MAX_STOP_STRINGS`].
    pub fn strings(&self, name: &str) -> Result<Vec<String>, ApiError> {
        let list = match self.get(name) {
            None => return Ok(vec![]),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|i| i.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    ApiError::param(
                        name,
                        format!("`{name}` must be a string or a list of strings"),
                    )
                })?,
            Some(v) => return Err(wrong(name, "a string or a list of strings", v)),
        };
        at_most_stops(name, list.len(), "strings")?;
        if list.iter().any(String::is_empty) {
            return Err(ApiError::param(
                name,
                format!("`{name}` has an empty string, which would stop at once; drop it"),
            ));
        }
        Ok(list)
    }
}

/// A stop list of `len` `items` is at most [`MAX_STOP_STRINGS`] long.
fn at_most_stops(name: &str, len: usize, items: &str) -> Result<(), ApiError> {
    if len > MAX_STOP_STRINGS {
        return Err(ApiError::param(
            name,
            format!("`{name}` has {len} {items}; give at most {MAX_STOP_STRINGS}"),
        ));
    }
    Ok(())
}
