//! Every request check that needs no model work, for both endpoints, in the order they
//! run: the model name, the parameters (unsupported ones, ranges, limits), then what each
//! endpoint takes as input (one prompt; messages: present, few enough for the context,
//! known roles, text content, a chat template to render them). A request that passes is a
//! [`ValidCompletion`] or [`ValidChat`], ready for prompt preparation and the engine's
//! admission (the typed capacity check, which needs the prompt's tokens).

use std::sync::Arc;

use serde_json::Value;
use tokenizer::{ChatMessage, ChatTemplate};

use engine::{AdapterRef, Penalties, SamplingParams};

use crate::adapters::Catalog;
use crate::error::ApiError;
use crate::request::{ChatRequest, Common, CompletionRequest, Content, Message, Prompt, Stop};
use crate::tools::{ToolCalling, ToolFormat};
use crate::AppState;

/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;
/// Longest stop string, in UTF-8 bytes. OpenAI states no limit; stop sequences in use are
/// a few characters, and this bounds what one request can make the matcher hold
/// (`server::stop`) to 4 KiB.
pub const MAX_STOP_BYTES: usize = 1024;
/// Most alternatives per token a request may ask for.
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Most tokens one request may bias: each costs an addition per generated token.
pub const MAX_LOGIT_BIAS: usize = 1024;
/// Most choices (`n`) one request may ask for: each is a sequence of its own in the engine,
/// counted against the tenant's limits like a request.
pub const MAX_CHOICES: u64 = 16;
/// Most `stop_token_ids` one request may give: each is looked up per generated token.
pub const MAX_STOP_TOKEN_IDS: usize = 64;
/// Most variables `chat_template_kwargs` may set (templates read a few switches).
pub const MAX_TEMPLATE_VARIABLES: usize = 32;
/// Longest name of one, in bytes.
pub const MAX_TEMPLATE_VARIABLE_NAME: usize = 64;

/// What a request is checked against: the model this server serves, and the adapters its
/// tenant may select.
#[derive(Clone, Copy)]
pub struct ServedModel<'a> {
    pub name: &'a str,
    /// The requesting tenant (adapters are granted per tenant).
    pub tenant: &'a str,
    pub adapters: &'a Catalog,
    pub max_context: usize,
    pub vocab_size: usize,
    /// `None` when the model has no chat template: chat requests are then refused.
    pub template: Option<&'a Arc<ChatTemplate>>,
    pub tool_format: ToolFormat,
    /// The vocabulary's control token for the tool format's call marker, if it has one.
    pub tool_marker: Option<u32>,
}

impl<'a> ServedModel<'a> {
    pub fn of(app: &'a AppState, tenant: &'a str) -> Self {
        Self {
            name: &app.model_name,
            tenant,
            adapters: &app.adapters,
            max_context: app.backend.admission().max_context(),
            vocab_size: app.backend.admission().vocab_size(),
            template: app.template.as_ref(),
            tool_format: app.tool_format,
            tool_marker: app
                .tool_format
                .marker()
                .and_then(|m| app.tokenizer.token_id(m))
                .filter(|&id| app.tokenizer.is_control(id)),
        }
    }
}

/// A completion request that passed every check.
#[derive(Debug)]
pub struct ValidCompletion {
    pub settings: Settings,
    /// How many alternatives per token, when logprobs are wanted.
    pub logprobs: Option<usize>,
    pub prompt: PromptInput,
}

/// A chat request that passed every check.
#[derive(Debug)]
pub struct ValidChat {
    pub settings: Settings,
    /// How many alternatives per token, when logprobs are wanted.
    pub logprobs: Option<usize>,
    /// Roles normalized, contents as text, tool calls as templates take them.
    pub messages: Vec<ChatMessage>,
    pub template: Arc<ChatTemplate>,
    /// The request's tools, when it declares some and may call them.
    pub tools: Option<ToolCalling>,
    /// The request's own template variables (`chat_template_kwargs`), names checked.
    pub template_variables: Option<serde_json::Map<String, Value>>,
}

