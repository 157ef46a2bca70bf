//! Built-in rule rewards.

use crate::{RewardFn, RewardInput};
use regex::Regex;
use serde_json::Value;

/// The settings of one rule reward, from a `[[reward.functions]]` table.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RuleSpec {
    /// `math_answer`, `exact_match`, `regex_match`, `format`, `length_penalty`.
    pub kind: String,
    pub pattern: Option<String>,
    pub tolerance: Option<f64>,
    pub target_length: Option<usize>,
    /// The row column with the ground truth.
    pub answer_key: String,
}

pub const RULE_TYPES: [&str; 5] = [
    "math_answer",
    "exact_match",
    "regex_match",
    "format",
    "length_penalty",
];

/// Builds the rule `spec` names; errors say what is missing.
pub fn build_rule(spec: &RuleSpec) -> Result<Box<dyn RewardFn>, String> {
    let pattern = || -> Result<Regex, String> {
        let p = spec
            .pattern
            .as_deref()
            .ok_or_else(|| format!("`{}` needs a `pattern`", spec.kind))?;
        Regex::new(p).map_err(|e| format!("`pattern` is not a valid regex: {e}"))
    };
    Ok(match spec.kind.as_str() {
        "math_answer" => Box::new(MathAnswer {
            answer_key: spec.answer_key.clone(),
            tolerance: spec.tolerance.unwrap_or(1e-6),
        }),
        "exact_match" => Box::new(ExactMatch {
            answer_key: spec.answer_key.clone(),
        }),
        "regex_match" => Box::new(RegexMatch {
            pattern: pattern()?,
        }),
        "format" => Box::new(Format {
            pattern: pattern()?,
        }),
        "length_penalty" => Box::new(LengthPenalty {
            target: spec
                .target_length
                .ok_or("`length_penalty` needs a `target_length`")?,
        }),
        other => {
            return Err(format!(
                "unknown reward type `{other}`; expected one of {}",
                RULE_TYPES.join(", ")
            ))
        }
    })
}

fn ground_truth(input: &RewardInput, key: &str) -> Result<String, String> {
    match input.row.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Number(n)) => Ok(n.to_string()),
        Some(other) => Ok(other.to_string()),
        None => Err(format!("the row has no `{key}` column")),
    }
}

