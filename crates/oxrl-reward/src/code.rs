//! The code-correctness reward: the last fenced code block of the response, run in the
//! [`crate::sandbox`] against the row's tests, scored as the fraction of tests passed (or 1 only
//! when all pass).
//!
//! Tests (the `tests_key` column, default `tests`) take one of these forms:
//! - a string: test code appended to the solution (e.g. `assert` statements); one test, passed
//!   when the program exits with status 0;
//! - a list of strings: one such test each, each run separately;
//! - a list of `{"input": "...", "output": "..."}` objects, or `{"inputs": [...], "outputs":
//!   [...]}` (the APPS / TACO layout): the solution runs once per pair with `input` on stdin and
//!   passes when its stdout equals `output` (trailing whitespace of each line and trailing blank
//!   lines ignored);
//! - any of these encoded as a JSON string (a string starting with `[` or `{` that parses).
//!
//! The runner is generic over a command: `{file}` in it is the path of the program file, so
//! another language is `language`, `command` and `file_name` in the config.
//!
//! Python assert tests run under a harness (`code_harness.py`, the run's program file) so that a
//! test passes only if it really ran and passed: the solution, the tests and a random per-run
//! token arrive on stdin and are read before the solution runs (no file the solution can read
//! holds the tests), the harness writes the token as stdout's last line only after the solution
//! and every test ran without an exception (an early `os._exit(0)`, `sys.exit`, an `atexit`
//! hook or a replaced `AssertionError` never writes it), and every comparison in the tests is
//! strict (both sides made plain built-in values first, so a fake `__eq__` compares as what the
//! object holds). The solution and tests run in a thread of their own, so their frames do not
//! lead to the harness's, and an audit hook refuses `gc.get_objects`, `ctypes` and `/proc/*/mem`.
//! One interpreter cannot wall its code off from the solution's, though: a trace function that
//! jumps over the harness's checks, or a patched module the tests import, still cheats (README).
//! Stdin/stdout tests need no harness: the expected output never enters the sandbox.

use crate::{RewardFn, RewardInput, Schedule};
use oxrl_sandbox::{Limits, Sandbox, SandboxError};
use serde_json::Value;

/// How the tests' results become a score.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    /// Passed tests / tests.
    Fraction,
    /// 1 when every test passes, else 0 (stops at the first failure).
    All,
}

impl Scoring {
    pub const NAMES: [&'static str; 2] = ["fraction", "all"];

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "fraction" => Some(Scoring::Fraction),
            "all" => Some(Scoring::All),
            _ => None,
        }
    }
}

/// The settings of one code reward (a `[[reward.functions]]` table with `type = "code"`).
#[derive(Debug, Clone, PartialEq)]
pub struct CodeSpec {
    /// The fence tag of the code block (`python`; `py` and `python3` count for python).
    pub language: String,
    /// The program and its arguments; `{file}` is the solution file's path.
    pub command: Vec<String>,
    pub file_name: String,
    pub tests_key: String,
    pub scoring: Scoring,
    pub limits: Limits,
    /// Sandboxed runs at once (responses scored in parallel).
    pub workers: usize,
}

impl CodeSpec {
    /// The defaults for `language`: python runs as `python3 -I -B {file}` (isolated mode: no
    /// user site, no environment variables read, no bytecode written); other languages need a
    /// `command`.
    pub fn for_language(language: &str) -> Self {
        let python = language == "python";
        Self {
            language: language.to_string(),
            command: match python {
                true => ["python3", "-I", "-B", "{file}"].map(String::from).to_vec(),
                false => Vec::new(),
            },
            file_name: match python {
                true => "main.py".into(),
                false => "main".into(),
            },
            tests_key: "tests".into(),
            scoring: Scoring::Fraction,
            limits: Limits::default(),
            workers: std::thread::available_parallelism().map_or(2, |n| n.get()),
        }
    }
}

/// Why a code reward could not score a response: the row's or the sandbox's fault, never the
/// response's (a response that fails its tests scores 0 with a reason instead).
#[derive(Debug, thiserror::Error)]
pub enum CodeError {
    #[error("the row has no `{0}` column")]
    NoTestsColumn(String),
    /// The row's tests are in none of the layouts of the module docs.
    #[error("{0}")]
    MalformedTests(String),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
}

