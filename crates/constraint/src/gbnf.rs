//! llama.cpp's GBNF, the grammar language its `grammar` field takes, translated into
//! llguidance's Lark dialect, which the same engine then compiles.
//!
//! The parse follows llama.cpp's `llama-grammar.cpp`: `name ::= alternatives`, one rule per
//! line (a newline may follow `|` and may appear inside parentheses), `#` comments,
//! literals and character classes with `\x`, `\u`, `\U` and the usual one-letter escapes,
//! `.` for any character, `*`, `+`, `?` and `{m}`, `{m,}`, `{m,n}` after an item, and
//! `root` as the start. Token references (`<...>`) are refused. Rule names become
//! `g<index>_<name>`: Lark rule names are lowercase, and GBNF's are not.

use std::collections::HashMap;
use std::fmt::Write;

use crate::ConstraintError;

/// Deepest nesting of parentheses: the parse and the compile recurse on it.
const MAX_NESTING: usize = 64;

enum Item {
    Literal(String),
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    Any,
    Rule(String),
    Group(Vec<Vec<Item>>),
    Repeat {
        item: Box<Item>,
        min: u32,
        max: Option<u32>,
    },
}

struct Parser {
    src: Vec<char>,
    pos: usize,
}

fn err(message: String) -> ConstraintError {
    ConstraintError::Invalid(format!("grammar: {message}"))
}

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.src.get(self.pos).copied()
    }

    fn at(&self, s: &str) -> bool {
        s.chars()
            .enumerate()
            .all(|(i, c)| self.src.get(self.pos + i) == Some(&c))
    }

    fn line(&self) -> usize {
        1 + self.src[..self.pos.min(self.src.len())]
            .iter()
            .filter(|&&c| c == '\n')
            .count()
    }

    fn fail<T>(&self, what: &str) -> Result<T, ConstraintError> {
        Err(err(format!("{what} at line {}", self.line())))
    }

    fn space(&mut self, newline_ok: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.pos += 1,
                '#' => {
                    while !matches!(self.peek(), None | Some('\n' | '\r')) {
                        self.pos += 1;
                    }
                }
                '\n' | '\r' if newline_ok => self.pos += 1,
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Result<String, ConstraintError> {
        let start = self.pos;
        while self.peek().is_some_and(is_word) {
            self.pos += 1;
        }
        if start == self.pos {
            return self.fail("expected a rule name");
        }
        Ok(self.src[start..self.pos].iter().collect())
    }

    fn number(&mut self) -> Option<u32> {
        let start = self.pos;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.pos += 1;
        }
        let digits: String = self.src[start..self.pos].iter().collect();
        digits.parse().ok()
    }

    fn hex(&mut self, digits: usize) -> Result<char, ConstraintError> {
        let text: String = self.src.iter().skip(self.pos).take(digits).collect();
        let value = (text.len() == digits)
            .then(|| u32::from_str_radix(&text, 16).ok())
            .flatten()
            .and_then(char::from_u32);
        match value {
            Some(c) => {
                self.pos += digits;
                Ok(c)
            }
            None => self.fail("invalid hexadecimal escape"),
        }
    }

    fn char(&mut self) -> Result<char, ConstraintError> {
        let Some(c) = self.peek() else {
            return self.fail("unexpected end of grammar");
        };
        self.pos += 1;
        if c != '\\' {
            return Ok(c);
        }
        let Some(e) = self.peek() else {
            return self.fail("unexpected end of grammar");
        };
        self.pos += 1;
        match e {
            'x' => self.hex(2),
            'u' => self.hex(4),
            'U' => self.hex(8),
            't' => Ok('\t'),
            'r' => Ok('\r'),
            'n' => Ok('\n'),
            '\\' | '"' | '[' | ']' => Ok(e),
            _ => self.fail(&format!("unknown escape \\{e}")),
        }
    }

    fn alternatives(&mut self, depth: usize) -> Result<Vec<Vec<Item>>, ConstraintError> {
        if depth > MAX_NESTING {
            return self.fail(&format!("more than {MAX_NESTING} nested groups"));
        }
        let nested = depth > 0;
        let mut alts = vec![self.sequence(depth, nested)?];
        while self.peek() == Some('|') {
            self.pos += 1;
            self.space(true);
            alts.push(self.sequence(depth, nested)?);
        }
        Ok(alts)
    }

    fn sequence(&mut self, depth: usize, nested: bool) -> Result<Vec<Item>, ConstraintError> {
        let mut items: Vec<Item> = Vec::new();
        while let Some(c) = self.peek() {
            let item = match c {
                '"' => {
                    self.pos += 1;
                    let mut s = String::new();
                    while self.peek() != Some('"') {
                        s.push(self.char()?);
                    }
                    self.pos += 1;
                    Item::Literal(s)
                }
                '[' => {
                    self.pos += 1;
                    let negated = self.peek() == Some('^');
                    if negated {
                        self.pos += 1;
                    }
                    let mut ranges = Vec::new();
                    while self.peek() != Some(']') {
                        let lo = self.char()?;
                        let hi = if self.peek() == Some('-')
                            && self.src.get(self.pos + 1) != Some(&']')
                        {
                            self.pos += 1;
                            self.char()?
                        } else {
                            lo
                        };
                        if hi < lo {
                            return self.fail("a character range that runs backwards");
                        }
                        ranges.push((lo, hi));
                    }
                    self.pos += 1;
                    if ranges.is_empty() {
                        return self.fail("an empty character class");
                    }
                    Item::Class { negated, ranges }
                }
                '(' => {
                    self.pos += 1;
                    self.space(true);
                    let alts = self.alternatives(depth + 1)?;
                    if self.peek() != Some(')') {
                        return self.fail("expected ')'");
                    }
                    self.pos += 1;
                    Item::Group(alts)
                }
                '.' => {
                    self.pos += 1;
                    Item::Any
                }
                '<' => return self.fail("token references (<...>) are not supported"),
                '*' | '+' | '?' | '{' => {
                    let Some(last) = items.pop() else {
                        return self.fail(&format!("'{c}' without an item before it"));
                    };
                    self.pos += 1;
                    let (min, max) = match c {
                        '*' => (0, None),
                        '+' => (1, None),
                        '?' => (0, Some(1)),
                        _ => self.braces()?,
                    };
                    Item::Repeat {
                        item: Box::new(last),
                        min,
                        max,
                    }
                }
                c if is_word(c) => {
                    let name = self.name()?;
                    Item::Rule(name)
                }
                _ => break,
            };
            items.push(item);
            self.space(nested);
        }
        Ok(items)
    }

    fn braces(&mut self) -> Result<(u32, Option<u32>), ConstraintError> {
        self.space(true);
        let min = self.number();
        self.space(true);
        let max = if self.peek() == Some(',') {
            self.pos += 1;
            self.space(true);
            self.number()
        } else {
            min
        };
        self.space(true);
        if self.peek() != Some('}') {
            return self.fail("expected '}'");
        }
        self.pos += 1;
        let Some(min) = min.or(max.map(|_| 0)) else {
            return self.fail("a repetition without a count");
        };
        if max.is_some_and(|m| m < min) {
            return self.fail("a repetition whose maximum is below its minimum");
        }
        Ok((min, max))
    }
}

