//! SFT data: the loss covers exactly the assistant's tokens of each turn.

use oxrl_models::Tokenizer;
use oxrl_train::sft::load_examples;
use std::path::PathBuf;

fn demo_tokenizer() -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/arithmetic/policy");
    Tokenizer::from_dir(&dir).unwrap()
}

#[test]
fn each_assistant_turn_is_one_example_with_only_its_tokens_as_response() {
    let tok = demo_tokenizer();
    let dir = std::env::temp_dir().join(format!("oxrl-sft-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("chat.jsonl");
    std::fs::write(
        &file,
        r#"{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]}"#,
    )
    .unwrap();
    let ex = load_examples(
        &[file],
        "messages",
        "images",
        &tok,
        &Default::default(),
        None,
        None,
    )
    .unwrap()
    .0;
    assert_eq!(ex.len(), 2);
    assert_eq!(
        tok.decode(&ex[0].response_ids, false).unwrap(),
        "2<|im_end|>\n"
    );
    assert_eq!(
        tok.decode(&ex[1].response_ids, false).unwrap(),
        "4<|im_end|>\n"
    );
    let prompt = tok.decode(&ex[1].prompt_ids, false).unwrap();
    assert_eq!(prompt, "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n");
    std::fs::remove_dir_all(&dir).unwrap();
}
