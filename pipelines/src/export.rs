//! `weir export`: a rollout log's rows as the files weir's own pipelines
//! read — the best response per prompt as SFT data (rejection sampling,
//! expert iteration), the best and worst response of each group as DPO
//! pairs, or the prompts with how well they were solved (the unsolved
//! ones, say) as a prompt file.
//!
//! The rows are read with the log's row filter (`--where`), pushed down to
//! the Parquet row groups. Every exported record carries the prompt's text
//! as the log holds it and the dataset's own columns (a reference answer,
//! say), so the file reads back with the same reward. Which prompt setting
//! gives back the logged prompt tokens (the text as it is, or rendered as a
//! user message with the chat template) is found by tokenizing the first
//! prompts both ways with the log's tokenizer, and said in the report.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{ArrayRef, Float64Array, RecordBatch, StringArray, UInt64Array};
use arrow::datatypes::{DataType, Field, Schema};
use serde_json::{Map, Value};
use weir_gpu::{Message, Tokenizer};
use weir_operators::data::columns;
use weir_operators::rollout::{self, col};
use weir_operators::rollout_log::{self, RowFilter};

use crate::manifest::Manifest;
use crate::PipelineError;

/// What to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportKind {
    /// The best response of each prompt whose reward reaches the threshold:
    /// `prompt`, `response` (the target), `reward`.
    Sft,
    /// Each group's best and worst response, when the best is better by
    /// the margin: `prompt`, `chosen`, `rejected`, `chosen_reward`,
    /// `rejected_reward`.
    Dpo,
    /// Each prompt once: `prompt`, `samples`, `mean_reward`, `best_reward`
    /// (with `unsolved`, only those whose best reward misses the threshold).
    Prompts,
}

impl ExportKind {
    /// `sft`, `dpo` or `prompts`.
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "sft" => Ok(ExportKind::Sft),
            "dpo" => Ok(ExportKind::Dpo),
            "prompts" => Ok(ExportKind::Prompts),
            other => Err(format!(
                "--as {other:?}: one of sft (best responses), dpo (pairs), prompts"
            )),
        }
    }
}

/// An export.
#[derive(Clone, Debug)]
pub struct ExportRequest {
    /// A run folder, a folder of log files, or one file.
    pub source: PathBuf,
    /// What to write.
    pub kind: ExportKind,
    /// The row filter (`step >= 10 and reward > 0`; empty: every row).
    pub filter: String,
    /// The reward a response must reach (sft), or that a prompt's best
    /// response misses (prompts with `unsolved`).
    pub min_reward: f64,
    /// How much better a pair's chosen response must be (dpo; the best is
    /// always strictly better than the worst).
    pub min_margin: f64,
    /// Prompts: only those no response solved (best reward < `min_reward`).
    pub unsolved: bool,
    /// The file to write: `.jsonl` or `.parquet`; it must not exist yet.
    pub out: PathBuf,
}

/// What an export wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportReport {
    /// Log rows read (after the filter).
    pub rows_read: usize,
    /// Records written.
    pub written: usize,
    /// The keys that read the file back as the log's prompts were read
    /// (`data.prompts = "…"`, and `data.messages_column = "messages"` for
    /// the conversations a prompt file's chat template rendered, or
    /// `data.apply_chat_template = true` for text rendered as a user
    /// message); `None` when no reading gives back the logged tokens or no
    /// tokenizer was found.
    pub read_with: Option<Vec<String>>,
    /// Why `read_with` is `None`, when it is.
    pub note: Option<String>,
}

/// One logged row, as an export reads it.
struct Row {
    key: (u64, u64, u32),
    prompt_id: u64,
    group_id: u64,
    prompt: String,
    /// The conversation the chat template rendered (`prompt_messages`).
    messages: Option<Vec<Value>>,
    prompt_tokens: Vec<i64>,
    response: String,
    response_len: usize,
    reward: f64,
    /// The dataset's own columns, as `dataset` names them.
    extra: Vec<String>,
}