/// Lark source for a GBNF grammar, or a 400-worthy reason it is not one.
pub fn gbnf_to_lark(src: &str) -> Result<String, ConstraintError> {
    let mut p = Parser {
        src: src.chars().collect(),
        pos: 0,
    };
    let mut rules: Vec<(String, Vec<Vec<Item>>)> = Vec::new();
    p.space(true);
    while p.peek().is_some() {
        let name = p.name()?;
        p.space(false);
        if !p.at("::=") {
            return p.fail(&format!("expected '::=' after {name:?}"));
        }
        p.pos += 3;
        p.space(true);
        let alts = p.alternatives(0)?;
        match p.peek() {
            None | Some('\n' | '\r') => {}
            Some(c) => return p.fail(&format!("unexpected {c:?}")),
        }
        p.space(true);
        if rules.iter().any(|(n, _)| *n == name) {
            return Err(err(format!("rule {name:?} is defined twice")));
        }
        rules.push((name, alts));
    }
    let names: HashMap<&str, String> = rules
        .iter()
        .enumerate()
        .map(|(i, (name, _))| {
            let lower = name.to_ascii_lowercase().replace('-', "_");
            (name.as_str(), format!("g{i}_{lower}"))
        })
        .collect();
    let Some(root) = names.get("root") else {
        return Err(err("no rule named root".into()));
    };
    let mut out = format!("start: {root}\n");
    for (name, alts) in &rules {
        write!(out, "{}: ", names[name.as_str()]).expect("writing to a String");
        emit_alternatives(&mut out, alts, &names)?;
        out.push('\n');
    }
    Ok(out)
}

