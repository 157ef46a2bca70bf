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

/// Image rows in the forms datasets use — a string prompt with `<image>` and an `images`
/// column, chat messages with image items, embedded base64 bytes — become the same prompt: the
/// chat template's image pad expanded to the picture's 4 tokens, the picture processed once.
#[test]
fn image_rows_in_every_form_become_the_same_prompt() {
    use base64::Engine;
    use oxrl_models::ImagePrompting;
    let shapes = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/shapes");
    let policy = shapes.join("policy");
    let picture = shapes.join("data/images/000.png");
    let bytes = base64::engine::general_purpose::STANDARD.encode(std::fs::read(&picture).unwrap());
    let pic = picture.display().to_string();
    let rows = [
        serde_json::json!({"prompt": "<image>What colour is the shape?", "images": [pic], "answer": "red"}),
        serde_json::json!({"prompt": [{"role": "user", "content": [{"type": "image", "image": pic},
            {"type": "text", "text": "What colour is the shape?"}]}], "answer": "red"}),
        serde_json::json!({"prompt": "What colour is the shape?", "images": [{"bytes": bytes}], "answer": "red"}),
    ];
    let dir = std::env::temp_dir().join(format!("oxrl-data-img-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("d.jsonl");
    let text: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
    std::fs::write(&file, text.join("\n")).unwrap();
    let tok = Tokenizer::from_dir(&policy).unwrap();
    let prompting = ImagePrompting::from_dir(&policy).unwrap().unwrap();
    let cfg = DataConfig {
        train_files: vec![],
        val_files: vec![],
        prompt_key: "prompt".into(),
        answer_key: "answer".into(),
        image_key: "images".into(),
        max_prompt_length: 256,
        filter_overlong: false,
        enable_thinking: None,
        shuffle: true,
    };
    let (got, _) = load_prompts(&[&file], &cfg, &tok, Some(&prompting)).unwrap();
    assert_eq!(got.len(), 3);
    let pad = prompting.tokens.image_token_id;
    for row in &got {
        assert_eq!(row.images.len(), 1);
        assert_eq!(row.images[0].grid_thw, [1, 4, 4]);
        assert_eq!(row.prompt_ids.iter().filter(|&&t| t == pad).count(), 4);
        assert_eq!(row.prompt_ids, got[0].prompt_ids);
        assert_eq!(row.images[0].pixel_values, got[0].images[0].pixel_values);
    }
    assert!(got[2].image_refs[0].starts_with("data:image;base64,"));
    // A text-only policy refuses image rows before anything trains.
    let e = load_prompts(&[&file], &cfg, &tok, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("d.jsonl:1") && e.contains("no vision tower"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