/// Writes `req`'s file.
pub fn export(req: &ExportRequest) -> Result<ExportReport, PipelineError> {
    let out = &req.out;
    if out.exists() {
        return Err(format!(
            "--out {}: the file exists; pick a new name (nothing was written)",
            out.display()
        )
        .into());
    }
    let format = match out.extension().and_then(|e| e.to_str()) {
        Some("jsonl") => Format::Jsonl,
        Some("parquet") => Format::Parquet,
        _ => return Err(format!("--out {}: name a .jsonl or .parquet file", out.display()).into()),
    };
    let filter = RowFilter::parse(&req.filter).map_err(|e| format!("--where: {e}"))?;
    let files = rollout_log::files_of(&req.source)?;
    let first = rollout_log::open(&files[0])?;
    let known: Vec<&str> = rollout::columns().iter().map(|c| c.0).collect();
    let reserved = [
        "response",
        "chosen",
        "rejected",
        "chosen_reward",
        "rejected_reward",
        "samples",
        "mean_reward",
        "best_reward",
        "messages",
    ];
    // The dataset's own text columns (a reference answer…), carried over.
    let dataset: Vec<String> = first
        .schema
        .fields()
        .iter()
        .filter(|f| f.data_type() == &DataType::Utf8)
        .map(|f| f.name().clone())
        .filter(|n| !known.contains(&n.as_str()) && !reserved.contains(&n.as_str()))
        .collect();
    let mut wanted = vec![
        col::STEP,
        col::PROMPT_ID,
        col::GROUP_ID,
        col::SAMPLE_IDX,
        col::PROMPT,
        col::PROMPT_MESSAGES,
        col::PROMPT_TOKENS,
        col::RESPONSE,
        col::RESPONSE_TOKENS,
        col::REWARD,
    ];
    wanted.extend(dataset.iter().map(String::as_str));
    let batches = rollout_log::read_all(std::slice::from_ref(&req.source), &filter, Some(&wanted))?;
    let mut rows = read_rows(&batches, &dataset)?;
    // Conversations are written only where every row has one (a log
    // that mixes in rows from an older one may not), so records stay alike.
    if rows.iter().any(|r| r.messages.is_none()) {
        rows.iter_mut().for_each(|r| r.messages = None);
    }
    let records = match req.kind {
        ExportKind::Sft => best_responses(&rows, &dataset, req.min_reward),
        ExportKind::Dpo => pairs(&rows, &dataset, req.min_margin),
        ExportKind::Prompts => prompts(&rows, &dataset, req.unsolved.then_some(req.min_reward)),
    };
    if records.is_empty() {
        let why = match req.kind {
            ExportKind::Sft => format!("no prompt has a response with reward ≥ {}", req.min_reward),
            ExportKind::Dpo => format!(
                "no group has responses whose rewards differ by more than {}",
                req.min_margin
            ),
            ExportKind::Prompts => format!(
                "every prompt has a response with reward ≥ {}",
                req.min_reward
            ),
        };
        return Err(format!(
            "{}: {} rows read, {why}: nothing to write to {}",
            req.source.display(),
            rows.len(),
            out.display()
        )
        .into());
    }
    let (read_with, note) = match prompt_reading(&req.source, &rows) {
        Ok(Some(reading)) => {
            let mut keys = vec![format!("data.prompts = {:?}", out.display().to_string())];
            match reading {
                Reading::Text => {}
                Reading::Chat => keys.push("data.apply_chat_template = true".into()),
                Reading::Messages => keys.push("data.messages_column = \"messages\"".into()),
            }
            if req.kind == ExportKind::Sft {
                keys.push("data.label_column = \"response\"".into());
            }
            (Some(keys), None)
        }
        Ok(None) => (
            None,
            Some("neither the prompt text as it is, nor rendered with the chat template, nor the logged conversations give the logged prompt tokens".to_string()),
        ),
        Err(why) => (None, Some(why)),
    };
    write(out, format, &records)?;
    Ok(ExportReport {
        rows_read: rows.len(),
        written: records.len(),
        read_with,
        note,
    })
}

fn read_rows(batches: &[RecordBatch], dataset: &[String]) -> Result<Vec<Row>, PipelineError> {
    let mut rows = Vec::new();
    let stage = "export";
    for b in batches {
        let steps = columns::u64s(b, col::STEP, stage)?;
        let prompt_ids = columns::u64s(b, col::PROMPT_ID, stage)?;
        let groups = columns::u64s(b, col::GROUP_ID, stage)?;
        let samples = columns::u32s(b, col::SAMPLE_IDX, stage)?;
        let prompt = columns::strings(b, col::PROMPT, stage)?;
        let mut messages = columns::prompt_conversations(b, stage)?;
        let prompt_tokens = columns::token_lists(b, col::PROMPT_TOKENS, stage)?;
        let response = columns::strings(b, col::RESPONSE, stage)?;
        let response_tokens = columns::token_lists(b, col::RESPONSE_TOKENS, stage)?;
        let reward = columns::f32s(b, col::REWARD, stage)?;
        let extra = dataset
            .iter()
            .map(|c| columns::strings(b, c, stage))
            .collect::<Result<Vec<_>, _>>()?;
        for (i, (((prompt, prompt_tokens), response), response_tokens)) in prompt
            .into_iter()
            .zip(prompt_tokens)
            .zip(response)
            .zip(response_tokens)
            .enumerate()
        {
            rows.push(Row {
                key: (steps[i], groups[i], samples[i]),
                prompt_id: prompt_ids[i],
                group_id: groups[i],
                prompt,
                messages: messages[i].take(),
                prompt_tokens,
                response,
                response_len: response_tokens.len(),
                reward: reward[i],
                extra: extra.iter().map(|c| c[i].clone()).collect(),
            });
        }
    }
    // In the order the run trained them: the earliest of equals wins.
    rows.sort_by_key(|r| r.key);
    Ok(rows)
}