/// The content of the last `\boxed{...}` (braces balanced), if any.
pub fn last_boxed(text: &str) -> Option<&str> {
    let start = text.rfind("\\boxed{")? + "\\boxed{".len();
    let mut depth = 1;
    for (i, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[start..start + i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// The last number in `text` (`-12`, `3.5`, `1,234`, `2/3`).
pub fn last_number(text: &str) -> Option<f64> {
    let re = Regex::new(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?").ok()?;
    re.find_iter(text)
        .last()
        .and_then(|m| parse_number(m.as_str()))
}

fn parse_number(s: &str) -> Option<f64> {
    let s = s
        .trim()
        .trim_start_matches('$')
        .trim_end_matches('.')
        .replace(',', "");
    if let Some((a, b)) = s.split_once('/') {
        let (a, b): (f64, f64) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
        return (b != 0.0).then(|| a / b);
    }
    s.parse().ok()
}

/// 1 when the last `\boxed{}` (else the last number) of the response equals the ground truth
/// numerically within `tolerance` (relative for large values), else 0.
struct MathAnswer {
    answer_key: String,
    tolerance: f64,
}

impl RewardFn for MathAnswer {
    fn score(&self, input: &RewardInput) -> Result<f64, String> {
        let truth = ground_truth(input, &self.answer_key)?;
        let want = parse_number(&truth)
            .or_else(|| last_number(&truth))
            .ok_or_else(|| format!("ground truth `{truth}` is not a number"))?;
        let got = match last_boxed(&input.response) {
            Some(b) => parse_number(b).or_else(|| last_number(b)),
            None => last_number(&input.response),
        };
        Ok(match got {
            Some(g) if (g - want).abs() <= self.tolerance * want.abs().max(1.0) => 1.0,
            _ => 0.0,
        })
    }
}

/// 1 when the trimmed response equals the ground truth.
struct ExactMatch {
    answer_key: String,
}

impl RewardFn for ExactMatch {
    fn score(&self, input: &RewardInput) -> Result<f64, String> {
        let truth = ground_truth(input, &self.answer_key)?;
        Ok(f64::from(u8::from(input.response.trim() == truth.trim())))
    }
}

/// 1 when the pattern matches somewhere in the response.
struct RegexMatch {
    pattern: Regex,
}

impl RewardFn for RegexMatch {
    fn score(&self, input: &RewardInput) -> Result<f64, String> {
        Ok(f64::from(u8::from(self.pattern.is_match(&input.response))))
    }
}

/// 1 when the whole response matches the pattern (e.g. think/answer tags).
struct Format {
    pattern: Regex,
}

impl RewardFn for Format {
    fn score(&self, input: &RewardInput) -> Result<f64, String> {
        let whole = self
            .pattern
            .find(&input.response)
            .is_some_and(|m| m.start() == 0 && m.end() == input.response.len());
        Ok(f64::from(u8::from(whole)))
    }
}

/// `−max(0, tokens − target) / target`: 0 up to the target length, then linearly negative.
struct LengthPenalty {
    target: usize,
}

impl RewardFn for LengthPenalty {
    fn score(&self, input: &RewardInput) -> Result<f64, String> {
        let over = input.response_tokens.saturating_sub(self.target) as f64;
        Ok(-over / self.target.max(1) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn input(response: &str, answer: Value) -> RewardInput {
        let mut row = serde_json::Map::new();
        row.insert("answer".into(), answer);
        RewardInput {
            prompt: "p".into(),
            response: response.into(),
            row,
            response_tokens: response.split_whitespace().count(),
        }
    }

    fn rule(kind: &str, pattern: Option<&str>) -> Box<dyn RewardFn> {
        build_rule(&RuleSpec {
            kind: kind.into(),
            pattern: pattern.map(str::to_string),
            target_length: Some(4),
            answer_key: "answer".into(),
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn math_answer_prefers_the_last_box_then_the_last_number() {
        let r = rule("math_answer", None);
        assert_eq!(
            r.score(&input("so \\boxed{1,234} done", json!("1234")))
                .unwrap(),
            1.0
        );
        assert_eq!(
            r.score(&input("\\boxed{\\frac{1}{2}} 7", json!(7)))
                .unwrap(),
            0.0
        );
        assert_eq!(r.score(&input("3 + 4 = 7", json!(7))).unwrap(), 1.0);
        assert_eq!(r.score(&input("it is 0.5", json!("1/2"))).unwrap(), 1.0);
        assert_eq!(r.score(&input("no number", json!(7))).unwrap(), 0.0);
        assert!(r.score(&input("7", json!("seven"))).is_err());
    }

    #[test]
    fn exact_regex_and_format() {
        assert_eq!(
            rule("exact_match", None)
                .score(&input(" cat \n", json!("cat")))
                .unwrap(),
            1.0
        );
        assert_eq!(
            rule("regex_match", Some(r"\d+"))
                .score(&input("a 12 b", json!(0)))
                .unwrap(),
            1.0
        );
        let f = rule(
            "format",
            Some(r"(?s)<think>.*</think>\s*<answer>.*</answer>"),
        );
        assert_eq!(
            f.score(&input("<think>x</think> <answer>1</answer>", json!(0)))
                .unwrap(),
            1.0
        );
        assert_eq!(
            f.score(&input("<answer>1</answer>", json!(0))).unwrap(),
            0.0
        );
    }

    #[test]
    fn length_penalty_is_zero_until_the_target() {
        let r = rule("length_penalty", None);
        assert_eq!(r.score(&input("a b c", json!(0))).unwrap(), 0.0);
        assert_eq!(r.score(&input("a b c d e f", json!(0))).unwrap(), -0.5);
    }

    #[test]
    fn bad_specs_are_errors() {
        let bad = |k: &str| {
            build_rule(&RuleSpec {
                kind: k.into(),
                ..Default::default()
            })
            .err()
            .unwrap()
        };
        assert!(bad("format").contains("pattern"));
        assert!(bad("nope").contains("math_answer"));
        assert!(bad("length_penalty").contains("target_length"));
    }
}
