//! A remote environment over HTTP, for users' own environments in any language.
//!
//! The contract, JSON both ways:
//! - `POST <url>/reset` with `{"row": {<the dataset row's columns>}}` answers
//!   `{"episode_id": <any JSON value, optional>, "observation": "<text>" | null}`;
//! - `POST <url>/step` with `{"episode_id": <the reset's>, "action": "<the policy's turn>"}`
//!   answers `{"observation": "<text>" | null, "reward": <number>, "done": <bool>}`.
//!
//! A non-200 status, a transport error or a body without those keys fails the episode with a
//! message naming the endpoint (the rollout scores a failed episode 0 and counts it).

use crate::{EnvError, Environment, EnvironmentFactory, Step};
use serde_json::{json, Map, Value};
use std::time::Duration;

#[derive(Debug, Clone, PartialEq)]
pub struct HttpEnvSpec {
    /// The service's base URL (`http://host:port`); `/reset` and `/step` are appended.
    pub url: String,
    /// Per request, connect to last byte.
    pub timeout: Duration,
}

pub struct HttpEnvironmentFactory {
    spec: HttpEnvSpec,
    agent: ureq::Agent,
}

impl HttpEnvironmentFactory {
    pub fn new(spec: HttpEnvSpec) -> Self {
        let agent = ureq::AgentBuilder::new().timeout(spec.timeout).build();
        Self { spec, agent }
    }
}

impl EnvironmentFactory for HttpEnvironmentFactory {
    fn make(&self) -> Box<dyn Environment> {
        Box::new(HttpEnvironment {
            base: self.spec.url.trim_end_matches('/').to_string(),
            agent: self.agent.clone(),
            episode: Value::Null,
        })
    }
}

pub struct HttpEnvironment {
    base: String,
    agent: ureq::Agent,
    /// The service's name for this episode.
    episode: Value,
}

impl HttpEnvironment {
    fn post(&self, endpoint: &str, body: Value) -> Result<Value, EnvError> {
        let url = format!("{}/{endpoint}", self.base);
        let fail = |what: String| EnvError::Failed(format!("environment {url}: {what}"));
        let response = match self.agent.post(&url).send_json(body) {
            Ok(r) => r,
            Err(ureq::Error::Status(code, r)) => {
                let text = r.into_string().unwrap_or_default();
                return Err(fail(format!("HTTP {code}: {}", text.trim())));
            }
            Err(e) => return Err(fail(e.to_string())),
        };
        response
            .into_json()
            .map_err(|e| fail(format!("the answer is not JSON: {e}")))
    }
}

/// `answer[key]` as text, where null (or absent) means none.
fn observation(answer: &Value, url: &str) -> Result<Option<String>, EnvError> {
    match answer.get("observation") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(EnvError::Failed(format!(
            "environment {url}: \"observation\" must be a string or null, got {other}"
        ))),
    }
}

impl Environment for HttpEnvironment {
    fn reset(&mut self, row: &Map<String, Value>) -> Result<Option<String>, EnvError> {
        let answer = self.post("reset", json!({ "row": row }))?;
        self.episode = answer.get("episode_id").cloned().unwrap_or(Value::Null);
        observation(&answer, &format!("{}/reset", self.base))
    }

    fn step(&mut self, action: &str) -> Result<Step, EnvError> {
        let answer = self.post(
            "step",
            json!({ "episode_id": self.episode, "action": action }),
        )?;
        let url = format!("{}/step", self.base);
        let missing = |key: &str, kind: &str| {
            EnvError::Failed(format!(
                "environment {url}: the answer needs \"{key}\" ({kind}): {answer}"
            ))
        };
        Ok(Step {
            observation: observation(&answer, &url)?,
            reward: answer
                .get("reward")
                .and_then(Value::as_f64)
                .ok_or_else(|| missing("reward", "a number"))?,
            done: answer
                .get("done")
                .and_then(Value::as_bool)
                .ok_or_else(|| missing("done", "true or false"))?,
        })
    }
}
