//! A model's chat template rendered as transformers renders it: Jinja with `trim_blocks`
//! and `lstrip_blocks`, loop controls, `tojson`, Python's string methods, and the globals
//! transformers adds (`raise_exception`, `strftime_now`).

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
