//! The built-in `calculator` tool: exact arithmetic on integers and
//! decimals.
//!
//! An expression has numbers (`12`, `3.75`, `.5`), `+ - * /` (also `×`
//! and `÷`), `%` (the remainder of a division, signed like the dividend),
//! `^` or `**` (a whole exponent; right-associative, above unary minus, so
//! `-2^2` is −4), parentheses, and unary signs. Every value is an exact
//! fraction: `0.1 + 0.2` is `0.3`, `1/3*3` is `1`. The answer is an
//! integer, a terminating decimal, or for any other fraction `p/q` with a
//! ten-digit decimal after it (`1/3 ≈ 0.3333333333`).
//!
//! What it refuses, with a message the model reads as its observation: an
//! expression over [`MAX_CHARS`] characters or nested deeper than
//! [`MAX_DEPTH`], a division by zero, a fractional exponent, and any value
//! past [`MAX_BITS`] bits (so `9^9^9` is refused before it is computed,
//! never exhausting memory).

use std::fmt;

use num_bigint::{BigInt, Sign};
use num_integer::Integer;
use num_traits::{One, Signed, ToPrimitive, Zero};

/// The longest expression read.
pub const MAX_CHARS: usize = 1000;
/// The deepest nesting of parentheses, signs and powers.
pub const MAX_DEPTH: usize = 64;
/// The most bits a numerator or denominator may have (about 20,000 digits).
pub const MAX_BITS: u64 = 65_536;

/// Why an expression has no value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CalcError(pub String);

impl fmt::Display for CalcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CalcError {}

fn error<T>(message: impl Into<String>) -> Result<T, CalcError> {
    Err(CalcError(message.into()))
}

/// `expression`'s exact value, written as the module says.
pub fn evaluate(expression: &str) -> Result<String, CalcError> {
    if expression.chars().count() > MAX_CHARS {
        return error(format!(
            "the expression is longer than {MAX_CHARS} characters"
        ));
    }
    let tokens = tokenize(expression)?;
    if tokens.is_empty() {
        return error("the expression is empty");
    }
    let mut parser = Parser { tokens, at: 0 };
    let value = parser.sum(0)?;
    if let Some(token) = parser.tokens.get(parser.at) {
        return error(format!("unexpected {token} after a complete expression"));
    }
    Ok(value.to_string())
}

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Number(Fraction),
    Plus,
    Minus,
    Times,
    Divide,
    Remainder,
    Power,
    Open,
    Close,
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Token::Number(n) => write!(f, "{n}"),
            Token::Plus => f.write_str("+"),
            Token::Minus => f.write_str("-"),
            Token::Times => f.write_str("*"),
            Token::Divide => f.write_str("/"),
            Token::Remainder => f.write_str("%"),
            Token::Power => f.write_str("^"),
            Token::Open => f.write_str("("),
            Token::Close => f.write_str(")"),
        }
    }
}

fn tokenize(text: &str) -> Result<Vec<Token>, CalcError> {
    let mut tokens = Vec::new();
    let mut chars = text.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        let token = match c {
            c if c.is_whitespace() => continue,
            '+' => Token::Plus,
            '-' | '−' => Token::Minus,
            '*' if chars.peek().map(|(_, c)| *c) == Some('*') => {
                chars.next();
                Token::Power
            }
            '*' | '×' => Token::Times,
            '/' | '÷' => Token::Divide,
            '%' => Token::Remainder,
            '^' => Token::Power,
            '(' => Token::Open,
            ')' => Token::Close,
            c if c.is_ascii_digit() || c == '.' => {
                let mut end = at + c.len_utf8();
                while let Some((i, d)) = chars.peek().copied() {
                    if d.is_ascii_digit() || d == '.' {
                        end = i + d.len_utf8();
                        chars.next();
                    } else {
                        break;
                    }
                }
                Token::Number(Fraction::from_decimal(&text[at..end])?)
            }
            other => return error(format!("the character {other:?} is not arithmetic")),
        };
        tokens.push(token);
    }
    Ok(tokens)
}

