//! Errors of checkpoint IO and model construction, each naming the file or tensor at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: key `{key}`: {expected}")]
    ConfigKey {
        path: PathBuf,
        key: String,
        expected: String,
    },
    #[error("checkpoint is missing tensor `{0}`")]
    MissingTensor(String),
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    /// The weights of the checkpoint in `dir` do not fit its `config.json`.
    #[error("{}: {source}: the weights do not fit config.json", .dir.display())]
    WeightsMismatch {
        dir: PathBuf,
        source: Box<ModelError>,
    },
    #[error("{path}: {source}")]
    Safetensors {
        path: PathBuf,
        source: candle_core::Error,
    },
    #[error("{0}")]
    InvalidInput(String),
    /// A problem with one named part of an input (a request, a prompt, an image).
    #[error("{what}: {source}")]
    Input {
        what: String,
        source: Box<ModelError>,
    },
    #[error("{path}: cannot load tokenizer: {source}")]
    TokenizerLoad {
        path: PathBuf,
        source: tokenizers::Error,
    },
    #[error("cannot {action}: {source}")]
    Tokenize {
        action: &'static str,
        source: tokenizers::Error,
    },
    #[error("chat template: the model has no chat template (no chat_template.jinja and no `chat_template` in tokenizer_config.json)")]
    NoChatTemplate,
    #[error("chat template: {origin}: {source:#}")]
    TemplateSyntax {
        origin: String,
        source: minijinja::Error,
    },
    #[error("chat template: {0:#}")]
    TemplateRender(#[source] minijinja::Error),
    #[error("{0}")]
    Hub(String),
    #[error("model `{reference}` is not in the local hub cache (looked in {looked}) and downloading it failed: {source}")]
    HubDownload {
        reference: String,
        looked: String,
        source: crate::hub::DownloadError,
    },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("{path}: no `architectures` key, so the model class is unknown (known: {})", known.join(", "))]
    MissingArchitecture {
        path: PathBuf,
        known: Vec<&'static str>,
    },
    #[error("{path}: `architectures` is {found}, which oxrl cannot load (known: {})", known.join(", "))]
    UnknownArchitecture {
        path: PathBuf,
        found: String,
        known: Vec<&'static str>,
    },
    #[error("{path}: {architecture} is not {wanted}")]
    WrongModelKind {
        path: PathBuf,
        architecture: &'static str,
        wanted: &'static str,
    },
}

pub type Result<T> = std::result::Result<T, ModelError>;