/// `/v1/completions`: model, parameters, then the prompt.
pub fn completion(
    req: &CompletionRequest,
    model: &ServedModel,
) -> Result<ValidCompletion, ApiError> {
    let adapter = select_model(model, &req.model, req.lora.as_ref())?;
    let (mut settings, logprobs) = req.parameters(model.vocab_size)?;
    settings.adapter = adapter;
    let prompt = req.single_prompt()?;
    Ok(ValidCompletion {
        settings,
        logprobs,
        prompt,
    })
}

/// `/v1/chat/completions`: model, parameters, then the messages (each role, then its
/// content, message by message), then the template.
pub fn chat(req: &ChatRequest, model: &ServedModel) -> Result<ValidChat, ApiError> {
    let adapter = select_model(model, &req.model, req.lora.as_ref())?;
    let (mut settings, logprobs) = req.parameters(model.vocab_size)?;
    settings.adapter = adapter;
    let tools = crate::tools::requested(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls.as_ref(),
        model.tool_format,
    )?;
    if let Some(grammar) = tools
        .as_ref()
        .and_then(|t| t.forced_grammar(model.tool_marker))
    {
        force_tool_call(&mut settings, grammar)?;
    }
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "invalid_value",
            Some("messages".to_owned()),
            "'messages' must contain at least one message.",
        ));
    }
    check_message_count(req.messages.len(), model.max_context)?;
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        let role = normalize_role(&m.role).ok_or_else(|| {
            ApiError::invalid(
                "invalid_value",
                Some(format!("messages[{i}].role")),
                format!(
                    "Unsupported role '{}' in messages[{i}]; use system, developer, user, assistant or tool.",
                    m.role
                ),
            )
        })?;
        m.check_fields(i, role)?;
        let mut message = ChatMessage::new(role, m.text(i)?);
        if let Some(calls) = m.tool_calls.as_ref().filter(|v| !v.is_null()) {
            message.tool_calls = Some(crate::tools::history_calls(calls, i)?);
        }
        message.reasoning_content = m.thoughts(i)?;
        if role == "tool" {
            message.tool_call_id = match m.tool_call_id.as_ref() {
                None | Some(Value::Null) => None,
                Some(Value::String(id)) => Some(id.clone()),
                Some(_) => {
                    return Err(ApiError::invalid(
                        "invalid_value",
                        Some(format!("messages[{i}].tool_call_id")),
                        format!("'messages[{i}].tool_call_id' must be a string."),
                    ))
                }
            };
            message.name = m.name.clone();
        }
        messages.push(message);
    }
    if let Some(t) = tools
        .as_ref()
        .filter(|t| !t.format.template_renders_tools())
    {
        // The generic form: the template cannot show the tools, so a system message does.
        let instructions = t.generic_instructions();
        match messages.first_mut().filter(|m| m.role == "system") {
            Some(system) => {
                system.content.push_str("\n\n");
                system.content.push_str(&instructions);
            }
            None => messages.insert(0, ChatMessage::new("system", instructions)),
        }
    }
    let Some(template) = model.template.cloned() else {
        return Err(ApiError::invalid(
            "unsupported_endpoint",
            None,
            "This model has no chat template; use /v1/completions.",
        ));
    };
    let template_variables = template_variables(req.chat_template_kwargs.as_ref())?;
    Ok(ValidChat {
        settings,
        logprobs,
        messages,
        template,
        tools,
        template_variables,
    })
}

