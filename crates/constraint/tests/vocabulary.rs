//! Constraints compiled against the default model's real vocabulary: every answer a
//! constrained row can produce (here, a seeded walk over the allowed tokens, which tries
//! far stranger paths than a model would) is complete and valid when the mask allows the
//! end, and hostile constraints are refused within the limits.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use constraint::{ConstraintError, ConstraintSpec, RowConstraint, Vocabulary};
use tokenizer::Tokenizer;

fn model_path() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        let status = Command::new("bash")
            .arg(root.join("scripts/fetch-model.sh"))
            .status()
            .expect("running scripts/fetch-model.sh");
        assert!(status.success(), "scripts/fetch-model.sh failed ({status})");
    }
    path
}

struct Model {
    tokenizer: Arc<Tokenizer>,
    vocab: Vocabulary,
}

fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let file = gguf::GgufFile::open(model_path()).expect("the default model opens");
        let tokenizer = Arc::new(Tokenizer::from_gguf(&file).expect("its tokenizer loads"));
        let eos = tokenizer.eos_id();
        let vocab = Vocabulary::new(tokenizer.clone(), tokenizer.vocab_size(), eos);
        Model { tokenizer, vocab }
    })
}

/// A seeded walk: at each step a pseudo-random allowed token (the end-of-sequence token
/// whenever it is allowed and the walk is past `min_len`), until the constraint ends.
fn walk(row: &mut RowConstraint, seed: u64, min_len: usize) -> (String, usize) {
    let m = model();
    let eos = m.tokenizer.eos_id().unwrap();
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut out = Vec::new();
    for _ in 0..2000 {
        if row.is_finished() {
            break;
        }
        let mask = row.mask().expect("a mask");
        assert!(
            !mask.allows(m.tokenizer.token_id("<|im_start|>").unwrap()),
            "a control token is never allowed"
        );
        if mask.allows(eos) && out.len() >= min_len {
            break;
        }
        let allowed: Vec<u32> = mask.allowed().into_iter().filter(|&t| t != eos).collect();
        if allowed.is_empty() {
            break;
        }
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let token = allowed[(state >> 33) as usize % allowed.len()];
        row.advance(token).expect("an allowed token is accepted");
        out.push(token);
    }
    let text = m.tokenizer.decode(&out).unwrap();
    (text, out.len())
}

#[test]
fn every_walk_through_a_schema_gives_a_valid_object() {
    let schema = r##"{
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
            "nickname": {"type": "string", "maxLength": 5}
        },
        "required": ["name", "age", "color", "tags"],
        "additionalProperties": false,
        "$defs": {"tag": {"type": "string", "pattern": "^[a-z]{1,6}$"}}
    }"##;
    let spec = ConstraintSpec::JsonSchema(schema.into());
    for seed in 0..12 {
        let mut row = model().vocab.compile(&spec).expect("the schema compiles");
        let (text, _) = walk(&mut row, seed, 0);
        let v: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("seed {seed}: {text:?} is not JSON: {e}"));
        let obj = v.as_object().unwrap();
        assert!(
            obj.keys()
                .all(|k| ["name", "age", "color", "tags", "nickname"].contains(&k.as_str())),
            "{text}"
        );
        assert!(
            obj["name"].as_str().unwrap().chars().count() <= 12,
            "{text}"
        );
        let age = obj["age"].as_i64().unwrap();
        assert!((0..=150).contains(&age), "{text}");
        assert!(
            ["red", "green", "blue"].contains(&obj["color"].as_str().unwrap()),
            "{text}"
        );
        let tags = obj["tags"].as_array().unwrap();
        assert!(tags.len() <= 3, "{text}");
        for t in tags {
            let t = t.as_str().unwrap();
            assert!(
                (1..=6).contains(&t.len()) && t.bytes().all(|b| b.is_ascii_lowercase()),
                "{text}"
            );
        }
        // Compact separators: no whitespace but after ',' and ':'.
        assert!(!text.contains('\n') && !text.starts_with(' '), "{text:?}");
    }
}

