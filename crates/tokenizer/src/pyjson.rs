//! The `tojson` filter as Hugging Face's template renderer defines it (Python's
//! `json.dumps(x, ensure_ascii=False, indent=indent)`): `", "` and `": "` between items,
//! keys in their given order, nothing escaped but what JSON requires. minijinja's own
//! `tojson` escapes `<`, `>`, `&` and `'` for HTML, so a tool's schema would reach the
//! model as `\u003c…` where every other server renders `<`.

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Deepest nesting rendered: a value deeper than this is an error, not a deep recursion.
const MAX_DEPTH: usize = 128;

/// `value | tojson` or `value | tojson(indent=n)`.
pub(crate) fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // Accepted as Python's are, with their defaults the only behaviour.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write(&value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn newline(indent: Option<usize>, depth: usize, out: &mut String) {
    if let Some(n) = indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * depth));
    }
}

fn write(v: &Value, indent: Option<usize>, depth: usize, out: &mut String) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(f) = v.as_i64() {
                out.push_str(&f.to_string());
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                out.push_str(&python_float(f));
            }
        }
        ValueKind::String => string(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(indent, depth + 1, out);
                write(item, indent, depth + 1, out)?;
            }
            newline(indent, depth, out);
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(indent, depth + 1, out);
                match key.as_str() {
                    Some(k) => string(k, out),
                    None => string(&key.to_string(), out),
                }
                out.push_str(": ");
                write(&v.get_item(key)?, indent, depth + 1, out)?;
            }
            newline(indent, depth, out);
            out.push('}');
        }
        _ => string(&v.to_string(), out),
    }
    Ok(())
}

/// A JSON string as Python writes it with `ensure_ascii=False` (the same escapes as
/// `serde_json`: quote, backslash, and the control characters).
fn string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr` of a float as `json.dumps` writes it (`1.0`, `1e+20`, `NaN`).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // Rust's shortest round-trip digits, in Python's exponent form.
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumps(json: &str, indent: Option<usize>) -> String {
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        let mut out = String::new();
        write(
            &Value::from(minijinja::value::Serde(&v)),
            indent,
            0,
            &mut out,
        )
        .unwrap();
        out
    }

    #[test]
    fn writes_what_python_json_dumps_writes() {
        // python3 -c 'import json; print(json.dumps(..., ensure_ascii=False))'
        assert_eq!(
            dumps(
                r#"{"b": [1, 2.5, true, null], "a": "<x> & 'y' \"q\"\n", "e": {}}"#,
                None
            ),
            r#"{"b": [1, 2.5, true, null], "a": "<x> & 'y' \"q\"\n", "e": {}}"#
        );
        assert_eq!(
            dumps(r#"{"k": [1, {"z": "é"}]}"#, Some(2)),
            "{\n  \"k\": [\n    1,\n    {\n      \"z\": \"é\"\n    }\n  ]\n}"
        );
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(1e20), "1e+20");
        assert_eq!(python_float(2.5e-7), "2.5e-07");
        assert_eq!(python_float(0.1), "0.1");
    }

    #[test]
    fn a_value_nested_too_deeply_is_an_error() {
        let mut v = Value::from(1);
        for _ in 0..200 {
            v = Value::from(vec![v]);
        }
        let mut out = String::new();
        assert!(write(&v, None, 0, &mut out).is_err());
    }
}
