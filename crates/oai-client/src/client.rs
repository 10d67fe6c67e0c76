//! HTTP to the server under test: one call, everything it sent back.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::sse::SseParser;
use crate::ClientError;

/// Received bytes kept per response for scanning and the report; the rest is counted only.
const RAW_CAP: usize = 4 << 20;
/// The system prompt of chat probes (the default model answers sensibly with it).
const SYSTEM: &str = "You are a helpful assistant.";

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    Completions,
    Chat,
}

#[derive(Debug, Clone)]
pub enum Prompt {
    Text(String),
    /// Token ids, sent to /v1/completions as a list: exact lengths, no tokenizer needed.
    Tokens(Vec<u32>),
}

impl Prompt {
    /// "N tokens" or "N bytes", for tables.
    pub fn describe(&self) -> String {
        match self {
            Prompt::Text(t) => format!("{} bytes", t.len()),
            Prompt::Tokens(t) => format!("{} tokens", t.len()),
        }
    }
}

/// One request to send.
#[derive(Debug, Clone)]
pub struct Call {
    pub api: Api,
    pub prompt: Prompt,
    pub max_tokens: u32,
    pub temperature: f32,
    pub stream: bool,
    pub logprobs: bool,
    /// Ask the server to keep generating past end-of-sequence (`ignore_eos`, accepted by
    /// kvwarden, vLLM and llama.cpp), so a benchmark gets exactly `max_tokens`.
    pub ignore_eos: bool,
    /// Streams only: hang up after this many data events.
    pub cancel_after: Option<usize>,
    pub key: Option<String>,
    /// More fields of the body (a structured output's `json_schema`, say), merged in last.
    pub extra: serde_json::Map<String, Value>,
}

/// Token counts a response reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct UsageSeen {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// Prompt tokens served from a prefix cache (OpenAI's `prompt_tokens_details`, or
    /// llama.cpp's `timings.cache_n`).
    pub cached_tokens: Option<u64>,
}

/// What a stream looked like.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StreamSeen {
    pub data_events: usize,
    pub error_events: usize,
    pub done: bool,
    /// Data events after `[DONE]` or after an error event.
    pub events_after_end: usize,
    /// Data events that were not JSON.
    pub malformed: usize,
}

/// Everything one call produced.
/// One tool call of an answer: its function's name and its arguments' text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolCallSeen {
    pub name: String,
    pub arguments: String,
}

/// Merges a message's or a delta's `tool_calls` into `calls`: a whole message lists each
/// call once; a stream's deltas name a call by `index` and add to its name and arguments.
fn merge_tool_calls(calls: &mut Vec<ToolCallSeen>, message: Option<&Value>) {
    let Some(list) = message
        .and_then(|m| m.get("tool_calls"))
        .and_then(Value::as_array)
    else {
        return;
    };
    for (position, tc) in list.iter().enumerate() {
        let index = tc
            .get("index")
            .and_then(Value::as_u64)
            .map_or(calls.len().max(position), |i| i as usize)
            .min(1024);
        if calls.len() <= index {
            calls.resize(index + 1, ToolCallSeen::default());
        }
        let f = tc.get("function");
        let part = |k: &str| {
            f.and_then(|f| f.get(k))
                .and_then(Value::as_str)
                .unwrap_or("")
        };
        calls[index].name.push_str(part("name"));
        calls[index].arguments.push_str(part("arguments"));
    }
}