/// One record of the output: named values in order.
type Record = Vec<(String, Value)>;

/// The prompt's columns of a record: its text and the dataset's columns.
fn prompt_record(row: &Row, dataset: &[String]) -> Record {
    let mut record = vec![("prompt".to_string(), Value::from(row.prompt.clone()))];
    if let Some(messages) = &row.messages {
        record.push(("messages".to_string(), Value::Array(messages.clone())));
    }
    record.extend(
        dataset
            .iter()
            .zip(&row.extra)
            .map(|(name, value)| (name.clone(), Value::from(value.clone()))),
    );
    record
}

/// The better of two responses: the higher reward, then the shorter, then
/// the earlier.
fn better<'a>(a: &'a Row, b: &'a Row) -> &'a Row {
    let rank = |r: &Row| (-r.reward, r.response_len, r.key);
    match rank(a).partial_cmp(&rank(b)) {
        Some(std::cmp::Ordering::Greater) => b,
        _ => a,
    }
}

/// Rows by `key`, in first-seen order.
fn by<K: Ord + Copy>(rows: &[Row], key: impl Fn(&Row) -> K) -> Vec<Vec<&Row>> {
    let mut order: BTreeMap<K, usize> = BTreeMap::new();
    let mut out: Vec<Vec<&Row>> = Vec::new();
    for row in rows {
        let next = out.len();
        let at = *order.entry(key(row)).or_insert(next);
        if at == out.len() {
            out.push(Vec::new());
        }
        out[at].push(row);
    }
    out
}

fn best_responses(rows: &[Row], dataset: &[String], min_reward: f64) -> Vec<Record> {
    by(rows, |r| r.prompt_id)
        .into_iter()
        .filter_map(|group| {
            let best = group.iter().copied().reduce(better)?;
            (best.reward >= min_reward).then(|| {
                let mut record = prompt_record(best, dataset);
                record.push(("response".into(), Value::from(best.response.clone())));
                record.push(("reward".into(), Value::from(best.reward)));
                record
            })
        })
        .collect()
}

fn pairs(rows: &[Row], dataset: &[String], min_margin: f64) -> Vec<Record> {
    by(rows, |r| r.group_id)
        .into_iter()
        .filter_map(|group| {
            let best = group.iter().copied().reduce(better)?;
            let worst =
                group.iter().copied().reduce(
                    |a, b| {
                        if std::ptr::eq(better(a, b), a) {
                            b
                        } else {
                            a
                        }
                    },
                )?;
            let margin = best.reward - worst.reward;
            (margin > 0.0 && margin >= min_margin).then(|| {
                let mut record = prompt_record(best, dataset);
                record.extend([
                    ("chosen".to_string(), Value::from(best.response.clone())),
                    ("rejected".to_string(), Value::from(worst.response.clone())),
                    ("chosen_reward".to_string(), Value::from(best.reward)),
                    ("rejected_reward".to_string(), Value::from(worst.reward)),
                ]);
                record
            })
        })
        .collect()
}

fn prompts(rows: &[Row], dataset: &[String], unsolved_below: Option<f64>) -> Vec<Record> {
    by(rows, |r| r.prompt_id)
        .into_iter()
        .filter_map(|group| {
            let best = group.iter().map(|r| r.reward).fold(f64::MIN, f64::max);
            let mean = group.iter().map(|r| r.reward).sum::<f64>() / group.len() as f64;
            if unsolved_below.is_some_and(|threshold| best >= threshold) {
                return None;
            }
            let mut record = prompt_record(group[0], dataset);
            record.extend([
                ("samples".to_string(), Value::from(group.len() as u64)),
                ("mean_reward".to_string(), Value::from(mean)),
                ("best_reward".to_string(), Value::from(best)),
            ]);
            Some(record)
        })
        .collect()
}

/// How an exported prompt reads back as the log's prompt tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reading {
    /// The text as it is.
    Text,
    /// The text as a user message, through the chat template.
    Chat,
    /// The logged conversation (`messages`), through the chat template.
    Messages,
}

