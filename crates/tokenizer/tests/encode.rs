//! Encoding beyond the goldens: cases derived from the llama.cpp rules, special-token
//! handling, and properties over random input.

mod common;

use common::ids;
use proptest::prelude::*;
use tokenizer::{pre_tokenize, PreTokenizer, Tokenizer, TokenizerError};

/// Held-out cases whose tokens follow from the rules alone: each pre-token piece below is
/// itself a vocabulary entry, so BPE ends at that entry.
#[test]
fn held_out_cases_derived_from_the_rules() {
    let tok = common::tokenizer();
    let cases: &[(&str, &[&str])] = &[
        // `\s+(?!\S)` leaves the last space to prefix "y"; the newline stays in the run.
        ("x  \n y", &["x", "ĠĠĊ", "Ġy"]),
        // Every digit is isolated before the GPT-2 split sees it.
        ("abc123def", &["abc", "1", "2", "3", "def"]),
        // Digit isolation leaves the spaces before digits as pieces of their own.
        (" 1 2", &["Ġ", "1", "Ġ", "2"]),
        // Contractions are lowercase-only: "'M" is punctuation followed by a word.
        ("I'M vs I'm", &["I", "'", "M", "Ġvs", "ĠI", "'m"]),
        ("we'll've're'd", &["we", "'ll", "'ve", "'re", "'d"]),
        // Trailing whitespace is one piece.
        ("\r\n\r\n", &["čĊčĊ"]),
        ("hello   ", &["hello", "ĠĠĠ"]),
        // Control tokens split the text; the spaces around them are ordinary pieces.
        ("<|im_end|><|im_start|>", &["<|im_end|>", "<|im_start|>"]),
        (
            "<|im_start|><|im_start|><|im_end|>",
            &["<|im_start|>", "<|im_start|>", "<|im_end|>"],
        ),
        ("x<|endoftext|>y", &["x", "<|endoftext|>", "y"]),
        (" <|im_end|> ", &["Ġ", "<|im_end|>", "Ġ"]),
        ("<file_sep><filename>a", &["<file_sep>", "<filename>", "a"]),
        // An unterminated marker is plain text.
        ("<|im_start", &["<", "|", "im", "_", "start"]),
        ("", &[]),
    ];
    for (text, entries) in cases {
        let want = ids(tok, entries);
        assert_eq!(tok.encode(text), want, "encode({text:?})");
        assert_eq!(
            tok.decode(&want).expect("decodes"),
            *text,
            "decode of {text:?}"
        );
    }
}

/// Cases where BPE stops short of the whole piece; ids cross-checked against an
/// independent implementation (Python `regex` + textbook BPE over this GGUF's merges),
/// which also reproduces every golden.
#[test]
fn held_out_cases_cross_checked() {
    let tok = common::tokenizer();
    let cases: &[(&str, &[u32])] = &[
        ("  \t\n", &[256, 197, 198]),
        ("Hello, we can use", &[19556, 28, 392, 416, 722]),
        ("The capital of France is", &[504, 3575, 282, 4649, 314]),
        ("Hello world! 123", &[19556, 905, 17, 216, 33, 34, 35]),
        (
            "Café déjà vu.",
            &[51, 1939, 2756, 32564, 90, 16739, 386, 101, 30],
        ),
        ("  multiple   spaces", &[216, 2701, 256, 5600]),
        ("\u{a0}\u{a0}x", &[15442, 15442, 104]),
        // Ⅻ, ½ and ٣ are \p{N}: isolated, then spelled in bytes.
        ("Ⅻ½٣", &[173, 223, 121, 16738, 164, 113]),
    ];
    for (text, want) in cases {
        assert_eq!(tok.encode(text), *want, "encode({text:?})");
        assert_eq!(tok.decode(want).expect("decodes"), *text);
    }
}

