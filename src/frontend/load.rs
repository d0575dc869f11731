//! Reading model inputs from disk: `.ron` definitions, HF model directories and
//! `config.json` files. Syntax errors carry file, line and column.

use super::hf_config::family_from_hf_json;
use super::spec::ModelDef;
use crate::error::{Result, TpcError};
use std::path::{Path, PathBuf};

/// RON options used for every file tpc reads or writes: `Some(..)` may be omitted and
/// newtype variants take their fields directly (`Linear(weight_order: InOut)`).
pub fn ron_options() -> ron::Options {
    ron::Options::default()
        .with_default_extension(ron::extensions::Extensions::IMPLICIT_SOME)
        .with_default_extension(ron::extensions::Extensions::UNWRAP_VARIANT_NEWTYPES)
}

pub use crate::fsio::read_text;

/// ron's default recursion limit, which tpc keeps (deeper input is refused, not a stack
/// overflow).
const RON_DEPTH_LIMIT: usize = 128;

/// Parses RON text, turning errors into `file:line:column` messages.
pub fn parse_ron<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T> {
    ron_options().from_str(text).map_err(|e| TpcError::Syntax {
        path: path.to_path_buf(),
        line: e.position.line,
        column: e.position.col,
        format: "RON",
        message: match e.code {
            // ron's own text advises a crate; the user can only simplify the file.
            ron::Error::ExceededRecursionLimit => format!(
                "nested deeper than tpc reads ({RON_DEPTH_LIMIT} levels); a model never needs that, flatten the structure"
            ),
            other => other.to_string(),
        },
    })
}

/// Parses JSON text with the same kind of message.
pub fn parse_json<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| TpcError::Syntax {
        path: path.to_path_buf(),
        line: e.line(),
        column: e.column(),
        format: "JSON",
        message: strip_position(&e.to_string()),
    })
}

/// A JSON file that a model folder may hold: `None` when it is absent, an error when it
/// cannot be read or is not JSON.
pub fn read_json_if_present(path: &Path) -> Result<Option<serde_json::Value>> {
    match crate::fsio_check::read_regular_text(path) {
        Ok(text) => parse_json(path, &text).map(Some),
        Err(io) if io.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(io) => Err(TpcError::Read {
            path: path.to_path_buf(),
            io,
        }),
    }
}

fn strip_position(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg.to_string(),
    }
}

/// Where the HF `config.json` of a model argument is, if it is an HF input.
pub fn hf_config_path(path: &Path) -> Option<PathBuf> {
    if path.is_dir() {
        return Some(path.join("config.json"));
    }
    (path.extension().is_some_and(|e| e == "json")).then(|| path.to_path_buf())
}

/// Loads any model input tpc accepts.
pub fn load_model(path: &Path) -> Result<ModelDef> {
    if !path.exists() {
        return Err(TpcError::Read {
            path: path.to_path_buf(),
            io: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
        });
    }
    if let Some(cfg) = hf_config_path(path) {
        if !cfg.exists() {
            return Err(TpcError::UnknownInput {
                path: path.to_path_buf(),
                reason: "the directory has no config.json".into(),
            });
        }
        let text = read_text(&cfg)?;
        let json: serde_json::Value = parse_json(&cfg, &text)?;
        return Ok(ModelDef::Preset(family_from_hf_json(&cfg, &json)?));
    }
    if path.extension().is_some_and(|e| e == "ron") {
        let text = read_text(path)?;
        return parse_ron(path, &text);
    }
    Err(TpcError::UnknownInput {
        path: path.to_path_buf(),
        reason: "the extension is neither .ron nor .json".into(),
    })
}
