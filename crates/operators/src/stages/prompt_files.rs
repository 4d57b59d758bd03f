//! Prompt sets from files: JSONL or Parquet, the prompt as text or chat
//! messages, extra string columns (a reference answer, preference pairs);
//! errors name the file, the line or row, and the column.

use super::prompts::{PromptRow, PromptSource};
use crate::error::OperatorError;
use weir_gpu::{Message, Tokenizer};
use weir_graph::StageError;

/// Which column of a prompt file holds the prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptColumn {
    /// Plain text, tokenised as is (no chat template).
    Text(String),
    /// A list of `{role, content}` messages, rendered with the chat template and a generation prompt.
    Messages(String),
}

/// How a prompt of a file becomes the model's input.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptFormat {
    /// A text in which `{prompt}` stands for a plain-text prompt (e.g.
    /// `"Question: {prompt}\nAnswer:"`).
    pub template: Option<String>,
    /// Render a plain-text prompt as a user message with the chat template
    /// (and a generation prompt); message prompts always are.
    pub chat: bool,
    /// A system message put first, unless the messages start with one.
    pub system: Option<String>,
}

impl PromptFormat {
    /// The text and tokens of a plain-text prompt.
    fn text(&self, raw: &str, tokenizer: &Tokenizer) -> Result<(String, Vec<i64>), StageError> {
        let text = match &self.template {
            Some(t) => t.replace("{prompt}", raw),
            None => raw.to_string(),
        };
        if !self.chat {
            let tokens = tokenizer.encode(&text, true)?;
            return Ok((text, tokens));
        }
        self.messages(
            vec![Message {
                role: "user".into(),
                content: text,
            }],
            tokenizer,
        )
    }

    /// The text and tokens of a list of messages.
    fn messages(
        &self,
        mut messages: Vec<Message>,
        tokenizer: &Tokenizer,
    ) -> Result<(String, Vec<i64>), StageError> {
        if let Some(system) = &self.system {
            if messages.first().is_none_or(|m| m.role != "system") {
                messages.insert(
                    0,
                    Message {
                        role: "system".into(),
                        content: system.clone(),
                    },
                );
            }
        }
        Ok((
            tokenizer.apply_chat_template(&messages, true)?,
            tokenizer.encode_chat(&messages, true)?,
        ))
    }
}

