//! Response bodies and stream chunks in OpenAI's shapes, for both endpoints.

use std::sync::Arc;

use engine::{FinishReason, Usage};
use serde_json::{json, Map, Value};
use tokenizer::Tokenizer;

use crate::generation::{Chunk, TokenOut};
use crate::reasoning::{self, Thinking};
use crate::tools::{Call, ToolCalling, ToolFormat};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completion,
}

/// What every response and chunk of one request carries.
pub struct ResponseMeta {
    pub api: Api,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub logprobs: bool,
    pub tok: Arc<Tokenizer>,
    /// The request's tools: a chat answer is parsed for their calls.
    pub tools: Option<Arc<ToolCalling>>,
    /// A thinking model's chat answer: its thoughts go to `reasoning_content`, and only
    /// the rest is content (and parsed for calls).
    pub thinking: Option<Thinking>,
}

pub fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

pub fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
    })
}

/// JSON has no infinities; OpenAI reports impossible tokens as -9999.
fn finite(lp: f32) -> f64 {
    if lp.is_finite() {
        f64::from(lp)
    } else {
        -9999.0
    }
}

impl ResponseMeta {
    fn token_bytes(&self, id: u32) -> &[u8] {
        self.tok.token_bytes(id).unwrap_or_default()
    }

    fn token_str(&self, id: u32) -> String {
        String::from_utf8_lossy(self.token_bytes(id)).into_owned()
    }

    /// The `logprobs` field for `tokens`, or null when none were asked for.
    fn logprobs_json(&self, tokens: &[TokenOut]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.api {
            Api::Chat => {
                let content: Vec<Value> = tokens
                    .iter()
                    .map(|t| {
                        let e = &t.event;
                        let top: Vec<Value> = e
                            .top_logprobs
                            .iter()
                            .map(|&(id, lp)| {
                                json!({
                                    "id": id,
                                    "token": self.token_str(id),
                                    "logprob": finite(lp),
                                    "bytes": self.token_bytes(id),
                                })
                            })
                            .collect();
                        // `id` is llama.cpp's addition: the token itself, which `token` and
                        // `bytes` name only up to the vocabulary's duplicates.
                        json!({
                            "id": e.id,
                            "token": self.token_str(e.id),
                            "logprob": finite(e.logprob.unwrap_or(f32::NEG_INFINITY)),
                            "bytes": self.token_bytes(e.id),
                            "top_logprobs": top,
                        })
                    })
                    .collect();
                json!({ "content": content })
            }
            Api::Completion => {
                let mut texts = Vec::new();
                let mut lps = Vec::new();
                let mut tops = Vec::new();
                let mut offsets = Vec::new();
                for t in tokens {
                    let e = &t.event;
                    texts.push(Value::from(self.token_str(e.id)));
                    lps.push(Value::from(finite(e.logprob.unwrap_or(f32::NEG_INFINITY))));
                    let mut top = Map::new();
                    for &(id, lp) in &e.top_logprobs {
                        top.entry(self.token_str(id))
                            .or_insert(Value::from(finite(lp)));
                    }
                    tops.push(Value::Object(top));
                    offsets.push(Value::from(t.text_offset));
                }
                json!({
                    "tokens": texts,
                    "token_logprobs": lps,
                    "top_logprobs": tops,
                    "text_offset": offsets,
                })
            }
        }
    }

