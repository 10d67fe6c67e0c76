//! The character classes the steps test: Unicode categories from `regex-syntax`'s tables,
//! the literal sets some regexes list, and the text being split seen through them.

use std::sync::OnceLock;

/// The character sets the regex steps use. llama.cpp runs a regex with `\p{..}` over its
/// category-collapsed text, so those sets are Unicode categories; one with literal ranges
/// runs over the code points themselves, except that every non-ASCII whitespace character
/// has been replaced by `\x0B` first, so no whitespace is ever in such a set.
#[derive(Clone, Copy, Debug)]
pub(super) enum Set {
    /// `[\r\n]`.
    Newline,
    /// `\p{N}`.
    Number,
    /// `\p{L}`.
    Letter,
    /// `\p{P}`.
    Punct,
    /// `[\p{P}\$\+<=>\^~\|`]`.
    FalconPunct,
    /// DeepSeek LLM's letter ranges (Latin, Greek, Cyrillic, Armenian, Georgian, ...).
    DeepseekLetters,
    /// `[!-/:-~！-／：-～‘-‟　-。]`.
    DeepseekPunct,
    /// `[一-龥ࠀ-一가-퟿]`.
    CjkHangul,
}

/// DeepSeek LLM's letter class, exactly as llama.cpp lists it. Written with escapes: several
/// of its code points (the Kelvin and Ohm signs, Greek compatibility letters) are singletons
/// that Unicode normalization, and so many editors, would silently replace.
const DEEPSEEK_LETTERS: &str = concat!(
    "[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}",
    "\u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-",
    "\u{38A}\u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-",
    "\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-",
    "\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}",
    "-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}",
    "\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}\u{1FC2}-\u{1FC4}\u{1FC6}",
    "-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}\u{1FF2}-\u{1FF4}",
    "\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}",
    "\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\u{2145}-",
    "\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}",
    "\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}",
    "\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-",
    "\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}",
    "\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}]",
);
const DEEPSEEK_PUNCT: &str =
    "[!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}]";
const CJK_HANGUL: &str = "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Class {
    Letter,
    Number,
    /// Unicode `White_Space` (llama.cpp's `\s`), whatever its category.
    Space,
    Punct,
    Symbol,
    Mark,
    /// Anything else, including unassigned code points.
    Other,
}

pub(super) struct Tables {
    letter: Vec<(u32, u32)>,
    number: Vec<(u32, u32)>,
    space: Vec<(u32, u32)>,
    punct: Vec<(u32, u32)>,
    symbol: Vec<(u32, u32)>,
    mark: Vec<(u32, u32)>,
    deepseek_letters: Vec<(u32, u32)>,
    deepseek_punct: Vec<(u32, u32)>,
    cjk_hangul: Vec<(u32, u32)>,
}

fn unicode_ranges(pattern: &str) -> Vec<(u32, u32)> {
    use regex_syntax::hir::{Class as HirClass, HirKind};
    // The patterns are compile-time constants; failing here is a build defect, not input.
    let hir = regex_syntax::parse(pattern).expect("constant Unicode class pattern parses");
    match hir.kind() {
        HirKind::Class(HirClass::Unicode(class)) => class
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect(),
        other => panic!("{pattern} did not parse to a Unicode class: {other:?}"),
    }
}

pub(super) fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| Tables {
        letter: unicode_ranges(r"\p{L}"),
        number: unicode_ranges(r"\p{N}"),
        space: unicode_ranges(r"\s"),
        punct: unicode_ranges(r"\p{P}"),
        symbol: unicode_ranges(r"\p{S}"),
        mark: unicode_ranges(r"\p{M}"),
        deepseek_letters: unicode_ranges(DEEPSEEK_LETTERS),
        deepseek_punct: unicode_ranges(DEEPSEEK_PUNCT),
        cjk_hangul: unicode_ranges(CJK_HANGUL),
    })
}

pub(super) fn in_ranges(ranges: &[(u32, u32)], cp: u32) -> bool {
    let idx = ranges.partition_point(|&(_, end)| end < cp);
    ranges.get(idx).is_some_and(|&(start, _)| start <= cp)
}

