//! The prompt-file reader through `PromptSource::from_file`: JSONL and
//! Parquet sets, templates, long prompts, huge files, and the errors that
//! name the file, line and column.

use super::*;
use crate::stages::prompts::PromptSource;
use arrow::array::{ArrayRef, RecordBatch, StringArray};
use std::sync::Arc;

fn tokenizer() -> Tokenizer {
    Tokenizer::load(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer"),
    )
    .unwrap()
}

#[test]
fn jsonl_and_parquet_prompt_sets_load_with_their_extra_columns() {
    let dir = tempfile::tempdir().unwrap();
    let jsonl = dir.path().join("p.jsonl");
    std::fs::write(&jsonl, "{\"messages\": [{\"role\": \"user\", \"content\": \"Compute: 1+2\"}], \"answer\": \"3\"}\n\n{\"messages\": [{\"role\": \"user\", \"content\": \"Compute: 2+2\"}], \"answer\": 4}\n").unwrap();
    let tok = tokenizer();
    let src = PromptSource::from_file(
        &jsonl,
        &PromptColumn::Messages("messages".into()),
        &PromptFormat::default(),
        &["answer".into()],
        None,
        &tok,
        2,
        1,
        0,
    )
    .unwrap();
    let mut rows: Vec<_> = src
        .rows()
        .iter()
        .map(|r| (r.prompt.clone(), r.extra[0].clone()))
        .collect();
    rows.sort();
    assert_eq!(rows[0].1, "3");
    assert_eq!(rows[1].1, "4", "numbers become strings");
    assert!(rows[0].0.starts_with("<|im_start|>user\nCompute: 1+2"));
    // The same set as Parquet, text prompts.
    let parquet = dir.path().join("p.parquet");
    let batch = RecordBatch::try_from_iter([
        (
            "question",
            Arc::new(StringArray::from(vec!["Compute: 1+2", "Compute: 2+2"])) as ArrayRef,
        ),
        (
            "answer",
            Arc::new(StringArray::from(vec!["3", "4"])) as ArrayRef,
        ),
    ])
    .unwrap();
    weir_graph::parquet_log::write_parquet_atomically(&parquet, &[batch]).unwrap();
    let src = PromptSource::from_file(
        &parquet,
        &PromptColumn::Text("question".into()),
        &PromptFormat::default(),
        &["answer".into()],
        None,
        &tok,
        2,
        1,
        0,
    )
    .unwrap();
    assert_eq!(src.rows().len(), 2);
    assert_eq!(
        src.rows()[0].tokens,
        tok.encode("Compute: 1+2", true).unwrap()
    );
    // Typed columns: every value a number, list or object (nested
    // fields too); one text value makes a column text.
    let typed = dir.path().join("t.jsonl");
    std::fs::write(
        &typed,
        "{\"q\": \"a\", \"n\": 3, \"m\": \"3\", \"r\": {\"gt\": [1]}}\n\
         {\"q\": \"b\", \"n\": 4.5, \"m\": 4, \"r\": {\"gt\": [2, 3]}}\n",
    )
    .unwrap();
    let names: Vec<String> = ["q", "n", "m", "r.gt", "r", "absent"]
        .map(String::from)
        .to_vec();
    assert_eq!(
        PromptRecords::read(&typed).unwrap().typed_columns(&names),
        vec!["n".to_string(), "r.gt".into(), "r".into()]
    );
    assert!(PromptRecords::read(&parquet)
        .unwrap()
        .typed_columns(&["answer".into()])
        .is_empty());
}

