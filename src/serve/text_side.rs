//! What the server needs from the model folder besides the engine: the tokenizer, the chat
//! template with its special-token strings, the generation defaults and the stop ids.

use super::chat_template::ChatTemplate;
use super::ServeError;
use crate::frontend::load::read_json_if_present;
use crate::frontend::stop_ids::stop_ids;
use crate::frontend::text::TextTokenizer;
use serde_json::Value;
use std::path::Path;

/// Sampling defaults of `generation_config.json`, used where a request gives none.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub max_new_tokens: Option<usize>,
}

/// The text side of a served model.
#[derive(Default)]
pub struct TextSide {
    /// `None`: the folder has no tokenizer.json; prompts must be token ids.
    pub tokenizer: Option<TextTokenizer>,
    /// Jinja source of the chat template; `None`: no chat endpoint for this model.
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub defaults: GenerationDefaults,
    /// Ids that end generation unless a request sets `ignore_eos`.
    pub eos: Vec<i64>,
}

impl TextSide {
    /// Reads `tokenizer.json`, `tokenizer_config.json` (or `chat_template.jinja`, which
    /// transformers prefers when present), `generation_config.json` and the EOS ids of
    /// `dir`. A missing file leaves its part out; a malformed one is an error naming it.
    pub fn open(dir: &Path) -> Result<TextSide, ServeError> {
        let tokenizer = if dir.join("tokenizer.json").exists() {
            Some(TextTokenizer::open(dir)?)
        } else {
            None
        };
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json_if_present(&config_path)?.unwrap_or(Value::Null);
        let bad = |message: String| ServeError::ModelFile {
            path: config_path.clone(),
            message,
        };
        let jinja_path = dir.join("chat_template.jinja");
        let chat_template = match read_text_if_present(&jinja_path)? {
            Some(text) => Some(text),
            None => template_of(&config).map_err(bad)?,
        };
        let token = |key: &str| match config.get(key) {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).map(String::from),
            _ => None,
        };
        let (bos_token, eos_token) = (token("bos_token"), token("eos_token"));
        if let Some(source) = &chat_template {
            // Refused at start, not at the first chat request.
            ChatTemplate::new(source).map_err(|message| ServeError::ModelFile {
                path: if jinja_path.exists() {
                    jinja_path.clone()
                } else {
                    config_path.clone()
                },
                message: format!("the chat template does not compile: {message}"),
            })?;
        }
        let generation_path = dir.join("generation_config.json");
        let defaults = match read_json_if_present(&generation_path)? {
            None => GenerationDefaults::default(),
            Some(json) => generation_defaults(&json).map_err(|message| ServeError::ModelFile {
                path: generation_path.clone(),
                message,
            })?,
        };
        Ok(TextSide {
            tokenizer,
            chat_template,
            bos_token,
            eos_token,
            defaults,
            eos: stop_ids(dir)?,
        })
    }
}

fn read_text_if_present(path: &Path) -> Result<Option<String>, ServeError> {
    match crate::fsio_check::read_regular_text(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ServeError::ModelFile {
            path: path.to_path_buf(),
            message: format!("cannot read it: {e}"),
        }),
    }
}

/// `chat_template` of tokenizer_config.json: a string, or a list of `{name, template}` of
/// which the one named "default" is the chat template.
pub fn template_of(config: &Value) -> Result<Option<String>, String> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(items)) => {
            for item in items {
                let name = item.get("name").and_then(Value::as_str);
                let template = item.get("template").and_then(Value::as_str);
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_string())),
                    (Some(_), Some(_)) => {}
                    _ => return Err("`chat_template` as a list must hold objects with a string `name` and a string `template`".into()),
                }
            }
            Ok(None)
        }
        Some(_) => Err("`chat_template` must be a string or a list of named templates".into()),
    }
}

/// The sampling defaults of generation_config.json; a value of the wrong type is an error.
pub fn generation_defaults(json: &Value) -> Result<GenerationDefaults, String> {
    let number = |key: &str| match json.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("`{key}` must be a number, found {v}; fix or remove it")),
    };
    let whole = |key: &str| match json.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| format!("`{key}` must be a whole number, found {v}; fix or remove it")),
    };
    let max_new_tokens = match whole("max_new_tokens")? {
        None => None,
        Some(n) if n >= 1 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        Some(n) => {
            return Err(format!(
                "`max_new_tokens` is {n}; give at least 1 or remove it"
            ))
        }
    };
    Ok(GenerationDefaults {
        temperature: number("temperature")?,
        top_p: number("top_p")?,
        top_k: whole("top_k")?,
        max_new_tokens,
    })
}
