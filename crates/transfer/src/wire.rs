//! Conversions between the engine's types and their protobuf form. Everything that comes
//! off the wire is checked here before it becomes an engine value: a malformed message is
//! an `invalid_argument` for its own call, never a panic or a default.

use engine::handoff::{Manifest, Ticket};
use engine::{
    AdapterInfo, AdapterRef, Adapters, EngineError, FinishReason, GenerateRequest, IsolationDomain,
    Penalties, Rejection, SamplingParams, TokenEvent, Usage,
};
use std::sync::Arc;

use constraint::{ConstraintSpec, Vocabulary};
use tonic::Status;

use crate::pb;

/// Most logprobs alternatives a request may ask for (the OpenAI API allows 20).
const MAX_TOP_LOGPROBS: u32 = 20;
/// Most logit_bias entries (the public API's limit).
const MAX_LOGIT_BIAS: usize = 1024;
/// Most stop_token_ids (the public API's limit).
const MAX_STOP_TOKEN_IDS: usize = 64;

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
            stop_token_ids: r.sampling.stop_tokens.to_vec(),
            min_tokens: r.sampling.min_tokens as u64,
        }),
        ignore_eos: r.ignore_eos,
        logprobs: r.logprobs.map(|k| k as u32),
        adapter: r.adapter.as_ref().map(|a| adapter_to_pb(&AdapterId::of(a))),
    }
}

/// A LoRA adapter's identity as nodes compare it: the name it is served under, what it
/// computes and the file it came from. Never its weights: each node loads its own.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct AdapterId {
    pub name: String,
    pub fingerprint: u128,
    pub file_checksum: u128,
}

impl AdapterId {
    pub fn of(r: &AdapterRef) -> Self {
        Self {
            name: r.name().to_owned(),
            fingerprint: r.fingerprint(),
            file_checksum: r.file_checksum(),
        }
    }

    pub fn of_info(i: &AdapterInfo) -> Self {
        Self {
            name: i.name.clone(),
            fingerprint: i.fingerprint,
            file_checksum: i.file_checksum,
        }
    }

    /// A reference by identity, for a process that holds no weights (the router).
    pub fn to_remote(&self) -> AdapterRef {
        AdapterRef::remote(&self.name, self.fingerprint, self.file_checksum)
    }
}

