//! The OpenAI request bodies, as clients send them; [`crate::validation`] checks them.
//!
//! Every struct a client writes denies unknown fields: a field kvwarden does not know is a
//! 400 naming it (as OpenAI refuses unrecognized arguments), never accepted and ignored,
//! which would answer a `grammar` or a `json_schema` with unconstrained text. A field
//! declared here is either honoured or refused by validation when it asks for something
//! kvwarden does not do; the only ones accepted without effect are `user` (an end-user
//! id for the operator's abuse tracking) and llama.cpp's `cache_prompt`, whose answer is
//! the same either way.

use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Declares a request body with the fields both endpoints share appended, plus a
/// [`Common`] view of them. (`#[serde(flatten)]` would do this too, but it loses the field
/// path that error messages name.)
macro_rules! openai_request {
    ($(#[$m:meta])* pub struct $name:ident { $($(#[$fm:meta])* pub $f:ident: $t:ty,)* }) => {
        $(#[$m])*
        pub struct $name {
            $($(#[$fm])* pub $f: $t,)*
            pub model: String,
            pub max_tokens: Option<u64>,
            pub temperature: Option<f64>,
            pub top_p: Option<f64>,
            /// Not in OpenAI's API; vLLM's extension (-1 or 0 disables).
            pub top_k: Option<i64>,
            pub seed: Option<i64>,
            pub stop: Option<Stop>,
            pub stream: Option<bool>,
            pub stream_options: Option<StreamOptions>,
            pub n: Option<u64>,
            pub presence_penalty: Option<f64>,
            pub frequency_penalty: Option<f64>,
            /// vLLM's (and Hugging Face's) name for llama.cpp's `repeat_penalty`.
            pub repetition_penalty: Option<f64>,
            pub repeat_penalty: Option<f64>,
            /// llama.cpp's window for the repetition penalty (-1: the whole sequence).
            pub repeat_last_n: Option<i64>,
            /// vLLM's and llama.cpp's extension.
            pub min_p: Option<f64>,
            pub logit_bias: Option<serde_json::Map<String, Value>>,
            pub user: Option<String>,
            /// llama.cpp's: reuse of cached K/V never changes an answer, so either value
            /// is served the same way.
            pub cache_prompt: Option<bool>,
            /// Narrows the tenant's isolation domain: requests with different salts share
            /// no cached prefix even within one tenant.
            pub cache_salt: Option<String>,
            /// vLLM's extension: keep generating past EOS until `max_tokens`.
            pub ignore_eos: Option<bool>,
            /// vLLM's extensions: more tokens that end the answer, and the fewest tokens
            /// before anything may end it.
            pub stop_token_ids: Option<Vec<u64>>,
            pub min_tokens: Option<u64>,
            /// llama.cpp's adapter selection: `[{"id": I, "scale": S}, ...]`, ids as
            /// `GET /lora-adapters` lists them ([`crate::adapters`]).
            pub lora: Option<Value>,
            /// Structured outputs, in the four shapes clients send ([`crate::structured`]):
            /// OpenAI's `response_format`, llama.cpp's `json_schema` and `grammar`, and
            /// vLLM's `structured_outputs`.
            pub response_format: Option<Value>,
            pub json_schema: Option<Value>,
            pub grammar: Option<Value>,
            pub structured_outputs: Option<Value>,
        }

        impl $name {
            pub fn common(&self) -> Common<'_> {
                Common {
                    model: &self.model,
                    max_tokens: self.max_tokens,
                    temperature: self.temperature,
                    top_p: self.top_p,
                    top_k: self.top_k,
                    seed: self.seed,
                    stop: self.stop.as_ref(),
                    stream: self.stream,
                    stream_options: self.stream_options.as_ref(),
                    n: self.n,
                    presence_penalty: self.presence_penalty,
                    frequency_penalty: self.frequency_penalty,
                    repetition_penalty: self.repetition_penalty,
                    repeat_penalty: self.repeat_penalty,
                    repeat_last_n: self.repeat_last_n,
                    min_p: self.min_p,
                    logit_bias: self.logit_bias.as_ref(),
                    cache_salt: self.cache_salt.as_deref(),
                    ignore_eos: self.ignore_eos,
                    stop_token_ids: self.stop_token_ids.as_deref(),
                    min_tokens: self.min_tokens,
                    response_format: self.response_format.as_ref(),
                    json_schema: self.json_schema.as_ref(),
                    grammar: self.grammar.as_ref(),
                    structured_outputs: self.structured_outputs.as_ref(),
                }
            }
        }
    };
}

/// The fields both endpoints share.
#[derive(Debug, Clone, Copy)]
pub struct Common<'a> {
    pub model: &'a str,
    pub max_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<&'a Stop>,
    pub stream: Option<bool>,
    pub stream_options: Option<&'a StreamOptions>,
    pub n: Option<u64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub repeat_penalty: Option<f64>,
    pub repeat_last_n: Option<i64>,
    pub min_p: Option<f64>,
    pub logit_bias: Option<&'a serde_json::Map<String, Value>>,
    pub cache_salt: Option<&'a str>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<&'a [u64]>,
    pub min_tokens: Option<u64>,
    pub response_format: Option<&'a Value>,
    pub json_schema: Option<&'a Value>,
    pub grammar: Option<&'a Value>,
    pub structured_outputs: Option<&'a Value>,
}

openai_request! {
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct CompletionRequest {
        pub prompt: Prompt,
        pub logprobs: Option<u32>,
        pub echo: Option<bool>,
        pub best_of: Option<u64>,
        pub suffix: Option<String>,
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    pub name: Option<String>,
    /// An assistant turn's calls, and the call a tool turn answers.
    pub tool_calls: Option<Value>,
    pub tool_call_id: Option<Value>,
    pub function_call: Option<Value>,
    /// What OpenAI's own responses carry (null unless the model refused), so a client may
    /// send an earlier answer's message back as it got it.
    pub refusal: Option<Value>,
    /// An assistant turn's thoughts, as this server returns them apart from the content
    /// (`crate::reasoning`), so a client may send its earlier answers back as it got them.
    pub reasoning_content: Option<Value>,
}

openai_request! {
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct ChatRequest {
        pub messages: Vec<Message>,
        pub max_completion_tokens: Option<u64>,
        pub logprobs: Option<bool>,
        pub top_logprobs: Option<u32>,
        pub tools: Option<Value>,
        pub tool_choice: Option<Value>,
        pub functions: Option<Value>,
        pub function_call: Option<Value>,
        pub parallel_tool_calls: Option<Value>,
        /// Variables for the chat template (vLLM's and llama.cpp's extension), such as
        /// `enable_thinking`.
        pub chat_template_kwargs: Option<Value>,
    }
}
