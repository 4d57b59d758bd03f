//! Prompt sets from files: JSONL or Parquet, the prompt as text or chat
//! messages, extra string columns (a reference answer, preference pairs);
//! errors name the file, the line or row, and the column.

use std::io::BufRead;

use crate::error::OperatorError;
use weir_gpu::{Message, Tokenizer};
use weir_graph::StageError;

/// One prompt of a dataset.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptRow {
    /// The prompt as given (text, or the rendered chat).
    pub prompt: String,
    /// The conversation the chat template rendered into `prompt` (JSON: a
    /// list of `{role, content}`), where one did.
    pub messages: Option<String>,
    /// Its token ids, chat template applied.
    pub tokens: Vec<i64>,
    /// Values of the dataset's extra string columns (e.g. `answer`), in column order.
    pub extra: Vec<String>,
}

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

/// Reads the prompts of a `.jsonl` or `.parquet` file: the prompt from
/// `prompt`, and each of `extra` (e.g. `answer`) as a string column.
/// Errors name the file and the line (JSONL) or row (Parquet) and the
/// column; a prompt over `limit` is an error, or left out where the limit
/// says so.
pub fn read(
    path: &std::path::Path,
    prompt: &PromptColumn,
    format: &PromptFormat,
    extra: &[String],
    limit: Option<PromptLimit>,
    tokenizer: &Tokenizer,
) -> Result<Vec<PromptRow>, StageError> {
    let mut rows = Vec::new();
    let mut records = 0usize;
    let mut left_out: Option<(usize, String)> = None;
    // A text longer than this many bytes is over the limit, whatever
    // its tokens: it is not encoded at all.
    let token_bytes = limit.map(|_| tokenizer.max_token_bytes());
    each_record(path, |where_, record| {
        records += 1;
        let missing = |c: &str| format!("{}: {where_}: column `{c}` is missing", path.display());
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
        if let Some(limit) = limit.filter(|l| tokens_of(&rendered).is_none_or(|n| n > l.tokens)) {
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
    Ok(rows)
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
#[path = "prompt_files_tests.rs"]
mod file_tests;