/// `chat_template_kwargs`: an object of at most [`MAX_TEMPLATE_VARIABLES`] names, each an
/// identifier (as a template can read it) that the renderer does not define itself. The
/// values are the client's JSON; `chat_prompt` refuses strings in them that would read as
/// control tokens, since the template prints them as its own text.
fn template_variables(
    v: Option<&Value>,
) -> Result<Option<serde_json::Map<String, Value>>, ApiError> {
    const P: &str = "chat_template_kwargs";
    let map = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(map)) => map,
        Some(_) => {
            return Err(ApiError::invalid(
                "invalid_type",
                Some(P.to_owned()),
                format!("'{P}' must be an object."),
            ))
        }
    };
    if map.len() > MAX_TEMPLATE_VARIABLES {
        return Err(ApiError::invalid(
            "invalid_value",
            Some(P.to_owned()),
            format!("'{P}' may set at most {MAX_TEMPLATE_VARIABLES} variables."),
        ));
    }
    for name in map.keys() {
        let identifier = name.len() <= MAX_TEMPLATE_VARIABLE_NAME
            && name
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        // Client-chosen: only a bounded prefix is echoed.
        let shown: String = name.chars().take(MAX_TEMPLATE_VARIABLE_NAME).collect();
        if !identifier {
            return Err(ApiError::invalid(
                "invalid_value",
                Some(P.to_owned()),
                format!("'{P}' names must be identifiers of at most {MAX_TEMPLATE_VARIABLE_NAME} letters, digits or '_'; got {shown:?}."),
            ));
        }
        if ChatTemplate::RENDERER_VARIABLES.contains(&name.as_str()) {
            return Err(ApiError::invalid(
                "invalid_value",
                Some(format!("{P}.{shown}")),
                format!(
                    "'{P}' cannot set '{shown}': the server renders it from the request itself."
                ),
            ));
        }
    }
    Ok(Some(map.clone()))
}

/// A `required` or named `tool_choice`: the answer is constrained to the call grammar,
/// which no other constraint, stop string or ignore_eos may accompany.
fn force_tool_call(settings: &mut Settings, grammar: String) -> Result<(), ApiError> {
    if let Some(c) = &settings.constraint {
        return Err(ApiError::invalid(
            "invalid_value",
            param(c.param),
            format!(
                "'{}' cannot be combined with a required or named tool_choice, which constrains the answer to a call.",
                c.param
            ),
        ));
    }
    if !settings.stops.is_empty() {
        return Err(ApiError::invalid(
            "invalid_value",
            param("stop"),
            "stop cannot be combined with a required or named tool_choice: the answer ends when the call is complete.",
        ));
    }
    if settings.ignore_eos {
        return Err(ApiError::invalid(
            "invalid_value",
            param("ignore_eos"),
            "ignore_eos cannot be combined with a required or named tool_choice: the answer ends when the call is complete.",
        ));
    }
    let requested = crate::structured::Requested {
        spec: constraint::ConstraintSpec::Lark(grammar),
        // The grammar is the tools' schemas: an error in one names them.
        param: "tools",
    };
    requested
        .spec
        .check_size()
        .map_err(|e| crate::structured::compile_error("tools", &e))?;
    settings.constraint = Some(requested);
    Ok(())
}

/// The adapter a request runs under, if any: named by `model` (vLLM's convention: the
/// served model's name is the base) or by llama.cpp's `lora` list. An adapter the tenant may
/// not use is refused exactly as a model that does not exist.
fn select_model(
    served: &ServedModel,
    model: &str,
    lora: Option<&Value>,
) -> Result<Option<AdapterRef>, ApiError> {
    let by_name = if model == served.name {
        None
    } else {
        let (_, adapter) = served
            .adapters
            .select(served.tenant, model)
            .ok_or_else(|| ApiError::ModelNotFound(model.to_owned()))?;
        Some(adapter)
    };
    let Some(lora) = lora.filter(|v| !v.is_null()) else {
        return Ok(by_name);
    };
    if by_name.is_some() {
        return Err(ApiError::invalid(
            "invalid_value",
            param("lora"),
            format!(
                "'lora' cannot be combined with an adapter as 'model': send model '{}' with 'lora', or the adapter's name as 'model' alone.",
                served.name
            ),
        ));
    }
    let Some(entries) = lora.as_array() else {
        return Err(ApiError::invalid(
            "invalid_type",
            param("lora"),
            "'lora' must be a list of {\"id\": ID, \"scale\": SCALE} objects.",
        ));
    };
    if entries.len() > MAX_LORA_ENTRIES {
        return Err(ApiError::invalid(
            "invalid_value",
            param("lora"),
            format!(
                "'lora' has {} entries; at most {MAX_LORA_ENTRIES}.",
                entries.len()
            ),
        ));
    }
    let mut chosen = None;
    for (i, entry) in entries.iter().enumerate() {
        let (id, scale) = lora_entry(i, entry)?;
        // llama.cpp's clients send every adapter, the unused ones at scale 0.
        if scale == 0.0 {
            continue;
        }
        if chosen.is_some() {
            return Err(ApiError::unsupported(
                "lora",
                "At most one adapter per request may have a non-zero scale; combining adapters is not supported.",
            ));
        }
        let (loaded, adapter) = served
            .adapters
            .select_id(served.tenant, id)
            .ok_or_else(|| ApiError::AdapterIdNotFound {
                id,
                param: format!("lora[{i}].id"),
            })?;
        if scale as f32 != loaded.scale {
            return Err(ApiError::unsupported(
                &format!("lora[{i}].scale"),
                format!(
                    "Per-request LoRA scales other than the adapter's loaded scale ({}) are not supported: send scale {} (or 0 to leave it out), or ask the operator to load the adapter file under another name at the scale you need (--lora NAME=PATH,SCALE, or the operator API).",
                    loaded.scale, loaded.scale
                ),
            ));
        }
        chosen = Some(adapter);
    }
    Ok(chosen)
}