/// SmolLM2's vocabulary has no token for some byte values (0x04, 0xF1, ...). llama.cpp
/// drops such bytes; so must we, since the model never saw anything else.
#[test]
fn bytes_without_a_token_are_dropped_like_llama_cpp() {
    let tok = common::tokenizer();
    assert_eq!(tok.encode("\u{4}"), Vec::<u32>::new());
    assert_eq!(tok.encode("a\u{4}b"), ids(tok, &["a", "b"]));
    // U+50000 is F1 90 80 80 in UTF-8; only the lead byte lacks a token.
    assert_eq!(tok.encode("\u{50000}"), vec![234, 218, 218]);
}

#[test]
fn encode_ordinary_does_not_parse_control_tokens() {
    let tok = common::tokenizer();
    let ids = tok.encode_ordinary("<|im_start|>");
    assert!(!ids.contains(&1), "{ids:?}");
    assert!(ids.iter().all(|&i| !tok.is_control(i)));
    assert_eq!(ids, [44, 108, 306, 79, 3738, 108, 46]);
    assert_eq!(tok.decode(&ids).expect("decodes"), "<|im_start|>");

    let text = "<|im_start|>user\nhi<|im_end|>";
    let ordinary = tok.encode_ordinary(text);
    assert!(ordinary.iter().all(|&i| !tok.is_control(i)), "{ordinary:?}");
    assert_eq!(tok.decode(&ordinary).expect("decodes"), text);
    assert_eq!(tok.encode(text), [1, 4093, 198, 6004, 2]);
}

#[test]
fn vocabulary_facts() {
    let tok = common::tokenizer();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.eos_id(), Some(2));
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.pre_tokenizer(), Some(PreTokenizer::DigitsThenGpt2));
    assert!((0..17).all(|i| tok.is_control(i)));
    assert!(!tok.is_control(17));
    assert!(!tok.is_control(u32::MAX));
    assert_eq!(tok.token_bytes(2), Some(&b"<|im_end|>"[..]));
    assert_eq!(tok.token_bytes(216), Some(&b" "[..]));
    assert_eq!(tok.token_bytes(198), Some(&b"\n"[..]));
    assert_eq!(tok.token_bytes(49152), None);
    assert_eq!(tok.token_id("Ġworld"), Some(905));
    assert_eq!(tok.token_id(" world"), None);
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert!(tok
        .chat_template()
        .is_some_and(|t| t.contains("<|im_start|>")));
}

#[test]
fn decode_rejects_out_of_range_ids() {
    let tok = common::tokenizer();
    let err = tok
        .decode(&[19556, 49152])
        .expect_err("49152 is out of range");
    assert!(
        matches!(
            err,
            TokenizerError::TokenOutOfRange {
                id: 49152,
                vocab_size: 49152
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("49152"));
    assert!(tok.decode(&[u32::MAX]).is_err());
    assert_eq!(tok.decode(&[]).expect("empty decodes"), "");
}

#[test]
fn decode_marks_only_truly_invalid_bytes() {
    let tok = common::tokenizer();
    // "日" is E6 97 A5 = tokens "æĹ" + "¥"; half of it is an invalid (truncated) sequence.
    let ri = ids(tok, &["æĹ", "¥"]);
    assert_eq!(tok.decode(&ri).expect("decodes"), "日");
    assert_eq!(tok.decode(&ri[..1]).expect("decodes"), "\u{FFFD}");
    assert_eq!(tok.decode(&[ri[0], 104]).expect("decodes"), "\u{FFFD}x");
}

#[test]
fn long_inputs_stay_linear_and_lossless() {
    let tok = common::tokenizer();
    for text in [
        " ".repeat(100_000),
        "a".repeat(100_000),
        "9".repeat(20_000),
        "日本語".repeat(10_000),
        "ab ".repeat(30_000),
    ] {
        let ids = tok.encode(&text);
        assert!(!ids.is_empty());
        assert_eq!(tok.decode(&ids).expect("decodes"), text);
    }
}

#[test]
fn shared_between_threads() {
    let tok = common::tokenizer();
    let text = "Hello world! 3.14159 and 日本語 <|im_end|>";
    let want = tok.encode(text);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..4).map(|_| s.spawn(|| tok.encode(text))).collect();
        for h in handles {
            assert_eq!(h.join().expect("thread finished"), want);
        }
    });
}

