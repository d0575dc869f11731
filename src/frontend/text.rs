//! Text in and out of a Hugging Face model folder: `tokenizer.json`, with the special tokens
//! HF's tokenizer adds to a prompt by default.
//!
//! The rule, per token: `tokenizer_config.json`'s `add_bos_token` (with `bos_token`) decides
//! the token before the text and `add_eos_token` (with `eos_token`) the one after it; a flag
//! the file does not set leaves what `tokenizer.json`'s post-processor adds (BOS for
//! Llama/Mistral, nothing for GPT-2 or Qwen). Where the two files agree, as published
//! checkpoints do, this is what both transformers 4 and 5 produce. Where they disagree,
//! transformers 4 follows the flags for Llama tokenizers and transformers 5 follows
//! `tokenizer.json`; tpc follows the flags and says so ([`TextTokenizer::note`]).

use super::load::read_json_if_present;
use crate::error::{Result, TpcError};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Special-token ids put before and after a prompt's own tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Frame {
    pub before: Vec<u32>,
    pub after: Vec<u32>,
}

/// What `tokenizer_config.json` says about special tokens; `None` where it says nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokenFlags {
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

impl SpecialTokenFlags {
    /// Reads the four keys of a `tokenizer_config.json`; the message of an error says which
    /// key is wrong and what it should be.
    pub fn parse(json: &Value) -> std::result::Result<Self, String> {
        if !json.is_object() {
            return Err("expected a JSON object of tokenizer settings".into());
        }
        let flag = |key: &str| match json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(format!("`{key}` must be true or false, found {v}")),
        };
        // A token is its text, or an AddedToken object whose `content` is the text.
        let token = |key: &str| {
            match json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v @ Value::Object(o)) => match o.get("content") {
                Some(Value::String(s)) => Ok(Some(s.clone())),
                _ => Err(format!(
                    "`{key}` must be the token's text or an object with its text in `content`, found {v}"
                )),
            },
            Some(v) => Err(format!(
                "`{key}` must be the token's text or an object with its text in `content`, found {v}"
            )),
        }
        };
        Ok(SpecialTokenFlags {
            add_bos: flag("add_bos_token")?,
            add_eos: flag("add_eos_token")?,
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
        })
    }
}

/// The special tokens around a prompt: each flag `flags` sets decides its side (its token
/// looked up with `id_of`); an unset one keeps that side of `template`, what tokenizer.json's
/// post-processor adds.
pub fn frame(
    flags: &SpecialTokenFlags,
    template: &Frame,
    id_of: &dyn Fn(&str) -> Option<u32>,
) -> std::result::Result<Frame, String> {
    let side = |add: Option<bool>, token: &Option<String>, key: &str, kept: &[u32]| match add {
        None => Ok(kept.to_vec()),
        Some(false) => Ok(vec![]),
        Some(true) => {
            let text = token.as_deref().ok_or_else(|| {
                format!("`add_{key}` is true but `{key}` names no token; name it, or set `add_{key}` to false")
            })?;
            id_of(text).map(|id| vec![id]).ok_or_else(|| {
                format!("`{key}` is `{text}`, which tokenizer.json does not know; name one of its tokens")
            })
        }
    };
    Ok(Frame {
        before: side(
            flags.add_bos,
            &flags.bos_token,
            "bos_token",
            &template.before,
        )?,
        after: side(
            flags.add_eos,
            &flags.eos_token,
            "eos_token",
            &template.after,
        )?,
    })
}

/// Splits a text's ids with special tokens (`with`) around its ids without (`without`).
/// Text the tokenizer makes no ids of leaves the template's tokens all before it.
pub fn split_template(with: &[u32], without: &[u32]) -> Option<Frame> {
    if without.is_empty() {
        return Some(Frame {
            before: with.to_vec(),
            after: vec![],
        });
    }
    let n = without.len();
    let start = with.windows(n).position(|w| w == without)?;
    Some(Frame {
        before: with[..start].to_vec(),
        after: with[start + n..].to_vec(),
    })
}

/// Text the post-processor's template is read from (any text of at least one token does).
const PROBE: &str = "a";

/// A model folder's tokenizer, with the special tokens its prompts get.
pub struct TextTokenizer {
    tokenizer: tokenizers::Tokenizer,
    path: PathBuf,
    frame: Frame,
    note: Option<String>,
}

