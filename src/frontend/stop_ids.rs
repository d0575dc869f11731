//! The token ids that end generation in a Hugging Face model folder: `eos_token_id` of
//! `generation_config.json` where that file gives one, else that of `config.json`; an id or a
//! list of ids. Any of them stops a sequence.

use super::load::read_json_if_present;
use crate::error::{Result, TpcError};
use serde_json::Value;
use std::path::Path;

/// The end-of-sequence ids `generate` stops on, without repeats.
///
/// transformers' `from_pretrained` replaces the generation settings derived from
/// `config.json` with those of `generation_config.json` when that file exists, so its
/// `eos_token_id` wins (Llama-3-Instruct lists `<|eot_id|>` only there, and an id that
/// config.json names but the generation file leaves out does not stop). Where the generation
/// file is absent or does not set the field (null or missing), config.json's is used: files
/// written by transformers copy config.json's id, and for the legacy `_from_model_config`
/// files transformers itself falls back to the model config.
///
/// Every id must be an integer in `[0, vocab_size)` of config.json; anything else (a string,
/// a float, a negative, an id past the vocabulary) is refused naming the file, the field and
/// the value, since an id that can never be produced would silently never stop a run.
pub fn stop_ids(dir: &Path) -> Result<Vec<i64>> {
    let config_path = dir.join("config.json");
    let config = read_json_if_present(&config_path)?;
    let generation_path = dir.join("generation_config.json");
    let generation = read_json_if_present(&generation_path)?;
    let from_file = |path: &Path, json: &Value| {
        eos_token_ids(json).map_err(|message| TpcError::HfConfig {
            path: path.to_path_buf(),
            message,
        })
    };
    let config_ids = match &config {
        Some(json) => from_file(&config_path, json)?,
        None => None,
    };
    let generation_ids = match &generation {
        Some(json) => from_file(&generation_path, json)?,
        None => None,
    };
    let (path, found) = match (generation_ids, config_ids) {
        (Some(ids), _) => (&generation_path, ids),
        (None, Some(ids)) => (&config_path, ids),
        (None, None) => return Ok(vec![]),
    };
    if found.is_empty() {
        return Ok(vec![]);
    }
    let vocab = config
        .as_ref()
        .and_then(|c| c.get("vocab_size"))
        .and_then(Value::as_u64)
        .ok_or_else(|| TpcError::HfConfig {
            path: config_path.clone(),
            message: "needs `vocab_size` (a positive integer) to check the end-of-sequence ids against; add it".into(),
        })?;
    let mut ids: Vec<i64> = Vec::new();
    for id in found {
        if id >= vocab {
            return Err(TpcError::HfConfig {
                path: path.clone(),
                message: format!(
                    "`eos_token_id` {id} is not a token of this model: ids run from 0 to {} (`vocab_size` {vocab} in config.json); fix or remove it",
                    vocab.saturating_sub(1)
                ),
            });
        }
        // Below vocab_size, which came from JSON as a u64; i64 holds every id a run can emit.
        let id = i64::try_from(id).map_err(|_| TpcError::HfConfig {
            path: path.clone(),
            message: format!("`eos_token_id` {id} is too large; fix or remove it"),
        })?;
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    Ok(ids)
}

/// `eos_token_id` of one file: `None` when absent or null, else the ids it names (a
/// non-negative integer is one id, a list of them every id; an empty list stops on nothing).
pub fn eos_token_ids(json: &Value) -> std::result::Result<Option<Vec<u64>>, String> {
    if !json.is_object() {
        return Err(format!(
            "expected a JSON object with settings, found {}",
            kind_of(json)
        ));
    }
    let field = match json.get("eos_token_id") {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    let id = |v: &Value| {
        v.as_u64().ok_or_else(|| {
            format!("`eos_token_id` must be a token id (a non-negative integer) or a list of token ids, found {field}; fix or remove it")
        })
    };
    match field {
        Value::Array(items) => items
            .iter()
            .map(id)
            .collect::<std::result::Result<_, _>>()
            .map(Some),
        v => id(v).map(|i| Some(vec![i])),
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_id_or_a_list_of_ids() {
        assert_eq!(
            eos_token_ids(&json!({ "eos_token_id": 2 })),
            Ok(Some(vec![2]))
        );
        assert_eq!(
            eos_token_ids(&json!({ "eos_token_id": [128001, 128009] })),
            Ok(Some(vec![128001, 128009]))
        );
        assert_eq!(
            eos_token_ids(&json!({ "eos_token_id": [] })),
            Ok(Some(vec![]))
        );
    }

    #[test]
    fn absent_or_null_is_none() {
        assert_eq!(eos_token_ids(&json!({})), Ok(None));
        assert_eq!(eos_token_ids(&json!({ "eos_token_id": null })), Ok(None));
    }

    #[test]
    fn anything_else_is_refused_with_the_value() {
        for bad in [
            json!({ "eos_token_id": -1 }),
            json!({ "eos_token_id": 2.5 }),
            json!({ "eos_token_id": 2.0 }),
            json!({ "eos_token_id": 1e30 }),
            json!({ "eos_token_id": "</s>" }),
            json!({ "eos_token_id": [2, "x"] }),
            json!({ "eos_token_id": { "id": 2 } }),
        ] {
            let e = eos_token_ids(&bad).unwrap_err();
            assert!(
                e.contains("eos_token_id") && e.contains("list of token ids"),
                "{e}"
            );
            assert!(e.contains(&bad["eos_token_id"].to_string()), "{e}");
        }
        let e = eos_token_ids(&json!([2])).unwrap_err();
        assert!(e.contains("a list"), "{e}");
    }

    /// A folder of its own under the system's temporary folder.
    fn folder(test: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("tpc-stop-ids-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_generation_file_wins_and_config_json_is_the_fallback() {
        let dir = folder("override");
        assert_eq!(stop_ids(&dir).unwrap(), Vec::<i64>::new());
        std::fs::write(
            dir.join("config.json"),
            r#"{"vocab_size": 10, "eos_token_id": 2}"#,
        )
        .unwrap();
        assert_eq!(stop_ids(&dir).unwrap(), vec![2]);
        // A generation file without the field (or with null) keeps config.json's.
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"do_sample": false}"#,
        )
        .unwrap();
        assert_eq!(stop_ids(&dir).unwrap(), vec![2]);
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": null}"#,
        )
        .unwrap();
        assert_eq!(stop_ids(&dir).unwrap(), vec![2]);
        // One that sets it replaces config.json's (as transformers' generate does), not adds.
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": [7, 9, 7]}"#,
        )
        .unwrap();
        assert_eq!(stop_ids(&dir).unwrap(), vec![7, 9]);
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": []}"#,
        )
        .unwrap();
        assert_eq!(stop_ids(&dir).unwrap(), Vec::<i64>::new());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_id_past_the_vocabulary_is_refused_naming_file_field_and_value() {
        let dir = folder("range");
        std::fs::write(dir.join("config.json"), r#"{"vocab_size": 250}"#).unwrap();
        for (value, id) in [("250", "250"), ("[3, 99999999999]", "99999999999")] {
            std::fs::write(
                dir.join("generation_config.json"),
                format!(r#"{{"eos_token_id": {value}}}"#),
            )
            .unwrap();
            let e = stop_ids(&dir).unwrap_err().to_string();
            assert!(
                e.contains("generation_config.json")
                    && e.contains("eos_token_id")
                    && e.contains(id)
                    && e.contains("vocab_size"),
                "{e}"
            );
        }
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": 249}"#,
        )
        .unwrap();
        assert_eq!(stop_ids(&dir).unwrap(), vec![249]);
        // The same check for config.json's own id.
        std::fs::remove_file(dir.join("generation_config.json")).unwrap();
        std::fs::write(
            dir.join("config.json"),
            r#"{"vocab_size": 250, "eos_token_id": 9223372036854775808}"#,
        )
        .unwrap();
        let e = stop_ids(&dir).unwrap_err().to_string();
        assert!(
            e.contains("config.json") && e.contains("9223372036854775808"),
            "{e}"
        );
        // Without a vocabulary size an id cannot be checked: refused, not trusted.
        std::fs::write(dir.join("config.json"), r#"{"eos_token_id": 2}"#).unwrap();
        let e = stop_ids(&dir).unwrap_err().to_string();
        assert!(e.contains("config.json") && e.contains("vocab_size"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_malformed_file_is_an_error_naming_it() {
        let dir = folder("malformed");
        std::fs::write(dir.join("generation_config.json"), "{ not json").unwrap();
        let e = stop_ids(&dir).unwrap_err().to_string();
        assert!(
            e.contains("generation_config.json") && e.contains("JSON"),
            "{e}"
        );
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": "2"}"#,
        )
        .unwrap();
        let e = stop_ids(&dir).unwrap_err().to_string();
        assert!(
            e.contains("generation_config.json") && e.contains("eos_token_id"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
