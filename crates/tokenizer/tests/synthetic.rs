//! Small hand-built vocabularies: the corners of llama.cpp's algorithm that the real model
//! never reaches, and malformed metadata.

use gguf::{GgufFile, GgufWriter, MetaValue};
use tokenizer::{PreTokenizer, Tokenizer, TokenizerError};

const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

/// GPT-2's stand-in character for each byte.
fn stand_in(b: u8) -> char {
    let printable = |x: u32| matches!(x, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(u32::from(b)) {
        return char::from(b);
    }
    let rank = (0..u32::from(b)).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).expect("valid code point")
}

struct Vocab {
    tokens: Vec<(String, i32)>,
    merges: Vec<String>,
}

impl Vocab {
    /// All 256 byte tokens, then `extra`.
    fn new(extra: &[(&str, i32)], merges: &[&str]) -> Self {
        let mut tokens: Vec<(String, i32)> = (0u8..=255)
            .map(|b| (stand_in(b).to_string(), NORMAL))
            .collect();
        tokens.extend(extra.iter().map(|&(t, ty)| (t.to_owned(), ty)));
        Vocab {
            tokens,
            merges: merges.iter().map(|m| (*m).to_owned()).collect(),
        }
    }

    fn meta(&self) -> Meta {
        let mut m = Meta(Vec::new());
        m.set("tokenizer.ggml.model", MetaValue::String("gpt2".into()));
        m.set("tokenizer.ggml.pre", MetaValue::String("smollm".into()));
        m.set(
            "tokenizer.ggml.tokens",
            MetaValue::Array(
                self.tokens
                    .iter()
                    .map(|(t, _)| MetaValue::String(t.clone()))
                    .collect(),
            ),
        );
        m.set(
            "tokenizer.ggml.token_type",
            MetaValue::Array(
                self.tokens
                    .iter()
                    .map(|&(_, ty)| MetaValue::I32(ty))
                    .collect(),
            ),
        );
        m.set(
            "tokenizer.ggml.merges",
            MetaValue::Array(
                self.merges
                    .iter()
                    .map(|m| MetaValue::String(m.clone()))
                    .collect(),
            ),
        );
        m
    }

    fn load_with(&self, edit: impl FnOnce(&mut Meta)) -> Result<Tokenizer, TokenizerError> {
        let mut m = self.meta();
        edit(&mut m);
        let mut w = GgufWriter::new();
        for (k, v) in m.0 {
            w.meta(&k, v);
        }
        let file = GgufFile::parse(w.to_bytes()).expect("synthetic GGUF parses");
        Tokenizer::from_gguf(&file)
    }

    fn load(&self) -> Tokenizer {
        self.load_with(|_| {}).expect("synthetic vocabulary loads")
    }
}

/// GGUF metadata under construction; GGUF forbids duplicate keys, so setting replaces.
struct Meta(Vec<(String, MetaValue)>);

impl Meta {
    fn set(&mut self, key: &str, value: MetaValue) {
        self.remove(key);
        self.0.push((key.to_owned(), value));
    }

    fn remove(&mut self, key: &str) {
        self.0.retain(|(k, _)| k != key);
    }
}

fn id(tok: &Tokenizer, text: &str) -> u32 {
    tok.token_id(text)
        .unwrap_or_else(|| panic!("{text:?} not in vocabulary"))
}

#[test]
fn special_tokens_split_longest_first_not_leftmost() {
    // llama.cpp splits on each special token in turn, longest first, so in "XYZW" the
    // three-character "YZW" wins although "XY" starts earlier.
    let v = Vocab::new(&[("XY", CONTROL), ("YZW", CONTROL)], &[]);
    let tok = v.load();
    assert_eq!(tok.encode("XYZW"), [id(&tok, "X"), id(&tok, "YZW")]);
    assert_eq!(tok.encode("XYXY"), [id(&tok, "XY"), id(&tok, "XY")]);
    assert_eq!(
        tok.encode_ordinary("XYZW"),
        [id(&tok, "X"), id(&tok, "Y"), id(&tok, "Z"), id(&tok, "W")]
    );
}