/// One test of a row.
#[derive(Debug, Clone, PartialEq)]
pub enum TestCase {
    /// Code appended to the solution; passes when the program exits with 0.
    Program(String),
    /// Stdin and the expected stdout.
    Io { input: String, output: String },
}

/// The outcome of one test.
#[derive(Debug, Clone, PartialEq)]
pub struct TestResult {
    pub passed: bool,
    /// Why it failed: the limit hit, the exit status and error, or the wrong output.
    pub reason: Option<String>,
}

/// A response's score with each test's result (empty when no code block was found).
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub score: f64,
    pub tests: Vec<TestResult>,
    /// Set when the response had no code block to run.
    pub reason: Option<String>,
}

/// The content of the last fenced block tagged `language` (or an alias), else of the last
/// untagged block. Fences are three or more backticks or tildes; a block still open at the end
/// (a truncated response) does not count.
pub fn extract_code(response: &str, language: &str) -> Option<String> {
    let language = language.to_ascii_lowercase();
    let wanted =
        |tag: &str| tag == language || (language == "python" && (tag == "py" || tag == "python3"));
    let mut tagged = None;
    let mut untagged = None;
    let mut open: Option<(String, String, Vec<&str>)> = None;
    for line in response.lines() {
        let trimmed = line.trim_start();
        match &mut open {
            None => {
                let fence: String = trimmed
                    .chars()
                    .take_while(|&c| c == '`' || c == '~')
                    .collect();
                let uniform = fence.chars().all(|c| fence.starts_with(c));
                if fence.len() >= 3 && uniform {
                    let info = trimmed[fence.len()..].trim().to_ascii_lowercase();
                    open = Some((fence, info, Vec::new()));
                }
            }
            Some((fence, info, body)) => {
                let t = trimmed.trim_end();
                let closes = t.len() >= fence.len() && t.chars().all(|c| fence.starts_with(c));
                if closes {
                    let code = body.join("\n");
                    let tag = info.split_whitespace().next().unwrap_or("");
                    if tag.is_empty() {
                        untagged = Some(code);
                    } else if wanted(tag) {
                        tagged = Some(code);
                    }
                    open = None;
                } else {
                    body.push(line);
                }
            }
        }
    }
    tagged.or(untagged)
}

/// The tests of a row's `tests` cell, in one of the forms listed in the module docs.
pub fn parse_tests(cell: &Value) -> Result<Vec<TestCase>, String> {
    let text = |v: &Value, what: &str| -> Result<String, String> {
        match v {
            Value::String(s) => Ok(s.clone()),
            Value::Number(_) | Value::Bool(_) => Ok(v.to_string()),
            _ => Err(format!("{what} must be a string, got {v}")),
        }
    };
    let tests = match cell {
        Value::String(s) => {
            let t = s.trim_start();
            if t.starts_with('[') || t.starts_with('{') {
                if let Ok(v) = serde_json::from_str::<Value>(t) {
                    return parse_tests(&v);
                }
            }
            vec![TestCase::Program(s.clone())]
        }
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::String(s) => Ok(TestCase::Program(s.clone())),
                Value::Object(o) => Ok(TestCase::Io {
                    input: text(o.get("input").unwrap_or(&Value::Null), "`input`")?,
                    output: text(o.get("output").unwrap_or(&Value::Null), "`output`")?,
                }),
                other => Err(format!(
                    "a test must be a string or an {{input, output}} object, got {other}"
                )),
            })
            .collect::<Result<_, _>>()?,
        Value::Object(o) => match (o.get("inputs"), o.get("outputs")) {
            (Some(Value::Array(i)), Some(Value::Array(out))) if i.len() == out.len() => i
                .iter()
                .zip(out)
                .map(|(i, o)| {
                    Ok(TestCase::Io {
                        input: text(i, "an input")?,
                        output: text(o, "an output")?,
                    })
                })
                .collect::<Result<_, String>>()?,
            _ => {
                return Err(
                    "a tests object needs `inputs` and `outputs` lists of the same length".into(),
                )
            }
        },
        other => {
            return Err(format!(
                "tests must be a string, a list or an object, got {other}"
            ))
        }
    };
    match tests.is_empty() {
        true => Err("the row has no tests".into()),
        false => Ok(tests),
    }
}