#[test]
fn a_template_a_chat_template_and_a_system_prompt_shape_plain_prompts() {
    let tok = tokenizer();
    let format = PromptFormat {
        template: Some("Question: {prompt}\nAnswer:".into()),
        chat: true,
        system: Some("Be brief.".into()),
    };
    let rendered = format.text("1+2?", &tok).unwrap();
    let messages = [
        Message {
            role: "system".into(),
            content: "Be brief.".into(),
        },
        Message {
            role: "user".into(),
            content: "Question: 1+2?\nAnswer:".into(),
        },
    ];
    assert_eq!(
        rendered.text,
        tok.apply_chat_template(&messages, true).unwrap()
    );
    assert_eq!(rendered.tokens, tok.encode_chat(&messages, true).unwrap());
    // The conversation it rendered, kept for the judge and episodes.
    let kept: Vec<Message> = serde_json::from_str(&rendered.messages.unwrap()).unwrap();
    assert_eq!(kept, messages);
    // Without the chat template: the templated text as is.
    let plain = PromptFormat {
        chat: false,
        system: None,
        ..format.clone()
    };
    let rendered = plain.text("x", &tok).unwrap();
    assert_eq!(rendered.text, "Question: x\nAnswer:");
    assert_eq!(rendered.messages, None);
    // Messages that bring their own system message keep it.
    let own = vec![messages[0].clone(), messages[1].clone()];
    let again = format.messages(own, &tok).unwrap();
    assert_eq!(again.text.matches("Be brief.").count(), 1);
}

/// A prompt past the limit is an error naming its line, or, with
/// `skip`, left out (all of them left out is an error).
#[test]
fn long_prompts_are_named_or_left_out() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer();
    let path = dir.path().join("p.jsonl");
    let long = "1+1=".repeat(50);
    std::fs::write(
        &path,
        format!("{{\"prompt\": \"a\"}}\n{{\"prompt\": \"{long}\"}}\n{{\"prompt\": \"b\"}}\n"),
    )
    .unwrap();
    let load = |tokens, skip| {
        PromptSource::from_file(
            &path,
            &PromptColumn::Text("prompt".into()),
            &PromptFormat::default(),
            &[],
            Some(PromptLimit { tokens, skip }),
            &tok,
            1,
            1,
            0,
        )
    };
    let err = load(20, false).unwrap_err().to_string();
    assert!(
        err.contains("line 2: the prompt is") && err.contains("data.skip_long_prompts"),
        "{err}"
    );
    let kept = load(20, true).unwrap();
    let prompts: Vec<&str> = kept.rows().iter().map(|r| r.prompt.as_str()).collect();
    assert_eq!(prompts.len(), 2);
    assert!(prompts.iter().all(|p| p.len() < 10), "{prompts:?}");
    let err = load(0, true).unwrap_err().to_string();
    assert!(
        err.contains("every prompt is longer than the 0 tokens"),
        "{err}"
    );
}

#[test]
fn huge_lines_files_and_prompts_are_refused_without_reading_them_whole() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer();
    let load = |path: &std::path::Path, limit: Option<PromptLimit>| {
        PromptSource::from_file(
            path,
            &PromptColumn::Text("prompt".into()),
            &PromptFormat::default(),
            &[],
            limit,
            &tok,
            1,
            1,
            0,
        )
    };
    // A 1 GB line (sparse: no disk spent), after a good one.
    let path = dir.path().join("huge.jsonl");
    std::fs::write(&path, "{\"prompt\": \"1+1=\"}\n{\"prompt\": \"").unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(1 << 30).unwrap();
    let err = load(&path, None).unwrap_err().to_string();
    assert!(
        err.contains("huge.jsonl: line 2 is longer than 16 MiB") && !err.contains('\n'),
        "{err}"
    );
    // A file past what this machine may hold.
    file.set_len(max_file_bytes() + 1).unwrap();
    let err = PromptRecords::read(&path).err().unwrap().to_string();
    assert!(
        err.contains("huge.jsonl") && err.contains("a prompt file may hold here"),
        "{err}"
    );
    drop(file);
    // A prompt whose bytes alone exceed the token limit is judged so
    // without encoding it (4 MB of text against 20 tokens).
    let long = dir.path().join("long.jsonl");
    let text = "1+1=".repeat(1 << 20);
    std::fs::write(
        &long,
        format!("{{\"prompt\": \"2+2=\"}}\n{{\"prompt\": \"{text}\"}}\n"),
    )
    .unwrap();
    let limit = |skip| Some(PromptLimit { tokens: 20, skip });
    let err = load(&long, limit(false)).unwrap_err().to_string();
    assert!(
        err.contains("line 2: the prompt is over 20 tokens (by its length in bytes)"),
        "{err}"
    );
    assert_eq!(load(&long, limit(true)).unwrap().rows().len(), 1);
}