impl TextTokenizer {
    /// Reads `dir/tokenizer.json` and, when the folder has one, `dir/tokenizer_config.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(TpcError::HfConfig {
                path,
                message: "a text prompt needs this file (the model's Hugging Face tokenizer); give token ids instead".into(),
            });
        }
        // Read here, not by the tokenizers crate, so that a FIFO or device is refused.
        let text = crate::fsio::read_text(&path)?;
        let tokenizer: tokenizers::Tokenizer = text.parse().map_err(|e| TpcError::HfConfig {
            path: path.clone(),
            message: format!("not a tokenizer tpc can read: {e}"),
        })?;
        let config_path = dir.join("tokenizer_config.json");
        let flags = match read_json_if_present(&config_path)? {
            None => SpecialTokenFlags::default(),
            Some(json) => {
                SpecialTokenFlags::parse(&json).map_err(|message| TpcError::HfConfig {
                    path: config_path.clone(),
                    message,
                })?
            }
        };
        Self::new(tokenizer, path, &flags, &config_path)
    }

    /// `tokenizer` (read from `path`) with the special tokens `flags` (read from
    /// `config_path`) and its post-processor decide.
    pub fn new(
        tokenizer: tokenizers::Tokenizer,
        path: PathBuf,
        flags: &SpecialTokenFlags,
        config_path: &Path,
    ) -> Result<Self> {
        let ids = |special| -> Result<Vec<u32>> {
            Ok(tokenizer
                .encode(PROBE, special)
                .map_err(|e| TpcError::HfConfig {
                    path: path.clone(),
                    message: format!("the tokenizer fails on the text `{PROBE}`: {e}"),
                })?
                .get_ids()
                .to_vec())
        };
        let (with, without) = (ids(true)?, ids(false)?);
        let template = split_template(&with, &without).ok_or_else(|| TpcError::HfConfig {
            path: path.clone(),
            message: "the post-processor changes the text's own tokens, not only adds special tokens around them; tpc cannot tell which tokens it adds".into(),
        })?;
        let frame = frame(flags, &template, &|t| tokenizer.token_to_id(t)).map_err(|message| {
            TpcError::HfConfig {
                path: config_path.to_path_buf(),
                message,
            }
        })?;
        let note = disagreement(flags, &template, &frame);
        Ok(TextTokenizer {
            tokenizer,
            path,
            frame,
            note,
        })
    }

    /// The prompt's ids: the text's own tokens between the special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<i64>> {
        let own = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| TpcError::HfConfig {
                path: self.path.clone(),
                message: format!("cannot tokenize the prompt: {e}"),
            })?;
        Ok(self
            .frame
            .before
            .iter()
            .chain(own.get_ids())
            .chain(&self.frame.after)
            .map(|&i| i64::from(i))
            .collect())
    }

    /// The text of generated ids, special tokens left out.
    pub fn decode(&self, ids: &[i64]) -> Result<String> {
        let ids: Vec<u32> = ids
            .iter()
            .map(|&i| {
                u32::try_from(i).map_err(|_| TpcError::HfConfig {
                    path: self.path.clone(),
                    message: format!("cannot decode the token id {i}: ids are 0 to 2^32 - 1"),
                })
            })
            .collect::<Result<_>>()?;
        self.tokenizer
            .decode(&ids, true)
            .map_err(|e| TpcError::HfConfig {
                path: self.path.clone(),
                message: format!("cannot decode the output: {e}"),
            })
    }

    /// The ids of a text that holds its special tokens already (a rendered chat template):
    /// the text's own tokens, none added around them.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<i64>> {
        let own = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| TpcError::HfConfig {
                path: self.path.clone(),
                message: format!("cannot tokenize the prompt: {e}"),
            })?;
        Ok(own.get_ids().iter().map(|&i| i64::from(i)).collect())
    }

    /// One token's text as it reads after the token `after` (if any), so that a decoder's
    /// rules for a text's first token (Llama's leading space) apply as in the whole text;
    /// a special token's text included (log-probability listings name every token). `None`
    /// for an id the tokenizer does not know.
    pub fn token_text(&self, id: i64, after: Option<i64>) -> Option<String> {
        let known = |i: i64| {
            u32::try_from(i)
                .ok()
                .filter(|&i| self.tokenizer.id_to_token(i).is_some())
        };
        let id = known(id)?;
        let alone = || self.tokenizer.decode(&[id], false).ok();
        let Some(before) = after.and_then(known) else {
            return alone();
        };
        let prefix = self.tokenizer.decode(&[before], false).ok()?;
        let both = self.tokenizer.decode(&[before, id], false).ok()?;
        match both.strip_prefix(prefix.as_str()) {
            Some(rest) => Some(rest.to_string()),
            None => alone(),
        }
    }

    /// The special tokens every prompt gets.
    pub fn frame(&self) -> &Frame {
        &self.frame
    }

    /// A sentence for the user where tokenizer_config.json's flags override what
    /// tokenizer.json's post-processor adds (the HF versions differ there).
    pub fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }
}