#[test]
fn json_object_choice_regex_and_gbnf_end_only_when_complete() {
    let m = model();
    // Any object: a random walk would wander inside one endless string, so feed a text.
    let eos = m.tokenizer.eos_id().unwrap();
    let text = r#"{"a": [1, 2.5, {"b": null}], "c": "x\"y", "d": true}"#;
    let mut row = m.vocab.compile(&ConstraintSpec::JsonObject).unwrap();
    for token in m.tokenizer.encode_ordinary(text) {
        let mask = row.mask().unwrap();
        assert!(!mask.allows(eos), "the end is refused inside the object");
        assert!(mask.allows(token), "{text}: token {token} refused");
        row.advance(token).unwrap();
    }
    assert!(row.is_finished() || row.mask().unwrap().allows(eos));
    let mut row = m.vocab.compile(&ConstraintSpec::JsonObject).unwrap();
    let not_object = m.tokenizer.encode_ordinary("[1]");
    assert!(
        !row.mask().unwrap().allows(not_object[0]),
        "an array is not an object"
    );

    let choices = vec!["positive".to_string(), "negative".into(), "neutral".into()];
    for seed in 0..6 {
        let mut row = m
            .vocab
            .compile(&ConstraintSpec::Choice(choices.clone()))
            .unwrap();
        let (text, _) = walk(&mut row, seed, 0);
        assert!(choices.contains(&text), "{text:?}");
    }

    for seed in 0..6 {
        let mut row = m
            .vocab
            .compile(&ConstraintSpec::Regex(r"[0-9]{3}-[A-Z]{2}".into()))
            .unwrap();
        let (text, _) = walk(&mut row, seed, 0);
        let b = text.as_bytes();
        assert!(
            b.len() == 6 && b[..3].iter().all(u8::is_ascii_digit) && b[3] == b'-',
            "{text:?}"
        );
        assert!(b[4..].iter().all(u8::is_ascii_uppercase), "{text:?}");
    }

    let gbnf = "root ::= (\"yes\" | \"no\") \", because \" [a-z ]{3,20} \".\"";
    for seed in 0..6 {
        let mut row = m.vocab.compile(&ConstraintSpec::Gbnf(gbnf.into())).unwrap();
        let (text, _) = walk(&mut row, seed, 0);
        let rest = text
            .strip_prefix("yes, because ")
            .or_else(|| text.strip_prefix("no, because "))
            .unwrap_or_else(|| panic!("{text:?}"));
        let body = rest.strip_suffix('.').unwrap_or_else(|| panic!("{text:?}"));
        assert!((3..=20).contains(&body.len()), "{text:?}");
        assert!(
            body.bytes().all(|b| b == b' ' || b.is_ascii_lowercase()),
            "{text:?}"
        );
    }
}