#[derive(Debug, Clone, Default)]
pub struct Exchange {
    pub status: Option<u16>,
    pub transport_error: Option<String>,
    /// Every byte received, as text (lossy), up to a cap.
    pub raw: String,
    pub raw_bytes: usize,
    /// The generated text (content or completion text, streamed chunks joined).
    pub content: String,
    /// Token strings from `logprobs`, when asked for.
    pub logprob_tokens: Option<Vec<String>>,
    pub finish_reason: Option<String>,
    /// A chat answer's tool calls (a stream's deltas joined by index).
    pub tool_calls: Vec<ToolCallSeen>,
    pub usage: Option<UsageSeen>,
    pub stream: Option<StreamSeen>,
    /// `error.message` of an error body or error event.
    pub error_message: Option<String>,
    /// Non-2xx only: whether the body was JSON with an `error` object.
    pub error_body_ok: bool,
    pub ttft: Option<Duration>,
    /// Streams only: when each data event that carried generated text or tokens arrived,
    /// from the start of the call (the inter-token latencies of a benchmark).
    pub chunk_times: Vec<Duration>,
    pub total: Duration,
    pub cancelled: bool,
}

impl Exchange {
    pub fn ok(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s)) && self.transport_error.is_none()
    }

    /// A 2xx whose stream ended in an error event counts as failed.
    pub fn succeeded(&self) -> bool {
        self.ok()
            && self.error_message.is_none()
            && self.stream.as_ref().is_none_or(|s| s.error_events == 0)
    }
}

/// The server under test.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    /// Scheme, host and port, without `/v1`.
    pub base: String,
    pub model: String,
}

impl Client {
    pub fn new(endpoint: &str, timeout: Duration) -> Result<Self, ClientError> {
        let base = endpoint.trim_end_matches('/');
        let base = base.strip_suffix("/v1").unwrap_or(base).to_owned();
        if !base.starts_with("http://") && !base.starts_with("https://") {
            return Err(ClientError::BadUrl(endpoint.to_owned()));
        }
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .no_proxy()
            // A fresh connection per request: reusing an idle keep-alive connection that the
            // server has just closed (llama-server closes them after 5 s) fails the request
            // before it is sent, which would be the audit's fault, not the server's.
            .pool_max_idle_per_host(0)
            .build()
            .map_err(|e| ClientError::Setup {
                url: base.clone(),
                message: e.to_string(),
            })?;
        Ok(Self {
            http,
            base,
            model: String::new(),
        })
    }

    /// GET a JSON document: status and body (Null when the body is not JSON).
    pub async fn get_json(&self, path: &str, key: Option<&str>) -> Result<(u16, Value), String> {
        let text = self.get_text(path, key).await?;
        Ok((text.0, serde_json::from_str(&text.1).unwrap_or(Value::Null)))
    }

    pub async fn get_text(&self, path: &str, key: Option<&str>) -> Result<(u16, String), String> {
        let mut req = self.http.get(format!("{}{path}", self.base));
        if let Some(k) = key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        let resp = req.send().await.map_err(|e| describe(&e))?;
        let status = resp.status().as_u16();
        let text = resp.text().await.map_err(|e| describe(&e))?;
        Ok((status, text))
    }

    fn body(&self, call: &Call) -> Value {
        let mut body = json!({
            "model": self.model,
            "max_tokens": call.max_tokens,
            "temperature": call.temperature,
            "stream": call.stream,
        });
        match (call.api, &call.prompt) {
            (Api::Completions, Prompt::Text(t)) => body["prompt"] = json!(t),
            (Api::Completions, Prompt::Tokens(t)) => body["prompt"] = json!(t),
            (Api::Chat, prompt) => {
                let text = match prompt {
                    Prompt::Text(t) => t.clone(),
                    Prompt::Tokens(t) => format!("{t:?}"),
                };
                body["messages"] = json!([
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": text},
                ]);
            }
        }
        if call.logprobs {
            body["logprobs"] = match call.api {
                Api::Completions => json!(1),
                Api::Chat => json!(true),
            };
        }
        if call.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        if call.stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        for (k, v) in &call.extra {
            body[k] = v.clone();
        }
        body
    }