/// Most entries a `lora` list may have (llama.cpp's clients send one per adapter served).
pub const MAX_LORA_ENTRIES: usize = 1024;

/// One `{"id": ID, "scale": SCALE}` of a `lora` list.
fn lora_entry(i: usize, entry: &Value) -> Result<(u64, f64), ApiError> {
    let Some(fields) = entry.as_object() else {
        return Err(ApiError::invalid(
            "invalid_type",
            Some(format!("lora[{i}]")),
            format!("'lora[{i}]' must be an object {{\"id\": ID, \"scale\": SCALE}}."),
        ));
    };
    if let Some(other) = fields.keys().find(|k| *k != "id" && *k != "scale") {
        return Err(ApiError::unsupported(
            &format!("lora[{i}].{other}"),
            format!("Unrecognized field 'lora[{i}].{other}'; an entry has 'id' and 'scale'."),
        ));
    }
    let id = fields.get("id").and_then(Value::as_u64).ok_or_else(|| {
        ApiError::invalid(
            "invalid_value",
            Some(format!("lora[{i}].id")),
            format!("'lora[{i}].id' must be an adapter id (a whole number, as GET /lora-adapters lists them)."),
        )
    })?;
    let scale = fields
        .get("scale")
        .and_then(Value::as_f64)
        .filter(|s| s.is_finite())
        .ok_or_else(|| {
            ApiError::invalid(
                "invalid_value",
                Some(format!("lora[{i}].scale")),
                format!("'lora[{i}].scale' must be a number."),
            )
        })?;
    Ok((id, scale))
}

/// The roles a message may have. Roles are rendered into the prompt verbatim, so anything
/// else (e.g. a role containing control-token text) is refused.
pub fn normalize_role(role: &str) -> Option<&'static str> {
    match role {
        "system" | "developer" => Some("system"),
        "user" => Some("user"),
        "assistant" => Some("assistant"),
        "tool" => Some("tool"),
        _ => None,
    }
}

/// Refuses a conversation longer than the context could hold before any work is spent on
/// it: every message a chat template renders costs at least one token (its turn marker),
/// so more messages than the context has tokens can never fit. Without this, a body of
/// 100,000 empty messages was rendered and tokenized in full before admission refused it.
pub fn check_message_count(messages: usize, max_context: usize) -> Result<(), ApiError> {
    if messages > max_context {
        return Err(ApiError::invalid(
            "context_length_exceeded",
            Some("messages".to_owned()),
            format!(
                "This model's maximum context length is {max_context} tokens, and every message takes at least one; a conversation of {messages} messages cannot fit."
            ),
        ));
    }
    Ok(())
}

/// A request's generation settings after validation.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How many choices: each a sequence of its own over the one prompt.
    pub n: usize,
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// A fixed-size key derived from the client's `cache_salt` ([`salt_key`]), never the
    /// salt itself.
    pub cache_salt: Option<String>,
    pub ignore_eos: bool,
    /// A structured output, checked but not yet compiled (the prompt workers compile it).
    pub constraint: Option<crate::structured::Requested>,
    /// The LoRA adapter the request selected (`select_model`); `None`: the base model.
    pub adapter: Option<AdapterRef>,
}

