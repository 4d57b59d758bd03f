//! Prompt sets from files: JSONL or Parquet, the prompt as text or chat
//! messages, extra string columns (a reference answer, preference pairs);
//! errors name the file, the line or row, and the column.

use std::io::BufRead;

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
    /// The text and tokens of a plain-text prompt (and its conversation, when the chat template renders it).
    fn text(&self, raw: &str, tokenizer: &Tokenizer) -> Result<Rendered, StageError> {
        let text = match &self.template {
            Some(t) => t.replace("{prompt}", raw),
            None => raw.to_string(),
        };
        if !self.chat {
            let tokens = tokenizer.encode(&text, true)?;
            return Ok(Rendered {
                text,
                tokens,
                messages: None,
            });
        }
        self.messages(
            vec![Message {
                role: "user".into(),
                content: text,
            }],
            tokenizer,
        )
    }

    /// The text, tokens and conversation of a list of messages.
    fn messages(
        &self,
        mut messages: Vec<Message>,
        tokenizer: &Tokenizer,
    ) -> Result<Rendered, StageError> {
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
        // Rendered once; its tokens are those of the text (what
        // `encode_chat` gives, without a second rendering).
        let text = tokenizer.apply_chat_template(&messages, true)?;
        let tokens = tokenizer.encode(&text, false)?;
        let messages = serde_json::to_string(&messages).map_err(|e| e.to_string())?;
        Ok(Rendered {
            text,
            tokens,
            messages: Some(messages),
        })
    }
}

/// A prompt as the model reads it: its text and tokens, and the
/// conversation (JSON) the chat template rendered, where it did.
struct Rendered {
    text: String,
    tokens: Vec<i64>,
    messages: Option<String>,
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
        let mut rows = Vec::new();
        let mut records = 0usize;
        let mut left_out: Option<(usize, String)> = None;
        // A text longer than this many bytes is over the limit, whatever
        // its tokens: it is not encoded at all.
        let token_bytes = limit.map(|_| tokenizer.max_token_bytes());
        each_record(path, |where_, record| {
            records += 1;
            let missing =
                |c: &str| format!("{}: {where_}: column `{c}` is missing", path.display());
            let over = |bytes: usize| match (limit, token_bytes) {
                (Some(l), Some(b)) => bytes > l.tokens.saturating_mul(b),
                _ => false,
            };
            let rendered = match prompt {
                PromptColumn::Text(c) => {
                    let value = field(&record, c).ok_or_else(|| missing(c))?;
                    let text = value.as_str().ok_or_else(|| {
                        format!(
                            "{}: {where_}: column `{c}` is {}, not text",
                            path.display(),
                            json_kind(value)
                        )
                    })?;
                    (!over(text.len()))
                        .then(|| format.text(text, tokenizer))
                        .transpose()?
                }
                PromptColumn::Messages(c) => {
                    let value = field(&record, c).ok_or_else(|| missing(c))?;
                    let messages: Vec<Message> =
                        serde_json::from_value(value.clone()).map_err(|e| {
                            OperatorError::file(path, format!("{where_}: column `{c}`: {e}"))
                        })?;
                    let bytes: usize = messages.iter().map(|m| m.content.len()).sum();
                    (!over(bytes))
                        .then(|| format.messages(messages, tokenizer))
                        .transpose()?
                }
            };
            let tokens_of = |rendered: &Option<Rendered>| rendered.as_ref().map(|r| r.tokens.len());
            if rendered.as_ref().is_some_and(|r| r.tokens.is_empty()) {
                return Err(format!(
                    "{}: {where_}: the prompt encodes to no tokens",
                    path.display()
                )
                .into());
            }
            if let Some(limit) = limit.filter(|l| tokens_of(&rendered).is_none_or(|n| n > l.tokens))
            {
                if limit.skip {
                    left_out.get_or_insert((0, where_.to_string())).0 += 1;
                    return Ok(());
                }
                let size = match tokens_of(&rendered) {
                    Some(n) => format!("{n} tokens"),
                    None => format!("over {} tokens (by its length in bytes)", limit.tokens),
                };
                return Err(format!(
                    "{}: {where_}: the prompt is {size}, more than the {} the model's \
                     context leaves beside generate.max_new_tokens (data.skip_long_prompts = \
                     true leaves such prompts out)",
                    path.display(),
                    limit.tokens
                )
                .into());
            }
            let Rendered {
                text,
                tokens,
                messages,
            } = rendered.expect("checked above");
            let mut values = Vec::with_capacity(extra.len());
            for c in extra {
                let v = field(&record, c).ok_or_else(|| missing(c))?;
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
                messages,
                tokens,
                extra: values,
            });
            Ok(())
        })?;
        rows.shrink_to_fit();
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
                "{}: {n} of {records} prompts are longer than {} tokens and left out \
                 (data.skip_long_prompts; the first at {first})",
                path.display(),
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

