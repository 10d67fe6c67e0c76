//! Chat templates: the Jinja templates GGUF files carry in `tokenizer.chat_template`.

use minijinja::value::Value;
use minijinja::{context, Environment, Error, ErrorKind};

const TEMPLATE_NAME: &str = "chat";

/// Prefix that marks an error as coming from the template's own `raise_exception` call,
/// so it can be told apart from a broken template.
const RAISE_MARKER: &str = "\u{1}raise_exception\u{1}";

/// One chat turn, as Hugging Face's `apply_chat_template` receives it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// The turn's text; empty for an assistant turn that only calls tools.
    pub content: String,
    /// An assistant turn's calls: `[{"id", "type": "function", "function": {"name",
    /// "arguments"}}]`, the arguments an object (as templates index them) where they parse
    /// as one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool turn's answer: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool turn's function name, or a participant's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An earlier assistant turn's thoughts, as the server returned them apart from its
    /// content (Qwen3's template shows those of the turns after the last question).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }

    /// The message as the template sees it.
    fn to_value(&self) -> Value {
        let mut pairs: Vec<(&str, Value)> = vec![("role", Value::from(self.role.clone()))];
        // Always a string, empty for a turn that only calls tools: templates test it with
        // `in` and `.split`, which fail on none (llama.cpp and vLLM pass "" too).
        pairs.push(("content", Value::from(self.content.clone())));
        if let Some(calls) = &self.tool_calls {
            pairs.push(("tool_calls", Value::from(minijinja::value::Serde(calls))));
        }
        if let Some(id) = &self.tool_call_id {
            pairs.push(("tool_call_id", Value::from(id.clone())));
        }
        if let Some(name) = &self.name {
            pairs.push(("name", Value::from(name.clone())));
        }
        if let Some(thoughts) = &self.reasoning_content {
            pairs.push(("reasoning_content", Value::from(thoughts.clone())));
        }
        Value::from_pairs(pairs)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("chat template does not compile: {0}")]
    Compile(#[source] Error),
    /// The template rejected the conversation itself (e.g. roles that do not alternate);
    /// the request, not the template, is at fault.
    #[error("chat template rejected the conversation: {0}")]
    Raised(String),
    #[error("chat template failed to render: {0}")]
    Render(#[source] Error),
}

/// A compiled chat template.
///
/// Whitespace handling follows what both Hugging Face transformers and llama.cpp (minja)
/// use for chat templates — `trim_blocks` and `lstrip_blocks` on, trailing newline
/// dropped — since templates are written against those settings.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

/// Seconds since the Unix epoch (UTC) that `strftime_now` renders, when pinned (tests compare
/// with renderings recorded on another day); unpinned, it is the time of rendering.
static PINNED_NOW: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(i64::MIN);

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// The variables the renderer defines itself, which a request's own variables may not
    /// set: the conversation, the tools, the generation prompt's switch, the special
    /// tokens, the date and the renderer's functions.
    pub const RENDERER_VARIABLES: [&'static str; 8] = [
        "messages",
        "tools",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "date_string",
        "raise_exception",
        "strftime_now",
    ];

    /// Compiles `source`. `bos_token` and `eos_token` render as empty strings unless set
    /// with [`Self::with_special_tokens`].
    pub fn new(source: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(TemplateError::Compile)?;
        env.set_syntax(syntax);
        // Python string/dict/list methods (`.strip()`, `.startswith()`, `.items()`, ...)
        // that Hugging Face templates call freely.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("{RAISE_MARKER}{msg}"),
            ))
        });
        // Templates that print today's date (Llama 3.x, Mistral, Granite) call this, as
        // Hugging Face's and llama.cpp's renderers provide it.
        env.add_function("strftime_now", |format: String| -> Result<Value, Error> {
            crate::strftime::format(now(), &format)
                .map(Value::from)
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e))
        });
        env.add_filter("tojson", crate::pyjson::tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(TemplateError::Compile)?;
        Ok(ChatTemplate {
            env,
            source: source.to_owned(),
            bos_token: String::new(),
            eos_token: String::new(),
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Pins the time every template's `strftime_now` renders (seconds since the Unix epoch,
    /// UTC), for comparing with a rendering recorded at that time.
    pub fn pin_now(unix_seconds: i64) {
        PINNED_NOW.store(unix_seconds, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets the text the `bos_token` and `eos_token` template variables render as.
    pub fn with_special_tokens(
        mut self,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Self {
        self.bos_token = bos_token.into();
        self.eos_token = eos_token.into();
        self
    }

    /// Renders the prompt for `messages`; with `add_generation_prompt` the template appends
    /// the header that opens the assistant's turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// As [`Self::render`], with the request's `tools` (OpenAI's `[{"type": "function",
    /// "function": {...}}]`) as the template's `tools` variable; absent, it is undefined,
    /// as it is for llama.cpp's and Hugging Face's renderers.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with_variables(messages, tools, None, add_generation_prompt)
    }

    /// As [`Self::render_with_tools`], with a request's own template variables (OpenAI-
    /// compatible servers' `chat_template_kwargs`, e.g. `enable_thinking: false`). They
    /// may set any variable but those the renderer itself defines
    /// ([`Self::RENDERER_VARIABLES`], which win over them): a variable cannot replace the
    /// conversation, the tools or the special tokens.
    pub fn render_with_variables(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        variables: Option<&serde_json::Map<String, serde_json::Value>>,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let messages: Value = messages.iter().map(ChatMessage::to_value).collect();
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(TemplateError::Render)?;
        let tools = tools.map_or(Value::UNDEFINED, |t| {
            Value::from(minijinja::value::Serde(t))
        });
        // The renderer's functions are globals, which a context variable would shadow.
        let requested: std::collections::BTreeMap<String, Value> = variables
            .into_iter()
            .flatten()
            .filter(|(name, _)| !Self::RENDERER_VARIABLES.contains(&name.as_str()))
            .map(|(name, v)| (name.clone(), Value::from(minijinja::value::Serde(v))))
            .collect();
        let requested = Value::from(requested);
        // What llama.cpp's server passes every template, where a request does not say
        // otherwise: thinking left on for templates with a reasoning switch (as their own
        // default is).
        let defaults = context! { enable_thinking => true };
        let own = context! {
            messages,
            tools,
            add_generation_prompt,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
            // Today's date for the templates that print it (Llama 3.x), as llama.cpp's
            // server passes it.
            date_string => today("%d %b %Y"),
        };
        // The last map that holds a name gives its value (minijinja 3's `merge_maps`; the
        // corpus test and `request_variables_set_defaults_but_never_the_renderers_own`
        // would see the order turned round).
        template
            .render(minijinja::value::merge_maps([defaults, requested, own]))
            .map_err(|e| match raised_message(&e) {
                Some(msg) => TemplateError::Raised(msg),
                None => TemplateError::Render(e),
            })
    }
}

/// Seconds since the Unix epoch: the pinned time, if any ([`ChatTemplate::pin_now`]).
fn now() -> i64 {
    let pinned = PINNED_NOW.load(std::sync::atomic::Ordering::Relaxed);
    if pinned != i64::MIN {
        return pinned;
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn today(format: &str) -> String {
    crate::strftime::format(now(), format).unwrap_or_default()
}

fn raised_message(e: &Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(mj) = err.downcast_ref::<Error>() {
            if let Some(msg) = mj.detail().and_then(|d| d.strip_prefix(RAISE_MARKER)) {
                return Some(msg.to_owned());
            }
        }
        cur = err.source();
    }
    None
}