    fn object(&self, stream: bool) -> &'static str {
        match (self.api, stream) {
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, stream: bool, choices: Vec<Value>) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("id".into(), Value::from(self.id.clone()));
        m.insert("object".into(), Value::from(self.object(stream)));
        m.insert("created".into(), Value::from(self.created));
        m.insert("model".into(), Value::from(self.model.clone()));
        m.insert("choices".into(), Value::Array(choices));
        m
    }

    /// The id of choice `choice`'s `index`th call: derived from the response's id, so it
    /// is as opaque; Mistral's templates take only ids of 9 letters and digits.
    fn call_id(&self, choice: usize, index: usize) -> String {
        use std::hash::{Hash, Hasher};
        const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&self.id, choice, index).hash(&mut h);
        let mut bits =
            u128::from(h.finish()) << 64 | u128::from(h.finish().rotate_left(17) ^ index as u64);
        let len = match self.tools.as_ref().map(|t| t.format) {
            Some(ToolFormat::Mistral) => 9,
            _ => 20,
        };
        let mut s = String::with_capacity(len + 5);
        for _ in 0..len {
            s.push(ALPHABET[(bits % 62) as usize] as char);
            bits /= 62;
        }
        match self.tools.as_ref().map(|t| t.format) {
            Some(ToolFormat::Mistral) => s,
            _ => format!("call_{s}"),
        }
    }

    fn call_json(&self, choice: usize, index: usize, call: &Call) -> Value {
        json!({
            "id": self.call_id(choice, index),
            "type": "function",
            "function": { "name": call.name, "arguments": call.arguments },
        })
    }

    /// The whole non-streamed response: one choice per output, in order.
    pub fn response(&self, outputs: &[(Chunk, FinishReason)], usage: &Usage) -> Value {
        let choices = outputs
            .iter()
            .enumerate()
            .map(|(i, (output, reason))| self.choice(i, output, *reason))
            .collect();
        let mut m = self.envelope(false, choices);
        m.insert("usage".into(), usage_json(usage));
        Value::Object(m)
    }

    /// Choice `index` of the whole response.
    fn choice(&self, index: usize, output: &Chunk, reason: FinishReason) -> Value {
        if self.api == Api::Completion {
            return json!({
                "index": index,
                "text": output.text,
                "logprobs": self.logprobs_json(&output.tokens),
                "finish_reason": finish_reason(reason),
            });
        }
        let parts = match self.thinking {
            Some(thinking) => reasoning::split(thinking, &output.text),
            None => reasoning::Parts {
                thoughts: String::new(),
                content: output.text.clone(),
            },
        };
        let parsed = match (&self.tools, reason) {
            (Some(t), FinishReason::Stop) => {
                Some(t.format.parse(&parts.content, &t.tools)).filter(|p| !p.calls.is_empty())
            }
            _ => None,
        };
        let (mut message, finish) = match parsed {
            Some(parsed) => {
                let calls: Vec<Value> = parsed
                    .calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| self.call_json(index, i, c))
                    .collect();
                let message =
                    json!({ "role": "assistant", "content": parsed.content, "tool_calls": calls });
                (message, "tool_calls")
            }
            None => (
                json!({ "role": "assistant", "content": parts.content }),
                finish_reason(reason),
            ),
        };
        if !parts.thoughts.is_empty() {
            message["reasoning_content"] = Value::from(parts.thoughts);
        }
        json!({
            "index": index,
            "message": message,
            "logprobs": self.logprobs_json(&output.tokens),
            "finish_reason": finish,
        })
    }

    /// The opening chunk of a chat stream's choice `index`, which names the role.
    pub fn role_chunk(&self, index: usize, include_usage: bool) -> Value {
        let choice = json!({
            "index": index,
            "delta": { "role": "assistant", "content": "" },
            "logprobs": Value::Null,
            "finish_reason": Value::Null,
        });
        self.stream_chunk(vec![choice], include_usage)
    }

    /// A stream chunk of choice `index` with `chunk`'s text, and the finish reason on its
    /// last one.
    pub fn delta_chunk(
        &self,
        index: usize,
        chunk: &Chunk,
        finish: Option<FinishReason>,
        include_usage: bool,
    ) -> Value {
        self.delta_chunk_thinking(index, "", chunk, finish, include_usage)
    }

    /// [`Self::delta_chunk`] of a thinking model's answer, with `thoughts`, the part of
    /// the chunk's text that is thoughts (the chunk's own text is its content).
    pub fn delta_chunk_thinking(
        &self,
        index: usize,
        thoughts: &str,
        chunk: &Chunk,
        finish: Option<FinishReason>,
        include_usage: bool,
    ) -> Value {
        let reason = finish.map(finish_reason);
        let choice = match self.api {
            Api::Chat => {
                let mut delta =
                    if chunk.text.is_empty() && (finish.is_some() || !thoughts.is_empty()) {
                        json!({})
                    } else {
                        json!({ "content": chunk.text })
                    };
                if !thoughts.is_empty() {
                    delta["reasoning_content"] = Value::from(thoughts);
                }
                json!({
                    "index": index,
                    "delta": delta,
                    "logprobs": self.logprobs_json(&chunk.tokens),
                    "finish_reason": reason,
                })
            }
            Api::Completion => json!({
                "index": index,
                "text": chunk.text,
                "logprobs": self.logprobs_json(&chunk.tokens),
                "finish_reason": reason,
            }),
        };
        self.stream_chunk(vec![choice], include_usage)
    }

    /// A streamed answer's calls as OpenAI's deltas: per call, one chunk that opens it (its
    /// index, id and name, empty arguments) and one with its arguments; then the last chunk,
    /// whose finish reason is `tool_calls`.
    pub fn tool_call_chunks(
        &self,
        choice: usize,
        calls: &[Call],
        include_usage: bool,
    ) -> Vec<Value> {
        let mut out = Vec::with_capacity(2 * calls.len() + 1);
        let chunk = |delta: Value, finish: Value| {
            let choice = json!({ "index": choice, "delta": delta, "logprobs": Value::Null, "finish_reason": finish });
            self.stream_chunk(vec![choice], include_usage)
        };
        for (i, c) in calls.iter().enumerate() {
            let opening = json!({ "tool_calls": [{
                "index": i,
                "id": self.call_id(choice, i),
                "type": "function",
                "function": { "name": c.name, "arguments": "" },
            }]});
            out.push(chunk(opening, Value::Null));
            let arguments =
                json!({ "tool_calls": [{ "index": i, "function": { "arguments": c.arguments } }] });
            out.push(chunk(arguments, Value::Null));
        }
        out.push(chunk(json!({}), Value::from("tool_calls")));
        out
    }

    /// The extra last chunk `stream_options.include_usage` asks for: no choices, usage.
    pub fn usage_chunk(&self, usage: &Usage) -> Value {
        let mut m = self.envelope(true, Vec::new());
        m.insert("usage".into(), usage_json(usage));
        Value::Object(m)
    }

    fn stream_chunk(&self, choices: Vec<Value>, include_usage: bool) -> Value {
        let mut m = self.envelope(true, choices);
        if include_usage {
            // OpenAI sends `usage: null` on every chunk but the usage one.
            m.insert("usage".into(), Value::Null);
        }
        Value::Object(m)
    }
}