/// A recursive-descent parser over the tokens, evaluating as it goes.
struct Parser {
    tokens: Vec<Token>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at)
    }

    fn deeper(depth: usize) -> Result<usize, CalcError> {
        if depth >= MAX_DEPTH {
            return error(format!("the expression nests deeper than {MAX_DEPTH}"));
        }
        Ok(depth + 1)
    }

    /// sum := product (('+' | '-') product)*
    fn sum(&mut self, depth: usize) -> Result<Fraction, CalcError> {
        let mut value = self.product(depth)?;
        while let Some(op @ (Token::Plus | Token::Minus)) = self.peek().cloned() {
            self.at += 1;
            let right = self.product(depth)?;
            value = if op == Token::Plus {
                value.add(&right)?
            } else {
                value.add(&right.negate())?
            };
        }
        Ok(value)
    }

    /// product := unary (('*' | '/' | '%') unary)*
    fn product(&mut self, depth: usize) -> Result<Fraction, CalcError> {
        let mut value = self.unary(depth)?;
        while let Some(op @ (Token::Times | Token::Divide | Token::Remainder)) =
            self.peek().cloned()
        {
            self.at += 1;
            let right = self.unary(depth)?;
            value = match op {
                Token::Times => value.multiply(&right)?,
                Token::Divide => value.divide(&right)?,
                // The `while let` above binds only `*`, `/` and `%`: this is `%`.
                _ => value.remainder(&right)?,
            };
        }
        Ok(value)
    }

    /// unary := ('+' | '-') unary | power
    fn unary(&mut self, depth: usize) -> Result<Fraction, CalcError> {
        let depth = Self::deeper(depth)?;
        match self.peek() {
            Some(Token::Minus) => {
                self.at += 1;
                Ok(self.unary(depth)?.negate())
            }
            Some(Token::Plus) => {
                self.at += 1;
                self.unary(depth)
            }
            // Any other token, or none, is the start of a power (whose atom
            // refuses what cannot begin one): the grammar's other branch.
            _ => self.power(depth),
        }
    }

    /// power := atom ('^' unary)?   (right-associative through `unary`)
    fn power(&mut self, depth: usize) -> Result<Fraction, CalcError> {
        let base = self.atom(depth)?;
        if self.peek() == Some(&Token::Power) {
            self.at += 1;
            let exponent = self.unary(depth)?;
            return base.power(&exponent);
        }
        Ok(base)
    }

    /// atom := number | '(' sum ')'
    fn atom(&mut self, depth: usize) -> Result<Fraction, CalcError> {
        match self.tokens.get(self.at).cloned() {
            Some(Token::Number(n)) => {
                self.at += 1;
                Ok(n)
            }
            Some(Token::Open) => {
                self.at += 1;
                let value = self.sum(Self::deeper(depth)?)?;
                if self.peek() != Some(&Token::Close) {
                    return error("a ( without its )");
                }
                self.at += 1;
                Ok(value)
            }
            Some(token) => error(format!("expected a number or (, found {token}")),
            None => error("the expression ends where a number was expected"),
        }
    }
}

/// An exact fraction in lowest terms, its denominator positive.
#[derive(Clone, Debug, PartialEq)]
struct Fraction {
    numerator: BigInt,
    denominator: BigInt,
}

impl Fraction {
    fn new(numerator: BigInt, denominator: BigInt) -> Result<Self, CalcError> {
        if denominator.is_zero() {
            return error("division by zero");
        }
        let divisor = numerator.gcd(&denominator);
        let sign = if denominator.is_negative() { -1 } else { 1 };
        let fraction = Fraction {
            numerator: &numerator / &divisor * sign,
            denominator: &denominator / &divisor * sign,
        };
        if fraction.numerator.bits() > MAX_BITS || fraction.denominator.bits() > MAX_BITS {
            return error(format!("a value is larger than {MAX_BITS} bits"));
        }
        Ok(fraction)
    }

    fn integer(value: BigInt) -> Self {
        Fraction {
            numerator: value,
            denominator: BigInt::one(),
        }
    }