#[test]
fn what_columns_hold_is_learnt_again_when_the_file_changes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.jsonl");
    std::fs::write(&path, "{\"q\": \"a\", \"n\": 1}\n").unwrap();
    let first = PromptRecords::read(&path).unwrap();
    assert_eq!(first.typed_columns(&["n".into()]), vec!["n".to_string()]);
    assert!(std::sync::Arc::ptr_eq(
        &first,
        &PromptRecords::read(&path).unwrap()
    ));
    std::fs::write(
        &path,
        "{\"q\": \"a\", \"n\": 1}\n{\"q\": \"b\", \"n\": \"2\"}\n",
    )
    .unwrap();
    let second = PromptRecords::read(&path).unwrap();
    assert!(second.typed_columns(&["n".into()]).is_empty());
    assert_eq!(second.common_columns(), vec!["n".to_string(), "q".into()]);
}

#[test]
fn bad_prompt_files_name_the_file_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer();
    let path = dir.path().join("bad.jsonl");
    std::fs::write(
        &path,
        "{\"prompt\": \"a\", \"answer\": \"1\"}\n{\"prompt\": \"b\"}\n",
    )
    .unwrap();
    let err = PromptSource::from_file(
        &path,
        &PromptColumn::Text("prompt".into()),
        &PromptFormat::default(),
        &["answer".into()],
        None,
        &tok,
        1,
        1,
        0,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("bad.jsonl") && err.contains("line 2") && err.contains("`answer`"),
        "{err}"
    );
    std::fs::write(&path, "{\"prompt\": \"a\"}\nnot json\n").unwrap();
    let err = PromptSource::from_file(
        &path,
        &PromptColumn::Text("prompt".into()),
        &PromptFormat::default(),
        &[],
        None,
        &tok,
        1,
        1,
        0,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("line 2: not JSON"), "{err}");
    let err = PromptSource::from_file(
        &dir.path().join("x.csv"),
        &PromptColumn::Text("p".into()),
        &PromptFormat::default(),
        &[],
        None,
        &tok,
        1,
        1,
        0,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains(".csv"), "{err}");
    // A prompt that is not text, and a null answer: named as such.
    let load = |path: &std::path::Path| {
        PromptSource::from_file(
            path,
            &PromptColumn::Text("prompt".into()),
            &PromptFormat::default(),
            &["answer".into()],
            None,
            &tok,
            1,
            1,
            0,
        )
    };
    for (text, needle) in [
        (
            "{\"prompt\": 12, \"answer\": \"1\"}\n",
            "line 1: column `prompt` is a number, not text",
        ),
        (
            "{\"prompt\": \"a\", \"answer\": null}\n",
            "line 1: column `answer` is null",
        ),
    ] {
        std::fs::write(&path, text).unwrap();
        let err = load(&path).unwrap_err().to_string();
        assert!(err.contains(needle), "{err}");
    }
    // A .json file holding one array of objects, after a byte-order mark.
    let array = dir.path().join("set.json");
    std::fs::write(
        &array,
        "\u{feff}[{\"prompt\": \"a\", \"answer\": 1}, {\"prompt\": \"b\", \"answer\": \"2\"}]",
    )
    .unwrap();
    let src = load(&array).unwrap();
    assert_eq!(src.rows().len(), 2);
    assert_eq!(src.rows()[0].extra, vec!["1".to_string()]);
    std::fs::write(&array, "[{\"prompt\": \"a\", \"answer\": 1}, 3]").unwrap();
    let err = load(&array).unwrap_err().to_string();
    assert!(
        err.contains("record 2 of the array is not a JSON object"),
        "{err}"
    );
}
