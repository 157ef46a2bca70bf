//! Test support shared by the workspace's integration tests: the reference fixtures in
//! `../shared/fixtures/` (beside the repository) and small JSON helpers. Never a runtime dependency.

use serde_json::Value;
use std::path::PathBuf;

/// `../shared/fixtures/<rel>` beside the repository; fails with the path when it is absent.
pub fn fixture(rel: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/fixtures")
        .join(rel);
    assert!(
        p.exists(),
        "fixture {} is absent: the tests need ../shared/fixtures beside the repository",
        p.display()
    );
    p
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("a list of ids")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

pub fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("a list of numbers")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect()
}

pub fn jsonl(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .expect("readable fixture")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("valid JSON line"))
        .collect()
}

/// A fresh empty directory under the system temp dir, unique to this test.
pub fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxrl-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// The repository's root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A bundled demo's `grpo.toml` (`examples/<demo>/`) written to `path` with its policy and data
/// paths made absolute and each `(from, to)` of `edits` replaced in its text (e.g.
/// `("batch_size = 32", "batch_size = 2")`); returns `path`.
pub fn demo_config(demo: &str, path: &std::path::Path, edits: &[(&str, &str)]) -> PathBuf {
    let example = repo().join("examples").join(demo);
    let absolute = |rel: &str| example.join(rel).display().to_string();
    let mut text = std::fs::read_to_string(example.join("grpo.toml"))
        .expect("the demo's grpo.toml")
        .replace(
            "path = \"policy\"",
            &format!("path = \"{}\"", absolute("policy")),
        )
        .replace(
            "\"data/prompts.jsonl\"",
            &format!("\"{}\"", absolute("data/prompts.jsonl")),
        );
    for (from, to) in edits {
        assert!(
            text.contains(from),
            "examples/{demo}/grpo.toml has no `{from}`"
        );
        text = text.replace(from, to);
    }
    std::fs::write(path, text).expect("writing the config");
    path.to_path_buf()
}
