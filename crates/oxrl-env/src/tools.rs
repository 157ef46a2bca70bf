//! Tool use: the policy may call tools — `calculator` (`{"expression": "..."}`) and `python`
//! (`{"code": "..."}`, or a `<code>` block), run in the sandbox — and sees each result as an
//! observation; a turn without a tool call is its final answer, scored 1 when it matches the
//! row's ground truth (the `math_answer` rule: the last `\boxed{}`, else the last number).

use crate::calculator::{evaluate, format_number};
use crate::tool_call::{first_call, ToolCall};
use crate::{EnvError, Environment, EnvironmentFactory, Step};
use oxrl_reward::sandbox::{Exit, Limits, Sandbox};
use oxrl_reward::{build_rule, RewardFn, RewardInput, RuleSpec};
use serde_json::{Map, Value};
use std::sync::Arc;

/// Characters of a tool's output the policy sees (the rest is cut, and says so).
pub const MAX_OBSERVATION_CHARS: usize = 2000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tool {
    Calculator,
    Python,
}

impl Tool {
    pub const NAMES: [&'static str; 2] = ["calculator", "python"];

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "calculator" => Some(Tool::Calculator),
            "python" => Some(Tool::Python),
            _ => None,
        }
    }
}

/// What every episode of a run shares: the tools, the sandbox and the answer check.
pub struct ToolEnvironmentFactory {
    tools: Vec<Tool>,
    sandbox: Option<Arc<Sandbox>>,
    answer: Arc<dyn RewardFn>,
}