    /// Sends one call and records everything that came back. Never fails: transport
    /// errors are part of the record.
    pub async fn call(&self, call: &Call) -> Exchange {
        let path = match call.api {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        };
        let body = serde_json::to_vec(&self.body(call)).unwrap_or_default();
        let mut req = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body);
        if let Some(k) = &call.key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        let start = Instant::now();
        let mut ex = Exchange::default();
        let mut resp = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                ex.transport_error = Some(describe(&e));
                ex.total = start.elapsed();
                return ex;
            }
        };
        ex.status = Some(resp.status().as_u16());
        let is_sse = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("text/event-stream"));
        let mut parser = is_sse.then(SseParser::default);
        let mut raw = Vec::new();
        loop {
            match resp.chunk().await {
                Ok(Some(bytes)) => {
                    ex.raw_bytes += bytes.len();
                    let room = RAW_CAP.saturating_sub(raw.len());
                    raw.extend_from_slice(&bytes[..bytes.len().min(room)]);
                    if let Some(p) = &mut parser {
                        for data in p.push(&bytes) {
                            stream_event(&mut ex, call.api, &data, start);
                        }
                        let events = ex.stream.as_ref().map_or(0, |s| s.data_events);
                        if call.cancel_after.is_some_and(|n| events >= n) {
                            ex.cancelled = true;
                            break;
                        }
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    ex.transport_error = Some(describe(&e));
                    break;
                }
            }
        }
        // Dropping the response here hangs up a cancelled stream.
        drop(resp);
        ex.total = start.elapsed();
        if let Some(p) = &mut parser {
            if !ex.cancelled {
                for data in p.finish() {
                    stream_event(&mut ex, call.api, &data, start);
                }
            }
        }
        ex.raw = String::from_utf8_lossy(&raw).into_owned();
        if parser.is_none() {
            whole_body(&mut ex, call.api);
        }
        ex
    }
}

fn describe(e: &reqwest::Error) -> String {
    // reqwest's Display hides the cause ("error sending request"); the chain says why.
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

fn error_message(v: &Value) -> Option<String> {
    let e = v.get("error")?;
    Some(match e.get("message").and_then(Value::as_str) {
        Some(m) => m.to_owned(),
        None => e.to_string(),
    })
}

fn usage_of(v: &Value) -> Option<UsageSeen> {
    let u = v.get("usage").filter(|u| u.is_object());
    let timings = v.get("timings").filter(|t| t.is_object());
    if u.is_none() && timings.is_none() {
        return None;
    }
    let num = |v: Option<&Value>, k: &str| v.and_then(|v| v.get(k)).and_then(Value::as_u64);
    Some(UsageSeen {
        prompt_tokens: num(u, "prompt_tokens"),
        completion_tokens: num(u, "completion_tokens"),
        cached_tokens: u
            .and_then(|u| u.get("prompt_tokens_details"))
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
            .or_else(|| num(timings, "cache_n")),
    })
}

fn merge_usage(into: &mut Option<UsageSeen>, new: UsageSeen) {
    let u = into.get_or_insert_with(UsageSeen::default);
    u.prompt_tokens = new.prompt_tokens.or(u.prompt_tokens);
    u.completion_tokens = new.completion_tokens.or(u.completion_tokens);
    u.cached_tokens = new.cached_tokens.or(u.cached_tokens);
}

/// Text and logprob tokens of one choice (a whole message or a stream delta).
fn choice_parts(api: Api, choice: &Value) -> (Option<String>, Vec<String>) {
    let text = match api {
        Api::Completions => choice.get("text"),
        Api::Chat => choice
            .get("delta")
            .or_else(|| choice.get("message"))
            .and_then(|m| m.get("content")),
    }
    .and_then(Value::as_str)
    .map(str::to_owned);
    // OpenAI's completions shape is `logprobs.tokens`, its chat shape
    // `logprobs.content[].token`; some servers (llama.cpp) use the chat shape for both, so
    // both are read on both endpoints.
    let lp = choice.get("logprobs");
    let legacy = lp
        .and_then(|l| l.get("tokens"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|t| t.as_str().map(str::to_owned))
                .collect::<Vec<_>>()
        });
    let content = lp
        .and_then(|l| l.get("content"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|t| t.get("token").and_then(Value::as_str).map(str::to_owned))
                .collect::<Vec<_>>()
        });
    let tokens = match api {
        Api::Completions => legacy.or(content),
        Api::Chat => content.or(legacy),
    }
    .unwrap_or_default();
    (text, tokens)
}

