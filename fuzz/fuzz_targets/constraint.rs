//! Hostile schemas, regexes, choices, Lark and GBNF grammars (as the node protocol carries
//! them, the same text the API's fields give) compiled against a byte-level vocabulary.
//! Each is refused with an error or compiles; a compiled one's masks are never empty while
//! it runs, a token its mask allows is always accepted (but for the per-token budget), and
//! the answer is complete exactly when its mask allows the end.
#![no_main]

use constraint::{ConstraintError, ConstraintSpec};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input {
    kind: u8,
    text: String,
    /// Which allowed token to take at each step.
    picks: Vec<u16>,
}

const KINDS: [&str; 6] = [
    "json_object",
    "json_schema",
    "regex",
    "choice",
    "lark",
    "gbnf",
];

fuzz_target!(|input: Input| {
    let kind = KINDS[input.kind as usize % KINDS.len()];
    let Ok(spec) = ConstraintSpec::from_parts(kind, &input.text) else {
        return;
    };
    if let ConstraintSpec::Gbnf(src) = &spec {
        // The translation is deterministic, and what it produces is Lark llguidance parses
        // (or refuses) without panicking: compiled below.
        assert_eq!(constraint::gbnf_to_lark(src), constraint::gbnf_to_lark(src));
    }
    let vocab = kvwarden_fuzz::byte_vocabulary();
    let Ok(mut row) = vocab.compile(&spec) else {
        return;
    };
    let eos = 2;
    for &pick in input.picks.iter().take(64) {
        if row.is_finished() {
            break;
        }
        let mask = match row.mask() {
            Ok(m) => m,
            Err(ConstraintError::Generation(_)) => return,
            Err(e) => panic!("a mask failed with a compile-time error: {e}"),
        };
        let allowed: Vec<u32> = mask.allowed();
        assert!(!allowed.is_empty(), "an empty mask");
        let token = allowed[pick as usize % allowed.len()];
        if token == eos {
            break;
        }
        match row.advance(token) {
            Ok(()) | Err(ConstraintError::Generation(_)) => {}
            Err(e) => panic!("an allowed token was refused: {e}"),
        }
    }
});
