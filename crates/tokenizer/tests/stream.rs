//! Streaming detokenization with IncrementalDecoder.

mod common;

use common::ids;
use proptest::prelude::*;
use tokenizer::IncrementalDecoder;

fn stream(ids: &[u32]) -> (Vec<String>, String) {
    let tok = common::tokenizer();
    let mut dec = IncrementalDecoder::new();
    let parts: Vec<String> = ids
        .iter()
        .map(|&id| dec.push(tok, id).expect("id in range"))
        .collect();
    let tail = dec.finish();
    (parts, tail)
}

#[test]
fn multibyte_text_streams_without_replacement_characters() {
    let tok = common::tokenizer();
    for text in [
        "日本語のテキスト",
        "emoji 🦀🔥👍🏽",
        "Ünïcödé façade naïve",
        "mixed 日本 and 🦀 <|im_end|>",
    ] {
        let ids = tok.encode(text);
        let (parts, tail) = stream(&ids);
        for p in &parts {
            assert!(
                !p.contains('\u{FFFD}'),
                "{text:?} streamed a replacement character: {parts:?}"
            );
        }
        assert_eq!(tail, "", "{text:?} left bytes pending");
        assert_eq!(parts.concat(), text);
        // Characters spelled over several tokens really were held back.
        assert!(
            parts.iter().any(String::is_empty) || text.is_ascii(),
            "{text:?}: {parts:?}"
        );
    }
}

#[test]
fn held_back_bytes_are_released_when_the_character_completes() {
    let tok = common::tokenizer();
    let mut dec = IncrementalDecoder::new();
    let [lead, last] = ids(tok, &["æĹ", "¥"])[..] else {
        panic!("two tokens")
    };
    assert_eq!(dec.push(tok, lead).expect("in range"), "");
    assert!(dec.has_pending());
    assert_eq!(dec.push(tok, last).expect("in range"), "日");
    assert!(!dec.has_pending());
    assert_eq!(dec.finish(), "");
}

#[test]
fn dangling_partial_character_is_rendered_lossily_at_finish() {
    let tok = common::tokenizer();
    let mut dec = IncrementalDecoder::new();
    let lead = ids(tok, &["æĹ"])[0];
    assert_eq!(dec.push(tok, 19556).expect("in range"), "Hello");
    assert_eq!(dec.push(tok, lead).expect("in range"), "");
    assert_eq!(dec.finish(), "\u{FFFD}");
    // finish() resets the decoder.
    assert_eq!(dec.finish(), "");
    assert_eq!(dec.push(tok, 19556).expect("in range"), "Hello");
}

#[test]
fn bytes_that_can_never_be_valid_are_replaced_immediately() {
    let tok = common::tokenizer();
    let mut dec = IncrementalDecoder::new();
    let [lead, cont] = ids(tok, &["æĹ", "¥"])[..] else {
        panic!("two tokens")
    };
    // A lone continuation byte cannot start a character.
    assert_eq!(dec.push(tok, cont).expect("in range"), "\u{FFFD}");
    // An unfinished character followed by a control token is broken for good.
    assert_eq!(dec.push(tok, lead).expect("in range"), "");
    assert_eq!(dec.push(tok, 2).expect("in range"), "\u{FFFD}<|im_end|>");
    assert_eq!(dec.finish(), "");
}

#[test]
fn out_of_range_id_is_an_error_and_keeps_state() {
    let tok = common::tokenizer();
    let mut dec = IncrementalDecoder::new();
    let [lead, last] = ids(tok, &["æĹ", "¥"])[..] else {
        panic!("two tokens")
    };
    assert_eq!(dec.push(tok, lead).expect("in range"), "");
    assert!(dec.push(tok, 49152).is_err());
    assert!(dec.push(tok, u32::MAX).is_err());
    assert_eq!(dec.push(tok, last).expect("in range"), "日");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Streaming any token sequence yields exactly what decoding it at once does.
    #[test]
    fn streaming_equals_batch_decoding(ids in prop::collection::vec(
        prop_oneof![0u32..49152, prop::sample::select(vec![23274u32, 115, 40993, 10813, 238, 142, 246, 2])],
        0..40,
    )) {
        let tok = common::tokenizer();
        let (parts, tail) = stream(&ids);
        prop_assert_eq!(parts.concat() + &tail, tok.decode(&ids).unwrap());
    }
}