fn stream_event(ex: &mut Exchange, api: Api, data: &str, start: Instant) {
    let st = ex.stream.get_or_insert_with(StreamSeen::default);
    st.data_events += 1;
    if st.done || st.error_events > 0 {
        st.events_after_end += 1;
    }
    if data.trim() == "[DONE]" {
        st.done = true;
        return;
    }
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        st.malformed += 1;
        return;
    };
    if let Some(m) = error_message(&v) {
        st.error_events += 1;
        ex.error_message.get_or_insert(m);
        return;
    }
    if let Some(u) = usage_of(&v) {
        merge_usage(&mut ex.usage, u);
    }
    let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else {
        return;
    };
    let (text, tokens) = choice_parts(api, choice);
    let finish = choice
        .get("finish_reason")
        .and_then(Value::as_str)
        .map(str::to_owned);
    // A tool call's deltas are generated output as much as content is.
    let has_text = text.as_deref().is_some_and(|t| !t.is_empty())
        || choice
            .get("delta")
            .and_then(|d| d.get("tool_calls"))
            .and_then(Value::as_array)
            .is_some_and(|calls| !calls.is_empty());
    let now = start.elapsed();
    if ex.ttft.is_none() && (has_text || finish.is_some() || !tokens.is_empty()) {
        ex.ttft = Some(now);
    }
    if has_text || !tokens.is_empty() {
        ex.chunk_times.push(now);
    }
    if let Some(t) = text {
        ex.content.push_str(&t);
    }
    if api == Api::Chat {
        merge_tool_calls(&mut ex.tool_calls, choice.get("delta"));
    }
    if choice.get("logprobs").is_some_and(|l| !l.is_null()) {
        ex.logprob_tokens
            .get_or_insert_with(Vec::new)
            .extend(tokens);
    }
    if finish.is_some() {
        ex.finish_reason = finish;
    }
}