/// Output compared line by line without trailing whitespace, trailing blank lines dropped.
fn normalise(out: &str) -> Vec<&str> {
    let mut lines: Vec<&str> = out.lines().map(str::trim_end).collect();
    while lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    lines
}

fn shorten(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{:?}…", &s[..i]),
        None => format!("{s:?}"),
    }
}

/// The harness of Python assert tests (module docs).
const PYTHON_HARNESS: &str = include_str!("code_harness.py");

/// A fresh random token, 32 hex digits, from the kernel's generator.
fn run_token() -> Result<String, SandboxError> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|source| SandboxError::Io {
            what: "cannot read",
            path: "/dev/urandom".into(),
            source,
        })?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The code reward: see the module docs.
pub struct CodeReward {
    spec: CodeSpec,
    sandbox: Sandbox,
}

impl CodeReward {
    /// Checks that the command's program exists (on the sandbox's `PATH`) and finds the
    /// isolation the kernel allows, so a broken setup stops the run before any model loads.
    pub fn new(spec: CodeSpec) -> Result<Self, SandboxError> {
        let program = spec.command.first().ok_or(SandboxError::EmptyCommand)?;
        oxrl_sandbox::resolve_program(program)?;
        let sandbox = Sandbox::new(spec.limits.clone())?;
        Ok(Self { spec, sandbox })
    }

    pub fn sandbox(&self) -> &Sandbox {
        &self.sandbox
    }

    /// Runs one test in a fresh sandbox.
    fn run_test(&self, code: &str, test: &TestCase) -> Result<TestResult, SandboxError> {
        let file = format!("{{dir}}/{}", self.spec.file_name);
        let command: Vec<String> = self
            .spec
            .command
            .iter()
            .map(|a| a.replace("{file}", &file))
            .collect();
        let harnessed = self.spec.language == "python";
        let mut token = None;
        let (program, stdin) = match test {
            TestCase::Program(t) if harnessed => {
                let tok = run_token()?;
                let payload = serde_json::json!({"token": tok, "solution": code, "tests": t});
                let payload = payload.to_string();
                token = Some(tok);
                (
                    PYTHON_HARNESS.to_string(),
                    format!("{}\n{payload}", payload.len()),
                )
            }
            TestCase::Program(t) => (format!("{code}\n\n{t}\n"), String::new()),
            TestCase::Io { input, .. } => (format!("{code}\n"), input.clone()),
        };
        let files = [(self.spec.file_name.as_str(), program.as_bytes())];
        let outcome = self.sandbox.run(&command, &files, stdin.as_bytes())?;
        if let Some(reason) = outcome.failure_reason(self.sandbox.limits()) {
            return Ok(TestResult {
                passed: false,
                reason: Some(reason),
            });
        }
        Ok(match test {
            TestCase::Program(_) => match token {
                Some(t) if !outcome.stdout.ends_with(format!("\n{t}\n").as_bytes()) => TestResult {
                    passed: false,
                    reason: Some(
                        "exited with 0 before the tests finished (no harness token)".into(),
                    ),
                },
                _ => TestResult {
                    passed: true,
                    reason: None,
                },
            },
            TestCase::Io { output, .. } => {
                let got = String::from_utf8_lossy(&outcome.stdout);
                match normalise(&got) == normalise(output) {
                    true => TestResult {
                        passed: true,
                        reason: None,
                    },
                    false => TestResult {
                        passed: false,
                        reason: Some(format!(
                            "wrong output: expected {}, got {}",
                            shorten(output, 80),
                            shorten(&got, 80)
                        )),
                    },
                }
            }
        })
    }

    /// The score of one response with every test's result. `Err` only when the row's tests
    /// are missing or malformed or the sandbox itself fails (the reward's fault, not the
    /// response's).
    pub fn evaluate(&self, input: &RewardInput) -> Result<Verdict, CodeError> {
        let cell = input
            .row
            .get(&self.spec.tests_key)
            .ok_or_else(|| CodeError::NoTestsColumn(self.spec.tests_key.clone()))?;
        let tests = parse_tests(cell).map_err(CodeError::MalformedTests)?;
        let Some(code) = extract_code(&input.response, &self.spec.language) else {
            return Ok(Verdict {
                score: 0.0,
                tests: Vec::new(),
                reason: Some(format!("no ```{} code block", self.spec.language)),
            });
        };
        let mut results = Vec::with_capacity(tests.len());
        for t in &tests {
            let r = self.run_test(&code, t)?;
            let failed = !r.passed;
            results.push(r);
            if failed && self.spec.scoring == Scoring::All {
                break;
            }
        }
        let passed = results.iter().filter(|r| r.passed).count();
        let score = match self.spec.scoring {
            Scoring::Fraction => passed as f64 / tests.len() as f64,
            Scoring::All => f64::from(u8::from(passed == tests.len())),
        };
        Ok(Verdict {
            score,
            tests: results,
            reason: None,
        })
    }
}