/// llama.cpp's regex list for each pre-tokenizer, run by a regex engine: an independent
/// oracle for the hand-written splitters. Each regex splits every piece the previous one
/// produced; matches and the text between them both become pieces. The contractions are
/// written out case by case, as llama.cpp adapts them (`(?i:...)` would also fold `ſ` and
/// the Kelvin sign), and a literal-range set excludes whitespace, which llama.cpp replaces
/// by `\x0B` before running such a regex.
const ORACLES: &[(PreTokenizer, &[&str])] = &[
    (PreTokenizer::Gpt2, &[GPT2]),
    (PreTokenizer::DigitsThenGpt2, &[r"\p{N}", GPT2]),
    (
        PreTokenizer::Llama3,
        &[concat!(
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|",
            r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )],
    ),
    (
        PreTokenizer::Qwen2,
        &[concat!(
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|",
            r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )],
    ),
    (
        PreTokenizer::Qwen35,
        &[concat!(
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|",
            r"\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )],
    ),
    (
        PreTokenizer::DeepseekCoder,
        &[
            r"[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            r"(?:(?!\s)[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}])+",
            r"\p{N}",
        ],
    ),
    (
        PreTokenizer::Falcon,
        &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"],
    ),
];

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

fn regex_pieces(text: &str, mode: PreTokenizer) -> Vec<String> {
    use std::sync::OnceLock;
    static RES: OnceLock<Vec<(PreTokenizer, Vec<fancy_regex::Regex>)>> = OnceLock::new();
    let all = RES.get_or_init(|| {
        ORACLES
            .iter()
            .map(|(mode, list)| {
                let res = list
                    .iter()
                    .map(|r| fancy_regex::Regex::new(r).expect("oracle regex compiles"))
                    .collect();
                (*mode, res)
            })
            .collect()
    });
    let (_, regexes) = all
        .iter()
        .find(|(m, _)| *m == mode)
        .expect("an oracle for every pre-tokenizer tested");
    let mut pieces = vec![text.to_owned()];
    if text.is_empty() {
        pieces.clear();
    }
    for re in regexes {
        let mut next = Vec::new();
        for piece in &pieces {
            let mut last = 0;
            for m in re.find_iter(piece) {
                let m = m.expect("regex runs");
                if m.start() > last {
                    next.push(piece[last..m.start()].to_owned());
                }
                next.push(m.as_str().to_owned());
                last = m.end();
            }
            if last < piece.len() {
                next.push(piece[last..].to_owned());
            }
        }
        pieces = next;
    }
    pieces
}

fn interesting_char() -> impl Strategy<Value = char> {
    prop_oneof![
        3 => prop::sample::select(vec![
            ' ', ' ', ' ', '\n', '\t', '\r', '\x0B', '\x0C', '\u{85}', '\u{a0}', '\u{3000}', '\u{2028}',
            '\'', 's', 't', 'r', 'e', 'v', 'm', 'l', 'd', 'S', 'M', 'a', 'Z', '0', '7', '½', 'Ⅻ', '٣',
            '.', ',', '!', '<', '|', '>', '_', '$', '日', 'é', '\u{301}', '🦀', '\u{1F3FD}', '\x1C',
            '\u{4}', '\u{200B}', 'ß', 'Ω', '\u{17F}', '\u{212A}', '你', '한', '、', '（', '=', '`',
            '^', '~', '+', '(', ')', '-', '"',
        ]),
        1 => any::<char>(),
    ]
}

fn interesting_string() -> impl Strategy<Value = String> {
    prop::collection::vec(interesting_char(), 0..40).prop_map(|v| v.into_iter().collect())
}

/// Characters whose every byte has a token in this vocabulary (see the dropped-bytes test).
fn encodable(tok: &Tokenizer, s: &str) -> String {
    s.chars()
        .filter(|c| {
            let one = c.to_string();
            tok.decode(&tok.encode_ordinary(&one)).ok().as_deref() == Some(one.as_str())
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn splitters_match_regex_engine(text in interesting_string()) {
        for &(mode, _) in ORACLES {
            let ours: Vec<&str> = pre_tokenize(&text, mode);
            prop_assert_eq!(ours, regex_pieces(&text, mode), "{:?}", mode);
        }
    }

    /// The bound the server rejects over-long texts by before tokenizing them: no text
    /// has fewer tokens than its bytes over `max_bytes_per_token`.
    #[test]
    fn no_text_beats_the_bytes_per_token_bound(text in interesting_string(), runs in 0usize..600) {
        let tok = common::tokenizer();
        let per_token = tok.max_bytes_per_token().expect("this vocabulary strips nothing");
        // Long runs of one character are where BPE merges the most bytes into a token.
        let text = format!("{text}{}{}", " ".repeat(runs), "=".repeat(runs / 2));
        for tokens in [tok.encode(&text).len(), tok.encode_ordinary(&text).len()] {
            prop_assert!(tokens * per_token >= text.len(), "{} tokens, {} bytes", tokens, text.len());
        }
    }

    #[test]
    fn roundtrip(text in interesting_string()) {
        let tok = common::tokenizer();
        let text = encodable(tok, &text);
        prop_assert_eq!(tok.decode(&tok.encode(&text)).unwrap(), text.clone());
        prop_assert_eq!(tok.decode(&tok.encode_ordinary(&text)).unwrap(), text);
    }

    #[test]
    fn roundtrip_with_control_text(a in interesting_string(), b in interesting_string()) {
        let tok = common::tokenizer();
        let text = format!("{}<|im_start|>{}<|im_end|>", encodable(tok, &a), encodable(tok, &b));
        let special = tok.encode(&text);
        prop_assert_eq!(special.iter().filter(|&&i| tok.is_control(i)).count(), 2);
        prop_assert_eq!(tok.decode(&special).unwrap(), text.clone());
        let ordinary = tok.encode_ordinary(&text);
        prop_assert!(ordinary.iter().all(|&i| !tok.is_control(i)));
        prop_assert_eq!(tok.decode(&ordinary).unwrap(), text);
    }

    #[test]
    fn special_and_ordinary_agree_without_markers(text in interesting_string()) {
        let tok = common::tokenizer();
        prop_assert_eq!(tok.encode(&text), tok.encode_ordinary(&text));
    }

    #[test]
    fn arbitrary_input_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200), s in any::<String>()) {
        let tok = common::tokenizer();
        let lossy = String::from_utf8_lossy(&bytes);
        for text in [lossy.as_ref(), s.as_str()] {
            let ids = tok.encode(text);
            prop_assert!(ids.iter().all(|&i| (i as usize) < tok.vocab_size()));
            prop_assert!(tok.decode(&ids).is_ok());
            let _ = tok.encode_ordinary(text);
        }
    }

    #[test]
    fn decode_errors_exactly_on_out_of_range(ids in prop::collection::vec(0u32..60_000, 0..50)) {
        let tok = common::tokenizer();
        let any_bad = ids.iter().any(|&i| i as usize >= tok.vocab_size());
        prop_assert_eq!(tok.decode(&ids).is_err(), any_bad);
    }
}

#[test]
fn cancelled_encoding_stops_and_uncancelled_is_the_same() {
    let tok = common::tokenizer();
    let text = "word, and another; ".repeat(5000);
    assert_eq!(
        tok.encode_cancellable(&text, &|| false),
        Some(tok.encode(&text))
    );
    assert_eq!(
        tok.encode_ordinary_cancellable(&text, &|| false),
        Some(tok.encode_ordinary(&text))
    );
    // Raised after the work began: the encoder asks again within 1,024 pieces and stops.
    let asked = std::cell::Cell::new(0usize);
    let late = || {
        asked.set(asked.get() + 1);
        asked.get() > 2
    };
    assert_eq!(tok.encode_cancellable(&text, &late), None);
    assert_eq!(asked.get(), 3, "it went on after the flag was raised");
}
