//! Conversions between the engine's types and their protobuf form. Everything that comes
//! off the wire is checked here before it becomes an engine value: a malformed message is
//! an `invalid_argument` for its own call, never a panic or a default.

use engine::handoff::{Manifest, Ticket};
use engine::{
    EngineError, FinishReason, GenerateRequest, IsolationDomain, Penalties, Rejection,
    SamplingParams, TokenEvent, Usage,
};
use std::sync::Arc;

use constraint::{ConstraintSpec, Vocabulary};
use tonic::Status;

use crate::pb;

/// Most logprobs alternatives a request may ask for (the OpenAI API allows 20).
const MAX_TOP_LOGPROBS: u32 = 20;
/// Most logit_bias entries (the public API's limit).
const MAX_LOGIT_BIAS: usize = 1024;

pub fn request_to_pb(request_id: &str, r: &GenerateRequest) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: request_id.to_owned(),
        tenant: r.domain.tenant_name().to_owned(),
        salt: r.domain.salt().map(str::to_owned),
        weight: r.weight,
        prompt: r.prompt.clone(),
        max_tokens: r.max_tokens as u64,
        sampling: Some(pb::Sampling {
            temperature: r.sampling.temperature,
            top_p: r.sampling.top_p,
            top_k: r.sampling.top_k as u64,
            seed: r.sampling.seed,
            min_p: r.sampling.min_p,
            presence_penalty: r.sampling.penalties.presence,
            frequency_penalty: r.sampling.penalties.frequency,
            repetition_penalty: r.sampling.penalties.repetition,
            repeat_last_n: r.sampling.penalties.repeat_last_n as u64,
            logit_bias: r
                .sampling
                .logit_bias
                .iter()
                .map(|&(token, bias)| pb::LogitBias { token, bias })
                .collect(),
            constraint: r.constraint.as_ref().map(|c| {
                let (kind, text) = c.spec().to_parts();
                pb::Constraint {
                    kind: kind.to_owned(),
                    text,
                }
            }),
        }),
        ignore_eos: r.ignore_eos,
        logprobs: r.logprobs.map(|k| k as u32),
    }
}

pub fn domain(tenant: String, salt: Option<String>) -> IsolationDomain {
    let d = IsolationDomain::tenant(tenant);
    match salt {
        Some(s) => d.narrowed(s),
        None => d,
    }
}

fn invalid(what: &str) -> Status {
    Status::invalid_argument(what.to_owned())
}

/// The request id and the engine request; refuses what the router would never send. A
/// constraint is compiled here, against this node's vocabulary, within the same limits as
/// at the edge (up to a few hundred milliseconds: call it off the async workers, as
/// [`request_from_pb_blocking`] does).
pub fn request_from_pb(
    r: pb::GenerateRequest,
    vocabulary: &Vocabulary,
) -> Result<(String, GenerateRequest), Status> {
    if r.request_id.is_empty() || r.request_id.len() > 128 {
        return Err(invalid("request_id must be 1 to 128 bytes"));
    }
    if r.tenant.is_empty() {
        return Err(invalid("tenant is required"));
    }
    let mut s = r.sampling.ok_or_else(|| invalid("sampling is required"))?;
    let constraint = s.constraint.take();
    let sampling = sampling_from_pb(s)?;
    if r.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
        return Err(invalid("logprobs out of range"));
    }
    // Compiling is the expensive check: last, once everything cheaper has passed.
    let constraint = match constraint {
        None => None,
        // The public API refuses the pair: a constrained answer ends when it is complete.
        Some(_) if r.ignore_eos => {
            return Err(invalid("constraint: cannot be combined with ignore_eos"))
        }
        Some(c) => {
            let spec = ConstraintSpec::from_parts(&c.kind, &c.text)
                .map_err(|e| invalid(&format!("constraint: {e}")))?;
            Some(
                vocabulary
                    .compile(&spec)
                    .map_err(|e| invalid(&format!("constraint: {e}")))?,
            )
        }
    };
    let request = GenerateRequest {
        weight: r.weight.max(1),
        domain: domain(r.tenant, r.salt),
        prompt: r.prompt,
        max_tokens: usize::try_from(r.max_tokens).unwrap_or(usize::MAX),
        sampling,
        ignore_eos: r.ignore_eos,
        logprobs: r.logprobs.map(|k| k as usize),
        constraint,
    };
    Ok((r.request_id, request))
}