/// How the log's prompts read back (the first 16 rows tried); `None` when
/// no reading gives the logged tokens; an error when no tokenizer is
/// known (no manifest).
fn prompt_reading(source: &Path, rows: &[Row]) -> Result<Option<Reading>, String> {
    let manifest = Manifest::find(source).map_err(|e| e.to_string())?;
    let Some((_, manifest)) = manifest else {
        return Err(format!(
            "{}: no manifest names the log's tokenizer: how the prompts read back is not checked",
            source.display()
        ));
    };
    let tokenizer = Tokenizer::load(&manifest.policy.path).map_err(|e| e.to_string())?;
    let sample: Vec<&Row> = rows.iter().take(16).collect();
    let conversations = sample.iter().all(|r| {
        r.messages.as_ref().is_some_and(|m| {
            tokenizer
                .encode_conversation(m, None, true)
                .is_ok_and(|t| t == r.prompt_tokens)
        })
    });
    if conversations {
        return Ok(Some(Reading::Messages));
    }
    let plain = sample.iter().all(|r| {
        tokenizer
            .encode(&r.prompt, true)
            .is_ok_and(|t| t == r.prompt_tokens)
    });
    if plain {
        return Ok(Some(Reading::Text));
    }
    let chat = sample.iter().all(|r| {
        let message = Message {
            role: "user".into(),
            content: r.prompt.clone(),
        };
        tokenizer
            .apply_chat_template(&[message], true)
            .and_then(|text| tokenizer.encode(&text, false))
            .is_ok_and(|t| t == r.prompt_tokens)
    });
    Ok(chat.then_some(Reading::Chat))
}

#[derive(Clone, Copy)]
enum Format {
    Jsonl,
    Parquet,
}

fn write(out: &Path, format: Format, records: &[Record]) -> Result<(), PipelineError> {
    match format {
        Format::Jsonl => {
            let mut text = String::new();
            for record in records {
                let object: Map<String, Value> = record.iter().cloned().collect();
                text.push_str(&Value::Object(object).to_string());
                text.push('\n');
            }
            Ok(weir_gpu::snapshot::write_atomically(out, text.as_bytes())?)
        }
        Format::Parquet => {
            let names: Vec<&String> = records[0].iter().map(|(n, _)| n).collect();
            let mut fields = Vec::new();
            let mut arrays: Vec<ArrayRef> = Vec::new();
            for (i, name) in names.iter().enumerate() {
                let values: Vec<&Value> = records.iter().map(|r| &r[i].1).collect();
                let (ty, array): (DataType, ArrayRef) = match values[0] {
                    Value::String(_) => (
                        DataType::Utf8,
                        Arc::new(StringArray::from_iter_values(
                            values.iter().map(|v| v.as_str().unwrap_or_default()),
                        )),
                    ),
                    Value::Array(_) => conversations(&values),
                    Value::Number(n) if n.is_u64() => (
                        DataType::UInt64,
                        Arc::new(UInt64Array::from_iter_values(
                            values.iter().map(|v| v.as_u64().unwrap_or_default()),
                        )),
                    ),
                    _ => (
                        DataType::Float64,
                        Arc::new(Float64Array::from_iter_values(
                            values.iter().map(|v| v.as_f64().unwrap_or(f64::NAN)),
                        )),
                    ),
                };
                fields.push(Field::new(name.as_str(), ty, false));
                arrays.push(array);
            }
            let batch = RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays)
                .map_err(|e| format!("{}: {e}", out.display()))?;
            Ok(weir_graph::parquet_log::write_parquet_atomically(
                out,
                &[batch],
            )?)
        }
    }
}

/// A column of conversations (JSON lists of `{role, content}`) as Parquet's
/// list of structs, the layout verl's datasets hold their chat prompts in.
fn conversations(values: &[&Value]) -> (DataType, ArrayRef) {
    use arrow::array::{Array, ListBuilder, StringBuilder, StructBuilder};
    use arrow::datatypes::Fields;
    let fields = Fields::from(vec![
        Field::new("role", DataType::Utf8, false),
        Field::new("content", DataType::Utf8, false),
    ]);
    let mut list = ListBuilder::new(StructBuilder::from_fields(fields, values.len()));
    for value in values {
        for message in value.as_array().into_iter().flatten() {
            let item = list.values();
            for (i, key) in ["role", "content"].into_iter().enumerate() {
                item.field_builder::<StringBuilder>(i)
                    .expect("two text fields")
                    .append_value(message.get(key).and_then(Value::as_str).unwrap_or_default());
            }
            item.append(true);
        }
        list.append(true);
    }
    let array = list.finish();
    (array.data_type().clone(), Arc::new(array))
}
