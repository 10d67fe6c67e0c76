//! A streamed answer with tools: content goes out as it comes until a call could begin;
//! from there the text is held, and at the end it goes out as `tool_calls` deltas if it
//! parses as calls, else as the content it was. So the stream's content and calls,
//! concatenated, are the non-streamed answer's.

use super::{Call, ToolCalling};

/// One streamed answer's text so far and how much of it went out as content.
pub struct ToolStream {
    calling: std::sync::Arc<ToolCalling>,
    text: String,
    sent: usize,
}

impl ToolStream {
    pub fn new(calling: std::sync::Arc<ToolCalling>) -> Self {
        Self {
            calling,
            text: String::new(),
            sent: 0,
        }
    }

    /// Takes the next text; returns the part of the answer that is now certainly content.
    pub fn push(&mut self, text: &str) -> String {
        self.text.push_str(text);
        let certain = self.calling.format.certain_content(&self.text);
        self.take_until(certain)
    }

    fn take_until(&mut self, end: usize) -> String {
        let end = end.max(self.sent);
        let out = self.text[self.sent..end].to_owned();
        self.sent = end;
        out
    }

    /// The answer's end: the content not yet sent and the calls, if the held text is calls
    /// (`stopped`: it ended by itself, not at `max_tokens`, so a call part is whole).
    pub fn finish(&mut self, tail: &str, stopped: bool) -> (String, Vec<Call>) {
        self.text.push_str(tail);
        if stopped {
            let parsed = self.calling.format.parse(&self.text, &self.calling.tools);
            if !parsed.calls.is_empty() {
                let content_end = parsed.content.as_ref().map_or(0, String::len);
                return (self.take_until(content_end), parsed.calls);
            }
        }
        (self.take_until(self.text.len()), Vec::new())
    }
}
