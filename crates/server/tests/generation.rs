//! The engine-events-to-text bridge, fed by hand through a real vocabulary.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use engine::{EngineError, Event, FinishReason, RequestHandle, RequestId, TokenEvent, Usage};
use server::generation::{Chunk, Generation, Step};
use server::metrics::ServerMetrics;
use tokenizer::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

fn tokenizer() -> Arc<Tokenizer> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-model.sh",
        path.display()
    );
    let file = gguf::GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
    Arc::new(Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{e}")))
}

fn generation(tok: &Arc<Tokenizer>, stops: &[&str]) -> (Generation, UnboundedSender<Event>) {
    let (tx, rx) = unbounded_channel();
    let handle = RequestHandle {
        id: RequestId(1),
        events: rx,
    };
    let stops = stops.iter().map(|s| s.to_string()).collect();
    let g = Generation::new(
        handle,
        tok.clone(),
        stops,
        5,
        Instant::now(),
        Arc::new(ServerMetrics::default()),
        None,
    );
    (g, tx)
}

fn token(id: u32) -> Event {
    Event::Token(TokenEvent {
        id,
        logprob: Some(-0.5),
        top_logprobs: vec![(id, -0.5)],
        cached_prompt_tokens: 0,
    })
}

/// Drives the generation to its end: (all text, token ids with offsets, reason, usage).
async fn drain(g: &mut Generation) -> Result<(Chunk, FinishReason, Usage), server::ApiError> {
    let mut out = Chunk::default();
    while let Some(step) = g.next().await {
        match step {
            Step::Chunk(c) => {
                out.text.push_str(&c.text);
                out.tokens.extend(c.tokens);
            }
            Step::Done {
                tail,
                reason,
                usage,
            } => {
                out.text.push_str(&tail.text);
                out.tokens.extend(tail.tokens);
                assert!(g.next().await.is_none(), "nothing after the end");
                return Ok((out, reason, usage));
            }
            Step::Failed(e) => return Err(e),
        }
    }
    panic!("generation ended without Done or Failed")
}

fn ids(c: &Chunk) -> Vec<(u32, usize)> {
    c.tokens
        .iter()
        .map(|t| (t.event.id, t.text_offset))
        .collect()
}

#[tokio::test]
async fn stop_string_truncates_text_and_tokens_and_cancels() {
    let tok = tokenizer();
    let text = tok.encode(" Paris.\n\nThe United");
    let (mut g, tx) = generation(&tok, &["\n"]);
    for &id in &text {
        let _ = tx.send(token(id));
    }
    let (out, reason, usage) = drain(&mut g).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out.text, " Paris.");
    assert_eq!(reason, FinishReason::Stop);
    // " Paris", "." reach the client; the "\n" token was generated but not sent.
    let paris = tok.encode(" Paris.");
    assert_eq!(ids(&out), vec![(paris[0], 0), (paris[1], 6)]);
    assert_eq!(usage.completion_tokens, 3);
    assert_eq!(usage.prompt_tokens, 5);
    // The engine request was dropped: its event channel is closed.
    assert!(tx.is_closed());
}

#[tokio::test]
async fn engine_finish_flushes_held_text() {
    let tok = tokenizer();
    let text = tok.encode("Hello END");
    let (mut g, tx) = generation(&tok, &["ENDING"]);
    for &id in &text {
        let _ = tx.send(token(id));
    }
    let usage = Usage {
        prompt_tokens: 5,
        completion_tokens: text.len(),
        cached_tokens: 3,
    };
    let _ = tx.send(Event::Finished {
        reason: FinishReason::Length,
        usage,
    });
    let (out, reason, got) = drain(&mut g).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (out.text.as_str(), reason, got),
        ("Hello END", FinishReason::Length, usage)
    );
    assert_eq!(out.tokens.len(), text.len());
}

#[tokio::test]
async fn split_utf8_character_is_never_half_sent() {
    let tok = tokenizer();
    // "é" is C3 A9: two byte tokens, the first alone is no text.
    let c3 = tok.token_id("Ã").unwrap_or_else(|| panic!("byte token C3"));
    let a9 = tok.token_id("©").unwrap_or_else(|| panic!("byte token A9"));
    let (mut g, tx) = generation(&tok, &[]);
    let _ = tx.send(token(c3));
    let _ = tx.send(token(a9));
    let _ = tx.send(Event::Finished {
        reason: FinishReason::Stop,
        usage: Usage {
            prompt_tokens: 5,
            completion_tokens: 2,
            cached_tokens: 0,
        },
    });
    let mut texts = Vec::new();
    while let Some(step) = g.next().await {
        match step {
            Step::Chunk(c) => texts.push(c.text),
            Step::Done { tail, .. } => texts.push(tail.text),
            Step::Failed(e) => panic!("{e}"),
        }
    }
    assert!(texts.iter().all(|t| !t.contains('\u{FFFD}')), "{texts:?}");
    assert_eq!(texts.concat(), "é");
}

#[tokio::test]
async fn engine_failure_is_an_error_never_a_result() {
    let tok = tokenizer();
    let (mut g, tx) = generation(&tok, &[]);
    let _ = tx.send(token(tok.encode("Hi")[0]));
    let _ = tx.send(Event::Failed(EngineError::Isolation(
        kv::KvError::ForeignPage {
            request: RequestId(1),
        },
    )));
    let e = drain(&mut g)
        .await
        .err()
        .unwrap_or_else(|| panic!("expected a failure"));
    assert_eq!(
        (e.status().as_u16(), e.code()),
        (500, "isolation_check_failed")
    );
}

#[tokio::test]
async fn engine_vanishing_is_a_503() {
    let tok = tokenizer();
    let (mut g, tx) = generation(&tok, &[]);
    drop(tx);
    let e = drain(&mut g)
        .await
        .err()
        .unwrap_or_else(|| panic!("expected a failure"));
    assert_eq!(
        (e.status().as_u16(), e.code()),
        (503, "service_unavailable")
    );
}

#[tokio::test]
async fn dropping_the_generation_cancels_the_request() {
    let tok = tokenizer();
    let metrics = Arc::new(ServerMetrics::default());
    let (tx, rx) = unbounded_channel::<Event>();
    let g = Generation::new(
        RequestHandle {
            id: RequestId(9),
            events: rx,
        },
        tok,
        Vec::new(),
        1,
        Instant::now(),
        metrics.clone(),
        None,
    );
    assert!(!tx.is_closed());
    drop(g);
    assert!(tx.is_closed());
}

/// With `min_tokens`, stop strings match only the text of the tokens after the first
/// `min_tokens`: a stop string among them is sent as text, the next one ends the answer.
#[tokio::test]
async fn stop_strings_match_only_after_min_tokens() {
    let tok = tokenizer();
    let text = tok.encode(" a.\n b.\n c.");
    let newline = tok.encode("\n")[0];
    let second = text.iter().skip(3).position(|&t| t == newline).unwrap() + 3;
    let (g, tx) = generation(&tok, &["\n"]);
    let mut g = g.with_min_tokens(3 + 1);
    for &id in &text {
        let _ = tx.send(token(id));
    }
    let (out, reason, usage) = drain(&mut g).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(out.text, " a.\n b.");
    assert_eq!(usage.completion_tokens, second + 1);
}