/// What a prompt file's columns hold, learnt in one streaming pass over
/// it (its records are not kept) and shared by every reader in the
/// process while the file is unchanged.
pub struct PromptRecords {
    /// Records in the file.
    records: usize,
    /// The first record's columns, by name.
    first: Vec<String>,
    /// For each column (and each nested field, dotted, up to
    /// [`NESTED_DEPTH`] deep): the records that hold it, and those that
    /// hold it as a JSON number, boolean, list or object.
    seen: std::collections::HashMap<String, (usize, usize)>,
}

/// How deep nested fields are followed for [`PromptRecords::typed_columns`].
const NESTED_DEPTH: usize = 3;

impl PromptRecords {
    /// What the columns of a JSONL, JSON or Parquet prompt file hold.
    pub fn read(path: &std::path::Path) -> Result<std::sync::Arc<Self>, StageError> {
        type Key = (std::path::PathBuf, u64, Option<std::time::SystemTime>);
        static READ: std::sync::Mutex<Vec<(Key, std::sync::Arc<PromptRecords>)>> =
            std::sync::Mutex::new(Vec::new());
        let meta = std::fs::metadata(path).map_err(|e| OperatorError::file(path, e))?;
        let key: Key = (path.to_path_buf(), meta.len(), meta.modified().ok());
        if let Some((_, known)) = READ
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|(k, _)| *k == key)
        {
            return Ok(known.clone());
        }
        let mut summary = PromptRecords {
            records: 0,
            first: Vec::new(),
            seen: Default::default(),
        };
        each_record(path, |_, record| {
            if summary.records == 0 {
                summary.first = record.keys().cloned().collect();
            }
            summary.records += 1;
            summary.note(&record, "", 1);
            Ok(())
        })?;
        let summary = std::sync::Arc::new(summary);
        let mut known = READ.lock().unwrap_or_else(|e| e.into_inner());
        known.retain(|(k, _)| k.0 != key.0);
        known.push((key, summary.clone()));
        Ok(summary)
    }

    /// Counts the fields of `object` (under `prefix`) and their nested ones.
    fn note(
        &mut self,
        object: &serde_json::Map<String, serde_json::Value>,
        prefix: &str,
        depth: usize,
    ) {
        for (name, value) in object {
            let path = format!("{prefix}{name}");
            let typed = !matches!(value, serde_json::Value::String(_));
            let entry = self.seen.entry(path.clone()).or_default();
            entry.0 += 1;
            entry.1 += usize::from(typed);
            if let (serde_json::Value::Object(inner), true) = (value, depth < NESTED_DEPTH) {
                self.note(inner, &format!("{path}."), depth + 1);
            }
        }
    }

    /// The columns every record has, by name (what a reward function may
    /// receive besides the prompt).
    pub fn common_columns(&self) -> Vec<String> {
        self.first
            .iter()
            .filter(|k| self.seen.get(*k).is_some_and(|(n, _)| *n == self.records))
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
                self.records > 0
                    && self
                        .seen
                        .get(*name)
                        .is_some_and(|&(_, typed)| typed == self.records)
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

/// The most bytes one record of a prompt file (a JSONL line, a Parquet
/// row as JSON) may hold.
pub const MAX_RECORD_BYTES: usize = 16 << 20;

/// The most bytes a prompt file may hold (a Parquet file: uncompressed):
/// a quarter of the machine's memory, since each prompt is kept as text
/// and as tokens for the whole run.
pub fn max_file_bytes() -> u64 {
    weir_graph::host::memory_bytes().map_or(16 << 30, |bytes| bytes / 4)
}

/// A size in bytes, for an error.
fn size(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{} MiB", bytes >> 20)
    }
}

