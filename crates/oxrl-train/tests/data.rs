//! Datasets read the same from JSONL and from Parquet (nested chat columns included).

use oxrl_models::Tokenizer;
use oxrl_train::config::DataConfig;
use oxrl_train::data::{load_prompts, read_rows};
use std::io::{BufReader, Cursor};
use std::path::PathBuf;
use std::sync::Arc;

const ROWS: &str = r#"{"prompt": "1+1=", "answer": "2", "n": 3, "messages": [{"role": "user", "content": "hi"}]}
{"prompt": "2+5=", "answer": "7", "n": 4, "messages": [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "ok"}]}
"#;

fn write_parquet(path: &std::path::Path) {
    let (schema, _) =
        arrow_json::reader::infer_json_schema(BufReader::new(Cursor::new(ROWS)), None).unwrap();
    let schema = Arc::new(schema);
    let reader = arrow_json::ReaderBuilder::new(schema.clone())
        .build(BufReader::new(Cursor::new(ROWS)))
        .unwrap();
    let mut writer =
        parquet::arrow::ArrowWriter::try_new(std::fs::File::create(path).unwrap(), schema, None)
            .unwrap();
    for batch in reader {
        writer.write(&batch.unwrap()).unwrap();
    }
    writer.close().unwrap();
}

#[test]
fn parquet_rows_equal_their_jsonl_source() {
    let dir = std::env::temp_dir().join(format!("oxrl-data-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (jsonl, parquet) = (dir.join("d.jsonl"), dir.join("d.parquet"));
    std::fs::write(&jsonl, ROWS).unwrap();
    write_parquet(&parquet);
    let a: Vec<_> = read_rows(&jsonl)
        .unwrap()
        .into_iter()
        .map(|r| r.columns)
        .collect();
    let b: Vec<_> = read_rows(&parquet)
        .unwrap()
        .into_iter()
        .map(|r| r.columns)
        .collect();
    assert_eq!(a, b);
    let tok = Tokenizer::from_dir(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/arithmetic/policy"),
    )
    .unwrap();
    let cfg = DataConfig {
        train_files: vec![],
        val_files: vec![],
        prompt_key: "prompt".into(),
        answer_key: "answer".into(),
        image_key: "images".into(),
        max_prompt_length: 64,
        filter_overlong: true,
        enable_thinking: None,
        shuffle: true,
    };
    let (from_jsonl, _) = load_prompts(&[&jsonl], &cfg, &tok, None).unwrap();
    let (from_parquet, _) = load_prompts(&[&parquet], &cfg, &tok, None).unwrap();
    let ids = |rows: &[oxrl_train::data::PromptRow]| {
        rows.iter()
            .map(|r| r.prompt_ids.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(&from_jsonl), ids(&from_parquet));
    std::fs::remove_dir_all(&dir).unwrap();
}
