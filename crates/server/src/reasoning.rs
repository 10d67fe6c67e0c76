//! Reasoning models' thoughts (`<think>…</think>`, as Qwen3, QwQ and DeepSeek-R1's
//! distillations write them) returned apart from the answer, in the message's
//! `reasoning_content`, as llama.cpp's server (`--reasoning-format deepseek`, its default)
//! and vLLM's reasoning parsers return them.
//!
//! The split applies where the chat template teaches the tags. Thoughts are the text
//! between an opening tag at the very start of the answer (or the start itself, where the
//! template's generation prompt already opened the block, as R1's templates do) and the
//! first closing tag; the whitespace after the closing tag is dropped; an answer cut off
//! while thinking is all thoughts. Anything else is content, a tag written later included.
//!
//! The stream ([`ReasoningStream`]) and the whole answer ([`split`]) run the same code, so
//! a streamed answer's thoughts and content, concatenated, are the non-streamed answer's.
//! Its state is one request's own text: nothing is kept between requests.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// What the server does with thoughts (`--reasoning-format`, llama.cpp's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReasoningFormat {
    /// Left in the content, tags and all.
    None,
    /// Returned in `reasoning_content`.
    #[default]
    Deepseek,
}

impl ReasoningFormat {
    pub const NAMES: &'static str = "none, deepseek";

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "none" => Some(Self::None),
            "deepseek" => Some(Self::Deepseek),
            _ => None,
        }
    }

    /// How a chat answer rendered by `template_source` is split, given the template's own
    /// text of the prompt (`prompt_skeleton`: the rendering without message contents, so a
    /// client cannot make its answer start inside a block); `None` where it is not.
    pub fn for_prompt(self, template_source: &str, prompt_skeleton: &str) -> Option<Thinking> {
        if self == Self::None || !template_thinks(template_source) {
            return None;
        }
        let opened = prompt_skeleton.rfind(OPEN);
        let closed = prompt_skeleton.rfind(CLOSE);
        Some(Thinking {
            starts_inside: match (opened, closed) {
                (Some(o), Some(c)) => o > c,
                (Some(_), None) => true,
                (None, _) => false,
            },
        })
    }
}

/// Whether a chat template writes thinking blocks.
pub fn template_thinks(source: &str) -> bool {
    source.contains(OPEN) && source.contains(CLOSE)
}

/// One request's split: whether its answer begins inside a thinking block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thinking {
    pub starts_inside: bool,
}

/// A whole answer, sorted.
pub fn split(thinking: Thinking, text: &str) -> Parts {
    let mut s = ReasoningStream::new(thinking);
    let mut parts = s.push(text);
    parts.append(s.finish());
    parts
}

/// Text of an answer, sorted.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Parts {
    pub thoughts: String,
    pub content: String,
}

impl Parts {
    fn append(&mut self, other: Parts) {
        self.thoughts.push_str(&other.thoughts);
        self.content.push_str(&other.content);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: the answer may still open a block.
    Start,
    /// Just past the opening tag: whitespace is dropped.
    Opened,
    Thinking,
    /// Just past the closing tag: whitespace is dropped.
    Closed,
    Answer,
}

/// One streamed answer, sorted as it comes. Text that may be the start of a tag, or
/// whitespace that may end the thoughts, is held until the next text shows what it is.
pub struct ReasoningStream {
    state: State,
    held: String,
}

impl ReasoningStream {
    pub fn new(thinking: Thinking) -> Self {
        let state = match thinking.starts_inside {
            true => State::Opened,
            false => State::Start,
        };
        Self {
            state,
            held: String::new(),
        }
    }