/// One record of a prompt file: its fields.
type Record = serde_json::Map<String, serde_json::Value>;

/// Calls `visit(where, record)` for each record of a JSONL, JSON or Parquet
/// file, in order (`where` is `line 3`, `record 3` or `row 7`), reading the
/// file once and holding one record (a Parquet file: one batch) at a time.
fn each_record(
    path: &std::path::Path,
    mut visit: impl FnMut(&str, Record) -> Result<(), StageError>,
) -> Result<(), StageError> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let too_big = |bytes: u64| -> StageError {
        format!(
            "{}: {} is more than the {} a prompt file may hold here (a quarter of the \
             machine's memory: every prompt is kept as text and tokens); split the file or \
             leave out what the run does not use",
            path.display(),
            size(bytes),
            size(max_file_bytes())
        )
        .into()
    };
    match ext {
        "jsonl" | "json" => {
            let file = std::fs::File::open(path).map_err(|e| OperatorError::file(path, e))?;
            let len = file
                .metadata()
                .map_err(|e| OperatorError::file(path, e))?
                .len();
            if len > max_file_bytes() {
                return Err(too_big(len));
            }
            let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
            if starts_an_array(&mut reader).map_err(|e| OperatorError::file(path, e))? {
                return json_array_records(path, reader, visit);
            }
            let mut line = Vec::new();
            for number in 1.. {
                line.clear();
                let read = std::io::Read::take(&mut reader, MAX_RECORD_BYTES as u64 + 2)
                    .read_until(b'\n', &mut line)
                    .map_err(|e| OperatorError::file(path, e))?;
                if read == 0 {
                    break;
                }
                if line.last() == Some(&b'\n') {
                    line.pop();
                }
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                if line.len() > MAX_RECORD_BYTES {
                    return Err(format!(
                        "{}: line {number} is longer than {} (the most one prompt record may \
                         hold)",
                        path.display(),
                        size(MAX_RECORD_BYTES as u64)
                    )
                    .into());
                }
                let text = if number == 1 {
                    line.strip_prefix("\u{feff}".as_bytes()).unwrap_or(&line)
                } else {
                    &line[..]
                };
                if text.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                let value: serde_json::Value = serde_json::from_slice(text).map_err(|e| {
                    OperatorError::file(path, format!("line {number}: not JSON: {e}"))
                })?;
                let serde_json::Value::Object(map) = value else {
                    return Err(
                        format!("{}: line {number}: not a JSON object", path.display()).into(),
                    );
                };
                visit(&format!("line {number}"), map)?;
            }
            Ok(())
        }
        "parquet" => {
            let (bytes, batches) = weir_graph::parquet_log::parquet_batches(path)?;
            if bytes > max_file_bytes() {
                return Err(too_big(bytes));
            }
            let (mut row, mut decoded) = (0, 0u64);
            for batch in batches {
                let batch = batch?;
                // The values as decoded, not as the metadata says: a
                // dictionary holds one long string for many rows.
                decoded += batch.get_array_memory_size() as u64;
                if decoded > max_file_bytes() {
                    return Err(too_big(decoded));
                }
                // One line of JSON per row, the batch's rows only.
                let mut writer = arrow::json::LineDelimitedWriter::new(Vec::new());
                writer
                    .write(&batch)
                    .map_err(|e| OperatorError::file(path, e))?;
                writer.finish().map_err(|e| OperatorError::file(path, e))?;
                drop(batch);
                let lines = writer.into_inner();
                for line in lines.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
                    if line.len() > MAX_RECORD_BYTES {
                        return Err(format!(
                            "{}: row {row} is longer than {} as JSON (the most one prompt \
                             record may hold)",
                            path.display(),
                            size(MAX_RECORD_BYTES as u64)
                        )
                        .into());
                    }
                    let map: Record =
                        serde_json::from_slice(line).map_err(|e| OperatorError::file(path, e))?;
                    visit(&format!("row {row}"), map)?;
                    row += 1;
                }
            }
            Ok(())
        }
        other => Err(format!(
            "{}: prompt files must be .jsonl, .json or .parquet, not `.{other}`",
            path.display()
        )
        .into()),
    }
}