impl std::fmt::Display for AdapterId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}` (fingerprint {:032x}, file xxh3-128 {:032x})",
            self.name, self.fingerprint, self.file_checksum
        )
    }
}

/// How an adapter's identity, or its absence, reads in a message.
pub fn describe_adapter(a: Option<&AdapterId>) -> String {
    a.map_or_else(|| "the base model".to_owned(), ToString::to_string)
}

pub fn adapter_to_pb(a: &AdapterId) -> pb::Adapter {
    pb::Adapter {
        name: a.name.clone(),
        fingerprint: a.fingerprint.to_le_bytes().to_vec(),
        file_checksum: a.file_checksum.to_le_bytes().to_vec(),
    }
}

pub fn adapter_from_pb(a: pb::Adapter) -> Result<AdapterId, Status> {
    if !Adapters::valid_name(&a.name) {
        return Err(invalid("adapter name is not one an adapter can have"));
    }
    let word = |bytes: &[u8], what: &str| {
        bytes
            .try_into()
            .map(u128::from_le_bytes)
            .map_err(|_| invalid(&format!("adapter {what} must be 16 bytes")))
    };
    Ok(AdapterId {
        fingerprint: word(&a.fingerprint, "fingerprint")?,
        file_checksum: word(&a.file_checksum, "file checksum")?,
        name: a.name,
    })
}

/// The adapters a node holds, as its `Info` reports them (sorted by name).
pub fn adapters_to_pb(adapters: &Adapters) -> Vec<pb::LoadedAdapter> {
    let mut list = adapters.list();
    list.sort_by(|a, b| a.name.cmp(&b.name));
    list.iter()
        .map(|a| pb::LoadedAdapter {
            adapter: Some(adapter_to_pb(&AdapterId::of_info(a))),
            scale: a.scale,
            rank: a.rank as u64,
        })
        .collect()
}

/// A node's adapter set off the wire, sorted by name; a malformed entry or a name given
/// twice is refused.
pub fn adapters_from_pb(adapters: Vec<pb::LoadedAdapter>) -> Result<Vec<AdapterInfo>, Status> {
    let mut list = Vec::with_capacity(adapters.len());
    for a in adapters {
        let id = adapter_from_pb(
            a.adapter
                .ok_or_else(|| invalid("an adapter without its identity"))?,
        )?;
        if !a.scale.is_finite() {
            return Err(invalid("adapter scale must be finite"));
        }
        list.push(AdapterInfo {
            name: id.name,
            fingerprint: id.fingerprint,
            file_checksum: id.file_checksum,
            rank: size(a.rank),
            scale: a.scale,
        });
    }
    list.sort_by(|a, b| a.name.cmp(&b.name));
    if list.windows(2).any(|w| w[0].name == w[1].name) {
        return Err(invalid("an adapter name is listed twice"));
    }
    Ok(list)
}

/// The adapter a request names, resolved in this node's own set: the one it holds under
/// that name, and only if it is the very adapter the router named (same fingerprint and
/// file). Anything else is refused: a node never computes a request under another adapter
/// than the router named, nor under the base model for an adapter request.
fn resolve_adapter(named: AdapterId, adapters: &Adapters) -> Result<AdapterRef, Rejection> {
    let refused = || Rejection::AdapterNotLoaded {
        name: named.name.clone(),
    };
    let Some(held) = adapters.get(&named.name) else {
        tracing::warn!("a request names adapter {named}, which this node does not hold: refused");
        return Err(refused());
    };
    let ours = AdapterId::of(&held);
    if ours != named {
        tracing::warn!(
            "a request names adapter {named}, but this node holds {ours} under that name: refused"
        );
        return Err(refused());
    }
    Ok(held)
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

/// Why a request off the wire did not become an engine request.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// Malformed: what the router would never send; an `invalid_argument` for its call.
    #[error("{}", .0.message())]
    Invalid(Status),
    /// Well formed, but this node cannot compute it as named (an adapter it does not
    /// hold, or holds in another version): a verdict the router passes to the client.
    #[error(transparent)]
    Rejected(Rejection),
}

impl From<Status> for RequestError {
    fn from(s: Status) -> Self {
        RequestError::Invalid(s)
    }
}

/// The request id and the engine request; refuses what the router would never send. The
/// request's adapter is resolved in `adapters`, this node's own set ([`RequestError::Rejected`]
/// unless it holds exactly the adapter named). A constraint is compiled here, against this
/// node's vocabulary, within the same limits as at the edge (up to a few hundred
/// milliseconds: call it off the async workers, as [`request_from_pb_blocking`] does).
pub fn request_from_pb(
    r: pb::GenerateRequest,
    vocabulary: &Vocabulary,
    adapters: &Adapters,
) -> Result<(String, GenerateRequest), RequestError> {
    if r.request_id.is_empty() || r.request_id.len() > 128 {
        return Err(invalid("request_id must be 1 to 128 bytes").into());
    }
    if r.tenant.is_empty() {
        return Err(invalid("tenant is required").into());
    }
    let mut s = r.sampling.ok_or_else(|| invalid("sampling is required"))?;
    let constraint = s.constraint.take();
    let sampling = sampling_from_pb(s)?;
    if r.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
        return Err(invalid("logprobs out of range").into());
    }
    let adapter = match r.adapter {
        None => None,
        Some(a) => {
            Some(resolve_adapter(adapter_from_pb(a)?, adapters).map_err(RequestError::Rejected)?)
        }
    };
    // Compiling is the expensive check: last, once everything cheaper has passed.
    let constraint = match constraint {
        None => None,
        // The public API refuses the pair: a constrained answer ends when it is complete.
        Some(_) if r.ignore_eos => {
            return Err(invalid("constraint: cannot be combined with ignore_eos").into())
        }
        Some(_) if sampling.min_tokens > 0 => {
            return Err(invalid("constraint: cannot be combined with min_tokens").into())
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
        adapter,
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
    adapters: &Arc<Adapters>,
) -> Result<(String, GenerateRequest), RequestError> {
    let constrained = r.sampling.as_ref().is_some_and(|s| s.constraint.is_some());
    if !constrained {
        return request_from_pb(r, vocabulary, adapters);
    }
    let (vocabulary, adapters) = (vocabulary.clone(), adapters.clone());
    tokio::task::spawn_blocking(move || request_from_pb(r, &vocabulary, &adapters))
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
    let stops_sorted = s.stop_token_ids.windows(2).all(|w| w[0] < w[1]);
    if s.stop_token_ids.len() > MAX_STOP_TOKEN_IDS || !stops_sorted {
        return Err(invalid(
            "stop_token_ids must be sorted, unique and at most 64",
        ));
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
        stop_tokens: s.stop_token_ids.into(),
        min_tokens: usize::try_from(s.min_tokens).unwrap_or(usize::MAX),
    })
}

pub fn rejection_to_pb(r: &Rejection) -> pb::Rejection {
    use pb::rejection::Kind;
    let kind = match r {
        Rejection::AdapterNotLoaded { name } => Kind::AdapterNotLoaded(name.clone()),
        Rejection::EmptyPrompt => Kind::EmptyPrompt(true),
        Rejection::ZeroMaxTokens => Kind::ZeroMaxTokens(true),
        &Rejection::ContextLengthExceeded {
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
        &Rejection::TokenOutOfRange { id, vocab } => {
            Kind::TokenOutOfRange(pb::rejection::TokenOutOfRange {
                id,
                vocab: vocab as u64,
            })
        }
        // Made only by the public API's check of a text before tokenizing it; nodes see
        // tokens, so none sends it. Should one, it is the context limit it stands for.
        &Rejection::TextCannotFit {
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
        Kind::AdapterNotLoaded(name) => Rejection::AdapterNotLoaded { name },
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

/// The manifest as sent, naming the adapter that computed the K/V (`None`: the base
/// model). The adapter's fingerprint is also part of the manifest's domain, which the
/// decode node compares whole; the name and file say which version computed it.
pub fn manifest_to_pb(m: &Manifest, adapter: Option<&AdapterId>) -> pb::Manifest {
    debug_assert_eq!(
        m.domain.adapter(),
        adapter.map(|a| a.fingerprint),
        "the manifest's domain and adapter disagree"
    );
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
        adapter: adapter.map(adapter_to_pb),
    }
}

/// The manifest and the adapter it names. Its domain is computed under that adapter's
/// fingerprint, as the decode node's own request's is (`engine::Admission::admit`), so a
/// manifest naming another adapter, or none, fails the domain check too.
pub fn manifest_from_pb(m: pb::Manifest) -> Result<(Manifest, Option<AdapterId>), Status> {
    let ticket = Ticket::from_bytes(&m.ticket).ok_or_else(|| invalid("ticket must be 16 bytes"))?;
    let sampler_state: [u64; 4] = m
        .sampler_state
        .try_into()
        .map_err(|_| invalid("sampler_state must hold 4 words"))?;
    let first = m
        .first_token
        .ok_or_else(|| invalid("first_token is required"))?;
    let adapter = m.adapter.map(adapter_from_pb).transpose()?;
    let manifest = Manifest {
        ticket,
        request_id: m.request_id,
        domain: domain(m.tenant, m.salt).computed_under(adapter.as_ref().map(|a| a.fingerprint)),
        prompt_len: size(m.prompt_len),
        token_checksum: m.token_checksum,
        first_token: token_from_pb(first)?,
        sampler_state,
        page_tokens: m.page_tokens as usize,
        page_checksums: m.page_checksums,
        cached_tokens: size(m.cached_tokens),
    };
    Ok((manifest, adapter))
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
            adapter: None,
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
                stop_tokens: std::sync::Arc::from([5, 9]),
                min_tokens: 0,
            },
            ignore_eos: false,
            logprobs: Some(3),
            constraint: None,
        }
    }

    /// The status of a request refused as malformed.
    fn invalid_status(r: Result<(String, GenerateRequest), RequestError>, case: &str) -> Status {
        match r {
            Err(RequestError::Invalid(status)) => status,
            Err(RequestError::Rejected(r)) => panic!("{case}: rejected ({r}), not malformed"),
            Ok(_) => panic!("{case} was accepted"),
        }
    }

    #[test]
    fn every_sampling_parameter_crosses_the_wire() {
        let mut sent = request();
        sent.sampling.min_tokens = 2;
        let (_, got) =
            request_from_pb(request_to_pb("r1", &sent), &vocabulary(), &Adapters::new()).unwrap();
        assert_eq!(got.sampling, sent.sampling);
        assert_eq!(got.weight, 7, "the tenant's weight reaches the nodes");
        assert!(got.constraint.is_none());
        // Stop tokens out of order, or min_tokens beside a constraint, are refused.
        let mut pb = request_to_pb("r1", &sent);
        pb.sampling.as_mut().unwrap().stop_token_ids = vec![9, 5];
        invalid_status(
            request_from_pb(pb, &vocabulary(), &Adapters::new()),
            "unsorted stop_token_ids",
        );
        let mut pb = request_to_pb("r1", &sent);
        pb.sampling.as_mut().unwrap().constraint = Some(pb::Constraint {
            kind: "regex".into(),
            text: "a".into(),
        });
        invalid_status(
            request_from_pb(pb, &vocabulary(), &Adapters::new()),
            "min_tokens with a constraint",
        );
    }

    #[test]
    fn a_constraint_crosses_the_wire_as_source_and_is_compiled_on_arrival() {
        let vocab = vocabulary();
        let spec = ConstraintSpec::Choice(vec!["yes".into(), "no".into()]);
        let mut sent = request();
        sent.constraint = Some(vocab.compile(&spec).unwrap());
        let (_, got) =
            request_from_pb(request_to_pb("r1", &sent), &vocab, &Adapters::new()).unwrap();
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
            let err = invalid_status(request_from_pb(pb, &vocab, &Adapters::new()), kind);
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
        let err = invalid_status(
            request_from_pb(pb, &vocab, &Adapters::new()),
            "ignore_eos with a constraint",
        );
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
            let err = invalid_status(
                request_from_pb(pb, &vocabulary(), &Adapters::new()),
                &format!("case {i}"),
            );
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "case {i}");
        }
    }

    /// A synthetic adapter for the synthetic model; `seed` decides what it computes,
    /// `file` stands for its file's checksum.
    fn lora(seed: u64, file: u128) -> Arc<model::lora::LoraAdapter> {
        let spec = model::synth::SynthSpec::small(1, gguf::GgmlType::Q8_0, 64);
        let base = gguf::GgufFile::parse(spec.build().unwrap().to_bytes()).unwrap();
        let lora = model::lora::synth::LoraSpec {
            seed,
            ..Default::default()
        };
        let adapter = gguf::GgufFile::parse(lora.build(&base).unwrap().to_bytes()).unwrap();
        let model = spec.load().unwrap();
        Arc::new(model::lora::LoraAdapter::load(&adapter, file, &model.lora_base(), 1.0).unwrap())
    }

    fn rejected_name(r: Result<(String, GenerateRequest), RequestError>, case: &str) -> String {
        match r {
            Err(RequestError::Rejected(Rejection::AdapterNotLoaded { name })) => name,
            Err(e) => panic!("{case}: refused otherwise: {e}"),
            Ok(_) => panic!("{case}: accepted"),
        }
    }

    #[test]
    fn a_node_computes_only_under_exactly_the_adapter_the_router_named() {
        let vocab = vocabulary();
        let node = Adapters::new();
        node.insert("alpha", lora(1, 10)).unwrap();
        node.insert("beta", lora(2, 20)).unwrap();
        let named = |name: &str, weights: Arc<model::lora::LoraAdapter>| {
            let mut r = request();
            r.adapter = Some(AdapterRef::local(name, weights));
            request_to_pb("r1", &r)
        };

        // The router's reference (no weights) resolves to the node's own weights.
        let mut sent = request();
        let alpha = AdapterId::of(&node.get("alpha").unwrap());
        sent.adapter = Some(alpha.to_remote());
        let (_, got) = request_from_pb(request_to_pb("r1", &sent), &vocab, &node).unwrap();
        let got = got.adapter.expect("the adapter arrived");
        assert_eq!(AdapterId::of(&got), alpha);
        assert!(
            got.weights().is_some(),
            "resolved to the node's own weights"
        );

        // Not held, held in another version (what it computes, or only its file), or
        // another adapter's identity under this name: refused by name, never the base
        // model or another adapter in its place.
        let cases = [
            (
                "a name the node does not hold",
                named("gamma", lora(1, 10)),
                "gamma",
            ),
            ("another fingerprint", named("alpha", lora(3, 10)), "alpha"),
            (
                "the same arithmetic from another file",
                named("alpha", lora(1, 11)),
                "alpha",
            ),
            (
                "beta's identity under alpha's name",
                named("alpha", lora(2, 20)),
                "alpha",
            ),
        ];
        for (case, pb, name) in cases {
            assert_eq!(
                rejected_name(request_from_pb(pb, &vocab, &node), case),
                name
            );
        }
        // A node that holds no adapter refuses every adapter request.
        let pb = named("alpha", lora(1, 10));
        assert_eq!(
            rejected_name(request_from_pb(pb, &vocab, &Adapters::new()), "none held"),
            "alpha"
        );

        // A base request stays a base request on a node that holds adapters.
        let (_, got) = request_from_pb(request_to_pb("r1", &request()), &vocab, &node).unwrap();
        assert!(got.adapter.is_none());

        // A malformed identity is the call's error, not a rejection.
        let spoils: [fn(&mut pb::Adapter); 3] = [
            |a| {
                a.fingerprint.pop();
            },
            |a| a.file_checksum.push(0),
            |a| a.name = "no spaces".into(),
        ];
        for (i, spoil) in spoils.into_iter().enumerate() {
            let mut pb = named("alpha", lora(1, 10));
            spoil(pb.adapter.as_mut().unwrap());
            let status = invalid_status(request_from_pb(pb, &vocab, &node), &format!("spoil {i}"));
            assert!(status.message().contains("adapter"), "{}", status.message());
        }
    }

    #[test]
    fn a_manifest_names_its_adapter_and_its_domain_is_computed_under_it() {
        let output = engine::handoff::PrefillOutput {
            first: TokenEvent {
                id: 4,
                logprob: None,
                top_logprobs: Vec::new(),
                cached_prompt_tokens: 0,
            },
            sampler_state: [1, 2, 3, 4],
            prompt: vec![1, 2, 3],
            page_tokens: 16,
            pages: vec![vec![0; 8]],
            cached_tokens: 0,
        };
        let id = AdapterId {
            name: "alpha".into(),
            fingerprint: 0x1234,
            file_checksum: 0x5678,
        };
        let domain = IsolationDomain::tenant("alice").computed_under(Some(id.fingerprint));
        let m = Manifest::describe(Ticket(9), "r1".into(), domain.clone(), &output);
        let (back, adapter) = manifest_from_pb(manifest_to_pb(&m, Some(&id))).unwrap();
        assert_eq!(back, m, "the domain comes back computed under the adapter");
        assert_eq!(adapter, Some(id));
        // Without an adapter the domain is the base model's, which a decode node running
        // the request under an adapter refuses.
        let base = Manifest::describe(
            Ticket(9),
            "r1".into(),
            IsolationDomain::tenant("alice"),
            &output,
        );
        let (back, adapter) = manifest_from_pb(manifest_to_pb(&base, None)).unwrap();
        assert_eq!(adapter, None);
        assert_ne!(back.domain, domain);
    }
}
