//! The official `openai` Python client (pinned in `.ci/python-requirements.txt`) against
//! `oxrl serve`: chat, completion, streaming, n > 1, log-probs, an image prompt, and bad requests
//! as the client's own 4xx exceptions (`tests/peers/openai_client.py`). A machine that cannot
//! install the client fails this test.

use oxrl_fixtures::{peer_python, repo, ServeProcess};
use std::path::Path;

#[test]
fn the_openai_client_talks_to_oxrl_serve() {
    let python = peer_python();
    let binary = Path::new(env!("CARGO_BIN_EXE_oxrl"));
    let text_policy = repo().join("examples/arithmetic/policy");
    let vl_policy = repo().join("examples/shapes/policy");
    let text = ServeProcess::start(
        binary,
        &[
            "--model",
            text_policy.to_str().unwrap(),
            "--served-model-name",
            "arith",
        ],
    );
    let vl = ServeProcess::start(binary, &["--model", vl_policy.to_str().unwrap()]);
    let image = repo().join("examples/shapes/data/images/001.png");
    let out = std::process::Command::new(python)
        .arg(repo().join("crates/oxrl/tests/peers/openai_client.py"))
        .args([&text.url, "arith", &vl.url, image.to_str().unwrap()])
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{said}");
    assert!(said.contains("every check passed"), "{said}");
}