/// [`request_from_pb`] on a blocking thread when the request carries a constraint to
/// compile, so that compiling never holds up the node's other calls.
pub async fn request_from_pb_blocking(
    r: pb::GenerateRequest,
    vocabulary: &Arc<Vocabulary>,
) -> Result<(String, GenerateRequest), Status> {
    let constrained = r.sampling.as_ref().is_some_and(|s| s.constraint.is_some());
    if !constrained {
        return request_from_pb(r, vocabulary);
    }
    let vocabulary = vocabulary.clone();
    tokio::task::spawn_blocking(move || request_from_pb(r, &vocabulary))
        .await
        .map_err(|e| Status::internal(format!("compiling the constraint: {e}")))?
}

/// The ranges the public API's validation enforces, checked again on what arrives.
fn sampling_from_pb(s: pb::Sampling) -> Result<SamplingParams, Status> {
    let in_range = |v: f32, lo: f32, hi: f32| v.is_finite() && v >= lo && v <= hi;
    let ok = s.temperature.is_finite()
        && s.temperature >= 0.0
        && s.top_p.is_finite()
        && s.top_p > 0.0
        && s.top_p <= 1.0
        && in_range(s.min_p, 0.0, 1.0)
        && in_range(s.presence_penalty, -2.0, 2.0)
        && in_range(s.frequency_penalty, -2.0, 2.0)
        && in_range(s.repetition_penalty, f32::MIN_POSITIVE, 2.0);
    if !ok {
        return Err(invalid("sampling parameters out of range"));
    }
    if s.logit_bias.len() > MAX_LOGIT_BIAS {
        return Err(invalid("too many logit_bias entries"));
    }
    let sorted = s.logit_bias.windows(2).all(|w| w[0].token < w[1].token);
    if !sorted || !s.logit_bias.iter().all(|b| in_range(b.bias, -100.0, 100.0)) {
        return Err(invalid(
            "logit_bias must be sorted, unique and within [-100, 100]",
        ));
    }
    Ok(SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: usize::try_from(s.top_k).unwrap_or(usize::MAX),
        min_p: s.min_p,
        seed: s.seed,
        penalties: Penalties {
            presence: s.presence_penalty,
            frequency: s.frequency_penalty,
            repetition: s.repetition_penalty,
            repeat_last_n: usize::try_from(s.repeat_last_n).unwrap_or(usize::MAX),
        },
        logit_bias: s.logit_bias.iter().map(|b| (b.token, b.bias)).collect(),
    })
}

pub fn rejection_to_pb(r: &Rejection) -> pb::Rejection {
    use pb::rejection::Kind;
    let kind = match *r {
        Rejection::EmptyPrompt => Kind::EmptyPrompt(true),
        Rejection::ZeroMaxTokens => Kind::ZeroMaxTokens(true),
        Rejection::ContextLengthExceeded {
            limit,
            prompt_tokens,
            max_tokens,
            total,
        } => Kind::ContextLengthExceeded(pb::rejection::ContextLengthExceeded {
            limit: limit as u64,
            prompt_tokens: prompt_tokens as u64,
            max_tokens: max_tokens as u64,
            total: total as u64,
        }),
        Rejection::TokenOutOfRange { id, vocab } => {
            Kind::TokenOutOfRange(pb::rejection::TokenOutOfRange {
                id,
                vocab: vocab as u64,
            })
        }
        // Made only by the public API's check of a text before tokenizing it; nodes see
        // tokens, so none sends it. Should one, it is the context limit it stands for.
        Rejection::TextCannotFit {
            limit,
            min_tokens,
            max_tokens,
            ..
        } => Kind::ContextLengthExceeded(pb::rejection::ContextLengthExceeded {
            limit: limit as u64,
            prompt_tokens: min_tokens as u64,
            max_tokens: max_tokens.unwrap_or(0) as u64,
            total: min_tokens.saturating_add(max_tokens.unwrap_or(0)) as u64,
        }),
    };
    pb::Rejection { kind: Some(kind) }
}

