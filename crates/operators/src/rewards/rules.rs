//! The built-in rule rewards: functions of a response's text and its row's
//! reference answer.
//!
//! Every rule judges the *completion*: the response cut at its first
//! end-of-turn marker (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, `</s>`,
//! `<|end|>`) and trimmed.
//!
//! `math` extracts the final answer — the last `\boxed{…}` (or `\fbox{…}`),
//! else the text after the last `####`, else the last number — from the
//! completion and from the reference (a bare reference is taken whole), and
//! compares them:
//! - recognised: integers, decimals, negative numbers, thousands separators
//!   (`1,000`), fractions `a/b`, `\frac{a}{b}`, `\dfrac`, `\tfrac`, `\frac12`,
//!   percentages (`50%`, `50\%`: compared as 50), a leading `$` or trailing
//!   units of two letters or more (`5 cm`, `\text{ dollars}`, `^\circ`; one
//!   letter reads as a variable), `\left`/`\right` and LaTeX
//!   spacing; two numbers are equal within 1e-9 relative;
//! - not recognised: symbolic equivalence (`\sqrt{8}` vs `2\sqrt{2}`,
//!   `x+1` vs `1+x`), intervals, sets, matrices, scientific notation and
//!   mixed numbers; such answers count only when their normalised texts are
//!   equal (spaces, `\left`/`\right`, `\dfrac`→`\frac` and spacing removed).

use regex::Regex;
use std::sync::OnceLock;

/// The end-of-turn markers a completion is cut at.
const ENDS: [&str; 5] = [
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "</s>",
    "<|end|>",
];

/// The response up to its first end-of-turn marker, trimmed.
pub fn completion(text: &str) -> &str {
    let cut = ENDS
        .iter()
        .filter_map(|e| text.find(e))
        .min()
        .unwrap_or(text.len());
    text[..cut].trim()
}

/// 1 when the completion equals the reference (both trimmed).
pub fn exact(response: &str, reference: &str) -> f64 {
    f64::from(u8::from(completion(response) == reference.trim()))
}

/// 1 when the completion contains the (non-empty, trimmed) reference.
pub fn contains(response: &str, reference: &str) -> f64 {
    let r = reference.trim();
    f64::from(u8::from(!r.is_empty() && completion(response).contains(r)))
}

/// 1 when the final answers of the completion and the reference agree (see the module docs).
pub fn math(response: &str, reference: &str) -> f64 {
    let Some(answer) = final_answer(completion(response)) else {
        return 0.0;
    };
    let truth = final_answer_marked(reference).unwrap_or_else(|| reference.trim().to_string());
    f64::from(u8::from(equivalent(&answer, &truth)))
}

/// A penalty for length: `−min(tokens, max) / max`, from 0 (empty) to −1.
pub fn length_penalty(tokens: usize, max: usize) -> f64 {
    -(tokens.min(max.max(1)) as f64) / max.max(1) as f64
}

/// 1 when `pattern` (compiled with [`full_match`]) matches the whole completion.
pub fn regex_match(pattern: &Regex, response: &str) -> f64 {
    f64::from(u8::from(pattern.is_match(completion(response))))
}

/// `pattern` anchored at both ends, `.` matching newlines too.
pub fn full_match(pattern: &str) -> Result<Regex, String> {
    Regex::new(&format!("(?s)^(?:{pattern})$")).map_err(|e| e.to_string())
}

/// The final answer of a text: the last `\boxed{…}`, else what follows the
/// last `####`, else the last number.
pub fn final_answer(text: &str) -> Option<String> {
    final_answer_marked(text).or_else(|| last_number(text))
}

/// A `\boxed{…}` or `#### …` answer, if the text marks one.
fn final_answer_marked(text: &str) -> Option<String> {
    if let Some(b) = last_boxed(text) {
        return Some(b);
    }
    let at = text.rfind("####")?;
    let rest = text[at + 4..].trim();
    Some(rest.lines().next().unwrap_or("").trim().to_string()).filter(|s| !s.is_empty())
}

