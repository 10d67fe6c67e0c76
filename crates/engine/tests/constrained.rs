//! Structured outputs in the engine, on a synthetic model (byte-level vocabulary, random
//! weights, so the constraint alone makes its answers well formed): a constrained row's
//! tokens are the same alone, batched with others and split between a prefill and a
//! decode engine, every answer is complete when it ends, and a first token the
//! constraint does not allow, sent by a prefill node, fails the request on the decode node.

use std::sync::Arc;

use constraint::{ConstraintSpec, Vocabulary};
use engine::handoff::Manifest;
use engine::{
    EngineConfig, EngineHandle, Event, FinishReason, GenerateRequest, IsolationDomain,
    SamplingParams,
};
use gguf::GgmlType;
use kv::ScrubPolicy;
use model::synth::SynthSpec;
use tokenizer::Tokenizer;

const SEED: u64 = 7;

fn spec() -> SynthSpec {
    SynthSpec::small(SEED, GgmlType::Q4_1, 4096)
}

fn tokenizer() -> Arc<Tokenizer> {
    let file = gguf::GgufFile::parse(spec().build().unwrap().to_bytes()).unwrap();
    Arc::new(Tokenizer::from_gguf(&file).unwrap())
}

fn start(prefix_cache: bool) -> EngineHandle {
    engine::start(
        spec().load().unwrap(),
        EngineConfig {
            pool_tokens: 2048,
            scrub: ScrubPolicy::Poison,
            prefix_cache,
            max_batch_tokens: 48,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

fn constraints() -> Vec<ConstraintSpec> {
    vec![
        ConstraintSpec::Regex("[a-f]{3}-[0-9]{4}".into()),
        ConstraintSpec::JsonSchema(
            r#"{"type":"object","properties":{"n":{"type":"integer","minimum":0,"maximum":999},
                "c":{"enum":["red","green","blue"]}},"required":["n","c"],"additionalProperties":false}"#
                .into(),
        ),
        ConstraintSpec::Choice(vec!["alpha".into(), "beta".into(), "gamma".into()]),
        ConstraintSpec::Gbnf("root ::= \"(\" [xyz]{2,5} \")\"".into()),
    ]
}

fn request(vocab: &Vocabulary, i: usize, spec: Option<&ConstraintSpec>) -> GenerateRequest {
    let seed = i as u64;
    GenerateRequest {
        adapter: None,
        weight: 1,
        domain: IsolationDomain::tenant(if i.is_multiple_of(2) { "alice" } else { "bob" }),
        prompt: (0..(12 + 7 * i as u32))
            .map(|t| 3 + (t * 31 + i as u32 * 17) % 250)
            .collect(),
        max_tokens: 48,
        sampling: SamplingParams {
            temperature: if seed.is_multiple_of(2) { 0.0 } else { 1.1 },
            seed,
            ..SamplingParams::default()
        },
        ignore_eos: false,
        logprobs: Some(2),
        constraint: spec.map(|s| vocab.compile(s).unwrap()),
    }
}

#[derive(Debug, PartialEq)]
struct Output {
    tokens: Vec<(u32, u32)>,
    finish: FinishReason,
}

fn collect(mut handle: engine::RequestHandle) -> Result<Output, String> {
    let mut tokens = Vec::new();
    loop {
        match handle.events.blocking_recv() {
            Some(Event::Token(t)) => tokens.push((t.id, t.logprob.unwrap().to_bits())),
            Some(Event::Finished { reason, .. }) => {
                return Ok(Output {
                    tokens,
                    finish: reason,
                })
            }
            Some(Event::Failed(e)) => return Err(e.to_string()),
            Some(Event::Prefilled(_)) => return Err("prefilled on a client stream".into()),
            None => return Err("no terminal event".into()),
        }
    }
}

fn text(tok: &Tokenizer, out: &Output) -> String {
    let ids: Vec<u32> = out.tokens.iter().map(|t| t.0).collect();
    tok.decode(&ids).unwrap()
}

fn check_complete(spec: &ConstraintSpec, text: &str) {
    let ok = match spec {
        ConstraintSpec::Regex(_) => {
            let b = text.as_bytes();
            b.len() == 8
                && b[..3].iter().all(|c| (b'a'..=b'f').contains(c))
                && b[3] == b'-'
                && b[4..].iter().all(u8::is_ascii_digit)
        }
        ConstraintSpec::JsonSchema(_) => {
            let v: serde_json::Value = serde_json::from_str(text).unwrap();
            v["n"].as_u64().is_some_and(|n| n <= 999)
                && ["red", "green", "blue"].contains(&v["c"].as_str().unwrap())
        }
        ConstraintSpec::Choice(c) => c.iter().any(|c| c == text),
        ConstraintSpec::Gbnf(_) => {
            let inner = text.strip_prefix('(').and_then(|t| t.strip_suffix(')'));
            inner.is_some_and(|i| {
                (2..=5).contains(&i.len()) && i.bytes().all(|b| b"xyz".contains(&b))
            })
        }
        _ => unreachable!(),
    };
    assert!(ok, "{spec:?}: incomplete or invalid answer {text:?}");
}

#[test]
fn constrained_rows_are_the_same_alone_and_batched_and_complete_when_they_end() {
    let tok = tokenizer();
    let vocab = Vocabulary::new(tok.clone(), spec().vocab, tok.eos_id());
    let specs = constraints();
    // Eight requests: each constraint twice (greedy and sampled), and two unconstrained.
    let plan: Vec<Option<&ConstraintSpec>> = (0..10)
        .map(|i| if i < 8 { Some(&specs[i / 2]) } else { None })
        .collect();
    let engine = start(false);
    let solo: Vec<Output> = plan
        .iter()
        .enumerate()
        .map(|(i, s)| {
            collect(
                engine
                    .submit(engine.admission().admit(request(&vocab, i, *s)).unwrap())
                    .unwrap(),
            )
            .unwrap()
        })
        .collect();
    let handles: Vec<_> = plan
        .iter()
        .enumerate()
        .map(|(i, s)| {
            engine
                .submit(engine.admission().admit(request(&vocab, i, *s)).unwrap())
                .unwrap()
        })
        .collect();
    let batched: Vec<Output> = handles.into_iter().map(|h| collect(h).unwrap()).collect();
    for (i, (a, b)) in solo.iter().zip(&batched).enumerate() {
        assert_eq!(a, b, "request {i}: batched tokens differ from solo");
    }
    for (out, spec) in solo.iter().zip(&plan) {
        if let Some(spec) = spec {
            assert_eq!(out.finish, FinishReason::Stop, "{spec:?}");
            check_complete(spec, &text(&tok, out));
        }
    }
    // The unconstrained rows (ignore_eos off, random weights) are not such answers.
    assert!(solo[8].tokens.len() > 8 || solo[9].tokens.len() > 8);
}

/// Reserves `req` on the decode engine, sends it the prefill node's K/V, and decodes.
fn decode(
    dec: &EngineHandle,
    req: GenerateRequest,
    out: &engine::handoff::PrefillOutput,
    id: &str,
) -> Result<Output, String> {
    let domain = req.domain.clone();
    let admitted = dec.admission().admit(req).unwrap();
    let reservation = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(dec.reserve_import(admitted, id.to_owned()))
        .unwrap();
    let manifest = Manifest::describe(reservation.ticket(), id.to_owned(), domain, out);
    let mut t = reservation.begin(manifest).unwrap();
    for (p, page) in out.pages.iter().enumerate() {
        let tokens = (out.prompt.len() - p * out.page_tokens).min(out.page_tokens);
        t.receive_page(p, tokens, page).unwrap();
    }
    collect(dec.submit_import(t.finish().unwrap()).unwrap())
}

#[test]
fn split_constrained_output_equals_monolithic_and_a_refused_first_token_fails() {
    let tok = tokenizer();
    let vocab = Vocabulary::new(tok.clone(), spec().vocab, tok.eos_id());
    let (mono, pre, dec) = (start(false), start(true), start(false));
    let specs = constraints();
    for (i, s) in specs.iter().enumerate() {
        let expected = collect(
            mono.submit(mono.admission().admit(request(&vocab, i, Some(s))).unwrap())
                .unwrap(),
        )
        .unwrap();
        let mut handle = pre
            .submit_prefill(pre.admission().admit(request(&vocab, i, Some(s))).unwrap())
            .unwrap();
        let Some(Event::Prefilled(out)) = handle.events.blocking_recv() else {
            panic!("no prefill output");
        };
        // The decode node compiles the constraint itself (here: a fresh compile).
        let got = decode(&dec, request(&vocab, i, Some(s)), &out, &format!("r{i}")).unwrap();
        assert_eq!(got, expected, "{s:?}: split output differs");
    }

    // A prefill node that sends a first token the constraint refuses (here 'z' for the
    // [a-f] regex): the manifest is consistent, the K/V verifies, and the decode node's
    // own parser refuses the token before the client sees it.
    let s = &specs[0];
    let mut handle = pre
        .submit_prefill(pre.admission().admit(request(&vocab, 0, Some(s))).unwrap())
        .unwrap();
    let Some(Event::Prefilled(mut out)) = handle.events.blocking_recv() else {
        panic!("no prefill output");
    };
    out.first.id = tok.encode_ordinary("z")[0];
    let err = decode(&dec, request(&vocab, 0, Some(s)), &out, "bad").unwrap_err();
    assert!(err.contains("constraint"), "{err}");
}