    /// Takes the next text; returns what is now certainly thoughts or content.
    pub fn push(&mut self, text: &str) -> Parts {
        self.held.push_str(text);
        let mut out = Parts::default();
        loop {
            match self.state {
                State::Start => {
                    let rest = self.held.trim_start();
                    if let Some(after) = rest.strip_prefix(OPEN) {
                        self.held = after.to_owned();
                        self.state = State::Opened;
                    } else if OPEN.starts_with(rest) {
                        // Whitespace, or a tag's beginning: wait.
                        return out;
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Opened | State::Closed => {
                    let rest = self.held.trim_start();
                    if rest.is_empty() {
                        self.held.clear();
                        return out;
                    }
                    self.held = rest.to_owned();
                    self.state = match self.state {
                        State::Opened => State::Thinking,
                        _ => State::Answer,
                    };
                }
                State::Thinking => match self.held.find(CLOSE) {
                    Some(end) => {
                        out.thoughts.push_str(self.held[..end].trim_end());
                        self.held = self.held[end + CLOSE.len()..].to_owned();
                        self.state = State::Closed;
                    }
                    None => {
                        // A tag's beginning, and the whitespace before it, wait: the
                        // thoughts end without the whitespace before their closing tag.
                        let tag = partial_suffix(&self.held, CLOSE);
                        let before = &self.held[..self.held.len() - tag];
                        let certain = before.trim_end().len();
                        out.thoughts.push_str(&self.held[..certain]);
                        self.held.drain(..certain);
                        return out;
                    }
                },
                State::Answer => {
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// The answer's end: whatever was held, as what it was.
    pub fn finish(&mut self) -> Parts {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Start | State::Answer => Parts {
                thoughts: String::new(),
                content: held,
            },
            // Cut off while thinking: a tag's beginning is thoughts.
            State::Thinking => Parts {
                thoughts: held,
                content: String::new(),
            },
            State::Opened | State::Closed => Parts::default(),
        }
    }
}

/// The length of the longest proper prefix of `tag` that `text` ends with (on a character
/// boundary: tags are ASCII).
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FRESH: Thinking = Thinking {
        starts_inside: false,
    };
    const OPENED: Thinking = Thinking {
        starts_inside: true,
    };

    fn parts(thoughts: &str, content: &str) -> Parts {
        Parts {
            thoughts: thoughts.to_owned(),
            content: content.to_owned(),
        }
    }

    #[test]
    fn thoughts_and_content_are_split_where_the_block_is() {
        let cases = [
            (
                FRESH,
                "<think>\nwhy\n</think>\n\nBecause.",
                parts("why", "Because."),
            ),
            (FRESH, "\n <think>a</think>b", parts("a", "b")),
            (FRESH, "<think>\n\n</think>\n\nHi", parts("", "Hi")),
            (FRESH, "No thoughts.", parts("", "No thoughts.")),
            // Only a block at the start is thoughts.
            (
                FRESH,
                "Later <think>x</think>",
                parts("", "Later <think>x</think>"),
            ),
            (FRESH, "  ", parts("", "  ")),
            (FRESH, "<thin", parts("", "<thin")),
            (OPENED, "why</think>ok", parts("why", "ok")),
            // Cut off while thinking: all of it is thoughts.
            (
                OPENED,
                "still thinking </thi",
                parts("still thinking </thi", ""),
            ),
            (FRESH, "<think>a</think>b</think>", parts("a", "b</think>")),
            (FRESH, "<think> é \n</think>ü", parts("é", "ü")),
            (FRESH, "<think>a < b </think>c", parts("a < b", "c")),
        ];
        for (thinking, text, want) in cases {
            assert_eq!(split(thinking, text), want, "{text:?}");
        }
    }

    #[test]
    fn a_stream_in_any_pieces_gives_the_whole_answers_split() {
        let texts = [
            "<think>why not</think>\n\nBecause. <think>",
            "  <think></think>x",
            "reasoned \n</think>  done",
            "plain <answer> text",
            "<think>cut </thi",
            "é<think>ü</think>",
            "<think> a < b </ </think> c",
        ];
        for text in texts {
            for thinking in [FRESH, OPENED] {
                let whole = split(thinking, text);
                let chars: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
                let at = |i: usize| chars.get(i).copied().unwrap_or(text.len());
                // Every way of cutting the text in three pieces.
                for a in 0..=chars.len() {
                    for b in a..=chars.len() {
                        let pieces = [&text[..at(a)], &text[at(a)..at(b)], &text[at(b)..]];
                        let mut s = ReasoningStream::new(thinking);
                        let mut got = Parts::default();
                        for p in pieces {
                            got.append(s.push(p));
                        }
                        got.append(s.finish());
                        assert_eq!(got, whole, "{text:?} in {pieces:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn only_templates_that_teach_the_tags_split_and_the_prompt_says_where_it_starts() {
        let thinking = "{% if x %}<think>\n\n</think>{% endif %}";
        let f = ReasoningFormat::Deepseek;
        assert_eq!(f.for_prompt("plain {{ messages }}", "any"), None);
        assert_eq!(ReasoningFormat::None.for_prompt(thinking, "x"), None);
        assert_eq!(
            f.for_prompt(thinking, "<|user|>hi<|assistant|>"),
            Some(FRESH)
        );
        assert_eq!(
            f.for_prompt(thinking, "<|assistant|><think>\n"),
            Some(OPENED)
        );
        assert_eq!(
            f.for_prompt(thinking, "<|assistant|><think>\n\n</think>\n\n"),
            Some(FRESH),
            "thinking switched off closes the block in the prompt"
        );
    }
}