/// The isolation-domain key of a client's `cache_salt`: 128 bits of keyed SipHash, as 32
/// hex digits. The domain is cloned into every cached page's visibility, every tree key
/// and lookup, so a client-chosen string of any length would multiply memory and
/// eviction cost; the key has a fixed size whatever the client sends. The hash keys are
/// random per process, so a key means nothing outside it and a client cannot aim at a
/// collision it cannot observe; different salts collide with probability about 2^-128.
pub fn salt_key(salt: &str) -> String {
    use std::hash::BuildHasher;
    static KEYS: std::sync::OnceLock<[std::collections::hash_map::RandomState; 2]> =
        std::sync::OnceLock::new();
    let keys = KEYS.get_or_init(Default::default);
    format!(
        "{:016x}{:016x}",
        keys[0].hash_one(salt),
        keys[1].hash_one(salt)
    )
}

fn param(name: &str) -> Option<String> {
    Some(name.to_owned())
}

fn check_range(
    name: &str,
    v: Option<f64>,
    lo: f64,
    hi: f64,
    lo_open: bool,
) -> Result<(), ApiError> {
    let Some(v) = v else { return Ok(()) };
    let ok = v.is_finite() && v <= hi && if lo_open { v > lo } else { v >= lo };
    if ok {
        Ok(())
    } else {
        let open = if lo_open { "(" } else { "[" };
        Err(ApiError::invalid(
            "invalid_value",
            param(name),
            format!("Invalid '{name}': {v} is outside {open}{lo}, {hi}]."),
        ))
    }
}