#[test]
fn hostile_constraints_are_refused_within_the_limits() {
    let m = model();
    let refused = |spec: ConstraintSpec| -> String {
        match m.vocab.compile(&spec) {
            Ok(mut row) => {
                // Some limits are hit only when the first mask is computed.
                row.mask().err().map(|e| e.to_string()).unwrap_or_default()
            }
            Err(e) => e.to_string(),
        }
    };
    // Deeper than serde_json's recursion limit.
    let deep = format!(
        "{}{}",
        "{\"items\":".repeat(200),
        "{}".to_string() + &"}".repeat(200)
    );
    assert!(refused(ConstraintSpec::JsonSchema(deep)).contains("not JSON"));
    // A megabyte schema.
    let huge_enum = format!(
        "{{\"enum\": [{}]}}",
        (0..200_000)
            .map(|i| format!("\"v{i}\""))
            .collect::<Vec<_>>()
            .join(",")
    );
    let e = m
        .vocab
        .compile(&ConstraintSpec::JsonSchema(huge_enum))
        .unwrap_err();
    assert!(matches!(e, ConstraintError::TooLarge(_)), "{e}");
    // Legal but heavy: each compiles (or is refused) and its masks are computed within the
    // per-step fuel, never without bound.
    let enum_5k = format!(
        "{{\"enum\": [{}]}}",
        (0..5000)
            .map(|i| format!("\"value {i}\""))
            .collect::<Vec<_>>()
            .join(",")
    );
    let mut nested = String::from("{\"type\":\"string\"}");
    while nested.len() < 60_000 {
        nested =
            format!("{{\"type\":\"object\",\"properties\":{{\"a\":{nested},\"b\":{nested}}}}}");
    }
    for heavy in [
        ConstraintSpec::Regex("(a|b)*a(a|b){300}".into()),
        ConstraintSpec::Regex("(a{1,1000}){1,1000}".into()),
        ConstraintSpec::JsonSchema(enum_5k),
        ConstraintSpec::JsonSchema(nested),
    ] {
        if let Ok(mut row) = m.vocab.compile(&heavy) {
            for _ in 0..20 {
                let Ok(mask) = row.mask() else { break };
                let allowed = mask.allowed();
                if row.advance(allowed[allowed.len() / 2]).is_err() {
                    break;
                }
            }
        }
    }
    // Not a grammar at all.
    for bad in [
        ConstraintSpec::Regex("(unclosed".into()),
        ConstraintSpec::Lark("start: missing_rule".into()),
        ConstraintSpec::JsonSchema(r#"{"type": "no-such-type"}"#.into()),
        ConstraintSpec::Gbnf("root ::= undefined-rule".into()),
    ] {
        assert!(!refused(bad).is_empty());
    }
}

/// Feeds `text`'s tokens to `row`; true if every one was allowed and the row may end.
fn accepts(row: &mut RowConstraint, text: &str) -> bool {
    let m = model();
    let eos = m.tokenizer.eos_id().unwrap();
    for token in m.tokenizer.encode_ordinary(text) {
        if !row.mask().unwrap().allows(token) {
            return false;
        }
        row.advance(token).unwrap();
    }
    row.is_finished() || row.mask().unwrap().allows(eos)
}

/// A reasoning model's constrained answer: any thoughts in a leading block (or, where the
/// prompt opened it, up to the first closing tag), whitespace, then the answer the
/// constraint holds; without a block, the answer alone. Nothing after the answer, and no
/// second block.
#[test]
fn thoughts_come_free_before_the_constrained_answer() {
    let m = model();
    let after = |opened, answer: ConstraintSpec| ConstraintSpec::AfterThoughts {
        opened,
        answer: Box::new(answer),
    };
    let yes_no = || ConstraintSpec::Choice(vec!["yes".into(), "no".into()]);
    let cases = [
        (
            false,
            "<think>\nIs it? {\"x\": < </thin > maybe.\n</think>\n\n{\"a\": 1}",
            true,
        ),
        (false, "{\"a\": 1}", true),
        (false, "<think></think>{\"a\": 1}", true),
        (false, "<think>\nhm\n</think>\n\n{\"a\": 1} trailing", false),
        (false, "<think>a</think><think>b</think>{\"a\": 1}", false),
        (false, "<think>never closed {\"a\": 1}", false),
        (false, "Sure: {\"a\": 1}", false),
        (true, "hm, { or [ ...\n</think>\n\n{\"a\": 1}", true),
        (true, "{\"a\": 1}", false),
    ];
    for (opened, text, ok) in cases {
        let spec = after(opened, ConstraintSpec::JsonObject);
        let mut row = m.vocab.compile(&spec).unwrap();
        assert_eq!(accepts(&mut row, text), ok, "{opened} {text:?}");
    }
    let mut row = m.vocab.compile(&after(false, yes_no())).unwrap();
    assert!(accepts(&mut row, "<think>\nmaybe yes\n</think>\nno"));
    let mut row = m.vocab.compile(&after(false, yes_no())).unwrap();
    assert!(!accepts(&mut row, "<think>\nmaybe\n</think>\nmaybe"));

    // Past the block, walks (which would think forever inside it) end in an answer.
    for seed in 0..6 {
        let regex = ConstraintSpec::Regex("[0-9]{3}-[A-Z]{2}".into());
        let opened = seed % 2 == 0;
        let mut row = m.vocab.compile(&after(opened, regex)).unwrap();
        let thoughts = if opened {
            "why\n</think>\n\n"
        } else {
            "<think>why</think>\n"
        };
        for token in m.tokenizer.encode_ordinary(thoughts) {
            row.advance(token).unwrap();
        }
        let (answer, _) = walk(&mut row, seed, 0);
        let b = answer.trim_start().as_bytes();
        assert!(
            b.len() == 6 && b[..3].iter().all(u8::is_ascii_digit) && b[3] == b'-',
            "{answer:?}"
        );
    }

    // The wire form round-trips; thoughts come once.
    let spec = after(true, yes_no());
    let (kind, text) = spec.to_parts();
    assert_eq!(ConstraintSpec::from_parts(kind, &text).unwrap(), spec);
    let nested = after(false, after(false, yes_no()));
    assert!(m.vocab.compile(&nested).is_err());
    let (kind, text) = nested.to_parts();
    assert!(ConstraintSpec::from_parts(kind, &text).is_err());
}
