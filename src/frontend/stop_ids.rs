//! The token ids that end generation in a Hugging Face model folder: `eos_token_id` of
//! `config.json` and of `generation_config.json` (HF's `generate` reads the latter), each an
//! id or a list of ids. Any of them stops a sequence.

use super::load::read_json_if_present;
use crate::error::{Result, TpcError};
use serde_json::Value;
use std::path::Path;

/// Every end-of-sequence id the folder's two files name, in order, without repeats. A file
/// that is absent adds none; one that is not JSON, or whose `eos_token_id` is not an id or a
/// list of ids, is an error.
pub fn stop_ids(dir: &Path) -> Result<Vec<i64>> {
    let mut ids: Vec<i64> = Vec::new();
    for name in ["config.json", "generation_config.json"] {
        let path = dir.join(name);
        let Some(json) = read_json_if_present(&path)? else {
            continue;
        };
        let found = eos_token_ids(&json).map_err(|message| TpcError::HfConfig {
            path: path.clone(),
            message,
        })?;
        for id in found {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    Ok(ids)
}

/// `eos_token_id` of one file: absent or null is none, a non-negative integer is one id, a
/// list of them is every id.
pub fn eos_token_ids(json: &Value) -> std::result::Result<Vec<i64>, String> {
    if !json.is_object() {
        return Err(format!(
            "expected a JSON object with settings, found {}",
            kind_of(json)
        ));
    }
    let field = match json.get("eos_token_id") {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(v) => v,
    };
    let id = |v: &Value| {
        v.as_u64()
            .and_then(|i| i64::try_from(i).ok())
            .ok_or_else(|| {
                format!("`eos_token_id` must be a token id (a non-negative integer) or a list of token ids, found {field}; fix or remove it")
            })
    };
    match field {
        Value::Array(items) => items.iter().map(id).collect(),
        v => id(v).map(|i| vec![i]),
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
        assert_eq!(eos_token_ids(&json!({ "eos_token_id": 2 })), Ok(vec![2]));
        assert_eq!(
            eos_token_ids(&json!({ "eos_token_id": [128001, 128009] })),
            Ok(vec![128001, 128009])
        );
        assert_eq!(eos_token_ids(&json!({ "eos_token_id": [] })), Ok(vec![]));
    }

    #[test]
    fn absent_or_null_is_none() {
        assert_eq!(eos_token_ids(&json!({})), Ok(vec![]));
        assert_eq!(eos_token_ids(&json!({ "eos_token_id": null })), Ok(vec![]));
    }

    #[test]
    fn anything_else_is_refused_with_the_value() {
        for bad in [
            json!({ "eos_token_id": -1 }),
            json!({ "eos_token_id": 2.5 }),
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
    fn both_files_count_and_a_missing_one_adds_none() {
        let dir = folder("both");
        assert_eq!(stop_ids(&dir).unwrap(), Vec::<i64>::new());
        std::fs::write(dir.join("config.json"), r#"{"eos_token_id": 2}"#).unwrap();
        assert_eq!(stop_ids(&dir).unwrap(), vec![2]);
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": [2, 7]}"#,
        )
        .unwrap();
        assert_eq!(stop_ids(&dir).unwrap(), vec![2, 7]);
        std::fs::remove_file(dir.join("config.json")).unwrap();
        assert_eq!(stop_ids(&dir).unwrap(), vec![2, 7]);
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