#[test]
fn user_defined_tokens_are_matched_even_in_ordinary_mode() {
    let v = Vocab::new(&[("<u>", USER_DEFINED), ("<c>", CONTROL)], &[]);
    let tok = v.load();
    let u = id(&tok, "<u>");
    assert_eq!(
        tok.encode_ordinary("a<u>b"),
        [id(&tok, "a"), u, id(&tok, "b")]
    );
    assert!(!tok.encode_ordinary("<c>").contains(&id(&tok, "<c>")));
    assert_eq!(tok.encode("<c>"), [id(&tok, "<c>")]);
    assert_eq!(tok.decode(&[u]).expect("decodes"), "<u>");
}

#[test]
fn merges_may_use_symbols_that_later_rules_produce() {
    let v = Vocab::new(&[("ab", NORMAL), ("abc", NORMAL)], &["ab c", "a b"]);
    let tok = v.load();
    assert_eq!(tok.encode("abc"), [id(&tok, "abc")]);
    assert_eq!(tok.encode("ab"), [id(&tok, "ab")]);
    assert_eq!(tok.encode("abab"), [id(&tok, "ab"), id(&tok, "ab")]);
}

#[test]
fn lower_rank_wins_and_ties_go_left() {
    // "b c" outranks "a b", so "abc" becomes a + bc, not ab + c.
    let v = Vocab::new(
        &[("ab", NORMAL), ("bc", NORMAL), ("aa", NORMAL)],
        &["b c", "a b", "a a"],
    );
    let tok = v.load();
    assert_eq!(tok.encode("abc"), [id(&tok, "a"), id(&tok, "bc")]);
    assert_eq!(tok.encode("aaa"), [id(&tok, "aa"), id(&tok, "a")]);
}

#[test]
fn symbols_missing_from_the_vocabulary_fall_back_like_llama_cpp() {
    // Neither "cd" nor "Ã©" (the stand-ins of é = C3 A9) is a token. llama.cpp then looks
    // up each byte of the stand-in text as a token: printable ASCII survives, the rest is
    // dropped.
    let v = Vocab::new(&[], &["c d", "Ã ©"]);
    let tok = v.load();
    assert_eq!(tok.encode("cd"), [id(&tok, "c"), id(&tok, "d")]);
    assert_eq!(tok.encode("é"), Vec::<u32>::new());
    assert_eq!(tok.encode("xé"), [id(&tok, "x")]);
}

#[test]
fn empty_tokens_are_renamed_and_harmless() {
    let v = Vocab::new(&[("", CONTROL), ("ok", NORMAL)], &["o k"]);
    let tok = v.load();
    assert_eq!(tok.token_text(256), Some("[EMPTY_256]"));
    assert_eq!(tok.encode("ok"), [id(&tok, "ok")]);
    assert_eq!(tok.encode(""), Vec::<u32>::new());
}

#[test]
fn gpt2_pre_tokenizer_keeps_number_runs() {
    let v = Vocab::new(&[("12", NORMAL)], &["1 2"]);
    let tok = v
        .load_with(|w| {
            w.set("tokenizer.ggml.pre", MetaValue::String("gpt-2".into()));
        })
        .expect("loads");
    assert_eq!(tok.pre_tokenizer(), Some(PreTokenizer::Gpt2));
    assert_eq!(tok.encode("12"), [id(&tok, "12")]);
    // smollm isolates digits, so the same merge never applies there.
    let smollm = v.load();
    assert_eq!(smollm.encode("12"), [id(&smollm, "1"), id(&smollm, "2")]);
}

#[test]
fn special_ids_and_template_are_read() {
    let v = Vocab::new(&[("<s>", CONTROL), ("</s>", CONTROL)], &[]);
    let tok = v
        .load_with(|w| {
            w.set("tokenizer.ggml.bos_token_id", MetaValue::U32(256));
            w.set("tokenizer.ggml.eos_token_id", MetaValue::U32(257));
            w.set(
                "tokenizer.chat_template",
                MetaValue::String("{{ bos_token }}{{ eos_token }}".into()),
            );
        })
        .expect("loads");
    assert_eq!(tok.bos_id(), Some(256));
    assert_eq!(tok.eos_id(), Some(257));
    let t = tok
        .compile_chat_template()
        .expect("compiles")
        .expect("present");
    assert_eq!(t.render(&[], false).expect("renders"), "<s></s>");

    let bare = v.load();
    assert_eq!(
        (bare.bos_id(), bare.eos_id(), bare.chat_template()),
        (None, None, None)
    );
    assert!(bare
        .compile_chat_template()
        .expect("no template is fine")
        .is_none());
}