/// Whether the text `reader` holds starts (after a byte-order mark and
/// white space) with `[`: one JSON array of objects rather than JSONL.
/// Consumes the mark and the white space only.
fn starts_an_array(reader: &mut impl std::io::BufRead) -> std::io::Result<bool> {
    let mut first = true;
    loop {
        let buffer = reader.fill_buf()?;
        if buffer.is_empty() {
            return Ok(false);
        }
        if first && buffer.starts_with("\u{feff}".as_bytes()) {
            reader.consume(3);
            first = false;
            continue;
        }
        first = false;
        let blank = buffer
            .iter()
            .take_while(|b| b.is_ascii_whitespace())
            .count();
        if blank < buffer.len() {
            // Blank lines before a JSONL file's first record are kept for
            // its line numbers.
            let is_array = buffer[blank] == b'[';
            if is_array {
                reader.consume(blank);
            }
            return Ok(is_array);
        }
        if buffer.contains(&b'\n') {
            // Whole blank lines: JSONL numbering needs them.
            return Ok(false);
        }
        let n = buffer.len();
        reader.consume(n);
    }
}

/// The records of a file holding one JSON array of objects (what
/// `json.dump(rows, f)` writes), each named by its place in the array and
/// parsed from the stream one at a time.
fn json_array_records(
    path: &std::path::Path,
    reader: impl std::io::Read,
    visit: impl FnMut(&str, Record) -> Result<(), StageError>,
) -> Result<(), StageError> {
    use serde::de::{Deserializer as _, Error as _, SeqAccess, Visitor};

    struct Each<'a, F> {
        path: &'a std::path::Path,
        visit: F,
        failed: &'a mut Option<StageError>,
    }

    impl<'de, F: FnMut(&str, Record) -> Result<(), StageError>> Visitor<'de> for Each<'_, F> {
        type Value = ();

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON array of objects")
        }

        fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
            let mut number = 0;
            while let Some(value) = seq.next_element::<serde_json::Value>()? {
                number += 1;
                let result = match value {
                    serde_json::Value::Object(map) => {
                        (self.visit)(&format!("record {number}"), map)
                    }
                    _ => Err(format!(
                        "{}: record {number} of the array is not a JSON object",
                        self.path.display()
                    )
                    .into()),
                };
                if let Err(e) = result {
                    *self.failed = Some(e);
                    return Err(A::Error::custom("stopped"));
                }
            }
            Ok(())
        }
    }

    let mut failed = None;
    let mut deserializer = serde_json::Deserializer::from_reader(reader);
    let parsed = deserializer
        .deserialize_seq(Each {
            path,
            visit,
            failed: &mut failed,
        })
        .and_then(|()| deserializer.end());
    if let Some(e) = failed {
        return Err(e);
    }
    parsed.map_err(|e| {
        format!(
            "{}: not a JSON array of objects ({e}); a prompt file holds one JSON object per \
             line (JSONL), or one array of objects",
            path.display()
        )
        .into()
    })
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
}