pub(super) fn classify(c: char) -> Class {
    if c.is_ascii() {
        return match c {
            'a'..='z' | 'A'..='Z' => Class::Letter,
            '0'..='9' => Class::Number,
            // Unicode White_Space in ASCII; note \x0B is included, unlike char::is_ascii_whitespace.
            '\t' | '\n' | '\x0B' | '\x0C' | '\r' | ' ' => Class::Space,
            '$' | '+' | '<' | '=' | '>' | '^' | '`' | '|' | '~' => Class::Symbol,
            '!'..='/' | ':'..='@' | '['..='_' | '{'..='}' => Class::Punct,
            _ => Class::Other,
        };
    }
    let t = tables();
    let cp = c as u32;
    if in_ranges(&t.space, cp) {
        Class::Space
    } else if in_ranges(&t.letter, cp) {
        Class::Letter
    } else if in_ranges(&t.number, cp) {
        Class::Number
    } else if in_ranges(&t.punct, cp) {
        Class::Punct
    } else if in_ranges(&t.symbol, cp) {
        Class::Symbol
    } else if in_ranges(&t.mark, cp) {
        Class::Mark
    } else {
        Class::Other
    }
}

/// The text being split: its characters with their byte offsets and classes. Positions
/// are character indices; a step sees only its piece `lo..hi`, whose end counts as the end
/// of input (llama.cpp applies each regex to each piece separately).
pub(super) struct Text {
    pub(super) chars: Vec<(usize, char)>,
    pub(super) classes: Vec<Class>,
}

impl Text {
    pub(super) fn char(&self, i: usize, hi: usize) -> Option<char> {
        if i < hi {
            self.chars.get(i).map(|&(_, c)| c)
        } else {
            None
        }
    }

    pub(super) fn class(&self, i: usize, hi: usize) -> Option<Class> {
        if i < hi {
            self.classes.get(i).copied()
        } else {
            None
        }
    }

    pub(super) fn is_space(&self, i: usize, hi: usize) -> bool {
        self.class(i, hi) == Some(Class::Space)
    }

    pub(super) fn in_set(&self, set: Set, i: usize, hi: usize) -> bool {
        let (Some(c), Some(class)) = (self.char(i, hi), self.class(i, hi)) else {
            return false;
        };
        let ranges = |r: &[(u32, u32)]| class != Class::Space && in_ranges(r, c as u32);
        match set {
            Set::Newline => c == '\r' || c == '\n',
            Set::Number => class == Class::Number,
            Set::Letter => class == Class::Letter,
            Set::Punct => class == Class::Punct,
            Set::FalconPunct => {
                class == Class::Punct
                    || matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '~' | '|' | '`')
            }
            Set::DeepseekLetters => ranges(&tables().deepseek_letters),
            Set::DeepseekPunct => ranges(&tables().deepseek_punct),
            Set::CjkHangul => ranges(&tables().cjk_hangul),
        }
    }

    /// The end of the run of `set` starting at `i`.
    pub(super) fn run_end(&self, set: Set, mut i: usize, hi: usize) -> usize {
        while self.in_set(set, i, hi) {
            i += 1;
        }
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        assert_eq!(classify('é'), Class::Letter);
        assert_eq!(classify('日'), Class::Letter);
        assert_eq!(classify('٣'), Class::Number);
        assert_eq!(classify('Ⅻ'), Class::Number);
        assert_eq!(classify('½'), Class::Number);
        assert_eq!(classify('\u{3000}'), Class::Space);
        assert_eq!(classify('\u{85}'), Class::Space);
        assert_eq!(classify('\x1C'), Class::Other);
        assert_eq!(classify('🦀'), Class::Symbol);
        assert_eq!(classify('\u{0301}'), Class::Mark);
        assert_eq!(classify('、'), Class::Punct);
        for c in (0u8..128).map(char::from) {
            let want = if c.is_ascii_alphabetic() {
                Class::Letter
            } else if c.is_ascii_digit() {
                Class::Number
            } else if "\t\n\x0B\x0C\r ".contains(c) {
                Class::Space
            } else if in_ranges(&tables().punct, u32::from(c)) {
                Class::Punct
            } else if in_ranges(&tables().symbol, u32::from(c)) {
                Class::Symbol
            } else {
                Class::Other
            };
            assert_eq!(classify(c), want, "{c:?}");
        }
    }
}