impl RewardFn for CodeReward {
    fn score(&self, input: &RewardInput) -> Result<f64, String> {
        self.evaluate(input)
            .map(|v| v.score)
            .map_err(|e| e.to_string())
    }

    fn schedule(&self) -> Schedule {
        Schedule {
            batch_size: 1,
            workers: Some(self.spec.workers.max(1)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_last_block_of_the_language_wins_then_the_last_untagged() {
        let r = "plan\n```python\nx = 1\n```\ntext\n```py\nx = 2\n```\n```\nx = 3\n```\n";
        assert_eq!(extract_code(r, "python").as_deref(), Some("x = 2"));
        assert_eq!(
            extract_code("```\nx = 3\n```", "python").as_deref(),
            Some("x = 3")
        );
        assert_eq!(extract_code("```rust\nfn f(){}\n```", "python"), None);
        // A four-backtick fence holds a triple-backtick line; an unclosed block is ignored.
        let r = "````python\ns = '```'\nprint(s)\n````\n```python\ntruncated";
        assert_eq!(
            extract_code(r, "python").as_deref(),
            Some("s = '```'\nprint(s)")
        );
        assert_eq!(
            extract_code("~~~bash\necho hi\n~~~", "bash").as_deref(),
            Some("echo hi")
        );
    }

    #[test]
    fn tests_parse_in_every_layout() {
        assert_eq!(
            parse_tests(&json!("assert f(1) == 2")).unwrap(),
            vec![TestCase::Program("assert f(1) == 2".into())]
        );
        assert_eq!(parse_tests(&json!(["a", "b"])).unwrap().len(), 2);
        let io = vec![TestCase::Io {
            input: "1 2\n".into(),
            output: "3\n".into(),
        }];
        assert_eq!(
            parse_tests(&json!([{"input": "1 2\n", "output": "3\n"}])).unwrap(),
            io
        );
        assert_eq!(
            parse_tests(&json!({"inputs": ["1 2\n"], "outputs": ["3\n"]})).unwrap(),
            io
        );
        assert_eq!(
            parse_tests(&json!(
                "{\"inputs\": [\"1 2\\n\"], \"outputs\": [\"3\\n\"]}"
            ))
            .unwrap(),
            io
        );
        assert!(parse_tests(&json!([])).is_err());
        assert!(parse_tests(&json!({"inputs": ["1"], "outputs": []})).is_err());
        assert!(parse_tests(&json!(3)).is_err());
    }

    #[test]
    fn output_comparison_ignores_trailing_whitespace_only() {
        assert_eq!(normalise("3  \n4\n\n\n"), normalise("3\n4"));
        assert_ne!(normalise("3 4"), normalise("3  4"));
    }

    fn row_input(response: &str, tests: Value) -> RewardInput {
        let mut row = serde_json::Map::new();
        row.insert("tests".into(), tests);
        RewardInput {
            prompt: String::new(),
            response: response.into(),
            row,
            response_tokens: 0,
        }
    }

    #[test]
    fn fraction_and_all_or_nothing_over_assert_and_io_tests() {
        let mut spec = CodeSpec::for_language("python");
        let fraction = CodeReward::new(spec.clone()).unwrap();
        spec.scoring = Scoring::All;
        let all = CodeReward::new(spec).unwrap();
        // add() is wrong for negative numbers: 2 of 3 asserts pass.
        let r = "```python\ndef add(a, b):\n    return abs(a) + b\n```";
        let asserts = json!([
            "assert add(1, 2) == 3",
            "assert add(0, 0) == 0",
            "assert add(-1, 1) == 0"
        ]);
        let v = fraction.evaluate(&row_input(r, asserts.clone())).unwrap();
        assert!((v.score - 2.0 / 3.0).abs() < 1e-12, "{v:?}");
        assert!(v.tests[2]
            .reason
            .as_deref()
            .unwrap()
            .contains("AssertionError"));
        assert_eq!(all.score(&row_input(r, asserts)).unwrap(), 0.0);
        // stdin/stdout pairs in the APPS layout, one wrong.
        let r = "```python\na, b = map(int, input().split())\nprint(a * b)\n```";
        let io = json!({"inputs": ["2 3\n", "4 5\n"], "outputs": ["6\n", "21\n"]});
        let v = fraction.evaluate(&row_input(r, io)).unwrap();
        assert_eq!(v.score, 0.5);
        assert_eq!(
            v.tests[1].reason.as_deref(),
            Some("wrong output: expected \"21\\n\", got \"20\\n\"")
        );
        // No code block: 0 with a reason, not a failure of the reward.
        let v = fraction
            .evaluate(&row_input("just prose", json!("assert True")))
            .unwrap();
        assert_eq!(
            (v.score, v.reason.as_deref()),
            (0.0, Some("no ```python code block"))
        );
        // A row without tests is the reward's failure.
        let mut no_tests = row_input("```python\npass\n```", json!(null));
        no_tests.row.clear();
        assert!(fraction.score(&no_tests).unwrap_err().contains("`tests`"));
    }

    /// Honest solutions in the shapes datasets use pass the strict harness: stdlib containers
    /// compared with plain values, a HumanEval `check(candidate)`, tolerances, printing.
    #[test]
    fn honest_solutions_pass_the_harness() {
        let reward = CodeReward::new(CodeSpec::for_language("python")).unwrap();
        let cases = [
            (
                "from collections import Counter\ndef f(s):\n    print('counting', s)\n    return Counter(s)",
                "assert f('aab') == {'a': 2, 'b': 1}\nassert 'a' in f('a') and f('') == {}",
            ),
            (
                "from collections import namedtuple\nP = namedtuple('P', 'x y')\ndef f():\n    return P(1, 2)",
                "assert f() == (1, 2)\nassert f().x < 2 < 3\nassert f() is not None",
            ),
            (
                "def add(a, b):\n    return a + b",
                "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert all(candidate(i, 0) == i for i in range(5))\ncheck(add)",
            ),
            (
                "import math\ndef f():\n    return 0.1 + 0.2",
                "assert abs(f() - 0.3) < 1e-9 and math.isclose(f(), 0.3)\nassert isinstance(f(), float)\nassert [f()] != [0.3]",
            ),
        ];
        for (code, tests) in cases {
            let v = reward
                .evaluate(&row_input(&format!("```python\n{code}\n```"), json!(tests)))
                .unwrap();
            assert_eq!(v.score, 1.0, "{code}: {v:?}");
        }
    }

    #[test]
    fn a_batch_is_scored_by_parallel_workers() {
        let mut spec = CodeSpec::for_language("python");
        spec.workers = 4;
        let reward = CodeReward::new(spec).unwrap();
        let inputs: Vec<RewardInput> = (0..8)
            .map(|i| {
                let answer = if i % 2 == 0 { "6" } else { "7" };
                let code = format!("import time\ntime.sleep(0.4)\nprint({answer})");
                row_input(
                    &format!("```python\n{code}\n```"),
                    json!([{"input": "", "output": "6"}]),
                )
            })
            .collect();
        let set = crate::RewardSet {
            functions: vec![crate::WeightedReward {
                name: "code".into(),
                weight: 2.0,
                function: std::sync::Arc::new(reward),
            }],
            failure_score: -1.0,
            timeout: std::time::Duration::from_secs(10),
        };
        let start = std::time::Instant::now();
        let out = set.score(&inputs);
        let took = start.elapsed();
        assert_eq!(out.total, [2.0, 0.0, 2.0, 0.0, 2.0, 0.0, 2.0, 0.0]);
        assert_eq!(out.failures, vec![("code".to_string(), 0)]);
        // 8 runs of 0.4 s on 4 workers: two rounds, not eight.
        assert!(took < std::time::Duration::from_millis(2400), "{took:?}");
        let per_call = out.latency[0].1;
        assert!((0.4..1.2).contains(&per_call), "{per_call}");
    }
}
