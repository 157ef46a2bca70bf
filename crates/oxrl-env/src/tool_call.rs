//! Tool calls in a policy's turn, in the forms Qwen3's chat template teaches:
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (its `tools` format), and a
//! `<code>...</code>` block (code to run with the Python tool).

use serde_json::{Map, Value};

#[derive(Debug, Clone, PartialEq)]
pub enum ToolCall {
    Function {
        name: String,
        arguments: Map<String, Value>,
    },
    Code(String),
}

/// The first tool call of `action`: `None` when it has none (then the turn is a final answer),
/// `Some(Err)` naming what is malformed.
pub fn first_call(action: &str) -> Option<Result<ToolCall, String>> {
    let function = action.find("<tool_call>");
    let code = action.find("<code>");
    match (function, code) {
        (None, None) => None,
        (Some(f), c) if c.is_none_or(|c| f < c) => Some(function_call(&action[f..])),
        (_, Some(c)) => Some(code_block(&action[c..])),
        _ => None,
    }
}

/// The text between `open` (at the start of `text`) and `close`.
fn between<'a>(text: &'a str, open: &str, close: &str) -> Result<&'a str, String> {
    let body = &text[open.len()..];
    body.find(close)
        .map(|end| body[..end].trim())
        .ok_or_else(|| format!("{open} without {close}"))
}

fn function_call(text: &str) -> Result<ToolCall, String> {
    let body = between(text, "<tool_call>", "</tool_call>")?;
    let call: Value = serde_json::from_str(body)
        .map_err(|e| format!("the tool call is not JSON ({e}): {body}"))?;
    let name = call
        .get("name")
        .and_then(Value::as_str)
        .ok_or("the tool call has no \"name\" string")?
        .to_string();
    let arguments = match call.get("arguments") {
        None => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        // Some models write the arguments as a JSON string.
        Some(Value::String(s)) => match serde_json::from_str(s) {
            Ok(Value::Object(m)) => m,
            _ => return Err(format!("\"arguments\" is not a JSON object: {s}")),
        },
        Some(other) => return Err(format!("\"arguments\" is not a JSON object: {other}")),
    };
    Ok(ToolCall::Function { name, arguments })
}

fn code_block(text: &str) -> Result<ToolCall, String> {
    Ok(ToolCall::Code(
        between(text, "<code>", "</code>")?.to_string(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn qwen3_tool_calls_and_code_blocks_parse() {
        let a = "Let me compute.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"37*45\"}}\n</tool_call>";
        let Some(Ok(ToolCall::Function { name, arguments })) = first_call(a) else {
            panic!("{a}")
        };
        assert_eq!(name, "calculator");
        assert_eq!(arguments["expression"], json!("37*45"));
        let s = "<tool_call>{\"name\": \"calc\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>";
        let Some(Ok(ToolCall::Function { arguments, .. })) = first_call(s) else {
            panic!("{s}")
        };
        assert_eq!(arguments["x"], json!(1));
        assert_eq!(
            first_call("run <code>print(1+1)</code> then <tool_call>{}</tool_call>"),
            Some(Ok(ToolCall::Code("print(1+1)".into())))
        );
        assert_eq!(first_call("The answer is 42."), None);
    }

    #[test]
    fn malformed_calls_say_what_is_wrong() {
        let e = |a: &str| first_call(a).unwrap().unwrap_err();
        assert!(e("<tool_call>{\"name\": 1}</tool_call>").contains("\"name\""));
        assert!(e("<tool_call>{nope}</tool_call>").contains("not JSON"));
        assert!(e("<tool_call>{\"name\": \"c\"}").contains("without </tool_call>"));
        assert!(e("<code>print(1)").contains("without </code>"));
        assert!(
            e("<tool_call>{\"name\": \"c\", \"arguments\": [1]}</tool_call>")
                .contains("not a JSON object")
        );
    }
}
