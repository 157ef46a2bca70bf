//! The calculator tool: `+ − × ÷`, `**`, unary minus and parentheses over decimal numbers,
//! parsed by recursive descent (never handed to a shell or an interpreter).

/// The value of `expr`, or what is wrong with it.
pub fn evaluate(expr: &str) -> Result<f64, String> {
    let tokens: Vec<char> = expr.chars().filter(|c| !c.is_whitespace()).collect();
    let mut p = Parser { tokens, at: 0 };
    let v = p.sum()?;
    if p.at != p.tokens.len() {
        return Err(format!("unexpected `{}` at {}", p.tokens[p.at], p.at));
    }
    match v.is_finite() {
        true => Ok(v),
        false => Err("the result is not a finite number (division by zero?)".into()),
    }
}

/// A result as a person writes it: an integer without decimals, else up to 6 decimals.
pub fn format_number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        return format!("{}", v as i64);
    }
    let s = format!("{v:.6}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

struct Parser {
    tokens: Vec<char>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.tokens.get(self.at).copied()
    }

    fn eat(&mut self, c: char) -> bool {
        let hit = self.peek() == Some(c);
        self.at += usize::from(hit);
        hit
    }

    /// sum := product (('+' | '-') product)*
    fn sum(&mut self) -> Result<f64, String> {
        let mut v = self.product()?;
        loop {
            if self.eat('+') {
                v += self.product()?;
            } else if self.eat('-') {
                v -= self.product()?;
            } else {
                return Ok(v);
            }
        }
    }

    /// product := power (('*' | '/' | '×' | '÷') power)*
    fn product(&mut self) -> Result<f64, String> {
        let mut v = self.power()?;
        loop {
            if self.peek() == Some('*') && self.tokens.get(self.at + 1) == Some(&'*') {
                return Ok(v);
            }
            if self.eat('*') || self.eat('×') {
                v *= self.power()?;
            } else if self.eat('/') || self.eat('÷') {
                v /= self.power()?;
            } else {
                return Ok(v);
            }
        }
    }

    /// power := unary ('**' power)?   (right-associative)
    fn power(&mut self) -> Result<f64, String> {
        let base = self.unary()?;
        if self.peek() == Some('*') && self.tokens.get(self.at + 1) == Some(&'*') {
            self.at += 2;
            return Ok(base.powf(self.power()?));
        }
        Ok(base)
    }

    /// unary := '-' unary | '(' sum ')' | number
    fn unary(&mut self) -> Result<f64, String> {
        if self.eat('-') {
            return Ok(-self.unary()?);
        }
        if self.eat('(') {
            let v = self.sum()?;
            if !self.eat(')') {
                return Err(format!("missing `)` at {}", self.at));
            }
            return Ok(v);
        }
        let start = self.at;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_digit() || c == '.' || c == ',')
        {
            self.at += 1;
        }
        let text: String = self.tokens[start..self.at]
            .iter()
            .filter(|&&c| c != ',')
            .collect();
        match text.parse::<f64>() {
            Ok(v) => Ok(v),
            Err(_) => Err(match self.peek() {
                Some(c) if text.is_empty() => format!("unexpected `{c}` at {start}"),
                None if text.is_empty() => "the expression ends too early".into(),
                _ => format!("`{text}` is not a number"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precedence_parentheses_powers_and_signs() {
        assert_eq!(evaluate("37+45").unwrap(), 82.0);
        assert_eq!(evaluate("2 + 3 * 4").unwrap(), 14.0);
        assert_eq!(evaluate("(2 + 3) * 4").unwrap(), 20.0);
        assert_eq!(evaluate("2 ** 3 ** 2").unwrap(), 512.0);
        assert_eq!(evaluate("-3 * -(2 - 5)").unwrap(), -9.0);
        assert_eq!(evaluate("7 / 2").unwrap(), 3.5);
        assert_eq!(evaluate("1,200 × 3").unwrap(), 3600.0);
    }

    #[test]
    fn bad_expressions_say_what_is_wrong() {
        assert!(evaluate("2 +").unwrap_err().contains("ends too early"));
        assert!(evaluate("(1 + 2").unwrap_err().contains("missing `)`"));
        assert!(evaluate("1 / 0").unwrap_err().contains("not a finite"));
        assert!(evaluate("import os")
            .unwrap_err()
            .contains("unexpected `i`"));
        assert!(evaluate("1.2.3").unwrap_err().contains("not a number"));
    }

    #[test]
    fn results_read_as_written() {
        assert_eq!(format_number(82.0), "82");
        assert_eq!(format_number(3.5), "3.5");
        assert_eq!(format_number(1.0 / 3.0), "0.333333");
        assert_eq!(format_number(-4.0), "-4");
    }
}