impl PromptSource {
    /// Reads a prompt set from a `.jsonl` or `.parquet` file: the prompt
    /// from `prompt`, and each of `extra` (e.g. `answer`) as a string column.
    /// Errors name the file and the line (JSONL) or row (Parquet) and the
    /// column; a prompt of more than `max_prompt_tokens` tokens is an error.
    #[allow(clippy::too_many_arguments)]
    pub fn from_file(
        path: &std::path::Path,
        prompt: &PromptColumn,
        format: &PromptFormat,
        extra: &[String],
        limit: Option<PromptLimit>,
        tokenizer: &Tokenizer,
        prompts_per_step: usize,
        samples: usize,
        seed: u64,
    ) -> Result<Self, StageError> {
        let records = read_records(path)?;
        let mut rows = Vec::with_capacity(records.len());
        let mut left_out: Option<(usize, &str)> = None;
        for (where_, record) in &records {
            let missing =
                |c: &str| format!("{}: {where_}: column `{c}` is missing", path.display());
            let (text, tokens) = match prompt {
                PromptColumn::Text(c) => {
                    let value = field(record, c).ok_or_else(|| missing(c))?;
                    let text = value.as_str().ok_or_else(|| {
                        format!(
                            "{}: {where_}: column `{c}` is {}, not text",
                            path.display(),
                            json_kind(value)
                        )
                    })?;
                    format.text(text, tokenizer)?
                }
                PromptColumn::Messages(c) => {
                    let value = field(record, c).ok_or_else(|| missing(c))?;
                    let messages: Vec<Message> =
                        serde_json::from_value(value.clone()).map_err(|e| {
                            OperatorError::file(path, format!("{where_}: column `{c}`: {e}"))
                        })?;
                    format.messages(messages, tokenizer)?
                }
            };
            if tokens.is_empty() {
                return Err(format!(
                    "{}: {where_}: the prompt encodes to no tokens",
                    path.display()
                )
                .into());
            }
            if let Some(limit) = limit.filter(|l| tokens.len() > l.tokens) {
                if limit.skip {
                    left_out.get_or_insert((0, where_)).0 += 1;
                    continue;
                }
                return Err(format!(
                    "{}: {where_}: the prompt is {} tokens, more than the {} the model's \
                     context leaves beside generate.max_new_tokens (data.skip_long_prompts = \
                     true leaves such prompts out)",
                    path.display(),
                    tokens.len(),
                    limit.tokens
                )
                .into());
            }
            let mut values = Vec::with_capacity(extra.len());
            for c in extra {
                let v = field(record, c).ok_or_else(|| missing(c))?;
                values.push(match v {
                    serde_json::Value::String(s) => s.clone(),
                    serde_json::Value::Null => {
                        return Err(format!(
                            "{}: {where_}: column `{c}` is null (a reward needs a value)",
                            path.display()
                        )
                        .into())
                    }
                    other => other.to_string(),
                });
            }
            rows.push(PromptRow {
                prompt: text,
                tokens,
                extra: values,
            });
        }
        if let (Some((n, first)), Some(limit)) = (left_out, limit) {
            if rows.is_empty() {
                return Err(format!(
                    "{}: every prompt is longer than the {} tokens the model's context leaves \
                     beside generate.max_new_tokens",
                    path.display(),
                    limit.tokens
                )
                .into());
            }
            tracing::warn!(
                "{}: {n} of {} prompts are longer than {} tokens and left out \
                 (data.skip_long_prompts; the first at {first})",
                path.display(),
                records.len(),
                limit.tokens
            );
        }
        PromptSource::new(rows, extra.to_vec(), prompts_per_step, samples, seed)
            .map_err(|e| OperatorError::file(path, e).into())
    }
}

/// How many tokens a prompt may have, and whether a longer one is left
/// out (else it is an error naming its line).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptLimit {
    /// The most tokens a prompt may have.
    pub tokens: usize,
    /// Leave longer prompts out (with a warning counting them).
    pub skip: bool,
}

/// What kind of JSON value `v` is, for an error.
fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "text",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

/// A prompt file's records, read once to learn what its columns hold.
pub struct PromptRecords(Vec<Record>);

impl PromptRecords {
    /// Reads the records of a JSONL, JSON or Parquet prompt file.
    pub fn read(path: &std::path::Path) -> Result<Self, StageError> {
        Ok(PromptRecords(read_records(path)?))
    }

    /// The columns every record has, in the order the first record lists
    /// them (what a reward function may receive besides the prompt).
    pub fn common_columns(&self) -> Vec<String> {
        let Some((_, first)) = self.0.first() else {
            return Vec::new();
        };
        first
            .keys()
            .filter(|k| self.0.iter().all(|(_, r)| r.contains_key(*k)))
            .cloned()
            .collect()
    }

    /// Which of `names` every record holds as a JSON number, boolean, list
    /// or object (a column with any text value is text): the rollout keeps
    /// such values as their JSON text, and a reward function receives them
    /// decoded.
    pub fn typed_columns(&self, names: &[String]) -> Vec<String> {
        names
            .iter()
            .filter(|name| {
                !self.0.is_empty()
                    && self.0.iter().all(|(_, r)| {
                        field(r, name).is_some_and(|v| !matches!(v, serde_json::Value::String(_)))
                    })
            })
            .cloned()
            .collect()
    }
}

/// A record's column `name`: the top-level field of that name, else, for a
/// dotted name, the nested field it names (`reward_model.ground_truth`, as
/// verl's datasets keep the answer; a Parquet struct column reads the same).
fn field<'a>(
    record: &'a serde_json::Map<String, serde_json::Value>,
    name: &str,
) -> Option<&'a serde_json::Value> {
    if let Some(v) = record.get(name) {
        return Some(v);
    }
    let mut parts = name.split('.');
    let mut value = record.get(parts.next()?)?;
    for part in parts {
        value = value.as_object()?.get(part)?;
    }
    Some(value)
}

