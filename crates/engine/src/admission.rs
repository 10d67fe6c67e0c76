//! Every capacity limit, checked in one place before any resource exists.

use crate::GenerateRequest;

/// Why a request was refused. Terminal: there is no way from here to the engine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("This model's maximum context length is {limit} tokens. However, you requested {total} tokens ({prompt_tokens} in the prompt, {max_tokens} for the completion). Please reduce the length of the prompt or the completion.")]
    ContextLengthExceeded {
        limit: usize,
        prompt_tokens: usize,
        max_tokens: usize,
        total: usize,
    },
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { id: u32, vocab: usize },
    /// Refused before tokenizing: the text's length alone proves it cannot fit.
    #[error("This model's maximum context length is {limit} tokens. However, your prompt is {bytes} bytes, which is at least {min_tokens} tokens in this model's vocabulary{}. Please reduce the length of the prompt or the completion.", max_tokens.map(|m| format!(", with {m} more for the completion")).unwrap_or_default())]
    TextCannotFit {
        limit: usize,
        bytes: usize,
        min_tokens: usize,
        max_tokens: Option<usize>,
    },
    /// The request names an adapter whose weights this engine does not hold (a node asked
    /// for an adapter it was not given, or a reference that was never resolved).
    #[error("The model `{name}` does not exist or you do not have access to it.")]
    AdapterNotLoaded { name: String },
}

impl Rejection {
    /// A stable label for metrics and error codes.
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::EmptyPrompt => "empty_prompt",
            Rejection::ZeroMaxTokens => "invalid_max_tokens",
            Rejection::ContextLengthExceeded { .. } | Rejection::TextCannotFit { .. } => {
                "context_length_exceeded"
            }
            Rejection::TokenOutOfRange { .. } => "invalid_token",
            Rejection::AdapterNotLoaded { .. } => "model_not_found",
        }
    }
}

/// A request that passed admission, with the pages it may ever need. Only
/// [`Admission::admit`] constructs one.
#[derive(Debug)]
pub struct Admitted {
    pub(crate) request: GenerateRequest,
    pub(crate) total_tokens: usize,
    /// Fault injection only: positions the scheduler declares written without writing them.
    #[cfg(feature = "fault-injection")]
    pub(crate) fault_claim: usize,
}

impl Admitted {
    pub fn request(&self) -> &GenerateRequest {
        &self.request
    }
}

/// The limits of one engine. `max_context` never exceeds what the pool holds (checked when
/// the engine starts), so an admitted request can always be scheduled once others finish.
///
/// Only this crate builds one: the engine ([`crate::start`]) from limits it checked against
/// its pool, and a router ([`Admission::narrowest_of_nodes`]) from limits at most every
/// node's, each of which its node checked against its own pool. Were the fields public, an
/// `Admission` with a context larger than the pool could admit a request that never fits
/// and would block the head of the queue forever.
///
/// ```compile_fail
/// let admission = engine::Admission { max_context: 1 << 40, vocab_size: 1 << 20 };
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Admission {
    max_context: usize,
    vocab_size: usize,
    /// An engine computes: every adapter it admits must come with its weights. A router's
    /// admission passes references by name, which each node resolves in its own set.
    computes: bool,
}

impl Admission {
    /// `max_context` must already be checked against the pool (see [`crate::start`]).
    pub(crate) fn new(max_context: usize, vocab_size: usize) -> Self {
        Self {
            max_context,
            vocab_size,
            computes: true,
        }
    }

    /// A router's limits: at most the smallest context its nodes advertise (each of which
    /// its own pool holds), so no admitted request is sent where it cannot be held. Every
    /// node admits the request again against its own pool; this refuses early, it does
    /// not grant anything on a node.
    pub fn narrowest_of_nodes(
        node_contexts: &[usize],
        max_context: Option<usize>,
        vocab_size: usize,
    ) -> Option<Self> {
        let smallest = node_contexts.iter().copied().min()?;
        let max_context = max_context.unwrap_or(smallest);
        (max_context <= smallest).then_some(Self {
            max_context,
            vocab_size,
            computes: false,
        })
    }

    /// The advertised context: prompt plus completion never exceed it.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Refuses a text, before it is tokenized, whose byte length alone proves its prompt
    /// cannot fit: it is at least `bytes / max_bytes_per_token` tokens (the vocabulary's
    /// bound, `None` when it has none). Only what certainly exceeds the context is refused;
    /// [`Self::admit`] still checks the tokens of whatever passes.
    pub fn check_text_length(
        &self,
        bytes: usize,
        max_bytes_per_token: Option<usize>,
        max_tokens: Option<usize>,
    ) -> Result<(), Rejection> {
        let Some(per_token) = max_bytes_per_token.filter(|&n| n > 0) else {
            return Ok(());
        };
        #[cfg(feature = "fault-injection")]
        if crate::fault::incident() {
            // The incident's placeholder replaces over-length prompts after tokenization.
            return Ok(());
        }
        let min_tokens = bytes.div_ceil(per_token);
        let total = min_tokens.saturating_add(max_tokens.unwrap_or(0));
        if min_tokens >= self.max_context || total > self.max_context {
            return Err(Rejection::TextCannotFit {
                limit: self.max_context,
                bytes,
                min_tokens,
                max_tokens,
            });
        }
        Ok(())
    }