    /// `12`, `3.75`, `.5`, `7.`: one point at most, some digit.
    fn from_decimal(text: &str) -> Result<Self, CalcError> {
        let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
        if fraction.contains('.') {
            return error(format!("{text} is not a number"));
        }
        if whole.is_empty() && fraction.is_empty() {
            return error("a . that is not part of a number");
        }
        if whole.len() + fraction.len() > MAX_CHARS {
            return error(format!("{text} has too many digits"));
        }
        let digits: BigInt = format!("0{whole}{fraction}")
            .parse()
            .map_err(|_| CalcError(format!("{text} is not a number")))?;
        let scale = BigInt::from(10u32).pow(fraction.len() as u32);
        Fraction::new(digits, scale)
    }

    fn negate(self) -> Self {
        Fraction {
            numerator: -self.numerator,
            denominator: self.denominator,
        }
    }

    fn add(&self, other: &Fraction) -> Result<Self, CalcError> {
        Fraction::new(
            &self.numerator * &other.denominator + &other.numerator * &self.denominator,
            &self.denominator * &other.denominator,
        )
    }

    fn multiply(&self, other: &Fraction) -> Result<Self, CalcError> {
        Fraction::new(
            &self.numerator * &other.numerator,
            &self.denominator * &other.denominator,
        )
    }

    fn divide(&self, other: &Fraction) -> Result<Self, CalcError> {
        Fraction::new(
            &self.numerator * &other.denominator,
            &self.denominator * &other.numerator,
        )
    }

    /// `self − other · trunc(self / other)`: the sign follows the dividend.
    fn remainder(&self, other: &Fraction) -> Result<Self, CalcError> {
        let quotient = self.divide(other)?;
        let truncated = &quotient.numerator / &quotient.denominator;
        self.add(&other.multiply(&Fraction::integer(truncated))?.negate())
    }

    fn power(&self, exponent: &Fraction) -> Result<Self, CalcError> {
        if !exponent.denominator.is_one() {
            return error(format!(
                "the exponent {exponent} is not a whole number (roots are not exact)"
            ));
        }
        let magnitude = exponent.numerator.abs();
        // The result's size, bounded before computing it.
        let widest = self.numerator.bits().max(self.denominator.bits());
        let huge = || CalcError(format!("a value is larger than {MAX_BITS} bits"));
        let times = magnitude.to_u64().ok_or_else(huge)?;
        if widest > 1 && widest.saturating_sub(1).saturating_mul(times) > MAX_BITS {
            return Err(huge());
        }
        let times = u32::try_from(times).map_err(|_| huge())?;
        let (numerator, denominator) = (self.numerator.pow(times), self.denominator.pow(times));
        if exponent.numerator.sign() == Sign::Minus {
            Fraction::new(denominator, numerator)
        } else {
            Fraction::new(numerator, denominator)
        }
    }
}

