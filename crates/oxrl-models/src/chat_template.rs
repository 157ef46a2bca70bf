//! Chat templates rendered the way transformers renders them: Jinja with `trim_blocks` and
//! `lstrip_blocks`, the Python string methods templates call (`startswith`, `split`, `strip`, …
//! via minijinja-contrib's pycompat), `raise_exception`, and a `tojson` that prints what Python's
//! `json.dumps(x, ensure_ascii=False)` prints (`", "` and `": "` separators, key order kept).

use crate::error::{ModelError, Result};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;
use serde_json::ser::{CompactFormatter, Formatter, PrettyFormatter, Serializer};
use std::io::Write;

/// Python's default `json.dumps` separators on top of serde_json's compact output.
struct PythonFormatter;

impl Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        CompactFormatter.begin_object_value(w)?;
        w.write_all(b" ")
    }
}

fn tojson(value: Value, indent: Option<usize>) -> std::result::Result<String, Error> {
    let mut out = Vec::new();
    let written = match indent {
        None => value.serialize(&mut Serializer::with_formatter(&mut out, PythonFormatter)),
        Some(n) => {
            let pad = vec![b' '; n];
            value.serialize(&mut Serializer::with_formatter(
                &mut out,
                PrettyFormatter::with_indent(&pad),
            ))
        }
    };
    written.map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    String::from_utf8(out).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))
}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl ChatTemplate {
    /// Compiles `source`; `origin` names where it came from, for errors.
    pub fn new(source: &str, origin: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source.to_string())
            .map_err(|source| ModelError::TemplateSyntax {
                origin: origin.to_string(),
                source,
            })?;
        Ok(Self { env })
    }

    /// Renders `messages` (a JSON array of `{role, content}`) with the template variables
    /// `add_generation_prompt`, the special tokens in `special` and any extra keyword arguments
    /// (`enable_thinking`, `tools`, …) in `kwargs`.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        special: &serde_json::Map<String, serde_json::Value>,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let mut ctx = special.clone();
        ctx.extend(kwargs.clone());
        ctx.insert("messages".into(), messages.clone());
        ctx.insert(
            "add_generation_prompt".into(),
            serde_json::Value::Bool(add_generation_prompt),
        );
        let template = self
            .env
            .get_template("chat")
            .map_err(ModelError::TemplateRender)?;
        template
            .render(Value::from_serialize(&ctx))
            .map_err(ModelError::TemplateRender)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tojson_prints_like_python_json_dumps() {
        let v = Value::from_serialize(json!({"b": [1, 2.5, "é\n"], "a": null}));
        assert_eq!(
            tojson(v, None).unwrap(),
            r#"{"b": [1, 2.5, "é\n"], "a": null}"#
        );
    }

    #[test]
    fn raise_exception_surfaces_as_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "t").unwrap();
        let e = t
            .render(&json!([]), false, &Default::default(), &Default::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("no system role"), "{e}");
    }
}
