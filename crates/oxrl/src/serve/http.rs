//! HTTP plumbing over `tiny_http`: JSON bodies in and out, errors in OpenAI's shape, and
//! server-sent events written straight to the socket (flushed per event, so a client sees each
//! token as it is sampled).

use serde_json::{json, Value};
use std::io::{Read, Write};

/// The largest request body taken: room for a few images as data URLs.
pub const MAX_BODY_BYTES: u64 = 64 << 20;

/// An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    /// A 400 about the request field `param`.
    pub fn field(param: &str, message: impl std::fmt::Display) -> Self {
        Self {
            status: 400,
            message: format!("`{param}`: {message}"),
            param: Some(param.to_string()),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            param: None,
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: 404,
            message: message.into(),
            param: None,
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: 500,
            message: message.into(),
            param: None,
        }
    }

    /// OpenAI's error `type` for the status.
    fn kind(&self) -> &'static str {
        match self.status {
            400 | 413 | 422 => "invalid_request_error",
            404 => "not_found_error",
            405 => "method_not_allowed",
            503 => "service_unavailable",
            _ => "server_error",
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.status,
        }})
    }
}

/// The request's body as JSON: an object, at most [`MAX_BODY_BYTES`].
pub fn read_json(request: &mut tiny_http::Request) -> Result<Value, ApiError> {
    let mut bytes = Vec::new();
    let read = request
        .as_reader()
        .take(MAX_BODY_BYTES + 1)
        .read_to_end(&mut bytes);
    if let Err(e) = read {
        return Err(ApiError::bad_request(format!(
            "reading the request body: {e}"
        )));
    }
    if bytes.len() as u64 > MAX_BODY_BYTES {
        return Err(ApiError {
            status: 413,
            message: format!("the request body is over {MAX_BODY_BYTES} bytes"),
            param: None,
        });
    }
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    Ok(value)
}

/// Answers with `body` as JSON; a client that went away is not an error of ours.
pub fn respond_json(request: tiny_http::Request, status: u16, body: &Value) {
    let header = tiny_http::Header::from_bytes(&b"Content-Type"[..], &b"application/json"[..])
        .expect("a valid header");
    let response = tiny_http::Response::from_string(body.to_string())
        .with_status_code(status)
        .with_header(header);
    let _ = request.respond(response);
}

pub fn respond_text(request: tiny_http::Request, status: u16, content_type: &str, body: String) {
    let header = tiny_http::Header::from_bytes(&b"Content-Type"[..], content_type.as_bytes())
        .expect("a valid header");
    let response = tiny_http::Response::from_string(body)
        .with_status_code(status)
        .with_header(header);
    let _ = request.respond(response);
}

/// A `text/event-stream` answer: each event goes out as one HTTP chunk, flushed at once.
pub struct EventStream {
    out: Box<dyn Write + Send>,
    chunked: bool,
}

impl EventStream {
    /// Takes over the connection and writes the status line and headers.
    pub fn start(request: tiny_http::Request) -> std::io::Result<Self> {
        // HTTP/1.0 has no chunked encoding: the body then ends when the connection closes.
        let chunked = request.http_version() != &tiny_http::HTTPVersion(1, 0);
        let mut out = request.into_writer();
        let framing = if chunked {
            "Transfer-Encoding: chunked\r\n"
        } else {
            ""
        };
        write!(
            out,
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n\
             Connection: close\r\n{framing}\r\n"
        )?;
        out.flush()?;
        Ok(Self { out, chunked })
    }

    /// Sends `data: <json>`.
    pub fn send(&mut self, event: &Value) -> std::io::Result<()> {
        self.write(&format!("data: {event}\n\n"))
    }

    /// Sends `data: [DONE]` and ends the body.
    pub fn finish(mut self) -> std::io::Result<()> {
        self.write("data: [DONE]\n\n")?;
        if self.chunked {
            self.out.write_all(b"0\r\n\r\n")?;
        }
        self.out.flush()
    }

    fn write(&mut self, text: &str) -> std::io::Result<()> {
        if self.chunked {
            write!(self.out, "{:x}\r\n{text}\r\n", text.len())?;
        } else {
            self.out.write_all(text.as_bytes())?;
        }
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_take_openais_shape_and_type() {
        let e = ApiError::field("max_tokens", "must be at least 1, got -1");
        assert_eq!(
            e.body(),
            json!({"error": {
                "message": "`max_tokens`: must be at least 1, got -1",
                "type": "invalid_request_error",
                "param": "max_tokens",
                "code": 400,
            }})
        );
        assert_eq!(
            ApiError::not_found("no").body()["error"]["type"],
            "not_found_error"
        );
    }
}