fn size(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// The node's original rejection, so the client sees the same error as from `serve`.
pub fn rejection_from_pb(r: pb::Rejection) -> Result<Rejection, Status> {
    use pb::rejection::Kind;
    Ok(match r.kind.ok_or_else(|| invalid("empty rejection"))? {
        Kind::EmptyPrompt(_) => Rejection::EmptyPrompt,
        Kind::ZeroMaxTokens(_) => Rejection::ZeroMaxTokens,
        Kind::ContextLengthExceeded(c) => Rejection::ContextLengthExceeded {
            limit: size(c.limit),
            prompt_tokens: size(c.prompt_tokens),
            max_tokens: size(c.max_tokens),
            total: size(c.total),
        },
        Kind::TokenOutOfRange(t) => Rejection::TokenOutOfRange {
            id: t.id,
            vocab: size(t.vocab),
        },
    })
}

pub fn token_to_pb(t: &TokenEvent) -> pb::Token {
    pb::Token {
        id: t.id,
        logprob: t.logprob,
        top_logprobs: t
            .top_logprobs
            .iter()
            .map(|&(id, logprob)| pb::TopLogprob { id, logprob })
            .collect(),
        cached_prompt_tokens: t.cached_prompt_tokens as u64,
    }
}

pub fn token_from_pb(t: pb::Token) -> Result<TokenEvent, Status> {
    if t.top_logprobs.len() > MAX_TOP_LOGPROBS as usize {
        return Err(invalid("too many top logprobs"));
    }
    Ok(TokenEvent {
        id: t.id,
        logprob: t.logprob,
        top_logprobs: t
            .top_logprobs
            .into_iter()
            .map(|x| (x.id, x.logprob))
            .collect(),
        cached_prompt_tokens: size(t.cached_prompt_tokens),
    })
}

pub fn finished_to_pb(reason: FinishReason, usage: &Usage) -> pb::Finished {
    pb::Finished {
        stop: reason == FinishReason::Stop,
        prompt_tokens: usage.prompt_tokens as u64,
        completion_tokens: usage.completion_tokens as u64,
        cached_tokens: usage.cached_tokens as u64,
    }
}

pub fn finished_from_pb(f: &pb::Finished) -> (FinishReason, Usage) {
    let reason = if f.stop {
        FinishReason::Stop
    } else {
        FinishReason::Length
    };
    let usage = Usage {
        prompt_tokens: size(f.prompt_tokens),
        completion_tokens: size(f.completion_tokens),
        cached_tokens: size(f.cached_tokens),
    };
    (reason, usage)
}

/// A failure's metric label and the message a peer may see. Engine errors carry internal
/// request numbers in their detail: those are logged, not sent.
pub fn failure_from_engine(e: &EngineError) -> pb::Failure {
    let reason = match e {
        EngineError::Isolation(_) => "isolation",
        EngineError::Model(_) => "model",
        EngineError::Constraint(_) => "constraint",
        EngineError::Shutdown => "shutdown",
        EngineError::Remote { reason, .. } => reason.as_str(),
    };
    tracing::warn!("request failed on this node: {e}");
    pb::Failure {
        reason: reason.to_owned(),
        message: match e {
            EngineError::Isolation(_) => "a KV isolation check failed on the decode node".into(),
            EngineError::Model(_) => "the model failed on the node".into(),
            // The request's own grammar's failure: nothing of any other request.
            EngineError::Constraint(m) => m.clone(),
            EngineError::Shutdown => "the node is shutting down".into(),
            EngineError::Remote { message, .. } => message.clone(),
        },
    }
}

pub fn failure(reason: &str, message: impl Into<String>) -> pb::Failure {
    pb::Failure {
        reason: reason.to_owned(),
        message: message.into(),
    }
}

pub fn manifest_to_pb(m: &Manifest) -> pb::Manifest {
    pb::Manifest {
        ticket: m.ticket.to_bytes().to_vec(),
        request_id: m.request_id.clone(),
        tenant: m.domain.tenant_name().to_owned(),
        salt: m.domain.salt().map(str::to_owned),
        prompt_len: m.prompt_len as u64,
        token_checksum: m.token_checksum,
        first_token: Some(token_to_pb(&m.first_token)),
        sampler_state: m.sampler_state.to_vec(),
        page_tokens: m.page_tokens as u32,
        page_checksums: m.page_checksums.clone(),
        cached_tokens: m.cached_tokens as u64,
    }
}

pub fn manifest_from_pb(m: pb::Manifest) -> Result<Manifest, Status> {
    let ticket = Ticket::from_bytes(&m.ticket).ok_or_else(|| invalid("ticket must be 16 bytes"))?;
    let sampler_state: [u64; 4] = m
        .sampler_state
        .try_into()
        .map_err(|_| invalid("sampler_state must hold 4 words"))?;
    let first = m
        .first_token
        .ok_or_else(|| invalid("first_token is required"))?;
    Ok(Manifest {
        ticket,
        request_id: m.request_id,
        domain: domain(m.tenant, m.salt),
        prompt_len: size(m.prompt_len),
        token_checksum: m.token_checksum,
        first_token: token_from_pb(first)?,
        sampler_state,
        page_tokens: m.page_tokens as usize,
        page_checksums: m.page_checksums,
        cached_tokens: size(m.cached_tokens),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The synthetic model's byte-level vocabulary.
    fn vocabulary() -> Vocabulary {
        let spec = model::synth::SynthSpec::small(1, gguf::GgmlType::Q8_0, 64);
        let file = gguf::GgufFile::parse(spec.build().unwrap().to_bytes()).unwrap();
        let tok = Arc::new(tokenizer::Tokenizer::from_gguf(&file).unwrap());
        Vocabulary::new(tok.clone(), tok.vocab_size(), tok.eos_id())
    }

    fn request() -> GenerateRequest {
        GenerateRequest {
            weight: 7,
            domain: IsolationDomain::tenant("alice"),
            prompt: vec![1, 2, 3],
            max_tokens: 4,
            sampling: SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                top_k: 40,
                min_p: 0.05,
                seed: 11,
                penalties: Penalties {
                    presence: 0.5,
                    frequency: -0.25,
                    repetition: 1.15,
                    repeat_last_n: usize::MAX,
                },
                logit_bias: std::sync::Arc::from([(2, -100.0), (7, 3.5)]),
            },
            ignore_eos: false,
            logprobs: Some(3),
            constraint: None,
        }
    }

    #[test]
    fn every_sampling_parameter_crosses_the_wire() {
        let sent = request();
        let (_, got) = request_from_pb(request_to_pb("r1", &sent), &vocabulary()).unwrap();
        assert_eq!(got.sampling, sent.sampling);
        assert_eq!(got.weight, 7, "the tenant's weight reaches the nodes");
        assert!(got.constraint.is_none());
    }

    #[test]
    fn a_constraint_crosses_the_wire_as_source_and_is_compiled_on_arrival() {
        let vocab = vocabulary();
        let spec = ConstraintSpec::Choice(vec!["yes".into(), "no".into()]);
        let mut sent = request();
        sent.constraint = Some(vocab.compile(&spec).unwrap());
        let (_, got) = request_from_pb(request_to_pb("r1", &sent), &vocab).unwrap();
        let mut row = got.constraint.expect("the constraint arrived");
        assert_eq!(row.spec(), &spec);
        // Compiled here: its mask allows the first byte of each choice and nothing else.
        let mask = row.mask().unwrap();
        let first: Vec<u32> = mask.allowed();
        assert!(!first.is_empty() && first.len() <= 4, "{first:?}");

        let cases: [(&str, String); 4] = [
            ("python", String::new()),
            ("regex", "(unclosed".into()),
            ("choice", "not a list".into()),
            ("gbnf", "x".repeat(constraint::limits::MAX_SOURCE_BYTES + 1)),
        ];
        for (kind, text) in cases {
            let mut pb = request_to_pb("r1", &request());
            pb.sampling.as_mut().unwrap().constraint = Some(pb::Constraint {
                kind: kind.into(),
                text,
            });
            let err = request_from_pb(pb, &vocab).expect_err(kind);
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{kind}");
            assert!(
                err.message().starts_with("constraint: "),
                "{kind}: {}",
                err.message()
            );
        }
        // A valid constraint with ignore_eos, which the public API refuses, is refused too.
        let mut pb = request_to_pb("r1", &sent);
        pb.ignore_eos = true;
        let err = request_from_pb(pb, &vocab).expect_err("ignore_eos with a constraint");
        assert!(err.message().contains("ignore_eos"), "{}", err.message());
    }

    #[test]
    fn sampling_the_api_would_refuse_is_refused_off_the_wire() {
        let cases: [fn(&mut pb::Sampling); 5] = [
            |s| s.repetition_penalty = 0.0,
            |s| s.presence_penalty = f32::NAN,
            |s| s.min_p = 1.5,
            |s| s.logit_bias.reverse(),
            |s| s.logit_bias[0].bias = 101.0,
        ];
        for (i, spoil) in cases.into_iter().enumerate() {
            let mut pb = request_to_pb("r1", &request());
            spoil(pb.sampling.as_mut().unwrap());
            let err =
                request_from_pb(pb, &vocabulary()).expect_err(&format!("case {i} was accepted"));
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "case {i}");
        }
    }
}