/// The content of the last `\boxed{…}` / `\fbox{…}` (braces balanced), or of `\boxed x`.
fn last_boxed(text: &str) -> Option<String> {
    let at = ["\\boxed", "\\fbox"]
        .iter()
        .filter_map(|m| text.rfind(m).map(|i| (i, m.len())))
        .max()?;
    let rest = &text[at.0 + at.1..];
    if rest.starts_with('{') {
        return braced(rest).map(|(inner, _)| inner.trim().to_string());
    }
    let word: String = rest
        .trim_start()
        .chars()
        .take_while(|c| !c.is_whitespace() && *c != '$')
        .collect();
    (!word.is_empty()).then_some(word)
}

fn number_pattern() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:/\d+)?").expect("a valid pattern")
    })
}

/// The last number of a text (with its sign, separators, decimals or `/b`).
fn last_number(text: &str) -> Option<String> {
    number_pattern()
        .find_iter(text)
        .map(|m| m.as_str())
        .filter(|s| s.chars().any(|c| c.is_ascii_digit()))
        .last()
        .map(String::from)
}

/// A math answer with LaTeX spacing, delimiters, `\left`/`\right`, units,
/// percent signs, degree marks and thousands separators removed.
fn normalize(answer: &str) -> String {
    let mut s = answer.trim().trim_matches('$').trim().to_string();
    for (from, to) in [
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("\\ ", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\%", ""),
        ("%", ""),
        ("\\$", ""),
    ] {
        s = s.replace(from, to);
    }
    // `\text{…}` and `\mbox{…}` around units: keep what stands before them.
    for marker in ["\\text{", "\\mbox{", "\\mathrm{"] {
        if let Some(i) = s.find(marker) {
            if i > 0 {
                s.truncate(i);
            }
        }
    }
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    let s = s.trim_end_matches('.').to_string();
    // Thousands separators: only a well-formed `1,234,567`.
    static SEP: OnceLock<Regex> = OnceLock::new();
    let sep = SEP.get_or_init(|| Regex::new(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$").expect("valid"));
    if sep.is_match(&s) {
        return s.replace(',', "");
    }
    s
}

/// The value of a normalised answer: a number, `a/b`, `\frac{a}{b}`,
/// `\fracab`, or a number followed by units.
fn value(s: &str) -> Option<f64> {
    let s = s.strip_prefix('+').unwrap_or(s);
    if let Ok(x) = s.parse::<f64>() {
        return x.is_finite().then_some(x);
    }
    let (negative, body) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    let sign = if negative { -1.0 } else { 1.0 };
    if let Some(frac) = body.strip_prefix("\\frac") {
        let (a, rest) = frac_part(frac)?;
        let (b, rest) = frac_part(rest)?;
        if !rest.is_empty() {
            return None;
        }
        let (a, b) = (value(&a)?, value(&b)?);
        return (b != 0.0).then(|| sign * a / b);
    }
    if let Some((a, b)) = body.split_once('/') {
        let (a, b) = (a.parse::<f64>().ok()?, b.parse::<f64>().ok()?);
        return (b != 0.0).then(|| sign * a / b);
    }
    // A number followed by a unit of two letters or more (one letter reads
    // as a variable: `2x` is not 2): the number.
    let digits = body
        .find(|c: char| c.is_ascii_alphabetic())
        .filter(|&i| i > 0)?;
    let (number, unit) = body.split_at(digits);
    if unit.len() >= 2 && unit.chars().all(|c| c.is_ascii_alphabetic()) {
        return number.parse::<f64>().ok().map(|x| sign * x);
    }
    None
}

/// For `s` starting with `{`: what its balanced braces hold, and what follows them.
fn braced(s: &str) -> Option<(&str, &str)> {
    let inner = s.strip_prefix('{')?;
    let mut depth = 1;
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some((&inner[..i], &inner[i + 1..]));
                }
            }
            _ => {}
        }
    }
    None
}