impl fmt::Display for Fraction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.denominator.is_one() {
            return write!(f, "{}", self.numerator);
        }
        // Terminating: the denominator has no prime factors but 2 and 5.
        let mut rest = self.denominator.clone();
        let (two, five) = (BigInt::from(2u32), BigInt::from(5u32));
        let mut digits = 0u32;
        let (mut twos, mut fives) = (0u32, 0u32);
        while (&rest % &two).is_zero() {
            rest /= &two;
            twos += 1;
        }
        while (&rest % &five).is_zero() {
            rest /= &five;
            fives += 1;
        }
        if rest.is_one() {
            digits = twos.max(fives);
        }
        let sign = if self.numerator.is_negative() {
            "-"
        } else {
            ""
        };
        let magnitude = self.numerator.abs();
        let decimal = |places: u32| {
            let scaled = &magnitude * BigInt::from(10u32).pow(places) / &self.denominator;
            let text = format!("{scaled:0>width$}", width = places as usize + 1);
            let (whole, fraction) = text.split_at(text.len() - places as usize);
            format!("{whole}.{fraction}")
        };
        if rest.is_one() {
            return write!(f, "{sign}{}", decimal(digits));
        }
        let approximate = decimal(10);
        write!(
            f,
            "{}/{} ≈ {sign}{approximate}",
            self.numerator, self.denominator
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(expression: &str) -> String {
        evaluate(expression).unwrap_or_else(|e| panic!("{expression}: {e}"))
    }

    fn refused(expression: &str) -> String {
        evaluate(expression)
            .err()
            .unwrap_or_else(|| panic!("{expression} has a value"))
            .0
    }

    #[test]
    fn integers_and_decimals_are_exact() {
        assert_eq!(value("12*34"), "408");
        assert_eq!(
            value("987654321987654321 * 123456789123456789"),
            "121932631356500531347203169112635269"
        );
        assert_eq!(value("0.1 + 0.2"), "0.3");
        assert_eq!(value("1/3*3"), "1");
        assert_eq!(value("7 / 2"), "3.5");
        assert_eq!(value("-7 / 8"), "-0.875");
        assert_eq!(value("1 / 3"), "1/3 ≈ 0.3333333333");
        assert_eq!(value("-2 / 3"), "-2/3 ≈ -0.6666666666");
        assert_eq!(value(".5 + 7."), "7.5");
        assert_eq!(value("3 × 4 ÷ 6"), "2");
        assert_eq!(value("0.001 * 3"), "0.003");
    }

    #[test]
    fn precedence_signs_and_powers_follow_the_usual_rules() {
        assert_eq!(value("2 + 3 * 4"), "14");
        assert_eq!(value("(2 + 3) * 4"), "20");
        assert_eq!(value("2 ^ 3 ^ 2"), "512");
        assert_eq!(value("2 ** 10"), "1024");
        assert_eq!(value("-2 ^ 2"), "-4");
        assert_eq!(value("(-2) ^ 2"), "4");
        assert_eq!(value("2 ^ -2"), "0.25");
        assert_eq!(value("10 - 4 - 3"), "3");
        assert_eq!(value("--3"), "3");
        assert_eq!(value("17 % 5"), "2");
        assert_eq!(value("-17 % 5"), "-2");
        assert_eq!(value("7.5 % 2"), "1.5");
    }

    #[test]
    fn what_has_no_value_is_refused_with_a_reason() {
        assert_eq!(refused("1 / 0"), "division by zero");
        assert_eq!(refused("5 % 0"), "division by zero");
        assert_eq!(refused("0 ^ -1"), "division by zero");
        assert_eq!(
            refused("2 ^ 0.5"),
            "the exponent 0.5 is not a whole number (roots are not exact)"
        );
        assert_eq!(refused(""), "the expression is empty");
        assert_eq!(
            refused("2 +"),
            "the expression ends where a number was expected"
        );
        assert_eq!(refused("(1 + 2"), "a ( without its )");
        assert_eq!(refused("1 2"), "unexpected 2 after a complete expression");
        assert_eq!(refused("1.2.3"), "1.2.3 is not a number");
        assert_eq!(refused("sqrt(4)"), "the character 's' is not arithmetic");
    }

    #[test]
    fn inputs_that_would_exhaust_memory_or_the_stack_are_refused() {
        assert_eq!(
            refused("9 ^ 9 ^ 9"),
            format!("a value is larger than {MAX_BITS} bits")
        );
        assert_eq!(
            refused("2 ^ 100000"),
            format!("a value is larger than {MAX_BITS} bits")
        );
        assert_eq!(value("1 ^ 100000000"), "1");
        assert_eq!(value("(-1) ^ 100000001"), "-1");
        let deep = format!("{}1{}", "(".repeat(100), ")".repeat(100));
        assert_eq!(
            refused(&deep),
            format!("the expression nests deeper than {MAX_DEPTH}")
        );
        assert_eq!(
            refused(&"-".repeat(100)),
            format!("the expression nests deeper than {MAX_DEPTH}")
        );
        assert!(refused(&"1+".repeat(600)).contains("longer than 1000 characters"));
        // Squaring a large value repeatedly stops at the bound.
        let nines = "9".repeat(900);
        let squared = format!("{}{nines}{}^2", "(".repeat(4), "^2)".repeat(4));
        assert!(refused(&squared).contains("larger than"), "{squared}");
    }
}