fn emit_alternatives(
    out: &mut String,
    alts: &[Vec<Item>],
    names: &HashMap<&str, String>,
) -> Result<(), ConstraintError> {
    for (i, seq) in alts.iter().enumerate() {
        if i > 0 {
            out.push_str(" | ");
        }
        if seq.is_empty() {
            out.push_str("\"\"");
        }
        for (j, item) in seq.iter().enumerate() {
            if j > 0 {
                out.push(' ');
            }
            emit_item(out, item, names)?;
        }
    }
    Ok(())
}

fn emit_item(
    out: &mut String,
    item: &Item,
    names: &HashMap<&str, String>,
) -> Result<(), ConstraintError> {
    match item {
        Item::Literal(s) => out.push_str(&serde_json::Value::from(s.as_str()).to_string()),
        Item::Class { negated, ranges } => {
            out.push_str(if *negated { "/[^" } else { "/[" });
            for &(lo, hi) in ranges {
                write!(out, "\\x{{{:x}}}", lo as u32).expect("writing to a String");
                if hi != lo {
                    write!(out, "-\\x{{{:x}}}", hi as u32).expect("writing to a String");
                }
            }
            out.push_str("]/");
        }
        Item::Any => out.push_str("/(?s:.)/"),
        Item::Rule(name) => match names.get(name.as_str()) {
            Some(n) => out.push_str(n),
            None => return Err(err(format!("rule {name:?} is used but never defined"))),
        },
        Item::Group(alts) => {
            out.push('(');
            emit_alternatives(out, alts, names)?;
            out.push(')');
        }
        Item::Repeat { item, min, max } => {
            out.push('(');
            emit_item(out, item, names)?;
            out.push(')');
            match (min, max) {
                (0, None) => out.push('*'),
                (1, None) => out.push('+'),
                (0, Some(1)) => out.push('?'),
                (m, None) => write!(out, "{{{m},}}").expect("writing to a String"),
                (m, Some(n)) => write!(out, "{{{m},{n}}}").expect("writing to a String"),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translates_llama_cpp_syntax() {
        let lark = gbnf_to_lark(
            "# a comment\nroot ::= answer \" \" [0-9]{1,3} # trailing\nanswer ::= (\"yes\" |\n  \"no\")+ [^\\n\\x41]? .*\n",
        )
        .unwrap();
        assert_eq!(
            lark,
            "start: g0_root\n\
             g0_root: g1_answer \" \" (/[\\x{30}-\\x{39}]/){1,3}\n\
             g1_answer: ((\"yes\" | \"no\"))+ (/[^\\x{a}\\x{41}]/)? (/(?s:.)/)*\n"
        );
    }

    #[test]
    fn refuses_what_is_not_gbnf() {
        for (src, why) in [
            ("answer ::= \"x\"", "no rule named root"),
            ("root ::= other", "never defined"),
            ("root ::= \"x\"\nroot ::= \"y\"", "defined twice"),
            ("root = \"x\"", "expected '::='"),
            ("root ::= * \"x\"", "without an item"),
            ("root ::= [z-a]", "backwards"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::= <think>", "token references"),
            ("root ::= \"x\"{3,1}", "below its minimum"),
            ("root ::= \"unterminated", "unexpected end"),
        ] {
            let e = gbnf_to_lark(src).unwrap_err().to_string();
            assert!(e.contains(why), "{src:?}: {e}");
        }
        let deep = format!("root ::= {}\"x\"{}", "(".repeat(100), ")".repeat(100));
        assert!(gbnf_to_lark(&deep)
            .unwrap_err()
            .to_string()
            .contains("nested"));
    }
}
