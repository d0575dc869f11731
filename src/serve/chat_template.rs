//! A model's chat template rendered as transformers renders it: Jinja with `trim_blocks`
//! and `lstrip_blocks`, loop controls, `tojson`, Python's string methods, and the globals
//! transformers adds (`raise_exception`, `strftime_now`).

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};

/// Template steps allowed per render: a template loops over the messages, so a render of a
/// request's messages never needs more; a runaway template ends as an error.
const FUEL: u64 = 50_000_000;

const NAME: &str = "chat";

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

/// What a chat template is given besides the messages.
pub struct ChatContext<'a> {
    pub bos_token: Option<&'a str>,
    pub eos_token: Option<&'a str>,
    pub add_generation_prompt: bool,
}

impl ChatTemplate {
    /// Compiles `source`; the error is minijinja's description of the syntax error.
    pub fn new(source: &str) -> Result<ChatTemplate, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| describe(&e))?;
        Ok(ChatTemplate { env })
    }

    /// The prompt text of `messages` (a JSON list of message objects); an error is the
    /// template's own message (`raise_exception`) or minijinja's.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        ctx: &ChatContext,
    ) -> Result<String, String> {
        let template = self.env.get_template(NAME).map_err(|e| describe(&e))?;
        template
            .render(minijinja::context! {
                messages => Value::from_serialize(messages),
                add_generation_prompt => ctx.add_generation_prompt,
                bos_token => ctx.bos_token,
                eos_token => ctx.eos_token,
            })
            .map_err(|e| describe(&e))
    }
}

/// The error's message with the detail minijinja keeps in its source chain.
fn describe(e: &Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// transformers' `raise_exception(message)`: the template refuses the conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `strftime_now(format)`: the current date and time (UTC here), formatted.
fn strftime_now(format: String) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    super::strftime::format_utc(now, &format)
}

/// Python's `json.dumps` separators without indentation: ", " between items, ": " after keys.
struct PythonCompact;

impl serde_json::ser::Formatter for PythonCompact {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// transformers' `tojson` (not Jinja's HTML-safe one): `json.dumps(x, ensure_ascii=False,
/// indent=None, sort_keys=False)` with those keywords honoured.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    let failed =
        |e: serde_json::Error| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}"));
    let out = if sort_keys {
        // serde_json's own maps sort their keys.
        dump(&serde_json::to_value(value).map_err(failed)?, indent)
    } else {
        dump(value, indent)
    }
    .map_err(failed)?;
    let text = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from(if ensure_ascii {
        ascii_escaped(&text)
    } else {
        text
    }))
}

/// `text` with every non-ASCII character written as Python's `\uXXXX` (surrogate pairs
/// past the basic plane).
fn ascii_escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    out
}

/// `value` as JSON, with Python's separators, indented by `indent` spaces if given.
fn dump<T: serde::Serialize>(
    value: &T,
    indent: Option<usize>,
) -> Result<Vec<u8>, serde_json::Error> {
    let mut out = Vec::new();
    match indent {
        Some(n) => {
            let spaces = " ".repeat(n);
            let f = serde_json::ser::PrettyFormatter::with_indent(spaces.as_bytes());
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, f))?;
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PythonCompact,
        ))?,
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ctx() -> ChatContext<'static> {
        ChatContext {
            bos_token: Some("<s>"),
            eos_token: Some("</s>"),
            add_generation_prompt: true,
        }
    }

    /// The text fixture's Llama-2-chat template (tokenizer_config.json).
    fn llama2() -> ChatTemplate {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/text/llama/tokenizer_config.json"
        );
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        ChatTemplate::new(config["chat_template"].as_str().unwrap()).unwrap()
    }

    // Expected texts: Python's jinja2 3.1 with transformers' settings (trim_blocks,
    // lstrip_blocks, loop controls, its raise_exception and tojson).

    #[test]
    fn llama2_chat_renders_as_transformers_does() {
        let t = llama2();
        let one = json!([{ "role": "user", "content": "the quick cat" }]);
        assert_eq!(
            t.render(&one, &ctx()).unwrap(),
            "<s>[INST] the quick cat [/INST]"
        );
        let four = json!([
            { "role": "system", "content": "be brief" },
            { "role": "user", "content": " the red stone " },
            { "role": "assistant", "content": "by the river" },
            { "role": "user", "content": "sat on" },
        ]);
        assert_eq!(
            t.render(&four, &ctx()).unwrap(),
            "<s>[INST] <<SYS>>\nbe brief\n<</SYS>>\n\n the red stone [/INST] by the river </s><s>[INST] sat on [/INST]"
        );
        let e = t
            .render(&json!([{ "role": "assistant", "content": "x" }]), &ctx())
            .unwrap_err();
        assert!(e.contains("Conversation roles must alternate"), "{e}");
    }

    #[test]
    fn loop_controls_tojson_namespace_and_python_methods() {
        let source = "{%- set ns = namespace(n=0) -%}\n{% for m in messages %}\n  {% if m.role == 'skip' %}{% continue %}{% endif %}\n  {% if loop.index > 3 %}{% break %}{% endif %}\n  {% set ns.n = ns.n + 1 %}\n<|{{ m.role }}|>{{ m.content | trim }}{{ m | tojson }}\n{% endfor %}\n{% if add_generation_prompt %}<|assistant|>{{ ns.n }}{{ 'Hello'.upper() }}{{ ' x '.strip() }}{{ 'a,b'.split(',') | length }}{% endif %}";
        let t = ChatTemplate::new(source).unwrap();
        let messages = json!([
            { "role": "user", "content": " hi " },
            { "role": "skip", "content": "no" },
            { "role": "assistant", "content": "yo" },
            { "role": "user", "content": "q" },
            { "role": "user", "content": "dropped" },
        ]);
        assert_eq!(
            t.render(&messages, &ctx()).unwrap(),
            "<|user|>hi{\"content\": \" hi \", \"role\": \"user\"}\n<|assistant|>yo{\"content\": \"yo\", \"role\": \"assistant\"}\n<|assistant|>2HELLOx2"
        );
    }

    #[test]
    fn tojson_takes_pythons_keywords() {
        let t = ChatTemplate::new(
            "{{ messages[0] | tojson(indent=2) }}|{{ messages[0].content | tojson(ensure_ascii=true) }}|{{ messages[0] | tojson(sort_keys=true) }}",
        )
        .unwrap();
        let m = json!([{ "role": "user", "content": "é😀" }]);
        assert_eq!(
            t.render(&m, &ctx()).unwrap(),
            "{\n  \"content\": \"é😀\",\n  \"role\": \"user\"\n}|\"\\u00e9\\ud83d\\ude00\"|{\"content\": \"é😀\", \"role\": \"user\"}"
        );
        let e = ChatTemplate::new("{{ 1 | tojson(colour=1) }}")
            .unwrap()
            .render(&m, &ctx())
            .unwrap_err();
        assert!(e.contains("colour"), "{e}");
    }

    #[test]
    fn strftime_now_gives_a_date() {
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}").unwrap();
        let year: i64 = t.render(&json!([]), &ctx()).unwrap().parse().unwrap();
        assert!(year >= 2024, "{year}");
    }

    #[test]
    fn a_syntax_error_is_refused_when_compiled_and_a_runaway_template_stops() {
        let e = ChatTemplate::new("{% for m in messages %}").err().unwrap();
        assert!(e.contains("syntax") || e.contains("unexpected"), "{e}");
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        )
        .unwrap();
        let e = t.render(&json!([]), &ctx()).unwrap_err();
        assert!(e.contains("fuel"), "{e}");
    }
}