impl Common<'_> {
    /// Validates everything but the prompt. `max_tokens` is the value the endpoint settled
    /// on (chat prefers `max_completion_tokens`).
    fn settings(&self, max_tokens: Option<u64>, vocab_size: usize) -> Result<Settings, ApiError> {
        let n = match self.n {
            None => 1,
            Some(n) if (1..=MAX_CHOICES).contains(&n) => n as usize,
            Some(n) => {
                return Err(ApiError::invalid(
                    "invalid_value",
                    param("n"),
                    format!("n = {n} is out of range: 1 to {MAX_CHOICES}."),
                ))
            }
        };
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, false)?;
        check_range(
            "frequency_penalty",
            self.frequency_penalty,
            -2.0,
            2.0,
            false,
        )?;
        check_range("min_p", self.min_p, 0.0, 1.0, false)?;
        let repetition = match (self.repetition_penalty, self.repeat_penalty) {
            (Some(a), Some(b)) if a != b => {
                return Err(ApiError::invalid(
                    "invalid_value",
                    param("repeat_penalty"),
                    format!("repetition_penalty ({a}) and repeat_penalty ({b}) are two names for one setting; give one."),
                ))
            }
            (Some(v), _) => {
                check_range("repetition_penalty", Some(v), 0.0, 2.0, true)?;
                v
            }
            (None, Some(v)) => {
                check_range("repeat_penalty", Some(v), 0.0, 2.0, true)?;
                v
            }
            (None, None) => 1.0,
        };
        let repeat_last_n = match self.repeat_last_n {
            None => Penalties::default().repeat_last_n,
            Some(-1) => usize::MAX,
            Some(n) => usize::try_from(n).map_err(|_| {
                ApiError::invalid(
                    "invalid_value",
                    param("repeat_last_n"),
                    format!("Invalid 'repeat_last_n': {n}; use -1 for the whole sequence, 0 to disable."),
                )
            })?,
        };
        let logit_bias = match self.logit_bias {
            None => Arc::from([]),
            Some(map) => logit_bias(map, vocab_size)?,
        };
        check_range("temperature", self.temperature, 0.0, 2.0, false)?;
        check_range("top_p", self.top_p, 0.0, 1.0, true)?;
        let top_k = match self.top_k {
            None | Some(-1) => 0,
            Some(k) => usize::try_from(k).map_err(|_| {
                ApiError::invalid(
                    "invalid_value",
                    param("top_k"),
                    format!("Invalid 'top_k': {k}; use -1 or 0 to disable."),
                )
            })?,
        };
        let stops = match self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stops.len() > MAX_STOP_STRINGS {
            return Err(ApiError::invalid(
                "invalid_value",
                param("stop"),
                format!(
                    "At most {MAX_STOP_STRINGS} stop sequences are allowed; got {}.",
                    stops.len()
                ),
            ));
        }
        if stops.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                "invalid_value",
                param("stop"),
                "Stop sequences must not be empty.",
            ));
        }
        if let Some((i, long)) = stops
            .iter()
            .enumerate()
            .find(|(_, s)| s.len() > MAX_STOP_BYTES)
        {
            return Err(ApiError::invalid(
                "invalid_value",
                param("stop"),
                format!(
                    "Each stop sequence may be at most {MAX_STOP_BYTES} bytes of UTF-8; \
                     stop[{i}] is {} bytes.",
                    long.len()
                ),
            ));
        }
        if let Some(salt) = self.cache_salt {
            if salt.is_empty() {
                return Err(ApiError::invalid(
                    "invalid_value",
                    param("cache_salt"),
                    "cache_salt must not be empty.",
                ));
            }
        }
        let max_tokens = max_tokens.map(|m| usize::try_from(m).unwrap_or(usize::MAX));
        let seed = match self.seed {
            // Reinterpreting the bits keeps negative seeds distinct and reproducible.
            Some(s) => s as u64,
            None => random_seed(),
        };
        let stream = self.stream.unwrap_or(false);
        let constraint = crate::structured::requested(self)?;
        let ignore_eos = self.ignore_eos.unwrap_or(false);
        if let Some(c) = &constraint {
            // A constrained answer ends when it is complete; a stop string could cut it
            // short and still say `stop`, and ignore_eos would run past its end.
            if !stops.is_empty() {
                return Err(ApiError::invalid(
                    "invalid_value",
                    param("stop"),
                    format!(
                        "stop cannot be combined with {}: the answer ends when it is complete.",
                        c.param
                    ),
                ));
            }
            if ignore_eos {
                return Err(ApiError::invalid(
                    "invalid_value",
                    param("ignore_eos"),
                    format!("ignore_eos cannot be combined with {}: the answer ends when it is complete.", c.param),
                ));
            }
            if self.min_tokens.is_some_and(|m| m > 0) {
                return Err(ApiError::invalid(
                    "invalid_value",
                    param("min_tokens"),
                    format!("min_tokens cannot be combined with {}: the answer ends when it is complete.", c.param),
                ));
            }
        }
        let stop_tokens = stop_token_ids(self.stop_token_ids.unwrap_or_default(), vocab_size)?;
        let min_tokens = usize::try_from(self.min_tokens.unwrap_or(0)).unwrap_or(usize::MAX);
        if let Some(max) = max_tokens.filter(|&max| min_tokens > max) {
            return Err(ApiError::invalid(
                "invalid_value",
                param("min_tokens"),
                format!("min_tokens ({min_tokens}) must not exceed max_tokens ({max})."),
            ));
        }
        Ok(Settings {
            n,
            max_tokens,
            sampling: SamplingParams {
                // OpenAI's default temperature is 1.
                temperature: self.temperature.unwrap_or(1.0) as f32,
                top_p: self.top_p.unwrap_or(1.0) as f32,
                top_k,
                min_p: self.min_p.unwrap_or(0.0) as f32,
                seed,
                penalties: Penalties {
                    presence: self.presence_penalty.unwrap_or(0.0) as f32,
                    frequency: self.frequency_penalty.unwrap_or(0.0) as f32,
                    repetition: repetition as f32,
                    repeat_last_n,
                },
                logit_bias,
                stop_tokens,
                min_tokens,
            },
            stops,
            stream,
            include_usage: stream
                && self
                    .stream_options
                    .and_then(|o| o.include_usage)
                    .unwrap_or(false),
            cache_salt: self.cache_salt.map(salt_key),
            ignore_eos,
            constraint,
            adapter: None,
        })
    }
}