fn whole_body(ex: &mut Exchange, api: Api) {
    let v: Value = serde_json::from_str(&ex.raw).unwrap_or(Value::Null);
    if !ex.ok() {
        ex.error_message = error_message(&v);
        ex.error_body_ok = ex.error_message.is_some();
        return;
    }
    if let Some(m) = error_message(&v) {
        ex.error_message = Some(m);
        return;
    }
    ex.usage = usage_of(&v);
    if let Some(choice) = v.get("choices").and_then(|c| c.get(0)) {
        let (text, tokens) = choice_parts(api, choice);
        ex.content = text.unwrap_or_default();
        if api == Api::Chat {
            merge_tool_calls(&mut ex.tool_calls, choice.get("message"));
        }
        if choice.get("logprobs").is_some_and(|l| !l.is_null()) {
            ex.logprob_tokens = Some(tokens);
        }
        ex.finish_reason = choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(str::to_owned);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_calls_are_read_whole_and_joined_from_deltas() {
        let start = Instant::now();
        let mut streamed = Exchange {
            status: Some(200),
            ..Default::default()
        };
        for d in [
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","type":"function","function":{"name":"f","arguments":""}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"x\":"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":1,"id":"b","function":{"name":"g","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"1}"}}]}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"tool_calls"}]}"#,
        ] {
            stream_event(&mut streamed, Api::Chat, d, start);
        }
        let mut whole = Exchange {
            status: Some(200),
            raw: r#"{"choices":[{"message":{"content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{\"x\":1}"}},{"id":"b","type":"function","function":{"name":"g","arguments":"{}"}}]},"finish_reason":"tool_calls"}]}"#.into(),
            ..Default::default()
        };
        whole_body(&mut whole, Api::Chat);
        let expected = vec![
            ToolCallSeen {
                name: "f".into(),
                arguments: r#"{"x":1}"#.into(),
            },
            ToolCallSeen {
                name: "g".into(),
                arguments: "{}".into(),
            },
        ];
        assert_eq!(streamed.tool_calls, expected);
        assert_eq!(whole.tool_calls, expected);
        assert_eq!(whole.finish_reason.as_deref(), Some("tool_calls"));
    }

    #[test]
    fn stream_events_build_the_answer() {
        let start = Instant::now();
        let mut ex = Exchange {
            status: Some(200),
            ..Default::default()
        };
        for d in [
            r#"{"choices":[{"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
            r#"{"choices":[{"delta":{"content":"Hel"},"logprobs":{"content":[{"token":"Hel"}]},"finish_reason":null}]}"#,
            r#"{"choices":[{"delta":{"content":"lo"},"logprobs":{"content":[{"token":"lo"}]},"finish_reason":"stop"}],"usage":null}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}"#,
            "[DONE]",
        ] {
            stream_event(&mut ex, Api::Chat, d, start);
        }
        assert_eq!(ex.content, "Hello");
        assert_eq!(ex.finish_reason.as_deref(), Some("stop"));
        assert_eq!(ex.logprob_tokens, Some(vec!["Hel".into(), "lo".into()]));
        let u = ex.usage.unwrap_or_default();
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            (Some(7), Some(2), Some(0))
        );
        let st = ex.stream.clone().unwrap_or_default();
        assert!(st.done && st.error_events == 0 && st.events_after_end == 0);
        assert!(ex.ttft.is_some() && ex.succeeded());
        // The role chunk carries no text; the two deltas do.
        assert_eq!(ex.chunk_times.len(), 2);
        stream_event(&mut ex, Api::Chat, r#"{"error":{"message":"late"}}"#, start);
        let st = ex.stream.clone().unwrap_or_default();
        assert_eq!((st.error_events, st.events_after_end), (1, 1));
        assert!(!ex.succeeded());
    }

    #[test]
    fn whole_bodies_and_errors() {
        let mut ex = Exchange {
            status: Some(400),
            raw: r#"{"error":{"message":"too long","type":"invalid_request_error"}}"#.into(),
            ..Default::default()
        };
        whole_body(&mut ex, Api::Completions);
        assert!(ex.error_body_ok);
        assert_eq!(ex.error_message.as_deref(), Some("too long"));
        let mut ex = Exchange {
            status: Some(500),
            raw: "Internal Server Error".into(),
            ..Default::default()
        };
        whole_body(&mut ex, Api::Completions);
        assert!(!ex.error_body_ok);
        let mut ex = Exchange {
            status: Some(200),
            raw: r#"{"choices":[{"text":" a b","finish_reason":"length","logprobs":{"tokens":[" a"," b"]}}],"usage":{"prompt_tokens":3,"completion_tokens":2},"timings":{"cache_n":2}}"#.into(),
            ..Default::default()
        };
        whole_body(&mut ex, Api::Completions);
        assert_eq!(ex.content, " a b");
        assert_eq!(ex.logprob_tokens.as_ref().map(Vec::len), Some(2));
        assert_eq!(ex.usage.and_then(|u| u.cached_tokens), Some(2));
        // llama.cpp answers /v1/completions with the chat shape of logprobs.
        let mut ex = Exchange {
            status: Some(200),
            raw: r#"{"choices":[{"text":"ab","finish_reason":"stop","logprobs":{"content":[{"token":"a"},{"token":"b"}]}}]}"#.into(),
            ..Default::default()
        };
        whole_body(&mut ex, Api::Completions);
        assert_eq!(ex.logprob_tokens, Some(vec!["a".into(), "b".into()]));
    }
}