impl ToolEnvironmentFactory {
    /// `tools` by name; the final answer is checked against the row's `answer_key` column.
    /// The Python tool runs each snippet under `limits` in the strongest sandbox the kernel
    /// allows.
    pub fn new(tools: &[String], answer_key: &str, limits: Limits) -> Result<Self, EnvError> {
        let tools = tools
            .iter()
            .map(|n| {
                Tool::from_name(n).ok_or_else(|| {
                    EnvError::Failed(format!(
                        "unknown tool `{n}`; expected one of {}",
                        Tool::NAMES.join(", ")
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let sandbox = match tools.contains(&Tool::Python) {
            true => Some(Arc::new(
                Sandbox::new(limits).map_err(|e| EnvError::Failed(format!("sandbox: {e}")))?,
            )),
            false => None,
        };
        let answer = build_rule(&RuleSpec {
            kind: "math_answer".into(),
            answer_key: answer_key.into(),
            ..Default::default()
        })
        .map_err(EnvError::Failed)?;
        Ok(Self {
            tools,
            sandbox,
            answer: Arc::from(answer),
        })
    }
}

impl EnvironmentFactory for ToolEnvironmentFactory {
    fn make(&self) -> Box<dyn Environment> {
        Box::new(ToolEnvironment {
            tools: self.tools.clone(),
            sandbox: self.sandbox.clone(),
            answer: self.answer.clone(),
            row: Map::new(),
        })
    }
}

pub struct ToolEnvironment {
    tools: Vec<Tool>,
    sandbox: Option<Arc<Sandbox>>,
    answer: Arc<dyn RewardFn>,
    row: Map<String, Value>,
}

impl ToolEnvironment {
    /// The tool's output, or what went wrong (both are observations: the policy learns from
    /// its mistakes).
    fn call(&self, call: ToolCall) -> String {
        let (tool, arguments) = match call {
            ToolCall::Code(code) => (Tool::Python, Map::from_iter([("code".into(), code.into())])),
            ToolCall::Function { name, arguments } => match Tool::from_name(&name) {
                Some(t) => (t, arguments),
                None => return format!("error: no tool named `{name}`"),
            },
        };
        if !self.tools.contains(&tool) {
            return format!("error: the {tool:?} tool is not available");
        }
        let text = |key: &str| {
            arguments
                .get(key)
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        match tool {
            Tool::Calculator => match text("expression") {
                None => "error: calculator needs {\"expression\": \"...\"}".into(),
                Some(e) => match evaluate(&e) {
                    Ok(v) => format_number(v),
                    Err(why) => format!("error: {why}"),
                },
            },
            Tool::Python => match (text("code"), &self.sandbox) {
                (Some(code), Some(sandbox)) => run_python(sandbox, &code),
                _ => "error: python needs {\"code\": \"...\"}".into(),
            },
        }
    }
}

/// Runs `code` with `python3` in the sandbox: its stdout, and its stderr when it failed.
fn run_python(sandbox: &Sandbox, code: &str) -> String {
    let command = ["python3".to_string(), "{dir}/snippet.py".to_string()];
    let out = match sandbox.run(&command, &[("snippet.py", code.as_bytes())], b"") {
        Ok(out) => out,
        Err(e) => return format!("error: the sandbox could not run it: {e}"),
    };
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    match out.exit {
        Exit::Code(0) => {}
        Exit::Timeout => text.push_str("\nerror: timed out"),
        _ => text.push_str(&String::from_utf8_lossy(&out.stderr)),
    }
    truncate(text.trim_end())
}

fn truncate(text: &str) -> String {
    match text.char_indices().nth(MAX_OBSERVATION_CHARS) {
        Some((at, _)) => format!("{}\n... (output cut)", &text[..at]),
        None => text.to_string(),
    }
}

impl Environment for ToolEnvironment {
    fn reset(&mut self, row: &Map<String, Value>) -> Result<Option<String>, EnvError> {
        self.row = row.clone();
        Ok(None)
    }

    fn step(&mut self, action: &str) -> Result<Step, EnvError> {
        match first_call(action) {
            Some(call) => Ok(Step {
                observation: Some(match call {
                    Ok(call) => self.call(call),
                    Err(malformed) => format!("error: {malformed}"),
                }),
                reward: 0.0,
                done: false,
            }),
            None => {
                let input = RewardInput {
                    prompt: String::new(),
                    response: action.to_string(),
                    row: self.row.clone(),
                    response_tokens: 0,
                };
                let reward = self.answer.score(&input).map_err(EnvError::Failed)?;
                Ok(Step {
                    observation: None,
                    reward,
                    done: true,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn env(tools: &[&str]) -> Box<dyn Environment> {
        let names: Vec<String> = tools.iter().map(|s| s.to_string()).collect();
        let mut e = ToolEnvironmentFactory::new(&names, "answer", Limits::default())
            .unwrap()
            .make();
        let row = json!({"prompt": "37*45=", "answer": "1665"});
        assert_eq!(e.reset(row.as_object().unwrap()).unwrap(), None);
        e
    }

    #[test]
    fn a_calculator_call_is_answered_and_the_final_answer_scored() {
        let mut e = env(&["calculator"]);
        let call = "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"37*45\"}}</tool_call>";
        let s = e.step(call).unwrap();
        assert_eq!(
            (s.observation.as_deref(), s.reward, s.done),
            (Some("1665"), 0.0, false)
        );
        let s = e.step("37*45 = 1665").unwrap();
        assert_eq!((s.observation, s.reward, s.done), (None, 1.0, true));
        let mut e = env(&["calculator"]);
        assert_eq!(e.step("1600").unwrap().reward, 0.0);
    }

    #[test]
    fn mistakes_come_back_as_observations() {
        let mut e = env(&["calculator"]);
        let seen = |e: &mut Box<dyn Environment>, a: &str| e.step(a).unwrap().observation.unwrap();
        assert!(
            seen(&mut e, "<tool_call>{\"name\": \"search\"}</tool_call>").contains("no tool named")
        );
        assert!(seen(&mut e, "<code>print(1)</code>").contains("not available"));
        assert!(seen(&mut e, "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2+\"}}</tool_call>").contains("ends too early"));
        assert!(seen(&mut e, "<tool_call>oops</tool_call>").contains("not JSON"));
        let names = vec!["shell".to_string()];
        let e = ToolEnvironmentFactory::new(&names, "answer", Limits::default());
        assert!(e
            .err()
            .unwrap()
            .to_string()
            .contains("unknown tool `shell`"));
    }

    /// Python in the sandbox: output comes back; an error's traceback too.
    #[test]
    fn python_runs_in_the_sandbox() {
        let mut e = env(&["python"]);
        let s = e.step("<code>print(37 * 45)</code>").unwrap();
        assert_eq!(s.observation.as_deref(), Some("1665"));
        let s = e
            .step(
                "<tool_call>{\"name\": \"python\", \"arguments\": {\"code\": \"1/0\"}}</tool_call>",
            )
            .unwrap();
        assert!(s.observation.unwrap().contains("ZeroDivisionError"));
    }
}