/// vLLM's `stop_token_ids`: at most [`MAX_STOP_TOKEN_IDS`] ids of this vocabulary, sorted
/// and each once for the engine's lookup.
fn stop_token_ids(ids: &[u64], vocab_size: usize) -> Result<Arc<[u32]>, ApiError> {
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::invalid(
            "invalid_value",
            param("stop_token_ids"),
            format!(
                "stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} tokens; got {}.",
                ids.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(ids.len());
    for &id in ids {
        match u32::try_from(id)
            .ok()
            .filter(|&t| (t as usize) < vocab_size)
        {
            Some(t) => out.push(t),
            None => {
                return Err(ApiError::invalid(
                    "invalid_value",
                    param("stop_token_ids"),
                    format!(
                        "{id} in 'stop_token_ids' is not a token id of this model (0 to {}).",
                        vocab_size.saturating_sub(1)
                    ),
                ))
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out.into())
}

/// OpenAI's `logit_bias`: token ids (as the object's keys) to a bias in [-100, 100], sorted
/// by id for the sampler. An id the vocabulary does not have is refused, not ignored.
fn logit_bias(
    map: &serde_json::Map<String, Value>,
    vocab_size: usize,
) -> Result<Arc<[(u32, f32)]>, ApiError> {
    if map.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            "invalid_value",
            param("logit_bias"),
            format!(
                "logit_bias may hold at most {MAX_LOGIT_BIAS} tokens; got {}.",
                map.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(map.len());
    for (key, value) in map {
        let id = key
            .parse::<u32>()
            .ok()
            .filter(|&id| (id as usize) < vocab_size)
            .ok_or_else(|| {
                ApiError::invalid(
                    "invalid_value",
                    param("logit_bias"),
                    format!(
                        "Invalid key in 'logit_bias': '{}' is not a token id of this model (0 to {}).",
                        key.chars().take(32).collect::<String>(),
                        vocab_size.saturating_sub(1)
                    ),
                )
            })?;
        let bias = value
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                ApiError::invalid(
                    "invalid_value",
                    param("logit_bias"),
                    format!("Invalid value in 'logit_bias' for token {id}: a bias is a number in [-100, 100]."),
                )
            })?;
        out.push((id, bias as f32));
    }
    // Keys of a JSON object are distinct strings, but "7" and "07" name one token.
    out.sort_by_key(|&(id, _)| id);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(ApiError::invalid(
            "invalid_value",
            param("logit_bias"),
            format!("logit_bias names token {} twice.", w[0].0),
        ));
    }
    Ok(out.into())
}

/// Choice `choice`'s seed of a request seeded `seed`: the first keeps the request's own (so
/// `n = 1` samples as it always did), the others a SplitMix64 step away from it, so every
/// choice is reproducible from the one seed, alone or batched.
pub fn choice_seed(seed: u64, choice: usize) -> u64 {
    if choice == 0 {
        return seed;
    }
    let mut z = seed.wrapping_add((choice as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A seed for requests that give none: different per request, like OpenAI's sampling.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

impl CompletionRequest {
    /// The completion endpoint's own parameters, then the shared ones.
    fn parameters(&self, vocab_size: usize) -> Result<(Settings, Option<usize>), ApiError> {
        if self.echo == Some(true) {
            return Err(ApiError::unsupported("echo", "echo is not supported."));
        }
        if let Some(b) = self.best_of.filter(|&b| b != 1) {
            return Err(ApiError::unsupported(
                "best_of",
                format!("best_of = {b} is not supported; only 1."),
            ));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::unsupported("suffix", "suffix is not supported."));
        }
        if let Some(k) = self.logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
            return Err(ApiError::invalid(
                "invalid_value",
                param("logprobs"),
                format!("logprobs = {k} exceeds the maximum of {MAX_TOP_LOGPROBS}."),
            ));
        }
        let settings = self.common().settings(self.max_tokens, vocab_size)?;
        Ok((settings, self.logprobs.map(|k| k as usize)))
    }

    /// The prompt as text or token ids; several prompts in one request are refused.
    fn single_prompt(&self) -> Result<PromptInput, ApiError> {
        let many = || {
            ApiError::unsupported(
                "prompt",
                "Batched prompts are not supported; send one prompt per request.",
            )
        };
        Ok(match &self.prompt {
            Prompt::Text(s) => PromptInput::Text(s.clone()),
            Prompt::Tokens(t) => PromptInput::Tokens(t.clone()),
            Prompt::Texts(v) => match v.as_slice() {
                [s] => PromptInput::Text(s.clone()),
                _ => return Err(many()),
            },
            Prompt::TokenLists(v) => match v.as_slice() {
                [t] => PromptInput::Tokens(t.clone()),
                _ => return Err(many()),
            },
        })
    }
}

/// A completion's one prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

impl ChatRequest {
    /// Returns the settings and, when logprobs are wanted, how many alternatives.
    fn parameters(&self, vocab_size: usize) -> Result<(Settings, Option<usize>), ApiError> {
        // OpenAI's deprecated function calling; `tools` replaces it.
        for (name, v) in [
            ("functions", &self.functions),
            ("function_call", &self.function_call),
        ] {
            if v.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(ApiError::unsupported(
                    name,
                    format!("{name} is deprecated and not supported; use tools and tool_choice."),
                ));
            }
        }
        let logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (_, Some(k)) if k > MAX_TOP_LOGPROBS => {
                return Err(ApiError::invalid(
                    "invalid_value",
                    param("top_logprobs"),
                    format!("top_logprobs = {k} exceeds the maximum of {MAX_TOP_LOGPROBS}."),
                ))
            }
            // Some clients send `top_logprobs: 0` alongside `logprobs: false`.
            (false, Some(0)) => None,
            (false, Some(_)) => {
                return Err(ApiError::invalid(
                    "invalid_value",
                    param("top_logprobs"),
                    "top_logprobs requires logprobs to be true.",
                ))
            }
            (true, k) => Some(k.unwrap_or(0) as usize),
            (false, None) => None,
        };
        let settings = self
            .common()
            .settings(self.max_completion_tokens.or(self.max_tokens), vocab_size)?;
        Ok((settings, logprobs))
    }
}

impl Message {
    /// Refuses what a message holds that its role cannot carry (calls outside an
    /// assistant turn, a call id outside a tool turn, the deprecated `function_call`),
    /// rather than dropping it from the conversation.
    fn check_fields(&self, index: usize, role: &str) -> Result<(), ApiError> {
        for (name, v, allowed) in [
            ("tool_calls", &self.tool_calls, role == "assistant"),
            ("tool_call_id", &self.tool_call_id, role == "tool"),
            ("function_call", &self.function_call, false),
        ] {
            if !allowed && v.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(ApiError::unsupported(
                    &format!("messages[{index}].{name}"),
                    format!(
                        "messages[{index}].{name} is not supported on a message of role '{role}'."
                    ),
                ));
            }
        }
        if self.refusal.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::unsupported(
                &format!("messages[{index}].refusal"),
                format!("messages[{index}].refusal is not supported; send the text as content."),
            ));
        }
        Ok(())
    }

    /// An assistant turn's thoughts (`reasoning_content`), a string or null.
    fn thoughts(&self, index: usize) -> Result<Option<String>, ApiError> {
        match &self.reasoning_content {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if self.role == "assistant" => Ok(Some(s.clone())),
            Some(Value::String(_)) => Err(ApiError::unsupported(
                &format!("messages[{index}].reasoning_content"),
                format!(
                    "messages[{index}].reasoning_content is supported on assistant messages only."
                ),
            )),
            Some(_) => Err(ApiError::invalid(
                "invalid_type",
                Some(format!("messages[{index}].reasoning_content")),
                format!("'messages[{index}].reasoning_content' must be a string."),
            )),
        }
    }

    /// The message's text: a string, or the concatenation of its text parts.
    fn text(&self, index: usize) -> Result<String, ApiError> {
        match &self.content {
            None => Ok(String::new()),
            Some(Content::Text(s)) => Ok(s.clone()),
            Some(Content::Parts(parts)) => {
                let mut out = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => out.push_str(t),
                        ("text", None) => {
                            return Err(ApiError::invalid(
                                "missing_required_parameter",
                                Some(format!("messages[{index}].content[{j}].text")),
                                format!("Missing required parameter: 'messages[{index}].content[{j}].text'."),
                            ))
                        }
                        (other, _) => {
                            return Err(ApiError::unsupported(
                                &format!("messages[{index}].content[{j}].type"),
                                format!("Content parts of type '{other}' are not supported; only text."),
                            ))
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

#[cfg(test)]
mod tests;