fn disagreement(flags: &SpecialTokenFlags, template: &Frame, chosen: &Frame) -> Option<String> {
    if chosen == template {
        return None;
    }
    let mut said = Vec::new();
    if let Some(add) = flags.add_bos {
        said.push(format!("add_bos_token {add}"));
    }
    if let Some(add) = flags.add_eos {
        said.push(format!("add_eos_token {add}"));
    }
    Some(format!(
        "tokenizer_config.json sets {} while tokenizer.json's post-processor adds {:?} before and {:?} after the text; tpc follows tokenizer_config.json ({:?} before, {:?} after), as transformers 4 does for Llama tokenizers; transformers 5 follows tokenizer.json",
        said.join(" and "),
        template.before,
        template.after,
        chosen.before,
        chosen.after
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A word-level tokenizer with <unk> 0, <s> 1, </s> 2, and `post_processor` (JSON).
    fn tokenizer(post_processor: Value) -> tokenizers::Tokenizer {
        let special = |id: u32, content: &str| {
            json!({ "id": id, "content": content, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true })
        };
        let json = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
            "normalizer": null,
            "pre_tokenizer": { "type": "Whitespace" },
            "post_processor": post_processor,
            "decoder": null,
            "model": {
                "type": "WordLevel",
                "vocab": { "<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "cat": 4, "sat": 5 },
                "unk_token": "<unk>"
            }
        });
        tokenizers::Tokenizer::from_bytes(json.to_string()).unwrap()
    }

    /// Llama-2's post-processor: `<s>` first.
    fn bos_template() -> Value {
        json!({
            "type": "TemplateProcessing",
            "single": [
                { "SpecialToken": { "id": "<s>", "type_id": 0 } },
                { "Sequence": { "id": "A", "type_id": 0 } }
            ],
            "pair": [
                { "SpecialToken": { "id": "<s>", "type_id": 0 } },
                { "Sequence": { "id": "A", "type_id": 0 } },
                { "Sequence": { "id": "B", "type_id": 1 } }
            ],
            "special_tokens": { "<s>": { "id": "<s>", "ids": [1], "tokens": ["<s>"] } }
        })
    }

    fn encode(post_processor: Value, config: Value) -> Result<Vec<i64>> {
        let flags = SpecialTokenFlags::parse(&config).unwrap();
        let t = TextTokenizer::new(
            tokenizer(post_processor),
            "tokenizer.json".into(),
            &flags,
            Path::new("tokenizer_config.json"),
        )?;
        t.encode("a cat sat")
    }

    #[test]
    fn without_flags_the_post_processor_decides() {
        assert_eq!(encode(bos_template(), json!({})).unwrap(), [1, 3, 4, 5]);
        assert_eq!(encode(Value::Null, json!({})).unwrap(), [3, 4, 5]);
        // The same as the tokenizers crate's own `encode(text, true)`.
        let own = tokenizer(bos_template()).encode("a cat sat", true).unwrap();
        assert_eq!(own.get_ids(), [1, 3, 4, 5]);
    }

    #[test]
    fn add_bos_token_adds_the_named_token() {
        let llama = json!({ "add_bos_token": true, "add_eos_token": false, "bos_token": "<s>", "eos_token": "</s>" });
        assert_eq!(encode(bos_template(), llama.clone()).unwrap(), [1, 3, 4, 5]);
        // The flag decides even where tokenizer.json's post-processor adds nothing.
        assert_eq!(encode(Value::Null, llama).unwrap(), [1, 3, 4, 5]);
        // An AddedToken object names its token in `content`.
        let object = json!({ "add_bos_token": true, "bos_token": { "__type": "AddedToken", "content": "<s>" } });
        assert_eq!(encode(Value::Null, object).unwrap(), [1, 3, 4, 5]);
    }

    #[test]
    fn add_bos_token_false_drops_the_templates_bos() {
        let no_bos = json!({ "add_bos_token": false, "bos_token": "<s>" });
        assert_eq!(encode(bos_template(), no_bos).unwrap(), [3, 4, 5]);
    }

    #[test]
    fn add_eos_token_appends_the_eos() {
        let both = json!({ "add_bos_token": true, "add_eos_token": true, "bos_token": "<s>", "eos_token": "</s>" });
        assert_eq!(encode(bos_template(), both).unwrap(), [1, 3, 4, 5, 2]);
        // Only add_eos_token set: the BOS still comes from the post-processor.
        let eos_only = json!({ "add_eos_token": true, "eos_token": "</s>" });
        assert_eq!(encode(bos_template(), eos_only).unwrap(), [1, 3, 4, 5, 2]);
    }

    #[test]
    fn a_disagreement_between_the_files_is_noted() {
        let flags = SpecialTokenFlags::parse(&json!({ "add_bos_token": false })).unwrap();
        let cfg = Path::new("tokenizer_config.json");
        let t = TextTokenizer::new(tokenizer(bos_template()), "t".into(), &flags, cfg).unwrap();
        let note = t.note().unwrap();
        assert!(
            note.contains("add_bos_token false") && note.contains("transformers 5"),
            "{note}"
        );
        let flags = SpecialTokenFlags::parse(&json!({ "add_bos_token": true, "bos_token": "<s>" }))
            .unwrap();
        let t = TextTokenizer::new(tokenizer(bos_template()), "t".into(), &flags, cfg).unwrap();
        assert_eq!(t.note(), None);
    }

    #[test]
    fn a_flag_without_a_known_token_is_an_error() {
        let e = encode(Value::Null, json!({ "add_bos_token": true }))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokenizer_config.json") && e.contains("`bos_token` names no token"),
            "{e}"
        );
        let e = encode(
            Value::Null,
            json!({ "add_bos_token": true, "bos_token": "<bos>" }),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("`<bos>`") && e.contains("does not know"), "{e}");
    }

    #[test]
    fn malformed_settings_are_refused_with_the_key() {
        for (bad, key) in [
            (json!({ "add_bos_token": "yes" }), "add_bos_token"),
            (json!({ "add_eos_token": 1 }), "add_eos_token"),
            (json!({ "bos_token": 1 }), "bos_token"),
            (json!({ "eos_token": { "text": "</s>" } }), "eos_token"),
        ] {
            let e = SpecialTokenFlags::parse(&bad).unwrap_err();
            assert!(e.contains(&format!("`{key}`")), "{e}");
        }
        assert!(SpecialTokenFlags::parse(&json!([1])).is_err());
    }

    #[test]
    fn the_template_splits_around_the_texts_own_ids() {
        let f = split_template(&[1, 7, 8, 2], &[7, 8]).unwrap();
        assert_eq!((f.before, f.after), (vec![1], vec![2]));
        assert_eq!(split_template(&[7, 8], &[7, 8]).unwrap(), Frame::default());
        assert_eq!(split_template(&[1, 9], &[7]), None);
        assert_eq!(split_template(&[1], &[]).unwrap().before, vec![1]);
    }

    /// A folder of its own under the system's temporary folder.
    fn folder(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tpc-text-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_folder_files_missing_or_malformed() {
        let dir = folder("files");
        let e = TextTokenizer::open(&dir).err().unwrap().to_string();
        assert!(
            e.contains("tokenizer.json") && e.contains("token ids instead"),
            "{e}"
        );
        std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
        let e = TextTokenizer::open(&dir).err().unwrap().to_string();
        assert!(
            e.contains("tokenizer.json") && e.contains("not a tokenizer"),
            "{e}"
        );
        // Without tokenizer_config.json the post-processor decides.
        std::fs::write(
            dir.join("tokenizer.json"),
            tokenizer(bos_template()).to_string(false).unwrap(),
        )
        .unwrap();
        let t = TextTokenizer::open(&dir).unwrap();
        assert_eq!(t.encode("cat").unwrap(), [1, 4]);
        assert_eq!(t.decode(&[1, 4, 2]).unwrap(), "cat");
        // A text with its special tokens in it gets none added.
        assert_eq!(t.encode_plain("<s> cat").unwrap(), [1, 4]);
        assert_eq!(t.token_text(2, None).as_deref(), Some("</s>"));
        assert_eq!(t.token_text(4, None).as_deref(), Some("cat"));
        // After another token, as the whole text has it.
        assert_eq!(t.token_text(4, Some(3)).as_deref(), Some(" cat"));
        assert_eq!(t.token_text(4, Some(99)).as_deref(), Some("cat"));
        assert_eq!(t.token_text(99, None), None);
        assert_eq!(t.token_text(-1, Some(3)), None);
        std::fs::write(dir.join("tokenizer_config.json"), "{ \"add_bos_token\": ").unwrap();
        let e = TextTokenizer::open(&dir).err().unwrap().to_string();
        assert!(
            e.contains("tokenizer_config.json") && e.contains("JSON"),
            "{e}"
        );
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"add_bos_token": false}"#,
        )
        .unwrap();
        assert_eq!(
            TextTokenizer::open(&dir).unwrap().encode("cat").unwrap(),
            [4]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