/// One record of a prompt file: where it came from (`line 3`, `row 7`) and its fields.
type Record = (String, serde_json::Map<String, serde_json::Value>);

/// The records of a JSONL or Parquet file as JSON objects, each with where it came from.
fn read_records(path: &std::path::Path) -> Result<Vec<Record>, StageError> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match ext {
        "jsonl" | "json" => {
            let text = std::fs::read_to_string(path).map_err(|e| OperatorError::file(path, e))?;
            // A byte-order mark (as some Windows editors write) is not JSON.
            let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
            if text.trim_start().starts_with('[') {
                return json_array_records(path, text);
            }
            let mut out = Vec::new();
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let value: serde_json::Value = serde_json::from_str(line).map_err(|e| {
                    OperatorError::file(path, format!("line {}: not JSON: {e}", i + 1))
                })?;
                let serde_json::Value::Object(map) = value else {
                    return Err(
                        format!("{}: line {}: not a JSON object", path.display(), i + 1).into(),
                    );
                };
                out.push((format!("line {}", i + 1), map));
            }
            Ok(out)
        }
        "parquet" => {
            let batches = weir_graph::parquet_log::read_parquet_file(path)?;
            let mut out = Vec::new();
            let mut row = 0;
            for batch in batches {
                let mut writer = arrow::json::ArrayWriter::new(Vec::new());
                writer
                    .write(&batch)
                    .map_err(|e| OperatorError::file(path, e))?;
                writer.finish().map_err(|e| OperatorError::file(path, e))?;
                let values: Vec<serde_json::Value> = serde_json::from_slice(&writer.into_inner())
                    .map_err(|e| OperatorError::file(path, e))?;
                for v in values {
                    if let serde_json::Value::Object(map) = v {
                        out.push((format!("row {row}"), map));
                    }
                    row += 1;
                }
            }
            Ok(out)
        }
        other => Err(format!(
            "{}: prompt files must be .jsonl, .json or .parquet, not `.{other}`",
            path.display()
        )
        .into()),
    }
}

/// The records of a file holding one JSON array of objects (what
/// `json.dump(rows, f)` writes), each named by its place in the array.
fn json_array_records(path: &std::path::Path, text: &str) -> Result<Vec<Record>, StageError> {
    let values: Vec<serde_json::Value> = serde_json::from_str(text).map_err(|e| {
        format!(
            "{}: not a JSON array of objects ({e}); a prompt file holds one JSON object per \
             line (JSONL), or one array of objects",
            path.display()
        )
    })?;
    values
        .into_iter()
        .enumerate()
        .map(|(i, value)| match value {
            serde_json::Value::Object(map) => Ok((format!("record {}", i + 1), map)),
            _ => Err(format!(
                "{}: record {} of the array is not a JSON object",
                path.display(),
                i + 1
            )
            .into()),
        })
        .collect()
}

#[cfg(test)]
mod file_tests {
    use super::*;
    use arrow::array::{ArrayRef, RecordBatch, StringArray};
    use std::sync::Arc;

    fn tokenizer() -> Tokenizer {
        Tokenizer::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/tokenizer"),
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
        let (text, tokens) = format.text("1+2?", &tok).unwrap();
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
        assert_eq!(text, tok.apply_chat_template(&messages, true).unwrap());
        assert_eq!(tokens, tok.encode_chat(&messages, true).unwrap());
        // Without the chat template: the templated text as is.
        let plain = PromptFormat {
            chat: false,
            system: None,
            ..format.clone()
        };
        assert_eq!(plain.text("x", &tok).unwrap().0, "Question: x\nAnswer:");
        // Messages that bring their own system message keep it.
        let own = vec![messages[0].clone(), messages[1].clone()];
        let (again, _) = format.messages(own, &tok).unwrap();
        assert_eq!(again.matches("Be brief.").count(), 1);
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
}