/// One argument of `\frac`: `{…}` or a single character.
fn frac_part(s: &str) -> Option<(String, &str)> {
    if s.starts_with('{') {
        return braced(s).map(|(inner, rest)| (inner.to_string(), rest));
    }
    let c = s.chars().next()?;
    Some((c.to_string(), &s[c.len_utf8()..]))
}

/// Whether two final answers agree: equal values, or equal normalised texts.
pub fn equivalent(a: &str, b: &str) -> bool {
    let (na, nb) = (normalize(a), normalize(b));
    if na == nb {
        return !na.is_empty();
    }
    match (value(&na), value(&nb)) {
        (Some(x), Some(y)) => (x - y).abs() <= 1e-9 * x.abs().max(y.abs()).max(1.0),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_are_cut_at_end_of_turn() {
        assert_eq!(completion(" 42 <|im_end|> junk"), "42");
        assert_eq!(completion("a</s><|eot_id|>"), "a");
        assert_eq!(exact("12<|im_end|>", "12"), 1.0);
        assert_eq!(exact("123", "12"), 0.0);
        assert_eq!(contains("so it is 12.", "12"), 1.0);
        assert_eq!(contains("anything", " "), 0.0);
    }

    #[test]
    fn math_answers_by_hand() {
        for (response, reference) in [
            ("so the answer is \\boxed{72}.", "72"),
            ("\\boxed{\\frac{1}{2}}", "0.5"),
            ("\\boxed{\\dfrac{3}{4}}", "\\frac34"),
            ("$\\boxed{1,000}$", "1000"),
            ("We get 18 dollars.\n#### 18", "18"),
            ("He pays $1,234.50 in total", "1234.5"),
            ("The rate is 50\\%", "50"),
            ("\\boxed{50\\%}", "50%"),
            ("\\boxed{-\\frac{2}{3}}", "-2/3"),
            ("\\boxed{5 \\text{ cm}}", "5"),
            ("\\boxed{90^\\circ}", "90"),
            ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"),
            ("The answer: 7", "#### 7"),
            ("\\boxed{x^{2}+1}", "x^{2} + 1"),
            ("\\boxed 5", "5"),
            ("it costs 12 dollars", "12"),
        ] {
            assert_eq!(math(response, reference), 1.0, "{response} vs {reference}");
        }
        for (response, reference) in [
            ("\\boxed{0.333}", "\\frac{1}{3}"),
            ("\\boxed{71}", "72"),
            ("no number here", "3"),
            ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
            ("1,2,3 then 4", "3"),
            ("\\boxed{}", ""),
            ("\\boxed{2x}", "2"),
        ] {
            assert_eq!(math(response, reference), 0.0, "{response} vs {reference}");
        }
        // The last number counts when nothing is boxed or marked.
        assert_eq!(
            final_answer("3 apples and 4 pears: 7 fruits"),
            Some("7".into())
        );
        assert_eq!(final_answer("it is -2.5."), Some("-2.5".into()));
        assert_eq!(
            final_answer("\\boxed{\\frac{a}{\\sqrt{b}}} x"),
            Some("\\frac{a}{\\sqrt{b}}".into())
        );
    }

    #[test]
    fn regex_and_length_rules() {
        let format = full_match(r"<think>.*</think>\s*<answer>.*</answer>").unwrap();
        assert_eq!(
            regex_match(&format, "<think>a\nb</think> <answer>3</answer><|im_end|>"),
            1.0
        );
        assert_eq!(regex_match(&format, "<answer>3</answer>"), 0.0);
        assert_eq!(
            regex_match(&format, "x<think></think><answer></answer>"),
            0.0
        );
        assert!(full_match("(unclosed").is_err());
        assert_eq!(length_penalty(0, 8), 0.0);
        assert_eq!(length_penalty(4, 8), -0.5);
        assert_eq!(length_penalty(20, 8), -1.0);
    }
}