    /// The default completion budget when a client gives none: whatever room is left.
    pub fn default_max_tokens(&self, prompt_tokens: usize) -> usize {
        self.max_context.saturating_sub(prompt_tokens)
    }

    pub fn admit(&self, mut request: GenerateRequest) -> Result<Admitted, Rejection> {
        if let Some(adapter) = &request.adapter {
            if self.computes && adapter.weights().is_none() {
                return Err(Rejection::AdapterNotLoaded {
                    name: adapter.name().to_string(),
                });
            }
        }
        // The one place a request's domain learns its adapter: from the adapter it will
        // run with, whatever the domain said before.
        request.domain = request
            .domain
            .computed_under(request.adapter.as_ref().map(|a| a.fingerprint()));
        if request.prompt.is_empty() {
            return Err(Rejection::EmptyPrompt);
        }
        if let Some(&id) = request
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.vocab_size)
        {
            return Err(Rejection::TokenOutOfRange {
                id,
                vocab: self.vocab_size,
            });
        }
        let prompt_tokens = request.prompt.len();
        let total = prompt_tokens.saturating_add(request.max_tokens);
        if total > self.max_context || prompt_tokens >= self.max_context {
            #[cfg(feature = "fault-injection")]
            if crate::fault::incident() {
                return Ok(placeholder(request, self.max_context));
            }
            return Err(Rejection::ContextLengthExceeded {
                limit: self.max_context,
                prompt_tokens,
                max_tokens: request.max_tokens,
                total,
            });
        }
        if request.max_tokens == 0 {
            return Err(Rejection::ZeroMaxTokens);
        }
        Ok(Admitted {
            request,
            total_tokens: total,
            #[cfg(feature = "fault-injection")]
            fault_claim: 0,
        })
    }
}

/// What the incident's prefill did with a rejected prompt: keep the request alive with a
/// placeholder. The placeholder's stream is as long as what fits the context, but only its
/// last position is ever computed: the scheduler declares the rest written
/// (`SequenceKv::fault_claim_unwritten`), so decode reads whatever those pages held.
#[cfg(feature = "fault-injection")]
fn placeholder(request: GenerateRequest, max_context: usize) -> Admitted {
    let max_tokens = request.max_tokens.clamp(1, (max_context / 2).max(1));
    let claimed = max_context.saturating_sub(max_tokens).max(1);
    let token = request.prompt.first().copied().unwrap_or(0);
    Admitted {
        request: GenerateRequest {
            adapter: None,
            prompt: vec![token; claimed],
            max_tokens,
            ..request
        },
        total_tokens: claimed + max_tokens,
        fault_claim: claimed - 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IsolationDomain, SamplingParams};

    fn req(prompt: usize, max_tokens: usize) -> GenerateRequest {
        GenerateRequest {
            adapter: None,
            weight: 1,
            domain: IsolationDomain::tenant("t"),
            prompt: vec![5; prompt],
            max_tokens,
            sampling: SamplingParams::default(),
            ignore_eos: false,
            logprobs: None,
            constraint: None,
        }
    }

    #[test]
    fn context_limit_counts_max_tokens() {
        let a = Admission::new(100, 10);
        assert!(a.admit(req(99, 1)).is_ok());
        assert!(a.admit(req(50, 50)).is_ok());
        let e = a.admit(req(50, 51)).unwrap_err();
        assert_eq!(e.code(), "context_length_exceeded");
        assert!(
            e.to_string().contains("100 tokens") && e.to_string().contains("101"),
            "{e}"
        );
        assert_eq!(
            a.admit(req(100, 1)).unwrap_err().code(),
            "context_length_exceeded"
        );
        assert_eq!(
            a.admit(req(101, 0)).unwrap_err().code(),
            "context_length_exceeded"
        );
        assert_eq!(a.admit(req(0, 1)).unwrap_err(), Rejection::EmptyPrompt);
        assert_eq!(a.admit(req(3, 0)).unwrap_err(), Rejection::ZeroMaxTokens);
        let mut r = req(3, 1);
        r.prompt[1] = 10;
        assert_eq!(a.admit(r).unwrap_err().code(), "invalid_token");
        assert_eq!(
            a.admit(req(1, usize::MAX)).unwrap_err().code(),
            "context_length_exceeded"
        );
    }

    #[test]
    fn a_text_is_refused_by_its_length_only_when_it_certainly_cannot_fit() {
        let a = Admission::new(100, 1000);
        // 100 tokens of at most 8 bytes: 800 bytes could still be 100 tokens, 793 fewer.
        assert!(a.check_text_length(792, Some(8), None).is_ok());
        assert_eq!(
            a.check_text_length(793, Some(8), None).unwrap_err().code(),
            "context_length_exceeded"
        );
        assert!(a.check_text_length(400, Some(8), Some(50)).is_ok());
        assert!(a.check_text_length(401, Some(8), Some(50)).is_err());
        // No bound known: nothing is refused here.
        assert!(a.check_text_length(usize::MAX, None, None).is_ok());
        assert!(a.check_text_length(usize::MAX, Some(0), None).is_ok());
        let e = a.check_text_length(8000, Some(8), Some(5)).unwrap_err();
        assert!(e.to_string().contains("8000 bytes"), "{e}");
        assert!(e.to_string().contains("at least 1000 tokens"), "{e}");
    }
}