#[test]
fn malformed_metadata_is_a_clear_error() {
    let v = Vocab::new(&[], &[]);
    let err = |edit: &dyn Fn(&mut Meta)| v.load_with(edit).expect_err("must be rejected");

    let e = err(&|w| {
        w.set("tokenizer.ggml.model", MetaValue::String("bert".into()));
    });
    assert!(
        matches!(&e, TokenizerError::UnsupportedModel(m) if m == "bert"),
        "{e}"
    );

    let e = err(&|w| {
        w.set("tokenizer.ggml.pre", MetaValue::String("bloom".into()));
    });
    assert!(
        matches!(&e, TokenizerError::UnsupportedPreTokenizer(p) if p == "bloom"),
        "{e}"
    );

    let e = err(&|w| {
        w.set(
            "tokenizer.ggml.tokens",
            MetaValue::Array(vec![MetaValue::U32(1)]),
        );
    });
    assert!(matches!(e, TokenizerError::InvalidMetadata(_)), "{e}");

    let e = err(&|w| {
        w.set("tokenizer.ggml.tokens", MetaValue::Array(vec![]));
    });
    assert!(matches!(e, TokenizerError::InvalidMetadata(_)), "{e}");

    let e = err(&|w| {
        w.set(
            "tokenizer.ggml.token_type",
            MetaValue::Array(vec![MetaValue::I32(1)]),
        );
    });
    assert!(e.to_string().contains("token types"), "{e}");

    let e = err(&|w| {
        w.set(
            "tokenizer.ggml.merges",
            MetaValue::Array(vec![MetaValue::F32(1.0)]),
        );
    });
    assert!(e.to_string().contains("merge rule 0"), "{e}");

    let e = err(&|w| {
        w.set("tokenizer.ggml.eos_token_id", MetaValue::U32(100_000));
    });
    assert!(e.to_string().contains("eos_token_id"), "{e}");

    let e = err(&|w| {
        w.set("tokenizer.ggml.model", MetaValue::U32(7));
    });
    assert!(matches!(e, TokenizerError::Gguf(_)), "{e}");

    // Required keys that are absent.
    for key in [
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
    ] {
        let e = v.load_with(|w| w.remove(key)).expect_err("missing key");
        assert!(e.to_string().contains(key), "{key}: {e}");
    }
}

#[test]
fn missing_token_types_mean_normal() {
    let v = Vocab::new(&[("<c>", CONTROL)], &[]);
    let tok = v
        .load_with(|w| w.remove("tokenizer.ggml.token_type"))
        .expect("loads");
    assert!(!tok.is_control(256));
    assert_eq!(
        tok.encode("<c>"),
        [id(&tok, "<"), id(&tok, "c"), id(&tok, ">")]
    );
}

#[test]
fn a_vocabulary_differs_from_another_where_an_id_means_something_else() {
    let base = Vocab::new(&[("ab", NORMAL), ("<|end|>", CONTROL)], &["a b"]);
    let tok = base.load();
    assert_eq!(tok.vocabulary_difference(&base.load()), None);
    let longer = Vocab::new(
        &[("ab", NORMAL), ("<|end|>", CONTROL), ("cd", NORMAL)],
        &["a b"],
    );
    let d = tok.vocabulary_difference(&longer.load()).unwrap();
    assert!(d.contains("259 tokens against 258"), "{d}");
    let renamed = Vocab::new(&[("ba", NORMAL), ("<|end|>", CONTROL)], &["a b"]);
    let d = tok.vocabulary_difference(&renamed.load()).unwrap();
    assert!(d.contains("token 256") && d.contains("\"ba\""), "{d}");
    let retyped = Vocab::new(&[("ab", NORMAL), ("<|end|>", USER_DEFINED)], &["a b"]);
    let d = tok.vocabulary_difference(&retyped.load()).unwrap();
    assert!(d.contains("token 257 is of type"), "{d}");
    let other_end = base
        .load_with(|m| m.set("tokenizer.ggml.eos_token_id", MetaValue::U32(257)))
        .unwrap();
    let d = tok.vocabulary_difference(&other_end).unwrap();
    assert!(d.contains("end-of-sequence"), "{d}");
}
